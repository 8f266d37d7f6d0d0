"""One worker as the scheduler's projection has it: a scheduler's `worker` answer (a project addition), else
the whole log folded by `warmboot worker show` itself, into the same answer (`worker_detail`).

`worker show w-gv0-000` at 10,000 workers folded the whole log (71,000 messages, 5.3 s: docs/scaling.md),
although all it prints is the scheduler's projection of one worker. One request now answers it from a
replica's fold; the log's fold stays as the way when no scheduler answers (none runs, or one of an
earlier version).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner

from events.errors import ContractError
from events.schema import ErrorCode, ReleaseReason, SnapshotOrigin
from services.scheduler.projection import Projection
from services.scheduler.worker_detail import worker_detail
from tests.factories import (booked, created, entry, fold, last_seq, log_reads, placed, registered, released, runtime,
                             snapshot, stamp, taken, version)
from warmboot.cli import main
from warmboot.client import Client
from warmboot.cmd_worker import detail_view, worker_view
from warmboot.cmd_views import runtimes_of, worker_rows

V1, V1B, V2, FC = (version(b) for b in ("v1", "v1b", "v2", "fc1"))
GVISOR = entry(runtime(V2, "runsc-v2", 16, compatible=(V1,)), (runtime(V1B, "runsc-v1b", compatible=(V1,)),))
MICROVM = entry(runtime(FC, "fc-1"), sandbox_class="microvm")
PIN = stamp(V2, name="runsc-v2")
FC_PIN = stamp(FC, "microvm", name="fc-1")


def paused(actor_id: str, node: str, pin=PIN, **fields):
    """A PAUSE snapshot LOCAL on `node`, and its release: the actor waits, its image on that node alone."""
    return [taken(snapshot(actor_id, pin, node=node, snapshot_id=f"{actor_id}-v3", **fields), SnapshotOrigin.PAUSE),
            released(actor_id, "w-1", ReleaseReason.PAUSED)]

FLEET = [
    registered("w-1", GVISOR, MICROVM, node="node-a", labels={"zone": "a", "disk": "ssd"}, cpu=8000, mem=8192),
    registered("w-2", entry(runtime(V1, "runsc-v1")), node="node-a"),  # the same node, gvisor alone
    registered("w-3", GVISOR, node="node-b"),
    created("r-2", cpu=250, mem=512), placed("r-2", "w-1", PIN, node="node-a", cpu=250, mem=512), booked("w-1", "r-2"),
    created("r-1"), placed("r-1", "w-1", PIN, node="node-a"), booked("w-1", "r-1"),
    created("m-1", sandbox_class="microvm"), placed("m-1", "w-1", FC_PIN, node="node-a", sandbox_class="microvm"),
    booked("w-1", "m-1"),
    created("r-3"), placed("r-3", "w-3", PIN, node="node-b"), booked("w-3", "r-3"),  # booked on another worker
    # waiting actors whose image is LOCAL on node-a: listed, by actor id
    created("p-2"), placed("p-2", "w-1", PIN, node="node-a"), booked("w-1", "p-2"), *paused("p-2", "node-a"),
    created("p-1"), taken(snapshot("p-1", None, node="node-a")),  # unstamped, SUSPENDED with its image there
    created("m-2", sandbox_class="microvm"), taken(snapshot("m-2", FC_PIN, node="node-a", sandbox_class="microvm")),
    # not listed for w-1: an image on another node (w-3's), an EXTERNAL one
    created("q-1"), taken(snapshot("q-1", PIN, node="node-b")),
    created("s-1"), taken(snapshot("s-1", PIN)),
]


def cli(*args: str, width: int = 100):
    return asyncio.to_thread(CliRunner().invoke, main, list(args), env={"COLUMNS": str(width)})


def test_a_worker_s_detail_is_its_rows_of_workers_its_booked_actors_and_the_local_images_on_its_node():
    projection = fold(FLEET, Projection())
    detail = worker_detail(projection, "w-1")
    assert (detail.node, detail.state.value, detail.labels) == ("node-a", "REGISTERED", {"zone": "a", "disk": "ssd"})
    assert (detail.capacity.cpu_millis, detail.free.cpu_millis) == (8000, 8000 - 250 - 500 - 500)
    assert [c.sandbox_class for c in detail.classes] == ["gvisor", "microvm"]
    assert detail.classes[0].default_runtime.actor_overhead.fixed_mib == 16  # what the scheduler counts per actor
    assert [(a.actor_id, a.sandbox_class, a.state.value, a.pin) for a in detail.actors] == [
        ("m-1", "microvm", "RUNNING", FC_PIN), ("r-1", "gvisor", "RUNNING", PIN), ("r-2", "gvisor", "RUNNING", PIN)]
    assert [(i.actor_id, i.state.value, i.snapshot_id, i.stamp) for i in detail.local_images] == [
        ("m-2", "SUSPENDED", "m-2-s", FC_PIN), ("p-1", "SUSPENDED", "p-1-s", None), ("p-2", "PAUSED", "p-2-v3", PIN)]
    # w-2, on the same node, runs no microvm: m-2's image is not its concern
    assert [i.actor_id for i in worker_detail(projection, "w-2").local_images] == ["p-1", "p-2"]
    assert [i.actor_id for i in worker_detail(projection, "w-3").local_images] == ["q-1"]  # on node-b

    runtimes = runtimes_of(projection)
    view = detail_view(detail, runtimes)
    # its classes are its rows of `warmboot workers`, as `worker_rows` makes them for the whole fleet
    rows = [r for r in worker_rows(projection, runtimes) if r["worker_id"] == "w-1"]
    assert [{k: v for k, v in row.items() if k != "compatible"} for row in view["classes"]] == rows
    assert [(r["actors"], r["worker_actors"], r["compatible"]) for r in view["classes"]] == [
        (2, 3, [runtimes.label("gvisor", V1)]), (1, 3, [])]
    assert [a["pin"] for a in view["actors"]] == ["fc-1", "runsc-v2", "runsc-v2"]
    assert view["local_images"][1] == {"actor_id": "p-1", "state": "SUSPENDED", "snapshot_id": "p-1-s",
                                       "fidelity": "MEMORY", "stamp": "unstamped"}
    assert view == worker_view("w-1", projection)

    with pytest.raises(ContractError) as missing:
        worker_detail(projection, "nobody")
    assert (missing.value.code, missing.value.field) == (ErrorCode.NOT_FOUND, "worker_id")
    assert missing.value.message == "worker 'nobody' is not registered"


async def test_a_scheduler_answers_worker_show_as_the_log_s_fold_does_without_reading_the_log(
        nats_url, nc, prefix, writer, replicas, monkeypatch):
    from warmboot import cli_common
    from warmboot.audit import Sink

    last = await asyncio.to_thread(writer.write, *FLEET)
    args = ("--nats", nats_url, "--prefix", prefix)
    # no scheduler: the command folds the whole log, as it did before the endpoint
    folded = (await cli_common.replay(nc, prefix, Sink(), False)).projection
    expected = worker_view("w-1", folded)
    alone = await cli("worker", "show", "w-1", "-o", "json", *args)
    assert alone.exit_code == 0 and alone.stderr == "", alone.output
    assert json.loads(alone.stdout) == expected
    text = await cli("worker", "show", "w-1", *args)
    assert text.exit_code == 0, text.output

    await replicas(catch_up_s=0.5)
    answer = await Client(nc, prefix).worker("w-1", min_seq=last)
    assert answer == worker_detail(folded, "w-1")

    read = log_reads(monkeypatch)
    asked: list[int | None] = []
    ask = Client.worker

    async def recorded(self, worker_id, min_seq=None):
        asked.append(min_seq)
        return await ask(self, worker_id, min_seq)

    monkeypatch.setattr(Client, "worker", recorded)
    shown = await cli("worker", "show", "w-1", "-o", "json", *args)
    assert shown.exit_code == 0 and shown.stderr == "", shown.output
    assert json.loads(shown.stdout) == expected
    assert asked == [await last_seq(nc, prefix)]  # at least what the log held when asked
    assert (await cli("worker", "show", "w-1", *args)).stdout == text.stdout
    gone = await cli("worker", "show", "nobody", *args)
    assert (gone.exit_code, gone.stdout) == (1, "")
    assert gone.stderr == "error: NOT_FOUND worker_id: worker 'nobody' is not registered\n", gone.stderr
    assert read == []  # nothing of the log folded: the scheduler said it all


async def test_the_endpoint_refuses_an_unknown_worker_and_waits_for_min_seq(nc, prefix, writer, replicas):
    last = await asyncio.to_thread(writer.write, *FLEET[:3])
    await replicas(catch_up_s=0.5)
    wb = Client(nc, prefix, attempts=1)
    with pytest.raises(ContractError) as missing:
        await wb.worker("nobody", min_seq=last)
    assert (missing.value.code, missing.value.field) == (ErrorCode.NOT_FOUND, "worker_id")
    assert missing.value.message == "worker 'nobody' is not registered"
    with pytest.raises(ContractError) as ahead:  # answered from state that includes it, or not at all
        await wb.worker("w-1", min_seq=last + 100)
    assert (ahead.value.code, ahead.value.field) == (ErrorCode.UNAVAILABLE, "min_seq")
    with pytest.raises(ContractError) as bad:
        await wb.worker("a b")
    assert (bad.value.code, bad.value.field) == (ErrorCode.INVALID_ARGUMENT, "worker_id")
