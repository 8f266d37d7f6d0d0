"""A single server that crashes and loses the tail of its log it had not synced, then stores other
messages at those sequences: no scheduler replica places on what it folded of the lost tail, and
the registry answers no heartbeat from it (docs/operations.md, Backup and restore: a rolled-back
log). Judged by tests/test_commit_races.py's checker and `warmboot audit verify`, from the log in
stream order."""

from __future__ import annotations

import asyncio
import struct
import time
import uuid
from contextlib import AsyncExitStack, asynccontextmanager

import msgspec
import nats
import nats.errors
import pytest

from events.errors import ContractError
from events.schema import (Assignment, ErrorCode, Heartbeat, HeartbeatReply, PlacedFidelity, RegisterOutcome,
                           ResumeActor, RuntimeChanged, WorkerRegistered)
from events.subjects import stream_name
from services.scheduler.service import SchedulerService
from services.snapshotter.service import SnapshotterService
from tests.factories import SILENT_TTL_S, actor, golden, last_seq, read_messages, runtime, version, worker
from tests.registry_helpers import PROBE, agent_config, wait_event
from tests.test_agent import agent_running
from tests.test_commit_races import verdict
from warmboot.agent import Agent
from warmboot.audit import Sink
from warmboot.cli_common import replay
from warmboot.client import Client
from warmboot.natsserver import NatsServer
from warmboot.runner import start_services

V1, V2 = version("1"), version("2")
HEADERS_BIT, ERASED_BIT = 1 << 31, 1 << 63  # nats-server's file store: flags in a record's length and sequence


def roll_back(server: NatsServer, stream: str, keep: int) -> None:
    """Cut every message after sequence `keep` off the blocks of `stream` (its server stopped), and drop
    the stream's index, as a machine's crash before they were synced would. A block is a run of records:
    length (4 bytes), sequence (8), time, subject, headers, body, checksum."""
    msgs = next((server.data_path / "jetstream").glob(f"*/streams/{stream}/msgs"))
    for block in sorted(msgs.glob("*.blk"), key=lambda p: int(p.stem)):
        data, at = block.read_bytes(), 0
        while at + 12 <= len(data):
            length, seq = struct.unpack_from("<IQ", data, at)
            if seq & ~ERASED_BIT > keep:
                with open(block, "r+b") as handle:
                    handle.truncate(at)
                break
            at += length & ~HEADERS_BIT
    (msgs / "index.db").unlink(missing_ok=True)


async def crash_losing_the_tail(server: NatsServer, prefix: str, keep: int) -> None:
    """The server crashes, loses every message of the log after sequence `keep` (`roll_back`), and
    starts again."""
    server.kill()
    roll_back(server, stream_name(prefix), keep)
    server.spawn()
    await asyncio.to_thread(server.wait_ready)


@asynccontextmanager
async def serving(tmp_path, names: tuple[str, ...] = ("registry", "snapshotter", "scheduler")):
    """A server of its own with `names` running on it (workers silent for long: no removal meanwhile),
    and a client that retries through the crash: (the server, the prefix, the exit stack, the services,
    the client's connection, the client)."""
    prefix = "t" + uuid.uuid4().hex[:10]
    server = NatsServer(tmp_path)
    server.start()
    try:
        async with AsyncExitStack() as exits:
            running = await start_services(exits, list(names), server.url, prefix,
                                           options={"registry": {"ttl_s": SILENT_TTL_S},
                                                    "scheduler": {"metrics": False}})
            nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
            exits.push_async_callback(nc.close)
            yield server, prefix, exits, running, nc, Client(nc, prefix, attempts=40)
    finally:
        server.stop()


async def fresh_replica(exits: AsyncExitStack, server: NatsServer, prefix: str) -> SchedulerService:
    """A scheduler replica started on the log as it is now."""
    fresh_nc = await nats.connect(server.url)
    exits.push_async_callback(fresh_nc.close)
    fresh = await SchedulerService(fresh_nc, nats_url=server.url, prefix=prefix, metrics=False).start()
    exits.push_async_callback(fresh.stop)
    return fresh


async def placed_by(replica: SchedulerService, actor_id: str, request: ResumeActor) -> Assignment:
    """`request` placed by `replica` itself (not the queue group's choice), sent again while its
    store's connection is being made again after the crash (UNAVAILABLE)."""
    for _ in range(100):
        try:
            return await replica.resume(actor_id, request)
        except ContractError as error:
            assert error.code is ErrorCode.UNAVAILABLE, error
            await asyncio.sleep(0.05)  # a client's back-off between retries, not synchronisation
    raise AssertionError(f"{actor_id} not placed by the replica in 100 attempts")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["first-append-after", "appended-before-the-crash", "the-check-unanswered"])
async def test_a_replica_does_not_place_on_a_lost_tail_whose_sequences_hold_other_messages(tmp_path, monkeypatch,
                                                                                          case):
    """Judged on the committer's check (`Committer._confirm_log`): the fold is held paused from before
    the crash to the resume's answer, as a checkpoint holds it, so that its own check at its consumer's
    re-creation (1 to 2 s after the crash) cannot come first and hide a missing one (it did, about one
    run in four). Also when the replica placed an actor before the crash: it confirmed the log in the
    session before the crash, and a session with the server started again is another, checked again.
    And when the check cannot be made (the read of the message at the fold's position times out): what
    the replica decided is not appended unchecked; the resume is UNAVAILABLE (retry)."""
    async with serving(tmp_path) as (server, prefix, exits, running, nc, wb):
        scheduler = running.services[-1]
        await wb.register(worker("w0", runtime(V2)))
        await wb.create(actor("a", golden_snapshot=golden(V1)))  # a memory image of V1
        if case == "appended-before-the-crash":  # the replica's committer appends, in the session before the crash
            await wb.create(actor("c"))
            await wb.resume("c", request_id="rc")
        kept = await last_seq(nc, prefix)
        # acknowledged and folded, then lost: w0 restores V1 (its RuntimeChanged and fence)
        changed = await wb.register(worker("w0", runtime(V2), (runtime(V1),)))
        assert (await wb.explain("a", min_seq=changed.seq)).decision.fidelity is PlacedFidelity.MEMORY
        async with scheduler.fold.paused():
            await crash_losing_the_tail(server, prefix, kept)
            # the log goes on from where it was cut: w0 relabelled, still V2 alone, its fence where the
            # lost one was
            wb.seq = 0
            relabelled = await wb.register(worker("w0", runtime(V2), labels={"rack": "r1"}))
            assert relabelled.seq == changed.seq
            if case == "the-check-unanswered":
                async def unanswered() -> str | None:
                    raise nats.errors.TimeoutError  # the stream's leader did not answer the read in time

                monkeypatch.setattr(scheduler.fold, "continuity", unanswered)
            try:  # one attempt, at the one replica, which folded the lost tail
                got = await Client(nc, prefix, attempts=1).resume("a", request_id="r1")
            except ContractError as error:
                got = error
            if case == "the-check-unanswered":
                assert isinstance(got, ContractError) and got.code is ErrorCode.UNAVAILABLE, got
                monkeypatch.undo()
        bad, _ = verdict(await read_messages(nc, prefix))
        assert not bad, f"answered {got}; " + "\n".join(bad)
        sink = await replay(nc, prefix, Sink(verify=True), False)
        assert sink.violation is None, str(sink.violation)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("placed, request_id", [("b", "rb"), ("b", "r1"), ("a", None)],
                         ids=["another-actor", "another-actor-the-same-id", "the-same-actor-no-id"])
async def test_a_retried_request_id_is_not_answered_from_a_lost_tail(tmp_path, placed, request_id):
    """The placement a request id got is lost with the tail; another replica, started on the log as it
    is now, places another actor at the same sequences; the request id retried at the replica that folded
    the lost tail is not answered with what the log holds there (another actor's assignment). Also when
    b's placement carries the very request id a's did: request ids are the caller's, scoped to an actor
    (a client that numbers each actor's requests alike sends r1 for both), so only the actor the
    placement names tells them apart. And when the placement there is a's own, made without a request
    id: not the request's either, UNAVAILABLE as the others (it was an internal error). The stale
    replica's fold is held paused from before the crash to the retry's answer (as a checkpoint holds
    it), so that its own check at its consumer's re-creation cannot come first: the answer judged is
    the one from the log."""
    async with serving(tmp_path) as (server, prefix, exits, running, nc, wb):
        stale = running.services[-1]
        await wb.register(worker("w0", runtime(V2)))
        await wb.create(actor("a"))
        await wb.create(actor("b"))
        kept = await last_seq(nc, prefix)
        first = await wb.resume("a", request_id="r1")  # acknowledged, folded, then lost
        async with stale.fold.paused():
            await crash_losing_the_tail(server, prefix, kept)
            # a replica started on the log as it is now places first: at the lost placement's sequences
            fresh = await fresh_replica(exits, server, prefix)
            other = await placed_by(fresh, placed, ResumeActor(request_id=request_id))
            assert (other.actor_id, other.seq) == (placed, first.seq)  # placed where a's r1 was
            try:  # the retry, at the replica that folded the lost tail
                got = await stale.resume("a", ResumeActor(request_id="r1"))
            except ContractError as error:
                got = error
        assert isinstance(got, ContractError) and got.code is ErrorCode.UNAVAILABLE, got


async def snapshotter(exits: AsyncExitStack, server: NatsServer, prefix: str) -> SnapshotterService:
    """A snapshotter replica of its own connection, started on the log as it is now."""
    own_nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    exits.push_async_callback(own_nc.close)
    service = await SnapshotterService(own_nc, nats_url=server.url, prefix=prefix).start()
    exits.push_async_callback(service.stop)
    return service


@pytest.mark.timeout(120)
@pytest.mark.parametrize("moved", ["another-worker", "another-pin"])
async def test_a_pause_of_an_image_taken_under_a_lost_placement_is_refused_not_stamped_with_the_one_stored_there(
        tmp_path, moved):
    """The audit's experiment (docs/operations.md): a resume placed a on w1 under V2, acknowledged, then
    lost with the tail; a replica started on the log as it is now places a again at the same sequences:
    on w0 under V1, or on w1 under V1 (its change to V2 lost with the tail too, and written again as a
    relabelling of V1 before its agent registers V2 again). The client that resumed a first then pauses
    the image w1 took under V2. Named by its sequence alone, that image was recorded as V1's, on the
    node of the placement stored there, where a resume would send it to a worker that cannot load it.
    The client names its Assignment's worker and pin too: refused, FAILED_PRECONDITION on the field
    that differs, nothing recorded; the placement the log holds is then paused by a client that names
    it, stamped with its own pin. Each snapshotter serves the log it started on (one that read the lost
    tail stops at its watch's next look, docs/operations.md)."""
    async with serving(tmp_path, ("registry", "scheduler")) as (server, prefix, exits, running, nc, wb):
        stale = running.services[-1]
        async with AsyncExitStack() as before:
            await snapshotter(before, server, prefix)
            if moved == "another-worker":
                await wb.register(worker("w0", runtime(V1), labels={"rack": "r0"}))
                await wb.register(worker("w1", runtime(V2), labels={"rack": "r1"}))
            else:
                await wb.register(worker("w1", runtime(V1), labels={"rack": "r1"}))
            await wb.create(actor("a"))
            kept = await last_seq(nc, prefix)
            if moved == "another-pin":  # acknowledged, then lost
                changed = await wb.register(worker("w1", runtime(V2), labels={"rack": "r1"}))
            first = await wb.resume("a", selectors={"rack": "r1"})  # acknowledged, then lost
        assert (first.worker_id, first.sandbox_runtime.version) == ("w1", V2)
        async with stale.fold.paused():  # (the stale replica places nothing meanwhile)
            await crash_losing_the_tail(server, prefix, kept)
            wb.seq = 0
            if moved == "another-pin":
                relabelled = await wb.register(worker("w1", runtime(V1), labels={"rack": "r1", "row": "2"}))
                assert relabelled.seq == changed.seq
            fresh = await fresh_replica(exits, server, prefix)
            other = await placed_by(fresh, "a", ResumeActor(selectors={"rack": "r0" if moved == "another-worker"
                                                                      else "r1"}))
            assert other.seq == first.seq, (other, first)  # stored where the lost placement was
            assert (other.worker_id, other.sandbox_runtime.version) == (
                "w0" if moved == "another-worker" else "w1", V1), other
            await snapshotter(exits, server, prefix)
            before_pause = await last_seq(nc, prefix)
            field = "placement_worker_id" if moved == "another-worker" else "placement_runtime"
            # the image w1 took under V2, named by the client's Assignment: left out, or given as its seq
            for pause in (lambda: wb.pause("a"), lambda: wb.pause("a", placement_seq=first.seq)):
                with pytest.raises(ContractError) as refused:
                    await pause()
                assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, field), \
                    refused.value
            assert await last_seq(nc, prefix) == before_pause  # nothing recorded
            paused = await Client(nc, prefix).pause("a", placement_seq=other.seq)  # the placement the log holds
            assert paused.snapshot.sandbox_runtime.version == V1
        sink = await replay(nc, prefix, Sink(verify=True), False)
        assert sink.violation is None, str(sink.violation)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("look", ["answered", "unanswered"])
async def test_a_beat_naming_a_registration_lost_with_the_tail_is_refused_and_its_agent_registers_again(
        tmp_path, monkeypatch, look):
    """w0 registered V1, then V2 alone (acknowledged: its agent has that revision in force); the tail
    holding the second is lost, and the log says w0 runs V1. A beat naming the lost revision is refused
    (FAILED_PRECONDITION, field revision: register again) by the registry whose roster folded it, from
    the worker's history, before the watch's next look; the registration that follows puts V2 alone back
    in the log, and a replica started on it places a's V1 memory image nowhere on w0. The roster answered
    such beats until the watch's look stopped the registry, up to 5 s later, and an agent that registers
    again only when a beat is refused left the log saying V1 until its registry was started again.
    So too while the registry cannot look whether the log is still the one it folded (`unanswered`: each
    look at the stream times out): a roster not confirmed in the session answers no beat."""
    async with serving(tmp_path, ("registry", "snapshotter")) as (server, prefix, exits, running, nc, wb):
        registry = running.services[0]
        r1 = int(time.time() * 1000)
        await wb.register(msgspec.structs.replace(worker("w0", runtime(V1)), revision=r1))
        await wb.create(actor("a", golden_snapshot=golden(V1)))  # a memory image of V1
        kept = await last_seq(nc, prefix)
        await wb.register(msgspec.structs.replace(worker("w0", runtime(V2)), revision=r1 + 1))  # then lost
        if look == "unanswered":
            async def unanswered() -> str | None:
                raise nats.errors.TimeoutError  # the stream's leader did not answer the look in time

            monkeypatch.setattr(registry.watch, "look", unanswered)
        await crash_losing_the_tail(server, prefix, kept)
        with pytest.raises(ContractError) as refused:
            await wb.request("registry", "heartbeat", "w0", Heartbeat(revision=r1 + 1), HeartbeatReply)
        assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "revision"), \
            refused.value
        monkeypatch.undo()
        # what its agent does then: registers this machine again, above
        again = await wb.register(msgspec.structs.replace(worker("w0", runtime(V2)), revision=r1 + 2))
        assert again.outcome is RegisterOutcome.RUNTIME_CHANGED
        await wb.request("registry", "heartbeat", "w0", Heartbeat(revision=r1 + 2), HeartbeatReply)
        fresh = await fresh_replica(exits, server, prefix)
        placed = await fresh.resume("a", ResumeActor(request_id="ra", min_seq=again.seq))
        assert placed.fidelity is not PlacedFidelity.MEMORY, placed
        bad, _ = verdict(await read_messages(nc, prefix))
        assert not bad, "\n".join(bad)


@pytest.mark.timeout(120)
async def test_the_agent_registers_again_at_its_reconnection_what_the_lost_tail_held(tmp_path):
    """warmboot's agent registered V1, then V2 alone (its answer had: the agent has it in force); the
    tail holding the second is lost with the server's crash, and the log says w0 runs V1. At its
    reconnection the agent sends its registration in force again, with the revision it had, which the
    registry decides on the worker's history as the log holds it: V2 alone is in the log again (the
    registration a refused beat would have the agent make goes above that revision)."""
    prefix = "t" + uuid.uuid4().hex[:10]
    server = NatsServer(tmp_path)
    server.start()
    try:
        async with AsyncExitStack() as exits:
            await start_services(exits, ["registry"], server.url, prefix, options={"registry": {"ttl_s": 6.0}})
            nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
            exits.push_async_callback(nc.close)
            path = tmp_path / "agent.toml"
            path.write_text(agent_config("v1"))
            agent = Agent(server.url, "w0", "node-w0", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
            changed, request = asyncio.Event(), agent._request

            async def noting(verb, *args, **kwargs):
                reply = await request(verb, *args, **kwargs)
                if verb == "register" and reply.outcome is RegisterOutcome.RUNTIME_CHANGED:
                    changed.set()
                return reply

            agent._request = noting
            async with agent_running(agent):
                await wait_event(nc, prefix, "w0", WorkerRegistered)
                kept = await last_seq(nc, prefix)
                path.write_text(agent_config("v2"))
                _, lost = await wait_event(nc, prefix, "w0", RuntimeChanged, after=kept)
                await asyncio.wait_for(changed.wait(), 20)  # answered: the agent has it in force
                await crash_losing_the_tail(server, prefix, kept)
                _, again = await wait_event(nc, prefix, "w0", RuntimeChanged, after=kept)
                assert (again.sandbox_classes, again.revision) == (lost.sandbox_classes, lost.revision), again
    finally:
        server.stop()
