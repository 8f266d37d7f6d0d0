"""A service's endpoints: nats.micro endpoints that answer the contract's requests, with its
errors; and `call`, a bare request to one with a contract body.

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
import logging
import re
import time
import typing
import weakref
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

import nats
import nats.errors
import nats.js.errors
from eventsourcing.persistence import OperationalError
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.micro import ServiceConfig
from nats.micro.request import Request
from nats.micro.service import Endpoint, EndpointConfig, Service
from prometheus_client import Counter

from events.codec import decode_reply, decode_request, encode
from events.errors import ContractError, exhausted, invalid, unavailable
from events.natspy.connections import transport_lost
from events.natspy.frames import DirectDelivery, deliver_core, guard_reads
from events.natspy.headers import header_block
from events.natspy.publish import flush_in_order, publish
from events.schema import ID_RE, Base, ErrorCode
from events.subjects import micro_name, service_subject, services_inbox
from services import deadline

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

EXPIRED = Counter(
    "warmboot_requests_expired_total",
    "Requests refused UNAVAILABLE with nothing written: held past the wait their caller said (Warmboot-Wait-Ms)",
    ["service", "endpoint"],
)
DROPPED = Counter(
    "warmboot_requests_dropped_total",
    "Requests dropped unprocessed and unanswered: no reply subject, or one that is not an inbox",
    ["service", "endpoint", "reason"],
)


ASK_FOR_LESS = "ask for less"  # `EndpointSpec.too_large` unless an endpoint says better


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
    # What an answer past the server's max_payload holds and what to ask instead (`fitting`'s refusal says
    # it, then "; or raise the server's max_payload"): an endpoint whose request cannot ask for less says so.
    # A function of the request's body where what to ask depends on what was asked.
    too_large: str | Callable[[Any], str] = ASK_FOR_LESS

    def too_large_for(self, body: Any) -> str:
        return self.too_large(body) if callable(self.too_large) else self.too_large

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
        self.inbox = services_inbox(prefix)  # the services' own: refused bare too (`_INBOX._<prefix>`)
        self.own = self.inbox + "."
        self._logged: set[str] = set()

    def allowed(self, reply: str) -> bool:
        return (reply.startswith(self.prefixes) and not reply.startswith(self.own) and reply != self.inbox
                and "*" not in reply and ">" not in reply and ".." not in reply and reply[-1] != ".")

    def drop(self, endpoint: str, subject: str, reply: str) -> None:
        if not reply:
            reason = "no_reply"
        elif reply.startswith(self.own) or reply == self.inbox:
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
    5xx kind (503: no quorum, a leader election), a write onto a transport that closed under
    nats-py (`transport_lost`: uvloop's RuntimeError). A JetStream API error of the 4xx kind
    (the server answered: the request was wrong) and a misuse of the client are bugs.
    """
    if isinstance(error, nats.js.errors.APIError):
        if isinstance(error, (nats.js.errors.BadRequestError, nats.js.errors.NotFoundError)):
            return False
        code = getattr(error, "code", None)  # some subclasses never set it
        return code is None or code >= 500
    return (isinstance(error, _OUTAGES) and not isinstance(error, _MISUSE)) or transport_lost(error)


def _header_text(text: str) -> str:
    # a header value is one line: a message quoting a caller's input must not add headers
    return text.replace("\r", " ").replace("\n", " ")[:512]


def error_headers(error: ContractError) -> dict[str, str]:
    return {"Nats-Service-Error": _header_text(error.message), "Nats-Service-Error-Code": str(error.status)}


async def respond_error(request: Request, error: ContractError) -> None:
    """The contract's error body, through micro's error reply (its two headers), its message cut to what the
    server carries (`fitting_error`)."""
    error = fitting_error(error, server_limit(request))
    await request.respond_error(str(error.status), _header_text(error.message), data=encode(error.reply()))


CUT_MESSAGE = " ... (cut at {kept} of its {total} characters, past what one message of the NATS server carries)"


def fitting_error(error: ContractError, limit: int | None) -> ContractError:
    """`error`, or, where its reply (body and headers) is past `limit` (the server's max_payload), the same
    code and field with its message cut to fit, saying so (CUT_MESSAGE). A refusal's message may quote what
    the fold holds (whatif's unknown class named every registered class: 2,200 workers of 8 classes each made
    a 1.1 MB message, `services.scheduler.whatif.CLASSES_NAMED`), and an error reply past max_payload was sent
    to nobody: its caller waited out its time-out. Pure."""
    if limit is None:
        return error

    def size(e: ContractError) -> int:
        return len(encode(e.reply())) + len(header_block(error_headers(e)))

    if size(error) <= limit:
        return error
    total = len(error.message)

    def cut_at(kept: int) -> ContractError:
        return ContractError(error.code, error.message[:kept] + CUT_MESSAGE.format(kept=kept, total=total), error.field)

    # the most characters kept for which the reply fits (its size grows with what is kept: a binary search
    # of about twenty encodings, on an error's path)
    fits, past = 0, total
    while past - fits > 1:
        mid = (fits + past) // 2
        if size(cut_at(mid)) <= limit:
            fits = mid
        else:
            past = mid
    return cut_at(fits)


INTERNAL_MESSAGE = "internal error; the service log has the details"


def wrap(spec: EndpointSpec, service: str) -> Callable[[Request], Awaitable[ContractError | None]]:
    """The request handler of one endpoint: the error it answered, or None for a reply."""
    outages = OutageLog(log, f"{service}.{spec.verb}: answered UNAVAILABLE")

    async def handle(request: Request) -> ContractError | None:
        try:
            entity_id = None
            if spec.per_entity:
                entity_id = request.subject.rsplit(".", 1)[-1]
                if not ID_RE.match(entity_id):
                    raise invalid(f"subject token {entity_id!r} is not a valid id", "subject")
            waits = deadline.wait_ms(request.headers)
            body = decode_request(spec.request_type, request.data)
            deadline.begin(waits, getattr(request, "received_ns", None) or deadline.now_ns())
            data = fitting(request, encode(await spec.handler(entity_id, body)), spec.too_large_for(body))
        except ContractError as error:
            if isinstance(error, deadline.Expired):
                EXPIRED.labels(service, spec.verb).inc()
                log.info("%s.%s on %s: %s", service, spec.verb, request.subject, error.message)
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


PAST_MAX_PAYLOAD = "the answer is {size} bytes, past the {limit} bytes the NATS server carries"  # `fitting`
_PAST_MAX_PAYLOAD = re.compile(PAST_MAX_PAYLOAD.replace("{size}", r"(\d+)").replace("{limit}", r"(\d+)"))


def past_max_payload(message: str) -> tuple[int, int] | None:
    """(the answer's size, the server's max_payload) that a RESOURCE_EXHAUSTED of `fitting` names, else
    None: for a caller that asks again for less (`warmboot.cmd_whatif.fitting_whatif`)."""
    found = _PAST_MAX_PAYLOAD.search(message)
    return (int(found[1]), int(found[2])) if found is not None else None


def server_limit(request: Request) -> int | None:
    """The max_payload of the server the connection that took `request` is on (None if not known)."""
    limit = getattr(getattr(getattr(request, "_msg", None), "_client", None), "max_payload", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def fitting(request: Request, data: bytes, too_large: str = ASK_FOR_LESS) -> bytes:
    """`data`, the answer to `request`, if the server carries a message that large (its `max_payload`);
    else RESOURCE_EXHAUSTED naming both sizes, what such an answer holds and what to do (`too_large`, the
    endpoint's `EndpointSpec.too_large`: "ask for less" said of `scheduler.worker`, which cannot, misled).
    An answer past it was sent to nobody (nats-py refuses to
    publish it) and its caller waited out its time-out: a worker's registration of thousands of runtime
    versions, within every bound of the schema, made `scheduler.runtimes` unanswerable for every client
    and operator (docs/security.md, "What the permissions do not cover")."""
    limit = server_limit(request)
    if limit is not None and limit < len(data):
        raise exhausted(PAST_MAX_PAYLOAD.format(size=len(data), limit=limit)
                        + f" (its max_payload): {too_large}; or raise the server's max_payload")
    return data


class OutageLog:
    """One warning per OUTAGE_LOG_S while an outage lasts, with a count of the failures it did not log
    one by one: `what` (the endpoint that answered UNAVAILABLE, the removal that will be tried again),
    then the error."""

    OUTAGE_LOG_S = 10.0

    def __init__(self, logger: logging.Logger, what: str):
        self.log = logger
        self.what = what
        self.next_at = 0.0
        self.unlogged = 0

    def seen(self, error: BaseException) -> None:
        now = time.monotonic()
        if now < self.next_at:
            self.unlogged += 1
            return
        more = f" (and {self.unlogged} more since the last line)" if self.unlogged else ""
        self.log.warning("%s: %r%s", self.what, error, more)
        self.next_at, self.unlogged = now + self.OUTAGE_LOG_S, 0


# --- the micro service ------------------------------------------------------------------

MAX_CONCURRENT_REQUESTS = 256
# A message with a larger header block is dropped where the services' connection reads it,
# before anything parses it (the contract's requests need none; the log's events carry < 1 kB):
# a worker's 1 MB header blocks held the read loop for 0.1 s each.
MAX_HEADER_BYTES = 16 * 1024


class ServiceRequest(Request):
    """nats.micro's request, answered through `events.natspy.publish.publish` (an error's two headers
    encoded by `header_block`): at thousands of heartbeats a second nats-py's publish is a
    measurable part of an answer. Every answer of a `ConcurrentEndpoint` goes through its
    `respond`, `respond_error`'s too. `received_ns`: when the endpoint took it
    (`services.deadline.now_ns`; its caller's wait is counted from there)."""

    def __init__(self, msg: Msg, received_ns: int):
        super().__init__(msg)
        self.received_ns = received_ns

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
        # when each request nats-py's queue holds counts as received, noted as the read loop read it
        # (`_free_or_queued`): its wait counts from its read, not from when a slot takes it out of the queue
        self._queued_received: collections.deque[int] = collections.deque()

    async def _start(self) -> None:
        await super()._start()
        # While a slot is free, a request goes from the connection's read loop straight to
        # its task (`deliver_core`); when none is, nats-py's path holds it in the
        # subscription's queue, and `_handle_request` waits for a slot.
        # A status message on a request subject is no request (a client may publish one): dropped, so
        # that nats-py's queue holds nothing `_free_or_queued` did not note.
        self._direct = deliver_core(self._service._client, self._subscription, self._admit,
                                    ready=self._free_or_queued, statuses=False)

    async def _stop(self) -> None:
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        await super()._stop()

    def _free_or_queued(self) -> bool:
        """Whether a slot is free for the request the read loop reads now (delivered directly, `_admit`);
        else nats-py's queue takes it, and when it counts as received is noted now, in its order
        (`_handle_request`). After a stop of the process, a backlog larger than the slots waits in that
        queue, and its wait counted from when a slot took it out would begin after the server's PONG
        (`services.deadline.received`): as fresh, however long it waited."""
        if self.slots.free_now():
            return True
        self._queued_received.append(deadline.received(deadline.now_ns()))
        return False

    def _admit(self, msg: Msg) -> None:
        """A request delivered directly, so while a slot is free: it takes the slot now."""
        if self._micro.admits(msg, self._name):
            if not self.slots.take_now():
                raise RuntimeError("a request was delivered directly with no slot free")  # logged, dropped
            start = deadline.now_ns()
            self._spawn(msg, start, deadline.received(start))

    async def _handle_request(self, msg: Msg) -> None:
        start = deadline.now_ns()
        queued = self._queued_received
        # noted as it was read (`_free_or_queued`); nats-py queues nothing else on a request subject (a
        # status message is dropped: `_start`), and the notes are cleared whenever the queue is empty
        received = queued.popleft() if queued else deadline.received(start)
        subscription = self._subscription
        if queued and (subscription is None or not subscription._pending_queue.qsize()):
            queued.clear()
        if self._micro.admits(msg, self._name):
            await self.slots.take()
            self._spawn(msg, start, received)

    def _spawn(self, msg: Msg, start: int, received: int) -> None:
        """Serve `msg` (its slot taken) in a task of its own; the slot is given back when it ends. Its
        caller's wait counts from `received`: when it was read (`start`), or earlier if the loop had
        not run for a while before (`services.deadline.received`)."""
        task = asyncio.create_task(self._serve(ServiceRequest(msg, received), start))
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
        self._processing_time += deadline.now_ns() - start
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


# When the stop of the services on a connection gives up on the requests still in progress (`drain_until`).
_drain_until: "weakref.WeakKeyDictionary[NATS, float]" = weakref.WeakKeyDictionary()


def drain_until(nc: NATS, when: float | None) -> None:
    """From now on, the stop of every MicroService on `nc` waits for its requests in progress until the
    loop's time `when` at the latest (None: each for its own `drain_s`): a process stopping
    (`warmboot.runner`) gives them one share of its bound, however many services it runs."""
    if when is None:
        _drain_until.pop(nc, None)
    else:
        _drain_until[nc] = when


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
        self._ticks: asyncio.AbstractEventLoop | None = None  # the loop its requests are served on, ticking

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

    async def start(self) -> None:
        await super().start()
        if self._ticks is None:  # its loop notes that it runs (`services.deadline.received`)
            self._ticks = asyncio.get_running_loop()
            deadline.tick_on(self._ticks, self._client)

    async def stop(self, drain_s: float = 10.0) -> None:
        """Take no more requests, then let the ones in flight finish for at most `drain_s`. Raises on a
        connection already closed (nothing left to unsubscribe).

        nats.micro's own stop drained its discovery subscriptions ($SRV.PING, INFO, STATS), each drain a
        flush, a round trip to the server: with the server frozen (SIGSTOP, a stuck disk) or gone, the
        first one waited out nats-py's 10 s and raised, so each service took 10 s to stop (30 s for
        `serve all`) and the requests in flight were not waited for. Those subscriptions carry a
        discovery's questions, not requests: they are unsubscribed, as the endpoints' are."""
        try:
            if not self._stopped.is_set():
                for endpoint in self._endpoints:
                    await endpoint._stop()
                for subscription in self._subscriptions.values():
                    await subscription.unsubscribe()
                self._endpoints = []
                self._subscriptions = {}
                self._stopped.set()
            if self._tasks:
                wait = drain_s
                if (until := _drain_until.get(self._client)) is not None:
                    wait = max(0.0, min(drain_s, until - asyncio.get_running_loop().time()))
                _, unanswered = await asyncio.wait(list(self._tasks), timeout=wait)
                if unanswered:
                    log.warning("%s: %d requests in progress not answered within %.1fs of the stop; given up "
                                "(their clients' retries, with the same request ids, find what was written)",
                                self._name, len(unanswered), wait)
        finally:  # a ticker left behind kept ticking, and pinging, for a service that had stopped
            ticks, self._ticks = self._ticks, None
            if ticks is not None:
                deadline.untick(ticks, self._client)


async def add_endpoints(
    nc: NATS, prefix: str, service: str, description: str, specs: list[EndpointSpec],
    max_concurrent: int = MAX_CONCURRENT_REQUESTS, reply_prefixes: tuple[str, ...] = REPLY_PREFIXES,
) -> MicroService:
    """Start the micro service `warmboot-<service>` in the queue group of that name.

    Its metadata names the deployment's subject prefix (`prefix`); each endpoint's,
    its request and reply schema (`request`, `reply`: names in `warmboot schema`).
    """
    guard_reads(nc, max_header_bytes=MAX_HEADER_BYTES)
    name = micro_name(service)
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
