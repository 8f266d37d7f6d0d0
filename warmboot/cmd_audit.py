"""`warmboot audit`: replay the log to any point, print an actor's timeline, verify invariants."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import click

from events.codec import to_builtins
from events.errors import not_found
from events.runtime_id import Runtimes
from events.schema import (
    Action,
    ActorCreated,
    ActorPlaced,
    ActorReleased,
    ActorReverted,
    ActorRuntime,
    Snapshot,
    SnapshotTaken,
    TemplateChanged,
)
from events.subjects import event_subject
from warmboot.audit import CHANGE_UNREGISTERED, PLACEMENT_RULES, RELEASE_RULES, STAMP_RULES, Sink, summary
from warmboot.cli_common import (Failed, IntRange, ask, check_id, json_option, nats_option, prefix_option, read_subject,
                                 replay)
from warmboot.cmd_views import echo_json, echo_table, fleet_runtimes, output_mode, output_option, pin_label
from warmboot.render import Column, render_fields, render_table, terminal_width


def utc_time(value: str | None) -> datetime | None:
    """An ISO 8601 time or date as an aware UTC datetime (UTC when it names no offset); a usage
    error naming the option otherwise."""
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an ISO 8601 time (e.g. 2026-12-03T10:00:00Z)",
                                 param_hint="'--until-time'") from None
    return when.replace(tzinfo=timezone.utc) if when.tzinfo is None else when.astimezone(timezone.utc)


@click.group()
def audit() -> None:
    """Audit by replay: the log is the only source of truth."""


@audit.command("replay")
@click.option("--until", "until_seq", type=IntRange(min=1), default=None, help="Last sequence to fold.")
@click.option("--until-time", callback=lambda ctx, param, value: utc_time(value), default=None, metavar="TIME",
              help="Fold events up to this time: ISO 8601 (2026-12-03T10:00:00Z, +01:00, a bare date), UTC "
                   "unless it names an offset.")
@nats_option
@prefix_option
@json_option
def replay_cmd(until_seq: int | None, until_time: datetime | None, nats_url: str, prefix: str,
               as_json: bool) -> None:
    """Rebuild the scheduler's projection at a point of the log and print its summary.

    An --until-time before the log's first event folds nothing: the summary of an empty
    projection, exit status 0, and a note on stderr giving the time of that first event. An --until
    or --until-time past the log's end folds it all, and a note on stderr says where it ended."""
    if until_seq is not None and until_time is not None:
        raise click.UsageError("give --until or --until-time, not both")
    bound = until_time
    sink = ask(nats_url, lambda nc: replay(nc, prefix, Sink(until_seq, bound), not as_json))
    result = summary(sink.projection)
    if until_time is not None and sink.stopped_at_time is not None and sink.events == 0:  # on stderr: JSON stays
        click.echo(f"note: --until-time {to_builtins(until_time)} is before the log's first event (sequence "
                   f"{sink.stopped_at}, at {to_builtins(sink.stopped_at_time)}): nothing folded", err=True)
    if until_time is not None and sink.stopped_at is None and sink.last_at is not None:  # nothing left out
        click.echo(f"note: --until-time {to_builtins(until_time)} is past the log's last event (sequence {sink.seq}, "
                   f"its last event at {to_builtins(sink.last_at)}): folded to its end", err=True)
    if until_seq is not None and sink.seq < until_seq:  # said as the --until-time before the start is (a trial)
        click.echo(f"note: --until {until_seq} is past the log's end (sequence {sink.seq}): folded to its end",
                   err=True)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"folded {result['events']} events up to sequence {result['seq']}")
    pairs = [(f"workers {state}", str(n)) for state, n in result["workers"].items()]
    pairs += [(f"actors {state}", str(n)) for state, n in result["actors"].items()]
    pairs.append(("stranded memory snapshots", str(result["stranded_snapshots"])))
    pairs.append(("local snapshots on no registered worker's node or disk (lost)", str(result["lost_local_snapshots"])))
    click.echo(render_fields(pairs))


@audit.command("verify", help="Replay the whole log and check the invariants; exit 1 at the first violation."
               "\n\nA violation is reported with its sequence and one of these names. At each placement "
               "(ActorPlaced):\n\n\b\n" + "\n".join(f"- {rule}" for rule in PLACEMENT_RULES) + "\n\n"
               "At each snapshot an actor takes, copies or goes back to (SnapshotTaken, TagRecorded, "
               "ActorCreated, ActorReverted; CONTRACT's stamping rules):\n\n\b\n"
               + "\n".join(f"- {rule}" for rule in STAMP_RULES) + "\n\n"
               f"At each ActorReleased: {'; '.join(RELEASE_RULES)}. At each RuntimeChanged: {CHANGE_UNREGISTERED}.")
@nats_option
@prefix_option
def verify_cmd(nats_url: str, prefix: str) -> None:
    sink = ask(nats_url, lambda nc: replay(nc, prefix, Sink(verify=True), True))
    if sink.violation is not None:
        click.echo(f"violation at {sink.violation}", err=True)
        raise SystemExit(1)
    click.echo(f"ok: {sink.events} events up to sequence {sink.seq}, no violation")


@audit.command("actor")
@click.argument("actor_id", callback=check_id)
@nats_option
@prefix_option
@output_option
def actor_cmd(actor_id: str, nats_url: str, prefix: str, output: str | None, as_json: bool) -> None:
    """Print ACTOR_ID's timeline: every event with stamp, pin, fidelity, fallback and worker."""

    as_json = output_mode(output, as_json) == "json"  # a usage error before anything is read

    subject = event_subject(prefix, "actor", actor_id)

    async def work(nc):
        records = await read_subject(nc, prefix, subject)
        return records, (None if as_json or not records else await fleet_runtimes(nc, prefix))

    records, runtimes = ask(nats_url, work)
    if not records:
        raise Failed(not_found(f"no events for actor {actor_id!r}", "actor_id"))
    rows = [timeline_row(seq, event) for seq, event in records]
    if as_json:  # each runtime with its `rt-` id beside its version, as every view's JSON has it
        echo_json(rows)
        return
    width = terminal_width()
    shown = list(zip(rows, timeline_labels([event for _, event in records], runtimes)))
    echo_table(render_table(TIMELINE_COLUMNS, shown, width, output == "wide"), width)


def _stamped(event) -> tuple[str, ActorRuntime] | None:
    """The pin of a placement, or the stamp of a snapshot, in a timeline's event."""
    if isinstance(event, ActorPlaced):
        return "pin", event.sandbox_runtime
    if isinstance(event, SnapshotTaken) and event.snapshot.sandbox_runtime is not None:
        return "stamp", event.snapshot.sandbox_runtime
    return None


def timeline_labels(events: list, runtimes: Runtimes) -> list[str]:
    """The stamp or pin of each event by its short label, as `workers` and `explain` show runtimes
    (`name`, `name@3f9a1c` or `rt-3f9a1c`), told apart among the fleet's runtimes and every one the
    timeline names: two runtimes of one name read alike once the fleet runs only one of them (found
    by a walkthrough: the pins of two CPU generations, the older one dropped, read the same). One
    the fleet no longer runs (as a default or restorable runtime; an edge that accepts it is not
    running it) is always `name@3f9a1c`: another actor's timeline may name another runtime of that
    name, which this one does not know of (a second walkthrough; a review found the edge case)."""
    stamped = [_stamped(event) for event in events]
    for found in stamped:
        if found is not None:  # known, not run (an edge only accepts it), unless a worker runs it
            runtimes.add(found[1].sandbox_class, found[1].version, found[1].name)
    return ["" if found is None else
            f"{found[0]} {pin_label(runtimes, found[1].sandbox_class, found[1].version, found[1].name)}"
            for found in stamped]


TIMELINE_COLUMNS = [
    Column("SEQ", lambda r: str(r[0]["seq"]), right=True),
    Column("AT", lambda r: r[0]["at"][:19] + "Z", drop=3),  # to the second (the log is in order), in UTC
    Column("EVENT", lambda r: r[0]["event"]),
    Column("WORKER", lambda r: r[0]["worker"] or ""),
    Column("FIDELITY", lambda r: r[0]["fidelity"] or "", drop=2),
    Column("FALLBACK", lambda r: r[0]["fallback"] or "", drop=1),
    Column("RUNTIME", lambda r: r[1]),
    Column("DETAIL", lambda r: r[0]["detail"] or "", drop=4),
]


def _where(snapshot: Snapshot) -> str:
    return f"{snapshot.snapshot_id} ({snapshot.location.value}{' on ' + snapshot.node if snapshot.node else ''})"


def timeline_detail(event) -> str | None:
    """What else an event of a timeline says, in a few words: the snapshots it takes, restores or
    gives up, the template it names, why it released."""
    if isinstance(event, ActorCreated):
        golden = f", from snapshot {_where(event.snapshot)}" if event.snapshot is not None else ""
        return f"template {event.template_uid}{golden}"
    if isinstance(event, TemplateChanged):
        return f"template {event.template_uid}"
    if isinstance(event, SnapshotTaken):
        return f"snapshot {_where(event.snapshot)}"
    if isinstance(event, ActorPlaced):
        if event.action is Action.RESTORE:
            return f"restore {event.snapshot_id}"
        return f"run (snapshot {event.snapshot_id} not restored)" if event.snapshot_id else "cold boot"
    if isinstance(event, ActorReleased):
        return event.reason.value.lower().replace("_", " ")
    if isinstance(event, ActorReverted):
        to = f"to snapshot {_where(event.snapshot)}" if event.snapshot is not None else "to a cold boot"
        return f"{to}, gave up {_where(event.abandoned)}"
    return None


def timeline_row(seq: int, event) -> dict:
    """One event of a timeline as `-o json` prints it: times and runtimes as the wire has them
    (`runtime`: the pin of a placement or the stamp of a snapshot, which `runtime_role` says)."""
    row = {"seq": seq, "at": to_builtins(event.at), "event": type(event).__name__, "worker": None,
           "fidelity": None, "fallback": None, "runtime": None, "runtime_role": None,
           "detail": timeline_detail(event)}
    if isinstance(event, ActorPlaced):
        row.update(worker=event.worker_id, fidelity=event.fidelity.value,
                   fallback=event.fallback.reason.value if event.fallback else None)
    elif isinstance(event, SnapshotTaken):
        row.update(event=f"SnapshotTaken {event.origin.value}", fidelity=event.snapshot.fidelity.value)
    elif hasattr(event, "worker_id"):
        row["worker"] = event.worker_id
    stamped = _stamped(event)
    if stamped is not None:
        row.update(runtime_role=stamped[0], runtime=to_builtins(stamped[1]))
    return row
