"""Each role's permissions, exactly as docs/security.md's Roles table gives them, on a live
nats-server with the block `warmboot nats-config` writes: a matrix of the subjects an attack
would aim at (other users' inboxes, the services' own, the log, the buckets, the JetStream
API, the system account), each subscribed and published by a worker, a client and an
operator; what the server lets through must be the table's set, no wider and no narrower.
And a worker's password withdrawn (left out of the block) or rotated, then the server
reloaded: its live connection is closed and the old password refused (the rotation tests
of nkeys are in test_key_rotation.py).

The refusals are the server's -ERR lines, which it writes before the PONG of a later PING
and nats-py hands to the error callback before it reads that PONG: once `flush_in_order`
returns, every refusal of what came before it has been collected."""

from __future__ import annotations

import asyncio

import nats
import pytest

from events.natspy.publish import flush_in_order
from tests.secured_helpers import Client, Secured

P = "rb"
STREAM, HEARTBEATS, REPLIES = f"{P.upper()}_EVENTS", f"{P.upper()}_HEARTBEATS", f"{P.upper()}_REPLIES"
SUBSCRIBE = ["_INBOX.>", "_INBOX.*.>", "_INBOX.w-1.>", "_INBOX.w-2.>", "_INBOX.orch.>", "_INBOX.alice.>",
             "_INBOX.bob.>", f"_INBOX._{P}.>", f"_INBOX._{P}", "_R_.>", f"{P}.>", f"{P}.ev.>", "$SRV.>", "$JS.>",
             "$KV.>", "$SYS.>", ">"]
PUBLISH = [f"{P}.registry.heartbeat.w-1", f"{P}.registry.drain.w-2", f"{P}.registry.anything.w-1",
           f"{P}.registry.heartbeat.w-1.more", f"{P}.snapshotter.stop.a-1", f"{P}.scheduler.resume.a-1",
           f"{P}.scheduler.explain.a-1", f"{P}.scheduler.fragmentation", f"{P}.scheduler.whatif",
           f"{P}.ev.worker.w-1", f"{P}.tracking.x", f"$KV.{HEARTBEATS}.w-1", f"$KV.{REPLIES}.x", "$SRV.PING",
           "$JS.API.INFO", f"$JS.API.STREAM.INFO.{STREAM}", f"$JS.API.STREAM.MSG.GET.{STREAM}",
           f"$JS.API.DIRECT.GET.{STREAM}", f"$JS.API.DIRECT.GET.{STREAM}.{P}.ev.worker.w-1",
           f"$JS.API.CONSUMER.CREATE.{STREAM}", f"$JS.API.STREAM.PURGE.{STREAM}", "_INBOX.w-1.x", "_INBOX.w-2.x",
           "_INBOX.alice.x", "_R_.x", "$SYS.REQ.SERVER.PING", "$SYS.REQ.USER.INFO", f"$JS.ACK.KV_{HEARTBEATS}.x"]
# docs/security.md, Roles: (what the user may subscribe to, what it may publish), of the two lists above
ALLOWED = {
    "w-1": ({"_INBOX.w-1.>"},
            {f"{P}.registry.heartbeat.w-1", f"{P}.registry.anything.w-1"}),
    "orch": ({"_INBOX.orch.>"},
             {f"{P}.snapshotter.stop.a-1", f"{P}.scheduler.resume.a-1", f"{P}.scheduler.explain.a-1",
              f"{P}.scheduler.fragmentation", f"{P}.scheduler.whatif", "$SRV.PING"}),
    "alice": ({"_INBOX.alice.>"},
              {f"{P}.scheduler.explain.a-1", f"{P}.scheduler.fragmentation", f"{P}.scheduler.whatif", "$SRV.PING",
               "$JS.API.INFO", f"$JS.API.STREAM.INFO.{STREAM}", f"$JS.API.STREAM.MSG.GET.{STREAM}",
               f"$JS.API.DIRECT.GET.{STREAM}", f"$JS.API.DIRECT.GET.{STREAM}.{P}.ev.worker.w-1"}),
}


async def _refusals(client: Client) -> list[str]:
    """The refusals of every command sent so far (see the module docstring)."""
    await flush_in_order(client.nc)
    found = []
    while not client.violations.empty():
        found.append(client.violations.get_nowait())
    return found


def _let_through(subjects: list[str], refusals: list[str]) -> set[str]:
    return {s for s in subjects if not any(f'"{s.lower()}"' in r.lower() for r in refusals)}


@pytest.fixture
def secured(tmp_path):
    server = Secured(tmp_path / "nats", P, workers=("w-1", "w-2"), operators=("alice", "bob"),
                     clients=("orch",)).start()
    yield server
    server.stop()


@pytest.mark.parametrize("user", list(ALLOWED))
async def test_each_role_may_say_and_hear_exactly_what_the_roles_table_says(secured, user):
    client = await secured.connect(user)
    try:
        for subject in SUBSCRIBE:
            await client.nc.subscribe(subject)
        subscribable = _let_through(SUBSCRIBE, await _refusals(client))
        for subject in PUBLISH:
            await client.nc.publish(subject, b"{}")
        publishable = _let_through(PUBLISH, await _refusals(client))
    finally:
        await client.close()
    assert (subscribable, publishable) == ALLOWED[user]


async def test_a_withdrawn_or_rotated_worker_password_is_cut_off_at_the_reload(secured):
    old_w1, old_w2 = secured.url("w-1"), secured.url("w-2")
    cut = {"w-1": asyncio.Event(), "w-2": asyncio.Event()}

    def on_cut(user: str):
        async def disconnected() -> None:
            cut[user].set()
        return disconnected

    w1 = await secured.connect("w-1", max_reconnect_attempts=2, reconnect_time_wait=0.1, disconnected_cb=on_cut("w-1"))
    w2 = await secured.connect("w-2", max_reconnect_attempts=2, reconnect_time_wait=0.1, disconnected_cb=on_cut("w-2"))
    await secured.reload(rotate=("w-1",), workers=["w-1"])  # w-1 rotated, w-2 left out
    for event in cut.values():
        await asyncio.wait_for(event.wait(), 10)  # the server closed its connection
    for url in (old_w1, old_w2):
        with pytest.raises(nats.errors.Error, match="(?i)authorization"):
            await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    renewed = await secured.connect("w-1")  # its new password signs in
    assert renewed.nc.is_connected
    await renewed.close()
    await w1.nc.close()
    await w2.nc.close()
