"""Failures warmboot must ride out: a cluster's stream leader killed under load, a single
server restarted mid-load, a scheduler replica killed with -9 in the middle of commits.

After each: every acknowledged event is in the stream, `audit verify` finds no double
booking and no stamp off its pin, clients saw at most UNAVAILABLE (and retried with the
same request_id), never a wrong answer, and the services reconnected by themselves.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from events.codec import decode_event
from events.errors import ContractError
from events.schema import (
    ActorPlaced,
    Assignment,
    Attribute,
    CompatVersion,
    CreateActor,
    ErrorCode,
    Fidelity,
    PauseActor,
    RegisterReply,
    RegisterWorker,
    Resources,
    ResumeActor,
    SeqReply,
    SnapshotReply,
    SuspendActor,
    WorkerFenced,
    WorkerRegistered,
    WorkerRuntime,
    WorkerSandboxClass,
)
from events.subjects import service_subject, stream_name
from services.endpoints import call
from tests.factories import SILENT_TTL_S, ordered_subscription
from warmboot.audit import Sink
from warmboot.cli_common import read_subject, replay
from warmboot.natsserver import NatsCluster, NatsServer, wait_jetstream, wait_stream_current
from warmboot.runner import SERVICES, connect, start_services

RETRYABLE = {ErrorCode.UNAVAILABLE}
VERSION = CompatVersion(schema_version="v1", attributes=(Attribute(key="architecture", value="amd64"),
                                                          Attribute(key="cpu_features", value="00aa00bb00cc00dd")))


@dataclass
class Load:
    """A bounded, steady load of lifecycle requests; every answer is recorded with its seq."""

    nc: object
    prefix: str
    acked: dict[int, str] = field(default_factory=dict)  # seq -> subject it must be on
    unavailable: int = 0
    placements: dict[str, list[Assignment]] = field(default_factory=dict)
    answered: asyncio.Event = field(default_factory=asyncio.Event)  # set by each acknowledged write

    async def ask(self, service: str, verb: str, entity: str, body, reply_type, *, attempts: int = 60):
        """One request; retried with the same body (and request_id) while the answer is UNAVAILABLE."""
        subject = service_subject(self.prefix, service, verb, entity)
        for _ in range(attempts):
            try:
                return await call(self.nc, subject, body, reply_type, timeout=5.0)
            except ContractError as e:
                if e.code not in RETRYABLE:
                    raise
                self.unavailable += 1
                await asyncio.sleep(0.25)  # client back-off between retries, not synchronisation
        raise AssertionError(f"{subject} stayed unavailable")

    def ack(self, seq: int, kind: str, entity: str) -> None:
        self.acked[seq] = f"{self.prefix}.ev.{kind}.{entity}"
        self.answered.set()

    async def register(self, worker_id: str) -> None:
        body = RegisterWorker(
            worker_id=worker_id, node=f"node-{worker_id}", capacity=Resources(cpu_millis=64000, memory_mib=65536),
            sandbox_classes=(WorkerSandboxClass(sandbox_class="gvisor", default_runtime=WorkerRuntime(version=VERSION)),),
            request_id=f"reg-{worker_id}",
        )
        reply = await self.ask("registry", "register", worker_id, body, RegisterReply)
        self.ack(reply.seq, "worker", worker_id)

    async def create(self, actor_id: str) -> None:
        body = CreateActor(actor_id=actor_id, sandbox_class="gvisor", template_uid="t1",
                           resources=Resources(cpu_millis=100, memory_mib=128), request_id=f"create-{actor_id}")
        reply = await self.ask("snapshotter", "create", actor_id, body, SeqReply)
        self.ack(reply.seq, "actor", actor_id)

    async def cycle(self, actor_id: str, round_: int) -> None:
        """resume -> pause -> resume -> suspend, each with its own request_id; each resume passes
        the previous reply's seq as `min_seq` (read-your-writes across services)."""
        seq = 0
        for step in ("r1", "p", "r2", "s"):
            request_id = f"{actor_id}-{round_}-{step}"
            if step.startswith("r"):
                reply = await self.ask("scheduler", "resume", actor_id,
                                       ResumeActor(min_seq=seq, request_id=request_id), Assignment)
                assert reply.actor_id == actor_id
                self.placements.setdefault(actor_id, []).append(reply)
                # The last event a placement writes is its booking marker, on the worker's booking subject.
                self.ack(reply.seq, "booking", reply.worker_id)
            elif step == "p":
                reply = await self.ask("snapshotter", "pause", actor_id, PauseActor(request_id=request_id),
                                       SnapshotReply)
                self.ack(reply.seq, "actor", actor_id)
            else:
                reply = await self.ask("snapshotter", "suspend", actor_id,
                                       SuspendActor(fidelity=Fidelity.MEMORY, request_id=request_id), SnapshotReply)
                self.ack(reply.seq, "actor", actor_id)
            seq = reply.seq


async def check_log(nc, load: Load) -> None:
    """Every acknowledged event is in the stream where it belongs; the invariants hold;
    every assignment a client got is the ActorPlaced the log holds at its seq."""
    js = nc.jetstream()
    stream = stream_name(load.prefix)
    for seq, subject in sorted(load.acked.items()):
        msg = await js.get_msg(stream, seq)
        assert msg.subject == subject, (seq, msg.subject, subject)
    for actor_id, assignments in load.placements.items():
        history = [e for _, e in await read_subject(nc, load.prefix, f"{load.prefix}.ev.actor.{actor_id}")
                   if isinstance(e, ActorPlaced)]
        by_request = {e.request_id: e for e in history}
        assert len(by_request) == len(history), f"{actor_id}: one ActorPlaced per resume request"
        for assignment in assignments:
            booked = decode_event((await js.get_msg(stream, assignment.seq)).data)
            assert (booked.worker_id, booked.actor_id) == (assignment.worker_id, actor_id)
        answered = {(a.worker_id, a.sandbox_runtime) for a in assignments}
        assert answered <= {(e.worker_id, e.sandbox_runtime) for e in history}
    sink = await replay(nc, load.prefix, Sink(verify=True), False)
    assert sink.violation is None, str(sink.violation)
    stamps = sum(1 for a in sink.projection.actors.values() if a.snap_stamp is not None)
    assert stamps > 0


async def run_load(load: Load, actors: list[str], rounds: int, fault) -> None:
    """`rounds` of cycles over every actor, with `fault()` injected halfway, while cycles are in flight."""
    for r in range(rounds):
        if r == rounds // 2:
            load.answered.clear()
            cycles = asyncio.gather(*(load.cycle(a, r) for a in actors))
            await asyncio.wait_for(load.answered.wait(), 60)  # the round's first answer: its cycles are under way
            await fault()
            await cycles
            continue
        await asyncio.gather(*(load.cycle(a, r) for a in actors))


async def start_again(server: NatsServer) -> None:
    """Spawn on the loop's (long-lived) thread, wait for readiness off it."""
    server.spawn()
    await asyncio.to_thread(server.wait_ready)


@pytest.mark.timeout(600)
async def test_stream_leader_killed_under_load(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMBOOT_STREAM_REPLICAS", "3")
    prefix = "t" + uuid.uuid4().hex[:10]
    with NatsCluster(tmp_path) as cluster:
        await wait_jetstream(cluster.url)
        async with AsyncExitStack() as exits:
            await start_services(exits, list(SERVICES), cluster.url, prefix,
                                 options={"scheduler": {"metrics": False},
                                          "registry": {"store_replicas": 3, "ttl_s": SILENT_TTL_S}})
            nc = await connect(cluster.url, "fault-client")
            exits.push_async_callback(nc.close)
            load = Load(nc, prefix)
            for i in range(4):
                await load.register(f"w-{i}")
            actors = [f"a-{i:02d}" for i in range(16)]
            await asyncio.gather(*(load.create(a) for a in actors))
            info = await nc.jetstream().stream_info(stream_name(prefix))
            assert info.config.num_replicas == 3
            killed: list[NatsServer] = []

            async def kill_leader() -> None:
                leader = (await nc.jetstream().stream_info(stream_name(prefix))).cluster.leader
                node = cluster.node(leader)
                node.kill()
                killed.append(node)

            await run_load(load, actors, 4, kill_leader)
            # Bring the node back; the load keeps going with it in the cluster.
            await start_again(killed[0])
            await asyncio.gather(*(load.cycle(a, 99) for a in actors))
            # the verdict reads the log message by message: once the node back in the cluster has
            # caught up (until then a read may be answered 503, "JetStream temporarily unavailable")
            await wait_stream_current(nc.jetstream(), stream_name(prefix), 3)
            new_leader = (await nc.jetstream().stream_info(stream_name(prefix))).cluster.leader
            assert new_leader != killed[0].name or killed[0].running
            # and once it makes consumers again (the verdict reads subjects through ordered consumers)
            await (await ordered_subscription(nc.jetstream(), f"{prefix}.>", stream_name(prefix))).unsubscribe()
            await check_log(nc, load)


@pytest.mark.timeout(600)
async def test_single_server_restarted_mid_load(tmp_path):
    prefix = "t" + uuid.uuid4().hex[:10]
    server = NatsServer(tmp_path)
    server.start()
    try:
        async with AsyncExitStack() as exits:
            await start_services(exits, list(SERVICES), server.url, prefix,
                                 options={"scheduler": {"metrics": False}, "registry": {"ttl_s": SILENT_TTL_S}})
            nc = await connect(server.url, "fault-client")
            exits.push_async_callback(nc.close)
            load = Load(nc, prefix)
            for i in range(3):
                await load.register(f"w-{i}")
            actors = [f"a-{i:02d}" for i in range(12)]
            await asyncio.gather(*(load.create(a) for a in actors))

            async def restart() -> None:
                await asyncio.to_thread(server.stop)
                await start_again(server)

            await run_load(load, actors, 4, restart)
            await check_log(nc, load)
    finally:
        server.stop()


@pytest.mark.timeout(300)
async def test_single_server_restarted_mid_registration_storm(tmp_path):
    """Registrations go out grouped (several workers' changes in one atomic batch): a restart while
    they are in flight loses none and doubles none. Each client retries UNAVAILABLE with its
    request id; afterwards every worker has one registration and one fence, and every answer
    names the registration the log holds."""
    prefix = "t" + uuid.uuid4().hex[:10]
    server = NatsServer(tmp_path)
    server.start()
    try:
        async with AsyncExitStack() as exits:
            await start_services(exits, ["registry"], server.url, prefix, options={"registry": {"ttl_s": SILENT_TTL_S}})
            nc = await connect(server.url, "fault-client")
            exits.push_async_callback(nc.close)
            load = Load(nc, prefix)
            workers = [f"w-{i:03d}" for i in range(300)]
            storm = asyncio.gather(*(load.register(w) for w in workers))
            await asyncio.wait_for(load.answered.wait(), 60)
            in_flight = len(workers) - len(load.acked)
            await asyncio.to_thread(server.stop)
            await start_again(server)
            await storm
            assert in_flight > 0  # the restart came while registrations were under way
            assert sorted(load.acked.values()) == sorted(f"{prefix}.ev.worker.{w}" for w in workers)
            js = nc.jetstream()
            for seq in load.acked:
                assert isinstance(decode_event((await js.get_msg(stream_name(prefix), seq)).data), WorkerRegistered)
            for w in workers:
                for kind, wanted in (("worker", WorkerRegistered), ("booking", WorkerFenced)):
                    history = await read_subject(nc, prefix, f"{prefix}.ev.{kind}.{w}")
                    assert [type(e) for _, e in history] == [wanted], (w, kind, history)
    finally:
        server.stop()


def serve_scheduler(url: str, prefix: str) -> subprocess.Popen:
    exe = str(Path(sys.executable).parent / "warmboot")
    return subprocess.Popen([exe, "serve", "scheduler", "--nats", url, "--prefix", prefix],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def wait_serving(proc: subprocess.Popen, within: float = 60.0) -> None:
    """Until `proc` (`serve_scheduler`) says it serves; AssertionError if it has not within `within` s (the
    thread reading its output ends once the caller kills it) or ended without saying so."""
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), within)
    except asyncio.TimeoutError:
        raise AssertionError(f"warmboot serve scheduler said nothing within {within:g}s "
                             f"({'running' if proc.poll() is None else f'exit {proc.returncode}'})") from None
    assert line.startswith("serving"), line


@pytest.mark.timeout(300)
async def test_scheduler_killed_mid_commit_places_each_request_once(nats_server, prefix, nc):
    async with AsyncExitStack() as exits:
        await start_services(exits, ["registry", "snapshotter"], nats_server.url, prefix,
                             options={"registry": {"ttl_s": SILENT_TTL_S}})
        load = Load(nc, prefix)
        for i in range(3):
            await load.register(f"w-{i}")
        actors = [f"a-{i:02d}" for i in range(40)]
        await asyncio.gather(*(load.create(a) for a in actors))
        first = serve_scheduler(nats_server.url, prefix)
        try:
            await wait_serving(first)
            requests = {a: ResumeActor(request_id=f"resume-{a}") for a in actors}
            subject = lambda a: service_subject(prefix, "scheduler", "resume", a)  # noqa: E731
            in_flight = [asyncio.ensure_future(call(nc, subject(a), requests[a], Assignment, timeout=5))
                         for a in actors]
            # Kill -9 as soon as the first placement is committed: the rest are mid-way.
            await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            first.send_signal(signal.SIGKILL)
            first.wait()
            answered = {}
            for a, fut in zip(actors, in_flight):
                try:
                    answered[a] = await fut
                except ContractError:
                    pass  # lost with the replica: the client retries
        finally:
            if first.poll() is None:
                first.kill()
        second = serve_scheduler(nats_server.url, prefix)
        try:
            await wait_serving(second)
            retried = {a: await load.ask("scheduler", "resume", a, requests[a], Assignment) for a in actors}
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=30)
        assert answered, "the first placement was answered before the kill"
        for a, assignment in answered.items():
            assert retried[a] == assignment, "a retry must get the first answer"
        # Exactly one ActorPlaced per actor in the log.
        sink = await replay(nc, prefix, Sink(verify=True), False)
        assert sink.violation is None, str(sink.violation)
        placed = {}
        for a in actors:
            events = await read_subject(nc, prefix, f"{prefix}.ev.actor.{a}")
            placed[a] = [e for _, e in events if isinstance(e, ActorPlaced)]
        assert all(len(p) == 1 for p in placed.values()), {a: len(p) for a, p in placed.items() if len(p) != 1}
        assert {a: (p[0].worker_id, p[0].request_id) for a, p in placed.items()} == {
            a: (retried[a].worker_id, f"resume-{a}") for a in actors}
