"""What an agent stopping leaves of a worker another agent of its id took meanwhile, on a real nats-server
with a real registry (docs/registry.md, "The agent": the worker is the other's, not this one's to drain)."""

from __future__ import annotations

import asyncio

from events.schema import WorkerDrained, WorkerRegistered, WorkerUpdated
from tests.registry_helpers import AMD, CPUINFO, running_registry, wait_event, worker_events
from tests.test_agent import agent_running
from tests.test_agent_twins import machine


async def test_an_agent_stopped_after_another_node_took_its_worker_does_not_drain_it(nats_url, nc, prefix, tmp_path):
    """A replacement (node-b) is started before the machine it replaces (node-a, `--drain-on-exit`) is
    stopped, as a rolling update does; node-a's agent is stopped before its next beat, so it never heard
    that node-b holds the worker. Its exit drained the worker all the same: node-b's registration, drained
    for the rest of its life (a drain is sticky), and node-b's agent never told."""
    ttl = 30.0  # a beat every 10 s: node-a's agent is stopped long before its next one
    one = machine(nats_url, prefix, tmp_path, "intel", CPUINFO, node="node-a")
    one.drain_on_exit = True
    async with running_registry(nats_url, prefix, ttl_s=ttl):
        stop_one = asyncio.Event()
        running_one = asyncio.create_task(one.run(stop_one))
        try:
            seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
            async with agent_running(machine(nats_url, prefix, tmp_path, "amd", AMD, node="node-b")):
                seq, _ = await wait_event(nc, prefix, "w-a", WorkerUpdated, after=seq)  # node-b holds it
                stop_one.set()
                await asyncio.wait_for(running_one, 15)
                drained = [s for s, e in await worker_events(nc, prefix, "w-a") if isinstance(e, WorkerDrained)]
                assert drained == [], f"node-a's agent drained node-b's worker on its way out (seq {drained})"
        finally:
            stop_one.set()
            if not running_one.done():
                await asyncio.wait_for(running_one, 15)
