"""A scheduler projection as bytes and back: pure (no I/O, no asyncio, no clock).

`export_state(projection)` copies everything the fold keeps into msgspec Structs
(`State`); `restore_state(state)` builds a new projection from them that is the
same, field for field and order for order, as the one exported:

- Objects shared by reference in the projection (workers, interned compat keys,
  stamps, runtimes, resources, label and selector maps, actors' specs, snapshot
  kinds and leases) are written once, in tables, and referred to by position, so a
  restored projection shares them the same way (an actor's booking points at the
  very Worker record in its class index; all snapshots of one runtime share one
  Stamp) and is as small in memory.
- Orders that decisions depend on are kept as they are: the member lists of every
  `IndexedSet` (power-of-two sampling draws by position), the order of workers,
  actors and classes, the counts tables. So `decide` gives the same worker for
  the same position on a restored projection as on a full replay.
- A worker record that is no longer registered but still referred to by an actor
  (its booking outlived a `WorkerRemoved`) is written too, after the registered ones.

`encode_checkpoint` wraps a State into an `Envelope`: the format version, a
digest of the fold's code, the stream position it covers, the stream it belongs
to and a digest of the body. `decode_checkpoint` refuses (`CheckpointRejected`,
with the reason) anything that is not exactly a checkpoint of this format, of this
fold code and intact; the caller then replays the log instead.
"""

from __future__ import annotations

import gc
import hashlib
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import msgspec
from msgspec import Struct
from msgspec.structs import astuple

from events import compat as compat_module
from events import schema as schema_module
from events import states as states_module
from events.jetstream import layout as layout_module
from events.natspy import frames as frames_module
from events.natspy import headers as headers_module
from events.natspy import jetstream as natspy_jetstream_module
from events.schema import ActorRuntime, CompatVersion, Fidelity, Resources, WorkerRuntime
from events.states import ActorState, WorkerState
from services.scheduler import interner as interner_module
from services.scheduler import places as places_module
from services.scheduler import projection as projection_module
from services.scheduler import records as records_module
from services.scheduler.places import Disks
from services.scheduler.projection import Projection
from services.scheduler.records import (
    ROLES,
    Actor,
    Assigned,
    ClassEntry,
    ClassIndex,
    Compat,
    IndexedSet,
    Lease,
    SnapshotKind,
    Spec,
    Worker,
)

# Bump on any change of what State holds or how it maps onto the projection.
# 8: a class's capacity counts (ClassRow), an actor's last life's placements (ActorRow.earlier); 9: the disks of
# nodes (State.disks) and each worker's place (WorkerRow.place)
FORMAT = 9


NONE = -1  # "no reference" in an index field


def _fold_digest() -> str:
    """Identifies the fold's code: a checkpoint is only ever restored by the code that wrote it.

    A checkpoint is a cache of a fold; if the fold's code changes (a new field, a fixed
    rule), an old checkpoint could differ from what a replay of the same log gives now.
    So the digest covers the sources of the fold and of this codec: the projection and
    its records, the reading of messages (`fold.py`; the header names it reads, defined in
    `events/jetstream/layout.py`; the header parsing, direct delivery and delivery positions of
    `events/natspy/headers.py`, `frames.py` and `jetstream.py`), the event types it decodes
    (`events/schema.py`), the states it folds them into (`events/states.py`) and the
    compatibility keys its indices are built on (`events/compat.py`: a checkpoint indexed by
    old keys could match a stamp to a runtime that no longer accepts it). Where the sources
    are not readable, the attribute layout of the projection's classes stands in.
    """
    h = hashlib.blake2b(digest_size=12)
    h.update(str(FORMAT).encode())
    try:
        sources = (records_module.__file__, interner_module.__file__, projection_module.__file__,
                   Path(__file__).with_name("fold.py"), schema_module.__file__, states_module.__file__,
                   layout_module.__file__, headers_module.__file__, frames_module.__file__,
                   natspy_jetstream_module.__file__, compat_module.__file__, places_module.__file__, __file__)
        for path in sources:
            h.update(Path(path).read_bytes())
    except (OSError, TypeError):
        for cls in (Worker, Actor, Assigned, ClassIndex, ClassEntry, IndexedSet, Compat, Spec, SnapshotKind, Lease):
            h.update(repr((cls.__name__, cls.__slots__)).encode())
        h.update(repr(sorted(vars(Projection()))).encode())
        h.update(repr(sorted(vars(Projection().intern))).encode())
    return h.hexdigest()


FOLD_DIGEST = _fold_digest()


# --- the state ----------------------------------------------------------------------------------


# Rows hold only scalars and lists of scalars: no reference cycles, so the collector need
# not track them (gc=False), which matters with hundreds of thousands of them.


class WorkerRow(Struct, array_like=True, gc=False):
    worker_id: str
    node: str
    cpu_millis: int
    memory_mib: int
    labels: int  # index into State.maps
    state: str
    classes: list[tuple[str, int, list[int]]]  # (sandbox_class, default, restorable) by index into State.runtimes
    booked_cpu: int
    booked_mem: int
    holding: int
    booking_version: int
    booking_seq: int
    since: int
    place: str  # the disk of its node it registered from (`services.scheduler.places`)
    token: str | None  # the node token it registered


class ActorRow(Struct, array_like=True, gc=False):
    actor_id: str
    state: str
    spec: int  # index into State.specs
    snapshot: int  # index into State.kinds, or NONE
    snapshot_ref: str | None
    worker: int  # index into State.workers, or NONE
    lease: int  # index into State.leases, or NONE
    node: str | None
    version: int
    last_seq: int
    placements: bytes | None
    image_node: str | None
    earlier: bytes | None


class ClassRow(Struct, array_like=True, gc=False):
    sandbox_class: str
    workers: list[int]  # the class's IndexedSet, in order, by index into State.workers
    members: list[list[tuple[int, list[int]]]]  # per role: (compat, members in order)
    live: list[list[tuple[int, int]]]  # per role: (compat, count)
    by_node: list[tuple[str, list[int]]]
    by_arch: list[tuple[str | None, list[int]]]
    live_on_node: list[tuple[str, int, int]]  # (node, compat, count)
    external_memory: list[tuple[int, int]]
    local_memory: list[tuple[str, int, int]]  # (node, compat, count)
    local_waiting: list[tuple[str, int]]
    cpu_caps: list[tuple[int, int]]  # (cpu millis, workers of the class with that capacity)
    mem_caps: list[tuple[int, int]]  # (memory MiB, workers)


class State(Struct):
    """Everything a projection holds, with shared objects in tables."""

    seq: int
    events: int
    compats: list[tuple[str, CompatVersion]]  # (sandbox_class, the version first seen for the key)
    runtimes: list[tuple[str, WorkerRuntime]]
    stamps: list[ActorRuntime]
    resources: list[Resources]
    maps: list[list[tuple[str, str]]]  # interned label and selector maps, sorted pairs
    specs: list[tuple[str, str, int, int, Fidelity]]  # (class, template, resources, selectors, min_fidelity)
    # (template, fidelity, stamp or NONE, borrowed, prefixed, local, node)
    kinds: list[tuple[str, Fidelity, int, bool, bool, bool]]
    leases: list[tuple[int, int]]  # (booked: index into resources, pin: index into stamps)
    registered: int  # workers[:registered] are the registered ones, in the projection's order
    workers: list[WorkerRow]
    classes: list[ClassRow]
    actors: list[ActorRow]
    bookings: list[tuple[str, int, int]]  # (worker id, version, last seq) of booking.<id>
    subjects: list[tuple[str, int, int]]
    recreated: list[tuple[str, int]]  # (actor id, seq of the ActorCreated of its current life)
    unread_actor_seq: int = 0  # the last message of an actor's history the fold could not read
    unread_actors: list[tuple[str, int]] = []  # (actor id, seq) of Projection.unread_actors
    unread_workers: list[tuple[str, int]] = []  # (worker id, seq) of Projection.unread_workers
    disks: list[tuple[str, str, str]] = []  # (node, first token, latest other token) of Projection.disks


class Envelope(Struct):
    """What is stored: the State's bytes and what decides whether they may be used."""

    format: int
    fold: str  # FOLD_DIGEST of the code that wrote it
    seq: int  # stream sequence of the last message the projection folded
    events: int
    stream: str  # the stream's name and creation time: this incarnation of the log
    stream_created: str
    seq_time: int  # the stream time (ns) of the message at `seq` as folded: `services.streams.continuity`
    digest: str  # blake2b of `body`
    compression: str  # "zlib" or "none"
    body: bytes  # msgpack of State


class _Header(Struct):
    """The one field every format will keep: read first, so an unknown format is named as such."""

    format: int


class CheckpointRejected(Exception):
    """A checkpoint that must not be used; the message says why."""


# --- projection -> state ---------------------------------------------------------------------------


@contextmanager
def collector_paused() -> Iterator[None]:
    """No garbage collection while hundreds of thousands of objects are made at once.

    Each generation-2 pass walks every tracked object, and making many triggers many:
    with the collector on, a copy or a restore of 100,000 actors takes 2 to 5 times as
    long. Nothing made here is garbage in a cycle, so there is nothing to collect.
    The collector is process-wide: it is switched on again only if it was on.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def export_state(p: Projection) -> State:
    """Copy the projection into a State. Nothing may fold into `p` meanwhile."""
    with collector_paused():
        return _export(p)


def _export(p: Projection) -> State:
    interned = p.intern
    compat_index = {id(c): i for i, c in enumerate(interned.compats)}
    compats = [(c.sandbox_class, c.version) for c in interned.compats]
    runtime_index = {id(r): i for i, r in enumerate(interned.runtime_records())}
    runtimes = list(interned.runtimes)
    stamp_index = {id(s): i for i, s in enumerate(interned.stamps)}
    stamps = [s.runtime for s in interned.stamps]
    resource_index = {id(r): i for i, r in enumerate(interned.resource_values)}
    resources = list(interned.resource_values)
    map_index = {id(m): i for i, m in enumerate(interned.selector_maps)}
    maps = [sorted(m.items()) for m in interned.selector_maps]

    def map_of(mapping: object) -> int:
        found = map_index.get(id(mapping))
        if found is None:  # not interned (cannot happen through the fold; kept exact anyway)
            found = map_index[id(mapping)] = len(maps)
            maps.append(sorted(mapping.items()))  # type: ignore[attr-defined]
        return found

    def resource_of(value: Resources | None) -> int:
        if value is None:
            return NONE
        found = resource_index.get(id(value))
        if found is None:
            found = resource_index[id(value)] = len(resources)
            resources.append(value)
        return found

    spec_index = {id(s): i for i, s in enumerate(interned.specs)}
    specs = [(s.sandbox_class, s.template_uid, resource_of(s.resources), map_of(s.selectors), s.min_fidelity)
             for s in interned.specs]
    kind_index = {id(k): i for i, k in enumerate(interned.kinds)}
    kinds = [(k.template_uid, k.fidelity, NONE if k.stamp is None else stamp_index[id(k.stamp)], k.borrowed,
              k.prefixed, k.local) for k in interned.kinds]
    lease_index = {id(lease): i for i, lease in enumerate(interned.leases)}
    leases = [(resource_of(lease.booked), stamp_index[id(lease.pin)]) for lease in interned.leases]

    workers: list[Worker] = list(p.workers.values())
    worker_index = {id(w): i for i, w in enumerate(workers)}
    registered = len(workers)
    for actor in p.actors.values():  # records of removed workers that bookings still point at
        worker = actor.worker
        if worker is not None and id(worker) not in worker_index:
            worker_index[id(worker)] = len(workers)
            workers.append(worker)

    worker_rows = [
        WorkerRow(
            w.worker_id, w.node, w.cpu_millis, w.memory_mib, map_of(w.labels), w.state.value,
            [(name, runtime_index[id(e.default)], [runtime_index[id(r)] for r in e.restorable])
             for name, e in w.classes.items()],
            w.booked_cpu, w.booked_mem, w.holding, w.booking_version, w.booking_seq, w.since, w.place, w.token,
        )
        for w in workers
    ]

    def members(s: IndexedSet) -> list[int]:
        return [worker_index[id(w)] for w in s.items]

    def counts(table: dict[Compat, int]) -> list[tuple[int, int]]:
        return [(compat_index[id(c)], n) for c, n in table.items()]

    class_rows = [
        ClassRow(
            index.sandbox_class,
            members(index.workers),
            [[(compat_index[id(c)], members(s)) for c, s in table.items()] for table in index.members],
            [counts(table) for table in index.live],
            [(node, members(s)) for node, s in index.by_node.items()],
            [(arch, members(s)) for arch, s in index.by_arch.items()],
            [(node, compat_index[id(c)], n) for (node, c), n in index.live_on_node.items()],
            counts(index.external_memory),
            [(node, compat_index[id(c)], n) for (node, c), n in index.local_memory.items()],
            list(index.local_waiting.items()),
            list(index.cpu_caps.items()),
            list(index.mem_caps.items()),
        )
        for index in p.classes.values()
    ]

    actor_rows = []
    append = actor_rows.append
    for a in p.actors.values():
        worker, kind, lease = a.worker, a.snapshot, a.lease
        append(ActorRow(
            a.actor_id, a.state.value, spec_index[id(a.spec)], NONE if kind is None else kind_index[id(kind)],
            a.snapshot_ref, NONE if worker is None else worker_index[id(worker)],
            NONE if lease is None else lease_index[id(lease)], a.node, a.version, a.last_seq, a.placements,
            a.image_node, a.earlier,
        ))

    return State(
        seq=p.seq,
        events=p.events,
        compats=compats,
        runtimes=runtimes,
        stamps=stamps,
        resources=resources,
        maps=maps,
        specs=specs,
        kinds=kinds,
        leases=leases,
        registered=registered,
        workers=worker_rows,
        classes=class_rows,
        actors=actor_rows,
        bookings=[(k, v, s) for k, (v, s) in p.bookings.items()],
        subjects=[(k, v, s) for k, (v, s) in p.subjects.items()],
        recreated=list(p.recreated.items()),
        unread_actor_seq=p.unread_actor_seq,
        unread_actors=list(p.unread_actors.items()),
        unread_workers=list(p.unread_workers.items()),
        disks=[(node, first, latest) for node, (first, latest) in p.disks.items()],
    )


# --- state -> projection ---------------------------------------------------------------------------------


def _at(table: list, i: int):
    """table[i] for a reference field; NONE gives None; anything else out of range is an error."""
    if i == NONE:
        return None
    if i < 0:
        raise IndexError(f"reference {i} out of range")
    return table[i]


def restore_state(state: State) -> Projection:
    """A new projection equal to the one `state` was exported from. Raises on an inconsistent state."""
    with collector_paused():
        return _restore(state)


def _restore(state: State) -> Projection:
    p = Projection()
    p.seq = state.seq
    p.events = state.events

    interned = p.intern
    compats: list[Compat] = [interned.add_compat(sandbox_class, version) for sandbox_class, version in state.compats]
    runtimes = [interned.runtime(sandbox_class, runtime) for sandbox_class, runtime in state.runtimes]
    stamps = [interned.stamp(runtime) for runtime in state.stamps]
    resources = [interned.resources(r) for r in state.resources]
    maps = [interned.selectors(dict(pairs)) for pairs in state.maps]
    text = interned.text

    specs = [interned.spec(text(cls), text(template), resources[r], maps[m], min_fidelity)
             for cls, template, r, m, min_fidelity in state.specs]
    kinds = [interned.snapshot_kind(text(template), fidelity, _at(stamps, stamp), borrowed, prefixed, local)
             for template, fidelity, stamp, borrowed, prefixed, local in state.kinds]
    leases = [interned.lease(resources[booked], stamps[pin]) for booked, pin in state.leases]

    workers: list[Worker] = []
    for i, row in enumerate(state.workers):
        w = Worker(row.worker_id)
        w.node = text(row.node)
        w.place = text(row.place)
        w.token = row.token
        w.cpu_millis = row.cpu_millis
        w.memory_mib = row.memory_mib
        w.labels = maps[row.labels]
        w.state = WorkerState(row.state)
        w.classes = interned.entries((text(name), runtimes[default], tuple(runtimes[r] for r in restorable))
                                     for name, default, restorable in row.classes)
        w.booked_cpu = row.booked_cpu
        w.booked_mem = row.booked_mem
        w.holding = row.holding
        w.booking_version = row.booking_version
        w.booking_seq = row.booking_seq
        w.since = row.since
        workers.append(w)
        if i < state.registered:
            if w.worker_id in p.workers:
                raise ValueError(f"worker {w.worker_id} registered twice")
            p.workers[w.worker_id] = w

    def members(indices: Iterable[int]) -> IndexedSet:
        s = IndexedSet()
        for i in indices:
            worker = workers[i]
            s.add(worker)
            worker.sets.append(s)  # its room's changes move the set's version (Worker.touch)
        return s

    for row in state.classes:
        index = ClassIndex(text(row.sandbox_class))
        if len(row.members) != len(ROLES) or len(row.live) != len(ROLES):
            raise ValueError(f"class {row.sandbox_class}: {len(row.members)} roles, not {len(ROLES)}")
        index.workers = members(row.workers)
        index.members = tuple({compats[c]: members(m) for c, m in table} for table in row.members)
        index.live = tuple({compats[c]: n for c, n in table} for table in row.live)
        index.by_node = {text(node): members(m) for node, m in row.by_node}
        index.by_arch = {arch: members(m) for arch, m in row.by_arch}
        index.live_on_node = {(text(node), compats[c]): n for node, c, n in row.live_on_node}
        index.external_memory = {compats[c]: n for c, n in row.external_memory}
        index.local_memory = {(text(node), compats[c]): n for node, c, n in row.local_memory}
        index.local_waiting = dict(row.local_waiting)
        index.cpu_caps = dict(row.cpu_caps)
        index.mem_caps = dict(row.mem_caps)
        p.classes[index.sandbox_class] = index

    actors = p.actors
    suffix = interned.suffix
    for row in state.actors:
        kind = _at(kinds, row.snapshot)
        ref = row.snapshot_ref
        if kind is not None and kind.prefixed:  # the rest after the actor's id: interned again
            ref = suffix(ref)
        worker = _at(workers, row.worker)
        lease = _at(leases, row.lease)
        if (worker is None) != (lease is None):
            raise ValueError(f"actor {row.actor_id} has a worker and no lease, or the reverse")
        a = Actor(
            row.actor_id, ActorState(row.state), specs[row.spec], kind, ref,
            None if row.node is None else text(row.node), row.version, row.last_seq, row.placements,
            None if row.image_node is None else text(row.image_node), row.earlier,
        )
        if worker is not None:
            a = Assigned(*astuple(a), worker, lease)
        if a.actor_id in actors:
            raise ValueError(f"actor {a.actor_id} appears twice")
        actors[a.actor_id] = a

    p.bookings = {worker_id: (version, seq) for worker_id, version, seq in state.bookings}
    p.subjects = {subject: (version, seq) for subject, version, seq in state.subjects}
    p.recreated = dict(state.recreated)
    p.unread_actor_seq = state.unread_actor_seq
    p.unread_actors = dict(state.unread_actors)
    p.unread_workers = dict(state.unread_workers)
    p.disks = Disks({text(node): (first, latest) for node, first, latest in state.disks})
    return p


# --- bytes ---------------------------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_state_decoder = msgspec.msgpack.Decoder(State)
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_header_decoder = msgspec.msgpack.Decoder(_Header)


def _digest(body: bytes) -> str:
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def encode_checkpoint(state: State, *, stream: str, stream_created: str, seq_time: int = 0,
                      compress: bool = True) -> bytes:
    body = _encoder.encode(state)
    if compress:
        body = zlib.compress(body, 1)
    return _encoder.encode(Envelope(
        format=FORMAT, fold=FOLD_DIGEST, seq=state.seq, events=state.events, stream=stream,
        stream_created=stream_created, seq_time=seq_time, digest=_digest(body),
        compression="zlib" if compress else "none", body=body,
    ))


def read_envelope(data: bytes) -> Envelope:
    """The envelope, if it is one this code can use at all; CheckpointRejected otherwise."""
    try:
        header = _header_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise CheckpointRejected(f"not a checkpoint ({error})") from None
    if header.format != FORMAT:
        raise CheckpointRejected(f"unknown format version {header.format} (this scheduler reads {FORMAT})")
    try:
        envelope = _envelope_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise CheckpointRejected(f"corrupt envelope ({error})") from None
    if envelope.fold != FOLD_DIGEST:
        raise CheckpointRejected("written by another version of the scheduler's fold")
    if _digest(envelope.body) != envelope.digest:
        raise CheckpointRejected("body does not match its digest")
    return envelope


def decode_checkpoint(data: bytes) -> tuple[Envelope, Projection]:
    """The envelope and the restored projection; CheckpointRejected if anything is off."""
    envelope = read_envelope(data)
    try:
        body = envelope.body
        if envelope.compression == "zlib":
            body = zlib.decompress(body)
        elif envelope.compression != "none":
            raise ValueError(f"unknown compression {envelope.compression!r}")
        with collector_paused():
            state = _state_decoder.decode(body)
        if (state.seq, state.events) != (envelope.seq, envelope.events):
            raise ValueError("body and envelope disagree on the position")
        projection = restore_state(state)
        projection.stream_created = envelope.stream_created  # a fold of the stream the envelope names
        projection.seq_time = envelope.seq_time
    except CheckpointRejected:
        raise
    except Exception as error:  # any inconsistency at all: the log is still there to replay
        raise CheckpointRejected(f"corrupt body ({type(error).__name__}: {error})") from None
    return envelope, projection
