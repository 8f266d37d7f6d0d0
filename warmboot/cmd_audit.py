"""`warmboot audit`: replay the log to any point, print an actor's timeline, verify invariants."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import click
from rich.console import Console
from rich.table import Table

from events.schema import ActorPlaced, SnapshotTaken
from events.subjects import event_subject
from warmboot.audit import Sink, summary
from warmboot.cli_common import ask, json_option, nats_option, prefix_option, read_subject, replay, version_text

console = Console()


@click.group()
def audit() -> None:
    """Audit by replay: the log is the only source of truth."""


@audit.command("replay")
@click.option("--until", "until_seq", type=click.IntRange(min=1), default=None, help="Last sequence to fold.")
@click.option("--until-time", type=click.DateTime(formats=["%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M:%S.%f"]),
              default=None, help="Fold events up to this UTC time (YYYY-MM-DDTHH:MM:SS).")
@nats_option
@prefix_option
@json_option
def replay_cmd(until_seq: int | None, until_time: datetime | None, nats_url: str, prefix: str,
               as_json: bool) -> None:
    """Rebuild the scheduler's projection at a point of the log and print its summary."""
    if until_seq is not None and until_time is not None:
        raise click.UsageError("give --until or --until-time, not both")
    bound = until_time.replace(tzinfo=timezone.utc) if until_time else None
    sink = ask(nats_url, lambda nc: replay(nc, prefix, Sink(until_seq, bound), not as_json))
    result = summary(sink.projection)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    console.print(f"folded {result['events']} events up to sequence {result['seq']}")
    table = Table(title="projection")
    table.add_column("what")
    table.add_column("count", justify="right")
    for state, n in result["workers"].items():
        table.add_row(f"workers {state}", str(n))
    for state, n in result["actors"].items():
        table.add_row(f"actors {state}", str(n))
    table.add_row("stranded memory snapshots", str(result["stranded_snapshots"]))
    console.print(table)


@audit.command("verify")
@nats_option
@prefix_option
def verify_cmd(nats_url: str, prefix: str) -> None:
    """Replay the whole log and check the invariants; exit 1 at the first violation."""
    sink = ask(nats_url, lambda nc: replay(nc, prefix, Sink(verify=True), True))
    if sink.violation is not None:
        click.echo(f"violation at {sink.violation}", err=True)
        raise SystemExit(1)
    click.echo(f"ok: {sink.events} events up to sequence {sink.seq}, no violation")


@audit.command("actor")
@click.argument("actor_id")
@nats_option
@prefix_option
@json_option
def actor_cmd(actor_id: str, nats_url: str, prefix: str, as_json: bool) -> None:
    """Print ACTOR_ID's timeline: every event with stamp, pin, fidelity, fallback and worker."""

    subject = event_subject(prefix, "actor", actor_id)
    records = ask(nats_url, lambda nc: read_subject(nc, prefix, subject))
    if not records:
        raise click.ClickException(f"no events for actor {actor_id}")
    rows = [timeline_row(seq, event) for seq, event in records]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(title=f"actor {actor_id}")
    for col in ("seq", "at", "event", "worker", "fidelity", "fallback", "stamp / pin"):
        table.add_column(col)
    for row in rows:
        table.add_row(str(row["seq"]), row["at"], row["event"], row["worker"] or "", row["fidelity"] or "",
                      row["fallback"] or "", row["runtime"] or "")
    console.print(table)


def timeline_row(seq: int, event) -> dict:
    row = {"seq": seq, "at": event.at.isoformat(), "event": type(event).__name__, "worker": None,
           "fidelity": None, "fallback": None, "runtime": None}
    if isinstance(event, ActorPlaced):
        row.update(worker=event.worker_id, fidelity=event.fidelity.value,
                   fallback=event.fallback.reason.value if event.fallback else None,
                   runtime="pin " + version_text(event.sandbox_runtime.version))
    elif isinstance(event, SnapshotTaken):
        snap = event.snapshot
        row.update(event=f"SnapshotTaken {event.origin.value}", fidelity=snap.fidelity.value,
                   runtime="stamp " + version_text(snap.sandbox_runtime.version) if snap.sandbox_runtime else None)
    elif hasattr(event, "worker_id"):
        row["worker"] = event.worker_id
    return row
