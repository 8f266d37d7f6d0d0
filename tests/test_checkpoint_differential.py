"""A scheduler replica that starts from a checkpoint decides as one that folded the whole log: a
projection restored from a checkpoint (its bytes round trip) taken at any position k of a generated
log, then folded over the tail through `Fold.fold_message` (booking markers from their subjects,
unread messages as the fold meets them), equals the full fold, record for record (`walk`) and answer
for answer (decisions, explanations, fragmentation, expectations, whatif, lives, request ids, the
judgement of a retry), for many k and seeds. The log holds what a checkpoint may fall in the middle
of: atomic batches (a placement and its booking marker, a registry event and its fence), messages
this version cannot read, edges, spellings of one machine, LOCAL images, reverts, stops and new
lives. (Written by an audit of the restart path, 2026-12-04: no difference found.)"""

from __future__ import annotations

import random

import pytest

from events.jetstream import TOPIC_HEADER, VERSION_HEADER
from events.schema import (
    Action,
    ActorReverted,
    ActorStopped,
    CompatVersion,
    Fidelity,
    Location,
    PlacedFidelity,
    Placement,
    ReleaseReason,
    Resources,
    RuntimeChanged,
    SnapshotOrigin,
    TemplateChanged,
    WhatIf,
    WorkerDrained,
    WorkerFenced,
    WorkerRemoved,
    WorkerUpdated,
)
from events.errors import ContractError
from services.scheduler.checkpoint_codec import decode_checkpoint, encode_checkpoint, export_state
from services.scheduler.decide import check_retry
from services.scheduler.fold import Fold
from services.scheduler.projection import Projection
from services.scheduler.records import request_hash
from services.scheduler.whatif import whatif
from tests.factories import (
    AT,
    CLASS,
    booked,
    created,
    entry,
    placed,
    registered,
    released,
    runtime,
    snapshot,
    stored_message,
    taken,
    version,
)
from tests.test_checkpoint import answers, walk

PREFIX = "t"
V1, V2, V3 = version("1"), version("2"), version("3")
VX = version("1", "x86_64")  # same machine, another spelling: another key
# V1 with its attributes in another order (a log written before v1.1 sorted them)
V1R = CompatVersion(schema_version="v1", attributes=tuple(reversed(V1.attributes)))
VARM = version("9", "arm64")
VERSIONS = [V1, V2, V3, VX, V1R, VARM]
WORKERS = [f"w{i}" for i in range(6)]
ACTORS = [f"a{i}" for i in range(8)]
NODES = ["n0", "n1", "n2"]


def gen(rng: random.Random, n: int) -> list[tuple[str, dict, bytes]]:
    """Messages as the stream holds them: (subject, headers, body). Placements come with their
    booking markers, registry events with their fences, right after them (atomic batches)."""
    versions: dict[str, int] = {}
    out: list[tuple[str, dict, bytes]] = []

    def put(event) -> None:
        out.append(stored_message(PREFIX, event, versions))

    def rt():
        v = rng.choice(VERSIONS)
        edges = tuple(e for e in rng.sample(VERSIONS, rng.randint(0, 2)) if e != v)
        return runtime(v, overhead=rng.choice([0, 32, None]), compatible=edges, per_gib=rng.choice([0, 4]))

    def fence(worker_id: str, what: str) -> None:
        put(WorkerFenced(at=AT, worker_id=worker_id, event=what))

    while len(out) < n:
        r = rng.random()
        w, a, node = rng.choice(WORKERS), rng.choice(ACTORS), rng.choice(NODES)
        if r < 0.12:
            restorable = tuple({rng.choice(VERSIONS) for _ in range(rng.randint(0, 2))})
            put(registered(w, entry(rt(), tuple(runtime(x) for x in restorable)), node=node,
                           cpu=rng.choice([2000, 8000]), mem=rng.choice([2048, 8192]),
                           labels=rng.choice([{}, {"zone": "a"}, {"zone": "b"}])))
            fence(w, "WorkerRegistered")
        elif r < 0.17:
            put(RuntimeChanged(at=AT, worker_id=w, sandbox_classes=(entry(rt()),), previous=()))
            fence(w, "RuntimeChanged")
        elif r < 0.21:
            put(WorkerUpdated(at=AT, worker_id=w, node=node, capacity=Resources(cpu_millis=4000, memory_mib=4096),
                              labels=rng.choice([{}, {"zone": "a"}])))
            fence(w, "WorkerUpdated")
        elif r < 0.24:
            put(WorkerDrained(at=AT, worker_id=w, reason="x"))
            fence(w, "WorkerDrained")
        elif r < 0.28:
            put(WorkerRemoved(at=AT, worker_id=w, reason="LOST"))
            fence(w, "WorkerRemoved")
        elif r < 0.30:  # a worker message this fold cannot read, with its fence
            out.append((f"{PREFIX}.ev.worker.{w}", {TOPIC_HEADER: "WorkerRetired", VERSION_HEADER: "999"},
                        b'{"type":"WorkerRetired"}'))
            fence(w, "WorkerRetired")
        elif r < 0.40:
            put(created(a, mem=rng.choice([256, 1024, 3000]), min_fidelity=rng.choice(list(Fidelity)),
                        selectors=rng.choice([{}, {"zone": "a"}]),
                        snapshot=rng.choice([None, snapshot(a, rng.choice(VERSIONS), borrowed=True,
                                                            snapshot_id=f"g{rng.randint(0, 3)}")])))
        elif r < 0.55:
            v = rng.choice(VERSIONS)
            mem = rng.choice([256, 1024])
            put(placed(a, w, v, node=node, cpu=rng.choice([100, 500]), mem=mem,
                       request_id=rng.choice([None, f"r{rng.randint(0, 9)}"]),
                       action=Action.RESTORE, fidelity=rng.choice(list(PlacedFidelity))))
            put(booked(w, a))
        elif r < 0.57:  # a placement this fold cannot read, and its marker
            out.append((f"{PREFIX}.ev.actor.{a}", {TOPIC_HEADER: "ActorPlacedV2", VERSION_HEADER: "999"},
                        b'{"type":"ActorPlacedV2"}'))
            put(booked(w, a))
        elif r < 0.72:
            origin = rng.choice([SnapshotOrigin.PAUSE, SnapshotOrigin.SUSPEND, SnapshotOrigin.PROMOTE,
                                 SnapshotOrigin.TAG])
            local = origin is SnapshotOrigin.PAUSE or rng.random() < 0.2
            snapshot_id = rng.choice([f"{a}-v{rng.randint(1, 3)}", "x"])
            put(taken(snapshot(a, rng.choice(VERSIONS + [None]), snapshot_id=snapshot_id,
                               fidelity=rng.choice(list(Fidelity)),
                               location=Location.LOCAL if local else Location.EXTERNAL,
                               node=rng.choice([node, None]) if local else None,
                               template=rng.choice(["t1", "t2"])), origin))
        elif r < 0.82:
            put(released(a, w, rng.choice(list(ReleaseReason))))
        elif r < 0.86:
            put(TemplateChanged(at=AT, actor_id=a, template_uid=rng.choice(["t1", "t2"])))
        elif r < 0.90:
            put(ActorReverted(at=AT, actor_id=a,
                              snapshot=rng.choice([None, snapshot(a, rng.choice(VERSIONS), snapshot_id=f"{a}-e")]),
                              abandoned=snapshot(a, V1, node=node)))
        elif r < 0.92:
            put(ActorStopped(at=AT, actor_id=a))
        else:  # an actor message this fold cannot read
            out.append((f"{PREFIX}.ev.actor.{a}", {TOPIC_HEADER: "ActorThing", VERSION_HEADER: "999"},
                        b'{"type":"ActorThing"}'))
    return out


def folded(messages, upto: int, into: Projection | None = None, start: int = 0) -> Projection:
    f = Fold(None, PREFIX, into if into is not None else Projection())
    for seq in range(start + 1, upto + 1):
        subject, headers, data = messages[seq - 1]
        f.fold_message(seq, subject, headers, data)
    return f.projection


def more_answers(p: Projection) -> dict:
    out = {}
    for drop in ([], [V1], [V2, VX], [V1R]):
        for drain in ([], [w for w in WORKERS if w in p.workers and CLASS in p.workers[w].classes][:1]):
            try:
                out[(len(drop), tuple(drain), tuple(map(str, drop)))] = whatif(
                    p, WhatIf(sandbox_class=CLASS, drop_runtimes=tuple(drop), drain_workers=tuple(drain)))
            except ContractError as e:
                out[(len(drop), tuple(drain), tuple(map(str, drop)))] = (e.code, e.message)
    for w in WORKERS:
        out[("life", w)] = (p.life_ended(w, 5), p.life_unread(w), p.life_unread(w, 5))
    for a in ACTORS:
        out[("seq", a)] = (p.actor_seq(a), p.life_started(a), p.answerable(a, 5))
        actor = p.actors.get(a)
        if actor is not None:
            for r in range(10):
                out[("placed", a, r)] = (actor.placed_by(request_hash(f"r{r}")),
                                         actor.may_have_pushed_out(request_hash(f"r{r}")))
    # retries of a placement made earlier, judged on each projection
    for w in WORKERS:
        for v in (V1, V2, VX):
            pl = Placement(actor_id="a0", worker_id=w, node="n0", action=Action.RESTORE,
                           fidelity=PlacedFidelity.MEMORY, sandbox_runtime=placed("a0", w, v).sandbox_runtime,
                           snapshot_id="a0-v1", fallback=None, booked=Resources(cpu_millis=1, memory_mib=1),
                           matched_version=v)
            try:
                check_retry(p, pl, 3, "r1")
                out[("retry", w, str(v))] = None
            except ContractError as e:
                out[("retry", w, str(v))] = (e.code, e.message)
    return out


def roundtrip(p: Projection) -> Projection:
    p.stream_created = "c"
    return decode_checkpoint(encode_checkpoint(export_state(p), stream="S", stream_created="c"))[1]


@pytest.mark.parametrize("seed_", range(12))
def test_restored_at_any_k_then_tail_equals_full_fold(seed_):
    rng = random.Random(seed_)
    messages = gen(rng, 160)
    full = folded(messages, len(messages))
    full.stream_created = "c"
    expected_walk, expected_answers, expected_more = walk(full), answers(full), more_answers(full)
    for k in range(0, len(messages) + 1, 3):
        restored = roundtrip(folded(messages, k))
        p = folded(messages, len(messages), into=restored, start=k)
        assert walk(p) == expected_walk, (seed_, k)
        assert answers(p) == expected_answers, (seed_, k)
        assert more_answers(p) == expected_more, (seed_, k)
