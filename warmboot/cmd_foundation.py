"""`warmboot probe` and `warmboot schema`: what a worker reports, and the wire contract for other languages."""

from __future__ import annotations

import json
from pathlib import Path

import click

from events.codec import encode
from events.probe import (
    ARCHITECTURES,
    DEFAULT_CPUINFO,
    PROFILES,
    ProbeError,
    check_architecture,
    host_architecture,
    probe_version,
    read_cpuinfo,
)
from warmboot.cli_common import check_given_file


def _parse_attr(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise click.BadParameter(f"{text!r} is not KEY=VALUE", param_hint="'--attr'")
    return key, value


@click.command("probe")
@click.option("--profile", type=click.Choice(list(PROFILES)), required=True, help="Which attributes to probe.")
@click.option(
    "--cpuinfo",
    "cpuinfo_path",
    type=click.Path(path_type=Path),
    default=DEFAULT_CPUINFO,
    show_default=True,
    callback=check_given_file,
    help="cpuinfo file to read; one given must be a readable file (a usage error otherwise). Without the "
         "option, a machine with no /proc/cpuinfo reports the architecture alone.",
)
@click.option("--arch", type=click.Choice(ARCHITECTURES), default=None,
              help="Architecture [default: this machine's]; a cpuinfo of the other one is an error.")
@click.option(
    "--attr",
    "attrs",
    multiple=True,
    metavar="KEY=VALUE",
    help="Extra attribute, e.g. a runtime asset digest; repeatable.",
)
def probe(profile: str, cpuinfo_path: Path, arch: str | None, attrs: tuple[str, ...]) -> None:
    """Print this worker's CompatVersion (schema v1) as JSON.

    gvisor reports architecture and cpu_features; microvm reports architecture,
    cpu_vendor and cpu_model (CONTRACT section 2).
    """
    extra = [_parse_attr(a) for a in attrs]
    try:
        architecture = arch or host_architecture()
        cpuinfo = read_cpuinfo(cpuinfo_path)
        check_architecture(cpuinfo, architecture, str(cpuinfo_path))
        version = probe_version(cpuinfo, architecture, profile, extra)
    except ProbeError as e:
        raise click.ClickException(str(e)) from None
    found = {a.key for a in version.attributes}
    cpu_keys = [key for key in PROFILES[profile] if key != "architecture"]
    missing = [key for key in cpu_keys if key not in found]
    if missing:  # a mistyped --cpuinfo reads as a machine without CPU attributes: said, not passed off
        named_none = len(missing) == len(cpu_keys)
        click.echo(f"warning: {cpuinfo_path} gave no {', '.join(missing)} (missing, unreadable, or not a cpuinfo "
                   "file?)" + (": this version names no CPU, and an agent refuses such a runtime unless it is "
                               "marked cpu_masked" if named_none else ""), err=True)
    click.echo(encode(version).decode())


@click.command("schema")
@click.option("--check", "body_path", type=click.Path(exists=True, dir_okay=False, path_type=Path, allow_dash=True),
              default=None, metavar="BODY.json", help="Validate this body (- for standard input) instead of printing.")
@click.option("--as", "name", default=None, metavar="NAME",
              help="The body's type: a request, reply or event name, AnyRequest, AnyReply, AnyEvent, or an "
                   "object inside bodies (e.g. Snapshot, the file of `actor create --golden-snapshot`).")
@click.option("--strict", is_flag=True,
              help="With --check: a key the type has no field for fails the check (exit 1), as `actor create "
                   "--golden-snapshot` refuses it (a misspelt key); without it, such keys are listed in a note, "
                   "since a reader ignores them on the wire (a newer writer may add fields).")
def schema(body_path: Path | None, name: str | None, strict: bool) -> None:
    """Print the JSON Schema (2020-12) of every request, reply and event body.

    With --check BODY.json --as NAME, validate a body instead: against the JSON Schema
    (the PyPI jsonschema package) and with warmboot's own decoder, each verdict
    printed with the JSON path of every error; exits 1 if either rejects the body
    (or, with --strict, if it holds a key the type has no field for).
    """
    from events.jsonschema import json_schema

    if body_path is None:
        for given, option in ((name, "--as"), (strict or None, "--strict")):
            if given is not None:
                raise click.UsageError(f"{option} goes with --check BODY.json")
        click.echo(json.dumps(json_schema(), indent=2))
        return
    from warmboot.schema_check import check_body

    if name is None:
        raise click.UsageError("--check needs --as NAME (the body's type)")
    data = click.open_file(str(body_path), "rb").read()
    report = check_body(name, data, strict)
    click.echo(report.text())
    if not report.valid:
        raise SystemExit(1)
