"""Failover bench: how long placements stall when the stream leader is killed.

    python bench/failover.py [--quick] [--json] [--kills N] [--graceful] [--trace] [--services-tree DIR]

A 3-node JetStream cluster on loopback (`warmboot.natsserver.NatsCluster`); the
registry, the snapshotter and the scheduler in one process of their own (as `warmboot
serve all --replicas 3` runs them: every stream and bucket R3); a fleet of workers
that heartbeat; and a steady load: every actor cycles resume -> suspend through
`warmboot.client.Client` (one client per actor: request ids, retries of UNAVAILABLE and
time-outs with the same request id, `min_seq` from its previous reply). Once the load
is steady the node leading the event stream is killed with SIGKILL; after the
observation window it is started again and, with `--kills N`, the next leader is
killed, and so on. With `--graceful` the leader is stopped with SIGTERM instead (a
rolling restart: the server hands its leaderships over before it exits).

Measured for each kill, from the log (the server's store time of each `ActorPlaced`)
and from the clients (when each resume was answered):

- placements per 250 ms around the kill, and the rate in the 10 s before it
  (`placements_per_s_before`) and in the 10 s after the stall (`placements_per_s_after`);
- when the new stream leader was elected (stream info's cluster leader, polled every
  50 ms from a connection of the bench's own, or the new leader's advisory if it came
  first), and the first message of any kind the stream stored after the kill;
- the stall: from the kill (`stall_after_kill_s`), and from the election
  (`stall_after_election_s`), until placements are back at half the earlier rate: the
  start of the first 250 ms bucket that has placements and from which every 2 s window
  starting in the next 3 s holds at least half the earlier rate (a burst of the backlog
  followed by another gap does not end a stall), or half the rate the two nodes left
  settle at in the last 10 s of the window if that is lower (the load slows down as
  histories grow); the figures are good to 250 ms. Also the first placement after the
  kill (`first_placement_after_kill_s`);
- what clients saw: requests sent again (`retries`), UNAVAILABLE answered by a service,
  time-outs (no reply within the client's 5 s), no responders, requests given up, and
  the slowest resume (first send to answer, retries included);
- and, over the whole log, the message ids stored more than once (`doubled_appends`:
  an append stored twice; there must be none).

With `--trace`, the services' process also writes what the committer, the fold and
the event store do (every append and every attempt of it with its outcome, the
nats-py ordered consumer's resets and re-creations, the committer's queue, the fold's
position every 100 ms), and the bench prints it around each kill: what waited.
`--services-tree DIR` runs the services from another checkout (the load and the
measurement stay this tree's), for before/after runs on one machine.

Figures of several kills are reported as their median and maximum. With `--json` the
last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the services' process may run another checkout's code (--services-tree)
sys.path.insert(0, os.environ.get("FAILOVER_SERVICES_TREE") or str(ROOT))

import nats  # noqa: E402

from events.errors import ContractError  # noqa: E402
from events.jetstream import MSG_ID_HEADER, TOPIC_HEADER  # noqa: E402
from events.schema import (  # noqa: E402
    Attribute,
    CompatVersion,
    CreateActor,
    ErrorCode,
    Fidelity,
    RegisterWorker,
    Resources,
    WorkerRuntime,
    WorkerSandboxClass,
)
from events.subjects import stream_name  # noqa: E402
from warmboot.client import Client  # noqa: E402
from warmboot.natsserver import NatsCluster, NatsServerError, wait_jetstream, wait_stream_current  # noqa: E402

BUCKET_S = 0.25
SUSTAINED_S = 3.0  # how long the rate must hold for a stall to be over,
WINDOW_S = 2.0  # in windows this long (a committer's group is up to one placement per worker)
BEFORE_S = 10.0  # the rate before a kill is measured over this window
AFTER_S = 10.0  # the rate after the stall, over this window
HEARTBEAT_EVERY_S = 5.0
WORKER_TTL_S = 60.0  # long enough that no worker is lost to a stall: the figure is placements
VERSION = CompatVersion(schema_version="v1", attributes=(Attribute(key="architecture", value="amd64"),
                                                          Attribute(key="cpu_features", value="00aa00bb00cc00dd")))


# --- the services' process ------------------------------------------------------------------------------------


def run_services(url: str, prefix: str, trace: str | None) -> None:
    """registry, snapshotter and scheduler in this process until stdin closes (`--services`)."""
    import logging
    from contextlib import AsyncExitStack

    from warmboot.runner import start_services

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(created).3f %(name)s %(levelname)s %(message)s")

    async def main() -> None:
        tracer = Tracer(trace) if trace else None
        async with AsyncExitStack() as exits:
            running = await start_services(
                exits, ["registry", "snapshotter", "scheduler"], url, prefix,
                options={"scheduler": {"metrics": False}, "registry": {"store_replicas": 3, "ttl_s": WORKER_TTL_S}},
            )
            if tracer is not None:
                tracer.follow(running.services[-1])
            print("READY", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
            if tracer is not None:
                tracer.close()

    asyncio.run(main())


class Tracer:
    """What the committer, the fold and the store do, as JSON lines (instrumentation of this
    bench's process only: it wraps a few methods, it changes nothing they do)."""

    def __init__(self, path: str):
        self.out = open(path, "w", buffering=1)
        self.scheduler = None
        self._wrap_store()
        self._wrap_ordered_consumer()

    def note(self, what: str, **fields) -> None:
        self.out.write(json.dumps({"t": time.time(), "what": what, **fields}) + "\n")

    def close(self) -> None:
        self.out.close()

    def _wrap(self, owner, name: str, before, after) -> bool:
        original = getattr(owner, name, None)
        if original is None:
            self.note("untraced", name=f"{owner.__name__}.{name}")
            return False

        async def traced(*args, **kwargs):
            token = before(*args, **kwargs)
            try:
                result = await original(*args, **kwargs)
            except BaseException as error:
                after(token, args, error)
                raise
            after(token, args, None)
            return result

        setattr(owner, name, traced)
        return True

    def _wrap_store(self) -> None:
        try:  # the event store as a package (events/jetstream/)
            from events.jetstream.retry import Retry as retry_cls
            from events.jetstream.stream import Stream as stream_cls
        except ImportError:  # an older checkout: one module
            import events.jetstream as store

            stream_cls, retry_cls = getattr(store, "_Stream", None), getattr(store, "_Retry", None)
        if stream_cls is None:
            self.note("untraced", name="events.jetstream's stream")
            return

        def send_before(stream, batch, timeout):
            return time.time(), len(batch.outs), stream.name, timeout

        def send_after(token, args, error):
            started, size, name, timeout = token
            self.note("send", started=started, size=size, stream=name, timeout=timeout,
                      outcome=type(error).__name__ if error else "ok", error=str(error)[:160] if error else None)

        self._wrap(stream_cls, "_send", send_before, send_after)

        def landed_before(stream, batch):
            return time.time(), len(batch.outs)

        def landed_after(token, args, error):
            self.note("landed?", started=token[0], size=token[1], outcome=type(error).__name__ if error else "ok")

        self._wrap(stream_cls, "_landed", landed_before, landed_after)
        if retry_cls is not None:
            def wait_before(retry, error):
                return time.time(), retry.what, retry.delay, type(error).__name__

            def wait_after(token, args, error):
                self.note("retry", started=token[0], op=token[1][:60], delay=token[2], cause=token[3])

            self._wrap(retry_cls, "wait", wait_before, wait_after)

    def _wrap_ordered_consumer(self) -> None:
        from nats.js.client import JetStreamContext

        jsi = JetStreamContext._JSI

        def reset_before(self_, sseq):
            return time.time(), self_._stream, sseq

        def reset_after(token, args, error):
            self.note("consumer reset", started=token[0], stream=token[1], from_seq=token[2])

        self._wrap(jsi, "reset_ordered_consumer", reset_before, reset_after)
        original = jsi.recreate_consumer
        tracer = self

        async def recreate(self_) -> None:
            started = time.time()
            errors = []
            error_cb = self_._conn._error_cb

            async def seen(error):
                errors.append(repr(error)[:160])
                await error_cb(error)

            self_._conn._error_cb = seen
            try:
                await original(self_)
            finally:
                self_._conn._error_cb = error_cb
                tracer.note("consumer recreated", started=started, stream=self_._stream,
                            outcome=errors[0] if errors else "ok")

        jsi.recreate_consumer = recreate

    def follow(self, scheduler) -> None:
        """Wrap the scheduler's committer append; sample the fold and the queue every 100 ms."""
        self.scheduler = scheduler
        committer = scheduler.committer
        original = committer.append

        async def append(group):
            started = time.time()
            try:
                await original(group)
            except BaseException as error:
                self.note("append", started=started, size=len(group), outcome=type(error).__name__)
                raise
            self.note("append", started=started, size=len(group), outcome="ok")

        committer.append = append
        recorder = scheduler.store.recorder
        insert = recorder.insert_events

        def inserted(*args, **kwargs):  # on the thread the committer's append runs on
            started = time.time()
            try:
                return insert(*args, **kwargs)
            finally:
                self.note("insert", started=started, size=len(args[0]) // 2)

        recorder.insert_events = inserted
        asyncio.get_running_loop().create_task(self._sample())

    async def _sample(self) -> None:
        s = self.scheduler
        while True:
            c = s.committer
            try:
                self.note("sample", folded=s.fold.applied, jobs=len(c._jobs), ready=len(c._ready),
                          waiting_fold=len(s.fold._waiters))
            except Exception as error:  # a renamed attribute: say so once, keep the rest of the trace
                self.note("untraced", name=f"sample: {error!r}")
                return
            await asyncio.sleep(0.1)


# --- the load -------------------------------------------------------------------------------------------------------


@dataclass
class Seen:
    """What the clients saw, each with its time: answers, and the attempts that failed."""

    resumes: list[float] = field(default_factory=list)  # when each resume was answered
    resume_latency: list[tuple[float, float]] = field(default_factory=list)  # (answered at, seconds)
    attempts: dict[str, list[float]] = field(default_factory=dict)  # unavailable / timeout / no_responders
    gave_up: dict[str, list[float]] = field(default_factory=dict)  # by error code

    def note(self, table: dict[str, list[float]], key: str) -> None:
        table.setdefault(key, []).append(time.time())


class SeenClient(Client):
    """warmboot.client.Client, counting what each attempt met (it retries as it always does)."""

    def __init__(self, nc, prefix: str, seen: Seen):
        super().__init__(nc, prefix)
        self.seen = seen

    async def _once(self, subject, data, reply_type, *rest):
        try:
            return await super()._once(subject, data, reply_type, *rest)  # `rest`: what this checkout's passes
        except ContractError as error:
            if error.code is ErrorCode.UNAVAILABLE:
                # the client's own wording for a time-out and for no responders (warmboot/client.py)
                kind = ("timeout" if error.message.startswith("no reply from") else
                        "no_responders" if error.message.startswith("no service answers") else "unavailable")
                self.seen.note(self.seen.attempts, kind)
            raise


async def actor_loop(client: SeenClient, actor_id: str, stop: asyncio.Event) -> None:
    seen = client.seen
    running = False
    while not stop.is_set():
        try:
            if running:
                await client.suspend(actor_id, Fidelity.MEMORY)
                running = False
                continue
            started = time.time()
            await client.resume(actor_id)
            now = time.time()
            seen.resumes.append(now)
            seen.resume_latency.append((now, now - started))
            running = True
        except ContractError as error:
            seen.note(seen.gave_up, error.code.value)
            if error.code is ErrorCode.FAILED_PRECONDITION:
                running = not running  # a give-up that had landed after all: the actor is where we said next
            await asyncio.sleep(0.1)


async def heartbeats(client: Client, workers: list[str], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for worker_id in workers:
            try:
                await client.heartbeat(worker_id)
            except ContractError:
                pass  # a stall longer than the client's retries: the next round beats again
        try:
            await asyncio.wait_for(stop.wait(), HEARTBEAT_EVERY_S)
        except asyncio.TimeoutError:
            pass


# --- the cluster's side ------------------------------------------------------------------------------------------------


async def stream_leader(js, stream: str) -> str | None:
    """The stream's leader as stream info names it (only a leader answers it), or None."""
    try:
        info = await js.stream_info(stream)
    except Exception:  # no leader to answer yet
        return None
    return info.cluster.leader if info.cluster else None


async def elected_after(js, stream: str, killed: str, limit: float) -> float | None:
    """When a node other than `killed` answers as the stream's leader (polled every 50 ms)."""
    deadline = time.time() + limit
    while time.time() < deadline:
        leader = await stream_leader(js, stream)
        if leader is not None and leader != killed:
            return time.time()
        await asyncio.sleep(0.05)
    return None


async def read_log(nc, prefix: str) -> tuple[list[float], list[float], list[str]]:
    """From the stream: the store times of every ActorPlaced and of every message, and the
    message ids stored more than once (an append doubled: there must be none)."""
    js = nc.jetstream()
    stream = stream_name(prefix)
    last = (await js.stream_info(stream)).state.last_seq
    placed: list[float] = []
    every: list[float] = []
    ids: set[str] = set()
    doubled: list[str] = []
    done = asyncio.get_running_loop().create_future()

    async def on_msg(msg) -> None:
        meta = msg.metadata
        t = meta.timestamp.timestamp()
        every.append(t)
        headers = msg.headers or {}
        if headers.get(TOPIC_HEADER) == "ActorPlaced":
            placed.append(t)
        msg_id = headers.get(MSG_ID_HEADER)
        if msg_id is not None:
            if msg_id in ids:
                doubled.append(msg_id)
            ids.add(msg_id)
        if meta.sequence.stream >= last and not done.done():
            done.set_result(None)

    sub = await js.subscribe(f"{prefix}.>", stream=stream, cb=on_msg, ordered_consumer=True)
    await asyncio.wait_for(done, 300)
    await sub.unsubscribe()
    placed.sort()
    every.sort()
    return placed, every, doubled


# --- figures -------------------------------------------------------------------------------------------------------------


def count_in(times: list[float], start: float, end: float) -> int:
    return bisect.bisect_left(times, end) - bisect.bisect_left(times, start)


def stall_end(times: list[float], kill: float, rate_before: float, limit: float) -> float | None:
    """Start of the first 250 ms bucket from the kill that has placements and from which they
    hold at least half the earlier rate in every `WINDOW_S` window starting in the next
    `SUSTAINED_S` (a burst of the backlog followed by another gap does not end a stall)."""
    need = 0.5 * rate_before * WINDOW_S
    steps = int(SUSTAINED_S / BUCKET_S)
    b = kill
    while b < kill + limit:
        if count_in(times, b, b + BUCKET_S) and all(
                count_in(times, b + i * BUCKET_S, b + i * BUCKET_S + WINDOW_S) >= need for i in range(steps + 1)):
            return b
        b += BUCKET_S
    return None


def buckets(times: list[float], start: float, end: float) -> list[int]:
    out, b = [], start
    while b < end - 1e-9:
        out.append(count_in(times, b, b + BUCKET_S))
        b += BUCKET_S
    return out


def figures_of(kill: float, elected: float | None, placed: list[float], every: list[float], seen: Seen,
               observe_s: float) -> dict:
    before = count_in(placed, kill - BEFORE_S, kill) / BEFORE_S
    # what the two nodes left settle at, at the end of the window: when that is less than the
    # rate before (the load slows down as histories grow), the stall ends at half of it
    settled = count_in(placed, kill + observe_s - AFTER_S, kill + observe_s) / AFTER_S
    end = stall_end(placed, kill, min(before, settled), observe_s)
    first_placement = bisect.bisect_right(placed, kill)
    answered_before = count_in(seen.resumes, kill - BEFORE_S, kill) / BEFORE_S
    client_end = stall_end(seen.resumes, kill, answered_before, observe_s)
    after = count_in(placed, end, end + AFTER_S) / min(AFTER_S, kill + observe_s - end) if end else 0.0
    first_write = every[bisect.bisect_right(every, kill)] if bisect.bisect_right(every, kill) < len(every) else None
    window = (kill, kill + observe_s)

    def within(times: list[float]) -> int:
        return count_in(sorted(times), *window)

    slowest = max((s for t, s in seen.resume_latency if window[0] <= t < window[1]), default=None)
    return {
        "placements_per_s_before": round(before, 1),
        "placements_per_s_after": round(after, 1),
        "placements_per_s_settled": round(settled, 1),
        "first_placement_after_kill_s": round(placed[first_placement] - kill, 2) if first_placement < len(placed)
        else None,
        "elected_after_kill_s": round(elected - kill, 2) if elected else None,
        "first_write_after_kill_s": round(first_write - kill, 2) if first_write else None,
        "stall_after_kill_s": round(end - kill, 2) if end else None,
        # clamped at 0: a stall that ends in the bucket of the election (the figures are good to 250 ms)
        "stall_after_election_s": round(max(0.0, end - elected), 2) if end and elected else None,
        "client_stall_after_kill_s": round(client_end - kill, 2) if client_end else None,
        "slowest_resume_s": round(slowest, 2) if slowest is not None else None,
        "retries": sum(within(v) for v in seen.attempts.values()),
        "unavailable_answered": within(seen.attempts.get("unavailable", [])),
        "timeouts": within(seen.attempts.get("timeout", [])),
        "no_responders": within(seen.attempts.get("no_responders", [])),
        "gave_up": {code: within(v) for code, v in seen.gave_up.items() if within(v)},
        "per_250ms": buckets(placed, kill - 2.0, kill + min(observe_s, 16.0)),
    }


# --- the trace, read back ---------------------------------------------------------------------------------------------------


def what_waited(trace: Path, kill: float, elected: float | None, end: float | None) -> list[str]:
    """What the trace says the committer, the fold and the store did from just before the kill
    until the stall ended (times from the kill): every attempt that failed or took long,
    every retry that waited longer than its back-off, the ordered consumers' resets, the
    first append that went through, and the fold's position and the committer's queue."""
    lines = []
    stop = (end or kill + 15.0) + 0.5
    samples, first_ok, quiet = [], {}, 0
    for raw in trace.read_text().splitlines():
        rec = json.loads(raw)
        t = rec.pop("t")
        what = rec.pop("what")
        started = rec.pop("started", t)
        if what == "untraced":
            lines.append(f"   (not traced: {rec['name']})")
            continue
        if what == "sample":
            if kill - 0.5 <= t <= stop:
                samples.append((t, rec))
            continue
        if t < kill or started > stop:
            continue
        took = t - started
        if what == "insert" and took < 0.3:
            quiet += 1
            continue
        if what in ("send", "append", "landed?") and rec.get("outcome") == "ok" and took < 0.3:
            if started >= kill and what not in first_ok:
                first_ok[what] = started
                lines.append(f"   {started - kill:+7.2f} .. {t - kill:+7.2f} s  first {what} to go through "
                             f"after the kill (size {rec.get('size')})")
            else:
                quiet += 1
            continue
        if what == "retry" and took < 2 * rec.get("delay", 0) + 0.1:
            quiet += 1
            continue
        span = f"{started - kill:+7.2f} .. {t - kill:+7.2f} s" if took > 0.005 else f"{t - kill:+7.2f} s        "
        detail = ", ".join(f"{k}={v}" for k, v in rec.items() if v is not None and k not in ("stream", "error"))
        lines.append(f"   {span}  {what}{' (waited %.2f s)' % took if took > 0.3 else ''}: {detail}")
    if quiet:
        lines.append(f"   (and {quiet} quick attempts and back-offs)")
    if samples:
        steps = [f"{t - kill:+.1f}s folded={rec['folded']} queued={rec['jobs']}+{rec['ready']} "
                 f"fold-waiters={rec['waiting_fold']}" for t, rec in samples[::5]]  # every 0.5 s
        lines.append("   every 0.5 s: " + "\n                ".join(steps))
    head = f"   election at {elected - kill:+.2f} s" if elected else "   no election seen"
    return [head] + lines


# --- main --------------------------------------------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, tmp: Path) -> dict:
    prefix = "fo" + os.urandom(4).hex()
    stream = stream_name(prefix)
    trace = tmp / "trace.jsonl" if args.trace else None
    tree = Path(args.services_tree).resolve() if args.services_tree else ROOT
    for attempt in range(3):  # a port drawn free may be taken before the node binds it (a shared machine)
        cluster = NatsCluster(tmp / f"cluster{attempt}")
        try:
            cluster.start()
            break
        except NatsServerError:
            if attempt == 2:
                raise
    with cluster:
        await wait_jetstream(cluster.url)
        env = {**os.environ, "WARMBOOT_STREAM_REPLICAS": "3", "FAILOVER_SERVICES_TREE": str(tree)}
        command = [sys.executable, str(ROOT / "bench" / "failover.py"), "--services", cluster.url, prefix]
        if trace:
            command.append(str(trace))
        services = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=open(tmp / "services.log", "w"), text=True, cwd=tree, env=env)
        try:
            line = await asyncio.to_thread(services.stdout.readline)
            if not line.startswith("READY"):
                raise RuntimeError(f"services did not start: {line!r} (see {tmp / 'services.log'})")
            return await load_and_kill(args, cluster, prefix, stream, trace, tmp)
        finally:
            services.stdin.close()
            await asyncio.to_thread(services.wait, 60)
            if args.keep_logs:
                print(f"services' log kept: {args.keep_logs}")
                Path(args.keep_logs).write_text((tmp / "services.log").read_text())
                if trace:
                    Path(args.keep_logs).with_suffix(".trace.jsonl").write_text(trace.read_text())


async def load_and_kill(args, cluster: NatsCluster, prefix: str, stream: str, trace: Path | None, tmp: Path) -> dict:
    async def quiet(error: Exception) -> None:  # a node killed on purpose: its EOF is expected
        pass

    options = dict(servers=cluster.urls, max_reconnect_attempts=-1, reconnect_time_wait=0.25, error_cb=quiet)
    nc = await nats.connect(name="failover-load", **options)
    watch = await nats.connect(name="failover-watch", **options)
    seen = Seen()
    stop = asyncio.Event()
    tasks: list[asyncio.Task] = []
    try:
        setup = Client(nc, prefix)
        workers = [f"w{i:03d}" for i in range(args.workers)]
        runtime = WorkerRuntime(version=VERSION)
        for worker_id in workers:
            await setup.register(RegisterWorker(
                worker_id=worker_id, node=f"node-{worker_id}", capacity=Resources(cpu_millis=64000, memory_mib=65536),
                sandbox_classes=(WorkerSandboxClass(sandbox_class="gvisor", default_runtime=runtime),)))
        actors = [f"a{i:04d}" for i in range(args.actors)]
        for i in range(0, len(actors), 50):
            await asyncio.gather(*(setup.create(CreateActor(
                actor_id=a, sandbox_class="gvisor", template_uid="t1",
                resources=Resources(cpu_millis=100, memory_mib=128))) for a in actors[i:i + 50]))
        js = watch.jetstream(timeout=0.25)  # polled: a short wait per ask
        assert (await js.stream_info(stream)).config.num_replicas == 3
        tasks.append(asyncio.create_task(heartbeats(Client(nc, prefix), workers, stop)))
        random.shuffle(actors)
        for a in actors:
            tasks.append(asyncio.create_task(actor_loop(SeenClient(nc, prefix, seen), a, stop)))
        print(f"{args.workers} workers, {args.actors} actors cycling resume -> suspend; "
              f"{args.warmup:g} s to warm up", flush=True)
        await asyncio.sleep(args.warmup + BEFORE_S)  # a steady load, then the window before the kill
        kills: list[tuple[float, float | None, str]] = []
        advisories: list[float] = []

        async def on_elected(msg) -> None:
            advisories.append(time.time())

        await watch.subscribe(f"$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED.{stream}", cb=on_elected)
        for k in range(args.kills):
            leader = await stream_leader(watch.jetstream(), stream)
            node = cluster.node(leader)
            if args.trace:
                for info in await watch.jetstream().consumers_info(stream):
                    where = info.cluster.leader if info.cluster else None
                    print(f"  consumer {info.config.filter_subject}: on {where}"
                          f"{' (the node killed next)' if where == leader else ''}")
            advisories.clear()
            kill = time.time()
            if args.graceful:  # SIGTERM: the server hands its leaderships over before it exits
                stopping = asyncio.create_task(asyncio.to_thread(node.stop))
            else:
                node.kill()
            polled = await elected_after(js, stream, leader, args.observe)
            # the earlier of the poll and the leader's own advisory (the poll waits on a 0.25 s ask)
            elected = min([t for t in [polled, *advisories] if t is not None], default=None)
            kills.append((kill, elected, leader))
            print(f"kill {k + 1}: {leader} {'stopped' if args.graceful else 'killed'}; new leader after "
                  f"{f'{elected - kill:.2f} s' if elected else 'more than the window'}", flush=True)
            await asyncio.sleep(max(0.0, kill + args.observe - time.time()))
            if args.graceful:
                await stopping
            node.spawn()
            await asyncio.to_thread(node.wait_ready)
            await wait_stream_current(js, stream, 3)
            if k + 1 < args.kills:
                await asyncio.sleep(BEFORE_S + 2.0)  # the window before the next kill, all three up
        stop.set()
        ended = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
        failed = [e for e in ended if isinstance(e, BaseException) and not isinstance(e, asyncio.CancelledError)]
        if failed:  # a client loop that died measured nothing: the run says so rather than report no placements
            raise RuntimeError(f"{len(failed)} client loops failed, the first: {type(failed[0]).__name__}: "
                               f"{failed[0]}") from failed[0]
        placed, every, doubled = await read_log(watch, prefix)
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await nc.close()
        await watch.close()
    per_kill = []
    for k, (kill, elected, leader) in enumerate(kills):
        f = figures_of(kill, elected, placed, every, seen, args.observe)
        f["killed"] = leader
        per_kill.append(f)
        print(f"\nkill {k + 1} ({leader}): placements {f['placements_per_s_before']}/s before, "
              f"{f['placements_per_s_after']}/s after (settling at {f['placements_per_s_settled']}/s); leader "
              f"elected {f['elected_after_kill_s']} s after the kill, first write {f['first_write_after_kill_s']} s, "
              f"first placement {f['first_placement_after_kill_s']} s; stall {f['stall_after_kill_s']} s from the kill, "
              f"{f['stall_after_election_s']} s from the election (clients: {f['client_stall_after_kill_s']} s)")
        print(f"  clients: {f['retries']} retries ({f['unavailable_answered']} UNAVAILABLE answered, "
              f"{f['timeouts']} time-outs, {f['no_responders']} no responders), gave up {f['gave_up'] or 0}, "
              f"slowest resume {f['slowest_resume_s']} s")
        print("  placements per 250 ms from 2 s before the kill: " + " ".join(map(str, f["per_250ms"])))
        if trace:
            end = kill + f["stall_after_kill_s"] if f["stall_after_kill_s"] is not None else None
            print("  what the services did (times from the kill):")
            print("\n".join(what_waited(trace, kill, elected, end)))
    print(f"\n{len(every)} messages in the log, {len(placed)} placements; "
          f"{len(doubled)} message ids stored twice{': ' + ', '.join(doubled[:5]) if doubled else ''}")
    results: dict = {"kills": len(per_kill), "workers": args.workers, "actors": args.actors, "per_kill": per_kill,
                     "doubled_appends": len(doubled)}
    for key in ("stall_after_kill_s", "stall_after_election_s", "elected_after_kill_s", "placements_per_s_before",
                "placements_per_s_after", "placements_per_s_settled", "first_placement_after_kill_s",
                "client_stall_after_kill_s", "slowest_resume_s"):
        values = [f[key] for f in per_kill if f[key] is not None]
        results[key] = round(statistics.median(values), 2) if values else None
        results[f"{key}_max"] = max(values) if values else None
    for key in ("retries", "unavailable_answered", "timeouts", "no_responders"):
        results[key] = sum(f[key] for f in per_kill)
    results["gave_up"] = sum(sum(f["gave_up"].values()) for f in per_kill)
    unmeasured = sum(1 for f in per_kill if f["stall_after_kill_s"] is None)
    if unmeasured:
        results["stalls_longer_than_window"] = unmeasured
    return results


def main() -> None:
    if len(sys.argv) >= 4 and sys.argv[1] == "--services":
        run_services(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one kill, a smaller fleet; about a minute on 2 cores")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--kills", type=int, help="stream leaders killed one after the other (default 3, --quick 1)")
    parser.add_argument("--workers", type=int, help="workers in the fleet (default 50, --quick 30)")
    parser.add_argument("--actors", type=int, help="actors cycling resume -> suspend (default 600, --quick 300)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the first measured window")
    parser.add_argument("--observe", type=float, default=25.0, help="seconds watched after each kill")
    parser.add_argument("--graceful", action="store_true",
                        help="stop the leader with SIGTERM (a rolling restart) instead of killing it")
    parser.add_argument("--trace", action="store_true", help="trace the services and print what waited")
    parser.add_argument("--services-tree", help="run the services from this checkout (before/after runs)")
    parser.add_argument("--keep-logs", help="copy the services' log (stderr) to this file")
    args = parser.parse_args()
    args.kills = args.kills or (1 if args.quick else 3)
    args.workers = args.workers or (30 if args.quick else 50)
    args.actors = args.actors or (300 if args.quick else 600)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="warmboot-failover-") as tmp:
        results = asyncio.run(bench(args, Path(tmp)))
    results["quick"] = args.quick
    results["graceful"] = args.graceful
    results["services_tree"] = str(Path(args.services_tree).resolve()) if args.services_tree else None
    results["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(f"\nstall after the kill: median {results['stall_after_kill_s']} s (max {results['stall_after_kill_s_max']}); "
          f"after the election: median {results['stall_after_election_s']} s "
          f"(max {results['stall_after_election_s_max']}; goal: under 3 s)")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
