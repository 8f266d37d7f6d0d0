"""CONTRACT v1.1, the edges of the rules, over the real bus: min_fidelity as a floor,
selectors that only narrow, printable text, request ids per life, registrations compared
normalised, explain's refusal, and times normalised to UTC. Every refusal writes nothing.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import msgspec
import pytest

from events.codec import encode
from events.errors import ContractError
from events.schema import (
    Action,
    ActorCreated,
    ActorOverhead,
    ErrorCode,
    Fidelity,
    PlacedFidelity,
    RegisterOutcome,
    SnapshotTaken,
    WorkerRegistered,
)
from events.subjects import service_subject
from tests.factories import actor, golden, last_seq, read_log, runtime, version, worker
from warmboot.client import Client

V1, V2, V3 = version("v1"), version("v2"), version("v3")


@pytest.fixture
async def wb(stack, nc, prefix):
    return Client(nc, prefix)


async def refused(nc, prefix, call) -> ContractError:
    """The contract error `call` is refused with; the stream's last sequence is unchanged."""
    before = await last_seq(nc, prefix)
    with pytest.raises(ContractError) as caught:
        await call
    assert await last_seq(nc, prefix) == before, "a refused request wrote something"
    return caught.value


# --- min_fidelity is a floor for every rule (4a) -------------------------------------------------


async def test_min_fidelity_memory_never_cold_boots_or_gives_up_memory(wb, nc, prefix):
    await wb.register(worker("w", V1, mem=8192))
    # no snapshot: a cold boot (NONE) is below MEMORY
    await wb.create(actor("fresh", min_fidelity=Fidelity.MEMORY))
    error = await refused(nc, prefix, wb.resume("fresh"))
    assert error.code is ErrorCode.FAILED_PRECONDITION and "MEMORY" in error.message
    # a memory snapshot of an older template: the memory is unusable, more room cannot help
    await wb.create(actor("tpl", min_fidelity=Fidelity.MEMORY, golden_snapshot=golden(V1)))
    await wb.update_template("tpl", "t2")
    error = await refused(nc, prefix, wb.resume("tpl"))
    assert error.code is ErrorCode.FAILED_PRECONDITION and "template" in error.message
    # an unstamped golden snapshot: no runtime can be matched to it
    await wb.create(actor("bare", min_fidelity=Fidelity.MEMORY,
                          golden_snapshot=msgspec.structs.replace(golden(V1, snapshot_id="golden-bare"),
                                                                   sandbox_runtime=None)))
    error = await refused(nc, prefix, wb.resume("bare"))
    assert error.code is ErrorCode.FAILED_PRECONDITION and "stamp" in error.message
    # compatible workers exist but are full: more room would help
    await wb.create(actor("big", mem=7000, min_fidelity=Fidelity.MEMORY, golden_snapshot=golden(V1)))
    await wb.create(actor("big2", mem=7000, min_fidelity=Fidelity.MEMORY, golden_snapshot=golden(V1)))
    assert (await wb.resume("big")).fidelity is PlacedFidelity.MEMORY
    assert (await refused(nc, prefix, wb.resume("big2"))).code is ErrorCode.RESOURCE_EXHAUSTED


async def test_min_fidelity_volumes_is_kept_by_every_rule(wb, nc, prefix):
    await wb.register(worker("w", V2, mem=8192))
    # a ROOTFS snapshot holds less than VOLUMES
    await wb.register(worker("old", V1))
    await wb.create(actor("r", min_fidelity=Fidelity.VOLUMES))
    await wb.resume("r")
    await wb.suspend("r", fidelity=Fidelity.ROOTFS, uri="s3://r")
    error = await refused(nc, prefix, wb.resume("r"))
    assert error.code is ErrorCode.FAILED_PRECONDITION and "ROOTFS" in error.message
    # a borrowed golden snapshot owns nothing to lose: it may RUN below VOLUMES
    await wb.remove("old")
    await wb.create(actor("g", min_fidelity=Fidelity.VOLUMES, golden_snapshot=golden(V1)))
    placed = await wb.resume("g")
    assert (placed.fidelity, placed.fallback.to_fidelity) == (PlacedFidelity.NONE, PlacedFidelity.NONE)
    # so does one of ROOTFS only (found by a review: refused, though the audit and the memory case agree)
    await wb.create(actor("gr", min_fidelity=Fidelity.VOLUMES, golden_snapshot=golden(V1, snapshot_id="golden-rootfs",
                                                                                         fidelity=Fidelity.ROOTFS)))
    placed = await wb.resume("gr")
    assert (placed.action, placed.fidelity, placed.fallback) == (Action.RUN, PlacedFidelity.NONE, None)
    # an actor with no snapshot may always RUN below its floor, unless that floor is MEMORY
    await wb.create(actor("new", min_fidelity=Fidelity.VOLUMES))
    assert (await wb.resume("new")).fidelity is PlacedFidelity.NONE


# --- a request's selectors add to the actor's (rule 6) ----------------------------------------------


async def test_a_resume_cannot_widen_the_actors_selectors(wb, nc, prefix):
    await wb.register(worker("eu", V1, labels={"zone": "eu", "rack": "r1"}))
    await wb.register(worker("us", V1, labels={"zone": "us", "rack": "r1"}, cpu=64000, mem=65536))
    await wb.create(actor("a", selectors={"zone": "eu"}))
    error = await refused(nc, prefix, wb.resume("a", selectors={"zone": "us"}))
    assert (error.code, error.field) == (ErrorCode.INVALID_ARGUMENT, "selectors.zone")
    with pytest.raises(ContractError) as explained:  # explain refuses the same request the same way
        await wb.explain("a", selectors={"zone": "us"})
    assert explained.value.field == "selectors.zone"
    placed = await wb.resume("a", selectors={"zone": "eu", "rack": "r1"})  # the same key agreeing, a new one
    assert placed.worker_id == "eu"


# --- printable text ------------------------------------------------------------------------------------


INVISIBLE = ["\u200b", "\u202e", "\u00a0", "\u2028", "\ufeff", "\ue000", "\u0378"]


@pytest.mark.parametrize("char", INVISIBLE, ids=[f"U+{ord(c):04X}" for c in INVISIBLE])
async def test_invisible_and_bidi_text_is_refused_at_the_edge(wb, nc, prefix, char):
    spoofed = version("v1" + char)
    error = await refused(nc, prefix, wb.register(worker("w", spoofed)))
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == "sandbox_classes[0].default_runtime.version.attributes[1].value"
    error = await refused(nc, prefix, wb.register(worker("w", V1, labels={"team": "a" + char})))
    assert error.field == "labels.team"
    error = await refused(nc, prefix, wb.register(worker("w", runtime(V1, name="gvisor" + char))))
    assert error.field == "sandbox_classes[0].default_runtime.name"
    await wb.register(worker("w", V1))
    error = await refused(nc, prefix, wb.drain("w", reason="ok" + char))
    assert (error.code, error.field) == (ErrorCode.INVALID_ARGUMENT, "reason")


# --- request ids are scoped to one life ---------------------------------------------------------------


async def test_a_worker_that_derives_its_request_id_from_its_config_can_come_back(wb, nc, prefix):
    body = worker("w1", V1, request_id="boot-1")
    first = await wb.register(body)
    assert await wb.register(body) == first  # a retry in the same life: the first answer
    await wb.remove("w1")
    again = await wb.register(body)  # a new life: a new registration, written
    assert again.outcome is RegisterOutcome.REGISTERED and again.seq > first.seq
    assert (await wb.heartbeat("w1")).ttl_s > 0
    registered = [e for _, e in await read_log(nc, prefix) if isinstance(e, WorkerRegistered)]
    assert len(registered) == 2


async def test_an_actor_stopped_is_created_anew_with_the_same_request_id(wb, nc, prefix):
    await wb.register(worker("w", V1))
    first = await wb.create(actor("a", request_id="make-a"))
    assert await wb.create(actor("a", request_id="make-a")) == first
    await wb.resume("a")
    await wb.stop("a")
    again = await wb.create(actor("a", request_id="make-a"))
    assert again.seq > first.seq
    placed = await wb.resume("a")  # a fresh life: cold start again, nothing of the last one
    assert placed.fidelity is PlacedFidelity.NONE
    created = [e for _, e in await read_log(nc, prefix) if isinstance(e, ActorCreated)]
    assert len(created) == 2
    error = await refused(nc, prefix, wb.create(actor("a", request_id="other")))
    assert error.code is ErrorCode.ALREADY_EXISTS  # alive again: a create of another request is refused


async def test_a_request_id_reused_for_another_verb_is_one_rule_in_every_service(wb, nc, prefix):
    await wb.register(worker("w", V1, request_id="r-1"))
    error = await refused(nc, prefix, wb.drain("w", request_id="r-1"))
    assert (error.code, error.field) == (ErrorCode.FAILED_PRECONDITION, "request_id")
    await wb.create(actor("a", request_id="c-1"))
    await wb.resume("a")
    error = await refused(nc, prefix, wb.pause("a", request_id="c-1"))
    assert (error.code, error.field) == (ErrorCode.FAILED_PRECONDITION, "request_id")


async def test_a_pause_whose_id_a_resume_reused_is_still_answered_with_its_own_write(wb, nc, prefix):
    """The scheduler does not refuse a resume whose id a pause used (docs/contract.md); the
    ActorPlaced it records with that id is not the pause's answer: a retry of the pause gets
    the first answer, the seq of its own snapshot's write, and writes nothing."""
    await wb.register(worker("w", V1))
    await wb.create(actor("a"))
    await wb.resume("a", request_id="r-0")
    first = await wb.pause("a", request_id="p-1")
    await wb.resume("a", request_id="p-1")
    before = await last_seq(nc, prefix)
    assert await wb.pause("a", request_id="p-1") == first
    assert await last_seq(nc, prefix) == before


async def test_a_request_that_wrote_nothing_is_answered_again_after_a_later_change(wb, nc, prefix):
    """A registration that changed nothing (UNCHANGED) and an update to the template an actor
    has write no event; repeated after a later change (a retry after a lost reply, or a copy
    a stalled replica decides late), each gets its first answer and writes nothing, instead
    of being decided again and undoing the change."""
    await wb.register(worker("w", V1, request_id="r-1"))
    first = await wb.register(worker("w", V1, request_id="r-2"))
    assert first.outcome is RegisterOutcome.UNCHANGED
    await wb.register(worker("w", V2, cpu=8000, request_id="r-3"))  # the runtime and the capacity change
    await wb.create(actor("a", template="t1"))
    kept = await wb.update_template("a", "t1", request_id="u-1")  # already t1
    await wb.update_template("a", "t2", request_id="u-2")
    before = await last_seq(nc, prefix)
    assert await wb.register(worker("w", V1, request_id="r-2")) == first
    assert await wb.update_template("a", "t1", request_id="u-1") == kept
    assert await last_seq(nc, prefix) == before
    # the same ids for other verbs name those requests: refused
    error = await refused(nc, prefix, wb.drain("w", request_id="r-2"))
    assert (error.code, error.field) == (ErrorCode.FAILED_PRECONDITION, "request_id")
    # a drain of a drained worker: its retry after the removal gets the first answer too
    await wb.drain("w", request_id="d-1")
    noop = await wb.drain("w", request_id="d-2")
    await wb.remove("w", request_id="x-1")
    assert await wb.drain("w", request_id="d-2") == noop
    # a new life: an id kept in the last one is a new request
    again = await wb.register(worker("w", V1, request_id="r-2"))
    assert again.outcome is RegisterOutcome.REGISTERED and again.seq > before


# --- registrations are compared normalised ----------------------------------------------------------------


async def test_reordering_runtimes_or_null_overhead_is_no_change(wb, nc, prefix):
    a = runtime(V1, compatible=(version("old1"), version("old2")))
    first = await wb.register(worker("w", V3, (a, runtime(V2))))
    reordered = worker("w", V3, (runtime(V2), runtime(V1, compatible=(version("old2"), version("old1")))))
    assert (await wb.register(reordered)).outcome is RegisterOutcome.UNCHANGED
    null_overhead = msgspec.structs.replace(
        reordered, sandbox_classes=tuple(
            msgspec.structs.replace(e, default_runtime=msgspec.structs.replace(e.default_runtime, actor_overhead=None))
            for e in reordered.sandbox_classes))
    assert (await wb.register(null_overhead)).outcome is RegisterOutcome.UNCHANGED
    zeros = msgspec.structs.replace(
        null_overhead, sandbox_classes=tuple(
            msgspec.structs.replace(e, default_runtime=msgspec.structs.replace(
                e.default_runtime, actor_overhead=ActorOverhead(fixed_mib=0, per_gib_mib=0)))
            for e in null_overhead.sandbox_classes))
    assert (await wb.register(zeros)).outcome is RegisterOutcome.UNCHANGED
    changed = await wb.register(worker("w", V3, (runtime(V2),)))
    assert changed.outcome is RegisterOutcome.RUNTIME_CHANGED and changed.seq > first.seq


# --- explain never answers a top-level error for a refusal ---------------------------------------------------


async def test_explain_of_a_refused_resume_is_a_successful_reply(wb, nc, prefix):
    await wb.register(worker("w", V2))
    await wb.create(actor("a", min_fidelity=Fidelity.MEMORY, golden_snapshot=golden(V1)))
    body = b'{"min_seq": %d}' % wb.seq  # read-your-writes, as the client itself would ask
    msg = await nc.request(service_subject(prefix, "scheduler", "explain", "a"), body, timeout=5)
    body = json.loads(msg.data)
    assert "error" not in body and body["decision"] is None
    assert body["refusal"]["code"] == "RESOURCE_EXHAUSTED"
    assert not (msg.headers or {}).get("Nats-Service-Error-Code")


# --- times a caller sends are UTC in the log -------------------------------------------------------------------


async def test_a_golden_snapshots_time_is_normalised_to_utc_or_refused(wb, nc, prefix):
    local = datetime(2026, 12, 1, 14, 0, tzinfo=timezone(timedelta(hours=2)))
    await wb.create(actor("a", golden_snapshot=msgspec.structs.replace(golden(V1), taken_at=local)))
    (taken,) = [e for _, e in await read_log(nc, prefix) if isinstance(e, SnapshotTaken)]
    assert taken.snapshot.taken_at == local and taken.snapshot.taken_at.utcoffset() == timedelta(0)
    raw = json.loads(encode(actor("b", golden_snapshot=golden(V1))))
    raw["golden_snapshot"]["taken_at"] = "2026-12-01T12:00:00"  # no zone: not RFC 3339
    before = await last_seq(nc, prefix)
    msg = await nc.request(service_subject(prefix, "snapshotter", "create", "b"), json.dumps(raw).encode(), timeout=5)
    error = json.loads(msg.data)["error"]
    assert (error["code"], error["field"]) == ("INVALID_ARGUMENT", "golden_snapshot.taken_at")
    assert await last_seq(nc, prefix) == before


# --- where an image lives: one node, one id ---------------------------------------------------------


async def test_a_pause_on_a_worker_that_registered_on_another_node_since_is_refused(wb, nc, prefix):
    """A worker may change its node within a life (CONTRACT: WorkerUpdated). A pause records its
    LOCAL image on the assignment's node: after w-a reported node n-b, that image would be said to
    be on n-a, and the resume sent to w-x on n-a, which has no such image. Refused, nothing
    written, even once it reports n-a again (what ran may not have come back with it); a suspend
    (EXTERNAL) is taken; placed anew, it pauses as usual."""
    await wb.register(worker("w-a", V1, node="n-a"))
    await wb.register(worker("w-x", V1, node="n-a"))
    await wb.create(actor("a"))
    await wb.drain("w-x")
    assert (await wb.resume("a")).worker_id == "w-a"
    moved = await wb.register(worker("w-a", V1, node="n-b"))
    assert moved.outcome is RegisterOutcome.UPDATED
    error = await refused(nc, prefix, wb.pause("a"))
    assert error.code is ErrorCode.FAILED_PRECONDITION
    assert ("placed on node 'n-a', and the worker registered on node 'n-b' since (sequence "
            f"{moved.seq})") in error.message and "suspend it instead" in error.message
    await wb.register(worker("w-a", V1, node="n-a"))  # back on the node it was placed on
    error = await refused(nc, prefix, wb.pause("a"))
    assert "registered on node 'n-b' since" in error.message
    suspended = (await wb.suspend("a", uri="s3://a/1")).snapshot
    assert suspended.location.value == "EXTERNAL" and suspended.node is None
    assert (await wb.resume("a")).worker_id == "w-a"  # placed anew, on n-a
    paused = (await wb.pause("a")).snapshot
    assert paused.node == "n-a"


async def test_a_snapshot_id_names_one_image_of_an_actor(wb, nc, prefix):
    """A worker finds an image by its id (an Assignment names nothing else). The review's path: an
    EXTERNAL `img` stamped V1, then a LOCAL `img` stamped V2, a revert, and the resume named `img`
    to a V1 worker on the node whose disk held the V2 one. A second image under an id the actor has
    used is refused (field snapshot_id), nothing written; a promote keeps its image's id."""
    await wb.register(worker("w1", V1, node="n-a"))
    await wb.create(actor("a"))
    await wb.resume("a")
    await wb.suspend("a", uri="s3://a/img", snapshot_id="img")
    await wb.resume("a")
    error = await refused(nc, prefix, wb.pause("a", snapshot_id="img"))
    assert (error.code, error.field) == (ErrorCode.FAILED_PRECONDITION, "snapshot_id")
    assert "snapshot_id 'img' already names another snapshot of actor 'a'" in error.message
    error = await refused(nc, prefix, wb.suspend("a", uri="s3://a/img2", snapshot_id="img"))
    assert error.field == "snapshot_id"
    paused = (await wb.pause("a", snapshot_id="p-1")).snapshot
    error = await refused(nc, prefix, wb.suspend("a", uri="s3://a/x", snapshot_id="img"))  # promote renamed
    assert error.field == "snapshot_id"
    promoted = (await wb.suspend("a", uri="s3://a/p-1", snapshot_id="p-1")).snapshot  # its own id: kept
    assert promoted.snapshot_id == paused.snapshot_id == "p-1"


async def test_a_snapshot_id_in_the_form_of_another_actors_default_ids_is_refused(wb, nc, prefix):
    """Ids are not checked across actors, yet the default ones were said never to collide: actor b
    could suspend as `a-v7`, the id a's seventh version takes by default, and a's resume then named
    an id that also names b's image (found by a review). An id a caller gives, for a pause, a
    suspend or a golden snapshot, in the form `<other actor>-v<version>[-<step>]` is refused
    (INVALID_ARGUMENT, the field named), nothing written; the actor's own form, and forms no
    default takes (`-v0`, `-v07`), are taken."""
    await wb.register(worker("w1", V1, node="n-a"))
    await wb.create(actor("b"))
    await wb.resume("b")
    for taken in ("a-v7", "a-v7-1", "x-y-v12"):
        error = await refused(nc, prefix, wb.suspend("b", uri="s3://b/1", snapshot_id=taken))
        assert (error.code, error.field) == (ErrorCode.INVALID_ARGUMENT, "snapshot_id")
        assert f"snapshot_id {taken!r} has the form of the ids the snapshotter gives another actor's" in error.message
    error = await refused(nc, prefix, wb.pause("b", snapshot_id="a-v7"))
    assert error.field == "snapshot_id"
    error = await refused(nc, prefix, wb.create(actor("c", golden_snapshot=golden(V1, snapshot_id="a-v3"))))
    assert (error.code, error.field) == (ErrorCode.INVALID_ARGUMENT, "golden_snapshot.snapshot_id")
    assert (await wb.pause("b", snapshot_id="b-v9")).snapshot.snapshot_id == "b-v9"  # its own form
    assert (await wb.suspend("b", uri="s3://b/2", snapshot_id="a-v0")).snapshot.snapshot_id == "a-v0"
    await wb.resume("b")
    assert (await wb.suspend("b", uri="s3://b/3", snapshot_id="release-v07")).snapshot.snapshot_id == "release-v07"
    await wb.create(actor("c", golden_snapshot=golden(V1, snapshot_id="base-2")))


async def test_a_golden_snapshot_naming_an_earlier_lifes_other_image_is_refused(wb, nc, prefix):
    """One id names one image of an actor, any life: a create anew whose golden snapshot names an
    id an earlier life gave another image (a LOCAL pause image stamped V2 on n-a, the golden one
    V1) was taken, and the resume named an id whose image on n-a was of another stamp (found by
    a review). Refused, FAILED_PRECONDITION, nothing written; a create anew from the same golden
    image as before is taken."""
    await wb.register(worker("w2", V2, node="n-a"))
    base = golden(V2, snapshot_id="base-1")
    await wb.create(actor("a", golden_snapshot=base))
    await wb.resume("a")
    old = (await wb.pause("a")).snapshot
    await wb.stop("a")
    error = await refused(nc, prefix, wb.create(actor("a", golden_snapshot=golden(V1, snapshot_id=old.snapshot_id))))
    assert (error.code, error.field) == (ErrorCode.FAILED_PRECONDITION, "golden_snapshot.snapshot_id")
    assert "already names another snapshot of actor 'a'" in error.message
    error = await refused(nc, prefix, wb.create(actor("a", golden_snapshot=golden(V1, snapshot_id="base-1"))))
    assert error.field == "golden_snapshot.snapshot_id"  # the id of the first life's golden image, another stamp
    await wb.create(actor("a", golden_snapshot=base))  # the same image again


async def test_a_create_from_a_tag_naming_an_earlier_lifes_other_image_is_refused(wb, nc, prefix):
    """The same rule for a tag's snapshot, which a create copies with its id (found by an audit): a's
    first life left a LOCAL `img` stamped V2 on n-a; b suspended an `img` of its own, stamped V1, and
    tagged it; a created anew from that tag was taken, and its resume named `img` at MEMORY to the V1
    worker on n-a, whose disk holds a's V2 `img`. Since one id names one image across actors
    (2026-12-06), b cannot take `img` at all: refused, naming a's image, nothing written (the create's
    own check stays for a log written before: tests/test_snapshotter_domain.py); a tag of another id
    is taken."""
    await wb.register(worker("w2", V2, node="n-a"))
    await wb.create(actor("a"))
    await wb.resume("a")
    old = (await wb.pause("a", snapshot_id="img")).snapshot
    await wb.stop("a")
    await wb.drain("w2")
    await wb.register(worker("w1", V1, node="n-a"))
    for actor_id in ("b", "c"):
        await wb.create(actor(actor_id))
        await wb.resume(actor_id)
    error = await refused(nc, prefix, wb.suspend("b", uri="s3://b", snapshot_id=old.snapshot_id))
    assert (error.code, error.field) == (ErrorCode.FAILED_PRECONDITION, "snapshot_id"), error
    assert "already names an image of actor 'a' (LOCAL on node 'n-a', MEMORY)" in error.message, error
    await wb.suspend("c", uri="s3://c", snapshot_id="img-c")
    await wb.tag("c", "t-c")
    await wb.create(actor("a", source_tag="t-c"))
    placed = await wb.resume("a")
    assert (placed.snapshot_id, placed.worker_id, placed.fidelity) == ("img-c", "w1", PlacedFidelity.MEMORY)


async def test_a_min_seq_past_the_end_of_the_log_is_not_retried_by_the_client(wb, nc, prefix):
    """Nothing will bring a sequence past the end of the log: the scheduler says so naming `min_seq`,
    and the client raises it at once instead of asking again with back-off (about 3.6 s of retries
    before), while a resume whose min_seq is in the log is answered."""
    await wb.register(worker("w1", V1))
    await wb.create(actor("a"))
    before = wb.retries
    with pytest.raises(ContractError) as error:
        await wb.explain("a", min_seq=2**53)
    assert (error.value.code, error.value.field) == (ErrorCode.UNAVAILABLE, "min_seq")
    assert "past the end of the log" in error.value.message and wb.retries == before
    assert (await wb.resume("a", min_seq=await last_seq(nc, prefix))).worker_id == "w1"
