"""`warmboot audit verify` on forged logs: each v1.1 invariant, broken by events appended
directly, is found and named with its sequence (pure folds), and through the CLI on a
real stream."""

from __future__ import annotations

import asyncio

import pytest
from click.testing import CliRunner

from events.aggregate import WireApplication
from events.schema import (
    Action,
    ActorCreated,
    ActorPlaced,
    ActorReleased,
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
    WorkerDrained,
    WorkerRegistered,
    WorkerRemoved,
    WorkerSandboxClass,
    WorkerUpdated,
)
from services.common import store_env
from tests.factories import AT, CLASS, runtime, stamp, version, worker
from warmboot import audit
from warmboot.audit import Sink
from warmboot.cli import main

V1, V2 = version("v1"), version("v2")
ARM = version("v1", arch="arm64")


def registered(worker_id: str, default, restorable=(), *, node: str = "n1", mem: int = 4096,
               labels: dict | None = None) -> WorkerRegistered:
    body = worker(worker_id, default, restorable, node=node, mem=mem, labels=labels or {"zone": "a"})
    return WorkerRegistered(at=AT, worker_id=worker_id, node=body.node, capacity=body.capacity,
                            labels=body.labels, sandbox_classes=body.sandbox_classes)


def created(actor_id: str, selectors: dict | None = None) -> ActorCreated:
    return ActorCreated(at=AT, actor_id=actor_id, sandbox_class=CLASS, template_uid="t1",
                        resources=Resources(cpu_millis=100, memory_mib=512), selectors=selectors or {},
                        min_fidelity=Fidelity.ROOTFS)


def placed(actor_id: str, worker_id: str, pin, *, node: str = "n1", fidelity=PlacedFidelity.NONE,
           action=Action.RUN, fallback=None, snapshot_id=None) -> ActorPlaced:
    return ActorPlaced(at=AT, actor_id=actor_id, worker_id=worker_id, node=node, action=action, fidelity=fidelity,
                       sandbox_runtime=stamp(pin), snapshot_id=snapshot_id, fallback=fallback,
                       booked=Resources(cpu_millis=100, memory_mib=512))


def snapshot_taken(actor_id: str, pin, *, location=Location.EXTERNAL, node=None, origin=SnapshotOrigin.SUSPEND):
    from events.schema import Snapshot

    snap = Snapshot(snapshot_id=f"{actor_id}-s", actor_id=actor_id, template_uid="t1", fidelity=Fidelity.MEMORY,
                    location=location, node=node, uri=None if location is Location.LOCAL else "s3://x",
                    sandbox_runtime=stamp(pin), taken_at=AT)
    return SnapshotTaken(at=AT, actor_id=actor_id, snapshot=snap, origin=origin)


def released(actor_id: str, worker_id: str, reason=ReleaseReason.SUSPENDED) -> ActorReleased:
    return ActorReleased(at=AT, actor_id=actor_id, worker_id=worker_id, reason=reason)


def verify(events: list[Event]) -> audit.Violation | None:
    sink = Sink(verify=True)
    for seq, event in enumerate(events, start=1):
        sink.apply(seq, event)
    return sink.violation


def test_a_clean_log_has_no_violation():
    assert verify([registered("w1", V1), created("a"), placed("a", "w1", V1)]) is None


CASES = {
    "drained": ([registered("w1", V1), created("a"), WorkerDrained(at=AT, worker_id="w1")],
                placed("a", "w1", V1), audit.NOT_TAKING),
    "removed": ([registered("w1", V1), created("a"), WorkerRemoved(at=AT, worker_id="w1")],
                placed("a", "w1", V1), audit.NOT_TAKING),
    "runtime dropped": (
        [registered("w1", V1), created("a"), placed("a", "w1", V1), snapshot_taken("a", V1),
         released("a", "w1"),
         RuntimeChanged(at=AT, worker_id="w1",
                        sandbox_classes=(WorkerSandboxClass(sandbox_class=CLASS, default_runtime=runtime(V2)),),
                        previous=())],
        placed("a", "w1", V1, fidelity=PlacedFidelity.MEMORY, action=Action.RESTORE, snapshot_id="a-s"),
        audit.RUNTIME_GONE),
    "capacity cut": (
        [registered("w1", V1), created("a"), WorkerUpdated(at=AT, worker_id="w1", node="n1",
                                                            capacity=Resources(cpu_millis=4000, memory_mib=128),
                                                            labels={"zone": "a"})],
        placed("a", "w1", V1), audit.PAST_ROOM),
    "selector no longer met": (
        [registered("w1", V1), created("a", {"zone": "a"}),
         WorkerUpdated(at=AT, worker_id="w1", node="n1", capacity=Resources(cpu_millis=4000, memory_mib=4096),
                       labels={"zone": "b"})],
        placed("a", "w1", V1), audit.SELECTOR_UNMET),
    "local off its node": (
        [registered("w1", V1, node="n1"), registered("w2", V1, node="n2"), created("a"), placed("a", "w1", V1),
         snapshot_taken("a", V1, location=Location.LOCAL, node="n1", origin=SnapshotOrigin.PAUSE),
         released("a", "w1", ReleaseReason.PAUSED)],
        placed("a", "w2", V1, node="n2", fidelity=PlacedFidelity.MEMORY, action=Action.RESTORE, snapshot_id="a-s"),
        audit.LOCAL_OFF_NODE),
    "across architectures": (
        [registered("w1", V1), registered("arm", ARM, node="n9"), created("a"), placed("a", "w1", V1),
         snapshot_taken("a", V1), released("a", "w1"), WorkerRemoved(at=AT, worker_id="w1")],
        placed("a", "arm", ARM, node="n9", fidelity=PlacedFidelity.VOLUMES, action=Action.RESTORE,
               snapshot_id="a-s", fallback=Fallback(reason=FallbackReason.NO_COMPATIBLE_WORKER,
                                                    from_fidelity=PlacedFidelity.MEMORY,
                                                    to_fidelity=PlacedFidelity.VOLUMES)),
        audit.ACROSS_ARCHITECTURES),
}


@pytest.mark.parametrize("case", CASES)
def test_a_forged_placement_is_named_with_its_sequence(case):
    before, forged, rule = CASES[case]
    violation = verify([*before, forged])
    assert violation is not None, f"{case}: not found"
    assert (violation.seq, violation.rule) == (len(before) + 1, rule)
    assert verify(before) is None  # the log up to it is clean


@pytest.mark.parametrize("case", ["drained", "local off its node", "across architectures"])
async def test_audit_verify_fails_naming_the_rule_on_a_real_stream(nats_url, prefix, case):
    before, forged, rule = CASES[case]
    def append() -> list[int]:  # the events appended directly, as a buggy or hostile writer would
        app = WireApplication(store_env(nats_url, prefix))
        try:
            versions: dict[str, int] = {}
            seqs = []
            for event in [*before, forged]:
                aggregate = f"{event.KIND}.{event.entity_id}"
                versions[aggregate] = versions.get(aggregate, 0) + 1
                seqs += app.recorder.insert_events([app.stored_event(aggregate, versions[aggregate], event)])
            return seqs
        finally:
            app.close()

    seqs = await asyncio.to_thread(append)
    result = await asyncio.to_thread(
        CliRunner().invoke, main, ["audit", "verify", "--nats", nats_url, "--prefix", prefix])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert f"sequence {seqs[-1]}" in result.output and rule in result.output
