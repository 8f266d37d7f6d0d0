"""`scheduler.whatif` (CONTRACT v1.1): the fleet as if some runtimes were dropped and some
workers drained, as a pure function of the projection (no I/O, writes nothing).

It answers what an operator needs before a step of a rolling upgrade: how many counted
memory snapshots are stranded and how many stay memory-restorable, before and after;
which actors become stranded; and, per runtime version of the class, the workers that
accept it and their free room, before and after.

"Stranded" is the one definition `ClassIndex.stranded` uses (CONTRACT section 3): a
counted memory snapshot (the latest MEMORY snapshot of a SUSPENDED or PAUSED actor of
its current template) is stranded when no registered, undrained worker of its class
could restore it at MEMORY, by version or by edge; a LOCAL one, when no such worker is
on its node. Here, "could" is judged as if every worker of the class stopped offering
the dropped runtimes (as default, as restorable, or as a compatible version) and the
named workers were drained. A runtime accepts a stamp when its own version or one of
its compatible versions equals it; a dropped runtime accepts nothing, and a dropped
version is accepted by nobody.
"""

from __future__ import annotations

from typing import Any

from events.compat import compat_key
from events.errors import ContractError, no_worker, not_found
from events.schema import (ActorRuntime, Location, Room, RuntimeForecast, SnapshotCounts, StrandedActor, WhatIf,
                           WhatIfAnswer)
from services.scheduler.projection import Projection
from services.scheduler.places import node_of
from services.scheduler.records import (
    CREATED,
    MEMORY,
    PAUSED,
    SUSPENDED,
    WORKER_RESERVE_MIB,
    Actor,
    ClassEntry,
    ClassIndex,
    Compat,
    Worker,
)


def accepts(entry: ClassEntry, compat: Compat, dropped: frozenset[Compat]) -> bool:
    """Whether a runtime of `entry` that is not dropped can restore a memory snapshot of `compat`."""
    if compat in dropped:
        return False
    # as the index has them: of the machine's architecture, edges included (`ClassEntry.accepting`)
    return any(runtime.compat not in dropped for _, runtime in entry.accepting.get(compat, ()))


class Scenario:
    """Who accepts what before, and as if `dropped` were dropped and `drained` drained
    (memoised per compat key: each is computed once per answer)."""

    def __init__(self, index: ClassIndex, dropped: frozenset[Compat], drained: frozenset[str]):
        self.index = index
        self.dropped = dropped
        self.drained = drained
        self._before: dict[Compat, list[Worker]] = {}
        self._after: dict[Compat, list[Worker]] = {}
        self._touched: dict[int, bool] = {}  # id(class entry) -> whether it has a dropped runtime

    def before(self, compat: Compat) -> list[Worker]:
        """Live workers that accept `compat` now, each once (a worker is in the member set of
        every role it accepts `compat` in)."""
        found = self._before.get(compat)
        if found is None:
            unique = {w.worker_id: w for table in self.index.members for w in table.get(compat, ()) if w.live}
            found = self._before[compat] = list(unique.values())
        return found

    def acceptors(self, compat: Compat) -> list[Worker]:
        """Live workers that would still accept `compat`."""
        found = self._after.get(compat)
        if found is None:
            before = self.before(compat)
            if compat in self.dropped:
                found = []
            elif not self.dropped and not self.drained:
                found = before
            else:
                name, drained, touched = self.index.sandbox_class, self.drained, self._touched
                found = []
                for worker in before:
                    if worker.worker_id in drained:
                        continue
                    entry = worker.classes[name]
                    hit = touched.get(id(entry))
                    if hit is None:
                        hit = touched[id(entry)] = any(r.compat in self.dropped
                                                       for r in (entry.default, *entry.restorable))
                    if not hit or accepts(entry, compat, self.dropped):
                        found.append(worker)
            self._after[compat] = found
        return found

    def on_node(self, node: str, compat: Compat) -> bool:
        return any(w.place == node for w in self.acceptors(compat))  # a place: a disk of a node (rule 5)


def _before(index: ClassIndex) -> SnapshotCounts:
    counted = sum(index.external_memory.values()) + sum(index.local_memory.values())
    stranded = index.stranded()
    return SnapshotCounts(stranded_snapshots=stranded, memory_restorable_snapshots=counted - stranded)


def _after(index: ClassIndex, scenario: Scenario) -> tuple[SnapshotCounts, set]:
    """The counts after, and the keys (a compat, or a (node, compat)) stranded after."""
    stranded_keys: set = set()
    stranded = restorable = 0
    for compat, n in index.external_memory.items():
        if scenario.acceptors(compat):
            restorable += n
        else:
            stranded += n
            stranded_keys.add(compat)
    for key, n in index.local_memory.items():
        node, compat = key
        if scenario.on_node(node, compat):
            restorable += n
        else:
            stranded += n
            stranded_keys.add(key)
    return SnapshotCounts(stranded_snapshots=stranded, memory_restorable_snapshots=restorable), stranded_keys


def _was_stranded(index: ClassIndex, key) -> bool:
    if isinstance(key, tuple):
        return not index.live_on_node.get(key)
    return not index.accepting(key)


def _room(workers: list[Worker]) -> Room:
    cpu = mem = 0
    for w in workers:
        free = w.cpu_millis - w.booked_cpu
        if free > 0:
            cpu += free
        free = w.memory_mib - WORKER_RESERVE_MIB - w.booked_mem
        if free > 0:
            mem += free
    return Room(cpu_millis=cpu, memory_mib=mem)


def registered_classes(projection: Projection) -> list[str]:
    """The classes a registered worker runs (`Projection.registered`), sorted."""
    return sorted(name for name in projection.classes if projection.registered(name))


CLASSES_NAMED = 64  # of the classes registered workers run, those an unknown class's refusal names (`unknown_class`)


def unknown_class(sandbox_class: str, known: list[str] | None) -> ContractError:
    """NOT_FOUND (field `sandbox_class`): no registered worker runs the class; the message names
    the `known` ones (a typo's usual look), the first CLASSES_NAMED and how many more (a fleet of 2,200
    workers of 8 classes each named 17,600, a message of 1.1 MB, past nats-server's default max_payload:
    `services.endpoints.fitting_error`), or says that no worker is registered at all (None: not known)."""
    more = f", and {len(known) - CLASSES_NAMED:,} more" if known is not None and len(known) > CLASSES_NAMED else ""
    names = "" if known is None else f" (registered: {', '.join(known[:CLASSES_NAMED])}{more})" if known \
        else " (no worker is registered)"
    return not_found(f"no worker has registered the sandbox class {sandbox_class!r}{names}", "sandbox_class")


def check_class(projection: Projection, sandbox_class: str) -> None:
    """`unknown_class` unless a registered worker runs the class (`Projection.registered`). The
    views' `--class` (whatif, workers, fragmentation) is checked so too."""
    if not projection.registered(sandbox_class):
        raise unknown_class(sandbox_class, registered_classes(projection))


def check_drains(projection: Projection, sandbox_class: str, workers: tuple[str, ...] | list[str]) -> None:
    """NOT_FOUND (field `drain_workers[i]`) unless every worker to drain is a registered worker of
    the class: a typo must not forecast nothing (docs/contract.md). One of another class is said so."""
    for i, worker_id in enumerate(workers):
        worker = projection.workers.get(worker_id)
        if worker is None:
            raise no_worker(worker_id, f"drain_workers[{i}]")
        if sandbox_class not in worker.classes:
            raise not_found(f"worker {worker_id!r} is registered for {', '.join(sorted(worker.classes))}, not for "
                            f"class {sandbox_class}", f"drain_workers[{i}]")


def whatif(projection: Projection, query: WhatIf) -> WhatIfAnswer:
    """The forecast of `query` on the log folded into `projection` (CONTRACT `scheduler.whatif`)."""
    name = query.sandbox_class
    check_class(projection, name)
    index = projection.classes[name]
    check_drains(projection, name, query.drain_workers)
    dropped = frozenset(c for c in (projection.intern.compat_of_key(compat_key(name, v)) for v in query.drop_runtimes)
                        if c is not None)
    scenario = Scenario(index, dropped, frozenset(query.drain_workers))
    after, stranded_after = _after(index, scenario)

    newly = {key for key in stranded_after if not _was_stranded(index, key)}
    # the counted actors newly stranded, and (a project addition) the CREATED actors whose first resume
    # restores a memory image the query strands: CONTRACT counts neither their images nor them, and one
    # created under `min_fidelity: MEMORY` is refused for good (found by a trial of a rolling upgrade)
    newly_stranded: list[StrandedActor] = []
    created: list[StrandedActor] = []
    for actor in projection.actors.values() if query.limit and (dropped or query.drain_workers) else ():
        counted = actor.state is SUSPENDED or actor.state is PAUSED
        into = newly_stranded if counted else created if actor.state is CREATED else None
        if into is None or len(into) >= query.limit:
            if len(newly_stranded) >= query.limit and len(created) >= query.limit:
                break
            continue
        image = _memory_image(actor, name)  # in the log's order: the same lists on every replica
        if image is None:
            continue
        key, stamp, location, node = image
        # a CREATED actor's image is in no count, so in none of the keys found stranded above: judged here
        stranded = key in newly if counted else (_stranded_after(scenario, key) and not _was_stranded(index, key))
        if stranded:
            into.append(StrandedActor(actor_id=actor.actor_id, stamp=stamp, location=location, node=node))

    compats = {c for table in index.members for c in table} | set(index.external_memory)
    compats |= {c for _, c in index.local_memory} | dropped
    runtimes = []
    for compat in sorted(compats, key=lambda c: c.key):
        before, now = scenario.before(compat), scenario.acceptors(compat)
        free_before = _room(before)
        free_after = free_before if now is before else _room(now)
        runtimes.append(RuntimeForecast(version=compat.version, workers_before=len(before), workers_after=len(now),
                                        free_before=free_before, free_after=free_after))
    return WhatIfAnswer(before=_before(index), after=after, newly_stranded=newly_stranded, runtimes=runtimes,
                        created_newly_stranded=created)


def _memory_image(actor: Actor, sandbox_class: str) -> tuple[Any, ActorRuntime, Location, str | None] | None:
    """Of an actor of `sandbox_class` whose latest snapshot is a stamped MEMORY image of its template (the
    one its next resume restores at MEMORY, if a worker accepts it): the key its acceptors are found by (a
    compat, or a (node, compat) for a LOCAL image), its stamp, and where it is; None for any other actor."""
    kind = actor.snapshot
    if kind is None or kind.fidelity is not MEMORY or kind.stamp is None:
        return None
    if actor.spec.sandbox_class != sandbox_class or kind.template_uid != actor.spec.template_uid:
        return None
    if kind.local:
        return (actor.image_node or "", kind.stamp.compat), kind.stamp.runtime, Location.LOCAL, \
            node_of(actor.image_node) if actor.image_node else None
    return kind.stamp.compat, kind.stamp.runtime, Location.EXTERNAL, None


def _stranded_after(scenario: Scenario, key: Any) -> bool:
    """Whether no worker would accept the image of `key` (a compat, or a (node, compat)) in the scenario."""
    if isinstance(key, tuple):
        return not scenario.on_node(*key)
    return not scenario.acceptors(key)
