"""How the scheduler talks: the fold of the log, the commit of placements, the endpoints.

What it decides is in `services.scheduler.decide`; what it knows, in
`services.scheduler.projection`. Here:

- `Fold` keeps the projection current. An ordered push consumer on the whole event
  stream delivers every message from sequence 1 into a callback (the fastest way
  nats-py reads a stream), which decodes the body with msgspec straight into its
  event Struct and folds it; messages that are not events (the tracking records of
  process applications) only advance the position. `wait(seq)` lets a request be
  answered from state that includes `seq` (`min_seq`), or UNAVAILABLE after a deadline.
- `SchedulerService` answers `resume`, `explain` and `fragmentation` as the nats.micro
  service `warmboot-scheduler` in its queue group, so any number of replicas serve.

Committing a placement (CONTRACT placement rule 8). A resume appends, in one atomic
batch through the event store's recorder, `WorkerBooked` on `booking.<worker id>`
and `ActorPlaced` on `actor.<actor id>`, each guarded by the last stream sequence
the decision saw for that subject. Another replica that booked the same worker, or
placed (or released, paused...) the same actor meanwhile, makes the batch fail as a
whole; this replica then waits until its fold has those events and decides again,
at most `commit_attempts` times, then answers UNAVAILABLE. The reply's `seq` is the
sequence of the `ActorPlaced`, the last event the request wrote.

Within one replica, resumes run concurrently. A decision counts the bookings this
replica has in flight (committed or not, until its fold has them), so concurrent
decisions do not pick the same room; commits on one worker are chained, each
expecting the booking sequence its predecessor wrote, so a replica does not lose
races against itself.

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
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from functools import partial
from typing import Any, Callable

import msgspec
from eventsourcing.persistence import IntegrityError, OperationalError
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge

from events.aggregate import WireApplication, now
from events.codec import decode_event, decoder
from events.errors import unavailable
from events.jetstream import TOPIC_HEADER, VERSION_HEADER
from events.schema import (
    EVENT_TYPES,
    ActorPlaced,
    Assignment,
    Explanation,
    ExplainResume,
    Fragmentation,
    FragmentationQuery,
    Placement,
    ResumeActor,
    WorkerBooked,
)
from events.subjects import check_prefix, stream_name
from services.common import EndpointSpec, ReplyCache, add_endpoints, store_env
from services.scheduler.decide import decide, explain, fragmentation
from services.scheduler.projection import Projection

log = logging.getLogger("warmboot.scheduler")

SERVICE = "scheduler"
DEFAULT_COMMIT_ATTEMPTS = 8
DEFAULT_CATCH_UP_S = 5.0  # how long a request waits for the fold (min_seq, after a lost race)
GAUGE_INTERVAL_S = 2.0
COMMIT_THREADS = 16  # appends in flight at once (each holds a thread while the store waits for its ack)

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
    "Latest MEMORY snapshots of waiting actors that no registered, undrained worker can restore",
    ["sandbox_class"],
)
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


class Fold:
    """The projection, kept current from the stream: replay from sequence 1, then live."""

    def __init__(self, nc: NATS, prefix: str, projection: Projection, on_applied: Callable[[int], None] | None = None):
        self.nc = nc
        self.prefix = prefix
        self.stream = stream_name(prefix)
        self.events_prefix = f"{prefix}.ev."
        self.projection = projection
        self.on_applied = on_applied
        self.behind = 0  # messages the server had not delivered yet at the last one folded
        self.errors = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._tie = itertools.count()
        self._sub: Any = None

    @property
    def applied(self) -> int:
        return self.projection.seq

    async def start(self, timeout: float) -> None:
        js = self.nc.jetstream()
        target = (await js.stream_info(self.stream)).state.last_seq
        self._sub = await js.subscribe(
            f"{self.prefix}.>", stream=self.stream, cb=self._on_msg, ordered_consumer=True, idle_heartbeat=2.0
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
        tokens = msg.reply.split(".")
        if len(tokens) == 9:
            seq, behind = int(tokens[5]), int(tokens[8])
        else:
            seq, behind = int(tokens[Msg.Ack.StreamSeq]), int(tokens[Msg.Ack.NumPending])
        headers = msg.headers
        topic = headers.get(TOPIC_HEADER) if headers else None
        projection = self.projection
        if topic in EVENT_TYPES or (topic is None and msg.subject.startswith(self.events_prefix)):
            try:
                event = decode_event(msg.data)
                version = headers.get(VERSION_HEADER) if headers else None
                projection.apply(seq, event, int(version) if version else None)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                self.errors += 1
                log.warning("message %d on %s is not an event this scheduler reads; skipped", seq, msg.subject)
                projection.skip(seq)
            except Exception:  # a bug in the fold: keep folding, loudly
                self.errors += 1
                log.exception("folding message %d on %s failed", seq, msg.subject)
                projection.skip(seq)
        else:
            projection.skip(seq)
        self.behind = behind
        waiters = self._waiters
        while waiters and waiters[0][0] <= seq:
            waiter = heapq.heappop(waiters)[2]
            if not waiter.done():
                waiter.set_result(None)
        if self.on_applied is not None:
            self.on_applied(seq)

    async def wait(self, seq: int | None, timeout: float) -> None:
        """Return once the fold has applied `seq`; UNAVAILABLE if it does not within `timeout`."""
        if not seq or self.projection.seq >= seq:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (seq, next(self._tie), waiter))
        try:
            await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise unavailable(
                f"this scheduler replica has folded the log up to sequence {self.projection.seq}, "
                f"not {seq}, within {timeout:g}s; try again"
            ) from None


# --- in-flight bookings --------------------------------------------------------------------------------


class Hold:
    """One booking this replica is committing (or has committed but not folded yet)."""

    __slots__ = ("worker_id", "cpu", "mem", "expected", "written", "placed_seq", "done", "released")

    def __init__(self, worker_id: str, cpu: int, mem: int, done: asyncio.Future[None]):
        self.worker_id = worker_id
        self.cpu = cpu
        self.mem = mem
        self.expected: tuple[int, int] | None = None  # (version, seq) of booking.<id> it expected
        self.written: tuple[int, int] | None = None  # (version, seq) of the WorkerBooked it wrote
        self.placed_seq = 0
        self.done = done
        self.released = False


class KeyedLock:
    """One asyncio lock per key, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    def __call__(self, key: str) -> "_Held":
        return _Held(self, key)


class _Held:
    def __init__(self, owner: KeyedLock, key: str):
        self.owner = owner
        self.key = key

    async def __aenter__(self) -> None:
        entry = self.owner._locks.get(self.key)
        if entry is None:
            entry = self.owner._locks[self.key] = (asyncio.Lock(), [0])
        entry[1][0] += 1
        try:
            await entry[0].acquire()
        except BaseException:
            self._leave(entry)
            raise

    async def __aexit__(self, *exc: object) -> None:
        entry = self.owner._locks[self.key]
        entry[0].release()
        self._leave(entry)

    def _leave(self, entry: tuple[asyncio.Lock, list[int]]) -> None:
        entry[1][0] -= 1
        if not entry[1][0]:
            del self.owner._locks[self.key]


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
        env: dict[str, str] | None = None,
    ):
        self.nc = nc
        self.prefix = check_prefix(prefix)
        self.stream = stream_name(prefix)
        replicas = store_replicas or int(os.environ.get("WARMBOOT_STREAM_REPLICAS") or 1)
        self.env = env if env is not None else store_env(nats_url, prefix, replicas)
        self.metrics = metrics
        self.commit_attempts = commit_attempts
        self.catch_up_s = catch_up_s
        self.projection = Projection()
        self.fold = Fold(nc, prefix, self.projection, self._folded)
        self.replies = ReplyCache(nc, prefix)
        self.store: WireApplication | None = None
        self.service: Any = None
        self.commits = 0
        self.conflicts = 0
        self._executor: ThreadPoolExecutor | None = None
        self._pending: dict[str, tuple[int, int]] = {}  # worker id -> in-flight (cpu, mem), for decide
        self._chain: dict[str, Hold] = {}  # worker id -> the latest hold on it
        self._unfolded: list[tuple[int, int, Hold]] = []  # committed holds by ActorPlaced seq
        self._unfolded_actors: dict[str, int] = {}  # actor id -> seq of a placement not folded yet
        self._tie = itertools.count()
        self._actors = KeyedLock()
        self._gauges: asyncio.Task[None] | None = None
        self._gauge_labels: set[tuple[str, ...]] = set()
        self._stopping = False

    # --- life cycle ---

    async def start(self) -> "SchedulerService":
        self.store = await asyncio.to_thread(WireApplication, self.env)  # creates the stream if need be
        self._executor = ThreadPoolExecutor(COMMIT_THREADS, thread_name_prefix="scheduler-commit")
        await self.fold.start(max(self.catch_up_s, 60.0))
        await self.replies.start()
        self.service = await add_endpoints(
            self.nc,
            self.prefix,
            SERVICE,
            "warmboot scheduler: places resumes where their snapshot can load, or falls back",
            [
                EndpointSpec("resume", ResumeActor, self.resume),
                EndpointSpec("explain", ExplainResume, self.explain),
                EndpointSpec("fragmentation", FragmentationQuery, self.fragmentation, per_entity=False),
            ],
        )
        await self.nc.flush()  # the server has our subscriptions before start() returns
        if self.metrics:
            self._gauges = asyncio.create_task(self._refresh_gauges(), name="scheduler-gauges")
        log.info("scheduler folded %d events up to sequence %d", self.projection.events, self.projection.seq)
        return self

    async def stop(self) -> None:
        self._stopping = True
        if self.service is not None:
            with suppress(Exception):
                await self.service.stop()
            self.service = None
        if self._gauges is not None:
            self._gauges.cancel()
            with suppress(asyncio.CancelledError):
                await self._gauges
            self._gauges = None
        await self.fold.stop()
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, True)
            self._executor = None
        if self.store is not None:
            store, self.store = self.store, None
            await asyncio.to_thread(store.close)

    # --- endpoints ---

    async def resume(self, actor_id: str, request: ResumeActor) -> Assignment:
        return await self.replies.once(
            f"resume.{actor_id}", request.request_id, lambda: self._resume(actor_id, request), Assignment
        )

    async def explain(self, actor_id: str, request: ExplainResume) -> Explanation:
        await self.fold.wait(request.min_seq, self.catch_up_s)
        p = self.projection
        return explain(p, actor_id, request.selectors, p.seq, self._pending)

    async def fragmentation(self, _: str | None, request: FragmentationQuery) -> Fragmentation:
        return fragmentation(self.projection, request.sandbox_class)

    # --- resume ---

    async def _resume(self, actor_id: str, request: ResumeActor) -> Assignment:
        await self.fold.wait(request.min_seq, self.catch_up_s)
        p = self.projection
        async with self._actors(actor_id):
            for _ in range(self.commit_attempts):
                unfolded = self._unfolded_actors.get(actor_id)
                if unfolded is not None:  # our own last placement of it: decide on state that has it
                    await self.fold.wait(unfolded, self.catch_up_s)
                    self._unfolded_actors.pop(actor_id, None)
                actor = p.actors.get(actor_id)
                if request.request_id is not None and actor is not None and actor.placed_request_id == request.request_id:
                    return await self._recorded(actor.placed_seq)
                placement = decide(p, actor_id, request.selectors, p.seq, self._pending)
                try:
                    seq = await self._commit(placement, request.request_id)
                except OperationalError as error:
                    raise unavailable(f"the event store did not take the placement: {error}") from None
                except IntegrityError as error:
                    self.conflicts += 1
                    if self.metrics:
                        COMMIT_CONFLICTS.inc()
                    log.debug("placement of %s on %s lost a race: %s", actor_id, placement.worker_id, error)
                    await self._catch_up(placement)
                    continue
                self.commits += 1
                if self.metrics:
                    self._count(placement)
                return Assignment(**msgspec.structs.asdict(placement), seq=seq)
        raise unavailable(
            f"placing actor {actor_id} lost {self.commit_attempts} concurrent-commit races in a row; try again"
        )

    async def _commit(self, placement: Placement, request_id: str | None) -> int:
        """Append WorkerBooked + ActorPlaced atomically, guarded on both subjects; the ActorPlaced seq."""
        p = self.projection
        worker_id, actor_id = placement.worker_id, placement.actor_id
        booking = p.booking_expectation(worker_id)
        actor_version, actor_seq = p.actor_expectation(actor_id)
        loop = asyncio.get_running_loop()
        hold = Hold(worker_id, placement.booked.cpu_millis, placement.booked.memory_mib, loop.create_future())
        self._hold(hold)
        before = self._chain.get(worker_id)
        self._chain[worker_id] = hold
        try:
            if before is not None:  # our own earlier booking of this worker goes first
                await asyncio.shield(before.done)
                known = before.written or before.expected
                if known is not None and known[1] > booking[1]:
                    booking = known
            hold.expected = booking
            store, executor = self.store, self._executor
            if self._stopping or store is None or executor is None:
                raise unavailable("this scheduler replica is stopping; try again")
            at = now()
            booked = WorkerBooked(at=at, worker_id=worker_id, actor_id=actor_id, request_id=request_id)
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
                request_id=request_id,
            )
            booking_id, placed_id = f"booking.{worker_id}", f"actor.{actor_id}"
            stored = [
                store.stored_event(booking_id, booking[0] + 1, booked),
                store.stored_event(placed_id, actor_version + 1, placed),
            ]
            append = partial(
                store.recorder.insert_events, stored, expected_last_seqs={booking_id: booking[1], placed_id: actor_seq}
            )
            seqs = await loop.run_in_executor(executor, append)
            hold.written = (booking[0] + 1, seqs[0])
            hold.placed_seq = seqs[-1]
            self._unfolded_actors[actor_id] = seqs[-1]
            return seqs[-1]
        finally:
            if not hold.done.done():
                hold.done.set_result(None)
            if not hold.placed_seq or self.fold.applied >= hold.placed_seq:
                self._unhold(hold)
            else:
                heapq.heappush(self._unfolded, (hold.placed_seq, next(self._tie), hold))

    def _hold(self, hold: Hold) -> None:
        cpu, mem = self._pending.get(hold.worker_id, (0, 0))
        self._pending[hold.worker_id] = (cpu + hold.cpu, mem + hold.mem)

    def _unhold(self, hold: Hold) -> None:
        if hold.released:
            return
        hold.released = True
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
        unfolded = self._unfolded
        while unfolded and unfolded[0][0] <= seq:
            self._unhold(heapq.heappop(unfolded)[2])

    async def _catch_up(self, placement: Placement) -> None:
        """After a lost race: wait until the fold has what the two subjects hold now."""
        js = self.nc.jetstream()
        last = 0
        for subject in (f"{self.prefix}.ev.booking.{placement.worker_id}", f"{self.prefix}.ev.actor.{placement.actor_id}"):
            with suppress(Exception):  # no message yet on the subject
                last = max(last, (await js.get_msg(self.stream, subject=subject, direct=True)).seq)
        await self.fold.wait(last, self.catch_up_s)

    async def _recorded(self, seq: int) -> Assignment:
        """The assignment an earlier request recorded at `seq` (a retry after a lost reply)."""
        msg = await self.nc.jetstream().get_msg(self.stream, seq=seq, direct=True)
        placed = decoder(ActorPlaced).decode(msg.data)
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
            for role, counts in (("default", index.live_default), ("restorable", index.live_restorable)):
                for compat, n in counts.items():
                    labels = (name, runtime_label(compat.key), role)
                    WORKERS.labels(*labels).set(n)
                    seen.add(labels)
            STRANDED.labels(name).set(index.stranded())
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

