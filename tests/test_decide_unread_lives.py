"""The scheduler's decision along lives of workers whose histories hold messages the fold cannot read
(a newer registry's event, a body this version refuses), which tests/test_decide_oracle.py does not
make: such a worker takes no placement until a registration starts its next life, and that next life
is folded on the very record the last one used (`Projection._worker_registered` on a worker it still
has). Every decision is checked against the registry's events alone (no ClassEntry, no index): a MEMORY
restore only on a registered, undrained worker with no unread message in its life whose runtimes (its
default, a restorable, or an edge of either) accept the stamp; every candidate a decision can take is
the projection's record of its worker (a record left in an index after its life ended would be placed
on, and the commit's booking expectation, looked up by worker id, would let it through); and the
booking expectation is the booking subject's last message. A projection restored from a checkpoint
part way decides the same. (Written by a review hunting a resume sent where its image cannot load.)"""

from __future__ import annotations

import os
import random

from events.compat import compat_key
from events.errors import ContractError
from events.schema import (ActorReleased, PlacedFidelity, ReleaseReason, Resources,
                           RuntimeChanged, SnapshotOrigin, WorkerDrained, WorkerRemoved, WorkerSandboxClass,
                           WorkerUpdated)
from services.registry.domain import canonical_classes
from services.scheduler.checkpoint_codec import export_state, restore_state
from services.scheduler.committer import placed_event
from services.scheduler.decide import decide
from services.scheduler.projection import Projection
from tests.factories import AT, CLASS, created, registered, runtime, snapshot, taken, version

VERSIONS = [version(b) for b in "1234"]
WORKERS = ["w0", "w1", "w2"]
ACTORS = ["a0", "a1", "a2"]
NODES = ["n-a", "n-b"]


def key(v):
    return compat_key(CLASS, v)


def classes(rng: random.Random) -> tuple[WorkerSandboxClass, ...]:
    d = rng.choice(VERSIONS)
    rest = [v for v in VERSIONS if v is not d]
    restorable = rng.sample(rest, rng.randint(0, 2))

    def rt(v):
        return runtime(v, compatible=tuple(rng.sample([x for x in VERSIONS if x is not v], rng.randint(0, 1))))
    return canonical_classes((WorkerSandboxClass(sandbox_class=CLASS, default_runtime=rt(d),
                                                 restorable_runtimes=tuple(rt(r) for r in restorable)),))


def accepts(cls: tuple[WorkerSandboxClass, ...], stamp_key, pin_key) -> bool:
    """Whether the runtime pinned (`pin_key`) is one of the registration's and accepts `stamp_key`."""
    ent = cls[0]
    for r in (ent.default_runtime, *ent.restorable_runtimes):
        if key(r.version) == pin_key:
            return stamp_key == pin_key or any(key(e) == stamp_key for e in r.compatible_versions)
    return False


class Script:
    """A log as the services write it, folded into a projection as it goes, with the registry's view
    kept from the events alone."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.p = Projection()
        self.seq = 0
        self.booking_last: dict[str, tuple[int, int]] = {}  # worker id -> (version, seq) of booking.<id>
        self.workers: dict[str, dict] = {}  # worker id -> the registry's view: classes, node, drained, unread
        self.seen: dict[str, int] = {}  # what the script made happen, to show the test reaches it

    def count(self, what: str) -> None:
        self.seen[what] = self.seen.get(what, 0) + 1

    def next(self) -> int:
        self.seq += 1
        return self.seq

    def fence(self, wid: str) -> None:
        version = self.booking_last.get(wid, (0, 0))[0] + 1
        seq = self.next()
        self.booking_last[wid] = (version, seq)
        self.p.booking_marker(seq, wid, version)

    def worker_event(self, wid: str, event) -> None:
        self.p.apply(self.next(), event)
        self.fence(wid)

    def unread(self, wid: str) -> None:
        """A message of the worker's history this fold cannot read, and the registry's fence after it."""
        self.p.worker_unread(self.next(), wid)
        self.fence(wid)

    def step(self) -> None:
        rng = self.rng
        wid = rng.choice(WORKERS)
        w = self.workers.get(wid)
        kind = rng.choice(["reg", "reg", "change", "move", "drain", "remove", "unread", "unread",
                           "unread-remove", "resume", "resume", "resume", "resume"])
        if kind == "reg" and w is None:
            if self.p.workers.get(wid) is not None:
                self.count("registered on the record of a life ended unread")
            cls, node = classes(rng), rng.choice(NODES)
            self.worker_event(wid, registered(wid, *cls, node=node))
            self.workers[wid] = {"classes": cls, "node": node, "drained": False, "unread": False}
        elif kind == "change" and w is not None:
            cls = classes(rng)
            self.worker_event(wid, RuntimeChanged(at=AT, worker_id=wid, sandbox_classes=cls, previous=w["classes"]))
            w["classes"] = cls
        elif kind == "move" and w is not None:
            node = rng.choice(NODES)
            self.worker_event(wid, WorkerUpdated(at=AT, worker_id=wid, node=node,
                                                 capacity=Resources(cpu_millis=4000, memory_mib=4096), labels={}))
            w["node"] = node
        elif kind == "drain" and w is not None:
            self.worker_event(wid, WorkerDrained(at=AT, worker_id=wid))
            w["drained"] = True
        elif kind == "remove" and w is not None:
            self.worker_event(wid, WorkerRemoved(at=AT, worker_id=wid))
            del self.workers[wid]
        elif kind == "unread" and w is not None:  # it may have changed anything: what it runs, where, its state
            self.unread(wid)
            w["unread"] = True
        elif kind == "unread-remove" and w is not None:
            # a removal whose body this version refuses: the life ends unread, and the next registration
            # is folded on the same record
            self.unread(wid)
            del self.workers[wid]
        elif kind == "resume":
            self.resume(rng.choice(ACTORS))

    def create(self, aid: str) -> None:
        stamp = self.rng.choice(VERSIONS)
        snap = snapshot(aid, stamp, snapshot_id=f"{aid}-{self.seq}")
        self.p.apply(self.next(), created(aid, snapshot=snap))
        self.p.apply(self.next(), taken(snap, SnapshotOrigin.CREATE))

    def resume(self, aid: str) -> None:
        p = self.p
        actor = p.actors.get(aid)
        if actor is None:
            return self.create(aid)
        try:
            placement = decide(p, aid, None, p.seq)
        except ContractError:
            return
        wid = placement.worker_id
        self.count("placed")
        if placement.fidelity is PlacedFidelity.MEMORY:
            self.count("memory")
        if 0 < self.p.unread_workers.get(wid, 0) < self.p.workers[wid].since:
            self.count("placed on a life after an unread message")
        record = p.workers.get(wid)
        assert record is not None and any(record is c for c in self.candidates()), (
            f"{aid} placed on a record of {wid} that is not the projection's: {placement}")
        w = self.workers.get(wid)
        assert w is not None, f"{aid} placed on {wid}, which the log has removed: {placement}"
        assert not w["drained"] and not w["unread"], f"{aid} placed on {wid} ({w}): {placement}"
        assert placement.node == w["node"], f"{aid} placed on {wid} on {placement.node}, it is on {w['node']}"
        if placement.fidelity is PlacedFidelity.MEMORY:
            stamp = actor.snapshot.stamp.runtime
            assert accepts(w["classes"], key(stamp.version), key(placement.sandbox_runtime.version)), (
                f"{aid}'s image {key(stamp.version)} placed on {wid}, whose runtimes are {w['classes']}: {placement}")
        assert p.booking_expectation(wid) == self.booking_last[wid], (wid, p.booking_expectation(wid),
                                                                      self.booking_last[wid])
        # committed as the committer writes it, then suspended at once: the next image is stamped with the pin
        version = p.actor_expectation(aid)[0]
        p.apply(self.next(), placed_event(placement, None), version + 1)
        b = self.booking_last[wid][0] + 1
        self.booking_last[wid] = (b, self.next())
        p.booking_marker(self.seq, wid, b)
        snap = snapshot(aid, placement.sandbox_runtime, snapshot_id=f"{aid}-{self.seq}")
        p.apply(self.next(), taken(snap, SnapshotOrigin.SUSPEND))
        p.apply(self.next(), ActorReleased(at=AT, actor_id=aid, worker_id=wid, reason=ReleaseReason.SUSPENDED))

    def candidates(self):
        for index in self.p.classes.values():
            yield from index.workers
            for table in index.members:
                for members in table.values():
                    yield from members
            for members in (*index.by_node.values(), *index.by_arch.values()):
                yield from members

    def check_indices(self) -> None:
        """Every worker any index holds is the projection's record of its id, and is indexed by what its
        registration says now."""
        p = self.p
        for worker in self.candidates():
            assert p.workers.get(worker.worker_id) is worker, f"index holds a stale record of {worker.worker_id}"
        for wid, worker in p.workers.items():
            w = self.workers.get(wid)
            if w is None or w["unread"]:
                continue
            for role_table in p.classes[CLASS].members:
                for compat, members in role_table.items():
                    if worker in members:
                        assert any(accepts(w["classes"], compat.key, key(r.version))
                                   for ent in w["classes"] for r in (ent.default_runtime, *ent.restorable_runtimes)), (
                            f"{wid} indexed as accepting {compat} it no longer does")


def test_workers_with_unread_messages_and_their_next_lives_never_take_an_image_they_cannot_load():
    seen: dict[str, int] = {}
    for seed in range(int(os.environ.get("UNREAD_LIVES", "400"))):
        rng = random.Random(seed)
        script = Script(rng)
        for _ in range(rng.randint(20, 80)):
            script.step()
            script.check_indices()
            if rng.random() < 0.05:  # a replica restored from a checkpoint taken here decides the same
                script.p = restore_state(export_state(script.p))
                script.check_indices()
        for what, n in script.seen.items():
            seen[what] = seen.get(what, 0) + n
    print(seen)
    for what in ("placed", "memory", "registered on the record of a life ended unread",
                 "placed on a life after an unread message"):
        assert seen.get(what, 0) > 10, (what, seen)
