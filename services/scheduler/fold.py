"""The scheduler's fold: the projection kept current from the event stream.

An ordered push consumer on the whole stream delivers every message from the
projection's position, and each is decoded with msgspec straight into its event
Struct (`EventReader`) and folded; booking markers are folded from their subject
alone, and messages that are not events (the tracking records of process
applications) only advance the position. A replay, and every replica's fold of every
placement, is bound by the work per message: the fold's connection parses headers with
the lean parser, and its data messages are handed from the connection's read loop
straight to the fold, read ahead of nats-py's protocol parser
(`events.natspy.frames.deliver_directly`). While a checkpoint has the
fold paused they take nats-py's path to the subscription's callback instead, which
folds them in order once the pause ends; direct delivery resumes when none is left.
`wait(seq)` lets a request be answered from state that includes `seq` (`min_seq`),
or UNAVAILABLE after a deadline. Only the next message is folded: one further on means
those between were missed (nats-py drops what a full queue cannot take, though this fold's
has no limit), and the consumer is made again from the first of them (`_missing`).

A projection is a fold of one incarnation of the stream (`Projection.stream_created`):
a stream deleted and made again is another log, whose sequences start over. nats-py
re-creates the ordered consumer of a deleted stream (two missed idle heartbeats: 1 to
2 s) from the sequence after the last one read, on whatever stream has the name by then.
So each re-creation is run by the fold (`events.natspy.jetstream.guard_recreation`): its messages
are held until the stream's info says which stream the new consumer reads; if it is
not the projection's (`replaced_by`), or whenever a stream info asked for another
reason says so, the fold gives up (`give_up`): it folds nothing more, every wait is
UNAVAILABLE, and its owner is told (`on_stale`; the scheduler stops). No message of
another incarnation is folded into a projection that serves: a re-made consumer's are
held until the check, and at the start (not paused, a replay's speed) those folded before
the check are thrown away with the fold, which raises StreamReplaced. What the replica
decides between the deletion and the check is not covered (docs/operations.md).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import math
from contextlib import asynccontextmanager, suppress
from typing import Any, AsyncIterator, Awaitable, Callable, Union

import msgspec
from msgspec import Raw
from msgspec.structs import force_setattr
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from events.errors import unavailable
from events.jetstream import TOPIC_HEADER, VERSION_HEADER
from events.natspy.connections import describe_error
from events.natspy.frames import DirectDelivery, deliver_directly
from events.natspy.headers import use_lean_headers
from events.natspy.jetstream import (NO_DROPS, ORDERED_IDLE_HEARTBEAT_S, ack_positions, ack_time, guard_recreation,
                                     reset_from)
from events.schema import (EVENT_TYPES, ActorPlaced, ActorRuntime, AnyEvent, Snapshot, SnapshotTaken, TagRecorded,
                           WorkerBooked, WorkerEvent)
from events.subjects import stream_name
from events.tasks import cancel_and_wait, retrieved
from services.scheduler.projection import Projection
from services.streams import continuity, leaders_stream_info, replaced_by, stream_identity, until_answered

log = logging.getLogger("warmboot.scheduler")

# The two events that carry a stamp, read with the stamp's JSON kept raw (see EventReader).


class _SnapshotRead(Snapshot, kw_only=True, frozen=True):
    sandbox_runtime: Raw = Raw(b"null")


class _PlacedRead(ActorPlaced, kw_only=True, frozen=True, tag="ActorPlaced"):
    sandbox_runtime: Raw


class _TakenRead(SnapshotTaken, kw_only=True, frozen=True, tag="SnapshotTaken"):
    snapshot: _SnapshotRead


_READ_TYPES = {ActorPlaced: _PlacedRead, SnapshotTaken: _TakenRead}
_read_decoder = msgspec.json.Decoder(Union[tuple(_READ_TYPES.get(t, t) for t in AnyEvent.__args__)])  # type: ignore[misc]
_runtime_decoder = msgspec.json.Decoder(ActorRuntime)
_optional_runtime_decoder = msgspec.json.Decoder(ActorRuntime | None)
RUNTIMES_KEPT = 4096
PAST_END_GRACE_S = 0.25  # a min_seq not folded after this long is checked against the end of the log
CURRENT_RETRY_S = 0.05  # `Fold.current`: the first pause before a failed question about the log's end is asked again
STREAM_GONE_RETRY_S = 0.5  # a re-made consumer's stream not found: asked again after this long
REFILL_AGAIN_S = 1.0  # messages missed again at the same place: read again at most this often (`Fold._missing`)


class StreamReplaced(Exception):
    """The fold gave up as it started (`Fold.give_up`): the reason."""


class EventReader:
    """Decodes event bodies for the fold: the same events as `decode_event`, or the same
    errors, in less time.

    Decoding checks every string of an event against its pattern; the stamp an
    ActorPlaced or a SnapshotTaken carries (a runtime: class, schema version and
    attributes) is most of those strings, and recurs from event to event. So those
    two are read with the stamp's JSON kept raw, and each distinct stamp text is
    decoded, with all its checks, once; the event then holds the decoded runtime (it
    is an instance of a subclass of its schema type, field for field the same).
    """

    def __init__(self) -> None:
        self._runtimes: dict[bytes, ActorRuntime] = {}
        self._optional: dict[bytes, ActorRuntime | None] = {}

    def decode(self, data: bytes) -> Any:
        event = _read_decoder.decode(data)
        kind = type(event)
        if kind is _PlacedRead:
            force_setattr(event, "sandbox_runtime", self._runtime(event.sandbox_runtime, self._runtimes,
                                                                 _runtime_decoder))
        elif kind is _TakenRead:
            snapshot = event.snapshot
            force_setattr(snapshot, "sandbox_runtime", self._runtime(snapshot.sandbox_runtime, self._optional,
                                                                    _optional_runtime_decoder))
        return event

    @staticmethod
    def _runtime(raw: Raw, seen: dict, decoder: msgspec.json.Decoder) -> Any:
        text = bytes(raw)
        try:
            return seen[text]
        except KeyError:
            runtime = decoder.decode(text)  # raises as decoding the whole event would
            if len(seen) >= RUNTIMES_KEPT:
                seen.clear()
            seen[text] = runtime
            return runtime


class Fold:
    """The projection, kept current from the stream: replay from sequence 1, then live.

    `listeners` are called with the sequence of each message right after it is folded
    (the committer's ledger of bookings in flight, the checkpoint saver's trigger);
    `paused()` stops folding while a checkpoint copies the projection. `on_cpu`, if given,
    is told the thread CPU of the fold's direct deliveries as they happen (reading each
    message and folding it; not the wake-ups that brought them, nor the messages folded
    through nats-py's path during a pause). `on_stale` are called once, with the reason,
    if the fold gives up (`give_up`: the stream is another incarnation than the projection's).
    """

    def __init__(self, nc: NATS, prefix: str, projection: Projection, *,
                 on_cpu: Callable[[float], None] | None = None, on_refill: Callable[[], None] | None = None):
        self.nc = nc
        self.prefix = prefix
        self.stream = stream_name(prefix)
        self.events_prefix = f"{prefix}.ev."
        self.booking_prefix = f"{prefix}.ev.{WorkerBooked.KIND}."
        self.worker_prefix = f"{prefix}.ev.{WorkerEvent.KIND}."
        self.actor_prefix = f"{prefix}.ev.actor."
        self.tag_prefix = f"{prefix}.ev.{TagRecorded.KIND}."
        self.projection = projection
        self.listeners: list[Callable[[int], None]] = []
        self.behind = 0  # messages the server had not delivered yet at the last one folded
        self.errors = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []  # sorted: (seq, tie, waiter)
        self._tie = itertools.count()
        # The stream's info as last asked (`_stream_end`): the question's number, and its answer. A
        # number, not the loop's clock: uvloop's clock stands still within a millisecond.
        self._end: tuple[int, asyncio.Future[Any]] | None = None
        self._asked = 0  # questions asked so far
        self._sub: Any = None
        self.on_cpu = on_cpu
        self._direct: DirectDelivery | None = None
        self._in_callback = 0  # messages nats-py's path has handed to `_on_msg` and it has not folded yet
        self._read = EventReader().decode
        self._paused: asyncio.Future[None] | None = None
        # Why the fold gave up (`give_up`), or None: it folds nothing more, and every wait fails.
        self.stale: str | None = None
        self.on_stale: list[Callable[[str], None]] = []
        self._guard: asyncio.Task[Any] | None = None  # nats-py's task re-making the consumer, while it checks
        # Messages missed (`_missing`): reads again begun (each told to `on_refill`), the task reading
        # them again, and where and when it last had the consumer made again
        self.refills = 0
        self.on_refill = on_refill
        self._refilling: asyncio.Task[None] | None = None
        self._refilled: tuple[int, float] = (0, -math.inf)

    @property
    def applied(self) -> int:
        return self.projection.seq

    async def start(self, timeout: float) -> None:
        """Read from the message after the projection's position (1, or a restored checkpoint's + 1).

        A projection at sequence 0 becomes a fold of the stream as it is before the consumer
        is made; the stream, asked again once the consumer is made, must still be the
        projection's incarnation, else the fold gives up and StreamReplaced is raised."""
        use_lean_headers(self.nc)
        js = self.nc.jetstream()
        # All asked again while JetStream cannot answer (a replica started during a leader election).
        info = await until_answered(lambda: leaders_stream_info(js, self.stream), f"the stream {self.stream}")
        if not self.projection.seq:
            self.projection.stream_created = stream_identity(info)[0]

        def subscribe() -> Any:
            start = {}  # made anew for each attempt: nats-py writes the deliver subject into the config
            if self.projection.seq:
                start = {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE,
                         "config": ConsumerConfig(opt_start_seq=self.projection.seq + 1)}
            return js.subscribe(f"{self.prefix}.>", stream=self.stream, cb=self._on_msg, ordered_consumer=True,
                                idle_heartbeat=ORDERED_IDLE_HEARTBEAT_S, **NO_DROPS, **start)

        self._sub = await until_answered(subscribe, f"the fold's consumer on {self.stream}")
        self._direct = deliver_directly(self.nc, self._sub, self._folded, self._direct_ready,
                                        wanted=(TOPIC_HEADER, VERSION_HEADER),  # all fold_message reads
                                        on_cpu=self.on_cpu)
        guard_recreation(self._sub, self._recreate)
        # Asked once the consumer is made: the stream it reads is this one, or the fold gives up. Not
        # paused meanwhile (a replay would take nats-py's slower path): what it folded until then is
        # thrown away with it, for no request is answered from a fold that has not started.
        target = self.check_stream(
            await until_answered(lambda: leaders_stream_info(js, self.stream), f"the stream {self.stream}"))
        if self.stale is not None:
            raise StreamReplaced(self.stale)
        await self.wait(target, timeout)

    async def stop(self) -> None:
        guard, self._guard = self._guard, None
        if guard is not None and guard is not asyncio.current_task():
            await cancel_and_wait(guard)
        refilling, self._refilling = self._refilling, None
        if refilling is not None and refilling is not asyncio.current_task():
            await cancel_and_wait(refilling)
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        sub, self._sub = self._sub, None
        if sub is not None:
            with suppress(Exception):
                await sub.unsubscribe()
        for _, _, waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(unavailable("the scheduler is stopping"))
        self._waiters.clear()

    # --- which stream ---

    def check_stream(self, info: Any) -> int:
        """The last sequence of the stream whose info this is (asked just now); if it is not the
        incarnation the projection is a fold of, the fold gives up first (`give_up`)."""
        created, last_seq = stream_identity(info)
        why = replaced_by(self.stream, self.projection.stream_created, created)
        if why is not None:
            self.give_up(why)
        return last_seq

    def give_up(self, why: str) -> None:
        """The stream is not the log the projection is a fold of (`replaced_by`, or the fold could not
        tell): fold nothing more, fail every wait (UNAVAILABLE, now and from now on), and tell
        `on_stale`. Once; the subscription stays until `stop`."""
        if self.stale is not None:
            return
        self.stale = why
        if self._direct is not None:  # what arrives now takes nats-py's path, and `_on_msg` drops it
            self._direct.close()
            self._direct = None
        error = self.stale_error()
        for _, _, waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(error)
        self._waiters.clear()
        for callback in self.on_stale:
            try:
                callback(why)
            except Exception:
                log.exception("telling that the fold gave up failed")

    def stale_error(self) -> Exception:
        """What a request gets from a fold given up (UNAVAILABLE: another replica may answer)."""
        return unavailable(f"this scheduler replica stopped folding the log ({self.stale}); try another replica")

    async def _recreate(self, recreate: Callable[[], Awaitable[None]]) -> None:
        """nats-py re-makes the fold's consumer (`events.natspy.jetstream.guard_recreation`): missed heartbeats
        (a stream leader lost; the stream deleted, and maybe made again by now) or a delivery out of
        order. It is made from the sequence after the last one read, on the stream that has the name
        now; so its messages are held (the fold paused) until the stream's info, asked once it is
        made, says which incarnation that is: the projection's, and the fold goes on; another, and
        the fold gives up, having folded none of it. The info is asked until it answers, through an
        election and through a time without the stream (deleted, not made again yet), while the
        consumer's messages wait. One check at a time: a reset meanwhile is left to the next one."""
        if self.stale is not None or self._guard is not None:
            return
        self._guard = asyncio.current_task()
        try:
            async with self.paused():
                await recreate()
                try:
                    info = await self._stream_info()
                except Exception as error:  # a connection closed for good: what it reads is not known
                    self.give_up(f"which stream the fold's consumer on {self.stream} reads could not be asked "
                                 f"({describe_error(error)})")
                else:
                    self.check_stream(info)
                    if self.stale is None:
                        # the same creation time, yet maybe not the log folded: one restored from a copy
                        try:
                            why = await until_answered(self.continuity, f"the stream {self.stream}", math.inf)
                        except Exception as error:  # the stream gone again, the connection closed: not known
                            why = (f"whether the event stream {self.stream} still holds the message the fold "
                                   f"read last could not be asked ({describe_error(error)})")
                        if why is not None:
                            self.give_up(why)
        finally:
            if self._guard is asyncio.current_task():
                self._guard = None

    async def continuity(self) -> str | None:
        """Why the message at the projection's position is not the one folded there
        (`services.streams.continuity`: a log restored from a copy, or rolled back); None if it is."""
        stamp = self.projection.seq_time
        return await continuity(self.nc, self.stream, self.projection.seq, int(stamp) // 1000 if stamp else 0)

    async def _stream_info(self) -> Any:
        """The stream's info, asked until it answers: again while JetStream cannot (`until_answered`),
        and while the stream does not exist (its next incarnation will answer)."""
        js = self.nc.jetstream()
        while True:
            try:
                return await until_answered(lambda: leaders_stream_info(js, self.stream),
                                            f"the stream {self.stream}", math.inf)
            except NotFoundError:
                await asyncio.sleep(STREAM_GONE_RETRY_S)

    @asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Fold nothing while inside (requests may still read the projection)."""
        while self._paused is not None:  # one pause at a time
            await asyncio.shield(self._paused)
        gate = self._paused = asyncio.get_running_loop().create_future()
        try:
            yield
        finally:
            self._paused = None
            gate.set_result(None)

    def _direct_ready(self) -> bool:
        """Direct delivery keeps the order only when nats-py's path holds nothing: no pause,
        no message in the subscription's queue or in `_on_msg`."""
        sub = self._sub
        return (self._paused is None and not self._in_callback and sub is not None
                and sub._sub._pending_queue.empty())

    async def _on_msg(self, msg: Msg) -> None:
        """nats-py's path: messages that arrived during a pause, or that direct delivery left to nats-py."""
        self._in_callback += 1
        try:
            while self._paused is not None:
                await asyncio.shield(self._paused)
            if self.stale is not None:  # given up while it waited: not of the projection's stream, maybe
                return
            seq, behind = ack_positions(msg.reply)
            self._folded(seq, behind, msg.subject, msg.headers, msg.data, ack_time(msg.reply))
        finally:
            self._in_callback -= 1

    def _folded(self, seq: int, behind: int, subject: str, headers: dict[str, str] | None, data: bytes,
                stamp: int | bytes = 0) -> None:
        """One message delivered, by either path: folded, then the waiters and listeners told. Only
        the next one: every message of the stream is the fold's, so one further on means those
        between were missed (`_missing`)."""
        last = self.projection.seq
        if seq != last + 1:
            if seq > last:
                self._missing(seq)
            return  # else redelivered: an ordered consumer reset before its first message
        self.fold_message(seq, subject, headers, data)
        self.projection.seq_time = stamp
        self.behind = behind
        waiters = self._waiters
        if waiters and waiters[0][0] <= seq:
            reached = bisect.bisect_right(waiters, (seq, math.inf))
            ready, waiters[:reached] = waiters[:reached], []
            for _, _, waiter in ready:
                if not waiter.done():
                    waiter.set_result(None)
        for listener in self.listeners:
            listener(seq)

    def _missing(self, seq: int) -> None:
        """A message past the next one (`seq`): those between were not delivered. nats-py drops what its
        queue cannot take, its sequence tracking already past them (`events.natspy.jetstream.NO_DROPS`,
        set here all the same), or the stream no longer has them (deleted by hand: the stream itself
        discards nothing). Folded past, they would leave the projection wrong for good: a dropped
        runtime change, a memory image placed where it cannot load (an audit's finding). So nothing is
        folded until they are: the consumer is made again from the first one missed (`_refill`), and
        what the old one still delivers meanwhile is dropped here."""
        if self._refilling is not None or self.stale is not None:
            return
        first = self.projection.seq + 1
        loop = asyncio.get_running_loop()
        where, when = self._refilled
        if where == first and loop.time() - when < REFILL_AGAIN_S:
            return  # the old consumer's messages still coming, after the consumer was made again from here
        log.warning("the fold of %s missed messages %d to %d; reading them again", self.stream, first, seq - 1)
        self.refills += 1
        if self.on_refill is not None:
            self.on_refill()
        self._refilling = loop.create_task(self._refill(), name=f"{self.stream}-fold-refill")

    async def _refill(self) -> None:
        """The consumer made again from the first message missed; messages the stream no longer has
        are folded past (logged), as the stream's leader says (its first message from there on)."""
        try:
            while self._guard is not None:  # a re-creation under way first: it checks the stream
                await asyncio.wait({self._guard})
            first = self.projection.seq + 1
            js = self.nc.jetstream()
            try:
                found = await until_answered(
                    lambda: js.get_msg(self.stream, seq=first, subject=f"{self.prefix}.>", next=True),
                    f"the stream {self.stream}")
            except NotFoundError:
                found = None
            if found is not None and found.seq > first and self.projection.seq == first - 1:
                log.warning("messages %d to %d are not in the stream %s (deleted): the fold goes on past them",
                            first, found.seq - 1, self.stream)
                self.projection.skip(found.seq - 1)
            if self._sub is not None and self.stale is None:
                self._refilled = (self.projection.seq + 1, asyncio.get_running_loop().time())
                await reset_from(self._sub, self.projection.seq + 1)
        except Exception as error:
            self.give_up(f"the messages the fold of {self.stream} missed could not be read again "
                         f"({describe_error(error)})")
        finally:
            if self._refilling is asyncio.current_task():
                self._refilling = None

    def fold_message(self, seq: int, subject: str, headers: dict[str, str] | None, data: bytes) -> None:
        """Fold one message of the stream as read: its sequence, subject, headers and body."""
        projection = self.projection
        topic = headers.get(TOPIC_HEADER) if headers else None
        if subject.startswith(self.booking_prefix) and headers:
            # a placement's WorkerBooked or the registry's WorkerFenced: the subject says all
            # the fold needs of a booking marker, so there is no body to decode
            version = headers.get(VERSION_HEADER)
            worker_id = subject[len(self.booking_prefix):]
            projection.booking_marker(seq, worker_id, int(version) if version else None)
            if projection.unread_actor_seq == seq - 1:
                # the marker of a placement this fold could not read (a newer scheduler's, written
                # right before it in the same atomic append): what it booked is not counted here
                projection.booking_unread(worker_id)
        elif topic in EVENT_TYPES or (topic is None and subject.startswith(self.events_prefix)):
            try:
                event = self._read(data)
                version = headers.get(VERSION_HEADER) if headers else None
                projection.apply(seq, event, int(version) if version else None)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                self.errors += 1
                log.warning("message %d on %s is not an event this scheduler reads; skipped", seq, subject)
                self._unread(seq, subject)
            except Exception:  # a bug in the fold: keep folding, loudly
                self.errors += 1
                log.exception("folding message %d on %s failed", seq, subject)
                self._unread(seq, subject)
        else:
            self._unread(seq, subject)

    def _unread(self, seq: int, subject: str) -> None:
        """A message not folded. On a worker's history (a newer registry's event type, or a body
        this fold cannot read) it may have drained the worker or dropped the runtime a placement
        would match, and the registry's fence beside it moves the booking subject the fold does
        read: the worker takes no placement from this replica until its next life. One on an actor's
        history right before a booking marker was a placement: the worker it booked counts as
        drained as well (its room here is too large by what that placement booked)."""
        if subject.startswith(self.worker_prefix):
            self.projection.worker_unread(seq, subject[len(self.worker_prefix):])
        elif subject.startswith(self.actor_prefix):
            self.projection.actor_unread(seq, subject[len(self.actor_prefix):])
        elif subject.startswith(self.tag_prefix):
            self.projection.tag_unread(seq, subject[len(self.tag_prefix):])
        else:
            self.projection.skip(seq)

    async def wait(self, seq: int | None, timeout: float, field: str = "min_seq") -> None:
        """Return once the fold has applied `seq` (the request's `field`: `events.errors.WAITED_FOR`);
        UNAVAILABLE if it does not within `timeout`.

        A `seq` past what the server had when it last delivered, still not folded after
        `PAST_END_GRACE_S`, is checked against the stream's last sequence (one question for
        every waiter that asks meanwhile): for one past the end of the log there is nothing
        to wait for, and it is UNAVAILABLE then, not after the whole `timeout` of holding a
        request's slot (a seq a caller was given is in the log before it reaches the caller)."""
        if self.stale is not None:
            raise self.stale_error()
        if not seq or self.projection.seq >= seq:
            return
        loop = asyncio.get_running_loop()
        asked = self._asked  # only a question asked after this one came can answer it
        deadline = loop.time() + timeout
        waiter: asyncio.Future[None] = loop.create_future()
        entry = (seq, next(self._tie), waiter)
        waiters = self._waiters
        bisect.insort(waiters, entry)
        try:
            if seq > self.projection.seq + self.behind:
                await asyncio.wait({waiter}, timeout=min(PAST_END_GRACE_S, timeout))
                if not waiter.done():
                    end = await self._stream_end(asked, deadline - loop.time())
                    if end is not None and seq > end and not waiter.done():
                        raise unavailable(f"sequence {seq} is past the end of the log (its last is {end}): "
                                          "nothing to wait for", field)
            await asyncio.wait_for(waiter, max(deadline - loop.time(), 0.0))
        except asyncio.TimeoutError:
            raise unavailable(
                f"this scheduler replica has folded the log up to sequence {self.projection.seq}, "
                f"not {seq}, within {timeout:g}s; try again"
            ) from None
        finally:
            at = bisect.bisect_left(waiters, entry[:2])
            if at < len(waiters) and waiters[at] is entry:
                del waiters[at]

    @property
    def asked(self) -> int:
        """How many questions about the stream's end this fold has asked so far (for `current`)."""
        return self._asked

    async def current(self, timeout: float, since: int | None = None) -> None:
        """Return once the fold has every event the stream held at some moment after the
        `since`-th question about its end was asked (`asked` when the caller's request came; by
        default, now), as its leader answers: one question shared by every caller it is recent
        enough for; a question that fails (an election: no responders) is asked again, a little later
        each time. UNAVAILABLE if the leader does not answer, or the fold does not get there,
        within `timeout`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        since = self._asked if since is None else since
        pause = CURRENT_RETRY_S
        while (end := await self._stream_end(since, deadline - loop.time())) is None:
            if loop.time() + pause >= deadline:
                raise unavailable("the event log's leader did not say where the log ends; try again")
            await asyncio.sleep(pause)  # a back-off before asking again, not a synchronisation
            pause = min(pause * 2, 1.0)
        await self.wait(end, max(deadline - loop.time(), 0.0))

    async def _stream_end(self, since: int, within: float) -> int | None:
        """The stream's last sequence as the leader answers a question asked after the `since`-th
        (None if it is not known within `within`): one question shared by every caller while it
        is asked, but never one asked before a caller came (it may not have its `seq` yet)."""
        if self._end is None or self._end[1].done() or self._end[0] <= since:
            self._asked += 1
            self._end = (self._asked, asyncio.ensure_future(leaders_stream_info(self.nc.jetstream(), self.stream)))
            self._end[1].add_done_callback(retrieved)
        try:
            info = await asyncio.wait_for(asyncio.shield(self._end[1]), max(within, 0.0))
        except Exception:  # not known: the wait goes on as before
            return None
        return self.check_stream(info)
