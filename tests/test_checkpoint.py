"""Projection checkpoints: a restored projection is the projection a full replay gives.

The pure part (export, restore, encode, decode) is checked at every position of a
log that exercises every kind of state the fold keeps; the bus part with real
scheduler replicas: a checkpoint written and read through the object store, a new
replica that folds only the tail, and checkpoints that must not be used (corrupt,
an unknown format, another fold's code, another incarnation of the stream), which
are named in a warning and replaced by a full replay. No sleeps: every wait is on a
stored checkpoint or a stream sequence.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from datetime import datetime, timezone
from typing import Any

import msgspec
import nats
import pytest

from events.aggregate import WireApplication
from events.errors import ContractError
from events.schema import ErrorCode, Fragmentation, FragmentationQuery
from events.schema import (
    ActorCreated,
    ActorOverhead,
    ActorPlaced,
    ActorReleased,
    ActorRuntime,
    ActorStopped,
    Action,
    Attribute,
    CompatVersion,
    Event,
    Fidelity,
    Location,
    PlacedFidelity,
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
    WorkerRegistered,
    WorkerRemoved,
    WorkerRuntime,
    WorkerSandboxClass,
    WorkerUpdated,
)
from events.subjects import stream_name
from services.common import call, store_env
from events.states import ActorState, WorkerState
from services.scheduler import records as records_module
from services.scheduler import checkpoint as checkpoint_module
from services.scheduler.checkpoint import Checkpoints, incarnation_of, object_name
from services.scheduler.checkpoint_codec import (
    FORMAT,
    CheckpointRejected,
    Envelope,
    decode_checkpoint,
    encode_checkpoint,
    export_state,
    restore_state,
)
from services.scheduler.decide import decide
from services.scheduler.explain import explain
from services.scheduler.fragmentation import fragmentation
from services.scheduler.projection import Projection
from services.scheduler.fold import Fold
from services.scheduler.service import SchedulerService
from warmboot.audit import summary

AT = datetime(2026, 11, 30, tzinfo=timezone.utc)
GV, MV = "gvisor", "microvm"


def version(build: str, arch: str = "amd64") -> CompatVersion:
    return CompatVersion(schema_version="v1", attributes=(
        Attribute(key="architecture", value=arch), Attribute(key="gvisor_asset_hash", value=build),
    ))


V1, V2, V3, V9 = version("1"), version("2"), version("3"), version("9")


def runtime(v: CompatVersion, overhead: int = 0, name: str | None = None) -> WorkerRuntime:
    return WorkerRuntime(version=v, name=name, actor_overhead=ActorOverhead(fixed_mib=overhead, per_gib_mib=4) if overhead else None)


def entry(cls: str, default: WorkerRuntime, *restorable: WorkerRuntime) -> WorkerSandboxClass:
    return WorkerSandboxClass(sandbox_class=cls, default_runtime=default, restorable_runtimes=restorable)


def register(worker_id: str, *classes: WorkerSandboxClass, mem=8192, cpu=8000, node=None, labels=None):
    return WorkerRegistered(at=AT, worker_id=worker_id, node=node or f"node-{worker_id}",
                            capacity=Resources(cpu_millis=cpu, memory_mib=mem), labels=labels or {},
                            sandbox_classes=classes or (entry(GV, runtime(V1)),))


def create(actor_id: str, cls=GV, *, mem=1024, selectors=None, min_fidelity=Fidelity.ROOTFS, snapshot=None):
    return ActorCreated(at=AT, actor_id=actor_id, sandbox_class=cls, template_uid="t1",
                        resources=Resources(cpu_millis=500, memory_mib=mem), selectors=selectors or {},
                        min_fidelity=min_fidelity, snapshot=snapshot)


def snap(actor_id: str, stamp: CompatVersion | None, *, fidelity=Fidelity.MEMORY, node=None, cls=GV,
         template="t1", borrowed=False, n=1) -> Snapshot:
    return Snapshot(snapshot_id=f"{actor_id}-s{n}", actor_id=actor_id, template_uid=template, fidelity=fidelity,
                    location=Location.LOCAL if node else Location.EXTERNAL, node=node,
                    sandbox_runtime=ActorRuntime(sandbox_class=cls, version=stamp) if stamp else None,
                    borrowed=borrowed, taken_at=AT)


def taken(actor_id: str, origin: SnapshotOrigin, snapshot: Snapshot) -> SnapshotTaken:
    return SnapshotTaken(at=AT, actor_id=actor_id, snapshot=snapshot, origin=origin)


def placed(actor_id: str, worker_id: str, pin: CompatVersion, *, mem=1024, cls=GV, request_id=None) -> list[Event]:
    return [
        ActorPlaced(at=AT, actor_id=actor_id, worker_id=worker_id, node=f"node-{worker_id}", action=Action.RUN,
                    fidelity=PlacedFidelity.NONE, sandbox_runtime=ActorRuntime(sandbox_class=cls, version=pin),
                    booked=Resources(cpu_millis=500, memory_mib=mem), request_id=request_id),
        WorkerBooked(at=AT, worker_id=worker_id, actor_id=actor_id, request_id=request_id),
    ]


def released(actor_id: str, worker_id: str, reason: ReleaseReason) -> ActorReleased:
    return ActorReleased(at=AT, actor_id=actor_id, worker_id=worker_id, reason=reason)


def event_mix() -> list[Event]:
    """Workers with restorable runtimes and overheads, drained, removed, upgraded, updated;
    actors in every state; bookings; a tag; events of actors never created."""
    events: list[Event] = [
        register("w1", entry(GV, runtime(V1, 64, "runsc-1"), runtime(V2, 32)), labels={"zone": "a"}),
        register("w2", entry(GV, runtime(V2), runtime(V1)), labels={"zone": "b"}),
        register("w3", entry(GV, runtime(V1)), entry(MV, runtime(version("k1", "arm64")))),
        register("w4", entry(GV, runtime(V1), runtime(V3))),
        register("w5", entry(GV, runtime(V1))),
        register("w6", entry(GV, runtime(V3), runtime(V2), runtime(V1)), mem=4096),
        register("w7", entry(MV, runtime(version("k1", "arm64"))), node="node-w3"),
        WorkerDrained(at=AT, worker_id="w3", reason="maintenance"),
        RuntimeChanged(at=AT, worker_id="w5", sandbox_classes=(entry(GV, runtime(V3), runtime(V1)),),
                       previous=(entry(GV, runtime(V1)),)),
        WorkerUpdated(at=AT, worker_id="w6", node="node-w6b", capacity=Resources(cpu_millis=6000, memory_mib=6144),
                      labels={"zone": "c", "disk": "ssd"}),
        create("cold"),
        create("golden", snapshot=snap("golden", V2, borrowed=True)),
        create("strict", min_fidelity=Fidelity.MEMORY, selectors={"zone": "a"}),
        create("micro", MV, mem=512),
        TagRecorded(at=AT, tag="base", snapshot=snap("golden", V2)),
        TemplateChanged(at=AT, actor_id="ghost", template_uid="t9"),  # an actor never created
    ]
    for i, worker in enumerate(["w1", "w2", "w4", "w4", "w5", "w6", "w1", "w2"]):
        actor = f"a{i}"
        events.append(create(actor, mem=512 + 256 * i))
        events.extend(placed(actor, worker, V1 if worker != "w2" else V2, mem=600 + 256 * i, request_id=f"r-{i}"))
    events += [
        # a0 paused on w1, a1 suspended from RUNNING, a2 paused then promoted, a6 stopped
        taken("a0", SnapshotOrigin.PAUSE, snap("a0", V1, node="node-w1")),
        released("a0", "w1", ReleaseReason.PAUSED),
        taken("a1", SnapshotOrigin.SUSPEND, snap("a1", V2)),
        released("a1", "w2", ReleaseReason.SUSPENDED),
        taken("a2", SnapshotOrigin.PAUSE, snap("a2", V1, node="node-w4")),
        released("a2", "w4", ReleaseReason.PAUSED),
        taken("a2", SnapshotOrigin.PROMOTE, snap("a2", V1, n=2)),
        ActorStopped(at=AT, actor_id="a6"),
        # w4 goes away with a3 still booked on it; one more placement lands there after
        WorkerRemoved(at=AT, worker_id="w4", reason="LOST"),
        create("late"),
        *placed("late", "w4", V1),
        # a4 suspended with a VOLUMES snapshot, a5 suspended then its template changed
        taken("a4", SnapshotOrigin.SUSPEND, snap("a4", V1, fidelity=Fidelity.VOLUMES)),
        released("a4", "w5", ReleaseReason.SUSPENDED),
        taken("a5", SnapshotOrigin.SUSPEND, snap("a5", V1)),
        released("a5", "w6", ReleaseReason.SUSPENDED),
        TemplateChanged(at=AT, actor_id="a5", template_uid="t2"),
        taken("a1", SnapshotOrigin.TAG, snap("a1", V2)),
        # a stranded memory snapshot (V9: nobody restores it) and one of a removed worker's runtime
        create("stranded"),
        taken("stranded", SnapshotOrigin.SUSPEND, snap("stranded", V9)),
        create("no-stamp"),
        taken("no-stamp", SnapshotOrigin.SUSPEND, snap("no-stamp", None)),
        # a7 released because its worker went away, then w4 registered again afresh
        released("a3", "w4", ReleaseReason.WORKER_REMOVED),
        register("w4", entry(GV, runtime(V2))),
        create("cold"),  # created again: the fold takes the new content
        WorkerBooked(at=AT, worker_id="w9", actor_id="nobody"),  # a booking marker alone
    ]
    return events


def subject_of(event: Event) -> str:
    return f"{event.KIND}.{event.entity_id}"


def fold_all(events: list[Event]) -> Projection:
    p = Projection()
    for seq, event in enumerate(events, start=1):
        p.apply(seq, event)
    return p


# --- what a projection holds, independently of the codec --------------------------------------------------


# Fields that only memoise (versions decisions key their remembered refusals on, the sets
# a worker is in): a restored projection starts them afresh, which changes no answer.
DERIVED = {"version", "sets"}


def walk(p: Projection) -> dict[str, Any]:
    """Every field of every object, orders kept, references by identity: equal walks are equal projections.

    It reads the classes' `__slots__` rather than a list of names, so a field added to
    the projection and forgotten by the codec shows up here as a difference.
    """
    assert set(vars(p)) == {"seq", "events", "workers", "classes", "actors", "bookings", "subjects", "intern",
                            "recreated", "placed_listener", "registry_version", "_dispatch"}, \
        "a new Projection field: teach the checkpoint codec about it"
    registered = {id(w) for w in p.workers.values()}
    others: dict[int, int] = {}  # unregistered worker records, numbered by first sight

    def value(v: Any) -> Any:
        if isinstance(v, records_module.Worker):
            if id(v) in registered:
                return ("worker", v.worker_id)
            n = others.setdefault(id(v), len(others))
            return ("record", n, obj(v))
        if isinstance(v, records_module.Stamp):
            return ("stamp", v.runtime, v.compat.key, v.compat.version)
        if isinstance(v, records_module.Runtime):
            return ("runtime", v.compat.key, v.compat.version, v.name, v.fixed_mib, v.per_gib_mib, v.pin)
        if isinstance(v, records_module.ClassEntry):
            return ("entry", value(v.default), [value(r) for r in v.restorable])
        if isinstance(v, records_module.Compat):
            return ("compat", v.key, v.version)
        if isinstance(v, (records_module.Spec, records_module.SnapshotKind, records_module.Lease)):
            return (type(v).__name__, obj(v))
        if isinstance(v, records_module.IndexedSet):
            assert v.pos == {w.worker_id: i for i, w in enumerate(v.items)}
            return [value(w) for w in v.items]
        if isinstance(v, (set, frozenset)):
            return sorted(v)
        if isinstance(v, dict):
            return [(value(k), value(x)) for k, x in v.items()]
        if isinstance(v, (tuple, list)):
            return (type(v).__name__, [value(x) for x in v])
        if isinstance(v, (ActorState, WorkerState)):
            return ("state", v.value)
        return v

    def obj(o: Any) -> dict[str, Any]:
        names = getattr(type(o), "__struct_fields__", None) or type(o).__slots__  # a Struct: its fields, inherited too
        return {"class": type(o).__name__,
                **{name: value(getattr(o, name)) for name in names if name not in DERIVED}}

    return {
        "seq": p.seq,
        "events": p.events,
        "workers": [(k, obj(w)) for k, w in p.workers.items()],
        "classes": [(k, obj(c)) for k, c in p.classes.items()],
        "actors": [(k, obj(a)) for k, a in p.actors.items()],
        "bookings": list(p.bookings.items()),
        "subjects": list(p.subjects.items()),
        "recreated": list(p.recreated.items()),
        "compats": [value(c) for c in p.intern.compats],
        # sharing: one object per distinct stamp, resources and label/selector map
        "distinct": (
            len({id(a.snap_stamp) for a in p.actors.values()} | {id(a.pin) for a in p.actors.values()}),
            len({id(a.resources) for a in p.actors.values()} | {id(a.booked) for a in p.actors.values()}),
            len({id(a.selectors) for a in p.actors.values()} | {id(w.labels) for w in p.workers.values()}),
        ),
    }


def answers(p: Projection) -> dict[str, Any]:
    """What the scheduler would answer from `p`: decisions, explanations, fragmentation, OCC expectations."""

    def attempt(fn, *args):
        try:
            return fn(*args)
        except ContractError as error:
            return (error.code, error.message)

    ids = [*p.actors, "ghost", "nobody"]
    return {
        "summary": summary(p),
        "fragmentation": fragmentation(p),
        "decide": {a: attempt(decide, p, a, None, p.seq) for a in ids},
        "decide_zone_b": {a: attempt(decide, p, a, {"zone": "b"}, p.seq + 7) for a in ids},
        "explain": {a: attempt(explain, p, a, None, p.seq) for a in ids},
        "actor_expectations": {a: p.actor_expectation(a) for a in ids},
        "booking_expectations": {w: p.booking_expectation(w) for w in ["w1", "w2", "w3", "w4", "w5", "w6", "w7", "w9"]},
        "stranded": p.stranded(),
    }


def assert_same(restored: Projection, replayed: Projection) -> None:
    assert walk(restored) == walk(replayed)
    assert answers(restored) == answers(replayed)


# --- pure ---------------------------------------------------------------------------------------------------


def test_the_mix_reaches_every_state():
    p = fold_all(event_mix())
    states = {a.state.value for a in p.actors.values()}
    assert states == {"CREATED", "RUNNING", "PAUSED", "SUSPENDED", "STOPPED"}
    assert {w.state.value for w in p.workers.values()} == {"REGISTERED", "DRAINED"}
    orphans = [a for a in p.actors.values() if a.worker is not None and p.workers.get(a.worker.worker_id) is not a.worker]
    assert orphans, "an actor still booked on a removed worker's record"
    assert p.stranded() >= 1 and p.subjects and p.bookings
    decisions = answers(p)["decide"]
    assert decisions["a0"].worker_id == "w1"  # PAUSED on node-w1: only there
    assert decisions["a6"][0] is ErrorCode.FAILED_PRECONDITION and decisions["ghost"][0] is ErrorCode.NOT_FOUND


def test_restore_equals_the_projection_at_every_position_and_folds_on_identically():
    events = event_mix()
    for k in range(len(events) + 1):
        p = fold_all(events[:k])
        restored = restore_state(export_state(p))
        assert walk(restored) == walk(p), f"after {k} events"
        for seq, event in enumerate(events[k:], start=k + 1):  # both go on folding the rest of the log
            restored.apply(seq, event)
            p.apply(seq, event)
        assert walk(restored) == walk(p), f"restored after {k} events, then folded the rest"
    assert_same(restore_state(export_state(p)), p)


def test_bytes_round_trip_and_what_is_refused():
    p = fold_all(event_mix())
    data = encode_checkpoint(export_state(p), stream="S", stream_created="c")
    envelope, restored = decode_checkpoint(data)
    assert (envelope.format, envelope.seq, envelope.events, envelope.stream) == (FORMAT, p.seq, p.events, "S")
    assert_same(restored, p)
    uncompressed = encode_checkpoint(export_state(p), stream="S", stream_created="c", compress=False)
    assert walk(decode_checkpoint(uncompressed)[1]) == walk(p)

    whole = msgspec.msgpack.decode(data, type=Envelope)
    refused = {
        "truncated": data[: len(data) // 2],
        "not msgpack": b"\x00garbage",
        "unknown format version 2": msgspec.msgpack.encode(msgspec.structs.replace(whole, format=FORMAT + 1)),
        "another version of the scheduler's fold": msgspec.msgpack.encode(msgspec.structs.replace(whole, fold="x")),
        "does not match its digest": msgspec.msgpack.encode(
            msgspec.structs.replace(whole, body=whole.body[:-1] + bytes([whole.body[-1] ^ 1]))),
        "corrupt body": encode_checkpoint(msgspec.structs.replace(export_state(p), workers=[]), stream="S",
                                          stream_created="c"),
    }
    for what, bad in refused.items():
        with pytest.raises(CheckpointRejected) as why:
            decode_checkpoint(bad)
        if what in ("unknown format version 2", "another version of the scheduler's fold",
                    "does not match its digest", "corrupt body"):
            assert what.replace(" 2", f" {FORMAT + 1}") in str(why.value)


# --- over the bus -----------------------------------------------------------------------------------------------


class Log:
    """Writes events into the stream through the event store, as the other services do."""

    def __init__(self, nats_url: str, prefix: str):
        self.app = WireApplication(store_env(nats_url, prefix))
        self.versions: dict[str, int] = {}

    def write(self, *events: Event) -> int:
        stored = []
        for event in events:
            subject = subject_of(event)
            self.versions[subject] = self.versions.get(subject, 0) + 1
            stored.append(self.app.stored_event(subject, self.versions[subject], event))
        return self.app.recorder.insert_events(stored)[-1]

    def close(self) -> None:
        self.app.close()


@pytest.fixture
async def log_(nats_url, prefix):
    log = await asyncio.to_thread(Log, nats_url, prefix)
    yield log
    await asyncio.to_thread(log.close)


@pytest.fixture
async def replicas(nats_url, prefix):
    started: list[tuple[SchedulerService, nats.NATS]] = []

    async def start(**options) -> SchedulerService:
        nc = await nats.connect(nats_url)
        service = SchedulerService(nc, nats_url=nats_url, prefix=prefix, metrics=False, **options)
        await service.start()
        started.append((service, nc))
        return service

    yield start
    for service, nc in started:
        await service.stop()
        await nc.close()


async def replay(nc, prefix) -> Projection:
    """The projection a full replay of the stream gives (the scheduler's own fold, from sequence 1)."""
    fold = Fold(nc, prefix, Projection())
    await fold.start(30)
    await fold.stop()
    assert fold.errors == 0
    return fold.projection


async def write_mix(log_: Log) -> int:
    events = event_mix()
    seq = 0
    for i in range(0, len(events), 10):  # several appends, like several services writing
        seq = await asyncio.to_thread(log_.write, *events[i:i + 10])
    return seq


async def test_a_checkpoint_through_the_object_store_restores_the_full_replay(nc, prefix, log_, replicas):
    last = await write_mix(log_)
    service = await replicas(checkpoint_every=10**9, checkpoint_interval_s=0)
    assert service.checkpoints.restored_seq == 0 and service.projection.seq == last
    name = await service.checkpoints.save(service.projection)
    created = (await nc.jetstream().stream_info(stream_name(prefix))).created.isoformat()
    assert name == object_name(last, incarnation_of(created), service.checkpoints.token)
    assert [n for _, _, n in await service.checkpoints.list()] == [name]

    restored = await (await Checkpoints(nc, prefix).open()).load()
    full = await replay(nc, prefix)
    assert restored is not None and restored.seq == last
    assert_same(restored, full)
    assert_same(service.projection, full)


async def test_a_new_replica_folds_only_the_tail_after_the_newest_checkpoint(nc, prefix, log_, replicas):
    start = await write_mix(log_)
    # left over from an earlier incarnation of the stream: neither newer than ours nor kept
    stale = object_name(10**9, incarnation_of("2001-01-01"), "stale")
    await (await Checkpoints(nc, prefix).open()).store.put(stale, b"left over")
    # saves on its own: at once (it replayed more than 25 events), then every 25 events folded
    first = await replicas(checkpoint_every=25, checkpoint_interval_s=0)
    await first.checkpoints.wait_saved(start, 20)
    batch = await asyncio.to_thread(log_.write, *[create(f"b{i}") for i in range(30)])
    await first.checkpoints.wait_saved(batch - 5, 20)
    batch = await asyncio.to_thread(log_.write, *[create(f"c{i}") for i in range(30)])
    await first.checkpoints.wait_saved(batch - 10, 20)
    await first.stop()  # lets a save in progress finish
    assert first.checkpoints.saves == 3
    stored = await first.checkpoints.list()
    assert len(stored) == 2 and stale not in [n for _, _, n in stored], "older checkpoints are pruned"
    newest = stored[0][0]
    assert newest == first.checkpoints.stored_seq
    tail = [create("t1"), *placed("t1", "w1", V1), create("t2"), taken("t2", SnapshotOrigin.SUSPEND, snap("t2", V2))]
    last = await asyncio.to_thread(log_.write, *tail)

    second = await replicas(checkpoint_every=10**9, checkpoint_interval_s=0)
    full = await replay(nc, prefix)
    folded = second.projection.events - second.checkpoints.restored_events
    after_checkpoint = full.events - (await replay_until(nc, prefix, newest)).events
    assert second.checkpoints.restored_seq == newest and second.projection.seq == last
    assert folded == after_checkpoint and len(tail) <= folded < len(tail) + 10
    assert_same(second.projection, full)
    # and it serves from there
    frag = await call(nc, f"{prefix}.scheduler.fragmentation", FragmentationQuery(), Fragmentation)
    assert frag == fragmentation(full)


async def test_the_time_trigger_saves_what_was_folded_since_the_last_save(nc, prefix, log_, replicas):
    last = await write_mix(log_)
    service = await replicas(checkpoint_every=10**9, checkpoint_interval_s=0.2)
    await service.checkpoints.wait_saved(last, 10)
    saves = service.checkpoints.saves
    assert saves == 1
    more = await asyncio.to_thread(log_.write, create("later"))
    await service.checkpoints.wait_saved(more, 10)
    assert service.checkpoints.saves == saves + 1
    stored = await service.checkpoints.list()
    assert [seq for seq, _, _ in stored] == [more, last]


async def replay_until(nc, prefix, seq: int) -> Projection:
    from warmboot.audit import Sink

    sink = Sink(until_seq=seq)
    fold = Fold(nc, prefix, sink)  # type: ignore[arg-type]
    await fold.start(30)
    await fold.stop()
    return sink.projection


async def test_unusable_checkpoints_are_named_in_a_warning_and_the_log_is_replayed(
    nc, prefix, log_, replicas, caplog
):
    last = await write_mix(log_)
    writer = await Checkpoints(nc, prefix).open()
    full = await replay(nc, prefix)
    good = await writer.save(await replay_until(nc, prefix, last - 3))  # older than the unusable ones
    state = export_state(full)
    info = await nc.jetstream().stream_info(stream_name(prefix))
    created = info.created.isoformat()
    valid = encode_checkpoint(state, stream=stream_name(prefix), stream_created=created)
    envelope = msgspec.msgpack.decode(valid, type=Envelope)
    now = incarnation_of(created)
    bad = {
        object_name(last, now, "corrupt"): valid[: len(valid) // 3],
        object_name(last, now, "format"): msgspec.msgpack.encode(msgspec.structs.replace(envelope, format=FORMAT + 7)),
        object_name(last, now, "fold"): msgspec.msgpack.encode(msgspec.structs.replace(envelope, fold="0" * 24)),
        object_name(last, now, "stream"): encode_checkpoint(state, stream=stream_name(prefix),
                                                            stream_created="2001-01-01"),
        object_name(last + 5, now, "ahead"): encode_checkpoint(
            msgspec.structs.replace(state, seq=last + 5), stream=stream_name(prefix), stream_created=created),
        object_name(10**6, incarnation_of("2001-01-01"), "old"): valid,  # a stream deleted and made again
    }
    for name, data in bad.items():  # all newer than (or as new as) the good one: tried first
        await writer.store.put(name, data)
    caplog.set_level(logging.WARNING, logger="warmboot.scheduler.checkpoint")

    fallback = await replicas(checkpoint_every=10**9, checkpoint_interval_s=0)
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for name in bad:
        assert f"checkpoint {name} ignored" in warned
    assert f"unknown format version {FORMAT + 7}" in warned and "another version of the scheduler's fold" in warned
    assert "created 2001-01-01" in warned and f"the stream ends at {last}" in warned
    assert "written for another incarnation of stream" in warned
    assert fallback.checkpoints.restored_seq == last - 3  # the older, valid one, and the tail after it
    assert_same(fallback.projection, full)

    await writer.store.delete(good)  # only unusable ones are left: a full replay
    caplog.clear()
    replayed = await replicas(checkpoint_every=10**9, checkpoint_interval_s=0)
    assert replayed.checkpoints.restored_seq == 0 and replayed.projection.events == full.events
    assert sum("ignored" in r.getMessage() for r in caplog.records) == len(bad)
    assert_same(replayed.projection, full)


async def test_a_capture_holds_the_fold_and_the_checkpoint_is_the_projection_at_its_sequence(
    nc, prefix, log_, replicas, monkeypatch
):
    await write_mix(log_)
    service = await replicas(checkpoint_every=10**9, checkpoint_interval_s=0)
    started, go = threading.Event(), threading.Event()
    seen: list[int] = []

    def slow_export(projection: Projection):  # runs in the capture's thread
        seen.append(projection.seq)
        started.set()
        go.wait(10)
        seen.append(projection.seq)
        return export_state(projection)

    monkeypatch.setattr(checkpoint_module, "export_state", slow_export)
    saving = asyncio.create_task(service.checkpoints.save(service.projection))
    await asyncio.to_thread(started.wait, 10)
    last = await asyncio.to_thread(log_.write, *[create(f"x{i}") for i in range(300)])
    await service.nc.flush()
    with pytest.raises(ContractError):  # the fold waits while the capture copies
        await service.fold.wait(last, 0.5)
    go.set()
    await saving
    await service.fold.wait(last, 10)
    assert seen[0] == seen[1], "nothing was folded during the copy"
    restored = await (await Checkpoints(nc, prefix).open()).load()
    assert restored.seq == seen[0]
    assert_same(restored, await replay_until(nc, prefix, restored.seq))
    assert_same(service.projection, await replay(nc, prefix))


async def test_a_checkpoint_bucket_that_cannot_be_made_does_not_stop_a_replica(nc, prefix, log_, replicas, caplog):
    last = await write_mix(log_)
    bucket = f"{prefix.upper()}_CHECKPOINTS"
    # another stream already holds the object store's subjects: the bucket cannot be created
    await nc.jetstream().add_stream(name=f"SQUAT_{prefix.upper()}", subjects=[f"$O.{bucket}.>"])
    caplog.set_level(logging.WARNING, logger="warmboot.scheduler.checkpoint")
    service = await replicas(checkpoint_every=10, checkpoint_interval_s=0)
    assert f"checkpoint bucket {bucket} unavailable" in caplog.text
    assert service.projection.seq == last and service.checkpoints.restored_seq == 0
    assert_same(service.projection, await replay(nc, prefix))
    frag = await call(nc, f"{prefix}.scheduler.fragmentation", FragmentationQuery(), Fragmentation)
    assert frag == fragmentation(service.projection)
    await nc.jetstream().delete_stream(f"SQUAT_{prefix.upper()}")
