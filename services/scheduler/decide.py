"""What the scheduler decides: placement, explain and fragmentation as pure functions.

Inputs are the projection (a fold of the log up to `position`), the actor, the
request's selectors and, from the service, the bookings it has in flight (so that
concurrent decisions of one replica do not pick room it is already committing).
No I/O, no clock, no randomness that does not come from the inputs.

## Placement (CONTRACT section 3, placement rules 1 to 7, v1.1)

The actor's state and latest snapshot give a *plan*: an ordered list of tiers, each a
set of candidate workers, the runtime a worker would run the actor under, and what
the placement then is (action, fidelity, pin, fallback). `min_fidelity` is a floor
for every tier (rule 4a): a tier below it is not in the plan, and a plan left without
a tier that more room could fill is refused with FAILED_PRECONDITION naming the cause.

- Where the snapshot lives (rule 5): a LOCAL image restores only on a worker on its
  node, at any fidelity, whatever the actor's state; every tier is restricted to the
  class's workers on that node and there is no fallback tier that leaves it. When the
  node has no registered worker of the class, FAILED_PRECONDITION names the node and
  the way out (`revert`).
- No snapshot: one tier, every worker of the class, RUN on its default (rule 1); not
  with `min_fidelity` MEMORY.
- A MEMORY snapshot of the actor's current template, stamped for its class (rule 2):
  four tiers straight from the projection's compat-key index, in the preference of
  rule 2: workers whose default equals the stamp, whose restorable runtime equals
  it, whose default lists it as a compatible version (an edge), whose restorable
  runtime does. Then the fallback tier (rule 4): VOLUMES with reason
  NO_COMPATIBLE_WORKER, or RUN with fidelity NONE when the snapshot is `borrowed`;
  not with `min_fidelity` MEMORY (RESOURCE_EXHAUSTED: more room, or a worker accepting the
  stamp registering, could help; the message says which), not for
  a LOCAL image.
- A MEMORY snapshot of an older template (TEMPLATE_CHANGED), or one whose stamp is
  missing or of another class (SNAPSHOT_NOT_MEMORY): VOLUMES (RUN/NONE if borrowed),
  the memory given up (rule 3).
- A VOLUMES or ROOTFS snapshot: restored at its fidelity, no fallback (rule 3).
- Every tier without memory of a stamped snapshot keeps the stamp's `architecture`
  (rule 4): only workers whose class default has it (the projection indexes workers
  by that architecture).

The first tier with a feasible worker wins. A worker is feasible when it passes the
pipeline of named checks of `services.scheduler.feasibility` (rule 6): `class not
registered`, `drained`, `selector mismatch`, `not on pinned node`, `runtime mismatch`,
`architecture mismatch`, `insufficient cpu`, `insufficient memory`. Room is capacity
minus the 64 MiB worker reserve minus what is booked; an actor books its resources
plus the chosen runtime's overhead. Selectors are the
actor's and the request's together; the request may add keys, never change one
(INVALID_ARGUMENT, field `selectors.<key>`).

A refusal (RESOURCE_EXHAUSTED) counts every worker's reason ("0/12 workers available: 7
runtime mismatch, 2 selector mismatch (zone), ..."; `summary`, the selector keys not
matched named after their count), then says why no further tier was tried: the plan's
refusal, or, for an actor bigger than any worker of its class could ever take (the class
index counts its workers' capacities), that no worker of the class is big enough, the
largest's capacity and what the actor needs, or, when by those counts no undrained worker of
the class has the labels its selectors ask for, that (`refusal_cause`): the same code, which
would otherwise read as "busy, try later", with a `field` naming what of the actor the fleet
lacks.

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

import heapq
from typing import Iterable, Iterator, Mapping, NamedTuple, Sequence

from events.errors import NoWorkerOnNode, UnreadableHistory, exhausted, invalid, no_actor, precondition
from events.schema import (
    Action,
    CompatVersion,
    ErrorCode,
    Fallback,
    FallbackReason,
    Fidelity,
    Placement,
    PlacedFidelity,
    Rejection,
    Resources,
)
from services.scheduler.feasibility import (NO_PENDING, REASONS, SELECTOR_MISMATCH, Ask, Pending, missing_keys,
                                            none_passes)
from services.scheduler.projection import Projection
from services.scheduler.places import describe, node_of
from services.scheduler.records import (
    EDGE_DEFAULT,
    EDGE_RESTORABLE,
    MEMORY,
    OWN_DEFAULT,
    OWN_RESTORABLE,
    PAUSED,
    RUNNING,
    STOPPED,
    WORKER_RESERVE_MIB,
    Actor,
    Compat,
    IndexedSet,
    Runtime,
    Worker,
    stable_hash,
)

PROBES = 8  # random draws before walking the tier
EXPLAIN_REJECTED_LIMIT = 1000  # workers listed by name in an explanation (counts cover all)

# A snapshot's (or a floor's) fidelity as a placement names it.
AS_PLACED = {
    Fidelity.MEMORY: PlacedFidelity.MEMORY,
    Fidelity.VOLUMES: PlacedFidelity.VOLUMES,
    Fidelity.ROOTFS: PlacedFidelity.ROOTFS,
}
# The fidelities' order (rules 3 and 4a): lower holds more. `audit verify` reads it too.
RANK = {PlacedFidelity.MEMORY: 0, PlacedFidelity.VOLUMES: 1, PlacedFidelity.ROOTFS: 2, PlacedFidelity.NONE: 3}


# --- the plan ---------------------------------------------------------------------------------


# The memory tiers, in the order of rule 2 (v1.1), by the role a runtime accepts the stamp in.
MEMORY_TIERS = (
    (OWN_DEFAULT, "default runtime match"),
    (OWN_RESTORABLE, "restorable runtime match"),
    (EDGE_DEFAULT, "default runtime through a compatible version"),
    (EDGE_RESTORABLE, "restorable runtime through a compatible version"),
)


class Tier:
    """One step of a plan: who is a candidate, and what a placement on one of them is."""

    __slots__ = ("name", "ask", "members", "action", "fidelity", "fallback", "role")

    def __init__(
        self,
        name: str,
        ask: Ask,
        members: Sequence[Worker],
        action: Action,
        fidelity: PlacedFidelity,
        fallback: Fallback | None,
        role: int | None,
    ):
        self.name = name
        self.ask = ask
        self.members = members
        self.action = action
        self.fidelity = fidelity
        self.fallback = fallback
        self.role = role  # memory tiers: the role in which a worker's runtime accepts the stamp


class Cause(NamedTuple):
    """Why a resume is refused past its plan's tiers: the end of the RESOURCE_EXHAUSTED message, and,
    where no room freed can help (the fleet must change: a worker of the class, one accepting the
    image's runtime or of its architecture, or a bigger one, must register), the actor's `field` the
    fleet cannot meet now, which the refusal carries (docs/contract.md, "Placement"); None where room
    coming free may place it."""

    text: str
    field: str | None = None


class Plan:
    __slots__ = ("actor", "tiers", "primary", "refusal", "memory_wanted", "sources")

    def __init__(self, actor: Actor, tiers: list[Tier], primary: Ask, refusal: Cause, memory_wanted: bool,
                 sources: tuple[IndexedSet | None, ...] = ()):
        self.actor = actor
        self.tiers = tiers
        self.primary = primary  # the ask explain reports reasons against
        self.refusal = refusal  # why there is no further tier, for the RESOURCE_EXHAUSTED message
        self.memory_wanted = memory_wanted
        self.sources = sources  # the member sets the tiers were drawn from (their versions key a refusal)


# Why a resume is refused on what the actor is (`unresumable`), in the order checked.
NO_ACTOR = "no such actor"
ACTOR_RUNNING = "actor running"
ACTOR_STOPPED = "actor stopped"
UNRESUMABLE = (NO_ACTOR, ACTOR_RUNNING, ACTOR_STOPPED)


def unresumable(actor: Actor | None) -> str | None:
    """Why `actor` (None: none in the projection) cannot be resumed: it does not exist, it is RUNNING (it
    must be paused or suspended first), or STOPPED (its life has ended); None when it waits (CREATED,
    PAUSED, SUSPENDED). The one definition: `resolve` refuses a resume by it, and `audit verify` names a
    placement of such an actor by it (`audit.RESOLVED`)."""
    if actor is None:
        return NO_ACTOR
    state = actor.state
    if state is RUNNING:
        return ACTOR_RUNNING
    if state is STOPPED:
        return ACTOR_STOPPED
    return None


def resolve(projection: Projection, actor_id: str) -> Actor:
    """The actor a resume is about, or the contract error that refuses it (`unresumable`)."""
    unread = projection.unread_of(actor_id)
    if unread is not None:  # what that message changed (a newer snapshot, its stamp) is unknown here
        # a refusal on the actor's state, which a fold behind the log can give wrongly (the leader may
        # have the actor's next life already): the scheduler checks it at the stream leader
        raise UnreadableHistory(ErrorCode.UNAVAILABLE, (
            f"actor {actor_id}'s history holds message {unread}, which this scheduler cannot read (an event "
            f"of another version, or a body this version refuses): this replica does not place the actor "
            f"until its next life; a scheduler that reads the message can"))
    actor = projection.actors.get(actor_id)
    why = unresumable(actor)
    if why is None:
        return actor  # type: ignore[return-value]
    if why == NO_ACTOR:
        raise no_actor(actor_id)
    if why == ACTOR_RUNNING:
        where = f" on worker {actor.worker.worker_id}" if actor.worker is not None else ""  # type: ignore[union-attr]
        raise precondition(f"actor {actor_id} is RUNNING{where}; it must be paused or suspended first")
    # ACTOR_STOPPED
    raise precondition(f"actor {actor_id} is STOPPED: its life has ended; a CreateActor with the same "
                       f"id (`warmboot actor create {actor_id} ...`) starts its next life")


def check_retry(projection: Projection, answer: Placement, seq: int, request_id: str | None) -> None:
    """Refuse the answer from the log `answer` (its ActorPlaced at `seq`, for a resume's `request_id`
    sent again) unless its worker, as `projection` has it now, still carries it out (found by audits:
    the first answer, given again, sent a memory image where it could not load):
    - the worker's life it was made in has ended (removed, perhaps registered again on other
      runtimes: `Projection.life_ended`): the placement ended with it (the snapshotter releases the
      actor) and no worker expects its resume. FAILED_PRECONDITION, naming `request_id`;
    - a message of the worker's history after it that this fold cannot read may have ended that
      life: UNAVAILABLE, as for an actor's (`resolve`), since a replica that reads it can tell; and
      so is a refusal below when such a message came earlier in the life, or began it (what the
      fold has of the worker may be stale, or missing: found by reviews);
    - the worker no longer registers the class, is on another node, no longer runs the runtime the
      placement pins, or that runtime no longer accepts the image's version
      (`feasibility.carries_out`), or it registers another disk of the node than the one the LOCAL
      image it restores is on (`Projection.cannot_carry_out`, rule 5): the resume would run the actor
      under another runtime than the one every later snapshot is stamped with, or crash loading its
      image. FAILED_PRECONDITION, naming `request_id`."""
    worker_id = answer.worker_id
    made = f"the placement request_id {request_id!r} made (sequence {seq}, on worker {worker_id})"
    ended = projection.life_ended(worker_id, seq)
    if ended is not None:
        raise precondition(f"{made} has ended: {ended}. Its answer would send a resume no worker expects; "
                           "resume with a new request_id", "request_id")
    unread = projection.life_unread(worker_id, seq)
    if unread:
        raise UnreadableHistory(ErrorCode.UNAVAILABLE, (
            f"worker {worker_id}'s history holds message {unread}, after {made}, which this scheduler cannot "
            "read: it may have ended the worker's life, so this replica does not answer the request id; a "
            "scheduler that reads the message can"))
    cannot = projection.cannot_carry_out(answer)
    if cannot is None:
        return
    unread = projection.life_unread(worker_id)
    if unread:  # what this fold has of the worker may be stale: a refusal for good would be wrong
        raise UnreadableHistory(ErrorCode.UNAVAILABLE, (
            f"worker {worker_id}'s history holds message {unread}, which this scheduler cannot read and which "
            f"may have changed what it runs: this replica cannot tell whether {made} can be carried out "
            "there; a scheduler that reads the message can"))
    actor = projection.actors.get(answer.actor_id)
    still = (f" The actor stays RUNNING on {worker_id} in the log until it is released (paused or "
             f"suspended, or {worker_id} removed)."
             if actor is not None and actor.state is RUNNING and actor.worker is not None
             and actor.worker.worker_id == worker_id
             else " Resume with a new request_id.")
    raise precondition(f"{made} cannot be carried out there now: {cannot}; its answer would send the "
                       f"resume where it cannot run as placed.{still}", "request_id")


def merged_selectors(actor: Actor, selectors: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    """The actor's selectors and the request's together (rule 6, v1.1): a request may add a
    key, never change the value of one the actor selects on (INVALID_ARGUMENT)."""
    own = actor.spec.selectors
    if not selectors:
        return actor.spec.selector_pairs
    merged = dict(own)
    for key, value in selectors.items():
        have = own.get(key)
        if have is not None and have != value:
            raise invalid(
                f"actor {actor.actor_id} selects {key}={have}; a resume may add selectors, "
                f"not change one ({key}={value})",
                f"selectors.{key}",
            )
        merged[key] = value
    return tuple(sorted(merged.items()))


def items(source: IndexedSet | None) -> Sequence[Worker]:
    """The members of a set the index may not have (no worker in it yet)."""
    return source.items if source is not None else ()


def _below(fidelity: PlacedFidelity, floor: Fidelity) -> bool:
    return RANK[fidelity] > RANK[AS_PLACED[floor]]


def plan(projection: Projection, actor: Actor, selectors: Mapping[str, str] | None) -> Plan:
    """The tiers a resume of `actor` may be placed by, in order, and why it is refused past them."""
    the_plan = _plan(projection, actor, selectors)
    cls = actor.spec.sandbox_class
    if not projection.registered(cls):  # no tier had a worker: the class is the cause
        the_plan.refusal = Cause(f"no worker has registered the sandbox class {cls!r}", "sandbox_class")
    return the_plan


def _plan(projection: Projection, actor: Actor, selectors: Mapping[str, str] | None) -> Plan:
    spec = actor.spec  # what it asks for
    cls = spec.sandbox_class
    index = projection.classes.get(cls)
    sel = merged_selectors(actor, selectors)
    floor = spec.min_fidelity
    snapshot = actor.snapshot  # what its latest snapshot is
    aid = actor.actor_id

    node = restricted_to(actor)
    if node is not None:
        on_node = index.by_node.get(node) if index is not None and node else None
        if not on_node:
            where = describe(node) if node else "a node it does not name"
            none_there = (f", a disk no registered worker of class {cls} is on: node {node_of(node)} has registered "
                          "from another disk since (another node token: a machine replaced, the image lost with its "
                          "disk)" if node and projection.disks.moved_on(node) else
                          f", where no worker of class {cls} is registered")
            raise NoWorkerOnNode(
                ErrorCode.FAILED_PRECONDITION,
                f"actor {aid}'s latest snapshot is a LOCAL image on {where}{none_there}; it restores only there. "
                f"To give the image up, revert the actor "
                f"(`warmboot actor revert {aid}`): it then resumes from its latest EXTERNAL snapshot, or cold-boots"
            )
        base: IndexedSet | None = on_node
    else:
        base = index.workers if index is not None else None
    everyone: Sequence[Worker] = base.items if base is not None else ()

    def without_memory(arch: str | None) -> IndexedSet | None:
        """Candidates of a tier without memory: on the node, or of the stamp's architecture."""
        if arch is None or node is not None or index is None:
            return base
        return index.by_arch.get(arch)

    tiers: list[Tier] = []
    if snapshot is None:  # rule 1: cold start on the class default
        any_ask = tier_ask(actor, sel, node, memory=False)
        if floor is Fidelity.MEMORY:
            raise precondition(
                f"actor {aid} has no snapshot to restore and its min_fidelity is MEMORY: a cold boot "
                "(RUN, fidelity NONE) is below it; create it from a MEMORY snapshot (a tag or a golden "
                "snapshot) or with a lower min_fidelity"
            )
        tiers.append(Tier("cold start", any_ask, everyone, Action.RUN, PlacedFidelity.NONE, None, None))
        return Plan(actor, tiers, any_ask, Cause("no worker of the class fits"), False, (base,))

    stamp = snapshot.stamp
    arch = stamp.compat.arch if stamp is not None else None
    borrowed = snapshot.borrowed
    if snapshot.fidelity is not MEMORY:  # rule 3: volumes or rootfs, nothing given up
        fidelity = AS_PLACED[snapshot.fidelity]
        restore = tier_ask(actor, sel, node, memory=False)
        source = without_memory(arch)
        if not _below(fidelity, floor):
            tiers.append(Tier("restore", restore, items(source), Action.RESTORE, fidelity, None, None))
        elif borrowed and floor is not Fidelity.MEMORY:
            # rule 4a: a borrowed (golden) snapshot holds nothing of the actor's own, which may RUN
            # whatever its floor but MEMORY, as a borrowed memory image it cannot use does
            tiers.append(Tier("cold start (a borrowed snapshot below min_fidelity)", restore, items(source),
                              Action.RUN, PlacedFidelity.NONE, None, None))
        else:
            raise precondition(
                f"actor {aid}'s latest snapshot holds {fidelity.value} only, below its min_fidelity "
                f"{floor.value}"
            )
        return Plan(actor, tiers, restore, _no_worker(arch, node, items(source)), False, (source,))

    lost = memory_lost(actor)
    if lost is not None:  # rule 3: memory in the snapshot that cannot be used
        cause = (f"its template changed since the snapshot (the memory image is of template "
                 f"{snapshot.template_uid}, the actor's is now {spec.template_uid})"
                 if lost is FallbackReason.TEMPLATE_CHANGED else
                 "its snapshot's stamp is missing or of another class, so no runtime can be matched to it")
        source = without_memory(arch)
        tier = _without_memory(tier_ask(actor, sel, node, memory=False), items(source), lost, borrowed)
        if below_floor(tier.fidelity, floor, borrowed):
            raise precondition(f"actor {aid} cannot be restored at its min_fidelity {floor.value}: {cause}")
        tiers.append(tier)
        return Plan(actor, tiers, tier.ask, _no_worker(arch, node, items(source)), False, (source,))

    # rule 2: a memory restore on a worker that accepts the stamp, in the order of preference
    compat = stamp.compat
    mem_ask = tier_ask(actor, sel, node, memory=True)
    sources: list[IndexedSet | None] = [base] if node is not None else []
    for role, name in MEMORY_TIERS:
        if node is not None:  # the node's workers accepting the stamp in that role (few)
            members: Sequence[Worker] = [w for w in everyone if accepts_in(w, cls, compat, role)]
        else:
            found = index.members[role].get(compat) if index is not None else None
            sources.append(found)
            members = items(found)
        if members:  # a role no worker accepts the stamp in is no tier (most stamps have no edges)
            tiers.append(Tier(name, mem_ask, members, Action.RESTORE, PlacedFidelity.MEMORY, None, role))
    if node is not None:  # rule 5: never relaxed
        refusal = Cause(f"its memory image is LOCAL on {describe(node)}: it restores only on a compatible worker "
                        "there" if actor.state is not PAUSED else
                        f"actor is PAUSED on {describe(node)}: its memory restores only on a compatible worker there "
                        "(suspended, its image goes to external storage and it may move)")
    elif floor is Fidelity.MEMORY:  # rule 4's exception (4a: more room could help; so could a worker registering)
        refusal = (Cause("no compatible worker has room and min_fidelity is MEMORY") if tiers else
                   Cause("no registered worker accepts its memory image's runtime and min_fidelity is MEMORY: more "
                         "room does not help until one that does registers (a rolling upgrade can bring one back)",
                         STAMP_FIELD))
    else:  # rule 4: fall back rather than fail, keeping the stamp's architecture
        source = without_memory(arch)
        fallback = _without_memory(tier_ask(actor, sel, node, memory=False), items(source),
                                   FallbackReason.NO_COMPATIBLE_WORKER, borrowed)
        if below_floor(fallback.fidelity, floor, borrowed):
            refusal = Cause(f"no compatible worker has room, and a fallback is below min_fidelity {floor.value}")
        else:
            tiers.append(fallback)
            sources.append(source)
            refusal = _no_worker(arch, None, items(source))
    return Plan(actor, tiers, mem_ask, refusal, True, tuple(sources))


def memory_lost(actor: Actor) -> FallbackReason | None:
    """Rule 3: why the memory of the actor's latest snapshot, a MEMORY one, cannot be used: its template
    changed since (TEMPLATE_CHANGED), or its stamp is missing or of another class, so that no runtime can
    be matched to it (SNAPSHOT_NOT_MEMORY); None if it can. The first of `memory_lost_all`: the one
    definition, `plan` gives the memory up by it, and `audit verify` flags a memory restore of such an
    image (NOT_IN_SNAPSHOT)."""
    lost = memory_lost_all(actor)
    return lost[0] if lost else None


def memory_lost_all(actor: Actor) -> tuple[FallbackReason, ...]:
    """Every reason of rule 3 that holds for the actor's latest snapshot (`memory_lost` is the first, the
    one `plan` records): both when its template changed and its stamp is unusable. `audit verify` accepts
    a fallback naming any of them (each is true; the contract orders none before the other)."""
    snapshot = actor.snapshot
    if snapshot is None:
        return ()
    lost: tuple[FallbackReason, ...] = ()
    if snapshot.template_uid != actor.spec.template_uid:
        lost = (FallbackReason.TEMPLATE_CHANGED,)
    stamp = snapshot.stamp
    if stamp is None or stamp.compat.sandbox_class != actor.spec.sandbox_class:
        lost += (FallbackReason.SNAPSHOT_NOT_MEMORY,)
    return lost


def restricted_to(actor: Actor) -> str | None:
    """Rule 5: the node every tier of `actor` is restricted to: its latest snapshot's, a LOCAL image
    (a PAUSED actor's is one: the node it paused on); "" for one that names no node, which restores
    nowhere; None where it may go to any node. The one definition: `plan` and `audit verify` (a
    placement off it is LOCAL_OFF_NODE) both read it."""
    snapshot = actor.snapshot
    if snapshot is not None and snapshot.local:
        return actor.image_node or ""
    if actor.state is PAUSED:
        return actor.node or ""
    return None


def tier_ask(actor: Actor, selectors: tuple[tuple[str, str], ...], node: str | None, memory: bool) -> Ask:
    """What a tier of `actor`'s plan asks of a worker (`feasibility.Ask`, judged by `Ask.judge`): its
    class and resources, `selectors`, on `node` (`restricted_to`); with `memory`, a runtime accepting its
    latest snapshot's stamp (rule 2: the stamp must be one of the actor's class); without, its class
    default, of the stamp's architecture when the actor has a stamped snapshot (rule 4: a restore without
    memory, a fallback, the RUN of a borrowed snapshot). The one definition: `plan` builds its tiers' asks
    by it, and `audit verify` judges a placement by the ask of its tier."""
    spec = actor.spec
    res = spec.resources
    snapshot = actor.snapshot
    stamp = snapshot.stamp if snapshot is not None else None
    if memory:  # (a plan has a memory tier, and verify judges one, only for a stamped MEMORY image)
        return Ask(spec.sandbox_class, res.cpu_millis, res.memory_mib, selectors, node,
                   stamp.compat)  # type: ignore[union-attr]
    return Ask(spec.sandbox_class, res.cpu_millis, res.memory_mib, selectors, node, None,
               stamp.compat.arch if stamp is not None else None)


def accepts_in(worker: Worker, sandbox_class: str, compat: Compat, role: int) -> bool:
    """Whether a runtime of the worker accepts a memory snapshot of `compat` in `role`."""
    entry = worker.classes.get(sandbox_class)
    roles = entry.roles.get(compat) if entry is not None else None
    return roles is not None and role in roles


def _no_worker(arch: str | None, node: str | None, candidates: Sequence[Worker]) -> Cause:
    """Why a tier without memory found no worker: none of its `candidates` fits (the counts before it
    say why: room, drained, selectors), or, of a stamp's architecture, none is registered (it read as
    busy, where room freed cannot help: a docs check)."""
    where = f" on {describe(node)}" if node else ""
    if arch is not None and node is None and not candidates:
        return Cause(f"no registered worker of the class has architecture {arch}", ARCH_FIELD)
    of = f" with architecture {arch}" if arch is not None else ""
    return Cause(f"no worker of the class{of}{where} fits")


# the fields a refusal names where the fleet, not its room, must change (`Cause`): the actor's latest
# snapshot's stamp, as `snapshotter.status` shows it
STAMP_FIELD = "snapshot.sandbox_runtime"
SELECTORS_FIELD = "selectors"  # no undrained worker of the class has the labels (`refusal_cause`)
ARCH_FIELD = "snapshot.sandbox_runtime.version.attributes.architecture"


def below_floor(fidelity: PlacedFidelity, floor: Fidelity, owns_nothing: bool) -> bool:
    """Whether a placement at `fidelity` is below `min_fidelity` `floor` (rule 4a): an actor that
    owns nothing to lose (a borrowed snapshot, or none) may RUN unless its floor is MEMORY. The one
    definition: the plan's tiers and `audit verify` both judge by it."""
    if owns_nothing and fidelity is PlacedFidelity.NONE:
        return floor is Fidelity.MEMORY
    return _below(fidelity, floor)


# Every fallback a placement can carry, made once: (reason, borrowed) -> (action, fidelity, Fallback, tier name)
_FALLBACKS = {
    (reason, borrowed): (
        Action.RUN if borrowed else Action.RESTORE,
        PlacedFidelity.NONE if borrowed else PlacedFidelity.VOLUMES,
        Fallback(reason=reason, from_fidelity=PlacedFidelity.MEMORY,
                 to_fidelity=PlacedFidelity.NONE if borrowed else PlacedFidelity.VOLUMES),
        f"fallback {reason.value}",
    )
    for reason in FallbackReason for borrowed in (False, True)
}


def _without_memory(ask: Ask, members: Sequence[Worker], reason: FallbackReason, borrowed: bool) -> Tier:
    """A tier that gives the memory up: VOLUMES, or RUN/NONE for a borrowed (golden) snapshot,
    which holds no volumes of the actor's own."""
    action, to, fallback, name = _FALLBACKS[reason, borrowed]
    return Tier(name, ask, members, action, to, fallback, None)


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


def _positions(n: int, draw: Draw) -> Iterator[int]:
    """Where `choose` looks: PROBES random draws, then the whole list from a drawn offset."""
    for _ in range(min(PROBES, n)):
        yield draw.below(n)
    start = draw.below(n)
    for i in range(n):
        yield (start + i) % n


def choose(ask: Ask, members: Sequence[Worker], draw: Draw, pending: Pending, role: int | None = None) -> Choice | None:
    """Power of two choices among the tier's feasible members (module docstring); a memory
    tier's `role` says which of a worker's runtimes may restore the stamp."""
    n = len(members)
    if n == 0:
        return None
    first: Choice | None = None
    for i in _positions(n, draw):
        worker = members[i]
        if first is not None and worker is first[0]:
            continue
        fit = ask.fit(worker, pending, role)
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
        matched_version=_matched(tier, runtime),
        node_token=placed_token(actor, tier.action, worker),
    )


def placed_token(actor: Actor, action: Action, worker: Worker) -> str | None:
    """The node token a placement of `actor` on `worker` names (rule 5): on a restore restricted to a place
    (`restricted_to`), the worker's, the disk its memory is on, so that a machine on another disk under the
    worker's id refuses it (`agent --check-placement`); None otherwise. The one definition: `placement`
    writes it and `audit verify` (NODE_TOKEN_MISSTATED) judges it."""
    return worker.token if action is Action.RESTORE and restricted_to(actor) is not None else None


def _matched(tier: Tier, runtime: Runtime) -> CompatVersion | None:
    """On a memory restore, the version that matched the stamp: the pin's own, or the edge."""
    if tier.role is None:
        return None
    if tier.role in (OWN_DEFAULT, OWN_RESTORABLE):
        return runtime.compat.version
    return tier.ask.compat.version


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
    fleet. `refusals`, if given, remembers each refusal by what was asked, with the
    versions of everything it depended on: the fleet's registry state and the member
    sets the plan's tiers were drawn from, whose versions move with every member that
    comes or goes and every change of a member's room, bookings in flight included
    (`IndexedSet.version`, `Worker.touch`). While none moved, the same ask is refused
    again with the same message at once, without walking the tiers: exactly what a
    fresh refusal would compute, in microseconds instead of a pass over the fleet.
    """
    actor = resolve(projection, actor_id)
    the_plan = plan(projection, actor, selectors)
    if refusals is not None:
        key, versions = _refusal_key(projection, the_plan)
        known = refusals.get(key)
        if known is not None and known[0] == versions:
            raise exhausted(*known[1])
    draw = Draw(seed(actor_id, position))
    for tier in the_plan.tiers:
        choice = choose(tier.ask, tier.members, draw, pending, tier.role)
        if choice is not None:
            return placement(actor, tier, choice)
    refused = exhausted_message(projection, the_plan, pending)
    if refusals is not None:
        if len(refusals) >= REFUSALS_KEPT:
            refusals.clear()
        refusals[key] = (versions, refused)
    raise exhausted(*refused)


REFUSALS_KEPT = 4096  # distinct asks remembered at once


def _refusal_key(projection: Projection, the_plan: Plan) -> tuple[tuple, tuple[int, ...]]:
    """What a refusal is remembered by, and the versions of what it depended on."""
    ask = the_plan.primary
    key = (ask.sandbox_class, ask.cpu, ask.memory_mib, ask.selectors, ask.node, ask.compat, ask.arch,
           the_plan.refusal, len(the_plan.tiers))
    versions = (projection.registry_version, *(s.version if s is not None else -1 for s in the_plan.sources))
    return key, versions


def exhausted_message(projection: Projection, the_plan: Plan, pending: Pending) -> Cause:
    """A refusal's message, the counts of every worker's reason (`summary`) then why no further tier
    was tried (`refusal_cause`), and its field (`Cause`)."""
    keys: dict[str, int] = {}
    total, candidates, counts = tally(projection.workers.values(), the_plan.primary, pending, None, keys)
    cause = refusal_cause(projection, the_plan, candidates, counts)
    return Cause(f"{summary(candidates, total, counts, keys)}; {cause.text}", cause.field)


def refusal_cause(projection: Projection, the_plan: Plan, candidates: int, counts: Mapping[str, int]) -> Cause:
    """Why a refused resume had no further tier: the plan's refusal; or, since then no room freed
    helps (a refusal of the same code, RESOURCE_EXHAUSTED, that would otherwise read as "busy, try
    later"), when the actor is bigger than any worker of its class could ever take (`bigger_than`,
    from the capacities the class's index counts: no pass over the fleet), that; or, when the plan's
    refusal names no field and the refusal's tally (`candidates`, `counts`) has no undrained worker
    of the class with the labels its selectors ask for, that (field `selectors`: a drain lasts the
    worker's life)."""
    ask = the_plan.primary
    too_big = too_big_for_class(projection, ask.sandbox_class, ask.cpu, ask.memory_mib)
    if too_big is not None:
        return Cause(f"no worker of the class is big enough: {too_big}; no room freed will fit it, a bigger worker "
                     "must register", "resources")
    if the_plan.refusal.field is None and none_passes(candidates, counts, SELECTOR_MISMATCH):
        return Cause("no undrained worker of the class has the labels its selectors ask for; no room freed will "
                     "place it, an undrained worker with them must register", SELECTORS_FIELD)
    return the_plan.refusal


def too_big_for_class(projection: Projection, sandbox_class: str, cpu: int, memory_mib: int) -> str | None:
    """`bigger_than` the largest capacities of the class's registered workers (`ClassIndex.largest`);
    None if one could take it, or none is registered. `warmboot actor create` warns with it."""
    index = projection.classes.get(sandbox_class)
    largest = index.largest() if index is not None else None
    return bigger_than(largest, cpu, memory_mib) if largest is not None else None


def bigger_than(largest: tuple[int, int], cpu: int, memory_mib: int) -> str | None:
    """How an actor asking `cpu` millis and `memory_mib` MiB is bigger than any worker of a class
    whose largest capacities are `largest` (`ClassIndex.largest`: the most CPU, the most memory)
    could take with nothing booked (CONTRACT placement rule 6: capacity minus the 64 MiB reserve);
    None if it is not. Its runtime's overhead is left out (it depends on the runtime): an actor
    that would fit only without it is not said to be too big."""
    most_cpu, most_mem = largest
    offered = most_mem - WORKER_RESERVE_MIB
    if cpu <= most_cpu and memory_mib <= offered:
        return None
    return (f"the largest has {most_cpu}m CPU and {most_mem} MiB memory ({offered} MiB after the "
            f"{WORKER_RESERVE_MIB} MiB reserve), the actor needs {cpu}m CPU and {memory_mib} MiB memory plus its "
            "runtime's overhead")


def tally(
    workers: Iterable[Worker], ask: Ask, pending: Pending, rejected: list[Rejection] | None,
    keys: dict[str, int] | None = None,
) -> tuple[int, int, dict[str, int]]:
    """Workers in all, candidates, and the count of each reason; with `rejected`, the workers passed
    over that came furthest through the checks (short of one resource before short of both, before
    a drained one, before one of another class; of those as far, the first in the log), at most
    EXPLAIN_REJECTED_LIMIT of them, listed in that order and then by id; with `keys`, for each
    selector key, how many of the workers passed over for `selector mismatch` do not match it (in
    the same pass, from the labels of those workers alone), and each listed one's keys
    (`Rejection.missing_keys`)."""
    total = candidates = 0
    counts: dict[str, int] = {}
    kept: list[tuple[int, int, str, list[str], Sequence[str]]] = []  # a heap, the least far through on top
    selectors = ask.selectors if keys is not None else ()  # read only when asked (a test's stand-in ask has none)
    for worker in workers:
        total += 1
        reasons = ask.reasons(worker, pending)
        if not reasons:
            candidates += 1
            continue
        for reason in reasons:
            counts[reason] = counts.get(reason, 0) + 1
        missed: Sequence[str] = ()  # (no list made for each worker passed over)
        if selectors and reasons[0] == SELECTOR_MISMATCH:
            missed = missing_keys(selectors, worker.labels)  # sorted: the selectors are
            for key in missed:
                keys[key] = keys.get(key, 0) + 1
        if rejected is not None:
            how_far = _how_far(reasons)
            if len(kept) < EXPLAIN_REJECTED_LIMIT:
                heapq.heappush(kept, (how_far, -total, worker.worker_id, reasons, missed))
            elif how_far > kept[0][0]:  # of equals, the first in the log is kept
                heapq.heapreplace(kept, (how_far, -total, worker.worker_id, reasons, missed))
    if rejected is not None:
        kept.sort(key=lambda e: (-e[0], e[2]))
        rejected.extend(Rejection(worker_id=worker_id, reasons=reasons, missing_keys=list(missed))
                        for _, _, worker_id, reasons, missed in kept)
    return total, candidates, counts


# How far through the checks a reason comes, in steps of 2: a worker short of room comes furthest,
# one short of a single resource (CPU or memory) a step further than one short of both.
_PIPELINE = {reason: 2 * i for i, reason in enumerate(REASONS)}
_ROOM = 2 * len(REASONS)
_SHORT = frozenset(REASONS[-2:])  # insufficient cpu, insufficient memory: the resource checks


def _how_far(reasons: Sequence[str]) -> int:
    """How far through the checks a worker passed over came: reasons come in the checks' order (the
    first failing feasibility check, or every failing resource check)."""
    last = reasons[-1]
    if last in _SHORT:
        return _ROOM - len(reasons)
    return _PIPELINE.get(last, -1)


SELECTOR_KEYS_NAMED = 3  # selector keys a summary names at most after `selector mismatch`


def summary(candidates: int, total: int, counts: Mapping[str, int], keys: Mapping[str, int] | None = None) -> str:
    """ "0/12 workers available: 7 runtime mismatch, 3 insufficient memory, 2 drained"; with `keys`
    (`tally`'s), `selector mismatch` names the selector keys not matched: "2 selector mismatch (zone)",
    of many the SELECTOR_KEYS_NAMED most missed, "(disk, rack, zone, +2 more)"."""
    text = f"{candidates}/{total} workers available"
    if counts:
        ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        text += ": " + ", ".join(f"{n} {reason}{named_keys(keys) if reason == SELECTOR_MISMATCH and keys else ''}"
                                 for reason, n in ordered)
    return text


def named_keys(keys: Mapping[str, int]) -> str:
    """ " (zone)"; " (disk, zone)"; of more than SELECTOR_KEYS_NAMED, the most missed (of those missed
    alike, the first by name), by name, and how many more: " (disk, rack, zone, +2 more)"."""
    shown = sorted(sorted(keys, key=lambda k: (-keys[k], k))[:SELECTOR_KEYS_NAMED])
    more = len(keys) - len(shown)
    return f" ({', '.join(shown)}{f', +{more} more' if more else ''})"
