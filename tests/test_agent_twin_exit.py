"""What an agent stopping leaves of a worker another agent of its id took meanwhile, on a real nats-server
with a real registry (docs/registry.md, "The agent": the worker is the other's, not this one's to drain)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, Callable

import pytest

from events.schema import WorkerDrained, WorkerRegistered, WorkerUpdated
from tests.registry_helpers import AMD, CPUINFO, running_registry, wait_event, worker_events
from tests.test_agent import agent_running
from tests.test_agent_twins import machine
from warmboot.agent_rules import StillSuperseded, Superseded


async def drained_once_node_b_holds_it(nats_url: str, nc, prefix: str, tmp_path, one,
                                       registered: Callable[[], Awaitable[None]] | None = None) -> list[int]:
    """node-a's agent `one` (`--drain-on-exit`) runs until it registered w-a (and `registered()`, if given,
    returned); then node-b's agent registers w-a, and node-a's is stopped while node-b's runs: the sequences
    of the WorkerDrained of w-a (none, unless node-a's exit drained node-b's registration)."""
    one.drain_on_exit = True
    async with running_registry(nats_url, prefix, ttl_s=30.0):  # a beat every 10 s: none before the stop
        stop_one = asyncio.Event()
        running_one = asyncio.create_task(one.run(stop_one))
        try:
            if registered is not None:
                await registered()
            seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
            async with agent_running(machine(nats_url, prefix, tmp_path, "amd", AMD, node="node-b")):
                seq, _ = await wait_event(nc, prefix, "w-a", WorkerUpdated, after=seq)  # node-b holds it
                stop_one.set()
                await asyncio.wait_for(running_one, 15)
                return [s for s, e in await worker_events(nc, prefix, "w-a") if isinstance(e, WorkerDrained)]
        finally:
            stop_one.set()
            if not running_one.done():
                await asyncio.wait_for(running_one, 15)


async def test_an_agent_stopped_after_another_node_took_its_worker_does_not_drain_it(nats_url, nc, prefix, tmp_path):
    """A replacement (node-b) is started before the machine it replaces (node-a, `--drain-on-exit`) is
    stopped, as a rolling update does; node-a's agent is stopped before its next beat, so it never heard
    that node-b holds the worker. Its exit drained the worker all the same: node-b's registration, drained
    for the rest of its life (a drain is sticky), and node-b's agent never told."""
    one = machine(nats_url, prefix, tmp_path, "intel", CPUINFO, node="node-a")
    drained = await drained_once_node_b_holds_it(nats_url, nc, prefix, tmp_path, one)
    assert drained == [], f"node-a's agent drained node-b's worker on its way out (seq {drained})"


async def test_a_drain_at_exit_sent_after_another_node_took_the_worker_drains_nothing(nats_url, nc, prefix, tmp_path,
                                                                                       monkeypatch):
    """The race the exit's beat leaves open (docs/registry.md): node-b registers w-a after node-a's agent,
    stopping, beat (and heard its own registration in force) and before its drain. The drain drained node-b's
    registration. It now names node-a's registration (`DrainWorker.revision`), and the registry refuses it:
    nothing is drained. The race is made certain here: node-a's beat at exit is taken as answered before
    node-b registered."""
    one = machine(nats_url, prefix, tmp_path, "intel", CPUINFO, node="node-a")

    async def beat_crossed_before_the_replacement(timeout_s: float) -> None:
        return None  # what `_superseded_now` says when its beat was answered before node-b's registration

    monkeypatch.setattr(one, "_superseded_now", beat_crossed_before_the_replacement)
    drained = await drained_once_node_b_holds_it(nats_url, nc, prefix, tmp_path, one)
    assert drained == [], f"node-a's agent drained node-b's worker on its way out (seq {drained})"


async def test_an_agent_stopped_before_hearing_its_first_registration_does_not_drain_another_nodes(
        nats_url, nc, prefix, tmp_path):
    """An agent stopped before the answer to its first registration came (`_beats` unset) named no registration
    in its drain at exit, and so drained whatever was in force: node-b's, registered since (a review). It now
    names the last revision it made; node-b's registration in force is refused it, and nothing is drained."""
    one = machine(nats_url, prefix, tmp_path, "intel", CPUINFO, node="node-a")
    request = one._request
    stored, never = asyncio.Event(), asyncio.Event()

    async def answers_unheard(verb, body, *args, **kwargs):
        reply = await request(verb, body, *args, **kwargs)
        if verb == "register":
            stored.set()
            await never.wait()  # stopped before the answer is read (cancelled at the stop)
        return reply

    one._request = answers_unheard

    async def unheard() -> None:
        await asyncio.wait_for(stored.wait(), 15)
        assert one._beats is None

    drained = await drained_once_node_b_holds_it(nats_url, nc, prefix, tmp_path, one, unheard)
    assert drained == [], f"node-a's agent drained node-b's worker on its way out (seq {drained})"


async def test_a_superseded_agent_restarted_by_its_supervisor_does_not_take_the_worker_back(nats_url, nc, prefix,
                                                                                           tmp_path):
    """node-a's agent stops (exit 1) once node-b's agent registered w-a since. A supervisor that restarts a
    failed process (systemd `Restart=on-failure`, a pod's restart policy) starts it again: its registration
    at start was above node-b's, it took the worker back, and node-b's agent stopped at its next beat, to be
    restarted in turn: the flap the stop was made to end, at the supervisor's pace, a fence each time (a
    review). Its stop is recorded beside its state file, and restarted it does not register while node-b's
    registration is in force (StillSuperseded: `warmboot agent` exits 3)."""
    ttl = 2.0
    async with running_registry(nats_url, prefix, ttl_s=ttl):
        first = asyncio.create_task(machine(nats_url, prefix, tmp_path, "intel", CPUINFO, node="node-a").run(
            asyncio.Event()))
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        async with agent_running(machine(nats_url, prefix, tmp_path, "amd", AMD, node="node-b")):
            seq, _ = await wait_event(nc, prefix, "w-a", WorkerUpdated, after=seq)
            with pytest.raises(Superseded):
                await asyncio.wait_for(first, 4 * ttl)
            stop = asyncio.Event()
            again = asyncio.create_task(machine(nats_url, prefix, tmp_path, "intel", CPUINFO, node="node-a").run(stop))
            try:  # node-b holds the worker and beats it: the restarted agent should refuse to start, as it stopped
                with pytest.raises(StillSuperseded):
                    await asyncio.wait_for(asyncio.shield(again), 4 * ttl)
            finally:
                stop.set()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(again, 15)


async def test_an_agent_stopped_with_its_own_registration_unanswered_still_drains_its_worker(nats_url, nc, prefix,
                                                                                            tmp_path):
    """The drain at exit names the registration the agent's beats keep (`DrainWorker.revision`). An agent stopped
    while a registration of its own was on its way (an edit of its file, here; a registration again after a
    refused beat alike), which the registry stored but whose answer the agent had not heard, named the
    registration before it: refused, FAILED_PRECONDITION on revision, and its own worker was left undrained,
    placeable with no agent behind it (a review). The registration in force is this machine's (its node, a
    revision this agent made): the drain names it, and drains."""
    from tests.registry_helpers import agent_config

    one = machine(nats_url, prefix, tmp_path, "intel", CPUINFO, node="node-a")
    one.drain_on_exit = True
    request = one._request
    heard, stored, never = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def second_answer_unheard(verb, body, *args, **kwargs):
        reply = await request(verb, body, *args, **kwargs)
        if verb == "register" and heard.is_set():
            stored.set()
            await never.wait()  # stopped before the answer is read (cancelled at the stop)
        if verb == "register":
            heard.set()
        return reply

    one._request = second_answer_unheard
    async with running_registry(nats_url, prefix, ttl_s=30.0):
        stop = asyncio.Event()
        running = asyncio.create_task(one.run(stop))
        try:
            await asyncio.wait_for(heard.wait(), 15)
            seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
            (tmp_path / "intel.toml").write_text(agent_config("v1", memory_mib=4096))  # an edit: registered again
            await asyncio.wait_for(stored.wait(), 15)
            seq, updated = await wait_event(nc, prefix, "w-a", WorkerUpdated, after=seq)
            assert updated.capacity.memory_mib == 4096 and updated.revision != one._beats
            stop.set()
            await asyncio.wait_for(running, 15)
            kinds = [type(e).__name__ for s, e in await worker_events(nc, prefix, "w-a") if s > seq]
            assert "WorkerDrained" in kinds, f"the agent left its own worker undrained on its way out: {kinds}"
        finally:
            stop.set()
            if not running.done():
                await asyncio.wait_for(running, 15)
