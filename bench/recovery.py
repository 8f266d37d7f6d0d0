"""Recovery benchmark: how soon a new scheduler replica answers, with and without a checkpoint.

    python bench/recovery.py [--events N] [--quick] [--tail N] [--json]

1. A log of N events (default 1,000,000; `--quick` 100,000) shaped like a long-lived
   deployment: 2,000 workers with restorable runtimes (some upgraded, drained or
   removed along the way), actors created, placed (ActorPlaced + WorkerBooked),
   paused, suspended, resumed and stopped, interleaved. It is bulk-loaded with
   `publish_async` as the event store writes it (body, topic, version and msg id
   headers) into the stream the store module creates.
2. Full replay: a new replica (its own process, checkpoints off) is started; the time
   until it answers a `fragmentation` request is measured from the process spawn,
   so interpreter start and imports are in it (the replica's own `start()` time is
   shown beside).
3. A replica with checkpoints on (the defaults `warmboot serve` uses) replays the log
   and saves a checkpoint at once; how long its fold waited for the copy, and the
   size, are shown. Then a tail of events is appended (default: half the default
   checkpoint interval, capped at N/40: on average a replica starts that far behind
   the newest checkpoint).
4. With checkpoint: a new replica (checkpoints on) loads it and folds only the tail;
   same measure as 2. Ratio = with / without; the target is under 0.1.
5. Memory, in this process with tracemalloc: a projection folded as a replica folds
   the stream (each message through `Fold.fold_message`, with its subject and the
   headers the store writes) with 10,000 workers and then 100,000 actors (`--quick`
   20,000) in a realistic mix of states; bytes per 1,000 workers and per 1,000 actors (target: at most 300 bytes per
   actor), also for the same projection restored from a checkpoint, and where an actor's
   bytes are allocated (the fold's lines; `service.py`: strings decoded from events, i.e.
   ids; `recovery.py`: the stream sequences an actor keeps, as int objects).

With `--json` the last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import nats  # noqa: E402

from events.codec import encode  # noqa: E402
from events.schema import (  # noqa: E402
    Action,
    ActorStopped,
    Event,
    Fidelity,
    FragmentationQuery,
    PlacedFidelity,
    ReleaseReason,
    RuntimeChanged,
    SnapshotOrigin,
    WorkerDrained,
    WorkerRegistered,
    WorkerRemoved,
    WorkerSandboxClass,
)
from events.subjects import service_subject  # noqa: E402
from tests.factories import (  # noqa: E402
    AT,
    ensure_stream,
    publish_events,
    stored_message,
    booked,
    created,
    entry,
    placed,
    registered,
    released,
    runtime,
    snapshot,
    stamp,
    taken,
    version,
)

VERSIONS = 20
WORKERS = 2000
VERSION_LIST = [version(f"sha256-{i:04d}", cpu_features=f"{0x5eed0000c0ffee00 + i % 3:016x}")
                for i in range(VERSIONS + 8)]


def class_entry(v: int) -> WorkerSandboxClass:
    return entry(runtime(VERSION_LIST[v], f"runsc-{v}", 32, per_gib=8),
                 tuple(runtime(VERSION_LIST[v - k], overhead=None) for k in (1, 2) if v - k >= 0))


class Deployment:
    """Generates events as a busy deployment writes them; remembers what each entity is doing."""

    def __init__(self, rng: random.Random, workers: int = WORKERS):
        self.rng = rng
        self.workers: dict[str, int] = {}  # worker id -> default version index
        self.node: dict[str, str] = {}
        self.live: list[str] = []
        self.next_worker = 0
        self.actors: dict[str, list] = {}  # actor id -> [state, worker id, pin version, n]
        self.active: list[str] = []
        self.next_actor = 0
        self.initial_workers = workers

    def register(self) -> WorkerRegistered:
        i = self.next_worker
        self.next_worker += 1
        worker_id, v = f"w{i:06d}", 2 + i % (VERSIONS - 2)
        self.workers[worker_id] = v
        self.node[worker_id] = f"node-{i // 2:06d}"
        self.live.append(worker_id)
        return registered(worker_id, class_entry(v), node=self.node[worker_id], cpu=64000, mem=262144,
                          labels={"zone": f"z{i % 3}", "pool": "general"})

    def worker_event(self) -> list[Event]:
        """Now and then: an upgrade, a drain or a removal (replaced by a new worker)."""
        r = self.rng.random()
        worker_id = self.live[self.rng.randrange(len(self.live))]
        if r < 0.6:
            v = self.workers[worker_id]
            if v + 1 >= len(VERSION_LIST):
                return []
            self.workers[worker_id] = v + 1
            return [RuntimeChanged(at=AT, worker_id=worker_id, sandbox_classes=(class_entry(v + 1),),
                                   previous=(class_entry(v),))]
        self.live.remove(worker_id)
        if r < 0.8:
            return [WorkerDrained(at=AT, worker_id=worker_id, reason="maintenance"), self.register()]
        return [WorkerRemoved(at=AT, worker_id=worker_id, reason="LOST"), self.register()]

    def step(self, create: float = 0.2) -> list[Event]:
        """One thing happening: an actor created (with probability `create`), or the next
        step of a random live actor's life (placed, paused, suspended, stopped)."""
        rng = self.rng
        if rng.random() < create or not self.active:
            actor_id = f"a{self.next_actor:07d}"
            self.next_actor += 1
            self.actors[actor_id] = ["CREATED", None, None, 0]
            self.active.append(actor_id)
            mem = rng.choice((256, 512, 1024, 2048, 4096))
            return [created(actor_id, cpu=250, mem=mem, template=f"tmpl-{rng.randrange(50)}",  # draws in this order
                            selectors={"pool": "general"} if rng.random() < 0.3 else {})]
        i = rng.randrange(len(self.active))
        actor_id = self.active[i]
        record = self.actors[actor_id]
        state, worker_id, pin, n = record
        if state != "RUNNING":
            if state != "PAUSED" or worker_id not in self.workers:
                worker_id = self.live[rng.randrange(len(self.live))]
            v = self.workers[worker_id]
            record[:] = ["RUNNING", worker_id, v, n]
            request_id = f"req-{actor_id}-{n}" if rng.random() < 0.5 else None
            return [
                placed(actor_id, worker_id, stamp(VERSION_LIST[v], name=f"runsc-{v}"), node=self.node[worker_id],
                       action=Action.RESTORE if state != "CREATED" else Action.RUN,
                       fidelity=PlacedFidelity.MEMORY if state != "CREATED" else PlacedFidelity.NONE,
                       snapshot_id=f"{actor_id}-s{n}" if n else None, cpu=250, mem=1024 + 40, request_id=request_id),
                booked(worker_id, actor_id, request_id),
            ]
        r = rng.random()
        if r < 0.1:
            record[0] = "STOPPED"
            self.active[i] = self.active[-1]
            self.active.pop()
            return [ActorStopped(at=AT, actor_id=actor_id)]
        pause = r < 0.55
        n += 1
        image = snapshot(actor_id, stamp(VERSION_LIST[pin], name=f"runsc-{pin}"), snapshot_id=f"{actor_id}-s{n}",
                         template="tmpl-0", fidelity=Fidelity.MEMORY if pause or r < 0.9 else Fidelity.VOLUMES,
                         node=self.node[worker_id] if pause else None,
                         uri=None if pause else f"s3://snapshots/{actor_id}/{n}")
        record[:] = ["PAUSED" if pause else "SUSPENDED", worker_id, pin, n]
        return [
            taken(image, SnapshotOrigin.PAUSE if pause else SnapshotOrigin.SUSPEND),
            released(actor_id, worker_id, ReleaseReason.PAUSED if pause else ReleaseReason.SUSPENDED),
        ]

    def events(self, total: int) -> list[Event]:
        out: list[Event] = []
        while self.next_worker < self.initial_workers and len(out) < total:
            out.append(self.register())
        while len(out) < total:
            out.extend(self.step())
            if self.rng.random() < 0.0005:
                out.extend(self.worker_event())
        return out[:total]


# --- a replica in its own process ----------------------------------------------------------------------------------


def run_replica(nats_url: str, prefix: str, checkpoint_every: int) -> None:
    """Start a scheduler; print `READY {json}` once it serves (and, with checkpoints, has saved one)."""
    from services.scheduler.service import SchedulerService

    async def main() -> None:
        t0 = time.perf_counter()
        nc = await nats.connect(nats_url)
        service = SchedulerService(nc, nats_url=nats_url, prefix=prefix, metrics=False,
                                   checkpoint_every=checkpoint_every or None)
        await service.start()
        started = time.perf_counter() - t0
        p, cp = service.projection, service.checkpoints
        info = {"start_s": round(started, 3), "seq": p.seq, "events": p.events, "fold_errors": service.fold.errors,
                "restored_seq": cp.restored_seq if cp else 0,
                "folded": p.events - (cp.restored_events if cp else 0),
                "load": cp.load_timings if cp else {}}
        if cp is not None and not cp.restored_seq:  # it replayed the log: it saves a checkpoint at once
            t = time.perf_counter()
            await cp.wait_saved(p.seq, 600)
            info.update(save_s=round(time.perf_counter() - t, 3), capture_s=round(cp.last_capture_s, 3),
                        checkpoint_bytes=cp.last_size)
        info["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        print("READY " + json.dumps(info), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await service.stop()
        await nc.close()

    asyncio.run(main())


async def time_to_answer(nats_url: str, prefix: str, checkpoint_every: int) -> tuple[float, dict]:
    """Seconds from spawning a replica to its first fragmentation answer, and what it reported."""
    nc = await nats.connect(nats_url)
    subject = service_subject(prefix, "scheduler", "fragmentation")
    body = encode(FragmentationQuery())
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--replica", nats_url, prefix, str(checkpoint_every)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        while True:
            try:
                reply = await nc.request(subject, body, timeout=5)
                break
            except nats.errors.NoRespondersError:
                if proc.poll() is not None:
                    raise RuntimeError("the replica exited before answering") from None
                await asyncio.sleep(0.005)
        answered = time.perf_counter() - t0
        assert not reply.data.startswith(b'{"error"'), reply.data[:200]
        line = await asyncio.to_thread(proc.stdout.readline)
        if not line.startswith("READY "):
            raise RuntimeError(f"replica: {line!r}")
        return answered, json.loads(line[6:])
    finally:
        proc.stdin.close()
        await asyncio.to_thread(proc.wait, 120)
        await nc.close()


# --- memory ----------------------------------------------------------------------------------------------------------


def projection_memory(workers: int, actors: int) -> dict:
    """Bytes a projection holds per 1,000 workers and per 1,000 actors: folded as a replica
    folds the stream, and restored from a checkpoint's bytes (everything allocated while traced)."""
    from services.scheduler.checkpoint_codec import decode_checkpoint, encode_checkpoint, export_state
    from services.scheduler.projection import Projection
    from services.scheduler.fold import Fold

    prefix = "mem"
    versions: dict[str, int] = {}

    def message(event: Event) -> tuple[str, dict[str, str], bytes]:
        return stored_message(prefix, event, versions)

    deployment = Deployment(random.Random(11), workers)
    worker_messages = [message(deployment.register()) for _ in range(workers)]
    messages: list[tuple[str, dict[str, str], bytes]] = []
    while deployment.next_actor < actors:
        messages.extend(message(e) for e in deployment.step())
    for _ in range(actors):  # the actors created last are mostly CREATED: live a little longer, as in a log
        messages.extend(message(e) for e in deployment.step(create=0.0))
    del deployment
    versions.clear()

    def fold(p: Projection, seq: int, items: list[tuple[str, dict[str, str], bytes]]) -> int:
        replica = Fold(None, prefix, p)  # its per-message path, without the bus
        for subject, headers, body in items:
            seq += 1
            replica.fold_message(seq, subject, headers, body)
        assert replica.errors == 0
        return seq

    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    p = Projection()
    seq = fold(p, 0, worker_messages)
    gc.collect()
    after_workers = tracemalloc.get_traced_memory()[0]
    before = tracemalloc.take_snapshot()
    fold(p, seq, messages)
    gc.collect()
    after_actors = tracemalloc.get_traced_memory()[0]
    sites = tracemalloc.take_snapshot().compare_to(before, "lineno")
    tracemalloc.stop()
    n_actors = len(p.actors)
    states: dict[str, int] = {}
    for a in p.actors.values():
        states[a.state.value] = states.get(a.state.value, 0) + 1
    where = [(f"{Path(s.traceback[0].filename).name}:{s.traceback[0].lineno}", round(s.size_diff / n_actors, 1))
             for s in sites[:6]]

    data = encode_checkpoint(export_state(p), stream="bench", stream_created="", compress=False)
    del p, messages, worker_messages
    gc.collect()
    tracemalloc.start()
    base_r = tracemalloc.get_traced_memory()[0]
    restored = decode_checkpoint(data)[1]  # the envelope (holding the body's bytes) goes at once
    del data
    gc.collect()
    restored_total = tracemalloc.get_traced_memory()[0] - base_r
    tracemalloc.stop()
    per_worker = (after_workers - base) / workers
    return {
        "bytes_per_1000_workers": round(per_worker * 1000),
        "bytes_per_1000_actors": round((after_actors - after_workers) / n_actors * 1000),
        "bytes_per_actor": round((after_actors - after_workers) / n_actors, 1),
        "bytes_per_actor_restored": round((restored_total - per_worker * workers) / len(restored.actors), 1),
        "bytes_projection_folded": after_actors - base,
        "bytes_projection_restored": restored_total,
        "memory_actors": n_actors,
        "memory_workers": workers,
        "memory_actor_states": states,
        "bytes_per_actor_by_site": where,
    }


# --- main ---------------------------------------------------------------------------------------------------------------


async def bench(total: int, tail: int) -> dict:
    from services.scheduler.checkpoint import DEFAULT_EVERY_EVENTS
    from warmboot.natsserver import NatsServer

    out: dict = {"events": total, "tail_events": tail}
    with tempfile.TemporaryDirectory() as tmp, NatsServer(tmp) as server:
        url, prefix = server.url, f"recovery{os.getpid() % 1000}"
        await ensure_stream(url, prefix)
        rng = random.Random(7)
        deployment = Deployment(rng)
        t = time.perf_counter()
        log = deployment.events(total)
        generated = time.perf_counter() - t
        nc = await nats.connect(url)
        versions: dict[str, int] = {}
        t = time.perf_counter()
        await publish_events(nc, prefix, log, versions)
        written = time.perf_counter() - t
        print(f"log: {total:,} events ({deployment.next_actor:,} actors, {deployment.next_worker:,} workers) "
              f"generated in {generated:.1f} s, written in {written:.1f} s ({total / written:,.0f}/s)", flush=True)

        full_s, full = await time_to_answer(url, prefix, 0)
        assert full["fold_errors"] == 0 and full["events"] == total, full
        print(f"full replay:      answers after {full_s:6.2f} s (start() {full['start_s']:.2f} s, "
              f"{full['folded']:,} events folded, {full['folded'] / full['start_s']:,.0f}/s; "
              f"max RSS {full['max_rss_mib']} MiB)", flush=True)

        _, saver = await time_to_answer(url, prefix, DEFAULT_EVERY_EVENTS)
        print(f"checkpoint saved: {saver['checkpoint_bytes'] / 1e6:.1f} MB, fold held {saver['capture_s']:.2f} s for "
              f"the copy, stored {saver['save_s']:.2f} s after start() returned", flush=True)

        await publish_events(nc, prefix, deployment.events(tail), versions)  # the same deployment, going on
        await nc.close()

        cp_s, cp = await time_to_answer(url, prefix, DEFAULT_EVERY_EVENTS)
        assert cp["fold_errors"] == 0 and cp["events"] == total + tail and cp["restored_seq"] == saver["seq"], cp
        load = cp["load"]
        print(f"with checkpoint:  answers after {cp_s:6.2f} s (start() {cp['start_s']:.2f} s: read "
              f"{load['read_s']:.2f} s, decode+restore {load['decode_s']:.2f} s, then {cp['folded']:,} tail events "
              f"folded; max RSS {cp['max_rss_mib']} MiB)", flush=True)
        ratio, ratio_start = cp_s / full_s, cp["start_s"] / full["start_s"]
        print(f"ratio with/without: {ratio:.3f} from spawn, {ratio_start:.3f} start() alone (target < 0.1)", flush=True)
        out.update({
            "log_write_events_per_s": round(total / written),
            "actors_in_log": deployment.next_actor,
            "ready_full_replay_s": round(full_s, 3),
            "ready_with_checkpoint_s": round(cp_s, 3),
            "ready_ratio": round(ratio, 4),
            "start_full_replay_s": full["start_s"],
            "start_with_checkpoint_s": cp["start_s"],
            "start_ratio": round(ratio_start, 4),
            "replay_events_per_s": round(full["folded"] / full["start_s"]),
            "checkpoint_bytes": saver["checkpoint_bytes"],
            "checkpoint_capture_s": saver["capture_s"],
            "checkpoint_store_s": saver["save_s"],
            "checkpoint_read_s": round(load["read_s"], 3),
            "checkpoint_decode_restore_s": round(load["decode_s"], 3),
            "tail_folded": cp["folded"],
            "max_rss_mib_full_replay": full["max_rss_mib"],
            "max_rss_mib_with_checkpoint": cp["max_rss_mib"],
        })
    return out


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--replica":
        run_replica(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=None, help="log length (default 1,000,000; --quick 100,000)")
    parser.add_argument("--quick", action="store_true", help="a 100,000-event log and a smaller memory measure")
    parser.add_argument("--tail", type=int, default=None,
                        help="events appended after the checkpoint (default: min(25,000, events / 40))")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    total = args.events or (100_000 if args.quick else 1_000_000)
    tail = args.tail if args.tail is not None else min(25_000, total // 40)
    results = asyncio.run(bench(total, tail))
    memory = projection_memory(10_000, 20_000 if args.quick else 100_000)
    print(f"memory: {memory['bytes_per_1000_workers'] / 1000:,.0f} bytes per worker "
          f"({memory['bytes_per_1000_workers'] / 1e6:.2f} MB per 1,000 workers); "
          f"{memory['bytes_per_actor']:,.0f} bytes per actor ({memory['bytes_per_1000_actors'] / 1e3:,.0f} kB per "
          f"1,000 actors; {memory['bytes_per_actor_restored']:,.0f} restored from a checkpoint), target <= 300; "
          f"{memory['memory_actors']:,} actors {memory['memory_actor_states']}", flush=True)
    print("        per actor, by allocation site: " + ", ".join(f"{site} {b:.0f} B" for site, b in
                                                         memory["bytes_per_actor_by_site"]), flush=True)
    results.update(memory)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
