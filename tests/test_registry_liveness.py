"""Heartbeats answered from the registry's roster, a fold of worker events, behind its barrier.

A replica answers a heartbeat from its in-memory roster once the roster holds every
worker event stored before the heartbeat, whichever replica wrote it; a worker the
roster does not have is looked up in the log. These tests run two replicas on the
session's nats-server and ask one of them directly (a client cannot pick a replica
through the queue group) right after the other wrote.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from contextlib import suppress

import msgspec
import nats.errors
import pytest
from nats.js.api import PersistMode

import services.registry.liveness as liveness_module
from events.errors import ContractError, unavailable
from events.schema import ErrorCode, Heartbeat, RemoveWorker, WorkerRemoved
from events.subjects import bucket_name
from services.registry.roster import Roster
from tests.proxy import LosingProxy
from tests.registry_helpers import body, raw_request, registration, running_registry, wait_event, worker_events


async def refused(call) -> ContractError:
    with pytest.raises(ContractError) as caught:
        await call
    return caught.value


# --- the fold itself ---------------------------------------------------------------------------


def test_roster_follows_each_life():
    roster = Roster()
    roster.apply(1, "w-1", "WorkerRegistered")
    roster.apply(2, "w-2", "WorkerRegistered")
    roster.apply(3, "w-1", "WorkerDrained")
    assert roster.alive("w-1") and roster.last_seq("w-1") == 3
    roster.apply(4, "w-1", "WorkerRemoved")
    assert not roster.alive("w-1") and roster.last_seq("w-1") == 0  # nothing kept of a removed worker
    assert sorted(roster.registered()) == ["w-2"]
    roster.apply(5, "w-1", "WorkerRegistered")  # a new life
    roster.apply(6, "w-1", "RuntimeChanged")
    assert roster.alive("w-1") and sorted(roster.registered()) == ["w-1", "w-2"]
    assert not roster.alive("w-never") and roster.last_seq("w-never") == 0
    assert roster.seq == 6 and len(roster) == 2


# --- answers across replicas -------------------------------------------------------------------


async def test_a_removal_through_another_replica_is_not_found_at_once(nats_url, prefix):
    async with running_registry(nats_url, prefix) as one, running_registry(nats_url, prefix) as two:
        for life in range(8):
            await two.register("w-1", body("w-1"))
            assert (await one.heartbeat("w-1", Heartbeat())).ttl_s == 15.0
            await two.remove("w-1", RemoveWorker(reason=f"life {life}"))
            error = await refused(one.heartbeat("w-1", Heartbeat()))
            assert error.code == ErrorCode.NOT_FOUND and f"was removed (life {life})" in error.message


async def test_a_registration_through_another_replica_beats_at_once(nats_url, prefix):
    async with running_registry(nats_url, prefix) as one, running_registry(nats_url, prefix) as two:
        for n in range(8):
            worker_id = f"w-{n}"
            await two.register(worker_id, body(worker_id))
            assert (await one.heartbeat(worker_id, Heartbeat())).ttl_s == 15.0
        error = await refused(one.heartbeat("w-never", Heartbeat()))
        assert error.code == ErrorCode.NOT_FOUND and "not registered" in error.message


async def test_a_replica_whose_fold_stalls_answers_from_the_log(nats_url, prefix):
    async with running_registry(nats_url, prefix) as one, running_registry(nats_url, prefix) as two:
        await two.register("w-gone", body("w-gone"))
        await two.register("w-kept", body("w-kept"))
        await one.heartbeat("w-gone", Heartbeat())  # one's roster has both
        one.fold.barrier_timeout = 0.2
        await one.fold._sub.unsubscribe()  # one hears of no worker event from now on
        await two.remove("w-gone", RemoveWorker(reason="decommissioned"))
        # one's barrier cannot be had (the removal never reaches its fold): the log answers
        error = await refused(one.heartbeat("w-gone", Heartbeat()))
        assert error.code == ErrorCode.NOT_FOUND and "was removed (decommissioned)" in error.message
        assert (await one.heartbeat("w-kept", Heartbeat())).ttl_s == 15.0


async def test_a_heartbeat_waiting_for_the_fold_is_answered_once_the_event_is_folded(nats_url, prefix):
    """docs/registry.md, "Who may beat": a worker registered a moment ago through another replica beats
    at once; the barrier waits until the fold has delivered the worker's last event, and answers from
    the roster as soon as it has. Here the fold of `one` is held back until the barrier is waiting for
    w-1's registration, then let go: the heartbeat is answered then, not after the barrier gives up
    (its time-out set to a minute here: a round that missed the event would hang, rather than fall
    back on the log). Kills the mutant of `RosterFold._on_msg` whose delivery of the awaited event
    itself does not release the barrier (only a later worker event did)."""
    async with running_registry(nats_url, prefix) as one, running_registry(nats_url, prefix) as two:
        one.fold.barrier_timeout = 60.0
        sub = one.fold._sub._sub  # nats-py's subscription under the push one: its callback folds
        release, asked = asyncio.Event(), asyncio.Event()
        deliver, next_worker_event = sub._cb, one.fold._next_worker_event

        async def held_back(msg) -> None:  # one's fold, delivering nothing until released
            await release.wait()
            await deliver(msg)

        async def asking(start, timeout, patient=False):
            seq = await next_worker_event(start, timeout, patient)
            asked.set()  # the round waits for `seq` to be folded as soon as it resumes
            return seq

        sub._cb, one.fold._next_worker_event = held_back, asking
        registered = await two.register("w-1", body("w-1"))
        beat = asyncio.ensure_future(one.heartbeat("w-1", Heartbeat()))
        await asyncio.wait_for(asked.wait(), 10)
        assert one.fold.complete < registered.seq and not beat.done()  # the barrier waits for the fold
        sub._cb = deliver
        release.set()
        done, _ = await asyncio.wait({beat}, timeout=10)
        assert done, "the heartbeat still waits on the barrier after the fold delivered w-1's registration"
        assert beat.result().ttl_s == 15.0 and one.roster.alive("w-1")


async def test_a_beat_answered_from_the_log_keeps_alive_only_the_registration_it_names(nats_url, prefix):
    """Answered from the worker's history (the replica's fold stalled: its barrier cannot be had), a
    beat naming another revision than the registration in force is refused as the roster refuses it
    (FAILED_PRECONDITION on revision): another machine registered w-t since, and the first machine's
    beats kept that one alive, its CPU with it, through this replica (the check was the roster's alone)."""
    async with running_registry(nats_url, prefix) as one, running_registry(nats_url, prefix) as two:
        await two.register("w-t", msgspec.structs.replace(body("w-t"), revision=100))
        assert (await one.heartbeat("w-t", Heartbeat(revision=100))).ttl_s == 15.0  # one's roster has it
        one.fold.barrier_timeout = 0.2
        await one.fold._sub.unsubscribe()  # one hears of no worker event from now on
        another_cpu = msgspec.structs.replace(body("w-t"), revision=200, labels={"machine": "second"})
        await two.register("w-t", another_cpu)
        error = await refused(one.heartbeat("w-t", Heartbeat(revision=100)))
        assert (error.code, error.field) == (ErrorCode.FAILED_PRECONDITION, "revision"), error
        assert "registration in force is revision 200, not 100" in error.message
        assert (await one.heartbeat("w-t", Heartbeat(revision=200))).ttl_s == 15.0
        assert (await one.heartbeat("w-t", Heartbeat())).ttl_s == 15.0  # a beat naming none: as before
        # registered without a revision since: nothing to tell beats apart by
        await two.register("w-t", msgspec.structs.replace(body("w-t"), labels={"machine": "third"}))
        assert (await one.heartbeat("w-t", Heartbeat(revision=100))).ttl_s == 15.0


async def test_concurrent_heartbeats_share_barrier_rounds(nats_url, prefix):
    async with running_registry(nats_url, prefix) as one:
        workers = [f"w-{n}" for n in range(50)]
        for worker_id in workers:
            await one.register(worker_id, body(worker_id))
        rounds = one.fold.rounds
        replies = await asyncio.gather(*(one.heartbeat(w, Heartbeat()) for w in workers * 4))
        assert {r.ttl_s for r in replies} == {15.0}
        assert one.fold.rounds - rounds <= 2  # 200 heartbeats, one or two reads of the stream's state


async def test_a_started_replica_has_every_registered_worker(nats_url, nc, prefix):
    async with running_registry(nats_url, prefix):
        for n in range(5):
            assert "error" not in (await raw_request(nc, prefix, "register", f"w-{n}", registration(f"w-{n}")))[0]
        await raw_request(nc, prefix, "remove", "w-0", {})
    async with running_registry(nats_url, prefix) as later:
        assert sorted(later.roster.registered()) == ["w-1", "w-2", "w-3", "w-4"]
        for n in range(1, 5):
            assert (await raw_request(nc, prefix, "heartbeat", f"w-{n}", {}))[0] == {"ttl_s": 15.0, "drained": None}
        reply, _ = await raw_request(nc, prefix, "heartbeat", "w-0", {})
        assert reply["error"]["code"] == "NOT_FOUND"


# --- the put behind the reply ----------------------------------------------------------------------


async def test_a_heartbeat_answers_once_its_put_is_stored(nats_url, nc, prefix):
    async with running_registry(nats_url, prefix):
        await raw_request(nc, prefix, "register", "w-1", registration("w-1"))
        js = nc.jetstream()
        stream = f"KV_{bucket_name(prefix, 'heartbeats')}"
        before = (await js.stream_info(stream)).state.last_seq
        assert (await raw_request(nc, prefix, "heartbeat", "w-1", {}))[0] == {"ttl_s": 15.0, "drained": None}
        entry = await js.get_msg(stream, subject=f"$KV.{bucket_name(prefix, 'heartbeats')}.w-1")
        assert entry.seq > before and entry.headers["Nats-TTL"] == "15s"
        assert msgspec.json.decode(entry.data)["ttl_s"] == 15.0

        await js.delete_stream(stream)  # the bucket is gone: no put can be stored
        reply, headers = await raw_request(nc, prefix, "heartbeat", "w-1", {})
        assert reply["error"]["code"] == "UNAVAILABLE", reply
        assert headers["Nats-Service-Error-Code"] == "503"


async def test_the_bucket_s_puts_are_not_synced_and_its_stream_is_the_one_nats_py_makes(nats_url, nc, prefix):
    """The heartbeat bucket's stream is made unsynced (`persist_mode: async`): the embedded server syncs
    every write before its ack, which cost a fifth of the heartbeats a registry answers (docs/operations.md,
    Durability). Apart from the mode, the stream is the one nats-py's `create_key_value` makes of the same
    bucket configuration (the mode goes through nats-py's own code)."""
    js = nc.jetstream()
    async with running_registry(nats_url, prefix) as registry:
        made = (await js.stream_info(registry.liveness.stream)).config
        twin = dataclasses.replace(registry.liveness.bucket_config(), bucket=f"{registry.liveness.bucket}_twin")
        await js.create_key_value(twin)
        try:
            plain = (await js.stream_info(f"KV_{twin.bucket}")).config
        finally:
            await js.delete_key_value(twin.bucket)
    assert made.persist_mode == PersistMode.ASYNC
    assert plain.persist_mode is None  # nats-py's own: the server's default, synced
    assert (made.name, made.subjects) == (registry.liveness.stream, [f"$KV.{registry.liveness.bucket}.>"])
    def ours(config) -> dict:  # less the metadata the server keeps of itself (`_nats.req.level` differs)
        fields = config.as_dict()
        fields["metadata"] = {k: v for k, v in (fields.get("metadata") or {}).items() if not k.startswith("_nats.")}
        return fields

    differs = {key for key, value in ours(made).items() if ours(plain).get(key) != value}
    assert differs == {"persist_mode", "name", "subjects"}, differs


async def test_a_synced_bucket_of_an_earlier_version_is_used_said_and_made_anew_as_the_docs_say(
        nats_url, nc, prefix, caplog):
    """An upgrade: the bucket an earlier version made, synced (a stream's mode cannot change), is used as
    it is, beats and expiries alike, and the registry says so once at its start, with what to do.
    Done as said (every replica stopped, the bucket deleted, one started), the bucket is made unsynced,
    and a worker registered before keeps beating: its clock started again by the start's reconciliation."""
    caplog.set_level(logging.WARNING, logger="warmboot.registry")
    js = nc.jetstream()
    bucket = bucket_name(prefix, "heartbeats")
    stream = f"KV_{bucket}"
    earlier = liveness_module.Liveness(nc, prefix, ttl_s=15, on_expired=None).bucket_config()
    await js.create_key_value(earlier)  # as the earlier version made it: nats-py's, synced
    async with running_registry(nats_url, prefix, ttl_s=300):
        said = [r.getMessage() for r in caplog.records if "persist mode" in r.getMessage()]
        assert said == [f"the bucket {bucket} was made with persist mode default (by an earlier version): where the "
                        f"server syncs every write (`sync_interval: always`), each heartbeat waits for its sync; to "
                        f"make it anew, stop every registry replica, delete the bucket (`nats kv del {bucket}`) and "
                        f"start them again (docs/operations.md, Durability)"], said
        assert (await js.stream_info(stream)).config.persist_mode is None  # left as it was
        assert "error" not in (await raw_request(nc, prefix, "register", "w-live", registration("w-live")))[0]
        assert (await raw_request(nc, prefix, "heartbeat", "w-live", {}))[0] == {"ttl_s": 300.0, "drained": None}
    async with running_registry(nats_url, prefix, ttl_s=1):  # expiries work on it too
        reply, _ = await raw_request(nc, prefix, "register", "w-silent", registration("w-silent"))
        _, removed = await wait_event(nc, prefix, "w-silent", WorkerRemoved, after=reply["seq"], timeout=30)
        assert removed.reason == "LOST"

    await js.delete_key_value(bucket)  # the docs' `nats kv del`, every replica stopped
    caplog.clear()
    async with running_registry(nats_url, prefix, ttl_s=300) as registry:
        assert (await js.stream_info(stream)).config.persist_mode == PersistMode.ASYNC
        assert not [r for r in caplog.records if "persist mode" in r.getMessage()]
        assert sorted(registry.roster.registered()) == ["w-live"]
        state, _ = await registry.liveness.entry("w-live")
        assert state == "beating", state  # its clock, started again by the start's reconciliation
        assert (await raw_request(nc, prefix, "heartbeat", "w-live", {}))[0] == {"ttl_s": 300.0, "drained": None}


async def test_the_sweep_acknowledges_every_heartbeat_put_all_at_once(nats_url, nc, prefix):
    """The sweep's consumer gets every put of the bucket (only the server's expiry markers
    matter to it) and acknowledges them all at once (`AckPolicy.ALL`): now and then, the newest
    delivery, which acknowledges every one before it. The acks are read on the bus, in the order
    they are sent: the last put's is among them, each is past the one before, nothing was
    delivered again (no ack wait ran out), and there were fewer acks than deliveries. (The
    consumer's own ack floor is not read: the server applies an ack after routing it, so a
    read right after could come first.)"""
    from events.natspy.publish import flush_in_order
    from services.registry.liveness import SWEEPER

    stream = f"KV_{bucket_name(prefix, 'heartbeats')}"
    acked: list[int] = []  # the stream sequence of each ack
    last_put = 0
    last_acked = asyncio.Event()

    async def ack(msg) -> None:
        acked.append(int(msg.subject.split(".")[5]))  # $JS.ACK.<stream>.<consumer>.<n>.<stream seq>...
        if acked[-1] == last_put:
            last_acked.set()

    spy = await nc.subscribe(f"$JS.ACK.{stream}.{SWEEPER}.>", cb=ack)
    await flush_in_order(nc)
    async with running_registry(nats_url, prefix) as one:
        workers = [f"w-{n}" for n in range(40)]
        for worker_id in workers:
            await one.register(worker_id, body(worker_id))
        await asyncio.gather(*(one.heartbeat(w, Heartbeat()) for w in workers * 10))
        js = nc.jetstream()
        last_put = (await js.stream_info(stream)).state.last_seq
        if last_put in acked:
            last_acked.set()
        await asyncio.wait_for(last_acked.wait(), 30)
        assert acked == sorted(set(acked))  # each ack past the one before
        info = await js.consumer_info(stream, SWEEPER)
        assert info.delivered.stream_seq == last_put and info.num_redelivered == 0
        assert len(acked) < info.delivered.consumer_seq, (len(acked), info.delivered.consumer_seq)
    await spy.unsubscribe()


async def test_replies_match_answers_and_give_up_on_silence(nc, prefix):
    """The request multiplexer the heartbeat acks ride on: answers reach their own caller,
    nobody listening is NoResponders, silence is a time-out, and it serves on after one."""
    import nats.errors

    from events.natspy.publish import Replies

    async def echo(msg) -> None:
        if msg.data != b"quiet":
            await nc.publish(msg.reply, b"re:" + msg.data)

    sub = await nc.subscribe(f"{prefix}.echo", cb=echo)
    # Patient where an answer is awaited (0.3 s left 50 echoes little room under the suite's load), short where
    # silence is: the time-out is read at each request and each sweep
    replies = await Replies(nc, timeout=10.0).start()
    try:
        answers = await asyncio.gather(*(replies.request(f"{prefix}.echo", str(n).encode()) for n in range(50)))
        assert [a.data for a in answers] == [f"re:{n}".encode() for n in range(50)]
        with pytest.raises(nats.errors.NoRespondersError):
            await replies.request(f"{prefix}.nobody", b"x")
        replies.timeout = 0.3
        with pytest.raises(nats.errors.TimeoutError):
            await replies.request(f"{prefix}.echo", b"quiet")
        replies.timeout = 10.0
        assert (await replies.request(f"{prefix}.echo", b"after")).data == b"re:after"
        replies.timeout = 0.3

        # A caller cancelled while it waits (a time-out of its own) leaves nothing behind: no
        # "exception was never retrieved" when its request expires, and no entry kept.
        import gc

        loop = asyncio.get_running_loop()
        unretrieved: list[dict] = []
        loop.set_exception_handler(lambda _, context: unretrieved.append(context))
        try:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(replies.request(f"{prefix}.echo", b"quiet"), 0.05)
            with pytest.raises(nats.errors.TimeoutError):  # by its end the first has expired too
                await replies.request(f"{prefix}.echo", b"quiet")
            gc.collect()
            assert unretrieved == [] and replies._pending == {}
        finally:
            loop.set_exception_handler(None)
    finally:
        await replies.stop()
        await sub.unsubscribe()


# --- a silent worker is found LOST whatever became of its clock (found by an audit) --------------------------


async def test_a_marker_whose_removal_failed_for_its_whole_life_still_ends_the_silent_worker(
        nats_url, nc, prefix, monkeypatch):
    """The sweep hands back a marker whose removal fails (the event log unavailable) and is given it
    again a second later, until the server deletes the marker (MARKER_TTL_S: 300 s, 2 s here). Then the
    key holds nothing, and no marker would ever come again: the silent worker stayed registered for
    good. Each replica reconciles while it runs now, so the worker's clock starts again and its next
    marker removes it. Here every removal fails while the first marker lives."""
    monkeypatch.setattr(liveness_module, "MARKER_TTL_S", 2.0)  # read as the bucket is made
    async with running_registry(nats_url, prefix, ttl_s=1, reconcile_interval_s=1.0) as registry:
        lose, first, refused = registry.store.lose, [], []

        async def unavailable_for_the_first_marker(worker_id, at):
            _, marker = await registry.liveness.entry(worker_id)
            first[:] = first or [marker]
            if marker == first[0]:
                refused.append(marker)
                raise unavailable("the event log is unavailable (the test's outage: the first marker's life)")
            return await lose(worker_id, at)

        registry.store.lose = unavailable_for_the_first_marker
        reply, _ = await raw_request(nc, prefix, "register", "w-1", registration("w-1"))
        assert reply["outcome"] == "REGISTERED"
        _, removed = await wait_event(nc, prefix, "w-1", WorkerRemoved, after=reply["seq"], timeout=30)
        assert removed.reason == "LOST" and refused, refused
        _, marker = await registry.liveness.entry("w-1")
        assert marker != first[0]  # removed on a marker of a clock started again


async def test_a_marker_lost_with_the_pinned_replica_s_connection_is_found_before_the_next_ack(
        nats_server, nc, prefix):
    """The chunk that carries a silent worker's expiry marker to the pinned replica is lost with its
    connection; nats-py reconnects within the pin's time-out, so the replica keeps its pin, and the
    server counts the marker delivered. The next delivery (another worker's beat) shows the gap in the
    consumer's sequence: the replica reconciles before it acknowledges past the marker, and the worker
    is removed LOST at once, once. Before (found by an audit) that ack acknowledged the marker unhandled,
    and only the next periodic round (5 minutes here, 100 s by default) found the worker."""
    async with LosingProxy(nats_server.port) as proxy, \
            running_registry(nats_server.url, prefix, ttl_s=2, reconcile_interval_s=300, via=proxy.url):
        reply, _ = await raw_request(nc, prefix, "register", "w-live", registration("w-live"))
        assert reply["outcome"] == "REGISTERED"
        beating = asyncio.Event()

        async def beat() -> None:  # the deliveries after the marker, one of which the replica acknowledges
            while True:
                # while the replica reconnects its service is away (no responders), or the request was
                # lost with the connection (no answer): beat on, as an agent does
                with suppress(nats.errors.NoRespondersError, nats.errors.TimeoutError):
                    await raw_request(nc, prefix, "heartbeat", "w-live", {}, timeout=1.0)
                    beating.set()
                await asyncio.sleep(0.2)  # the agents' beat period here, a load, not a wait for anything

        beats = asyncio.create_task(beat())
        try:
            await asyncio.wait_for(beating.wait(), 10)
            proxy.lose(b"MaxAge")  # the marker's reason header: only a marker's delivery holds it
            reply, _ = await raw_request(nc, prefix, "register", "w-silent", registration("w-silent"))
            registered = reply["seq"]
            await asyncio.wait_for(proxy.lost.wait(), 20)
            # well within the consumer's ack wait (30 s), had nothing acknowledged the marker
            _, removed = await wait_event(nc, prefix, "w-silent", WorkerRemoved, after=registered, timeout=20)
            assert removed.reason == "LOST"
        finally:
            beats.cancel()
            with suppress(asyncio.CancelledError):
                await beats
        removals = [e for _, e in await worker_events(nc, prefix, "w-silent") if isinstance(e, WorkerRemoved)]
        assert len(removals) == 1


async def test_the_sweep_s_consumer_deleted_is_made_again_and_the_silent_worker_found_lost(nats_url, nc, prefix):
    """The replicas share one durable consumer of the heartbeat bucket; deleted (by hand, or lost with
    its group on a cluster) it was never made again, and no silent worker was removed LOST until a
    replica restarted. A replica's reconciliation makes it again, and finds the marker written while it
    was gone."""
    async with running_registry(nats_url, prefix, ttl_s=1, reconcile_interval_s=1.0):
        stream = f"KV_{bucket_name(prefix, 'heartbeats')}"
        js = nc.jetstream()
        await js.delete_consumer(stream, liveness_module.SWEEPER)
        reply, _ = await raw_request(nc, prefix, "register", "w-1", registration("w-1"))
        _, removed = await wait_event(nc, prefix, "w-1", WorkerRemoved, after=reply["seq"], timeout=30)
        assert removed.reason == "LOST"
        assert (await js.consumer_info(stream, liveness_module.SWEEPER)).config.durable_name == liveness_module.SWEEPER


async def test_an_earlier_version_s_sweep_consumer_is_replaced_by_a_pinned_one(nats_url, nc, prefix):
    """An upgrade: the bucket's sweep consumer is the earlier version's (each put acknowledged on its
    own, no priority group), which the server cannot change. The first replica of this version
    deletes it and makes it anew, pinned and acknowledged all at once, and its sweep finds a silent
    worker LOST; a pull of the earlier version's kind (no group) is refused by the server."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    js = nc.jetstream()
    bucket = bucket_name(prefix, "heartbeats")
    stream = f"KV_{bucket}"
    async with running_registry(nats_url, prefix):  # the bucket, as the earlier version made it too
        pass
    await js.delete_consumer(stream, liveness_module.SWEEPER)
    await js.add_consumer(stream, ConsumerConfig(
        durable_name=liveness_module.SWEEPER, filter_subject=f"$KV.{bucket}.>", deliver_policy=DeliverPolicy.NEW,
        ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0, headers_only=True, max_ack_pending=-1))
    async with running_registry(nats_url, prefix, ttl_s=1):
        info = json.loads((await nc.request(f"$JS.API.CONSUMER.INFO.{stream}.{liveness_module.SWEEPER}", b"")).data)
        assert info["config"]["ack_policy"] == "all", info
        assert info["config"]["priority_policy"] == "pinned_client", info
        reply, _ = await raw_request(nc, prefix, "register", "w-1", registration("w-1"))
        _, removed = await wait_event(nc, prefix, "w-1", WorkerRemoved, after=reply["seq"], timeout=30)
        assert removed.reason == "LOST"
        old_kind = await nc.request(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{liveness_module.SWEEPER}",
                                    json.dumps({"batch": 1, "expires": int(1e9)}).encode(), timeout=5)
        assert old_kind.headers and old_kind.headers.get("Status") == "400", old_kind.headers


async def test_a_clock_whose_put_failed_at_start_is_started_again(nats_url, nc, prefix, monkeypatch, caplog):
    """At start a replica starts a clock for a registered worker whose key holds none; that put failing
    (a time-out in an election of the bucket's leader) was swallowed, and the worker had no clock for
    good: never found LOST. Only a beat that came first is let go now: the failure is said, and the
    next round starts the clock."""
    caplog.set_level(logging.WARNING, logger="warmboot.registry")
    async with running_registry(nats_url, prefix, ttl_s=300) as first:
        reply, _ = await raw_request(nc, prefix, "register", "w-1", registration("w-1"))
        assert await first.liveness.forget("w-1", await first.liveness.last_entry("w-1"))  # no clock now
    start_clock, failed = liveness_module.Liveness.start_clock, []

    async def lost_in_an_election_once(self, worker_id, after=0):
        if failed:
            return await start_clock(self, worker_id, after)
        failed.append(worker_id)
        publish = self.js.publish

        async def timed_out(*_, **__):
            raise nats.errors.TimeoutError  # nothing stored

        self.js.publish = timed_out
        try:
            await start_clock(self, worker_id, after)
        finally:
            self.js.publish = publish

    monkeypatch.setattr(liveness_module.Liveness, "start_clock", lost_in_an_election_once)
    async with running_registry(nats_url, prefix, ttl_s=1, reconcile_interval_s=1.0):
        assert failed == ["w-1"]  # the start's reconciliation
        assert any(r.getMessage().startswith("worker w-1 is not reconciled (TimeoutError") for r in caplog.records)
        _, removed = await wait_event(nc, prefix, "w-1", WorkerRemoved, after=reply["seq"], timeout=30)
        assert removed.reason == "LOST"


async def test_a_sweep_consumer_that_cannot_be_asked_about_does_not_stop_the_round(nats_url, nc, prefix, monkeypatch):
    """The sweep's consumer unanswered (its group without a leader on a cluster: it exists, so it is not
    made again, and it delivers nothing): the round that finds its markers runs all the same (a review
    found the failed look skipped every round)."""
    async with running_registry(nats_url, prefix, ttl_s=1, reconcile_interval_s=1.0) as registry:
        stream = f"KV_{bucket_name(prefix, 'heartbeats')}"
        await nc.jetstream().delete_consumer(stream, liveness_module.SWEEPER)  # delivers nothing now

        async def unanswered():
            raise nats.errors.TimeoutError  # as consumer_info in an election of the consumer's group

        monkeypatch.setattr(registry.liveness.sweeper, "ensure_consumer", unanswered)
        reply, _ = await raw_request(nc, prefix, "register", "w-1", registration("w-1"))
        _, removed = await wait_event(nc, prefix, "w-1", WorkerRemoved, after=reply["seq"], timeout=30)
        assert removed.reason == "LOST"


async def test_a_round_the_bucket_does_not_answer_ends_early_and_says_so_once(nats_url, nc, prefix, caplog):
    """The heartbeat bucket not answering a round's reads: the round ends after RECONCILE_GIVE_UP failures
    in a row, with one line for the round, not a read of seconds and a line per registered worker (a review:
    10,000 workers held a start for minutes and logged 10,000 lines)."""
    from services.registry import service as service_module

    caplog.set_level(logging.WARNING, logger="warmboot.registry")
    async with running_registry(nats_url, prefix, ttl_s=300) as registry:
        for i in range(service_module.RECONCILE_GIVE_UP * 2):
            reply, _ = await raw_request(nc, prefix, "register", f"w-{i}", registration(f"w-{i}"))
            assert reply["outcome"] == "REGISTERED"
        reads = []

        async def unanswered(worker_id):
            reads.append(worker_id)
            raise nats.errors.TimeoutError

        registry.liveness.entry = unanswered
        caplog.clear()
        await registry.reconcile()
    assert service_module.RECONCILE_GIVE_UP <= len(reads) < service_module.RECONCILE_GIVE_UP * 2
    lines = [r.getMessage() for r in caplog.records]
    assert sum("is not reconciled (TimeoutError" in line for line in lines) == 1, lines
    assert any(line.startswith("reconciling heartbeats stopped early") for line in lines), lines
    assert any(f"{len(reads)} registered workers were not reconciled this round" in line for line in lines), lines


async def test_an_expiry_handled_on_a_read_behind_the_worker_s_new_life_still_ends_it_as_lost(
        nats_url, nc, prefix, monkeypatch):
    """A worker is removed and registered anew (a new life) through another registry replica; its
    agent beats once through this replica (the roster, current, has the new life) and falls
    silent. The expiry marker comes to this replica, whose read of the worker's history comes from a
    replica of the stream that has not applied the new registration: the worker is in no life there,
    so `lose` wrote nothing, and the marker was acknowledged. The new life stayed registered with no
    heartbeat (its resumes placed on a silent worker) until a reconciliation round found the marker
    (100 s by default), not within its TTL (docs/registry.md). A removal as LOST that writes nothing
    must stand only on the worker's history as the stream leader has it, as an answer that writes
    nothing does (`confirm_unchanged`)."""
    from datetime import datetime, timezone

    from services.process import store_env
    from services.registry.service import RegistryStore
    from tests.factories import another_process, reads_before

    at = datetime.now(timezone.utc)
    async with running_registry(nats_url, prefix, ttl_s=1) as registry:  # reconciles every 100 s
        async with another_process(RegistryStore, store_env(nats_url, prefix)) as elsewhere:
            await elsewhere.register(body("w-1"), at)
            await elsewhere.remove("w-1", RemoveWorker(reason="replaced"), at)
            again = (await elsewhere.register(body("w-1"), at)).seq  # the new life
        reads_before(monkeypatch, registry.store.recorder.stream, again)  # a replica behind plays its reads
        lose, handled = registry.store.lose, []

        async def noted(worker_id, when):  # the same decision, its outcome noted
            decided = await lose(worker_id, when)
            handled.append(decided.wrote)
            return decided

        registry.store.lose = noted
        reply, _ = await raw_request(nc, prefix, "heartbeat", "w-1", {})
        assert reply == {"ttl_s": registry.ttl_s, "drained": None}, reply  # the roster has the new life: its clock runs
        try:
            _, removed = await wait_event(nc, prefix, "w-1", WorkerRemoved, after=again, timeout=15)
        except AssertionError:
            state = await registry.liveness.state("w-1")
            raise AssertionError(f"the new life was not removed as LOST: its expiry was handled {len(handled)} "
                                 f"time(s), writing {handled}; the key is {state!r}") from None
        assert removed.reason == "LOST"


# --- the sweep hands back what it could not handle; a beat's TTL and put as the heartbeat says ------------


@pytest.mark.parametrize("failure, outage", [
    (unavailable("the event log is unavailable (the test's outage: one attempt)"), True),
    (nats.errors.TimeoutError(), True),
    (KeyError("the test's bug"), False),
])
async def test_a_removal_that_fails_once_is_tried_again_a_second_later(nats_url, nc, prefix, caplog, failure, outage):
    """The sweep hands back (nak) the marker of a removal that failed (the event log unavailable for a
    moment), to be delivered again a second later (docs/registry.md, Liveness): the silent worker is
    removed as LOST then, well before the consumer's 30 s ack wait or the next reconciliation (100 s).
    A user checks that a worker lost during a short outage of the log is still removed within a few
    seconds of it. Kills the mutants of `Sweeper._handle_markers` that acknowledge the marker of a
    failed removal (instead of its nak, or after it) or let the failure out of the lane. An outage is
    logged in one line naming it (at most one per 10 s), a bug with its traceback (a soak's logs held a
    traceback per outage, then a line per lost worker and second of the outage)."""
    async with running_registry(nats_url, prefix, ttl_s=1) as registry:
        lose, failed = registry.store.lose, []

        async def failing_once(worker_id, at):
            if not failed:
                failed.append(worker_id)
                raise failure
            return await lose(worker_id, at)

        registry.store.lose = failing_once
        with caplog.at_level(logging.WARNING, logger="warmboot.registry"):
            reply, _ = await raw_request(nc, prefix, "register", "w-1", registration("w-1"))
            assert reply["outcome"] == "REGISTERED"
            _, removed = await wait_event(nc, prefix, "w-1", WorkerRemoved, after=reply["seq"], timeout=15)
        assert removed.reason == "LOST" and failed == ["w-1"]
    [said] = [r for r in caplog.records if "could not remove lost worker" in r.getMessage()]
    if outage:  # a line per OUTAGE_LOG_S while it lasts (`services.endpoints.OutageLog`), naming the error
        assert said.exc_info is None and repr(failure) in said.getMessage(), said.getMessage()
    else:
        assert "w-1" in said.getMessage() and said.exc_info is not None and said.exc_info[1] is failure


async def test_a_ttl_that_is_no_whole_number_of_seconds_is_rounded_up(nats_url, nc, prefix):
    """docs/registry.md: the TTL is counted in whole seconds, rounded up, so that a worker never
    expires before the `ttl_s` its heartbeat answers. With ttl_s 1.5, a beat's put carries a TTL of
    2 s; 1 s would remove as LOST an agent that beats on time for what it was told. Kills the
    mutant of `Liveness.__init__` that rounds the TTL down."""
    async with running_registry(nats_url, prefix, ttl_s=1.5) as registry:
        await raw_request(nc, prefix, "register", "w-1", registration("w-1"))
        assert (await raw_request(nc, prefix, "heartbeat", "w-1", {}))[0] == {"ttl_s": 1.5, "drained": None}
        bucket = bucket_name(prefix, "heartbeats")
        entry = await nc.jetstream().get_msg(f"KV_{bucket}", subject=f"$KV.{bucket}.w-1")
        assert entry.seq == await registry.liveness.last_entry("w-1")
        assert entry.headers["Nats-TTL"] == "2s", entry.headers


async def test_a_put_the_bucket_refuses_is_unavailable_never_ttl_s(nats_url, nc, prefix):
    """docs/registry.md: a heartbeat is answered `ttl_s` once the server has stored its put; a put the
    bucket does not store is UNAVAILABLE. Here the bucket refuses every put (its messages limited to a
    few bytes): the server answers the put with an error, and the heartbeat must say UNAVAILABLE,
    not a TTL counting from a put that is not there. Kills the mutant of `Acks.publish` that takes
    an error in the server's answer for a stored put."""
    async with running_registry(nats_url, prefix) as registry:
        await raw_request(nc, prefix, "register", "w-1", registration("w-1"))
        put = await registry.liveness.last_entry("w-1")
        js = nc.jetstream()
        stream = f"KV_{bucket_name(prefix, 'heartbeats')}"
        config = (await js.stream_info(stream)).config
        config.max_msg_size = 8  # every beat is larger
        await js.update_stream(config)
        reply, headers = await raw_request(nc, prefix, "heartbeat", "w-1", {})
        assert reply["error"]["code"] == "UNAVAILABLE", reply
        assert "refused the put" in reply["error"]["message"] and headers["Nats-Service-Error-Code"] == "503"
        assert await registry.liveness.last_entry("w-1") == put  # nothing was stored
