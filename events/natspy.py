"""Every workaround of nats-py this project relies on, in one module, installed one way.

nats-py is the project's only NATS client; where its public API is too slow for a
replay of the log, or says less than needed, the gap is closed here and nowhere else:

- Header parsing. Every reader of the event log parses 4 to 7 headers per message,
  and a replay is bound by it. `parse_header_lines` gives the same dict as nats-py's
  `Client._parse_header_lines` (last of duplicate names wins, values stripped and
  decoded as UTF-8 with replacement, names that are not printable ASCII without white
  space skipped) faster: an ASCII block (all the store writes) is decoded once and
  each line is parsed once per distinct line, from a bounded table of short lines (most
  lines recur from message to message: the topic, the version, the batch id; a long one
  is a publisher's choice, and is parsed each time rather than kept). `use_lean_headers(nc)`
  installs it on a connection, the only way it is installed (the event store's link
  and the scheduler's fold both call it). nats-py's parser is a private static method:
  if a new nats-py renames it, `use_lean_headers` raises instead of silently running
  slower, and tests/test_natspy.py pins the parser against nats-py's own.
- `parse_header_block`: the headers of a `STREAM.MSG.GET` answer (a `NATS/1.0` block,
  base64 in the JSON), read by the same rule.
- `ApiError`: the error of a JetStream API answer read as raw JSON.
- `ack_positions`: the stream sequence and the number pending, from the reply subject
  of a JetStream push delivery (`$JS.ACK...`), without building nats-py's metadata
  object per message.
- `ORDERED_IDLE_HEARTBEAT_S`: the idle heartbeat of every ordered consumer (nats-py
  re-creates one only after two missed heartbeats).
- `deliver_directly`: the data messages of one ordered push consumer handed from
  the connection's read loop straight to a synchronous handler, without nats-py's
  protocol parser (a regular expression per message), the message object, the
  subscription's queue and its task that nats-py's own path costs per message (a
  replay, and every scheduler replica's fold of every placement). Its frame reader
  (`_Frames`) reads each chunk the read loop got frame by frame ahead of nats-py's
  parser: a data message of a subscription delivered directly goes to the handler,
  every other frame, whole, to nats-py's parser. It keeps nats-py's bookkeeping of the
  ordered consumer exactly as nats-py would (tests/test_fold_delivery.py compares the
  two), and leaves nats-py everything else: status messages (idle heartbeats, flow
  control), a delivery out of order (nats-py resets the consumer), a subject in another
  format, and every message while the caller says it is not ready (its own callback
  then gets them, in order). It can measure the CPU the deliveries cost (`on_cpu`).
- `guard_recreation`: nats-py re-creates an ordered consumer on its own (missed heartbeats,
  a delivery out of order), from the stream sequence after the last one received, on
  whatever stream has the name then: one deleted and made again included. The caller
  gets to run that re-creation itself (a fold holds its messages, then checks which
  stream its consumer is now on).
- `deliver_core`: the same for a core NATS subscription whose messages are handled
  each on its own (the services' request endpoints, `Replies`' inbox): its messages go
  from the read loop to a synchronous callback, as the `Msg` nats-py would have built,
  without the parser's regular expression, the subscription's queue and its task
  (`subscribe_core` makes such a subscription with the one callback for both paths).
- `ErrorsOnce`: an `error_cb` (its `report`). nats-py's default logs each error with its traceback, so a
  process waiting for its server printed a screenful every half second; this logs each
  error once while it repeats, in one line, and keeps the last for a caller that gives up.
- `guard_reads`: nats-py decodes each message's subject, reply subject and status line
  strictly, and an error there ends the connection's read loop for good, the connection
  still up: one request with a reply subject that is not UTF-8, from any client allowed
  to send one, silenced a service replica, which the server went on sending its share of
  the requests. nats-py also splits a message's line on bytes the server does not split
  it on (`_ODD_SPACE`), and so reads such a message under another sid, or reconnects.
  The frame reader drops such a message instead (and logs it); the services', the
  agent's and the client's connections read through it.
- `flush_in_order`: a flush whose PONG says the server has every command sent before
  it. nats-py's `flush` writes its PING straight to the socket, ahead of the commands
  its flusher task has not written yet (the SUB of a subscription just made): a
  service that flushed after subscribing could still answer "no responders" to a
  request sent right after its start.
- `publish`: nats-py's `publish`, with the same refusals, writing into the same buffer,
  for a header block encoded once (`header_block`, by nats-py's rules): nats-py builds and
  checks the block, and formats the command, for every message (4 to 5 µs with headers
  and a reply against 2, measured). The services answer requests with it, and the registry
  puts heartbeats and acknowledges the sweeper's deliveries with it.
- `connecting`: a connect (nats-py's `Client.connect`), given up on (its caller cancelled, or
  its time up), cancelled until it ends, and its client closed. Python 3.11's
  `asyncio.wait_for`, which nats-py's connect awaits each step with, swallows a cancellation
  that lands as the step completes (the TCP connection made: CPython gh-86296, fixed in
  3.12), and nats-py then goes on connecting, forever with `max_reconnect_attempts=-1`: a
  Ctrl-C of a command waiting for its server, or a stop of an agent or a service before its
  server answered, hung for good.
- `close`: nats-py's close of a connection that is down (reconnecting) raised half way, writing
  what it held to be sent onto the lost transport; what cannot be sent is dropped first.
- `Replies`: many requests in flight over one wildcard inbox, each answered into a
  future. nats-py's `request` arms a timer (`wait_for`) and draws a NUID per call,
  and `publish_async` a timer per call on its semaphore; at thousands of requests a
  second that is a good part of what a request costs. Here one task checks deadlines,
  and the replies are delivered directly (`deliver_core`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from contextlib import suppress
from typing import Any, Awaitable, Callable

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.protocol import parser as nats_parser

from events.tasks import cancel_and_wait, retrieved

# nats-py re-creates an ordered consumer (from the message after the last one received) when
# two heartbeats in a row are missed, and tries again every two heartbeats until it works: a
# consumer lost with its server (a stream leader killed) comes back within 1 to 2 s of a new
# one being possible. An idle stream costs each ordered consumer two messages a second.
ORDERED_IDLE_HEARTBEAT_S = 0.5

NATS_PARSER = "_parse_header_lines"  # the private name nats-py calls on every message with headers
NATS_PROTOCOL = "_ps"  # the private attribute of a connection holding its protocol parser (`Parser`)
NATS_PENDING = "_flush_pending"  # the private coroutine that has nats-py's flusher task write what it holds

log = logging.getLogger("warmboot.natspy")

_HEADER_NAME = re.compile(rb"^[\x21-\x7e]+$")  # printable ASCII, no white space
_WHITESPACE = " \t\n\r\x0b\x0c"  # what bytes.strip() strips
_LINES_KEPT = 4096
_LINE_KEPT_CHARS = 256  # a longer line is parsed each time, not kept (a publisher chooses its lines)

# line -> (name, value), or () for a line that gives no header
_lines: dict[str, tuple[str, str] | tuple[()]] = {}


def parse_header_lines(raw: bytes) -> dict[str, str]:
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return _parse_bytes(raw)
    headers: dict[str, str] = {}
    seen = _lines.get
    for line in text.split("\r\n"):
        pair = seen(line)
        if pair is None:
            pair = _parse_line(line)
            if len(line) <= _LINE_KEPT_CHARS:
                if len(_lines) >= _LINES_KEPT:
                    _lines.clear()
                _lines[line] = pair
        if pair:
            headers[pair[0]] = pair[1]
    return headers


def header_values(raw: bytes, wanted: tuple[tuple[str, bytes], ...]) -> dict[str, str]:
    """The headers of `wanted`, (name, name.encode()) pairs, that `raw` has, as
    `parse_header_lines(raw)` gives them, without parsing the other lines when the last
    line naming each is in the usual form (`Name:` at the start of a line)."""
    found: dict[str, str] = {}
    for name, key in wanted:
        at = raw.rfind(key)  # any line whose name strips to `name` holds these bytes: the last is at or after it
        if at < 0:
            continue
        end = at + len(key)
        if (at == 0 or raw[at - 2:at] == b"\r\n") and raw[end:end + 1] == b":":
            eol = raw.find(b"\r\n", end)
            value = raw[end + 1:] if eol < 0 else raw[end + 1:eol]
            if value.isascii():
                found[name] = value.decode().strip(_WHITESPACE)
                continue
        full = parse_header_lines(raw)  # another form: the full parser says, for every name
        return {n: full[n] for n, _ in wanted if n in full}
    return found


def header_value(raw: bytes, name: str, encoded: bytes | None = None) -> str | None:
    """`parse_header_lines(raw).get(name)`, by `header_values`; `encoded` is `name.encode()`."""
    return header_values(raw, ((name, encoded if encoded is not None else name.encode()),)).get(name)


def _parse_line(line: str) -> tuple[str, str] | tuple[()]:
    """One ASCII line, as `_parse_bytes` reads it."""
    name, sep, value = line.partition(":")
    if not sep:
        return ()
    name = name.strip(_WHITESPACE)
    if not name or not name.isprintable() or " " in name:  # isprintable: \x20-\x7e, for ASCII
        return ()
    return name, value.strip(_WHITESPACE)


def _parse_bytes(raw: bytes) -> dict[str, str]:
    """Any block, line by line: names must be printable ASCII, values are UTF-8."""
    headers: dict[str, str] = {}
    for line in raw.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep:
            name = name.strip()
            if _HEADER_NAME.match(name):
                headers[name.decode("ascii")] = value.strip().decode("utf-8", "replace")
    return headers


def use_lean_headers(nc: Any) -> None:
    """Have the connection `nc` parse message headers with `parse_header_lines`.

    The connection may be shared: every reader of it gets the same headers as before."""
    if not callable(getattr(Client, NATS_PARSER, None)):
        raise RuntimeError(
            f"nats-py {getattr(Client, '__module__', '?')} no longer has Client.{NATS_PARSER}: "
            "events/natspy.py must be taught the new name (or the workaround dropped)"
        )
    if getattr(nc, NATS_PARSER, None) is not parse_header_lines:
        setattr(nc, NATS_PARSER, parse_header_lines)


# A handler of direct deliveries: (stream sequence, messages pending, subject, headers, body, the
# message's stream time in nanoseconds as the reply subject spells it: `ack_time` reads it).
DirectHandler = Callable[[int, int, str, "dict[str, str] | None", bytes, bytes], None]

_ACK_PREFIX = b"$JS.ACK."
_HEADER_LINE = b"NATS/1.0\r\n"  # a block of headers without a status (a status has a space after 1.0)
_CRLF = b"\r\n"
_HMSG = b"HMSG "
_MSG = b"MSG "


def _wanted_headers(headers: bytes | None, wanted: tuple[tuple[str, bytes], ...]) -> dict[str, str] | None:
    """A message's header block (from its `NATS/1.0` line, as the frame holds it) as a direct
    delivery hands it over: with `wanted`, only those headers (`header_values`), or all of them
    when none of those is there (whether there are any others counts); None for no header at all,
    as nats-py gives it (it reads the lines after the `NATS/1.0` one)."""
    if headers is None:
        return None
    block = headers[len(_HEADER_LINE):]
    parsed = header_values(block, wanted) if wanted else None
    return (parsed or parse_header_lines(block)) or None


class _Direct:
    """One subscription delivered directly (see `deliver_directly`)."""

    __slots__ = ("sub", "handler", "ready", "stats", "wanted", "on_cpu")

    def __init__(self, sub: Any, handler: DirectHandler, ready: Callable[[], bool], stats: dict[str, int],
                 wanted: tuple[str, ...], on_cpu: Callable[[float], None] | None = None):
        self.sub = sub
        self.handler = handler
        self.ready = ready
        self.stats = stats
        self.wanted = tuple((name, name.encode()) for name in wanted)  # as header_values takes them
        self.on_cpu = on_cpu  # told the thread CPU of each run of its deliveries, if measured

    def take(self, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> bool:
        """Hand a data message to the handler, doing what nats-py's `_process_msg` does for one
        of an ordered consumer; False (nothing done) for anything nats-py must see itself."""
        if not reply.startswith(_ACK_PREFIX) or (headers is not None and not headers.startswith(_HEADER_LINE)):
            return False
        tokens = reply.split(b".")
        sub = self.sub
        jsi = sub._jsi
        # the 9-token form only: the one whose positions nats-py's ordered consumer reads
        if len(tokens) != 9 or jsi is None or not self.ready():
            return False
        dseq = int(tokens[6])
        if dseq != jsi._dseq:  # out of order: nats-py re-creates the consumer
            return False
        seq = int(tokens[5])
        stats = self.stats
        stats["in_msgs"] += 1
        stats["in_bytes"] += len(data)
        sub._received += 1
        jsi._active = True
        jsi._dseq = dseq + 1
        jsi._sseq = seq
        jsi.track_sequences(reply.decode())
        try:
            self.handler(seq, int(tokens[8]), subject.decode(), _wanted_headers(headers, self.wanted), data,
                         tokens[7])
        except Exception:  # as nats-py reports an exception of a subscription's callback: not fatal
            log.exception("handling message %d on %s failed", seq, subject)
        return True


class _Core:
    """One core NATS subscription delivered directly (see `deliver_core`)."""

    __slots__ = ("nc", "sub", "on_msg", "ready", "on_cpu", "wanted")

    def __init__(self, nc: Any, sub: Any, on_msg: Callable[[Msg], None], ready: Callable[[], bool],
                 wanted: tuple[str, ...] = ()):
        self.nc = nc
        self.sub = sub
        self.on_msg = on_msg
        self.ready = ready
        self.on_cpu = None  # not measured
        self.wanted = tuple((name, name.encode()) for name in wanted)  # as header_values takes them

    def take(self, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> bool:
        """Hand a message to `on_msg` as nats-py's `_process_msg` would hand it to the
        subscription's callback; False (nothing done) for anything nats-py must see itself."""
        if headers is not None and not headers.startswith(_HEADER_LINE):  # a status
            return False
        sub = self.sub
        if sub._jsi is not None or sub._future is not None or sub._max_msgs > 0 or not self.ready():
            return False
        nc = self.nc
        stats = nc.stats
        stats["in_msgs"] += 1
        stats["in_bytes"] += len(data)
        sub._received += 1
        msg = nc.msg_class(subject=subject.decode(), reply=reply.decode(), data=data,
                           headers=_wanted_headers(headers, self.wanted),
                           _client=nc, _sid=sub._id)
        try:
            self.on_msg(msg)
        except Exception:  # as nats-py reports an exception of a subscription's callback: not fatal
            log.exception("handling a message on %s failed", subject)
        return True


DROPS_TOLD_EVERY_S = 60.0  # a connection logs the messages it drops at most this often
_ANY_SIZE = 1 << 62
# Bytes nats-py's parser splits a MSG line on (`\s`) and nats-server does not (it splits on space,
# tab, CR and LF: a lone CR is here only in case another server lets one through):
# in a subject or a reply subject, nats-py misreads the line (a protocol error and a
# reconnect, or the message handed to another subscription of the connection, under a sid
# the publisher wrote). Any client allowed a wildcard in a subject it publishes can send one.
_ODD_SPACE = (b"\r", b"\x0b", b"\x0c")


def _odd_space(line: bytes) -> bool:
    return any(byte in line for byte in _ODD_SPACE)


def _stops_nats_py(subject: bytes, reply: bytes, headers: bytes | None) -> bool:
    """Whether nats-py could not read this message: `_process_msg` decodes the subject and the
    reply as UTF-8, and a status line's code and description too, and reads the byte after
    `NATS/1.0` of a header block that has one; an error there ends the connection's read
    loop for good (nats-py logs "encountered error" and reads nothing more; the connection
    stays up, so the server goes on sending it its share of a queue group's requests). Any
    client allowed to publish a request can send such a message."""
    try:
        subject.decode()
        reply.decode()
    except UnicodeDecodeError:
        return True
    if not headers or headers.startswith(_HEADER_LINE):  # none (nats-py skips an empty block), or no status
        return False
    version = len(_HEADER_LINE) - 2  # `NATS/1.0`, or any 8 bytes: nats-py reads what follows them
    if len(headers) <= version:
        return True  # nats-py reads the byte after them: there is none
    if headers[version] != 0x20:
        return False  # no status line: the lines after the first are read with errors replaced
    line = headers[version + 1:]  # a status line, as `_process_headers` reads it: code, then description
    description = line[4:len(line) - 4]
    end = description.find(_CRLF)
    try:
        line[:3].strip().decode()
        (description[:end] if end > 0 else description).decode()
    except UnicodeDecodeError:
        return True
    return False


class _Frames:
    """The frame reader of one connection: what its read loop hands nats-py's parser, read
    frame by frame ahead of it.

    A message (`HMSG`, or `MSG` when it has no headers) of a subscription delivered directly
    is handed to its route (`_Direct`, `_Core`); every other frame (a message of another
    subscription, a status message, PING, PONG, INFO, +OK, -ERR, or a message the route
    declines) is
    handed whole, in order, to nats-py's own parser, which then does with it what it
    always does (consecutive ones in one call). A frame split across
    reads waits for its end. So nats-py's parser only ever gets whole frames, and is
    between frames whenever this reader reads; the one exception is the moment of
    installing, when nats-py may be inside a frame: it gets exactly the rest of that frame
    first. nats-py resets its parser on a reconnect: so does this reader (a frame begun on
    the old socket never ends). A message nats-py could not read (`_stops_nats_py`: one
    would end its read loop) is dropped, whatever its subscription, and logged.
    """

    __slots__ = ("nc", "ps", "routes", "pieces", "have", "need", "dropped", "resets", "max_header_bytes", "_told")

    def __init__(self, nc: Any, routes: dict[int, "_Direct | _Core"]):
        self.nc = nc
        self.ps = getattr(nc, NATS_PROTOCOL)
        self.routes = routes
        self.pieces: list[bytes] = []  # the beginning of a frame whose end has not been read yet
        self.have = 0  # bytes in `pieces`
        self.need = 0  # bytes the frame begun in `pieces` has, once its control line is read
        self.dropped = 0  # messages nats-py could not have read (`_stops_nats_py`, `_ODD_SPACE`)
        self.resets = 0  # nats-py's resets of its parser (a reconnect)
        self.max_header_bytes = _ANY_SIZE  # a message with a larger header block is dropped (`guard_reads`)
        self._told = -DROPS_TOLD_EVERY_S

    def _drop(self, line: bytes) -> None:
        self.dropped += 1
        moment = time.monotonic()
        if moment - self._told >= DROPS_TOLD_EVERY_S:
            self._told = moment
            log.warning("dropped a message nats-py could not read (%r): a subject or reply subject that is not "
                        "UTF-8 or holds a byte nats-py splits on, a header block's first line that is not "
                        "ASCII or ends at NATS/1.0, or a header block over %d bytes; %d so far on this "
                        "connection", line[:300], self.max_header_bytes, self.dropped)

    def route(self, route: "_Direct | _Core") -> DirectDelivery:
        """Hand `route` the messages of its subscription from now on."""
        self.routes[id(route.sub)] = route
        return DirectDelivery(self.routes, route)

    def reset(self) -> None:
        self.pieces, self.have, self.need = [], 0, 0
        self.resets += 1
        nats_parser.Parser.reset(self.ps)

    async def parse(self, data: bytes = b"") -> None:
        ps = self.ps
        inner = nats_parser.Parser.parse
        resets = self.resets  # a reset while nats-py reads (a reconnect): the rest of `data` is the old socket's
        if self.pieces:
            self.pieces.append(data)
            self.have += len(data)
            if self.have < self.need:  # a large frame still arriving: joined once, when whole
                return
            data = b"".join(self.pieces)
            self.pieces, self.have, self.need = [], 0, 0
        else:
            if ps.state != nats_parser.AWAITING_CONTROL_LINE:  # installed while nats-py was inside a payload
                rest_of_frame = ps.needed + nats_parser.CRLF_SIZE - len(ps.buf)
                await inner(ps, data[:rest_of_frame])
                data = data[rest_of_frame:]
                if ps.state != nats_parser.AWAITING_CONTROL_LINE or self.resets != resets:
                    return
            if ps.buf:  # installed while nats-py had the beginning of a control line
                data = bytes(ps.buf) + data
                ps.buf.clear()
        n = len(data)
        pos = 0
        passed = 0  # data[passed:pos]: whole frames for nats-py's parser, handed over together
        subs, routes, clock, cap = self.nc._subs, self.routes, time.thread_time, self.max_header_bytes
        run: Callable[[float], None] | None = None  # told the CPU of the deliveries since `started`
        started = 0.0
        while pos < n:
            eol = data.find(_CRLF, pos)
            if eol < 0:
                break
            with_headers = data.startswith(_HMSG, pos)
            if with_headers or data.startswith(_MSG, pos):
                # HMSG <subject> <sid> [reply] <header size> <size>, MSG <subject> <sid> [reply] <size>
                line = data[pos + (5 if with_headers else 4):eol]
                args = line.split()
                count = len(args) - with_headers
                if count == 3 or count == 4:
                    subject, sid, size = args[0], args[1], args[-1]
                    reply = args[2] if count == 4 else b""
                    header_size = args[-2] if with_headers else b"0"
                # a byte nats-py splits the line on and the server did not: a subject or reply holds it
                # (the server puts one space between arguments: only another line is looked into)
                odd = b" ".join(args) != line and _odd_space(line)
                if odd:  # the sizes are the last arguments either way
                    count, size = 0, args[-1] if args else b""
                    header_size = args[-2] if with_headers and len(args) > 1 else b"0"
                    sid = b"0"
                if not (odd or count == 3 or count == 4) or not (size.isdigit() and header_size.isdigit()
                                                                 and sid.isdigit()):
                    frame_end = n  # not a frame this reader reads: nats-py says what it is
                else:
                    body = eol + 2
                    middle = body + int(header_size)
                    frame_end = body + int(size) + 2
                    if frame_end > n:
                        break
                    if odd or not (subject.isascii() and reply.isascii()) or (with_headers and (
                            middle - body > cap
                            or not data.startswith(_HEADER_LINE, body, middle))):  # rare: look closer
                        if middle - body > cap and isinstance(routes.get(id(subs.get(int(sid)))), _Direct):
                            cap_here = _ANY_SIZE  # a fold's: nats-py reads it, and a drop would stall the fold
                        else:
                            cap_here = cap
                        if odd or middle - body > cap_here or _stops_nats_py(
                                subject, reply, data[body:middle] if with_headers else None):
                            if passed < pos:
                                await inner(ps, data[passed:pos])
                                if self.resets != resets:
                                    return
                            self._drop(data[pos:eol])
                            pos = passed = frame_end
                            continue
                    sub = subs.get(int(sid))
                    route = routes.get(id(sub)) if sub is not None else None
                    if route is not None and passed < pos:
                        # nats-py reads the frames before this one first: they may change its subscriptions
                        await inner(ps, data[passed:pos])
                        if self.resets != resets:
                            return
                        passed = pos
                        sub = subs.get(int(sid))
                        route = routes.get(id(sub)) if sub is not None else None
                    if route is not None:
                        if route.on_cpu is not run:  # a measured route's run of deliveries begins or ends
                            if run is not None:
                                _tell(run, clock() - started)
                            run = route.on_cpu
                            if run is not None:
                                started = clock()
                        if route.take(subject, reply, data[middle:frame_end - 2],
                                      data[body:middle] if middle > body else None):
                            pos = passed = frame_end
                            continue
            else:  # PING, PONG, INFO, +OK, -ERR: one line
                frame_end = eol + 2
            if run is not None:  # a frame for nats-py ends a run of deliveries
                _tell(run, clock() - started)
                run = None
            pos = frame_end
        if run is not None:
            _tell(run, clock() - started)
        if passed < pos:
            await inner(ps, data[passed:pos])
            if self.resets != resets:
                return
        if pos < n:
            rest = data[pos:]
            self.pieces, self.have = [rest], len(rest)
            self.need = frame_end - pos if eol >= 0 else 0  # a whole control line tells the frame's size


def _tell(on_cpu: Callable[[float], None], seconds: float) -> None:
    """Tell a measured route the CPU of a run of its deliveries: never an error in the read loop
    (one there would make nats-py drop the connection and reconnect)."""
    try:
        on_cpu(max(seconds, 0.0))
    except Exception:
        log.exception("telling the CPU of direct deliveries failed")


class DirectDelivery:
    """What `deliver_directly` or `deliver_core` installed for one subscription; `close()` ends it
    (its messages take nats-py's path again)."""

    def __init__(self, routes: dict[int, "_Direct | _Core"], route: "_Direct | _Core"):
        self._routes = routes
        self._route = route

    def close(self) -> None:
        if self._routes.get(id(self._route.sub)) is self._route:
            del self._routes[id(self._route.sub)]


def deliver_directly(nc: Any, psub: Any, handler: DirectHandler, ready: Callable[[], bool],
                     wanted: tuple[str, ...] = (), on_cpu: Callable[[float], None] | None = None) -> DirectDelivery:
    """Hand the data messages of `psub` (an ordered push subscription of `nc`, made with a
    callback) to `handler` from the connection's read loop, while `ready()`.

    The handler runs synchronously in the connection's read loop: it must not block. When
    `ready()` is false, a message takes nats-py's path to the subscription's callback, so
    the caller keeps the order by answering false while its callback holds messages (any
    in its queue or in hand). Header blocks are parsed with `parse_header_lines`; with
    `wanted`, the handler gets only those headers (`header_values`), or all of them when
    none of those is there: the same to a reader that looks at no other name and at
    whether there are headers at all. With `on_cpu`, the deliveries are measured: it is
    told the thread CPU of each run of consecutive deliveries of the subscription (two
    clock reads per run, not per message), the reading of each message and the handler's
    work; not the wake-ups of the loop that brought them."""
    frames = _frames(nc)
    return frames.route(_Direct(psub._sub, handler, ready, nc.stats, wanted, on_cpu))


def guard_recreation(psub: Any, guard: Callable[[Callable[[], Awaitable[None]]], Awaitable[None]]) -> None:
    """From now on, where nats-py would re-create the consumer of `psub` (an ordered push
    subscription), it runs `guard(recreate)` instead, in the task nats-py starts for it;
    `recreate()` is nats-py's own re-creation (one consumer request, from the sequence after
    the last message received, to the new deliver subject; a failure goes to the connection's
    error callback, and nats-py tries again after two more missed heartbeats). A guard may
    call it, or not (then no consumer is made this time), and may hold the caller's messages
    while it does (the new consumer's messages arrive once the request is answered).

    nats-py resets the subscription (a new deliver subject) before that task starts, and
    every reset starts one: a guard still running when the next reset comes may leave the
    next one undone (its `recreate()`, called later, uses the newest deliver subject)."""
    jsi = getattr(psub, "_sub", None) and psub._sub._jsi
    recreate = getattr(jsi, "recreate_consumer", None)
    if recreate is None or not getattr(jsi, "_ordered", False):
        raise RuntimeError(
            "nats-py's ordered consumer no longer re-creates itself through _JSI.recreate_consumer as "
            "events/natspy.py expects: teach `guard_recreation` the new way"
        )

    async def guarded() -> None:
        await guard(recreate)

    jsi.recreate_consumer = guarded


def deliver_core(nc: Any, sub: Any, on_msg: Callable[[Msg], None],
                 ready: Callable[[], bool] = lambda: True, wanted: tuple[str, ...] = ()) -> DirectDelivery:
    """Hand the messages of `sub` (a core NATS subscription of `nc`, made with a callback) to
    `on_msg` from the connection's read loop, while `ready()`, instead of to the subscription's
    queue and task.

    `on_msg` gets the message nats-py would have handed the callback (the same `Msg`, the
    same headers), and runs synchronously in the connection's read loop: it must not block
    (a task it starts is its own). nats-py's own path still takes every status message
    (a 503 "no responders", say), and every message while `ready()` is false: the
    subscription's callback must handle those, in the same way. So this is for a
    subscription whose callback does not depend on the order of its messages (each request,
    or each reply, handled on its own). nats-py's subscription counters are kept as it
    keeps them; a subscription of a request (`_future`), of JetStream, or with a limit of
    messages is left to nats-py altogether. With `wanted`, a message's headers are only those
    (`header_values`; all of them when none of those is there), as `deliver_directly` gives
    them: for a reader that looks at no other name (a batched direct get's answers carry about
    six lines of headers each, and parsing them all was a third of an operator's replay)."""
    missing = [name for name in ("_jsi", "_future", "_max_msgs", "_received", "_id") if not hasattr(sub, name)]
    if missing or not isinstance(getattr(nc, "stats", None), dict):
        raise RuntimeError(
            f"nats-py's Subscription no longer has {', '.join(missing) or 'its connection stats'} as "
            "events/natspy.py reads them: teach `_Core` the new ones (or drop direct delivery)"
        )
    return _frames(nc).route(_Core(nc, sub, on_msg, ready, wanted))


_PUBLISH_REFUSED = 'nats: permissions violation for publish to "'


class ErrorsOnce:
    """nats-py's `error_cb`: each kind of error logged to `logger` (None: not logged) once until
    the connection is made again (two that alternate, such as a refused sign-in and the reset that
    follows it, are two lines, not one per attempt), one line naming `where` (the server, as a log
    may show it); the last kept (`last`) for a caller that gives up waiting, the first refused
    sign-in (`refusal`, `refused`), which waiting will not change, and the first permissions
    violation (`denied`), which a later error must not hide; a refused publish wakes whoever waits
    on its subject (`publish_refusal`, `unless_refused`), and is kept nowhere. nats-py hands the
    server's words over in lower case, subject included: a refusal that fits subjects in flight
    differing only in case (`...drain.W-1` and `...drain.w-1`) cannot say which of them it was, and
    wakes none of them (each ends as it would have without the refusal, in its reply or time-out)."""

    MAX_KINDS = 64  # kinds remembered at once; past it they are news again

    def __init__(self, logger: logging.Logger | None = log, where: str = "", refusal_hint: str = "") -> None:
        self.logger = logger
        self.where = f"NATS at {where}" if where else "NATS"
        self.refusal_hint = refusal_hint  # what a refused sign-in's line adds: which credentials to check
        self.last: Exception | None = None
        self.refusal: Exception | None = None
        self.denied: Exception | None = None  # the first permissions violation since connected
        self._seen: set[tuple] = set()
        self._refused: asyncio.Event | None = None
        self._inbox: tuple[str, Exception | None] | None = None  # (prefix watched, its refusal): `watch_inbox`
        # subject (lower case) -> the subjects as asked (`publish_refusal`) -> their waiters
        self._refusal_waiters: dict[str, dict[str, set[asyncio.Future]]] = {}

    async def report(self, error: Exception) -> None:
        """The callback itself (nats-py takes only coroutine functions)."""
        kind = _kind(error)
        if kind not in self._seen:
            if len(self._seen) >= self.MAX_KINDS:
                self._seen.clear()
            self._seen.add(kind)
            if self.logger is not None:
                hint = f" ({self.refusal_hint})" if self.refusal_hint and refuses_sign_in(error) else ""
                self.logger.warning("%s: %s%s", self.where, describe_error(error), hint)
        self.last = error
        text = describe_error(error).lower()  # nats-py lowers the server's words, a subject's too
        if self.denied is None and "permissions violation" in text:
            self.denied = error
        if self._inbox is not None and self._inbox[1] is None \
                and text.startswith(f'nats: permissions violation for subscription to "{self._inbox[0]}.'):
            self._inbox = (self._inbox[0], error)
        if text.startswith(_PUBLISH_REFUSED):
            subject = text[len(_PUBLISH_REFUSED):].split('"', 1)[0]  # as nats-py writes it: lower case
            asked = self._refusal_waiters.get(subject, {})
            if len(asked) == 1:  # else: which one was refused cannot be told (class docstring)
                del self._refusal_waiters[subject]
                for waiter in asked.popitem()[1]:
                    if not waiter.done():
                        waiter.set_result(error)
        if self.refusal is None and refuses_sign_in(error):
            self.refusal = error
            if self._refused is not None:
                self._refused.set()

    async def refused(self) -> Exception:
        """The first refused sign-in, once there is one."""
        if self.refusal is None:
            if self._refused is None:
                self._refused = asyncio.Event()
            await self._refused.wait()
        assert self.refusal is not None
        return self.refusal

    def watch_inbox(self, prefix: str) -> None:
        """Look out for the server's refusal of a subscription under the inbox prefix `prefix` (the
        connection's: `inbox_of`): its requests would hear no reply, each only timing out (a user
        signed in with an nkey seed and no NATS_INBOX_PREFIX, or another user's prefix)."""
        if self._inbox is None or self._inbox[0] != prefix.lower():
            self._inbox = (prefix.lower(), None)

    @property
    def inbox_refusal(self) -> Exception | None:
        """That refusal (`watch_inbox`), if it came."""
        return self._inbox[1] if self._inbox is not None else None

    def publish_refusal(self, subject: str) -> asyncio.Future:
        """A future done with the server's refusal to let this connection publish to `subject` once
        one comes (`unless_refused`); the caller ends it with `forget_refusal`."""
        waiter = asyncio.get_running_loop().create_future()
        self._refusal_waiters.setdefault(subject.lower(), {}).setdefault(subject, set()).add(waiter)
        return waiter

    def forget_refusal(self, subject: str, waiter: asyncio.Future) -> None:
        asked = self._refusal_waiters.get(subject.lower())
        waiters = asked.get(subject) if asked is not None else None
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del asked[subject]
                if not asked:
                    del self._refusal_waiters[subject.lower()]
        waiter.cancel()

    def reset(self) -> None:
        """Connected again: the next error is news."""
        self.last = self.refusal = self.denied = None
        self._seen.clear()
        if self._refused is not None:
            self._refused.clear()


CANCEL_AGAIN_S = 0.1  # a connect given up on is cancelled again this often until it ends (`connecting`)
CLOSE_GIVEN_UP_S = 2.0  # how long the close of a connection given up on may take


async def connecting(nc: Client, timeout: float | None = None, **options: Any) -> Client:
    """`nc`, connected (`nc.connect(**options)`) within `timeout` (asyncio.TimeoutError after it).
    Given up on, by the caller's cancellation or the time-out, the connect is abandoned
    (`abandon`): cancelled until it ends, the first cancellation maybe swallowed (Python 3.11's
    `asyncio.wait_for`, module docstring), and `nc` closed however far it got (a socket opened and
    waiting for the server's greeting; a connection made as the caller gave up), also while the
    caller is cancelled again meanwhile. A connect that fails leaves `nc` closed too."""
    task = asyncio.ensure_future(nc.connect(**options))
    try:
        await asyncio.wait({task}, timeout=timeout)  # a cancellation of the caller is not the task's
    except asyncio.CancelledError:
        await abandon(task, nc)
        raise
    if not task.done():
        await abandon(task, nc)
        raise asyncio.TimeoutError
    if task.exception() is not None:  # refused: the client is nobody's either
        await close_given_up(nc)
    task.result()
    return nc


async def abandon(attempt: asyncio.Future, nc: Client | None = None) -> None:
    """Cancel `attempt` (a connect, or a task whose result is a connection) until it ends, then
    close `nc`, or the connection the attempt made if it made one (`taken`). A cancellation of
    the caller meanwhile does not cut either short: it is raised once both are done."""
    cancelled = False
    while not attempt.done():
        attempt.cancel()
        try:
            await asyncio.wait({attempt}, timeout=CANCEL_AGAIN_S)
        except asyncio.CancelledError:
            cancelled = True
    try:
        await close_given_up(nc if nc is not None else taken(attempt))
    except asyncio.CancelledError:
        cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def close_given_up(nc: Client | None) -> None:
    """Close a connection nobody will use, whatever state it is in (one that never connected
    raises in nats-py's close once it is marked closed: retrieved, not raised), within
    `CLOSE_GIVEN_UP_S`. A cancellation of the caller meanwhile does not cut the close short (nats-py
    closes the socket a turn after it starts): it is raised once the close has ended or its time
    is up."""
    if nc is None:
        return
    closing = asyncio.ensure_future(nc.close())
    closing.add_done_callback(retrieved)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CLOSE_GIVEN_UP_S
    cancelled = False
    while not closing.done() and (left := deadline - loop.time()) > 0:
        try:
            await asyncio.wait({closing}, timeout=left)
        except asyncio.CancelledError:
            cancelled = True
    closing.cancel()
    if cancelled:
        raise asyncio.CancelledError


async def close(nc: Client) -> None:
    """`nc.close()`, of a connection that is down too (its server gone, reconnecting). nats-py's close
    writes what it holds to be sent onto the lost transport and drains it, which raises there
    (ConnectionResetError; RuntimeError under uvloop) half way through the close: the caller got that
    error, and the subscriptions' tasks were left running. Nothing held can be sent on a connection
    that is down: it is dropped first."""
    if not nc.is_closed and not nc.is_connected:
        nc._pending = []
        nc._pending_data_size = 0
    await nc.close()


def taken(attempt: asyncio.Future) -> Any:
    """The connection a finished `attempt` made, or None (it failed, or was cancelled)."""
    if attempt.done() and not attempt.cancelled() and attempt.exception() is None:
        return attempt.result()
    return None


def refuses_sign_in(error: BaseException) -> bool:
    """Whether nats-py's `error` is the server refusing the credentials (which no retry changes)."""
    if isinstance(error, nats.errors.AuthorizationError):
        return True
    text = describe_error(error).lower()
    return any(words in text for words in ("authorization violation", "authentication expired",
                                           "authentication revoked"))


def _kind(error: BaseException) -> tuple:
    """What makes two errors the same one for `ErrorsOnce`: an OSError's type and errno (the
    members of a cluster each refuse in their own words, naming their own address), else the text."""
    if isinstance(error, OSError) and error.errno is not None:
        return type(error), error.errno
    return type(error), describe_error(error)


class PublishRefused(Exception):
    """The server refused to let the connection publish to `subject` (a permissions violation):
    what was sent there reached nobody, and sending it again changes nothing."""

    def __init__(self, subject: str, error: Exception) -> None:
        super().__init__(f"NATS does not let these credentials publish to {subject}")
        self.subject = subject
        self.error = error


async def unless_refused(nc: Client, subject: str, work: Awaitable[Any]) -> Any:
    """`await work` (a request to `subject` on `nc`, say), or PublishRefused as soon as the server
    says it refuses this connection a publish to `subject`: the server says so at once, and the
    request would otherwise wait out its whole time-out for a reply that cannot come. Only for a
    connection that reports to an `ErrorsOnce` (`errors_of`: warmboot's `connect`, the CLI's);
    otherwise just `await work`. A refusal for the subject while `work` runs is this one's too:
    the server judges a publish by the connection's permissions and the subject alone (unless a
    request to a subject that differs only in case is in flight too: `ErrorsOnce`)."""
    errors = errors_of(nc)
    if errors is None:
        return await work
    refused = errors.publish_refusal(subject)
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, refused}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled: the work is nobody's
        errors.forget_refusal(subject, refused)
        await cancel_and_wait(task)
        raise
    if task.done():
        errors.forget_refusal(subject, refused)
        return task.result()
    error = refused.result()
    errors.forget_refusal(subject, refused)
    await cancel_and_wait(task)
    raise PublishRefused(subject, error)


def errors_of(nc: Client) -> ErrorsOnce | None:
    """The `ErrorsOnce` a connection reports its errors to (its `error_cb`), if it was made with one."""
    owner = getattr(getattr(nc, "_error_cb", None), "__self__", None)
    return owner if isinstance(owner, ErrorsOnce) else None


def inbox_of(nc: Client) -> str:
    """The inbox prefix a connection hears its replies under (nats-py keeps it as bytes)."""
    return bytes(nc._inbox_prefix).decode()


def describe_error(error: BaseException) -> str:
    """An error as one line: its text, or its type when it has none (a time-out)."""
    return str(error) or type(error).__name__


def guard_reads(nc: Any, max_header_bytes: int | None = None) -> None:
    """Have the connection `nc` read its frames through the frame reader (`_Frames`), routes or
    not: a message nats-py could not read is dropped there instead of ending the connection's
    read loop; with `max_header_bytes`, so is a message whose header block is larger (before
    anything parses it: the services' requests, `services.endpoints.add_endpoints`). The services' connection (requests come from any worker and client), the
    agent's and the client's call it once connected. The event store's does not: under the
    generated permissions only the server and the services publish onto its inboxes, and a
    replay would pay about a microsecond a message for it."""
    frames = _frames(nc)
    if max_header_bytes is not None:
        frames.max_header_bytes = max_header_bytes


async def subscribe_core(nc: Any, subject: str, on_msg: Callable[[Msg], None]) -> tuple[Any, DirectDelivery]:
    """Subscribe the synchronous `on_msg` to `subject`: delivered directly (`deliver_core`),
    and through nats-py's callback for what nats-py keeps to itself (a status: a 503, say).
    For a subscription whose messages are each handled on their own, at once."""

    async def callback(msg: Msg) -> None:
        on_msg(msg)

    sub = await nc.subscribe(subject, cb=callback)
    return sub, deliver_core(nc, sub, on_msg)


def _frames(nc: Any) -> _Frames:
    """The connection's frame reader, installed on its first route or by `guard_reads`."""
    ps = getattr(nc, NATS_PROTOCOL, None)
    if not isinstance(ps, nats_parser.Parser) or not all(
            hasattr(ps, name) for name in ("buf", "state", "needed")) or not all(
            hasattr(nats_parser, name) for name in ("AWAITING_CONTROL_LINE", "CRLF_SIZE")):
        raise RuntimeError(
            f"nats-py no longer has a protocol parser at Client.{NATS_PROTOCOL} as events/natspy.py "
            "reads it (buf, state, needed): teach `_Frames` the new one (or drop direct delivery)"
        )
    frames: _Frames | None = getattr(nc, "_warmboot_frames", None)
    if frames is None:
        frames = _Frames(nc, {})
        nc._warmboot_frames = frames
        ps.parse = frames.parse  # the read loop's `self._ps.parse(chunk)` and reconnect's `reset()`
        ps.reset = frames.reset
    return frames


async def flush_in_order(nc: Any, timeout: float = 10.0) -> None:
    """`nc.flush()` once every command nats-py holds is written: then the PONG says the server
    has them all (nats-py's flush writes its PING ahead of the commands its flusher task
    has not written yet, such as the SUB of a subscription just made)."""
    write_pending = getattr(nc, NATS_PENDING, None)
    if not callable(write_pending):
        raise RuntimeError(
            f"nats-py no longer has Client.{NATS_PENDING}: events/natspy.py must be taught how to have its "
            "pending commands written before a flush"
        )
    await write_pending(force_flush=True)
    await nc.flush(timeout)


# --- publishing ---------------------------------------------------------------------------

_UNSAFE_SUBJECT = re.compile(r"[ \t\r\n]")  # nats-py's publish refuses these: they would split or end the command line
_HEADER_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # nats-py's rule for a header name
_LINE_BREAKS = str.maketrans({"\r": " ", "\n": " "})


def header_block(headers: dict[str, str]) -> bytes:
    """The header block nats-py's `publish` writes for `headers`, by its rules (a name it
    refuses raises `BadHeaderError`, an empty one is skipped, a value is stripped and its
    line breaks made spaces): encoded once, for `publish` to send as many times as needed."""
    lines = [b"NATS/1.0\r\n"]
    for name, value in headers.items():
        key = name.strip()
        if not key:
            continue
        if not _HEADER_KEY.fullmatch(key):
            raise nats.errors.BadHeaderError(key)
        lines.append(b"%s: %s\r\n" % (key.encode(), value.strip().translate(_LINE_BREAKS).encode()))
    lines.append(b"\r\n")
    return b"".join(lines)


async def publish(nc: Any, subject: str, payload: bytes, reply: str = "", headers: bytes = b"") -> None:
    """`nc.publish(subject, payload, reply, headers)`, with the header block encoded once by
    `header_block`: the same refusals (`BadSubjectError` for an empty subject or one, or a
    reply, with white space, which would add a protocol command; a closed or draining
    connection; a payload past the server's limit; a full buffer while reconnecting), the
    same command in nats-py's buffer, its flusher woken the same way (and waited for when
    the buffer is full). It saves what nats-py does per message: the header block built and
    checked, the command formatted and encoded twice, a coroutine more. The services send
    three messages per heartbeat this way (its put, the sweeper's ack, the answer). Unlike
    nats-py's, its limit is on the header block and the payload together, as the server's is."""
    if not subject or _UNSAFE_SUBJECT.search(subject) or (reply and _UNSAFE_SUBJECT.search(reply)):
        raise nats.errors.BadSubjectError
    if nc.is_closed:
        raise nats.errors.ConnectionClosedError
    if nc.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError
    size = len(payload)
    try:
        # the server's limit is on the header block and the payload together (a message past it
        # gets the connection cut: nats-py's own publish checks the payload alone)
        if size + len(headers) > nc._max_payload:
            raise nats.errors.MaxPayloadError
        limit = nc._max_pending_size
        if not nc.is_connected and (limit <= 0 or size + nc._pending_data_size > limit):
            raise nats.errors.OutboundBufferLimitError
        target = b"%s %s" % (subject.encode(), reply.encode()) if reply else subject.encode()
        if headers:
            command = b"HPUB %s %d %d\r\n%s%s\r\n" % (target, len(headers), len(headers) + size, headers, payload)
        else:
            command = b"PUB %s %d\r\n%s\r\n" % (target, size, payload)
        nc.stats["out_msgs"] += 1
        nc.stats["out_bytes"] += size
        nc._pending.append(command)
        nc._pending_data_size += len(command)
        if limit > 0 and nc._pending_data_size > limit:
            await nc._flush_pending(force_flush=True)
        elif nc._flush_queue is not None and nc._flush_queue.empty():
            await nc._flush_pending()
    except AttributeError as error:
        raise RuntimeError(f"nats-py no longer keeps its outgoing buffer as events/natspy.py's `publish` "
                           f"writes into it ({error}): teach `publish` the new one") from None


def parse_header_block(raw: bytes) -> dict[str, str]:
    """Headers of a full block (`NATS/1.0[ status]\r\nName: value\r\n...`): the status line dropped."""
    _, sep, rest = raw.partition(b"\r\n")
    return parse_header_lines(rest) if sep else {}


def ack_positions(reply: str) -> tuple[int, int]:
    """(stream sequence, messages pending) from a JetStream delivery's reply subject.

    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<time>.<pending>`, or with a
    domain and an account hash after `ACK` (12 tokens)."""
    tokens = reply.split(".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[8])
    return int(tokens[7]), int(tokens[10])


def ack_time(reply: str | bytes) -> int:
    """The stream time (nanoseconds since the epoch) of a JetStream delivery, from its reply
    subject (see `ack_positions`); a direct handler's last argument spells it as bytes."""
    tokens = reply.split(b"." if isinstance(reply, bytes) else ".")
    return int(tokens[7] if len(tokens) == 9 else tokens[9])


class ApiError(msgspec.Struct):
    """The `error` of a JetStream API answer, for readers of the raw JSON (which skip the
    objects nats-py builds per answer)."""

    code: int = 0
    err_code: int = 0
    description: str = ""


class Replies:
    """Requests over one wildcard inbox (`<inbox>.<n>`), their replies matched by token.

    `request` returns the reply message, or raises nats-py's own errors:
    `NoRespondersError` (a 503 status: nobody listens on the subject) and
    `TimeoutError` (no reply within `timeout`, checked every `timeout / 4` at most).
    A caller cancelled while it waits cancels its reply's future (nothing is left to
    retrieve). Before `start` and after `stop` it raises `ConnectionClosedError`: no
    reply could arrive, nor expire.
    """

    def __init__(self, nc: Client, timeout: float = 5.0):
        self.nc = nc
        self.timeout = timeout
        self._pending: dict[str, tuple[asyncio.Future[Msg], float]] = {}
        self._tokens = itertools.count(1)
        self._inbox = ""
        self._sub: Any = None
        self._direct: DirectDelivery | None = None
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> "Replies":
        self._inbox = self.nc.new_inbox() + "."
        self._sub, self._direct = await subscribe_core(self.nc, self._inbox + "*", self._reply)
        self._watch = asyncio.create_task(self._expire(), name="replies-deadlines")
        return self

    async def stop(self) -> None:
        sub, self._sub = self._sub, None  # first: no request is sent from here on
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        if self._watch is not None:
            await cancel_and_wait(self._watch)
            self._watch = None
        if sub is not None:
            with suppress(Exception):
                await sub.unsubscribe()
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(nats.errors.ConnectionClosedError())
                future.exception()
        self._pending.clear()

    async def request(self, subject: str, payload: bytes, headers: bytes = b"") -> Msg:
        if self._sub is None:
            raise nats.errors.ConnectionClosedError()
        token = str(next(self._tokens))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Msg] = loop.create_future()
        self._pending[token] = (future, loop.time() + self.timeout)  # until answered or expired
        try:
            await publish(self.nc, subject, payload, self._inbox + token, headers)
        except BaseException:
            self._pending.pop(token, None)
            raise
        return await future  # its outcome retrieved here, or the future cancelled with the caller

    def _reply(self, msg: Msg) -> None:
        entry = self._pending.pop(msg.subject[len(self._inbox):], None)
        if entry is None or entry[0].done():
            return  # too late: its request timed out
        if not msg.data and msg.headers and msg.headers.get("Status") == "503":
            entry[0].set_exception(nats.errors.NoRespondersError())
        else:
            entry[0].set_result(msg)

    async def _expire(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(0.25, self.timeout / 4))
            moment = loop.time()
            late = [token for token, (_, deadline) in self._pending.items() if deadline < moment]
            for token in late:
                future = self._pending.pop(token)[0]
                if not future.done():
                    future.set_exception(nats.errors.TimeoutError())
