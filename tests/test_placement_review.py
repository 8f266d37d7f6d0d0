"""An adversarial review of placement (CONTRACT v1.1: no resume is ever sent where its image
cannot load): what `audit verify` must name, a worker event the scheduler cannot read, and
random lifecycles through the real aggregates whose every decision the audit judges.

Each hole found is here as it was reproduced; the property test at the end is what the
review checked and found holding (rules 1 to 6 and the edges, on the pure fold).
"""

from __future__ import annotations

import asyncio
import random
import re

import msgspec
import pytest

from events.codec import encode
from events.errors import ContractError
from events.jetstream import TOPIC_HEADER, VERSION_HEADER
from events.schema import (
    Action,
    ActorEvent,
    ActorStopped,
    CreateActor,
    ErrorCode,
    Fallback,
    FallbackReason,
    Fidelity,
    PlacedFidelity,
    RegisterWorker,
    ReleaseReason,
    Resources,
    SnapshotOrigin,
    TemplateChanged,
    WorkerBooked,
    WorkerFenced,
)
from services.registry.domain import Worker as RegistryWorker
from services.scheduler.checkpoint_codec import export_state, restore_state
from services.scheduler.committer import placed_event
from services.scheduler.decide import decide
from services.scheduler.fold import Fold
from services.scheduler.projection import Projection
from services.snapshotter.domain import Actor as SnapshotterActor
from tests.factories import (
    AT,
    NewerWorkerEvent,
    created,
    entry,
    fold,
    golden,
    last_seq,
    placed,
    registered,
    released,
    runtime,
    snapshot,
    taken,
    version,
)
from tests.factories import actor as new_actor
from tests.factories import worker as registration
from tests.test_checkpoint import walk
from warmboot import audit
from warmboot.audit import Sink
from warmboot.cli_common import replay
from warmboot.client import Client

V1, V2 = version("v1"), version("v2")
SMALL = {"cpu": 100, "mem": 512}


def verify(events) -> audit.Violation | None:
    return fold(events, Sink(verify=True)).violation


def on(worker_id: str, v, node: str = "n1"):
    return registered(worker_id, entry(v), node=node)


def memory(actor_id: str, worker_id: str, node: str, **fields):
    return placed(actor_id, worker_id, V1, node=node, action=Action.RESTORE, fidelity=PlacedFidelity.MEMORY,
                  **{"snapshot_id": f"{actor_id}-s", **SMALL, **fields})


# Each: the log before, the placement the rules forbid, the rule `audit verify` must name.
PAUSED_ON_N1 = [on("w1", V1), on("w2", V1, node="n2"), created("a", **SMALL), placed("a", "w1", V1, node="n1", **SMALL),
                taken(snapshot("a", V1, node="n1"), SnapshotOrigin.PAUSE), released("a", "w1", ReleaseReason.PAUSED)]


def suspended(fidelity: Fidelity = Fidelity.MEMORY, **created_fields):
    return [on("w1", V1), created("a", **{**SMALL, **created_fields}), placed("a", "w1", V1, node="n1", **SMALL),
            taken(snapshot("a", V1, uri="s3://a", fidelity=fidelity)), released("a", "w1")]


CASES = {
    # the LOCAL image's node judged by what the event says, not where its worker is
    "a LOCAL image sent to another node under its own node's name": (
        PAUSED_ON_N1, memory("a", "w2", "n1"), audit.NODE_MISMATCH),
    "memory restored from a VOLUMES snapshot": (
        suspended(Fidelity.VOLUMES), memory("a", "w1", "n1"), audit.NOT_IN_SNAPSHOT),
    "memory of the old template restored under the new one": (
        [*suspended(), TemplateChanged(at=AT, actor_id="a", template_uid="t2")], memory("a", "w1", "n1"),
        audit.NOT_IN_SNAPSHOT),
    "a restore of another snapshot than the latest": (
        suspended(), memory("a", "w1", "n1", snapshot_id="someone-elses"), audit.NOT_IN_SNAPSHOT),
    "a cold boot of an actor whose floor is MEMORY": (
        [on("w1", V1), created("a", min_fidelity=Fidelity.MEMORY, **SMALL)],
        placed("a", "w1", V1, node="n1", **SMALL), audit.BELOW_FLOOR),
    "a cold boot that throws the actor's own snapshot away": (
        suspended(), placed("a", "w1", V1, node="n1", **SMALL), audit.BELOW_FLOOR),
    "a ROOTFS restore under a VOLUMES floor": (
        suspended(Fidelity.ROOTFS, min_fidelity=Fidelity.VOLUMES),
        placed("a", "w1", V1, node="n1", action=Action.RESTORE, fidelity=PlacedFidelity.ROOTFS, snapshot_id="a-s",
               **SMALL), audit.BELOW_FLOOR),
    "a placement of a stopped actor": (
        [on("w1", V1), created("a", **SMALL), ActorStopped(at=AT, actor_id="a")],
        placed("a", "w1", V1, node="n1", **SMALL), audit.PLACED_STOPPED),
    "a booking smaller than the actor": (
        [on("w1", V1), created("a", cpu=100, mem=2048)], placed("a", "w1", V1, node="n1", cpu=100, mem=16),
        audit.UNDER_BOOKED),
    "a booking without the runtime's overhead": (
        [registered("w1", entry(runtime(V1, overhead=128)), node="n1"), created("a", **SMALL)],
        placed("a", "w1", V1, node="n1", **SMALL), audit.UNDER_BOOKED),
}


@pytest.mark.parametrize("case", CASES)
def test_audit_verify_names_each_placement_the_rules_forbid(case):
    before, forged, rule = CASES[case]
    assert verify(before) is None  # the log up to it is clean
    violation = verify([*before, forged])
    assert violation is not None, f"{case}: not found"
    assert (violation.seq, violation.rule) == (len(before) + 1, rule), str(violation)


def test_what_the_rules_allow_at_their_edges_is_no_violation():
    booked = 512 + 128  # the actor and the runtime's overhead
    assert verify([registered("w1", entry(runtime(V1, overhead=128)), node="n1"), created("a", **SMALL),
                   placed("a", "w1", V1, node="n1", cpu=100, mem=booked)]) is None
    # a borrowed (golden) snapshot owns nothing to lose: it may cold-boot above a MEMORY floor, its memory given
    # up as the scheduler records it (rule 4's fallback, MEMORY to NONE; without the record, verify names it:
    # `placement whose fallback record is not the one the placement rules give it`)
    owned_by_nobody = golden(V1, borrowed=True)
    log = [on("w1", V2), created("a", snapshot=owned_by_nobody, min_fidelity=Fidelity.VOLUMES, **SMALL)]
    fallback = Fallback(reason=FallbackReason.NO_COMPATIBLE_WORKER, from_fidelity=PlacedFidelity.MEMORY,
                        to_fidelity=PlacedFidelity.NONE)
    assert verify([*log, placed("a", "w1", V2, node="n1", fallback=fallback, **SMALL)]) is None
    assert verify([*log, placed("a", "w1", V2, node="n1", **SMALL)]).rule == audit.FALLBACK_MISSTATED
    # the memory image of the current template on its node: a restore
    assert verify([*PAUSED_ON_N1, memory("a", "w1", "n1")]) is None


# --- a worker event the scheduler cannot read --------------------------------------------------


@pytest.fixture
async def wb(stack, nc, prefix):
    return Client(nc, prefix)


async def test_a_worker_event_the_scheduler_cannot_read_stops_its_placements(wb, nc, prefix, writer):
    """A newer registry writes an event this scheduler does not know (it may drain the worker or
    drop the runtime an image needs), with its fence on the booking subject as every worker change
    has. The fold skipped it and folded the fence, so its next placement there expected the very
    sequence the fence left and committed, on the worker's old state."""
    await wb.register(registration("w1", V1, node="n1"))
    await wb.create(new_actor("a", golden_snapshot=golden(V1)))
    seq = await asyncio.to_thread(writer.write, NewerWorkerEvent(at=AT, worker_id="w1", what="cordoned"),
                                  WorkerFenced(at=AT, worker_id="w1", event="NewerWorkerEvent"))
    with pytest.raises(ContractError) as refused:
        await wb.resume("a", min_seq=seq)
    assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED and "1 drained" in refused.value.message
    assert await last_seq(nc, prefix) == seq  # nothing written

    await wb.register(registration("w2", V1, node="n1"))  # a worker it can read takes the actor
    assert (await wb.resume("a")).worker_id == "w2"
    sink = await replay(nc, prefix, Sink(verify=True), False)  # `audit verify`: the scheduler's own fold
    assert sink.violation is None and not sink.projection.workers["w1"].live


class ActorPlacedV2(ActorEvent, kw_only=True):
    """A placement event a newer scheduler might write instead of ActorPlaced (with its booking
    marker right after it, in the same atomic append, as every placement has)."""

    worker_id: str
    memory_mib: int


async def test_a_placement_the_scheduler_cannot_read_stops_its_placements_on_that_worker(wb, nc, prefix, writer):
    """The fold skipped the placement and folded its booking marker: the worker's room, as this
    replica counted it, did not have what that placement booked, and the next resume booked the
    worker past its capacity."""
    await wb.register(registration("w1", V1, node="n1", mem=4096))
    await wb.create(new_actor("big", golden_snapshot=golden(V1)))
    await wb.create(new_actor("a", golden_snapshot=golden(V1)))
    seq = await asyncio.to_thread(writer.write, ActorPlacedV2(at=AT, actor_id="big", worker_id="w1", memory_mib=4000),
                                  WorkerBooked(at=AT, worker_id="w1", actor_id="big"))
    with pytest.raises(ContractError) as refused:
        await wb.resume("a", min_seq=seq)
    assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED and "1 drained" in refused.value.message
    assert await last_seq(nc, prefix) == seq  # nothing written

    await wb.register(registration("w2", V1, node="n1"))  # a worker whose room it knows takes the actor
    assert (await wb.resume("a")).worker_id == "w2"


class SnapshotTakenV2(ActorEvent, kw_only=True):
    """A snapshot event a newer snapshotter might write: a new image of the actor, described in a
    way this scheduler does not read."""

    snapshot_id: str
    stamp: str


async def test_an_actor_event_the_scheduler_cannot_read_stops_its_placements_until_its_next_life(
        wb, nc, prefix, writer):
    """A newer snapshotter records a new snapshot of the actor in an event this scheduler does not
    know, then a tag copies one of its snapshots (an event it reads). The fold skipped the first
    and folded the second, so its record of the actor looked current by sequence, and the next
    resume committed a restore of the golden image, not of the newer snapshot. The unread event
    alone had each resume decided again eight times, ending UNAVAILABLE as "lost 8
    concurrent-commit races"."""
    once = Client(nc, prefix, attempts=1)  # the answer itself, not the client's retries of it
    await wb.register(registration("w1", V1, node="n1"))
    await wb.create(new_actor("a", golden_snapshot=golden(V1)))
    unread = await asyncio.to_thread(writer.write, SnapshotTakenV2(at=AT, actor_id="a", snapshot_id="a-2",
                                                                    stamp="gvisor/2027"))
    for step in ("alone", "then an event it reads"):
        if step != "alone":
            seq = await asyncio.to_thread(writer.write, taken(snapshot("a", V1, snapshot_id="a-1"),
                                                              SnapshotOrigin.TAG))
        else:
            seq = unread
        with pytest.raises(ContractError) as refused:
            await once.resume("a", min_seq=seq)
        assert refused.value.code is ErrorCode.UNAVAILABLE, step
        assert f"message {unread}" in refused.value.message and "cannot read" in refused.value.message, step
        assert await last_seq(nc, prefix) == seq, step  # nothing written
        explanation = await once.explain("a", min_seq=seq)
        assert explanation.decision is None and explanation.refusal.code is ErrorCode.UNAVAILABLE, step

    # its next life, which this scheduler reads from its creation on, is placed
    seq = await asyncio.to_thread(writer.write, ActorStopped(at=AT, actor_id="a"),
                                  created("a", snapshot=golden(V1)))
    assert (await once.resume("a", min_seq=seq)).worker_id == "w1"


class ActorCreatedV2(ActorEvent, kw_only=True):
    """A creation a newer snapshotter might write: the actor's next life, in a form this scheduler
    does not read."""

    sandbox_class: str


async def test_a_request_id_is_not_answered_from_a_life_an_unread_creation_ended(wb, nc, prefix, writer):
    """Placed with request id R, stopped, and created anew in a form this scheduler cannot read:
    the fold's record of the actor is still its last life's, R among its placements. A resume of
    the new life with R was answered with the last life's placement (the check at the leader
    passed: the fold had met every message of the actor's subject, read or not). The new life is
    not this replica's to answer or place."""
    once = Client(nc, prefix, attempts=1)
    await wb.register(registration("w1", V1, node="n1"))
    await wb.create(new_actor("a", golden_snapshot=golden(V1)))
    first = await wb.resume("a", request_id="R")
    await wb.stop("a")
    unread = await asyncio.to_thread(writer.write, ActorCreatedV2(at=AT, actor_id="a", sandbox_class="gvisor"))
    with pytest.raises(ContractError) as refused:
        await once.resume("a", request_id="R", min_seq=unread)
    assert refused.value.code is ErrorCode.UNAVAILABLE and f"message {unread}" in refused.value.message
    assert await last_seq(nc, prefix) == unread  # nothing written
    assert first.seq < unread


def test_a_readable_placement_of_an_actor_whose_creation_was_not_read_drains_its_worker():
    """A newer snapshotter's creation this fold cannot read, then a newer scheduler's placement of
    that actor in a form it reads, with its booking marker: with no record of the actor the fold
    counted nothing of what the placement booked, and the next decision booked the worker past its
    room. Now the marker drains the worker, as that of a placement it cannot read does."""
    f = Fold(None, "t", fold([registered("w1", entry(V1), mem=4096), created("a")], Projection()))
    f.fold_message(3, "t.ev.actor.big", {TOPIC_HEADER: "ActorCreatedV2", VERSION_HEADER: "1"},
                   b'{"type":"ActorCreatedV2","actor_id":"big","sandbox_class":"gvisor","at":"2026-12-01T10:00:00Z"}')
    f.fold_message(4, "t.ev.actor.big", {TOPIC_HEADER: "ActorPlaced", VERSION_HEADER: "2"},
                   encode(placed("big", "w1", V1, mem=4000)))
    f.fold_message(5, "t.ev.booking.w1", {TOPIC_HEADER: "WorkerBooked", VERSION_HEADER: "1"}, b"{}")
    with pytest.raises(ContractError) as refused:
        decide(f.projection, "a", None, f.projection.seq)
    assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED and "1 drained" in refused.value.message


def test_the_life_after_one_whose_creation_was_not_read_starts_where_its_creation_is():
    """A life whose creation this fold cannot read (it keeps no record of the actor), placed with a
    request id by a newer scheduler, stopped; then a creation it reads. The fold made a first
    record of the actor there, so its life seemed to have begun with the log: an answer recorded
    in the reply cache for the last life's request id counted as this life's."""
    f = Fold(None, "t", fold([registered("w1", entry(V1))], Projection()))
    f.fold_message(2, "t.ev.actor.a", {TOPIC_HEADER: "ActorCreatedV2", VERSION_HEADER: "1"},
                   b'{"type":"ActorCreatedV2","actor_id":"a","sandbox_class":"gvisor","at":"2026-12-01T10:00:00Z"}')
    f.fold_message(3, "t.ev.actor.a", {TOPIC_HEADER: "ActorPlaced", VERSION_HEADER: "2"},
                   encode(placed("a", "w1", V1, request_id="R")))
    f.fold_message(4, "t.ev.booking.w1", {TOPIC_HEADER: "WorkerBooked", VERSION_HEADER: "1"}, b"{}")
    f.fold_message(5, "t.ev.actor.a", {TOPIC_HEADER: "ActorStopped", VERSION_HEADER: "3"},
                   encode(ActorStopped(at=AT, actor_id="a")))
    f.fold_message(6, "t.ev.actor.a", {TOPIC_HEADER: "ActorCreated", VERSION_HEADER: "4"}, encode(created("a")))
    p = f.projection
    assert p.life_started("a") == 6 and not p.unread_actors
    assert p.actor_seq("a") == 6 and p.actor_expectation("a") == (4, 6)


# --- what the review found holding: random lifecycles, every decision audited ----------------------


VERSIONS = [version("1"), version("2"), version("3"), version("1", "arm64"), version("2", "arm64")]


def random_runtime(rng: random.Random):
    own = rng.choice(VERSIONS)
    edges = tuple(v for v in VERSIONS if v != own and rng.random() < 0.2)  # chains and cycles of edges too
    return runtime(own, name=rng.choice([None, "same-name"]), overhead=rng.choice([0, 32]),
                   compatible=edges, per_gib=rng.choice([0, 4]))


def random_registration(rng: random.Random, worker_id: str) -> RegisterWorker:
    default = random_runtime(rng)
    restorable: list = []
    for _ in range(rng.randint(0, 2)):
        r = random_runtime(rng)
        if all(r.version != x.version for x in (default, *restorable)):
            restorable.append(r)
    return RegisterWorker(worker_id=worker_id, node=rng.choice(["n1", "n2", "n3"]),
                          capacity=Resources(cpu_millis=rng.choice([1000, 4000]), memory_mib=rng.choice([1024, 4096])),
                          labels=rng.choice([{}, {"zone": "a"}, {"zone": "b"}]),
                          sandbox_classes=(entry(default, tuple(restorable)),))


def lifecycle(seed: int, steps: int) -> None:
    """Registrations, runtime changes, moves, drains and removals (the registry's Worker), actors
    created plain, from golden snapshots or anew, paused, suspended, reverted, re-templated and
    stopped (the snapshotter's Actor), and resumes decided on the fold; each event is judged by
    `audit verify` before it is folded, and now and then a checkpoint's restore is compared with
    the fold and with a replay."""
    rng = random.Random(seed)
    p = Projection()
    verifier = audit.Verifier(p)
    log: list = []
    workers: dict[str, RegistryWorker] = {}
    actors: dict[str, SnapshotterActor] = {}

    def add(event) -> None:
        log.append(event)
        violation = verifier.check(len(log), event)
        assert violation is None, f"seed {seed}: {violation}"
        if isinstance(event, WorkerBooked):
            p.booking_marker(len(log), event.worker_id)
        else:
            p.apply(len(log), event)

    def save(aggregate) -> None:
        for recorded in aggregate.collect_events():
            add(recorded.body)

    for step in range(steps):
        op = rng.random()
        try:
            if op < 0.12:
                w = workers.setdefault(wid := f"w{rng.randint(0, 6)}", RegistryWorker(wid))
                w.register(random_registration(rng, wid), AT)
                save(w)
            elif op < 0.16:
                w = workers.setdefault(wid := f"w{rng.randint(0, 6)}", RegistryWorker(wid))
                if rng.random() < 0.5:
                    w.drain(None, AT)
                    save(w)
                else:
                    w.remove(None, AT)
                    save(w)
                    for a in actors.values():  # the snapshotter releases what ran there
                        if a.assignment is not None and a.assignment.worker_id == wid:
                            a.release_from_removed_worker(wid, a.assignment_version, AT)
                            save(a)
            elif op < 0.25:
                a = actors.setdefault(aid := f"a{rng.randint(0, 9)}", SnapshotterActor(aid))
                source = None
                if rng.random() < 0.3:  # one id names one image (docs/contract.md): each golden image its own
                    v, f, t = rng.choice(VERSIONS), rng.choice(list(Fidelity)), rng.choice(["t1", "t2"])
                    source = golden(v, snapshot_id=f"golden-{VERSIONS.index(v)}-{f.value.lower()}-{t}", fidelity=f,
                                    template=t)
                a.create(CreateActor(
                    actor_id=aid, sandbox_class="gvisor", template_uid=rng.choice(["t1", "t2"]),
                    resources=Resources(cpu_millis=rng.choice([100, 500]), memory_mib=rng.choice([256, 1500])),
                    selectors=rng.choice([{}, {"zone": "a"}]), golden_snapshot=source,
                    min_fidelity=rng.choice([Fidelity.ROOTFS, Fidelity.VOLUMES, Fidelity.MEMORY])), None, AT)
                save(a)
            elif op < 0.6:
                aid = f"a{rng.randint(0, 9)}"
                try:
                    decided = decide(p, aid, rng.choice([None, {"zone": "a"}, {"zone": "b"}]), p.seq)
                except ContractError:
                    continue
                actors[aid].place(placed_event(decided, None))
                save(actors[aid])
                add(WorkerBooked(at=AT, worker_id=decided.worker_id, actor_id=aid))
            elif (a := actors.get(f"a{rng.randint(0, 9)}")) is not None:
                r = rng.random()
                if r < 0.3:
                    a.pause(None, None, AT)
                elif r < 0.6:
                    a.suspend(None, "s3://x", rng.choice(list(Fidelity)), None, AT)
                elif r < 0.7:
                    a.change_template(rng.choice(["t1", "t2", "t3"]), None, AT)
                elif r < 0.8:
                    a.revert(None, None, AT)
                else:
                    a.stop(None, AT)
                save(a)
        except ContractError:  # a command its aggregate refuses records nothing
            continue
        if step % 50 == 49:
            assert walk(restore_state(export_state(p))) == walk(p), f"seed {seed} step {step}"
            replay = Projection()
            for seq, event in enumerate(log, start=1):
                replay.booking_marker(seq, event.worker_id) if isinstance(event, WorkerBooked) \
                    else replay.apply(seq, event)
            assert walk(replay) == walk(p), f"seed {seed} step {step}"


@pytest.mark.parametrize("seed", range(12))
def test_every_decision_on_random_lifecycles_passes_the_audit(seed):
    lifecycle(seed, 400)


async def test_explain_names_what_it_can_of_an_actor_whose_history_holds_an_event_it_cannot_read(
        wb, nc, nats_url, prefix, writer, monkeypatch):
    """A newer snapshotter's event in an actor's last life, then its next life, which the scheduler
    reads and explains: every worker is passed over for `selector mismatch`. `warmboot explain`
    reads the actor's history to name the keys not matched, and decoded every message of it: the
    one it cannot read ended the command with a traceback (msgspec.ValidationError), the scheduler's
    answer unshown (found by a review). It shows the answer, the reason bare where the log cannot be
    read, as when the operator may not read the log at all. (A scheduler that names the keys itself,
    `Rejection.missing_keys`, leaves the history unread: the keys are named.)"""
    from click.testing import CliRunner

    from warmboot.cli import main

    await wb.register(registration("w1", V1, node="n1"))
    await wb.create(new_actor("a", golden_snapshot=golden(V1)))
    unread = await asyncio.to_thread(writer.write, SnapshotTakenV2(at=AT, actor_id="a", snapshot_id="a-2",
                                                                   stamp="gvisor/2027"))
    seq = await asyncio.to_thread(writer.write, ActorStopped(at=AT, actor_id="a"), created("a", snapshot=golden(V1)))
    why = await wb.explain("a", {"zone": "eu-1"}, seq)  # the scheduler reads this life: w1 passed over
    assert [r.reasons for r in why.rejected] == [["selector mismatch"]], why
    args = ["explain", "a", "--selector", "zone=eu-1", "--min-seq", str(seq), "--nats", nats_url, "--prefix", prefix]
    shown = await asyncio.to_thread(CliRunner().invoke, main, args)
    assert shown.exit_code == 0 and shown.exception is None, (shown.output, shown.exception)
    rows = [re.split(r"\s{2,}", line) for line in shown.stdout.strip().split("\n\n")[1].splitlines()]
    assert rows == [["WORKERS", "REASONS"], ["w1", "selector mismatch (zone)"]], shown.stdout  # the scheduler's
    from warmboot.client import Client

    explain = Client.explain  # a scheduler of an earlier version: no keys in its answer, the history read

    async def earlier(self, *args, **kwargs):
        answer = await explain(self, *args, **kwargs)
        return msgspec.structs.replace(answer, rejected=[msgspec.structs.replace(r, missing_keys=[])
                                                         for r in answer.rejected])

    monkeypatch.setattr(Client, "explain", earlier)
    shown = await asyncio.to_thread(CliRunner().invoke, main, args)
    assert shown.exit_code == 0 and shown.exception is None, (shown.output, shown.exception)
    rows = [re.split(r"\s{2,}", line) for line in shown.stdout.strip().split("\n\n")[1].splitlines()]
    assert rows == [["WORKERS", "REASONS"], ["w1", "selector mismatch"]], shown.stdout  # bare: not known
    # the commands that show the history itself cannot leave the message out: they name it, exit 1
    for command in (["audit", "actor", "a"], ["actor", "show", "a"]):
        shown = await asyncio.to_thread(CliRunner().invoke, main, [*command, "--nats", nats_url, "--prefix", prefix])
        assert shown.exit_code == 1 and isinstance(shown.exception, SystemExit), (shown.output, shown.exception)
        assert (f"error: FAILED_PRECONDITION: message {unread} of {prefix}.ev.actor.a (SnapshotTakenV2"
                in shown.stderr), (command, shown.stderr)
        assert "a newer warmboot may read it" in shown.stderr


async def test_the_views_read_the_fleet_past_a_worker_event_they_cannot_read(wb, nc, nats_url, prefix, writer):
    """A newer registry's event in a worker's history, which the scheduler folds as unread (the worker
    counts as drained). The views read the fleet's runtime names, and `fragmentation --class` the
    classes it runs, by decoding every worker event: the one this version cannot read ended `explain`
    and `fragmentation` with a traceback (msgspec.ValidationError), the scheduler's answer unshown
    (found by a review). They read the fleet as the scheduler does (`Fold.fold_message`)."""
    from click.testing import CliRunner

    from warmboot.cli import main

    await wb.register(registration("w1", V1, node="n1"))
    await wb.create(new_actor("a", golden_snapshot=golden(V1)))
    seq = await asyncio.to_thread(writer.write, NewerWorkerEvent(at=AT, worker_id="w1", what="cordoned"),
                                  WorkerFenced(at=AT, worker_id="w1", event="NewerWorkerEvent"))
    where = ["--nats", nats_url, "--prefix", prefix]

    def run(*args: str):
        return asyncio.to_thread(CliRunner().invoke, main, list(args))

    why = await run("explain", "a", "--min-seq", str(seq), *where)
    assert why.exit_code == 0 and why.exception is None, (why.output, why.exception)
    assert "1 drained" in why.stdout, why.stdout  # the scheduler's answer, shown
    shown = await run("fragmentation", "--min-seq", str(seq), *where)
    assert shown.exit_code == 0 and shown.exception is None, (shown.output, shown.exception)
    typo = await run("fragmentation", "--class", "gvsor", "--min-seq", str(seq), *where)
    assert typo.exit_code == 1 and isinstance(typo.exception, SystemExit), (typo.output, typo.exception)
    assert "NOT_FOUND" in typo.output and "(registered: gvisor)" in typo.output, typo.output
