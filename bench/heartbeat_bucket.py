"""What a heartbeat's put costs nats-server, and how much of it is the sweep.

    python bench/heartbeat_bucket.py [--puts N] [--workers N] [--window N] [--rounds N] [--json]

Each heartbeat puts the worker's key in the bucket `<PREFIX>_HEARTBEATS` with a per-message
TTL, and the registry replicas' shared consumer (`registry-sweeper`) is delivered every
put, to be acknowledged, because an expiry marker comes on the key's own subject
(`services.registry.liveness`). This bench drives the registry's own `Liveness.beat`
(`--window` puts in flight over `--workers` keys) in this process, on a nats-server of
its own (file storage, as in production), two ways, alternated over `--rounds` rounds on
fresh buckets:

- `with_sweep`: `Liveness` as the registry starts it, the sweeper pulling and acknowledging all
  at once (`AckPolicy.ALL`: now and then the newest put);
- `sweep_acking_each`: the sweep as it was before it was pinned to one replica, each put
  acknowledged on its own (`AckPolicy.EXPLICIT`): side by side, what acknowledging all at once
  buys (`all_at_once_vs_each_server`, `all_at_once_vs_each_client`);
- `sweep_without_acks`: the sweeper's consumer with `AckPolicy.NONE`, each put delivered and
  not acknowledged (a measurement only: what shedding the sweep's acks would buy; a marker
  handed to a replica that dies is then lost to the others, docs/scaling.md);
- `without_sweep`: the same bucket with no sweeper (a measurement only: without it no
  worker is ever found `LOST`).

It prints the server's CPU per put (from /proc) and this process's (the puts, their acks,
and with the sweep its deliveries and acks), each the median over the rounds, and the
sweep's share of the server's (`sweep_share_of_server`), and what the sweep's acks are of the
server's and of this process's CPU per put (`sweep_acks_server_us_per_put`,
`sweep_acks_client_us_per_put`). With `--json` the last line is
one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from registry import cpu_seconds  # noqa: E402  (bench/registry.py: CPU of a process from /proc)


WAYS = ("with_sweep", "sweep_acking_each", "sweep_without_acks", "without_sweep")


def unpinned(sweeper) -> None:
    """`sweeper`'s consumer with no priority group: any number of replicas pull from it."""
    from services.registry.liveness import PULL_BATCH, PULL_EXPIRES_S

    for name in ("priority_groups", "priority_policy", "priority_timeout"):
        del sweeper.config[name]
    request = json.dumps({"batch": PULL_BATCH, "expires": int(PULL_EXPIRES_S * 1e9)}).encode()
    sweeper._request = lambda: request


def deliver_puts_to(sweeper, on_put) -> None:
    """`sweeper`'s deliveries read as it reads them (the pull's statuses, its credit, markers queued),
    each put's reply subject handed to `on_put` instead of to the sweep's acks."""
    from services.registry.liveness import MARKER_REASON

    delivered = sweeper._delivered

    def put(msg) -> None:
        if not msg.reply:  # the pull request's statuses, as the sweeper reads them
            return delivered(msg)
        sweeper._credit -= 1
        if sweeper._credit <= 0:
            sweeper._ended.set()
        if msg.headers and msg.headers.get(MARKER_REASON) == "MaxAge":
            sweeper._markers.put_nowait(msg)
        else:
            on_put(msg.reply)

    sweeper._delivered = put


def acking_each(sweeper) -> None:
    """`sweeper` (a `liveness.Sweeper` not started) as the sweep was before it was pinned to one replica:
    shared by any number (no priority group), each put acknowledged on its own (`AckPolicy.EXPLICIT`),
    one ack task for all that one read of the socket brought."""
    from events.natspy.publish import publish

    unpinned(sweeper)
    sweeper.config["ack_policy"] = "explicit"
    to_ack, acking = [], []

    async def ack() -> None:
        try:
            while to_ack:
                replies = to_ack[:]
                to_ack.clear()
                for reply in replies:
                    await publish(sweeper.nc, reply, b"+ACK")
        finally:
            acking.clear()

    def each(reply: str) -> None:
        to_ack.append(reply)
        if not acking:
            acking.append(asyncio.create_task(ack()))

    deliver_puts_to(sweeper, each)


def without_acks(sweeper) -> None:
    """`sweeper` (a `liveness.Sweeper` not started) on a consumer that wants no acks, its puts
    delivered and dropped: the sweep's cost without its acks."""
    unpinned(sweeper)
    sweeper.config["ack_policy"] = "none"
    del sweeper.config["max_ack_pending"]
    deliver_puts_to(sweeper, lambda reply: None)


async def one_round(url: str, server_pid: int, prefix: str, way: str, args: argparse.Namespace) -> dict:
    import nats

    from services.registry.liveness import SWEEPER, Liveness

    async def never(worker_id: str) -> None:  # no key outlives its TTL here
        raise AssertionError(f"worker {worker_id} expired during the bench")

    nc = await nats.connect(url)
    liveness = Liveness(nc, prefix, ttl_s=1800.0, on_expired=never)
    sweep = way != "without_sweep"
    if way == "sweep_without_acks":
        without_acks(liveness.sweeper)
    if way == "sweep_acking_each":
        acking_each(liveness.sweeper)
    if not sweep:
        async def no_sweeper() -> None:
            return None
        liveness.sweeper.start = no_sweeper  # type: ignore[method-assign]
        liveness.sweeper.stop = no_sweeper  # type: ignore[method-assign]
    await liveness.start()
    workers = [f"w{i:05d}" for i in range(args.workers)]
    pending = iter(range(args.puts))

    async def lane() -> None:
        for i in pending:
            await liveness.beat(workers[i % len(workers)])

    try:
        server0, own0, t0 = cpu_seconds(server_pid), cpu_seconds(os.getpid()), time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(args.window)))
        if sweep:  # every put of this round delivered, and acked if the consumer wants acks, before the CPU is read
            await swept(nc, liveness.stream, SWEEPER, acked=way != "sweep_without_acks")
        elapsed = time.perf_counter() - t0
        server, own = cpu_seconds(server_pid) - server0, cpu_seconds(os.getpid()) - own0
    finally:
        await liveness.stop()
        await nc.close()
    return {"puts_per_s": args.puts / elapsed, "server_us_per_put": server / args.puts * 1e6,
            "client_us_per_put": own / args.puts * 1e6}


async def swept(nc, stream: str, consumer: str, acked: bool, timeout_s: float = 30.0) -> None:
    """Until the consumer has delivered every message (and had each acked, if `acked`), as its info says."""
    js, deadline = nc.jetstream(), time.monotonic() + timeout_s
    while True:
        await nc.flush()
        info = await js.consumer_info(stream, consumer)
        if info.num_pending == 0 and (not acked or info.num_ack_pending == 0):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the sweep's consumer still has {info.num_pending} to deliver and "
                               f"{info.num_ack_pending} unacked after {timeout_s:g}s")
        await asyncio.sleep(0.01)  # polling the consumer's info: nothing to await on it


async def bench(url: str, server_pid: int, args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for r in range(args.rounds):
        for label in (WAYS if r % 2 == 0 else WAYS[::-1]):
            run = await one_round(url, server_pid, f"hb{r}{WAYS.index(label)}", label, args)
            runs[label].append(run)
            print(f"round {r + 1} {label:<18} {run['puts_per_s']:>9,.0f} puts/s   server {run['server_us_per_put']:5.1f} "
                  f"us/put   this process {run['client_us_per_put']:5.1f} us/put", flush=True)
    out: dict = {}
    for label, rounds in runs.items():
        for key in ("puts_per_s", "server_us_per_put", "client_us_per_put"):
            out[f"{key}_{label}"] = round(statistics.median(run[key] for run in rounds), 1)
    out["sweep_share_of_server"] = round(
        1 - out["server_us_per_put_without_sweep"] / out["server_us_per_put_with_sweep"], 2)
    out["sweep_client_us_per_put"] = round(
        out["client_us_per_put_with_sweep"] - out["client_us_per_put_without_sweep"], 1)
    out["all_at_once_vs_each_server"] = round(
        out["server_us_per_put_with_sweep"] / out["server_us_per_put_sweep_acking_each"], 2)
    out["all_at_once_vs_each_client"] = round(
        out["client_us_per_put_with_sweep"] / out["client_us_per_put_sweep_acking_each"], 2)
    out["sweep_acks_server_us_per_put"] = round(
        out["server_us_per_put_with_sweep"] - out["server_us_per_put_sweep_without_acks"], 1)
    out["sweep_acks_client_us_per_put"] = round(
        out["client_us_per_put_with_sweep"] - out["client_us_per_put_sweep_without_acks"], 1)
    print(f"\nserver CPU per put: {out['server_us_per_put_with_sweep']} us with the sweep, "
          f"{out['server_us_per_put_without_sweep']} us without: the sweep is {out['sweep_share_of_server']:.0%} of it; "
          f"in the registry's process the sweep costs {out['sweep_client_us_per_put']} us per put; of that, its acks "
          f"{out['sweep_acks_server_us_per_put']} us of the server's and {out['sweep_acks_client_us_per_put']} us of "
          "the registry's; acknowledged all at once against each on its own (as before): "
          f"{out['all_at_once_vs_each_server']}x the server's CPU per put, "
          f"{out['all_at_once_vs_each_client']}x the registry's", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--puts", type=int, default=60_000, help="puts per round and way (default 60000)")
    parser.add_argument("--workers", type=int, default=4_000, help="keys the puts cycle over (default 4000)")
    parser.add_argument("--window", type=int, default=256, help="puts in flight (default 256)")
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    for name in ("puts", "workers", "window", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")

    from warmboot.natsserver import NatsServer

    with tempfile.TemporaryDirectory(prefix="warmboot-bench-") as tmp, NatsServer(tmp) as server:
        results = asyncio.run(bench(server.url, server.process.pid, args))
    results.update(puts=args.puts, workers=args.workers, window=args.window, rounds=args.rounds)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
