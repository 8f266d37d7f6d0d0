"""What every warmboot service shares: nats.micro endpoints with contract errors,
request_id idempotency, the request client, and the metrics server.

A service handler is `async (entity_id, request) -> reply Struct`; it raises
`ContractError` to refuse. `add_endpoints` turns that into a micro endpoint that
decodes and validates the body at the edge, answers errors exactly as CONTRACT
section 1 says (body and `Nats-Service-Error*` headers) and never leaks a traceback.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.micro import ServiceConfig
from nats.micro.request import Request
from nats.micro.service import Service

from events.codec import decode_reply, decode_request, encode
from events.errors import ContractError, invalid, unavailable
from events.schema import ID_PATTERN, Base, ErrorCode
from events.subjects import bucket_name, service_subject

log = logging.getLogger("warmboot.service")
T = TypeVar("T")
_ID = re.compile(ID_PATTERN)

VERSION = "1.0.0"
Handler = Callable[[str | None, Any], Awaitable[Base]]


@dataclass(frozen=True)
class EndpointSpec:
    """One request subject: `<prefix>.<service>.<verb>[.<entity_id>]`."""

    verb: str
    request_type: type
    handler: Handler
    per_entity: bool = True  # the subject ends with an entity id token


def error_headers(error: ContractError) -> dict[str, str]:
    return {"Nats-Service-Error": error.message[:512], "Nats-Service-Error-Code": str(error.status)}


async def respond_error(request: Request, error: ContractError) -> None:
    await request.respond(encode(error.reply()), headers=error_headers(error))


def wrap(spec: EndpointSpec, service: str) -> Callable[[Request], Awaitable[None]]:
    async def handle(request: Request) -> None:
        try:
            entity_id = None
            if spec.per_entity:
                entity_id = request.subject.rsplit(".", 1)[-1]
                if not _ID.match(entity_id):
                    raise invalid(f"subject token {entity_id!r} is not a valid id", "subject")
            body = decode_request(spec.request_type, request.data)
            reply = await spec.handler(entity_id, body)
            await request.respond(encode(reply))
        except ContractError as error:
            await respond_error(request, error)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: log it here, tell the caller no more than that
            log.exception("%s.%s failed on %s", service, spec.verb, request.subject)
            internal = ContractError(ErrorCode.INTERNAL, "internal error; the service log has the details")
            await respond_error(request, internal)

    return handle


MAX_CONCURRENT_REQUESTS = 256


class MicroService(Service):
    """A nats.micro service whose endpoints answer requests concurrently.

    nats.micro awaits each handler before it reads the endpoint's next message, so a
    handler that waits on the store would serialise every request of the replica.
    Handlers added through `concurrently` start each request as a task (at most
    MAX_CONCURRENT_REQUESTS at once; past that the subscription waits), and `stop`
    lets the ones in flight finish.
    """

    def __init__(self, nc: NATS, config: ServiceConfig, max_concurrent: int = MAX_CONCURRENT_REQUESTS):
        super().__init__(nc, config)
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(max_concurrent)

    def concurrently(self, handle: Callable[[Request], Awaitable[None]]) -> Callable[[Request], Awaitable[None]]:
        def finished(task: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            self._slots.release()

        async def handler(request: Request) -> None:
            await self._slots.acquire()
            task = asyncio.create_task(handle(request))
            self._tasks.add(task)
            task.add_done_callback(finished)

        return handler

    async def stop(self, drain_s: float = 10.0) -> None:
        await super().stop()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=drain_s)


async def add_endpoints(
    nc: NATS, prefix: str, service: str, description: str, specs: list[EndpointSpec],
    max_concurrent: int = MAX_CONCURRENT_REQUESTS,
) -> MicroService:
    """Start the micro service `warmboot-<service>` in the queue group of that name."""
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
    )
    await svc.start()
    for spec in specs:
        subject = service_subject(prefix, service, spec.verb, "*" if spec.per_entity else None)
        await svc.add_endpoint(name=spec.verb, subject=subject, handler=svc.concurrently(wrap(spec, service)))
    await nc.flush()  # the server has the subscriptions: requests sent after this are served
    return svc


# --- idempotency ------------------------------------------------------------------


class ReplyCache:
    """The first answer to each `request_id`, shared by every replica (JetStream KV).

    A replica also folds concurrent duplicates it receives itself onto one
    computation. When a reply is lost *and* the cache write is lost (a crash
    between commit and put), services fall back to the entity's history:
    every event carries the `request_id` that caused it.
    """

    def __init__(self, nc: NATS, prefix: str, ttl_s: float = 3600.0):
        self.nc = nc
        self.bucket = bucket_name(prefix, "replies")
        self.ttl_s = ttl_s
        self.kv = None
        self._inflight: dict[str, asyncio.Future[bytes]] = {}

    async def start(self) -> "ReplyCache":
        js = self.nc.jetstream()
        self.kv = await js.create_key_value(
            KeyValueConfig(bucket=self.bucket, ttl=self.ttl_s, storage=StorageType.FILE, history=1,
                           replicas=stream_replicas())
        )
        return self

    @staticmethod
    def key(scope: str, request_id: str) -> str:
        return f"{scope}.{hashlib.sha256(request_id.encode()).hexdigest()[:40]}"

    async def get(self, key: str) -> bytes | None:
        try:
            entry = await self.kv.get(key)
        except (KeyNotFoundError, NotFoundError):
            return None
        return entry.value or None

    async def once(
        self, scope: str, request_id: str | None, compute: Callable[[], Awaitable[Base]], reply_type: type[T]
    ) -> T:
        """Answer `compute()` once per (scope, request_id); repeats get the first answer.

        Errors are not cached: a refused request wrote nothing, so trying again is safe.
        """
        if request_id is None:
            return await compute()
        key = self.key(scope, request_id)
        running = self._inflight.get(key)
        if running is not None:
            return msgspec.json.decode(await asyncio.shield(running), type=reply_type)
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            cached = await self.get(key)
            if cached is not None:
                future.set_result(cached)
                return msgspec.json.decode(cached, type=reply_type)
            reply = await compute()
            data = encode(reply)
            try:
                await self.kv.put(key, data)
            except Exception:  # the history fallback still answers a retry correctly
                log.warning("could not cache the reply to request %s", key, exc_info=True)
            future.set_result(data)
            return reply
        except BaseException as error:
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: no "never retrieved" warning
            raise
        finally:
            self._inflight.pop(key, None)


def stream_replicas() -> int:
    """Replicas of the streams and buckets a service creates: WARMBOOT_STREAM_REPLICAS, else 1."""
    return int(os.environ.get("WARMBOOT_STREAM_REPLICAS") or 1)


def store_env(nats_url: str, prefix: str, replicas: int | None = None) -> dict[str, str]:
    """The eventsourcing environment that selects the JetStream event store for a deployment.

    Without `replicas`, the stream's replica count comes from the process environment
    (WARMBOOT_STREAM_REPLICAS, which `warmboot serve --replicas` sets), else 1.
    """
    env = {"PERSISTENCE_MODULE": "events.jetstream", "NATS_URL": nats_url, "WARMBOOT_PREFIX": prefix}
    if replicas is not None:
        env["WARMBOOT_STREAM_REPLICAS"] = str(replicas)
    return env


async def run_command(command: Callable[[], T], attempts: int = 8) -> T:
    """Run a load-decide-save `command` off the event loop, again on a lost OCC race.

    `command` must re-read what it decides on each time (the repository does), so
    a retry decides on fresh state. After `attempts` lost races: UNAVAILABLE.
    """
    from eventsourcing.persistence import IntegrityError

    for _ in range(attempts):
        try:
            return await asyncio.to_thread(command)
        except IntegrityError:
            continue
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


def start_metrics(port: int | None, host: str = "127.0.0.1") -> int | None:
    """Serve prometheus-client's default registry on `port` (0: any free port)."""
    if port is None:
        return None
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host)
    return server.server_port
