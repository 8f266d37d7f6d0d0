"""The committer of one scheduler replica: the ledger of bookings in flight and the group commit.

A resume is `submit`ted as a `Job`; the committer decides it on the freshest fold right
before it appends, in rounds: every resume queued since the last round is decided on
the current projection and all of them are appended as one atomic batch through the
event store's recorder. A file-backed atomic batch costs a few ms whatever its size
(the server stages it in files of its own, and syncs it with every other write before
answering: docs/operations.md, Durability), so grouping is what lets one replica
commit thousands of placements per second (Nomad's plan queue and plan applier do
the same job: one applier, re-checking against the latest state).

Committing a placement (CONTRACT placement rule 8): two events, `ActorPlaced` on
`actor.<actor id>` then `WorkerBooked` on `booking.<worker id>`, each guarded by the
last stream sequence the decision saw for that subject. Another replica that booked
the same worker or wrote on the same actor, or the registry that changed the worker
(its `WorkerFenced` moves the booking subject too), makes the append fail. The order
matters: a fold delivers a batch one message at a time and a decision may run between
two of them; with the placement first, a worker's booking sequence never moves ahead
of the capacity it accounts for, so a decision made in between expects an old
sequence and loses, instead of booking room already taken. If a batch is refused,
the committer folds up to the stream's end, sends the placements whose two subjects
have not moved into the next round unchanged, and fails the others with
IntegrityError: their resumes decide again.

Within a replica nothing races: decisions count the bookings in flight (`pending`,
appended or not, until the fold has them), a round holds at most one placement per
worker, and a placement on a worker this replica booked in an earlier round that is
not folded yet expects the sequence that round wrote.

Idempotency is decided here too, where the write happens: before it decides a job
that carries a request id, the committer looks for a placement carrying that id, in
the actor's recent placements and among those the fold met while the job waited
(`placed`, the projection's listener); it answers that placement (`Answered`)
instead of placing the actor again. If the id may have been pushed out of the recent
placements since the job's caller checked them and the reply cache (a late retry on a
replica that folded the pushing out meanwhile), the job goes back to its caller to be
checked again (`RECHECK`) rather than decided.

A placement that would discard the actor's memory image for want of a compatible worker
with room (NO_COMPATIBLE_WORKER) is not made on a fold that may be behind another
process's registration or release: the job goes back to its caller (`CONFIRM`), which has
the fold catch up with the stream's end and submits it again. So is a refusal for want of
a worker on a LOCAL image's node (`NoWorkerOnNode`), whose message points at revert.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from contextlib import asynccontextmanager
from types import MappingProxyType
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import msgspec
from eventsourcing.persistence import IntegrityError

from events.aggregate import WireApplication, now
from events.errors import ContractError, NoWorkerOnNode, created_anew_since, from_an_earlier_life, unavailable
from events.schema import ActorPlaced, FallbackReason, Placement, WorkerBooked
from events.tasks import cancel_and_wait
from services import deadline
from services.scheduler.decide import decide
from services.scheduler.fold import Fold
from services.scheduler.records import oldest_placement, request_hash

log = logging.getLogger("warmboot.scheduler")

MAX_GROUP = 400  # placements per append: 800 messages, under the server's 1,000 per atomic batch


def placed_event(placement: Placement, request_id: str | None) -> ActorPlaced:
    """The ActorPlaced that records `placement` (the one conversion of a decision into its event)."""
    return ActorPlaced(at=now(), request_id=request_id, **msgspec.structs.asdict(placement))


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

    __slots__ = ("actor_id", "selectors", "request_id", "request", "result", "checked", "seen", "confirmed", "deadline",
                 "life_seq")

    def __init__(self, actor_id: str, selectors: Any, request_id: str | None, result: asyncio.Future[Any],
                 deadline: tuple[int, int, int] | None = None, life_seq: int | None = None):
        self.actor_id = actor_id
        self.selectors = selectors
        self.request_id = request_id
        self.request = request_hash(request_id) if request_id is not None else None
        self.result = result  # (Placement, seq), Answered, RECHECK, CONFIRM, or the error
        # the actor's recent placements (and filter of those pushed out) its request id was
        # checked against, the reply cache included where the filter said so (SchedulerService.resume)
        self.checked: bytes | None = None
        # the actor's last sequence in the fold when the committer answered or refused it: what
        # the answer or the refusal was taken on (SchedulerService._current checks it at the leader)
        self.seen: int | None = None
        # whether its caller has had the fold catch up with the stream's end since the resume came
        # (`CONFIRM`): only then may it be placed discarding a memory image for want of room
        self.confirmed = False
        # its request's deadline (`services.deadline.deadline()`): decided past it, it is refused instead
        self.deadline = deadline
        # the sequence of the actor's life its request names (`ResumeActor.life_seq`): refused if the
        # actor was created anew after it
        self.life_seq = life_seq

    @property
    def key(self) -> tuple[str, int] | None:
        return (self.actor_id, self.request) if self.request is not None else None


class Answered:
    """A job whose request the log already answers: its placement is the ActorPlaced at `seq`."""

    __slots__ = ("seq",)

    def __init__(self, seq: int):
        self.seq = seq


# A job's outcome when its request id may have been pushed out of the actor's recent placements
# after its caller checked them (and the reply cache): its caller checks again, then resubmits.
RECHECK = object()

# A job's outcome when it would be placed discarding its memory image, no compatible worker having
# room (`FallbackReason.NO_COMPATIBLE_WORKER`), or refused for want of a worker on its image's node
# (`NoWorkerOnNode`), on a fold not yet confirmed current: a registration or a release another
# process wrote a moment ago may give a compatible worker room. The image is lost for good once the
# fallback is written (or the caller reverts), so its caller has the fold catch up with the
# stream's end (`Fold.current`) and resubmits it, `confirmed`; it is decided again there.
CONFIRM = object()


class _LatePlacement(Exception):
    """A group's append not sent again: one of its placements' callers has gone (`Committer.append`)."""

    as_is = True  # raised by `Stream.append` as it is, also when an earlier attempt may have been stored


class Commit:
    """A decided placement waiting for the group commit."""

    __slots__ = ("placement", "request_id", "hold", "booking", "actor", "after", "result", "evicts", "deadline")

    def __init__(
        self,
        placement: Placement,
        request_id: str | None,
        hold: Hold,
        booking: tuple[int, int],
        actor: tuple[int, int],
        after: Hold | None,
        result: asyncio.Future[Any],
        evicts: tuple[int, int] | None = None,
        deadline: tuple[int, int, int] | None = None,
    ):
        self.placement = placement
        self.request_id = request_id
        self.hold = hold
        self.booking = booking  # (version, seq) of booking.<worker> the decision saw
        self.actor = actor  # (version, seq) of actor.<id> the decision saw
        self.after = after  # this replica's previous booking of the same worker, if unfolded then
        self.result = result  # (Placement, sequence of its WorkerBooked), or the error
        self.evicts = evicts  # (request hash, seq) this placement pushes out of the actor's recent ones
        # its request's deadline (`Job.deadline`): kept for another append after a refused group
        # (`Committer._sort_out`), it is refused instead once that is past
        self.deadline = deadline


class Committer:
    """Decides and appends the resumes submitted to it, in groups (see the module docstring)."""

    def __init__(self, fold: Fold, last_seq: Callable[[], Awaitable[int]], *, catch_up_s: float,
                 max_group: int = MAX_GROUP, on_evicted: Callable[[str, int, int], Awaitable[None]] | None = None,
                 on_append: Callable[[int], None] | None = None):
        self.fold = fold
        self.on_append = on_append  # called with the placements of each append made, taken or refused
        # awaited with (actor id, request hash, seq) before a placement that pushes an older one out
        # of the actor's recent placements is appended: the service keeps the older one where a late
        # retry still finds it. If it raises, that placement fails with its error (and is not written).
        self.on_evicted = on_evicted
        self.last_seq = last_seq  # the stream's last sequence now (to catch up after a refused group)
        self.catch_up_s = catch_up_s
        self.max_group = max(1, min(max_group, MAX_GROUP))
        self._group_limit = self.max_group  # halved after a refused append, doubled after a taken one
        self.store: WireApplication | None = None
        self.groups = 0  # appends made (a group of placements each)
        self._pending: dict[str, tuple[int, int]] = {}  # worker id -> in-flight (cpu, mem), for decide
        self.pending: Mapping[str, tuple[int, int]] = MappingProxyType(self._pending)
        self._refusals: dict = {}  # refusals decide remembers, with the versions they depend on
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
        # ends the loop also when a request's time-out swallowed stop()'s cancellation (Python
        # 3.11's asyncio.wait_for, inside every nats-py request and Fold.wait, can)
        self._stopping = False
        self._may_commit = asyncio.Event()  # cleared while `commits_held`
        self._may_commit.set()
        self._arrival: asyncio.Future[None] | None = None  # `until_queued` waits on it
        self._task: asyncio.Task[None] | None = None
        self._tie = itertools.count()
        self._confirmed: tuple[int, int] | None = None  # the store's session the fold's log was confirmed in
        fold.listeners.append(self._folded)
        fold.on_stale.append(self._fold_gave_up)

    @property
    def projection(self):
        return self.fold.projection

    def start(self, store: WireApplication) -> None:
        self.store = store
        self._task = asyncio.create_task(self._commit_groups(), name="scheduler-committer")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._may_commit.set()
        task, self._task = self._task, None
        await cancel_and_wait(task)
        self._fail_queued(unavailable("this scheduler replica is stopping; try again"))

    def _fold_gave_up(self, why: str) -> None:
        """The fold gave up (its stream is another incarnation than the projection's): nothing more is
        decided on the projection; what waits fails (an append in flight, decided before, ends as it ends)."""
        self._stopping = True
        self._wake.set()
        self._may_commit.set()
        self._fail_queued(self.fold.stale_error())

    def _fail_queued(self, error: BaseException) -> None:
        self._fail(self._ready, error)
        for job in self._jobs:
            if not job.result.done():
                job.result.set_exception(error)
        self._jobs, self._ready = [], []

    @property
    def settled(self) -> bool:
        """Nothing in flight: no booking counted as pending, none appended and not folded yet."""
        return not (self._pending or self._chain or self._unfolded or self._unfolded_actors or self._jobs
                    or self._ready)

    def unfolded(self, actor_id: str) -> int | None:
        """The sequence of this replica's placement of the actor that the fold has not reached yet."""
        return self._unfolded_actors.get(actor_id)

    async def submit(self, job: "Job") -> Any:
        """Queue `job` and wait for its outcome: (Placement, seq), `Answered`, or the error raised
        (IntegrityError: it lost a race, decide again on fresh state)."""
        if self.fold.stale is not None:
            raise self.fold.stale_error()
        key = job.key
        if key is not None:
            self._awaiting[key] = self._awaiting.get(key, 0) + 1
        self._jobs.append(job)
        self._wake.set()
        if self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(None)
        try:
            return await asyncio.shield(job.result)
        finally:
            if key is not None:
                self._forget(key)

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

    def placed(self, actor_id: str, request: int, seq: int) -> None:
        """The fold met a placement carrying a request id: a job of that request still waiting
        here is answered by it, whichever replica wrote it (listener of the projection)."""
        key = (actor_id, request)
        if key in self._awaiting:
            self._answered[key] = seq

    def _forget(self, key: tuple[str, int]) -> None:
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
        as for hundreds (the server stages and syncs each batch before it answers), so every
        resume that arrived while one append was in flight shares the next. A group holds
        at most one placement per worker (the OCC guard is per subject); a resume that
        lands on a worker already in the group is decided again in the next one, which
        then expects the booking sequence this group wrote.
        """
        while not self._stopping:
            await self._wake.wait()
            await self._may_commit.wait()
            self._wake.clear()
            while (self._ready or self._jobs) and not self._stopping:
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
                    actor = p.actors.get(job.actor_id)
                    job.seen = p.actor_seq(job.actor_id)
                    answered = self._answered_by_log(job, actor)
                    if answered:  # its request was placed meanwhile (a retry, another replica)
                        job.result.set_result(Answered(answered) if answered is not RECHECK else RECHECK)
                        continue
                    late = deadline.passed(job.deadline, "the placement")
                    if late is not None:  # held past its caller's wait: decided now, it could place a next life
                        job.result.set_exception(late)
                        continue
                    if self._placed_in_an_earlier_life(job, actor):  # a late copy of the last life's resume
                        job.result.set_exception(from_an_earlier_life("actor", job.actor_id, "resume",
                                                                      job.request_id or ""))
                        continue
                    if job.life_seq is not None and job.life_seq < p.life_started(job.actor_id):
                        # a copy of a resume of an earlier life, decided late
                        job.result.set_exception(created_anew_since(job.actor_id, job.life_seq,
                                                                    p.life_started(job.actor_id)))
                        continue
                    try:
                        placement = decide(p, job.actor_id, job.selectors, p.seq, self.pending, self._refusals)
                    except NoWorkerOnNode as error:  # it points at revert, which gives the image up: as below
                        if job.confirmed:
                            job.result.set_exception(error)
                        else:
                            job.result.set_result(CONFIRM)
                        continue
                    except ContractError as error:
                        job.result.set_exception(error)
                        continue
                    except Exception as error:  # a bug: this request fails, the committer goes on
                        log.exception("deciding the placement of %s failed", job.actor_id)
                        job.result.set_exception(error)
                        continue
                    if not job.confirmed and placement.fallback is not None \
                            and placement.fallback.reason is FallbackReason.NO_COMPATIBLE_WORKER:
                        job.result.set_result(CONFIRM)
                        continue
                    worker_id = placement.worker_id
                    if worker_id in workers:
                        deferred.append(job)
                        continue
                    workers.add(worker_id)
                    group.append(self.prepare(placement, job))
                self._jobs[:0] = deferred
                if not group:
                    continue
                try:
                    await self.append(group)
                except asyncio.CancelledError:
                    self._fail(group, unavailable("this scheduler replica is stopping; try again"))
                    raise
                except Exception as error:  # the store failed: every placement of the group fails with it
                    log.warning("appending %d placements failed: %s", len(group), error)
                    self._fail(group, error)

    def _in_time(self, items: list[Commit]) -> list[Commit]:
        """`items`, about to be appended, without those whose request's deadline has passed since they
        were decided, which fail with its refusal: a request held past its caller's wait writes nothing
        (docs/contract.md), though it was decided in time. The time goes in the awaits between the
        decision and the append (the reply cache keeping an evicted answer, the log's continuity
        confirmed), and, for a placement kept from a refused group (`_sort_out`), in the refusal and the
        fold's catching up before its second append."""
        kept = []
        for item in items:
            late = deadline.passed(item.deadline, "the placement")
            if late is None:
                kept.append(item)
            else:
                self._fail([item], late)
        return kept

    def _answered_by_log(self, job: Job, actor: Any) -> Any:
        """The ActorPlaced that already carries the job's request id, if the fold has met one
        (`actor`: the job's actor in the projection, or None); RECHECK if the id may have been
        pushed out of the actor's recent placements since the job's caller checked them (only
        the reply cache would know it then); else 0."""
        if job.request is None:
            return 0
        found = self._answered.get(job.key, 0)
        if found and found <= self.projection.life_started(job.actor_id):
            found = 0  # of a life before the actor's current one: request ids are scoped to one life
        found = found or (actor.placed_by(job.request) if actor is not None else 0)
        if found:
            # not one from before a message of the actor's history this fold cannot read (it may have
            # begun the next life): then the decision refuses the actor (`decide.resolve`)
            return found if self.projection.answerable(job.actor_id, found) else 0
        if actor is not None and actor.placements != job.checked and actor.may_have_pushed_out(job.request):
            return RECHECK
        return 0

    def _placed_in_an_earlier_life(self, job: Job, actor: Any) -> int:
        """The sequence of a placement of an earlier life of the job's actor that carried its request
        id, as this replica answered it or among the last life's recent ones (`Actor.placed_earlier`);
        else 0. A copy of such a resume, held in a NATS server's buffers while its retry was answered
        and delivered once the actor was stopped and created anew, placed the new life too (a
        failover test): it is refused, as the snapshotter's verbs refuse their ids of an earlier life."""
        if job.request is None:
            return 0
        found = self._answered.get(job.key, 0)
        if found and found <= self.projection.life_started(job.actor_id):
            return found
        return actor.placed_earlier(job.request) if actor is not None else 0

    def prepare(self, placement: Placement, job: "Job") -> Commit:
        """A decided placement: its booking counts as in flight from now on, and it carries
        the expectations of the state it was decided on."""
        p = self.projection
        worker_id = placement.worker_id
        hold = Hold(worker_id, placement.actor_id, placement.booked.cpu_millis, placement.booked.memory_mib)
        self._hold(hold)
        after = self._chain.get(worker_id)
        self._chain[worker_id] = hold
        actor = p.actors.get(placement.actor_id)
        evicts = oldest_placement(actor.placements) if actor is not None and job.request is not None else None
        return Commit(
            placement, job.request_id, hold, p.booking_expectation(worker_id), p.actor_expectation(placement.actor_id),
            after, job.result, evicts, job.deadline,
        )

    async def append(self, group: list[Commit]) -> None:
        """One atomic append of the group's placements (each with its booking marker), guarded
        by the expectations each was prepared with; on a refusal, `_sort_out`. The placements
        that push an older one out of their actor's recent ones are appended only once
        `on_evicted` has kept the older one (a crash in between loses no answer)."""
        group = await self._keep_evicted(group)
        if not group:
            return
        await self._confirm_log()
        # what is appended now is written now: not for a request whose caller's wait has passed meanwhile
        group = self._in_time(group)
        if not group:
            return
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
            booked = WorkerBooked(at=now(), worker_id=worker_id, actor_id=actor_id, request_id=item.request_id)
            placed = placed_event(placement, item.request_id)
            booking_id, placed_id = f"booking.{worker_id}", f"actor.{actor_id}"
            # ActorPlaced first: a fold that has read only part of the batch has then counted
            # the booking before the booking subject's sequence moves, never the reverse.
            stored.append(store.stored_event(placed_id, item.actor[0] + 1, placed))
            stored.append(store.stored_event(booking_id, booking[0] + 1, booked))
            expected[booking_id] = booking[1]
            expected[placed_id] = item.actor[1]
        self.groups += 1
        if self.on_append is not None:
            self.on_append(len(group))
        def member_late() -> BaseException | None:  # asked before each attempt that would be a first write
            return _LatePlacement() if any(deadline.passed(item.deadline, "the placement") is not None
                                           for item in group) else None

        try:
            seqs = await store.recorder.insert_events_async(stored, expected_last_seqs=expected, late=member_late)
        except IntegrityError as error:
            await self._sort_out(group, error)
            return
        except _LatePlacement as error:
            if getattr(error, "maybe_stored", False):
                # sent to a leader that did not answer, not found where it would have landed, and not sent
                # again (a first write, for a caller gone): it may still be stored, as any unanswered append
                self._fail(group, unavailable(
                    "a placement's caller has gone while the group's append went unanswered: not sent again; "
                    "it may still be stored (ask again with the same request id)"))
                return
            # Nobody took the group (a stream without a leader, an election) until a caller's wait had
            # passed: nothing of it can have been stored (`Stream.append`), and a placement sent now would
            # be a first write of a resume whose caller has gone. Those are refused, the others appended.
            kept = self._in_time(group)
            if kept:
                await self.append(kept)
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

    async def _confirm_log(self) -> None:
        """Append nothing in a session of the store's connection (`Link.session`) until the fold's log
        is confirmed in it: the message at the fold's position is still the one it folded
        (`Fold.continuity`, at the stream leader). A server that crashed and came back may have lost
        the tail it had not synced, which the fold had read, and have stored other messages at
        those sequences since: the placements' guards (the last sequences of their subjects) would
        take those for the ones the decisions read. One read per session; another log, and the fold
        gives up (as at its consumer's re-creation, which comes later); no session up, UNAVAILABLE
        (what is sent while reconnecting goes out after the reconnection, unchecked)."""
        assert self.store is not None
        session = self.store.recorder.link.session
        if session is not None and session == self._confirmed:
            return
        if session is None:
            raise unavailable("the event store's connection is being made again; try again")
        try:
            why = await self.fold.continuity()
        except Exception as error:
            raise unavailable(f"whether the event stream still holds what this replica folded could not be "
                              f"asked ({error}); try again") from None
        if why is not None:
            self.fold.give_up(why)
            raise self.fold.stale_error()
        self._confirmed = session

    async def _keep_evicted(self, group: list[Commit]) -> list[Commit]:
        """The group without the placements whose evicted answer could not be kept (failed).

        The answer kept is true whether or not the placement is then written: the older
        placement is in the log, of the actor's current life."""
        evicting = [item for item in group if item.evicts is not None]
        if not evicting or self.on_evicted is None:
            return group
        kept = await asyncio.gather(*(self.on_evicted(item.placement.actor_id, *item.evicts) for item in evicting),
                                    return_exceptions=True)
        for outcome in kept:
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome  # a cancellation: the caller fails the whole group
        failed = set()
        for item, outcome in zip(evicting, kept):
            if isinstance(outcome, Exception):
                self._fail([item], outcome)
                failed.add(id(item))
        return [item for item in group if id(item) not in failed] if failed else group

    async def _sort_out(self, group: list[Commit], error: IntegrityError) -> None:
        """A group was refused: fold what the log holds now, fail the placements whose
        subjects moved on, and those that give a memory image up for want of room (they are
        decided again), and queue the others again unchanged.

        Under contention (replicas booking the same workers) smaller groups lose less
        to one stale placement, so the next groups are at most half this one's size.
        """
        self._group_limit = max(1, len(group) // 2)
        try:
            last = await self.last_seq()
            await self.fold.wait(last, self.catch_up_s)
        except Exception:
            self._fail(group, error)
            return
        p = self.projection
        stale = [
            item for item in group
            if p.booking_expectation(item.hold.worker_id) != item.hold.expected
            or p.actor_expectation(item.placement.actor_id) != item.actor
            or p.actor_seq(item.placement.actor_id) != item.actor[1]  # moved by a message the fold cannot read
        ]
        if not stale:  # refused for a reason the expectations do not show: let each decide again
            stale = group
        else:  # and a fallback that gives an image up: the room it lacked may be there now (a failed
            # placement's booking, counted in flight when it was decided, or what the refusal folded)
            stale += [item for item in group if item not in stale and item.placement.fallback is not None
                      and item.placement.fallback.reason is FallbackReason.NO_COMPATIBLE_WORKER]
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
        cpu, mem = self._pending.get(hold.worker_id, (0, 0))
        self._pending[hold.worker_id] = (cpu + hold.cpu, mem + hold.mem)
        self._touch(hold.worker_id)

    def _unhold(self, hold: Hold) -> None:
        if hold.released:
            return
        hold.released = True
        self._touch(hold.worker_id)
        cpu, mem = self._pending[hold.worker_id]
        cpu, mem = cpu - hold.cpu, mem - hold.mem
        if cpu or mem:
            self._pending[hold.worker_id] = (cpu, mem)
        else:
            del self._pending[hold.worker_id]
        if self._chain.get(hold.worker_id) is hold:
            del self._chain[hold.worker_id]

    def _touch(self, worker_id: str) -> None:
        """Its room in flight changed: remembered refusals that counted it no longer hold."""
        worker = self.projection.workers.get(worker_id)
        if worker is not None:
            worker.touch()

    def _folded(self, seq: int) -> None:
        """After each message folded: bookings now in the projection leave the in-flight set."""
        unfolded = self._unfolded
        while unfolded and unfolded[0][0] <= seq:
            hold = heapq.heappop(unfolded)[2]
            self._unhold(hold)
            if self._unfolded_actors.get(hold.actor_id) == hold.last_seq:
                del self._unfolded_actors[hold.actor_id]

