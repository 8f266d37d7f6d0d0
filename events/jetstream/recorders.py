"""The eventsourcing library's recorders on a `Stream`, and the subscription.

As in the library's own sqlite.py and postgres.py, a recorder turns the library's calls
into calls on the datastore (here the stream protocol, run on the link's loop) and the
rows it gets back into the library's records; retries, catching up with a replica and
what the server's errors mean are the stream's and errors.py's business, not theirs.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from uuid import UUID

from eventsourcing.persistence import (
    AggregateRecorder,
    ApplicationRecorder,
    Notification,
    ProcessRecorder,
    ProgrammingError,
    StoredEvent,
    Subscription,
    Tracking,
    TrackingRecorder,
)
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from events.jetstream.grouped import GroupedAppends, Late
from events.jetstream.lastseen import Last
from events.jetstream.layout import (
    MAX_BATCH_MESSAGES,
    SEQUENCE_HEADER,
    SUBJECT_HEADER,
    TOPIC_HEADER,
    TRACKING_HEADER,
    VERSION_HEADER,
    SequencedStoredEvent,
    event_headers,
    notification_from_message,
    originator_subject,
    sequence_of,
    topic_of,
    tracking_message,
    tracking_subject,
    version_of,
)
from events.jetstream.link import Link
from events.jetstream.batch import Batch, Out
from events.jetstream.errors import from_nats_py
from events.jetstream.retry import Retry
from events.jetstream.stream import Stored, Stream
from events.natspy.jetstream import NO_DROPS, ORDERED_IDLE_HEARTBEAT_S, ack_positions

SUBSCRIPTION_BUFFER = 10_000


class JetStreamRecorder:
    """What every JetStream recorder has: a stream on a shared link and a subject namespace."""

    def __init__(self, stream: Stream, prefix: str, namespace: str):
        self.stream = stream
        self.prefix = prefix
        self.namespace = namespace

    @property
    def link(self) -> Link:
        return self.stream.link

    def _add_tracking(self, batch: Batch, tracking: Tracking) -> None:
        subject = tracking_subject(self.prefix, tracking.application_name)
        body, headers = tracking_message(tracking.application_name, tracking.notification_id)
        batch.add(Out(subject, body, headers, tracking.notification_id, False), TRACKING_HEADER)


class JetStreamAggregateRecorder(JetStreamRecorder, AggregateRecorder):
    """Events (or snapshots) of aggregates, one subject per aggregate."""

    grouped: GroupedAppends | None = None  # `group_appends`: appends gathered into shared batches

    def group_appends(self, on_group: Callable[[int], None] | None = None) -> None:
        """From now on, an append of more than one event that carries no tracking record and no expected
        sequences goes out with the others in flight, as one atomic batch (`events.jetstream.grouped`;
        fences go along; a single event is a plain publish, cheaper alone).
        Only for callers whose appends in flight at once never touch one history (a lock per
        entity): a one-replica file stream costs the server milliseconds per batch. `on_group(n)`
        is told the number of appends of each batch sent. `ungroup_appends` ends it."""
        if self.grouped is None:
            self.grouped = GroupedAppends(self._append_now, on_group=on_group)

    async def ungroup_appends(self) -> None:
        """Appends go out one by one again; those waiting in a group are answered UNAVAILABLE."""
        grouped, self.grouped = self.grouped, None
        if grouped is not None:
            await self.link.submit(grouped.close())

    def insert_events(self, stored_events: Sequence[StoredEvent], **kwargs: Any) -> Sequence[int] | None:
        self._insert(stored_events, **kwargs)
        return None

    def _insert(
        self,
        stored_events: Sequence[StoredEvent],
        *,
        expected_last_seqs: Mapping[UUID | str, int] | None = None,
        fences: Mapping[UUID | str, int] | None = None,
        tracking: Tracking | None = None,
        **_: Any,
    ) -> list[int]:
        if not stored_events and tracking is None and not fences:  # nothing to send (fences alone: refused)
            return []
        return self.link.call(self._append(stored_events, expected_last_seqs, fences, tracking))

    async def insert_events_async(
        self,
        stored_events: Sequence[StoredEvent],
        *,
        expected_last_seqs: Mapping[UUID | str, int] | None = None,
        fences: Mapping[UUID | str, int] | None = None,
        retried: bool = False,
        late: Late | None = None,
    ) -> list[int]:
        """`insert_events` for asyncio code: the same append, awaited (`Link.submit`) from
        the caller's loop instead of through a thread of its own. `late`: asked before the append
        goes out, and before each attempt that would be a first write (`events.jetstream.grouped.Late`,
        `Stream.append`).

        `retried`: these very events may have been stored already (they went out before, and
        what came back does not say they were not: `events.jetstream.grouped` after a refused
        batch that held them). A copy found stored, byte for byte these events, is then taken
        as this call's and its sequences returned; it is not a conflict."""
        if not stored_events and not fences:  # nothing to send (fences alone: refused)
            return []
        return await self.link.submit(self._append(stored_events, expected_last_seqs, fences, None, retried, late))

    async def _append(
        self,
        stored_events: Sequence[StoredEvent],
        expected_last_seqs: Mapping[UUID | str, int] | None,
        fences: Mapping[UUID | str, int] | None,
        tracking: Tracking | None,
        retried: bool = False,
        late: Late | None = None,
    ) -> list[int]:
        """One call's append, on the link's loop: grouped with others when it can be (`group_appends`),
        which pays only for what would be an atomic batch alone: a single message is a plain publish."""
        grouped = self.grouped
        if grouped is not None and len(stored_events) > 1 and tracking is None and not expected_last_seqs \
                and not retried:
            return await grouped.insert(stored_events, fences=fences, late=late)
        return await self._append_now(stored_events, expected_last_seqs=expected_last_seqs, fences=fences,
                                      tracking=tracking, retried=retried, late=late)

    async def _append_now(
        self,
        stored_events: Sequence[StoredEvent],
        *,
        expected_last_seqs: Mapping[UUID | str, int] | None = None,
        fences: Mapping[UUID | str, int] | None = None,
        tracking: Tracking | None = None,
        retried: bool = False,
        late: Late | None = None,
    ) -> list[int]:
        """One atomic append of these events (and fences, and tracking record), on the link's loop;
        `late`, asked before each attempt that would be a first write (`Stream.append`)."""
        batch = self._fenced(stored_events, expected_last_seqs, fences, tracking)
        if not batch.outs:
            return []
        return _event_seqs(batch, await self.stream.append(batch, retried=retried, late=late))

    def _fenced(
        self,
        stored_events: Sequence[StoredEvent],
        expected_last_seqs: Mapping[UUID | str, int] | None,
        fences: Mapping[UUID | str, int] | None,
        tracking: Tracking | None,
    ) -> Batch:
        batch = self._batch(stored_events, expected_last_seqs, tracking)
        for originator_id, seq in (fences or {}).items():
            batch.fence(originator_subject(self.namespace, originator_id), int(seq))
        return batch

    def _batch(
        self,
        stored_events: Sequence[StoredEvent],
        expected_last_seqs: Mapping[UUID | str, int] | None,
        tracking: Tracking | None,
    ) -> Batch:
        batch = Batch()
        for event in stored_events:
            subject = originator_subject(self.namespace, event.originator_id)
            batch.add(Out(subject, event.state, event_headers(event), event.originator_version, True), VERSION_HEADER)
        if tracking is not None:
            self._add_tracking(batch, tracking)
        for originator_id, seq in (expected_last_seqs or {}).items():
            guard = batch.guards.get(originator_subject(self.namespace, originator_id))
            if guard is None:
                raise ProgrammingError(
                    f"expected_last_seqs names {originator_id!r}, which has no event in this call"
                )
            guard.expected = int(seq)
            guard.given = True
        if len(batch.outs) > MAX_BATCH_MESSAGES:
            raise ProgrammingError(
                f"{len(batch.outs)} messages in one call: an atomic append holds at most {MAX_BATCH_MESSAGES}"
            )
        return batch

    def select_events(
        self,
        originator_id: UUID | str,
        *,
        gt: int | None = None,
        lte: int | None = None,
        desc: bool = False,
        limit: int | None = None,
    ) -> Sequence[StoredEvent]:
        msgs = self.link.call(self._read(originator_subject(self.namespace, originator_id), gt, lte, desc, limit))
        return self._selected(originator_id, msgs, gt, lte, desc, limit)

    async def select_events_async(
        self,
        originator_id: UUID | str,
        *,
        gt: int | None = None,
        lte: int | None = None,
        desc: bool = False,
        limit: int | None = None,
        after_seq: int = 0,
    ) -> Sequence[StoredEvent]:
        """`select_events` for asyncio code: the same read, awaited (`Link.submit`) from the
        caller's loop instead of through a thread of its own. `after_seq` (with `gt`): the stream
        sequence of the event at version `gt`, as the caller read it (an aggregate it holds):
        the read starts after it, whatever else this process has read of the subject since."""
        subject = originator_subject(self.namespace, originator_id)
        read = self._all(subject, gt, after_seq) if after_seq and gt is not None and not desc and lte is None \
            else self._read(subject, gt, lte, desc, limit)
        msgs = await self.link.submit(read)
        return self._selected(originator_id, msgs, gt, lte, desc, limit)

    def _read(self, subject: str, gt: int | None, lte: int | None, desc: bool, limit: int | None) -> Any:
        """The coroutine that reads what `select_events` selects from."""
        if desc and limit == 1 and lte is None:
            return self._last(subject)
        return self._all(subject, gt)

    @staticmethod
    def _selected(
        originator_id: UUID | str,
        msgs: list[Msg] | list[Stored],
        gt: int | None,
        lte: int | None,
        desc: bool,
        limit: int | None,
    ) -> Sequence[StoredEvent]:
        events = []
        for msg in msgs:
            version = version_of(msg.headers)
            if (gt is not None and version <= gt) or (lte is not None and version > lte):
                continue
            topic = topic_of(msg.headers, msg.data)
            events.append(SequencedStoredEvent(originator_id, version, topic, msg.data, sequence_of(msg)))
        if desc:
            events.reverse()
        if limit is not None:
            events = events[:limit]
        return events

    def seen(self, originator_id: UUID | str) -> int:
        """The stream sequence of the last message on the originator's subject that this process
        read or wrote, 0 if none is known. A read of the subject made after this returns at least
        that message (a replica behind it is asked again, then the leader), so it is a floor
        of what a decision that reads the subject afterwards decides on."""
        known = self.link.last_seen.get(originator_subject(self.namespace, originator_id))
        return known.seq if known is not None else 0

    def newer_at_leader(self, originator_id: UUID | str, since: int | None = None) -> bool:
        """Whether the stream leader has a message on the originator's subject past `since` (by
        default, past the last one this process read or wrote there). If so, that is remembered
        as the leader's word, so that the next read of the subject reaches it (a replica behind
        it is read again, then the leader). For a decision that refused on what it read: the
        read may have been a lagging replica's, behind another process's append. Such a
        decision passes `seen()` as it was before it read: what this process has read since
        (another command's read of the subject) is not what the decision saw."""
        return self.link.call(self._newer_at_leader(originator_subject(self.namespace, originator_id), since))

    async def newer_at_leader_async(self, originator_id: UUID | str, since: int | None = None) -> bool:
        """`newer_at_leader` for asyncio code (`Link.submit`)."""
        return await self.link.submit(self._newer_at_leader(originator_subject(self.namespace, originator_id),
                                                            since))

    async def _newer_at_leader(self, subject: str, since: int | None) -> bool:
        known = self.link.last_seen.get(subject)
        now = known.seq if known is not None else 0
        # `since` is a floor of what a decision read only while this process still knows that
        # much of the subject (forgotten: its stream made anew, or pushed out of `last_seen`)
        since = now if since is None else min(since, now)
        stored = await self.stream.last_from_leader(subject)
        seq = sequence_of(stored) if stored is not None else 0
        if seq <= since:
            return False
        # Not authoritative: an append of this process's own stored meanwhile is newer than this
        # answer, and what later reads must reach (another decision's floor) is not lowered.
        self.link.last_seen.put(subject, Last(seq, version_of(stored.headers)))
        return True

    async def _last(self, subject: str) -> list[Msg] | list[Stored]:
        msg = await self.stream.last(subject)
        if msg is None:
            self.link.last_seen.put(subject, Last(0, None))
            return []
        self.link.last_seen.put(subject, Last(sequence_of(msg), version_of(msg.headers)))
        return [msg]

    async def _all(self, subject: str, gt: int | None, after_seq: int = 0) -> list[Msg] | list[Stored]:
        start = after_seq + 1 if after_seq else 1  # the caller's word: the event at `gt` is there
        known = self.link.last_seen.get(subject)
        if gt is not None and known is not None and known.position is not None and known.position <= gt:
            start = max(start, known.seq + 1)  # everything up to there is at or below `gt`
        msgs = await self.stream.subject_from(subject, start)
        if msgs:
            last = msgs[-1]
            self.link.last_seen.put(subject, Last(sequence_of(last), version_of(last.headers)))
        elif start == 1:
            self.link.last_seen.put(subject, Last(0, None))
        return msgs


class JetStreamApplicationRecorder(JetStreamAggregateRecorder, ApplicationRecorder):
    """Events of an application; notification ids are stream sequences."""

    def insert_events(self, stored_events: Sequence[StoredEvent], **kwargs: Any) -> Sequence[int] | None:
        return self._insert(stored_events, **{k: v for k, v in kwargs.items() if k != "tracking"})

    def select_notifications(
        self,
        start: int | None,
        limit: int,
        stop: int | None = None,
        topics: Sequence[str] = (),
        *,
        inclusive_of_start: bool = True,
    ) -> Sequence[Notification]:
        first = 1 if start is None else (start if inclusive_of_start else start + 1)
        if limit <= 0 or (stop is not None and stop < first):
            return []
        wanted = set(topics)
        keep = (lambda msg: msg.headers.get(TOPIC_HEADER) in wanted) if wanted else None
        msgs = self.link.call(
            self.stream.read(f"{self.namespace}.>", first, stop=stop, limit=limit, keep=keep)
        )
        return [self._notification(msg) for msg in msgs]

    def _notification(self, msg: Msg) -> Notification:
        headers = msg.headers
        # per message of a replay: the sequence read inline (sequence_of), as in notification_from_message
        return notification_from_message(
            self.prefix, int(headers[SEQUENCE_HEADER]), headers[SUBJECT_HEADER], headers, msg.data
        )

    def max_notification_id(self) -> int | None:
        msg = self.link.call(self.stream.last_direct(f"{self.namespace}.>"))
        return sequence_of(msg) if msg is not None else None

    def subscribe(self, gt: int | None = None, topics: Sequence[str] = ()) -> "JetStreamSubscription":
        return JetStreamSubscription(self, gt=gt, topics=topics)


class JetStreamTrackingRecorder(JetStreamRecorder, TrackingRecorder):
    """Tracking records on `<prefix>.tracking.<application>`: the last one is the position."""

    def insert_tracking(self, tracking: Tracking) -> None:
        batch = Batch()
        self._add_tracking(batch, tracking)
        self.link.call(self.stream.append(batch))

    def max_tracking_id(self, application_name: str) -> int | None:
        msg = self.link.call(self.stream.last(tracking_subject(self.prefix, application_name)))
        if msg is None:
            return None
        return int(msg.headers[TRACKING_HEADER])


class JetStreamProcessRecorder(JetStreamTrackingRecorder, JetStreamApplicationRecorder, ProcessRecorder):
    """Events and the tracking record of the step that caused them, in one atomic batch."""

    def insert_events(self, stored_events: Sequence[StoredEvent], **kwargs: Any) -> Sequence[int] | None:
        return self._insert(stored_events, **kwargs)


# --- subscriptions ----------------------------------------------------------------------------

_STOP = object()


class JetStreamSubscription(Subscription[JetStreamApplicationRecorder]):
    """Recorded events after `gt`, then new ones as they are appended (an ordered consumer)."""

    def __init__(self, recorder: JetStreamApplicationRecorder, gt: int | None = None, topics: Sequence[str] = ()):
        super().__init__(recorder=recorder, gt=gt, topics=topics)
        self._wanted = set(topics)
        self._buffer: queue.Queue[Any] = queue.Queue(maxsize=SUBSCRIPTION_BUFFER)
        self._consumer: Any = None
        self._lock = threading.Lock()
        self._consumer = recorder.link.call(self._start(gt))
        recorder.link.subscriptions.add(self)

    async def _start(self, gt: int | None) -> Any:
        recorder = self._recorder
        buffer = self._buffer

        async def deliver(msg: Msg) -> None:
            item = (msg.reply, msg.subject, msg.headers, msg.data)
            while not self._has_been_stopped:
                try:
                    buffer.put_nowait(item)
                    return
                except queue.Full:  # the reader is behind: hold the callback (nats-py queues what comes meanwhile)
                    await asyncio.sleep(0.005)

        stream = recorder.stream

        async def attempt(timeout: float) -> Any:
            config = ConsumerConfig(  # a fresh one each time: nats-py fills in the one it is given
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE if gt else DeliverPolicy.ALL,
                opt_start_seq=gt + 1 if gt else None,
            )
            try:
                return await recorder.link.nc.jetstream(timeout=timeout).subscribe(
                    f"{recorder.namespace}.>",
                    stream=stream.name,
                    cb=deliver,
                    ordered_consumer=True,
                    idle_heartbeat=ORDERED_IDLE_HEARTBEAT_S,
                    config=config,
                    **NO_DROPS,  # held by `deliver` while the reader is behind: nats-py queues, never drops
                )
            except nats.js.errors.APIError as error:
                raise from_nats_py(error) from None

        # The consumer is made by the stream's group: during an election nobody can (503, or no answer)
        return await Retry(f"subscribing to {stream.name}", stream.budget, stream).run(attempt)

    def __next__(self) -> Notification:
        while True:
            if self._has_been_stopped:
                raise StopIteration
            item = self._buffer.get()
            if item is _STOP or self._has_been_stopped:
                raise StopIteration
            reply, subject, headers, data = item
            notification = notification_from_message(self._recorder.prefix, ack_positions(reply)[0], subject, headers, data)
            if self._wanted and notification.topic not in self._wanted:
                continue
            self._last_notification_id = notification.id
            return notification

    def stop(self) -> None:
        with self._lock:
            if self._has_been_stopped:
                return
            super().stop()
        try:
            self._buffer.put_nowait(_STOP)
        except queue.Full:
            pass  # __next__ checks the flag first
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            self._recorder.link.unsubscribe(consumer)


def _event_seqs(batch: Batch, seqs: list[int]) -> list[int]:
    """The stream sequences of the batch's events (its tracking records left out)."""
    return [seq for seq, out in zip(seqs, batch.outs) if out.is_event]
