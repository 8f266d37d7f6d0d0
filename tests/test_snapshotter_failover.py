"""The snapshotter's verbs through stream leader elections on a 3-node cluster, each request sent
at once to two snapshotter replicas (a client's retry reaching another replica while its first
attempt is decided), with one append in ten losing its reply (half after it was stored), and each
request sent again later with its id (a late retry).

What a user checks: both copies of a request and its late retry get one answer (the first); the
log, read in stream order, holds each request's effect once; `audit verify` finds nothing."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter, defaultdict
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, AsyncIterator

import pytest

from events.errors import ContractError
from events.schema import (
    CreateActor, Fidelity, PauseActor, RevertActor, SnapshotTaken, StopActor, SuspendActor, TagSnapshot,
    UpdateTemplate,
)
from events.subjects import stream_name
from services.process import store_env
from tests.factories import actor, answered, elections, outcome, read_log, version, worker
from tests.test_append_failover import losing_replies
from tests.test_failover import every_service
from warmboot.client import Client
from warmboot.natsserver import NatsCluster, wait_jetstream, wait_stream_current
from warmboot.runner import connect

ACTORS = 24
ROUNDS = 8

VERBS = {"pause": ("pause", PauseActor), "suspend": ("suspend", SuspendActor), "tag": ("tag", TagSnapshot),
         "update-template": ("update_template", UpdateTemplate), "stop": ("stop_actor", StopActor),
         "revert": ("revert", RevertActor), "create": ("create", CreateActor)}


async def snapshotter_replica(exits: AsyncExitStack, cluster: NatsCluster, index: int, prefix: str,
                              rng: random.Random) -> Any:
    from services.snapshotter.service import SnapshotterService

    url = cluster.urls[index]
    nc = await connect(",".join([url] + [u for u in cluster.urls if u != url]), f"snapshotter-{index}")
    exits.push_async_callback(nc.close)
    env = store_env(",".join([url] + [u for u in cluster.urls if u != url]), prefix, replicas=3)
    replica = await SnapshotterService(nc, nats_url=url, prefix=prefix, env=env, follow=False).start()
    exits.push_async_callback(replica.stop)
    losing_replies(replica.app.recorder.stream, rng)
    return replica


async def ask(replica: Any, verb: str, actor_id: str, req: Any) -> Any:
    """`verb` (a key of VERBS) at `replica` with its request id until answered (`factories.answered`)."""
    return await answered(lambda: getattr(replica, VERBS[verb][0])(actor_id, req), f"{verb} {req.request_id}")


@asynccontextmanager
async def snapshotters_on_a_cluster(tmp_path, prefix: str, rng: random.Random
                                    ) -> AsyncIterator[tuple[NatsCluster, list[Any], Any, Client]]:
    """A 3-node cluster running every service, two more snapshotter replicas (`snapshotter_replica`), and
    a client: (the cluster, the two replicas, the client's connection, the client)."""
    with NatsCluster(tmp_path) as cluster:
        await wait_jetstream(cluster.url)
        async with AsyncExitStack() as exits:
            await every_service(exits, cluster, prefix)
            replicas = [await snapshotter_replica(exits, cluster, i, prefix, rng) for i in (1, 2)]
            nc = await connect(cluster.url, "client")
            exits.push_async_callback(nc.close)
            yield cluster, replicas, nc, Client(nc, prefix, attempts=30)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("disrupt", ["stepdown", "kill"])
async def test_snapshotter_copies_on_two_replicas_through_elections_answer_alike_and_write_once(tmp_path,
                                                                                                monkeypatch, disrupt):
    monkeypatch.setenv("WARMBOOT_STREAM_REPLICAS", "3")
    prefix = "t" + uuid.uuid4().hex[:10]
    stream = stream_name(prefix)
    rng = random.Random(7)
    async with snapshotters_on_a_cluster(tmp_path, prefix, rng) as (cluster, replicas, nc, wb):
        v1 = version("v1")
        for i in range(4):
            await wb.register(worker(f"w{i}", v1, cpu=64000, mem=65536))
        actors = [f"a{i:02d}" for i in range(ACTORS)]
        sent: dict[str, tuple[str, str, Any, Any]] = {}  # request id -> (verb, actor, request, first answer)
        odd: list[Any] = []
        last_create: dict[str, str] = {}

        async def dup(verb: str, actor_id: str, req: Any) -> Any:
            a, b = await asyncio.gather(ask(replicas[0], verb, actor_id, req), ask(replicas[1], verb, actor_id, req))
            c = await ask(rng.choice(replicas), verb, actor_id, req)
            if not (outcome(a) == outcome(b) == outcome(c)):
                odd.append(("copies answered otherwise", verb, actor_id, req.request_id, outcome(a), outcome(b),
                            outcome(c)))
            if isinstance(a, ContractError):
                odd.append(("refused", verb, actor_id, req.request_id, outcome(a), a.message))
            sent[req.request_id] = (verb, actor_id, req, outcome(a))
            if verb == "create":
                last_create[actor_id] = req.request_id
            return a

        async def life(actor_id: str) -> None:
            for k in range(ROUNDS):
                rid = lambda op: f"{actor_id}-{k}-{op}"  # noqa: E731
                placed = await wb.resume(actor_id)
                await dup("pause", actor_id, PauseActor(request_id=rid("pause"), placement_seq=placed.seq,
                                                        snapshot_id=f"img-{actor_id}-{k}"))
                await dup("suspend", actor_id, SuspendActor(request_id=rid("promote"), fidelity=Fidelity.MEMORY,
                                                            uri=f"s3://x/{actor_id}-{k}"))
                await dup("tag", actor_id, TagSnapshot(request_id=rid("tag"), tag=f"tag-{actor_id}"))
                await dup("update-template", actor_id,
                          UpdateTemplate(request_id=rid("tmpl"), template_uid=f"t{k + 2}"))
                placed = await wb.resume(actor_id)
                await dup("suspend", actor_id, SuspendActor(request_id=rid("suspend"), fidelity=Fidelity.MEMORY,
                                                            uri=f"s3://y/{actor_id}-{k}", placement_seq=placed.seq,
                                                            snapshot_id=f"ext-{actor_id}-{k}"))
                placed = await wb.resume(actor_id)
                await dup("pause", actor_id, PauseActor(request_id=rid("pause2"), placement_seq=placed.seq))
                await dup("revert", actor_id, RevertActor(request_id=rid("revert")))
                if k % 2:
                    await dup("stop", actor_id, StopActor(request_id=rid("stop")))
                    await dup("create", actor_id, CreateActor(**{
                        **{f: getattr(actor(actor_id, cpu=100, mem=128), f)
                           for f in CreateActor.__struct_fields__}, "request_id": rid("create")}))

        for a in actors:
            await wb.create(actor(a, cpu=100, mem=128))
        stop = asyncio.Event()

        chaos = asyncio.create_task(elections(nc, cluster, stream, stop, rng, disrupt))
        try:
            await asyncio.gather(*(life(a) for a in actors))
        finally:
            stop.set()
            stepped = await chaos

        # late retries of every request, at either replica: the first answer, or (an earlier life's
        # id, the actor created anew since) a refusal naming the request id
        for rid, (verb, actor_id, req, first) in sorted(sent.items()):
            again = outcome(await ask(rng.choice(replicas), verb, actor_id, req))
            earlier = isinstance(again, tuple) and (again[2] == "request_id" or verb == "create" and again[1] == "ALREADY_EXISTS" and last_create[actor_id] != rid)
            if again != first and not earlier:
                odd.append(("late retry answered otherwise", rid, first, again))

        await wait_stream_current(nc.jetstream(), stream, 3)
        log = await read_log(nc, prefix)
        by_request: dict[str, Counter] = defaultdict(Counter)
        for seq, event in log:
            if event.request_id is not None:
                name = type(event).__name__
                if isinstance(event, SnapshotTaken):
                    name += "." + event.origin.value
                by_request[event.request_id][name] += 1
        expected = {
            "pause": {"SnapshotTaken.PAUSE": 1, "ActorReleased": 1, "ImageNamed": 1},
            "promote": {"SnapshotTaken.PROMOTE": 1, "ImageNamed": 1},
            "tag": {"SnapshotTaken.TAG": 1, "TagRecorded": 1},
            "tmpl": {"TemplateChanged": 1},
            "suspend": {"SnapshotTaken.SUSPEND": 1, "ActorReleased": 1, "ImageNamed": 1},
            "pause2": {"SnapshotTaken.PAUSE": 1, "ActorReleased": 1},
            "revert": {"ActorReverted": 1},
            "stop": {"ActorStopped": 1},
            "create": {"ActorCreated": 1},
        }
        for rid in sent:
            want = expected[rid.rsplit("-", 1)[1]]
            if dict(by_request.get(rid, {})) != want:
                odd.append(("log holds otherwise", rid, dict(by_request.get(rid, {})), want))
        from warmboot.audit import Sink
        from warmboot.cli_common import replay

        sink = await replay(nc, prefix, Sink(verify=True), False)
        assert sink.violation is None, sink.violation
        print(f"{len(sent)} requests, {stepped} stepdowns")
        print(Counter(o[0] for o in odd))
        assert odd == [], odd[:20]
