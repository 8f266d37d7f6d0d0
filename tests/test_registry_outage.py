"""A control plane down for longer than the heartbeat TTL, on real nats-server processes with a real
registry and agent: the workers' keys run out while no beat can reach the bucket, and the server writes
their expiry markers then (or at its restart). A marker handled before the registry has heard beats for a
whole TTL (since it started, or since its connection came back) is no silence of the worker's: it gets a
new clock (`services.registry.liveness.Hearing`, docs/contract.md). Until 2026-12-07 a restart of
`warmboot up` longer than the TTL removed every worker as LOST, released every actor they ran and undid
their drains, though no worker had stopped (a trial of the client). A worker silent indeed still ends
as LOST, once, a TTL later."""

from __future__ import annotations

import asyncio
import signal

import nats
from prometheus_client import REGISTRY

from events.schema import WorkerRegistered, WorkerRemoved
from tests.factories import until
from tests.registry_helpers import CPUINFO, agent_config, body, running_registry, wait_event, worker_events
from tests.test_agent import agent_running
from tests.test_agent_twins import agent_process, beats_of, machine, process_ended
from warmboot.natsserver import NatsServer

TTL = 2.0  # a silent worker's
# A running agent's: once the registry hears again, the agent, itself reconnecting (from a stop, SIGCONT,
# in the first test), must beat within one TTL. 2 s was too short on a loaded machine (a CI run: it took
# longer, and the worker ended as LOST, as it then must), and so was 5 s beside three other suites on two
# cores; production's is 15 s. An outage is OUTAGE TTLs long: longer than one, so that the key runs out.
AGENT_TTL = 8.0
OUTAGE = 1.5
PREFIX = "outage"


def restarted_clocks() -> float:
    return REGISTRY.get_sample_value("warmboot_registry_clocks_restarted_total") or 0.0


async def removals(nc, worker_id: str) -> list[str]:
    return [e.reason for _, e in await worker_events(nc, PREFIX, worker_id) if isinstance(e, WorkerRemoved)]


async def test_a_nats_restart_longer_than_the_ttl_removes_no_worker_whose_agent_runs(tmp_path):
    """NATS stopped for longer than the TTL, then started again on its store: the key ran out meanwhile,
    and the server writes its marker at its start. The registry's connection comes back and handles the
    marker before the agent's does (the agent held stopped until then, SIGSTOP: it reconnects when its
    backoff says, a race that otherwise goes either way): a new clock, not LOST; the agent, back, beats."""
    server = NatsServer(tmp_path / "nats").start()
    config = tmp_path / "agent.toml"
    config.write_text(agent_config("v1"))
    try:
        nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        async with running_registry(server.url, PREFIX, ttl_s=AGENT_TTL) as registry:
            agent = await agent_process(server.url, PREFIX, config, "node-a")
            try:
                await wait_event(nc, PREFIX, "w-a", WorkerRegistered)
                before = restarted_clocks()
                agent.send_signal(signal.SIGSTOP)
                server.stop()
                await asyncio.sleep(OUTAGE * AGENT_TTL)  # the outage itself: no beat reaches the bucket meanwhile
                server.restart()
                await until(lambda: restarted_clocks() > before)  # the marker, handled on the expired key
                agent.send_signal(signal.SIGCONT)
                async with beats_of(nc, PREFIX, "w-a") as stored:
                    await asyncio.wait_for(stored.get(), 4 * AGENT_TTL)  # the agent's, once it is back
                removed, alive = await removals(nc, "w-a"), registry.roster.alive("w-a")
            finally:
                if agent.returncode is None:
                    agent.send_signal(signal.SIGCONT)
                ended = await process_ended(agent, 30)
        said = (await agent.stderr.read()).decode(errors="replace")  # the agent's log, for a failure below
        assert removed == [] and alive, f"w-a removed {removed}; the agent's log:\n{said}"
        assert ended, "the agent did not end within 30 s of its SIGTERM (killed)"
        await nc.close()
    finally:
        server.stop()


async def test_every_registry_replica_down_longer_than_the_ttl_removes_no_worker_whose_agent_runs(
        tmp_path, nats_url, nc):
    """NATS up, every registry replica down (a rolling deploy gone wrong, `warmboot up` restarted): the
    agent's beats reach no replica, its key runs out and the server writes the marker at once. The next
    replica's start gives it a new clock (its reconciliation), and the agent's beats, answered again,
    keep it."""
    async with agent_running(machine(nats_url, PREFIX, tmp_path, "intel", CPUINFO)):
        async with running_registry(nats_url, PREFIX, ttl_s=AGENT_TTL):
            await wait_event(nc, PREFIX, "w-a", WorkerRegistered)
        before = restarted_clocks()
        await asyncio.sleep(OUTAGE * AGENT_TTL)  # the outage itself: the agent's beats reach no replica
        async with running_registry(nats_url, PREFIX, ttl_s=AGENT_TTL) as registry:
            await until(lambda: restarted_clocks() > before)  # the marker, handled: the registry's counter says it
            async with beats_of(nc, PREFIX, "w-a") as stored:
                await asyncio.wait_for(stored.get(), 2 * AGENT_TTL)
            assert await removals(nc, "w-a") == []
            assert registry.roster.alive("w-a")


async def test_a_worker_silent_indeed_across_the_outage_is_still_removed_as_lost_once(tmp_path, nats_url, nc):
    """No agent: the worker's new clock runs out too, once the replica has heard beats for a TTL, and
    it is removed as LOST, once."""
    async with running_registry(nats_url, PREFIX, ttl_s=TTL) as registry:
        registered = await registry.register("w-b", body("w-b"))
    await asyncio.sleep(2 * TTL)  # the outage itself
    before = restarted_clocks()
    async with running_registry(nats_url, PREFIX, ttl_s=TTL) as registry:
        _, removed = await wait_event(nc, PREFIX, "w-b", WorkerRemoved, after=registered.seq, timeout=6 * TTL)
        assert removed.reason == "LOST"
        assert restarted_clocks() > before  # a new clock first
        assert await removals(nc, "w-b") == ["LOST"]
        assert not registry.roster.alive("w-b")
