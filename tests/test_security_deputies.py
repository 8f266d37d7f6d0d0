"""docs/security.md, Roles, through the server itself: what nats-server publishes on a caller's
behalf to a subject the caller names (the no-responders status a request on a subject nobody
serves is answered with; a message trace, `Nats-Trace-Dest`), and where a message trace goes when
an operator's request crosses its account's import into the deployment's, reaches no subject the
caller may not publish to: nothing is stored in the log or the heartbeat bucket, no request subject
of a service is acted on, no other user's inbox hears anything.

On a real server secured by `warmboot nats-config` (`tests.secured_helpers`), `warmboot serve all` a
child process. An audit's experiments, each found sound; kept as guards (tests/test_security.py has
the attacks through the services' reply subjects)."""

from __future__ import annotations

import json

import pytest

from events.codec import encode
from events.natspy.publish import flush_in_order
from events.schema import (CreateActor, ExplainResume, Explanation, Heartbeat, HeartbeatReply, RegisterReply, Resources,
                           SeqReply)
from events.subjects import bucket_name, event_subject, service_subject, stream_name
from services.endpoints import call
from tests.factories import last_seq
from tests.registry_helpers import registration
from tests.secured_helpers import Secured, served

PREFIX = "dep"
STREAM = stream_name(PREFIX)
HEARTBEATS = bucket_name(PREFIX, "heartbeats")


def sub(service: str, verb: str, entity: str | None = None) -> str:
    return service_subject(PREFIX, service, verb, entity)


# subjects that act, or store, if anything is published there with the deployment's rights
TARGETS = {
    "w-2's history": event_subject(PREFIX, "worker", "w-2"),
    "a-1's history": event_subject(PREFIX, "actor", "a-1"),
    "w-2's heartbeat": f"$KV.{HEARTBEATS}.w-2",
    "drain w-2": sub("registry", "drain", "w-2"),
    "stop a-1": sub("snapshotter", "stop", "a-1"),
    "w-2's inbox": "_INBOX.w-2.x",
    # a JetStream API call (on nats-server 2.15 a purge with no reply subject, as a trace has none, purges
    # nothing: aimed here all the same)
    "purge the log": f"$JS.API.STREAM.PURGE.{STREAM}",
}


@pytest.fixture(scope="module")
async def d(tmp_path_factory):
    secured = Secured(tmp_path_factory.mktemp("secured"), PREFIX, workers=("w-1", "w-2"), operators=("ops",),
                      clients=("orch",))
    async with served(secured, ("svc", "ops", "orch", "w-1", "w-2")) as conns:
        for worker_id, node in (("w-1", "node-a"), ("w-2", "node-b")):
            await call(conns[worker_id].nc, sub("registry", "register", worker_id), registration(worker_id, node=node),
                       RegisterReply)
        created = CreateActor(actor_id="a-1", sandbox_class="gvisor", template_uid="tpl-1",
                              resources=Resources(cpu_millis=250, memory_mib=256))
        await call(conns["orch"].nc, sub("snapshotter", "create", "a-1"), created, SeqReply)
        yield conns


async def state(d) -> tuple:
    """The stream's last sequence, and w-2's heartbeat bucket entry."""
    js = d["svc"].nc.jetstream()
    entry = (await js.get_msg(f"KV_{HEARTBEATS}", subject=f"$KV.{HEARTBEATS}.w-2")).seq
    return await last_seq(d["svc"].nc, PREFIX), entry


class Spy:
    """What arrives under w-2's inboxes (the only subscriptions w-2 may make)."""

    def __init__(self, d):
        self.d = d
        self.heard: list[str] = []

    async def __aenter__(self) -> "Spy":
        async def overhear(msg) -> None:
            self.heard.append(msg.subject)

        self.sub = await self.d["w-2"].nc.subscribe("_INBOX.w-2.>", cb=overhear)
        await flush_in_order(self.d["w-2"].nc)
        return self

    async def __aexit__(self, *_) -> None:
        # the registry has served what came before w-1's next beat (one subscription, in order), and
        # anything the server routed to w-2 before its own round trip has been delivered to it
        await call(self.d["w-1"].nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply)
        await flush_in_order(self.d["w-2"].nc)
        await self.sub.unsubscribe()


async def still_serving(d, before: tuple) -> None:
    """Each service answers, a-1 is as it was, and nothing was written."""
    assert await call(d["w-1"].nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply)
    status = json.loads((await d["orch"].nc.request(sub("snapshotter", "status", "a-1"), b"{}", timeout=10)).data)
    assert status["state"] == "CREATED", status
    await call(d["ops"].nc, sub("scheduler", "explain", "a-1"), ExplainResume(min_seq=before[0]), Explanation)
    assert await state(d) == before


@pytest.mark.parametrize("verb", ["nosuch", "*"])
async def test_a_workers_request_nobody_serves_has_the_server_answer_no_subject_it_names(d, verb):
    """w-1 may publish `<prefix>.registry.<any token>.w-1`, and nobody serves a verb that is not the
    registry's: nats-server answers such a request itself (a no-responders status) when its sender
    asks for that. It answers only on the sender's own subscription, whatever reply subject it names."""
    before = await state(d)
    async with Spy(d) as spy:
        for reply in TARGETS.values():
            await d["w-1"].nc.publish(sub("registry", verb, "w-1"), encode(Heartbeat()), reply=reply,
                                      headers={"x": "y"})  # a header block: the sender takes status messages
        await flush_in_order(d["w-1"].nc)
    assert spy.heard == []
    await still_serving(d, before)


@pytest.mark.parametrize("user", ["orch", "w-1"])
async def test_a_message_trace_goes_nowhere_the_caller_may_not_publish(d, user):
    """A client's or a worker's request carrying `Nats-Trace-Dest` (nats-server's message tracing: the
    server publishes a trace of the message to that subject): aimed at the log, the heartbeat bucket,
    another worker's drain or inbox, the server refuses it; aimed at a request subject the caller may
    publish to, the trace comes with no reply subject and the service drops it unread."""
    before = await state(d)
    subject = sub("scheduler", "explain", "a-1") if user == "orch" else sub("registry", "heartbeat", "w-1")
    body = encode(ExplainResume()) if user == "orch" else encode(Heartbeat())
    own = sub("snapshotter", "stop", "a-1") if user == "orch" else sub("registry", "drain", "w-1")
    async with Spy(d) as spy:
        for dest in (*TARGETS.values(), own):
            await d[user].nc.publish(subject, body, reply=f"_INBOX.{user}.x", headers={"Nats-Trace-Dest": dest})
        await flush_in_order(d[user].nc)
    assert spy.heard == []
    await still_serving(d, before)
    if user == "w-1":  # its trace aimed at its own drain was no request: w-1 is not drained
        beat = await call(d["w-1"].nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply)
        assert beat.drained is None


async def test_an_operators_trace_stays_in_its_own_account(d):
    """An operator's request crosses into the deployment's account through its account's import: a
    trace it asks for goes to its own account's subjects only, where none of the targets is; aimed at a
    subject its account imports, the trace crosses as a message with no reply subject and is dropped."""
    before = await state(d)
    ops = d["ops"].nc
    async with Spy(d) as spy:
        for subject, body in ((sub("scheduler", "explain", "a-1"), encode(ExplainResume())),
                              (f"$JS.API.DIRECT.GET.{STREAM}", json.dumps({"seq": 1}).encode()),
                              ("$SRV.PING", b"")):
            for dest in (*TARGETS.values(), sub("scheduler", "whatif"), f"$JS.API.STREAM.MSG.GET.{STREAM}",
                         "$SRV.INFO"):
                await ops.publish(subject, body, reply="_INBOX.ops.x", headers={"Nats-Trace-Dest": dest})
        await flush_in_order(ops)
    assert spy.heard == []
    await still_serving(d, before)
