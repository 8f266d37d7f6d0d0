"""The demo behind `make up`: a simulated fleet driven through the real bus.

Everything goes through the public subjects of CONTRACT.md, as real workers and
lifecycle callers would: about 60 workers in two sandbox classes on three CPU
generations register and heartbeat; a few hundred actors are created, resumed,
paused, suspended and resumed again; in the middle, a rolling upgrade makes v2 the
default with v1 restorable, and later drops v1. The summary counts what the
scheduler answered: placements by action and fidelity, fallbacks by reason,
stranded snapshots before, during and after the upgrade, and resumes/s.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from events.errors import ContractError
from events.schema import (
    ActorOverhead,
    Assignment,
    Attribute,
    CompatVersion,
    CreateActor,
    ErrorCode,
    Fidelity,
    Fragmentation,
    FragmentationQuery,
    Heartbeat,
    HeartbeatReply,
    PauseActor,
    RegisterReply,
    RegisterWorker,
    Resources,
    ResumeActor,
    SeqReply,
    SnapshotReply,
    SuspendActor,
    WorkerRuntime,
    WorkerSandboxClass,
)
from events.subjects import service_subject
from services.common import call
from warmboot.runner import connect

CLASSES = ("gvisor", "microvm")
# Three CPU generations, as the probe would report them (distinct attributes per generation).
GENERATIONS = {
    "gvisor": [
        {"architecture": "amd64", "cpu_features": f"{h:016x}"}
        for h in (0x0AC853DF914E2CA0, 0x5F1D0C3B2A994E17, 0x9E3779B97F4A7C15)
    ],
    "microvm": [
        {"architecture": "amd64", "cpu_vendor": "GenuineIntel", "cpu_model": "6/106"},
        {"architecture": "amd64", "cpu_vendor": "GenuineIntel", "cpu_model": "6/143"},
        {"architecture": "amd64", "cpu_vendor": "AuthenticAMD", "cpu_model": "25/17"},
    ],
}
ASSET_KEY = {"gvisor": "gvisor_asset_hash", "microvm": "kernel_digest"}


@dataclass
class DemoConfig:
    workers: int = 60
    actors: int = 300
    seed: int = 7
    concurrency: int = 32
    timeout: float = 10.0


@dataclass
class Worker:
    worker_id: str
    sandbox_class: str
    generation: int
    capacity: Resources


@dataclass
class Tally:
    placements: Counter = field(default_factory=Counter)  # (action, fidelity)
    fallbacks: Counter = field(default_factory=Counter)  # reason
    refusals: Counter = field(default_factory=Counter)  # error code
    stranded: dict[str, int] = field(default_factory=dict)  # phase -> count
    resumes: int = 0
    resume_seconds: float = 0.0  # summed latency
    resume_wall: float = 0.0  # wall time of the resume phases
    retries: int = 0  # requests answered UNAVAILABLE and sent again


def runtime(sandbox_class: str, generation: int, release: str) -> WorkerRuntime:
    attrs = dict(GENERATIONS[sandbox_class][generation])
    attrs[ASSET_KEY[sandbox_class]] = f"sha256-{sandbox_class}-{release}"
    return WorkerRuntime(
        name=f"{sandbox_class}-{release}",
        version=CompatVersion(
            schema_version="v1",
            attributes=tuple(Attribute(key=k, value=v) for k, v in sorted(attrs.items())),
        ),
        actor_overhead=ActorOverhead(fixed_mib=32, per_gib_mib=8),
    )


def fleet(cfg: DemoConfig, rng: random.Random) -> list[Worker]:
    workers = []
    for i in range(cfg.workers):
        sandbox_class = CLASSES[i % 2]
        # Generations are uneven (the newest is scarce), so some restores must fall back.
        generation = (0, 0, 0, 1, 1, 2)[(i // 2) % 6]
        capacity = Resources(cpu_millis=rng.choice((8000, 16000)), memory_mib=rng.choice((8192, 16384)))
        workers.append(Worker(f"w-{sandbox_class[:2]}{generation}-{i:03d}", sandbox_class, generation, capacity))
    return workers


class Demo:
    def __init__(self, nc: Any, prefix: str, cfg: DemoConfig):
        self.nc = nc
        self.prefix = prefix
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.tally = Tally()
        self.workers = fleet(cfg, self.rng)
        self.releases: dict[str, tuple[str, ...]] = {}  # worker -> (default, *restorable) releases
        self.gate = asyncio.Semaphore(cfg.concurrency)
        self.seqs: dict[str, int] = {}  # actor -> seq of its last write: the next resume's min_seq
        self.steps: dict[str, int] = {}

    def subject(self, service: str, verb: str, entity: str | None = None) -> str:
        return service_subject(self.prefix, service, verb, entity)

    async def request(self, service: str, verb: str, entity: str | None, body: Any, reply: type) -> Any:
        """One request, retried with the same body (and request_id) while it is UNAVAILABLE,
        as a careful client does: a retry gets the first answer, never a second write."""
        for attempt in range(8):
            try:
                async with self.gate:
                    return await call(self.nc, self.subject(service, verb, entity), body, reply, self.cfg.timeout)
            except ContractError as e:
                if e.code is not ErrorCode.UNAVAILABLE or attempt == 7:
                    raise
                self.tally.retries += 1
                await asyncio.sleep(0.1 * (attempt + 1))  # client back-off

    def request_id(self, actor_id: str, verb: str) -> str:
        self.steps[actor_id] = self.steps.get(actor_id, 0) + 1
        return f"demo-{actor_id}-{verb}-{self.steps[actor_id]}"

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
        await self.request("registry", "register", worker.worker_id, body, RegisterReply)
        self.releases[worker.worker_id] = releases

    async def heartbeats(self) -> None:
        """Keep every simulated worker alive, as its agent would."""
        interval = 3.0
        while True:
            for worker in self.workers:
                with suppress(ContractError):
                    reply = await self.request("registry", "heartbeat", worker.worker_id, Heartbeat(), HeartbeatReply)
                    interval = max(0.5, reply.ttl_s / 3)
            await asyncio.sleep(interval)  # a heartbeat period, not synchronisation

    async def resume(self, actor_id: str) -> Assignment | None:
        started = time.perf_counter()
        try:
            body = ResumeActor(min_seq=self.seqs.get(actor_id), request_id=self.request_id(actor_id, "resume"))
            assignment = await self.request("scheduler", "resume", actor_id, body, Assignment)
        except ContractError as e:
            self.tally.refusals[e.code.value] += 1
            return None
        finally:
            self.tally.resumes += 1
            self.tally.resume_seconds += time.perf_counter() - started
        self.seqs[actor_id] = assignment.seq
        self.tally.placements[(assignment.action.value, assignment.fidelity.value)] += 1
        if assignment.fallback:
            self.tally.fallbacks[assignment.fallback.reason.value] += 1
        return assignment

    async def pause(self, actor_id: str) -> bool:
        try:
            body = PauseActor(request_id=self.request_id(actor_id, "pause"))
            reply = await self.request("snapshotter", "pause", actor_id, body, SnapshotReply)
            self.seqs[actor_id] = reply.seq
            return True
        except ContractError as e:
            self.tally.refusals[e.code.value] += 1
            return False

    async def suspend(self, actor_id: str, fidelity: Fidelity = Fidelity.MEMORY) -> bool:
        try:
            body = SuspendActor(fidelity=fidelity, request_id=self.request_id(actor_id, "suspend"))
            reply = await self.request("snapshotter", "suspend", actor_id, body, SnapshotReply)
            self.seqs[actor_id] = reply.seq
            return True
        except ContractError as e:
            self.tally.refusals[e.code.value] += 1
            return False

    async def resume_all(self, actor_ids: list[str], advance: Callable[[], None]) -> None:
        started = time.perf_counter()
        await each(actor_ids, self.resume, advance)
        self.tally.resume_wall += time.perf_counter() - started

    async def stranded(self) -> int:
        frag = await self.request("scheduler", "fragmentation", None, FragmentationQuery(), Fragmentation)
        return sum(c.stranded_snapshots for c in frag.classes)


async def each(items: list[Any], step: Callable[[Any], Awaitable[Any]], advance: Callable[[], None]) -> list[Any]:
    async def one(item: Any) -> Any:
        try:
            return await step(item)
        finally:
            advance()

    return await asyncio.gather(*(one(item) for item in items))


async def run_demo(nats_url: str, prefix: str, cfg: DemoConfig, console: Console) -> Tally:
    nc = await connect(nats_url, "warmboot-demo")
    demo = Demo(nc, prefix, cfg)
    actors = [f"a-{i:04d}" for i in range(cfg.actors)]
    classes = {a: CLASSES[i % 2] for i, a in enumerate(actors)}
    # Phases and their step counts, for one progress bar over the whole run.
    phases = [
        ("register the fleet (v1)", len(demo.workers)),
        ("create actors", len(actors)),
        ("cold-start resumes", len(actors)),
        ("pause / suspend", len(actors)),
        ("memory restores", len(actors)),
        ("pause again", len(actors)),
        ("upgrade: v2 default, v1 restorable", len(demo.workers)),
        ("resume during the upgrade", len(actors)),
        ("pause on v1 and v2", len(actors)),
        ("drop v1", len(demo.workers)),
        ("move stranded actors", len(actors)),
        ("settle", len(actors)),
    ]
    beat = None
    progress = Progress(
        TextColumn("{task.description:<38}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=False,
    )
    try:
        with progress:
            task = progress.add_task("", total=sum(n for _, n in phases))
            names = iter(phases)

            def phase() -> Callable[[], None]:
                progress.update(task, description=next(names)[0])
                return lambda: progress.advance(task)

            advance = phase()
            await each(demo.workers, lambda w: demo.register(w, ("v1",)), advance)
            beat = asyncio.create_task(demo.heartbeats())

            advance = phase()
            rng = demo.rng

            async def create(actor_id: str) -> None:
                body = CreateActor(
                    actor_id=actor_id,
                    sandbox_class=classes[actor_id],
                    template_uid="tmpl-1",
                    resources=Resources(cpu_millis=rng.choice((250, 500, 1000)),
                                        memory_mib=rng.choice((256, 512, 1024))),
                    request_id=demo.request_id(actor_id, "create"),
                )
                with suppress(ContractError):
                    reply = await demo.request("snapshotter", "create", actor_id, body, SeqReply)
                    demo.seqs[actor_id] = reply.seq

            await each(actors, create, advance)
            await demo.resume_all(actors, phase())

            # Half pause (local memory snapshot), a quarter suspend to external memory.
            plan = {a: ("pause" if i % 4 < 2 else "suspend" if i % 4 == 2 else "run") for i, a in enumerate(actors)}

            async def snapshot(actor_id: str) -> None:
                if plan[actor_id] == "pause":
                    await demo.pause(actor_id)
                elif plan[actor_id] == "suspend":
                    await demo.suspend(actor_id)

            await each(actors, snapshot, phase())
            await demo.resume_all([a for a in actors if plan[a] != "run"], phase())
            progress.advance(task, sum(1 for a in actors if plan[a] == "run"))
            # Everyone but the runners pauses again: their latest snapshots are v1 memory images.
            await each(actors, lambda a: demo.pause(a) if plan[a] != "run" else asyncio.sleep(0), phase())
            demo.tally.stranded["before upgrade"] = await demo.stranded()

            await each(demo.workers, lambda w: demo.register(w, ("v2", "v1")), phase())
            demo.tally.stranded["during upgrade (v1 restorable)"] = await demo.stranded()
            # Half of the paused actors come back during the upgrade: still on v1 images.
            back = [a for i, a in enumerate(actors) if plan[a] != "run" and i % 2 == 0]
            await demo.resume_all(back, phase())
            progress.advance(task, len(actors) - len(back))
            await each(back, demo.pause, phase())
            progress.advance(task, len(actors) - len(back))

            await each(demo.workers, lambda w: demo.register(w, ("v2",)), phase())
            demo.tally.stranded["after v1 dropped"] = await demo.stranded()

            # Stranded actors move: a paused one is promoted (suspend) so it may leave its node,
            # then resumes with a fallback where no worker can load its v1 image, then pauses on v2.
            async def move(actor_id: str) -> None:
                if plan[actor_id] == "run":
                    return
                await demo.suspend(actor_id)
                await demo.resume(actor_id)

            await each(actors, move, phase())
            await each(actors, lambda a: demo.pause(a) if plan[a] != "run" else asyncio.sleep(0), phase())
            demo.tally.stranded["after the actors moved"] = await demo.stranded()
    finally:
        if beat:
            beat.cancel()
            with suppress(asyncio.CancelledError):
                await beat
        await nc.close()
    console.print(summary(demo.tally))
    return demo.tally


def summary(tally: Tally) -> Table:
    table = Table(title="warmboot demo summary", show_lines=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for (action, fidelity), n in sorted(tally.placements.items()):
        table.add_row(f"placements {action} {fidelity}", str(n))
    for reason, n in sorted(tally.fallbacks.items()):
        table.add_row(f"fallbacks {reason}", str(n))
    for code, n in sorted(tally.refusals.items()):
        table.add_row(f"refused {code}", str(n))
    for phase, n in tally.stranded.items():
        table.add_row(f"stranded snapshots {phase}", str(n))
    table.add_row("resumes", str(tally.resumes))
    table.add_row("requests retried after UNAVAILABLE", str(tally.retries))
    rate = tally.resumes / tally.resume_wall if tally.resume_wall else 0.0
    table.add_row("resumes/s (wall time of the resume phases)", f"{rate:.0f}")
    table.add_row("resume latency (mean ms)", f"{1000 * tally.resume_seconds / max(1, tally.resumes):.1f}")
    return table
