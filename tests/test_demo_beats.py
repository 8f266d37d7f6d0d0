"""The demo's heartbeats (pure scheduling; the demo itself on a real server: tests/test_operate.py).

One after another, a round of 20,000 simulated workers took longer than the registry's TTL, and
`warmboot up --demo --workers 20000` stopped with a worker removed as LOST (measured by hand on the
development machine: it now runs to its summary). A round's beats now go up to `BEATS_IN_FLIGHT` at
once, from the first registration on, and the next round is counted from the round's start.
"""

from __future__ import annotations

import asyncio

from events.schema import HeartbeatReply
from warmboot.demo import BEATS_IN_FLIGHT, MIN_WORKERS, Demo, DemoConfig
from events.tasks import cancel_and_wait


class Beats:
    """A client's `heartbeat` that holds each beat until the test lets the round go."""

    def __init__(self, hold_until: int) -> None:
        self.in_flight = 0
        self.most = 0
        self.beaten: list[str] = []
        self.hold_until = hold_until  # beats in flight at which they are let go
        self.go = asyncio.Event()
        self.round_done = asyncio.Event()
        self.expected = 0

    async def heartbeat(self, worker_id: str) -> HeartbeatReply:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        if self.in_flight >= self.hold_until:
            self.go.set()
        await self.go.wait()
        self.in_flight -= 1
        self.beaten.append(worker_id)
        if len(self.beaten) == self.expected:
            self.round_done.set()
        return HeartbeatReply(ttl_s=30)


async def test_a_round_of_beats_goes_many_at_once_and_covers_every_registered_worker_once():
    demo = Demo(None, "tp", DemoConfig(workers=MIN_WORKERS, actors=0))
    workers = [f"w-{i}" for i in range(3 * BEATS_IN_FLIGHT)]
    beats = Beats(hold_until=BEATS_IN_FLIGHT)
    beats.expected = len(workers)
    demo.wb = beats  # type: ignore[assignment]
    demo.registered.update(dict.fromkeys(workers))
    task = asyncio.create_task(demo.heartbeats())
    try:
        await asyncio.wait_for(beats.round_done.wait(), 10)
    finally:
        await cancel_and_wait(task)
    assert beats.most == BEATS_IN_FLIGHT  # as many as allowed at once, and no more
    assert sorted(beats.beaten) == sorted(workers)  # each registered worker once in the round
