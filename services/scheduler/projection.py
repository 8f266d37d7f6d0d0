"""The scheduler's projection: a pure fold of the event log (no I/O, no clock, no asyncio).

`Projection.apply(seq, event, version)` folds one event of the stream, in stream
order. What it keeps is exactly what placement and `fragmentation` read:

- workers: node, capacity, labels, state (REGISTERED, DRAINED; a removed worker is
  dropped), per sandbox class the default and restorable runtimes, what is booked
  on them and by how many actors (`Worker.actors` names them);
- per sandbox class, an index from compat key to the workers whose default runtime
  matches it and to the workers one of whose restorable runtimes matches it, so that
  the compatible workers of a stamp are one dictionary look-up away, never a scan;
- actors: state, class, template, resources, selectors, `min_fidelity`, the latest
  snapshot (what decisions read of it: template, fidelity, stamp, borrowed; and its
  id), the assignment (worker, booking, pin) or the node a PAUSED actor is pinned
  to, and the last placement's `request_id` and sequence (idempotent retries);
- per subject the scheduler writes (`actor.<id>`, `booking.<worker id>`): the
  aggregate version and the stream sequence of its last event, which are the
  optimistic-concurrency expectations of the next commit;
- counts for fragmentation: latest MEMORY snapshots per compat key of actors waiting
  for a resume, and live (registered, undrained) workers per key.

Memory is kept small on purpose, because a projection holds every actor of a
deployment (at most 300 bytes each, as `bench/recovery.py` measures it):

- one actor is one msgspec Struct that the garbage collector does not track (no
  reference cycle passes through it), 16 bytes of header and 8 per field;
- what many actors have alike is interned and referred to: compat keys, stamps,
  runtimes, templates, resources, selector maps, and the combinations an actor
  refers to as one (`Spec`: what it asks for; `SnapshotKind`: what decisions read of
  its latest snapshot; `Lease`: what it books while running);
- a snapshot id that starts with the actor's id (the snapshotter's default is
  `<actor id>-v<version>`) is kept as the interned rest;
- a worker counts the actors booked on it (their ids are found through their
  assignments), and keeps the OCC expectation of its `booking.<id>` subject.
"""

from __future__ import annotations

import hashlib
import struct
import weakref
from collections.abc import Set
from math import ceil
from typing import Any, Callable, ClassVar, Iterator, Mapping

from msgspec import Struct
from msgspec.structs import astuple

from events.compat import CompatKey, compat_key, describe_key
from events.schema import (
    ActorCreated,
    ActorPlaced,
    ActorReleased,
    ActorReverted,
    ActorRuntime,
    ActorStopped,
    CompatVersion,
    Event,
    Fidelity,
    Location,
    ReleaseReason,
    Resources,
    RuntimeChanged,
    Snapshot,
    SnapshotOrigin,
    SnapshotTaken,
    TagRecorded,
    TemplateChanged,
    WorkerBooked,
    WorkerDrained,
    WorkerFenced,
    WorkerRegistered,
    WorkerRemoved,
    WorkerRuntime,
    WorkerSandboxClass,
    WorkerUpdated,
)

# Memory every worker keeps out of what it offers to actors (CONTRACT placement rule 6).
WORKER_RESERVE_MIB = 64

# Worker states. A removed worker leaves the projection; registering it again starts afresh.
REGISTERED = "REGISTERED"
DRAINED = "DRAINED"

# Actor states.
CREATED = "CREATED"
RUNNING = "RUNNING"
PAUSED = "PAUSED"
SUSPENDED = "SUSPENDED"
STOPPED = "STOPPED"
# States in which an actor waits for a resume: its latest snapshot is what a resume restores.
WAITING = frozenset((CREATED, PAUSED, SUSPENDED))

MEMORY = Fidelity.MEMORY
_EMPTY: Mapping[str, str] = {}

# Distinct snapshot-id suffixes interned at most: past that, a suffix is kept per actor
# (user-chosen ids may all differ; the snapshotter's own are `-v<version>`, few).
SUFFIXES_INTERNED = 1 << 16


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process (str's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


# Roles in which a worker's runtime accepts a stamp, in the order placement rule 2 (v1.1)
# prefers them: the runtime's own version as the class default, as a restorable runtime,
# then a compatibility edge (`compatible_versions`) of the default, of a restorable.
OWN_DEFAULT, OWN_RESTORABLE, EDGE_DEFAULT, EDGE_RESTORABLE = 0, 1, 2, 3
ROLES = (OWN_DEFAULT, OWN_RESTORABLE, EDGE_DEFAULT, EDGE_RESTORABLE)
ROLE_NAMES = ("default", "restorable", "edge of default", "edge of restorable")
ARCHITECTURE = "architecture"


class Compat:
    """One interned compat key: (class, schema version, sorted attributes), its version,
    and its `architecture` attribute (None if it has none)."""

    __slots__ = ("key", "sandbox_class", "version", "arch")

    def __init__(self, key: CompatKey, version: CompatVersion):
        self.key = key
        self.sandbox_class = key[0]
        self.version = version
        self.arch = next((v for k, v in key[2] if k == ARCHITECTURE), None)

    def __repr__(self) -> str:
        return f"Compat({describe_key(self.key)})"


class Stamp:
    """An interned ActorRuntime (a snapshot's stamp or an assignment's pin) and its compat key."""

    __slots__ = ("runtime", "compat")

    def __init__(self, runtime: ActorRuntime, compat: Compat):
        self.runtime = runtime
        self.compat = compat


class Runtime:
    """An interned worker runtime of one class: its compat key, overhead, the pin it gives,
    and the compat keys of its compatible versions (the one-way edges it accepts)."""

    __slots__ = ("compat", "name", "fixed_mib", "per_gib_mib", "pin", "edges")

    def __init__(self, compat: Compat, runtime: WorkerRuntime, edges: tuple[Compat, ...] = ()):
        self.compat = compat
        self.name = runtime.name
        overhead = runtime.actor_overhead
        self.fixed_mib = overhead.fixed_mib if overhead else 0
        self.per_gib_mib = overhead.per_gib_mib if overhead else 0
        # The pin carries the runtime's own version with the class: what the actor runs under.
        self.pin = ActorRuntime(sandbox_class=compat.sandbox_class, name=runtime.name, version=runtime.version)
        self.edges = edges

    def overhead_mib(self, memory_mib: int) -> int:
        """`fixed_mib + per_gib_mib * ceil(memory_mib / 1024)` (CONTRACT placement rule 6)."""
        if self.per_gib_mib:
            return self.fixed_mib + self.per_gib_mib * ceil(memory_mib / 1024)
        return self.fixed_mib


class ClassEntry:
    """What one worker runs for one sandbox class (interned: workers configured alike share one).

    `accepts` maps every compat key a memory snapshot may carry to restore here to the
    best role in which a runtime of the entry accepts it and that runtime."""

    __slots__ = ("default", "restorable", "accepts")

    def __init__(self, default: Runtime, restorable: tuple[Runtime, ...]):
        self.default = default
        self.restorable = restorable
        accepts: dict[Compat, tuple[int, Runtime]] = {}
        for role, runtime in ((OWN_DEFAULT, default), *((OWN_RESTORABLE, r) for r in restorable)):
            accepts.setdefault(runtime.compat, (role, runtime))
        for edge in default.edges:
            accepts.setdefault(edge, (EDGE_DEFAULT, default))
        for runtime in restorable:
            for edge in runtime.edges:
                accepts.setdefault(edge, (EDGE_RESTORABLE, runtime))
        self.accepts = accepts

    def match(self, compat: Compat) -> tuple[int, Runtime] | None:
        """(role, runtime) that can restore a memory snapshot of `compat` here, or None."""
        return self.accepts.get(compat)

    @property
    def arch(self) -> str | None:
        """The architecture of the class default: what a restore without memory runs on."""
        return self.default.compat.arch


class Worker:
    __slots__ = (
        "worker_id",
        "node",
        "cpu_millis",
        "memory_mib",
        "labels",
        "state",
        "classes",  # {sandbox_class: ClassEntry}
        "booked_cpu",
        "booked_mem",
        "holding",  # how many actors hold bookings on this worker
        "projection",  # a weak reference to the projection the record is part of (see `actors`)
        # optimistic concurrency on `booking.<worker id>`
        "booking_version",
        "booking_seq",
    )

    def __init__(self, worker_id: str, projection: "weakref.ref[Projection] | None" = None):
        self.worker_id = worker_id
        self.node = ""
        self.cpu_millis = 0
        self.memory_mib = 0
        self.labels: Mapping[str, str] = _EMPTY
        self.state = REGISTERED
        self.classes: dict[str, ClassEntry] = {}
        self.booked_cpu = 0
        self.booked_mem = 0
        self.holding = 0
        self.projection = projection
        self.booking_version = 0
        self.booking_seq = 0

    @property
    def live(self) -> bool:
        """Takes new placements (registered and not drained)."""
        return self.state is REGISTERED

    @property
    def room_cpu(self) -> int:
        return self.cpu_millis - self.booked_cpu

    @property
    def room_mem(self) -> int:
        return self.memory_mib - WORKER_RESERVE_MIB - self.booked_mem

    @property
    def actors(self) -> "BookedActors":
        """The ids of the actors whose bookings are on this worker (a set)."""
        return BookedActors(self)

    def book(self, booked: Resources) -> None:
        self.booked_cpu += booked.cpu_millis
        self.booked_mem += booked.memory_mib
        self.holding += 1

    def unbook(self, booked: Resources) -> None:
        self.booked_cpu -= booked.cpu_millis
        self.booked_mem -= booked.memory_mib
        self.holding -= 1

    def __repr__(self) -> str:
        return f"Worker({self.worker_id} on {self.node}, {self.state}, room {self.room_cpu}m/{self.room_mem}MiB)"


class BookedActors(Set):
    """The ids of the actors booked on a worker, as a set: counted by the worker, found
    by their assignment (`Actor.worker`) in the projection. Keeping the ids on each worker
    would cost as much again as the assignment itself."""

    __slots__ = ("worker",)

    def __init__(self, worker: Worker):
        self.worker = worker

    def __len__(self) -> int:
        return self.worker.holding

    def _actors(self) -> dict[str, "Actor"]:
        ref = self.worker.projection
        projection = ref() if ref is not None else None
        return projection.actors if projection is not None else {}

    def __iter__(self) -> Iterator[str]:
        worker = self.worker
        return (a.actor_id for a in self._actors().values() if a.worker is worker)

    def __contains__(self, actor_id: object) -> bool:
        actor = self._actors().get(actor_id)  # type: ignore[call-overload]
        return actor is not None and actor.worker is self.worker

    def __repr__(self) -> str:
        return f"BookedActors({set(self)})"


class IndexedSet:
    """Workers in a stable order with O(1) add, remove and access by position.

    Removal moves the last member into the hole, so the order is a function of the
    sequence of operations alone: every replica that folds the same log gets the same
    order, which keeps sampling by position deterministic.
    """

    __slots__ = ("items", "pos")

    def __init__(self) -> None:
        self.items: list[Worker] = []
        self.pos: dict[str, int] = {}

    def add(self, worker: Worker) -> None:
        if worker.worker_id not in self.pos:
            self.pos[worker.worker_id] = len(self.items)
            self.items.append(worker)

    def discard(self, worker: Worker) -> None:
        i = self.pos.pop(worker.worker_id, None)
        if i is None:
            return
        last = self.items.pop()
        if last is not worker:
            self.items[i] = last
            self.pos[last.worker_id] = i

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Worker]:
        return iter(self.items)

    def __contains__(self, worker: Worker) -> bool:
        return worker.worker_id in self.pos


class ClassIndex:
    """Per sandbox class: its workers, the indices decisions look things up in, and the
    counts fragmentation reads.

    - `members[role][compat]`: the workers accepting `compat` in that role (each worker in
      its best role only), `live[role][compat]` how many of them are live;
    - `by_node[node]`, `by_arch[architecture]`: the workers on a node, and by the
      architecture of their class default (a restore without memory keeps the stamp's);
    - `live_on_node[(node, compat)]`: live workers on a node accepting `compat` in any role;
    - what counts as stranded (CONTRACT section 3): the latest MEMORY snapshots of
      SUSPENDED and PAUSED actors of their current template, EXTERNAL ones per compat
      key (`external_memory`), LOCAL ones per node and key (`local_memory`);
    - `local_waiting[node]`: waiting actors whose latest snapshot is LOCAL on `node`
      (lost when no worker of the class is registered there).
    """

    __slots__ = ("sandbox_class", "workers", "members", "live", "by_node", "by_arch", "live_on_node",
                 "external_memory", "local_memory", "local_waiting")

    def __init__(self, sandbox_class: str):
        self.sandbox_class = sandbox_class
        self.workers = IndexedSet()  # registered (drained included) workers of the class
        self.members: tuple[dict[Compat, IndexedSet], ...] = tuple({} for _ in ROLES)
        self.live: tuple[dict[Compat, int], ...] = tuple({} for _ in ROLES)
        self.by_node: dict[str, IndexedSet] = {}
        self.by_arch: dict[str | None, IndexedSet] = {}
        self.live_on_node: dict[tuple[str, Compat], int] = {}
        self.external_memory: dict[Compat, int] = {}
        self.local_memory: dict[tuple[str, Compat], int] = {}
        self.local_waiting: dict[str, int] = {}

    @property
    def default(self) -> dict[Compat, IndexedSet]:
        return self.members[OWN_DEFAULT]

    @property
    def restorable(self) -> dict[Compat, IndexedSet]:
        return self.members[OWN_RESTORABLE]

    def accepting(self, compat: Compat) -> int:
        """Live workers of the class that can restore a memory snapshot of `compat`, in any role."""
        return sum(live.get(compat, 0) for live in self.live)

    def stranded(self) -> int:
        """Counted memory snapshots that no registered, undrained worker could restore at MEMORY
        (a LOCAL one: no such worker on its node)."""
        external = sum(n for compat, n in self.external_memory.items() if not self.accepting(compat))
        local = sum(n for key, n in self.local_memory.items() if not self.live_on_node.get(key))
        return external + local

    def memory_snapshots(self, compat: Compat) -> int:
        """Counted memory snapshots stamped `compat`, EXTERNAL and LOCAL."""
        local = sum(n for (_, c), n in self.local_memory.items() if c is compat) if self.local_memory else 0
        return self.external_memory.get(compat, 0) + local

    def lost_local(self) -> int:
        """Waiting actors whose LOCAL latest snapshot is on a node with no registered worker of the class."""
        return sum(n for node, n in self.local_waiting.items() if node not in self.by_node)

    def live_count(self) -> int:
        return sum(1 for w in self.workers if w.live)


def _bump(counts: dict[Compat, int], compat: Compat, delta: int) -> None:
    n = counts.get(compat, 0) + delta
    if n:
        counts[compat] = n
    else:
        counts.pop(compat, None)


# --- actors -----------------------------------------------------------------------------------------


class Spec:
    """What an actor asks for (interned: actors created alike share one)."""

    __slots__ = ("sandbox_class", "template_uid", "resources", "selectors", "min_fidelity")

    def __init__(self, sandbox_class: str, template_uid: str, resources: Resources, selectors: Mapping[str, str],
                 min_fidelity: Fidelity):
        self.sandbox_class = sandbox_class
        self.template_uid = template_uid
        self.resources = resources
        self.selectors = selectors
        self.min_fidelity = min_fidelity


class SnapshotKind:
    """What decisions read of an actor's latest snapshot (interned): template, fidelity,
    stamp, borrowed, where it lives (`local`, and the `node` of a LOCAL image: None if it
    did not say), and whether its id is the actor's id followed by the suffix the actor
    keeps (`Actor.snapshot_ref`)."""

    __slots__ = ("template_uid", "fidelity", "stamp", "borrowed", "prefixed", "local", "node")

    def __init__(self, template_uid: str, fidelity: Fidelity, stamp: Stamp | None, borrowed: bool, prefixed: bool,
                 local: bool = False, node: str | None = None):
        self.template_uid = template_uid
        self.fidelity = fidelity
        self.stamp = stamp
        self.borrowed = borrowed
        self.prefixed = prefixed
        self.local = local
        self.node = node


class Lease:
    """What a running actor holds on its worker (interned): the resources booked and the pin."""

    __slots__ = ("booked", "pin")

    def __init__(self, booked: Resources, pin: Stamp):
        self.booked = booked
        self.pin = pin


class Actor(Struct, gc=False, eq=False):
    """One actor without an assignment; one with an assignment is an `Assigned`.

    A Struct untracked by the garbage collector (it is in no reference cycle): 16 bytes
    of header and 8 per field, the most numerous record of the fold. Its record is
    replaced when it gets or loses an assignment: hold on to it only while nothing folds.
    """

    actor_id: str  # the very string that keys `Projection.actors`
    state: str
    spec: Spec
    snapshot: SnapshotKind | None = None  # the latest snapshot, None before the first
    snapshot_ref: str | None = None  # its id, or (`snapshot.prefixed`) the rest after the actor's id
    node: str | None = None  # node of the assignment while RUNNING; the pinned node while PAUSED
    # optimistic concurrency on `actor.<id>`
    version: int = 0
    last_seq: int = 0
    # idempotency: the placements of this life that carried a request_id, newest first, at
    # most RECENT_PLACEMENTS, packed as (64-bit hash of the request id, stream sequence)
    placements: bytes | None = None

    worker: ClassVar[Worker | None] = None
    lease: ClassVar[Lease | None] = None

    # what the actor asks for
    @property
    def sandbox_class(self) -> str:
        return self.spec.sandbox_class

    @property
    def template_uid(self) -> str:
        return self.spec.template_uid

    @property
    def resources(self) -> Resources:
        return self.spec.resources

    @property
    def selectors(self) -> Mapping[str, str]:
        return self.spec.selectors

    @property
    def min_fidelity(self) -> Fidelity:
        return self.spec.min_fidelity

    # its latest snapshot
    @property
    def snapshot_id(self) -> str | None:
        kind = self.snapshot
        if kind is not None and kind.prefixed:
            return self.actor_id + self.snapshot_ref
        return self.snapshot_ref

    @property
    def snap_stamp(self) -> Stamp | None:
        return self.snapshot.stamp if self.snapshot is not None else None

    def placed_by(self, request: int) -> int:
        """The stream sequence of this life's placement that carried the request id whose
        `request_hash` is `request`, if it is among the recent ones; else 0."""
        packed = self.placements
        if packed:
            for h, seq in _PLACEMENT.iter_unpack(packed):
                if h == request:
                    return seq
        return 0

    @property
    def placements_known(self) -> int:
        return len(self.placements) // _PLACEMENT.size if self.placements else 0

    # its assignment
    @property
    def booked(self) -> Resources | None:
        return self.lease.booked if self.lease is not None else None

    @property
    def pin(self) -> Stamp | None:
        return self.lease.pin if self.lease is not None else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.actor_id}, {self.state}, {self.spec.sandbox_class})"


class Assigned(Actor):
    """An actor with an assignment: RUNNING (or made SUSPENDED by a PROMOTE without a release)."""

    worker: Worker | None = None  # the Worker record booked (its record, even if it has since been removed)
    lease: Lease | None = None


_ACTOR_FIELDS = len(Actor.__struct_fields__)

# Recent placements an actor keeps for idempotent retries (see Actor.placements).
RECENT_PLACEMENTS = 4
_PLACEMENT = struct.Struct("<Qq")


def request_hash(request_id: str) -> int:
    """The 64-bit hash an actor keeps of a placement's request id (the same in every process)."""
    return stable_hash(request_id)


def with_placement(packed: bytes | None, request: int, seq: int) -> bytes:
    """`packed` with (request, seq) in front, keeping at most RECENT_PLACEMENTS."""
    entry = _PLACEMENT.pack(request, seq)
    if not packed:
        return entry
    return (entry + packed)[: RECENT_PLACEMENTS * _PLACEMENT.size]


class Projection:
    """The fold. `seq` is the stream sequence of the last message folded."""

    def __init__(self) -> None:
        self.seq = 0
        self.events = 0
        self._ref = weakref.ref(self)  # what worker records know of the projection
        self.workers: dict[str, Worker] = {}
        self.classes: dict[str, ClassIndex] = {}
        self.actors: dict[str, Actor] = {}
        # (version, last seq) of `booking.<id>` subjects of workers not registered now (a
        # registered worker keeps its own), and of any other subject, by aggregate id
        self.bookings: dict[str, tuple[int, int]] = {}
        self.subjects: dict[str, tuple[int, int]] = {}
        # actor id -> sequence of the ActorCreated that began its current life, for actors
        # created more than once (few): an answer recorded before it is of an earlier life
        self.recreated: dict[str, int] = {}
        # called with (actor id, request hash, seq) for each placement folded that carries a
        # request id: what a replica needs to answer a retry that is still waiting to be decided
        self.placed_listener: Callable[[str, int, int], None] | None = None
        # interning tables
        self._compats: dict[CompatKey, Compat] = {}
        self._compat_by_version: dict[tuple[str, CompatVersion], Compat] = {}
        self._stamps: dict[ActorRuntime, Stamp] = {}
        self._runtimes: dict[tuple[str, WorkerRuntime], Runtime] = {}
        self._entries: dict[tuple[int, ...], ClassEntry] = {}
        self._strings: dict[str, str] = {}
        self._resources: dict[Resources, Resources] = {}
        self._selectors: dict[tuple[tuple[str, str], ...], Mapping[str, str]] = {(): _EMPTY}
        self._specs: dict[tuple, Spec] = {}
        self._kinds: dict[tuple, SnapshotKind] = {}
        self._leases: dict[tuple[Resources, Stamp], Lease] = {}
        self._suffixes: dict[str, str] = {}
        # an actor event's handler returns the actor's record as it is after the event
        self._dispatch: dict[type, Callable[[Any, int], Actor | None]] = {
            WorkerRegistered: self._worker_registered,
            RuntimeChanged: self._runtime_changed,
            WorkerUpdated: self._worker_updated,
            WorkerDrained: self._worker_drained,
            WorkerRemoved: self._worker_removed,
            ActorCreated: self._actor_created,
            SnapshotTaken: self._snapshot_taken,
            TemplateChanged: self._template_changed,
            ActorPlaced: self._actor_placed,
            ActorReleased: self._actor_released,
            ActorStopped: self._actor_stopped,
            ActorReverted: self._actor_reverted,
        }

    # --- the fold ---------------------------------------------------------------------

    def apply(self, seq: int, event: Event, version: int | None = None) -> None:
        """Fold one event recorded at stream sequence `seq` (its aggregate version if known)."""
        if seq > self.seq:
            self.seq = seq
        self.events += 1
        kind = type(event)
        if kind is WorkerBooked or kind is WorkerFenced:
            self._booked(seq, event.worker_id, version)
            return
        handler = self._dispatch.get(kind)
        if handler is None and kind not in self._dispatch:  # a subclass of an event type folds as that type
            handler = self._dispatch[kind] = next((self._dispatch[t] for t in kind.__mro__ if t in self._dispatch),
                                                  None)
        if event.KIND == "actor":
            actor = self.actors.get(event.actor_id)
            if actor is None and kind is not ActorCreated:
                self._other_subject(f"actor.{event.actor_id}", seq, version)
                return
            if handler is not None:
                actor = handler(event, seq)  # an actor's handler gives its record as it is now
            actor.version = version or actor.version + 1
            actor.last_seq = seq
            return
        if handler is not None:
            handler(event, seq)
        elif kind is TagRecorded:
            self._other_subject(f"tag.{event.tag}", seq, version)
        elif event.KIND == "booking":  # a marker of a kind this fold does not know: its sequence still guards
            self._booked(seq, event.worker_id, version)

    def booking_marker(self, seq: int, worker_id: str, version: int | None = None) -> None:
        """Fold a message of `booking.<worker id>` (a placement's WorkerBooked or the registry's
        WorkerFenced) known from its subject alone (all the fold needs of it), without decoding
        its body; the same as `apply` of the event."""
        if seq > self.seq:
            self.seq = seq
        self.events += 1
        self._booked(seq, worker_id, version)

    def _booked(self, seq: int, worker_id: str, version: int | None) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.booking_version = version or worker.booking_version + 1
            worker.booking_seq = seq
            return
        previous = self.bookings.get(worker_id)
        self.bookings[worker_id] = (version or (previous[0] + 1 if previous else 1), seq)

    def skip(self, seq: int) -> None:
        """A message that is not an event (e.g. a tracking record) still advances the position."""
        if seq > self.seq:
            self.seq = seq

    def _other_subject(self, aggregate_id: str, seq: int, version: int | None) -> None:
        previous = self.subjects.get(aggregate_id)
        self.subjects[aggregate_id] = (version or (previous[0] + 1 if previous else 1), seq)

    # --- interning --------------------------------------------------------------------------

    def compat(self, sandbox_class: str, version: CompatVersion) -> Compat:
        found = self._compat_by_version.get((sandbox_class, version))
        if found is not None:
            return found
        key = compat_key(sandbox_class, version)
        found = self._compats.get(key)
        if found is None:
            found = self._compats[key] = Compat(key, version)
        self._compat_by_version[(sandbox_class, version)] = found
        return found

    def compat_of_key(self, key: CompatKey) -> Compat | None:
        """The interned compat key equal to `key`, if the log has named it."""
        return self._compats.get(key)

    def stamp(self, runtime: ActorRuntime) -> Stamp:
        found = self._stamps.get(runtime)
        if found is None:
            found = self._stamps[runtime] = Stamp(runtime, self.compat(runtime.sandbox_class, runtime.version))
        return found

    def _runtime(self, sandbox_class: str, runtime: WorkerRuntime) -> Runtime:
        found = self._runtimes.get((sandbox_class, runtime))
        if found is None:
            edges = tuple(self.compat(sandbox_class, v) for v in runtime.compatible_versions)
            found = Runtime(self.compat(sandbox_class, runtime.version), runtime, edges)
            self._runtimes[(sandbox_class, runtime)] = found
        return found

    def _entry(self, default: Runtime, restorable: tuple[Runtime, ...]) -> ClassEntry:
        key = (id(default), *map(id, restorable))  # interned runtimes: identity stands for content
        found = self._entries.get(key)
        if found is None:
            found = self._entries[key] = ClassEntry(default, restorable)
        return found

    def _str(self, text: str) -> str:
        return self._strings.setdefault(text, text)

    def _res(self, resources: Resources) -> Resources:
        return self._resources.setdefault(resources, resources)

    def _sel(self, selectors: Mapping[str, str]) -> Mapping[str, str]:
        if not selectors:
            return _EMPTY
        key = tuple(sorted(selectors.items()))
        found = self._selectors.get(key)
        if found is None:
            found = self._selectors[key] = dict(key)
        return found

    def spec(self, sandbox_class: str, template_uid: str, resources: Resources, selectors: Mapping[str, str],
             min_fidelity: Fidelity) -> Spec:
        """The interned Spec; `resources` and `selectors` must be interned already (their
        identity stands for their content)."""
        key = (sandbox_class, template_uid, id(resources), id(selectors), min_fidelity)
        found = self._specs.get(key)
        if found is None:
            found = self._specs[key] = Spec(
                self._str(sandbox_class), self._str(template_uid), resources, selectors, min_fidelity
            )
        return found

    def snapshot_kind(self, template_uid: str, fidelity: Fidelity, stamp: Stamp | None, borrowed: bool,
                      prefixed: bool, local: bool = False, node: str | None = None) -> SnapshotKind:
        key = (template_uid, fidelity, stamp, borrowed, prefixed, local, node)
        found = self._kinds.get(key)
        if found is None:
            found = self._kinds[key] = SnapshotKind(self._str(template_uid), fidelity, stamp, borrowed, prefixed,
                                                    local, None if node is None else self._str(node))
        return found

    def lease(self, booked: Resources, pin: Stamp) -> Lease:
        """The interned Lease; `booked` must be interned already."""
        key = (booked, pin)
        found = self._leases.get(key)
        if found is None:
            found = self._leases[key] = Lease(booked, pin)
        return found

    def snapshot_ref(self, actor_id: str, snapshot_id: str) -> tuple[bool, str]:
        """(prefixed, what an actor keeps of `snapshot_id`): the interned rest after the
        actor's id when the id starts with it, else the id itself."""
        if not snapshot_id.startswith(actor_id):
            return False, snapshot_id
        return True, self.suffix(snapshot_id[len(actor_id):])

    def suffix(self, rest: str) -> str:
        """A snapshot id's rest after the actor's id, interned (while the table has room)."""
        found = self._suffixes.get(rest)
        if found is None:
            if len(self._suffixes) >= SUFFIXES_INTERNED:
                return rest
            found = self._suffixes[rest] = rest
        return found

    def class_index(self, sandbox_class: str) -> ClassIndex:
        index = self.classes.get(sandbox_class)
        if index is None:
            index = self.classes[sandbox_class] = ClassIndex(sandbox_class)
        return index

    # --- workers ------------------------------------------------------------------------

    def _index(self, worker: Worker, delta: int) -> None:
        """Add (+1) or remove (-1) a worker from the indices of its classes."""
        live = worker.live
        node = worker.node
        for name, entry in worker.classes.items():
            index = self.class_index(name)
            _member(index.by_node, node, worker, delta)
            _member(index.by_arch, entry.arch, worker, delta)
            if delta > 0:
                index.workers.add(worker)
            else:
                index.workers.discard(worker)
            for compat, (role, _) in entry.accepts.items():
                _member(index.members[role], compat, worker, delta)
                if live:
                    _bump(index.live[role], compat, delta)
                    _bump(index.live_on_node, (node, compat), delta)

    def _set_live(self, worker: Worker, live: bool) -> None:
        """Move a worker's contribution to the live counts when it is drained (or undrained)."""
        if worker.live == live:
            return
        delta = 1 if live else -1
        node = worker.node
        for name, entry in worker.classes.items():
            index = self.class_index(name)
            for compat, (role, _) in entry.accepts.items():
                _bump(index.live[role], compat, delta)
                _bump(index.live_on_node, (node, compat), delta)

    def _classes(self, entries: tuple[WorkerSandboxClass, ...]) -> dict[str, ClassEntry]:
        classes = {}
        for entry in entries:
            name = self._str(entry.sandbox_class)
            classes[name] = self._entry(
                self._runtime(name, entry.default_runtime),
                tuple(self._runtime(name, r) for r in entry.restorable_runtimes),
            )
        return classes

    def _worker_registered(self, event: WorkerRegistered, seq: int) -> None:
        worker = self.workers.get(event.worker_id)
        if worker is not None:  # registered again without a removal: take the new content
            self._index(worker, -1)
        else:
            worker = self.workers[event.worker_id] = Worker(event.worker_id, self._ref)
            previous = self.bookings.pop(event.worker_id, None)  # booked before, under another record
            if previous is not None:
                worker.booking_version, worker.booking_seq = previous
        worker.state = REGISTERED
        worker.node = self._str(event.node)
        worker.cpu_millis = event.capacity.cpu_millis
        worker.memory_mib = event.capacity.memory_mib
        worker.labels = self._sel(event.labels)
        worker.classes = self._classes(event.sandbox_classes)
        self._index(worker, +1)

    def _runtime_changed(self, event: RuntimeChanged, seq: int) -> None:
        worker = self.workers.get(event.worker_id)
        if worker is None:
            return
        self._index(worker, -1)
        worker.classes = self._classes(event.sandbox_classes)
        self._index(worker, +1)

    def _worker_updated(self, event: WorkerUpdated, seq: int) -> None:
        worker = self.workers.get(event.worker_id)
        if worker is None:
            return
        node = self._str(event.node)
        if node is not worker.node:  # its place in the per-node indices moves with it
            self._index(worker, -1)
            worker.node = node
            self._index(worker, +1)
        worker.cpu_millis = event.capacity.cpu_millis
        worker.memory_mib = event.capacity.memory_mib
        worker.labels = self._sel(event.labels)

    def _worker_drained(self, event: WorkerDrained, seq: int) -> None:
        worker = self.workers.get(event.worker_id)
        if worker is None:
            return
        self._set_live(worker, False)
        worker.state = DRAINED

    def _worker_removed(self, event: WorkerRemoved, seq: int) -> None:
        worker = self.workers.pop(event.worker_id, None)
        if worker is None:
            return
        self._index(worker, -1)
        if worker.booking_seq:  # its booking subject goes on; a new registration takes it up
            self.bookings[worker.worker_id] = (worker.booking_version, worker.booking_seq)
        # Actors still assigned keep a reference to this record until the snapshotter
        # releases them; their bookings no longer count anywhere.

    # --- actors -------------------------------------------------------------------------

    def _count(self, actor: Actor, delta: int) -> None:
        """Count (or uncount) what fragmentation reads of a waiting actor's latest snapshot:
        a MEMORY snapshot of its current template (SUSPENDED or PAUSED) for `stranded`, and
        a LOCAL one's node for `lost_local`."""
        kind = actor.snapshot
        if kind is None:
            return
        state = actor.state
        if kind.local and state in WAITING:
            _bump(self.class_index(actor.spec.sandbox_class).local_waiting, kind.node or "", delta)
        if kind.fidelity is MEMORY and kind.stamp is not None and (state is SUSPENDED or state is PAUSED) \
                and kind.template_uid == actor.spec.template_uid:
            index = self.class_index(actor.spec.sandbox_class)
            compat = kind.stamp.compat
            if kind.local:
                _bump(index.local_memory, (kind.node or "", compat), delta)
            else:
                _bump(index.external_memory, compat, delta)

    def _set_snapshot(self, actor: Actor, snapshot: Snapshot | None, node: str | None = None) -> None:
        """The actor's latest snapshot is now `snapshot` (None: it has none); a LOCAL one that
        names no node is on `node`, if given."""
        if snapshot is None:
            actor.snapshot = actor.snapshot_ref = None
            return
        prefixed, actor.snapshot_ref = self.snapshot_ref(actor.actor_id, snapshot.snapshot_id)
        runtime = snapshot.sandbox_runtime
        local = snapshot.location is Location.LOCAL
        actor.snapshot = self.snapshot_kind(
            snapshot.template_uid, snapshot.fidelity, self.stamp(runtime) if runtime is not None else None,
            snapshot.borrowed, prefixed, local, (snapshot.node or node) if local else None,
        )

    def _release(self, actor: Actor) -> Actor:
        """Give up the actor's assignment, if it has one; its record from now on."""
        if type(actor) is not Assigned:
            return actor
        actor.worker.unbook(actor.lease.booked)
        actor = self.actors[actor.actor_id] = Actor(*astuple(actor)[:_ACTOR_FIELDS])
        return actor

    def _assign(self, actor: Actor, worker: Worker, lease: Lease) -> Actor:
        """Book the actor on `worker` (after `_release`); its record from now on."""
        worker.book(lease.booked)
        if type(actor) is not Assigned:
            actor = self.actors[actor.actor_id] = Assigned(*astuple(actor))
        actor.worker = worker
        actor.lease = lease
        return actor

    def _actor_created(self, event: ActorCreated, seq: int) -> Actor:
        spec = self.spec(event.sandbox_class, event.template_uid, self._res(event.resources),
                         self._sel(event.selectors), event.min_fidelity)
        actor = self.actors.get(event.actor_id)
        if actor is None:
            actor = self.actors[event.actor_id] = Actor(event.actor_id, CREATED, spec)
            previous = self.subjects.pop(f"actor.{event.actor_id}", None) if self.subjects else None
            if previous is not None:
                actor.version, actor.last_seq = previous
        else:  # created anew after a stop: a new life, nothing of the last one carries over
            self._count(actor, -1)
            actor = self._release(actor)
            actor.state = CREATED
            actor.spec = spec
            actor.node = None
            actor.placements = None
            self.recreated[actor.actor_id] = seq
        self._set_snapshot(actor, event.snapshot)
        self._count(actor, +1)
        return actor

    def _snapshot_taken(self, event: SnapshotTaken, seq: int) -> Actor:
        actor = self.actors[event.actor_id]
        origin = event.origin
        if origin is SnapshotOrigin.TAG:  # a copy under a tag: the actor's own latest is unchanged
            return actor
        self._count(actor, -1)
        snapshot = event.snapshot
        # a LOCAL image that names no node is on the node the actor runs on
        self._set_snapshot(actor, snapshot, actor.node if actor.state is RUNNING else None)
        if origin is SnapshotOrigin.PAUSE:
            node = actor.snapshot.node or actor.node
            actor = self._release(actor)
            actor.state = PAUSED
            actor.node = node
        elif origin is SnapshotOrigin.SUSPEND:
            actor = self._release(actor)
            actor.state = SUSPENDED
            actor.node = None
        elif origin is SnapshotOrigin.PROMOTE:
            actor.state = SUSPENDED
            actor.node = None
        self._count(actor, +1)
        return actor

    def _template_changed(self, event: TemplateChanged, seq: int) -> Actor:
        actor = self.actors[event.actor_id]
        self._count(actor, -1)  # a memory snapshot of the old template no longer counts
        spec = actor.spec
        actor.spec = self.spec(spec.sandbox_class, event.template_uid, spec.resources, spec.selectors,
                               spec.min_fidelity)
        self._count(actor, +1)
        return actor

    def _actor_placed(self, event: ActorPlaced, seq: int) -> Actor:
        actor = self.actors[event.actor_id]
        self._count(actor, -1)
        actor = self._release(actor)  # a placement without a release in between replaces the old one
        worker = self.workers.get(event.worker_id)
        if worker is None:  # placed on a worker removed meanwhile: a record of its own, which no decision reads
            worker = Worker(event.worker_id, self._ref)
            worker.state = DRAINED
        actor = self._assign(actor, worker, self.lease(self._res(event.booked), self.stamp(event.sandbox_runtime)))
        actor.node = self._str(event.node)
        actor.state = RUNNING
        request_id = event.request_id
        if request_id is not None:
            request = request_hash(request_id)
            actor.placements = with_placement(actor.placements, request, seq)
            if self.placed_listener is not None:
                self.placed_listener(actor.actor_id, request, seq)
        return actor

    def _actor_released(self, event: ActorReleased, seq: int) -> Actor:
        actor = self.actors[event.actor_id]
        self._count(actor, -1)
        node = actor.node
        actor = self._release(actor)
        reason = event.reason
        if reason is ReleaseReason.PAUSED:
            # pinned to the node it ran on (or the one its PAUSE snapshot, folded first, named)
            actor.state = PAUSED
            actor.node = node
        elif reason is ReleaseReason.STOPPED:
            actor.state = STOPPED
            actor.node = None
        else:  # SUSPENDED, or WORKER_REMOVED: resumable from its latest snapshot, wherever it is
            actor.state = SUSPENDED
            actor.node = None
        self._count(actor, +1)
        return actor

    def _actor_stopped(self, event: ActorStopped, seq: int) -> Actor:
        actor = self.actors[event.actor_id]
        self._count(actor, -1)
        actor = self._release(actor)
        actor.state = STOPPED
        actor.node = None
        return actor

    def _actor_reverted(self, event: ActorReverted, seq: int) -> Actor:
        actor = self.actors[event.actor_id]
        self._count(actor, -1)
        actor = self._release(actor)
        self._set_snapshot(actor, event.snapshot)
        actor.state = SUSPENDED
        actor.node = None
        self._count(actor, +1)
        return actor

    # --- reads --------------------------------------------------------------------------

    def actor_expectation(self, actor_id: str) -> tuple[int, int]:
        """(version, last stream seq) of `actor.<id>`: what the next commit on it expects."""
        actor = self.actors.get(actor_id)
        if actor is not None:
            return actor.version, actor.last_seq
        return self.subjects.get(f"actor.{actor_id}", (0, 0))

    def booking_expectation(self, worker_id: str) -> tuple[int, int]:
        """(version, last stream seq) of `booking.<worker id>`."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            return worker.booking_version, worker.booking_seq
        return self.bookings.get(worker_id, (0, 0))

    def life_started(self, actor_id: str) -> int:
        """The sequence of the ActorCreated that began the actor's current life if it was
        created more than once; 0 otherwise."""
        return self.recreated.get(actor_id, 0)

    def stranded(self, sandbox_class: str | None = None) -> int:
        if sandbox_class is not None:
            index = self.classes.get(sandbox_class)
            return index.stranded() if index else 0
        return sum(index.stranded() for index in self.classes.values())

    def lost_local(self, sandbox_class: str | None = None) -> int:
        if sandbox_class is not None:
            index = self.classes.get(sandbox_class)
            return index.lost_local() if index else 0
        return sum(index.lost_local() for index in self.classes.values())


def _member(table: dict[Any, IndexedSet], key: Any, worker: Worker, delta: int) -> None:
    """Add the worker to (delta > 0) or remove it from the member set `table[key]`."""
    members = table.get(key)
    if delta > 0:
        if members is None:
            members = table[key] = IndexedSet()
        members.add(worker)
    elif members is not None:
        members.discard(worker)
        if not members:
            del table[key]
