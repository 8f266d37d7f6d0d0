"""What the scheduler decides: placement, explain and fragmentation as pure functions.

Inputs are the projection (a fold of the log up to `position`), the actor, the
request's selectors and, from the service, the bookings it has in flight (so that
concurrent decisions of one replica do not pick room it is already committing).
No I/O, no clock, no randomness that does not come from the inputs.

## Placement (CONTRACT section 3, placement rules 1 to 7)

The actor's state and latest snapshot give a *plan*: an ordered list of tiers, each a
set of candidate workers, the runtime a worker would run the actor under, and what
the placement then is (action, fidelity, pin, fallback).

- No snapshot: one tier, every worker of the class, RUN on its default (rule 1).
- A MEMORY snapshot of the actor's current template, stamped for its class (rule 2):
  tier 1 the workers whose default runtime equals the stamp, tier 2 those with an equal
  restorable runtime (both straight from the projection's compat-key index); then the
  fallback tier, every worker of the class on its default, VOLUMES with reason
  NO_COMPATIBLE_WORKER, or RUN with fidelity NONE when the snapshot is `borrowed`
  (rule 4). With `min_fidelity` MEMORY there is no fallback tier: RESOURCE_EXHAUSTED.
- A MEMORY snapshot of an older template: every worker of the class on its default,
  VOLUMES (RUN/NONE if borrowed), fallback TEMPLATE_CHANGED (rule 3). A MEMORY snapshot
  with no stamp, or one stamped for another class, goes the same way with reason
  SNAPSHOT_NOT_MEMORY: the memory is in the snapshot but cannot be used.
- A VOLUMES or ROOTFS snapshot: every worker of the class on its default, at the
  snapshot's fidelity, no fallback (nothing the snapshot holds is given up).
- A PAUSED actor: every tier is restricted to its pinned node and there is no
  fallback tier (rule 5): RESOURCE_EXHAUSTED rather than leave the node or the runtime.
  If its template changed meanwhile its memory is unusable anyway, so any worker of
  the class on that node restores its volumes (TEMPLATE_CHANGED).

The first tier with a feasible worker wins. A worker is feasible when it passes the
pipeline of named checks, in this order, each of which names what it rejects:
`class not registered`, `drained`, `selector mismatch`, `not on pinned node`,
`runtime mismatch`, `insufficient cpu`, `insufficient memory` (rule 6). Room is
capacity minus the 64 MiB worker reserve minus what is booked; an actor books its
resources plus the chosen runtime's overhead. Selectors: the actor's, with the
request's added (the request's value wins on a shared key).

## Choice within a tier (rule 7): power of two choices, deterministic

A pseudo-random stream seeded with a stable hash of (actor id, log position) draws
up to 8 positions in the tier's member list; the first two distinct feasible
workers found are the two choices. If fewer than two turn up, the list is walked
once from a drawn offset to complete them. Of the two, the one with the larger
share of its memory still free after this booking wins; on a tie, the first drawn.
Member lists are in an order fixed by the log alone (see `IndexedSet`), so replaying
the log to a request's position and deciding again picks the same worker. When room
is plentiful a decision looks at a handful of workers whatever the fleet size; when
it is scarce it walks the tier, which for a memory restore is only the compatible
workers.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

from events.errors import ContractError, exhausted, not_found, precondition
from events.schema import (
    Action,
    ClassFragmentation,
    Explanation,
    Fallback,
    FallbackReason,
    Fidelity,
    Fragmentation,
    Placement,
    PlacedFidelity,
    Rejection,
    Resources,
    Room,
    RuntimeFragmentation,
)
from services.scheduler.projection import (
    MEMORY,
    PAUSED,
    REGISTERED,
    RUNNING,
    STOPPED,
    WORKER_RESERVE_MIB,
    Actor,
    Compat,
    Projection,
    Runtime,
    Worker,
    stable_hash,
)

# Tentative bookings a replica has in flight: worker id -> (cpu millis, memory MiB).
Pending = Mapping[str, tuple[int, int]]
NO_PENDING: Pending = {}

PROBES = 8  # random draws before walking the tier
EXPLAIN_REJECTED_LIMIT = 1000  # workers listed by name in an explanation (counts cover all)

# Reasons, in pipeline order.
CLASS_NOT_REGISTERED = "class not registered"
DRAINED = "drained"
SELECTOR_MISMATCH = "selector mismatch"
NOT_ON_PINNED_NODE = "not on pinned node"
RUNTIME_MISMATCH = "runtime mismatch"
INSUFFICIENT_CPU = "insufficient cpu"
INSUFFICIENT_MEMORY = "insufficient memory"

_FIDELITY = {
    Fidelity.MEMORY: PlacedFidelity.MEMORY,
    Fidelity.VOLUMES: PlacedFidelity.VOLUMES,
    Fidelity.ROOTFS: PlacedFidelity.ROOTFS,
}


# --- the ask: what a tier requires of a worker ----------------------------------------------


class Ask:
    """The requirements one tier puts on a worker; `compat` set means a memory restore."""

    __slots__ = ("sandbox_class", "cpu", "memory_mib", "selectors", "node", "compat")

    def __init__(
        self,
        sandbox_class: str,
        cpu: int,
        memory_mib: int,
        selectors: tuple[tuple[str, str], ...],
        node: str | None,
        compat: Compat | None,
    ):
        self.sandbox_class = sandbox_class
        self.cpu = cpu
        self.memory_mib = memory_mib
        self.selectors = selectors
        self.node = node
        self.compat = compat

    def runtime(self, worker: Worker) -> Runtime | None:
        """The runtime the actor would run under on `worker` (None: the worker cannot)."""
        entry = worker.classes.get(self.sandbox_class)
        if entry is None:
            return None
        if self.compat is None:
            return entry.default
        return entry.match(self.compat)

    def need_mib(self, runtime: Runtime) -> int:
        return self.memory_mib + runtime.overhead_mib(self.memory_mib)

    def fit(self, worker: Worker, pending: Pending) -> tuple[Runtime, int] | None:
        """All checks at once (the fast path of `reasons`): (runtime, memory to book) or None."""
        entry = worker.classes.get(self.sandbox_class)
        if entry is None or worker.state is not REGISTERED:
            return None
        if self.node is not None and worker.node != self.node:
            return None
        if self.selectors:
            labels = worker.labels
            for key, value in self.selectors:
                if labels.get(key) != value:
                    return None
        runtime = entry.default if self.compat is None else entry.match(self.compat)
        if runtime is None:
            return None
        need = self.memory_mib + runtime.overhead_mib(self.memory_mib)
        room_cpu = worker.cpu_millis - worker.booked_cpu
        room_mem = worker.memory_mib - WORKER_RESERVE_MIB - worker.booked_mem
        if pending:
            held = pending.get(worker.worker_id)
            if held is not None:
                room_cpu -= held[0]
                room_mem -= held[1]
        if room_cpu < self.cpu or room_mem < need:
            return None
        return runtime, need

    def reasons(self, worker: Worker, pending: Pending) -> list[str]:
        """The named pipeline: the first failing feasibility check, else the resource checks."""
        for check in FEASIBILITY:
            reason = check(self, worker)
            if reason is not None:
                return [reason]
        return [r for check in FIT for r in (check(self, worker, pending),) if r is not None]


def _room(worker: Worker, pending: Pending) -> tuple[int, int]:
    held = pending.get(worker.worker_id, (0, 0)) if pending else (0, 0)
    return worker.room_cpu - held[0], worker.room_mem - held[1]


# The checks, each a small named function returning its reason or None.


def check_class(ask: Ask, worker: Worker) -> str | None:
    return None if ask.sandbox_class in worker.classes else CLASS_NOT_REGISTERED


def check_state(ask: Ask, worker: Worker) -> str | None:
    return None if worker.state is REGISTERED else DRAINED


def check_selectors(ask: Ask, worker: Worker) -> str | None:
    labels = worker.labels
    return None if all(labels.get(k) == v for k, v in ask.selectors) else SELECTOR_MISMATCH


def check_node(ask: Ask, worker: Worker) -> str | None:
    return None if ask.node is None or worker.node == ask.node else NOT_ON_PINNED_NODE


def check_runtime(ask: Ask, worker: Worker) -> str | None:
    return None if ask.runtime(worker) is not None else RUNTIME_MISMATCH


def check_cpu(ask: Ask, worker: Worker, pending: Pending) -> str | None:
    return None if _room(worker, pending)[0] >= ask.cpu else INSUFFICIENT_CPU


def check_memory(ask: Ask, worker: Worker, pending: Pending) -> str | None:
    runtime = ask.runtime(worker)
    return None if _room(worker, pending)[1] >= ask.need_mib(runtime) else INSUFFICIENT_MEMORY


FEASIBILITY: tuple[Callable[[Ask, Worker], str | None], ...] = (
    check_class,
    check_state,
    check_selectors,
    check_node,
    check_runtime,
)
FIT: tuple[Callable[[Ask, Worker, Pending], str | None], ...] = (check_cpu, check_memory)


# --- the plan ---------------------------------------------------------------------------------


DEFAULT = "default"
RESTORABLE = "restorable"


class Tier:
    """One step of a plan: who is a candidate, and what a placement on one of them is."""

    __slots__ = ("name", "ask", "members", "action", "fidelity", "fallback", "match")

    def __init__(
        self,
        name: str,
        ask: Ask,
        members: Sequence[Worker],
        action: Action,
        fidelity: PlacedFidelity,
        fallback: Fallback | None,
        match: str | None,
    ):
        self.name = name
        self.ask = ask
        self.members = members
        self.action = action
        self.fidelity = fidelity
        self.fallback = fallback
        self.match = match  # memory tiers: which runtime of a worker matches the stamp


class Plan:
    __slots__ = ("actor", "tiers", "primary", "refusal", "memory_wanted")

    def __init__(self, actor: Actor, tiers: list[Tier], primary: Ask, refusal: str, memory_wanted: bool):
        self.actor = actor
        self.tiers = tiers
        self.primary = primary  # the ask explain reports reasons against
        self.refusal = refusal  # why there is no further tier, for the RESOURCE_EXHAUSTED message
        self.memory_wanted = memory_wanted


def resolve(projection: Projection, actor_id: str) -> Actor:
    """The actor a resume is about, or the contract error that refuses it."""
    actor = projection.actors.get(actor_id)
    if actor is None:
        raise not_found(f"actor {actor_id} not found")
    if actor.state is RUNNING:
        where = f" on worker {actor.worker.worker_id}" if actor.worker is not None else ""
        raise precondition(f"actor {actor_id} is RUNNING{where}; it must be paused or suspended first")
    if actor.state is STOPPED:
        raise precondition(f"actor {actor_id} is STOPPED")
    return actor


def merged_selectors(actor: Actor, selectors: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    if not selectors:
        return tuple(actor.spec.selectors.items())
    merged = dict(actor.spec.selectors)
    merged.update(selectors)
    return tuple(sorted(merged.items()))


def plan(projection: Projection, actor: Actor, selectors: Mapping[str, str] | None) -> Plan:
    spec = actor.spec  # what it asks for
    cls = spec.sandbox_class
    index = projection.classes.get(cls)
    everyone: Sequence[Worker] = index.workers.items if index is not None else ()
    sel = merged_selectors(actor, selectors)
    node = actor.node if actor.state is PAUSED else None
    res = spec.resources

    def ask(compat: Compat | None) -> Ask:
        return Ask(cls, res.cpu_millis, res.memory_mib, sel, node, compat)

    any_ask = ask(None)
    snapshot = actor.snapshot  # what its latest snapshot is
    tiers: list[Tier] = []

    if snapshot is None:  # rule 1: cold start on the class default
        tiers.append(Tier("cold start", any_ask, everyone, Action.RUN, PlacedFidelity.NONE, None, None))
        return Plan(actor, tiers, any_ask, "no worker of the class fits", False)

    borrowed = snapshot.borrowed
    if snapshot.fidelity is not MEMORY:  # rule 3: volumes or rootfs, nothing given up
        fidelity = _FIDELITY[snapshot.fidelity]
        tiers.append(Tier("restore", any_ask, everyone, Action.RESTORE, fidelity, None, None))
        return Plan(actor, tiers, any_ask, "no worker of the class fits", False)

    stamp = snapshot.stamp
    lost = None
    if snapshot.template_uid != spec.template_uid:
        lost = FallbackReason.TEMPLATE_CHANGED
    elif stamp is None or stamp.compat.sandbox_class != cls:
        lost = FallbackReason.SNAPSHOT_NOT_MEMORY
    if lost is not None:  # rule 3: memory in the snapshot that cannot be used
        tiers.append(_without_memory(any_ask, everyone, lost, borrowed))
        return Plan(actor, tiers, any_ask, "no worker of the class fits", False)

    # rule 2: a memory restore on a worker whose default or restorable runtime equals the stamp
    compat = stamp.compat
    mem_ask = ask(compat)
    defaults = index.default.get(compat) if index is not None else None
    restorables = index.restorable.get(compat) if index is not None else None
    tiers.append(
        Tier("default runtime match", mem_ask, defaults.items if defaults else (), Action.RESTORE,
             PlacedFidelity.MEMORY, None, DEFAULT)
    )
    tiers.append(
        Tier("restorable runtime match", mem_ask, restorables.items if restorables else (), Action.RESTORE,
             PlacedFidelity.MEMORY, None, RESTORABLE)
    )
    if actor.state is PAUSED:  # rule 5: never relaxed
        refusal = f"actor is PAUSED on node {node}: its memory restores only on a compatible worker there"
    elif spec.min_fidelity is Fidelity.MEMORY:  # rule 4's exception
        refusal = "no compatible worker has room and min_fidelity is MEMORY"
    else:  # rule 4: fall back rather than fail
        tiers.append(_without_memory(any_ask, everyone, FallbackReason.NO_COMPATIBLE_WORKER, borrowed))
        refusal = "no worker of the class fits"
    return Plan(actor, tiers, mem_ask, refusal, True)


def _without_memory(ask: Ask, members: Sequence[Worker], reason: FallbackReason, borrowed: bool) -> Tier:
    if borrowed:  # a golden snapshot: no volumes of the actor's own to restore
        to, action = PlacedFidelity.NONE, Action.RUN
    else:
        to, action = PlacedFidelity.VOLUMES, Action.RESTORE
    fallback = Fallback(reason=reason, from_fidelity=PlacedFidelity.MEMORY, to_fidelity=to)
    return Tier(f"fallback {reason.value}", ask, members, action, to, fallback, None)


# --- choosing ----------------------------------------------------------------------------------

_MASK = (1 << 64) - 1


class Draw:
    """splitmix64: a small, fast, well-mixed stream; seeded from the inputs only."""

    __slots__ = ("state",)

    def __init__(self, seed: int):
        self.state = seed & _MASK

    def below(self, n: int) -> int:
        self.state = z = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return (z ^ (z >> 31)) % n


def seed(actor_id: str, position: int) -> int:
    return stable_hash(f"{actor_id}@{position}")


Choice = tuple[Worker, Runtime, int]  # worker, runtime, memory booked


def _better(a: Choice, b: Choice) -> Choice:
    """The larger share of memory still free after the booking; `a` (drawn first) on a tie."""
    wa, wb = a[0], b[0]
    free_a = (wa.room_mem - a[2]) * wb.memory_mib
    free_b = (wb.room_mem - b[2]) * wa.memory_mib
    return b if free_b > free_a else a


def choose(ask: Ask, members: Sequence[Worker], draw: Draw, pending: Pending) -> Choice | None:
    n = len(members)
    if n == 0:
        return None
    first: Choice | None = None
    for _ in range(min(PROBES, n)):
        worker = members[draw.below(n)]
        if first is not None and worker is first[0]:
            continue
        fit = ask.fit(worker, pending)
        if fit is not None:
            if first is None:
                first = (worker, fit[0], fit[1])
            else:
                return _better(first, (worker, fit[0], fit[1]))
    start = draw.below(n)
    for i in range(n):
        worker = members[(start + i) % n]
        if first is not None and worker is first[0]:
            continue
        fit = ask.fit(worker, pending)
        if fit is not None:
            if first is None:
                first = (worker, fit[0], fit[1])
            else:
                return _better(first, (worker, fit[0], fit[1]))
    return first


def placement(actor: Actor, tier: Tier, choice: Choice) -> Placement:
    worker, runtime, need = choice
    pin = runtime.pin
    return Placement(
        actor_id=actor.actor_id,
        worker_id=worker.worker_id,
        node=worker.node,
        action=tier.action,
        fidelity=tier.fidelity,
        sandbox_runtime=pin,
        snapshot_id=actor.snapshot_id if tier.action is Action.RESTORE else None,
        fallback=tier.fallback,
        booked=Resources(cpu_millis=tier.ask.cpu, memory_mib=need),
    )


# --- decide --------------------------------------------------------------------------------------


def decide(
    projection: Projection,
    actor_id: str,
    selectors: Mapping[str, str] | None,
    position: int,
    pending: Pending = NO_PENDING,
    refusals: dict | None = None,
) -> Placement:
    """The placement a resume gets from the log folded to `position`; raises ContractError.

    A refusal's message counts every worker's reason, which costs a pass over the
    fleet; `refusals`, if given, keeps those messages by requirement so that refusals
    of alike resumes reuse one. The caller must empty it whenever the projection or
    `pending` changes: the messages are then exactly what each refusal would compute.
    """
    actor = resolve(projection, actor_id)
    the_plan = plan(projection, actor, selectors)
    draw = Draw(seed(actor_id, position))
    for tier in the_plan.tiers:
        choice = choose(tier.ask, tier.members, draw, pending)
        if choice is not None:
            return placement(actor, tier, choice)
    raise exhausted(_exhausted_message(projection, the_plan, pending, refusals))


def _exhausted_message(projection: Projection, the_plan: Plan, pending: Pending, refusals: dict | None = None) -> str:
    ask = the_plan.primary
    key = (ask.sandbox_class, ask.cpu, ask.memory_mib, ask.selectors, ask.node, ask.compat, the_plan.refusal)
    if refusals is not None and key in refusals:
        return refusals[key]
    total, candidates, counts = _tally(projection.workers.values(), ask, pending, None)
    message = f"{summary(candidates, total, counts)}; {the_plan.refusal}"
    if refusals is not None:
        refusals[key] = message
    return message


def _tally(
    workers: Iterable[Worker], ask: Ask, pending: Pending, rejected: list[Rejection] | None
) -> tuple[int, int, dict[str, int]]:
    total = candidates = 0
    counts: dict[str, int] = {}
    for worker in workers:
        total += 1
        reasons = ask.reasons(worker, pending)
        if not reasons:
            candidates += 1
            continue
        for reason in reasons:
            counts[reason] = counts.get(reason, 0) + 1
        if rejected is not None and len(rejected) < EXPLAIN_REJECTED_LIMIT:
            rejected.append(Rejection(worker_id=worker.worker_id, reasons=reasons))
    return total, candidates, counts


def summary(candidates: int, total: int, counts: Mapping[str, int]) -> str:
    """ "0/12 workers available: 7 runtime mismatch, 3 insufficient memory, 2 drained" """
    text = f"{candidates}/{total} workers available"
    if counts:
        ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        text += ": " + ", ".join(f"{n} {reason}" for reason, n in ordered)
    return text


# --- explain -----------------------------------------------------------------------------------------


def explain(
    projection: Projection,
    actor_id: str,
    selectors: Mapping[str, str] | None,
    position: int,
    pending: Pending = NO_PENDING,
) -> Explanation:
    """What a resume would get now and why every other worker was passed over; writes nothing.

    Reasons and counts are against the actor's first requirement (a memory restore
    on a compatible worker when its snapshot allows one; otherwise any worker of its
    class), over every registered worker. Each rejected worker carries the first
    feasibility check it fails or, past those, every resource check it fails.
    """
    try:
        actor = resolve(projection, actor_id)
    except ContractError as error:
        return Explanation(error=error.detail(), candidates=0, rejected=[], counts={}, message=error.message)
    the_plan = plan(projection, actor, selectors)
    rejected: list[Rejection] = []
    total, candidates, counts = _tally(projection.workers.values(), the_plan.primary, pending, rejected)
    text = summary(candidates, total, counts)
    try:
        decision = decide(projection, actor_id, selectors, position, pending)
    except ContractError as error:
        return Explanation(
            error=error.detail(), candidates=candidates, rejected=rejected, counts=counts,
            message=f"{text}; {the_plan.refusal}",
        )
    outcome = f"{decision.action.value} {decision.fidelity.value} on {decision.worker_id}"
    if decision.fallback is not None:
        outcome += f" (fallback {decision.fallback.reason.value})"
    return Explanation(
        decision=decision, candidates=candidates, rejected=rejected, counts=counts, message=f"{text}; {outcome}"
    )


# --- the reference scan ----------------------------------------------------------------------------------


def decide_by_scan(
    projection: Projection,
    actor_id: str,
    selectors: Mapping[str, str] | None,
    position: int,
    pending: Pending = NO_PENDING,
) -> Placement:
    """The same rule as `decide`, without the index: every worker of the fleet is run
    through the named pipeline and sorted into the plan's tiers.

    It is the yardstick of `bench/scheduler.py` and the oracle of the tests: it
    finds the same tier and a worker the index would deem feasible, though the member
    order (fleet order here, index order there) can make the two choices differ.
    """
    actor = resolve(projection, actor_id)
    the_plan = plan(projection, actor, selectors)
    draw = Draw(seed(actor_id, position))
    for tier in the_plan.tiers:
        ask = tier.ask
        keep = []
        for worker in projection.workers.values():
            fit = ask.fit(worker, pending)
            if fit is None:
                continue
            if tier.match is not None:  # a memory tier: split by the kind of runtime that matched
                on_default = fit[0] is worker.classes[ask.sandbox_class].default
                if on_default != (tier.match == DEFAULT):
                    continue
            keep.append(worker)
        choice = choose(ask, keep, draw, pending)
        if choice is not None:
            return placement(actor, tier, choice)
    raise exhausted(_exhausted_message(projection, the_plan, pending))


# --- fragmentation ---------------------------------------------------------------------------------------------


def fragmentation(projection: Projection, sandbox_class: str | None = None) -> Fragmentation:
    """Per class and runtime version: live workers running it as default or able to
    restore it, their free room, and the latest MEMORY snapshots of actors waiting for
    a resume that are stamped with it; `stranded_snapshots` counts those of versions
    that no registered, undrained worker can restore.
    """
    classes = []
    names = sorted(projection.classes) if sandbox_class is None else [sandbox_class]
    for name in names:
        index = projection.classes.get(name)
        if index is None:
            continue
        compats = set(index.default) | set(index.restorable) | set(index.memory_snapshots)
        runtimes = []
        for compat in sorted(compats, key=lambda c: c.key):
            seen: set[str] = set()
            free_cpu = free_mem = 0
            for table in (index.default, index.restorable):
                for worker in table.get(compat, ()):
                    if worker.live and worker.worker_id not in seen:
                        seen.add(worker.worker_id)
                        free_cpu += max(worker.room_cpu, 0)
                        free_mem += max(worker.room_mem, 0)
            runtimes.append(
                RuntimeFragmentation(
                    version=compat.version,
                    workers_default=index.live_default.get(compat, 0),
                    workers_restorable=index.live_restorable.get(compat, 0),
                    free=Room(cpu_millis=free_cpu, memory_mib=free_mem),
                    snapshots_memory=index.memory_snapshots.get(compat, 0),
                )
            )
        classes.append(
            ClassFragmentation(
                sandbox_class=name, workers=index.live_count(), runtimes=runtimes, stranded_snapshots=index.stranded()
            )
        )
    return Fragmentation(classes=classes)
