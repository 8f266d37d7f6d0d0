"""Rule 5 with node tokens, over the bus: the registry, the scheduler and the snapshotter of one stack.

A worker's machine is replaced under its worker id and node name (docs/operations.md, "a machine
replaced"). Before node tokens, the resume of an actor paused on the old machine was sent to the new
one at MEMORY: its LOCAL image, on the old disk, cannot load there. Now the registration from the new
disk ends the worker's life (its running actors released), and the paused actor's resume is refused
FAILED_PRECONDITION, naming the node and `revert`, with nothing written; `audit verify` finds the log
clean.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from click.testing import CliRunner

from events.errors import ContractError
from events.schema import (Action, ActorPlaced, ActorReleased, ErrorCode, PlacedFidelity, ReleaseReason,
                           WorkerRegistered, WorkerRemoved)
from tests.factories import actor, last_seq, read_log, version, wait_for, worker
from warmboot.cli import main
from warmboot.client import Client

V1 = version("1")


async def test_a_machine_replaced_under_its_worker_id_and_node_gets_no_image_of_the_old_disk(
        stack, nc, prefix, nats_url):
    wb = Client(nc, prefix)
    assert (await wb.register(worker("w1", V1, node="n1", node_token="disk-a"))).outcome.value == "REGISTERED"
    await wb.create(actor("paused", cpu=100, mem=256))
    await wb.create(actor("running", cpu=100, mem=256))
    placed_at = await wb.resume("paused")
    await wb.pause("paused", placement_seq=placed_at.seq)
    await wb.resume("running")
    # the same machine, its agent restarted: the same disk, the same life
    assert (await wb.register(worker("w1", V1, node="n1", node_token="disk-a"))).outcome.value == "UNCHANGED"

    before = await last_seq(nc, prefix)
    replaced = await wb.register(worker("w1", V1, node="n1", node_token="disk-b"))
    assert replaced.outcome.value == "REGISTERED"
    written = [(seq, e) for seq, e in await read_log(nc, prefix) if seq > before]
    removed, began = written[0][1], written[1][1]
    assert isinstance(removed, WorkerRemoved) and "another disk of node n1" in removed.reason
    assert isinstance(began, WorkerRegistered) and began.node_token == "disk-b" and written[1][0] == replaced.seq
    # the old machine's running actor is released by the snapshotter (what ran there is gone)
    await wait_for(nc, prefix, lambda e: isinstance(e, ActorReleased) and e.actor_id == "running"
                   and e.reason is ReleaseReason.WORKER_REMOVED, after=before)

    at = await last_seq(nc, prefix)
    with pytest.raises(ContractError) as refused:
        await wb.resume("paused", request_id="r-after")
    error = refused.value
    assert error.code is ErrorCode.FAILED_PRECONDITION
    assert "LOCAL image on node n1" in error.message and "warmboot actor revert paused" in error.message
    assert "registered from another disk since" in error.message
    assert await last_seq(nc, prefix) == at  # nothing written
    shown = await asyncio.to_thread(CliRunner().invoke, main, ["actor", "show", "paused", "--nats", nats_url,
                                                               "--prefix", prefix])
    assert shown.exit_code == 0, shown.output
    assert any(line.startswith("LOST") and "warmboot actor revert paused" in line
               for line in shown.output.splitlines()), shown.output
    # the replay's summary counts the image as lost: no worker of its class is on its disk any more
    summary = await asyncio.to_thread(
        CliRunner().invoke, main, ["audit", "replay", "--nats", nats_url, "--prefix", prefix])
    assert summary.exit_code == 0, summary.output
    assert re.search(r"^local snapshots on no registered worker's node or disk \(lost\) +1$", summary.stdout,
                     re.MULTILINE), summary.stdout
    # given up, the actor cold-boots on the new machine; the released one runs there again
    await wb.revert("paused")
    cold = await wb.resume("paused")
    assert (cold.worker_id, cold.action, cold.fidelity) == ("w1", Action.RUN, PlacedFidelity.NONE)
    assert (await wb.resume("running")).worker_id == "w1"

    result = await asyncio.to_thread(
        CliRunner().invoke, main, ["audit", "verify", "--nats", nats_url, "--prefix", prefix])
    assert result.exit_code == 0 and "no violation" in result.output, result.output
    memory = [e for _, e in await read_log(nc, prefix)
              if isinstance(e, ActorPlaced) and e.fidelity is PlacedFidelity.MEMORY]
    assert memory == []  # no image was ever restored after its pause: the only one was on the old disk


async def test_another_worker_of_the_same_disk_restores_the_image_and_one_of_a_new_disk_does_not(
        stack, nc, prefix):
    wb = Client(nc, prefix)
    await wb.register(worker("w1", V1, node="n1", node_token="disk-a", mem=1024))
    await wb.create(actor("a", cpu=100, mem=256))
    placed_at = await wb.resume("a")
    await wb.pause("a", placement_seq=placed_at.seq)
    await wb.drain("w1")
    # a second worker of the same machine (the same token file), and one of a machine put under the
    # same node name by mistake, much roomier
    await wb.register(worker("w3", V1, node="n1", node_token="disk-c", mem=65536))
    await wb.register(worker("w2", V1, node="n1", node_token="disk-a", mem=2048))
    for _ in range(3):
        restored = await wb.resume("a")
        assert (restored.worker_id, restored.fidelity) == ("w2", PlacedFidelity.MEMORY)
        await wb.pause("a", placement_seq=restored.seq)


async def test_an_agent_restarted_without_its_token_file_is_refused_and_nothing_written(stack, nc, prefix):
    """Its registration could not say which disk it is on (on the machine that replaced the node's first, it
    would be taken as on that first disk): refused naming node_token, in its life and after it ended."""
    wb = Client(nc, prefix)
    await wb.register(worker("w1", V1, node="n1", node_token="disk-b"))
    for removed in (False, True):
        if removed:
            await wb.remove("w1")  # and in a later life alike
        at = await last_seq(nc, prefix)
        with pytest.raises(ContractError) as refused:
            await wb.register(worker("w1", V1, node="n1"))
        assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "node_token")
        assert "--node-token-file" in refused.value.message
        assert await last_seq(nc, prefix) == at


async def test_worker_show_and_workers_wide_name_the_disk_each_worker_registered(stack, nc, prefix, nats_url):
    wb = Client(nc, prefix)
    await wb.register(worker("w1", V1, node="n1", node_token="disk-a"))
    await wb.register(worker("w2", V1, node="n2"))
    await wb.create(actor("a", cpu=100, mem=256))
    placed_at = await wb.resume("a", selectors=None)
    await wb.pause("a", placement_seq=placed_at.seq)
    on = placed_at.worker_id

    def run(*args: str):
        return CliRunner().invoke(main, [*args, "--nats", nats_url, "--prefix", prefix])

    shown = await asyncio.to_thread(run, "worker", "show", "w1")
    assert shown.exit_code == 0, shown.output
    assert any(line.split() == ["NODE", "TOKEN", "disk-a"] for line in shown.output.splitlines()), shown.output
    if on == "w1":
        assert "local images on n1, on the disk of node token disk-a" in shown.output
    plain = await asyncio.to_thread(run, "worker", "show", "w2")
    assert "NODE TOKEN" not in plain.output
    as_json = await asyncio.to_thread(run, "worker", "show", "w1", "-o", "json")
    assert json.loads(as_json.output)["node_token"] == "disk-a"
    wide = await asyncio.to_thread(run, "workers", "-o", "wide")
    assert wide.exit_code == 0, wide.output
    header, *rows = wide.output.splitlines()
    assert "NODE TOKEN" in header
    column = header.index("NODE TOKEN")
    tokens = {row.split()[0]: row[column:].split()[0] for row in rows if row.strip()}
    assert tokens == {"w1": "disk-a", "w2": "-"}, wide.output
