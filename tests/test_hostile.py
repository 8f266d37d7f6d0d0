"""Hostile input at every endpoint: always a contract error reply, never a crash, a hang,
a traceback in the reply, or a write. Generated with hypothesis and written by hand."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.schema import (
    ErrorCode,
    ErrorReply,
    Explanation,
    Fragmentation,
    HeartbeatReply,
    RegisterReply,
    RegisterWorker,
)
from events.subjects import service_subject
from services.endpoints import call
from tests.factories import last_seq, version, worker

ENDPOINTS = [
    ("registry", "register", True),
    ("registry", "heartbeat", True),
    ("registry", "drain", True),
    ("registry", "remove", True),
    ("snapshotter", "create", True),
    ("snapshotter", "pause", True),
    ("snapshotter", "suspend", True),
    ("snapshotter", "tag", True),
    ("snapshotter", "update-template", True),
    ("snapshotter", "stop", True),
    ("scheduler", "resume", True),
    ("scheduler", "explain", True),
    ("scheduler", "fragmentation", False),
]
ERROR_CODES = {c.value for c in ErrorCode} - {"INTERNAL"}

BIG = 10**30
HAND_WRITTEN = [
    b"",
    b"null",
    b"[]",
    b"42",
    b'"text"',
    b"{",
    b"\xff\xfe\xfd",
    b'{"worker_id": "\xff"}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
    b"{" + b'"x": 1,' * 50_000 + b'"y": 2}',
    b'{"request_id": "' + b"r" * 1_000_000 + b'"}',
    b" " * (1 << 20) + b"{}",
    json.dumps({"worker_id": "w", "node": "n", "capacity": {"cpu_millis": -1, "memory_mib": BIG}}).encode(),
    json.dumps({"actor_id": "a", "sandbox_class": "gvisor", "template_uid": "t",
                "resources": {"cpu_millis": BIG, "memory_mib": 1}, "min_fidelity": "PERFECT"}).encode(),
    json.dumps({"fidelity": "TELEPATHY"}).encode(),
    json.dumps({"tag": "../../etc"}).encode(),
    json.dumps({"template_uid": ""}).encode(),
    json.dumps({"selectors": {"k": ["not", "a", "string"]}, "min_seq": -5}).encode(),
    json.dumps({"min_seq": BIG}).encode(),
    json.dumps({"sandbox_class": "Not_A_Class"}).encode(),
    json.dumps({"request_id": 12}).encode(),
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=25,
)
field_names = st.sampled_from(
    ["worker_id", "node", "capacity", "labels", "sandbox_classes", "request_id", "reason", "actor_id",
     "sandbox_class", "template_uid", "resources", "selectors", "min_fidelity", "source_tag", "golden_snapshot",
     "snapshot_id", "uri", "fidelity", "tag", "min_seq"]
)
objects = st.dictionaries(field_names, json_values, max_size=6)


async def refused(nc, subject: str, data: bytes) -> ErrorReply:
    msg = await nc.request(subject, data, timeout=10)
    return check_refusal(msg, subject, data)


def is_error(msg) -> bool:
    return bool(msg.headers and "Nats-Service-Error-Code" in msg.headers)


def check_refusal(msg, subject: str, data: bytes) -> ErrorReply:
    assert is_error(msg), (subject, data[:80], msg.data[:200])
    reply = msgspec.json.decode(msg.data, type=ErrorReply)
    assert reply.error.code.value in ERROR_CODES, (subject, data[:80], reply)
    assert "Traceback" not in reply.error.message and "File \"" not in reply.error.message
    assert msg.headers["Nats-Service-Error-Code"] in {"400", "404", "409", "429", "503"}
    return reply


def subject_of(prefix: str, service: str, verb: str, per_entity: bool, entity: str = "x-1") -> str:
    return service_subject(prefix, service, verb, entity if per_entity else None)


def valid_registration(worker_id: str) -> RegisterWorker:
    return worker(worker_id, version("1"), node="node-1", mem=8192)


async def still_serving(nc, prefix: str) -> None:
    """A valid request after the abuse is answered normally."""
    reply = await call(nc, service_subject(prefix, "registry", "register", "w-ok"), valid_registration("w-ok"),
                       RegisterReply)
    assert reply.outcome.value == "REGISTERED"
    beat = await call(nc, service_subject(prefix, "registry", "heartbeat", "w-ok"), b"{}", HeartbeatReply)
    assert beat.ttl_s > 0


async def refused_or_read(nc, service: str, verb: str, subject: str, data: bytes) -> None:
    """Writes must refuse; the two reads may answer a body that happens to be a valid query,
    and then only with what they answer for an unknown actor or an empty fleet."""
    msg = await nc.request(subject, data, timeout=10)
    if is_error(msg):
        check_refusal(msg, subject, data)
    elif (service, verb) == ("scheduler", "explain"):
        explanation = msgspec.json.decode(msg.data, type=Explanation)
        assert explanation.decision is None and explanation.error.code == ErrorCode.NOT_FOUND, (data[:80], msg.data)
    else:
        assert (service, verb) == ("scheduler", "fragmentation"), (service, verb, data[:80], msg.data[:200])
        msgspec.json.decode(msg.data, type=Fragmentation)


@pytest.mark.parametrize("service,verb,per_entity", ENDPOINTS)
async def test_hand_written_hostile_bodies_are_refused_and_write_nothing(stack, nc, prefix, service, verb,
                                                                         per_entity):
    before = await last_seq(nc, prefix)
    subject = subject_of(prefix, service, verb, per_entity)
    for data in HAND_WRITTEN:
        await refused_or_read(nc, service, verb, subject, data)
    assert await last_seq(nc, prefix) == before


async def test_a_body_over_one_mebibyte_names_the_limit(stack, nc, prefix):
    reply = await refused(nc, subject_of(prefix, "registry", "register", True), b"{" + b" " * (1 << 20) + b"}")
    assert reply.error.code == ErrorCode.INVALID_ARGUMENT
    assert "exceeds" in reply.error.message


async def test_hostile_subject_tokens_are_refused(stack, nc, prefix):
    before = await last_seq(nc, prefix)
    for token in ["-leading-dash", "x" * 129, "caf\u00e9", "a%00b", "_under"]:
        reply = await refused(nc, subject_of(prefix, "registry", "heartbeat", True, token), b"{}")
        assert reply.error.code == ErrorCode.INVALID_ARGUMENT
        assert reply.error.field == "subject"
    assert await last_seq(nc, prefix) == before


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(endpoint=st.sampled_from(ENDPOINTS), body=objects | json_values, raw=st.binary(max_size=64),
       use_raw=st.booleans())
async def test_generated_hostile_bodies_are_refused_and_write_nothing(stack, nc, prefix, endpoint, body, raw,
                                                                     use_raw):
    service, verb, per_entity = endpoint
    data = raw if use_raw else json.dumps(body).encode()
    before = await last_seq(nc, prefix)
    await refused_or_read(nc, service, verb, subject_of(prefix, service, verb, per_entity), data)
    assert await last_seq(nc, prefix) == before


async def test_services_still_serve_after_the_abuse(stack, nc, prefix):
    for data in HAND_WRITTEN:
        await refused(nc, subject_of(prefix, "snapshotter", "create", True), data)
    await still_serving(nc, prefix)


async def test_invalid_utf8_is_refused_even_in_a_field_nobody_reads(stack, nc, prefix):
    """msgspec skips unknown fields without reading their text; the edge checks the whole body."""
    for service, verb, per_entity in ENDPOINTS:
        reply = await refused(nc, subject_of(prefix, service, verb, per_entity), b'{"not_a_field": "\xff"}')
        assert reply.error.code == ErrorCode.INVALID_ARGUMENT and "UTF-8" in reply.error.message
