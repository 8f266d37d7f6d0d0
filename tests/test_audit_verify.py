"""`warmboot audit verify` on forged logs: each v1.1 invariant, broken by events appended
directly, is found and named with its sequence (pure folds), and through the CLI on a
real stream."""

from __future__ import annotations

import asyncio

import pytest
from click.testing import CliRunner

from events.schema import (
    Action,
    Event,
    Fallback,
    FallbackReason,
    PlacedFidelity,
    ReleaseReason,
    Resources,
    RuntimeChanged,
    SnapshotOrigin,
    WorkerDrained,
    WorkerRegistered,
    WorkerRemoved,
    WorkerUpdated,
)
from tests.factories import AT, created, entry, fold, placed, registered, released, snapshot, taken, version
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
}


@pytest.mark.parametrize("case", CASES)
def test_a_forged_placement_is_named_with_its_sequence(case):
    before, forged, rule = CASES[case]
    violation = verify([*before, forged])
    assert violation is not None, f"{case}: not found"
    assert (violation.seq, violation.rule) == (len(before) + 1, rule)
    assert verify(before) is None  # the log up to it is clean


def test_verify_help_names_every_rule_it_reports():
    """`audit verify --help` lists the names a violation is reported with, and every rule a forged
    log here breaks is one of them (a walkthrough found the help saying only "the invariants")."""
    shown = CliRunner().invoke(main, ["audit", "verify", "--help"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    rules = [*audit.PLACEMENT_RULES, audit.STAMP_NOT_PIN, audit.CHANGE_UNREGISTERED]
    assert all(rule in shown.output for rule in rules), shown.output
    assert {rule for _, _, rule in CASES.values()} <= set(rules)


@pytest.mark.parametrize("case", ["drained", "local off its node", "across architectures"])
async def test_audit_verify_fails_naming_the_rule_on_a_real_stream(nats_url, prefix, writer, case):
    before, forged, rule = CASES[case]
    # the events appended directly, one append each, as a buggy or hostile writer would
    seqs = [await asyncio.to_thread(writer.write, event) for event in [*before, forged]]
    result = await asyncio.to_thread(
        CliRunner().invoke, main, ["audit", "verify", "--nats", nats_url, "--prefix", prefix])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert f"sequence {seqs[-1]}" in result.output and rule in result.output
