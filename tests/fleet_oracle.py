"""An oracle of CONTRACT section 3's resume rules (1 to 6, v1.1) written from the contract's text
and docs/contract.md's recorded choices alone, over a model of the fleet and its actors kept by
this module (not the scheduler's Projection), and a seeded fuzzer that drives the real
Projection and `decide` with the same events and checks every answer against it.

What the oracle says of a resume, for the world as the model has it:
- every placement it would accept (`options`): worker, fidelity, action, pin, matched version,
  fallback, snapshot id and the memory booked, each marked fitting (room) or not;
- the refusal codes acceptable when none fits (`refusal_codes`).
`check` then holds a decision to it: a placement must be one of the fitting options (SAFE: the
image loads there, the architecture is kept, a LOCAL image stays on its node, the floor holds,
the worker is eligible and has room), a MEMORY one when a compatible worker has room, in rule
2's best tier that has room; a refusal only when nothing fits, with an acceptable code.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from events.errors import ContractError
from events.schema import (
    ActorCreated, ActorOverhead, ActorReleased, ActorReverted, ActorRuntime, ActorStopped,
    Attribute, CompatVersion, ErrorCode, Fidelity, Location, Placement, ReleaseReason, Resources,
    RuntimeChanged, Snapshot, SnapshotOrigin, SnapshotTaken, TemplateChanged, WorkerBooked, WorkerDrained,
    WorkerRegistered, WorkerRemoved, WorkerRuntime, WorkerSandboxClass, WorkerUpdated,
)

AT = datetime(2026, 12, 1, tzinfo=timezone.utc)
RESERVE = 64
RANK = {"MEMORY": 3, "VOLUMES": 2, "ROOTFS": 1, "NONE": 0}
GO_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


# --- versions, as the contract compares them (section 2) -------------------------------------

def v(schema: str = "v1", **attrs: str) -> CompatVersion:
    return CompatVersion(schema_version=schema, attributes=tuple(Attribute(key=k, value=x) for k, x in attrs.items()))


def key(ver: CompatVersion) -> tuple:
    """Equality of runtimes: the schema version and the attribute set, key for key (order aside)."""
    return ver.schema_version, frozenset((a.key, a.value) for a in ver.attributes)


def eq(a: CompatVersion, b: CompatVersion) -> bool:
    return key(a) == key(b)


def arch(ver: CompatVersion) -> str | None:
    """The `architecture` attribute in Go's naming (the probe maps x86_64 to amd64)."""
    val = next((a.value for a in ver.attributes if a.key == "architecture"), None)
    return None if val is None else GO_ARCH.get(val.lower(), val)


def pool(a: str) -> list[CompatVersion]:
    """Versions of one architecture that differ from one another in one key or one value."""
    out = [v(architecture=a, gvisor_asset_hash=b) for b in "123"]
    out.append(v(architecture=a, gvisor_asset_hash="1", cpu_features="f0"))     # one key more
    out.append(v(architecture=a, gvisor_asset_hash="1", cpu_features="f1"))     # one value other
    out.append(v("v2", architecture=a, gvisor_asset_hash="1"))                  # schema only differs
    if a == "amd64":
        out.append(v(architecture="x86_64", gvisor_asset_hash="1"))             # another spelling
    return out


NOARCH = v("v2", gvisor_asset_hash="9")  # a version naming no architecture
ARCHES = ("amd64", "arm64")
CLASSES = ("gvisor", "microvm")
NODES = ("n0", "n1", "n2")


# --- the model ------------------------------------------------------------------------------

@dataclass
class W:
    wid: str
    life: int
    node: str
    cpu: int
    mem: int
    labels: dict
    classes: tuple  # WorkerSandboxClass, as registered
    drained: bool = False
    booked_cpu: int = 0
    booked_mem: int = 0
    # with node tokens (`Fuzz(tokens=True)`): the disk the worker's machine has (the truth), and the token
    # it registers (its disk, or none from an agent before tokens, only ever on its node's first disk)
    disk: str | None = None
    token: str | None = None
    # a registration without a token on a node that has registered another disk than its first: it cannot say
    # which disk it is on, so its place is its own (docs/contract.md): its LOCAL images are there, and it is
    # sent no other's
    alone: str | None = None

    @property
    def at(self) -> str:
        """Where its LOCAL images are and which it can load: its disk, or its node without tokens."""
        return self.alone or self.disk or self.node

    def entry(self, cls: str) -> WorkerSandboxClass | None:
        return next((e for e in self.classes if e.sandbox_class == cls), None)

    def machine(self) -> str | None:
        """docs/contract.md: the machine is the first architecture the registration's versions name."""
        for e in self.classes:
            for r in (e.default_runtime, *e.restorable_runtimes):
                for ver in (r.version, *r.compatible_versions):
                    if arch(ver) is not None:
                        return arch(ver)
        return None


@dataclass
class Held:
    wid: str
    life: int
    booked: Resources
    pin: ActorRuntime
    node: str
    template: str


@dataclass
class A:
    aid: str
    cls: str
    template: str
    cpu: int
    mem: int
    selectors: dict
    floor: Fidelity
    state: str = "CREATED"
    snap: Snapshot | None = None
    pause_node: str | None = None
    held: Held | None = None
    # where its latest LOCAL image is (`W.at` of the worker that wrote it; "" on no known disk), and where a
    # PAUSED actor's memory is
    image_at: str | None = None
    pause_at: str | None = None
    external: Snapshot | None = None  # the latest EXTERNAL snapshot of this life (revert's way back)
    borrows: bool = False


def overhead(rt: WorkerRuntime, mem: int) -> int:
    o = rt.actor_overhead
    if o is None:
        return 0
    return o.fixed_mib + o.per_gib_mib * math.ceil(mem / 1024)


@dataclass(frozen=True)
class Option:
    wid: str
    node: str
    fidelity: str
    action: str
    pin: tuple  # (class, version key)
    matched: tuple | None  # version key
    fallback: tuple | None  # (reason, from, to)
    snapshot_id: str | None
    booked: tuple  # (cpu, mem)
    role: int | None  # rule 2's tier (0 default, 1 restorable, 2 edge of default, 3 edge of restorable)
    fits: bool
    # a memory option through a version of another architecture than the machine, or one without memory
    # under a class default of another architecture than the machine
    filtered: bool = False


def room(w: W, pending: dict) -> tuple[int, int]:
    pc, pm = pending.get(w.wid, (0, 0))
    return w.cpu - w.booked_cpu - pc, w.mem - RESERVE - w.booked_mem - pm


def merged(a: A, request: dict | None) -> dict | None:
    """Rule 6: the actor's selectors and the request's; None when the request changes one."""
    out = dict(a.selectors)
    for k, x in (request or {}).items():
        if k in out and out[k] != x:
            return None
        out[k] = x
    return out


def options(workers: dict[str, W], a: A, sel: dict, pending: dict) -> tuple[list[Option], set[ErrorCode]]:
    """Every placement the contract allows for a resume of `a` (fitting or not), and the codes a
    refusal may carry if none fits."""
    snap, cls, floor = a.snap, a.cls, a.floor.value
    local = snap is not None and snap.location is Location.LOCAL
    restrict = a.image_at if local else (a.pause_at if a.state == "PAUSED" else None)
    if local and snap.node is None:
        restrict = ""  # a LOCAL image that names no node restores nowhere

    def eligible(w: W) -> bool:
        return (not w.drained and w.entry(cls) is not None
                and all(w.labels.get(k) == x for k, x in sel.items())
                and (restrict is None or w.at == restrict))

    if restrict is not None and not any(w.entry(cls) is not None and w.at == restrict for w in workers.values()):
        return [], {ErrorCode.FAILED_PRECONDITION}  # rule 5: no worker of the class on that node (disk) at all
    codes: set[ErrorCode] = set()
    stamp = snap.sandbox_runtime if snap is not None else None
    want_arch = arch(stamp.version) if stamp is not None else None
    out: list[Option] = []

    def plain(fidelity: str, action: str, fallback: tuple | None) -> None:
        """Placements without memory: the worker's class default, the stamp's architecture kept; none
        under a default of another architecture than the worker's machine (a logged registration
        naming two: docs/contract.md, "Placement"), which is marked `filtered`."""
        for w in workers.values():
            if not eligible(w):
                continue
            d = w.entry(cls).default_runtime
            if want_arch is not None and arch(d.version) != want_arch:
                continue
            need = a.mem + overhead(d, a.mem)
            rc, rm = room(w, pending)
            machine = w.machine()
            out.append(Option(w.wid, w.node, fidelity, action, (cls, key(d.version)), None, fallback,
                              snap.snapshot_id if action == "RESTORE" else None, (a.cpu, need), None,
                              rc >= a.cpu and rm >= need,
                              arch(d.version) is not None and machine is not None and arch(d.version) != machine))

    if snap is None:  # rule 1
        if floor == "MEMORY":
            codes.add(ErrorCode.FAILED_PRECONDITION)  # docs/contract.md: a cold boot is below MEMORY
        else:
            plain("NONE", "RUN", None)
            codes.add(ErrorCode.RESOURCE_EXHAUSTED)
        return out, codes
    if snap.fidelity is not Fidelity.MEMORY:  # rule 3
        if RANK[snap.fidelity.value] >= RANK[floor]:
            plain(snap.fidelity.value, "RESTORE", None)
            codes.add(ErrorCode.RESOURCE_EXHAUSTED)
        elif snap.borrowed and floor != "MEMORY":  # 4a: owns nothing to lose
            plain("NONE", "RUN", None)
            codes.add(ErrorCode.RESOURCE_EXHAUSTED)
        else:
            codes.add(ErrorCode.FAILED_PRECONDITION)
        return out, codes
    reasons = []
    if snap.template_uid != a.template:
        reasons.append("TEMPLATE_CHANGED")
    if stamp is None or stamp.sandbox_class != cls:
        reasons.append("SNAPSHOT_NOT_MEMORY")
    to = "NONE" if snap.borrowed else "VOLUMES"
    if reasons:  # rule 3: memory in the snapshot that cannot be used
        if (snap.borrowed and floor == "MEMORY") or (not snap.borrowed and RANK[to] < RANK[floor]):
            codes.add(ErrorCode.FAILED_PRECONDITION)
            return out, codes
        for reason in reasons:
            plain(to, "RUN" if snap.borrowed else "RESTORE", (reason, "MEMORY", to))
        codes.add(ErrorCode.RESOURCE_EXHAUSTED)
        return out, codes
    # rule 2: a worker whose runtime equals the stamp, or accepts it through an edge
    sv = stamp.version
    for w in workers.values():
        if not eligible(w):
            continue
        e = w.entry(cls)
        machine = w.machine()

        def other(ver: CompatVersion) -> bool:
            return arch(ver) is not None and machine is not None and arch(ver) != machine

        rc, rm = room(w, pending)
        for own_role, rt in ((0, e.default_runtime), *((1, r) for r in e.restorable_runtimes)):
            if eq(rt.version, sv):
                role, matched = own_role, rt.version
            elif any(eq(x, sv) for x in rt.compatible_versions):
                role, matched = own_role + 2, next(x for x in rt.compatible_versions if eq(x, sv))
            else:
                continue
            need = a.mem + overhead(rt, a.mem)
            out.append(Option(w.wid, w.node, "MEMORY", "RESTORE", (cls, key(rt.version)), key(matched), None,
                              snap.snapshot_id, (a.cpu, need), role, rc >= a.cpu and rm >= need,
                              other(rt.version) or other(matched)))
    codes.add(ErrorCode.RESOURCE_EXHAUSTED)  # more room (or a compatible worker) could help
    if restrict is None and floor != "MEMORY":  # rule 4: fall back, never for a LOCAL image
        if any(o.fits and not o.filtered for o in out):
            return out, codes  # a fallback is only for when no compatible worker has room
        plain(to, "RUN" if snap.borrowed else "RESTORE", ("NO_COMPATIBLE_WORKER", "MEMORY", to))
    return out, codes


def as_option(p: Placement) -> tuple:
    fb = p.fallback
    return (p.worker_id, p.node, p.fidelity.value, p.action.value,
            (p.sandbox_runtime.sandbox_class, key(p.sandbox_runtime.version)),
            None if p.matched_version is None else key(p.matched_version),
            None if fb is None else (fb.reason.value, fb.from_fidelity.value, fb.to_fidelity.value),
            p.snapshot_id, (p.booked.cpu_millis, p.booked.memory_mib))


def check(workers: dict[str, W], actors: dict[str, A], aid: str, request: dict | None, pending: dict,
          answer: Placement | ContractError) -> str | None:
    """None if `answer` is what the contract allows, else why not."""
    a = actors.get(aid)
    if a is None:
        want = {ErrorCode.NOT_FOUND}
    elif a.state in ("RUNNING", "STOPPED"):
        want = {ErrorCode.FAILED_PRECONDITION}
    else:
        sel = merged(a, request)
        if sel is None:
            want = {ErrorCode.INVALID_ARGUMENT}
        else:
            opts, want = options(workers, a, sel, pending)
            fitting = [o for o in opts if o.fits and not o.filtered]
            if isinstance(answer, Placement):
                got = as_option(answer)
                match = [o for o in opts if (o.wid, o.node, o.fidelity, o.action, o.pin, o.matched, o.fallback,
                                             o.snapshot_id, o.booked) == got]
                if not match:
                    return f"UNSAFE/ILLEGAL placement {got} not among the contract's options"
                o = match[0]
                if not o.fits:
                    return f"placement on a worker without room {got}"
                if o.filtered:
                    return f"placement under or through a version of another architecture than the machine {got}"
                mem = [x for x in fitting if x.fidelity == "MEMORY"]
                if mem and o.fidelity != "MEMORY":
                    return f"fell back to {o.fidelity} though a compatible worker has room: {mem[0]}"
                if mem and o.role != min(x.role for x in mem):
                    return f"rule 2 order: role {o.role} chosen, role {min(x.role for x in mem)} has room"
                return None
            if fitting:
                return f"refused {answer.code.value} ({answer.message}) though {fitting[0]} fits"
    if isinstance(answer, Placement):
        return f"placed {as_option(answer)} where the contract refuses with {want}"
    if answer.code not in want:
        return f"refused {answer.code.value} ({answer.message}), expected one of {sorted(c.value for c in want)}"
    return None


# --- the fuzzer: one random life of a small fleet, folded by the real Projection -------------

class Fuzz:
    """A seeded life of a fleet: registrations, runtime changes, node/capacity/label changes, drains,
    removals (the snapshotter's releases after them, sometimes late), creations (none, golden, tag),
    pauses, suspends, promotions, template changes, stops, reverts, snapshots of any stamp, and
    resumes decided by the real `decide` on the real Projection and checked against the oracle."""

    def __init__(self, seed: int, *, legacy: bool = False, workers: int = 5, actors: int = 4, tokens: bool = False):
        from services.scheduler.projection import Projection
        self.r = random.Random(seed)
        self.seed = seed
        self.legacy = legacy  # registrations naming two architectures (a log from before the rule)
        self.p = Projection()
        self.events: list = []
        self.workers: dict[str, W] = {}
        self.actors: dict[str, A] = {}
        self.lives: dict[str, int] = {}
        self.late: list[tuple[str, str, int]] = []  # releases the snapshotter has yet to write
        self.refusals: dict = {}
        self.made: list[tuple[Placement, int, int]] = []  # placements committed: (placement, seq, worker life)
        self.stats: dict[str, int] = {}
        self.failures: list[str] = []
        self.n = 0
        self.sizes = (workers, actors)
        # node tokens: each node's machines in turn (`replace`), and the nodes whose first token was registered
        # (on their first machine: a registration without one is then trusted to be there, docs/contract.md)
        self.tokens = tokens
        self.machine: dict[str, int] = {}
        self.tokened: set[str] = set()
        self.moved_on: set[str] = set()  # nodes a token other than their first (machine 0's) was registered on

    def disk(self, node: str) -> str:
        return f"{node}-d{self.machine.get(node, 0)}"

    def token(self, node: str) -> str:
        """The token a worker of `node`'s machine now registers: its disk's, or (an agent before tokens) none,
        only on the node's first machine once that machine's token is known."""
        if node in self.tokened and not self.machine.get(node) and self.r.random() < 0.3:
            return None
        if node in self.moved_on and self.r.random() < 0.5:
            return None  # on a node that moved on, on any machine: a new worker id run without its token file
        self.tokened.add(node)
        return self.disk(node)

    def registering(self, w: W, seq_of: str) -> None:
        """What a registration of `w` (its token just chosen) tells the fold of its node's disks: a token
        other than the first moves the node on for good; none on a node moved on is a place of its own."""
        if w.token is not None:
            w.alone = None
            if w.token != f"{w.node}-d0":
                self.moved_on.add(w.node)
        elif self.tokens and w.node in self.moved_on:
            w.alone = seq_of
            self.count("registered alone")
        else:  # on a node that has not moved on: its first disk, for all the fold (and the contract) can tell
            w.alone = None

    def replace(self, node: str) -> None:
        """The node's machine replaced (its disk with it): workers registered from now on are on the new one.
        Those still registered keep the old one (two disks under one node name until they go)."""
        if self.tokens and node in self.tokened:
            self.machine[node] = self.machine.get(node, 0) + 1
            self.count("machine replaced")

    def unknown_at(self, node: str) -> str:
        """Where a LOCAL image on `node` not written by a worker of the model is: on no known disk once the node
        registers tokens, else on its first disk (the one its first token will name)."""
        if not self.tokens:
            return node
        return "" if node in self.tokened else f"{node}-d0"

    # events ---------------------------------------------------------------------------------
    def add(self, event) -> None:
        self.events.append(event)
        self.p.apply(len(self.events), event)

    def at(self) -> datetime:
        self.n += 1
        return AT + timedelta(seconds=self.n)

    def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    # a worker's runtimes ----------------------------------------------------------------------
    def runtime(self, versions: list[CompatVersion], own: CompatVersion) -> WorkerRuntime:
        r = self.r
        others = [x for x in versions if not eq(x, own)]
        edges = [self.shuffled(x) for x in r.sample(others, r.choice([0, 0, 1, 1, 2]))]
        own = self.shuffled(own)
        o = r.choice([None, None, (0, 0), (32, 0), (100, 0), (0, 48), (16, 16)])
        return WorkerRuntime(version=own, name=r.choice([None, "runsc"]), compatible_versions=tuple(edges),
                             actor_overhead=None if o is None else ActorOverhead(fixed_mib=o[0], per_gib_mib=o[1]))

    def classes(self, names: tuple[str, ...], machine: str) -> tuple[WorkerSandboxClass, ...]:
        r = self.r
        out = []
        for cls in names:
            a = machine if not (self.legacy and r.random() < 0.3) else r.choice(ARCHES)
            versions = pool(a) + [NOARCH]
            d = r.choice(versions[:2]) if r.random() < 0.5 else r.choice(versions)
            rest = r.sample([x for x in versions if not eq(x, d)], r.choice([0, 1, 1, 2, 3]))
            out.append(WorkerSandboxClass(sandbox_class=cls, default_runtime=self.runtime(versions, d),
                                          restorable_runtimes=tuple(self.runtime(versions, x) for x in rest)))
        return tuple(out)

    # worker steps -------------------------------------------------------------------------------
    def register(self, wid: str) -> None:
        r = self.r
        if wid in self.workers:
            return
        names = r.choice([("gvisor",), ("gvisor",), ("microvm",), ("gvisor", "microvm")])
        machine = r.choice(ARCHES)
        life = self.lives[wid] = self.lives.get(wid, 0) + 1
        w = W(wid, life, r.choice(NODES), r.choice([600, 1000, 2000]), r.choice([700, 1200, 2100, 4200]),
              r.choice([{}, {"zone": "a"}, {"zone": "b"}, {"zone": "a", "disk": "ssd"}]),
              self.classes(names, machine))
        if self.tokens:
            w.disk, w.token = self.disk(w.node), self.token(w.node)
            self.registering(w, f"{wid}@{len(self.events) + 1}")
        self.workers[wid] = w
        self.add(WorkerRegistered(at=self.at(), worker_id=wid, node=w.node,
                                  capacity=Resources(cpu_millis=w.cpu, memory_mib=w.mem), labels=w.labels,
                                  sandbox_classes=w.classes, node_token=w.token))

    def change_runtimes(self, wid: str) -> None:
        w = self.workers.get(wid)
        if w is None:
            return
        before = w.classes
        w.classes = self.classes(tuple(e.sandbox_class for e in before), w.machine() or self.r.choice(ARCHES))
        self.add(RuntimeChanged(at=self.at(), worker_id=wid, sandbox_classes=w.classes, previous=before))

    def update(self, wid: str) -> None:
        r = self.r
        w = self.workers.get(wid)
        if w is None:
            return
        moved, was = r.random() < 0.5, w.node
        if moved:
            w.node = r.choice(NODES)
            if self.tokens and w.disk is not None and not w.disk.startswith(f"{w.node}-"):  # on another machine
                w.disk, w.token = self.disk(w.node), self.token(w.node)
        if self.tokens and w.token is None and r.random() < 0.3:  # its agent upgraded: it names its disk
            w.token = w.disk
            self.tokened.add(w.node)
        elif self.tokens and w.token is not None and not moved and r.random() < 0.2:
            # its agent downgraded on the same machine: no token, the life goes on on its disk
            w.token = None
            self.count("agent downgraded")
        if self.tokens and (w.token is not None or w.node != was):  # one giving no token on its node keeps its place
            self.registering(w, f"{wid}@{len(self.events) + 1}")
        if r.random() < 0.5:
            w.mem = r.choice([700, 1200, 2100, 4200])
            w.cpu = r.choice([600, 1000, 2000])
        if r.random() < 0.5:
            w.labels = r.choice([{}, {"zone": "a"}, {"zone": "b"}, {"zone": "a", "disk": "ssd"}])
        self.add(WorkerUpdated(at=self.at(), worker_id=wid, node=w.node,
                               capacity=Resources(cpu_millis=w.cpu, memory_mib=w.mem), labels=w.labels,
                               node_token=w.token))

    def drain(self, wid: str) -> None:
        w = self.workers.get(wid)
        if w is None or w.drained:
            return
        w.drained = True
        self.add(WorkerDrained(at=self.at(), worker_id=wid, reason="maintenance"))

    def remove(self, wid: str) -> None:
        w = self.workers.pop(wid, None)
        if w is None:
            return
        self.add(WorkerRemoved(at=self.at(), worker_id=wid, reason="LOST"))
        for a in self.actors.values():
            if a.state == "RUNNING" and a.held.wid == wid and a.held.life == w.life:
                self.late.append((a.aid, wid, w.life))
        if self.r.random() < 0.7:
            self.flush_releases()

    def flush_releases(self) -> None:
        for aid, wid, life in self.late:
            a = self.actors[aid]
            if a.state == "RUNNING" and a.held.wid == wid and a.held.life == life:
                self.release(a, ReleaseReason.WORKER_REMOVED)
        self.late = []

    # actor steps --------------------------------------------------------------------------------
    def version(self) -> CompatVersion:
        r = self.r
        versions = pool(r.choice(ARCHES)) + [NOARCH]
        return self.shuffled(r.choice(versions[:2]) if r.random() < 0.5 else r.choice(versions))

    def shuffled(self, ver: CompatVersion) -> CompatVersion:
        """The same version, its attributes in another order (order carries no meaning)."""
        attrs = list(ver.attributes)
        self.r.shuffle(attrs)
        return CompatVersion(schema_version=ver.schema_version, attributes=tuple(attrs))

    def stamp(self) -> ActorRuntime:
        return ActorRuntime(sandbox_class=self.r.choice(CLASSES), version=self.version())

    def create(self, aid: str) -> None:
        r = self.r
        a = self.actors.get(aid)
        if a is not None and a.state != "STOPPED":
            return
        cls = r.choice(CLASSES)
        a = A(aid, cls, "t1", r.choice([250, 500]), r.choice([256, 512, 1024, 1500]),
              r.choice([{}, {}, {"zone": "a"}]), r.choice(list(Fidelity)))
        snap = None
        k = r.random()
        if k < 0.35:  # golden: EXTERNAL, borrowed, stamped for the class
            st = ActorRuntime(sandbox_class=cls, version=self.version())
            snap = Snapshot(snapshot_id=f"g{self.n}", actor_id=aid, template_uid=r.choice(["t1", "t1", "t0"]),
                            fidelity=r.choice([Fidelity.MEMORY, Fidelity.MEMORY, Fidelity.VOLUMES, Fidelity.ROOTFS]),
                            location=Location.EXTERNAL, uri="s3://g", sandbox_runtime=st, borrowed=True, taken_at=AT)
        elif k < 0.55:  # from a tag: another actor's EXTERNAL snapshot, any stamp
            st = self.stamp() if r.random() < 0.2 else ActorRuntime(
                sandbox_class=cls, version=self.version())
            snap = Snapshot(snapshot_id=f"t{self.n}", actor_id=aid, template_uid=r.choice(["t1", "t0"]),
                            fidelity=r.choice(list(Fidelity)), location=Location.EXTERNAL,
                            sandbox_runtime=None if r.random() < 0.1 else st, borrowed=r.random() < 0.2,
                            taken_at=AT)
        if snap is None and a.floor is Fidelity.MEMORY and r.random() < 0.8:
            a.floor = Fidelity.ROOTFS  # (such an actor is refused for good: a few suffice)
        a.snap = snap
        a.borrows = snap is not None and snap.borrowed
        a.external = snap
        self.actors[aid] = a
        self.add(ActorCreated(at=self.at(), actor_id=aid, sandbox_class=cls, template_uid=a.template,
                              resources=Resources(cpu_millis=a.cpu, memory_mib=a.mem), selectors=a.selectors,
                              min_fidelity=a.floor, snapshot=snap))
        if snap is not None:
            self.add(SnapshotTaken(at=self.at(), actor_id=aid, snapshot=snap, origin=SnapshotOrigin.CREATE))

    def release(self, a: A, reason: ReleaseReason) -> None:
        h = a.held
        w = self.workers.get(h.wid)
        if w is not None and w.life == h.life:
            w.booked_cpu -= h.booked.cpu_millis
            w.booked_mem -= h.booked.memory_mib
        a.held = None
        if reason is ReleaseReason.PAUSED:
            a.state, a.pause_node = "PAUSED", h.node
            a.pause_at = w.at if w is not None and w.life == h.life else self.unknown_at(h.node)
        elif reason is ReleaseReason.STOPPED:
            a.state = "STOPPED"
        else:
            a.state, a.pause_node = "SUSPENDED", None
        self.add(ActorReleased(at=self.at(), actor_id=a.aid, worker_id=h.wid, reason=reason))

    def pause(self, aid: str) -> None:
        a = self.actors.get(aid)
        if a is None or a.state != "RUNNING":
            return
        h = a.held
        w = self.workers.get(h.wid)
        if w is None or w.life != h.life or w.node != h.node:
            return  # the snapshotter refuses it (worker removed or moved)
        snap = Snapshot(snapshot_id=f"{aid}-p{self.n}", actor_id=aid, template_uid=h.template,
                        fidelity=Fidelity.MEMORY, location=Location.LOCAL, node=h.node, sandbox_runtime=h.pin,
                        borrowed=a.borrows, taken_at=AT)
        a.snap, a.image_at = snap, w.at
        self.add(SnapshotTaken(at=self.at(), actor_id=aid, snapshot=snap, origin=SnapshotOrigin.PAUSE))
        self.release(a, ReleaseReason.PAUSED)

    def suspend(self, aid: str) -> None:
        r = self.r
        a = self.actors.get(aid)
        if a is None:
            return
        fid = r.choice([Fidelity.MEMORY, Fidelity.MEMORY, Fidelity.VOLUMES, Fidelity.ROOTFS])
        if a.state == "PAUSED":  # promote: EXTERNAL, stamp kept
            snap = Snapshot(snapshot_id=a.snap.snapshot_id, actor_id=aid, template_uid=a.snap.template_uid,
                            fidelity=fid, location=Location.EXTERNAL, sandbox_runtime=a.snap.sandbox_runtime,
                            borrowed=False, taken_at=AT)
            a.snap, a.external, a.state, a.pause_node, a.borrows = snap, snap, "SUSPENDED", None, False
            self.add(SnapshotTaken(at=self.at(), actor_id=aid, snapshot=snap, origin=SnapshotOrigin.PROMOTE))
            return
        if a.state != "RUNNING":
            return
        h = a.held
        snap = Snapshot(snapshot_id=f"{aid}-s{self.n}", actor_id=aid, template_uid=h.template, fidelity=fid,
                        location=Location.EXTERNAL, sandbox_runtime=h.pin, borrowed=False, taken_at=AT)
        a.snap, a.external, a.borrows = snap, snap, False
        self.add(SnapshotTaken(at=self.at(), actor_id=aid, snapshot=snap, origin=SnapshotOrigin.SUSPEND))
        self.release(a, ReleaseReason.SUSPENDED)

    def foreign_snapshot(self, aid: str) -> None:
        """A snapshot of any stamp, fidelity, template and place on a waiting actor (a log of
        another writer, or of an older version), as SUSPEND (or PAUSE when LOCAL)."""
        r = self.r
        a = self.actors.get(aid)
        if a is None or a.state not in ("CREATED", "SUSPENDED", "PAUSED"):
            return
        local = r.random() < 0.4
        st = r.choice([None, self.stamp(), self.stamp(),
                       ActorRuntime(sandbox_class=a.cls, version=self.version())])
        snap = Snapshot(snapshot_id=f"{aid}-f{self.n}", actor_id=aid, template_uid=r.choice(["t1", "t2", "t0"]),
                        fidelity=r.choice(list(Fidelity)), location=Location.LOCAL if local else Location.EXTERNAL,
                        node=r.choice(NODES) if local else None, sandbox_runtime=st, borrowed=r.random() < 0.2,
                        taken_at=AT)
        a.snap = snap
        a.image_at = self.unknown_at(snap.node) if local else None
        origin = SnapshotOrigin.PAUSE if local and r.random() < 0.5 else SnapshotOrigin.SUSPEND
        if origin is SnapshotOrigin.PAUSE:
            a.state, a.pause_node, a.pause_at = "PAUSED", snap.node, a.image_at
        else:
            a.state, a.pause_node = "SUSPENDED", None
            if not local:
                a.external = snap
        self.add(SnapshotTaken(at=self.at(), actor_id=aid, snapshot=snap, origin=origin))

    def template(self, aid: str) -> None:
        a = self.actors.get(aid)
        if a is None or a.state == "STOPPED":
            return
        t = self.r.choice(["t1", "t2", "t0"])
        if t == a.template:
            return
        a.template = t
        self.add(TemplateChanged(at=self.at(), actor_id=aid, template_uid=t))

    def stop(self, aid: str) -> None:
        a = self.actors.get(aid)
        if a is None or a.state == "STOPPED":
            return
        if a.held is not None:
            self.release(a, ReleaseReason.STOPPED)
        a.state = "STOPPED"
        self.add(ActorStopped(at=self.at(), actor_id=aid))

    def revert(self, aid: str) -> None:
        a = self.actors.get(aid)
        if a is None or a.snap is None or a.snap.location is not Location.LOCAL:
            return
        if a.state not in ("PAUSED", "SUSPENDED"):
            return
        abandoned, a.snap = a.snap, a.external
        a.state, a.pause_node = "SUSPENDED", None
        a.borrows = a.snap is not None and a.snap.borrowed
        self.add(ActorReverted(at=self.at(), actor_id=aid, snapshot=a.snap, abandoned=abandoned))

    # the resume ---------------------------------------------------------------------------------
    def decide_with(self, aid: str, request: dict | None, pending: dict, refusals: dict | None, on=None):
        """`decide` on this life's projection (or on the projection `on`), at its position; the refusal."""
        from services.scheduler.decide import decide
        p = self.p if on is None else on
        try:
            return decide(p, aid, request, p.seq, pending, refusals)
        except ContractError as e:
            return e

    def resume(self, aid: str) -> None:
        from services.scheduler.committer import placed_event
        r = self.r
        a = self.actors.get(aid)
        if a is not None and a.state == "RUNNING" and r.random() < 0.85:  # mostly resume what waits
            (self.pause if r.random() < 0.5 else self.suspend)(aid)
        if a is not None and a.state == "STOPPED" and r.random() < 0.8:
            self.create(aid)
        request = r.choice([None, None, {}, {"zone": "a"}, {"zone": "b"}, {"disk": "ssd"}])
        pending: dict = {}
        if self.workers and r.random() < 0.2:
            wid = r.choice(sorted(self.workers))
            pending = {wid: (r.choice([0, 250]), r.choice([0, 300, 900]))}
            self.touch(pending)  # as the committer does when what it holds in flight changes
        answer = self.decide_with(aid, request, pending, self.refusals)
        fresh = self.decide_with(aid, request, pending, None)
        if pending:
            self.touch(pending)
        if self.same(answer) != self.same(fresh):
            self.fail(f"a remembered refusal differs from a fresh decision: {answer!r} vs {fresh!r}")
        why = check(self.workers, self.actors, aid, request, pending, fresh)
        state = self.actors[aid].state if aid in self.actors else "absent"
        self.count("placed" if isinstance(fresh, Placement) else f"refused {fresh.code.value} ({state})")
        if not isinstance(fresh, Placement) and "registered from another disk since" in fresh.message:
            self.count("refused: its image's disk replaced")
        if isinstance(fresh, Placement):
            snap = self.actors[aid].snap
            self.count(f"fidelity {fresh.fidelity.value}"
                       + (f" {fresh.fallback.reason.value}" if fresh.fallback else "")
                       + (" LOCAL" if snap is not None and snap.location is Location.LOCAL else ""))
            if fresh.matched_version is not None:
                self.count("through an edge" if not eq(fresh.matched_version, fresh.sandbox_runtime.version)
                           else "own version")
        if why is not None:
            self.fail(f"resume {aid} {request}: {why}")
            return
        if isinstance(fresh, Placement) and not pending and r.random() < 0.8:
            a = self.actors[aid]
            w = self.workers[fresh.worker_id]
            w.booked_cpu += fresh.booked.cpu_millis
            w.booked_mem += fresh.booked.memory_mib
            a.held = Held(w.wid, w.life, fresh.booked, fresh.sandbox_runtime, fresh.node, a.template)
            a.state, a.pause_node = "RUNNING", None
            self.add(placed_event(fresh, f"r{len(self.events)}"))
            self.made.append((fresh, len(self.events), w.life))
            self.add(WorkerBooked(at=self.at(), worker_id=w.wid, actor_id=aid))

    def retry(self) -> None:
        """A resume's request id sent again, answered from the log only if its worker, as it is now,
        still carries the placement out (docs/contract.md, Idempotency): same life, the class, the
        node, the pinned runtime, and at MEMORY that runtime still accepting the image's version."""
        from services.scheduler.decide import check_retry
        if not self.made:
            return
        pl, seq, life = self.r.choice(self.made)
        try:
            check_retry(self.p, pl, seq, "rid")
            answered = True
        except ContractError:
            answered = False
        w = self.workers.get(pl.worker_id)
        ok = w is not None and w.life == life and w.entry(pl.sandbox_runtime.sandbox_class) is not None \
            and w.node == pl.node
        if ok:
            e = w.entry(pl.sandbox_runtime.sandbox_class)
            rt = next((x for x in (e.default_runtime, *e.restorable_runtimes)
                       if eq(x.version, pl.sandbox_runtime.version)), None)
            ok = rt is not None
            if ok and pl.fidelity.value == "MEMORY":
                m = pl.matched_version
                machine = w.machine()
                ok = (eq(rt.version, m) or any(eq(x, m) for x in rt.compatible_versions)) and not (
                    machine is not None and arch(m) not in (None, machine))
            a = self.actors.get(pl.actor_id)
            if ok and self.tokens and pl.snapshot_id is not None and a is not None and a.snap is not None \
                    and a.snap.location is Location.LOCAL and a.snap.snapshot_id == pl.snapshot_id:
                # rule 5: its LOCAL image still where the worker is (one that registered alone, then named its
                # disk, has left the place of its own its images are on)
                ok = a.image_at == w.at
        self.count(f"retry {'answered' if answered else 'refused'}")
        if answered and not ok:
            self.fail(f"a retry is answered with {as_option(pl)}, which its worker cannot carry out now")
        if ok and not answered:
            self.fail(f"a retry is refused though its worker carries out {as_option(pl)}")

    def touch(self, pending: dict) -> None:
        for wid in pending:
            w = self.p.workers.get(wid)
            if w is not None:
                w.touch()

    @staticmethod
    def same(answer):
        if isinstance(answer, Placement):
            return answer
        return (answer.code, answer.message, answer.field)

    def fail(self, why: str) -> None:
        self.failures.append(f"seed {self.seed} step {len(self.events)}: {why}")

    def replay_check(self) -> None:
        """A fresh fold of the same log, and a checkpoint of this one restored, decide every
        actor alike (rule 7)."""
        from services.scheduler.checkpoint_codec import export_state, restore_state
        from services.scheduler.decide import decide
        from services.scheduler.projection import Projection
        q = Projection()
        for i, e in enumerate(self.events, start=1):
            q.apply(i, e)
        c = restore_state(export_state(self.p))
        for aid in sorted(self.actors):
            def one(p):
                try:
                    return self.same(decide(p, aid, None, p.seq))
                except ContractError as e:
                    return self.same(e)
            a, b, k = one(self.p), one(q), one(c)
            if a != b or a != k:
                self.fail(f"a replay or a checkpoint decides {aid} otherwise: {a!r} vs {b!r} vs {k!r}")

    def run(self, steps: int) -> "Fuzz":
        r = self.r
        wids = [f"w{i}" for i in range(self.sizes[0])]
        aids = [f"a{i}" for i in range(self.sizes[1])]
        for wid in wids[:3]:
            self.register(wid)
        for aid in aids:
            self.create(aid)
        moves = (["register"] * 3 + ["runtimes"] * 2 + ["update"] * 2 + ["drain", "remove", "flush"] +
                 ["create"] + ["resume"] * 10 + ["pause"] * 2 + ["suspend"] * 2 + ["foreign"] +
                 ["template", "stop", "revert", "retry"] + (["replace"] * 2 if self.tokens else []))
        for _ in range(steps):
            m = r.choice(moves)
            wid, aid = r.choice(wids), r.choice(aids)
            {"register": lambda: self.register(wid), "runtimes": lambda: self.change_runtimes(wid),
             "update": lambda: self.update(wid), "drain": lambda: self.drain(wid), "remove": lambda: self.remove(wid),
             "flush": self.flush_releases, "create": lambda: self.create(aid), "resume": lambda: self.resume(aid),
             "pause": lambda: self.pause(aid), "suspend": lambda: self.suspend(aid),
             "foreign": lambda: self.foreign_snapshot(aid), "template": lambda: self.template(aid),
             "stop": lambda: self.stop(aid), "revert": lambda: self.revert(aid), "retry": self.retry,
             "replace": lambda: self.replace(r.choice(NODES))}[m]()
        self.replay_check()
        return self


def fuzz(seeds: range, steps: int = 120, legacy: bool = False, workers: int = 5, actors: int = 4
         , tokens: bool = False) -> tuple[list[str], dict[str, int]]:
    failures: list[str] = []
    stats: dict[str, int] = {}
    for s in seeds:
        f = Fuzz(s, legacy=legacy and s % 3 == 0, workers=workers, actors=actors, tokens=tokens).run(steps)
        failures += f.failures
        for k, n in f.stats.items():
            stats[k] = stats.get(k, 0) + n
    return failures, stats


if __name__ == "__main__":
    import sys
    import time
    t = time.time()
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    fails, stats = fuzz(range(n), legacy="legacy" in sys.argv)
    print(f"{time.time() - t:.1f}s", sorted(stats.items()))
    print(len(fails), "failures")
    for f in fails[:30]:
        print(f)
