"""Helpers for the registry and agent tests: bodies, requests, and waiting on the event log."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import shutil
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from events.codec import decode_event, encode
from events.schema import Event, RegisterWorker
from events.subjects import bucket_name, event_subject, service_subject, stream_name
from services.process import store_env
from services.registry.budget import WriteBudget
from services.registry.service import RegistryService
from tests.factories import ordered_subscription
from warmboot.agent import Agent
from warmboot.agent_config import ProbeSettings

CPUINFO = Path(__file__).parent / "cpuinfo" / "intel-xeon-8480.txt"
AMD = Path(__file__).parent / "cpuinfo" / "amd-epyc-7r13.txt"
PROBE = ProbeSettings(cpuinfo_path=CPUINFO, architecture="amd64")


def attrs(**pairs: str) -> list[dict[str, str]]:
    return [{"key": k, "value": v} for k, v in pairs.items()]


def runtime(asset: str, name: str | None = None, order: str = "forward", **more: str) -> dict[str, Any]:
    """A v1 runtime of class gvisor with asset digest `asset`; `order` shuffles its attributes."""
    pairs = attrs(architecture="amd64", cpu_features="0ac853df914e2ca0", gvisor_asset_hash=asset, **more)
    if order == "reverse":
        pairs = pairs[::-1]
    body: dict[str, Any] = {"version": {"schema_version": "v1", "attributes": pairs}}
    if name is not None:
        body["name"] = name
    return body


def registration(
    worker_id: str,
    default: dict | None = None,
    restorable: list[dict] | None = None,
    *,
    node: str = "node-a",
    cpu: int = 4000,
    memory: int = 8192,
    labels: dict[str, str] | None = None,
    classes: list[dict] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    if classes is None:
        classes = [
            {
                "sandbox_class": "gvisor",
                "default_runtime": default or runtime("v1"),
                "restorable_runtimes": restorable or [],
            }
        ]
    return {
        "worker_id": worker_id,
        "node": node,
        "capacity": {"cpu_millis": cpu, "memory_mib": memory},
        "labels": labels if labels is not None else {"zone": "a"},
        "sandbox_classes": classes,
        **extra,
    }


async def raw_request(nc: NATS, prefix: str, verb: str, worker_id: str, body: Any, timeout: float = 10.0):
    """(decoded reply dict, headers) of one registry request; body may be raw bytes."""
    data = body if isinstance(body, bytes) else encode(body)
    msg = await nc.request(service_subject(prefix, "registry", verb, worker_id), data, timeout=timeout)
    return msgspec.json.decode(msg.data), (msg.headers or {})


async def worker_events(nc: NATS, prefix: str, worker_id: str, kind: str = "worker") -> list[tuple[int, Event]]:
    """Every event on the worker's subject, in order, with its stream sequence (`kind` "*": its booking
    subject's too, the `WorkerFenced` each write of its history carries, and placements)."""
    js = nc.jetstream()
    subject = event_subject(prefix, kind, worker_id)
    events: list[tuple[int, Event]] = []
    seq = 0
    while True:
        try:
            msg = await js.get_msg(stream_name(prefix), seq=seq + 1, subject=subject, next=True)
        except NotFoundError:
            return events
        seq = msg.seq
        events.append((seq, decode_event(msg.data)))


async def wait_event(
    nc: NATS, prefix: str, worker_id: str, event_type: type | tuple[type, ...], *, after: int = 0,
    timeout: float = 20.0
) -> tuple[int, Event]:
    """The first event of `event_type` (a type, or a tuple of types) on the worker's subject with
    a sequence above `after`.

    Reads the stream with an ordered consumer: returns as soon as the event is
    stored; `timeout` only bounds a failure.
    """
    js = nc.jetstream()
    subject = event_subject(prefix, "worker", worker_id)
    deadline = time.monotonic() + timeout
    wanted = " or ".join(t.__name__ for t in event_type) if isinstance(event_type, tuple) else event_type.__name__
    sub = await ordered_subscription(js, subject, stream_name(prefix), deadline_s=timeout)
    seen: list[str] = []  # the other events after `after`, for the failure's message
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {wanted} for {worker_id} within {timeout}s; after {after}: {seen}")
            try:
                msg = await sub.next_msg(timeout=remaining)
            except (asyncio.TimeoutError, nats.errors.TimeoutError):
                raise AssertionError(f"no {wanted} for {worker_id} within {timeout}s; after {after}: {seen}") from None
            event = decode_event(msg.data)
            if msg.metadata.sequence.stream > after and isinstance(event, event_type):
                return msg.metadata.sequence.stream, event
            if msg.metadata.sequence.stream > after:
                seen.append(f"{msg.metadata.sequence.stream} {type(event).__name__}"
                            f"{' ' + str(getattr(event, 'reason', '')) if hasattr(event, 'reason') else ''}")
    finally:
        await sub.unsubscribe()


async def expiry_marker(nc, prefix: str, worker_id: str) -> None:
    """Return once the server has expired the worker's heartbeat (its MaxAge marker is stored)."""
    bucket = bucket_name(prefix, "heartbeats")
    sub = await nc.jetstream().subscribe(f"$KV.{bucket}.{worker_id}", stream=f"KV_{bucket}", ordered_consumer=True)
    deadline = time.monotonic() + 30.0  # the key's beats go on coming while the worker beats: not each one's wait
    try:
        while (msg := await sub.next_msg(timeout=max(deadline - time.monotonic(), 0.001))).headers is None or \
                msg.headers.get("Nats-Marker-Reason") != "MaxAge":
            pass
    finally:
        await sub.unsubscribe()


@asynccontextmanager
async def running_registry(nats_url: str, prefix: str, ttl_s: float = 15.0, own_link: bool = False,
                           writes: WriteBudget | None = None, reconcile_interval_s: float | None = None,
                           via: str | None = None, heard: dict[str, Any] | None = None):
    """A registry replica with its own connection, on the JetStream event store; with `own_link`,
    an event-store connection of its own too (another inbox prefix), as another process has, so
    that nothing this process read or wrote is known to it. `writes`: the workers' write budget
    (the default's, if not given); `reconcile_interval_s`: how often it reconciles heartbeats while
    it runs (the default's, if not given); `via`: the URL its own connection (not its event
    store's) is made to, a proxy of the server's, say; `heard`: verbs (`register`, `heartbeat`, `drain`, ...)
    whose requests are each handed to a function as they arrive, before they are answered
    (`{"heartbeat": queue.put_nowait}`; `counting`)."""
    nc = await nats.connect(via or nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    env = None
    if own_link:
        env = store_env(nats_url, prefix)
        env["NATS_INBOX_PREFIX"] = f"{env['NATS_INBOX_PREFIX']}.own-link"
    more = {} if reconcile_interval_s is None else {"reconcile_interval_s": reconcile_interval_s}
    service = RegistryService(nc, nats_url=nats_url, prefix=prefix, ttl_s=ttl_s, env=env, writes=writes, **more)
    for verb, to in (heard or {}).items():
        setattr(service, verb, counting(getattr(service, verb), to))
    await service.start()
    try:
        yield service
    finally:
        await service.stop()
        await nc.close()


def counting(handler, heard):
    """A registry's handler of a verb (heartbeat, register, drain) that hands each request to `heard` as it
    arrives, then answers it; once what `heard` returns is done, if it returns an awaitable (a request held
    until the test releases it)."""
    async def counted(worker_id, request):
        held = heard(request)
        if inspect.isawaitable(held):
            await held
        return await handler(worker_id, request)
    return counted


class Holding:
    """A `heard` function (`running_registry`) that holds at the registry each request `which(request)` picks,
    from when `armed` is set until the test releases them (`release`, or leaving `async with holding:`); the first
    one held sets `held`."""

    def __init__(self, which: Callable[[Any], bool] = lambda request: True, armed: bool = True):
        self.which, self.armed = which, armed
        self.held, self.released = asyncio.Event(), asyncio.Event()

    def __call__(self, request) -> Any:
        if not self.armed or self.released.is_set() or not self.which(request):
            return None
        self.held.set()
        return self.released.wait()

    def release(self) -> None:
        self.released.set()

    async def __aenter__(self) -> "Holding":
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()  # before the registry stops: it waits for the requests it answers


def body(worker_id: str) -> RegisterWorker:
    """`registration(worker_id)` as the registry's `register` takes it."""
    return msgspec.convert(registration(worker_id), RegisterWorker)


def heard_for_long(*replicas: RegistryService) -> None:
    """Each replica takes an expiry marker as a silence at once, as one that has heard beats for a whole TTL
    does (`services.registry.liveness.Hearing`): for tests of what a removal as LOST does, on replicas that
    started a moment ago (which give such a worker a new clock first)."""
    for replica in replicas:
        replica.hearing.heard_for = lambda: math.inf


def agent_config(default_asset: str, restorable_assets: tuple[str, ...] = (), memory_mib: int = 8192) -> str:
    """An agent config of one gvisor class: defaults probed, asset digests literal."""
    text = f"""
[capacity]
cpu_millis = 4000
memory_mib = {memory_mib}

[labels]
zone = "a"

[[sandbox_classes]]
sandbox_class = "gvisor"

[sandbox_classes.default_runtime]
name = "gvisor-{default_asset}"
profile = "gvisor"
attributes = {{ gvisor_asset_hash = "{default_asset}" }}
actor_overhead = {{ fixed_mib = 16, per_gib_mib = 2 }}
"""
    for asset in restorable_assets:
        text += f"""
[[sandbox_classes.restorable_runtimes]]
name = "gvisor-{asset}"
profile = "gvisor"
attributes = {{ gvisor_asset_hash = "{asset}" }}
"""
    return text


def without_cpu_features(cpuinfo: Path) -> None:
    """The machine's cpuinfo without its flags: the probe cannot read `cpu_features` of it."""
    cpuinfo.write_text("".join(line for line in CPUINFO.read_text().splitlines(keepends=True)
                               if not line.startswith("flags")))


def counted_probe(cpuinfo: Path) -> tuple[ProbeSettings, asyncio.Queue]:
    """A probe of the amd64 machine whose cpuinfo is `cpuinfo`, and a queue that each of its reads, made or
    failed, puts None on as it ends: a test awaits the agent's reads of the machine (and what it decides on
    each, at the watch that made it), not a time."""
    reads: asyncio.Queue = asyncio.Queue()

    class Counted(ProbeSettings):
        def read(self):
            try:
                return super().read()
            finally:
                reads.put_nowait(None)

    return Counted(cpuinfo_path=cpuinfo, architecture="amd64"), reads


async def reads_after(reads: asyncio.Queue, count: int, timeout_s: float = 20) -> None:
    """`count` reads of the machine (`counted_probe`) made after this call."""
    while not reads.empty():
        reads.get_nowait()
    for _ in range(count):
        await asyncio.wait_for(reads.get(), timeout_s)


def a_machine(tmp_path: Path, nats_url: str, prefix: str) -> tuple[Agent, Path, Path]:
    """An agent of `w-a` (one gvisor class, asset v1) on a machine whose cpuinfo the test swaps,
    read again every 0.05 s (it starts as CPUINFO), a read the probe cannot make counting at the second
    in a row (no grace): (the agent, its cpuinfo, its config file)."""
    cpuinfo = tmp_path / "cpuinfo"
    shutil.copy(CPUINFO, cpuinfo)
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    agent = Agent(nats_url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe_interval_s=0.05,
                  unreadable_grace_s=0.0, probe=ProbeSettings(cpuinfo_path=cpuinfo, architecture="amd64"))
    return agent, cpuinfo, path


class Said(logging.Handler):
    """A logger's lines, as they are said: every one (`lines`), and awaited one after the other (`until`),
    not polled."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self._new: asyncio.Queue[str] = asyncio.Queue()

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        self.lines.append(line)
        self._new.put_nowait(line)

    async def until(self, words: str, timeout_s: float = 20) -> list[str]:
        """The lines said since the last `until`, up to the next one holding `words`, that one included, within
        `timeout_s` in all (an agent that says something else every beat would otherwise be waited on for ever)."""
        said: list[str] = []
        deadline = time.monotonic() + timeout_s
        while not said or words not in said[-1]:
            try:
                said.append(await asyncio.wait_for(self._new.get(), max(deadline - time.monotonic(), 0.001)))
            except asyncio.TimeoutError:
                raise AssertionError(f"no line saying {words!r} within {timeout_s:g}s; said meanwhile: {said}") from None
        return said

    def matching(self, words: str) -> list[str]:
        """Every line said that holds `words`."""
        return [line for line in self.lines if words in line]


@asynccontextmanager
async def agent_said() -> AsyncIterator[Said]:
    """What the agent's logger (`warmboot.agent`) says, at INFO and above, while the block runs."""
    logger = logging.getLogger("warmboot.agent")
    said, level = Said(), logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(said)
    try:
        yield said
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
