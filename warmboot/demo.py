"""The demo behind `make up`: a simulated fleet driven through the real bus.

Everything goes through the public subjects of CONTRACT.md with `warmboot.client`, as
real workers and lifecycle callers would: about 60 workers in two sandbox classes on
four CPU generations register and heartbeat; a few hundred actors are created,
resumed, paused, suspended and resumed again (and a few more created during the upgrade). The newest generation's runtimes list
the oldest generation's version of the same release in `compatible_versions` (a one-way
edge: its snapshots resume on the newer CPU, not back), and the oldest machines are
retired (drained) early on, so their actors' memory images restore through that edge.
In the middle, a rolling upgrade makes v2 the default with v1 restorable; before v1 is
dropped, the demo asks `scheduler.whatif` what the drop will strand, prints the
forecast, makes the drop and checks the forecast against what fragmentation then
counts. The summary counts what the scheduler answered: placements by action and
fidelity, restores through a compatible version, fallbacks by reason, stranded
snapshots before, during and after the upgrade (forecast beside measured), resumes/s and
a resume's latency from sent to answered (not its wait for a turn among the demo's own
requests); refusals by what was asked, and under the table by phase in the services' words,
those for want of room said to be the size asked for (`summary_notes`). Progress: a bar on a
terminal, plain lines piped (`Steps`).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Coroutine

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from events.errors import ContractError
from events.natsauth import redact_url
from events.natspy.connections import close_within
from events.tasks import cancel_and_wait
from events.runtime_id import Runtimes
from events.schema import (
    ActorOverhead,
    Assignment,
    Attribute,
    CompatVersion,
    CreateActor,
    ErrorCode,
    Fidelity,
    RegisterWorker,
    Resources,
    WhatIf,
    WorkerRuntime,
    WorkerSandboxClass,
)
from events.subjects import DEFAULT_PREFIX
from warmboot.client import Client
from warmboot.connection import connect

CLASSES = ("gvisor", "microvm")
# Four CPU generations, as the probe would report them (distinct attributes per generation),
# oldest first. The newest (3) restores the oldest's (0) snapshots of the same release.
GENERATIONS = {
    "gvisor": [
        {"architecture": "amd64", "cpu_features": f"{h:016x}"}
        for h in (0x0AC853DF914E2CA0, 0x5F1D0C3B2A994E17, 0x9E3779B97F4A7C15, 0x3C6EF372FE94F82B)
    ],
    "microvm": [
        {"architecture": "amd64", "cpu_vendor": "GenuineIntel", "cpu_model": "6/106"},
        {"architecture": "amd64", "cpu_vendor": "GenuineIntel", "cpu_model": "6/143"},
        {"architecture": "amd64", "cpu_vendor": "AuthenticAMD", "cpu_model": "25/17"},
        {"architecture": "amd64", "cpu_vendor": "GenuineIntel", "cpu_model": "6/207"},
    ],
}
OLDEST, NEWEST = 0, 3
ASSET_KEY = {"gvisor": "gvisor_asset_hash", "microvm": "kernel_digest"}
# Generations are uneven (the newest is scarce), so some restores must fall back: the fleet deals its
# workers to the classes in turn, and each round of the classes to the next generation of this cycle.
GENERATION_CYCLE = (OLDEST, OLDEST, NEWEST, 1, 1, 2)


def generation_of(index: int) -> int:
    """The CPU generation of the fleet's worker `index` (`fleet`)."""
    return GENERATION_CYCLE[(index // len(CLASSES)) % len(GENERATION_CYCLE)]


def smallest_fleet() -> int:
    """The fewest workers the demo's story holds with: it retires (drains) the oldest generation and
    restores its images on the newest, through its compatible version, so every class needs a worker of
    the newest generation. With fewer (`up --demo --workers 2`: both of the oldest), every worker was
    drained, and the demo resumed onto no worker and printed a whatif of runtimes no worker accepts
    (a user trial); with none of a class, its whatif was refused NOT_FOUND."""
    needed, count = set(CLASSES), 0
    while needed:
        if generation_of(count) == NEWEST:
            needed.discard(CLASSES[count % len(CLASSES)])
        count += 1
    return count


MIN_WORKERS = smallest_fleet()
# What the demo knows of an actor from its own requests' answers, and which of them a pause and a suspend
# need (CONTRACT: pause from RUNNING only; suspend from RUNNING or PAUSED).
CREATED, RUNNING, PAUSED, SUSPENDED = "CREATED", "RUNNING", "PAUSED", "SUSPENDED"
ALLOWED_FROM = {"pause": (RUNNING,), "suspend": (RUNNING, PAUSED)}
# Actors a worker that the demo's fleet holds at its peak (the upgrade, its oldest generation retired):
# measured on 60 workers (2026-12-07), 540 actors all found room and 600 did not (README, the demo).
ROOMY = 9
BEATS_IN_FLIGHT = 64  # the demo's heartbeats at once (an agent sends one; the demo plays thousands)


def size_error(field: str, value: int) -> str | None:
    """Why the demo cannot run with `value` as its `field` ("workers" or "actors"); None if it can."""
    if field == "workers" and value < MIN_WORKERS:
        return (f"{value} is too few: the demo retires (drains) the oldest CPU generation and restores its images "
                f"on the newest, so it needs a worker of the newest in each sandbox class ({', '.join(CLASSES)}): "
                f"at least {MIN_WORKERS}")
    if field == "actors" and value < 0:
        return f"{value} is not a number of actors (0 or more)"
    return None


def newcomer_count(cfg: "DemoConfig") -> int:
    """How many actors the demo creates during its upgrade (`b-*`), besides its `actors`."""
    return max(2, cfg.actors // 5)


@dataclass
class DemoConfig:
    workers: int = 60
    actors: int = 300
    seed: int = 7
    concurrency: int = 32
    timeout: float = 10.0

    def __post_init__(self) -> None:
        for name in ("workers", "actors"):
            if (why := size_error(name, getattr(self, name))) is not None:
                raise ValueError(f"{name}: {why}")


@dataclass
class Worker:
    worker_id: str
    sandbox_class: str
    generation: int
    capacity: Resources


@dataclass
class Tally:
    placements: Counter = field(default_factory=Counter)  # (action, fidelity)
    edge_restores: int = 0  # MEMORY restores whose stamp matched a compatible version, not the pin's own
    fallbacks: Counter = field(default_factory=Counter)  # reason
    refusals: Counter = field(default_factory=Counter)  # (phase, verb, error code, field)
    refused_as: dict[tuple[str, str, str, str | None], ContractError] = field(default_factory=dict)  # the first of each
    not_asked: Counter = field(default_factory=Counter)  # (phase, verb): its actor not in the state for it
    stranded: dict[str, int] = field(default_factory=dict)  # phase -> count
    forecast_stranded: int | None = None  # whatif's stranded count after the v1 drop, before it was made
    resumes: int = 0
    resume_latencies: list[float] = field(default_factory=list)  # each resume's, from sent to answered
    resume_wall: float = 0.0  # wall time of the resume phases
    in_flight: int = 0  # the demo's requests at once (DemoConfig.concurrency)
    workers: int = 0  # the demo's size, for what the summary says of a fleet that was full
    actors: int = 0
    newcomers: int = 0  # actors created during the upgrade
    retired: int = 0  # workers of the oldest generation, drained
    phase_seconds: dict[str, float] = field(default_factory=dict)  # phase -> its wall time
    requests: int = 0  # the demo's requests answered or refused (heartbeats apart)
    heartbeats: int = 0  # beats of its simulated workers answered, meanwhile
    retries: int = 0  # requests answered UNAVAILABLE (or not at all) and sent again

    @property
    def forecast_agrees(self) -> bool:
        return self.forecast_stranded == self.stranded.get("after v1 dropped")


def version(sandbox_class: str, generation: int, release: str) -> CompatVersion:
    attrs = dict(GENERATIONS[sandbox_class][generation])
    attrs[ASSET_KEY[sandbox_class]] = f"sha256-{sandbox_class}-{release}"
    return CompatVersion(schema_version="v1",
                         attributes=tuple(Attribute(key=k, value=v) for k, v in sorted(attrs.items())))


def runtime(sandbox_class: str, generation: int, release: str) -> WorkerRuntime:
    """The release on one CPU generation; on the newest, it also restores the oldest's snapshots."""
    edges = (version(sandbox_class, OLDEST, release),) if generation == NEWEST else ()
    return WorkerRuntime(
        name=f"{sandbox_class}-{release}",
        version=version(sandbox_class, generation, release),
        actor_overhead=ActorOverhead(fixed_mib=32, per_gib_mib=8),
        compatible_versions=edges,
    )


def known_runtimes() -> Runtimes:
    """Every runtime the demo's fleet can offer, with its name: the labels the views would print."""
    return Runtimes((cls, runtime(cls, g, r).version, runtime(cls, g, r).name)
                    for cls in CLASSES for g in range(len(GENERATIONS[cls])) for r in ("v1", "v2"))


def fleet(cfg: DemoConfig, rng: random.Random) -> list[Worker]:
    workers = []
    for i in range(cfg.workers):
        sandbox_class = CLASSES[i % len(CLASSES)]
        generation = generation_of(i)
        capacity = Resources(cpu_millis=rng.choice((8000, 16000)), memory_mib=rng.choice((8192, 16384)))
        workers.append(Worker(f"w-{sandbox_class[:2]}{generation}-{i:03d}", sandbox_class, generation, capacity))
    return workers


class Demo:
    def __init__(self, nc: Any, prefix: str, cfg: DemoConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.tally = Tally()
        self.workers = fleet(cfg, self.rng)
        # One client for the whole demo: request ids, retries of UNAVAILABLE, and read-your-writes
        # (every read and resume waits for the demo's own last write) are its business.
        self.wb = Client(nc, prefix, timeout=cfg.timeout, attempts=8)
        self.gate = asyncio.Semaphore(cfg.concurrency)
        self.where: dict[str, str] = {}  # actor -> the worker of its last placement
        self.placed: dict[str, int] = {}  # actor -> the seq of its last placement (its Assignment's)
        # ends `heartbeats` also when a request's time-out swallowed its cancellation (Python
        # 3.11's asyncio.wait_for can, when the reply and the cancellation come together)
        self.stopping = False
        self.oldest = [w for w in self.workers if w.generation == OLDEST]
        self.registered: dict[str, None] = {}  # the workers registered so far, in order: `heartbeats` keeps them
        self.state: dict[str, str] = {}  # actor -> CREATED, RUNNING, PAUSED or SUSPENDED, as its answers said
        self.phase = ""  # the phase running, which a refusal is counted under
        self.clock = time.perf_counter
        self.tally.in_flight = cfg.concurrency
        self.tally.workers, self.tally.actors, self.tally.retired = cfg.workers, cfg.actors, len(self.oldest)
        self.tally.newcomers = newcomer_count(cfg)

    async def call(self, request: Coroutine[Any, Any, Any], took: list[float] | None = None) -> Any:
        """`request` once it has its turn (at most `concurrency` at once); with `took`, the time from its
        turn to its answer (or refusal) is appended to it: what warmboot took, not the demo's own queue.
        (Timed from before the turn, a phase's mean latency was mostly its wait there: each phase sends all
        its requests at once, so with 50,000 actors a resume waited some 30 s for its turn behind the others.)"""
        try:
            await self.gate.acquire()
        except BaseException:  # cancelled before its turn (the demo stopping): closed, not warned of as never awaited
            request.close()
            raise
        try:
            started = self.clock()
            try:
                return await request
            finally:
                self.tally.requests += 1
                if took is not None:
                    took.append(self.clock() - started)
        finally:
            self.gate.release()

    def refused(self, verb: str, error: ContractError) -> None:
        """Count a refusal by the phase it came in, what was asked and its code; the first of each is kept
        for the summary, which says why in the service's own words."""
        key = (self.phase, verb, error.code.value, error.field)  # the field too: a full fleet's names none
        self.tally.refusals[key] += 1
        self.tally.refused_as.setdefault(key, error)

    def can(self, verb: str, actor_id: str) -> bool:
        """Whether the demo's record of the actor allows `verb` (pause: running; suspend: running or paused).
        An actor whose resume was refused is not running: its pause is not asked, and counted as not asked,
        rather than refused FAILED_PRECONDITION a second time for the one refusal (a user's trial counted
        3,115 of each)."""
        if self.state.get(actor_id) in ALLOWED_FROM[verb]:
            return True
        self.tally.not_asked[(self.phase, verb)] += 1
        return False

    async def register(self, worker: Worker, releases: tuple[str, ...]) -> None:
        default, *restorable = releases
        entry = WorkerSandboxClass(
            sandbox_class=worker.sandbox_class,
            default_runtime=runtime(worker.sandbox_class, worker.generation, default),
            restorable_runtimes=tuple(runtime(worker.sandbox_class, worker.generation, r) for r in restorable),
        )
        body = RegisterWorker(
            worker_id=worker.worker_id,
            node=f"node-{worker.worker_id}",
            capacity=worker.capacity,
            labels={"generation": f"g{worker.generation}", "zone": f"z{hash(worker.worker_id) % 3}"},
            sandbox_classes=(entry,),
        )
        await self.call(self.wb.register(body))
        self.registered[worker.worker_id] = None

    async def heartbeats(self) -> None:
        """Keep every registered simulated worker alive, as its agent would: a round of beats every
        third of the TTL, counted from the round's start, up to `BEATS_IN_FLIGHT` of them at once and
        apart from the demo's other requests. (One after another, a round of 30,000 workers took
        longer than the TTL, and the first of them were removed as LOST while the round went on.)"""
        loop = asyncio.get_running_loop()
        gate = asyncio.Semaphore(BEATS_IN_FLIGHT)
        interval = 0.5  # until a beat answers the TTL (the shortest a registry takes is 1 s)

        async def beat(worker_id: str) -> float | None:
            async with gate:
                with suppress(ContractError):
                    ttl = (await self.wb.heartbeat(worker_id)).ttl_s
                    self.tally.heartbeats += 1
                    return ttl
            return None

        while not self.stopping:
            started = loop.time()
            ttls = [t for t in await asyncio.gather(*(beat(w) for w in list(self.registered))) if t]
            if ttls:
                interval = max(0.5, min(ttls) / 3)
            await asyncio.sleep(max(0.0, interval - (loop.time() - started)))  # a period, not synchronisation

    async def resume(self, actor_id: str) -> Assignment | None:
        try:
            assignment = await self.call(self.wb.resume(actor_id), self.tally.resume_latencies)
        except ContractError as e:
            self.refused("resume", e)
            return None
        finally:
            self.tally.resumes += 1
        self.state[actor_id] = RUNNING
        self.where[actor_id] = assignment.worker_id
        self.placed[actor_id] = assignment.seq  # what its pause and suspend were taken under
        self.tally.placements[(assignment.action.value, assignment.fidelity.value)] += 1
        matched = assignment.matched_version
        if matched is not None and matched != assignment.sandbox_runtime.version:
            self.tally.edge_restores += 1
        if assignment.fallback:
            self.tally.fallbacks[assignment.fallback.reason.value] += 1
        return assignment

    async def pause(self, actor_id: str) -> bool:
        if not self.can("pause", actor_id):
            return False
        try:
            await self.call(self.wb.pause(actor_id, placement_seq=self.placed.get(actor_id)))
        except ContractError as e:
            self.refused("pause", e)
            return False
        self.state[actor_id] = PAUSED
        return True

    async def suspend(self, actor_id: str, fidelity: Fidelity = Fidelity.MEMORY) -> bool:
        if not self.can("suspend", actor_id):
            return False
        try:
            await self.call(self.wb.suspend(actor_id, fidelity, placement_seq=self.placed.get(actor_id)))
        except ContractError as e:
            self.refused("suspend", e)
            return False
        self.state[actor_id] = SUSPENDED
        return True

    async def resume_all(self, actor_ids: list[str], advance: Callable[[], None]) -> None:
        started = time.perf_counter()
        await each(actor_ids, self.resume, advance)
        self.tally.resume_wall += time.perf_counter() - started

    async def stranded(self) -> int:
        frag = await self.call(self.wb.fragmentation())
        return sum(c.stranded_snapshots for c in frag.classes)

    async def forecast_drop(self, release: str, console: Console) -> int:
        """Ask whatif, per class, what dropping `release` everywhere would strand; print it; the total."""
        from warmboot.cmd_whatif import render_whatif
        from warmboot.render import terminal_width

        runtimes = known_runtimes()
        total = 0
        console.print(f"[bold]what-if[/] before dropping {release} (scheduler.whatif, writes nothing):")
        for cls in CLASSES:
            # the name stands for the release on every CPU generation, as on the command line
            console.print(f"$ warmboot whatif --class {cls} --drop-runtime {cls}-{release} --limit 3",
                          markup=False, highlight=False)
            drop = tuple(version(cls, g, release) for g in range(len(GENERATIONS[cls])))
            query = WhatIf(sandbox_class=cls, drop_runtimes=drop, limit=3)
            answer = await self.call(self.wb.whatif(query))
            total += answer.after.stranded_snapshots
            # as `warmboot whatif` prints it: every column to a pipe or a file (rich's width is 80 then)
            console.print(render_whatif(query, answer, runtimes, terminal_width()), markup=False, highlight=False)
            console.print()
        return total


async def each(items: list[Any], step: Callable[[Any], Awaitable[Any]], advance: Callable[[], None]) -> list[Any]:
    async def one(item: Any) -> Any:
        try:
            return await step(item)
        finally:
            advance()

    return await asyncio.gather(*(one(item) for item in items))


PROGRESS_EVERY_S = 10.0  # piped or to a file: a line of progress this often


class Steps:
    """The demo's progress through its phases: on a terminal, one bar over the whole run (rich's). Piped or
    to a file rich draws no bar until it stops, and a user's trial (`--workers 5000 --actors 50000`, 16
    minutes) printed nothing until its summary; there a plain line every `every` seconds says the phase and
    its steps done. Either way a line as each phase ends gives its wall time (`Tally.phase_seconds`), and
    the phase is the demo's (`Demo.phase`: what a refusal is counted under)."""

    def __init__(self, console: Console, phases: list[tuple[str, int]], demo: Demo,
                 every: float = PROGRESS_EVERY_S) -> None:
        self.console, self.demo, self.every = console, demo, every
        self.names = iter(phases)
        self.total = sum(n for _, n in phases)
        self.done = 0
        self.current: tuple[str, int, float, int] | None = None  # name, steps, started, done when it started
        self.bar = Progress(TextColumn("{task.description:<38}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, transient=False) if console.is_terminal else None
        self.task: Any = None
        self.ticker: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Steps:
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task("", total=self.total)
        else:
            self.ticker = asyncio.create_task(self.tick(self.demo.clock()))
        return self

    async def __aexit__(self, kind: type[BaseException] | None, *_: object) -> None:
        await cancel_and_wait(self.ticker)
        if kind is None:
            self.end_phase()
        if self.bar is not None:
            self.bar.stop()

    def phase(self) -> Callable[[], None]:
        """End the phase running (its line) and begin the next; its step's `advance`."""
        self.end_phase()
        name, steps = next(self.names)
        self.current = (name, steps, self.demo.clock(), self.done)
        self.demo.phase = name
        if self.bar is not None:
            self.bar.update(self.task, description=name)
        return self.advance

    def advance(self, steps: int = 1) -> None:
        self.done += steps
        if self.bar is not None:
            self.bar.advance(self.task, steps)

    def end_phase(self) -> None:
        if self.current is None:
            return
        name, _, started, _ = self.current
        took = self.demo.clock() - started
        self.demo.tally.phase_seconds[name] = took
        self.current = None
        self.console.print(f"{name}: done in {took:.1f} s", markup=False, highlight=False)

    def line(self, elapsed: float) -> str:
        """The plain line of progress: time since the start, the phase, its steps done and the run's."""
        if self.current is None:
            return f"{elapsed:6.0f} s  {self.done:,}/{self.total:,} steps"
        name, steps, _, before = self.current
        return f"{elapsed:6.0f} s  {name}: {self.done - before:,}/{steps:,} ({self.done:,}/{self.total:,} in all)"

    async def tick(self, started: float) -> None:
        while True:
            await asyncio.sleep(self.every)  # a period, not synchronisation
            self.console.print(self.line(self.demo.clock() - started), markup=False, highlight=False)


def views_command(nats_url: str, prefix: str) -> str:
    """The command that shows the demo's fleet: its server (redacted), and its prefix unless the default."""
    with_prefix = "" if prefix == DEFAULT_PREFIX else f" --prefix {prefix}"
    return f"warmboot workers --nats {redact_url(nats_url)}{with_prefix}"


async def run_demo(nats_url: str, prefix: str, cfg: DemoConfig, console: Console,
                   hold: Callable[[], Awaitable[None]] | None = None) -> Tally:
    """Drive the simulated fleet through every phase and print the summary. With `hold`, the
    fleet keeps heartbeating after the summary until `hold` returns (`warmboot up` serving on),
    so that `warmboot workers`, `fragmentation` and `explain` show the fleet the demo left."""
    nc = await connect(nats_url, "warmboot-demo")
    demo = Demo(nc, prefix, cfg)
    actors = [f"a-{i:04d}" for i in range(cfg.actors)]
    classes = {a: CLASSES[i % 2] for i, a in enumerate(actors)}
    newcomers = [f"b-{i:04d}" for i in range(demo.tally.newcomers)]  # created during the upgrade
    classes.update({a: CLASSES[i % 2] for i, a in enumerate(newcomers)})
    # Phases and their step counts, for one progress bar over the whole run.
    phases = [
        ("register the fleet (v1)", len(demo.workers)),
        ("create actors", len(actors)),
        ("cold-start resumes", len(actors)),
        ("pause / suspend", len(actors)),
        ("retire the oldest CPU generation", len(demo.oldest) + len(actors)),
        ("memory restores", len(actors)),
        ("pause again", len(actors)),
        ("upgrade: v2 default, v1 restorable", len(demo.workers)),
        ("resume during the upgrade", len(actors) + 2 * len(newcomers)),
        ("pause on v1 and v2", len(actors) + len(newcomers)),
        ("whatif, then drop v1", len(demo.workers)),
        ("move stranded actors", len(actors)),
        ("settle", len(actors)),
    ]
    beat = None
    try:
        async with Steps(console, phases, demo) as steps:
            advance = steps.phase()
            beat = asyncio.create_task(demo.heartbeats())  # from the first registration: a large fleet's takes a TTL
            await each(demo.workers, lambda w: demo.register(w, ("v1",)), advance)

            advance = steps.phase()
            rng = demo.rng

            async def create(actor_id: str) -> None:
                body = CreateActor(
                    actor_id=actor_id,
                    sandbox_class=classes[actor_id],
                    template_uid="tmpl-1",
                    resources=Resources(cpu_millis=rng.choice((250, 500, 1000)),
                                        memory_mib=rng.choice((256, 512, 1024))),
                )
                try:
                    await demo.call(demo.wb.create(body))
                except ContractError as e:
                    demo.refused("create", e)
                    return
                demo.state[actor_id] = CREATED

            await each(actors, create, advance)
            await demo.resume_all(actors, steps.phase())

            # Half pause (local memory snapshot), a quarter suspend to external memory.
            plan = {a: ("pause" if i % 4 < 2 else "suspend" if i % 4 == 2 else "run") for i, a in enumerate(actors)}

            async def snapshot(actor_id: str) -> None:
                if plan[actor_id] == "pause":
                    await demo.pause(actor_id)
                elif plan[actor_id] == "suspend":
                    await demo.suspend(actor_id)

            await each(actors, snapshot, steps.phase())

            # Retire the oldest CPU generation: its workers are drained (they keep what runs on
            # them) and the images paused there are promoted, so that they may move. They resume
            # from memory on the newest generation, through its compatible version.
            advance = steps.phase()
            await each(demo.oldest, lambda w: demo.call(demo.wb.drain(w.worker_id, "retired")), advance)
            retired = {w.worker_id for w in demo.oldest}
            stuck = [a for a in actors if plan[a] == "pause" and demo.where.get(a) in retired]
            await each(stuck, demo.suspend, advance)
            steps.advance(len(actors) - len(stuck))

            # The paused images first, on their nodes; then the rest, wherever they fit (the
            # retired generation's through the edge): nothing takes the room a paused one needs.
            advance = steps.phase()
            await demo.resume_all([a for a in actors if plan[a] == "pause" and a not in stuck], advance)
            await demo.resume_all([a for a in actors if plan[a] == "suspend" or a in stuck], advance)
            steps.advance(sum(1 for a in actors if plan[a] == "run"))
            # Everyone but the runners pauses again: their latest snapshots are v1 memory images.
            await each(actors, lambda a: demo.pause(a) if plan[a] != "run" else asyncio.sleep(0), steps.phase())
            demo.tally.stranded["before upgrade"] = await demo.stranded()

            await each(demo.workers, lambda w: demo.register(w, ("v2", "v1")), steps.phase())
            demo.tally.stranded["during upgrade (v1 restorable)"] = await demo.stranded()
            # The snapshotted actors of the even indices come back during the upgrade, still on v1
            # images: two thirds of those snapshotted, all of one class (an actor's class is its index's
            # parity), so that class's workers hold the demo's peak (ROOMY). New actors cold-start on v2,
            # the default now: their images are v2.
            back = [a for i, a in enumerate(actors) if plan[a] != "run" and i % 2 == 0]
            advance = steps.phase()
            await demo.resume_all(back, advance)
            await each(newcomers, create, advance)
            await demo.resume_all(newcomers, advance)
            steps.advance(len(actors) - len(back))
            await each(back + newcomers, demo.pause, steps.phase())
            steps.advance(len(actors) - len(back))

            # Before dropping v1: what will it strand? (whatif writes nothing.) Then drop it and count.
            advance = steps.phase()
            demo.tally.forecast_stranded = await demo.forecast_drop("v1", console)
            await each(demo.workers, lambda w: demo.register(w, ("v2",)), advance)
            demo.tally.stranded["after v1 dropped"] = await demo.stranded()

            # Stranded actors move: a paused one is promoted (suspend) so it may leave its node,
            # then resumes with a fallback where no worker can load its v1 image, then pauses on v2.
            async def move(actor_id: str) -> None:
                if plan[actor_id] == "run":
                    return
                await demo.suspend(actor_id)
                await demo.resume(actor_id)

            await each(actors, move, steps.phase())
            await each(actors, lambda a: demo.pause(a) if plan[a] != "run" else asyncio.sleep(0), steps.phase())
            demo.tally.stranded["after the actors moved"] = await demo.stranded()
        demo.tally.retries = demo.wb.retries
        report(demo.tally, console)
        if hold is not None:
            console.print(f"the demo's {len(demo.workers)} workers keep heartbeating: try {views_command(nats_url, prefix)}")
            await hold()
    finally:
        demo.stopping = True
        await cancel_and_wait(beat)
        await close_within(nc)  # given up after CLOSE_GIVEN_UP_S: `up` stopping with its server frozen
    return demo.tally


def report(tally: Tally, console: Console) -> None:
    console.print(summary(tally))
    if tally.forecast_agrees:
        console.print(f"whatif's forecast of the v1 drop ({tally.forecast_stranded} stranded) is what the drop did")
    else:
        console.print(f"[red]whatif forecast {tally.forecast_stranded} stranded snapshots after the v1 drop; "
                      f"fragmentation counted {tally.stranded.get('after v1 dropped')}[/]")
    for line in summary_notes(tally):
        console.print(line, markup=False, highlight=False)


def summary_notes(tally: Tally) -> list[str]:
    """What the summary's refusals were, in the services' own words (the first of each kind), and what the
    user can do about the ones the demo's size caused (the scenario refuses nothing on purpose: its drain
    and its v1 drop give fallbacks, which are placements); and, when its workers' heartbeats were most of
    what the services answered, that they were (the fleet's own load, which slows the demo's steps)."""
    notes = []
    for key, n in tally.refusals.items():
        phase, verb, _, _ = key
        error = tally.refused_as[key]
        notes.append(f"{n:,} {plural(verb, n)} in '{phase}' refused {error}")
    full = sum(n for (_, verb, code, named), n in tally.refusals.items()  # (another verb's: a registry's limits)
               if verb == "resume" and code == ErrorCode.RESOURCE_EXHAUSTED.value and named is None)
    if full:  # no field: room coming free could place it (Client.resume)
        notes.append(f"{full:,} {plural('resume', full)} refused for want of room (RESOURCE_EXHAUSTED naming no "
                     f"field): the fleet was full. That is the size asked for, not a fault: {tally.actors:,} actors "
                     f"(and {tally.newcomers:,} created during the upgrade) on {tally.workers:,} workers, "
                     f"{tally.retired:,} of them retired, is more than the fleet holds at the demo's peak; fewer "
                     f"--actors or more --workers keep it in room (about {ROOMY} actors a worker fit; the default is "
                     f"{DemoConfig.actors // DemoConfig.workers})")
    answered = tally.requests + tally.heartbeats
    if answered and tally.heartbeats > tally.requests:
        notes.append(f"{tally.heartbeats:,} of the {answered:,} requests the services answered over the demo's phases "
                     f"({100 * tally.heartbeats / answered:.0f}%) were its {tally.workers:,} workers' heartbeats, "
                     f"the fleet's own load: its steps ran slower for them than with fewer workers")
    for (phase, verb), n in tally.not_asked.items():
        needs = " or ".join(ALLOWED_FROM[verb])
        notes.append(f"{n:,} {plural(verb, n)} in '{phase}' not asked: the actor was not {needs} "
                     f"(a request of it was refused before)")
    return notes


def plural(verb: str, n: int) -> str:
    return verb if n == 1 else f"{verb}s"


def percentile(values: list[float], share: float) -> float:
    """The value `share` of the way up `values` (nearest rank); 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


def summary(tally: Tally) -> Table:
    table = Table(title="warmboot demo summary", show_lines=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for (action, fidelity), n in sorted(tally.placements.items()):
        table.add_row(f"placements {action} {fidelity}", str(n))
    for reason, n in sorted(tally.fallbacks.items()):
        table.add_row(f"fallbacks {reason}", str(n))
    # by what was asked (the phases, and why, under the table: `summary_notes`); 80 columns in a pipe
    refused, not_asked = Counter(), Counter()
    for (_, verb, code, _), n in tally.refusals.items():
        refused[(code, verb)] += n
    for (_, verb), n in tally.not_asked.items():
        not_asked[verb] += n
    for (code, verb), n in sorted(refused.items()):
        table.add_row(f"refused {code}, {verb} (see below)", str(n))
    for verb, n in sorted(not_asked.items()):
        table.add_row(f"{verb} not asked, its actor refused before", str(n))
    table.add_row("restores through a compatible version", str(tally.edge_restores))
    for phase, n in tally.stranded.items():
        table.add_row(f"stranded snapshots {phase}", str(n))
        if phase == "after v1 dropped":
            table.add_row("stranded snapshots after v1 dropped, forecast by whatif", str(tally.forecast_stranded))
            table.add_row("whatif forecast agrees with the drop", "yes" if tally.forecast_agrees else "NO")
    run = sum(tally.phase_seconds.values())
    table.add_row("the demo's requests/s, over its phases", f"{tally.requests / run:.0f}" if run else "-")
    table.add_row("heartbeats/s meanwhile (the fleet's own load)", f"{tally.heartbeats / run:.0f}" if run else "-")
    table.add_row("resumes", str(tally.resumes))
    table.add_row("requests retried after UNAVAILABLE or a time-out", str(tally.retries))
    rate = tally.resumes / tally.resume_wall if tally.resume_wall else 0.0
    table.add_row("resumes/s (wall time of the resume phases)", f"{rate:.0f}")
    table.add_row("requests in flight at once (the demo's load)", str(tally.in_flight))
    took = tally.resume_latencies
    table.add_row("resume latency, sent to answered (p50 / p99 ms)",
                  f"{1000 * percentile(took, 0.5):.1f} / {1000 * percentile(took, 0.99):.1f}")
    table.add_row("resume latency, sent to answered (mean ms)", f"{1000 * sum(took) / max(1, len(took)):.1f}")
    return table
