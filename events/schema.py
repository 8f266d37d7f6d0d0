"""The wire schema: every type, request, reply and event of CONTRACT.md, defined once.

Constraints that msgspec can express (patterns, lengths, bounds) live in the
annotations below, so that decoding a body is also validating it; the rules it
cannot express (unique keys, `architecture` in v1, distinct restorable runtimes,
unique classes) are in `events.validate`.

Events are a tagged union on `type` (the class name), so one decoder turns any
message of the log straight into its Struct.
"""

from __future__ import annotations

import enum
import re
from datetime import datetime
from typing import Annotated, ClassVar, Union

from msgspec import Meta, Struct, field

from events.states import ActorState, WorkerState

# --- scalar constraints (CONTRACT section 2) ---------------------------------

# Every pattern ends in `(?!\n)$`, not a bare `$`: msgspec matches with Python's
# `re.search`, whose `$` also matches before a final newline, so `"abc\n"` would
# pass as an id. The lookahead closes that and still means the same to ECMA-262
# regex engines reading the published JSON Schema.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}(?!\n)$"
ID_RE = re.compile(ID_PATTERN)  # an id checked outside a Struct (a subject token, a file's entry)
ID_WORDS = "1 to 128 letters, digits, '_' or '-', the first a letter or digit"  # ID_PATTERN, as errors say it
CLASS_PATTERN = r"^[a-z][a-z0-9-]{0,62}(?!\n)$"
SCHEMA_VERSION_PATTERN = r"^v[1-9][0-9]{0,3}(?!\n)$"
ATTR_KEY_PATTERN = r"^[a-z][a-z0-9_]{0,127}(?!\n)$"
# Printable (CONTRACT section 2, v1.1) is what `str.isprintable()` accepts. A regular
# expression for that would list every unassigned code point of one Unicode version,
# so the pattern below (no C0/C1 control character, no DEL) is only what the published
# JSON Schema can say; every field typed with it is also marked `PRINTABLE`, and
# `events.validate` checks those with `str.isprintable()` right after decoding.
PRINTABLE_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*(?!\n)$"
PRINTABLE = {"printable": True}
LABEL_KEY_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,251}[A-Za-z0-9])?(?!\n)$"
# Each pattern as an error says it (`events.codec.field_path`), not as a regular expression.
PATTERN_WORDS = {
    ID_PATTERN: f"an id: {ID_WORDS}",
    CLASS_PATTERN: "a sandbox class: 1 to 63 lower-case letters, digits or '-', the first a letter",
    SCHEMA_VERSION_PATTERN: "a schema version: 'v' and a number from 1 to 9999, such as v1",
    ATTR_KEY_PATTERN: "an attribute key: 1 to 128 lower-case letters, digits or '_', the first a letter",
    PRINTABLE_PATTERN: "printable text (no control characters)",
    LABEL_KEY_PATTERN: "a label key: 1 to 253 letters, digits, '.', '_', '/' or '-', the first and last a "
                       "letter or digit",
}

MAX_INT = 1 << 40  # MiB and millicores: far above any machine, far below overflow

Id = Annotated[str, Meta(pattern=ID_PATTERN, description="one NATS subject token")]
SandboxClass = Annotated[str, Meta(pattern=CLASS_PATTERN)]
SchemaVersion = Annotated[str, Meta(pattern=SCHEMA_VERSION_PATTERN)]
AttrKey = Annotated[str, Meta(pattern=ATTR_KEY_PATTERN)]
AttrValue = Annotated[str, Meta(min_length=1, max_length=256, pattern=PRINTABLE_PATTERN, extra=PRINTABLE)]
Name = Annotated[str, Meta(max_length=253, pattern=PRINTABLE_PATTERN, extra=PRINTABLE)]
Reason = Annotated[str, Meta(max_length=256, pattern=PRINTABLE_PATTERN, extra=PRINTABLE)]
Uri = Annotated[str, Meta(max_length=2048, pattern=PRINTABLE_PATTERN, extra=PRINTABLE)]
RequestId = Annotated[str, Meta(min_length=1, max_length=128, pattern=PRINTABLE_PATTERN, extra=PRINTABLE)]
LabelKey = Annotated[str, Meta(pattern=LABEL_KEY_PATTERN)]
LabelValue = Annotated[str, Meta(max_length=256, pattern=PRINTABLE_PATTERN, extra=PRINTABLE)]
Labels = Annotated[dict[LabelKey, LabelValue], Meta(max_length=64)]
NonNegative = Annotated[int, Meta(ge=0, le=MAX_INT)]
Positive = Annotated[int, Meta(gt=0, le=MAX_INT)]
Seq = Annotated[int, Meta(ge=0)]
# The stream sequence of a message, as a pause or suspend names its placement (`placement_seq`)
# and a resume its actor's life (`life_seq`):
# JetStream numbers messages from 1, so 0 names none (INVALID_ARGUMENT; it was FAILED_PRECONDITION,
# which told a client's unset 0 that the actor had been placed anew).
StreamSeq = Annotated[int, Meta(ge=1)]
# A registration's revision (project addition, docs/contract.md): a number its sender never
# lowers for a worker, across its own restarts (warmboot's agent: its clock in ms); at most 2^53 - 1,
# an integer every JSON reader keeps exactly.
MAX_REVISION = (1 << 53) - 1
Revision = Annotated[int, Meta(ge=0, le=MAX_REVISION)]
# RFC 3339 with a zone (CONTRACT section 1); a caller's other offset is normalised to UTC
# at the edge (events.validate), so every time in the log is UTC.
Time = Annotated[datetime, Meta(tz=True)]


class Base(Struct, kw_only=True, frozen=True):
    """Every wire Struct: immutable (hashable where its fields are).

    msgspec applies `kw_only` per class, so every subclass repeats it: fields are
    always passed by name, which lets required fields follow optional ones.
    """


# --- enums --------------------------------------------------------------------


class Fidelity(enum.Enum):
    """What a snapshot can restore, best first."""

    MEMORY = "MEMORY"
    VOLUMES = "VOLUMES"
    ROOTFS = "ROOTFS"


class PlacedFidelity(enum.Enum):
    """What a placement restores: a snapshot's fidelity, or NONE for a cold boot."""

    MEMORY = "MEMORY"
    VOLUMES = "VOLUMES"
    ROOTFS = "ROOTFS"
    NONE = "NONE"


class Location(enum.Enum):
    LOCAL = "LOCAL"
    EXTERNAL = "EXTERNAL"


class Action(enum.Enum):
    RESTORE = "RESTORE"
    RUN = "RUN"


class FallbackReason(enum.Enum):
    NO_COMPATIBLE_WORKER = "NO_COMPATIBLE_WORKER"
    TEMPLATE_CHANGED = "TEMPLATE_CHANGED"
    SNAPSHOT_NOT_MEMORY = "SNAPSHOT_NOT_MEMORY"


class ReleaseReason(enum.Enum):
    PAUSED = "PAUSED"
    SUSPENDED = "SUSPENDED"
    STOPPED = "STOPPED"
    WORKER_REMOVED = "WORKER_REMOVED"


class SnapshotOrigin(enum.Enum):
    PAUSE = "PAUSE"
    SUSPEND = "SUSPEND"
    PROMOTE = "PROMOTE"
    TAG = "TAG"
    CREATE = "CREATE"


class RegisterOutcome(enum.Enum):
    REGISTERED = "REGISTERED"
    RUNTIME_CHANGED = "RUNTIME_CHANGED"
    UPDATED = "UPDATED"
    UNCHANGED = "UNCHANGED"


class ErrorCode(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


# --- types (CONTRACT section 2) -------------------------------------------------


class Attribute(Base, kw_only=True):
    key: AttrKey
    value: AttrValue


class CompatVersion(Base, kw_only=True):
    schema_version: SchemaVersion
    attributes: Annotated[tuple[Attribute, ...], Meta(min_length=1, max_length=32)]


class ActorOverhead(Base, kw_only=True):
    fixed_mib: NonNegative = 0
    per_gib_mib: NonNegative = 0


class WorkerRuntime(Base, kw_only=True):
    version: CompatVersion
    name: Name | None = None
    actor_overhead: ActorOverhead | None = None
    # v1.1: one-way compatibility edges: this runtime also restores snapshots stamped
    # with any of these versions (its own `version` stays the pin of what it restores).
    compatible_versions: Annotated[tuple[CompatVersion, ...], Meta(max_length=32)] = ()


class WorkerSandboxClass(Base, kw_only=True):
    sandbox_class: SandboxClass
    default_runtime: WorkerRuntime
    restorable_runtimes: Annotated[tuple[WorkerRuntime, ...], Meta(max_length=32)] = ()


class ActorRuntime(Base, kw_only=True):
    """The stamp: the runtime a snapshot was taken under, or an assignment's pin."""

    sandbox_class: SandboxClass
    version: CompatVersion
    name: Name | None = None


class Resources(Base, kw_only=True):
    cpu_millis: Positive
    memory_mib: Positive


class Room(Base, kw_only=True):
    """Free capacity: like Resources, but may be zero (or negative after a capacity cut)."""

    cpu_millis: int
    memory_mib: int


class Snapshot(Base, kw_only=True):
    snapshot_id: Id
    actor_id: Id
    template_uid: Id
    fidelity: Fidelity
    location: Location
    node: Id | None = None
    uri: Uri | None = None
    sandbox_runtime: ActorRuntime | None = None
    borrowed: bool = False
    taken_at: Time


class Fallback(Base, kw_only=True):
    reason: FallbackReason
    from_fidelity: PlacedFidelity
    to_fidelity: PlacedFidelity


# --- errors (CONTRACT section 1) ------------------------------------------------


class ErrorDetail(Base, kw_only=True):
    code: ErrorCode
    message: str
    field: str | None = None


class ErrorReply(Base, kw_only=True):
    error: ErrorDetail


# --- registry requests and replies ------------------------------------------------


class RegisterWorker(Base, kw_only=True):
    worker_id: Id
    node: Id
    capacity: Resources
    labels: Labels = field(default_factory=dict)
    sandbox_classes: Annotated[tuple[WorkerSandboxClass, ...], Meta(min_length=1, max_length=8)]
    request_id: RequestId | None = None
    # Project addition: a registration whose revision is lower than one the worker's history
    # holds (any life) is refused: a copy of an older one, decided late (docs/contract.md).
    revision: Annotated[Revision | None, Meta(description=(
        "optional (project addition): a number the sender never lowers for this worker, across its "
        "own restarts (warmboot's agent: its clock in ms); one below the highest the worker's history "
        "holds in any life, or equal to it with other content, is FAILED_PRECONDITION (field revision, "
        "the message naming the highest); more than a year ahead of the registry's clock in ms is "
        "INVALID_ARGUMENT. Resend an unchanged registration with the revision it had: a higher one "
        "writes an event (docs/worker-agents.md)"))] = None
    # Project addition: which disk of `node` the worker runs on (rule 5's LOCAL images are on it).
    node_token: Annotated[Id | None, Meta(description=(
        "optional (project addition): a token kept on the node's own disk, the same for every worker of "
        "the node (warmboot's agent: --node-token-file). A LOCAL image restores only on workers that "
        "registered the token of the disk it was written to; a worker registering another token than "
        "its life's begins a new life (its actors released), and one registering none after it gave one "
        "(any life) is FAILED_PRECONDITION, field node_token. The first token a node registers is taken "
        "as its disk before tokens (docs/contract.md, rule 5)"))] = None


class RegisterReply(Base, kw_only=True):
    outcome: RegisterOutcome
    seq: Seq


class Heartbeat(Base, kw_only=True):
    request_id: Annotated[RequestId | None, Meta(description="accepted and ignored: a heartbeat writes nothing")] = None
    # Project addition: the revision of the registration this beat keeps alive (its agent's in force);
    # refused when the worker's registration in force carries another (docs/contract.md, Additions).
    revision: Annotated[Revision | None, Meta(description=(
        "optional (project addition): the revision of the registration the sender has in force; "
        "FAILED_PRECONDITION (field revision, nothing put) when the worker's registration in force "
        "carries another: register again (docs/worker-agents.md)"))] = None


class Drained(Base, kw_only=True):
    """The drain in force on a worker (project addition): its `WorkerDrained` event."""

    seq: Annotated[StreamSeq, Meta(description="the stream sequence of the worker's WorkerDrained event")]
    reason: Reason | None = None


class HeartbeatReply(Base, kw_only=True):
    ttl_s: Annotated[float, Meta(description=(
        "seconds from this beat until the worker is removed as LOST; written with a fraction (15.0), "
        "so decode it as a float. warmboot's agent beats every ttl_s / 3"))]
    # Project addition: whether the registration in force is drained (`warmboot worker drain`, with the worker's
    # own credential where the deployment's users are `nats-config`'s; or its agent's at exit), read
    # from the registry's fold of the workers' events, as the beat's answer is (docs/contract.md, Additions).
    drained: Annotated[Drained | None, Meta(description=(
        "optional (project addition): the worker's drain in force in its current life (its WorkerDrained "
        "event's seq and reason): it takes no new placements; null when it is not drained. Absent from a "
        "registry of an earlier version: not known. warmboot's agent says each drain once"))] = None


class DrainWorker(Base, kw_only=True):
    reason: Reason | None = None
    request_id: RequestId | None = None
    # Project addition: the registration the drain is for (its agent's, at its exit), so that a drain sent
    # after another agent of the worker id registered it does not drain that one (docs/contract.md).
    revision: Annotated[Revision | None, Meta(description=(
        "optional (project addition): the revision of the registration the drain is for; if the registration "
        "in force is another, FAILED_PRECONDITION, field revision, and nothing is written"))] = None


class RemoveWorker(Base, kw_only=True):
    reason: Reason | None = None
    request_id: RequestId | None = None
    # Project addition: the worker's own agent orders its removal after everything it sent, so that
    # no copy of a registration it sent, decided late, begins a life again (docs/contract.md).
    revision: Annotated[Revision | None, Meta(description=(
        "optional (project addition): above every revision the worker's history holds (else "
        "FAILED_PRECONDITION, field revision); every registration at or below it is refused afterwards"))] = None


class SeqReply(Base, kw_only=True):
    seq: Seq
    # Project addition: true when the request found the state already as it asks (a drain of a
    # drained worker, an update-template to the actor's template) and wrote nothing; `seq` is then
    # the event its answer stands on. A retry gets the first attempt's answer, flag included.
    unchanged: bool = False


# --- snapshotter requests and replies ---------------------------------------------


class CreateActor(Base, kw_only=True):
    actor_id: Id
    sandbox_class: SandboxClass
    template_uid: Id
    resources: Resources
    selectors: Labels = field(default_factory=dict)
    min_fidelity: Fidelity = Fidelity.ROOTFS
    source_tag: Id | None = None
    golden_snapshot: Snapshot | None = None
    request_id: RequestId | None = None


class UnderPlacement(Base, kw_only=True):
    """A request of the snapshotter's that records an image its actor's worker took (pause, suspend).
    Project addition (docs/contract.md): the placement it was taken under, as the Assignment of the
    resume that made it names it. `placement_seq`, that Assignment's `seq`: refused (FAILED_PRECONDITION,
    field `placement_seq`) unless that placement is the actor's current one (for a PAUSED actor, the one
    its pause ended). `placement_worker_id`, `placement_node` and `placement_runtime`, its `worker_id`,
    `node` and `sandbox_runtime` (given only with `placement_seq`): refused (on the field) unless the
    placement at that sequence is on that worker, on that node, under that pin (compared by stamp: class
    and version): a log rolled back past a placement and written again holds another placement at its
    sequence, whose pin and node are not the image's (a worker id may register on another node)."""

    placement_seq: StreamSeq | None = None
    placement_worker_id: Id | None = None
    placement_node: Id | None = None
    placement_runtime: ActorRuntime | None = None


class PauseActor(UnderPlacement, kw_only=True):
    snapshot_id: Id | None = None
    request_id: RequestId | None = None


class SuspendActor(UnderPlacement, kw_only=True):
    snapshot_id: Id | None = None
    uri: Uri | None = None
    fidelity: Fidelity
    request_id: RequestId | None = None


class InLife(Base, kw_only=True):
    """A request of the snapshotter's that acts on the actor's current life (stop, tag, revert,
    update-template). Project addition: `life_seq`, a stream sequence of the actor's life the request
    is for (what its create answered, or `snapshotter.status`'s `life_seq`): refused
    (FAILED_PRECONDITION, field `life_seq`) if the actor was created anew after it."""

    life_seq: StreamSeq | None = None


class TagSnapshot(InLife, kw_only=True):
    tag: Id
    request_id: RequestId | None = None


class UpdateTemplate(InLife, kw_only=True):
    template_uid: Id
    request_id: RequestId | None = None


class StopActor(InLife, kw_only=True):
    request_id: RequestId | None = None


class RevertActor(InLife, kw_only=True):
    """v1.1: give up the actor's LOCAL image and go back to its latest EXTERNAL snapshot (or none)."""

    reason: Reason | None = None
    request_id: RequestId | None = None


class TaggedBefore(Base, kw_only=True):
    """What a tag named before the request that answered it: `snapshot` null for a new tag."""

    snapshot: Snapshot | None


class SnapshotReply(Base, kw_only=True):
    snapshot: Snapshot
    seq: Seq
    # Project addition, as on SeqReply: true when a tag found the tag naming the actor's latest snapshot
    # already and wrote nothing; `seq` is then the TagRecorded that named it. A retry gets the first answer.
    unchanged: bool = False
    # Project addition: of a tag's reply, what the tag named before it (`TaggedBefore`), so that a caller
    # whose credentials may not read the log is told the tag moved. Null when not said: not a tag, a
    # snapshotter before 2026-12-07, or a repeat answered from the log whose tag history, as read, lacks
    # its record (docs/contract.md).
    tagged_before: TaggedBefore | None = None


class RevertReply(Base, kw_only=True):
    """The EXTERNAL snapshot the actor went back to, or null when it will cold-boot."""

    snapshot: Snapshot | None
    seq: Seq


class ActorStatusQuery(Base, kw_only=True):
    """Project addition (`snapshotter.status.<actor_id>`): the actor as the log has it now. No fields."""


class ActorStatus(Base, kw_only=True):
    """Project addition: the actor as the stream leader's log has it, and what a later request of the
    caller's names so that a copy of it decided after the actor moved is refused, not carried out."""

    state: ActorState
    # the ActorCreated that began its current life (its last, for a STOPPED actor): what a resume,
    # stop, tag, revert or update-template names as `life_seq`
    life_seq: StreamSeq
    # the current life's last ActorPlaced (RUNNING; PAUSED: the placement its pause ended), what a
    # pause or suspend names as `placement_seq`; null if the life has not been placed
    placement_seq: StreamSeq | None = None
    seq: StreamSeq  # the actor's last event (a `min_seq` for a read that must see it)
    # (2026-12-07) its latest snapshot: for a CREATED actor, the one it starts from (its golden snapshot, or
    # its tag's as copied), which a client's credentials cannot read from the log; null if it has none, or
    # from a snapshotter of an earlier version, which leaves the field out
    snapshot: Snapshot | None = None


# --- scheduler requests and replies -----------------------------------------------


class ResumeActor(Base, kw_only=True):
    selectors: Labels | None = None
    min_seq: Seq | None = None
    request_id: RequestId | None = None
    # project addition: a stream sequence of the actor's life this resume is for (its create's
    # reply `seq`, say): refused (FAILED_PRECONDITION) if the actor was created anew after it
    life_seq: StreamSeq | None = None


class ExplainResume(Base, kw_only=True):
    selectors: Labels | None = None
    min_seq: Seq | None = None


class FragmentationQuery(Base, kw_only=True):
    sandbox_class: SandboxClass | None = None
    min_seq: Seq | None = None  # project addition: answered from state that includes it


class RuntimesQuery(Base, kw_only=True):
    """Project addition `<prefix>.scheduler.runtimes`: the runtimes the registered workers offer, as
    the scheduler's fold has them (what the CLI labels runtimes with, instead of folding every
    worker's history itself: docs/contract.md, Additions)."""

    min_seq: Seq | None = None  # answered from state that includes it


class FleetRuntime(Base, kw_only=True):
    sandbox_class: str
    version: CompatVersion
    # the names the registered workers give it (none when only an edge names it)
    names: list[str]
    # whether a registered worker (drained included) runs it, as a default or restorable runtime;
    # false: a runtime of the fleet only accepts it (a compatible version)
    run: bool


class FleetRuntimes(Base, kw_only=True):
    runtimes: list[FleetRuntime]


class WorkerQuery(Base, kw_only=True):
    """Project addition `<prefix>.scheduler.worker.<worker_id>`: one worker as the scheduler's fold has
    it (what `warmboot worker show` prints, instead of folding the whole log itself: docs/contract.md,
    Additions)."""

    min_seq: Seq | None = None  # answered from state that includes it


class BookedActor(Base, kw_only=True):
    """An actor whose booking is on the worker (`Projection.booked_on`)."""

    actor_id: str
    sandbox_class: str
    state: ActorState
    booked: Resources  # what it books on the worker
    pin: ActorRuntime  # the runtime it runs under there


class LocalImage(Base, kw_only=True):
    """A waiting actor whose latest snapshot is LOCAL on the worker's node, of a class the worker runs:
    it resumes only on that node (CONTRACT rule 5)."""

    actor_id: str
    state: ActorState
    snapshot_id: str | None = None
    fidelity: Fidelity
    stamp: ActorRuntime | None = None  # the runtime the snapshot was taken under (none: unstamped)


class WorkerDetail(Base, kw_only=True):
    worker_id: str
    node: str
    state: WorkerState
    labels: dict[str, str]
    capacity: Resources
    free: Room  # its capacity less what is booked on it (and the worker's reserve of memory)
    # its classes as the fold has them: each runtime with its name, its overhead and the versions its
    # edges accept (`compatible_versions`), in the worker's order
    classes: list[WorkerSandboxClass]
    actors: list[BookedActor]  # by actor id
    local_images: list[LocalImage]  # by actor id; those on its node's disk it registered (rule 5)
    node_token: str | None = None  # project addition: the token of its node's disk it registered


class Placement(Base, kw_only=True):
    """An Assignment without its `seq`: what the decision returns and explain shows."""

    actor_id: Id
    worker_id: Id
    node: Id
    action: Action
    fidelity: PlacedFidelity
    sandbox_runtime: ActorRuntime
    snapshot_id: Id | None = None
    fallback: Fallback | None = None
    booked: Resources
    # v1.1: on a MEMORY restore, the version that matched the stamp: the pin's own version,
    # or the compatible version (edge) through which the pin's runtime accepts it; else null.
    matched_version: CompatVersion | None = None
    # project addition: on a restore of a LOCAL image (rule 5), the node token of the disk the image is
    # on, as its worker registered it; a worker on another disk refuses the placement (`agent
    # --check-placement`). Null otherwise, or where the worker registered no token.
    node_token: Id | None = None


class Assignment(Placement, kw_only=True):
    seq: Seq


class Rejection(Base, kw_only=True):
    worker_id: str
    reasons: list[str]
    # project addition: of a worker passed over for `selector mismatch`, the selector keys (the actor's
    # and the request's, sorted) its labels do not match, as the scheduler's fold has them; else empty
    missing_keys: list[str] = []


class Refusal(Base, kw_only=True):
    """How a resume would be refused now (its error code and message)."""

    code: ErrorCode
    message: str
    # Project addition: the error's `field`, as the resume's refusal would carry it; of a RESOURCE_EXHAUSTED,
    # set only where no room freed can help (docs/contract.md, "Placement")
    field: str | None = None


class Explanation(Base, kw_only=True):
    """`decision` is the placement a resume would get now; `refusal` what it would refuse with.

    Exactly one of the two is set. A refusal is part of a successful explanation, so it
    is never a top-level `error` (that key means the explain request itself failed).
    `message` is the one-line summary an operator reads, e.g.
    "0/12 workers available: 7 runtime mismatch, 3 insufficient memory, 2 drained".
    """

    decision: Placement | None = None
    refusal: Refusal | None = None
    candidates: int
    rejected: list[Rejection]
    counts: dict[str, int]
    message: str = ""


class RuntimeFragmentation(Base, kw_only=True):
    version: CompatVersion
    workers_default: int
    workers_restorable: int
    free: Room
    snapshots_memory: int
    # v1.1: live workers that accept this version only through a compatibility edge
    workers_compatible: int = 0


class ClassFragmentation(Base, kw_only=True):
    sandbox_class: str
    workers: int
    runtimes: list[RuntimeFragmentation]
    stranded_snapshots: int
    # v1.1: waiting actors whose LOCAL latest snapshot is on a node with no registered
    # worker of the class (given up only by `revert`)
    lost_local_snapshots: int = 0
    # project addition: the most CPU and the most memory a registered worker of the class has
    # (drained ones included; each may be another worker's), as the scheduler's "big enough" refusal
    # reads them (`ClassIndex.largest`); None without a worker, and from a scheduler of an earlier version
    largest: Room | None = None


class Fragmentation(Base, kw_only=True):
    classes: list[ClassFragmentation]


WHATIF_LIMIT_MAX = 10_000  # newly stranded actors a forecast lists at most


class WhatIf(Base, kw_only=True):
    """v1.1 `scheduler.whatif`: the fleet as if these runtimes were dropped and these workers drained."""

    sandbox_class: SandboxClass
    drop_runtimes: Annotated[tuple[CompatVersion, ...], Meta(max_length=64)] = ()
    drain_workers: Annotated[tuple[Id, ...], Meta(max_length=10_000)] = ()
    limit: Annotated[int, Meta(ge=0, le=WHATIF_LIMIT_MAX)] = 100
    min_seq: Seq | None = None


class SnapshotCounts(Base, kw_only=True):
    stranded_snapshots: int
    memory_restorable_snapshots: int


class StrandedActor(Base, kw_only=True):
    actor_id: str
    stamp: ActorRuntime
    # project addition: where the image is, which says why it is stranded (a LOCAL image restores
    # only on its node); None from a scheduler that does not say
    location: Location | None = None
    node: str | None = None  # a LOCAL image's node


class RuntimeForecast(Base, kw_only=True):
    version: CompatVersion
    workers_before: int
    workers_after: int
    free_before: Room
    free_after: Room


class WhatIfAnswer(Base, kw_only=True):
    before: SnapshotCounts
    after: SnapshotCounts
    newly_stranded: list[StrandedActor]
    runtimes: list[RuntimeForecast]
    # Project addition: the CREATED actors whose first resume restores a memory image (a golden or tagged
    # MEMORY snapshot of their template) that the query strands. CONTRACT counts only the PAUSED and
    # SUSPENDED actors' images, so these are in no count above; absent from a scheduler of an earlier version.
    created_newly_stranded: Annotated[list[StrandedActor], Meta(description=(
        "optional (project addition): CREATED actors whose first resume restores a MEMORY image (their golden "
        "or tagged snapshot) that the query strands, up to `limit`; in no count of `before` or `after`, which "
        "count PAUSED and SUSPENDED actors only. Each such resume falls back to a lower fidelity, or is refused "
        "under min_fidelity MEMORY. Absent from a scheduler of an earlier version"))] = []


# --- project addition `<prefix>.scheduler.actors` (docs/contract.md, Additions) ----------------
#
# The actors of the scheduler's fold, a page at a time, as `warmboot actor list` shows them.
# A page must fit NATS's max_payload (1 MiB = 1,048,576 bytes), and a count alone cannot bound a
# row's size usefully: an actor's selectors (64 labels: a 253-character key, a 256-character value,
# up to 4 bytes a character in UTF-8) take up to 82 KB, a runtime (32 attributes of 128 + 256
# characters, and its name) up to 39 KB, and a row carries two runtimes (stamp, pin): a row is at
# most 161 KB (`tests/test_actor_list.py` builds the largest), about 650 bytes typically. So a page
# stops at ACTORS_PAGE_BYTES of rows (each row's encoding, and the stamp names it brings,
# `ActorPage.stamp_names`: at most 2 x 39 KB more), or at `limit` rows, whichever comes first, and
# always holds one row if one is left (the largest, 239 KB with its names, fits). The rest of a page
# is bounded by the query: `unknown_workers` at most ACTORS_FILTER_MAX ids of 128 characters,
# `unknown_classes` ACTORS_FILTER_MAX classes, `classes` ACTORS_CLASSES_MAX classes of 63, and
# `next_after`: 118 KB at most. 768 KiB (786,432) + 118 KB + a comma a row = 905 KB < 1 MiB, with
# 143 KB to spare for the headers. ACTORS_LIMIT_MAX typical rows (~650 KB) fit within the bytes.
ACTORS_LIMIT_DEFAULT = 500  # rows a page holds at most, unless the query says
ACTORS_LIMIT_MAX = 1_000
ACTORS_PAGE_BYTES = 768 * 1024  # of rows (and their stamp names): a page stops before a row past it
ACTORS_FILTER_MAX = 256  # values of one filter (sandbox_classes, worker_ids)
ACTORS_CLASSES_MAX = 1_024  # of the fold's actors' classes a page names (`ActorPage.classes`)


class ActorsQuery(Base, kw_only=True):
    """Project addition `<prefix>.scheduler.actors`: the actors of the fold (stopped ones included),
    by id, those after `after`, a page of at most `limit`. A filter given more than one value takes
    any of them; different filters all apply (an empty one: no filter)."""

    sandbox_classes: Annotated[tuple[SandboxClass, ...], Meta(max_length=ACTORS_FILTER_MAX)] = ()
    states: Annotated[tuple[ActorState, ...], Meta(max_length=len(ActorState))] = ()
    worker_ids: Annotated[tuple[Id, ...], Meta(max_length=ACTORS_FILTER_MAX)] = ()  # placed on (RUNNING)
    after: Id | None = None  # the cursor: a page's `next_after`; none: from the first id
    limit: Annotated[int, Meta(ge=1, le=ACTORS_LIMIT_MAX)] = ACTORS_LIMIT_DEFAULT
    min_seq: Seq | None = None  # answered from state that includes it


class ActorSnapshotSummary(Base, kw_only=True):
    """An actor's latest snapshot, as `actor list` shows it."""

    snapshot_id: str
    template_uid: str
    fidelity: Fidelity
    location: Location
    node: str | None  # a LOCAL image's node
    borrowed: bool
    stamp: ActorRuntime | None  # the runtime it was taken under; null: unstamped
    # project addition: a waiting actor's LOCAL image on a disk of its node that no registered worker of
    # its class is on (its node has none, or registered from another disk since): given up only by revert
    lost: bool = False


class ActorSummary(Base, kw_only=True):
    """One actor of the fold: a row of `actor list` (its `-o json` entry, without the labels a
    client gives the runtimes: `stamp` and `pin` are as the wire names runtimes)."""

    actor_id: str
    state: ActorState
    sandbox_class: str
    template_uid: str
    resources: Resources
    selectors: dict[str, str]
    min_fidelity: Fidelity
    snapshot: ActorSnapshotSummary | None  # its latest; null before the first
    worker_id: str | None  # the worker it is placed on (RUNNING)
    node: str | None  # its placement's node (RUNNING; PAUSED: the node its image is on)
    pin: ActorRuntime | None  # the runtime it runs under (RUNNING)
    booked: Resources | None  # what its placement books on its worker
    last_seq: Seq  # the stream sequence of its history's last event


class ActorPage(Base, kw_only=True):
    """A page of `scheduler.actors`. Pages are not one snapshot: each is the fold as it is when it is
    asked (at least `min_seq`); an actor created between two pages is on a later one if its id sorts
    after the cursor, else on none."""

    actors: list[ActorSummary]
    # the id to ask `after` for the next page; null: no actor matches past this page
    next_after: str | None
    # On the first page (no `after`) alone, what a caller says of its filters: the classes asked that
    # no actor of the fold has, and then the classes its actors have (the first ACTORS_CLASSES_MAX, in
    # order); the worker ids asked that are not registered
    unknown_classes: list[str]
    classes: list[str]
    unknown_workers: list[str]
    # For each runtime a row of this page names without a name (a stamp or a pin of a worker's unnamed
    # runtime), the least name the fold's stamps and pins give it elsewhere, if any: how the views label
    # a runtime no worker names (`Runtimes.stamp`)
    stamp_names: list[ActorRuntime]


# --- project addition `<prefix>.scheduler.workers` (docs/contract.md, Additions) ---------------
#
# The registered workers of the scheduler's fold (drained ones included), a page at a time, as
# `warmboot workers` shows them. A page must fit NATS's max_payload (1 MiB = 1,048,576 bytes). A row
# is a worker's registration as the fold keeps it (its labels, up to 82 KB as an actor's selectors;
# its classes, `WorkerSandboxClass` as `WorkerDetail` carries them) and a few numbers: about 670 bytes
# typically (the demo's: one class, its runtimes of a few attributes, no labels). Its classes are bounded
# by the registration they came in, itself a request NATS carried (at most 1 MiB), not usefully by
# the schema (8 classes x 33 runtimes x 33 versions of 32 attributes), so a row is at most about that
# registration's size plus 1 KB (state, free room and the counts of at most 8 classes): a page of one
# such row may be refused by NATS (the same bound as `WorkerDetail`). A page stops at
# WORKERS_PAGE_BYTES of rows, or at `limit` rows, whichever comes first, and always holds one row if
# one is left. The rest of a page: `unknown_classes` at most ACTORS_FILTER_MAX classes of 63
# characters, `classes` WORKERS_CLASSES_MAX of 63 and `next_after` 128: 85 KB at most. 768 KiB
# (786,432) + 85 KB + a comma a row = 872 KB < 1 MiB, with 176 KB to spare for the headers.
# WORKERS_LIMIT_MAX rows of 670 bytes fit within the bytes (the demo's 10,000 workers, some rows larger: 11 pages).
WORKERS_LIMIT_DEFAULT = 500  # rows a page holds at most, unless the query says
WORKERS_LIMIT_MAX = 1_000
WORKERS_PAGE_BYTES = 768 * 1024  # of rows: a page stops before a row past it
WORKERS_CLASSES_MAX = 1_024  # of the classes registered workers run a first page names (`WorkerPage.classes`)


class WorkersQuery(Base, kw_only=True):
    """Project addition `<prefix>.scheduler.workers`: the registered workers of the fold (drained ones
    included), by id, those after `after`, a page of at most `limit`. `sandbox_classes`: only the workers
    that run one of them, each with those of its classes alone (an empty one: every worker, every class)."""

    sandbox_classes: Annotated[tuple[SandboxClass, ...], Meta(max_length=ACTORS_FILTER_MAX)] = ()
    after: Id | None = None  # the cursor: a page's `next_after`; none: from the first id
    limit: Annotated[int, Meta(ge=1, le=WORKERS_LIMIT_MAX)] = WORKERS_LIMIT_DEFAULT
    min_seq: Seq | None = None  # answered from state that includes it


class WorkerSummary(Base, kw_only=True):
    """One registered worker of the fold: what its rows of `warmboot workers` need (one row per class),
    runtimes by version and name as the wire names them, without the labels a client gives them."""

    worker_id: str
    node: str
    state: WorkerState
    labels: dict[str, str]
    capacity: Resources
    free: Room  # its capacity less what is booked on it (and the worker's reserve of memory)
    classes: list[WorkerSandboxClass]  # in the worker's order (filtered: the classes asked alone)
    class_actors: dict[str, int]  # per class of `classes`: the actors of that class booked on it
    actors: int  # the actors booked on it, of every class
    node_token: str | None = None  # project addition: the token of its node's disk it registered


class WorkerPage(Base, kw_only=True):
    """A page of `scheduler.workers`. Pages are not one snapshot: each is the fold as it is when it is
    asked (at least `min_seq`); a worker registered between two pages is on a later one if its id sorts
    after the cursor, else on none."""

    workers: list[WorkerSummary]
    # the id to ask `after` for the next page; null: no worker matches past this page
    next_after: str | None
    # On the first page (no `after`) alone: the classes asked that no registered worker runs (as
    # `whatif`'s check_class finds), and the classes registered workers run, sorted (the first
    # WORKERS_CLASSES_MAX): what a caller's error for an unknown class names
    unknown_classes: list[str]
    classes: list[str]


# --- events (CONTRACT section 4) ---------------------------------------------------


class Event(Base, kw_only=True, tag_field="type", tag=True):
    """Base of every event: `type` is the class name; `at` the time it was decided."""

    at: Time
    # The request that caused the event (project addition): a retried request with
    # the same id is answered from the event that already recorded it.
    request_id: RequestId | None = None
    # The aggregate kind whose history holds the event; each kind defines `entity_id`,
    # so that the event's subject is `<prefix>.ev.<KIND>.<entity_id>`.
    KIND: ClassVar[str] = ""


class WorkerEvent(Event, kw_only=True):
    worker_id: Id
    KIND: ClassVar[str] = "worker"

    @property
    def entity_id(self) -> str:
        return self.worker_id


class ActorEvent(Event, kw_only=True):
    actor_id: Id
    KIND: ClassVar[str] = "actor"

    @property
    def entity_id(self) -> str:
        return self.actor_id


class WorkerRegistered(WorkerEvent, kw_only=True):
    node: Id
    capacity: Resources
    labels: Labels
    sandbox_classes: tuple[WorkerSandboxClass, ...]
    revision: Revision | None = None  # the registration's (project addition)
    node_token: Id | None = None  # the disk of its node it registered from (project addition)


class RuntimeChanged(WorkerEvent, kw_only=True):
    sandbox_classes: tuple[WorkerSandboxClass, ...]
    previous: tuple[WorkerSandboxClass, ...]
    revision: Revision | None = None


class WorkerUpdated(WorkerEvent, kw_only=True):
    node: Id
    capacity: Resources
    labels: Labels
    revision: Revision | None = None
    node_token: Id | None = None  # the disk of its node it registers from now (project addition)


class WorkerDrained(WorkerEvent, kw_only=True):
    reason: Reason | None = None


class WorkerRemoved(WorkerEvent, kw_only=True):
    reason: Reason | None = None
    revision: Revision | None = None  # its agent's, when it removed the worker (project addition)


class ActorCreated(ActorEvent, kw_only=True):
    sandbox_class: SandboxClass
    template_uid: Id
    resources: Resources
    selectors: Labels
    min_fidelity: Fidelity
    snapshot: Snapshot | None = None


class SnapshotTaken(ActorEvent, kw_only=True):
    snapshot: Snapshot
    origin: SnapshotOrigin


class TemplateChanged(ActorEvent, kw_only=True):
    template_uid: Id


class ActorPlaced(ActorEvent, kw_only=True):
    worker_id: Id
    node: Id
    action: Action
    fidelity: PlacedFidelity
    sandbox_runtime: ActorRuntime
    snapshot_id: Id | None = None
    fallback: Fallback | None = None
    booked: Resources
    matched_version: CompatVersion | None = None  # v1.1: as on the Assignment
    node_token: Id | None = None  # as on the Assignment (project addition)


class ActorReleased(ActorEvent, kw_only=True):
    worker_id: Id
    reason: ReleaseReason


class ActorStopped(ActorEvent, kw_only=True):
    pass


class ActorReverted(ActorEvent, kw_only=True):
    """v1.1: the actor gave up its LOCAL image `abandoned` and went back to `snapshot`
    (its latest EXTERNAL one), or to none (it cold-boots); it is SUSPENDED."""

    snapshot: Snapshot | None = None
    abandoned: Snapshot
    reason: Reason | None = None


class WorkerBooked(Event, kw_only=True):
    """Project addition: the booking marker a placement writes beside `ActorPlaced`.

    It lives on `<prefix>.ev.booking.<worker_id>`, so that two scheduler replicas
    booking the same worker at once conflict on that subject's last sequence
    (CONTRACT placement rule 8) instead of both succeeding.
    """

    worker_id: Id
    actor_id: Id
    KIND: ClassVar[str] = "booking"

    @property
    def entity_id(self) -> str:
        return self.worker_id


class WorkerFenced(Event, kw_only=True):
    """Project addition: written by the registry on `<prefix>.ev.booking.<worker_id>` in the
    same atomic append as every event of the worker's own history (`event` names it).

    A placement is committed only if the worker's booking subject has not moved since
    the state its decision read (CONTRACT placement rule 8), so a drain, removal,
    runtime change or capacity cut of the worker makes every placement decided
    before it lose and decide again on fresh state.
    """

    worker_id: Id
    event: str
    KIND: ClassVar[str] = "booking"

    @property
    def entity_id(self) -> str:
        return self.worker_id


class TagRecorded(Event, kw_only=True):
    """Project addition: a tag names a copy of a snapshot, on `<prefix>.ev.tag.<tag>`."""

    tag: Id
    snapshot: Snapshot
    KIND: ClassVar[str] = "tag"

    @property
    def entity_id(self) -> str:
        return self.tag


class ImageNamed(Event, kw_only=True):
    """Project addition: a snapshot id that no default id takes (`services.snapshotter.stamping.
    free_form_id`) names `snapshot`'s image, on `<prefix>.ev.image.<snapshot_id>`.

    A worker finds an image by its id (an Assignment names nothing else), so one id names one image
    across actors: the snapshotter writes this in the same atomic append as the SnapshotTaken or
    ActorCreated that first records an image under a caller's id, guarded by the subject's sequence,
    and refuses another actor's different image under it (docs/contract.md, "one snapshot_id names
    one image"). The same EXTERNAL image in several actors (a golden snapshot, a tag's copy) is one
    image. Folds that do not check snapshot requests skip it."""

    snapshot: Snapshot
    KIND: ClassVar[str] = "image"

    @property
    def entity_id(self) -> str:
        return self.snapshot.snapshot_id


AnyEvent = Union[
    WorkerRegistered,
    RuntimeChanged,
    WorkerUpdated,
    WorkerDrained,
    WorkerRemoved,
    ActorCreated,
    SnapshotTaken,
    TemplateChanged,
    ActorPlaced,
    ActorReleased,
    ActorStopped,
    ActorReverted,
    WorkerBooked,
    WorkerFenced,
    TagRecorded,
    ImageNamed,
]

EVENT_TYPES: dict[str, type[Event]] = {cls.__name__: cls for cls in AnyEvent.__args__}

REQUEST_TYPES: tuple[type[Base], ...] = (
    RegisterWorker,
    Heartbeat,
    DrainWorker,
    RemoveWorker,
    CreateActor,
    PauseActor,
    SuspendActor,
    TagSnapshot,
    UpdateTemplate,
    StopActor,
    RevertActor,
    ActorStatusQuery,
    ResumeActor,
    ExplainResume,
    FragmentationQuery,
    WhatIf,
    RuntimesQuery,
    WorkerQuery,
    ActorsQuery,
    WorkersQuery,
)

REPLY_TYPES: tuple[type[Base], ...] = (
    RegisterReply,
    HeartbeatReply,
    SeqReply,
    SnapshotReply,
    RevertReply,
    ActorStatus,
    Assignment,
    Explanation,
    Fragmentation,
    WhatIfAnswer,
    FleetRuntimes,
    WorkerDetail,
    ActorPage,
    WorkerPage,
    ErrorReply,
)
