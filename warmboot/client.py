"""A typed async client of warmboot's public subjects (CONTRACT section 3).

One method per endpoint, taking and returning the schema's Structs (`events.schema`)::

    async with Client.connect("nats://127.0.0.1:4222") as wb:
        await wb.create(CreateActor(actor_id="a-1", sandbox_class="gvisor", template_uid="t1",
                                    resources=Resources(cpu_millis=500, memory_mib=1024)))
        placed = await wb.resume("a-1")          # sees the create: read-your-writes
        snap = await wb.pause("a-1")
        print(placed.worker_id, snap.snapshot.location)

What it does so that callers need not:

- Read-your-writes: the client remembers the highest `seq` any reply gave it and
  sends it as `min_seq` on resume, explain, fragmentation and whatif, so a scheduler
  replica that has not folded this client's own writes yet waits for them (or answers
  UNAVAILABLE, which is retried) instead of answering from older state.
- Idempotency: every mutating request carries a `request_id`; one is generated when
  the caller gives none, so a retry is the same request.
- Fencing: `pause` and `suspend` name the placement their image was taken under
  (`placement_seq`): the caller's, else the `seq` of this client's last `resume` of the
  actor (with that Assignment's worker, node and pin, `placement_worker_id`, `placement_node`
  and `placement_runtime`, also when the caller gives that seq, or of an Assignment it gives,
  `placed`: a log rolled back past it may hold another placement there since), else the
  placement the snapshotter says the actor has (`status`, one more request; none from a
  snapshotter of an earlier version, which has no `status`, and `on_unfenced` is told; with
  `fence_snapshots=False`, only the caller's). A copy decided after the actor was placed
  anew is refused, not recorded with the new placement's pin. `resume` names the actor's life
  (`life_seq`): the caller's, else the `seq` of this client's last create or resume of the actor
  (with `fence_resumes=False`, only the caller's). A copy decided after the actor was created
  anew is refused, not placed in a life nobody resumed. A caller still waiting is no late copy:
  when its client had not seen another caller's creation, the client sends the resume again,
  once, naming the life the refusal says began. `stop`, `tag`, `revert` and `update_template`
  name the life the same way (with `fence_lives=False`, only the caller's): a copy decided
  after the actor was created anew is refused, not carried out on a life nobody asked it of;
  a refusal reaching a caller still waiting is sent again once, as for a resume, unless this
  client had seen the new life begin: then it is raised.
- Warnings: a `create` the contract takes but no resume can ever place (`min_fidelity` MEMORY
  with no stamped MEMORY image of its template to start from: `below_memory`) is told to
  `on_never_resumable(actor_id, why)`, else logged as a warning, as `actor create` warns of it
  (from a `source_tag`, the snapshot it starts from is asked of `status`, one more request).
- Retries: UNAVAILABLE, a time-out and "no responders" are retried with the same body
  (the same `request_id`), at most `attempts` times, each attempt waiting `timeout` seconds
  (the constructor's; `with wb.limits(timeout=, attempts=):` for the calls made in a block, on
  the same client), with a growing, jittered pause (a request
  no service answered any time is UNAVAILABLE "no service answers SUBJECT after N attempts in
  T s: is 'PREFIX' the deployment's prefix, and is its SERVICE running?", or "at the last of N
  attempts (K reached no service) in T s: the SERVICE was reached before; it may be stopping or
  restarting" when others timed out or were UNAVAILABLE; one whose attempts all went unanswered
  in time, "no reply from SUBJECT within Ts, at each of N attempts (S s in all)"); so is
  the registry's RESOURCE_EXHAUSTED that names no field (its replica was working on a few
  requests about the same worker already and took nothing: `_transient`). Everything else
  is raised at once, and so is UNAVAILABLE naming `min_seq` or a resume's `life_seq` (a sequence
  past the end of the log: no retry brings it), and the registry's budget refusal (naming `worker_id`:
  its wait is seconds, told in its message).
- Errors: every contract error is raised as `events.errors.ContractError`, with its
  `code`, `message` and `field`, and the `request_id` of the request (the caller's or the one
  made up: an UNAVAILABLE after the last retry may have been carried out, and that id sent
  again gets its answer); its text is `CODE field: message`, as the CLI prints it. A request
  the server refused to carry for these credentials (a permissions violation, heard on a
  connection made by `connect` or the CLI) is FAILED_PRECONDITION naming the subject, as soon
  as the server says so (`events.natspy.connections.unless_refused`: not after the attempt's time-out), not
  retried. A request on a closed connection is FAILED_PRECONDITION (UNAVAILABLE when an earlier
  attempt of it was sent before the close: it may have been carried out), one larger than the server's
  max_payload INVALID_ARGUMENT, and one the connection cannot hold while it reconnects (its
  buffer full) UNAVAILABLE: nothing was sent; no nats-py exception comes out of a request. A
  reply that cannot be read as the endpoint's is INTERNAL naming the subject, not retried. (Not
  for the agent's client, `refusals_final=False`, whose own loop takes nats-py's errors.)

The client does not own a connection it is given; `Client.connect` makes one it owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import math
import random
import uuid
from typing import Any, Callable, Iterator, TypeVar

import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NATS

from events.codec import decode_reply, encode
from events.errors import ContractError, invalid, life_started_in, past_the_end, request_too_large, unavailable
from events.natsauth import check_url, redact_url
from events.natspy.connections import ErrorsOnce, PublishRefused, close_within, transport_lost, unless_refused
from events.natspy.headers import header_block
from events.schema import (
    ID_RE,
    ID_WORDS,
    ActorPage,
    ActorStatus,
    ActorStatusQuery,
    ActorsQuery,
    Assignment,
    Base,
    CreateActor,
    DrainWorker,
    ErrorCode,
    ExplainResume,
    Explanation,
    Fidelity,
    Fragmentation,
    FleetRuntimes,
    FragmentationQuery,
    Heartbeat,
    HeartbeatReply,
    PauseActor,
    RegisterReply,
    RegisterWorker,
    RemoveWorker,
    ResumeActor,
    RevertActor,
    RevertReply,
    RuntimesQuery,
    SeqReply,
    Snapshot,
    SnapshotReply,
    StopActor,
    SuspendActor,
    TagSnapshot,
    UnderPlacement,
    UpdateTemplate,
    WhatIf,
    WhatIfAnswer,
    WorkerDetail,
    WorkerPage,
    WorkerQuery,
    WorkersQuery,
)
from events.states import ActorState
from events.subjects import DEFAULT_PREFIX, MAX_WAIT_MS, WAIT_HEADER, check_prefix, micro_name, service_subject
from warmboot.connection import CONNECT_TIMEOUT_S, connect_within, hears_replies

T = TypeVar("T")
K = TypeVar("K")
log = logging.getLogger("warmboot.client")

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_ATTEMPTS = 6
# the `Client.limits` in force in this task (asyncio copies the context into each task it starts): one
# (client, timeout, attempts) for each client that has some, the innermost first
_LIMITS: contextvars.ContextVar[tuple[tuple[Any, float, int], ...]] = contextvars.ContextVar("warmboot_client_limits",
                                                                                            default=())
DISCOVERY_WAIT_S = 0.5  # how long `_serves` waits for a service to answer `$SRV.INFO`
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0


# requests whose answer never writes: sent without their wait (`WAIT_HEADER`), which only bounds writes
WRITE_NOTHING = frozenset({("registry", "heartbeat"), ("scheduler", "explain"), ("scheduler", "fragmentation"),
                           ("scheduler", "whatif"), ("scheduler", "runtimes"), ("snapshotter", "status"),
                           ("scheduler", "worker"), ("scheduler", "actors"), ("scheduler", "workers")})
NO_SERVICE = "no service answers "  # how a request that reached nobody is said (then the subject)
NO_REPLY = "no reply from "  # how an attempt's time-out is said (then the subject and the wait)
UNSENT_FULL = "not connected to NATS, and the requests waiting to be sent fill the connection's buffer"


class NobodyAnswered(ContractError):
    """UNAVAILABLE: every attempt of a request reached no service (nothing subscribes to its subject:
    the service is not running, the prefix is not the deployment's, or the service is of an earlier
    version that has no such endpoint)."""


class Closed(ContractError):
    """FAILED_PRECONDITION: the client's connection is closed (or closing): nothing was sent on this attempt."""


class Refused(ContractError):
    """FAILED_PRECONDITION: the server refused to let these credentials publish the request (`Client._refusal`)."""


def asked_first(error: Refused, actor_id: str, what: str) -> Refused:
    """`error`, the refusal of the status question a command asks before it is sent (which `what` of the
    actor it names), said as that: it read as if the status question were the command (an operator's
    `actor resume` said only that it may not publish to `...snapshotter.status.a-3`: a trial)."""
    return Refused(error.code, f"the command asks the snapshotter first which {what} {actor_id} is in (its "
                   f"fence), and {error.message}", error.field)


def no_service_hint(prefix: str, service: str) -> str:
    """What a request nobody answered, however often it was sent, says of its likely cause (after
    the attempts): the prefix is not the deployment's, or the service is not running."""
    return f": is {prefix!r} the deployment's prefix, and is its {service} running?"


def new_request_id() -> str:
    return uuid.uuid4().hex


def _transient(service: str, error: ContractError) -> bool:
    """Whether the same request, sent again, may be answered otherwise: UNAVAILABLE (a replica that
    could not answer now, a time-out, no responders), except one naming `min_seq` or `life_seq` (a
    sequence past the end of the log: no retry brings it, `past_the_end`); and the registry's
    refusal of a request about a worker it is working on `IN_FLIGHT_PER_WORKER` requests about
    already (RESOURCE_EXHAUSTED naming no field: nothing was taken; without a retry, a worker
    flooding its own `remove` or `drain` would have an operator's refused with its own). The
    scheduler's RESOURCE_EXHAUSTED (no room) and the registry's budget refusal (naming `worker_id`)
    are the caller's to judge."""
    if error.code is ErrorCode.UNAVAILABLE:
        return not past_the_end(error)
    return error.code is ErrorCode.RESOURCE_EXHAUSTED and service == "registry" and error.field is None


PLACEMENTS_KEPT = 65_536  # actors whose last placement (and life) a client remembers, to fence its requests


def remember(kept: dict[str, K], actor_id: str, value: K, seq: Callable[[K], int] = lambda seq: seq) -> None:
    """`kept[actor_id] = value` unless it holds a later one by `seq` (a reply that came late, after this
    client's own stop and create of the actor, say: stream sequences only grow), the newest last, and
    the oldest actor forgotten past PLACEMENTS_KEPT."""
    kept[actor_id] = max(value, kept.pop(actor_id, value), key=seq)
    if len(kept) > PLACEMENTS_KEPT:
        del kept[next(iter(kept))]


def checked_seconds(value: Any, field: str, *, forever: bool = False) -> float:
    """A number of seconds above 0 (finite, unless `forever`), or INVALID_ARGUMENT naming `field`: a
    client's `timeout` (`timeout=0` was taken as a millisecond) and `connect`'s `connect_timeout` (`0`
    tried for no time and said UNAVAILABLE "within 0 s"; `math.inf` waits on)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or (
            value == math.inf and not forever):
        raise invalid(f"{value!r} is not a number of seconds above 0", field)
    return float(value)


def checked_attempts(value: Any) -> int:
    """A client's `attempts`, a whole number, at least 1, or INVALID_ARGUMENT naming it (`0` was taken as 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(f"{value!r} is not a number of attempts: a whole number, at least 1", "attempts")
    return value


def given(value: Any, kind: type[T], name: str) -> T:
    """`value`, a request body of `kind` (events.schema), or INVALID_ARGUMENT naming the parameter, before
    anything is sent (`wb.whatif("gvisor")` raised an AttributeError of `min_seq`: a user trial)."""
    if not isinstance(value, kind):
        raise invalid(f"{value!r} is not a {kind.__name__} (events.schema)", name)
    return value


# Each field of a pause or suspend that names the placement its image was taken under (`UnderPlacement`), and
# the field of that placement's Assignment it is: the one mapping, `placed_under` reads it and `actor
# pause|suspend --placement FILE` names the file's field by it.
UNDER_PLACEMENT = {"placement_seq": "seq", "placement_worker_id": "worker_id", "placement_node": "node",
                   "placement_runtime": "sandbox_runtime"}


def placed_under(placed: Assignment) -> UnderPlacement:
    """What a pause or suspend of an image taken under the placement `placed` names: its seq, worker, node
    and pin (`UNDER_PLACEMENT`)."""
    return UnderPlacement(**{under: getattr(placed, field) for under, field in UNDER_PLACEMENT.items()})


def under_seq(under: UnderPlacement) -> int:
    return under.placement_seq or 0


def below_memory(snapshot: Snapshot | None, template_uid: str,
                 given: tuple[str, str] = ("golden_snapshot", "source_tag")) -> str | None:
    """Why an actor of min_fidelity MEMORY whose first snapshot is `snapshot` can never be resumed
    (as the scheduler's plan refuses it: services.scheduler.decide, rule 4a), or None if its memory
    may be restored. The snapshotter takes such an actor (the contract lets it); a walkthrough's was
    refused at every resume, and the CLI said nothing, or that it would start without the memory.
    `given`: what the golden snapshot and the tag are called where it is said (the CLI's options)."""
    if snapshot is None:
        return f"it has no snapshot to restore (no {given[0]}, no {given[1]}): a cold boot is below it"
    what = f"its snapshot {snapshot.snapshot_id!r}"
    if snapshot.fidelity is not Fidelity.MEMORY:
        return f"{what} holds {snapshot.fidelity.value} only"
    if snapshot.template_uid != template_uid:
        return f"{what} was taken from template {snapshot.template_uid!r}, not {template_uid!r} (TEMPLATE_CHANGED)"
    if snapshot.sandbox_runtime is None:
        return f"{what} holds memory but no sandbox_runtime: no worker can restore it (SNAPSHOT_NOT_MEMORY)"
    return None


class Connecting:
    """What `Client.connect` gives: awaited, the client (`await Client.connect(...)`); entered, the client,
    closed at the block's end (`async with Client.connect(...) as wb:`, as `async with await ...`). An
    awaitable, not a coroutine: `asyncio.ensure_future` or `wait_for` take it, `create_task` does not."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make  # the connect, made when awaited or entered (never left unawaited)
        self._client: Client | None = None

    def __await__(self) -> Any:
        return self._make().__await__()

    async def __aenter__(self) -> "Client":
        self._client = await self._make()
        return self._client

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()


class Client:
    """warmboot's endpoints as typed methods, over one NATS connection (see the module docstring)."""

    def __init__(
        self,
        nc: NATS,
        prefix: str = DEFAULT_PREFIX,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        attempts: int = DEFAULT_ATTEMPTS,
        read_your_writes: bool = True,
        refusals_final: bool = True,
        fence_snapshots: bool = True,
        fence_resumes: bool = True,
        fence_lives: bool = True,
        on_unfenced: Callable[[str, ContractError], None] | None = None,
        on_never_resumable: Callable[[str, str], None] | None = None,
    ):
        self.nc = nc
        # a request the server refuses to carry is FAILED_PRECONDITION at once (`_refusal`);
        # else UNAVAILABLE, as a lost one (the agent: its own loop tells a refusal, `_check_not_denied`,
        # and takes nats-py's own errors and an unreadable reply as it always did, `_once`)
        self.refusals_final = refusals_final
        self.prefix = check_prefix(prefix)
        # each attempt's wait for its answer, and how many attempts a request makes (`limits` for some calls)
        self._timeout, self._most_attempts = checked_seconds(timeout, "timeout"), checked_attempts(attempts)
        self.read_your_writes = read_your_writes
        self.seq = 0  # the highest stream sequence a reply has given this client
        # `pause` and `suspend` without a `placement_seq` name the placement this client's last
        # `resume` of the actor answered (`_placed`): the one whose worker this client told to run it,
        # and so to take its image (`placement_seq`'s docstring)
        self.fence_snapshots = fence_snapshots
        # told (the actor's id, the error) when a request goes without the fence `status` would give it,
        # the snapshotter being of an earlier version (`status_if_served`); by default a warning is logged
        self.on_unfenced = on_unfenced
        # told (the actor's id, why) when `create` made an actor no resume can place (`below_memory`);
        # by default a warning is logged
        self.on_never_resumable = on_never_resumable
        # actor id -> that Assignment's seq, worker, node and pin (`placed_under`), the last PLACEMENTS_KEPT actors
        self._placed: dict[str, UnderPlacement] = {}
        # `resume` without a `life_seq` names the life this client last saw the actor in (`_lives`): the
        # `seq` of its last create or resume of it (`life_seq`'s docstring)
        self.fence_resumes = fence_resumes
        self.fence_lives = fence_lives  # the same for a stop, tag, revert or update-template
        self._lives: dict[str, int] = {}  # actor id -> that seq, the last PLACEMENTS_KEPT actors
        self.retries = 0  # requests sent again (`_transient`)
        self._owned = False

    @classmethod
    def connect(cls, servers: str | list[str], prefix: str = DEFAULT_PREFIX, *,
                connect_timeout: float = CONNECT_TIMEOUT_S, **options: Any) -> "Connecting":
        """A client with a connection of its own (closed by `close`, or at the end of the block of
        `async with Client.connect(...) as wb:`; `await Client.connect(...)` gives the client), made as the CLI's
        (`warmboot.connection.connect`): signed in with the URL's user and password, or the nkey
        seed `nkeys_seed` (else $NATS_NKEY_SEED), or what the environment gives
        ($NATS_USER/$NATS_PASSWORD, $NATS_TOKEN, $NATS_CREDS); listening for replies under
        `inbox_prefix`, else $NATS_INBOX_PREFIX, else `_INBOX.<user>` for a URL (or else
        $NATS_USER, or else the nkey seed file's name, `<user>.nk`) that names one, which is where the
        permissions of `warmboot nats-config` let a user hear them; once connected, each connection
        error logged once while it repeats (to the `warmboot.client` logger; before, the error is the
        one raised, and not logged). A server that does not answer within `connect_timeout` seconds is
        UNAVAILABLE (ContractError), naming it; one that refuses the user that inbox prefix,
        FAILED_PRECONDITION (`warmboot.connection.hears_replies`), before anything is sent; a
        prefix that is not one, a URL the CLI's --nats refuses, or a `connect_timeout` that is not a number
        of seconds above 0, INVALID_ARGUMENT (field `prefix`, `servers`, `connect_timeout`) before connecting;
        after that the connection reconnects for as long as it lives. `options` go to the
        Client, except the nats.connect keywords
        `user_credentials`, `nkeys_seed`, `inbox_prefix` and `name`."""
        return Connecting(lambda: cls._connect(servers, prefix, connect_timeout, dict(options)))

    @classmethod
    async def _connect(cls, servers: str | list[str], prefix: str, connect_timeout: float,
                       options: dict[str, Any]) -> "Client":
        connect = {k: options.pop(k) for k in ("user_credentials", "inbox_prefix", "name") if k in options}
        nkey_seed = options.pop("nkeys_seed", None)
        inspect.signature(cls).bind(None, prefix, **options)  # a mistyped option: its TypeError before connecting
        checked_seconds(options.get("timeout", DEFAULT_TIMEOUT_S), "timeout")
        checked_attempts(options.get("attempts", DEFAULT_ATTEMPTS))
        checked_seconds(connect_timeout, "connect_timeout", forever=True)
        try:  # before connecting: a bad prefix was a ValueError, raised with the connection left open
            check_prefix(prefix)
        except ValueError as error:
            raise invalid(str(error), "prefix") from None
        url = servers if isinstance(servers, str) else ",".join(servers)
        try:  # as the CLI's --nats: nats-py raised a ValueError of its own for some ('nats://[::1')
            check_url(url)
        except ValueError as error:
            said = str(error)  # check_url's words name the member; urllib's do not
            raise invalid(said if said.startswith("'") else f"{redact_url(url)!r}: {said}", "servers") from None
        errors = ErrorsOnce(None, redact_url(url))  # until connected, an error is the one raised: not logged too
        nc = await connect_within(url, connect.pop("name", "warmboot-client"), connect_timeout, nkey_seed=nkey_seed,
                                  errors=errors, reconnect_time_wait=0.25, **connect)
        try:
            await hears_replies(url, nc, errors)  # a user refused its inbox: said before anything is sent
            client = cls(nc, prefix, **options)
        except BaseException:
            await nc.close()
            raise
        errors.reset()
        errors.logger = log  # connected: what the connection meets from now on is logged once each
        client._owned = True
        return client

    async def close(self) -> None:
        """Close the connection if `connect` made it (one given to the constructor is the caller's to close):
        given up after CLOSE_GIVEN_UP_S and its socket closed at once if the server is frozen with the socket's
        buffers full (`close_within`: nats-py's own close never ends then), and said in a warning."""
        if self._owned and not self.nc.is_closed:
            await close_within(self.nc)  # its server gone too (nats-py's own close raised then), or frozen

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def timeout(self) -> float:
        """Seconds each attempt of a request waits for its answer (outside a `limits` block)."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:  # checked as the constructor checks it (it was taken unchecked)
        self._timeout = checked_seconds(value, "timeout")

    @property
    def attempts(self) -> int:
        """How many attempts a request makes at most (outside a `limits` block)."""
        return self._most_attempts

    @attempts.setter
    def attempts(self, value: int) -> None:
        self._most_attempts = checked_attempts(value)

    @contextlib.contextmanager
    def limits(self, timeout: float | None = None, attempts: int | None = None) -> Iterator[Client]:
        """Within this `with` block, and in the tasks started in it, this client's requests wait at most
        `timeout` seconds for each attempt's answer and make at most `attempts` attempts (one left out
        keeps the limit in force: the constructor's, or an enclosing block's)::

            with wb.limits(timeout=0.5, attempts=1):
                placed = await wb.resume("a-1")   # UNAVAILABLE after half a second, not sent again

        The same client: the same read-your-writes `seq` and fences, and its other tasks keep their own
        limits. A call that makes several requests (a `pause` that asks `status` first) makes each
        within them. A write's service is told the shorter wait (the wait header), so a copy it holds
        past it writes nothing. A value the constructor would refuse is INVALID_ARGUMENT naming
        `timeout` or `attempts`, raised before the block runs."""
        now_timeout, now_attempts = self._limits()
        limited = (self, checked_seconds(now_timeout if timeout is None else timeout, "timeout"),
                   checked_attempts(now_attempts if attempts is None else attempts))
        token = _LIMITS.set((limited,) + tuple(kept for kept in _LIMITS.get() if kept[0] is not self))
        try:
            yield self
        finally:
            _LIMITS.reset(token)

    def _limits(self) -> tuple[float, int]:
        """The timeout and attempts of this client's requests made here: the innermost `limits`', else its own."""
        for client, timeout, attempts in _LIMITS.get():
            if client is self:
                return timeout, attempts
        return self.timeout, self.attempts

    # --- the one way a request is made -------------------------------------------------

    async def request(self, service: str, verb: str, entity: str | None, body: Base, reply_type: type[T]) -> T:
        """Send `body` to `<prefix>.<service>.<verb>[.<entity>]` and decode the reply as
        `reply_type`, retrying what the contract says is safe to retry (the body, and so
        its request_id, unchanged); remember the reply's `seq`."""
        if entity is not None and not (isinstance(entity, str) and ID_RE.match(entity)):
            # a subject token is what an id is for: a dot or a space would change the subject (and a
            # number is not one: `wb.resume(5)` raised the regular expression's TypeError)
            raise invalid(f"{entity!r} is not an id: {ID_WORDS}",
                          "worker_id" if service == "registry" else "actor_id")
        subject = service_subject(self.prefix, service, verb, entity)
        # how long each attempt waits, where an answer may write: a service writes nothing for one it
        # has held longer (`services.deadline`), so a copy a stalled replica decides late does not act
        # on what the caller did since (an entity's next life)
        # a time-out past the header's bound says the bound: a caller that waits a day or more (it was
        # INVALID_ARGUMENT on every write: a review)
        timeout, attempts = self._limits()
        wait = min(MAX_WAIT_MS, max(1, math.ceil(timeout * 1000)))
        waits = None if (service, verb) in WRITE_NOTHING else {WAIT_HEADER: str(wait)}
        try:
            return await self._attempts(service, subject, encode(body), reply_type, waits, timeout, attempts)
        except ContractError as error:  # the id a caller needs to send it again (`ContractError.request_id`)
            error.request_id = getattr(body, "request_id", None)
            raise

    async def _attempts(self, service: str, subject: str, data: bytes, reply_type: type[T],
                        headers: dict[str, str] | None, timeout: float, attempts: int) -> T:
        """`request`'s attempts at `subject`, at most `attempts`, each with `data` and waiting `timeout`
        seconds, until one is answered or is not to be retried."""
        delay = FIRST_BACKOFF_S
        started = asyncio.get_running_loop().time()
        nobody = 0  # attempts that reached no service
        timed_out = 0  # attempts that waited `timeout` for an answer and heard none
        sent = False  # an earlier attempt went out and may have been carried out (its answer not heard)
        for attempt in range(attempts):
            try:
                reply = await self._once(subject, data, reply_type, headers, timeout)
            except ContractError as error:
                if isinstance(error, Closed) and sent:
                    # this attempt sent nothing, but an earlier one did (a close ends the wait for its answer
                    # as a time-out): "nothing was sent" told the caller its request was not carried out,
                    # when it may have been (a user trial: 292 of 300 resumes so told were placed)
                    raise unavailable(f"the connection to NATS was closed while the request to {subject} waited "
                                      "for its answer: an earlier attempt was sent and may have been carried out; "
                                      "send it again with the same request_id on a new client for its "
                                      "answer") from None
                if not _transient(service, error):
                    raise
                nobody += error.message.startswith(NO_SERVICE)
                timed_out += error.message.startswith(NO_REPLY)
                sent = sent or not error.message.startswith((NO_SERVICE, UNSENT_FULL))
                if attempt == attempts - 1:
                    if error.message.startswith(NO_SERVICE):  # the attempts made, and what is likely wrong
                        took = asyncio.get_running_loop().time() - started
                        if nobody == attempt + 1:
                            made = f"after {nobody} attempt{'' if nobody == 1 else 's'}"
                            raise NobodyAnswered(ErrorCode.UNAVAILABLE, f"{NO_SERVICE}{subject} {made} in {took:.1f} s"
                                                 f"{no_service_hint(self.prefix, service)}") from None
                        # the prefix is right: something answered, or heard and did not answer
                        made = f"at the last of {attempt + 1} attempts ({nobody} reached no service)"
                        why = f": the {service} was reached before; it may be stopping or restarting"
                        raise unavailable(f"{NO_SERVICE}{subject} {made} in {took:.1f} s{why}") from None
                    if attempts > 1 and error.message.startswith(NO_REPLY):
                        # "within 5s" alone, after six attempts and some 35 s, read as one wait of 5 s (a
                        # user trial of `limits(timeout=0.3, attempts=2)`): the attempts made, and the time
                        took = asyncio.get_running_loop().time() - started
                        made = (f"at each of {attempts} attempts" if timed_out == attempts
                                else f"at the last of {attempts} attempts")
                        raise unavailable(f"{error.message}, {made} ({took:.1f} s in all)") from None
                    raise
            else:
                seq = getattr(reply, "seq", None)
                if isinstance(seq, int) and seq > self.seq:
                    self.seq = seq
                return reply
            self.retries += 1
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, MAX_BACKOFF_S)
        raise AssertionError("unreachable")

    @staticmethod
    def _refusal(subject: str) -> Refused:
        """FAILED_PRECONDITION for a request the server refused to let these credentials publish
        (`events.natspy.connections.unless_refused`): nobody heard it, and sending it again ends the same (an
        operator's `warmboot worker drain` ended UNAVAILABLE, "no reply", after some 30 s of retries:
        an audit's finding)."""
        return Refused(ErrorCode.FAILED_PRECONDITION, f"NATS does not let these credentials publish to {subject}: "
                       "the request reached nobody, and sending it again will not change that (docs/security.md "
                       "says what each role may publish)")

    async def _once(self, subject: str, data: bytes, reply_type: type[T], headers: dict[str, str] | None,
                    timeout: float) -> T:
        if headers and len(data) + len(header_block(headers)) > self.nc.max_payload:
            # the server's limit is on the header block and the payload together, nats-py's on the payload
            # alone: sent, such a request got the connection cut ("Maximum Payload Violation"), every request
            # on it lost, and was told UNAVAILABLE (sent again by the agent after each reconnect)
            raise request_too_large(subject, len(data) + len(header_block(headers)), self.nc.max_payload)
        try:
            request = self.nc.request(subject, data, timeout=timeout, headers=headers)
            msg = await (unless_refused(self.nc, subject, request) if self.refusals_final else request)
        except PublishRefused:  # said by the server at once: not after the request's time-out
            raise self._refusal(subject) from None
        except nats.errors.NoRespondersError:
            raise unavailable(f"{NO_SERVICE}{subject}") from None
        except nats.errors.TimeoutError:
            raise unavailable(f"{NO_REPLY}{subject} within {timeout:g}s") from None
        except nats.errors.MaxPayloadError as error:  # sent again, refused again: final for every caller
            # (the agent's loop took it as a connection's error and sent an edit past max_payload every 5 s for
            # as long as it ran, its registration in force, which the file no longer made, beaten meanwhile)
            raise self._unsent(subject, data, error) from None
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError,
                nats.errors.OutboundBufferLimitError) as error:
            if not self.refusals_final:  # the agent: its own loop takes nats-py's errors, as it always did
                raise
            raise self._unsent(subject, data, error) from None
        except RuntimeError as error:
            if not transport_lost(error):
                raise
            raise unavailable(f"the connection to NATS was lost as the request to {subject} was written: it may "
                              "still go out once the connection is back (nats-py keeps what it could not send); a "
                              "retry with the same request_id gets its answer") from None
        try:
            return decode_reply(reply_type, msg.data)
        except msgspec.DecodeError as error:  # not this version's reply (ValidationError is one too)
            if not self.refusals_final:
                raise
            raise ContractError(ErrorCode.INTERNAL, f"the reply from {subject} cannot be read as "
                                f"its {reply_type.__name__}: {error} (is what answers there warmboot, of a "
                                "version that speaks this client's contract?)") from None

    def _unsent(self, subject: str, data: bytes, error: Exception) -> ContractError:
        """A request nats-py would not send, as the contract error that says why."""
        if isinstance(error, (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError)):
            return Closed(ErrorCode.FAILED_PRECONDITION, f"the connection to NATS is closed (or closing): nothing "
                          f"was sent to {subject}, and nothing will be on it; make a new client")
        if isinstance(error, nats.errors.MaxPayloadError):
            return request_too_large(subject, len(data), self.nc.max_payload)
        # disconnected, and what waits to be sent fills the connection's buffer
        return unavailable(f"{UNSENT_FULL}: nothing was sent to {subject}")

    def _min_seq(self, given: int | None) -> int | None:
        if given is not None:
            return given
        return self.seq or None if self.read_your_writes else None

    @staticmethod
    def _with_request_id(body: Any) -> Any:
        if getattr(body, "request_id", None) is None:
            return msgspec.structs.replace(body, request_id=new_request_id())
        return body

    # --- registry ---------------------------------------------------------------------------

    async def register(self, registration: RegisterWorker) -> RegisterReply:
        """Register the worker, or register it again (what a worker agent sends at its start and on every
        change): `outcome` REGISTERED, RUNTIME_CHANGED, UPDATED or UNCHANGED (the normalised registration
        equal to the last: nothing written), and the `seq` of what was written. A set of sandbox classes
        other than the first registration's is FAILED_PRECONDITION. A `request_id` is made if the body
        has none."""
        body = self._with_request_id(given(registration, RegisterWorker, "registration"))
        return await self.request("registry", "register", body.worker_id, body, RegisterReply)

    async def heartbeat(self, worker_id: str) -> HeartbeatReply:
        """Keep `worker_id` alive for another `ttl_s` seconds (the reply's); writes no event. NOT_FOUND if it
        is not registered (never was, or removed: register it again)."""
        return await self.request("registry", "heartbeat", worker_id, Heartbeat(), HeartbeatReply)

    async def drain(self, worker_id: str, reason: str | None = None, request_id: str | None = None) -> SeqReply:
        """Take `worker_id` out of new placements; what it runs keeps running, and it stays drained if it
        registers again. A drained worker's drain writes nothing. NOT_FOUND if it is not registered."""
        body = DrainWorker(reason=reason, request_id=request_id or new_request_id())
        return await self.request("registry", "drain", worker_id, body, SeqReply)

    async def remove(self, worker_id: str, reason: str | None = None, request_id: str | None = None) -> SeqReply:
        """Remove `worker_id`: its RUNNING actors are released (SUSPENDED, reason WORKER_REMOVED); PAUSED ones
        keep their image on its node. `seq`: the WorkerRemoved event's. NOT_FOUND if it is not registered."""
        body = RemoveWorker(reason=reason, request_id=request_id or new_request_id())
        return await self.request("registry", "remove", worker_id, body, SeqReply)

    # --- snapshotter ------------------------------------------------------------------------

    async def create(self, actor: CreateActor, *, warn: bool = True) -> SeqReply:
        """Create the actor (state CREATED), from nothing, a `source_tag` or a `golden_snapshot`, whose stamp
        its first image keeps. `seq`: the ActorCreated event's, remembered as the life this client's
        later stop, tag, revert, update-template and resume of the actor name (`fence_lives`). An actor
        that exists is ALREADY_EXISTS (field `actor_id`), unless STOPPED: then a new life begins. A
        request_id is made if the body has none. `warn=False`: the caller says itself whether no resume can
        ever place it (`below_memory`: `actor create` does, in its own words), and no `status` is asked
        for it."""
        body = self._with_request_id(given(actor, CreateActor, "actor"))
        created = await self.request("snapshotter", "create", body.actor_id, body, SeqReply)
        remember(self._lives, body.actor_id, created.seq)
        if warn and body.min_fidelity is Fidelity.MEMORY:  # taken, as the contract allows, though maybe never resumable
            start = (body.golden_snapshot if body.source_tag is None
                     else await self.started_from(body.actor_id, created.seq))
            never = None if body.source_tag is not None and start is None else below_memory(start, body.template_uid)
            if never is not None and self.on_never_resumable is not None:
                self.on_never_resumable(body.actor_id, never)
            elif never is not None:
                log.warning("%s can never be resumed: its min_fidelity is MEMORY and %s; every resume is refused "
                            "(FAILED_PRECONDITION)", body.actor_id, never)
        return created

    async def started_from(self, actor_id: str, created: int) -> Snapshot | None:
        """The snapshot the actor whose create answered `created` (its last event) starts from, as the
        snapshotter's `status` says it (`ActorStatus.snapshot`, which any caller that may create may ask: a
        client's credentials may not read the log, and every create from a tag said its checks were not made:
        a trial of a secured deployment); None when the status does not say it: a snapshotter of an earlier
        version, none answering, or the actor moved on since (its last event another: its latest snapshot may
        be another)."""
        try:
            status = await self.status(actor_id)
        except (ContractError, OSError, asyncio.TimeoutError, nats.errors.Error):
            return None
        if status.state is not ActorState.CREATED or status.seq != created:  # its last event is still the create's
            return None
        return status.snapshot

    async def pause(self, actor_id: str, snapshot_id: str | None = None, request_id: str | None = None,
                    placement_seq: int | None = None, placed: Assignment | None = None) -> SnapshotReply:
        """`placement_seq`: the `seq` of the Assignment the image was taken under (what `resume`
        answered); FAILED_PRECONDITION if the actor has been placed anew since. Left out, it is the
        seq of this client's last `resume` of the actor, if it made one (`fence_snapshots`; the
        image comes from the worker that Assignment named), with that Assignment's worker, node and pin
        (also when `placement_seq` is its seq): refused too if the placement stored at that sequence is
        another's (a log rolled back past it and written again). A copy of this request held somewhere
        (a NATS server stopped with it in its buffers: a failover test) and decided once the actor
        was stopped, created and placed again, is then refused instead of recording this image in
        the next life, stamped with that life's pin, where a resume would send it to a worker that
        cannot load it. For an actor this client did not resume, it is the placement the actor has
        when the call starts, as the snapshotter says (`status`: one more request; since 2026-12-06,
        before which such a pause was sent unfenced): that fences the actor as this call finds it, not
        as it was when its worker took the image, so a caller that pauses actors another process
        resumed gives the seq of the placement it had take the image. With `fence_snapshots=False`,
        only the caller's (with the worker, node and pin, if it is this client's last resume's). A
        snapshotter of an earlier version (no `status`): sent without one, and `on_unfenced` is told
        (`status_if_served`). `placed`: instead of `placement_seq`, the Assignment the image was taken
        under (another process's resume, say): its seq, worker, node and pin are named."""
        under = await self._placement_of(actor_id, placement_seq, placed)
        body = PauseActor(snapshot_id=snapshot_id, request_id=request_id or new_request_id(),
                          **msgspec.structs.asdict(under))
        return await self.request("snapshotter", "pause", actor_id, body, SnapshotReply)

    async def suspend(
        self, actor_id: str, fidelity: Fidelity = Fidelity.MEMORY, uri: str | None = None,
        snapshot_id: str | None = None, request_id: str | None = None, placement_seq: int | None = None,
        placed: Assignment | None = None,
    ) -> SnapshotReply:
        """`placement_seq` and `placed` as for `pause`: this client's last resume of the actor if left out
        (for a PAUSED actor: the placement its pause ended), else the actor's placement as `status` says."""
        under = await self._placement_of(actor_id, placement_seq, placed)
        body = SuspendActor(snapshot_id=snapshot_id, uri=uri, fidelity=fidelity,
                            request_id=request_id or new_request_id(), **msgspec.structs.asdict(under))
        return await self.request("snapshotter", "suspend", actor_id, body, SnapshotReply)

    async def _placement_of(self, actor_id: str, given: int | None,
                            placed: Assignment | None = None) -> UnderPlacement:
        """The placement a pause or suspend names: `placed` (its seq, worker, node and pin: `placed_under`),
        else `given`, else this client's last resume of the actor (`placed_under`), else the one the
        snapshotter says is the actor's when the call starts (`status`; in a life not placed yet, its
        creation, which no placement matches: each comes after it); none when the snapshotter is of an
        earlier version (`status_if_served`). A `given` seq of this client's last resume names that
        resume's worker, node and pin too. INVALID_ARGUMENT, nothing sent, for a `placed` of another actor
        or beside another `given`."""
        if placed is not None:
            if placed.actor_id != actor_id:
                raise invalid(f"placed is an Assignment of actor {placed.actor_id!r}, not {actor_id!r}", "placed")
            if given not in (None, placed.seq):
                raise invalid(f"placement_seq {given} is not the seq of placed ({placed.seq}): give one of them",
                              "placement_seq")
            return placed_under(placed)
        known = self._placed.get(actor_id)
        if given is not None or not self.fence_snapshots:
            return known if known is not None and known.placement_seq == given else UnderPlacement(placement_seq=given)
        if known is not None:
            return known
        now = await self.status_if_served(actor_id, "placement")
        if now is None:
            return UnderPlacement()
        return UnderPlacement(placement_seq=now.placement_seq if now.placement_seq is not None else now.life_seq)

    async def status_if_served(self, actor_id: str, what: str = "life") -> ActorStatus | None:
        """`status`, or None when the deployment's snapshotter is of an earlier version, which has no
        such endpoint (and ignores the fences a status would give): every attempt reached no service,
        and the snapshotter that answers discovery (`$SRV.INFO`) lists none. `on_unfenced` is told
        (else a warning logged): what the caller sends goes without a fence, as before the question
        was asked. Any other failure is raised, nothing sent: no snapshotter running (its request would
        reach none either), or one restarting (the question reached none while one now serves it)."""
        try:
            return await self.status(actor_id)
        except Refused as error:
            raise asked_first(error, actor_id, what) from None  # (`what` the caller names: its life, its placement)
        except NobodyAnswered as error:
            if await self._serves("snapshotter", "status") is not False:
                raise
            if self.on_unfenced is not None:
                self.on_unfenced(actor_id, error)
            else:
                log.warning("%s: sent without a fence (%s; the snapshotter lists no status endpoint)", actor_id,
                            error.message)
            return None

    async def _serves(self, service: str, verb: str) -> bool | None:
        """Whether `micro_name(service)` of this deployment (its `prefix` metadata) serves `verb`, as the
        first instance of it to answer `$SRV.INFO` within DISCOVERY_WAIT_S says (None: none answered;
        instances of other deployments on the same server are passed over)."""
        inbox = self.nc.new_inbox()
        answers = await self.nc.subscribe(inbox)
        loop = asyncio.get_running_loop()
        until = loop.time() + DISCOVERY_WAIT_S
        try:
            await self.nc.publish(f"$SRV.INFO.{micro_name(service)}", b"", reply=inbox)
            while (left := until - loop.time()) > 0:
                try:
                    msg = await answers.next_msg(timeout=left)
                except nats.errors.TimeoutError:
                    break
                try:
                    info = msgspec.json.decode(msg.data)
                except msgspec.DecodeError:
                    continue
                if isinstance(info, dict) and (info.get("metadata") or {}).get("prefix") == self.prefix:
                    return any(isinstance(e, dict) and e.get("name") == verb for e in info.get("endpoints") or ())
            return None
        finally:
            await answers.unsubscribe()

    async def status(self, actor_id: str) -> ActorStatus:
        """The actor as the stream leader's log has it (writes nothing): its state, the creation of
        its current life (`life_seq`, what a resume, stop, tag, revert or update-template names) and
        its placement (`placement_seq`, what a pause or suspend names; null if the life has not been
        placed). A project addition (`snapshotter.status`, docs/contract.md); a snapshotter of an
        earlier version does not answer."""
        return await self.request("snapshotter", "status", actor_id, ActorStatusQuery(), ActorStatus)

    # `tag`, `update_template`, `stop` and `revert` name the actor's life as `resume` does (`life_seq`:
    # the caller's, else this client's last create or resume of the actor, with `fence_lives`): a copy
    # held somewhere, its caller gone, and decided once the actor was stopped and created again is
    # refused, FAILED_PRECONDITION field `life_seq`, instead of stopping, tagging, reverting or
    # changing the template of a life nobody asked it of (`_in_life`; sent again into a life another
    # caller made meanwhile, as a resume is, but not into one this client made itself since)

    async def tag(self, actor_id: str, tag: str, request_id: str | None = None,
                  life_seq: int | None = None) -> SnapshotReply:
        """Copy the actor's latest snapshot under `tag` (stamp unchanged), for other actors' `source_tag`.
        Only an EXTERNAL snapshot can be tagged: a LOCAL one (PAUSED), or none, is FAILED_PRECONDITION.
        `life_seq`: as `stop`'s."""
        body = TagSnapshot(tag=tag, request_id=request_id or new_request_id(), life_seq=life_seq)
        return await self._in_life("snapshotter", "tag", actor_id, body, SnapshotReply, self.fence_lives)

    async def update_template(self, actor_id: str, template_uid: str, request_id: str | None = None,
                              life_seq: int | None = None) -> SeqReply:
        """Set the actor's template; its next resume from a snapshot of another template falls back
        (TEMPLATE_CHANGED). `life_seq`: as `stop`'s."""
        body = UpdateTemplate(template_uid=template_uid, request_id=request_id or new_request_id(), life_seq=life_seq)
        return await self._in_life("snapshotter", "update-template", actor_id, body, SeqReply, self.fence_lives)

    async def stop(self, actor_id: str, request_id: str | None = None, life_seq: int | None = None) -> SeqReply:
        """Stop the actor (its placement released). `life_seq`: the `seq` of the create or resume that began
        the life meant; left out, this client's last one of the actor (`fence_lives`): a stop held
        somewhere and decided after the actor was stopped and created again is FAILED_PRECONDITION
        (field `life_seq`), not a stop of the new life."""
        body = StopActor(request_id=request_id or new_request_id(), life_seq=life_seq)
        stopped = await self._in_life("snapshotter", "stop", actor_id, body, SeqReply, self.fence_lives)
        # the life is over: its placements with it (not a later life's this client created meanwhile: a stop
        # answered late)
        if self._lives.get(actor_id, 0) <= stopped.seq:
            self._lives.pop(actor_id, None)
        placed = self._placed.get(actor_id)
        if placed is not None and under_seq(placed) <= stopped.seq:
            self._placed.pop(actor_id, None)
        return stopped

    async def revert(self, actor_id: str, reason: str | None = None, request_id: str | None = None,
                     life_seq: int | None = None) -> RevertReply:
        """Give up the actor's LOCAL image and go back to its latest EXTERNAL snapshot (or to none: it will
        cold-boot), state SUSPENDED: the way out for a PAUSED actor whose node is gone. `snapshot`: the
        one it goes back to, or null. FAILED_PRECONDITION unless the actor is PAUSED, or SUSPENDED with a
        LOCAL latest snapshot. `life_seq`: as `stop`'s."""
        body = RevertActor(reason=reason, request_id=request_id or new_request_id(), life_seq=life_seq)
        return await self._in_life("snapshotter", "revert", actor_id, body, RevertReply, self.fence_lives)

    async def _in_life(self, service: str, verb: str, actor_id: str, body: Any, reply_type: type[T],
                       fenced: bool, into_own: bool = False) -> T:
        """`body`, a request naming the actor's life (`life_seq`: the caller's; else, with `fenced`,
        the seq of this client's last create or resume of the actor, if it made one), sent. A refusal
        for the life this client remembered that reaches this call is no late copy (the caller of one
        has gone): unless this client had seen the life it names begin, another caller stopped and
        created the actor meanwhile. So it names the life the refusal says began (`events.errors.
        life_started_in`; as the `min_seq` of a request that has one) and sends the request again,
        once, with the same request id: carried out as before the fence, and a copy of it held past a
        further creation is refused in its turn. If this client had seen that life begin (it created
        or resumed it, or an earlier refusal named it, in another call), the request was meant for
        the life that ended: raised (a stop, tag, revert or update-template does not end or change
        the life this client made since; a review's finding), or, with `into_own` (a resume), sent
        again into this client's latest life. A `life_seq` the caller gave is not sent again: its
        refusal is raised."""
        remembered = body.life_seq is None and fenced
        if remembered:
            body = msgspec.structs.replace(body, life_seq=self._lives.get(actor_id))
        try:
            return await self.request(service, verb, actor_id, body, reply_type)
        except ContractError as refused:
            started = life_started_in(refused) if remembered and body.life_seq is not None else None
            if started is None:
                if remembered and refused.field == "life_seq":  # said by another version: not known where
                    self._lives.pop(actor_id, None)
                raise
            seen = self._lives.get(actor_id, 0) >= started  # this client knew that life already
            remember(self._lives, actor_id, started)  # (a later one, if this client created the actor since)
            if seen and not into_own:
                raise
            again = msgspec.structs.replace(body, life_seq=self._lives[actor_id])
            if "min_seq" in body.__struct_fields__:
                again = msgspec.structs.replace(again, min_seq=max(body.min_seq or 0, started))
            return await self.request(service, verb, actor_id, again, reply_type)

    # --- scheduler ------------------------------------------------------------------------------

    async def resume(
        self, actor_id: str, selectors: dict[str, str] | None = None, request_id: str | None = None,
        min_seq: int | None = None, life_seq: int | None = None,
    ) -> Assignment:
        """Place the actor on a worker (where, at which fidelity, pinned to which runtime). No worker
        able to take it now is RESOURCE_EXHAUSTED: with `field` null, room coming free may place it
        (try later); with a `field` (`resources`, `sandbox_class`, `selectors`, `snapshot.sandbox_runtime`, or
        its architecture), the fleet lacks what that part of the actor needs, and only a worker that
        registers can change it (docs/contract.md, "Placement").

        `life_seq`: a stream sequence of the actor's life this resume is for (what its `create`
        answered, or a resume of it); FAILED_PRECONDITION, field `life_seq`, if the actor was created
        anew after it. Left out, it is the seq of this client's last create or resume of the actor, if
        it made one (`fence_resumes`): a copy of this request held somewhere (a NATS server stopped
        with it in its buffers: a failover test), its caller gone, and decided once the actor was
        stopped and created again, is then refused instead of placing a life nobody resumed.

        Such a refusal that reaches this call is no late copy (the caller of one has gone): this
        client had not seen another caller stop and create the actor. So the client names the life
        the refusal says began (`events.errors.life_started_in`) and sends the request again, once,
        with the same request id: it is placed as it was before the fence (a chaos test's shared
        clients were refused about one resume in ten), and a copy of it held past a further creation
        is refused in its turn. A `life_seq` the caller gives is not sent again: its refusal is raised."""
        body = ResumeActor(selectors=selectors, min_seq=self._min_seq(min_seq),
                           request_id=request_id or new_request_id(), life_seq=life_seq)
        placed = await self._in_life("scheduler", "resume", actor_id, body, Assignment, self.fence_resumes,
                                     into_own=True)
        remember(self._placed, actor_id, placed_under(placed), under_seq)
        remember(self._lives, actor_id, placed.seq)
        return placed

    async def explain(
        self, actor_id: str, selectors: dict[str, str] | None = None, min_seq: int | None = None,
    ) -> Explanation:
        """Where a resume of the actor would go now, and why every other worker was filtered out, without
        placing it (writes nothing): what `warmboot explain` prints. `min_seq`: answered by a replica
        whose fold has reached it (left out, this client's last write's, with `read_your_writes`)."""
        body = ExplainResume(selectors=selectors, min_seq=self._min_seq(min_seq))
        return await self.request("scheduler", "explain", actor_id, body, Explanation)

    async def fragmentation(self, sandbox_class: str | None = None, min_seq: int | None = None) -> Fragmentation:
        """Every class's fragmentation, or `sandbox_class`'s alone. A class the scheduler knows
        nothing of (no worker has registered it, and no actor of it holds a memory snapshot) is
        NOT_FOUND, field `sandbox_class`: the endpoint says so (since 2026-12-06); of a scheduler
        before then, which answered no class, the client says it, as `whatif`'s and `warmboot
        fragmentation --class`'s are (that empty answer read as a class with nothing in it)."""
        body = FragmentationQuery(sandbox_class=sandbox_class, min_seq=self._min_seq(min_seq))
        answer = await self.request("scheduler", "fragmentation", None, body, Fragmentation)
        if sandbox_class is not None and not answer.classes:  # a scheduler before 2026-12-06 answered so
            from services.scheduler.whatif import unknown_class

            raise unknown_class(sandbox_class, None)  # its message names no class: this answer has none
        return answer

    async def runtimes(self, min_seq: int | None = None) -> FleetRuntimes:
        """The runtimes the registered workers offer (drained ones included), with the names they give
        them, and the versions they accept only through an edge (`run` false): what the views label
        runtimes with. A project addition (`scheduler.runtimes`, docs/contract.md); a scheduler of an
        earlier version does not answer."""
        return await self.request("scheduler", "runtimes", None, RuntimesQuery(min_seq=self._min_seq(min_seq)),
                                  FleetRuntimes)

    async def worker(self, worker_id: str, min_seq: int | None = None) -> WorkerDetail:
        """`worker_id` as a scheduler replica's fold has it (once it includes `min_seq`): its node, state,
        labels, capacity, free room, classes, the actors booked on it and the waiting actors whose LOCAL
        image is on its node; NOT_FOUND (field `worker_id`) if it is not registered. What `warmboot worker
        show` prints. A project addition (`scheduler.worker`, docs/contract.md); a scheduler of an earlier
        version does not answer."""
        if not (isinstance(worker_id, str) and ID_RE.match(worker_id)):  # `request` would name `actor_id`
            raise invalid(f"{worker_id!r} is not an id: {ID_WORDS}", "worker_id")
        return await self.request("scheduler", "worker", worker_id, WorkerQuery(min_seq=self._min_seq(min_seq)),
                                  WorkerDetail)

    async def actors(self, query: ActorsQuery) -> ActorPage:
        """A page of the actors of a scheduler replica's fold (stopped ones included), by id, as `warmboot
        actor list` shows them: the next page is `query` with `after` its `next_after`, until that is
        null. Pages are not one snapshot (each is the fold when it is asked: an actor created between
        two pages shows on a later one if its id sorts after the cursor). A project addition
        (`scheduler.actors`, docs/contract.md); a scheduler of an earlier version does not answer."""
        query = given(query, ActorsQuery, "query")
        if query.min_seq is None and self.read_your_writes and self.seq:
            query = msgspec.structs.replace(query, min_seq=self.seq)
        return await self.request("scheduler", "actors", None, query, ActorPage)

    async def workers(self, query: WorkersQuery) -> WorkerPage:
        """A page of the registered workers of a scheduler replica's fold (drained ones included), by id, as
        `warmboot workers` shows them: the next page is `query` with `after` its `next_after`, until that is
        null. Pages are not one snapshot (each is the fold when it is asked: a worker registered between two
        pages shows on a later one if its id sorts after the cursor). A project addition
        (`scheduler.workers`, docs/contract.md); a scheduler of an earlier version does not answer."""
        query = given(query, WorkersQuery, "query")
        if query.min_seq is None and self.read_your_writes and self.seq:
            query = msgspec.structs.replace(query, min_seq=self.seq)
        return await self.request("scheduler", "workers", None, query, WorkerPage)

    async def whatif(self, query: WhatIf) -> WhatIfAnswer:
        """What dropping `query.drop_runtimes` and draining `query.drain_workers` would do to the class's
        actors and snapshots (stranded, downgraded, still restorable from memory), counted from a scheduler
        replica's fold; writes nothing. What `warmboot whatif` prints. `min_seq` as `explain`'s."""
        query = given(query, WhatIf, "query")
        if query.min_seq is None and self.read_your_writes and self.seq:
            query = msgspec.structs.replace(query, min_seq=self.seq)
        return await self.request("scheduler", "whatif", None, query, WhatIfAnswer)
