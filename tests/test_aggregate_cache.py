"""The services' cache of aggregates (`events.aggregate.AggregateCache`): a command reads only the
events after the actor or worker it last read or saved, and decides on exactly what a whole read
of its history would give.

On the bus: two snapshotter replicas (each with its cache), the scheduler and the registry, a
client sending random lifecycle requests (with retries of the same request id) for a handful of
actors, each request to one of the two replicas, so each replica's cache is behind the log most
of the time (the other replica's writes, the scheduler's placements). After every request, what
each replica's cache holds, and what a command would get from it, is compared with the aggregate
a whole read of the log makes.
"""

from __future__ import annotations

import asyncio
import enum
import random
from contextlib import AsyncExitStack
from datetime import datetime
from typing import Any

import msgspec
import pytest

from events.aggregate import FORKED_CONTAINERS, AggregateCache, WireAggregate
from events.errors import ContractError
from events.schema import Fidelity, PauseActor, StopActor, SuspendActor, TagSnapshot, UpdateTemplate
from services.registry.domain import Worker
from services.snapshotter.domain import Actor, Tag
from tests.factories import actor, version, worker
from warmboot.client import Client
from warmboot.runner import start_services

V1 = version("v1")


def check_forkable(aggregate: WireAggregate) -> None:
    """AssertionError unless `fork` copies all of `aggregate`'s mutable state: every attribute
    is an immutable value or a list, dict or set of immutable values (checked on every kind, below)."""
    def immutable(value: Any) -> bool:
        if isinstance(value, (tuple, frozenset)):
            return all(immutable(v) for v in value)
        return value is None or isinstance(value, (str, int, float, bool, datetime, enum.Enum, msgspec.Struct)) and (
            not isinstance(value, msgspec.Struct) or value.__struct_config__.frozen)

    for name, value in vars(aggregate).items():
        if type(value) in FORKED_CONTAINERS:
            items = list(value.items()) if isinstance(value, dict) else list(value)
            assert all(immutable(v) for v in items), f"{type(aggregate).__name__}.{name} holds mutable values"
        else:
            assert immutable(value), f"{type(aggregate).__name__}.{name} is mutable: {type(value).__name__}"


def state(aggregate: WireAggregate) -> dict:
    """Everything an aggregate decides on."""
    return {k: v for k, v in vars(aggregate).items() if k != "pending_events"}


async def whole_read(app, aggregate_id: str) -> WireAggregate | None:
    """The aggregate a read of its whole history makes, as a command made it before the cache."""
    from eventsourcing.application import project_aggregate

    stored = await app.recorder.select_events_async(aggregate_id)
    return project_aggregate(None, map(app.mapper.to_domain_event, stored)) if stored else None


@pytest.mark.timeout(300)
async def test_commands_decide_on_what_a_whole_read_of_the_history_gives(stack, nats_server, nc, prefix):
    async with AsyncExitStack() as exits:
        other = (await start_services(exits, ["snapshotter"], nats_server.url, prefix)).services[0]
        first = next(s for s in stack.services if type(s) is type(other))
        replicas = [first, other]
        wb = Client(nc, prefix)
        for i in range(3):
            await wb.register(worker(f"w{i}", V1, node=f"n{i}", cpu=64000, mem=65536))
        rng = random.Random(7)
        actors = [f"a{i}" for i in range(5)]
        for a in actors:
            await wb.create(actor(a, cpu=100, mem=128))
        answered = refused = 0
        for step in range(300):
            a = rng.choice(actors)
            replica = rng.choice(replicas)
            rid = f"r{step if rng.random() < 0.8 else step - 1}"  # now and then a retry of the last request id
            verb = rng.choice(["resume", "resume", "pause", "suspend", "suspend", "tag", "template", "stop",
                               "create", "race"])
            try:
                if verb == "race":  # both replicas at once: one append loses, its command runs again
                    results = await asyncio.gather(
                        replicas[0].suspend(a, SuspendActor(fidelity=Fidelity.MEMORY, uri="s3://x/0", request_id=rid)),
                        replicas[1].update_template(a, UpdateTemplate(template_uid=f"tpl-{step}", request_id=rid + "u")),
                        return_exceptions=True)
                    for result in results:
                        if isinstance(result, Exception) and not isinstance(result, ContractError):
                            raise result
                elif verb == "resume":
                    await wb.resume(a, request_id=rid)
                elif verb == "pause":
                    await replica.pause(a, PauseActor(request_id=rid))
                elif verb == "suspend":
                    await replica.suspend(a, SuspendActor(fidelity=rng.choice(list(Fidelity)), uri=f"s3://x/{step}",
                                                          request_id=rid))
                elif verb == "tag":
                    await replica.tag(a, TagSnapshot(tag=f"t{step % 3}", request_id=rid))
                elif verb == "template":
                    await replica.update_template(a, UpdateTemplate(template_uid=f"tpl{step % 2}", request_id=rid))
                elif verb == "stop":
                    await replica.stop_actor(a, StopActor(request_id=rid))
                else:
                    await replica.create(a, actor(a, cpu=100, mem=128, request_id=rid))
                answered += 1
            except ContractError:
                refused += 1
            for r in replicas:
                app = r.app
                for aggregate_id in [Actor.create_id(x) for x in actors] + [Tag.create_id(f"t{i}") for i in range(3)]:
                    whole = await whole_read(app, aggregate_id)
                    kept = app.cache.entries.get(aggregate_id)
                    if kept is not None:  # what it holds is a state the log held (maybe behind it)
                        assert whole is not None and kept.version <= whole.version
                        older = await whole_read_until(app, aggregate_id, kept.version)
                        assert state(kept) == state(older), (step, aggregate_id)
                    got = await app.get_async(aggregate_id)  # what a command gets: the log as it is
                    assert (got is None) == (whole is None)
                    if got is not None:
                        assert state(got) == state(whole), (step, aggregate_id)
                        check_forkable(got)
        assert answered > 60 and refused > 60  # both ways taken, in numbers
        assert all(r.app.cache.hits > 1000 for r in replicas)


async def whole_read_until(app, aggregate_id: str, version: int) -> WireAggregate:
    from eventsourcing.application import project_aggregate

    stored = await app.recorder.select_events_async(aggregate_id, lte=version)
    return project_aggregate(None, map(app.mapper.to_domain_event, stored))


async def test_a_pause_reads_the_tail_of_a_long_history_not_all_of_it(stack, nc, prefix, monkeypatch):
    """After 60 cycles (180 events), a pause reads the events written since the actor was last read
    or saved (the scheduler's placement: one), not the 180: what a command costs no longer grows
    with the actor's history."""
    snapshotter = next(s for s in stack.services if type(s).__name__ == "SnapshotterService")
    wb = Client(nc, prefix)
    await wb.register(worker("w", V1, cpu=64000, mem=65536))
    await wb.create(actor("a", cpu=100, mem=128))
    for _ in range(60):
        await wb.resume("a")
        await wb.pause("a")
    recorder = snapshotter.app.recorder
    read: list[int] = []
    select = recorder.select_events_async

    async def counted(aggregate_id, **kw):
        events = await select(aggregate_id, **kw)
        if aggregate_id == Actor.create_id("a"):
            read.append(len(events))
        return events

    monkeypatch.setattr(recorder, "select_events_async", counted)
    await wb.resume("a")
    paused = await wb.pause("a")
    assert read == [2], read  # the event the cache ends with (still there: checked), and the ActorPlaced since
    whole = await whole_read(snapshotter.app, Actor.create_id("a"))
    assert whole.version > 180 and whole.latest_snapshot == paused.snapshot


def test_the_cache_keeps_a_budget_of_events_least_recently_used_first_out():
    cache = AggregateCache(budget_events=10)
    made = {}
    for name, n in (("a", 4), ("b", 4), ("c", 4)):
        w = Worker(name)
        w.version, w.seqs = n, list(range(1, n + 1))
        made[name] = w
    cache.put(made["a"])
    cache.put(made["b"])
    assert cache.get("worker.a") is not None  # a used after b
    cache.put(made["c"])  # 12 > 10: b, the least recently used, goes
    assert set(cache.entries) == {"worker.a", "worker.c"} and cache.held == 8
    long = Worker("long")
    long.version, long.seqs = 11, list(range(1, 12))
    cache.put(long)  # longer than the whole budget: not kept
    assert "worker.long" not in cache.entries
    unknown = Worker("u")
    unknown.version, unknown.seqs = 1, [0]  # a position not known: not kept
    cache.put(unknown)
    assert "worker.u" not in cache.entries
    kept = cache.get("worker.a")
    assert kept is not made["a"] and kept.seqs is not made["a"].seqs  # a fork: nothing shared to mutate


def test_every_aggregate_kind_is_forkable_after_a_rich_history():
    """`fork` copies one level of containers: every kind's state must be immutable values and such
    containers (a nested list would be shared between a command and the cache)."""
    from tests.test_snapshotter_domain import at, placed, running

    a = running()
    a.pause("p", "r1", at(1))
    a.place(placed(a))
    a.suspend(None, "s3://x", Fidelity.MEMORY, "r2", at(2))
    tag = Tag("t")
    a.tag(tag, "r3", at(3))
    w = Worker("w1")
    w.register(worker("w1", V1, request_id="r4"), at(4))
    w.drain("x", at(5))
    for aggregate in (a, tag, w):
        aggregate.collect_events()
        check_forkable(aggregate)
    twin = a.fork()
    twin.place(placed(twin))
    assert a.state != twin.state and len(a.history) + 1 == len(twin.history)
    assert a.snapshot_ids is not twin.snapshot_ids and a.request_versions is not twin.request_versions


@pytest.mark.parametrize("how", ["last event deleted", "stream made again"])
async def test_a_history_the_log_no_longer_holds_is_not_decided_on(stack, nc, prefix, how):
    """The cache holds the actor at its last event; the log loses that event (an operator's `nats
    stream rmm`, a single server losing its tail) or is made again empty. A command then decides
    on what a whole read gives, as without the cache: the cached state, which the log no longer
    holds, answered a no-op from an event gone (the review's run: a success from seq 2 after it was
    deleted), or appended version 3 onto an empty subject, a history no one could read again."""
    from events.errors import ErrorCode
    from events.subjects import stream_name

    snapshotter = next(s for s in stack.services if type(s).__name__ == "SnapshotterService")
    wb = Client(nc, prefix)
    await wb.create(actor("a", cpu=100, mem=128))
    changed = await snapshotter.update_template("a", UpdateTemplate(template_uid="tpl-x"))
    assert snapshotter.app.cache.entries[Actor.create_id("a")].version == 2
    if how == "last event deleted":
        await nc.jetstream().delete_msg(stream_name(prefix), changed.seq)
    else:
        await nc.jetstream().delete_stream(stream_name(prefix))
    got = await snapshotter.app.get_async(Actor.create_id("a"))
    whole = await whole_read(snapshotter.app, Actor.create_id("a"))
    if how == "last event deleted":
        assert got.version == 1 and got.template_uid == whole.template_uid == "t1"
        assert state(got) == state(whole)
    else:
        assert got is None and whole is None
        with pytest.raises(ContractError) as refused:
            await snapshotter.update_template("a", UpdateTemplate(template_uid="tpl-y"))
        assert refused.value.code is ErrorCode.NOT_FOUND


@pytest.mark.timeout(300)
async def test_registry_commands_decide_on_what_a_whole_read_gives(stack, nats_server, nc, prefix):
    """The registry's cache, two replicas: random registrations (runtime and capacity changes),
    drains, removals and registrations anew of a few workers, each to one replica; after each,
    what either replica holds and hands a command is what a whole read of the worker makes."""
    from events.schema import DrainWorker, RemoveWorker

    async with AsyncExitStack() as exits:
        other = (await start_services(exits, ["registry"], nats_server.url, prefix,
                                      options={"registry": {"ttl_s": 3600}})).services[0]
        first = next(s for s in stack.services if type(s) is type(other))
        replicas = [first, other]
        rng = random.Random(11)
        workers = [f"w{i}" for i in range(3)]
        answered = 0
        for step in range(150):
            w, replica = rng.choice(workers), rng.choice(replicas)
            verb = rng.choice(["register", "register", "drain", "remove"])
            try:
                if verb == "register":
                    await replica.register(w, worker(w, version(rng.choice(["v1", "v2"])), cpu=rng.choice([1000, 2000]),
                                                     request_id=f"r{step}"))
                elif verb == "drain":
                    await replica.drain(w, DrainWorker(reason="x", request_id=f"r{step}"))
                else:
                    await replica.remove(w, RemoveWorker(reason="x", request_id=f"r{step}"))
                answered += 1
            except ContractError:
                pass
            for r in replicas:
                for w2 in workers:
                    aggregate_id = Worker.create_id(w2)
                    whole = await whole_read(r.store, aggregate_id)
                    got = await r.store.get_async(aggregate_id)
                    assert (got is None) == (whole is None)
                    if got is not None:
                        assert state(got) == state(whole), (step, aggregate_id)
        assert answered > 80


async def test_another_event_at_the_same_sequence_is_not_taken_for_the_cached_one(nats_server, nc, prefix):
    """The stream made again, its history landing at the same sequences: replica A holds w1
    registered with cpu-x at version 1, sequence 1; B registers w1 anew with cpu-y, at version 1,
    sequence 1. The check of sequence and version passed, and A decided on cpu-x (the review's
    run: a cpu-x registration answered UNCHANGED while placement sent it cpu-y images). The event
    itself is compared: A reads the log whole, and decides on cpu-y."""
    from events.subjects import stream_name

    js = nc.jetstream()
    async with AsyncExitStack() as exits:
        a, b = [(await start_services(exits, ["registry"], nats_server.url, prefix,
                                      options={"registry": {"ttl_s": 3600}})).services[0] for _ in range(2)]
        wid = Worker.create_id("w1")
        await a.register("w1", worker("w1", version("cpu-x"), request_id="r1"))
        cached = a.store.cache.entries[wid]
        info = await js.stream_info(stream_name(prefix))
        await js.delete_stream(stream_name(prefix))
        await js.add_stream(info.config)
        for _ in range(cached.seqs[-1] - 1):  # the same layout: what came before w1's registration
            await js.publish(f"{prefix}.ev.filler.x", b"{}")
        await b.register("w1", worker("w1", version("cpu-y"), request_id="r2"))
        whole = await whole_read(b.store, wid)
        assert (whole.version, whole.seqs) == (cached.version, cached.seqs)  # the same place, another event
        got = await a.store.get_async(wid)
        assert state(got) == state(whole)
        attrs = {x.key: x.value for x in got.sandbox_classes[0].default_runtime.version.attributes}
        assert attrs["gvisor_asset_hash"] == "cpu-y"
