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
from pathlib import Path
from typing import Any

import msgspec
import pytest

from events.errors import ContractError
from events.schema import ErrorCode, Fragmentation, FragmentationQuery
from events.schema import (
    ActorStopped,
    Event,
    Fidelity,
    ReleaseReason,
    Resources,
    RuntimeChanged,
    SnapshotOrigin,
    TagRecorded,
    TemplateChanged,
    WorkerDrained,
    WorkerRemoved,
    WorkerUpdated,
)
from events.subjects import stream_name
from services.endpoints import call
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
from tests.factories import (
    AT,
    Writer,
    booked,
    created,
    entry,
    fold,
    placed,
    registered,
    released,
    runtime,
    snapshot,
    taken,
    version,
)
from warmboot.audit import summary

MV = "microvm"
V1, V2, V3, V9 = version("1"), version("2"), version("3"), version("9")
K1 = version("k1", "arm64")
ROOMY = {"cpu": 8000, "mem": 8192}  # the mix's workers, unless it says otherwise


def event_mix() -> list[Event]:
    """Workers with restorable runtimes and overheads, drained, removed, upgraded, updated;
    actors in every state; bookings; a tag; events of actors never created."""
    events: list[Event] = [
        registered("w1", entry(runtime(V1, "runsc-1", 64, per_gib=4), (runtime(V2, overhead=32, per_gib=4),)),
                   labels={"zone": "a"}, **ROOMY),
        registered("w2", entry(V2, (V1,)), labels={"zone": "b"}, **ROOMY),
        registered("w3", entry(V1), entry(K1, sandbox_class=MV), **ROOMY),
        registered("w4", entry(V1, (V3,)), **ROOMY),
        registered("w5", entry(V1), **ROOMY),
        registered("w6", entry(V3, (V2, V1)), cpu=8000, mem=4096),
        registered("w7", entry(K1, sandbox_class=MV), node="node-w3", **ROOMY),
        WorkerDrained(at=AT, worker_id="w3", reason="maintenance"),
        RuntimeChanged(at=AT, worker_id="w5", sandbox_classes=(entry(V3, (V1,)),), previous=(entry(V1),)),
        WorkerUpdated(at=AT, worker_id="w6", node="node-w6b", capacity=Resources(cpu_millis=6000, memory_mib=6144),
                      labels={"zone": "c", "disk": "ssd"}),
        created("cold"),
        created("golden", snapshot=snapshot("golden", V2, borrowed=True)),
        created("strict", min_fidelity=Fidelity.MEMORY, selectors={"zone": "a"}),
        created("micro", sandbox_class=MV, mem=512),
        TagRecorded(at=AT, tag="base", snapshot=snapshot("golden", V2)),
        TemplateChanged(at=AT, actor_id="ghost", template_uid="t9"),  # an actor never created
    ]
    for i, worker in enumerate(["w1", "w2", "w4", "w4", "w5", "w6", "w1", "w2"]):
        actor = f"a{i}"
        events.append(created(actor, mem=512 + 256 * i))
        events += [placed(actor, worker, V1 if worker != "w2" else V2, mem=600 + 256 * i, request_id=f"r-{i}"),
                   booked(worker, actor, f"r-{i}")]
    events += [
        # a0 paused on w1, a1 suspended from RUNNING, a2 paused then promoted, a6 stopped
        taken(snapshot("a0", V1, node="node-w1"), SnapshotOrigin.PAUSE),
        released("a0", "w1", ReleaseReason.PAUSED),
        taken(snapshot("a1", V2), SnapshotOrigin.SUSPEND),
        released("a1", "w2", ReleaseReason.SUSPENDED),
        taken(snapshot("a2", V1, node="node-w4"), SnapshotOrigin.PAUSE),
        released("a2", "w4", ReleaseReason.PAUSED),
        taken(snapshot("a2", V1, snapshot_id="a2-s2"), SnapshotOrigin.PROMOTE),
        ActorStopped(at=AT, actor_id="a6"),
        # w4 goes away with a3 still booked on it; one more placement lands there after
        WorkerRemoved(at=AT, worker_id="w4", reason="LOST"),
        created("late"),
        placed("late", "w4", V1), booked("w4", "late"),
        # a4 suspended with a VOLUMES snapshot, a5 suspended then its template changed
        taken(snapshot("a4", V1, fidelity=Fidelity.VOLUMES), SnapshotOrigin.SUSPEND),
        released("a4", "w5", ReleaseReason.SUSPENDED),
        taken(snapshot("a5", V1), SnapshotOrigin.SUSPEND),
        released("a5", "w6", ReleaseReason.SUSPENDED),
        TemplateChanged(at=AT, actor_id="a5", template_uid="t2"),
        taken(snapshot("a1", V2), SnapshotOrigin.TAG),
        # a stranded memory snapshot (V9: nobody restores it) and one of a removed worker's runtime
        created("stranded"),
        taken(snapshot("stranded", V9), SnapshotOrigin.SUSPEND),
        created("no-stamp"),
        taken(snapshot("no-stamp", None), SnapshotOrigin.SUSPEND),
        # a7 released because its worker went away, then w4 registered again afresh
        released("a3", "w4", ReleaseReason.WORKER_REMOVED),
        registered("w4", entry(V2), **ROOMY),
        created("cold"),  # created again: the fold takes the new content
        booked("w9", "nobody"),  # a booking marker alone
        # node tokens: two disks under node-t (t1 its first, then t2), an image paused on the second's
        registered("wt1", entry(V1), node="node-t", node_token="t1", **ROOMY),
        registered("wt2", entry(V1), node="node-t", node_token="t2", **ROOMY),
        created("on-t2"),
        placed("on-t2", "wt2", V1, node="node-t"), booked("wt2", "on-t2"),
        taken(snapshot("on-t2", V1, node="node-t"), SnapshotOrigin.PAUSE),
        released("on-t2", "wt2", ReleaseReason.PAUSED),
    ]
    return events


# --- what a projection holds, independently of the codec --------------------------------------------------


# Fields that only memoise (versions decisions key their remembered refusals on, the sets
# a worker is in): a restored projection starts them afresh, which changes no answer.
DERIVED = {"version", "sets"}


def walk(p: Projection) -> dict[str, Any]:
    """Every field of every object, orders kept, references by identity: equal walks are equal projections.

    It reads the classes' `__slots__` rather than a list of names, so a field added to
    the projection and forgotten by the codec shows up here as a difference.
    """
    assert set(vars(p)) == {"seq", "events", "stream_created", "seq_time", "workers", "classes", "actors", "bookings",
                            "subjects", "intern", "recreated", "placed_listener", "registry_version", "unread_actor_seq",
                            "unread_actors", "unread_workers", "disks", "_dispatch"}, \
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
        "stream_created": p.stream_created,  # the envelope's, restored
        "workers": [(k, obj(w)) for k, w in p.workers.items()],
        "classes": [(k, obj(c)) for k, c in p.classes.items()],
        "actors": [(k, obj(a)) for k, a in p.actors.items()],
        "bookings": list(p.bookings.items()),
        "subjects": list(p.subjects.items()),
        "disks": (type(p.disks).__name__, list(p.disks.items())),
        "recreated": list(p.recreated.items()),
        "unread_actor_seq": p.unread_actor_seq,
        "unread_actors": list(p.unread_actors.items()),
        "unread_workers": list(p.unread_workers.items()),
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
    p = fold(event_mix(), Projection())
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
        p = fold(events[:k], Projection())
        restored = restore_state(export_state(p))
        assert walk(restored) == walk(p), f"after {k} events"
        for seq, event in enumerate(events[k:], start=k + 1):  # both go on folding the rest of the log
            restored.apply(seq, event)
            p.apply(seq, event)
        assert walk(restored) == walk(p), f"restored after {k} events, then folded the rest"
    assert_same(restore_state(export_state(p)), p)


def test_a_checkpoint_between_an_unread_placement_and_its_booking_marker_keeps_the_worker_drained():
    """A placement this fold cannot read (a newer scheduler's), then its booking marker: the
    worker counts as drained, its room here being too large by what the placement booked. A
    checkpoint taken between the two messages of that atomic append must carry what the fold
    knew, or a replica restored from it would book the worker past its room."""
    def folded_until_the_unread_placement() -> Fold:
        f = Fold(None, "t", fold([registered("w1", entry(V1), mem=8192), created("a1")], Projection()))
        f.fold_message(3, "t.ev.actor.big", {"Warmboot-Topic": "ActorPlacedV2", "Warmboot-Version": "2"},
                       b'{"type":"ActorPlacedV2","actor_id":"big","worker_id":"w1","memory_mib":8000}')
        return f

    def marker(f: Fold) -> Projection:
        f.fold_message(4, "t.ev.booking.w1", {"Warmboot-Topic": "WorkerBooked", "Warmboot-Version": "1"}, b"{}")
        return f.projection

    replayed = marker(folded_until_the_unread_placement())
    assert replayed.workers["w1"].state is WorkerState.DRAINED
    restored = restore_state(export_state(folded_until_the_unread_placement().projection))
    assert restored.unread_actor_seq == 3 and restored.unread_actors == {"big": 3}
    assert_same(marker(Fold(None, "t", restored)), replayed)
    assert answers(replayed)["decide"]["a1"][0] is ErrorCode.RESOURCE_EXHAUSTED


def test_a_checkpoint_keeps_the_worker_messages_its_fold_could_not_read():
    """A worker message this fold cannot read (a newer registry's) may have ended the worker's life: a
    retry of a placement made before it is not answered from this fold (`Projection.life_unread`).
    A replica restored from a checkpoint taken after it must know that too."""
    f = Fold(None, "t", fold([registered("w1", entry(V1), mem=8192)], Projection()))
    f.fold_message(2, "t.ev.worker.w1", {"Warmboot-Topic": "WorkerRetired", "Warmboot-Version": "1"},
                   b'{"type":"WorkerRetired","worker_id":"w1"}')
    assert f.projection.life_unread("w1", 1) == 2 and f.projection.life_unread("w1", 2) == 0
    restored = restore_state(export_state(f.projection))
    assert restored.unread_workers == {"w1": 2} and restored.life_unread("w1", 1) == 2
    assert_same(restored, f.projection)


def test_bytes_round_trip_and_what_is_refused():
    p = fold(event_mix(), Projection())
    p.stream_created = "c"  # a fold of the stream created at "c": so is what its checkpoint restores
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


def test_the_fold_digest_covers_every_source_a_fold_depends_on(tmp_path, monkeypatch):
    """A checkpoint indexed by compatibility keys an older `events/compat.py` computed could match a
    stamp to a runtime that no longer accepts it: a change of any source the fold's result depends
    on must refuse old checkpoints (a full replay), as a change of the projection's does."""
    from events import compat, schema, states
    from events.jetstream import layout
    from events.natspy import frames, headers, jetstream as natspy_jetstream
    from services.scheduler import checkpoint_codec, fold as fold_module, interner, projection

    before = checkpoint_codec._fold_digest()
    codec_source = Path(checkpoint_codec.__file__).read_bytes()
    for module in (compat, schema, states, layout, headers, frames, natspy_jetstream, fold_module, projection,
                   records_module, interner):
        changed = tmp_path / f"{module.__name__}.py"
        changed.write_bytes(Path(module.__file__).read_bytes() + b"\n# changed\n")
        with monkeypatch.context() as m:
            if module is fold_module:  # found beside the codec, not through the module
                (tmp_path / "checkpoint_codec.py").write_bytes(codec_source)
                (tmp_path / "fold.py").write_bytes(changed.read_bytes())
                m.setattr(checkpoint_codec, "__file__", str(tmp_path / "checkpoint_codec.py"))
            else:
                m.setattr(module, "__file__", str(changed))
            assert checkpoint_codec._fold_digest() != before, module.__name__
    assert checkpoint_codec._fold_digest() == before


# --- over the bus -----------------------------------------------------------------------------------------------


async def replay(nc, prefix) -> Projection:
    """The projection a full replay of the stream gives (the scheduler's own fold, from sequence 1)."""
    fold = Fold(nc, prefix, Projection())
    await fold.start(30)
    await fold.stop()
    assert fold.errors == 0
    return fold.projection


async def write_mix(writer: Writer) -> int:
    events = event_mix()
    seq = 0
    for i in range(0, len(events), 10):  # several appends, like several services writing
        seq = await asyncio.to_thread(writer.write, *events[i:i + 10])
    return seq


async def test_a_checkpoint_through_the_object_store_restores_the_full_replay(nc, prefix, writer, replicas):
    last = await write_mix(writer)
    service = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0)
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


async def test_a_new_replica_folds_only_the_tail_after_the_newest_checkpoint(nc, prefix, writer, replicas):
    start = await write_mix(writer)
    # left over from an earlier incarnation of the stream: neither newer than ours nor kept
    stale = object_name(10**9, incarnation_of("2001-01-01"), "stale")
    await (await Checkpoints(nc, prefix).open()).store.put(stale, b"left over")
    # saves on its own: at once (it replayed more than 25 events), then every 25 events folded
    first = await replicas(metrics=False, checkpoint_every=25, checkpoint_interval_s=0)
    await first.checkpoints.wait_saved(start, 20)
    batch = await asyncio.to_thread(writer.write, *[created(f"b{i}") for i in range(30)])
    await first.checkpoints.wait_saved(batch - 5, 20)
    batch = await asyncio.to_thread(writer.write, *[created(f"c{i}") for i in range(30)])
    await first.checkpoints.wait_saved(batch - 10, 20)
    await first.stop()  # lets a save in progress finish
    assert first.checkpoints.saves == 3
    stored = await first.checkpoints.list()
    assert len(stored) == 2 and stale not in [n for _, _, n in stored], "older checkpoints are pruned"
    newest = stored[0][0]
    assert newest == first.checkpoints.stored_seq
    tail = [created("t1"), placed("t1", "w1", V1), booked("w1", "t1"), created("t2"),
            taken(snapshot("t2", V2), SnapshotOrigin.SUSPEND)]
    last = await asyncio.to_thread(writer.write, *tail)

    second = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0)
    full = await replay(nc, prefix)
    folded = second.projection.events - second.checkpoints.restored_events
    after_checkpoint = full.events - (await replay_until(nc, prefix, newest)).events
    assert second.checkpoints.restored_seq == newest and second.projection.seq == last
    assert folded == after_checkpoint and len(tail) <= folded < len(tail) + 10
    assert_same(second.projection, full)
    # and it serves from there
    frag = await call(nc, f"{prefix}.scheduler.fragmentation", FragmentationQuery(), Fragmentation)
    assert frag == fragmentation(full)


async def test_the_time_trigger_saves_what_was_folded_since_the_last_save(nc, prefix, writer, replicas):
    last = await write_mix(writer)
    service = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0.2)
    await service.checkpoints.wait_saved(last, 10)
    saves = service.checkpoints.saves
    assert saves == 1
    more = await asyncio.to_thread(writer.write, created("later"))
    await service.checkpoints.wait_saved(more, 10)
    assert service.checkpoints.saves == saves + 1
    stored = await service.checkpoints.list()
    assert [seq for seq, _, _ in stored] == [more, last]


async def test_a_checkpoint_bucket_deleted_under_a_running_replica_is_made_again_at_its_next_save(
        nc, prefix, writer, replicas):
    """docs/operations.md: "Deleting the bucket is always safe" (`nats stream rm OBJ_<PREFIX>_CHECKPOINTS`).
    A replica running then kept the handle of the bucket it had opened, and every save after failed
    (`stream not found; trying again later`) for as long as it ran (a trial of the procedure, 2026-12-07):
    no checkpoint at all until a replica was restarted."""
    last = await write_mix(writer)
    service = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0.2)
    await service.checkpoints.wait_saved(last, 10)
    await nc.jetstream().delete_stream(f"OBJ_{prefix.upper()}_CHECKPOINTS")
    more = await asyncio.to_thread(writer.write, created("after-the-deletion"))
    await service.checkpoints.wait_saved(more, 10)
    assert [seq for seq, _, _ in await service.checkpoints.list()] == [more]


async def test_a_stop_ends_the_saver_when_a_request_swallowed_its_cancellation(nc, prefix, writer, replicas):
    """On Python 3.11 `asyncio.wait_for` (every nats-py request) returns its result instead of
    raising when the reply and the cancellation arrive together. A saver cancelled that way
    in the middle of a trigger must still end, or the replica's stop waits for it for ever."""
    await write_mix(writer)
    service = await replicas(metrics=False, checkpoint_every=5, checkpoint_interval_s=0)
    checkpoints = service.checkpoints
    await checkpoints.wait_saved(service.projection.seq, 20)  # the save at start, done
    asked, release = asyncio.Event(), asyncio.Event()
    identity = checkpoints._stream_identity

    async def swallowing() -> tuple[str, int]:
        asked.set()
        try:
            await release.wait()  # the stop's cancellation lands here
        except asyncio.CancelledError:
            pass  # ... and is lost, as wait_for loses it
        return await identity()

    checkpoints._stream_identity = swallowing
    await asyncio.to_thread(writer.write, *[created(f"s{i}") for i in range(10)])  # the next trigger
    await asyncio.wait_for(asked.wait(), 20)
    saves = checkpoints.saves
    await asyncio.wait_for(service.stop(), 30)  # it hung here: the saver waited for a trigger for ever
    assert checkpoints.saves == saves  # and a closed saver starts no new save


async def replay_until(nc, prefix, seq: int) -> Projection:
    from warmboot.audit import Sink

    sink = Sink(until_seq=seq)
    fold = Fold(nc, prefix, sink)  # type: ignore[arg-type]
    await fold.start(30)
    await fold.stop()
    sink.projection.stream_created = sink.stream_created  # the fold labels what it folds into: the sink
    return sink.projection


async def test_unusable_checkpoints_are_named_in_a_warning_and_the_log_is_replayed(
    nc, prefix, writer, replicas, caplog
):
    last = await write_mix(writer)
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

    fallback = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0)
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
    replayed = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0)
    assert replayed.checkpoints.restored_seq == 0 and replayed.projection.events == full.events
    assert sum("ignored" in r.getMessage() for r in caplog.records) == len(bad)
    assert_same(replayed.projection, full)


async def test_a_capture_holds_the_fold_and_the_checkpoint_is_the_projection_at_its_sequence(
    nc, prefix, writer, replicas, monkeypatch
):
    await write_mix(writer)
    service = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0)
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
    last = await asyncio.to_thread(writer.write, *[created(f"x{i}") for i in range(300)])
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


async def test_a_replica_started_while_jetstream_does_not_answer_loads_its_checkpoint(
        nc, prefix, writer, replicas, monkeypatch, caplog):
    """Each question a load asks the server goes unanswered once (a time-out, as during the stream's
    leader election: a replica started in an incident, right after a stepdown or a kill): it is asked
    again, and the checkpoint is loaded, not thrown away for a replay of the whole log."""
    import nats.errors
    import nats.js.client
    import nats.js.object_store

    last = await write_mix(writer)
    first = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0)
    assert await first.checkpoints.save(first.projection) is not None
    await first.stop()
    unanswered: list[str] = []

    def fails_once(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        async def once(*args: Any, **kwargs: Any) -> Any:
            if name not in unanswered:
                unanswered.append(name)
                raise nats.errors.TimeoutError
            return await real(*args, **kwargs)

        monkeypatch.setattr(owner, name, once)

    fails_once(nats.js.client.JetStreamContext, "create_object_store")  # the bucket, at open
    fails_once(Checkpoints, "_stream_identity")  # STREAM.INFO, answered by the stream's leader alone
    fails_once(nats.js.object_store.ObjectStore, "list")
    fails_once(nats.js.object_store.ObjectStore, "get")
    caplog.set_level(logging.WARNING, logger="warmboot.scheduler.checkpoint")
    second = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0)
    assert unanswered == ["create_object_store", "_stream_identity", "list", "get"]
    assert second.checkpoints.restored_seq == last, caplog.text
    assert "replaying" not in caplog.text and "ignored" not in caplog.text
    assert_same(second.projection, await replay(nc, prefix))


async def test_a_checkpoint_bucket_that_cannot_be_made_does_not_stop_a_replica(nc, prefix, writer, replicas, caplog):
    last = await write_mix(writer)
    bucket = f"{prefix.upper()}_CHECKPOINTS"
    # another stream already holds the object store's subjects: the bucket cannot be created
    await nc.jetstream().add_stream(name=f"SQUAT_{prefix.upper()}", subjects=[f"$O.{bucket}.>"])
    caplog.set_level(logging.WARNING, logger="warmboot.scheduler.checkpoint")
    service = await replicas(metrics=False, checkpoint_every=10, checkpoint_interval_s=0)
    assert f"checkpoint bucket {bucket} unavailable" in caplog.text
    assert service.projection.seq == last and service.checkpoints.restored_seq == 0
    assert_same(service.projection, await replay(nc, prefix))
    frag = await call(nc, f"{prefix}.scheduler.fragmentation", FragmentationQuery(), Fragmentation)
    assert frag == fragmentation(service.projection)
    await nc.jetstream().delete_stream(f"SQUAT_{prefix.upper()}")
