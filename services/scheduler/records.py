"""The records the scheduler's projection is made of (pure data, no I/O).

Memory is kept small on purpose, because a projection holds every actor of a
deployment (about 300 bytes each, as `bench/recovery.py` measures it):

- one actor is one msgspec Struct that the garbage collector does not track (no
  reference cycle passes through it), 16 bytes of header and 8 per field; an actor
  with an assignment is an `Assigned` (two fields more), the other actors do not pay
  for them;
- what many actors have alike is interned (`services.scheduler.interner`) and referred
  to: compat keys, stamps, runtimes, templates, resources, selector maps, and the
  combinations an actor refers to as one (`Spec`: what it asks for; `SnapshotKind`:
  what decisions read of its latest snapshot, where it lives included; `Lease`: what
  it books while running);
- a snapshot id that starts with the actor's id (the snapshotter's default is
  `<actor id>-v<version>`) is kept as the interned rest;
- a worker counts the actors booked on it and keeps the OCC expectation of its
  `booking.<id>` subject.
"""

from __future__ import annotations

import hashlib
import struct
from math import ceil
from typing import Any, ClassVar, Iterable, Iterator, Mapping

from msgspec import Struct

from events.compat import CompatKey, architecture, compat_key, describe_key, machine_architecture, other_architecture
from events.schema import (ActorPlaced, ActorRuntime, CompatVersion, Fidelity, PlacedFidelity, Placement, Resources,
                           WorkerRuntime)
from events.states import ActorState, WorkerState

# Memory every worker keeps out of what it offers to actors (CONTRACT placement rule 6).
WORKER_RESERVE_MIB = 64

# The states (events.states), by the names decisions read them with. A removed worker
# leaves the projection; registering it again starts afresh.
REGISTERED, DRAINED = WorkerState.REGISTERED, WorkerState.DRAINED
CREATED, RUNNING, PAUSED = ActorState.CREATED, ActorState.RUNNING, ActorState.PAUSED
SUSPENDED, STOPPED = ActorState.SUSPENDED, ActorState.STOPPED

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


class Compat:
    """One interned compat key: (class, schema version, sorted attributes), its version,
    and its `architecture` attribute (None if it has none)."""

    __slots__ = ("key", "sandbox_class", "version", "arch")

    def __init__(self, key: CompatKey, version: CompatVersion):
        self.key = key
        self.sandbox_class = key[0]
        self.version = version
        self.arch = architecture(version)  # in Go's naming: `x86_64` is amd64, as the registry reads it

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

    def need_mib(self, memory_mib: int) -> int:
        """The memory an actor of `memory_mib` books under this runtime: its own and the runtime's
        overhead, `fixed_mib + per_gib_mib * ceil(memory_mib / 1024)` (CONTRACT placement rule 6).
        The one definition: `feasibility.Ask.judge` judges a worker's room by it, `audit verify` a
        placement's booking (UNDER_BOOKED)."""
        if self.per_gib_mib:
            return memory_mib + self.fixed_mib + self.per_gib_mib * ceil(memory_mib / 1024)
        return memory_mib + self.fixed_mib


class ClassEntry:
    """What one worker runs for one sandbox class (interned: workers configured alike share one).

    `accepting` maps every compat key a memory snapshot may carry to restore here to every
    (role, runtime) of the entry that accepts it, in the order placement rule 2 prefers them
    (by role, then the entry's order of its restorable runtimes). Most keys have one; a key
    has several when, say, a restorable runtime's own version is also an edge of the
    default: if the first has no room for an actor (its overhead), the next may. `accepts`
    is the first of each, `roles` the distinct roles of each, in that order. `runs`: whether the
    default is of the worker's machine (it names no other architecture), so that anything may run
    under it there: a cold boot, or a restore without memory (`feasibility.Ask.judge`)."""

    __slots__ = ("default", "restorable", "accepting", "accepts", "roles", "runs")

    def __init__(self, default: Runtime, restorable: tuple[Runtime, ...], machine: str | None):
        self.default = default
        self.restorable = restorable
        # A registration the registry refuses now (`check_one_machine`), as a log written before that
        # rule, or by a registry replica of that earlier version, may hold: a default of another
        # architecture than the machine. Nothing runs under it: volumes or a root file system of its
        # architecture would land on the machine, and a cold boot pinned to it would stamp the actor's
        # next snapshots with an architecture its memory is not of.
        self.runs = other_architecture(default.compat.version, machine) is None
        # Only what the worker's machine can load (`machine`: `worker_machine` of its whole
        # registration): the registry refuses a version of another architecture, in any class
        # (`events.validate.check_one_machine`); one a log holds from before is not indexed, so
        # no memory image is sent across architectures.
        loads = [(role, r) for role, r in ((OWN_DEFAULT, default), *((OWN_RESTORABLE, r) for r in restorable))
                 if other_architecture(r.compat.version, machine) is None]
        accepting: dict[Compat, list[tuple[int, Runtime]]] = {}
        for role, runtime in loads:
            accepting.setdefault(runtime.compat, []).append((role, runtime))
        for role, runtime in ((EDGE_DEFAULT if role == OWN_DEFAULT else EDGE_RESTORABLE, r) for role, r in loads):
            for edge in runtime.edges:
                if other_architecture(edge.version, machine) is None:
                    accepting.setdefault(edge, []).append((role, runtime))
        self.accepting: dict[Compat, tuple[tuple[int, Runtime], ...]] = {
            compat: tuple(matches) for compat, matches in accepting.items()}
        self.accepts: dict[Compat, tuple[int, Runtime]] = {
            compat: matches[0] for compat, matches in self.accepting.items()}
        self.roles: dict[Compat, tuple[int, ...]] = {
            compat: tuple(dict.fromkeys(role for role, _ in matches)) for compat, matches in self.accepting.items()}

    @property
    def arch(self) -> str | None:
        """The architecture of the class default: what a restore without memory runs on."""
        return self.default.compat.arch


class Worker:
    __slots__ = (
        "worker_id",
        "node",
        "place",  # the disk of its node it registered from (`services.scheduler.places`): what rule 5 reads
        "token",  # the node token it registered (None: none), as the views show it
        "cpu_millis",
        "memory_mib",
        "labels",
        "state",
        "classes",  # {sandbox_class: ClassEntry}
        "booked_cpu",
        "booked_mem",
        "holding",  # how many actors hold bookings on this worker (`Projection.booked_on` names them)
        "sets",  # the member sets of the class indices this worker is in (their versions move with its room)
        # optimistic concurrency on `booking.<worker id>`
        "booking_version",
        "booking_seq",
        "since",  # the stream sequence of the WorkerRegistered that began this life (this record)
    )

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self.node = ""
        self.place = ""
        self.token: str | None = None
        self.cpu_millis = 0
        self.memory_mib = 0
        self.labels: Mapping[str, str] = _EMPTY
        self.state = REGISTERED
        self.classes: dict[str, ClassEntry] = {}
        self.booked_cpu = 0
        self.booked_mem = 0
        self.holding = 0
        self.sets: list[IndexedSet] = []
        self.booking_version = 0
        self.booking_seq = 0
        self.since = 0

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

    def book(self, booked: Resources) -> None:
        self.booked_cpu += booked.cpu_millis
        self.booked_mem += booked.memory_mib
        self.holding += 1
        self.touch()

    def unbook(self, booked: Resources) -> None:
        self.booked_cpu -= booked.cpu_millis
        self.booked_mem -= booked.memory_mib
        self.holding -= 1
        self.touch()

    def touch(self) -> None:
        """Its room changed (a booking, a capacity change, bookings in flight): what decisions
        found of the sets it is in may no longer hold."""
        for members in self.sets:
            members.version += 1

    def __repr__(self) -> str:
        return f"Worker({self.worker_id} on {self.node}, {self.state}, room {self.room_cpu}m/{self.room_mem}MiB)"


class IndexedSet:
    """Workers in a stable order with O(1) add, remove and access by position.

    Removal moves the last member into the hole, so the order is a function of the
    sequence of operations alone: every replica that folds the same log gets the same
    order, which keeps sampling by position deterministic.
    """

    __slots__ = ("items", "pos", "version")

    def __init__(self) -> None:
        self.items: list[Worker] = []
        self.pos: dict[str, int] = {}
        # moves whenever a member comes or goes or its room changes: what a decision
        # found of this set stays true while it stays (a refusal's message is memoised on it)
        self.version = 0

    def add(self, worker: Worker) -> None:
        if worker.worker_id not in self.pos:
            self.pos[worker.worker_id] = len(self.items)
            self.items.append(worker)
            self.version += 1

    def discard(self, worker: Worker) -> None:
        i = self.pos.pop(worker.worker_id, None)
        if i is None:
            return
        self.version += 1
        last = self.items.pop()
        if last is not worker:
            self.items[i] = last
            self.pos[last.worker_id] = i

    def __getitem__(self, i: int) -> Worker:
        return self.items[i]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Worker]:
        return iter(self.items)

    def __contains__(self, worker: Worker) -> bool:
        return worker.worker_id in self.pos


class ClassIndex:
    """Per sandbox class: its workers, the indices decisions look things up in, and the
    counts fragmentation reads.

    - `members[role][compat]`: the workers accepting `compat` in that role (a worker in every
      role it accepts `compat` in: `ClassEntry.accepting`); `live[role][compat]` how many
      live workers accept `compat` best in that role (each worker counted once per key);
    - `by_node[place]`, `by_arch[architecture]`: the workers on a place (a disk of a node,
      `services.scheduler.places`: what rule 5 restricts a LOCAL image to), and by the
      architecture of their class default (a restore without memory keeps the stamp's);
    - `live_on_node[(place, compat)]`: live workers on a place accepting `compat` in any role;
    - what counts as stranded (CONTRACT section 3): the latest MEMORY snapshots of
      SUSPENDED and PAUSED actors of their current template, EXTERNAL ones per compat
      key (`external_memory`), LOCAL ones per place and key (`local_memory`);
    - `local_waiting[place]`: waiting actors whose latest snapshot is LOCAL on `place`
      (lost when no worker of the class is registered there);
    - `cpu_caps[cpu millis]`, `mem_caps[memory MiB]`: how many of its workers (`workers`) have
      that capacity, so that the largest is known without a pass over them (`largest`: a
      refusal says when an actor is bigger than any worker of its class).
    """

    __slots__ = ("sandbox_class", "workers", "members", "live", "by_node", "by_arch", "live_on_node",
                 "external_memory", "local_memory", "local_waiting", "cpu_caps", "mem_caps")

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
        self.cpu_caps: dict[int, int] = {}
        self.mem_caps: dict[int, int] = {}

    def count_capacity(self, worker: Worker, delta: int) -> None:
        """Count (+1) or uncount (-1) a member's capacity in `cpu_caps` and `mem_caps`."""
        bump_count(self.cpu_caps, worker.cpu_millis, delta)
        bump_count(self.mem_caps, worker.memory_mib, delta)

    def largest(self) -> tuple[int, int] | None:
        """(the most CPU millis, the most memory MiB) a worker of the class has, each (two workers
        may have them), drained ones included; None without a worker. Over the distinct capacities,
        which a fleet has few of."""
        if not self.cpu_caps:
            return None
        return max(self.cpu_caps), max(self.mem_caps)

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
        (a LOCAL one: no such worker on its place, the disk of its node it was written to)."""
        external = sum(n for compat, n in self.external_memory.items() if not self.accepting(compat))
        local = sum(n for key, n in self.local_memory.items() if not self.live_on_node.get(key))
        return external + local

    def memory_snapshots(self, compat: Compat) -> int:
        """Counted memory snapshots stamped `compat`, EXTERNAL and LOCAL."""
        local = sum(n for (_, c), n in self.local_memory.items() if c is compat) if self.local_memory else 0
        return self.external_memory.get(compat, 0) + local

    def lost_local(self) -> int:
        """Waiting actors whose LOCAL latest snapshot is on a place (a disk of its node) with no registered worker
        of the class: a node with none, or one that has registered from another disk since."""
        return sum(n for place, n in self.local_waiting.items() if place not in self.by_node)

    def live_count(self) -> int:
        return sum(1 for w in self.workers if w.live)


def bump_count(counts: dict[Any, int], compat: Any, delta: int) -> None:
    n = counts.get(compat, 0) + delta
    if n:
        counts[compat] = n
    else:
        counts.pop(compat, None)


# --- actors -----------------------------------------------------------------------------------------


class Spec:
    """What an actor asks for (interned: actors created alike share one)."""

    __slots__ = ("sandbox_class", "template_uid", "resources", "selectors", "min_fidelity", "selector_pairs")

    def __init__(self, sandbox_class: str, template_uid: str, resources: Resources, selectors: Mapping[str, str],
                 min_fidelity: Fidelity):
        self.sandbox_class = sandbox_class
        self.template_uid = template_uid
        self.resources = resources
        self.selectors = selectors
        self.min_fidelity = min_fidelity
        self.selector_pairs = tuple(sorted(selectors.items()))  # as the feasibility checks read them


class SnapshotKind:
    """What decisions read of an actor's latest snapshot (interned): template, fidelity,
    stamp, borrowed, whether it is a LOCAL image (its node is the actor's, `Actor.image_node`:
    kept per actor, a kind per node would make most kinds one actor's), and whether its id
    is the actor's id followed by the suffix the actor keeps (`Actor.snapshot_ref`)."""

    __slots__ = ("template_uid", "fidelity", "stamp", "borrowed", "prefixed", "local")

    def __init__(self, template_uid: str, fidelity: Fidelity, stamp: Stamp | None, borrowed: bool, prefixed: bool,
                 local: bool = False):
        self.template_uid = template_uid
        self.fidelity = fidelity
        self.stamp = stamp
        self.borrowed = borrowed
        self.prefixed = prefixed
        self.local = local


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
    # place (`services.scheduler.places`: a disk of a node) of the assignment while RUNNING; the pinned
    # place while PAUSED
    node: str | None = None
    # optimistic concurrency on `actor.<id>`
    version: int = 0
    last_seq: int = 0
    # idempotency: the placements of this life that carried a request_id, newest first, at
    # most RECENT_PLACEMENTS, packed as (64-bit hash of the request id, stream sequence);
    # once one was pushed out, followed by a filter of the hashes pushed out (`with_placement`)
    placements: bytes | None = None
    # the place (a disk of a node) of the latest snapshot when it is a LOCAL image (None: not LOCAL, or
    # a LOCAL image that named no node, taken while the actor ran nowhere)
    image_node: str | None = None
    # the recent placements of the actor's last life (its `placements` when it was created anew,
    # without their filter): a resume carrying one of their request ids is refused
    # (`placed_earlier`), not placed in this life
    earlier: bytes | None = None

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
            for h, seq in _PLACEMENT.iter_unpack(packed[:_RECENT_BYTES]):
                if h == request:
                    return seq
        return 0

    def placed_earlier(self, request: int) -> int:
        """The stream sequence of a placement of the actor's last life, among its recent ones, that
        carried the request id whose `request_hash` is `request`; else 0. Exact (no filter): a new
        id is never taken for an earlier life's."""
        packed = self.earlier
        if packed:
            for h, seq in _PLACEMENT.iter_unpack(packed):
                if h == request:
                    return seq
        return 0

    def may_have_pushed_out(self, request: int) -> bool:
        """Whether a placement of this life carrying `request` may have been pushed out of the
        recent ones (then only the reply cache knows it). False is certain: no placement of
        this life that carried it was pushed out; True may be wrong (`with_placement`)."""
        packed = self.placements
        if not packed or len(packed) <= _RECENT_BYTES:
            return False
        bits = _pushed_out_bits(request)
        return int.from_bytes(packed[_RECENT_BYTES:], "little") & bits == bits

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


ACTOR_FIELDS = len(Actor.__struct_fields__)

# Recent placements an actor keeps for idempotent retries (see Actor.placements).
RECENT_PLACEMENTS = 4
_PLACEMENT = struct.Struct("<Qq")
_RECENT_BYTES = RECENT_PLACEMENTS * _PLACEMENT.size
# Behind a full set of recent placements: a Bloom filter of the request hashes pushed out of
# them in this life, PUSHED_OUT_BITS bits, 3 set per hash. A resume whose request id is not in
# it is new, without a read of the reply cache; one that is in it (all pushed out, and by
# chance about 1% of new ids after 50 pushed out, 7% after 100) is looked up there.
PUSHED_OUT_BITS = 512
_FILTER_BYTES = PUSHED_OUT_BITS // 8


def _pushed_out_bits(request: int) -> int:
    """The filter bits of a request hash: three 9-bit slices of it (a blake2b hash: uniform)."""
    return (1 << (request & 511)) | (1 << ((request >> 9) & 511)) | (1 << ((request >> 18) & 511))


def named_image(placement: Placement | ActorPlaced) -> CompatKey | None:
    """The compat key of the image a placement at MEMORY restores, as its record names it: its matched
    version (v1.1), or, null, its pin's own; None for one without memory. The one reading: what a worker
    checks the image against before it loads it and a retry's answer is judged by
    (`Projection.cannot_carry_out`), and what `audit verify` holds equal to the image's stamp (MATCHED_OTHER)."""
    if placement.fidelity is not PlacedFidelity.MEMORY:
        return None
    pin = placement.sandbox_runtime
    return compat_key(pin.sandbox_class, placement.matched_version or pin.version)


def request_hash(request_id: str) -> int:
    """The 64-bit hash an actor keeps of a placement's request id (the same in every process)."""
    return stable_hash(request_id)


def oldest_placement(packed: bytes | None) -> tuple[int, int] | None:
    """The (request hash, seq) the next placement will push out of a full `packed`, if any."""
    if not packed or len(packed) < _RECENT_BYTES:
        return None
    return _PLACEMENT.unpack_from(packed, _RECENT_BYTES - _PLACEMENT.size)


def recent_of(packed: bytes | None) -> bytes | None:
    """The recent placements of `packed` (an actor's `placements`) without the filter behind them."""
    return packed[:_RECENT_BYTES] if packed else None


def with_placement(packed: bytes | None, request: int, seq: int) -> bytes:
    """`packed` with (request, seq) in front, keeping at most RECENT_PLACEMENTS; the one it
    pushes out, if any, joins the filter behind them (`Actor.may_have_pushed_out`)."""
    entry = _PLACEMENT.pack(request, seq)
    if not packed:
        return entry
    recent = packed[:_RECENT_BYTES]
    if len(recent) < _RECENT_BYTES:
        return entry + recent
    pushed = _PLACEMENT.unpack_from(recent, _RECENT_BYTES - _PLACEMENT.size)[0]
    bits = int.from_bytes(packed[_RECENT_BYTES:], "little") | _pushed_out_bits(pushed)
    return entry + recent[:-_PLACEMENT.size] + bits.to_bytes(_FILTER_BYTES, "little")


def set_member(table: dict[Any, IndexedSet], key: Any, worker: Worker, delta: int) -> None:
    """Add the worker to (delta > 0) or remove it from the member set `table[key]`; the
    worker keeps the sets it is in (`Worker.sets`)."""
    members = table.get(key)
    if delta > 0:
        if members is None:
            members = table[key] = IndexedSet()
        if worker not in members:
            members.add(worker)
            worker.sets.append(members)
    elif members is not None:
        members.discard(worker)
        if members in worker.sets:
            worker.sets.remove(members)
        if not members:
            del table[key]


def worker_machine(classes: Iterable[tuple[Runtime, tuple[Runtime, ...]]]) -> str | None:
    """The architecture of the machine a worker runs on, from its registration's class entries
    ((default, restorable runtimes) each, in its order): the first its versions name, the first
    class's default's first (`events.compat.machine_architecture`; the registry's rule is
    `events.validate.check_one_machine`, on the same versions in the same order)."""
    return machine_architecture(
        v for default, restorable in classes for r in (default, *restorable)
        for v in (r.compat.version, *(e.version for e in r.edges)))
