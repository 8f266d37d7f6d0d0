"""Two agents started with one worker id (two machines configured alike), on a real nats-server with a
real registry: what the log says the worker is, against the machines that beat it."""

from __future__ import annotations

import asyncio
import sys
import time
from asyncio.subprocess import Process
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import pytest

from events.schema import Event, RuntimeChanged, WorkerRegistered, WorkerRemoved
from events.subjects import bucket_name
from events.natspy.publish import flush_in_order
from tests.registry_helpers import (AMD, CPUINFO, agent_config, raw_request, registration, running_registry, runtime,
                                    wait_event, worker_events)
from tests.factories import cancelled_and_ended
from tests.test_agent import agent_running
from warmboot.agent import Agent
from warmboot.agent_rules import Superseded
from warmboot.agent_config import ProbeSettings


def machine(nats_url: str, prefix: str, tmp_path, name: str, cpuinfo, node: str = "node-a") -> Agent:
    path = tmp_path / f"{name}.toml"
    path.write_text(agent_config("v1"))
    return Agent(nats_url, "w-a", node, path, prefix=prefix, watch_interval_s=0.05,
                 probe=ProbeSettings(cpuinfo_path=cpuinfo, architecture="amd64"),
                 state_file=tmp_path / f"{name}.revision")


async def agent_process(nats_url: str, prefix: str, config: Path, node: str, *more: str) -> Process:
    """`warmboot agent` of w-a on `node` (the intel machine's CPU), a process of its own: its output piped."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from warmboot.cli import main; main()",
        "agent", "--nats", nats_url, "--worker-id", "w-a", "--node", node, "--config", str(config),
        "--prefix", prefix, "--watch-interval", "0.05", "--cpuinfo", str(CPUINFO), "--arch", "amd64", *more,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def process_ended(process: Process, within: float) -> bool:
    """`process` (`agent_process`) sent SIGTERM if it still runs, and waited for: whether it ended within
    `within` s. One that did not is killed (and waited for: a kill ends it), its output then printed."""
    if process.returncode is None:
        process.terminate()
    try:
        await asyncio.wait_for(process.wait(), within)
        return True
    except asyncio.TimeoutError:
        process.kill()
        out, err = await asyncio.wait_for(process.communicate(), 30)
        print(f"the process {process.pid} did not end within {within:g}s of its SIGTERM; killed. Its output:\n"
              f"{out.decode(errors='replace')}{err.decode(errors='replace')}")
        return False


@asynccontextmanager
async def beats_of(nc, prefix: str, worker_id: str) -> AsyncIterator[asyncio.Queue[float]]:
    """The monotonic time of each put in `worker_id`'s heartbeat key, as the server stores it."""
    stored: asyncio.Queue[float] = asyncio.Queue()

    async def put(msg) -> None:
        stored.put_nowait(time.monotonic())

    sub = await nc.subscribe(f"$KV.{bucket_name(prefix, 'heartbeats')}.{worker_id}", cb=put)
    await flush_in_order(nc)
    try:
        yield stored
    finally:
        await sub.unsubscribe()


@asynccontextmanager
async def agent_task(agent: Agent) -> AsyncIterator[asyncio.Task[None]]:
    """`agent` runs in the block as a task the block awaits itself (to see it stop as superseded); one still
    running at the end is cancelled (`agent_running` instead stops it, and raises its run's error)."""
    task = asyncio.create_task(agent.run(asyncio.Event()))
    try:
        yield task
    finally:
        await cancelled_and_ended(task, 15, "the agent's task")  # (nothing, if it ended)


async def test_a_second_agent_s_registration_is_not_kept_alive_by_the_first_one_s_beats(nats_url, nc, prefix,
                                                                                        tmp_path):
    """Machine `intel` runs the agent of w-a; machine `amd` is started with the same worker id and
    node (a copied configuration, a replacement started before the old one was stopped), registers
    its CPU over the first one's, and stops. The intel agent's beats kept the registration of a CPU
    no running machine of w-a has, for as long as it ran (no TTL ended it), and images of the AMD
    CPU were placed on w-a (an audit). A beat names the registration it keeps alive (its revision),
    so intel's is refused. It registered its machine again (a registration on its own node was taken
    for its own) until 2026-12-07, and the two took w-a from each other at every beat while both ran;
    now it stops, and the registration amd left ends as LOST: nothing keeps it alive."""
    ttl = 2.0
    async with running_registry(nats_url, prefix, ttl_s=ttl):
        async with agent_task(machine(nats_url, prefix, tmp_path, "intel", CPUINFO)) as first:
            seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
            async with agent_running(machine(nats_url, prefix, tmp_path, "amd", AMD)):
                seq, _ = await wait_event(nc, prefix, "w-a", RuntimeChanged, after=seq)
                with pytest.raises(Superseded) as stopped:
                    await asyncio.wait_for(first, 4 * ttl)  # at its next beat, a third of a TTL
            assert "another agent on this agent's node node-a" in stopped.value.message, stopped.value.message
            _, lost = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq, timeout=4 * ttl)
            assert lost.reason == "LOST", lost
    kinds = [type(event).__name__ for event in await log_of(nc, prefix, "w-a")]
    # intel's registration, amd's take and the one fence of each write, then the end of amd's life: no more
    assert kinds == ["WorkerRegistered", "WorkerFenced", "RuntimeChanged", "WorkerFenced", "WorkerRemoved",
                     "WorkerFenced"], kinds


async def test_a_new_life_of_other_classes_is_not_kept_alive_by_the_first_agent_s_beats(nats_url, nc, prefix,
                                                                                       tmp_path):
    """The intel machine's agent runs w-a (class gvisor). The worker is removed, and another machine
    with the same worker id and node (a replacement started before the old one was stopped) begins a new
    life with other classes (gvisor and microvm) and its CPU, then stops. The intel agent's next beat is
    refused (another registration is in force). It registered its machine again, which the registry
    refused as a change of class, and its beats then named no revision (`_forget_revision`): they kept the
    other machine's registration (a class and a CPU it does not have) alive for as long as it ran. Since
    2026-12-07 an agent stops for another agent's registration above its own, on its node too: the other
    machine's life ends as LOST, and the intel agent, stopped, begins none."""
    ttl = 2.0
    async with beats_of(nc, prefix, "w-a") as beat:
        async with running_registry(nats_url, prefix, ttl_s=ttl):
            async with agent_task(machine(nats_url, prefix, tmp_path, "intel", CPUINFO)) as first:
                await wait_event(nc, prefix, "w-a", WorkerRegistered)
                await asyncio.wait_for(beat.get(), 2 * ttl)
                while not beat.empty():
                    beat.get_nowait()
                await asyncio.wait_for(beat.get(), 2 * ttl)  # right after a beat: the next is ttl/3 away
                removed, _ = await raw_request(nc, prefix, "remove", "w-a", {"reason": "replaced"})
                assert "seq" in removed, removed
                other = registration("w-a", classes=[
                    {"sandbox_class": "gvisor", "default_runtime": runtime("v1")},
                    {"sandbox_class": "microvm", "default_runtime": runtime("k1")}],
                    revision=time.time_ns() // 1_000_000 + 60_000, request_id="the-other-machine")
                answer, _ = await raw_request(nc, prefix, "register", "w-a", other)
                assert answer.get("outcome") == "REGISTERED", answer
                seq = answer["seq"]
                with pytest.raises(Superseded):
                    await asyncio.wait_for(first, 4 * ttl)
                # The other machine stopped, and the intel agent: nothing keeps the other's life alive.
                seq, lost = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq, timeout=4 * ttl)
                assert lost.reason == "LOST", lost
    registered = [event for event in await log_of(nc, prefix, "w-a") if isinstance(event, WorkerRegistered)]
    assert [len(event.sandbox_classes) for event in registered] == [1, 2], registered  # intel's, the other's


async def log_of(nc, prefix: str, worker_id: str) -> list[Event]:
    """Every event about the worker, in stream order: its history's and its booking subject's (the
    `WorkerFenced` each write of its history carries, and placements)."""
    return [event for _, event in await worker_events(nc, prefix, worker_id, kind="*")]


@pytest.mark.parametrize("other_node", ["node-b", "node-a"])
async def test_an_agent_whose_worker_another_agent_registered_since_stops_and_leaves_it_there(nats_url, nc, prefix,
                                                                                             tmp_path, other_node):
    """`warmboot agent` runs w-a on node-a; an agent of the same worker id is started on node-b (a machine
    configured alike, or a replacement started before the old one was stopped). Each one's beat was
    refused as the other registered since, and each registered its machine again: the worker went back
    and forth at each beat, a move, a runtime change and a fence each time, for as long as both ran (a user
    trial). The refusal names the node in force: the node-a agent, whose beat it is, stops saying so (exit
    1), without draining the worker; the log holds one take, and node-b keeps the worker beyond its TTLs.
    The same with the second agent on node-a too (a second agent started on the machine, or one configured
    alike, `--node` included), where until 2026-12-07 the two still took the worker at every beat."""
    ttl = 2.0
    path = tmp_path / "one.toml"
    path.write_text(agent_config("v1"))
    async with running_registry(nats_url, prefix, ttl_s=ttl) as registry:
        one = await agent_process(nats_url, prefix, path, "node-a", "--drain-on-exit")
        try:
            await wait_event(nc, prefix, "w-a", WorkerRegistered)
            async with beats_of(nc, prefix, "w-a") as stored:
                async with agent_running(machine(nats_url, prefix, tmp_path, "amd", AMD, node=other_node)):
                    await wait_event(nc, prefix, "w-a", RuntimeChanged)
                    _, err = await asyncio.wait_for(one.communicate(), 4 * ttl)  # at its next beat, a third of a TTL
                    said = err.decode()
                    assert one.returncode == 1, said
                    who = "on node node-b" if other_node == "node-b" else "on this agent's node node-a"
                    assert who in said and "give each machine a worker id of its own" in said, said
                    stopped = time.monotonic()
                    while await asyncio.wait_for(stored.get(), ttl) < stopped + 3 * ttl:
                        pass  # node-b's beats, for three TTLs after node-a's agent stopped
                    assert registry.roster.alive("w-a") and registry.roster.node("w-a") == other_node
                    log = await log_of(nc, prefix, "w-a")
        finally:
            if one.returncode is None:
                one.kill()
                await one.wait()
    kinds = [type(event).__name__ for event in log]
    # node-a's registration, then the other's take (its CPU, its node if another) and the one fence of that
    # write: no more
    moved = ["WorkerUpdated"] if other_node == "node-b" else []
    assert kinds == ["WorkerRegistered", "WorkerFenced", "RuntimeChanged", *moved, "WorkerFenced"], kinds
    if moved:
        assert (log[0].node, log[3].node) == ("node-a", "node-b")
