"""What a refused resume tells its caller (a walkthrough's findings), pure: projections folded
from events, no bus (tests/test_lifecycle_cli.py has the same through the CLI).

- a `selector mismatch` count names the selector keys not matched, a few at most;
- an actor whose LOCAL image's node has no worker of its class is told the command that gives
  the image up;
- an actor bigger than any worker of its class is told so, with the largest worker's capacity,
  and not "no worker of the class fits" (which reads as busy): the same code, RESOURCE_EXHAUSTED;
- a RESOURCE_EXHAUSTED that no room freed can end names, in its `field`, what of the actor the
  fleet cannot meet now (a program tells it from "busy, try later" without reading the message).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.errors import ContractError
from events.schema import (ErrorCode, Fidelity, ReleaseReason, Resources, RuntimeChanged, SnapshotOrigin, WorkerRemoved,
                           WorkerUpdated)
from services.scheduler.checkpoint_codec import export_state, restore_state
from services.scheduler.decide import ARCH_FIELD, STAMP_FIELD, bigger_than, decide, summary
from tests.factories import AT, Log, entry, runtime, version

V1 = version("1")
BUSY = "no worker of the class fits"
NO_LABELS = ("no undrained worker of the class has the labels its selectors ask for; no room freed will place it, an "
             "undrained worker with them must register")


def refusal(log: Log, actor_id: str, selectors=None, code: ErrorCode = ErrorCode.RESOURCE_EXHAUSTED) -> str:
    with pytest.raises(ContractError) as caught:
        log.decide(actor_id, selectors)
    assert caught.value.code is code, caught.value
    return caught.value.message


def explained(log: Log, actor_id: str, selectors=None) -> str:
    """The explanation's message of a refused resume, which is the refusal's."""
    why = log.explain(actor_id, selectors)
    assert why.refusal is not None and why.refusal.message == why.message, why
    return why.message


# --- selector mismatch names its keys ------------------------------------------------------------------------------


def test_a_refusal_names_the_selector_key_the_workers_do_not_match():
    log = Log()
    log.worker("a-1", labels={"zone": "a"})
    log.worker("a-2", labels={"zone": "a"})
    log.worker("b-1", labels={"zone": "b"}, mem=1024)  # matches, too small to take it now
    log.actor("x", mem=1024, selectors={"zone": "b"})
    message = "0/3 workers available: 2 selector mismatch (zone), 1 insufficient memory; " + BUSY
    assert refusal(log, "x") == message
    assert explained(log, "x") == message
    # a key the request adds is named too, and every key a worker misses counts
    log.worker("b-2", labels={"zone": "b"})
    assert refusal(log, "x", {"disk": "ssd"}) == (
        "0/4 workers available: 4 selector mismatch (disk, zone); " + NO_LABELS)


def test_many_selector_keys_are_named_a_few_at_most_the_most_missed_first():
    log = Log()
    log.worker("w-1", labels={"k1": "x", "k2": "x"})
    log.worker("w-2", labels={"k1": "x"})
    log.worker("w-3", labels={})
    log.actor("x", selectors={f"k{i}": "x" for i in range(1, 6)})  # k3 to k5: no worker has them
    assert refusal(log, "x") == "0/3 workers available: 3 selector mismatch (k3, k4, k5, +2 more); " + NO_LABELS


def test_summary_names_keys_only_after_selector_mismatch():
    counts = {"selector mismatch": 2, "drained": 1}
    assert summary(0, 3, counts, {"zone": 2}) == "0/3 workers available: 2 selector mismatch (zone), 1 drained"
    assert summary(0, 3, counts) == "0/3 workers available: 2 selector mismatch, 1 drained"
    assert summary(0, 1, {"drained": 1}, {}) == "0/1 workers available: 1 drained"


# --- a lost LOCAL image names the command that gives it up ----------------------------------------------------------


def test_a_local_image_on_a_node_without_workers_names_the_revert_command():
    log = Log()
    log.worker("home", runtime(V1), node="n1")
    log.actor("a")
    placed = log.decide("a")
    log.place(placed)
    log.snapshot("a", origin=SnapshotOrigin.PAUSE, stamped=V1, node="n1")
    log.release("a", "home", ReleaseReason.PAUSED)
    log.add(WorkerRemoved(at=AT, worker_id="home", reason="decommissioned"))
    log.worker("away", runtime(V1), node="n2")
    message = refusal(log, "a", code=ErrorCode.FAILED_PRECONDITION)
    assert "node n1" in message and "(`warmboot actor revert a`)" in message, message
    assert "snapshotter revert" not in message


# --- an actor bigger than any worker of its class ------------------------------------------------------------------


def test_an_actor_bigger_than_any_worker_is_told_so_with_the_same_code():
    log = Log()
    log.worker("small", cpu=2000, mem=2048)
    log.worker("big", cpu=4000, mem=4096)
    log.actor("huge", cpu=500, mem=8192)
    log.actor("fits", cpu=500, mem=3000)  # fits "big" when it is free
    log.place(log.decide("fits"))
    log.actor("busy", cpu=500, mem=3000)
    too_big = ("0/2 workers available: 2 insufficient memory; no worker of the class is big enough: the largest has "
               "4000m CPU and 4096 MiB memory (4032 MiB after the 64 MiB reserve), the actor needs 500m CPU and "
               "8192 MiB memory plus its runtime's overhead; no room freed will fit it, a bigger worker must register")
    assert refusal(log, "huge") == too_big
    assert explained(log, "huge") == too_big
    # full, not too big: the busy refusal it always was
    assert refusal(log, "busy") == "0/2 workers available: 2 insufficient memory; " + BUSY
    # CPU alone, and the largest of each from different workers
    log.actor("greedy", cpu=8000, mem=256)
    assert "the largest has 4000m CPU and 4096 MiB memory (4032 MiB after the 64 MiB reserve), the actor needs " \
           "8000m CPU and 256 MiB memory" in refusal(log, "greedy")


def test_too_big_is_said_at_any_tier_and_never_changes_the_code():
    log = Log()
    log.worker("w", runtime(V1), mem=4096)
    log.actor("strict", mem=8192, min_fidelity=Fidelity.MEMORY)
    log.snapshot("strict", stamped=V1)
    assert "no worker of the class is big enough" in refusal(log, "strict")  # RESOURCE_EXHAUSTED, as before
    log.actor("edge", mem=4032)  # exactly the room of an empty worker: not too big (its overhead aside)
    log.place(log.decide("edge"))
    log.actor("edge-2", mem=4032)
    assert refusal(log, "edge-2").endswith("; " + BUSY)


def test_a_fallback_with_no_worker_of_the_stamp_s_architecture_says_none_is_registered():
    """A fallback keeps the stamp's architecture (rule 4). With a worker of it full, the refusal ends
    "no worker of the class with architecture arm64 fits" (room may be freed); with none of it
    registered, it said the same, which reads as busy: it says none is registered (a docs check)."""
    arm = version("9", arch="arm64")
    log = Log()
    log.worker("amd", runtime(V1))
    log.worker("arm", runtime(version("10", arch="arm64")), mem=256)  # too small for it
    log.actor("a", mem=512)
    log.snapshot("a", stamped=arm, snapshot_id="mem-1")  # no worker accepts its memory: a fallback on arm64
    busy = refusal(log, "a")
    assert busy.endswith("; no worker of the class with architecture arm64 fits"), busy
    log.add(WorkerRemoved(at=AT, worker_id="arm", reason="gone"))
    gone = refusal(log, "a")
    assert gone.endswith("; no registered worker of the class has architecture arm64"), gone
    assert explained(log, "a") == gone


def test_the_largest_capacity_follows_updates_removals_and_a_checkpoint():
    log = Log()
    log.worker("w-1", cpu=4000, mem=4096)
    log.worker("w-2", cpu=4000, mem=4096)
    log.actor("a", mem=6000)
    assert "big enough: the largest has 4000m CPU and 4096 MiB" in refusal(log, "a")
    log.add(WorkerUpdated(at=AT, worker_id="w-2", node=log.p.workers["w-2"].node,
                          capacity=Resources(cpu_millis=4000, memory_mib=8192), labels={}))
    assert log.decide("a").worker_id == "w-2"  # grown: it fits now
    assert restore_state(export_state(log.p)).classes["gvisor"].largest() == (4000, 8192)
    log.add(WorkerRemoved(at=AT, worker_id="w-2", reason="decommissioned"))
    assert "big enough: the largest has 4000m CPU and 4096 MiB" in refusal(log, "a")
    log.add(WorkerRemoved(at=AT, worker_id="w-1", reason="decommissioned"))
    assert log.p.classes["gvisor"].largest() is None
    assert refusal(log, "a").endswith("no worker has registered the sandbox class 'gvisor'")


def test_a_remembered_too_big_refusal_moves_with_the_fleet():
    log = Log()
    log.worker("w", mem=4096)
    log.actor("a", mem=6000)
    memo: dict = {}
    for _ in range(2):
        with pytest.raises(ContractError) as caught:
            decide(log.p, "a", None, log.p.seq, {}, memo)
        assert "big enough" in caught.value.message
    log.add(WorkerUpdated(at=AT, worker_id="w", node=log.p.workers["w"].node,
                          capacity=Resources(cpu_millis=4000, memory_mib=8192), labels={}))
    assert decide(log.p, "a", None, log.p.seq, {}, memo).worker_id == "w"


def test_bigger_than_leaves_out_the_overhead_and_the_reserve_counts():
    assert bigger_than((4000, 4096), 4000, 4032) is None
    assert bigger_than((4000, 4096), 4001, 1) is not None
    assert bigger_than((4000, 4096), 1, 4033) is not None


@settings(max_examples=80, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["register", "update", "remove", "drain", "reclass"]),
                                st.integers(0, 4), st.sampled_from([1024, 2048, 4096])), max_size=40))
def test_the_largest_capacity_kept_is_that_of_a_scan_of_the_class_after_any_history(steps):
    """What the class index keeps of its workers' capacities is what a scan of them finds, after
    registrations (anew too), capacity changes, removals, drains and runtime changes, and after a
    checkpoint's round trip."""
    log = Log()
    for verb, n, mem in steps:
        worker_id = f"w{n}"
        if verb == "register":
            log.worker(worker_id, cpu=mem, mem=mem)
        elif worker_id not in log.p.workers:
            continue
        elif verb == "update":
            log.add(WorkerUpdated(at=AT, worker_id=worker_id, node=log.p.workers[worker_id].node,
                                  capacity=Resources(cpu_millis=2 * mem, memory_mib=mem), labels={}))
        elif verb == "remove":
            log.add(WorkerRemoved(at=AT, worker_id=worker_id, reason="decommissioned"))
        elif verb == "drain":
            log.drain(worker_id)
        else:  # the worker leaves the class for another, and comes back
            mine, other = (entry(runtime(V1)),), (entry(runtime(V1), (), "other"),)
            log.add(RuntimeChanged(at=AT, worker_id=worker_id, sandbox_classes=other, previous=mine))
            log.add(RuntimeChanged(at=AT, worker_id=worker_id, sandbox_classes=mine, previous=other))
    for p in (log.p, restore_state(export_state(log.p))):
        for name, index in p.classes.items():
            scan = [w for w in p.workers.values() if name in w.classes]
            assert index.largest() == (None if not scan else (max(w.cpu_millis for w in scan),
                                                              max(w.memory_mib for w in scan)))


# --- the field of a refusal that no room freed can end -------------------------------------------------------------


def refused_field(log: Log, actor_id: str) -> str | None:
    """The `field` of the actor's RESOURCE_EXHAUSTED, checked to be explain's refusal's too."""
    with pytest.raises(ContractError) as caught:
        log.decide(actor_id)
    assert caught.value.code is ErrorCode.RESOURCE_EXHAUSTED, caught.value
    why = log.explain(actor_id)
    assert why.refusal is not None and why.refusal.field == caught.value.field, (why.refusal, caught.value)
    return caught.value.field


def test_a_refusal_names_a_field_only_where_no_room_freed_can_place_the_actor():
    log = Log()
    log.worker("w", runtime(V1), cpu=4000, mem=4096)
    log.actor("fills", mem=3000)
    log.place(log.decide("fills"))
    log.actor("busy", mem=3000)
    assert refused_field(log, "busy") is None  # room may come free: try later
    log.actor("huge", mem=8192)
    assert refused_field(log, "huge") == "resources"  # a bigger worker must register
    log.actor("picky", mem=256, selectors={"zone": "b"})
    assert refused_field(log, "picky") == "selectors"  # no worker has zone=b: one that has it must register
    log.worker("zb", labels={"zone": "b"}, mem=4096)
    log.drain("zb")
    assert refused_field(log, "picky") == "selectors"  # a drain lasts the worker's life
    log.actor("strict", mem=256, min_fidelity=Fidelity.MEMORY)
    log.snapshot("strict", stamped=version("0"))  # no registered worker accepts its image's runtime
    assert refused_field(log, "strict") == STAMP_FIELD
    log.actor("strict-2", mem=3000, min_fidelity=Fidelity.MEMORY)
    log.snapshot("strict-2", stamped=V1)  # one does, full
    assert refused_field(log, "strict-2") is None
    log.actor("arm", mem=256)
    log.snapshot("arm", stamped=version("9", arch="arm64"))  # a fallback on arm64, none registered
    assert refused_field(log, "arm") == ARCH_FIELD
    log.actor("other", sandbox_class="firecracker")
    assert refused_field(log, "other") == "sandbox_class"


def test_selectors_are_named_only_when_no_undrained_worker_of_the_class_has_the_labels():
    """`selectors` (2026-12-07: a trial's resume refused for `pool=nope` read as busy, field null): not
    when a worker with the labels is full (room may come free), nor when one with them fails a later
    check only a change of the fleet ends, which keeps its own field (here the stamp's architecture)."""
    log = Log()
    log.worker("za", labels={"zone": "a"}, mem=4096)
    log.worker("zb", labels={"zone": "b"}, mem=4096)
    log.actor("fills", mem=3000, selectors={"zone": "b"})
    log.place(log.decide("fills"))
    log.actor("x", mem=3000, selectors={"zone": "b"})
    assert refused_field(log, "x") is None  # zb has the label, and is full
    assert refusal(log, "x") == "0/2 workers available: 1 insufficient memory, 1 selector mismatch (zone); " + BUSY
    assert explained(log, "x") == refusal(log, "x")
    log.actor("c", mem=256, selectors={"zone": "c"})
    assert refusal(log, "c") == "0/2 workers available: 2 selector mismatch (zone); " + NO_LABELS
    assert explained(log, "c") == refusal(log, "c")
    log.actor("arm", mem=256, selectors={"zone": "b"})
    log.snapshot("arm", stamped=version("9", arch="arm64"))  # zb has the label, and is amd64
    assert refused_field(log, "arm") == ARCH_FIELD


def test_a_remembered_refusal_keeps_its_field():
    log = Log()
    log.worker("w", mem=4096)
    log.actor("a", mem=6000)
    memo: dict = {}
    for _ in range(2):  # the second from `memo`, without a pass over the fleet
        with pytest.raises(ContractError) as caught:
            decide(log.p, "a", None, log.p.seq, {}, memo)
        assert caught.value.field == "resources"
    assert len(memo) == 1


def test_a_drained_worker_with_the_labels_is_not_reported_as_missing_them():
    """Every worker is passed over as drained, none for its labels: the refusal counts it drained
    (undraining it helps), and does not say no worker has the labels (`none_passes` needs some
    worker passed over for `selector mismatch`)."""
    log = Log()
    log.worker("a-1", labels={"zone": "a"})
    log.drain("a-1")
    log.actor("x", selectors={"zone": "a"})
    message = "0/1 workers available: 1 drained; " + BUSY
    assert refusal(log, "x") == message
    assert explained(log, "x") == message


def test_a_worker_with_the_labels_on_another_node_is_not_reported_as_missing_them():
    """A LOCAL image on n1, whose worker lacks the actor's labels, while a worker on n2 has them: the
    refusal is the LOCAL one (rule 5), not that no worker has the labels (a worker passed over for
    `not on pinned node` passed the selector check)."""
    from events.schema import Location
    from tests.factories import snapshot, taken

    log = Log()
    log.worker("home", node="n1", labels={})
    log.worker("away", node="n2", labels={"zone": "a"})
    log.actor("x", selectors={"zone": "a"})
    log.add(taken(snapshot("x", V1, snapshot_id="s1", location=Location.LOCAL, node="n1")))
    message = ("0/2 workers available: 1 not on pinned node, 1 selector mismatch (zone); its memory image is LOCAL "
               "on node n1: it restores only on a compatible worker there")
    assert refusal(log, "x") == message
    assert explained(log, "x") == message
