"""Pauses and suspends of actors racing their worker's removal, each request sent at once to two
snapshotter replicas (appends losing one reply in ten), on a 3-node cluster with stepdowns: every
placement ends exactly once in the log (a pause, a suspend, or a release WORKER_REMOVED), no image is
recorded for a placement after its worker's removal, and both copies of a request get one answer."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from typing import Any

import pytest

from events.schema import (ActorPlaced, ActorReleased, Fidelity, PauseActor, SnapshotTaken,
                           SuspendActor, WorkerRemoved)
from events.subjects import stream_name
from tests.factories import actor, read_log, step_down, version, wait_for, worker
from tests.test_snapshotter_failover import ask, outcome, snapshotters_on_a_cluster
from warmboot.natsserver import wait_stream_current

ACTORS = 30
ROUNDS = 12


@pytest.mark.timeout(600)
async def test_pauses_racing_their_workers_removal_end_each_placement_once(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMBOOT_STREAM_REPLICAS", "3")
    prefix = "t" + uuid.uuid4().hex[:10]
    stream = stream_name(prefix)
    rng = random.Random(5)
    async with snapshotters_on_a_cluster(tmp_path, prefix, rng) as (cluster, replicas, nc, wb):
        v1 = version("v1")
        actors = [f"a{i:02d}" for i in range(ACTORS)]
        for a in actors:
            await wb.create(actor(a, cpu=100, mem=128))
        odd: list[Any] = []
        stop = asyncio.Event()

        async def elections() -> None:
            while not stop.is_set():
                await step_down(nc, stream)
                try:
                    await asyncio.wait_for(stop.wait(), rng.uniform(0.3, 1.5))
                except asyncio.TimeoutError:
                    pass

        chaos = asyncio.create_task(elections())
        try:
            for round_ in range(ROUNDS):
                w = f"w{round_}"
                await wb.register(worker(w, v1, cpu=64000, mem=65536, node="n1"))
                placed = {a: await wb.resume(a) for a in actors}
                assert {p.worker_id for p in placed.values()} == {w}

                async def end(a: str) -> None:
                    await asyncio.sleep(rng.uniform(0, 0.05))  # jitter: the requests spread around the removal
                    if rng.random() < 0.5:
                        req: Any = PauseActor(request_id=f"{a}-{round_}-p", placement_seq=placed[a].seq)
                        verb = "pause"
                    else:
                        req = SuspendActor(request_id=f"{a}-{round_}-s", placement_seq=placed[a].seq,
                                           fidelity=Fidelity.MEMORY, uri=f"s3://x/{a}/{round_}")
                        verb = "suspend"
                    x, y = await asyncio.gather(ask(replicas[0], verb, a, req), ask(replicas[1], verb, a, req))
                    if outcome(x) != outcome(y):
                        odd.append(("copies answered otherwise", req.request_id, outcome(x), outcome(y)))

                async def remove() -> None:
                    await asyncio.sleep(rng.uniform(0.02, 0.15))  # jitter: amid the pauses
                    await wb.remove(w)

                await asyncio.gather(*(end(a) for a in actors), remove())
                # every actor's placement ends (a pause, a suspend, or the removal's release) before the next
                for a in actors:
                    await wait_for(nc, prefix, lambda e, a=a: isinstance(e, ActorReleased) and e.actor_id == a,
                                   after=placed[a].seq, timeout=60)
        finally:
            stop.set()
            await chaos
        await wait_stream_current(nc.jetstream(), stream, 3)
        log = await read_log(nc, prefix)
        state: dict[str, Any] = {}
        removed: set[str] = set()
        for seq, e in log:
            if isinstance(e, WorkerRemoved):
                removed.add(e.worker_id)
            elif isinstance(e, ActorPlaced):
                if e.actor_id in state:
                    odd.append(("placed twice", seq, e.actor_id))
                state[e.actor_id] = e
            elif isinstance(e, SnapshotTaken) and e.origin.value in ("PAUSE", "SUSPEND"):
                held = state.get(e.actor_id)
                if held is None:
                    odd.append(("image of no placement", seq, e.actor_id, e.request_id))
                elif held.worker_id in removed:
                    odd.append(("image after its worker's removal", seq, e.actor_id, e.request_id))
            elif isinstance(e, ActorReleased):
                if state.pop(e.actor_id, None) is None:
                    odd.append(("released twice", seq, e.actor_id, e.reason))
        assert not state, state
        ends = Counter(e.reason.value for _, e in log if isinstance(e, ActorReleased))
        print(f"{len(log)} events; placements ended by {dict(ends)}")
        assert ends["WORKER_REMOVED"] and (ends["PAUSED"] + ends["SUSPENDED"]), ends  # the race was run
        assert odd == [], odd[:20]
