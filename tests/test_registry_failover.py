"""The registry's verbs through stream leader elections on a 3-node cluster, each request sent at once
to two registry replicas, with one append in ten losing its reply (half after it was stored), and each
request sent again later with its id.

What a user checks: both copies of a request and its late retry get one answer (the first, or for an
id of an earlier life of the worker a refusal naming `request_id`); the log, read in stream order, holds
each request's effect once."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter, defaultdict
from contextlib import AsyncExitStack
from typing import Any

import msgspec
import pytest

from events.errors import ContractError
from events.schema import DrainWorker, ErrorCode, RemoveWorker
from events.subjects import stream_name
from services.process import store_env
from tests.factories import SILENT_TTL_S, answered, elections, outcome, read_log, version, worker
from tests.test_append_failover import losing_replies
from tests.test_failover import every_service
from warmboot.natsserver import NatsCluster, wait_jetstream, wait_stream_current
from warmboot.runner import connect

WORKERS = 24
ROUNDS = 5


async def registry_replica(exits: AsyncExitStack, cluster: NatsCluster, index: int, prefix: str,
                           rng: random.Random) -> Any:
    from services.registry.service import RegistryService

    url = cluster.urls[index]
    urls = ",".join([url] + [u for u in cluster.urls if u != url])
    nc = await connect(urls, f"registry-{index}")
    exits.push_async_callback(nc.close)
    replica = await RegistryService(nc, nats_url=url, prefix=prefix, env=store_env(urls, prefix, replicas=3),
                                    store_replicas=3, ttl_s=SILENT_TTL_S).start()
    exits.push_async_callback(replica.stop)
    losing_replies(replica.store.recorder.stream, rng)
    return replica


async def ask(replica: Any, verb: str, worker_id: str, req: Any) -> Any:
    """`verb` at `replica` with its request id until answered (`factories.answered`; a registry busy with
    heartbeats answers RESOURCE_EXHAUSTED, sent again too)."""
    return await answered(lambda: getattr(replica, verb)(worker_id, req), f"{verb} {req.request_id}",
                          again=frozenset({ErrorCode.UNAVAILABLE, ErrorCode.RESOURCE_EXHAUSTED}))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("disrupt", ["stepdown", "kill"])
async def test_registry_copies_on_two_replicas_through_elections_answer_alike_and_write_once(tmp_path, monkeypatch,
                                                                                             disrupt):
    monkeypatch.setenv("WARMBOOT_STREAM_REPLICAS", "3")
    prefix = "t" + uuid.uuid4().hex[:10]
    stream = stream_name(prefix)
    rng = random.Random(11)
    with NatsCluster(tmp_path) as cluster:
        await wait_jetstream(cluster.url)
        async with AsyncExitStack() as exits:
            await every_service(exits, cluster, prefix)
            replicas = [await registry_replica(exits, cluster, i, prefix, rng) for i in (1, 2)]
            nc = await connect(cluster.url, "client")
            exits.push_async_callback(nc.close)
            v1, v2 = version("v1"), version("v2")
            sent: dict[str, tuple[str, str, Any, Any, int]] = {}  # id -> (verb, worker, request, first answer, life)
            odd: list[Any] = []
            lives: dict[str, int] = defaultdict(int)

            async def dup(verb: str, worker_id: str, req: Any) -> Any:
                a, b = await asyncio.gather(ask(replicas[0], verb, worker_id, req),
                                            ask(replicas[1], verb, worker_id, req))
                c = await ask(rng.choice(replicas), verb, worker_id, req)
                if not (outcome(a) == outcome(b) == outcome(c)):
                    odd.append(("copies answered otherwise", verb, worker_id, req.request_id, outcome(a), outcome(b),
                                outcome(c)))
                if isinstance(a, ContractError):
                    odd.append(("refused", verb, worker_id, req.request_id, outcome(a), a.message))
                sent[req.request_id] = (verb, worker_id, req, outcome(a), lives[worker_id])
                return a

            async def cycle(worker_id: str) -> None:
                for k in range(ROUNDS):
                    rid = lambda op: f"{worker_id}-{k}-{op}"  # noqa: E731
                    if k:
                        await dup("remove", worker_id, RemoveWorker(request_id=rid("remove"), reason="cycle"))
                    lives[worker_id] += 1
                    base = worker(worker_id, v1, cpu=64000, mem=65536)
                    await dup("register", worker_id, msgspec.structs.replace(base, request_id=rid("reg")))
                    changed = worker(worker_id, v2, cpu=64000, mem=65536)
                    await dup("register", worker_id, msgspec.structs.replace(changed, request_id=rid("rt")))
                    updated = worker(worker_id, v2, cpu=32000, mem=65536)
                    await dup("register", worker_id, msgspec.structs.replace(updated, request_id=rid("upd")))
                    await dup("register", worker_id, msgspec.structs.replace(updated, request_id=rid("same")))
                    await dup("drain", worker_id, DrainWorker(request_id=rid("drain"), reason="cycle"))
                    await dup("drain", worker_id, DrainWorker(request_id=rid("drain2"), reason="cycle"))

            stop = asyncio.Event()

            chaos = asyncio.create_task(elections(nc, cluster, stream, stop, rng, disrupt))
            try:
                await asyncio.gather(*(cycle(f"w{i:02d}") for i in range(WORKERS)))
            finally:
                stop.set()
                stepped = await chaos

            for rid, (verb, worker_id, req, first, life) in sorted(sent.items()):
                again = outcome(await ask(rng.choice(replicas), verb, worker_id, req))
                if life == lives[worker_id]:
                    if again != first:
                        odd.append(("late retry answered otherwise", rid, first, again))
                elif not (isinstance(again, tuple) and again[2] == "request_id"):
                    odd.append(("late retry of an earlier life not refused", rid, first, again))

            await wait_stream_current(nc.jetstream(), stream, 3)
            by_request: dict[str, Counter] = defaultdict(Counter)
            for seq, event in await read_log(nc, prefix):
                if getattr(event, "request_id", None) is not None:
                    by_request[event.request_id][type(event).__name__] += 1
            expected = {"remove": {"WorkerRemoved": 1}, "reg": {"WorkerRegistered": 1}, "rt": {"RuntimeChanged": 1},
                        "upd": {"WorkerUpdated": 1}, "same": {}, "drain": {"WorkerDrained": 1}, "drain2": {}}
            for rid in sent:
                want = expected[rid.rsplit("-", 1)[1]]
                if dict(by_request.get(rid, {})) != want:
                    odd.append(("log holds otherwise", rid, dict(by_request.get(rid, {})), want))
            print(f"{len(sent)} requests, {stepped} disruptions")
            print(Counter(o[0] for o in odd))
            assert odd == [], odd[:20]
