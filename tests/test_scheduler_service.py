"""The scheduler over a real bus: resume, explain and fragmentation as nats.micro
endpoints, commits with optimistic concurrency across replicas, idempotent retries,
a replica rebuilt from the log.

Worker and actor events are written straight through the event store (the registry
and the snapshotter are other services); the scheduler's own writes are what is
under test. No sleeps: every wait is on a reply, a stream sequence or an event.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import nats
import pytest
from prometheus_client import REGISTRY

from eventsourcing.persistence import IntegrityError

from events.codec import decode_event, encode
from events.errors import ContractError, unavailable
from events.compat import compat_key
from events.runtime_id import short_id
from events.schema import (
    Action,
    ActorPlaced,
    ActorReleased,
    ActorRuntime,
    Assignment,
    CompatVersion,
    ErrorCode,
    Event,
    Explanation,
    ExplainResume,
    FallbackReason,
    Fidelity,
    Fragmentation,
    FragmentationQuery,
    Location,
    PlacedFidelity,
    ReleaseReason,
    Resources,
    ResumeActor,
    Snapshot,
    SnapshotOrigin,
    SnapshotTaken,
    WorkerBooked,
    WorkerDrained,
    WorkerRegistered,
)
from events.subjects import service_subject, stream_name
from services.endpoints import call
from services.replies import ReplyCache
from services.scheduler.records import WORKER_RESERVE_MIB
from services.scheduler.decide import decide
from services.scheduler.committer import Job
from tests.factories import (
    AT,
    CLASS as CLS,
    booked,
    created,
    entry,
    last_seq,
    read_log,
    registered,
    released,
    runtime,
    snapshot,
    taken,
    version,
)

V1, V2 = version("1"), version("2")


def suspended(actor_id: str, stamped: CompatVersion, fidelity=Fidelity.MEMORY) -> SnapshotTaken:
    return taken(snapshot(actor_id, stamped, snapshot_id=f"{actor_id}-snap", fidelity=fidelity))


def subject(prefix: str, verb: str, actor_id: str | None = None) -> str:
    return service_subject(prefix, "scheduler", verb, actor_id)


async def resume(nc, prefix, actor_id, timeout=10.0, **fields) -> Assignment:
    return await call(nc, subject(prefix, "resume", actor_id), ResumeActor(**fields), Assignment, timeout=timeout)


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# --- resume, explain, fragmentation --------------------------------------------------------------------


async def test_resume_places_commits_and_answers_over_nats(nc, prefix, writer, replicas):
    await asyncio.to_thread(writer.write, registered("old", entry(V1)),
                            registered("new", entry(runtime(V2, overhead=32))))
    await asyncio.to_thread(writer.write, created("a"), suspended("a", V1))
    await asyncio.to_thread(writer.write, created("cold"))
    service = await replicas()
    placed_before = metric("warmboot_placements_total", sandbox_class=CLS, action="RESTORE", fidelity="MEMORY")

    a = await resume(nc, prefix, "a")
    assert (a.worker_id, a.action, a.fidelity, a.snapshot_id) == ("old", Action.RESTORE, PlacedFidelity.MEMORY, "a-snap")
    assert a.sandbox_runtime == ActorRuntime(sandbox_class=CLS, version=V1)
    events = dict(await read_log(nc, prefix))
    recorded = events[a.seq - 1]  # the reply's seq is the last event written: the booking marker
    assert isinstance(recorded, ActorPlaced) and recorded.worker_id == "old" and recorded.booked == a.booked
    assert isinstance(events[a.seq], WorkerBooked) and events[a.seq].worker_id == "old"
    assert max(events) == a.seq
    assert metric("warmboot_placements_total", sandbox_class=CLS, action="RESTORE", fidelity="MEMORY") == placed_before + 1

    with pytest.raises(ContractError) as running:
        await resume(nc, prefix, "a", min_seq=a.seq)
    assert running.value.code is ErrorCode.FAILED_PRECONDITION
    with pytest.raises(ContractError) as unknown:
        await resume(nc, prefix, "nobody")
    assert unknown.value.code is ErrorCode.NOT_FOUND

    cold = await resume(nc, prefix, "cold")
    assert cold.action is Action.RUN and cold.fidelity is PlacedFidelity.NONE and cold.snapshot_id is None

    frag = await call(nc, subject(prefix, "fragmentation"), FragmentationQuery(sandbox_class=CLS), Fragmentation)
    [gvisor] = frag.classes
    assert gvisor.workers == 2 and gvisor.stranded_snapshots == 0
    assert {r.version: r.workers_default for r in gvisor.runtimes} == {V1: 1, V2: 1}

    service.refresh_gauges()
    label = "v1 architecture=amd64,gvisor_asset_hash=2"
    runtime_id = short_id(compat_key(CLS, V2))  # the id the views print (`rt-...`)
    assert metric("warmboot_scheduler_workers", sandbox_class=CLS, runtime=label, runtime_id=runtime_id,
                  role="default") == 1
    assert metric("warmboot_scheduler_fold_seq") == service.projection.seq >= cold.seq


@pytest.fixture
async def costly_pages(writer, replicas, monkeypatch):
    """A replica whose fold holds a worker and an actor `a`, each page of `actor list` costing it 20 ms of
    its loop (the page function made that slow, as a fold of fleet size makes it); `READS_WAITING`, the
    test's to set."""
    import services.scheduler.service as scheduler_service

    await asyncio.to_thread(writer.write, registered("w", entry(V1)), created("a"))
    await replicas()
    page = scheduler_service.actor_page

    def costly(projection, request):
        time.sleep(0.02)  # the loop held, as a fleet-size page holds it
        return page(projection, request)

    monkeypatch.setattr(scheduler_service, "actor_page", costly)
    return scheduler_service


async def test_a_burst_of_read_only_answers_does_not_hold_a_resume_behind_it(nc, prefix, costly_pages, monkeypatch):
    """A page of `actor list` on a fold of fleet size costs the replica's loop tens of ms (bench/views.py:
    28 to 51 ms at 100,000 actors). A client's burst of them, up to 4,096 of each endpoint at once, all
    ready together, ran one after another before a resume that came after them took its next step:
    placements held for seconds. Here each page costs 20 ms of the loop (`costly_pages`); 100 pages are
    asked, then a resume, in that order on one connection.
    The replies, in the order they arrive: the resume is answered before most pages (it was answered
    after every one)."""
    from events.schema import ActorsQuery

    monkeypatch.setattr(costly_pages, "READS_WAITING", 1000)  # every page waits its turn (the next test: not)
    order: list[str] = []
    done = asyncio.Event()

    async def answered(msg) -> None:
        order.append(msg.subject.rsplit(".", 1)[1])
        if len(order) == 101:
            done.set()

    inbox = nc.new_inbox()
    await nc.subscribe(f"{inbox}.*", cb=answered)
    for n in range(100):
        await nc.publish(subject(prefix, "actors"), encode(ActorsQuery()), reply=f"{inbox}.page{n}")
    await nc.publish(subject(prefix, "resume", "a"), encode(ResumeActor()), reply=f"{inbox}.resume")
    await asyncio.wait_for(done.wait(), 60)
    assert sorted(order) == sorted([f"page{n}" for n in range(100)] + ["resume"])
    assert order.index("resume") < 60, order  # 11 or 12 here, of 100; 100 before


async def test_read_only_answers_past_those_waiting_their_turn_are_unavailable_at_once(nc, prefix, costly_pages,
                                                                                     monkeypatch):
    """At most `READS_WAITING` read-only answers wait their turn on a replica; one more is UNAVAILABLE at once
    (a client retries it), not answered after every pass before it, long after its client gave up. Here 4
    may wait and 30 pages of 20 ms each are asked at once: each gets a page or that refusal (5 pages here:
    the one computed and the 4 waiting), and the replica goes on answering."""
    from events.schema import ActorPage, ActorsQuery

    monkeypatch.setattr(costly_pages, "READS_WAITING", 4)
    answers = await asyncio.gather(*(call(nc, subject(prefix, "actors"), ActorsQuery(), ActorPage, timeout=30)
                                     for _ in range(30)), return_exceptions=True)
    refused = [a for a in answers if isinstance(a, ContractError)]
    pages = [a for a in answers if isinstance(a, ActorPage)]
    assert len(refused) + len(pages) == 30, answers
    assert 5 <= len(pages) < 30 and refused, (len(pages), len(refused))
    assert {(e.code, e.message) for e in refused} == {(ErrorCode.UNAVAILABLE, "4 read-only answers already wait "
                                                       "their turn on this scheduler replica; try again")}
    assert all([row.actor_id for row in p.actors] == ["a"] for p in pages)
    again = await call(nc, subject(prefix, "actors"), ActorsQuery(), ActorPage, timeout=30)
    assert [row.actor_id for row in again.actors] == ["a"]


async def test_fallback_is_committed_and_counted(nc, prefix, writer, replicas):
    await asyncio.to_thread(writer.write, registered("full", entry(V1), mem=512), registered("new", entry(V2)))
    await asyncio.to_thread(writer.write, created("a"), suspended("a", V1))
    await asyncio.to_thread(writer.write, created("strict", min_fidelity=Fidelity.MEMORY), suspended("strict", V1))
    await replicas()
    before = metric("warmboot_resume_fallbacks_total", sandbox_class=CLS, reason="NO_COMPATIBLE_WORKER")
    a = await resume(nc, prefix, "a")
    assert a.worker_id == "new" and a.fidelity is PlacedFidelity.VOLUMES
    assert a.fallback.reason is FallbackReason.NO_COMPATIBLE_WORKER
    assert a.sandbox_runtime == ActorRuntime(sandbox_class=CLS, version=V2)
    assert metric("warmboot_resume_fallbacks_total", sandbox_class=CLS, reason="NO_COMPATIBLE_WORKER") == before + 1
    with pytest.raises(ContractError) as strict:
        await resume(nc, prefix, "strict")
    assert strict.value.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "insufficient memory" in strict.value.message


async def test_explain_names_reasons_and_writes_nothing(nc, prefix, writer, replicas):
    await asyncio.to_thread(writer.write, registered("new", entry(V2)), registered("full", entry(V1), mem=512))
    await asyncio.to_thread(writer.write, registered("drained", entry(V1)), WorkerDrained(at=AT, worker_id="drained"))
    await asyncio.to_thread(writer.write, created("a"), suspended("a", V1))
    await replicas()
    before = await last_seq(nc, prefix)
    why = await call(nc, subject(prefix, "explain", "a"), ExplainResume(min_seq=before), Explanation)
    assert why.counts == {"runtime mismatch": 1, "insufficient memory": 1, "drained": 1}
    assert why.message.startswith("0/3 workers available: 1 drained, 1 insufficient memory, 1 runtime mismatch")
    assert why.decision.worker_id == "new" and why.decision.fallback.reason is FallbackReason.NO_COMPATIBLE_WORKER
    assert await last_seq(nc, prefix) == before
    with pytest.raises(ContractError) as missing:  # explain itself fails for an unknown actor
        await call(nc, subject(prefix, "explain", "ghost"), ExplainResume(), Explanation)
    assert missing.value.code is ErrorCode.NOT_FOUND
    assert await last_seq(nc, prefix) == before


async def test_min_seq_beyond_the_log_is_unavailable_after_the_deadline(nc, prefix, writer, replicas):
    await asyncio.to_thread(writer.write, registered("w", entry(V1)), created("a"))
    await replicas(catch_up_s=0.3)
    with pytest.raises(ContractError) as behind:
        await resume(nc, prefix, "a", min_seq=10_000)
    assert behind.value.code is ErrorCode.UNAVAILABLE


async def test_min_seq_past_the_end_of_the_log_is_unavailable_without_holding_a_slot_for_the_deadline(
        nc, prefix, writer, replicas):
    """Nothing will bring a sequence past the end of the log: 600 explains asking for one are
    answered UNAVAILABLE long before the replica's 60 s deadline, while a resume goes on."""
    await asyncio.to_thread(writer.write, registered("w", entry(V1)), created("a"))
    await replicas(catch_up_s=60)
    end = await last_seq(nc, prefix)
    asked = [asyncio.ensure_future(call(nc, subject(prefix, "explain", "a"), ExplainResume(min_seq=2**53),
                                        Explanation, timeout=20)) for _ in range(600)]
    placed = await resume(nc, prefix, "a", min_seq=end)
    answers = await asyncio.gather(*asked, return_exceptions=True)
    assert placed.worker_id == "w"
    assert {type(a) for a in answers} == {ContractError}
    assert {a.code for a in answers} == {ErrorCode.UNAVAILABLE}
    assert all("past the end of the log" in a.message for a in answers)  # its last: `end`, or the resume's
    assert {a.field for a in answers} == {"min_seq"}


async def test_a_replica_sees_events_written_after_it_started(nc, prefix, writer, replicas):
    await replicas()
    seq = await asyncio.to_thread(writer.write, registered("w", entry(V1)))
    seq = await asyncio.to_thread(writer.write, created("a"), suspended("a", V1))
    a = await resume(nc, prefix, "a", min_seq=seq)
    assert a.worker_id == "w" and a.fidelity is PlacedFidelity.MEMORY
    seq = await asyncio.to_thread(
        writer.write, released("a", "w", ReleaseReason.SUSPENDED)
    )
    again = await resume(nc, prefix, "a", min_seq=seq)
    assert again.worker_id == "w" and again.seq > a.seq


# --- group commits ------------------------------------------------------------------------------------


async def test_concurrent_resumes_share_appends(nc, prefix, writer, replicas):
    await asyncio.to_thread(writer.write, *[registered(f"w{i}", entry(V1)) for i in range(10)])
    await asyncio.to_thread(writer.write, *[created(f"a{j:02d}", cpu=100, mem=256) for j in range(60)])
    service = await replicas()
    appends, appended = (metric(f"warmboot_scheduler_commit_group_placements_{n}") for n in ("count", "sum"))
    placed = await asyncio.gather(*(resume(nc, prefix, f"a{j:02d}") for j in range(60)))
    assert service.commits == 60 and service.committer.groups < 60
    # what an operator reads of it: appends made, and the placements they carried (none refused here)
    assert metric("warmboot_scheduler_commit_group_placements_count") - appends == service.committer.groups
    assert metric("warmboot_scheduler_commit_group_placements_sum") - appended == 60
    assert sum(check_log(await read_log(nc, prefix)).values()) == 60
    assert len({a.seq for a in placed}) == 60


async def test_the_commits_append_on_the_replica_s_own_loop_and_a_stop_releases_that_connection(
        nc, prefix, writer, replicas):
    """The replica's store runs its connection on the replica's loop (`links_on`): a group commit's
    append crosses no thread; the replica's stop releases that connection with the store (closed
    once no other store of the loop holds it)."""
    await asyncio.to_thread(writer.write, registered("w1", entry(V1)), created("a1"))
    service = await replicas()
    link = service.store.recorder.link
    assert link.loop is asyncio.get_running_loop() and link.thread is None
    assert (await resume(nc, prefix, "a1")).worker_id == "w1"
    held = link.refs  # other replicas on this loop with the same options share the link
    await service.stop()
    assert link.refs == held - 1
    assert link.closed == (link.refs == 0) and link.nc.is_closed == link.closed


async def test_a_refused_group_keeps_the_placements_that_are_still_valid(nc, prefix, writer, replicas):
    await asyncio.to_thread(writer.write, registered("w1", entry(V1), labels={"slot": "1"}),
                            registered("w2", entry(V1), labels={"slot": "2"}))
    await asyncio.to_thread(writer.write, created("x", selectors={"slot": "1"}), created("y", selectors={"slot": "2"}))
    service = await replicas()
    p = service.projection
    on_w1, on_w2 = decide(p, "x", None, p.seq), decide(p, "y", None, p.seq)
    loop = asyncio.get_running_loop()
    x, y = (service.committer.prepare(placed, Job(placed.actor_id, None, None, loop.create_future()))
            for placed in (on_w1, on_w2))
    # another replica books w2 after y was decided
    seq = await asyncio.to_thread(writer.write, booked("w2", "elsewhere"))
    await service.fold.wait(seq, 5)
    await service.committer.append([x, y])
    with pytest.raises(IntegrityError):
        await y.result
    placed_x, x_seq = await x.result  # committed by the next group, without deciding again
    assert placed_x is on_w1
    events = dict(await read_log(nc, prefix))
    assert isinstance(events[x_seq], WorkerBooked) and events[x_seq - 1].actor_id == "x"
    assert [e.actor_id for e in events.values() if isinstance(e, ActorPlaced)] == ["x"]


async def test_a_stop_ends_the_committer_when_a_request_swallowed_its_cancellation(nc, prefix, writer, replicas):
    """On Python 3.11 `asyncio.wait_for` (every nats-py request, Fold.wait) returns its result
    instead of raising when it completes as its task is cancelled. A committer cancelled that
    way in the middle of an append must still end, or the replica's stop waits for ever."""
    await asyncio.to_thread(writer.write, registered("w1", entry(V1)), created("x"))
    service = await replicas()
    committer = service.committer
    appending = asyncio.Event()

    async def swallowing(group) -> None:
        appending.set()
        try:
            await asyncio.Event().wait()  # the stop's cancellation lands here
        except asyncio.CancelledError:
            pass  # ... and is lost, as wait_for loses it
        committer._fail(group, unavailable("the append was cut short"))

    committer.append = swallowing
    pending = asyncio.create_task(resume(nc, prefix, "x"))
    await asyncio.wait_for(appending.wait(), 10)
    await asyncio.wait_for(committer.stop(), 10)  # it hung here: the loop waited for the next resume
    with pytest.raises(ContractError) as refused:
        await pending
    assert refused.value.code is ErrorCode.UNAVAILABLE


# --- idempotency ----------------------------------------------------------------------------------------


async def test_a_lost_reply_retried_with_its_request_id_gives_one_placement(nc, prefix, writer, replicas):
    await asyncio.to_thread(writer.write, *[registered(f"w{i}", entry(V1)) for i in range(4)])
    await asyncio.to_thread(writer.write, created("a"), created("b"))
    first = await replicas()
    second = await replicas()

    # The request is served but its reply goes nowhere.
    js = nc.jetstream()
    seen = asyncio.get_running_loop().create_future()

    async def on_placed(msg):
        if isinstance(decode_event(msg.data), ActorPlaced) and not seen.done():
            seen.set_result(msg.metadata.sequence.stream)

    sub = await js.subscribe(f"{prefix}.ev.actor.a", stream=stream_name(prefix), cb=on_placed, ordered_consumer=True)
    await nc.publish(subject(prefix, "resume", "a"), encode(ResumeActor(request_id="req-a")), reply="_INBOX.nobody.listens")
    placed_seq = await asyncio.wait_for(seen, 10)
    await sub.unsubscribe()

    retry = await resume(nc, prefix, "a", request_id="req-a")
    assert retry.seq == placed_seq + 1  # the WorkerBooked written with it
    again = await resume(nc, prefix, "a", request_id="req-a")
    assert again == retry

    # Lost reply *and* lost cache entry: the log itself answers, on whichever replica.
    b = await resume(nc, prefix, "b", request_id="req-b")
    cache = ReplyCache(nc, prefix)
    await cache.start()
    for service in (first, second):
        await cache.kv.purge(ReplyCache.key("resume.b", "req-b"))
        await service.fold.wait(b.seq, 5)
        assert await service.resume("b", ResumeActor(request_id="req-b")) == b
    assert await resume(nc, prefix, "b", request_id="req-b") == b

    placed = [e for _, e in await read_log(nc, prefix) if isinstance(e, ActorPlaced)]
    assert sorted(e.actor_id for e in placed) == ["a", "b"]
    # a different request for a placed actor is refused, not placed twice
    with pytest.raises(ContractError) as twice:
        await resume(nc, prefix, "a", request_id="req-a-2")
    assert twice.value.code is ErrorCode.FAILED_PRECONDITION


# --- replicas ---------------------------------------------------------------------------------------------


def check_log(events: list[tuple[int, Event]]) -> dict[str, int]:
    """Replay: no worker booked past its room at any point; no actor placed twice without a release."""
    room: dict[str, int] = {}
    cpu: dict[str, int] = {}
    booked_mem: dict[str, int] = {}
    booked_cpu: dict[str, int] = {}
    placed: dict[str, ActorPlaced] = {}
    placements: dict[str, int] = {}
    for seq, event in events:
        if isinstance(event, WorkerRegistered):
            room[event.worker_id] = event.capacity.memory_mib - WORKER_RESERVE_MIB
            cpu[event.worker_id] = event.capacity.cpu_millis
        elif isinstance(event, ActorPlaced):
            assert event.actor_id not in placed, f"seq {seq}: {event.actor_id} placed twice without a release"
            placed[event.actor_id] = event
            placements[event.worker_id] = placements.get(event.worker_id, 0) + 1
            w = event.worker_id
            booked_mem[w] = booked_mem.get(w, 0) + event.booked.memory_mib
            booked_cpu[w] = booked_cpu.get(w, 0) + event.booked.cpu_millis
            assert booked_mem[w] <= room[w], f"seq {seq}: {w} booked {booked_mem[w]} MiB of {room[w]}"
            assert booked_cpu[w] <= cpu[w], f"seq {seq}: {w} booked {booked_cpu[w]}m of {cpu[w]}"
        elif isinstance(event, ActorReleased):
            held = placed.pop(event.actor_id)
            booked_mem[held.worker_id] -= held.booked.memory_mib
            booked_cpu[held.worker_id] -= held.booked.cpu_millis
    return placements


async def test_three_replicas_and_200_concurrent_resumes_never_overbook(nc, nats_url, prefix, writer, replicas):
    # 12 workers with room for 8 actors of 448 MiB each (4 on the V1 workers' restorable path): 96 slots.
    workers = [registered(f"w{i:02d}", entry([V1, V2][i % 2], (V1,) if i % 2 else ()),
                          mem=8 * 448 + WORKER_RESERVE_MIB, cpu=8000)
               for i in range(12)]
    await asyncio.to_thread(writer.write, *workers)
    actors = []
    for j in range(200):
        actors.append(created(f"a{j:03d}", cpu=500, mem=448))
        if j % 3 == 0:
            actors.append(suspended(f"a{j:03d}", [V1, V2][j % 2]))
    for k in range(0, len(actors), 100):
        await asyncio.to_thread(writer.write, *actors[k:k + 100])
    services = [await replicas() for _ in range(3)]

    clients = [await nats.connect(nats_url) for _ in range(4)]
    try:
        async def one(j: int):
            try:
                return await resume(clients[j % 4], prefix, f"a{j:03d}", timeout=30, request_id=f"r{j}")
            except ContractError as error:
                return error.code

        outcomes = await asyncio.gather(*(one(j) for j in range(200)))
    finally:
        for client in clients:
            await client.close()

    placed = [o for o in outcomes if isinstance(o, Assignment)]
    refused = [o for o in outcomes if not isinstance(o, Assignment)]
    assert set(refused) <= {ErrorCode.RESOURCE_EXHAUSTED}, refused
    events = await read_log(nc, prefix)
    per_worker = check_log(events)
    assert len(placed) == 96  # every slot taken, none twice
    assert sum(per_worker.values()) == 96 and set(per_worker.values()) == {8}
    log_placed = {e.actor_id: (s, e) for s, e in events if isinstance(e, ActorPlaced)}
    for assignment in placed:
        seq, event = log_placed[assignment.actor_id]
        assert seq == assignment.seq - 1 and event.worker_id == assignment.worker_id
    assert sum(s.commits for s in services) == 96
    # the replicas agree on what is booked
    last = await last_seq(nc, prefix)
    for s in services:
        await s.fold.wait(last, 10)
    booked = [{w.worker_id: w.booked_mem for w in s.projection.workers.values()} for s in services]
    assert booked[0] == booked[1] == booked[2]
    for s in services:  # nothing is left counted in flight once the folds have every commit
        assert s.committer.settled and not s.committer.pending


async def test_a_replica_stopped_mid_load_is_rebuilt_from_the_log_and_serves(nc, prefix, writer, replicas):
    workers = [registered(f"w{i}", entry(V1), mem=16 * 256 + WORKER_RESERVE_MIB) for i in range(6)]
    await asyncio.to_thread(writer.write, *workers)
    await asyncio.to_thread(writer.write, *[created(f"a{j:02d}", cpu=100, mem=256) for j in range(90)])
    survivor = await replicas()
    doomed = await replicas()

    async def one(j: int) -> Assignment:
        for _ in range(5):  # a request caught by the stopping replica times out: retry, same request_id
            try:
                return await resume(nc, prefix, f"a{j:02d}", timeout=3, request_id=f"load-{j}")
            except ContractError as error:
                if error.code is not ErrorCode.UNAVAILABLE:
                    raise
        raise AssertionError(f"a{j:02d} never placed")

    first = await asyncio.gather(*(one(j) for j in range(30)))
    load = [asyncio.create_task(one(j)) for j in range(30, 60)]
    await doomed.stop()
    second = await asyncio.gather(*load)
    reborn = await replicas()
    assert reborn.projection.seq >= max(a.seq for a in first + second)
    assert {w.worker_id: w.booked_mem for w in reborn.projection.workers.values()} == {
        w.worker_id: w.booked_mem for w in survivor.projection.workers.values()
    }
    await survivor.stop()  # only the rebuilt replica is left to answer
    third = await asyncio.gather(*(one(j) for j in range(60, 90)))
    assert reborn.commits >= 1 and len(third) == 30
    placements = check_log(await read_log(nc, prefix))
    assert sum(placements.values()) == 90
    assert [a.actor_id for a in first + second + third] == [f"a{j:02d}" for j in range(90)]


class ReplicaProcess:
    """A scheduler replica in a process of its own (`warmboot serve scheduler`), to kill -9."""

    def __init__(self, nats_url: str, prefix: str):
        code = "from warmboot.cli import main; main()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, "serve", "scheduler", "--nats", nats_url, "--prefix", prefix],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )

    async def ready(self) -> None:
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), 60)
        assert line.startswith("serving scheduler"), line

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


async def test_a_replica_killed_mid_load_is_rebuilt_from_the_log_and_serves(nc, nats_url, prefix, writer, replicas):
    workers = [registered(f"w{i}", entry(V1), mem=16 * 256 + WORKER_RESERVE_MIB) for i in range(6)]
    await asyncio.to_thread(writer.write, *workers)
    await asyncio.to_thread(writer.write, *[created(f"a{j:02d}", cpu=100, mem=256) for j in range(90)])
    survivor = await replicas()
    doomed = ReplicaProcess(nats_url, prefix)
    reborn = None
    try:
        await doomed.ready()
        answered = 0
        enough = asyncio.Event()

        async def one(j: int) -> Assignment:
            nonlocal answered
            for _ in range(10):  # a request the killed replica took never gets a reply: retry, same request_id
                try:
                    assignment = await resume(nc, prefix, f"a{j:02d}", timeout=2, request_id=f"kill-{j}")
                except ContractError as error:
                    if error.code is not ErrorCode.UNAVAILABLE:
                        raise
                    continue
                answered += 1
                if answered - survivor.commits >= 3:  # the other replica has answered some too
                    enough.set()
                return assignment
            raise AssertionError(f"a{j:02d} never placed")

        load = asyncio.gather(*(one(j) for j in range(60)))
        waiting = asyncio.create_task(enough.wait())
        await asyncio.wait([load, waiting], return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        assert enough.is_set(), "the replica to kill answered nothing"
        doomed.kill()
        placed = await load

        reborn = ReplicaProcess(nats_url, prefix)
        await reborn.ready()
        await survivor.stop()  # from here on only the rebuilt replica answers
        with pytest.raises(ContractError) as running:  # it folded the placements made before it started
            await resume(nc, prefix, "a00", request_id="again")
        assert running.value.code is ErrorCode.FAILED_PRECONDITION
        assert await resume(nc, prefix, "a00", request_id="kill-0") == placed[0]
        placed += await asyncio.gather(*(one(j) for j in range(60, 90)))
    finally:
        doomed.kill()
        if reborn is not None:
            reborn.kill()
    assert [a.actor_id for a in placed] == [f"a{j:02d}" for j in range(90)]
    events = await read_log(nc, prefix)
    assert sum(check_log(events).values()) == 90
    by_actor = {e.actor_id: s for s, e in events if isinstance(e, ActorPlaced)}
    assert all(by_actor[a.actor_id] == a.seq - 1 for a in placed)


# --- how the fold reads event bodies (no bus) ---------------------------------------------------------------------


def test_the_folds_reader_gives_the_events_decode_event_gives_and_refuses_what_it_refuses():
    import json

    import msgspec

    from services.scheduler.fold import EventReader

    pin = ActorRuntime(sandbox_class=CLS, name="runsc", version=V1)
    placed = ActorPlaced(at=AT, actor_id="a", worker_id="w1", node="n1", action=Action.RESTORE,
                         fidelity=PlacedFidelity.MEMORY, sandbox_runtime=pin, snapshot_id="a-v2",
                         booked=Resources(cpu_millis=500, memory_mib=1024), request_id="r1")
    unstamped = SnapshotTaken(at=AT, actor_id="a", origin=SnapshotOrigin.SUSPEND, snapshot=Snapshot(
        snapshot_id="a-v3", actor_id="a", template_uid="t1", fidelity=Fidelity.VOLUMES, location=Location.EXTERNAL,
        taken_at=AT))
    events = [registered("w1", entry(V1)), created("a"), placed, suspended("a", V2), unstamped, suspended("b", V1),
              placed]
    reader = EventReader()
    for event in events * 2:  # the second time from the reader's table of stamps
        read = reader.decode(encode(event))
        assert isinstance(read, type(event)) and msgspec.to_builtins(read) == msgspec.to_builtins(event)
        assert encode(read) == encode(event)

    def body(event: Event, **changes) -> bytes:
        data = json.loads(encode(event))
        for path, value in changes.items():
            *parents, last = path.split("__")
            target = data
            for key in parents:
                target = target[key]
            if value is KeyError:
                del target[last]
            else:
                target[last] = value
        return json.dumps(data).encode()

    bad_version = json.loads(encode(V1))
    bad_version["attributes"][0]["key"] = "not a key!"
    refused = [
        body(placed, sandbox_runtime=None),
        body(placed, sandbox_runtime=KeyError),
        body(placed, sandbox_runtime__version=bad_version),
        body(placed, sandbox_runtime__sandbox_class=7),
        body(placed, worker_id="two words"),
        body(suspended("a", V1), snapshot__sandbox_runtime__version=bad_version),
        body(suspended("a", V1), snapshot__sandbox_runtime=[]),
        encode(placed)[:-3],
    ]
    for data in refused * 2:
        with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)) as by_schema:
            decode_event(data)
        with pytest.raises(type(by_schema.value)):
            reader.decode(data)
    # a stamp given as null on a snapshot is no stamp, as the schema reads it
    assert reader.decode(body(suspended("a", V1), snapshot__sandbox_runtime=None)).snapshot.sandbox_runtime is None
