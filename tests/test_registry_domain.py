"""The registry's pure decisions on a worker (`services.registry.domain`), where the tests over the bus
left a rule unchecked (found by a mutation campaign of that module): what a registration records of the
runtimes a worker offers, and what the revision of the registration in force decides.

No resume may go to a worker whose runtime cannot load the image: a registration change recorded wrongly
(a restorable runtime dropped but still offered, a class change taken silently) is the worst bug.
"""

from __future__ import annotations

from datetime import datetime, timezone

import msgspec
import pytest

from events.errors import ContractError
from events.schema import (ErrorCode, RegisterOutcome, RegisterWorker, RuntimeChanged, WorkerRegistered, WorkerRemoved,
                           WorkerUpdated)
from services.registry.domain import Worker, canonical_classes, register_outcome
from tests.registry_helpers import registration, runtime

AT = datetime(2026, 12, 7, 12, 0, tzinfo=timezone.utc)


def request(body: dict) -> RegisterWorker:
    return msgspec.convert(body, RegisterWorker)


def registered(body: dict) -> Worker:
    worker = Worker("w-1")
    assert worker.register(request(body), AT) is RegisterOutcome.REGISTERED
    worker.collect_events()
    return worker


def offered(worker: Worker) -> dict[str, set[str]]:
    """What a worker offers, as placement reads it: per class, the assets of its default and restorable runtimes."""
    def asset(r) -> str:
        return {a.key: a.value for a in r.version.attributes}["gvisor_asset_hash"]
    return {e.sandbox_class: {asset(e.default_runtime), *(asset(r) for r in e.restorable_runtimes)}
            for e in worker.sandbox_classes}


# --- what a registration records of the runtimes a worker offers ----------------------------------------------


def test_every_restorable_runtime_is_offered_and_one_dropped_is_a_runtime_change_that_stops_offering_it():
    worker = registered(registration("w-1", default=runtime("v2"), restorable=[runtime("v1"), runtime("v0")]))
    assert offered(worker) == {"gvisor": {"v2", "v1", "v0"}}
    fewer = request(registration("w-1", default=runtime("v2"), restorable=[runtime("v1")]))
    assert worker.register(fewer, AT) is RegisterOutcome.RUNTIME_CHANGED  # the default is the same: still a change
    [changed] = [e.body for e in worker.collect_events()]
    assert isinstance(changed, RuntimeChanged)
    assert changed.sandbox_classes == canonical_classes(fewer.sandbox_classes)  # what it offers now
    assert offered(worker) == {"gvisor": {"v2", "v1"}}
    replayed = Worker("w-1")  # as the service loads it from the history
    for event in worker.history:
        replayed.apply(event)
    assert offered(replayed) == {"gvisor": {"v2", "v1"}}


def test_a_class_added_or_dropped_is_refused_and_records_nothing():
    two = [{"sandbox_class": "gvisor", "default_runtime": runtime("v1")},
           {"sandbox_class": "microvm", "default_runtime": runtime("k1")}]
    worker = registered(registration("w-1", classes=two))
    assert offered(worker) == {"gvisor": {"v1"}, "microvm": {"k1"}}
    three = two + [{"sandbox_class": "wasm", "default_runtime": runtime("x1")}]
    for classes, says in ((two[:1], "drops microvm"), (two[1:], "drops gvisor"), (three, "adds wasm")):
        with pytest.raises(ContractError) as refused:
            worker.register(request(registration("w-1", classes=classes)), AT)
        assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "sandbox_classes")
        assert says in refused.value.message
        assert worker.pending_events == [] and offered(worker) == {"gvisor": {"v1"}, "microvm": {"k1"}}
    # the same classes in another order are no change, and are stored sorted by class
    assert worker.register(request(registration("w-1", classes=two[::-1])), AT) is RegisterOutcome.UNCHANGED
    assert [e.sandbox_class for e in worker.sandbox_classes] == ["gvisor", "microvm"]


def test_the_registered_event_stores_the_normalised_classes():
    body = registration("w-1", classes=[
        {"sandbox_class": "microvm", "default_runtime": runtime("k1", order="reverse")},
        {"sandbox_class": "gvisor", "default_runtime": runtime("v2", order="reverse"),
         "restorable_runtimes": [runtime("v1", order="reverse"), runtime("v0")]}])
    worker = Worker("w-1")
    worker.register(request(body), AT)
    [event] = [e.body for e in worker.collect_events()]
    assert isinstance(event, WorkerRegistered)
    assert event.sandbox_classes == canonical_classes(request(body).sandbox_classes) != request(body).sandbox_classes


def test_a_label_change_alone_is_an_update_with_the_new_labels():
    worker = registered(registration("w-1", labels={"zone": "a"}))
    assert worker.register(request(registration("w-1", labels={"zone": "b"})), AT) is RegisterOutcome.UPDATED
    [updated] = [e.body for e in worker.collect_events()]
    assert updated.labels == {"zone": "b"} and worker.labels == {"zone": "b"}


def test_a_registration_without_a_revision_after_one_with_is_checked_for_nothing_and_writes_nothing():
    worker = registered(registration("w-1", revision=100))
    assert worker.register(request(registration("w-1")), AT) is RegisterOutcome.UNCHANGED
    assert worker.collect_events() == [] and worker.in_force == 100


@pytest.mark.parametrize("change", [
    registration("w-1", revision=200),  # the same content: WorkerUpdated
    registration("w-1", default=runtime("v2"), revision=200),  # RuntimeChanged
    registration("w-1", default=runtime("v2"), labels={"zone": "b"}, revision=200),  # both
    registration("w-1", labels={"zone": "b"}, revision=200),  # WorkerUpdated
])
def test_a_retry_is_answered_the_outcome_its_registration_was_first_answered(change):
    """The service answers a registration sent again under its request id from the events it recorded
    (`register_outcome`): the outcome must be the one the first answer gave, and the retry must be found."""
    worker = Worker("w-1")
    first = worker.register(request(registration("w-1", request_id="r-1", revision=100)), AT)
    assert register_outcome([e.body for e in worker.collect_events()]) is first is RegisterOutcome.REGISTERED
    body = request({**change, "request_id": "r-2"})
    outcome = worker.register(body, AT)
    assert register_outcome([e.body for e in worker.collect_events()]) is outcome
    assert register_outcome(worker.events_at(worker.prior("register", "r-2"))) is outcome  # no "used for another verb"
    assert register_outcome([]) is RegisterOutcome.UNCHANGED


def test_a_registration_refused_for_its_labels_size_records_nothing_of_its_runtime_change_either():
    """All or nothing: a RuntimeChanged that fits is not recorded when the WorkerUpdated of the same
    registration does not (the aggregate, which the store caches, stays as it was)."""
    from events.codec import encode
    from events.schema import WorkerUpdated
    from services.registry.domain import EVENT_HEADROOM
    worker = registered(registration("w-1"))
    labels = {f"k{i}": "v" * 63 for i in range(64)}
    body = request(registration("w-1", default=runtime("v2"), labels=labels))
    updated = WorkerUpdated(at=AT, worker_id="w-1", node=body.node, capacity=body.capacity, labels=labels)
    with pytest.raises(ContractError) as refused:
        worker.register(body, AT, max_payload=len(encode(updated)) + EVENT_HEADROOM - 1)
    assert refused.value.field == "labels"
    assert worker.pending_events == [] and offered(worker) == {"gvisor": {"v1"}} and worker.labels == {"zone": "a"}


# --- the registration in force: drains and removals ------------------------------------------------------------


def test_a_drain_names_the_registration_in_force_after_every_kind_of_change():
    worker = registered(registration("w-1", revision=100))
    steps = [(registration("w-1", default=runtime("v2"), revision=200), RegisterOutcome.RUNTIME_CHANGED),
             (registration("w-1", default=runtime("v2"), labels={"zone": "b"}, revision=300), RegisterOutcome.UPDATED)]
    for body, outcome in steps:
        before = worker.in_force
        assert worker.register(request(body), AT) is outcome
        worker.collect_events()
        assert worker.in_force == body["revision"]
        with pytest.raises(ContractError) as refused:  # the registration it replaced is no longer in force
            worker.drain("exit", AT, revision=before)
        assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "revision")
    for stale in (99, 100, 200):
        with pytest.raises(ContractError) as refused:
            worker.drain("exit", AT, revision=stale)
        assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "revision")
        assert worker.pending_events == [] and not worker.drained
    assert worker.drain("exit", AT, revision=300) is True and worker.drained
    # registered without a revision: nothing to tell registrations apart by, so drained
    plain = registered(registration("w-2"))
    assert plain.drain("exit", AT, revision=300) is True and plain.drained


def test_a_fresh_registration_is_the_one_in_force_for_a_drain():
    worker = registered(registration("w-1", revision=100))
    with pytest.raises(ContractError):
        worker.drain("exit", AT, revision=50)
    assert worker.in_force == 100


def test_drain_and_removal_of_a_worker_in_no_life_are_not_found_and_record_nothing():
    never = Worker("w-1")
    removed = registered(registration("w-2"))
    removed.remove("gone", AT)
    removed.collect_events()
    for worker in (never, removed):
        for act in (lambda w: w.drain("x", AT), lambda w: w.remove("x", AT), lambda w: w.remove("x", AT, revision=5)):
            with pytest.raises(ContractError) as refused:
                act(worker)
            assert refused.value.code is ErrorCode.NOT_FOUND and worker.pending_events == []


def test_a_removal_whose_revision_is_more_than_a_year_ahead_is_refused():
    from services.registry.domain import REVISION_AHEAD_MS
    worker = registered(registration("w-1", revision=100))
    ahead = int(AT.timestamp() * 1000) + REVISION_AHEAD_MS + 1
    with pytest.raises(ContractError) as refused:
        worker.remove("mine", AT, revision=ahead)
    assert (refused.value.code, refused.value.field) == (ErrorCode.INVALID_ARGUMENT, "revision")
    assert worker.alive and worker.pending_events == [] and worker.revision == 100


def test_a_registration_under_a_request_id_of_an_earlier_life_is_refused_in_the_next_one():
    """A copy of an earlier life's registration, decided late, would put that life's runtimes back
    on the next one: its request id names the earlier life (`WireAggregate.prior`)."""
    worker = Worker("w-1")
    worker.register(request(registration("w-1", request_id="r-1")), AT)
    assert worker.lose(AT)
    worker.register(request(registration("w-1", default=runtime("v2"), request_id="r-2")), AT)
    with pytest.raises(ContractError) as refused:
        worker.prior("register", "r-1")
    assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "request_id")
    assert worker.prior("register", "r-2")  # this life's own: answered again


def test_the_drain_in_force_names_its_own_event():
    """The service answers a heartbeat read from the history with the stream sequence of the drain in force
    (`RegistryStore.require_alive`: `seq_at(drain_in_force[0])`): that version must be the WorkerDrained's."""
    from events.schema import WorkerDrained
    worker = registered(registration("w-1"))
    worker.register(request(registration("w-1", labels={"zone": "b"})), AT)
    worker.drain("maintenance", AT)
    version, reason = worker.drain_in_force
    assert isinstance(worker.history[version - 1], WorkerDrained) and reason == "maintenance"
    assert version == worker.version


# --- node tokens: which disk of its node a worker registers from (rule 5's LOCAL images are on it) ----------


def with_token(body: dict, token: str | None, **changes) -> dict:
    return {**body, **changes, "node_token": token}


def test_a_registration_from_another_disk_of_the_node_ends_the_life_and_begins_a_new_one_undrained():
    body = registration("w-1")
    worker = registered(with_token(body, "disk-a", revision=1))
    worker.drain("cordoned", AT)
    worker.collect_events()
    assert worker.register(request(with_token(body, "disk-b", revision=2, request_id="r-2")), AT) \
        is RegisterOutcome.REGISTERED
    removed, began = [e.body for e in worker.collect_events()]
    assert isinstance(removed, WorkerRemoved) and removed.request_id is None
    assert "another disk of node" in removed.reason and body["node"] in removed.reason
    assert isinstance(began, WorkerRegistered) and began.node_token == "disk-b" and began.request_id == "r-2"
    assert worker.alive and worker.lives == 2 and not worker.drained and worker.node_token == "disk-b"
    # the same registration sent again is answered from the new life, which it began
    assert worker.prior("register", "r-2") == [worker.version]
    replayed = Worker("w-1")
    for event in worker.history:
        replayed.apply(event)
    assert (replayed.lives, replayed.node_token, replayed.drained) == (2, "disk-b", False)


def test_a_token_given_on_the_same_machine_updates_the_life_it_does_not_end_it():
    body = registration("w-1")
    worker = registered(with_token(body, None))
    assert worker.register(request(with_token(body, "disk-a")), AT) is RegisterOutcome.UPDATED
    [updated] = [e.body for e in worker.collect_events()]
    assert isinstance(updated, WorkerUpdated) and updated.node_token == "disk-a"
    assert worker.lives == 1 and worker.node_token == "disk-a"


@pytest.mark.parametrize("removed_between", [False, True])
def test_a_registration_without_a_token_of_a_worker_that_registered_one_is_refused(removed_between):
    """Its agent restarted without --node-token-file (on the machine that replaced the node's first, it would
    be taken as on that first disk): refused naming node_token, nothing written, in the same life or a later one."""
    body = registration("w-1")
    worker = registered(with_token(body, "disk-b"))
    if removed_between:
        worker.lose(AT)
        worker.collect_events()
    with pytest.raises(ContractError) as e:
        worker.register(request(with_token(body, None)), AT)
    assert (e.value.code, e.value.field) == (ErrorCode.FAILED_PRECONDITION, "node_token")
    assert "--node-token-file" in e.value.message
    assert worker.collect_events() == [] and worker.lives == 1
    replayed = Worker("w-1")
    for event in worker.history:
        replayed.apply(event)
    with pytest.raises(ContractError):
        replayed.register(request(with_token(body, None)), AT)


def test_the_same_token_again_writes_nothing_and_a_registered_token_is_in_the_event():
    body = with_token(registration("w-1"), "disk-a")
    worker = Worker("w-1")
    worker.register(request(body), AT)
    [began] = [e.body for e in worker.collect_events()]
    assert began.node_token == "disk-a"
    assert worker.register(request(body), AT) is RegisterOutcome.UNCHANGED
    assert worker.collect_events() == []


def test_an_equal_revision_naming_another_token_is_another_registration_and_refused():
    body = registration("w-1")
    worker = registered(with_token(body, "disk-a", revision=5))
    with pytest.raises(ContractError) as e:
        worker.register(request(with_token(body, "disk-b", revision=5)), AT)
    assert (e.value.code, e.value.field) == (ErrorCode.FAILED_PRECONDITION, "revision")
    assert worker.collect_events() == [] and worker.lives == 1


def test_a_new_life_from_another_disk_too_large_for_one_event_records_nothing():
    body = registration("w-1")
    worker = registered(with_token(body, "disk-a"))
    with pytest.raises(ContractError) as e:
        worker.register(request(with_token(body, "disk-b")), AT, max_payload=600)
    assert e.value.code is ErrorCode.INVALID_ARGUMENT
    assert worker.collect_events() == [] and (worker.alive, worker.lives, worker.node_token) == (True, 1, "disk-a")
