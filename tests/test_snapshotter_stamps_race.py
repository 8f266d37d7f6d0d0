"""Stamps under races, judged from the log in stream order (an audit's stress test).

Every service runs (registry, scheduler, snapshotter) plus a second snapshotter replica with a
connection and an event-store link of its own. Actors are resumed by the scheduler onto workers
of three runtimes, and, all at once, paused, suspended (promoted), tagged, reverted, created from
tags, with request ids repeated, while a worker's runtimes change and another worker is removed
and registered again under another runtime. The verdict is read from the log alone: each snapshot
carries the pin of the placement it was taken under, each copy the stamp of what it copies, each
memory restore a pin that accepts its image's stamp, and each reply the snapshot the log recorded
for its request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter

import msgspec
import nats

from events.compat import stamp_key
from events.errors import ContractError, unavailable
from events.schema import (
    ActorCreated,
    ActorPlaced,
    ActorReleased,
    ActorReverted,
    ActorStopped,
    ErrorCode,
    Fidelity,
    Location,
    PauseActor,
    PlacedFidelity,
    ReleaseReason,
    SnapshotOrigin,
    SnapshotReply,
    SnapshotTaken,
    SuspendActor,
    TagRecorded,
)
from events.subjects import services_inbox
from services.endpoints import call
from services.snapshotter.service import SnapshotterService
from events.jetstream.layout import BATCH_ID_HEADER, sequence_of
from tests.factories import actor, read_entries, runtime, version, wait_for, worker
import pytest
from tests.test_snapshotter import env_for
from warmboot.audit import Sink
from warmboot.cli_common import replay
from warmboot.client import Client

V1, V2, V3, V4 = version("r1"), version("r2"), version("r3"), version("r4")
ROUNDS = int(__import__("os").environ.get("STAMP_ROUNDS", "4"))


def judge(entries, created_from: dict[str, str], replies: list[tuple[str, SnapshotReply]]) -> None:
    """The log's stamps hold (`verdict`), and every reply is the snapshot the log recorded first for
    its request id; a tag's that wrote nothing (`unchanged`: the tag named it already), the snapshot
    the TagRecorded at its `seq` names, and nothing recorded for its request id."""
    faults = verdict(entries, created_from)
    assert not faults, "\n".join(faults[:20])
    by_request: dict[str, SnapshotTaken] = {}
    tagged = {seq: e for seq, _, e in entries if isinstance(e, TagRecorded)}
    for _, _, e in entries:
        if isinstance(e, SnapshotTaken) and e.request_id and e.request_id not in by_request:
            by_request[e.request_id] = e
    for rid, reply in replies:
        if reply.unchanged:
            assert rid not in by_request and tagged[reply.seq].snapshot == reply.snapshot, (rid, reply)
        else:
            assert by_request[rid].snapshot == reply.snapshot, (rid, reply)


def reg(wid, node, default, restorable=()):
    """A worker with room for every actor of these tests, its runtimes without overheads."""
    return worker(wid, runtime(default, overhead=None), tuple(runtime(v, overhead=None) for v in restorable),
                  node=node, cpu=10_000_000, mem=10_000_000)


class Outcomes:
    """Each request's outcome, counted by (verb, error code or OK); an INTERNAL answer fails the test.
    `answered` is set at every answer (a test waits for the first during a failover)."""

    def __init__(self, answered: asyncio.Event | None = None):
        self.codes: Counter = Counter()
        self.answered = answered

    async def note(self, what, coro):
        try:
            reply = await coro
        except ContractError as error:
            self.codes[(what, error.code.value)] += 1
            assert error.code is not ErrorCode.INTERNAL, error
            return None
        finally:
            if self.answered is not None:
                self.answered.set()
        self.codes[(what, "OK")] += 1
        return reply


@contextlib.asynccontextmanager
async def second_snapshotter(nats_url: str, prefix: str, lag: random.Random | None = None):
    """A second replica; with `lag`, its direct gets answered as by a replica of the stream up to a
    few messages behind (each read hides up to 5 of the newest messages it would return, and the
    rest of their atomic batches)."""
    client = await nats.connect(nats_url)
    env = env_for(nats_url, prefix)
    env["NATS_INBOX_PREFIX"] = f"{services_inbox(prefix)}.replica2"
    service = SnapshotterService(client, nats_url=nats_url, prefix=prefix, env=env)
    try:
        await service.start()
        if lag is not None:
            stream = service.app.recorder.stream
            read, hidden = stream.read, Counter()

            async def behind(subject, start, *args, **kwargs):
                msgs = await read(subject, start, *args, **kwargs)
                if not msgs:
                    return msgs
                cut = sequence_of(msgs[-1]) - lag.randrange(6)
                # an atomic batch becomes visible whole: none of a batch some message of which is cut
                torn = {m.headers.get(BATCH_ID_HEADER) for m in msgs if sequence_of(m) > cut} - {None}
                kept = [m for m in msgs if sequence_of(m) <= cut and m.headers.get(BATCH_ID_HEADER) not in torn]
                hidden["read"] += len(msgs) - len(kept)
                return kept

            async def last_behind(subject, *args, **kwargs):
                msgs = await behind(subject, 1)
                return msgs[-1] if msgs else None

            stream.read, stream.last_direct = behind, last_behind
            service.hidden = hidden
        yield service
    finally:
        await service.stop()
        await client.close()


def served(replica: SnapshotterService, verb: str) -> int:
    return next(e.num_requests for e in replica.micro.stats().endpoints if e.name == verb)


def verdict(entries, created_from: dict[str, str]) -> list[str]:
    """Every breach of the stamping rules in the log, in stream order."""
    faults: list[str] = []
    assign: dict[str, ActorPlaced | None] = {}
    state: dict[str, str] = {}
    latest: dict = {}
    external: dict = {}
    tags: dict[str, object] = {}
    tag_by_request: dict[str, object] = {}
    for seq, _, e in entries:
        if isinstance(e, TagRecorded):
            tags[e.tag] = e.snapshot
            if e.request_id:
                tag_by_request[e.request_id] = e.snapshot
            continue
        aid = getattr(e, "actor_id", None)
        if aid is None:
            continue
        if isinstance(e, ActorCreated):
            state[aid], assign[aid] = "CREATED", None
            latest[aid] = e.snapshot
            external[aid] = e.snapshot
            source = created_from.get(aid)
            if source is not None:
                want = tags.get(source)
                want = msgspec.structs.replace(want, actor_id=aid) if want is not None else None
                if e.snapshot != want:
                    faults.append(f"{seq}: {aid} created from tag {source} with {e.snapshot}, the tag names {want}")
        elif isinstance(e, ActorPlaced):
            if state.get(aid) not in ("CREATED", "PAUSED", "SUSPENDED"):
                faults.append(f"{seq}: {aid} placed while {state.get(aid)}")
            snap = latest.get(aid)
            if e.fidelity is PlacedFidelity.MEMORY:
                if snap is None or snap.sandbox_runtime is None or \
                        stamp_key(snap.sandbox_runtime) != stamp_key(e.sandbox_runtime):
                    faults.append(f"{seq}: {aid} restored at MEMORY under {e.sandbox_runtime.version} from {snap}")
            if snap is not None and snap.location is Location.LOCAL and snap.node != e.node:
                faults.append(f"{seq}: {aid} LOCAL image on {snap.node} restored on {e.node}")
            state[aid], assign[aid] = "RUNNING", e
        elif isinstance(e, SnapshotTaken):
            s, origin = e.snapshot, e.origin
            held = assign.get(aid)
            if origin in (SnapshotOrigin.PAUSE, SnapshotOrigin.SUSPEND):
                if held is None or state.get(aid) != "RUNNING":
                    faults.append(f"{seq}: {aid} {origin.value} while {state.get(aid)}")
                elif s.sandbox_runtime != held.sandbox_runtime:
                    faults.append(f"{seq}: {aid} {origin.value} stamped {s.sandbox_runtime}, "
                                  f"pin {held.sandbox_runtime}")
                elif origin is SnapshotOrigin.PAUSE and (s.node != held.node or s.location is not Location.LOCAL):
                    faults.append(f"{seq}: {aid} PAUSE on {s.node}, placed on {held.node}")
                latest[aid] = s
                if origin is SnapshotOrigin.SUSPEND:
                    external[aid] = s
            elif origin is SnapshotOrigin.PROMOTE:
                was = latest.get(aid)
                if state.get(aid) != "PAUSED" or was is None or was.location is not Location.LOCAL:
                    faults.append(f"{seq}: {aid} PROMOTE while {state.get(aid)} from {was}")
                elif (s.sandbox_runtime, s.taken_at, s.template_uid) != \
                        (was.sandbox_runtime, was.taken_at, was.template_uid):
                    faults.append(f"{seq}: {aid} PROMOTE stamped {s.sandbox_runtime}, "
                                  f"the local one {was.sandbox_runtime}")
                latest[aid] = external[aid] = s
                state[aid] = "SUSPENDED"
            elif origin is SnapshotOrigin.TAG:
                if s != latest.get(aid):
                    faults.append(f"{seq}: {aid} TAG copies {s}, latest is {latest.get(aid)}")
                if e.request_id is None or tag_by_request.get(e.request_id) != s:
                    faults.append(f"{seq}: {aid} TAG {s} differs from the tag's record "
                                  f"{tag_by_request.get(e.request_id)}")
            elif origin is SnapshotOrigin.CREATE:
                if s != latest.get(aid):
                    faults.append(f"{seq}: {aid} CREATE snapshot differs from ActorCreated's")
        elif isinstance(e, ActorReleased):
            assign[aid] = None
            if e.reason is ReleaseReason.PAUSED:
                state[aid] = "PAUSED"
            elif e.reason in (ReleaseReason.SUSPENDED, ReleaseReason.WORKER_REMOVED):
                state[aid] = "SUSPENDED"
        elif isinstance(e, ActorStopped):
            state[aid], assign[aid] = "STOPPED", None
        elif isinstance(e, ActorReverted):
            if e.abandoned != latest.get(aid) or e.snapshot != external.get(aid):
                faults.append(f"{seq}: {aid} reverted to {e.snapshot} (last external {external.get(aid)}), "
                              f"abandoning {e.abandoned} (latest {latest.get(aid)})")
            latest[aid] = e.snapshot
            state[aid], assign[aid] = "SUSPENDED", None
    return faults


@pytest.mark.parametrize("lagging", [False, True])
async def test_stamps_hold_under_two_replicas_runtime_changes_and_a_new_life_of_a_worker(stack, nc, prefix, lagging):
    rng = random.Random(7)
    wb = Client(nc, prefix, read_your_writes=False)

    await wb.register(reg("w-1", "node-1", V1, (V2,)))
    await wb.register(reg("w-2", "node-2", V2, (V1,)))
    await wb.register(reg("w-3", "node-1", V3))
    actors = [f"a-{i}" for i in range(30)]
    for aid in actors:
        await wb.create(actor(aid, cpu=1, mem=1))
    created_from: dict[str, str] = {}
    replies: list[tuple[str, SnapshotReply]] = []
    outcomes = Outcomes()
    note, codes = outcomes.note, outcomes.codes

    sent: dict[str, tuple] = {}  # request id -> how to send it again

    async def snap(what, aid, rid, *args):
        call = {"pause": wb.pause, "suspend": wb.suspend, "tag": wb.tag}[what]
        kwargs = {"request_id": rid}
        if what == "suspend":
            args = (Fidelity.MEMORY,)
        sent[rid] = (what, aid, args)
        reply = await note(what, call(aid, *args, **kwargs))
        if reply is not None:
            replies.append((rid, reply))

    async with second_snapshotter(stack.nats_url, prefix, random.Random(11) if lagging else None) as second:
        for round_ in range(ROUNDS):
            await asyncio.gather(*(note("resume", wb.resume(aid)) for aid in actors for _ in range(2)))
            ops = []
            for aid in actors:
                rids = [f"{aid}-{round_}-{k}" for k in range(3)]
                for _ in range(3):
                    ops.append(snap("pause", aid, rng.choice(rids) + "p"))
                    ops.append(snap("suspend", aid, rng.choice(rids) + "s"))
                ops.append(snap("tag", aid, f"{aid}-{round_}-tag", f"t-{rng.randrange(3)}"))
                if rng.random() < 0.3:
                    ops.append(note("revert", wb.revert(aid)))
            reborn: set[str] = set()

            async def new_life(aid):
                await note("stop", wb.stop(aid))
                if await note("create", wb.create(actor(aid, cpu=1, mem=1))) is not None:
                    reborn.add(aid)

            for aid in rng.sample(actors, 3):  # a stop and, at once, a new life of the same id
                ops.append(new_life(aid))
            for k in range(6):
                cid = f"c-{round_}-{k}"
                created_from[cid] = f"t-{k % 3}"
                ops.append(note("create", wb.create(actor(cid, cpu=1, mem=1, source_tag=created_from[cid]))))
            # the registry moves under it all: w-1's runtimes change, w-3 ends and begins a life anew
            ops.append(note("register", wb.register(reg("w-1", "node-1", V2, (V1,)) if round_ % 2 == 0
                                                    else reg("w-1", "node-1", V1, (V2,)))))
            if round_ % 2 == 0:
                ops.append(note("remove", wb.remove("w-3")))
            else:
                ops.append(note("register", wb.register(reg("w-3", "node-1", V4 if round_ == 1 else V3))))
            rng.shuffle(ops)
            await asyncio.gather(*ops)
            # every id answered so far sent again after the actors moved: each gets its first answer
            await asyncio.gather(*(note("resume", wb.resume(aid)) for aid in actors))
            # (an earlier life's request id is a new request in the next life: docs/contract.md)
            first = {rid: r for rid, r in replies if r.snapshot.actor_id not in reborn}
            replies.clear()
            await asyncio.gather(*(snap(sent[rid][0], sent[rid][1], rid, *sent[rid][2]) for rid in first))
            for rid, reply in replies:
                assert reply.snapshot == first[rid].snapshot, (rid, reply, first[rid])
            replies[:] = list(first.items())
        entries = await read_entries(nc, prefix)
        assert served(second, "pause") and served(second, "suspend")
        if lagging:
            print("hidden by the lagging replica:", dict(second.hidden))
    print(sorted(codes.items()))
    judge(entries, created_from, replies)
    # and `warmboot audit verify`, which checks the same rules through the scheduler's fold, agrees
    sink = await replay(nc, prefix, Sink(verify=True), False)
    assert sink.violation is None, str(sink.violation)
    assert codes[("pause", "OK")] and codes[("suspend", "OK")] and codes[("tag", "OK")]


@pytest.mark.timeout(600)
async def test_stamps_hold_through_a_stream_leader_failover_with_replicas_on_two_members(tmp_path, monkeypatch):
    """The same workload on a 3-node cluster (streams R3), the snapshotter's two replicas on two
    members; the stream leader is killed (SIGKILL) while a round is in flight, and started again."""
    import uuid
    from contextlib import AsyncExitStack

    from events.subjects import stream_name
    from tests.test_failover import every_service
    from warmboot.natsserver import NatsCluster, wait_jetstream, wait_stream_current
    from warmboot.runner import connect

    monkeypatch.setenv("WARMBOOT_STREAM_REPLICAS", "3")
    prefix = "t" + uuid.uuid4().hex[:10]
    rng = random.Random(3)
    with NatsCluster(tmp_path) as cluster:
        await wait_jetstream(cluster.url)
        async with AsyncExitStack() as exits:
            await every_service(exits, cluster, prefix)
            second = await exits.enter_async_context(second_snapshotter(cluster.urls[1], prefix))
            # its requests are served by both replicas (one on another member)
            nc = await connect(cluster.url, "client")
            exits.push_async_callback(nc.close)
            wb = Client(nc, prefix, read_your_writes=False)

            await wb.register(reg("w-1", "node-1", V1, (V2,)))
            await wb.register(reg("w-2", "node-2", V2, (V1,)))
            actors = [f"a-{i}" for i in range(24)]
            for aid in actors:
                await wb.create(actor(aid, cpu=1, mem=1))
            replies: list[tuple[str, SnapshotReply]] = []
            answered = asyncio.Event()
            outcomes = Outcomes(answered)
            note, codes = outcomes.note, outcomes.codes

            async def snap(what, aid, rid):
                call = wb.pause(aid, request_id=rid) if what == "pause" else \
                    wb.suspend(aid, Fidelity.MEMORY, request_id=rid) if what == "suspend" else \
                    wb.tag(aid, f"t-{rng.randrange(2)}", request_id=rid)
                reply = await note(what, call)
                if reply is not None:
                    replies.append((rid, reply))

            stream = stream_name(prefix)
            for round_ in range(4):
                await asyncio.gather(*(note("resume", wb.resume(aid)) for aid in actors for _ in range(2)))
                ops = []
                for aid in actors:
                    for k in range(2):
                        ops.append(snap("pause", aid, f"{aid}-{round_}-{k}p"))
                        ops.append(snap("suspend", aid, f"{aid}-{round_}-{k}s"))
                    ops.append(snap("tag", aid, f"{aid}-{round_}-tag"))
                ops.append(note("register", wb.register(reg("w-1", "node-1", V2, (V1,)) if round_ % 2 == 0
                                                        else reg("w-1", "node-1", V1, (V2,)))))
                rng.shuffle(ops)
                if round_ == 1:
                    await wait_stream_current(nc.jetstream(), stream, 3)
                    leader = (await nc.jetstream().stream_info(stream)).cluster.leader
                    answered.clear()
                    running = asyncio.gather(*ops)
                    await answered.wait()  # the round is under way: one of its requests is answered
                    cluster.node(leader).kill()
                    await running
                    cluster.node(leader).spawn()
                    await asyncio.to_thread(cluster.node(leader).wait_ready, 30)
                else:
                    await asyncio.gather(*ops)
                first = dict(replies)
                replies.clear()
                await asyncio.gather(*(snap(rid[-1:] == "p" and "pause" or rid[-1:] == "s" and "suspend" or "tag",
                                            r.snapshot.actor_id, rid) for rid, r in first.items() if rid[-1] != "g"))
                for rid, reply in replies:
                    assert reply.snapshot == first[rid].snapshot, (rid, reply, first[rid])
                replies[:] = list(first.items())
            await wait_stream_current(nc.jetstream(), stream, 3)
            entries = await read_entries(nc, prefix)
            assert served(second, "pause") and served(second, "suspend")
    print(sorted(codes.items()))
    judge(entries, {}, replies)
    ids = Counter((e.actor_id, e.request_id, e.origin) for _, _, e in entries if isinstance(e, SnapshotTaken))
    assert set(ids.values()) == {1}, [k for k, n in ids.items() if n > 1]


async def test_a_pause_or_suspend_naming_its_placement_is_refused_once_the_actor_was_placed_anew(stack, nc, prefix):
    """a-1 runs on w-1 under V1 and its image is being taken there, when w-1 is removed (a-1 is
    released) and a resume places a-1 on w-2 under V2. The pause, sent late, was recorded as a pause
    on w-2's node stamped V2: an image of V1 on node-1 named a V2 image on node-2 (found by an audit).
    A pause or suspend that names the placement it was taken under (`placement_seq`, the seq the
    resume answered) is refused once that placement has ended, and nothing is written; one naming
    the current placement is recorded with that placement's pin and node."""
    wb = Client(nc, prefix)
    await wb.register(worker("w-1", runtime(V1), node="node-1"))
    await wb.create(actor("a-1", cpu=1, mem=1))
    first = await wb.resume("a-1")
    assert (first.worker_id, first.sandbox_runtime.version) == ("w-1", V1)
    await wb.remove("w-1")
    await wb.register(worker("w-2", runtime(V2), node="node-2"))
    released, _ = await wait_for(nc, prefix, lambda e: isinstance(e, ActorReleased) and e.actor_id == "a-1")
    second = await wb.resume("a-1", min_seq=released)  # the snapshotter released it: w-1's removal
    assert (second.worker_id, second.sandbox_runtime.version) == ("w-2", V2)

    before = [seq for seq, _, _ in await read_entries(nc, prefix)][-1]
    for send in (lambda: wb.pause("a-1", placement_seq=first.seq),
                 lambda: wb.suspend("a-1", uri="s3://a-1", placement_seq=first.seq),
                 lambda: wb.pause("a-1", placement_seq=first.seq - 1)):  # not the placement's seq at all
        with pytest.raises(ContractError) as refused:
            await send()
        assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "placement_seq")
        assert (f"placed on worker 'w-2' (recorded at sequence {second.seq - 1}; its resume answered "
                f"{second.seq - 1} or {second.seq})") in refused.value.message
    for bad in (0, -1):  # no message has such a sequence: the request's form is wrong, not the actor's placement
        for send in (lambda: wb.pause("a-1", placement_seq=bad),
                     lambda: wb.suspend("a-1", uri="s3://a-1", placement_seq=bad)):
            with pytest.raises(ContractError) as refused:
                await send()
            assert (refused.value.code, refused.value.field) == (ErrorCode.INVALID_ARGUMENT, "placement_seq")
    pin = msgspec.to_builtins(second.sandbox_runtime)
    twice = dict(pin, version=dict(pin["version"], attributes=pin["version"]["attributes"] * 2))
    for body, field in (({"placement_worker_id": "w-2"}, "placement_worker_id"),  # a placement's, with no seq
                        ({"placement_node": "node-2"}, "placement_node"),
                        ({"placement_runtime": pin}, "placement_runtime"),
                        ({"placement_seq": second.seq, "placement_runtime": twice},
                         f"placement_runtime.version.attributes[{len(pin['version']['attributes'])}].key")):
        for verb, more in (("pause", {}), ("suspend", {"fidelity": "MEMORY", "uri": "s3://a-1"})):
            with pytest.raises(ContractError) as refused:
                await call(nc, f"{prefix}.snapshotter.{verb}.a-1", msgspec.json.encode(body | more), SnapshotReply)
            assert (refused.value.code, refused.value.field) == (ErrorCode.INVALID_ARGUMENT, field), refused.value
    assert [seq for seq, _, _ in await read_entries(nc, prefix)][-1] == before  # nothing written

    paused = await wb.pause("a-1", placement_seq=second.seq)  # the Assignment's seq: its booking marker's
    assert (paused.snapshot.node, paused.snapshot.sandbox_runtime.version) == ("node-2", V2)
    with pytest.raises(ContractError) as refused:  # a promote names the placement the pause ended
        await wb.suspend("a-1", uri="s3://a-1", placement_seq=first.seq)
    assert f"its image is of the placement (recorded at sequence {second.seq - 1};" in refused.value.message
    promoted = await wb.suspend("a-1", uri="s3://a-1", placement_seq=second.seq - 1)  # the ActorPlaced's seq
    assert promoted.snapshot.sandbox_runtime.version == V2


async def test_the_client_fences_a_pause_or_suspend_with_its_last_resume_of_the_actor(stack, nc, prefix):
    """A failover test: a suspend (no `placement_seq`) held in a stopped NATS server's buffers, its
    caller gone, was decided once the actor had been stopped, created and placed again on a worker of
    another runtime: life 1's image recorded in life 2, stamped with life 2's pin, and the next resume
    sent it, at MEMORY, to a worker that cannot load it. The client now names, unless told otherwise,
    the placement its own last resume of the actor answered: such a copy (here sent late by the client
    that resumed life 1) is refused, nothing written. The usual course (resume, pause, promote;
    resume, suspend) is unchanged, and a client with `fence_snapshots=False` sends no placement."""
    orchestrator, other = Client(nc, prefix), Client(nc, prefix)
    await other.register(worker("w-1", runtime(V1), node="node-1"))
    await other.create(actor("a-1", cpu=1, mem=1))
    first = await orchestrator.resume("a-1")  # life 1, on w-1 (V1): its image is taken there
    assert (first.worker_id, first.sandbox_runtime.version) == ("w-1", V1)
    await other.stop("a-1")  # meanwhile, another caller: a new life on a worker of another runtime
    await other.remove("w-1")
    await other.register(worker("w-2", runtime(V2), node="node-2"))
    await other.create(actor("a-1", cpu=1, mem=1))
    second = await other.resume("a-1")
    assert (second.worker_id, second.sandbox_runtime.version) == ("w-2", V2)

    before = [seq for seq, _, _ in await read_entries(nc, prefix)][-1]
    for late in (lambda: orchestrator.suspend("a-1", uri="s3://life-1-image"), lambda: orchestrator.pause("a-1")):
        with pytest.raises(ContractError) as refused:  # the late copy, as its caller sent it
            await late()
        assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "placement_seq")
        assert "placed on worker 'w-2'" in refused.value.message
    assert [seq for seq, _, _ in await read_entries(nc, prefix)][-1] == before  # nothing written

    unfenced = Client(nc, prefix, fence_snapshots=False)  # what it was: recorded with life 2's pin
    recorded = await unfenced.suspend("a-1", uri="s3://life-1-image")
    assert recorded.snapshot.sandbox_runtime.version == V2

    # the usual course, all by the client that placed the actor: resume, pause, promote; resume, suspend
    third = await orchestrator.resume("a-1")
    paused = await orchestrator.pause("a-1")
    assert (paused.snapshot.node, paused.snapshot.sandbox_runtime.version) == ("node-2", V2)
    promoted = await orchestrator.suspend("a-1", uri="s3://a-1-promoted")
    assert promoted.snapshot.sandbox_runtime.version == V2
    fourth = await orchestrator.resume("a-1")
    assert fourth.seq > third.seq
    suspended = await orchestrator.suspend("a-1", uri="s3://a-1-again")
    assert (suspended.snapshot.uri, suspended.snapshot.sandbox_runtime.version) == ("s3://a-1-again", V2)


async def test_a_client_names_the_assignment_it_is_given_another_process_s_resume_made(stack, nc, prefix):
    """`pause(..., placed=assignment)`: a client that did not resume the actor names that Assignment's
    seq, worker and pin (heard beside the snapshotter), asking nothing; one of another actor, or beside
    another `placement_seq`, is INVALID_ARGUMENT naming the field, nothing sent."""
    resumer, other = Client(nc, prefix), Client(nc, prefix)
    heard: list = []

    async def keep(msg) -> None:
        heard.append(msg)
    for verb in ("pause", "suspend"):
        await nc.subscribe(f"{prefix}.snapshotter.{verb}.a-1", cb=keep)
    await resumer.register(worker("w-1", runtime(V1), node="node-1"))
    for actor_id in ("a-1", "b-1"):
        await resumer.create(actor(actor_id, cpu=1, mem=1))
    a, b = await resumer.resume("a-1"), await resumer.resume("b-1")
    for bad, field in (({"placed": b}, "placed"), ({"placed": a, "placement_seq": a.seq + 1}, "placement_seq")):
        with pytest.raises(ContractError) as refused:
            await other.pause("a-1", **bad)
        assert (refused.value.code, refused.value.field) == (ErrorCode.INVALID_ARGUMENT, field), refused.value
    await nc.flush()
    assert heard == []  # nothing sent
    paused = await other.suspend("a-1", uri="s3://a-1", placed=a)
    await nc.flush()
    (sent,) = [msgspec.json.decode(m.data, type=SuspendActor) for m in heard]
    assert (sent.placement_seq, sent.placement_worker_id, sent.placement_node, sent.placement_runtime) == (
        a.seq, "w-1", "node-1", a.sandbox_runtime)
    assert paused.snapshot.sandbox_runtime == a.sandbox_runtime


async def test_a_client_that_did_not_resume_the_actor_fences_with_the_placement_the_snapshotter_says(
        stack, nc, prefix):
    """A pause or suspend by a client that did not resume the actor (another orchestrator, a fresh
    process: the CLI's) went unfenced: a copy of it decided after the actor moved recorded its image
    under the new placement's pin. Such a client now asks the snapshotter where the actor is
    (`status`, one request) and names that placement: heard beside the snapshotter, the pause names the
    ActorPlaced of the resume another client made, and its late copy, decided after the actor was
    stopped, created and placed on a worker of another runtime, is refused, nothing written. A client
    that knows its own resume asks nothing; with `fence_snapshots=False`, nothing is asked or named."""
    resumer, other = Client(nc, prefix), Client(nc, prefix)
    heard: dict[str, list] = {"status": [], "pause": [], "suspend": []}
    for verb, kept in heard.items():
        async def keep(msg, kept=kept) -> None:
            kept.append(msg)
        await nc.subscribe(f"{prefix}.snapshotter.{verb}.a-1", cb=keep)
    await resumer.register(worker("w-1", runtime(V1), node="node-1"))
    await resumer.create(actor("a-1", cpu=1, mem=1))
    first = await resumer.resume("a-1")
    placed = [seq for seq, _, e in await read_entries(nc, prefix) if isinstance(e, ActorPlaced)][-1]
    assert first.seq in (placed, placed + 1)

    paused = await other.pause("a-1")  # a client that knows no placement of the actor
    await nc.flush()
    sent = msgspec.json.decode(heard["pause"][-1].data, type=PauseActor)
    assert len(heard["status"]) == 1 and sent.placement_seq == placed
    assert (sent.placement_worker_id, sent.placement_node, sent.placement_runtime) == (None, None, None)  # seq alone
    assert (paused.snapshot.node, paused.snapshot.sandbox_runtime.version) == ("node-1", V1)

    second = await resumer.resume("a-1")  # resumer knows its placement: no question asked
    await resumer.pause("a-1")
    await nc.flush()
    assert len(heard["status"]) == 1
    sent = msgspec.json.decode(heard["pause"][-1].data, type=PauseActor)  # its Assignment's seq, worker, node, pin
    assert (sent.placement_seq, sent.placement_worker_id, sent.placement_node, sent.placement_runtime) == (
        second.seq, second.worker_id, second.node, second.sandbox_runtime)
    third = await resumer.resume("a-1")
    late, held = Client(nc, prefix), []  # its suspend is held while the actor lives anew elsewhere (sent late)
    request = late.request

    async def never_answered(service, verb, actor_id, body, reply_type):
        if verb != "suspend":
            return await request(service, verb, actor_id, body, reply_type)
        held.append(msgspec.json.encode(body))  # kept in a stopped NATS server's buffers; its caller gives up
        raise unavailable("no reply within 5s")

    late.request = never_answered
    with pytest.raises(ContractError):
        await late.suspend("a-1", uri="s3://life-1-image")
    (body,) = held
    assert msgspec.json.decode(body, type=SuspendActor).placement_seq in (third.seq - 1, third.seq)
    await resumer.stop("a-1")
    await resumer.remove("w-1")
    await resumer.register(worker("w-2", runtime(V2), node="node-2"))
    await resumer.create(actor("a-1", cpu=1, mem=1))
    assert (await resumer.resume("a-1")).sandbox_runtime.version == V2
    before = [seq for seq, _, _ in await read_entries(nc, prefix)][-1]
    with pytest.raises(ContractError) as refused:
        await call(nc, f"{prefix}.snapshotter.suspend.a-1", body, SnapshotReply)
    assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "placement_seq")
    assert [seq for seq, _, _ in await read_entries(nc, prefix)][-1] == before  # nothing written

    asked = len(heard["status"])
    unfenced = Client(nc, prefix, fence_snapshots=False)
    recorded = await unfenced.suspend("a-1", uri="s3://a-1")
    await nc.flush()
    assert len(heard["status"]) == asked and \
        msgspec.json.decode(heard["suspend"][-1].data, type=SuspendActor).placement_seq is None
    assert recorded.snapshot.sandbox_runtime.version == V2


def named_placements(entries, named: dict[str, int]) -> list[str]:
    """Each snapshot a request naming its placement (`named`: request id -> placement_seq) recorded, in
    stream order: a pause or a suspend while that placement is the actor's current one (its ActorPlaced,
    or the booking marker after it), a promote of the image whose pause ended it."""
    faults: list[str] = []
    current: dict[str, int] = {}
    ended: dict[str, int] = {}
    for seq, _, e in entries:
        aid = getattr(e, "actor_id", None)
        if isinstance(e, ActorPlaced):
            current[aid] = seq
        elif isinstance(e, ActorReleased):
            held = current.pop(aid, 0)
            ended[aid] = held if e.reason is ReleaseReason.PAUSED else 0
        elif isinstance(e, (ActorCreated, ActorStopped, ActorReverted)):
            current.pop(aid, None)
            ended[aid] = 0
        elif isinstance(e, SnapshotTaken) and e.request_id in named:
            want = named[e.request_id]
            held = ended.get(aid) if e.origin is SnapshotOrigin.PROMOTE else current.get(aid)
            if held not in (want, want - 1):
                faults.append(f"{seq}: {aid} {e.origin.value} ({e.request_id}) names placement {want}, "
                              f"{'its pause ended' if e.origin is SnapshotOrigin.PROMOTE else 'current is'} {held}")
    return faults


async def test_snapshots_naming_their_placement_hold_under_a_lagging_replica_removals_and_new_lives(stack, nc, prefix):
    """The stamps race above with `placement_seq`: every pause and suspend names a placement (mostly the
    current one, by its ActorPlaced's seq or its Assignment's; else the message after the Assignment, or
    a placement that has ended), each sent at once to a lagging replica and through the queue group, and
    sent again once the round is over, while w-1 is removed and its actors placed anew, w-1 comes back on
    other runtimes, and actors begin new lives. From the log: each snapshot recorded under the placement
    its request named (a promote, the one its pause ended), and the stamping rules; each request id
    answered one snapshot (an audit's test, 2026-12-04: no fault found)."""
    rng = random.Random(5)
    wb = Client(nc, prefix, read_your_writes=False)
    await wb.register(reg("w-1", "node-1", V1, (V2,)))
    await wb.register(reg("w-2", "node-2", V2))
    await wb.register(reg("w-3", "node-1", V3, (V1,)))
    actors = [f"a-{i}" for i in range(30)]
    for aid in actors:
        await wb.create(actor(aid, cpu=1, mem=1))
    outcomes = Outcomes()
    note, codes = outcomes.note, outcomes.codes
    placed: dict[str, list[int]] = {aid: [] for aid in actors}  # each actor's Assignments' seqs, as answered
    named: dict[str, int] = {}
    sent: dict[str, tuple[str, str]] = {}
    answered: dict[str, SnapshotReply] = {}

    async def resume(aid):
        got = await note("resume", wb.resume(aid))
        if got is not None:
            placed[aid].append(got.seq)

    async with second_snapshotter(stack.nats_url, prefix, random.Random(11)) as second:
        async def snap(verb, aid, rid, direct):
            if direct:
                body = PauseActor(request_id=rid, placement_seq=named[rid]) if verb == "pause" else \
                    SuspendActor(request_id=rid, placement_seq=named[rid], fidelity=Fidelity.MEMORY, uri=f"s3://{rid}")
                call = getattr(second, verb)(aid, body)
            else:
                call = wb.pause(aid, request_id=rid, placement_seq=named[rid]) if verb == "pause" else \
                    wb.suspend(aid, Fidelity.MEMORY, uri=f"s3://{rid}", request_id=rid, placement_seq=named[rid])
            got = await note(verb, call)
            if got is not None:
                assert answered.setdefault(rid, got).snapshot == got.snapshot, (rid, got, answered[rid])

        for round_ in range(3):
            await asyncio.gather(*(resume(aid) for aid in actors for _ in range(2)))
            ops = []
            for aid in actors:
                if not placed[aid]:
                    continue
                for k in range(2):
                    rid, verb = f"{aid}-{round_}-{k}", rng.choice(["pause", "suspend"])
                    # its Assignment's seq, its ActorPlaced's, or the message after the Assignment (no placement)
                    named[rid], sent[rid] = placed[aid][-1] - rng.choice((0, 0, 1, -1)), (verb, aid)
                    ops += [snap(verb, aid, rid, True), snap(verb, aid, rid, False)]
                if len(placed[aid]) > 1:  # an image of an ended placement, sent late
                    rid = f"{aid}-{round_}-late"
                    named[rid], sent[rid] = rng.choice(placed[aid][:-1]), (rng.choice(["pause", "suspend"]), aid)
                    ops.append(snap(*sent[rid], rid, rng.random() < 0.5))
            if round_ % 2 == 0:
                ops.append(note("remove", wb.remove("w-1")))
                ops += [resume(aid) for aid in rng.sample(actors, 10)]
            else:
                ops.append(note("register", wb.register(reg("w-1", "node-1", V2, (V1,)))))
            for aid in rng.sample(actors, 2):
                async def new_life(aid=aid):
                    await note("stop", wb.stop(aid))
                    await note("create", wb.create(actor(aid, cpu=1, mem=1)))
                ops.append(new_life())
            rng.shuffle(ops)
            await asyncio.gather(*ops)
            await asyncio.gather(*(snap(verb, aid, rid, rng.random() < 0.5) for rid, (verb, aid) in sent.items()))
        entries = await read_entries(nc, prefix)
    print(sorted(codes.items()))
    faults = named_placements(entries, named) + verdict(entries, {})
    assert not faults, "\n".join(faults[:20])
    assert codes[("pause", "OK")] and codes[("suspend", "OK")] and codes[("pause", "FAILED_PRECONDITION")]
