"""The snapshotter over a real bus: nats-server, the JetStream event store, nats.micro endpoints.

Placements (`ActorPlaced`) are written the way the scheduler writes them: through
the event store, on the actor's history, with optimistic concurrency. Workers are
registered, upgraded and removed through the registry's endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
from datetime import datetime, timezone

import msgspec
import pytest
from eventsourcing.application import AggregateNotFoundError

from events.aggregate import WireApplication, now
from events.codec import decode_event
from events.errors import ContractError
from events.jetstream.layout import sequence_of
from events.schema import (
    Action,
    ActorCreated,
    ActorPlaced,
    ActorReleased,
    ActorRuntime,
    ActorStatus,
    ActorStatusQuery,
    ActorStopped,
    CompatVersion,
    ErrorCode,
    Fidelity,
    ImageNamed,
    Location,
    PauseActor,
    PlacedFidelity,
    RegisterReply,
    RegisterWorker,
    ReleaseReason,
    RemoveWorker,
    Resources,
    SeqReply,
    SnapshotOrigin,
    SnapshotReply,
    SnapshotTaken,
    StopActor,
    SuspendActor,
    TaggedBefore,
    TagRecorded,
    TagSnapshot,
    TemplateChanged,
    UpdateTemplate,
    WorkerFenced,
    WorkerRemoved,
)
from events.jetstream import TOPIC_HEADER, VERSION_HEADER
from events.states import ActorState
from events.subjects import event_subject, service_subject, services_inbox, stream_name
from services.commands import run_command
from services.endpoints import call
from services.process import store_env
from services.registry.service import RegistryService
from services.snapshotter.domain import Actor, Tag
from services.snapshotter.service import SnapshotterService
from tests.factories import actor, last_seq, read_entries, runtime, snapshot, stamp, version, worker
from tests.factories import another_process
from tests.factories import reads_before as stream_reads_before

CLASS = "gvisor"
STORE = os.environ.get("WARMBOOT_TEST_STORE", "events.jetstream")


V1, V2 = version("aaaa1111"), version("bbbb2222")
PIN_V1, PIN_V2 = stamp(V1, name="runsc-1"), stamp(V2, name="runsc-2")


def env_for(nats_url: str, prefix: str) -> dict[str, str]:
    env = store_env(nats_url, prefix)
    env["PERSISTENCE_MODULE"] = STORE
    return env


# --- fixtures ----------------------------------------------------------------------------


@pytest.fixture
async def snapshotter(nats_server, prefix, nc):
    service = SnapshotterService(nc, nats_url=nats_server.url, prefix=prefix, env=env_for(nats_server.url, prefix))
    await service.start()
    yield service
    await service.stop()


@contextlib.asynccontextmanager
async def another_replica(snapshotter: SnapshotterService, nats_url: str, prefix: str, **options):
    """A second snapshotter replica as another process runs one: a connection of its own to serve
    on, and an event-store link of its own (another inbox prefix: other connect options), so its
    own cache of each subject's last sequence. A losing append is then refused by the server,
    not caught by a cache the two replicas share."""
    import nats

    client = await nats.connect(nats_url)
    env = env_for(nats_url, prefix)
    env["NATS_INBOX_PREFIX"] = f"{services_inbox(prefix)}.replica2"
    service = SnapshotterService(client, nats_url=nats_url, prefix=prefix, env=env, **options)
    try:
        await service.start()
        assert service.app.recorder.link is not snapshotter.app.recorder.link
        yield service
    finally:
        await service.stop()
        await client.close()


@pytest.fixture
async def registry(nats_server, prefix, nc):
    service = RegistryService(nc, nats_url=nats_server.url, prefix=prefix, env=env_for(nats_server.url, prefix))
    await service.start()
    yield service
    await service.stop()


@pytest.fixture
async def placer(nats_server, prefix):
    """Writes ActorPlaced into an actor's history as the scheduler does: load, record, save (OCC)."""
    app = await asyncio.to_thread(WireApplication, env_for(nats_server.url, prefix))
    yield Placer(app)
    await asyncio.to_thread(app.close)


class Placer:
    def __init__(self, app: WireApplication):
        self.app = app

    async def place(self, actor_id: str, worker_id: str, node: str, sandbox_runtime: ActorRuntime) -> int:
        def commit() -> int:
            actor: Actor = self.app.repository.get(Actor.create_id(actor_id))
            actor.place(ActorPlaced(
                actor_id=actor_id, worker_id=worker_id, node=node, action=Action.RUN,
                fidelity=PlacedFidelity.NONE, sandbox_runtime=sandbox_runtime,
                booked=Resources(cpu_millis=250, memory_mib=256), at=now(),
            ))
            return self.app.save(actor)[-1].notification.id

        return await run_command(commit)  # a lost race re-decides on fresh state, as the scheduler does


# --- helpers -------------------------------------------------------------------------------


def subject(prefix: str, verb: str, actor_id: str) -> str:
    return service_subject(prefix, "snapshotter", verb, actor_id)


async def create(nc, prefix: str, actor_id: str, **fields) -> SeqReply:
    body = actor(actor_id, cpu=250, mem=256, template="tpl-1", **fields)
    return await call(nc, subject(prefix, "create", actor_id), body, SeqReply)


async def pause(nc, prefix: str, actor_id: str, **fields) -> SnapshotReply:
    return await call(nc, subject(prefix, "pause", actor_id), PauseActor(**fields), SnapshotReply)


async def suspend(nc, prefix: str, actor_id: str, fidelity: Fidelity = Fidelity.MEMORY, **fields) -> SnapshotReply:
    return await call(nc, subject(prefix, "suspend", actor_id), SuspendActor(fidelity=fidelity, **fields),
                      SnapshotReply)


async def tag(nc, prefix: str, actor_id: str, name: str, **fields) -> SnapshotReply:
    return await call(nc, subject(prefix, "tag", actor_id), TagSnapshot(tag=name, **fields), SnapshotReply)


async def refused(awaitable) -> ContractError:
    with pytest.raises(ContractError) as excinfo:
        await awaitable
    return excinfo.value


def registration(worker_id: str, node: str, default: CompatVersion, restorable: tuple[CompatVersion, ...] = ()):
    return worker(worker_id, runtime(default, "runsc-default", overhead=None),
                  tuple(runtime(v, overhead=None) for v in restorable), node=node, cpu=8000, mem=16384)


async def register(nc, prefix: str, reg: RegisterWorker) -> RegisterReply:
    return await call(nc, service_subject(prefix, "registry", "register", reg.worker_id), reg, RegisterReply)


# --- stamping rules ------------------------------------------------------------------------------


async def test_rolling_upgrade_pause_stamps_the_pin_and_promotion_keeps_it(
    snapshotter, registry, placer, nc, prefix
):
    await register(nc, prefix, registration("w-1", "node-1", V1))
    await create(nc, prefix, "old")
    await placer.place("old", "w-1", "node-1", PIN_V1)  # placed while the default was v1

    # Rolling upgrade: the worker's default becomes v2; it can still restore v1.
    upgraded = await register(nc, prefix, registration("w-1", "node-1", V2, (V1,)))
    assert upgraded.outcome.value == "RUNTIME_CHANGED"

    paused = await pause(nc, prefix, "old")
    assert paused.snapshot.sandbox_runtime == PIN_V1  # the pin, not the worker's new default
    assert (paused.snapshot.location, paused.snapshot.fidelity, paused.snapshot.node) == (
        Location.LOCAL, Fidelity.MEMORY, "node-1")

    promoted = await suspend(nc, prefix, "old", uri="s3://snaps/old")
    assert promoted.snapshot.sandbox_runtime == PIN_V1
    assert promoted.snapshot.snapshot_id == paused.snapshot.snapshot_id
    assert (promoted.snapshot.location, promoted.snapshot.node) == (Location.EXTERNAL, None)

    # A fresh actor placed on the upgraded worker runs its new default: pinned, and stamped, v2.
    await create(nc, prefix, "fresh")
    await placer.place("fresh", "w-1", "node-1", PIN_V2)
    assert (await pause(nc, prefix, "fresh")).snapshot.sandbox_runtime == PIN_V2

    log = [(s, e) for s, _, e in await read_entries(nc, prefix) if getattr(e, "actor_id", None) == "old"]
    taken = [e for _, e in log if isinstance(e, SnapshotTaken)]
    assert [t.origin for t in taken] == [SnapshotOrigin.PAUSE, SnapshotOrigin.PROMOTE]
    assert all(t.snapshot.sandbox_runtime == PIN_V1 for t in taken)
    released = [e for _, e in log if isinstance(e, ActorReleased)]
    assert [(r.worker_id, r.reason) for r in released] == [("w-1", ReleaseReason.PAUSED)]
    assert promoted.seq == log[-1][0]


async def test_suspend_from_running_is_external_stamped_from_the_pin_and_releases(
    snapshotter, placer, nc, prefix
):
    await create(nc, prefix, "a-1")
    await placer.place("a-1", "w-9", "node-9", PIN_V2)
    reply = await suspend(nc, prefix, "a-1", Fidelity.VOLUMES, snapshot_id="snap-1", uri="s3://b/1")
    s = reply.snapshot
    assert (s.snapshot_id, s.location, s.fidelity, s.uri, s.node) == (
        "snap-1", Location.EXTERNAL, Fidelity.VOLUMES, "s3://b/1", None)
    assert s.sandbox_runtime == PIN_V2  # stamped also when the snapshot has no memory
    events = [e for _, _, e in await read_entries(nc, prefix)]
    assert isinstance(events[-1], ActorReleased) and events[-1].reason is ReleaseReason.SUSPENDED
    assert reply.seq == await last_seq(nc, prefix)


async def test_tag_and_create_from_tag_keep_the_stamp(snapshotter, placer, nc, prefix):
    await create(nc, prefix, "src")
    await placer.place("src", "w-1", "node-1", PIN_V1)
    suspended = (await suspend(nc, prefix, "src", uri="s3://b/src")).snapshot
    tagged = await tag(nc, prefix, "src", "golden-path")
    assert tagged.snapshot == suspended  # a copy: same image, same stamp

    made = await create(nc, prefix, "copy", source_tag="golden-path")
    log = await read_entries(nc, prefix)
    tag_events = [e for _, subj, e in log if subj == f"{prefix}.ev.tag.golden-path"]
    assert tag_events == [TagRecorded(tag="golden-path", snapshot=suspended, at=tag_events[0].at)]
    copy_events = [(s, e) for s, _, e in log if getattr(e, "actor_id", None) == "copy"]
    created, taken = copy_events[0][1], copy_events[1][1]
    assert isinstance(created, ActorCreated) and isinstance(taken, SnapshotTaken)
    assert taken.origin is SnapshotOrigin.CREATE and created.snapshot == taken.snapshot
    assert created.snapshot.sandbox_runtime == PIN_V1 and created.snapshot.actor_id == "copy"
    assert created.snapshot.snapshot_id == suspended.snapshot_id and created.snapshot.borrowed is False
    assert made.seq == copy_events[-1][0]
    # The copy's snapshot is its own latest: tagging it copies it again, stamp unchanged.
    assert (await tag(nc, prefix, "copy", "again")).snapshot.sandbox_runtime == PIN_V1

    error = await refused(create(nc, prefix, "orphan", source_tag="no-such-tag"))
    assert (error.code, error.field) == (ErrorCode.NOT_FOUND, "source_tag")


async def test_create_from_golden_keeps_the_stamp_and_is_borrowed(snapshotter, nc, prefix):
    golden = snapshot("template-actor", PIN_V2, snapshot_id="gold-1", template="tpl-1", uri="s3://golden/1",
                      taken_at=datetime(2026, 1, 1, tzinfo=timezone.utc))
    await create(nc, prefix, "g-1", golden_snapshot=golden)
    (_, _, created), (_, _, taken) = await read_entries(nc, prefix, event_subject(prefix, "actor", "g-1"))
    assert created.snapshot.borrowed is True and created.snapshot.sandbox_runtime == PIN_V2
    assert taken.origin is SnapshotOrigin.CREATE and taken.snapshot == created.snapshot
    assert msgspec.structs.replace(created.snapshot, actor_id="template-actor", borrowed=False) == golden
    # the id is no default's: what it names is recorded on its own subject, in the same append
    [(_, _, named)] = await read_entries(nc, prefix, event_subject(prefix, "image", "gold-1"))
    assert isinstance(named, ImageNamed) and named.snapshot == created.snapshot


# --- one snapshot id names one image, across actors ----------------------------------------------


async def log_length(nc, prefix: str) -> int:
    return (await nc.jetstream().stream_info(stream_name(prefix))).state.last_seq


async def test_an_id_another_actor_s_image_holds_is_refused_and_nothing_is_written(snapshotter, placer, nc, prefix):
    """The walkthrough's case: a-1 paused under `myimg` (LOCAL on node-1), then b-1, running on the
    same node, paused and suspended under `myimg`. Each was taken, and a resume of either named
    `myimg` to a worker there, which finds an image by its id. Now b-1's are refused, naming a-1's
    image, with nothing written; the default id and another free id are taken."""
    for actor_id in ("a-1", "b-1"):
        await create(nc, prefix, actor_id)
        await placer.place(actor_id, "w-1", "node-1", PIN_V1)
    first = await pause(nc, prefix, "a-1", snapshot_id="myimg")
    assert (first.snapshot.location, first.snapshot.node) == (Location.LOCAL, "node-1")
    before = await log_length(nc, prefix)
    for attempt in (pause(nc, prefix, "b-1", snapshot_id="myimg"),
                    suspend(nc, prefix, "b-1", Fidelity.VOLUMES, snapshot_id="myimg", uri="s3://b/1")):
        error = await refused(attempt)
        assert (error.code, error.field) == (ErrorCode.FAILED_PRECONDITION, "snapshot_id"), error
        assert "already names an image of actor 'a-1' (LOCAL on node 'node-1', MEMORY)" in error.message, error
    assert await log_length(nc, prefix) == before  # nothing written: b-1 still runs
    other = await pause(nc, prefix, "b-1", snapshot_id="b-own")
    assert other.snapshot.snapshot_id == "b-own"
    [(_, _, named)] = await read_entries(nc, prefix, event_subject(prefix, "image", "myimg"))
    assert named.snapshot == first.snapshot  # what the id names: a-1's image, as recorded


async def test_an_image_in_several_actors_is_one_image_and_a_promote_names_it_anew(snapshotter, placer, nc, prefix):
    """What may be in two actors' histories under one id is one EXTERNAL image: a tag's copy, a
    golden snapshot given again. A promote keeps the LOCAL image's id and makes it EXTERNAL: the id
    then names the EXTERNAL image (its next ImageNamed), which a tag's copy repeats. A golden
    snapshot of another image under that id is refused; a default id writes no ImageNamed."""
    await create(nc, prefix, "a-1")
    await placer.place("a-1", "w-1", "node-1", PIN_V1)
    paused = await pause(nc, prefix, "a-1", snapshot_id="img")
    promoted = await suspend(nc, prefix, "a-1", Fidelity.VOLUMES, uri="s3://b/img")
    assert promoted.snapshot.snapshot_id == "img" and promoted.snapshot.location is Location.EXTERNAL
    named = [e.snapshot for _, _, e in await read_entries(nc, prefix, event_subject(prefix, "image", "img"))]
    assert named == [paused.snapshot, promoted.snapshot]
    await tag(nc, prefix, "a-1", "base")
    await create(nc, prefix, "c-1", source_tag="base")  # c-1 holds a copy of img: the same image
    same = msgspec.structs.replace(promoted.snapshot, actor_id="golden-maker")
    await create(nc, prefix, "d-1", golden_snapshot=same)  # given again as a golden snapshot: the same image
    other = msgspec.structs.replace(same, uri="s3://b/another")
    before = await log_length(nc, prefix)
    error = await refused(create(nc, prefix, "e-1", golden_snapshot=other))
    assert (error.code, error.field) == (ErrorCode.FAILED_PRECONDITION, "golden_snapshot.snapshot_id"), error
    assert await log_length(nc, prefix) == before
    assert len(await read_entries(nc, prefix, event_subject(prefix, "image", "img"))) == 2  # nothing more named
    await placer.place("c-1", "w-1", "node-1", PIN_V1)
    default = await pause(nc, prefix, "c-1")
    assert default.snapshot.snapshot_id.startswith("c-1-v")
    assert not any(isinstance(e, ImageNamed) and e.snapshot.snapshot_id != "img"
                   for _, _, e in await read_entries(nc, prefix))


async def test_many_actors_naming_one_id_at_once_through_two_replicas_one_gets_it(
    snapshotter, placer, nats_server, nc, prefix
):
    """Forty running actors pause or suspend at once under one id, through two replicas that share
    nothing but the server, three rounds: each round one gets the id, every other is refused
    FAILED_PRECONDITION (field `snapshot_id`), and the log, read in stream order, holds one image
    under the id (one ImageNamed, the winner's one SnapshotTaken) and nothing of the losers."""
    rounds, actors = 3, 40
    async with another_replica(snapshotter, nats_server.url, prefix, follow=False):
        for round_ in range(rounds):
            ids = [f"r{round_}-a{i}" for i in range(actors)]
            for actor_id in ids:
                await create(nc, prefix, actor_id)
                await placer.place(actor_id, "w-1", "node-1", PIN_V1)
            shared = f"shared-{round_}"
            outcomes = await asyncio.gather(
                *(pause(nc, prefix, actor_id, snapshot_id=shared) if i % 2 else
                  suspend(nc, prefix, actor_id, Fidelity.VOLUMES, snapshot_id=shared, uri=f"s3://b/{actor_id}")
                  for i, actor_id in enumerate(ids)),
                return_exceptions=True)
            won = [(actor_id, o) for actor_id, o in zip(ids, outcomes) if isinstance(o, SnapshotReply)]
            lost = [o for o in outcomes if not isinstance(o, SnapshotReply)]
            assert len(won) == 1, outcomes
            assert all(isinstance(e, ContractError) and (e.code, e.field) == (ErrorCode.FAILED_PRECONDITION,
                                                                              "snapshot_id") for e in lost), lost
            winner, reply = won[0]
            entries = await read_entries(nc, prefix)
            named = [e for _, on, e in entries if on == event_subject(prefix, "image", shared)]
            taken = [(on, e) for _, on, e in entries if isinstance(e, SnapshotTaken) and e.snapshot.snapshot_id == shared]
            assert [e.snapshot for e in named] == [reply.snapshot]
            assert taken == [(event_subject(prefix, "actor", winner), taken[0][1])] and taken[0][1].snapshot == reply.snapshot
            for actor_id in ids:
                if actor_id != winner:  # created and placed, nothing since
                    kinds = [type(e) for _, _, e in await read_entries(nc, prefix, event_subject(prefix, "actor", actor_id))]
                    assert kinds == [ActorCreated, ActorPlaced], (actor_id, kinds)


# --- refusals ----------------------------------------------------------------------------------


async def test_illegal_transitions_are_failed_precondition_and_write_nothing(snapshotter, placer, nc, prefix):
    await create(nc, prefix, "a-1")
    before = await last_seq(nc, prefix)
    for attempt in (
        pause(nc, prefix, "a-1"),  # CREATED: nothing runs
        suspend(nc, prefix, "a-1"),
        tag(nc, prefix, "a-1", "t"),  # no snapshot yet
    ):
        assert (await refused(attempt)).code is ErrorCode.FAILED_PRECONDITION
    error = await refused(create(nc, prefix, "a-1"))
    assert (error.code, error.field) == (ErrorCode.ALREADY_EXISTS, "actor_id")
    assert await last_seq(nc, prefix) == before

    await placer.place("a-1", "w-1", "node-1", PIN_V1)
    await suspend(nc, prefix, "a-1", uri="s3://x")
    before = await last_seq(nc, prefix)
    assert (await refused(pause(nc, prefix, "a-1"))).code is ErrorCode.FAILED_PRECONDITION  # SUSPENDED
    assert (await refused(suspend(nc, prefix, "a-1"))).code is ErrorCode.FAILED_PRECONDITION
    await call(nc, subject(prefix, "stop", "a-1"), StopActor(), SeqReply)
    stopped = await last_seq(nc, prefix)
    assert stopped == before + 1  # ActorStopped only: nothing was held
    for attempt in (
        call(nc, subject(prefix, "stop", "a-1"), StopActor(), SeqReply),
        call(nc, subject(prefix, "update-template", "a-1"), UpdateTemplate(template_uid="tpl-2"), SeqReply),
        tag(nc, prefix, "a-1", "t"),
    ):
        assert (await refused(attempt)).code is ErrorCode.FAILED_PRECONDITION
    assert await last_seq(nc, prefix) == stopped


async def test_a_refusal_read_behind_another_process_s_placement_is_decided_again_on_the_leader_s_word(
        snapshotter, nats_server, nc, prefix, monkeypatch):
    """Any replica of the stream answers a direct get, and one may not have applied the latest
    append yet. A pause right after a placement another process wrote (the scheduler's), read
    that way, saw an actor that does not run and was refused FAILED_PRECONDITION. The snapshotter
    now asks the stream leader before it refuses on the actor's state, and decides again on what
    the leader has. A single server has no replica to lag: the lagging replica is played by the
    snapshotter's own direct reads, cut before the placement (the leader's reads are left alone),
    and the placement is written on a connection of its own, as from another process."""
    async with another_process(WireApplication, env_for(nats_server.url, prefix)) as elsewhere:
        await create(nc, prefix, "a-1")
        placed = await Placer(elsewhere).place("a-1", "w-1", "node-1", PIN_V1)
        stream = snapshotter.app.recorder.stream
        read = stream.read
        left_out: list[int] = []

        async def behind(subject: str, start: int, *args, **kwargs):
            msgs = await read(subject, start, *args, **kwargs)
            kept = [m for m in msgs if sequence_of(m) < placed]
            left_out.append(len(msgs) - len(kept))
            return kept

        monkeypatch.setattr(stream, "read", behind)
        paused = await pause(nc, prefix, "a-1")
        assert paused.seq > placed and paused.snapshot.node == "node-1"
        assert any(left_out)  # the replica's answer did lack the placement
        # a refusal the leader confirms stands, and writes nothing
        before = await last_seq(nc, prefix)
        assert (await refused(pause(nc, prefix, "a-1"))).code is ErrorCode.FAILED_PRECONDITION  # PAUSED
        assert (await refused(pause(nc, prefix, "ghost"))).code is ErrorCode.NOT_FOUND
        assert await last_seq(nc, prefix) == before


async def status(nc, prefix: str, actor_id: str) -> ActorStatus:
    return await call(nc, subject(prefix, "status", actor_id), ActorStatusQuery(), ActorStatus)


async def test_status_says_the_life_and_placement_a_later_request_names_and_writes_nothing(
        snapshotter, placer, nc, prefix):
    """`snapshotter.status.<actor_id>` (a project addition): the actor's state, the ActorCreated of its
    current life (a resume's `life_seq`), its last ActorPlaced of that life (a pause's or suspend's
    `placement_seq`; null before the life is placed), its last event and its latest snapshot (null for
    none), each as the log holds it; nothing written. A pause naming what it said is recorded; after the
    actor moves, the same is refused. An actor never created is NOT_FOUND, field actor_id; a subject token that is not an id,
    INVALID_ARGUMENT."""
    assert (await refused(status(nc, prefix, "a-1"))).code is ErrorCode.NOT_FOUND
    born = (await create(nc, prefix, "a-1")).seq
    assert await status(nc, prefix, "a-1") == ActorStatus(state=ActorState.CREATED, life_seq=born, seq=born)
    first = await placer.place("a-1", "w-1", "node-1", PIN_V1)
    now = await status(nc, prefix, "a-1")
    assert now == ActorStatus(state=ActorState.RUNNING, life_seq=born, placement_seq=first, seq=first)
    before = await last_seq(nc, prefix)
    assert await status(nc, prefix, "a-1") == now and await last_seq(nc, prefix) == before  # writes nothing

    paused = await pause(nc, prefix, "a-1", placement_seq=now.placement_seq)
    assert await status(nc, prefix, "a-1") == ActorStatus(state=ActorState.PAUSED, life_seq=born, placement_seq=first,
                                                          seq=paused.seq, snapshot=paused.snapshot)  # and its image
    moved = await placer.place("a-1", "w-2", "node-1", PIN_V2)
    before = await last_seq(nc, prefix)
    late = await refused(pause(nc, prefix, "a-1", placement_seq=now.placement_seq))  # a copy decided after the move
    assert (late.code, late.field) == (ErrorCode.FAILED_PRECONDITION, "placement_seq")
    assert await last_seq(nc, prefix) == before
    assert (await status(nc, prefix, "a-1")).placement_seq == moved

    await call(nc, subject(prefix, "stop", "a-1"), StopActor(), SeqReply)
    stopped = await status(nc, prefix, "a-1")
    assert (stopped.state, stopped.life_seq, stopped.placement_seq) == (ActorState.STOPPED, born, moved)
    reborn = (await create(nc, prefix, "a-1")).seq
    assert await status(nc, prefix, "a-1") == ActorStatus(state=ActorState.CREATED, life_seq=reborn, seq=reborn)
    bad = await refused(call(nc, f"{prefix}.snapshotter.status.-a", ActorStatusQuery(), ActorStatus))
    assert bad.code is ErrorCode.INVALID_ARGUMENT, bad


async def test_a_status_read_behind_another_process_s_placement_is_read_again_at_the_leader(
        snapshotter, nats_server, nc, prefix, monkeypatch):
    """A status read from a replica of the stream behind the scheduler's placement of a moment ago
    would name the actor's last placement, or none, and a pause naming it would be refused: the
    snapshotter asks the stream leader where the actor's history ends, and reads it again there
    (the replica played by its own direct reads, cut before the placement). An actor another
    process created a moment ago, never read here, is not NOT_FOUND for such a read."""
    def create_elsewhere(app: WireApplication, actor_id: str) -> int:
        made = Actor(actor_id)
        made.create(actor(actor_id, cpu=250, mem=256, template="tpl-1"), None, now())
        return app.save(made)[-1].notification.id

    async with another_process(WireApplication, env_for(nats_server.url, prefix)) as elsewhere:
        born = (await create(nc, prefix, "a-1")).seq
        assert (await status(nc, prefix, "a-1")).placement_seq is None  # read once: cached at the creation
        placed = await Placer(elsewhere).place("a-1", "w-1", "node-1", PIN_V1)
        other = await asyncio.to_thread(create_elsewhere, elsewhere, "a-2")
        reads_before(monkeypatch, snapshotter, placed)
        assert await status(nc, prefix, "a-1") == ActorStatus(state=ActorState.RUNNING, life_seq=born,
                                                              placement_seq=placed, seq=placed)
        assert await status(nc, prefix, "a-2") == ActorStatus(state=ActorState.CREATED, life_seq=other, seq=other)


def tag_elsewhere(app: WireApplication, actor_id: str, tag_name: str) -> int:
    """`actor_id`'s latest snapshot tagged `tag_name` by another process (`app`, a connection of its
    own): the sequence of the tag's event."""
    source = app.repository.get(Actor.create_id(actor_id))
    try:
        gold = app.repository.get(Tag.create_id(tag_name))
    except AggregateNotFoundError:
        gold = Tag(tag_name)
    source.tag(gold, None, now())
    return app.save(gold, source)[0].notification.id


def reads_before(monkeypatch, service: SnapshotterService, seq: int) -> None:
    """The service's reads of the stream answered as by a replica that has applied nothing from `seq` on
    (a single server has no replica to lag); the stream leader's reads left alone."""
    stream_reads_before(monkeypatch, service.app.recorder.stream, seq)


async def test_a_create_from_a_tag_read_behind_another_process_s_tag_is_decided_again(
        snapshotter, placer, nats_server, nc, prefix, monkeypatch):
    """The same for what a create reads besides the actor: a tag recorded a moment ago by another
    process, read from a replica behind it, named nothing (NOT_FOUND, field source_tag); the tag's
    history is confirmed by the stream leader as well before the create is refused."""
    async with another_process(WireApplication, env_for(nats_server.url, prefix)) as elsewhere:
        await create(nc, prefix, "a-1")
        await placer.place("a-1", "w-1", "node-1", PIN_V1)
        await suspend(nc, prefix, "a-1", uri="s3://golden")

        tagged = await asyncio.to_thread(tag_elsewhere, elsewhere, "a-1", "gold")
        reads_before(monkeypatch, snapshotter, tagged)
        made = await create(nc, prefix, "a-2", source_tag="gold")
        assert made.seq > tagged
        missing = await refused(create(nc, prefix, "a-3", source_tag="never"))
        assert (missing.code, missing.field) == (ErrorCode.NOT_FOUND, "source_tag")


async def test_a_create_from_a_tag_read_behind_a_retag_copies_what_the_tag_names_now(
        snapshotter, placer, nats_server, nc, prefix, monkeypatch):
    """A create copies the tag's snapshot as it read it, and its append expected only the actor's
    subject: another process moved tag `gold` from a-1's image (V1) to a-2's (V2), and a create whose
    read of the tag came from a replica behind the move was taken with a-1's image, though its caller
    had the move's seq (found by an audit). The append now expects the tag's subject where it was
    read too: refused by the leader, decided again, and the copy is the image the tag names now."""
    async with another_process(WireApplication, env_for(nats_server.url, prefix)) as elsewhere:
        for actor_id, pin in (("a-1", PIN_V1), ("a-2", PIN_V2)):
            await create(nc, prefix, actor_id)
            await placer.place(actor_id, "w-1", "node-1", pin)
            await suspend(nc, prefix, actor_id, uri=f"s3://{actor_id}")
        first = (await tag(nc, prefix, "a-1", "gold")).snapshot  # read by the snapshotter

        moved = await asyncio.to_thread(tag_elsewhere, elsewhere, "a-2", "gold")
        reads_before(monkeypatch, snapshotter, moved)
        made = await create(nc, prefix, "copy", source_tag="gold")
        monkeypatch.undo()
        ((seq, created),) = [(s, e) for s, _, e in await read_entries(nc, prefix)
                             if isinstance(e, ActorCreated) and e.actor_id == "copy"]
        assert moved < seq <= made.seq
        assert created.snapshot.sandbox_runtime == PIN_V2 and created.snapshot.snapshot_id != first.snapshot_id, (
            created.snapshot)


async def test_unknown_actors_are_not_found(snapshotter, nc, prefix):
    await create(nc, prefix, "exists")  # the stream exists; nothing else does
    before = await last_seq(nc, prefix)
    for attempt in (
        pause(nc, prefix, "ghost"),
        suspend(nc, prefix, "ghost"),
        tag(nc, prefix, "ghost", "t"),
        call(nc, subject(prefix, "update-template", "ghost"), UpdateTemplate(template_uid="t"), SeqReply),
        call(nc, subject(prefix, "stop", "ghost"), StopActor(), SeqReply),
    ):
        assert (await refused(attempt)).code is ErrorCode.NOT_FOUND
    mismatch = await refused(call(nc, subject(prefix, "create", "other"), actor("ghost", cpu=1, mem=1, template="t"),
                                  SeqReply))
    assert (mismatch.code, mismatch.field) == (ErrorCode.INVALID_ARGUMENT, "actor_id")
    assert await last_seq(nc, prefix) == before


async def test_an_actor_whose_history_this_version_cannot_read_is_unavailable_and_nothing_is_written(
        snapshotter, placer, nc, prefix):
    """A newer version's event on the actor's subject (the contract may add events), or a body this
    version refuses: every command on the actor is UNAVAILABLE (a retry may reach a service of the
    version that wrote it), naming the event, and writes nothing. It was INTERNAL, naming nothing."""
    js = nc.jetstream()
    await create(nc, prefix, "a-1")
    await placer.place("a-1", "w-1", "node-1", PIN_V1)
    await create(nc, prefix, "a-2")
    unknown = await js.publish(
        f"{prefix}.ev.actor.a-1", b'{"type":"ActorMigrated","actor_id":"a-1","at":"2026-12-01T10:00:00Z"}',
        stream=stream_name(prefix), headers={TOPIC_HEADER: "ActorMigrated", VERSION_HEADER: "3"})
    unknown_first = await js.publish(  # one a create finds: the history is there, whatever it says
        f"{prefix}.ev.actor.a-3", b'{"type":"ActorSpawned","actor_id":"a-3","at":"2026-12-01T10:00:00Z"}',
        stream=stream_name(prefix), headers={TOPIC_HEADER: "ActorSpawned", VERSION_HEADER: "1"})
    why = {"a-1": f"(its version 3 at stream sequence {unknown.seq}): its type 'ActorMigrated' is not one this "
                  f"version knows",
           "a-3": f"(its version 1 at stream sequence {unknown_first.seq}): its type 'ActorSpawned' is not one this "
                  f"version knows"}
    for actor_id, cause in why.items():
        for attempt in (
            pause(nc, prefix, actor_id),
            suspend(nc, prefix, actor_id, uri="s3://x"),
            tag(nc, prefix, actor_id, "t"),
            call(nc, subject(prefix, "update-template", actor_id), UpdateTemplate(template_uid="t-2"), SeqReply),
            call(nc, subject(prefix, "stop", actor_id), StopActor(), SeqReply),
            create(nc, prefix, actor_id),
        ):
            error = await refused(attempt)
            assert error.code is ErrorCode.UNAVAILABLE, error
            assert f"the history of actor.{actor_id} holds an event this service cannot read {cause}" in error.message
    assert await last_seq(nc, prefix) == unknown_first.seq


def test_a_body_this_version_refuses_is_named_where_the_history_is_read(caplog):
    """The same for an event of a known type whose body this version refuses (a field it does not
    have yet), and for a message with no type at all: the store's mapper is the one place a
    history is read into events. The service's log says it once per event, however often a
    command is retried on that history (its caller's answer is the caller's; STATS shows a code)."""
    from eventsourcing.persistence import JSONTranscoder, StoredEvent

    from events.aggregate import WireMapper

    mapper = WireMapper(transcoder=JSONTranscoder())
    refused_body = StoredEvent(originator_id="actor.mapped-here", originator_version=2, topic="SnapshotTaken",
                               state=b'{"type":"SnapshotTaken","actor_id":"mapped-here","at":"2026-12-01T10:00:00Z"}')
    untyped = StoredEvent(originator_id="actor.mapped-here", originator_version=3, topic="", state=b'{"seq":4}')
    expected = {
        refused_body: "its body does not read as SnapshotTaken: Object missing required field `snapshot`",
        untyped: "its type '' is not one this version knows",
    }
    with caplog.at_level(logging.WARNING, logger="warmboot.events"):
        for stored, why in expected.items():
            for _ in range(3):
                with pytest.raises(ContractError) as refused_read:
                    mapper.to_domain_event(stored)
                assert refused_read.value.code is ErrorCode.UNAVAILABLE
                assert refused_read.value.message == (
                    f"the history of actor.mapped-here holds an event this service cannot read (its version "
                    f"{stored.originator_version}): {why}; the services and the log are of different versions "
                    f"of warmboot")
    assert [r.getMessage() for r in caplog.records if r.name == "warmboot.events"] == [
        f"the history of actor.mapped-here holds an event this service cannot read (its version {stored.originator_version}): "
        f"{why}; the services and the log are of different versions of warmboot" for stored, why in expected.items()]


# --- update-template and stop ------------------------------------------------------------------


async def test_update_template_and_stop(snapshotter, placer, nc, prefix):
    first = await create(nc, prefix, "a-1")
    same = await call(nc, subject(prefix, "update-template", "a-1"), UpdateTemplate(template_uid="tpl-1"), SeqReply)
    assert (same.seq, same.unchanged) == (first.seq, True)  # unchanged: the event that set it
    assert not first.unchanged
    changed = await call(nc, subject(prefix, "update-template", "a-1"),
                         UpdateTemplate(template_uid="tpl-2", request_id="tpl-2"), SeqReply)
    assert (changed.seq, changed.unchanged) == (await last_seq(nc, prefix), False)
    retried = await call(nc, subject(prefix, "update-template", "a-1"),
                         UpdateTemplate(template_uid="tpl-2", request_id="tpl-2"), SeqReply)
    assert retried == changed  # the retry of a change is answered as the change, not as "unchanged"
    await placer.place("a-1", "w-3", "node-3", PIN_V1)
    stopped = await call(nc, subject(prefix, "stop", "a-1"), StopActor(), SeqReply)
    tail = [e for _, _, e in await read_entries(nc, prefix)][-4:]
    assert isinstance(tail[0], TemplateChanged) and tail[0].template_uid == "tpl-2"
    assert isinstance(tail[1], ActorPlaced)
    assert isinstance(tail[2], ActorReleased) and (tail[2].worker_id, tail[2].reason) == ("w-3", ReleaseReason.STOPPED)
    assert isinstance(tail[3], ActorStopped)
    assert stopped.seq == await last_seq(nc, prefix)


async def test_a_template_read_behind_another_process_s_change_is_not_answered_unchanged(
        snapshotter, nats_server, nc, prefix, monkeypatch):
    """A template set back to tpl-1 right after another process changed it to tpl-2, read from a
    replica of the stream behind that change: the history it read says tpl-1, so it answered with
    the creation's seq and wrote nothing, the log left on tpl-2 (the registry's UNCHANGED had the
    same fault: an audit). An answer that writes nothing now stands only once the stream leader
    has nothing past what was read; otherwise it is decided again on the leader's history."""
    async with another_process(WireApplication, env_for(nats_server.url, prefix)) as elsewhere:
        await create(nc, prefix, "a-1")

        def change_elsewhere() -> int:
            actor = elsewhere.repository.get(Actor.create_id("a-1"))
            assert actor.change_template("tpl-2", None, now())
            return elsewhere.save(actor)[0].notification.id

        changed = await asyncio.to_thread(change_elsewhere)
        reads_before(monkeypatch, snapshotter, changed)
        back = await call(nc, subject(prefix, "update-template", "a-1"), UpdateTemplate(template_uid="tpl-1"),
                          SeqReply)
        monkeypatch.undo()
        templates = [(seq, e.template_uid) for seq, _, e in await read_entries(nc, prefix)
                     if isinstance(e, TemplateChanged)]
        assert templates == [(changed, "tpl-2"), (back.seq, "tpl-1")], (templates, back)


async def test_a_retry_read_behind_the_actor_s_next_life_is_decided_on_the_leader_s_history(
        snapshotter, nats_server, nc, prefix, monkeypatch):
    """A stop retried with its request id after the actor was created anew through another process,
    read from a replica of the stream behind that creation: the history it read has the stop in the
    current life, so the stop's first answer was given and nothing written. An answer from before
    writes nothing, so it stands only on the history as the leader has it, where the retry is decided
    again: there its id is an earlier life's, so it is refused (FAILED_PRECONDITION, field request_id;
    a stop made for that life does not stop this one: docs/contract.md), the new life left running."""
    async with another_process(WireApplication, env_for(nats_server.url, prefix)) as elsewhere:
        await create(nc, prefix, "a-1")
        first = await call(nc, subject(prefix, "stop", "a-1"), StopActor(request_id="stop-1"), SeqReply)

        def create_elsewhere() -> int:
            anew = elsewhere.repository.get(Actor.create_id("a-1"))
            anew.create(actor("a-1", cpu=250, mem=256, template="tpl-1"), None, now())
            return elsewhere.save(anew)[0].notification.id

        recreated = await asyncio.to_thread(create_elsewhere)
        reads_before(monkeypatch, snapshotter, recreated)
        with pytest.raises(ContractError) as again:
            await call(nc, subject(prefix, "stop", "a-1"), StopActor(request_id="stop-1"), SeqReply)
        monkeypatch.undo()
        assert (again.value.code, again.value.field) == (ErrorCode.FAILED_PRECONDITION, "request_id"), again.value
        stops = [seq for seq, _, e in await read_entries(nc, prefix) if isinstance(e, ActorStopped)]
        assert stops == [first.seq] and first.seq < recreated, (stops, first, recreated)


# --- idempotency --------------------------------------------------------------------------------


async def test_request_id_retry_returns_the_first_answer_and_writes_one_event(snapshotter, placer, nc, prefix):
    await create(nc, prefix, "a-1", request_id="create-1")
    assert (await create(nc, prefix, "a-1", request_id="create-1")).seq == 1  # not ALREADY_EXISTS
    await placer.place("a-1", "w-1", "node-1", PIN_V1)
    first = await pause(nc, prefix, "a-1", request_id="pause-1")
    after_first = await last_seq(nc, prefix)
    again = await pause(nc, prefix, "a-1", request_id="pause-1")
    assert again == first and await last_seq(nc, prefix) == after_first


    # Concurrent duplicates: one answer, one write.
    replies = await asyncio.gather(*(suspend(nc, prefix, "a-1", uri="s3://x", request_id="susp-1") for _ in range(4)))
    assert all(r == replies[0] for r in replies)
    log = [e for _, _, e in await read_entries(nc, prefix)]
    assert sum(isinstance(e, SnapshotTaken) and e.request_id == "susp-1" for e in log) == 1
    assert sum(isinstance(e, SnapshotTaken) and e.request_id == "pause-1" for e in log) == 1

    # A request_id already used for another verb on this actor is refused, not misanswered.
    error = await refused(tag(nc, prefix, "a-1", "t", request_id="pause-1"))
    assert (error.code, error.field) == (ErrorCode.FAILED_PRECONDITION, "request_id")


# --- the log is the contract --------------------------------------------------------------------


async def test_raw_subscriber_reads_the_stamp_as_the_contract_says(snapshotter, placer, nc, prefix):
    await create(nc, prefix, "a-1")
    await placer.place("a-1", "w-1", "node-1", PIN_V1)
    reply = await pause(nc, prefix, "a-1")
    msg = await nc.jetstream().get_msg(stream_name(prefix), seq=reply.seq - 1)
    assert msg.subject == f"{prefix}.ev.actor.a-1"
    raw = msgspec.json.decode(msg.data)
    assert raw["type"] == "SnapshotTaken" and raw["actor_id"] == "a-1" and raw["origin"] == "PAUSE"
    stamp = raw["snapshot"]["sandbox_runtime"]
    assert stamp["sandbox_class"] == CLASS and stamp["version"]["schema_version"] == "v1"
    assert {a["key"]: a["value"] for a in stamp["version"]["attributes"]} == {
        "architecture": "amd64", "gvisor_asset_hash": "aaaa1111"}
    assert raw["snapshot"]["location"] == "LOCAL" and raw["snapshot"]["node"] == "node-1"
    assert decode_event(msg.data).snapshot == reply.snapshot
    released = decode_event((await nc.jetstream().get_msg(stream_name(prefix), seq=reply.seq)).data)
    assert isinstance(released, ActorReleased) and released.reason is ReleaseReason.PAUSED


@pytest.mark.parametrize("topic, body", [
    # a newer registry's event type: a move to another node, or a removal, in a form this version does not know
    ("WorkerRelocated", b'{"type":"WorkerRelocated","worker_id":"w-1","node":"node-2","at":"2026-12-01T10:00:00Z"}'),
    # an update this version refuses (a capacity field of a newer schema it does not know the form of)
    ("WorkerUpdated", b'{"type":"WorkerUpdated","worker_id":"w-1","node":"node-2","capacity":{"cpu_millis":"8 cores",'
                      b'"memory_mib":16384},"labels":{},"at":"2026-12-01T10:00:00Z"}'),
])
async def test_a_pause_on_a_worker_whose_history_holds_a_later_event_it_cannot_read_is_unavailable(
        snapshotter, registry, placer, nc, prefix, topic, body):
    """After the placement, the worker's history holds an event this version cannot read, which may have
    moved it to another node or removed it. The pause read the worker's history by topic alone: an unknown
    type was passed over, and the LOCAL image recorded on the assignment's node (where the worker may no
    longer be: a resume there cannot load it); an update it refused ended the command with a
    msgspec.ValidationError (INTERNAL). UNAVAILABLE now, naming the message, and nothing written."""
    await register(nc, prefix, registration("w-1", "node-1", V1))
    await create(nc, prefix, "a-1")
    await placer.place("a-1", "w-1", "node-1", PIN_V1)
    js = nc.jetstream()
    version = (await js.get_last_msg(stream_name(prefix), f"{prefix}.ev.worker.w-1")).headers[VERSION_HEADER]
    newer = await js.publish(f"{prefix}.ev.worker.w-1", body, stream=stream_name(prefix),
                             headers={TOPIC_HEADER: topic, VERSION_HEADER: str(int(version) + 1)})
    before = await last_seq(nc, prefix)
    try:
        error = await refused(pause(nc, prefix, "a-1"))
        assert error.code is ErrorCode.UNAVAILABLE, error
        assert "worker.w-1" in error.message and f"sequence {newer.seq}" in error.message
        assert await last_seq(nc, prefix) == before  # nothing written
    finally:  # not left for the traffic check
        await js.delete_msg(stream_name(prefix), newer.seq)


# --- worker removal ------------------------------------------------------------------------------


async def test_a_removed_workers_actors_are_released_once_with_two_replicas(
    snapshotter, registry, placer, nats_server, nc, prefix
):
    async with another_replica(snapshotter, nats_server.url, prefix) as second:
        await register(nc, prefix, registration("w-1", "node-1", V1))
        for actor_id in ("a-1", "a-2", "a-3"):
            await create(nc, prefix, actor_id)
        await placer.place("a-1", "w-1", "node-1", PIN_V1)
        await placer.place("a-2", "w-1", "node-1", PIN_V1)
        await placer.place("a-3", "w-other", "node-2", PIN_V1)  # elsewhere: untouched
        paused_seq = (await pause(nc, prefix, "a-1")).seq  # released already (PAUSED)
        await placer.place("a-1", "w-1", "node-1", PIN_V1)  # resumed on its node: placed again

        removed = await call(nc, service_subject(prefix, "registry", "remove", "w-1"), RemoveWorker(reason="gone"),
                             SeqReply)
        assert removed.seq > paused_seq
        # Both replicas fold past the removal and past the releases it caused.
        releases = await released_by_removal(nc, prefix, count=2)
        settled = max(seq for seq, _ in releases)
        assert await snapshotter.wait_followed(settled) and await second.wait_followed(settled)

        log = await read_entries(nc, prefix)
        removal = [e for _, _, e in log if isinstance(e, ActorReleased) and e.reason is ReleaseReason.WORKER_REMOVED]
        assert sorted(e.actor_id for e in removal) == ["a-1", "a-2"]  # each exactly once
        assert all(e.worker_id == "w-1" for e in removal)
        assert snapshotter.process.released + second.process.released == 2
        (worker_removed,) = [e for _, _, e in log if isinstance(e, WorkerRemoved)]
        assert all(e.at == worker_removed.at for e in removal)  # decided from the log, not a clock

        # Released actors are suspended: they can be placed again, and paused there.
        await placer.place("a-2", "w-2", "node-2", PIN_V1)
        assert (await pause(nc, prefix, "a-2")).snapshot.node == "node-2"


async def test_an_actor_whose_history_it_cannot_read_holds_up_no_removal_and_is_released_once_it_can(
        snapshotter, registry, placer, nats_server, nc, prefix, caplog):
    """A removed worker ran two actors, one of whose histories holds an event this version cannot
    read (after a rollback). Reading it failed the whole position, which the follower retried for
    ever: not even the other actor was released, nor any actor of a worker removed later. Now the
    others are released and the removals go on; the one left is tried again as the log moves, and
    a replica that starts takes it up from its fold. Once an operator has removed the event, it is
    released, once."""
    await register(nc, prefix, registration("w-1", "node-1", V1))
    await register(nc, prefix, registration("w-2", "node-2", V1))
    for actor_id, worker_id, node in (("a-1", "w-1", "node-1"), ("a-2", "w-1", "node-1"), ("a-3", "w-2", "node-2")):
        await create(nc, prefix, actor_id)
        await placer.place(actor_id, worker_id, node, PIN_V1)
    js = nc.jetstream()
    unknown = await js.publish(
        f"{prefix}.ev.actor.a-2", b'{"type":"ActorMigrated","actor_id":"a-2","at":"2026-12-01T10:00:00Z"}',
        stream=stream_name(prefix), headers={TOPIC_HEADER: "ActorMigrated", VERSION_HEADER: "3"})
    with caplog.at_level(logging.WARNING, logger="warmboot.snapshotter"):
        for worker_id in ("w-1", "w-2"):
            await call(nc, service_subject(prefix, "registry", "remove", worker_id), RemoveWorker(), SeqReply)
        releases = await released_by_removal(nc, prefix, count=2)
        assert await snapshotter.wait_followed(max(seq for seq, _ in releases))
    assert sorted((e.actor_id, e.worker_id) for _, e in releases) == [("a-1", "w-1"), ("a-3", "w-2")]
    assert (await js.get_last_msg(stream_name(prefix), f"{prefix}.ev.actor.a-2")).seq == unknown.seq  # left
    assert "a-2" in snapshotter.process.left
    assert any("a-2" in r.getMessage() and "wait for histories" in r.getMessage() for r in caplog.records)

    snapshotter.process._left_next = math.inf  # this replica tries no more: the start below must take it up
    await js.delete_msg(stream_name(prefix), unknown.seq)  # an operator removes the event
    async with another_replica(snapshotter, nats_server.url, prefix) as second:  # its start takes it up from its fold
        # once it has followed the log to where it ended at its start: at the next event it follows
        await register(nc, prefix, registration("w-9", "node-9", V1))
        releases = await released_by_removal(nc, prefix, count=3)
        settled = max(seq for seq, _ in releases)  # a position the processes follow (a fence is not one)
        assert await snapshotter.wait_followed(settled) and await second.wait_followed(settled)
        assert second.process.released == 1
    subjects = (await js.stream_info(stream_name(prefix), subjects_filter=f"{prefix}.ev.actor.a-2")).state.subjects
    assert subjects == {f"{prefix}.ev.actor.a-2": 3}  # created, placed, released once (the event is gone)
    assert sorted((e.actor_id, e.worker_id) for _, e in releases) == [("a-1", "w-1"), ("a-2", "w-1"), ("a-3", "w-2")]


async def test_a_followed_event_whose_body_it_cannot_read_holds_up_no_later_removal(
        snapshotter, registry, placer, nc, prefix, caplog):
    """A newer snapshotter released an actor for a reason this version does not know (a new
    ReleaseReason): an event of a type the process follows, with a body it refuses. Mapping it
    failed the subscription, which was made again at the same position and failed again, for ever:
    no worker removed later had its actors released."""
    await register(nc, prefix, registration("w-1", "node-1", V1))
    await register(nc, prefix, registration("w-2", "node-2", V1))
    for actor_id, worker_id, node in (("a-1", "w-1", "node-1"), ("a-2", "w-2", "node-2")):
        await create(nc, prefix, actor_id)
        await placer.place(actor_id, worker_id, node, PIN_V1)
    js = nc.jetstream()
    newer = await js.publish(
        f"{prefix}.ev.actor.a-1",
        b'{"type":"ActorReleased","actor_id":"a-1","worker_id":"w-1","reason":"EVICTED","at":"2026-12-01T10:00:00Z"}',
        stream=stream_name(prefix), headers={TOPIC_HEADER: "ActorReleased", VERSION_HEADER: "3"})
    try:
        with caplog.at_level(logging.WARNING, logger="warmboot.snapshotter"):
            await call(nc, service_subject(prefix, "registry", "remove", "w-2"), RemoveWorker(), SeqReply)
            (released,) = await released_by_removal(nc, prefix, count=1)
        assert (released[1].actor_id, released[1].worker_id) == ("a-2", "w-2")
        assert any("a-1" in r.getMessage() and "cannot read" in r.getMessage() for r in caplog.records)
    finally:  # not left for the traffic check, which judges the session's streams against this version's schema
        await js.delete_msg(stream_name(prefix), newer.seq)


async def test_a_removed_worker_with_a_later_event_it_cannot_read_is_not_taken_for_removed(
        snapshotter, registry, placer, nc, prefix):
    """A removed worker's history then holds an event of a newer registry (a type this version does
    not know: its next life, say), and a newer scheduler places an actor on it. The process still
    took the worker for removed and released the actor (WORKER_REMOVED, SUSPENDED in the log) while
    it ran there: a resume then placed it a second time. A worker event it cannot read leaves the
    worker's state unknown to the process: it releases nothing placed on it afterwards."""
    await register(nc, prefix, registration("w-1", "node-1", V1))
    await call(nc, service_subject(prefix, "registry", "remove", "w-1"), RemoveWorker(), SeqReply)
    js = nc.jetstream()
    version = (await js.get_last_msg(stream_name(prefix), f"{prefix}.ev.worker.w-1")).headers[VERSION_HEADER]
    await js.publish(
        f"{prefix}.ev.worker.w-1", b'{"type":"WorkerRejoined","worker_id":"w-1","at":"2026-12-01T10:00:00Z"}',
        stream=stream_name(prefix), headers={TOPIC_HEADER: "WorkerRejoined", VERSION_HEADER: str(int(version) + 1)})
    await create(nc, prefix, "a-1")
    await placer.place("a-1", "w-1", "node-1", PIN_V1)
    # a removal after it, whose release is awaited: the process has followed past the placement
    await register(nc, prefix, registration("w-2", "node-2", V1))
    await create(nc, prefix, "a-2")
    await placer.place("a-2", "w-2", "node-2", PIN_V1)
    await call(nc, service_subject(prefix, "registry", "remove", "w-2"), RemoveWorker(), SeqReply)
    releases = await released_by_removal(nc, prefix, count=1)
    assert [(e.actor_id, e.worker_id) for _, e in releases] == [("a-2", "w-2")]  # a-1 was not released first
    a1 = [e for _, _, e in await read_entries(nc, prefix, f"{prefix}.ev.actor.a-1")]
    assert not [e for e in a1 if isinstance(e, ActorReleased)]


async def test_a_removal_whose_body_it_cannot_read_still_releases_the_workers_actors(
        snapshotter, registry, placer, nc, prefix):
    """A newer registry's removal with a reason longer than this version takes: its topic says it is a
    removal, and its time reads, so the worker's actors are released as of it."""
    await register(nc, prefix, registration("w-1", "node-1", V1))
    await create(nc, prefix, "a-1")
    await placer.place("a-1", "w-1", "node-1", PIN_V1)
    js = nc.jetstream()
    version = (await js.get_last_msg(stream_name(prefix), f"{prefix}.ev.worker.w-1")).headers[VERSION_HEADER]
    body = b'{"type":"WorkerRemoved","worker_id":"w-1","reason":"%s","at":"2026-12-01T10:00:00Z"}' % (b"x" * 300)
    newer = await js.publish(f"{prefix}.ev.worker.w-1", body, stream=stream_name(prefix),
                             headers={TOPIC_HEADER: "WorkerRemoved", VERSION_HEADER: str(int(version) + 1)})
    try:
        (released,) = await released_by_removal(nc, prefix, count=1)
        assert (released[1].actor_id, released[1].worker_id) == ("a-1", "w-1")
        assert released[1].at == datetime(2026, 12, 1, 10, tzinfo=timezone.utc)
    finally:  # not left for the traffic check
        await js.delete_msg(stream_name(prefix), newer.seq)


async def test_a_release_that_failed_on_the_store_is_made_when_it_is_tried_again(
        snapshotter, registry, placer, nc, prefix, monkeypatch):
    """The removal's releases failed to append once (an outage) and were tried again: the event
    was folded again too, and a removal folded twice hands out no placement the second time, so
    the releases were never made (by this replica)."""
    from eventsourcing.persistence import OperationalError

    await register(nc, prefix, registration("w-1", "node-1", V1))
    await create(nc, prefix, "a-1")
    await placer.place("a-1", "w-1", "node-1", PIN_V1)
    record = snapshotter.process._record
    failed = []

    def once_unavailable(processing):
        if not failed:
            failed.append(processing)
            raise OperationalError("the store did not answer")
        return record(processing)

    monkeypatch.setattr(snapshotter.process, "_record", once_unavailable)
    await call(nc, service_subject(prefix, "registry", "remove", "w-1"), RemoveWorker(), SeqReply)
    ((_, released),) = await released_by_removal(nc, prefix, count=1)
    assert failed and (released.actor_id, released.worker_id) == ("a-1", "w-1")


async def test_a_restarted_replica_does_not_release_again(registry, placer, nats_server, nc, prefix):
    env = env_for(nats_server.url, prefix)
    first = await SnapshotterService(nc, nats_url=nats_server.url, prefix=prefix, env=env).start()
    try:
        await register(nc, prefix, registration("w-1", "node-1", V1))
        await create(nc, prefix, "a-1")
        await placer.place("a-1", "w-1", "node-1", PIN_V1)
        await call(nc, service_subject(prefix, "registry", "remove", "w-1"), RemoveWorker(), SeqReply)
        ((seq, _),) = await released_by_removal(nc, prefix, count=1)
        assert await first.wait_followed(seq) and first.process.released == 1
    finally:
        await first.stop()
    before = await last_seq(nc, prefix)
    again = await SnapshotterService(nc, nats_url=nats_server.url, prefix=prefix, env=env).start()
    try:
        assert await again.wait_followed(seq)  # folded the whole log again from its start
        assert again.process.released == 0 and await last_seq(nc, prefix) == before
    finally:
        await again.stop()


@contextlib.contextmanager
def releases_held(service: SnapshotterService):
    """The service's worker-removal process stops before making any release (a WorkerRemoved's, or
    an ActorPlaced's on a removed worker) until the block ends: a removal is in the log and its
    releases are not yet (the window a pause may fall into)."""
    hold = threading.Event()
    process = service.process
    act = process._act

    def held(releases, at, tracking):
        if releases:
            hold.wait(60)
        act(releases, at, tracking)

    process._act = held
    try:
        yield
    finally:
        hold.set()


async def placed_then_removed_pending_release(snapshotter, nc, prefix, placer) -> int:
    await register(nc, prefix, registration("w-1", "node-1", V1))
    await create(nc, prefix, "a-1")
    return await placer.place("a-1", "w-1", "node-1", PIN_V1)


async def test_an_actor_whose_worker_was_removed_is_neither_paused_nor_suspended_there(
    snapshotter, registry, placer, nc, prefix
):
    """A removed worker's RUNNING actors are released, SUSPENDED from their latest snapshot. A
    pause or a suspend that the snapshotter decides after the removal but before the release must
    not record an image of that worker (a LOCAL one would send the actor's next resume to its node)."""
    with releases_held(snapshotter):
        await placed_then_removed_pending_release(snapshotter, nc, prefix, placer)
        removed = await call(nc, service_subject(prefix, "registry", "remove", "w-1"), RemoveWorker(), SeqReply)
        before = await last_seq(nc, prefix)  # the removal and its fence
        for attempt in (pause(nc, prefix, "a-1"), suspend(nc, prefix, "a-1", uri="s3://x/a-1")):
            with pytest.raises(ContractError) as refused:
                await attempt
            assert refused.value.code is ErrorCode.FAILED_PRECONDITION
            assert f"the worker was removed (sequence {removed.seq})" in refused.value.message
        assert await last_seq(nc, prefix) == before  # nothing written
    ((_, release),) = await released_by_removal(nc, prefix, count=1)
    assert release.actor_id == "a-1" and release.worker_id == "w-1"


async def test_a_pause_whose_read_of_its_worker_finds_nothing_is_fenced_on_the_worker_s_subject(
    snapshotter, registry, placer, nc, prefix, monkeypatch
):
    """A pause reads its worker's last event from any replica of the stream: one behind the worker's
    whole history answers nothing. The pause then checked no removal and was appended with no fence
    at all: a LOCAL image recorded on a removed worker, the next resume sent to its node (found by an
    audit). Now it expects the worker's subject to be empty, as it read it: the leader refuses the
    append, and the pause decided again on the leader's history is refused. The lagging replica is
    played by the snapshotter's direct get of the worker's subject answering nothing, and by its link
    forgetting that subject (this test's registry shares its process; a replica of its own would not
    have read it)."""
    with releases_held(snapshotter):
        await placed_then_removed_pending_release(snapshotter, nc, prefix, placer)
        removed = await call(nc, service_subject(prefix, "registry", "remove", "w-1"), RemoveWorker(), SeqReply)
        before = await last_seq(nc, prefix)
        stream = snapshotter.app.recorder.stream
        last_direct = stream.last_direct
        subject = event_subject(prefix, "worker", "w-1")
        answered_nothing: list[str] = []

        async def behind(asked: str, *args, **kwargs):
            if asked == subject:
                answered_nothing.append(asked)
                return None
            return await last_direct(asked, *args, **kwargs)

        monkeypatch.setattr(stream, "last_direct", behind)
        snapshotter.app.recorder.link.last_seen.forget([subject])
        error = await refused(pause(nc, prefix, "a-1"))
        assert error.code is ErrorCode.FAILED_PRECONDITION and f"(sequence {removed.seq})" in error.message, error
        assert answered_nothing  # the replica's answer did lack the worker's history
        assert await last_seq(nc, prefix) == before  # nothing written


async def test_a_removal_landing_between_the_read_and_the_append_of_a_pause_wins(
    snapshotter, registry, placer, writer, nc, prefix
):
    """The pause read the worker's history (alive), then the removal was appended, then the pause's
    append: its fence on the worker's history refuses it, and the decision taken again refuses."""
    with releases_held(snapshotter):
        await placed_then_removed_pending_release(snapshotter, nc, prefix, placer)
        fence = snapshotter.placement_fence
        reads: list[int] = []

        async def removed_meanwhile(actor, verb):
            answer = await fence(actor, verb)
            reads.append(answer["worker.w-1"])
            if len(reads) == 1:  # as the registry writes a removal: the event and its fence
                await asyncio.to_thread(writer.write, WorkerRemoved(at=now(), worker_id="w-1", reason="gone"),
                                        WorkerFenced(at=now(), worker_id="w-1", event="WorkerRemoved"))
            return answer

        snapshotter.placement_fence = removed_meanwhile
        with pytest.raises(ContractError) as refused:
            await pause(nc, prefix, "a-1")
        assert refused.value.code is ErrorCode.FAILED_PRECONDITION and "the worker was removed" in refused.value.message
        assert len(reads) == 1  # the second decision found the removal and fenced nothing
        log = await read_entries(nc, prefix)
        assert not [e for _, _, e in log if isinstance(e, SnapshotTaken)]
        assert isinstance(log[-1][2], WorkerFenced)  # the removal was the last write


async def released_by_removal(nc, prefix: str, count: int) -> list[tuple[int, ActorReleased]]:
    """Wait (on the stream, not a clock) for `count` WORKER_REMOVED releases; return them."""
    js = nc.jetstream()
    sub = await js.subscribe(f"{prefix}.ev.actor.*", ordered_consumer=True)
    found: list[tuple[int, ActorReleased]] = []
    try:
        while len(found) < count:
            msg = await sub.next_msg(timeout=10)
            try:
                event = decode_event(msg.data)
            except msgspec.DecodeError:  # an event of another version, written on purpose
                continue
            if isinstance(event, ActorReleased) and event.reason is ReleaseReason.WORKER_REMOVED:
                found.append((msg.metadata.sequence.stream, event))
    finally:
        await sub.unsubscribe()
    return found


async def test_concurrent_pauses_on_two_replicas_one_wins_the_other_re_reads(
    snapshotter, placer, nats_server, nc, prefix
):
    """Eight pauses of one actor at once, shared by two replicas that share nothing but the
    server, five rounds: one pause wins each round, the others are refused on the state they
    read again (PAUSED), and the log holds one snapshot and one release per round."""
    rounds = 5
    async with another_replica(snapshotter, nats_server.url, prefix, follow=False) as second:
        for round_ in range(rounds):
            actor_id = f"a-{round_}"
            await create(nc, prefix, actor_id)
            await placer.place(actor_id, "w-1", "node-1", PIN_V1)
            outcomes = await asyncio.gather(*(pause(nc, prefix, actor_id) for _ in range(8)),
                                            return_exceptions=True)
            won = [o for o in outcomes if isinstance(o, SnapshotReply)]
            lost = [o for o in outcomes if isinstance(o, ContractError)]
            assert len(won) == 1 and len(lost) == 7, outcomes
            assert all(e.code is ErrorCode.FAILED_PRECONDITION for e in lost)  # re-read: PAUSED now
        served = [next(e.num_requests for e in replica.micro.stats().endpoints if e.name == "pause")
                  for replica in (snapshotter, second)]
        assert sum(served) == 8 * rounds and min(served) > 0, served  # both replicas took part
        log = [e for _, _, e in await read_entries(nc, prefix)]
        assert sum(isinstance(e, SnapshotTaken) for e in log) == rounds
        assert sum(isinstance(e, ActorReleased) for e in log) == rounds


async def test_a_placement_racing_a_stop_never_leaves_a_stopped_actor_placed(snapshotter, placer, nc, prefix):
    await create(nc, prefix, "a-1")
    stop = asyncio.ensure_future(call(nc, subject(prefix, "stop", "a-1"), StopActor(), SeqReply))
    try:
        await placer.place("a-1", "w-1", "node-1", PIN_V1)
    except ContractError as error:  # the stop won: a stopped actor is not placed
        assert error.code is ErrorCode.FAILED_PRECONDITION
    await stop
    log = [e for _, _, e in await read_entries(nc, prefix)]
    assert isinstance(log[-1], ActorStopped)
    if any(isinstance(e, ActorPlaced) for e in log):  # the placement won: the stop released it
        assert isinstance(log[-2], ActorReleased) and log[-2].reason is ReleaseReason.STOPPED


async def test_snapshots_and_releases_are_counted(snapshotter, placer, nc, prefix):
    from prometheus_client import REGISTRY

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    pauses = value("warmboot_snapshots_taken_total", sandbox_class=CLASS, origin="PAUSE", fidelity="MEMORY")
    paused = value("warmboot_actor_releases_total", reason="PAUSED")
    await create(nc, prefix, "a-1")
    await placer.place("a-1", "w-1", "node-1", PIN_V1)
    await pause(nc, prefix, "a-1")
    assert value("warmboot_snapshots_taken_total", sandbox_class=CLASS, origin="PAUSE",
                 fidelity="MEMORY") == pauses + 1
    assert value("warmboot_actor_releases_total", reason="PAUSED") == paused + 1


async def test_many_actors_tagging_one_tag_at_once_are_all_answered_each_version_once(snapshotter, placer, nc, prefix):
    """Tags of one tag name are decided one at a time in a replica (its own lock, beside the
    actor's): on the service's loop, racing on the tag's next version, most of 24 at once lost
    eight races and were UNAVAILABLE; and two appends of one history must never be in flight
    together in the grouped appends (events.jetstream.grouped). Each answer says what the tag named
    before it (`tagged_before`): the TagRecorded before its own in stream order, whatever the race."""
    actors = [f"t-{i}" for i in range(24)]
    for actor_id in actors:
        await create(nc, prefix, actor_id)
        await placer.place(actor_id, "w-x", "node-1", PIN_V1)
        await suspend(nc, prefix, actor_id, uri=f"s3://x/{actor_id}")
    ids = {actor_id: f"tag-{actor_id}" for actor_id in actors}
    replies = await asyncio.gather(*(tag(nc, prefix, a, "gold", request_id=ids[a]) for a in actors))
    recorded = [(seq, e) for seq, _, e in await read_entries(nc, prefix) if isinstance(e, TagRecorded)]
    assert len(recorded) == len(actors)  # one version each, none twice
    assert sorted(e.snapshot.snapshot_id for _, e in recorded) == sorted(r.snapshot.snapshot_id for r in replies)
    in_order = [e.snapshot for _, e in recorded]
    for reply in replies:
        at = in_order.index(reply.snapshot)
        assert reply.tagged_before == TaggedBefore(snapshot=in_order[at - 1] if at else None), (at, reply)
    again = await tag(nc, prefix, actors[0], "gold", request_id=ids[actors[0]])  # a repeat: the first answer
    assert again == replies[0]


async def test_a_removal_releases_an_actor_whose_read_comes_from_a_replica_behind_its_placement(
        snapshotter, registry, nats_server, nc, prefix, monkeypatch):
    """The worker-removal process learns the placement from the stream (through its leader) and
    reads the actor by direct gets, which a replica of the stream behind that placement may
    answer. That read made the placement look ended, so the release was skipped and the position
    tracked as done: the actor stayed RUNNING on a removed worker. A single server has no replica
    to lag; the lagging replica is played by the process's direct reads, cut before the placement
    (its reads through the leader are left alone), and the placement is written on a connection
    of its own, as by the scheduler's process. It now asks the leader, and releases."""
    async with another_process(WireApplication, env_for(nats_server.url, prefix)) as elsewhere:
        placed = await placed_then_removed_pending_release(snapshotter, nc, prefix, Placer(elsewhere))
    stream = snapshotter.process.recorder.stream
    read = stream.read
    left_out: list[int] = []

    async def behind(subject: str, start: int, *args, **kwargs):
        msgs = await read(subject, start, *args, **kwargs)
        kept = [m for m in msgs if not (subject.endswith(".actor.a-1") and sequence_of(m) >= placed)]
        left_out.append(len(msgs) - len(kept))
        return kept

    monkeypatch.setattr(stream, "read", behind)
    await call(nc, service_subject(prefix, "registry", "remove", "w-1"), RemoveWorker(), SeqReply)
    ((_, release),) = await released_by_removal(nc, prefix, count=1)
    assert release.actor_id == "a-1" and release.worker_id == "w-1"
    assert any(left_out)  # the replica's answer did lack the placement


async def test_a_worker_removed_with_more_actors_than_an_atomic_append_holds_releases_them_all(stack, nc, prefix):
    """The releases of a removed worker's actors, with the position's tracking record, are more
    messages than one atomic append holds (MAX_BATCH_MESSAGES): they go in parts, and every actor
    is released once. They were one append, refused for good, and retried for ever: no actor of
    that worker released, and no removal after it (an audit, 2026-12-04)."""
    from events.jetstream import MAX_BATCH_MESSAGES
    from tests.factories import created, placed, publish_events

    actors = MAX_BATCH_MESSAGES  # with the tracking record, one message over
    from warmboot.client import Client

    wb = Client(nc, prefix)
    await wb.register(worker("big", V1, cpu=10_000_000, mem=10_000_000))
    await wb.register(worker("small", V1))
    loaded = []
    for i in range(actors):
        loaded += [created(f"a{i}", cpu=1, mem=1), placed(f"a{i}", "big", V1, cpu=1, mem=1)]
    loaded += [created("b", cpu=1, mem=1), placed("b", "small", V1, cpu=1, mem=1)]
    await publish_events(nc, prefix, loaded, {})
    await wb.remove("big", reason="decommissioned")
    await wb.remove("small", reason="decommissioned")  # a removal after it is handled too
    released = await released_by_removal(nc, prefix, actors + 1)
    assert sorted(e.actor_id for _, e in released) == sorted([f"a{i}" for i in range(actors)] + ["b"])


def test_release_parts_fit_an_atomic_append_with_the_tracking_record():
    from services.snapshotter.service import release_parts

    class Pending:
        pending_events = [object()]

    ones = [Pending() for _ in range(7)]
    assert [len(p) for p in release_parts(ones, 3)] == [3, 3, 1]
    assert [len(p) for p in release_parts(ones, 7)] == [7]
    assert release_parts([], 3) == [[]]  # nothing to release: the tracking record alone


async def test_a_pause_read_behind_a_new_life_of_its_worker_is_stamped_with_the_new_pin(
        snapshotter, registry, placer, nats_server, nc, prefix, monkeypatch):
    """A guard from an audit that found it safe: a-1 placed on w-1 under V1; w-1 removed (a-1 released), registered again
    on node-2 with V2 only, a-1 placed there under V2 by another process. A second replica whose reads
    lag behind all of it (it sees a-1 RUNNING on w-1@node-1 under V1, w-1 alive) is asked to pause,
    then the client retries the same request id at the first replica: one pause, stamped V2 on node-2."""
    await placed_then_removed_pending_release(snapshotter, nc, prefix, placer)
    stale_from = await last_seq(nc, prefix) + 1
    async with another_replica(snapshotter, nats_server.url, prefix, follow=False) as lagging:
        # the lagging replica reads a-1 and w-1 once, while they are current (its cache, its last_seen)
        await lagging.load_actor("a-1")
        await lagging.app.recorder.select_events_async("worker.w-1")
        await call(nc, service_subject(prefix, "registry", "remove", "w-1"), RemoveWorker(), SeqReply)
        await released_by_removal(nc, prefix, count=1)
        await register(nc, prefix, registration("w-1", "node-2", V2))
        await placer.place("a-1", "w-1", "node-2", PIN_V2)
        reads_before(monkeypatch, lagging, stale_from)
        stream = lagging.app.recorder.stream
        last_direct = stream.last_direct

        async def behind(asked, *args, **kwargs):
            msg = await last_direct(asked, *args, **kwargs)
            return None if msg is not None and sequence_of(msg) >= stale_from else msg

        monkeypatch.setattr(stream, "last_direct", behind)
        first = await lagging.pause("a-1", PauseActor(request_id="R"))
        again = await pause(nc, prefix, "a-1", request_id="R")
    assert first.snapshot == again.snapshot
    assert first.snapshot.sandbox_runtime == PIN_V2 and first.snapshot.node == "node-2", first.snapshot
    taken = [e for _, _, e in await read_entries(nc, prefix) if isinstance(e, SnapshotTaken)]
    assert len(taken) == 1
