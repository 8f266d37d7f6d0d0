"""A model of the contract against `decide`, and rule 8 decided-then-committed on the bus.

The model (pure): the registry's Worker and the snapshotter's Actor aggregates produce
the events from random valid requests, folded into the scheduler's Projection
(tests.factories.Log). Every decision is checked against an independent reading of
section 3 computed from the aggregates' own state and a ledger of bookings (not from the
projection): refuse or place, at which fidelity, on a worker of the winning tier; that
the image loads where it is sent; and that a fresh replay and a checkpoint restore
decide the same. Unlike tests/test_placement_review.py's audit (is a placement allowed?),
it also checks the choice (is it the best tier the rules allow?).

On the bus: a MEMORY restore decided on a worker, then a registry change of that worker,
then the commit of the stale decision: refused (the fence), and no ActorPlaced.
"""

from __future__ import annotations

import asyncio
import random
from datetime import datetime, timedelta, timezone

import pytest

from events.compat import compat_key, same_version
from events.errors import ContractError
from events.schema import (
    ActorPlaced,
    Attribute,
    CompatVersion,
    CreateActor,
    ErrorCode,
    Fidelity,
    Location,
    PlacedFidelity,
    RegisterWorker,
    ReleaseReason,
    Resources,
    WorkerBooked,
    WorkerFenced,
)
from events.states import ActorState
from events.validate import check_request
from services.registry.domain import Worker as RegWorker
from services.scheduler.checkpoint_codec import export_state, restore_state
from services.scheduler.committer import Job, placed_event
from services.scheduler.decide import decide
from services.snapshotter.domain import Actor as SnapActor
from services.snapshotter.placements import PlacementFold
from tests.factories import CLASS, Log, entry, golden, last_seq, read_log, runtime, version
from tests.factories import actor as actor_body
from tests.factories import worker as worker_body
from warmboot.client import Client

T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)
RESERVE = 64

NOARCH = CompatVersion(schema_version="v2", attributes=(Attribute(key="kernel_digest", value="k1"),))
POOL = [
    version("a"),  # amd64
    version("b"),  # amd64
    version("a", arch="arm64"),
    version("c", schema="v2"),
    NOARCH,
]
NODES = ["n1", "n2", "n3"]
WORKERS = ["w1", "w2", "w3", "w4", "w5"]
ACTORS = ["a1", "a2", "a3", "a4", "a5", "a6"]


def arch_of(v: CompatVersion) -> str | None:
    return next((a.value for a in v.attributes if a.key == "architecture"), None)


def loadable(arch: str) -> list[CompatVersion]:
    """The versions of POOL a worker on an `arch` machine may restore: of its architecture, or
    naming none (the registry refuses others)."""
    return [v for v in POOL if arch_of(v) in (None, arch)]


def shuffled(v: CompatVersion, rng: random.Random) -> CompatVersion:
    """The same version with its attributes in another order (order carries no meaning)."""
    attrs = list(v.attributes)
    rng.shuffle(attrs)
    return CompatVersion(schema_version=v.schema_version, attributes=tuple(attrs))


# --- the independent model of the contract ---------------------------------------------------------


def accepting(entry, stamp_version: CompatVersion) -> list:
    """Every (role, runtime) of the worker class entry that accepts the stamp, best role first
    (rule 2): own version as default (0) or restorable (1), then an edge of the default (2) or
    of a restorable (3). A worker whose first one has no room for the actor (its overhead) may
    still restore the image through the next (docs/contract.md, rule 2)."""
    rts = [(0, entry.default_runtime)] + [(1, r) for r in entry.restorable_runtimes]
    found = [(role, r) for role, r in rts if same_version(r.version, stamp_version)]
    found += [(role + 2, r) for role, r in rts if any(same_version(v, stamp_version) for v in r.compatible_versions)]
    return found


def overhead(r, mem: int) -> int:
    o = r.actor_overhead
    if o is None:
        return 0
    return o.fixed_mib + o.per_gib_mib * -(-mem // 1024)


class Model:
    """The system as its aggregates see it, plus the scheduler's bookings."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.log = Log()
        self.t = 0
        self.workers: dict[str, RegWorker] = {}
        self.actors: dict[str, SnapActor] = {}
        self.booked: dict[str, tuple[str, int, int]] = {}  # actor -> (worker, cpu, mem) while RUNNING
        self.placements = PlacementFold()
        self.created: dict[str, CreateActor] = {}  # each actor's creation request, in its current life
        self.goldens = 0  # golden images made: each has an id of its own (one id names one image)
        self.decisions = 0
        self.refusals = 0
        self.fallbacks = 0

    def at(self) -> datetime:
        self.t += 1
        return T0 + timedelta(seconds=self.t)

    def emit(self, bodies) -> None:
        for body in bodies:
            self.log.add(body)
            for release in self.placements.apply(0, body):
                self.release_removed(release)

    def emit_worker(self, w: RegWorker) -> None:
        bodies = [r.body for r in w.collect_events()]
        if bodies:
            bodies.append(WorkerFenced(at=self.at(), worker_id=w.entity_id, event=type(bodies[-1]).__name__))
        self.emit(bodies)

    def emit_actor(self, a: SnapActor) -> None:
        self.emit([r.body for r in a.collect_events()])

    def release_removed(self, release) -> None:
        a = self.actors[release.actor_id]
        if a.assignment is not None and a.assignment.worker_id == release.worker_id:
            a.release(a.assignment, ReleaseReason.WORKER_REMOVED, None, self.at())
            self.booked.pop(a.entity_id, None)
            self.log.add(a.collect_events()[-1].body)

    # --- random requests, as valid callers send them --------------------------------------------

    def random_runtime(self, own: CompatVersion, arch: str):
        """A runtime of version `own` on a worker on an `arch` machine: its edges are of the
        machine's architecture (the registry refuses others)."""
        rng = self.rng
        edges = tuple(shuffled(v, rng) for v in loadable(arch) if not same_version(v, own) and rng.random() < 0.2)
        return runtime(shuffled(own, rng), overhead=rng.choice([0, 0, 16, 64, 600]), compatible=edges,
                       per_gib=rng.choice([0, 0, 8]))

    def random_registration(self, wid: str, keep_node: str | None) -> RegisterWorker:
        rng = self.rng
        default = rng.choice(POOL)
        arch = arch_of(default) or rng.choice(["amd64", "arm64"])  # a default naming none: a machine all the same
        restorable = tuple(self.random_runtime(v, arch) for v in loadable(arch)
                           if not same_version(v, default) and rng.random() < 0.35)
        node = keep_node if keep_node is not None and rng.random() < 0.8 else rng.choice(NODES)
        return RegisterWorker(
            worker_id=wid, node=node,
            capacity=Resources(cpu_millis=4000, memory_mib=rng.choice([700, 1300, 2400])),
            labels={"zone": rng.choice(["a", "b"])},
            sandbox_classes=(entry(self.random_runtime(default, arch), restorable),),
        )

    def register(self, wid: str) -> None:
        w = self.workers.setdefault(wid, RegWorker(wid))
        req = check_request(RegisterWorker, self.random_registration(wid, w.node if w.alive else None))
        w.register(req, self.at())
        self.emit_worker(w)

    def drain(self, wid: str) -> None:
        self.change(wid, RegWorker.drain)

    def remove(self, wid: str) -> None:
        self.change(wid, RegWorker.remove)

    def change(self, wid: str, verb) -> None:
        """A drain or a removal of a registered worker (nothing for one that is not)."""
        w = self.workers.get(wid)
        if w is None or not w.alive:
            return
        verb(w, "x", self.at())
        self.emit_worker(w)

    def create(self, aid: str) -> None:
        rng = self.rng
        a = self.actors.setdefault(aid, SnapActor(aid))
        if a.alive:
            return
        g = None
        if rng.random() < 0.4:
            stamp = shuffled(rng.choice(POOL), rng) if rng.random() < 0.85 else None  # an unstamped golden too
            self.goldens += 1
            g = golden(stamp, fidelity=rng.choice(list(Fidelity)), template=rng.choice(["t1", "t1", "t2"]),
                       snapshot_id=f"golden-{self.goldens}")
        req = CreateActor(actor_id=aid, sandbox_class=CLASS, template_uid="t1",
                          resources=Resources(cpu_millis=100, memory_mib=rng.choice([200, 400, 900])),
                          selectors=({"zone": "a"} if rng.random() < 0.15 else {}),
                          min_fidelity=rng.choice([Fidelity.ROOTFS, Fidelity.ROOTFS, Fidelity.VOLUMES, Fidelity.MEMORY]),
                          golden_snapshot=g)
        a.create(check_request(CreateActor, req), None, self.at())
        self.created[aid] = req  # its selectors and resources, which the snapshotter's aggregate does not keep
        self.emit_actor(a)

    def lifecycle(self, aid: str) -> None:
        rng = self.rng
        a = self.actors.get(aid)
        if a is None or not a.alive:
            return
        verb = rng.choice(["pause", "suspend", "suspend", "template", "revert", "stop"])
        try:
            if verb == "pause":
                a.pause(None, None, self.at())
            elif verb == "suspend":
                a.suspend(None, "s3://x", rng.choice(list(Fidelity)), None, self.at())
            elif verb == "template":
                a.change_template(rng.choice(["t1", "t2"]), None, self.at())
            elif verb == "revert":
                a.revert(None, None, self.at())
            else:
                a.stop(None, self.at())
        except ContractError:
            return
        if a.state is not ActorState.RUNNING:
            self.booked.pop(aid, None)
        self.emit_actor(a)

    # --- the oracle ---------------------------------------------------------------------------

    def room(self, wid: str) -> tuple[int, int]:
        w = self.workers[wid]
        cpu = w.capacity.cpu_millis - sum(c for (x, c, _) in self.booked.values() if x == wid)
        mem = w.capacity.memory_mib - RESERVE - sum(m for (x, _, m) in self.booked.values() if x == wid)
        return cpu, mem

    def expected(self, aid: str, selectors=None):
        """What the contract says: ('refuse', code) or ('place', fidelity, {worker ids of the winning tier})."""
        a = self.actors[aid]
        if a.state in (ActorState.RUNNING, ActorState.STOPPED):
            return ("refuse", ErrorCode.FAILED_PRECONDITION)
        s = a.latest_snapshot
        floor = a.min_fidelity
        rank = {PlacedFidelity.MEMORY: 0, PlacedFidelity.VOLUMES: 1, PlacedFidelity.ROOTFS: 2, PlacedFidelity.NONE: 3}
        floor_rank = {Fidelity.MEMORY: 0, Fidelity.VOLUMES: 1, Fidelity.ROOTFS: 2}[floor]
        sel = dict(self.created[aid].selectors)
        if selectors:
            sel.update(selectors)
        node = None
        if s is not None and s.location is Location.LOCAL:
            node = s.node or ""
        elif a.state is ActorState.PAUSED:
            node = a.node_pin or ""
        live = [w for w in self.workers.values() if w.alive]
        of_class = [w for w in live if any(e.sandbox_class == CLASS for e in w.sandbox_classes)]
        if node is not None and not [w for w in of_class if w.node == node]:
            return ("refuse", ErrorCode.FAILED_PRECONDITION)

        def base_ok(w, need_of):
            if w.drained:
                return None
            if any(w.labels.get(k) != v for k, v in sel.items()):
                return None
            if node is not None and w.node != node:
                return None
            e = next(e for e in w.sandbox_classes if e.sandbox_class == CLASS)
            cpu, mem = self.room(w.entity_id)
            want = self.created[aid].resources
            if cpu < want.cpu_millis:
                return None
            # the runtimes the tier may run the actor under here: any with room will do
            return next((r for r in need_of(e) if mem >= want.memory_mib + overhead(r, want.memory_mib)), None)

        def default_of_arch(arch):
            def need(e):
                if arch is not None and arch_of(e.default_runtime.version) != arch:
                    return []
                return [e.default_runtime]
            return need

        def tier(need):
            return {w.entity_id for w in of_class if base_ok(w, need) is not None}

        tiers: list[tuple[PlacedFidelity, set]] = []
        if s is None:
            if floor is Fidelity.MEMORY:
                return ("refuse", ErrorCode.FAILED_PRECONDITION)
            tiers.append((PlacedFidelity.NONE, tier(default_of_arch(None))))
        else:
            stamp = s.sandbox_runtime
            arch = arch_of(stamp.version) if stamp is not None else None
            without = PlacedFidelity.NONE if s.borrowed else PlacedFidelity.VOLUMES
            below_without = (floor is Fidelity.MEMORY) if s.borrowed else rank[without] > floor_rank
            if s.fidelity is not Fidelity.MEMORY:
                f = PlacedFidelity(s.fidelity.value)
                if rank[f] > floor_rank:  # below the floor: a borrowed snapshot may RUN (rule 4a)
                    if not s.borrowed or floor is Fidelity.MEMORY:
                        return ("refuse", ErrorCode.FAILED_PRECONDITION)
                    f = PlacedFidelity.NONE
                tiers.append((f, tier(default_of_arch(arch))))
            elif s.template_uid != a.template_uid or stamp is None or stamp.sandbox_class != CLASS:
                if below_without:
                    return ("refuse", ErrorCode.FAILED_PRECONDITION)
                tiers.append((without, tier(default_of_arch(arch))))
            else:
                for role in range(4):
                    def need(e, role=role):
                        return [r for rl, r in accepting(e, stamp.version) if rl == role]
                    tiers.append((PlacedFidelity.MEMORY, tier(need)))
                if node is None and floor is not Fidelity.MEMORY and not below_without:
                    tiers.append((without, tier(default_of_arch(arch))))
        for fidelity, ids in tiers:
            if ids:
                return ("place", fidelity, ids)
        return ("refuse", None)  # RESOURCE_EXHAUSTED or FAILED_PRECONDITION, depending on the cause

    def check_placement(self, aid: str, p) -> None:
        """Independent check that the placement loads where it is sent (the promise)."""
        a = self.actors[aid]
        w = self.workers[p.worker_id]
        assert w.alive and not w.drained, p
        assert p.node == w.node, p
        e = next(e for e in w.sandbox_classes if e.sandbox_class == CLASS)
        s = a.latest_snapshot
        if s is not None and s.location is Location.LOCAL:
            assert w.node == s.node, (p, s)
        if a.state is ActorState.PAUSED:
            assert w.node == a.node_pin, p
        if p.fidelity is PlacedFidelity.MEMORY:
            assert s is not None and s.fidelity is Fidelity.MEMORY and s.template_uid == a.template_uid, (p, s)
            assert s.sandbox_runtime is not None and s.sandbox_runtime.sandbox_class == CLASS
            ms = accepting(e, s.sandbox_runtime.version)
            assert any(same_version(p.sandbox_runtime.version, r.version) for _, r in ms), (p, ms)
        else:
            assert same_version(p.sandbox_runtime.version, e.default_runtime.version), (p, e)
            if s is not None and s.sandbox_runtime is not None:
                arch = arch_of(s.sandbox_runtime.version)
                if arch is not None:
                    assert arch_of(e.default_runtime.version) == arch, (p, s, e)

    # --- resume -------------------------------------------------------------------------------

    def resume(self, aid: str) -> None:
        a = self.actors.get(aid)
        if a is None:
            return
        p = self.log.p
        want = self.expected(aid)
        try:
            placement = decide(p, aid, None, p.seq)
        except ContractError as error:
            got = ("refuse", error.code)
        else:
            got = ("place", placement.fidelity, placement.worker_id)
        # the same answer from a fresh replay and from a checkpoint restore
        for other in (self.log.replay(), restore_state(export_state(p))):
            try:
                again = decide(other, aid, None, p.seq)
                assert got[0] == "place" and again == placement, (got, again)
            except ContractError as error:
                assert got == ("refuse", error.code), (got, error)
        if want[0] == "refuse":
            assert got[0] == "refuse", (aid, want, got, self.describe(aid))
            if want[1] is not None:
                assert got[1] is want[1], (aid, want, got, self.describe(aid))
            self.refusals += 1
            return
        assert got[0] == "place", (aid, want, got, self.describe(aid))
        assert got[1] is want[1] and got[2] in want[2], (aid, want, got, self.describe(aid))
        self.check_placement(aid, placement)
        self.decisions += 1
        self.fallbacks += placement.fallback is not None
        event = placed_event(placement, None)
        a.place(event)
        a.collect_events()
        self.emit([event, WorkerBooked(at=self.at(), worker_id=placement.worker_id, actor_id=aid)])
        self.booked[aid] = (placement.worker_id, placement.booked.cpu_millis, placement.booked.memory_mib)

    def describe(self, aid: str) -> str:
        a = self.actors[aid]
        ws = {wid: (w.alive, w.drained, w.node, [(compat_key("", e.default_runtime.version),
                                                 [compat_key("", r.version) for r in e.restorable_runtimes])
                                                for e in w.sandbox_classes], self.room(wid) if w.alive else None)
              for wid, w in self.workers.items()}
        return f"actor {a.state} {a.latest_snapshot} min={a.min_fidelity} tpl={a.template_uid}\nworkers {ws}"

    def step(self) -> None:
        rng = self.rng
        r = rng.random()
        if r < 0.15:
            self.register(rng.choice(WORKERS))
        elif r < 0.19:
            self.drain(rng.choice(WORKERS))
        elif r < 0.24:
            self.remove(rng.choice(WORKERS))
        elif r < 0.34:
            self.create(rng.choice(ACTORS))
        elif r < 0.55:
            self.lifecycle(rng.choice(ACTORS))
        else:
            self.resume(rng.choice(ACTORS))


@pytest.mark.parametrize("seed", range(60))
def test_fuzz_every_decision_matches_an_independent_reading_of_the_contract(seed):
    model = Model(random.Random(seed))
    for _ in range(150):
        model.step()
    assert model.decisions + model.refusals > 0


# --- rule 8 on the bus: a decision made before a registry change never commits after it -------------

VA, VB = version("a"), version("b")


async def _decided_then(stack, nc, prefix, replicas, change, *, node_of_actor: str = "n1", paused: bool = False):
    """Decide a MEMORY restore of `a` on w1, let `change(wb)` land in the registry, then commit
    the decision as the committer would: it must be refused and write no ActorPlaced."""
    wb = Client(nc, prefix)
    await wb.register(worker_body("w1", VA, node=node_of_actor))
    await wb.create(actor_body("a", golden_snapshot=golden(VA)))
    if paused:
        await wb.resume("a")
        await wb.pause("a")
    service = await replicas(metrics=False)
    await service.fold.wait(await last_seq(nc, prefix), 10)
    p = service.projection
    decided = decide(p, "a", None, p.seq)
    assert decided.worker_id == "w1" and decided.fidelity is PlacedFidelity.MEMORY
    job = Job("a", None, None, asyncio.get_running_loop().create_future())
    commit = service.committer.prepare(decided, job)
    await change(wb)
    before = await last_seq(nc, prefix)
    await service.committer.append([commit])
    with pytest.raises(Exception) as caught:
        await job.result
    placed_after = [e for s, e in await read_log(nc, prefix) if s > before and isinstance(e, ActorPlaced)]
    return caught.value, placed_after


@pytest.mark.parametrize("change", ["runtime", "drain", "remove", "node", "capacity"])
async def test_a_registry_change_between_decision_and_commit_wins(stack, nc, prefix, replicas, change):
    async def act(wb):
        if change == "runtime":
            assert (await wb.register(worker_body("w1", VB, node="n1"))).outcome.value == "RUNTIME_CHANGED"
        elif change == "drain":
            await wb.drain("w1")
        elif change == "remove":
            await wb.remove("w1")
        elif change == "node":
            await wb.register(worker_body("w1", VA, node="n2"))
        else:
            await wb.register(worker_body("w1", VA, node="n1", mem=1100))

    error, placed = await _decided_then(stack, nc, prefix, replicas, act, paused=change == "node")
    assert type(error).__name__ == "IntegrityError", error
    assert placed == []
