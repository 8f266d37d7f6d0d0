"""How the snapshotter talks: the `warmboot-snapshotter` micro service and its log follower.

Decisions are in `services.snapshotter.domain`; this module loads aggregates from
the event store, asks them to decide, saves what they recorded and answers.

- Endpoints (CONTRACT section 3): `<prefix>.snapshotter.<verb>.<actor_id>` for
  create, pause, suspend, tag, update-template, stop, revert and (a project addition, writing
  nothing) status, in the queue group
  `warmboot-snapshotter`, so any number of replicas serve them. Each command runs
  load-decide-save on the service's event loop (its reads and its append awaited there,
  on the store's connection, which runs on that loop too) and decides again on fresh
  state when it loses an optimistic-concurrency race (with the scheduler placing the same actor,
  or another replica). A refused command saves nothing; a refusal on the actor's
  state is answered once the stream leader confirms what was read (a lagging
  replica may not have the scheduler's placement yet: `run_command_async`'s recheck).
- `seq` in a reply is the stream sequence of the last event the request wrote
  (tag saves the tag's event first and the actor's last, so it is the actor's),
  or, when the request wrote nothing, of the event that already holds that state.
- `request_id`: a repeated request is answered from the actor's history, where
  every event names the request that caused it, at the moment it would write
  (`events.aggregate.WireAggregate.prior`: scoped to the actor's current life; an
  id used for another verb is FAILED_PRECONDITION). So a retry after a lost reply
  or a crash gets the first answer, and never a refusal caused by its own first
  attempt. Requests about one actor are decided one at a time in a replica.
- `WorkerRemovalProcess` follows the log from its start and folds who is placed
  where (`PlacementFold`). When a worker is removed it releases every actor still
  placed there with reason WORKER_REMOVED, writing the releases and a tracking
  record of the removal's position in one atomic append. Every replica runs it:
  a position already tracked is skipped, and two replicas releasing at once
  conflict on the actors' histories, so the loser re-checks, finds the position
  tracked, and writes nothing. Each removal is handled exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import asynccontextmanager
from datetime import datetime
from functools import partial
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from eventsourcing.application import AggregateNotFoundError, ProcessingEvent
from eventsourcing.persistence import IntegrityError, Notification, Tracking
from eventsourcing.projection import ApplicationSubscription, EventSourcedProjection
import msgspec
from nats.aio.client import Client as NATS
from prometheus_client import Counter, Histogram

from events.aggregate import Recorded, WireAggregate, WireApplication, aggregate_id, now, split_id
from events.jetstream import MAX_BATCH_MESSAGES
from events.jetstream.link import links_on
from events.errors import UnreadableHistory, invalid, no_actor, precondition, unavailable
from events.schema import (
    ActorPlaced,
    ActorReleased,
    ActorReverted,
    ActorStatus,
    ActorStatusQuery,
    EVENT_TYPES,
    Base,
    CreateActor,
    PauseActor,
    RevertActor,
    RevertReply,
    SeqReply,
    Snapshot,
    SnapshotReply,
    SnapshotTaken,
    StopActor,
    SuspendActor,
    TaggedBefore,
    TagRecorded,
    TagSnapshot,
    Time,
    UpdateTemplate,
    WorkerEvent,
    WorkerRemoved,
)
from events.subjects import check_prefix, stream_name
from services import deadline
from services.commands import confirm_unchanged, run_command_async
from services.endpoints import EndpointSpec, add_endpoints
from services.locks import KeyedLock
from services.process import store_env, stream_replicas
from services.replies import NoWriteAnswers, ReplyCache
from services.snapshotter.domain import Actor, Image, Tag, claims_id
from services.snapshotter.placements import PlacementFold, Release, node_since, removed_since
from services.streams import StreamWatch, stream_created

log = logging.getLogger("warmboot.snapshotter")
T = TypeVar("T", bound=Base)

SERVICE = "snapshotter"

SNAPSHOTS = Counter(
    "warmboot_snapshots_taken_total", "SnapshotTaken events written, by how the snapshot came about",
    ["sandbox_class", "origin", "fidelity"],
)
RELEASES = Counter("warmboot_actor_releases_total", "ActorReleased events written, by reason", ["reason"])
COMMIT_GROUP = Histogram(
    "warmboot_snapshotter_commit_group_writes",
    "Commands whose writes went out in one atomic append (a refused group counted, then each of its members alone)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)


class SnapshotterApplication(WireApplication):
    """The event-sourced application the endpoints load actors and tags from and save to."""

    name = "Snapshotter"
    CACHE_AGGREGATES = True  # a command reads only the events after the actor it last read or saved


# --- answers recorded in the history ---------------------------------------------------


def recorded_seq(aggregate: WireAggregate, version: int) -> int:
    """The stream sequence of the event `version` of an actor's (or a tag's) history, as it was read."""
    seq = aggregate.seq_at(version)
    if not seq:  # the event store names every event's position; a store that does not cannot answer
        raise unavailable(f"the event store did not say where event {version} of {aggregate.KIND} "
                          f"{aggregate.entity_id!r} is")
    return seq


def answer_from_history(actor: Actor, verb: str, request_id: str | None) -> Base | None:
    """The answer to a repeated request, rebuilt from the events it recorded in this life, if any.

    Only the snapshotter's own events count: a resume that reused the id (the scheduler does
    not refuse one) recorded an ActorPlaced with it, which is not this request's answer."""
    versions = [v for v in actor.prior(verb, request_id) if not isinstance(actor.history[v - 1], ActorPlaced)]
    if not versions:
        return None
    first = actor.history[versions[0] - 1]
    if isinstance(first, SnapshotTaken):
        snapshot = first.snapshot
        reply: Callable[[int], Base] = lambda seq: SnapshotReply(snapshot=snapshot, seq=seq)
    elif isinstance(first, ActorReverted):
        back = first.snapshot
        reply = lambda seq: RevertReply(snapshot=back, seq=seq)
    else:
        reply = lambda seq: SeqReply(seq=seq)
    return reply(recorded_seq(actor, versions[-1]))


def images_read(snapshot_id: str | None) -> tuple[str, ...]:
    """The `Image` a request naming `snapshot_id` reads, if any (`claims_id`): a refusal it causes is
    confirmed at the stream leader, as one on the actor's state (`SnapshotterService.answer`)."""
    claimed = claims_id(snapshot_id)
    return (Image.create_id(claimed),) if claimed is not None else ()


def counted(events: list[Any]) -> list[Any]:
    """`events` (domain events just saved), after counting the snapshots and releases among them."""
    for event in events:
        body = getattr(event, "body", None)
        if isinstance(body, SnapshotTaken):
            stamp = body.snapshot.sandbox_runtime
            SNAPSHOTS.labels(stamp.sandbox_class if stamp else "", body.origin.value,
                             body.snapshot.fidelity.value).inc()
        elif isinstance(body, ActorReleased):
            RELEASES.labels(body.reason.value).inc()
    return events


# --- the worker-removal process ------------------------------------------------------------


def release_parts(actors: list[Actor], room: int) -> list[list[Actor]]:
    """`actors` (each with its release pending) in order, in parts of at most `room` pending
    events each; one part, maybe empty, when they all fit (it carries the tracking record)."""
    parts: list[list[Actor]] = [[]]
    size = 0
    for actor in actors:
        events = len(actor.pending_events)
        if parts[-1] and size + events > room:
            parts.append([])
            size = 0
        parts[-1].append(actor)
        size += events
    return parts


class _When(msgspec.Struct):
    at: Time


class _Following(ApplicationSubscription[str]):
    """The worker-removal process's subscription: each event it follows (`WorkerRemovalProcess.topics`),
    mapped; a message it cannot read, of those or on a worker's subject (a type this version does not
    know), handed over as its Notification, not raised. A raise failed the subscription, which was made
    again at the same position and failed again, for ever: no removal after it released anything."""

    def __init__(self, app: Any, gt: int | None, followed: tuple[str, ...]):
        super().__init__(app, gt=gt)  # every topic: one this version does not know is seen too
        self.followed = frozenset(followed)

    def __next__(self) -> tuple[Any, Tracking]:
        while True:
            notification = next(self.subscription)
            topic = notification.topic
            if topic in self.followed:
                try:
                    event: Any = self.mapper.to_domain_event(notification)
                except UnreadableHistory:  # logged where it was read
                    event = notification
            elif topic not in EVENT_TYPES and str(notification.originator_id).startswith(WorkerEvent.KIND + "."):
                event = notification
            else:
                continue
            return event, Tracking(self.name, notification.id)


class WorkerRemovalProcess(EventSourcedProjection[str], WireApplication):
    """Releases, exactly once, every actor placed on a worker that is removed.

    A release it cannot make now (the actor's history holds an event this version cannot read)
    does not hold up the others: it is kept in `left` and tried again (`_release_left`).

    The library's event-sourced projection: a process recorder writes the releases
    and the tracking record of the position that caused them atomically. The
    placement fold is rebuilt from the start of the log each time the process
    starts (it is small: one entry per running actor); positions already tracked
    are only folded, never acted on again.
    """

    name = "SnapshotterWorkerRemovals"
    topics = ("WorkerRegistered", "WorkerRemoved", "ActorPlaced", "ActorReleased", "ActorStopped")
    # How long `stop` waits for the follower to end before it closes the store under it, and after: a call
    # of its to the store with NATS frozen or gone waited for the store's time-out (WARMBOOT_STORE_TIMEOUT,
    # 30 s), the stop with it (the bound of a stop: warmboot.runner.STOP_BOUND_S).
    FOLLOWER_STOP_S = 1.0
    ATTEMPTS = 16
    LEFT_RETRY_S = (1.0, 60.0)  # first and longest pause between tries of the releases left (`left`)

    def __init__(self, env: dict[str, str] | None = None) -> None:
        super().__init__(env)
        self.fold = PlacementFold()
        self.position = 0  # id of the last notification folded
        self.released = 0  # releases this replica wrote
        self.conflicts = 0  # appends lost to another writer (then re-checked)
        self._moved = threading.Condition()
        self._stopping = threading.Event()
        self._subscription: ApplicationSubscription[str] | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # the last failure of the subscription
        # Releases this version could not make (the actor's history holds an event it cannot read),
        # by actor: tried again as the log moves, with a growing pause, until made or moot. A
        # position is tracked as a high-water mark, so they are not left to a start to redo: a
        # start takes them up from the fold (`PlacementFold.unreleased`) once it has caught up.
        self.left: dict[str, tuple[Release, datetime]] = {}
        self._catch_up_end: int | None = None  # the log's end when following began
        self._left_delay = self.LEFT_RETRY_S[0]
        self._left_next = 0.0

    # --- processing (runs on the follower thread) ---

    def process_event(self, domain_event: Any, tracking: Tracking) -> None:
        self._act(*self._folded(domain_event), tracking)

    def _folded(self, domain_event: Any) -> tuple[list[Release], datetime | None]:
        """Fold one event (once: the fold is not idempotent, a removal hands out its placements once);
        the releases it calls for and the time of the event."""
        if isinstance(domain_event, Notification):
            return self._unread(domain_event)
        if not isinstance(domain_event, Recorded):
            return [], None
        return self.fold.apply(domain_event.originator_version, domain_event.body), domain_event.body.at

    def _unread(self, message: Notification) -> tuple[list[Release], datetime | None]:
        """A message this version cannot read (`_Following`). A removal (its topic says so) whose time
        reads is folded as one; any other on a worker's history leaves the worker's state unknown
        (`PlacementFold.worker_unread`). One on an actor's history changes nothing folded: a release of
        that actor reads its history, and is left (`left`) while it holds the message."""
        kind, entity_id = split_id(str(message.originator_id))
        if kind == WorkerEvent.KIND and message.topic == WorkerRemoved.__name__:
            try:
                at = msgspec.json.decode(message.state, type=_When).at
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
            else:
                log.warning("%s: the removal of worker %s at position %d has a body this version cannot read; its "
                            "actors are released as of its time", self.name, entity_id, message.id)
                return self.fold.apply(message.originator_version, WorkerRemoved(worker_id=entity_id, at=at)), at
        if kind == WorkerEvent.KIND:
            self.fold.worker_unread(entity_id)
        log.warning("%s: message %d of %s (%r) is one this version cannot read; %s", self.name, message.id,
                    message.originator_id, message.topic,
                    "the worker is no longer taken for removed" if kind == WorkerEvent.KIND else
                    "a release of the actor waits until its history can be read")
        return [], None

    def _act(self, releases: list[Release], at: datetime | None, tracking: Tracking) -> None:
        """What a folded event calls for: its releases, those left earlier; then the position moves."""
        if releases:
            self.release(releases, tracking, at)
        if self._catch_up_end is not None and tracking.notification_id >= self._catch_up_end:
            # caught up with the log as it was at the start: a placement on a removed worker the fold
            # still holds was never released (one of its actor's events unreadable by the version then)
            self._catch_up_end = None
            self.left.update(self.fold.unreleased)
        if self.left and time.monotonic() >= self._left_next:
            self._release_left()
        with self._moved:
            self.position = tracking.notification_id
            self._moved.notify_all()

    def release(self, releases: list[Release], tracking: Tracking, at: datetime) -> None:
        """Release `releases` and track `tracking` in one append, unless that position is tracked.

        `at` is the time of the event that caused the releases, so every replica
        deciding this step decides the same events.
        """
        count = 0
        for _ in range(self.ATTEMPTS):
            if self.recorder.has_tracking_id(tracking.application_name, tracking.notification_id):
                return
            actors = []
            for release in releases:
                try:
                    actor = self._released(release, at)
                except UnreadableHistory:  # logged where it was read; the others are released now
                    self.left[release.actor_id] = (release, at)
                    continue
                if actor is not None:
                    actors.append(actor)
            # An atomic append holds at most MAX_BATCH_MESSAGES: a worker's releases go in as many
            # as that takes, the tracking record with the last (an audit: a worker removed with
            # 1,000 actors was refused for good, and so was every removal after it). One that ended
            # between them is done again only for the actors it had not released: their placements
            # have ended (`_released` says None).
            parts = release_parts(actors, MAX_BATCH_MESSAGES - 1)
            try:
                for i, part in enumerate(parts):
                    processing = ProcessingEvent[str](tracking=tracking if i == len(parts) - 1 else None)
                    processing.collect_events(*part)
                    self._append(processing)
                    count += len(part)
                    self.released += len(part)
            except IntegrityError:
                self.conflicts += 1  # another writer got there first: look again
                continue
            if count:
                log.info("released %d actor(s) of removed worker %s at position %d",
                         count, releases[0].worker_id, tracking.notification_id)
            return
        raise RuntimeError(f"could not settle the releases at position {tracking.notification_id}")

    def _release_left(self) -> None:
        """Try again the releases in `left`: each is made, found moot (the log has the placement's end,
        the actor is gone or released), or left for the next try, a longer pause away."""
        for actor_id, (release, at) in list(self.left.items()):
            if self.fold.unreleased.get(actor_id, (None,))[0] != release:  # ended in the log since
                del self.left[actor_id]
                continue
            try:
                actor = self._released(release, at)
            except UnreadableHistory:
                continue
            if actor is None:
                del self.left[actor_id]
                continue
            processing = ProcessingEvent[str]()
            processing.collect_events(actor)
            try:
                self._append(processing)
            except IntegrityError:
                self.conflicts += 1  # another writer's event on the actor: read again next time
                continue
            self.released += 1
            del self.left[actor_id]
            log.info("released actor %s of removed worker %s (left earlier)", actor_id, release.worker_id)
        if self.left:
            log.warning("%d release(s) of actors on removed workers wait for histories this version can read: %s",
                        len(self.left), ", ".join(sorted(self.left)[:10]))
            self._left_next = time.monotonic() + self._left_delay
            self._left_delay = min(self._left_delay * 2, self.LEFT_RETRY_S[1])
        else:
            self._left_delay = self.LEFT_RETRY_S[0]

    def _released(self, release: Release, at: datetime) -> Actor | None:
        """The actor with `release` recorded on it, or None when that is moot (the actor gone, the
        placement ended); UnreadableHistory when this version cannot read the actor's history."""
        actor = self._read_past(release.actor_id, release.placed_version)
        if actor is None or not actor.release_from_removed_worker(release.worker_id, release.placed_version, at):
            return None
        return actor

    def _append(self, processing: ProcessingEvent[str]) -> None:
        """One atomic append of what `processing` collected (and its tracking record, if any), counted."""
        counted([recording.domain_event for recording in self._record(processing)])

    def _read_past(self, actor_id: str, placed_version: int) -> Actor | None:
        """The actor, read up to at least the placement the fold saw (`placed_version`). The fold
        follows the stream through its leader, the actor is read by direct gets, which a replica
        of the stream behind that placement may answer: without it the placement would look ended
        already, and the release be skipped for good (the position tracked as done). So a read
        short of it asks the leader (`newer_at_leader`: the next read then reaches it)."""
        aggregate = Actor.create_id(actor_id)
        for _ in range(2):
            try:
                actor: Actor | None = self.repository.get(aggregate)
            except AggregateNotFoundError:
                actor = None
            if (actor is not None and actor.version >= placed_version) or not self.recorder.newer_at_leader(aggregate):
                return actor
        return actor

    # --- the follower thread ---

    def follow(self) -> None:
        """Start following the log from its first event, on a thread of its own.

        Every application of a deployment shares one log (the stream), so the
        process reads it through its own recorder, and its tracking records carry
        its own name: no other follower's positions mix with its own.
        """
        self._catch_up_end = self.recorder.max_notification_id() or 0
        self._subscribe(None)
        with self._lock:  # not started once stop() has begun (it may run meanwhile, from another thread)
            if self._stopping.is_set():
                return
            self._thread = threading.Thread(target=self._run, name=f"{self.name}-follower", daemon=True)
            self._thread.start()

    def _subscribe(self, gt: int | None) -> ApplicationSubscription[str]:
        with self._lock:
            self._subscription = _Following(self, gt, self.topics)
            if self._stopping.is_set():  # stop() ran meanwhile and missed this one
                self._subscription.stop()
            return self._subscription

    def _run(self) -> None:
        subscription = self._subscription
        delay = 0.1
        try:
            while not self._stopping.is_set():
                try:
                    with subscription:
                        for domain_event, tracking in subscription:
                            self._process_until_done(domain_event, tracking)
                            delay = 0.1
                            if self._stopping.is_set():
                                return
                    return  # the subscription ended: stopped
                except Exception as error:
                    if self._stopping.is_set():
                        return
                    # The fold is kept: carry on after the last position folded.
                    self.error = error
                    log.warning("%s: the log subscription failed at position %d; resubscribing",
                                self.name, self.position, exc_info=True)
                    if self._stopping.wait(delay):
                        return
                    delay = min(delay * 2, 5.0)
                    subscription = self._subscribe(self.position)
        finally:
            with self._moved:
                self._moved.notify_all()

    def _process_until_done(self, domain_event: Any, tracking: Tracking) -> None:
        """Process one event; on a store failure, back off and act on it again (folded once: a
        removal folded again would hand out no placement, and its releases would be lost)."""
        releases, at = self._folded(domain_event)
        delay = 0.1
        while True:
            try:
                self._act(releases, at, tracking)
                return
            except Exception:
                if self._stopping.is_set():
                    raise
                log.warning("%s: position %d failed; retrying", self.name, tracking.notification_id,
                            exc_info=True)
                if self._stopping.wait(delay):
                    raise
                delay = min(delay * 2, 5.0)

    def wait_for(self, position: int, timeout: float) -> bool:
        """Block until the log is folded up to `position` (True), or `timeout`/stop (False)."""
        with self._moved:
            return self._moved.wait_for(
                lambda: self.position >= position or self._stopping.is_set(), timeout
            ) and self.position >= position

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            if self._subscription is not None:
                self._subscription.stop()
            thread = self._thread  # started, or never to be: follow() checks `_stopping` under the lock
        if thread is not None:
            thread.join(self.FOLLOWER_STOP_S)
            if thread.is_alive():
                log.warning("%s: the follower is still in a call to the store %gs into the stop (NATS frozen or "
                            "unreachable?): the store is closed under it; the next start goes on from the last "
                            "position tracked in the log", self.name, self.FOLLOWER_STOP_S)
        self.close()  # (a call of the follower's to the store still waiting ends, interrupted: it stops)
        if thread is not None:
            thread.join(self.FOLLOWER_STOP_S)


# --- the service -------------------------------------------------------------------------------


class SnapshotterService:
    """The snapshotter replica: `warmboot-snapshotter` endpoints plus the worker-removal process.

    `env` overrides the event-store environment (default: the JetStream store of
    `prefix` on `nats_url`, with `store_replicas` stream replicas when it creates
    the stream); `follow=False` runs the endpoints only.
    """

    def __init__(
        self,
        nc: NATS,
        *,
        nats_url: str,
        prefix: str,
        env: dict[str, str] | None = None,
        store_replicas: int | None = None,
        follow: bool = True,
    ) -> None:
        self.nc = nc
        self.nats_url = nats_url
        self.prefix = check_prefix(prefix)
        self.env = env if env is not None else store_env(nats_url, prefix, store_replicas or stream_replicas())
        self.follow = follow
        self._actors = KeyedLock()  # requests about one actor, one at a time in this replica
        # Tags of one tag name too (a tag writes the tag's history beside its actor's): racing on the
        # same version they would mostly lose, and two appends of one history must never be in flight
        # at once through the grouped appends (events.jetstream.grouped). Taken after the actor's.
        self._tags = KeyedLock()
        self._images = KeyedLock()  # the same for what a snapshot id names (`Image`): taken last
        self.no_writes: NoWriteAnswers | None = None  # answers of requests that wrote nothing (update-template)
        self.app: SnapshotterApplication | None = None
        self.process: WorkerRemovalProcess | None = None
        self.micro = None
        # the worker-removal process's placements and position are of one incarnation of the stream
        self.watch = StreamWatch(nc, stream_name(prefix)) if follow else None

    @property
    def failed(self) -> asyncio.Future[str] | None:
        """Done, with the reason, once the event stream was made again under this replica's
        worker-removal process (`services.streams.StreamWatch`): whoever runs it then stops it."""
        return self.watch.failed if self.watch is not None else None

    async def start(self) -> "SnapshotterService":
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def _start(self) -> None:
        # The store's connection runs on this loop (`links_on`): the commands' reads and appends are
        # awaited here, with no thread of the store's own and none for the commands. The worker-removal
        # process, a thread of the library's, keeps a connection of its own (made outside).
        with links_on(asyncio.get_running_loop()):
            self.app = await asyncio.to_thread(SnapshotterApplication, self.env)
        # Commands for different actors append together while one append is in flight (each holds its
        # actor's lock): an atomic batch costs a one-replica file stream's server milliseconds.
        self.app.recorder.group_appends(on_group=COMMIT_GROUP.observe)
        if self.watch is not None:
            await self.watch.start()
        created = (self.watch.created if self.watch is not None
                   else await stream_created(self.nc, stream_name(self.prefix)))
        self.no_writes = NoWriteAnswers(await ReplyCache(self.nc, self.prefix).start(), SERVICE,
                                        asyncio.get_running_loop(), created)
        if self.watch is not None:
            self.process = await asyncio.to_thread(WorkerRemovalProcess, self.env)
            await asyncio.to_thread(self.process.follow)  # its subscription is made on its own link: not on this loop
        self.micro = await add_endpoints(
            self.nc, self.prefix, SERVICE,
            "Actor lifecycle steps that take, promote and tag snapshots, stamped with their runtime",
            [
                EndpointSpec("create", CreateActor, self.create),
                EndpointSpec("pause", PauseActor, self.pause),
                EndpointSpec("suspend", SuspendActor, self.suspend),
                EndpointSpec("tag", TagSnapshot, self.tag),
                EndpointSpec("update-template", UpdateTemplate, self.update_template),
                EndpointSpec("stop", StopActor, self.stop_actor),
                EndpointSpec("revert", RevertActor, self.revert),
                EndpointSpec("status", ActorStatusQuery, self.status),
            ],
        )

    async def stop(self) -> None:
        if self.micro is not None:
            micro, self.micro = self.micro, None
            try:
                await micro.stop()
            except Exception:  # the connection is already closed: nothing left to unsubscribe
                log.debug("stopping the micro service failed", exc_info=True)
        if self.watch is not None:
            await self.watch.stop()
        if self.process is not None:
            await asyncio.to_thread(self.process.stop)
            self.process = None
        if self.app is not None:
            await self.app.recorder.ungroup_appends()
            await asyncio.to_thread(self.app.close)
            self.app = None

    async def wait_followed(self, position: int, timeout: float = 10.0) -> bool:
        """Whether the worker-removal process has folded the log up to `position`."""
        assert self.process is not None
        return await asyncio.to_thread(self.process.wait_for, position, timeout)

    # --- endpoint plumbing ---

    async def answer(self, actor_id: str, decide: Callable[[], Awaitable[Base]], also: tuple[str, ...] = ()) -> Any:
        """Run one load-decide-save of `actor_id`, alone among this replica's requests about it; a
        refusal on the actor's state is answered once the stream leader confirms what was read of
        the actor, and of the aggregates `also` names (`run_command_async`'s recheck: the read may
        have been a lagging replica's, behind the scheduler's placement a moment ago)."""
        assert self.app is not None
        recorder = self.app.recorder
        read = (Actor.create_id(actor_id), *also)

        def recheck() -> Callable[[], Awaitable[bool]]:  # before a decision: what this process has read of them
            seen = [(aggregate, recorder.seen(aggregate)) for aggregate in read]

            async def newer() -> bool:
                found = [await recorder.newer_at_leader_async(aggregate, since)  # each one remembered
                         for aggregate, since in seen]
                return any(found)

            return newer

        async with self._actors(actor_id):
            return await run_command_async(decide, recheck=recheck)

    async def load_actor(self, actor_id: str, *, must_exist: bool = True) -> Actor:
        assert self.app is not None
        actor = await self.app.get_async(Actor.create_id(actor_id))
        if actor is not None:
            return actor
        if must_exist:
            raise no_actor(actor_id)
        return Actor(actor_id)

    async def load_tag(self, tag: str) -> Tag:
        assert self.app is not None
        found = await self.app.get_async(Tag.create_id(tag))
        return found if found is not None else Tag(tag)

    @asynccontextmanager
    async def naming(self, snapshot: Snapshot | None, field: str, request_id: str | None,
                     at: datetime) -> AsyncIterator[tuple[Image, ...]]:
        """Around the save of a new record of `snapshot`'s image: the `Image` of its id, with what it
        recorded, to save before the actor (one atomic append, guarded by the image's subject as
        read: a race with another actor naming the id fails the append, and the retry refuses it);
        FAILED_PRECONDITION (`field`) if the id names another actor's other image. Nothing for an id
        of the default form (one actor's alone) or no image."""
        snapshot_id = claims_id(snapshot.snapshot_id if snapshot is not None else None)
        if snapshot_id is None:
            yield ()
            return
        assert snapshot is not None and self.app is not None
        async with self._images(snapshot_id):
            found = await self.app.get_async(Image.create_id(snapshot_id))
            image = found if found is not None else Image(snapshot_id)
            image.name(snapshot, field, request_id, at)
            yield (image,) if image.pending_events else ()

    # --- endpoints ---
    # Each one: load the actor, answer a repeated request from its history, else decide
    # and save; all of it again on a lost optimistic-concurrency race (`answer`). Every read
    # and the append are awaited on this loop, which runs the store's connection (`links_on`).

    async def create(self, actor_id: str, req: CreateActor) -> SeqReply:
        if req.actor_id != actor_id:
            raise invalid(f"actor_id {req.actor_id!r} differs from the subject's {actor_id!r}", "actor_id")
        tag = (Tag.create_id(req.source_tag),) if req.source_tag is not None else ()  # a create reads it too
        golden = req.golden_snapshot
        return await self.answer(actor_id, partial(self.decide_create, actor_id, req),
                                 also=tag + images_read(golden.snapshot_id if golden is not None else None))

    async def decide_create(self, actor_id: str, req: CreateActor) -> Base:
        actor = await self.load_actor(actor_id, must_exist=False)
        found = await self.answered_before(actor, "create", req.request_id)
        if found is not None:
            return found
        tagged, fences = None, None
        if req.source_tag is not None:
            tag = await self.load_tag(req.source_tag)
            tagged = tag.snapshot
            if tag.version:  # the copy is of the tag as read here: committed only if the tag has not moved
                # since (found by an audit: read from a stream replica behind a retag, it copied what the
                # tag named before)
                fences = {tag.id: tag.seq_at(tag.version)}
        at = now()
        actor.create(req, tagged, at)
        field = "golden_snapshot.snapshot_id" if req.golden_snapshot is not None else "source_tag"
        async with self.naming(actor.latest_snapshot, field, req.request_id, at) as image:
            return SeqReply(seq=await self.save(*image, actor, fences=fences))

    async def pause(self, actor_id: str, req: PauseActor) -> SnapshotReply:
        return await self.answer(actor_id, partial(self.decide_pause, actor_id, req), also=images_read(req.snapshot_id))

    async def decide_pause(self, actor_id: str, req: PauseActor) -> Base:
        actor = await self.load_actor(actor_id)
        found = await self.answered_before(actor, "pause", req.request_id)
        if found is not None:
            return found
        fence = await self.placement_fence(actor, "paused")
        at = now()
        snapshot = actor.pause(req.snapshot_id, req.request_id, at, req)
        async with self.naming(snapshot, "snapshot_id", req.request_id, at) as image:
            return SnapshotReply(snapshot=snapshot, seq=await self.save(*image, actor, fences=fence))

    async def suspend(self, actor_id: str, req: SuspendActor) -> SnapshotReply:
        return await self.answer(actor_id, partial(self.decide_suspend, actor_id, req),
                                 also=images_read(req.snapshot_id))

    async def decide_suspend(self, actor_id: str, req: SuspendActor) -> Base:
        actor = await self.load_actor(actor_id)
        found = await self.answered_before(actor, "suspend", req.request_id)
        if found is not None:
            return found
        fence = await self.placement_fence(actor, "suspended")  # None from PAUSED: the image is on its node
        at = now()
        snapshot = actor.suspend(req.snapshot_id, req.uri, req.fidelity, req.request_id, at, req)
        # a promote keeps the LOCAL image's id unless given one: its Image then names the EXTERNAL image
        async with self.naming(snapshot, "snapshot_id", req.request_id, at) as image:
            return SnapshotReply(snapshot=snapshot, seq=await self.save(*image, actor, fences=fence))

    async def tag(self, actor_id: str, req: TagSnapshot) -> SnapshotReply:
        return await self.answer(actor_id, partial(self.decide_tag, actor_id, req))

    async def decide_tag(self, actor_id: str, req: TagSnapshot) -> Base:
        actor = await self.load_actor(actor_id)
        found = await self.answered_or_kept(actor, "tag", req.request_id, SnapshotReply)
        if found is not None:
            return await self.tagged_before(found, req)
        async with self._tags(req.tag):
            tag = await self.load_tag(req.tag)
            # what it named before, exactly: the save is fenced on the tag's history as read here
            before = TaggedBefore(snapshot=tag.snapshot)
            snapshot, recorded = actor.tag(tag, req.request_id, now(), req.life_seq)
            if recorded:  # the tag's event first, the actor's last: the reply's seq is the actor's event
                return SnapshotReply(snapshot=snapshot, seq=await self.save(tag, actor), tagged_before=before)
            # The tag names it already (as the stream leader has the tag's history too): the TagRecorded
            # that named it is the answer
            assert self.app is not None
            await confirm_unchanged(self.app.recorder, tag.id, recorded_seq(tag, tag.version))
            reply = SnapshotReply(snapshot=snapshot, seq=recorded_seq(tag, tag.version), unchanged=True,
                                  tagged_before=before)
            return await self.kept_unchanged(actor, "tag", req.request_id, reply)

    async def tagged_before(self, found: Base, req: TagSnapshot) -> Base:
        """A tag's repeat answered from the actor's history (`answer_from_history`) with what the tag
        named before the TagRecorded it made, as its first answer said: the one before that record in
        the tag's history as read here (the last record of this request id and snapshot); left unsaid
        when this read does not hold the record yet."""
        if not isinstance(found, SnapshotReply) or found.tagged_before is not None:
            return found
        named = [e for e in (await self.load_tag(req.tag)).history if isinstance(e, TagRecorded)]
        at = [i for i, e in enumerate(named) if e.request_id == req.request_id and e.snapshot == found.snapshot]
        if not at:
            return found
        before = named[at[-1] - 1].snapshot if at[-1] else None
        return msgspec.structs.replace(found, tagged_before=TaggedBefore(snapshot=before))

    async def update_template(self, actor_id: str, req: UpdateTemplate) -> SeqReply:
        return await self.answer(actor_id, partial(self.decide_update_template, actor_id, req))

    async def decide_update_template(self, actor_id: str, req: UpdateTemplate) -> Base:
        actor = await self.load_actor(actor_id)
        found = await self.answered_or_kept(actor, "update-template", req.request_id, SeqReply)
        if found is not None:
            return found
        if not actor.change_template(req.template_uid, req.request_id, now(), req.life_seq):
            # Already that template: the event that set it is the answer
            reply = SeqReply(seq=recorded_seq(actor, actor.template_version), unchanged=True)
            return await self.kept_unchanged(actor, "update-template", req.request_id, reply)
        return SeqReply(seq=await self.save(actor))

    async def stop_actor(self, actor_id: str, req: StopActor) -> SeqReply:
        return await self.answer(actor_id, partial(self.decide_stop, actor_id, req))

    async def decide_stop(self, actor_id: str, req: StopActor) -> Base:
        actor = await self.load_actor(actor_id)
        found = await self.answered_before(actor, "stop", req.request_id)
        if found is not None:
            return found
        actor.stop(req.request_id, now(), req.life_seq)
        return SeqReply(seq=await self.save(actor))

    async def revert(self, actor_id: str, req: RevertActor) -> RevertReply:
        return await self.answer(actor_id, partial(self.decide_revert, actor_id, req))

    async def decide_revert(self, actor_id: str, req: RevertActor) -> Base:
        actor = await self.load_actor(actor_id)
        found = await self.answered_before(actor, "revert", req.request_id)
        if found is not None:
            return found
        back = actor.revert(req.reason, req.request_id, now(), req.life_seq)
        return RevertReply(snapshot=back, seq=await self.save(actor))

    async def status(self, actor_id: str, _: ActorStatusQuery) -> ActorStatus:
        """The actor as the stream leader's log has it (`Actor.status`), writing nothing: what a caller
        names in a later request so that a copy of it decided after the actor moved is refused (the
        CLI asks it before a pause, suspend, resume, stop, tag, revert or update-template, unless given
        `--placement-seq` or `--life-seq`; `warmboot.client.Client` before a pause or suspend of an actor
        it did not resume). A read behind the leader (a lagging replica of
        the stream) is read again: a placement a moment old is in the answer."""
        return await run_command_async(partial(self.read_status, actor_id))

    async def read_status(self, actor_id: str) -> ActorStatus:
        actor = await self.load_actor(actor_id, must_exist=False)
        assert self.app is not None
        await confirm_unchanged(self.app.recorder, actor.id, actor.seq_at(actor.version))
        return actor.status()

    async def answered_before(self, actor: Actor, verb: str, request_id: str | None) -> Base | None:
        """The first answer of an earlier request with this id (`answer_from_history`), given, as every
        answer that writes nothing, only on the actor's history as the stream leader has it
        (`confirm_unchanged`; else decided again there): read behind a stop and a creation anew through
        another replica, the earlier life's answer was given where the leader's history, in which a
        request id is looked up in the current life only, decides the retry anew (docs/contract.md)."""
        found = answer_from_history(actor, verb, request_id)
        if found is not None:
            await self.confirm_read(actor)
        return found

    async def answered_or_kept(self, actor: Actor, verb: str, request_id: str | None,
                               reply_type: type[Base]) -> Base | None:
        """`answered_before`, else the answer kept for a request with this id that wrote nothing
        (`kept_unchanged`), given on the actor's history as the stream leader has it; None if neither."""
        found = await self.answered_before(actor, verb, request_id)
        if found is not None or self.no_writes is None:
            return found
        kept = await self.no_writes.recall_async(actor, verb, request_id, reply_type)
        if kept is None:
            return None
        await self.confirm_read(actor)  # kept for the life as read (`answered_before`)
        return kept[0]

    async def kept_unchanged(self, actor: Actor, verb: str, request_id: str | None, reply: T) -> T:
        """`reply`, the answer of a request that found the actor as it asks and wrote nothing (an
        update-template to its template, a tag naming its snapshot already), given only on the actor's
        history as the stream leader has it, and kept as this request's, which left nothing its retry
        could be answered from (`services.replies.NoWriteAnswers`)."""
        await self.confirm_read(actor)
        if self.no_writes is not None:
            await self.no_writes.keep_async(actor, verb, request_id, reply)
        return reply

    async def confirm_read(self, actor: Actor) -> None:
        """`confirm_unchanged` of the actor's history as read."""
        assert self.app is not None
        await confirm_unchanged(self.app.recorder, actor.id, recorded_seq(actor, actor.version))

    async def placement_fence(self, actor: Actor, verb: str) -> dict[str, int] | None:
        """For a pause or a suspend of a RUNNING actor, which says its image was taken on the worker
        it is placed on: FAILED_PRECONDITION if that worker was removed since (its actors are
        released, SUSPENDED from their latest snapshot: CONTRACT section 4), or, for a pause, if it
        has registered on another node than the assignment's since (`node_since`), UNAVAILABLE if the
        worker's history since holds an event this version cannot read (it may have done either), else the fence that
        commits the snapshot only if the worker's history has not moved since it was read here (a
        removal landing meanwhile fails the append, and the retry finds it). None for an actor
        that is not placed (the domain refuses it)."""
        held = actor.assignment
        if held is None:
            return None
        assert self.app is not None
        worker = aggregate_id(WorkerEvent.KIND, held.worker_id)
        last = await self.app.recorder.select_events_async(worker, desc=True, limit=1)
        if not last:
            # Nothing read of the worker: none (another writer's placement), or a stream replica behind
            # its whole history answered (found by an audit: no fence then, and a pause recorded a LOCAL
            # image after the worker's removal). Expected empty: the leader decides.
            return {worker: 0}
        placed_seq = actor.seq_at(actor.assignment_version)
        last_seq_ = last[0].seq
        removal, moved = 0, None
        if last[0].topic == WorkerRemoved.__name__ and (not placed_seq or last_seq_ > placed_seq):
            removal = last_seq_
        elif placed_seq and last_seq_ > placed_seq:  # the worker changed since: a removal? another node?
            history = await self.app.recorder.select_events_async(worker)
            removal = removed_since([(e.seq, e.topic) for e in history], placed_seq)
            if not removal:  # an event since that this version cannot read may have moved or removed it:
                for stored in history:  # UNAVAILABLE, naming it (`events.aggregate.WireMapper`)
                    if stored.seq > placed_seq:
                        self.app.mapper.to_domain_event(stored)
            if verb == "paused":
                moved = node_since([(e.seq, e.topic, e.state) for e in history], placed_seq, held.node)
        if removal:
            raise precondition(
                f"actor {actor.entity_id!r} cannot be {verb} on worker {held.worker_id!r}: the worker was removed "
                f"(sequence {removal}) after the actor was placed there, and its actors are released, SUSPENDED "
                "from their latest snapshot"
            )
        if moved is not None:
            # A pause records its image on the node of the assignment (CONTRACT): a worker that has
            # reported another node since would keep it where the log says it is not.
            raise precondition(
                f"actor {actor.entity_id!r} cannot be paused on worker {held.worker_id!r}: the actor was placed "
                f"on node {held.node!r}, and the worker registered on node {moved[1]!r} since (sequence "
                f"{moved[0]}), so its local image would be recorded on a node its worker is not on; suspend it "
                "instead (an EXTERNAL image restores on any node)"
            )
        return {worker: last_seq_}

    async def save(self, *aggregates: WireAggregate, fences: dict[str, int] | None = None) -> int:
        """Save what the aggregates recorded (one atomic append); the sequence of the last event.
        With `fences`, only if each of those subjects is still at its sequence (else IntegrityError)."""
        assert self.app is not None
        deadline.check("the actor's event")
        # and again if it waits for a grouped append in flight before it goes out
        events, seqs = await self.app.save_async(*aggregates, fences=fences, late=partial(
            deadline.passed, deadline.deadline(), "the actor's event"))
        counted(events)
        return seqs[-1]
