"""Resumes sent again with their request id after their worker changed, to any of three scheduler
replicas (one replaced by a fresh replica started from a checkpoint each round), while two registry
replicas take every worker's runtime flips, node moves and new lives: an answer from the log is
given only while its worker, in the life the placement was made in, still carries it out
(docs/contract.md, Idempotency: `decide.check_retry`).

The verdict is read from the log by a checker of its own (no scheduler code): each retry answered
with a placement made before the retry was sent must find, at some position of the log between the
retry's sending and its answer (the stream's last sequence, as its leader has it, read just before
and just after), the worker in that placement's life, on the placement's node, running its pin, and,
at MEMORY, that runtime accepting the image's version (by equality or through its
`compatible_versions`). A retry its worker no longer carries out must be refused instead.

What it adds to tests/test_idempotency_faults.py (each case once, deterministically) and
tests/test_commit_races.py (copies sent at once, never after the world changed): hundreds of late
retries per round racing the registry's changes, two registry replicas, and a replica restored from a
checkpoint answering them. An audit's harness, which found the scheduler sound; without
`check_retry` it fails at once (late answers on removed workers, on other nodes, on runtimes gone).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from contextlib import AsyncExitStack

import nats
import pytest

from events.compat import same_version
from events.errors import ContractError
from events.schema import (ActorPlaced, Assignment, Fidelity, PlacedFidelity, ResumeActor, RuntimeChanged,
                           WorkerRegistered, WorkerRemoved, WorkerUpdated)
from services.registry.budget import WriteBudget
from services.scheduler.service import SchedulerService
from tests.factories import SILENT_TTL_S, actor, last_seq, read_messages, worker
from tests.test_commit_races import NODES, RUNTIMES
from warmboot.client import Client
from warmboot.runner import start_services

WORKERS = 6
ACTORS = 100
ROUNDS = 4
LATE = 300  # retries of earlier request ids sent each round
CHANGES = 3  # registry changes of each worker racing each wave of resumes


def why_not(state: dict | None, placed: ActorPlaced) -> str | None:
    """Why the worker as `state` has it cannot carry out `placed`; None if it can."""
    if state is None:
        return "removed"
    if state["node"] != placed.node:
        return f"on node {state['node']}"
    pin = placed.sandbox_runtime
    image = placed.matched_version or pin.version
    for entry in state["classes"]:
        if entry.sandbox_class != pin.sandbox_class:
            continue
        for r in (entry.default_runtime, *entry.restorable_runtimes):
            if same_version(r.version, pin.version) and (
                    placed.fidelity is not PlacedFidelity.MEMORY or same_version(r.version, image)
                    or any(same_version(c, image) for c in r.compatible_versions)):
                return None
    return "no runtime of its runs the pin and accepts the image"


def verdict(messages, retries) -> list[str]:
    """The module docstring's verdict on each (request id, answer, sent at, answered by)."""
    placements = {seq: e for seq, _, _, e in messages if isinstance(e, ActorPlaced)}
    bad = []
    for rid, got, sent_at, answered_by in retries:
        at = got.seq - 1 if got.seq - 1 in placements else got.seq  # its seq is the booking marker's
        placed = placements.get(at)
        if placed is None or placed.request_id != rid or placed.actor_id != got.actor_id:
            bad.append(f"{rid}: answered {got.worker_id} at {got.seq}; the log holds {placed} there")
            continue
        if at > sent_at:
            continue  # placed by this very request (its first attempt placed nothing): no answer from the log
        state: dict | None = None
        states: list[tuple[int, dict | None]] = []
        for seq, _, _, e in messages:
            if seq > answered_by:
                break
            if seq > sent_at and not states:
                states.append((sent_at, state))  # as the log stood when the retry was sent
            if getattr(e, "worker_id", None) == placed.worker_id:
                if isinstance(e, WorkerRegistered):
                    state = {"life": seq, "node": e.node, "classes": e.sandbox_classes}
                elif isinstance(e, RuntimeChanged) and state is not None:
                    state = dict(state, classes=e.sandbox_classes)
                elif isinstance(e, WorkerUpdated) and state is not None:
                    state = dict(state, node=e.node)
                elif isinstance(e, WorkerRemoved):
                    state = None
            if seq > sent_at:
                states.append((seq, state))
        if not states:
            states.append((sent_at, state))
        reasons = []
        for seq, st in states:
            if st is not None and st["life"] > at:
                reasons.append(f"{seq}: a later life")
                continue
            reason = why_not(st, placed)
            if reason is None:
                break
            reasons.append(f"{seq}: {reason}")
        else:
            bad.append(f"{rid}: answered the placement at {at} on {placed.worker_id} ({placed.fidelity.value} under "
                       f"{placed.sandbox_runtime.version.attributes}, node {placed.node}), sent at {sent_at}, "
                       f"answered by {answered_by}, when the worker could not carry it out: {reasons[:4]}")
    return bad


@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed", [1, 2])
async def test_a_late_retry_is_answered_only_while_its_worker_carries_the_placement_out(nats_server, prefix, nc,
                                                                                         seed):
    rng = random.Random(seed)
    url = nats_server.url
    async with AsyncExitStack() as exits:
        registry = {"ttl_s": SILENT_TTL_S, "writes": WriteBudget(0)}
        running = await start_services(exits, ["registry", "snapshotter", "scheduler"], url, prefix,
                                       options={"registry": registry, "scheduler": {"metrics": False}})
        await start_services(exits, ["registry"], url, prefix, options={"registry": registry})
        connections: dict[int, object] = {}

        async def replica() -> SchedulerService:
            rnc = await nats.connect(url)
            service = await SchedulerService(rnc, nats_url=url, prefix=prefix, metrics=False, checkpoint_every=100,
                                             checkpoint_interval_s=0.5).start()
            connections[id(service)] = rnc
            exits.push_async_callback(rnc.close)
            exits.push_async_callback(service.stop)
            return service

        schedulers = [running.services[-1], await replica(), await replica()]
        wb = Client(nc, prefix, attempts=30)
        node_of = {f"w{i}": NODES[i % len(NODES)] for i in range(WORKERS)}
        runtimes_of = {wid: RUNTIMES[0] for wid in node_of}

        def registration(wid: str):
            default, restorable = runtimes_of[wid]
            return worker(wid, default, restorable, node=node_of[wid], cpu=64000, mem=65536)

        for wid in node_of:
            await wb.register(registration(wid))
        actors = [f"a{i:03d}" for i in range(ACTORS)]
        await asyncio.gather(*(wb.create(actor(a, cpu=100, mem=128)) for a in actors))
        current: dict[str, Assignment] = {}
        sent: list[tuple[str, str]] = []
        retries: list[tuple[str, Assignment, int, int]] = []
        outcomes: Counter = Counter()

        async def resume(a: str, rid: str, late: bool) -> None:
            sent_at = await last_seq(nc, prefix)
            what = "late" if late else "first"
            try:
                got = await rng.choice(schedulers).resume(a, ResumeActor(request_id=rid))
            except ContractError as error:
                outcomes[f"{what} {error.code.value}"] += 1
                return
            answered_by = await last_seq(nc, prefix)
            outcomes[f"{what} answered"] += 1
            if late:
                retries.append((rid, got, sent_at, answered_by))
            else:
                current[a] = got

        async def put_away(a: str) -> None:
            """Pause (a LOCAL image on its node) or suspend (EXTERNAL, at MEMORY) a running actor."""
            got = current.pop(a, None)
            if got is None:
                return
            try:
                if rng.random() < 0.5:
                    await wb.pause(a, placement_seq=got.seq)
                else:
                    await wb.suspend(a, Fidelity.MEMORY, uri=f"s3://x/{a}/{got.seq}", placement_seq=got.seq)
            except ContractError as error:
                outcomes[f"put away {error.code.value}"] += 1  # released: its worker was removed

        async def churn(wid: str) -> None:
            for _ in range(CHANGES):
                op = rng.random()
                try:
                    if op < 0.5:
                        runtimes_of[wid] = rng.choice(RUNTIMES)
                    elif op < 0.7:
                        node_of[wid] = rng.choice(NODES)
                    elif op < 0.85:
                        await wb.remove(wid)
                        runtimes_of[wid] = rng.choice(RUNTIMES)
                    await wb.register(registration(wid))
                    outcomes["registry change"] += 1
                except ContractError as error:
                    outcomes[f"registry {error.code.value}"] += 1

        async def replace_a_replica() -> None:
            victim = schedulers.pop(rng.randrange(1, len(schedulers)))
            await connections[id(victim)].close()
            await victim.stop()
            fresh = await replica()
            schedulers.append(fresh)
            if fresh.checkpoints.restored_seq:
                outcomes["replica started from a checkpoint"] += 1

        for number in range(ROUNDS):
            await asyncio.gather(*(put_away(a) for a in actors))
            this_round = [(a, f"r{number}-{a}") for a in actors]
            sent += this_round
            late = rng.sample(sent, min(len(sent), LATE))
            # the first attempts race the registry's changes; then the late retries race more of them, on
            # a set of replicas one of which was started from a checkpoint meanwhile
            await asyncio.gather(*(resume(a, rid, False) for a, rid in this_round), *map(churn, node_of))
            await replace_a_replica()
            await asyncio.gather(*(resume(a, rid, True) for a, rid in late), *map(churn, node_of))

        bad = verdict(await read_messages(nc, prefix), retries)
        assert not bad, "\n".join(bad[:20])
        print("outcomes", dict(outcomes), "answered from the log", sum(1 for _, g, s, _ in retries if g.seq - 1 <= s))
        # the races were had: late retries answered from the log, and refused for their worker's changes
        answered_from_log = sum(1 for rid, got, sent_at, _ in retries if got.seq - 1 <= sent_at)
        assert answered_from_log > 50 and outcomes["late FAILED_PRECONDITION"] > 50, (answered_from_log, outcomes)
        assert outcomes["replica started from a checkpoint"] >= 1, outcomes
