"""Registry benchmark: heartbeats and registrations over NATS, against a no-op service.

    python bench/registry.py [--quick] [--json] [--workers N] [--window N] [--before DIR]

Side by side, in one run, on one nats-server (file storage, as in production):

(a) echo: a no-op `nats.micro` service (one endpoint answering `{}`) in its own process;
    a client keeps `--window` requests in flight, each to a different subject token
    as heartbeats are. This is the ceiling the client, the bus and one Python process
    reach on this machine. Beside it, a no-op endpoint through the services' shared
    machinery (`services.common.add_endpoints`), answering what a heartbeat answers:
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

The registry process tunes its collector as `warmboot serve` does (`services.common.tune_gc`,
when the checkout has it); the echo and the no-op run as plain Python processes. All of them
run on the event loop `warmboot serve` runs on (`services.common.run_serving`: uvloop, unless
WARMBOOT_EVENT_LOOP=asyncio; a checkout without it, asyncio's).
Every reply is checked: a refused heartbeat or registration fails the run.
`--before DIR` also runs (b) and (c) against the registry of another checkout (say a
`git worktree` of an earlier commit) in the same run, on the same server, its
heartbeats alternating with the others.
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

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
TTL_S = 1800.0  # long enough that no worker is lost between its registration and its beats


# --- the serving processes ------------------------------------------------------------------------


def serve(kind: str, nats_url: str, prefix: str) -> None:
    """A registry replica, or an echo service, in this process: prints READY, runs until stdin closes.

    `echo` is a plain nats.micro service; `wrapped` answers what a heartbeat does,
    `{"ttl_s": 1800.0}`, through the services' shared endpoint machinery
    (`services.common.add_endpoints`: validation at the edge, a task per request,
    contract errors, stats), and does nothing else."""
    import nats

    async def main() -> None:
        nc = await nats.connect(nats_url)
        if kind == "registry":
            from services.registry.service import RegistryService

            service = RegistryService(nc, nats_url=nats_url, prefix=prefix, ttl_s=TTL_S)
            await service.start()
        elif kind == "wrapped":
            from events.schema import Heartbeat, HeartbeatReply
            from services.common import EndpointSpec, add_endpoints

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
        if kind == "registry":  # as `warmboot serve` does (an older checkout has no tune_gc); echo and
            import services.common  # the no-op through services.common run as plain Python processes

            getattr(services.common, "tune_gc", lambda: None)()
        print("READY", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await service.stop()
        await nc.close()

    # Every kind on the loop `warmboot serve` runs on, the echo too (an older checkout has no
    # run_serving: asyncio's loop).
    import services.common

    getattr(services.common, "run_serving", lambda run: asyncio.run(run()))(main)


class Served:
    """A serving process started from `code` (a checkout's root)."""

    def __init__(self, kind: str, nats_url: str, prefix: str, code: Path = ROOT):
        env = {**os.environ, "PYTHONPATH": str(code)}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", kind, nats_url, prefix],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=code, env=env,
        )

    async def ready(self) -> "Served":
        line = await asyncio.to_thread(self.proc.stdout.readline)
        if not line.startswith("READY"):
            raise RuntimeError(f"the served process did not start: {line!r}")
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
                check=lambda data: not data.startswith(b'{"error"')) -> Run:
    """Send every request with `window` in flight; every reply must pass `check`.

    Through `events.natspy.Replies` (one inbox, no timer per request), so that the
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

    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(window)))
    elapsed = time.perf_counter() - t0
    cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(requests)} requests refused; the first: {bad[0][:300]!r}")
    return Run(len(requests), elapsed, latencies, cpu)


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
        request_id=request_id,
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


async def bench(nats_url: str, server_pid: int, args: argparse.Namespace) -> dict:
    import nats

    from events.natspy import Replies
    from events.subjects import service_subject

    nc = await nats.connect(nats_url)
    replies = await Replies(nc, timeout=60).start()
    workers = [f"w{i:05d}" for i in range(args.workers)]
    window = args.window
    tag = f"b{os.getpid() % 10000}"
    codes = {"now": ROOT}
    if args.before:
        codes["before"] = Path(args.before).resolve()
    echo = await Served("echo", nats_url, f"{tag}e").ready()
    wrapped = await Served("wrapped", nats_url, f"{tag}w").ready()
    replicas = {label: await Served("registry", nats_url, f"{tag}{label[0]}", code).ready()
                for label, code in codes.items()}
    client = {"client": os.getpid(), "server": server_pid}
    echo_requests = [(f"{tag}e.echo.beat.{w}", b"{}") for w in workers] * args.rounds
    wrapped_requests = [(service_subject(f"{tag}w", "bench", "beat", w), b"{}") for w in workers] * args.rounds
    beats = {label: [(service_subject(f"{tag}{label[0]}", "registry", "heartbeat", w), b"{}") for w in workers]
             * args.rounds for label in codes}
    registered: dict[str, Run] = {}
    best: dict[str, Run] = {}
    storms: dict[str, tuple[Run, list[float]]] = {}
    try:
        for label, replica in replicas.items():
            prefix = f"{tag}{label[0]}"
            registered[label] = run = await drive(
                replies, [(service_subject(prefix, "registry", "register", w), registration(w)) for w in workers],
                window, {"registry": replica.proc.pid, **client})
            show(f"{label}: register", run, "registrations")
        # Alternate, so that each figure meets the same load from the rest of the machine.
        for _ in range(2):
            run = await drive(replies, echo_requests, window, {"echo": echo.proc.pid, **client})
            show("echo (no-op nats.micro)", run, "requests")
            best["echo"] = max(best.get("echo", run), run, key=lambda r: r.rate)
            run = await drive(replies, wrapped_requests, window, {"wrapped": wrapped.proc.pid, **client},
                              check=lambda data: data == b'{"ttl_s":1800.0}')
            show("no-op through services.common", run, "requests")
            best["wrapped"] = max(best.get("wrapped", run), run, key=lambda r: r.rate)
            for label, replica in replicas.items():
                run = await drive(replies, beats[label], window, {"registry": replica.proc.pid, **client},
                                  check=lambda data: data == b'{"ttl_s":1800.0}')
                show(f"{label}: heartbeat", run, "heartbeats")
                best[label] = max(best.get(label, run), run, key=lambda r: r.rate)
        for label, replica in replicas.items():
            prefix = f"{tag}{label[0]}"
            storms[label] = run, during = await storm(
                replies, [(service_subject(prefix, "registry", "register", w), registration(w, f"storm-{w}"))
                          for w in workers], beats[label], {"registry": replica.proc.pid, **client})
            show(f"{label}: re-register, all at once", run, "registrations")
            print(f"{'':<34}{len(during):>9,} heartbeats meanwhile: p99 {pct_ms(during, 0.99):.1f} ms, "
                  f"max {pct_ms(during, 1.0):.1f} ms", flush=True)
    finally:
        for replica in replicas.values():
            await replica.stop()
        await echo.stop()
        await wrapped.stop()
        await replies.stop()
        await nc.close()

    echo_run, wrapped_run = best["echo"], best["wrapped"]
    out: dict = {"echo_per_s": round(echo_run.rate), "echo_p99_ms": round(echo_run.pct_ms(0.99), 2),
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
          f"a no-op through services.common {out['wrapped_noop_per_s']:,}/s "
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
    if len(sys.argv) == 5 and sys.argv[1] == "--serve":
        sys.path.insert(0, os.environ.get("PYTHONPATH", str(ROOT)).split(os.pathsep)[0])
        serve(sys.argv[2], sys.argv[3], sys.argv[4])
        return
    sys.path.insert(0, str(ROOT))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 heartbeats per worker instead of 5 (registering the workers takes as long)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--workers", type=int, default=10_000, help="registered workers (default 10000)")
    parser.add_argument("--window", type=int, default=256, help="requests in flight (default 256)")
    parser.add_argument("--rounds", type=int, help="heartbeats per worker per measurement (default 5, --quick 2)")
    parser.add_argument("--before", help="also bench the registry of this checkout (an earlier commit's worktree)")
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5

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
