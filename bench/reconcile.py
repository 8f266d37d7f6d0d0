"""What a round of reconciliation costs the registry per worker: its read of each key against nats-py's.

    python bench/reconcile.py [--workers N] [--rounds N] [--json]

A round (`RegistryService.reconcile`, at start, every `reconcile_interval_s`, and when the sweep
is pinned anew or misses a delivery) reads the heartbeat key of every registered worker at the
stream leader (`STREAM.MSG.GET`), 32 at once. One registry replica runs in this process (on the
event loop `warmboot serve` runs on), on a nats-server of its own (file storage), with `--workers` workers registered and beating (their
keys hold a heartbeat each); the process's CPU is read around whole rounds, alternated over
`--rounds` rounds (the order swapped each round) between:

- the registry's read (`Liveness.entry`: the request sent through the beats' inbox, its answer
  read raw), and
- nats-py's (`JetStreamContext.get_msg`: a request with its own inbox and timer, the answer
  built into nats-py's objects), which a round made before 2026-12-05.

It prints the CPU and wall time per worker of each, the medians over the rounds, and their
quotient (`reconcile_read_vs_nats_py`: under 1 is cheaper). With `--json` the last line is one
JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402
from nats.js.errors import NotFoundError  # noqa: E402

from services.process import run_serving  # noqa: E402
from services.registry.liveness import key_state  # noqa: E402
from tests.registry_helpers import raw_request, registration, running_registry  # noqa: E402
from warmboot.natsserver import NatsServer  # noqa: E402

PREFIX = "rc"


async def nats_py_entry(self, worker_id: str) -> tuple[str, int]:
    """The read of a key as a round made it before: nats-py's `get_msg` at the stream leader."""
    try:
        msg = await self.js.get_msg(self.stream, subject=self.subject(worker_id))
    except NotFoundError:
        return "absent", 0
    return key_state(msg.headers or {}), msg.seq


async def bench(url: str, workers: int, rounds: int) -> dict:
    nc = await nats.connect(url)
    try:
        async with running_registry(url, PREFIX, ttl_s=1800, reconcile_interval_s=3600) as registry:
            window = asyncio.Semaphore(128)

            async def register(i: int) -> None:
                async with window:
                    reply, _ = await raw_request(nc, PREFIX, "register", f"w-{i}", registration(f"w-{i}"))
                    if reply.get("outcome") != "REGISTERED":
                        raise RuntimeError(f"w-{i} was not registered: {reply}")

            t = time.perf_counter()
            await asyncio.gather(*(register(i) for i in range(workers)))
            print(f"{workers} workers registered in {time.perf_counter() - t:.1f}s", flush=True)
            ways = {"registry": registry.liveness.entry,
                    "nats_py": types.MethodType(nats_py_entry, registry.liveness)}
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
            for round_ in range(rounds):
                for name in (list(ways) if round_ % 2 == 0 else list(reversed(ways))):
                    registry.liveness.entry = ways[name]
                    c0, t0 = time.process_time(), time.perf_counter()
                    await registry.reconcile()
                    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
                    runs[name].append((cpu, wall))
                    print(f"round {round_ + 1}, {name:8s}: {cpu * 1e6 / workers:6.1f} us of CPU and "
                          f"{wall * 1e6 / workers:6.1f} us of wall time a worker", flush=True)
            registry.liveness.entry = ways["registry"]
    finally:
        await nc.close()
    cpu = {name: statistics.median(c for c, _ in got) * 1e6 / workers for name, got in runs.items()}
    wall = {name: statistics.median(w for _, w in got) * 1e6 / workers for name, got in runs.items()}
    return {
        "reconcile_workers": workers,
        "reconcile_cpu_us_per_worker": round(cpu["registry"], 1),
        "reconcile_cpu_us_per_worker_nats_py": round(cpu["nats_py"], 1),
        "reconcile_wall_us_per_worker": round(wall["registry"], 1),
        "reconcile_wall_us_per_worker_nats_py": round(wall["nats_py"], 1),
        "reconcile_read_vs_nats_py": round(cpu["registry"] / cpu["nats_py"], 3),
        "reconcile_wall_vs_nats_py": round(wall["registry"] / wall["nats_py"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=5000, help="registered workers (default 5000)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if args.workers < 1 or args.rounds < 1:
        parser.error("--workers and --rounds must be at least 1")
    with tempfile.TemporaryDirectory() as tmp, NatsServer(tmp) as server:
        results = run_serving(lambda: bench(server.url, args.workers, args.rounds))  # on `warmboot serve`'s loop
    print(f"a round, per worker: {results['reconcile_cpu_us_per_worker']} us of CPU against "
          f"{results['reconcile_cpu_us_per_worker_nats_py']} with nats-py's read "
          f"({results['reconcile_read_vs_nats_py']}x); wall time {results['reconcile_wall_us_per_worker']} against "
          f"{results['reconcile_wall_us_per_worker_nats_py']} us ({results['reconcile_wall_vs_nats_py']}x)", flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
