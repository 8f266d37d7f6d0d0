"""The events the snapshotter and the scheduler write: none that a valid request makes is past one message.

The registry refuses a registration whose event would not fit one message of the server (its max_payload,
EVENT_HEADROOM kept for the headers: tests/test_registry_event_size.py), because a registration's classes
are bounded by counts that allow events of megabytes. Every other event a caller's request fills is bounded
by the schema's lengths far tighter than by the 1 MiB a body may be (`events.codec.MAX_BODY`): 64 selectors
(keys of at most 253 characters, values of 256), a uri of 2048 characters, a stamp of one version (32
attributes of 128 + 256) and a name of 253, a reason of 256, ids of 128. Written with the widest character
(4 bytes of UTF-8), the largest is a create's ActorCreated, carrying the selectors and the golden snapshot:
130,678 bytes, an eighth of nats-server's default 1 MB (docs/contract.md, "A registration too large for one
event"). So they are not measured before they are written; these tests hold the bound: the widest requests
are the widest the schema takes (one more of anything is refused), their events fit a 1 MB server with room
to spare, and on a real one the widest create and its tag are written.
"""

from __future__ import annotations

from datetime import datetime, timezone

import msgspec
import pytest

from events.codec import MAX_BODY, decode_request, encode
from events.errors import ContractError
from events.natspy.headers import header_block
from events.schema import (
    Action,
    ActorCreated,
    ActorPlaced,
    ActorReverted,
    ActorRuntime,
    CompatVersion,
    CreateActor,
    ErrorCode,
    Fallback,
    FallbackReason,
    ImageNamed,
    PlacedFidelity,
    Resources,
    RevertActor,
    Snapshot,
    SnapshotOrigin,
    SnapshotTaken,
    SuspendActor,
    TagRecorded,
    TemplateChanged,
    WorkerBooked,
    WorkerDrained,
    WorkerRemoved,
)
from events.subjects import service_subject, stream_name
from services.registry.domain import EVENT_HEADROOM
from services.snapshotter.domain import Actor
from services.snapshotter.service import SnapshotterService
from tests.conftest import ONE_MB

AT = datetime(2026, 12, 7, 0, 0, 0, 123456, tzinfo=timezone.utc)  # with microseconds, as `at` mostly is
WIDE = "\U00010000"  # the widest character a printable string holds: 4 bytes of UTF-8, as msgspec writes it
ROOM = ONE_MB - EVENT_HEADROOM  # what an event may be on nats-server's default max_payload
LARGEST = 130_678  # the widest create's ActorCreated: the largest event a snapshotter or scheduler request makes


# --- the widest values the schema takes --------------------------------------------------------------


def widest_id(tag: str) -> str:
    return (tag + "x" * 128)[:128]  # an id: 128 letters, digits, '_' or '-'


def widest_version(tag: str) -> dict:
    """32 attributes, each key 128 characters and each value 256 of the widest; a schema that requires no key."""
    return {"schema_version": "v9999",
            "attributes": [{"key": (f"k{tag}{i:02d}" + "k" * 128)[:128], "value": WIDE * 256} for i in range(32)]}


def widest_stamp(tag: str) -> dict:
    return {"sandbox_class": "c" * 63, "version": widest_version(tag), "name": WIDE * 253}


def widest_snapshot(tag: str, location: str = "EXTERNAL") -> dict:
    return {"snapshot_id": widest_id(tag), "actor_id": widest_id("a"), "template_uid": widest_id("t"),
            "fidelity": "VOLUMES", "location": location, "uri": WIDE * 2048, "sandbox_runtime": widest_stamp(tag),
            "borrowed": True, "taken_at": "2026-12-07T00:00:00.123456+00:00",
            **({"node": widest_id("n")} if location == "LOCAL" else {})}


def widest_create(actor_id: str = widest_id("a")) -> dict:
    """A create whose every field is as wide as the schema takes: 64 selectors of the longest keys and values,
    a golden snapshot of the widest uri and stamp, the longest request id."""
    return {"actor_id": actor_id, "sandbox_class": "c" * 63, "template_uid": widest_id("t"),
            "resources": {"cpu_millis": 1 << 40, "memory_mib": 1 << 40},
            "selectors": {(f"{i:02d}" + "k" * 253)[:253]: WIDE * 256 for i in range(64)},
            "min_fidelity": "VOLUMES", "golden_snapshot": {**widest_snapshot("g"), "actor_id": actor_id},
            "request_id": WIDE * 128}


def one_more(path: list, grow) -> dict:
    """The widest create with the value at `path` made one wider by `grow`."""
    body = widest_create()
    where = body
    for step in path[:-1]:
        where = where[step]
    where[path[-1]] = grow(where[path[-1]])
    return body


# --- the bound, pure ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "grow"), [
    (["selectors"], lambda s: {**s, "zz": "v"}),
    (["selectors"], lambda s: {**s, next(iter(s)): s[next(iter(s))] + "v"}),
    (["selectors"], lambda s: {k + "k" if i == 0 else k: v for i, (k, v) in enumerate(s.items())}),
    (["golden_snapshot", "uri"], lambda u: u + "u"),
    (["golden_snapshot", "sandbox_runtime", "name"], lambda n: n + "n"),
    (["golden_snapshot", "sandbox_runtime", "version", "attributes"], lambda a: a + [{"key": "more", "value": "v"}]),
    (["golden_snapshot", "sandbox_runtime", "version", "attributes"],
     lambda a: [{**a[0], "value": a[0]["value"] + "v"}] + a[1:]),
    (["golden_snapshot", "sandbox_runtime", "version", "attributes"],
     lambda a: [{**a[0], "key": a[0]["key"] + "k"}] + a[1:]),
    (["golden_snapshot", "snapshot_id"], lambda i: i + "x"),
    (["request_id"], lambda r: r + "r"),
], ids=["a 65th selector", "a selector's value", "a selector's key", "the uri", "the stamp's name",
        "a 33rd attribute", "an attribute's value", "an attribute's key", "an id", "the request id"])
def test_the_widest_create_is_the_widest_the_schema_takes(path, grow):
    """The widest create is taken, and one more of anything it is widest in is refused: what the events below
    are measured from is what the schema allows, no less (a bound raised must be measured anew)."""
    assert decode_request(CreateActor, encode(widest_create())).selectors
    with pytest.raises(ContractError) as refused:
        decode_request(CreateActor, encode(one_more(path, grow)))
    assert refused.value.code is ErrorCode.INVALID_ARGUMENT


def test_every_event_a_snapshotter_or_scheduler_request_makes_fits_a_one_mb_server_with_room_to_spare():
    """Each event built from the widest request that fills it (the create's through the domain), and from the
    widest stamp a worker's registration gives a placement: the largest, ActorCreated, is an eighth of what a
    1 MB server carries. The registry's other events (a drain's, a removal's) carry a reason of 256."""
    body = encode(widest_create())
    assert len(body) < MAX_BODY
    actor = Actor(widest_id("a"))
    actor.create(decode_request(CreateActor, body), None, AT)
    created = [recorded.body for recorded in actor.collect_events()]
    assert [type(e) for e in created] == [ActorCreated, SnapshotTaken]

    request_id = WIDE * 128
    external = msgspec.convert(widest_snapshot("s"), Snapshot)
    local = msgspec.convert(widest_snapshot("l", "LOCAL"), Snapshot)
    pin = msgspec.convert(widest_stamp("p"), ActorRuntime)
    uri = decode_request(SuspendActor, encode({"fidelity": "VOLUMES", "uri": WIDE * 2048})).uri
    reason = decode_request(RevertActor, encode({"reason": WIDE * 256})).reason
    events = [
        *created,
        # a suspend's (the uri its request gives, the stamp its placement's pin gives) and a tag's copy
        SnapshotTaken(at=AT, request_id=request_id, actor_id=widest_id("a"), origin=SnapshotOrigin.SUSPEND,
                      snapshot=msgspec.structs.replace(external, uri=uri)),
        TagRecorded(at=AT, request_id=request_id, tag=widest_id("g"), snapshot=external),
        ImageNamed(at=AT, request_id=request_id, snapshot=local),
        ActorReverted(at=AT, request_id=request_id, actor_id=widest_id("a"), snapshot=external, abandoned=local,
                      reason=reason),
        TemplateChanged(at=AT, request_id=request_id, actor_id=widest_id("a"), template_uid=widest_id("t")),
        ActorPlaced(at=AT, request_id=request_id, actor_id=widest_id("a"), worker_id=widest_id("w"),
                    node=widest_id("n"), action=Action.RESTORE, fidelity=PlacedFidelity.VOLUMES, sandbox_runtime=pin,
                    snapshot_id=widest_id("s"), booked=Resources(cpu_millis=1 << 40, memory_mib=1 << 40),
                    fallback=Fallback(reason=FallbackReason.TEMPLATE_CHANGED, from_fidelity=PlacedFidelity.MEMORY,
                                      to_fidelity=PlacedFidelity.VOLUMES),
                    matched_version=msgspec.convert(widest_version("m"), CompatVersion)),
        WorkerBooked(at=AT, request_id=request_id, worker_id=widest_id("w"), actor_id=widest_id("a")),
        WorkerDrained(at=AT, request_id=request_id, worker_id=widest_id("w"), reason=reason),
        WorkerRemoved(at=AT, request_id=request_id, worker_id=widest_id("w"), reason=reason, revision=(1 << 53) - 1),
    ]
    sizes = {f"{type(e).__name__}#{i}": len(encode(e)) for i, e in enumerate(events)}
    largest = max(sizes, key=sizes.get)
    assert (largest, sizes[largest]) == ("ActorCreated#0", LARGEST), sizes
    assert LARGEST * 8 < ROOM


# --- over the bus: a 1 MB server -----------------------------------------------------------------------


async def test_on_a_one_mb_server_the_widest_create_and_its_tag_are_written(one_mb, prefix):
    """The widest create, sent to a snapshotter on a 1 MB server, is written (ActorCreated, its SnapshotTaken
    and the golden id's ImageNamed), each message as large as measured above and its headers within the
    headroom; and so is its tag. docs/contract.md had it that such a create could come back INTERNAL."""
    url, nc = one_mb
    service = await SnapshotterService(nc, nats_url=url, prefix=prefix).start()
    try:
        actor_id = widest_id("a")
        reply = msgspec.json.decode((await nc.request(service_subject(prefix, "snapshotter", "create", actor_id),
                                                      encode(widest_create()), timeout=30)).data)
        assert "seq" in reply, reply
        tag = msgspec.json.decode((await nc.request(service_subject(prefix, "snapshotter", "tag", actor_id),
                                                    encode({"tag": widest_id("g")}), timeout=30)).data)
        assert "snapshot" in tag, tag
        js = nc.jetstream()
        stored = [await js.get_msg(stream_name(prefix), seq) for seq in range(1, tag["seq"] + 1)]
        types = [msgspec.json.decode(m.data)["type"] for m in stored if m.subject.startswith(f"{prefix}.ev.")]
        assert sorted(types) == sorted(["ActorCreated", "SnapshotTaken", "ImageNamed", "SnapshotTaken",
                                        "TagRecorded"]), types
        sizes = {msgspec.json.decode(m.data)["type"]: len(m.data) for m in stored if m.subject.startswith(f"{prefix}.ev.")}
        assert sizes["ActorCreated"] <= LARGEST, sizes  # its `at` may have fewer digits than six
        assert max(len(header_block(m.headers or {})) for m in stored) < EVENT_HEADROOM
    finally:
        await service.stop()
