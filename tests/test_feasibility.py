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
