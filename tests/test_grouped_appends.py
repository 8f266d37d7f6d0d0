"""`events.jetstream.grouped.GroupedAppends` on a real nats-server: appends of different histories
that come while one is in flight go out as one atomic batch, each caller gets its own sequences,
and grouping never makes a caller pay for another's conflict, nor writes for one that gave up."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from pathlib import Path

import pytest
from eventsourcing.persistence import IntegrityError, OperationalError, StoredEvent
from eventsourcing.utils import Environment

from events.codec import encode
from events.jetstream import JetStreamFactory
from events.jetstream.grouped import GroupedAppends
from events.jetstream.link import links_on
from events.schema import WorkerDrained
from services.common import store_env
from warmboot.natsserver import NatsServer

AT = datetime(2026, 1, 1, tzinfo=timezone.utc)
BODY = encode(WorkerDrained(at=AT, worker_id="g", reason="x"))


def change(entity: str, version: int = 1) -> list[StoredEvent]:
    """What a registry command appends: the entity's event and, after it, a fence elsewhere."""
    return [StoredEvent(f"tally.{entity}", version, "WorkerDrained", BODY),
            StoredEvent(f"ledger.{entity}", version, "WorkerDrained", BODY)]


@pytest.fixture
async def recorder(nats_url, prefix):
    with links_on(asyncio.get_running_loop()):
        factory = await asyncio.to_thread(JetStreamFactory, Environment(env=store_env(nats_url, prefix)))
    try:
        yield await asyncio.to_thread(factory.application_recorder)
    finally:
        await asyncio.to_thread(factory.close)


async def stored(recorder) -> dict[int, tuple[str, int]]:
    """The stream as the library reads it: sequence -> (originator, version)."""
    return {n.id: (n.originator_id, n.originator_version)
            for n in await asyncio.to_thread(recorder.select_notifications, None, 10_000)}


async def test_appends_that_come_together_are_one_batch_and_each_caller_gets_its_own_sequences(recorder):
    groups: list[int] = []
    appends = GroupedAppends(recorder.insert_events_async, on_group=groups.append)
    names = [f"e{i}" for i in range(120)]  # 240 messages: one batch (at most 256)
    seqs = await asyncio.gather(*(appends.insert(change(name)) for name in names))
    assert groups == [120]
    log = await stored(recorder)
    for name, got in zip(names, seqs):
        assert [log[seq] for seq in got] == [(f"tally.{name}", 1), (f"ledger.{name}", 1)]
    assert sorted(s for got in seqs for s in got) == sorted(log)  # nothing else, nothing twice


async def test_a_batch_holds_at_most_max_messages_and_the_rest_goes_next(recorder):
    groups: list[int] = []
    appends = GroupedAppends(recorder.insert_events_async, max_messages=10, on_group=groups.append)
    seqs = await asyncio.gather(*(appends.insert(change(f"m{i}")) for i in range(12)))
    assert groups == [5, 5, 2]
    assert len({s for got in seqs for s in got}) == 24


async def test_a_member_that_lost_its_race_fails_alone_and_the_others_are_stored(nats_url, prefix, recorder):
    """`c` was written meanwhile by another process (this one's store does not know it): the
    grouped batch is refused as a whole, then each is tried alone; only `c` is a conflict."""
    other = await asyncio.to_thread(JetStreamFactory, Environment(env=store_env(nats_url, prefix)))
    try:
        theirs = await asyncio.to_thread(other.application_recorder().insert_events, change("c"))
    finally:
        await asyncio.to_thread(other.close)
    groups: list[int] = []
    appends = GroupedAppends(recorder.insert_events_async, on_group=groups.append)
    results = await asyncio.gather(*(appends.insert(change(name)) for name in "acb"), return_exceptions=True)
    assert isinstance(results[1], IntegrityError), results
    assert groups == [3, 1, 1, 1]
    log = await stored(recorder)
    assert [log[seq] for seq in results[0]] == [("tally.a", 1), ("ledger.a", 1)]
    assert [log[seq] for seq in results[2]] == [("tally.b", 1), ("ledger.b", 1)]
    assert sorted(log) == sorted(theirs + results[0] + results[2])  # c once, theirs; nothing of the refused batch


async def test_appends_to_one_history_never_share_a_batch(recorder):
    groups: list[int] = []
    appends = GroupedAppends(recorder.insert_events_async, on_group=groups.append)
    first, other, second = await asyncio.gather(
        appends.insert(change("x", 1)), appends.insert(change("y", 1)), appends.insert(change("x", 2)))
    assert groups == [2, 1]  # x's second change waits for the batch that holds its first
    log = await stored(recorder)
    assert [log[seq] for seq in first + second] == [("tally.x", 1), ("ledger.x", 1), ("tally.x", 2), ("ledger.x", 2)]
    assert second[0] > first[-1] and log[other[0]] == ("tally.y", 1)


async def test_a_caller_that_gives_up_before_its_append_goes_out_writes_nothing(recorder):
    groups: list[int] = []
    appends = GroupedAppends(recorder.insert_events_async, on_group=groups.append)
    kept = asyncio.create_task(appends.insert(change("kept")))
    gone = asyncio.create_task(appends.insert(change("gone")))
    await asyncio.sleep(0)  # one step of each: both queued, the sending task not yet run
    gone.cancel()
    assert len(await kept) == 2
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert groups == [1]
    assert sorted(origin for origin, _ in (await stored(recorder)).values()) == ["ledger.kept", "tally.kept"]


async def test_an_unavailable_store_fails_every_member_once_not_each_again(tmp_path: Path, prefix):
    server = await asyncio.to_thread(NatsServer(tmp_path).start)
    try:
        env = {**store_env(server.url, prefix), "WARMBOOT_STORE_TIMEOUT": "1"}
        with links_on(asyncio.get_running_loop()):
            factory = await asyncio.to_thread(JetStreamFactory, Environment(env=env))
        try:
            recorder = await asyncio.to_thread(factory.application_recorder)
            await asyncio.to_thread(server.stop)
            groups: list[int] = []
            appends = GroupedAppends(recorder.insert_events_async, on_group=groups.append)
            results = await asyncio.gather(*(appends.insert(change(f"u{i}")) for i in range(3)),
                                           return_exceptions=True)
            assert all(isinstance(r, OperationalError) and "unavailable" in str(r) for r in results), results
            assert groups == [3]
        finally:
            await asyncio.to_thread(factory.close)
    finally:
        await asyncio.to_thread(server.stop)


async def test_closed_appends_refuse_new_ones_and_cancel_the_waiting(recorder):
    appends = GroupedAppends(recorder.insert_events_async)
    waiting = [asyncio.create_task(appends.insert(change(f"w{i}"))) for i in range(3)]
    await asyncio.sleep(0)
    await appends.close()
    for task in waiting:
        with pytest.raises(asyncio.CancelledError):
            await task
    with pytest.raises(OperationalError, match="closed"):
        await appends.insert(change("late"))
