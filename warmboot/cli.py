"""The `warmboot` command line. Each command group lives in its own module; this file assembles them."""

from __future__ import annotations

import io
import re

import click

INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped


class Restyled(click.ClickException):
    """A ClickException printed as every warmboot error is, `error: ...` (click's own say `Error: ...`),
    with its exit status (2 for a usage error, after click's usage line and hint, which are kept)."""

    def __init__(self, cause: click.ClickException):
        super().__init__(cause.message)
        self.cause = cause
        self.exit_code = cause.exit_code

    def show(self, file=None) -> None:
        shown = io.StringIO()
        self.cause.show(shown)
        click.echo(re.sub(r"^Error: ", "error: ", shown.getvalue(), count=1, flags=re.M), file=file, err=True,
                   nl=False)


def restyled(e: click.ClickException) -> click.ClickException:
    """`e` printed `error: ...`, if it is printed by click's own `show` (warmboot's own, `Failed`, says `error:`)."""
    own = type(e).show in (click.ClickException.show, click.UsageError.show)
    return Restyled(e) if own and not isinstance(e, Restyled) else e


class Commands(click.Group):
    """The command group: every error, click's usage errors included, is printed `error: ...`
    (`Restyled`), and a Ctrl-C stops a command with "interrupted" and exit status 130, as
    shells and most tools do (click's own is "Aborted!" and 1, the status of a failed command).
    `serve`, `up` and `agent` handle SIGINT themselves once they serve (a graceful stop)."""

    def make_context(self, *args, **kwargs) -> click.Context:  # the top level's own options and arguments
        try:
            return super().make_context(*args, **kwargs)
        except KeyboardInterrupt:  # as the command starts (it was click's "Aborted!" and 1 there)
            raise interrupted() from None
        except click.ClickException as e:
            raise restyled(e) from None

    def invoke(self, ctx: click.Context):  # every subcommand: its parsing, and what it raises
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise interrupted() from None
        except click.ClickException as e:
            raise restyled(e) from None


def interrupted() -> click.exceptions.Exit:
    """What a Ctrl-C ends a command with: "interrupted" said, exit status 130."""
    click.echo("interrupted", err=True)
    return click.exceptions.Exit(INTERRUPTED_EXIT)


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
from warmboot.cmd_explain import explain  # noqa: E402
from warmboot.cmd_fragmentation import fragmentation  # noqa: E402
from warmboot.cmd_views import workers  # noqa: E402
from warmboot.cmd_whatif import whatif  # noqa: E402

main.add_command(explain)
main.add_command(fragmentation)
main.add_command(whatif)
main.add_command(workers)
from warmboot.cmd_lifecycle import actor  # noqa: E402
from warmboot.cmd_worker import worker  # noqa: E402

main.add_command(actor)
main.add_command(worker)
from warmboot.cmd_registry import agent  # noqa: E402

main.add_command(agent)
from warmboot.nats_config import nats_config  # noqa: E402

main.add_command(nats_config)
from warmboot.cmd_audit import audit  # noqa: E402

main.add_command(audit)
from warmboot.examples import attach  # noqa: E402

attach(main)  # every command's examples, after its options in --help

if __name__ == "__main__":  # `python -m warmboot.cli`, as the `warmboot` script (`python -m warmboot` too)
    main(prog_name="warmboot")
