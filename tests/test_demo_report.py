"""What the demo's summary says (its requests played by a stand-in client; the demo on a real server:
tests/test_operate.py and tests/test_up_surface.py).

A user's trial (`up --demo --workers 5000 --actors 50000`, piped) printed nothing for 16 minutes, then a
mean resume latency of 33.8 s and 3,115 each of FAILED_PRECONDITION and RESOURCE_EXHAUSTED. The latency
was timed from before a request's turn among the demo's 32 in flight, so it was mostly the demo's own
queue (each phase sends all its requests at once); the RESOURCE_EXHAUSTED were resumes of actors created
during the upgrade on a fleet that was full at that size, and the FAILED_PRECONDITION the pauses the demo
then asked of those same actors, which were not running.
"""

from __future__ import annotations

import asyncio
import io

from rich.console import Console

from events.errors import ContractError
from events.schema import ErrorCode
from warmboot.demo import MIN_WORKERS, Demo, DemoConfig, Steps, summary_notes, summary

FULL = ContractError(ErrorCode.RESOURCE_EXHAUSTED, "0/6 workers available: 3 class not registered, "
                     "3 insufficient memory; no worker of the class fits")


class Clock:
    """The demo's clock, moved on only by the stand-in's requests: each takes one second."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Refusing:
    """A client whose resumes take a second each (on `Clock`) and are refused: the fleet is full."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.paused: list[str] = []

    async def resume(self, actor_id: str) -> None:
        await asyncio.sleep(0)  # the others wait for their turn meanwhile
        self.clock.now += 1.0
        raise FULL

    async def pause(self, actor_id: str, placement_seq: int | None = None) -> None:
        self.paused.append(actor_id)


def demo_with(client: Refusing, clock: Clock, concurrency: int) -> Demo:
    demo = Demo(None, "warmboot", DemoConfig(workers=MIN_WORKERS, actors=3, concurrency=concurrency))
    demo.wb = client  # type: ignore[assignment]
    demo.clock = clock
    return demo


async def test_a_resumes_latency_is_from_its_turn_not_from_the_demos_queue():
    """Three resumes sent at once, one at a time: each took a second of warmboot's time. Timed from before
    its turn, the third counted the two before it (a mean of 2 s instead of 1)."""
    clock = Clock()
    client = Refusing(clock)
    demo = demo_with(client, clock, concurrency=1)
    await asyncio.gather(*(demo.resume(a) for a in ("a-0", "a-1", "a-2")))
    assert demo.tally.resume_latencies == [1.0, 1.0, 1.0]
    assert demo.tally.resumes == 3
    rows = table_rows(summary(demo.tally))
    assert rows["resume latency, sent to answered (mean ms)"] == "1000.0"
    assert rows["resume latency, sent to answered (p50 / p99 ms)"] == "1000.0 / 1000.0"
    assert rows["requests in flight at once (the demo's load)"] == "1"


async def test_a_refusal_is_counted_under_its_phase_and_said_why_and_its_actor_is_not_paused():
    clock = Clock()
    client = Refusing(clock)
    demo = demo_with(client, clock, concurrency=4)
    demo.phase = "resume during the upgrade"
    for actor in ("b-0", "b-1"):
        await demo.resume(actor)
    demo.phase = "pause on v1 and v2"
    assert [await demo.pause(a) for a in ("b-0", "b-1")] == [False, False]
    assert client.paused == []  # not asked: it would be refused FAILED_PRECONDITION (it is CREATED)

    rows = table_rows(summary(demo.tally))
    assert rows["refused RESOURCE_EXHAUSTED, resume (see below)"] == "2"
    assert rows["pause not asked, its actor refused before"] == "2"
    assert not any("FAILED_PRECONDITION" in what for what in rows)
    notes = summary_notes(demo.tally)
    assert notes[0] == f"2 resumes in 'resume during the upgrade' refused {FULL}"
    assert notes[1].startswith("2 resumes refused for want of room (RESOURCE_EXHAUSTED naming no field): the "
                               f"fleet was full. That is the size asked for, not a fault: 3 actors (and 2 created during the upgrade) on {MIN_WORKERS} "
                               f"workers, {len(demo.oldest)} of them retired")
    assert notes[2] == "2 pauses in 'pause on v1 and v2' not asked: the actor was not RUNNING (a request of it " \
                       "was refused before)"
    # a RESOURCE_EXHAUSTED of another verb (a registry's write budget, say) is no full fleet
    demo.tally = type(demo.tally)()
    demo.phase = "register the fleet (v1)"
    demo.refused("register", ContractError(ErrorCode.RESOURCE_EXHAUSTED, "write budget spent"))
    assert summary_notes(demo.tally) == ["1 register in 'register the fleet (v1)' refused RESOURCE_EXHAUSTED: "
                                         "write budget spent"]


async def test_piped_the_progress_is_plain_lines_every_period_and_at_each_phase_end():
    """To a pipe or a file rich draws no bar: a line comes every period, and one as each phase ends."""
    written = asyncio.Event()

    class Out(io.StringIO):
        def write(self, text: str) -> int:
            if "steps" not in text and "in all" in text:  # a line of progress (not a phase's end)
                written.set()
            return super().write(text)

    out = Out()
    console = Console(file=out, width=200)
    assert not console.is_terminal
    clock = Clock()
    demo = demo_with(Refusing(clock), clock, concurrency=1)
    async with Steps(console, [("first", 4), ("second", 2)], demo, every=0.001) as steps:
        advance = steps.phase()
        advance()
        clock.now = 12.0
        await asyncio.wait_for(written.wait(), 10)
        steps.phase()
        clock.now = 20.0
    lines = out.getvalue().splitlines()
    assert "    12 s  first: 1/4 (1/6 in all)" in lines
    assert "first: done in 12.0 s" in lines and lines[-1] == "second: done in 8.0 s"
    assert demo.tally.phase_seconds == {"first": 12.0, "second": 8.0}


def table_rows(table) -> dict[str, str]:
    """The summary table as {what: value}."""
    what, value = table.columns
    return dict(zip(what._cells, value._cells))


def test_a_fleet_whose_heartbeats_are_most_of_the_traffic_is_said_so():
    """At 5,000 workers the demo's simulated agents beat about 900 times a second, most of what the
    services answered (README, the demo: measured by hand). The summary gives both rates and says so."""
    demo = Demo(None, "warmboot", DemoConfig(workers=5000, actors=2000))
    demo.tally.requests, demo.tally.heartbeats = 2_000, 8_000
    demo.tally.phase_seconds = {"register the fleet (v1)": 6.0, "create actors": 4.0}
    rows = table_rows(summary(demo.tally))
    assert rows["the demo's requests/s, over its phases"] == "200"
    assert rows["heartbeats/s meanwhile (the fleet's own load)"] == "800"
    assert "8,000 of the 10,000 requests the services answered over the demo's phases (80%) were its 5,000 " \
           "workers' heartbeats, the fleet's own load: its steps ran slower for them than with fewer workers" \
        in summary_notes(demo.tally)
    demo.tally.heartbeats = 1_000
    assert not any("heartbeats" in note for note in summary_notes(demo.tally))


async def test_resumes_refused_for_want_of_room_are_counted_apart_from_those_naming_a_field():
    """A phase's resumes refused RESOURCE_EXHAUSTED, some naming no field (the fleet full) and some naming one
    (no undrained worker with the labels, an image LOCAL elsewhere: more room does not place them): only the
    former are said to be for want of room. The count went by the phase's first such refusal: a first naming a
    field hid every full-fleet one, and a first naming none counted the others as the fleet full."""
    labels = ContractError(ErrorCode.RESOURCE_EXHAUSTED, "no undrained worker of the class has the labels its "
                           "selectors ask for", "selectors")
    for first, then in ((labels, FULL), (FULL, labels)):
        demo = demo_with(Refusing(Clock()), Clock(), concurrency=1)
        demo.phase = "resume during the upgrade"
        demo.refused("resume", first)
        demo.refused("resume", then)
        demo.refused("resume", then)
        full = 2 if then is FULL else 1
        notes = [n for n in summary_notes(demo.tally) if "for want of room" in n]
        assert len(notes) == 1 and notes[0].startswith(f"{full} resume{'s' if full > 1 else ''} refused for want "
                                                       "of room"), notes
        assert table_rows(summary(demo.tally))["refused RESOURCE_EXHAUSTED, resume (see below)"] == "3"
