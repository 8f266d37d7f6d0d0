"""What the registry decides about a worker: the Worker aggregate.

Pure decisions: no I/O, no asyncio, no clock (each command takes `at`). The
service (`services.registry.service`) loads a Worker, calls one command, and
saves the events it recorded.

Rules (CONTRACT sections 2 and 3, Registry):

- A worker's first registration fixes its set of sandbox classes. A later one
  that adds or drops a class is FAILED_PRECONDITION (field `sandbox_classes`):
  a worker does not change class; it is removed and registered anew.
- What is stored and compared is the normalised registration (v1.1): classes sorted
  by name, each version's attributes sorted by key, restorable runtimes and
  compatible versions taken as sets (stored sorted by compat key), a null
  `actor_overhead` as zeros. So a report that only reorders them, or sends `null`
  for zero overhead, is no change (`UNCHANGED`).
- Identical content writes nothing (`UNCHANGED`). Any difference in a class entry
  (a default or restorable runtime's version, name or actor overhead) writes
  `RuntimeChanged` with the whole new set and the set it replaces; a different
  node, capacity or labels writes `WorkerUpdated`. Both may come from one
  request: `RuntimeChanged` is written first and the outcome is `RUNTIME_CHANGED`.
- Every event a registration would write must fit one message of the NATS server (its max_payload,
  EVENT_HEADROOM kept for the headers): one that does not is INVALID_ARGUMENT, field
  `sandbox_classes` (`labels` for a WorkerUpdated), its message naming both sizes, and nothing is
  recorded (`check_fits`). A RuntimeChanged carries the previous classes too, so a change can be
  refused where the same registration of a new life (its WorkerRegistered) fits.
- Lives: `WorkerRemoved` (by a caller or as `LOST`) ends a worker's life. A
  removed worker may register again: that writes `WorkerRegistered` and starts a
  new life with whatever classes it now reports, undrained.
- Drain is sticky within a life: a drained worker that registers again (say,
  after its agent restarted) stays drained, as a cordoned node stays cordoned
  when its kubelet restarts. Draining a drained worker writes nothing.
- Drain and remove of a worker that is not registered (never was, or removed)
  are NOT_FOUND; so is a heartbeat.
- Request ids are scoped to one life (`WireAggregate.prior`): a registration of a
  removed worker with a request id of its previous life registers it anew.
- Revisions (project addition, docs/contract.md): a registration may carry `revision`, a
  number its sender never lowers (warmboot's agent: its clock in ms when it made the
  content, across its restarts). One lower than the highest the worker's history holds,
  in any life, or equal to it with other content, is FAILED_PRECONDITION (field `revision`);
  one beginning a life under a request id sent before that life ended (the service looks:
  history, kept answers, refusals marked) is FAILED_PRECONDITION (field `request_id`);
  nothing written: a copy of an older registration that a stalled replica decides after a
  newer one, or after the worker was removed, would put back runtimes the machine no
  longer has. A removal may carry a revision too (its agent's: above the highest, then
  recorded), which orders it after everything the agent sent. So that every
  revision answered is in the history, a higher revision with the same content writes
  `WorkerUpdated` (same node, capacity and labels; outcome `UPDATED`) instead of nothing:
  once per content an agent makes, never in a storm of unchanged re-registrations.
  Without a revision nothing is checked (a sender that does not order its registrations).
  A revision more than a year ahead of the registry's clock in ms is INVALID_ARGUMENT
  (`REVISION_AHEAD_MS`): the highest is kept across lives, and one credential must not be
  able to put it out of its successors' reach.
- Node tokens (project addition, docs/contract.md rule 5): a registration may carry `node_token`,
  the token kept on its node's own disk. It is part of what a registration registers: one that
  changes it writes `WorkerUpdated` with it. One that names another token than the one the
  worker's life registered (both given) is another disk, so another machine: the life ends
  (`WorkerRemoved`, `DISK_CHANGED_REASON`: its actors are released, what ran on the old machine
  is gone) and the registration begins a new one (`WorkerRegistered`, outcome `REGISTERED`,
  undrained), in one decision. A token given where the life had none is an agent upgraded on the
  same machine: `WorkerUpdated`, the life goes on. A registration without a token, of a worker
  whose history (any life) registered one, is FAILED_PRECONDITION (field `node_token`), nothing
  written: its agent restarted without its token file, on the machine that replaced the node's
  first, would be taken as on that first disk, whose images it does not have.
- A heartbeat may name the revision of the registration it keeps alive (its agent's in
  force): one naming another than the worker's registration in force is FAILED_PRECONDITION
  (field `revision`), and keeps nothing alive (`check_beats_in_force`). Two machines run
  as one worker id: the second registered its CPU over the first's and stopped, and the
  first's beats kept that registration, a CPU no running machine of the worker has, for as
  long as it ran (an audit). Without a revision, or when the registration in force has
  none, nothing is checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from events.aggregate import WireAggregate
from events.codec import encode
from events.compat import canonical_version, compat_key
from events.errors import (beat_not_in_force, drain_not_in_force, event_too_large, invalid, no_worker, not_found,
                           precondition, revision_refused)
from events.schema import (
    ActorOverhead,
    Event,
    Labels,
    RegisterOutcome,
    RegisterWorker,
    Resources,
    RuntimeChanged,
    WorkerDrained,
    WorkerRegistered,
    WorkerRemoved,
    WorkerRuntime,
    WorkerSandboxClass,
    WorkerUpdated,
)
from services.registry.nodes import allows, unbound_reason

LOST = "LOST"
# How far a registration's revision may run ahead of the registry's clock (in ms, the agent's
# unit). The highest revision is kept across lives, so without a bound one credential could
# send the largest and leave every later registration of its worker refused for good; with it,
# a sender refused goes on one above the highest (the refusal names it), which is then within
# the bound.
REVISION_AHEAD_MS = 366 * 24 * 3600 * 1000

# The reason of the removal that ends a worker's life when it registers from another disk of its node
# (another node token): at most 256 characters (a contract reason), the node an id of at most 128.
DISK_CHANGED_REASON = ("registered from another disk of node {node} (another node token): a new machine, a new "
                       "life; what ran on the old one is gone")


def disk_changed_reason(node: str) -> str:
    return DISK_CHANGED_REASON.format(node=node)[:256]


NO_OVERHEAD = ActorOverhead(fixed_mib=0, per_gib_mib=0)

# What an event message carries besides its body, kept out of the server's max_payload: its id, topic and
# version, and an atomic batch's id, sequence, commit and expected sequence (a few hundred bytes for the
# longest worker id: tests/test_registry_event_size.py measures them).
EVENT_HEADROOM = 1024


def canonical_runtime(runtime: WorkerRuntime) -> WorkerRuntime:
    """A runtime as stored: attributes sorted, compatible versions as a sorted set, overhead explicit."""
    version = canonical_version(runtime.version)
    edges = tuple(sorted({compat_key("", v): canonical_version(v) for v in runtime.compatible_versions}.items()))
    compatible = tuple(v for _, v in edges)
    overhead = runtime.actor_overhead or NO_OVERHEAD
    if (version, compatible, overhead) == (runtime.version, runtime.compatible_versions, runtime.actor_overhead):
        return runtime
    return WorkerRuntime(version=version, name=runtime.name, actor_overhead=overhead, compatible_versions=compatible)


def canonical_classes(classes: tuple[WorkerSandboxClass, ...]) -> tuple[WorkerSandboxClass, ...]:
    """The stored form of a worker's class entries: sorted by class, restorable runtimes
    as a set sorted by compat key, every runtime canonical."""
    out = []
    for entry in sorted(classes, key=lambda e: e.sandbox_class):
        restorable = sorted((canonical_runtime(r) for r in entry.restorable_runtimes),
                            key=lambda r: compat_key("", r.version))
        out.append(WorkerSandboxClass(
            sandbox_class=entry.sandbox_class,
            default_runtime=canonical_runtime(entry.default_runtime),
            restorable_runtimes=tuple(restorable),
        ))
    return tuple(out)


def check_beats_in_force(worker_id: str, beats: int, in_force: int | None, node: str | None) -> None:
    """FAILED_PRECONDITION (field `revision`) when a heartbeat naming the registration of revision
    `beats` would keep alive the worker's registration in force, of revision `in_force`, another
    one (None: registered without a revision, nothing to tell them apart by). The refusal names the
    node that registration was made on (`node`): an agent tells another machine's from its own by it
    (`events.errors.in_force_named`)."""
    if in_force is not None and beats != in_force:
        raise beat_not_in_force(worker_id, beats, in_force, node)


def check_fits(event: WorkerRegistered | RuntimeChanged | WorkerUpdated, max_payload: int | None) -> None:
    """INVALID_ARGUMENT, naming the request's field that makes it so large, if `event` (one a registration
    would write) is larger than one message of a NATS server whose max_payload is `max_payload` carries,
    EVENT_HEADROOM kept for its headers; None: not known, not checked. The body is bounded by the same
    max_payload (and by the 1 MiB of `events.codec.MAX_BODY`), but an event is not: RuntimeChanged carries
    the new classes and the previous ones, about twice a registration's, and every event the canonical
    form (a null overhead as zeros, every default spelt out). Unchecked, the store refused it (DataError:
    INTERNAL), and the registration it would record never took the place of the one in force, which the
    worker's heartbeats kept alive (docs/contract.md, "A registration too large for one event")."""
    if max_payload is None:
        return
    room = max_payload - EVENT_HEADROOM
    size = len(encode(event))
    if size <= room:
        return
    worker = event.worker_id
    if isinstance(event, RuntimeChanged):
        raise event_too_large(
            f"worker {worker!r}: this registration changes its runtimes, and the RuntimeChanged event recording "
            f"the change, which carries the new sandbox_classes ({len(encode(event.sandbox_classes))} bytes) "
            f"and the previous ones it replaces ({len(encode(event.previous))} bytes),", size, room, max_payload,
            EVENT_HEADROOM, "the registration in force stays. Register fewer or smaller runtimes or compatible "
            "versions, so that the new classes and the previous ones fit together; or remove the worker and "
            "register it anew (its WorkerRegistered carries its classes once); or raise the server's max_payload",
            "sandbox_classes")
    if isinstance(event, WorkerRegistered):
        raise event_too_large(
            f"worker {worker!r}: the WorkerRegistered event recording this registration, which carries its "
            f"sandbox_classes ({len(encode(event.sandbox_classes))} bytes, every default spelt out),", size,
            room, max_payload, EVENT_HEADROOM, "register fewer or smaller runtimes or compatible versions, or "
            "raise the server's max_payload", "sandbox_classes")
    raise event_too_large(
        f"worker {worker!r}: the {type(event).__name__} event recording this registration's node, capacity and "
        "labels", size, room, max_payload, EVENT_HEADROOM, "the registration in force stays. Register fewer or "
        "shorter labels, or raise the server's max_payload", "labels")


def register_outcome(events: list[Event]) -> RegisterOutcome:
    """The outcome a registration answered, from the events it wrote."""
    kinds = {type(e) for e in events}
    if WorkerRegistered in kinds:
        return RegisterOutcome.REGISTERED
    if RuntimeChanged in kinds:
        return RegisterOutcome.RUNTIME_CHANGED
    if WorkerUpdated in kinds:
        return RegisterOutcome.UPDATED
    return RegisterOutcome.UNCHANGED


def _names(classes: tuple[WorkerSandboxClass, ...]) -> list[str]:
    return sorted(entry.sandbox_class for entry in classes)


class Worker(WireAggregate):
    """One worker's history (`worker.<worker_id>`): registrations, drains, removals."""

    KIND = "worker"
    LIFE_VERB = "register"  # a registration of a removed (or never registered) worker starts a life
    # an earlier life's runtimes, brought back late; its drain or removal, acting on the next life
    REFUSED_FROM_AN_EARLIER_LIFE = frozenset({"register", "drain", "remove"})
    VERB_FIRST = {
        "register": lambda e: isinstance(e, (WorkerRegistered, RuntimeChanged, WorkerUpdated)),
        "drain": lambda e: isinstance(e, WorkerDrained),
        "remove": lambda e: isinstance(e, WorkerRemoved),
    }

    def __init__(self, entity_id: str):
        super().__init__(entity_id)
        self.alive = False  # registered, and not removed since
        self.lives = 0
        self.node: str | None = None
        self.capacity: Resources | None = None
        self.labels: Labels = {}
        self.sandbox_classes: tuple[WorkerSandboxClass, ...] = ()
        # the drain in force in this life: the version of its WorkerDrained and the reason it gives
        self.drain_in_force: tuple[int, str | None] | None = None
        self.removed_reason: str | None = None
        self.revision: int | None = None  # the highest a registration of any life recorded
        self.in_force: int | None = None  # the revision of the registration in force (the roster's `revision`)
        self.revised_content: tuple | None = None  # what the worker was once `revision` was recorded
        self.node_token: str | None = None  # the token of its node's disk this life registered from now
        self.tokened = False  # a registration of any life gave a node token

    # --- decisions ------------------------------------------------------------------

    def register(self, request: RegisterWorker, at: datetime, sent_before: bool = False,
                 max_payload: int | None = None) -> RegisterOutcome:
        """Decide a registration (the rules in the module's docstring). `sent_before`: its request id
        was sent before, in a life that has ended (the service looks, `_sent_before`). `max_payload`:
        what one message of the NATS server carries; each event this registration would write must fit
        it (`check_fits`: INVALID_ARGUMENT, nothing recorded, otherwise)."""
        classes = canonical_classes(request.sandbox_classes)
        rid, revision = request.request_id, request.revision
        if request.node_token is None and self.tokened:
            raise precondition(
                f"worker {self.entity_id!r} registered a node_token before (the disk of its node it runs on): a "
                "registration without one cannot say which disk it is on, and would be sent LOCAL images of a "
                "disk it may not have. Give the token (warmboot agent --node-token-file, the file on the disk of "
                "the node's LOCAL snapshots), or register the machine under a new worker id", "node_token")
        if revision is not None:
            self._check_revision(revision, at)
            # Equal to the highest: the registration recorded at it, sent again, unless with other content.
            # Beginning a life, at any revision, under a request id sent before that life ended (recorded,
            # answered without an event, or refused): a copy decided late after the worker was removed (by
            # its agent for want of the CPU it names, by an operator, or as LOST), refused. An agent sends
            # every registration under a new id: one that does not know of the removal (its registration
            # after a reconnect) begins the life.
            if self.revision is not None and (revision < self.revision or (
                    revision == self.revision and self._content_of(request, classes) != self.revised_content)):
                raise revision_refused(self.entity_id, revision, self.revision)
            if not self.alive and sent_before:
                raise precondition(
                    f"request_id {rid!r} was sent before the last life of worker {self.entity_id!r} ended: a copy of "
                    "that registration, decided late, does not begin a life; a sender that means it sends it "
                    "with a new request_id", "request_id")
        another_disk = self.alive and self._another_disk(request.node_token)
        if not self.alive or another_disk:
            registered = WorkerRegistered(
                at=at,
                request_id=rid,
                worker_id=self.entity_id,
                node=request.node,
                capacity=request.capacity,
                labels=dict(request.labels),
                sandbox_classes=classes,
                revision=revision,
                node_token=request.node_token,
            )
            check_fits(registered, max_payload)
            if another_disk:
                # another machine under this worker id: its predecessor's life, and the actors placed in it, end
                self.record(WorkerRemoved(at=at, worker_id=self.entity_id, reason=disk_changed_reason(request.node)))
            self.record(registered)
            return RegisterOutcome.REGISTERED
        self._check_same_classes(classes)
        runtime_changed = classes != self.sandbox_classes
        updated = (request.node, request.capacity, dict(request.labels), request.node_token) != (
            self.node,
            self.capacity,
            self.labels,
            self.node_token,
        )
        # A higher revision is written even with the same content: the next copy of an older
        # registration is then refused on the history alone.
        updated = updated or (revision is not None and revision != self.revision and not runtime_changed)
        changes: list[RuntimeChanged | WorkerUpdated] = []
        if runtime_changed:
            changes.append(RuntimeChanged(
                at=at,
                request_id=rid,
                worker_id=self.entity_id,
                sandbox_classes=classes,
                previous=self.sandbox_classes,
                revision=revision,
            ))
        if updated:
            changes.append(WorkerUpdated(
                at=at,
                request_id=rid,
                worker_id=self.entity_id,
                node=request.node,
                capacity=request.capacity,
                labels=dict(request.labels),
                revision=revision,
                node_token=request.node_token,
            ))
        for change in changes:  # every one checked before any is recorded: all or nothing
            check_fits(change, max_payload)
        for change in changes:
            self.record(change)
        if runtime_changed:
            return RegisterOutcome.RUNTIME_CHANGED
        return RegisterOutcome.UPDATED if updated else RegisterOutcome.UNCHANGED

    def drain(self, reason: str | None, at: datetime, request_id: str | None = None,
              revision: int | None = None) -> bool:
        """Mark the worker drained; False (nothing written) if it already is. With a `revision` (the
        registration the drain is for: its agent's, at its exit), FAILED_PRECONDITION (field `revision`),
        nothing written, when the registration in force is another (`drain_not_in_force`); one made
        without a revision has nothing to tell them apart by, and is drained."""
        self.require_alive()
        if revision is not None and self.in_force is not None and revision != self.in_force:
            raise drain_not_in_force(self.entity_id, revision, self.in_force, self.node)
        if self.drained:
            return False
        self.record(WorkerDrained(at=at, request_id=request_id, worker_id=self.entity_id, reason=reason))
        return True

    def remove(self, reason: str | None, at: datetime, request_id: str | None = None,
               revision: int | None = None) -> None:
        """End the worker's life. With a `revision` (its agent's: above every revision it sent,
        refused ones included), recorded, so that a copy of anything it sent before, decided late,
        is lower and refused instead of beginning a life the agent ended."""
        self.require_alive()
        if revision is not None:
            self._check_revision(revision, at)
            if self.revision is not None and revision <= self.revision:
                raise revision_refused(self.entity_id, revision, self.revision)
        self.record(WorkerRemoved(at=at, request_id=request_id, worker_id=self.entity_id, reason=reason,
                                  revision=revision))

    def remove_unbound(self, nodes: Mapping[str, str], at: datetime) -> bool:
        """Remove the worker if it is in a life on a node `nodes` (the deployment's binding of workers
        to nodes) does not give it; False, nothing recorded, otherwise. Decided on the history's
        node: a move to its own node stored a moment before is seen, and of two replicas deciding
        it, the loser decides again on the fresh state and writes nothing (as `lose`)."""
        if not self.alive or allows(nodes, self.entity_id, self.node):
            return False
        self.record(WorkerRemoved(at=at, worker_id=self.entity_id, reason=unbound_reason(self.node)))
        return True

    def lose(self, at: datetime) -> bool:
        """Remove the worker as LOST (its heartbeats stopped); False if it is not alive.

        Two registry replicas deciding this on the same version conflict on save;
        the loser re-decides on the fresh state, finds the worker removed, and
        writes nothing: exactly one `WorkerRemoved(LOST)` per life.
        """
        if not self.alive:
            return False
        self.record(WorkerRemoved(at=at, worker_id=self.entity_id, reason=LOST))
        return True

    @property
    def drained(self) -> bool:
        return self.drain_in_force is not None

    def require_alive(self) -> None:
        if not self.alive:
            if self.lives:
                raise not_found(f"worker {self.entity_id!r} was removed ({self.removed_reason or 'no reason'})",
                                "worker_id")
            raise no_worker(self.entity_id)

    def _another_disk(self, node_token: str | None) -> bool:
        """Whether a registration naming `node_token` is from another disk than the one this life
        registered from: both name one, and they differ."""
        return node_token is not None and self.node_token is not None and node_token != self.node_token

    def _check_same_classes(self, classes: tuple[WorkerSandboxClass, ...]) -> None:
        have, want = _names(self.sandbox_classes), _names(classes)
        if have == want:
            return
        added = [c for c in want if c not in have]
        dropped = [c for c in have if c not in want]
        parts = []
        if added:
            parts.append(f"adds {', '.join(added)}")
        if dropped:
            parts.append(f"drops {', '.join(dropped)}")
        raise precondition(
            f"worker {self.entity_id!r} registered the sandbox classes [{', '.join(have)}]; "
            f"this registration {' and '.join(parts)}. A worker does not change class: "
            "remove it and register it anew",
            "sandbox_classes",
        )

    # --- evolution ----------------------------------------------------------------------

    def starts_life(self, body: Event) -> bool:
        return isinstance(body, WorkerRegistered) and not self.alive

    @staticmethod
    def _check_revision(revision: int, at: datetime) -> None:
        if revision > at.timestamp() * 1000 + REVISION_AHEAD_MS:
            raise invalid(f"revision {revision} is more than a year ahead of the registry's clock in "
                          "milliseconds (a sender never goes below the revision it last sent; it need "
                          "not jump ahead)", "revision")

    @staticmethod
    def _content_of(request: RegisterWorker, classes: tuple[WorkerSandboxClass, ...]) -> tuple:
        return request.node, request.capacity, tuple(sorted(request.labels.items())), classes, request.node_token

    def _content(self) -> tuple:
        return self.node, self.capacity, tuple(sorted(self.labels.items())), self.sandbox_classes, self.node_token

    def _revised(self, revision: int | None) -> None:
        """After an event's fields are applied: the highest revision, and what it registered (an
        equal revision with other content is another registration, and refused)."""
        if revision is not None and (self.revision is None or revision >= self.revision):
            self.revision = revision
            self.revised_content = self._content() if self.alive else None  # a removal registered nothing

    def when_WorkerRegistered(self, event: WorkerRegistered) -> None:
        self.alive = True
        self.lives += 1
        self.drain_in_force = None
        self.removed_reason = None
        self.node, self.capacity, self.labels = event.node, event.capacity, dict(event.labels)
        self.node_token = event.node_token
        self.tokened = self.tokened or event.node_token is not None
        self.sandbox_classes = canonical_classes(event.sandbox_classes)
        self._revised(event.revision)
        self.in_force = event.revision

    def when_RuntimeChanged(self, event: RuntimeChanged) -> None:
        self.sandbox_classes = canonical_classes(event.sandbox_classes)
        self._revised(event.revision)
        self.in_force = event.revision

    def when_WorkerUpdated(self, event: WorkerUpdated) -> None:
        self.node, self.capacity, self.labels = event.node, event.capacity, dict(event.labels)
        self.node_token = event.node_token
        self.tokened = self.tokened or event.node_token is not None
        self._revised(event.revision)
        self.in_force = event.revision

    def when_WorkerDrained(self, event: WorkerDrained) -> None:
        self.drain_in_force = (self.version + 1, event.reason)  # (applied before the version moves on)

    def when_WorkerRemoved(self, event: WorkerRemoved) -> None:
        self.alive = False
        self.drain_in_force = None
        self.removed_reason = event.reason or ""
        self._revised(event.revision)
        self.in_force = None
        self.node_token = None
