"""A scheduler replica whose event stream is deleted and made again while it runs.

The event store makes a deleted stream again; its sequences start over, and a replica
that outlived the deletion holds a projection of a log that is gone. Its checkpoints
must not pass for the new stream's (they are labelled with the incarnation the
projection is a fold of, and a save for a stream made again is refused), and the
replica itself stops rather than fold the new stream from its old position. On a real
nats-server; every wait is on a log line, a future or a process's end, never a sleep.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from pathlib import Path

import pytest

from events.errors import ContractError
from events.schema import Assignment, ErrorCode, Fidelity, ResumeActor, WorkerFenced
from events.subjects import service_subject, stream_name
from services.endpoints import call
from services.scheduler.checkpoint import Checkpoints, incarnation_of
from services.scheduler.decide import decide
from services.scheduler.fold import Fold
from services.scheduler.projection import Projection
from tests.factories import AT, Writer, created, entry, logged, registered, snapshot, taken, version

V1, V2 = version("1"), version("2")
STOPS_WITHIN_S = 20.0  # nats-py re-makes the consumer of a deleted stream within about 2 s
STOPPING = ": stopping; start the replica again to fold the new stream"


def fence(worker_id: str) -> WorkerFenced:
    return WorkerFenced(at=AT, worker_id=worker_id, event="WorkerRegistered")


# The old stream: w1 restores V2 snapshots, and a1 waits with a V2 snapshot (a MEMORY restore on w1).
OLD = (registered("w1", entry(V1, (V2,))), fence("w1"), created("a1"), taken(snapshot("a1", V2)))
# The same bootstrap written again into the new stream, but w1 runs V1 only now: it cannot load a1's
# image, and two more actors (sequences past the old stream's end).
NEW = (registered("w1", entry(V1)), fence("w1"), created("a1"), taken(snapshot("a1", V2)), created("b1"),
       created("b2"))


async def write(nats_url: str, prefix: str, events: tuple) -> int:
    writer = await asyncio.to_thread(Writer, nats_url, prefix)  # makes the stream if it is not there
    try:
        return await asyncio.to_thread(writer.write, *events)
    finally:
        await asyncio.to_thread(writer.close)


async def created_at(nc, prefix: str) -> str:
    return (await nc.jetstream().stream_info(stream_name(prefix))).created.isoformat()


async def made_again(nc, nats_url: str, prefix: str) -> tuple[str, str]:
    """Delete the stream and write the bootstrap again (NEW): (old, new) creation times."""
    old = await created_at(nc, prefix)
    await nc.jetstream().delete_stream(stream_name(prefix))
    await write(nats_url, prefix, NEW)
    new = await created_at(nc, prefix)
    assert new != old
    return old, new


async def replay(nc, prefix: str) -> Projection:
    fold = Fold(nc, prefix, Projection())
    await fold.start(30)
    await fold.stop()
    return fold.projection


def replaced(prefix: str, new: str, old: str) -> str:
    return f"the event stream {stream_name(prefix)} was made again (created {new}; this process read the one created {old})"


async def test_a_replica_that_outlived_its_stream_leaves_no_checkpoint_a_new_replica_would_load(
        nc, nats_url, prefix, replicas):
    """The review's reproduction: the old replica's save (what its time trigger does) after the
    stream was made again used to label its old projection with the new stream's creation time,
    and a replica started afterwards loaded it and committed a MEMORY restore of a1 on w1, which
    the new log registers without V2."""
    last = await write(nats_url, prefix, OLD)
    first = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0)
    assert first.projection.seq == last
    old, new = await made_again(nc, nats_url, prefix)

    saved = await first.checkpoints.save(first.projection)  # what its time trigger does
    await first.stop()  # as the process that runs it does once it fails (the save told it: see below)

    full = await replay(nc, prefix)
    expected = decide(full, "a1", None, full.seq)
    assert expected.fidelity is not Fidelity.MEMORY
    second = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0)
    assigned = await call(nc, service_subject(prefix, "scheduler", "resume", "a1"), ResumeActor(), Assignment,
                          timeout=10)
    assert (assigned.worker_id, assigned.fidelity) == ("w1", expected.fidelity), "a MEMORY restore w1 cannot load"
    assert second.checkpoints.restored_seq == 0 and second.projection.stream_created == new
    now = incarnation_of(new)
    assert saved is None and not [name for _, written_for, name in await first.checkpoints.list()
                                  if written_for == now], "a checkpoint of the old log labelled with the new stream"
    assert first.failed.done() and first.failed.result() == replaced(prefix, new, old)


async def test_a_running_replica_stops_when_its_stream_is_made_again(nc, nats_url, prefix, replicas, caplog):
    """No checkpoint at all (none is saved): nats-py re-makes the fold's consumer of the deleted stream,
    on the new one, from the old position; the fold holds what it delivers, sees another incarnation
    and gives up, having folded none of it, and the replica answers nothing more."""
    last = await write(nats_url, prefix, OLD)
    first = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0)
    caplog.set_level(logging.ERROR, logger="warmboot.scheduler")
    with logged("warmboot.scheduler", STOPPING) as stopping:
        old, new = await made_again(nc, nats_url, prefix)
        await asyncio.wait_for(stopping.wait(), STOPS_WITHIN_S)

    why = replaced(prefix, new, old)
    assert [r.getMessage() for r in caplog.records if STOPPING in r.getMessage()] == [why + STOPPING]
    assert first.failed.done() and first.failed.result() == why
    # nothing of the new stream was folded into the old projection
    assert first.projection.seq == last and set(first.projection.actors) == {"a1"}
    assert first.projection.workers["w1"].classes["gvisor"].restorable, "w1 as the old stream registered it"
    with pytest.raises(ContractError) as refused:
        await call(nc, service_subject(prefix, "scheduler", "resume", "a1"), ResumeActor(), Assignment, timeout=10)
    assert refused.value.code is ErrorCode.UNAVAILABLE and why in refused.value.message


async def test_a_save_for_a_stream_made_again_is_refused(nc, nats_url, prefix, replicas, caplog):
    """Nothing saved and nothing deleted: the new stream's own checkpoint, stored by a replica of
    it, stays as it is."""
    await write(nats_url, prefix, OLD)
    first = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0)
    old, new = await made_again(nc, nats_url, prefix)
    second = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0)
    genuine = await second.checkpoints.save(second.projection)
    assert genuine is not None and incarnation_of(new) in genuine
    stored = await second.checkpoints.list()

    caplog.set_level(logging.ERROR, logger="warmboot.scheduler.checkpoint")
    assert await first.checkpoints.save(first.projection) is None
    assert await second.checkpoints.list() == stored
    assert f"checkpoint not saved: {replaced(prefix, new, old)}" in [r.getMessage() for r in caplog.records]
    assert first.failed.done() and not second.failed.done()

    # a projection that does not say which stream it is a fold of is not saved either
    caplog.clear()
    unlabelled = await (await Checkpoints(nc, prefix).open()).save(Projection())
    assert unlabelled is None and await second.checkpoints.list() == stored
    assert "does not say which incarnation" in caplog.text


async def test_serve_ends_with_a_failure_status_when_its_stream_is_made_again(nc, nats_url, prefix):
    """As deployed: `warmboot serve scheduler` logs the one line and exits with status 1."""
    from tests.secured_helpers import Serve

    await write(nats_url, prefix, OLD)
    # this checkout's code, wherever the installed `warmboot` points (a git worktree shares the venv)
    here = str(Path(__file__).resolve().parents[1])
    serve = Serve("scheduler", "--nats", nats_url, "--prefix", prefix,
                  env={"PYTHONPATH": os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))})
    await asyncio.to_thread(serve.start)
    try:
        old, new = await made_again(nc, nats_url, prefix)
        line = await asyncio.to_thread(serve.line, STOPPING, STOPS_WITHIN_S, True)
        assert re.search(r" ERROR warmboot\.scheduler: " + re.escape(replaced(prefix, new, old) + STOPPING) + "$",
                         line), line
        ended = await asyncio.to_thread(serve.process.wait, 30)
    finally:
        code = await asyncio.to_thread(serve.stop)
    assert ended == code == 1, serve.output
    assert sum(STOPPING in text for text in serve.lines) == 1, serve.output  # one line says why
    assert "stopping" in serve.lines[serve.lines.index(line):], serve.output  # then it stopped its services


async def test_a_registry_and_a_snapshotter_stop_when_their_stream_is_made_again(nc, nats_url, prefix):
    """Their roster, placements and worker-removal position are of the old log: each fails with
    the reason (and `warmboot serve` stops them, status 1, as for the scheduler above)."""
    from services.registry.service import RegistryService
    from services.snapshotter.service import SnapshotterService

    await write(nats_url, prefix, OLD)
    registry = RegistryService(nc, nats_url=nats_url, prefix=prefix)
    snapshotter = SnapshotterService(nc, nats_url=nats_url, prefix=prefix)
    for service in (registry, snapshotter):
        service.watch.every = 0.1  # its look at the stream, every 5 s in service
        await service.start()
    try:
        old, new = await made_again(nc, nats_url, prefix)
        for service in (registry, snapshotter):
            assert await asyncio.wait_for(service.failed, 30) == replaced(prefix, new, old)
    finally:
        for service in (snapshotter, registry):
            await service.stop()


async def test_replicas_stop_when_their_stream_is_restored_from_a_copy_of_the_store(tmp_path, prefix):
    """The store directory copied while the server was stopped (docs/operations.md, Backup and
    restore), and put back under running replicas: the stream keeps its creation time, but its
    messages after the copy are gone and new ones take their sequences (a review: the scheduler
    folded on from its old position and committed a MEMORY restore w1 cannot load). The message
    at the position each replica read is another now, or none: the scheduler's fold (at its
    consumer's re-creation) and the registry's watch stop their replica."""
    import shutil

    import nats

    from services.registry.service import RegistryService
    from services.scheduler.service import SchedulerService
    from warmboot.natsserver import NatsServer

    store = tmp_path / "nats"
    server = NatsServer(store).start()
    url = server.url
    connections = []
    try:
        await write(url, prefix, OLD[:2])  # w1 registered (V1 alone), its fence: the copy is of this
        server.stop()
        shutil.copytree(store, tmp_path / "copy")
        server.start()
        await write(url, prefix, (registered("w1", entry(V1, (V2,))), fence("w1"), *OLD[2:]))  # a1's V2 image
        for _ in range(2):
            connections.append(await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2))
        scheduler = SchedulerService(connections[0], nats_url=url, prefix=prefix, metrics=False)
        registry = RegistryService(connections[1], nats_url=url, prefix=prefix)
        registry.watch.every = 0.1  # its look at the stream, every 5 s in service
        await scheduler.start()
        await registry.start()
        created = scheduler.projection.stream_created
        server.stop()
        shutil.rmtree(store)
        shutil.copytree(tmp_path / "copy", store)
        server.start()
        await write(url, prefix, NEW)  # the restored log goes on: its own messages at the old sequences
        nc = connections[0]
        assert (await nc.jetstream().stream_info(stream_name(prefix))).created.isoformat() == created
        for service in (scheduler, registry):
            why = await asyncio.wait_for(service.failed, 30)
            assert why.startswith(f"the event stream {stream_name(prefix)} ") and why.endswith("restored or rolled back")
        with pytest.raises(ContractError) as refused:  # what the scheduler's clients get from now on
            await call(nc, service_subject(prefix, "scheduler", "resume", "a1"), ResumeActor(), Assignment, timeout=10)
        assert refused.value.code is ErrorCode.UNAVAILABLE
        await registry.stop()
        await scheduler.stop()
    finally:
        for connection in connections:
            await connection.close()
        server.stop()


async def test_a_message_an_operator_deleted_is_a_hole_not_another_log(nc, nats_url, prefix, replicas):
    """docs/contract.md lets an operator delete an event no version can read. The stream still
    ends where it did: no replica takes the missing message for a restored log."""
    from services.registry.service import RegistryService

    last = await write(nats_url, prefix, OLD)
    registry = RegistryService(nc, nats_url=nats_url, prefix=prefix)
    registry.watch.every = 3600  # looked at by the test alone
    await registry.start()
    scheduler = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0)
    try:
        assert await registry.watch.look() is None and registry.watch.mark[0] == last
        assert scheduler.projection.seq == last
        await nc.jetstream().delete_msg(stream_name(prefix), last)  # `nats stream rmm`
        assert await registry.watch.look() is None
        assert await scheduler.checkpoints.save(scheduler.projection) is not None and not scheduler.failed.done()
    finally:
        await registry.stop()


async def test_a_checkpoint_whose_message_cannot_be_asked_is_ignored_not_a_failed_start(
        nc, nats_url, prefix, replicas, monkeypatch):
    import nats.js.manager

    await write(nats_url, prefix, OLD)
    first = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0)
    assert await first.checkpoints.save(first.projection) is not None
    await first.stop()
    real = nats.js.manager.JetStreamManager.get_msg

    async def failing(self, stream, *args, **kwargs):
        if stream == stream_name(prefix):
            raise RuntimeError("the server said something else")
        return await real(self, stream, *args, **kwargs)

    monkeypatch.setattr(nats.js.manager.JetStreamManager, "get_msg", failing)
    second = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0)
    assert second.checkpoints.restored_seq == 0 and second.projection.seq == first.projection.seq  # replayed


async def test_the_registry_tells_a_copy_put_back_between_two_looks_by_what_its_roster_read(tmp_path, prefix):
    """A copy taken before the watch's last look still holds that look's mark; what the roster folded
    after it is not in the copy. The watch checks the roster's own mark too."""
    import shutil

    import nats

    from services.registry.service import RegistryService
    from services.streams import until_answered
    from warmboot.natsserver import NatsServer

    store = tmp_path / "nats"
    server = NatsServer(store).start()
    url = server.url
    await write(url, prefix, OLD[:2])
    server.stop()
    shutil.copytree(store, tmp_path / "copy")
    server.start()
    nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    registry = RegistryService(nc, nats_url=url, prefix=prefix)
    registry.watch.every = 3600  # looked at by the test alone
    try:
        await registry.start()
        assert await registry.watch.look() is None and registry.watch.mark[0] == 2
        await write(url, prefix, (registered("w1", entry(V1, (V2,))), fence("w1")))  # 3, 4: not in the copy
        await registry.fold.current()
        assert registry.fold.mark[0] == 3  # the registration (its fence is on another subject)
        server.stop()
        shutil.rmtree(store)
        shutil.copytree(tmp_path / "copy", store)
        server.start()
        why = await until_answered(registry.watch.look, "the stream")
        assert why is not None and why.endswith("restored or rolled back"), why
    finally:
        await registry.stop()
        await nc.close()
        server.stop()


# --- the answers kept in the reply bucket, which outlives the stream ---------------------------------------------


async def test_an_answer_kept_on_a_stream_made_again_does_not_answer_the_new_one(nats_url, nc, prefix):
    """A registration that changed nothing (UNCHANGED) has its answer kept in the reply bucket,
    under the worker and the request id, with the version of the history it stood on. The bucket
    outlives the stream, whose versions start over: the new stream's w-1, registered on runtime
    vB, is at the version the kept answer names. A registration on vA with the kept request id was
    answered UNCHANGED from the old stream and wrote nothing, so the log held w-1 on vB while it
    ran vA: vB's memory images would have been sent to it (an audit, 2026-12-04). It is decided on
    the new stream's history now."""
    from tests.registry_helpers import raw_request, registration, running_registry, runtime, worker_events

    on_a = registration("w-1", default=runtime("vA"), request_id="first")
    same = registration("w-1", default=runtime("vA"), request_id="again")
    async with running_registry(nats_url, prefix):
        assert (await raw_request(nc, prefix, "register", "w-1", on_a))[0]["outcome"] == "REGISTERED"
        assert (await raw_request(nc, prefix, "register", "w-1", same))[0] == {"outcome": "UNCHANGED", "seq": 1}
    await nc.jetstream().delete_stream(stream_name(prefix))
    async with running_registry(nats_url, prefix):
        on_b = registration("w-1", default=runtime("vB"), request_id="new-stream")
        assert (await raw_request(nc, prefix, "register", "w-1", on_b))[0] == {"outcome": "REGISTERED", "seq": 1}
        reply, _ = await raw_request(nc, prefix, "register", "w-1", same)
        assert reply["outcome"] == "RUNTIME_CHANGED", reply
        events = [event for _, event in await worker_events(nc, prefix, "w-1")]
        assert [type(event).__name__ for event in events] == ["WorkerRegistered", "RuntimeChanged"]
        assert events[-1].request_id == "again"
        assert [a.value for a in events[-1].sandbox_classes[0].default_runtime.version.attributes
                if a.key == "gvisor_asset_hash"] == ["vA"]
        # and on this stream the id is answered as its change, as any retry is
        assert (await raw_request(nc, prefix, "register", "w-1", same))[0] == reply


async def test_a_template_kept_unchanged_on_a_stream_made_again_is_set_on_the_new_one(nats_server, nc, prefix):
    """The snapshotter's kept answers (an update-template that changed nothing) likewise: on the
    new stream, the same request id sets the template the new actor does not have."""
    from events.schema import SeqReply, TemplateChanged, UpdateTemplate
    from events.subjects import service_subject
    from services.endpoints import call
    from services.snapshotter.service import SnapshotterService
    from tests.factories import actor, last_seq, read_entries

    def subject(verb: str) -> str:
        return service_subject(prefix, "snapshotter", verb, "a-1")

    keep = UpdateTemplate(template_uid="tpl-1", request_id="keep-tpl-1")
    for template, stream_again in (("tpl-1", False), ("tpl-0", True)):
        if stream_again:
            await nc.jetstream().delete_stream(stream_name(prefix))
        service = SnapshotterService(nc, nats_url=nats_server.url, prefix=prefix)
        await service.start()
        try:
            made = await call(nc, subject("create"), actor("a-1", cpu=250, mem=256, template=template), SeqReply)
            answer = await call(nc, subject("update-template"), keep, SeqReply)
        finally:
            await service.stop()
    assert (answer.seq, answer.unchanged) == (await last_seq(nc, prefix), False), (made, answer)
    templates = [e.template_uid for _, _, e in await read_entries(nc, prefix) if isinstance(e, TemplateChanged)]
    assert templates == ["tpl-1"]


async def test_a_checkpoint_of_messages_a_restored_stream_no_longer_holds_is_not_loaded(tmp_path, prefix):
    """The event stream alone put back from a copy taken before the checkpoint (an operator's restore
    of the stream, not of the checkpoints' bucket), and the restored log goes on: its messages at the
    checkpoint's sequences are others, with the same creation time. A replica started then replays
    the log rather than load the checkpoint, which folded w1 restoring V2: a1's V2 image is not
    restored on w1, which runs V1 alone in the log it now has (the verdict from the log in stream
    order). Kills the mutant of Checkpoints.load that skips the continuity check (the message at the
    checkpoint's sequence being the one it folded): the checkpoint was loaded and a1 placed at
    MEMORY on w1, pinned to V2."""
    import shutil

    import nats

    from events.codec import decode_event
    from events.schema import ActorPlaced, PlacedFidelity, WorkerRegistered
    from services.scheduler.service import SchedulerService
    from warmboot.natsserver import NatsServer

    store = tmp_path / "nats"
    server = NatsServer(store).start()
    url = server.url
    stream = stream_name(prefix)
    try:
        await write(url, prefix, (created("b0"),))  # the stream, as the copy has it
        server.stop()
        [events_dir] = [p for p in store.rglob(stream) if p.is_dir() and p.parent.name == "streams"]
        shutil.copytree(events_dir, tmp_path / "copy")
        server.start()
        await write(url, prefix, OLD)  # w1 restores V2; a1 waits with a V2 image
        nc = await nats.connect(url)
        try:
            first = SchedulerService(nc, nats_url=url, prefix=prefix, metrics=False,
                                     checkpoint_every=10**9, checkpoint_interval_s=0)
            await first.start()
            assert await first.checkpoints.save(first.projection) is not None
            saved = first.projection.seq
            await first.stop()
        finally:
            await nc.close()
        server.stop()
        shutil.rmtree(events_dir)
        shutil.copytree(tmp_path / "copy", events_dir)
        server.start()
        last = await write(url, prefix, NEW)  # w1 runs V1 alone now; the log goes past the checkpoint
        assert last > saved
        nc = await nats.connect(url)
        try:
            second = SchedulerService(nc, nats_url=url, prefix=prefix, metrics=False,
                                      checkpoint_every=10**9, checkpoint_interval_s=0)
            await second.start()
            try:
                answer = await call(nc, service_subject(prefix, "scheduler", "resume", "a1"), ResumeActor(),
                                    Assignment, timeout=10)
            finally:
                await second.stop()
            js = nc.jetstream()
            runs: dict[str, object] = {}
            placed = []
            for seq in range(1, (await js.stream_info(stream)).state.last_seq + 1):
                event = decode_event((await js.get_msg(stream, seq)).data)
                if isinstance(event, WorkerRegistered):
                    runs[event.worker_id] = event.sandbox_classes
                elif isinstance(event, ActorPlaced):
                    placed.append(event)
                    if event.fidelity is PlacedFidelity.MEMORY:
                        [cls] = runs[event.worker_id]
                        accepted = (cls.default_runtime.version, *(r.version for r in cls.restorable_runtimes))
                        assert event.sandbox_runtime.version in accepted, f"{event} on a worker running {cls}"
            assert [p.actor_id for p in placed] == ["a1"]
            assert answer.worker_id == "w1" and answer.fidelity is not PlacedFidelity.MEMORY, answer
        finally:
            await nc.close()
    finally:
        server.stop()


async def test_a_resume_queued_when_the_stream_is_made_again_is_not_committed_to_the_new_one(
        nc, nats_url, prefix, replicas):
    """A resume of a1 waits in the committer's queue (commits held, as during a leader election) when
    the stream is deleted and made again with the same bootstrap but w1 on V1 alone: the fold gives
    up, and the queued resume is refused UNAVAILABLE once commits go on, not decided on the old
    projection (w1 restoring V2) and appended to the new stream, whose subjects' sequences happen to
    be the ones that projection expects: the new log, in stream order, holds no ActorPlaced. Kills
    the mutant of Committer._fold_gave_up that leaves the committer deciding: a1 was placed at MEMORY
    on w1 pinned to V2, an image w1 cannot load."""
    from events.codec import decode_event
    from events.schema import ActorPlaced

    await write(nats_url, prefix, OLD)
    first = await replicas(metrics=False, checkpoint_every=10**9, checkpoint_interval_s=0)
    async with first.committer.commits_held():
        resume = asyncio.ensure_future(call(nc, service_subject(prefix, "scheduler", "resume", "a1"), ResumeActor(),
                                            Assignment, timeout=30))
        await asyncio.wait_for(first.committer.until_queued(1), 10)
        with logged("warmboot.scheduler", STOPPING) as stopping:
            await made_again(nc, nats_url, prefix)
            await asyncio.wait_for(stopping.wait(), STOPS_WITHIN_S)
    answered = (await asyncio.gather(resume, return_exceptions=True))[0]
    js = nc.jetstream()
    stream = stream_name(prefix)
    events = [decode_event((await js.get_msg(stream, seq)).data)
              for seq in range(1, (await js.stream_info(stream)).state.last_seq + 1)]
    placed = [e for e in events if isinstance(e, ActorPlaced)]
    assert not placed, f"placed on the old stream's fold: {placed}"
    assert isinstance(answered, ContractError) and answered.code is ErrorCode.UNAVAILABLE, answered
