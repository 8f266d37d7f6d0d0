"""A resume names the actor's life it is for (`ResumeActor.life_seq`), and is refused in another.

A failover test (2026-12-06, a 3-node cluster whose members were stopped for 1 to 10 s) held
resumes in a stopped NATS server's buffers; their callers gave up, the actors were stopped and
created anew, and once the server resumed, the copies placed the actors' next lives: actors
RUNNING that nobody started. A resume that names a sequence of the life it is for (what its
create answered) is refused, FAILED_PRECONDITION field `life_seq`, nothing written, once the actor
has been created anew after it: decided on a fold that has the new life, or on one behind it
(its append then loses the race against the actor's history, and the decision is made again).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import msgspec
import pytest

from events.errors import ContractError, life_started_in
from events.schema import (ActorCreated, ActorPlaced, ActorStopped, Assignment, ErrorCode, ResumeActor, StopActor,
                           TemplateChanged, UpdateTemplate)
from tests.factories import actor, delivered, last_seq, read_log, version, worker
from tests.test_idempotency_faults import catching_up
from warmboot.client import Client

V1 = version("v1")
ROUNDS = int(os.environ.get("LIFE_ROUNDS", "3"))


def placed_in_a_life_not_named(log, named: dict[str, int]) -> list[str]:
    """Each placement whose request (`named`: request id -> the life_seq it sent) named a life that
    a creation after it ended, read in stream order."""
    born: dict[str, int] = {}
    faults = []
    for seq, event in log:
        if isinstance(event, ActorCreated):
            born[event.actor_id] = seq
        elif isinstance(event, ActorPlaced) and event.request_id in named:
            if named[event.request_id] < born[event.actor_id]:
                faults.append(f"{seq}: {event.actor_id} placed by {event.request_id}, which named life "
                              f"{named[event.request_id]}; its life began at {born[event.actor_id]}")
    return faults


def refused_for_its_life(error: ContractError, actor_id: str, named: int, started: int) -> bool:
    return (error.code, error.field) == (ErrorCode.FAILED_PRECONDITION, "life_seq") and error.message.startswith(
        f"actor {actor_id!r} was created anew at sequence {started}, after the life this resume names "
        f"(life_seq {named}): nothing placed")


@pytest.mark.parametrize("fold_first", [True, False], ids=["decided-on-the-new-life", "decided-on-the-last-life"])
async def test_a_resume_of_the_last_life_decided_late_is_refused(stalled, nc, prefix, fold_first):
    """A resume naming life 1 waits in a stalled replica while the actor is stopped and created anew
    through another. Decided on a fold that has life 2: refused at once. Decided on a fold still in
    life 1 (where it is a resume of a CREATED actor, placed on it): its append loses to the actor's
    history, the replica catches up and decides again: refused. Nothing placed either way."""
    wb = Client(nc, prefix)
    await wb.register(worker("w", V1, cpu=64000, mem=65536))
    born = (await wb.create(actor("a"))).seq
    await stalled.fold.wait(await last_seq(nc, prefix), 10)
    behind = catching_up(stalled)
    fold, commits = stalled.fold.paused(), stalled.committer.commits_held()
    await fold.__aenter__()
    await commits.__aenter__()
    try:
        late = asyncio.create_task(stalled.resume("a", ResumeActor(request_id="R", life_seq=born)))
        await stalled.committer.until_queued(1)
        await wb.stop("a")
        reborn = (await wb.create(actor("a"))).seq  # life 2
    finally:
        if fold_first:  # the fold has life 2 before the committer decides
            await fold.__aexit__(None, None, None)
            await stalled.fold.wait(await last_seq(nc, prefix), 10)
            await commits.__aexit__(None, None, None)
        else:  # decided on life 1; its append loses, and it catches up with the actor's history
            await commits.__aexit__(None, None, None)
            await asyncio.wait_for(behind.wait(), 10)
            await fold.__aexit__(None, None, None)
    with pytest.raises(ContractError) as refused:
        await asyncio.wait_for(late, 20)
    assert refused_for_its_life(refused.value, "a", born, reborn), refused.value
    assert not [e for _, e in await read_log(nc, prefix) if isinstance(e, ActorPlaced)]
    assert (await wb.resume("a", request_id="R2")).worker_id == "w"  # life 2's own resume


async def outcome(call) -> object:
    """What a request came to: its answer, or the contract error it was refused with."""
    try:
        return await call
    except ContractError as error:
        return error


async def test_resumes_of_last_lives_racing_new_ones_on_three_replicas_place_only_their_own(
        stack, nc, prefix, replicas):
    """Three scheduler replicas, requests without min_seq (a replica may be behind any of them), 50
    actors, several rounds. Each actor is stopped and created anew while copies of resumes naming its
    last life arrive: sent as the stop is, after it, and after the new creation; then its new life is
    resumed. From the log in stream order: no placement in a life its request did not name. Every
    copy sent after the new creation was answered is refused for its life, and every new life's
    resume places the actor (no copy took it)."""
    for _ in range(2):
        await replicas(metrics=False)
    wb = Client(nc, prefix, read_your_writes=False, fence_resumes=False)  # each life named below
    for i in range(4):
        await wb.register(worker(f"w{i}", V1, cpu=256000, mem=262144))
    actors = [f"a{i}" for i in range(50)]
    lives = dict(zip(actors, [c.seq for c in await asyncio.gather(*(wb.create(actor(a)) for a in actors))]))
    named: dict[str, int] = {}

    def copy(a: str, round_: int, when: str, k: int) -> asyncio.Task:
        rid = f"{a}-{round_}-{when}-{k}"
        named[rid] = lives[a]
        return asyncio.create_task(outcome(wb.resume(a, request_id=rid, life_seq=lives[a])))

    async def churn(a: str, round_: int) -> tuple[list, list, object]:
        before = [copy(a, round_, "before", k) for k in range(2)]
        await wb.stop(a)
        during = [copy(a, round_, "during", k) for k in range(2)]
        born = (await wb.create(actor(a))).seq
        after = [copy(a, round_, "after", k) for k in range(2)]
        rid = f"{a}-{round_}-new"
        named[rid] = born
        new = await outcome(wb.resume(a, request_id=rid, life_seq=born))
        return await asyncio.gather(*before, *during), (born, await asyncio.gather(*after)), new

    refused_after = 0
    for round_ in range(ROUNDS):
        results = await asyncio.gather(*(churn(a, round_) for a in actors))
        for a, (early, (born, late), new) in zip(actors, results):
            assert not isinstance(new, ContractError), (a, new)  # no copy of the last life took this one
            for answer in early:  # placed in the last life, or refused (RUNNING, STOPPED, or its life)
                assert not isinstance(answer, ContractError) or answer.code is ErrorCode.FAILED_PRECONDITION, answer
            for answer in late:
                assert isinstance(answer, ContractError) and refused_for_its_life(answer, a, lives[a], born), answer
                refused_after += 1
            lives[a] = born
    assert refused_after == len(actors) * 2 * ROUNDS
    faults = placed_in_a_life_not_named(await read_log(nc, prefix), named)
    assert not faults, "\n".join(faults[:20])


class Sent:
    """The resumes of one actor as they were sent (a subscription beside the scheduler's; or the
    requests of another `service` and `verb`): their bodies in order, and each message, to deliver a
    copy of it later."""

    def __init__(self, nc, prefix: str, actor_id: str, service: str = "scheduler", verb: str = "resume"):
        self.nc, self.subject = nc, f"{prefix}.{service}.{verb}.{actor_id}"

    async def __aenter__(self) -> "Sent":
        self.sub = await self.nc.subscribe(self.subject)
        return self

    async def __aexit__(self, *_) -> None:
        await self.sub.unsubscribe()

    async def next(self, n: int = 1) -> list:
        """The next `n` requests sent (each delivered to this subscription before it returns)."""
        return [await self.sub.next_msg(timeout=10) for _ in range(n)]

    @staticmethod
    def body(msg, request_type: type = ResumeActor) -> Any:
        return msgspec.json.decode(msg.data, type=request_type)


async def test_the_client_names_the_life_it_last_saw_and_sends_again_into_one_it_had_not_seen(
        stack, nc, prefix):
    """`Client.resume` without `life_seq` names the life of this client's last create or resume of the
    actor. Another caller stops the actor and creates it anew: the resume is refused, and since its
    caller is waiting (no late copy), the client sends it again, once, with the same request id,
    naming the life the refusal says began: it is placed, once. A copy of that second request, held
    past a further creation, is refused. A `life_seq` given is sent as it is and its refusal raised;
    a client made with `fence_resumes=False` names none; a client's own stop and create move it on."""
    orchestrator, other = Client(nc, prefix), Client(nc, prefix)
    unfenced = Client(nc, prefix, fence_resumes=False)
    await other.register(worker("w", V1, cpu=64000, mem=65536))
    born = (await orchestrator.create(actor("a"))).seq
    await other.stop("a")
    renewed = (await other.create(actor("a"))).seq  # life 2: the orchestrator has not seen it
    async with Sent(nc, prefix, "a") as sent:
        placed = await orchestrator.resume("a")
        first, second = await sent.next(2)
    assert (Sent.body(first).life_seq, Sent.body(second).life_seq) == (born, renewed)
    assert Sent.body(first).request_id == Sent.body(second).request_id
    assert placed.seq > renewed
    assert len([e for _, e in await read_log(nc, prefix) if isinstance(e, ActorPlaced)]) == 1

    await other.stop("a")
    again = (await other.create(actor("a"))).seq  # life 3
    before = await last_seq(nc, prefix)
    for copy in (first, second):  # copies of the two requests, delivered now: refused (life 2 placed their id)
        with pytest.raises(ContractError) as refused:
            await delivered(nc, copy, copy.data, Assignment)
        assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "request_id")
    assert await last_seq(nc, prefix) == before  # nothing written

    with pytest.raises(ContractError) as refused:  # given, it is sent as it is, once
        await unfenced.resume("a", life_seq=born)
    assert refused_for_its_life(refused.value, "a", born, again), refused.value
    async with Sent(nc, prefix, "a") as sent:
        await unfenced.resume("a")  # it names no life
        (named,) = await sent.next()
    assert Sent.body(named).life_seq is None
    await unfenced.suspend("a", uri="s3://a/3")

    await orchestrator.stop("a")  # its own stop and create: the life it names moves with them
    own = (await orchestrator.create(actor("a"))).seq
    async with Sent(nc, prefix, "a") as sent:
        await orchestrator.resume("a")
        (named,) = await sent.next()
    assert Sent.body(named).life_seq == own


async def test_a_life_past_the_end_of_the_log_is_unavailable_at_once_and_nothing_placed(stack, nc, prefix):
    """A `life_seq` is a sequence a reply gave, so the scheduler waits for it as for `min_seq`: one past
    the end of the log names no life (a typing error: `--life-seq 999999` was taken, and fenced nothing
    until the log got there, a user trial's finding). UNAVAILABLE, field life_seq, raised by the client
    without a retry (no retry brings it), nothing placed; the life the create answered is placed."""
    wb = Client(nc, prefix)
    await wb.register(worker("w", V1, cpu=64000, mem=65536))
    born = (await wb.create(actor("a"))).seq
    end = await last_seq(nc, prefix)
    with pytest.raises(ContractError) as refused:
        await wb.resume("a", life_seq=end + 1_000_000)
    assert (refused.value.code, refused.value.field) == (ErrorCode.UNAVAILABLE, "life_seq"), refused.value
    assert f"past the end of the log (its last is {end})" in refused.value.message, refused.value.message
    assert wb.retries == 0 and await last_seq(nc, prefix) == end  # raised at once; nothing written
    assert (await wb.resume("a", life_seq=born)).seq > end


async def test_the_client_names_the_life_in_a_stop_tag_revert_or_update_template_as_in_a_resume(
        stack, nc, prefix):
    """`Client.update_template`, `stop`, `tag` and `revert` name the actor's life as `resume` does (the
    snapshotter refuses one naming a life a creation has ended: a copy held somewhere, its caller
    gone). Another caller stops the actor and creates it anew: the update-template is refused for
    its life and, its caller waiting (no late copy), sent again once with the same request id, naming
    the life the refusal says began: the template changed once, in that life. A `life_seq` given is
    sent as it is and its refusal raised; a client made with `fence_lives=False` names none."""
    orchestrator, other = Client(nc, prefix), Client(nc, prefix)
    born = (await orchestrator.create(actor("a"))).seq
    await other.stop("a")
    renewed = (await other.create(actor("a"))).seq  # life 2: the orchestrator has not seen it
    async with Sent(nc, prefix, "a", "snapshotter", "update-template") as sent:
        changed = await orchestrator.update_template("a", "tpl-2")
        first, second = (Sent.body(m, UpdateTemplate) for m in await sent.next(2))
    assert (first.life_seq, second.life_seq) == (born, renewed) and first.request_id == second.request_id
    assert changed.seq > renewed
    assert [s for s, e in await read_log(nc, prefix) if isinstance(e, TemplateChanged)] == [changed.seq]

    before = await last_seq(nc, prefix)
    with pytest.raises(ContractError) as refused:  # given, it is sent as it is, once
        await orchestrator.stop("a", life_seq=born)
    assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "life_seq")
    assert refused.value.message.startswith(f"actor 'a' was created anew at sequence {renewed}, after the life this "
                                            f"stop names (life_seq {born}): nothing stopped"), refused.value
    assert await last_seq(nc, prefix) == before
    async with Sent(nc, prefix, "a", "snapshotter", "stop") as sent:
        stopped = await Client(nc, prefix, fence_lives=False).stop("a")  # it names no life
        (named,) = await sent.next()
    assert Sent.body(named, StopActor).life_seq is None and stopped.seq > before


async def test_a_stop_of_a_life_a_client_ended_does_not_end_the_life_it_created_since(stack, nc, prefix):
    """One client, two tasks (a review's finding). Task A's stop names life 1 and reaches the
    snapshotter only after the same client stopped the actor and created it anew: refused for its
    life and raised, not sent again into the client's own life 2 (a resume is: the test above), which
    lives on. A stop whose answer
    comes late, after the client created the actor anew, does not make it forget that life: the
    next request names it."""
    wb = Client(nc, prefix)
    born = (await wb.create(actor("a"))).seq
    held, release = answered_late(wb, "stop", before_sending=True, service="snapshotter")
    stale = asyncio.create_task(wb.stop("a"))  # names life 1
    await asyncio.wait_for(held.wait(), 10)
    del wb.request
    await wb.stop("a")
    reborn = (await wb.create(actor("a"))).seq  # this client's own life 2
    release.set()
    with pytest.raises(ContractError) as refused:
        await stale
    assert life_started_in(refused.value) == reborn and born < reborn
    assert [e for s, e in await read_log(nc, prefix) if isinstance(e, ActorStopped) and s > reborn] == []

    held, release = answered_late(wb, "stop", before_sending=False, service="snapshotter")
    first = asyncio.create_task(wb.stop("a"))  # life 2 stopped; its answer held
    await asyncio.wait_for(held.wait(), 10)
    del wb.request
    third = (await wb.create(actor("a"))).seq  # life 3
    release.set()
    assert (await first).seq < third
    async with Sent(nc, prefix, "a", "snapshotter", "update-template") as sent:
        await wb.update_template("a", "tpl-3")
        (named,) = await sent.next()
    assert Sent.body(named, UpdateTemplate).life_seq == third


def answered_late(client: Client, verb: str, *, before_sending: bool,
                  service: str = "scheduler") -> tuple[asyncio.Event, asyncio.Event]:
    """`client`'s `<service>.<verb>` requests held, until the second event is set: before they are sent
    (`before_sending`), or once answered (their reply delivered late); the first event is set when one
    is held."""
    held, release = asyncio.Event(), asyncio.Event()
    request = client.request

    async def late(to, called, *args, **kw):
        if (to, called) != (service, verb):
            return await request(to, called, *args, **kw)
        if before_sending:
            held.set()
            await release.wait()
            return await request(to, called, *args, **kw)
        try:
            return await request(to, called, *args, **kw)
        finally:
            held.set()
            await release.wait()

    client.request = late
    return held, release


async def test_a_late_answer_does_not_move_the_client_s_life_back(stack, nc, prefix):
    """One client, one actor, two tasks: a resume whose answer (a placement, or a refusal for its life)
    comes back only after the same client stopped the actor and created it anew. The late answer named
    an earlier life: the client's memory took it over the life it had just created (a review's finding;
    without `remember` keeping the later sequence, each part names the earlier life)."""
    wb, other = Client(nc, prefix), Client(nc, prefix)
    await wb.register(worker("w", V1, cpu=64000, mem=65536))
    await wb.create(actor("a"))
    held, release = answered_late(wb, "resume", before_sending=False)
    first = asyncio.create_task(wb.resume("a"))  # placed; its answer held
    await asyncio.wait_for(held.wait(), 10)
    await wb.stop("a")
    reborn = (await wb.create(actor("a"))).seq  # this client's own life 2
    release.set()
    assert (await first).seq < reborn
    del wb.request  # answered as sent again
    async with Sent(nc, prefix, "a") as sent:
        second = await wb.resume("a")
        (named,) = await sent.next()
    assert Sent.body(named).life_seq == reborn and second.seq > reborn  # life 2, not life 1's placement

    await wb.suspend("a", uri="s3://a/2")
    await other.stop("a")
    await other.create(actor("a"))  # life 3, by another caller
    held, release = answered_late(wb, "resume", before_sending=True)
    stale = asyncio.create_task(wb.resume("a"))  # it names life 2 (its resume): refused once it is sent
    await asyncio.wait_for(held.wait(), 10)
    await wb.stop("a")
    own = (await wb.create(actor("a"))).seq  # life 4, this client's own
    async with Sent(nc, prefix, "a") as sent:
        release.set()
        placed = await stale  # refused for life 2, then sent again naming life 4, not life 3
        refused_once, again = await sent.next(2)
    assert (Sent.body(refused_once).life_seq, Sent.body(again).life_seq) == (second.seq, own)
    assert placed.seq > own


def test_the_creation_a_refusal_names_is_read_back_from_it():
    """`life_started_in` reads the sequence `created_anew_since` writes; any other error says nothing."""
    from events.errors import created_anew_since, precondition

    assert life_started_in(created_anew_since("a-1", 3, 912)) == 912
    assert life_started_in(created_anew_since("a-1", 3, 914, "update-template", "nothing changed")) == 914
    assert life_started_in(precondition("actor 'a' is RUNNING on worker 'w'", "actor_id")) is None
    assert life_started_in(precondition("was created anew at sequence 7, after the life this resume names",
                                         "request_id")) is None
    assert life_started_in(precondition("another version's words", "life_seq")) is None
