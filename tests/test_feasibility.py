"""The one definitions `feasibility.Ask.judge` and `audit verify` share: a worker's room
(`feasibility.room`) and what an actor books under a runtime (`Runtime.need_mib`)."""

from __future__ import annotations

from events.schema import Resources
from services.scheduler.feasibility import NO_PENDING, SHORT_MEMORY, Ask, room
from services.scheduler.projection import Projection
from services.scheduler.records import WORKER_RESERVE_MIB
from tests.factories import CLASS, entry, fold, registered, runtime, version

V1 = version("1")


def test_room_is_what_the_worker_record_says_less_what_is_in_flight():
    """`room` inlines `Worker.room_cpu` and `room_mem` (a property read costs a sixth of a judgement):
    the two must stay one definition."""
    p = fold([registered("w1", entry(V1), cpu=4000, mem=4096), registered("w2", entry(V1), cpu=1000, mem=100)],
             Projection())
    for w in p.workers.values():
        w.book(Resources(cpu_millis=300, memory_mib=200))
        assert room(w, NO_PENDING) == (w.room_cpu, w.room_mem)
        assert room(w, {w.worker_id: (100, 10)}) == (w.room_cpu - 100, w.room_mem - 10)
        assert w.room_mem == w.memory_mib - WORKER_RESERVE_MIB - 200


def test_need_is_the_actors_memory_and_the_runtimes_overhead_and_judge_books_it():
    p = fold([registered("w1", entry(runtime(V1, overhead=32, per_gib=8)), cpu=4000, mem=WORKER_RESERVE_MIB + 1025 + 32 + 8 * 2)],
             Projection())
    w = p.workers["w1"]
    rt = w.classes[CLASS].default
    assert rt.need_mib(1024) == 1024 + 32 + 8 * 1
    assert rt.need_mib(1025) == 1025 + 32 + 8 * 2
    assert Ask(CLASS, 500, 1025, (), None, None).judge(w, NO_PENDING) == (0, rt, 1025 + 32 + 16)
    assert Ask(CLASS, 500, 1026, (), None, None).judge(w, NO_PENDING)[0] == SHORT_MEMORY


def test_a_placement_is_carried_out_only_by_a_worker_that_still_runs_its_class_and_pinned_runtime():
    """`carries_out` (a retry answered from the log, `audit verify`): without an image too, a worker
    that no longer registers the class, or no longer runs the runtime the placement pins, cannot
    carry it out; one that does can, under the pinned runtime (not merely its default)."""
    from services.scheduler.feasibility import NO_CLASS_NOW, PIN_NOT_RUN, carries_out, carrying

    V2 = version("2")
    p = fold([registered("w1", entry(V1, (V2,)), node="n1"),
              registered("w2", entry(V2), node="n2"),
              registered("w3", entry(version("3")), node="n3"),
              registered("other", entry(V1, sandbox_class="other-class"), node="n4")], Projection())
    w1, w3, other = p.workers["w1"], p.workers["w3"], p.workers["other"]
    v1 = w1.classes[CLASS].default.compat
    v2 = p.workers["w2"].classes[CLASS].default.compat
    assert carrying(other, CLASS, "n4", v1, None) == (NO_CLASS_NOW, None)
    assert carries_out(other, CLASS, "n4", v1, None) is not None
    assert carrying(w3, CLASS, "n3", v1, None) == (PIN_NOT_RUN, None)
    assert carries_out(w3, CLASS, "n3", v1, None) is not None
    why, runs = carrying(w1, CLASS, "n1", v2, None)
    assert why is None and runs is not None and runs.compat is v2
    assert carries_out(w1, CLASS, "n1", v1, None) is None


def test_of_two_runtimes_accepting_a_stamp_in_one_role_the_first_with_room_is_the_pin():
    """Two restorable runtimes listing the stamp's version as compatible both accept it (through an
    edge, one role): the first in the registration's order that has room is the runtime the restore
    runs under (module docstring, rule 7); the second only when the first is short of memory."""
    from services.scheduler.records import EDGE_RESTORABLE

    V2, V3, V4 = version("2"), version("3"), version("4")
    first, second = runtime(V2, overhead=0, compatible=(V1,)), runtime(V4, overhead=100, compatible=(V1,))
    p = fold([registered("w1", entry(V1), node="n1"),
              registered("w2", entry(V3, (first, second)), node="n2", mem=WORKER_RESERVE_MIB + 2000)], Projection())
    v1 = p.workers["w1"].classes[CLASS].default.compat
    w2 = p.workers["w2"]
    ask = Ask(CLASS, 500, 1024, (), None, v1)
    verdict, rt, need = ask.judge(w2, NO_PENDING, EDGE_RESTORABLE)
    assert (verdict, rt.compat.version, need) == (0, V2, 1024)
    second_first = fold([registered("w1", entry(V1), node="n1"),
                         registered("w2", entry(V3, (second, first)), node="n2", mem=WORKER_RESERVE_MIB + 1200)],
                        Projection())
    ask = Ask(CLASS, 500, 1024, (), None, second_first.workers["w1"].classes[CLASS].default.compat)
    verdict, rt, need = ask.judge(second_first.workers["w2"], NO_PENDING, EDGE_RESTORABLE)
    assert (verdict, rt.compat.version, need) == (0, V4, 1124)


def test_a_memory_restore_in_a_role_passes_over_a_worker_accepting_the_stamp_only_in_another():
    """`judge` with a role considers only the runtimes accepting the stamp in that role: a worker
    whose default matches the stamp (OWN_DEFAULT) is `runtime mismatch` for the edge tiers and fits
    for its own; one role never borrows another's runtime."""
    from services.scheduler.records import EDGE_DEFAULT, EDGE_RESTORABLE, OWN_DEFAULT, OWN_RESTORABLE

    p = fold([registered("w1", entry(V1))], Projection())
    w1 = p.workers["w1"]
    ask = Ask(CLASS, 500, 1024, (), None, w1.classes[CLASS].default.compat)
    assert ask.judge(w1, NO_PENDING, OWN_DEFAULT)[0] == 0
    for role in (OWN_RESTORABLE, EDGE_DEFAULT, EDGE_RESTORABLE):
        assert ask.judge(w1, NO_PENDING, role) == (5, None, 0)
        assert ask.reasons(w1, NO_PENDING) == []
