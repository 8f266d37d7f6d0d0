"""The scheduler's decision against an oracle written from the contract's words alone (no
ClassEntry, no index), along random lives of a small fleet and its actors: registrations and
runtime changes (defaults, restorables, one-way `compatible_versions` edges, two architectures and
a version naming none), node moves, drains, removals, creations with and without a golden
snapshot, pauses (LOCAL images), suspensions, promotions and template changes. No MEMORY placement
on a worker whose runtimes cannot load the stamp, no LOCAL image off its node, no fallback across
architectures, nothing below the actor's floor; and a checkpointed projection decides the same.
(Written by a review that looked for a resume sent where its image cannot load, and found none.)"""

from __future__ import annotations

import os

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from events.compat import MACHINE_TO_ARCH, compat_key
from events.errors import ContractError
from events.schema import (
    ActorReleased, Attribute, CompatVersion, Fidelity, Location, PlacedFidelity, ReleaseReason,
    Resources, RuntimeChanged, SnapshotOrigin, TemplateChanged, WorkerDrained, WorkerRemoved, WorkerSandboxClass,
    WorkerUpdated,
)
from services.registry.domain import canonical_classes
from services.scheduler.checkpoint_codec import export_state, restore_state
from services.scheduler.committer import placed_event
from services.scheduler.decide import decide
from tests.factories import AT, CLASS, Log, booked, created, golden, registered, runtime, snapshot, taken, version

NOARCH = CompatVersion(schema_version="v2", attributes=(Attribute(key="gvisor_asset_hash", value="9"),))


def pool(arch):
    return [version(b, arch) for b in "1234"] + [NOARCH]


def arch_of(v):
    a = next((x.value for x in v.attributes if x.key == "architecture"), None)
    return None if a is None else MACHINE_TO_ARCH.get(a.lower(), a)


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


def check(pl, w, a, all_workers=None):
    """The oracle: the contract's words (placement rules 1 to 6)."""
    snap = a["snap"]
    assert w is not None and not w["drained"], (pl, w)
    owns_nothing = snap is None or snap.borrowed
    if pl.fidelity is PlacedFidelity.NONE:
        assert owns_nothing and a["floor"] is not Fidelity.MEMORY, (pl, snap, a["floor"])
    else:
        assert RANK[pl.fidelity.value] >= RANK[a["floor"].value], (pl, a["floor"])
    ent = w["classes"][0]
    if snap is not None and snap.location is Location.LOCAL:
        assert pl.node == snap.node == w["node"], (pl, snap, w)
    if pl.fidelity is PlacedFidelity.MEMORY:
        st_ = snap.sandbox_runtime
        assert st_ is not None and st_.sandbox_class == CLASS and snap.fidelity is Fidelity.MEMORY
        assert snap.template_uid == a["template"]
        ok = []
        for r in (ent.default_runtime, *ent.restorable_runtimes):
            if same(r.version, st_.version) or any(same(e, st_.version) for e in r.compatible_versions):
                ok.append(r.version)
        assert any(same(pl.sandbox_runtime.version, v) for v in ok), (pl, ent, st_)
        assert pl.snapshot_id == snap.snapshot_id
        # v1.1: matched_version is the version that matched the stamp (the pin's own, or the edge)
        assert pl.matched_version is not None and same(pl.matched_version, st_.version), (pl, st_)
        # rule 2 (v1.1 order): the worker's own default equal to the stamp, then a restorable, then edges
        tiers = [[ent.default_runtime.version] if same(ent.default_runtime.version, st_.version) else [],
                 [r.version for r in ent.restorable_runtimes if same(r.version, st_.version)],
                 [ent.default_runtime.version] if any(same(e, st_.version)
                                                      for e in ent.default_runtime.compatible_versions) else [],
                 [r.version for r in ent.restorable_runtimes if any(same(e, st_.version)
                                                                    for e in r.compatible_versions)]]
        best = next(t for t in tiers if t)
        assert any(same(pl.sandbox_runtime.version, v) for v in best), ("rule 2 order", pl, ent, st_)
        assert pl.sandbox_runtime.sandbox_class == CLASS
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
            and snap.template_uid == a["template"]):
        def loads(wk):
            e = wk["classes"][0]
            return any(same(r.version, snap.sandbox_runtime.version)
                       or any(same(x, snap.sandbox_runtime.version) for x in r.compatible_versions)
                       for r in (e.default_runtime, *e.restorable_runtimes))
        able = [wid for wid, wk in all_workers.items() if not wk["drained"] and loads(wk)
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
