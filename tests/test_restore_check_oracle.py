"""A worker's own check of a placement (`warmboot.restore_check.cannot_carry_out_here`, behind
`warmboot agent --check-placement`) against the fleet oracle's placements and the contract's rules
(tests/fleet_oracle.py; the expectation below is written from CONTRACT sections 2 and 3 and
docs/contract.md's machine rule alone, no code of `services.scheduler`).

Seeded lives of a small fleet (edges on most runtimes, attributes shuffled, amd64 also spelt
x86_64, a version naming no architecture, LOCAL images, fallbacks to VOLUMES, ROOTFS and NONE).
Every placement `decide` makes that the oracle accepts is checked against its worker's own
registration, as the fleet holds it: it must pass (a refusal would make a worker refuse a good
placement). Then that registration is drifted (the pinned runtime dropped, promoted over or
demoted, the edge that matched dropped or moved to a runtime of its own, cpu_features or the
architecture changed or respelt, the node moved, capacity and labels changed, attributes,
restorable runtimes and classes reordered, runtimes renamed, an unrelated restorable added), and
among drifts the registry would accept, the check must refuse exactly when the contract says the
drifted machine cannot carry it out: the pin one of its runtimes (by version; `name` never takes
part), on its node, and at MEMORY the image's version (`matched_version`, else the pin's) the
pin's own version or one of its edges, neither of another architecture than the machine.
The Assignment as the scheduler replies it and as
`warmboot actor resume -o json` prints it (with `seq` and the `runtime_id` keys the views add)
decodes to the same placement. (Written by an audit, which found the check exactly right: kept as
a guard.)
"""

from __future__ import annotations

import json

import msgspec

from events.codec import decode_request, encode
from events.errors import ContractError
from events.schema import (
    ActorOverhead, Assignment, Attribute, CompatVersion, Placement, PlacedFidelity, RegisterWorker, Resources,
    WorkerRuntime,
)
from events.validate import check_request
from tests.fleet_oracle import NOARCH, W, Fuzz, arch, eq, pool
from warmboot.cmd_views import with_runtime_ids
from warmboot.restore_check import cannot_carry_out_here

R = msgspec.structs.replace
MUST_PASS = ("pin demoted", "capacity and labels", "reordered", "renamed", "unrelated restorable")


def can_carry_out(reg: RegisterWorker, p: Placement) -> bool:
    """The contract's answer, on the oracle's model of a worker."""
    w = W(reg.worker_id, 1, reg.node, 1, 1, {}, reg.sandbox_classes)
    e = w.entry(p.sandbox_runtime.sandbox_class)
    if reg.worker_id != p.worker_id or reg.node != p.node or e is None:
        return False
    pins = [r for r in (e.default_runtime, *e.restorable_runtimes) if eq(r.version, p.sandbox_runtime.version)]
    if p.fidelity is not PlacedFidelity.MEMORY:
        return bool(pins)
    image, machine = p.matched_version or p.sandbox_runtime.version, w.machine()

    def other(ver: CompatVersion) -> bool:
        return arch(ver) not in (None, machine) and machine is not None

    return any((eq(r.version, image) or any(eq(x, image) for x in r.compatible_versions))
               and not other(r.version) and not other(image) for r in pins)


def each_version(reg: RegisterWorker, f, edges: bool = True) -> RegisterWorker:
    def runtime(r: WorkerRuntime) -> WorkerRuntime:
        return R(r, version=f(r.version), compatible_versions=tuple(map(f, r.compatible_versions)) if edges
                 else r.compatible_versions)
    return R(reg, sandbox_classes=tuple(R(e, default_runtime=runtime(e.default_runtime),
                                          restorable_runtimes=tuple(map(runtime, e.restorable_runtimes)))
                                        for e in reg.sandbox_classes))


def attr(to: dict[str, str] | str, key: str = "architecture"):
    def f(ver: CompatVersion) -> CompatVersion:
        return R(ver, attributes=tuple(Attribute(key=a.key, value=(to if isinstance(to, str) else to[a.value])
                                                 if a.key == key else a.value) for a in ver.attributes))
    return f


def drifts(reg: RegisterWorker, p: Placement, r):
    i = next(i for i, e in enumerate(reg.sandbox_classes) if e.sandbox_class == p.sandbox_runtime.sandbox_class)
    e, pin, m = reg.sandbox_classes[i], p.sandbox_runtime.version, p.matched_version

    def entry(new) -> RegisterWorker:
        return R(reg, sandbox_classes=(*reg.sandbox_classes[:i], new, *reg.sandbox_classes[i + 1:]))

    rest = tuple(x for x in e.restorable_runtimes if not eq(x.version, pin))
    if not eq(e.default_runtime.version, pin):
        yield "pin dropped", entry(R(e, restorable_runtimes=rest))
    elif rest:
        yield "pin dropped, a restorable promoted", entry(R(e, default_runtime=rest[0], restorable_runtimes=rest[1:]))
        yield "pin demoted", entry(R(e, default_runtime=rest[0], restorable_runtimes=(*rest[1:], e.default_runtime)))
    else:
        other = next(x for x in pool(arch(pin) or "amd64") if not eq(x, pin))
        yield "pin replaced", entry(R(e, default_runtime=R(e.default_runtime, version=other)))
    if m is not None and not eq(m, pin):
        def unedged(x: WorkerRuntime) -> WorkerRuntime:
            return R(x, compatible_versions=tuple(c for c in x.compatible_versions if not eq(c, m)))
        yield "edge dropped", entry(R(e, default_runtime=unedged(e.default_runtime),
                                      restorable_runtimes=tuple(map(unedged, e.restorable_runtimes))))
        # still accepted on the machine, but by a runtime of its own, not the pin's
        mine = R(e.default_runtime, name="m", version=m, compatible_versions=())
        moved = entry(R(e, default_runtime=unedged(e.default_runtime), restorable_runtimes=(
            *(x for x in map(unedged, e.restorable_runtimes) if not eq(x.version, m)), mine)))
        yield "edge moved", moved if eq(e.default_runtime.version, pin) or not eq(e.default_runtime.version, m) else \
            entry(R(e, restorable_runtimes=tuple(map(unedged, e.restorable_runtimes))))
    yield "cpu_features", each_version(reg, attr("ff", "cpu_features"), edges=r.random() < 0.5)
    yield "architecture", each_version(reg, attr({"amd64": "arm64", "x86_64": "arm64", "arm64": "amd64"}),
                                       edges=r.random() < 0.5)
    yield "architecture respelt", each_version(reg, attr({"amd64": "x86_64", "x86_64": "amd64", "arm64": "aarch64"}))
    yield "node moved", R(reg, node="n9")
    yield "capacity and labels", R(reg, capacity=Resources(cpu_millis=1, memory_mib=1), labels={"zone": "z"})
    shuffled = each_version(reg, lambda v: R(v, attributes=tuple(r.sample(v.attributes, len(v.attributes)))))
    yield "reordered", R(shuffled, sandbox_classes=tuple(
        R(x, restorable_runtimes=tuple(r.sample(x.restorable_runtimes, len(x.restorable_runtimes))))
        for x in reversed(shuffled.sandbox_classes)))
    yield "renamed", R(reg, sandbox_classes=tuple(R(
        x, default_runtime=R(x.default_runtime, name="other"),
        restorable_runtimes=tuple(R(y, name=None) for y in x.restorable_runtimes)) for x in reg.sandbox_classes))
    have = (e.default_runtime.version, *(x.version for x in e.restorable_runtimes))
    new = [x for x in pool(W("", 1, "", 1, 1, {}, reg.sandbox_classes).machine() or "amd64") + [NOARCH]
           if not any(eq(x, y) for y in have)]
    if new:
        unrelated = WorkerRuntime(version=r.choice(new), name="x", compatible_versions=())
        yield "unrelated restorable", entry(R(e, restorable_runtimes=(*e.restorable_runtimes, unrelated)))


class Audit(Fuzz):
    """The oracle's lives, with an edge or more on every runtime, each fresh placement checked as above."""

    def __init__(self, seed: int):
        super().__init__(seed)
        self.fresh = None
        self.seen: dict[str, int] = {}

    def runtime(self, versions: list[CompatVersion], own: CompatVersion) -> WorkerRuntime:
        edges = self.r.sample([x for x in versions if not eq(x, own)], self.r.choice([1, 2, 3]))
        return WorkerRuntime(version=self.shuffled(own), name=self.r.choice([None, "runsc"]),
                             compatible_versions=tuple(map(self.shuffled, edges)),
                             actor_overhead=self.r.choice([None, ActorOverhead(fixed_mib=100, per_gib_mib=0)]))

    def decide_with(self, aid, request, pending, refusals):
        answer = super().decide_with(aid, request, pending, refusals)
        if refusals is None:
            self.fresh = answer
        return answer

    def resume(self, aid: str) -> None:
        self.fresh, before = None, len(self.failures)
        super().resume(aid)
        p = self.fresh
        if not isinstance(p, Placement) or len(self.failures) > before:
            return
        w = self.workers[p.worker_id]
        reg = RegisterWorker(worker_id=w.wid, node=w.node, capacity=Resources(cpu_millis=w.cpu, memory_mib=w.mem),
                             labels=dict(w.labels), sandbox_classes=w.classes)
        edge = p.matched_version is not None and not eq(p.matched_version, p.sandbox_runtime.version)
        self.count(f"placed {p.fidelity.value}{' through an edge' if edge else ''}")
        if cannot_carry_out_here(reg, p) is not None:
            self.fail(f"its own worker refuses {p!r}: {cannot_carry_out_here(reg, p)}; {reg!r}")
        reply = Assignment(**msgspec.structs.asdict(p), seq=7)
        for form in (encode(reply), json.dumps(with_runtime_ids(msgspec.to_builtins(reply)), indent=2).encode()):
            if decode_request(Placement, form) != p:
                self.fail(f"{form!r} decodes to {decode_request(Placement, form)!r}, not {p!r}")
        for kind, drifted in drifts(reg, p, self.r):
            try:
                check_request(RegisterWorker, drifted)
            except ContractError:
                continue  # a registration no agent builds (load_registration checks it so)
            want, got = can_carry_out(drifted, p), cannot_carry_out_here(drifted, p)
            self.count(f"{kind} {'passes' if got is None else 'refused'}")
            if (got is None) != want or (kind in MUST_PASS and not want):
                self.fail(f"{kind}: expected {'a pass' if want else 'a refusal'}, got {got!r} for {p!r}\n"
                          f"  before {reg.sandbox_classes!r}\n  after {drifted.sandbox_classes!r}")


def test_the_worker_check_passes_every_placement_on_its_own_worker_and_refuses_exactly_the_drifts_that_break_it():
    failures, stats = [], {}
    for seed in range(60):
        audit = Audit(seed).run(120)
        failures += audit.failures
        for what, n in audit.stats.items():
            stats[what] = stats.get(what, 0) + n
    assert not failures, "\n".join(failures[:5])
    # what the lives reached, so that a change of the generator cannot make this test vacuous
    for what, least in (("placed MEMORY", 120), ("placed MEMORY through an edge", 12), ("placed VOLUMES", 60),
                        ("placed ROOTFS", 20), ("placed NONE", 120), ("edge dropped refused", 12),
                        ("edge moved refused", 12), ("pin dropped refused", 12), ("pin replaced refused", 30),
                        ("pin demoted passes", 250), ("cpu_features passes", 200), ("cpu_features refused", 20),
                        ("architecture refused", 120), ("architecture passes", 6),
                        ("architecture respelt refused", 300), ("architecture respelt passes", 30),
                        ("unrelated restorable passes", 300)):
        assert stats.get(what, 0) >= least, (what, stats.get(what, 0), stats)
