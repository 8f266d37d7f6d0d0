"""Typed bodies, events and log helpers the tests share (and bench/ too): one definition each.

Bodies are the schema's Structs (`events.schema`), so a test says what a caller sends
in the contract's own terms; `warmboot.client.Client` sends them. Events are what the
services write, for tests that build a log themselves: folded without a bus (`Log`,
`fold`) or appended straight into the stream (`Writer`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime, timezone
from types import EllipsisType
from typing import Any, AsyncIterator, Callable, ClassVar, Protocol, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from eventsourcing.persistence import OperationalError
from nats.aio.client import Client as NATS
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from events.aggregate import WireApplication
from events.codec import decode_event, encode
from events.errors import ContractError
from events.jetstream import MSG_ID_HEADER, TOPIC_HEADER, VERSION_HEADER
from events.jetstream.layout import sequence_of
from events.schema import (
    Action,
    ActorCreated,
    ActorOverhead,
    ActorPlaced,
    ActorReleased,
    ActorRuntime,
    Attribute,
    CompatVersion,
    CreateActor,
    ErrorCode,
    Event,
    Fallback,
    Fidelity,
    Location,
    PlacedFidelity,
    RegisterWorker,
    ReleaseReason,
    Resources,
    Snapshot,
    SnapshotOrigin,
    SnapshotTaken,
    WorkerBooked,
    WorkerDrained,
    WorkerRegistered,
    WorkerRuntime,
    WorkerSandboxClass,
)
from events.subjects import stream_name
from services.process import store_env
from services.scheduler.committer import placed_event
from services.scheduler.decide import decide
from services.scheduler.explain import explain
from services.scheduler.projection import Projection
from services.streams import leaders_stream_info, until_answered

CLASS = "gvisor"
AT = datetime(2026, 12, 1, tzinfo=timezone.utc)


class NewerWorkerEvent(Event, kw_only=True):
    """An event a newer registry might add to a worker's history (the contract allows new events), which
    this version cannot read: a removal, a cordon, a change of runtimes, a registration, as `what` says.
    Not a WorkerEvent subclass: this process's registry would take it for one of its own."""

    worker_id: str
    what: str
    KIND: ClassVar[str] = "worker"

    @property
    def entity_id(self) -> str:
        return self.worker_id
# The registry's heartbeat TTL where the workers a test registers do not heartbeat: longer than
# any test. With the default 15 s, a test slowed by a busy machine lost its workers as LOST mid-way
# (one loaded full run of ten). Liveness has its own tests, with short TTLs.
SILENT_TTL_S = 600.0


def version(build: str, arch: str = "amd64", schema: str = "v1", **extra: str) -> CompatVersion:
    """A runtime version told apart by `build` (its asset digest) and `arch`; attributes sorted
    by key, as the registry stores them."""
    pairs = {"architecture": arch, "gvisor_asset_hash": build, **extra}
    return CompatVersion(schema_version=schema,
                         attributes=tuple(Attribute(key=k, value=v) for k, v in sorted(pairs.items())))


def runtime(v: CompatVersion, name: str | None = None, overhead: int | None = 0,
            compatible: tuple[CompatVersion, ...] = (), *, per_gib: int = 0) -> WorkerRuntime:
    """`overhead` is the fixed MiB per actor (`per_gib` the MiB per GiB booked); None: the
    runtime states no overhead at all (the schema's default)."""
    cost = None if overhead is None else ActorOverhead(fixed_mib=overhead, per_gib_mib=per_gib)
    return WorkerRuntime(version=v, name=name, actor_overhead=cost, compatible_versions=compatible)


def stamp(v: CompatVersion, sandbox_class: str = CLASS, name: str | None = None) -> ActorRuntime:
    return ActorRuntime(sandbox_class=sandbox_class, name=name, version=v)


def entry(default: CompatVersion | WorkerRuntime, restorable: tuple = (), sandbox_class: str = CLASS
          ) -> WorkerSandboxClass:
    """One class a worker runs; a bare version is a runtime of it with no overhead."""
    def rt(r: CompatVersion | WorkerRuntime) -> WorkerRuntime:
        return r if isinstance(r, WorkerRuntime) else runtime(r)

    return WorkerSandboxClass(sandbox_class=sandbox_class, default_runtime=rt(default),
                              restorable_runtimes=tuple(rt(r) for r in restorable))


def worker(worker_id: str, default: CompatVersion | WorkerRuntime, restorable: tuple = (), *, node: str | None = None,
           cpu: int = 4000, mem: int = 4096, labels: dict[str, str] | None = None, sandbox_class: str = CLASS,
           request_id: str | None = None, node_token: str | None = None) -> RegisterWorker:
    return RegisterWorker(
        worker_id=worker_id, node=node or f"node-{worker_id}",
        capacity=Resources(cpu_millis=cpu, memory_mib=mem), labels=labels or {},
        sandbox_classes=(entry(default, restorable, sandbox_class),), request_id=request_id, node_token=node_token,
    )


def snapshot(actor_id: str, v: CompatVersion | ActorRuntime | None, *, snapshot_id: str | None = None,
             fidelity: Fidelity = Fidelity.MEMORY, node: str | None = None, location: Location | None = None,
             uri: str | None = None, template: str = "t1", borrowed: bool = False, sandbox_class: str = CLASS,
             taken_at: datetime = AT) -> Snapshot:
    """A snapshot of `actor_id` stamped `v` (None: unstamped); LOCAL to `node` when one is named,
    else EXTERNAL, unless `location` says otherwise."""
    return Snapshot(snapshot_id=snapshot_id or f"{actor_id}-s", actor_id=actor_id, template_uid=template,
                    fidelity=fidelity, location=location or (Location.LOCAL if node else Location.EXTERNAL),
                    node=node, uri=uri, borrowed=borrowed, taken_at=taken_at,
                    sandbox_runtime=v if isinstance(v, ActorRuntime) or v is None else stamp(v, sandbox_class))


def golden(v: CompatVersion, *, snapshot_id: str = "golden-1", template: str = "t1",
           fidelity: Fidelity = Fidelity.MEMORY, sandbox_class: str = CLASS, **fields: Any) -> Snapshot:
    """An EXTERNAL golden snapshot stamped `v`."""
    made = snapshot("golden", v, snapshot_id=snapshot_id, fidelity=fidelity, location=Location.EXTERNAL,
                    uri=f"s3://golden/{snapshot_id}", template=template, sandbox_class=sandbox_class)
    return msgspec.structs.replace(made, **fields) if fields else made


def actor(actor_id: str, *, cpu: int = 500, mem: int = 1024, template: str = "t1",
          min_fidelity: Fidelity = Fidelity.ROOTFS, selectors: dict[str, str] | None = None,
          golden_snapshot: Snapshot | None = None, source_tag: str | None = None,
          sandbox_class: str = CLASS, request_id: str | None = None) -> CreateActor:
    return CreateActor(actor_id=actor_id, sandbox_class=sandbox_class, template_uid=template,
                       resources=Resources(cpu_millis=cpu, memory_mib=mem), selectors=selectors or {},
                       min_fidelity=min_fidelity, golden_snapshot=golden_snapshot, source_tag=source_tag,
                       request_id=request_id)


# --- events, as the services write them ---------------------------------------------------------


def registered(worker_id: str, *classes: WorkerSandboxClass, node: str | None = None, cpu: int = 4000,
               mem: int = 4096, labels: dict[str, str] | None = None, at: datetime = AT,
               node_token: str | None = None) -> WorkerRegistered:
    """A registration as the registry records it (`entry(...)` per class)."""
    return WorkerRegistered(at=at, worker_id=worker_id, node=node or f"node-{worker_id}",
                            capacity=Resources(cpu_millis=cpu, memory_mib=mem), labels=labels or {},
                            sandbox_classes=classes, node_token=node_token)


def created(actor_id: str, *, cpu: int = 500, mem: int = 1024, template: str = "t1",
            min_fidelity: Fidelity = Fidelity.ROOTFS, selectors: dict[str, str] | None = None,
            snapshot: Snapshot | None = None, sandbox_class: str = CLASS, at: datetime = AT) -> ActorCreated:
    return ActorCreated(at=at, actor_id=actor_id, sandbox_class=sandbox_class, template_uid=template,
                        resources=Resources(cpu_millis=cpu, memory_mib=mem), selectors=selectors or {},
                        min_fidelity=min_fidelity, snapshot=snapshot)


def taken(snapshot: Snapshot, origin: SnapshotOrigin = SnapshotOrigin.SUSPEND, at: datetime = AT) -> SnapshotTaken:
    """The snapshotter's record of `snapshot`, on its actor."""
    return SnapshotTaken(at=at, actor_id=snapshot.actor_id, snapshot=snapshot, origin=origin)


def placed(actor_id: str, worker_id: str, pin: CompatVersion | ActorRuntime, *, node: str | None = None,
           action: Action = Action.RUN, fidelity: PlacedFidelity = PlacedFidelity.NONE, cpu: int = 500,
           mem: int = 1024, snapshot_id: str | None = None, fallback: Fallback | None = None,
           request_id: str | None = None, sandbox_class: str = CLASS, at: datetime = AT) -> ActorPlaced:
    """A placement written as the scheduler writes it (a decision's own: `committer.placed_event`)."""
    return ActorPlaced(at=at, actor_id=actor_id, worker_id=worker_id, node=node or f"node-{worker_id}",
                       action=action, fidelity=fidelity,
                       sandbox_runtime=pin if isinstance(pin, ActorRuntime) else stamp(pin, sandbox_class),
                       snapshot_id=snapshot_id, fallback=fallback, booked=Resources(cpu_millis=cpu, memory_mib=mem),
                       request_id=request_id)


def booked(worker_id: str, actor_id: str, request_id: str | None = None, at: datetime = AT) -> WorkerBooked:
    return WorkerBooked(at=at, worker_id=worker_id, actor_id=actor_id, request_id=request_id)


def released(actor_id: str, worker_id: str, reason: ReleaseReason = ReleaseReason.SUSPENDED,
             at: datetime = AT) -> ActorReleased:
    return ActorReleased(at=at, actor_id=actor_id, worker_id=worker_id, reason=reason)


class Folds(Protocol):
    def apply(self, seq: int, event: Event) -> Any: ...


F = TypeVar("F", bound=Folds)


def fold(events: Iterable[Event], into: F) -> F:
    """`into` (a Projection, an audit Sink) with `events` folded at sequences 1, 2, ..."""
    for seq, event in enumerate(events, start=1):
        into.apply(seq, event)
    return into


class Log:
    """A log in the making, without a bus: each event gets the next sequence and is folded
    into the scheduler's Projection at once. A worker that names no runtime runs `default`,
    a snapshot that names no stamp is stamped with it; workers are roomy (8 GiB) unless told."""

    def __init__(self, default: CompatVersion = version("1")) -> None:
        self.default = default
        self.events: list[Event] = []
        self.p = Projection()

    def add(self, event: Event) -> int:
        self.events.append(event)
        seq = len(self.events)
        self.p.apply(seq, event)
        return seq

    def replay(self, upto: int | None = None, *, markers: bool = False) -> Projection:
        """A fresh projection of the first `upto` events (all of them by default); with `markers`,
        each WorkerBooked is folded as the fold reads it from its subject (a booking marker)."""
        if not markers:
            return fold(self.events[:upto], Projection())
        p = Projection()
        for seq, event in enumerate(self.events[:upto], start=1):
            if isinstance(event, WorkerBooked):
                p.booking_marker(seq, event.worker_id)
            else:
                p.apply(seq, event)
        return p

    def worker(self, worker_id: str, default: WorkerRuntime | None = None, restorable: tuple[WorkerRuntime, ...] = (),
               *, node: str | None = None, cpu: int = 4000, mem: int = 8192, labels: dict[str, str] | None = None,
               sandbox_class: str = CLASS, node_token: str | None = None) -> int:
        classes = entry(default or runtime(self.default), restorable, sandbox_class)
        return self.add(registered(worker_id, classes, node=node, cpu=cpu, mem=mem, labels=labels,
                                   node_token=node_token))

    def drain(self, worker_id: str) -> int:
        return self.add(WorkerDrained(at=AT, worker_id=worker_id, reason="maintenance"))

    def actor(self, actor_id: str, **fields: Any) -> int:
        """`created(actor_id, **fields)`."""
        return self.add(created(actor_id, **fields))

    def snapshot(self, actor_id: str, *, stamped: CompatVersion | None | EllipsisType = ...,
                 origin: SnapshotOrigin = SnapshotOrigin.SUSPEND, snapshot_id: str | None = None,
                 **fields: Any) -> int:
        """A snapshot taken (`snapshot(...)`'s fields), LOCAL when paused; `stamped=None`: unstamped."""
        made = snapshot(actor_id, self.default if stamped is ... else stamped,
                        snapshot_id=snapshot_id or f"{actor_id}-s{len(self.events)}",
                        location=Location.LOCAL if origin is SnapshotOrigin.PAUSE else Location.EXTERNAL, **fields)
        return self.add(taken(made, origin))

    def place(self, placement, request_id: str | None = None) -> int:
        """What the scheduler commits: ActorPlaced, then WorkerBooked, in one atomic append."""
        self.add(placed_event(placement, request_id))
        return self.add(booked(placement.worker_id, placement.actor_id, request_id))

    def release(self, actor_id: str, worker_id: str, reason: ReleaseReason) -> int:
        return self.add(released(actor_id, worker_id, reason))

    def decide(self, actor_id: str, selectors=None, position=None):
        return decide(self.p, actor_id, selectors, self.p.seq if position is None else position)

    def explain(self, actor_id: str, selectors=None):
        return explain(self.p, actor_id, selectors, self.p.seq)


class Writer:
    """Appends events straight into the stream through the event store, as another service, or a
    buggy or hostile writer, would: each subject's next version is read from the store, the
    events of one `write` go in one atomic append. Blocking (run it in a thread)."""

    def __init__(self, nats_url: str, prefix: str):
        self.app = WireApplication(store_env(nats_url, prefix))

    def write(self, *events: Event) -> int:
        """The stream sequence of the last event written."""
        stored = []
        versions: dict[str, int] = {}
        for event in events:
            subject = f"{event.KIND}.{event.entity_id}"
            if subject not in versions:
                last = self.app.recorder.select_events(subject, desc=True, limit=1)
                versions[subject] = last[0].originator_version if last else 0
            versions[subject] += 1
            stored.append(self.app.stored_event(subject, versions[subject], event))
        return self.app.recorder.insert_events(stored)[-1]

    def close(self) -> None:
        self.app.close()


# --- the log ---------------------------------------------------------------------------------


def runtime_ids_apart(value: Any) -> tuple[Any, list[tuple[Any, str]]]:
    """A view's JSON (`warmboot.cmd_views.with_runtime_ids`) split into the endpoint's answer it
    prints and the ids it added: (the JSON without them, [(the version each was added beside, id)])."""
    added: list[tuple[Any, str]] = []

    def apart(v: Any) -> Any:
        if isinstance(v, list):
            return [apart(x) for x in v]
        if not isinstance(v, dict):
            return v
        for key, id_key in (("version", "runtime_id"), ("matched_version", "matched_runtime_id")):
            if id_key in v:
                added.append((v[key], v[id_key]))
        return {k: apart(x) for k, x in v.items() if k not in ("runtime_id", "matched_runtime_id")}

    return apart(value), added


async def ensure_stream(nats_url: str, prefix: str) -> None:
    """The stream, created by the event store (its factory), as the services create it."""
    writer = await asyncio.to_thread(Writer, nats_url, prefix)
    await asyncio.to_thread(writer.close)


def stored_message(prefix: str, event: Event, versions: dict[str, int]) -> tuple[str, dict[str, str], bytes]:
    """What the stream holds for `event` as the event store writes it: subject, the store's headers
    (message id, topic, version) and body; `versions` counts each subject's events so far."""
    aggregate_id = f"{event.KIND}.{event.entity_id}"
    v = versions[aggregate_id] = versions.get(aggregate_id, 0) + 1
    return (f"{prefix}.ev.{aggregate_id}",
            {MSG_ID_HEADER: f"{aggregate_id}:{v}", TOPIC_HEADER: type(event).__name__, VERSION_HEADER: str(v)},
            encode(event))


async def publish_events(nc: NATS, prefix: str, events: Iterable[Event], versions: dict[str, int]) -> None:
    """Bulk-load a large log (benches): `stored_message`s published without waiting for each, into
    a stream `ensure_stream` made; `versions` carries on from an earlier load."""
    js = nc.jetstream(publish_async_max_pending=4000)
    for event in events:
        subject, headers, body = stored_message(prefix, event, versions)
        await js.publish_async(subject, body, headers=headers)
    await js.publish_async_completed()


async def cancelled_and_ended(task: asyncio.Future, within: float, what: str) -> None:
    """`events.tasks.cancel_and_wait(task)` (which cancels again a task that swallowed its cancellation, as
    Python 3.11's asyncio.wait_for inside nats-py's requests can), bounded: AssertionError naming `what`,
    and where it waits, if it has not ended within `within` s."""
    from events.tasks import cancel_and_wait

    waiting = asyncio.ensure_future(cancel_and_wait(task))
    await asyncio.wait({waiting}, timeout=within)
    if not task.done():
        waiting.cancel()
        import io

        stack = io.StringIO()
        task.print_stack(file=stack)
        raise AssertionError(f"{what} did not end within {within:g}s of its cancellation:\n{stack.getvalue()}")


async def until(check: Callable[[], bool], within: float = 30.0, what: str = "not within the deadline") -> None:
    """Return once `check()` holds; AssertionError saying `what` if it does not within `within` s. For state
    nothing announces (a counter, an attribute of the process's own objects): read again every 0.05 s."""
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)  # polling with a deadline: what is waited for has no event to await


async def leaderless_info(js: Any, stream: str, within: float = 90.0) -> Any:
    """The stream's info as a member left alone answers it, once it says it has no leader (about 10 s after
    the others stopped); asked every 0.2 s, one second each, unanswered or refused meanwhile."""
    deadline = time.monotonic() + within
    while True:
        try:
            info = await js.stream_info(stream)
            if not info.cluster.leader:
                return info
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.APIError):  # not yet
            pass
        assert time.monotonic() < deadline, "the member left never answered without a leader"
        await asyncio.sleep(0.2)  # polling a condition with a deadline, not a fixed wait


READS = logging.getLogger("tests.reads")  # a test's own reads asked again: not a service's (`unanswered_noted`)


async def ordered_subscription(js: Any, subject: str, stream: str, deadline_s: float = 60.0, **options: Any) -> Any:
    """An ordered consumer on `subject`, made once the cluster makes one: right after a stream
    leader is killed or a member restarted, on a loaded machine, a CONSUMER.CREATE can go
    unanswered (nats-py's 5 s time-out) or be answered 503 until the cluster has settled, even
    once the stream's replicas are current (the meta group assigns the consumer). Every test
    reader of the log makes its consumer here, asked again as a service's start asks
    (`services.streams.until_answered`); `options` are js.subscribe's (a start sequence)."""
    return await until_answered(lambda: js.subscribe(subject, stream=stream, ordered_consumer=True, **options),
                                f"a test's consumer on {stream}", deadline_s, logger=READS)


async def leaders_info(js: Any, stream: str, deadline_s: float = 60.0) -> Any:
    """The stream's info as its leader has it (`services.streams.leaders_stream_info`), asked
    again while the cluster settles, as `ordered_subscription` does."""
    return await until_answered(lambda: leaders_stream_info(js, stream), f"the stream {stream}", deadline_s,
                                logger=READS)


async def elections(nc: NATS, cluster: Any, stream: str, stop: asyncio.Event, rng: Any, disrupt: str) -> int:
    """Elections of the stream's leader until `stop` is set, how many: a stepdown every 0.5 to 2 s, and
    with `disrupt` "kill" every third one a kill of the leader's server instead, restarted 1 to 4 s
    later (`cluster`: a `NatsCluster`). The failover harnesses' chaos loop."""
    from warmboot.natsserver import wait_stream_current

    async def pause(low: float, high: float) -> None:
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(low, high))
        except asyncio.TimeoutError:
            pass

    count = 0
    while not stop.is_set():
        if disrupt == "kill" and count % 3 == 2:
            await wait_stream_current(nc.jetstream(), stream, 3)
            node = cluster.node((await nc.jetstream().stream_info(stream)).cluster.leader)
            node.kill()
            await pause(1.0, 4.0)
            await asyncio.to_thread(node.restart)
        else:
            await step_down(nc, stream)
        count += 1
        await pause(0.5, 2.0)
    return count


NOT_LEADER = 10041  # JetStream's err_code of `raft: not leader`


def first_column(shown: Any) -> list[str]:
    """The first cell of each row of a table a CLI command printed (`shown.stdout`, a CliRunner's result or a
    process's): its header line left out. What `actor list` and `workers` tests read of a page."""
    return [line.split()[0] for line in shown.stdout.splitlines()[1:]]


def outcome(value: Any) -> Any:
    """What a failover harness compares of an answer: a refusal's code and field (its message may name the
    replica's state), else the reply itself."""
    if isinstance(value, ContractError):
        return ("refused", value.code.value, value.field)
    return value


ANSWERED_WITHIN_S = 180.0  # how long `answered` sends a request again


async def answered(call: Callable[[], Any], what: str, *, again: frozenset = frozenset({ErrorCode.UNAVAILABLE}),
                   within: float = ANSWERED_WITHIN_S) -> Any:
    """A failover harness's caller: `call()` (a service's verb with the same request, request id and all) until
    answered, a refusal of a code in `again` and a store error sent again, 240 times at most and for `within` s
    at most (an attempt may itself take the store's whole time-out, 30 s, and 240 of them far outlast a test).
    Returns the reply or the refusal (a ContractError); raises AssertionError naming `what` if none came."""
    loop = asyncio.get_running_loop()
    errors = []
    deadline = loop.time() + within
    for _ in range(240):
        try:
            return await call()
        except ContractError as error:
            if error.code not in again:
                return error
            errors.append(f"{error.code.value}: {error.message}")
        except OperationalError as error:
            errors.append(repr(error))
        if loop.time() > deadline:
            break
        await asyncio.sleep(0.25)  # a caller's pause before it sends again (not a synchronisation)
    raise AssertionError(f"{what} never answered ({len(errors)} attempts): {Counter(errors).most_common(3)}")


async def step_down(nc: NATS, stream: str, replicas: int = 3, deadline_s: float = 120.0) -> str:
    """Have the stream's leader step down, once the stream has a leader and its other replicas are
    current (a stepdown asked during the previous one's election goes unanswered or is refused);
    the leader that stepped down. An answer lost on a loaded machine (a run with two suites and a
    spinning process waited 10 s for one) is not a refusal: if the stream has another leader since,
    the stepdown happened; if not, it is asked again. Nor is `raft: not leader` (err_code 10041): the
    request reached a server whose replica had just lost the leadership it was routed to it for (an
    election of its own between the read of the leader and the request: a CI run, 2026-12-07); asked
    again once the stream is current, of the leader it has then."""
    import nats.errors

    from warmboot.natsserver import wait_stream_current

    js = nc.jetstream()
    deadline = asyncio.get_running_loop().time() + deadline_s
    while True:
        await wait_stream_current(js, stream, replicas)
        leader = (await leaders_info(js, stream)).cluster.leader
        try:
            reply = await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=10)
        except nats.errors.TimeoutError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            if (await leaders_info(js, stream)).cluster.leader != leader:
                return leader
            continue
        answer = json.loads(reply.data)
        if answer.get("error", {}).get("err_code") == NOT_LEADER and asyncio.get_running_loop().time() < deadline:
            continue
        assert answer.get("success"), reply.data
        return leader


async def last_seq(nc: NATS, prefix: str) -> int:
    """The stream's last sequence as its leader has it (0 before the first event)."""
    try:
        return (await leaders_info(nc.jetstream(), stream_name(prefix))).state.last_seq
    except NotFoundError:
        return 0


async def read_messages(nc: NATS, prefix: str, subject: str | None = None) -> list[tuple[int, str, dict, Event]]:
    """Every event of the stream (or of one subject) with its message's headers, as (sequence,
    subject, headers, event), in stream order, decoded with the Structs alone; messages that are not
    events (tracking records) are left out. The headers say which atomic batch stored an event
    (`Nats-Batch-Id`; none on an append of one message)."""
    js = nc.jetstream()
    end = await last_seq(nc, prefix)
    if not end:
        return []
    sub = await ordered_subscription(js, subject or f"{prefix}.>", stream_name(prefix))
    out: list[tuple[int, str, dict, Event]] = []
    try:
        while True:
            msg = await sub.next_msg(timeout=10)
            seq = msg.metadata.sequence.stream
            if msg.subject.startswith(f"{prefix}.ev."):
                out.append((seq, msg.subject, msg.headers or {}, decode_event(msg.data)))
            if seq >= end or (subject and msg.metadata.num_pending == 0):
                return out
    finally:
        await sub.unsubscribe()


async def read_entries(nc: NATS, prefix: str, subject: str | None = None) -> list[tuple[int, str, Event]]:
    """`read_messages` without the headers: (sequence, subject, event)."""
    return [(seq, on, event) for seq, on, _, event in await read_messages(nc, prefix, subject)]


async def delivered(nc: NATS, held: Any, data: bytes, reply_type: type) -> Any:
    """A copy of the request `held` (a message caught on its subject) with the body `data`, delivered
    now as it was sent (its subject, its headers), as a NATS server stopped with it in its buffers
    delivers it later; its reply decoded (an error raised as its ContractError)."""
    from events.codec import decode_reply

    return decode_reply(reply_type, (await nc.request(held.subject, data, 5, headers=held.headers)).data)


async def read_log(nc: NATS, prefix: str, subject: str | None = None) -> list[tuple[int, Event]]:
    """`read_entries` without the subjects: (sequence, event)."""
    return [(seq, event) for seq, _, event in await read_entries(nc, prefix, subject)]


async def wait_for(nc: NATS, prefix: str, found: Callable[[Event], bool], *, after: int = 0,
                   timeout: float = 20.0) -> tuple[int, Event]:
    """The first event after sequence `after` for which `found` is true, as soon as it is stored
    (an ordered consumer reads the stream live); `timeout` only bounds a failure."""
    js = nc.jetstream()
    deadline = time.monotonic() + timeout
    start = {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE, "config": ConsumerConfig(opt_start_seq=after + 1)} \
        if after else {}
    sub = await ordered_subscription(js, f"{prefix}.ev.>", stream_name(prefix), deadline_s=timeout, **start)
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


@contextmanager
def unanswered_noted(caplog: Any) -> Iterator[asyncio.Event]:
    """An event set once `services.streams.until_answered` logs that JetStream did not answer
    a start's request (one attempt went unanswered, and it asks again)."""
    asked = asyncio.Event()

    class Asked(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "JetStream did not answer" in record.getMessage():
                asked.set()

    handler = Asked()
    logging.getLogger("warmboot.service").addHandler(handler)
    caplog.set_level(logging.INFO, logger="warmboot.service")
    try:
        yield asked
    finally:
        logging.getLogger("warmboot.service").removeHandler(handler)


async def started_once_members_are_back(starting: Any, asked: asyncio.Event, members: Iterable[Any],
                                        within: float) -> Any:
    """What the start `starting` (a coroutine that asks JetStream again while it cannot answer)
    returns, run while cluster `members` are down: once one of its attempts went unanswered
    (`asked`, from `unanswered_noted`; the start is still waiting then), the members are
    started again, and the start must then end within `within` seconds."""
    task, noted = asyncio.ensure_future(starting), asyncio.ensure_future(asked.wait())
    try:
        await asyncio.wait({task, noted}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        if task.done():  # it ended without waiting for JetStream: its own error says why
            raise AssertionError(f"the start did not wait for JetStream: it ended with {task.result()!r}")
        assert asked.is_set(), "no attempt of the start went unanswered within 60 s"
        members = list(members)
        for node in members:
            node.spawn()
        for node in members:
            await asyncio.to_thread(node.wait_ready, 30)
        return await asyncio.wait_for(task, within)
    finally:
        for pending in (task, noted):
            if not pending.done():
                pending.cancel()


def reads_before(monkeypatch: Any, stream: Any, seq: int) -> None:
    """`stream`'s reads (an event store's `recorder.stream`: the direct gets a process loads its
    aggregates with) answered as by a replica of the stream that has applied nothing from `seq` on
    (a single server has no replica to lag); its reads through the stream leader left alone."""
    read = stream.read

    async def behind(subject: str, start: int, *args: Any, **kwargs: Any) -> Any:
        return [m for m in await read(subject, start, *args, **kwargs) if sequence_of(m) < seq]

    monkeypatch.setattr(stream, "read", behind)


A = TypeVar("A")


@asynccontextmanager
async def another_process(make: Callable[[dict[str, str]], A], env: dict[str, str]) -> AsyncIterator[A]:
    """`make(env)` (an event store's application: a registry's `RegistryStore`, a `WireApplication`)
    on a connection and an inbox of its own, as another replica's in another process; closed after."""
    app = await asyncio.to_thread(make, {**env, "NATS_INBOX_PREFIX": "_INBOX_elsewhere"})
    try:
        yield app
    finally:
        await asyncio.to_thread(app.close)


def log_reads(monkeypatch: Any) -> list[str]:
    """The subjects the CLI's views read from the log (`log_messages`, as `cmd_views` and `cli_common.replay`
    call it; None: the whole log), one per read, in order: what a test of a view that must not fold the
    fleet asserts on."""
    from warmboot import cli_common, cmd_views

    read: list[str] = []
    every = cli_common.log_messages

    def recorded(nc: Any, prefix: str, filter_subject: str | None = None, stop: int | None = None) -> Any:
        read.append(filter_subject)
        return every(nc, prefix, filter_subject, stop)

    monkeypatch.setattr(cmd_views, "log_messages", recorded)
    monkeypatch.setattr(cli_common, "log_messages", recorded)  # `replay`'s, of the whole log
    return read


@contextmanager
def logged(logger: str, text: str) -> Iterator[asyncio.Event]:
    """An event (of the running loop) set once `logger` logs a message holding `text`, from any thread: the
    record awaited, not read at once (a line logged on the loop, or on another thread, may come after the
    call that led to it has returned)."""
    seen, loop = asyncio.Event(), asyncio.get_running_loop()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage():
                loop.call_soon_threadsafe(seen.set)

    handler = Seen()
    logging.getLogger(logger).addHandler(handler)
    try:
        yield seen
    finally:
        logging.getLogger(logger).removeHandler(handler)
