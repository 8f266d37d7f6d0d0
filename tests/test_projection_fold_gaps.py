"""What the scheduler's fold (services/scheduler/projection.py) keeps, pinned where a mutation
campaign found nothing checking it: where a LOCAL image is, which snapshot is an actor's latest,
which workers count as live, a removed worker's unread history, a worker's updated capacity.
Pure: a `Log` folded into a Projection, no bus."""

from __future__ import annotations

from events.schema import (
    ActorReverted,
    ActorStopped,
    Location,
    PlacedFidelity,
    ReleaseReason,
    Resources,
    RuntimeChanged,
    SnapshotOrigin,
    WorkerDrained,
    WorkerRemoved,
    WorkerUpdated,
)
from services.scheduler.decide import too_big_for_class
from services.scheduler.records import SUSPENDED, request_hash
from tests.factories import AT, CLASS as CLS, Log, booked, created, entry, placed as placement_event, runtime, snapshot, taken, version

V1, V2, V3 = version("1"), version("2"), version("3")


def test_a_local_image_that_names_no_node_is_on_the_node_the_actor_ran_on():
    log = Log()
    log.worker("w1", runtime(V1), node="n1")
    log.actor("a")
    log.place(log.decide("a"))
    log.worker("w2", runtime(V1), node="n2")
    log.add(taken(snapshot("a", V1, snapshot_id="a-1", location=Location.LOCAL), SnapshotOrigin.SUSPEND))
    actor = log.p.actors["a"]
    assert actor.state is SUSPENDED and actor.node is None
    assert actor.image_node == "n1"
    placed = log.decide("a")
    assert placed.node == "n1" and placed.fidelity is PlacedFidelity.MEMORY and placed.snapshot_id == "a-1"


def test_a_local_image_that_names_its_node_is_there_not_where_the_actor_ran():
    log = Log()
    log.worker("w1", runtime(V1), node="n1")
    log.actor("a")
    log.place(log.decide("a"))
    log.worker("w2", runtime(V1), node="n2")
    log.add(taken(snapshot("a", V1, snapshot_id="a-1", node="n2"), SnapshotOrigin.SUSPEND))
    assert log.p.actors["a"].image_node == "n2"
    placed = log.decide("a")
    assert placed.node == "n2" and placed.worker_id == "w2" and placed.snapshot_id == "a-1"


def test_a_tag_copy_does_not_change_the_actors_latest_snapshot():
    log = Log()
    log.worker("w1", runtime(V1), (runtime(V2),))
    log.actor("a")
    log.snapshot("a", stamped=V1, snapshot_id="a-own")
    log.add(taken(snapshot("a", V2, snapshot_id="a-tag-copy"), SnapshotOrigin.TAG))
    placed = log.decide("a")
    assert placed.snapshot_id == "a-own" and placed.sandbox_runtime.version == V1


def test_a_drained_worker_whose_runtime_changes_still_takes_no_stranded_snapshot_off_the_count():
    log = Log()
    log.worker("w1", runtime(V1))
    log.actor("a")
    log.snapshot("a", stamped=V3)
    assert log.p.stranded(CLS) == 1
    log.drain("w1")
    log.add(RuntimeChanged(at=AT, worker_id="w1", sandbox_classes=(entry(runtime(V1), (runtime(V3),)),),
                           previous=(entry(runtime(V1)),)))
    assert log.p.stranded(CLS) == 1  # w1 restores V3 now, but is drained
    assert log.replay().stranded(CLS) == 1


def test_a_worker_drained_twice_is_uncounted_once():
    log = Log()
    log.worker("w1", runtime(V1), (runtime(V3),))
    log.worker("w2", runtime(V1), (runtime(V3),))
    log.actor("a")
    log.snapshot("a", stamped=V3)
    log.drain("w1")
    log.add(WorkerDrained(at=AT, worker_id="w1", reason="again"))
    assert log.p.stranded(CLS) == 0  # w2 still restores V3


def test_a_removal_ends_a_life_whose_last_message_the_fold_could_not_read():
    log = Log()
    seq = log.worker("w1", runtime(V1))
    unread = seq + 1
    log.p.worker_unread(unread, "w1")
    log.events.append(None)  # the unread message's place in the log
    log.add(WorkerRemoved(at=AT, worker_id="w1", reason="gone"))
    assert log.p.life_unread("w1") == 0
    assert log.p.life_ended("w1", seq) is not None


def test_a_capacity_update_replaces_the_largest_the_class_offers():
    log = Log()
    log.worker("w1", runtime(V1), cpu=4000, mem=8192)
    assert too_big_for_class(log.p, CLS, 2000, 4096) is None
    log.add(WorkerUpdated(at=AT, worker_id="w1", node="node-w1", capacity=Resources(cpu_millis=1000, memory_mib=2048),
                          labels={}))
    assert log.p.classes[CLS].largest() == (1000, 2048)
    assert too_big_for_class(log.p, CLS, 2000, 4096) is not None


def test_a_revert_makes_the_external_image_it_goes_back_to_the_latest():
    """The LOCAL image abandoned (stamped V2, on n1) is no longer what a resume restores: the EXTERNAL
    one stamped V1 is, wherever a V1 restorer is."""
    log = Log()
    log.worker("w1", runtime(V2), node="n1")
    log.worker("w2", runtime(V1), node="n2")
    log.actor("a")
    back = snapshot("a", V1, snapshot_id="a-external")
    log.add(taken(back, SnapshotOrigin.SUSPEND))
    local = snapshot("a", V2, snapshot_id="a-local", node="n1")
    log.add(taken(local, SnapshotOrigin.SUSPEND))
    log.add(ActorReverted(at=AT, actor_id="a", snapshot=back, abandoned=local))
    actor = log.p.actors["a"]
    assert actor.state is SUSPENDED and actor.image_node is None
    placed = log.decide("a")
    assert placed.snapshot_id == "a-external" and placed.worker_id == "w2"
    assert placed.sandbox_runtime.version == V1 and placed.fidelity is PlacedFidelity.MEMORY


def test_a_revert_to_no_snapshot_cold_boots_the_actor_anywhere():
    log = Log()
    log.worker("w1", runtime(V2), node="n1")
    log.worker("w2", runtime(V1), node="n2", cpu=8000)
    log.actor("a")
    local = snapshot("a", V2, snapshot_id="a-local", node="n1")
    log.add(taken(local, SnapshotOrigin.SUSPEND))
    log.add(ActorReverted(at=AT, actor_id="a", snapshot=None, abandoned=local))
    actor = log.p.actors["a"]
    assert actor.snapshot is None and actor.snapshot_ref is None and actor.image_node is None
    placed = log.decide("a")
    assert placed.snapshot_id is None and placed.fidelity is PlacedFidelity.NONE


def test_a_placement_without_a_release_in_between_replaces_the_old_booking():
    log = Log()
    log.worker("w1", runtime(V1))
    log.worker("w2", runtime(V1))
    log.actor("a", cpu=500, mem=1024)
    first = log.decide("a")
    log.place(first)
    log.add(placement_event("a", "w2" if first.worker_id == "w1" else "w1", V1, cpu=700, mem=2048))
    old, new = log.p.workers[first.worker_id], log.p.workers["w2" if first.worker_id == "w1" else "w1"]
    assert (old.booked_cpu, old.booked_mem, old.holding) == (0, 0, 0)
    assert (new.booked_cpu, new.booked_mem, new.holding) == (700, 2048, 1)


def test_a_suspending_release_leaves_no_node_pin():
    log = Log()
    log.worker("w1", runtime(V1))
    log.actor("a")
    log.place(log.decide("a"))
    log.release("a", "w1", ReleaseReason.SUSPENDED)
    assert log.p.actors["a"].state is SUSPENDED and log.p.actors["a"].node is None


def test_an_actor_created_anew_without_a_snapshot_keeps_none_of_its_last_lifes():
    log = Log()
    log.worker("w1", runtime(V1))
    log.actor("a")
    log.snapshot("a", stamped=V1, snapshot_id="a-last-life")
    log.add(ActorStopped(at=AT, actor_id="a"))
    log.actor("a")
    assert log.p.actors["a"].snapshot is None and log.p.actors["a"].snapshot_ref is None
    placed = log.decide("a")
    assert placed.snapshot_id is None and placed.fidelity is PlacedFidelity.NONE


def test_an_external_image_names_no_node_even_when_taken_where_the_actor_ran():
    log = Log()
    log.worker("w1", runtime(V1), node="n1")
    log.actor("a")
    log.place(log.decide("a"))
    log.add(taken(snapshot("a", V1, snapshot_id="a-ext"), SnapshotOrigin.SUSPEND))
    assert log.p.actors["a"].image_node is None  # what `actor list` shows of its latest snapshot


def test_a_placement_folded_after_its_workers_removal_keeps_the_node_it_names():
    log = Log()
    log.worker("w1", runtime(V1), node="n1")
    log.actor("a")
    decided = log.decide("a")
    log.add(WorkerRemoved(at=AT, worker_id="w1", reason="gone"))
    log.add(placement_event("a", "w1", V1, node="n1"))
    assert log.p.actors["a"].node == "n1"
    assert log.p.actors["a"].worker.worker_id == "w1" and not log.p.actors["a"].worker.live
    assert decided.node == "n1"


def test_a_paused_actors_local_memory_image_is_stranded_only_when_its_node_has_no_live_restorer():
    log = Log()
    log.worker("w1", runtime(V1), node="n1")
    log.worker("w2", runtime(V1), node="n2")
    log.actor("a")
    placed_a = log.decide("a")
    log.place(placed_a)
    log.snapshot("a", stamped=V1, origin=SnapshotOrigin.PAUSE)
    assert log.p.stranded(CLS) == 0
    log.drain(placed_a.worker_id)  # the only V1 restorer on its node; the other node's does not help
    assert log.p.stranded(CLS) == 1


def test_a_local_image_is_lost_only_when_its_node_has_no_worker_of_the_class():
    log = Log()
    log.worker("w1", runtime(V1), node="n1")
    log.actor("a")
    log.place(log.decide("a"))
    log.add(taken(snapshot("a", V1, snapshot_id="a-1", node="n1"), SnapshotOrigin.SUSPEND))
    assert log.p.lost_local(CLS) == 0
    log.add(WorkerRemoved(at=AT, worker_id="w1", reason="gone"))
    assert log.p.lost_local(CLS) == 1


def test_a_new_life_keeps_the_last_lifes_request_ids_to_refuse_a_late_resume_by():
    log = Log()
    log.worker("w1", runtime(V1))
    log.actor("a")
    seq = log.place(log.decide("a"), "r1") - 1
    log.add(ActorStopped(at=AT, actor_id="a"))
    log.actor("a")
    assert log.p.actors["a"].placed_earlier(request_hash("r1")) == seq
    assert log.p.actors["a"].placed_by(request_hash("r1")) == 0


def test_a_new_life_begun_after_an_unread_stop_gives_up_the_last_lifes_booking():
    log = Log()
    log.worker("w1", runtime(V1))
    log.actor("a", cpu=500, mem=1024)
    log.place(log.decide("a"))
    log.p.actor_unread(len(log.events) + 1, "a")  # its stop, of a version this fold cannot read
    log.events.append(None)
    log.actor("a")
    w1 = log.p.workers["w1"]
    assert (w1.booked_cpu, w1.booked_mem, w1.holding) == (0, 0, 0)
    assert log.p.actors["a"].worker is None and log.p.actors["a"].node is None


def test_a_pause_whose_local_image_names_a_node_pins_the_actor_there():
    log = Log()
    log.worker("w1", runtime(V1), node="n1")
    log.actor("a")
    log.place(log.decide("a"))
    log.add(taken(snapshot("a", V1, snapshot_id="a-p", node="n2"), SnapshotOrigin.PAUSE))
    assert log.p.actors["a"].node == "n2" and log.p.actors["a"].image_node == "n2"


def test_the_aggregate_versions_the_log_gives_are_what_the_next_commits_expect():
    log = Log()
    log.worker("w1", runtime(V1))
    log.p.apply(2, created("a"), 5)
    log.p.apply(3, booked("w1", "a"), 9)
    assert log.p.actor_expectation("a") == (5, 2)
    assert log.p.booking_expectation("w1") == (9, 3)
