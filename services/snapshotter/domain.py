"""What the snapshotter decides: the Actor lifecycle, and the stamp every snapshot gets.

No I/O here, no asyncio, no clock: time comes in as `at`. The NATS wiring is in
`services.snapshotter.service`.

States and transitions (CONTRACT section 3)::

    create            -> CREATED        ActorCreated (+ SnapshotTaken CREATE from a tag/golden)
    resume (scheduler) CREATED|PAUSED|SUSPENDED -> RUNNING   ActorPlaced (written by the scheduler)
    pause             RUNNING -> PAUSED             SnapshotTaken PAUSE, ActorReleased PAUSED
    suspend           RUNNING -> SUSPENDED          SnapshotTaken SUSPEND, ActorReleased SUSPENDED
    suspend           PAUSED  -> SUSPENDED          SnapshotTaken PROMOTE
    tag               any but STOPPED, latest snapshot EXTERNAL: SnapshotTaken TAG (+ TagRecorded on the tag);
                      nothing if the tag names that snapshot already
    update-template   any but STOPPED               TemplateChanged (nothing if unchanged)
    stop              any but STOPPED -> STOPPED    ActorReleased STOPPED if placed, ActorStopped
    worker removed    RUNNING on it -> SUSPENDED    ActorReleased WORKER_REMOVED
    revert            PAUSED, or SUSPENDED with a LOCAL latest snapshot -> SUSPENDED   ActorReverted
    create            STOPPED -> CREATED            a new life (ActorCreated, as from nothing)

Anything else is FAILED_PRECONDITION and records nothing.

The stamp (`Snapshot.sandbox_runtime`) is the runtime the snapshot's memory image was
produced under; its rules, one pure function each, are in `services.snapshotter.stamping`.
Who is placed where (for releases when a worker is removed) is folded by
`services.snapshotter.placements`.

Tags (project addition). A tag is its own small aggregate, `tag.<tag>`, whose
history lives on `<prefix>.ev.tag.<tag>` and holds `TagRecorded` events; the latest
one is what the tag names, so tagging again moves the tag. Tagging writes, in one
atomic append, `SnapshotTaken(origin=TAG)` on the actor (the actor's history shows
it was tagged, and the tag is guarded by the actor's optimistic concurrency, so it
copies the snapshot that is latest at commit) and `TagRecorded` on the tag, which
is what `create` with `source_tag` reads.

Where CONTRACT.md is silent, this is what the snapshotter does:

- Creating an actor that exists is ALREADY_EXISTS (field `actor_id`), unless it is
  STOPPED: then the create starts a new life of the same id (request ids are scoped
  to one life, CONTRACT section 1 v1.1), as a worker registers anew after a removal. From a tag
  that names nothing, NOT_FOUND (field `source_tag`); from a tag whose snapshot is
  stamped with another sandbox class, FAILED_PRECONDITION (field `source_tag`).
- A snapshot taken without a `snapshot_id` gets `<actor_id>-v<version>`
  (`default_snapshot_id`). A promoted snapshot keeps the local one's id and
  `taken_at` unless the caller names it; a tag's copy and a created actor's first
  snapshot keep the source's id (they name the same image).
- A snapshot records the template its running instance was started from, which
  is the template at placement, even if `update-template` ran since: the memory
  image is of that template, and the scheduler falls back (TEMPLATE_CHANGED) when
  it is no longer the actor's.
- `borrowed` stays on the snapshots of an actor created from a golden snapshot
  (a pause's too) until its first suspend; a tag's copy keeps the flag it had.
- An actor whose worker was removed is SUSPENDED: its instance is gone and it
  resumes from its latest snapshot, wherever that is (a LOCAL one only on its node).
  `update-template` to the current template writes nothing. Stop of a STOPPED actor
  is FAILED_PRECONDITION.
- Only an EXTERNAL snapshot can be tagged (v1.1): a tag is for other actors, on any
  node, and a LOCAL image exists on one node only.
- revert (v1.1) gives up the LOCAL latest snapshot and goes back to the actor's
  latest EXTERNAL snapshot of this life (the last one it suspended, promoted or was
  created from), or to none: it then cold-boots. It is the way out for an actor
  whose node is gone; nothing reverts by itself, because the local image holds
  state that a revert loses.
"""

from __future__ import annotations

from datetime import datetime

from events.aggregate import WireAggregate
from events.compat import describe_key, stamp_key
from events.errors import already_exists, created_anew_since, invalid, no_actor, not_found, precondition, unavailable
from events.schema import (
    ActorCreated,
    ActorPlaced,
    ActorReleased,
    ActorReverted,
    ActorStatus,
    ActorStopped,
    CreateActor,
    Event,
    Fidelity,
    ImageNamed,
    Location,
    ReleaseReason,
    Snapshot,
    SnapshotOrigin,
    SnapshotTaken,
    TagRecorded,
    TemplateChanged,
    UnderPlacement,
)
from events.states import WAITING, ActorState
from services.snapshotter.stamping import (
    anothers_default_id,
    default_snapshot_id,
    free_form_id,
    initial_snapshot,
    paused_snapshot,
    promoted_snapshot,
    same_image,
    suspended_snapshot,
    tagged_copy,
)

# A pause or suspend that names no placement (`UnderPlacement`): recorded for the actor's current one.
NOT_NAMED = UnderPlacement()

# States from which the scheduler may place (resume) an actor.
RESUMABLE = tuple(WAITING)


# --- the Actor aggregate ---------------------------------------------------------------


def _taken(*origins: SnapshotOrigin):
    return lambda e: isinstance(e, SnapshotTaken) and e.origin in origins


class Actor(WireAggregate):
    """One actor's history `actor.<actor_id>`: written by the snapshotter and the scheduler."""

    KIND = "actor"
    LIFE_VERB = "create"  # a create of an absent or stopped actor starts a life
    # A copy of one of these that a stalled replica decides late, after the actor was stopped and
    # created anew, would act on the next life: a suspend (a promote) recorded the earlier life's image
    # (its uri) under this life's pin, which a resume then restored where it cannot load (a soak's
    # finding); a stop ended the next life. Their ids are made for one life (docs/contract.md).
    REFUSED_FROM_AN_EARLIER_LIFE = frozenset({"pause", "suspend", "tag", "update-template", "stop", "revert"})
    VERB_FIRST = {
        "create": lambda e: isinstance(e, ActorCreated),
        "pause": _taken(SnapshotOrigin.PAUSE),
        "suspend": _taken(SnapshotOrigin.SUSPEND, SnapshotOrigin.PROMOTE),
        "tag": _taken(SnapshotOrigin.TAG),
        "update-template": lambda e: isinstance(e, TemplateChanged),
        "stop": lambda e: isinstance(e, ActorStopped) or (
            isinstance(e, ActorReleased) and e.reason is ReleaseReason.STOPPED),
        "revert": lambda e: isinstance(e, ActorReverted),
    }

    def __init__(self, entity_id: str):
        super().__init__(entity_id)
        self.state: ActorState | None = None  # None: no ActorCreated yet
        self.sandbox_class = ""
        self.template_uid = ""
        self.template_version = 0  # version of the event that set template_uid
        self.min_fidelity = Fidelity.ROOTFS
        self.latest_snapshot: Snapshot | None = None
        # The current placement (RUNNING only), the version that recorded it, and
        # the template the placed instance was started from.
        self.assignment: ActorPlaced | None = None
        self.assignment_version = 0
        # the last placement, kept once released (a PAUSED actor's: the one its pause ended); recorded
        # at `assignment_version`
        self.placed: ActorPlaced | None = None
        self.running_template_uid = ""
        self.node_pin: str | None = None  # PAUSED: the node that holds the local snapshot
        self.borrows_volumes = False  # created from a golden snapshot, not suspended since
        self.latest_external: Snapshot | None = None  # what a revert goes back to
        # every snapshot it ever had, each life, by id: the last recorded under it (`next_snapshot_id`)
        self.snapshot_ids: dict[str, Snapshot] = {}

    # --- guards ---

    def require(self, verb: str, *states: ActorState, endpoint: str | None = None) -> None:
        """NOT_FOUND for an actor never created; FAILED_PRECONDITION unless it is in one of `states`:
        "cannot `verb` actor 'a': it is STOPPED, `endpoint` (default: the verb) needs ..."."""
        if self.state is None:
            raise no_actor(self.entity_id)
        if self.state not in states:
            allowed = " or ".join(s.value for s in states)
            raise precondition(
                f"cannot {verb} actor {self.entity_id!r}: it is {self.state.value}, "
                f"{endpoint or verb} needs {allowed}"
            )

    def require_live(self, verb: str, endpoint: str | None = None) -> None:
        self.require(verb, ActorState.CREATED, ActorState.RUNNING, ActorState.PAUSED,
                     ActorState.SUSPENDED, endpoint=endpoint)

    def next_snapshot_id(self, requested: str | None, same_image: str | None = None) -> str:
        """The id of a new image: `requested`, unless it names another snapshot this actor had
        (FAILED_PRECONDITION, field `snapshot_id`); else `<actor_id>-v<version>`, or, should a
        caller have taken that one, the first `...-<n>` free. A worker finds an image by its id
        (an Assignment names nothing else), so one id names one image: an id reused after a
        revert named both an EXTERNAL image and a LOCAL one of another stamp. `same_image`: the id
        of the image this one is (a promote keeps it), which is not a reuse."""
        if requested is not None:
            if requested != same_image:
                self._not_anothers_default(requested, "snapshot_id")
            if requested != same_image and requested in self.snapshot_ids:
                raise precondition(
                    f"snapshot_id {requested!r} already names another snapshot of actor {self.entity_id!r}: "
                    "a worker finds an image by its id, so one id names one image; give a new one, or none",
                    "snapshot_id")
            return requested
        step = 0
        while (made := default_snapshot_id(self.entity_id, self.version + 1, step)) in self.snapshot_ids:
            step += 1
        return made

    def _not_anothers_default(self, snapshot_id: str, field: str) -> None:
        """INVALID_ARGUMENT if a caller's `snapshot_id` has the form of another actor's default ids
        (`stamping.anothers_default_id`): default ids would no longer name one image each. An id this
        actor's history holds is its own, whatever rule made it (a default of a log written before
        the rule changed); whether it may name this image is `snapshot_ids`' concern."""
        if snapshot_id not in self.snapshot_ids and anothers_default_id(self.entity_id, snapshot_id):
            raise invalid(
                f"{field} {snapshot_id!r} has the form of the ids the snapshotter gives another actor's snapshots "
                "(<actor_id>-v<version>): a worker finds an image by its id, so that actor's resume could load "
                "this image; give another id, or none", field)

    def _one_image(self, snapshot: Snapshot, what: str, advice: str, field: str) -> None:
        """FAILED_PRECONDITION if the id of `snapshot`, a create's image, already names another image
        of this actor (an earlier life's): a worker finds an image by its id, so one id names one image
        (found by an audit for a golden snapshot, and by another for a tag's)."""
        earlier = self.snapshot_ids.get(snapshot.snapshot_id)
        if earlier is not None and not same_image(earlier, snapshot):
            raise precondition(
                f"{what} already names another snapshot of actor {self.entity_id!r} (an earlier life's): a worker "
                f"finds an image by its id, so one id names one image; {advice}", field)

    @property
    def alive(self) -> bool:
        """Created and not stopped since: a create now would not start a new life."""
        return self.state is not None and self.state is not ActorState.STOPPED

    def starts_life(self, body: Event) -> bool:
        return isinstance(body, ActorCreated)

    # --- commands: decide, then record ---

    def create(self, request: CreateActor, tagged: Snapshot | None, at: datetime) -> None:
        """Create from nothing, a tag's snapshot (resolved by the caller) or a golden snapshot;
        a STOPPED actor is created anew (a new life of the same id)."""
        if self.alive:
            raise already_exists(f"actor {self.entity_id!r} already exists", "actor_id")
        if request.source_tag is not None and tagged is None:
            raise not_found(f"tag {request.source_tag!r} does not exist", "source_tag")
        if tagged is not None and tagged.sandbox_runtime is not None \
                and tagged.sandbox_runtime.sandbox_class != request.sandbox_class:
            raise precondition(
                f"tag {request.source_tag!r} names a snapshot of class "
                f"{tagged.sandbox_runtime.sandbox_class!r}, not {request.sandbox_class!r}",
                "source_tag",
            )
        if tagged is not None:
            if tagged.location is not Location.EXTERNAL:  # a tag written before v1.1 may name a LOCAL image
                raise precondition(
                    f"tag {request.source_tag!r} names the LOCAL snapshot {tagged.snapshot_id!r} on node "
                    f"{tagged.node!r} (tagged before v1.1): its image is on that node only, and a tag is for "
                    "other actors on any node; tag an EXTERNAL snapshot", "source_tag")
            self._one_image(tagged, f"tag {request.source_tag!r} names snapshot_id {tagged.snapshot_id!r}, which",
                            "tag another snapshot, or create under another actor_id", "source_tag")
        golden = request.golden_snapshot
        if golden is not None:
            self._not_anothers_default(golden.snapshot_id, "golden_snapshot.snapshot_id")
            self._one_image(golden, f"golden_snapshot.snapshot_id {golden.snapshot_id!r}", "give a new one",
                            "golden_snapshot.snapshot_id")
        snapshot = initial_snapshot(self.entity_id, tagged, request.golden_snapshot)
        self.record(ActorCreated(
            actor_id=self.entity_id,
            sandbox_class=request.sandbox_class,
            template_uid=request.template_uid,
            resources=request.resources,
            selectors=request.selectors,
            min_fidelity=request.min_fidelity,
            snapshot=snapshot,
            at=at,
            request_id=request.request_id,
        ))
        if snapshot is not None:
            # Every snapshot an actor ever had is a SnapshotTaken in its history.
            self.record(SnapshotTaken(
                actor_id=self.entity_id, snapshot=snapshot, origin=SnapshotOrigin.CREATE,
                at=at, request_id=request.request_id,
            ))

    def place(self, placed: ActorPlaced) -> None:
        """resume (decided by the scheduler): the actor runs where `placed` says, pinned to its runtime."""
        if placed.actor_id != self.entity_id:
            raise ValueError(f"placement of {placed.actor_id!r} recorded on actor {self.entity_id!r}")
        self.require("resume", *RESUMABLE)
        if self.state is ActorState.PAUSED and placed.node != self.node_pin:
            raise precondition(
                f"actor {self.entity_id!r} is paused on node {self.node_pin!r}; "
                f"it resumes only there, not on {placed.node!r}"
            )
        self.record(placed)

    def require_placement(self, under: UnderPlacement, verb: str) -> None:
        """With `placement_seq` (the `seq` of the Assignment a resume answered: its ActorPlaced's, or
        that of the booking marker written right after it in the same batch), the image a pause or a
        suspend records was taken under that placement: FAILED_PRECONDITION (field `placement_seq`)
        unless it is the actor's current one, or, for a PAUSED actor, the one its pause ended.
        Otherwise the actor was released and placed again (its worker removed, say) while the image
        was being taken, and the record would stamp that image with another placement's pin and node
        (found by an audit: a pause decided after such a move recorded the new pin). With its worker,
        node and pin too (`placement_worker_id`, `placement_node`, `placement_runtime`), the placement
        at that sequence must be that one (`same_placement`)."""
        placement_seq = under.placement_seq
        if placement_seq is None:
            return
        placed = self.seq_at(self.assignment_version) if self.assignment_version else 0
        if self.assignment_version and not placed:  # the event store names every event's position
            raise unavailable(f"the event store did not say where the placement of actor {self.entity_id!r} is")
        if placed and placed <= placement_seq <= placed + 1:
            return self.same_placement(under, placed, verb)
        held = self.assignment
        # `actor resume` printed the Assignment's seq: the booking marker's, one after the ActorPlaced
        answered = f"(recorded at sequence {placed}; its resume answered {placed} or {placed + 1})"
        now = (f"it is placed on worker {held.worker_id!r} {answered}" if held is not None
               else f"its image is of the placement {answered}" if placed
               else "it has never been placed")
        raise precondition(
            f"cannot record a {verb} of actor {self.entity_id!r} taken under the placement at sequence "
            f"{placement_seq}: {now}; nothing recorded (the image taken there is not that placement's)",
            "placement_seq",
        )

    def same_placement(self, under: UnderPlacement, placed: int, verb: str) -> None:
        """FAILED_PRECONDITION (field `placement_worker_id`, `placement_node` or `placement_runtime`)
        unless the placement recorded at `placed`, the one `under.placement_seq` names, is on the worker
        and node and under the pin `under` says. Only a log rolled back past the placement the image
        was taken under, and written again since, holds another one at its sequence
        (docs/operations.md, "Backup and restore"): the record would stamp the image with that one's
        pin and node, not the image's own (an audit's experiment: an image taken on w1 under V2
        recorded as V1's, on w0's node)."""
        held = self.placed
        assert held is not None  # recorded at `placed`
        if under.placement_worker_id not in (None, held.worker_id):
            field, named, found = "placement_worker_id", f"worker {under.placement_worker_id!r}", \
                f"worker {held.worker_id!r}"
        elif under.placement_node not in (None, held.node):  # the worker id registered on another node
            field, named, found = "placement_node", f"node {under.placement_node!r}", f"node {held.node!r}"
        elif under.placement_runtime is not None and (pin := stamp_key(under.placement_runtime)) != (
                recorded := stamp_key(held.sandbox_runtime)):
            field, named, found = "placement_runtime", f"runtime {describe_key(pin)}", \
                f"runtime {describe_key(recorded)}"
        else:
            return
        raise precondition(
            f"cannot record a {verb} of actor {self.entity_id!r} taken under its placement on {named} at sequence "
            f"{under.placement_seq}: the placement recorded there is on {found}, another one (the log was rolled "
            "back past the one this image was taken under and written again since); nothing recorded (the image "
            "is not that placement's)", field)

    def require_life(self, life_seq: int | None, verb: str, outcome: str) -> None:
        """With `life_seq` (a stream sequence of the actor's life the request is for: its create's
        reply, `status`'s `life_seq`), FAILED_PRECONDITION (field `life_seq`, `created_anew_since`)
        if the actor was created anew after it: a copy of a stop, tag, revert or update-template held
        somewhere (a NATS server stopped with it in its buffers), its caller gone, and decided in the
        actor's next life would stop that life, tag its image, give it up or change its template.
        A resume's is the scheduler's check (`ResumeActor.life_seq`), a pause's and a suspend's the
        placement's (`require_placement`), which is finer. Called on a live or stopped actor; where its
        life began is what `status` says."""
        if life_seq is None:
            return
        started = self.status().life_seq
        if life_seq < started:
            raise created_anew_since(self.entity_id, life_seq, started, verb, outcome)

    def status(self) -> ActorStatus:
        """The actor as its history has it, with the sequences a later request names: its life's
        creation (the `life_seq` of a resume, stop, tag, revert or update-template) and the placement
        `require_placement` holds a pause or suspend to (its `placement_seq`; none if this life has not
        been placed); and its latest snapshot. NOT_FOUND if it was never created."""
        if self.state is None:
            raise no_actor(self.entity_id)
        placed = self.assignment_version if self.assignment_version >= self.life_start else 0
        seqs = (self.seq_at(self.life_start), self.seq_at(placed) if placed else None, self.seq_at(self.version))
        if 0 in seqs:  # the event store names every event's position
            raise unavailable(f"the event store did not say where the events of actor {self.entity_id!r} are")
        return ActorStatus(state=self.state, life_seq=seqs[0], placement_seq=seqs[1], seq=seqs[2],
                           snapshot=self.latest_snapshot)

    def pause(self, snapshot_id: str | None, request_id: str | None, at: datetime,
              under: UnderPlacement = NOT_NAMED) -> Snapshot:
        """RUNNING -> PAUSED: a local memory snapshot stamped from the pin; the assignment is released."""
        self.require("pause", ActorState.RUNNING)
        self.require_placement(under, "pause")
        assignment = self.assignment
        assert assignment is not None  # RUNNING always has one
        snapshot = paused_snapshot(
            self.entity_id, self.next_snapshot_id(snapshot_id), self.running_template_uid,
            assignment, self.borrows_volumes, at,
        )
        self.record(SnapshotTaken(
            actor_id=self.entity_id, snapshot=snapshot, origin=SnapshotOrigin.PAUSE,
            at=at, request_id=request_id,
        ))
        self.release(assignment, ReleaseReason.PAUSED, request_id, at)
        return snapshot

    def suspend(
        self, snapshot_id: str | None, uri: str | None, fidelity: Fidelity,
        request_id: str | None, at: datetime, under: UnderPlacement = NOT_NAMED,
    ) -> Snapshot:
        """RUNNING -> SUSPENDED (new external snapshot, assignment released), or
        PAUSED -> SUSPENDED (the local snapshot promoted, node pin cleared)."""
        self.require("suspend", ActorState.RUNNING, ActorState.PAUSED)
        self.require_placement(under, "suspend")
        if self.state is ActorState.PAUSED:
            local = self.latest_snapshot
            assert local is not None  # PAUSED always has its local snapshot
            snapshot = promoted_snapshot(local, self.next_snapshot_id(snapshot_id, same_image=local.snapshot_id)
                                         if snapshot_id is not None else None, fidelity, uri)
            self.record(SnapshotTaken(
                actor_id=self.entity_id, snapshot=snapshot, origin=SnapshotOrigin.PROMOTE,
                at=at, request_id=request_id,
            ))
            return snapshot
        assignment = self.assignment
        assert assignment is not None
        snapshot = suspended_snapshot(
            self.entity_id, self.next_snapshot_id(snapshot_id), self.running_template_uid,
            assignment, fidelity, uri, at,
        )
        self.record(SnapshotTaken(
            actor_id=self.entity_id, snapshot=snapshot, origin=SnapshotOrigin.SUSPEND,
            at=at, request_id=request_id,
        ))
        self.release(assignment, ReleaseReason.SUSPENDED, request_id, at)
        return snapshot

    def tag(self, tag: "Tag", request_id: str | None, at: datetime,
            life_seq: int | None = None) -> tuple[Snapshot, bool]:
        """Name a copy of the latest snapshot with `tag` (recorded on the actor and on the tag), and
        whether anything was recorded: nothing when the tag names that very snapshot already (a
        re-tag wrote two events each time, a user trial's finding; as a drain of a drained worker)."""
        self.require_live("tag")
        self.require_life(life_seq, "tag", "nothing tagged")
        latest = self.latest_snapshot
        if latest is None:
            raise precondition(f"cannot tag actor {self.entity_id!r}: it has no snapshot yet")
        if latest.location is not Location.EXTERNAL:
            raise precondition(
                f"cannot tag actor {self.entity_id!r}: its latest snapshot {latest.snapshot_id!r} is LOCAL "
                f"on node {latest.node!r}; a tag is for other actors on any node: suspend it first "
                "(the image is promoted to EXTERNAL), then tag"
            )
        snapshot = tagged_copy(self.latest_snapshot)
        if tag.snapshot == snapshot:
            return snapshot, False
        self.record(SnapshotTaken(
            actor_id=self.entity_id, snapshot=snapshot, origin=SnapshotOrigin.TAG,
            at=at, request_id=request_id,
        ))
        tag.name(snapshot, request_id, at)
        return snapshot, True

    def change_template(self, template_uid: str, request_id: str | None, at: datetime,
                        life_seq: int | None = None) -> bool:
        """The template the next resume uses; False (nothing recorded) when it is already that one.

        A running instance keeps the template it was started from: its snapshots
        record that one, so a memory image of the old template is not restored
        under the new one (the scheduler falls back with TEMPLATE_CHANGED).
        """
        self.require_live("update the template of", "update-template")
        self.require_life(life_seq, "update-template", "nothing changed")
        if template_uid == self.template_uid:
            return False
        self.record(TemplateChanged(
            actor_id=self.entity_id, template_uid=template_uid, at=at, request_id=request_id,
        ))
        return True

    def stop(self, request_id: str | None, at: datetime, life_seq: int | None = None) -> None:
        """Any live state -> STOPPED, releasing the assignment first if it holds one."""
        self.require_live("stop")
        self.require_life(life_seq, "stop", "nothing stopped")
        if self.assignment is not None:
            self.release(self.assignment, ReleaseReason.STOPPED, request_id, at)
        self.record(ActorStopped(actor_id=self.entity_id, at=at, request_id=request_id))

    def revert(self, reason: str | None, request_id: str | None, at: datetime,
               life_seq: int | None = None) -> Snapshot | None:
        """Give up the LOCAL latest snapshot: back to the latest EXTERNAL one (or none), SUSPENDED."""
        if self.state is None:
            raise no_actor(self.entity_id)
        self.require_life(life_seq, "revert", "nothing given up")
        local = self.latest_snapshot
        if self.state is not ActorState.PAUSED and not (
            self.state is ActorState.SUSPENDED and local is not None and local.location is Location.LOCAL
        ):
            raise precondition(
                f"cannot revert actor {self.entity_id!r}: it is {self.state.value}"
                + ("" if local is None else f" with its latest snapshot {local.location.value}")
                + "; revert gives up a LOCAL image: it needs a PAUSED actor, or a SUSPENDED one "
                "whose latest snapshot is LOCAL"
            )
        assert local is not None  # PAUSED always has its local snapshot
        back = self.latest_external
        self.record(ActorReverted(
            actor_id=self.entity_id, snapshot=back, abandoned=local, reason=reason,
            at=at, request_id=request_id,
        ))
        return back

    def release_from_removed_worker(self, worker_id: str, placed_version: int, at: datetime) -> bool:
        """Release the placement made at `placed_version` on the removed `worker_id`, if still held.

        A no-op (False) when that placement has already ended: released by a pause,
        a suspend, a stop, or by another replica of this process. Comparing the
        placement's version, not just the worker id, keeps a late or replayed
        removal from releasing a newer placement on a worker of the same id.
        """
        held = self.assignment
        if held is None or held.worker_id != worker_id or self.assignment_version != placed_version:
            return False
        self.release(held, ReleaseReason.WORKER_REMOVED, None, at)
        return True

    def release(
        self, assignment: ActorPlaced, reason: ReleaseReason, request_id: str | None, at: datetime
    ) -> None:
        self.record(ActorReleased(
            actor_id=self.entity_id, worker_id=assignment.worker_id, reason=reason,
            at=at, request_id=request_id,
        ))

    # --- events: change state, never refuse (they are facts) ---

    def when_ActorCreated(self, e: ActorCreated) -> None:
        self.state = ActorState.CREATED
        self.sandbox_class = e.sandbox_class
        self.template_uid = e.template_uid
        self.template_version = self.version + 1
        self.min_fidelity = e.min_fidelity
        self.latest_snapshot = e.snapshot
        self.borrows_volumes = e.snapshot is not None and e.snapshot.borrowed
        self.latest_external = e.snapshot if e.snapshot is not None and e.snapshot.location is Location.EXTERNAL \
            else None
        self.assignment = None
        self.node_pin = None

    def when_SnapshotTaken(self, e: SnapshotTaken) -> None:
        self.snapshot_ids[e.snapshot.snapshot_id] = e.snapshot
        if e.origin is SnapshotOrigin.TAG:  # a copy under a tag: the actor's own latest is unchanged
            return
        self.latest_snapshot = e.snapshot
        if e.snapshot.location is Location.EXTERNAL:
            self.latest_external = e.snapshot
        if e.origin is SnapshotOrigin.PROMOTE:
            self.state = ActorState.SUSPENDED
            self.node_pin = None
        if e.origin in (SnapshotOrigin.SUSPEND, SnapshotOrigin.PROMOTE):
            self.borrows_volumes = False

    def when_TemplateChanged(self, e: TemplateChanged) -> None:
        self.template_uid = e.template_uid
        self.template_version = self.version + 1

    def when_ActorPlaced(self, e: ActorPlaced) -> None:
        self.state = ActorState.RUNNING
        self.assignment = self.placed = e
        self.assignment_version = self.version + 1
        self.running_template_uid = self.template_uid
        self.node_pin = None

    def when_ActorReleased(self, e: ActorReleased) -> None:
        released = self.assignment
        self.assignment = None
        if e.reason is ReleaseReason.PAUSED:
            self.state = ActorState.PAUSED
            self.node_pin = released.node if released is not None else None
        elif e.reason in (ReleaseReason.SUSPENDED, ReleaseReason.WORKER_REMOVED):
            # A lost worker took the instance with it: the actor resumes from its
            # latest snapshot, like a suspended one.
            self.state = ActorState.SUSPENDED
        # STOPPED: ActorStopped follows in the same append and sets the state.

    def when_ActorStopped(self, e: ActorStopped) -> None:
        self.state = ActorState.STOPPED
        self.assignment = None
        self.node_pin = None

    def when_ActorReverted(self, e: ActorReverted) -> None:
        self.state = ActorState.SUSPENDED
        self.latest_snapshot = e.snapshot
        self.node_pin = None
        self.borrows_volumes = e.snapshot is not None and e.snapshot.borrowed


class Tag(WireAggregate):
    """A tag's history `tag.<tag>`: each TagRecorded names the snapshot the tag now points at."""

    KIND = "tag"

    def __init__(self, entity_id: str):
        super().__init__(entity_id)
        self.snapshot: Snapshot | None = None

    def name(self, snapshot: Snapshot, request_id: str | None, at: datetime) -> None:
        self.record(TagRecorded(tag=self.entity_id, snapshot=snapshot, at=at, request_id=request_id))

    def when_TagRecorded(self, e: TagRecorded) -> None:
        self.snapshot = e.snapshot


class Image(WireAggregate):
    """What a snapshot id no default takes names, across actors: `image.<snapshot_id>`, whose
    ImageNamed events each name the image the id stands for from then on.

    A worker finds an image by its id (an Assignment names nothing else), so one id names one
    image: an actor's own history keeps it from naming two of its own (`Actor.next_snapshot_id`),
    and this keeps two actors from naming two images alike (found by a walkthrough: two actors
    paused under `myimg` on one node, one of them of another sandbox class, and either's resume
    named `myimg` to a worker there). An id of the default form is one actor's alone
    (`stamping.anothers_default_id`), so only the others (`free_form_id`) are recorded here."""

    KIND = "image"

    def __init__(self, entity_id: str):
        super().__init__(entity_id)
        self.snapshot: Snapshot | None = None

    def name(self, snapshot: Snapshot, field: str, request_id: str | None, at: datetime) -> None:
        """Record that the id names `snapshot`'s image, unless it names that image already; refused
        (FAILED_PRECONDITION, `field`) if it names another actor's other image. The same actor's
        other image under its id (a promote: the LOCAL image made EXTERNAL) is its own history's
        concern, decided before this: recorded. The same EXTERNAL image in another actor's history
        (a golden snapshot, a tag's copy) is one image: nothing recorded."""
        held = self.snapshot
        if held is not None and held.actor_id != snapshot.actor_id:
            if held.location is Location.EXTERNAL and same_image(held, snapshot):
                return
            where = "EXTERNAL" if held.location is Location.EXTERNAL else f"LOCAL on node {held.node!r}"
            advice = {"snapshot_id": "give another id, or none (a default id is the actor's own)",
                      "source_tag": "tag another snapshot"}.get(field, "give it another id")
            raise precondition(
                f"{field} {snapshot.snapshot_id!r} already names an image of actor {held.actor_id!r} ({where}, "
                f"{held.fidelity.value}): a worker finds an image by its id, so one id names one image; {advice}",
                field)
        if held is None or not same_image(held, snapshot):
            self.record(ImageNamed(snapshot=snapshot, at=at, request_id=request_id))

    def when_ImageNamed(self, e: ImageNamed) -> None:
        self.snapshot = e.snapshot


def claims_id(snapshot_id: str | None) -> str | None:
    """The id whose `Image` a new record of an image under `snapshot_id` must check, and a request
    naming it reads (None: none to check: no id, or one of the default form)."""
    return snapshot_id if snapshot_id is not None and free_form_id(snapshot_id) else None
