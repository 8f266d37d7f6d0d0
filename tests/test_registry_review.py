"""The registry's heartbeat path at its edges: stopping with work in flight, the roster's
memory, an expiry swept while the worker registers, an event the roster does not know,
and a lost worker asked through each replica.

Each test runs over the session's nats-server and fails on the behaviour it names
(a hang shows as a bound running out, never as a sleep).
"""

from __future__ import annotations

import asyncio
import logging
import math
import tracemalloc
from unittest.mock import patch

import msgspec
import nats.errors
import nats.js.errors
import pytest

from events.errors import ContractError
from events.jetstream import TOPIC_HEADER, VERSION_HEADER
from events.schema import (ErrorCode, Heartbeat, RegisterOutcome, RegisterWorker, RemoveWorker, WorkerRegistered,
                           WorkerRemoved)
from events.subjects import bucket_name, stream_name
from events.natspy.publish import Replies, flush_in_order
import services.registry.liveness as liveness_module
from services.registry.liveness import Hearing, Liveness
from services.registry.roster import Roster
from services.registry.service import REGISTER_AGAIN
from tests.factories import last_seq
from tests.registry_helpers import (
    body,
    expiry_marker,
    heard_for_long,
    raw_request,
    registration,
    running_registry,
    runtime,
    wait_event,
    worker_events,
)

BOUND_S = 10.0  # how long a call that should return at once may take before the test fails


async def refused(call) -> ContractError:
    with pytest.raises(ContractError) as caught:
        await finished(call)
    return caught.value


async def finished(call, bound: float = BOUND_S):
    """What `call` returns, failing the test if it has not finished within `bound`. It is not
    cancelled at the bound (as `asyncio.wait_for` would), so a call that swallows a
    cancellation cannot pass for one that returned."""
    task = asyncio.ensure_future(call)
    done, _ = await asyncio.wait({task}, timeout=bound)
    if not done:
        task.cancel()
        pytest.fail(f"still waiting after {bound:g}s: {task!r}")
    return task.result()


# --- stopping with work in flight -----------------------------------------------------------


async def test_stopping_the_fold_ends_the_heartbeats_waiting_on_its_barrier(nats_url, nc, prefix):
    async with running_registry(nats_url, prefix) as one, running_registry(nats_url, prefix) as two:
        one.fold.barrier_timeout = 120.0  # longer than the test: only the stop can end the round
        await one.fold._sub.unsubscribe()  # one's fold hears of no worker event from now on...
        await two.register("w-1", body("w-1"))  # ...so its next round waits for this one
        asked = asyncio.Event()

        async def tap(msg) -> None:
            asked.set()

        # The round is under way (its waiters taken) once it asks the leader for that event.
        sub = await nc.subscribe(f"$JS.API.STREAM.MSG.GET.{stream_name(prefix)}", cb=tap)
        await flush_in_order(nc)
        waiting = asyncio.create_task(one.fold.current())
        await asyncio.wait_for(asked.wait(), BOUND_S)
        await sub.unsubscribe()

        await finished(one.fold.stop())
        error = await refused(waiting)
        assert error.code == ErrorCode.UNAVAILABLE and "stopping" in error.message
        # and a call after the stop is refused at once, not left waiting for a round that never runs
        error = await refused(one.fold.current())
        assert error.code == ErrorCode.UNAVAILABLE


async def test_replies_refuse_requests_once_stopped(nc, prefix):
    async def echo(msg) -> None:
        await nc.publish(msg.reply, b"re:" + msg.data)

    sub = await nc.subscribe(f"{prefix}.echo", cb=echo)
    replies = await Replies(nc, timeout=0.5).start()
    try:
        assert (await replies.request(f"{prefix}.echo", b"x")).data == b"re:x"
    finally:
        await replies.stop()
    try:
        # its inbox is gone and nothing checks deadlines any more: an answer could never arrive
        with pytest.raises(nats.errors.ConnectionClosedError):
            await finished(replies.request(f"{prefix}.echo", b"late"))
    finally:
        await sub.unsubscribe()


async def test_the_sweeper_stops_even_when_a_removal_swallows_its_cancellation(nc, prefix):
    entered = asyncio.Event()

    async def on_expired(worker_id: str) -> None:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass  # what asyncio.wait_for (Python 3.11) does when its future completes as it is cancelled

    liveness = Liveness(nc, prefix, ttl_s=1, on_expired=on_expired)
    await liveness.start()
    try:
        await liveness.beat("w-1")
        await asyncio.wait_for(entered.wait(), 30.0)  # the server expired the put; its marker was swept
    finally:
        await finished(liveness.stop())


async def test_stopping_the_sweeper_can_itself_be_cancelled(nc, prefix):
    entered, swallowed, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def on_expired(worker_id: str) -> None:
        entered.set()
        while not release.is_set():  # a removal that will not be cancelled: stop() waits for it
            try:
                await release.wait()
            except asyncio.CancelledError:
                swallowed.set()

    liveness = Liveness(nc, prefix, ttl_s=1, on_expired=on_expired)
    await liveness.start()
    try:
        await liveness.beat("w-1")
        await asyncio.wait_for(entered.wait(), 30.0)
        stopping = asyncio.create_task(liveness.stop())
        await asyncio.wait_for(swallowed.wait(), BOUND_S)  # stop() has cancelled the sweep and waits
        stopping.cancel()  # whoever stops the registry gives up waiting
        release.set()
        await asyncio.wait({stopping}, timeout=BOUND_S)
        assert stopping.cancelled()  # the stop was cancelled, not finished as if nothing happened
    finally:
        release.set()
        await finished(liveness.stop())


async def test_a_sweep_that_stops_hands_back_the_markers_queued_behind_its_lanes_too(nc, prefix, monkeypatch):
    """docs/registry.md, Liveness: a replica that stops hands back at once the markers it took and has
    not handled, so that the others remove those workers within their TTL, not the consumer's 30 s ack
    wait later: the markers its lanes are handling, and those queued behind them. Here the stopping
    sweep has one lane, held by its first marker, and the two other markers wait in its queue; a sweep
    started after it stopped is given all three at once. Kills the mutant of `Sweeper.stop` that hands
    back only the markers in hand."""
    monkeypatch.setattr(liveness_module, "MARKER_LANES", 1)  # read as the sweep starts
    workers = {"w-1", "w-2", "w-3"}
    taken, all_taken = set(), asyncio.Event()

    async def handling_none(worker_id: str) -> None:
        await asyncio.Event().wait()

    stopping = Liveness(nc, prefix, ttl_s=1, on_expired=handling_none)
    await stopping.start()
    put = stopping.sweeper._markers.put_nowait

    def queued(msg) -> None:  # each marker delivered to the stopping sweep
        put(msg)
        taken.add(msg.subject.rsplit(".", 1)[-1])
        if taken == workers:
            all_taken.set()

    stopping.sweeper._markers.put_nowait = queued
    try:
        for worker_id in sorted(workers):
            await stopping.beat(worker_id)
        await asyncio.wait_for(all_taken.wait(), 30.0)  # one in hand, two queued
    finally:
        await finished(stopping.stop())

    monkeypatch.undo()
    handed, all_handed = set(), asyncio.Event()

    async def removing(worker_id: str) -> None:
        handed.add(worker_id)
        if handed == workers:
            all_handed.set()

    other = Liveness(nc, prefix, ttl_s=1, on_expired=removing)
    await other.start()
    try:
        await finished(all_handed.wait(), bound=15.0)  # well within the consumer's ack wait (30 s)
    finally:
        await finished(other.stop())


# --- the roster's memory ----------------------------------------------------------------------


def test_the_roster_keeps_nothing_of_removed_workers():
    """Workers come and go (an autoscaled fleet, a fresh id per boot): the roster holds the
    registered ones only, however many lives it has folded."""
    roster = Roster()
    roster.apply(1, "w-kept", "WorkerRegistered")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(20_000):
            worker_id = f"w-{n}"
            roster.apply(2 * n + 2, worker_id, "WorkerRegistered")
            roster.apply(2 * n + 3, worker_id, "WorkerRemoved")
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert list(roster.registered()) == ["w-kept"] and roster.seq == 40_001
    assert held < 100_000, f"{held} bytes held for 20000 removed workers"  # about 100 bytes each before


# --- an expiry swept while the worker registers ----------------------------------------------------


def hold_the_sweeps_read(registry) -> tuple[asyncio.Event, asyncio.Event]:
    """The registry's read of a worker's heartbeat key (`liveness.entry`, which the sweep makes for
    an expiry) held once it has read: (`read`, set then; `go`, which the test sets to let it return)."""
    entry, read, go = registry.liveness.entry, asyncio.Event(), asyncio.Event()

    async def entry_then_wait(worker_id: str) -> tuple[str, int]:
        seen = await entry(worker_id)
        read.set()
        await go.wait()
        return seen

    registry.liveness.entry = entry_then_wait
    return read, go


async def test_an_expiry_swept_while_the_worker_registers_leaves_it_registered(nats_url, nc, prefix):
    """docs/registry.md: a registration beats before it is decided, so that an expiry being swept
    at that moment cannot remove the worker it is registering."""
    async with running_registry(nats_url, prefix, ttl_s=1) as one:
        await one.liveness.sweeper.stop()  # the test hands the expiry to the sweep, at the moment it picks
        await one.register("w-1", body("w-1"))
        await expiry_marker(nc, prefix, "w-1")
        assert await one.liveness.state("w-1") == "expired"
        read, go = hold_the_sweeps_read(one)
        sweep = asyncio.create_task(one._expired("w-1"))
        await finished(read.wait())  # the sweep has read the marker...
        registering = asyncio.create_task(one.register("w-1", body("w-1")))  # ...as the worker comes back
        go.set()
        await finished(sweep)
        reply = await finished(registering)

        # Whatever the sweep did, the registration answered last: the worker is registered.
        events = await worker_events(nc, prefix, "w-1")
        assert not isinstance(events[-1][1], WorkerRemoved), (reply, [type(e).__name__ for _, e in events])
        assert (await finished(one.heartbeat("w-1", Heartbeat()))).ttl_s == 1.0


async def test_a_registration_answered_while_an_expiry_is_handled_is_not_undone_by_it(nats_url, nc, prefix):
    """docs/registry.md: the sweep reads the bucket under the worker's lock, so that a registration
    through the same replica either is seen beating or decides after the removal (and registers the
    worker anew). Here the sweep has loaded w-1 and read its marker when w-1 registers again; it is let
    go once the registration waits for w-1's lock, or once the registration is answered if it did not
    have to wait. Whatever the order, the registration answered is what stands: w-1 is registered
    and beats. Without the lock, the registration was answered UNCHANGED and the sweep then wrote
    its removal on the history it had loaded (nothing written since): a worker removed as LOST just
    after its registration was answered. Kills the mutant of `RegistryService._expired` that handles
    the marker without the worker's lock."""
    async with running_registry(nats_url, prefix, ttl_s=1) as one:
        await one.liveness.sweeper.stop()  # the test hands the expiry to the sweep
        await one.register("w-1", body("w-1"))
        await expiry_marker(nc, prefix, "w-1")
        read, go = hold_the_sweeps_read(one)
        sweep = asyncio.create_task(one._expired("w-1"))
        await finished(read.wait())  # the sweep has loaded w-1 and read its marker...
        workers = one._workers

        def asking(worker_id: str):
            if worker_id in workers._locks:  # held by the sweep: the registration waits its turn
                go.set()
            return workers(worker_id)

        one._workers = asking
        reply = await finished(one.register("w-1", body("w-1")))  # ...as the worker registers again
        go.set()
        await finished(sweep)

        events = await worker_events(nc, prefix, "w-1")
        assert not isinstance(events[-1][1], WorkerRemoved), (reply, [type(e).__name__ for _, e in events])
        assert reply.seq == events[-1][0]
        assert (await finished(one.heartbeat("w-1", Heartbeat()))).ttl_s == 1.0


async def test_an_expiry_handled_twice_does_not_end_the_life_registered_after_it(nats_url, nc, prefix):
    """Two replicas handle one expiry marker (a reconciliation round and the sweep; a marker handed back
    by a replica that stops after it removed the worker): the first removes the worker as LOST, its
    agent registers it anew through that replica (a new life, which beats), and the second, having
    read the marker as the key's last entry before all that, decided on the worker as it loaded it
    afterwards: it removed the new life as LOST too, a worker that had just registered and beaten (its
    actors released and placed again elsewhere), two removals for one silence. The key is read after
    the worker is loaded now, again at each attempt, and the removal's append expects the worker's
    history as loaded: a registration since makes it decide again, and find the new life beating."""
    async with running_registry(nats_url, prefix, ttl_s=1) as one, \
            running_registry(nats_url, prefix, ttl_s=60) as two:  # two's beats outlive the test
        for replica in (one, two):  # the test hands the marker to each of them
            await replica.liveness.sweeper.stop()
        heard_for_long(one, two)  # (each takes the marker as a silence, not as one it may not have heard)
        first = await one.register("w-1", body("w-1"))
        await expiry_marker(nc, prefix, "w-1")

        entry, read, go = one.liveness.entry, asyncio.Event(), asyncio.Event()

        async def entry_then_wait(worker_id: str):  # one's first read of the bucket, held
            seen = await entry(worker_id)
            if not read.is_set():
                read.set()
                await go.wait()
            return seen

        one.liveness.entry = entry_then_wait
        late = asyncio.create_task(one._expired("w-1"))
        await finished(read.wait())  # one has read the marker as the key's last entry...
        await finished(two._expired("w-1"))  # ...two removes the worker on it (LOST)...
        again = await finished(two.register("w-1", body("w-1")))  # ...and its agent registers it anew
        assert again.outcome is RegisterOutcome.REGISTERED
        go.set()
        await finished(late)

        history = await worker_events(nc, prefix, "w-1")
        events = [(seq, type(e).__name__, getattr(e, "reason", None)) for seq, e in history]
        assert [e[1:] for e in events] == [("WorkerRegistered", None), ("WorkerRemoved", "LOST"),
                                           ("WorkerRegistered", None)], events
        assert events[0][0] == first.seq and events[-1][0] == again.seq
        assert (await finished(one.heartbeat("w-1", Heartbeat()))).ttl_s == 1.0


async def test_an_expiry_that_finds_a_removal_s_tombstone_gives_the_new_life_a_clock(nats_url, nc, prefix):
    """A worker falls silent (its marker written), and is removed (by its agent, an operator) as it
    registers again through another replica: the removal read that registration's first beat as the
    key's last entry and put its tombstone over it, and the registration, decided on the removed
    worker, began a new life, whose second beat is on its way. The marker handled then found the new
    life and a key with no heartbeat, and removed it as LOST: a worker that had just registered and
    beaten. A key with nothing in it after a marker was emptied by a removal since: the life in force
    began after it, and gets a clock (removed LOST within its TTL if it is silent), as a reconciliation
    gives one."""
    from events.schema import RemoveWorker

    async with running_registry(nats_url, prefix, ttl_s=1) as one, \
            running_registry(nats_url, prefix, ttl_s=60) as two:  # two's beats outlive the test
        for replica in (one, two):  # the test hands the marker over itself
            await replica.liveness.sweeper.stop()
        await one.register("w-1", body("w-1"))
        await expiry_marker(nc, prefix, "w-1")

        beat, beats, first, go, second, then = two.liveness.beat, [], asyncio.Event(), asyncio.Event(), \
            asyncio.Event(), asyncio.Event()

        async def held(worker_id: str) -> None:  # two's beat before its decision, then its beat after it
            beats.append(worker_id)
            if len(beats) == 1:
                await beat(worker_id)
                first.set()
                await go.wait()
            else:
                second.set()
                await then.wait()
                await beat(worker_id)

        two.liveness.beat = held
        registering = asyncio.create_task(two.register("w-1", body("w-1")))
        await finished(first.wait())
        removed = await finished(one.remove("w-1", RemoveWorker(reason="operator")))
        assert await one.liveness.state("w-1") == "absent"  # its tombstone over two's beat
        go.set()
        await finished(second.wait())  # the new life is written, its second beat held
        await finished(one._expired("w-1"))  # the marker, handled now
        then.set()
        again = await finished(registering)
        assert again.outcome is RegisterOutcome.REGISTERED and again.seq > removed.seq

        history = await worker_events(nc, prefix, "w-1")
        events = [(type(e).__name__, getattr(e, "reason", None)) for _, e in history]
        assert events == [("WorkerRegistered", None), ("WorkerRemoved", "operator"), ("WorkerRegistered", None)], \
            events
        assert (await finished(one.heartbeat("w-1", Heartbeat()))).ttl_s == 1.0


async def test_an_expiry_that_finds_the_key_empty_starts_a_clock_that_ends_a_silent_life(nats_url, nc, prefix):
    """docs/registry.md, Liveness: a marker handled while the worker's key holds nothing (a removal's
    tombstone since the marker, the life in force begun after it) writes nothing, and gives the worker
    a clock, so that it is removed as LOST within its TTL if it is silent. Here w-1 is in a life and its
    key emptied after its marker; the marker handled then removes nothing, a clock runs, and its
    expiry removes the silent worker. Without the clock no marker would ever come, and the worker stayed
    registered until a reconciliation (every 100 s). Kills the mutants of `RegistryService._silent` that
    start no clock, or one that expects the key to hold no entry (refused under the tombstone)."""
    async with running_registry(nats_url, prefix, ttl_s=1) as one:
        await one.liveness.sweeper.stop()  # the test hands the markers over itself
        registered = await one.register("w-1", body("w-1"))
        await expiry_marker(nc, prefix, "w-1")
        assert await one.liveness.forget("w-1", await one.liveness.last_entry("w-1"))  # the key emptied
        assert await one.liveness.state("w-1") == "absent"

        await finished(one._expired("w-1"))  # the marker, handled now
        assert [type(e) for _, e in await worker_events(nc, prefix, "w-1")] == [WorkerRegistered]
        assert await one.liveness.state("w-1") == "beating"  # a clock
        await finished(expiry_marker(nc, prefix, "w-1"), bound=30.0)  # which runs out: the worker is silent
        await finished(one._expired("w-1"))
        _, lost = await wait_event(nc, prefix, "w-1", WorkerRemoved, after=registered.seq)
        assert lost.reason == "LOST"


async def test_an_expiry_whose_clock_the_bucket_refuses_is_handed_back(nats_url, nc, prefix):
    """A marker handled while the worker's key holds nothing starts a clock (see the test above); should the
    bucket refuse that put, the handling fails, so that the sweep hands the marker back and tries again a
    second later, instead of taking the clock for started: swallowed, the refusal left the silent worker
    with neither a clock nor a marker, registered until a reconciliation (every 100 s). Only a beat
    that came first is let go. Kills the mutant of `Liveness.start_clock` that swallows every refusal
    of its put by the server."""
    async with running_registry(nats_url, prefix, ttl_s=1) as one:
        await one.liveness.sweeper.stop()  # the test hands the marker over itself
        await one.register("w-1", body("w-1"))
        await expiry_marker(nc, prefix, "w-1")
        assert await one.liveness.forget("w-1", await one.liveness.last_entry("w-1"))  # the key emptied
        js = nc.jetstream()
        stream = f"KV_{bucket_name(prefix, 'heartbeats')}"
        config = (await js.stream_info(stream)).config
        config.max_msg_size = 8  # the bucket refuses every put now
        await js.update_stream(config)
        with pytest.raises(nats.js.errors.APIError):
            await finished(one._expired("w-1"))
        assert await one.liveness.state("w-1") == "absent"
        assert [type(e) for _, e in await worker_events(nc, prefix, "w-1")] == [WorkerRegistered]


# --- an event the roster does not know -----------------------------------------------------------


async def test_a_worker_event_of_an_unknown_type_is_not_vouched_for_by_the_roster(nats_url, nc, prefix):
    """The project may add events (CONTRACT section 1): a newer registry's event on a worker's
    subject, which may end its life, leaves a replica that cannot read it unable to say the
    worker is registered. Its heartbeat is answered by the worker's history, not `ttl_s`."""
    async with running_registry(nats_url, prefix) as one:
        await one.register("w-1", body("w-1"))
        await one.register("w-2", body("w-2"))
        ack = await nc.jetstream().publish(
            f"{prefix}.ev.worker.w-1",
            msgspec.json.encode({"type": "WorkerRetired", "worker_id": "w-1", "at": "2026-12-01T10:00:00Z"}),
            stream=stream_name(prefix),
            headers={TOPIC_HEADER: "WorkerRetired", VERSION_HEADER: "2"},
        )
        assert (await finished(one.heartbeat("w-2", Heartbeat()))).ttl_s == 15.0  # the barrier passed ack.seq
        assert one.fold.complete >= ack.seq
        reply, _ = await raw_request(nc, prefix, "heartbeat", "w-1", {})
        # whatever the history says, it does not say "registered"; nor can this replica read it
        assert reply["error"]["code"] == "UNAVAILABLE", reply
        assert (f"worker.w-1 holds an event this service cannot read (its version 2 at stream sequence {ack.seq}): "
                f"its type 'WorkerRetired' is not one this version knows") in reply["error"]["message"], reply


# --- removed, lost, and back: through each replica ---------------------------------------------------


async def test_a_lost_worker_is_not_found_through_every_replica_and_beats_again_once_back(nats_url, nc, prefix):
    async with running_registry(nats_url, prefix, ttl_s=1) as one, running_registry(nats_url, prefix, ttl_s=1) as two:
        start = await last_seq(nc, prefix)
        await two.register("w-1", body("w-1"))  # a registration is a heartbeat: its clock runs from here
        await wait_event(nc, prefix, "w-1", WorkerRemoved, after=start)
        kv = f"KV_{bucket_name(prefix, 'heartbeats')}"
        puts = (await nc.jetstream().stream_info(kv)).state.last_seq
        for replica in (one, two):
            error = await refused(replica.heartbeat("w-1", Heartbeat()))
            # the refusal says what an agent in another language does next (docs/worker-agents.md)
            assert (error.code, error.message) == (ErrorCode.NOT_FOUND,
                                                   f"worker 'w-1' was removed (LOST){REGISTER_AGAIN}")
            error = await refused(replica.heartbeat("w-never", Heartbeat()))
            assert (error.code, error.message) == (ErrorCode.NOT_FOUND,
                                                   f"worker 'w-never' is not registered{REGISTER_AGAIN}")
        assert (await nc.jetstream().stream_info(kv)).state.last_seq == puts  # a refusal puts nothing
        assert [type(e) for _, e in await worker_events(nc, prefix, "w-1")] == [WorkerRegistered, WorkerRemoved]

        await one.register("w-1", body("w-1"))  # back: a new life
        for replica in (one, two):
            assert (await finished(replica.heartbeat("w-1", Heartbeat()))).ttl_s == 1.0


# --- a refusal's recheck at the stream leader -----------------------------------------------------


async def test_a_refusal_is_checked_against_what_its_decision_read_not_what_was_read_since(nats_url, prefix):
    """A refusal on a worker's state (here NOT_FOUND) decided on a read behind another process's
    registration is decided again, also when this process has read the worker's history in
    between (the snapshotter's fence reads it outside the registry's lock on the worker, in
    `warmboot serve all`). The check used to compare the leader with everything this process had
    read by then, so that read made the stale refusal pass for current."""
    from events.errors import not_found
    from services.commands import run_command_async
    from services.registry.domain import Worker

    async with running_registry(nats_url, prefix) as elsewhere, \
            running_registry(nats_url, prefix, own_link=True) as here:
        await elsewhere.register("w-1", body("w-1"))  # another process's write: `here` has read nothing of it
        recorder, aggregate = here.store.recorder, Worker.create_id("w-1")
        assert recorder.seen(aggregate) == 0
        decisions: list[str] = []

        async def decide() -> str:
            if not decisions:  # decided on a read behind that registration (a lagging replica's)...
                await recorder.select_events_async(aggregate)  # ...while another command read the worker
                decisions.append("refused")
                raise not_found("worker w-1 is not registered")
            decisions.append("decided again")
            return "registered"

        assert await finished(run_command_async(decide, recheck=here._recheck("w-1"))) == "registered"
        assert decisions == ["refused", "decided again"]
        assert recorder.seen(aggregate) > 0

        # A refusal decided on everything the leader has is answered, after one check.
        async def refuse() -> str:
            decisions.append("refused again")
            raise not_found("worker w-1 is not registered")

        error = await refused(run_command_async(refuse, recheck=here._recheck("w-1")))
        assert error.code is ErrorCode.NOT_FOUND and decisions[-1:] == ["refused again"]
        assert decisions.count("refused again") == 1


# --- the fold's stream requests, asked again (pure retry logic: a scripted connection) ---------------


class _Scripted:
    """A connection whose requests get the scripted outcomes in turn: an exception, or a body."""

    def __init__(self, *outcomes):
        self.outcomes = list(outcomes)
        self.timeouts: list[float] = []

    async def request(self, subject: str, body: bytes, timeout: float):
        from types import SimpleNamespace

        self.timeouts.append(timeout)
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return SimpleNamespace(data=outcome)


UNAVAILABLE_503 = b'{"error":{"code":503,"err_code":10008,"description":"JetStream system temporarily unavailable"}}'
INFO_7 = b'{"state":{"last_seq":7}}'


async def test_the_fold_asks_again_after_a_lost_request_and_at_its_start_through_an_outage():
    from events.jetstream.retry import REQUEST_TIMEOUT
    from services.registry.fold import RosterFold

    # At the start (patient): a lost request, nobody listening, a 5xx, then the answer.
    nc = _Scripted(nats.errors.TimeoutError(), nats.errors.NoRespondersError(), UNAVAILABLE_503, INFO_7)
    fold = RosterFold(nc, "p", Roster())
    assert await finished(fold._last_seq(60.0, patient=True)) == 7
    assert len(nc.timeouts) == 4 and all(t <= REQUEST_TIMEOUT for t in nc.timeouts)

    # In a barrier round (2 s, less than one request's time): an outage is the round's failure at once.
    nc = _Scripted(nats.errors.NoRespondersError())
    with pytest.raises(nats.errors.NoRespondersError):
        await finished(RosterFold(nc, "p", Roster())._last_seq(2.0))
    nc = _Scripted(UNAVAILABLE_503)
    error = await refused(RosterFold(nc, "p", Roster())._last_seq(2.0))
    assert error.code is ErrorCode.UNAVAILABLE and "temporarily unavailable" in error.message

    # A request that had all the time left is the last, as a round's: no burst of attempts at the deadline.
    nc = _Scripted(nats.errors.TimeoutError(), INFO_7)
    with pytest.raises(asyncio.TimeoutError):
        await finished(RosterFold(nc, "p", Roster())._last_seq(0.5, patient=True))
    assert nc.timeouts == [pytest.approx(0.5, abs=0.05)] and nc.outcomes == [INFO_7]


async def test_a_check_at_the_leader_never_lowers_what_later_reads_must_reach(nats_url, prefix):
    """The leader's answer to a refusal's check is remembered only if it is news: it never
    lowers what this process knows of the subject (an append of its own stored meanwhile is
    newer), which is the floor of every later decision's read. And a floor this process has
    forgotten since (the stream made anew, the entry pushed out) is not trusted."""
    from events.jetstream.lastseen import Last
    from events.jetstream.layout import originator_subject
    from services.registry.domain import Worker

    async with running_registry(nats_url, prefix) as elsewhere, \
            running_registry(nats_url, prefix, own_link=True) as here:
        stored = await elsewhere.register("w-1", body("w-1"))
        recorder, aggregate = here.store.recorder, Worker.create_id("w-1")
        subject = originator_subject(recorder.namespace, aggregate)
        ahead = stored.seq + 1_000  # as if this process had just appended there, past the leader's answer
        recorder.link.last_seen.put(subject, Last(ahead, None))
        assert await recorder.newer_at_leader_async(aggregate, 0) is True  # news to a decision that read nothing
        assert recorder.seen(aggregate) == ahead  # and what later reads must reach stays where it was

        recorder.link.last_seen.forget([subject])  # forgotten: a decision's floor of `stored.seq` is not trusted
        assert await recorder.newer_at_leader_async(aggregate, stored.seq) is True
        assert recorder.seen(aggregate) == stored.seq
        assert await recorder.newer_at_leader_async(aggregate, stored.seq) is False  # known again: current


# --- an event of another version at start ------------------------------------------------------------


async def test_a_start_reconciles_every_worker_but_one_whose_history_it_cannot_read(tmp_path, prefix, caplog):
    """Both workers' heartbeats expired while no registry ran (after a rollback, say), and one's
    history holds an event of a known type whose body this version refuses. The start-up
    reconciliation raised out of its task group for that worker: no replica of this version could
    start. Now that worker is logged and left (its expiry marker stays with the sweep), and the
    others are reconciled. On a server of its own: the session's traffic check would judge the
    refused body."""
    from warmboot.natsserver import NatsServer

    server = NatsServer(tmp_path / "nats").start()
    try:
        nc = await nats.connect(server.url)
        async with running_registry(server.url, prefix, ttl_s=1) as one:
            await one.register("w-1", body("w-1"))
            await one.register("w-2", body("w-2"))
        js = nc.jetstream()
        kv = f"KV_{bucket_name(prefix, 'heartbeats')}"
        markers = await js.subscribe(f"$KV.{bucket_name(prefix, 'heartbeats')}.>", stream=kv, ordered_consumer=True)
        expired: set[str] = set()
        while expired != {"w-1", "w-2"}:  # the server's expiry markers, written while no registry runs
            msg = await markers.next_msg(timeout=30)
            if (msg.headers or {}).get("Nats-Marker-Reason") == "MaxAge":
                expired.add(msg.subject.rsplit(".", 1)[1])
        await markers.unsubscribe()
        refused = await js.publish(f"{prefix}.ev.worker.w-1", b'{"type":"WorkerDrained","worker_id":"w-1"}',
                                   stream=stream_name(prefix), headers={TOPIC_HEADER: "WorkerDrained", VERSION_HEADER: "2"})
        with caplog.at_level(logging.WARNING, logger="warmboot.registry"), \
                patch.object(Hearing, "heard_for", lambda self: math.inf):
            # (as a replica that has heard beats for a TTL reconciles: one that has just started gives each a
            # new clock first, `test_registry_outage.py`)
            async with running_registry(server.url, prefix, ttl_s=1):
                _, removed = await wait_event(nc, prefix, "w-2", WorkerRemoved, after=refused.seq)
        assert removed.reason == "LOST"
        last = await js.get_last_msg(stream_name(prefix), f"{prefix}.ev.worker.w-1")
        assert last.seq == refused.seq  # nothing written for it
        assert any("w-1" in r.getMessage() and "reconcil" in r.getMessage() for r in caplog.records), caplog.text
        await nc.close()
    finally:
        server.stop()


async def test_a_registration_anew_racing_a_removal_on_another_replica_keeps_its_clock(nats_url, nc, prefix):
    """Replica B beats for a registration, replica A removes the worker (reading B's beat as the
    key's last entry) and puts its tombstone over it, and B's registration is then decided on the
    removed worker: a new life. Its one beat was wiped: the worker was never found LOST, resumes
    placed on a worker gone (the review's run: 108 of 150 such lives). B beats again once the new
    life is written: the silent worker is removed LOST within its TTL."""
    from events.schema import RegisterOutcome, RemoveWorker

    async with running_registry(nats_url, prefix, ttl_s=1) as a, running_registry(nats_url, prefix, ttl_s=1) as b:
        reply, _ = await raw_request(nc, prefix, "register", "w-1", registration("w-1"))
        assert reply["outcome"] == "REGISTERED"
        beaten, go = asyncio.Event(), asyncio.Event()
        beat = b.liveness.beat

        async def beat_then_wait(worker_id: str) -> None:  # B's first beat, then its decision held
            await beat(worker_id)
            if not beaten.is_set():
                beaten.set()
                await go.wait()

        b.liveness.beat = beat_then_wait
        registering = asyncio.create_task(b.register("w-1", msgspec.convert(registration("w-1"), RegisterWorker)))
        await finished(beaten.wait())
        removed = await a.remove("w-1", RemoveWorker(reason="operator"))
        assert await a.liveness.state("w-1") == "absent"  # A's tombstone over B's beat
        go.set()
        again = await finished(registering)
        assert again.outcome is RegisterOutcome.REGISTERED and again.seq > removed.seq
        assert await a.liveness.state("w-1") == "beating"  # the new life's clock runs
        _, lost = await wait_event(nc, prefix, "w-1", WorkerRemoved, after=again.seq)
        assert lost.reason == "LOST"


async def test_a_replica_starting_gives_a_clock_to_a_registered_worker_under_a_tombstone(nats_url, nc, prefix):
    """A registered worker whose heartbeat key ends in a tombstone (a removal's purge that won a race
    with its next life) has no clock. A replica's start gives every registered worker without one a
    clock; it expected an empty key, so the put was refused over the tombstone, silently."""
    async with running_registry(nats_url, prefix, ttl_s=300) as a:
        reply, _ = await raw_request(nc, prefix, "register", "w-1", registration("w-1"))
        assert await a.liveness.forget("w-1", await a.liveness.last_entry("w-1"))  # the tombstone, alone
        assert await a.liveness.state("w-1") == "absent" and await a.liveness.last_entry("w-1") > 0
    async with running_registry(nats_url, prefix, ttl_s=1) as b:
        assert await b.liveness.state("w-1") == "beating"  # reconciled at its start
        _, lost = await wait_event(nc, prefix, "w-1", WorkerRemoved, after=reply["seq"])
        assert lost.reason == "LOST"


async def registration_held(stalled, request: RegisterWorker) -> tuple[asyncio.Task, asyncio.Event]:
    """`request` sent to the registry replica `stalled`, whose decision of it waits until the event
    returned is set (a replica that stalled on it): the task answers it then."""
    go, held = asyncio.Event(), asyncio.Event()
    decide = stalled.store.register

    async def held_back(held_request, at, *paid_with):
        held.set()
        await go.wait()
        return await decide(held_request, at, *paid_with)

    stalled.store.register = held_back
    late = asyncio.create_task(stalled.register(request.worker_id, request))
    await finished(held.wait())
    return late, go


@pytest.mark.parametrize("first_answer", ["REGISTERED", "UNCHANGED"])
async def test_a_registration_of_an_earlier_life_decided_late_is_refused(nats_url, nc, prefix, first_answer):
    """A replica stalls on a copy of registration R1 (the agent's first send; its retry was answered
    elsewhere). Meanwhile the machine's CPU changes: the worker is removed and registered anew with
    R2. The late copy was a new request of the new life: RuntimeChanged back to R1's CPU, which the
    machine no longer has (the review's run). Its id was used in the earlier life (recorded in its
    history, or, for a registration that changed nothing, in the reply cache): refused, field
    request_id, nothing written; the worker keeps R2."""
    from events.schema import RegisterOutcome, RemoveWorker
    from tests.registry_helpers import runtime

    def reg(asset: str, rid: str) -> RegisterWorker:
        return msgspec.convert(registration("w-1", default=runtime(asset), request_id=rid), RegisterWorker)

    async with running_registry(nats_url, prefix) as a, running_registry(nats_url, prefix) as stalled:
        r1 = reg("cpu-x", "agent-1")
        if first_answer == "REGISTERED":
            assert (await a.register("w-1", r1)).outcome is RegisterOutcome.REGISTERED
        else:  # life 1 began with another id; R1 said the same again: kept in the reply cache
            await a.register("w-1", reg("cpu-x", "agent-0"))
            assert (await a.register("w-1", r1)).outcome is RegisterOutcome.UNCHANGED
        late, go = await registration_held(stalled, r1)
        await a.remove("w-1", RemoveWorker(reason="its CPU changed"))
        second = await a.register("w-1", reg("cpu-y", "agent-2"))
        assert second.outcome is RegisterOutcome.REGISTERED
        before = await last_seq(nc, prefix)
        go.set()
        with pytest.raises(ContractError) as refused:
            await finished(late)
        assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "request_id")
        assert "was used in an earlier life of worker 'w-1'" in refused.value.message
        assert await last_seq(nc, prefix) == before
        worker = await a.store.load("w-1")
        attrs = {x.key: x.value for x in worker.sandbox_classes[0].default_runtime.version.attributes}
        assert attrs["gvisor_asset_hash"] == "cpu-y"
        assert (await a.register("w-1", reg("cpu-y", "agent-2"))).outcome is RegisterOutcome.REGISTERED  # its own: answered


@pytest.mark.parametrize("then", ["unchanged", "changed", "removed"])
async def test_an_older_registration_decided_late_is_refused_by_its_revision(nats_url, nc, prefix, then):
    """A replica stalls on registration R1 (CPU x, revision 100) and decides it after a newer one.
    - unchanged: R1 was an edit its agent never saw answered; the agent restarted (a rolling
      upgrade) and its new process registered what the registry already had (CPU y). That wrote
      nothing, so R1 was then applied: RuntimeChanged to a CPU the machine no longer has.
    - changed: the new process registered CPU z; R1, a new id, was applied over it.
    - removed: R1 was answered (its retry, elsewhere), then R2 (CPU y) changed it, and the worker
      was removed: R1's copy started the next life with CPU x (an earlier life's id may start a life).
    Each time R1 is older than what the history holds: refused, field revision, nothing written,
    and the worker keeps CPU y (or z)."""
    from events.schema import RegisterOutcome, RemoveWorker
    from tests.registry_helpers import runtime

    def reg(asset: str, rid: str, revision: int) -> RegisterWorker:
        return msgspec.convert(registration("w-1", default=runtime(asset), request_id=rid, revision=revision),
                               RegisterWorker)

    async with running_registry(nats_url, prefix) as a, running_registry(nats_url, prefix) as stalled:
        r1 = reg("cpu-x", "agent-p1-2", 100)
        if then == "removed":
            assert (await a.register("w-1", r1)).outcome is RegisterOutcome.REGISTERED
        else:
            await a.register("w-1", reg("cpu-y", "agent-p1-1", 50))
        late, go = await registration_held(stalled, r1)
        if then == "unchanged":
            newer = await a.register("w-1", reg("cpu-y", "agent-p2-1", 200))
            assert newer.outcome is RegisterOutcome.UPDATED  # the revision is written
            kept = "cpu-y"
        elif then == "changed":
            newer = await a.register("w-1", reg("cpu-z", "agent-p2-1", 200))
            assert newer.outcome is RegisterOutcome.RUNTIME_CHANGED
            kept = "cpu-z"
        else:
            assert (await a.register("w-1", reg("cpu-y", "agent-p1-3", 200))).outcome is RegisterOutcome.RUNTIME_CHANGED
            await a.remove("w-1", RemoveWorker(reason="LOST"))
            kept = "cpu-y"
        before = await last_seq(nc, prefix)
        go.set()
        with pytest.raises(ContractError) as refused:
            await finished(late)
        assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "revision")
        assert "revision 100 is not above 200" in refused.value.message
        assert await last_seq(nc, prefix) == before
        worker = await a.store.load("w-1")
        attrs = {x.key: x.value for x in worker.sandbox_classes[0].default_runtime.version.attributes}
        assert attrs["gvisor_asset_hash"] == kept and worker.revision == 200


def revised(asset: str, rid: str, revision: int | None) -> RegisterWorker:
    body = registration("w-1", default=runtime(asset), request_id=rid)
    return msgspec.convert({**body, "revision": revision}, RegisterWorker)


@pytest.mark.parametrize("first_answer", ["REGISTERED", "UNCHANGED"])
@pytest.mark.parametrize("life2_revision", [None, 120])
async def test_a_late_copy_whose_revision_the_earlier_life_never_recorded_is_refused(
        nats_url, nc, prefix, first_answer, life2_revision):
    """Life 1: an agent deriving ids from its configuration registers cfg-1 (CPU x, revision 100).
    It restarts and sends cfg-1 again at its new revision 150: a copy stalls on one replica, the
    retry is answered from life 1 (replay / kept answer), so 150 is never recorded. The worker is
    removed (its CPU changed) and life 2 is registered by a sender without revisions (or with a
    lower one). The stalled copy (cfg-1, 150) is then decided: refused, its id an earlier life's.
    A revision above every recorded one cannot tell a new request from it, since an answered
    revision need not be recorded (a review refused 107963e, which took it so)."""
    async with running_registry(nats_url, prefix) as a, running_registry(nats_url, prefix) as stalled:
        if first_answer == "REGISTERED":
            first = await a.register("w-1", revised("cpu-x", "cfg-1", 100))
            assert first.outcome is RegisterOutcome.REGISTERED
        else:
            await a.register("w-1", revised("cpu-x", "cfg-0", 100))
            first = await a.register("w-1", revised("cpu-x", "cfg-1", 100))
            assert first.outcome is RegisterOutcome.UNCHANGED
        copy = revised("cpu-x", "cfg-1", 150)
        late, go = await registration_held(stalled, copy)
        retry = await a.register("w-1", copy)  # answered from life 1: nothing recorded at 150
        assert (retry.outcome, retry.seq) == (first.outcome, first.seq)
        assert (await a.store.load("w-1")).revision == 100
        await a.remove("w-1", RemoveWorker(reason="its CPU changed"))
        second = await a.register("w-1", revised("cpu-y", "cfg-2", life2_revision))
        assert second.outcome is RegisterOutcome.REGISTERED
        before = await last_seq(nc, prefix)
        go.set()
        try:
            outcome = (await finished(late)).outcome
        except ContractError as refused:
            outcome = (refused.code, refused.field)
        worker = await a.store.load("w-1")
        attrs = {x.key: x.value for x in worker.sandbox_classes[0].default_runtime.version.attributes}
        assert (outcome, attrs["gvisor_asset_hash"]) == ((ErrorCode.FAILED_PRECONDITION, "request_id"), "cpu-y")
        assert await last_seq(nc, prefix) == before


# --- a cancellation swallowed inside a loop of the replica -------------------------------------------


async def test_a_replica_stops_though_its_loops_swallowed_their_cancellation(nats_url, prefix):
    """Python 3.11's asyncio.wait_for, inside every nats-py request, can swallow a cancellation (its
    future done as the task is cancelled). The look for workers on nodes their binding does not give
    them, and the reconciliation's loop, went back to their waits: `stop` waited for them for ever
    (a test hung so, 2026-12-05); so did the watch of the stream's incarnation. Here all three swallow
    it as wait_for can; the replica still stops."""
    async with running_registry(nats_url, prefix, reconcile_interval_s=0.05) as registry:
        inside = {"look": asyncio.Event(), "round": asyncio.Event(), "watch": asyncio.Event()}

        def swallowing(name: str):
            async def call(*args, **kwargs) -> None:
                inside[name].set()
                try:
                    await asyncio.Event().wait()  # until cancelled
                except asyncio.CancelledError:
                    return  # as wait_for returns a result that came as it was cancelled
            return call

        registry.binding.refresh = swallowing("look")
        registry.reconcile = swallowing("round")
        registry.watch.look = swallowing("watch")  # its next look, within INCARNATION_CHECK_S
        registry._binding_moved.set()
        for event in inside.values():
            await asyncio.wait_for(event.wait(), 10)
        await asyncio.wait_for(registry.stop(), 10)


async def test_a_round_that_fails_alike_every_time_logs_its_traceback_once(nats_url, prefix, caplog):
    """A bug in the reconciliation logged its traceback every round (once a second by default): the
    same failure again is one line naming it; another failure's traceback is logged."""
    caplog.set_level(logging.ERROR, logger="warmboot.registry")
    async with running_registry(nats_url, prefix, reconcile_interval_s=0.05) as registry:
        rounds = {"n": 0}
        done = asyncio.Event()

        async def failing() -> None:
            rounds["n"] += 1
            if rounds["n"] == 7:
                done.set()
            raise RuntimeError("bug a" if rounds["n"] <= 3 else "bug b" if rounds["n"] <= 5 else "bug a")

        registry.reconcile = failing
        await asyncio.wait_for(done.wait(), 30)
    said = [r for r in caplog.records if "reconciling heartbeats" in r.getMessage()][:7]
    failed = (True, "reconciling heartbeats failed")
    again = "reconciling heartbeats still fails (RuntimeError: {}, traceback above)"
    assert [(r.exc_info is not None, r.getMessage().split(";")[0]) for r in said] == [
        failed, (False, again.format("bug a")), (False, again.format("bug a")),  # rounds 1-3: a
        failed, (False, again.format("bug b")),  # rounds 4-5: b
        failed, (False, again.format("bug a")),  # rounds 6-7: a again, after b
    ]
