"""The registry's roster, kept current from the log, and a read barrier on it.

`RosterFold` reads the workers' subjects (`<prefix>.ev.worker.*`, not the whole log:
a start replays worker events only) with an ordered push consumer into a callback,
the fastest way nats-py reads a stream, and folds each event's type and sequence
into a `Roster` (`services.registry.roster`). The event store's topic header names the
type; of the bodies, only a registration's and an update's are read, for their node (and
revision), and a drain's, for its reason.

`current()` is the barrier a heartbeat is answered behind: it returns once the fold
holds every worker event that was stored before the call, written by this replica
or any other. The consumer cannot say that by itself: the server answers a write
before it signals the stream's consumers (an internal queue), so neither a
delivery nor the consumer's pending count need include an event whose writer has
already been answered. The stream's state does, so a barrier round asks the stream
leader (1) the stream's last sequence L, then, unless the fold already accounts for
everything up to L, (2) the first worker event after what the fold accounts for;
none (or one past L) means the fold is complete up to L, else the round waits until
the fold has delivered that event and asks (2) again. Calls to `current()` made
while a round is under way join the next round, so one round (one or two API
requests) serves every heartbeat that arrived meanwhile; rounds start at most every
`ROUND_GAP_S` while calls keep coming, so that a round serves many (a lone call is
served at once).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from events.codec import decode_event
from events.errors import ContractError, unavailable
from events.jetstream import TOPIC_HEADER
from events.jetstream.retry import REQUEST_TIMEOUT
from events.nats_codes import ERR_NO_MESSAGE_FOUND
from events.natspy.headers import use_lean_headers
from events.natspy.jetstream import NO_DROPS, ORDERED_IDLE_HEARTBEAT_S, ApiError, MsgGetAnswer, ack_positions, ack_time
from events.schema import Reason
from events.subjects import event_subject, stream_name
from events.tasks import cancel_and_wait
from services.registry.roster import DRAINS, NAMES_NODE, REVISES, Roster
from services.streams import answered_by_leader, until_answered

log = logging.getLogger("warmboot.registry")

WORKER_KIND = "worker"
ROUND_GAP_S = 0.002  # under load a round costs about what 3 heartbeats do: make each serve many


class _State(msgspec.Struct):
    last_seq: int = 0


class _Peer(msgspec.Struct):
    name: str | None = None


class _Cluster(msgspec.Struct):
    leader: str | None = None
    replicas: list[_Peer] = []


class _StreamInfo(msgspec.Struct):
    state: _State | None = None
    cluster: _Cluster | None = None  # `services.streams.answered_by_leader`
    error: ApiError | None = None


class _Registered(msgspec.Struct):
    """The fields of a registration's, an update's or a runtime change's body the roster keeps."""
    node: str | None = None
    revision: int | None = None


class _Drain(msgspec.Struct):
    """The field of a drain's body the roster keeps: as the wire bounds it, since a heartbeat's answer
    carries it (a body not written by the registry, beyond the bounds, is read as giving no reason)."""
    reason: Reason | None = None


def _not_yet(answer: Any) -> bool:
    """An answer the stream cannot give yet: a 5xx (no leader, no quorum), or a STREAM.INFO from a
    member while its group has no leader (`answered_by_leader`)."""
    return (answer.error is not None and answer.error.code >= 500) or not answered_by_leader(answer)


_registered_decoder = msgspec.json.Decoder(_Registered)
_drain_decoder = msgspec.json.Decoder(_Drain)
_info_decoder = msgspec.json.Decoder(_StreamInfo)
_get_decoder = msgspec.json.Decoder(MsgGetAnswer)


class RosterFold:
    """The roster kept current from the workers' subjects, with a read barrier (`current`)."""

    def __init__(self, nc: NATS, prefix: str, roster: Roster, barrier_timeout: float = 2.0):
        self.nc = nc
        self.roster = roster
        self.stream = stream_name(prefix)
        self.filter = event_subject(prefix, WORKER_KIND, "*")
        self.subject_prefix = self.filter[:-1]
        self.barrier_timeout = barrier_timeout
        # Every worker event up to this sequence is folded (the fold's own position, or
        # further when the stream leader said no worker event lies in between).
        self.complete = 0
        self.errors = 0
        self.rounds = 0
        # (sequence, stored at in µs) of the last message folded: which log the roster is of
        # (`services.streams.StreamWatch` checks that message is still there)
        self.mark: tuple[int, int] = (0, 0)
        self._sub: Any = None
        self._waiters: list[asyncio.Future[None]] = []  # calls of current() for the next round
        self._round: asyncio.Task[None] | None = None
        self._want: tuple[int, asyncio.Future[None]] | None = None  # the round waits for this sequence
        self._stopping = False
        # Told (worker id, node) of each registration or update folded that names a node for a worker
        # in a life, whichever replica wrote it (the registry judges it on its binding of workers to nodes).
        self.on_node: Callable[[str, str], None] | None = None

    async def start(self, timeout: float) -> None:
        """Read the workers' events from the first; return once every one stored so far is folded."""
        use_lean_headers(self.nc)
        js = self.nc.jetstream()
        self._sub = await until_answered(  # asked again while JetStream cannot answer (a leader election)
            lambda: js.subscribe(self.filter, stream=self.stream, cb=self._on_msg, ordered_consumer=True,
                                 idle_heartbeat=ORDERED_IDLE_HEARTBEAT_S, **NO_DROPS),
            f"the roster's consumer on {self.stream}")
        try:
            await self._settle(asyncio.get_running_loop().time() + timeout, patient=True)
        except asyncio.TimeoutError:
            raise unavailable(f"the registry could not fold the workers' events within {timeout:g}s "
                              f"(it holds up to sequence {self.complete})") from None

    async def stop(self) -> None:
        self._stopping = True  # also ends a round loop whose cancellation a time-out swallowed
        if self._want is not None:  # a round waiting for an event that will not come now
            self._want[1].cancel()
        sub, self._sub = self._sub, None
        if sub is not None:
            with suppress(Exception):
                await sub.unsubscribe()
        await cancel_and_wait(self._round)
        self._fail(self._waiters, unavailable("the registry is stopping"))
        self._waiters = []

    # --- folding ------------------------------------------------------------------------

    async def _on_msg(self, msg: Msg) -> None:
        if not msg.reply:
            return
        seq = ack_positions(msg.reply)[0]
        if seq <= self.roster.seq:  # redelivered: an ordered consumer reset before its first message
            return
        headers = msg.headers
        event_type = headers.get(TOPIC_HEADER) if headers else None
        if event_type is None:  # not written by the event store: the body says its type
            try:
                event_type = type(decode_event(msg.data)).__name__
            except Exception:
                self.errors += 1
                log.warning("message %d on %s is not a worker event; skipped", seq, msg.subject)
                event_type = ""
        node = revision = reason = None
        if event_type == DRAINS:
            try:
                reason = _drain_decoder.decode(msg.data).reason
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.errors += 1
                log.warning("message %d on %s: no reason read from its body", seq, msg.subject)
        elif event_type in REVISES:
            try:
                read = _registered_decoder.decode(msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.errors += 1
                log.warning("message %d on %s: no node nor revision read from its body", seq, msg.subject)
            else:
                node = read.node if event_type in NAMES_NODE else None
                revision = read.revision
        worker_id = msg.subject[len(self.subject_prefix):]
        self.roster.apply(seq, worker_id, event_type, node, revision, reason)
        if node is not None and self.on_node is not None and self.roster.alive(worker_id):
            self.on_node(worker_id, node)
        self.mark = (seq, ack_time(msg.reply) // 1000)
        if seq > self.complete:
            self.complete = seq
        want = self._want
        if want is not None and seq >= want[0] and not want[1].done():
            want[1].set_result(None)

    # --- the barrier --------------------------------------------------------------------

    async def current(self) -> None:
        """Return once every worker event stored before this call is folded.

        UNAVAILABLE if the stream leader cannot be asked, or the fold does not get
        there within `barrier_timeout`.
        """
        if self._stopping:  # no round will run again
            raise unavailable("the registry is stopping")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        if self._round is None:
            self._round = asyncio.create_task(self._rounds(), name=f"{self.stream}-roster-barrier")
        await waiter

    async def _rounds(self) -> None:
        loop = asyncio.get_running_loop()
        waiters: list[asyncio.Future[None]] = []
        try:
            while self._waiters and not self._stopping:
                started = loop.time()
                waiters, self._waiters = self._waiters, []
                self.rounds += 1
                try:
                    await self._settle(started + self.barrier_timeout)
                except asyncio.TimeoutError:
                    self._fail(waiters, unavailable(
                        f"this registry replica's fold of worker events is not current within "
                        f"{self.barrier_timeout:g}s (it holds up to sequence {self.complete})"))
                except ContractError as error:
                    self._fail(waiters, error)
                except (nats.errors.Error, OSError) as error:
                    self._fail(waiters, unavailable(f"the event log is unavailable: {error!r}"))
                except Exception as error:  # a bug, or an answer not understood: the log answers instead
                    log.warning("the roster's barrier failed; heartbeats are answered from the log", exc_info=True)
                    self._fail(waiters, unavailable(f"the registry's roster could not be brought current: {error!r}"))
                else:
                    for waiter in waiters:
                        if not waiter.done():
                            waiter.set_result(None)
                if self._waiters:
                    await asyncio.sleep(started + ROUND_GAP_S - loop.time())
        finally:
            self._round = None
            # Cancelled mid-round (stop): this round's heartbeats are answered, not left waiting.
            self._fail(waiters, unavailable("the registry is stopping"))

    @staticmethod
    def _fail(waiters: list[asyncio.Future[None]], error: Exception) -> None:
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(error)
                waiter.exception()  # retrieved: a caller that gave up leaves no warning

    async def _settle(self, deadline: float, patient: bool = False) -> None:
        """Bring `complete` up to the stream's last sequence as of now (TimeoutError past `deadline`)."""
        loop = asyncio.get_running_loop()
        last = await self._last_seq(deadline - loop.time(), patient)
        while self.complete < last:
            seq = await self._next_worker_event(self.complete + 1, deadline - loop.time(), patient)
            if seq is None or seq > last:
                self.complete = max(self.complete, last)
                return
            if self.complete < seq:  # not folded yet: it is on its way to the callback
                if self._stopping:  # and will not come; stop() cancelled us, but a time-out swallowed it
                    raise unavailable("the registry is stopping")
                want = self._want = (seq, loop.create_future())
                try:
                    await asyncio.wait_for(want[1], deadline - loop.time())
                finally:
                    self._want = None

    async def _api(self, verb: str, body: bytes, decoder: msgspec.json.Decoder, timeout: float,
                   patient: bool = False) -> Any:
        """One stream API request, decoded; asked again within `timeout` if it was lost (no
        answer within `REQUEST_TIMEOUT`, as in a leader election), and, when `patient` (the
        start), also while nobody listens or the stream cannot answer yet (`_not_yet`: after a
        pause, doubling). Past `timeout`, TimeoutError. A barrier round is not patient: an outage
        fails it at once, and its heartbeats are looked up in the log instead. One request used
        to wait the whole `timeout`: at the start (two minutes), a STREAM.INFO lost while the
        cluster elected its leaders failed it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pause = 0.05
        while (left := deadline - loop.time()) > 0:
            attempt = min(left, REQUEST_TIMEOUT)
            try:
                msg = await self.nc.request(f"$JS.API.STREAM.{verb}.{self.stream}", body, timeout=attempt)
            except nats.errors.TimeoutError:
                if attempt >= left:  # it had all the time there was (uvloop's timers round it to a millisecond)
                    break
                continue
            except nats.errors.NoRespondersError:
                if not patient:
                    raise
            else:
                answer = decoder.decode(msg.data)
                if not patient or not _not_yet(answer):
                    return answer
            await asyncio.sleep(min(pause, max(deadline - loop.time(), 0.0)))  # a back-off, not a wait for a condition
            pause = min(pause * 2, 1.0)
        raise asyncio.TimeoutError

    async def _last_seq(self, timeout: float, patient: bool = False) -> int:
        info = await self._api("INFO", b"", _info_decoder, timeout, patient)
        if info.error is not None or info.state is None:
            raise unavailable(f"the event log {self.stream} is unavailable: "
                              f"{info.error.description if info.error else 'no state'}")
        if not answered_by_leader(info):
            raise unavailable(f"the event log {self.stream} has no leader: a member's own state is not where "
                              "its log ends")
        return info.state.last_seq

    async def _next_worker_event(self, start: int, timeout: float, patient: bool = False) -> int | None:
        """The sequence of the first worker event at or after `start`, as the stream leader has it."""
        body = msgspec.json.encode({"seq": start, "next_by_subj": self.filter})
        got = await self._api("MSG.GET", body, _get_decoder, timeout, patient)
        if got.error is not None:
            if got.error.err_code == ERR_NO_MESSAGE_FOUND or got.error.code == 404:
                return None
            raise unavailable(f"the event log {self.stream} is unavailable: {got.error.description}")
        return got.message.seq if got.message is not None else None
