"""The shared service shell (services.endpoints; what it leans on: services.replies, streams, process)
over a real bus: who is answered, how an
error is sent and counted, what `$SRV.STATS` and `$SRV.INFO` say, and that an outage of
the store, a bucket or the bus is UNAVAILABLE for every service, never INTERNAL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
from contextlib import AsyncExitStack

import nats
import nats.errors
import nats.js.errors
import pytest
from eventsourcing.persistence import IntegrityError, OperationalError

from events.codec import encode
from events.errors import ContractError, not_found
from events.jetstream import StoreUnavailableError
from events.schema import (
    Assignment,
    CreateActor,
    DrainWorker,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    RegisterReply,
    Resources,
    ResumeActor,
    SeqReply,
)
from events.subjects import event_subject, service_subject, stream_name
from services import deadline
from services.endpoints import EndpointSpec, OutageLog, add_endpoints, call, is_outage
from services.process import EVENT_LOOP_ENV, run_serving, serving_loop
from services.replies import ReplyCache
from tests.factories import SILENT_TTL_S, started_once_members_are_back, unanswered_noted
from tests.registry_helpers import registration
from warmboot.natsserver import NatsCluster, wait_jetstream
from warmboot.runner import DUMP_HEADER, SERVICES, start_services, stop_signals

# --- which errors are outages (pure) ------------------------------------------------------------


@pytest.mark.parametrize("error", [
    OperationalError("store"), StoreUnavailableError("no answer for 30s"), nats.errors.TimeoutError(),
    nats.errors.NoRespondersError(), nats.errors.ConnectionClosedError(), nats.errors.ConnectionReconnectingError(),
    nats.js.errors.ServiceUnavailableError(code=503, description="JetStream system temporarily unavailable"),
    nats.js.errors.ServerError(code=500), nats.js.errors.NoStreamResponseError(), asyncio.TimeoutError(),
    ConnectionResetError(),
])
def test_an_outage_is_told_apart_from_a_bug(error):
    assert is_outage(error)


@pytest.mark.parametrize("error", [
    ValueError(), KeyError("x"), AttributeError(), IntegrityError(), nats.errors.BadSubjectError(),
    nats.js.errors.BadRequestError(code=400, description="bad request"), nats.js.errors.NotFoundError(code=404),
    nats.js.errors.KeyWrongLastSequenceError(),
])
def test_a_bug_is_no_outage(error):
    assert not is_outage(error)


def test_an_outage_is_logged_once_per_interval_with_a_count_of_the_rest(caplog):
    log = logging.getLogger("warmboot.test-outages")
    outages = OutageLog(log, "doing the thing")
    with caplog.at_level(logging.WARNING, logger="warmboot.test-outages"):
        for _ in range(3):
            outages.seen(nats.errors.TimeoutError())
        outages.next_at = 0.0  # the interval (OUTAGE_LOG_S) is over
        outages.seen(StoreUnavailableError("no answer for 30s"))
    assert [r.getMessage() for r in caplog.records] == [
        "doing the thing: TimeoutError()",
        "doing the thing: StoreUnavailableError('no answer for 30s') (and 2 more since the last line)",
    ]


# --- a test service on the real bus --------------------------------------------------------------


class Probe:
    """Handlers that answer, refuse, fail as a bug or as an outage, or wait to be released."""

    def __init__(self):
        self.calls = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def answer(self, entity_id: str, request: Heartbeat) -> HeartbeatReply:
        self.calls += 1
        if entity_id == "missing":
            raise not_found(f"no {entity_id}\r\nX-Injected: 1", "worker_id")
        if entity_id == "bug":
            raise KeyError("a bug")
        if entity_id == "outage":
            raise StoreUnavailableError("the event store did not answer for 30s")
        if entity_id == "slow":
            self.started.set()
            await self.release.wait()
        return HeartbeatReply(ttl_s=1.0)


@pytest.fixture
async def probe(nc, prefix):
    handlers = Probe()
    micro = await add_endpoints(nc, prefix, "probe", "a test service", [
        EndpointSpec("answer", Heartbeat, handlers.answer),
        EndpointSpec("listed", Heartbeat, handlers.answer, per_entity=False, reply_type=SeqReply),
    ])
    yield handlers
    await micro.stop()


async def stats(nc, name: str) -> dict[str, dict]:
    reply = await nc.request(f"$SRV.STATS.{name}", b"", timeout=10)
    return {e["name"]: e for e in json.loads(reply.data)["endpoints"]}


async def test_a_service_stopped_after_its_connection_closed_leaves_its_loop_s_ticker(nats_url, prefix):
    """A service's stop raises when its connection closed first (nothing left to unsubscribe: the
    snapshotter's stop swallows it). It left its loop's ticker counting it as a user, ticking and, at a
    stall, pinging its closed connection for good (found as a ticker outliving its test)."""
    from services import deadline

    async def answer(entity_id: str, request: Heartbeat) -> HeartbeatReply:
        return HeartbeatReply(ttl_s=1.0)

    loop = asyncio.get_running_loop()
    before = deadline.ticker_of(loop)
    users = before.users if before is not None else 0
    conn = await nats.connect(nats_url)
    micro = await add_endpoints(conn, prefix, "probe", "a test service", [EndpointSpec("answer", Heartbeat, answer)])
    assert deadline.ticker_of(loop).users == users + 1 and conn in deadline.ticker_of(loop).connections
    await conn.close()
    with contextlib.suppress(Exception):
        await micro.stop()
    after = deadline.ticker_of(loop)
    assert (after.users if after is not None else 0) == users
    assert after is None or conn not in after.connections


async def test_errors_go_out_as_micro_error_replies_with_the_contract_body(nc, prefix, probe):
    msg = await nc.request(service_subject(prefix, "probe", "answer", "missing"), b"{}", timeout=10)
    assert msg.headers["Nats-Service-Error-Code"] == "404"
    assert msg.headers["Nats-Service-Error"] == "no missing  X-Injected: 1"  # one header line, nothing injected
    assert "X-Injected" not in msg.headers
    assert json.loads(msg.data) == {"error": {"code": "NOT_FOUND", "message": "no missing\r\nX-Injected: 1",
                                              "field": "worker_id"}}


async def test_a_bug_is_internal_with_a_logged_traceback_and_an_outage_unavailable(nc, prefix, probe, caplog):
    with caplog.at_level(logging.WARNING, logger="warmboot.service"):
        bug = await nc.request(service_subject(prefix, "probe", "answer", "bug"), b"{}", timeout=10)
        outage = await nc.request(service_subject(prefix, "probe", "answer", "outage"), b"{}", timeout=10)
    assert json.loads(bug.data)["error"]["code"] == "INTERNAL" and bug.headers["Nats-Service-Error-Code"] == "500"
    assert "KeyError" not in bug.data.decode()
    assert json.loads(outage.data)["error"]["code"] == "UNAVAILABLE"
    assert outage.headers["Nats-Service-Error-Code"] == "503"
    [traceback] = [r for r in caplog.records if r.exc_info]
    assert traceback.exc_info[0] is KeyError and "probe.answer failed" in traceback.getMessage()
    assert any("answered UNAVAILABLE" in r.getMessage() for r in caplog.records)


async def test_stats_count_requests_errors_and_the_time_until_the_reply(nc, prefix, probe):
    def subject(entity: str) -> str:
        return service_subject(prefix, "probe", "answer", entity)

    for entity, body in (("w-1", b"{}"), ("w-2", b"{}"), ("missing", b"{}"), ("bug", b"{}"), ("w-3", b"[1]")):
        await nc.request(subject(entity), body, timeout=10)
    slow = asyncio.ensure_future(nc.request(subject("slow"), b"{}", timeout=10))
    await probe.started.wait()
    # the service's clock (services.deadline.now_ns), not the loop's: uvloop's loop.time() is the time of the
    # loop's iteration, to the millisecond, and overstated this interval by up to a millisecond
    started = deadline.now_ns()
    await asyncio.sleep(0.2)  # the handler's own work, which STATS must count: not a wait for a condition
    # the handler was under way from before `started` until after the release (it cannot
    # reply before): a lower bound of its processing time, whatever the reply's way back costs
    waited_ns = deadline.now_ns() - started
    probe.release.set()
    await slow

    answer = (await stats(nc, "warmboot-probe"))["answer"]
    assert answer["num_requests"] == 6  # w-1, w-2, missing, bug, the invalid body, slow
    assert answer["num_errors"] == 3  # missing, bug, the invalid body
    assert answer["last_error"] == "400:INVALID_ARGUMENT"  # the code, never the message: it may quote the caller
    assert answer["processing_time"] >= waited_ns
    assert answer["average_processing_time"] == answer["processing_time"] // 6


async def test_only_inbox_replies_are_processed(nc, prefix, probe):
    subject = service_subject(prefix, "probe", "answer", "w-1")
    for reply in (None, f"{prefix}.registry.drain.w-2", "$KV.X.y", "INBOX.x", f"_INBOX._{prefix}.own"):
        await nc.publish(subject, b"{}", reply=reply or "")
    msg = await nc.request(subject, b"{}", timeout=10)  # the same subscription, after them
    assert json.loads(msg.data) == {"ttl_s": 1.0, "drained": None}
    assert probe.calls == 1
    assert (await stats(nc, "warmboot-probe"))["answer"]["num_requests"] == 1


async def test_a_reply_subject_that_only_begins_like_an_inbox_is_not_answered(nc, prefix, probe):
    """`_INBOX.` and `_R_.` are prefixes up to their dot: `_INBOXES.x`, `_INBOX_w-2.x`, `_R_x.y` are
    no inbox (the services' user may not publish there under the generated permissions, so
    answering them would have it commit a permission violation at a worker's will). None is
    served nor answered, each is counted `not_inbox`, and the next request is served. Kills the
    mutants of `REPLY_PREFIXES` without the dot of `_INBOX.` or of `_R_.`."""
    from prometheus_client import REGISTRY

    heard: list[str] = []

    async def spy(msg) -> None:
        heard.append(msg.subject)

    subject = service_subject(prefix, "probe", "answer", "w-1")
    replies = ("_INBOXES.x", "_INBOX_w-2.x", "_R_x.y")
    spies = [await nc.subscribe(reply, cb=spy) for reply in replies]

    def dropped() -> float:
        return REGISTRY.get_sample_value("warmboot_requests_dropped_total",
                                         {"service": "probe", "endpoint": "answer", "reason": "not_inbox"}) or 0.0

    before = dropped()
    for reply in replies:
        await nc.publish(subject, b"{}", reply=reply)
    msg = await nc.request(subject, b"{}", timeout=10)  # the same subscription, after them
    assert json.loads(msg.data) == {"ttl_s": 1.0, "drained": None}
    await nc.flush()  # anything answered to the spies before that answer has arrived too
    for s in spies:
        await s.unsubscribe()
    assert probe.calls == 1 and heard == []
    assert dropped() == before + len(replies)


async def test_a_request_that_waited_for_a_slot_is_checked_as_one_that_did_not(nc, prefix):
    """With every slot of an endpoint taken, its requests wait in the subscription's queue and
    reach the service by nats-py's path, not the direct one: the reply rule holds there too.
    A request with no reply subject, or one aimed at another worker's drain, queued behind a
    slow request, is neither processed nor answered; the good request queued after them is.
    Kills the mutant of `ConcurrentEndpoint._handle_request` that serves without `admits`."""
    gate, started = asyncio.Event(), asyncio.Event()
    served: list[str] = []

    async def answer(entity_id: str, request: Heartbeat) -> HeartbeatReply:
        served.append(entity_id)
        if entity_id == "slow":
            started.set()
            await gate.wait()
        return HeartbeatReply(ttl_s=1.0)

    heard: list[str] = []

    async def spy(msg) -> None:
        heard.append(msg.subject)

    target = service_subject(prefix, "registry", "drain", "w-2")
    watch = await nc.subscribe(target, cb=spy)
    micro = await add_endpoints(nc, prefix, "one", "one at a time", [EndpointSpec("answer", Heartbeat, answer)],
                                max_concurrent=1)
    try:
        slow = asyncio.ensure_future(nc.request(service_subject(prefix, "one", "answer", "slow"), b"{}", timeout=30))
        await asyncio.wait_for(started.wait(), 30)  # the only slot is held
        await nc.publish(service_subject(prefix, "one", "answer", "w-1"), b"{}")  # no reply subject
        await nc.publish(service_subject(prefix, "one", "answer", "w-1"), b"{}", reply=target)
        good = asyncio.ensure_future(nc.request(service_subject(prefix, "one", "answer", "w-3"), b"{}", timeout=30))
        await nc.flush()  # the service's connection is this one: it has read all three, queued behind the slot
        assert micro.endpoint_slots["answer"].free == 0
        gate.set()
        assert json.loads((await good).data) == {"ttl_s": 1.0, "drained": None}
        await slow
        await nc.flush()  # anything answered to the target before the good answer has arrived too
    finally:
        gate.set()
        await micro.stop()
        await watch.unsubscribe()
    assert served == ["slow", "w-3"] and heard == []


async def test_an_answer_carries_none_of_the_requests_headers(nc, prefix, probe):
    """An answer is published with the services' rights: it carries the contract's body and, for an
    error, micro's two error headers, never a header the caller chose (a `Nats-Trace-Dest` echoed
    into an answer would have the server send a trace wherever the services may publish). Kills
    the mutant of `ServiceRequest.respond` that sends the request's headers back with the answer."""
    subject = service_subject(prefix, "probe", "answer", "w-1")
    chosen = {"X-Echo": "1", "Nats-Msg-Id": "chosen"}
    answer = await nc.request(subject, b"{}", headers=chosen, timeout=10)
    assert json.loads(answer.data) == {"ttl_s": 1.0, "drained": None} and not answer.headers
    refused = await nc.request(service_subject(prefix, "probe", "answer", "missing"), b"{}", headers=chosen,
                               timeout=10)
    assert set(refused.headers) == {"Nats-Service-Error", "Nats-Service-Error-Code"}


async def test_info_names_each_endpoints_request_and_reply_schema(nc, prefix, probe):
    info = json.loads((await nc.request("$SRV.INFO.warmboot-probe", b"", timeout=10)).data)
    assert info["metadata"] == {"prefix": prefix}
    endpoints = {e["name"]: e["metadata"] for e in info["endpoints"]}
    assert endpoints == {"answer": {"request": "Heartbeat", "reply": "HeartbeatReply"},
                         "listed": {"request": "Heartbeat", "reply": "SeqReply"}}


async def test_every_service_endpoint_names_its_schemas(nc, prefix, stack):
    inbox = nc.new_inbox()
    answers = await nc.subscribe(inbox)
    await nc.publish("$SRV.INFO", b"", reply=inbox)
    seen = {}
    while len(seen) < 3:
        info = json.loads((await answers.next_msg(timeout=10)).data)
        if info["metadata"].get("prefix") == prefix:
            seen[info["name"]] = {e["name"]: e["metadata"] for e in info["endpoints"]}
    await answers.unsubscribe()
    assert seen["warmboot-registry"]["register"] == {"request": "RegisterWorker", "reply": "RegisterReply"}
    assert seen["warmboot-scheduler"]["resume"] == {"request": "ResumeActor", "reply": "Assignment"}
    for name, endpoints in seen.items():
        for verb, meta in endpoints.items():
            assert set(meta) == {"request", "reply"}, (name, verb, meta)


async def test_the_real_services_count_their_error_replies(nc, prefix, stack):
    for worker_id in ("nobody-1", "nobody-2"):
        with pytest.raises(ContractError):
            await call(nc, service_subject(prefix, "registry", "heartbeat", worker_id), Heartbeat(), HeartbeatReply)
    await call(nc, service_subject(prefix, "registry", "register", "w-1"), registration("w-1"), RegisterReply)
    await call(nc, service_subject(prefix, "registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply)
    # other tests' registries may answer too: take this deployment's (its metadata names the prefix)
    inbox = nc.new_inbox()
    answers = await nc.subscribe(inbox)
    await nc.publish("$SRV.STATS.warmboot-registry", b"", reply=inbox)
    mine = None
    while mine is None:
        data = json.loads((await answers.next_msg(timeout=10)).data)
        if data["metadata"].get("prefix") == prefix:
            mine = {e["name"]: e for e in data["endpoints"]}
    await answers.unsubscribe()
    assert mine["heartbeat"]["num_requests"] == 3 and mine["heartbeat"]["num_errors"] == 2
    # the code, never the message: STATS answers every client and operator, and the message quotes the worker's id
    assert mine["heartbeat"]["last_error"] == "404:NOT_FOUND"
    assert mine["register"]["num_requests"] == 1 and mine["register"]["num_errors"] == 0


async def test_without_permissions_the_services_still_answer_nothing_but_inboxes(nc, prefix, stack):
    """The reply check alone (an unsecured server, services with every right): a worker's
    heartbeat whose reply names another worker's drain drains nothing."""
    for worker_id in ("w-1", "w-2"):
        await call(nc, service_subject(prefix, "registry", "register", worker_id), registration(worker_id),
                   RegisterReply)
    js = nc.jetstream()
    before = (await js.stream_info(stream_name(prefix))).state.last_seq
    heartbeat = service_subject(prefix, "registry", "heartbeat", "w-1")
    for target in (service_subject(prefix, "registry", "drain", "w-2"), service_subject(prefix, "registry", "remove", "w-2"),
                   event_subject(prefix, "worker", "w-2")):
        await nc.publish(heartbeat, encode(Heartbeat()), reply=target)
    await call(nc, heartbeat, Heartbeat(), HeartbeatReply)
    # drain w-2 for real: its history's next event is this drain, nothing in between
    drained = await call(nc, service_subject(prefix, "registry", "drain", "w-2"), DrainWorker(reason="mine"), SeqReply)
    assert drained.seq == before + 1


# --- an outage: JetStream without quorum, core NATS still routing ---------------------------------------


@pytest.mark.timeout(240)
async def test_a_store_that_does_not_answer_is_unavailable_for_every_service(tmp_path, prefix, monkeypatch, caplog):
    monkeypatch.setenv("WARMBOOT_STORE_TIMEOUT", "2")  # the event store gives up after 2 s
    cluster = NatsCluster(tmp_path, 3)
    await asyncio.to_thread(cluster.start)
    try:
        await wait_jetstream(cluster.url)
        async with AsyncExitStack() as stack:
            # a reply cache bucket with one replica: the node that holds it will be gone
            monkeypatch.setenv("WARMBOOT_STREAM_REPLICAS", "1")
            probe_nc = await nats.connect(cluster.url.split(","))
            stack.push_async_callback(probe_nc.close)
            cache = await ReplyCache(probe_nc, prefix + "-probe").start()
            holder = (await probe_nc.jetstream().stream_info(f"KV_{cache.bucket}")).cluster.leader
            survivor = next(node for node in cluster.nodes if node.name != holder)
            monkeypatch.setenv("WARMBOOT_STREAM_REPLICAS", "3")  # the services' streams on all three nodes

            # services and the client stay on the node that survives
            await start_services(stack, list(SERVICES), survivor.url, prefix,
                                 options={"scheduler": {"catch_up_s": 2.0}, "registry": {"ttl_s": SILENT_TTL_S}})
            nc = await nats.connect(survivor.url)
            stack.push_async_callback(nc.close)
            await call(nc, service_subject(prefix, "registry", "register", "w-1"), registration("w-1"), RegisterReply)
            create = CreateActor(actor_id="a-1", sandbox_class="gvisor", template_uid="t",
                                 resources=Resources(cpu_millis=100, memory_mib=64))
            await call(nc, service_subject(prefix, "snapshotter", "create", "a-1"), create, SeqReply)

            async def read_cache(entity_id: str, request: Heartbeat) -> HeartbeatReply:  # as the scheduler's long tail
                await cache.get(cache.key("probe", entity_id))
                return HeartbeatReply(ttl_s=0.0)

            micro = await add_endpoints(nc, prefix, "probe", "reads a reply cache",
                                        [EndpointSpec("read", Heartbeat, read_cache)])
            stack.push_async_callback(micro.stop)
            assert await call(nc, service_subject(prefix, "probe", "read", "r-0"), Heartbeat(), HeartbeatReply)

            for node in cluster.nodes:  # two of three gone, the bucket's holder among them: no quorum
                if node is not survivor:
                    await asyncio.to_thread(node.kill)

            requests = [
                ("registry", "heartbeat", "w-1", Heartbeat(), HeartbeatReply),
                ("registry", "drain", "w-1", DrainWorker(reason="x"), SeqReply),
                ("snapshotter", "create", "a-2", CreateActor(actor_id="a-2", sandbox_class="gvisor", template_uid="t",
                                                             resources=Resources(cpu_millis=100, memory_mib=64)),
                 SeqReply),
                ("scheduler", "resume", "a-1", ResumeActor(request_id="r-1"), Assignment),
                ("probe", "read", "r-1", Heartbeat(), HeartbeatReply),  # a key-value read nobody answers
            ]
            with caplog.at_level(logging.WARNING, logger="warmboot.service"):
                for service, verb, entity, body, _ in requests:
                    # the service itself answers (a client-side time-out would fail here, not pass as UNAVAILABLE)
                    msg = await nc.request(service_subject(prefix, service, verb, entity), encode(body), timeout=30)
                    error = json.loads(msg.data).get("error") or {}
                    assert error.get("code") == "UNAVAILABLE", (service, verb, msg.data)
                    assert msg.headers["Nats-Service-Error-Code"] == "503"
            messages = [r.getMessage() for r in caplog.records]
            # how JetStream says it (a time-out, no responders, a 503) depends on the moment: all are outages
            assert [m for m in messages if m.startswith("probe.read: answered UNAVAILABLE: ")], messages
            # no traceback of the services: nothing taken for a bug
            assert not [r for r in caplog.records if r.exc_info and r.name.startswith("warmboot")]
    finally:
        await asyncio.to_thread(cluster.stop)


# --- metrics other hosts can scrape ------------------------------------------------------------------


def listening_on(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp and tcp6 write them) of the sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if int(hex_port, 16) == port and state == "0A":  # LISTEN
                found.add(address)
    return found


async def test_stop_signals_handle_a_dump_and_a_stop_from_the_moment_they_are_entered(capfd):
    """`warmboot serve|up` dump on SIGUSR1 from their start, and enter `stop_signals` before they
    say they serve: a SIGUSR1 or a stop sent as soon as that line is read meets the handlers,
    not the default action (the SIGUSR1 of test_serve_serves_metrics... once ended `warmboot
    serve` with -10, when the handlers came after that line)."""
    with stop_signals() as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.wait_for(stop.wait(), 10)
    assert f"{DUMP_HEADER}: end" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own again


async def test_serve_serves_metrics_on_every_interface_and_up_on_loopback(nats_url, prefix):
    import socket
    import urllib.request

    from tests.secured_helpers import Serve

    serve = Serve("registry", "--nats", nats_url, "--prefix", prefix, "--metrics-port", "0")
    await asyncio.to_thread(serve.start)
    try:
        # SIGUSR1: every task's stack into the output (what a process that does not stop waits on); it serves on
        assert await asyncio.to_thread(serve.dump)
        dumped = serve.output[serve.output.index("--- warmboot: every task and thread"):]
        assert "task " in dumped and "Current thread" in dumped
        assert re.search(r'cmd_serve\.py", line \d+, in run', dumped)  # the main task, waiting for a signal
        url = serve.line("metrics on ").split()[-1]
        assert url.startswith(f"http://{socket.gethostname()}:") and url.endswith("/metrics")
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert listening_on(port) == {"0" * 32}  # "::": every interface, IPv6's and (dual-stack) IPv4's
        for host in ("127.0.0.1", "[::1]"):  # a scraper reaches it over either
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10)
                                           .read().decode())
            assert "warmboot_registry_registrations_total" in text, host
    finally:
        assert await asyncio.to_thread(serve.stop) == 0

    async with AsyncExitStack() as stack:  # what `warmboot up` starts: the default host
        running = await start_services(stack, ["registry"], nats_url, prefix, metrics_port=0)
        assert running.metrics_url == f"http://127.0.0.1:{running.metrics_port}/metrics"
        assert listening_on(running.metrics_port) == {"0100007F"}  # 127.0.0.1


def test_the_serving_loop_is_uvloop_unless_asyncio_is_named(monkeypatch):
    import uvloop

    monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    assert serving_loop() == ("uvloop", uvloop.new_event_loop)
    assert serving_loop("asyncio") == ("asyncio", asyncio.new_event_loop)
    monkeypatch.setenv(EVENT_LOOP_ENV, "asyncio")
    assert serving_loop()[0] == "asyncio"
    assert serving_loop("uvloop")[0] == "uvloop"  # the command's option over the environment
    monkeypatch.setenv(EVENT_LOOP_ENV, "trio")
    with pytest.raises(ValueError, match=r"^WARMBOOT_EVENT_LOOP='trio': expected one of uvloop, asyncio$"):
        serving_loop()


def test_run_serving_runs_main_on_the_named_loop_and_nothing_on_a_bad_name():
    import uvloop

    async def running() -> tuple[type, bool]:
        return type(asyncio.get_running_loop()), asyncio.get_running_loop().is_running()

    assert run_serving(running, "uvloop") == (uvloop.Loop, True)
    kind, _ = run_serving(running, "asyncio")
    assert issubclass(kind, asyncio.BaseEventLoop) and not issubclass(kind, uvloop.Loop)
    started = []

    async def main() -> None:
        started.append(True)

    with pytest.raises(ValueError, match="'epoll'"):
        run_serving(main, "epoll")
    assert started == []  # refused before main was even made a coroutine


def test_serve_and_up_refuse_an_event_loop_they_do_not_know_naming_the_option():
    from click.testing import CliRunner

    from warmboot.cli import main

    for command in (["serve", "registry"], ["up"]):
        result = CliRunner().invoke(main, [*command, "--event-loop", "epoll"])
        assert result.exit_code == 2, result.output
        assert "Invalid value for '--event-loop'" in result.output
        assert "'epoll' is not one of 'uvloop', 'asyncio'." in result.output
        result = CliRunner().invoke(main, command, env={EVENT_LOOP_ENV: "epoll"})
        assert result.exit_code == 2 and "'--event-loop'" in result.output, result.output


@pytest.mark.parametrize("loop", ["asyncio", None])
async def test_serve_runs_on_the_loop_named_and_says_which(nats_url, prefix, loop):
    from tests.secured_helpers import Serve

    env = {EVENT_LOOP_ENV: loop} if loop else {}
    serve = Serve("registry", "--nats", nats_url, "--prefix", prefix, env=env)
    if not loop:
        serve.env.pop(EVENT_LOOP_ENV, None)
    await asyncio.to_thread(serve.start)
    try:
        assert await asyncio.to_thread(serve.line, f"event loop: {loop or 'uvloop'}", anywhere=True)
        async with await nats.connect(nats_url) as client:
            with pytest.raises(ContractError) as refused:  # it answers: an unknown worker's heartbeat
                await call(client, service_subject(prefix, "registry", "heartbeat", "w-unknown"), Heartbeat(),
                           HeartbeatReply)
        assert refused.value.code is ErrorCode.NOT_FOUND
    finally:
        assert await asyncio.to_thread(serve.stop) == 0


def test_an_offending_subject_is_logged_once_and_the_log_is_bounded(caplog):
    from prometheus_client import REGISTRY

    from services.endpoints import ReplyGuard

    DROPPED_TOTAL = "warmboot_requests_dropped_total"  # services.endpoints.DROPPED, as a scrape reads it

    guard = ReplyGuard("guarded", "gp")
    guard.MAX_LOGGED = 2
    with caplog.at_level(logging.WARNING, logger="warmboot.service"):
        for _ in range(3):
            guard.drop("heartbeat", "gp.registry.heartbeat.w-1", "gp.registry.drain.w-2")
        for i in range(5):
            guard.drop("heartbeat", "gp.registry.heartbeat.w-1", f"elsewhere.{i}")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # the first subject once, one more, then that no more are logged
    assert "'gp.registry.drain.w-2'" in lines[0] and "no longer logged" in lines[2]
    assert REGISTRY.get_sample_value(DROPPED_TOTAL, {"service": "guarded", "endpoint": "heartbeat",
                                                     "reason": "not_inbox"}) == 8
    assert guard.allowed("_INBOX.w-1.abc") and guard.allowed("_INBOX.xyz")
    assert not guard.allowed("_INBOX._gp.abc") and not guard.allowed("gp.registry.drain.w-2")


async def test_a_message_known_to_be_stored_is_read_or_the_read_is_unavailable(nc, prefix, writer):
    """stored_at, the read of a retry's recorded placement: the message at a sequence the log
    or the reply cache gave, or UNAVAILABLE (retry) when no server has it (a lagging replica's
    "no message" is asked again of the leader), never an error a client gives up on."""
    from events.codec import decode_event
    from services.streams import stored_at
    from tests.factories import registered

    seq = await asyncio.to_thread(writer.write, registered("w-1"))
    js = nc.jetstream()
    assert decode_event((await stored_at(js, stream_name(prefix), seq)).data).worker_id == "w-1"
    with pytest.raises(ContractError) as refused:
        await stored_at(js, stream_name(prefix), seq + 1)
    assert refused.value.code is ErrorCode.UNAVAILABLE and f"message {seq + 1}" in refused.value.message


async def test_the_answers_of_requests_that_wrote_nothing_are_read_from_a_commands_thread_only(nc, prefix):
    """`NoWriteAnswers` waits for the service's loop: called on that loop it would wait for
    itself, so it refuses at once instead."""
    import asyncio

    from services.replies import NoWriteAnswers, ReplyCache

    answers = NoWriteAnswers(await ReplyCache(nc, prefix).start(), "registry", asyncio.get_running_loop(), "")

    class Entity:
        KIND, entity_id, version, life_start = "worker", "w", 1, 1

        def request_starts_life(self, verb: str) -> bool:
            return False

    with pytest.raises(RuntimeError, match="thread"):
        answers.recall(Entity(), "register", "r-1", dict)
    assert await asyncio.to_thread(answers.recall, Entity(), "register", "r-1", dict) is None  # nothing kept


async def test_answers_and_refusal_marks_are_read_only_on_the_stream_they_were_kept_on(nc, prefix):
    """The reply bucket outlives an event stream made again: what `NoWriteAnswers` kept or marked
    on one incarnation (its `created`) is not read on another; an entry of an earlier version,
    which names none, still is."""
    import asyncio

    from events.schema import SeqReply
    from services.replies import NoWriteAnswers, ReplyCache

    replies = await ReplyCache(nc, prefix).start()
    loop = asyncio.get_running_loop()
    old, new = (NoWriteAnswers(replies, "registry", loop, created)
                for created in ("2026-12-04T10:00:00+00:00", "2026-12-04T11:00:00+00:00"))

    class Entity:
        KIND, entity_id, version, life_start = "worker", "w", 1, 1

        def request_starts_life(self, verb: str) -> bool:
            return False

    kept = SeqReply(seq=1, unchanged=True)
    await old.keep_async(Entity(), "register", "kept", kept)
    await old.mark_refused_async(Entity(), "marked")
    assert await old.recall_async(Entity(), "register", "kept", SeqReply) == (kept, 1)
    assert await old.was_answered_async(Entity(), "kept") and await old.refusal_marked_async(Entity(), "marked")
    assert await new.recall_async(Entity(), "register", "kept", SeqReply) is None
    assert not await new.was_answered_async(Entity(), "kept")
    assert not await new.refusal_marked_async(Entity(), "marked")
    assert not await new.was_answered_async(Entity(), "marked")
    # kept and marked by an earlier version: no stream named, read by every incarnation
    await replies.put(new._key("w", "earlier"), b'{"verb":"register","version":1,"reply":{"seq":1,"unchanged":true}}')
    await replies.put(new._refused_key("w", "earlier-mark"), b"refused")
    assert await new.recall_async(Entity(), "register", "earlier", SeqReply) == (kept, 1)
    assert await new.refusal_marked_async(Entity(), "earlier-mark")


async def test_an_answer_kept_by_a_newer_version_that_this_one_cannot_read_is_unavailable(nc, prefix):
    """A newer registry kept the answer of a registration that wrote nothing with an outcome this
    version does not know: a retry through this version ended with a msgspec.ValidationError
    (INTERNAL, a traceback in the log). UNAVAILABLE now, naming the entry (a retry may reach a
    replica that reads it)."""
    import asyncio

    from events.errors import ContractError
    from events.schema import ErrorCode, RegisterReply
    from services.replies import NoWriteAnswers, ReplyCache

    replies = await ReplyCache(nc, prefix).start()
    answers = NoWriteAnswers(replies, "registry", asyncio.get_running_loop(), "2026-12-04T10:00:00+00:00")

    class Entity:
        KIND, entity_id, version, life_start = "worker", "w", 1, 1

        def request_starts_life(self, verb: str) -> bool:
            return False

    await replies.put(answers._key("w", "newer"),
                      b'{"verb":"register","version":1,"reply":{"outcome":"REVISED","seq":1}}')
    with pytest.raises(ContractError) as refused:
        await answers.recall_async(Entity(), "register", "newer", RegisterReply)
    assert refused.value.code is ErrorCode.UNAVAILABLE and "newer" in refused.value.message


# --- at most `max_concurrent` requests served at once (`Slots`, direct delivery) -----------------


async def test_slots_are_taken_at_once_while_free_and_then_in_turn():
    from services.endpoints import Slots

    slots = Slots(2)
    assert slots.take_now() and slots.take_now()
    assert not slots.free_now() and not slots.take_now()
    order: list[str] = []

    async def wait(name: str) -> None:
        await slots.take()
        order.append(name)

    first, second = asyncio.create_task(wait("first")), asyncio.create_task(wait("second"))
    await asyncio.sleep(0)  # both queued behind the two holders (one task step each)
    assert order == [] and not slots.free_now()
    slots.give()
    await first
    assert order == ["first"] and not second.done() and not slots.take_now()  # nobody jumps the queue
    slots.give()
    await second
    assert order == ["first", "second"] and slots.free == 0
    slots.give(), slots.give()
    assert slots.free == 2 and slots.free_now()


async def test_a_waiter_cancelled_takes_no_slot_and_one_cancelled_as_it_was_handed_one_passes_it_on():
    from services.endpoints import Slots

    slots = Slots(1)
    assert slots.take_now()
    gone = asyncio.create_task(slots.take())
    handed = asyncio.create_task(slots.take())
    last = asyncio.create_task(slots.take())
    await asyncio.sleep(0)  # one turn of the loop: the three wait for the slot, in that order
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    slots.give()  # to `handed`, skipping the cancelled one
    handed.cancel()  # cancelled before it ran: the slot it was handed goes to `last`
    await asyncio.gather(handed, return_exceptions=True)
    await asyncio.wait_for(last, 5)
    assert slots.free == 0
    slots.give()
    assert slots.free == 1


async def test_a_service_serves_at_most_max_concurrent_requests_at_once_and_answers_them_all(nc, prefix):
    """Requests come from the connection's read loop straight to their tasks while a slot is
    free, and wait in the subscription's queue when none is: 200 requests at once to a
    service allowed 5 are served 5 at a time, every one answered once."""
    running, most, served = 0, 0, []
    gate, full = asyncio.Event(), asyncio.Event()

    async def answer(entity_id: str, request: Heartbeat) -> HeartbeatReply:
        nonlocal running, most
        running += 1
        most = max(most, running)
        if running == 5:
            full.set()
        await gate.wait()
        running -= 1
        served.append(entity_id)
        return HeartbeatReply(ttl_s=1.0)

    micro = await add_endpoints(nc, prefix, "narrow", "five at a time", [EndpointSpec("answer", Heartbeat, answer)],
                                max_concurrent=5)
    try:
        requests = [asyncio.ensure_future(nc.request(service_subject(prefix, "narrow", "answer", f"w-{i}"), b"{}",
                                                     timeout=30)) for i in range(200)]
        await asyncio.wait_for(full.wait(), 30)  # the first five take the slots; the rest wait for them
        assert micro.endpoint_slots["answer"].free == 0
        gate.set()
        replies = await asyncio.gather(*requests)
    finally:
        await micro.stop()
    assert most == 5
    assert [json.loads(r.data) for r in replies] == [{"ttl_s": 1.0, "drained": None}] * 200
    assert sorted(served) == sorted(f"w-{i}" for i in range(200))
    assert micro.endpoint_slots["answer"].free == 5


async def test_a_backlog_on_one_endpoint_does_not_hold_up_another(nc, prefix):
    """Each endpoint has slots of its own: with every slot of `slow` held and 40 more of its
    requests waiting (a storm of registrations), each of 20 requests to `quick` (heartbeats)
    is answered while `slow` still holds them all. Shared slots would have made them wait."""
    gate, full = asyncio.Event(), asyncio.Event()
    running = 0

    async def slow(entity_id: str, request: Heartbeat) -> HeartbeatReply:
        nonlocal running
        running += 1
        if running == 4:
            full.set()
        await gate.wait()
        return HeartbeatReply(ttl_s=2.0)

    async def quick(entity_id: str, request: Heartbeat) -> HeartbeatReply:
        return HeartbeatReply(ttl_s=1.0)

    micro = await add_endpoints(nc, prefix, "split", "a slow endpoint and a quick one",
                                [EndpointSpec("slow", Heartbeat, slow), EndpointSpec("quick", Heartbeat, quick)],
                                max_concurrent=4)
    try:
        held = [asyncio.ensure_future(nc.request(service_subject(prefix, "split", "slow", f"w-{i}"), b"{}",
                                                 timeout=30)) for i in range(44)]
        await asyncio.wait_for(full.wait(), 30)
        for i in range(20):
            reply = await nc.request(service_subject(prefix, "split", "quick", f"w-{i}"), b"{}", timeout=10)
            assert json.loads(reply.data) == {"ttl_s": 1.0, "drained": None}
        assert micro.endpoint_slots["slow"].free == 0 and not any(r.done() for r in held)
        gate.set()
        assert [json.loads(r.data) for r in await asyncio.gather(*held)] == [{"ttl_s": 2.0, "drained": None}] * 44
    finally:
        gate.set()
        await micro.stop()
    assert micro.endpoint_slots["slow"].free == 4 and micro.endpoint_slots["quick"].free == 4


# --- a service's buckets at start, while JetStream cannot answer yet --------------------------------


async def test_until_answered_asks_again_through_outages_only_and_gives_up_after_its_time():
    from services.streams import until_answered

    answers = iter([nats.errors.TimeoutError(), nats.js.errors.ServiceUnavailableError(code=503), "made"])

    async def flaky() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert await until_answered(flaky, "a bucket") == "made"

    async def refused() -> None:
        raise nats.js.errors.BadRequestError(code=400, description="a configuration the server refuses")

    with pytest.raises(nats.js.errors.BadRequestError):  # the server answered: not asked again
        await until_answered(refused, "a bucket")
    for failure in (nats.js.errors.KeyValueLimitMarkerTTLNotSupportedError(), nats.errors.ConnectionClosedError()):
        asked = 0

        async def failing() -> None:
            nonlocal asked
            asked += 1
            raise failure

        with pytest.raises(type(failure)):  # a server too old for the bucket, a connection closed for good
            await until_answered(failing, "a bucket")
        assert asked == 1
    calls = 0

    async def silent() -> None:
        nonlocal calls
        calls += 1
        raise nats.errors.TimeoutError()

    with pytest.raises(nats.errors.TimeoutError):
        await until_answered(silent, "a bucket", within=0.5)
    assert 2 <= calls <= 4  # after 0.1, 0.2 (and 0.4 s, if within the time): then the last failure


@pytest.mark.timeout(240)
async def test_a_bucket_made_while_the_cluster_forms_is_made_once_it_can_answer(tmp_path, prefix, caplog):
    """A service started on a cluster whose members are not all up yet (no JetStream meta
    leader: nobody answers the bucket's creation) waits for it instead of failing its start."""
    cluster = NatsCluster(tmp_path, 3)
    first, *others = cluster.nodes
    with unanswered_noted(caplog) as asked:
        try:
            await asyncio.to_thread(first.start)
            nc = await nats.connect(first.url)
            try:
                cache = await started_once_members_are_back(ReplyCache(nc, prefix).start(), asked, others, 120)
                await cache.put("k", b"v")
                assert await cache.get("k") == b"v"
            finally:
                await nc.close()
        finally:
            await asyncio.to_thread(cluster.stop)


async def test_a_reply_cache_without_its_bucket_is_unavailable_not_empty(nc, prefix):
    """An entry that is not there is None: the request was not answered before. A bucket that is
    not there (deleted, being made again) says nothing of that: UNAVAILABLE, so a late retry is
    not decided again as if it were new (it could be placed twice)."""
    from events.errors import ContractError
    from events.schema import ErrorCode
    from services.replies import ReplyCache

    cache = await ReplyCache(nc, prefix).start()
    key = cache.key("resume.a-1", "r-1")
    assert await cache.get(key) is None
    await cache.put(key, b"answer")
    assert await cache.get(key) == b"answer"
    await nc.jetstream().delete_stream(f"KV_{cache.bucket}")
    with pytest.raises(ContractError) as refused:
        await cache.get(key)
    assert refused.value.code is ErrorCode.UNAVAILABLE and "the reply cache cannot be read" in refused.value.message


def test_metrics_on_every_interface_of_a_host_without_ipv6_are_on_every_ipv4_one(monkeypatch):
    import errno

    import prometheus_client

    from services.process import ALL_INTERFACES, serve_metrics

    real = prometheus_client.start_http_server

    def without_ipv6(port, addr="0.0.0.0", **kwargs):
        if ":" in addr:  # as a host with IPv6 turned off answers
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real(port, addr=addr, **kwargs)

    monkeypatch.setattr(prometheus_client, "start_http_server", without_ipv6)
    served = serve_metrics(0, ALL_INTERFACES)
    try:
        assert listening_on(served.port) == {"00000000"}  # 0.0.0.0
    finally:
        served.close()
    with pytest.raises(OSError, match=r"cannot serve metrics on ::1:0"):  # a host the caller named: said
        serve_metrics(0, "::1")
