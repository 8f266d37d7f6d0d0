"""Two agents started with one worker id (two machines configured alike), on a real nats-server with a
real registry: what the log says the worker is, against the machines that beat it."""

from __future__ import annotations

import asyncio
import time

import pytest

from events.schema import RuntimeChanged, WorkerRegistered, WorkerRemoved
from events.subjects import bucket_name
from events.natspy import flush_in_order
from tests.registry_helpers import AMD, CPUINFO, agent_config, running_registry, wait_event, worker_events
from tests.test_agent import agent_running
from tests.test_agent_orders import foreign_attributes
from warmboot.agent import Agent, ProbeSettings


def machine(nats_url: str, prefix: str, tmp_path, name: str, cpuinfo) -> Agent:
    path = tmp_path / f"{name}.toml"
    path.write_text(agent_config("v1"))
    return Agent(nats_url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05,
                 probe=ProbeSettings(cpuinfo_path=cpuinfo, architecture="amd64"),
                 state_file=tmp_path / f"{name}.revision")


async def test_a_second_agent_s_registration_is_not_kept_alive_by_the_first_one_s_beats(nats_url, nc, prefix,
                                                                                        tmp_path):
    """Machine `intel` runs the agent of w-a; machine `amd` is started with the same worker id and
    node (a copied configuration, a replacement started before the old one was stopped), registers
    its CPU over the first one's, and stops. The intel agent's beats kept the registration of a CPU
    no running machine of w-a has, for as long as it ran (no TTL ended it), and images of the AMD
    CPU were placed on w-a (an audit). A beat names the registration it keeps alive (its revision),
    so intel's is refused and intel registers its machine again: the log holds intel's CPU."""
    ttl = 2.0
    stored: asyncio.Queue[float] = asyncio.Queue()

    async def put(msg) -> None:
        stored.put_nowait(time.monotonic())

    sub = await nc.subscribe(f"$KV.{bucket_name(prefix, 'heartbeats')}.w-a", cb=put)
    await flush_in_order(nc)
    try:
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
    finally:
        await sub.unsubscribe()
