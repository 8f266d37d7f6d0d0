"""The event stream as a service reads it: JetStream asked until it answers at a service's start
(`until_answered`), which incarnation of the stream a process read and whether the stream is still
that log (`stream_identity`, `replaced_by`, `continuity`, `StreamWatch`), and what the stream
holds, as its leader has it (`leaders_stream_info`, `last_seq_on`, `stored_at`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from typing import Any, Awaitable, Callable, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from events.errors import unavailable
from events.nats_codes import ERR_NO_MESSAGE_FOUND
from events.natspy.connections import transport_lost

log = logging.getLogger("warmboot.service")
T = TypeVar("T")


# --- JetStream's answer at a start ----------------------------------------------------


START_WITHIN_S = 60.0  # how long a service's start waits for JetStream to answer its bucket and consumer calls


_UNANSWERED = (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError,
               nats.errors.ConnectionReconnectingError, nats.js.errors.NoStreamResponseError)


def _unanswered(error: BaseException) -> bool:
    """JetStream did not answer (a time-out, nobody listening, the connection between two
    servers), or answered that it cannot yet (a 5xx: no meta leader, no quorum)."""
    if isinstance(error, nats.js.errors.APIError):
        code = getattr(error, "code", None)
        return code is not None and code >= 500
    return isinstance(error, _UNANSWERED) or transport_lost(error)


async def until_answered(call: Callable[[], Awaitable[T]], what: str, within: float = START_WITHIN_S, *,
                         logger: logging.Logger = log) -> T:
    """`call()`, a JetStream API request made at a service's start (a bucket, a consumer), made
    again while JetStream cannot answer it (`_unanswered`: a cluster that has just formed, a
    meta leader election, a time-out), after 0.1 s, doubling up to 2 s; past `within`, the
    last failure. Any other failure (a configuration the server refuses, a connection closed
    for good) is raised at once. The calls it makes are idempotent: a bucket or a durable
    consumer that the lost answer had created is created again with the same configuration,
    which is no change; an ordered consumer (the folds') is made anew, and the one a lost
    answer made, which nobody listens to, is deleted by the server once it is inactive. Each
    attempt that went unanswered is logged at INFO on `logger` (a service's own by default)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    pause = 0.1
    while True:
        try:
            return await call()
        except Exception as error:
            if not _unanswered(error) or loop.time() + pause > deadline:
                raise
            logger.info("%s: JetStream did not answer (%s); asking again in %.1fs", what, type(error).__name__, pause)
        await asyncio.sleep(pause)
        pause = min(pause * 2, 2.0)


# --- the incarnation of the event stream --------------------------------------------------------

INCARNATION_CHECK_S = 5.0  # how often a service's StreamWatch asks which stream has the name


def stream_identity(info: Any) -> tuple[str, int]:
    """(creation time, last sequence) of the stream whose info (nats-py's StreamInfo) this is:
    the creation time names its incarnation (`Projection.stream_created`)."""
    return (info.created.isoformat() if info.created is not None else ""), info.state.last_seq


async def stream_created(nc: NATS, stream: str) -> str:
    """The incarnation (`stream_identity`) of the stream as its leader has it now, asked until
    answered as at a service's start (`until_answered`)."""
    info = await until_answered(lambda: leaders_stream_info(nc.jetstream(), stream), f"the stream {stream}")
    return stream_identity(info)[0]


def answered_by_leader(info: Any) -> bool:
    """Whether a STREAM.INFO answer (nats-py's StreamInfo, or a struct with the same
    `cluster.leader`) is the stream leader's. In a cluster, a stream group without a leader (a
    lost quorum; the moment of an election) has every member answer from its own state, which
    may lack the last events the group stored and acknowledged (nats-server's
    `jsStreamInfoRequest`; such an answer names no leader). So may a member the group prefers,
    within 10 s of its raft node's making (a restart: it may be catching up), while another is
    leader: its answer names that leader among the replicas, where the answering server never
    lists itself. A single server's answer has no `cluster`, an R1 stream's in a cluster names the
    server itself and no replicas."""
    cluster = getattr(info, "cluster", None)
    if cluster is None:
        return True
    return bool(cluster.leader) and all(peer.name != cluster.leader for peer in cluster.replicas or ())


async def leaders_stream_info(js: Any, stream: str) -> Any:
    """The stream's info as its leader has it: where the log ends for a barrier (a fold's, a
    read's) is never a member's own word. A leaderless member's answer (`answered_by_leader`) is
    raised as the 503 the server gives while it cannot tell (ServiceUnavailableError), which
    `until_answered` and every caller's retry already take for an election."""
    info = await js.stream_info(stream)
    if not answered_by_leader(info):
        raise nats.js.errors.ServiceUnavailableError(
            code=503, description=f"the stream {stream} has no leader: a member's own state is not where its log ends")
    return info


def replaced_by(stream: str, folded: str | None, created: str) -> str | None:
    """Why the stream `stream`, created at `created` as it is now, is not the log a process read as
    the incarnation created at `folded` (a projection's `Projection.stream_created`, a service's
    `StreamWatch.created`); None if it is."""
    if folded is None:
        return f"the projection does not say which incarnation of the event stream {stream} it is a fold of"
    if created != folded:
        return (f"the event stream {stream} was made again (created {created}; this process read the one "
                f"created {folded})")
    return None


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def micros(when: datetime.datetime) -> int:
    """A stream time as nats-py reads it (to the microsecond), in microseconds since the epoch."""
    return (when - _EPOCH) // datetime.timedelta(microseconds=1)


async def continuity(nc: NATS, stream: str, seq: int, at_us: int) -> str | None:
    """Why the message at `seq` of `stream` is not the one a process read there, stored at `at_us`
    (microseconds since the epoch); None if it is, or if that cannot be told (`seq` or `at_us` 0).
    A log restored from a copy of the server's store, or rolled back, keeps the stream's creation
    time (`stream_identity`): what tells it is that the message at a sequence read before is
    another one now (stored at another time), or none. Read through the stream leader."""
    if not seq or not at_us:
        return None
    js = nc.jetstream()
    try:
        message = await js.get_msg(stream, seq)
    except NotFoundError as error:
        if getattr(error, "err_code", None) != ERR_NO_MESSAGE_FOUND:
            raise  # the stream itself is not there: the caller asks again
        last = (await leaders_stream_info(js, stream)).state.last_seq
        if last >= seq:
            return None  # a hole (an operator deleted that message: docs/contract.md), not another log
        return (f"the event stream {stream} ends at sequence {last}, before sequence {seq}, which this process "
                f"read: restored or rolled back")
    if message.time is None or micros(message.time) != at_us:
        return (f"the event stream {stream} holds another message at sequence {seq} than this process read "
                f"(stored {message.time.isoformat() if message.time else '?'}): restored or rolled back")
    return None


class StreamWatch:
    """Fails a service whose event stream is deleted and made again, or restored or rolled back,
    while it runs (`failed`, done with the reason; `warmboot.runner.until_stopped` then stops the
    process, status 1): what the service folded of the log (the registry's roster, the
    snapshotter's placements and positions) is of a log that no longer exists. Every `every`
    seconds it asks the stream's info (its creation time: `replaced_by`) and whether the last
    message it saw at the previous look is still there, stored when it was (`continuity`); a
    stream that does not exist, or a JetStream that does not answer, is asked again at the next
    look. The scheduler's fold also looks at its consumer's re-creation (`services.scheduler.fold`)."""

    def __init__(self, nc: NATS, stream: str, every: float = INCARNATION_CHECK_S,
                 read: Callable[[], tuple[int, int]] | None = None) -> None:
        self.nc, self.stream, self.every = nc, stream, every
        self.created: str | None = None
        self.mark: tuple[int, int] = (0, 0)  # (sequence, stored at in µs) of the last message at the last look
        # The service's own mark, if it has one (the registry's roster fold: the last message it folded),
        # checked too: a copy put back between two looks may still hold the watch's mark, not that one.
        self.read = read
        self.failed: asyncio.Future[str] | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False  # ends the watch also past a cancellation a request's time-out swallowed
        self.lost: str | None = None  # why the stream is not the log read, once a look found it (`confirmed`)
        self._confirmed: int | None = None  # the session of the connection the log was confirmed in
        self._confirming: tuple[int, asyncio.Future[bool]] | None = None  # a look under way for a session

    async def start(self) -> "StreamWatch":
        """The incarnation of now is the service's (call it right after the service's store has made
        or found the stream)."""
        self.failed = asyncio.get_running_loop().create_future()
        info = await until_answered(lambda: leaders_stream_info(self.nc.jetstream(), self.stream),
                                    f"the stream {self.stream}")
        self.created = stream_identity(info)[0]
        self.mark = await until_answered(lambda: self._last(info.state.last_seq), f"the stream {self.stream}")
        self._confirmed = self.nc.stats["reconnects"]
        self._task = asyncio.create_task(self._watch(), name=f"stream-watch-{self.stream}")
        return self

    async def _last(self, seq: int) -> tuple[int, int]:
        """(seq, its stored time in µs) of the message at `seq`, the stream's last; (0, 0) for none."""
        if not seq:
            return 0, 0
        try:
            message = await self.nc.jetstream().get_msg(self.stream, seq)
        except NotFoundError as error:
            if getattr(error, "err_code", None) == ERR_NO_MESSAGE_FOUND:
                return 0, 0  # removed meanwhile: nothing to hold on to this time
            raise
        return seq, micros(message.time) if message.time is not None else 0

    async def _watch(self) -> None:
        assert self.failed is not None
        while not self._stopping:
            await asyncio.sleep(self.every)  # a period: nothing tells a process that a stream was deleted
            try:
                why = await self.look()
            except Exception as error:  # gone and not made again yet, an election, an outage: next look
                log.debug("the stream %s could not be looked at (%s)", self.stream, type(error).__name__)
                continue
            if self._stopping:
                return
            if why is not None:
                self.lost = why
                log.error("%s: stopping; start the service again to read the new stream", why)
                if not self.failed.done():
                    self.failed.set_result(why)
                return

    async def look(self) -> str | None:
        """One look: why the stream is not the log the service read (None if it is: then the
        stream's last message is the next look's mark). Raises what asking raised."""
        info = await leaders_stream_info(self.nc.jetstream(), self.stream)
        why = (replaced_by(self.stream, self.created, stream_identity(info)[0])
               or await continuity(self.nc, self.stream, *self.mark)
               or (await continuity(self.nc, self.stream, *self.read()) if self.read is not None else None))
        if why is None:
            self.mark = await self._last(info.state.last_seq)
        return why

    async def confirmed(self) -> bool:
        """Whether the stream is still the log the service read, as looked at (`look`) once in the
        present session of its connection (nats-py counts each reconnection), one look shared by the
        callers meanwhile: a single server that crashed and came back may have lost the tail it had
        not synced, which the service folded, and the next look of the watch is up to `every`
        seconds away. False while no session is up, while a look cannot be made (the next call
        looks again), and once a look found another log (`lost`; the watch fails at its next look:
        the service goes on until then, its caller not trusting what it folded)."""
        if self.lost is not None or not self.nc.is_connected:
            return False
        session = self.nc.stats["reconnects"]
        if session == self._confirmed:
            return True
        if self._confirming is None or self._confirming[0] != session:
            self._confirming = (session, asyncio.ensure_future(self._confirm(session)))
        return await asyncio.shield(self._confirming[1])

    async def _confirm(self, session: int) -> bool:
        try:
            why = await self.look()
        except Exception as error:  # not answered: the next call looks again
            log.debug("the stream %s could not be looked at (%s)", self.stream, type(error).__name__)
            return False
        finally:
            if self._confirming is not None and self._confirming[0] == session:
                self._confirming = None
        if why is not None:
            if self.lost is None:
                log.error("%s: what this process folded is not trusted; it stops at the watch's next look", why)
            self.lost = why
            return False
        self._confirmed = session
        return True

    async def stop(self) -> None:
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


# --- what the stream holds ------------------------------------------------------------


async def last_seq_on(js: Any, stream: str, subject: str) -> int:
    """The stream sequence of the last message on `subject` (as the stream leader has it), 0 if none."""
    try:
        return (await js.get_msg(stream, subject=subject)).seq
    except NotFoundError:
        return 0


async def stored_at(js: Any, stream: str, seq: int) -> Msg:
    """The message stored at `seq`, known to be in the stream (a reply's sequence, the
    log's or the reply cache's word for it). A direct get is answered by any replica, and
    one that has not caught up yet says "no message"; so that answer is asked again of the
    stream leader. When the leader does not have it either, or nobody answers, the log is
    not readable now: UNAVAILABLE (retry), never INTERNAL."""
    try:
        return await js.get_msg(stream, seq=seq, direct=True)
    except NotFoundError:
        pass  # a replica behind the leader answered
    try:
        return await js.get_msg(stream, seq=seq)  # STREAM.MSG.GET: answered by the leader
    except NotFoundError:
        raise unavailable(f"message {seq} of {stream} is not readable yet; try again") from None
