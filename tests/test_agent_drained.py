"""A drained worker's agent says so, on a real nats-server with a real registry (docs/registry.md, "The
agent"): an operator's `warmboot worker drain` took the worker out of placement, and the person watching
the agent's log had no idea. The registry's answer to a heartbeat now names the drain in force
(`HeartbeatReply.drained`, a project addition), and the agent says each drain once."""

from __future__ import annotations

import asyncio

import msgspec

from events.errors import unavailable
from events.schema import Base, Drained, HeartbeatReply, WorkerDrained, WorkerRegistered
from services.registry.roster import Roster
from tests.registry_helpers import (PROBE, agent_config, agent_said, raw_request, registration, running_registry,
                                    wait_event)
from tests.test_agent import agent_running
from warmboot.agent import Agent
from warmboot.agent_rules import drain_to_say, said_drained

DRAINED = "worker w-a is drained"


def the_agent(nats_url: str, prefix: str, tmp_path, **options) -> tuple[Agent, asyncio.Queue[None]]:
    """An agent of w-a, and a queue that gets an item at each of its heartbeats answered."""
    path = tmp_path / "agent.toml"
    if not path.exists():
        path.write_text(agent_config("v1"))
    agent = Agent(nats_url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE, **options)
    beats: asyncio.Queue[None] = asyncio.Queue()
    heartbeat = agent.heartbeat

    async def counted(stop: asyncio.Event) -> None:
        await heartbeat(stop)
        if agent._ttl_learnt:
            beats.put_nowait(None)

    agent.heartbeat = counted
    return agent, beats


async def beats_after(beats: asyncio.Queue[None], count: int) -> None:
    """The agent's next `count` heartbeats, from now."""
    while not beats.empty():
        beats.get_nowait()
    for _ in range(count):
        await asyncio.wait_for(beats.get(), 20)


# --- the decision, and the roster it is answered from --------------------------------------------


def test_each_drain_is_said_once_and_not_the_agents_own():
    assert drain_to_say(Drained(seq=7, reason="kernel"), 0)  # a drain heard first
    assert not drain_to_say(Drained(seq=7, reason="kernel"), 7)  # said: not at the next beat
    assert not drain_to_say(Drained(seq=7), 9)  # its own at exit, answered "unchanged" on a later event
    assert drain_to_say(Drained(seq=12), 7)  # a drain of a later life
    assert not drain_to_say(None, 0)  # not drained, or a registry of an earlier version
    assert said_drained("w-a", Drained(seq=7, reason="kernel")) == (
        "worker w-a is drained (seq 7, reason 'kernel'): it takes no new placements; its actors stay until "
        "stopped or moved")
    assert "(seq 7, no reason given)" in said_drained("w-a", Drained(seq=7))


def test_roster_keeps_the_drain_of_the_life_it_was_written_in():
    roster = Roster()
    roster.apply(1, "w-1", "WorkerRegistered")
    assert roster.drained("w-1") is None
    roster.apply(2, "w-1", "WorkerDrained", reason="kernel")
    roster.apply(3, "w-1", "WorkerUpdated", "node-a", 5)  # a re-registration: still drained (sticky)
    assert roster.drained("w-1") == Drained(seq=2, reason="kernel")
    roster.apply(4, "w-1", "WorkerRemoved")
    assert roster.drained("w-1") is None
    roster.apply(5, "w-1", "WorkerRegistered")  # a new life: undrained
    assert roster.drained("w-1") is None and roster.drained("w-never") is None


async def test_a_heartbeat_answers_the_drain_in_force_from_the_roster_and_from_the_history(nats_url, nc, prefix,
                                                                                         monkeypatch):
    """The roster's dict entry answers it (no history read per beat); where the roster cannot answer (no
    barrier to be had), the history the beat is then answered from says the same. An agent of an earlier
    version reads the answer as it did."""

    class EarlierHeartbeatReply(Base, kw_only=True):  # an agent of an earlier version's
        ttl_s: float

    async with running_registry(nats_url, prefix) as service:
        await raw_request(nc, prefix, "register", "w-1", registration("w-1"))
        beat, _ = await raw_request(nc, prefix, "heartbeat", "w-1", {})
        assert beat == {"ttl_s": 15.0, "drained": None}
        drained, _ = await raw_request(nc, prefix, "drain", "w-1", {"reason": "kernel upgrade"})
        assert (await raw_request(nc, prefix, "heartbeat", "w-1", {}))[0] == {
            "ttl_s": 15.0, "drained": {"seq": drained["seq"], "reason": "kernel upgrade"}}
        await raw_request(nc, prefix, "register", "w-1", registration("w-1", cpu=2000))  # sticky in its life
        again, _ = await raw_request(nc, prefix, "heartbeat", "w-1", {})
        assert again["drained"] == {"seq": drained["seq"], "reason": "kernel upgrade"}
        assert msgspec.json.decode(msgspec.json.encode(again), type=EarlierHeartbeatReply).ttl_s == 15.0

        async def no_barrier() -> None:
            raise unavailable("no barrier to be had")

        monkeypatch.setattr(service.fold, "current", no_barrier)
        from_history, _ = await raw_request(nc, prefix, "heartbeat", "w-1", {})
        assert from_history == again
        monkeypatch.undo()
        await raw_request(nc, prefix, "remove", "w-1", {"reason": "gone"})
        await raw_request(nc, prefix, "register", "w-1", registration("w-1"))  # a new life: undrained
        assert (await raw_request(nc, prefix, "heartbeat", "w-1", {}))[0]["drained"] is None


# --- the agent ------------------------------------------------------------------------------------


async def test_an_operators_drain_is_said_once_and_again_by_a_restarted_agent(nats_url, nc, prefix, tmp_path):
    async with agent_said() as said, running_registry(nats_url, prefix, ttl_s=3):
        agent, beats = the_agent(nats_url, prefix, tmp_path)
        async with agent_running(agent):
            await said.until("registered w-a: REGISTERED")
            await beats_after(beats, 1)
            assert said.matching(DRAINED) == []
            reply, _ = await raw_request(nc, prefix, "drain", "w-a", {"reason": "kernel upgrade"})
            line = (await said.until(DRAINED))[-1]
            assert line == (f"worker w-a is drained (seq {reply['seq']}, reason 'kernel upgrade'): it takes no new "
                            "placements; its actors stay until stopped or moved")
            await beats_after(beats, 3)  # each answered with the drain: said once
            assert said.matching(DRAINED) == [line]
        # a new process on the worker, still drained (it came back within the TTL): it learns it
        restarted, beats = the_agent(nats_url, prefix, tmp_path)
        async with agent_running(restarted):
            assert (await said.until(DRAINED))[-1] == line
            await beats_after(beats, 2)
            assert said.matching(DRAINED) == [line, line]


async def test_the_agents_own_drain_at_exit_is_said_once_and_by_its_next_process(nats_url, nc, prefix, tmp_path):
    async with agent_said() as said, running_registry(nats_url, prefix, ttl_s=3):
        agent, beats = the_agent(nats_url, prefix, tmp_path, drain_on_exit=True)
        async with agent_running(agent):
            await said.until("registered w-a: REGISTERED")
            await beats_after(beats, 1)
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerDrained)
        assert f"drained w-a (seq {seq})" in said.lines and said.matching(DRAINED) == []  # said as its own, once
        restarted, beats = the_agent(nats_url, prefix, tmp_path)
        async with agent_running(restarted):
            line = (await said.until(DRAINED))[-1]
            assert line.startswith(f"worker w-a is drained (seq {seq}, reason 'agent stopped'): ")
            await beats_after(beats, 2)
            assert said.matching(DRAINED) == [line]


async def test_a_registry_of_an_earlier_version_says_nothing_of_drains_and_the_agent_serves(
        nats_url, nc, prefix, tmp_path, monkeypatch):
    """Its answer has no `drained` (its HeartbeatReply had only `ttl_s`): the agent says nothing, and beats
    on. The registry upgraded, the agent hears of the drain at its next beat. (The answers the agent reads
    are made an earlier registry's where it reads them, as tests/test_placement_review.py makes an earlier
    scheduler's: the suite's traffic check judges every reply the services send by this version's schema.)"""
    import warmboot.client

    decode_reply = warmboot.client.decode_reply

    def earlier(reply_type, data: bytes):
        if reply_type is HeartbeatReply and not data.startswith(b'{"error"'):
            data = msgspec.json.encode({"ttl_s": msgspec.json.decode(data)["ttl_s"]})  # all it said
        return decode_reply(reply_type, data)

    monkeypatch.setattr(warmboot.client, "decode_reply", earlier)
    async with agent_said() as said, running_registry(nats_url, prefix, ttl_s=3):
        agent, beats = the_agent(nats_url, prefix, tmp_path)
        async with agent_running(agent):
            await wait_event(nc, prefix, "w-a", WorkerRegistered)
            await raw_request(nc, prefix, "drain", "w-a", {"reason": "kernel upgrade"})
            await beats_after(beats, 3)
            assert said.matching(DRAINED) == [] and agent._ttl_learnt and agent.ttl_s == 3.0
            monkeypatch.undo()  # the registry upgraded
            line = (await said.until(DRAINED))[-1]
            assert "reason 'kernel upgrade'" in line
            await beats_after(beats, 2)
            assert said.matching(DRAINED) == [line]
