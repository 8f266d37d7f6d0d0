"""A drained worker's agent says so, on a real nats-server with a real registry (docs/registry.md, "The
agent"): an operator's `warmboot worker drain` took the worker out of placement, and the person watching
the agent's log had no idea. The registry's answer to a heartbeat now names the drain in force
(`HeartbeatReply.drained`, a project addition), and the agent says each drain once."""

from __future__ import annotations

import msgspec

from events.errors import unavailable
from events.schema import Base, Drained
from services.registry.roster import Roster
from tests.registry_helpers import raw_request, registration, running_registry


# --- the roster, and the answer it gives ---------------------------------------------------------


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
