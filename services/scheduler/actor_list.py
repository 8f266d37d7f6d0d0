"""The actors of the fold, a page at a time (`<prefix>.scheduler.actors`, a project addition).

What `warmboot actor list` shows: one row per actor (stopped ones included), by id, filtered as
its options say (a filter given more than one value takes any of them; different filters all
apply). The CLI folded the whole log for it, every worker's history included (at 10,000 workers
and 360 actors, 71,000 messages, 4.3 s: docs/scaling.md); the scheduler's fold has it already.
The same function answers the endpoint and the CLI's own fold when no scheduler answers, so the
two never disagree. Pure: no I/O (a cache of the sorted ids, per projection, is all it keeps).

Cost: the ids in order are kept per projection and brought up to date when actors are added
(the projection never drops one: a STOPPED actor stays, and a create of its id again replaces its
record in place), so a page is a bisection and the rows it scans (all of them, at worst, for a
filter that matches few), not a sort of every id (docs/scaling.md measures both). A page's cursor is
given only when an actor that passes the filters follows it (`paging.Ahead`: the next page starts
where that one was found).
"""

from __future__ import annotations

import weakref
from bisect import insort
from itertools import islice
from typing import Any

from msgspec.structs import replace

from events.codec import encode
from events.compat import CompatKey
from events.schema import (
    ACTORS_CLASSES_MAX,
    ACTORS_PAGE_BYTES,
    ActorPage,
    ActorRuntime,
    ActorSnapshotSummary,
    ActorsQuery,
    ActorSummary,
    Location,
)
from services.scheduler.paging import Ahead
from services.scheduler.places import node_of


def actor_summary(actor: Any, projection: Any) -> ActorSummary:
    """One actor's record of the fold (`projection`'s) as a row of `actor list`
    (`warmboot.cmd_lifecycle.actor_view` without its labels and history count)."""
    kind = actor.snapshot
    snapshot = None if kind is None else ActorSnapshotSummary(
        snapshot_id=actor.snapshot_id, template_uid=kind.template_uid, fidelity=kind.fidelity,
        location=Location.LOCAL if kind.local else Location.EXTERNAL,
        node=node_of(actor.image_node) if actor.image_node else None,
        borrowed=kind.borrowed, stamp=kind.stamp.runtime if kind.stamp is not None else None,
        lost=projection.image_lost(actor))
    worker, pin = actor.worker, actor.pin
    return ActorSummary(
        actor_id=actor.actor_id, state=actor.state, sandbox_class=actor.sandbox_class,
        template_uid=actor.template_uid, resources=actor.resources, selectors=dict(actor.selectors),
        min_fidelity=actor.min_fidelity, snapshot=snapshot,
        worker_id=worker.worker_id if worker is not None else None, node=node_of(actor.node) if actor.node else None,
        pin=pin.runtime if pin is not None else None, booked=actor.booked, last_seq=actor.last_seq)


class _Sorted:
    """A projection's actor ids in order, as of `count` actors (the dict's first `count` keys)."""

    __slots__ = ("ids", "count", "seq", "names", "ahead")

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.count = 0
        self.seq = -1  # the fold's position `names` is of
        self.names: dict[CompatKey, str] = {}  # compat key -> the least name a stamp or pin gives it
        self.ahead = Ahead()  # where the pages' cursors lead (`paging.Ahead`)


def _cached(projection: Any) -> _Sorted:
    cached = _CACHE.get(projection)
    if cached is None:
        cached = _CACHE[projection] = _Sorted()
    return cached


_CACHE: weakref.WeakKeyDictionary[Any, _Sorted] = weakref.WeakKeyDictionary()
RESORT_FROM = 64  # new actors at most inserted one by one; more: the ids are sorted again


def sorted_ids(projection: Any) -> list[str]:
    """The ids of `projection.actors` in order. Actors are only ever added (insertion order is
    the dict's): the ones added since the last call are inserted, or, many, all are sorted again."""
    cached = _cached(projection)
    actors = projection.actors
    if len(actors) != cached.count:
        if len(actors) < cached.count or len(actors) - cached.count > RESORT_FROM:
            cached.ids = sorted(actors)
        else:
            for actor_id in islice(actors, cached.count, None):
                insort(cached.ids, actor_id)
        cached.count = len(actors)
    return cached.ids


def _stamp_names(projection: Any) -> dict[CompatKey, str]:
    """Compat key -> the least name the fold's stamps and pins give it (as `warmboot.cmd_views.runtimes_of`
    stamps them), kept per fold position."""
    cached = _cached(projection)
    if cached.seq != projection.seq:
        names: dict[CompatKey, str] = {}
        for a in projection.actors.values():
            for stamp in (a.snapshot.stamp if a.snapshot is not None else None, a.pin):
                if stamp is not None and stamp.runtime.name:
                    key, name = stamp.compat.key, stamp.runtime.name
                    if key not in names or name < names[key]:
                        names[key] = name
        cached.names, cached.seq = names, projection.seq
    return cached.names


def actor_page(projection: Any, query: ActorsQuery) -> ActorPage:
    """The page of `query`: the actors after `query.after` in id order that pass its filters, at
    most `query.limit`, and at most ACTORS_PAGE_BYTES of them (always one, if one is left; events/
    schema.py says why a page then fits NATS's max_payload); `next_after` the last one's id if an
    actor that passes the filters follows it (`paging.Ahead.cursor`), else None. The first page (no `after`) also says which classes and workers asked match
    nothing the fold has (`ActorPage`)."""
    actors = projection.actors
    classes, states, worker_ids = set(query.sandbox_classes), set(query.states), set(query.worker_ids)

    def passes(actor_id: str) -> bool:
        a = actors[actor_id]
        worker = a.worker
        return not ((classes and a.sandbox_class not in classes) or (states and a.state not in states)
                    or (worker_ids and (worker is None or worker.worker_id not in worker_ids)))

    ids = sorted_ids(projection)
    ahead = _cached(projection).ahead
    position = (projection.seq, projection.events)
    filters = (query.sandbox_classes, query.states, query.worker_ids)
    start = ahead.start(ids, position, query.after, filters)
    rows: list[ActorSummary] = []
    stamp_names: list[ActorRuntime] = []
    named: set[CompatKey] = set()
    size = 0
    index = start
    while index < len(ids) and len(rows) < query.limit:
        if not passes(ids[index]):
            index += 1
            continue
        a = actors[ids[index]]
        row = actor_summary(a, projection)
        extra = []  # the least names of the runtimes it names without one, not named on this page yet
        for stamp in (a.snapshot.stamp if a.snapshot is not None else None, a.pin):
            if stamp is not None and not stamp.runtime.name and stamp.compat.key not in named:
                name = _stamp_names(projection).get(stamp.compat.key)
                if name is not None:
                    extra.append((stamp.compat.key, replace(stamp.runtime, name=name)))
        grown = size + len(encode(row)) + sum(len(encode(runtime)) for _, runtime in extra)
        if rows and grown > ACTORS_PAGE_BYTES:
            break
        rows.append(row)
        for key, runtime in extra:
            named.add(key)
            stamp_names.append(runtime)
        size = grown
        index += 1
    unknown_classes: list[str] = []
    fold_classes: list[str] = []
    unknown_workers: list[str] = []
    if query.after is None:
        if classes:
            have = {a.sandbox_class for a in actors.values()}
            unknown_classes = [c for c in dict.fromkeys(query.sandbox_classes) if c not in have]
            if unknown_classes:
                fold_classes = sorted(have)[:ACTORS_CLASSES_MAX]
        unknown_workers = [w for w in dict.fromkeys(query.worker_ids) if w not in projection.workers]
    next_after = ahead.cursor(ids, index, rows[-1].actor_id if rows else None, position, filters, passes)
    return ActorPage(actors=rows, next_after=next_after,
                     unknown_classes=unknown_classes, classes=fold_classes, unknown_workers=unknown_workers,
                     stamp_names=stamp_names)
