"""`warmboot audit verify` on forged logs: each v1.1 invariant, broken by events appended
directly, is found and named with its sequence (pure folds), and through the CLI on a
real stream."""

from __future__ import annotations

import asyncio

import msgspec

import pytest
from click.testing import CliRunner

from events.schema import (
    Action,
    ActorPlaced,
    ActorReverted,
    ActorStopped,
    Event,
    Fallback,
    FallbackReason,
    Fidelity,
    Location,
    PlacedFidelity,
    ReleaseReason,
    Resources,
    RuntimeChanged,
    SnapshotOrigin,
    SnapshotTaken,
    TagRecorded,
    TemplateChanged,
    WorkerDrained,
    WorkerRegistered,
    WorkerRemoved,
    WorkerUpdated,
)
from tests.factories import (AT, created, entry, fold, golden, placed, registered, released, runtime, snapshot, stamp,
                             taken, version)
from events.states import WorkerState
from services.scheduler.fold import Fold
from warmboot import audit
from warmboot.audit import Sink
from warmboot.cli import main

V1, V2 = version("v1"), version("v2")
ARM = version("v1", arch="arm64")


# These logs' workers are in zone a (on node n1 unless named); their actors are small.
ZONE_A = {"zone": "a"}
SMALL = {"cpu": 100, "mem": 512}
FALLBACK = Fallback(reason=FallbackReason.NO_COMPATIBLE_WORKER, from_fidelity=PlacedFidelity.MEMORY,
                    to_fidelity=PlacedFidelity.VOLUMES)


def resumed(actor_id: str, **fields) -> ActorPlaced:
    """A memory restore on w1 of the snapshot `snapshot(actor_id, V1)` its suspend took."""
    return placed(actor_id, "w1", V1, node="n1", fidelity=PlacedFidelity.MEMORY, action=Action.RESTORE,
                  snapshot_id=f"{actor_id}-s", **SMALL, **fields)


def verify(events: list[Event]) -> audit.Violation | None:
    return fold(events, Sink(verify=True)).violation


def worker_on(worker_id: str, v, node: str = "n1") -> WorkerRegistered:
    return registered(worker_id, entry(v), node=node, labels=ZONE_A)


def test_a_replay_takes_a_placement_it_cannot_read_as_the_scheduler_does():
    """`audit` replays through the scheduler's own fold into a Sink: a booking marker right after a
    placement the fold cannot read (a newer scheduler's) drains the worker there too, and a marker
    after a readable event folds as any other."""
    sink = Sink(verify=True)
    fold_into = Fold(None, "t", sink)
    for seq, event in enumerate([worker_on("w1", V1), created("a1")], start=1):
        sink.apply(seq, event)
    fold_into.fold_message(3, "t.ev.booking.w1", {"Warmboot-Topic": "WorkerBooked", "Warmboot-Version": "1"}, b"{}")
    assert sink.projection.workers["w1"].state is WorkerState.REGISTERED
    fold_into.fold_message(4, "t.ev.actor.big", {"Warmboot-Topic": "ActorPlacedV2", "Warmboot-Version": "2"},
                           b'{"type":"ActorPlacedV2","actor_id":"big","worker_id":"w1","memory_mib":8000}')
    fold_into.fold_message(5, "t.ev.booking.w1", {"Warmboot-Topic": "WorkerBooked", "Warmboot-Version": "2"}, b"{}")
    assert sink.projection.workers["w1"].state is WorkerState.DRAINED
    assert sink.seq == 5 and sink.violation is None


@pytest.mark.parametrize("unread", ["worker", "placement", "actor"])
def test_a_placement_on_state_this_version_cannot_read_is_not_judged(unread):
    """The fold counts a worker drained after a message of its history it cannot read (a newer
    registry's), or after a placement it cannot read (its room then unknown), and knows nothing of an
    actor whose life holds such a message: a placement a newer scheduler made there, feasible on what
    this version cannot read, was reported as a violation (NOT_TAKING: "w1 is drained"; PLACED_TWICE),
    and verify failed a log that may be sound. Not judged, as the stamps of such an actor are not."""
    sink = Sink(verify=True)
    fold_into = Fold(None, "t", sink)
    for seq, event in enumerate([worker_on("w1", V1), created("a", **SMALL), created("big", **SMALL)], start=1):
        sink.apply(seq, event)
    if unread == "worker":
        fold_into.fold_message(4, "t.ev.worker.w1", {"Warmboot-Topic": "WorkerCordonedV2", "Warmboot-Version": "2"},
                               b'{"type":"WorkerCordonedV2","worker_id":"w1"}')
    elif unread == "placement":
        fold_into.fold_message(4, "t.ev.actor.big", {"Warmboot-Topic": "ActorPlacedV2", "Warmboot-Version": "2"},
                               b'{"type":"ActorPlacedV2","actor_id":"big","worker_id":"w1"}')
        fold_into.fold_message(5, "t.ev.booking.w1", {"Warmboot-Topic": "WorkerBooked", "Warmboot-Version": "1"}, b"{}")
    else:
        sink.apply(4, placed("a", "w1", V1, node="n1", **SMALL))
        fold_into.fold_message(5, "t.ev.actor.a", {"Warmboot-Topic": "ActorReleasedV2", "Warmboot-Version": "3"},
                               b'{"type":"ActorReleasedV2","actor_id":"a"}')
    sink.apply(6, placed("a", "w1", V1, node="n1", **SMALL))
    assert sink.violation is None, sink.violation
    # a registration it reads begins the worker's next life, a creation the actor's: judged again from there
    sink.apply(7, WorkerRemoved(at=AT, worker_id="w1"))
    sink.apply(8, worker_on("w1", V1))
    sink.apply(9, ActorStopped(at=AT, actor_id="a"))
    sink.apply(10, created("a", **SMALL))
    sink.apply(11, placed("a", "w1", V1, node="n1", **SMALL))
    sink.apply(12, placed("a", "w1", V1, node="n1", **SMALL))
    assert sink.violation is not None and (sink.violation.seq, sink.violation.rule) == (12, audit.PLACED_TWICE)


def test_a_clean_log_has_no_violation():
    assert verify([worker_on("w1", V1), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL)]) is None


CASES = {
    "drained": ([worker_on("w1", V1), created("a", **SMALL), WorkerDrained(at=AT, worker_id="w1")],
                placed("a", "w1", V1, node="n1", **SMALL), audit.NOT_TAKING),
    "removed": ([worker_on("w1", V1), created("a", **SMALL), WorkerRemoved(at=AT, worker_id="w1")],
                placed("a", "w1", V1, node="n1", **SMALL), audit.NOT_TAKING),
    "runtime dropped": (
        [worker_on("w1", V1), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL),
         taken(snapshot("a", V1, uri="s3://x")), released("a", "w1"),
         RuntimeChanged(at=AT, worker_id="w1", sandbox_classes=(entry(V2),), previous=())],
        placed("a", "w1", V1, node="n1", fidelity=PlacedFidelity.MEMORY, action=Action.RESTORE, snapshot_id="a-s",
               **SMALL),
        audit.RUNTIME_GONE),
    "capacity cut": (
        [worker_on("w1", V1), created("a", **SMALL), WorkerUpdated(at=AT, worker_id="w1", node="n1",
                                                             capacity=Resources(cpu_millis=4000, memory_mib=128),
                                                             labels={"zone": "a"})],
        placed("a", "w1", V1, node="n1", **SMALL), audit.PAST_ROOM),
    "selector no longer met": (
        [worker_on("w1", V1), created("a", selectors={"zone": "a"}, **SMALL),
         WorkerUpdated(at=AT, worker_id="w1", node="n1", capacity=Resources(cpu_millis=4000, memory_mib=4096),
                       labels={"zone": "b"})],
        placed("a", "w1", V1, node="n1", **SMALL), audit.SELECTOR_UNMET),
    "local off its node": (
        [worker_on("w1", V1), worker_on("w2", V1, node="n2"), created("a", **SMALL),
         placed("a", "w1", V1, node="n1", **SMALL),
         taken(snapshot("a", V1, node="n1"), SnapshotOrigin.PAUSE),
         released("a", "w1", ReleaseReason.PAUSED)],
        placed("a", "w2", V1, node="n2", fidelity=PlacedFidelity.MEMORY, action=Action.RESTORE, snapshot_id="a-s",
               **SMALL),
        audit.LOCAL_OFF_NODE),
    "across architectures": (
        [worker_on("w1", V1), worker_on("arm", ARM, node="n9"), created("a", **SMALL),
         placed("a", "w1", V1, node="n1", **SMALL),
         taken(snapshot("a", V1, uri="s3://x")), released("a", "w1"), WorkerRemoved(at=AT, worker_id="w1")],
        placed("a", "arm", ARM, node="n9", fidelity=PlacedFidelity.VOLUMES, action=Action.RESTORE,
               snapshot_id="a-s", fallback=Fallback(reason=FallbackReason.NO_COMPATIBLE_WORKER,
                                                    from_fidelity=PlacedFidelity.MEMORY,
                                                    to_fidelity=PlacedFidelity.VOLUMES), **SMALL),
        audit.ACROSS_ARCHITECTURES),
    # a registration logged before the registry refused it (two architectures): its machine is amd64
    # (its first class's default), and its microvm default says arm64, which nothing may run under
    "under a default of another architecture than its machine": (
        [registered("w1", entry(V1, sandbox_class="gvisor"), entry(ARM, sandbox_class="microvm"), node="n1"),
         created("a", sandbox_class="microvm", **SMALL)],
        placed("a", "w1", ARM, node="n1", sandbox_class="microvm", **SMALL), audit.ACROSS_ARCHITECTURES),
    # a restore at a fidelity no tier of the scheduler's plan has (`decide.plan`), each found by a mutation
    # campaign (tests/test_audit_mutations.py) that verify let pass: a LOCAL memory image given up on its
    # node (rule 5: never relaxed), ...
    "a LOCAL memory image restored without memory": (
        [worker_on("w1", V1), worker_on("w2", V2), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL),
         taken(snapshot("a", V1, node="n1"), SnapshotOrigin.PAUSE), released("a", "w1", ReleaseReason.PAUSED)],
        placed("a", "w2", V2, node="n1", fidelity=PlacedFidelity.VOLUMES, action=Action.RESTORE, snapshot_id="a-s",
               fallback=FALLBACK, **SMALL),
        audit.OFF_PLAN),
    # ... a snapshot restored below its own fidelity (rule 3: at its fidelity; the fallback of rule 4 is VOLUMES),
    "a VOLUMES snapshot restored at ROOTFS": (
        [worker_on("w1", V1), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL),
         taken(snapshot("a", V1, fidelity=Fidelity.VOLUMES, uri="s3://x")), released("a", "w1")],
        placed("a", "w1", V1, node="n1", fidelity=PlacedFidelity.ROOTFS, action=Action.RESTORE, snapshot_id="a-s",
               **SMALL),
        audit.OFF_PLAN),
    "a MEMORY snapshot restored at ROOTFS": (
        [worker_on("w1", V1), worker_on("w2", V2), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL),
         taken(snapshot("a", V1, uri="s3://x")), released("a", "w1")],
        placed("a", "w2", V2, node="n1", fidelity=PlacedFidelity.ROOTFS, action=Action.RESTORE, snapshot_id="a-s",
               **SMALL),
        audit.OFF_PLAN),
    # ... a borrowed (golden) memory image's volumes restored (rule 4: it holds none of the actor's own, a cold boot)
    "a borrowed memory image restored from volumes": (
        [worker_on("w1", V1), worker_on("w2", V2), created("g", snapshot=golden(V1, borrowed=True, actor_id="g"),
                                                           **SMALL)],
        placed("g", "w2", V2, node="n1", fidelity=PlacedFidelity.VOLUMES, action=Action.RESTORE,
               snapshot_id="golden-1", fallback=FALLBACK, **SMALL),
        audit.OFF_PLAN),
    # ... and a PAUSED actor's LOCAL memory image given up for a cold boot on its node, a golden (borrowed) one's
    # included (rule 5: never relaxed; the image holds what the actor ran since the golden boot)
    "a PAUSED actor's LOCAL memory image given up for a cold boot": (
        [worker_on("w1", V1), created("g", snapshot=golden(V1, borrowed=True, actor_id="g"), **SMALL),
         placed("g", "w1", V1, node="n1", fidelity=PlacedFidelity.MEMORY, action=Action.RESTORE,
                snapshot_id="golden-1", **SMALL),
         taken(snapshot("g", V1, snapshot_id="g-p", node="n1", borrowed=True), SnapshotOrigin.PAUSE),
         released("g", "w1", ReleaseReason.PAUSED)],
        placed("g", "w1", V1, node="n1", **SMALL), audit.OFF_PLAN),
    "a PAUSED actor's LOCAL memory image given up for a cold boot on another node": (
        [worker_on("w1", V1), worker_on("w2", V1, node="n2"),
         created("g", snapshot=golden(V1, borrowed=True, actor_id="g"), **SMALL),
         placed("g", "w1", V1, node="n1", fidelity=PlacedFidelity.MEMORY, action=Action.RESTORE,
                snapshot_id="golden-1", **SMALL),
         taken(snapshot("g", V1, snapshot_id="g-p", node="n1", borrowed=True), SnapshotOrigin.PAUSE),
         released("g", "w1", ReleaseReason.PAUSED)],
        placed("g", "w2", V1, node="n2", **SMALL), audit.LOCAL_OFF_NODE),
    # a memory restore whose record names another version than its image's as the one matched: what a worker
    # checks the image against before loading it (`agent --check-placement`) and a retry's answer is judged by
    "a memory restore naming another matched version": (
        [worker_on("w1", V1), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL),
         taken(snapshot("a", V1, uri="s3://x")), released("a", "w1")],
        msgspec.structs.replace(placed("a", "w1", V1, node="n1", fidelity=PlacedFidelity.MEMORY, action=Action.RESTORE,
                                       snapshot_id="a-s", **SMALL), matched_version=V2),
        audit.MATCHED_OTHER),
    "a memory restore through an edge naming no matched version": (
        [registered("w1", entry(runtime(V2, compatible=(V1,))), node="n1", labels=ZONE_A),
         created("g", snapshot=golden(V1, borrowed=True, actor_id="g"), **SMALL)],
        placed("g", "w1", V2, node="n1", fidelity=PlacedFidelity.MEMORY, action=Action.RESTORE,
               snapshot_id="golden-1", **SMALL),
        audit.MATCHED_OTHER),
    # the record, as the scheduler judges a placement made (`feasibility.carrying`) and a placement's tier
    # (`Ask.judge`): a node other than its worker's, a cold boot pinned to a restorable runtime, not the default
    "a placement naming another node than its worker's": (
        [worker_on("w1", V1), created("a", **SMALL)], placed("a", "w1", V1, node="n2", **SMALL),
        audit.NODE_MISMATCH),
    "a cold boot pinned to a restorable runtime": (
        [registered("w1", entry(V2, (V1,)), node="n1", labels=ZONE_A), created("a", **SMALL)],
        placed("a", "w1", V1, node="n1", **SMALL), audit.RUNTIME_GONE),
    # judged by the scheduler's own checks of a worker (`feasibility.Ask.judge`, by `decide.tier_ask`), verify found
    # two placements its own copy of them let pass: the RUN of a borrowed snapshot below the floor (rule 4a) keeps
    # the stamp's architecture, as every tier without memory of a stamped snapshot (rule 4) ...
    "a borrowed snapshot below its floor cold-booted across architectures": (
        [worker_on("w1", V1), worker_on("arm", ARM, node="n9"),
         created("g", snapshot=golden(V1, fidelity=Fidelity.ROOTFS, borrowed=True, actor_id="g"), min_fidelity=Fidelity.VOLUMES,
                 **SMALL)],
        placed("g", "arm", ARM, node="n9", **SMALL), audit.ACROSS_ARCHITECTURES),
    # a resume's request id placed again after its first placement ended, in the same life or the next:
    # the scheduler answers it with the first (idempotency), or refuses one of the last life's
    "a request id placed again": (
        [worker_on("w1", V1), created("a", **SMALL), placed("a", "w1", V1, node="n1", request_id="r1", **SMALL),
         taken(snapshot("a", V1, uri="s3://x")), released("a", "w1")],
        resumed("a", request_id="r1"), audit.REQUEST_AGAIN),
    "a request id of the last life placed again": (
        [worker_on("w1", V1), created("a", **SMALL), placed("a", "w1", V1, node="n1", request_id="r1", **SMALL),
         released("a", "w1", ReleaseReason.STOPPED), ActorStopped(at=AT, actor_id="a"), created("a", **SMALL)],
        placed("a", "w1", V1, node="n1", request_id="r1", **SMALL), audit.REQUEST_AGAIN),
    # a fallback's record (`fallback`), judged against the tier of the scheduler's plan the placement is of
    # (`Tier.fallback`): its reason where the rules give another one (the template changed: rule 3), a memory
    # restore or a cold boot of an actor with no snapshot carrying one, a placement giving a memory image up
    # without one; each was let pass before
    "a fallback naming NO_COMPATIBLE_WORKER where the template changed": (
        [worker_on("w1", V1), worker_on("w2", V2), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL),
         taken(snapshot("a", V1, uri="s3://x")), released("a", "w1"),
         TemplateChanged(at=AT, actor_id="a", template_uid="t2")],
        placed("a", "w2", V2, node="n1", fidelity=PlacedFidelity.VOLUMES, action=Action.RESTORE, snapshot_id="a-s",
               fallback=FALLBACK, **SMALL),
        audit.FALLBACK_MISSTATED),
    "a memory restore carrying a fallback": (
        [worker_on("w1", V1), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL),
         taken(snapshot("a", V1, uri="s3://x")), released("a", "w1")],
        placed("a", "w1", V1, node="n1", fidelity=PlacedFidelity.MEMORY, action=Action.RESTORE, snapshot_id="a-s",
               fallback=FALLBACK, **SMALL),
        audit.FALLBACK_MISSTATED),
    "a memory image given up without a fallback record": (
        [worker_on("w1", V1), worker_on("w2", V2), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL),
         taken(snapshot("a", V1, uri="s3://x")), released("a", "w1")],
        placed("a", "w2", V2, node="n1", fidelity=PlacedFidelity.VOLUMES, action=Action.RESTORE, snapshot_id="a-s",
               **SMALL),
        audit.FALLBACK_MISSTATED),
    "a fallback to another fidelity than the placement's": (
        [worker_on("w1", V1), worker_on("w2", V2), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL),
         taken(snapshot("a", V1, uri="s3://x")), released("a", "w1")],
        placed("a", "w2", V2, node="n1", fidelity=PlacedFidelity.VOLUMES, action=Action.RESTORE, snapshot_id="a-s",
               fallback=Fallback(reason=FallbackReason.NO_COMPATIBLE_WORKER, from_fidelity=PlacedFidelity.MEMORY,
                                 to_fidelity=PlacedFidelity.ROOTFS), **SMALL),
        audit.FALLBACK_MISSTATED),
    "a cold boot of an actor with no snapshot carrying a fallback": (
        [worker_on("w1", V1), created("a", **SMALL)],
        placed("a", "w1", V1, node="n1", fallback=Fallback(reason=FallbackReason.NO_COMPATIBLE_WORKER,
                                                           from_fidelity=PlacedFidelity.MEMORY,
                                                           to_fidelity=PlacedFidelity.NONE), **SMALL),
        audit.FALLBACK_MISSTATED),
}


def test_a_cold_boot_of_an_actor_that_owns_nothing_to_lose_is_accepted_as_rule_4a_allows_and_judged_otherwise():
    """Chosen, looked at again: the contract's rule 4a lets an actor that owns nothing to lose (no snapshot, or
    only a borrowed one) "always RUN unless its floor is MEMORY". The scheduler reads it narrowly (it restores
    a golden VOLUMES snapshot at its fidelity, and cold-boots such an actor only as rule 4's fallback of a
    memory image or below its floor: `decide.plan`), verify as the contract says: such a cold boot sends no
    image and throws nothing of the actor's away, so it is no violation. All the rest of it is judged: the
    floor (MEMORY: BELOW_FLOOR), the stamp's architecture and the worker (`Ask.judge` on the tier's ask), a
    LOCAL image's node (OFF_PLAN or LOCAL_OFF_NODE), and its fallback record (none, as on the scheduler's
    cold boots of such an actor)."""
    from services.scheduler.decide import plan
    log = [worker_on("w1", V1), worker_on("arm", ARM, node="n9"),
           created("g", snapshot=golden(V1, fidelity=Fidelity.VOLUMES, borrowed=True, actor_id="g"), **SMALL)]
    tiers = plan(fold(log, Sink()).projection, fold(log, Sink()).projection.actors["g"], None).tiers
    assert [(t.action, t.fidelity) for t in tiers] == [(Action.RESTORE, PlacedFidelity.VOLUMES)]  # the scheduler's
    assert verify([*log, placed("g", "w1", V1, node="n1", **SMALL)]) is None  # rule 4a's
    assert verify([*log, placed("g", "arm", ARM, node="n9", **SMALL)]).rule == audit.ACROSS_ARCHITECTURES
    fallback = Fallback(reason=FallbackReason.NO_COMPATIBLE_WORKER, from_fidelity=PlacedFidelity.MEMORY,
                        to_fidelity=PlacedFidelity.NONE)
    assert verify([*log, placed("g", "w1", V1, node="n1", fallback=fallback, **SMALL)]).rule == \
        audit.FALLBACK_MISSTATED
    floored = [*log[:2], created("g", snapshot=golden(V1, fidelity=Fidelity.VOLUMES, borrowed=True, actor_id="g"),
                                 min_fidelity=Fidelity.MEMORY, **SMALL)]
    assert verify([*floored, placed("g", "w1", V1, node="n1", **SMALL)]).rule == audit.BELOW_FLOOR


@pytest.mark.parametrize("reason", [FallbackReason.TEMPLATE_CHANGED, FallbackReason.SNAPSHOT_NOT_MEMORY])
def test_a_fallback_naming_either_reason_of_rule_3_where_both_hold_is_clean(reason):
    """A golden memory image of another template, unstamped: both reasons of rule 3 hold (`decide.memory_lost_all`);
    the scheduler records the first, and a fallback naming either is true. Another reason is not."""
    log = [worker_on("w1", V1), created("g", snapshot=golden(V1, borrowed=True, actor_id="g", template="t0",
                                                             sandbox_runtime=None), **SMALL)]
    run = placed("g", "w1", V1, node="n1", fallback=Fallback(reason=reason, from_fidelity=PlacedFidelity.MEMORY,
                                                             to_fidelity=PlacedFidelity.NONE), **SMALL)
    assert verify([*log, run]) is None
    wrong = msgspec.structs.replace(run, fallback=msgspec.structs.replace(
        run.fallback, reason=FallbackReason.NO_COMPATIBLE_WORKER))
    violation = verify([*log, wrong])
    assert violation is not None and violation.rule == audit.FALLBACK_MISSTATED, violation
    assert "the rules give that placement fallback TEMPLATE_CHANGED (MEMORY to NONE)" in str(violation), violation


RELEASES = {
    # a release names the worker of the placement it ends: one naming another would end in the log an actor
    # that still runs where it was placed, and let it be placed a second time
    "a release naming another worker": (
        [worker_on("w1", V1), worker_on("w2", V1), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL)],
        released("a", "w2", ReleaseReason.STOPPED), ["a released from w2 (STOPPED) while RUNNING",
                                                     "its placement is on w1"]),
    "a release of an actor not running": (
        [worker_on("w1", V1), created("a", **SMALL)],
        released("a", "w1", ReleaseReason.WORKER_REMOVED), ["a released from w1 (WORKER_REMOVED) while CREATED"]),
    "a pause's release after a suspend": (
        [worker_on("w1", V1), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL),
         taken(snapshot("a", V1, uri="s3://x"))],
        released("a", "w1", ReleaseReason.PAUSED), ["while SUSPENDED", "right after its pause's snapshot"]),
    # a removal's release only once the worker's life the placement was made in has ended
    "a removal's release of a worker not removed": (
        [worker_on("w1", V1), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL)],
        released("a", "w1", ReleaseReason.WORKER_REMOVED),
        ["a released from w1 as WORKER_REMOVED; w1 has not been removed since a was placed there (sequence 3)"]),
}


def test_a_paused_actor_placed_off_the_node_it_paused_on_is_named_even_with_no_pause_snapshot_logged():
    """A PAUSED actor resumes only on the node it paused on (rule 5, `decide.restricted_to`), even with no pause
    snapshot logged: a log verify names at the release (`pause's or suspend's release without its snapshot`),
    so its placement is judged here on the projection of that log, as a foreign writer may have left it."""
    before = [worker_on("w1", V1), worker_on("w2", V1, node="n2"), created("a", **SMALL),
              placed("a", "w1", V1, node="n1", **SMALL), released("a", "w1", ReleaseReason.PAUSED)]
    violation = verify(before)
    assert violation is not None and (violation.seq, violation.rule) == (5, audit.RELEASE_UNSNAPSHOTTED), violation
    projection = fold(before, Sink()).projection
    found = audit.Verifier(projection).check(6, placed("a", "w2", V1, node="n2", **SMALL))
    assert found is not None and found.rule == audit.LOCAL_OFF_NODE, found
    assert "a is PAUSED on node n1; cold-booted on w2 on n2" in str(found), found
    assert audit.Verifier(projection).check(6, placed("a", "w1", V1, node="n1", **SMALL)) is None


UNSNAPSHOTTED = {
    # a pause's or a suspend's release is written only right after the snapshot it takes (`Actor.pause`,
    # `Actor.suspend`): without it, the actor resumes from an older snapshot than what it ran (or cold-boots)
    "a pause's release without its snapshot": (
        [worker_on("w1", V1), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL)],
        released("a", "w1", ReleaseReason.PAUSED), ["a released from w1 (PAUSED) while RUNNING", "no PAUSE snapshot"]),
    "a suspend's release without its snapshot": (
        [worker_on("w1", V1), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL),
         taken(snapshot("a", V1, uri="s3://x")), released("a", "w1"), placed("a", "w1", V1, node="n1",
                                                                             fidelity=PlacedFidelity.MEMORY,
                                                                             action=Action.RESTORE,
                                                                             snapshot_id="a-s", **SMALL)],
        released("a", "w1", ReleaseReason.SUSPENDED), ["(SUSPENDED) while RUNNING", "no SUSPEND snapshot"]),
    "a pause's release written twice": (
        [worker_on("w1", V1), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL),
         taken(snapshot("a", V1, node="n1"), SnapshotOrigin.PAUSE), released("a", "w1", ReleaseReason.PAUSED)],
        released("a", "w1", ReleaseReason.PAUSED), ["(PAUSED) while PAUSED", "no PAUSE snapshot"]),
}


@pytest.mark.parametrize("case", UNSNAPSHOTTED)
def test_a_pause_s_or_suspend_s_release_without_its_snapshot_is_named(case):
    before, forged, says = UNSNAPSHOTTED[case]
    assert verify(before) is None
    violation = verify([*before, forged])
    assert violation is not None and (violation.seq, violation.rule) == (len(before) + 1, audit.RELEASE_UNSNAPSHOTTED), \
        violation
    assert all(words in str(violation) for words in says), str(violation)


@pytest.mark.parametrize("case", RELEASES)
def test_a_release_that_ends_no_placement_where_it_says_is_named(case):
    before, forged, says = RELEASES[case]
    assert verify(before) is None
    violation = verify([*before, forged])
    assert violation is not None and (violation.seq, violation.rule) == (len(before) + 1, audit.RELEASE_ELSEWHERE), \
        violation
    assert all(words in str(violation) for words in says), str(violation)


def test_a_removal_s_release_after_the_worker_came_back_is_clean():
    """The snapshotter's worker-removal process may release an actor of the removed worker after it has
    registered again (a new life): that release ends the placement of the life that ended."""
    log = [worker_on("w1", V1), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL),
           WorkerRemoved(at=AT, worker_id="w1", reason="LOST"), worker_on("w1", V1),
           released("a", "w1", ReleaseReason.WORKER_REMOVED), placed("a", "w1", V1, node="n1", **SMALL)]
    assert verify(log) is None


def test_a_request_id_pushed_out_of_the_recent_placements_is_not_judged():
    """Chosen: verify judges a request id again only against the placements the scheduler's projection
    keeps (the actor's last four that carried one, and its last life's): one pushed out is answered from
    the reply bucket for an hour, and may be placed anew after that, which the log cannot tell."""
    log = [worker_on("w1", V1), created("a", **SMALL)]
    for rid in ("r1", "r2", "r3", "r4", "r5", "r1"):
        log += [resumed("a", request_id=rid) if len(log) > 2 else placed("a", "w1", V1, node="n1", request_id=rid,
                                                                         **SMALL),
                taken(snapshot("a", V1, uri="s3://x")), released("a", "w1")]
    assert verify(log) is None
    violation = verify(log[:-6] + [resumed("a", request_id="r2")])
    assert violation is not None and violation.rule == audit.REQUEST_AGAIN, violation


@pytest.mark.parametrize("case", CASES)
def test_a_forged_placement_is_named_with_its_sequence(case):
    before, forged, rule = CASES[case]
    violation = verify([*before, forged])
    assert violation is not None, f"{case}: not found"
    assert (violation.seq, violation.rule) == (len(before) + 1, rule)
    assert verify(before) is None  # the log up to it is clean


def test_a_worker_the_scheduler_would_reject_is_named_with_the_values_involved():
    """The rules verify names for the scheduler's rejections of a worker (`audit.JUDGED`) say what was wrong,
    with the values, as verify's own checks did before it judged by the scheduler's."""
    says = {
        "drained": ["w1 is drained"],
        "selector no longer met": ["a selects zone=a; w1 has no such label"],
        "local off its node": ["a's latest snapshot is LOCAL on node n1; restored on w2 on n2"],
        "across architectures": ["a's snapshot is amd64; arm's default is arm64"],
        "under a default of another architecture than its machine": [
            "a runs under w1's default of class microvm, of architecture arm64, not of its machine"],
        "a borrowed snapshot below its floor cold-booted across architectures": [
            "g's snapshot is amd64; arm's default is arm64"],
        "runtime dropped": ["restored on w1 pinned to", "which w1 does not offer for it"],
        "capacity cut": ["w1 had 4000m cpu / 64 MiB free, a booked 100m / 512 MiB"],
        "a placement naming another node than its worker's": ["a placed on w1 naming node n2; w1 is on n1"],
        "a cold boot pinned to a restorable runtime": ["a pinned to ('gvisor', 'v1', (('architecture', 'amd64'), "
                                                       "('gvisor_asset_hash', 'v1'))); w1's default is"],
    }
    for case, words in says.items():
        before, forged, _ = CASES[case]
        violation = str(verify([*before, forged]))
        assert all(w in violation for w in words), (case, violation)
    # a worker that does not register the actor's class, as the scheduler's first check finds it
    violation = verify([worker_on("w1", V1), created("a", sandbox_class="microvm", **SMALL),
                        placed("a", "w1", V1, node="n1", **SMALL)])
    assert violation is not None and violation.rule == audit.RUNTIME_GONE, violation
    assert "w1 does not register class microvm" in str(violation), str(violation)


def test_a_memory_restore_books_what_its_pin_needs_of_the_runtimes_accepting_the_image():
    """Two runtimes of a worker accept the image (a restorable one's own version, and an edge of the default's),
    with other overheads: a placement pinned to either is loadable (rule 2 prefers the first), and books what the
    actor needs under its pin (`feasibility.carrying` finds the pin's runtime, `Runtime.need_mib` its need)."""
    log = [registered("w1", entry(runtime(V2, overhead=0, compatible=(V1,)), (runtime(V1, overhead=100),)),
                      node="n1", labels=ZONE_A),
           created("g", snapshot=golden(V1, borrowed=True, actor_id="g"), **SMALL)]
    memory = {"node": "n1", "fidelity": PlacedFidelity.MEMORY, "action": Action.RESTORE, "snapshot_id": "golden-1",
              "cpu": 100}
    assert verify([*log, placed("g", "w1", V1, mem=612, **memory)]) is None
    through_edge = msgspec.structs.replace(placed("g", "w1", V2, mem=512, **memory), matched_version=V1)
    assert verify([*log, through_edge]) is None
    violation = verify([*log, placed("g", "w1", V1, mem=512, **memory)])
    assert violation is not None and violation.rule == audit.UNDER_BOOKED, violation
    assert "g needs 100m / 612 MiB under" in str(violation) and "it booked 100m / 512 MiB" in str(violation)


def test_every_rejection_of_the_scheduler_is_one_rule_of_verify():
    """Each reason the scheduler rejects a worker for (`Ask.judge`) or a placement made on it (`carrying`)
    is named by one rule of verify's, in one table."""
    from services.scheduler.feasibility import CARRY_REASONS, REASONS
    assert set(audit.JUDGED) == {*REASONS, *CARRY_REASONS}
    assert set(audit.JUDGED.values()) <= set(audit.PLACEMENT_RULES)


def test_every_refusal_of_a_resume_on_the_actor_s_state_is_one_rule_of_verify():
    """Each reason the scheduler refuses a resume for on what the actor is (`decide.unresumable`, by which
    `decide.resolve` refuses) is named by one rule of verify's, in one table; and verify judges by it: with
    it made to find nothing, a placement of a running or stopped actor is let pass."""
    from services.scheduler import decide
    assert set(audit.RESOLVED) == set(decide.UNRESUMABLE)
    assert set(audit.RESOLVED.values()) <= set(audit.PLACEMENT_RULES)
    running = [worker_on("w1", V1), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL)]
    stopped = [worker_on("w1", V1), created("a", **SMALL), ActorStopped(at=AT, actor_id="a")]
    again = placed("a", "w1", V1, node="n1", **SMALL)
    assert verify([*running, again]).rule == audit.PLACED_TWICE
    assert verify([*stopped, again]).rule == audit.PLACED_STOPPED
    real = audit.unresumable
    try:
        audit.unresumable = lambda actor: None
        assert verify([*stopped, again]) is None and verify([*running, again]) is None
    finally:
        audit.unresumable = real


def test_verify_help_names_every_rule_it_reports():
    """`audit verify --help` lists the names a violation is reported with, and every rule a forged
    log here breaks is one of them (a walkthrough found the help saying only "the invariants")."""
    shown = CliRunner().invoke(main, ["audit", "verify", "--help"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    rules = [*audit.PLACEMENT_RULES, *audit.STAMP_RULES, *audit.RELEASE_RULES, audit.CHANGE_UNREGISTERED]
    assert all(rule in shown.output for rule in rules), shown.output
    assert {rule for _, _, rule in CASES.values()} <= set(rules)
    assert {case[2] for case in STAMP_CASES.values()} == set(audit.STAMP_RULES)  # each stamping rule forged


@pytest.mark.parametrize("case", ["drained", "local off its node", "across architectures"])
async def test_audit_verify_fails_naming_the_rule_on_a_real_stream(nats_url, prefix, writer, case):
    before, forged, rule = CASES[case]
    # the events appended directly, one append each, as a buggy or hostile writer would
    seqs = [await asyncio.to_thread(writer.write, event) for event in [*before, forged]]
    result = await asyncio.to_thread(
        CliRunner().invoke, main, ["audit", "verify", "--nats", nats_url, "--prefix", prefix])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert f"sequence {seqs[-1]}" in result.output and rule in result.output


# --- the stamping rules (CONTRACT section 3, "Stamping rules"; docs/contract.md, Snapshotter) ---------
#
# A legitimate log with every step that takes, moves or copies a snapshot, written as the snapshotter
# and the scheduler write it: actor a paused, resumed, suspended, tagged; b created from the tag and
# suspended under its own pin; g created from a golden snapshot; a paused, promoted, paused and
# reverted (to the promoted image), resumed from a LOCAL image on a worker then removed and reverted
# again (SUSPENDED with a LOCAL latest snapshot); a stopped, created anew, paused, and reverted to
# none (no EXTERNAL snapshot in its new life). `AT_STEP` names the length of the log after each step.

W1_NODE, W2_NODE = "n1", "n2"
A3 = snapshot("a", V1, snapshot_id="a-v3", node=W1_NODE)  # a's pause: LOCAL on the placement's node
A7 = snapshot("a", V1, snapshot_id="a-v7", uri="s3://a-v7")  # a's suspend: EXTERNAL
B7 = msgspec.structs.replace(A7, actor_id="b")  # b created from the tag naming A7: the same image
G = golden(V2, snapshot_id="gold-img", borrowed=True, actor_id="g")  # g created from a golden snapshot
B12 = snapshot("b", V1, snapshot_id="b-v12", uri="s3://b-v12")  # b's own suspend, from its pin (V1)
A20 = snapshot("a", V1, snapshot_id="a-v20", node=W1_NODE)
A20_UP = msgspec.structs.replace(A20, location=Location.EXTERNAL, node=None, uri="s3://a-v20")  # its promote
A25 = snapshot("a", V1, snapshot_id="a-v25", node=W1_NODE)
A30 = snapshot("a", V1, snapshot_id="a-v30", node=W1_NODE)
A2_LIFE = snapshot("a", V2, snapshot_id="a-v50", node=W2_NODE)  # a's second life: on w2 (V2)


def restore(actor_id: str, worker_id: str, pin, snapshot_id: str, node: str = W1_NODE):
    return placed(actor_id, worker_id, pin, node=node, action=Action.RESTORE, fidelity=PlacedFidelity.MEMORY,
                  snapshot_id=snapshot_id, **SMALL)


STEPS: list[tuple[str, list[Event]]] = [
    ("fleet", [worker_on("w1", V1, node=W1_NODE), worker_on("w2", V2, node=W2_NODE)]),
    ("a created", [created("a", **SMALL)]),
    ("a running", [placed("a", "w1", V1, node=W1_NODE, **SMALL)]),
    ("a paused", [taken(A3, SnapshotOrigin.PAUSE), released("a", "w1", ReleaseReason.PAUSED)]),
    ("a resumed", [restore("a", "w1", V1, "a-v3")]),
    ("a suspended", [taken(A7, SnapshotOrigin.SUSPEND), released("a", "w1")]),
    ("a tagged", [TagRecorded(at=AT, tag="gold", snapshot=A7), taken(A7, SnapshotOrigin.TAG)]),
    ("b created from the tag", [created("b", snapshot=B7, **SMALL), taken(B7, SnapshotOrigin.CREATE)]),
    ("g created from a golden snapshot", [created("g", snapshot=G, **SMALL), taken(G, SnapshotOrigin.CREATE)]),
    ("b running", [restore("b", "w1", V1, "a-v7")]),
    ("b suspended", [taken(B12, SnapshotOrigin.SUSPEND), released("b", "w1")]),
    ("a running again", [restore("a", "w1", V1, "a-v7")]),
    ("a paused again", [taken(A20, SnapshotOrigin.PAUSE), released("a", "w1", ReleaseReason.PAUSED)]),
    ("a promoted", [taken(A20_UP, SnapshotOrigin.PROMOTE)]),
    ("a running from its promoted image", [restore("a", "w1", V1, "a-v20")]),
    ("a paused a third time", [taken(A25, SnapshotOrigin.PAUSE), released("a", "w1", ReleaseReason.PAUSED)]),
    ("a reverted", [ActorReverted(at=AT, actor_id="a", snapshot=A20_UP, abandoned=A25)]),
    ("a running from the image it went back to", [restore("a", "w1", V1, "a-v20")]),
    ("a paused a fourth time", [taken(A30, SnapshotOrigin.PAUSE), released("a", "w1", ReleaseReason.PAUSED)]),
    ("a running from its LOCAL image", [restore("a", "w1", V1, "a-v30")]),
    ("w1 removed under a", [WorkerRemoved(at=AT, worker_id="w1"), released("a", "w1", ReleaseReason.WORKER_REMOVED)]),
    ("a reverted from SUSPENDED", [ActorReverted(at=AT, actor_id="a", snapshot=A20_UP, abandoned=A30)]),
    ("a stopped", [ActorStopped(at=AT, actor_id="a")]),
    ("a created anew", [created("a", **SMALL)]),
    ("a running in its new life", [placed("a", "w2", V2, node=W2_NODE, **SMALL)]),
    ("a paused in its new life", [taken(A2_LIFE, SnapshotOrigin.PAUSE), released("a", "w2", ReleaseReason.PAUSED)]),
    ("a reverted to none", [ActorReverted(at=AT, actor_id="a", snapshot=None, abandoned=A2_LIFE)]),
]
LIFE: list[Event] = [event for _, events in STEPS for event in events]
AT_STEP: dict[str, int] = {}
for _name, _events in STEPS:
    AT_STEP[_name] = sum(len(events) for _, events in STEPS[:[n for n, _ in STEPS].index(_name) + 1])


def upto(step: str, *more: Event) -> list[Event]:
    """The legitimate log up to and with `step`, then `more`."""
    return [*LIFE[:AT_STEP[step]], *more]


def test_a_pause_after_a_template_change_is_of_the_template_the_actor_ran():
    """A template changed while the actor runs takes effect at its next placement: the pause's image is of
    the template it ran (the snapshotter's `running_template_uid`), and the resume after it falls back."""
    changed = TemplateChanged(at=AT, actor_id="a", template_uid="t2")
    assert verify(upto("a running", changed, taken(A3, SnapshotOrigin.PAUSE))) is None


def test_a_log_with_every_stamping_step_is_clean():
    """Pause, resume, suspend, tag, create from the tag, golden create, promote, revert (of a PAUSED
    actor and of a SUSPENDED one with a LOCAL latest snapshot), stop and a new life, revert to none."""
    assert verify(LIFE) is None
    sink = fold(LIFE, Sink(verify=True))
    a = sink.projection.actors["a"]
    assert (a.state.value, a.snapshot) == ("SUSPENDED", None)  # the last revert went back to none


def restamped(s, v) -> object:
    return msgspec.structs.replace(s, sandbox_runtime=None if v is None else stamp(v))


# Each: the legitimate log up to a step, the one event that breaks a stamping rule, the rule, and
# what the report's line must say (the snapshot, and what it should have been).
STAMP_CASES = {
    # 1. a pause or a suspend of an actor that is not RUNNING
    "pause of a paused actor": (
        upto("a paused"), taken(snapshot("a", V1, snapshot_id="a-x", node=W1_NODE), SnapshotOrigin.PAUSE),
        audit.NOT_RUNNING, ["a PAUSE snapshot a-x", "while a is PAUSED"]),
    "suspend of a suspended actor": (
        upto("a suspended"), taken(snapshot("a", V2, snapshot_id="a-x", uri="s3://x")),
        audit.NOT_RUNNING, ["a SUSPEND snapshot a-x", "while a is SUSPENDED"]),
    "suspend of a paused actor recorded as a SUSPEND": (
        upto("a paused"), taken(snapshot("a", V2, snapshot_id="a-x", uri="s3://x")),
        audit.NOT_RUNNING, ["while a is PAUSED", "a suspend of a PAUSED actor is a PROMOTE"]),
    "pause of a stopped actor": (
        upto("a stopped"), taken(snapshot("a", V1, snapshot_id="a-x", node=W1_NODE), SnapshotOrigin.PAUSE),
        audit.NOT_RUNNING, ["while a is STOPPED"]),
    "pause of an actor never created": (
        upto("fleet"), taken(snapshot("z", V1, snapshot_id="z-1", node=W1_NODE), SnapshotOrigin.PAUSE),
        audit.NOT_RUNNING, ["z PAUSE snapshot z-1", "not created in the log"]),
    # 2. a pause or a suspend against the placement it ends: its pin, and a pause's node
    "pause on another node than its placement's": (
        upto("a running"), taken(snapshot("a", V1, snapshot_id="a-x", node=W2_NODE), SnapshotOrigin.PAUSE),
        audit.MISPLACED, ["a PAUSE snapshot a-x is LOCAL on node n2", "node n1 (worker w1)"]),
    "pause recorded EXTERNAL": (
        upto("a running"), taken(snapshot("a", V1, snapshot_id="a-x", uri="s3://x"), SnapshotOrigin.PAUSE),
        audit.MISPLACED, ["a PAUSE snapshot a-x is EXTERNAL"]),
    "suspend recorded LOCAL": (
        upto("a resumed"), taken(snapshot("a", V1, snapshot_id="a-x", node=W1_NODE)),
        audit.MISPLACED, ["a SUSPEND snapshot a-x is LOCAL on node n1", "a suspend's image is EXTERNAL"]),
    "pause stamped with another runtime than its pin": (
        upto("a running"), taken(snapshot("a", V2, snapshot_id="a-x", node=W1_NODE), SnapshotOrigin.PAUSE),
        audit.STAMP_NOT_PIN, ["a PAUSE snapshot a-x stamped gvisor v1 architecture=amd64,gvisor_asset_hash=v2",
                              "pinned to gvisor v1 architecture=amd64,gvisor_asset_hash=v1"]),
    # ... and of the template the actor ran: its template when placed (one changed while it runs takes
    # effect at its next placement), else a memory image of an older template would restore at MEMORY
    "pause of the template changed while it ran": (
        upto("a running", TemplateChanged(at=AT, actor_id="a", template_uid="t2")),
        taken(snapshot("a", V1, snapshot_id="a-x", node=W1_NODE, template="t2"), SnapshotOrigin.PAUSE),
        audit.NOT_RUN_TEMPLATE, ["a PAUSE snapshot a-x is of template t2", "ran template t1"]),
    # ... and holding what its step takes: a pause all of the memory, `borrowed` as the actor's latest snapshot
    # is; a suspend the actor's own copy (a `borrowed` one would let its resume cold-boot, its volumes lost)
    "suspend recorded borrowed": (
        upto("a resumed"), taken(snapshot("a", V1, snapshot_id="a-x", uri="s3://x", borrowed=True)),
        audit.NOT_AS_TAKEN, ["a SUSPEND snapshot a-x is recorded borrowed", "a has volumes of its own"]),
    "pause recorded at VOLUMES": (
        upto("a running"), taken(snapshot("a", V1, snapshot_id="a-x", node=W1_NODE, fidelity=Fidelity.VOLUMES),
                                 SnapshotOrigin.PAUSE),
        audit.NOT_AS_TAKEN, ["a PAUSE snapshot a-x is recorded at VOLUMES"]),
    "pause of a golden actor recorded as its own": (
        upto("g created from a golden snapshot", restore("g", "w2", V2, "gold-img", node=W2_NODE)),
        taken(snapshot("g", V2, snapshot_id="g-x", node=W2_NODE), SnapshotOrigin.PAUSE),
        audit.NOT_AS_TAKEN, ["g PAUSE snapshot g-x is recorded not borrowed", "none of its own"]),
    "promote recorded borrowed": (
        upto("a paused again"), taken(msgspec.structs.replace(A20_UP, borrowed=True), SnapshotOrigin.PROMOTE),
        audit.NOT_COPIED, ["borrowed, where a promote's image is the actor's own durable copy"]),
    "unstamped suspend": (
        upto("a resumed"), taken(snapshot("a", None, snapshot_id="a-x", uri="s3://x")),
        audit.STAMP_NOT_PIN, ["a SUSPEND snapshot a-x unstamped", "worker w1, node n1"]),
    # 3. a promote keeps the stamp and the image of the LOCAL snapshot it promotes
    "promote restamped": (
        upto("a paused again"), taken(restamped(A20_UP, V2), SnapshotOrigin.PROMOTE),
        audit.NOT_COPIED, ["a PROMOTE snapshot a-v20 differs from the LOCAL snapshot it promotes, a-v20",
                           "gvisor_asset_hash=v2, the LOCAL one stamped gvisor v1 architecture=amd64,gvisor_asset_hash=v1"]),
    "promote of another template": (
        upto("a paused again"), taken(msgspec.structs.replace(A20_UP, template_uid="t9"), SnapshotOrigin.PROMOTE),
        audit.NOT_COPIED, ["of template t9, the LOCAL one of t1"]),
    "promote of a suspended actor": (
        upto("a suspended"), taken(msgspec.structs.replace(A7, snapshot_id="a-x"), SnapshotOrigin.PROMOTE),
        audit.NOT_PAUSED, ["a PROMOTE snapshot a-x while a is SUSPENDED"]),
    "promote recorded LOCAL": (
        upto("a paused again"), taken(A20, SnapshotOrigin.PROMOTE),
        audit.MISPLACED, ["a PROMOTE snapshot a-v20 is LOCAL on node n1"]),
    # 4. a creation carries exactly what a tag names at that point, or a golden (borrowed) snapshot
    "create from a tag, restamped": (
        upto("a tagged", created("c", snapshot=restamped(msgspec.structs.replace(A7, actor_id="c"), V2), **SMALL)),
        None, audit.NO_SOURCE,
        ["c created with snapshot a-v7 stamped gvisor v1 architecture=amd64,gvisor_asset_hash=v2",
         "which no tag names at this point of the log", "tag gold names a-v7 stamped gvisor v1 "
                                                        "architecture=amd64,gvisor_asset_hash=v1"]),
    "create from what a tag named before it moved": (
        upto("b suspended", TagRecorded(at=AT, tag="gold", snapshot=B12), taken(B12, SnapshotOrigin.TAG),
             created("c", snapshot=msgspec.structs.replace(A7, actor_id="c"), **SMALL)),
        None, audit.NO_SOURCE, ["c created with snapshot a-v7", "which no tag names at this point of the log"]),
    "create from no tag, not borrowed": (
        upto("fleet", created("c", snapshot=snapshot("c", V1, snapshot_id="c-img", uri="s3://c"), **SMALL)),
        None, audit.NO_SOURCE, ["c created with snapshot c-img", "not borrowed, as a golden one is"]),
    "golden snapshot of another class": (
        upto("fleet", created("c", snapshot=golden(V1, sandbox_class="microvm", borrowed=True, actor_id="c"),
                              **SMALL)),
        None, audit.NO_SOURCE, ["c (class gvisor) created with snapshot golden-1 stamped for class microvm"]),
    "CREATE snapshot restamped after its creation": (
        upto("a tagged", created("c", snapshot=msgspec.structs.replace(A7, actor_id="c"), **SMALL)),
        taken(restamped(msgspec.structs.replace(A7, actor_id="c"), V2), SnapshotOrigin.CREATE),
        audit.NO_SOURCE, ["c CREATE snapshot a-v7 stamped gvisor v1 architecture=amd64,gvisor_asset_hash=v2 differs "
                          "from the one its ActorCreated recorded, a-v7 stamped gvisor v1 "
                          "architecture=amd64,gvisor_asset_hash=v1"]),
    "CREATE snapshot later in a life": (
        upto("a suspended"), taken(restamped(A7, V2), SnapshotOrigin.CREATE),
        audit.NO_SOURCE, ["a CREATE snapshot a-v7", "where a was not just created (SUSPENDED)"]),
    # 5. a revert goes back to the latest EXTERNAL snapshot of this life, or none
    "revert to an earlier EXTERNAL snapshot": (
        upto("a paused a third time"), ActorReverted(at=AT, actor_id="a", snapshot=A7, abandoned=A25),
        audit.REVERT_ELSEWHERE, ["a reverted to a-v7", "its latest EXTERNAL snapshot of this life is a-v20"]),
    "revert to none when the life has an EXTERNAL snapshot": (
        upto("a paused a third time"), ActorReverted(at=AT, actor_id="a", snapshot=None, abandoned=A25),
        audit.REVERT_ELSEWHERE, ["a reverted to no snapshot (a cold boot)", "a-v20"]),
    "revert to a restamped copy": (
        upto("a paused a third time"), ActorReverted(at=AT, actor_id="a", snapshot=restamped(A20_UP, V2),
                                                     abandoned=A25),
        audit.REVERT_ELSEWHERE, ["a reverted to a-v20 stamped gvisor v1 architecture=amd64,gvisor_asset_hash=v2",
                                 "is a-v20 stamped gvisor v1 architecture=amd64,gvisor_asset_hash=v1"]),
    "revert to an earlier life's snapshot": (
        upto("a paused in its new life"), ActorReverted(at=AT, actor_id="a", snapshot=A20_UP, abandoned=A2_LIFE),
        audit.REVERT_ELSEWHERE, ["a reverted to a-v20", "no EXTERNAL snapshot since its creation"]),
    "revert of a running actor": (
        upto("a resumed"), ActorReverted(at=AT, actor_id="a", snapshot=None, abandoned=A3),
        audit.REVERT_NOTHING, ["a reverted while RUNNING with its latest snapshot LOCAL"]),
    # 6. a tag's copy is the actor's latest snapshot, stamp unchanged
    "tag copy restamped": (
        upto("a suspended"), taken(restamped(A7, V2), SnapshotOrigin.TAG),
        audit.NOT_COPIED, ["a TAG copy a-v7 differs from a's latest snapshot: stamped gvisor v1 "
                           "architecture=amd64,gvisor_asset_hash=v2, the latest stamped gvisor v1"]),
    "unstamped tag copy": (
        upto("a suspended"), taken(restamped(A7, None), SnapshotOrigin.TAG),
        audit.NOT_COPIED, ["a TAG copy a-v7", "unstamped, the latest stamped gvisor v1"]),
    "tag naming a restamped copy": (
        upto("a suspended"), TagRecorded(at=AT, tag="gold", snapshot=restamped(A7, V2)),
        audit.NOT_COPIED, ["tag gold names a-v7, which differs from a's latest snapshot: stamped gvisor v1 "
                           "architecture=amd64,gvisor_asset_hash=v2"]),
    # 7. one snapshot id names one image across actors
    "another actor's image under a caller's id": (
        upto("b running"), taken(snapshot("b", V1, snapshot_id="gold-img", uri="s3://b-own")),
        audit.ID_TWO_IMAGES, ["b records snapshot gold-img (EXTERNAL), which names g's image (EXTERNAL, MEMORY)"]),
    "a LOCAL image under another actor's id": (
        upto("b running"), taken(snapshot("b", V1, snapshot_id="gold-img", node=W1_NODE), SnapshotOrigin.PAUSE),
        audit.ID_TWO_IMAGES, ["b records snapshot gold-img (LOCAL on node n1), which names g's image (EXTERNAL"]),
    "tag naming an older snapshot": (
        upto("a paused again"), TagRecorded(at=AT, tag="gold", snapshot=A7),
        audit.NOT_COPIED, ["tag gold names a-v7", "id a-v7, the latest's a-v20"]),
}


def test_one_external_image_in_several_actors_under_one_id_is_no_violation():
    """A golden snapshot given again (h, created from g's golden image: all but whose it is), and an
    actor's own image under its id made EXTERNAL (a promote) are one image each; an id of the default
    form is one actor's by construction, not checked across actors."""
    again = msgspec.structs.replace(G, actor_id="h")
    assert verify(upto("g created from a golden snapshot", created("h", snapshot=again, **SMALL),
                       taken(again, SnapshotOrigin.CREATE))) is None
    other = msgspec.structs.replace(G, actor_id="h", uri="s3://golden/another")
    violation = verify(upto("g created from a golden snapshot", created("h", snapshot=other, **SMALL)))
    assert violation is not None and violation.rule == audit.ID_TWO_IMAGES, violation


@pytest.mark.parametrize("other_uri", [None, "s3://golden/another"])
def test_one_image_under_one_id_is_judged_on_bodies_as_the_fold_decodes_them(other_uri):
    """The same through the scheduler's fold, from encoded bodies, as `audit verify` reads a stream:
    the fold decodes a SnapshotTaken's snapshot and stamps into its own types, so the image an
    ActorCreated records and the one a SnapshotTaken repeats must still compare as one."""
    from events.codec import encode
    from events.jetstream import TOPIC_HEADER, VERSION_HEADER

    again = msgspec.structs.replace(G, actor_id="h", **({"uri": other_uri} if other_uri else {}))
    log = upto("g created from a golden snapshot", created("h", snapshot=again, **SMALL),
               taken(again, SnapshotOrigin.CREATE))
    sink = Sink(verify=True)
    reader = Fold(None, "t", sink)
    versions: dict[str, int] = {}
    for seq, event in enumerate(log, start=1):
        subject = f"t.ev.{event.KIND}.{event.entity_id}"
        versions[subject] = versions.get(subject, 0) + 1
        reader.fold_message(seq, subject, {TOPIC_HEADER: type(event).__name__, VERSION_HEADER: str(versions[subject])},
                            encode(event))
    if other_uri is None:
        assert sink.violation is None, sink.violation
    else:
        assert sink.violation is not None and (sink.violation.seq, sink.violation.rule) == (
            len(log) - 1, audit.ID_TWO_IMAGES), sink.violation


@pytest.mark.parametrize("case", STAMP_CASES)
def test_a_forged_stamp_is_named_with_its_sequence_and_what_it_should_be(case):
    before, forged, rule, says = STAMP_CASES[case]
    log = [*before, forged] if forged is not None else before
    seq = len(log)
    assert verify(log[:-1]) is None  # the log up to it is clean
    violation = verify(log)
    assert violation is not None, f"{case}: not found"
    assert (violation.seq, violation.rule) == (seq, rule), str(violation)
    line = str(violation)
    assert line.startswith(f"sequence {seq}: {rule}: ") and "\n" not in line
    for words in says:
        assert words in line, line


def verifying_up_to(step: str) -> tuple[Sink, Fold, int]:
    """A verifying Sink that has applied the legitimate log up to `step` (`upto`), the scheduler's
    Fold that reads messages into it, and the sequence of the last event applied."""
    sink = Sink(verify=True)
    before = upto(step)
    for seq, event in enumerate(before, start=1):
        sink.apply(seq, event)
    return sink, Fold(None, "t", sink), len(before)


def test_what_a_tag_names_is_unknown_after_a_message_of_its_history_this_version_cannot_read():
    """A newer snapshotter's message on a tag's subject (unread, as the scheduler's fold reads the
    log): a creation no known tag names may be from that tag, so it is not judged, until a
    TagRecorded this version reads says again what the tag names."""
    sink, fold_into, seq = verifying_up_to("a suspended")
    fold_into.fold_message(seq + 1, "t.ev.tag.gold", {"Warmboot-Topic": "TagRecordedV2", "Warmboot-Version": "1"},
                           b'{"type":"TagRecordedV2","tag":"gold"}')
    sink.apply(seq + 2, created("c", snapshot=restamped(msgspec.structs.replace(A7, actor_id="c"), V2), **SMALL))
    assert sink.violation is None
    sink.apply(seq + 3, TagRecorded(at=AT, tag="gold", snapshot=A7))
    sink.apply(seq + 4, taken(A7, SnapshotOrigin.TAG))
    sink.apply(seq + 5, created("d", snapshot=restamped(msgspec.structs.replace(A7, actor_id="d"), V2), **SMALL))
    assert sink.violation is not None and (sink.violation.seq, sink.violation.rule) == (seq + 5, audit.NO_SOURCE)


def test_an_actor_with_a_message_this_version_cannot_read_is_not_stamp_judged_until_its_next_life():
    """What an unread message of an actor's life changed (its state, its latest snapshot) is unknown:
    its stamps are judged again from the creation that begins its next life."""
    sink, fold_into, seq = verifying_up_to("a paused")
    fold_into.fold_message(seq + 1, "t.ev.actor.a", {"Warmboot-Topic": "ActorMovedV2", "Warmboot-Version": "9"},
                           b'{"type":"ActorMovedV2","actor_id":"a"}')
    sink.apply(seq + 2, taken(snapshot("a", V2, snapshot_id="a-x", uri="s3://x")))  # a SUSPEND, maybe of a running a
    assert sink.violation is None
    sink.apply(seq + 3, ActorStopped(at=AT, actor_id="a"))
    sink.apply(seq + 4, created("a", **SMALL))
    sink.apply(seq + 5, taken(snapshot("a", V2, snapshot_id="a-y", uri="s3://y")))
    assert sink.violation is not None and (sink.violation.seq, sink.violation.rule) == (seq + 5, audit.NOT_RUNNING)


@pytest.mark.parametrize("case", ["pause on another node than its placement's",
                                  "create from what a tag named before it moved",
                                  "revert to an earlier EXTERNAL snapshot"])
async def test_audit_verify_names_a_forged_stamp_on_a_real_stream(nats_url, prefix, writer, case):
    before, forged, rule, says = STAMP_CASES[case]
    events = [*before, forged] if forged is not None else before
    seqs = [await asyncio.to_thread(writer.write, event) for event in events]
    result = await asyncio.to_thread(
        CliRunner().invoke, main, ["audit", "verify", "--nats", nats_url, "--prefix", prefix])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert f"violation at sequence {seqs[-1]}: {rule}: " in result.output and says[0] in result.output, result.output


async def test_audit_verify_passes_a_log_the_services_wrote_with_every_stamping_step(stack, nc, prefix, nats_url):
    """The services themselves take every step (each pause and suspend naming its placement):
    pause, resume, suspend, tag, create from the tag, golden create, promote, revert, stop, a new
    life, revert to none; `audit verify` finds the log clean, and the log holds each step."""
    from tests.factories import actor, read_log, worker
    from warmboot.client import Client

    wb = Client(nc, prefix)
    await wb.register(worker("w1", V1, node="n1"))
    await wb.register(worker("w2", V2, node="n2"))
    await wb.create(actor("a", cpu=100, mem=256))
    placed_at = await wb.resume("a")
    await wb.pause("a", placement_seq=placed_at.seq)
    placed_at = await wb.resume("a")  # from its LOCAL image, on its node
    await wb.suspend("a", uri="s3://a", placement_seq=placed_at.seq)
    await wb.tag("a", "gold")
    await wb.create(actor("b", cpu=100, mem=256, source_tag="gold"))
    await wb.create(actor("g", cpu=100, mem=256, golden_snapshot=golden(V2)))
    placed_at = await wb.resume("b")
    await wb.suspend("b", uri="s3://b", placement_seq=placed_at.seq)
    placed_at = await wb.resume("g")
    await wb.pause("g", placement_seq=placed_at.seq)
    await wb.suspend("g", uri="s3://g")  # a promote
    placed_at = await wb.resume("a")
    await wb.pause("a", placement_seq=placed_at.seq)
    await wb.suspend("a", uri="s3://a2")  # a promote
    placed_at = await wb.resume("a")
    await wb.pause("a", placement_seq=placed_at.seq)
    assert (await wb.revert("a")).snapshot is not None  # back to the promoted image
    await wb.stop("a")
    await wb.create(actor("a", cpu=100, mem=256))  # its next life
    placed_at = await wb.resume("a")
    await wb.pause("a", placement_seq=placed_at.seq)
    assert (await wb.revert("a")).snapshot is None  # no EXTERNAL snapshot in this life
    await wb.tag("b", "gold")  # the tag moves

    result = await asyncio.to_thread(
        CliRunner().invoke, main, ["audit", "verify", "--nats", nats_url, "--prefix", prefix])
    assert result.exit_code == 0 and "no violation" in result.output, result.output
    log = [event for _, event in await read_log(nc, prefix)]
    origins = {e.origin for e in log if isinstance(e, SnapshotTaken)}
    assert origins == set(SnapshotOrigin), origins
    assert sum(isinstance(e, ActorReverted) for e in log) == 2
    assert sum(isinstance(e, TagRecorded) for e in log) == 2 and any(isinstance(e, ActorStopped) for e in log)
