"""CONTRACT v1.1, "a memory image is only ever sent where it can load", over the real bus.

Each reproduction of the issue is here as it was found: a LOCAL image after its worker
was removed or lost, a paused actor whose node is gone, a fallback across
architectures, tags and golden snapshots that say LOCAL, and registry changes that
race placements (judged from the log in stream order by the audit verifier).
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import msgspec
import pytest

from events.errors import ContractError
from events.schema import (
    Action,
    ActorPlaced,
    ActorReleased,
    ActorReverted,
    ErrorCode,
    FallbackReason,
    Location,
    PlacedFidelity,
    ReleaseReason,
    TagRecorded,
    WorkerRemoved,
)
from events.aggregate import now
from services.scheduler.service import SchedulerService
from tests.factories import CLASS, actor, golden, last_seq, read_log, snapshot, version, wait_for, worker
from warmboot.audit import Sink
from warmboot.client import Client
from warmboot.runner import SERVICES, connect, start_services

V1, V2 = version("v1"), version("v2")
ARM1 = version("v1", arch="arm64")


@pytest.fixture
async def wb(stack, nc, prefix):
    return Client(nc, prefix)


async def refused(call) -> ContractError:
    with pytest.raises(ContractError) as caught:
        await call
    return caught.value


async def released(nc, prefix, actor_id: str, after: int) -> int:
    seq, _ = await wait_for(nc, prefix, lambda e: isinstance(e, ActorReleased) and e.actor_id == actor_id
                            and e.reason is ReleaseReason.WORKER_REMOVED, after=after)
    return seq


async def verify(nc, prefix) -> Sink:
    """The whole log folded and checked by `warmboot audit verify`'s verifier, in stream order."""
    sink = Sink(verify=True)
    for seq, event in await read_log(nc, prefix):
        if event.KIND == "booking":
            sink.booking_marker(seq, event.worker_id)
        else:
            sink.apply(seq, event)
    return sink


# --- where a snapshot lives (rule 5) -------------------------------------------------------------


async def test_a_local_image_restores_only_on_its_node_after_its_worker_is_removed(wb, nc, prefix):
    await wb.register(worker("w-a", V1, node="n-a"))
    await wb.create(actor("a"))
    assert (await wb.resume("a")).worker_id == "w-a"
    paused = await wb.pause("a")
    assert (paused.snapshot.location, paused.snapshot.node) == (Location.LOCAL, "n-a")
    again = await wb.resume("a")
    assert (again.worker_id, again.action, again.fidelity) == ("w-a", Action.RESTORE, PlacedFidelity.MEMORY)
    removed = await wb.remove("w-a")
    release = await released(nc, prefix, "a", removed.seq)
    await wb.register(worker("w-b", V1, node="n-b"))  # compatible, but on another node
    before = await last_seq(nc, prefix)

    error = await refused(wb.resume("a", min_seq=release))
    assert error.code is ErrorCode.FAILED_PRECONDITION
    assert "n-a" in error.message and "revert" in error.message
    assert await last_seq(nc, prefix) == before  # nothing written
    why = await wb.explain("a")
    assert why.decision is None and why.refusal.code is ErrorCode.FAILED_PRECONDITION
    (cls,) = (await wb.fragmentation(CLASS)).classes
    assert cls.lost_local_snapshots == 1

    await wb.register(worker("w-c", V1, node="n-a"))  # a worker comes back on the image's node
    back = await wb.resume("a")
    assert (back.worker_id, back.fidelity, back.snapshot_id) == ("w-c", PlacedFidelity.MEMORY, paused.snapshot.snapshot_id)
    assert (await wb.fragmentation(CLASS)).classes[0].lost_local_snapshots == 0
    assert (await verify(nc, prefix)).violation is None


async def test_a_lost_workers_local_image_is_given_up_only_by_revert(nats_server, nc, prefix):
    async with AsyncExitStack() as exits:
        await start_services(exits, list(SERVICES), nats_server.url, prefix, options={"registry": {"ttl_s": 1}})
        wb = Client(nc, prefix)
        await wb.register(worker("w-a", V1, node="n-a"))
        await wb.create(actor("a"))
        await wb.resume("a")
        await wb.pause("a")
        await wb.resume("a")
        # no heartbeat: the registry removes w-a as LOST; the snapshotter releases the actor
        lost, _ = await wait_for(nc, prefix, lambda e: isinstance(e, WorkerRemoved) and e.reason == "LOST")
        release = await released(nc, prefix, "a", lost)
        await wb.register(worker("w-b", V1, node="n-b"))
        error = await refused(wb.resume("a", min_seq=release))
        assert error.code is ErrorCode.FAILED_PRECONDITION and "n-a" in error.message

        reverted = await wb.revert("a", reason="node n-a is gone")
        assert reverted.snapshot is None  # it never had an EXTERNAL snapshot: it cold-boots
        _, event = (await read_log(nc, prefix))[-1]
        assert isinstance(event, ActorReverted) and event.abandoned.location is Location.LOCAL
        assert event.abandoned.node == "n-a" and event.reason == "node n-a is gone"
        cold = await wb.resume("a")
        assert (cold.worker_id, cold.action, cold.fidelity) == ("w-b", Action.RUN, PlacedFidelity.NONE)


async def test_a_paused_actor_whose_node_is_gone_is_refused_not_busy_and_reverts_to_its_external_snapshot(
        wb, nc, prefix):
    await wb.register(worker("w-a", V1, node="n-a"))
    await wb.register(worker("w-b", V1, node="n-b"))
    await wb.create(actor("a", selectors={}))
    first = await wb.resume("a")
    suspended = await wb.suspend("a", uri="s3://a/1")  # EXTERNAL, stamped V1
    node = (await wb.resume("a")).node
    await wb.pause("a")
    gone = "w-a" if node == "n-a" else "w-b"
    assert first.action is Action.RUN
    await wb.remove(gone)  # a PAUSED actor is not released: its image is on the node
    error = await refused(wb.resume("a"))
    assert error.code is ErrorCode.FAILED_PRECONDITION and node in error.message and "revert" in error.message
    (cls,) = (await wb.fragmentation(CLASS)).classes
    assert cls.lost_local_snapshots == 1

    reverted = await wb.revert("a", request_id="rv-1")
    assert reverted.snapshot == suspended.snapshot
    assert await wb.revert("a", request_id="rv-1") == reverted  # a retry: the first answer, nothing written
    restored = await wb.resume("a")
    assert restored.snapshot_id == suspended.snapshot.snapshot_id and restored.fidelity is PlacedFidelity.MEMORY
    assert restored.node != node
    assert (await wb.fragmentation(CLASS)).classes[0].lost_local_snapshots == 0
    assert (await verify(nc, prefix)).violation is None


async def test_revert_needs_a_local_image(wb, nc, prefix):
    await wb.register(worker("w", V1))
    await wb.create(actor("a"))
    before = await last_seq(nc, prefix)
    assert (await refused(wb.revert("a"))).code is ErrorCode.FAILED_PRECONDITION  # CREATED
    await wb.resume("a")
    assert (await refused(wb.revert("a"))).code is ErrorCode.FAILED_PRECONDITION  # RUNNING
    await wb.suspend("a", uri="s3://a")
    assert (await refused(wb.revert("a"))).code is ErrorCode.FAILED_PRECONDITION  # SUSPENDED, EXTERNAL latest
    assert (await refused(wb.revert("ghost"))).code is ErrorCode.NOT_FOUND
    log = [e for s, e in await read_log(nc, prefix) if s > before]
    assert not any(isinstance(e, ActorReverted) for e in log)


async def test_only_an_external_snapshot_is_tagged_or_golden(wb, nc, prefix):
    await wb.register(worker("w", V1))
    await wb.create(actor("a"))
    await wb.resume("a")
    await wb.pause("a")
    before = await last_seq(nc, prefix)
    error = await refused(wb.tag("a", "t-local"))
    assert error.code is ErrorCode.FAILED_PRECONDITION and "LOCAL" in error.message
    local_golden = msgspec.structs.replace(golden(V1), location=Location.LOCAL, node="n-x")
    error = await refused(wb.create(actor("g", golden_snapshot=local_golden)))
    assert (error.code, error.field) == (ErrorCode.INVALID_ARGUMENT, "golden_snapshot.location")
    on_a_node = msgspec.structs.replace(golden(V1), node="n-x")  # only a LOCAL image is on a node
    error = await refused(wb.create(actor("g", golden_snapshot=on_a_node)))
    assert (error.code, error.field) == (ErrorCode.INVALID_ARGUMENT, "golden_snapshot.node")
    for uri in (None, "", " "):  # a blank one says nowhere either (found by an audit: taken)
        no_uri = msgspec.structs.replace(golden(V1), uri=uri)
        error = await refused(wb.create(actor("g", golden_snapshot=no_uri)))
        assert (error.code, error.field) == (ErrorCode.INVALID_ARGUMENT, "golden_snapshot.uri"), uri
    for uri in ("", "  "):
        error = await refused(wb.suspend("a", uri=uri))
        assert (error.code, error.field) == (ErrorCode.INVALID_ARGUMENT, "uri"), uri
    assert await last_seq(nc, prefix) == before

    await wb.suspend("a", uri="s3://a")  # promoted to EXTERNAL: now it can be tagged, and created from
    await wb.tag("a", "t-ext")
    await wb.create(actor("b", source_tag="t-ext"))
    placed = await wb.resume("b")
    assert placed.fidelity is PlacedFidelity.MEMORY


async def test_a_tag_of_a_local_image_written_before_v1_1_is_not_copied(wb, writer, nc, prefix):
    """Tags are durable, and before v1.1 a LOCAL snapshot could be tagged: the log may hold a tag of
    an image on one node's disk. A create from it was taken (found by an audit): the new actor held
    another actor's LOCAL image on a node with no worker, its resume refused naming `revert`, and
    revert refused for a CREATED actor, so it could never run. Refused now, FAILED_PRECONDITION on
    `source_tag`, nothing written."""
    await wb.register(worker("w", V1, node="n-a"))
    local = snapshot("src", V1, snapshot_id="src-img", node="n-gone")
    await asyncio.to_thread(writer.write, TagRecorded(tag="old", snapshot=local, at=now()))
    before = await last_seq(nc, prefix)
    error = await refused(wb.create(actor("a", source_tag="old")))
    assert (error.code, error.field) == (ErrorCode.FAILED_PRECONDITION, "source_tag"), error
    assert "LOCAL" in error.message and "n-gone" in error.message
    assert await last_seq(nc, prefix) == before


# --- a fallback keeps the stamp's architecture (rule 4) -----------------------------------------------


async def test_a_fallback_never_crosses_architectures(wb, nc, prefix):
    await wb.register(worker("old", V1, cpu=64000, mem=65536))
    for i in range(12):  # each suspended at MEMORY under V1 (amd64): its own volumes, not borrowed
        await wb.create(actor(f"a{i}", mem=1024))
        await wb.resume(f"a{i}")
        await wb.suspend(f"a{i}", uri=f"s3://a{i}")
    await wb.remove("old")  # now no worker restores V1
    await wb.register(worker("arm", ARM1, cpu=64000, mem=65536))  # all the room, the other architecture
    await wb.register(worker("amd", V2, cpu=2000, mem=4096))  # amd64, but not the stamp's runtime
    placed, refusals = [], []
    for i in range(12):
        try:
            placed.append(await wb.resume(f"a{i}"))
        except ContractError as error:
            refusals.append(error)
    assert placed and all(p.worker_id == "amd" for p in placed)  # the arm64 worker has all the room
    assert all(p.fallback.reason is FallbackReason.NO_COMPATIBLE_WORKER and p.fidelity is PlacedFidelity.VOLUMES
               for p in placed)
    assert refusals and all(r.code is ErrorCode.RESOURCE_EXHAUSTED for r in refusals)
    why = await wb.explain(f"a{len(placed)}")
    assert why.refusal is not None
    assert (await verify(nc, prefix)).violation is None


# --- the worker's history in the commit (rule 8) ----------------------------------------------------


WORKERS = 10
ACTORS = 240


def fleet_member(i: int, *, restorable: bool = True, mem: int = 16384, zone: str = "a"):
    return worker(f"w{i}", V2, (V1,) if restorable else (), cpu=64000, mem=mem, labels={"zone": zone},
                  node=f"n{i}")


async def race_round(wb: Client, nc, prefix: str, actors: list[str]) -> tuple[int, int]:
    """Resume every actor at once; as soon as the first placement is in the log, drain,
    re-register without the matched restorable runtime, cut the capacity, change the label
    the actors select on, and remove five workers; then check the log in stream order."""
    start = await last_seq(nc, prefix)
    results: list = []

    async def resume(a: str) -> None:
        try:
            results.append(await wb.resume(a, min_seq=start))
        except ContractError as error:
            results.append(error)

    tasks = [asyncio.create_task(resume(a)) for a in actors]
    await wait_for(nc, prefix, lambda e: isinstance(e, ActorPlaced), after=start)
    changes = [
        wb.drain("w0"),
        wb.register(fleet_member(1, restorable=False)),  # a rolling upgrade drops V1
        wb.register(fleet_member(2, mem=1024)),  # a capacity cut below what is booked
        wb.register(fleet_member(3, zone="b")),  # no longer meets the actors' selector
        wb.remove("w4"),
    ]
    await asyncio.gather(*changes)
    await asyncio.gather(*tasks)
    sink = await verify(nc, prefix)
    assert sink.violation is None, str(sink.violation)
    placed = [r for r in results if not isinstance(r, ContractError)]
    errors = [r for r in results if isinstance(r, ContractError)]
    assert all(e.code in (ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.UNAVAILABLE) for e in errors), errors[:3]
    # what the racing placements could not do, judged from the log (the verifier checks each one)
    log = [(s, e) for s, e in await read_log(nc, prefix) if s > start]
    assert len([e for _, e in log if isinstance(e, ActorPlaced)]) == len(placed)
    return len(placed), len(errors)


async def reset_round(wb: Client, actors: list[str]) -> None:
    """Suspend what runs and bring the fleet back to its first shape (a drained or removed
    worker registers anew after a removal)."""
    for a in actors:
        try:
            await wb.suspend(a, uri=f"s3://{a}")
        except ContractError as error:
            assert error.code is ErrorCode.FAILED_PRECONDITION  # it was not placed this round
    await wb.remove("w0")
    for i in range(WORKERS):
        await wb.register(fleet_member(i))


@pytest.mark.parametrize("replicas", [1, 3])
async def test_registry_changes_racing_placements_always_win(stack, nats_url, nc, prefix, replicas):
    wb = Client(nc, prefix)
    for i in range(WORKERS):
        await wb.register(fleet_member(i))
    actors = [f"a{i:03d}" for i in range(ACTORS)]
    for a in actors:  # stamped V1: they restore on the workers' restorable runtime
        await wb.create(actor(a, cpu=100, mem=256, selectors={"zone": "a"}, golden_snapshot=golden(V1)))
    async with AsyncExitStack() as exits:
        for _ in range(replicas - 1):
            extra = await connect(nats_url, "extra-scheduler")
            exits.push_async_callback(extra.close)
            service = await SchedulerService(extra, nats_url=nats_url, prefix=prefix, metrics=False).start()
            exits.push_async_callback(service.stop)
        rounds = 3
        for r in range(rounds):
            await race_round(wb, nc, prefix, actors)
            if r < rounds - 1:
                await reset_round(wb, actors)
