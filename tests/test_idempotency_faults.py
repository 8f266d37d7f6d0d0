"""One placement per request across replicas, also when a replica stalls (issue 14, 1 and 2).

A replica whose committer stalls (a leader election) holds a resume it queued; the
client times out and retries the same request id; another replica answers it; the
client goes on (suspends, resumes again with other ids...). When the stalled replica
decides its stale attempt at last, it must answer from the log, never place the actor
again. Made deterministic by holding the replica's committer (`commits_held`).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from contextlib import AsyncExitStack, suppress
from typing import Any

import pytest

from events.errors import ContractError
from events.schema import (ActorPlaced, ActorReleased, ErrorCode, FallbackReason, Fidelity, PlacedFidelity,
                           ReleaseReason, ResumeActor, RuntimeChanged, WorkerFenced, WorkerRegistered)
from services.registry.domain import canonical_classes
from services.scheduler.records import RECENT_PLACEMENTS
from services.scheduler.service import SchedulerService
from tests.factories import (AT, NewerWorkerEvent, actor, answered, golden, last_seq, read_log, runtime, version,
                             wait_for, worker)
from tests.factories import booked as booked_event, placed as placed_event
from warmboot.client import Client

V1 = version("v1")


def catching_up(replica: SchedulerService) -> asyncio.Event:
    """Set once `replica` waits for its fold to reach a sequence it has not applied (it catches up)."""
    event = asyncio.Event()
    fold_wait = replica.fold.wait

    async def wait(seq, timeout, *field):
        if seq and seq > replica.fold.applied:
            event.set()
        await fold_wait(seq, timeout, *field)

    replica.fold.wait = wait
    return event


async def placements(nc, prefix, request_id: str) -> list[tuple[int, ActorPlaced]]:
    return [(s, e) for s, e in await read_log(nc, prefix) if isinstance(e, ActorPlaced) and e.request_id == request_id]


@pytest.mark.parametrize("later", [0, 1, RECENT_PLACEMENTS + 1], ids=["suspended", "resumed-again", "many-later"])
async def test_a_stale_attempt_decided_late_answers_from_the_log(stalled, nc, prefix, later):
    wb = Client(nc, prefix)
    for i in range(4):
        await wb.register(worker(f"w{i}", V1))
    await wb.create(actor("a"))
    async with stalled.committer.commits_held():
        stale = asyncio.create_task(stalled.resume("a", ResumeActor(request_id="R")))
        await stalled.committer.until_queued(1)
        first = await wb.resume("a", request_id="R")  # the retry, answered by the other replica
        await wb.suspend("a", uri="s3://a/0")
        for i in range(later):  # the client goes on with other requests
            await wb.resume("a", request_id=f"R{i + 2}")
            await wb.suspend("a", uri=f"s3://a/{i + 1}")
        await stalled.fold.wait(await last_seq(nc, prefix), 10)  # it has folded all of it meanwhile
    answer = await asyncio.wait_for(stale, 10)
    assert answer == first  # the first answer, not a second placement
    assert [s for s, _ in await placements(nc, prefix, "R")] == [first.seq - 1]  # ActorPlaced, then WorkerBooked


async def test_a_retry_that_races_its_own_committed_first_attempt_gets_the_first_answer(stalled, nc, prefix):
    """Attempt 1 is committed, its reply lost; attempt 2 reaches a replica that had queued
    it before it folded attempt 1: answered with attempt 1's placement, not 'RUNNING'."""
    wb = Client(nc, prefix)
    await wb.register(worker("w", V1))
    await wb.create(actor("a"))
    async with stalled.committer.commits_held():
        second = asyncio.create_task(stalled.resume("a", ResumeActor(request_id="R")))
        await stalled.committer.until_queued(1)
        first = await wb.resume("a", request_id="R")
    assert await asyncio.wait_for(second, 10) == first
    assert len(await placements(nc, prefix, "R")) == 1


async def test_duplicates_in_flight_on_two_replicas_place_once(stalled, nc, prefix):
    wb = Client(nc, prefix)
    for i in range(3):
        await wb.register(worker(f"w{i}", V1, cpu=64000, mem=65536))
    actors = [f"a{i}" for i in range(40)]
    for a in actors:
        await wb.create(actor(a))
    async with stalled.committer.commits_held():
        stale = [asyncio.create_task(stalled.resume(a, ResumeActor(request_id=f"r-{a}"))) for a in actors]
        await stalled.committer.until_queued(len(actors))
        answered = await asyncio.gather(*(wb.resume(a, request_id=f"r-{a}") for a in actors))
    assert await asyncio.gather(*stale) == answered
    for a in actors:
        assert len(await placements(nc, prefix, f"r-{a}")) == 1


async def test_a_late_retry_after_many_placements_is_answered_from_the_reply_cache(stack, nc, prefix):
    """The actor's recent placements hold the last few; an older one's answer is kept in the
    reply cache when it is pushed out, so a retry that comes later still gets it."""
    wb = Client(nc, prefix)
    await wb.register(worker("w", V1, cpu=64000, mem=65536))
    await wb.create(actor("a"))
    first = await wb.resume("a", request_id="R")
    await wb.suspend("a", uri="s3://a/0")
    for i in range(RECENT_PLACEMENTS + 1):
        await wb.resume("a", request_id=f"later-{i}")
        await wb.suspend("a", uri=f"s3://a/{i + 1}")
    before = len(await placements(nc, prefix, "R"))
    assert await wb.resume("a", request_id="R") == first  # not a new placement of a suspended actor
    assert before == len(await placements(nc, prefix, "R")) == 1


async def test_a_new_request_id_costs_no_read_of_the_reply_cache_however_often_the_actor_was_placed(
        stack, nc, prefix):
    """Only an id that a placement of this life may have pushed out of the actor's recent ones
    is looked up in the reply cache (`Actor.may_have_pushed_out`); the others are new."""
    wb = Client(nc, prefix)
    await wb.register(worker("w", V1, cpu=64000, mem=65536))
    await wb.create(actor("a"))
    scheduler = stack.services[-1]
    reads: list[str] = []
    get = scheduler.replies.get

    async def counted(key):
        reads.append(key)
        return await get(key)

    scheduler.replies.get = counted
    answers = []
    for i in range(3 * RECENT_PLACEMENTS):
        answers.append(await wb.resume("a", request_id=f"r-{i}"))
        await wb.suspend("a", uri=f"s3://a/{i}")
    assert reads == []  # every one of them new
    assert await wb.resume("a", request_id="r-0") == answers[0]  # pushed out long ago: the cache answers
    assert len(reads) == 1
    assert await wb.resume("a", request_id=f"r-{3 * RECENT_PLACEMENTS - 1}") == answers[-1]  # a recent one
    assert len(reads) == 1


async def test_an_answer_pushed_out_is_kept_before_the_placement_that_pushes_it(stalled, nc, prefix):
    """A replica that dies between committing the placement that pushes an older answer out
    of the actor's recent ones and keeping that answer in the reply cache must not lose it:
    the answer is kept first. The replica's cache writes hang until it "crashes" (the write is
    then lost); a late retry of the oldest request, through the other replica, still gets its
    first answer and writes nothing."""
    wb = Client(nc, prefix)
    await wb.register(worker("w", V1, cpu=64000, mem=65536))
    await wb.create(actor("a"))
    first = await wb.resume("a", request_id="R")
    await wb.suspend("a", uri="s3://a/0")
    for i in range(RECENT_PLACEMENTS - 1):  # R and these fill the actor's recent placements
        await wb.resume("a", request_id=f"later-{i}")
        await wb.suspend("a", uri=f"s3://a/{i + 1}")
    await stalled.fold.wait(await last_seq(nc, prefix), 10)

    writing, crashed = asyncio.Event(), asyncio.Event()
    kept: list[str] = []

    async def hanging_put(key, value):
        kept.append(key)
        writing.set()
        await crashed.wait()
        raise ConnectionResetError("the replica died before its cache write landed")

    stalled.replies.kv.put = hanging_put
    pushing = asyncio.create_task(stalled.resume("a", ResumeActor(request_id="pushes-R-out")))
    await asyncio.wait_for(writing.wait(), 10)
    logged = await placements(nc, prefix, "pushes-R-out")
    crashed.set()
    with suppress(ContractError):  # the placement fails with the write: it was not appended
        await asyncio.wait_for(pushing, 10)
    assert len(kept) == 1  # the write of R's answer, and only it

    await wb.resume("a", request_id="pushes-R-out")  # the client retries it, through the other replica
    await wb.suspend("a", uri="s3://a/last")
    before = len(await read_log(nc, prefix))
    assert await wb.resume("a", request_id="R") == first  # not a new placement of a suspended actor
    assert len(await read_log(nc, prefix)) == before  # and nothing written
    assert logged == [], "the placement that pushes R out was written before R's answer was kept"
    assert len(await placements(nc, prefix, "pushes-R-out")) == 1


async def test_a_reply_cache_that_refuses_fails_only_the_placement_that_needed_it(stalled, nc, prefix):
    """One group: a placement that pushes an older answer out, and placements that push nothing
    out. The bucket refuses the older answer: that placement fails UNAVAILABLE and is not
    written; the others of its group are."""
    wb = Client(nc, prefix)
    for a in "abc":  # a worker each (a group books a worker once), chosen by label
        await wb.register(worker(f"w-{a}", V1, cpu=64000, mem=65536, labels={"for": a}))
        await wb.create(actor(a))
    for i in range(RECENT_PLACEMENTS):
        await wb.resume("a", request_id=f"early-{i}", selectors={"for": "a"})
        await wb.suspend("a", uri=f"s3://a/{i}")
    await stalled.fold.wait(await last_seq(nc, prefix), 10)

    async def refusing_put(key, value):
        raise ConnectionResetError("the bucket's leader is gone")

    stalled.replies.kv.put = refusing_put
    async with stalled.committer.commits_held():
        resumes = {a: asyncio.create_task(stalled.resume(a, ResumeActor(request_id=f"now-{a}", selectors={"for": a})))
                   for a in "abc"}
        await stalled.committer.until_queued(3)
    groups = stalled.committer.groups
    with pytest.raises(ContractError) as refused:
        await asyncio.wait_for(resumes["a"], 10)
    assert refused.value.code is ErrorCode.UNAVAILABLE and "reply cache" in str(refused.value)
    placed_b, placed_c = await asyncio.gather(resumes["b"], resumes["c"])
    assert stalled.committer.groups == groups + 1  # one group: b and c appended, a taken out of it
    assert await placements(nc, prefix, "now-a") == []
    assert [s for s, _ in await placements(nc, prefix, "now-b")] == [placed_b.seq - 1]
    assert [s for s, _ in await placements(nc, prefix, "now-c")] == [placed_c.seq - 1]


async def test_a_late_retry_at_a_replica_behind_the_pushing_out_is_answered_not_placed_again(stalled, nc, prefix):
    """A replica folds nothing while R is placed elsewhere and then pushed out of the actor's
    recent placements by later ones. The retry of R reaches it: decided first on its stale
    view, it loses the race; caught up, R is in neither the recent placements nor the view
    it checked the reply cache on. The committer sends it back to be checked again (the
    filter of pushed-out ids now holds R), and the reply cache answers: one placement of R."""
    wb = Client(nc, prefix)
    await wb.register(worker("w", V1, cpu=64000, mem=65536))
    created = await wb.create(actor("a"))
    await stalled.fold.wait(await last_seq(nc, prefix), 10)
    lost_a_race = asyncio.Event()
    last_seq_of_stream = stalled.committer.last_seq

    async def sorting_out() -> int:  # the committer reads the stream's end after a refused append
        lost_a_race.set()
        return await last_seq_of_stream()

    stalled.committer.last_seq = sorting_out
    async with stalled.fold.paused():  # it lags: folds nothing meanwhile
        first = await wb.resume("a", request_id="R")
        await wb.suspend("a", uri="s3://a/0")
        for i in range(RECENT_PLACEMENTS):  # later requests push R out of the recent placements
            await wb.resume("a", request_id=f"L{i}")
            await wb.suspend("a", uri=f"s3://a/{i + 1}")
        retry = asyncio.create_task(stalled.resume("a", ResumeActor(request_id="R", min_seq=created.seq)))
        await asyncio.wait_for(lost_a_race.wait(), 10)  # its first decision, on the stale view, lost
    answer = await asyncio.wait_for(retry, 20)
    assert answer == first
    assert [s for s, _ in await placements(nc, prefix, "R")] == [first.seq - 1]


async def test_a_replica_behind_a_new_life_does_not_answer_the_last_lifes_placement(stalled, nc, prefix):
    """Request ids are scoped to one life. A resume R of the actor's new life reaches a replica
    that has not folded the stop and the new creation yet (the caller sent no min_seq): it
    must not answer with the last life's placement of R, but catch up and decide on the new life:
    which refuses R, an id the last life's resume used (chosen 2026-12-06: before, it placed the
    new life; a copy of a last life's resume held in a NATS server did the same)."""
    wb = Client(nc, prefix)
    await wb.register(worker("w", V1, cpu=64000, mem=65536))
    await wb.create(actor("a"))
    old = await wb.resume("a", request_id="R")
    await stalled.fold.wait(await last_seq(nc, prefix), 10)
    behind = catching_up(stalled)
    async with stalled.fold.paused():
        await wb.stop("a")
        created = await wb.create(actor("a"))  # the next life
        answer = asyncio.create_task(stalled.resume("a", ResumeActor(request_id="R")))
        await asyncio.wait_for(behind.wait(), 10)  # it found R in its stale view: it catches up first
        assert not answer.done()
    await refused_from_an_earlier_life(answer, created, old)
    assert len(await placements(nc, prefix, "R")) == 1  # the last life's alone


async def test_a_refusal_decided_on_a_fold_behind_the_actor_s_history_is_decided_again(stack, nc, prefix, monkeypatch):
    """A client that does not pass `min_seq` resumes an actor it has just suspended, through a
    replica whose fold has not folded the suspend yet (after a failover its consumer starts
    again; here its fold is paused). The fold says RUNNING: before, that refusal was the answer
    (FAILED_PRECONDITION, as in a leader-kill run of test_faults). Now it is checked against the
    stream leader first, and the resume waits for the fold and places the actor."""
    scheduler = stack.services[-1]
    wb = Client(nc, prefix)
    await wb.register(worker("w0", V1))
    await wb.create(actor("a"))
    await wb.resume("a")
    suspended, placed = await resumed_behind(scheduler, nc, prefix, monkeypatch, lambda: wb.suspend("a", uri="s3://a/0"))
    assert placed.actor_id == "a" and placed.seq > suspended.seq


async def resumed_behind(scheduler: SchedulerService, nc, prefix: str, monkeypatch, write, **resume) -> tuple:
    """`write()` while the replica's fold is paused, then a resume of actor "a" through it by a
    client that passes no `min_seq` (`resume`: its other arguments); asserts that the resume waits
    for the fold rather than being answered on what the fold has. (write's answer, the placement)."""
    waiting = asyncio.Event()
    wait = scheduler.fold.wait

    async def noted(seq: int | None, timeout: float, *field: str) -> None:
        if seq is not None and seq > scheduler.projection.seq:  # the resume waits for what the fold has not folded
            waiting.set()
        await wait(seq, timeout, *field)

    async with scheduler.fold.paused():
        written = await write()
        monkeypatch.setattr(scheduler.fold, "wait", noted)
        resuming = asyncio.create_task(Client(nc, prefix, read_your_writes=False).resume("a", **resume))
        await asyncio.wait({resuming, asyncio.create_task(waiting.wait())}, return_when=asyncio.FIRST_COMPLETED)
        assert not resuming.done(), resuming.exception()  # not refused on what the fold has: it waits
    return written, await resuming


async def full_for_a_memory_image(wb: Client) -> int:
    """a holds a MEMORY image stamped V1 whose only compatible worker, w1, is full (b runs there);
    w2 has room on V2 only: a resume of a now falls back, NO_COMPATIBLE_WORKER, giving up the image.
    Returns the sequence of w2's registration."""
    await wb.register(worker("w1", V1, mem=2048))
    await wb.create(actor("a", mem=1024))
    await wb.resume("a")
    await wb.suspend("a", uri="s3://a/0")  # a MEMORY image stamped V1
    await wb.create(actor("b", mem=1536))
    assert (await wb.resume("b")).worker_id == "w1"
    return (await wb.register(worker("w2", version("v2")))).seq


@pytest.mark.parametrize("room", ["registered", "released"])
async def test_a_memory_image_is_not_given_up_on_a_fold_behind_room_for_it(stack, nc, prefix, monkeypatch, room):
    """A compatible worker gets room through another process (a registration at the registry, a
    suspend at the snapshotter) a moment before the actor's resume reaches a replica whose fold
    has not read it yet (the caller passes no min_seq). The fold sees no compatible worker with
    room; the fallback that answer makes throws the memory image away for good, so the replica
    has its fold catch up with the stream's end first, and restores the image (before: VOLUMES on
    w2, the image lost, although a compatible worker had room at the leader)."""
    scheduler = stack.services[-1]
    wb = Client(nc, prefix)
    await full_for_a_memory_image(wb)
    explained = await wb.explain("a")
    assert explained.decision.fallback.reason is FallbackReason.NO_COMPATIBLE_WORKER  # what the fold says now

    async def room_for_it():
        if room == "registered":
            return await wb.register(worker("w3", V1))
        return await wb.suspend("b", uri="s3://b/0")

    _, placed = await resumed_behind(scheduler, nc, prefix, monkeypatch, room_for_it)
    assert (placed.fidelity, placed.fallback) == (PlacedFidelity.MEMORY, None)
    assert placed.worker_id == ("w3" if room == "registered" else "w1")
    assert [e.worker_id for _, e in await read_log(nc, prefix) if isinstance(e, ActorPlaced) and e.actor_id == "a"] \
        == ["w1", placed.worker_id]  # nothing placed on w2 before


async def test_a_local_image_is_not_refused_on_a_fold_behind_a_worker_of_its_node(stack, nc, prefix, monkeypatch):
    """a is PAUSED on node-1, whose worker was removed (its machine replaced): a resume is refused,
    FAILED_PRECONDITION, and the refusal says to revert the actor to give the image up. The node's new
    worker registers through the registry a moment before the resume reaches a replica whose fold has
    not read it: the refusal was the answer, and a caller following it would have thrown the image away.
    Now the replica has its fold catch up with the stream's end first, and restores the image there."""
    scheduler = stack.services[-1]
    wb = Client(nc, prefix)
    await wb.register(worker("w1", V1, node="node-1"))
    await wb.create(actor("a"))
    await wb.resume("a")
    await wb.pause("a")  # a LOCAL image on node-1, stamped V1
    await wb.remove("w1", reason="machine replaced")
    with pytest.raises(ContractError) as refused:  # no worker on node-1: the refusal, as it stands
        await wb.resume("a")
    assert refused.value.code is ErrorCode.FAILED_PRECONDITION and "revert" in refused.value.message
    _, placed = await resumed_behind(scheduler, nc, prefix, monkeypatch,
                                     lambda: wb.register(worker("w2", V1, node="node-1")))
    assert (placed.worker_id, placed.fidelity, placed.node) == ("w2", PlacedFidelity.MEMORY, "node-1")


async def test_a_fallback_in_a_refused_group_is_decided_again(stack, stalled, nc, prefix):
    """b and a, both with V1 images, reach the committer together; w1, the only V1 worker, has room
    for one: b takes it, and a (its fold confirmed current) falls back to w2, giving its image up.
    The group is refused (w1 changed meanwhile: its capacity raised) and b is decided again. a's
    fallback was kept and appended as it was, although the room it lacked (b's booking, failed, or
    w1's new capacity) was there (found by a review). It is decided again too, and restores."""
    from eventsourcing.persistence import IntegrityError

    from services.scheduler.committer import Job

    wb = Client(nc, prefix)
    await wb.register(worker("w1", V1, mem=1536))  # room for one actor of 1024 MiB
    for name in ("a", "b"):
        await wb.create(actor(name, mem=1024))
        await wb.resume(name)
        await wb.suspend(name, uri=f"s3://{name}/0")  # a MEMORY image stamped V1
    await wb.register(worker("w2", version("v2"), mem=8192))
    await stalled.fold.wait(await last_seq(nc, prefix), 10)
    committer = stalled.committer
    append = committer.append

    async def after_w1_changed(group):
        committer.append = append
        await wb.register(worker("w1", V1, mem=4096))  # its fence refuses the group
        await append(group)

    committer.append = after_w1_changed
    loop = asyncio.get_running_loop()
    jobs = {name: Job(name, None, None, loop.create_future()) for name in ("b", "a")}
    jobs["a"].confirmed = True  # as after its CONFIRM: its fold caught up with the stream's end
    async with committer.commits_held():
        tasks = {name: asyncio.create_task(committer.submit(job)) for name, job in jobs.items()}
        await committer.until_queued(2)
    with pytest.raises(IntegrityError):  # b, whose worker moved on
        await asyncio.wait_for(tasks["b"], 20)
    with pytest.raises(IntegrityError):  # and a: decided again, not its fallback appended
        await asyncio.wait_for(tasks["a"], 20)
    assert not [e for _, e in await read_log(nc, prefix) if isinstance(e, ActorPlaced) and e.worker_id == "w2"]


async def test_a_memory_image_is_given_up_once_the_fold_is_current(stack, nc, prefix):
    """When no compatible worker has room at the leader either, the fallback is made, once. The resume
    names w2's registration as its min_seq: without it, a replica whose fold has not read w2 yet has
    no worker with room at all, and refuses RESOURCE_EXHAUSTED (a loaded CI run: `0/1 workers
    available`). A refusal gives nothing up, so it is not rechecked at the stream's end as a fallback
    is; the caller's min_seq is how it sees its own writes (CONTRACT, read-your-writes)."""
    wb = Client(nc, prefix, read_your_writes=False)
    registered = await full_for_a_memory_image(wb)
    before = await last_seq(nc, prefix)
    placed = await wb.resume("a", request_id="F", min_seq=registered)
    assert (placed.worker_id, placed.fidelity) == ("w2", PlacedFidelity.VOLUMES)
    assert placed.fallback.reason is FallbackReason.NO_COMPATIBLE_WORKER
    assert [type(e).__name__ for s, e in await read_log(nc, prefix) if s > before] == ["ActorPlaced", "WorkerBooked"]


async def test_selectors_of_the_actor_s_last_life_do_not_refuse_a_resume_of_its_next(stack, nc, prefix, monkeypatch):
    """The actor's selectors are its life's: a resume may add selectors, never change one
    (INVALID_ARGUMENT). Stopped and created anew without them, the actor is resumed with one its
    last life had otherwise, through a replica whose fold has not folded the new life. The
    conflict was the answer, from the last life's selectors; now the refusal is checked at the
    stream leader as one on the actor's state is, and the resume waits for the fold."""
    scheduler = stack.services[-1]
    wb = Client(nc, prefix)
    await wb.register(worker("w-a", V1, labels={"zone": "a"}))
    await wb.register(worker("w-b", V1, labels={"zone": "b"}))
    await wb.create(actor("a", selectors={"zone": "a"}))
    with pytest.raises(ContractError) as refused:  # the rule itself, on a fold that is current
        await wb.resume("a", selectors={"zone": "b"})
    assert refused.value.code is ErrorCode.INVALID_ARGUMENT and refused.value.field == "selectors.zone"

    async def next_life():
        await wb.stop("a")
        return await wb.create(actor("a"))  # it selects nothing

    created, placed = await resumed_behind(scheduler, nc, prefix, monkeypatch, next_life, selectors={"zone": "b"})
    assert placed.worker_id == "w-b" and placed.seq > created.seq


async def test_a_message_of_the_last_life_the_fold_cannot_read_does_not_refuse_the_next(
        stack, nc, prefix, monkeypatch, writer):
    """An actor whose life holds a message this scheduler cannot read is not placed by it
    (UNAVAILABLE) until its next life. A replica whose fold has not folded that next life yet
    gave that refusal; it is one on the actor's state, so it is checked at the stream leader
    first, and the resume waits for the fold and places the actor."""
    from events.schema import ActorStopped
    from tests.factories import AT, created
    from tests.test_placement_review import SnapshotTakenV2

    scheduler = stack.services[-1]
    wb = Client(nc, prefix)
    await wb.register(worker("w0", V1))
    await wb.create(actor("a"))
    unread = await asyncio.to_thread(writer.write, SnapshotTakenV2(at=AT, actor_id="a", snapshot_id="a-2", stamp="x"))
    with pytest.raises(ContractError) as refused:
        await Client(nc, prefix, attempts=1).resume("a", min_seq=unread)
    assert refused.value.code is ErrorCode.UNAVAILABLE and f"message {unread}" in refused.value.message

    async def next_life() -> int:
        return await asyncio.to_thread(writer.write, ActorStopped(at=AT, actor_id="a"), created("a"))

    created_at, placed = await resumed_behind(scheduler, nc, prefix, monkeypatch, next_life)
    assert placed.worker_id == "w0" and placed.seq > created_at


@pytest.mark.parametrize("created_first, folded_late", [(True, False), (False, False), (False, True)],
                         ids=["created", "suspended", "suspended-placement-folded-late"])
async def test_a_refusal_is_decided_again_when_the_fold_catches_up_while_the_leader_is_asked(
        stack, nc, prefix, monkeypatch, created_first, folded_late):
    """As above, but the fold folds what it lacked while the stream leader's answer is on its way,
    the window a loaded CI run hit (NOT_FOUND for an actor just created, in test_faults' leader
    kill). The refusal was decided on the fold's state before that, so it is decided again: the
    check compares the leader's answer with what the fold had when the refusal was decided, not
    with what it has once the answer is in.

    The first placement's reply can reach the client before the fold's consumer delivers that
    placement (the store appends on a connection of its own): a fold paused then would hold the
    resume in its wait for the replica's own last placement (`Committer.unfolded`), which only the
    end of the pause, in the leader's answer, could end (`folded_late` makes that order certain).
    So the fold has the placement before it is paused."""
    import services.scheduler.service as service_module

    scheduler = stack.services[-1]
    wb = Client(nc, prefix)
    await wb.register(worker("w0", V1))
    if not created_first:
        created = await wb.create(actor("a"))
        if folded_late:
            await scheduler.fold.wait(created.seq, 10)
            async with scheduler.fold.paused():
                first = await wb.resume("a")
            assert scheduler.committer.unfolded("a") == first.seq  # answered before the fold has it
        else:
            first = await wb.resume("a")
        await scheduler.fold.wait(first.seq, 10)
        assert scheduler.committer.unfolded("a") is None
    pause = scheduler.fold.paused()
    await pause.__aenter__()
    paused = True

    async def go_on() -> None:
        nonlocal paused
        if paused:
            paused = False
            await pause.__aexit__(None, None, None)

    asked: list[int] = []
    real = service_module.last_seq_on

    async def answered_once_the_fold_caught_up(js, stream: str, subject: str) -> int:
        seq = await real(js, stream, subject)
        if not asked:  # the refusal's check: the fold goes on, and has the actor before the answer is read
            await go_on()
            await scheduler.fold.wait(seq, 10)
        asked.append(seq)
        return seq

    try:
        written = await (wb.create(actor("a")) if created_first else wb.suspend("a", uri="s3://a/0"))
        monkeypatch.setattr(service_module, "last_seq_on", answered_once_the_fold_caught_up)
        placed = await Client(nc, prefix, read_your_writes=False).resume("a")
    finally:
        await go_on()  # whatever failed, the fold is not left paused
    assert asked[0] == written.seq  # refused on the fold's state, checked at the leader
    assert placed.actor_id == "a" and placed.seq > written.seq


# --- a retry after the placement's worker ended its life (found by an audit) -----------------------------------

V2 = version("v2")  # another runtime asset: its workers cannot load an image stamped V1


async def a_memory_restore(wb: Client, request_id: str = "R"):
    """w (V1) restores a's MEMORY image stamped V1, for `request_id`: the first answer."""
    await wb.register(worker("w", V1))
    await wb.create(actor("a"))
    await wb.resume("a")
    await wb.suspend("a", uri="s3://a/1")  # a MEMORY image stamped V1
    first = await wb.resume("a", request_id=request_id)
    assert (first.worker_id, first.fidelity) == ("w", PlacedFidelity.MEMORY)
    return first


async def refused(wb: Client, min_seq: int, code: ErrorCode = ErrorCode.FAILED_PRECONDITION) -> ContractError:
    """The retry of R, refused with `code` (naming request_id when FAILED_PRECONDITION)."""
    with pytest.raises(ContractError) as caught:
        await wb.resume("a", request_id="R", min_seq=min_seq)
    assert caught.value.code is code, caught.value
    if code is ErrorCode.FAILED_PRECONDITION:
        assert caught.value.field == "request_id", caught.value
    return caught.value


async def test_a_retry_after_its_worker_came_back_on_another_runtime_is_refused(stack, nc, prefix):
    """resume R restores a MEMORY image stamped V1 on w, and its reply is lost. w is removed (its
    machine replaced: the snapshotter releases the actor, SUSPENDED from the same image) and
    registers again, a new life, on V2 only. Retried, R must not be answered with its first
    placement: the caller would send the V1 image to w, which cannot load it now. It is refused,
    FAILED_PRECONDITION naming request_id, nothing written; a new request places the actor where
    its image can go (before: the first answer, a MEMORY restore on w of the V1 image)."""
    wb = Client(nc, prefix)
    await a_memory_restore(wb)  # its reply lost, say
    removed = await wb.remove("w", reason="machine replaced")
    await wait_for(nc, prefix, lambda e: isinstance(e, ActorReleased) and e.reason is ReleaseReason.WORKER_REMOVED,
                   after=removed.seq)
    again = await wb.register(worker("w", V2))
    before = await last_seq(nc, prefix)
    error = await refused(wb, again.seq)
    assert "worker w was removed since, and registered again" in error.message
    assert await last_seq(nc, prefix) == before  # nothing written
    placed = await wb.resume("a", request_id="R2")
    assert (placed.worker_id, placed.fidelity) == ("w", PlacedFidelity.VOLUMES)  # the memory left behind
    assert placed.fallback is not None and placed.fallback.reason is FallbackReason.NO_COMPATIBLE_WORKER


async def test_a_retry_at_a_replica_behind_the_worker_s_removal_waits_for_it(stack, stalled, nc, prefix):
    """The same before the release is written (the snapshotter down), at a replica whose fold has not
    read the removal: the actor's own subject has not moved, so only the worker's booking subject,
    which every registry write fences, says the placement's life ended. The replica waits for its
    fold to have that subject as the stream leader has it, and refuses (before: it answered the
    first placement at once, from a fold behind the removal)."""
    wb = Client(nc, prefix)
    await wb.register(worker("w", V1))
    await wb.create(actor("a"))
    first = await wb.resume("a", request_id="R")
    snapshotter = next(s for s in stack.services if type(s).__name__ == "SnapshotterService")
    await snapshotter.stop()  # no release of the removed worker's actors from here on
    await stalled.fold.wait(await last_seq(nc, prefix), 10)
    assert stalled.projection.actors["a"].worker.worker_id == first.worker_id
    waiting = catching_up(stalled)
    async with stalled.fold.paused():
        await wb.remove("w", reason="machine replaced")
        await wb.register(worker("w", V2))
        retry = asyncio.create_task(stalled.resume("a", ResumeActor(request_id="R")))
        noticed = asyncio.ensure_future(waiting.wait())
        await asyncio.wait({retry, noticed}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        noticed.cancel()
        assert not retry.done(), retry.result()  # answered from a fold behind the removal
        assert waiting.is_set()
    with pytest.raises(ContractError) as refused:
        await asyncio.wait_for(retry, 10)
    assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "request_id")


async def test_a_retry_in_the_same_life_of_its_worker_is_answered_with_the_first_placement(stack, nc, prefix):
    """A registration that changes the worker within its life (its labels) does not end the placements
    made on it: a retry is answered as before, with the first placement."""
    wb = Client(nc, prefix)
    await wb.register(worker("w", V1))
    await wb.create(actor("a"))
    first = await wb.resume("a", request_id="R")
    updated = await wb.register(worker("w", V1, labels={"rack": "r2"}))
    assert await wb.resume("a", request_id="R", min_seq=updated.seq) == first


async def test_a_retry_after_its_worker_dropped_the_runtime_it_pins_is_refused(stack, nc, prefix):
    """The placement R made is still in force (the actor RUNNING on w), and w registers again in the same
    life on V2 only (RuntimeChanged). Retried, R would send the V1 image to a worker that cannot load it
    (before: answered, leaving it to the worker to refuse; docs/contract.md). Refused, naming what keeps
    the actor on w; nothing written."""
    wb = Client(nc, prefix)
    await a_memory_restore(wb)
    changed = await wb.register(worker("w", V2))
    assert changed.outcome.value == "RUNTIME_CHANGED"
    before = await last_seq(nc, prefix)
    error = await refused(wb, changed.seq)
    assert "no longer runs the runtime the placement pins" in error.message
    assert "stays RUNNING on w" in error.message
    assert await last_seq(nc, prefix) == before


async def test_a_retry_after_the_placement_ended_and_its_worker_dropped_the_runtime_is_refused(stack, nc, prefix):
    """The same after the actor was suspended (the placement ended): refused, the caller told to resume with
    a new request id, which restores the new image where it loads (found by a review)."""
    wb = Client(nc, prefix)
    await a_memory_restore(wb)
    await wb.suspend("a", uri="s3://a/2")
    changed = await wb.register(worker("w", V2))
    error = await refused(wb, changed.seq)
    assert "Resume with a new request_id" in error.message
    placed = await wb.resume("a", request_id="R2")
    assert placed.fidelity is PlacedFidelity.VOLUMES


async def test_a_retry_after_its_worker_moved_to_another_node_is_refused(stack, nc, prefix):
    """A registration that moves the worker to another node (WorkerUpdated, the same life): the placement
    named the node its image is on, or the machine it ran on; refused."""
    wb = Client(nc, prefix)
    await a_memory_restore(wb)
    moved = await wb.register(worker("w", V1, node="node-elsewhere"))
    error = await refused(wb, moved.seq)
    assert "on node node-elsewhere now" in error.message


async def unread(writer, what: str) -> int:
    """`what` happens to w in an event this scheduler cannot read (with its fence, as every registry write
    has); the stream sequence of the fence."""
    return await asyncio.to_thread(writer.write, NewerWorkerEvent(at=AT, worker_id="w", what=what),
                                   WorkerFenced(at=AT, worker_id="w", event="NewerWorkerEvent"))


async def retired(writer) -> int:
    """w's life ended by a newer registry."""
    return await unread(writer, "removed: machine replaced")


async def test_a_retry_after_an_unread_removal_and_a_new_registration_is_refused(stack, writer, nc, prefix):
    """A newer registry ends w's life in an event this scheduler cannot read, and w registers again, a new
    life (the registry writes a WorkerRegistered only to begin one), on V2 only. The fold took the unread
    event for a drain and the registration for one "without a removal", so the retry of R was answered
    with its first placement, the V1 image sent to a worker on V2 (found by a review). Each
    WorkerRegistered now begins a life."""
    wb = Client(nc, prefix)
    await a_memory_restore(wb)
    await retired(writer)
    anew = worker("w", V2)
    again = await asyncio.to_thread(
        writer.write,
        WorkerRegistered(at=AT, worker_id="w", node=anew.node, capacity=anew.capacity, labels=dict(anew.labels),
                         sandbox_classes=canonical_classes(anew.sandbox_classes)),
        WorkerFenced(at=AT, worker_id="w", event="WorkerRegistered"))
    error = await refused(wb, again)
    assert "registered again" in error.message


async def test_a_retry_after_an_unread_message_of_its_worker_is_left_to_a_replica_that_reads_it(
        stack, writer, nc, prefix):
    """A message of w's history after the placement that this scheduler cannot read may have ended w's
    life: UNAVAILABLE (a replica of a newer version can tell), as for an actor's unread message."""
    wb = Client(nc, prefix)
    await a_memory_restore(wb)
    error = await refused(Client(nc, prefix, attempts=1), await retired(writer), ErrorCode.UNAVAILABLE)
    assert "cannot read" in error.message


async def test_a_retry_after_the_pinned_runtime_stopped_accepting_the_image_s_version_is_refused(stack, nc, prefix):
    """w's default V2 accepts V1 images through a compatible version (an edge), and R restored a V1 image
    on w that way. w then registers V2 without the edge (the same life, the same runtime): the runtime R
    pins still runs there, but no longer loads R's image. Refused."""
    wb = Client(nc, prefix)
    await wb.register(worker("w1", V1))
    await wb.create(actor("a"))
    await wb.resume("a")
    await wb.suspend("a", uri="s3://a/1")  # a MEMORY image stamped V1
    await wb.remove("w1")
    await wb.register(worker("w", runtime(V2, compatible=(V1,))))
    first = await wb.resume("a", request_id="R")
    assert (first.worker_id, first.fidelity, first.matched_version) == ("w", PlacedFidelity.MEMORY, V1)
    changed = await wb.register(worker("w", runtime(V2)))
    error = await refused(wb, changed.seq)
    assert "no longer accepts the image's version" in error.message


async def test_a_retry_of_a_placement_made_after_an_unread_change_of_its_worker_is_left_to_a_replica_that_reads_it(
        stack, writer, nc, prefix):
    """A newer registry changes w's runtimes to V2 in a message this scheduler cannot read (its fold keeps
    w's runtimes as V1, and takes no placement on w), and a newer scheduler places a on w under V2, the
    first answer of R. Retried here, R is judged on runtimes this replica knows are not w's: it must not
    be refused for good ("resume with a new request_id" / "stays RUNNING") when a replica that reads the
    message answers it. UNAVAILABLE, as for an unread message after the placement (found by a review: it was
    FAILED_PRECONDITION, "no longer runs the runtime the placement pins", though w runs exactly that)."""
    wb = Client(nc, prefix, attempts=1)
    await wb.register(worker("w", V1))
    await wb.create(actor("a"))
    await unread(writer, "runtimes changed: V2")  # (the same holds for a RuntimeChanged whose body it refuses)
    first = await asyncio.to_thread(writer.write, placed_event("a", "w", V2, request_id="R"),
                                    booked_event("w", "a", request_id="R"))
    await refused(wb, first, ErrorCode.UNAVAILABLE)


async def test_a_retry_on_a_worker_whose_current_life_began_unread_is_left_to_a_replica_that_reads_it(
        stack, writer, nc, prefix):
    """w is removed (read here), then registers again in a message this scheduler cannot read (a newer
    registry's), and a newer scheduler places a on w, the first answer of R. This fold has no w at all, but
    not because w's life ended after the placement: it cannot read the registration that began it. Retried
    here, R must not be refused for good ("worker w was removed since") when a replica that reads the
    message answers it: UNAVAILABLE, as for any other unread message of the worker's life."""
    wb = Client(nc, prefix, attempts=1)
    await wb.register(worker("w", V1))
    await wb.create(actor("a"))
    await wb.remove("w")
    await unread(writer, "registered: a new life")  # (or a WorkerRegistered whose body it refuses)
    first = await asyncio.to_thread(writer.write, placed_event("a", "w", V1, request_id="R"),
                                    booked_event("w", "a", request_id="R"))
    await refused(wb, first, ErrorCode.UNAVAILABLE)


async def test_a_refusal_after_an_unread_message_of_the_worker_s_last_life_is_for_good(stack, writer, nc, prefix):
    """An unread message matters only in the life it came in: w's life ends in a message this scheduler cannot
    read, w registers again (read here: a new life), R restores a's V1 image there, and w then drops V1 (read
    here). The retry of R is refused for good, FAILED_PRECONDITION, not left to another replica: nothing this
    fold cannot read came in w's current life."""
    wb = Client(nc, prefix, attempts=1)
    await wb.register(worker("w", V1))
    await wb.create(actor("a"))
    await wb.resume("a")
    await wb.suspend("a", uri="s3://a/1")  # a MEMORY image stamped V1
    await retired(writer)
    anew = worker("w", V1)
    await asyncio.to_thread(
        writer.write,
        WorkerRegistered(at=AT, worker_id="w", node=anew.node, capacity=anew.capacity, labels=dict(anew.labels),
                         sandbox_classes=canonical_classes(anew.sandbox_classes)),
        WorkerFenced(at=AT, worker_id="w", event="WorkerRegistered"))
    first = await wb.resume("a", request_id="R")
    assert (first.worker_id, first.fidelity) == ("w", PlacedFidelity.MEMORY)
    dropped = worker("w", V2)
    changed = await asyncio.to_thread(
        writer.write,
        RuntimeChanged(at=AT, worker_id="w", sandbox_classes=canonical_classes(dropped.sandbox_classes),
                       previous=canonical_classes(anew.sandbox_classes)),
        WorkerFenced(at=AT, worker_id="w", event="RuntimeChanged"))
    error = await refused(wb, changed)
    assert "no longer runs the runtime the placement pins" in error.message


async def test_a_last_life_placement_folded_while_the_resume_waits_does_not_answer_the_next_life(
        stalled, nc, prefix):
    """Request ids are scoped to one life. A resume R of the actor's new life reaches a replica whose
    fold has not even folded the last life's placement of R yet (the caller sent no min_seq). Its job
    waits for the committer (an append in flight, a stall); meanwhile the fold meets the last life's
    placement of R (the committer's `placed` listener notes it for the waiting job), the stop and the
    new creation. The job is decided in the new life: it was answered with the last life's
    placement (`Committer._answered_by_log` did not check the life, as `_cached` does with
    `life_started`, and `_current` passes, since the fold has caught up by then; an audit, 2026-12-04)."""
    wb = Client(nc, prefix)
    await wb.register(worker("w", V1, cpu=64000, mem=65536))
    await wb.create(actor("a"))
    await stalled.fold.wait(await last_seq(nc, prefix), 10)
    async with stalled.committer.commits_held():  # its committer is busy (an append in flight, a stall)
        async with stalled.fold.paused():  # and its fold lags
            old = await wb.resume("a", request_id="R")  # the last life's placement of R, by the other replica
            await wb.stop("a")
            created = await wb.create(actor("a"))  # the next life
            answer = asyncio.create_task(stalled.resume("a", ResumeActor(request_id="R")))
            await asyncio.wait_for(stalled.committer.until_queued(1), 10)
        await stalled.fold.wait(await last_seq(nc, prefix), 10)  # it catches up while the job waits
    await refused_from_an_earlier_life(answer, created, old)  # it was answered with the last life's placement
    assert len(await placements(nc, prefix, "R")) == 1  # the last life's alone


async def test_a_last_life_cold_boot_does_not_answer_a_next_life_whose_floor_is_memory(stalled, nc, prefix):
    """The same race with a different body: the last life cold-booted under R (min_fidelity ROOTFS);
    the next life is created from a golden MEMORY image with min_fidelity MEMORY. Its resume R, at a
    replica that folds the last life's placement while the job waits, restores the golden image; it
    was answered RUN/NONE, a placement below the floor of the life it answers (rule 4a)."""
    wb = Client(nc, prefix)
    await wb.register(worker("w", V1, cpu=64000, mem=65536))
    await wb.create(actor("a"))
    await stalled.fold.wait(await last_seq(nc, prefix), 10)
    async with stalled.committer.commits_held():
        async with stalled.fold.paused():
            old = await wb.resume("a", request_id="R")
            assert old.fidelity is PlacedFidelity.NONE
            await wb.stop("a")
            created = await wb.create(actor("a", min_fidelity=Fidelity.MEMORY, golden_snapshot=golden(V1)))
            answer = asyncio.create_task(stalled.resume("a", ResumeActor(request_id="R")))
            await asyncio.wait_for(stalled.committer.until_queued(1), 10)
        await stalled.fold.wait(await last_seq(nc, prefix), 10)
    # it was answered RUN/NONE (the last life's placement) for a life whose min_fidelity is MEMORY
    await refused_from_an_earlier_life(answer, created, old)
    placed = await Client(nc, prefix).resume("a", request_id="R2")  # a resume of this life: its own id
    assert placed.fidelity is PlacedFidelity.MEMORY


async def refused_from_an_earlier_life(answer: asyncio.Task, created, old) -> None:
    """`answer` (a resume R of the life `created` began) is refused as an id the last life used,
    not answered with the last life's placement `old`, nor placed."""
    with pytest.raises(ContractError) as refused:
        placed = await asyncio.wait_for(answer, 20)
        assert placed != old, "the next life's resume R was answered with the last life's placement of R"
    assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "request_id")
    assert "was used in an earlier life of actor 'a': a resume made for that life" in refused.value.message
    assert created.seq > old.seq


def covering(request_id: str) -> list[str]:
    """Request ids, none of them `request_id`, that set its three bits of the actor's filter of
    pushed-out ids between them: pushed out, they make the filter say it may have been too."""
    from services.scheduler.records import _pushed_out_bits, request_hash

    wanted = _pushed_out_bits(request_hash(request_id))
    found, i = [], 0
    while wanted:
        candidate = f"cover-{i}"
        bits = _pushed_out_bits(request_hash(candidate))
        if bits & wanted:
            found.append(candidate)
            wanted &= ~bits
        i += 1
    return found


@pytest.mark.parametrize("old_seq", ["within", "past"], ids=["old-seq-within-the-new-log", "old-seq-past-its-end"])
async def test_a_reply_cache_entry_of_a_stream_made_again_does_not_answer_its_new_log(nats_url, nc, prefix, old_seq):
    """The reply cache outlives a stream deleted and made again, whose sequences start over. A
    resume R pushed out of an actor's recent placements in the old log left R's sequence there;
    in the new log R is new, but the filter may say it was pushed out (here: ids that cover its
    bits, pushed out). It is placed anew: it was answered from whatever the new log holds at the
    old sequence (an audit, 2026-12-04); and where the new log does not reach that sequence, it
    is not refused UNAVAILABLE for as long as the entry lives."""
    from tests.factories import created as created_event, publish_events
    from events.subjects import stream_name
    from warmboot.runner import SERVICES, start_services

    from tests.factories import SILENT_TTL_S

    async def cycle(wb: Client, request_id: str, n: int) -> Any:
        placed = await wb.resume("a", request_id=request_id)
        await wb.suspend("a", uri=f"s3://a/{n}")
        return placed

    options = {"registry": {"ttl_s": SILENT_TTL_S}}
    wb = Client(nc, prefix)
    async with AsyncExitStack() as exits:
        await start_services(exits, list(SERVICES), nats_url, prefix, options=options)
        await wb.register(worker("w", V1, cpu=64000, mem=65536))
        await wb.create(actor("a"))
        if old_seq == "past":  # R's placement far along the old log
            await publish_events(nc, prefix, [created_event(f"pad-{i}") for i in range(200)], {})
            wb = Client(nc, prefix)
        await cycle(wb, "R", 0)
        for i in range(RECENT_PLACEMENTS):  # R pushed out: its sequence kept in the reply cache
            await cycle(wb, f"old-{i}", i + 1)
    await nc.jetstream().delete_stream(stream_name(prefix))
    async with AsyncExitStack() as exits:
        await start_services(exits, list(SERVICES), nats_url, prefix, options=options)
        wb = Client(nc, prefix)  # a new client: the one before waits for sequences of the old log
        await wb.register(worker("w", V1, cpu=64000, mem=65536))
        created = await wb.create(actor("a"))
        cover = covering("R")
        for n, request_id in enumerate(cover + [f"new-{i}" for i in range(RECENT_PLACEMENTS)]):
            await cycle(wb, request_id, n)
        placed = await wb.resume("a", request_id="R")
        in_log = await placements(nc, prefix, "R")
        assert [seq for seq, _ in in_log] == [placed.seq - 1], (placed, in_log)  # placed now, with its booking
        assert placed.seq > created.seq


async def test_a_resume_whose_ack_was_lost_is_answered_by_its_placement_after_another_write(stack, nc, prefix):
    """A resume without a request_id (optional in the contract): its group commit is stored, the
    ack lost (a time-out, as in a leader election), and before the store's retry looks, the
    registry drains the worker (a WorkerFenced on the booking subject the placement wrote). The
    retry finds the batch where it landed and answers with it. It was refused FAILED_PRECONDITION
    ("RUNNING", by its own placement) while its ActorPlaced and WorkerBooked were in the log: the
    store knew the batch only as its subjects' last messages (an audit, 2026-12-04)."""
    import json

    import nats.errors

    from events.codec import encode

    wb = Client(nc, prefix)
    await wb.register(worker("w", V1, cpu=64000, mem=65536))
    await wb.create(actor("a"))
    scheduler = next(s for s in stack.services if isinstance(s, SchedulerService))
    stream = scheduler.store.recorder.stream
    real_send = stream._send
    lost = asyncio.Event()

    async def send(batch, timeout):
        seq = await real_send(batch, timeout)
        if not lost.is_set() and any(o.subject.endswith(".ev.actor.a") for o in batch.outs):
            lost.set()
            await wb.drain("w", reason="maintenance")  # another writer, before the retry looks
            raise nats.errors.TimeoutError  # the ack of a stored batch is lost
        return seq

    stream._send = send
    reply = await nc.request(f"{prefix}.scheduler.resume.a", encode(ResumeActor()), timeout=30)
    body = json.loads(reply.data)
    placed = [(s, e) for s, e in await read_log(nc, prefix) if isinstance(e, ActorPlaced) and e.actor_id == "a"]
    assert lost.is_set() and len(placed) == 1  # the placement is in the log, once
    assert "error" not in body, f"refused although its placement was written at {placed[0][0]}: {body}"
    assert (body["worker_id"], body["seq"]) == ("w", placed[0][0] + 1)  # its answer: the seq of its booking


@pytest.mark.parametrize("change", ["drop-restorable", "remove-and-register-again", "drop-edge"])
async def test_a_memory_restore_decided_before_its_worker_stopped_accepting_the_stamp_is_not_committed(
        stack, stalled, nc, prefix, change):
    """An audit's probe (found safe, kept as a guard): a replica decides a MEMORY restore of a V1 image
    on w from a fold that has not read w's change (its restorable V1 dropped; w removed and registered
    again on V2; the edge that accepted V1 dropped), and appends after the change is in the log. The
    change's fence on w's booking subject refuses it; decided again on the fresh fold, the resume gives
    the memory up; and the log, read in stream order, holds no placement its worker could not take."""
    from warmboot.audit import Sink
    from warmboot.cli_common import replay

    wb = Client(nc, prefix)
    V2 = version("v2")
    await wb.register(worker("w", V1))
    await wb.create(actor("a"))
    await wb.resume("a")
    await wb.suspend("a", uri="s3://a/1")  # a MEMORY image, stamped with what a ran under
    if change == "drop-restorable":
        await wb.register(worker("w", V2, (runtime(V1),)))  # V2 that still restores V1
    elif change == "drop-edge":
        await wb.register(worker("w", runtime(V2, compatible=(V1,))))  # V2 that accepts V1 through an edge
    await stalled.fold.wait(await last_seq(nc, prefix), 10)
    pause = stalled.fold.paused()
    await pause.__aenter__()
    decided: list = []
    append = stalled.committer.append

    async def append_after_the_change(group):
        decided.append([c.placement for c in group])
        if len(decided) == 1:
            if change == "remove-and-register-again":
                await wb.remove("w", reason="machine replaced")
                await wb.register(worker("w", V2))
            elif change == "drop-restorable":
                await wb.register(worker("w", V2))
            else:
                await wb.register(worker("w", V2))  # the edge to V1 gone
            await pause.__aexit__(None, None, None)
        await append(group)

    stalled.committer.append = append_after_the_change
    try:
        answer = await asyncio.wait_for(stalled.resume("a", ResumeActor(request_id="R")), 30)
    except ContractError as error:
        answer = error
    first = decided[0][0]
    assert (first.worker_id, first.fidelity) == ("w", PlacedFidelity.MEMORY)  # decided on the old w
    assert not isinstance(answer, ContractError) or answer.code is not ErrorCode.INTERNAL, answer
    if not isinstance(answer, ContractError):
        assert answer.fidelity is not PlacedFidelity.MEMORY, answer
    sink = await replay(nc, prefix, Sink(verify=True), False)
    assert sink.violation is None, sink.violation


async def test_a_retry_refused_for_room_on_a_fold_behind_its_first_placement_gets_that_placement(stalled, nc, prefix):
    """R's first attempt placed a on w, the only worker, in the room b's suspend had just made, and
    its reply was lost. The retry reaches a replica whose fold has neither: w is full there, and
    "no room" (RESOURCE_EXHAUSTED) was the answer, the caller told its resume failed while the log
    has a RUNNING where it never started it (found by an audit). A refusal for want of room of a
    request with an id now stands only on the actor's history as the stream leader has it: the
    replica catches up and answers R's placement; nothing is written twice."""
    wb = Client(nc, prefix)
    await wb.register(worker("w", V1, mem=2048))  # room for one of them
    await wb.create(actor("a", mem=1536))
    await wb.create(actor("b", mem=1536))
    await wb.resume("b")
    await stalled.fold.wait(await last_seq(nc, prefix), 10)
    behind = catching_up(stalled)
    async with stalled.fold.paused():
        await wb.suspend("b", uri="s3://b/0")
        first = await wb.resume("a", request_id="R")
        retry = asyncio.create_task(stalled.resume("a", ResumeActor(request_id="R")))
        caught_up = asyncio.create_task(behind.wait())
        await asyncio.wait({retry, caught_up}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        assert not retry.done(), retry.exception()  # refused on its stale view: it catches up first
        assert caught_up.done()
    assert await asyncio.wait_for(retry, 20) == first
    assert [s for s, _ in await placements(nc, prefix, "R")] == [first.seq - 1]


def confirming(replica: SchedulerService, monkeypatch, n: int) -> asyncio.Event:
    """Set once `n` requests have asked `replica`'s fold to catch up with the stream's end (`Fold.current`)."""
    event, calls = asyncio.Event(), [0]
    current = type(replica.fold).current.__get__(replica.fold)  # the fold's own, not an earlier count's

    async def counted(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] >= n:
            event.set()
        await current(*args, **kwargs)

    monkeypatch.setattr(replica.fold, "current", counted)
    return event


async def test_retries_refused_for_room_at_once_on_a_fold_behind_get_their_placements_and_only_they(
        stack, stalled, nc, prefix, monkeypatch):
    """The same, many at once, as when a replica's fold stalls in a busy fleet: in each round 40 running
    actors are suspended and 40 others are placed by one replica in the room made, with request ids, their
    replies lost; their retries, and 40 resumes with new ids for which there is no room, reach a replica
    whose fold has none of it (paused). Each retry is answered its first placement, each new id is refused
    RESOURCE_EXHAUSTED and writes nothing, and the refusals rechecked together share their questions about
    the log's end (`Fold.current`). Without the recheck every retry was told "no room"."""
    wb = Client(nc, prefix)
    for i in range(4):
        await wb.register(worker(f"w{i}", V1, cpu=64000, mem=64 + 25 * 128))  # room for 25 each
    actors = [f"a{i:03d}" for i in range(200)]
    await asyncio.gather(*(wb.create(actor(a, cpu=1, mem=128)) for a in actors))
    # The fleet filled by 200 resumes at once, on two replicas, on a loaded machine: a reply lost to a time-out is
    # asked again with its request id (answered its first placement, if it made one), and a refusal for room
    # another replica's booking held at that moment (RESOURCE_EXHAUSTED, room coming free may place it) is asked
    # again, one at a time, until the room is used. The CI run of 41eff7b found 99 running.
    placed = await asyncio.gather(*(answered(lambda a=a: wb.resume(a, request_id=f"{a}-fill"), f"resume {a}")
                                    for a in actors))
    running = [a for a, got in zip(actors, placed) if not isinstance(got, ContractError)]
    refused = Counter((e.code.value, e.message[:160]) for e in placed if isinstance(e, ContractError))
    for a in [a for a in actors if a not in running]:
        if len(running) == 100:
            break
        if not isinstance(await answered(lambda a=a: wb.resume(a, request_id=f"{a}-fill-again"), f"resume {a}"),
                          ContractError):
            running.append(a)
    assert len(running) == 100, refused
    rng = random.Random(1)
    sent: dict[str, int] = {}  # request id -> placements it should have made (1: retried, 0: refused)
    for round_ in range(3):
        waiting = [a for a in actors if a not in running]
        gone, coming = rng.sample(running, 40), rng.sample(waiting, 40)
        others = rng.sample([a for a in waiting if a not in coming], 40)
        asked = stalled.fold.asked
        behind = confirming(stalled, monkeypatch, 80)
        async with stalled.fold.paused():
            await asyncio.gather(*(wb.suspend(a, uri=f"s3://{a}/{round_}") for a in gone))
            first = await asyncio.gather(*(wb.resume(a, request_id=f"{a}-{round_}") for a in coming))
            retries = [asyncio.create_task(stalled.resume(a, ResumeActor(request_id=f"{a}-{round_}")))
                       for a in coming]
            new = [asyncio.create_task(stalled.resume(a, ResumeActor(request_id=f"{a}-{round_}")))
                   for a in others]
            with suppress(asyncio.TimeoutError):  # every one refused on the paused fold asks where the log ends
                await asyncio.wait_for(behind.wait(), 10)
        assert await asyncio.gather(*retries) == first
        refused = await asyncio.gather(*new, return_exceptions=True)
        assert all(isinstance(e, ContractError) and e.code is ErrorCode.RESOURCE_EXHAUSTED for e in refused), refused
        assert stalled.fold.asked - asked <= 10, stalled.fold.asked - asked  # shared, not one per refusal
        running = [a for a in running if a not in gone] + coming
        sent.update({f"{a}-{round_}": 1 for a in coming} | {f"{a}-{round_}": 0 for a in others})
    made = Counter(e.request_id for _, e in await read_log(nc, prefix) if isinstance(e, ActorPlaced))
    assert {rid: made[rid] for rid in sent} == sent  # the retries placed nothing again, the refused nothing at all
