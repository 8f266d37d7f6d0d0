"""The nats-py workarounds (events.natspy): the lean header parser reads every block as
its line-by-line byte parser does, and as nats-py does for the names NATS clients write
(its table of lines seen changes nothing but the speed); it is installed on a connection
the one way the project installs it, and a nats-py that renames the private parser
fails here, loudly, instead of leaving replays silently slower."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

import pytest

from events.natspy import headers
from events.natspy.headers import (NATS_PARSER, _parse_bytes, header_value, header_values, parse_header_block,
                                   parse_header_lines, use_lean_headers)
from events.natspy.jetstream import ack_positions

SAMPLES = [
    b"Nats-Msg-Id: worker.w-1:1\r\nWarmboot-Topic: WorkerDrained\r\nWarmboot-Version: 1\r\n",
    b"Nats-Stream: T_EVENTS\r\nNats-Subject: t.ev.worker.w-1\r\nNats-Sequence: 7\r\n\r\n",
    b"A:b\r\nBad Name: x\r\nC:\t d \r\nno colon here\r\n",
    "Reason: caf\u00e9 \u2014 ok\r\n".encode(),
    b"\xff\xfe: dropped\r\nKept: \xff\r\n",
    b": no name\r\n \x0b: blank name\r\nDel\x7f: x\r\nCtl\x01: y\r\nSep\x1c: z\r\nA: 1\r\nA: 2\r\n",
    b"K:\x0c v \x0b\r\nL: a\nb\r\nM:\r\nN: \r\n\r\n\r\n",
]

# the characters header blocks are made of, the awkward ones included
_CHARS = st.sampled_from(list(":- \t\r\n\x0b\x0c\x1c\x7f\x01aZ09é\u2014") + ["\r\n"])
_LINE = st.lists(_CHARS, max_size=12).map("".join)
_BLOCK = st.lists(_LINE, max_size=6).map(lambda lines: "\r\n".join(lines).encode())
_TOKEN = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, blacklist_characters=":"), min_size=1,
                 max_size=8)
_VALUE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12)
_WELL_FORMED = st.lists(st.tuples(_TOKEN, _VALUE), max_size=8).map(
    lambda pairs: "".join(f"{k}: {v}\r\n" for k, v in pairs).encode() + b"\r\n")


def test_samples_read_as_the_byte_parser_and_nats_py_read_them():
    for raw in SAMPLES:
        assert parse_header_lines(raw) == _parse_bytes(raw)
        assert parse_header_lines(raw) == parse_header_lines(raw)  # again, from the table
    for raw in SAMPLES[:5]:  # names that are tokens (or not ASCII at all): nats-py agrees
        assert parse_header_lines(raw) == Client._parse_header_lines(raw)


@settings(max_examples=400, deadline=None)
@given(_BLOCK)
def test_any_block_reads_as_the_byte_parser_reads_it(raw):
    assert parse_header_lines(raw) == _parse_bytes(raw)
    assert parse_header_lines(raw) == _parse_bytes(raw)


@settings(max_examples=300, deadline=None)
@given(_WELL_FORMED)
def test_blocks_of_tokens_read_as_nats_py_reads_them(raw):
    assert parse_header_lines(raw) == Client._parse_header_lines(raw)


# blocks made of header names and the bytes around them that make a line read otherwise
_PIECES = st.sampled_from(["Warmboot-Topic", "X-Warmboot-Topic", "Warmboot-Topics", "warmboot-topic", ":", ": ",
                           " ", "\t", "\x0b", "\r\n", "\n", "\r", "a", "7", "\u00e9", "\x01"])
_NAMED_BLOCK = st.lists(_PIECES, max_size=24).map(lambda pieces: "".join(pieces).encode())


@settings(max_examples=3000, deadline=None)
@given(_NAMED_BLOCK, st.sampled_from(["Warmboot-Topic", "a", "X-Warmboot-Topic"]))
def test_one_header_s_value_is_the_one_the_full_parser_gives(raw, name):
    assert header_value(raw, name) == parse_header_lines(raw).get(name) == _parse_bytes(raw).get(name)


@settings(max_examples=3000, deadline=None)
@given(_NAMED_BLOCK, st.lists(st.sampled_from(["Warmboot-Topic", "a", "X-Warmboot-Topic", "Warmboot-Topics"]),
                              min_size=1, max_size=3, unique=True))
def test_several_headers_values_are_the_ones_the_full_parser_gives(raw, names):
    full = parse_header_lines(raw)
    assert header_values(raw, tuple((n, n.encode()) for n in names)) == {n: full[n] for n in names if n in full}


@given(_BLOCK | _WELL_FORMED, st.sampled_from(["a", "Z", "a-", "A"]))
def test_one_header_s_value_is_the_full_parser_s_for_any_block(raw, name):
    assert header_value(raw, name) == parse_header_lines(raw).get(name)


def test_one_header_s_value_from_the_blocks_the_store_writes():
    raw = (b"Nats-Msg-Id: actor.a1:3\r\nWarmboot-Topic: ActorPlaced\r\nWarmboot-Version: 3\r\n"
           b"Nats-Expected-Last-Subject-Sequence: 52\r\nNats-Batch-Id: mo9H\r\nNats-Batch-Sequence: 5\r\n\r\n")
    assert header_value(raw, "Warmboot-Topic") == "ActorPlaced"
    assert header_value(raw, "Warmboot-Version", b"Warmboot-Version") == "3"
    assert header_value(raw, "Nats-Batch-Commit") is None
    assert header_value(b"Warmboot-Topic: A\r\n Warmboot-Topic : B\r\n", "Warmboot-Topic") == "B"  # the last wins


def test_the_table_of_lines_stays_bounded_and_is_only_a_cache():
    blocks = [f"Nats-Msg-Id: actor.a{i}:1\r\nWarmboot-Topic: ActorCreated\r\n\r\n".encode() for i in range(10_000)]
    for raw in blocks:
        assert parse_header_lines(raw) == _parse_bytes(raw)
        assert len(headers._lines) <= headers._LINES_KEPT


def test_a_long_header_line_is_read_but_not_kept():
    """A publisher chooses its header lines: 200 distinct lines of 100 kB each would have kept
    40 MB in the table (and 4,096 of 1 MB, 8 GB) for as long as the process ran."""
    headers._lines.clear()
    for i in range(200):
        raw = f"X-{i}: {'v' * 100_000}\r\nWarmboot-Topic: ActorCreated\r\n\r\n".encode()
        assert parse_header_lines(raw) == _parse_bytes(raw)
    assert set(headers._lines) == {"Warmboot-Topic: ActorCreated", ""}


def test_nats_py_still_has_the_parser_this_module_replaces():
    # If this fails, a new nats-py renamed or removed its private header parser: teach
    # events/natspy/headers.py the new name (replays would otherwise run at nats-py's own speed).
    assert callable(getattr(Client, NATS_PARSER, None))
    assert Client._parse_header_lines(SAMPLES[0]) == parse_header_lines(SAMPLES[0])


def test_the_lean_parser_is_installed_on_a_connection_and_refuses_a_changed_nats_py(monkeypatch):
    nc = Client()
    use_lean_headers(nc)
    assert getattr(nc, NATS_PARSER) is parse_header_lines
    assert Client._parse_header_lines is not parse_header_lines  # the class is left as it is
    monkeypatch.delattr(Client, NATS_PARSER)
    with pytest.raises(RuntimeError, match="natspy"):
        use_lean_headers(Client())


def test_a_stream_msg_get_block_and_an_ack_subject_are_read_alike_everywhere():
    assert parse_header_block(b"NATS/1.0\r\nA: 1\r\nA: 2\r\n\r\n") == {"A": "2"}  # the last wins, as nats-py
    assert parse_header_block(b"") == {}
    assert ack_positions("$JS.ACK.S.C.1.42.7.1700000000.3") == (42, 3)
    assert ack_positions("$JS.ACK.dom.acc.S.C.1.42.7.1700000000.3.rnd") == (42, 3)


# --- the frame reader of direct delivery (`_Frames`) against nats-py's own parser ---------------

class _Recorder:
    """A connection as nats-py's parser sees one: what each frame made it do, in order."""

    def __init__(self, routed_sid: int | None):
        from nats.protocol.parser import Parser

        self.log: list[tuple] = []
        self._subs = {1: object(), 2: object()}
        self.routed = self._subs[routed_sid] if routed_sid is not None else None
        self._ps = Parser(self)

    async def _process_msg(self, sid, subject, reply, data, headers):
        self.log.append(("msg", sid, subject, reply, data, headers))

    async def _process_ping(self):
        self.log.append(("ping",))

    async def _process_pong(self):
        self.log.append(("pong",))

    async def _process_info(self, info):
        self.log.append(("info", info))

    async def _process_err(self, err):
        self.log.append(("err", err))


class _Route:
    """Takes the messages of its subscription whose reply is a JetStream ack subject."""

    on_cpu = None

    def __init__(self, log: list):
        self.log = log

    def take(self, subject, reply, data, headers) -> bool:
        if not reply.startswith(b"$JS.ACK."):
            return False
        self.log.append(("direct", subject, reply, data, headers))
        return True


_PAYLOAD = st.binary(max_size=40) | st.sampled_from([b"", b"\r\n", b"HMSG a 1 2 3\r\n", b"PING\r\n"])
_HEADERS = st.sampled_from([b"NATS/1.0\r\nA: b\r\n\r\n", b"NATS/1.0 100 Idle Heartbeat\r\n\r\n",
                            b"NATS/1.0\r\n\r\n"])
_FRAME = st.one_of(
    st.tuples(st.just("HMSG"), st.sampled_from([1, 2]), st.sampled_from([b"", b"$JS.ACK.S.C.1.2.3.4.0", b"_INBOX.x"]),
              _HEADERS, _PAYLOAD),
    st.tuples(st.just("MSG"), st.sampled_from([1, 2]), st.sampled_from([b"", b"_INBOX.y", b"$JS.ACK.S.C.1.2.3.4.0"]),
              st.none(), _PAYLOAD),
    st.sampled_from([("PING",), ("PONG",), ("+OK",), ("INFO",)]),
)


def _wire(frame: tuple) -> bytes:
    kind = frame[0]
    if kind == "HMSG":
        _, sid, reply, head, payload = frame
        middle = b" " + reply if reply else b""
        return (b"HMSG t.s%d %d%s %d %d\r\n" % (sid, sid, middle, len(head), len(head) + len(payload))
                + head + payload + b"\r\n")
    if kind == "MSG":
        _, sid, reply, _, payload = frame
        middle = b" " + reply if reply else b""
        return b"MSG t.s%d %d%s %d\r\n" % (sid, sid, middle, len(payload)) + payload + b"\r\n"
    if kind == "INFO":
        return b'INFO {"server_id":"x","max_payload":1048576}\r\n'
    return kind.encode() + b"\r\n"


@settings(max_examples=1500, deadline=None)
@given(st.lists(_FRAME, max_size=12), st.sampled_from([1, 2, None]), st.lists(st.integers(0, 400), max_size=8),
       st.integers(0, 400))
def test_the_frame_reader_does_what_nats_py_s_parser_does_frame_by_frame(frames, routed, cuts, installed_at):
    """Whatever the chunks a connection's reads cut the wire into, and whenever the reader is
    installed (nats-py inside a frame included): every frame leads to what nats-py's own
    parser does with it, in the same order, except that the data messages the route takes
    are handed to it instead of to nats-py's dispatch. A message whose control line nats-py
    had read before the install is finished by nats-py, and dispatched as nats-py does."""
    import asyncio

    from events.natspy.frames import _Frames

    pieces = [_wire(f) for f in frames]
    wire = b"".join(pieces)
    at = min(installed_at, len(wire))
    begun = []  # for each message frame: whether nats-py had read its control line at the install
    offset = 0
    for frame, piece in zip(frames, pieces):
        if frame[0] in ("HMSG", "MSG"):
            begun.append(offset + piece.index(b"\r\n") + 2 <= at)
        offset += len(piece)

    async def run() -> tuple[list, list]:
        expected_conn = _Recorder(routed)
        expected_route = _Route(expected_conn.log)
        ordinal = iter(begun)

        async def dispatch(sid, subject, reply, data, headers, conn=expected_conn):
            sub = conn._subs.get(sid)
            if (next(ordinal) or sub is None or sub is not conn.routed
                    or not expected_route.take(subject, reply, data, headers)):
                await _Recorder._process_msg(conn, sid, subject, reply, data, headers)

        expected_conn._process_msg = dispatch
        await expected_conn._ps.parse(wire)

        conn = _Recorder(routed)
        await conn._ps.parse(wire[:at])  # nats-py alone, up to the install
        frames_reader = _Frames(conn, {id(conn.routed): _Route(conn.log)} if conn.routed is not None else {})
        conn._ps.parse = frames_reader.parse
        points = sorted({at, len(wire), *(min(at + c, len(wire)) for c in cuts)})
        for a, b in zip(points, points[1:]):
            await conn._ps.parse(wire[a:b])
        return expected_conn.log, conn.log

    expected, actual = asyncio.run(run())
    assert actual == expected


class _StatefulModel:
    """A connection whose routed subscription A (sid 1) is measured and takes a message only
    while nats-py's queue of A is empty (as the fold's `_direct_ready`); nats-py's handling of
    earlier frames changes that state: a message of A's queued by nats-py, a PONG drains the
    queue (the callback caught up), a PING closes the route, a message on sid 2 with reply
    RESET moves A to sid 3 (an ordered consumer's reset). With every frame handed to nats-py
    before the next is routed, the log is the same however frames are batched."""

    def __init__(self):
        from nats.protocol.parser import Parser

        self.a = object()
        self._subs = {1: self.a, 2: object()}
        self.queue: list = []
        self.log: list = []
        self._ps = Parser(self)
        model = self

        class Route:
            sub = self.a

            def on_cpu(self, seconds):
                model.log.append(("cpu",))

            def take(self, subject, reply, data, headers):
                if not reply.startswith(b"$JS.ACK.") or model.queue or (
                        headers is not None and not headers.startswith(b"NATS/1.0\r\n")):
                    return False
                model.log.append(("direct", subject, reply, data, headers))
                return True

        self.route = Route()
        self.routes = {id(self.a): self.route}

    async def _process_msg(self, sid, subject, reply, data, headers):
        self.log.append(("msg", sid, subject, reply, data, headers))
        if self._subs.get(sid) is self.a:
            self.queue.append(data)
        if sid == 2 and reply == b"RESET" and 1 in self._subs:
            self._subs[3] = self._subs.pop(1)

    async def _process_ping(self):
        self.log.append(("ping",))
        self.routes.pop(id(self.a), None)

    async def _process_pong(self):
        self.log.append(("pong",))
        self.queue.clear()

    async def _process_info(self, info):
        self.log.append(("info",))

    async def _process_err(self, err):
        self.log.append(("err",))


_ACK = b"$JS.ACK.S.C.1.2.3.4.0"
_STATEFUL_FRAME = st.one_of(
    st.tuples(st.just("MSG"), st.sampled_from([1, 2]), st.sampled_from([_ACK, b"_INBOX.y", b"RESET"]),
              st.none(), st.binary(max_size=6)),
    st.tuples(st.just("HMSG"), st.sampled_from([1, 2]), st.sampled_from([_ACK, b""]),
              st.sampled_from([b"NATS/1.0\r\nA: b\r\n\r\n", b"NATS/1.0 100 Idle\r\n\r\n"]), st.binary(max_size=6)),
    st.just(("MSG", 1, b"_INBOX.\xff", None, b"x")),  # dropped
    st.sampled_from([("PING",), ("PONG",), ("+OK",)]),
)


@settings(max_examples=1500, deadline=None)
@given(st.lists(_STATEFUL_FRAME, max_size=14), st.lists(st.integers(0, 300), max_size=5))
def test_frames_handed_to_nats_py_together_change_nothing_a_stateful_route_sees(frames, cuts):
    """The frame reader hands consecutive frames for nats-py to it in one call, and whatever
    precedes a routed frame before routing it: against nats-py's parser frame by frame, with
    a route whose answer depends on what nats-py did with the frames before, the log is the
    same, and no work of nats-py's falls inside a measured run of deliveries."""
    import asyncio

    from events.natspy import frames as frames_module
    from events.natspy.frames import _Frames, _stops_nats_py

    wire = b"".join(_wire(f) for f in frames)

    async def frame_by_frame() -> list:
        model = _StatefulModel()

        async def dispatch(sid, subject, reply, data, headers):
            if _stops_nats_py(subject, reply, headers):
                return
            sub = model._subs.get(sid)
            route = model.routes.get(id(sub)) if sub is not None else None
            if route is None or not route.take(subject, reply, data, headers):
                await _StatefulModel._process_msg(model, sid, subject, reply, data, headers)

        model._process_msg = dispatch
        await model._ps.parse(wire)
        return model.log

    async def batched() -> list:
        model = _StatefulModel()
        thread_time = frames_module.time.thread_time

        def clock() -> float:  # each read of the clock starts or ends a measured run
            model.log.append(("clock",))
            return thread_time()

        frames_module.time.thread_time = clock  # the module's `time` is the stdlib's: put back below
        try:
            reader = _Frames(model, model.routes)
            points = sorted({0, len(wire), *(min(c, len(wire)) for c in cuts)})
            for a, b in zip(points, points[1:]):
                await reader.parse(wire[a:b])
        finally:
            frames_module.time.thread_time = thread_time
        return model.log

    expected = asyncio.run(frame_by_frame())
    got = asyncio.run(batched())
    assert [e for e in got if e[0] not in ("clock", "cpu")] == [e for e in expected if e[0] != "cpu"]
    measuring = False
    for entry in got:
        if entry[0] == "clock":
            measuring = not measuring
        elif entry[0] in ("msg", "ping", "pong", "info", "err"):
            assert not measuring, got


def test_the_frame_reader_joins_a_large_frame_once_it_is_whole():
    import asyncio

    from events.natspy.frames import _Frames

    payload = bytes(range(256)) * 400  # 100 kB, read in 1 kB chunks
    wire = _wire(("HMSG", 1, b"$JS.ACK.S.C.1.2.3.4.0", b"NATS/1.0\r\n\r\n", payload)) + b"PING\r\n"

    async def run() -> list:
        conn = _Recorder(1)
        reader = _Frames(conn, {id(conn.routed): _Route(conn.log)})
        for i in range(0, len(wire), 1000):
            await reader.parse(wire[i:i + 1000])
            if i + 1000 < len(wire) - 20:
                assert conn.log == [] and len(reader.pieces) == i // 1000 + 1  # kept as read, not joined
        return conn.log

    log = asyncio.run(run())
    assert log == [("direct", b"t.s1", b"$JS.ACK.S.C.1.2.3.4.0", payload, b"NATS/1.0\r\n\r\n"), ("ping",)]


def test_the_frame_reader_forgets_a_frame_begun_before_a_reconnect():
    """nats-py resets its parser when it reconnects (`Client._ps.reset()`): a frame whose
    beginning came on the old socket never ends, and what the new socket brings is read
    from its first byte."""
    import asyncio

    from events.natspy.frames import _Frames

    first = _wire(("HMSG", 1, b"$JS.ACK.S.C.1.2.3.4.0", b"NATS/1.0\r\n\r\n", b"x" * 100))
    second = _wire(("HMSG", 1, b"$JS.ACK.S.C.1.3.4.5.0", b"NATS/1.0\r\n\r\n", b"y"))

    async def run() -> list:
        conn = _Recorder(1)
        reader = _Frames(conn, {id(conn.routed): _Route(conn.log)})
        conn._ps.parse, conn._ps.reset = reader.parse, reader.reset  # as deliver_directly installs it
        await conn._ps.parse(first[:60])
        conn._ps.reset()
        await conn._ps.parse(b"INFO {}\r\n" + second)
        return conn.log

    assert asyncio.run(run()) == [("info", {}),
                                  ("direct", b"t.s1", b"$JS.ACK.S.C.1.3.4.5.0", b"y", b"NATS/1.0\r\n\r\n")]


# --- direct delivery of a core subscription (`deliver_core`) on a real server -------------------

_CORE_MESSAGES = [  # subject, reply, headers, body
    ("t.core.a", "", None, b""),
    ("t.core.b", "_INBOX.x.1", None, b"{}"),
    ("t.core.c", "_INBOX.x.2", {"A": "b"}, b"one"),
    ("t.core.d", "", {"Nats-TTL": "15s", "KV-Operation": "PURGE", "x": " padded "}, b"\r\nMSG t 1 2\r\n"),
    ("t.core.e", "r", {"Z": ""}, bytes(range(256)) * 300),  # 75 kB: more than one read
    ("t.core.f", "_INBOX.x.3", None, b"last"),
]


_EMPTY_BLOCK = b"HPUB t.core.g _INBOX.x.4 12 14\r\nNATS/1.0\r\n\r\n{}\r\n"
_SENT = [*_CORE_MESSAGES[:-1], ("t.core.g", "_INBOX.x.4", None, b"{}"), _CORE_MESSAGES[-1]]


def _seen(msg) -> tuple:
    return msg.subject, msg.reply, msg.data, msg.headers, msg.sid


async def test_core_delivery_hands_over_what_nats_py_would_and_leaves_it_the_rest(nats_url):
    """A subscription delivered directly gets, from the read loop, the messages nats-py's path
    gives a plain subscription of the same subject on another connection (the same subject,
    reply, body and headers, in the same order), and the connection's and subscription's
    counters move as nats-py moves them. While it is not ready, and for a status message
    (a 503 for a request nobody serves), the subscription's own callback gets them; after
    `close()` too."""
    import nats

    from events.natspy.frames import deliver_core
    from events.natspy.publish import flush_in_order

    sender, plain, direct = [await nats.connect(nats_url) for _ in range(3)]
    try:
        plain_seen, direct_seen, callback_seen = [], [], []
        counts = {"plain": asyncio.Event(), "direct": asyncio.Event(), "callback": asyncio.Event()}

        def note(into: list, name: str, msg) -> None:
            into.append(_seen(msg))
            if msg.data == b"last" or msg.headers and msg.headers.get("Status"):
                counts[name].set()

        async def on_plain(msg):
            note(plain_seen, "plain", msg)

        async def on_callback(msg):
            note(callback_seen, "callback", msg)

        ready = True
        plain_sub = await plain.subscribe("t.core.>", cb=on_plain)
        direct_sub = await direct.subscribe("t.core.>", cb=on_callback)
        delivery = deliver_core(direct, direct_sub, lambda msg: note(direct_seen, "direct", msg), lambda: ready)
        await flush_in_order(plain)
        await flush_in_order(direct)

        async def send_all() -> None:
            for name in counts.values():
                name.clear()
            for subject, reply, headers, body in _CORE_MESSAGES[:-1]:
                await sender.publish(subject, body, reply=reply, headers=headers)
            await flush_in_order(sender)
            sender._transport.write(_EMPTY_BLOCK)  # nats-py never sends one; nats-py reads it as no headers
            subject, reply, headers, body = _CORE_MESSAGES[-1]
            await sender.publish(subject, body, reply=reply, headers=headers)
            await sender.flush()

        await send_all()
        await asyncio.wait_for(asyncio.gather(counts["plain"].wait(), counts["direct"].wait()), 10)
        assert [m[:4] for m in direct_seen] == [m[:4] for m in plain_seen]
        assert [m[:3] for m in direct_seen] == [(s, r, b) for s, r, _, b in _SENT]
        assert [m[3] for m in direct_seen][2:4] == [{"A": "b"}, {"Nats-TTL": "15s", "KV-Operation": "PURGE", "x": "padded"}]
        assert direct_seen[-2][3] is None  # the empty block
        assert callback_seen == [] and {m[4] for m in direct_seen} == {direct_sub._id}
        assert direct_sub._received == plain_sub._received == len(_SENT)
        assert (direct.stats["in_msgs"], direct.stats["in_bytes"]) == (plain.stats["in_msgs"], plain.stats["in_bytes"])

        ready = False  # nats-py's path: the callback
        plain_seen.clear(), direct_seen.clear()
        await send_all()
        await asyncio.wait_for(asyncio.gather(counts["plain"].wait(), counts["callback"].wait()), 10)
        assert direct_seen == [] and [m[:4] for m in callback_seen] == [m[:4] for m in plain_seen]

        ready = True  # a status is nats-py's whatever `ready` says
        callback_seen.clear()
        counts["callback"].clear()
        await direct.publish("t.nobody.serves.this", b"?", reply="t.core.status")  # the reply comes back as a 503
        await asyncio.wait_for(counts["callback"].wait(), 10)
        [(subject, _, data, headers, _)] = callback_seen
        assert subject == "t.core.status" and data == b"" and headers["Status"] == "503"
        assert direct_seen == []

        delivery.close()
        callback_seen.clear()
        await send_all()
        await asyncio.wait_for(counts["callback"].wait(), 10)
        assert direct_seen == [] and len(callback_seen) == len(_SENT)
    finally:
        for nc in (sender, plain, direct):
            await nc.close()


async def test_core_delivery_of_wanted_headers_gives_those_alone_or_all_when_none_is_there(nats_url):
    """With `wanted` (an operator's replay: a direct get's answer carries about six header lines, the
    fold reads four names), a message's headers are only the wanted ones it has, as nats-py would
    parse them; all of them when it has none of those (a reader sees whether there are headers); None
    when it has none at all. The messages, their order and bodies, are those nats-py's path gives."""
    import nats

    from events.natspy.frames import deliver_core
    from events.natspy.publish import flush_in_order

    sender, direct = [await nats.connect(nats_url) for _ in range(2)]
    try:
        seen, done = [], asyncio.Event()

        def on_msg(msg) -> None:
            seen.append(_seen(msg))
            if msg.data == b"last":
                done.set()

        async def on_callback(msg):  # nats-py's path: nothing here while ready
            seen.append(("callback", msg.subject))

        sub = await direct.subscribe("t.core.>", cb=on_callback)
        delivery = deliver_core(direct, sub, on_msg, wanted=("A", "Nats-TTL", "x"))
        await flush_in_order(direct)
        for subject, reply, sent_headers, body in _CORE_MESSAGES:
            await sender.publish(subject, body, reply=reply, headers=sent_headers)
        await sender.flush()
        await asyncio.wait_for(done.wait(), 10)
        assert [m[:3] for m in seen] == [(s, r, b) for s, r, _, b in _CORE_MESSAGES]
        assert [m[3] for m in seen] == [None, None, {"A": "b"}, {"Nats-TTL": "15s", "x": "padded"}, {"Z": ""}, None]
        delivery.close()
    finally:
        for nc in (sender, direct):
            await nc.close()


def test_core_delivery_refuses_a_nats_py_without_what_it_relies_on():
    from events.natspy.frames import deliver_core

    class OldSubscription:  # no `_jsi`, `_future`, ...
        _id = 1

    with pytest.raises(RuntimeError, match="natspy"):
        deliver_core(Client(), OldSubscription(), lambda msg: None)


def test_the_frame_reader_drops_what_nats_py_could_not_read_and_only_that():
    """nats-py decodes a message's subject, reply and status line strictly, and an error there
    ends its read loop for good: such a message is dropped (whatever its subscription), and
    every other frame, UTF-8 that is not ASCII included, reaches nats-py as before: a drop of
    a message nats-py reads would stall a fold for good (a gap its ordered consumer restarts at)."""
    import asyncio

    from events.natspy.frames import _Frames

    def hmsg(head: bytes, reply: bytes = b"_INBOX.x", body: bytes = b"{}") -> bytes:
        return b"HMSG t.s1 1 %s %d %d\r\n%s%s\r\n" % (reply, len(head), len(head) + len(body), head, body)

    wire = [
        b"MSG t.s1 1 _INBOX.ok 2\r\n{}\r\n",
        b"MSG t.s1 1 _INBOX.\xff\xfe 2\r\n{}\r\n",  # a reply that is not UTF-8
        b"MSG t.\xff 2 _INBOX.x 2\r\n{}\r\n",  # a subject that is not UTF-8
        hmsg(b"NATS/1.0 503 \xff\xfe\r\n\r\n"),  # a status line that is not ASCII
        hmsg(b"NATS/1.0 ab\xc3\xa9\r\n\r\n"),  # nats-py cuts a status line by byte counts: "ab\xc3"
        hmsg(b"NATS/1.0"),  # nats-py reads the byte after it: IndexError
        hmsg(b"NATS/1.0", body=b"\r\n{}"),  # the same, the body going on as a header line would
        b"MSG t.a\x0b1 1 2\r\n{}\r\n",  # bytes nats-py splits on and the server does not:
        b"MSG t.a\x0c1 1 _INBOX.x 2\r\n{}\r\n",  # read by nats-py as another sid, or a protocol
        b"HMSG t.s1 1 _INBOX.a\rb 12 14\r\nNATS/1.0\r\n\r\n{}\r\n",  # error and a reconnect
        b"MSG t.a\x0b2 1 \x0c 2\r\n{}\r\n",  # one more argument and one fewer: as many as spaces,
        b"HMSG t.a\x0bb 1 \x0c 12 14\r\nNATS/1.0\r\n\r\n{}\r\n",  # read as sid 2, or an error
        b"MSG t.\xc3\xa9 2 _INBOX.\xc3\xa9 2\r\n{}\r\n",  # UTF-8: nats-py reads it
        hmsg(b"NATS/1.0 503\r\n\r\n", b""),  # a status nats-py reads
        hmsg(b"NATS/1.0\r\nX: \xff\r\n\r\n"),  # a header value nats-py reads with a replacement
        hmsg(b"", b"_INBOX.empty"),  # an empty block: nats-py reads no headers
        hmsg(b"NATS/1.0 \xc3\xa9\r\n\r\n", b"_INBOX.status"),  # UTF-8 whole in the code's 3 bytes: read
        hmsg(b"NATS/1.1\r\nX: \xc3\xa9\r\n\r\n", b"_INBOX.v11"),  # no status: the lines after the first, read
        b"PING\r\n",
    ]

    async def run() -> tuple[list, int]:
        conn = _Recorder(1)
        reader = _Frames(conn, {id(conn.routed): _Route(conn.log)})
        await reader.parse(b"".join(wire))
        return conn.log, reader.dropped

    log, dropped = asyncio.run(run())
    assert dropped == 11
    assert [entry[:4] for entry in log] == [
        ("msg", 1, b"t.s1", b"_INBOX.ok"),
        ("msg", 2, b"t.\xc3\xa9", b"_INBOX.\xc3\xa9"),
        ("msg", 1, b"t.s1", b""),
        ("msg", 1, b"t.s1", b"_INBOX.x"),
        ("msg", 1, b"t.s1", b"_INBOX.empty"),
        ("msg", 1, b"t.s1", b"_INBOX.status"),
        ("msg", 1, b"t.s1", b"_INBOX.v11"),
        ("ping",),
    ]


def test_a_header_block_over_the_connection_s_limit_is_dropped_before_anything_parses_it():
    import asyncio

    from events.natspy.frames import _Frames

    def hmsg(head: bytes) -> bytes:
        return b"HMSG t.s1 1 _INBOX.x %d %d\r\n%s{}\r\n" % (len(head), len(head) + 2, head)

    small = b"NATS/1.0\r\nX: " + b"a" * 40 + b"\r\n\r\n"
    large = b"NATS/1.0\r\nX: " + b"a" * 80 + b"\r\n\r\n"

    async def run() -> tuple[list, int]:
        conn = _Recorder(1)
        reader = _Frames(conn, {id(conn.routed): _Route(conn.log)})
        reader.max_header_bytes = 64  # as `guard_reads(nc, max_header_bytes=64)` sets it
        await reader.parse(hmsg(small) + hmsg(large) + b"PING\r\n")
        return conn.log, reader.dropped

    log, dropped = asyncio.run(run())
    assert dropped == 1 and [entry[0] for entry in log] == ["msg", "ping"] and log[0][5] == small


def test_a_reset_while_nats_py_reads_leaves_the_rest_of_the_old_socket_s_chunk_unread():
    """nats-py resets its parser from inside a parse (an `-ERR` that makes it reconnect): what
    is left of the chunk came from the old socket, and is neither routed nor kept as the
    beginning of a frame for the new socket to finish."""
    import asyncio

    from events.natspy.frames import _Frames

    async def run() -> list:
        conn = _Recorder(1)
        reader = _Frames(conn, {id(conn.routed): _Route(conn.log)})
        conn._ps.parse, conn._ps.reset = reader.parse, reader.reset

        async def err(message):  # as Client._process_err -> _process_op_err -> _ps.reset()
            conn.log.append(("err", message))
            conn._ps.reset()

        conn._process_err = err
        routed = _wire(("HMSG", 1, b"$JS.ACK.S.C.1.2.3.4.0", b"NATS/1.0\r\n\r\n", b"old"))
        partial = _wire(("MSG", 2, b"_INBOX.y", None, b"z" * 50))[:30]
        await conn._ps.parse(b"-ERR 'Stale Connection'\r\n" + routed + partial)
        await conn._ps.parse(b"PING\r\n")  # the new socket
        return conn.log

    assert asyncio.run(run()) == [("err", "'stale connection'"), ("ping",)]


_TOKEN_BYTES = st.binary(min_size=1, max_size=12).filter(lambda b: not any(c in b for c in b" \t\r\n"))


@settings(max_examples=3000, deadline=None)
@given(_TOKEN_BYTES, st.one_of(st.just(b""), _TOKEN_BYTES),
       st.one_of(st.none(), st.binary(max_size=24).map(lambda rest: b"NATS/1.0" + rest), st.binary(max_size=16)))
def test_nats_py_reads_every_message_the_frame_reader_lets_through(subject, reply, head):
    """Whatever bytes a publisher puts in a subject, a reply subject or a header block: either
    the frame reader drops the message, or nats-py's own reading of it (its header block,
    then the message it builds) raises nothing, so its read loop goes on."""
    import asyncio

    from events.natspy.frames import _stops_nats_py

    if _stops_nats_py(subject, reply, head):
        return
    client = Client()

    async def read() -> None:
        headers = await client._process_headers(head)
        client._build_message(1, subject, reply, b"{}", headers)

    asyncio.run(read())


async def test_a_flush_in_order_says_the_server_has_the_subscriptions_made_before_it(nats_url):
    """nats-py's flush writes its PING straight to the socket, ahead of the SUB of a subscription
    its flusher task has not written yet: the PONG then says nothing of that subscription (a
    service flushed after subscribing, and a request sent right after could find no responders).
    `flush_in_order` has the pending commands written first."""
    import nats

    from events.natspy.publish import flush_in_order

    nc = await nats.connect(nats_url)
    try:
        written: list[bytes] = []
        transport = nc._transport
        write, writelines = transport.write, transport.writelines

        def recorded_write(data):
            written.append(bytes(data))
            return write(data)

        def recorded_writelines(lines):
            written.extend(bytes(line) for line in lines)
            return writelines(lines)

        transport.write, transport.writelines = recorded_write, recorded_writelines

        def order(subject: bytes) -> tuple[int, int]:
            sub = next(i for i, data in enumerate(written) if data.startswith(b"SUB " + subject))
            ping = next(i for i, data in enumerate(written) if data == b"PING\r\n")
            return sub, ping

        await nc.subscribe("t.plain")
        await nc.flush()
        sub, ping = order(b"t.plain")
        assert ping < sub  # nats-py's own flush: the PING went first (if this fails, nats-py changed)
        written.clear()
        await nc.subscribe("t.ordered")
        await flush_in_order(nc)
        sub, ping = order(b"t.ordered")
        assert sub < ping
    finally:
        await nc.close()


def test_a_flush_in_order_refuses_a_nats_py_without_what_it_relies_on(monkeypatch):
    import asyncio

    from events.natspy.publish import NATS_PENDING, flush_in_order

    assert callable(getattr(Client, NATS_PENDING, None))
    monkeypatch.delattr(Client, NATS_PENDING)
    with pytest.raises(RuntimeError, match="natspy"):
        asyncio.run(flush_in_order(Client()))


# (subject, reply, headers, payload): what the services publish, and the awkward cases of nats-py's rules
_PUBLISHED = [
    ("t.pub.a", "", None, b"plain"),
    ("t.pub.b", "_INBOX.x.7", None, b""),
    ("t.pub.c", "_INBOX.x.8", {"Nats-TTL": "15s", "  Spaced ": "  v  ", "Line": "a\r\nb"}, b'{"at":1}'),
    ("t.pub.d", "", {"": "skipped", "K": "", "V": "caf\u00e9"}, b"x" * 3000),
    ("t.pub.$JS.ACK.KV_T.sweeper.1.5.5.1733.0", "", None, b"+ACK"),  # a sweep's ack, under the test's subjects
]


async def test_publish_sends_what_nats_py_s_publish_sends(nats_url):
    """`events.natspy.publish.publish`, with the block `header_block` encoded, writes the header block
    nats-py's `publish` writes for the same headers, and the server delivers the same message
    (subject, reply, body, headers) from either, in the order they were sent."""
    import nats

    from events.natspy.headers import header_block
    from events.natspy.publish import flush_in_order, publish

    receiver, sender = await nats.connect(nats_url), await nats.connect(nats_url)
    try:
        commands: list[bytes] = []
        send_command = sender._send_command

        async def recorded(cmd, priority=False):
            commands.append(bytes(cmd))
            await send_command(cmd, priority)

        sender._send_command = recorded
        for subject, reply, head, body in _PUBLISHED:
            commands.clear()
            await sender.publish(subject, body, reply=reply, headers=head)
            [command] = commands
            if head is not None:
                line, _, rest = command.partition(b"\r\n")
                assert rest[:int(line.split()[-2])] == header_block(head)
        sender._send_command = send_command
        await flush_in_order(sender)  # at the server before the receiver subscribes: not received

        got: list[tuple] = []
        done = asyncio.Event()

        async def on_msg(msg):
            got.append((msg.subject, msg.reply, msg.data, msg.headers))
            if len(got) == 2 * len(_PUBLISHED):
                done.set()

        await receiver.subscribe("t.pub.>", cb=on_msg)  # one subscription: its messages come in order
        await flush_in_order(receiver)
        for subject, reply, head, body in _PUBLISHED:
            await sender.publish(subject, body, reply=reply, headers=head)
            await publish(sender, subject, body, reply, header_block(head) if head is not None else b"")
        await sender.flush()
        await asyncio.wait_for(done.wait(), 10)
        assert got[0::2] == got[1::2]
        assert [m[:3] for m in got[0::2]] == [(s, r, b) for s, r, _, b in _PUBLISHED]
        assert got[4][3] == {"Nats-TTL": "15s", "Spaced": "v", "Line": "a  b"}
    finally:
        await sender.close()
        await receiver.close()


async def test_publish_refuses_what_nats_py_s_publish_refuses_and_buffers_nothing(nats_url):
    """A subject or reply with white space would add a protocol command of the caller's making:
    refused, as nats-py refuses it, and nothing is buffered; so are a header name nats-py refuses,
    a payload past the server's limit, and a closed connection."""
    import nats
    import nats.errors

    from events.natspy.headers import header_block
    from events.natspy.publish import publish

    nc = await nats.connect(nats_url)
    try:
        for subject, reply in [("t.a b", ""), ("t.a\r\nPUB t.x 1", ""), ("", ""), ("t.ok", "_INBOX.x\r\nUNSUB 1"),
                               ("t.ok", "_INBOX.x 1"), ("t.a\tb", "")]:
            before = (list(nc._pending), nc._pending_data_size)
            with pytest.raises(nats.errors.BadSubjectError):
                await nc.publish(subject, b"x", reply=reply)
            with pytest.raises(nats.errors.BadSubjectError):
                await publish(nc, subject, b"x", reply)
            assert (nc._pending, nc._pending_data_size) == before
        for name in ["Bad Name", "Col:on", "Nl\r\nX"]:
            with pytest.raises(nats.errors.BadHeaderError):
                await nc.publish("t.ok", b"x", headers={name: "v"})
            with pytest.raises(nats.errors.BadHeaderError):
                header_block({name: "v"})
        with pytest.raises(nats.errors.MaxPayloadError):
            await publish(nc, "t.ok", b"x" * (nc.max_payload + 1))
        # the server's limit is on headers and payload together: past it, it cuts the connection
        # (nats-py's publish lets such a message through, checking the payload alone)
        before = (list(nc._pending), nc._pending_data_size)
        with pytest.raises(nats.errors.MaxPayloadError):
            await publish(nc, "t.ok", b"x" * (nc.max_payload - 10), headers=header_block({"H": "y" * 100}))
        assert (nc._pending, nc._pending_data_size) == before
        reconnects = nc.stats["reconnects"]
        await publish(nc, "t.ok", b"x" * (nc.max_payload - 200), headers=header_block({"H": "y" * 100}))
        await nc.flush(timeout=5)  # the largest message the server takes: carried, the connection kept
        assert nc.stats["reconnects"] == reconnects and nc.is_connected
        await nc.close()
        with pytest.raises(nats.errors.ConnectionClosedError):
            await publish(nc, "t.ok", b"x")
    finally:
        await nc.close()


def test_publish_refuses_a_nats_py_without_what_it_relies_on():
    from events.natspy.publish import publish

    class Old:  # a connection with no outgoing buffer where `publish` writes
        is_closed = is_draining_pubs = False

    with pytest.raises(RuntimeError, match="natspy"):
        asyncio.run(publish(Old(), "t.ok", b"x"))


async def test_a_refusal_that_fits_subjects_in_flight_differing_only_in_case_fails_neither(tmp_path):
    """nats-py hands the server's refusal over in lower case, subject included. A refusal of
    `t.W-1` failed, as refused, a request to `t.w-1` in flight on the same connection, which the
    server had let through and whose reply was on its way (found by an audit of the client).
    Which of the two was refused cannot be told from the words: neither is failed by it, the
    one let through gets its reply, the other ends as it would have without the refusal."""
    import nats as nats_py
    from events.natspy.connections import ErrorsOnce, PublishRefused, unless_refused
    from warmboot.connection import connect
    from warmboot.natsserver import NatsServer

    users = ('authorization { users = [ {user: svc, password: s1}, {user: u, password: u1, permissions: '
             '{publish: {allow: ["t.w-1", "t.w-2"]}, subscribe: {allow: ["_INBOX.>"]}}} ] }')
    server = await asyncio.to_thread(NatsServer(tmp_path / "nats", extra_config=users).start)
    try:
        host = f"{server.host}:{server.port}"
        service = await nats_py.connect(f"nats://svc:s1@{host}")
        release = asyncio.Event()

        async def answer(msg):
            await release.wait()
            await msg.respond(b"answered " + msg.subject.encode())

        await service.subscribe("t.>", cb=answer)
        await service.flush()
        errors = ErrorsOnce(None)
        nc = await connect(f"nats://u:u1@{host}", "test", errors=errors)
        try:
            let_through = asyncio.ensure_future(unless_refused(nc, "t.w-1", nc.request("t.w-1", b"", timeout=30)))
            await nc.flush()  # the server has it: its refusal of the next one comes after
            with pytest.raises(nats_py.errors.TimeoutError):  # not PublishRefused: it cannot be told which
                await unless_refused(nc, "t.W-1", nc.request("t.W-1", b"", timeout=1))
            assert errors.denied is not None and 't.w-1"' in str(errors.denied).lower()  # the refusal came
            assert not let_through.done()
            release.set()
            assert (await let_through).data == b"answered t.w-1"
            # alone in flight, a refused subject is still told at once, whatever its case
            with pytest.raises(PublishRefused):
                await asyncio.wait_for(unless_refused(nc, "t.W-2", nc.request("t.W-2", b"", timeout=30)), 10)
        finally:
            await nc.close()
            await service.close()
    finally:
        await asyncio.to_thread(server.stop)
