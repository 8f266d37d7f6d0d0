"""events.jetstream beyond the library's conformance cases: restarts, concurrent
processes, the raw wire format, guards on other subjects, retried batches."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest
from eventsourcing.application import AggregateNotFoundError
from eventsourcing.persistence import IntegrityError, OperationalError, ProgrammingError, StoredEvent
from eventsourcing.utils import Environment

from events.aggregate import WireAggregate, WireApplication
from events.codec import decode_event, encode
from events.jetstream import (
    MSG_ID_HEADER,
    TOPIC_HEADER,
    VERSION_HEADER,
    JetStreamFactory,
    StoreUnavailableError,
)
from events.jetstream.link import ConnectOptions, Link, links_on
from events.natspy.publish import flush_in_order
from events.schema import (
    ActorStopped,
    Attribute,
    CompatVersion,
    Resources,
    WorkerBooked,
    WorkerDrained,
    WorkerRegistered,
    WorkerRuntime,
    WorkerSandboxClass,
)
from events.subjects import stream_name
from services.process import store_env
from tests.factories import leaderless_info
from warmboot.natsserver import NatsCluster, NatsServer, wait_jetstream

ROOT = Path(__file__).resolve().parent.parent
AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


class Tally(WireAggregate):
    """A test aggregate: a history of drain reasons (kind `tally`, not a real service's)."""

    KIND = "tally"

    def __init__(self, entity_id: str):
        super().__init__(entity_id)
        self.reasons: list[str | None] = []

    def drain(self, reason: str) -> None:
        self.record(WorkerDrained(at=AT, worker_id=self.entity_id, reason=reason))

    def when_WorkerDrained(self, body: WorkerDrained) -> None:
        self.reasons.append(body.reason)


class Ledger(WireAggregate):
    """A test stand-in for a worker's booking subject."""

    KIND = "ledger"

    def __init__(self, entity_id: str):
        super().__init__(entity_id)
        self.actors: list[str] = []

    def book(self, actor_id: str) -> None:
        self.record(WorkerBooked(at=AT, worker_id=self.entity_id, actor_id=actor_id))

    def when_WorkerBooked(self, body: WorkerBooked) -> None:
        self.actors.append(body.actor_id)


def new_prefix() -> str:
    return "t" + uuid.uuid4().hex[:12]


def app_on(url: str, prefix: str, **extra: str) -> WireApplication:
    return WireApplication(env={**store_env(url, prefix), **extra})


def in_thread(target, timeout: float = 60.0):
    """Run `target` in a thread; its result, or its exception raised here."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = target()
        except BaseException as error:  # handed to the test thread
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def finish(thread: threading.Thread, outcome: dict, timeout: float = 60.0):
    thread.join(timeout)
    assert not thread.is_alive(), "the call did not return"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@pytest.fixture
def own_server(tmp_path):
    """A nats-server of this test's own, to stop and restart on the same store directory."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    yield server
    server.stop()


# --- restarts -------------------------------------------------------------------------------


def test_restart_loses_nothing_and_the_same_app_carries_on(own_server, caplog):
    caplog.set_level(logging.INFO, logger="warmboot.jetstream")
    prefix = new_prefix()
    app = app_on(own_server.url, prefix)
    try:
        tally = Tally("t-1")
        for i in range(3):
            tally.drain(f"before-{i}")
        app.save(tally)
        tally = app.repository.get(Tally.create_id("t-1"))
        tally.drain("before-3")
        app.save(tally)
        subscription = app.recorder.subscribe(gt=None)

        own_server.restart()

        tally = app.repository.get(Tally.create_id("t-1"))  # the same app, not rebuilt
        assert tally.reasons == [f"before-{i}" for i in range(4)]
        for i in range(3):
            tally.drain(f"after-{i}")
            app.save(tally)
        ledger = Ledger("w-1")
        ledger.book("t-1")
        app.save(ledger)

        expected = [f"before-{i}" for i in range(4)] + [f"after-{i}" for i in range(3)]
        fresh = app_on(own_server.url, prefix)
        try:
            assert fresh.repository.get(Tally.create_id("t-1")).reasons == expected
        finally:
            fresh.close()
        notifications = app.recorder.select_notifications(None, 100)
        assert [n.id for n in notifications] == list(range(1, 9))
        assert app.recorder.max_notification_id() == 8

        # The subscription opened before the restart delivers everything, the new events too.
        def read_eight():
            with subscription:
                return [n.id for _, n in zip(range(8), subscription)]  # range first: zip stops there

        assert finish(*in_thread(read_eight)) == list(range(1, 9))
    finally:
        app.close()
    # the restart is said (a close on purpose is not: below)
    assert any(r.getMessage().startswith("disconnected from ") for r in caplog.records)


def test_a_store_closed_on_purpose_says_no_reconnecting(nats_url, caplog):
    """nats-py reports a close as a disconnection too: a walkthrough read "disconnected ...;
    reconnecting" after a clean stop of `warmboot serve`."""
    caplog.set_level(logging.INFO, logger="warmboot.jetstream")
    app = app_on(nats_url, new_prefix())
    tally = Tally("t-1")
    tally.drain("x")
    app.save(tally)
    app.close()
    assert not [r for r in caplog.records if "reconnecting" in r.getMessage()]


def test_a_write_issued_while_the_server_is_down_lands_once_it_is_back(own_server):
    app = app_on(own_server.url, new_prefix())
    try:
        tally = Tally("t-1")
        tally.drain("first")
        app.save(tally)
        tally.drain("while down")

        own_server.stop()
        thread, outcome = in_thread(lambda: app.save(tally))
        own_server.start()
        recordings = finish(thread, outcome)

        assert [r.notification.id for r in recordings] == [2]
        assert app.repository.get(Tally.create_id("t-1")).reasons == ["first", "while down"]
        assert app.recorder.max_notification_id() == 2  # stored once
    finally:
        app.close()


def test_an_unreachable_store_raises_a_clear_error_after_the_retry_budget(own_server):
    app = app_on(own_server.url, new_prefix(), WARMBOOT_STORE_TIMEOUT="1")
    try:
        own_server.stop()
        tally = Tally("t-1")
        tally.drain("nobody hears this")
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="unavailable for 1s"):
            app.save(tally)
        assert time.monotonic() - started < 10
    finally:
        app.close()


async def stream_leader(url: str, prefix: str) -> str:
    import nats

    nc = await nats.connect(url.split(","))
    try:
        return (await nc.jetstream().stream_info(stream_name(prefix))).cluster.leader
    finally:
        await nc.close()


@pytest.mark.timeout(240)
def test_writes_ride_out_the_stream_leader_being_killed(tmp_path):
    with NatsCluster(tmp_path) as cluster:
        asyncio.run(wait_jetstream(cluster.url))
        prefix = new_prefix()
        app = WireApplication(env=store_env(cluster.url, prefix, replicas=3))
        try:
            tally = Tally("t-1")
            tally.drain("0")
            app.save(tally)
            cluster.node(asyncio.run(stream_leader(cluster.url, prefix))).kill()
            for i in range(1, 10):  # each save rides out the election (and a reconnect) by itself
                tally.drain(str(i))
                app.save(tally)
            assert app.repository.get("tally.t-1").reasons == [str(i) for i in range(10)]
            assert [n.id for n in app.recorder.select_notifications(None, 100)] == list(range(1, 11))
        finally:
            app.close()


def test_nats_py_s_jetstream_errors_are_judged_as_the_store_s_own():
    """What nats-py raises for the requests it makes itself (`subscribe`'s consumer) is retried as the
    store's own requests are: a 503 with its code, and a request nobody took, which nats-py gives as a
    503 without a code (found by a review: taken as a refusal, not retried); a refusal is not."""
    import nats.errors
    import nats.js.errors

    from events.jetstream.errors import from_nats_py, retryable

    nobody = from_nats_py(nats.js.errors.ServiceUnavailableError())
    assert isinstance(nobody, nats.errors.NoRespondersError) and retryable(nobody)
    no_leader = from_nats_py(nats.js.errors.APIError(code=503, err_code=10008, description="JetStream system temporarily unavailable"))
    assert retryable(no_leader)
    refused = from_nats_py(nats.js.errors.BadRequestError(code=400, err_code=10012, description="consumer config invalid"))
    assert not retryable(refused) and "consumer config invalid" in str(refused)


def test_a_subscription_asked_for_while_its_stream_has_no_leader_starts_once_it_has_one(tmp_path):
    """`recorder.subscribe` makes an ordered consumer, which a stream without a leader cannot: the
    request is retried as the store's own reads are, within the store's time budget, and the
    subscription then delivers everything from the start and what is appended after."""
    import nats

    class Retried(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.DEBUG)
            self.seen = threading.Event()

        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("subscribing to "):
                self.seen.set()

    retried = Retried()
    store_log = logging.getLogger("warmboot.jetstream")
    level = store_log.level
    store_log.addHandler(retried)
    store_log.setLevel(logging.DEBUG)
    with NatsCluster(tmp_path) as cluster:
        asyncio.run(wait_jetstream(cluster.url))
        prefix = new_prefix()
        first, *others = cluster.nodes
        app = WireApplication(env=store_env(first.url, prefix, replicas=3))
        try:
            tally = Tally("t-1")
            tally.drain("0")
            app.save(tally)
            for node in others:
                node.stop()

            async def leaderless() -> None:  # the member left says so once it has been alone long enough
                nc = await nats.connect(first.url)
                try:
                    await leaderless_info(nc.jetstream(timeout=1.0), stream_name(prefix))
                finally:
                    await nc.close()

            asyncio.run(leaderless())
            thread, outcome = in_thread(lambda: app.recorder.subscribe(gt=None))
            while not retried.seen.wait(0.2):  # until it has been refused once and is trying again
                assert thread.is_alive(), f"subscribe gave up at once: {outcome.get('error')!r}"
            for node in others:
                node.spawn()
            for node in others:
                node.wait_ready(30)
            subscription = finish(thread, outcome)
            try:
                assert next(subscription).id == 1
                tally.drain("1")
                app.save(tally)
                assert next(subscription).id == 2
            finally:
                subscription.stop()
        finally:
            app.close()
            store_log.removeHandler(retried)
            store_log.setLevel(level)


# --- concurrent writers ------------------------------------------------------------------------

WRITER = r"""
import json, sys
from eventsourcing.application import AggregateNotFoundError
from eventsourcing.persistence import IntegrityError
from events.aggregate import WireAggregate, WireApplication
from events.schema import WorkerDrained
from datetime import datetime, timezone
from services.process import store_env

class Tally(WireAggregate):
    KIND = "tally"
    def when_WorkerDrained(self, body):
        pass

url, prefix, name, wanted = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
app = WireApplication(env=store_env(url, prefix))
app.recorder.max_notification_id()  # connected, stream ready
print("ready", flush=True)
sys.stdin.readline()  # both writers start together
won, lost = [], 0
while len(won) < wanted:
    try:
        tally = app.repository.get("tally.race")
    except AggregateNotFoundError:
        tally = Tally("race")
    at = datetime.now(timezone.utc)
    tally.record(WorkerDrained(at=at, worker_id="race", reason=f"{name}-{len(won)}"))
    try:
        app.save(tally)
    except IntegrityError:
        lost += 1
        continue
    won.append(tally.version)
print(json.dumps({"won": won, "lost": lost}), flush=True)
app.close()
"""


def test_two_processes_writing_one_aggregate_each_version_is_won_once(nats_url):
    prefix = new_prefix()
    wanted = 25
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, nats_url, prefix, name, str(wanted)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for name in ("a", "b")
    ]
    try:
        for writer in writers:
            assert writer.stdout.readline().strip() == "ready"
        for writer in writers:
            writer.stdin.write("go\n")
            writer.stdin.flush()
        results = {}
        for name, writer in zip("ab", writers):
            out, _ = writer.communicate(timeout=120)
            assert writer.returncode == 0
            results[name] = json.loads(out.strip().splitlines()[-1])
    finally:
        for writer in writers:
            if writer.poll() is None:
                writer.kill()

    print("lost races:", results["a"]["lost"], results["b"]["lost"])
    won_a, won_b = set(results["a"]["won"]), set(results["b"]["won"])
    assert not won_a & won_b
    assert won_a | won_b == set(range(1, 2 * wanted + 1))

    app = app_on(nats_url, prefix)
    try:
        stored = app.recorder.select_events("tally.race")
        assert [e.originator_version for e in stored] == list(range(1, 2 * wanted + 1))
        for event in stored:  # the stored event of each version is the one its winner wrote
            writer = decode_event(event.state).reason.split("-")[0]
            assert event.originator_version in (won_a if writer == "a" else won_b)
    finally:
        app.close()


# --- the wire format ------------------------------------------------------------------------------


def registered(worker_id: str) -> WorkerRegistered:
    runtime = WorkerRuntime(
        version=CompatVersion(schema_version="v1", attributes=(Attribute(key="architecture", value="amd64"),))
    )
    return WorkerRegistered(
        at=AT,
        worker_id=worker_id,
        node="node-1",
        capacity=Resources(cpu_millis=4000, memory_mib=8192),
        labels={"zone": "a"},
        sandbox_classes=(WorkerSandboxClass(sandbox_class="gvisor", default_runtime=runtime),),
    )


async def test_a_raw_subscriber_decodes_every_body_with_the_schema_alone(nats_url, prefix, nc):
    app = app_on(nats_url, prefix)
    try:
        bodies = [registered("w-1"), WorkerDrained(at=AT, worker_id="w-1", reason="maintenance")]
        app.recorder.insert_events(
            [app.stored_event("worker.w-1", version, body) for version, body in enumerate(bodies, 1)]
        )
        booked = WorkerBooked(at=AT, worker_id="w-1", actor_id="a-1")
        stopped = ActorStopped(at=AT, actor_id="a-1")
        app.recorder.insert_events([app.stored_event("booking.w-1", 1, booked)])
        app.recorder.insert_events([app.stored_event("actor.a-1", 1, stopped)])
        tally = Tally("t-1")
        tally.drain("through an aggregate")
        app.save(tally)
        bodies += [booked, stopped, tally.history[0]]
    finally:
        app.close()

    received = []
    done = asyncio.Event()

    async def on_message(msg):
        received.append(msg)
        if len(received) == len(bodies):
            done.set()

    subscription = await nc.jetstream().subscribe(f"{prefix}.ev.>", cb=on_message, ordered_consumer=True)
    try:
        await asyncio.wait_for(done.wait(), 10)
    finally:
        await subscription.unsubscribe()

    assert [decode_event(msg.data) for msg in received] == bodies
    assert [msg.data for msg in received] == [encode(body) for body in bodies]  # the Struct's JSON, as is
    subjects = [msg.subject for msg in received]
    assert subjects == [f"{prefix}.ev.{s}" for s in ("worker.w-1", "worker.w-1", "booking.w-1", "actor.a-1", "tally.t-1")]
    for msg, body in zip(received, bodies):
        assert msg.headers[TOPIC_HEADER] == type(body).__name__
        version = msg.headers[VERSION_HEADER]
        assert msg.headers[MSG_ID_HEADER] == f"{msg.subject.split('.', 2)[2]}:{version}"
    assert [msg.headers[VERSION_HEADER] for msg in received] == ["1", "2", "1", "1", "1"]


async def test_the_stream_is_created_as_the_log_needs_and_an_old_one_is_upgraded(nats_url, prefix, nc):
    js = nc.jetstream()
    name = stream_name(prefix)
    await js.add_stream(name=name, subjects=[f"{prefix}.ev.>"])  # made by hand, without atomic batches

    factory = JetStreamFactory(Environment(env=store_env(nats_url, prefix)))
    try:
        factory.application_recorder()
        again = JetStreamFactory(Environment(env=store_env(nats_url, prefix)))  # idempotent
        again.process_recorder()
        again.close()
    finally:
        factory.close()

    config = (await js.stream_info(name)).config
    assert config.allow_atomic and config.allow_direct
    assert set(config.subjects) == {f"{prefix}.ev.>", f"{prefix}.tracking.>"}
    assert config.duplicate_window >= 120

    fresh = new_prefix()
    factory = JetStreamFactory(Environment(env=store_env(nats_url, fresh)))
    factory.application_recorder()
    factory.close()
    config = (await js.stream_info(stream_name(fresh))).config
    assert str(getattr(config.storage, "value", config.storage)) == "file"
    assert config.allow_atomic and config.allow_direct
    assert config.duplicate_window >= 120
    assert (config.max_msgs, config.max_bytes, config.max_age, config.max_msgs_per_subject) == (-1, -1, 0, -1)


# --- guards, retries, prefixes ------------------------------------------------------------------


def test_expected_last_seqs_guards_a_second_subject(nats_url, prefix):
    app = app_on(nats_url, prefix)
    try:
        ledger, tally = Ledger("w-1"), Tally("a-1")
        ledger.book("a-1")
        tally.drain("placed")
        recordings = app.save(tally, ledger, expected_last_seqs={"ledger.w-1": 0})
        booking_seq = recordings[-1].notification.id
        assert [r.notification.id for r in recordings] == [1, 2]

        # A placement decided on a view that has not seen the first booking:
        before = app.recorder.max_notification_id()
        ledger, tally = app.repository.get("ledger.w-1"), Tally("a-2")
        ledger.book("a-2")
        tally.drain("placed")
        with pytest.raises(IntegrityError, match="expected last sequence 0"):
            app.save(tally, ledger, expected_last_seqs={"ledger.w-1": 0})
        assert app.recorder.max_notification_id() == before  # nothing written, not even a-2's event
        with pytest.raises(AggregateNotFoundError):
            app.repository.get("tally.a-2")

        # Decided on the current view, it commits.
        ledger, tally = app.repository.get("ledger.w-1"), Tally("a-2")
        ledger.book("a-2")
        tally.drain("placed")
        app.save(tally, ledger, expected_last_seqs={"ledger.w-1": booking_seq})
        assert app.repository.get("ledger.w-1").actors == ["a-1", "a-2"]

        # An expectation on a subject the call does not write cannot be kept: refused outright.
        tally = app.repository.get("tally.a-2")
        tally.drain("again")
        with pytest.raises(ProgrammingError, match="ledger.w-9"):
            app.save(tally, expected_last_seqs={"ledger.w-9": 0})
    finally:
        app.close()


def test_a_fence_commits_only_while_a_subject_the_call_does_not_write_is_where_it_was(nats_url, prefix):
    """`fences={originator: seq}`: the append commits only if that subject's last sequence is still
    `seq` (Nats-Expected-Last-Subject-Sequence-Subject, on a message without an expectation of its
    own); a subject that moved is a conflict, and nothing of the call is written."""
    app = app_on(nats_url, prefix)
    try:
        ledger = Ledger("w-1")
        ledger.book("a-0")
        fenced_at = app.save(ledger)[-1].notification.id
        tally = Tally("a-1")
        tally.drain("one")
        tally.drain("two")  # a second message: the first carries the tally's own expectation
        assert [r.notification.id for r in app.save(tally, fences={"ledger.w-1": fenced_at})] == [2, 3]

        ledger = app.repository.get("ledger.w-1")
        ledger.book("a-9")  # the fenced subject moves on
        app.save(ledger)
        before = app.recorder.max_notification_id()
        tally = app.repository.get("tally.a-1")
        tally.drain("three")
        tally.drain("four")
        with pytest.raises(IntegrityError, match=f"fenced at last sequence {fenced_at}, now {before}"):
            app.save(tally, fences={"ledger.w-1": fenced_at})
        assert app.recorder.max_notification_id() == before
        assert app.repository.get("tally.a-1").reasons == ["one", "two"]
        # the current position commits; an empty subject is fenced at 0 (a fence per free message)
        tally = app.repository.get("tally.a-1")
        for reason in ("three", "four", "five"):
            tally.drain(reason)
        app.save(tally, fences={"ledger.w-1": before, "ledger.w-never": 0})
        assert app.repository.get("tally.a-1").reasons == ["one", "two", "three", "four", "five"]

        # a call with no message free to carry a fence, or that writes the fenced subject: refused
        tally = app.repository.get("tally.a-1")
        tally.drain("six")
        with pytest.raises(ProgrammingError, match="no message of this call can carry a fence on"):
            app.save(tally, fences={"ledger.w-1": before})
        tally = app.repository.get("tally.a-1")  # the refused save took the pending event with it
        tally.drain("six")
        tally.drain("seven")
        with pytest.raises(ProgrammingError, match="is written by this call"):
            app.save(tally, fences={"tally.a-1": 0})
        assert app.recorder.max_notification_id() == before + 3
    finally:
        app.close()


def test_a_refusal_of_expectations_all_given_is_a_conflict_without_reading_every_subject(nats_url, prefix):
    """The scheduler's group commit gives the expected last sequence of every subject it
    writes: a refusal is IntegrityError at once, with no read of each subject from the
    leader (with three replicas those reads were most of what a lost race cost)."""
    app = app_on(nats_url, prefix)
    try:
        ledger, tally = Ledger("w-1"), Tally("a-1")
        ledger.book("a-1")
        tally.drain("placed")
        booking_seq = app.save(tally, ledger, expected_last_seqs={"ledger.w-1": 0, "tally.a-1": 0})[-1].notification.id
        link = app.recorder.link

        async def watch():
            return [await link.nc.subscribe(f"$JS.API.{api}.>") for api in ("STREAM.MSG.GET", "DIRECT.GET")]

        before = app.recorder.max_notification_id()
        ledger, tally = app.repository.get("ledger.w-1"), Tally("a-2")
        ledger.book("a-2")
        tally.drain("placed")
        subs = link.call(watch())
        with pytest.raises(IntegrityError):
            app.save(tally, ledger, expected_last_seqs={"ledger.w-1": 0, "tally.a-2": 0})
        link.call(flush_in_order(link.nc))  # every request the save published has reached the subscriptions
        assert [sub.pending_msgs for sub in subs] == [0, 0]
        assert app.recorder.max_notification_id() == before  # nothing written
        with pytest.raises(AggregateNotFoundError):
            app.repository.get("tally.a-2")
        # the position the refused save wanted is still free: decided again on the current view, it commits
        ledger = app.repository.get("ledger.w-1")
        ledger.book("a-2")
        app.save(ledger, expected_last_seqs={"ledger.w-1": booking_seq})
        assert app.repository.get("ledger.w-1").actors == ["a-1", "a-2"]
    finally:
        app.close()


def test_a_retried_batch_is_stored_once(nats_url, prefix):
    factory = JetStreamFactory(Environment(env=store_env(nats_url, prefix)))
    try:
        recorder = factory.application_recorder()
        body = encode(WorkerDrained(at=AT, worker_id="r-1", reason="x"))
        events = [StoredEvent("tally.r-1", version, "WorkerDrained", body) for version in (1, 2, 3)]
        events.append(StoredEvent("ledger.r-1", 1, "WorkerDrained", body))
        first = recorder.insert_events(events)

        # The module resends a batch when its reply was lost (a timeout, a dropped
        # connection); a lost reply cannot be provoked on demand, so the resend of
        # the identical batch is driven directly.
        resent = recorder.link.call(recorder.stream.append(recorder._batch(events, None, None), retried=True))
        assert resent == first
        assert [n.id for n in recorder.select_notifications(None, 100)] == first

        # A caller repeating its own write is a conflict, as with any recorder.
        with pytest.raises(IntegrityError):
            recorder.insert_events(events)
        assert recorder.max_notification_id() == first[-1]
    finally:
        factory.close()


def test_a_retried_batch_is_known_as_stored_after_another_writer_wrote_past_it(nats_url, prefix):
    """A batch stored, its reply lost, and another write on one of its subjects before the retry
    looks: the retry still finds the batch where it landed, right after the sequences it expected,
    not only as its subjects' last messages (an audit: a placement, then a drain's fence on its
    booking subject, was refused although stored)."""
    import nats.errors

    factory = JetStreamFactory(Environment(env=store_env(nats_url, prefix)))
    try:
        recorder = factory.application_recorder()
        stream = recorder.stream
        real_send = stream._send
        other = []

        async def send(batch, timeout):
            last = await real_send(batch, timeout)
            if not other:  # stored; another writer moves one of its subjects on; the reply is lost
                subject = batch.outs[-1].subject
                other.append((await stream.link.nc.jetstream().publish(subject, b"another writer")).seq)
                raise nats.errors.TimeoutError
            return last

        stream._send = send
        body = encode(WorkerDrained(at=AT, worker_id="r-1", reason="x"))
        stored = recorder.insert_events([StoredEvent("tally.r-1", 1, "WorkerDrained", body),
                                         StoredEvent("ledger.r-1", 1, "WorkerDrained", body)])
        assert other and stored == [other[0] - 2, other[0] - 1]  # the first attempt's, answered by the retry
        assert [n.id for n in recorder.select_notifications(None, 100)] == stored + other  # stored once
    finally:
        factory.close()


async def test_an_append_awaited_from_the_caller_s_loop_is_the_threaded_append(nats_url, prefix):
    """`insert_events_async` (the scheduler's group commit): the same atomic append under the
    same guards as `insert_events`, awaited from the caller's loop through `Link.submit`; a
    caller cancelled meanwhile leaves its append to land, as a thread's call would."""
    factory = JetStreamFactory(Environment(env=store_env(nats_url, prefix)))
    try:
        recorder = factory.application_recorder()
        body = encode(WorkerDrained(at=AT, worker_id="s-1", reason="x"))

        def events(version: int) -> list[StoredEvent]:
            return [StoredEvent("tally.s-1", version, "WorkerDrained", body),
                    StoredEvent("ledger.s-1", version, "WorkerDrained", body)]

        first = await recorder.insert_events_async(events(1), expected_last_seqs={"tally.s-1": 0, "ledger.s-1": 0})
        assert len(first) == 2
        stored = await asyncio.to_thread(recorder.select_notifications, None, 100)
        assert [(n.id, n.originator_id, n.originator_version) for n in stored] == [
            (first[0], "tally.s-1", 1), (first[1], "ledger.s-1", 1)]

        # a guard that no longer holds: a conflict, and nothing of the call written
        with pytest.raises(IntegrityError):
            await recorder.insert_events_async(events(2), expected_last_seqs={"tally.s-1": 0, "ledger.s-1": first[1]})
        assert await asyncio.to_thread(recorder.max_notification_id) == first[1]

        # the caller gives up once its append is handed over: the append still lands, once
        task = asyncio.create_task(recorder.insert_events_async(
            events(2), expected_last_seqs={"tally.s-1": first[0], "ledger.s-1": first[1]}))
        await asyncio.sleep(0)  # one step of the task: its append is handed to the link's loop
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # appends reach the link's loop in order: this one commits only after the one given up on
        third = await recorder.insert_events_async(
            events(3), expected_last_seqs={"tally.s-1": first[1] + 1, "ledger.s-1": first[1] + 2})
        assert third == [first[1] + 3, first[1] + 4]
        stored = await asyncio.to_thread(recorder.select_notifications, None, 100)
        assert [n.originator_version for n in stored] == [1, 1, 2, 2, 3, 3]
    finally:
        await asyncio.to_thread(factory.close)
    with pytest.raises(ProgrammingError, match="closed"):
        await recorder.insert_events_async(events(4))


async def test_a_call_awaited_from_another_loop_fails_as_a_thread_s_when_the_link_shuts_down(nats_url):
    """`Link.submit` of a call still running when the link shuts down: OperationalError, as
    `Link.call` raises to a thread."""
    link = Link(ConnectOptions(url=nats_url))
    try:
        started = threading.Event()

        async def forever() -> None:
            started.set()
            await asyncio.get_running_loop().create_future()

        waiting = asyncio.create_task(link.submit(forever()))
        assert await asyncio.to_thread(started.wait, 10)
        await asyncio.to_thread(link.shutdown)
        with pytest.raises(OperationalError, match="closed during the call"):
            await waiting
    finally:
        await asyncio.to_thread(link.shutdown)


async def test_a_call_its_link_s_loop_never_started_fails_when_the_loop_stops(nats_url):
    """A `submit` whose call the link's loop took up only as it stopped (its task never ran to
    an end) is cancelled as the link's thread ends, and its caller gets OperationalError: the
    thread cancelled it while holding the lock its done-callback takes, and waited for itself."""
    link = Link(ConnectOptions(url=nats_url))
    stopping, go_on = threading.Event(), threading.Event()

    def stop_then_hold() -> None:  # on the link's loop: its last turn, held while the call is sent
        link.loop.stop()
        stopping.set()
        go_on.wait(10)

    try:
        link.loop.call_soon_threadsafe(stop_then_hold)
        assert await asyncio.to_thread(stopping.wait, 10)

        async def forever() -> None:
            await asyncio.get_running_loop().create_future()

        waiting = asyncio.create_task(link.submit(forever()))
        while not link.waiting:  # submit has handed the call to the link's loop
            await asyncio.sleep(0)
        go_on.set()
        await asyncio.to_thread(link.thread.join, 10)
        assert not link.thread.is_alive()
        with pytest.raises(OperationalError, match="closed during the call"):
            await asyncio.wait_for(waiting, 10)
    finally:
        go_on.set()
        await asyncio.to_thread(link.shutdown)


async def test_a_store_on_the_caller_s_loop_appends_there_and_serves_threads_as_before(nats_url, prefix):
    """`links_on(loop)`: the store made inside runs its link on `loop`, with no thread of its own;
    `insert_events_async` from that loop is awaited right there, a synchronous call from a thread
    is served as before, one from the loop itself is refused (it would block the loop), and a
    store made outside keeps the process's threaded link."""
    loop = asyncio.get_running_loop()
    with links_on(loop):
        factory = await asyncio.to_thread(JetStreamFactory, Environment(env=store_env(nats_url, prefix)))
    apart = await asyncio.to_thread(JetStreamFactory, Environment(env=store_env(nats_url, prefix)))
    try:
        recorder = await asyncio.to_thread(factory.application_recorder)
        assert recorder.link.loop is loop and recorder.link.thread is None
        assert (await asyncio.to_thread(apart.application_recorder)).link is not recorder.link
        body = encode(WorkerDrained(at=AT, worker_id="h-1", reason="x"))
        seqs = await recorder.insert_events_async([StoredEvent("tally.h-1", 1, "WorkerDrained", body)],
                                                  expected_last_seqs={"tally.h-1": 0})
        assert await asyncio.to_thread(recorder.max_notification_id) == seqs[-1]
        with pytest.raises(ProgrammingError, match="its own event loop"):
            recorder.max_notification_id()
    finally:
        await asyncio.to_thread(factory.close)
        await asyncio.to_thread(apart.close)
    assert recorder.link.closed and recorder.link.nc.is_closed


async def test_the_server_refuses_a_resent_atomic_batch(nats_url, prefix, nc):
    """What the retry above relies on: nats-server keeps one copy of a resent batch."""
    factory = JetStreamFactory(Environment(env=store_env(nats_url, prefix)))
    factory.application_recorder()
    factory.close()

    async def send_batch(batch_id: str) -> dict:
        subjects = [f"{prefix}.ev.tally.x", f"{prefix}.ev.ledger.x"]
        for index, subject in enumerate(subjects, 1):
            headers = {"Nats-Msg-Id": f"{subject}:1", "Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(index)}
            if index == len(subjects):
                headers["Nats-Batch-Commit"] = "1"
                return json.loads((await nc.request(subject, b"{}", headers=headers, timeout=5)).data)
            await nc.publish(subject, b"{}", headers=headers)

    assert (await send_batch("first"))["count"] == 2
    assert "error" in await send_batch("again")
    info = await nc.jetstream().stream_info(stream_name(prefix))
    assert info.state.messages == 2


def test_two_prefixes_side_by_side(nats_url):
    apps = {prefix: app_on(nats_url, prefix) for prefix in (new_prefix(), new_prefix())}
    try:
        for prefix, app in apps.items():
            tally = Tally("shared-id")
            tally.drain(prefix)
            app.save(tally)
        for prefix, app in apps.items():
            assert app.repository.get("tally.shared-id").reasons == [prefix]
            assert [n.id for n in app.recorder.select_notifications(None, 10)] == [1]
    finally:
        for app in apps.values():
            app.close()


def test_prefixes_that_name_the_same_stream_are_refused_not_merged(nats_url):
    """`team-a` and `team_a` name one stream and the same buckets (names fold '-' into '_'): the
    second deployment's store refuses the stream of the first, naming its subjects, and writes
    nothing, instead of adding its subjects to it (one log, one liveness for both)."""
    base = new_prefix()
    first = app_on(nats_url, f"{base}-a")
    try:
        tally = Tally("w-1")
        tally.drain("first")
        first.save(tally)
        with pytest.raises(OperationalError) as refused:
            app_on(nats_url, f"{base}_a")
        assert f"holds the subjects {base}-a.ev.>" in str(refused.value)
        assert f"another prefix than {base}_a" in str(refused.value)
        assert [n.id for n in first.recorder.select_notifications(None, 10)] == [1]  # its log alone
    finally:
        first.close()


def test_ids_keep_their_type_and_name_their_subject(nats_url, prefix):
    factory = JetStreamFactory(Environment(env=store_env(nats_url, prefix)))
    try:
        recorder = factory.application_recorder()
        as_uuid = uuid.uuid4()
        recorder.insert_events(
            [
                StoredEvent(as_uuid, 1, "topic", b"{}"),
                StoredEvent("plain", 1, "topic", b"{}"),
                StoredEvent("worker.w-1", 1, "topic", b"{}"),
            ]
        )
        ids = [n.originator_id for n in recorder.select_notifications(None, 10)]
        assert ids == [as_uuid, "plain", "worker.w-1"]
        assert [type(i) for i in ids] == [uuid.UUID, str, str]
        with pytest.raises(ProgrammingError):
            recorder.insert_events([StoredEvent("worker.has space", 1, "topic", b"{}")])
        with pytest.raises(ProgrammingError):
            recorder.insert_events([StoredEvent("aggregate.reserved", 1, "topic", b"{}")])
    finally:
        factory.close()


def test_notifications_skip_what_is_not_an_event_and_honour_topics(nats_url, prefix):
    from eventsourcing.persistence import Tracking

    factory = JetStreamFactory(Environment(env=store_env(nats_url, prefix)))
    try:
        recorder = factory.process_recorder()
        recorder.insert_events([StoredEvent("worker.a", 1, "A", b"1")], tracking=Tracking("up", 7))
        recorder.insert_events([StoredEvent("worker.a", 2, "B", b"2")], tracking=Tracking("up", 8))
        recorder.insert_events([StoredEvent("worker.b", 1, "A", b"3")])
        assert [n.id for n in recorder.select_notifications(None, 10)] == [1, 3, 5]  # 2 and 4: tracking
        assert [n.id for n in recorder.select_notifications(2, 10)] == [3, 5]
        assert [n.id for n in recorder.select_notifications(None, 10, topics=["A"])] == [1, 5]
        assert [n.id for n in recorder.select_notifications(None, 1, topics=["A"], stop=4)] == [1]
        assert recorder.max_notification_id() == 5
        assert recorder.max_tracking_id("up") == 8
    finally:
        factory.close()


def test_what_cannot_be_one_atomic_append_is_refused_before_anything_is_written(nats_url, prefix):
    from eventsourcing.persistence import DataError

    from events.jetstream import MAX_BATCH_MESSAGES

    factory = JetStreamFactory(Environment(env=store_env(nats_url, prefix)))
    try:
        recorder = factory.application_recorder()
        too_many = [StoredEvent("worker.w-1", v, "topic", b"{}") for v in range(1, MAX_BATCH_MESSAGES + 2)]
        with pytest.raises(ProgrammingError, match="at most 1000"):
            recorder.insert_events(too_many)
        with pytest.raises(DataError, match="max_payload"):
            recorder.insert_events([StoredEvent("worker.w-1", 1, "topic", b"x" * (3 << 20))])
        assert recorder.max_notification_id() is None
        assert recorder.insert_events(too_many[:MAX_BATCH_MESSAGES]) == list(range(1, MAX_BATCH_MESSAGES + 1))
    finally:
        factory.close()


def test_a_read_behind_this_process_s_own_writes_is_made_through_the_stream_leader(nats_url, prefix):
    """On a replicated stream a direct get may reach a replica that has not applied the
    latest writes yet. One server cannot lag, so the process's memory of its last write
    is pushed ahead of every replica instead: the reads must then go to the leader."""
    from events.jetstream import _Last

    factory = JetStreamFactory(Environment(env=store_env(nats_url, prefix)))
    try:
        recorder = factory.application_recorder()
        written = [StoredEvent("worker.w-1", v, f"T{v}", f"{v}".encode()) for v in (1, 2, 3)]
        recorder.insert_events(written)
        recorder.link.last_seen.put(f"{prefix}.ev.worker.w-1", _Last(10**6, 3), authoritative=True)
        assert recorder.select_events("worker.w-1") == written
        assert recorder.select_events("worker.w-1", desc=True, limit=1) == written[-1:]
        assert recorder.select_events("worker.w-1", gt=1, lte=2) == written[1:2]
    finally:
        factory.close()


def test_credentials_from_the_environment_and_one_connection_per_credentials(tmp_path):
    users = 'authorization { users = [ {user: "alice", password: "wonder"}, {user: "bob", password: "builder"} ] }'
    server = NatsServer(tmp_path / "auth", extra_config=users)
    server.start()
    try:
        prefix = new_prefix()
        alice = app_on(server.url, prefix, NATS_USER="alice", NATS_PASSWORD="wonder")
        bob = app_on(server.url, prefix, NATS_USER="bob", NATS_PASSWORD="builder")
        try:
            tally = Tally("t-1")
            tally.drain("alice")
            alice.save(tally)
            assert bob.repository.get("tally.t-1").reasons == ["alice"]
            assert alice.factory.link is not bob.factory.link
        finally:
            alice.close()
            bob.close()
        with pytest.raises(StoreUnavailableError, match="could not connect.*[Aa]uthorization"):
            app_on(server.url, prefix, NATS_USER="mallory", NATS_PASSWORD="x", WARMBOOT_STORE_TIMEOUT="1")
    finally:
        server.stop()


async def test_a_stream_deleted_under_the_store_is_made_again_or_named(nats_url, prefix, nc):
    from eventsourcing.persistence import OperationalError

    factory = JetStreamFactory(Environment(env=store_env(nats_url, prefix)))
    restrained = JetStreamFactory(Environment(env={**store_env(nats_url, prefix), "CREATE_TABLE": "no"}))
    try:
        recorder = factory.application_recorder()
        restrained_recorder = restrained.application_recorder()
        written = [StoredEvent("worker.w-1", v, "T", b"{}") for v in (1, 2, 3)]
        await asyncio.to_thread(recorder.insert_events, written)
        await nc.jetstream().delete_stream(stream_name(prefix))
        started = time.monotonic()
        with pytest.raises(OperationalError, match="does not exist"):
            await asyncio.to_thread(restrained_recorder.select_notifications, None, 10)
        assert time.monotonic() - started < 5  # not retried for the whole budget
        # The default: the stream is made again and the append goes through.
        assert await asyncio.to_thread(recorder.insert_events, written[:1]) == [1]
        assert (await nc.jetstream().stream_info(stream_name(prefix))).config.allow_atomic
        # What the process knew of the old stream is forgotten: reads and appends go on from the new one.
        assert await asyncio.to_thread(recorder.select_events, "worker.w-1", gt=0) == written[:1]
        assert await asyncio.to_thread(recorder.insert_events, written[1:2]) == [2]
    finally:
        factory.close()
        restrained.close()


_TOKEN_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_:~+=!@#$%^&()[]{}|;,"


def test_an_originator_id_and_its_subject_map_both_ways():
    from hypothesis import given
    from hypothesis import strategies as st

    from events.jetstream import ID_TYPE_HEADER, originator_of, originator_subject

    token = st.text(alphabet=_TOKEN_CHARS, min_size=1, max_size=12)
    kinds = token.filter(lambda kind: kind != "aggregate")
    dotted = st.builds(lambda kind, parts: ".".join([kind, *parts]), kinds, st.lists(token, min_size=1, max_size=3))
    ids = st.one_of(st.uuids(), token, dotted)

    @given(ids)
    def round_trip(originator_id):
        subject = originator_subject("p.ev", originator_id)
        headers = {ID_TYPE_HEADER: "uuid"} if isinstance(originator_id, uuid.UUID) else {}
        assert subject.startswith("p.ev.") and " " not in subject
        assert originator_of("p.ev", subject, headers) == originator_id

    round_trip()


def test_a_server_that_drops_allow_atomic_is_refused_naming_its_version():
    """nats-server before 2.12 does not know `allow_atomic` and answers the stream's config without
    it; it would then store a batch's messages one by one (a placement without its fence). The
    store refuses such a stream, naming the server's version and the one it needs."""
    from events.jetstream.stream import MIN_SERVER, refuse_without_atomic

    refuse_without_atomic("W_EVENTS", {"name": "W_EVENTS", "allow_atomic": True}, "2.15.1")  # kept: taken
    with pytest.raises(OperationalError) as refused:
        refuse_without_atomic("W_EVENTS", {"name": "W_EVENTS"}, "2.11.4")
    assert str(refused.value) == (f"stream W_EVENTS does not allow atomic batches on nats-server 2.11.4: warmboot's "
                                  f"appends are JetStream atomic batches, which need nats-server {MIN_SERVER} or later")


def test_the_store_judges_the_config_the_server_answered(nats_url, monkeypatch):
    """At its start the store hands `refuse_without_atomic` the config the server answered (made,
    or brought up to date) and the server's version: what a 2.11 server would answer without
    `allow_atomic` is what it would refuse."""
    from events.jetstream import stream as stream_module

    judged: list[tuple[str, dict, str]] = []
    real = stream_module.refuse_without_atomic

    def spy(name, config, server):
        judged.append((name, config, server))
        real(name, config, server)

    monkeypatch.setattr(stream_module, "refuse_without_atomic", spy)
    prefix = new_prefix()
    app_on(nats_url, prefix).close()  # makes the stream
    app_on(nats_url, prefix).close()  # finds it
    assert [name for name, _, _ in judged] == [stream_name(prefix)] * 2
    assert all(config.get("allow_atomic") is True and config["name"] == stream_name(prefix) for _, config, _ in judged)
    assert all(server.count(".") == 2 for _, _, server in judged), judged  # e.g. 2.15.1


def test_a_subscription_queues_what_comes_while_its_reader_is_behind_without_a_limit(nats_url):
    """nats-py drops what a push subscription's queue cannot take (524,288 messages or 256 MiB by
    default) and counts it delivered all the same: a process application's follower held behind its
    thread lost events for good (an audit's reproduction lost a WorkerRemoved, its worker's actors
    never released). The subscription's queue has no limit (`events.natspy.jetstream.NO_DROPS`)."""
    app = app_on(nats_url, new_prefix())
    try:
        subscription = app.recorder.subscribe(gt=None)
        try:
            queued = subscription._consumer._sub
            assert (queued._pending_queue.maxsize, queued._pending_bytes_limit) == (0, 0)
        finally:
            subscription.stop()
    finally:
        app.close()


FINALIZED_IN_ACQUIRE = r"""
import gc, sys
from events.aggregate import WireApplication
from events.jetstream import link as links
from services.process import store_env

url, prefix = sys.argv[1:3]
gc.disable()  # the application below is freed by the collection made in Link, nowhere else
app = WireApplication(env=store_env(url, prefix))
held = app.factory.link
app.cycle = app  # only a collection frees it, and runs its __del__ (which closes it)
del app

made = links.Link.__init__

def making(self, *args, **kwargs):
    gc.collect()  # as any allocation while a link is made may start one
    made(self, *args, **kwargs)

links.Link.__init__ = making
other = links.acquire(links.ConnectOptions(url.replace("127.0.0.1", "localhost")))
print("released", held.refs, held.closed, flush=True)
links.release(other)
"""


def test_an_application_finalized_while_a_link_is_made_releases_its_own(nats_url, prefix):
    """An Application freed by the garbage collector closes its factory in `__del__`, on
    whatever thread the collection ran, at whatever allocation started it: one started
    while `acquire` made a link (holding the links' lock) released the application's link
    under that same lock, and the thread waited for itself for ever (a hang seen in CI)."""
    assert "127.0.0.1" in nats_url
    done = subprocess.run(
        [sys.executable, "-c", FINALIZED_IN_ACQUIRE, nats_url, prefix],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "released 0 True"
