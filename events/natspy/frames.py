"""The frame reader of a connection and direct delivery from nats-py's read loop
(`events.natspy` says why this package exists):

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
- `deliver_core`: the same for a core NATS subscription whose messages are handled
  each on its own (the services' request endpoints, `Replies`' inbox): its messages go
  from the read loop to a synchronous callback, as the `Msg` nats-py would have built,
  without the parser's regular expression, the subscription's queue and its task
  (`subscribe_core` makes such a subscription with the one callback for both paths).
- `guard_reads`: nats-py decodes each message's subject, reply subject and status line
  strictly, and an error there ends the connection's read loop for good, the connection
  still up: one request with a reply subject that is not UTF-8, from any client allowed
  to send one, silenced a service replica, which the server went on sending its share of
  the requests. nats-py also splits a message's line on bytes the server does not split
  it on (`_ODD_SPACE`), and so reads such a message under another sid, or reconnects.
  The frame reader drops such a message instead (and logs it); the services', the
  agent's and the client's connections read through it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from nats.aio.msg import Msg
from nats.protocol import parser as nats_parser

from events.natspy.headers import header_values, parse_header_lines

NATS_PROTOCOL = "_ps"  # the private attribute of a connection holding its protocol parser (`Parser`)

log = logging.getLogger("warmboot.natspy")

# A handler of direct deliveries: (stream sequence, messages pending, subject, headers, body, the
# message's stream time in nanoseconds as the reply subject spells it: `events.natspy.jetstream.ack_time` reads it).
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

    __slots__ = ("nc", "sub", "on_msg", "ready", "on_cpu", "wanted", "statuses")

    def __init__(self, nc: Any, sub: Any, on_msg: Callable[[Msg], None], ready: Callable[[], bool],
                 wanted: tuple[str, ...] = (), statuses: bool = True):
        self.nc = nc
        self.statuses = statuses
        self.sub = sub
        self.on_msg = on_msg
        self.ready = ready
        self.on_cpu = None  # not measured
        self.wanted = tuple((name, name.encode()) for name in wanted)  # as header_values takes them

    def take(self, subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> bool:
        """Hand a message to `on_msg` as nats-py's `_process_msg` would hand it to the
        subscription's callback; False (nothing done) for anything nats-py must see itself."""
        if headers is not None and not headers.startswith(_HEADER_LINE):  # a status
            return not self.statuses  # dropped (`deliver_core`), or nats-py's to handle
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


def deliver_core(nc: Any, sub: Any, on_msg: Callable[[Msg], None],
                 ready: Callable[[], bool] = lambda: True, wanted: tuple[str, ...] = (),
                 statuses: bool = True) -> DirectDelivery:
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
    six lines of headers each, and parsing them all was a third of an operator's replay). With
    `statuses` false, a status message is dropped instead: on a subject of requests none is one,
    and one nats-py queued without `ready()` being asked put the notes a caller keeps of what
    waits in that queue out of step (`services.endpoints.ConcurrentEndpoint`: a review)."""
    missing = [name for name in ("_jsi", "_future", "_max_msgs", "_received", "_id") if not hasattr(sub, name)]
    if missing or not isinstance(getattr(nc, "stats", None), dict):
        raise RuntimeError(
            f"nats-py's Subscription no longer has {', '.join(missing) or 'its connection stats'} as "
            "events/natspy/frames.py reads them: teach `_Core` the new ones (or drop direct delivery)"
        )
    return _frames(nc).route(_Core(nc, sub, on_msg, ready, wanted, statuses))


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
            f"nats-py no longer has a protocol parser at Client.{NATS_PROTOCOL} as events/natspy/frames.py "
            "reads it (buf, state, needed): teach `_Frames` the new one (or drop direct delivery)"
        )
    frames: _Frames | None = getattr(nc, "_warmboot_frames", None)
    if frames is None:
        frames = _Frames(nc, {})
        nc._warmboot_frames = frames
        ps.parse = frames.parse  # the read loop's `self._ps.parse(chunk)` and reconnect's `reset()`
        ps.reset = frames.reset
    return frames
