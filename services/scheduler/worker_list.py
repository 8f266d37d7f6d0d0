"""The registered workers of the fold, a page at a time (`<prefix>.scheduler.workers`, a project addition).

What `warmboot workers` shows: every worker of the projection (drained ones included), by id, with
what its rows need (one row per class: `warmboot.cmd_views.class_row`): node, state, labels, capacity,
free room, its classes (`WorkerSandboxClass`, as `worker_detail` puts them on the wire) and the actors
booked on it, per class and in all. The CLI folded the whole log for it (71,000 messages, 3.8 s at
10,000 workers: docs/scaling.md); the scheduler's fold has it already. The same function answers the
endpoint and the CLI's own fold when no scheduler answers, so the two never disagree. Pure: no I/O
(a cache per projection, of its fold position, is all it keeps).

Cost: the workers' ids in order and the count of each worker's booked actors per class (one pass
over the actors, as `worker_rows` made it for every worker at once) are made once per fold position
(`Projection.seq`) and kept for the next pages asked at it: a walk of every page at one `min_seq`
makes them once, unless events arrive meanwhile (docs/scaling.md measures both). A page's cursor is
given only when a worker that passes the filter follows it (`paging.Ahead`: the next page starts
where that one was found).
"""

from __future__ import annotations

import weakref
from typing import Any

from events.codec import encode
from events.schema import (WORKERS_CLASSES_MAX, WORKERS_PAGE_BYTES, Resources, Room, WorkerPage, WorkersQuery,
                           WorkerSandboxClass, WorkerSummary)
from services.scheduler.paging import Ahead
from services.scheduler.whatif import registered_classes
from services.scheduler.worker_detail import wire_runtime


class _Position:
    """What the pages of one fold position share: the worker ids in order, and the booked actors per
    (worker record, class)."""

    __slots__ = ("seq", "ids", "held", "ahead")

    def __init__(self, seq: int, ids: list[str], held: dict[tuple[int, str], int]) -> None:
        self.seq, self.ids, self.held = seq, ids, held
        self.ahead = Ahead()  # where the pages' cursors lead (`paging.Ahead`)


_CACHE: weakref.WeakKeyDictionary[Any, _Position] = weakref.WeakKeyDictionary()


def booked_per_class(projection: Any) -> dict[tuple[int, str], int]:
    """(id of a worker's record, class) -> the actors of that class booked on it: one pass over the
    actors for every worker (as `Projection.booked_on` names them)."""
    held: dict[tuple[int, str], int] = {}
    for a in projection.actors.values():
        if a.worker is not None:
            key = (id(a.worker), a.sandbox_class)
            held[key] = held.get(key, 0) + 1
    return held


def _position(projection: Any) -> _Position:
    cached = _CACHE.get(projection)
    if cached is None or cached.seq != projection.seq:
        cached = _CACHE[projection] = _Position(projection.seq, sorted(projection.workers),
                                                booked_per_class(projection))
    return cached


def worker_summary(worker: Any, held: dict[tuple[int, str], int], classes: set[str] | None = None) -> WorkerSummary:
    """A worker's record of the fold as `warmboot workers` needs it (`held`: `booked_per_class`);
    with `classes`, those of its classes alone."""
    entries = [(name, entry) for name, entry in worker.classes.items() if classes is None or name in classes]
    return WorkerSummary(
        worker_id=worker.worker_id, node=worker.node, node_token=worker.token, state=worker.state,
        labels=dict(worker.labels),
        capacity=Resources(cpu_millis=worker.cpu_millis, memory_mib=worker.memory_mib),
        free=Room(cpu_millis=worker.room_cpu, memory_mib=worker.room_mem),
        classes=[WorkerSandboxClass(sandbox_class=name, default_runtime=wire_runtime(entry.default),
                                    restorable_runtimes=tuple(map(wire_runtime, entry.restorable)))
                 for name, entry in entries],
        class_actors={name: held.get((id(worker), name), 0) for name, _ in entries},
        actors=worker.holding)


def worker_page(projection: Any, query: WorkersQuery) -> WorkerPage:
    """The page of `query`: the registered workers after `query.after` in id order that run one of its
    classes (all, without), at most `query.limit`, and at most WORKERS_PAGE_BYTES of them (always one,
    if one is left: events/schema.py says why a page then fits NATS's max_payload); `next_after` the
    last one's id if a worker that runs one of the classes follows it (`paging.Ahead.cursor`), else
    None. The first page (no `after`) also says which classes asked no registered worker runs, and the
    classes they run (`WorkerPage`)."""
    cached = _position(projection)
    ids, workers = cached.ids, projection.workers
    classes = set(query.sandbox_classes) or None

    def passes(worker_id: str) -> bool:
        return classes is None or not classes.isdisjoint(workers[worker_id].classes)

    filters = query.sandbox_classes
    at = (projection.seq, projection.events)
    start = cached.ahead.start(ids, at, query.after, filters)
    rows: list[WorkerSummary] = []
    size = 0
    index = start
    while index < len(ids) and len(rows) < query.limit:
        if not passes(ids[index]):
            index += 1
            continue
        worker = workers[ids[index]]
        row = worker_summary(worker, cached.held, classes)
        grown = size + len(encode(row))
        if rows and grown > WORKERS_PAGE_BYTES:
            break
        rows.append(row)
        size = grown
        index += 1
    unknown_classes: list[str] = []
    run: list[str] = []
    if query.after is None:
        unknown_classes = [c for c in dict.fromkeys(query.sandbox_classes) if not projection.registered(c)]
        run = registered_classes(projection)[:WORKERS_CLASSES_MAX]
    next_after = cached.ahead.cursor(ids, index, rows[-1].worker_id if rows else None, at,
                                     filters, passes)
    return WorkerPage(workers=rows, next_after=next_after,
                      unknown_classes=unknown_classes, classes=run)
