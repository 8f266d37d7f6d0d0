"""Event-store bench: events.jetstream against the library's SQLite module, side by side.

    .venv/bin/python bench/store.py [--singles N] [--batches N] [--threads N] [--url nats://...] [--json]

One run measures, on the same workload (WorkerDrained events as WireMapper stores
them, one subject per aggregate):

- appends/s with one event per call (sequential, and from several threads),
- appends/s with a batch of 10 events per call (one atomic batch on JetStream), and what
  such a call takes against a call of one event (`jetstream_batch_call_vs_single_call`),
- replay events/s through the module (select_notifications pages; subscribe),
- the raw nats-py ordered-consumer read rate of the same stream (the ceiling),

and prints the ratios. Without --url it starts its own nats-server on a temporary
store (file storage, as in production); SQLite writes a file in the same place.
The default run takes well under two minutes on a 2-core machine. With --json the
last line is one JSON object: each rate as `<store>_<workload>_per_s` (store
`jetstream` or `sqlite`), and the ratios the report prints.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import nats  # noqa: E402
from eventsourcing.persistence import ApplicationRecorder, InfrastructureFactory, StoredEvent  # noqa: E402
from eventsourcing.utils import Environment  # noqa: E402

from events.codec import decode_event, encode  # noqa: E402
from events.schema import WorkerDrained  # noqa: E402
from events.subjects import stream_name  # noqa: E402
from services.process import store_env  # noqa: E402
from warmboot.natsserver import NatsServer  # noqa: E402

AT = datetime(2026, 1, 1, tzinfo=timezone.utc)
PAGE = 1000


@dataclass
class Rates:
    single: float = 0.0
    threaded: float = 0.0
    batch: float = 0.0
    replay_select: float = 0.0
    replay_subscribe: float | None = None
    raw: float | None = None
    raw_decoded: float | None = None
    events: int = 0


def body(worker: str, n: int) -> bytes:
    return encode(WorkerDrained(at=AT, worker_id=worker, reason=f"bench {n}"))


def timed(work: Callable[[], int]) -> float:
    """Events per second of `work` (which returns how many events it handled)."""
    started = time.perf_counter()
    count = work()
    return count / (time.perf_counter() - started)


def run_workload(recorder: ApplicationRecorder, singles: int, batches: int, threads: int, tag: str) -> Rates:
    rates = Rates()

    def single_appends(count: int, owner: str) -> int:
        for n in range(count):  # a new aggregate each time: a version-1 append, as a creation is
            worker = f"{owner}-{n}"
            recorder.insert_events([StoredEvent(f"worker.{worker}", 1, "WorkerDrained", body(worker, n))])
        return count

    def batch_appends(count: int) -> int:
        for n in range(count):
            worker = f"{tag}-b{n}"
            recorder.insert_events(
                [
                    StoredEvent(f"worker.{worker}", version, "WorkerDrained", body(worker, version))
                    for version in range(1, 11)
                ]
            )
        return count * 10

    def threaded_appends() -> int:
        per_thread = singles // threads
        with ThreadPoolExecutor(threads) as pool:
            done = pool.map(lambda t: single_appends(per_thread, f"{tag}-t{t}"), range(threads))
            return sum(done)

    single_appends(50, f"{tag}-warm")
    rates.single = timed(lambda: single_appends(singles, f"{tag}-s"))
    rates.threaded = timed(threaded_appends)
    rates.batch = timed(lambda: batch_appends(batches))

    def replay() -> int:
        count, start = 0, None
        while True:
            page = recorder.select_notifications(start, PAGE, inclusive_of_start=False)
            count += len(page)
            if len(page) < PAGE:
                return count
            start = page[-1].id

    rates.events = replay()
    rates.replay_select = max(timed(replay) for _ in range(3))
    return rates


def replay_by_subscription(recorder: ApplicationRecorder, total: int) -> float:
    def read() -> int:
        with recorder.subscribe(gt=None) as subscription:
            for count, _ in enumerate(subscription, 1):
                if count == total:
                    return count
        return 0

    return max(timed(read) for _ in range(2))


async def raw_read(url: str, prefix: str, total: int, decode: bool) -> float:
    """Ordered consumer with a callback, nothing between nats-py and the count (or decode_event)."""
    nc = await nats.connect(url)
    try:
        done = asyncio.Event()
        count = 0

        async def on_message(msg) -> None:
            nonlocal count
            if decode:
                decode_event(msg.data)
            count += 1
            if count == total:
                done.set()

        started = time.perf_counter()
        subscription = await nc.jetstream().subscribe(
            f"{prefix}.ev.>", stream=stream_name(prefix), cb=on_message, ordered_consumer=True
        )
        await asyncio.wait_for(done.wait(), 300)
        elapsed = time.perf_counter() - started
        await subscription.unsubscribe()
        return total / elapsed
    finally:
        await nc.close()


def bench_jetstream(url: str, args: argparse.Namespace) -> Rates:
    prefix = "bench" + uuid.uuid4().hex[:8]
    factory = InfrastructureFactory.construct(Environment(env=store_env(url, prefix)))
    try:
        recorder = factory.application_recorder()
        rates = run_workload(recorder, args.singles, args.batches, args.threads, "js")
        rates.replay_subscribe = replay_by_subscription(recorder, rates.events)
    finally:
        factory.close()
    rates.raw = max(asyncio.run(raw_read(url, prefix, rates.events, decode=False)) for _ in range(2))
    rates.raw_decoded = asyncio.run(raw_read(url, prefix, rates.events, decode=True))
    return rates


def bench_sqlite(directory: Path, args: argparse.Namespace) -> Rates:
    env = {
        "PERSISTENCE_MODULE": "eventsourcing.sqlite",
        "SQLITE_DBNAME": str(directory / "bench.sqlite"),
        "ORIGINATOR_ID_TYPE": "text",
    }
    factory = InfrastructureFactory.construct(Environment(env=env))
    try:
        return run_workload(factory.application_recorder(), args.singles, args.batches, args.threads, "sq")
    finally:
        factory.close()


def report(js: Rates, sq: Rates, args: argparse.Namespace) -> None:
    def rate(value: float | None) -> str:
        return f"{value:>12,.0f}" if value is not None else f"{'-':>12}"

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:>8.2f}" if a and b else f"{'-':>8}"

    rows = [
        ("append, 1 event per call", js.single, sq.single),
        (f"append, 1 event per call, {args.threads} threads", js.threaded, sq.threaded),
        ("append, batch of 10 per call", js.batch, sq.batch),
        ("replay, select_notifications", js.replay_select, sq.replay_select),
        ("replay, subscribe (ordered consumer)", js.replay_subscribe, None),
        ("raw nats-py ordered consumer", js.raw, None),
        ("raw nats-py ordered consumer + decode_event", js.raw_decoded, None),
    ]
    print(f"\n{js.events:,} events in the log; rates in events/s\n")
    print(f"{'workload':<46}{'jetstream':>12}{'sqlite':>12}{'js/sqlite':>10}")
    for name, a, b in rows:
        print(f"{name:<46}{rate(a)}{rate(b)}  {ratio(a, b)}")
    print()
    print(f"module replay / raw read:  select_notifications {ratio(js.replay_select, js.raw).strip()}, "
          f"subscribe {ratio(js.replay_subscribe, js.raw).strip()}")
    print(f"batch of 10 / single append (events/s): jetstream {ratio(js.batch, js.single).strip()}, "
          f"sqlite {ratio(sq.batch, sq.single).strip()}")
    print(f"time of a call of 10 / a call of 1: jetstream {ratio(10 * js.single, js.batch).strip()}, "
          f"sqlite {ratio(10 * sq.single, sq.batch).strip()} (on a stream of one replica in file "
          f"storage, nats-server stages each atomic batch in a file store of its own)")


def figures(js: Rates, sq: Rates) -> dict[str, float | int | None]:
    """The `--json` object: every rate of both stores, and the ratios `report` prints."""
    out: dict[str, float | int | None] = {"events": js.events}
    for store, rates in (("jetstream", js), ("sqlite", sq)):
        for field in dataclasses.fields(Rates):
            value = getattr(rates, field.name)
            if field.name != "events" and value is not None:
                out[f"{store}_{field.name}_per_s"] = round(value)

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    out.update({
        "replay_select_vs_raw": ratio(js.replay_select, js.raw),
        "replay_subscribe_vs_raw": ratio(js.replay_subscribe, js.raw),
        "jetstream_batch_vs_single": ratio(js.batch, js.single),
        "sqlite_batch_vs_single": ratio(sq.batch, sq.single),
        "jetstream_batch_call_vs_single_call": ratio(10 * js.single, js.batch),
        **{f"{name}_vs_sqlite": ratio(getattr(js, name), getattr(sq, name))
           for name in ("single", "threaded", "batch", "replay_select")},
    })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an existing nats-server (default: start one)")
    parser.add_argument("--singles", type=int, default=3000, help="single-event appends (default 3000)")
    parser.add_argument("--batches", type=int, default=1500, help="appends of 10 events (default 1500)")
    parser.add_argument("--threads", type=int, default=4, help="threads for the threaded appends")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="warmboot-bench-") as tmp:
        directory = Path(tmp)
        server = None
        url = args.url
        if url is None:
            server = NatsServer(directory / "nats").start()
            url = server.url
        try:
            started = time.perf_counter()
            print(f"jetstream: {url}", flush=True)
            js = bench_jetstream(url, args)
            print("sqlite: eventsourcing.sqlite, file in the same temporary directory", flush=True)
            sq = bench_sqlite(directory, args)
            report(js, sq, args)
            print(f"\n(run took {time.perf_counter() - started:.0f}s, {threading.active_count()} threads left)")
            if args.json:
                print(json.dumps(figures(js, sq)), flush=True)
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main()
