"""`warmboot worker ...`: drain, remove and show workers (the actor commands are warmboot.cmd_lifecycle's).

`worker drain` and `worker remove` are one `warmboot.client.Client` call per id (`each_one`, as `actor
resume` of several), printed as one line each for people or, with `--json` (or `-o json`), as the replies'
JSON; a contract error is printed as `error: CODE field: message` on stderr with exit status 1.
`worker show` asks a scheduler replica what its projection has of that worker (`scheduler.worker`, a
project addition: `services.scheduler.worker_detail`), at least with all the log held when asked; when
none answers, it folds the whole log with the scheduler's projection, as `warmboot workers` does when
none answers it (a worker's free room and actors are in the actors' placements), into the same answer.
"""

from __future__ import annotations

from typing import Any

import click
import nats.errors

from events.codec import to_builtins
from events.errors import ContractError
from events.runtime_id import Runtimes
from events.schema import DrainWorker, ErrorCode, RemoveWorker, WorkerDetail
from warmboot.cli_common import (OneOrMore, ask, check_id, json_option, last_seq, nats_option, prefix_option,
                                 replay_for)
from warmboot.client import Client
from warmboot.cmd_lifecycle import done, each_one, echo, field_of, one_request_id, request_id_option, run, stamp_label
from warmboot.cmd_views import (LABELS_TIMEOUT_S, class_row, class_runtime_fields, echo_json, mib, millis, output_mode,
                                output_option, pin_label, runtime_labels, runtimes_of, unless_busy)
from warmboot.render import Column, key_values, render_fields, render_table, terminal_width


@click.group()
def worker() -> None:
    """Drain, remove and show workers."""


@worker.command("drain")
@click.argument("worker_id", nargs=-1, required=True, metavar="WORKER_ID", cls=OneOrMore)
@click.option("--reason", default=None, callback=field_of(DrainWorker, "reason"),
              help="Recorded on WorkerDrained: at most 256 printable characters.")
@request_id_option(DrainWorker)
@nats_option
@prefix_option
@json_option
def drain_cmd(worker_id: tuple[str, ...], reason: str | None, request_id: str | None, nats_url: str, prefix: str,
              as_json: bool) -> None:
    """Drain WORKER_ID (one or more): it takes no new placements and keeps what it runs.

    A drain lasts the worker's life, its agent's restarts included (as a cordoned node stays
    cordoned): to take placements again, remove it (its RUNNING actors are released) and let
    its agent register it anew. A drain of a drained worker writes nothing and prints `unchanged`.

    Several workers: each drained, a line each as it is done (16 at once); one refused is said
    on stderr and the others go on (exit status 1, the last line counting them); --json gives a
    list, each reply with its worker_id."""
    one_request_id(request_id, worker_id)
    if len(set(worker_id)) > 1:
        each_one(nats_url, prefix, "worker", worker_id, lambda wb, w: wb.drain(w, reason),
                 lambda w, reply, _: done("worker", w, "drained", reply.seq, reply.unchanged), as_json, "drained")
        return
    reply, _ = run(nats_url, prefix, False, lambda wb: wb.drain(worker_id[0], reason, request_id))
    echo(reply, as_json, lambda: done("worker", worker_id[0], "drained", reply.seq, reply.unchanged))


@worker.command("remove")
@click.argument("worker_id", nargs=-1, required=True, metavar="WORKER_ID", cls=OneOrMore)
@click.option("--reason", default=None, callback=field_of(RemoveWorker, "reason"),
              help="Recorded on WorkerRemoved: at most 256 printable characters.")
@request_id_option(RemoveWorker)
@nats_option
@prefix_option
@json_option
def remove_cmd(worker_id: tuple[str, ...], reason: str | None, request_id: str | None, nats_url: str, prefix: str,
               as_json: bool) -> None:
    """Remove WORKER_ID (one or more): its RUNNING actors are released (SUSPENDED, back to their latest
    snapshot).

    Stop the worker's agent first (`warmboot agent --drain-on-exit` drains it as it stops): an
    agent still running registers the worker again within seconds, undrained, and it takes
    placements again. The removal does not check for one; a note on stderr says so.

    Several workers: as `worker drain` of several."""
    one_request_id(request_id, worker_id)
    if len(set(worker_id)) > 1:
        try:
            each_one(nats_url, prefix, "worker", worker_id, lambda wb, w: wb.remove(w, reason),
                     lambda w, reply, _: done("worker", w, "removed", reply.seq), as_json, "removed")
        finally:
            click.echo("note: if the agents of these workers still run, they register them again within seconds, "
                       "undrained, taking placements: stop the agents (`warmboot agent --drain-on-exit` drains "
                       "each as it stops)", err=True)
        return
    reply, _ = run(nats_url, prefix, False, lambda wb: wb.remove(worker_id[0], reason, request_id))
    echo(reply, as_json, lambda: done("worker", worker_id[0], "removed", reply.seq))
    # the agent re-registers it at its next heartbeat, and the output said "removed" alone (a walkthrough)
    click.echo(f"note: if the agent of {worker_id[0]} still runs, it registers {worker_id[0]} again within seconds, "
               "undrained, taking placements: stop the agent (`warmboot agent --drain-on-exit` drains it as it "
               "stops)", err=True)


def worker_view(worker_id: str, projection: Any) -> dict:
    """One worker as the scheduler's projection has it (`worker_detail`, what a scheduler answers), its
    runtimes labelled as the projection's (`runtimes_of`): `detail_view`."""
    from services.scheduler.worker_detail import worker_detail

    return detail_view(worker_detail(projection, worker_id), runtimes_of(projection))


def detail_view(detail: WorkerDetail, runtimes: Runtimes) -> dict:
    """A worker (`worker_detail`, or a scheduler's `worker` answer) as `worker show` prints it, as JSON
    values: its rows of `warmboot workers` (one per class, as `worker_rows` makes them; `compatible` is
    their `resumes_from`, sorted), its labels, booked actors and the LOCAL images on its node, each
    runtime by its label in `runtimes`."""
    from services.scheduler.interner import Interner

    intern = Interner()  # the answer's classes as the fold's records, which the views' helpers read
    entries = intern.entries((c.sandbox_class, intern.runtime(c.sandbox_class, c.default_runtime),
                              tuple(intern.runtime(c.sandbox_class, r) for r in c.restorable_runtimes))
                             for c in detail.classes)
    held: dict[str, int] = {}  # class -> its actors booked on the worker
    for booked in detail.actors:
        held[booked.sandbox_class] = held.get(booked.sandbox_class, 0) + 1
    capacity, free = to_builtins(detail.capacity), to_builtins(detail.free)
    rows = []
    for sandbox_class, entry in entries.items():
        row = class_row(sandbox_class, entry, runtimes, worker_id=detail.worker_id, node=detail.node,
                        state=detail.state.value, capacity=capacity, free=free, actors=held.get(sandbox_class, 0),
                        worker_actors=len(detail.actors), labels=detail.labels, node_token=detail.node_token)
        row["compatible"] = sorted(row["resumes_from"])
        rows.append(row)
    rows.sort(key=lambda r: (r["sandbox_class"], r["runtime"]))
    actors = [{"actor_id": a.actor_id, "state": a.state, "booked": to_builtins(a.booked),
               "pin": pin_label(runtimes, a.pin.sandbox_class, a.pin.version, a.pin.name)} for a in detail.actors]
    local = [{"actor_id": i.actor_id, "state": i.state, "snapshot_id": i.snapshot_id, "fidelity": i.fidelity.value,
              "stamp": stamp_label(i.stamp, runtimes)} for i in detail.local_images]
    return to_builtins({"worker_id": detail.worker_id, "node": detail.node, "node_token": detail.node_token,
                        "state": detail.state,
                        "labels": dict(detail.labels), "capacity": capacity, "free": free,
                        "classes": rows, "actors": actors, "local_images": local})


async def asked_worker(nc: Any, prefix: str, worker_id: str, min_seq: int | None) -> WorkerDetail | None:
    """`worker_id` as a scheduler replica's fold has it once it includes `min_seq` (`<prefix>.scheduler.worker`,
    a project addition): one request, where the log's answer is the whole log (71,000 messages, 5.3 s, at
    10,000 workers). Its NOT_FOUND is the answer (the worker is not registered); None when no scheduler
    answers within LABELS_TIMEOUT_S, in one attempt, as `cmd_views.asked_runtimes`: none runs, one of an
    earlier version, credentials that may not ask it, or a fold that is not at `min_seq` by then."""
    try:
        client = Client(nc, prefix, timeout=LABELS_TIMEOUT_S, attempts=1)
        return await unless_busy(lambda: client.worker(worker_id, min_seq))
    except ContractError as e:
        if e.code is ErrorCode.NOT_FOUND:
            raise
        return None


ACTOR_COLUMNS = [
    Column("ACTOR", lambda a: a["actor_id"]),
    Column("STATE", lambda a: a["state"]),
    Column("CPU", lambda a: millis(a["booked"]["cpu_millis"]), right=True),
    Column("MEM", lambda a: mib(a["booked"]["memory_mib"]), right=True),
    Column("PIN", lambda a: a["pin"]),
]


LOCAL_COLUMNS = [
    Column("ACTOR", lambda a: a["actor_id"]),
    Column("STATE", lambda a: a["state"]),
    Column("SNAPSHOT", lambda a: a["snapshot_id"] or "-"),
    Column("FIDELITY", lambda a: a["fidelity"]),
    Column("STAMP", lambda a: a["stamp"]),
]


def render_worker(view: dict, width: int | None, wide: bool = False) -> str:
    cap, free = view["capacity"], view["free"]
    fields = [
        ("WORKER", view["worker_id"]),
        ("NODE", view["node"]),
        *([("NODE TOKEN", view["node_token"])] if view["node_token"] else []),
        ("STATE", view["state"]),
        ("LABELS", key_values(view["labels"])),
        ("CAPACITY", f"{millis(cap['cpu_millis'])} cpu, {mib(cap['memory_mib'])} memory"),
        ("FREE", f"{millis(free['cpu_millis'])} cpu, {mib(free['memory_mib'])} memory"),
    ]
    for row in view["classes"]:  # each runtime with its own edges, as `workers -o wide` shows them
        fields += class_runtime_fields(row, wide)
    text = render_fields(fields, None if wide else width)
    booked = render_table(ACTOR_COLUMNS, view["actors"], width, wide).text if view["actors"] else "no actors booked"
    disk = "its disk" if view["node_token"] else "this node"
    where = f"local images on {view['node']}" + (f", on the disk of node token {view['node_token']}"
                                                if view["node_token"] else "")
    local = (f"{where} (those actors resume only on {disk}):\n"
             + render_table(LOCAL_COLUMNS, view["local_images"], width, wide).text
             if view["local_images"] else f"no {where}")
    return text + "\n\n" + booked + "\n\n" + local


@worker.command("show")
@click.argument("worker_id", callback=check_id)
@nats_option
@prefix_option
@output_option
def show_worker_cmd(worker_id: str, nats_url: str, prefix: str, output: str | None, as_json: bool) -> None:
    """WORKER_ID's node, state, labels, capacity and free room, runtimes per class (DEFAULT,
    RESTORABLE, and RESUMES FROM: the versions its compatible_versions edges accept, as
    `warmboot workers -o wide` shows them), the actors booked on it, and the waiting actors whose LOCAL
    image is on its node (they resume only there: suspend them before draining its last worker). As a
    scheduler replica's fold has it, at least with all the log held when asked; the whole log folded
    with the scheduler's projection when no scheduler answers."""
    from warmboot.audit import Sink

    mode = output_mode(output, as_json)

    async def work(nc: Any) -> dict:
        try:
            target: int | None = await last_seq(nc, prefix, LABELS_TIMEOUT_S)
        except (click.ClickException, ContractError, nats.errors.Error):
            target = None  # credentials that may not read the log (a client's) ask for what the fold has
        detail = await asked_worker(nc, prefix, worker_id, target or None)
        if detail is not None:
            return detail_view(detail, await runtime_labels(nc, prefix))
        sink = await replay_for(nc, prefix, f"worker.{worker_id}", Sink(), mode != "json")
        return worker_view(worker_id, sink.projection)

    view = ask(nats_url, work)
    if mode == "json":
        echo_json(view)
        return
    click.echo(render_worker(view, terminal_width(), mode == "wide"))
