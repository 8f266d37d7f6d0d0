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
from typing import Any, Callable

from events.compat import stamp_key
from events.schema import (
    Action,
    ActorPlaced,
    Event,
    Fidelity,
    PlacedFidelity,
    RuntimeChanged,
    SnapshotOrigin,
    SnapshotTaken,
)
from services.scheduler.fragmentation import fragmentation
from services.scheduler.projection import Projection
from services.scheduler.records import MEMORY, RUNNING, STOPPED, Actor

# The rules `audit verify` checks (names as they appear in its report): at each ActorPlaced,
UNKNOWN_ACTOR = "placement of an unknown actor"
PLACED_TWICE = "actor placed twice without a release"
NOT_TAKING = "placement on a worker that takes none"
PAST_ROOM = "worker booked past its room"
RUNTIME_GONE = "placement on a runtime the worker does not offer"
SELECTOR_UNMET = "placement on a worker that does not meet the actor's selectors"
LOCAL_OFF_NODE = "restore of a LOCAL snapshot off its node"
ACROSS_ARCHITECTURES = "restore without memory across architectures"
PLACED_STOPPED = "placement of a stopped actor"
NODE_MISMATCH = "placement names another node than its worker's"
NOT_IN_SNAPSHOT = "restore of what the latest snapshot does not hold"
BELOW_FLOOR = "placement below the actor's min_fidelity"
UNDER_BOOKED = "placement books less than the actor needs"
# at each SnapshotTaken and RuntimeChanged,
STAMP_NOT_PIN = "stamp differs from the actor's pin"
CHANGE_UNREGISTERED = "RuntimeChanged without a registration"
PLACEMENT_RULES = (UNKNOWN_ACTOR, PLACED_STOPPED, PLACED_TWICE, NOT_TAKING, PAST_ROOM, RUNTIME_GONE, SELECTOR_UNMET,
                   LOCAL_OFF_NODE, ACROSS_ARCHITECTURES, NODE_MISMATCH, NOT_IN_SNAPSHOT, BELOW_FLOOR,
                   UNDER_BOOKED)

# The floor's order (CONTRACT rule 4a): lower is better.
_RANK = {PlacedFidelity.MEMORY: 0, PlacedFidelity.VOLUMES: 1, PlacedFidelity.ROOTFS: 2, PlacedFidelity.NONE: 3}
_HOLDS = {Fidelity.MEMORY: 0, Fidelity.VOLUMES: 1, Fidelity.ROOTFS: 2}


@dataclass(frozen=True)
class Violation:
    seq: int
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"sequence {self.seq}: {self.rule}: {self.detail}"


class Verifier:
    """Checks one event against the projection folded up to the event before it."""

    def __init__(self, projection: Projection):
        self.projection = projection

    def check(self, seq: int, event: Event) -> Violation | None:
        if isinstance(event, ActorPlaced):
            return self._placement(seq, event)
        if isinstance(event, SnapshotTaken):
            return self._stamp(seq, event)
        if isinstance(event, RuntimeChanged) and event.worker_id not in self.projection.workers:
            return Violation(seq, CHANGE_UNREGISTERED,
                             f"worker {event.worker_id} is not registered")
        return None

    def _placement(self, seq: int, event: ActorPlaced) -> Violation | None:
        """A placement must be feasible on the log as it stood right before it (CONTRACT
        placement rules 2 to 8): no event of its worker that lands between a decision and
        its commit may have made it infeasible, and where the image lives and what it was
        built for decide where it may go."""
        aid, wid = event.actor_id, event.worker_id
        actor = self.projection.actors.get(aid)
        if actor is None:
            return Violation(seq, UNKNOWN_ACTOR, aid)
        if actor.state is RUNNING:
            return Violation(seq, PLACED_TWICE, f"{aid} already runs on {actor.worker.worker_id if actor.worker else '?'}")
        if actor.state is STOPPED:
            return Violation(seq, PLACED_STOPPED, aid)
        worker = self.projection.workers.get(wid)
        if worker is None or not worker.live:
            return Violation(seq, NOT_TAKING, f"{wid} is {'drained' if worker else 'not registered'}")
        if event.node != worker.node:  # the node a LOCAL image is judged by is the worker's, not what the event says
            return Violation(seq, NODE_MISMATCH,
                             f"{aid} placed on {wid} naming node {event.node}; {wid} is on {worker.node}")
        if event.booked.cpu_millis > worker.room_cpu or event.booked.memory_mib > worker.room_mem:
            return Violation(
                seq, PAST_ROOM,
                f"{wid} had {worker.room_cpu}m cpu / {worker.room_mem} MiB free, "
                f"{aid} booked {event.booked.cpu_millis}m / {event.booked.memory_mib} MiB",
            )
        labels = worker.labels
        unmet = sorted(f"{k}={v}" for k, v in actor.spec.selectors.items() if labels.get(k) != v)
        if unmet:
            return Violation(seq, SELECTOR_UNMET, f"{aid} selects {', '.join(unmet)}; {wid} has no such label")
        entry = worker.classes.get(actor.spec.sandbox_class)
        pin = stamp_key(event.sandbox_runtime)
        kind = actor.snapshot
        stamp = kind.stamp if kind is not None else None
        if entry is None:
            return Violation(seq, RUNTIME_GONE, f"{wid} does not register class {actor.spec.sandbox_class}")
        held = self._not_held(actor, event)
        if held is not None:
            return Violation(seq, NOT_IN_SNAPSHOT, held)
        floor = actor.spec.min_fidelity
        owns_nothing = kind is None or kind.borrowed  # rule 4a: may RUN unless the floor is MEMORY
        if (event.fidelity is PlacedFidelity.NONE and (not owns_nothing or floor is Fidelity.MEMORY)) or (
                event.fidelity is not PlacedFidelity.NONE and _RANK[event.fidelity] > _HOLDS[floor]):
            return Violation(seq, BELOW_FLOOR,
                             f"{aid} placed at {event.fidelity.value}, its min_fidelity is {floor.value}")
        if event.fidelity is PlacedFidelity.MEMORY:
            # any runtime of the worker that accepts the stamp (rule 2 prefers one; another with
            # room is just as loadable), and the pin must be that runtime's own version
            matches = entry.accepting.get(stamp.compat, ()) if stamp is not None else ()
            runtime = next((r for _, r in matches if r.compat.key == pin), None)
            if runtime is None:
                return Violation(seq, RUNTIME_GONE,
                                 f"{aid}'s memory image ({stamp_key(stamp.runtime) if stamp else 'unstamped'}) "
                                 f"restored on {wid} pinned to {pin}, which {wid} does not offer for it")
        elif entry.default.compat.key != pin:
            return Violation(seq, RUNTIME_GONE, f"{aid} pinned to {pin}; {wid}'s default is {entry.default.compat.key}")
        else:
            runtime = entry.default
        want = actor.spec.resources
        need = want.memory_mib + runtime.overhead_mib(want.memory_mib)
        if event.booked.cpu_millis < want.cpu_millis or event.booked.memory_mib < need:
            return Violation(seq, UNDER_BOOKED,
                             f"{aid} needs {want.cpu_millis}m / {need} MiB under {pin}; it booked "
                             f"{event.booked.cpu_millis}m / {event.booked.memory_mib} MiB")
        if kind is not None and kind.local and event.action is Action.RESTORE and worker.node != actor.image_node:
            return Violation(seq, LOCAL_OFF_NODE,
                             f"{aid}'s latest snapshot is LOCAL on node {actor.image_node}; "
                             f"restored on {wid} on {worker.node}")
        without_memory = event.fallback is not None or (
            event.action is Action.RESTORE and event.fidelity is not PlacedFidelity.MEMORY)
        if without_memory and stamp is not None and stamp.compat.arch is not None \
                and entry.default.compat.arch != stamp.compat.arch:
            return Violation(seq, ACROSS_ARCHITECTURES,
                             f"{aid}'s snapshot is {stamp.compat.arch}; {wid}'s default is {entry.default.compat.arch}")
        return None

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
        if _RANK[event.fidelity] < _HOLDS[kind.fidelity]:
            return f"{aid} restored at {event.fidelity.value} from a {kind.fidelity.value} snapshot"
        if event.fidelity is PlacedFidelity.MEMORY and kind.fidelity is MEMORY:
            if kind.template_uid != actor.spec.template_uid:
                return (f"{aid}'s memory image is of template {kind.template_uid}, "
                        f"the actor's is {actor.spec.template_uid}")
            if kind.stamp is None or kind.stamp.compat.sandbox_class != actor.spec.sandbox_class:
                return f"{aid}'s memory image is unstamped or stamped for another class"
        return None

    def _stamp(self, seq: int, event: SnapshotTaken) -> Violation | None:
        actor = self.projection.actors.get(event.actor_id)
        stamp = event.snapshot.sandbox_runtime
        if actor is None or stamp is None:
            return None
        origin = event.origin
        if origin in (SnapshotOrigin.PAUSE, SnapshotOrigin.SUSPEND) and actor.state is RUNNING:
            expected = actor.pin.runtime if actor.pin else None
            what = "its assignment's pin"
        elif origin in (SnapshotOrigin.PROMOTE, SnapshotOrigin.TAG):
            expected = actor.snap_stamp.runtime if actor.snap_stamp else None
            what = "the snapshot it copies"
        else:
            return None
        if expected is None or stamp_key(stamp) != stamp_key(expected):
            return Violation(seq, STAMP_NOT_PIN,
                             f"{event.actor_id} {origin.value} stamped {stamp_key(stamp)}, {what} is "
                             f"{stamp_key(expected) if expected else 'missing'}")
        return None


class Sink:
    """What `Fold` folds into: a projection, bounded by a sequence or a time, optionally verified.

    It offers what `Fold` uses of a Projection (apply, booking_marker, worker_unread,
    actor_unread, tag_unread, booking_unread, skip, seq, unread_actor_seq).
    """

    def __init__(self, until_seq: int | None = None, until_time: datetime | None = None, verify: bool = False,
                 on_position: Callable[[int], None] | None = None):
        self.projection = Projection()
        self.until_seq = until_seq
        self.until_time = until_time
        self.verifier = Verifier(self.projection) if verify else None
        self.violation: Violation | None = None
        self.stopped_at: int | None = None  # the first sequence left out by the bound
        self.seq = 0  # position in the stream, folded or not
        self.on_position = on_position

    @property
    def events(self) -> int:
        return self.projection.events

    def _beyond(self, seq: int, event: Event | None) -> bool:
        if self.stopped_at is not None:
            return True
        if (self.until_seq is not None and seq > self.until_seq) or (
            event is not None and self.until_time is not None and event.at > self.until_time
        ):
            self.stopped_at = seq
            return True
        return False

    def apply(self, seq: int, event: Event, version: int | None = None) -> None:
        if not self._beyond(seq, event) and self.violation is None:
            if self.verifier is not None:
                self.violation = self.verifier.check(seq, event)
            self.projection.apply(seq, event, version)
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
        """A message of a tag's history the fold cannot read: as the scheduler's projection takes it."""
        if not self._beyond(seq, None) and self.violation is None:
            self.projection.tag_unread(seq, tag)
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

    def skip(self, seq: int) -> None:
        self._beyond(seq, None)
        if self.stopped_at is None:
            self.projection.skip(seq)
        self.seq = max(self.seq, seq)
        if self.on_position is not None:
            self.on_position(seq)


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

