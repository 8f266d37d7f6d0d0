"""The scheduler's fold reads its stream through `events.natspy.frames.deliver_directly`: data
messages are handed from the connection's read loop straight to the fold (its frame
reader reads ahead of nats-py's parser), everything else takes nats-py's own path. On a
real server: the bookkeeping of the ordered consumer is what nats-py's path leaves, a
pause hands messages to nats-py's path and nothing is folded out of order or twice, a
consumer lost on the server is re-created by nats-py and the fold carries on from where
it was, and a backlog large enough for flow control is read to its end."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from nats.aio.client import Client

from events.errors import ContractError
from events.natspy.frames import NATS_PROTOCOL, deliver_directly
from events.natspy.headers import use_lean_headers
from events.natspy.jetstream import ORDERED_IDLE_HEARTBEAT_S, ack_positions, ack_time
from events.subjects import stream_name
from services.scheduler.fold import Fold
from services.scheduler.projection import Projection
from tests.factories import created, ensure_stream, last_seq, publish_events


async def load(nc, prefix: str, first: int, count: int, versions: dict[str, int]) -> int:
    """`count` ActorCreated events (actors a<first>...), published; the stream's last sequence."""
    await publish_events(nc, prefix, [created(f"a{i}") for i in range(first, first + count)], versions)
    return await last_seq(nc, prefix)


class Arrivals:
    """Announces the messages a connection's subscription has received, by either path: it
    wraps the parse of each chunk the connection's read loop got (direct delivery's frame
    reader included), after which nats-py has counted its messages in the subscription's
    `_received`."""

    def __init__(self, conn, psub):
        self.sub = psub._sub
        self.waiters: list[tuple[int, asyncio.Future[None]]] = []
        parser = getattr(conn, NATS_PROTOCOL)
        parse = parser.parse

        async def counted(data: bytes = b"") -> None:
            await parse(data)
            for n, waiter in self.waiters:
                if self.sub._received >= n and not waiter.done():
                    waiter.set_result(None)

        parser.parse = counted

    async def reach(self, n: int, what: str, timeout: float = 30.0) -> None:
        """Return once the subscription has received `n` messages, or fail."""
        if self.sub._received >= n:
            return
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append((n, waiter))
        try:
            await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"not within {timeout:g}s: {what} ({self.sub._received} of {n})") from None


async def fold_of(nats_url: str, nc, prefix: str, count: int):
    """A stream of `count` events and a Fold on a connection of its own, not started; the
    sequences it folds are appended to `order`."""
    await ensure_stream(nats_url, prefix)
    versions: dict[str, int] = {}
    first = await load(nc, prefix, 0, count, versions)
    conn = await nats.connect(nats_url)
    fold = Fold(conn, prefix, Projection())
    order: list[int] = []
    fold.listeners.append(order.append)
    return conn, fold, order, versions, first


def jsi_state(psub) -> tuple:
    inner = psub._sub
    jsi = inner._jsi
    return jsi._dseq, jsi._sseq, jsi._fciseq, inner._received


async def test_direct_delivery_leaves_the_bookkeeping_nats_py_s_own_path_leaves(nats_url, prefix, nc):
    await ensure_stream(nats_url, prefix)
    versions: dict[str, int] = {}
    end = await load(nc, prefix, 0, 300, versions)
    stream = stream_name(prefix)
    seen: dict[str, list] = {"nats-py": [], "direct": []}
    done = {name: asyncio.get_running_loop().create_future() for name in seen}
    conns, subs = [], {}
    try:
        for name in seen:
            conn = await nats.connect(nats_url)
            use_lean_headers(conn)
            conns.append(conn)

            async def cb(msg, name=name) -> None:  # nats-py's path
                seq, pending = ack_positions(msg.reply)
                seen[name].append((seq, pending, msg.subject, msg.headers, msg.data, ack_time(msg.reply)))
                if seq == end:
                    done[name].set_result(None)

            def handler(seq, pending, subject, headers, data, stamp, name=name) -> None:  # direct
                seen[name].append((seq, pending, subject, headers, data, int(stamp)))
                if seq == end:
                    done[name].set_result(None)

            psub = await conn.jetstream().subscribe(f"{prefix}.>", stream=stream, cb=cb, ordered_consumer=True,
                                                    idle_heartbeat=ORDERED_IDLE_HEARTBEAT_S)
            subs[name] = psub
            if name == "direct":
                deliver_directly(conn, psub, handler, lambda psub=psub: psub._sub._pending_queue.empty())
        await asyncio.wait_for(asyncio.gather(*done.values()), 30)
        assert [m[0] for m in seen["direct"]] == list(range(1, end + 1))
        assert seen["direct"] == seen["nats-py"]  # the same messages, headers and positions, either way
        assert jsi_state(subs["direct"]) == jsi_state(subs["nats-py"]) == (end + 1, end, end, end)
    finally:
        for conn in conns:
            await conn.close()


async def test_a_paused_fold_takes_nats_py_s_path_and_folds_everything_once_in_order(nats_url, prefix, nc):
    conn, fold, order, versions, first = await fold_of(nats_url, nc, prefix, 50)
    callbacks = 0
    on_msg = fold._on_msg

    async def counted(msg) -> None:
        nonlocal callbacks
        callbacks += 1
        await on_msg(msg)

    fold._on_msg = counted  # the callback the subscription is made with
    try:
        await fold.start(30)
        assert fold.applied == first
        arrivals = Arrivals(conn, fold._sub)
        async with fold.paused():
            during = await load(nc, prefix, 50, 200, versions)
            await arrivals.reach(during, "the paused fold's connection got the load")
            assert fold.applied == first and not fold._direct_ready()
            # more keeps arriving while the pause ends: direct delivery must wait for nats-py's
            # path to hand over everything it holds
            more = asyncio.create_task(publish_events(nc, prefix, [created(f"a{i}") for i in range(250, 650)],
                                                      versions))
            await arrivals.reach(during + 20, "more arrived during the pause")
        assert not fold._direct_ready()  # the pause is over, but nats-py's path still holds messages
        await more
        after = await last_seq(nc, prefix)
        await fold.wait(after, 30)
        assert order == list(range(1, after + 1))  # each once, in stream order, across both paths
        assert fold.projection.events == after and len(fold.projection.actors) == 650
        assert fold._direct_ready()
        assert callbacks >= during - first  # what arrived during the pause went through nats-py's path
    finally:
        await fold.stop()
        await conn.close()


async def test_a_consumer_lost_on_the_server_is_made_again_and_the_fold_carries_on(nats_url, prefix, nc):
    conn, fold, order, versions, first = await fold_of(nats_url, nc, prefix, 100)
    try:
        await fold.start(30)
        jsm = nc.jsm()
        [lost] = await jsm.consumers_info(stream_name(prefix))
        await jsm.delete_consumer(stream_name(prefix), lost.name)
        end = await load(nc, prefix, 100, 100, versions)
        await fold.wait(end, 30)  # nats-py misses two idle heartbeats and makes the consumer again
        [made] = await jsm.consumers_info(stream_name(prefix))
        assert made.created > lost.created and made.delivered.stream_seq == end  # made again, read to the end
        assert order == list(range(1, end + 1))
        assert fold.projection.events == end
    finally:
        await fold.stop()
        await conn.close()


async def test_a_backlog_past_the_flow_control_window_is_read_to_its_end(nats_url, prefix, nc):
    await ensure_stream(nats_url, prefix)
    end = await load(nc, prefix, 0, 20_000, {})
    conn = await nats.connect(nats_url)
    measured: list[float] = []
    fold = Fold(conn, prefix, Projection(), on_cpu=measured.append)
    try:
        cpu = time.process_time()
        await fold.start(120)
        cpu = time.process_time() - cpu
        assert fold.applied == end and fold.projection.events == end
        assert conn.stats["in_msgs"] >= end  # direct deliveries are counted as nats-py counts its own
        # the fold's CPU is told per run of messages read together, not per message, and is part
        # of what this process spent meanwhile
        assert 0 < len(measured) < end / 10
        assert 0 < sum(measured) <= cpu
    finally:
        await fold.stop()
        await conn.close()


def test_direct_delivery_refuses_a_nats_py_without_the_parser_it_reads_ahead_of(monkeypatch):
    from nats.protocol import parser as nats_parser

    client = Client()
    assert isinstance(getattr(client, NATS_PROTOCOL, None), nats_parser.Parser)
    monkeypatch.delattr(nats_parser, "AWAITING_CONTROL_LINE")
    with pytest.raises(RuntimeError, match="natspy"):
        deliver_directly(client, None, lambda *a: None, lambda: True)


class _HeldStreamInfo:
    """A JetStream context whose `stream_info` is read at the server when asked, and handed
    back only once the test releases it (a busy read loop, a JetStream API queue)."""

    def __init__(self, js, asked: list[asyncio.Event], release: asyncio.Event):
        self._js, self._asked, self._release = js, asked, release

    async def stream_info(self, name):
        info = await self._js.stream_info(name)
        next(event for event in self._asked if not event.is_set()).set()
        await self._release.wait()
        return info

    def __getattr__(self, name):
        return getattr(self._js, name)


async def test_a_seq_written_after_the_log_s_end_was_asked_is_not_past_the_end(nc, prefix, writer):
    """A wait for a sequence past what the fold knows asks the stream's last sequence; a wait
    that comes later, for a sequence written meanwhile, must not take that answer (it was read
    before the sequence existed): it asks again, and is answered once the fold has it."""
    from tests.factories import entry, registered, version

    await asyncio.to_thread(writer.write, registered("w", entry(version("1"))))
    fold = Fold(nc, prefix, Projection())
    await fold.start(10)
    asked, release = [asyncio.Event(), asyncio.Event()], asyncio.Event()
    real = nc.jetstream
    nc.jetstream = lambda *a, **k: _HeldStreamInfo(real(*a, **k), asked, release)
    try:
        far = asyncio.ensure_future(fold.wait(2**53, 30))
        await asyncio.wait_for(asked[0].wait(), 10)  # its question is out, its answer held
        async with fold.paused():  # the fold folds nothing meanwhile (a checkpoint's copy, say)
            seq = await asyncio.to_thread(writer.write, created("a"))  # in the log
            mine = asyncio.ensure_future(fold.wait(seq, 30))
            await asyncio.wait_for(asked[1].wait(), 10)  # a question of its own, not the one out
            release.set()
            with pytest.raises(ContractError, match="past the end of the log"):
                await far
        await asyncio.wait_for(mine, 10)
        assert fold.projection.seq >= seq and fold._waiters == []
    finally:
        nc.jetstream = real
        await fold.stop()


@pytest.mark.parametrize("headers", [
    {"X-Pad": "a" * 20000},  # over the services' 16 KiB cap (`MAX_HEADER_BYTES`), which guards their connection
    b"NATS/1.1\r\nX: \xc3\xa9\r\n\r\n",  # not `NATS/1.0`: nats-py reads the lines after it, errors replaced
])
async def test_a_message_nats_py_reads_is_folded_past_not_dropped(nats_url, nc, prefix, headers):
    """The frame reader drops a message nats-py could not read (it would end the connection's read
    loop), and one with a header block over the services' cap. On the fold's ordered consumer a
    dropped message is a gap: the consumer is made again at it, and it is dropped again, for ever,
    in every replica (the review's run: the fold stuck at sequence 5 of 9, 26 resets). Such a
    message nats-py reads (a big header block, a block whose first line is not NATS/1.0) is folded
    past: the fold reaches the stream's end, on a connection guarded as the services' is."""
    from events.natspy.frames import guard_reads
    from events.natspy.publish import flush_in_order, publish
    from services.endpoints import MAX_HEADER_BYTES

    await ensure_stream(nats_url, prefix)
    versions: dict[str, int] = {}
    await publish_events(nc, prefix, [created(f"a{i}") for i in range(5)], versions)
    conn = await nats.connect(nats_url)
    guard_reads(conn, max_header_bytes=MAX_HEADER_BYTES)  # as `add_endpoints` guards the scheduler's connection
    fold = Fold(conn, prefix, Projection())
    await fold.start(30)
    try:
        if isinstance(headers, bytes):
            await publish(nc, f"{prefix}.ev.misc.x", b"{}", headers=headers)
        else:
            await nc.publish(f"{prefix}.ev.misc.x", b"{}", headers=headers)
        await flush_in_order(nc)
        await publish_events(nc, prefix, [created(f"b{i}") for i in range(3)], versions)
        end = await last_seq(nc, prefix)
        await fold.wait(end, 10)
        assert fold.applied == end and conn._warmboot_frames.dropped == 0
    finally:
        await fold.stop()
        await conn.close()


class _NoLeaderFor:
    """A JetStream context whose first `failures` questions about the stream find no responders
    (an election), each counted; then the real answer."""

    def __init__(self, js, failures: int, asked: list):
        self._js, self._failures, self._asked = js, failures, asked

    async def stream_info(self, name):
        self._asked.append(name)
        if len(self._asked) <= self._failures:
            raise nats.errors.NoRespondersError()
        return await self._js.stream_info(name)

    def __getattr__(self, name):
        return getattr(self._js, name)


@pytest.mark.parametrize("failures", [3, 10**6])
async def test_the_fold_is_brought_to_the_log_s_end_through_failed_questions_or_says_unavailable(
        nc, prefix, writer, failures):
    """`Fold.current` (what a fallback that gives up an image, and a refusal that points at revert,
    wait for): a question about the log's end that fails at once (no responders during an election)
    is asked again, a little later each time, until the fold has the end; if the leader never
    answers, UNAVAILABLE once the time is up, not at the first failure (found by a review)."""
    from tests.factories import entry, registered, version

    await asyncio.to_thread(writer.write, registered("w", entry(version("1"))))
    fold = Fold(nc, prefix, Projection())
    await fold.start(10)
    asked: list = []
    real = nc.jetstream
    try:
        async with fold.paused():  # written where the fold has not read it yet
            seq = await asyncio.to_thread(writer.write, created("a"))
            nc.jetstream = lambda *a, **k: _NoLeaderFor(real(*a, **k), failures, asked)
        if failures < 10:
            await fold.current(30)
            assert fold.projection.seq >= seq and len(asked) == failures + 1
        else:
            with pytest.raises(ContractError, match="did not say where the log ends") as refused:
                await fold.current(1.0)
            assert refused.value.code.value == "UNAVAILABLE" and len(asked) > 3  # asked again meanwhile
    finally:
        nc.jetstream = real
        await fold.stop()
