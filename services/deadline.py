"""How long a request's caller waits for its answer, and the refusal of a write decided after that.

A caller may say, in the request header `Warmboot-Wait-Ms` (`events.subjects.WAIT_HEADER`), how
many milliseconds it waits for the answer; `warmboot.client` sends its time-out there. A replica
that has held such a request longer than that, counted from when it received it, writes nothing
for it: the write is refused UNAVAILABLE (`Expired`) at the moment it would be made, so its
caller, which has gone, is answered as if the replica had stalled a moment longer.

Why: a request id is scoped to one life of its entity (CONTRACT, v1.1). A first attempt held
by a stalled replica (its store retrying through a leader election) is decided after the
caller's retry was answered elsewhere and the caller went on, a stop and a creation anew, say;
the copy, a new request in the new life by that rule, then stopped, suspended, paused or removed
the next life (an audit's finding, docs/contract.md). Where the retry was answered in the earlier
life, the copy's id says so, and the registry and the snapshotter refuse it by that
(`REFUSED_FROM_AN_EARLIER_LIFE`); this bound is for the rest: a request its caller gave up on, and
a resume, whose id the scheduler looks up in this life only. Past its caller's wait no request is
anyone's any more, so it is refused instead. What is decided in time is unchanged: an append
already sent lands or not as before, and it expects each subject where it was read, so a
copy decided on the earlier life that lands after the next one began fails its append, is
decided again, and is refused here.

A request without the header (a client of another language that does not send it) is decided
however long it waited, as before.

When a request was received is when the endpoint read it, unless the process was not running just
before (`received`): a process stopped (SIGSTOP, a frozen VM, a suspended host: `now_ns`) or an
event loop blocked for a while reads, once it runs again, requests that may have waited in its
socket all that time. So each loop
that serves requests ticks every TICK_S (`Ticker`), and a request counts as received at the start of
such a gap, the earliest it may have arrived, when it is read more than STALLED_S after the last
tick (the loop reads before it ticks again), or after a tick that came that late but before the
replica has read what reached it during the gap. That backlog ends where the server's answer to a
PING sent at that tick does: the server sends a connection's messages in order, so what it sends
before the PONG reached it before the PING, and what comes after, after the replica ran again
(`Ticker`; waited for at most BACKLOG_MAX_S), as the read loop parses it: what the same read holds
after it counts from its read. A stall again before the backlog was read (its PONGs not back yet)
counts from the first stall's start: what is read before the new PONGs may have waited since then.
A connection lost meanwhile (a server drops one that
did not read for long) was read to its end first, and its PING is asked again (`_pong`). A request
that waits in nats-py's queue for a free slot counts from when it was read, not from when a slot
takes it (`services.endpoints`). A soak's findings: a resume sent to a scheduler stopped for 8.8 s
was read after it woke, its wait counted from there, and it placed the actor's next life; once gaps
were counted, one of a stop of 15.3 s was read 0.63 s after it woke (its 51 neighbours in the same
backlog refused); and a window by time after the gap (a quarter of it) also refused the requests
that came fresh after the replica woke, which the PONG tells apart. A busy loop's requests pay the
same (their wait shortened by the gap), and so does a request that reached the server before the
replica woke and whose caller still waits: no clock says when it came.

The deadline is the current task's: set by the endpoint wrapper (`services.endpoints.wrap`) in
the request's own task, and read only from that task (`check`), so a task the request started
does not inherit it. The scheduler decides in its committer's task, from each job's own
deadline (`passed`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from contextvars import ContextVar
from typing import Any, Callable

from events.errors import ContractError, invalid
from events.schema import ErrorCode
from events.subjects import MAX_WAIT_MS, WAIT_HEADER
from events.tasks import retrieved

log = logging.getLogger("warmboot.service")

_WAIT_LOWER = WAIT_HEADER.lower()
TICK_S = 0.2  # how often a loop that serves requests notes that it runs (`Ticker`)
STALLED_S = 0.5  # read this long after the last tick: the process or its loop was not running meanwhile
BACKLOG_MAX_S = 5.0  # after a gap, the longest the PONGs that end its backlog are waited for
PONG_CHECK_S = 0.05  # meanwhile, how often a connection is looked at for a reconnect (its PING forgotten)

# The clock of the ticks and of requests' deadlines: CLOCK_BOOTTIME, which goes on while the host is
# suspended, as the caller's wait does; CLOCK_MONOTONIC (time.perf_counter) stops meanwhile, and a
# suspended VM's gap in the ticks was invisible (a review). Where there is none, the monotonic clock.
if hasattr(time, "CLOCK_BOOTTIME"):
    now_ns: Callable[[], int] = functools.partial(time.clock_gettime_ns, time.CLOCK_BOOTTIME)
else:  # pragma: no cover (not Linux)
    now_ns = time.monotonic_ns

# (the request's task, the deadline in now_ns(), the wait it says, when it was received)
_current: ContextVar[tuple[asyncio.Task, int, int, int] | None] = ContextVar("warmboot_request_deadline",
                                                                            default=None)


class Expired(ContractError):
    """UNAVAILABLE: the request was held past its caller's wait, and nothing was written for it."""

    def __init__(self, wait_ms: int, held_ms: int, what: str):
        super().__init__(
            ErrorCode.UNAVAILABLE,
            f"this replica held the request {held_ms} ms, longer than the {wait_ms} ms its caller waits "
            f"({WAIT_HEADER}): {what} is not written so late, as it could act on what happened since (a retry "
            "answered elsewhere, a new life); nothing was written, and a retry with the same request_id gets "
            "the answer")


def wait_ms(headers: dict[str, str] | None) -> int | None:
    """The wait the request's header says, in ms; None without the header. INVALID_ARGUMENT naming
    the header for anything but an integer from 1 to MAX_WAIT_MS."""
    if not headers:
        return None
    text = headers.get(WAIT_HEADER)
    if text is None:  # as another language's client may spell it: header names are case-insensitive
        text = next((value for name, value in headers.items() if name.lower() == _WAIT_LOWER), None)
        if text is None:
            return None
    text = text.strip()
    digits = text.lstrip("0")
    # ASCII digits only, and no more than the bound has: `isdigit` takes '²' and other scripts' digits,
    # which `int` refuses or reads, and `int` refuses more than 4,300 digits (both answered INTERNAL: a review)
    if not (text.isascii() and text.isdigit()) or len(digits) > len(str(MAX_WAIT_MS)) \
            or not 1 <= int(digits or "0") <= MAX_WAIT_MS:
        raise invalid(f"header {WAIT_HEADER} must be the milliseconds the caller waits for the answer, an integer "
                      f"from 1 to {MAX_WAIT_MS}; got {text[:32]!r}", f"headers.{WAIT_HEADER}")
    return int(digits)


class Ticker:
    """Notes, every TICK_S, that its loop runs (`last`, `now_ns`); shared by the services
    of a loop (`tick_on`, `untick`), stopped with the last of them. After a gap in its ticks, asks the
    server of each connection its services read requests from for a PONG (`_read_backlog`): what
    reached the replica during the gap comes before it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.last = now_ns()
        self.gap = (0, 0)  # the last gap between ticks longer than TICK_S + STALLED_S: (from, until)
        self.caught_up = 0  # when the PONGs after that gap came back (0: not yet)
        self.backlog_read = asyncio.Event()  # set with `caught_up`
        self.connections: list[Any] = []  # the connections its services read requests from, once per service
        self.users = 0
        self.task = loop.create_task(self._tick(), name="warmboot-request-ticker")
        self._backlog: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        try:
            while True:
                now = now_ns()
                if now - self.last > (TICK_S + STALLED_S) * 1e9:
                    since, (before, until) = self.last, self.gap
                    if until and not self.caught_up and self.last - until <= BACKLOG_MAX_S * 1e9:
                        # stalled again before the backlog of the gap before was read: what is read before
                        # this gap's PONGs may have waited since that one began (a review: 288 of 300
                        # requests held past their callers' wait were written, counted from this gap)
                        since = before
                    self.gap, self.caught_up = (since, now), 0
                    self.backlog_read.clear()
                    if self._backlog is not None:
                        self._backlog.cancel()
                    self._backlog = asyncio.ensure_future(self._read_backlog(self.gap))
                self.last = now
                await asyncio.sleep(TICK_S)
        finally:
            if self._backlog is not None:
                self._backlog.cancel()

    async def _read_backlog(self, gap: tuple[int, int]) -> None:
        """A PING on each connection; `caught_up` once every PONG is back (or BACKLOG_MAX_S after the
        gap, whatever the connections do)."""
        until = gap[1] + int(BACKLOG_MAX_S * 1e9)
        waiting = set(self.connections)

        def ponged(nc: Any) -> None:
            """In the read loop, as a PONG is parsed: the last one ends the backlog there, so what the
            same read holds after it counts from its read (a review: a request read with the PONG
            was refused while its caller waited)."""
            waiting.discard(nc)
            if not waiting and self.gap is gap and not self.caught_up:
                self.caught_up = now_ns()

        answered = await asyncio.gather(*(_pong(nc, until, ponged) for nc in set(self.connections)))
        now = now_ns()
        if self.gap is gap:
            self.caught_up = self.caught_up or now
            self.backlog_read.set()
            stalled, after = (gap[1] - gap[0]) / 1e9, (now - gap[1]) / 1e6
            if all(answered):
                log.info("the serving loop did not run for %.1f s; it read what reached it meanwhile in %.0f ms",
                         stalled, after)
            else:
                log.warning("the serving loop did not run for %.1f s; its server did not answer a PING after it "
                            "in %.0f ms: the requests read until now counted from the stall's start", stalled, after)


async def _pong(nc: Any, until: int, ponged: Callable[[Any], None] = lambda nc: None) -> bool:
    """The server's PONG to a PING on `nc` sent now, or once `nc` lost its connection meanwhile, to one
    sent then: nats-py forgets the PINGs in flight when it reconnects (its server dropped a connection
    that did not read for long, as a stopped process's), and what the old socket held was read before
    its end was. `ponged(nc)` as the read loop parses it. Gives up at `until` (`now_ns`):
    False. A connection closed, or not reading, answers no PING: True (nothing more comes from it)."""
    while True:
        reconnects = nc.stats.get("reconnects", 0)
        ping = asyncio.ensure_future(_ping(nc, ponged))
        ping.add_done_callback(retrieved)
        while not ping.done():
            left = (until - now_ns()) / 1e9
            if left <= 0:
                ping.cancel()  # this wait, not nats-py's future (`_ping`)
                return False
            await asyncio.wait({ping}, timeout=min(PONG_CHECK_S, left))
            if not ping.done() and (nc.is_reconnecting or nc.stats.get("reconnects", 0) != reconnects):
                ping.cancel()
                break  # asked again: of the new connection, or (reconnecting) nothing left to read
        else:
            return True


class _Pong(asyncio.Future):
    """The future nats-py keeps for a PING (`_pongs`) and resolves as its read loop parses the PONG:
    tells `ponged` then, before the loop reads on."""

    def __init__(self, nc: Any, ponged: Callable[[Any], None]):
        super().__init__()
        self._nc, self._ponged = nc, ponged

    def set_result(self, result: Any) -> None:
        super().set_result(result)
        self._ponged(self._nc)


async def _ping(nc: Any, ponged: Callable[[Any], None]) -> None:
    """A PING on `nc`, awaited until its PONG. nats-py's future for it is never cancelled here: a PONG
    that came for a cancelled one (as `nc.flush(timeout)` leaves it) raised InvalidStateError in the
    read loop, which then read nothing more (a review: a replica whose PONG came after BACKLOG_MAX_S
    answered nothing again; `events.natspy.connections.tolerate_late_pongs` guards nats-py's own)."""
    if nc.is_closed:
        return
    reading = getattr(nc, "_reading_task", None)
    if reading is None or reading.done():  # nothing would read the PONG (as nats-py's flush says)
        return
    pong = _Pong(nc, ponged)
    await nc._send_ping(pong)
    await asyncio.wait({pong})  # a reconnect forgets it (nats-py empties `_pongs`): `_pong` asks again


_tickers: dict[asyncio.AbstractEventLoop, Ticker] = {}


def tick_on(loop: asyncio.AbstractEventLoop, nc: Any = None) -> None:
    """A service on `loop` serves requests (read from `nc`): its loop ticks (`received`)."""
    ticker = _tickers.get(loop)
    if ticker is None or ticker.task.done():
        ticker = _tickers[loop] = Ticker(loop)
    ticker.users += 1
    if nc is not None:
        ticker.connections.append(nc)


def untick(loop: asyncio.AbstractEventLoop, nc: Any = None) -> None:
    """A service on `loop` stopped serving (from `nc`); the ticker stops with the last one."""
    ticker = _tickers.get(loop)
    if ticker is None:
        return
    ticker.users -= 1
    if nc is not None and nc in ticker.connections:
        ticker.connections.remove(nc)
    if ticker.users <= 0:
        ticker.task.cancel()
        del _tickers[loop]


def ticker_of(loop: asyncio.AbstractEventLoop) -> Ticker | None:
    """The ticker of `loop`'s services, if any serve on it."""
    return _tickers.get(loop)


def received(read_ns: int) -> int:
    """When a request read at `read_ns` (`now_ns`) counts as received: then, or at the
    start of a gap in its loop's ticks that it was read in or after, before the replica had read
    what reached it meanwhile (module docstring)."""
    try:
        ticker = _tickers.get(asyncio.get_running_loop())
    except RuntimeError:
        return read_ns
    if ticker is None:
        return read_ns
    return received_after(read_ns, ticker.last, ticker.gap, ticker.caught_up)


def received_after(read_ns: int, last: int, gap: tuple[int, int], caught_up: int) -> int:
    """`received`, from the loop's last tick, last long gap and when the PONGs after it came back
    (0: not yet) (pure)."""
    since, until = gap
    if until and read_ns >= until:  # ticked first, then read: before the PONGs, what waited through the gap
        if (read_ns <= caught_up) if caught_up else (read_ns - until <= BACKLOG_MAX_S * 1e9):
            return since  # the earliest: a stall since the last tick began after it (a review)
    if read_ns - last > STALLED_S * 1e9:  # not ticked since the gap began
        return last
    return read_ns


def begin(wait: int | None, received_ns: int) -> None:
    """The current task serves a request received at `received_ns` (`now_ns`) whose
    caller waits `wait` ms (None: no deadline)."""
    if wait is None:
        return
    _current.set((asyncio.current_task(), received_ns + wait * 1_000_000, wait, received_ns))  # type: ignore[arg-type]


def deadline() -> tuple[int, int, int] | None:
    """The current task's request deadline: (deadline, wait in ms, received), in `now_ns`; None if none."""
    found = _current.get()
    if found is None:
        return None
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no loop runs in this thread: not the request's task
        return None
    if task is not found[0]:
        return None
    return found[1], found[2], found[3]


def passed(at: tuple[int, int, int] | None, what: str) -> Expired | None:
    """The refusal of a write decided now for a request with deadline `at` (`deadline()`), or None."""
    if at is None:
        return None
    now = now_ns()
    if now <= at[0]:
        return None
    return Expired(at[1], (now - at[2]) // 1_000_000, what)


def check(what: str) -> None:
    """Raise `Expired` if the current task serves a request held past its caller's wait."""
    refusal = passed(deadline(), what)
    if refusal is not None:
        raise refusal
