"""How the scheduler talks: the `warmboot-scheduler` endpoints, its life cycle and its metrics.

What it decides is in `services.scheduler.decide` (and `whatif`); what it knows, in
`services.scheduler.projection`; how the projection is kept current, in
`services.scheduler.fold`; how placements are committed, in
`services.scheduler.committer`. `SchedulerService` answers `resume`, `explain`,
`fragmentation`, `whatif` and `runtimes` (a project addition) as the nats.micro service `warmboot-scheduler` in its
queue group, so any number of replicas serve. A resume waits for `min_seq`, is
answered from the log if its request id already placed the actor, else is submitted
to the committer; one that loses a commit race is decided again on fresh state, at
most `commit_attempts` times, then answers UNAVAILABLE.

A replica whose event stream is deleted and made again while it runs holds a projection
of a log that is gone: its fold gives up (`Fold.give_up`, within about 2 s of the
deletion), and the replica stops serving: one error line, every request UNAVAILABLE,
and `failed` done with the reason, which ends `warmboot serve` with exit status 1
(`warmboot.runner.until_stopped`). Started again, it folds the new stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from contextlib import suppress
from typing import Any, Callable, TypeVar

import msgspec
from eventsourcing.persistence import IntegrityError, OperationalError
from nats.aio.client import Client as NATS
from prometheus_client import Counter, Gauge, Histogram

from events.aggregate import WireApplication
from events.codec import decode_event, decoder
from events.errors import ContractError, UnreadableHistory, busy_reads, unavailable
from events.jetstream.link import links_on
from events.tasks import cancel_and_wait
from events.runtime_id import short_id
from events.schema import (
    ActorPage,
    ActorPlaced,
    ActorsQuery,
    Assignment,
    ErrorCode,
    Explanation,
    ExplainResume,
    FleetRuntimes,
    Fragmentation,
    FragmentationQuery,
    Placement,
    ResumeActor,
    RuntimesQuery,
    WhatIf,
    WhatIfAnswer,
    WorkerBooked,
    WorkerDetail,
    WorkerPage,
    WorkerQuery,
    WorkersQuery,
)
from events.subjects import check_prefix, event_subject, stream_name
from services import deadline
from services.commands import STATE_REFUSALS
from services.endpoints import EndpointSpec, add_endpoints
from services.locks import KeyedLock
from services.process import store_env, stream_replicas
from services.replies import ReplyCache
from services.scheduler.actor_list import actor_page
from services.scheduler.checkpoint import DEFAULT_INTERVAL_S, Checkpoints
from services.scheduler.committer import MAX_GROUP, CONFIRM, RECHECK, Answered, Committer, Job
from services.scheduler.decide import check_retry
from services.scheduler.explain import explain
from services.scheduler.fragmentation import fragmentation
from services.scheduler.fold import Fold
from services.scheduler.projection import Projection
from services.scheduler.records import request_hash
from services.scheduler.runtimes import offered_runtimes
from services.scheduler.whatif import unknown_class, whatif
from services.scheduler.worker_detail import worker_detail
from services.scheduler.worker_list import worker_page
from services.streams import last_seq_on, leaders_stream_info, stored_at

T = TypeVar("T")
log = logging.getLogger("warmboot.scheduler")

SERVICE = "scheduler"
DEFAULT_COMMIT_ATTEMPTS = 8
DEFAULT_CATCH_UP_S = 5.0  # how long a request waits for the fold (min_seq, after a lost race)
GAUGE_INTERVAL_S = 2.0
# What each read's answer holds, past the server's max_payload, and what to ask instead (`EndpointSpec.too_large`,
# said in its RESOURCE_EXHAUSTED before "; or raise the server's max_payload"). A worker's registration may be as
# large as one event (max_payload less 1 KiB), and the answers that spell its runtimes out add to it: on a 1 MB
# server, one class of 33 runtimes of 4 compatible versions each, three actors booked, made `worker` 1,056,485
# bytes, `fragmentation` of that class 1,065,402, `whatif` 1,078,593 and `runtimes` 1,050,206
# (tests/test_answer_size.py)
TOO_LARGE = {
    "worker": "it holds the worker's classes with every runtime and compatible version it registered, the actors "
              "booked on it and the waiting LOCAL images on its node, and no request asks for less of it "
              "(`warmboot worker show` reads the worker from the log instead); register fewer or smaller runtimes "
              "and compatible versions on that worker",
    "fragmentation": "it holds a row per distinct runtime version of each class; ask for one class (sandbox_class), "
                     "or have the workers of the class register fewer or smaller runtimes and compatible versions",
    "fragmentation of a class": "it holds a row per distinct runtime version of the class; have its workers "
                                "register fewer or smaller runtimes and compatible versions",
    "whatif": "it holds a row per distinct runtime version of the class and up to `limit` actors in each list; "
              "ask for fewer actors (limit), or have the workers of the class register fewer or smaller runtimes "
              "and compatible versions",
    "whatif listing at most one actor": "it holds a row per distinct runtime version of the class, which no "
                                        "request narrows; have the workers of the class register fewer or "
                                        "smaller runtimes and compatible versions",
    "runtimes": "it holds every distinct runtime version the registered workers offer, and no request asks for "
                "less of it; have the workers register fewer or smaller runtimes and compatible versions",
    "explain": "it holds a rejection per worker of the class passed over, which no request narrows (a resume's "
               "own answer is one placement, and unaffected)",
    "actors": "ask for a smaller page (limit)",
    "workers": "ask for a smaller page (limit) or for fewer classes (sandbox_classes)",
}
MAX_CONCURRENT_REQUESTS = 4096  # requests handled at once by one replica
# Read-only answers that may wait their turn at once on one replica (`SchedulerService._read`); past it,
# UNAVAILABLE at once: a client retries it later, on this replica or another.
READS_WAITING = 64
# What a resume is refused on the actor's state, which a fold behind the log can show wrongly
# (`SchedulerService._current`): its life (NOT_FOUND, RUNNING, STOPPED), its snapshot against its
# min_fidelity, and the selectors of its life a request may not change (INVALID_ARGUMENT; the
# request's own form is refused at the edge, before any decision).
ACTOR_REFUSALS = STATE_REFUSALS | {ErrorCode.INVALID_ARGUMENT}

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
COMMIT_GROUP = Histogram(
    "warmboot_scheduler_commit_group_placements",
    "Placements per atomic append of the group commit (refused appends included)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 400),
)
WORKERS = Gauge(
    "warmboot_scheduler_workers", "Registered, undrained workers per sandbox class and runtime version",
    ["sandbox_class", "runtime", "runtime_id", "role"],
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
FOLD_REFILLS = Counter(
    "warmboot_scheduler_fold_refills",
    "Times the fold met a message past the next one and had its consumer made again from the first one "
    "missed (messages nats-py dropped, or the stream no longer has)",
)
FOLD_CPU = Counter(
    "warmboot_scheduler_fold_cpu_seconds",
    "Thread CPU this replica spent reading the event log's messages and folding them (not the wake-ups "
    "that brought them)",
)


def runtime_label(key: tuple) -> str:
    """A runtime version as a metric label: `v1 architecture=amd64,...`, shortened if long."""
    _, schema_version, attrs = key
    text = f"{schema_version} " + ",".join(f"{k}={v}" for k, v in attrs)
    if len(text) > 120:
        text = text[:100] + "~" + hashlib.blake2b(text.encode(), digest_size=6).hexdigest()
    return text



def assignment_of(placed: Placement | ActorPlaced, seq: int) -> Assignment:
    """The Assignment a resume answers for a placement (decided, or as its event recorded it)."""
    return Assignment(**{f: getattr(placed, f) for f in Placement.__struct_fields__}, seq=seq)


class SchedulerService:
    """`warmboot-scheduler`: resume, explain, fragmentation, whatif (CONTRACT section 3, Scheduler), and
    runtimes (docs/contract.md, Additions)."""

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
        self.env = env if env is not None else store_env(nats_url, prefix, store_replicas or stream_replicas())
        self.metrics = metrics
        self.commit_attempts = commit_attempts
        self.catch_up_s = catch_up_s
        self.fold = Fold(nc, prefix, Projection(), on_cpu=FOLD_CPU.inc if metrics else None,
                         on_refill=FOLD_REFILLS.inc if metrics else None)
        self.committer = Committer(self.fold, self._last_seq, catch_up_s=catch_up_s, max_group=max_group,
                                   on_evicted=self._evicted, on_append=COMMIT_GROUP.observe if metrics else None)
        self.fold.projection.placed_listener = self.committer.placed
        # Projection checkpoints (services.scheduler.checkpoint): start from the newest, save every
        # `checkpoint_every` events or `checkpoint_interval_s` seconds; None or 0: always replay the log.
        self.checkpoints = (
            Checkpoints(nc, prefix, every_events=checkpoint_every, interval_s=checkpoint_interval_s)
            if checkpoint_every else None
        )
        # One read-only answer computed at a time (`_read`): each is a pass over the fold, on the loop.
        self._reads = asyncio.Lock()
        self._reads_waiting = 0
        self.replies = ReplyCache(nc, prefix)
        self.store: WireApplication | None = None
        self.service: Any = None
        self.commits = 0  # placements committed
        self.conflicts = 0  # placements whose commit lost a race (each is decided again)
        self._actors = KeyedLock()  # one resume of an actor at a time in this replica
        self._gauges: asyncio.Task[None] | None = None
        self._gauge_labels: set[tuple[str, ...]] = set()
        self._stopping = False
        # Done, with the reason, once this replica cannot serve any more (its fold gave up: the stream
        # was made again); whoever runs it then stops it (`warmboot.runner.until_stopped`). Made by start().
        self.failed: asyncio.Future[str] | None = None
        self.fold.on_stale.append(self._stale)

    @property
    def projection(self) -> Projection:
        return self.fold.projection

    # --- life cycle ---

    async def start(self) -> "SchedulerService":
        self.failed = asyncio.get_running_loop().create_future()
        # The store's link runs on this loop: the committer's appends are awaited here, not
        # handed to a thread (`events.jetstream.link.links_on`); this store is used for nothing else.
        with links_on(asyncio.get_running_loop()):
            self.store = await asyncio.to_thread(WireApplication, self.env)  # creates the stream if need be
        if self.checkpoints is not None:
            restored = await (await self.checkpoints.open()).load()
            if restored is not None:  # the fold goes on from its position
                restored.placed_listener = self.committer.placed
                self.fold.projection = restored
        await self.fold.start(max(self.catch_up_s, 60.0))
        if self.checkpoints is not None:
            self.checkpoints.follow(self.fold)
        await self.replies.start()
        self.committer.start(self.store)
        # Resumes wait for a group commit and explains for the fold: many run at once.
        self.service = await add_endpoints(
            self.nc,
            self.prefix,
            SERVICE,
            "warmboot scheduler: places resumes where their snapshot can load, or falls back",
            [
                EndpointSpec("resume", ResumeActor, self.resume),
                EndpointSpec("explain", ExplainResume, self.explain, too_large=TOO_LARGE["explain"]),
                EndpointSpec("fragmentation", FragmentationQuery, self.fragmentation, per_entity=False,
                             too_large=lambda query: TOO_LARGE["fragmentation" if query.sandbox_class is None
                                                               else "fragmentation of a class"]),
                EndpointSpec("whatif", WhatIf, self.whatif, per_entity=False,
                             too_large=lambda query: TOO_LARGE["whatif" if query.limit > 1
                                                               else "whatif listing at most one actor"]),
                EndpointSpec("runtimes", RuntimesQuery, self.runtimes, per_entity=False,
                             too_large=TOO_LARGE["runtimes"]),
                EndpointSpec("worker", WorkerQuery, self.worker, too_large=TOO_LARGE["worker"]),
                EndpointSpec("actors", ActorsQuery, self.actors, per_entity=False, too_large=TOO_LARGE["actors"]),
                EndpointSpec("workers", WorkersQuery, self.workers, per_entity=False,
                             too_large=TOO_LARGE["workers"]),
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
        gauges, self._gauges = self._gauges, None
        await cancel_and_wait(gauges)
        await self.committer.stop()
        if self.checkpoints is not None:
            await self.checkpoints.close()
        await self.fold.stop()
        if self.store is not None:
            store, self.store = self.store, None
            await asyncio.to_thread(store.close)

    async def _last_seq(self) -> int:
        return self.fold.check_stream(await leaders_stream_info(self.nc.jetstream(), self.stream))

    def _stale(self, why: str) -> None:
        """The fold gave up: its projection is of another incarnation of the stream. Serve nothing more."""
        log.error("%s: stopping; start the replica again to fold the new stream", why)
        self._stopping = True
        if self.failed is not None and not self.failed.done():
            self.failed.set_result(why)

    # --- endpoints ---

    async def resume(self, actor_id: str, request: ResumeActor) -> Assignment:
        """Idempotency is decided where the write happens. A request id is answered from the
        log: by the actor's recent placements of this life (`Actor.placed_by`), checked here
        and again by the committer right before it decides, and by any placement carrying
        the id that the fold meets while the job waits, so a retry, or a stale attempt that
        a stalled committer decides late, never places twice. For an id a placement of this
        life may have pushed out of that memory (`Actor.may_have_pushed_out`), the shared reply
        cache answers (written before the placement that pushes one out is appended); a new id
        costs no read of it, however often the actor was placed. If the committer finds the id
        may have been pushed out after these checks (the fold moved on meanwhile), the job
        comes back (`RECHECK`) and is checked again. An answer from the log is given only once
        this replica's fold has the actor's history as the stream leader has it (`_current`):
        a replica behind a stop and a new creation does not answer a request id of the actor's
        last life. Nor one its worker no longer carries out (`_still_answerable`).

        A placement that would discard the actor's memory image, no compatible worker having room
        (NO_COMPATIBLE_WORKER), is made only on a fold that has caught up with the stream's end
        since the resume came (`CONFIRM`): a worker another process registered, or room it freed, a
        moment ago is seen before the image is given up for good. So is a refusal for want of a
        worker on the node of a LOCAL image (`NoWorkerOnNode`), which points at revert.
        """
        due = deadline.deadline()  # its caller's wait, if it said one: the committer decides it in time or not at all
        await self.fold.wait(request.min_seq, self.catch_up_s)
        # a life named is one whose sequence a reply gave: decided on a fold that has it, and one past the
        # end of the log names no life at all (a typing error would fence nothing until the log got there)
        await self.fold.wait(request.life_seq, self.catch_up_s, "life_seq")
        rid = request.request_id
        confirmed = False  # whether the fold has caught up with the stream's end since it came (`CONFIRM`)
        came = self.fold.asked  # a question about the stream's end asked after this answers for it
        races = 0  # of its decisions, those whose commit lost a race (the others were checked again)
        async with self._actors(actor_id):
            for _ in range(self.commit_attempts):
                if self._stopping:
                    raise unavailable("this scheduler replica is stopping; try again")
                unfolded = self.committer.unfolded(actor_id)
                if unfolded is not None:  # our own last placement of it: decide on state that has it
                    await self.fold.wait(unfolded, self.catch_up_s)
                job = Job(actor_id, request.selectors, rid, asyncio.get_running_loop().create_future(), due,
                          request.life_seq)
                job.confirmed = confirmed
                seq = 0
                actor = self.projection.actors.get(actor_id)
                # What this replica's fold has of the actor now: an answer taken from here on is taken on
                # this much of its history, or more (the fold only moves forward). The committer notes
                # what it answered or refused on exactly (`job.seen`).
                seen = self.projection.actor_seq(actor_id)
                if job.request is not None:
                    if actor is not None:
                        job.checked = actor.placements  # what the checks below cover (the committer's RECHECK)
                        seq = actor.placed_by(job.request)
                        if not seq and actor.may_have_pushed_out(job.request):
                            seq = await self._cached(actor_id, job.request)
                        if seq and not self.projection.answerable(actor_id, seq):
                            seq = 0  # before a message this fold cannot read: the committer's decision refuses
                if not seq:
                    try:
                        result = await self.committer.submit(job)
                        seen = job.seen if job.seen is not None else seen
                    except IntegrityError as error:
                        races += 1
                        self.conflicts += 1
                        if self.metrics:
                            COMMIT_CONFLICTS.inc()
                        log.debug("placement of %s lost a race: %s", actor_id, error)
                        await self._catch_up(actor_id)
                        continue
                    except OperationalError as error:
                        raise unavailable(f"the event store did not take the placement: {error}") from None
                    except ContractError as refusal:
                        # A refusal on the actor's state (RUNNING, STOPPED, not found, ...) may come from a fold
                        # behind the log, as after a failover while its consumer starts again: answered
                        # once the stream leader has nothing past what it was decided on (`_current`, one
                        # read), decided again otherwise, as the registry and the snapshotter do
                        # (`run_command_async`).
                        if job.seen is not None:
                            seen = job.seen
                        if (refusal.code in ACTOR_REFUSALS or isinstance(refusal, UnreadableHistory)) and \
                                not await self._current(actor_id, seen):
                            log.info("refused on a fold behind the log (%s: %s); deciding again",
                                     refusal.code.value, refusal.message)
                            continue
                        if refusal.code is ErrorCode.RESOURCE_EXHAUSTED and rid is not None and \
                                not await self._current_since(actor_id, seen, came):
                            log.info("refused for room on a fold behind the actor's history; deciding again")
                            continue
                        raise
                    if result is RECHECK:  # its id may have been pushed out meanwhile: check again
                        continue
                    if result is CONFIRM:  # it would give its memory image up: on a current fold only
                        await self.fold.current(self.catch_up_s, came)
                        confirmed = True
                        continue
                    if isinstance(result, Answered):
                        seq = result.seq
                if seq:  # the log answers the request id; from this life, as the stream leader has it
                    if not await self._current(actor_id, seen):
                        continue
                    answer = await self._recorded(actor_id, job.request, seq)
                    await self._still_answerable(answer, seq, rid)
                    return answer
                placement, seq = result
                self.commits += 1
                if self.metrics:
                    self._count(placement)
                return assignment_of(placement, seq)
        raise unavailable(
            f"placing actor {actor_id} was decided {self.commit_attempts} times in a row without an answer ({races} "
            "lost a concurrent-commit race, the others were checked again on a fresher fold); try again"
        )

    async def _read(self, min_seq: int, answer: Callable[[], T]) -> T:
        """A read-only answer: `answer()` on the fold caught up with `min_seq`, one at a time on this replica.

        Each is a pass over the fold, tens of ms at 100,000 actors, on the loop that places resumes. A
        burst of them all ready at once (up to `MAX_CONCURRENT_REQUESTS` of each endpoint) ran one after
        another before a resume that came meanwhile took its next step: a client's burst held placements
        for seconds. Now they take turns (an asyncio lock, first come first served), and each holds the
        turn until the loop has gone round once after its pass: what became ready meanwhile, a
        resume's next step or the socket's next bytes, goes before the next answer's pass. A resume
        waits at most one pass at each of its steps. At most `READS_WAITING` wait their turn: one more
        is UNAVAILABLE at once, rather than answered after the others' passes (a burst of 4,096 pages of
        50 ms each is over 3 minutes), long after its client gave up."""
        await self.fold.wait(min_seq, self.catch_up_s)
        if self._reads_waiting >= READS_WAITING:
            raise busy_reads(READS_WAITING)
        self._reads_waiting += 1
        try:
            await self._reads.acquire()
        finally:
            self._reads_waiting -= 1
        try:
            made = answer()
            await asyncio.sleep(0)  # the loop's next turn, the turn still held
            return made
        finally:
            self._reads.release()

    async def explain(self, actor_id: str, request: ExplainResume) -> Explanation:
        return await self._read(request.min_seq, lambda: explain(
            self.projection, actor_id, request.selectors, self.projection.seq, self.committer.pending))

    async def whatif(self, _: str | None, request: WhatIf) -> WhatIfAnswer:
        return await self._read(request.min_seq, lambda: whatif(self.projection, request))

    async def fragmentation(self, _: str | None, request: FragmentationQuery) -> Fragmentation:
        answer = await self._read(request.min_seq, lambda: fragmentation(self.projection, request.sandbox_class))
        if request.sandbox_class is not None and not answer.classes:
            # nothing of the class in the fold (no worker registered it, and no actor of it holds a memory
            # snapshot): NOT_FOUND, as whatif says it, not an empty answer a typo's caller reads as a class
            # with nothing in it; the class names are not given (a client's credentials may not read them)
            raise unknown_class(request.sandbox_class, None)
        return answer

    async def runtimes(self, _: str | None, request: RuntimesQuery) -> FleetRuntimes:
        """The runtimes the registered workers offer, for the views' labels (`runtimes.offered_runtimes`)."""
        return await self._read(request.min_seq, lambda: offered_runtimes(self.projection))

    async def worker(self, worker_id: str, request: WorkerQuery) -> WorkerDetail:
        """One worker as this replica's fold has it, for `warmboot worker show` (`worker_detail.worker_detail`:
        a pass over the actors, as explain's over the workers); NOT_FOUND when the fold has no such worker."""
        return await self._read(request.min_seq, lambda: worker_detail(self.projection, worker_id))

    async def actors(self, _: str | None, request: ActorsQuery) -> ActorPage:
        """A page of the fold's actors, as `actor list` shows them (`actor_list.actor_page`; a project
        addition, docs/contract.md); writes nothing."""
        return await self._read(request.min_seq, lambda: actor_page(self.projection, request))

    async def workers(self, _: str | None, request: WorkersQuery) -> WorkerPage:
        """A page of the fold's registered workers, as `warmboot workers` shows them (`worker_list.worker_page`;
        a project addition, docs/contract.md); writes nothing."""
        return await self._read(request.min_seq, lambda: worker_page(self.projection, request))

    # --- answers from the log ---

    @staticmethod
    def _cache_key(actor_id: str, request: int) -> str:
        return f"resume.{actor_id}.{request:016x}"

    async def _evicted(self, actor_id: str, request: int, seq: int) -> None:
        """An older placement of the actor is about to leave its recent ones: keep where it is in
        the reply cache first (the committer appends the placement that evicts it only then)."""
        await self.replies.put(self._cache_key(actor_id, request), str(seq).encode())

    async def _cached(self, actor_id: str, request: int) -> int:
        """The sequence of the ActorPlaced the reply cache has for a request id, if it is of the
        actor's current life and the log holds there a placement of the actor carrying that id;
        else 0. The bucket outlives a stream deleted and made again, whose sequences start over:
        an entry of the last one names another event, or none (an audit, 2026-12-04)."""
        data = await self.replies.get(self._cache_key(actor_id, request))
        seq = int(data) if data and data.isdigit() else 0
        if seq <= self.projection.life_started(actor_id):
            return 0
        if await self._placement_of(actor_id, request, seq) is None:
            log.warning("the reply cache names sequence %d for a request of actor %s, where the log holds no "
                        "placement of it carrying that id (a stream made again since?): the request is taken as "
                        "new", seq, actor_id)
            return 0
        return seq

    async def _placement_of(self, actor_id: str, request: int, seq: int) -> ActorPlaced | None:
        """The ActorPlaced stored at `seq` if it is a placement of the actor carrying the request id
        (`request`, its hash); else None."""
        placed = await self._placement_at(seq)
        if placed is None or placed.actor_id != actor_id or placed.request_id is None \
                or request_hash(placed.request_id) != request:
            return None
        return placed

    async def _placement_at(self, seq: int) -> ActorPlaced | None:
        """The ActorPlaced stored at `seq`; None if the log holds another event there, or ends before."""
        js = self.nc.jetstream()
        try:
            return decoder(ActorPlaced).decode((await stored_at(js, self.stream, seq)).data)
        except msgspec.DecodeError:  # another event (a ValidationError is one)
            return None
        except ContractError:  # not readable now, or not there at all: the leader says which
            try:
                last = (await leaders_stream_info(js, self.stream)).state.last_seq
            except Exception:
                last = None
            if last is not None and seq > last:
                return None
            raise

    async def _recorded(self, actor_id: str, request: int, seq: int) -> Assignment:
        """The assignment an earlier request recorded with the ActorPlaced at `seq` (a retry
        after a lost reply); its `seq` is that of the WorkerBooked written with it, right after.
        UNAVAILABLE if the log holds there no placement of the actor carrying the request's id: a
        log that lost the tail this replica folded (a server's crash before it synced) may hold
        another actor's placement there, whose assignment was the answer (an audit, 2026-12-05)."""
        js = self.nc.jetstream()
        placed = await self._placement_of(actor_id, request, seq)
        if placed is None:
            raise unavailable(f"this replica folded a placement of actor {actor_id} carrying the request's id at "
                              f"sequence {seq}, which the log does not hold there (rolled back?); try another replica")
        # the booking marker written in the same atomic batch (none if something else than a
        # scheduler wrote the placement): stored with it, so readable wherever it is
        with suppress(ContractError, msgspec.DecodeError):
            booked = decode_event((await stored_at(js, self.stream, seq + 1)).data)
            if isinstance(booked, WorkerBooked) and booked.actor_id == placed.actor_id:
                seq += 1
        return assignment_of(placed, seq)

    async def _at_leader(self, kind: str, entity: str) -> int:
        """The last sequence of the entity's subject as the stream leader has it."""
        try:
            return await last_seq_on(self.nc.jetstream(), self.stream, event_subject(self.prefix, kind, entity))
        except Exception as error:  # no leader to ask right now: retry later, with the same request id
            raise unavailable(f"the event log's leader did not answer ({type(error).__name__}); try again") from None

    async def _still_answerable(self, answer: Assignment, seq: int, request_id: str | None) -> None:
        """Refuse the answer from the log `answer` (its ActorPlaced at `seq`) unless its worker, as
        it is now, still carries it out (`decide.check_retry`). Decided on a fold that has the
        worker's booking subject as the stream leader has it (every write of the registry fences
        it, `services.registry`), so a retry that reaches a replica behind the worker's change is
        not answered from before it. One read at the leader, made only for an answer from the log."""
        await self.fold.wait(await self._at_leader(WorkerBooked.KIND, answer.worker_id), self.catch_up_s)
        check_retry(self.projection, answer, seq, request_id)

    async def _current(self, actor_id: str, seen: int) -> bool:
        """Whether `seen`, the actor's last sequence in this replica's fold when an answer from the
        log or a refusal on the actor's state was taken, is its history as the stream leader has
        it, so that the answer is of the actor's current life (request ids are scoped to one) and
        the refusal is not one of a fold behind; if not, it waits until the fold has it and says
        False (the request is decided again). One read at the leader, made only for those two.

        Compared with `seen`, not with what the fold has once the leader has answered: the fold
        goes on meanwhile, and a fold that caught up during the read would pass off a refusal
        decided before it (a loaded CI run: NOT_FOUND for an actor just created)."""
        leader = await self._at_leader("actor", actor_id)
        if seen >= leader:  # no history anywhere is current too
            return True
        await self.fold.wait(leader, self.catch_up_s)
        return False

    async def _current_since(self, actor_id: str, seen: int, came: int) -> bool:
        """Whether `seen`, the actor's last sequence in this replica's fold when a resume with a request
        id was refused for want of room, is still all the log had of the actor once the fold has caught
        up with the stream's end as the leader told it after the resume came (`Fold.current`: one
        question shared by every resume asking meanwhile, so a storm of refusals, as in a rolling
        upgrade, costs a question per round trip, not one per refusal); False (decide again) if the
        actor's history moved past it. The request's first attempt may have been placed, in room this
        fold had not seen made, and its answer lost: the retry was told "no room" while the log held
        the actor RUNNING where its caller never started it (found by an audit)."""
        await self.fold.current(self.catch_up_s, came)
        return self.projection.actor_seq(actor_id) <= seen

    async def _catch_up(self, actor_id: str) -> None:
        """After a lost race: wait until the fold has what the actor's subject holds now
        (the worker's side was caught up with by the committer before it gave up)."""
        try:
            msg = await self.nc.jetstream().get_msg(
                self.stream, subject=event_subject(self.prefix, "actor", actor_id), direct=True
            )
        except Exception:  # no message on the subject yet, or the server is busy: decide on what we have
            return
        await self.fold.wait(msg.seq, self.catch_up_s)

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
                    labels = (name, runtime_label(compat.key), short_id(compat.key), role)
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
