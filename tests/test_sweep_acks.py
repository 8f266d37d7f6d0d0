"""The sweep acknowledges all at once, never past an expiry marker it holds.

`services.registry.ackfloor.AckFloor` (pure: which delivery to acknowledge) against a model of
what `AckPolicy.ALL` does with it, and the sweep on a real bucket: while a replica handles a marker,
no ack it sends reaches the marker, whatever is delivered after it; once handled, one ack covers all.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from events.natspy.publish import flush_in_order
from events.subjects import bucket_name
from services.registry.ackfloor import AckFloor
from services.registry.liveness import SWEEPER, Liveness


def reply(seq: int, delivered: int = 1) -> str:
    return f"$JS.ACK.KV_T.{SWEEPER}.{delivered}.{seq}.{seq}.1733000000000000000.0"


def seq_of(subject: str) -> int:
    return int(subject.split(".")[5])


def test_with_nothing_held_the_newest_delivery_is_acknowledged_once():
    floor = AckFloor()
    assert floor.target() is None
    for seq in (1, 2, 3):
        floor.delivered(reply(seq))
    assert floor.target() == reply(3)
    assert floor.target() is None  # nothing new since


def test_no_target_reaches_a_held_marker_and_its_release_lets_the_acks_past():
    floor = AckFloor()
    floor.delivered(reply(1))
    assert floor.hold(reply(2)) == 2
    floor.delivered(reply(3))
    floor.delivered(reply(4))
    assert floor.target() == reply(1)
    floor.release(2)
    assert floor.target() == reply(4)


def test_a_marker_delivered_again_while_held_is_not_held_twice():
    floor = AckFloor()
    assert floor.hold(reply(5)) == 5
    assert floor.hold(reply(5, delivered=2)) is None
    assert floor.held() == [5]
    assert floor.holds(5) and floor.held_replies() == [reply(5)]  # the first delivery's, to hand back
    floor.release(5)
    assert not floor.holds(5) and floor.held_replies() == []


def test_markers_released_out_of_order_keep_the_acks_below_the_lowest_still_held():
    floor = AckFloor()
    floor = AckFloor()  # markers at 2, 4 and 6, delivered in stream order among the puts
    floor.delivered(reply(1))
    floor.hold(reply(2))
    floor.delivered(reply(3))
    floor.hold(reply(4))
    floor.delivered(reply(5))
    floor.hold(reply(6))
    floor.delivered(reply(7))
    assert floor.target() == reply(1)
    floor.release(4)
    assert floor.target() is None  # 2 still held: still 1
    floor.release(2)
    assert floor.target() == reply(5)  # up to the marker at 6, which is held
    floor.release(6)
    assert floor.target() == reply(7)
    assert floor.held() == []


@pytest.mark.parametrize("seed", range(20))
def test_a_random_sweep_never_acknowledges_a_held_marker_and_ends_acknowledging_everything(seed):
    """A model of the server's `AckPolicy.ALL`: an ack of sequence n acknowledges every delivery up to
    n. Deliveries come in stream order, some again later (an ack wait ran out); markers are handled in
    any order. At every step, nothing held is acknowledged; at the end, everything is."""
    rng = random.Random(seed)
    floor = AckFloor()
    acked = 0
    held: set[int] = set()
    markers: set[int] = set()
    delivered: list[int] = []
    for seq in range(1, 400):
        if delivered and rng.random() < 0.05:  # something not acknowledged yet delivered again
            again = rng.choice([s for s in delivered if s > acked] or [0])
            if again in held:
                assert floor.hold(reply(again, 2)) is None
            elif again in markers:  # handled, not acknowledged yet: handled again
                assert floor.hold(reply(again, 2)) == again
                held.add(again)
            elif again:
                floor.delivered(reply(again, 2))
        if rng.random() < 0.1:
            markers.add(seq)
            assert floor.hold(reply(seq)) == seq
            held.add(seq)
        else:
            floor.delivered(reply(seq))
        delivered.append(seq)
        if held and rng.random() < 0.08:
            done = rng.choice(sorted(held))
            held.discard(done)
            floor.release(done)
        target = floor.target()
        if target is not None:
            acked = max(acked, seq_of(target))
        assert not held or acked < min(held), (acked, sorted(held))
    for done in sorted(held, key=lambda _: rng.random()):
        floor.release(done)
        target = floor.target()
        if target is not None:
            acked = max(acked, seq_of(target))
    assert acked == max(delivered)


async def test_on_the_bus_no_ack_reaches_a_marker_until_its_worker_is_handled(nc, prefix):
    """One sweep, one marker held (its worker's removal waits), one worker beating: the puts after the
    marker are delivered, and the acks the sweep sends (read on the bus) all stay below the marker.
    Once the removal returns, one ack reaches the newest put."""
    stream = f"KV_{bucket_name(prefix, 'heartbeats')}"
    acks: list[int] = []
    reached = asyncio.Event()
    last_put = 0

    async def ack(msg) -> None:
        acks.append(seq_of(msg.subject))
        if last_put and acks[-1] >= last_put:
            reached.set()

    spy = await nc.subscribe(f"$JS.ACK.{stream}.{SWEEPER}.>", cb=ack)
    await flush_in_order(nc)
    handling, release = asyncio.Event(), asyncio.Event()

    async def removing(worker_id: str) -> None:  # only w-silent's waits (w-live expires too, once the test ends)
        if worker_id == "w-silent":
            handling.set()
            await release.wait()

    liveness = Liveness(nc, prefix, ttl_s=1, on_expired=removing)
    await liveness.start()
    try:
        await liveness.beat("w-silent")
        await asyncio.wait_for(handling.wait(), 20)  # its marker: held by the sweep
        state, marker = await liveness.entry("w-silent")
        assert state == "expired"
        seen, past = [], asyncio.Event()
        delivered = liveness.sweeper._floor.delivered

        def noting(subject: str) -> None:  # the deliveries to the sweep, to await the last put's
            delivered(subject)
            seen.append(seq_of(subject))
            if last_put and seen[-1] >= last_put:
                past.set()

        liveness.sweeper._floor.delivered = noting
        for _ in range(20):
            await liveness.beat("w-live")
        last_put = await liveness.last_entry("w-live")
        if seen and seen[-1] >= last_put:
            past.set()
        await asyncio.wait_for(past.wait(), 20)
        if liveness.sweeper._acking is not None:  # the acks of those deliveries, sent
            await liveness.sweeper._acking
        await flush_in_order(liveness.nc)  # and on their way
        await flush_in_order(nc)
        assert acks and max(acks) < marker, (acks, marker)
        assert marker in liveness.sweeper._floor.held()
        # (The server's own ack floor may be past the marker by now: under AckPolicy.ALL it takes a
        # pending put that a newer put of its key replaced as acknowledged, and everything below it with
        # it. So the sweep never waits for a marker to be delivered again: see `Sweeper`.)
        release.set()
        await asyncio.wait_for(reached.wait(), 20)
        assert acks == sorted(acks)
    finally:
        release.set()
        await asyncio.wait_for(liveness.stop(), 20)
        await spy.unsubscribe()
