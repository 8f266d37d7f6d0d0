"""A write decided in time whose append the stream's leader does not take (killed, the election not
over: nobody takes it; or frozen, SIGSTOP, with the append in its socket) is sent again by the store
until a leader takes it (`Stream.append`'s retries, for WARMBOOT_STORE_TIMEOUT). An attempt sent after
the caller's wait (`Warmboot-Wait-Ms`) that stores what no earlier attempt stored is a first write of a
request whose caller has gone, which docs/contract.md says a replica does not make ("It is judged
again where the write goes out").

On a 3-node cluster, the snapshotter's stop of an actor (one event; of a placed actor, two: a grouped
append), the registry's drain of a worker (an event and its fence: a grouped append) and the scheduler's
resume of an actor are sent with a short wait while the stream leader is killed, or frozen for longer
than an election takes. Their callers are told nothing in time; the log must hold none of them stored
after their callers' wait. (A frozen leader that thaws before another is elected stores what its
socket held: an append already sent lands, docs/contract.md; the freeze here outlasts the election.)"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from contextlib import AsyncExitStack

import nats.errors
import pytest

from events.codec import encode
from events.schema import DrainWorker, ResumeActor, StopActor
from events.subjects import WAIT_HEADER, service_subject, stream_name
from tests.factories import actor, leaders_info, ordered_subscription, step_down, version, worker
from tests.test_failover import every_service
from warmboot.client import Client
from warmboot.natsserver import NatsCluster, wait_jetstream, wait_stream_current
from warmboot.runner import connect

WAIT_MS = 800
ROUNDS = 2
ACTORS = 6  # of each kind, a round
FROZEN_S = 12.0  # longer than the election the freeze brings about (4 to 9 s)
WRITES = {"ActorStopped", "WorkerDrained", "ActorPlaced"}


async def stored_after(nc, prefix: str, stream: str, sent_at: dict[str, float], unanswered: set[str]) -> list:
    """(request id, event type, seconds after it was sent) of each event of an unanswered request
    stored after its caller's wait, read in stream order with the time the server stored it."""
    js = nc.jetstream()
    last = (await leaders_info(js, stream)).state.last_seq
    sub = await ordered_subscription(js, f"{prefix}.ev.>", stream)
    late = []
    try:
        while True:
            msg = await sub.next_msg(timeout=10)
            body = json.loads(msg.data)
            rid = body.get("request_id")
            if body.get("type") in WRITES and rid in unanswered:
                after = msg.metadata.timestamp.timestamp() - sent_at[rid]
                if after > WAIT_MS / 1000:
                    late.append((rid, body["type"], round(after, 2)))
            if msg.metadata.sequence.stream >= last:
                return late
    finally:
        await sub.unsubscribe()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("fault", ["kill", "freeze"])
async def test_writes_decided_in_time_are_not_made_after_their_callers_wait_by_a_resend(tmp_path, monkeypatch,
                                                                                         fault):
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
            sent_at: dict[str, float] = {}
            unanswered: set[str] = set()
            answered: list[str] = []
            for round_ in range(ROUNDS):
                requests = []
                for i in range(ACTORS):
                    w, c, p, r = (f"{k}{round_}-{i}" for k in "wcpr")
                    await wb.register(worker(w, version("v1"), cpu=64000, mem=65536))
                    await wb.create(actor(c, cpu=100, mem=128))  # stopped: one event
                    await wb.create(actor(p, cpu=100, mem=128))
                    await wb.resume(p)  # stopped: its release and ActorStopped, a grouped append
                    await wb.create(actor(r, cpu=100, mem=128))  # resumed: the scheduler's committer
                    requests += [(service_subject(prefix, "snapshotter", "stop", c), StopActor(request_id=f"s-{c}")),
                                 (service_subject(prefix, "snapshotter", "stop", p), StopActor(request_id=f"s-{p}")),
                                 (service_subject(prefix, "registry", "drain", w),
                                  DrainWorker(request_id=f"d-{w}", reason="test")),
                                 (service_subject(prefix, "scheduler", "resume", r), ResumeActor(request_id=f"r-{r}"))]
                await wait_stream_current(js, stream, 3)
                # the leader on another member than the one the services and the client use
                while (leader := (await leaders_info(js, stream)).cluster.leader) == cluster.nodes[0].name:
                    try:
                        await step_down(nc, stream)
                    except AssertionError:  # refused while JetStream settles after the last fault: again
                        await wait_stream_current(js, stream, 3)
                await wait_stream_current(js, stream, 3)
                node = cluster.node(leader)
                if fault == "kill":
                    node.kill()

                async def once(n: int, subject: str, body) -> None:
                    if fault == "freeze":
                        await asyncio.sleep(n * 0.005)  # spread: some before the freeze, most after
                    sent_at[body.request_id] = time.time()
                    try:
                        reply = await nc.request(subject, encode(body), timeout=WAIT_MS / 1000,
                                                 headers={WAIT_HEADER: str(WAIT_MS)})
                    except nats.errors.TimeoutError:
                        unanswered.add(body.request_id)  # the caller's one attempt: no answer in its wait
                    else:  # answered in time, written or refused (UNAVAILABLE: a bucket during the election)
                        answered.append((reply.headers or {}).get("Nats-Service-Error-Code", "ok"))

                async def freeze() -> None:
                    await asyncio.sleep(0.02)  # the fault's moment: amid the requests' spread (jitter), not a wait
                    node.process.send_signal(signal.SIGSTOP)
                    try:
                        await asyncio.sleep(FROZEN_S)  # the fault's length: a leader elected meanwhile
                    finally:
                        node.process.send_signal(signal.SIGCONT)

                await asyncio.gather(*(once(n, s, b) for n, (s, b) in enumerate(requests)),
                                     *([freeze()] if fault == "freeze" else []))
                if fault == "kill":
                    await asyncio.to_thread(node.restart)
                await wait_stream_current(js, stream, 3)
                # what a replica held is decided by now: a later write of each service is after it
                await wb.register(worker(f"after{round_}", version("v1")))
                await wb.create(actor(f"after{round_}", cpu=100, mem=128))
                await wb.resume(f"after{round_}")
            assert unanswered, "no request went unanswered while the stream had no leader"
            late = await stored_after(nc, prefix, stream, sent_at, unanswered)
            assert late == [], f"written after their callers' wait of {WAIT_MS} ms ({len(late)} of " \
                               f"{len(unanswered)} unanswered): {late}"
