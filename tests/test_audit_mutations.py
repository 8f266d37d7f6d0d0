"""A mutation campaign on `warmboot audit verify`: logs whose placements the real scheduler decided
(`decide` on the real Projection, `tests/fleet_oracle.py`'s seeded lives of a fleet, without the
snapshots of foreign writers, which break the stamping rules on purpose) are clean, and each
mutation of one that breaks exactly one placement or stamping rule is found, at the event that
breaks it, under the rule's name. Pure (no server) and seeded.

Two kinds of mutation:
- a placement swapped for another one at the same point of the log (`test_every_other_placement_...`):
  every worker of the fleet, drained or not, every runtime of its classes as the pin, its node or
  another, every action and fidelity, every fallback record (none, each reason, another fidelity). The
  fleet oracle, written from the contract's text over a
  model of its own, says which of them the rules allow; verify must flag every other one and none
  of those. Two things verify cannot judge are left out: a fallback while a compatible worker may
  have had room (the request's selectors, which may have ruled those out, are not in the log), and
  a cold boot of an actor that owns nothing to lose (rule 4a: it may always RUN), but for one whose
  latest snapshot is a LOCAL image, which only its node's workers take (rule 5).
- a log changed around a placement or a snapshot (`test_a_log_changed_around_...`): a drain, a removal
  (LOST or not), a re-registration or a runtime change to runtimes of another CPU, a re-registration
  on the other architecture, a capacity cut, a label or node change, a template change or a stop,
  inserted right before a placement (that is, after its decision); the placement moved before the
  registration or the snapshot it relies on, written twice, for the request id of an earlier one,
  booking less or more, restoring more than the image holds or less than the rules give, another
  snapshot than the latest, naming another matched version; the actor's min_fidelity raised; each
  stamp of a pause, suspend, promote, tag, creation and revert changed, the template of a pause's or
  a suspend's image, whether it is borrowed, and a pause's fidelity; a release naming another worker,
  recorded as a removal's where the worker was not removed, or a removal's left out.

(Written by a mutation campaign, which found verify letting pass a LOCAL memory image given up on its
node (restored without memory, or cold-booted), a cold boot off a LOCAL image's node, a snapshot
restored below its own fidelity, a borrowed memory image's volumes restored, a memory restore whose
record names another version than its image's as the one matched, a placement for the request id of
an earlier one, a pause's or a suspend's image of another template than the actor ran (then restored
at MEMORY as if of its current one), and a pause, suspend or promote recorded `borrowed` otherwise
than the snapshotter records it (a resume may then cold-boot an actor that has volumes): fixed in
`warmboot.audit`, the fidelities with `decide.plan`, the request ids with the projection's own record
of them. The scheduler's decisions had none of these (`tests/test_decide_fleet_oracle.py`), nor the
snapshotter's records (`running_template_uid`, `stamping.paused_snapshot` and the rest). Then, with
every fallback record tried: a fallback naming another reason than the rules give (NO_COMPATIBLE_WORKER
where the template changed), another fidelity than its placement's, on a memory restore or a cold boot,
or none on a placement giving a memory image up: fixed by judging the record against the plan's tier.)
"""

from __future__ import annotations

import random
from collections import Counter
import msgspec

from events.schema import (
    Action,
    ActorCreated,
    ActorPlaced,
    ActorReleased,
    ActorReverted,
    ActorRuntime,
    ActorStopped,
    Attribute,
    CompatVersion,
    Fallback,
    FallbackReason,
    Fidelity,
    Location,
    PlacedFidelity,
    Placement,
    ReleaseReason,
    Resources,
    RuntimeChanged,
    Snapshot,
    SnapshotOrigin,
    SnapshotTaken,
    TagRecorded,
    TemplateChanged,
    WorkerBooked,
    WorkerDrained,
    WorkerRegistered,
    WorkerRemoved,
    WorkerRuntime,
    WorkerSandboxClass,
    WorkerUpdated,
)
from services.scheduler.committer import placed_event
from tests import fleet_oracle as fo
from tests.factories import fold
from warmboot import audit
from warmboot.audit import Sink

SEEDS = range(30)


class CleanLife(fo.Fuzz):
    """A fleet oracle life whose log verify must find clean: no foreign snapshot, and a creation from a
    tag copies what a TagRecorded names (a live actor's latest EXTERNAL snapshot) or is golden. A
    verifying Sink folds the log as it grows; before each resume, `others` judges every other placement
    the resume could be recorded as."""

    def __init__(self, seed: int, **kwargs):
        super().__init__(seed, legacy=seed % 3 == 0, **kwargs)
        self.sink = Sink(verify=True)
        self.judged: Counter = Counter()
        self.wrong: list[str] = []

    def add(self, event) -> None:
        super().add(event)
        if self.sink.violation is None:
            self.sink.apply(len(self.events), event)

    def foreign_snapshot(self, aid: str) -> None:
        return None

    def pause(self, aid: str) -> None:
        super().pause(aid)
        if self.r.random() < 0.3:  # (reverts are rare in the oracle's lives: a few more)
            self.revert(aid)

    def create(self, aid: str) -> None:
        r = self.r
        a = self.actors.get(aid)
        if a is not None and a.state != "STOPPED":
            return
        k = r.random()
        sources = [b for b in self.actors.values() if b.state == "SUSPENDED" and b.snap is not None
                   and b.snap.location is Location.EXTERNAL and b.aid != aid]
        a = fo.A(aid, r.choice(fo.CLASSES), "t1", r.choice([250, 500]), r.choice([256, 512, 1024, 1500]),
                 r.choice([{}, {}, {"zone": "a"}]), r.choice(list(Fidelity)))
        snap = None
        if k < 0.35:  # golden: EXTERNAL, borrowed, stamped for the class
            snap = Snapshot(snapshot_id=f"g{self.n}", actor_id=aid, template_uid=r.choice(["t1", "t1", "t0"]),
                            fidelity=r.choice([Fidelity.MEMORY, Fidelity.MEMORY, Fidelity.VOLUMES, Fidelity.ROOTFS]),
                            location=Location.EXTERNAL, uri="s3://g", borrowed=True, taken_at=fo.AT,
                            sandbox_runtime=ActorRuntime(sandbox_class=a.cls, version=self.version()))
        elif k < 0.6 and sources:  # from a tag naming another actor's latest snapshot
            b = r.choice(sources)
            tag = f"tag{self.n}"
            self.add(TagRecorded(at=self.at(), tag=tag, snapshot=b.snap))
            self.add(SnapshotTaken(at=self.at(), actor_id=b.aid, snapshot=b.snap, origin=SnapshotOrigin.TAG))
            a.cls = b.snap.sandbox_runtime.sandbox_class if b.snap.sandbox_runtime is not None else b.cls
            snap = msgspec.structs.replace(b.snap, actor_id=aid)
        if snap is None and a.floor is Fidelity.MEMORY and r.random() < 0.8:
            a.floor = Fidelity.ROOTFS
        a.snap, a.borrows, a.external = snap, snap is not None and snap.borrowed, snap
        self.actors[aid] = a
        self.add(ActorCreated(at=self.at(), actor_id=aid, sandbox_class=a.cls, template_uid=a.template,
                              resources=Resources(cpu_millis=a.cpu, memory_mib=a.mem), selectors=a.selectors,
                              min_fidelity=a.floor, snapshot=snap))
        if snap is not None:
            self.add(SnapshotTaken(at=self.at(), actor_id=aid, snapshot=snap, origin=SnapshotOrigin.CREATE))

    def resume(self, aid: str) -> None:
        a = self.actors.get(aid)
        if a is not None and a.state in ("CREATED", "SUSPENDED", "PAUSED") and self.sink.violation is None:
            self.others(a)
        super().resume(aid)

    def others(self, a: fo.A) -> None:
        """Every placement of `a` at this point (`candidates`), as verify judges it and as the oracle does."""
        legal = allowed(self.workers, a)
        lenient = fallbacks(self.workers, a)
        verifier = self.sink.verifier
        seq = len(self.events) + 1
        for option, event in candidates(self.workers, a):
            creating = dict(verifier.creating)
            found = verifier.check(seq, event)  # pure: the projection is of the log before it
            verifier.creating = creating
            self.judged[found.rule if found is not None else "clean"] += 1
            if option in legal:
                if found is not None:
                    self.wrong.append(f"seed {self.seed} at {seq}: a placement the rules allow is flagged: {found}")
                continue
            if found is not None or option in lenient or (option[3] == "RUN" and a.snap is not None and a.snap.borrowed
                                                          and a.snap.location is Location.EXTERNAL):
                continue
            self.wrong.append(f"seed {self.seed} at {seq}: {a.aid} placed {option}, which the rules do not allow "
                              f"(its latest snapshot {a.snap}), is not flagged")


Option = tuple  # (worker, node, fidelity, action, pin's (class, version key), snapshot id, booked, fallback)


def allowed(workers: dict[str, fo.W], a: fo.A) -> set[Option]:
    """The placements the oracle allows on the fleet as it is (room included), by the actor's selectors."""
    options, _ = fo.options(workers, a, dict(a.selectors), {})
    return {(o.wid, o.node, o.fidelity, o.action, o.pin, o.snapshot_id, o.booked, o.fallback)
            for o in options if o.fits and not o.filtered}


def fallbacks(workers: dict[str, fo.W], a: fo.A) -> set[Option]:
    """The fallbacks of rule 4 the oracle allows as if no compatible worker had room (the oracle's options
    of the same snapshot under a stamp no worker accepts, of the same class and architecture)."""
    snap = a.snap
    if snap is None or snap.fidelity is not Fidelity.MEMORY or snap.sandbox_runtime is None:
        return set()
    st = snap.sandbox_runtime
    nobody = CompatVersion(schema_version=st.version.schema_version,
                           attributes=(*st.version.attributes, Attribute(key="zz_accepted_by", value="nobody")))
    other = fo.A(**{**a.__dict__, "snap": msgspec.structs.replace(
        snap, sandbox_runtime=ActorRuntime(sandbox_class=st.sandbox_class, version=nobody))})
    return allowed(workers, other)


PLACEMENTS = ((Action.RUN, PlacedFidelity.NONE), (Action.RESTORE, PlacedFidelity.MEMORY),
              (Action.RESTORE, PlacedFidelity.VOLUMES), (Action.RESTORE, PlacedFidelity.ROOTFS))


def records(fidelity: PlacedFidelity) -> tuple[Fallback | None, ...]:
    """The fallback records a placement at `fidelity` is tried with: none, each reason from MEMORY to its
    fidelity, and one to another fidelity than its own."""
    other = PlacedFidelity.VOLUMES if fidelity is not PlacedFidelity.VOLUMES else PlacedFidelity.NONE
    return (None, *(Fallback(reason=reason, from_fidelity=PlacedFidelity.MEMORY, to_fidelity=fidelity)
                    for reason in FallbackReason),
            Fallback(reason=FallbackReason.NO_COMPATIBLE_WORKER, from_fidelity=PlacedFidelity.MEMORY,
                     to_fidelity=other))


def candidates(workers: dict[str, fo.W], a: fo.A):
    """(option, ActorPlaced) for every worker, every runtime of its classes as the pin, its node or
    another, every action and fidelity, every fallback record (`records`); booked as that runtime asks;
    a memory restore naming the stamp's version as matched."""
    snap = a.snap
    stamp = snap.sandbox_runtime if snap is not None else None
    seen = set()
    for w in workers.values():
        for entry in w.classes:
            cls = entry.sandbox_class
            for rt in (entry.default_runtime, *entry.restorable_runtimes):
                booked = (a.cpu, a.mem + fo.overhead(rt, a.mem))
                for node in (w.node, "elsewhere"):
                    for action, fidelity in PLACEMENTS:
                        if action is Action.RESTORE and snap is None:
                            continue
                        sid = snap.snapshot_id if action is Action.RESTORE else None
                        for fallback in records(fidelity):
                            option = (w.wid, node, fidelity.value, action.value, (cls, fo.key(rt.version)), sid,
                                      booked, None if fallback is None else (
                                          fallback.reason.value, fallback.from_fidelity.value,
                                          fallback.to_fidelity.value))
                            if option in seen:
                                continue
                            seen.add(option)
                            yield option, placed_event(Placement(
                                actor_id=a.aid, worker_id=w.wid, node=node, action=action, fidelity=fidelity,
                                sandbox_runtime=ActorRuntime(sandbox_class=cls, version=rt.version), snapshot_id=sid,
                                fallback=fallback, booked=Resources(cpu_millis=booked[0], memory_mib=booked[1]),
                                matched_version=stamp.version if fidelity is PlacedFidelity.MEMORY and stamp else None,
                            ), None)


_LIVES: dict[int, CleanLife] = {}


def life(seed: int) -> CleanLife:
    """The seeded life (made once per seed for this module's tests)."""
    if seed not in _LIVES:
        _LIVES[seed] = CleanLife(seed, workers=6, actors=5).run(200)
    return _LIVES[seed]


def test_the_logs_the_scheduler_decided_are_clean():
    """The unmutated logs: every decision the oracle's (the fleet oracle's own checks), and verify
    finds no violation, through the Sink that folded them as they grew and through a fresh fold."""
    placements = 0
    for seed in SEEDS:
        f = life(seed)
        assert not f.failures, f.failures[:3]
        assert f.sink.violation is None, f"seed {seed}: {f.sink.violation}"
        assert fold(f.events, Sink(verify=True)).violation is None
        placements += sum(isinstance(e, ActorPlaced) for e in f.events)
    assert placements >= 300, placements


def test_every_other_placement_is_flagged_unless_the_rules_allow_it():
    wrong: list[str] = []
    judged: Counter = Counter()
    for seed in SEEDS:
        f = life(seed)
        wrong += f.wrong
        judged += f.judged
    assert not wrong, "\n".join(wrong[:10])
    # what the candidates reached, so that a change of the generator cannot make this test vacuous
    for rule in (audit.NOT_TAKING, audit.PAST_ROOM, audit.RUNTIME_GONE, audit.SELECTOR_UNMET, audit.LOCAL_OFF_NODE,
                 audit.ACROSS_ARCHITECTURES, audit.NODE_MISMATCH, audit.NOT_IN_SNAPSHOT, audit.BELOW_FLOOR,
                 audit.OFF_PLAN, audit.FALLBACK_MISSTATED):
        assert judged[rule] >= 20, (rule, judged)
    assert judged["clean"] >= 500, judged


# --- mutations of a log around a placement or a snapshot ------------------------------------------------

Log = list
Mutant = tuple[Log, int, frozenset[str]]  # the log, the sequence verify must stop at, the rules it may name


def other_cpu(version: CompatVersion) -> CompatVersion:
    """The same version on a CPU of other features (`cpu_features`, added or changed)."""
    attrs = tuple(a for a in version.attributes if a.key != "cpu_features")
    return CompatVersion(schema_version=version.schema_version,
                         attributes=(*attrs, Attribute(key="cpu_features", value="0123456789abcdef")))


def on_other_cpu(classes: tuple[WorkerSandboxClass, ...]) -> tuple[WorkerSandboxClass, ...]:
    def rt(r: WorkerRuntime) -> WorkerRuntime:
        return msgspec.structs.replace(r, version=other_cpu(r.version),
                                       compatible_versions=tuple(map(other_cpu, r.compatible_versions)))
    return tuple(msgspec.structs.replace(e, default_runtime=rt(e.default_runtime),
                                         restorable_runtimes=tuple(map(rt, e.restorable_runtimes))) for e in classes)


def other_arch(version: CompatVersion) -> CompatVersion:
    """The same version on the other architecture (one named amd64, or x86_64, becomes arm64; any other,
    amd64; one naming none, arm64)."""
    mine = fo.arch(version)
    attrs = tuple(a for a in version.attributes if a.key != "architecture")
    flipped = Attribute(key="architecture", value="arm64" if mine != "arm64" else "amd64")
    return CompatVersion(schema_version=version.schema_version, attributes=(*attrs, flipped))


def other_arch_entry(e: WorkerSandboxClass) -> WorkerSandboxClass:
    def rt(r: WorkerRuntime) -> WorkerRuntime:
        return msgspec.structs.replace(r, version=other_arch(r.version),
                                       compatible_versions=tuple(map(other_arch, r.compatible_versions)))
    return msgspec.structs.replace(e, default_runtime=rt(e.default_runtime),
                                   restorable_runtimes=tuple(map(rt, e.restorable_runtimes)))


class Around:
    """What the log says, before index `i` (an ActorPlaced), of its worker and its actor."""

    def __init__(self, events: Log, i: int):
        self.events, self.i = events, i
        p: ActorPlaced = events[i]
        self.placed = p
        self.registration: WorkerRegistered | None = None
        self.registered_at = self.created_at = self.latest_at = -1
        self.classes = None
        self.node = self.capacity = self.labels = None
        self.created: ActorCreated | None = None
        self.latest: Snapshot | None = None  # the actor's latest snapshot
        self.snapshot_ids: list[str] = []
        for j, e in enumerate(events[:i]):
            if getattr(e, "worker_id", None) == p.worker_id and not isinstance(e, (ActorPlaced, WorkerBooked)):
                if isinstance(e, WorkerRegistered):
                    self.registration, self.registered_at, self.classes = e, j, e.sandbox_classes
                    self.node, self.capacity, self.labels = e.node, e.capacity, e.labels
                elif isinstance(e, RuntimeChanged):
                    self.classes = e.sandbox_classes
                elif isinstance(e, WorkerUpdated):
                    self.node, self.capacity, self.labels = e.node, e.capacity, e.labels
            if getattr(e, "actor_id", None) == p.actor_id:
                if isinstance(e, ActorCreated):
                    self.created, self.created_at, self.snapshot_ids, self.latest = e, j, [], e.snapshot
                    if e.snapshot is not None:
                        self.latest_at = j
                if isinstance(e, SnapshotTaken) and e.origin is not SnapshotOrigin.TAG:
                    self.snapshot_ids.append(e.snapshot.snapshot_id)
                    self.latest = e.snapshot
                    if e.origin is not SnapshotOrigin.CREATE:
                        self.latest_at = j
                if isinstance(e, ActorReverted):
                    self.latest_at, self.latest = j, e.snapshot


def mutants(events: Log, r: random.Random) -> list[tuple[str, Mutant]]:
    """Every mutation of `events` below that applies, each named, with where and how verify must report it."""
    out: list[tuple[str, Mutant]] = []
    placements = [i for i, e in enumerate(events) if isinstance(e, ActorPlaced)]
    for i in placements:
        out += around_placement(events, i, r)
    out += stamps_changed(events)
    out += floors_raised(events)
    out += releases_changed(events)
    return out


def releases_changed(events: Log) -> list[tuple[str, Mutant]]:
    """Each release naming another worker; a pause's or a suspend's without its snapshot, or written twice;
    a stop's recorded as a removal's while its worker was not removed; a removal's left out (the actor then
    placed again while it runs)."""
    out: list[tuple[str, Mutant]] = []
    for i, e in enumerate(events):
        if not isinstance(e, ActorReleased):
            continue
        other = msgspec.structs.replace(e, worker_id="w-elsewhere")
        out.append(("release naming another worker", ([*events[:i], other, *events[i + 1:]], i + 1,
                                                      frozenset({audit.RELEASE_ELSEWHERE}))))
        if e.reason in (ReleaseReason.PAUSED, ReleaseReason.SUSPENDED):
            # its snapshot left out (the actor's event right before it), or the release written twice
            j = max(j for j in range(i) if getattr(events[j], "actor_id", None) == e.actor_id)
            out.append((f"{e.reason.value} release without its snapshot", (
                [*events[:j], *events[j + 1:]], i, frozenset({audit.RELEASE_UNSNAPSHOTTED}))))
            out.append((f"{e.reason.value} release written twice", (
                [*events[:i + 1], e, *events[i + 1:]], i + 2, frozenset({audit.RELEASE_UNSNAPSHOTTED}))))
        if e.reason is ReleaseReason.STOPPED:
            placed_at = max(j for j in range(i) if isinstance(events[j], ActorPlaced)
                            and events[j].actor_id == e.actor_id)
            if not any(isinstance(f, WorkerRemoved) and f.worker_id == e.worker_id for f in events[placed_at:i]):
                removal = msgspec.structs.replace(e, reason=ReleaseReason.WORKER_REMOVED)
                out.append(("a stop's release recorded as a removal's", (
                    [*events[:i], removal, *events[i + 1:]], i + 1, frozenset({audit.RELEASE_ELSEWHERE}))))
        if e.reason is ReleaseReason.WORKER_REMOVED:
            following = next((j for j in range(i + 1, len(events))
                              if getattr(events[j], "actor_id", None) == e.actor_id), None)
            if following is not None and isinstance(events[following], ActorPlaced):
                out.append(("a removal's release left out", ([*events[:i], *events[i + 1:]], following,
                                                             frozenset({audit.PLACED_TWICE}))))
    return out


def around_placement(events: Log, i: int, r: random.Random) -> list[tuple[str, Mutant]]:
    at = Around(events, i)
    p = at.placed
    wid, aid, at_ = p.worker_id, p.actor_id, p.at
    before, after = events[:i], events[i + 1:]
    out: list[tuple[str, Mutant]] = []

    def insert(name: str, rules: set[str], *inserted, placement: ActorPlaced = p) -> None:
        log = [*before, *inserted, placement, *after]
        out.append((name, (log, len(before) + len(inserted) + 1, frozenset(rules))))

    def replace(name: str, rules: set[str], **fields) -> None:
        insert(name, rules, placement=msgspec.structs.replace(p, **fields))

    # the worker, after the decision: drained, removed (LOST or not), registered again or its runtimes
    # changed to another CPU's, its capacity cut, its labels dropped, moved to another node
    insert("worker drained", {audit.NOT_TAKING}, WorkerDrained(at=at_, worker_id=wid, reason="maintenance"))
    insert("worker lost", {audit.NOT_TAKING}, WorkerRemoved(at=at_, worker_id=wid, reason="LOST"))
    insert("worker removed", {audit.NOT_TAKING}, WorkerRemoved(at=at_, worker_id=wid, reason="decommissioned"))
    if at.registration is not None:
        insert("worker registered again on another CPU", {audit.RUNTIME_GONE},
               WorkerRemoved(at=at_, worker_id=wid, reason="LOST"),
               msgspec.structs.replace(at.registration, node=at.node, capacity=at.capacity, labels=at.labels,
                                       sandbox_classes=on_other_cpu(at.classes)))
        insert("worker's runtimes changed to another CPU's", {audit.RUNTIME_GONE},
               RuntimeChanged(at=at_, worker_id=wid, sandbox_classes=on_other_cpu(at.classes), previous=at.classes))
        insert("worker's capacity cut", {audit.PAST_ROOM},
               WorkerUpdated(at=at_, worker_id=wid, node=at.node, capacity=Resources(cpu_millis=1, memory_mib=65),
                             labels=at.labels))
        # registered again on a machine of the other architecture, the placement pinned to its new default:
        # a restore without memory (a fallback, or of a snapshot without usable memory) of a stamp that names
        # an architecture crosses architectures (rule 4); at MEMORY, its pin is no runtime of the worker's now
        stamp = at.latest.sandbox_runtime if at.latest is not None else None
        if stamp is not None and fo.arch(stamp.version) is not None and (
                p.fallback is not None or p.action is Action.RESTORE):
            flipped = tuple(other_arch_entry(e) for e in at.classes)
            cls = p.sandbox_runtime.sandbox_class
            default = next(e.default_runtime.version for e in flipped if e.sandbox_class == cls)
            memory = p.fidelity is PlacedFidelity.MEMORY
            insert("worker registered again on the other architecture",
                   {audit.RUNTIME_GONE if memory else audit.ACROSS_ARCHITECTURES},
                   WorkerRemoved(at=at_, worker_id=wid, reason="LOST"),
                   msgspec.structs.replace(at.registration, node=at.node, capacity=at.capacity, labels=at.labels,
                                           sandbox_classes=flipped),
                   placement=p if memory else msgspec.structs.replace(
                       p, sandbox_runtime=ActorRuntime(sandbox_class=cls, version=default)))
        insert("worker moved to another node", {audit.NODE_MISMATCH},
               WorkerUpdated(at=at_, worker_id=wid, node="elsewhere", capacity=at.capacity, labels=at.labels))
        if at.created is not None and at.created.selectors:
            insert("worker's labels dropped", {audit.SELECTOR_UNMET},
                   WorkerUpdated(at=at_, worker_id=wid, node=at.node, capacity=at.capacity, labels={}))
        # the placement before the registration that began the worker's life
        log = [*events[:at.registered_at], p, *events[at.registered_at:i], *after]
        out.append(("placed before its worker's registration", (log, at.registered_at + 1, frozenset(
            {audit.NOT_TAKING, audit.UNKNOWN_ACTOR, audit.PLACED_TWICE, audit.PLACED_STOPPED}))))
    # the actor, after the decision: its template changed (a memory restore), stopped
    if p.fidelity is PlacedFidelity.MEMORY:
        insert("template changed under a memory restore", {audit.NOT_IN_SNAPSHOT},
               TemplateChanged(at=at_, actor_id=aid, template_uid="t-new"))
        replace("another matched version", {audit.MATCHED_OTHER}, matched_version=other_cpu(
            p.matched_version or p.sandbox_runtime.version))
    insert("actor stopped", {audit.PLACED_STOPPED}, ActorStopped(at=at_, actor_id=aid))
    # the request id of the actor's previous placement (of this life or the last), placed again
    lives = 0
    for e in reversed(before):
        if getattr(e, "actor_id", None) != aid:
            continue
        lives += isinstance(e, ActorCreated)
        if lives > 1:
            break
        if isinstance(e, ActorPlaced) and e.request_id is not None:
            replace("a request id placed again", {audit.REQUEST_AGAIN}, request_id=e.request_id)
            break
    # the placement itself: twice, booking less or past the room, restoring more than the image holds,
    # less than the rules give, or another snapshot than the latest
    twice = [*before, p, *after[:1], p, *after[1:]]
    out.append(("placed twice", (twice, i + 3, frozenset({audit.PLACED_TWICE}))))
    replace("books less cpu", {audit.UNDER_BOOKED}, booked=Resources(cpu_millis=p.booked.cpu_millis - 1,
                                                                     memory_mib=p.booked.memory_mib))
    replace("books less memory", {audit.UNDER_BOOKED}, booked=Resources(cpu_millis=p.booked.cpu_millis,
                                                                        memory_mib=p.booked.memory_mib - 1))
    replace("books past the room", {audit.PAST_ROOM}, booked=Resources(cpu_millis=p.booked.cpu_millis,
                                                                       memory_mib=p.booked.memory_mib + 10 ** 6))
    if p.action is Action.RESTORE:
        if p.fidelity is PlacedFidelity.ROOTFS:
            replace("ROOTFS claimed VOLUMES", {audit.NOT_IN_SNAPSHOT}, fidelity=PlacedFidelity.VOLUMES)
        if p.fidelity is PlacedFidelity.VOLUMES:
            replace("VOLUMES given up for ROOTFS", {audit.OFF_PLAN, audit.BELOW_FLOOR}, fidelity=PlacedFidelity.ROOTFS,
                    fallback=None)
            if p.fallback is None or p.fallback.reason is not FallbackReason.NO_COMPATIBLE_WORKER:
                replace("VOLUMES claimed MEMORY", {audit.NOT_IN_SNAPSHOT, audit.RUNTIME_GONE},
                        fidelity=PlacedFidelity.MEMORY, fallback=None, matched_version=p.sandbox_runtime.version)
        older = [s for s in at.snapshot_ids if s != p.snapshot_id]
        if older:
            replace("restores an older snapshot", {audit.NOT_IN_SNAPSHOT}, snapshot_id=r.choice(older))
        if at.latest_at >= 0 and not (isinstance(events[at.latest_at], SnapshotTaken)
                                      and events[at.latest_at].origin is SnapshotOrigin.PROMOTE):
            # before the snapshot it restores was taken (a promote keeps the id of the image it uploads):
            # the actor then ran, or had another snapshot or none; and its worker may not have been there yet
            j = at.latest_at
            log = [*events[:j], p, *events[j:i], *after]
            out.append(("placed before the snapshot it restores", (log, j + 1, frozenset(audit.PLACEMENT_RULES))))
    return out


def restamped(snapshot: Snapshot) -> Snapshot:
    st = snapshot.sandbox_runtime
    runtime = ActorRuntime(sandbox_class=st.sandbox_class if st else "gvisor",
                           version=other_cpu(st.version) if st else fo.v(architecture="amd64", gvisor_asset_hash="1"))
    return msgspec.structs.replace(snapshot, sandbox_runtime=runtime)


STAMP_RULE = {SnapshotOrigin.PAUSE: audit.STAMP_NOT_PIN, SnapshotOrigin.SUSPEND: audit.STAMP_NOT_PIN,
              SnapshotOrigin.PROMOTE: audit.NOT_COPIED, SnapshotOrigin.TAG: audit.NOT_COPIED,
              SnapshotOrigin.CREATE: audit.NO_SOURCE}


def stamps_changed(events: Log) -> list[tuple[str, Mutant]]:
    """Each stamp a pause, suspend, promote, tag or creation records, or a revert goes back to, changed
    (another CPU): the stamp should have been the pin, or the one copied."""
    out: list[tuple[str, Mutant]] = []
    for i, e in enumerate(events):
        mutated, rule = None, None
        if isinstance(e, SnapshotTaken) and not (e.origin is SnapshotOrigin.CREATE and e.snapshot.borrowed):
            mutated, rule = msgspec.structs.replace(e, snapshot=restamped(e.snapshot)), STAMP_RULE[e.origin]
        elif isinstance(e, TagRecorded):
            mutated, rule = msgspec.structs.replace(e, snapshot=restamped(e.snapshot)), audit.NOT_COPIED
        elif isinstance(e, ActorCreated) and e.snapshot is not None and not e.snapshot.borrowed:
            mutated, rule = msgspec.structs.replace(e, snapshot=restamped(e.snapshot)), audit.NO_SOURCE
        elif isinstance(e, ActorReverted) and e.snapshot is not None:
            mutated, rule = msgspec.structs.replace(e, snapshot=restamped(e.snapshot)), audit.REVERT_ELSEWHERE
        if mutated is not None:
            name = f"{type(e).__name__}{' ' + e.origin.value if isinstance(e, SnapshotTaken) else ''} restamped"
            out.append((name, ([*events[:i], mutated, *events[i + 1:]], i + 1, frozenset({rule}))))
        if isinstance(e, SnapshotTaken) and e.origin in (SnapshotOrigin.PAUSE, SnapshotOrigin.SUSPEND):
            other = msgspec.structs.replace(e, snapshot=msgspec.structs.replace(e.snapshot, template_uid="t-other"))
            out.append((f"{e.origin.value} of another template than the actor ran",
                        ([*events[:i], other, *events[i + 1:]], i + 1, frozenset({audit.NOT_RUN_TEMPLATE}))))
        if isinstance(e, SnapshotTaken) and e.origin in (SnapshotOrigin.PAUSE, SnapshotOrigin.SUSPEND,
                                                         SnapshotOrigin.PROMOTE):
            flipped = msgspec.structs.replace(e, snapshot=msgspec.structs.replace(
                e.snapshot, borrowed=not e.snapshot.borrowed))
            rule = audit.NOT_COPIED if e.origin is SnapshotOrigin.PROMOTE else audit.NOT_AS_TAKEN
            if not (e.origin is SnapshotOrigin.PROMOTE and e.snapshot.borrowed):
                out.append((f"{e.origin.value} recorded {'not ' if e.snapshot.borrowed else ''}borrowed",
                            ([*events[:i], flipped, *events[i + 1:]], i + 1, frozenset({rule}))))
        if isinstance(e, SnapshotTaken) and e.origin is SnapshotOrigin.PAUSE:
            less = msgspec.structs.replace(e, snapshot=msgspec.structs.replace(e.snapshot, fidelity=Fidelity.VOLUMES))
            out.append(("PAUSE recorded at VOLUMES", ([*events[:i], less, *events[i + 1:]], i + 1,
                                                      frozenset({audit.NOT_AS_TAKEN}))))
    return out


def floors_raised(events: Log) -> list[tuple[str, Mutant]]:
    """Each creation's min_fidelity raised to MEMORY: its life's first placement without memory is below it."""
    out: list[tuple[str, Mutant]] = []
    for i, e in enumerate(events):
        if not isinstance(e, ActorCreated) or e.min_fidelity is Fidelity.MEMORY:
            continue
        below = None
        for j in range(i + 1, len(events)):
            f = events[j]
            if getattr(f, "actor_id", None) != e.actor_id:
                continue
            if isinstance(f, ActorCreated):
                break
            if isinstance(f, ActorPlaced) and f.fidelity is not PlacedFidelity.MEMORY:
                below = j
                break
        if below is not None:
            raised = msgspec.structs.replace(e, min_fidelity=Fidelity.MEMORY)
            out.append(("min_fidelity raised", ([*events[:i], raised, *events[i + 1:]], below + 1,
                                                frozenset({audit.BELOW_FLOOR}))))
    return out


def test_a_log_changed_around_a_placement_or_a_stamp_is_flagged_where_and_as_it_breaks():
    r = random.Random(20261207)
    wrong: list[str] = []
    reached: Counter = Counter()
    for seed in SEEDS[:16]:
        events = life(seed).events
        for name, (log, seq, rules) in mutants(events, r):
            found = fold(log, Sink(verify=True)).violation
            reached[name] += 1
            if found is None or found.seq != seq or found.rule not in rules:
                wrong.append(f"seed {seed}, {name}: expected at {seq} one of {sorted(rules)}, found {found}")
    assert not wrong, f"{len(wrong)} missed:\n" + "\n".join(wrong[:15])
    for name in ("worker drained", "worker lost", "worker registered again on another CPU",
                 "worker's runtimes changed to another CPU's", "worker's capacity cut", "worker moved to another node",
                 "worker's labels dropped", "placed before its worker's registration",
                 "worker registered again on the other architecture",
                 "template changed under a memory restore", "another matched version", "actor stopped",
                 "placed twice", "a request id placed again", "books less memory", "books past the room",
                 "ROOTFS claimed VOLUMES",
                 "VOLUMES given up for ROOTFS", "VOLUMES claimed MEMORY", "restores an older snapshot",
                 "placed before the snapshot it restores", "min_fidelity raised", "SnapshotTaken PAUSE restamped",
                 "SnapshotTaken SUSPEND restamped", "SnapshotTaken PROMOTE restamped", "SnapshotTaken TAG restamped",
                 "TagRecorded restamped", "ActorCreated restamped", "ActorReverted restamped",
                 "PAUSE of another template than the actor ran", "SUSPEND of another template than the actor ran",
                 "PAUSE recorded borrowed", "PAUSE recorded not borrowed", "SUSPEND recorded borrowed",
                 "PROMOTE recorded borrowed", "PAUSE recorded at VOLUMES", "release naming another worker",
                 "PAUSED release without its snapshot", "SUSPENDED release without its snapshot",
                 "PAUSED release written twice", "SUSPENDED release written twice",
                 "a stop's release recorded as a removal's", "a removal's release left out"):
        assert reached[name] >= 3, (name, reached)


def test_lives_with_node_tokens_are_clean_and_a_restore_not_naming_its_disk_is_flagged():
    """The fleet oracle's lives with node tokens (machines replaced, agents before tokens, workers registered
    without one on a replaced node): verify finds every placement the scheduler decided clean, the node token
    each names included, and each restore of a LOCAL image with its token dropped or another disk's is flagged
    where it is, as NODE_TOKEN_MISSTATED (`decide.placement` names the worker's: what its agent checks)."""
    tokened = 0
    for seed in range(25):
        f = CleanLife(seed, workers=6, actors=5, tokens=True).run(200)
        assert not f.failures, f.failures[:3]
        assert f.sink.violation is None, f"seed {seed}: {f.sink.violation}"
        for i, event in enumerate(f.events):
            if not isinstance(event, ActorPlaced) or event.node_token is None:
                continue
            tokened += 1
            for token in (None, f"{event.node_token}-other"):
                found = fold([*f.events[:i], msgspec.structs.replace(event, node_token=token)],
                             Sink(verify=True)).violation
                assert found is not None and (found.seq, found.rule) == (i + 1, audit.NODE_TOKEN_MISSTATED), (
                    seed, i, found)
    assert tokened >= 30, tokened
