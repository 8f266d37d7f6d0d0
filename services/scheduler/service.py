"""How the scheduler talks: the fold of the log, the commit of placements, the endpoints.

What it decides is in `services.scheduler.decide`; what it knows, in
`services.scheduler.projection`. Here:

- `Fold` keeps the projection current. An ordered push consumer on the whole event
  stream delivers every message from sequence 1 into a callback (the fastest way
  nats-py reads a stream), which decodes the body with msgspec straight into its
  event Struct (`EventReader`) and folds it; messages that are not events (the
  tracking records of process applications) only advance the position. A replay is
  bound by nats-py's work per message, most of it parsing headers: the fold reads
  with the shared lean parser (`lean_headers`). `wait(seq)` lets a request be
  answered from state that includes `seq` (`min_seq`), or UNAVAILABLE after a deadline.
- `SchedulerService` answers `resume`, `explain` and `fragmentation` as the nats.micro
  service `warmboot-scheduler` in its queue group, so any number of replicas serve.

Committing placements (CONTRACT placement rule 8). Each placement is two events,
`ActorPlaced` on `actor.<actor id>` then `WorkerBooked` on `booking.<worker id>`,
each guarded by the last stream sequence the decision saw for that subject; another
replica that booked the same worker, or wrote on the same actor meanwhile, makes the
append fail. The order matters: a fold delivers a batch one message at a time and a
decision may run between two of them; with the placement first, a worker's booking
sequence never moves ahead of the capacity it accounts for, so a decision made in
between expects an old sequence and loses, instead of booking room already taken.
The reply's `seq` is the sequence of the `WorkerBooked`, the last event written.

One committer task per replica decides and appends, in rounds: it takes every resume
queued since the last round, decides each on the current fold (so a decision is as
fresh as it can be when it is committed), and appends them all as one atomic batch
through the event store's recorder. A file-backed atomic batch costs a few ms
whatever its size (the server makes it durable before answering), so grouping is
what lets one replica commit thousands of placements per second. If the batch is
refused, the committer folds up to the stream's end, sends the placements whose two
subjects have not moved into the next round unchanged, and fails the others: their
resumes decide again, at most `commit_attempts` times, then answer UNAVAILABLE.

Within a replica nothing races: decisions count the bookings this replica has in
flight (appended or not, until its fold has them), a round holds at most one
placement per worker, and a placement on a worker this replica booked in an earlier
round that is not folded yet expects the sequence that round wrote.

Idempotency: `request_id` through `ReplyCache` (the first answer, shared by every
replica), and through the log: an actor whose last placement carries the request's
`request_id` answers that placement, also after a lost reply and a lost cache write.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import logging
import os
from contextlib import asynccontextmanager, suppress
from typing import Any, AsyncIterator, Callable, Union

import msgspec
from eventsourcing.persistence import IntegrityError, OperationalError
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from msgspec import Raw
from msgspec.structs import force_setattr
from prometheus_client import Counter, Gauge

from events.aggregate import WireApplication, now
from events.codec import decode_event, decoder
from events.errors import ContractError, unavailable
from events.headers import parse_header_lines
from events.jetstream import TOPIC_HEADER, VERSION_HEADER
from events.schema import (
    EVENT_TYPES,
    ActorPlaced,
    ActorRuntime,
    AnyEvent,
    Assignment,
    Explanation,
    ExplainResume,
    Fragmentation,
    FragmentationQuery,
    Placement,
    ResumeActor,
    Snapshot,
    SnapshotTaken,
    WhatIf,
    WhatIfAnswer,
    WorkerBooked,
)
from events.subjects import check_prefix, stream_name
from services.common import EndpointSpec, ReplyCache, add_endpoints, store_env
from services.locks import KeyedLock
from services.scheduler.checkpoint import DEFAULT_INTERVAL_S, Checkpoints
from services.scheduler.decide import decide, explain, fragmentation
from services.scheduler.projection import RECENT_PLACEMENTS, Projection, request_hash
from services.scheduler.whatif import whatif

log = logging.getLogger("warmboot.scheduler")

SERVICE = "scheduler"
DEFAULT_COMMIT_ATTEMPTS = 8
DEFAULT_CATCH_UP_S = 5.0  # how long a request waits for the fold (min_seq, after a lost race)
GAUGE_INTERVAL_S = 2.0
MAX_CONCURRENT_REQUESTS = 4096  # requests handled at once by one replica
MAX_GROUP = 400  # placements per append: 800 messages, under the server's 1,000 per atomic batch

# --- metrics (prometheus-client default registry; defined once per process) -----------------------

PLACEMENTS = Counter(
    "warmboot_placements_total", "Placements committed by resume", ["sandbox_class", "action", "fidelity"]
)
FALLBACKS = Counter(
    "warmboot_resume_fallbacks_total", "Resumes placed at a lower fidelity than their snapshot",
    ["sandbox_class", "reason"],
)
COMMIT_CONFLICTS = Counter(
    "warmboot_scheduler_commit_conflicts_total",
    "Placement commits refused because the worker's bookings or the actor's history moved on",
)
WORKERS = Gauge(
    "warmboot_scheduler_workers", "Registered, undrained workers per sandbox class and runtime version",
    ["sandbox_class", "runtime", "role"],
)
STRANDED = Gauge(
    "warmboot_scheduler_stranded_snapshots",
    "Latest MEMORY snapshots of suspended or paused actors (current template) that no registered, undrained "
    "worker can restore at MEMORY (a LOCAL one: none on its node)",
    ["sandbox_class"],
)
LOST_LOCAL = Gauge(
    "warmboot_scheduler_lost_local_snapshots",
    "Waiting actors whose LOCAL latest snapshot is on a node with no registered worker of the class "
    "(resumable only after a revert)",
    ["sandbox_class"],
)
# the `role` label of warmboot_scheduler_workers, by projection role
GAUGE_ROLES = ("default", "restorable", "edge_default", "edge_restorable")
FOLD_LAG = Gauge("warmboot_scheduler_fold_lag_events", "Messages in the stream the fold has not read yet")
FOLD_SEQ = Gauge("warmboot_scheduler_fold_seq", "Stream sequence of the last message folded")


def runtime_label(key: tuple) -> str:
    """A runtime version as a metric label: `v1 architecture=amd64,...`, shortened if long."""
    _, schema_version, attrs = key
    text = f"{schema_version} " + ",".join(f"{k}={v}" for k, v in attrs)
    if len(text) > 120:
        text = text[:100] + "~" + hashlib.blake2b(text.encode(), digest_size=6).hexdigest()
    return text


# --- the fold ---------------------------------------------------------------------------------------


def lean_headers(nc: NATS) -> None:
    """Have `nc` parse message headers with the event store's lean parser.

    A replay is bound by nats-py's work per message, most of it parsing the headers
    the store writes on every event (message id, topic, version, batch and expectation
    headers); the lean parser gives the same dict faster (`events.jetstream`, whose
    test pins it to nats-py's own). The connection may be shared: every reader of it
    gets the same headers as before.
    """
    if nc._parse_header_lines is not parse_header_lines:
        nc._parse_header_lines = parse_header_lines  # type: ignore[method-assign]


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
    """The projection, kept current from the stream: replay from sequence 1, then live."""

    def __init__(self, nc: NATS, prefix: str, projection: Projection, on_applied: Callable[[int], None] | None = None):
        self.nc = nc
        self.prefix = prefix
        self.stream = stream_name(prefix)
        self.events_prefix = f"{prefix}.ev."
        self.booking_prefix = f"{prefix}.ev.{WorkerBooked.KIND}."
        self.projection = projection
        self.on_applied = on_applied
        self.behind = 0  # messages the server had not delivered yet at the last one folded
        self.errors = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._tie = itertools.count()
        self._sub: Any = None
        self._read = EventReader().decode
        self.checkpoints: Checkpoints | None = None  # set by Checkpoints.follow: holds the fold during a capture

    @property
    def applied(self) -> int:
        return self.projection.seq

    async def start(self, timeout: float) -> None:
        """Read from the message after the projection's position (1, or a restored checkpoint's + 1)."""
        lean_headers(self.nc)
        js = self.nc.jetstream()
        target = (await js.stream_info(self.stream)).state.last_seq
        start = {}
        if self.projection.seq:
            start = {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE,
                     "config": ConsumerConfig(opt_start_seq=self.projection.seq + 1)}
        self._sub = await js.subscribe(
            f"{self.prefix}.>", stream=self.stream, cb=self._on_msg, ordered_consumer=True, idle_heartbeat=2.0,
            **start,
        )
        await self.wait(target, timeout)

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with suppress(Exception):
                await sub.unsubscribe()
        for _, _, waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(unavailable("the scheduler is stopping"))
        self._waiters.clear()

    async def _on_msg(self, msg: Msg) -> None:
        checkpoints = self.checkpoints
        if checkpoints is not None and checkpoints.capturing is not None:
            await checkpoints.hold()  # a checkpoint is copying the projection: fold nothing meanwhile
        tokens = msg.reply.split(".")
        if len(tokens) == 9:
            seq, behind = int(tokens[5]), int(tokens[8])
        else:
            seq, behind = int(tokens[Msg.Ack.StreamSeq]), int(tokens[Msg.Ack.NumPending])
        if seq <= self.projection.seq:  # redelivered: an ordered consumer reset before its first message
            return
        self.fold_message(seq, msg.subject, msg.headers, msg.data)
        self.behind = behind
        waiters = self._waiters
        while waiters and waiters[0][0] <= seq:
            waiter = heapq.heappop(waiters)[2]
            if not waiter.done():
                waiter.set_result(None)
        if self.on_applied is not None:
            self.on_applied(seq)
        if checkpoints is not None:
            checkpoints.folded(self.projection.events, behind)

    def fold_message(self, seq: int, subject: str, headers: dict[str, str] | None, data: bytes) -> None:
        """Fold one message of the stream as read: its sequence, subject, headers and body."""
        projection = self.projection
        topic = headers.get(TOPIC_HEADER) if headers else None
        if subject.startswith(self.booking_prefix) and headers:
            # a placement's WorkerBooked or the registry's WorkerFenced: the subject says all
            # the fold needs of a booking marker, so there is no body to decode
            version = headers.get(VERSION_HEADER)
            projection.booking_marker(seq, subject[len(self.booking_prefix):], int(version) if version else None)
        elif topic in EVENT_TYPES or (topic is None and subject.startswith(self.events_prefix)):
            try:
                event = self._read(data)
                version = headers.get(VERSION_HEADER) if headers else None
                projection.apply(seq, event, int(version) if version else None)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                self.errors += 1
                log.warning("message %d on %s is not an event this scheduler reads; skipped", seq, subject)
                projection.skip(seq)
            except Exception:  # a bug in the fold: keep folding, loudly
                self.errors += 1
                log.exception("folding message %d on %s failed", seq, subject)
                projection.skip(seq)
        else:
            projection.skip(seq)

    async def wait(self, seq: int | None, timeout: float) -> None:
        """Return once the fold has applied `seq`; UNAVAILABLE if it does not within `timeout`."""
        if not seq or self.projection.seq >= seq:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (seq, next(self._tie), waiter)
        heapq.heappush(self._waiters, entry)
        try:
            await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            with suppress(ValueError):
                self._waiters.remove(entry)
                heapq.heapify(self._waiters)
            raise unavailable(
                f"this scheduler replica has folded the log up to sequence {self.projection.seq}, "
                f"not {seq}, within {timeout:g}s; try again"
            ) from None


# --- in-flight bookings --------------------------------------------------------------------------------


class Hold:
    """One booking this replica is committing (or has committed but not folded yet)."""

    __slots__ = ("worker_id", "actor_id", "cpu", "mem", "expected", "written", "last_seq", "settled", "released")

    def __init__(self, worker_id: str, actor_id: str, cpu: int, mem: int):
        self.worker_id = worker_id
        self.actor_id = actor_id
        self.cpu = cpu
        self.mem = mem
        self.expected: tuple[int, int] | None = None  # (version, seq) of booking.<id> its commit expected
        self.written: tuple[int, int] | None = None  # (version, seq) of the WorkerBooked it wrote
        self.last_seq = 0  # the WorkerBooked's sequence: the fold has the booking once past it
        self.settled = False  # its append succeeded or failed
        self.released = False  # no longer counted in flight


class Job:
    """A resume waiting for the committer to decide and commit it."""

    __slots__ = ("actor_id", "selectors", "request_id", "request", "result")

    def __init__(self, actor_id: str, selectors: Any, request_id: str | None, result: asyncio.Future[Any]):
        self.actor_id = actor_id
        self.selectors = selectors
        self.request_id = request_id
        self.request = request_hash(request_id) if request_id is not None else None
        self.result = result  # (Placement, seq), Answered, or the error

    @property
    def key(self) -> tuple[str, int] | None:
        return (self.actor_id, self.request) if self.request is not None else None


class Answered:
    """A job whose request the log already answers: its placement is the ActorPlaced at `seq`."""

    __slots__ = ("seq",)

    def __init__(self, seq: int):
        self.seq = seq


class Commit:
    """A decided placement waiting for the group commit."""

    __slots__ = ("placement", "request_id", "hold", "booking", "actor", "after", "result")

    def __init__(
        self,
        placement: Placement,
        request_id: str | None,
        hold: Hold,
        booking: tuple[int, int],
        actor: tuple[int, int],
        after: Hold | None,
        result: asyncio.Future[Any],
    ):
        self.placement = placement
        self.request_id = request_id
        self.hold = hold
        self.booking = booking  # (version, seq) of booking.<worker> the decision saw
        self.actor = actor  # (version, seq) of actor.<id> the decision saw
        self.after = after  # this replica's previous booking of the same worker, if unfolded then
        self.result = result  # (Placement, sequence of its WorkerBooked), or the error

# --- the service -------------------------------------------------------------------------------------------


class SchedulerService:
    """`warmboot-scheduler`: resume, explain, fragmentation (CONTRACT section 3, Scheduler)."""

    def __init__(
        self,
        nc: NATS,
        *,
        nats_url: str,
        prefix: str,
        metrics: bool = True,
        store_replicas: int | None = None,
        commit_attempts: int = DEFAULT_COMMIT_ATTEMPTS,
        catch_up_s: float = DEFAULT_CATCH_UP_S,
        max_group: int = MAX_GROUP,
        env: dict[str, str] | None = None,
        checkpoint_every: int | None = None,
        checkpoint_interval_s: float = DEFAULT_INTERVAL_S,
    ):
        self.nc = nc
        self.prefix = check_prefix(prefix)
        self.stream = stream_name(prefix)
        replicas = store_replicas or int(os.environ.get("WARMBOOT_STREAM_REPLICAS") or 1)
        self.env = env if env is not None else store_env(nats_url, prefix, replicas)
        self.metrics = metrics
        self.commit_attempts = commit_attempts
        self.catch_up_s = catch_up_s
        self.max_group = max(1, min(max_group, MAX_GROUP))
        self._group_limit = self.max_group  # halved after a refused append, doubled after a taken one
        self.projection = Projection()
        self.projection.placed_listener = self._placed
        self.fold = Fold(nc, prefix, self.projection, self._folded)
        # Projection checkpoints (services.scheduler.checkpoint): start from the newest, save every
        # `checkpoint_every` events or `checkpoint_interval_s` seconds; None or 0: always replay the log.
        self.checkpoints = (
            Checkpoints(nc, prefix, every_events=checkpoint_every, interval_s=checkpoint_interval_s)
            if checkpoint_every else None
        )
        self.replies = ReplyCache(nc, prefix)
        self.store: WireApplication | None = None
        self.service: Any = None
        self.commits = 0  # placements committed
        self.conflicts = 0  # placements whose commit lost a race (each is decided again)
        self.groups = 0  # appends made (a group of placements each)
        self._pending: dict[str, tuple[int, int]] = {}  # worker id -> in-flight (cpu, mem), for decide
        self._refusals: dict = {}  # refusal messages of decide, valid until the fold or _pending changes
        self._chain: dict[str, Hold] = {}  # worker id -> the latest hold on it
        self._unfolded: list[tuple[int, int, Hold]] = []  # appended holds, by the seq of their WorkerBooked
        self._unfolded_actors: dict[str, int] = {}  # actor id -> seq of a placement not folded yet
        # idempotency of jobs in flight: (actor id, request hash) -> jobs waiting, and -> the
        # sequence of a placement carrying that request the fold met meanwhile
        self._awaiting: dict[tuple[str, int], int] = {}
        self._answered: dict[tuple[str, int], int] = {}
        self._jobs: list[Job] = []  # resumes to decide
        self._ready: list[Commit] = []  # decided placements to append again after a refused group
        self._wake = asyncio.Event()
        self._may_commit = asyncio.Event()  # cleared while `commits_held`
        self._may_commit.set()
        self._arrival: asyncio.Future[None] | None = None  # `until_queued` waits on it
        self._committer: asyncio.Task[None] | None = None
        self._tie = itertools.count()
        self._actors = KeyedLock()
        self._gauges: asyncio.Task[None] | None = None
        self._gauge_labels: set[tuple[str, ...]] = set()
        self._stopping = False

    # --- life cycle ---

    async def start(self) -> "SchedulerService":
        self.store = await asyncio.to_thread(WireApplication, self.env)  # creates the stream if need be
        if self.checkpoints is not None:
            restored = await (await self.checkpoints.open()).load()
            if restored is not None:  # the fold goes on from its position
                restored.placed_listener = self._placed
                self.projection = self.fold.projection = restored
        await self.fold.start(max(self.catch_up_s, 60.0))
        if self.checkpoints is not None:
            self.checkpoints.follow(self.fold)
        await self.replies.start()
        self._committer = asyncio.create_task(self._commit_groups(), name="scheduler-committer")
        # Resumes wait for a group commit and explains for the fold: many run at once.
        self.service = await add_endpoints(
            self.nc,
            self.prefix,
            SERVICE,
            "warmboot scheduler: places resumes where their snapshot can load, or falls back",
            [
                EndpointSpec("resume", ResumeActor, self.resume),
                EndpointSpec("explain", ExplainResume, self.explain),
                EndpointSpec("fragmentation", FragmentationQuery, self.fragmentation, per_entity=False),
                EndpointSpec("whatif", WhatIf, self.whatif, per_entity=False),
            ],
            max_concurrent=MAX_CONCURRENT_REQUESTS,
        )
        if self.metrics:
            self._gauges = asyncio.create_task(self._refresh_gauges(), name="scheduler-gauges")
        log.info("scheduler folded %d events up to sequence %d", self.projection.events, self.projection.seq)
        return self

    async def stop(self) -> None:
        self._stopping = True
        if self.service is not None:  # let the requests in progress finish (new commits are refused)
            with suppress(Exception):
                await self.service.stop(drain_s=self.catch_up_s + 5)
            self.service = None
        for task in (self._gauges, self._committer):
            if task is not None:
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
        self._gauges = self._committer = None
        stopping = unavailable("this scheduler replica is stopping; try again")
        self._fail(self._ready, stopping)
        for job in self._jobs:
            if not job.result.done():
                job.result.set_exception(stopping)
        self._jobs, self._ready = [], []
        if self.checkpoints is not None:
            await self.checkpoints.close()
        await self.replies.flush()
        await self.fold.stop()
        if self.store is not None:
            store, self.store = self.store, None
            await asyncio.to_thread(store.close)

    # --- holding the committer (fault tests, maintenance) ---

    @asynccontextmanager
    async def commits_held(self) -> AsyncIterator[None]:
        """While held, the committer decides and appends nothing; resumes queue up, as they
        do when a replica stalls (a leader election). On release it decides them as usual."""
        self._may_commit.clear()
        try:
            yield
        finally:
            self._may_commit.set()
            self._wake.set()

    async def until_queued(self, jobs: int) -> None:
        """Return once at least `jobs` resumes wait for the committer."""
        while len(self._jobs) < jobs:
            self._arrival = asyncio.get_running_loop().create_future()
            await self._arrival

    # --- endpoints ---

    async def resume(self, actor_id: str, request: ResumeActor) -> Assignment:
        return await self._resume(actor_id, request)

    async def explain(self, actor_id: str, request: ExplainResume) -> Explanation:
        await self.fold.wait(request.min_seq, self.catch_up_s)
        p = self.projection
        return explain(p, actor_id, request.selectors, p.seq, self._pending)

    async def whatif(self, _: str | None, request: WhatIf) -> WhatIfAnswer:
        await self.fold.wait(request.min_seq, self.catch_up_s)
        return whatif(self.projection, request)

    async def fragmentation(self, _: str | None, request: FragmentationQuery) -> Fragmentation:
        await self.fold.wait(request.min_seq, self.catch_up_s)
        return fragmentation(self.projection, request.sandbox_class)

    # --- resume ---

    async def _resume(self, actor_id: str, request: ResumeActor) -> Assignment:
        """Idempotency is decided where the write happens. A request id is answered from the
        log: by the actor's recent placements of this life (`Actor.placed_by`), checked here
        and again by the committer right before it decides, and by any placement carrying
        the id that the fold meets while the job waits (`_placed`), so a retry, or a stale
        attempt that a stalled committer decides late, never places twice. Only when the
        actor has more placements than it keeps, the shared reply cache answers for older ones.
        """
        await self.fold.wait(request.min_seq, self.catch_up_s)
        rid = request.request_id
        async with self._actors(actor_id):
            for attempt in range(self.commit_attempts):
                if self._stopping:
                    raise unavailable("this scheduler replica is stopping; try again")
                unfolded = self._unfolded_actors.get(actor_id)
                if unfolded is not None:  # our own last placement of it: decide on state that has it
                    await self.fold.wait(unfolded, self.catch_up_s)
                job = Job(actor_id, request.selectors, rid, asyncio.get_running_loop().create_future())
                if job.request is not None:
                    actor = self.projection.actors.get(actor_id)
                    seq = actor.placed_by(job.request) if actor is not None else 0
                    if seq:
                        return await self._recorded(seq)
                    if attempt == 0 and actor is not None and actor.placements_known >= RECENT_PLACEMENTS:
                        cached = await self._cached(actor_id, rid)
                        if cached is not None:
                            return cached
                    self._awaiting[job.key] = self._awaiting.get(job.key, 0) + 1
                self._jobs.append(job)
                self._wake.set()
                if self._arrival is not None and not self._arrival.done():
                    self._arrival.set_result(None)
                try:
                    result = await asyncio.shield(job.result)
                except IntegrityError as error:
                    self.conflicts += 1
                    if self.metrics:
                        COMMIT_CONFLICTS.inc()
                    log.debug("placement of %s lost a race: %s", actor_id, error)
                    await self._catch_up(job)
                    continue
                except OperationalError as error:
                    raise unavailable(f"the event store did not take the placement: {error}") from None
                finally:
                    self._forget(job)
                if isinstance(result, Answered):
                    return await self._recorded(result.seq)
                placement, seq = result
                self.commits += 1
                if self.metrics:
                    self._count(placement)
                assignment = Assignment(**msgspec.structs.asdict(placement), seq=seq)
                if rid is not None:
                    self.replies.remember(self.replies.key(f"resume.{actor_id}", rid), assignment)
                return assignment
        raise unavailable(
            f"placing actor {actor_id} lost {self.commit_attempts} concurrent-commit races in a row; try again"
        )

    async def _cached(self, actor_id: str, request_id: str) -> Assignment | None:
        """The reply cache's answer to a request id, if it is of the actor's current life."""
        data = await self.replies.get(self.replies.key(f"resume.{actor_id}", request_id))
        if data is None:
            return None
        assignment = msgspec.json.decode(data, type=Assignment)
        return assignment if assignment.seq > self.projection.life_started(actor_id) else None

    def _placed(self, actor_id: str, request: int, seq: int) -> None:
        """The fold met a placement carrying a request id: a job of that request still waiting
        here is answered by it, whichever replica wrote it (listener of the projection)."""
        key = (actor_id, request)
        if key in self._awaiting:
            self._answered[key] = seq

    def _forget(self, job: Job) -> None:
        key = job.key
        if key is None:
            return
        n = self._awaiting.get(key, 0) - 1
        if n > 0:
            self._awaiting[key] = n
        else:
            self._awaiting.pop(key, None)
            self._answered.pop(key, None)

    async def _commit_groups(self) -> None:
        """The committer: decide what is queued, then one append for all of it, and again.

        Decisions are made here, right before the append, on the freshest fold: the
        shorter the time between deciding and committing, the fewer commits lose a race
        against another replica. An atomic append costs about the same for one placement
        as for hundreds (the server makes each batch durable before it answers), so every
        resume that arrived while one append was in flight shares the next. A group holds
        at most one placement per worker (the OCC guard is per subject); a resume that
        lands on a worker already in the group is decided again in the next one, which
        then expects the booking sequence this group wrote.
        """
        while True:
            await self._wake.wait()
            await self._may_commit.wait()
            self._wake.clear()
            while self._ready or self._jobs:
                workers = {item.hold.worker_id for item in self._ready}
                group = self._ready[: self._group_limit]
                self._ready = self._ready[self._group_limit:]
                jobs, self._jobs, deferred = self._jobs, [], []
                p = self.projection
                for job in jobs:
                    if job.result.done():  # its caller went away
                        continue
                    if len(group) >= self._group_limit:
                        deferred.append(job)
                        continue
                    answered = self._answered_by_log(job)
                    if answered:  # its request was placed meanwhile (a retry, another replica)
                        job.result.set_result(Answered(answered))
                        continue
                    try:
                        placement = decide(p, job.actor_id, job.selectors, p.seq, self._pending, self._refusals)
                    except ContractError as error:
                        job.result.set_exception(error)
                        continue
                    except Exception as error:  # a bug: this request fails, the committer goes on
                        log.exception("deciding the placement of %s failed", job.actor_id)
                        job.result.set_exception(error)
                        continue
                    worker_id = placement.worker_id
                    if worker_id in workers:
                        deferred.append(job)
                        continue
                    workers.add(worker_id)
                    group.append(self._queued(placement, job))
                self._jobs[:0] = deferred
                if not group:
                    continue
                try:
                    await self._append(group)
                except asyncio.CancelledError:
                    self._fail(group, unavailable("this scheduler replica is stopping; try again"))
                    raise
                except Exception as error:  # the store failed: every placement of the group fails with it
                    log.warning("appending %d placements failed: %s", len(group), error)
                    self._fail(group, error)

    def _answered_by_log(self, job: Job) -> int:
        """The ActorPlaced that already carries the job's request id, if the fold has met one."""
        if job.request is None:
            return 0
        found = self._answered.get(job.key, 0)
        if found:
            return found
        actor = self.projection.actors.get(job.actor_id)
        return actor.placed_by(job.request) if actor is not None else 0

    def _queued(self, placement: Placement, job: "Job") -> Commit:
        """A decided placement: its booking counts as in flight from now on, and it carries
        the expectations of the state it was decided on."""
        p = self.projection
        worker_id = placement.worker_id
        hold = Hold(worker_id, placement.actor_id, placement.booked.cpu_millis, placement.booked.memory_mib)
        self._hold(hold)
        after = self._chain.get(worker_id)
        self._chain[worker_id] = hold
        return Commit(
            placement, job.request_id, hold, p.booking_expectation(worker_id), p.actor_expectation(placement.actor_id),
            after, job.result,
        )

    async def _append(self, group: list[Commit]) -> None:
        store = self.store
        stored = []
        expected: dict[str, int] = {}
        for item in group:
            booking = item.booking
            if item.after is not None:  # our own earlier booking of this worker went first
                known = item.after.written or item.after.expected
                if known is not None and known[1] > booking[1]:
                    booking = known
                item.after = None
                item.booking = booking
            item.hold.expected = booking
            placement = item.placement
            worker_id, actor_id = placement.worker_id, placement.actor_id
            at = now()
            booked = WorkerBooked(at=at, worker_id=worker_id, actor_id=actor_id, request_id=item.request_id)
            placed = ActorPlaced(
                at=at,
                actor_id=actor_id,
                worker_id=worker_id,
                node=placement.node,
                action=placement.action,
                fidelity=placement.fidelity,
                sandbox_runtime=placement.sandbox_runtime,
                snapshot_id=placement.snapshot_id,
                fallback=placement.fallback,
                booked=placement.booked,
                matched_version=placement.matched_version,
                request_id=item.request_id,
            )
            booking_id, placed_id = f"booking.{worker_id}", f"actor.{actor_id}"
            # ActorPlaced first: a fold that has read only part of the batch has then counted
            # the booking before the booking subject's sequence moves, never the reverse.
            stored.append(store.stored_event(placed_id, item.actor[0] + 1, placed))
            stored.append(store.stored_event(booking_id, booking[0] + 1, booked))
            expected[booking_id] = booking[1]
            expected[placed_id] = item.actor[1]
        self.groups += 1
        try:
            seqs = await asyncio.to_thread(store.recorder.insert_events, stored, expected_last_seqs=expected)
        except IntegrityError as error:
            await self._sort_out(group, error)
            return
        self._group_limit = min(self.max_group, self._group_limit * 2)
        applied = self.fold.applied
        for i, item in enumerate(group):
            hold = item.hold
            hold.written = (hold.expected[0] + 1, seqs[2 * i + 1])
            hold.last_seq = seqs[2 * i + 1]
            hold.settled = True
            if applied >= hold.last_seq:
                self._unhold(hold)
            else:
                heapq.heappush(self._unfolded, (hold.last_seq, next(self._tie), hold))
                self._unfolded_actors[hold.actor_id] = hold.last_seq
            if not item.result.done():
                item.result.set_result((item.placement, hold.last_seq))

    async def _sort_out(self, group: list[Commit], error: IntegrityError) -> None:
        """A group was refused: fold what the log holds now, fail the placements whose
        subjects moved on (they are decided again) and queue the others again unchanged.

        Under contention (replicas booking the same workers) smaller groups lose less
        to one stale placement, so the next groups are at most half this one's size.
        """
        self._group_limit = max(1, len(group) // 2)
        try:
            last = (await self.nc.jetstream().stream_info(self.stream)).state.last_seq
            await self.fold.wait(last, self.catch_up_s)
        except Exception:
            self._fail(group, error)
            return
        p = self.projection
        stale = [
            item for item in group
            if p.booking_expectation(item.hold.worker_id) != item.hold.expected
            or p.actor_expectation(item.placement.actor_id) != item.actor
        ]
        if not stale:  # refused for a reason the expectations do not show: let each decide again
            stale = group
        self._fail(stale, IntegrityError(str(error)))
        kept = [item for item in group if item not in stale and not item.result.done()]
        for item in kept:
            item.booking = item.hold.expected
        self._ready[:0] = kept
        if kept:
            self._wake.set()

    def _fail(self, items: list[Commit], error: BaseException) -> None:
        for item in items:
            item.hold.settled = True
            self._unhold(item.hold)
            if not item.result.done():
                item.result.set_exception(error)

    def _hold(self, hold: Hold) -> None:
        self._refusals.clear()
        cpu, mem = self._pending.get(hold.worker_id, (0, 0))
        self._pending[hold.worker_id] = (cpu + hold.cpu, mem + hold.mem)

    def _unhold(self, hold: Hold) -> None:
        if hold.released:
            return
        hold.released = True
        self._refusals.clear()
        cpu, mem = self._pending[hold.worker_id]
        cpu, mem = cpu - hold.cpu, mem - hold.mem
        if cpu or mem:
            self._pending[hold.worker_id] = (cpu, mem)
        else:
            del self._pending[hold.worker_id]
        if self._chain.get(hold.worker_id) is hold:
            del self._chain[hold.worker_id]

    def _folded(self, seq: int) -> None:
        """After each message folded: bookings now in the projection leave the in-flight set."""
        if self._refusals:
            self._refusals.clear()
        unfolded = self._unfolded
        while unfolded and unfolded[0][0] <= seq:
            hold = heapq.heappop(unfolded)[2]
            self._unhold(hold)
            if self._unfolded_actors.get(hold.actor_id) == hold.last_seq:
                del self._unfolded_actors[hold.actor_id]

    async def _catch_up(self, job: Job) -> None:
        """After a lost race: wait until the fold has what the actor's subject holds now
        (the worker's side was caught up with by the committer before it gave up)."""
        try:
            msg = await self.nc.jetstream().get_msg(
                self.stream, subject=f"{self.prefix}.ev.actor.{job.actor_id}", direct=True
            )
        except Exception:  # no message on the subject yet, or the server is busy: decide on what we have
            return
        await self.fold.wait(msg.seq, self.catch_up_s)

    async def _recorded(self, seq: int) -> Assignment:
        """The assignment an earlier request recorded with the ActorPlaced at `seq` (a retry
        after a lost reply); its `seq` is that of the WorkerBooked written with it, right after."""
        js = self.nc.jetstream()
        placed = decoder(ActorPlaced).decode((await js.get_msg(self.stream, seq=seq, direct=True)).data)
        with suppress(Exception):  # written by something else than this scheduler: no booking marker
            booked = decode_event((await js.get_msg(self.stream, seq=seq + 1, direct=True)).data)
            if isinstance(booked, WorkerBooked) and booked.actor_id == placed.actor_id:
                seq += 1
        fields = {f: getattr(placed, f) for f in Placement.__struct_fields__}
        return Assignment(**fields, seq=seq)

    # --- metrics ---

    def _count(self, placement: Placement) -> None:
        cls = placement.sandbox_runtime.sandbox_class
        PLACEMENTS.labels(cls, placement.action.value, placement.fidelity.value).inc()
        if placement.fallback is not None:
            FALLBACKS.labels(cls, placement.fallback.reason.value).inc()

    def refresh_gauges(self) -> None:
        p = self.projection
        seen: set[tuple[str, ...]] = set()
        for name, index in p.classes.items():
            for role, counts in zip(GAUGE_ROLES, index.live):
                for compat, n in counts.items():
                    labels = (name, runtime_label(compat.key), role)
                    WORKERS.labels(*labels).set(n)
                    seen.add(labels)
            STRANDED.labels(name).set(index.stranded())
            LOST_LOCAL.labels(name).set(index.lost_local())
        for labels in self._gauge_labels - seen:
            with suppress(KeyError):
                WORKERS.remove(*labels)
        self._gauge_labels = seen
        FOLD_LAG.set(self.fold.behind)
        FOLD_SEQ.set(p.seq)

    async def _refresh_gauges(self) -> None:
        while True:
            try:
                self.refresh_gauges()
            except Exception:
                log.exception("refreshing the scheduler's gauges failed")
            await asyncio.sleep(GAUGE_INTERVAL_S)
