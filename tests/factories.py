"""Typed bodies and log readers the bus tests share (and bench/ too): one definition each.

Bodies are the schema's Structs (`events.schema`), so a test says what a caller sends
in the contract's own terms; `warmboot.client.Client` sends them.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone
from typing import Any, Callable

from nats.aio.client import Client as NATS
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from events.codec import decode_event
from events.schema import (
    ActorOverhead,
    ActorRuntime,
    Attribute,
    CompatVersion,
    CreateActor,
    Event,
    Fidelity,
    Location,
    RegisterWorker,
    Resources,
    Snapshot,
    WorkerRuntime,
    WorkerSandboxClass,
)
from events.subjects import stream_name

CLASS = "gvisor"
AT = datetime(2026, 12, 1, tzinfo=timezone.utc)


def version(build: str, arch: str = "amd64", schema: str = "v1", **extra: str) -> CompatVersion:
    """A runtime version told apart by `build` (its asset digest) and `arch`."""
    pairs = {"architecture": arch, "gvisor_asset_hash": build, **extra}
    return CompatVersion(schema_version=schema, attributes=tuple(Attribute(key=k, value=v) for k, v in pairs.items()))


def runtime(v: CompatVersion, name: str | None = None, overhead: int = 0,
            compatible: tuple[CompatVersion, ...] = ()) -> WorkerRuntime:
    return WorkerRuntime(version=v, name=name, actor_overhead=ActorOverhead(fixed_mib=overhead, per_gib_mib=0),
                         compatible_versions=compatible)


def stamp(v: CompatVersion, sandbox_class: str = CLASS) -> ActorRuntime:
    return ActorRuntime(sandbox_class=sandbox_class, version=v)


def worker(worker_id: str, default: CompatVersion | WorkerRuntime, restorable: tuple = (), *, node: str | None = None,
           cpu: int = 4000, mem: int = 4096, labels: dict[str, str] | None = None, sandbox_class: str = CLASS,
           request_id: str | None = None) -> RegisterWorker:
    def rt(r: CompatVersion | WorkerRuntime) -> WorkerRuntime:
        return r if isinstance(r, WorkerRuntime) else runtime(r)

    return RegisterWorker(
        worker_id=worker_id, node=node or f"node-{worker_id}",
        capacity=Resources(cpu_millis=cpu, memory_mib=mem), labels=labels or {},
        sandbox_classes=(WorkerSandboxClass(sandbox_class=sandbox_class, default_runtime=rt(default),
                                            restorable_runtimes=tuple(rt(r) for r in restorable)),),
        request_id=request_id,
    )


def golden(v: CompatVersion, *, snapshot_id: str = "golden-1", template: str = "t1",
           fidelity: Fidelity = Fidelity.MEMORY, sandbox_class: str = CLASS, **fields: Any) -> Snapshot:
    """An EXTERNAL golden snapshot stamped `v`."""
    return Snapshot(snapshot_id=snapshot_id, actor_id="golden", template_uid=template, fidelity=fidelity,
                    location=Location.EXTERNAL, uri=f"s3://golden/{snapshot_id}",
                    sandbox_runtime=stamp(v, sandbox_class), taken_at=AT, **fields)


def actor(actor_id: str, *, cpu: int = 500, mem: int = 1024, template: str = "t1",
          min_fidelity: Fidelity = Fidelity.ROOTFS, selectors: dict[str, str] | None = None,
          golden_snapshot: Snapshot | None = None, source_tag: str | None = None,
          sandbox_class: str = CLASS, request_id: str | None = None) -> CreateActor:
    return CreateActor(actor_id=actor_id, sandbox_class=sandbox_class, template_uid=template,
                       resources=Resources(cpu_millis=cpu, memory_mib=mem), selectors=selectors or {},
                       min_fidelity=min_fidelity, golden_snapshot=golden_snapshot, source_tag=source_tag,
                       request_id=request_id)


# --- the log ---------------------------------------------------------------------------------


async def last_seq(nc: NATS, prefix: str) -> int:
    """The stream's last sequence (0 before the first event)."""
    try:
        return (await nc.jetstream().stream_info(stream_name(prefix))).state.last_seq
    except NotFoundError:
        return 0


async def read_log(nc: NATS, prefix: str, subject: str | None = None) -> list[tuple[int, Event]]:
    """Every event of the stream (or of one subject), in stream order, with its sequence;
    messages that are not events (tracking records) are left out."""
    js = nc.jetstream()
    end = await last_seq(nc, prefix)
    if not end:
        return []
    sub = await js.subscribe(subject or f"{prefix}.>", stream=stream_name(prefix), ordered_consumer=True)
    out: list[tuple[int, Event]] = []
    try:
        while True:
            msg = await sub.next_msg(timeout=10)
            seq = msg.metadata.sequence.stream
            if msg.subject.startswith(f"{prefix}.ev."):
                out.append((seq, decode_event(msg.data)))
            if seq >= end or (subject and msg.metadata.num_pending == 0):
                return out
    finally:
        await sub.unsubscribe()


async def wait_for(nc: NATS, prefix: str, found: Callable[[Event], bool], *, after: int = 0,
                   timeout: float = 20.0) -> tuple[int, Event]:
    """The first event after sequence `after` for which `found` is true, as soon as it is stored
    (an ordered consumer reads the stream live); `timeout` only bounds a failure."""
    js = nc.jetstream()
    deadline = time.monotonic() + timeout
    start = {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE, "config": ConsumerConfig(opt_start_seq=after + 1)} \
        if after else {}
    sub = await js.subscribe(f"{prefix}.ev.>", stream=stream_name(prefix), ordered_consumer=True, **start)
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no matching event after sequence {after} within {timeout}s")
            try:
                msg = await sub.next_msg(timeout=remaining)
            except asyncio.TimeoutError:
                continue
            event = decode_event(msg.data)
            if found(event):
                return msg.metadata.sequence.stream, event
    finally:
        await sub.unsubscribe()
