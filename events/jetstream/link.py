"""The connection: one NATS connection on one event-loop thread per (URL, credentials).

The eventsourcing library is synchronous and nats-py is asyncio. A `Link` runs one
event loop in a daemon thread with one connection on it, shared by every factory and
recorder of the process that connects with the same `ConnectOptions` (`acquire`,
`release`), reconnecting forever after a server restart. Recorders hand it coroutines
(`Link.call`) and wait for their result; a call from the loop's own thread is an error.
It also routes the replies of batched direct gets, which nats-py has no call for.

An asyncio service whose store is on its hot path may have its links run on its own
loop instead (`links_on(loop)` around the store's construction): no thread of the
link's own, and `Link.submit` from that loop awaits the call right there, with no
hand-over between threads. Its synchronous calls must then come from other threads
(`asyncio.to_thread`), as they already must from asyncio code.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import json
import logging
import os
import threading
import time
import weakref
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator

import nats.errors
from eventsourcing.persistence import OperationalError, ProgrammingError
from eventsourcing.utils import Environment
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.nuid import NUID

from events.jetstream import errors
from events.jetstream.lastseen import LastSeen
from events.jetstream.layout import LEADER_ELECTED_ADVISORY, status_of
from events.natsauth import (
    CREDS_ENV,
    INBOX_PREFIX_ENV,
    NKEY_SEED_ENV,
    PASSWORD_ENV,
    TOKEN_ENV,
    USER_ENV,
    nkey_options,
    redact_url,
    sign_in_options,
)
from events.natspy.connections import CLOSE_GIVEN_UP_S, ErrorsOnce, close_given_up, close_within, connecting
from events.natspy.frames import deliver_core
from events.natspy.headers import use_lean_headers
from events.tasks import retrieved

log = logging.getLogger("warmboot.jetstream")

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
_CLOSING = (asyncio.TimeoutError, nats.errors.Error, OSError)  # what closing a connection may raise
CLOSED_DURING_CALL = "the JetStream connection was closed during the call"  # a call the shutdown cancelled
# How long a link's shutdown (`Link.shutdown`: a store's close) waits, all its steps together, whatever NATS does:
# the close of its connection, given up after CLOSE_GIVEN_UP_S (a server frozen with the socket's buffers full:
# nats-py's close never ends), then the end of its loop's thread, which has the rest. It waited up to 5 s for the
# close, 10 for the loop to hand it back and 10 for the thread (docs/operations.md, "Stopping").
SHUTDOWN_S = CLOSE_GIVEN_UP_S + 1.0


@dataclass(frozen=True)
class ConnectOptions:
    """Where and as whom to connect: the key of the shared connections."""

    url: str = field(repr=False)  # may hold user:password: shown as `where`
    creds: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    nkey_seed: str | None = None  # path of an nkey seed file
    inbox_prefix: str | None = None

    @classmethod
    def from_env(cls, env: Environment) -> "ConnectOptions":
        return cls(
            url=env.get("NATS_URL") or DEFAULT_NATS_URL,
            creds=env.get(CREDS_ENV) or None,
            user=env.get(USER_ENV) or None,
            password=env.get(PASSWORD_ENV) or None,
            token=env.get(TOKEN_ENV) or None,
            nkey_seed=env.get(NKEY_SEED_ENV) or None,
            inbox_prefix=env.get(INBOX_PREFIX_ENV) or None,
        )

    @property
    def where(self) -> str:
        """The URL(s) without any user:password in them, for messages and logs."""
        return redact_url(self.url)

    def __repr__(self) -> str:
        return f"ConnectOptions(where={self.where!r}, creds={self.creds!r}, user={self.user!r})"

    def connect_kwargs(self) -> dict[str, Any]:
        # NATS_URL may list a cluster's members, comma-separated (as `--nats` does).
        kwargs: dict[str, Any] = {"servers": [u.strip() for u in self.url.split(",") if u.strip()]}
        kwargs.update(nkey_options(self.nkey_seed))
        if self.inbox_prefix:
            kwargs["inbox_prefix"] = self.inbox_prefix
        kwargs.update(sign_in_options(self.url, creds=self.creds, user=self.user, password=self.password,
                                      token=self.token))
        return kwargs


async def direct_batch(nc: NATS, stream: str, request: dict[str, Any], timeout: float,
                       wanted: tuple[str, ...] = ()) -> tuple[list[Msg], int]:
    """One batched direct get on any connection (answers on an inbox of its own): the
    messages, and how many more match after them. For a reader without a `Link` (the
    operator commands, which may read the log only this way: docs/security.md). The answers
    come straight from the connection's read loop (`events.natspy.frames.deliver_core`: in order, with no
    queue and no task per message), with only the `wanted` headers if given; the end of the
    batch, a status, takes nats-py's path after them."""
    collector = _Collector(asyncio.get_running_loop())

    async def feed(msg: Msg) -> None:
        collector.feed(msg)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=feed)
    delivery = deliver_core(nc, sub, collector.feed, wanted=wanted)
    try:
        await nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox)
        pending = await asyncio.wait_for(collector.done, timeout)
    finally:
        delivery.close()
        await sub.unsubscribe()
    return collector.msgs, pending


class _Collector:
    """Gathers the replies of one batched direct get until the end-of-batch status."""

    __slots__ = ("msgs", "done")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.msgs: list[Msg] = []
        self.done: asyncio.Future[int] = loop.create_future()

    def feed(self, msg: Msg) -> None:
        status = status_of(msg)
        if status is None:
            self.msgs.append(msg)
        elif self.done.done():
            return
        elif status == "204":  # end of batch; Nats-Num-Pending says how many more match
            self.done.set_result(int(msg.headers.get("Nats-Num-Pending", "0")))
        elif status == "404":  # nothing (more) matches
            self.done.set_result(0)
        else:
            self.done.set_exception(errors.direct_get_refused(status))


class Link:
    """One NATS connection on one event-loop thread, shared by all users of the same options;
    or, given `loop`, on that loop (a running loop of its caller's) without a thread."""

    def __init__(self, options: ConnectOptions, loop: asyncio.AbstractEventLoop | None = None):
        self.options = options
        self.key = (options, loop)  # its place among the process's links (`acquire`)
        self.pid = os.getpid()
        self.refs = 0
        self.closed = False
        self.loop = loop or asyncio.new_event_loop()
        self.thread = None if loop is not None else threading.Thread(
            target=self._run_loop, name="warmboot-jetstream", daemon=True)
        self.nc: NATS | None = None
        self.connecting: asyncio.Lock | None = None
        self.last_error: BaseException | None = None
        # the server's refusals of a publish, which wake a request to that subject (`Stream._api`): credentials
        # that may not use the stream's API (a client's, an operator's) are told at once, not after the budget
        self.errors = ErrorsOnce(logger=None)
        self.subscriptions: "weakref.WeakSet[Any]" = weakref.WeakSet()  # stopped at shutdown
        self.inbox = ""
        self.connections = 0  # connections made (`connect`, again after one was closed): `session`
        self.collectors: dict[str, _Collector] = {}
        self.tokens = itertools.count()
        self.nuid = NUID()
        self.ready_streams: set[str] = set()
        self.watched: set[str] = set()  # streams whose leader elections this link hears of
        self.elections: dict[str, asyncio.Future[None]] = {}  # stream -> resolved at its next election
        self.last_seen = LastSeen()
        self.waiting: set[concurrent.futures.Future[Any]] = set()
        self.waiting_lock = threading.Lock()
        if self.thread is not None:
            self.thread.start()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        # Stopped by shutdown(): let the client's leftover tasks end before the loop closes.
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()
        # Calls submitted as the loop stopped never ran: release their callers. Cancelled out of
        # the lock, which a `submit`'s done-callback takes (on this thread, as it is cancelled).
        with self.waiting_lock:
            never_ran, self.waiting = list(self.waiting), set()
        for future in never_ran:
            future.cancel()

    def _on_own_loop(self) -> bool:
        if self.thread is not None:
            return threading.current_thread() is self.thread
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:  # no loop runs in this thread
            return False

    def _refuse_if_closed(self, coro: Any) -> None:
        """What `call` and `submit` do with a call once the link (or the loop it runs on) is closed."""
        if self.closed or self.loop.is_closed():
            coro.close()
            raise ProgrammingError("the JetStream connection of this recorder is closed")

    def call(self, coro: Any) -> Any:
        """Run `coro` on the link's loop and wait for it (coroutines bound their own time)."""
        if self._on_own_loop():
            coro.close()
            raise ProgrammingError("a JetStream recorder was called from its own event loop")
        self._refuse_if_closed(coro)
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        with self.waiting_lock:
            self.waiting.add(future)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise OperationalError(CLOSED_DURING_CALL) from None
        finally:
            with self.waiting_lock:
                self.waiting.discard(future)

    async def submit(self, coro: Any) -> Any:
        """`call` for asyncio code: awaited right here on the link's own loop; from another
        loop, `coro` runs on the link's and the caller's loop awaits its outcome, with no
        thread of the caller's own blocked on it (an executor thread's round trip costs CPU
        on every call).

        Either way a caller cancelled meanwhile does not cancel `coro`, as with `call` from
        a thread: an append it started still lands, or fails, as a retry of the caller's
        will find out."""
        self._refuse_if_closed(coro)
        loop = asyncio.get_running_loop()
        if loop is self.loop:
            task = loop.create_task(coro)
            task.add_done_callback(retrieved)  # its caller may be gone (cancelled) when it ends
            return await asyncio.shield(task)  # the call runs to its end, as on another loop
        answer: asyncio.Future[Any] = loop.create_future()
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        with self.waiting_lock:
            self.waiting.add(future)

        def settled(done: concurrent.futures.Future[Any]) -> None:  # on whichever thread ended it
            with self.waiting_lock:
                self.waiting.discard(done)
            with suppress(RuntimeError):  # the caller's loop is closed: nobody is left to tell
                loop.call_soon_threadsafe(_hand_over, done, answer)

        future.add_done_callback(settled)
        return await answer

    def unsubscribe(self, subscription: Any) -> None:
        """Stop a nats-py subscription in the background (nothing to do once the link is closed)."""
        if not self.closed:
            asyncio.run_coroutine_threadsafe(_unsubscribe(subscription), self.loop)

    async def connect(self, timeout: float) -> None:
        if self.connecting is None:
            self.connecting = asyncio.Lock()
        async with self.connecting:
            if self.nc is None:
                await self._connect(timeout)

    async def _connect(self, timeout: float) -> None:

        async def on_error(error: Exception) -> None:
            # The server's word (e.g. an authorization violation) says more than the reset after it.
            if not (isinstance(error, OSError) and self.last_error is not None):
                self.last_error = error
            await self.errors.report(error)
            log.debug("nats: %r", error)

        async def on_disconnected() -> None:
            if self.closed or nc.is_closed:  # closed on purpose (nats-py says it as a disconnection too)
                return
            log.info("disconnected from %s; reconnecting", self.options.where)

        async def on_reconnected() -> None:
            log.info("reconnected to %s", self.options.where)

        nc = NATS()
        use_lean_headers(nc)  # replays are bound by header parsing (events.natspy.headers)
        try:
            await connecting(  # ends when cancelled, even as the TCP connection is made, and closes
                nc,
                timeout,
                **self.options.connect_kwargs(),
                name="warmboot-eventstore",
                allow_reconnect=True,
                max_reconnect_attempts=-1,  # forever: the store outlives server restarts
                reconnect_time_wait=0.25,
                connect_timeout=2,
                ping_interval=10,
                max_outstanding_pings=3,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
            )
        except asyncio.TimeoutError:  # closed, its reconnect loop stopped: the next call starts afresh
            raise errors.unreachable(self.options.where, timeout, self.last_error) from None
        try:
            self.inbox = nc.new_inbox()
            await nc.subscribe(f"{self.inbox}.*", cb=self._route)
        except BaseException:
            await close_given_up(nc)
            raise
        self.nc = nc
        self.connections += 1

    @property
    def session(self) -> tuple[int, int] | None:
        """Which session with the server this link is in: (its connection, that connection's
        reconnections), or None while none is up (not connected yet, reconnecting, closed). nats-py
        counts a reconnection once the server has taken CONNECT, before what was buffered while it
        was away is sent: whatever was sent in one session went to the same server process (a server
        restarted in between is a new session)."""
        nc = self.nc
        if nc is None or not nc.is_connected:
            return None
        return self.connections, nc.stats["reconnects"]

    async def _route(self, msg: Msg) -> None:
        collector = self.collectors.get(msg.subject[len(self.inbox) + 1 :])
        if collector is not None:
            collector.feed(msg)

    async def watch_elections(self, stream: str) -> None:
        """Hear of the stream's leader elections (JetStream's advisory): a request that went to
        a leader that died is never answered, and the election says so seconds before the
        request's time-out would. Without the permission to hear it, time-outs still say it."""
        if stream in self.watched:
            return
        self.watched.add(stream)

        async def elected(_: Msg) -> None:
            future = self.elections.pop(stream, None)
            if future is not None and not future.done():
                future.set_result(None)

        try:
            await self.nc.subscribe(f"{LEADER_ELECTED_ADVISORY}.{stream}", cb=elected)
        except nats.errors.Error as error:
            log.debug("not hearing of the leader elections of %s: %r", stream, error)

    def next_election(self, stream: str) -> asyncio.Future[None]:
        """A future of the link's loop, resolved when `stream` next elects a leader."""
        future = self.elections.get(stream)
        if future is None:
            future = self.elections[stream] = self.loop.create_future()
        return future

    async def direct_batch(self, stream: str, request: dict[str, Any], timeout: float) -> tuple[list[Msg], int]:
        """One batched direct get: the messages, and how many more match after them."""
        token = str(next(self.tokens))
        collector = _Collector(asyncio.get_running_loop())
        self.collectors[token] = collector
        try:
            await self.nc.publish(
                f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=f"{self.inbox}.{token}"
            )
            pending = await asyncio.wait_for(collector.done, timeout)
        finally:
            del self.collectors[token]
        return collector.msgs, pending

    async def close(self, within: float = CLOSE_GIVEN_UP_S) -> None:
        """Close the connection, given up after `within` s (`close_within`, which says so)."""
        if self.nc is not None and not self.nc.is_closed:
            try:
                await close_within(self.nc, within)
            except _CLOSING as error:
                log.debug("closing the connection to %s: %r", self.options.where, error)

    def shutdown(self) -> None:
        """Stop its subscriptions, close its connection and end its loop's thread: within SHUTDOWN_S in all, not
        waited for longer (its thread, a daemon's, ends on its own or with the process)."""
        if self.closed:
            return
        self.closed = True
        deadline = time.monotonic() + SHUTDOWN_S
        for subscription in list(self.subscriptions):
            subscription.stop()
        if self.thread is None:  # on its caller's loop, which goes on
            self._close_on_loop(deadline)
            return
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self._close_from_thread(deadline)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(max(0.0, deadline - time.monotonic()))
            if self.thread.is_alive():
                log.warning("the loop of the connection to %s did not end within %gs of the store's close: left to "
                            "end on its own", self.options.where, SHUTDOWN_S)

    def _close_from_thread(self, deadline: float) -> None:
        """The connection's close, on the link's loop, waited for from another thread until `deadline` (its own
        bound, CLOSE_GIVEN_UP_S at most, within it)."""
        within = min(CLOSE_GIVEN_UP_S, max(0.0, deadline - time.monotonic()))
        try:
            closing = asyncio.run_coroutine_threadsafe(self.close(within), self.loop)
        except RuntimeError:  # its loop closed meanwhile: nothing left to close
            return
        with suppress(concurrent.futures.TimeoutError, concurrent.futures.CancelledError, RuntimeError):
            closing.result(max(0.0, deadline - time.monotonic()))

    def _close_on_loop(self, deadline: float) -> None:
        """Close the connection of a link on its caller's loop: in the background when called
        from that loop (the close bounds itself), else waited for until `deadline` (nothing to do once
        the loop is closed)."""
        if self._on_own_loop():
            task = self.loop.create_task(self.close())
            _closing.add(task)
            task.add_done_callback(_closing.discard)
        elif not self.loop.is_closed():
            self._close_from_thread(deadline)


_closing: set[asyncio.Task[None]] = set()  # closes in the background, kept until they end


async def _unsubscribe(subscription: Any) -> None:
    try:
        await subscription.unsubscribe()
    except nats.errors.Error:
        pass  # gone with its connection: nothing left to stop


_links: dict[tuple[ConnectOptions, asyncio.AbstractEventLoop | None], Link] = {}
# Reentrant: an eventsourcing Application closes its factory (and `release`s its link) in
# `__del__`, which the garbage collector runs on whichever thread allocates when a collection
# is due: inside `acquire` too, while this thread holds the lock.
_links_lock = threading.RLock()
_home_loop: ContextVar[asyncio.AbstractEventLoop | None] = ContextVar("warmboot_link_loop", default=None)


@contextmanager
def links_on(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """Links acquired inside, in this context or a copy of it (what `asyncio.to_thread` runs
    in), run on `loop`, one per `ConnectOptions`, apart from the process's threaded ones."""
    token = _home_loop.set(loop)
    try:
        yield
    finally:
        _home_loop.reset(token)


def acquire(options: ConnectOptions) -> Link:
    """The process's link for `options` (made on first use); `release` it when done."""
    key = (options, _home_loop.get())
    with _links_lock:
        link = _links.get(key)
        if link is not None and link.pid != os.getpid():
            link = None  # inherited through fork: its thread did not come along
        if link is None or link.closed:
            link = Link(options, key[1])
            _links[key] = link
        link.refs += 1
        return link


def release(link: Link) -> None:
    with _links_lock:
        link.refs -= 1
        if link.refs > 0:
            return
        if _links.get(link.key) is link:
            del _links[link.key]
    link.shutdown()


@atexit.register
def _close_all() -> None:
    with _links_lock:
        links = [link for link in _links.values() if link.pid == os.getpid()]
        _links.clear()
    for link in links:
        link.shutdown()


def _hand_over(done: concurrent.futures.Future[Any], answer: asyncio.Future[Any]) -> None:
    """`submit`'s outcome, on the caller's loop: a call the link's shutdown cancelled fails
    as `call` does."""
    if answer.done():  # its caller was cancelled, and the answer with it
        return
    if done.cancelled():
        answer.set_exception(OperationalError(CLOSED_DURING_CALL))
    elif done.exception() is not None:
        answer.set_exception(done.exception())
    else:
        answer.set_result(done.result())
