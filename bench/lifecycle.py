"""Lifecycle benchmark: creates, resumes, pauses and suspends through the services, over NATS.

    python bench/lifecycle.py [--quick] [--json] [--actors N] [--window N] [--rounds N] [--before DIR]

One nats-server (file storage, one replica: the embedded default). Each tree's registry,
snapshotter and scheduler run as three processes of their own (`warmboot serve <name>`,
as in production), on a prefix of their own; 100 workers register, then every round
takes `--actors` new actors through their life with `--window` requests in flight, each
with a request id: create, resume, pause, resume, suspend. Every reply is checked: a
refusal fails the run. Each process's CPU is read from /proc, per request.

`--before DIR` runs the same rounds against the services of another checkout (say a `git
worktree` of an earlier commit), alternating with this tree's, round by round, on the same
server: the figures to compare are the `*_now_vs_before` ratios (this machine is shared and
noisy; absolute rates wander). With `--json` the last line is one JSON object: per phase
`<phase>_per_s` and `<phase>_cpu_us` (the best round), and with `--before` the same keys
prefixed `before_` and `<phase>_now_vs_before`.

Why it exists: a pause or a suspend is an atomic batch (the actor's events and a fence on
its worker's history), and nats-server stages each atomic batch of a one-replica file
stream in a file store of its own (`events.jetstream.grouped`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("registry", "snapshotter", "scheduler")
PHASES = ("create", "resume", "pause", "resume_again", "suspend")
WORKERS = 100


class Services:
    """One tree's three services, each a `warmboot serve <name>` process."""

    def __init__(self, code: Path, nats_url: str, prefix: str):
        self.code, self.nats_url, self.prefix = code, nats_url, prefix
        self.procs: dict[str, subprocess.Popen] = {}

    async def start(self) -> "Services":
        env = {**os.environ, "PYTHONPATH": str(self.code)}
        for name in SERVICES:
            proc = subprocess.Popen(
                [sys.executable, "-c", "from warmboot.cli import main; main()", "serve", name,
                 "--nats", self.nats_url, "--prefix", self.prefix, *(["--ttl", "3600"] if name == "registry" else [])],
                cwd=self.code, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self.procs[name] = proc
            line = await asyncio.to_thread(proc.stdout.readline)
            if not line.startswith("serving"):
                raise RuntimeError(f"{name} of {self.code} did not start: {line!r}")
        return self

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items()}

    async def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            await asyncio.to_thread(proc.wait, 30)


def bodies(prefix: str, phase: str, actors: list[str], tag: str) -> list[tuple[str, bytes]]:
    from events.codec import encode
    from events.schema import CreateActor, Fidelity, PauseActor, Resources, ResumeActor, SuspendActor
    from events.subjects import service_subject

    def one(actor: str) -> tuple[str, bytes]:
        request_id = f"{tag}-{phase}-{actor}"
        if phase == "create":
            body = CreateActor(actor_id=actor, sandbox_class="gvisor", template_uid="t1",
                               resources=Resources(cpu_millis=10, memory_mib=16), request_id=request_id)
            return service_subject(prefix, "snapshotter", "create", actor), encode(body)
        if phase.startswith("resume"):
            return service_subject(prefix, "scheduler", "resume", actor), encode(ResumeActor(request_id=request_id))
        if phase == "pause":
            return service_subject(prefix, "snapshotter", "pause", actor), encode(PauseActor(request_id=request_id))
        return (service_subject(prefix, "snapshotter", "suspend", actor),
                encode(SuspendActor(fidelity=Fidelity.MEMORY, request_id=request_id)))

    return [one(actor) for actor in actors]


async def register_workers(replies, prefix: str) -> None:
    """`WORKERS` workers, registered as `bench/registry.py` registers its own."""
    from bench.registry import drive, registration
    from events.subjects import service_subject

    requests = [(service_subject(prefix, "registry", "register", f"w{i}"), registration(f"w{i}", f"reg-w{i}"))
                for i in range(WORKERS)]
    await drive(replies, requests, 64, {})


async def bench(nats_url: str, server_pid: int, args: argparse.Namespace) -> dict:
    import nats

    from bench.registry import drive
    from events.natspy.publish import Replies

    nc = await nats.connect(nats_url)
    replies = await Replies(nc, timeout=120).start()
    codes = {"now": ROOT}
    if args.before:
        codes["before"] = Path(args.before).resolve()
    tag = f"l{os.getpid() % 10000}"
    trees = {label: await Services(code, nats_url, f"{tag}{label[0]}").start() for label, code in codes.items()}
    best: dict[tuple[str, str], object] = {}
    try:
        for label, services in trees.items():
            await register_workers(replies, services.prefix)
        for round_ in range(args.rounds):
            actors = [f"a{round_}x{i:05d}" for i in range(args.actors)]
            for label, services in trees.items():
                pids = {**services.pids(), "server": server_pid, "client": os.getpid()}
                for phase in PHASES:
                    run = await drive(replies, bodies(services.prefix, phase, actors, tag), args.window, pids)
                    costs = ", ".join(f"{name} {run.cpu_us(name):.0f}" for name in run.cpu)
                    print(f"round {round_ + 1} {label:>6} {phase:<13}{run.rate:>8,.0f}/s  p99 {run.pct_ms(0.99):7.1f} ms"
                          f"  [CPU us per request: {costs}]", flush=True)
                    key = (label, phase)
                    if key not in best or run.rate > best[key].rate:
                        best[key] = run
    finally:
        for services in trees.values():
            await services.stop()
        await replies.stop()
        await nc.close()

    out: dict = {}
    for (label, phase), run in best.items():
        prefix = "" if label == "now" else f"{label}_"
        out[f"{prefix}{phase}_per_s"] = round(run.rate)
        out[f"{prefix}{phase}_p99_ms"] = round(run.pct_ms(0.99), 1)
        out[f"{prefix}{phase}_cpu_us"] = {name: round(run.cpu_us(name)) for name in run.cpu}
    print(f"\n{args.actors:,} actors a round, {args.window} in flight, {WORKERS} workers, best of {args.rounds} rounds")
    for phase in PHASES:
        line = f"{phase:<13}{out[f'{phase}_per_s']:>8,}/s"
        if args.before:
            ratio = out[f"{phase}_per_s"] / out[f"before_{phase}_per_s"]
            out[f"{phase}_now_vs_before"] = round(ratio, 2)
            line += f"  before {out[f'before_{phase}_per_s']:,}/s: {ratio:.2f}x"
        print(line, flush=True)
    return out


def main() -> None:
    sys.path.insert(0, str(ROOT))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 actors a round, 2 rounds")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--actors", type=int, help="new actors each round (default 2000, --quick 1000)")
    parser.add_argument("--window", type=int, default=256, help="requests in flight (default 256)")
    parser.add_argument("--rounds", type=int, help="rounds, alternated between the trees (default 3, --quick 2)")
    parser.add_argument("--before", help="also bench the services of this checkout (an earlier commit's worktree)")
    args = parser.parse_args()
    args.actors = args.actors or (1000 if args.quick else 2000)
    args.rounds = args.rounds or (2 if args.quick else 3)
    for name, value in (("--actors", args.actors), ("--window", args.window), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{name} must be at least 1, not {value}")
    if args.before and not (Path(args.before) / "warmboot" / "cli.py").is_file():
        parser.error(f"--before {args.before}: not a warmboot checkout (no warmboot/cli.py)")

    from warmboot.natsserver import NatsServer

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="warmboot-bench-") as tmp, NatsServer(tmp) as server:
        results = asyncio.run(bench(server.url, server.process.pid, args))
    results.update(actors=args.actors, window=args.window, rounds=args.rounds, quick=args.quick,
                   elapsed_s=round(time.perf_counter() - t0, 1))
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
