"""Connections to NATS, made, given up on and closed, and the errors nats-py reports on them
(`events.natspy` says why this package exists):

- `ErrorsOnce`: an `error_cb` (its `report`). nats-py's default logs each error with its traceback, so a
  process waiting for its server printed a screenful every half second; this logs each
  error once while it repeats, in one line, and keeps the last for a caller that gives up.
- `connecting`: a connect (nats-py's `Client.connect`), given up on (its caller cancelled, or
  its time up), cancelled until it ends, and its client closed. Python 3.11's
  `asyncio.wait_for`, which nats-py's connect awaits each step with, swallows a cancellation
  that lands as the step completes (the TCP connection made: CPython gh-86296, fixed in
  3.12), and nats-py then goes on connecting, forever with `max_reconnect_attempts=-1`: a
  Ctrl-C of a command waiting for its server, or a stop of an agent or a service before its
  server answered, hung for good.
- `close`: nats-py's close of a connection that is down (reconnecting) raised half way, writing
  what it held to be sent onto the lost transport; what cannot be sent is dropped first.
- `transport_lost`: a write onto a connection whose transport closed before nats-py saw it go
  (uvloop raises RuntimeError there, where asyncio's own transports raise ConnectionError): the
  connection is lost, not the code wrong (a soak's finding: answered INTERNAL, and not retried).
- `follow_seed_file` (done by `connecting`): a connection signed in with an nkey seed file signs
  each sign-in with the file as it is then, under that seed's own public key. nats-py reads the
  file again for each signature but keeps the public key it read as it started connecting: after a
  rotation (the server's user given a new key and reloaded, the new seed put in the file) a
  running process signed with the new seed under the old key, and was refused until restarted.
- `tolerate_late_pongs` (done by `connecting`): nats-py's `flush(timeout)` cancels its PING's future
  when the time is up and leaves it in line; the PONG that comes later raised InvalidStateError in
  the read loop, which then read nothing more, the connection still up (a review).
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any, Awaitable

import nats.errors
from nats.aio.client import Client

from events.natsauth import seed_key_pair
from events.tasks import cancel_and_wait, retrieved

log = logging.getLogger("warmboot.natspy")

_PUBLISH_REFUSED = 'nats: permissions violation for publish to "'


class ErrorsOnce:
    """nats-py's `error_cb`: each kind of error logged to `logger` (None: not logged) once until
    the connection is made again (two that alternate are two lines, not one per attempt), one
    line naming `where` (the server, as a log may show it), and a connection reset after a
    refused sign-in not at all: the server closing the connection it refused, read before its
    refusal was (it was a second line, which read as a network fault); the last kept (`last`)
    for a caller that gives up waiting, the first refused sign-in (`refusal`, `refused`), which
    waiting will not change, and the first permissions violation (`denied`), which a later error
    must not hide; a refused publish wakes whoever waits on its subject (`publish_refusal`,
    `unless_refused`), and is kept nowhere. nats-py hands the server's words over in lower case,
    subject included: a refusal that fits subjects in flight differing only in case
    (`...drain.W-1` and `...drain.w-1`) cannot say which of them it was, and wakes none of them
    (each ends as it would have without the refusal, in its reply or time-out)."""

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
        if self.refusal is not None and isinstance(error, ConnectionResetError):
            self._seen.add(kind)  # the refusal's own end: said with it
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
    follow_seed_file(nc)
    tolerate_late_pongs(nc)
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


def tolerate_late_pongs(nc: Client) -> None:
    """Have `nc` pass over a PONG whose PING's future was cancelled (a `flush` that timed out), as
    it takes any other: nats-py set its result, raising InvalidStateError in the read loop, which
    ended for good. PONGs come in the order of the PINGs, so the future is still taken off the line.
    A client that is not nats-py 2.x's is left as it is (`tests/test_late_copies.py` fails if nats-py
    changes this), as `follow_seed_file` leaves it."""
    if not isinstance(getattr(nc, "_pongs", None), list) or not hasattr(nc, "_process_pong"):
        return

    async def process_pong() -> None:
        if nc._pongs:
            future = nc._pongs.pop(0)
            if not future.done():
                future.set_result(True)
            nc._pongs_received += 1
            nc._pings_outstanding = 0

    nc._process_pong = process_pong  # type: ignore[method-assign]


def follow_seed_file(nc: Client) -> None:
    """Before `nc.connect`: if it signs in with an nkey seed file (nats-py's `nkeys_seed`, no credentials
    file), each sign-in, the first and every reconnect, reads the file as it is then, signs the
    server's nonce with that seed and names that seed's public key. nats-py read the public key once,
    as it started connecting, so a process could not follow a rotation without a restart: not the
    reconnects of a running one, nor the first connect of one started while its file still held the
    revoked seed (found by a review). The seed is wiped after each use, as nats-py's own signature
    does. A file that cannot be read, or holds no seed (half written), fails that attempt with a nats-py
    error (reported on the connection's `error_cb`, no secret quoted), and the next attempt reads it
    again; nats-py's own signature raised nkeys' error there, which ended its reconnecting for good.
    A sign-in with a credentials file (its own seed), or a seed given as text, is left to nats-py; so
    is a client that is not nats-py 2.x's (`tests/test_key_rotation.py` fails if nats-py changes this)."""
    setup = getattr(nc, "_setup_nkeys_seed_connect", None)
    if setup is None or not hasattr(nc, "_signature_cb") or not hasattr(nc, "_public_nkey"):
        return

    def sign(nonce: str) -> bytes:
        path = nc._nkeys_seed
        try:
            with seed_key_pair(path) as pair:
                nc._public_nkey = pair.public_key.decode()  # nats-py names it in the CONNECT after signing
                return base64.b64encode(pair.sign(nonce.encode()))
        except OSError as error:
            raise nats.errors.Error(f"cannot read the nkey seed file {path!r}: {error.strerror or error}") from None
        except ValueError as error:  # (half written, say): this attempt fails, as a refused one does; not the next
            raise nats.errors.Error(str(error)) from None

    def follow() -> None:  # what nats-py's connect calls for an nkey sign-in without a credentials file
        if getattr(nc, "_nkeys_seed", None) and not getattr(nc, "_nkeys_seed_str", None):
            nc._signature_cb = sign
        else:
            setup()

    nc._setup_nkeys_seed_connect = follow


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


async def close_within(nc: Client, within: float = CLOSE_GIVEN_UP_S) -> bool:
    """`close(nc)`, given up on after `within` s (whether it ended). nats-py's close writes what it holds onto
    the socket and waits for the kernel to take it (`transport.drain`), then for the socket to close: to a
    server frozen (SIGSTOP, a frozen VM, a stuck disk) whose socket buffers are full, neither ever ends, and
    a process that stops so never did. Given up on, the close is cancelled and the socket closed at once, what it
    held dropped (`_abort_socket`: a process that goes on, a library's caller, keeps no socket to the frozen
    server). Its error, if it ended in one, is raised as `close`'s."""
    closing = asyncio.ensure_future(close(nc))
    try:
        await asyncio.wait({closing}, timeout=within)
    except BaseException:  # cancelled: the close is nobody's
        closing.cancel()
        closing.add_done_callback(retrieved)
        raise
    if not closing.done():
        closing.cancel()
        closing.add_done_callback(retrieved)
        _abort_socket(nc)
        log.warning("the close of the connection to NATS did not end within %gs: given up (the server is frozen, "
                    "or its socket's buffers are full)", within)
        return False
    closing.result()
    return True


def _abort_socket(nc: Client) -> None:
    """Close the socket of `nc` at once, what its transport holds dropped (asyncio's `abort`): the end of a
    close given up on. (nats-py keeps its TCP transport's writer as `_transport._io_writer`; a transport
    without one, a WebSocket's, is left to its process.)"""
    writer = getattr(getattr(nc, "_transport", None), "_io_writer", None)
    if writer is not None:
        writer.transport.abort()


_UVLOOP_CLOSED = ("unable to perform operation on <", "the handler is closed")


def transport_lost(error: BaseException) -> bool:
    """Whether `error` is uvloop refusing a write onto a transport that is closed: nats-py flushed
    onto its connection's transport after the socket went, before it noticed (its reconnect or its
    close), as `RuntimeError: unable to perform operation on <TCPTransport closed=True ...>; the
    handler is closed` (uvloop's `UVHandle._ensure_alive`). That write did not go out, but nats-py keeps
    what it held and sends it once it has reconnected: what raised it may still arrive (uncertain)."""
    if type(error) is not RuntimeError:
        return False
    text = str(error)
    return text.startswith(_UVLOOP_CLOSED[0]) and text.endswith(_UVLOOP_CLOSED[1])


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


async def unless_refused(nc: Client, subject: str, work: Awaitable[Any], errors: "ErrorsOnce | None" = None) -> Any:
    """`await work` (a request to `subject` on `nc`, say), or PublishRefused as soon as the server
    says it refuses this connection a publish to `subject`: the server says so at once, and the
    request would otherwise wait out its whole time-out for a reply that cannot come. Only for a
    connection that reports to an `ErrorsOnce` (`errors_of`: warmboot's `connect`, the CLI's);
    otherwise just `await work` (`errors`: the one it reports to, for a connection made with an
    `error_cb` of its own, which reports to it). A refusal for the subject while `work` runs is this one's too:
    the server judges a publish by the connection's permissions and the subject alone (unless a
    request to a subject that differs only in case is in flight too: `ErrorsOnce`)."""
    errors = errors or errors_of(nc)
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


def closed_for_good(nc: Client, whose: str) -> str:
    """What to say of `nc` once nats-py has closed it for good: it does so on a server's -ERR other than a
    stale connection or a permissions violation (an 'Authorization Violation' when a reload of the server
    revokes the user's password, the connection being open), and never reconnects it."""
    why = describe_error(nc.last_error) if nc.last_error is not None else "no reason given"
    return (f"NATS closed {whose} connection for good ({why}), and it does not reconnect: restart it "
            "(after a rotation of its password, with the new one; docs/security.md)")
