"""Audit by replay: rebuild the scheduler's projection at any point of the log, and check
the invariants that must hold at every sequence.

The checks are pure (a `Verifier` looks at the projection *before* each event is
folded); reading the log is the scheduler's own `Fold`, given a sink that stops at
a bound or checks as it goes, so an audit sees exactly what a scheduler replica
folds, through the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from events.compat import describe_key, stamp_key
from events.errors import ContractError
from events.schema import (
    Action,
    ActorCreated,
    ActorPlaced,
    ActorReleased,
    ActorReverted,
    ActorRuntime,
    ActorStopped,
    Event,
    Fallback,
    FallbackReason,
    Fidelity,
    Location,
    PlacedFidelity,
    ReleaseReason,
    RuntimeChanged,
    Snapshot,
    SnapshotOrigin,
    SnapshotTaken,
    TagRecorded,
)
from services.scheduler.decide import (ACTOR_RUNNING, ACTOR_STOPPED, AS_PLACED, NO_ACTOR, RANK, Tier, below_floor,
                                      memory_lost, memory_lost_all, placed_token, plan, restricted_to, tier_ask,
                                      unresumable)
from services.scheduler.feasibility import (ARCHITECTURE_MISMATCH, CLASS_NOT_REGISTERED, DRAINED, FITS,
                                            IMAGE_NOT_ACCEPTED, INSUFFICIENT_CPU, INSUFFICIENT_MEMORY, NO_CLASS_NOW,
                                            NO_PENDING, NOT_ON_PINNED_NODE, OTHER_NODE_NOW, PIN_NOT_RUN, REASONS,
                                            RUNTIME_MISMATCH, SELECTOR_MISMATCH, SHORT_CPU, Ask, carrying,
                                            missing_keys, room)
from services.scheduler.fragmentation import fragmentation
from services.scheduler.projection import Projection
from services.scheduler.places import describe, node_of, short
from services.scheduler.records import (MEMORY, PAUSED, RUNNING, SUSPENDED, Actor, SnapshotKind, Worker,
                                        named_image, request_hash)
from services.snapshotter.stamping import free_form_id

# The rules `audit verify` checks (names as they appear in its report): at each ActorPlaced,
UNKNOWN_ACTOR = "placement of an unknown actor"
PLACED_TWICE = "actor placed twice without a release"
NOT_TAKING = "placement on a worker that takes none"
PAST_ROOM = "worker booked past its room"
RUNTIME_GONE = "placement on a runtime the worker does not offer"
SELECTOR_UNMET = "placement on a worker that does not meet the actor's selectors"
LOCAL_OFF_NODE = "placement off the node of its LOCAL image"  # a restore or a cold boot (rule 5)
ACROSS_ARCHITECTURES = "placement without memory across architectures"  # a restore, a fallback, a RUN of a golden image
PLACED_STOPPED = "placement of a stopped actor"
NODE_MISMATCH = "placement names another node than its worker's"
NOT_IN_SNAPSHOT = "restore of what the latest snapshot does not hold"
BELOW_FLOOR = "placement below the actor's min_fidelity"
UNDER_BOOKED = "placement books less than the actor needs"
OFF_PLAN = "placement at a fidelity the placement rules do not give its snapshot"
FALLBACK_MISSTATED = "placement whose fallback record is not the one the placement rules give it"
MATCHED_OTHER = "memory restore naming another matched version than its image's stamp"
REQUEST_AGAIN = "placement for a request id an earlier placement answered"
# a restore of a LOCAL image (an actor restricted to a place) names its worker's node token, what the worker's
# agent checks its disk against (`decide.placement`, `restore_check`); any other placement names none
NODE_TOKEN_MISSTATED = "placement whose node token is not its worker's disk"
# at each snapshot an actor takes, copies or goes back to (SnapshotTaken, TagRecorded,
# ActorCreated, ActorReverted: CONTRACT section 3, "Stamping rules"),
STAMP_NOT_PIN = "stamp differs from the actor's pin"
NOT_RUN_TEMPLATE = "snapshot of another template than its actor ran"
NOT_AS_TAKEN = "snapshot recorded as holding otherwise than its step takes it"
NOT_RUNNING = "pause or suspend of an actor that is not running"
NOT_PAUSED = "promote of an actor that is not paused"
MISPLACED = "snapshot not where its step puts it"
NOT_COPIED = "copy differs from the snapshot it copies"
NO_SOURCE = "created with a snapshot that is no tag's and no golden one"
REVERT_NOTHING = "revert of an actor with no LOCAL image to give up"
REVERT_ELSEWHERE = "revert to another snapshot than the latest EXTERNAL one of this life"
ID_TWO_IMAGES = "snapshot id naming another actor's other image"
# at each ActorReleased,
RELEASE_ELSEWHERE = "release that ends no placement where it says"
RELEASE_UNSNAPSHOTTED = "pause's or suspend's release without its snapshot"
RELEASE_RULES = (RELEASE_ELSEWHERE, RELEASE_UNSNAPSHOTTED)
# and at each RuntimeChanged.
CHANGE_UNREGISTERED = "RuntimeChanged without a registration"
PLACEMENT_RULES = (UNKNOWN_ACTOR, PLACED_STOPPED, PLACED_TWICE, NOT_TAKING, PAST_ROOM, RUNTIME_GONE, SELECTOR_UNMET,
                   LOCAL_OFF_NODE, ACROSS_ARCHITECTURES, NODE_MISMATCH, NOT_IN_SNAPSHOT, BELOW_FLOOR,
                   UNDER_BOOKED, OFF_PLAN, FALLBACK_MISSTATED, MATCHED_OTHER, REQUEST_AGAIN, NODE_TOKEN_MISSTATED)
# The scheduler's judgement of a placement's record and worker as the placement rule verify names: the one
# table. Its record as a placement made (`feasibility.carrying`, a retry's answer's judgement), its worker by
# the ask of its tier (`feasibility.Ask.judge` on `decide.tier_ask`, its rejection reasons). Room is judged
# by the booking (`feasibility.room` against what was booked, PAST_ROOM, and the need under the pin,
# UNDER_BOOKED), not by the need under the runtime the scheduler would prefer, which the judgement's resource
# checks are of: a placement booked within the room under its pin is safe.
JUDGED = {
    NO_CLASS_NOW: RUNTIME_GONE,
    OTHER_NODE_NOW: NODE_MISMATCH,
    PIN_NOT_RUN: RUNTIME_GONE,
    IMAGE_NOT_ACCEPTED: RUNTIME_GONE,
    CLASS_NOT_REGISTERED: RUNTIME_GONE,
    DRAINED: NOT_TAKING,
    SELECTOR_MISMATCH: SELECTOR_UNMET,
    NOT_ON_PINNED_NODE: LOCAL_OFF_NODE,
    RUNTIME_MISMATCH: RUNTIME_GONE,
    ARCHITECTURE_MISMATCH: ACROSS_ARCHITECTURES,
    INSUFFICIENT_CPU: PAST_ROOM,
    INSUFFICIENT_MEMORY: PAST_ROOM,
}
# The scheduler's refusal of a resume on what the actor is (`decide.unresumable`, by which `decide.resolve`
# refuses it) as the placement rule verify names: the one table.
RESOLVED = {
    NO_ACTOR: UNKNOWN_ACTOR,
    ACTOR_RUNNING: PLACED_TWICE,
    ACTOR_STOPPED: PLACED_STOPPED,
}
STAMP_RULES = (NOT_RUNNING, STAMP_NOT_PIN, NOT_RUN_TEMPLATE, NOT_AS_TAKEN, MISPLACED, NOT_PAUSED, NOT_COPIED,
               NO_SOURCE, REVERT_NOTHING, REVERT_ELSEWHERE, ID_TWO_IMAGES)


def _holds_more(fidelity: Fidelity | PlacedFidelity, than: Fidelity) -> bool:
    """Whether `fidelity` holds more than a snapshot at `than` does (the scheduler's order, `decide.RANK`)."""
    placed = AS_PLACED[fidelity] if isinstance(fidelity, Fidelity) else fidelity
    return RANK[placed] < RANK[AS_PLACED[than]]


def _fallback(fallback: Fallback | None) -> str:
    """A fallback record as a report line names it."""
    if fallback is None:
        return "no fallback"
    return (f"fallback {fallback.reason.value} ({fallback.from_fidelity.value} to "
            f"{fallback.to_fidelity.value})")


def _runtime(runtime: ActorRuntime | None) -> str:
    """A stamp or a pin as a report line names it: class, schema version and attributes (what
    runtimes are compared by), and the name when it has one; `unstamped` for none."""
    if runtime is None:
        return "unstamped"
    return describe_key(stamp_key(runtime)) + (f" ({runtime.name})" if runtime.name else "")


def _key(runtime: ActorRuntime | None) -> Any:
    """What two stamps are compared by (CONTRACT section 2: `name` takes no part); None for none."""
    return stamp_key(runtime) if runtime is not None else None


def _stamped(runtime: ActorRuntime | None) -> str:
    return f"stamped {_runtime(runtime)}" if runtime is not None else "unstamped"


def _kind_key(kind: SnapshotKind) -> Any:
    """`_key` of the stamp of an actor's latest snapshot, as the fold keeps it."""
    return kind.stamp.compat.key if kind.stamp is not None else None


def _state(actor: Actor | None) -> str:
    return actor.state.value if actor is not None else "not created in the log"


def _where(snapshot: Snapshot) -> str:
    if snapshot.location is Location.EXTERNAL:
        return "EXTERNAL"
    return f"LOCAL on node {snapshot.node}" if snapshot.node is not None else "LOCAL on no node"


def _image(snapshot: Snapshot) -> tuple:
    """Every field of a snapshot but whose it is: a tag names it and a creation copies it with
    these unchanged. A tuple of the fields, not the Struct: the fold reads a SnapshotTaken's
    snapshot as a subclass, which never compares equal to a Snapshot."""
    s = snapshot
    return (*_loaded(s), s.borrowed, s.taken_at)


def _loaded(snapshot: Snapshot) -> tuple:
    """What a worker restoring `snapshot` loads, found by its id: every field but whose it is, whether
    borrowed, and when recorded (`services.snapshotter.stamping.same_image`, as a tuple: `_image`)."""
    s = snapshot
    return (s.snapshot_id, s.template_uid, s.fidelity, s.location, s.node, s.uri, s.sandbox_runtime)


class _External:
    """An actor's latest EXTERNAL snapshot of its current life, as `Verifier` keeps it: its id and
    stamp (for the report) and a hash of all of it, whose it is included (a revert goes back to
    exactly it). A hash, not the snapshot: one is kept per live actor of a log of millions."""

    __slots__ = ("snapshot_id", "stamp", "digest")

    def __init__(self, snapshot: Snapshot, stamp: ActorRuntime | None):
        self.snapshot_id = snapshot.snapshot_id
        self.stamp = stamp  # the projection's interned copy: one object per distinct stamp
        self.digest = hash((snapshot.actor_id, _image(snapshot)))


@dataclass(frozen=True)
class Violation:
    seq: int
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"sequence {self.seq}: {self.rule}: {self.detail}"


class Verifier:
    """Checks one event against the projection folded up to the event before it.

    The stamping rules need a little the projection does not keep, kept here as the log is
    folded, each at O(1) per event: what every tag names now, each live actor's latest
    EXTERNAL snapshot of its life (what a revert goes back to), and the snapshot a creation
    just recorded (its SnapshotTaken CREATE must repeat it)."""

    def __init__(self, projection: Projection):
        self.projection = projection
        # tag -> the image it names now (`_image`), None while its history holds a message this
        # version cannot read; image -> how many tags name it now; and how many are unknown
        self.tags: dict[str, tuple | None] = {}
        self.tagged: dict[tuple, int] = {}
        self.tags_unknown = 0
        self.tag_of_id: dict[str, str] = {}  # snapshot id -> a tag that names an image of that id (for reports)
        # actor id -> its latest EXTERNAL snapshot of its current life (a stop forgets it)
        self.external: dict[str, _External] = {}
        # actor id -> the snapshot its ActorCreated recorded, until the actor's next event
        self.creating: dict[str, Snapshot] = {}
        # actor id -> the origin of the pause's or suspend's snapshot it just took, until its next event
        # (the snapshotter appends the release right after it: `Actor.pause`, `Actor.suspend`)
        self.taking: dict[str, SnapshotOrigin] = {}
        # worker id -> the booking marker of the last placement on it the fold could not read (its room unknown)
        self.room_unknown: dict[str, int] = {}
        # snapshot id no default takes -> the actor whose image it names and that image (`_loaded`)
        self.images: dict[str, tuple[str, tuple]] = {}
        # actor id -> its template when it was last placed: what it runs, and what a pause's or a
        # suspend's image is of (a template changed while it runs takes effect at its next placement);
        # and the worker and sequence of that placement, which its release names
        self.ran: dict[str, str] = {}
        self.placed_on: dict[str, tuple[str, int]] = {}

    def check(self, seq: int, event: Event) -> Violation | None:
        created = self.creating.pop(event.actor_id, None) if self.creating and event.KIND == "actor" else None
        took = self.taking.pop(event.actor_id, None) if self.taking and event.KIND == "actor" else None
        if isinstance(event, ActorPlaced):
            found = self._placement(seq, event)
            placed = self.projection.actors.get(event.actor_id)
            if placed is not None:
                self.ran[event.actor_id] = placed.spec.template_uid
            self.placed_on[event.actor_id] = (event.worker_id, seq)
            return found
        if isinstance(event, ActorReleased):
            return self._released(seq, event, took)
        if isinstance(event, SnapshotTaken):
            found = self._stamp(seq, event, created) or self._one_image(seq, event.actor_id, event.snapshot)
            if event.origin is SnapshotOrigin.PAUSE or event.origin is SnapshotOrigin.SUSPEND:
                self.taking[event.actor_id] = event.origin
            snapshot = event.snapshot
            if event.origin is not SnapshotOrigin.TAG and snapshot.location is Location.EXTERNAL \
                    and event.actor_id in self.projection.actors:
                self.external[event.actor_id] = self._external(snapshot)
            return found
        if isinstance(event, ActorCreated):
            found = self._created(seq, event)
            snapshot = event.snapshot
            if found is None and snapshot is not None:
                found = self._one_image(seq, event.actor_id, snapshot)
            if snapshot is not None:
                self.creating[event.actor_id] = snapshot
            if snapshot is not None and snapshot.location is Location.EXTERNAL:
                self.external[event.actor_id] = self._external(snapshot)
            else:
                self.external.pop(event.actor_id, None)
            return found
        if isinstance(event, TagRecorded):
            found = self._tag_recorded(seq, event)
            self._name(event.tag, _image(event.snapshot))
            return found
        if isinstance(event, ActorReverted):
            return self._reverted(seq, event)
        if isinstance(event, ActorStopped):
            self.external.pop(event.actor_id, None)  # the next life starts with its creation's snapshot
            self.ran.pop(event.actor_id, None)
            self.placed_on.pop(event.actor_id, None)
            return None
        if isinstance(event, RuntimeChanged) and event.worker_id not in self.projection.workers:
            return Violation(seq, CHANGE_UNREGISTERED,
                             f"worker {event.worker_id} is not registered")
        return None

    def _one_image(self, seq: int, actor_id: str, snapshot: Snapshot) -> Violation | None:
        """One snapshot id names one image across actors (docs/contract.md): an id no default takes
        (`free_form_id`; one of the default form is one actor's alone) that names another actor's
        image may be recorded again only as that image, EXTERNAL (a golden snapshot, a tag's copy).
        The actor's own image under it (a promote) is what the id names from then on."""
        sid = snapshot.snapshot_id
        if not free_form_id(sid):
            return None
        image = _loaded(snapshot)
        held = self.images.get(sid)
        if held is None or held[0] == actor_id:
            self.images[sid] = (actor_id, image)
            return None
        if held[1] == image and snapshot.location is Location.EXTERNAL:
            return None
        owner, (_, _, fidelity, location, node, _, _) = held
        where = "EXTERNAL" if location is Location.EXTERNAL else f"LOCAL on node {node}"
        return Violation(seq, ID_TWO_IMAGES,
                         f"{actor_id} records snapshot {sid} ({_where(snapshot)}), which names {owner}'s "
                         f"image ({where}, {fidelity.value}): a worker finds an image by its id")

    def _external(self, snapshot: Snapshot) -> _External:
        runtime = snapshot.sandbox_runtime  # (the projection interns it too, as it folds this event)
        return _External(snapshot, self.projection.intern.stamp(runtime).runtime if runtime is not None else None)

    def tag_unread(self, tag: str) -> None:
        """A message of the tag's history this version cannot read: what the tag names is unknown
        from here until a TagRecorded it reads, and a creation no known tag names may be from it."""
        self._name(tag, None)

    def _name(self, tag: str, image: tuple | None) -> None:
        """The tag names `image` from now on (None: unknown)."""
        if tag in self.tags:
            before = self.tags[tag]
            if before is None:
                self.tags_unknown -= 1
            else:
                left = self.tagged[before] - 1
                if left:
                    self.tagged[before] = left
                else:
                    del self.tagged[before]
                if self.tag_of_id.get(before[0]) == tag:
                    del self.tag_of_id[before[0]]
        self.tags[tag] = image
        if image is None:
            self.tags_unknown += 1
        else:
            self.tagged[image] = self.tagged.get(image, 0) + 1
            self.tag_of_id[image[0]] = tag

    def booking_unread(self, seq: int, worker_id: str) -> None:
        """The booking marker at `seq` is a placement's the fold could not read: the worker's room is
        unknown until a registration this version reads begins its next life."""
        self.room_unknown[worker_id] = seq

    def _worker_unknowable(self, worker_id: str) -> bool:
        """Whether the worker's current life holds a message this version cannot read (`Projection.
        life_unread`: the fold counts it drained, or has no record of it) or a placement it cannot
        read (its room unknown): a placement on it is not judged, as the scheduler does not place there."""
        p = self.projection
        if p.unread_workers and p.life_unread(worker_id):
            return True
        marker = self.room_unknown.get(worker_id) if self.room_unknown else None
        worker = p.workers.get(worker_id)
        return marker is not None and worker is not None and marker > worker.since

    def _unknowable(self, actor_id: str) -> bool:
        """Whether the actor's current life holds a message this version cannot read (a newer
        version's event: `Projection.unread_actors`): what it changed (a snapshot, a state) is
        unknown, so its stamps are not judged until a creation this version reads begins its next
        life, as the scheduler does not place it meanwhile (`Projection.unread_of`, which `decide.resolve`
        refuses by)."""
        return self.projection.unread_of(actor_id) is not None

    def _placement(self, seq: int, event: ActorPlaced) -> Violation | None:
        """A placement must be feasible on the log as it stood right before it (CONTRACT
        placement rules 2 to 8): no event of its worker that lands between a decision and
        its commit may have made it infeasible, and where the image lives and what it was
        built for decide where it may go."""
        aid, wid = event.actor_id, event.worker_id
        if self._unknowable(aid) or self._worker_unknowable(wid):  # what it was decided on is unknown here
            return None
        # the actor, as the scheduler judges a resume of it (`decide.unresumable`, which `decide.resolve` refuses by)
        actor = self.projection.actors.get(aid)
        refused = unresumable(actor)
        if refused is not None:
            rule = RESOLVED[refused]
            if rule == PLACED_TWICE:
                return Violation(seq, rule, f"{aid} already runs on "
                                            f"{actor.worker.worker_id if actor and actor.worker else '?'}")
            return Violation(seq, rule, aid)
        assert actor is not None
        if event.request_id is not None:
            # a resume sent again is answered by the placement its id made, never placed anew: the
            # scheduler looks the id up among the actor's recent placements of this life (and refuses
            # one of its last life's), exactly as the projection keeps them (`Actor.placed_by`)
            request = request_hash(event.request_id)
            first, life = actor.placed_by(request), ""
            if not first:
                first, life = actor.placed_earlier(request), " of its last life"
            if first:
                return Violation(seq, REQUEST_AGAIN, f"{aid} placed on {wid} for request_id {event.request_id!r}, "
                                                     f"which its placement at sequence {first}{life} answered")
        worker = self.projection.workers.get(wid)
        if worker is None:  # (a removed worker is not in the projection: nothing for the scheduler to judge)
            return Violation(seq, NOT_TAKING, f"{wid} is not registered")
        # the room the scheduler judges a worker by (`feasibility.room`), as the log gives it here (nothing
        # in flight), against what was booked: a decision books no more than its need (`Ask.judge`), and
        # the need is judged below, under the pin (UNDER_BOOKED); booked past the room, the worker is
        # overcommitted whatever the need was
        room_cpu, room_mem = room(worker, NO_PENDING)
        if event.booked.cpu_millis > room_cpu or event.booked.memory_mib > room_mem:
            return Violation(
                seq, PAST_ROOM,
                f"{wid} had {room_cpu}m cpu / {room_mem} MiB free, "
                f"{aid} booked {event.booked.cpu_millis}m / {event.booked.memory_mib} MiB",
            )
        kind = actor.snapshot
        stamp = kind.stamp if kind is not None else None
        held = self._not_held(actor, event)
        if held is not None:
            return Violation(seq, NOT_IN_SNAPSHOT, held)
        floor = actor.spec.min_fidelity
        if below_floor(event.fidelity, floor, owns_nothing=kind is None or kind.borrowed):
            return Violation(seq, BELOW_FLOOR,
                             f"{aid} placed at {event.fidelity.value}, its min_fidelity is {floor.value}")
        # (from here, at MEMORY, the checks before found a MEMORY image of the actor's template stamped for its class)
        memory = event.fidelity is PlacedFidelity.MEMORY
        # the record, as the scheduler judges a placement made on a worker (`feasibility.carrying`: a retry's
        # answer from the log): its class there, the node the record names the worker's (the node a LOCAL image
        # is judged by below is the worker's, not what the event says), its pin a runtime of the worker's, at
        # MEMORY one that accepts the image, in any role (rule 2 prefers one; another loads the image as well)
        pin = self.projection.intern.compat_of_key(stamp_key(event.sandbox_runtime))
        why, runtime = carrying(worker, actor.spec.sandbox_class, event.node, pin,
                                stamp.compat if memory else None)  # type: ignore[union-attr]
        if why is not None:
            rule = JUDGED[why]
            return Violation(seq, rule, self._rejected(rule, actor, event, worker, None))
        # the worker, as the scheduler judges it for the tier the placement is of (`decide.tier_ask`: its class,
        # the actor's selectors, rule 5's node, at MEMORY a runtime accepting the stamp, without memory the
        # class default of the stamp's architecture), by its own checks (`Ask.judge`), in its pipeline order;
        # at MEMORY in any role, as above. Its room is judged above, by the booking.
        ask = tier_ask(actor, actor.spec.selector_pairs, restricted_to(actor), memory)
        verdict, judged, _ = ask.judge(worker, NO_PENDING)
        if FITS < verdict < SHORT_CPU:
            rule = JUDGED[REASONS[verdict - 1]]
            return Violation(seq, rule, self._rejected(rule, actor, event, worker, ask))
        if not memory and judged.compat is not pin:  # without memory, the class default the judgement names
            return Violation(seq, RUNTIME_GONE, self._rejected(RUNTIME_GONE, actor, event, worker, ask))
        # its need under its pin (`Runtime.need_mib`, what the scheduler books), not under the runtime the
        # judgement would prefer: the placement runs under its pin
        want = actor.spec.resources
        need = runtime.need_mib(want.memory_mib)  # type: ignore[union-attr]
        pin_key = stamp_key(event.sandbox_runtime)
        if event.booked.cpu_millis < want.cpu_millis or event.booked.memory_mib < need:
            return Violation(seq, UNDER_BOOKED,
                             f"{aid} needs {want.cpu_millis}m / {need} MiB under {pin_key}; it booked "
                             f"{event.booked.cpu_millis}m / {event.booked.memory_mib} MiB")
        matched = named_image(event)
        if matched is not None and stamp is not None:
            # what a worker checks the image against before it loads it (`restore_check`), and a retry's
            # answer from the log (`decide.check_retry`): the matched version, or the pin's own when null
            if matched != stamp.compat.key:
                return Violation(seq, MATCHED_OTHER,
                                 f"{aid}'s memory image is {describe_key(stamp.compat.key)}; its placement on {wid} "
                                 f"names {describe_key(matched)} as the version that matched")
        # the node token its worker's agent checks its disk against: its worker's, on a restore restricted to a place
        # (rule 5, `decide.placement`); a placement naming none there is not checked, another's is refused
        token = placed_token(actor, event.action, worker)
        if event.node_token != token:
            return Violation(seq, NODE_TOKEN_MISSTATED,
                             f"{aid} placed on {wid} naming node token {event.node_token or '(none)'}; "
                             + (f"its LOCAL image is on {wid}'s disk, node token {token}" if token is not None else
                                f"{wid} registers node token {worker.token or '(none)'}, and the placement "
                                "restores no LOCAL image: it names none"))
        # the scheduler's tiers for the actor's latest snapshot (`decide.plan`), where what follows needs them: a
        # placement without memory (its action and fidelity), one with a fallback record (what it says)
        tiers = self._tiers(actor) if not memory or event.fallback is not None else ()
        off_plan = self._off_plan(actor, event, tiers)
        if off_plan is not None:
            return Violation(seq, OFF_PLAN, off_plan)
        misstated = self._misstated(actor, event, tiers)
        if misstated is not None:
            return Violation(seq, FALLBACK_MISSTATED, misstated)
        return None

    @staticmethod
    def _rejected(rule: str, actor: Actor, event: ActorPlaced, worker: Worker, ask: Ask | None) -> str:
        """What the scheduler's judgement found wrong with the placement's record or worker (`JUDGED`; `ask`
        the one its worker was judged by), with the values involved."""
        aid, wid, cls = actor.actor_id, worker.worker_id, actor.spec.sandbox_class
        entry = worker.classes.get(cls)
        if rule == NOT_TAKING:
            return f"{wid} is drained"
        if rule == NODE_MISMATCH:
            return f"{aid} placed on {wid} naming node {event.node}; {wid} is on {worker.node}"
        if rule == SELECTOR_UNMET:
            selectors = actor.spec.selectors
            unmet = [f"{k}={selectors[k]}" for k in missing_keys(actor.spec.selector_pairs, worker.labels)]
            return f"{aid} selects {', '.join(unmet)}; {wid} has no such label"
        if rule == LOCAL_OFF_NODE:
            kind = actor.snapshot
            how = 'restored' if event.action is Action.RESTORE else 'cold-booted'
            if kind is not None and kind.local:
                # at any fidelity (rule 5), a cold boot too: the scheduler restricts every tier of such an
                # actor to that node, and a cold boot elsewhere would leave the image there for good
                return (f"{aid}'s latest snapshot is LOCAL on {describe(actor.image_node or '')}; {how} on {wid} on "
                        f"{short(worker.place)}")
            return f"{aid} is PAUSED on {describe(actor.node or '')}; {how} on {wid} on {short(worker.place)}"
        if entry is None:  # RUNTIME_GONE, as all that follow but ACROSS_ARCHITECTURES
            return f"{wid} does not register class {cls}"
        if rule == ACROSS_ARCHITECTURES:
            arch = entry.default.compat.arch
            want = ask.arch if ask is not None else None
            if want is not None and arch != want:
                return f"{aid}'s snapshot is {want}; {wid}'s default is {arch}"
            return (f"{aid} runs under {wid}'s default of class {cls}, of architecture {arch}, not of its machine "
                    f"(its registration names two)")
        pin = stamp_key(event.sandbox_runtime)
        if event.fidelity is not PlacedFidelity.MEMORY:
            return f"{aid} pinned to {pin}; {wid}'s default is {entry.default.compat.key}"
        stamp = actor.snapshot.stamp if actor.snapshot is not None else None
        return (f"{aid}'s memory image ({stamp_key(stamp.runtime) if stamp else 'unstamped'}) "
                f"restored on {wid} pinned to {pin}, which {wid} does not offer for it")

    def _released(self, seq: int, event: ActorReleased, took: SnapshotOrigin | None) -> Violation | None:
        """A release ends the actor's placement, on the worker that placement names (the snapshotter's
        `Actor.release`): a pause's or a suspend's right after its snapshot (which ended it already in
        the fold), a stop's or a removal's of the RUNNING actor; a removal's only once the worker's life
        that placement was made in has ended (a WorkerRemoved). A release naming another worker, or one of
        a removal the worker has not had, would end in the log an actor that still runs there, and let it
        be placed a second time. A pause's or a suspend's is the actor's next event after that snapshot
        (`took`, its origin), which the snapshotter appends with it (`Actor.pause`, `Actor.suspend`; no
        other path writes one): without it, the actor resumes from an older snapshot than what it ran
        (or cold-boots), what it ran since lost, and a paused one is held to its node by no image there."""
        aid, wid, reason = event.actor_id, event.worker_id, event.reason
        if self._unknowable(aid):
            return None
        actor = self.projection.actors.get(aid)
        held = self.placed_on.get(aid)
        state = actor.state if actor is not None else None
        after = PAUSED if reason is ReleaseReason.PAUSED else SUSPENDED if reason is ReleaseReason.SUSPENDED \
            else RUNNING
        if (state is not RUNNING and state is not after) or held is None or held[0] != wid:
            placed = f"; its placement is on {held[0]}" if held is not None and held[0] != wid else (
                "" if held is not None else "; it has no placement")
            return Violation(seq, RELEASE_ELSEWHERE,
                             f"{aid} released from {wid} ({reason.value}) while {_state(actor)}{placed}: a release "
                             f"ends the placement it names, of a RUNNING actor"
                             + (f" or right after its {'pause' if after is PAUSED else 'suspend'}'s snapshot"
                                if after is not RUNNING else ""))
        if after is not RUNNING:
            want = SnapshotOrigin.PAUSE if after is PAUSED else SnapshotOrigin.SUSPEND
            if took is not want:
                return Violation(seq, RELEASE_UNSNAPSHOTTED,
                                 f"{aid} released from {wid} ({reason.value}) while {_state(actor)}, its previous "
                                 f"event no {want.value} snapshot: a {'pause' if after is PAUSED else 'suspend'}'s "
                                 f"release is written right after the snapshot it takes, and only then")
        if reason is ReleaseReason.WORKER_REMOVED:
            worker = self.projection.workers.get(wid)
            p = self.projection
            if worker is not None and worker.since < held[1] and not (p.unread_workers and p.life_unread(wid)):
                return Violation(seq, RELEASE_ELSEWHERE,
                                 f"{aid} released from {wid} as WORKER_REMOVED; {wid} has not been removed since "
                                 f"{aid} was placed there (sequence {held[1]})")
        return None

    def _tiers(self, actor: Actor) -> list[Tier] | str:
        """The scheduler's tiers for a resume of `actor` on the log as it stands (`decide.plan`, without a
        request's selectors, which are not in the log and choose among workers, not tiers), or, where
        the rules place it nowhere, the refusal's message."""
        try:
            return plan(self.projection, actor, None).tiers
        except ContractError as refused:
            return refused.message

    def _off_plan(self, actor: Actor, event: ActorPlaced, tiers: list[Tier] | str) -> str | None:
        """Why a placement is at an action and fidelity none of the scheduler's tiers for the actor's
        latest snapshot has (`decide.plan`, the one definition of rules 2 to 5 and 4a): no fallback for
        a LOCAL memory image (rule 5, never relaxed), a cold boot included; a borrowed memory image's
        fallback a cold boot (rule 4); a snapshot without usable memory restored at its own fidelity
        (rule 3); the fallback VOLUMES (rule 4). None if one has it. A cold boot of an actor that owns
        nothing to lose, its latest snapshot not LOCAL, is left to the floor's check (rule 4a: it "may
        always RUN unless its floor is MEMORY"; chosen, looked at again and kept: the scheduler reads the
        rule narrowly and restores a golden VOLUMES or ROOTFS snapshot at or above the floor, but such a
        cold boot sends no image and throws nothing of the actor's own away, and its worker, architecture
        and fallback record are judged all the same). The candidates' room and selectors are not judged
        here (a request's selectors are not in the log), nor whether a fallback was needed."""
        aid, kind = event.actor_id, actor.snapshot
        if event.fidelity is PlacedFidelity.MEMORY:  # its tier is there: the checks before found its worker in it
            return None
        if event.action is Action.RUN and (kind is None or not kind.local):
            return None
        if isinstance(tiers, str):
            return f"{aid} placed at {event.fidelity.value}, where the rules place it nowhere: {tiers}"
        allowed = sorted({(t.action.value, t.fidelity.value) for t in tiers})
        if (event.action.value, event.fidelity.value) in allowed:
            return None
        what = "none" if kind is None else (
            f"{'LOCAL' if kind.local else 'EXTERNAL'} {kind.fidelity.value}{' borrowed' if kind.borrowed else ''}")
        return (f"{aid} placed {event.action.value} at {event.fidelity.value} with its latest snapshot "
                f"{actor.snapshot_id} ({what}); the rules place it "
                + (" or ".join(f"{action} at {fidelity}" for action, fidelity in allowed) or "nowhere"))

    def _misstated(self, actor: Actor, event: ActorPlaced, tiers: list[Tier] | str) -> str | None:
        """Why the placement's `fallback` is not the record the scheduler's tier of its action and fidelity
        carries (`decide.plan`: `Tier.fallback`, which `decide.placement` writes): none on a memory restore,
        on a snapshot without memory restored at its own fidelity, on a cold boot of an actor with no
        snapshot or of a borrowed one below its floor (rule 4a); on a placement that gives a memory image
        up, the reason the rules give it up for (rule 3: TEMPLATE_CHANGED, SNAPSHOT_NOT_MEMORY, either
        when both hold, `decide.memory_lost_all`; rule 4: NO_COMPATIBLE_WORKER), from MEMORY to the
        placement's fidelity. A cold boot no tier has (rule 4a, left to the floor: `_off_plan`) carries
        none, as the scheduler's cold boots of such an actor. None if it is the record. Not judged, as the
        log cannot say: whether a NO_COMPATIBLE_WORKER fallback was needed (the decision's position, the
        bookings its replica had in flight and the request's selectors are not in the log; rule 8 fences
        the chosen worker only)."""
        got = event.fallback
        if not tiers and got is None:  # (a memory restore without a fallback record: the plan was not asked)
            return None
        found = [t for t in tiers if t.action is event.action and t.fidelity is event.fidelity] \
            if not isinstance(tiers, str) else []
        want = found[0].fallback if found else None
        if got == want:
            return None
        lost = memory_lost_all(actor)
        if got is not None and want is not None and want.reason in lost and got.reason in lost \
                and (got.from_fidelity, got.to_fidelity) == (want.from_fidelity, want.to_fidelity):
            return None  # rule 3: both reasons hold, either is true
        kind = actor.snapshot
        what = "none" if kind is None else (
            f"{'LOCAL' if kind.local else 'EXTERNAL'} {kind.fidelity.value}{' borrowed' if kind.borrowed else ''}"
            + (f", of template {kind.template_uid}, the actor's {actor.spec.template_uid}"
               if kind.template_uid != actor.spec.template_uid else "")
            + (", unstamped or stamped for another class"
               if FallbackReason.SNAPSHOT_NOT_MEMORY in lost else ""))
        return (f"{event.actor_id} placed {event.action.value} at {event.fidelity.value} with {_fallback(got)}, its "
                f"latest snapshot {actor.snapshot_id} ({what}); the rules give that placement {_fallback(want)}")

    @staticmethod
    def _not_held(actor: Actor, event: ActorPlaced) -> str | None:
        """Why the placement restores what the actor's latest snapshot does not hold (rules 1 to 3):
        memory only from a MEMORY image of the actor's current template stamped for its class,
        volumes only from a MEMORY or VOLUMES one, a restore only of the latest snapshot; None if it does."""
        aid, kind = event.actor_id, actor.snapshot
        if event.action is Action.RUN:
            return None if event.fidelity is PlacedFidelity.NONE else f"{aid} RUN at {event.fidelity.value}"
        if kind is None:
            return f"{aid} has no snapshot to restore"
        if event.snapshot_id != actor.snapshot_id:
            return f"{aid} restored {event.snapshot_id}; its latest snapshot is {actor.snapshot_id}"
        if event.fidelity is PlacedFidelity.NONE:
            return f"{aid} RESTORE at NONE"
        if _holds_more(event.fidelity, than=kind.fidelity):
            return f"{aid} restored at {event.fidelity.value} from a {kind.fidelity.value} snapshot"
        if event.fidelity is PlacedFidelity.MEMORY and kind.fidelity is MEMORY:
            lost = memory_lost(actor)  # rule 3, as the plan gives the memory up
            if lost is FallbackReason.TEMPLATE_CHANGED:
                return (f"{aid}'s memory image is of template {kind.template_uid}, "
                        f"the actor's is {actor.spec.template_uid}")
            if lost is not None:
                return f"{aid}'s memory image is unstamped or stamped for another class"
        return None

    def _stamp(self, seq: int, event: SnapshotTaken, created: Snapshot | None) -> Violation | None:
        """A snapshot an actor takes or copies, against the stamping rules (CONTRACT section 3):
        a pause or a suspend of a RUNNING actor, stamped with the pin of the placement it ends (a
        pause's image LOCAL on that placement's node, a suspend's EXTERNAL); a promote of a PAUSED
        actor's LOCAL snapshot, keeping its stamp and image; a tag's copy of the actor's latest
        snapshot; a creation's snapshot, the one its ActorCreated recorded right before."""
        aid, snapshot, origin = event.actor_id, event.snapshot, event.origin
        if self._unknowable(aid):
            return None
        actor = self.projection.actors.get(aid)
        sid = snapshot.snapshot_id
        if origin is SnapshotOrigin.PAUSE or origin is SnapshotOrigin.SUSPEND:
            return self._taken_running(seq, event, actor)
        if origin is SnapshotOrigin.PROMOTE:
            kind = actor.snapshot if actor is not None else None
            if actor is None or actor.state is not PAUSED or kind is None or not kind.local:
                state = "PAUSED without a LOCAL snapshot" if actor is not None and actor.state is PAUSED \
                    else _state(actor)
                return Violation(seq, NOT_PAUSED,
                                 f"{aid} PROMOTE snapshot {sid} while {aid} is {state}: a promote uploads the "
                                 "LOCAL image of a PAUSED actor, keeping its stamp")
            if snapshot.location is not Location.EXTERNAL:
                return Violation(seq, MISPLACED, f"{aid} PROMOTE snapshot {sid} is {_where(snapshot)}; a promote's "
                                                 "image is EXTERNAL")
            differs = []
            if _key(snapshot.sandbox_runtime) != _kind_key(kind):
                differs.append(f"{_stamped(snapshot.sandbox_runtime)}, the LOCAL one "
                               f"{_stamped(kind.stamp.runtime if kind.stamp else None)}")
            if snapshot.template_uid != kind.template_uid:
                differs.append(f"of template {snapshot.template_uid}, the LOCAL one of {kind.template_uid}")
            if _holds_more(snapshot.fidelity, than=kind.fidelity):
                differs.append(f"{snapshot.fidelity.value}, more than the LOCAL one holds ({kind.fidelity.value})")
            if snapshot.borrowed:  # (`promoted_snapshot`: the actor's own durable copy from then on)
                differs.append("borrowed, where a promote's image is the actor's own durable copy")
            if differs:
                return Violation(seq, NOT_COPIED, f"{aid} PROMOTE snapshot {sid} differs from the LOCAL snapshot it "
                                                  f"promotes, {actor.snapshot_id}: " + "; ".join(differs))
            return None
        if origin is SnapshotOrigin.TAG:
            differs = self._copy_differs(snapshot, actor, aid)
            if differs:
                return Violation(seq, NOT_COPIED, f"{aid} TAG copy {sid} differs from {aid}'s latest snapshot: "
                                                  + "; ".join(differs))
            return None
        if origin is SnapshotOrigin.CREATE:
            if created is None:
                return Violation(seq, NO_SOURCE,
                                 f"{aid} CREATE snapshot {sid} {_stamped(snapshot.sandbox_runtime)} where "
                                 f"{aid} was not just created ({_state(actor)}): a creation's snapshot is recorded "
                                 "right after its ActorCreated, and only then")
            if (snapshot.actor_id, _image(snapshot)) != (created.actor_id, _image(created)):
                return Violation(seq, NO_SOURCE,
                                 f"{aid} CREATE snapshot {sid} {_stamped(snapshot.sandbox_runtime)} differs "
                                 f"from the one its ActorCreated recorded, {created.snapshot_id} "
                                 f"{_stamped(created.sandbox_runtime)}")
        return None

    def _taken_running(self, seq: int, event: SnapshotTaken, actor: Actor | None) -> Violation | None:
        """A pause or a suspend: of a RUNNING actor, stamped from the pin of the placement it ends
        (`ActorPlaced.sandbox_runtime`), a pause's image LOCAL on that placement's node, a suspend's
        EXTERNAL. A LOCAL image that names no node is taken as on the placement's (the fold does)."""
        aid, snapshot, origin = event.actor_id, event.snapshot, event.origin
        sid = snapshot.snapshot_id
        pin = actor.pin if actor is not None and actor.state is RUNNING else None
        if pin is None:
            hint = ("; a suspend of a PAUSED actor is a PROMOTE of its LOCAL snapshot"
                    if origin is SnapshotOrigin.SUSPEND and actor is not None and actor.state is PAUSED else "")
            return Violation(seq, NOT_RUNNING,
                             f"{aid} {origin.value} snapshot {sid} {_stamped(snapshot.sandbox_runtime)} while "
                             f"{aid} is {_state(actor)}: only a running actor's image is taken, stamped from the pin "
                             f"of its placement{hint}")
        worker = actor.worker.worker_id if actor.worker is not None else "?"
        if _key(snapshot.sandbox_runtime) != pin.compat.key:
            return Violation(seq, STAMP_NOT_PIN,
                             f"{aid} {origin.value} snapshot {sid} {_stamped(snapshot.sandbox_runtime)}; the "
                             f"placement it ends (worker {worker}, {describe(actor.node)}) is pinned to "
                             f"{_runtime(pin.runtime)}")
        ran = self.ran.get(aid)
        if ran is not None and snapshot.template_uid != ran:
            return Violation(seq, NOT_RUN_TEMPLATE,
                             f"{aid} {origin.value} snapshot {sid} is of template {snapshot.template_uid}; the "
                             f"placement it ends (worker {worker}, {describe(actor.node)}) ran template {ran}")
        # what the image holds (the snapshotter's `paused_snapshot`, `suspended_snapshot`): a pause's all of
        # the memory, `borrowed` as the actor's latest snapshot is (volumes of its own only once it has been
        # suspended since a golden creation); a suspend's the actor's own durable copy, never `borrowed`. A
        # `borrowed` image's actor owns nothing to lose: its resume may cold-boot (rule 4a), its volumes lost
        kind = actor.snapshot
        owns = not (origin is SnapshotOrigin.PAUSE and kind is not None and kind.borrowed)
        if snapshot.borrowed == owns or (origin is SnapshotOrigin.PAUSE and snapshot.fidelity is not MEMORY):
            held = (f"at {snapshot.fidelity.value}; a pause's image holds the memory" if snapshot.borrowed != owns
                    else f"{'' if snapshot.borrowed else 'not '}borrowed; {aid} has "
                         f"{'volumes of its own' if owns else 'none of its own (created from a golden snapshot)'}")
            return Violation(seq, NOT_AS_TAKEN, f"{aid} {origin.value} snapshot {sid} is recorded {held}")
        if origin is SnapshotOrigin.PAUSE:
            if snapshot.location is not Location.LOCAL or (snapshot.node is not None
                                                           and snapshot.node != node_of(actor.node)):
                return Violation(seq, MISPLACED,
                                 f"{aid} PAUSE snapshot {sid} is {_where(snapshot)}; a pause's image is LOCAL on the "
                                 f"node of the placement it ends: {describe(actor.node)} (worker {worker})")
        elif snapshot.location is not Location.EXTERNAL:
            return Violation(seq, MISPLACED, f"{aid} SUSPEND snapshot {sid} is {_where(snapshot)}; a suspend's image "
                                             "is EXTERNAL")
        return None

    @staticmethod
    def _copy_differs(snapshot: Snapshot, actor: Actor | None, actor_id: str) -> list[str]:
        """How `snapshot`, a copy of the actor's latest snapshot (a tag's), differs from it: id,
        stamp, template, fidelity, borrowed, location (what the fold keeps of the latest)."""
        kind = actor.snapshot if actor is not None else None
        if kind is None:
            return [f"{actor_id} has none ({_state(actor)})"]
        differs = []
        if snapshot.snapshot_id != actor.snapshot_id:
            differs.append(f"id {snapshot.snapshot_id}, the latest's {actor.snapshot_id}")
        if _key(snapshot.sandbox_runtime) != _kind_key(kind):
            differs.append(f"{_stamped(snapshot.sandbox_runtime)}, the latest "
                           f"{_stamped(kind.stamp.runtime if kind.stamp else None)}")
        if snapshot.template_uid != kind.template_uid:
            differs.append(f"template {snapshot.template_uid}, the latest's {kind.template_uid}")
        if snapshot.fidelity is not kind.fidelity:
            differs.append(f"fidelity {snapshot.fidelity.value}, the latest's {kind.fidelity.value}")
        if snapshot.borrowed != kind.borrowed:
            differs.append(f"borrowed {str(snapshot.borrowed).lower()}, the latest's {str(kind.borrowed).lower()}")
        if (snapshot.location is Location.LOCAL) != kind.local:
            differs.append(f"{snapshot.location.value}, the latest {'LOCAL' if kind.local else 'EXTERNAL'}")
        return differs

    def _tag_recorded(self, seq: int, event: TagRecorded) -> Violation | None:
        """What a tag names (what a creation from it copies) is a copy of its actor's latest snapshot,
        stamp unchanged: written with the actor's SnapshotTaken TAG, in the same append, before it."""
        snapshot = event.snapshot
        aid = snapshot.actor_id
        if self._unknowable(aid):
            return None
        actor = self.projection.actors.get(aid)
        differs = self._copy_differs(snapshot, actor, aid)
        if differs:
            return Violation(seq, NOT_COPIED, f"tag {event.tag} names {snapshot.snapshot_id}, which differs from "
                                              f"{aid}'s latest snapshot: " + "; ".join(differs))
        return None

    def _created(self, seq: int, event: ActorCreated) -> Violation | None:
        """A creation's snapshot is exactly what a tag names at this point of the log (whose it is
        aside), or a golden one, `borrowed`; either way of the actor's class. The log does not say
        which a creation came from: one that no tag names must be borrowed (a golden snapshot's
        content is the caller's, nothing in the log to compare it with)."""
        snapshot = event.snapshot
        if snapshot is None:
            return None
        aid, sid, stamp = event.actor_id, snapshot.snapshot_id, snapshot.sandbox_runtime
        if stamp is not None and stamp.sandbox_class != event.sandbox_class:
            return Violation(seq, NO_SOURCE,
                             f"{aid} (class {event.sandbox_class}) created with snapshot {sid} stamped for class "
                             f"{stamp.sandbox_class}: {_runtime(stamp)}")
        if snapshot.borrowed or self.tags_unknown or self.tagged.get(_image(snapshot)):
            return None
        near = ""
        tag = self.tag_of_id.get(sid)
        named = self.tags.get(tag) if tag is not None else None
        if named is not None:
            near = f"; tag {tag} names {sid} {_stamped(named[6])}" + (
                "" if _key(named[6]) != _key(stamp) else ", otherwise recorded")
        return Violation(seq, NO_SOURCE,
                         f"{aid} created with snapshot {sid} {_stamped(stamp)}, which no tag names at this "
                         f"point of the log, and not borrowed, as a golden one is{near}")

    def _reverted(self, seq: int, event: ActorReverted) -> Violation | None:
        """A revert gives up the LOCAL image of a PAUSED actor, or of a SUSPENDED one whose latest
        snapshot is LOCAL, and goes back to exactly the actor's latest EXTERNAL snapshot of this
        life (since its creation), or to none when it has had none."""
        aid = event.actor_id
        if self._unknowable(aid):
            return None
        actor = self.projection.actors.get(aid)
        kind = actor.snapshot if actor is not None else None
        if actor is None or not (actor.state is PAUSED or (actor.state is SUSPENDED and kind is not None
                                                            and kind.local)):
            latest = "" if kind is None else f" with its latest snapshot {'LOCAL' if kind.local else 'EXTERNAL'}"
            return Violation(seq, REVERT_NOTHING,
                             f"{aid} reverted while {_state(actor)}{latest}: a revert gives up the LOCAL image of a "
                             "PAUSED actor, or of a SUSPENDED one whose latest snapshot is LOCAL")
        back, want = event.snapshot, self.external.get(aid)
        if back is None and want is None:
            return None
        if back is not None and want is not None and hash((back.actor_id, _image(back))) == want.digest:
            return None
        to = "no snapshot (a cold boot)" if back is None \
            else f"{back.snapshot_id} {_stamped(back.sandbox_runtime)}"
        if want is None:
            return Violation(seq, REVERT_ELSEWHERE, f"{aid} reverted to {to}; it has had no EXTERNAL snapshot since "
                                                    "its creation, so a revert goes back to none")
        same = back is not None and back.snapshot_id == want.snapshot_id and \
            _key(back.sandbox_runtime) == _key(want.stamp)
        return Violation(seq, REVERT_ELSEWHERE,
                         f"{aid} reverted to {to}; its latest EXTERNAL snapshot of this life is {want.snapshot_id} "
                         f"{_stamped(want.stamp)}" + (", recorded otherwise" if same else ""))


class Sink:
    """What `Fold` folds into: a projection, bounded by a sequence or a time, optionally verified.

    It offers what `Fold` uses of a Projection (apply, booking_marker, worker_unread,
    actor_unread, tag_unread, booking_unread, skip, seq, unread_actor_seq).
    """

    def __init__(self, until_seq: int | None = None, until_time: datetime | None = None, verify: bool = False):
        self.projection = Projection()
        self.until_seq = until_seq
        self.until_time = until_time
        self.verifier = Verifier(self.projection) if verify else None
        self.violation: Violation | None = None
        self.stopped_at: int | None = None  # the first sequence left out by the bound
        self.stopped_at_time: datetime | None = None  # the time of its event, when the time bound left it out
        self.seq = 0  # position in the stream, folded or not
        self.last_at: datetime | None = None  # the time of the last event folded

    @property
    def events(self) -> int:
        return self.projection.events

    def _beyond(self, seq: int, event: Event | None) -> bool:
        if self.stopped_at is not None:
            return True
        if self.until_seq is not None and seq > self.until_seq:
            self.stopped_at = seq
            return True
        if event is not None and self.until_time is not None and event.at > self.until_time:
            self.stopped_at, self.stopped_at_time = seq, event.at
            return True
        return False

    def apply(self, seq: int, event: Event, version: int | None = None) -> None:
        if not self._beyond(seq, event) and self.violation is None:
            if self.verifier is not None:
                self.violation = self.verifier.check(seq, event)
            self.projection.apply(seq, event, version)
            self.last_at = event.at
        self.skip(seq)

    def booking_marker(self, seq: int, worker_id: str, version: int | None = None) -> None:
        """A WorkerBooked marker, which the fold reads from its subject without decoding it."""
        if not self._beyond(seq, None) and self.violation is None:
            self.projection.booking_marker(seq, worker_id, version)
        self.skip(seq)

    def worker_unread(self, seq: int, worker_id: str) -> None:
        """A message of a worker's history the fold cannot read: as the scheduler's projection takes it."""
        if not self._beyond(seq, None) and self.violation is None:
            self.projection.worker_unread(seq, worker_id)
        self.skip(seq)

    def actor_unread(self, seq: int, actor_id: str) -> None:
        """A message of an actor's history the fold cannot read: as the scheduler's projection takes it."""
        if not self._beyond(seq, None) and self.violation is None:
            self.projection.actor_unread(seq, actor_id)
        self.skip(seq)

    def tag_unread(self, seq: int, tag: str) -> None:
        """A message of a tag's history the fold cannot read: what the tag names is unknown to the
        verifier from here (the projection keeps nothing of tags)."""
        if not self._beyond(seq, None) and self.violation is None:
            self.projection.tag_unread(seq, tag)
            if self.verifier is not None:
                self.verifier.tag_unread(tag)
        self.skip(seq)

    @property
    def unread_actor_seq(self) -> int:
        """The last message of an actor's history the fold could not read (`Fold.fold_message`)."""
        return self.projection.unread_actor_seq

    def booking_unread(self, worker_id: str) -> None:
        """The booking marker just folded is a placement's the fold could not read: as the
        scheduler's projection takes it (the worker drained)."""
        if self.stopped_at is None and self.violation is None:
            self.projection.booking_unread(worker_id)
            if self.verifier is not None:
                self.verifier.booking_unread(self.seq, worker_id)

    def skip(self, seq: int) -> None:
        self._beyond(seq, None)
        if self.stopped_at is None:
            self.projection.skip(seq)
        self.seq = max(self.seq, seq)


def summary(projection: Projection) -> dict[str, Any]:
    """What a projection holds, in numbers (JSON values): the same for the scheduler and a replay."""
    from collections import Counter

    from events.codec import to_builtins

    workers = Counter(w.state.value for w in projection.workers.values())
    actors = Counter(a.state.value for a in projection.actors.values())
    return to_builtins({
        "seq": projection.seq,
        "events": projection.events,
        "workers": dict(sorted(workers.items())),
        "actors": dict(sorted(actors.items())),
        "stranded_snapshots": projection.stranded(),
        "lost_local_snapshots": projection.lost_local(),
        "fragmentation": fragmentation(projection),
    })

