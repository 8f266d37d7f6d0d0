"""A fold never folds past a message it did not get (services/scheduler/fold.py, `Fold._missing`).

Every message of the event stream is the scheduler fold's, so its stream sequences come one
after the other. nats-py drops what a subscription's queue cannot take while its reader is
held (a checkpoint copying the projection holds the fold), having counted it delivered: an
audit reproduced a worker's runtime change lost that way, and a memory image then placed on
the worker that could no longer restore it. The fold's queue now has no limit
(`events.natspy.jetstream.NO_DROPS`); and a message further on than the next one is not folded:
the consumer is made again from the first one missed. Messages the stream no longer has
(deleted by hand) are folded past, as the stream's leader says."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack

import nats
import nats.errors
import nats.js.client as jsc
from prometheus_client import REGISTRY

from events.schema import PlacedFidelity
from events.subjects import stream_name
from services.scheduler.fold import Fold
from services.scheduler.projection import Projection
from services.scheduler.service import SchedulerService
from tests.factories import SILENT_TTL_S, actor, golden, last_seq, read_log, version, worker
from warmboot.client import Client
from warmboot.runner import start_services

V1, V2 = version("1"), version("2")
LIMIT = 8  # the replica's queue (nats-py's default is 524,288 messages): the same drop, sooner


def restorable(projection: Projection, worker_id: str) -> list:
    return [r.compat for r in projection.workers[worker_id].classes["gvisor"].restorable]


async def test_messages_dropped_while_the_fold_is_held_are_read_again_before_a_placement(
        nats_url, prefix, nc, monkeypatch):
    async with AsyncExitStack() as exits:
        await start_services(exits, ["registry", "snapshotter"], nats_url, prefix,
                             options={"registry": {"ttl_s": SILENT_TTL_S}})
        wb = Client(nc, prefix)
        await wb.register(worker("w", V2, (V1,), labels={"rack": "a"}))  # w runs V2, still restores V1
        await wb.create(actor("a", golden_snapshot=golden(V1)))  # a's image is stamped V1

        dropped: dict[str, asyncio.Event] = {f"{prefix}.ev.worker.w": asyncio.Event(),
                                             f"{prefix}.ev.booking.w": asyncio.Event()}

        async def on_error(error: Exception) -> None:
            if isinstance(error, nats.errors.SlowConsumerError) and error.subject in dropped:
                dropped[error.subject].set()

        subscribe = jsc.JetStreamContext.subscribe

        async def small_queue(self, *args, **kwargs):  # as a queue of nats-py's default size, filled
            if kwargs.get("ordered_consumer"):
                kwargs["pending_msgs_limit"] = LIMIT
            return await subscribe(self, *args, **kwargs)

        monkeypatch.setattr(jsc.JetStreamContext, "subscribe", small_queue)
        connection = await nats.connect(nats_url, error_cb=on_error)
        exits.push_async_callback(connection.close)
        replica = SchedulerService(connection, nats_url=nats_url, prefix=prefix)
        await replica.start()
        exits.push_async_callback(replica.stop)
        monkeypatch.undo()

        refills = REGISTRY.get_sample_value("warmboot_scheduler_fold_refills_total")
        async with replica.fold.paused():  # what a checkpoint's copy of the projection does
            for i in range(LIMIT + 4):
                await wb.create(actor(f"filler-{i}"))
            await wb.register(worker("w", V2, (), labels={"rack": "a"}))  # w no longer restores V1
            for event in dropped.values():  # its RuntimeChanged and the registry's fence: both dropped
                await asyncio.wait_for(event.wait(), 10)
        # w's label changed (WorkerUpdated and a fence): the replica's booking guard for w is current
        await wb.register(worker("w", V2, (), labels={"rack": "b"}))
        await replica.fold.wait(await last_seq(nc, prefix), 10)

        fresh = Projection()
        for seq, event in await read_log(nc, prefix):
            fresh.apply(seq, event)
        assert restorable(fresh, "w") == []
        assert restorable(replica.projection, "w") == [], "the fold went past w's runtime change"
        assert replica.fold.refills >= 1 and replica.fold.stale is None
        assert REGISTRY.get_sample_value("warmboot_scheduler_fold_refills_total") >= refills + 1  # an operator sees it
        placed = await wb.resume("a")
        assert not (placed.fidelity is PlacedFidelity.MEMORY and placed.worker_id == "w"), placed


async def test_messages_the_stream_no_longer_has_are_folded_past(nats_url, prefix, nc, caplog):
    wb = Client(nc, prefix)
    async with AsyncExitStack() as exits:
        await start_services(exits, ["registry", "snapshotter"], nats_url, prefix,
                             options={"registry": {"ttl_s": SILENT_TTL_S}})
        await wb.register(worker("w", V2))
        for i in range(3):
            await wb.create(actor(f"a-{i}"))
    gone = [seq for seq, event in await read_log(nc, prefix) if getattr(event, "actor_id", None) == "a-1"]
    for seq in gone:
        await nc.jetstream().delete_msg(stream_name(prefix), seq)
    last = await last_seq(nc, prefix)
    caplog.set_level(logging.WARNING, logger="warmboot.scheduler")

    fold = Fold(nc, prefix, Projection())
    await fold.start(10)
    try:
        assert fold.applied == last and fold.stale is None
        assert set(fold.projection.actors) == {"a-0", "a-2"}
        assert fold.refills >= 1
        assert any("are not in the stream" in r.getMessage() for r in caplog.records)
        queue = fold._sub._sub  # and nats-py queues its messages without a limit (NO_DROPS)
        assert (queue._pending_queue.maxsize, queue._pending_bytes_limit) == (0, 0)
    finally:
        await fold.stop()


async def test_the_registry_s_folds_queue_without_a_limit(nats_url, prefix):
    """The roster's fold and the binding's follower read ordered consumers too: nats-py's queue would
    drop past its limit in a long replay (the server pushes faster than a fold reads), unseen."""
    from tests.registry_helpers import running_registry

    async with running_registry(nats_url, prefix) as registry:
        for sub in (registry.fold._sub, registry.binding._sub):
            assert (sub._sub._pending_queue.maxsize, sub._sub._pending_bytes_limit) == (0, 0)
