"""A write decided in time whose append finds the stream without a leader (its leader killed, the
election not over) is sent again by the store until a leader takes it (`Stream.append`'s retries,
for WARMBOOT_STORE_TIMEOUT): each attempt nobody took stored nothing, so an attempt sent after the
caller's wait (`Warmboot-Wait-Ms`) is a first write of a request whose caller has gone, which
docs/contract.md says a replica does not make ("It is judged again where the write goes out").

On a 3-node cluster: the stream leader is killed, and while the other two elect one (seconds), the
snapshotter's stop of an actor (one event; of a placed actor, two: a grouped append) and the
registry's drain of a worker (an event and its fence: a grouped append) are sent with a short wait.
Their callers are told nothing in time; once the new leader is elected the log must hold none of them."""

from __future__ import annotations

import asyncio
import json
import uuid
from contextlib import AsyncExitStack

import nats.errors
import pytest

from events.codec import encode
from events.schema import ActorPlaced, ActorStopped, DrainWorker, ResumeActor, StopActor, WorkerDrained
from events.subjects import WAIT_HEADER, service_subject, stream_name
from tests.factories import actor, leaders_info, read_log, step_down, version, worker
from tests.test_failover import every_service
from warmboot.client import Client
from warmboot.natsserver import NatsCluster, wait_jetstream, wait_stream_current
from warmboot.runner import connect

WAIT_MS = 800
ROUNDS = 3


@pytest.mark.timeout(300)
async def test_writes_decided_in_time_are_not_made_once_a_leader_is_elected_after_their_callers_wait(
        tmp_path, monkeypatch):
    monkeypatch.setenv("WARMBOOT_STREAM_REPLICAS", "3")
    prefix = "t" + uuid.uuid4().hex[:10]
    stream = stream_name(prefix)
    with NatsCluster(tmp_path) as cluster:
        await wait_jetstream(cluster.url)
        async with AsyncExitStack() as exits:
            await every_service(exits, cluster, prefix)  # on the first member
            nc = await connect(cluster.urls[0], "client")
            exits.push_async_callback(nc.close)
            js = nc.jetstream()
            wb = Client(nc, prefix, attempts=30)
            late: list[str] = []  # request ids sent while the stream had no leader, answered in no time
            for round_ in range(ROUNDS):
                await wb.register(worker(f"w{round_}", version("v1"), cpu=64000, mem=65536))
                await wb.create(actor(f"c{round_}", cpu=100, mem=128))  # stopped: one event
                await wb.create(actor(f"p{round_}", cpu=100, mem=128))
                await wb.resume(f"p{round_}")  # stopped: its release and ActorStopped, a grouped append
                await wb.create(actor(f"r{round_}", cpu=100, mem=128))  # resumed: the scheduler's committer
                await wait_stream_current(js, stream, 3)
                # the leader on another member than the one the services and the client use
                while (leader := (await leaders_info(js, stream)).cluster.leader) == cluster.nodes[0].name:
                    await step_down(nc, stream)
                await wait_stream_current(js, stream, 3)
                node = cluster.node(leader)
                node.kill()
                requests = [
                    (service_subject(prefix, "snapshotter", "stop", f"c{round_}"),
                     StopActor(request_id=f"stop-c{round_}")),
                    (service_subject(prefix, "snapshotter", "stop", f"p{round_}"),
                     StopActor(request_id=f"stop-p{round_}")),
                    (service_subject(prefix, "registry", "drain", f"w{round_}"),
                     DrainWorker(request_id=f"drain-w{round_}", reason="test")),
                    (service_subject(prefix, "scheduler", "resume", f"r{round_}"),
                     ResumeActor(request_id=f"resume-r{round_}")),
                ]

                async def once(subject: str, body) -> str | None:
                    try:
                        reply = await nc.request(subject, encode(body), timeout=WAIT_MS / 1000,
                                                 headers={WAIT_HEADER: str(WAIT_MS)})
                    except nats.errors.TimeoutError:
                        return body.request_id  # the caller's one attempt: no answer in its wait
                    return None if reply.headers and reply.headers.get("Nats-Service-Error-Code") else \
                        json.dumps(json.loads(reply.data))

                answers = await asyncio.gather(*(once(s, b) for s, b in requests))
                late += [a for a in answers if a is not None and not a.startswith("{")]
                await asyncio.to_thread(node.restart)
                await wait_stream_current(js, stream, 3)
                # what a replica held is decided by now: a later write of the same services is after it
                await wb.register(worker(f"w{round_}-after", version("v1")))
                await wb.create(actor(f"after{round_}", cpu=100, mem=128))
            assert late, "no request went unanswered while the stream had no leader"
            made = [e.request_id for _, e in await read_log(nc, prefix)
                    if isinstance(e, (ActorStopped, WorkerDrained, ActorPlaced)) and e.request_id in late]
            assert made == [], f"written after their callers' wait of {WAIT_MS} ms: {made} (of {late})"
