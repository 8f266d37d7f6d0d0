"""`python -m warmboot`: the `warmboot` command, from a checkout or an environment without its script."""

from warmboot.cli import main

main(prog_name="warmboot")
