"""What every warmboot service shares: nats.micro endpoints with contract errors,
request_id idempotency, the request client, and the metrics server.

A service handler is `async (entity_id, request) -> reply Struct`; it raises
`ContractError` to refuse. `add_endpoints` turns that into a micro endpoint that:

- serves a request only if its reply subject is an inbox (CONTRACT section 1,
  "Replies"): `_INBOX.` (which covers a worker's `_INBOX.<worker_id>.`) and not the
  services' own inboxes (`services_inbox`). Any other request is dropped before its
  body is even decoded (nothing parsed, nothing answered, nothing published with the
  services' rights), counted in `warmboot_requests_dropped_total` and logged once per
  offending subject. The check is a string prefix test on the message's reply subject.
  nats.micro's `$SRV.PING/INFO/STATS` handlers get the same check;
- decodes and validates the body at the edge, answers errors exactly as CONTRACT
  section 1 says (the JSON error body, sent through micro's error reply, so its
  `Nats-Service-Error*` headers carry the same) and never leaks a traceback;
- answers UNAVAILABLE (retryable) when a store, bucket or the bus does not answer
  (`is_outage`), INTERNAL with a logged traceback for anything else unexpected;
- answers requests concurrently, and keeps micro's per-endpoint stats honest: a
  request counts, with its time from receipt to its reply being sent, once it is
  answered; every error reply counts in `num_errors`;
- names each endpoint's request and reply schema in its `$SRV.INFO` metadata.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import errno
import gc
import hashlib
import logging
import os
import random
import time
import typing
from dataclasses import dataclass
from functools import partial
from typing import Any, Awaitable, Callable, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from eventsourcing.persistence import IntegrityError, OperationalError
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import NotFoundError
from nats.micro import ServiceConfig
from nats.micro.request import Request
from nats.micro.service import Endpoint, EndpointConfig, Service
from prometheus_client import Counter

from events.codec import decode_reply, decode_request, encode
from events.errors import ContractError, invalid, unavailable
from events.natspy import (DirectDelivery, deliver_core, describe_error, flush_in_order, guard_reads, header_block,
                           publish)
from events.schema import ID_RE, Base, ErrorCode
from events.subjects import bucket_name, service_subject, services_inbox

log = logging.getLogger("warmboot.service")
T = TypeVar("T")

VERSION = "1.0.0"
Handler = Callable[[str | None, Any], Awaitable[Base]]

# Reply subjects a request may name (CONTRACT section 1, "Replies"). A client with a
# custom inbox prefix of its own is served once its prefix is added here (and the
# services' user may publish there: `warmboot nats-config`). `_R_.` is the reply subject
# nats-server gives a request that came through another account's service import (an
# operator's, whose own reply subject is an inbox in its account: docs/security.md); it
# is routed back only while that request is open, under a random token.
REPLY_PREFIXES: tuple[str, ...] = ("_INBOX.", "_R_.")

DROPPED = Counter(
    "warmboot_requests_dropped_total",
    "Requests dropped unprocessed and unanswered: no reply subject, or one that is not an inbox",
    ["service", "endpoint", "reason"],
)


@dataclass(frozen=True)
class EndpointSpec:
    """One request subject: `<prefix>.<service>.<verb>[.<entity_id>]`.

    The reply schema named in `$SRV.INFO` is `reply_type`, else the handler's return
    annotation.
    """

    verb: str
    request_type: type
    handler: Handler
    per_entity: bool = True  # the subject ends with an entity id token
    reply_type: type | None = None

    def metadata(self) -> dict[str, str]:
        reply = self.reply_type
        if reply is None:
            try:
                reply = typing.get_type_hints(self.handler).get("return")
            except Exception:  # an annotation that does not resolve: name no reply type
                reply = None
        meta = {"request": self.request_type.__name__}
        if isinstance(reply, type):
            meta["reply"] = reply.__name__
        return meta


# --- what a request may be answered to ------------------------------------------------


class ReplyGuard:
    """Decides whether a request's reply subject may be answered; counts and logs the rest.

    `allowed(reply)` is the hot path: two prefix tests and four substring tests, no regex,
    no await. A reply subject with a wildcard (`*` or `>`) is refused: an inbox has none,
    and `_INBOX.w-2.>` as a reply would reach every subscription of w-2's inbox that
    matches it by a wildcard of its own. So is one with an empty token (`_INBOX..x`,
    `_INBOX.w-1.`): no subject, so the server refuses the answer, and a worker sending them
    would have the services' user commit permission violations at will, each logged.
    """

    MAX_LOGGED = 1024  # offending subjects remembered (each logged once); then one last line

    def __init__(self, service: str, prefix: str, reply_prefixes: tuple[str, ...] = REPLY_PREFIXES):
        self.service = service
        self.prefixes = reply_prefixes
        self.own = services_inbox(prefix) + "."
        self._logged: set[str] = set()

    def allowed(self, reply: str) -> bool:
        return (reply.startswith(self.prefixes) and not reply.startswith(self.own)
                and "*" not in reply and ">" not in reply and ".." not in reply and reply[-1] != ".")

    def drop(self, endpoint: str, subject: str, reply: str) -> None:
        if not reply:
            reason = "no_reply"
        elif reply.startswith(self.own):
            reason = "services_inbox"
        elif reply.startswith(self.prefixes):
            reason = "wildcard" if "*" in reply or ">" in reply else "empty_token"
        else:
            reason = "not_inbox"
        DROPPED.labels(self.service, endpoint, reason).inc()
        key = reply or subject
        if key in self._logged:
            return
        if len(self._logged) >= self.MAX_LOGGED:
            if len(self._logged) == self.MAX_LOGGED:
                self._logged.add("")  # one more entry: this line is written once
                log.warning("warmboot-%s: more requests with offending reply subjects; no longer logged "
                            "(warmboot_requests_dropped_total counts them)", self.service)
            return
        self._logged.add(key)
        log.warning("warmboot-%s: dropped a request on %s: reply subject %r is %s (CONTRACT section 1, Replies)",
                    self.service, subject[:200], reply[:200],
                    "missing" if not reply else "not an inbox this service may answer")


# --- outages and errors ---------------------------------------------------------------

_OUTAGES = (OperationalError, nats.errors.Error, asyncio.TimeoutError, ConnectionError)
# nats errors that say the caller (this code) used the client wrongly: bugs, not outages
_MISUSE = (
    nats.errors.BadSubjectError, nats.errors.BadHeaderError, nats.errors.MaxPayloadError,
    nats.errors.BadTimeoutError, nats.errors.BadSubscriptionError, nats.errors.InvalidCallbackTypeError,
    nats.errors.NotJSMessageError, nats.errors.MsgAlreadyAckdError, nats.js.errors.InvalidKeyError,
    nats.js.errors.InvalidBucketNameError, nats.js.errors.InvalidObjectNameError,
)


def is_outage(error: BaseException) -> bool:
    """Whether `error` means that a store, a bucket or the bus did not answer (retry later).

    The event store's OperationalError (StoreUnavailableError among them), a time-out,
    no responders, a closed or reconnecting connection, a JetStream API error of the
    5xx kind (503: no quorum, a leader election). A JetStream API error of the 4xx kind
    (the server answered: the request was wrong) and a misuse of the client are bugs.
    """
    if isinstance(error, nats.js.errors.APIError):
        if isinstance(error, (nats.js.errors.BadRequestError, nats.js.errors.NotFoundError)):
            return False
        code = getattr(error, "code", None)  # some subclasses never set it
        return code is None or code >= 500
    return isinstance(error, _OUTAGES) and not isinstance(error, _MISUSE)


def _header_text(text: str) -> str:
    # a header value is one line: a message quoting a caller's input must not add headers
    return text.replace("\r", " ").replace("\n", " ")[:512]


def error_headers(error: ContractError) -> dict[str, str]:
    return {"Nats-Service-Error": _header_text(error.message), "Nats-Service-Error-Code": str(error.status)}


async def respond_error(request: Request, error: ContractError) -> None:
    """The contract's error body, through micro's error reply (its two headers)."""
    await request.respond_error(str(error.status), _header_text(error.message), data=encode(error.reply()))


INTERNAL_MESSAGE = "internal error; the service log has the details"


def wrap(spec: EndpointSpec, service: str) -> Callable[[Request], Awaitable[ContractError | None]]:
    """The request handler of one endpoint: the error it answered, or None for a reply."""
    outages = _OutageLog(f"{service}.{spec.verb}")

    async def handle(request: Request) -> ContractError | None:
        try:
            entity_id = None
            if spec.per_entity:
                entity_id = request.subject.rsplit(".", 1)[-1]
                if not ID_RE.match(entity_id):
                    raise invalid(f"subject token {entity_id!r} is not a valid id", "subject")
            body = decode_request(spec.request_type, request.data)
            data = encode(await spec.handler(entity_id, body))
        except ContractError as error:
            await respond_error(request, error)
            return error
        except asyncio.CancelledError:
            raise
        except Exception as error:
            if is_outage(error):
                outages.seen(error)
                refused = unavailable(f"the event log, a bucket or the bus did not answer "
                                      f"({type(error).__name__}); try again")
            else:  # a bug: log it here, tell the caller no more than that
                log.exception("%s.%s failed on %s", service, spec.verb, request.subject)
                refused = ContractError(ErrorCode.INTERNAL, INTERNAL_MESSAGE)
            await respond_error(request, refused)
            return refused
        await request.respond(data)
        return None

    return handle


class _OutageLog:
    """One warning per endpoint and OUTAGE_LOG_S while an outage lasts, with a count."""

    OUTAGE_LOG_S = 10.0

    def __init__(self, where: str):
        self.where = where
        self.next_at = 0.0
        self.unlogged = 0

    def seen(self, error: BaseException) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.unlogged += 1
            return
        more = f" (and {self.unlogged} more since the last line)" if self.unlogged else ""
        log.warning("%s: answered UNAVAILABLE: %r%s", self.where, error, more)
        self.next_at, self.unlogged = now + self.OUTAGE_LOG_S, 0


# --- the micro service ------------------------------------------------------------------

MAX_CONCURRENT_REQUESTS = 256
# A message with a larger header block is dropped where the services' connection reads it,
# before anything parses it (the contract's requests need none; the log's events carry < 1 kB):
# a worker's 1 MB header blocks held the read loop for 0.1 s each.
MAX_HEADER_BYTES = 16 * 1024


class ServiceRequest(Request):
    """nats.micro's request, answered through `events.natspy.publish` (an error's two headers
    encoded by `header_block`): at thousands of heartbeats a second nats-py's publish is a
    measurable part of an answer. Every answer of a `ConcurrentEndpoint` goes through its
    `respond`, `respond_error`'s too."""

    async def respond(self, data: bytes = b"", headers: dict[str, str] | None = None) -> None:
        if not self._msg.reply:
            raise ValueError("no reply subject set")
        await publish(self._msg._client, self._msg.reply, data, headers=header_block(headers) if headers else b"")


class ConcurrentEndpoint(Endpoint):
    """A micro endpoint that serves each request as a task, with stats as `$SRV.STATS` means them.

    nats.micro awaits each handler before it reads the endpoint's next message and
    times that await, so a handler that spawned a task would be counted as done in
    microseconds and never as an error. Here a request is counted when its reply
    (or error reply) is sent, with the time since it was received, waiting for a
    slot included.
    """

    def __init__(self, service: "MicroService", config: EndpointConfig):
        super().__init__(service, config)
        self._micro = service
        self.slots = service.endpoint_slots[config.name] = Slots(service.max_concurrent)  # its own (see MicroService)
        self._direct: DirectDelivery | None = None

    async def _start(self) -> None:
        await super()._start()
        # While a slot is free, a request goes from the connection's read loop straight to
        # its task (`deliver_core`); when none is, nats-py's path holds it in the
        # subscription's queue, and `_handle_request` waits for a slot.
        self._direct = deliver_core(self._service._client, self._subscription, self._admit,
                                    ready=self.slots.free_now)

    async def _stop(self) -> None:
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        await super()._stop()

    def _admit(self, msg: Msg) -> None:
        """A request delivered directly, so while a slot is free: it takes the slot now."""
        if self._micro.admits(msg, self._name):
            if not self.slots.take_now():
                raise RuntimeError("a request was delivered directly with no slot free")  # logged, dropped
            self._spawn(msg, time.perf_counter_ns())

    async def _handle_request(self, msg: Msg) -> None:
        if self._micro.admits(msg, self._name):
            start = time.perf_counter_ns()
            await self.slots.take()
            self._spawn(msg, start)

    def _spawn(self, msg: Msg, start: int) -> None:
        """Serve `msg` (its slot taken) in a task of its own; the slot is given back when it ends."""
        task = asyncio.create_task(self._serve(ServiceRequest(msg), start))
        self._micro.track(task, self._give_back)

    def _give_back(self) -> None:
        self.slots.give()

    async def _serve(self, request: Request, start: int) -> None:
        error = None
        try:
            error = await self._handler(request)
        except asyncio.CancelledError:
            raise
        except Exception as failure:  # the reply itself could not be sent (the connection went)
            log.debug("could not answer %s: %r", request.subject, failure)
            error = failure
        self._num_requests += 1
        if error is not None:
            self._num_errors += 1
            self._last_error = last_error(error)
        self._processing_time += time.perf_counter_ns() - start
        self._average_processing_time = self._processing_time // self._num_requests


def last_error(error: BaseException) -> str:
    """What `$SRV.STATS` shows of an endpoint's last error: `<status>:<CODE>`. Never its message
    nor its field: they quote the caller's request (ids, nodes, tags, a selector's key), and STATS
    answers anyone allowed on `$SRV.>` (every client and operator), not the caller."""
    if isinstance(error, ContractError):
        return f"{error.status}:{error.code.value}"
    return type(error).__name__


class Slots:
    """At most `size` holders at once. `take_now` takes a free slot without waiting (False when
    none is free, or someone waits for one); `take` waits its turn, first come first served;
    `give` hands a slot to the first waiter, or frees it. (`asyncio.Semaphore` has no taking
    without an await, which a request delivered from the read loop needs.)"""

    def __init__(self, size: int):
        self.free = size
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    def free_now(self) -> bool:
        return self.free > 0 and not self._waiting

    def take_now(self) -> bool:
        if self.free_now():
            self.free -= 1
            return True
        return False

    async def take(self) -> None:
        if self.take_now():
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.give()  # handed a slot as it was cancelled: to the next
            else:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(turn)
            raise

    def give(self) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.free += 1


class MicroService(Service):
    """A nats.micro service whose endpoints answer requests concurrently and only to inboxes.

    At most `max_concurrent` requests of each endpoint are served at once; past that the
    endpoint's subscription waits. Each endpoint has slots of its own, so that a backlog of
    one kind of request never holds up another: a storm of registrations (every agent of a
    fleet registering again when NATS comes back) takes nothing from the heartbeats that
    keep those workers alive. `stop` lets the ones in flight finish.
    """

    def __init__(self, nc: NATS, config: ServiceConfig, max_concurrent: int = MAX_CONCURRENT_REQUESTS,
                 guard: ReplyGuard | None = None):
        super().__init__(nc, config)
        self.guard = guard or ReplyGuard(config.name, (config.metadata or {}).get("prefix", ""))
        self.max_concurrent = max_concurrent
        self.endpoint_slots: dict[str, Slots] = {}  # by endpoint name
        self._tasks: set[asyncio.Task[None]] = set()

    def track(self, task: asyncio.Task[None], then: Callable[[], None]) -> None:
        """Keep `task` (a request being served) until it ends, for `stop` to wait for; `then()`
        when it ends (one done-callback for both: each is a step of the loop per request)."""
        self._tasks.add(task)

        def ended(task: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            then()

        task.add_done_callback(ended)

    async def add_endpoint(self, config: EndpointConfig | None = None, **kwargs: Any) -> None:
        config = EndpointConfig(**kwargs) if config is None else config
        if config.queue_group is None:
            config = EndpointConfig(name=config.name, handler=config.handler, subject=config.subject,
                                    metadata=config.metadata, queue_group=self._queue_group)
        endpoint = ConcurrentEndpoint(self, config)
        await endpoint._start()
        self._endpoints.append(endpoint)

    # nats.micro's discovery handlers answer any reply subject too: the same check. They answer
    # with `msg.respond`, which sends the request's own headers back: a caller's header block
    # as large as the server allows made the answer larger than that, and the server then cut
    # the services' connection (nats-py closes it for good on that error); a header name nats-py
    # will not send logged a traceback per request. So they answer with no headers.
    async def _handle_ping_request(self, msg: Msg) -> None:
        if self._answerable(msg, "$SRV.PING"):
            await super()._handle_ping_request(msg)

    async def _handle_info_request(self, msg: Msg) -> None:
        if self._answerable(msg, "$SRV.INFO"):
            await super()._handle_info_request(msg)

    async def _handle_stats_request(self, msg: Msg) -> None:
        if self._answerable(msg, "$SRV.STATS"):
            await super()._handle_stats_request(msg)

    def admits(self, msg: Msg, endpoint: str) -> bool:
        """Whether `msg` may be served: its reply subject is one the services answer
        (`ReplyGuard`); otherwise it is dropped, counted and logged."""
        reply = msg.reply
        if reply and self.guard.allowed(reply):
            return True
        self.guard.drop(endpoint, msg.subject, reply)
        return False

    def _answerable(self, msg: Msg, endpoint: str) -> bool:
        if not self.admits(msg, endpoint):
            return False
        msg.headers = None  # not echoed in the answer
        return True

    async def stop(self, drain_s: float = 10.0) -> None:
        await super().stop()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=drain_s)


async def add_endpoints(
    nc: NATS, prefix: str, service: str, description: str, specs: list[EndpointSpec],
    max_concurrent: int = MAX_CONCURRENT_REQUESTS, reply_prefixes: tuple[str, ...] = REPLY_PREFIXES,
) -> MicroService:
    """Start the micro service `warmboot-<service>` in the queue group of that name.

    Its metadata names the deployment's subject prefix (`prefix`); each endpoint's,
    its request and reply schema (`request`, `reply`: names in `warmboot schema`).
    """
    guard_reads(nc, max_header_bytes=MAX_HEADER_BYTES)
    name = f"warmboot-{service}"
    svc = MicroService(
        nc,
        ServiceConfig(
            name=name,
            version=VERSION,
            description=description,
            queue_group=name,
            metadata={"prefix": prefix},
        ),
        max_concurrent,
        ReplyGuard(service, prefix, reply_prefixes),
    )
    await svc.start()
    for spec in specs:
        subject = service_subject(prefix, service, spec.verb, "*" if spec.per_entity else None)
        await svc.add_endpoint(name=spec.verb, subject=subject, handler=wrap(spec, service),
                               metadata=spec.metadata())
    await flush_in_order(nc)  # the server has the subscriptions: requests sent after this are served
    return svc


# --- idempotency ------------------------------------------------------------------


START_WITHIN_S = 60.0  # how long a service's start waits for JetStream to answer its bucket and consumer calls


_UNANSWERED = (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError,
               nats.errors.ConnectionReconnectingError, nats.js.errors.NoStreamResponseError)


def _unanswered(error: BaseException) -> bool:
    """JetStream did not answer (a time-out, nobody listening, the connection between two
    servers), or answered that it cannot yet (a 5xx: no meta leader, no quorum)."""
    if isinstance(error, nats.js.errors.APIError):
        code = getattr(error, "code", None)
        return code is not None and code >= 500
    return isinstance(error, _UNANSWERED)


async def until_answered(call: Callable[[], Awaitable[T]], what: str, within: float = START_WITHIN_S) -> T:
    """`call()`, a JetStream API request made at a service's start (a bucket, a consumer), made
    again while JetStream cannot answer it (`_unanswered`: a cluster that has just formed, a
    meta leader election, a time-out), after 0.1 s, doubling up to 2 s; past `within`, the
    last failure. Any other failure (a configuration the server refuses, a connection closed
    for good) is raised at once. The calls it makes are idempotent: a bucket or a durable
    consumer that the lost answer had created is created again with the same configuration,
    which is no change; an ordered consumer (the folds') is made anew, and the one a lost
    answer made, which nobody listens to, is deleted by the server once it is inactive."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    pause = 0.1
    while True:
        try:
            return await call()
        except Exception as error:
            if not _unanswered(error) or loop.time() + pause > deadline:
                raise
            log.info("%s: JetStream did not answer (%s); asking again in %.1fs", what, type(error).__name__, pause)
        await asyncio.sleep(pause)
        pause = min(pause * 2, 2.0)


# --- the incarnation of the event stream --------------------------------------------------------

INCARNATION_CHECK_S = 5.0  # how often a service's StreamWatch asks which stream has the name


def stream_identity(info: Any) -> tuple[str, int]:
    """(creation time, last sequence) of the stream whose info (nats-py's StreamInfo) this is:
    the creation time names its incarnation (`Projection.stream_created`)."""
    return (info.created.isoformat() if info.created is not None else ""), info.state.last_seq


async def stream_created(nc: NATS, stream: str) -> str:
    """The incarnation (`stream_identity`) of the stream as its leader has it now, asked until
    answered as at a service's start (`until_answered`)."""
    info = await until_answered(lambda: leaders_stream_info(nc.jetstream(), stream), f"the stream {stream}")
    return stream_identity(info)[0]


def answered_by_leader(info: Any) -> bool:
    """Whether a STREAM.INFO answer (nats-py's StreamInfo, or a struct with the same
    `cluster.leader`) is the stream leader's. In a cluster, a stream group without a leader (a
    lost quorum; the moment of an election) has every member answer from its own state, which
    may lack the last events the group stored and acknowledged (nats-server's
    `jsStreamInfoRequest`; such an answer names no leader). So may a member the group prefers,
    within 10 s of its raft node's making (a restart: it may be catching up), while another is
    leader: its answer names that leader among the replicas, where the answering server never
    lists itself. A single server's answer has no `cluster`, an R1 stream's in a cluster names the
    server itself and no replicas."""
    cluster = getattr(info, "cluster", None)
    if cluster is None:
        return True
    return bool(cluster.leader) and all(peer.name != cluster.leader for peer in cluster.replicas or ())


async def leaders_stream_info(js: Any, stream: str) -> Any:
    """The stream's info as its leader has it: where the log ends for a barrier (a fold's, a
    read's) is never a member's own word. A leaderless member's answer (`answered_by_leader`) is
    raised as the 503 the server gives while it cannot tell (ServiceUnavailableError), which
    `until_answered` and every caller's retry already take for an election."""
    info = await js.stream_info(stream)
    if not answered_by_leader(info):
        raise nats.js.errors.ServiceUnavailableError(
            code=503, description=f"the stream {stream} has no leader: a member's own state is not where its log ends")
    return info


def replaced_by(stream: str, folded: str | None, created: str) -> str | None:
    """Why the stream `stream`, created at `created` as it is now, is not the log a process read as
    the incarnation created at `folded` (a projection's `Projection.stream_created`, a service's
    `StreamWatch.created`); None if it is."""
    if folded is None:
        return f"the projection does not say which incarnation of the event stream {stream} it is a fold of"
    if created != folded:
        return (f"the event stream {stream} was made again (created {created}; this process read the one "
                f"created {folded})")
    return None


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_NO_MESSAGE = 10037  # JetStream's "no message found" (the stream is there)


def micros(when: datetime.datetime) -> int:
    """A stream time as nats-py reads it (to the microsecond), in microseconds since the epoch."""
    return (when - _EPOCH) // datetime.timedelta(microseconds=1)


async def continuity(nc: NATS, stream: str, seq: int, at_us: int) -> str | None:
    """Why the message at `seq` of `stream` is not the one a process read there, stored at `at_us`
    (microseconds since the epoch); None if it is, or if that cannot be told (`seq` or `at_us` 0).
    A log restored from a copy of the server's store, or rolled back, keeps the stream's creation
    time (`stream_identity`): what tells it is that the message at a sequence read before is
    another one now (stored at another time), or none. Read through the stream leader."""
    if not seq or not at_us:
        return None
    js = nc.jetstream()
    try:
        message = await js.get_msg(stream, seq)
    except NotFoundError as error:
        if getattr(error, "err_code", None) != _NO_MESSAGE:
            raise  # the stream itself is not there: the caller asks again
        last = (await leaders_stream_info(js, stream)).state.last_seq
        if last >= seq:
            return None  # a hole (an operator deleted that message: docs/contract.md), not another log
        return (f"the event stream {stream} ends at sequence {last}, before sequence {seq}, which this process "
                f"read: restored or rolled back")
    if message.time is None or micros(message.time) != at_us:
        return (f"the event stream {stream} holds another message at sequence {seq} than this process read "
                f"(stored {message.time.isoformat() if message.time else '?'}): restored or rolled back")
    return None


class StreamWatch:
    """Fails a service whose event stream is deleted and made again, or restored or rolled back,
    while it runs (`failed`, done with the reason; `warmboot.runner.until_stopped` then stops the
    process, status 1): what the service folded of the log (the registry's roster, the
    snapshotter's placements and positions) is of a log that no longer exists. Every `every`
    seconds it asks the stream's info (its creation time: `replaced_by`) and whether the last
    message it saw at the previous look is still there, stored when it was (`continuity`); a
    stream that does not exist, or a JetStream that does not answer, is asked again at the next
    look. The scheduler's fold also looks at its consumer's re-creation (`services.scheduler.fold`)."""

    def __init__(self, nc: NATS, stream: str, every: float = INCARNATION_CHECK_S,
                 read: Callable[[], tuple[int, int]] | None = None) -> None:
        self.nc, self.stream, self.every = nc, stream, every
        self.created: str | None = None
        self.mark: tuple[int, int] = (0, 0)  # (sequence, stored at in µs) of the last message at the last look
        # The service's own mark, if it has one (the registry's roster fold: the last message it folded),
        # checked too: a copy put back between two looks may still hold the watch's mark, not that one.
        self.read = read
        self.failed: asyncio.Future[str] | None = None
        self._task: asyncio.Task[None] | None = None
        self.lost: str | None = None  # why the stream is not the log read, once a look found it (`confirmed`)
        self._confirmed: int | None = None  # the session of the connection the log was confirmed in
        self._confirming: tuple[int, asyncio.Future[bool]] | None = None  # a look under way for a session

    async def start(self) -> "StreamWatch":
        """The incarnation of now is the service's (call it right after the service's store has made
        or found the stream)."""
        self.failed = asyncio.get_running_loop().create_future()
        info = await until_answered(lambda: leaders_stream_info(self.nc.jetstream(), self.stream),
                                    f"the stream {self.stream}")
        self.created = stream_identity(info)[0]
        self.mark = await until_answered(lambda: self._last(info.state.last_seq), f"the stream {self.stream}")
        self._confirmed = self.nc.stats["reconnects"]
        self._task = asyncio.create_task(self._watch(), name=f"stream-watch-{self.stream}")
        return self

    async def _last(self, seq: int) -> tuple[int, int]:
        """(seq, its stored time in µs) of the message at `seq`, the stream's last; (0, 0) for none."""
        if not seq:
            return 0, 0
        try:
            message = await self.nc.jetstream().get_msg(self.stream, seq)
        except NotFoundError as error:
            if getattr(error, "err_code", None) == _NO_MESSAGE:
                return 0, 0  # removed meanwhile: nothing to hold on to this time
            raise
        return seq, micros(message.time) if message.time is not None else 0

    async def _watch(self) -> None:
        assert self.failed is not None
        while True:
            await asyncio.sleep(self.every)  # a period: nothing tells a process that a stream was deleted
            try:
                why = await self.look()
            except Exception as error:  # gone and not made again yet, an election, an outage: next look
                log.debug("the stream %s could not be looked at (%s)", self.stream, type(error).__name__)
                continue
            if why is not None:
                self.lost = why
                log.error("%s: stopping; start the service again to read the new stream", why)
                if not self.failed.done():
                    self.failed.set_result(why)
                return

    async def look(self) -> str | None:
        """One look: why the stream is not the log the service read (None if it is: then the
        stream's last message is the next look's mark). Raises what asking raised."""
        info = await leaders_stream_info(self.nc.jetstream(), self.stream)
        why = (replaced_by(self.stream, self.created, stream_identity(info)[0])
               or await continuity(self.nc, self.stream, *self.mark)
               or (await continuity(self.nc, self.stream, *self.read()) if self.read is not None else None))
        if why is None:
            self.mark = await self._last(info.state.last_seq)
        return why

    async def confirmed(self) -> bool:
        """Whether the stream is still the log the service read, as looked at (`look`) once in the
        present session of its connection (nats-py counts each reconnection), one look shared by the
        callers meanwhile: a single server that crashed and came back may have lost the tail it had
        not synced, which the service folded, and the next look of the watch is up to `every`
        seconds away. False while no session is up, while a look cannot be made (the next call
        looks again), and once a look found another log (`lost`; the watch fails at its next look:
        the service goes on until then, its caller not trusting what it folded)."""
        if self.lost is not None or not self.nc.is_connected:
            return False
        session = self.nc.stats["reconnects"]
        if session == self._confirmed:
            return True
        if self._confirming is None or self._confirming[0] != session:
            self._confirming = (session, asyncio.ensure_future(self._confirm(session)))
        return await asyncio.shield(self._confirming[1])

    async def _confirm(self, session: int) -> bool:
        try:
            why = await self.look()
        except Exception as error:  # not answered: the next call looks again
            log.debug("the stream %s could not be looked at (%s)", self.stream, type(error).__name__)
            return False
        finally:
            if self._confirming is not None and self._confirming[0] == session:
                self._confirming = None
        if why is not None:
            if self.lost is None:
                log.error("%s: what this process folded is not trusted; it stops at the watch's next look", why)
            self.lost = why
            return False
        self._confirmed = session
        return True

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class ReplyCache:
    """The first answer to each `request_id`, shared by every replica (JetStream KV).

    It is the long memory of idempotency only: services answer a repeated request
    from the entity's history first (every event carries the `request_id` that caused
    it), and look here only for what the history they keep no longer holds (the
    scheduler keeps an actor's last few placements). An entry is written before the
    write that makes the kept history forget it (the scheduler's: before the placement
    that pushes an older one out of the actor's recent ones), so a crash between the
    two loses nothing: at worst the entry is there and the placement is not, and the
    entry only says what the log already holds.
    """

    def __init__(self, nc: NATS, prefix: str, ttl_s: float = 3600.0):
        self.nc = nc
        self.bucket = bucket_name(prefix, "replies")
        self.ttl_s = ttl_s
        self.kv = None

    async def start(self) -> "ReplyCache":
        js = self.nc.jetstream()
        config = KeyValueConfig(bucket=self.bucket, ttl=self.ttl_s, storage=StorageType.FILE, history=1,
                                replicas=stream_replicas())
        self.kv = await until_answered(lambda: js.create_key_value(config), f"the bucket {self.bucket}")
        return self

    @staticmethod
    def key(scope: str, request_id: str) -> str:
        return f"{scope}.{hashlib.sha256(request_id.encode()).hexdigest()[:40]}"

    async def get(self, key: str) -> bytes | None:
        """The entry under `key`, as the bucket's stream leader has it: an entry is read where
        its absence would be decided on (a retry placed or decided again), and a direct get
        may be answered by a replica that has not caught up with a put a moment ago."""
        if self.kv is None:
            raise unavailable("the reply cache is not open")
        try:
            msg = await self.nc.jetstream().get_msg(f"KV_{self.bucket}", subject=f"$KV.{self.bucket}.{key}")
        except NotFoundError as error:
            if getattr(error, "err_code", None) == _NO_MESSAGE:
                return None
            # no bucket (deleted, being made again): nothing says the request was not answered
            raise unavailable(f"the reply cache cannot be read ({describe_error(error)}); try again") from None
        if msg.headers and msg.headers.get("KV-Operation") in ("DEL", "PURGE"):
            return None
        return msg.data or None

    async def put(self, key: str, data: bytes) -> None:
        """Store `data` under `key`; returns once the bucket has it, else raises UNAVAILABLE."""
        if self.kv is None:
            raise unavailable("the reply cache is not open")
        try:
            await self.kv.put(key, data)
        except Exception as error:
            raise unavailable(f"the reply cache did not take an entry ({type(error).__name__}: {error}); "
                              "try again") from None


class Kept(msgspec.Struct, frozen=True):
    """The answer of a request that wrote nothing, as `NoWriteAnswers` keeps it: the verb, the
    version of the entity's history it stood on, the reply's JSON, and the incarnation of the
    event stream that history is in (its creation time, `stream_identity`; None in an entry an
    earlier version kept, which an older replica, ignoring the field, still reads)."""

    verb: str
    version: int
    reply: msgspec.Raw
    stream: str | None = None


def _cache_failed(error: Exception) -> ContractError:
    return unavailable(f"the reply cache did not answer ({type(error).__name__}: {error}); try again")


class NoWriteAnswers:
    """The first answers of requests that wrote nothing: a registration that changed nothing
    (UNCHANGED), a drain of a drained worker, an update to the template an actor has.

    A repeated request is answered from the entity's history, where its events name it
    (`WireAggregate.prior`); one that wrote nothing left no event to answer from, so its
    retry, or a copy a stalled replica decides late, would be decided again on whatever
    the entity is by then (a registration's stale copy undoing a later runtime change).
    So its answer is kept in the reply bucket, under the entity and the request id, before
    it is given, and looked up, as the stream leader has it, before a request with an id
    the history does not answer is decided: after the entity was read, so a change the
    entity shows came after the kept answer was there to be read. It is honoured within
    the entity's current life only (`Kept.version`), and for the verb it was kept for
    (another verb reusing the id is refused, as `WireAggregate.prior` refuses one). The bucket
    outlives an event stream deleted and made again, whose versions start over: an answer, or a
    refusal's mark, kept on another incarnation of the stream (`created`, the stream's creation
    time) says nothing of this one and is not read (an audit, 2026-12-04: an UNCHANGED kept on the
    old stream answered a registration with the same id on the new one, whose worker the log then
    held on another runtime than it runs). A command
    on the service's loop (`run_command_async`) awaits `recall_async` and `keep_async`; one on
    a thread of its own (`run_command`) calls `recall` and `keep`, which wait for the service's
    loop to run those: either way the reads and writes are on the service's connection.
    """

    def __init__(self, replies: ReplyCache, scope: str, loop: asyncio.AbstractEventLoop, created: str,
                 timeout: float = 5.0):
        self.replies = replies
        self.scope = scope  # e.g. "registry": the service whose entities these are
        self.loop = loop
        self.created = created  # the incarnation of the event stream the service reads (`stream_identity`)
        self.timeout = timeout
        self._refused = b"refused " + created.encode()

    def _key(self, entity_id: str, request_id: str) -> str:
        return self.replies.key(f"{self.scope}.{entity_id}", request_id)

    def _run(self, coroutine: Awaitable[T]) -> T:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:  # it would wait for itself
            coroutine.close()  # type: ignore[attr-defined]
            raise RuntimeError("NoWriteAnswers is called from a command's thread (run_command), not from its loop")
        try:
            return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(self.timeout + 1.0)  # its own first
        except ContractError:
            raise
        except Exception as error:
            raise _cache_failed(error) from None

    async def _answered(self, coroutine: Awaitable[T]) -> T:
        """A read or write of the reply cache, on the service's loop: UNAVAILABLE if it fails."""
        try:
            return await asyncio.wait_for(coroutine, self.timeout)
        except ContractError:
            raise
        except Exception as error:
            raise _cache_failed(error) from None

    def recall(self, aggregate: Any, verb: str, request_id: str | None, reply_type: type[T]) -> tuple[T, int] | None:
        """`recall_async`, from a command's thread (which waits for the loop only to read)."""
        if self._nothing_kept(aggregate, verb, request_id):
            return None
        return self._run(self.recall_async(aggregate, verb, request_id, reply_type))

    def keep(self, aggregate: Any, verb: str, request_id: str | None, reply: Base) -> None:
        """`keep_async`, from a command's thread (which waits for the loop only to write)."""
        if request_id is not None:
            self._run(self.keep_async(aggregate, verb, request_id, reply))

    @staticmethod
    def _nothing_kept(aggregate: Any, verb: str, request_id: str | None) -> bool:
        # no history has answered anything, and a new life is answered by none
        return request_id is None or not aggregate.version or aggregate.request_starts_life(verb)

    async def recall_async(self, aggregate: Any, verb: str, request_id: str | None,
                           reply_type: type[T]) -> tuple[T, int] | None:
        """The kept answer (reply, version) of an earlier `verb` request with `request_id` in the
        aggregate's current life, if any (none when this request starts a new one);
        FAILED_PRECONDITION if one was kept for another verb."""
        if self._nothing_kept(aggregate, verb, request_id):
            return None
        kept = self._of_this_stream(await self._answered(self.replies.get(self._key(aggregate.entity_id, request_id))))
        if kept is None:
            return None
        if kept.version < aggregate.life_start:  # an earlier life's (request ids are scoped to one)
            aggregate.refuse_from_an_earlier_life(verb, request_id)
            return None
        if kept.version > aggregate.version:
            return None
        if kept.verb != verb:
            raise aggregate.reused(request_id, f"a {kept.verb} that changed nothing")
        try:
            return msgspec.json.decode(kept.reply, type=reply_type), kept.version
        except msgspec.DecodeError as error:  # a ValidationError is one: a newer version's answer
            raise unavailable(f"the answer kept for request_id {request_id!r} on {aggregate.KIND} "
                              f"{aggregate.entity_id!r} is not one this version reads ({error}): a newer "
                              "version may read it") from None

    async def was_answered_async(self, aggregate: Any, request_id: str) -> bool:
        """Whether `request_id` was answered for the aggregate, in any life, with an answer kept here or a
        refusal marked (`mark_refused_async`), as the stream leader has them."""
        if self._of_this_stream(await self._answered(self.replies.get(self._key(aggregate.entity_id, request_id)))):
            return True
        return await self.refusal_marked_async(aggregate, request_id)

    async def refusal_marked_async(self, aggregate: Any, request_id: str) -> bool:
        """Whether `request_id` is marked refused for the aggregate (`mark_refused_async`) on this
        incarnation of the stream, as the stream leader has it."""
        mark = await self._answered(self.replies.get(self._refused_key(aggregate.entity_id, request_id)))
        return mark in (self._refused, b"refused")  # the latter: marked by an earlier version, on no stream named

    async def mark_refused_async(self, aggregate: Any, request_id: str) -> None:
        """Mark `request_id` refused for the aggregate (a refusal writes no event: this says it was sent)."""
        await self._answered(self.replies.put(self._refused_key(aggregate.entity_id, request_id), self._refused))

    def _of_this_stream(self, data: bytes | None) -> Kept | None:
        """The kept answer `data` holds, if it is of the stream's incarnation the service reads (or
        of none named: kept by an earlier version); None otherwise, or for no entry."""
        if not data:
            return None
        try:
            kept = msgspec.json.decode(data, type=Kept)
        except msgspec.DecodeError:
            return None
        return kept if kept.stream in (None, self.created) else None

    def _refused_key(self, entity_id: str, request_id: str) -> str:
        return self.replies.key(f"{self.scope}-refused.{entity_id}", request_id)

    async def keep_async(self, aggregate: Any, verb: str, request_id: str | None, reply: Base) -> None:
        """Keep the answer of a request that wrote nothing, before it is given (UNAVAILABLE if the
        bucket does not take it: the request wrote nothing, so its retry is safe)."""
        if request_id is None:
            return
        data = encode(Kept(verb=verb, version=aggregate.version, reply=msgspec.Raw(encode(reply)), stream=self.created))
        await self._answered(self.replies.put(self._key(aggregate.entity_id, request_id), data))


async def last_seq_on(js: Any, stream: str, subject: str) -> int:
    """The stream sequence of the last message on `subject` (as the stream leader has it), 0 if none."""
    try:
        return (await js.get_msg(stream, subject=subject)).seq
    except NotFoundError:
        return 0


async def stored_at(js: Any, stream: str, seq: int) -> Msg:
    """The message stored at `seq`, known to be in the stream (a reply's sequence, the
    log's or the reply cache's word for it). A direct get is answered by any replica, and
    one that has not caught up yet says "no message"; so that answer is asked again of the
    stream leader. When the leader does not have it either, or nobody answers, the log is
    not readable now: UNAVAILABLE (retry), never INTERNAL."""
    try:
        return await js.get_msg(stream, seq=seq, direct=True)
    except NotFoundError:
        pass  # a replica behind the leader answered
    try:
        return await js.get_msg(stream, seq=seq)  # STREAM.MSG.GET: answered by the leader
    except NotFoundError:
        raise unavailable(f"message {seq} of {stream} is not readable yet; try again") from None


# A serving process's collector (`tune_gc`). Python's default collects the youngest generation
# every 700 net allocations: at thousands of requests a second in flight, a request's objects
# (its message, task, futures) are still alive at a collection, survive two of them, and count
# toward a full collection, which then walks the whole heap (20 to 30 ms at 10,000 workers in
# the registry, about three times in two seconds of heartbeats). Collected every 50,000, they
# are mostly freed by their reference counts first, and a full collection is much rarer
# (bench/registry.py: heartbeat p99 36 to 42 ms against 51 to 61, README).
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """For a process that serves (`warmboot serve`, `warmboot up`, the benches' serving
    processes), once its services have started: what the start loaded (modules, the state
    folded from the log) is moved out of the collector's sight (`gc.freeze`: still freed by
    reference counting, but a reference cycle among those objects that becomes garbage later
    is never collected; they are modules, connections and state that live as long as the
    process), and the thresholds become GC_THRESHOLDS."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


# The event loop a serving process runs on (`run_serving`): uvloop, libuv's loop, unless the
# environment says WARMBOOT_EVENT_LOOP=asyncio. What a wake-up of the loop costs is most of what
# a small request costs a service (docs/scaling.md, "The event loop"), and uvloop's is smaller.
EVENT_LOOP_ENV = "WARMBOOT_EVENT_LOOP"
EVENT_LOOPS = ("uvloop", "asyncio")


def serving_loop(choice: str | None = None) -> tuple[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The event loop `run_serving` runs on: its name, and the factory that makes one.

    `choice` (else WARMBOOT_EVENT_LOOP) names it: `uvloop`, the default, or `asyncio`; any other
    value is a ValueError naming the variable. uvloop not installed (a platform without its
    wheels): asyncio's loop, unless uvloop was asked for by name."""
    named = choice if choice is not None else os.environ.get(EVENT_LOOP_ENV, "")
    if named not in ("", *EVENT_LOOPS):
        raise ValueError(f"{EVENT_LOOP_ENV}={named!r}: expected one of {', '.join(EVENT_LOOPS)}")
    if named != "asyncio":
        try:
            import uvloop
        except ImportError:
            if named:
                raise ValueError(f"{EVENT_LOOP_ENV}=uvloop, but uvloop is not installed") from None
        else:
            return "uvloop", uvloop.new_event_loop
    return "asyncio", asyncio.new_event_loop


def run_serving(main: Callable[[], Awaitable[T]], loop: str | None = None) -> T:
    """`asyncio.run(main())` on the serving event loop (`serving_loop(loop)`): what `warmboot
    serve`, `warmboot up` and the benches' serving processes run on. Threads that make loops of
    their own (the event store's link for synchronous callers) keep asyncio's. Unlike
    `asyncio.run`, the loop is not made the thread's current loop outside `main`."""
    name, factory = serving_loop(loop)  # a bad choice is refused before anything starts
    log.info("event loop: %s", name)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


def stream_replicas() -> int:
    """Replicas of the streams and buckets a service creates: WARMBOOT_STREAM_REPLICAS, else 1."""
    return int(os.environ.get("WARMBOOT_STREAM_REPLICAS") or 1)


def store_env(nats_url: str, prefix: str, replicas: int | None = None) -> dict[str, str]:
    """The eventsourcing environment that selects the JetStream event store for a deployment.

    Without `replicas`, the stream's replica count comes from the process environment
    (WARMBOOT_STREAM_REPLICAS, which `warmboot serve --replicas` sets), else 1. So do
    credentials not in the URL (NATS_NKEY_SEED, NATS_USER, ...: events.jetstream).
    """
    env = {"PERSISTENCE_MODULE": "events.jetstream", "NATS_URL": nats_url, "WARMBOOT_PREFIX": prefix,
           "NATS_INBOX_PREFIX": services_inbox(prefix)}  # the services' inboxes (docs/security.md)
    if replicas is not None:
        env["WARMBOOT_STREAM_REPLICAS"] = str(replicas)
    return env


# What a command refuses on its entity's state, which a read behind the stream leader can show
# wrongly (`run_command_async`'s `recheck`).
STATE_REFUSALS = frozenset({ErrorCode.FAILED_PRECONDITION, ErrorCode.NOT_FOUND, ErrorCode.ALREADY_EXISTS})


# `run_command_async`'s recheck of a refusal: called before each decision, it notes what this
# process has read of the entities the decision reads (`recorder.seen`), and returns the check
# to await if the decision refuses on their state: whether the stream leader has their history
# past that (`recorder.newer_at_leader_async(aggregate, since)`).
Recheck = Callable[[], Callable[[], Awaitable[bool]]]


async def confirm_unchanged(recorder: Any, aggregate: Any, seq: int) -> None:
    """Before an answer that writes nothing (a registration UNCHANGED, a drain of a drained worker,
    a template already set): it stands on what was read of `aggregate`, up to stream sequence
    `seq`, and a read that a replica of the stream answered behind another process's append
    shows an older state (found by an audit: a worker's runtime changed back, answered
    UNCHANGED, left the log on the other runtime, and memory images were placed where they
    cannot load). IntegrityError if the stream leader has the history past `seq`, so that
    `run_command_async` decides again, on the leader's history (remembered, so the next read
    reaches it). One read of the leader per answer: the registry, whose storms of unchanged
    re-registrations are all such answers, asks its roster first (`RegistryService.
    _confirm_unchanged`) and comes here only when the roster does not say the same."""
    if await recorder.newer_at_leader_async(aggregate, seq):
        raise IntegrityError(f"{aggregate}: the stream leader has its history past {seq}, which was read behind it")


async def run_command(command: Callable[[], T], attempts: int = 8) -> T:
    """Run a load-decide-save `command` off the event loop, again on a lost OCC race.

    `command` must re-read what it decides on each time (the repository does), so
    a retry decides on fresh state. After `attempts` lost races: UNAVAILABLE."""
    return await _retried(partial(asyncio.to_thread, command), attempts, None)


async def run_command_async(command: Callable[[], Awaitable[T]], attempts: int = 8, *,
                            recheck: Recheck | None = None) -> T:
    """Run a load-decide-save `command` (or a read that may refuse, such as the registry's
    lookup of a worker for a heartbeat) on the event loop (its reads and its append awaited
    there: `recorder.select_events_async`, `insert_events_async`), again on a lost OCC race.

    `command` must re-read what it decides on each time (the repository does), so
    a retry decides on fresh state. After `attempts` lost races: UNAVAILABLE.

    A refusal on the entity's state (STATE_REFUSALS) may have been decided on a read that a
    lagging replica of the stream answered, behind another process's append: with `recheck`
    (`Recheck`), such a refusal is answered only once the leader has nothing past what this
    process had read of the entity before the decision, and is otherwise decided again, once,
    on the leader's history. Not past what it has read by the time of the check: another
    command's read meanwhile (the snapshotter's fence reads a worker's history outside the
    registry's lock on it) is not what the decision saw. An accepted command needs no such
    check: its append expects the subject where it read it."""
    return await _retried(command, attempts, recheck)


async def _retried(attempt: Callable[[], Awaitable[T]], attempts: int, recheck: Recheck | None) -> T:
    for tried in range(attempts):
        check = recheck() if recheck is not None else None  # before the decision reads anything
        try:
            return await attempt()
        except IntegrityError:
            # Writers that lost to each other should not meet again at once: a short,
            # growing, random pause spreads them (0-2 ms, then 0-4, 0-8 ... at most 0-64).
            await asyncio.sleep(random.random() * 0.002 * (1 << min(tried, 5)))
        except ContractError as refusal:
            if check is None or refusal.code not in STATE_REFUSALS or not await check():
                raise
            log.info("refused on a read behind the stream leader (%s: %s); deciding again", refusal.code.value,
                     refusal.message)
            return await _retried(attempt, attempts, None)
    raise unavailable(f"lost {attempts} concurrent-write races in a row; try again")


# --- client -------------------------------------------------------------------------


async def call(
    nc: NATS, subject: str, body: Base | dict | bytes, reply_type: type[T], timeout: float = 5.0
) -> T:
    """Request/reply with a contract body; an error reply raises its ContractError."""
    if isinstance(body, bytes):
        data = body
    else:
        data = encode(body)
    try:
        msg = await nc.request(subject, data, timeout=timeout)
    except nats.errors.NoRespondersError:
        raise unavailable(f"no service answers {subject}") from None
    except nats.errors.TimeoutError:
        raise unavailable(f"no reply from {subject} within {timeout}s") from None
    return decode_reply(reply_type, msg.data)


# --- metrics --------------------------------------------------------------------------


LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "::"  # IPv6's and, dual-stack as Linux has it by default, IPv4's too
IPV4_INTERFACES = "0.0.0.0"  # where a host has no IPv6


def start_metrics(port: int | None, host: str = LOOPBACK) -> int | None:
    """Serve prometheus-client's default registry on `host`:`port` (0: any free port); the port.
    On every interface (ALL_INTERFACES) of a host without IPv6, on every IPv4 one."""
    if port is None:
        return None
    from prometheus_client import start_http_server

    try:
        try:
            server, _thread = start_http_server(port, addr=host)
        except OSError as e:
            if host != ALL_INTERFACES or e.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise
            server, _thread = start_http_server(port, addr=IPV4_INTERFACES)
    except OSError as e:  # said as what it is: the caller's option, not a traceback of the http server
        raise OSError(e.errno, f"cannot serve metrics on {host}:{port}: {e.strerror or e}"
                               + ("; try another --metrics-port, or 0 for any free one" if port else "")) from None
    return server.server_port


def metrics_url(host: str, port: int) -> str:
    """The URL a scraper uses: for a server on every interface, this host's name (no DNS
    look-up: the name as the host knows itself)."""
    if host in (ALL_INTERFACES, IPV4_INTERFACES, ""):
        import socket

        host = socket.gethostname()
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"
