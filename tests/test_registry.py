"""The registry over a real bus: validation at the endpoint, the rolling-upgrade sequence,
class changes, drain and remove, request_id retries, and liveness with two replicas.

Every test runs the registry on the JetStream event store of the session's nats-server
under a fresh prefix, and checks what the stream holds.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import uuid
from contextlib import asynccontextmanager, suppress
from datetime import datetime, timedelta, timezone
from typing import AsyncIterator

import msgspec
import nats
import pytest

from events.codec import decode_event
from events.schema import (
    ErrorCode,
    Heartbeat,
    RegisterOutcome,
    RegisterWorker,
    RemoveWorker,
    RuntimeChanged,
    WorkerDrained,
    WorkerFenced,
    WorkerRegistered,
    WorkerRemoved,
    WorkerUpdated,
)
from events.jetstream.layout import BATCH_ID_HEADER
from events.subjects import bucket_name, stream_name
from events.tasks import cancel_and_wait
from services.registry.domain import REVISION_AHEAD_MS, Worker, canonical_classes
from events.errors import ContractError, latest_revision, unavailable
from services.process import store_env
from services.registry.liveness import ACK_WAIT_S, SWEEPER
from services.registry.service import COMMIT_GROUP, RegistryStore
from tests.factories import another_process, last_seq, read_messages, reads_before
from tests.registry_helpers import (
    attrs,
    expiry_marker,
    raw_request,
    registration,
    running_registry,
    runtime,
    wait_event,
    worker_events,
)

AT = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)


@pytest.fixture
async def registry(nats_url, prefix):
    async with running_registry(nats_url, prefix) as service:
        yield service


async def register(nc, prefix, body, worker_id=None):
    reply, headers = await raw_request(nc, prefix, "register", worker_id or body["worker_id"], body)
    assert "error" not in reply, reply
    return reply


# --- the pure decisions -------------------------------------------------------------------


def decide(worker: Worker, body: dict) -> RegisterOutcome:
    return worker.register(msgspec.convert(body, RegisterWorker), AT)


def test_domain_first_registration_then_unchanged_and_canonical():
    worker = Worker("w-1")
    assert decide(worker, registration("w-1")) is RegisterOutcome.REGISTERED
    [event] = [e.body for e in worker.collect_events()]
    assert isinstance(event, WorkerRegistered)
    keys = [a.key for a in event.sandbox_classes[0].default_runtime.version.attributes]
    assert keys == sorted(keys)
    reordered = registration("w-1", default=runtime("v1", order="reverse"))
    assert decide(worker, reordered) is RegisterOutcome.UNCHANGED
    assert worker.collect_events() == []


def test_domain_runtime_and_update_in_one_request():
    worker = Worker("w-1")
    decide(worker, registration("w-1"))
    worker.collect_events()
    body = registration("w-1", default=runtime("v2"), restorable=[runtime("v1")], memory=16384)
    assert decide(worker, body) is RegisterOutcome.RUNTIME_CHANGED
    changed, updated = [e.body for e in worker.collect_events()]
    assert isinstance(changed, RuntimeChanged) and isinstance(updated, WorkerUpdated)
    assert changed.previous == canonical_classes(msgspec.convert(registration("w-1"), RegisterWorker).sandbox_classes)
    assert updated.capacity.memory_mib == 16384


def test_domain_lives_drain_and_lost():
    worker = Worker("w-1")
    decide(worker, registration("w-1"))
    assert worker.drain("maintenance", AT) is True
    assert worker.drain("again", AT) is False  # nothing new: already drained
    assert decide(worker, registration("w-1")) is RegisterOutcome.UNCHANGED
    assert worker.drained  # a drain survives a re-registration
    assert worker.lose(AT) is True
    assert worker.lose(AT) is False  # a second replica deciding on fresh state writes nothing
    two_classes = registration("w-1", classes=[
        {"sandbox_class": "gvisor", "default_runtime": runtime("v1")},
        {"sandbox_class": "microvm", "default_runtime": runtime("k1")},
    ])
    assert decide(worker, two_classes) is RegisterOutcome.REGISTERED  # a new life, new classes
    assert not worker.drained and worker.lives == 2


def test_domain_a_lower_revision_is_refused_in_any_life_and_a_higher_one_is_written():
    """Revisions order a sender's registrations (docs/contract.md): one lower than the history's
    highest is refused, in this life or a later one; the same revision with the same content is
    no change; a higher one with the same content is written (WorkerUpdated), so that the next
    older copy is refused on the history alone; none is not checked."""
    worker = Worker("w-1")
    assert decide(worker, registration("w-1", revision=100)) is RegisterOutcome.REGISTERED
    assert [e.body.revision for e in worker.collect_events()] == [100]
    assert decide(worker, registration("w-1", revision=100)) is RegisterOutcome.UNCHANGED
    assert worker.collect_events() == []
    assert decide(worker, registration("w-1", revision=200)) is RegisterOutcome.UPDATED
    [updated] = [e.body for e in worker.collect_events()]
    assert isinstance(updated, WorkerUpdated) and updated.revision == 200
    assert (updated.node, updated.capacity, updated.labels) == (worker.node, worker.capacity, worker.labels)
    assert decide(worker, registration("w-1", revision=200)) is RegisterOutcome.UNCHANGED  # the same, again
    for refused in (registration("w-1", default=runtime("v0"), revision=150), registration("w-1", revision=199),
                    registration("w-1", default=runtime("v0"), revision=200)):  # equal, other content: another one
        with pytest.raises(ContractError) as e:
            decide(worker, refused)
        assert (e.value.code, e.value.field) == (ErrorCode.FAILED_PRECONDITION, "revision")
        assert latest_revision(e.value) == 200 and worker.pending_events == []
    body = registration("w-1", default=runtime("v2"), revision=300)
    assert decide(worker, body) is RegisterOutcome.RUNTIME_CHANGED
    [changed] = [e.body for e in worker.collect_events()]
    assert isinstance(changed, RuntimeChanged) and changed.revision == 300
    assert worker.lose(AT) is True
    with pytest.raises(ContractError) as e:  # the next life too: an older copy does not begin it
        decide(worker, registration("w-1", revision=250))
    assert latest_revision(e.value) == 300 and not worker.alive
    assert decide(worker, registration("w-1")) is RegisterOutcome.REGISTERED  # none: not checked
    assert worker.revision == 300


def test_domain_an_agents_removal_outranks_everything_it_sent():
    """A removal with a revision (the worker's own agent's) must be above the history's highest, and is
    recorded: every registration at or below it, whatever its content, is refused afterwards, so a
    copy of anything the agent sent before (a refused edit included) cannot begin a life again."""
    worker = Worker("w-1")
    decide(worker, registration("w-1", revision=100))
    worker.collect_events()
    with pytest.raises(ContractError) as e:
        worker.remove("mine", AT, revision=100)
    assert (e.value.code, e.value.field) == (ErrorCode.FAILED_PRECONDITION, "revision") and worker.alive
    worker.remove("mine", AT, revision=300)
    [removed] = [e.body for e in worker.collect_events()]
    assert isinstance(removed, WorkerRemoved) and removed.revision == 300 and worker.revision == 300
    for late in (registration("w-1", revision=100), registration("w-1", default=runtime("v9"), revision=200),
                 registration("w-1", revision=300)):
        with pytest.raises(ContractError):
            decide(worker, late)
    assert decide(worker, registration("w-1", revision=301)) is RegisterOutcome.REGISTERED
    worker.remove(None, AT)  # an operator's: no revision, nothing checked
    assert decide(worker, registration("w-1", revision=301)) is RegisterOutcome.REGISTERED  # its own, sent again
    worker.remove(None, AT)
    late = msgspec.convert(registration("w-1", revision=400, request_id="sent-before"), RegisterWorker)
    with pytest.raises(ContractError) as e:  # a request id sent before this life ended, whatever its revision
        worker.register(late, AT, sent_before=True)
    assert (e.value.code, e.value.field) == (ErrorCode.FAILED_PRECONDITION, "request_id") and not worker.alive
    assert "sends it with a new request_id" in e.value.message


def test_domain_a_revision_out_of_a_successors_reach_is_refused():
    """The highest revision is kept across lives: one credential sending the largest there is would
    leave every later registration of its worker refused. One more than a year ahead of the clock
    (in ms) is INVALID_ARGUMENT, nothing written; at the bound it is taken, and a sender refused
    after it goes on one above the highest the refusal names, which is within the bound then."""
    at_ms = int(AT.timestamp() * 1000)
    worker = Worker("w-1")
    with pytest.raises(ContractError) as e:
        decide(worker, registration("w-1", revision=at_ms + REVISION_AHEAD_MS + 1))
    assert (e.value.code, e.value.field) == (ErrorCode.INVALID_ARGUMENT, "revision") and worker.pending_events == []
    assert decide(worker, registration("w-1", revision=at_ms + REVISION_AHEAD_MS)) is RegisterOutcome.REGISTERED
    assert worker.lose(AT) is True
    later = AT + timedelta(seconds=1)
    with pytest.raises(ContractError) as e:  # a successor's clock
        worker.register(msgspec.convert(registration("w-1", revision=at_ms + 1000), RegisterWorker), later)
    above = latest_revision(e.value) + 1
    assert worker.register(msgspec.convert(registration("w-1", revision=above), RegisterWorker), later) \
        is RegisterOutcome.REGISTERED


# --- validation through the endpoint ----------------------------------------------------------


def _set(path: list, value):
    def mutate(body: dict) -> dict:
        body = copy.deepcopy(body)
        target = body
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
        return body

    return mutate


def _default_attrs(value):
    return _set(["sandbox_classes", 0, "default_runtime", "version", "attributes"], value)


DEFAULT = "sandbox_classes[0].default_runtime"
V1 = attrs(architecture="amd64", gvisor_asset_hash="v1")
CLASS = {"sandbox_class": "gvisor", "default_runtime": runtime("v1")}

# (id, mutation of a valid registration of worker w-valid, field, text in the message)
INVALID_REGISTRATIONS = [
    ("worker_id-pattern", _set(["worker_id"], "-w"), "worker_id", "Expected an id: 1 to 128 letters"),
    ("worker_id-not-subject", _set(["worker_id"], "w-other"), "worker_id", "does not match the subject"),
    ("worker_id-missing", lambda b: {k: v for k, v in b.items() if k != "worker_id"}, "worker_id", "missing"),
    ("node-pattern", _set(["node"], "node a"), "node", "Expected an id"),
    ("node-too-long", _set(["node"], "n" * 129), "node", "Expected an id"),
    ("cpu-zero", _set(["capacity", "cpu_millis"], 0), "capacity.cpu_millis", ">= 1"),
    ("memory-negative", _set(["capacity", "memory_mib"], -1), "capacity.memory_mib", ">= 1"),
    ("memory-missing", _set(["capacity"], {"cpu_millis": 1}), "capacity.memory_mib", "missing"),
    ("label-value-control", _set(["labels"], {"zone": "a\x01"}), "labels.zone", "Expected printable text"),
    ("classes-empty", _set(["sandbox_classes"], []), "sandbox_classes", "length >= 1"),
    ("classes-nine", _set(["sandbox_classes"], [
        {"sandbox_class": f"c{i}", "default_runtime": runtime("v1")} for i in range(9)
    ]), "sandbox_classes", "length <= 8"),
    ("class-twice", _set(["sandbox_classes"], [CLASS, CLASS]), "sandbox_classes[1].sandbox_class", "listed twice"),
    ("class-pattern", _set(["sandbox_classes", 0, "sandbox_class"], "GVisor"), "sandbox_classes[0].sandbox_class",
     "Expected a sandbox class: 1 to 63 lower-case letters"),
    ("default-missing", _set(["sandbox_classes", 0], {"sandbox_class": "gvisor"}),
     "sandbox_classes[0].default_runtime", "missing"),
    ("name-too-long", _set(["sandbox_classes", 0, "default_runtime", "name"], "n" * 254), f"{DEFAULT}.name",
     "length <= 253"),
    ("schema-version-pattern", _set(["sandbox_classes", 0, "default_runtime", "version", "schema_version"], "1"),
     f"{DEFAULT}.version.schema_version", "Expected a schema version: 'v' and a number"),
    ("attributes-empty", _default_attrs([]), f"{DEFAULT}.version.attributes", "length >= 1"),
    ("attributes-33", _default_attrs(attrs(architecture="amd64", **{f"k{i}": "x" for i in range(32)})),
     f"{DEFAULT}.version.attributes", "length <= 32"),
    ("attribute-key-twice", _default_attrs([*V1, {"key": "architecture", "value": "arm64"}]),
     f"{DEFAULT}.version.attributes[2].key", "duplicate attribute key"),
    ("attribute-key-pattern", _default_attrs([*V1, {"key": "Arch", "value": "x"}]),
     f"{DEFAULT}.version.attributes[2].key", "Expected an attribute key"),
    ("attribute-value-empty", _default_attrs([*V1, {"key": "k", "value": ""}]),
     f"{DEFAULT}.version.attributes[2].value", "length >= 1"),
    ("attribute-value-257", _default_attrs([*V1, {"key": "k", "value": "x" * 257}]),
     f"{DEFAULT}.version.attributes[2].value", "length <= 256"),
    ("attribute-value-control", _default_attrs([*V1, {"key": "k", "value": "a\nb"}]),
     f"{DEFAULT}.version.attributes[2].value", "Expected printable text"),
    ("v1-without-architecture", _default_attrs(attrs(gvisor_asset_hash="v1")),
     f"{DEFAULT}.version.attributes", "requires the attribute 'architecture'"),
    ("overhead-negative", _set(["sandbox_classes", 0, "default_runtime", "actor_overhead"], {"fixed_mib": -1}),
     f"{DEFAULT}.actor_overhead.fixed_mib", ">= 0"),
    ("restorable-33", _set(["sandbox_classes", 0, "restorable_runtimes"], [runtime(f"old{i}") for i in range(33)]),
     "sandbox_classes[0].restorable_runtimes", "length <= 32"),
    ("restorable-equals-default", _set(["sandbox_classes", 0, "restorable_runtimes"], [runtime("v1", order="reverse")]),
     "sandbox_classes[0].restorable_runtimes[0].version", "equals default_runtime"),
    ("restorable-twice", _set(["sandbox_classes", 0, "restorable_runtimes"], [runtime("v0"), runtime("v0", "again")]),
     "sandbox_classes[0].restorable_runtimes[1].version", "equals restorable_runtimes[0]"),
    ("request-id-too-long", _set(["request_id"], "r" * 129), "request_id", "length <= 128"),
    # wrong JSON types
    ("capacity-string", _set(["capacity"], "lots"), "capacity", "Expected `object`, got `str`"),
    ("cpu-float", _set(["capacity", "cpu_millis"], 1.5), "capacity.cpu_millis", "Expected `int`, got `float`"),
    ("classes-object", _set(["sandbox_classes"], {"gvisor": {}}), "sandbox_classes", "Expected `array`, got `object`"),
    ("labels-list", _set(["labels"], ["a"]), "labels", "Expected `object`, got `array`"),
    ("attribute-value-number", _default_attrs([*V1, {"key": "k", "value": 7}]),
     f"{DEFAULT}.version.attributes[2].value", "Expected `str`, got `int`"),
]


@pytest.fixture(scope="module")
async def validation_registry(nats_server):
    prefix = "t" + uuid.uuid4().hex[:12]
    # its workers never beat: an hour's TTL keeps their removals (LOST) out of the module's tests ("nothing
    # written" here; another registry's counts), however slowly a loaded machine runs them
    async with running_registry(nats_server.url, prefix, ttl_s=3600):
        client = await nats.connect(nats_server.url)
        # one event in the stream, so "nothing written" is a sequence that stays put
        await register(client, prefix, registration("w-valid"))
        yield client, prefix
        await client.close()


@pytest.mark.parametrize("mutate, field, text", [c[1:] for c in INVALID_REGISTRATIONS],
                         ids=[c[0] for c in INVALID_REGISTRATIONS])
async def test_invalid_registration_is_refused_with_field_and_writes_nothing(validation_registry, mutate, field,
                                                                              text):
    nc, prefix = validation_registry
    before = await last_seq(nc, prefix)
    reply, headers = await raw_request(nc, prefix, "register", "w-valid", mutate(registration("w-valid")))
    assert reply["error"]["code"] == "INVALID_ARGUMENT", reply
    assert reply["error"]["field"] == field, reply
    assert text in reply["error"]["message"], reply
    assert headers["Nats-Service-Error-Code"] == "400"
    assert headers["Nats-Service-Error"] == reply["error"]["message"][:512]
    assert await last_seq(nc, prefix) == before


@pytest.mark.parametrize(
    "verb, subject_id, body, field, text",
    [
        ("register", "w-valid", b"\x00\xffgarbage", None, "not valid JSON"),
        ("register", "w-valid", b"[1, 2]", None, "Expected `object`, got `array`"),
        ("register", "w-valid", b'{"worker_id": 5}', "worker_id", "Expected `str`, got `int`"),
        ("register", "-bad", registration("-bad"), "subject", "not a valid id"),
        ("heartbeat", "w-valid", b"{not json", None, "not valid JSON"),
        ("heartbeat", "w-valid", {"request_id": 5}, "request_id", "Expected `str | null`, got `int`"),
        ("drain", "w-valid", {"reason": ["a"]}, "reason", "Expected `str | null`, got `array`"),
        ("drain", "w-valid", {"reason": "x" * 257}, "reason", "length <= 256"),
        ("remove", "w-valid", {"reason": 1}, "reason", "Expected `str | null`, got `int`"),
        ("remove", "w-valid", b"\xc3\x28", None, "not valid JSON"),
    ],
    ids=["garbage", "array", "id-int", "subject-token", "hb-garbage", "hb-request-id-int", "drain-reason-list",
         "drain-reason-long", "remove-reason-int", "remove-bad-utf8"],
)
async def test_bad_bodies_on_every_endpoint(validation_registry, verb, subject_id, body, field, text):
    nc, prefix = validation_registry
    before = await last_seq(nc, prefix)
    reply, headers = await raw_request(nc, prefix, verb, subject_id, body)
    assert reply["error"]["code"] == "INVALID_ARGUMENT", reply
    assert reply["error"]["field"] == field, reply
    assert text in reply["error"]["message"], reply
    assert headers["Nats-Service-Error-Code"] == "400"
    assert await last_seq(nc, prefix) == before


async def test_unknown_fields_are_ignored_and_unknown_schema_versions_accepted(validation_registry):
    nc, prefix = validation_registry
    body = registration("w-future", default={"version": {"schema_version": "v7", "attributes": attrs(anything="x")}},
                        future_field={"nested": True})
    assert (await register(nc, prefix, body))["outcome"] == "REGISTERED"


# --- the rolling upgrade ----------------------------------------------------------------------------


@asynccontextmanager
async def registered_behind(registry, nats_url, prefix, monkeypatch, worker_id: str,
                            body: dict | None = None) -> AsyncIterator[int]:
    """`worker_id` registered (`body`, by default a first registration) by another registry replica
    (a store on a connection of its own, as in another process), while this registry's own direct
    reads are cut before that registration: they play a replica of the stream that has not
    applied it yet (the leader's reads are left alone). Yields the registration's sequence."""
    async with another_process(RegistryStore, store_env(nats_url, prefix)) as elsewhere:
        body = msgspec.convert(body or registration(worker_id), RegisterWorker)
        registered = (await elsewhere.register(body, AT)).seq  # its own connection, on its own thread
        reads_before(monkeypatch, registry.store.recorder.stream, registered)
        yield registered


async def test_a_refusal_read_behind_another_replica_s_registration_is_decided_again(
        registry, nats_url, nc, prefix, monkeypatch):
    """A drain right after a registration that another registry replica wrote, read from a
    replica of the stream that has not applied it yet, found no such worker: NOT_FOUND, though
    the log has it. The registry now asks the stream leader before it refuses on the worker's
    state."""
    async with registered_behind(registry, nats_url, prefix, monkeypatch, "w-late") as registered:
        reply, _ = await raw_request(nc, prefix, "drain", "w-late", {"reason": "upgrade"})
        assert "error" not in reply and reply["seq"] > registered, reply
        events = [type(e).__name__ for _, e in await worker_events(nc, prefix, "w-late")]
        assert events == ["WorkerRegistered", "WorkerDrained"]
        # a worker the leader does not have either stays NOT_FOUND
        reply, _ = await raw_request(nc, prefix, "drain", "w-never", {"reason": "x"})
        assert reply["error"]["code"] == "NOT_FOUND"


async def test_a_registration_read_behind_another_replica_s_runtime_change_is_not_answered_unchanged(
        registry, nats_url, nc, prefix, monkeypatch):
    """A worker registered on V1, changed to V2 through another registry replica, then back to V1
    through this one, whose read of its history comes from a replica of the stream that has not
    applied the change: the history it read says V1, so it answered UNCHANGED and wrote nothing,
    leaving the log on V2 while the worker runs V1, and V2's memory images placed there (an
    audit's finding). An answer that writes nothing is now given only once the stream leader has
    nothing past what was read; otherwise it is decided again on the leader's history."""
    first = await register(nc, prefix, registration("w-flip"))
    assert first["outcome"] == "REGISTERED"
    async with registered_behind(registry, nats_url, prefix, monkeypatch, "w-flip",
                                 registration("w-flip", default=runtime("v2"))) as changed:
        back = await register(nc, prefix, registration("w-flip"))
        assert back["outcome"] == "RUNTIME_CHANGED" and back["seq"] > changed, back
    events = await worker_events(nc, prefix, "w-flip")
    assert [type(e) for _, e in events] == [WorkerRegistered, RuntimeChanged, RuntimeChanged]
    [entry] = events[-1][1].sandbox_classes
    [registered] = events[0][1].sandbox_classes
    assert entry.default_runtime == registered.default_runtime  # the log ends where the worker is: V1
    again = await register(nc, prefix, registration("w-flip"))  # a read that is not behind: unchanged
    assert again == {"outcome": "UNCHANGED", "seq": events[-1][0]}


async def test_a_heartbeat_looked_up_behind_another_replica_s_registration_is_not_refused(
        registry, nats_url, nc, prefix, monkeypatch):
    """A heartbeat the roster cannot answer (its barrier not to be had) is looked up in the
    worker's history; read from a replica of the stream behind another registry replica's
    registration, that said NOT_FOUND, and the agent registered again. Now the stream leader
    is asked first."""

    async def no_barrier() -> None:
        raise unavailable("the roster's barrier is not to be had")

    async with registered_behind(registry, nats_url, prefix, monkeypatch, "w-beat"):
        monkeypatch.setattr(registry.fold, "current", no_barrier)
        reply, _ = await raw_request(nc, prefix, "heartbeat", "w-beat", {})
        assert reply == {"ttl_s": registry.ttl_s, "drained": None}, reply
        # a worker the leader does not have either stays NOT_FOUND, and nothing is put for it
        reply, _ = await raw_request(nc, prefix, "heartbeat", "w-never", {})
        assert reply["error"]["code"] == "NOT_FOUND"
        assert await registry.liveness.last_entry("w-never") == 0


def beat_answer(registry) -> dict:
    """A heartbeat's answer, of a worker that is not drained."""
    return {"ttl_s": registry.ttl_s, "drained": None}


async def test_a_heartbeat_keeps_alive_only_the_registration_whose_revision_it_names(registry, nc, prefix):
    """A beat may name the revision of the registration it keeps alive (its agent's in force).
    One naming another is FAILED_PRECONDITION on `revision` and puts nothing: two machines
    running as w-1, the second's registration (another CPU) was kept alive by the first's beats
    after the second stopped (an audit). Without a revision, a beat is taken as before; so is
    every beat of a registration made without one."""
    await register(nc, prefix, registration("w-1", revision=100))
    assert (await raw_request(nc, prefix, "heartbeat", "w-1", {"revision": 100}))[0] == beat_answer(registry)
    put = await registry.liveness.last_entry("w-1")
    # another machine registers w-1 on its CPU, at a higher revision
    await register(nc, prefix, registration("w-1", default=runtime("amd"), revision=200))
    after_amd = await registry.liveness.last_entry("w-1")
    refused, _ = await raw_request(nc, prefix, "heartbeat", "w-1", {"revision": 100})
    assert refused["error"]["code"] == "FAILED_PRECONDITION" and refused["error"]["field"] == "revision", refused
    assert "registration in force is revision 200, not 100" in refused["error"]["message"]
    assert await registry.liveness.last_entry("w-1") == after_amd > put  # the refusal put nothing
    assert (await raw_request(nc, prefix, "heartbeat", "w-1", {"revision": 200}))[0] == beat_answer(registry)
    assert (await raw_request(nc, prefix, "heartbeat", "w-1", {}))[0] == beat_answer(registry)
    # the first machine registers again above it: its beats are the ones taken now
    await register(nc, prefix, registration("w-1", revision=300))
    assert (await raw_request(nc, prefix, "heartbeat", "w-1", {"revision": 300}))[0] == beat_answer(registry)
    assert (await raw_request(nc, prefix, "heartbeat", "w-1", {"revision": 200}))[0]["error"]["field"] == "revision"
    # a registration without a revision: nothing to tell beats apart by
    await register(nc, prefix, registration("w-2"))
    assert (await raw_request(nc, prefix, "heartbeat", "w-2", {"revision": 7}))[0] == beat_answer(registry)
    # the same content at a higher revision writes (WorkerUpdated): the roster holds that one
    await register(nc, prefix, registration("w-1", revision=400))
    assert (await raw_request(nc, prefix, "heartbeat", "w-1", {"revision": 400}))[0] == beat_answer(registry)


async def test_a_drain_naming_a_registration_drains_only_that_one(registry, nc, prefix):
    """A drain may name the revision of the registration it is for (an agent's, at its exit: docs/registry.md).
    A replacement that registered the worker id between the agent's last beat and its drain was drained, for
    the rest of its life, its agent never told (a review). Now a drain naming another revision than the one in
    force is FAILED_PRECONDITION on `revision`, naming the revision and node in force, and writes nothing; one
    naming it drains; a drain naming none, or of a registration made without one, drains as before."""
    await register(nc, prefix, registration("w-1", revision=100))
    await register(nc, prefix, registration("w-1", default=runtime("amd"), node="node-b", revision=200))
    before = await last_seq(nc, prefix)
    refused, _ = await raw_request(nc, prefix, "drain", "w-1", {"revision": 100, "request_id": "exit-1"})
    assert refused["error"]["code"] == "FAILED_PRECONDITION" and refused["error"]["field"] == "revision", refused
    assert "registration in force is revision 200, not 100 (registered on node node-b)" in refused["error"]["message"]
    assert await last_seq(nc, prefix) == before  # nothing written
    again, _ = await raw_request(nc, prefix, "drain", "w-1", {"revision": 100, "request_id": "exit-1"})
    assert again["error"]["field"] == "revision", again  # a retry is decided again, and refused again
    assert await last_seq(nc, prefix) == before
    drained, _ = await raw_request(nc, prefix, "drain", "w-1", {"revision": 200})
    assert drained["seq"] > before and not drained.get("unchanged"), drained
    [(_, event)] = [(seq, e) for seq, e in await worker_events(nc, prefix, "w-1") if seq > before]
    assert isinstance(event, WorkerDrained)
    await register(nc, prefix, registration("w-2"))  # no revision: nothing to tell registrations apart by
    assert "seq" in (await raw_request(nc, prefix, "drain", "w-2", {"revision": 7}))[0]
    await register(nc, prefix, registration("w-3", revision=5))
    assert "seq" in (await raw_request(nc, prefix, "drain", "w-3", {}))[0]  # naming none: as before


async def test_a_revision_of_zero_is_told_apart_as_any_other(registry, nc, prefix):
    """Revisions run from 0 (docs/contract.md): a sender that numbers its registrations 0, 1, 2...
    names 0 as any other. w-z registered at revision 0: a beat naming 1 (a registration the registry
    does not have in force) is refused; another machine registers w-z at 1: the first one's beats,
    naming 0, are refused and put nothing. A 0 taken for "no revision" kept both alive."""
    await register(nc, prefix, registration("w-z", revision=0))
    refused, _ = await raw_request(nc, prefix, "heartbeat", "w-z", {"revision": 1})
    assert refused["error"]["code"] == "FAILED_PRECONDITION" and refused["error"]["field"] == "revision", refused
    assert "registration in force is revision 0, not 1" in refused["error"]["message"]
    assert (await raw_request(nc, prefix, "heartbeat", "w-z", {"revision": 0}))[0] == beat_answer(registry)
    await register(nc, prefix, registration("w-z", default=runtime("amd"), revision=1))
    put = await registry.liveness.last_entry("w-z")
    refused, _ = await raw_request(nc, prefix, "heartbeat", "w-z", {"revision": 0})
    assert refused["error"]["code"] == "FAILED_PRECONDITION" and refused["error"]["field"] == "revision", refused
    assert "registration in force is revision 1, not 0" in refused["error"]["message"]
    assert await registry.liveness.last_entry("w-z") == put  # the refusal put nothing
    assert (await raw_request(nc, prefix, "heartbeat", "w-z", {"revision": 1}))[0] == beat_answer(registry)


async def test_a_registration_without_a_revision_leaves_none_in_force(registry, nc, prefix):
    """docs/registry.md: a heartbeat of a registration made without a revision is taken as before,
    whatever revision it names (nothing to tell beats apart by). w-1, registered at revision 100, is
    registered again without one (an agent of an earlier version taking over, as in an upgrade):
    beats naming 100 or any other revision keep that registration alive, and none is refused, as the
    worker's history answers them (`test_a_beat_answered_from_the_log_keeps_alive_only_the_registration_
    it_names`). Kills the mutant of `Roster.apply` that keeps the revision of the registration before
    when a later one names none."""
    await register(nc, prefix, registration("w-1", revision=100))
    refused, _ = await raw_request(nc, prefix, "heartbeat", "w-1", {"revision": 7})
    assert refused["error"]["field"] == "revision", refused
    assert (await register(nc, prefix, registration("w-1", labels={"zone": "b"})))["outcome"] == "UPDATED"
    for revision in (100, 7):
        beat, _ = await raw_request(nc, prefix, "heartbeat", "w-1", {"revision": revision})
        assert beat == {"ttl_s": registry.ttl_s, "drained": None}, (revision, beat)


async def test_a_drain_read_behind_another_replica_s_new_life_drains_it(registry, nats_url, nc, prefix, monkeypatch):
    """A worker drained through this registry, then removed and registered again (a new life,
    undrained) through another replica; an operator's drain here, read from a replica of the
    stream behind those two, found the worker drained and wrote nothing: the new life stayed
    undrained. A drain that writes nothing now stands only once the history it read is current."""
    await register(nc, prefix, registration("w-again"))
    reply, _ = await raw_request(nc, prefix, "drain", "w-again", {"reason": "first"})
    assert "error" not in reply, reply
    async with another_process(RegistryStore, store_env(nats_url, prefix)) as elsewhere:
        removed = (await elsewhere.remove("w-again", RemoveWorker(reason="replaced"), AT)).seq
        again = (await elsewhere.register(msgspec.convert(registration("w-again"), RegisterWorker), AT)).seq
        assert again > removed
        reads_before(monkeypatch, registry.store.recorder.stream, removed)
        reply, _ = await raw_request(nc, prefix, "drain", "w-again", {"reason": "second"})
        assert "error" not in reply and reply["seq"] > again, reply
    kinds = [type(e).__name__ for _, e in await worker_events(nc, prefix, "w-again")]
    assert kinds[-3:] == ["WorkerRemoved", "WorkerRegistered", "WorkerDrained"], kinds


async def test_a_heartbeat_looked_up_behind_another_replica_s_removal_is_not_answered(
        registry, nats_url, nc, prefix, monkeypatch):
    """A heartbeat of a worker the roster, current, has in no life is looked up in the worker's
    history; read from a replica of the stream behind another registry replica's removal of the
    worker, that history says it is alive: the heartbeat was answered and its clock put for a
    worker the log has removed (its actors released), and its agent, told it is registered, did
    not register again (an audit's finding). Such an answer now stands only once the stream
    leader has nothing past what was read."""
    assert (await register(nc, prefix, registration("w-gone")))["outcome"] == "REGISTERED"
    async with another_process(RegistryStore, store_env(nats_url, prefix)) as elsewhere:
        removed = (await elsewhere.remove("w-gone", RemoveWorker(reason="decommissioned"), AT)).seq
        reads_before(monkeypatch, registry.store.recorder.stream, removed)
        before = await registry.liveness.last_entry("w-gone")
        reply, _ = await raw_request(nc, prefix, "heartbeat", "w-gone", {})
        assert reply.get("error", {}).get("code") == "NOT_FOUND", reply
        assert await registry.liveness.last_entry("w-gone") == before  # nothing put for it


async def test_a_registration_refused_on_a_read_behind_a_removal_begins_the_new_life(
        registry, nats_url, nc, prefix, monkeypatch):
    """A worker registered with class gvisor (and a revision) is removed through another registry
    replica; its agent, told NOT_FOUND, registers anew, now with class microvm, under a new
    request id. Read here from a replica of the stream that has not applied the removal, the
    worker is alive with gvisor: a change of class, FAILED_PRECONDITION (sandbox_classes). That
    refusal is rechecked at the stream leader (the removal is newer) and decided again on the
    leader's history, where the worker is in no life and the registration begins one. But the
    stale decision marked its request id refused in the reply bucket before the recheck, and the
    decision on the leader's history takes that mark for a copy sent before the life ended
    (`_sent_before`): the registration is refused FAILED_PRECONDITION (request_id), an answer the
    leader's history does not give (docs/contract.md: a refusal on the entity's state is answered
    only once the leader confirms what was read)."""
    import time as _time

    revision = int(_time.time() * 1000)
    first = await register(nc, prefix, registration("w-class", revision=revision))
    assert first["outcome"] == "REGISTERED"
    async with another_process(RegistryStore, store_env(nats_url, prefix)) as elsewhere:
        removed = (await elsewhere.remove("w-class", RemoveWorker(reason="class change"), AT)).seq
        reads_before(monkeypatch, registry.store.recorder.stream, removed)  # a replica behind plays its reads
        anew = registration("w-class", classes=[{"sandbox_class": "microvm", "default_runtime": runtime("k1")}],
                            revision=revision + 1, request_id=f"agent-{uuid.uuid4().hex}")
        reply, _ = await raw_request(nc, prefix, "register", "w-class", anew)
    assert reply.get("outcome") == "REGISTERED", reply  # on the leader's history: a new life begins
    kinds = [type(e).__name__ for _, e in await worker_events(nc, prefix, "w-class")]
    assert kinds == ["WorkerRegistered", "WorkerRemoved", "WorkerRegistered"], kinds


async def test_a_retry_read_behind_the_worker_s_next_life_is_decided_on_the_leader_s_history(
        registry, nats_url, nc, prefix, monkeypatch):
    """A drain retried with its request id after the worker was removed and registered anew through
    another registry replica, read from a replica of the stream behind that removal: the history it
    read has the drain in the current life, so the drain's first answer was given and nothing
    written, the new life left undrained (resumes still placed on it). An answer from before writes
    nothing, so it stands only on the history as the leader has it, where the retry is decided again:
    there its id is an earlier life's, so it is refused (FAILED_PRECONDITION, field request_id; a drain
    made for that life does not drain this one: docs/contract.md), and the new life is left as it is."""
    await register(nc, prefix, registration("w-again"))
    first, _ = await raw_request(nc, prefix, "drain", "w-again", {"reason": "upgrade", "request_id": "drain-1"})
    assert "error" not in first, first
    async with another_process(RegistryStore, store_env(nats_url, prefix)) as elsewhere:
        removed = (await elsewhere.remove("w-again", RemoveWorker(reason="replaced"), AT)).seq
        await elsewhere.register(msgspec.convert(registration("w-again"), RegisterWorker), AT)
        reads_before(monkeypatch, registry.store.recorder.stream, removed)  # a replica behind plays its reads
        again, _ = await raw_request(nc, prefix, "drain", "w-again", {"reason": "upgrade", "request_id": "drain-1"})
    assert again["error"]["code"] == "FAILED_PRECONDITION" and again["error"]["field"] == "request_id", again
    assert "earlier life" in again["error"]["message"], again
    kinds = [type(e).__name__ for _, e in await worker_events(nc, prefix, "w-again")]
    assert kinds == ["WorkerRegistered", "WorkerDrained", "WorkerRemoved", "WorkerRegistered"], kinds


async def test_rolling_upgrade_sequence(registry, nc, prefix):
    v1 = registration("w-1", default=runtime("v1", "gvisor-1"))
    first = await register(nc, prefix, v1)
    assert first["outcome"] == "REGISTERED"

    v2 = registration("w-1", default=runtime("v2", "gvisor-2"), restorable=[runtime("v1", "gvisor-1")])
    second = await register(nc, prefix, v2)
    assert second["outcome"] == "RUNTIME_CHANGED" and second["seq"] > first["seq"]

    again = await register(nc, prefix, v2)
    assert again == {"outcome": "UNCHANGED", "seq": second["seq"]}  # the worker's last event

    reordered = registration("w-1", default=runtime("v2", "gvisor-2", order="reverse"),
                             restorable=[runtime("v1", "gvisor-1", order="reverse")])
    assert await register(nc, prefix, reordered) == {"outcome": "UNCHANGED", "seq": second["seq"]}

    three = registration("w-1", default=runtime("v3"), restorable=[runtime("v2"), runtime("v1")])
    assert (await register(nc, prefix, three))["outcome"] == "RUNTIME_CHANGED"
    swapped = registration("w-1", default=runtime("v3"), restorable=[runtime("v1"), runtime("v2")])
    last = await register(nc, prefix, swapped)
    assert last["outcome"] == "UNCHANGED"  # v1.1: restorable runtimes are a set; their order is no change

    events = await worker_events(nc, prefix, "w-1")
    assert [type(e).__name__ for _, e in events] == [
        "WorkerRegistered", "RuntimeChanged", "RuntimeChanged",
    ]
    # the reply's seq is the worker's last event; the registry's fence on its booking subject follows it
    assert [seq for seq, _ in events][-1] == last["seq"] == await last_seq(nc, prefix) - 1
    upgrade = events[1][1]
    assert upgrade.previous == events[0][1].sandbox_classes
    assert upgrade.sandbox_classes[0].default_runtime.name == "gvisor-2"
    assert [r.name for r in upgrade.sandbox_classes[0].restorable_runtimes] == ["gvisor-1"]
    for _, event in events:  # stored sorted by key, whatever order they came in
        for entry in event.sandbox_classes:
            for rt in (entry.default_runtime, *entry.restorable_runtimes):
                keys = [a.key for a in rt.version.attributes]
                assert keys == sorted(keys)


async def test_update_and_runtime_change_in_one_request(registry, nc, prefix):
    await register(nc, prefix, registration("w-1"))
    body = registration("w-1", default=runtime("v2"), node="node-b", labels={"zone": "b"}, cpu=8000)
    reply = await register(nc, prefix, body)
    assert reply["outcome"] == "RUNTIME_CHANGED"
    events = await worker_events(nc, prefix, "w-1")
    assert [type(e) for _, e in events] == [WorkerRegistered, RuntimeChanged, WorkerUpdated]
    assert reply["seq"] == events[-1][0]
    updated = events[-1][1]
    assert (updated.node, updated.capacity.cpu_millis, updated.labels) == ("node-b", 8000, {"zone": "b"})
    only_labels = await register(nc, prefix, {**body, "labels": {"zone": "c"}})
    assert only_labels["outcome"] == "UPDATED"


async def test_a_live_worker_moved_to_another_node_is_logged(registry, nc, prefix, caplog):
    """A registration that moves a live worker to another node is taken (the contract lets an agent
    move), and said in the registry's log: two agents started with one worker id take it from
    each other in turn, and nothing else shows it (a walkthrough found it silent)."""
    caplog.set_level(logging.WARNING, logger="warmboot.registry")
    await register(nc, prefix, registration("w-1"))
    await register(nc, prefix, registration("w-1", labels={"zone": "b"}))  # the same node: not a move
    assert not [r for r in caplog.records if "moved from node" in r.getMessage()]
    moved = await register(nc, prefix, registration("w-1", node="node-b"))
    assert moved["outcome"] == "UPDATED"
    said = [r.getMessage() for r in caplog.records if "moved from node" in r.getMessage()]
    assert said == ["worker w-1 moved from node node-a to node node-b while alive: its agent moved, or a second "
                    "agent runs with this worker id (`serve registry --worker-nodes` binds each worker to its node)"]


async def test_class_change_is_refused(registry, nc, prefix):
    await register(nc, prefix, registration("w-1"))
    before = await last_seq(nc, prefix)
    both = registration("w-1", classes=[
        {"sandbox_class": "gvisor", "default_runtime": runtime("v1")},
        {"sandbox_class": "microvm", "default_runtime": runtime("k1")},
    ])
    reply, headers = await raw_request(nc, prefix, "register", "w-1", both)
    assert reply["error"]["code"] == "FAILED_PRECONDITION"
    assert reply["error"]["field"] == "sandbox_classes"
    assert "adds microvm" in reply["error"]["message"]
    assert headers["Nats-Service-Error-Code"] == "409"
    other = registration("w-1", classes=[{"sandbox_class": "microvm", "default_runtime": runtime("k1")}])
    reply, _ = await raw_request(nc, prefix, "register", "w-1", other)
    assert reply["error"]["code"] == "FAILED_PRECONDITION"
    assert "adds microvm and drops gvisor" in reply["error"]["message"]
    assert await last_seq(nc, prefix) == before

    # removed, it may come back with other classes: a new life
    await raw_request(nc, prefix, "remove", "w-1", {"reason": "reprovisioned"})
    assert (await register(nc, prefix, both))["outcome"] == "REGISTERED"


async def test_drain_and_remove(registry, nc, prefix):
    await register(nc, prefix, registration("w-1"))
    drained, _ = await raw_request(nc, prefix, "drain", "w-1", {"reason": "kernel upgrade"})
    events = await worker_events(nc, prefix, "w-1")
    assert isinstance(events[-1][1], WorkerDrained) and events[-1][1].reason == "kernel upgrade"
    assert drained == {"seq": events[-1][0], "unchanged": False}
    again, _ = await raw_request(nc, prefix, "drain", "w-1", {"request_id": "drain-2"})
    # already drained: nothing written, the same position, and the answer says so
    assert again == {"seq": events[-1][0], "unchanged": True}
    assert await worker_events(nc, prefix, "w-1") == events
    retried, _ = await raw_request(nc, prefix, "drain", "w-1", {"request_id": "drain-2"})
    assert retried == again  # a retry gets the first answer, the flag with it (kept: it wrote nothing)

    hb, _ = await raw_request(nc, prefix, "heartbeat", "w-1", {})
    # a drained worker is still alive, and the answer names its drain (project addition)
    assert hb == {"ttl_s": 15.0, "drained": {"seq": drained["seq"], "reason": "kernel upgrade"}}

    removed, _ = await raw_request(nc, prefix, "remove", "w-1", {"reason": "decommissioned"})
    events = await worker_events(nc, prefix, "w-1")
    assert isinstance(events[-1][1], WorkerRemoved) and events[-1][1].reason == "decommissioned"
    assert removed == {"seq": events[-1][0], "unchanged": False}

    before = await last_seq(nc, prefix)
    for verb in ("drain", "remove", "heartbeat"):
        reply, headers = await raw_request(nc, prefix, verb, "w-1", {})
        assert reply["error"]["code"] == "NOT_FOUND", (verb, reply)
        assert headers["Nats-Service-Error-Code"] == "404"
    reply, _ = await raw_request(nc, prefix, "heartbeat", "w-never", {})
    assert reply["error"]["code"] == "NOT_FOUND" and "not registered" in reply["error"]["message"]
    assert await last_seq(nc, prefix) == before


async def test_a_removal_whose_heartbeat_cannot_be_dropped_is_still_answered(nats_url, nc, prefix):
    """The removal is written before the heartbeat is dropped: a bucket that fails then must not
    turn a done removal into UNAVAILABLE. The heartbeat expires by itself; its expiry writes nothing."""
    async with running_registry(nats_url, prefix, ttl_s=1) as registry:
        await register(nc, prefix, registration("w-1"))

        async def bucket_down(worker_id: str, last_entry: int) -> bool:
            raise ConnectionError("the heartbeat bucket is down")

        registry.liveness.forget = bucket_down
        swept = asyncio.get_running_loop().create_future()
        on_marker = registry.liveness.sweeper.on_marker

        async def marker(worker_id: str) -> None:
            await on_marker(worker_id)
            if worker_id == "w-1" and not swept.done():
                swept.set_result(None)

        registry.liveness.sweeper.on_marker = marker
        removed, _ = await raw_request(nc, prefix, "remove", "w-1", {"reason": "decommissioned"})
        events = await worker_events(nc, prefix, "w-1")
        assert removed == {"seq": events[-1][0], "unchanged": False}
        assert isinstance(events[-1][1], WorkerRemoved) and events[-1][1].reason == "decommissioned"
        reply, _ = await raw_request(nc, prefix, "heartbeat", "w-1", {})
        assert reply["error"]["code"] == "NOT_FOUND"

        await asyncio.wait_for(swept, 30)  # the heartbeat left in the bucket expired and was swept
        events = await worker_events(nc, prefix, "w-1")
        assert [type(e) for _, e in events] == [WorkerRegistered, WorkerRemoved]  # no LOST after it


async def test_request_id_retry_returns_the_first_answer(registry, nc, prefix):
    body = registration("w-1", request_id="reg-1")
    first = await register(nc, prefix, body)
    # the same request_id with other content: still the first answer, nothing written
    retry = await register(nc, prefix, {**body, "node": "node-z"})
    assert retry == first
    assert len(await worker_events(nc, prefix, "w-1")) == 1

    change = registration("w-1", default=runtime("v2"), cpu=1000, request_id="reg-2")
    changed = await register(nc, prefix, change)
    assert changed["outcome"] == "RUNTIME_CHANGED"

    # Answered from the worker's history (every event names its request), so a lost reply
    # or a crash between commit and reply changes nothing.
    assert await register(nc, prefix, change) == changed  # both events of reg-2; seq of the last
    assert await register(nc, prefix, body) == first
    assert len(await worker_events(nc, prefix, "w-1")) == 3

    drain = {"reason": "r", "request_id": "d-1"}
    drained, _ = await raw_request(nc, prefix, "drain", "w-1", drain)
    assert (await raw_request(nc, prefix, "drain", "w-1", drain))[0] == drained

    reused, _ = await raw_request(nc, prefix, "remove", "w-1", {"request_id": "reg-1"})
    assert reused["error"]["code"] == "FAILED_PRECONDITION" and reused["error"]["field"] == "request_id"

    removal = {"request_id": "rm-1"}
    removed, _ = await raw_request(nc, prefix, "remove", "w-1", removal)
    assert (await raw_request(nc, prefix, "remove", "w-1", removal))[0] == removed
    assert [type(e) for _, e in await worker_events(nc, prefix, "w-1")] == [
        WorkerRegistered, RuntimeChanged, WorkerUpdated, WorkerDrained, WorkerRemoved,
    ]


async def test_concurrent_duplicate_requests_write_once(registry, nc, prefix):
    body = registration("w-1", request_id="same")
    replies = await asyncio.gather(*(register(nc, prefix, body) for _ in range(8)))
    assert all(r == replies[0] for r in replies)
    assert len(await worker_events(nc, prefix, "w-1")) == 1


# --- liveness --------------------------------------------------------------------------------------


async def test_silent_worker_removed_as_lost_exactly_once_with_two_replicas(nats_url, nc, prefix):
    async with running_registry(nats_url, prefix, ttl_s=1) as one, running_registry(nats_url, prefix, ttl_s=1) as two:
        start = await last_seq(nc, prefix)
        await register(nc, prefix, registration("w-silent"))
        await register(nc, prefix, registration("w-beating"))
        beat, _ = await raw_request(nc, prefix, "heartbeat", "w-beating", {})
        assert beat == {"ttl_s": 1.0, "drained": None}

        seq, removed = await wait_event(nc, prefix, "w-silent", WorkerRemoved, after=start)
        assert removed.reason == "LOST"

        # Both replicas handling the same expiry (a redelivered marker) write nothing more.
        await asyncio.gather(one._expired("w-silent"), two._expired("w-silent"))
        # They share one sweeper: each marker goes to one of them.
        consumers = await nc.jetstream().consumers_info(f"KV_{bucket_name(prefix, 'heartbeats')}")
        assert [c.name for c in consumers] == [SWEEPER]
        events = await worker_events(nc, prefix, "w-silent")
        assert [type(e) for _, e in events] == [WorkerRegistered, WorkerRemoved]

        reply, _ = await raw_request(nc, prefix, "heartbeat", "w-silent", {})
        assert reply["error"]["code"] == "NOT_FOUND"
        # a worker that comes back registers anew
        assert (await register(nc, prefix, registration("w-silent")))["outcome"] == "REGISTERED"


async def test_a_registration_between_a_removal_and_its_tombstone_is_still_lost_within_the_ttl(nats_url, nc, prefix):
    """Replica A writes a removal; before A drops the heartbeat, the worker registers again through
    replica B (which beats first). A tombstone over B's beat would leave the new life with no clock
    (an expiring tombstone leaves no marker): a worker that then goes silent would never be LOST."""
    async with running_registry(nats_url, prefix, ttl_s=1) as a, running_registry(nats_url, prefix, ttl_s=1) as b:
        await register(nc, prefix, registration("w-1"))
        registered = asyncio.Event()
        forget = a.liveness.forget

        async def after_the_registration(worker_id: str, last_entry: int) -> bool:
            await registered.wait()
            return await forget(worker_id, last_entry)

        a.liveness.forget = after_the_registration
        start = await last_seq(nc, prefix)
        removal = asyncio.create_task(a.remove("w-1", RemoveWorker(reason="reprovisioned")))
        await wait_event(nc, prefix, "w-1", WorkerRemoved, after=start)
        again = await b.register("w-1", msgspec.convert(registration("w-1"), RegisterWorker))
        assert again.outcome is RegisterOutcome.REGISTERED
        registered.set()
        await removal
        assert await a.liveness.state("w-1") == "beating"  # B's beat: no tombstone was put over it
        # the worker never beats again: LOST once its TTL has passed since B's beat
        _, lost = await wait_event(nc, prefix, "w-1", WorkerRemoved, after=again.seq)
        assert lost.reason == "LOST"
        events = await worker_events(nc, prefix, "w-1")
        assert [type(e) for _, e in events] == [WorkerRegistered, WorkerRemoved, WorkerRegistered, WorkerRemoved]


async def test_a_registration_while_a_removal_is_being_written_keeps_its_clock(nats_url, nc, prefix):
    """A removal drops the worker's heartbeat only if nothing was put since it read the key, before
    writing the removal (docs/registry.md). Here replica A's removal is written and, before A goes on,
    the worker registers anew through replica B (a new life, beaten before and after its decision): A
    leaves B's beats in place, and the new life, silent from then on, is LOST within its TTL. Read once
    the removal was written, the key's last entry was B's beat, and A's tombstone went over it: the new
    life had no clock, and stayed registered, silent, until a reconciliation. Kills the mutant of
    `RegistryService._remove` that reads the key's last entry after the removal."""
    async with running_registry(nats_url, prefix, ttl_s=1) as a, running_registry(nats_url, prefix, ttl_s=1) as b:
        await register(nc, prefix, registration("w-1"))
        remove, written, go = a.store.remove, asyncio.Event(), asyncio.Event()

        async def written_then_held(worker_id, request, at):
            decided = await remove(worker_id, request, at)
            written.set()
            await go.wait()
            return decided

        a.store.remove = written_then_held
        removal = asyncio.create_task(a.remove("w-1", RemoveWorker(reason="reprovisioned")))
        await asyncio.wait_for(written.wait(), 10)
        again = await b.register("w-1", msgspec.convert(registration("w-1"), RegisterWorker))
        assert again.outcome is RegisterOutcome.REGISTERED
        go.set()
        await asyncio.wait_for(removal, 10)
        assert await a.liveness.state("w-1") == "beating"  # B's beat: no tombstone was put over it
        _, lost = await wait_event(nc, prefix, "w-1", WorkerRemoved, after=again.seq)
        assert lost.reason == "LOST"


async def pinned_and_holding(nc, prefix: str, replica, worker_id: str) -> asyncio.Event:
    """The sweep pinned to `replica` (the only one running: `worker_id`'s registration puts its clock,
    whose delivery pins it), which from now on takes expiry markers and handles none of them; the
    event is set once it holds one."""
    held, pinned = asyncio.Event(), asyncio.Event()
    reconcile = replica.liveness.sweeper.on_pinned

    async def holding(worker_id: str) -> None:
        held.set()
        await asyncio.Event().wait()

    async def noted() -> None:
        pinned.set()
        await reconcile()

    replica.liveness.sweeper.on_marker = holding
    replica.liveness.sweeper.on_pinned = noted
    await register(nc, prefix, registration(worker_id))
    await asyncio.wait_for(pinned.wait(), 20)
    return held


async def test_a_replica_stopping_hands_back_the_expiries_it_holds(nats_url, nc, prefix):
    """Two replicas share the sweep, pinned to one of them. That one is stopped (a rolling restart)
    while it holds expiry markers it has not handled: it hands them back and unpins itself, and the
    other replica removes those workers now, not once the pin's time-out (15 s) or the consumer's ack
    wait (30 s) has passed."""
    workers = [f"w-{i:02d}" for i in range(40)]
    start = await last_seq(nc, prefix)
    stopping = running_registry(nats_url, prefix, ttl_s=1)
    stops = await stopping.__aenter__()
    try:
        held = await pinned_and_holding(nc, prefix, stops, workers[0])
        async with running_registry(nats_url, prefix, ttl_s=1):  # the replica that keeps sweeping
            await asyncio.gather(*(register(nc, prefix, registration(w)) for w in workers[1:]))
            await asyncio.wait_for(held.wait(), 20)  # the stopping replica holds at least one marker
            await stopping.__aexit__(None, None, None)
            stopping = None
            stopped = asyncio.get_running_loop().time()
            removed = await asyncio.gather(*(wait_event(nc, prefix, w, WorkerRemoved, after=start, timeout=15)
                                             for w in workers))
            assert {e.reason for _, e in removed} == {"LOST"}
            assert asyncio.get_running_loop().time() - stopped < 10  # well within the pin's time-out
    finally:
        if stopping is not None:
            await stopping.__aexit__(None, None, None)
    for w in workers:  # each once
        assert [type(e) for _, e in await worker_events(nc, prefix, w)] == [WorkerRegistered, WorkerRemoved]


async def test_a_replica_that_dies_holding_expiries_leaves_them_to_the_next_one_pinned(nats_url, nc, prefix):
    """The sweep is pinned to a replica that dies (its connection gone, nothing handed back) while it
    holds expiry markers. The other replica is pinned next, and acknowledges all at once the puts of
    the workers still beating, past the dead one's markers: nothing delivers those again. It finds
    their workers by the reconciliation it runs before its first ack, so they are removed as LOST well
    before the consumer's ack wait (30 s) or the periodic round (100 s); the workers still beating are
    not."""
    silent = [f"w-{i:02d}" for i in range(20)]
    alive = ["w-alive-1", "w-alive-2"]
    start = await last_seq(nc, prefix)
    dying = running_registry(nats_url, prefix, ttl_s=1)
    doomed = await dying.__aenter__()
    beats = None
    try:
        held = await pinned_and_holding(nc, prefix, doomed, silent[0])
        async with running_registry(nats_url, prefix, ttl_s=1) as survivor:
            await asyncio.gather(*(register(nc, prefix, registration(w)) for w in silent[1:] + alive))

            async def beating() -> None:  # the live workers' agents: a beat every 0.2 s, well within the TTL
                while True:
                    await asyncio.gather(*(survivor.heartbeat(w, Heartbeat()) for w in alive))
                    await asyncio.sleep(0.2)  # the agents' period, not synchronisation

            beats = asyncio.create_task(beating())
            await asyncio.wait_for(held.wait(), 20)  # the doomed replica holds at least one marker
            await doomed.nc.close()  # dies: no nak, no unpin, no more pulls
            died = asyncio.get_running_loop().time()
            removed = await asyncio.gather(*(wait_event(nc, prefix, w, WorkerRemoved, after=start, timeout=25)
                                             for w in silent))
            assert {e.reason for _, e in removed} == {"LOST"}
            assert asyncio.get_running_loop().time() - died < ACK_WAIT_S
            await cancel_and_wait(beats)
    finally:
        if beats is not None:
            await cancel_and_wait(beats)
        with suppress(Exception):  # its connection is closed: what it can still stop
            await dying.__aexit__(None, None, None)
    for w in silent:  # each once
        assert [type(e) for _, e in await worker_events(nc, prefix, w)] == [WorkerRegistered, WorkerRemoved]
    for w in alive:
        assert [type(e) for _, e in await worker_events(nc, prefix, w)] == [WorkerRegistered]


async def test_both_replicas_expiring_at_once_write_one_removal(nats_url, nc, prefix):
    async with running_registry(nats_url, prefix, ttl_s=1) as one, running_registry(nats_url, prefix, ttl_s=1) as two:
        for replica in (one, two):  # the test hands the expiry to both, twice
            await replica.liveness.sweeper.stop()
        await register(nc, prefix, registration("w-1"))
        await expiry_marker(nc, prefix, "w-1")
        await asyncio.gather(*(r._expired("w-1") for r in (one, two, one, two)))
        events = await worker_events(nc, prefix, "w-1")
        assert [type(e) for _, e in events] == [WorkerRegistered, WorkerRemoved]
        assert events[-1][1].reason == "LOST"


async def test_restart_reconciles_a_registered_worker_without_heartbeat(nats_url, nc, prefix):
    async with running_registry(nats_url, prefix):
        await register(nc, prefix, registration("w-orphan"))
    # its heartbeat record is lost while no registry runs
    await nc.jetstream().purge_stream(f"KV_{bucket_name(prefix, 'heartbeats')}")
    start = await last_seq(nc, prefix)
    async with running_registry(nats_url, prefix, ttl_s=1):
        _, removed = await wait_event(nc, prefix, "w-orphan", WorkerRemoved, after=start)
        assert removed.reason == "LOST"


async def test_the_log_is_the_contract_json(registry, nc, prefix):
    await register(nc, prefix, registration("w-1"))
    msg = await nc.jetstream().get_last_msg(stream_name(prefix), f"{prefix}.ev.worker.w-1")
    raw = msgspec.json.decode(msg.data)
    assert raw["type"] == "WorkerRegistered" and raw["worker_id"] == "w-1"
    assert isinstance(decode_event(msg.data), WorkerRegistered)


async def test_two_replicas_writing_one_worker_concurrently_lose_nothing(nats_url, nc, prefix):
    """Twelve registrations of one worker at once over two replicas; one a replica refuses for working
    on too many of that worker's already (RESOURCE_EXHAUSTED, nothing written: `_one_of_few`) is sent
    again, as an agent does."""

    async def until_taken(body):
        while True:
            reply, _ = await raw_request(nc, prefix, "register", "w-1", body)
            if reply.get("error", {}).get("code") != "RESOURCE_EXHAUSTED":
                assert "error" not in reply, reply
                return reply

    async with running_registry(nats_url, prefix), running_registry(nats_url, prefix):
        await register(nc, prefix, registration("w-1"))
        bodies = [registration("w-1", cpu=1000 + i) for i in range(12)]
        replies = await asyncio.gather(*(until_taken(b) for b in bodies))
        assert {r["outcome"] for r in replies} == {"UPDATED"}
        events = await worker_events(nc, prefix, "w-1")
        assert len(events) == 13  # each registration won its own version
        assert sorted(r["seq"] for r in replies) == [seq for seq, _ in events[1:]]
        assert sorted(e.capacity.cpu_millis for _, e in events[1:]) == [1000 + i for i in range(12)]


def commit_groups() -> tuple[float, float]:
    """(atomic appends, commands in them) the grouped appends of every registry in this process have
    counted so far (a module's registry may remove its own silent workers meanwhile)."""
    samples = {s.name: s.value for s in COMMIT_GROUP.collect()[0].samples}
    return samples["warmboot_registry_commit_group_writes_count"], samples["warmboot_registry_commit_group_writes_sum"]


def appends_of(messages: list, kind: type, workers: set[str]) -> int:
    """How many atomic appends stored the `kind` events of `workers` among `messages` (the log's, with
    headers: `read_messages`): those of one batch share its Nats-Batch-Id; a message without one
    was an append of its own."""
    return len({headers.get(BATCH_ID_HEADER) or f"alone at {seq}"
                for seq, _, headers, event in messages if isinstance(event, kind) and event.worker_id in workers})


async def test_registrations_at_once_are_appended_together_each_with_its_fence_after_it(registry, nc, prefix):
    """A fleet registering at once: the commands' appends go out grouped (`events.jetstream.grouped`:
    one atomic batch costs a one-replica file stream's server milliseconds), and each worker still
    gets what it would alone: REGISTERED at its own event, its fence on its booking subject right
    after it in the same batch, nothing twice. Counted from the log; the registry's metric counts
    them too."""
    names = [f"g-{i}" for i in range(150)]
    _, commands = commit_groups()
    replies = await asyncio.gather(*(register(nc, prefix, registration(name)) for name in names))
    assert commit_groups()[1] - commands >= len(names)
    messages = await read_messages(nc, prefix)
    assert appends_of(messages, WorkerRegistered, set(names)) < len(names)  # some went out together
    log = {seq: event for seq, _, _, event in messages}
    for name, reply in zip(names, replies):
        assert reply["outcome"] == "REGISTERED"
        assert isinstance(log[reply["seq"]], WorkerRegistered) and log[reply["seq"]].worker_id == name
        fence = log[reply["seq"] + 1]
        assert isinstance(fence, WorkerFenced) and fence.worker_id == name and fence.event == "WorkerRegistered"
    assert sorted(type(e).__name__ for e in log.values()) == ["WorkerFenced"] * 150 + ["WorkerRegistered"] * 150


async def test_workers_lost_together_are_removed_together_each_once(nats_url, nc, prefix):
    """A rack goes dark: its workers' expiry markers come in a burst. They are handled at once
    (`liveness.MARKER_LANES`), so their removals share atomic appends instead of taking turns;
    each worker is removed LOST exactly once. Counted from the log: the registry's metric is every
    registry's in this process (a loaded run once counted here the removals of the module's
    `validation_registry`, whose silent workers had a 15 s TTL then)."""
    workers = [f"r-{i:02d}" for i in range(60)]
    async with running_registry(nats_url, prefix, ttl_s=1):
        start = await last_seq(nc, prefix)
        await asyncio.gather(*(register(nc, prefix, registration(w)) for w in workers))
        removed = await asyncio.gather(*(wait_event(nc, prefix, w, WorkerRemoved, after=start, timeout=30)
                                         for w in workers))
    assert {e.reason for _, e in removed} == {"LOST"}
    messages = await read_messages(nc, prefix)
    assert sum(isinstance(e, WorkerRemoved) for _, _, _, e in messages) == len(workers)
    assert appends_of(messages, WorkerRemoved, set(workers)) < len(workers)  # some removals shared an append
    for w in workers:
        assert [type(e) for _, e in await worker_events(nc, prefix, w)] == [WorkerRegistered, WorkerRemoved]
