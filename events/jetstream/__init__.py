"""A persistence module for the eventsourcing library that stores events in NATS JetStream.

Select it with the library's setting ``PERSISTENCE_MODULE=events.jetstream``
(`services.common.store_env` builds the whole environment). Settings, read
through the library's environment (so ``<APPNAME>_NATS_URL`` overrides
``NATS_URL`` for one application):

=============================  ==========================================================
``NATS_URL``                   server URL(s), comma-separated for a cluster;
                               default ``nats://127.0.0.1:4222``
``WARMBOOT_PREFIX``            subject prefix, default ``warmboot``
``WARMBOOT_STREAM_REPLICAS``   replicas of a stream this module creates, default 1
``NATS_CREDS``                 path of a credentials file (JWT + nkey seed)
``NATS_USER``/``NATS_PASSWORD``  user and password
``NATS_TOKEN``                 authentication token
``NATS_NKEY_SEED``             path of an nkey seed file (``warmboot nats-config --auth nkey``)
``NATS_INBOX_PREFIX``          inbox prefix of the connection (the services' own, `services_inbox`)
``WARMBOOT_STORE_TIMEOUT``     seconds an operation keeps retrying transient errors
                               (no responders, timeouts, 503, a leader election)
                               before raising `StoreUnavailableError`; default 30
``CREATE_TABLE``               ``no`` skips creating the streams (the library's name)
=============================  ==========================================================

Layout, for a prefix ``p`` (CONTRACT section 4):

- Stream ``P_EVENTS`` (file storage, ``allow_atomic``, ``allow_direct``, a
  duplicate window of 2 minutes, no limit that discards anything) holds the
  events on ``p.ev.<kind>.<entity id>`` and the tracking records of process
  applications on ``p.tracking.<application name>``: tracking records are
  committed in the same atomic batch as the events they caused, and an atomic
  batch cannot span streams.
- An originator id ``<kind>.<entity id>`` (``worker.w-17``) is stored on
  ``p.ev.worker.w-17``. An id without a ``.`` (the library's UUIDs) goes to
  ``p.ev.aggregate.<id>``, with the header ``Warmboot-Id-Type: uuid`` for a UUID
  so that reading gives back a UUID; the kind ``aggregate`` is reserved for that.
- Each event message: body = the stored event's state (for `WireMapper`, the
  event Struct's JSON, so any NATS client can read the log), headers
  ``Nats-Msg-Id: <originator id>:<version>`` (a retried append is stored once),
  `TOPIC_HEADER` and `VERSION_HEADER`.
- Snapshots (the aggregate recorder of purpose ``snapshots``) live in their own
  stream ``P_SNAPSHOTS`` on ``p.snapshots.<kind>.<entity id>``, which keeps the
  last `SNAPSHOTS_KEPT` snapshots of each aggregate: older ones are redundant,
  and the event stream stays nothing but events.

Writing. `insert_events` appends all messages of one call as one JetStream atomic
batch (at most `MAX_BATCH_MESSAGES`), each subject's first message carrying
``Nats-Expected-Last-Subject-Sequence``: the batch is stored whole or not at all,
and only if no subject has moved on since its writer read it. The expected
sequence of a subject comes from what this process last read or wrote there; a
first version (0 or 1) expects an empty subject; otherwise the subject's last
message is looked up. Versions of an aggregate only grow: an event whose version
is not above the stored last version of its aggregate is a conflict,
`eventsourcing.persistence.IntegrityError` (when the server refuses an
expectation, the subject is read again: a conflict if the version is taken,
another attempt if not). Transient errors (no responders, timeouts, 503, a
leader election, a dropped connection) are retried with backoff within
``WARMBOOT_STORE_TIMEOUT``; a resent batch whose first attempt was stored after
all is recognised by its message ids and contents, and not stored twice.
The application recorders return the stream sequences of the events written:
notification ids are stream sequences, so tracking records (and anything else
in the stream) are gaps that readers skip.

Guarding other subjects: ``insert_events(stored_events, expected_last_seqs=...)``
takes a mapping ``{originator_id: stream sequence}``; for those originators the
given sequence (0 for "no event yet") is the expected last sequence of their
subject, instead of the one this module looks up. The library passes keyword
arguments of ``Application.save`` down to the recorder, so::

    app.save(actor, booking, expected_last_seqs={"booking.w-17": 1234})

commits the actor's events and the booking marker atomically, and only if the
booking subject's last message is still sequence 1234 (otherwise IntegrityError,
nothing written). Every originator named there must have an event in the call.

Reading. ``select_events`` and ``select_notifications`` use batched direct gets
(one request answers up to `READ_PAGE` messages); ``subscribe`` uses an ordered
consumer (recreated by nats-py after a server restart, from where it was);
``max_notification_id`` is one direct get of the last event message. Topics are
filtered on the `TOPIC_HEADER` of each message, here, not by the server. On a
replicated stream a direct get may be answered by a replica that is behind: a
read of a subject that comes back older than what this process wrote or read
there is asked again, then made through the stream leader, so a process always
reads its own writes.

Threads. The library is synchronous and nats-py is asyncio: the module runs one
event-loop thread and one connection per (URL, credentials) in the process,
shared by every factory and recorder that uses them, reconnecting forever after
a server restart. Calling a recorder from that loop's own thread is an error;
asyncio code calls recorders through a thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import concurrent.futures
import itertools
import json
import logging
import os
import queue
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable
from uuid import UUID

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.nuid import NUID

from eventsourcing.persistence import (
    AggregateRecorder,
    ApplicationRecorder,
    DataError,
    InfrastructureFactory,
    IntegrityError,
    Notification,
    OperationalError,
    ProcessRecorder,
    ProgrammingError,
    StoredEvent,
    Subscription,
    Tracking,
    TrackingRecorder,
)
from eventsourcing.utils import Environment, EnvType, resolve_topic, strtobool

from events.natspy import ack_positions, parse_header_block, use_lean_headers
from events.natsauth import NKEY_SEED_ENV, nkey_options, redact_url
from events.subjects import DEFAULT_PREFIX, check_prefix, stream_name

log = logging.getLogger("warmboot.jetstream")

# --- names and numbers ------------------------------------------------------------

TOPIC_HEADER = "Warmboot-Topic"  # the library topic of the event (WireMapper: the event `type`)
VERSION_HEADER = "Warmboot-Version"  # the originator version
ID_TYPE_HEADER = "Warmboot-Id-Type"  # "uuid" when the originator id is a UUID
TRACKING_HEADER = "Warmboot-Tracking"  # on a tracking record: the notification id processed
MSG_ID_HEADER = "Nats-Msg-Id"
EXPECTED_SUBJECT_SEQ_HEADER = "Nats-Expected-Last-Subject-Sequence"
BATCH_ID_HEADER = "Nats-Batch-Id"
BATCH_SEQ_HEADER = "Nats-Batch-Sequence"
BATCH_COMMIT_HEADER = "Nats-Batch-Commit"

EVENTS_PURPOSE = "events"
EVENTS_TOKEN = "ev"  # CONTRACT section 4: <prefix>.ev.<kind>.<id>
TRACKING_TOKEN = "tracking"
UUID_KIND = "aggregate"  # the kind of originator ids without one (UUIDs)

MAX_BATCH_MESSAGES = 1000  # nats-server's limit for one atomic batch
DUPLICATE_WINDOW_NS = 120 * 1_000_000_000
SNAPSHOTS_KEPT = 4
READ_PAGE = 1000
REQUEST_TIMEOUT = 5.0
DEFAULT_STORE_TIMEOUT = 30.0
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
SUBSCRIPTION_BUFFER = 10_000
IDLE_HEARTBEAT = 1.0  # an ordered consumer is recreated after two missed heartbeats
CATCH_UP_ATTEMPTS = 6  # reads answered by a replica behind this process's own writes, asked again
CATCH_UP_DELAY = 0.005  # doubling: about 0.3 s in all before reading through the stream leader
MAX_REPLANS = 16  # rounds of "someone else appended, look again" before giving up

# nats-server error codes (server/errors.json)
ERR_WRONG_LAST_SEQUENCE = 10071
ERR_BATCH_WRONG_LAST_SEQUENCE = 10164
ERR_BATCH_DUPLICATE_MSG_ID = 10201
ERR_BATCH_INCOMPLETE = 10176
ERR_CLUSTER_NOT_AVAILABLE = 10008
ERR_CLUSTER_NOT_LEADER = 10009
ERR_BATCH_TOO_MANY_INFLIGHT = 10210
ERR_STREAM_NAME_IN_USE = 10058
ERR_NO_MESSAGE_FOUND = 10037
ERR_STREAM_NOT_FOUND = 10059
ERR_CLUSTER_NO_PEERS = 10005
CONFLICT_CODES = {ERR_WRONG_LAST_SEQUENCE, ERR_BATCH_WRONG_LAST_SEQUENCE, ERR_BATCH_DUPLICATE_MSG_ID}
TRANSIENT_CODES = {ERR_BATCH_INCOMPLETE, ERR_CLUSTER_NOT_AVAILABLE, ERR_CLUSTER_NOT_LEADER, ERR_BATCH_TOO_MANY_INFLIGHT}

_TOKEN = re.compile(r"^[^\s.*>]+$")
_DOTTED = re.compile(r"^[^\s.*>]+(\.[^\s.*>]+)*$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


class StoreUnavailableError(OperationalError):
    """JetStream did not answer (or answered "unavailable") for longer than the retry budget."""


@dataclass(frozen=True, eq=False)
class SequencedStoredEvent(StoredEvent):
    """A stored event as `select_events` reads it: also its stream sequence, `seq`.

    Equal (and hashing alike) to a StoredEvent of the same four fields, so the library
    and its tests see a StoredEvent; the aggregates of this project keep `seq` so that
    the answer to a repeated request names its event's position without another read.
    """

    seq: int = 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StoredEvent):
            return NotImplemented
        return (self.originator_id, self.originator_version, self.topic, self.state) == (
            other.originator_id, other.originator_version, other.topic, other.state)

    __hash__ = StoredEvent.__hash__


# --- subjects ---------------------------------------------------------------------------


def originator_subject(namespace: str, originator_id: UUID | str) -> str:
    """`<namespace>.<kind>.<entity id>` of an originator id; see the module docstring."""
    if isinstance(originator_id, UUID):
        return f"{namespace}.{UUID_KIND}.{originator_id}"
    text = str(originator_id)
    kind, dot, entity = text.partition(".")
    if not dot:
        kind, entity = UUID_KIND, text
    elif kind == UUID_KIND:
        raise ProgrammingError(f"originator id {text!r}: the kind {UUID_KIND!r} is reserved")
    if not _TOKEN.match(kind) or not _DOTTED.match(entity):
        raise ProgrammingError(f"originator id {text!r} cannot be a NATS subject")
    return f"{namespace}.{kind}.{entity}"


def originator_of(namespace: str, subject: str, headers: Mapping[str, str] | None) -> UUID | str:
    """The originator id stored on `subject` (the inverse of `originator_subject`)."""
    rest = subject[len(namespace) + 1 :]
    kind, _, entity = rest.partition(".")
    if kind != UUID_KIND:
        return rest
    if headers and headers.get(ID_TYPE_HEADER) == "uuid":
        return UUID(entity)
    return entity


def application_token(application_name: str) -> str:
    """A subject token for an application name (names with other characters are encoded)."""
    if _SAFE_NAME.match(application_name):
        return application_name
    encoded = base64.urlsafe_b64encode(application_name.encode()).decode().rstrip("=")
    return f"~{encoded}"


def events_namespace(prefix: str) -> str:
    return f"{prefix}.{EVENTS_TOKEN}"


def tracking_subject(prefix: str, application_name: str) -> str:
    return f"{prefix}.{TRACKING_TOKEN}.{application_token(application_name)}"


def notification_from_message(
    prefix: str, seq: int, subject: str, headers: Mapping[str, str] | None, data: bytes
) -> Notification:
    """Turn a raw message of `<prefix>.ev.>` (from any reader) into the library's Notification."""
    headers = headers or {}
    return Notification(
        id=seq,
        originator_id=originator_of(events_namespace(prefix), subject, headers),
        originator_version=_version_of(headers),
        topic=headers.get(TOPIC_HEADER) or _body_type(data),  # another client's message: its `type`
        state=data,
    )


def _version_of(headers: Mapping[str, str]) -> int:
    """The originator version of a message: its header, else the end of its Nats-Msg-Id."""
    value = headers.get(VERSION_HEADER)
    if value is None:
        value = headers.get(MSG_ID_HEADER, "").rpartition(":")[2]
    return int(value or 0)


def _body_type(data: bytes) -> str:
    try:
        body = json.loads(data)
    except ValueError:
        return ""
    return str(body.get("type", "")) if isinstance(body, dict) else ""


# --- connection: one event-loop thread per (url, credentials) ----------------------------


@dataclass(frozen=True)
class ConnectOptions:
    """Where and as whom to connect: the key of the shared connections."""

    url: str = field(repr=False)  # may hold user:password: shown as `where`
    creds: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    nkey_seed: str | None = None  # path of an nkey seed file
    inbox_prefix: str | None = None

    @classmethod
    def from_env(cls, env: Environment) -> "ConnectOptions":
        return cls(
            url=env.get("NATS_URL") or DEFAULT_NATS_URL,
            creds=env.get("NATS_CREDS") or None,
            user=env.get("NATS_USER") or None,
            password=env.get("NATS_PASSWORD") or None,
            token=env.get("NATS_TOKEN") or None,
            nkey_seed=env.get(NKEY_SEED_ENV) or None,
            inbox_prefix=env.get("NATS_INBOX_PREFIX") or None,
        )

    @property
    def where(self) -> str:
        """The URL(s) without any user:password in them, for messages and logs."""
        return redact_url(self.url)

    def __repr__(self) -> str:
        return f"ConnectOptions(where={self.where!r}, creds={self.creds!r}, user={self.user!r})"

    def connect_kwargs(self) -> dict[str, Any]:
        # NATS_URL may list a cluster's members, comma-separated (as `--nats` does).
        kwargs: dict[str, Any] = {"servers": [u.strip() for u in self.url.split(",") if u.strip()]}
        kwargs.update(nkey_options(self.nkey_seed))
        if self.inbox_prefix:
            kwargs["inbox_prefix"] = self.inbox_prefix
        if self.creds:
            kwargs["user_credentials"] = self.creds
        if self.user:
            kwargs["user"] = self.user
            kwargs["password"] = self.password or ""
        if self.token:
            kwargs["token"] = self.token
        return kwargs


@dataclass
class _Last:
    """What is known of a subject's last message: its stream sequence and position."""

    seq: int  # 0: the subject has no message
    position: int | None  # the version (events) or notification id (tracking); None if empty


class _LastSeen:
    """A bounded map subject -> _Last, filled by reads and by our own writes."""

    def __init__(self, capacity: int = 65_536):
        self.capacity = capacity
        self.entries: OrderedDict[str, _Last] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, subject: str) -> _Last | None:
        with self.lock:
            last = self.entries.get(subject)
            if last is not None:
                self.entries.move_to_end(subject)
            return last

    def forget(self, prefixes: list[str]) -> None:
        """Drop what is known of subjects under `prefixes` (their stream was made anew)."""
        with self.lock:
            for subject in [s for s in self.entries if s.startswith(tuple(prefixes))]:
                del self.entries[subject]

    def put(self, subject: str, last: _Last, authoritative: bool = False) -> None:
        """Remember `last`; a read that may be older than what is known does not replace it,
        what the stream leader said or acknowledged does."""
        with self.lock:
            known = self.entries.get(subject)
            if not authoritative and known is not None and known.seq > last.seq:
                return
            self.entries[subject] = last
            self.entries.move_to_end(subject)
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)


class _Collector:
    """Gathers the replies of one batched direct get until the end-of-batch status."""

    __slots__ = ("msgs", "done")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.msgs: list[Msg] = []
        self.done: asyncio.Future[int] = loop.create_future()

    def feed(self, msg: Msg) -> None:
        headers = msg.headers
        status = headers.get("Status") if headers and not msg.data else None
        if status is None:
            self.msgs.append(msg)
        elif self.done.done():
            return
        elif status == "204":  # end of batch; Nats-Num-Pending says how many more match
            self.done.set_result(int(headers.get("Nats-Num-Pending", "0")))
        elif status == "404":  # nothing (more) matches
            self.done.set_result(0)
        elif status == "503":
            self.done.set_exception(nats.errors.NoRespondersError())
        else:
            self.done.set_exception(OperationalError(f"direct get failed with status {status}"))


class _Link:
    """One NATS connection on one event-loop thread, shared by all users of the same options."""

    def __init__(self, options: ConnectOptions):
        self.options = options
        self.pid = os.getpid()
        self.refs = 0
        self.closed = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run_loop, name="warmboot-jetstream", daemon=True)
        self.nc: NATS | None = None
        self.connecting: asyncio.Lock | None = None
        self.last_error: BaseException | None = None
        self.subscriptions: "weakref.WeakSet[JetStreamSubscription]" = weakref.WeakSet()
        self.inbox = ""
        self.collectors: dict[str, _Collector] = {}
        self.tokens = itertools.count()
        self.nuid = NUID()
        self.ready_streams: set[str] = set()
        self.last_seen = _LastSeen()
        self.waiting: set[concurrent.futures.Future[Any]] = set()
        self.waiting_lock = threading.Lock()
        self.thread.start()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        # Stopped by shutdown(): let the client's leftover tasks end before the loop closes.
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()
        with self.waiting_lock:  # calls submitted as the loop stopped never ran: release their callers
            for future in self.waiting:
                future.cancel()

    def call(self, coro: Any) -> Any:
        """Run `coro` on the link's loop and wait for it (coroutines bound their own time)."""
        if threading.current_thread() is self.thread:
            coro.close()
            raise ProgrammingError("a JetStream recorder was called from its own event loop")
        if self.closed:
            coro.close()
            raise ProgrammingError("the JetStream connection of this recorder is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        with self.waiting_lock:
            self.waiting.add(future)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            raise OperationalError("the JetStream connection was closed during the call") from None
        finally:
            with self.waiting_lock:
                self.waiting.discard(future)

    def spawn(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def connect(self, timeout: float) -> None:
        if self.connecting is None:
            self.connecting = asyncio.Lock()
        async with self.connecting:
            if self.nc is None:
                await self._connect(timeout)

    async def _connect(self, timeout: float) -> None:

        async def on_error(error: Exception) -> None:
            # The server's word (e.g. an authorization violation) says more than the reset after it.
            if not (isinstance(error, OSError) and self.last_error is not None):
                self.last_error = error
            log.debug("nats: %r", error)

        async def on_disconnected() -> None:
            log.info("disconnected from %s; reconnecting", self.options.where)

        async def on_reconnected() -> None:
            log.info("reconnected to %s", self.options.where)

        nc = NATS()
        use_lean_headers(nc)  # replays are bound by header parsing (events.natspy)
        try:
            await asyncio.wait_for(
                nc.connect(
                    **self.options.connect_kwargs(),
                    name="warmboot-eventstore",
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,  # forever: the store outlives server restarts
                    reconnect_time_wait=0.25,
                    connect_timeout=2,
                    ping_interval=10,
                    max_outstanding_pings=3,
                    error_cb=on_error,
                    disconnected_cb=on_disconnected,
                    reconnected_cb=on_reconnected,
                ),
                timeout,
            )
        except asyncio.TimeoutError:
            try:  # stop its reconnect loop: the next call starts afresh
                await asyncio.wait_for(nc.close(), 2)
            except (asyncio.TimeoutError, nats.errors.Error, OSError):
                pass
            raise StoreUnavailableError(
                f"could not connect to NATS at {self.options.where} within {timeout:g}s"
                f" (last error: {self.last_error!r})"
            ) from None
        self.inbox = nc.new_inbox()
        await nc.subscribe(f"{self.inbox}.*", cb=self._route)
        self.nc = nc

    async def _route(self, msg: Msg) -> None:
        collector = self.collectors.get(msg.subject[len(self.inbox) + 1 :])
        if collector is not None:
            collector.feed(msg)

    async def direct_batch(self, stream: str, request: dict[str, Any], timeout: float) -> tuple[list[Msg], int]:
        """One batched direct get: the messages, and how many more match after them."""
        token = str(next(self.tokens))
        collector = _Collector(asyncio.get_running_loop())
        self.collectors[token] = collector
        try:
            await self.nc.publish(
                f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=f"{self.inbox}.{token}"
            )
            pending = await asyncio.wait_for(collector.done, timeout)
        finally:
            del self.collectors[token]
        return collector.msgs, pending

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.close(), 5)
            except (asyncio.TimeoutError, nats.errors.Error, OSError) as error:
                log.debug("closing the connection to %s: %r", self.options.where, error)

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        for subscription in list(self.subscriptions):
            subscription.stop()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            try:
                asyncio.run_coroutine_threadsafe(self.close(), self.loop).result(10)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


_links: dict[ConnectOptions, _Link] = {}
_links_lock = threading.Lock()


def _acquire(options: ConnectOptions) -> _Link:
    with _links_lock:
        link = _links.get(options)
        if link is not None and link.pid != os.getpid():
            link = None  # inherited through fork: its thread did not come along
        if link is None or link.closed:
            link = _Link(options)
            _links[options] = link
        link.refs += 1
        return link


def _release(link: _Link) -> None:
    with _links_lock:
        link.refs -= 1
        if link.refs > 0:
            return
        if _links.get(link.options) is link:
            del _links[link.options]
    link.shutdown()


@atexit.register
def _close_all() -> None:
    with _links_lock:
        links = [link for link in _links.values() if link.pid == os.getpid()]
        _links.clear()
    for link in links:
        link.shutdown()


@dataclass
class _Stored:
    """A message read through the stream leader, shaped like a direct-get reply."""

    headers: dict[str, str]
    data: bytes


# --- transient errors and retries -------------------------------------------------------


class _ServerSaid(Exception):
    """JetStream answered a publish or API request with an error."""

    def __init__(self, code: int, err_code: int, description: str):
        super().__init__(f"{description} (code {code}, err_code {err_code})")
        self.code = code
        self.err_code = err_code
        self.description = description

    @property
    def transient(self) -> bool:
        return self.code in (503, 429) or self.err_code in TRANSIENT_CODES

    @property
    def conflict(self) -> bool:
        return self.err_code in CONFLICT_CODES

    @classmethod
    def from_reply(cls, data: dict[str, Any]) -> "_ServerSaid":
        error = data["error"]
        return cls(int(error.get("code", 0)), int(error.get("err_code", 0)), str(error.get("description", "")))


_NOT_DELIVERED = (nats.errors.NoRespondersError,)
_UNANSWERED = (
    nats.errors.TimeoutError,
    asyncio.TimeoutError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionClosedError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.FlushTimeoutError,
    nats.errors.UnexpectedEOF,
    ConnectionError,
)


class _Retry:
    """The time budget of one operation: per-attempt timeouts, and doubling sleeps between attempts."""

    def __init__(self, what: str, budget: float, stream: "_Stream | None" = None):
        self.what = what
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + budget
        self.budget = budget
        self.delay = 0.05
        self.stream = stream  # asked once whether it exists when nobody answers

    @property
    def timeout(self) -> float:
        """How long the next attempt may wait for an answer."""
        return max(0.05, min(REQUEST_TIMEOUT, self.deadline - self.loop.time()))

    async def wait(self, error: BaseException) -> None:
        if isinstance(error, nats.errors.NoRespondersError) and self.stream is not None:
            stream, self.stream = self.stream, None
            await stream.check_exists()
        if self.loop.time() + self.delay > self.deadline:
            raise StoreUnavailableError(
                f"{self.what}: JetStream unavailable for {self.budget:g}s (last error: {error!r})"
            ) from error
        log.debug("%s: retrying after %r", self.what, error)
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, 1.0)


# --- one stream ---------------------------------------------------------------------------


@dataclass
class _Out:
    """One message of a batch to append."""

    subject: str
    data: bytes
    headers: dict[str, str]
    position: int  # version (events) or notification id (tracking)
    is_event: bool


@dataclass
class _Guard:
    """The optimistic-concurrency expectation on one subject of a batch."""

    subject: str
    position_header: str
    first_position: int
    first_index: int
    last_index: int
    last_position: int
    expected: int | None = None  # expected last subject sequence
    given: bool = False  # by the caller (expected_last_seqs): never looked up again


@dataclass
class _Batch:
    outs: list[_Out] = field(default_factory=list)
    guards: dict[str, _Guard] = field(default_factory=dict)

    def add(self, out: _Out, position_header: str) -> None:
        index = len(self.outs)
        guard = self.guards.get(out.subject)
        if guard is None:
            self.guards[out.subject] = _Guard(
                out.subject, position_header, out.position, index, index, out.position
            )
        else:
            if out.position <= guard.last_position:
                raise IntegrityError(
                    f"{out.subject}: position {out.position} does not follow {guard.last_position} in one call"
                )
            guard.last_index = index
            guard.last_position = out.position
        self.outs.append(out)


class _Stream:
    """One JetStream stream on a link: creation, appends and reads (coroutines on the link's loop)."""

    def __init__(self, link: _Link, name: str, subjects: list[str], replicas: int, budget: float,
                 per_subject_limit: int = -1):
        self.link = link
        self.name = name
        self.subjects = subjects
        self.replicas = replicas
        self.budget = budget
        self.per_subject_limit = per_subject_limit
        self.create = True  # whether a missing stream may be created (CREATE_TABLE)

    # -- setup

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": "warmboot event store (events.jetstream)",
            "subjects": self.subjects,
            "retention": "limits",
            "storage": "file",
            "num_replicas": self.replicas,
            "max_consumers": -1,
            "max_msgs": -1,
            "max_bytes": -1,
            "max_age": 0,
            "max_msgs_per_subject": self.per_subject_limit,
            "max_msg_size": -1,
            "discard": "old",
            "duplicate_window": DUPLICATE_WINDOW_NS,
            "allow_atomic": True,
            "allow_direct": True,
        }

    async def ensure(self, create: bool) -> None:
        """Connect; create the stream (idempotently) or bring an existing one up to what we need."""
        self.create = create
        link = self.link
        await link.connect(self.budget)
        if not create or self.name in link.ready_streams:
            return
        retry = _Retry(f"creating stream {self.name}", self.budget)
        while True:
            try:
                await self._create_or_update(retry.timeout)
                break
            except _ServerSaid as said:
                # No peers for the replicas yet: a cluster still forming, or a member restarting.
                if not (said.transient or said.err_code == ERR_CLUSTER_NO_PEERS):
                    raise OperationalError(f"stream {self.name}: {said}") from None
                await retry.wait(said)
            except _NOT_DELIVERED + _UNANSWERED as error:
                await retry.wait(error)
        link.ready_streams.add(self.name)

    async def _api(self, subject: str, payload: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        body = json.dumps(payload).encode() if payload is not None else b""
        reply = await self.link.nc.request(f"$JS.API.{subject}", body, timeout=timeout)
        data = json.loads(reply.data)
        if "error" in data:
            raise _ServerSaid.from_reply(data)
        return data

    async def _create_or_update(self, timeout: float) -> None:
        wanted = self.config()
        try:
            await self._api(f"STREAM.CREATE.{self.name}", wanted, timeout)
            return
        except _ServerSaid as said:
            if said.err_code != ERR_STREAM_NAME_IN_USE:
                raise
        try:
            current = (await self._api(f"STREAM.INFO.{self.name}", None, timeout))["config"]
        except _ServerSaid as said:
            if said.err_code != ERR_STREAM_NOT_FOUND:
                raise
            # "in use" and "not found" at once: a cluster between two states; ask again
            raise _ServerSaid(503, ERR_CLUSTER_NOT_AVAILABLE, f"stream {self.name} is settling") from None
        merged = dict(current)
        merged["subjects"] = sorted(set(current.get("subjects") or []) | set(self.subjects))
        merged["allow_atomic"] = True
        merged["allow_direct"] = True
        merged["duplicate_window"] = max(int(current.get("duplicate_window") or 0), DUPLICATE_WINDOW_NS)
        if merged != current:
            log.info("updating stream %s to what the event store needs", self.name)
            await self._api(f"STREAM.UPDATE.{self.name}", merged, timeout)

    async def check_exists(self) -> None:
        """Nobody answers for the stream: if it does not exist, create it again or say so."""
        try:
            await self._api(f"STREAM.INFO.{self.name}", None, REQUEST_TIMEOUT)
        except _ServerSaid as said:
            if said.err_code != ERR_STREAM_NOT_FOUND or await self._listed():
                return  # there, between leaders: the caller's retries ride it out
            self.link.ready_streams.discard(self.name)
            if not self.create:
                raise OperationalError(
                    f"stream {self.name} does not exist (and CREATE_TABLE says not to create it)"
                ) from None
            log.warning("stream %s is gone (deleted, or a new server); creating it again", self.name)
            self.link.last_seen.forget([subject.rstrip(">") for subject in self.subjects])
            await self.ensure(True)
        except _NOT_DELIVERED + _UNANSWERED:
            pass  # JetStream itself is not answering: a transient state, retried by the caller

    async def _listed(self) -> bool:
        """Whether the account's stream list (the meta leader's word) names this stream."""
        try:
            names = await self._api("STREAM.NAMES", {"subject": self.subjects[0]}, REQUEST_TIMEOUT)
        except (_ServerSaid,) + _NOT_DELIVERED + _UNANSWERED:
            return True  # cannot tell: do not conclude it is gone
        return self.name in (names.get("streams") or [])

    # -- reads

    async def read(
        self,
        filter_subject: str,
        start_seq: int,
        *,
        stop: int | None = None,
        limit: int | None = None,
        keep: Callable[[Msg], bool] | None = None,
    ) -> list[Msg]:
        """Messages on `filter_subject` from `start_seq` (to `stop`), at most `limit` kept ones."""
        msgs: list[Msg] = []
        seq = max(start_seq, 1)
        retry = _Retry(f"reading {filter_subject}", self.budget, self)
        while True:
            want = READ_PAGE
            if limit is not None and keep is None:
                want = min(want, limit - len(msgs))
            if stop is not None:
                want = min(want, stop - seq + 1)
            if want <= 0:
                return msgs
            request = {"seq": seq, "next_by_subj": filter_subject, "batch": want}
            try:
                page, pending = await self.link.direct_batch(self.name, request, retry.timeout)
            except _NOT_DELIVERED + _UNANSWERED as error:
                await retry.wait(error)
                continue
            for msg in page:
                msg_seq = int(msg.headers["Nats-Sequence"])
                if stop is not None and msg_seq > stop:
                    return msgs
                if keep is None or keep(msg):
                    msgs.append(msg)
                    if limit is not None and len(msgs) >= limit:
                        return msgs
                seq = msg_seq + 1
            if not page or pending == 0:
                return msgs

    async def last_direct(self, subject: str) -> Msg | None:
        """The last message on `subject` (a wildcard is allowed), from any replica."""
        retry = _Retry(f"reading the last message of {subject}", self.budget, self)
        request = json.dumps({"last_by_subj": subject}).encode()
        while True:
            try:
                reply = await self.link.nc.request(
                    f"$JS.API.DIRECT.GET.{self.name}", request, timeout=retry.timeout
                )
            except _NOT_DELIVERED + _UNANSWERED as error:
                await retry.wait(error)
                continue
            status = reply.headers.get("Status") if reply.headers and not reply.data else None
            if status is None:
                return reply
            if status == "404":
                return None
            await retry.wait(OperationalError(f"direct get of {subject} answered status {status}"))

    async def _leader_get(self, request: dict[str, Any], subject: str, retry: "_Retry") -> tuple[int, dict[str, str], bytes] | None:
        """One message as the stream leader has it, (seq, headers, data), or None when there is none.

        Transient errors are retried within `retry`'s budget; a stream deleted under us is made again.
        """
        while True:
            try:
                data = await self._api(f"STREAM.MSG.GET.{self.name}", request, retry.timeout)
            except _ServerSaid as said:
                if said.err_code == ERR_STREAM_NOT_FOUND:
                    await self.check_exists()  # made again (then nothing is in it), or an error
                    await retry.wait(said)
                    continue
                if said.err_code == ERR_NO_MESSAGE_FOUND or said.code == 404:
                    return None
                if not said.transient:
                    raise OperationalError(f"reading {subject}: {said}") from None
                await retry.wait(said)
                continue
            except _NOT_DELIVERED + _UNANSWERED as error:
                await retry.wait(error)
                continue
            message = data["message"]
            headers = parse_header_block(base64.b64decode(message["hdrs"])) if message.get("hdrs") else {}
            body = base64.b64decode(message["data"]) if message.get("data") else b""
            return int(message["seq"]), headers, body

    async def last_from_leader(self, subject: str) -> tuple[int, dict[str, str], bytes] | None:
        """The last message on `subject` as the stream leader has it: (seq, headers, data)."""
        retry = _Retry(f"reading the last message of {subject}", self.budget, self)
        return await self._leader_get({"last_by_subj": subject}, subject, retry)

    async def last(self, subject: str) -> Msg | _Stored | None:
        """The last message on `subject`, never older than what this process saw there.

        Direct gets may be answered by a replica that is behind (on a replicated
        stream); such an answer is asked again, then read through the leader.
        """
        known = self.link.last_seen.get(subject)
        delay = CATCH_UP_DELAY
        for _ in range(CATCH_UP_ATTEMPTS):
            msg = await self.last_direct(subject)
            if known is None or not known.seq or (msg is not None and int(msg.headers["Nats-Sequence"]) >= known.seq):
                return msg
            await asyncio.sleep(delay)
            delay *= 2
        current = await self.last_from_leader(subject)
        if current is None:
            return None
        seq, headers, data = current
        return _Stored({**headers, "Nats-Sequence": str(seq), "Nats-Subject": subject}, data)

    async def subject_from(self, subject: str, start: int) -> list[Msg] | list[_Stored]:
        """Every message on `subject` from `start`, at least up to what this process saw there."""
        known = self.link.last_seen.get(subject)
        must_see = known.seq if known is not None and known.seq >= start else 0
        delay = CATCH_UP_DELAY
        for _ in range(CATCH_UP_ATTEMPTS):
            msgs = await self.read(subject, start)
            if not must_see or (msgs and int(msgs[-1].headers["Nats-Sequence"]) >= must_see):
                return msgs
            await asyncio.sleep(delay)  # a replica behind: ask again (maybe another one)
            delay *= 2
        return await self._subject_from_leader(subject, start)

    async def _subject_from_leader(self, subject: str, start: int) -> list[_Stored]:
        stored: list[_Stored] = []
        seq = max(start, 1)
        retry = _Retry(f"reading {subject} through the leader", self.budget, self)
        while (found := await self._leader_get({"seq": seq, "next_by_subj": subject}, subject, retry)) is not None:
            seq, headers, body = found
            headers.update({"Nats-Sequence": str(seq), "Nats-Subject": subject})
            stored.append(_Stored(headers, body))
            seq += 1
        return stored

    # -- appends

    async def append(self, batch: _Batch, *, retried: bool = False) -> list[int]:
        """Append `batch` atomically; return the stream sequence of each of its messages.

        `retried` says an earlier attempt of this very batch may have been stored
        (its reply was lost): then a duplicate is recognised as ours, not a conflict.
        """
        await self._expect(batch, verify=not retried)
        retry = _Retry(f"appending to {self.name}", self.budget, self)
        uncertain = retried
        replans = 0
        while True:
            try:
                last_seq = await self._send(batch, retry.timeout)
            except _ServerSaid as said:
                if said.conflict:
                    if uncertain:
                        seqs = await self._landed(batch)
                        if seqs is not None:
                            return seqs
                    replans += 1
                    if replans > MAX_REPLANS:
                        raise IntegrityError(f"gave up after {MAX_REPLANS} concurrent appends: {said}") from None
                    await self._replan(batch, said)
                    continue
                if not said.transient:
                    raise OperationalError(f"appending to {self.name}: {said}") from None
                await retry.wait(said)
                continue
            except _NOT_DELIVERED as error:
                await retry.wait(error)
                continue
            except _UNANSWERED as error:
                uncertain = True  # it may have been stored
                await retry.wait(error)
                continue
            except nats.errors.MaxPayloadError:
                largest = max(len(out.data) for out in batch.outs)
                raise DataError(
                    f"a message of {largest} bytes exceeds the server's max_payload"
                ) from None
            first_seq = last_seq - len(batch.outs) + 1
            self._remember(batch, first_seq)
            return list(range(first_seq, last_seq + 1))

    async def _expect(self, batch: _Batch, verify: bool = True) -> None:
        """Fill in each guard's expected last sequence: given, remembered or looked up.

        With `verify`, a position at or below the subject's last one is refused here
        (versions are never taken back). What this process remembers is only a hint:
        a refusal is confirmed with the stream leader first.
        """
        seen = self.link.last_seen
        missing, doubtful = [], []
        for guard in batch.guards.values():
            last = seen.get(guard.subject)
            if verify and last is not None and last.position is not None and guard.first_position <= last.position:
                doubtful.append(guard)
            elif guard.given:
                continue
            elif last is not None:
                guard.expected = last.seq
            elif guard.first_position <= 1:
                guard.expected = 0  # a first version expects an empty subject; if not, the server says so
            else:
                missing.append(guard)
        if doubtful:
            found = await asyncio.gather(*(self.last_from_leader(guard.subject) for guard in doubtful))
            for guard, current in zip(doubtful, found):
                seq, headers = (current[0], current[1]) if current else (0, None)
                last = self._last_of(guard, headers, seq, authoritative=True)
                self._check_position(guard, last)
                if not guard.given:
                    guard.expected = last.seq
        if missing:
            found = await asyncio.gather(*(self.last_direct(guard.subject) for guard in missing))
            for guard, msg in zip(missing, found):
                seq = int(msg.headers["Nats-Sequence"]) if msg else 0
                last = self._last_of(guard, msg.headers if msg else None, seq)
                if verify:
                    self._check_position(guard, last)
                guard.expected = last.seq

    def _last_of(
        self, guard: _Guard, headers: Mapping[str, str] | None, seq: int, authoritative: bool = False
    ) -> _Last:
        if not seq:
            last = _Last(0, None)
        elif guard.position_header == VERSION_HEADER:
            last = _Last(seq, _version_of(headers or {}))
        else:
            value = (headers or {}).get(guard.position_header)
            last = _Last(seq, int(value) if value is not None else None)
        self.link.last_seen.put(guard.subject, last, authoritative=authoritative)
        return last

    @staticmethod
    def _check_position(guard: _Guard, last: _Last) -> None:
        if last.position is not None and guard.first_position <= last.position:
            raise IntegrityError(
                f"{guard.subject}: position {guard.first_position} is already taken (last is {last.position})"
            )

    async def _replan(self, batch: _Batch, said: _ServerSaid) -> None:
        """After a rejected append: raise IntegrityError, or update expectations to try again."""
        guards = list(batch.guards.values())
        found = await asyncio.gather(*(self.last_from_leader(guard.subject) for guard in guards))
        changed = False
        for guard, current in zip(guards, found):
            seq, headers = (current[0], current[1]) if current else (0, None)
            last = self._last_of(guard, headers, seq, authoritative=True)
            if guard.given:
                if guard.expected != last.seq:
                    raise IntegrityError(
                        f"{guard.subject}: expected last sequence {guard.expected}, found {last.seq}"
                    )
                self._check_position(guard, last)
                continue
            self._check_position(guard, last)
            if guard.expected != last.seq:
                guard.expected = last.seq
                changed = True
        if not changed:
            raise IntegrityError(f"append to {self.name} refused: {said.description}")

    async def _landed(self, batch: _Batch) -> list[int] | None:
        """If an earlier attempt of `batch` was stored, the sequences it got; else None."""
        first_seq = None
        guards = list(batch.guards.values())
        found = await asyncio.gather(*(self.last_from_leader(guard.subject) for guard in guards))
        for guard, current in zip(guards, found):
            ours = batch.outs[guard.last_index]
            if current is None:
                return None
            seq, headers, data = current
            if headers.get(MSG_ID_HEADER) != ours.headers[MSG_ID_HEADER] or data != ours.data:
                return None
            start = seq - guard.last_index
            if first_seq is not None and start != first_seq:
                return None
            first_seq = start
        assert first_seq is not None
        self._remember(batch, first_seq)
        return list(range(first_seq, first_seq + len(batch.outs)))

    def _remember(self, batch: _Batch, first_seq: int) -> None:
        for guard in batch.guards.values():
            last = _Last(first_seq + guard.last_index, guard.last_position)
            self.link.last_seen.put(guard.subject, last, authoritative=True)

    async def _send(self, batch: _Batch, timeout: float) -> int:
        """One attempt: publish the batch; the stream sequence of its last message."""
        nc = self.link.nc
        outs = batch.outs
        expectations = {guard.first_index: guard.expected for guard in batch.guards.values()}

        def headers_of(index: int, out: _Out) -> dict[str, str]:
            headers = dict(out.headers)
            expected = expectations.get(index)
            if expected is not None:
                headers[EXPECTED_SUBJECT_SEQ_HEADER] = str(expected)
            return headers

        if len(outs) == 1:
            reply = await nc.request(outs[0].subject, outs[0].data, timeout=timeout, headers=headers_of(0, outs[0]))
        else:
            batch_id = self.link.nuid.next().decode()
            for index, out in enumerate(outs[:-1]):
                headers = headers_of(index, out)
                headers[BATCH_ID_HEADER] = batch_id
                headers[BATCH_SEQ_HEADER] = str(index + 1)
                await nc.publish(out.subject, out.data, headers=headers)
            last = len(outs) - 1
            headers = headers_of(last, outs[last])
            headers[BATCH_ID_HEADER] = batch_id
            headers[BATCH_SEQ_HEADER] = str(len(outs))
            headers[BATCH_COMMIT_HEADER] = "1"
            reply = await nc.request(outs[last].subject, outs[last].data, timeout=timeout, headers=headers)
        ack = json.loads(reply.data)
        if "error" in ack:
            raise _ServerSaid.from_reply(ack)
        if ack.get("duplicate"):
            raise _ServerSaid(400, ERR_BATCH_DUPLICATE_MSG_ID, "duplicate message id")
        if len(outs) > 1 and int(ack.get("count", len(outs))) != len(outs):
            raise OperationalError(f"atomic batch stored {ack.get('count')} of {len(outs)} messages")
        return int(ack["seq"])


# --- recorders ----------------------------------------------------------------------------


class JetStreamRecorder:
    """What every JetStream recorder has: a stream on a shared link and a subject namespace."""

    def __init__(self, stream: _Stream, prefix: str, namespace: str):
        self.stream = stream
        self.prefix = prefix
        self.namespace = namespace

    @property
    def link(self) -> _Link:
        return self.stream.link

    def _add_tracking(self, batch: _Batch, tracking: Tracking) -> None:
        subject = tracking_subject(self.prefix, tracking.application_name)
        body = json.dumps(
            {"application_name": tracking.application_name, "notification_id": tracking.notification_id}
        ).encode()
        headers = {
            MSG_ID_HEADER: f"tracking:{tracking.application_name}:{tracking.notification_id}",
            TRACKING_HEADER: str(tracking.notification_id),
        }
        batch.add(_Out(subject, body, headers, tracking.notification_id, False), TRACKING_HEADER)


class JetStreamAggregateRecorder(JetStreamRecorder, AggregateRecorder):
    """Events (or snapshots) of aggregates, one subject per aggregate."""

    def insert_events(self, stored_events: Sequence[StoredEvent], **kwargs: Any) -> Sequence[int] | None:
        self._insert(stored_events, **kwargs)
        return None

    def _insert(
        self,
        stored_events: Sequence[StoredEvent],
        *,
        expected_last_seqs: Mapping[UUID | str, int] | None = None,
        tracking: Tracking | None = None,
        **_: Any,
    ) -> list[int]:
        batch = self._batch(stored_events, expected_last_seqs, tracking)
        if not batch.outs:
            return []
        seqs = self.link.call(self.stream.append(batch))
        return [seq for seq, out in zip(seqs, batch.outs) if out.is_event]

    def _batch(
        self,
        stored_events: Sequence[StoredEvent],
        expected_last_seqs: Mapping[UUID | str, int] | None,
        tracking: Tracking | None,
    ) -> _Batch:
        batch = _Batch()
        for event in stored_events:
            subject = originator_subject(self.namespace, event.originator_id)
            headers = {
                MSG_ID_HEADER: f"{event.originator_id}:{event.originator_version}",
                TOPIC_HEADER: event.topic,
                VERSION_HEADER: str(event.originator_version),
            }
            if isinstance(event.originator_id, UUID):
                headers[ID_TYPE_HEADER] = "uuid"
            batch.add(_Out(subject, event.state, headers, event.originator_version, True), VERSION_HEADER)
        if tracking is not None:
            self._add_tracking(batch, tracking)
        for originator_id, seq in (expected_last_seqs or {}).items():
            guard = batch.guards.get(originator_subject(self.namespace, originator_id))
            if guard is None:
                raise ProgrammingError(
                    f"expected_last_seqs names {originator_id!r}, which has no event in this call"
                )
            guard.expected = int(seq)
            guard.given = True
        if len(batch.outs) > MAX_BATCH_MESSAGES:
            raise ProgrammingError(
                f"{len(batch.outs)} messages in one call: an atomic append holds at most {MAX_BATCH_MESSAGES}"
            )
        return batch

    def select_events(
        self,
        originator_id: UUID | str,
        *,
        gt: int | None = None,
        lte: int | None = None,
        desc: bool = False,
        limit: int | None = None,
    ) -> Sequence[StoredEvent]:
        subject = originator_subject(self.namespace, originator_id)
        if desc and limit == 1 and lte is None:
            msgs = self.link.call(self._last(subject))
        else:
            msgs = self.link.call(self._all(subject, gt))
        events = []
        for msg in msgs:
            version = _version_of(msg.headers)
            if (gt is not None and version <= gt) or (lte is not None and version > lte):
                continue
            topic = msg.headers.get(TOPIC_HEADER) or _body_type(msg.data)
            events.append(SequencedStoredEvent(originator_id, version, topic, msg.data,
                                               int(msg.headers["Nats-Sequence"])))
        if desc:
            events.reverse()
        if limit is not None:
            events = events[:limit]
        return events

    async def _last(self, subject: str) -> list[Msg] | list[_Stored]:
        msg = await self.stream.last(subject)
        if msg is None:
            self.link.last_seen.put(subject, _Last(0, None))
            return []
        self.link.last_seen.put(subject, _Last(int(msg.headers["Nats-Sequence"]), _version_of(msg.headers)))
        return [msg]

    async def _all(self, subject: str, gt: int | None) -> list[Msg] | list[_Stored]:
        start = 1
        known = self.link.last_seen.get(subject)
        if gt is not None and known is not None and known.position is not None and known.position <= gt:
            start = known.seq + 1  # everything up to there is at or below `gt`
        msgs = await self.stream.subject_from(subject, start)
        if msgs:
            last = msgs[-1]
            self.link.last_seen.put(subject, _Last(int(last.headers["Nats-Sequence"]), _version_of(last.headers)))
        elif start == 1:
            self.link.last_seen.put(subject, _Last(0, None))
        return msgs


class JetStreamApplicationRecorder(JetStreamAggregateRecorder, ApplicationRecorder):
    """Events of an application; notification ids are stream sequences."""

    def insert_events(self, stored_events: Sequence[StoredEvent], **kwargs: Any) -> Sequence[int] | None:
        return self._insert(stored_events, **{k: v for k, v in kwargs.items() if k != "tracking"})

    def select_notifications(
        self,
        start: int | None,
        limit: int,
        stop: int | None = None,
        topics: Sequence[str] = (),
        *,
        inclusive_of_start: bool = True,
    ) -> Sequence[Notification]:
        first = 1 if start is None else (start if inclusive_of_start else start + 1)
        if limit <= 0 or (stop is not None and stop < first):
            return []
        wanted = set(topics)
        keep = (lambda msg: msg.headers.get(TOPIC_HEADER) in wanted) if wanted else None
        msgs = self.link.call(
            self.stream.read(f"{self.namespace}.>", first, stop=stop, limit=limit, keep=keep)
        )
        return [self._notification(msg) for msg in msgs]

    def _notification(self, msg: Msg) -> Notification:
        headers = msg.headers
        return notification_from_message(
            self.prefix, int(headers["Nats-Sequence"]), headers["Nats-Subject"], headers, msg.data
        )

    def max_notification_id(self) -> int | None:
        msg = self.link.call(self.stream.last_direct(f"{self.namespace}.>"))
        return int(msg.headers["Nats-Sequence"]) if msg is not None else None

    def subscribe(self, gt: int | None = None, topics: Sequence[str] = ()) -> "JetStreamSubscription":
        return JetStreamSubscription(self, gt=gt, topics=topics)


class JetStreamTrackingRecorder(JetStreamRecorder, TrackingRecorder):
    """Tracking records on `<prefix>.tracking.<application>`: the last one is the position."""

    def insert_tracking(self, tracking: Tracking) -> None:
        batch = _Batch()
        self._add_tracking(batch, tracking)
        self.link.call(self.stream.append(batch))

    def max_tracking_id(self, application_name: str) -> int | None:
        msg = self.link.call(self.stream.last(tracking_subject(self.prefix, application_name)))
        if msg is None:
            return None
        return int(msg.headers[TRACKING_HEADER])


class JetStreamProcessRecorder(JetStreamTrackingRecorder, JetStreamApplicationRecorder, ProcessRecorder):
    """Events and the tracking record of the step that caused them, in one atomic batch."""

    def insert_events(self, stored_events: Sequence[StoredEvent], **kwargs: Any) -> Sequence[int] | None:
        return self._insert(stored_events, **kwargs)


# --- subscriptions ----------------------------------------------------------------------------

_STOP = object()


class JetStreamSubscription(Subscription[JetStreamApplicationRecorder]):
    """Recorded events after `gt`, then new ones as they are appended (an ordered consumer)."""

    def __init__(self, recorder: JetStreamApplicationRecorder, gt: int | None = None, topics: Sequence[str] = ()):
        super().__init__(recorder=recorder, gt=gt, topics=topics)
        self._wanted = set(topics)
        self._buffer: queue.Queue[Any] = queue.Queue(maxsize=SUBSCRIPTION_BUFFER)
        self._consumer: Any = None
        self._lock = threading.Lock()
        self._consumer = recorder.link.call(self._start(gt))
        recorder.link.subscriptions.add(self)

    async def _start(self, gt: int | None) -> Any:
        recorder = self._recorder
        buffer = self._buffer

        async def deliver(msg: Msg) -> None:
            item = (msg.reply, msg.subject, msg.headers, msg.data)
            while not self._has_been_stopped:
                try:
                    buffer.put_nowait(item)
                    return
                except queue.Full:  # the reader is behind: hold the consumer (flow control)
                    await asyncio.sleep(0.005)

        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if gt else DeliverPolicy.ALL,
            opt_start_seq=gt + 1 if gt else None,
        )
        js = recorder.link.nc.jetstream()
        return await js.subscribe(
            f"{recorder.namespace}.>",
            stream=recorder.stream.name,
            cb=deliver,
            ordered_consumer=True,
            idle_heartbeat=IDLE_HEARTBEAT,
            config=config,
        )

    def __next__(self) -> Notification:
        while True:
            if self._has_been_stopped:
                raise StopIteration
            item = self._buffer.get()
            if item is _STOP or self._has_been_stopped:
                raise StopIteration
            reply, subject, headers, data = item
            notification = notification_from_message(self._recorder.prefix, ack_positions(reply)[0], subject, headers, data)
            if self._wanted and notification.topic not in self._wanted:
                continue
            self._last_notification_id = notification.id
            return notification

    def stop(self) -> None:
        with self._lock:
            if self._has_been_stopped:
                return
            super().stop()
        try:
            self._buffer.put_nowait(_STOP)
        except queue.Full:
            pass  # __next__ checks the flag first
        consumer, self._consumer = self._consumer, None
        link = self._recorder.link
        if consumer is not None and not link.closed:
            link.spawn(_unsubscribe(consumer))


async def _unsubscribe(consumer: Any) -> None:
    try:
        await consumer.unsubscribe()
    except nats.errors.Error:
        pass


# --- factory -----------------------------------------------------------------------------------


class JetStreamFactory(InfrastructureFactory[JetStreamTrackingRecorder]):
    """The eventsourcing infrastructure factory of this module."""

    NATS_URL = "NATS_URL"
    WARMBOOT_PREFIX = "WARMBOOT_PREFIX"
    WARMBOOT_STREAM_REPLICAS = "WARMBOOT_STREAM_REPLICAS"
    WARMBOOT_STORE_TIMEOUT = "WARMBOOT_STORE_TIMEOUT"
    CREATE_TABLE = "CREATE_TABLE"

    aggregate_recorder_class = JetStreamAggregateRecorder
    application_recorder_class = JetStreamApplicationRecorder
    tracking_recorder_class = JetStreamTrackingRecorder
    process_recorder_class = JetStreamProcessRecorder

    def __init__(self, env: Environment | EnvType | None):
        super().__init__(env)
        self.prefix = check_prefix(self.env.get(self.WARMBOOT_PREFIX) or DEFAULT_PREFIX)
        self.replicas = int(self.env.get(self.WARMBOOT_STREAM_REPLICAS) or 1)
        self.budget = float(self.env.get(self.WARMBOOT_STORE_TIMEOUT) or DEFAULT_STORE_TIMEOUT)
        self.options = ConnectOptions.from_env(self.env)
        self.link = _acquire(self.options)
        self._closed = False

    def _create(self) -> bool:
        return bool(strtobool(self.env.get(self.CREATE_TABLE) or "yes"))

    def _stream(self, purpose: str) -> tuple[_Stream, str]:
        """The stream of `purpose` (ready to use) and the subject namespace of its aggregates."""
        if purpose == EVENTS_PURPOSE:
            namespace = events_namespace(self.prefix)
            subjects = [f"{namespace}.>", f"{self.prefix}.{TRACKING_TOKEN}.>"]
            limit = -1
        else:
            if not _TOKEN.match(purpose) or purpose in (EVENTS_TOKEN, TRACKING_TOKEN):
                raise ProgrammingError(f"recorder purpose {purpose!r} cannot name a stream")
            namespace = f"{self.prefix}.{purpose}"
            subjects = [f"{namespace}.>"]
            limit = SNAPSHOTS_KEPT if purpose == "snapshots" else -1
        name = stream_name(self.prefix) if purpose == EVENTS_PURPOSE else (
            f"{self.prefix.upper().replace('-', '_')}_{purpose.upper()}"
        )
        stream = _Stream(self.link, name, subjects, self.replicas, self.budget, limit)
        self.link.call(stream.ensure(self._create()))
        return stream, namespace

    def aggregate_recorder(self, purpose: str = "events") -> AggregateRecorder:
        stream, namespace = self._stream(purpose)
        return self.aggregate_recorder_class(stream, self.prefix, namespace)

    def application_recorder(self) -> ApplicationRecorder:
        cls = self._recorder_class(self.APPLICATION_RECORDER_TOPIC, self.application_recorder_class)
        stream, namespace = self._stream(EVENTS_PURPOSE)
        return cls(stream, self.prefix, namespace)

    def tracking_recorder(
        self, tracking_recorder_class: type[JetStreamTrackingRecorder] | None = None
    ) -> JetStreamTrackingRecorder:
        cls = tracking_recorder_class or self._recorder_class(
            self.TRACKING_RECORDER_TOPIC, self.tracking_recorder_class
        )
        stream, namespace = self._stream(EVENTS_PURPOSE)
        return cls(stream, self.prefix, namespace)

    def process_recorder(self) -> ProcessRecorder:
        cls = self._recorder_class(self.PROCESS_RECORDER_TOPIC, self.process_recorder_class)
        stream, namespace = self._stream(EVENTS_PURPOSE)
        return cls(stream, self.prefix, namespace)

    def _recorder_class(self, topic_key: str, default: type) -> type:
        topic = self.env.get(topic_key)
        if not topic:
            return default
        cls = resolve_topic(topic)
        if not (isinstance(cls, type) and issubclass(cls, JetStreamRecorder)):
            raise ProgrammingError(f"{topic_key}={topic!r} is not a JetStream recorder class")
        return cls

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            _release(self.link)


Factory = JetStreamFactory

__all__ = [
    "TOPIC_HEADER",
    "VERSION_HEADER",
    "ID_TYPE_HEADER",
    "TRACKING_HEADER",
    "MSG_ID_HEADER",
    "MAX_BATCH_MESSAGES",
    "StoreUnavailableError",
    "JetStreamFactory",
    "JetStreamAggregateRecorder",
    "JetStreamApplicationRecorder",
    "JetStreamTrackingRecorder",
    "JetStreamProcessRecorder",
    "JetStreamSubscription",
    "originator_subject",
    "originator_of",
    "tracking_subject",
    "notification_from_message",
]
