"""What a command's read of its actor costs as the actor's history grows: a whole read, against
the services' cache of aggregates (`events.aggregate.AggregateCache`), side by side.

    python bench/history.py [--quick] [--json] [--lengths 30,300,3000] [--actors N] [--rounds N]

One nats-server (file storage, one replica), every service in this process. `--actors` actors
live through resume and pause cycles until their histories reach each length in turn. At each
length, `--rounds` times: every actor is resumed and paused once more through the services
(the scheduler's placement and the snapshotter's pause land in its history), and then its
history is read as a command reads it, by two applications of the snapshotter's kind on the
same stream: one whole (`WARMBOOT_AGGREGATE_CACHE_EVENTS=0`, what every command did before the
cache) and one with the cache (it last read the actor a round ago, as a replica that served the
actor's last command did), every actor by one, then by the other (which first, alternated round
by round), the garbage collected before each read. The figures are the CPU time of each
read (`time.thread_time`, this process's one thread) and their quotient, measured in one run
(this machine is shared and noisy: absolute times wander, the quotient is what counts), and the
pause's latency through the services (which use the cache) at each length.

With `--json` the last line is one JSON object: per length L, `load_us_whole_L`,
`load_us_cached_L`, `load_cached_vs_whole_L` (medians) and `pause_p50_ms_L`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


async def grow(wb, actors: list[str], length: int, app) -> None:
    """Resume and pause every actor until each history holds at least `length` events."""
    from services.snapshotter.domain import Actor

    while True:
        version = (await app.get_async(Actor.create_id(actors[0]))).version
        if version >= length:
            return
        cycles = max(1, (length - version) // 3)
        print(f"  growing {len(actors)} histories from {version} to {length} events ({cycles} cycles)", flush=True)
        for done in range(cycles):
            await asyncio.gather(*(wb.resume(a) for a in actors))
            await asyncio.gather(*(wb.pause(a) for a in actors))
            if done and done % 200 == 0:
                print(f"    {done}/{cycles}", flush=True)


async def read_cpu_us(app, aggregate_id: str) -> float:
    """The thread's CPU time of one read. This thread runs the services too: the garbage a whole
    read leaves is collected before, not in, the next read (a whole read of 3,000 events made the
    cached read after it look 9x dearer), and the reads of one kind are made one after the other."""
    gc.collect()
    await asyncio.sleep(0)
    started = time.thread_time()
    await app.get_async(aggregate_id)
    return (time.thread_time() - started) * 1e6


async def bench(url: str, args: argparse.Namespace) -> dict:
    import nats

    from events.aggregate import CACHE_ENV
    from events.jetstream.link import links_on
    from services.process import store_env
    from services.snapshotter.domain import Actor
    from services.snapshotter.service import SnapshotterApplication
    from tests.factories import actor, version, worker
    from warmboot.client import Client
    from warmboot.runner import SERVICES, start_services

    prefix = f"h{os.getpid() % 10000}"
    out: dict = {}
    async with AsyncExitStack() as exits:
        await start_services(exits, list(SERVICES), url, prefix, options={"registry": {"ttl_s": 3600}})
        nc = await nats.connect(url)
        exits.push_async_callback(nc.close)
        wb = Client(nc, prefix)
        for i in range(4):
            await wb.register(worker(f"w{i}", version("v1"), cpu=640000, mem=655360))
        actors = [f"a{i:03d}" for i in range(args.actors)]
        await asyncio.gather(*(wb.create(actor(a, cpu=10, mem=16)) for a in actors))
        apps = {}
        with links_on(asyncio.get_running_loop()):
            for label, budget in (("whole", "0"), ("cached", "1000000")):
                os.environ[CACHE_ENV] = budget
                apps[label] = await asyncio.to_thread(SnapshotterApplication, store_env(url, prefix))
                exits.callback(apps[label].close)
        os.environ.pop(CACHE_ENV, None)
        assert apps["whole"].cache is None and apps["cached"].cache is not None
        for length in args.lengths:
            await grow(wb, actors, length, apps["cached"])
            reads: dict[str, list[float]] = {"whole": [], "cached": []}
            pauses: list[float] = []
            for a in actors:
                await apps["cached"].get_async(Actor.create_id(a))  # the actor as a command last read it
            for round_ in range(args.rounds):
                for a in actors:
                    await wb.resume(a)
                    started = time.perf_counter()
                    await wb.pause(a)
                    pauses.append((time.perf_counter() - started) * 1000)
                for label in ("whole", "cached") if round_ % 2 == 0 else ("cached", "whole"):
                    for a in actors:
                        reads[label].append(await read_cpu_us(apps[label], Actor.create_id(a)))
            whole, cached = statistics.median(reads["whole"]), statistics.median(reads["cached"])
            events = (await apps["cached"].get_async(Actor.create_id(actors[0]))).version
            out[f"load_us_whole_{length}"] = round(whole)
            out[f"load_us_cached_{length}"] = round(cached)
            out[f"load_cached_vs_whole_{length}"] = round(cached / whole, 3)
            out[f"pause_p50_ms_{length}"] = round(statistics.median(pauses), 2)
            print(f"history {events:6,} events: a command's read {whole:9,.0f} us whole, {cached:7,.0f} us cached "
                  f"({cached / whole:.3f}x); pause p50 {statistics.median(pauses):.2f} ms through the services",
                  flush=True)
    return out


def main() -> None:
    sys.path.insert(0, str(ROOT))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="lengths 30 and 600, 10 actors, 3 rounds")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--lengths", help="history lengths, comma-separated (default 30,300,3000)")
    parser.add_argument("--actors", type=int, help="actors (default 20, --quick 10)")
    parser.add_argument("--rounds", type=int, help="measured cycles per length (default 5, --quick 3)")
    args = parser.parse_args()
    try:
        args.lengths = [int(x) for x in (args.lengths or ("30,600" if args.quick else "30,300,3000")).split(",")]
    except ValueError:
        parser.error(f"--lengths {args.lengths}: give whole numbers separated by commas")
    if any(length < 1 for length in args.lengths) or args.lengths != sorted(args.lengths):
        parser.error(f"--lengths {args.lengths}: positive, in increasing order")
    args.actors = args.actors or (10 if args.quick else 20)
    args.rounds = args.rounds or (3 if args.quick else 5)
    for name, value in (("--actors", args.actors), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{name} must be at least 1, not {value}")

    from warmboot.natsserver import NatsServer

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="warmboot-bench-") as tmp, NatsServer(tmp) as server:
        results = asyncio.run(bench(server.url, args))
    results.update(lengths=args.lengths, actors=args.actors, rounds=args.rounds, quick=args.quick,
                   elapsed_s=round(time.perf_counter() - t0, 1))
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
