"""An actor's memory of its placements' request ids (`services.scheduler.records`), as pure logic.

The recent ones answer a retry from the projection; the ones pushed out of them are in
the reply cache, and a filter behind the recent ones says which ids may be among those:
never "no" for an id that was pushed out, else a new id would be placed again.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from events.schema import Fidelity, Resources
from services.scheduler.records import (
    PUSHED_OUT_BITS,
    RECENT_PLACEMENTS,
    Actor,
    Spec,
    oldest_placement,
    request_hash,
    with_placement,
)


def actor_with(requests: list[str]) -> tuple[Actor, list[tuple[int, int]]]:
    """An actor placed once per request id, in order (seq 10, 20, ...), and those (hash, seq)."""
    actor = Actor("a", "SUSPENDED", Spec("gvisor", "t", Resources(cpu_millis=1, memory_mib=1), {}, Fidelity.ROOTFS))
    placed = []
    for n, request_id in enumerate(requests, start=1):
        request = request_hash(request_id)
        assert oldest_placement(actor.placements) == (placed[-RECENT_PLACEMENTS] if len(placed) >= RECENT_PLACEMENTS
                                                      else None)
        actor.placements = with_placement(actor.placements, request, n * 10)
        placed.append((request, n * 10))
    return actor, placed


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=12), min_size=0, max_size=60, unique=True),
       st.lists(st.text(min_size=13, max_size=20), min_size=1, max_size=20, unique=True))
def test_recent_ids_are_answered_and_every_id_pushed_out_may_have_been(requests, never_used):
    actor, placed = actor_with(requests)
    recent, pushed_out = placed[-RECENT_PLACEMENTS:], placed[:-RECENT_PLACEMENTS]
    for request, seq in recent:
        assert actor.placed_by(request) == seq
    for request, _ in pushed_out:
        assert actor.placed_by(request) == 0  # no longer in the projection's memory
        assert actor.may_have_pushed_out(request)  # so the reply cache is asked
    if not pushed_out:  # nothing pushed out: no id is looked up in the reply cache
        assert not any(actor.may_have_pushed_out(request_hash(r)) for r in never_used)
    for r in never_used:
        assert actor.placed_by(request_hash(r)) == 0


def test_a_new_id_is_rarely_sent_to_the_reply_cache():
    """The filter's point: after 50 placements pushed out, a new id is known new without a
    read of the reply cache, but for about 1% of them (3 bits of 512 per id)."""
    actor, placed = actor_with([f"old-{i}" for i in range(50 + RECENT_PLACEMENTS)])
    looked_up = sum(actor.may_have_pushed_out(request_hash(f"new-{i}")) for i in range(10_000))
    assert looked_up < 300, looked_up  # expected about 1.2% (k = 3, m = PUSHED_OUT_BITS)
    assert PUSHED_OUT_BITS == 512
    assert len(actor.placements) == RECENT_PLACEMENTS * 16 + PUSHED_OUT_BITS // 8


def test_the_memory_is_bounded_whatever_the_number_of_placements():
    actor, placed = actor_with([f"r-{i}" for i in range(1000)])
    assert len(actor.placements) == RECENT_PLACEMENTS * 16 + PUSHED_OUT_BITS // 8
    assert [actor.placed_by(request) for request, _ in placed[-RECENT_PLACEMENTS:]] == \
        [seq for _, seq in placed[-RECENT_PLACEMENTS:]]
    assert all(actor.may_have_pushed_out(request) for request, _ in placed[:-RECENT_PLACEMENTS])
