"""The `warmboot` command line. Each command group lives in its own module; this file assembles them."""

from __future__ import annotations

import click

INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped


class Commands(click.Group):
    """The command group, whose commands a Ctrl-C stops with "interrupted" and exit status 130, as
    shells and most tools do (click's own is "Aborted!" and 1, the status of a failed command).
    `serve`, `up` and `agent` handle SIGINT themselves once they serve (a graceful stop)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            raise click.exceptions.Exit(INTERRUPTED_EXIT) from None


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="warmboot")
def main() -> None:
    """warmboot: place snapshot resumes on workers whose runtime can load them."""


# Commands are registered below, one line per module.
from warmboot.cmd_serve import serve  # noqa: E402

main.add_command(serve)
from warmboot.cmd_up import up  # noqa: E402

main.add_command(up)
from warmboot.cmd_foundation import probe, schema  # noqa: E402

main.add_command(probe)
main.add_command(schema)
from warmboot.cmd_views import explain, fragmentation, whatif, workers  # noqa: E402

main.add_command(explain)
main.add_command(fragmentation)
main.add_command(whatif)
main.add_command(workers)
from warmboot.cmd_lifecycle import actor, worker  # noqa: E402

main.add_command(actor)
main.add_command(worker)
from warmboot.cmd_registry import agent  # noqa: E402

main.add_command(agent)
from warmboot.nats_config import nats_config  # noqa: E402

main.add_command(nats_config)
from warmboot.cmd_audit import audit  # noqa: E402

main.add_command(audit)

if __name__ == "__main__":  # `python -m warmboot.cli`, as the `warmboot` script (`python -m warmboot` too)
    main(prog_name="warmboot")
