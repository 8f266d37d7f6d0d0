"""How the registry talks: the `warmboot-registry` micro service, its event store and its liveness.

What it decides is in `services.registry.domain`. Here:

- `RegistryStore`: the eventsourcing application over the JetStream event store
  (`store_env`). Each command loads a Worker, decides, saves, on the service's event loop
  (the store's connection runs there); `run_command_async` runs it again on a lost
  optimistic-concurrency race, so any number of replicas may serve the same worker.
- `Liveness` (`services.registry.liveness`): heartbeats are not events. Each one is a
  put of the worker's key in the JetStream key-value bucket `<PREFIX>_HEARTBEATS` with
  a per-message TTL; the server expires it and the replicas sweep its marker once.
- The roster (`services.registry.roster`, kept current by `services.registry.fold`):
  which workers are registered, folded from their events. A heartbeat is answered
  from it behind the fold's barrier (every worker event stored before the heartbeat
  is folded), so it loads no history; only a worker the roster does not have is
  looked up in the log before the answer is NOT_FOUND.
- `RegistryService`: the four endpoints of CONTRACT section 3 (Registry). Given the
  deployment's binding of workers to nodes (`services.registry.nodes`, shared by the
  replicas: `services.registry.binding`), a registration on any other node is refused
  before anything is written.

Replies carry `seq`: the stream sequence of the last event of the worker's history
the request wrote (the registry's fence on the booking subject follows it in the
same append). A request that writes nothing (`UNCHANGED`, draining a drained worker)
answers the sequence of the worker's last event, which includes everything it was
answered from; with a request id, that answer is kept in the reply bucket before it is
given (`services.replies.NoWriteAnswers`), so its retry, or a copy a stalled replica
decides late, gets it too instead of being decided again on a later state. A repeated
`request_id` is answered from the worker's history, where every event names the
request that caused it (scoped to the worker's current life:
`events.aggregate.WireAggregate.prior`), so the answer is decided where the write
happens, also after a lost reply or a crash between commit and reply.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from datetime import datetime
from functools import partial, wraps
from typing import TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError
from prometheus_client import Counter, Histogram

from events.aggregate import Recorded, WireApplication, now
from events.errors import ContractError, UnreadableHistory, exhausted, invalid, too_large_for_an_event, unavailable
from events.jetstream.link import links_on
from events.natspy.publish import flush_in_order
from events.schema import (
    Drained,
    DrainWorker,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    RegisterOutcome,
    RegisterReply,
    RegisterWorker,
    RemoveWorker,
    SeqReply,
    WorkerFenced,
)
from events.subjects import check_prefix, event_subject, stream_name
from events.tasks import cancel_and_wait
from services import deadline
from services.commands import Recheck, confirm_unchanged, run_command_async
from services.endpoints import EndpointSpec, add_endpoints
from services.locks import KeyedCount, KeyedLock
from services.process import store_env, stream_replicas
from services.registry.binding import SharedBinding
from services.registry.budget import FREE, Ticket, WriteBudget
from services.registry.domain import Worker, check_beats_in_force, register_outcome
from services.registry.fold import RosterFold
from services.registry.liveness import RECONCILE_INTERVAL_S, SWEEPER, Hearing, Liveness
from services.registry.nodes import allows, check_node, check_registered
from services.registry.roster import Roster
from services.replies import NoWriteAnswers, ReplyCache
from services.streams import StreamWatch, last_seq_on

log = logging.getLogger("warmboot.registry")
T = TypeVar("T")
R = TypeVar("R")

SERVICE = "registry"
DEFAULT_TTL_S = 15.0
FOLD_START_S = 120.0  # time to fold every worker event at start
RECONCILE_LANES = 32  # heartbeat records read at once when reconciling (`RegistryService.reconcile`)
RECONCILE_GIVE_UP = 64  # failures in a row that end a round early: the heartbeat bucket does not answer
# Requests about one worker a replica works on at once, per endpoint (in progress, or waiting for the
# worker's lock or a heartbeat's put): an agent sends its registrations one after the other and its
# heartbeats two at most at once. Past it, RESOURCE_EXHAUSTED at once (`_one_of_few`).
IN_FLIGHT_PER_WORKER = 8
# Said after a heartbeat's NOT_FOUND: the contract says "not registered", not what the worker does
# about it, and an agent written in another language read only that (docs/worker-agents.md).
REGISTER_AGAIN = "; a heartbeat keeps only a registered worker alive: register it (a new life) if it is to serve"

REGISTRATIONS = Counter(
    "warmboot_registry_registrations_total", "Registrations answered, by outcome", ["outcome"]
)
LOST_WORKERS = Counter("warmboot_registry_workers_lost_total", "Workers removed as LOST by this replica")
CLOCKS_RESTARTED = Counter(
    "warmboot_registry_clocks_restarted_total",
    "Expired heartbeat clocks this replica started again instead of removing the worker as LOST: it had not heard "
    "beats for a whole TTL yet, since it started or its connection to NATS came back (liveness.Hearing)")
UNBOUND_REMOVALS = Counter("warmboot_registry_workers_unbound_removed_total",
                           "Workers this replica removed for being registered on a node the binding does not give them")
IN_FLIGHT_REFUSED = Counter(
    "warmboot_registry_requests_over_in_flight_total",
    f"Requests this replica refused because it was working on {IN_FLIGHT_PER_WORKER} of the same endpoint "
    "about the same worker already",
)
OVER_BUDGET = Counter("warmboot_registry_writes_over_budget_total",
                      "Requests this replica refused because their worker's write budget was spent "
                      "(services.registry.budget)")
COMMIT_GROUP = Histogram(
    "warmboot_registry_commit_group_writes",
    "Commands whose writes went out in one atomic append (a refused group counted, then each of its members alone)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)


class Decided(msgspec.Struct, frozen=True):
    """What a command decided: its answer, and where in the log the answer stands.

    `seq` is the stream sequence of the last event of the worker's history the command
    wrote; for a `replay` (an earlier request with the same request_id in this life)
    that of the earlier request's last event, `version`; when nothing was written, that
    of the worker's last event, which holds all the answer stood on (`unchanged`: the
    request found the worker already as it asks, now or in the answer it kept). The worker's
    history as loaded knows each event's sequence; `seq` is None only when the store
    did not say (the service then looks it up).
    """

    outcome: RegisterOutcome | None = None
    seq: int | None = None
    version: int = 0
    wrote: bool = False
    replay: bool = False
    unchanged: bool = False


class RegistryStore(WireApplication):
    """The Worker repository on the event store: one load-decide-save per command.

    Its commands are coroutines: the worker's history is read, and its events appended, through
    the recorder's asyncio calls (`select_events_async`, `insert_events_async`), on the loop the
    service awaits them on, which runs the store's connection too (`events.jetstream.link.
    links_on`): a command crosses no thread. (Awaited from another loop, each read and append
    goes over to the connection's loop and back, as a test's second store does.)

    A command that writes nothing for a request with an id (a registration UNCHANGED, a
    drain of a drained worker) keeps its answer in `no_writes`, set by the service, and
    every command whose id the worker's history does not answer looks there first."""

    name = "registry"
    no_writes: NoWriteAnswers | None = None
    # Before an answer that writes nothing: raises IntegrityError (the command decides again) if the
    # worker's history was read behind the stream leader; the service sets its roster's check. Without
    # one, the leader is asked (`services.commands.confirm_unchanged`).
    confirm: Callable[[Worker, int], Awaitable[None]] | None = None
    # Whether a worker's heartbeat key holds no heartbeat (`lose` reads it after loading the worker); the
    # service sets its liveness's. Without one, `lose` removes a worker in a life.
    silent: Callable[[str], Awaitable[bool]] | None = None
    # What one message of the NATS server carries (its max_payload, as the connections know it); the service
    # sets its `_max_payload`. A registration whose events would not fit is refused before anything is written
    # (`domain.check_fits`). Without one, nothing is checked (the store then refuses such an event: INTERNAL).
    max_payload: Callable[[], int | None] | None = None
    CACHE_AGGREGATES = True  # a command reads only the events after the worker it last read or saved

    async def load(self, worker_id: str) -> Worker:
        """The worker as its history makes it (a new one if it has none), as `repository.get` would."""
        worker = await self.get_async(Worker.create_id(worker_id))
        return worker if worker is not None else Worker(worker_id)

    async def _commit(self, worker: Worker, outcome: RegisterOutcome | None = None, verb: str | None = None,
                      request_id: str | None = None, ticket: Ticket = FREE) -> Decided:
        """Save what `worker` recorded, fenced (CONTRACT placement rule 8).

        Every append to a worker's history carries, in the same atomic batch and after
        it, a `WorkerFenced` on the worker's booking subject: a placement is committed
        only if that subject has not moved since its decision, so no placement decided
        on the worker's earlier state can commit after this change. The fence expects
        the booking subject's last sequence as read here; a placement that lands in
        between makes the save lose (IntegrityError) and `run_command_async` try again.

        What it writes, events or a kept answer, the request pays for with its `ticket`
        (`services.registry.budget`): RESOURCE_EXHAUSTED, nothing written, if the worker's budget
        is spent; given back if the write fails.
        """
        if not worker.pending_events:
            seq = worker.seq_at(worker.version)
            if verb is not None:  # a request's answer (the sweep's, lose and remove_unbound, confirm their own)
                await self._confirm_read(worker)
            if request_id is not None and self.no_writes is not None and verb is not None:
                if not seq:  # the event store names every event's position; one that does not cannot answer
                    raise unavailable(f"the event store did not say where worker {worker.entity_id!r}'s "
                                      f"event {worker.version} is")
                reply = (RegisterReply(outcome=outcome, seq=seq) if verb == "register"
                         else SeqReply(seq=seq, unchanged=True))
                with ticket.paying():
                    await self.no_writes.keep_async(worker, verb, request_id, reply)
            return Decided(outcome=outcome, seq=seq or None, version=worker.version, unchanged=True)
        last_type = type(worker.pending_events[-1].body).__name__
        with ticket.paying():
            fence = await self._fence(worker.entity_id, last_type)
            deadline.check("the worker's event")
            # and again if it waits for a grouped append in flight before it goes out
            _, seqs = await self.save_async(worker, fence, late=partial(deadline.passed, deadline.deadline(),
                                                                        "the worker's event"))
        return Decided(outcome=outcome, seq=seqs[-2], version=worker.version, wrote=True)  # the fence follows it

    async def _fence(self, worker_id: str, event: str) -> Recorded:
        booking_id = WorkerFenced.KIND + "." + worker_id
        last = await self.recorder.select_events_async(booking_id, desc=True, limit=1)
        version = last[0].originator_version + 1 if last else 1
        return Recorded(booking_id, version, WorkerFenced(at=now(), worker_id=worker_id, event=event))

    async def _confirm_read(self, worker: Worker) -> None:
        """What writes nothing stands on the worker's history as read, and a direct get that a replica
        of the stream answers may be behind another registry replica's write: IntegrityError (the
        command is decided again, on the leader's history) unless the history as read is the
        stream leader's (`confirm`, by the roster; else `confirm_unchanged`). An UNCHANGED answer,
        an answer from before (the history's or a kept one), a refusal's mark, a removal of the
        sweep's that finds nothing to do: each was found by an audit given on a read behind."""
        read = self._read_up_to(worker)
        await (self.confirm(worker, read) if self.confirm is not None
               else confirm_unchanged(self.recorder, worker.id, read))

    async def _replay(self, worker: Worker, versions: list[int], outcome: RegisterOutcome | None = None) -> Decided:
        """The answer of an earlier request with the same id, from the events it recorded in this life
        as the leader has it: read behind another replica's removal and registration of the next life,
        the earlier life's answer was given where the leader's history refuses the copy or decides it
        anew (docs/contract.md: a request_id is scoped to one life)."""
        await self._confirm_read(worker)
        last = versions[-1]
        return Decided(outcome=outcome, seq=worker.seq_at(last) or None, version=last, replay=True)

    async def _kept(self, worker: Worker, verb: str, request_id: str | None) -> Decided | None:
        """The answer an earlier request with this id kept because it wrote nothing (`no_writes`)."""
        if self.no_writes is None:
            return None
        kept = await self.no_writes.recall_async(worker, verb, request_id,
                                                 RegisterReply if verb == "register" else SeqReply)
        if kept is None:
            return None
        reply, version = kept
        await self._confirm_read(worker)  # kept for the life as read (`_replay`)
        return Decided(outcome=getattr(reply, "outcome", None), seq=reply.seq, version=version, replay=True,
                       unchanged=getattr(reply, "unchanged", False))

    async def register(self, request: RegisterWorker, at: datetime, ticket: Ticket = FREE) -> Decided:
        worker = await self.load(request.worker_id)
        earlier = worker.prior("register", request.request_id)
        if earlier:
            return await self._replay(worker, earlier, register_outcome(worker.events_at(earlier)))
        kept = await self._kept(worker, "register", request.request_id)
        if kept is not None:
            return kept
        moved_from = worker.node if worker.alive and worker.node != request.node else None
        try:
            outcome = worker.register(request, at, sent_before=await self._sent_before(worker, request),
                                      max_payload=self.max_payload() if self.max_payload is not None else None)
        except ContractError as refusal:
            if too_large_for_an_event(refusal):
                # decided on the worker's state (the previous classes a RuntimeChanged carries, or whether it
                # is in a life): answered only on the history as the stream leader has it (IntegrityError,
                # decided again, otherwise)
                await self._confirm_read(worker)
            if (refusal.code is ErrorCode.FAILED_PRECONDITION and refusal.field not in ("revision", "request_id")
                    and request.revision is not None and request.request_id is not None
                    and self.no_writes is not None):
                # refused on the worker's state (a change of class): a copy decided after the worker's
                # life ended would be taken, and only this mark says it was sent before (`_sent_before`).
                # Marked only on the worker's history as the stream leader has it: a mark made on a read
                # behind another replica's removal refused the registration that begins the next life,
                # when it was decided again on the leader's history (an audit's finding).
                await self._confirm_read(worker)
                if not await self.no_writes.refusal_marked_async(worker, request.request_id):  # marked: free
                    with ticket.paying():  # out of budget: RESOURCE_EXHAUSTED instead, unmarked (nothing answered it)
                        await self.no_writes.mark_refused_async(worker, request.request_id)
            raise
        decided = await self._commit(worker, outcome, "register", request.request_id, ticket)
        if moved_from is not None:
            log.warning("worker %s moved from node %s to node %s while alive: its agent moved, or a second agent "
                        "runs with this worker id (`serve registry --worker-nodes` binds each worker to its node)",
                        request.worker_id, moved_from, request.node)
        return decided

    async def _sent_before(self, worker: Worker, request: RegisterWorker) -> bool:
        """Whether a registration with a revision that would begin a life carries a request id sent
        before (`Worker.register`): in the worker's history, or answered without an event (an answer
        kept, a refusal marked). Read only then: the bucket costs a read or two."""
        rid = request.request_id
        if rid is None or worker.alive or request.revision is None or worker.revision is None:
            return False
        if rid in worker.request_versions:
            return True
        return self.no_writes is not None and await self.no_writes.was_answered_async(worker, rid)

    async def drain(self, worker_id: str, request: DrainWorker, at: datetime, ticket: Ticket = FREE) -> Decided:
        worker = await self.load(worker_id)
        earlier = worker.prior("drain", request.request_id)
        if earlier:
            return await self._replay(worker, earlier)
        kept = await self._kept(worker, "drain", request.request_id)
        if kept is not None:
            return kept
        drained = worker.drain(request.reason, at, request.request_id, request.revision)
        # draining happens once in a life, which a paid registration began: free; keeping the answer
        # of a drain that changed nothing is not
        return await self._commit(worker, None, "drain", request.request_id, FREE if drained else ticket)

    async def remove(self, worker_id: str, request: RemoveWorker, at: datetime) -> Decided:
        """Free of the worker's budget (`services.registry.budget`): a removal ends a life, which a paid
        registration began, and one of a removed worker writes nothing."""
        worker = await self.load(worker_id)
        earlier = worker.prior("remove", request.request_id)
        if earlier:
            return await self._replay(worker, earlier)
        kept = await self._kept(worker, "remove", request.request_id)
        if kept is not None:
            return kept
        worker.remove(request.reason, at, request.request_id, request.revision)
        return await self._commit(worker)

    async def remove_unbound(self, worker_id: str, nodes: Mapping[str, str], at: datetime) -> Decided:
        worker = await self.load(worker_id)
        if not worker.remove_unbound(nodes, at):
            await self._confirm_read(worker)
        return await self._commit(worker)

    async def lose(self, worker_id: str, at: datetime) -> Decided:
        """Remove the worker as LOST if it is in a life and `silent(worker_id)` (its heartbeat key, read
        after the worker is loaded) says so still. Read before the load, a marker handled twice (two
        replicas) removed the life its agent registered meanwhile: the key was read before that
        registration's beat, the worker loaded after it. Read after, a registration the load has has
        beaten already (it beats before it decides), and one it has not moves the history the removal
        expects, so the command is decided again, reading the key again (an audit's finding)."""
        worker = await self.load(worker_id)
        if worker.alive and self.silent is not None and not await self.silent(worker_id):
            return await self._commit(worker)  # nothing: it beats
        if not worker.lose(at):  # read behind the registration of a new life, that life was left silent
            await self._confirm_read(worker)
        return await self._commit(worker)

    async def require_alive(self, worker_id: str, confirm: bool = False
                            ) -> tuple[str, int | None, Drained | None]:
        """NOT_FOUND unless the worker is in a life; the node it registered on, the revision of
        its registration in force (`Worker.in_force`), and its drain in this life (None: not drained,
        or the drain's sequence not known). With `confirm`, in a life only as the stream
        leader has it too (IntegrityError, decided again on the leader's history, if it has more:
        `confirm_unchanged`)."""
        worker = await self.load(worker_id)
        worker.require_alive()
        if confirm:
            await confirm_unchanged(self.recorder, worker.id, self._read_up_to(worker))
        drained = None
        if worker.drain_in_force is not None and (seq := worker.seq_at(worker.drain_in_force[0])):
            drained = Drained(seq=seq, reason=worker.drain_in_force[1])
        return worker.node, worker.in_force, drained

    def _read_up_to(self, worker: Worker) -> int:
        """The stream sequence of the last event of the worker's history as loaded (what this process
        has read of the subject, should the store not have said)."""
        return worker.seq_at(worker.version) or self.recorder.seen(worker.id)


class EventPositions:
    """Stream sequences of a worker's events, read from the stream itself.

    A worker's subject holds exactly its events, version 1 first (the stream never
    discards), so version v is the v-th message on the subject.
    """

    def __init__(self, nc: NATS, prefix: str):
        self.js = nc.jetstream()
        self.prefix = prefix
        self.stream = stream_name(prefix)

    def subject(self, worker_id: str) -> str:
        return event_subject(self.prefix, Worker.KIND, worker_id)

    async def last_seq(self, worker_id: str) -> int:
        """The sequence of the worker's last event (0 if it has none)."""
        return await last_seq_on(self.js, self.stream, self.subject(worker_id))

    async def seq_of(self, worker_id: str, version: int) -> int:
        """The sequence of the worker's event `version`: the version-th message on its subject."""
        subject = self.subject(worker_id)
        seq = 0
        try:
            for _ in range(version):
                seq = (await self.js.get_msg(self.stream, seq=seq + 1, subject=subject, next=True)).seq
        except NotFoundError:
            raise unavailable(f"the event log has no event {version} of worker {worker_id!r}") from None
        return seq


class RegistryService:
    """`warmboot-registry`: register, heartbeat, drain and remove workers (CONTRACT section 3)."""

    def __init__(
        self,
        nc: NATS,
        *,
        nats_url: str,
        prefix: str,
        ttl_s: float = DEFAULT_TTL_S,
        store_replicas: int | None = None,
        env: dict[str, str] | None = None,
        worker_nodes: Mapping[str, str] | str | None = None,
        writes: WriteBudget | None = None,
        reconcile_interval_s: float = RECONCILE_INTERVAL_S,
    ):
        if ttl_s < 1:
            raise ValueError(f"ttl_s must be at least 1 second (heartbeat TTLs are whole seconds), not {ttl_s}")
        self.nc = nc
        self.prefix = check_prefix(prefix)
        self.ttl_s = ttl_s
        # The node each worker may claim (`services.registry.nodes`), shared by the replicas: set from
        # `worker_nodes` at start (a binding, or `binding.UNBIND`), else as another replica set it.
        self.worker_nodes = worker_nodes
        self.binding = SharedBinding(nc, prefix, store_replicas)
        self._binding_moved = asyncio.Event()  # set when the binding changes: `_remove_unbound` runs again
        self.binding.on_change = self._binding_moved.set
        # What the requests about each worker may write (`services.registry.budget`): this replica's.
        self.writes = writes if writes is not None else WriteBudget()
        self._unbound: asyncio.Task[None] | None = None
        # set by `stop`: ends the two loops below also when a request's time-out swallowed their
        # cancellation (Python 3.11's asyncio.wait_for, inside nats-py's requests, can), which left
        # `stop` waiting for ever on a loop gone back to its wait (a test hung so, 2026-12-05)
        self._stopping = False
        self.reconcile_interval_s = reconcile_interval_s
        self._reconciling: asyncio.Task[None] | None = None
        self.env = env if env is not None else store_env(nats_url, prefix, store_replicas)
        self.store: RegistryStore | None = None
        # Requests about one worker are decided one at a time in this replica; request ids
        # are answered from the worker's history, where the write happens (WireAggregate.prior).
        self._workers = KeyedLock()
        self.positions = EventPositions(nc, prefix)
        self.roster = Roster()
        self.fold = RosterFold(nc, prefix, self.roster)
        self.fold.on_node = self._node_folded
        self.hearing = Hearing(nc)  # how long this replica has heard beats without a break (`_expired`)
        self._said_restarted = False  # whether `_expired` logged a clock it started again
        self.liveness = Liveness(
            nc, prefix, ttl_s, self._expired, store_replicas if store_replicas is not None else stream_replicas(),
            on_pinned=self.reconcile,  # the sweep pinned here: what the replica pinned before held is found
        )
        self.replies: ReplyCache | None = None
        self.service = None
        # the roster is of one incarnation of the stream, and of the messages the fold read from it
        self.watch = StreamWatch(nc, stream_name(prefix), read=lambda: self.fold.mark)

    @property
    def failed(self) -> asyncio.Future[str] | None:
        """Done, with the reason, once the event stream was made again under this replica
        (`services.streams.StreamWatch`): whoever runs it then stops it."""
        return self.watch.failed

    async def start(self) -> "RegistryService":
        # The store's connection runs on this loop (`links_on`): the commands' reads and appends are
        # awaited here, with no thread of the store's own and none for the commands.
        with links_on(asyncio.get_running_loop()):
            self.store = await asyncio.to_thread(RegistryStore, self.env)  # makes the stream if need be
        await self.watch.start()
        self.replies = await ReplyCache(self.nc, self.prefix).start()
        self.store.no_writes = NoWriteAnswers(self.replies, SERVICE, asyncio.get_running_loop(), self.watch.created)
        self.store.confirm = self._confirm_unchanged
        self.store.silent = self._silent
        self.store.max_payload = self._max_payload
        await self.binding.start(self.worker_nodes)
        # Commands for different workers append together while one append is in flight (each holds its
        # worker's lock): an atomic batch costs a one-replica file stream's server milliseconds.
        self.store.recorder.group_appends(on_group=COMMIT_GROUP.observe)
        await self.fold.start(FOLD_START_S)
        await self.liveness.start()
        await self.reconcile()
        self.service = await add_endpoints(
            self.nc,
            self.prefix,
            SERVICE,
            "warmboot worker registry: workers report their runtimes per sandbox class",
            [
                EndpointSpec("register", RegisterWorker, self._one_of_few(self.register)),
                EndpointSpec("heartbeat", Heartbeat, self._one_of_few(self.heartbeat)),
                EndpointSpec("drain", DrainWorker, self._one_of_few(self.drain)),
                EndpointSpec("remove", RemoveWorker, self._one_of_few(self.remove)),
            ],
        )
        self.hearing.begin()  # beats reach this replica from now on: a clock that runs out a TTL on is a silence
        self._binding_moved.set()  # the workers registered before this start, judged once
        self._unbound = asyncio.create_task(self._remove_unbound(), name="registry-unbound-workers")
        self._reconciling = asyncio.create_task(self._reconcile_now_and_then(), name="registry-reconcile")
        await flush_in_order(self.nc)  # the server has our subscriptions: we serve when start() returns
        return self

    def _max_payload(self) -> int | None:
        """What one message may be, as the server told this replica's connections (each learns it from the
        server it is connected to, again at each reconnect): the least of this service's and its event
        store's, which appends the events; None before either knows."""
        store_nc = self.store.recorder.link.nc if self.store is not None else None
        known = [nc.max_payload for nc in (self.nc, store_nc) if nc is not None and nc.max_payload > 0]
        return min(known, default=None)

    async def stop(self) -> None:
        if self.service is not None:
            with suppress(Exception):
                await self.service.stop()
            self.service = None
        self._stopping = True
        self._binding_moved.set()  # `_remove_unbound` past a swallowed cancellation: woken, it sees `_stopping`
        await cancel_and_wait(self._unbound, self._reconciling)
        self._unbound = self._reconciling = None
        await self.watch.stop()
        await self.liveness.stop()
        await self.binding.stop()
        await self.fold.stop()
        if self.store is not None:
            await self.store.recorder.ungroup_appends()
            await asyncio.to_thread(self.store.close)
            self.store = None

    # --- endpoints ----------------------------------------------------------------------

    def _one_of_few(self, handler: Callable[[str, T], Awaitable[R]]) -> Callable[[str, T], Awaitable[R]]:
        """`handler`, refused RESOURCE_EXHAUSTED (no field: the request is not at fault; nothing done)
        while this replica works on IN_FLIGHT_PER_WORKER of the endpoint's requests about the same worker
        already. The requests about one worker wait for its lock, or a heartbeat for its put, each holding
        one of the endpoint's slots, which the requests about every worker share: without a bound, one
        credential's flood of requests about its own worker held them all, and every other worker's
        registrations (or heartbeats) waited behind it. Each endpoint counts its own, so a removal of a
        flooding worker by hand (`warmboot worker remove`, with its own credential under nats-config) is
        not refused for its registrations."""
        in_flight = KeyedCount(IN_FLIGHT_PER_WORKER)
        flooding: set[str] = set()  # workers refused since they last had none of these in progress
        verb = handler.__name__

        @wraps(handler)
        async def limited(worker_id: str, request: T) -> R:
            if not in_flight.enter(worker_id):
                IN_FLIGHT_REFUSED.inc()
                if worker_id not in flooding:  # said once until its requests are all answered
                    flooding.add(worker_id)
                    log.warning("worker %s has %d %s requests in progress at this replica: more are refused "
                                "until they are answered", worker_id, IN_FLIGHT_PER_WORKER, verb)
                raise exhausted(f"this registry replica is working on {IN_FLIGHT_PER_WORKER} {verb} requests about "
                                f"worker {worker_id!r} already: this one was not taken; try again once one is "
                                "answered")
            try:
                return await handler(worker_id, request)
            finally:
                in_flight.leave(worker_id)
                if worker_id not in in_flight:
                    flooding.discard(worker_id)

        return limited

    async def register(self, worker_id: str, request: RegisterWorker) -> RegisterReply:
        if request.worker_id != worker_id:
            raise invalid(
                f"worker_id {request.worker_id!r} does not match the subject's worker {worker_id!r}",
                "worker_id",
            )
        check_node(self.binding.nodes, worker_id, request.node)  # before the beat: a refusal writes nothing

        async with self._workers(worker_id):
            # A registration is also a heartbeat. Beating first means an expiry being
            # swept right now finds the worker beating and leaves it registered.
            await self.liveness.beat(worker_id)
            ticket = self.writes.ticket(worker_id)  # pays for what its attempts write (a failed one is given back)
            command = lambda: self.store.register(request, now(), ticket)  # noqa: E731
            decided = await self._paid(worker_id, run_command_async(command, recheck=self._recheck(worker_id)))
            REGISTRATIONS.labels(decided.outcome.value).inc()
            if not allows(self.binding.judged_nodes, worker_id, request.node):
                self._binding_moved.set()  # decided on a binding that changed since: removed at once
            if decided.outcome is RegisterOutcome.REGISTERED:
                # A new life beats again once it is written: a removal through another replica
                # that read the beat above as the key's last entry may have put its tombstone
                # over it since (`Liveness.forget`), and a life with no entry is never found LOST.
                # This beat follows the tombstone, or moves the last entry so the purge is refused.
                # If it fails, the answer is UNAVAILABLE: the caller's retry (the same request id)
                # is answered from the history, and beats again.
                await self.liveness.beat(worker_id)
            return RegisterReply(outcome=decided.outcome, seq=await self._seq(worker_id, decided))

    async def _paid(self, worker_id: str, command: Awaitable[Decided]) -> Decided:
        """`command`'s decision; a refusal for the worker's write budget counted, and logged once until
        the worker writes again."""
        try:
            return await command
        except ContractError as error:
            if error.code is ErrorCode.RESOURCE_EXHAUSTED and error.field == "worker_id":
                OVER_BUDGET.inc()
                if self.writes.first_refusal(worker_id):
                    log.warning("worker %s has spent its write budget: its requests that would write are refused "
                                "until it refills (%s); said once until it writes again", worker_id, error.message)
            raise

    async def _confirm_unchanged(self, worker: Worker, seq: int) -> None:
        """`RegistryStore.confirm` by the roster, brought current (one barrier for every request
        waiting, as heartbeats have it; a re-registration storm after a NATS restart is all such
        answers): a worker whose last event in its life is not the one read at `seq` was read
        behind the stream leader, whose word is then asked for (and remembered, so that the next
        read reaches it: `confirm_unchanged`). Without a barrier, the leader's word alone."""
        assert self.store is not None
        try:
            await self.fold.current()
        except ContractError:
            pass
        else:
            if self.roster.last_seq(worker.entity_id) == seq:
                return
        await confirm_unchanged(self.store.recorder, worker.id, seq)

    def _recheck(self, worker_id: str) -> Recheck:
        """`run_command_async`'s recheck of a refusal on the worker's state: whether the stream leader
        has the worker's history past what this process had read of it before the decision
        (another replica's write a moment ago)."""
        recorder, aggregate = self.store.recorder, Worker.create_id(worker_id)
        return lambda: partial(recorder.newer_at_leader_async, aggregate, recorder.seen(aggregate))

    async def heartbeat(self, worker_id: str, request: Heartbeat) -> HeartbeatReply:
        # From the roster, once it holds every worker event stored before this request
        # (whichever replica wrote it): a worker removed a moment ago is seen removed.
        # One the roster does not have is looked up in its history: the log says
        # NOT_FOUND (or that it registered meanwhile). So does a barrier not to be had.
        # That read may come from a replica of the stream behind the leader, so a NOT_FOUND
        # is rechecked at the leader as a command's refusal is (`run_command_async`); and where
        # the roster, current, says the worker is in no life, so is an answer that it is in one
        # (a removal through another replica read behind: an audit's finding). With no barrier
        # to be had (the leader cannot be asked), the read is taken as it is. The roster answers
        # only in a session of the connection in which the log it folded was found still there
        # (`StreamWatch.confirmed`): a single server that crashed and lost the tail it had not
        # synced holds no more the registration the roster has in force; the history does.
        # Nothing is put before the answer is known: a refusal writes nothing.
        try:
            await self.fold.current()
            alive, current = self.roster.alive(worker_id), True
        except ContractError:
            alive, current = False, False
        if alive and not await self.watch.confirmed():
            alive = False
        node = in_force = drained = None
        if not alive:
            try:
                node, in_force, drained = await run_command_async(
                    lambda: self.store.require_alive(worker_id, confirm=current), recheck=self._recheck(worker_id))
            except ContractError as error:
                if error.code is not ErrorCode.NOT_FOUND:
                    raise
                # what the agent does next, said to one written in another language (docs/worker-agents.md)
                raise ContractError(error.code, f"{error.message}{REGISTER_AGAIN}", error.field) from None
        judged = self.binding.judged_nodes
        if judged is not None:  # registered on a node the binding gives another (it registered before): no beat
            check_registered(judged, worker_id, self.roster.node(worker_id) if alive else node)
        if request.revision is not None:  # (looked up only for a beat that names one: each beat's cost counts)
            if alive:
                node, in_force = self.roster.node(worker_id), self.roster.revision(worker_id)
            check_beats_in_force(worker_id, request.revision, in_force, node)
        await self.liveness.beat(worker_id)
        # whether it is drained: a dict entry of the roster (each beat's cost counts), or what its history said
        return HeartbeatReply(ttl_s=self.ttl_s, drained=self.roster.drained(worker_id) if alive else drained)

    async def drain(self, worker_id: str, request: DrainWorker) -> SeqReply:
        async with self._workers(worker_id):
            ticket = self.writes.ticket(worker_id)
            command = lambda: self.store.drain(worker_id, request, now(), ticket)  # noqa: E731
            decided = await self._paid(worker_id, run_command_async(command, recheck=self._recheck(worker_id)))
            return SeqReply(seq=await self._seq(worker_id, decided), unchanged=decided.unchanged)

    async def remove(self, worker_id: str, request: RemoveWorker) -> SeqReply:
        async with self._workers(worker_id):
            decided = await self._remove(worker_id, lambda: self.store.remove(worker_id, request, now()))
            return SeqReply(seq=await self._seq(worker_id, decided))

    async def _remove(self, worker_id: str, command: Callable[[], Awaitable[Decided]]) -> Decided:
        """A removal of `worker_id` (`command`, run as `run_command_async` runs it), its heartbeat dropped
        if it wrote; the caller holds the worker's lock."""
        try:  # before the removal: its heartbeat is dropped only if nothing was put after this
            last_entry: int | None = await self.liveness.last_entry(worker_id)
        except Exception as error:
            last_entry = None
            log.warning("reading the heartbeat of worker %s failed (%s: %s); if removed, it is left to "
                        "expire", worker_id, type(error).__name__, error)
        decided = await run_command_async(command, recheck=self._recheck(worker_id))
        if decided.wrote and last_entry is not None:
            await self._forget(worker_id, last_entry)
        return decided

    async def _forget(self, worker_id: str, last_entry: int) -> None:
        """Drop a removed worker's heartbeat (`Liveness.forget`). The removal is written whatever
        happens here, so a failure is not the caller's: the heartbeat then expires by itself within
        the TTL, and its expiry finds the worker removed and writes nothing (`_expired`); a
        heartbeat meanwhile is NOT_FOUND (the roster has the removal)."""
        try:
            if not await self.liveness.forget(worker_id, last_entry):
                log.info("worker %s is removed; a heartbeat put since is left to expire", worker_id)
        except Exception as error:
            log.warning("worker %s is removed; its heartbeat could not be dropped (%s: %s), it expires "
                        "by itself within %ss", worker_id, type(error).__name__, error, self.ttl_s)

    async def _seq(self, worker_id: str, decided: Decided) -> int:
        if decided.seq is not None:
            return decided.seq
        if decided.replay:
            return await self.positions.seq_of(worker_id, decided.version)
        return await self.positions.last_seq(worker_id)

    # --- the binding of workers to nodes ---------------------------------------------------

    def _node_folded(self, worker_id: str, node: str) -> None:
        """The fold read a registration or an update putting `worker_id`, in a life, on `node`: if the
        binding this replica judges by does not give it that node, the look runs again. Such an event
        was decided by a replica that did not have the binding yet (its change not delivered to it, or
        delivered while the decision was under way); without this, the worker stayed on that node,
        beating through that replica, until the change reached it too (found by an audit)."""
        if not allows(self.binding.judged_nodes, worker_id, node):
            self._binding_moved.set()

    async def _remove_unbound(self) -> None:
        """Each time the binding this replica judges by changes, once at start, after a registration
        decided on a binding that changed meanwhile, and when the fold reads a worker put on a node the
        binding does not give it (`_node_folded`: decided by a replica the binding had not reached yet):
        every worker registered on a node the binding does not give it is removed at once, not left to
        beat until its heartbeats' refusal ends it as LOST a TTL later (meanwhile resumes could be
        placed on it). Every replica looks; the decision is the Worker's, on its history
        (`Worker.remove_unbound`), so a worker another replica removed, or that moved to its own node,
        is left as it is."""
        while not self._stopping:
            await self._binding_moved.wait()
            if self._stopping:
                return
            self._binding_moved.clear()
            try:
                try:  # judged on the binding the bucket's leader has: a replica whose consumer is late does not
                    await self.binding.refresh()  # remove the workers registered on their nodes since the change
                except Exception as error:
                    log.warning("the binding of workers to nodes could not be read at its bucket's leader (%s: %s); "
                                "workers are judged on revision %d, as this replica has it", type(error).__name__,
                                error, self.binding.revision)
                nodes = self.binding.judged_nodes
                if nodes is None:
                    continue
                with suppress(ContractError):  # every worker event stored so far, if the barrier can be had
                    await self.fold.current()
                for worker_id in self.roster.registered():
                    node = self.roster.node(worker_id)
                    if node is not None and not allows(nodes, worker_id, node):
                        await self._remove_if_unbound(worker_id, node)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: say so, and keep the task for the next change
                log.exception("removing the workers registered on nodes the binding does not give them failed")

    async def _remove_if_unbound(self, worker_id: str, node: str) -> None:
        """Remove `worker_id`, found on `node`, if its history says it is still registered on a node
        the binding does not give it."""
        try:
            async with self._workers(worker_id):
                nodes = self.binding.judged_nodes
                if nodes is None:
                    return
                decided = await self._remove(worker_id, lambda: self.store.remove_unbound(worker_id, nodes, now()))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # an outage: its heartbeats are refused, so it ends as LOST
            log.warning("worker %s, registered on a node its binding does not give it, was not removed (%s: %s); "
                        "its heartbeats are refused, so it ends as LOST", worker_id, type(error).__name__, error)
            return
        if decided.wrote:
            UNBOUND_REMOVALS.inc()
            bound = nodes.get(worker_id)
            log.warning("worker %s removed: registered on node %s (%s)", worker_id, node,
                        f"it is bound to node {bound}" if bound else "the binding does not list it")

    # --- liveness -------------------------------------------------------------------------

    async def _expired(self, worker_id: str) -> None:
        if self.hearing.heard_for() < self.ttl_s:
            # This replica has not heard beats for a whole TTL yet (it started, or its connection came back):
            # the clock may have run out while no beat could reach the bucket. A new one, unless a beat came
            # first; a worker that is silent indeed ends as LOST once that one runs out (`Hearing`). (Whether
            # the worker is in a life is not asked here: this replica's roster may not have folded its latest
            # registration yet; a clock of a worker in none runs out, and its marker then writes nothing.)
            state, seq = await self.liveness.entry(worker_id)
            if state == "expired":
                await self.liveness.start_clock(worker_id, seq)
                CLOCKS_RESTARTED.inc()
                if not self._said_restarted:
                    self._said_restarted = True
                    log.info("worker %s's heartbeat clock ran out before this replica had heard beats for a TTL "
                             "(%ss; it started, or its connection to NATS came back, %.1fs ago): a new clock, not "
                             "LOST; others so are counted in warmboot_registry_clocks_restarted_total", worker_id,
                             self.ttl_s, self.hearing.heard_for())
            return
        # A heartbeat (or a new registration) that came after the marker wins. Read under the
        # worker's lock: a registration here beats before it decides, so either its beat is
        # seen, or the removal is written before it decides (and it registers anew). The key is
        # read after the worker is loaded, at each attempt (`RegistryStore.lose`): a registration
        # through another replica is seen beating too, or makes the removal decide again.
        async with self._workers(worker_id):
            decided = await run_command_async(lambda: self.store.lose(worker_id, now()))
        if decided.wrote:
            LOST_WORKERS.inc()
            log.info("worker %s removed as LOST after %ss without a heartbeat", worker_id, self.ttl_s)

    async def _silent(self, worker_id: str) -> bool:
        """Whether the worker, in a life, is silent: its heartbeat key's last entry is the server's expiry
        marker. A key with nothing in it (a removal's tombstone since the marker: the life in force began
        after it, and its beat may be on its way; or no entry) gets a clock instead, as a reconciliation
        gives one, so that the worker is removed LOST within its TTL if it is silent: removed at once, a
        life registered a moment before, its first beat under the tombstone, was (an audit's finding)."""
        state, seq = await self.liveness.entry(worker_id)
        if state == "absent":
            await self.liveness.start_clock(worker_id, seq)
        return state == "expired"

    async def reconcile(self) -> None:
        """At start, and every `reconcile_interval_s`: every registered worker has a heartbeat clock
        running, or is swept.

        A worker registered while no replica could record its heartbeat, whose clock's put was lost,
        or whose expiry marker aged out unhandled (every replica down, or its removal failing for
        the marker's whole life: found by an audit) would otherwise never be found lost. The
        registered workers are the roster's; cost: one read of the bucket per registered worker,
        per round. A worker that cannot be reconciled now is logged; the next round tries again.
        """
        pending = self.roster.registered()
        failed: list[str] = []  # the workers not reconciled this round
        failing = 0  # failures in a row, not counting unreadable histories: the bucket may not answer

        async def one(worker_id: str) -> None:
            state, seq = await self.liveness.entry(worker_id)
            if state == "absent":
                await self.liveness.start_clock(worker_id, seq)
            elif state == "expired":
                await self._expired(worker_id)

        async def lane() -> None:
            nonlocal failing
            for worker_id in pending:
                try:
                    await one(worker_id)
                    failing = 0
                except UnreadableHistory:  # logged where it was read; the others are reconciled all the same
                    failed.append(worker_id)
                except Exception as error:
                    failed.append(worker_id)
                    failing += 1
                    if failing == 1:  # the first of a run; then one line for the round, not one per worker
                        log.warning("worker %s is not reconciled (%s: %s); the next round tries again", worker_id,
                                    type(error).__name__, error, exc_info=not isinstance(error, (
                                        ContractError, nats.errors.Error, OSError, asyncio.TimeoutError)))
                    if failing >= RECONCILE_GIVE_UP:  # the bucket does not answer: not a wait of 5 s per worker
                        raise unavailable(f"{failing} workers in a row could not be reconciled, the last for "
                                          f"{type(error).__name__}: {error}") from None

        try:
            async with asyncio.TaskGroup() as lanes:
                for _ in range(RECONCILE_LANES):
                    lanes.create_task(lane())
        except* ContractError as stopped:
            log.warning("reconciling heartbeats stopped early (%s); the next round tries again",
                        stopped.exceptions[0].message)
        if failed:
            log.warning("%d registered workers were not reconciled this round (%s%s); the next round tries again",
                        len(failed), ", ".join(failed[:5]), ", ..." if len(failed) > 5 else "")

    async def _reconcile_now_and_then(self) -> None:
        """`reconcile` every `reconcile_interval_s` while this replica runs, the sweep's shared consumer
        made again first if it is gone (markers written meanwhile were delivered to nobody; the round
        finds them)."""
        failing = ""  # the last round's failure, as said: its traceback is logged once, not every round
        while not self._stopping:
            await asyncio.sleep(self.reconcile_interval_s)  # a period, not a wait for a condition
            try:
                if await self.liveness.sweeper.ensure_consumer():
                    log.warning("the heartbeat sweep's consumer %s was gone (or an earlier version's); made again",
                                SWEEPER)
            except Exception as error:  # unanswered (its group without a leader): the round finds its markers
                log.warning("the heartbeat sweep's consumer %s could not be looked at (%s: %s); reconciling all "
                            "the same", SWEEPER, type(error).__name__, error)
            try:
                await self.reconcile()
            except Exception as error:  # a bug: logged, and the next round
                said, failing = failing, f"{type(error).__name__}: {error}"
                if said == failing:
                    log.error("reconciling heartbeats still fails (%s, traceback above); again in %gs", failing,
                              self.reconcile_interval_s)
                else:
                    log.exception("reconciling heartbeats failed; again in %gs", self.reconcile_interval_s)
            else:
                failing = ""
