"""Placements committed while the registry changes their workers, by several scheduler replicas,
with request ids sent twice at once and a replica killed mid-commit: judged from the log.

One nats-server; the registry and the snapshotter in this process; three scheduler replicas on
connections of their own. Six workers on three nodes, runtimes V1, V2 (restoring V1) and V3 (an edge
from V1). Each round resumes every actor twice with one request id (one copy through the queue
group, one straight to a replica picked at random), while every worker's registrations race them:
runtime flips, moves to another node, drains, removals and new lives on other runtimes; and the
actors' own histories race them too (a stop and a new life, a template change, a revert). Once per
round a replica's connection is cut mid-load (a crash) and a fresh replica, started from a
checkpoint, replaces it. Between rounds each running actor is paused (a LOCAL image on its node)
or suspended (EXTERNAL).

The verdict is the contract's, from the log in stream order, by a checker of its own (no scheduler
code): at every ActorPlaced its worker is registered, not drained, in the life the placement
names, on the node it names; a LOCAL latest snapshot restores only on its node; a MEMORY restore's
pin is one of the worker's runtimes as of the last registry event before it, and that runtime accepts
the stamp, by equality or through its `compatible_versions`; every booking subject's versions run
1, 2, 3 with no gap or repeat (a placement decided before a registry change, whose fence it did not
read, would reuse the fence's version); an (actor, life, request id) is placed at most once and
every answer a request id got is that placement. `warmboot audit verify`'s checker is run too.

What it adds to tests/test_failover_runtimes.py (runtime flips only): drains, removals and new lives
of workers, node moves with LOCAL images, edges, actors' new lives, and the booking subjects'
versions. An audit's harness that found no fault (also run, as `stress`, on a 3-node cluster with
stream leader stepdowns and at tight capacity with min_fidelity MEMORY: none); without the registry's
fence it fails at once on every count (drained, node, LOCAL off node, runtime).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict
from contextlib import AsyncExitStack

import nats
import pytest

from events.compat import same_version
from events.errors import ContractError
from events.jetstream import VERSION_HEADER
from events.schema import (Action, ActorCreated, ActorPlaced, ActorReverted, Assignment,
                           ErrorCode, Fidelity, Location, PlacedFidelity, ResumeActor, RuntimeChanged, SnapshotOrigin,
                           SnapshotTaken, WorkerDrained, WorkerRegistered, WorkerRemoved, WorkerUpdated)
from services.registry.budget import WriteBudget
from services.scheduler.service import SchedulerService
from tests.factories import SILENT_TTL_S, actor, read_messages, runtime, version, worker
from warmboot.audit import Sink
from warmboot.cli_common import replay
from warmboot.client import Client
from warmboot.runner import start_services

V1, V2, V3 = version("1"), version("2"), version("3")
RUNTIMES = [
    (runtime(V1), ()),
    (runtime(V2), (runtime(V1),)),
    (runtime(V3, compatible=(V1,)), ()),
    (runtime(V2), (runtime(V3, compatible=(V1,)),)),
    (runtime(V3, compatible=(V1, V2)), (runtime(V1),)),
]
NODES = ["n0", "n1", "n2"]
WORKERS = 6
ACTORS = 120
ROUNDS = 3


def verdict(messages) -> tuple[list[str], Counter]:
    """The contract's verdict on the log (module docstring), by no scheduler code."""
    bad: list[str] = []
    seen: Counter = Counter()
    workers: dict[str, dict] = {}
    actors: dict[str, dict] = {}
    booking_versions: dict[str, int] = {}
    placed: Counter = Counter()
    for seq, subject, headers, event in messages:
        if subject.split(".")[-2] == "booking":
            version_ = int(headers[VERSION_HEADER])
            wid = subject.split(".")[-1]
            if version_ != booking_versions.get(wid, 0) + 1:
                bad.append(f"seq {seq}: {subject} version {version_} after {booking_versions.get(wid, 0)}")
            booking_versions[wid] = version_
            continue
        if event is None:
            continue
        if isinstance(event, WorkerRegistered):
            workers[event.worker_id] = {"node": event.node, "classes": event.sandbox_classes, "drained": False,
                                        "since": seq}
        elif isinstance(event, RuntimeChanged):
            workers[event.worker_id]["classes"] = event.sandbox_classes
        elif isinstance(event, WorkerUpdated):
            workers[event.worker_id]["node"] = event.node
        elif isinstance(event, WorkerDrained):
            workers[event.worker_id]["drained"] = True
        elif isinstance(event, WorkerRemoved):
            workers.pop(event.worker_id, None)
        elif isinstance(event, ActorCreated):
            actors[event.actor_id] = {"snapshot": event.snapshot, "life": seq, "node": None}
        elif isinstance(event, SnapshotTaken):
            if event.origin is not SnapshotOrigin.TAG:
                actors[event.actor_id]["snapshot"] = event.snapshot
        elif isinstance(event, ActorReverted):
            actors[event.actor_id]["snapshot"] = event.snapshot
        elif isinstance(event, ActorPlaced):
            seen[event.fidelity.value] += 1
            a = actors[event.actor_id]
            w = workers.get(event.worker_id)
            where = f"seq {seq}: {event.actor_id} on {event.worker_id}"
            if event.request_id is not None:
                placed[(event.actor_id, a["life"], event.request_id)] += 1
            if w is None:
                bad.append(f"{where}: the worker is not registered")
                continue
            if w["drained"]:
                bad.append(f"{where}: the worker is drained")
            if event.node != w["node"]:
                bad.append(f"{where}: placed naming node {event.node}, the worker is on {w['node']}")
            snap = a["snapshot"]
            if event.action is Action.RESTORE and snap is not None and snap.location is Location.LOCAL \
                    and snap.node != w["node"]:
                seen["local off node"] += 1
                bad.append(f"{where}: LOCAL image on {snap.node}, the worker is on {w['node']}")
            if snap is not None and snap.location is Location.LOCAL:
                seen["local restores"] += 1
            if event.fidelity is PlacedFidelity.MEMORY:
                stamp = snap.sandbox_runtime if snap is not None else None
                pin = event.sandbox_runtime
                ok = False
                for entry in w["classes"]:
                    if stamp is None or entry.sandbox_class != stamp.sandbox_class:
                        continue
                    for r in (entry.default_runtime, *entry.restorable_runtimes):
                        if same_version(r.version, pin.version) and (
                                same_version(r.version, stamp.version)
                                or any(same_version(c, stamp.version) for c in r.compatible_versions)):
                            ok = True
                            if not same_version(r.version, stamp.version):
                                seen["through an edge"] += 1
                if not ok:
                    bad.append(f"{where}: MEMORY restore of a {stamp and stamp.version} image pinned to "
                               f"{pin.version}; the worker runs {w['classes']}")
    bad += [f"{key} placed {n} times" for key, n in placed.items() if n > 1]
    return bad, seen


async def stress(nc, urls: list[str], prefix: str, seed: int, exits: AsyncExitStack, *, rounds: int = ROUNDS,
                 disrupt=None, replicas: int | None = None, worker_mib: int = 65536,
                 memory_floor: bool = False) -> tuple[Counter, Counter]:
    """The rounds of the module docstring on the servers at `urls` (services on the first, replicas
    spread over all); `disrupt()` is awaited once a third of each round's resumes are answered, beside
    the replica kill. The verdicts are asserted; (outcomes, what the log holds) returned."""
    rng = random.Random(seed)
    url = urls[0]
    options = {"registry": {"ttl_s": SILENT_TTL_S, "writes": WriteBudget(0)}, "scheduler": {"metrics": False}}
    if replicas:
        options["registry"]["store_replicas"] = replicas
    running = await start_services(exits, ["registry", "snapshotter", "scheduler"], url, prefix, options=options)
    schedulers: list[SchedulerService] = [running.services[-1]]
    connections: dict[int, object] = {}

    async def replica() -> SchedulerService:
        at = urls[(len(connections) + 1) % len(urls)]
        rnc = await nats.connect(at, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        service = await SchedulerService(rnc, nats_url=at, prefix=prefix, metrics=False, checkpoint_every=200,
                                         checkpoint_interval_s=1.0).start()
        connections[id(service)] = rnc
        exits.push_async_callback(rnc.close)
        exits.push_async_callback(service.stop)
        return service

    schedulers += [await replica(), await replica()]
    wb = Client(nc, prefix, attempts=30)
    node_of = {f"w{i}": NODES[i % len(NODES)] for i in range(WORKERS)}
    runtimes_of = {f"w{i}": RUNTIMES[0] for i in range(WORKERS)}

    def registration(wid: str):
        default, restorable = runtimes_of[wid]
        return worker(wid, default, restorable, node=node_of[wid], cpu=64000, mem=worker_mib)

    for wid in node_of:
        await wb.register(registration(wid))
    actors = [f"a{i:03d}" for i in range(ACTORS)]
    floor = {a: Fidelity.MEMORY if memory_floor and i % 2 else Fidelity.ROOTFS for i, a in enumerate(actors)}
    await asyncio.gather(*(wb.create(actor(a, cpu=100, mem=128)) for a in actors))
    placement_of: dict[str, Assignment] = {}
    for a, got in zip(actors, await asyncio.gather(*(wb.resume(a) for a in actors), return_exceptions=True)):
        if isinstance(got, Assignment):
            placement_of[a] = got

    outcomes: Counter = Counter()
    answers: dict[str, set] = defaultdict(set)

    async def put_away(a: str) -> None:
        """Pause (a LOCAL image) or suspend a running actor; revert one whose LOCAL image is stuck."""
        got = placement_of.pop(a, None)
        try:
            if got is None:
                return
            if rng.random() < 0.5:
                try:
                    await wb.pause(a, placement_seq=got.seq)
                    outcomes["paused"] += 1
                    return
                except ContractError:
                    pass
            await wb.suspend(a, Fidelity.MEMORY, uri=f"s3://x/{a}/{got.seq}", placement_seq=got.seq)
            outcomes["suspended"] += 1
        except ContractError as error:
            outcomes[f"put away {error.code.value}"] += 1  # mostly: released, its worker removed

    async def resume(rid: str, a: str, direct: bool) -> None:
        try:
            if direct:
                got = await rng.choice(schedulers).resume(a, ResumeActor(request_id=rid))
            else:
                got = await wb.resume(a, request_id=rid)
        except ContractError as error:
            outcomes[f"resume {error.code.value}"] += 1
            if error.code is ErrorCode.FAILED_PRECONDITION and "revert" in error.message and direct:
                try:
                    await wb.revert(a)
                    outcomes["reverted"] += 1
                except ContractError:
                    pass
            return
        except Exception as error:  # a replica killed under the call
            outcomes[f"resume {type(error).__name__}"] += 1
            return
        answers[rid].add((got.worker_id, got.seq, got.fidelity))
        placement_of[a] = got
        outcomes[f"placed {got.fidelity.value}"] += 1

    async def churn(wid: str, stop: asyncio.Event) -> None:
        while not stop.is_set():
            op = rng.random()
            try:
                if op < 0.45:
                    runtimes_of[wid] = rng.choice(RUNTIMES)
                    await wb.register(registration(wid))
                    outcomes["runtime flip"] += 1
                elif op < 0.6:
                    node_of[wid] = rng.choice(NODES)
                    await wb.register(registration(wid))
                    outcomes["node move"] += 1
                elif op < 0.8:
                    await wb.drain(wid)
                    outcomes["drain"] += 1
                    await wb.remove(wid)
                    runtimes_of[wid] = rng.choice(RUNTIMES)
                    await wb.register(registration(wid))
                    outcomes["drained, new life"] += 1
                else:
                    await wb.remove(wid)
                    runtimes_of[wid] = rng.choice(RUNTIMES)
                    await wb.register(registration(wid))
                    outcomes["new life"] += 1
            except ContractError as error:
                outcomes[f"registry {error.code.value}"] += 1

    template: dict[str, int] = defaultdict(int)

    async def actor_churn(stop: asyncio.Event) -> None:
        """The actors' side of the race: a stop and a new life, a template change, a revert."""
        while not stop.is_set():
            a = rng.choice(actors)
            op = rng.random()
            try:
                if op < 0.3:
                    await wb.stop(a)
                    placement_of.pop(a, None)
                    await wb.create(actor(a, cpu=100, mem=128, template=f"t{template[a]}", min_fidelity=floor[a]))
                    outcomes["new actor life"] += 1
                elif op < 0.6:
                    template[a] += 1
                    await wb.update_template(a, f"t{template[a]}")
                    outcomes["template changed"] += 1
                else:
                    await wb.revert(a)
                    outcomes["reverted"] += 1
            except ContractError as error:
                outcomes[f"actor churn {error.code.value}"] += 1

    async def kill_a_replica() -> None:
        victim = schedulers.pop(rng.randrange(1, len(schedulers)))
        await connections[id(victim)].close()  # a crash: its commits in flight end as they end
        await victim.stop()
        fresh = await replica()
        schedulers.append(fresh)
        outcomes["replica killed"] += 1
        if fresh.checkpoints.restored_seq:
            outcomes["replica started from a checkpoint"] += 1

    async def after(first: asyncio.Future) -> None:
        await first
        await kill_a_replica()
        if disrupt is not None:
            await disrupt()
            outcomes["disrupted"] += 1

    for number in range(rounds):
        await asyncio.gather(*(put_away(a) for a in actors))
        stop = asyncio.Event()
        churning = [asyncio.create_task(churn(wid, stop)) for wid in node_of]
        churning.append(asyncio.create_task(actor_churn(stop)))
        calls = []
        for a in actors:
            rid = f"r{number}-{a}"
            calls += [resume(rid, a, False), resume(rid, a, True)]
        rng.shuffle(calls)
        first = asyncio.ensure_future(asyncio.gather(*calls[:len(calls) // 3]))
        killing = asyncio.create_task(after(first))
        rest = asyncio.gather(*calls[len(calls) // 3:])
        try:
            await asyncio.gather(first, rest, killing)
        finally:
            stop.set()
            await asyncio.gather(*churning)

    messages = await read_messages(nc, prefix)
    bad, seen = verdict(messages)
    print("outcomes", dict(outcomes), "seen", dict(seen))
    assert not bad, "\n".join(bad[:30])
    # a request id is scoped to one life of its actor (CONTRACT section 1): answers are compared
    # within a life, the placement each was answered from found in the log by its sequence
    placed_at = {seq: (e.actor_id, e.request_id, e.worker_id) for seq, _, _, e in messages
                 if isinstance(e, ActorPlaced)}
    life_of: dict[int, int] = {}
    lives: dict[str, int] = {}
    for seq, _, _, e in messages:
        if isinstance(e, ActorCreated):
            lives[e.actor_id] = seq
        elif isinstance(e, ActorPlaced):
            life_of[seq] = lives[e.actor_id]
    wrong, by_life = [], defaultdict(set)
    for rid, got in answers.items():
        for worker_id, seq, _ in got:
            at = seq - 1 if seq - 1 in placed_at else seq
            if placed_at.get(at, (None, None, None))[1:] != (rid, worker_id):
                wrong.append(f"{rid}: answered {worker_id} at {seq}; the log has {placed_at.get(at)}")
            else:
                by_life[(rid, life_of[at])].add(at)
    assert not wrong, wrong[:20]
    doubled = {key: got for key, got in by_life.items() if len(got) > 1}
    assert not doubled, doubled
    sink = await replay(nc, prefix, Sink(verify=True), False)
    assert sink.violation is None, str(sink.violation)
    return outcomes, seen


@pytest.mark.timeout(240)
async def test_placements_racing_registry_changes_and_a_replica_kill_are_safe_in_stream_order(nats_server, prefix,
                                                                                               nc):
    async with AsyncExitStack() as exits:
        outcomes, seen = await stress(nc, [nats_server.url], prefix, 5, exits)
    # the races were had: memory images restored (through edges too) and LOCAL images on their nodes
    assert seen["MEMORY"] > ACTORS // 2 and seen["local restores"] > 10, seen
    assert outcomes["replica started from a checkpoint"] >= 1, outcomes
