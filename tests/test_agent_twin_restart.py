"""A superseded agent started again by its supervisor, as real processes with a state file, on a real
nats-server with a real registry (docs/registry.md, "The agent"): it does not take the worker back while
another node's agent holds it (exit 3, for `RestartPreventExitStatus=`), and registers once that one's
registration has ended."""

from __future__ import annotations

import asyncio
import sys
from asyncio.subprocess import Process
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

from events.schema import WorkerRegistered, WorkerRemoved, WorkerUpdated
from tests.registry_helpers import AMD, agent_config, running_registry, wait_event
from tests.test_agent import agent_running
from tests.test_agent_twins import agent_process, beats_of, log_of, machine
from warmboot.agent_rules import SUPERSEDED_AT_START_EXIT

# The workers' TTL. No test here waits for one to run out, but between an agent's end and the next step (a
# `worker remove` process, a third agent's registration) a loaded machine took longer than 2 s: w-a was
# removed as LOST meanwhile (three runs of this file side by side: 19 failures in 12 runs, 'worker w-a was
# removed (LOST)', and a WorkerRegistered where a WorkerUpdated was awaited).
TTL = 6.0


@asynccontextmanager
async def killed_at_the_end(process: Process) -> AsyncIterator[Process]:
    """`process` in the block, killed at its end if it still runs (a failed assertion)."""
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def state_of(tmp_path: Path) -> tuple[Path, Path, Path]:
    """node-a's configuration, its state file, and the record of a stop as superseded beside it."""
    config = tmp_path / "a.toml"
    config.write_text(agent_config("v1"))
    return config, tmp_path / "a.revision", tmp_path / "a.revision.superseded"


@asynccontextmanager
async def node_a_superseded(nats_url: str, nc, prefix: str, tmp_path: Path) -> AsyncIterator[int]:
    """node-a's agent (a process, with a state file) registers w-a; node-b's (running in the block)
    registers it since, and node-a's stops at its next beat (exit 1). The sequence of node-b's take."""
    config, state, _ = state_of(tmp_path)
    async with killed_at_the_end(await agent_process(nats_url, prefix, config, "node-a", "--state-file",
                                                     str(state))) as one:
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        async with agent_running(machine(nats_url, prefix, tmp_path, "amd", AMD, node="node-b")):
            seq, _ = await wait_event(nc, prefix, "w-a", WorkerUpdated, after=seq)
            _, err = await asyncio.wait_for(one.communicate(), 4 * TTL)
            assert one.returncode == 1 and "on node node-b" in err.decode(), err.decode()
            yield seq


async def test_a_superseded_agent_restarted_while_the_other_holds_the_worker_exits_3_and_writes_nothing(
        nats_url, nc, prefix, tmp_path):
    """A supervisor restarts the agent that stopped (exit 1) when node-b's agent registered w-a since: it
    took the worker back at its first registration, node-b's agent stopped in turn and was restarted, and
    so on, at the supervisors' pace, each take fencing every placement on the worker (a review). Restarted,
    it beats first naming its kept revision; refused for node-b's registration in force, it exits 3 saying
    what to do, and the worker's log gains nothing."""
    config, state, record = state_of(tmp_path)
    async with running_registry(nats_url, prefix, ttl_s=TTL) as registry:
        async with node_a_superseded(nats_url, nc, prefix, tmp_path):
            assert record.read_text().split()[:2] == ["w-a", "node-b"]
            before = await log_of(nc, prefix, "w-a")
            async with killed_at_the_end(await agent_process(nats_url, prefix, config, "node-a", "--state-file",
                                                             str(state))) as again:
                out, err = await asyncio.wait_for(again.communicate(), 15)
            said = err.decode()
            assert again.returncode == SUPERSEDED_AT_START_EXIT == 3, said
            for words in ("worker w-a is held by another agent, on node node-b, which registered it since",
                          "Give each machine a worker id of its own", f"delete {record}"):
                assert words in said, (words, said)
            assert "registered w-a" not in said and b"stopped" not in out, said
            async with beats_of(nc, prefix, "w-a") as stored:
                await asyncio.wait_for(stored.get(), TTL)  # node-b beats on, after the restart ended
            assert registry.roster.alive("w-a") and registry.roster.node("w-a") == "node-b"
            assert await log_of(nc, prefix, "w-a") == before  # no registration, no fence
            assert record.exists()


async def test_a_superseded_agent_registers_at_its_restart_once_the_other_s_registration_ended(
        nats_url, nc, prefix, tmp_path):
    """node-b's agent is stopped and w-a removed (`warmboot worker remove`): the machine that stopped for it
    may have the worker id again. Restarted, node-a's agent finds no registration in force (NOT_FOUND),
    clears its record, and registers."""
    config, state, record = state_of(tmp_path)
    async with running_registry(nats_url, prefix, ttl_s=TTL):
        async with node_a_superseded(nats_url, nc, prefix, tmp_path) as seq:
            pass  # node-b's agent stopped at the end of the block
        assert record.exists()
        removal = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "from warmboot.cli import main; main()", "worker", "remove", "w-a",
            "--reason", "node-b retired", "--nats", nats_url, "--prefix", prefix,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(removal.communicate(), 15)
        assert removal.returncode == 0, err.decode()
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        async with killed_at_the_end(await agent_process(nats_url, prefix, config, "node-a", "--state-file",
                                                         str(state))) as again:
            _, registered = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=seq)
            assert registered.node == "node-a"
            assert not record.exists()
            again.terminate()
            _, err = await asyncio.wait_for(again.communicate(), 15)
        said = err.decode()
        assert again.returncode == 0, said
        assert "this agent stopped for node node-b's registration" in said and "registration ended" in said, said


async def test_a_second_agent_given_the_first_one_s_state_file_starts_nothing_until_the_first_has_stopped(
        nats_url, nc, prefix, tmp_path):
    """Two agents of w-a on one machine given one state file (a unit started twice, a copied command line):
    each read the other's revisions as its own, went above them, and took the worker from the other; each,
    restarted after a stop as superseded, found the other's revision in the file and took the worker back.
    The state file is held while its agent runs: a second one exits 1 at once, naming the holder, and sends
    nothing. Once the first is killed (its lock goes with it), the second starts, above its revisions."""
    config, state, _ = state_of(tmp_path)
    async with running_registry(nats_url, prefix, ttl_s=TTL) as registry:
        async with killed_at_the_end(await agent_process(nats_url, prefix, config, "node-a", "--state-file",
                                                         str(state))) as first:
            seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
            kept = int(state.read_text().split()[1])
            before = await log_of(nc, prefix, "w-a")
            async with killed_at_the_end(await agent_process(nats_url, prefix, config, "node-a", "--state-file",
                                                             str(state))) as second:
                _, err = await asyncio.wait_for(second.communicate(), 15)
            said = err.decode()
            assert second.returncode == 1, said
            for words in (f"state file {state} is in use by another agent (process {first.pid}",
                          "run one agent of it", "give each agent a state file of its own"):
                assert words in said, (words, said)
            async with beats_of(nc, prefix, "w-a") as stored:
                await asyncio.wait_for(stored.get(), TTL)  # the first beats on
            assert await log_of(nc, prefix, "w-a") == before  # no registration, no fence
            assert int(state.read_text().split()[1]) == kept
            first.kill()
            await first.wait()
        async with killed_at_the_end(await agent_process(nats_url, prefix, config, "node-a", "--state-file",
                                                         str(state))) as third:
            # the same content as the first's registration, at a revision above it: written (an update)
            _, update = await wait_event(nc, prefix, "w-a", WorkerUpdated, after=seq)
            assert update.revision is not None and update.revision > kept, update
            assert third.returncode is None and registry.roster.alive("w-a")
