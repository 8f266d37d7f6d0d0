"""Hostile review: what a worker, client or operator credential can do to a service beyond the
non-UTF-8 fix. Each test PASSES when the service stays healthy; a FAILURE demonstrates a problem.

Every test runs against a fresh secured deployment (`warmboot serve all` as a child process,
the generated permissions), since several attacks end the deployment's connection.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from events.codec import encode
from events.errors import ContractError
from events.natspy import flush_in_order
from events.schema import Assignment, ResumeActor, DrainWorker, ExplainResume, Explanation, Heartbeat, HeartbeatReply, RegisterReply, SeqReply
from services.common import call
from tests.registry_helpers import registration
from tests.secured_helpers import Secured, Serve
from tests.test_security import PREFIX, WORKERS, Deployment, create_body, serve_args, sub


@pytest.fixture
async def fresh(tmp_path, request):
    only = getattr(request, "param", "all")  # `warmboot serve <only>`
    secured = Secured(tmp_path / "secured", PREFIX, workers=WORKERS, operators=("ops",), clients=("orch",)).start()
    serve = Serve(only, *serve_args(secured, "--ttl", "300")[1:])
    await asyncio.to_thread(serve.start)
    d = await Deployment(secured, serve).open()
    for worker_id, node in (("w-1", "node-a"), ("w-2", "node-b")):
        await call(d.conns[worker_id].nc, sub("registry", "register", worker_id), registration(worker_id, node=node),
                   RegisterReply)
    if only == "all":
        await call(d.orch.nc, sub("snapshotter", "create", "a-1"), create_body("a-1"), SeqReply)
    try:
        yield d
    finally:
        for conn in d.conns.values():
            await conn.close()
        await asyncio.to_thread(serve.stop)
        secured.stop()
        print("SERVE:", *serve.output.splitlines()[-30:], sep="\n")
        print("SERVER:", *[l for l in secured.server.log if "rror" in l or "Payload" in l or "iolation" in l or "Slow" in l or "Stale" in l], sep="\n")


async def answered_within(d: Deployment, seconds: float) -> bool:
    """Whether w-2's heartbeat is answered within `seconds` (retrying a refusal such as 'no responders')."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            await call(d.w_2.nc, sub("registry", "heartbeat", "w-2"), Heartbeat(), HeartbeatReply,
                       timeout=max(0.5, min(3.0, deadline - time.monotonic())))
            return True
        except ContractError:
            await asyncio.sleep(0.2)
    return False


# --- 1. $SRV.INFO / $SRV.STATS echo the request's headers: a big header block makes the answer
# exceed max_payload; the server closes the services' connection with -ERR 'Maximum Payload
# Violation', and nats-py's _process_err closes the client for good (no reconnect).


async def under_load(d: Deployment, attack, seconds: float = 4.0) -> list[BaseException]:
    """w-1's heartbeats, 10 in flight, for `seconds`; `attack()` once 0.5 s in: the ones that failed."""
    failures: list[BaseException] = []
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds

    async def lane() -> None:
        while loop.time() < end:
            try:
                await call(d.w_1.nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply, timeout=3)
            except ContractError as error:
                failures.append(error)
                await asyncio.sleep(0.05)

    lanes = [asyncio.create_task(lane()) for _ in range(10)]
    await asyncio.sleep(0.5)
    await attack()
    await asyncio.gather(*lanes)
    return failures


@pytest.mark.parametrize("user", ["orch", "ops"])
@pytest.mark.parametrize("verb", ["INFO", "STATS"])
async def test_a_discovery_request_with_a_big_header_block_does_not_end_the_services_connection(fresh, user, verb):
    d = fresh
    nc = d.conns[user].nc
    big = {"X": "a" * (nc.max_payload - 200)}  # allowed: headers + body <= max_payload

    async def attack() -> None:
        await nc.publish(f"$SRV.{verb}", b"", reply=nc.new_inbox(), headers=big)
        await nc.flush()

    failed = await under_load(d, attack)
    closed = False
    for _ in range(4):  # again: each time the connection is either re-made or closed for good
        if not await answered_within(d, 10):
            closed = True
            break
        await attack()
        await asyncio.sleep(1)
    tail = "\n".join(d.serve.output.splitlines()[-12:])
    assert not closed, "the services no longer answer at all (their connection is closed for good):\n" + tail
    assert not failed, f"{len(failed)} requests failed around one attack ({failed[0]!r}):\n" + tail


@pytest.mark.parametrize("fresh", ["registry"], indirect=True)
async def test_a_big_header_block_on_srv_info_does_not_close_a_registry_process_for_good(fresh):
    """`warmboot serve registry`: one micro service on the connection; nats-py reads the server's
    -ERR 'Maximum Payload Violation' and closes the connection (no reconnect); the process runs on."""
    d = fresh
    nc = d.orch.nc
    await nc.publish("$SRV.INFO", b"", reply=nc.new_inbox(), headers={"X": "a" * (nc.max_payload - 200)})
    await nc.flush()
    await asyncio.sleep(3)
    alive = await answered_within(d, 20)
    running = d.serve.process.poll() is None
    assert alive, f"the registry never answers again (process still running: {running}):\n" + "\n".join(
        d.serve.output.splitlines()[-8:])


# --- 2. A reply subject (or subject) with \x0b or \x0c: nats-server splits protocol arguments on
# space, tab, CR and LF only, nats-py's parser (MSG_RE, `\s`) and `_Frames` (bytes.split()) also
# on VT and FF. _Frames sees 5 arguments, hands the rest of the read to nats-py, which cannot
# match it: ProtocolError -> the connection is dropped and re-made (what it was sent is lost);
# with >= 4096 bytes buffered nats-py does not raise but waits for more, for good: deaf.


def _pub(subject: bytes, reply: bytes, body: bytes) -> bytes:
    return b"PUB %s %s %d\r\n%s\r\n" % (subject, reply, len(body), body)


async def test_a_reply_subject_with_a_form_feed_does_not_drop_what_the_services_were_sent(fresh):
    d = fresh
    nc = d.w_1.nc
    await flush_in_order(nc)
    # a request w-1 may send: its own heartbeat, with a reply subject of its choosing
    nc._transport.write(_pub(sub("registry", "heartbeat", "w-1").encode(), b"_INBOX.w-1.a\x0cb", b"{}"))
    # right behind it, a good request from the same worker
    pending = [asyncio.create_task(call(nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply,
                                        timeout=5)) for _ in range(20)]
    results = await asyncio.gather(*pending, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of 20 requests behind it failed: {failed[0]!r}\n" + "\n".join(
        d.serve.output.splitlines()[-10:])


async def test_a_client_subject_with_a_vertical_tab_does_not_drop_the_services_connection(fresh):
    d = fresh
    nc = d.orch.nc
    await flush_in_order(nc)
    nc._transport.write(_pub(sub("scheduler", "explain", "a").encode() + b"\x0b1", b"_INBOX.orch.x", b"{}"))
    pending = [asyncio.create_task(call(d.w_1.nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply,
                                        timeout=5)) for _ in range(20)]
    results = await asyncio.gather(*pending, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of 20 requests failed: {failed[0]!r}"


async def test_a_big_request_with_a_form_feed_in_its_reply_does_not_deafen_the_services(fresh):
    d = fresh
    nc = d.w_1.nc
    await flush_in_order(nc)
    nc._transport.write(_pub(sub("registry", "heartbeat", "w-1").encode(), b"_INBOX.w-1.a\x0cb",
                             b"{}" + b" " * 6000))
    await asyncio.sleep(1)
    assert await answered_within(d, 20), "deaf for 20 s:\n" + "\n".join(d.serve.output.splitlines()[-10:])


# --- 3. Starving other callers.


async def test_an_operator_cannot_hold_every_scheduler_slot_with_unreachable_min_seq(fresh):
    """explain waits up to catch_up_s (5 s) for min_seq, holding one of the scheduler's 256 slots;
    nothing bounds min_seq by the log's last sequence."""
    d = fresh
    ops = d.ops.nc
    body = encode(ExplainResume(min_seq=2 ** 53))
    inbox = ops.new_inbox()
    for _ in range(5000):  # the scheduler serves 4096 at once
        await ops.publish(sub("scheduler", "explain", "a-1"), body, reply=inbox)
    await ops.flush()
    await asyncio.sleep(0.5)
    started = time.monotonic()
    # the client's resume of a-1 (another endpoint): placed on w-1 or w-2 in milliseconds, unless starved
    await call(d.orch.nc, sub("scheduler", "resume", "a-1"), ResumeActor(), Assignment, timeout=15)
    took = time.monotonic() - started
    assert took < 2.0, f"a client's resume waited {took:.1f}s behind an operator's 5000 explains"


async def test_one_worker_serialised_on_its_own_lock_does_not_starve_other_workers(fresh):
    """register/drain/remove of one worker are decided one at a time (KeyedLock), each holding a
    registry slot while it waits for the lock: a burst about one worker holds all 256 slots."""
    d = fresh
    w1 = d.w_1.nc
    inbox = w1.new_inbox()
    got = []
    t0 = time.monotonic()

    async def answered(_msg) -> None:
        got.append(time.monotonic() - t0)

    await w1.subscribe(inbox, cb=answered)
    for i in range(1500):
        await w1.publish(sub("registry", "drain", "w-1"), encode(DrainWorker(reason="r", request_id=f"r{i}")),
                         reply=inbox)
    await w1.flush()
    await asyncio.sleep(0.5)
    started = time.monotonic()
    await call(d.w_2.nc, sub("registry", "heartbeat", "w-2"), Heartbeat(), HeartbeatReply, timeout=30)
    took = time.monotonic() - started
    await asyncio.sleep(3)
    print(f"w-2 heartbeat took {took:.2f}s; w-1 drains answered: {len(got)}, last at {got[-1] if got else None}")
    assert took < 2.0, f"w-2's heartbeat waited {took:.1f}s behind w-1's 1500 drains of itself"


async def test_an_unregistered_worker_flooding_heartbeats_does_not_starve_other_services(fresh):
    """A heartbeat of a worker the roster does not have reads the log in a thread (require_alive)
    and again at the leader (recheck): the default executor (min(32, cpus + 4) threads) is shared
    by every service of the process."""
    d = fresh
    w3 = await d.secured.connect("w-3")
    try:
        inbox = w3.nc.new_inbox()
        for _ in range(3000):
            await w3.nc.publish(sub("registry", "heartbeat", "w-3"), b"{}", reply=inbox)
        await w3.nc.flush()
        await asyncio.sleep(0.5)
        started = time.monotonic()
        await call(d.orch.nc, sub("snapshotter", "create", "a-9"), create_body("a-9"), SeqReply, timeout=60)
        took = time.monotonic() - started
    finally:
        await w3.close()
    assert took < 2.0, f"a client's create waited {took:.1f}s behind w-3's 3000 heartbeats"


# --- 4. Memory: events.natspy.parse_header_lines keeps every distinct header line it parsed
# (up to 4096 lines, of any length) in the module-level `_lines` table; `_Core.take` parses a
# request's headers with it before the reply guard runs.


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_header_lines_a_worker_sends_are_not_kept(fresh):
    d = fresh
    nc = d.w_1.nc
    pid = d.serve.process.pid
    await call(nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply)
    before = rss_mb(pid)
    for i in range(200):  # 200 requests of ~1 MB each, each with one distinct header line
        await nc.publish(sub("registry", "heartbeat", "w-1"), b"{}", reply=nc.new_inbox(),
                         headers={"X": f"{i:08d}" + "a" * (nc.max_payload - 300)})
        if i % 20 == 19:
            await nc.flush()
    await nc.flush()
    await asyncio.sleep(3)
    await call(nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply, timeout=30)
    after = rss_mb(pid)
    assert after - before < 100, f"the services' process grew from {before:.0f} MB to {after:.0f} MB and keeps it"


# --- 5. Log flood: nats.micro's $SRV handlers answer with the request's own headers
# (`Msg.respond(data)` publishes `headers=self.headers`); a header name nats-py reads but will not
# write (not in _HEADER_KEY_RE, e.g. `a(b`) raises BadHeaderError in the handler, logged with a
# traceback by nats-py's default error callback, per message and per service, unthrottled.


async def test_discovery_requests_do_not_flood_the_services_log(fresh):
    d = fresh
    nc = d.orch.nc
    await asyncio.sleep(1)
    lines = len(d.serve.output.splitlines())
    head = b"NATS/1.0\r\na(b: 1\r\n\r\n"
    await flush_in_order(nc)
    for _ in range(100):  # nats-py will not send that header: written raw
        nc._transport.write(b"HPUB $SRV.PING _INBOX.orch.x %d %d\r\n%s\r\n" % (len(head), len(head), head))
    await flush_in_order(nc)
    await asyncio.sleep(3)
    grown = len(d.serve.output.splitlines()) - lines
    assert grown < 20, f"100 pings wrote {grown} log lines:\n" + "\n".join(d.serve.output.splitlines()[-12:])


# --- 6. Writes without bound: nothing limits how often a worker may change its registration;
# each change is a WorkerUpdated event plus a fence, appended to a stream that never discards and
# folded by every registry and scheduler replica.


async def test_a_worker_cannot_grow_the_log_without_bound(fresh):
    from tests.factories import last_seq

    d = fresh
    nc = d.w_1.nc
    before = await last_seq(d.svc.nc, PREFIX)
    pending = [call(nc, sub("registry", "register", "w-1"), registration("w-1", labels={"n": str(i)}), RegisterReply,
                    timeout=30) for i in range(300)]
    await asyncio.gather(*pending, return_exceptions=True)
    grown = await last_seq(d.svc.nc, PREFIX) - before
    assert grown < 50, f"300 registrations of one worker appended {grown} messages to the log"


# --- 7. CPU in the read loop: a request's header block is parsed (line by line, into the `_lines`
# table) synchronously in the connection's read loop before anything looks at the reply subject;
# ~0.1 s per 1 MB block of short distinct lines.


async def test_big_header_blocks_do_not_stall_the_services_read_loop(fresh):
    d = fresh
    nc = d.w_1.nc
    head = b"NATS/1.0\r\n" + b"".join(b"h%d:v\r\n" % i for i in range(120000))
    head = head[: head.rindex(b"\r\n", 0, nc.max_payload - 100) + 2] + b"\r\n"  # ~1 MB, within max_payload
    frame = b"HPUB %s %d %d\r\n%s{}\r\n" % (sub("registry", "heartbeat", "w-1").encode(), len(head), len(head) + 2,
                                              head)  # built once: the test's own loop stays free

    async def flood() -> None:
        await flush_in_order(nc)
        for _ in range(60):  # no reply subject: each is dropped unanswered, after its headers are parsed
            nc._transport.write(frame)
            await nc._transport.drain()

    task = asyncio.create_task(flood())
    await asyncio.sleep(0.5)
    started = time.monotonic()
    try:
        await call(d.w_2.nc, sub("registry", "heartbeat", "w-2"), Heartbeat(), HeartbeatReply, timeout=30)
    except ContractError as refused:
        pytest.fail(f"w-2's heartbeat was refused after {time.monotonic() - started:.1f}s: {refused}")
    took = time.monotonic() - started
    await task
    assert took < 1.0, f"w-2's heartbeat took {took:.1f}s behind 60 requests with big header blocks and no reply"


async def test_control_big_bodies_without_headers_do_not_stall_the_services_read_loop(fresh):
    """Control for 7: the same bytes as bodies, no header block."""
    d = fresh
    nc = d.w_1.nc
    body = b" " * (nc.max_payload - 100)
    frame = b"PUB %s %d\r\n%s\r\n" % (sub("registry", "heartbeat", "w-1").encode(), len(body), body)

    async def flood() -> None:
        await flush_in_order(nc)
        for _ in range(60):
            nc._transport.write(frame)
            await nc._transport.drain()

    task = asyncio.create_task(flood())
    await asyncio.sleep(0.5)
    started = time.monotonic()
    await call(d.w_2.nc, sub("registry", "heartbeat", "w-2"), Heartbeat(), HeartbeatReply, timeout=30)
    took = time.monotonic() - started
    await task
    assert took < 1.0, f"w-2's heartbeat took {took:.1f}s behind 60 big bodies"
