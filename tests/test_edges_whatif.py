"""One-way compatibility edges (`compatible_versions`) and `scheduler.whatif`, over the bus."""

from __future__ import annotations

import asyncio

import pytest
from click.testing import CliRunner

from events.compat import compat_key
from events.errors import ContractError
from events.runtime_id import short_id
from events.schema import Action, CompatVersion, ErrorCode, Fidelity, PlacedFidelity, RegisterOutcome, WhatIf
from tests.factories import CLASS, actor, golden, last_seq, runtime, version, worker
from warmboot.cli import main
from warmboot.client import Client

V1, V2, V3 = version("v1"), version("v2"), version("v3")
EDGE = runtime(V2, name="gvisor-2", compatible=(V1,))  # v2 restores v1's snapshots, not the reverse


@pytest.fixture
async def wb(stack, nc, prefix):
    return Client(nc, prefix)


async def test_a_v1_snapshot_restores_through_an_edge_and_its_next_snapshot_is_stamped_v2(wb):
    await wb.register(worker("new", EDGE))
    await wb.create(actor("a", golden_snapshot=golden(V1)))
    why = await wb.explain("a")
    assert "restorable through compatible version" in why.message and why.decision.matched_version == V1
    placed = await wb.resume("a")
    assert (placed.worker_id, placed.action, placed.fidelity) == ("new", Action.RESTORE, PlacedFidelity.MEMORY)
    assert placed.sandbox_runtime.version == V2 and placed.matched_version == V1  # pinned to the runtime it runs
    suspended = await wb.suspend("a", uri="s3://a")
    assert suspended.snapshot.sandbox_runtime.version == V2  # the lineage moves forward across the edge
    again = await wb.resume("a")
    assert again.matched_version == V2 and again.sandbox_runtime.version == V2


async def test_an_edge_is_one_way(wb):
    await wb.register(worker("old", runtime(V1)))
    await wb.create(actor("a", golden_snapshot=golden(V2)))
    placed = await wb.resume("a")  # a v2 image on a v1 runtime: not from memory
    assert placed.fidelity is not PlacedFidelity.MEMORY and placed.fallback is not None
    assert placed.matched_version is None


async def test_a_workers_own_version_is_preferred_over_an_edge(wb, nc, prefix):
    await wb.register(worker("own", V1, cpu=64000, mem=65536))
    await wb.register(worker("edge", EDGE, cpu=64000, mem=65536))
    for i in range(30):
        await wb.create(actor(f"a{i}", cpu=100, mem=256, golden_snapshot=golden(V1)))
    placed = [await wb.resume(f"a{i}") for i in range(30)]
    assert {p.worker_id for p in placed} == {"own"}
    assert all(p.matched_version == V1 and p.sandbox_runtime.version == V1 for p in placed)
    await wb.drain("own")
    await wb.create(actor("late", golden_snapshot=golden(V1)))
    late = await wb.resume("late")
    assert (late.worker_id, late.matched_version, late.sandbox_runtime.version) == ("edge", V1, V2)
    why = await wb.explain("a0")
    assert "RUNNING" in why.refusal.message


async def test_a_worker_whose_own_version_has_no_room_restores_through_its_defaults_edge(wb, nc, prefix):
    """Rule 2 prefers a worker's own version to an edge when both are available: when its
    restorable runtime of the stamp's version cannot fit the actor (its overhead), its default,
    which lists that version as compatible, still restores the image from memory (rule 4:
    memory is given up only when no compatible worker has room). The audit of the log agrees."""
    from click.testing import CliRunner

    from warmboot.cli import main

    v1_costly = runtime(V1, name="gvisor-1", overhead=3000)  # booking 1024 + 3000 MiB: no room in 2048
    await wb.register(worker("w", EDGE, (v1_costly,), mem=2048))
    await wb.create(actor("a", mem=1024, golden_snapshot=golden(V1)))
    await wb.create(actor("floor", mem=512, min_fidelity=Fidelity.MEMORY, golden_snapshot=golden(V1)))
    placed = await wb.resume("a")
    assert (placed.worker_id, placed.fidelity, placed.fallback) == ("w", PlacedFidelity.MEMORY, None)
    assert placed.sandbox_runtime.version == V2 and placed.matched_version == V1  # through the edge
    assert placed.booked.memory_mib == 1024  # the default's overhead (none), not the restorable's
    floor = await wb.resume("floor")  # min_fidelity MEMORY: placed, not refused as "no room"
    assert (floor.fidelity, floor.matched_version) == (PlacedFidelity.MEMORY, V1)
    audited = await asyncio.to_thread(CliRunner().invoke, main, ["audit", "verify", "--nats",
                                                                 wb.nc.connected_url.geturl(), "--prefix", prefix])
    assert audited.exit_code == 0, audited.output


async def test_the_own_version_is_chosen_when_it_has_room_beside_an_edge_of_the_default(wb):
    await wb.register(worker("w", EDGE, (runtime(V1, name="gvisor-1", overhead=100),), mem=8192))
    await wb.create(actor("a", mem=1024, golden_snapshot=golden(V1)))
    placed = await wb.resume("a")
    assert placed.sandbox_runtime.version == V1 and placed.matched_version == V1
    assert placed.booked.memory_mib == 1124


async def test_edge_validation_names_the_field_and_writes_nothing(wb, nc, prefix):
    before = await last_seq(nc, prefix)
    cases = {
        "sandbox_classes[0].default_runtime.compatible_versions[0]": runtime(V2, compatible=(V2,)),
        "sandbox_classes[0].default_runtime.compatible_versions[1]": runtime(V2, compatible=(V1, V1)),
        "sandbox_classes[0].default_runtime.compatible_versions[0].attributes": runtime(  # v1 needs architecture
            V2, compatible=(CompatVersion(schema_version="v1", attributes=version("x").attributes[1:]),)),
    }
    for field, rt in cases.items():
        with pytest.raises(ContractError) as caught:
            await wb.register(worker("w", rt))
        assert (caught.value.code, caught.value.field) == (ErrorCode.INVALID_ARGUMENT, field)
    assert await last_seq(nc, prefix) == before


async def test_compatible_versions_are_a_set_and_part_of_the_registration(wb):
    first = await wb.register(worker("w", runtime(V3, compatible=(V1, V2))))
    assert first.outcome is RegisterOutcome.REGISTERED
    assert (await wb.register(worker("w", runtime(V3, compatible=(V2, V1))))).outcome is RegisterOutcome.UNCHANGED
    assert (await wb.register(worker("w", runtime(V3, compatible=(V2,))))).outcome is RegisterOutcome.RUNTIME_CHANGED


# --- whatif -----------------------------------------------------------------------------------


async def fleet(wb: Client) -> None:
    """Two v1 workers, one of them on the node of the paused actors; a v2 worker with an edge to v1;
    actors suspended and paused under v1 and v2."""
    await wb.register(worker("old", runtime(V1), node="n-old", cpu=64000, mem=65536))
    await wb.register(worker("mixed", V2, (V1,), node="n-mixed", cpu=64000, mem=65536))
    for i in range(6):
        await wb.create(actor(f"s{i}"))
        await wb.resume(f"s{i}")
        await wb.suspend(f"s{i}", uri=f"s3://s{i}")  # EXTERNAL, stamped with their pins
    for i in range(4):
        await wb.create(actor(f"p{i}", golden_snapshot=golden(V1)))
        await wb.resume(f"p{i}")
        await wb.pause(f"p{i}")  # LOCAL on their worker's node


async def test_whatif_forecasts_what_the_drop_then_does_and_writes_nothing(wb, nc, prefix):
    await fleet(wb)
    frag = (await wb.fragmentation(CLASS)).classes[0]
    before = await last_seq(nc, prefix)
    query = WhatIf(sandbox_class=CLASS, drop_runtimes=(V1,), limit=100)
    forecast = await wb.whatif(query)
    assert await last_seq(nc, prefix) == before  # writes nothing
    assert forecast.before.stranded_snapshots == frag.stranded_snapshots == 0
    assert forecast.after.stranded_snapshots > 0
    assert len(forecast.newly_stranded) == forecast.after.stranded_snapshots
    assert all(s.stamp.version == V1 for s in forecast.newly_stranded)
    v1 = next(r for r in forecast.runtimes if r.version == V1)
    assert (v1.workers_before, v1.workers_after) == (2, 0)

    # now make the drop: every worker stops offering v1
    await wb.register(worker("old", runtime(V2), node="n-old", cpu=64000, mem=65536))
    await wb.register(worker("mixed", V2, node="n-mixed", cpu=64000, mem=65536))
    after = (await wb.fragmentation(CLASS)).classes[0]
    assert after.stranded_snapshots == forecast.after.stranded_snapshots
    restorable = sum(r.snapshots_memory for r in after.runtimes) - after.stranded_snapshots
    assert restorable == forecast.after.memory_restorable_snapshots
    assert next(r for r in after.runtimes if r.version == V1).workers_default == 0


async def test_whatif_counts_an_edge_as_restorable_and_a_drain_as_gone(wb, nc, prefix):
    await fleet(wb)
    await wb.register(worker("edge", EDGE, node="n-edge", cpu=64000, mem=65536))
    # the two first workers drained: the EXTERNAL snapshots (v1 or v2) restore on the edge
    # worker (v1 through its edge); the LOCAL ones are on nodes left without a worker
    drained = await wb.whatif(WhatIf(sandbox_class=CLASS, drain_workers=("old", "mixed")))
    assert drained.after.stranded_snapshots == 4 and drained.after.memory_restorable_snapshots == 6
    everyone = await wb.whatif(WhatIf(sandbox_class=CLASS, drain_workers=("old", "mixed", "edge")))
    assert everyone.after.stranded_snapshots == 10
    # dropping v1 drops it everywhere, as an edge too: every v1 snapshot is stranded
    dropped = await wb.whatif(WhatIf(sandbox_class=CLASS, drop_runtimes=(V1,)))
    v1_stamped = sum(1 for s in dropped.newly_stranded if s.stamp.version == V1)
    assert v1_stamped == dropped.after.stranded_snapshots == len(dropped.newly_stranded)
    assert dropped.before == drained.before
    limited = await wb.whatif(WhatIf(sandbox_class=CLASS, drain_workers=("old", "mixed", "edge"), limit=2))
    assert len(limited.newly_stranded) == 2
    with pytest.raises(ContractError) as unknown:
        await wb.whatif(WhatIf(sandbox_class="nope"))
    assert (unknown.value.code, unknown.value.field) == (ErrorCode.NOT_FOUND, "sandbox_class")
    with pytest.raises(ContractError) as typo:  # a worker to drain that is none of the class: not "nothing changes"
        await wb.whatif(WhatIf(sandbox_class=CLASS, drain_workers=("old", "mixd")))
    assert (typo.value.code, typo.value.field) == (ErrorCode.NOT_FOUND, "drain_workers[1]")
    assert typo.value.message == "worker 'mixd' is not registered"
    assert unknown.value.message == f"no worker has registered the sandbox class 'nope' (registered: {CLASS})"


def test_whatif_takes_what_the_index_takes_an_edge_of_another_architecture_none():
    """A log from before the registry refused it may hold an arm64 edge on an amd64 default:
    placement does not index it, and whatif does not count it as restoring (found by review)."""
    from events.compat import compat_key
    from services.scheduler.records import ClassEntry, Compat, Runtime
    from services.scheduler.whatif import accepts
    from tests.factories import runtime, version

    amd, arm = version("d", "amd64"), version("e", "arm64")
    c_amd, c_arm = Compat(compat_key("gvisor", amd), amd), Compat(compat_key("gvisor", arm), arm)
    entry = ClassEntry(Runtime(c_amd, runtime(amd), edges=(c_arm,)), (), "amd64")
    assert c_arm not in entry.accepting and not accepts(entry, c_arm, frozenset())
    assert accepts(entry, c_amd, frozenset()) and not accepts(entry, c_amd, frozenset({c_amd}))


async def test_whatif_lists_the_created_actors_whose_first_resume_a_drop_strands_and_the_drop_then_does(
        wb, nc, prefix, nats_url):
    """CREATED actors starting from a golden MEMORY image of their template (stamped v1, v2, or of another
    template), none resumed yet. CONTRACT counts only PAUSED and SUSPENDED actors' images, so whatif's
    forecast of dropping v1 said nothing of them, and once v1 was dropped the one created under
    `min_fidelity: MEMORY` was refused for good (a trial of a rolling upgrade). They are listed apart,
    in the log's order, in no count; what the forecast says is what the drop then does."""
    await wb.register(worker("old", runtime(V1), node="n-old", cpu=64000, mem=65536))
    await wb.register(worker("mixed", V2, (V1,), node="n-mixed", cpu=64000, mem=65536))
    await wb.create(actor("g-mem", min_fidelity=Fidelity.MEMORY, golden_snapshot=golden(V1)))
    await wb.create(actor("g2", golden_snapshot=golden(V2, snapshot_id="golden-2")))
    await wb.create(actor("g", golden_snapshot=golden(V1)))
    await wb.create(actor("other", golden_snapshot=golden(V1, snapshot_id="golden-3", template="t2")))
    await wb.create(actor("plain"))
    before = await last_seq(nc, prefix)
    forecast = await wb.whatif(WhatIf(sandbox_class=CLASS, drop_runtimes=(V1,)))
    assert await last_seq(nc, prefix) == before  # writes nothing
    assert [s.actor_id for s in forecast.created_newly_stranded] == ["g-mem", "g"]
    assert all(s.stamp.version == V1 and s.location.value == "EXTERNAL" for s in forecast.created_newly_stranded)
    assert forecast.newly_stranded == [] and forecast.before == forecast.after  # in no count
    limited = await wb.whatif(WhatIf(sandbox_class=CLASS, drop_runtimes=(V1,), limit=1))
    assert [s.actor_id for s in limited.created_newly_stranded] == ["g-mem"]
    drained = await wb.whatif(WhatIf(sandbox_class=CLASS, drain_workers=("old",)))  # "mixed" still restores v1
    assert drained.created_newly_stranded == []

    result = await asyncio.to_thread(CliRunner().invoke, main, [
        "whatif", "--class", CLASS, "--drop-runtime", short_id(compat_key(CLASS, V1)), "--nats",
        nats_url, "--prefix", prefix], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("CREATED, IMAGE NEWLY STRANDED"))
    assert [line.split()[0] for line in lines[header + 1:header + 3]] == ["g-mem", "g"]
    assert "refused under --min-fidelity MEMORY" in result.output

    # now make the drop: every worker stops offering v1
    await wb.register(worker("old", runtime(V2), node="n-old", cpu=64000, mem=65536))
    await wb.register(worker("mixed", V2, node="n-mixed", cpu=64000, mem=65536))
    with pytest.raises(ContractError) as refused:
        await wb.resume("g-mem")
    assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED
    fell = await wb.resume("g")
    assert fell.fidelity is not PlacedFidelity.MEMORY and fell.fallback is not None
    assert (await wb.resume("g2")).fidelity is PlacedFidelity.MEMORY
    # stranded already: not newly
    assert (await wb.whatif(WhatIf(sandbox_class=CLASS, drop_runtimes=(V1,)))).created_newly_stranded == []
