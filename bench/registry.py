"""Registry benchmark: heartbeats and registrations over NATS, against a no-op service.

    python bench/registry.py [--quick] [--json] [--workers N] [--window N] [--before DIR]
                             [--fleet-only] [--reconcile-interval S]

Side by side, in one run, on one nats-server (file storage, as in production):

(a) echo: a no-op `nats.micro` service (one endpoint answering `{}`) in its own process;
    a client keeps `--window` requests in flight, each to a different subject token
    as heartbeats are. This is the ceiling the client, the bus and one Python process
    reach on this machine. Beside it, a no-op endpoint through the services' shared
    machinery (`services.endpoints.add_endpoints`), answering what a heartbeat answers:
    what that machinery costs before a handler does anything (`wrapped_noop_*`).
(b) registrations: `--workers` workers register through one registry replica (its own
    process), `--window` in flight (`register_per_s`).
(c) heartbeats: every registered worker beats, round after round, `--window` in
    flight (`heartbeats_per_s`, p50/p99), and the ratio to (a) (`heartbeat_vs_echo`).
    Echo and heartbeats alternate twice; the best of each counts (both read the same
    warm server).
(d) a re-registration storm: every worker registers again, all at once and unchanged,
    each with a request id of its own, as agents do when their connection comes back
    after a NATS restart (`reregister_per_s`, `storm_register_p99_ms`), while the workers
    go on beating at a fleet's rate, one heartbeat per worker every 5 s, open loop
    (`storm_heartbeat_p99_ms`, `storm_heartbeat_max_ms`: a heartbeat queued behind the
    storm for a TTL would lose its worker). Each process's CPU time is read from /proc, so the run also says
    what a heartbeat costs the registry, the server and the client.
(e), (f) a fleet: a registry replica of its own (its own process and prefix, the TTL the service
    has by default, 15 s: `fleet_ttl_s`), the replicas above stopped. `--workers` workers
    register and beat, each from its registration's answer on, one heartbeat every 5 s, open
    loop, for the whole section; `fleet_heartbeats_refused` counts those refused or unanswered
    (a beating worker removed, say). First (f), then (e):
(f) LOST: 50 of them, spread over the workers, stop beating one after the other over 10 s.
    For each, the time from its last answered heartbeat (when the answer came back: its put
    was stored by then) to its `WorkerRemoved` in the log (the server's time of the message),
    minus the TTL: `lost_lateness_min_s`, `lost_lateness_p50_s`, `lost_lateness_max_s` (how
    late LOST comes; `lost_removed` of `lost_sampled` were removed within 4 TTLs).
    `lost_exactly_once`: read from the log in stream order, after (e), every removal is a LOST
    one of a stopped worker, and each stopped worker is removed exactly once.
(e) a round of reconciliation (`RegistryService.reconcile`: one read of the heartbeat bucket per
    registered worker), as the replica's own timer runs it every `reconcile_interval_s` (the
    service's option; 100 s, its default, or 60 s with `--quick`): the first round that starts
    once (f)'s workers are removed. `reconcile_s`: how long it took, over `reconcile_workers`
    registered workers; `reconcile_registry_cpu_s`: the registry's CPU meanwhile (the heartbeats
    it answered meanwhile too). The heartbeats sent while it ran against those sent in the 15 s
    before it, in the same run: `heartbeat_{p50,p99,max}_ms_during_reconcile` and
    `heartbeat_{p50,p99,max}_ms_outside_reconcile` (a heartbeat queued toward the TTL would
    lose its worker). Measured, not asserted: no figure fails the run.

The registry process tunes its collector as `warmboot serve` does (`services.process.tune_gc`,
when the checkout has it); the echo and the no-op run as plain Python processes. All of them
run on the event loop `warmboot serve` runs on (`services.process.run_serving`: uvloop, unless
WARMBOOT_EVENT_LOOP=asyncio; a checkout without it, asyncio's).
Every reply is checked: a refused heartbeat or registration fails the run.
`--before DIR` also runs (b) and (c) against the registry of another checkout (say a
`git worktree` of an earlier commit) in the same run, its heartbeats alternating with the
others, on a nats-server of its own started as that checkout starts one (its
`warmboot.natsserver`: a change of the server's configuration is measured too; the
`before_` CPU figures are of that server).
With `--json` the last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
TTL_S = 1800.0  # long enough that no worker is lost between its registration and its beats


# --- the serving processes ------------------------------------------------------------------------


def serve(kind: str, nats_url: str, prefix: str, *options: str) -> None:
    """A registry replica, or an echo service, in this process: prints READY, runs until stdin closes.

    `fleet` is a registry replica with the TTL and reconciliation interval given in `options`
    (the service's own `ttl_s` and `reconcile_interval_s`), which prints a line for each round
    of reconciliation once it is over: `ROUND <start> <end> <CPU s> <workers>`, the times on
    the system's monotonic clock, the CPU the whole process spent meanwhile (the heartbeats it
    answered meanwhile too), and how many registered workers the round read.
    `echo` is a plain nats.micro service; `wrapped` answers what a heartbeat does,
    `{"ttl_s": 1800.0}`, through the services' shared endpoint machinery
    (`services.endpoints.add_endpoints`: validation at the edge, a task per request,
    contract errors, stats), and does nothing else."""
    import nats

    if kind == "nats":  # the checkout's own server, configured as it configures one: READY <url> <pid>
        import tempfile

        from warmboot.natsserver import NatsServer

        with tempfile.TemporaryDirectory(prefix="warmboot-bench-") as tmp, NatsServer(tmp) as server:
            print("READY", server.url, server.process.pid, flush=True)
            sys.stdin.read()
        return

    async def main() -> None:
        nc = await nats.connect(nats_url)
        if kind == "registry":
            from services.registry.service import RegistryService

            service = RegistryService(nc, nats_url=nats_url, prefix=prefix, ttl_s=TTL_S)
            await service.start()
        elif kind == "fleet":
            from services.registry.service import RegistryService

            class Timed(RegistryService):
                async def reconcile(self) -> None:  # at start, and as the service's own timer calls it
                    workers = len(self.roster)
                    t0, cpu0 = time.monotonic(), time.process_time()
                    await super().reconcile()
                    print(f"ROUND {t0} {time.monotonic()} {time.process_time() - cpu0} {workers}", flush=True)

            service = Timed(nc, nats_url=nats_url, prefix=prefix, ttl_s=float(options[0]),
                            reconcile_interval_s=float(options[1]))
            await service.start()
        elif kind == "wrapped":
            from events.schema import Heartbeat, HeartbeatReply
            from services.endpoints import EndpointSpec, add_endpoints

            answer = HeartbeatReply(ttl_s=TTL_S)

            async def beat(worker_id: str, request: Heartbeat) -> HeartbeatReply:
                return answer

            service = await add_endpoints(nc, prefix, "bench", "bench: the endpoint machinery alone",
                                          [EndpointSpec("beat", Heartbeat, beat)])
        else:
            from nats.micro import add_service

            async def echo(request) -> None:
                await request.respond(b"{}")

            service = await add_service(nc, name="bench-echo", version="1.0.0", queue_group="bench-echo")
            await service.add_endpoint(name="beat", subject=f"{prefix}.echo.beat.*", handler=echo)
            await nc.flush()
        if kind in ("registry", "fleet"):  # as `warmboot serve` does (an older checkout has no tune_gc); echo and
            # the no-op through services.endpoints run as plain Python processes
            getattr(serving_helpers(), "tune_gc", lambda: None)()
        print("READY", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await service.stop()
        await nc.close()

    # Every kind on the loop `warmboot serve` runs on, the echo too (an older checkout has no
    # run_serving: asyncio's loop).
    getattr(serving_helpers(), "run_serving", lambda run: asyncio.run(run()))(main)


def serving_helpers() -> ModuleType:
    """The module with the checkout's `tune_gc` and `run_serving`: services.process, or an older
    checkout's services.common (which may have neither)."""
    try:
        import services.process as helpers
    except ModuleNotFoundError as error:
        if error.name != "services.process":
            raise
        import services.common as helpers  # type: ignore[no-redef]  # an older checkout (`--before`)
    return helpers


class Served:
    """A serving process started from `code` (a checkout's root)."""

    def __init__(self, kind: str, nats_url: str, prefix: str, code: Path = ROOT, options: tuple[str, ...] = ()):
        self.said: list[str] = []  # what its READY line said after the word (a `nats`: its URL and pid)
        env = {**os.environ, "PYTHONPATH": str(code)}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", kind, nats_url, prefix, *options],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=code, env=env,
        )

    async def ready(self) -> "Served":
        self.early: list[str] = []  # what a `fleet` reported before it was ready (its round at start)
        while not (line := await asyncio.to_thread(self.proc.stdout.readline)).startswith("READY"):
            if not line.startswith("ROUND "):
                raise RuntimeError(f"the served process did not start: {line!r}")
            self.early.append(line)
        self.said = line.split()[1:]
        return self

    def cpu_s(self) -> float:
        return cpu_seconds(self.proc.pid)

    async def stop(self) -> None:
        self.proc.stdin.close()
        await asyncio.to_thread(self.proc.wait, 30)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


# --- the client -----------------------------------------------------------------------------------


def pct_ms(latencies: list[float], q: float) -> float:
    """The `q` quantile of sorted `latencies` (seconds), in ms; 0 when there are none."""
    if not latencies:
        return 0.0
    return latencies[min(len(latencies) - 1, int(len(latencies) * q))] * 1000


class Run:
    def __init__(self, count: int, elapsed: float, latencies: list[float], cpu: dict[str, float]):
        self.count = count
        self.elapsed = elapsed
        self.latencies = sorted(latencies)
        self.cpu = cpu  # process -> CPU seconds during the run

    @property
    def rate(self) -> float:
        return self.count / self.elapsed

    def pct_ms(self, q: float) -> float:
        return pct_ms(self.latencies, q)

    def cpu_us(self, name: str) -> float:
        return self.cpu[name] / self.count * 1e6


async def drive(replies, requests: list[tuple[str, bytes]], window: int, pids: dict[str, int],
                check=lambda data: not data.startswith(b'{"error"'), answered=lambda subject: None) -> Run:
    """Send every request with `window` in flight; every reply must pass `check` (`answered(subject)`
    is called for each that does).

    Through `events.natspy.publish.Replies` (one inbox, no timer per request), so that the
    load generator, on the same two cores, takes as little as it can."""
    pending = iter(requests)
    latencies: list[float] = []
    bad: list[bytes] = []

    async def lane() -> None:
        for subject, body in pending:
            t = time.perf_counter()
            msg = await replies.request(subject, body)
            latencies.append(time.perf_counter() - t)
            if not check(msg.data):
                bad.append(msg.data)
            else:
                answered(subject)

    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(window)))
    elapsed = time.perf_counter() - t0
    cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(requests)} requests refused; the first: {bad[0][:300]!r}")
    return Run(len(requests), elapsed, latencies, cpu)


# Every worker registers at this revision and names it in each beat, as the agent does (a beat naming
# another than the registration in force is refused: docs/registry.md, "The agent").
REVISION = 1
BEAT = b'{"revision":1}'


def registration(worker_id: str, request_id: str | None = None) -> bytes:
    from events.codec import encode
    from events.schema import (Attribute, CompatVersion, RegisterWorker, Resources, WorkerRuntime,
                               WorkerSandboxClass)

    version = CompatVersion(schema_version="v1", attributes=(
        Attribute(key="architecture", value="amd64"),
        Attribute(key="gvisor_asset_hash", value=f"sha256-{hash(worker_id) % 7}"),
    ))
    return encode(RegisterWorker(
        worker_id=worker_id, node=f"node-{worker_id}", capacity=Resources(cpu_millis=64000, memory_mib=65536),
        labels={"zone": "a"},
        sandbox_classes=(WorkerSandboxClass(sandbox_class="gvisor", default_runtime=WorkerRuntime(version=version)),),
        request_id=request_id, revision=REVISION,
    ))


BEAT_EVERY_S = 5.0  # an agent's heartbeat interval at the default TTL (15 s / 3)


async def storm(replies, registrations: list[tuple[str, bytes]], beats: list[tuple[str, bytes]],
                pids: dict[str, int]) -> tuple[Run, list[float]]:
    """Every registration sent at once while the workers go on beating, open loop, at the rate
    a fleet of that size beats (one heartbeat per worker every `BEAT_EVERY_S`); the storm's
    run, and the latencies of the heartbeats sent while it lasted (each must be answered)."""
    done = False
    latencies: list[float] = []
    refused: list[bytes] = []
    in_flight: set[asyncio.Task[None]] = set()

    async def beat(subject: str, body: bytes) -> None:
        t = time.perf_counter()
        msg = await replies.request(subject, body)
        if not done:
            latencies.append(time.perf_counter() - t)
        if not msg.data.startswith(b'{"ttl_s"'):
            refused.append(msg.data)

    async def offer() -> None:
        rate = len(registrations) / BEAT_EVERY_S
        t0 = time.perf_counter()
        for k, (subject, body) in enumerate(itertools.cycle(beats)):
            if done:
                return
            delay = t0 + k / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(beat(subject, body))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)

    offering = asyncio.create_task(offer())
    try:
        run = await drive(replies, registrations, len(registrations), pids)
    finally:
        done = True
        await offering
        await asyncio.gather(*in_flight)
    if refused:
        raise RuntimeError(f"{len(refused)} heartbeats during the storm were refused; the first: {refused[0][:300]!r}")
    return run, sorted(latencies)


def show(label: str, run: Run, unit: str, cpu: str = "") -> None:
    costs = ", ".join(f"{name} {run.cpu_us(name):.0f} us" for name in run.cpu)
    print(f"{label:<34}{run.rate:>9,.0f} {unit}/s  p50 {run.pct_ms(0.5):6.1f} ms  p99 {run.pct_ms(0.99):6.1f} ms"
          f"  [CPU per request: {costs}]", flush=True)


# --- (e) a round of reconciliation and (f) LOST, in a fleet beating at its rate ----------------------

FLEET_TTL_S = 15.0  # the registry's default TTL (`warmboot serve --ttl`), whose third is BEAT_EVERY_S
LOST_SAMPLE = 50  # workers stopped in (f)
LOST_SPREAD_S = 10.0  # over which they are stopped, one after the other
# a heartbeat's answer, by this tree's registry (`drained`: null, undrained) or an earlier one's (`--before`)
BEAT_ANSWERS = frozenset((b'{"ttl_s":1800.0,"drained":null}', b'{"ttl_s":1800.0}'))
OUTSIDE_S = 15.0  # the heartbeats sent this long before a round (three per worker) are those outside it


class Fleet:
    """The registered workers beating open loop at a fleet's rate: the cycle of every worker passes
    once per `BEAT_EVERY_S`, and a worker in `beating` (registered, not stopped) is sent a heartbeat
    in its slot. Each answered beat is kept as (monotonic time sent, latency), and each worker's
    last answered beat by the wall clock's time of its answer (the put it made was stored by then).
    A heartbeat refused (a worker found removed) or unanswered is kept too: neither fails the run."""

    def __init__(self, replies, prefix: str, workers: list[str]):
        from events.subjects import service_subject

        self.replies = replies
        self.workers = workers
        self.subjects = {w: service_subject(prefix, "registry", "heartbeat", w) for w in workers}
        self.beating: set[str] = set()
        self.beats: list[tuple[float, float]] = []
        self.last_answered: dict[str, float] = {}
        self.refused: list[tuple[str, bytes]] = []
        self.failed: list[tuple[str, str]] = []
        self._done = False
        self._in_flight: set[asyncio.Task[None]] = set()
        self._offering: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._offering = asyncio.create_task(self._offer())

    def registered(self, worker: str) -> None:
        """`worker`'s registration was answered (it beat before it was decided): it beats from now on."""
        self.last_answered[worker] = time.time()
        self.beating.add(worker)

    async def stop(self) -> None:
        self._done = True
        if self._offering is not None:
            await self._offering
        await asyncio.gather(*self._in_flight)

    async def _beat(self, worker: str) -> None:
        t = time.monotonic()
        try:
            msg = await self.replies.request(self.subjects[worker], BEAT)
        except Exception as error:
            self.failed.append((worker, repr(error)))
            return
        if msg.data.startswith(b'{"ttl_s"'):
            self.last_answered[worker] = time.time()
            self.beats.append((t, time.monotonic() - t))
        else:
            self.refused.append((worker, msg.data))

    async def _offer(self) -> None:
        rate = len(self.workers) / BEAT_EVERY_S
        t0 = time.monotonic()
        for k, worker in enumerate(itertools.cycle(self.workers)):
            if self._done:
                return
            delay = t0 + k / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if worker in self.beating:
                task = asyncio.create_task(self._beat(worker))
                self._in_flight.add(task)
                task.add_done_callback(self._in_flight.discard)

    def latencies(self, start: float, end: float) -> list[float]:
        """The sorted latencies of the answered heartbeats sent from `start` to `end` (monotonic)."""
        return sorted(latency for sent, latency in self.beats if start <= sent < end)


class Rounds:
    """The rounds of reconciliation a `fleet` process reports, as (start, end, CPU s, workers)."""

    def __init__(self, served: Served):
        self.served = served
        self.seen: list[tuple[float, float, float, int]] = []
        self.arrived = asyncio.Event()
        self.reading = asyncio.create_task(self._read())

    async def _read(self) -> None:
        for line in self.served.early:
            self._take(line)
        while line := await asyncio.to_thread(self.served.proc.stdout.readline):  # until the process ends
            self._take(line)

    def _take(self, line: str) -> None:
        if line.startswith("ROUND "):
            _, start, end, cpu, workers = line.split()
            self.seen.append((float(start), float(end), float(cpu), int(workers)))
            self.arrived.set()

    async def first(self, found, timeout: float) -> tuple[float, float, float, int]:
        """The first round reported for which `found(round)` is true."""
        deadline = time.monotonic() + timeout
        while True:
            for one in self.seen:
                if found(one):
                    return one
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise RuntimeError(f"no such round of reconciliation within {timeout:.0f}s; rounds: {self.seen}") \
                    from None


async def removals(nc, prefix: str, live: bool = False):
    """Every `WorkerRemoved` in the log, in stream order, as (sequence, worker, reason, the server's
    time of it in epoch seconds), read through an ordered consumer of the workers' subjects: all
    there are now; or, `live`, a list that grows as they are stored, and the subscription."""
    from events.codec import decode_event
    from events.schema import WorkerRemoved
    from events.subjects import event_subject, stream_name

    out: list[tuple[int, str, str | None, float]] = []

    async def take(msg) -> None:
        event = decode_event(msg.data)
        if isinstance(event, WorkerRemoved):
            out.append((msg.metadata.sequence.stream, event.worker_id, event.reason,
                        msg.metadata.timestamp.timestamp()))

    subject, stream = event_subject(prefix, "worker", "*"), stream_name(prefix)
    if live:
        return out, await nc.jetstream().subscribe(subject, stream=stream, ordered_consumer=True, cb=take)
    sub = await nc.jetstream().subscribe(subject, stream=stream, ordered_consumer=True)
    try:
        while True:
            msg = await sub.next_msg(timeout=10)
            await take(msg)
            if msg.metadata.num_pending == 0:
                return out
    finally:
        await sub.unsubscribe()


async def fleet(nats_url: str, nc, replies, tag: str, workers: list[str], window: int, interval_s: float,
                pids: dict[str, int]) -> dict:
    """(e) and (f): a registry replica of its own (TTL `FLEET_TTL_S`, reconciling every
    `interval_s`), `workers` registering and beating at a fleet's rate from the first answer
    on; `LOST_SAMPLE` of them stopped, one after the other over `LOST_SPREAD_S`; then the
    first round of reconciliation that starts once they are all removed, with the heartbeats
    it meets."""
    from events.subjects import service_subject

    prefix = f"{tag}f"
    served = await Served("fleet", nats_url, prefix, options=(str(FLEET_TTL_S), str(interval_s))).ready()
    rounds = Rounds(served)
    seen, watching = await removals(nc, prefix, live=True)
    beats = Fleet(replies, prefix, workers)
    beats.start()
    sample = workers[::max(1, len(workers) // LOST_SAMPLE)][:LOST_SAMPLE]
    try:
        t_start = time.monotonic()
        await drive(replies, [(service_subject(prefix, "registry", "register", w), registration(w)) for w in workers],
                    window, {"registry": served.proc.pid, **pids},
                    answered=lambda subject: beats.registered(subject.rsplit(".", 1)[-1]))
        registered = time.monotonic()
        print(f"fleet: {len(workers):,} workers registered in {registered - t_start:.1f} s, beating at "
              f"{len(workers) / BEAT_EVERY_S:,.0f}/s (TTL {FLEET_TTL_S:g} s, a round of reconciliation every "
              f"{interval_s:g} s)", flush=True)
        await asyncio.sleep(BEAT_EVERY_S)  # every worker beats once before the first is stopped
        # (f) each of the sample stops beating; its last answered beat is its last.
        t_lost = time.monotonic()
        for i, worker in enumerate(sample):
            await asyncio.sleep(max(0.0, t_lost + i * LOST_SPREAD_S / len(sample) - time.monotonic()))
            beats.beating.discard(worker)
        deadline = time.monotonic() + 4 * FLEET_TTL_S
        while {w for _, w, _, _ in seen} < set(sample) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        lost_done = time.monotonic()
        # (e) the first round that starts once they are removed, the heartbeats beside it, and before it
        # for OUTSIDE_S (from when the removals were read, at most).
        start, end, cpu, read = await rounds.first(lambda r: r[0] >= lost_done + 1.0, 2 * interval_s + 120)
        await asyncio.sleep(1.0)
        removed = await removals(nc, prefix)  # once more, after the round: one that came late counts
    finally:
        await beats.stop()
        await watching.unsubscribe()
        await served.stop()
        await rounds.reading

    during = beats.latencies(start, end)
    outside = beats.latencies(max(lost_done, start - OUTSIDE_S), start)
    stopped = set(sample)
    lost = [(seq, w, at) for seq, w, reason, at in removed if reason == "LOST"]
    times = {w: at for _, w, at in reversed(lost)}  # each sampled worker's first removal
    lateness = sorted(times[w] - beats.last_answered[w] - FLEET_TTL_S for w in sample if w in times)  # s
    others = [w for _, w, _, _ in removed if w not in stopped]
    once = (len(lost) == len(removed) and sorted(w for _, w, _ in lost) == sorted(sample) and not others)
    overlapped = [r for r in rounds.seen if r[3] and r[0] < lost_done and r[1] > t_lost]
    out = {
        "fleet_ttl_s": FLEET_TTL_S,
        "reconcile_interval_s": interval_s,
        "reconcile_s": round(end - start, 2),
        "reconcile_workers": read,
        "reconcile_registry_cpu_s": round(cpu, 2),
        "heartbeat_p50_ms_during_reconcile": round(pct_ms(during, 0.5), 1),
        "heartbeat_p99_ms_during_reconcile": round(pct_ms(during, 0.99), 1),
        "heartbeat_max_ms_during_reconcile": round(pct_ms(during, 1.0), 1),
        "heartbeat_p50_ms_outside_reconcile": round(pct_ms(outside, 0.5), 1),
        "heartbeat_p99_ms_outside_reconcile": round(pct_ms(outside, 0.99), 1),
        "heartbeat_max_ms_outside_reconcile": round(pct_ms(outside, 1.0), 1),
        "lost_sampled": len(sample),
        "lost_removed": len(times),
        "lost_lateness_p50_s": round(lateness[len(lateness) // 2], 2) if lateness else None,
        "lost_lateness_max_s": round(lateness[-1], 2) if lateness else None,
        "lost_lateness_min_s": round(lateness[0], 2) if lateness else None,
        "lost_exactly_once": once,
        "fleet_heartbeats_refused": len(beats.refused) + len(beats.failed),
    }
    print(f"fleet: a round of reconciliation read {read:,} workers in {out['reconcile_s']} s "
          f"(the registry's CPU meanwhile {out['reconcile_registry_cpu_s']} s); heartbeats during it "
          f"({len(during):,}) p50 {out['heartbeat_p50_ms_during_reconcile']} ms, p99 "
          f"{out['heartbeat_p99_ms_during_reconcile']} ms, max {out['heartbeat_max_ms_during_reconcile']} ms; "
          f"in the {start - max(lost_done, start - OUTSIDE_S):.0f} s before it ({len(outside):,}) p50 "
          f"{out['heartbeat_p50_ms_outside_reconcile']} ms, p99 {out['heartbeat_p99_ms_outside_reconcile']} ms, "
          f"max {out['heartbeat_max_ms_outside_reconcile']} ms", flush=True)
    print(f"fleet: {len(sample)} workers stopped over {LOST_SPREAD_S:g} s, {len(times)} removed as LOST; from the "
          f"last answered heartbeat to the removal's time in the log, minus the TTL of {FLEET_TTL_S:g} s: "
          f"min {out['lost_lateness_min_s']} s, p50 {out['lost_lateness_p50_s']} s, max {out['lost_lateness_max_s']} s;"
          f" exactly once: {once} ({len(removed)} removals in the log, {len(others)} of workers still beating; "
          f"{out['fleet_heartbeats_refused']} heartbeats refused or unanswered)", flush=True)
    if overlapped:
        print(f"fleet: a round of reconciliation ran while the sample was stopped: {overlapped}", flush=True)
    if beats.refused or beats.failed:
        print(f"fleet: the first heartbeat refused or unanswered: {(beats.refused + beats.failed)[0]}", flush=True)
    return out


async def bench(nats_url: str, server_pid: int, args: argparse.Namespace) -> dict:
    import nats

    from events.natspy.publish import Replies
    from events.subjects import service_subject

    nc = await nats.connect(nats_url)
    replies = await Replies(nc, timeout=60).start()
    workers = [f"w{i:05d}" for i in range(args.workers)]
    window = args.window
    tag = f"b{os.getpid() % 10000}"
    if args.fleet_only:
        try:
            return await fleet(nats_url, nc, replies, tag, workers, window, args.reconcile_interval,
                               {"client": os.getpid(), "server": server_pid})
        finally:
            await replies.stop()
            await nc.close()
    codes = {"now": ROOT}
    if args.before:
        codes["before"] = Path(args.before).resolve()
    servers = {"now": (nats_url, server_pid)}
    own: dict[str, Served] = {}  # the servers of the other checkouts
    clients = {"now": (nc, replies)}
    for label, code in codes.items():
        if label != "now":
            own[label] = await Served("nats", "", "", code).ready()
            url, pid = own[label].said
            servers[label] = url, int(pid)
            other = await nats.connect(url)
            clients[label] = other, await Replies(other, timeout=60).start()
    echo = await Served("echo", nats_url, f"{tag}e").ready()
    wrapped = await Served("wrapped", nats_url, f"{tag}w").ready()
    replicas = {label: await Served("registry", servers[label][0], f"{tag}{label[0]}", code).ready()
                for label, code in codes.items()}
    client = {"client": os.getpid(), "server": server_pid}
    against = {label: {"client": os.getpid(), "server": servers[label][1]} for label in codes}
    echo_requests = [(f"{tag}e.echo.beat.{w}", BEAT) for w in workers] * args.rounds
    wrapped_requests = [(service_subject(f"{tag}w", "bench", "beat", w), BEAT) for w in workers] * args.rounds
    beats = {label: [(service_subject(f"{tag}{label[0]}", "registry", "heartbeat", w), BEAT) for w in workers]
             * args.rounds for label in codes}
    registered: dict[str, Run] = {}
    best: dict[str, Run] = {}
    storms: dict[str, tuple[Run, list[float]]] = {}
    try:
        for label, replica in replicas.items():
            prefix = f"{tag}{label[0]}"
            registered[label] = run = await drive(
                clients[label][1], [(service_subject(prefix, "registry", "register", w), registration(w))
                                    for w in workers],
                window, {"registry": replica.proc.pid, **against[label]})
            show(f"{label}: register", run, "registrations")
        # Alternate, so that each figure meets the same load from the rest of the machine.
        for _ in range(2):
            run = await drive(replies, echo_requests, window, {"echo": echo.proc.pid, **client})
            show("echo (no-op nats.micro)", run, "requests")
            best["echo"] = max(best.get("echo", run), run, key=lambda r: r.rate)
            run = await drive(replies, wrapped_requests, window, {"wrapped": wrapped.proc.pid, **client},
                              check=BEAT_ANSWERS.__contains__)
            show("no-op through services.endpoints", run, "requests")
            best["wrapped"] = max(best.get("wrapped", run), run, key=lambda r: r.rate)
            for label, replica in replicas.items():
                run = await drive(clients[label][1], beats[label], window,
                                  {"registry": replica.proc.pid, **against[label]}, check=BEAT_ANSWERS.__contains__)
                show(f"{label}: heartbeat", run, "heartbeats")
                best[label] = max(best.get(label, run), run, key=lambda r: r.rate)
        for label, replica in replicas.items():
            prefix = f"{tag}{label[0]}"
            storms[label] = run, during = await storm(
                clients[label][1], [(service_subject(prefix, "registry", "register", w),
                                     registration(w, f"storm-{w}")) for w in workers],
                beats[label], {"registry": replica.proc.pid, **against[label]})
            show(f"{label}: re-register, all at once", run, "registrations")
            print(f"{'':<34}{len(during):>9,} heartbeats meanwhile: p99 {pct_ms(during, 0.99):.1f} ms, "
                  f"max {pct_ms(during, 1.0):.1f} ms", flush=True)
        for replica in replicas.values():  # idle from here on: (e) and (f) have the machine
            await replica.stop()
        replicas = {}
        fleet_figures = await fleet(nats_url, nc, replies, tag, workers, window, args.reconcile_interval, client)
    finally:
        for replica in replicas.values():
            await replica.stop()
        await echo.stop()
        await wrapped.stop()
        for other, its_replies in clients.values():
            await its_replies.stop()
            await other.close()
        for server in own.values():
            await server.stop()

    echo_run, wrapped_run = best["echo"], best["wrapped"]
    out: dict = {**fleet_figures,"echo_per_s": round(echo_run.rate), "echo_p99_ms": round(echo_run.pct_ms(0.99), 2),
                 "echo_cpu_us": {name: round(echo_run.cpu_us(name), 1) for name in echo_run.cpu},
                 "wrapped_noop_per_s": round(wrapped_run.rate),
                 "wrapped_noop_vs_echo": round(wrapped_run.rate / echo_run.rate, 3),
                 "wrapped_noop_cpu_us": {name: round(wrapped_run.cpu_us(name), 1) for name in wrapped_run.cpu}}
    for label in codes:
        beat, reg = best[label], registered[label]
        figures = {
            "heartbeats_per_s": round(beat.rate),
            "heartbeat_p50_ms": round(beat.pct_ms(0.5), 2),
            "heartbeat_p99_ms": round(beat.pct_ms(0.99), 2),
            "heartbeat_vs_echo": round(beat.rate / echo_run.rate, 3),
            "register_per_s": round(reg.rate),
            "register_p99_ms": round(reg.pct_ms(0.99), 2),
            "heartbeat_cpu_us": {name: round(beat.cpu_us(name), 1) for name in beat.cpu},
            "reregister_per_s": round(storms[label][0].rate),
            "storm_register_p99_ms": round(storms[label][0].pct_ms(0.99), 1),
            "storm_heartbeat_p99_ms": round(pct_ms(storms[label][1], 0.99), 1),
            "storm_heartbeat_max_ms": round(pct_ms(storms[label][1], 1.0), 1),
        }
        out.update(figures if label == "now" else {f"{label}_{key}": value for key, value in figures.items()})
    print(f"\n{args.workers:,} workers, {window} in flight, best of two; echo {out['echo_per_s']:,} requests/s; "
          f"a no-op through services.endpoints {out['wrapped_noop_per_s']:,}/s "
          f"({out['wrapped_noop_vs_echo']:.3f} of echo)", flush=True)
    for label in codes:
        key = "" if label == "now" else f"{label}_"
        print(f"{label:>7}: {out[key + 'heartbeats_per_s']:,} heartbeats/s (p99 {out[key + 'heartbeat_p99_ms']} ms) "
              f"= {out[key + 'heartbeat_vs_echo']:.3f} of echo; {out[key + 'register_per_s']:,} registrations/s; "
              f"a storm: {out[key + 'reregister_per_s']:,} re-registrations/s, heartbeats meanwhile p99 "
              f"{out[key + 'storm_heartbeat_p99_ms']} ms", flush=True)
    if args.before:
        out["heartbeats_now_vs_before"] = round(out["heartbeats_per_s"] / out["before_heartbeats_per_s"], 2)
        print(f"now / before: {out['heartbeats_now_vs_before']}x heartbeats/s", flush=True)
    return out

def main() -> None:
    if len(sys.argv) >= 5 and sys.argv[1] == "--serve":
        sys.path.insert(0, os.environ.get("PYTHONPATH", str(ROOT)).split(os.pathsep)[0])
        serve(*sys.argv[2:])
        return
    sys.path.insert(0, str(ROOT))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 heartbeats per worker instead of 5 (registering the workers takes as long), "
                             "and (e)'s round after 60 s instead of 100")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--workers", type=int, default=10_000, help="registered workers (default 10000)")
    parser.add_argument("--window", type=int, default=256, help="requests in flight (default 256)")
    parser.add_argument("--rounds", type=int, help="heartbeats per worker per measurement (default 5, --quick 2)")
    parser.add_argument("--before", help="also bench the registry of this checkout (an earlier commit's worktree)")
    parser.add_argument("--fleet-only", action="store_true", help="only (e) and (f)")
    parser.add_argument("--reconcile-interval", type=float,
                        help="the fleet's registry reconciles this often, in s (default: the service's, 100; "
                             "--quick 60): (e) waits for its first round after (f)")
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.reconcile_interval is None:
        from services.registry.liveness import RECONCILE_INTERVAL_S

        args.reconcile_interval = 60.0 if args.quick else RECONCILE_INTERVAL_S

    from warmboot.natsserver import NatsServer

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="warmboot-bench-") as tmp, NatsServer(tmp) as server:
        results = asyncio.run(bench(server.url, server.process.pid, args))
    results.update(workers=args.workers, window=args.window, quick=args.quick,
                   elapsed_s=round(time.perf_counter() - t0, 1))
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
