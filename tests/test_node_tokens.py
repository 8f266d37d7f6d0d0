"""Rule 5 with node tokens (docs/contract.md): a LOCAL image restores only on the disk it was written to.

A machine replaced under its old node name (and worker id) was sent the old disk's LOCAL images, which
cannot load there: a node was its name. With `node_token` in registrations, the fold keys rule 5 by the
disk of a node (`services.scheduler.places`), and decide, explain, `audit verify` and a checkpoint all
read the same. Pure: the scheduler's own fold and decisions over logs built here.
"""

from __future__ import annotations

import pytest

from events.errors import ContractError
from events.schema import (Action, ErrorCode, PlacedFidelity, ReleaseReason, SnapshotOrigin, WorkerRemoved,
                           WorkerUpdated)
from services.registry.domain import disk_changed_reason
from services.scheduler.actor_list import actor_summary
from services.scheduler.checkpoint_codec import export_state, restore_state
from services.scheduler.decide import decide
from services.scheduler.fragmentation import fragmentation
from services.scheduler.places import Disks, describe, node_of
from services.scheduler.projection import Projection
from services.scheduler.records import PAUSED
from services.scheduler.worker_detail import worker_detail
from tests.factories import AT, Log, fold, placed, registered, version
from warmboot import audit
from warmboot.audit import Sink

V1 = version("1")


def paused_on(log: Log, actor_id: str, worker_id: str) -> None:
    """Place `actor_id` (it must go to `worker_id`), then pause it there: a LOCAL image on its node."""
    placement = log.decide(actor_id)
    assert placement.worker_id == worker_id
    log.place(placement)
    log.snapshot(actor_id, origin=SnapshotOrigin.PAUSE, stamped=placement.sandbox_runtime.version,
                 node=placement.node)
    log.release(actor_id, worker_id, ReleaseReason.PAUSED)
    assert log.p.actors[actor_id].state is PAUSED


def refused(log: Log, actor_id: str) -> ContractError:
    with pytest.raises(ContractError) as caught:
        log.decide(actor_id)
    return caught.value


def replaced(log: Log, worker_id: str, node: str, token: str) -> None:
    """The registry's record of a machine replaced under the same worker id: the life ends, a new one begins."""
    log.add(WorkerRemoved(at=AT, worker_id=worker_id, reason=disk_changed_reason(node)))
    log.worker(worker_id, node=node, node_token=token)


# --- decide --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("same_worker_id", [True, False])
def test_a_local_image_is_never_sent_to_a_machine_that_replaced_its_disk_under_the_node_name(same_worker_id):
    log = Log()
    log.worker("w1", node="n1", node_token="disk-a")
    log.actor("a")
    paused_on(log, "a", "w1")
    if same_worker_id:
        replaced(log, "w1", "n1", "disk-b")
    else:
        log.add(WorkerRemoved(at=AT, worker_id="w1", reason="LOST"))
        log.worker("w2", node="n1", node_token="disk-b")
    error = refused(log, "a")
    assert error.code is ErrorCode.FAILED_PRECONDITION
    assert "LOCAL image on node n1" in error.message and "warmboot actor revert a" in error.message
    assert "registered from another disk since" in error.message  # why: the machine was replaced
    # the same log without tokens: the hole this closes (the image sent to the new machine at MEMORY)
    untokened = Log()
    for event in log.events:
        if hasattr(event, "node_token"):
            event = type(event)(**{**{f: getattr(event, f) for f in event.__struct_fields__}, "node_token": None})
        untokened.add(event)
    assert untokened.decide("a").fidelity is PlacedFidelity.MEMORY


def test_the_same_disk_in_a_new_life_restores_its_images_at_memory():
    log = Log()
    log.worker("w1", node="n1", node_token="disk-a")
    log.actor("a")
    paused_on(log, "a", "w1")
    log.add(WorkerRemoved(at=AT, worker_id="w1", reason="LOST"))  # its agent was down past the TTL
    log.worker("w1", node="n1", node_token="disk-a")
    log.worker("w2", node="n1", node_token="disk-a")  # another worker of the same machine
    placement = log.decide("a")
    assert (placement.node, placement.action, placement.fidelity) == ("n1", Action.RESTORE, PlacedFidelity.MEMORY)


def test_images_taken_before_tokens_are_the_disk_of_the_first_token_its_node_registers():
    """An agent upgraded in place: its node's images from before stay restorable under the first token; a
    second token (a machine replaced after the upgrade) does not get them."""
    log = Log()
    log.worker("w1", node="n1")
    log.actor("a")
    log.actor("b")
    paused_on(log, "a", "w1")
    log.add(WorkerUpdated(at=AT, worker_id="w1", node="n1", capacity=registered("w1").capacity, labels={},
                          node_token="disk-a"))
    assert log.decide("a").fidelity is PlacedFidelity.MEMORY
    paused_on(log, "b", "w1")
    replaced(log, "w1", "n1", "disk-b")
    for actor_id in ("a", "b"):
        assert refused(log, actor_id).code is ErrorCode.FAILED_PRECONDITION


def test_two_disks_registered_under_one_node_each_restore_only_their_own_images():
    """Two machines under one node name at once (a misconfiguration the registry cannot refuse in a race):
    each image goes back to the disk it was written to, never to the other, whichever has room."""
    log = Log()
    log.worker("w1", node="n1", node_token="disk-a", mem=2048)
    log.worker("w2", node="n1", node_token="disk-b", mem=65536)
    log.actor("a", mem=1024)
    placement = log.decide("a")
    log.place(placement)
    worker = placement.worker_id
    log.snapshot("a", origin=SnapshotOrigin.PAUSE, stamped=placement.sandbox_runtime.version, node="n1")
    log.release("a", worker, ReleaseReason.PAUSED)
    for position in range(10):
        assert log.decide("a", position=position).worker_id == worker
    log.drain(worker)
    error = refused(log, "a")
    assert error.code is ErrorCode.RESOURCE_EXHAUSTED  # its disk has a registered worker, drained
    assert describe(log.p.actors["a"].node) in error.message


def test_views_show_the_node_and_fragmentation_counts_an_image_whose_disk_is_gone_as_lost():
    log = Log()
    log.worker("w1", node="n1", node_token="disk-a")
    log.worker("w2", node="n1", node_token="disk-b")
    log.actor("a")
    placement = log.decide("a")
    log.place(placement)
    log.snapshot("a", origin=SnapshotOrigin.PAUSE, stamped=placement.sandbox_runtime.version, node="n1")
    log.release("a", placement.worker_id, ReleaseReason.PAUSED)
    summary = actor_summary(log.p.actors["a"], log.p)
    assert summary.node == "n1" and summary.snapshot.node == "n1"
    other = "w2" if placement.worker_id == "w1" else "w1"
    assert [i.actor_id for i in worker_detail(log.p, placement.worker_id).local_images] == ["a"]
    assert worker_detail(log.p, other).local_images == []
    assert not summary.snapshot.lost
    log.add(WorkerRemoved(at=AT, worker_id=placement.worker_id, reason="LOST"))
    (cls,) = fragmentation(log.p).classes
    assert cls.lost_local_snapshots == 1
    assert actor_summary(log.p.actors["a"], log.p).snapshot.lost  # as actor show and list say it


def test_a_local_image_taken_where_the_actor_did_not_run_is_on_no_known_disk_of_a_tokened_node():
    """A pause recorded naming another node than the placement's (no snapshotter writes one; the fold reads
    it): on a node that registers tokens, on a disk no worker is on; before tokens, on the node, as v1.1."""
    for token, restorable in (("disk-a", False), (None, True)):
        log = Log()
        log.worker("w1", node="n1")
        log.worker("w9", node="n9", node_token=token)
        log.actor("a")
        placement = log.decide("a", selectors=None)
        log.place(placement)
        other = "n9" if placement.node == "n1" else "n1"
        log.snapshot("a", origin=SnapshotOrigin.PAUSE, stamped=V1, node=other)
        if other == "n1" or restorable:
            assert log.decide("a").node == other
        else:
            assert refused(log, "a").code is ErrorCode.FAILED_PRECONDITION


# --- audit verify, checkpoints -------------------------------------------------------------------------------


def test_audit_verify_finds_a_restore_sent_to_another_disk_of_the_node():
    log = Log()
    log.worker("w1", node="n1", node_token="disk-a")
    log.actor("a", mem=512)
    paused_on(log, "a", "w1")
    replaced(log, "w1", "n1", "disk-b")
    restore = placed("a", "w1", V1, node="n1", action=Action.RESTORE, fidelity=PlacedFidelity.MEMORY,
                     snapshot_id=log.p.actors["a"].snapshot_id, mem=512)
    violation = fold([*log.events, restore], Sink(verify=True)).violation
    assert violation is not None and violation.rule == audit.LOCAL_OFF_NODE
    assert "node n1" in violation.detail and "disk-b" in violation.detail
    same_disk = Log()
    for event in log.events[:-2]:
        same_disk.add(event)
    import msgspec  # on its disk, the placement names its token, as the scheduler writes it (`decide.placement`)
    restore = msgspec.structs.replace(restore, node_token="disk-a")
    assert fold([*same_disk.events, restore], Sink(verify=True)).violation is None


def test_a_checkpoint_keeps_the_disks_of_nodes_and_decides_as_the_replay():
    log = Log()
    log.worker("w1", node="n1", node_token="disk-a")
    log.actor("a")
    paused_on(log, "a", "w1")
    replaced(log, "w1", "n1", "disk-b")
    restored = restore_state(export_state(log.p))
    assert restored.disks == {"n1": ("disk-a", "disk-b")}
    assert restored.workers["w1"].place == log.p.workers["w1"].place == "n1/disk-b"
    assert restored.actors["a"].image_node == "n1"
    with pytest.raises(ContractError):
        decide(restored, "a", None, restored.seq)


# --- the places themselves -----------------------------------------------------------------------------------


def test_places_name_the_node_and_the_first_token_is_the_node_itself():
    disks = Disks()
    assert disks.place("n1", None, "w1@1") == "n1" and disks == {}
    assert disks.place("n1", "t1", "w1@2") == "n1"
    assert disks.place("n1", None, "w2@3") == "n1"  # the node has not moved on from its first disk
    assert disks.place("n1", "t2", "w3@4") == "n1/t2" and node_of("n1/t2") == "n1"
    assert disks.place("n1", None, "w4@5") == "n1//w4@5" and node_of("n1//w4@5") == "n1"
    assert describe("n1//w4@5") == "node n1 (a disk that no node token names: the registration w4@5)"
    assert disks == {"n1": ("t1", "t2")}
    assert disks.moved_on("n1") and not disks.moved_on("n1/t2")
    assert disks.unknown("n1") == "n1/" and disks.unknown("n2") == "n2"
    assert describe("n1") == "node n1" and describe("n1/t2") == "node n1 (the disk of node token t2)"


def test_an_image_paused_after_its_worker_named_its_disk_is_on_that_disk_not_the_one_of_the_placement():
    """A worker registered without a token (an agent before tokens) on a node whose first token is another
    machine's: its actor placed then; its agent upgraded, it names its own disk; the pause that follows
    is on that disk, and never restores on the node's first disk."""
    log = Log()
    log.worker("w0", node="n1", node_token="disk-a")  # the node's first token
    log.add(WorkerRemoved(at=AT, worker_id="w0", reason="LOST"))
    log.worker("w2", node="n1", mem=2048)
    log.actor("a")
    placement = log.decide("a")
    assert placement.worker_id == "w2"
    log.place(placement)
    log.add(WorkerUpdated(at=AT, worker_id="w2", node="n1", capacity=registered("w2", mem=2048).capacity,
                          labels={}, node_token="disk-b"))
    log.snapshot("a", origin=SnapshotOrigin.PAUSE, stamped=placement.sandbox_runtime.version, node="n1")
    log.release("a", "w2", ReleaseReason.PAUSED)
    assert log.p.actors["a"].image_node == "n1/disk-b"
    log.worker("w1", node="n1", node_token="disk-a", mem=65536)  # the first disk's machine, roomy
    log.drain("w2")
    assert refused(log, "a").code is ErrorCode.RESOURCE_EXHAUSTED  # its own disk's worker drained; never w1


def test_a_registration_without_a_token_on_a_node_that_moved_on_is_sent_no_image_of_another_registration():
    """A machine replaced (a second token on the node), and a worker of a new id registering there without a
    token (its agent run without --node-token-file): it cannot say which disk it is on, so it is sent neither
    the first disk's images nor any other's; its own pauses restore on it."""
    log = Log()
    log.worker("w1", node="n1", node_token="disk-a")
    log.actor("a")
    log.actor("b")
    paused_on(log, "a", "w1")
    replaced(log, "w1", "n1", "disk-b")
    log.drain("w1")
    log.worker("w9", node="n1")  # no token
    assert refused(log, "a").code is ErrorCode.FAILED_PRECONDITION
    paused_on(log, "b", "w9")
    assert log.decide("b").worker_id == "w9"
    log.add(WorkerUpdated(at=AT, worker_id="w9", node="n1", capacity=registered("w9").capacity, labels={"x": "y"}))
    assert log.decide("b").worker_id == "w9"  # an update giving no token keeps its disk
    log.add(WorkerRemoved(at=AT, worker_id="w9", reason="LOST"))
    log.worker("w9", node="n1")  # its next life, on whatever machine: not the image's disk
    assert refused(log, "b").code is ErrorCode.FAILED_PRECONDITION
    assert replay_decides_alike(log)


def replay_decides_alike(log: Log) -> bool:
    """A checkpoint of the fold, and a fresh fold of the log, decide every actor as the fold does."""
    restored = restore_state(export_state(log.p))
    replayed = fold(log.events, Projection())

    def answer(p, actor_id):
        try:
            return decide(p, actor_id, None, p.seq).worker_id
        except ContractError as e:
            return e.code, e.message
    return all(answer(log.p, a) == answer(restored, a) == answer(replayed, a) for a in log.p.actors)


def test_a_retry_is_not_answered_with_a_restore_of_an_image_on_another_disk_than_its_worker_names_now():
    """A worker with an agent before tokens on a node whose first token is another machine's is taken as on
    the first disk (the limit rule 5 names) and is sent its image; its agent upgraded, it names its own
    disk. The resume's retry is then refused, not answered with a restore that cannot load there (found by
    review: `check_retry` compared nodes only)."""
    log = Log()
    log.worker("w1", node="n1", node_token="disk-a")
    log.actor("a")
    paused_on(log, "a", "w1")
    log.add(WorkerRemoved(at=AT, worker_id="w1", reason="LOST"))
    log.worker("w2", node="n1", mem=65536)
    placement = log.decide("a")
    assert (placement.worker_id, placement.fidelity) == ("w2", PlacedFidelity.MEMORY)
    retry_refused_once_w2_names_disk_b(log, placement)


def downgraded(log: Log, worker_id: str, node: str, mem: int = 8192) -> None:
    """A worker's agent downgraded on the same machine (a registration naming no token where its life named
    one), as a log may hold it: the registry refuses it now (`Worker.register`), an older registry wrote a
    WorkerUpdated, the life going on."""
    log.add(WorkerUpdated(at=AT, worker_id=worker_id, node=node, capacity=registered(worker_id, mem=mem).capacity,
                          labels={}, node_token=None))


def test_a_worker_that_stops_naming_its_token_stays_on_its_lifes_disk_never_the_first_one():
    """Two disks of one node; the second's agent downgraded (no token): the registry takes it as the same
    machine (the life goes on: an older registry's WorkerUpdated; this one refuses it), so it is still on the
    second disk. It is never sent the first disk's images,
    and an image it pauses after is on its own disk, never restored on the first's (found by review: the
    fold took it as on the node's first disk, and sent it the other machine's image at MEMORY)."""
    log = Log()
    log.worker("w1", node="n1", node_token="disk-a", mem=4096)  # the node's first disk
    log.actor("a")
    log.actor("b")
    paused_on(log, "a", "w1")
    log.worker("w2", node="n1", node_token="disk-b", mem=65536)
    placement = log.decide("b")
    assert placement.worker_id == "w2"  # the roomier
    log.place(placement)
    downgraded(log, "w2", "n1", mem=65536)
    assert log.p.workers["w2"].place == "n1/disk-b"
    log.snapshot("b", origin=SnapshotOrigin.PAUSE, stamped=placement.sandbox_runtime.version, node="n1")
    log.release("b", "w2", ReleaseReason.PAUSED)
    assert log.p.actors["b"].image_node == "n1/disk-b"
    for position in range(10):  # each image to its own disk's worker, whichever is roomier
        assert log.decide("a", position=position).worker_id == "w1"
        assert log.decide("b", position=position).worker_id == "w2"
    log.drain("w1")
    assert refused(log, "a").code is ErrorCode.RESOURCE_EXHAUSTED  # never w2, on another disk
    # audit verify judges by the same fold: a restore of a's image sent to w2 is off its disk
    restore = placed("a", "w2", V1, node="n1", action=Action.RESTORE, fidelity=PlacedFidelity.MEMORY,
                     snapshot_id=log.p.actors["a"].snapshot_id)
    violation = fold([*log.events, restore], Sink(verify=True)).violation
    assert violation is not None and violation.rule == audit.LOCAL_OFF_NODE
    restored = restore_state(export_state(log.p))
    assert restored.workers["w2"].place == "n1/disk-b"


def test_a_registration_without_a_token_stays_on_its_own_disk_after_the_first_disk_registers_again():
    """A node that registered a second disk (a machine replacing the first, its workers moving over one by
    one), then the first disk's token again (a worker still on the first machine updating its labels): it
    has moved on from its first disk all the same, so a worker of a new id registering without a token
    there cannot say which disk it is on, and is sent no image of the first disk (found by review: the
    node's latest token back at its first made such a registration the first disk's)."""
    log = Log()
    log.worker("w1", node="n1", node_token="disk-a")
    log.worker("w3", node="n1", node_token="disk-a")
    log.actor("a")
    log.drain("w3")
    paused_on(log, "a", "w1")
    replaced(log, "w1", "n1", "disk-b")  # w1 moved to the new machine
    log.drain("w1")
    # w3, still on the old machine, updates its labels: its registration names the first disk's token again
    log.add(WorkerUpdated(at=AT, worker_id="w3", node="n1", capacity=registered("w3").capacity,
                          labels={"x": "y"}, node_token="disk-a"))
    log.worker("w9", node="n1", mem=65536)  # no token: on the new machine, for all the fold can tell
    assert log.p.workers["w9"].place != "n1"
    assert refused(log, "a").code is ErrorCode.RESOURCE_EXHAUSTED  # w3 drained; never w9
    assert replay_decides_alike(log)


@pytest.mark.parametrize("token", [None, "disk-b"])
def test_audit_verify_finds_a_restore_of_a_local_image_not_naming_its_workers_disk(token):
    """The node token a restore of a LOCAL image names is what the worker's agent checks its disk against
    (`agent --check-placement`): one naming none (a scheduler of an earlier version, after agents were given
    tokens), or another disk's, is not the placement the rules give, and `audit verify` says so (found by
    review: it judged the worker's place, never the token the record names)."""
    import msgspec

    log = Log()
    log.worker("w1", node="n1", node_token="disk-a")
    log.actor("a", mem=512)
    paused_on(log, "a", "w1")
    made = log.decide("a")
    assert made.node_token == "disk-a"
    good = fold([*log.events, placed_event_of(made)], Sink(verify=True))
    assert good.violation is None
    bad = fold([*log.events, msgspec.structs.replace(placed_event_of(made), node_token=token)], Sink(verify=True))
    assert bad.violation is not None and bad.violation.rule == audit.NODE_TOKEN_MISSTATED
    assert "disk-a" in bad.violation.detail


def placed_event_of(placement):
    from services.scheduler.committer import placed_event
    return placed_event(placement, None)


def test_a_retry_of_a_restore_without_memory_of_a_local_image_on_another_disk_is_refused_too():
    """As the retry of a memory restore above, of a LOCAL image the pause took without memory (ROOTFS): it
    is on its disk too (rule 5 restricts every fidelity), and the placement names no token its worker could
    check (the worker had none then). The retry is refused once the worker names another disk (found by
    review: the disk check was of memory restores only, `named_image`)."""
    from events.schema import Fidelity

    log = Log()
    log.worker("w1", node="n1", node_token="disk-a")
    log.actor("a")
    first = log.decide("a")
    log.place(first)
    log.snapshot("a", origin=SnapshotOrigin.PAUSE, stamped=first.sandbox_runtime.version, node="n1",
                 fidelity=Fidelity.ROOTFS)
    log.release("a", "w1", ReleaseReason.PAUSED)
    log.add(WorkerRemoved(at=AT, worker_id="w1", reason="LOST"))
    log.worker("w2", node="n1", mem=65536)
    placement = log.decide("a")
    assert (placement.worker_id, placement.action, placement.fidelity, placement.node_token) == (
        "w2", Action.RESTORE, PlacedFidelity.ROOTFS, None)
    retry_refused_once_w2_names_disk_b(log, placement)


def retry_refused_once_w2_names_disk_b(log: Log, placement) -> None:
    """Commit `placement` (on w2, registered without a token) under request id r1: its retry is answered from
    the log while nothing says w2 is on another disk, and refused (FAILED_PRECONDITION, field request_id,
    naming the disk) once w2's agent, upgraded, registers disk-b."""
    from services.scheduler.decide import check_retry

    seq = log.place(placement, "r1") - 1
    check_retry(log.p, placement, seq, "r1")
    log.add(WorkerUpdated(at=AT, worker_id="w2", node="n1", capacity=registered("w2", mem=65536).capacity,
                          labels={}, node_token="disk-b"))
    with pytest.raises(ContractError) as caught:
        check_retry(log.p, placement, seq, "r1")
    assert caught.value.code is ErrorCode.FAILED_PRECONDITION and caught.value.field == "request_id"
    assert "disk-b" in caught.value.message
