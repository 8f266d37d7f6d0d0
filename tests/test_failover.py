"""Placements come back soon after a new stream leader is elected (issue 14, item 4), and a
replica started while its stream has no leader starts once it has one.

A 3-node cluster, every service (streams and buckets R3), actors cycling resume ->
suspend through `warmboot.client`; the stream leader is killed with SIGKILL. The
figure itself (the stall after the election; goal under 3 s) is measured by
`bench/failover.py`. Here, a bound that holds on a loaded machine: the log has a
placement committed within 10 s of the new leader's election (before the event store
gave an append whose leader died a new attempt at the election, and stopped waiting on
a stream check nobody could answer, placements came back up to 5 s after it), every
actor's client goes on (each gets a resume answered after the election), and no append
is stored twice.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import AsyncExitStack
from typing import Any

import pytest

from events.errors import ContractError
from events.jetstream import MSG_ID_HEADER, TOPIC_HEADER
from events.jetstream.layout import LEADER_ELECTED_ADVISORY
from events.natspy import flush_in_order
from events.schema import (Attribute, CompatVersion, CreateActor, ErrorCode, Fidelity, RegisterWorker, Resources,
                           WorkerRuntime, WorkerSandboxClass)
from events.subjects import stream_name
from tests.factories import ordered_subscription
from warmboot.client import Client
from warmboot.natsserver import NatsCluster, wait_jetstream, wait_stream_current
from warmboot.runner import SERVICES, connect, start_services

AFTER_ELECTION_BOUND_S = 10.0
VERSION = CompatVersion(schema_version="v1", attributes=(Attribute(key="architecture", value="amd64"),))


class Answers:
    """When each actor's resumes were answered; `reached` waits for a condition on them."""

    def __init__(self) -> None:
        self.at: dict[str, list[float]] = {}
        self.changed = asyncio.Condition()

    async def note(self, actor_id: str) -> None:
        async with self.changed:
            self.at.setdefault(actor_id, []).append(time.time())
            self.changed.notify_all()

    def count(self) -> int:
        return sum(len(v) for v in self.at.values())

    async def reached(self, condition) -> None:
        async with self.changed:
            await self.changed.wait_for(condition)


async def cycle(wb: Client, actor_id: str, answers: Answers, stop: asyncio.Event) -> None:
    """resume -> suspend until `stop`; a request the client gave up on (its retries spent
    during the election) is asked again with a new request id, as a caller would."""
    running = False
    while not stop.is_set():
        try:
            if running:
                await wb.suspend(actor_id, Fidelity.MEMORY)
            else:
                await wb.resume(actor_id)
                await answers.note(actor_id)
            running = not running
        except ContractError as error:
            if error.code is ErrorCode.FAILED_PRECONDITION:  # the attempt given up on had landed after all
                running = not running


@pytest.mark.timeout(300)
async def test_placements_resume_within_seconds_of_a_new_stream_leader(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMBOOT_STREAM_REPLICAS", "3")
    prefix = "t" + uuid.uuid4().hex[:10]
    stream = stream_name(prefix)
    with NatsCluster(tmp_path) as cluster:
        await wait_jetstream(cluster.url)
        async with AsyncExitStack() as exits:
            await start_services(exits, list(SERVICES), cluster.url, prefix,
                                 options={"scheduler": {"metrics": False},
                                          "registry": {"store_replicas": 3, "ttl_s": 600}})
            nc = await connect(cluster.url, "failover-client")
            exits.push_async_callback(nc.close)
            setup = Client(nc, prefix)
            for i in range(4):
                await setup.register(RegisterWorker(
                    worker_id=f"w-{i}", node=f"node-{i}", capacity=Resources(cpu_millis=64000, memory_mib=65536),
                    sandbox_classes=(WorkerSandboxClass(sandbox_class="gvisor",
                                                        default_runtime=WorkerRuntime(version=VERSION)),)))
            actors = [f"a-{i:02d}" for i in range(12)]
            for a in actors:
                await setup.create(CreateActor(actor_id=a, sandbox_class="gvisor", template_uid="t1",
                                               resources=Resources(cpu_millis=100, memory_mib=128)))
            answers, stop = Answers(), asyncio.Event()
            loops = [asyncio.create_task(cycle(Client(nc, prefix), a, answers, stop)) for a in actors]
            try:
                await asyncio.wait_for(answers.reached(lambda: answers.count() >= 3 * len(actors)), 120)
                await wait_stream_current(nc.jetstream(), stream, 3)
                leader = (await nc.jetstream().stream_info(stream)).cluster.leader
                elections: asyncio.Queue[tuple[float, str]] = asyncio.Queue()  # (when heard, the leader it names)

                async def on_elected(msg) -> None:
                    elections.put_nowait((time.time(), json.loads(msg.data).get("leader", "")))

                await nc.subscribe(f"{LEADER_ELECTED_ADVISORY}.{stream}", cb=on_elected)
                await flush_in_order(nc)
                killed_at = time.time()
                cluster.node(leader).kill()
                elected_at, elected = await asyncio.wait_for(elections.get(), 60)
                while elected in ("", leader):  # an advisory of an earlier election, if any: the next one
                    elected_at, elected = await asyncio.wait_for(elections.get(), 60)
                # every actor's client goes on: each has a resume answered after the election
                await asyncio.wait_for(answers.reached(
                    lambda: all(answers.at.get(a, [0.0])[-1] > elected_at for a in actors)), 120)
            finally:
                stop.set()
                await asyncio.gather(*loops, return_exceptions=True)
            placed_at, doubled = await read_log(nc, stream, killed_at)
            assert doubled == [], "appends stored twice"
            print(f"placements resumed {placed_at - killed_at:.2f} s after the kill, "
                  f"{placed_at - elected_at:.2f} s after the election")
            assert placed_at - elected_at <= AFTER_ELECTION_BOUND_S, (
                f"the first placement after the kill was committed {placed_at - elected_at:.1f} s after "
                f"{elected} was elected")


async def read_log(nc, stream: str, t: float) -> tuple[float, list[str]]:
    """The store time of the first ActorPlaced stored after time `t`, and the message ids the
    stream holds more than once (an append stored twice)."""
    js = nc.jetstream()
    last = (await js.stream_info(stream)).state.last_seq
    sub = await ordered_subscription(js, ">", stream)  # the cluster may still be settling after the kill
    first, ids, doubled = None, set(), []
    try:
        while True:
            msg = await sub.next_msg(timeout=10)
            headers = msg.headers or {}
            stored = msg.metadata.timestamp.timestamp()
            if first is None and stored > t and headers.get(TOPIC_HEADER) == "ActorPlaced":
                first = stored
            if (msg_id := headers.get(MSG_ID_HEADER)) is not None:
                if msg_id in ids:
                    doubled.append(msg_id)
                ids.add(msg_id)
            if msg.metadata.sequence.stream >= last:
                assert first is not None, "no placement after the kill"
                return first, doubled
    finally:
        await sub.unsubscribe()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fold", ["scheduler", "roster"])
async def test_a_fold_started_while_its_stream_has_no_leader_folds_once_it_has_one(tmp_path, monkeypatch, caplog,
                                                                                  fold):
    """A replica started during a failover (here two of the stream's three members down: no
    leader, no meta leader) asks for the stream and its fold's consumer again while JetStream
    cannot answer, instead of failing its start, and folds the whole log once it can."""
    import nats

    from services.registry.fold import RosterFold
    from services.registry.roster import Roster
    from services.scheduler.fold import Fold
    from services.scheduler.projection import Projection
    from tests.factories import Writer, entry, registered, started_once_members_are_back, unanswered_noted, version

    monkeypatch.setenv("WARMBOOT_STREAM_REPLICAS", "3")
    prefix = "t" + uuid.uuid4().hex[:10]
    with unanswered_noted(caplog) as asked:
        with NatsCluster(tmp_path) as cluster:
            await wait_jetstream(cluster.url)
            writer = await asyncio.to_thread(Writer, cluster.url, prefix)  # the stream, R3
            try:
                seq = await asyncio.to_thread(writer.write, registered("w-1", entry(version("1"))))
            finally:
                await asyncio.to_thread(writer.close)
            first, *others = cluster.nodes
            for node in others:
                await asyncio.to_thread(node.stop)
            nc = await nats.connect(first.url)
            try:
                folding = (Fold(nc, prefix, Projection()) if fold == "scheduler"
                           else RosterFold(nc, prefix, Roster()))
                await started_once_members_are_back(folding.start(120), asked, others, 150)
                if fold == "scheduler":
                    assert folding.projection.seq >= seq and "w-1" in folding.projection.workers
                else:
                    assert folding.roster.alive("w-1")
                await folding.stop()
            finally:
                await nc.close()


@pytest.mark.timeout(300)
async def test_a_request_on_two_replicas_at_once_is_answered_alike_on_a_replicated_stream(tmp_path, monkeypatch):
    """A client's retry reaches another scheduler replica while its first attempt is being
    committed: both append the same actor version at once. On a replicated stream the leader
    refuses the second proposal of a message id in flight (err_code 10158, "duplicate message id
    is in process"), which failed the loser's whole group as UNAVAILABLE (the review's run: 20 of
    120). Waited out, it is the conflict it is: both answers are the first placement, one
    ActorPlaced per request, no UNAVAILABLE. Three rounds, 60 actors, two replicas on two nodes."""
    from collections import Counter

    from events.schema import ActorPlaced, ResumeActor
    from tests.factories import actor, read_log, version, worker

    monkeypatch.setenv("WARMBOOT_STREAM_REPLICAS", "3")
    prefix = "t" + uuid.uuid4().hex[:10]
    v1 = version("v1")
    with NatsCluster(tmp_path) as cluster:
        await wait_jetstream(cluster.url)
        async with AsyncExitStack() as exits:
            first = await every_service(exits, cluster, prefix)
            second, _ = await scheduler_replica(exits, cluster.urls[1], prefix, "replica-b")
            nc = await connect(cluster.url, "client")
            exits.push_async_callback(nc.close)
            wb = Client(nc, prefix)
            for i in range(4):
                await wb.register(worker(f"w{i}", v1, cpu=64000, mem=65536))
            actors = [f"a{i:02d}" for i in range(60)]
            for a in actors:
                await wb.create(actor(a, cpu=100, mem=128))
            outcomes: Counter = Counter()
            for round_ in range(3):
                async def one(replica, actor_id):
                    try:
                        return await replica.resume(actor_id, ResumeActor(request_id=f"r{round_}-{actor_id}"))
                    except ContractError as error:
                        return error.code

                answers = await asyncio.gather(*(one(replica, a) for a in actors for replica in (first, second)))
                for a, pair in zip(actors, (answers[i:i + 2] for i in range(0, len(answers), 2))):
                    outcomes.update(type(x).__name__ if not isinstance(x, ErrorCode) else x.value for x in pair)
                    assert pair[0] == pair[1], (a, pair)  # the retry's answer is the first one's
                for a in actors:
                    await wb.suspend(a, fidelity=Fidelity.MEMORY, uri=f"s3://x/{a}-{round_}")
            assert outcomes == Counter({"Assignment": 2 * 3 * len(actors)}), outcomes
            placed = Counter(e.request_id for _, e in await read_log(nc, prefix) if isinstance(e, ActorPlaced))
            assert set(placed.values()) == {1} and len(placed) == 3 * len(actors)


async def every_service(exits: AsyncExitStack, cluster: NatsCluster, prefix: str, **registry: Any) -> Any:
    """Every service on the cluster's first member, its streams and buckets at three replicas and
    workers never LOST during the test (`registry`: more of the registry's options); its scheduler
    replica."""
    from tests.factories import SILENT_TTL_S

    running = await start_services(exits, list(SERVICES), cluster.urls[0], prefix,
                                   options={"scheduler": {"metrics": False},
                                            "registry": {"store_replicas": 3, "ttl_s": SILENT_TTL_S, **registry}})
    return running.services[-1]


async def scheduler_replica(exits: AsyncExitStack, url: str, prefix: str, name: str, **options: Any) -> tuple[Any, Any]:
    """Another scheduler replica, on a connection of its own to `url`: (the replica, its connection)."""
    from services.scheduler.service import SchedulerService

    nc = await connect(url, name)
    exits.push_async_callback(nc.close)
    replica = await SchedulerService(nc, nats_url=url, prefix=prefix, metrics=False, **options).start()
    exits.push_async_callback(replica.stop)
    return replica, nc
