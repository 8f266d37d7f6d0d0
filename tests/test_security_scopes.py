"""docs/security.md, Roles, through the services: what a worker's request may touch of the
services' own state (an answer kept for its request id, a refusal's mark, its write budget, its
heartbeat entry) is the state of the worker its subject names, whatever its body and its request
id; a client's credential does nothing a worker's may; an operator's exported reads of the log
reach no bucket and no other stream.

On a real server secured by `warmboot nats-config` (`tests.secured_helpers`), `warmboot serve all`
a child process with a small write budget. An audit's experiments, which found each of these
sound; kept as a guard (tests/test_security.py has the reply-subject attacks)."""

from __future__ import annotations

import json

import pytest

from events.schema import Heartbeat, HeartbeatReply
from events.subjects import bucket_name, event_subject, service_subject, stream_name
from services.endpoints import call
from tests.factories import last_seq
from tests.registry_helpers import raw_request, registration, runtime, worker_events
from tests.secured_helpers import Secured, served

PREFIX = "scope"
STREAM = stream_name(PREFIX)
HEARTBEATS = bucket_name(PREFIX, "heartbeats")
REPLIES = bucket_name(PREFIX, "replies")
BUDGET = 4  # --worker-writes: writes at once, then one an hour


@pytest.fixture(scope="module")
async def d(tmp_path_factory):
    secured = Secured(tmp_path_factory.mktemp("secured"), PREFIX, workers=("w-1", "w-2", "w-3", "w-4"),
                      operators=("ops",), clients=("orch",))
    async with served(secured, ("svc", "ops", "orch", "w-1", "w-2", "w-3", "w-4"),
                      "--worker-writes", str(BUDGET), "--worker-write-interval", "3600") as clients:
        yield clients


async def register(d, worker_id: str, request_id: str, **fields) -> dict:
    reply, _ = await raw_request(d[worker_id].nc, PREFIX, "register", worker_id,
                                 registration(worker_id, request_id=request_id, **fields))
    return reply


async def test_a_request_id_another_worker_used_is_answered_from_nothing_of_its(d):
    """The answers kept in the reply bucket (an UNCHANGED registration) and the marks of refused
    registrations are the subject's worker's: w-2 sending the request ids w-1 used is answered on
    w-2's own history, and w-1's are answered as before."""
    assert (await register(d, "w-1", "first", revision=1000))["outcome"] == "REGISTERED"
    kept = await register(d, "w-1", "shared", revision=1000)
    assert kept["outcome"] == "UNCHANGED"  # its answer kept under the request id
    classes = [{"sandbox_class": c, "default_runtime": runtime("v1"), "restorable_runtimes": []}
               for c in ("gvisor", "kata")]
    refused = await register(d, "w-1", "marked", revision=2000, classes=classes)
    assert refused["error"]["field"] == "sandbox_classes"  # a change of class: refused, its request id marked

    assert (await register(d, "w-2", "first", revision=1000))["outcome"] == "REGISTERED"
    assert (await register(d, "w-2", "shared", revision=1500, labels={"zone": "b"}))["outcome"] == "UPDATED"
    removed, _ = await raw_request(d["w-2"].nc, PREFIX, "remove", "w-2", {"request_id": "gone", "revision": 1600})
    assert "error" not in removed, removed
    # a new life under a request id w-1's refusal marked: w-2 never sent it
    assert (await register(d, "w-2", "marked", revision=1700))["outcome"] == "REGISTERED"

    assert await register(d, "w-1", "shared", revision=1000) == kept
    assert [type(e).__name__ for _, e in await worker_events(d["svc"].nc, PREFIX, "w-1")] == ["WorkerRegistered"]
    assert [(type(e).__name__, e.request_id) for _, e in await worker_events(d["svc"].nc, PREFIX, "w-2")] == [
        ("WorkerRegistered", "first"), ("WorkerUpdated", "shared"), ("WorkerRemoved", "gone"),
        ("WorkerRegistered", "marked")]


async def test_one_worker_spending_its_budget_refuses_no_other_worker_anything(d):
    """w-3 writes past its budget; w-4's writes and heartbeats are taken as before, and a body
    naming w-4 on w-3's subjects changes nothing of w-4's."""
    answers = [await register(d, "w-3", f"edit-{i}", labels={"zone": f"z{i}"}) for i in range(BUDGET + 1)]
    assert [a.get("outcome") or a["error"]["code"] for a in answers] == [
        "REGISTERED", *["UPDATED"] * (BUDGET - 1), "RESOURCE_EXHAUSTED"]
    assert [(await register(d, "w-4", f"edit-{i}", labels={"zone": f"z{i}"}))["outcome"]
            for i in range(BUDGET)] == ["REGISTERED", *["UPDATED"] * (BUDGET - 1)]
    js = d["svc"].nc.jetstream()
    beat = (await js.get_msg(f"KV_{HEARTBEATS}", subject=f"$KV.{HEARTBEATS}.w-4")).seq
    history = await worker_events(d["svc"].nc, PREFIX, "w-4")
    named, _ = await raw_request(d["w-3"].nc, PREFIX, "register", "w-3", registration("w-4", request_id="as-w-4"))
    assert named["error"]["field"] == "worker_id"
    for verb in ("heartbeat", "drain"):  # their bodies have no worker: w-3's own
        await raw_request(d["w-3"].nc, PREFIX, verb, "w-3", {"worker_id": "w-4"})
    assert (await js.get_msg(f"KV_{HEARTBEATS}", subject=f"$KV.{HEARTBEATS}.w-4")).seq == beat
    assert await worker_events(d["svc"].nc, PREFIX, "w-4") == history
    assert await call(d["w-4"].nc, service_subject(PREFIX, "registry", "heartbeat", "w-4"), Heartbeat(), HeartbeatReply)


async def test_a_client_speaks_for_no_worker(d):
    """No client registers a worker of its own making (a runtime the scheduler would send images
    to), nor beats, drains or removes one: the server refuses each, and the log is as it was."""
    before = await last_seq(d["svc"].nc, PREFIX)
    orch = d["orch"]
    for verb in ("register", "heartbeat", "drain", "remove"):
        subject = service_subject(PREFIX, "registry", verb, "w-9")
        await orch.nc.publish(subject, json.dumps(registration("w-9")).encode(), reply="_INBOX.orch.x")
        await orch.violation(subject)  # refused by the server: no service hears it
    assert await last_seq(d["svc"].nc, PREFIX) == before


async def test_an_operators_exported_reads_reach_no_bucket(d):
    """The operators' account imports reads of the log's stream alone: aimed at a bucket's
    subjects they find nothing, and a read of a bucket's stream is refused by the server."""
    ops = d["ops"]
    js = d["svc"].nc.jetstream()
    buckets = {b: (await js.stream_info(f"KV_{b}")).state.last_seq for b in (HEARTBEATS, REPLIES)}
    for body in ({"last_by_subj": f"$KV.{HEARTBEATS}.w-1"}, {"last_by_subj": f"$KV.{REPLIES}.>"}):
        got = await ops.nc.request(f"$JS.API.STREAM.MSG.GET.{STREAM}", json.dumps(body).encode(), timeout=10)
        answer = json.loads(got.data)
        assert answer["error"]["code"] == 404, answer
    for subject, body in ((f"$JS.API.DIRECT.GET.{STREAM}", {"multi_last": ["$KV.>"], "batch": 10}),
                          (f"$JS.API.DIRECT.GET.{STREAM}.$KV.{HEARTBEATS}.w-1", None)):
        answer = await ops.nc.request(subject, json.dumps(body).encode() if body else b"", timeout=10)
        assert answer.headers and answer.headers.get("Status") == "404", (subject, answer.headers, answer.data)
    for subject in (f"$JS.API.STREAM.MSG.GET.KV_{REPLIES}", f"$JS.API.DIRECT.GET.KV_{HEARTBEATS}.$KV.{HEARTBEATS}.w-1",
                    f"$JS.API.STREAM.INFO.KV_{HEARTBEATS}", f"$JS.API.STREAM.MSG.DELETE.{STREAM}",
                    event_subject(PREFIX, "worker", "w-1")):
        await ops.nc.publish(subject, b"{}", reply="_INBOX.ops.x")
        await ops.violation(subject)  # refused by the server
    assert {b: (await js.stream_info(f"KV_{b}")).state.last_seq for b in buckets} == buckets
