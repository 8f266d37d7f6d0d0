"""Contract errors (CONTRACT section 1): one exception type, one reply shape."""

from __future__ import annotations

import re

from events.schema import ErrorCode, ErrorDetail, ErrorReply

# The numeric `Nats-Service-Error-Code` header that goes with each contract code.
HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.FAILED_PRECONDITION: 409,
    ErrorCode.ALREADY_EXISTS: 409,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.INTERNAL: 500,
}


class ContractError(Exception):
    """A request refused with a contract error code; nothing was written.

    `request_id`: the request id of the request `warmboot.client` raised it for (the caller's, or
    the one the client made up), so that a caller told UNAVAILABLE after the last retry, whose
    request may have been carried out, can send it again with that id for its answer."""

    request_id: str | None = None

    def __init__(self, code: ErrorCode, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field

    def __str__(self) -> str:
        """`CODE field: message`, as the CLI prints a refusal: a traceback or a log line of one says
        which code and field, not the message alone (`Expected `int` >= 1`: of what?)."""
        where = f" {self.field}" if self.field else ""
        return f"{self.code.value}{where}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self})"

    @property
    def status(self) -> int:
        return HTTP_STATUS[self.code]

    def detail(self) -> ErrorDetail:
        return ErrorDetail(code=self.code, message=self.message, field=self.field)

    def reply(self) -> ErrorReply:
        return ErrorReply(error=self.detail())

    @classmethod
    def from_detail(cls, detail: ErrorDetail) -> "ContractError":
        return cls(detail.code, detail.message, detail.field)


class UnreadableHistory(ContractError):
    """UNAVAILABLE: an entity's history holds an event this version cannot read (a type of another
    version, or a body it refuses; `events.aggregate.unreadable`, the scheduler's `decide.resolve`).
    A refusal of that entity only: work about other entities goes on (the registry's start-up
    reconciliation, the snapshotter's worker-removal process), and the scheduler checks it at the
    stream leader as a refusal on the actor's state."""

    def __repr__(self) -> str:
        where = f" at {self.field}" if self.field else ""
        return f"ContractError({self.code.value}{where}: {self.message})"

    __str__ = __repr__


class NoWorkerOnNode(ContractError):
    """FAILED_PRECONDITION: an actor's LOCAL image is on a node where no worker of its class is
    registered (the scheduler's `decide`). A reading of the fleet, and one whose message points at
    revert, which gives the image up for good: the scheduler answers it only on a fold caught up
    with the stream's end since the resume came."""


def invalid(message: str, field: str | None = None) -> ContractError:
    return ContractError(ErrorCode.INVALID_ARGUMENT, message, field)


def not_found(message: str, field: str | None = None) -> ContractError:
    return ContractError(ErrorCode.NOT_FOUND, message, field)


def no_actor(actor_id: str, field: str = "actor_id") -> ContractError:
    """NOT_FOUND for an actor that does not exist: one wording for every service and command."""
    return not_found(f"actor {actor_id!r} does not exist", field)


def no_worker(worker_id: str, field: str = "worker_id") -> ContractError:
    """NOT_FOUND for a worker in no life (never registered, or removed and not registered again):
    one wording for every service and command."""
    return not_found(f"worker {worker_id!r} is not registered", field)


def precondition(message: str, field: str | None = None) -> ContractError:
    return ContractError(ErrorCode.FAILED_PRECONDITION, message, field)


def from_an_earlier_life(kind: str, entity_id: str, verb: str, request_id: str) -> ContractError:
    """FAILED_PRECONDITION, field request_id: a `verb` whose id an earlier life of the entity used
    and which does not start a life (docs/contract.md, Idempotency): a copy delivered late."""
    return precondition(
        f"request_id {request_id!r} was used in an earlier life of {kind} {entity_id!r}: a {verb} made for that "
        "life (a copy delivered late?) is not applied to this one; send it with a new request_id", "request_id")


def created_anew_since(actor_id: str, life_seq: int, started: int, verb: str = "resume",
                       outcome: str = "nothing placed") -> ContractError:
    """FAILED_PRECONDITION, field life_seq: a request (`verb`: a resume, a stop, a tag, ...) naming a
    life of the actor that a creation at `started` ended (docs/contract.md, Idempotency): a copy
    delivered late, or a caller that has not seen the actor created anew. `life_started_in` reads
    `started` back."""
    return precondition(
        f"actor {actor_id!r} was created anew at sequence {started}, after the life this {verb} names (life_seq "
        f"{life_seq}): {outcome} (a copy of a request of its earlier life delivered late is not applied to this "
        f"one); send it again with life_seq {started}, or none, if this life is meant", "life_seq")


_CREATED_ANEW = re.compile(r"was created anew at sequence (\d+), after the life this \S+ names")


def life_started_in(error: ContractError) -> int | None:
    """The sequence of the creation a `created_anew_since` refusal names (the actor's current life),
    or None for any other error, or one whose message does not say it (another version's)."""
    if error.code is not ErrorCode.FAILED_PRECONDITION or error.field != "life_seq":
        return None
    found = _CREATED_ANEW.search(error.message)
    return int(found[1]) if found else None


# A registration older than one the worker's history holds (services.registry.domain): the
# refusal names the latest revision, which the sender reads back (`latest_revision`) to go on
# above it when its own clock runs behind the one that wrote it.
_REVISION_REFUSAL = "revision {given} is not above {latest}, the latest registered for worker {worker_id!r}"


def revision_refused(worker_id: str, given: int, latest: int) -> ContractError:
    """A registration whose revision is below the worker's latest, or equal to it with other content."""
    other = " (registered already, with other content)" if given == latest else ""
    return precondition(
        _REVISION_REFUSAL.format(given=given, latest=latest, worker_id=worker_id) + other
        + ": a copy of an older registration, decided late, is not applied over a newer one; a sender "
        "that means it sends it with a higher revision", "revision")


def latest_revision(error: ContractError) -> int | None:
    """The latest revision a `revision_refused` error names; None for any other error."""
    if (error.code, error.field) != (ErrorCode.FAILED_PRECONDITION, "revision"):
        return None
    head, sep, tail = error.message.partition(" is not above ")
    latest, sep2, _ = tail.partition(",")
    return int(latest) if sep and sep2 and latest.isdigit() and head.startswith("revision ") else None


# A heartbeat naming another registration than the worker's in force (services.registry.domain,
# `check_beats_in_force`): the refusal names the one in force, its revision and its node, which an agent
# reads back (`in_force_named`) to tell its own registration, lost with a log's tail or crossed by the beat
# (it registers again), from another agent's of its worker id on another node (it stops: docs/registry.md).
_NOT_IN_FORCE = "worker {worker_id}'s registration in force is revision {in_force}, not {beats}{where}"
_NOT_IN_FORCE_READ = re.compile(r"'s registration in force is revision (\d+), not \d+ \(registered on node ([^)\s]+)\)")


def beat_not_in_force(worker_id: str, beats: int, in_force: int, node: str | None) -> ContractError:
    """FAILED_PRECONDITION, field revision: a heartbeat naming the registration of revision `beats`, when
    the worker's registration in force is that of revision `in_force`, registered on `node`."""
    where = f" (registered on node {node})" if node else ""
    return precondition(
        _NOT_IN_FORCE.format(worker_id=worker_id, in_force=in_force, beats=beats, where=where)
        + ": another agent registered it since (two machines running as one worker id?), or this beat crossed "
        "its agent's own newer registration, or the log lost its agent's latest. The beat keeps nothing alive; "
        "register again, unless the registration in force is another agent's (a revision above every one this "
        "agent sent, on any node): then stop, and give each machine a worker id of its own", "revision")


def drain_not_in_force(worker_id: str, drains: int, in_force: int, node: str | None) -> ContractError:
    """FAILED_PRECONDITION, field revision: a drain naming the registration of revision `drains`, when the
    worker's registration in force is that of revision `in_force`, registered on `node` (as
    `beat_not_in_force` names it: `in_force_named` reads both)."""
    where = f" (registered on node {node})" if node else ""
    return precondition(
        _NOT_IN_FORCE.format(worker_id=worker_id, in_force=in_force, beats=drains, where=where)
        + ": it was registered again since the registration this drain is for (by another agent, or by the "
        "drain's own agent in a registration it has not heard answered); nothing was drained", "revision")


def in_force_named(error: ContractError) -> tuple[int, str] | None:
    """The revision and node of the registration in force a `beat_not_in_force` refusal names; None for any
    other error, or one that names no node (a registry of an earlier version)."""
    if (error.code, error.field) != (ErrorCode.FAILED_PRECONDITION, "revision"):
        return None
    found = _NOT_IN_FORCE_READ.search(error.message)
    return (int(found[1]), found[2]) if found else None


# An event a request would write that one message of the NATS server does not carry (its max_payload):
# refused before anything is written (services.registry.domain, `check_fits`), naming the request's field
# that makes it so large. The phrase is read back (`too_large_for_an_event`) by an agent, which then
# takes its worker out of placement rather than leave the registration it could not replace in force
# (docs/contract.md, "A registration too large for one event").
_TOO_LARGE = "bytes, past the {room} bytes an event may be"
_TOO_LARGE_READ = re.compile(r"bytes, past the \d+ bytes an event may be")


def event_too_large(what: str, size: int, room: int, max_payload: int, headroom: int, remedy: str,
                    field: str) -> ContractError:
    """INVALID_ARGUMENT naming `field`: the event `what` describes would be `size` bytes, more than the
    `room` an event has in one message of `max_payload` bytes (less `headroom` for its headers)."""
    return invalid(f"{what} would be {size} " + _TOO_LARGE.format(room=room)
                   + f" where the NATS server carries {max_payload} in one message (its max_payload, less "
                   f"{headroom} for the message's headers). Nothing was written: {remedy}", field)


def too_large_for_an_event(error: ContractError) -> bool:
    """Whether `error` is an `event_too_large` refusal."""
    return error.code is ErrorCode.INVALID_ARGUMENT and _TOO_LARGE_READ.search(error.message) is not None


# A request too large to be sent (past the server's max_payload: the client's refusal, nothing sent) or to be
# decoded (past MAX_BODY: a service's). With `event_too_large`, what `too_large` reads back: an agent whose
# registration is refused so takes its worker out of placement (docs/contract.md, "A registration too large").
_UNSENT_LARGE = "bytes, more than NATS takes in a message"
_BODY_LARGE = "bytes exceeds the limit of"


def request_too_large(subject: str, size: int, max_payload: int) -> ContractError:
    """INVALID_ARGUMENT: a request of `size` bytes to `subject` that the connection does not send."""
    return invalid(f"the request to {subject} is {size} {_UNSENT_LARGE} (its max_payload: {max_payload} bytes); "
                   "nothing was sent")


def body_too_large(size: int, limit: int) -> ContractError:
    """INVALID_ARGUMENT: a body of `size` bytes a service does not decode (past `limit`)."""
    return invalid(f"body of {size} {_BODY_LARGE} {limit}")


def too_large(error: ContractError) -> bool:
    """Whether `error` refuses a request for its size: its body past what NATS carries (`request_too_large`) or
    a service decodes (`body_too_large`), or an event it would write past one message (`event_too_large`)."""
    return error.code is ErrorCode.INVALID_ARGUMENT and (
        too_large_for_an_event(error) or _UNSENT_LARGE in error.message or _BODY_LARGE in error.message)


def already_exists(message: str, field: str | None = None) -> ContractError:
    return ContractError(ErrorCode.ALREADY_EXISTS, message, field)


def exhausted(message: str, field: str | None = None) -> ContractError:
    return ContractError(ErrorCode.RESOURCE_EXHAUSTED, message, field)


def unavailable(message: str, field: str | None = None) -> ContractError:
    return ContractError(ErrorCode.UNAVAILABLE, message, field)


# Fields a request names a stream sequence in that a scheduler replica waits to have folded: one past the
# end of the log is UNAVAILABLE naming it (`services.scheduler.fold.Fold.wait`), and no retry brings it.
WAITED_FOR = ("min_seq", "life_seq")


# What a scheduler replica answers a read-only request past those waiting their turn
# (`services.scheduler.service.READS_WAITING`): UNAVAILABLE, the same request answered a moment later.
_BUSY_READS = "read-only answers already wait their turn on this scheduler replica; try again"


def busy_reads(waiting: int) -> ContractError:
    return unavailable(f"{waiting} {_BUSY_READS}")


def is_busy_reads(error: ContractError) -> bool:
    """Whether `error` is a scheduler replica's `busy_reads`: it answered, and would a moment later."""
    return error.code is ErrorCode.UNAVAILABLE and error.message.endswith(_BUSY_READS)


def past_the_end(error: ContractError) -> bool:
    """Whether `error` says a sequence the request named is past the end of the log (UNAVAILABLE naming
    `min_seq` or `life_seq`): not transient, and nothing was carried out."""
    return error.code is ErrorCode.UNAVAILABLE and error.field in WAITED_FOR
