"""The Actor aggregate and the stamping rules, without a bus: decisions are pure."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import msgspec
import pytest

from events.errors import ContractError, life_started_in
from events.schema import (
    ActorCreated,
    ActorPlaced,
    ActorReleased,
    ActorReverted,
    ActorRuntime,
    ActorStatus,
    ActorStopped,
    CreateActor,
    ErrorCode,
    ID_PATTERN,
    Fidelity,
    ImageNamed,
    Location,
    ReleaseReason,
    Snapshot,
    SnapshotOrigin,
    SnapshotTaken,
    TagRecorded,
    TemplateChanged,
    UnderPlacement,
    WorkerRemoved,
)
from events.states import ActorState
from services.snapshotter.domain import Actor, Image, Tag, claims_id
from services.snapshotter.placements import PlacementFold, Release
from services.snapshotter.stamping import anothers_default_id, default_snapshot_id, initial_snapshot, stamp_from_pin
from tests import factories

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
V1, V2 = (factories.stamp(factories.version(build), name=f"runsc-{build}") for build in ("v1", "v2"))


def at(seconds: int = 0) -> datetime:
    return T0 + timedelta(seconds=seconds)


def create_request(actor_id: str = "a-1", **kw) -> CreateActor:
    return factories.actor(actor_id, cpu=500, mem=512, template="tpl-1", **kw)


def placed(actor: Actor, worker_id: str = "w-1", node: str = "n-1", pin: ActorRuntime = V1) -> ActorPlaced:
    return factories.placed(actor.entity_id, worker_id, pin, node=node, cpu=500, mem=512, at=at(1))


def created(actor_id: str = "a-1", **kw) -> Actor:
    actor = Actor(actor_id)
    actor.create(create_request(actor_id, **kw), None, at())
    return actor


def running(actor_id: str = "a-1", pin: ActorRuntime = V1, node: str = "n-1") -> Actor:
    actor = created(actor_id)
    actor.place(placed(actor, node=node, pin=pin))
    return actor


def bodies(actor: Actor) -> list:
    return [e.body for e in actor.collect_events()]


def code_of(excinfo) -> ErrorCode:
    return excinfo.value.code


def golden(stamp: ActorRuntime | None = V1) -> Snapshot:
    return factories.snapshot("template-actor", stamp, snapshot_id="golden-7", template="tpl-1", uri="s3://golden/7",
                              taken_at=at(-100))


# --- stamping rules ---------------------------------------------------------------


def test_pause_stamps_the_pin_makes_a_local_memory_snapshot_and_keeps_the_node():
    actor = running(pin=V1, node="n-9")
    actor.collect_events()
    snapshot = actor.pause(None, "r-1", at(5))
    assert snapshot.sandbox_runtime == V1
    assert (snapshot.location, snapshot.fidelity, snapshot.node) == (Location.LOCAL, Fidelity.MEMORY, "n-9")
    assert snapshot.taken_at == at(5) and snapshot.template_uid == "tpl-1"
    events = bodies(actor)
    assert [type(e) for e in events] == [SnapshotTaken, ActorReleased]
    assert events[0].origin is SnapshotOrigin.PAUSE and events[0].snapshot == snapshot
    assert events[1].reason is ReleaseReason.PAUSED and events[1].worker_id == "w-1"
    assert all(e.request_id == "r-1" for e in events)
    assert actor.state is ActorState.PAUSED and actor.node_pin == "n-9" and actor.assignment is None


def test_stamp_comes_from_the_assignment_never_from_anything_else():
    actor = running(pin=V1)
    assert stamp_from_pin(actor.assignment) == V1
    # The stamp functions take only the assignment: a worker's default cannot leak in.
    assert actor.pause(None, None, at(2)).sandbox_runtime == V1


@pytest.mark.parametrize("take", ["pause", "suspend"])
def test_an_actor_restored_through_an_edge_is_stamped_with_its_pin_not_the_version_that_matched(take):
    """Restored through an edge (v2's `compatible_versions` accepts v1: `matched_version` v1, the pin
    v2), the actor runs under v2, and its next image is stamped v2: a v1 stamp would send it to v1
    workers, which cannot load an image v2 wrote (CONTRACT, v1.1 edges). A mutation audit found only
    one random seed of a 44 s test telling the two apart."""
    actor = created()
    actor.place(msgspec.structs.replace(placed(actor, pin=V2), matched_version=V1.version))
    snapshot = actor.pause(None, None, at(2)) if take == "pause" else \
        actor.suspend(None, "s3://b/x", Fidelity.MEMORY, None, at(2))
    assert snapshot.sandbox_runtime == V2 != V1


def test_suspend_from_running_is_external_of_the_requested_fidelity_stamped_from_the_pin():
    actor = running(pin=V2)
    actor.collect_events()
    snapshot = actor.suspend("snap-x", "s3://b/x", Fidelity.VOLUMES, None, at(3))
    assert snapshot.sandbox_runtime == V2  # VOLUMES is stamped too, for the record
    assert (snapshot.snapshot_id, snapshot.location, snapshot.fidelity, snapshot.node, snapshot.uri) == (
        "snap-x", Location.EXTERNAL, Fidelity.VOLUMES, None, "s3://b/x")
    events = bodies(actor)
    assert [type(e) for e in events] == [SnapshotTaken, ActorReleased]
    assert events[0].origin is SnapshotOrigin.SUSPEND
    assert events[1].reason is ReleaseReason.SUSPENDED
    assert actor.state is ActorState.SUSPENDED and actor.node_pin is None


def test_suspend_from_paused_promotes_the_local_snapshot_keeping_its_stamp_and_image():
    actor = running(pin=V1, node="n-3")
    local = actor.pause(None, None, at(5))
    actor.collect_events()
    promoted = actor.suspend(None, "s3://b/p", Fidelity.MEMORY, None, at(50))
    assert promoted.sandbox_runtime == V1
    assert promoted.snapshot_id == local.snapshot_id and promoted.taken_at == local.taken_at
    assert (promoted.location, promoted.node, promoted.uri) == (Location.EXTERNAL, None, "s3://b/p")
    events = bodies(actor)
    assert [type(e) for e in events] == [SnapshotTaken]  # nothing held, nothing released
    assert events[0].origin is SnapshotOrigin.PROMOTE
    assert actor.state is ActorState.SUSPENDED and actor.node_pin is None


def test_rolling_upgrade_actor_started_on_v1_stays_v1_and_a_new_placement_gets_its_own_pin():
    old = running("old", pin=V1)  # placed before the worker's default moved to v2
    fresh = running("fresh", pin=V2)  # placed after: the scheduler pinned the new default
    assert old.pause(None, None, at(9)).sandbox_runtime == V1
    assert old.suspend(None, None, Fidelity.MEMORY, None, at(10)).sandbox_runtime == V1
    assert fresh.pause(None, None, at(9)).sandbox_runtime == V2


def test_default_snapshot_id_is_deterministic_unique_per_version_and_a_valid_id():
    assert default_snapshot_id("a-1", 4) == "a-1-v4"
    long_a, long_b = "a" * 127 + "x", "a" * 127 + "y"
    ids = {default_snapshot_id(long_a, 4), default_snapshot_id(long_b, 4), default_snapshot_id(long_a, 5)}
    assert len(ids) == 3 and all(len(i) <= 128 for i in ids)
    assert default_snapshot_id(long_a, 4) == default_snapshot_id(long_a, 4)
    actor = running()
    snapshot = actor.pause(None, None, at(1))
    assert snapshot.snapshot_id == f"a-1-v{actor.version - 1}"  # the SnapshotTaken's version



@pytest.mark.parametrize("length", [120, 124, 125, 126, 128])
def test_no_actors_default_snapshot_id_is_another_actors(length):
    """A default id that would reach 128 characters is shortened, with a digest of the actor id, to
    exactly 128. Its stem, `<prefix>-<digest>`, is itself a valid actor id, whose plain default was
    the same string: two actors' images under one id (found by a review). A plain default is now
    at most 127 characters; and an id of the stem actor's in that form is another actor's."""
    long_actor = "L" * length
    for version in (9, 10, 1234):
        for step in (0, 2):
            shortened = default_snapshot_id(long_actor, version, step)
            assert len(shortened) <= 128 and re.fullmatch(ID_PATTERN, shortened)
            suffix = shortened[shortened.rindex("-v"):]
            stem = shortened[: -len(suffix)]
            if stem == long_actor:
                continue  # not shortened
            assert default_snapshot_id(stem, version, step) != shortened
            assert anothers_default_id(stem, shortened)
            assert not anothers_default_id(long_actor, shortened)

def test_an_id_the_actors_history_holds_is_its_own_whatever_rule_made_it(monkeypatch):
    """A log written before the default ids changed holds an actor's plain default of exactly 128
    characters, which the rule now would give another actor's shortened form: the actor's own image
    under it is still its own (a create anew from it as a golden image again is taken), and another
    image under it is refused as a reuse of the id."""
    actor_id = "L" * 125
    old_default = actor_id + "-v9"  # as the rule before b5b960f made it
    assert anothers_default_id(actor_id, old_default)
    image = factories.golden(V1, snapshot_id=old_default, template="tpl-1")
    import services.snapshotter.domain as domain

    with monkeypatch.context() as then:  # recorded then, by the code before the rule
        then.setattr(domain, "anothers_default_id", lambda actor_id, snapshot_id: False)
        actor = created(actor_id, golden_snapshot=image)
    actor.stop(None, at(2))
    actor.collect_events()
    actor.create(create_request(actor_id, golden_snapshot=image), None, at(3))
    actor.stop(None, at(4))
    other = factories.golden(V2, snapshot_id=old_default, template="tpl-1")
    with pytest.raises(ContractError) as error:
        actor.create(create_request(actor_id, golden_snapshot=other), None, at(5))
    assert (error.value.code, error.value.field) == (ErrorCode.FAILED_PRECONDITION, "golden_snapshot.snapshot_id")

def test_tag_copies_the_latest_snapshot_with_its_stamp_onto_the_actor_and_the_tag():
    actor = running(pin=V1)
    snapshot = actor.suspend(None, "s3://x", Fidelity.MEMORY, None, at(2))
    actor.collect_events()
    tag = Tag("release-1")
    copy, recorded_now = actor.tag(tag, "r-9", at(3))
    assert copy == snapshot and copy.sandbox_runtime == V1 and recorded_now
    (taken,) = bodies(actor)
    assert taken.origin is SnapshotOrigin.TAG and taken.snapshot == snapshot
    (recorded,) = bodies(tag)
    assert isinstance(recorded, TagRecorded) and recorded.tag == "release-1" and recorded.snapshot == snapshot
    assert tag.snapshot == snapshot and actor.latest_snapshot == snapshot
    # the tag names that snapshot already: nothing recorded (a re-tag wrote two events each time)
    assert actor.tag(tag, "r-10", at(4)) == (snapshot, False)
    assert bodies(actor) == [] and bodies(tag) == []
    actor.place(placed(actor))
    newer = actor.suspend(None, "s3://y", Fidelity.MEMORY, None, at(5))
    actor.collect_events()
    assert actor.tag(tag, "r-11", at(6)) == (newer, True) and tag.snapshot == newer  # moved to the newer one


def test_create_from_a_tag_keeps_the_stamp_and_makes_the_copy_the_new_actors():
    source = running("src", pin=V1)
    snapshot = source.suspend(None, "s3://x", Fidelity.MEMORY, None, at(2))
    actor = Actor("a-2")
    actor.create(create_request("a-2", source_tag="t"), snapshot, at(4))
    events = bodies(actor)
    assert [type(e) for e in events] == [ActorCreated, SnapshotTaken]
    first = events[0].snapshot
    assert first == events[1].snapshot and events[1].origin is SnapshotOrigin.CREATE
    assert first.sandbox_runtime == V1 and first.actor_id == "a-2" and first.borrowed is False
    assert msgspec.structs.replace(first, actor_id="src") == snapshot
    assert actor.state is ActorState.CREATED and actor.latest_snapshot == first


def test_create_from_golden_keeps_the_stamp_and_is_borrowed_until_the_first_suspend():
    actor = created("a-3", golden_snapshot=golden(V2))
    assert actor.latest_snapshot.borrowed is True and actor.latest_snapshot.sandbox_runtime == V2
    assert actor.latest_snapshot.actor_id == "a-3" and actor.latest_snapshot.snapshot_id == "golden-7"
    actor.place(placed(actor, pin=V2))
    assert actor.pause(None, None, at(3)).borrowed is True  # no volumes of its own yet
    assert actor.suspend(None, "s3://own", Fidelity.VOLUMES, None, at(4)).borrowed is False
    actor.place(placed(actor, pin=V2))
    assert actor.pause(None, None, at(6)).borrowed is False


def test_initial_snapshot_without_a_source_is_none():
    assert initial_snapshot("a", None, None) is None
    assert bodies(created())[0].snapshot is None


# --- transitions and refusals ----------------------------------------------------------


def test_create_twice_is_already_exists_and_from_an_unknown_tag_not_found():
    actor = created()
    with pytest.raises(ContractError) as e:
        actor.create(create_request(), None, at())
    assert code_of(e) is ErrorCode.ALREADY_EXISTS
    with pytest.raises(ContractError) as e:
        Actor("a-9").create(create_request("a-9", source_tag="nope"), None, at())
    assert code_of(e) is ErrorCode.NOT_FOUND and e.value.field == "source_tag"


@pytest.mark.parametrize("verb", ["pause", "suspend", "tag", "update", "stop"])
def test_unknown_actor_is_not_found(verb):
    actor = Actor("ghost")
    calls = {
        "pause": lambda: actor.pause(None, None, at()),
        "suspend": lambda: actor.suspend(None, None, Fidelity.MEMORY, None, at()),
        "tag": lambda: actor.tag(Tag("t"), None, at()),
        "update": lambda: actor.change_template("tpl-2", None, at()),
        "stop": lambda: actor.stop(None, at()),
    }
    with pytest.raises(ContractError) as e:
        calls[verb]()
    assert code_of(e) is ErrorCode.NOT_FOUND
    assert actor.pending_events == []


def states() -> dict[str, Actor]:
    paused = running("p")
    paused.pause(None, None, at(1))
    suspended = running("s")
    suspended.suspend(None, None, Fidelity.ROOTFS, None, at(1))
    stopped = created("x")
    stopped.stop(None, at(1))
    for actor in (paused, suspended, stopped):
        actor.collect_events()
    return {"CREATED": created("c"), "PAUSED": paused, "SUSPENDED": suspended, "STOPPED": stopped}


ILLEGAL = [
    ("pause", "CREATED"), ("pause", "PAUSED"), ("pause", "SUSPENDED"), ("pause", "STOPPED"),
    ("suspend", "CREATED"), ("suspend", "SUSPENDED"), ("suspend", "STOPPED"),
    ("tag", "CREATED"), ("tag", "STOPPED"), ("update", "STOPPED"), ("stop", "STOPPED"),
]


@pytest.mark.parametrize("verb,state", ILLEGAL)
def test_illegal_transitions_are_failed_precondition_and_record_nothing(verb, state):
    actor = states()[state]
    actor.collect_events()
    version = actor.version
    calls = {
        "pause": lambda: actor.pause(None, None, at(9)),
        "suspend": lambda: actor.suspend(None, None, Fidelity.MEMORY, None, at(9)),
        "tag": lambda: actor.tag(Tag("t"), None, at(9)),
        "update": lambda: actor.change_template("tpl-2", None, at(9)),
        "stop": lambda: actor.stop(None, at(9)),
    }
    with pytest.raises(ContractError) as e:
        calls[verb]()
    assert code_of(e) is ErrorCode.FAILED_PRECONDITION
    endpoint = {"update": "update-template"}.get(verb, verb)  # the endpoint's name, not the verb's phrase
    said = "it has no snapshot yet" if (verb, state) == ("tag", "CREATED") else f"it is {state}, {endpoint} needs "
    assert said in e.value.message, e.value.message
    assert actor.pending_events == [] and actor.version == version


def test_resume_rules_running_and_stopped_refuse_and_paused_only_on_its_node():
    actor = running()
    with pytest.raises(ContractError) as e:
        actor.place(placed(actor))
    assert code_of(e) is ErrorCode.FAILED_PRECONDITION
    actor.pause(None, None, at(2))
    with pytest.raises(ContractError) as e:
        actor.place(placed(actor, node="elsewhere"))
    assert code_of(e) is ErrorCode.FAILED_PRECONDITION
    actor.place(placed(actor, node="n-1"))
    assert actor.state is ActorState.RUNNING and actor.node_pin is None


def test_update_template_records_once_and_a_running_instance_keeps_its_template():
    actor = running()
    actor.collect_events()
    assert actor.change_template("tpl-2", "r", at(2)) is True
    (event,) = bodies(actor)
    assert isinstance(event, TemplateChanged) and event.template_uid == "tpl-2"
    assert actor.change_template("tpl-2", "r2", at(3)) is False and bodies(actor) == []
    # The running instance was started from tpl-1: its snapshot says so.
    assert actor.pause(None, None, at(4)).template_uid == "tpl-1"
    actor.place(placed(actor))
    assert actor.pause(None, None, at(5)).template_uid == "tpl-2"


def test_stop_releases_what_it_holds_then_stops():
    actor = running()
    actor.collect_events()
    actor.stop("r", at(2))
    events = bodies(actor)
    assert [type(e) for e in events] == [ActorReleased, ActorStopped]
    assert events[0].reason is ReleaseReason.STOPPED and events[0].worker_id == "w-1"
    assert actor.state is ActorState.STOPPED and actor.assignment is None
    paused = running("p")
    paused.pause(None, None, at(1))
    paused.collect_events()
    paused.stop(None, at(2))
    assert [type(e) for e in bodies(paused)] == [ActorStopped]
    assert paused.node_pin is None


def test_release_from_removed_worker_only_ends_the_placement_it_names():
    actor = running()
    placed_version = actor.assignment_version
    actor.collect_events()
    assert actor.release_from_removed_worker("w-other", placed_version, at(2)) is False
    assert actor.release_from_removed_worker("w-1", placed_version + 7, at(2)) is False
    assert actor.release_from_removed_worker("w-1", placed_version, at(2)) is True
    (event,) = bodies(actor)
    assert event.reason is ReleaseReason.WORKER_REMOVED and event.worker_id == "w-1"
    assert actor.state is ActorState.SUSPENDED
    assert actor.release_from_removed_worker("w-1", placed_version, at(3)) is False  # once


def test_replaying_the_history_rebuilds_the_same_state():
    actor = running(pin=V1)
    actor.pause(None, None, at(2))
    actor.suspend(None, "s3://x", Fidelity.MEMORY, None, at(3))
    events = actor.collect_events()
    replayed = None
    for event in events:
        replayed = event.mutate(replayed)
    assert replayed.state is actor.state and replayed.latest_snapshot == actor.latest_snapshot
    assert replayed.version == actor.version


def test_status_names_the_current_life_s_creation_and_its_last_placement():
    """`Actor.status` (the snapshotter's `status` answer, what the CLI's and the client's fences
    name): the current life's ActorCreated, its last ActorPlaced (a PAUSED actor's is the one its
    pause ended, which `require_placement` takes), none in a life not placed yet (the last life's
    does not count); the actor's last event; its latest snapshot. Read from the stream sequences its history was read
    with; unknown ones (not stored) are UNAVAILABLE, a never created actor NOT_FOUND."""
    actor = created()
    actor.place(placed(actor, worker_id="w-1"))
    actor.pause(None, None, at(2))
    actor.place(placed(actor, worker_id="w-2", node="n-1"))
    actor.stop(None, at(3))
    actor.create(create_request(), None, at(4))
    history = actor.collect_events()

    def read_at(count: int) -> Actor:  # the first `count` events, as read from the log at 10, 20, ...
        replayed = None
        for event in history[:count]:
            event.seq = 10 * event.originator_version
            replayed = event.mutate(replayed)
        return replayed

    types = [type(e.body).__name__ for e in history]
    placements = [i + 1 for i, t in enumerate(types) if t == "ActorPlaced"]
    pause_ended = types.index("ActorReleased") + 1
    reborn = len(types)
    assert types[0] == types[-1] == "ActorCreated" and len(placements) == 2
    steps = [(1, ActorState.CREATED, 10, None), (placements[0], ActorState.RUNNING, 10, 10 * placements[0]),
             (pause_ended, ActorState.PAUSED, 10, 10 * placements[0]),
             (placements[1], ActorState.RUNNING, 10, 10 * placements[1]),
             (reborn - 1, ActorState.STOPPED, 10, 10 * placements[1]),
             (reborn, ActorState.CREATED, 10 * reborn, None)]
    for count, state, life, placement in steps:
        read = read_at(count)
        assert read.status() == ActorStatus(state=state, life_seq=life, placement_seq=placement, seq=10 * count,
                                            snapshot=read.latest_snapshot), (count, types[:count])
    paused = read_at(pause_ended).status().snapshot  # and its latest snapshot: the one its pause took
    assert paused is not None and paused == history[pause_ended - 2].body.snapshot
    with pytest.raises(ContractError) as unknown:
        created().status()  # recorded, not stored: no sequence
    assert code_of(unknown) is ErrorCode.UNAVAILABLE
    with pytest.raises(ContractError) as never:
        Actor("a-9").status()
    assert (code_of(never), never.value.field) == (ErrorCode.NOT_FOUND, "actor_id")


def stored(actor: Actor) -> Actor:
    """`actor` as read back from a log that stored its events at sequences 10, 20, 30, ..."""
    replayed = None
    for event in actor.collect_events():
        event.seq = 10 * event.originator_version
        replayed = event.mutate(replayed)
    return replayed


LIFE_VERBS = {  # each verb that names the actor's life, on an actor it applies to
    "stop": lambda a, life: a.stop(None, at(9), life),
    "tag": lambda a, life: a.tag(Tag("gold"), None, at(9), life),
    "update-template": lambda a, life: a.change_template("tpl-2", None, at(9), life),
    "revert": lambda a, life: a.revert(None, None, at(9), life),
}


@pytest.mark.parametrize("verb", LIFE_VERBS)
def test_a_stop_tag_revert_or_update_template_naming_an_ended_life_is_refused(verb):
    """`life_seq` on a stop, tag, revert or update-template (a project addition): a sequence of the
    actor's life the request is for. Naming a life that a creation since ended (a copy held in a
    NATS server and decided late, its caller gone) is FAILED_PRECONDITION, field life_seq, nothing
    recorded, the message naming the creation; naming the current life, or any sequence in it, or
    none, the request is decided as before."""
    def in_life_2() -> Actor:  # life 1 created at 10, stopped; life 2 created, placed, suspended (paused)
        actor = created()
        actor.stop(None, at(1))
        actor.create(create_request(), None, at(2))
        actor.place(placed(actor))
        actor.suspend(None, "s3://a-1", Fidelity.MEMORY, None, at(3))  # an EXTERNAL image to tag
        if verb != "tag":
            actor.place(placed(actor))
            actor.pause(None, None, at(4))  # a LOCAL one to revert
        return stored(actor)

    actor = in_life_2()
    reborn = actor.seq_at(actor.life_start)
    assert reborn == 30 and actor.state is (ActorState.SUSPENDED if verb == "tag" else ActorState.PAUSED)
    with pytest.raises(ContractError) as refused:
        LIFE_VERBS[verb](actor, 10)
    assert (code_of(refused), refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "life_seq")
    assert refused.value.message.startswith(f"actor 'a-1' was created anew at sequence 30, after the life this {verb} "
                                            "names (life_seq 10): nothing "), refused.value.message
    assert life_started_in(refused.value) == 30 and actor.collect_events() == []
    for life in (None, reborn, reborn + 5):
        fresh = in_life_2()
        LIFE_VERBS[verb](fresh, life)
        assert fresh.collect_events(), (verb, life)


UNDER = {  # a pause, or a suspend (from RUNNING and from PAUSED), naming what it was taken under
    "pause": lambda a, under: a.pause(None, None, at(9), under),
    "suspend": lambda a, under: a.suspend(None, "s3://a-1", Fidelity.MEMORY, None, at(9), under),
    "promote": lambda a, under: a.suspend(None, "s3://a-1", Fidelity.MEMORY, None, at(9), under),
}


@pytest.mark.parametrize("verb", UNDER)
def test_a_pause_or_suspend_naming_another_worker_or_pin_at_its_placement_s_sequence_is_refused(verb):
    """`placement_worker_id`, `placement_node` and `placement_runtime` beside `placement_seq` (a project
    addition): the worker, node and pin of the Assignment the image was taken under. A log rolled back
    past that placement and written again holds another placement at its sequence: naming its worker,
    its node (the worker id registered on another node) or its pin (by stamp: the pin's name takes no
    part) otherwise is FAILED_PRECONDITION on that field, nothing recorded, the message naming both;
    the placement's own worker, node and pin, or none, are recorded as before; a PAUSED actor's is the
    placement its pause ended."""
    def placed_at_20() -> Actor:  # created at 10, placed on w-1 under V1 at 20 (then paused at 30, 40)
        actor = created()
        actor.place(placed(actor, pin=V1))
        if verb == "promote":
            actor.pause(None, None, at(2))
        return stored(actor)

    other_name = msgspec.structs.replace(V1, name="another-name")  # the same stamp
    found = {"placement_worker_id": "worker 'w-1'", "placement_node": "node 'n-1'",
             "placement_runtime": "runtime gvisor v1 architecture=amd64"}
    for worker_id, node, runtime, field in (
            ("w-2", None, None, "placement_worker_id"), (None, None, V2, "placement_runtime"),
            ("w-2", "n-1", V2, "placement_worker_id"), ("w-1", "n-1", V2, "placement_runtime"),
            ("w-1", "n-2", V1, "placement_node"),  # the worker id registered on another node (a review's finding)
            (None, "n-2", None, "placement_node")):
        actor = placed_at_20()
        named = UnderPlacement(placement_seq=20, placement_worker_id=worker_id, placement_node=node,
                               placement_runtime=runtime)
        with pytest.raises(ContractError) as refused:
            UNDER[verb](actor, named)
        assert (code_of(refused), refused.value.field) == (ErrorCode.FAILED_PRECONDITION, field), named
        assert f"the placement recorded there is on {found[field]}" in refused.value.message, refused.value.message
        assert "nothing recorded" in refused.value.message and actor.collect_events() == []
    for worker_id, node, runtime in (("w-1", "n-1", V1), ("w-1", None, None), (None, "n-1", other_name),
                                     (None, None, None)):
        for seq in (20, 21):  # the ActorPlaced's, or its booking marker's
            actor = placed_at_20()
            snapshot = UNDER[verb](actor, UnderPlacement(placement_seq=seq, placement_worker_id=worker_id,
                                                         placement_node=node, placement_runtime=runtime))
            assert snapshot.sandbox_runtime == V1 and actor.collect_events(), (worker_id, node, runtime, seq)


# --- the placement fold ----------------------------------------------------------------


def worker_removed(worker_id: str) -> WorkerRemoved:
    return WorkerRemoved(worker_id=worker_id, reason="LOST", at=at(10))


def test_fold_releases_every_actor_on_a_removed_worker_once():
    fold = PlacementFold()
    a, b, c = running("a"), running("b"), running("c")
    assert fold.apply(2, placed(a, worker_id="w-1")) == []
    assert fold.apply(2, placed(b, worker_id="w-1")) == []
    assert fold.apply(2, placed(c, worker_id="w-2")) == []
    assert fold.apply(3, ActorReleased(actor_id="b", worker_id="w-1", reason=ReleaseReason.PAUSED, at=at(4))) == []
    assert fold.apply(5, placed(b, worker_id="w-1")) == []
    assert fold.apply(1, worker_removed("w-1")) == [Release("a", "w-1", 2), Release("b", "w-1", 5)]
    assert fold.apply(2, worker_removed("w-1")) == []
    assert fold.placed_on("w-2") == {"c": 2}


def test_fold_releases_a_placement_on_an_already_removed_worker_until_it_registers_again():
    fold = PlacementFold()
    fold.apply(1, worker_removed("w-1"))
    a = running("a")
    assert fold.apply(2, placed(a, worker_id="w-1")) == [Release("a", "w-1", 2)]
    registered = factories.registered("w-1", node="n-1", cpu=1000, mem=1024, at=at(20))
    fold.apply(2, registered)
    assert fold.apply(4, placed(a, worker_id="w-1")) == []
    assert fold.placed_on("w-1") == {"a": 4}


def test_fold_forgets_stopped_actors():
    fold = PlacementFold()
    fold.apply(2, placed(running("a")))
    fold.apply(4, ActorStopped(actor_id="a", at=at(3)))
    assert fold.apply(1, worker_removed("w-1")) == []


def test_fold_holds_each_removed_placement_until_the_log_ends_it():
    """`unreleased`: what the worker-removal process must still release (its release may be left,
    the actor's history unreadable); it ends with a release, a stop, or a placement anew."""
    fold = PlacementFold()
    for actor_id in ("a", "b", "c"):
        fold.apply(2, placed(running(actor_id), worker_id="w-1"))
    fold.apply(1, worker_removed("w-1"))
    assert {k: v[0] for k, v in fold.unreleased.items()} == {
        "a": Release("a", "w-1", 2), "b": Release("b", "w-1", 2), "c": Release("c", "w-1", 2)}
    assert fold.unreleased["a"][1] == at(10)  # the removal's time: every replica releases alike
    fold.apply(3, ActorReleased(actor_id="a", worker_id="w-1", reason=ReleaseReason.WORKER_REMOVED, at=at(10)))
    fold.apply(3, ActorStopped(actor_id="b", at=at(11)))
    assert set(fold.unreleased) == {"c"}
    fold.apply(4, placed(running("d"), worker_id="w-1"))  # on the removed worker: to release too
    assert set(fold.unreleased) == {"c", "d"}
    fold.apply(3, placed(running("c"), worker_id="w-2"))  # placed anew elsewhere: its old placement ended
    assert set(fold.unreleased) == {"d"}


def test_create_from_a_tag_of_another_class_is_failed_precondition():
    source = running("src", pin=V1)
    snapshot = source.suspend(None, "s3://x", Fidelity.MEMORY, None, at(2))
    request = msgspec.structs.replace(create_request("a-5", source_tag="t"), sandbox_class="microvm")
    actor = Actor("a-5")
    with pytest.raises(ContractError) as e:
        actor.create(request, snapshot, at(3))
    assert code_of(e) is ErrorCode.FAILED_PRECONDITION and e.value.field == "source_tag"
    assert actor.pending_events == []


def test_a_placement_ended_at_the_first_removal_of_its_worker_after_it():
    from services.snapshotter.placements import removed_since

    history = [(3, "WorkerRegistered"), (5, "RuntimeChanged"), (7, "WorkerRemoved"), (9, "WorkerRegistered"),
               (12, "WorkerRemoved")]
    assert removed_since(history, 4) == 7  # re-registered since: the placement still ended at 7
    assert removed_since(history, 7) == 12  # placed after the first removal: ended at the second
    assert removed_since(history, 8) == 12
    assert removed_since(history, 12) == 0
    assert removed_since([], 0) == 0


def test_a_snapshot_id_names_one_image_and_the_default_steps_aside_for_a_callers():
    """One id, one image (a worker finds an image by its id): an id any snapshot of the actor had
    is refused for another (FAILED_PRECONDITION, field snapshot_id); a promote keeps its own; a
    default id a caller took is stepped past, within the id's 128 characters."""
    actor = running()
    actor.pause("p-1", None, at(1))
    actor.place(placed(actor))
    with pytest.raises(ContractError) as refused:
        actor.pause("p-1", None, at(2))
    assert (code_of(refused), refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "snapshot_id")
    nxt = default_snapshot_id("a-1", actor.version + 1 + 2 + 1)  # after a pause (2 events) and a placement
    actor.pause(nxt, None, at(3))
    actor.place(placed(actor))
    assert actor.pause(None, None, at(4)).snapshot_id == f"{nxt}-1"
    assert actor.suspend(None, "s3://x", Fidelity.MEMORY, None, at(5)).snapshot_id == f"{nxt}-1"  # promoted: kept
    long_id = "a" * 128
    assert len(default_snapshot_id(long_id, 1234, 7)) <= 128 and default_snapshot_id(long_id, 1234, 7).endswith("-v1234-7")


# --- what a snapshot id names across actors (`Image`) ---------------------------------------------


def image_of(actor_id: str, snapshot_id: str = "img", **kw) -> Snapshot:
    return factories.snapshot(actor_id, V1, snapshot_id=snapshot_id, **kw)


def named(*snapshots: Snapshot) -> Image:
    image = Image(snapshots[0].snapshot_id)
    for snapshot in snapshots:
        image.name(snapshot, "snapshot_id", None, at())
    image.pending_events.clear()  # as read from the log
    return image


@pytest.mark.parametrize("held, new, recorded", [
    ((), image_of("a-1", node="n-1"), True),  # a free id: named
    ((image_of("a-1", node="n-1"),), image_of("a-1", node="n-1"), False),  # the same record again
    ((image_of("a-1", node="n-1"),), image_of("a-1", uri="s3://b/img"), True),  # a promote: EXTERNAL now
    ((image_of("a-1", uri="s3://b/img"),),  # another actor's copy of one EXTERNAL image (a tag's, a golden's)
     image_of("b-1", uri="s3://b/img", borrowed=True, taken_at=at(9)), False),
])
def test_an_image_id_is_named_once_per_image(held, new, recorded):
    image = named(*held) if held else Image(new.snapshot_id)
    image.name(new, "snapshot_id", "r-1", at(5))
    events = [e.body for e in image.pending_events]
    assert events == ([ImageNamed(snapshot=new, at=at(5), request_id="r-1")] if recorded else [])


@pytest.mark.parametrize("held, new, says", [
    (image_of("a-1", node="n-1"), image_of("b-1", node="n-1"), "LOCAL on node 'n-1', MEMORY"),  # the walkthrough's
    (image_of("a-1", node="n-1"), image_of("b-1", uri="s3://b/img"), "LOCAL on node 'n-1', MEMORY"),
    (image_of("a-1", uri="s3://b/img"), image_of("b-1", uri="s3://b/other"), "EXTERNAL, MEMORY"),
    (image_of("a-1", uri="s3://b/img"), image_of("b-1", uri="s3://b/img", fidelity=Fidelity.VOLUMES),
     "EXTERNAL, MEMORY"),
    (image_of("a-1", uri="s3://b/img"), factories.snapshot("b-1", V2, snapshot_id="img", uri="s3://b/img"),
     "EXTERNAL, MEMORY"),  # the same uri under another stamp is another image
])
def test_another_actor_s_other_image_under_the_id_is_refused_and_nothing_recorded(held, new, says):
    image = named(held)
    with pytest.raises(ContractError) as refused:
        image.name(new, "golden_snapshot.snapshot_id", None, at(5))
    assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "golden_snapshot.snapshot_id")
    assert f"already names an image of actor 'a-1' ({says})" in refused.value.message
    assert image.pending_events == []


@pytest.mark.parametrize("snapshot_id, checked", [
    ("img", True), ("a-1-v0", True), ("a-1-v07", True), ("golden-2026", True),  # no default takes these
    ("a-1-v3", False), ("a-1-v3-2", False), ("anyone-v12", False),  # the default form: one actor's alone
])
def test_only_ids_no_default_takes_are_checked_across_actors(snapshot_id, checked):
    assert claims_id(image_of("a-1", snapshot_id).snapshot_id) == (snapshot_id if checked else None)
    assert claims_id(None) is None


def test_a_create_copying_an_id_an_earlier_life_gave_another_image_is_refused():
    """The actor's own check of a create's image (`Actor._one_image`), for a log in which another
    actor could still take an id this one had used (written before ids were checked across actors):
    a's first life paused under `img`; a created anew from a tag whose snapshot is another `img`
    is refused, FAILED_PRECONDITION on `source_tag`, nothing recorded; one of another id is taken."""
    actor = running("a")
    actor.pause("img", None, at(1))
    actor.stop(None, at(2))
    actor.collect_events()
    other = factories.snapshot("b", V1, snapshot_id="img", uri="s3://b/img")
    with pytest.raises(ContractError) as refused:
        actor.create(create_request("a", source_tag="t"), other, at(3))
    assert (code_of(refused), refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "source_tag")
    assert "already names another snapshot of actor 'a'" in refused.value.message
    assert actor.collect_events() == []
    actor.create(create_request("a", source_tag="t"), msgspec.structs.replace(other, snapshot_id="img-2"), at(4))
    assert actor.latest_snapshot.snapshot_id == "img-2"


# --- gaps a mutation campaign of this module found (each test fails on the mutant it names) ---------


def test_a_local_image_is_never_tagged_nor_created_from():
    """A tag is for other actors on any node, and a LOCAL image is on one node only: tagging an actor
    whose latest snapshot is LOCAL is FAILED_PRECONDITION, nothing recorded on the actor or the tag,
    in PAUSED and in SUSPENDED (its worker removed after a resume from a pause, the pause's image still
    its latest); and a create from a tag written before v1.1 that names a LOCAL image is refused on
    `source_tag`, nothing recorded. (Mutants: either refusal dropped, and every test passed.)"""
    paused = running("p", node="n-4")
    paused.pause("p-img", None, at(1))
    suspended = running("s", node="n-5")
    suspended.pause("s-img", None, at(1))
    suspended.place(placed(suspended, node="n-5"))
    assert suspended.release_from_removed_worker("w-1", suspended.assignment_version, at(2))
    assert suspended.state is ActorState.SUSPENDED and suspended.latest_snapshot.location is Location.LOCAL
    for actor, node in ((paused, "n-4"), (suspended, "n-5")):
        actor.collect_events()
        tag = Tag("gold")
        with pytest.raises(ContractError) as refused:
            actor.tag(tag, None, at(3))
        assert code_of(refused) is ErrorCode.FAILED_PRECONDITION
        assert f"is LOCAL on node {node!r}" in refused.value.message, refused.value.message
        assert actor.collect_events() == [] and tag.collect_events() == [] and tag.snapshot is None
    local = paused.latest_snapshot  # as a tag written before v1.1 named it
    fresh = Actor("a-2")
    with pytest.raises(ContractError) as refused:
        fresh.create(create_request("a-2", source_tag="old"), local, at(4))
    assert (code_of(refused), refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "source_tag")
    assert "names the LOCAL snapshot 'p-img' on node 'n-4'" in refused.value.message, refused.value.message
    assert fresh.collect_events() == [] and fresh.state is None


@pytest.mark.parametrize("verb", UNDER)
def test_a_pause_or_suspend_naming_a_sequence_beside_its_placement_s_two_is_refused(verb):
    """The image a pause or suspend records was taken under the placement its `placement_seq` names: the
    ActorPlaced's sequence or its booking marker's, the one after, and no other. A sequence just before
    or just after those two names no placement of this actor's (in a log rolled back and written again,
    it may have been another one's): FAILED_PRECONDITION on `placement_seq`, nothing recorded, rather
    than the image stamped with this placement's pin and node. (Mutants: the window widened to
    placed-1 or placed+2, and every test passed.)"""
    def placed_at_20() -> Actor:  # created at 10, placed at 20 (its marker would be 21; paused at 30, 40)
        actor = created()
        actor.place(placed(actor, pin=V1))
        if verb == "promote":
            actor.pause(None, None, at(2))
        return stored(actor)

    for seq in (19, 22):
        actor = placed_at_20()
        with pytest.raises(ContractError) as refused:
            UNDER[verb](actor, UnderPlacement(placement_seq=seq))
        assert (code_of(refused), refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "placement_seq"), seq
        assert f"taken under the placement at sequence {seq}" in refused.value.message
        assert actor.collect_events() == []
    for seq in (20, 21):
        assert UNDER[verb](placed_at_20(), UnderPlacement(placement_seq=seq)).sandbox_runtime == V1


def test_a_pause_naming_its_placement_when_the_store_gave_no_positions_is_unavailable():
    """Where the event store did not say at which sequence the actor's placement is, a pause naming a
    `placement_seq` cannot be checked: UNAVAILABLE (try again), nothing recorded; not FAILED_PRECONDITION
    saying the placed actor "has never been placed". (Mutant: that UNAVAILABLE dropped.)"""
    actor = running()  # recorded, not read back from a store: no sequences
    actor.collect_events()
    with pytest.raises(ContractError) as refused:
        actor.pause(None, None, at(2), UnderPlacement(placement_seq=20))
    assert code_of(refused) is ErrorCode.UNAVAILABLE, refused.value.message
    assert actor.collect_events() == [] and actor.state is ActorState.RUNNING


def test_a_placement_of_another_actor_is_never_recorded_on_this_one():
    """`place` is given the scheduler's ActorPlaced; one for another actor recorded here would pin this
    actor, and stamp its next image, with another's placement: refused (ValueError, a caller's bug),
    nothing recorded. (Mutant: the check dropped.)"""
    actor = created("a-1")
    actor.collect_events()
    with pytest.raises(ValueError, match="placement of 'a-2' recorded on actor 'a-1'"):
        actor.place(factories.placed("a-2", "w-1", V2, node="n-1", cpu=500, mem=512, at=at(1)))
    assert actor.collect_events() == [] and actor.state is ActorState.CREATED and actor.assignment is None


def test_revert_of_an_unknown_actor_is_not_found():
    """(Mutant: revert's NOT_FOUND dropped: an AttributeError instead.)"""
    actor = Actor("ghost")
    with pytest.raises(ContractError) as refused:
        actor.revert("node gone", None, at())
    assert (code_of(refused), refused.value.field) == (ErrorCode.NOT_FOUND, "actor_id")
    assert actor.pending_events == []


def test_revert_records_the_local_image_it_gives_up_and_goes_back_to_the_latest_external_one():
    """ActorReverted names both images: `snapshot`, the latest EXTERNAL one the actor resumes from, and
    `abandoned`, the LOCAL one given up (what `audit` prints: "gave up ..."). Reverted to a golden
    snapshot, the actor again borrows its volumes: its next pause is `borrowed`, as before its first
    suspend. (Mutants: `abandoned` recorded as the snapshot gone back to; `borrowed` cleared by a revert.)"""
    actor = created("a-3", golden_snapshot=golden(V2))
    start = actor.latest_snapshot
    actor.place(placed(actor, pin=V2, node="n-7"))
    local = actor.pause(None, None, at(3))
    actor.collect_events()
    back = actor.revert("node n-7 is gone", "r-1", at(4))
    (reverted,) = bodies(actor)
    assert isinstance(reverted, ActorReverted)
    assert reverted.snapshot == back == start and reverted.abandoned == local != start
    assert reverted.abandoned.location is Location.LOCAL and reverted.abandoned.node == "n-7"
    assert actor.state is ActorState.SUSPENDED and actor.latest_snapshot == start
    actor.place(placed(actor, pin=V2, node="n-8"))
    assert actor.pause(None, None, at(6)).borrowed is True  # still no volumes of its own


def test_an_actor_created_from_a_tag_of_an_own_snapshot_borrows_nothing():
    """A tag's copy keeps the `borrowed` flag it had: an actor created from a tag of another actor's own
    (suspended, not borrowed) snapshot does not borrow volumes, and neither does its pause's image.
    (Mutant: every created actor with a first snapshot taken as borrowing.)"""
    source = running("src", pin=V1)
    own = source.suspend(None, "s3://src", Fidelity.MEMORY, None, at(2))
    assert own.borrowed is False
    actor = Actor("a-2")
    actor.create(create_request("a-2", source_tag="t"), own, at(3))
    assert actor.latest_snapshot.borrowed is False
    actor.place(placed(actor, pin=V1))
    assert actor.pause(None, None, at(5)).borrowed is False


def test_a_retried_request_is_answered_by_what_its_verb_recorded_and_no_other_verb_s():
    """`Actor.prior` (how a retry with the same request_id is answered, not decided again): a suspend
    from PAUSED recorded a PROMOTE, a stop of a placed actor recorded its release first; a retry of
    each is answered by those events. An id a pause used, sent again with a suspend, is
    FAILED_PRECONDITION on `request_id` (else the suspend would be answered with the pause's LOCAL
    image). (Mutants: PROMOTE not a suspend's; the release not a stop's; any SnapshotTaken taken as any
    of the three verbs': every test passed.)"""
    promoted = running("p")
    promoted.pause(None, "r-pause", at(1))
    promoted.suspend(None, "s3://p", Fidelity.MEMORY, "r-promote", at(2))
    assert promoted.events_at(promoted.prior("suspend", "r-promote"))[0].origin is SnapshotOrigin.PROMOTE
    with pytest.raises(ContractError) as reused:
        promoted.prior("suspend", "r-pause")
    assert (code_of(reused), reused.value.field) == (ErrorCode.FAILED_PRECONDITION, "request_id")
    assert "already used for another request" in reused.value.message
    stopped = running("s")
    stopped.stop("r-stop", at(1))
    assert [type(e) for e in stopped.events_at(stopped.prior("stop", "r-stop"))] == [ActorReleased, ActorStopped]


@pytest.mark.parametrize("verb", ["suspend", "stop"])
def test_a_suspend_or_stop_whose_id_an_earlier_life_used_is_refused(verb):
    """A copy of a suspend or stop decided late, after the actor was stopped and created anew, would act
    on the next life (a suspend recorded the earlier life's image under this life's pin): its request_id
    was made for the earlier life, so it is FAILED_PRECONDITION on `request_id`. (Mutants: suspend, or
    stop, left out of REFUSED_FROM_AN_EARLIER_LIFE.)"""
    actor = running()
    if verb == "suspend":
        actor.suspend(None, "s3://a", Fidelity.MEMORY, "r-old", at(1))
        actor.stop(None, at(2))
    else:
        actor.stop("r-old", at(2))
    actor.create(create_request(), None, at(3))
    actor.place(placed(actor))
    with pytest.raises(ContractError) as refused:
        actor.prior(verb, "r-old")
    assert (code_of(refused), refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "request_id")
    assert f"was used in an earlier life of actor 'a-1': a {verb} made for that life" in refused.value.message


def test_an_unchanged_update_template_names_the_event_that_set_the_template():
    """An update-template to the actor's current template records nothing and answers the sequence of
    the event that set it (`Actor.template_version`: `service` replies `seq` from it), so a read at that
    sequence sees the template: the TemplateChanged's, once there was one, not the create's. (Mutant:
    `template_version` left at the create's.)"""
    actor = created()
    actor.change_template("tpl-2", None, at(1))
    actor = stored(actor)
    assert actor.change_template("tpl-2", None, at(2)) is False and actor.collect_events() == []
    assert isinstance(actor.history[actor.template_version - 1], TemplateChanged)
    assert actor.seq_at(actor.template_version) == 20 and actor.template_uid == "tpl-2"
