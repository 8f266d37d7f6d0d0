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

from events.schema import Event, RuntimeChanged, WorkerRegistered, WorkerRemoved, WorkerUpdated
from events.subjects import bucket_name
from events.natspy.publish import flush_in_order
from tests.registry_helpers import (AMD, CPUINFO, agent_config, raw_request, registration, running_registry, runtime,
                                    wait_event, worker_events)
from tests.test_agent import agent_running
from tests.test_agent_orders import foreign_attributes
from warmboot.agent import Agent
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


async def test_a_second_agent_s_registration_is_not_kept_alive_by_the_first_one_s_beats(nats_url, nc, prefix,
                                                                                        tmp_path):
    """Machine `intel` runs the agent of w-a; machine `amd` is started with the same worker id and
    node (a copied configuration, a replacement started before the old one was stopped), registers
    its CPU over the first one's, and stops. The intel agent's beats kept the registration of a CPU
    no running machine of w-a has, for as long as it ran (no TTL ended it), and images of the AMD
    CPU were placed on w-a (an audit). A beat names the registration it keeps alive (its revision),
    so intel's is refused and intel registers its machine again: the log holds intel's CPU."""
    ttl = 2.0
    async with beats_of(nc, prefix, "w-a") as stored:
        async with running_registry(nats_url, prefix, ttl_s=ttl):
            async with agent_running(machine(nats_url, prefix, tmp_path, "intel", CPUINFO)):
                seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
                async with agent_running(machine(nats_url, prefix, tmp_path, "amd", AMD)):
                    seq, _ = await wait_event(nc, prefix, "w-a", (RuntimeChanged, WorkerRemoved), after=seq)
                stopped = time.monotonic()
                while await asyncio.wait_for(stored.get(), ttl) < stopped + 2 * ttl:
                    pass  # the intel agent's beats, for two of the amd one's TTLs after it stopped
                classes = None
                for _, event in await worker_events(nc, prefix, "w-a"):
                    if isinstance(event, (WorkerRegistered, RuntimeChanged)):
                        classes = event.sandbox_classes
                    elif isinstance(event, WorkerRemoved):
                        classes = None
                assert classes is not None and not foreign_attributes(classes, "intel"), (
                    f"w-a, run by the intel machine alone, is registered with "
                    f"{classes and foreign_attributes(classes, 'intel')}")


async def test_a_new_life_of_other_classes_is_not_kept_alive_by_the_first_agent_s_beats(nats_url, nc, prefix,
                                                                                       tmp_path):
    """The intel machine's agent runs w-a (class gvisor). The worker is removed, and another machine
    with the same worker id (a replacement started before the old one was stopped) begins a new life
    with other classes (gvisor and microvm) and its CPU, then stops. The intel agent's next beat is
    refused (another registration is in force) and it registers its machine again, which the registry
    refuses as a change of class. Its beats then named no revision (`_forget_revision`), and kept the
    other machine's registration (a class and a CPU it does not have) alive for as long as it ran.
    A beat names the last registration of this agent the registry answered until another is answered:
    refused, it keeps nothing alive, and the other machine's life ends as LOST."""
    ttl = 2.0
    async with beats_of(nc, prefix, "w-a") as beat:
        async with running_registry(nats_url, prefix, ttl_s=ttl):
            async with agent_running(machine(nats_url, prefix, tmp_path, "intel", CPUINFO)):
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
                # The other machine stopped: only the intel agent runs w-a. Its life ends, as LOST, and the
                # intel agent begins one with its own class.
                seq, lost = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq, timeout=4 * ttl)
                assert lost.reason == "LOST", lost
                _, anew = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=seq, timeout=4 * ttl)
                assert [c.sandbox_class for c in anew.sandbox_classes] == ["gvisor"]
                assert not foreign_attributes(anew.sandbox_classes, "intel")


async def log_of(nc, prefix: str, worker_id: str) -> list[Event]:
    """Every event about the worker, in stream order: its history's and its booking subject's (the
    `WorkerFenced` each write of its history carries, and placements)."""
    return [event for _, event in await worker_events(nc, prefix, worker_id, kind="*")]


async def test_an_agent_whose_worker_another_node_registered_since_stops_and_leaves_it_there(nats_url, nc, prefix,
                                                                                            tmp_path):
    """`warmboot agent` runs w-a on node-a; an agent of the same worker id is started on node-b (a machine
    configured alike, or a replacement started before the old one was stopped). Each one's beat was
    refused as the other registered since, and each registered its machine again: the worker went back
    and forth at each beat, a move, a runtime change and a fence each time, for as long as both ran (a user
    trial). The refusal names the node in force: the node-a agent, whose beat it is, stops saying so (exit
    1), without draining the worker; the log holds one take, and node-b keeps the worker beyond its TTLs."""
    ttl = 2.0
    path = tmp_path / "one.toml"
    path.write_text(agent_config("v1"))
    async with running_registry(nats_url, prefix, ttl_s=ttl) as registry:
        one = await agent_process(nats_url, prefix, path, "node-a", "--drain-on-exit")
        try:
            await wait_event(nc, prefix, "w-a", WorkerRegistered)
            async with beats_of(nc, prefix, "w-a") as stored:
                async with agent_running(machine(nats_url, prefix, tmp_path, "amd", AMD, node="node-b")):
                    await wait_event(nc, prefix, "w-a", WorkerUpdated)
                    _, err = await asyncio.wait_for(one.communicate(), 4 * ttl)  # at its next beat, a third of a TTL
                    said = err.decode()
                    assert one.returncode == 1, said
                    assert "on node node-b" in said and "give each machine a worker id of its own" in said, said
                    stopped = time.monotonic()
                    while await asyncio.wait_for(stored.get(), ttl) < stopped + 3 * ttl:
                        pass  # node-b's beats, for three TTLs after node-a's agent stopped
                    assert registry.roster.alive("w-a") and registry.roster.node("w-a") == "node-b"
                    log = await log_of(nc, prefix, "w-a")
        finally:
            if one.returncode is None:
                one.kill()
                await one.wait()
    kinds = [type(event).__name__ for event in log]
    # node-a's registration, then node-b's take (its CPU, its node) and the one fence of that write: no more
    assert kinds == ["WorkerRegistered", "WorkerFenced", "RuntimeChanged", "WorkerUpdated", "WorkerFenced"], kinds
    assert (log[0].node, log[3].node) == ("node-a", "node-b")
