"""CONTRACT v1.1 rules an audit (2026-12-04) found untested, or tested only in part: rule 2's whole
order of preference, rule 4's architecture, rule 4a's floors, rule 5's LOCAL images, rule 6's room
and selectors, a label change racing a placement (rule 8), whatif's drop, durable tags, and request
ids of other verbs scoped to one life.

Placement rules are checked against services/scheduler/decide.py, pure (`tests.factories.Log`);
the others on the real nats-server and services (fixtures of tests/conftest.py).
"""

from __future__ import annotations

import pytest

from events.errors import ContractError
from events.schema import (
    Action,
    ActorPlaced,
    ActorReverted,
    Attribute,
    CompatVersion,
    ErrorCode,
    FallbackReason,
    Fidelity,
    PlacedFidelity,
    SnapshotOrigin,
    SnapshotTaken,
    TemplateChanged,
    WhatIf,
    WorkerDrained,
    WorkerRemoved,
)
from services.scheduler.whatif import whatif
from tests.factories import AT, Log, actor, entry, golden, read_log, registered, runtime, taken, version, worker
from tests.factories import snapshot as snap
from tests.test_placement_model import VA, _decided_then
from tests.test_scheduler_decide import refused
from warmboot.client import Client

V1, V2, V3 = version("v1"), version("v2"), version("v3")


@pytest.fixture
async def wb(stack, nc, prefix):
    return Client(nc, prefix)


# --- placement, pure (services/scheduler/decide.py) --------------------------------------------------


def paused_on(log: Log, actor_id: str, node: str, v, **created) -> None:
    """An actor whose latest snapshot is a LOCAL MEMORY image on `node`, stamped `v`, PAUSED."""
    log.actor(actor_id, **created)
    log.add(taken(snap(actor_id, v, snapshot_id=f"{actor_id}-p", node=node), SnapshotOrigin.PAUSE))


def test_rule2_order_default_then_restorable_then_edge_of_default_then_edge_of_restorable():
    """Rule 2 (v1.1): among compatible workers, default equal to the stamp, then a restorable equal to
    it, then an edge of the default, then an edge of a restorable; matched_version says which."""
    log = Log()
    log.worker("w-edge-res", runtime(version("x")), (runtime(V3, compatible=(V1,)),))
    log.worker("w-edge-def", runtime(V2, compatible=(V1,)))
    log.worker("w-res", runtime(V3), (runtime(V1),))
    log.worker("w-def", runtime(V1))
    log.actor("a", snapshot=golden(V1))
    expected = [("w-def", V1, V1), ("w-res", V1, V1), ("w-edge-def", V2, V1), ("w-edge-res", V3, V1)]
    for worker_id, pin, matched in expected:
        placed = log.decide("a")
        assert (placed.worker_id, placed.fidelity, placed.sandbox_runtime.version, placed.matched_version) == (
            worker_id, PlacedFidelity.MEMORY, pin, matched)
        log.drain(worker_id)
    log.worker("w-other", runtime(version("y")))
    placed = log.decide("a")  # no compatible worker left: the fallback says no version matched
    assert placed.fallback is not None and placed.matched_version is None


def test_rule5_template_changed_local_image_restores_volumes_on_any_worker_of_its_node_only():
    """Rule 5 (v1.1): if the template changed, any worker of the class on the image's node restores
    the volumes (TEMPLATE_CHANGED); never a worker elsewhere."""
    log = Log()
    log.worker("w-a", runtime(V2), node="n-a")  # on the node, cannot load V1
    log.worker("w-b", runtime(V1), node="n-b", mem=65536)  # could load it, elsewhere
    paused_on(log, "a", "n-a", V1)
    log.add(TemplateChanged(at=AT, actor_id="a", template_uid="t2"))
    placed = log.decide("a")
    assert (placed.worker_id, placed.fidelity, placed.fallback.reason) == (
        "w-a", PlacedFidelity.VOLUMES, FallbackReason.TEMPLATE_CHANGED)


def test_rule5_a_node_with_only_other_classes_workers_is_failed_precondition_naming_node_and_revert():
    """Rule 5 (v1.1): a node with no registered worker *of the class* (a worker of another class
    there does not count) is FAILED_PRECONDITION naming the node and revert, not RESOURCE_EXHAUSTED."""
    log = Log()
    log.add(registered("other", entry(runtime(V1), sandbox_class="other-class"), node="n-a"))
    log.worker("w-b", runtime(V1), node="n-b")
    paused_on(log, "a", "n-a", V1)
    error = refused(log, "a", ErrorCode.FAILED_PRECONDITION)
    assert "n-a" in error.message and "revert" in error.message
    why = log.explain("a")
    assert why.decision is None and why.refusal.code is ErrorCode.FAILED_PRECONDITION


def test_rule5_a_drained_worker_of_the_class_on_the_node_is_registered_so_busy_not_lost():
    log = Log()
    log.worker("w-a", runtime(V1), node="n-a")
    log.drain("w-a")
    paused_on(log, "a", "n-a", V1)
    refused(log, "a", ErrorCode.RESOURCE_EXHAUSTED)


def test_rule4_rule3_restore_of_a_volumes_snapshot_keeps_the_stamps_architecture():
    log = Log()
    arm = version("v1", arch="arm64")
    log.worker("w-amd", runtime(V1), mem=65536)
    log.actor("a", snapshot=golden(arm, fidelity=Fidelity.VOLUMES, borrowed=False))
    refused(log, "a", ErrorCode.RESOURCE_EXHAUSTED)  # the amd64 worker has room, but not the architecture
    log.worker("w-arm", runtime(arm))
    assert log.decide("a").worker_id == "w-arm"


def test_rule4_a_stamp_without_architecture_imposes_none():
    noarch = CompatVersion(schema_version="v2", attributes=(Attribute(key="kernel_digest", value="k"),))
    log = Log()
    log.worker("w-arm", runtime(version("v1", arch="arm64")))
    log.actor("a", snapshot=golden(noarch))  # MEMORY, no worker accepts it: a fallback anywhere
    placed = log.decide("a")
    assert placed.worker_id == "w-arm" and placed.fallback.reason is FallbackReason.NO_COMPATIBLE_WORKER


def test_rule6_room_books_resources_plus_the_chosen_runtimes_overhead_with_ceil_gib():
    """Rule 6: room = capacity - 64 MiB - booked; booked = memory + fixed + per_gib * ceil(mem/1024)."""
    log = Log()
    edge = runtime(V2, overhead=10, per_gib=7, compatible=(V1,))
    mem = 1025  # ceil(1025 / 1024) = 2
    need = mem + 10 + 7 * 2
    log.worker("w", edge, mem=need + 64, cpu=300)
    log.actor("a", cpu=300, mem=mem, snapshot=golden(V1))
    placed = log.decide("a")
    assert placed.booked.memory_mib == need and placed.booked.cpu_millis == 300
    log2 = Log()
    log2.worker("w", edge, mem=need + 63, cpu=300)
    log2.actor("a", cpu=300, mem=mem, snapshot=golden(V1), min_fidelity=Fidelity.MEMORY)
    refused(log2, "a", ErrorCode.RESOURCE_EXHAUSTED)


def test_rule4a_floor_volumes_with_a_full_compatible_worker_falls_back_at_volumes_not_below():
    log = Log()
    log.worker("compat", runtime(V1), mem=100)  # too small
    log.worker("other", runtime(V2), mem=65536)
    log.actor("a", min_fidelity=Fidelity.VOLUMES, snapshot=golden(V1, borrowed=False))
    placed = log.decide("a")
    assert (placed.worker_id, placed.fidelity) == ("other", PlacedFidelity.VOLUMES)
    log.actor("r", min_fidelity=Fidelity.VOLUMES, snapshot=golden(V1, borrowed=False, fidelity=Fidelity.ROOTFS))
    error = refused(log, "r", ErrorCode.FAILED_PRECONDITION)
    assert "ROOTFS" in error.message


def test_rule4a_memory_floor_with_a_full_compatible_worker_is_resource_exhausted():
    log = Log()
    log.worker("compat", runtime(V1), mem=100)
    log.worker("other", runtime(V2), mem=65536)
    log.actor("a", min_fidelity=Fidelity.MEMORY, snapshot=golden(V1))
    refused(log, "a", ErrorCode.RESOURCE_EXHAUSTED)
    log.add(TemplateChanged(at=AT, actor_id="a", template_uid="t2"))
    error = refused(log, "a", ErrorCode.FAILED_PRECONDITION)
    assert "template" in error.message


def test_rule4a_memory_floor_with_no_worker_accepting_the_stamp_says_so_with_the_same_code():
    """RESOURCE_EXHAUSTED either way (docs/contract.md: a rolling upgrade can bring one back), but
    "no compatible worker has room" read as busy where none is registered at all (a walkthrough)."""
    log = Log()
    log.worker("other", runtime(V2), mem=65536)
    log.actor("a", min_fidelity=Fidelity.MEMORY, snapshot=golden(V1))
    error = refused(log, "a", ErrorCode.RESOURCE_EXHAUSTED)
    assert error.message.endswith("; no registered worker accepts its memory image's runtime and min_fidelity is "
                                  "MEMORY: more room does not help until one that does registers (a rolling "
                                  "upgrade can bring one back)")
    log.worker("compat", runtime(V1), mem=100)  # one that accepts it, full
    assert refused(log, "a", ErrorCode.RESOURCE_EXHAUSTED).message.endswith(
        "; no compatible worker has room and min_fidelity is MEMORY")


def test_revert_to_none_cold_boots_unless_the_floor_is_memory():
    log = Log()
    log.worker("w-b", runtime(V1), node="n-b")
    paused_on(log, "a", "n-a", V1)
    refused(log, "a", ErrorCode.FAILED_PRECONDITION)
    log.add(ActorReverted(at=AT, actor_id="a", snapshot=None,
                          abandoned=snap("a", V1, snapshot_id="a-p", node="n-a"), reason="node gone"))
    placed = log.decide("a")
    assert (placed.worker_id, placed.action, placed.fidelity) == ("w-b", Action.RUN, PlacedFidelity.NONE)
    paused_on(log, "m", "n-a", V1, min_fidelity=Fidelity.MEMORY)
    log.add(ActorReverted(at=AT, actor_id="m", snapshot=None,
                          abandoned=snap("m", V1, snapshot_id="m-p", node="n-a"), reason="node gone"))
    refused(log, "m", ErrorCode.FAILED_PRECONDITION)  # nothing to restore, and a cold boot is below MEMORY


# --- whatif (v1.1), pure ------------------------------------------------------------------------------


def _reordered(v: CompatVersion) -> CompatVersion:
    return CompatVersion(schema_version=v.schema_version, attributes=tuple(reversed(v.attributes)))


def test_whatif_drop_is_judged_by_version_equality_whatever_the_attribute_order():
    log = Log()
    log.worker("old", runtime(V1))
    log.worker("edge", runtime(V2, compatible=(V1,)))
    # a SUSPENDED actor stamped V1: dropping V1 (in any attribute order) strands it, also through the edge
    log.actor("s")
    placed = log.decide("s")
    log.place(placed)
    log.add(taken(snap("s", V1, snapshot_id="s-1", uri="s3://s"), SnapshotOrigin.SUSPEND))
    cls = placed.sandbox_runtime.sandbox_class
    for drop in (V1, _reordered(V1)):
        answer = whatif(log.p, WhatIf(sandbox_class=cls, drop_runtimes=(drop,)))
        assert (answer.before.stranded_snapshots, answer.after.stranded_snapshots) == (0, 1), drop
        assert [s.actor_id for s in answer.newly_stranded] == ["s"]
    # dropping V2 only: old still restores V1
    answer = whatif(log.p, WhatIf(sandbox_class=cls, drop_runtimes=(V2,)))
    assert answer.after.stranded_snapshots == 0
    # draining old: edge still accepts V1 through its compatible version
    answer = whatif(log.p, WhatIf(sandbox_class=cls, drain_workers=("old",)))
    assert answer.after.stranded_snapshots == 0
    answer = whatif(log.p, WhatIf(sandbox_class=cls, drain_workers=("old",), drop_runtimes=(V2,)))
    assert answer.after.stranded_snapshots == 1


# --- rule 8 (v1.1): a label change racing a placement wins -------------------------------------------

async def test_a_label_change_between_decision_and_commit_wins(stack, nc, prefix, replicas):
    """Rule 8 names "a drain, removal, runtime change, capacity or label change"; the existing test
    covers all but a label change."""
    async def relabel(wb):
        assert (await wb.register(worker("w1", VA, node="n1", labels={"zone": "b"}))).outcome.value == "UPDATED"

    error, placed = await _decided_then(stack, nc, prefix, replicas, relabel)
    assert type(error).__name__ == "IntegrityError", error
    assert placed == []


# --- "tags and golden snapshots are durable" (What v1.1 changes) ------------------------------------


async def test_a_tag_outlives_its_actors_stop_and_next_life(stack, wb, nc, prefix):
    await wb.register(worker("w", V1))
    await wb.create(actor("a"))
    await wb.resume("a")
    await wb.suspend("a", uri="s3://a/1")
    tagged = await wb.tag("a", "base")
    await wb.stop("a")
    await wb.create(actor("a"))  # its next life
    await wb.create(actor("b", source_tag="base"))
    placed = await wb.resume("b")
    assert (placed.fidelity, placed.snapshot_id) == (PlacedFidelity.MEMORY, tagged.snapshot.snapshot_id)


# --- section 1 (v1.1): every verb's request_id is scoped to one life ----------------------------------


async def test_an_earlier_lifes_ids_start_new_lives_and_are_refused_by_the_verbs_that_do_not(wb, nc, prefix):
    """v1.1 names a registration and a create with an earlier life's id as new requests: they start
    the next life. Every other verb of the registry and the snapshotter refuses an id an earlier life
    used (FAILED_PRECONDITION, field request_id, nothing written): a late copy of an earlier life's
    request is told from nothing else, and it suspended the next life under the wrong pin (a soak's
    finding; docs/contract.md). So does the scheduler's resume, for an id among the last life's recent
    placements (chosen 2026-12-06; it was a new request: a failover test had a copy held in a stopped
    NATS server place the next life under an id whose retry life 1 had answered)."""
    await wb.register(worker("w", V1, request_id="reg-1"))
    first = await wb.drain("w", request_id="d-1")
    await wb.remove("w", request_id="rm-1")
    await wb.register(worker("w", V1, request_id="reg-1"))  # life 2, begun by life 1's registration id
    for again in (wb.drain("w", request_id="d-1"), wb.remove("w", request_id="rm-1")):
        with pytest.raises(ContractError) as refused:
            await again
        assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "request_id")
        assert "earlier life" in refused.value.message
    assert [e for _, e in await read_log(nc, prefix) if isinstance(e, WorkerDrained)] == [
        e for s, e in await read_log(nc, prefix) if s == first.seq]

    await wb.register(worker("w2", V1))
    await wb.create(actor("a", request_id="c-1"))
    await wb.resume("a", request_id="r-1")
    p1 = await wb.pause("a", request_id="p-1")
    await wb.stop("a", request_id="s-1")
    await wb.create(actor("a", request_id="c-1"))  # life 2, begun by life 1's create id
    with pytest.raises(ContractError) as refused:  # life 1's resume id: refused, not placed in life 2
        await wb.resume("a", request_id="r-1")
    assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "request_id")
    assert "earlier life of actor 'a': a resume made for that life" in refused.value.message
    assert not [e for _, e in await read_log(nc, prefix) if isinstance(e, ActorPlaced) and e.request_id == "r-1"][1:]
    r2 = await wb.resume("a", request_id="r-2")  # life 2: a new resume (a cold start), not life 1's answer
    assert r2.fidelity is PlacedFidelity.NONE
    for again in (wb.pause("a", request_id="p-1"), wb.stop("a", request_id="s-1")):
        with pytest.raises(ContractError) as refused:
            await again
        assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "request_id")
    snapshots = [e for _, e in await read_log(nc, prefix) if isinstance(e, SnapshotTaken)]
    assert [e.snapshot.snapshot_id for e in snapshots] == [p1.snapshot.snapshot_id]
    p2 = await wb.pause("a", request_id="p-2")  # a new id: a pause of life 2
    assert p2.seq > p1.seq and p2.snapshot.snapshot_id != p1.snapshot.snapshot_id


def test_the_last_life_s_resume_ids_are_kept_exactly_and_through_a_checkpoint():
    """What the committer refuses a resume id by (`Actor.placed_earlier`): the recent placements of the
    actor's last life, exactly (a new id is never taken for one), the same in a replica that started
    from a checkpoint; a further life keeps only the life before it."""
    from events.schema import ActorStopped, ReleaseReason
    from services.scheduler.checkpoint_codec import export_state, restore_state
    from services.scheduler.records import request_hash

    log = Log()
    log.worker("w")
    log.actor("a")
    log.place(log.decide("a"), request_id="r-1")
    placed = log.p.actors["a"].placed_by(request_hash("r-1"))
    assert placed and not log.p.actors["a"].placed_earlier(request_hash("r-1"))  # this life's: answered
    log.release("a", "w", ReleaseReason.STOPPED)
    log.add(ActorStopped(at=AT, actor_id="a"))
    log.actor("a")  # life 2
    for p in (log.p, restore_state(export_state(log.p))):
        a = p.actors["a"]
        assert (a.placed_by(request_hash("r-1")), a.placed_earlier(request_hash("r-1"))) == (0, placed)
        assert not any(a.placed_earlier(request_hash(f"new-{i}")) for i in range(1000))
    log.place(log.decide("a"), request_id="r-2")
    log.release("a", "w", ReleaseReason.STOPPED)
    log.add(ActorStopped(at=AT, actor_id="a"))
    log.actor("a")  # life 3: life 2's ids, not life 1's
    a = log.p.actors["a"]
    assert a.placed_earlier(request_hash("r-2")) and not a.placed_earlier(request_hash("r-1"))


def test_whatif_of_a_class_whose_every_worker_was_removed_is_not_found():
    """As for a resume: a class whose every worker was removed has none registered (a review)."""
    log = Log()
    log.worker("w1")
    log.worker("other", sandbox_class="microvm")
    log.add(WorkerRemoved(at=AT, worker_id="w1", reason="decommissioned"))
    with pytest.raises(ContractError) as refused:
        whatif(log.p, WhatIf(sandbox_class="gvisor"))
    assert refused.value.code is ErrorCode.NOT_FOUND
    assert refused.value.message == "no worker has registered the sandbox class 'gvisor' (registered: microvm)"
