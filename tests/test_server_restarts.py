"""The whole NATS server killed (SIGKILL) and started again on its store, a single one and every member of
a 3-node cluster at once, while tests/test_commit_races.py's rounds run (three scheduler replicas, the
registry's runtime flips, drains, removals and new lives, pauses and suspends naming their placement,
request ids sent twice at once): the services reconnect by themselves, and the log holds nothing that
checker or `warmboot audit verify` finds infeasible, no request id placed twice in a life, every
answer as the log has it (asserted by `stress`). Each kill comes when a number of placements is
written (heard on the log's subjects), so that resumes and registry changes are in flight."""

from __future__ import annotations

import asyncio
import re
import uuid
from contextlib import AsyncExitStack

import nats
import pytest

from events.schema import ActorPlaced
from events.tasks import cancel_and_wait
from tests.factories import last_seq, read_entries
from tests.test_commit_races import stress
from warmboot.natsserver import NatsCluster, NatsServer, wait_jetstream


def round_of(data: bytes) -> int | None:
    """The round of `stress` a message of an actor's subject is a placement of (its resumes carry
    request ids `r<round>-<actor>`), or None."""
    if b'"ActorPlaced"' not in data:
        return None
    found = re.search(rb'"request_id":"r([0-9]+)-', data)
    return int(found.group(1)) if found else None


async def kills_in_rounds(nc, prefix: str, rounds: int, kill
                         ) -> tuple[asyncio.Task, list[int], list[int], list[int]]:
    """A task that awaits `kill()` once in each round, heard on the log's actor subjects: once 20 of the
    round's placements are written (of a hundred or more: the rest of its resumes, and the registry's
    and the actors' changes, are in flight). Returns it, the placements of each round heard by the time of
    its kill, those heard in all, and the log's last sequence before each kill. (What is heard after a
    kill is not all that is written: a subscription misses what is published before its connection, or
    the cluster's routes, are back.)"""
    placed, at_kill, seq_at_kill = [0] * rounds, [0] * rounds, [0] * rounds
    enough = [asyncio.Event() for _ in range(rounds)]

    async def on_msg(msg) -> None:
        number = round_of(msg.data)
        if number is not None:
            placed[number] += 1
            if placed[number] >= 20:
                enough[number].set()

    sub = await nc.subscribe(f"{prefix}.ev.actor.>", cb=on_msg)

    async def run() -> None:
        try:
            for number in range(rounds):
                await enough[number].wait()
                at_kill[number] = placed[number]
                seq_at_kill[number] = await last_seq(nc, prefix)
                await kill()
        finally:
            await sub.unsubscribe()

    return asyncio.create_task(run()), at_kill, placed, seq_at_kill


async def run_through_kills(urls: list[str], prefix: str, seed: int, kill, rounds: int, **options) -> None:
    nc = await nats.connect(urls, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    killer, at_kill, placed, seq_at_kill = await kills_in_rounds(nc, prefix, rounds, kill)
    try:
        async with AsyncExitStack() as exits:
            outcomes, seen = await stress(nc, urls, prefix, seed, exits, rounds=rounds, **options)
        # every round's kill came during the rounds (its last may still be starting the servers again):
        # a round of which fewer than 20 placements were heard would leave it waiting for ever
        await asyncio.wait({killer}, timeout=120)
        assert killer.done(), f"not every round's kill came (placements heard by round: {placed}; at the kills: " \
                              f"{at_kill})"
        killer.result()
        # every round was killed, with placements written after its kill (read from the log: heard, they were
        # missed after a whole cluster's restart, 24 heard of 101 written, a run beside two others), memory
        # images among them
        entries = await read_entries(nc, prefix)
        after_kill = [sum(1 for seq, _, event in entries if isinstance(event, ActorPlaced) and seq > seq_at_kill[n]
                          and (event.request_id or "").startswith(f"r{n}-")) for n in range(rounds)]
        assert all(after_kill), (seq_at_kill, after_kill, at_kill, placed, outcomes)
        assert seen["MEMORY"], seen
    finally:
        await cancel_and_wait(killer)
        await nc.close()


@pytest.mark.timeout(300)
async def test_placements_through_whole_server_kills_are_safe_in_stream_order(tmp_path):
    server = NatsServer(tmp_path)
    server.start()

    async def kill() -> None:
        server.kill()
        server.spawn()
        await asyncio.to_thread(server.wait_ready)

    try:
        await run_through_kills([server.url], "t" + uuid.uuid4().hex[:10], 11, kill, 2)
    finally:
        server.stop()


@pytest.mark.timeout(300)
async def test_placements_through_whole_cluster_restarts_are_safe_in_stream_order(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMBOOT_STREAM_REPLICAS", "3")
    cluster = NatsCluster(tmp_path)
    cluster.start()

    async def kill() -> None:
        for node in cluster.nodes:
            node.process.kill()  # every member down before any is waited on
        for node in cluster.nodes:
            node.kill()
        for node in cluster.nodes:
            node.spawn()
        for node in cluster.nodes:
            await asyncio.to_thread(node.wait_ready, 30)
        await wait_jetstream(cluster.url, 60)

    try:
        await wait_jetstream(cluster.url)
        await run_through_kills(cluster.urls, "t" + uuid.uuid4().hex[:10], 13, kill, 1, replicas=3)
    finally:
        cluster.stop()
