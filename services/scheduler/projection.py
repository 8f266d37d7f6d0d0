"""The scheduler's projection: a pure fold of the event log (no I/O, no clock, no asyncio).

`Projection.apply(seq, event, version)` folds one event of the stream, in stream
order, into the records of `services.scheduler.records` (interned through
`services.scheduler.interner`). What it keeps is exactly what placement,
`fragmentation` and `whatif` read:

- workers: node, capacity, labels, state (REGISTERED, DRAINED; a removed worker is
  dropped), per sandbox class the default and restorable runtimes and the compatible
  versions they accept, what is booked on them and by how many actors;
- per sandbox class (`ClassIndex`): the workers by the role in which they accept each
  compat key (own default, own restorable, edge of either), by node and by their
  default's architecture, so that the candidates of every tier of a decision are one
  dictionary look-up away, never a scan; and the counts fragmentation reads;
- actors: state, what they ask for (`Spec`), their latest snapshot (`SnapshotKind`:
  template, fidelity, stamp, borrowed, where it lives; and its id), the assignment
  (worker, booking, pin) while RUNNING, and the last placements of this life that
  carried a request id (idempotent retries);
- per subject the scheduler writes (`actor.<id>`, `booking.<worker id>`): the
  aggregate version and the stream sequence of its last event, which are the
  optimistic-concurrency expectations of the next commit.
"""

from __future__ import annotations

from typing import Any, Callable

from msgspec.structs import astuple

from events.schema import (
    Action,
    ActorCreated,
    ActorPlaced,
    ActorReleased,
    ActorReverted,
    ActorStopped,
    Event,
    Location,
    Placement,
    ReleaseReason,
    RuntimeChanged,
    Snapshot,
    SnapshotOrigin,
    SnapshotTaken,
    TagRecorded,
    TemplateChanged,
    WorkerBooked,
    WorkerDrained,
    WorkerFenced,
    WorkerRegistered,
    WorkerRemoved,
    WorkerSandboxClass,
    WorkerUpdated,
)
from events.compat import compat_key
from events.states import WAITING
from services.scheduler.feasibility import carries_out
from services.scheduler.interner import Interner
from services.scheduler.places import Disks, describe, node_of
from services.scheduler.records import (
    ACTOR_FIELDS,
    CREATED,
    DRAINED,
    MEMORY,
    PAUSED,
    REGISTERED,
    RUNNING,
    STOPPED,
    SUSPENDED,
    Actor,
    Assigned,
    ClassEntry,
    ClassIndex,
    Lease,
    Worker,
    bump_count,
    named_image,
    recent_of,
    set_member,
    request_hash,
    with_placement,
)

class Projection:
    """The fold. `seq` is the stream sequence of the last message folded."""

    def __init__(self) -> None:
        self.seq = 0
        self.events = 0
        # The creation time of the stream this is a fold of (`stream_identity`): its incarnation. A
        # stream deleted and made again (the event store makes it again) is another log whose
        # sequences start over, and this projection is of none of it. Set by the fold that starts
        # it from sequence 1, or from the checkpoint it is restored from; None until then.
        self.stream_created: str | None = None
        # The stream time of the message at `seq` as it was delivered (nanoseconds, or the delivery's
        # token of them; 0: not known): with `seq`, which message the fold reached. A log restored from
        # a copy keeps its creation time, and a message of its own at that sequence has another time.
        self.seq_time: int | bytes | str = 0
        self.workers: dict[str, Worker] = {}
        # node -> the first and the latest other node token its workers registered: which disk of a node a
        # worker is on (`Worker.place`), and a LOCAL image (`Actor.image_node`), for rule 5
        self.disks = Disks()
        self.classes: dict[str, ClassIndex] = {}
        self.actors: dict[str, Actor] = {}
        # (version, last seq) of `booking.<id>` subjects of workers not registered now (a
        # registered worker keeps its own), and of any other subject, by aggregate id
        self.bookings: dict[str, tuple[int, int]] = {}
        self.subjects: dict[str, tuple[int, int]] = {}
        # actor id -> sequence of the ActorCreated that began its current life, for actors
        # created more than once (few): an answer recorded before it is of an earlier life
        self.recreated: dict[str, int] = {}
        self.registry_version = 0  # moves with every event of a worker's history (see decide's refusals)
        # the sequence of the last message of an actor's history the fold could not read: a
        # booking marker right after it is that placement's (`Fold.fold_message`)
        self.unread_actor_seq = 0
        # actor id -> the last message of its current life the fold could not read (a newer
        # version's event, or a body this version refuses): what it changed is unknown here,
        # so the actor is not placed from this fold (`decide.resolve`) until its next life
        self.unread_actors: dict[str, int] = {}
        # worker id -> the last message of its history the fold could not read: it may have ended
        # the worker's life, or changed what it runs (`life_unread`)
        self.unread_workers: dict[str, int] = {}
        # called with (actor id, request hash, seq) for each placement folded that carries a
        # request id: what a replica needs to answer a retry that is still waiting to be decided
        self.placed_listener: Callable[[str, int, int], None] | None = None
        self.intern = Interner()
        # an actor event's handler returns the actor's record as it is after the event
        self._dispatch: dict[type, Callable[[Any, int], Actor | None]] = {
            WorkerRegistered: self._worker_registered,
            RuntimeChanged: self._runtime_changed,
            WorkerUpdated: self._worker_updated,
            WorkerDrained: self._worker_drained,
            WorkerRemoved: self._worker_removed,
            ActorCreated: self._actor_created,
            SnapshotTaken: self._snapshot_taken,
            TemplateChanged: self._template_changed,
            ActorPlaced: self._actor_placed,
            ActorReleased: self._actor_released,
            ActorStopped: self._actor_stopped,
            ActorReverted: self._actor_reverted,
        }

    # --- the fold ---------------------------------------------------------------------

    def apply(self, seq: int, event: Event, version: int | None = None) -> None:
        """Fold one event recorded at stream sequence `seq` (its aggregate version if known)."""
        if seq > self.seq:
            self.seq = seq
        self.events += 1
        kind = type(event)
        if kind is WorkerBooked or kind is WorkerFenced:
            self._booked(seq, event.worker_id, version)
            return
        handler = self._dispatch.get(kind)
        if handler is None and kind not in self._dispatch:  # a subclass of an event type folds as that type
            handler = self._dispatch[kind] = next((self._dispatch[t] for t in kind.__mro__ if t in self._dispatch),
                                                  None)
        if event.KIND == "actor":
            actor = self.actors.get(event.actor_id)
            if actor is None and kind is not ActorCreated:
                self._other_subject(f"actor.{event.actor_id}", seq, version)
                if isinstance(event, ActorPlaced):
                    # a placement of an actor this fold has no record of (its creation unread): what
                    # it booked is not counted here, so its booking marker drains the worker, as that
                    # of a placement this fold cannot read does (`Fold.fold_message`)
                    self.unread_actor_seq = seq
                return
            if handler is not None:
                actor = handler(event, seq)  # an actor's handler gives its record as it is now
            actor.version = version or actor.version + 1
            actor.last_seq = seq
            return
        if handler is not None:
            handler(event, seq)
            if event.KIND == "worker":
                self.registry_version += 1  # what decisions found of the fleet may no longer hold
        elif kind is TagRecorded:
            self._other_subject(f"tag.{event.tag}", seq, version)
        elif event.KIND == "booking":  # a marker of a kind this fold does not know: its sequence still guards
            self._booked(seq, event.worker_id, version)

    def booking_marker(self, seq: int, worker_id: str, version: int | None = None) -> None:
        """Fold a message of `booking.<worker id>` (a placement's WorkerBooked or the registry's
        WorkerFenced) known from its subject alone (all the fold needs of it), without decoding
        its body; the same as `apply` of the event."""
        if seq > self.seq:
            self.seq = seq
        self.events += 1
        self._booked(seq, worker_id, version)

    def _booked(self, seq: int, worker_id: str, version: int | None) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.booking_version = version or worker.booking_version + 1
            worker.booking_seq = seq
            return
        previous = self.bookings.get(worker_id)
        self.bookings[worker_id] = (version or (previous[0] + 1 if previous else 1), seq)

    def skip(self, seq: int) -> None:
        """A message that is not an event (e.g. a tracking record) still advances the position."""
        if seq > self.seq:
            self.seq = seq

    def actor_unread(self, seq: int, actor_id: str) -> None:
        """A message of the actor's history this fold cannot read (`Fold._unread`): it may have
        changed what a resume restores (a newer snapshot, its stamp), so the actor is not placed
        from this fold until a creation this fold reads starts its next life. A booking marker
        right after it was a placement's (`booking_unread`)."""
        self.skip(seq)
        self.unread_actor_seq = seq
        self.unread_actors[actor_id] = seq

    def unread_of(self, actor_id: str) -> int | None:
        """The message of the actor's current life this fold cannot read (`actor_unread`), None if none: what
        it changed is unknown here, so the scheduler does not place the actor (`decide.resolve`) and `audit
        verify` does not judge its placements and releases, until a creation this fold reads begins its
        next life."""
        return self.unread_actors.get(actor_id) if self.unread_actors else None

    def tag_unread(self, seq: int, tag: str) -> None:
        """A message of a tag's history this fold cannot read: nothing the scheduler decides reads
        tags, so it only advances the position (`audit verify` forgets what the tag names)."""
        self.skip(seq)

    def actor_seq(self, actor_id: str) -> int:
        """The last message of the actor's history this fold has met, read or not (0 if none): what
        a decision about the actor was taken on, to compare with the stream leader's."""
        seq = self.actor_expectation(actor_id)[1]  # the last message folded (or kept of an unknown actor)
        return max(seq, self.unread_actors.get(actor_id, 0)) if self.unread_actors else seq

    def answerable(self, actor_id: str, seq: int) -> bool:
        """Whether the actor's placement at `seq`, found for a request id, may answer it: not if
        it comes before a message of the actor's history this fold cannot read (that message may
        have begun the actor's next life, to which the placement does not belong)."""
        return not self.unread_actors or seq > self.unread_actors.get(actor_id, 0)

    def life_ended(self, worker_id: str, seq: int) -> str | None:
        """Why the life of `worker_id` that a placement at `seq` was made in has ended, or None
        if, as far as this fold reads, it goes on (`life_unread` says whether it reads all).
        Every write of the registry fences the worker's booking subject, so a fold that has that
        subject as the stream leader has it has every event of the worker's history."""
        worker = self.workers.get(worker_id)
        if worker is None:
            if self.unread_workers and worker_id in self.unread_workers:
                return None  # its life began in a message this fold could not read (`life_unread`)
            return f"worker {worker_id} was removed since"
        if worker.since > seq:
            return f"worker {worker_id} was removed since, and registered again (a new life, at sequence {worker.since})"
        return None

    def cannot_carry_out(self, placement: Placement) -> str | None:
        """Why the worker of `placement` (made earlier: an answer from the log), as this fold has it
        now, cannot carry it out (`feasibility.carries_out`); None if it can."""
        worker = self.workers.get(placement.worker_id)
        if worker is None:  # (removed: `life_ended` says so; else its life began in a message not read here)
            return "this scheduler has not read the registration that began its life"
        pin = placement.sandbox_runtime
        sandbox_class = pin.sandbox_class
        compat = self.intern.compat_of_key
        image = None
        named = named_image(placement)
        if named is not None:
            image = compat(named)
            if image is None:  # a version no worker of the log ran or accepted
                return "no runtime it runs accepts the image's version"
        why = carries_out(worker, sandbox_class, placement.node, compat(compat_key(sandbox_class, pin.version)), image)
        if why is None and placement.action is Action.RESTORE and placement.snapshot_id is not None:
            # rule 5: a LOCAL image restores on its disk only, at any fidelity; a worker naming another disk of the
            # node since (its agent upgraded: it was on that disk all along) cannot load it
            actor = self.actors.get(placement.actor_id)
            if (actor is not None and actor.snapshot is not None and actor.snapshot.local and actor.image_node
                    and actor.snapshot_id == placement.snapshot_id and actor.image_node != worker.place):
                why = (f"it registers {describe(worker.place)} now, not the disk its LOCAL image is on "
                       f"({describe(actor.image_node)})")
        return why

    def life_unread(self, worker_id: str, after: int = 0) -> int:
        """The last message of the worker's history that this fold could not read, if it came after
        `after` and in the worker's current life (0 otherwise; a removal this fold reads forgets the
        ended life's): after a placement, it may have ended the life the placement was made in;
        before, what this fold has of the worker may be stale, or all of it unknown (a life begun
        in such a message)."""
        unread = self.unread_workers.get(worker_id, 0) if self.unread_workers else 0
        worker = self.workers.get(worker_id)
        return unread if unread > after and (worker is None or unread > worker.since) else 0

    def worker_unread(self, seq: int, worker_id: str) -> None:
        """A message of the worker's history this fold cannot read (`Fold._unread`): whatever it
        changed, the worker now counts as drained here (no new placement; it keeps its bookings)
        until a registration starts its next life; and it may have ended the worker's life
        (`life_unread`)."""
        self.skip(seq)
        self.unread_workers[worker_id] = seq
        self._drain(worker_id)
        self.registry_version += 1

    def booking_unread(self, worker_id: str) -> None:
        """The booking marker just folded belongs to a placement this fold could not read
        (`Fold._unread`): the room it booked is unknown here, so the worker counts as drained
        (no new placement; it keeps its bookings) until a registration starts its next life."""
        self._drain(worker_id)
        self.registry_version += 1

    def _other_subject(self, aggregate_id: str, seq: int, version: int | None) -> None:
        previous = self.subjects.get(aggregate_id)
        self.subjects[aggregate_id] = (version or (previous[0] + 1 if previous else 1), seq)

    def class_index(self, sandbox_class: str) -> ClassIndex:
        index = self.classes.get(sandbox_class)
        if index is None:
            index = self.classes[sandbox_class] = ClassIndex(sandbox_class)
        return index

    def image_lost(self, actor: Actor) -> bool:
        """Whether `actor` waits on a LOCAL image that no registered worker of its class is on the disk
        of (its node has none, or has registered from another disk since; or it names no node): what
        fragmentation counts as lost (`ClassIndex.lost_local`), given up only by a revert."""
        kind = actor.snapshot
        if kind is None or not kind.local or actor.state not in WAITING:
            return False
        index = self.classes.get(actor.spec.sandbox_class)
        return not actor.image_node or index is None or actor.image_node not in index.by_node

    def registered(self, sandbox_class: str) -> bool:
        """Whether a registered worker (drained or not) runs the class. Not whether the class has an
        index: one outlives its last worker, and one is made for an actor's class."""
        index = self.classes.get(sandbox_class)
        return index is not None and bool(index.workers.items)

    # --- workers ------------------------------------------------------------------------

    def _index(self, worker: Worker, delta: int) -> None:
        """Add (+1) or remove (-1) a worker from the indices of its classes."""
        live = worker.live
        node = worker.place
        for name, entry in worker.classes.items():
            index = self.class_index(name)
            set_member(index.by_node, node, worker, delta)
            set_member(index.by_arch, entry.arch, worker, delta)
            if delta > 0:
                if worker not in index.workers:
                    index.workers.add(worker)
                    worker.sets.append(index.workers)
                    index.count_capacity(worker, +1)
            elif worker in index.workers:
                index.workers.discard(worker)
                index.count_capacity(worker, -1)
                if index.workers in worker.sets:
                    worker.sets.remove(index.workers)
            for compat, roles in entry.roles.items():
                for role in roles:
                    set_member(index.members[role], compat, worker, delta)
                if live:
                    bump_count(index.live[roles[0]], compat, delta)
                    bump_count(index.live_on_node, (node, compat), delta)

    def _set_live(self, worker: Worker, live: bool) -> None:
        """Move a worker's contribution to the live counts when it is drained (or undrained)."""
        if worker.live == live:
            return
        delta = 1 if live else -1
        node = worker.place
        for name, entry in worker.classes.items():
            index = self.class_index(name)
            for compat, (role, _) in entry.accepts.items():
                bump_count(index.live[role], compat, delta)
                bump_count(index.live_on_node, (node, compat), delta)

    def _classes(self, entries: tuple[WorkerSandboxClass, ...]) -> dict[str, ClassEntry]:
        named = [self.intern.text(entry.sandbox_class) for entry in entries]
        return self.intern.entries(
            (name, self.intern.runtime(name, entry.default_runtime),
             tuple(self.intern.runtime(name, r) for r in entry.restorable_runtimes))
            for name, entry in zip(named, entries))

    def _worker_registered(self, event: WorkerRegistered, seq: int) -> None:
        worker = self.workers.get(event.worker_id)
        if worker is not None:
            # The registry writes a WorkerRegistered only to begin a life, so the last one ended in a
            # message this fold could not read: a new life all the same (`since`), on the same record,
            # whose bookings go on counting until their actors are released (none is overbooked).
            self._index(worker, -1)
            worker.since = seq
        else:
            worker = self.workers[event.worker_id] = Worker(event.worker_id)
            worker.since = seq
            previous = self.bookings.pop(event.worker_id, None)  # booked before, under another record
            if previous is not None:
                worker.booking_version, worker.booking_seq = previous
        worker.state = REGISTERED
        worker.node = self.intern.text(event.node)
        worker.place = self.intern.text(self.disks.place(worker.node, event.node_token, f"{worker.worker_id}@{seq}"))
        worker.token = event.node_token
        worker.cpu_millis = event.capacity.cpu_millis
        worker.memory_mib = event.capacity.memory_mib
        worker.labels = self.intern.selectors(event.labels)
        worker.classes = self._classes(event.sandbox_classes)
        self._index(worker, +1)

    def _runtime_changed(self, event: RuntimeChanged, seq: int) -> None:
        worker = self.workers.get(event.worker_id)
        if worker is None:
            return
        self._index(worker, -1)
        worker.classes = self._classes(event.sandbox_classes)
        self._index(worker, +1)

    def _worker_updated(self, event: WorkerUpdated, seq: int) -> None:
        worker = self.workers.get(event.worker_id)
        if worker is None:
            return
        node = self.intern.text(event.node)
        # an update that gives no token on the same node says nothing new of its disk: its place and token stay
        place = worker.place
        if event.node_token is not None or node != worker.node:
            place = self.intern.text(self.disks.place(node, event.node_token, f"{worker.worker_id}@{seq}"))
            worker.token = event.node_token
        if place is not worker.place:  # its place in the per-place indices moves with it
            self._index(worker, -1)
            worker.node, worker.place = node, place
            self._index(worker, +1)
        capacity = event.capacity
        if capacity.cpu_millis != worker.cpu_millis or capacity.memory_mib != worker.memory_mib:
            # the largest of each of its classes (`ClassIndex.largest`) counts the capacities of their workers
            indices = [index for index in map(self.class_index, worker.classes) if worker in index.workers]
            for index in indices:
                index.count_capacity(worker, -1)
            worker.cpu_millis = capacity.cpu_millis
            worker.memory_mib = capacity.memory_mib
            for index in indices:
                index.count_capacity(worker, +1)
        worker.labels = self.intern.selectors(event.labels)

    def _worker_drained(self, event: WorkerDrained, seq: int) -> None:
        self._drain(event.worker_id)

    def _drain(self, worker_id: str) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            self._set_live(worker, False)
            worker.state = DRAINED

    def _worker_removed(self, event: WorkerRemoved, seq: int) -> None:
        if self.unread_workers:  # what the ended life held that this fold could not read no longer matters
            self.unread_workers.pop(event.worker_id, None)
        worker = self.workers.pop(event.worker_id, None)
        if worker is None:
            return
        self._index(worker, -1)
        if worker.booking_seq:  # its booking subject goes on; a new registration takes it up
            self.bookings[worker.worker_id] = (worker.booking_version, worker.booking_seq)
        # Actors still assigned keep a reference to this record until the snapshotter
        # releases them; their bookings no longer count anywhere.

    # --- actors -------------------------------------------------------------------------

    def _count(self, actor: Actor, delta: int) -> None:
        """Count (or uncount) what fragmentation reads of a waiting actor's latest snapshot:
        a MEMORY snapshot of its current template (SUSPENDED or PAUSED) for `stranded`, and
        a LOCAL one's node for `lost_local`."""
        kind = actor.snapshot
        if kind is None:
            return
        state = actor.state
        if kind.local and state in WAITING:
            bump_count(self.class_index(actor.spec.sandbox_class).local_waiting, actor.image_node or "", delta)
        if kind.fidelity is MEMORY and kind.stamp is not None and (state is SUSPENDED or state is PAUSED) \
                and kind.template_uid == actor.spec.template_uid:
            index = self.class_index(actor.spec.sandbox_class)
            compat = kind.stamp.compat
            if kind.local:
                bump_count(index.local_memory, (actor.image_node or "", compat), delta)
            else:
                bump_count(index.external_memory, compat, delta)

    def _set_snapshot(self, actor: Actor, snapshot: Snapshot | None, place: str | None = None) -> None:
        """The actor's latest snapshot is now `snapshot` (None: it has none); a LOCAL one is on
        `place` (where the actor ran when it was taken), if given and of the node it names (or it
        names none); on a disk the fold does not know otherwise (`Disks.unknown`)."""
        if snapshot is None:
            actor.snapshot = actor.snapshot_ref = actor.image_node = None
            return
        prefixed, actor.snapshot_ref = self.intern.snapshot_ref(actor.actor_id, snapshot.snapshot_id)
        runtime = snapshot.sandbox_runtime
        local = snapshot.location is Location.LOCAL
        actor.snapshot = self.intern.snapshot_kind(
            snapshot.template_uid, snapshot.fidelity, self.intern.stamp(runtime) if runtime is not None else None,
            snapshot.borrowed, prefixed, local,
        )
        image_node = None
        if local:
            named = snapshot.node
            if place is not None and (named is None or node_of(place) == named):
                image_node = place
            elif named is not None:
                image_node = self.disks.unknown(named)
        actor.image_node = None if image_node is None else self.intern.text(image_node)

    @staticmethod
    def _running_place(actor: Actor) -> str | None:
        """Where a RUNNING actor's memory is written when it pauses: the place its worker registers
        now (a worker that gave its node token after the placement, the agent upgraded, names its
        disk), or the placement's when the fold has no such worker."""
        worker = actor.worker
        return worker.place if worker is not None and worker.place else actor.node

    def _release(self, actor: Actor) -> Actor:
        """Give up the actor's assignment, if it has one; its record from now on."""
        if type(actor) is not Assigned:
            return actor
        actor.worker.unbook(actor.lease.booked)
        actor = self.actors[actor.actor_id] = Actor(*astuple(actor)[:ACTOR_FIELDS])
        return actor

    def _assign(self, actor: Actor, worker: Worker, lease: Lease) -> Actor:
        """Book the actor on `worker` (after `_release`); its record from now on."""
        worker.book(lease.booked)
        if type(actor) is not Assigned:
            actor = self.actors[actor.actor_id] = Assigned(*astuple(actor))
        actor.worker = worker
        actor.lease = lease
        return actor

    def _actor_created(self, event: ActorCreated, seq: int) -> Actor:
        spec = self.intern.spec(event.sandbox_class, event.template_uid, self.intern.resources(event.resources),
                         self.intern.selectors(event.selectors), event.min_fidelity)
        # a life this fold reads from its start
        unread = self.unread_actors.pop(event.actor_id, None) if self.unread_actors else None
        actor = self.actors.get(event.actor_id)
        if actor is None:
            actor = self.actors[event.actor_id] = Actor(event.actor_id, CREATED, spec)
            previous = self.subjects.pop(f"actor.{event.actor_id}", None) if self.subjects else None
            if previous is not None:
                actor.version, actor.last_seq = previous
            if previous is not None or unread is not None:
                # its subject held messages before: of a life whose creation this fold did not read.
                # An answer recorded before this creation is of that life (`life_started`).
                self.recreated[actor.actor_id] = seq
        else:  # created anew after a stop: a new life, nothing of the last one carries over
            self._count(actor, -1)
            actor = self._release(actor)
            actor.state = CREATED
            actor.spec = spec
            actor.node = None
            # a resume of the last life, decided late (its copy held in a NATS server's buffers while
            # its retry was answered), is refused by its id, as the snapshotter's verbs are
            actor.earlier = recent_of(actor.placements)
            actor.placements = None
            self.recreated[actor.actor_id] = seq
        self._set_snapshot(actor, event.snapshot)
        self._count(actor, +1)
        return actor

    def _snapshot_taken(self, event: SnapshotTaken, seq: int) -> Actor:
        actor = self.actors[event.actor_id]
        origin = event.origin
        if origin is SnapshotOrigin.TAG:  # a copy under a tag: the actor's own latest is unchanged
            return actor
        self._count(actor, -1)
        snapshot = event.snapshot
        # a LOCAL image is on the place the actor runs on (a disk of its node), as is one that names no node
        self._set_snapshot(actor, snapshot, self._running_place(actor) if actor.state is RUNNING else None)
        if origin is SnapshotOrigin.PAUSE:
            node = actor.image_node or actor.node
            actor = self._release(actor)
            actor.state = PAUSED
            actor.node = node
        elif origin is SnapshotOrigin.SUSPEND:
            actor = self._release(actor)
            actor.state = SUSPENDED
            actor.node = None
        elif origin is SnapshotOrigin.PROMOTE:
            actor.state = SUSPENDED
            actor.node = None
        self._count(actor, +1)
        return actor

    def _template_changed(self, event: TemplateChanged, seq: int) -> Actor:
        actor = self.actors[event.actor_id]
        self._count(actor, -1)  # a memory snapshot of the old template no longer counts
        spec = actor.spec
        actor.spec = self.intern.spec(spec.sandbox_class, event.template_uid, spec.resources, spec.selectors,
                               spec.min_fidelity)
        self._count(actor, +1)
        return actor

    def _actor_placed(self, event: ActorPlaced, seq: int) -> Actor:
        actor = self.actors[event.actor_id]
        self._count(actor, -1)
        actor = self._release(actor)  # a placement without a release in between replaces the old one
        worker = self.workers.get(event.worker_id)
        if worker is None:  # placed on a worker removed meanwhile: a record of its own, which no decision reads
            worker = Worker(event.worker_id)
            worker.state = DRAINED
        actor = self._assign(actor, worker, self.intern.lease(self.intern.resources(event.booked), self.intern.stamp(event.sandbox_runtime)))
        # on its worker's place (the disk it registered from); a worker removed meanwhile, or on another node
        # than the placement names, on a disk the fold does not know
        node = self.intern.text(event.node)
        actor.node = worker.place if worker.node == node else self.intern.text(self.disks.unknown(node))
        actor.state = RUNNING
        request_id = event.request_id
        if request_id is not None:
            request = request_hash(request_id)
            actor.placements = with_placement(actor.placements, request, seq)
            if self.placed_listener is not None:
                self.placed_listener(actor.actor_id, request, seq)
        return actor

    def _actor_released(self, event: ActorReleased, seq: int) -> Actor:
        actor = self.actors[event.actor_id]
        self._count(actor, -1)
        node = self._running_place(actor) if actor.state is RUNNING else actor.node
        actor = self._release(actor)
        reason = event.reason
        if reason is ReleaseReason.PAUSED:
            # pinned to the node it ran on (or the one its PAUSE snapshot, folded first, named)
            actor.state = PAUSED
            actor.node = node
        elif reason is ReleaseReason.STOPPED:
            actor.state = STOPPED
            actor.node = None
        else:  # SUSPENDED, or WORKER_REMOVED: resumable from its latest snapshot, wherever it is
            actor.state = SUSPENDED
            actor.node = None
        self._count(actor, +1)
        return actor

    def _actor_stopped(self, event: ActorStopped, seq: int) -> Actor:
        actor = self.actors[event.actor_id]
        self._count(actor, -1)
        actor = self._release(actor)
        actor.state = STOPPED
        actor.node = None
        return actor

    def _actor_reverted(self, event: ActorReverted, seq: int) -> Actor:
        actor = self.actors[event.actor_id]
        self._count(actor, -1)
        actor = self._release(actor)
        self._set_snapshot(actor, event.snapshot)
        actor.state = SUSPENDED
        actor.node = None
        self._count(actor, +1)
        return actor

    # --- reads --------------------------------------------------------------------------

    def actor_expectation(self, actor_id: str) -> tuple[int, int]:
        """(version, last stream seq) of `actor.<id>`: what the next commit on it expects."""
        actor = self.actors.get(actor_id)
        if actor is not None:
            return actor.version, actor.last_seq
        return self.subjects.get(f"actor.{actor_id}", (0, 0))

    def booking_expectation(self, worker_id: str) -> tuple[int, int]:
        """(version, last stream seq) of `booking.<worker id>`."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            return worker.booking_version, worker.booking_seq
        return self.bookings.get(worker_id, (0, 0))

    def booked_on(self, worker: Worker) -> list[str]:
        """The ids of the actors whose bookings are on `worker` (its record, even if removed since),
        in the projection's order: a pass over the actors, for views (a worker only counts them)."""
        return [a.actor_id for a in self.actors.values() if a.worker is worker]

    def life_started(self, actor_id: str) -> int:
        """The sequence of the ActorCreated that began the actor's current life if it was
        created more than once; 0 otherwise."""
        return self.recreated.get(actor_id, 0)

    def stranded(self, sandbox_class: str | None = None) -> int:
        if sandbox_class is not None:
            index = self.classes.get(sandbox_class)
            return index.stranded() if index else 0
        return sum(index.stranded() for index in self.classes.values())

    def lost_local(self, sandbox_class: str | None = None) -> int:
        if sandbox_class is not None:
            index = self.classes.get(sandbox_class)
            return index.lost_local() if index else 0
        return sum(index.lost_local() for index in self.classes.values())
