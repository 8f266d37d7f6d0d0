"""`warmboot probe` and `warmboot schema`: what a worker reports, and the wire contract for other languages."""

from __future__ import annotations

import json
from pathlib import Path

import click

from events.codec import encode, json_schemas
from events.probe import (
    ARCHITECTURES,
    DEFAULT_CPUINFO,
    PROFILES,
    ProbeError,
    host_architecture,
    probe_version,
    read_cpuinfo,
)


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
    help="cpuinfo file to read; a missing file reports the architecture alone.",
)
@click.option("--arch", type=click.Choice(ARCHITECTURES), default=None, help="Architecture [default: this machine's].")
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
        version = probe_version(read_cpuinfo(cpuinfo_path), architecture, profile, extra)
    except ProbeError as e:
        raise click.ClickException(str(e)) from None
    click.echo(encode(version).decode())


@click.command("schema")
def schema() -> None:
    """Print the JSON Schema of every request, reply and event body."""
    click.echo(json.dumps(json_schemas(), indent=2, sort_keys=False))
