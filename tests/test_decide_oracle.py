"""The scheduler's decision against an oracle written from the contract's words alone (no
ClassEntry, no index), along random lives of a small fleet and its actors: registrations and
runtime changes (defaults, restorables, one-way `compatible_versions` edges, two architectures and
a version naming none), node moves, drains, removals, creations with and without a golden
snapshot, pauses (LOCAL images), suspensions, promotions and template changes. No MEMORY placement
on a worker whose runtimes cannot load the stamp, no LOCAL image off its node, no fallback across
architectures, nothing below the actor's floor; and a checkpointed projection decides the same.
(Written by a review that looked for a resume sent where its image cannot load, and found none.)
A second life, seeded: workers of two classes whose entries may name the other class's versions and
other architectures (as a log from before the one-architecture rule may hold), amd64 spelt three
ways, golden snapshots of either class, labels and selectors (an audit's fuzzing, which found
nothing: kept as a guard)."""

from __future__ import annotations

import os
import random
from collections import Counter

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.compat import MACHINE_TO_ARCH, compat_key
from events.errors import ContractError
from events.schema import (
    ActorReleased, Attribute, CompatVersion, Fidelity, Location, PlacedFidelity, ReleaseReason,
    Resources, RuntimeChanged, SnapshotOrigin, TemplateChanged, WorkerDrained, WorkerRemoved, WorkerRuntime, WorkerSandboxClass,
    WorkerUpdated,
)
from services.registry.domain import canonical_classes
from services.scheduler.checkpoint_codec import export_state, restore_state
from services.scheduler.committer import placed_event
from services.scheduler.decide import decide
from tests.factories import (
    AT, CLASS, Log, booked, created, golden, registered, released, runtime, snapshot, taken, version,
)

NOARCH = CompatVersion(schema_version="v2", attributes=(Attribute(key="gvisor_asset_hash", value="9"),))


def pool(arch):
    return [version(b, arch) for b in "1234"] + [NOARCH]


def arch_of(v):
    a = next((x.value for x in v.attributes if x.key == "architecture"), None)
    return None if a is None else MACHINE_TO_ARCH.get(a.lower(), a)  # as the probe maps it (Go's names)


def same(a, b):
    return compat_key("", a) == compat_key("", b)


@st.composite
def class_entry(draw, arch):
    vs = pool(arch)
    d = draw(st.sampled_from(vs))
    rest = [v for v in vs if not same(v, d)]
    restorable = draw(st.lists(st.sampled_from(rest), unique_by=lambda v: compat_key("", v), max_size=2))

    def rt(v):
        edges = draw(st.lists(st.sampled_from([x for x in vs if not same(x, v)]),
                              unique_by=lambda x: compat_key("", x), max_size=2))
        return runtime(v, compatible=tuple(edges))
    return canonical_classes((WorkerSandboxClass(sandbox_class=CLASS, default_runtime=rt(d),
                                                 restorable_runtimes=tuple(rt(r) for r in restorable)),))


WORKERS = ["w0", "w1", "w2"]
ACTORS = ["a0", "a1"]
NODES = ["n-a", "n-b"]


@st.composite
def ops(draw):
    """A fleet's life: every worker registers and every actor is created first (so that what follows
    acts on something), then changes and lifecycle calls, resumes the most often."""
    kinds = ["reg"] * len(WORKERS) + ["create"] * len(ACTORS)
    kinds += draw(st.lists(st.sampled_from(["reg", "reg", "update", "drain", "remove", "create", "resume",
                                            "resume", "resume", "resume", "pause", "pause", "suspend",
                                            "suspend", "promote", "template"]), min_size=5, max_size=40))
    out = []
    for i, kind in enumerate(kinds):
        if kind == "reg":
            arch = draw(st.sampled_from(["amd64", "arm64"]))
            wid = WORKERS[i] if i < len(WORKERS) else draw(st.sampled_from(WORKERS))
            out.append((kind, wid, draw(class_entry(arch)), draw(st.sampled_from(NODES))))
        elif kind in ("update", "drain", "remove"):
            out.append((kind, draw(st.sampled_from(WORKERS)), draw(st.sampled_from(NODES))))
        elif kind == "create":
            g = draw(st.one_of(st.none(), st.sampled_from(pool("amd64") + pool("arm64"))))
            j = i - len(WORKERS)
            aid = ACTORS[j] if 0 <= j < len(ACTORS) else draw(st.sampled_from(ACTORS))
            out.append((kind, aid, g, draw(st.sampled_from(list(Fidelity)))))
        else:
            out.append((kind, draw(st.sampled_from(ACTORS)), draw(st.sampled_from(["t1", "t2"])),
                        draw(st.sampled_from(list(Fidelity)))))
    return out


RANK = {"MEMORY": 3, "VOLUMES": 2, "ROOTFS": 1, "NONE": 0}


def entry_of(w: dict, sandbox_class: str) -> WorkerSandboxClass | None:
    return next((c for c in w["classes"] if c.sandbox_class == sandbox_class), None)


def machine_of(w: dict) -> str | None:
    """The architecture of the worker's machine (docs/contract.md: one architecture per registration):
    the first its versions name, class by class, its first class's default's first."""
    versions = [v for ent in w["classes"] for r in (ent.default_runtime, *ent.restorable_runtimes)
                for v in (r.version, *r.compatible_versions)]
    return next((a for a in map(arch_of, versions) if a is not None), None)


def restoring(w: dict, ent: WorkerSandboxClass) -> tuple[WorkerRuntime | None, tuple[WorkerRuntime, ...]]:
    """(default, restorable runtimes) of the entry that may restore a memory image on the worker's
    machine: a runtime (the default too) or an edge of another architecture dropped. The registry
    refuses such a registration; a log written before the rule may hold one (two classes of two
    architectures, or one entry naming two), and no memory image may be placed through what is dropped."""
    machine = machine_of(w)

    def here(v: CompatVersion) -> bool:
        return arch_of(v) is None or machine is None or arch_of(v) == machine

    def kept(r):
        return msgspec.structs.replace(r, compatible_versions=tuple(filter(here, r.compatible_versions)))

    default = kept(ent.default_runtime) if here(ent.default_runtime.version) else None
    return default, tuple(kept(r) for r in ent.restorable_runtimes if here(r.version))


def check(pl, w, a, all_workers=None):
    """The oracle: the contract's words (placement rules 1 to 6). `w["classes"]`: the worker's class
    entries; `a["cls"]`: the actor's class (CLASS if not said)."""
    snap = a["snap"]
    cls = a.get("cls", CLASS)
    assert w is not None and not w["drained"], (pl, w)
    assert pl.sandbox_runtime.sandbox_class == cls, (pl, cls)
    wanted = {**a.get("selectors", {}), **a.get("asked", {})}  # rule 6: a request's selectors add to the actor's
    assert all(w.get("labels", {}).get(k) == v for k, v in wanted.items()), (pl, w, wanted)
    owns_nothing = snap is None or snap.borrowed
    if pl.fidelity is PlacedFidelity.NONE:
        assert owns_nothing and a["floor"] is not Fidelity.MEMORY, (pl, snap, a["floor"])
    else:
        assert RANK[pl.fidelity.value] >= RANK[a["floor"].value], (pl, a["floor"])
    ent = entry_of(w, cls)
    assert ent is not None, (pl, w, cls)
    default, restorable = restoring(w, ent)
    if snap is not None and snap.location is Location.LOCAL:
        assert pl.node == snap.node == w["node"], (pl, snap, w)
    if pl.fidelity is PlacedFidelity.MEMORY:
        st_ = snap.sandbox_runtime
        assert st_ is not None and st_.sandbox_class == cls and snap.fidelity is Fidelity.MEMORY
        assert snap.template_uid == a["template"]
        ok = []
        for r in (*([default] if default else []), *restorable):
            if same(r.version, st_.version) or any(same(e, st_.version) for e in r.compatible_versions):
                ok.append(r.version)
        assert any(same(pl.sandbox_runtime.version, v) for v in ok), (pl, ent, st_)
        assert pl.snapshot_id == snap.snapshot_id
        # v1.1: matched_version is the version that matched the stamp (the pin's own, or the edge)
        assert pl.matched_version is not None and same(pl.matched_version, st_.version), (pl, st_)
        # rule 2 (v1.1 order): the worker's own default equal to the stamp, then a restorable, then edges
        tiers = [[default.version] if default and same(default.version, st_.version) else [],
                 [r.version for r in restorable if same(r.version, st_.version)],
                 [default.version] if default and any(same(e, st_.version)
                                                      for e in default.compatible_versions) else [],
                 [r.version for r in restorable if any(same(e, st_.version) for e in r.compatible_versions)]]
        best = next(t for t in tiers if t)
        assert any(same(pl.sandbox_runtime.version, v) for v in best), ("rule 2 order", pl, ent, st_)
    else:
        assert pl.matched_version is None, pl
        if snap is not None and snap.sandbox_runtime is not None:
            sa = arch_of(snap.sandbox_runtime.version)
            if sa is not None:
                assert arch_of(ent.default_runtime.version) == sa, (pl, ent, snap)
        assert same(pl.sandbox_runtime.version, ent.default_runtime.version)
    if pl.fidelity is PlacedFidelity.NONE:
        assert pl.action.value == "RUN", pl
    else:
        assert pl.action.value == "RESTORE" and snap is not None and pl.snapshot_id == snap.snapshot_id, pl
    # rule 5: a PAUSED actor restores only from its local image on a compatible worker, never relaxed
    if a["state"] == "PAUSED" and snap.template_uid == a["template"]:
        assert pl.fidelity is PlacedFidelity.MEMORY, ("rule 5", pl, snap)
    # rule 2: room is ample (at most two actors of 1 GiB on 8 GiB workers), so a MEMORY snapshot of the
    # current template goes to a compatible worker whenever one is registered and undrained (on the image's
    # node, if LOCAL)
    if (snap is not None and snap.fidelity is Fidelity.MEMORY and snap.sandbox_runtime is not None
            and snap.sandbox_runtime.sandbox_class == cls and snap.template_uid == a["template"]):
        def loads(wk):
            e = entry_of(wk, cls)
            if e is None:
                return False
            d, rs = restoring(wk, e)
            return any(same(r.version, snap.sandbox_runtime.version)
                       or any(same(x, snap.sandbox_runtime.version) for x in r.compatible_versions)
                       for r in (*([d] if d else []), *rs))
        able = [wid for wid, wk in all_workers.items() if not wk["drained"] and loads(wk)
                and all(wk.get("labels", {}).get(k) == v for k, v in wanted.items())
                and (snap.location is not Location.LOCAL or wk["node"] == snap.node)]
        if able:
            assert pl.fidelity is PlacedFidelity.MEMORY, ("rule 2 preference", pl, able)


@settings(max_examples=int(os.environ.get("ORACLE_EXAMPLES", "200")), deadline=None,
          suppress_health_check=list(HealthCheck))
@given(ops())
def test_no_memory_image_where_it_cannot_load(script):
    log = Log()
    workers: dict[str, dict] = {}
    actors: dict[str, dict] = {}
    n = 0
    for op in script:
        kind = op[0]
        if kind == "reg":
            _, wid, classes, node = op
            if wid in workers:
                log.add(RuntimeChanged(at=AT, worker_id=wid, sandbox_classes=classes,
                                       previous=workers[wid]["classes"]))
                workers[wid]["classes"] = classes
            else:
                log.add(registered(wid, *classes, node=node, mem=8192))
                workers[wid] = {"classes": classes, "node": node, "drained": False}
        elif kind == "update" and op[1] in workers:
            w = workers[op[1]]
            log.add(WorkerUpdated(at=AT, worker_id=op[1], node=op[2],
                                  capacity=Resources(cpu_millis=4000, memory_mib=8192), labels={}))
            w["node"] = op[2]
        elif kind == "drain" and op[1] in workers and not workers[op[1]]["drained"]:
            log.add(WorkerDrained(at=AT, worker_id=op[1], reason="x"))
            workers[op[1]]["drained"] = True
        elif kind == "remove" and op[1] in workers:
            log.add(WorkerRemoved(at=AT, worker_id=op[1], reason="x"))
            del workers[op[1]]
            for aid, a in actors.items():
                if a["state"] == "RUNNING" and a["worker"] == op[1]:
                    log.add(ActorReleased(at=AT, actor_id=aid, worker_id=op[1], reason=ReleaseReason.WORKER_REMOVED))
                    a["state"] = "SUSPENDED"
        elif kind == "create":
            _, aid, g, floor = op
            if aid in actors and actors[aid]["state"] != "STOPPED":
                continue
            snap = None
            if g is not None:
                snap = msgspec.structs.replace(golden(g, snapshot_id=f"g{n}"), actor_id=aid, borrowed=True)
                n += 1
            log.add(created(aid, snapshot=snap, min_fidelity=floor))
            if snap is not None:
                log.add(taken(snap, SnapshotOrigin.CREATE))
            actors[aid] = {"state": "CREATED", "snap": snap, "template": "t1", "worker": None, "floor": floor}
        elif op[1] not in actors:
            continue
        else:
            _, aid, tpl, fid = op
            a = actors[aid]
            if kind == "template":
                if a["template"] != tpl:
                    log.add(TemplateChanged(at=AT, actor_id=aid, template_uid=tpl))
                    a["template"] = tpl
            elif kind == "resume" and a["state"] != "RUNNING":
                p = log.p
                try:
                    pl = log.decide(aid)
                except ContractError:
                    continue
                try:
                    pl2 = decide(restore_state(export_state(p)), aid, None, p.seq)
                except ContractError as e:
                    raise AssertionError(f"checkpointed projection refused {e}") from e
                assert pl2 == pl
                check(pl, workers.get(pl.worker_id), a, workers)
                log.add(placed_event(pl, None))
                log.add(booked(pl.worker_id, aid))
                a.update(state="RUNNING", worker=pl.worker_id, pin=pl.sandbox_runtime, node=pl.node,
                         running_template=a["template"])
            elif kind in ("pause", "suspend") and a["state"] == "RUNNING":
                loc = Location.LOCAL if kind == "pause" else Location.EXTERNAL
                s = snapshot(aid, a["pin"], snapshot_id=f"{aid}-x{n}", template=a["running_template"],
                             fidelity=Fidelity.MEMORY if kind == "pause" else fid,
                             node=a["node"] if kind == "pause" else None, location=loc)
                n += 1
                log.add(taken(s, SnapshotOrigin.PAUSE if kind == "pause" else SnapshotOrigin.SUSPEND))
                reason = ReleaseReason.PAUSED if kind == "pause" else ReleaseReason.SUSPENDED
                log.add(ActorReleased(at=AT, actor_id=aid, worker_id=a["worker"], reason=reason))
                a.update(state="PAUSED" if kind == "pause" else "SUSPENDED", snap=s, worker=None)
            elif kind == "promote" and a["state"] == "PAUSED":
                s = msgspec.structs.replace(a["snap"], location=Location.EXTERNAL, node=None, fidelity=fid,
                                            borrowed=False)
                log.add(taken(s, SnapshotOrigin.PROMOTE))
                a.update(state="SUSPENDED", snap=s)


# --- two classes, labels and architecture spellings -------------------------------------------

CLASSES = ("gvisor", "microvm")
LABELS = ({}, {"zone": "a"}, {"zone": "b"}, {"zone": "a", "gpu": "1"})


def versions_of(kernel: str) -> list[CompatVersion]:
    """Versions of two builds on two architectures, and amd64 spelt as the machine says it
    (`x86_64`, `AMD64`): what the registry may have stored from agents of several versions."""
    return ([version(b, arch, kernel_digest=kernel) for b in "12" for arch in ("amd64", "arm64")]
            + [version("1", "x86_64", kernel_digest=kernel), version("1", "AMD64", kernel_digest=kernel)])


def random_entry(rng: random.Random, sandbox_class: str) -> WorkerSandboxClass:
    """A class entry whose runtimes (and their edges) may name the other class's versions too."""
    pool = versions_of(sandbox_class) + versions_of("other")

    def some(exclude: list[CompatVersion], most: int) -> list[CompatVersion]:
        chosen: list[CompatVersion] = []
        for _ in range(rng.randint(0, most)):
            v = rng.choice(pool)
            if not any(same(v, x) for x in (*exclude, *chosen)):
                chosen.append(v)
        return chosen

    default = rng.choice(pool)
    return WorkerSandboxClass(
        sandbox_class=sandbox_class,
        default_runtime=runtime(default, compatible=tuple(some([default], 2))),
        restorable_runtimes=tuple(runtime(v, compatible=tuple(some([v], 2))) for v in some([default], 2)))


def one_life_of_two_classes(seed: int) -> Counter:
    """A fleet of workers that run one class or both, actors of either class (golden snapshots of
    either class, stamped with either class's versions), drains, node and label moves, pauses and
    suspensions, and resumes with and without selectors of their own: every placement is checked
    by the oracle and decided alike on a checkpointed projection. The placements, by fidelity."""
    rng = random.Random(seed)
    log = Log()
    workers: dict[str, dict] = {}
    actors: dict[str, dict] = {}
    placements: Counter = Counter()
    for step in range(120):
        roll = rng.random()
        if roll < 0.25:  # a worker (re)registers: a new life
            wid = f"w{rng.randint(0, 4)}"
            classes = canonical_classes(tuple(random_entry(rng, c) for c in CLASSES if rng.random() < 0.7)
                                        or (random_entry(rng, CLASSES[0]),))
            if wid in workers:
                log.add(WorkerRemoved(at=AT, worker_id=wid, reason="x"))
                for aid, a in actors.items():
                    if a["state"] == "RUNNING" and a["worker"] == wid:
                        log.add(released(aid, wid, ReleaseReason.WORKER_REMOVED))
                        a.update(state="SUSPENDED", worker=None)
            node, labels = rng.choice(NODES), rng.choice(LABELS)
            log.add(registered(wid, *classes, node=node, mem=16384, cpu=16000, labels=labels))
            workers[wid] = {"classes": classes, "node": node, "drained": False, "labels": labels}
        elif roll < 0.30:  # drained, or moved to another node or labels
            wid = f"w{rng.randint(0, 4)}"
            if wid not in workers:
                continue
            w = workers[wid]
            if rng.random() < 0.5 and not w["drained"]:
                log.add(WorkerDrained(at=AT, worker_id=wid, reason=None))
                w["drained"] = True
            else:
                w.update(node=rng.choice(NODES), labels=rng.choice(LABELS[:3]))
                log.add(WorkerUpdated(at=AT, worker_id=wid, node=w["node"], labels=w["labels"],
                                      capacity=Resources(cpu_millis=16000, memory_mib=16384)))
        elif roll < 0.35:  # an actor created, maybe from a golden snapshot of either class
            aid = f"a{rng.randint(0, 3)}"
            if aid in actors and actors[aid]["state"] != "STOPPED":
                continue
            cls = rng.choice(CLASSES)
            gold = None
            if rng.random() < 0.5:
                gold = msgspec.structs.replace(
                    golden(rng.choice(versions_of(cls) + versions_of("other")), snapshot_id=f"{aid}-g{step}",
                           fidelity=rng.choice(list(Fidelity)), sandbox_class=rng.choice(CLASSES)),
                    actor_id=aid, borrowed=True)
            floor, selectors = rng.choice(list(Fidelity)), rng.choice(({}, {"zone": "a"}))
            log.add(created(aid, sandbox_class=cls, snapshot=gold, min_fidelity=floor, mem=512, cpu=100,
                            selectors=selectors))
            actors[aid] = {"cls": cls, "snap": gold, "state": "CREATED", "floor": floor, "worker": None,
                           "template": "t1", "selectors": selectors}
        elif roll < 0.75:  # a resume
            aid = f"a{rng.randint(0, 3)}"
            a = actors.get(aid)
            if a is None or a["state"] == "RUNNING":
                continue
            asked = rng.choice((None, {"gpu": "1"}, {"zone": "a"}))
            try:
                pl = decide(log.p, aid, asked, log.p.seq)
            except ContractError:
                continue
            assert decide(restore_state(export_state(log.p)), aid, asked, log.p.seq) == pl, seed
            check(pl, workers.get(pl.worker_id), {**a, "asked": asked or {}}, workers)
            log.place(pl)
            a.update(state="RUNNING", worker=pl.worker_id, pin=pl.sandbox_runtime, node=pl.node)
            placements[pl.fidelity] += 1
        else:  # paused (LOCAL, MEMORY) or suspended (EXTERNAL, any fidelity), stamped with the pin
            aid = f"a{rng.randint(0, 3)}"
            a = actors.get(aid)
            if a is None or a["state"] != "RUNNING":
                continue
            pause = rng.random() < 0.5
            s = snapshot(aid, a["pin"], snapshot_id=f"{aid}-s{step}", template=a["template"],
                         fidelity=Fidelity.MEMORY if pause else rng.choice(list(Fidelity)),
                         node=a["node"] if pause else None, uri=None if pause else "s3://y",
                         location=Location.LOCAL if pause else Location.EXTERNAL)
            log.add(taken(s, SnapshotOrigin.PAUSE if pause else SnapshotOrigin.SUSPEND))
            log.add(released(aid, a["worker"], ReleaseReason.PAUSED if pause else ReleaseReason.SUSPENDED))
            a.update(state="PAUSED" if pause else "SUSPENDED", snap=s, worker=None)
    return placements


def test_two_classes_labels_and_architecture_spellings_never_place_an_image_where_it_cannot_load():
    """The oracle over workers of two classes whose runtimes and edges may name the other class's
    versions, golden snapshots of the other class, amd64 spelt three ways, labels and selectors
    (an audit's fuzzing, kept as a guard: it found nothing)."""
    placed: Counter = Counter()
    for seed in range(int(os.environ.get("ORACLE_SEEDS", "300"))):
        placed += one_life_of_two_classes(seed)
    # the lives do reach placements of every kind (about 1,000 in all, 200 of them MEMORY)
    assert placed[PlacedFidelity.MEMORY] > 100 and sum(placed.values()) > 500, placed
