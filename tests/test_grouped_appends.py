"""`events.jetstream.grouped.GroupedAppends` on a real nats-server: appends of different histories
that come while one is in flight go out as one atomic batch, each caller gets its own sequences,
and grouping never makes a caller pay for another's conflict, nor writes for one that gave up."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from pathlib import Path

import nats.errors
import pytest
from eventsourcing.persistence import IntegrityError, OperationalError, StoredEvent
from eventsourcing.utils import Environment

from events.codec import encode
from events.jetstream import JetStreamFactory, StoreUnavailableError
from events.jetstream.grouped import GroupedAppends
from events.jetstream.link import links_on
from events.schema import WorkerDrained
from services.process import store_env
from warmboot.natsserver import NatsServer

AT = datetime(2026, 1, 1, tzinfo=timezone.utc)
BODY = encode(WorkerDrained(at=AT, worker_id="g", reason="x"))
THEIRS = encode(WorkerDrained(at=AT, worker_id="g", reason="another writer's"))


def change(entity: str, version: int = 1) -> list[StoredEvent]:
    """What a registry command appends: the entity's event and, after it, a fence elsewhere."""
    return [StoredEvent(f"tally.{entity}", version, "WorkerDrained", BODY),
            StoredEvent(f"ledger.{entity}", version, "WorkerDrained", BODY)]


def two_events(entity: str) -> list[StoredEvent]:
    """What a snapshotter command appends: two events of the actor's (the second carries a fence)."""
    return [StoredEvent(f"tally.{entity}", 1, "WorkerDrained", BODY), StoredEvent(f"tally.{entity}", 2, "WorkerDrained", BODY)]


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
    grouped batch is refused as a whole, then each is tried alone; only `c` is a conflict.
    (Their events differ from `c`'s: a copy of a member's very events, byte for byte, is taken
    as the member's own, stored by an attempt whose reply was lost.)"""
    other = await asyncio.to_thread(JetStreamFactory, Environment(env=store_env(nats_url, prefix)))
    try:
        their_change = [StoredEvent(e.originator_id, e.originator_version, e.topic, THEIRS) for e in change("c")]
        theirs = await asyncio.to_thread(other.application_recorder().insert_events, their_change)
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


async def test_closed_appends_answer_the_waiting_unavailable_and_refuse_new_ones(recorder):
    appends = GroupedAppends(recorder.insert_events_async)
    waiting = [asyncio.create_task(appends.insert(change(f"w{i}"))) for i in range(3)]
    await asyncio.sleep(0)  # one turn of the loop: the three inserts queued
    await appends.close()
    for task in waiting:
        with pytest.raises(StoreUnavailableError, match="same request id"):
            await task
    with pytest.raises(StoreUnavailableError, match="closed"):
        await appends.insert(change("late"))


async def test_every_member_of_a_stored_batch_whose_reply_was_lost_gets_its_sequences(nats_url, prefix, recorder):
    """The grouped batch is stored but its reply lost; before the resend, another process appends
    to `b`'s second history (after b's own write, which it read). The resend is refused, and the
    batch is found where it landed, right after what it expected: `a` and `b` get their sequences,
    as each would have alone; nothing is stored twice. (`b` was answered as a conflict while its
    write was in the log, when a batch was known as stored only as its subjects' last messages: an
    audit, 2026-12-04.)"""
    real, sent = recorder.stream._send, []

    async def send(batch, timeout):
        seq = await real(batch, timeout)
        sent.append(len(batch.outs))
        if len(sent) == 1:
            other = await asyncio.to_thread(JetStreamFactory, Environment(env=store_env(nats_url, prefix)))
            try:
                await asyncio.to_thread(other.application_recorder().insert_events,
                                        [StoredEvent("ledger.b", 2, "WorkerDrained", BODY)])
            finally:
                await asyncio.to_thread(other.close)
            raise nats.errors.TimeoutError  # stored, and the caller does not know it
        return seq

    recorder.stream._send = send
    groups: list[int] = []
    appends = GroupedAppends(recorder.insert_events_async, on_group=groups.append)
    a, b = await asyncio.gather(appends.insert(change("a")), appends.insert(change("b")), return_exceptions=True)
    assert groups == [2] and sent[0] == 4
    log = await stored(recorder)
    assert [log[seq] for seq in a] == [("tally.a", 1), ("ledger.a", 1)]
    assert [log[seq] for seq in b] == [("tally.b", 1), ("ledger.b", 1)]
    assert sorted(log.values()) == sorted([("tally.a", 1), ("ledger.a", 1), ("tally.b", 1), ("ledger.b", 1),
                                           ("ledger.b", 2)])


async def test_an_unavailable_store_fails_the_calls_queued_behind_the_group_at_once():
    """Not one more time-out per group: the calls queued while the store failed are answered with
    the group's error, without an append of their own."""
    calls = []

    async def insert(events, fences=None, retried=False, late=None):
        calls.append(len(events))
        raise StoreUnavailableError("JetStream unavailable for 30s")

    appends = GroupedAppends(insert)
    results = await asyncio.gather(*(appends.insert(change(f"q{i}")) for i in range(401)), return_exceptions=True)
    assert calls == [256]  # one group of 128 changes; the 273 others failed with it
    assert all(isinstance(r, StoreUnavailableError) for r in results)
    assert len({id(r) for r in results}) == len(results)  # each caller its own exception


async def test_a_sender_that_fails_on_its_own_leaves_no_caller_waiting_and_the_next_call_goes_out():
    failures = [asyncio.CancelledError()]  # e.g. an inner task cancelled under the append, the sender not

    async def insert(events, fences=None, retried=False, late=None):
        if failures:
            raise failures.pop()
        return list(range(len(events)))

    def metric(size: int) -> None:
        raise RuntimeError("a broken metric is not the appends' failure")

    appends = GroupedAppends(insert, on_group=metric)
    results = await asyncio.gather(*(appends.insert(change(f"s{i}")) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, StoreUnavailableError) for r in results), results
    assert await appends.insert(change("next")) == [0, 1]


async def test_a_recorder_groups_its_appends_with_their_fences_and_one_history_fenced_twice_only_alike(recorder):
    """`recorder.group_appends()`: the library's calls (`insert_events_async`, and `insert_events`
    from threads) of more than one event go out grouped, each with its fences (a single event is a
    plain publish, cheaper alone than any atomic batch). Two that fence one history at the same
    sequence share a batch (one fence is both); one that expects another sequence there waits for
    the next batch, which the server refuses, and is refused alone, since that history moved on."""
    [placed] = await recorder.insert_events_async([StoredEvent("worker.f", 1, "WorkerDrained", BODY)])
    groups: list[int] = []
    recorder.group_appends(on_group=groups.append)
    try:
        fenced = {"worker.f": placed}
        results = await asyncio.gather(
            *(recorder.insert_events_async(two_events(f"k{i}"), fences=fenced) for i in range(3)),
            recorder.insert_events_async(two_events("stale"), fences={"worker.f": placed - 1}),
            recorder.insert_events_async(change("free")),
            return_exceptions=True)
        assert groups == [3, 2, 1, 1]  # the stale fence's batch refused, then each of its two alone
        assert isinstance(results[3], IntegrityError) and "fenced" in str(results[3])
        log = await stored(recorder)
        for i, got in enumerate(results[:3]):
            assert [log[seq] for seq in got] == [(f"tally.k{i}", 1), (f"tally.k{i}", 2)]
        assert [log[seq] for seq in results[4]] == [("tally.free", 1), ("ledger.free", 1)]
        assert len(log) == 1 + 8  # nothing of the refused one
        from_threads = await asyncio.gather(*(asyncio.to_thread(recorder.insert_events, two_events(f"t{i}"),
                                                                fences=fenced) for i in range(4)))
        log = await stored(recorder)
        for i, got in enumerate(from_threads):
            assert [log[seq] for seq in got] == [(f"tally.t{i}", 1), (f"tally.t{i}", 2)]
        assert sum(groups) == 3 + 2 + 1 + 1 + 4
        singles = await asyncio.gather(*(recorder.insert_events_async([StoredEvent(f"one.s{i}", 1, "WorkerDrained", BODY)])
                                         for i in range(3)))
        assert sum(groups) == 11 and len({seq for [seq] in singles}) == 3  # one event: a plain publish, not grouped
    finally:
        await recorder.ungroup_appends()
    assert recorder.grouped is None
    assert await recorder.insert_events_async(change("after")) != []


async def test_a_batch_refused_before_anything_was_stored_checks_each_member_as_a_first_attempt(
        nats_url, prefix, recorder):
    """Members are tried again as possibly stored only when the grouped batch may have been (a
    resend after a lost reply). Here it cannot have been: another process wrote `c`'s very
    events, byte for byte, and the server refused the grouped batch. `c` is a conflict, as
    alone, not taken for its own copy; were it taken, a rival's version would be answered as
    this caller's."""
    other = await asyncio.to_thread(JetStreamFactory, Environment(env=store_env(nats_url, prefix)))
    try:
        theirs = await asyncio.to_thread(other.application_recorder().insert_events, change("c"))
    finally:
        await asyncio.to_thread(other.close)
    await a_written_beside_a_conflict(recorder, "c", theirs)


async def a_written_beside_a_conflict(recorder, rival: str, theirs: list[int]) -> None:
    """`a` and `rival` grouped: the batch is refused, each member tried alone; `a` is written and
    `rival` is a conflict, the log holding the other writer's `theirs` and `a`'s, nothing more."""
    groups: list[int] = []
    appends = GroupedAppends(recorder.insert_events_async, on_group=groups.append)
    a, refused = await asyncio.gather(appends.insert(change("a")), appends.insert(change(rival)),
                                      return_exceptions=True)
    assert groups == [2, 1, 1]
    assert isinstance(refused, IntegrityError), refused
    log = await stored(recorder)
    assert [log[seq] for seq in a] == [("tally.a", 1), ("ledger.a", 1)]
    assert sorted(log) == sorted(theirs + a)  # the rival's version once: the other's


async def test_a_member_tried_again_after_a_lost_reply_is_still_checked_against_versions_taken_long_ago(
        nats_url, prefix, monkeypatch):
    """The grouped batch's first attempt goes unanswered (it may have been stored), its resend is
    refused: version 1 of `m`'s second history was taken by another process, longer ago than the stream's duplicate
    window, so the server no longer knows that message id. Each member is then tried alone as
    possibly stored. `m`'s copy is not in the log (the one there is another writer's), so `m` is
    the conflict it is: it was stored, after the other's version 1 (its expectation taken from
    the leader's read of the subject, its version never checked), and answered as written.
    The window is shortened to half a second here; in a deployment it is 120 s, which a read
    behind (a cached aggregate, a lagging replica) can be."""
    import events.jetstream.stream as stream_module

    window_s = 0.5
    monkeypatch.setattr(stream_module, "DUPLICATE_WINDOW_NS", int(window_s * 1e9))
    other = await asyncio.to_thread(JetStreamFactory, Environment(env=store_env(nats_url, prefix)))
    try:
        # as a placement takes the version of a worker's booking subject that the registry's fence would
        theirs = await asyncio.to_thread(other.application_recorder().insert_events,
                                         [StoredEvent("ledger.m", 1, "WorkerDrained", THEIRS)])
    finally:
        await asyncio.to_thread(other.close)
    with links_on(asyncio.get_running_loop()):
        factory = await asyncio.to_thread(JetStreamFactory, Environment(env=store_env(nats_url, prefix)))
    try:
        recorder = await asyncio.to_thread(factory.application_recorder)
        real, sent = recorder.stream._send, []

        async def send(batch, timeout):
            sent.append(len(batch.outs))
            if len(sent) == 1:
                raise nats.errors.TimeoutError  # unanswered: for all the caller knows, it was stored
            return await real(batch, timeout)

        recorder.stream._send = send
        # the other's message ages past the duplicate window: the precondition, not a synchronisation
        await asyncio.sleep(3 * window_s)
        await a_written_beside_a_conflict(recorder, "m", theirs)
    finally:
        await asyncio.to_thread(factory.close)


async def test_a_group_nobody_took_until_a_member_turned_late_is_not_sent_with_it(recorder):
    """An atomic batch the stream did not take (nobody answered: an election) is sent again by the store
    until it is; every attempt so far stored nothing. A member whose caller's wait passed meanwhile is
    left out (a first write, made late), and the others go out alone; none is written twice."""
    stream = recorder.stream
    send = stream._send
    refused = []

    async def nobody_first(batch, timeout):  # the group's first attempt: no responders (no leader)
        if len(batch.outs) == 4 and not refused:
            refused.append(len(batch.outs))
            late_one.set()
            raise nats.errors.NoRespondersError
        return await send(batch, timeout)

    stream._send = nobody_first
    late_one = asyncio.Event()
    gone = OperationalError("b's caller has gone")
    recorder.group_appends()
    try:
        grouped = recorder.grouped
        first = asyncio.ensure_future(grouped.insert(change("a0")))  # in flight: what follows queues behind it
        await asyncio.sleep(0)  # one turn of the loop: a0 queued, and the sender started, before a and b
        results = asyncio.gather(
            grouped.insert(change("a"), late=lambda: None),
            grouped.insert(change("b"), late=lambda: gone if late_one.is_set() else None),
            return_exceptions=True)
        await first
        a, b = await results
    finally:
        await recorder.ungroup_appends()
    assert refused == [4], refused  # the group of a and b, refused once as a whole
    assert b is gone, b
    assert isinstance(a, list) and len(a) == 2, a
    log = await stored(recorder)
    assert sorted(v for v in log.values() if v[0].endswith(".b")) == []
    assert sorted(v for v in log.values() if v[0].endswith(".a")) == [("ledger.a", 1), ("tally.a", 1)]
