"""A registration whose events one message of the NATS server does not carry (its max_payload).

A registration is bounded by the schema's counts and by the 1 MiB a body may be (`events.codec.MAX_BODY`),
an event only by the server's max_payload: `RuntimeChanged` carries the new classes and the previous ones,
about twice a registration, and every event spells out what a body may leave out. Such an event was
refused by the store (DataError, answered INTERNAL), the change never written, and the worker's beats kept
the registration it was to replace in force, drawing resumes of runtimes it had dropped (found by a review:
a 616 KB registration changed on a 1 MB server, and a 1,047,440-byte one, within MAX_BODY, changed on
warmboot's own 2 MB). Now the registry refuses it before anything is written, INVALID_ARGUMENT naming
`sandbox_classes` and both sizes (`services.registry.domain.check_fits`), and the agent so refused drains
its worker before it beats it again (docs/contract.md, "A registration too large for one event").
"""

from __future__ import annotations

import asyncio
import shutil
import time
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import datetime, timezone
from typing import Any, AsyncIterator

import msgspec
import nats
import pytest

from events.codec import MAX_BODY, encode
from events.errors import ContractError, exhausted, too_large_for_an_event, unavailable
from events.jetstream.layout import (BATCH_COMMIT_HEADER, BATCH_ID_HEADER, BATCH_SEQ_HEADER,
                                     EXPECTED_SUBJECT_SEQ_HEADER, EXPECTED_SUBJECT_SEQ_SUBJECT_HEADER,
                                     event_headers)
from events.natspy.headers import header_block
from events.schema import (ActorPlaced, ErrorCode, Fidelity, PlacedFidelity, RegisterWorker, RuntimeChanged, WorkerDrained,
                           WorkerRegistered, WorkerRemoved, WorkerUpdated)
from eventsourcing.persistence import StoredEvent
from services.registry.budget import WriteBudget
from services.registry.domain import EVENT_HEADROOM, Worker, check_fits
from services.registry.service import RegistryService
from tests.conftest import ONE_MB
from tests.factories import SILENT_TTL_S, actor, entry, last_seq, read_log, runtime, version, worker
from tests.registry_helpers import (AMD, CPUINFO, PROBE, Holding, agent_config, agent_said, attrs, counted_probe, counting,
                                    heard_for_long, raw_request, reads_after, registration, running_registry,
                                    wait_event, worker_events)
from tests.test_agent import agent_running, probed
from tests.test_registry_budget import Clock
from warmboot import agent as agent_module
from warmboot.agent import RETRY_MIN_S, Agent
from warmboot.client import Client
from warmboot.natsserver import NatsServer
from warmboot.runner import SERVICES, start_services

AT = datetime(2026, 12, 7, tzinfo=timezone.utc)


# --- bodies ------------------------------------------------------------------------------------------


def long_version(tag: str, pad: int = 200) -> dict:
    """A v1 version of 32 attributes, 31 of them `pad` characters long, told apart by `tag`."""
    pairs = attrs(architecture="amd64")
    pairs += [{"key": f"k{j:02d}", "value": (f"{tag}.{j}-" + "x" * pad)[:pad]} for j in range(31)]
    return {"schema_version": "v1", "attributes": pairs}


def classes(tag: str, pad: int, edges: int = 0, runtimes: int = 33, count: int = 8) -> list[dict]:
    """`count` classes of `runtimes` runtimes each (their defaults told apart by `tag`), every runtime a
    long version with `edges` compatible versions, and nothing a body may leave out (no name, no overhead)."""
    def rt(c: int, r: int) -> dict:
        out = {"version": long_version(f"{tag if r == 0 else 'r'}{c}.{r}", pad)}
        if edges:
            out["compatible_versions"] = [long_version(f"e{c}.{r}.{e}", pad) for e in range(edges)]
        return out

    return [{"sandbox_class": f"c{c}", "default_runtime": rt(c, 0),
             "restorable_runtimes": [rt(c, r) for r in range(1, runtimes)]} for c in range(count)]


def largest_under(limit: int, **shape) -> int:
    """The longest attribute values (`pad`) for which a registration of `classes(**shape)` stays under `limit`."""
    pad = 16
    while len(encode(registration("w-big", classes=classes("a", pad + 1, **shape)))) < limit:
        pad += 1
    assert pad < 256, f"{shape} cannot make {limit} bytes"  # an attribute's value is at most 256 characters
    return pad


# --- the rule, pure ----------------------------------------------------------------------------------


def changed(new_build: str, old_build: str, pad: int = 0) -> RuntimeChanged:
    extra = {"k": "x" * pad} if pad else {}
    return RuntimeChanged(at=AT, worker_id="w-1", sandbox_classes=(entry(version(new_build, **extra)),),
                          previous=(entry(version(old_build, **extra)),), revision=7)


def test_an_event_fits_up_to_the_servers_max_payload_less_the_headroom_and_not_a_byte_more():
    event = changed("v2", "v1", pad=200)
    size = len(encode(event))
    check_fits(event, size + EVENT_HEADROOM)  # exactly the room: taken
    check_fits(event, None)  # the server's limit not known: not checked
    with pytest.raises(ContractError) as refused:
        check_fits(event, size + EVENT_HEADROOM - 1)
    error = refused.value
    assert (error.code, error.field) == (ErrorCode.INVALID_ARGUMENT, "sandbox_classes")
    half = len(encode(event.sandbox_classes))
    assert half == len(encode(event.previous))
    assert error.message.startswith(
        f"worker 'w-1': this registration changes its runtimes, and the RuntimeChanged event recording the change, "
        f"which carries the new sandbox_classes ({half} bytes) and the previous ones it replaces ({half} bytes), "
        f"would be {size} bytes, past the {size - 1} bytes an event may be where the NATS server carries "
        f"{size + EVENT_HEADROOM - 1} in one message (its max_payload, less {EVENT_HEADROOM} for the message's "
        "headers). Nothing was written: the registration in force stays."), error.message
    assert "remove the worker and register it anew" in error.message
    assert too_large_for_an_event(error)
    assert not too_large_for_an_event(ContractError(ErrorCode.INVALID_ARGUMENT, "body of 2 bytes exceeds the limit"))


def test_a_registration_and_an_update_are_measured_too_and_name_their_field():
    registered = WorkerRegistered(at=AT, worker_id="w-1", node="n", capacity=worker("w-1", version("v1")).capacity,
                                  labels={"zone": "a"}, sandbox_classes=(entry(version("v1", k="x" * 300)),))
    with pytest.raises(ContractError) as refused:
        check_fits(registered, len(encode(registered)) + EVENT_HEADROOM - 1)
    assert refused.value.field == "sandbox_classes" and "the WorkerRegistered event recording this registration" \
        in refused.value.message
    updated = WorkerUpdated(at=AT, worker_id="w-1", node="n", capacity=registered.capacity,
                            labels={f"k{i}": "v" * 63 for i in range(64)})
    with pytest.raises(ContractError) as refused:
        check_fits(updated, len(encode(updated)) + EVENT_HEADROOM - 1)
    assert refused.value.field == "labels" and too_large_for_an_event(refused.value)


def test_a_worker_refused_a_change_too_large_records_nothing_and_stays_as_it_was():
    """Every event of the registration is measured before any is recorded: the aggregate (which the store
    caches) is left as it was, not with a WorkerUpdated recorded and its RuntimeChanged refused."""
    first = worker("w-1", runtime(version("v1", k="x" * 300)), labels={"zone": "a"})
    w = Worker("w-1")
    w.register(first, AT)
    w.collect_events()
    before = (w.version, w.sandbox_classes, w.labels)
    # a change of runtimes and of labels: a RuntimeChanged (too large) and a WorkerUpdated (small)
    second = msgspec.structs.replace(worker("w-1", runtime(version("v2", k="x" * 300)), labels={"zone": "b"}),
                                     node=first.node)
    room = len(encode(RuntimeChanged(at=AT, worker_id="w-1", sandbox_classes=w.sandbox_classes,
                                     previous=w.sandbox_classes))) + EVENT_HEADROOM - 1
    with pytest.raises(ContractError) as refused:
        w.register(second, AT, max_payload=room)
    assert refused.value.field == "sandbox_classes"
    assert w.pending_events == [] and (w.version, w.sandbox_classes, w.labels) == before
    # the same registration beginning a new life is one WorkerRegistered, carrying the classes once: it fits
    fresh = Worker("w-1")
    assert fresh.register(second, AT, max_payload=room).value == "REGISTERED"


def test_the_headroom_holds_the_headers_of_the_longest_event_message_of_a_batch():
    """What an event message of an atomic batch carries besides its body, for the longest worker id and
    prefix and the largest numbers: within EVENT_HEADROOM, as the message's headers count against
    max_payload too (`events.natspy.publish`)."""
    worker_id = "w" * 128  # the longest id
    prefix = "p" * 32  # the longest prefix (`events.subjects.check_prefix`)
    stored = StoredEvent(originator_id=f"worker.{worker_id}", originator_version=2 ** 53, topic="RuntimeChanged",
                         state=b"")
    headers = event_headers(stored)
    headers.update({EXPECTED_SUBJECT_SEQ_HEADER: str(2 ** 64), EXPECTED_SUBJECT_SEQ_SUBJECT_HEADER:
                    f"{prefix}.ev.booking.{worker_id}", BATCH_ID_HEADER: "N" * 22, BATCH_SEQ_HEADER: "1000",
                    BATCH_COMMIT_HEADER: "1"})
    assert len(header_block(headers)) < EVENT_HEADROOM - 256  # 613 bytes


# --- over the bus: the registry ----------------------------------------------------------------------


async def test_a_change_whose_event_is_past_max_payload_is_refused_naming_the_field_and_nothing_is_written(
        one_mb, prefix):
    """On a 1 MB server, a 0.6 MB registration is registered; its change (RuntimeChanged: 1.2 MB) is refused
    INVALID_ARGUMENT, field sandbox_classes, naming the server's max_payload, nothing written, and the
    registration in force is still the first (a beat naming it is answered, one naming the change is not). It
    was INTERNAL, nothing written either, and the worker's beats kept the first in force. The way out the
    refusal names, a new life, is taken: its WorkerRegistered carries the classes once."""
    url, nc = one_mb
    pad = largest_under(600_000, edges=2, runtimes=4)
    first = registration("w-big", classes=classes("a", pad, edges=2, runtimes=4), request_id="one", revision=1)
    second = registration("w-big", classes=classes("b", pad, edges=2, runtimes=4), request_id="two", revision=2)
    assert 550_000 < len(encode(second)) < 600_000
    async with running_registry(url, prefix, ttl_s=SILENT_TTL_S):
        reply, _ = await raw_request(nc, prefix, "register", "w-big", first, timeout=30)
        assert reply.get("outcome") == "REGISTERED", reply
        history, end = await worker_events(nc, prefix, "w-big"), await last_seq(nc, prefix)
        reply, headers = await raw_request(nc, prefix, "register", "w-big", second, timeout=30)
        error = reply["error"]
        assert (error["code"], error["field"]) == ("INVALID_ARGUMENT", "sandbox_classes"), reply
        assert headers["Nats-Service-Error-Code"] == "400"
        assert f"where the NATS server carries {ONE_MB} in one message (its max_payload" in error["message"]
        assert "this registration changes its runtimes, and the RuntimeChanged event" in error["message"]
        assert await worker_events(nc, prefix, "w-big") == history and await last_seq(nc, prefix) == end
        beat, _ = await raw_request(nc, prefix, "heartbeat", "w-big", {"revision": 1})
        assert "ttl_s" in beat, beat  # the registration in force is the first
        beat, _ = await raw_request(nc, prefix, "heartbeat", "w-big", {"revision": 2})
        assert beat["error"]["field"] == "revision", beat
        # the way out it names: remove the worker, and register it anew
        removed, _ = await raw_request(nc, prefix, "remove", "w-big", {"reason": "too large to change", "revision": 3})
        assert "seq" in removed, removed
        again, _ = await raw_request(nc, prefix, "register", "w-big", {**second, "request_id": "three", "revision": 4},
                                     timeout=30)
        assert again["outcome"] == "REGISTERED", again
        _, event = (await worker_events(nc, prefix, "w-big"))[-1]
        assert isinstance(event, WorkerRegistered) and event.revision == 4


async def test_a_first_registration_whose_event_is_past_max_payload_is_refused_before_anything_is_written(
        one_mb, prefix):
    """A registration within MAX_BODY and carried by the server, whose WorkerRegistered (every default spelt
    out: 264 runtimes' null names, zero overheads, empty edges) is past the server's max_payload: refused,
    naming the field, nothing written (it was INTERNAL)."""
    url, nc = one_mb
    pad = largest_under(ONE_MB - 2048)
    body = registration("w-big", classes=classes("a", pad), request_id="one")
    assert len(encode(body)) < min(MAX_BODY, ONE_MB)
    async with running_registry(url, prefix, ttl_s=SILENT_TTL_S):
        reply, _ = await raw_request(nc, prefix, "register", "w-big", body, timeout=30)
        error = reply["error"]
        assert (error["code"], error["field"]) == ("INVALID_ARGUMENT", "sandbox_classes"), reply
        assert "the WorkerRegistered event recording this registration" in error["message"]
        assert await last_seq(nc, prefix) == 0


async def test_on_warmboots_own_two_mb_server_a_change_within_max_body_can_be_past_it_and_is_refused(
        nats_url, nc, prefix):
    """warmboot's servers carry 2 MB, twice MAX_BODY; a change of a registration just under MAX_BODY whose
    runtimes leave out what a body may (name, overhead, edges) is past it all the same: 2.14 MB."""
    assert nc.max_payload == 2 * ONE_MB
    pad = largest_under(MAX_BODY)
    first = registration("w-big", classes=classes("a", pad), request_id="one")
    second = registration("w-big", classes=classes("b", pad), request_id="two")
    async with running_registry(nats_url, prefix, ttl_s=SILENT_TTL_S):
        reply, _ = await raw_request(nc, prefix, "register", "w-big", first, timeout=30)
        assert reply.get("outcome") == "REGISTERED", reply
        end = await last_seq(nc, prefix)
        reply, _ = await raw_request(nc, prefix, "register", "w-big", second, timeout=30)
        assert (reply["error"]["code"], reply["error"]["field"]) == ("INVALID_ARGUMENT", "sandbox_classes"), reply
        assert f"carries {2 * ONE_MB} in one message" in reply["error"]["message"]
        assert await last_seq(nc, prefix) == end


# --- over the bus: the agent and the scheduler ------------------------------------------------------


def bulky(config: str, pad: int = 250, edges: int = 32, restorable: int = 1) -> str:
    """`config` (agent_config's) with `edges` long literal compatible versions under its default runtime and
    under each of `restorable` restorable runtimes of its own (probed, assets v0, v0-1, ...): about 0.55 MB
    registered (0.27 MB more for each further one)."""
    def edge_tables(where: str, tag: str) -> str:
        out = ""
        for e in range(edges):
            pairs = ", ".join(f'k{j:02d} = "{(tag + str(e) + "." + str(j) + "-" + "x" * pad)[:pad]}"' for j in range(31))
            out += f'\n[[sandbox_classes.{where}.compatible_versions]]\nschema_version = "v1"\n' \
                   f'attributes = {{ architecture = "amd64", {pairs} }}\n'
        return out

    return config + edge_tables("default_runtime", "d") + "".join(
        f'\n[[sandbox_classes.restorable_runtimes]]\nname = "gvisor-v0{"-" + str(n) if n else ""}"\nprofile = "gvisor"\n'
        f'attributes = {{ gvisor_asset_hash = "v0{"-" + str(n) if n else ""}" }}\n' + edge_tables("restorable_runtimes", f"r{n}")
        for n in range(restorable))


@asynccontextmanager
async def counted_registry(url: str, prefix: str, **heard) -> AsyncIterator[RegistryService]:
    """A registry replica on a connection of its own, beating every few seconds (a third of a 10 s TTL), each
    verb named in `heard` (`heartbeat=queue.put_nowait`) handed to its function as it arrives."""
    async with running_registry(url, prefix, ttl_s=10, heard=heard) as registry:
        yield registry


async def test_an_agent_refused_a_change_too_large_drains_its_worker_and_no_resume_is_placed_on_it_after(
        one_mb, prefix, tmp_path):
    """The agent's worker (0.55 MB of runtimes) runs actor a-1, suspended with a memory image stamped with
    its default v1. The file moves the default to v2 and drops v1: the change is refused (1.1 MB on a 1 MB
    server). The agent drains its worker before its next beat, and beats on (its running actors stay); the
    resume of a-1 goes to w-2, which runs v1, and, in stream order, nothing is placed on w-a after the
    refusal. Then the file is mended (what fits) and taken, and the agent says the worker stays drained.
    Before, the refusal was INTERNAL, and w-a, beaten under the registration it could not replace, went on
    taking resumes of v1 images."""
    url, nc = one_mb
    path = tmp_path / "agent.toml"
    path.write_text(bulky(agent_config("v1")))
    async with AsyncExitStack() as exits:
        await start_services(exits, list(SERVICES), url, prefix, options={"registry": {"ttl_s": SILENT_TTL_S}})
        wb = Client(nc, prefix)
        agent = Agent(url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
        said = await exits.enter_async_context(agent_said())
        await exits.enter_async_context(agent_running(agent))
        await said.until("registered w-a: REGISTERED")
        await wb.create(actor("a-1"))
        placed = await wb.resume("a-1")
        assert (placed.worker_id, placed.sandbox_runtime.version) == ("w-a", probed("v1"))
        await wb.suspend("a-1", Fidelity.MEMORY)
        await wb.register(msgspec.convert(registration("w-2", node="node-b", default=msgspec.to_builtins(
            {"version": probed("v1")})), RegisterWorker))

        path.write_text(bulky(agent_config("v2")))  # v1 dropped: a RuntimeChanged of 1.1 MB
        lines = await said.until("drained (seq")
        refused = [line for line in lines if "was refused as too large; the worker is drained before its next beat" in line]
        assert refused and "INVALID_ARGUMENT sandbox_classes" in refused[0] and f"carries {ONE_MB}" in refused[0]
        drained_at, drained = await wait_event(nc, prefix, "w-a", WorkerDrained)
        assert "refused as too large" in drained.reason

        again = await wb.resume("a-1")
        assert (again.worker_id, again.fidelity, again.sandbox_runtime.version) == ("w-2", PlacedFidelity.MEMORY,
                                                                                    probed("v1"))
        # the refused change wrote nothing; in stream order, w-a's one placement (a-1's first) precedes its drain
        assert [type(e).__name__ for _, e in await worker_events(nc, prefix, "w-a")] == ["WorkerRegistered",
                                                                                          "WorkerDrained"]
        log = await read_log(nc, prefix)
        (first_placed,) = [seq for seq, e in log if isinstance(e, ActorPlaced) and e.worker_id == "w-a"]
        assert first_placed <= placed.seq < drained_at

        path.write_text(agent_config("v2"))  # mended: what fits
        await said.until("stays drained in this life")
        _, change = await wait_event(nc, prefix, "w-a", RuntimeChanged, after=drained_at)
        assert change.sandbox_classes[0].default_runtime.version == probed("v2")
        await wb.create(actor("a-2"))  # w-a, drained for the rest of its life, takes nothing new
        assert (await wb.resume("a-2")).worker_id == "w-2"


async def test_an_agent_whose_drain_is_not_answered_beats_no_more_and_its_worker_ends_lost_then_comes_back(
        one_mb, prefix, tmp_path):
    """The drain the agent owes after its change was refused as too large is not answered (the test holds
    every drain UNAVAILABLE): the agent sends no beat meanwhile, so the registration it could not replace is
    removed as LOST within the TTL (not kept alive by beats for as long as the drain fails). Once drains are
    answered, its drain finds the worker in no life, its beat is NOT_FOUND, and it registers anew what the
    file says: a new life, whose WorkerRegistered carries the classes once and fits, undrained."""
    url, nc = one_mb
    held, drains, beats = asyncio.Event(), asyncio.Queue(), []

    def holding(drain):
        async def held_drain(worker_id, request):
            drains.put_nowait(request)
            if not held.is_set():
                raise unavailable("the test holds every drain")
            return await drain(worker_id, request)
        return held_drain

    path = tmp_path / "agent.toml"
    path.write_text(bulky(agent_config("v1")))
    registry_nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    registry = RegistryService(registry_nc, nats_url=url, prefix=prefix, ttl_s=2)
    registry.drain, registry.heartbeat = holding(registry.drain), counting(registry.heartbeat, beats.append)
    await registry.start()
    heard_for_long(registry)  # an expired clock is a silence at once (the replica started a moment ago)
    try:
        agent = Agent(url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
        async with agent_said() as said, agent_running(agent):
            await said.until("registered w-a: REGISTERED")
            start = await last_seq(nc, prefix)
            path.write_text(bulky(agent_config("v2")))  # refused: too large a change
            first = await asyncio.wait_for(drains.get(), 20)
            assert "refused as too large" in first.reason
            beaten = len(beats)  # every beat of the loop before the drain was asked is answered by now
            lost_at, lost = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=start)
            assert lost.reason == "LOST" and len(beats) == beaten  # no beat since the drain was first asked
            held.set()
            _, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=lost_at)
            assert again.sandbox_classes[0].default_runtime.version == probed("v2")
            await said.until("registered w-a: REGISTERED")
            history = [type(e).__name__ for _, e in await worker_events(nc, prefix, "w-a")]
            assert history == ["WorkerRegistered", "WorkerRemoved", "WorkerRegistered"], history
    finally:
        await registry.stop()
        await registry_nc.close()


async def test_an_agent_refused_too_large_again_in_a_later_life_drains_its_worker_again(one_mb, prefix, tmp_path):
    """A drain is of one life. The agent's worker is drained after a change refused as too large; the file
    is put back (the refusal ends, the worker stays drained); the worker is removed, and the agent registers
    it anew: a new life, undrained. The same change made again is refused again, and the worker of this life
    is drained before its next beat. Before, the agent still held the first life's drain as had, and beat the
    new life's registration, which the file no longer made, undrained: placements went on under it."""
    url, nc = one_mb
    beats: asyncio.Queue = asyncio.Queue()

    path = tmp_path / "agent.toml"
    path.write_text(bulky(agent_config("v1")))
    # beats every few seconds (a third of the TTL): the removal is heard at the next one
    async with counted_registry(url, prefix, heartbeat=beats.put_nowait):
        agent = Agent(url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
        async with agent_said() as said, agent_running(agent):
            await said.until("registered w-a: REGISTERED")
            path.write_text(bulky(agent_config("v2")))  # refused: too large a change
            await said.until("drained (seq")
            path.write_text(bulky(agent_config("v1")))  # put back: the refusal ends, the worker stays drained
            await said.until("makes the registration in force again")
            removed, _ = await raw_request(nc, prefix, "remove", "w-a", {"reason": "moved its actors; undrained anew"})
            assert "seq" in removed, removed
            await said.until("registered w-a: REGISTERED")  # a new life, undrained
            life = (await worker_events(nc, prefix, "w-a"))[-1]
            assert isinstance(life[1], WorkerRegistered), life

            path.write_text(bulky(agent_config("v2")))  # the same change again: refused again
            await said.until("was refused as too large; the worker is drained before its next beat")
            while not beats.empty():
                beats.get_nowait()
            # the first beat after this may have been on its way before the refusal; the second went after it
            for _ in range(2):
                await asyncio.wait_for(beats.get(), 20)
            since = [type(e).__name__ for seq, e in await worker_events(nc, prefix, "w-a") if seq > life[0]]
            assert since == ["WorkerDrained"], since


async def test_an_agent_refused_too_large_in_no_life_drains_nothing_more_and_registers_once_a_beat(
        one_mb, prefix, tmp_path):
    """A registration refused as too large while the worker is in no life (removed, its agent's next
    WorkerRegistered past what the registry's server carries: here a registry whose server carries less than
    the agent's, its limit lowered): there is nothing to drain. The agent asks once, hears NOT_FOUND, holds the
    worker as out of placement, and registers again once a beat. Before, it cleared the refusal, so the next
    refusal asked for a beat at once: a drain, a beat and a registration of half a megabyte about every 0.2 s
    for as long as it ran. Counted at the registry, not timed: three refused registrations, one drain."""
    url, nc = one_mb
    drains: list = []
    registers: asyncio.Queue = asyncio.Queue()
    path = tmp_path / "agent.toml"
    path.write_text(bulky(agent_config("v1")))
    async with counted_registry(url, prefix, drain=drains.append, register=registers.put_nowait) as registry:
        agent = Agent(url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
        async with agent_said() as said, agent_running(agent):
            await said.until("registered w-a: REGISTERED")
            registry.store.max_payload = lambda: 200_000  # its WorkerRegistered, about 0.55 MB, no longer fits
            removed, _ = await raw_request(nc, prefix, "remove", "w-a", {"reason": "moved"})
            assert "seq" in removed, removed
            await said.until("was refused as too large")  # the new life's registration, refused
            while not registers.empty():
                registers.get_nowait()
            for _ in range(3):  # three more registrations, each after a beat answered NOT_FOUND
                await asyncio.wait_for(registers.get(), 30)
            assert len(drains) == 1, drains
            assert [type(e).__name__ for _, e in await worker_events(nc, prefix, "w-a")] == [
                "WorkerRegistered", "WorkerRemoved"]


async def test_an_agent_whose_edit_is_too_large_to_send_drains_its_worker(prefix, tmp_path):
    """On a server that carries 512 KB in a message (less than MAX_BODY, which the agent checks its file
    against), an edit whose registration is past it (the client's refusal: nothing sent) is refused for its
    size as one whose event is: the worker is drained before its next beat. Before, only an event past
    max_payload drained it; a body past it was an ordinary refused edit, and the registration in force, which
    the file no longer makes, went on taking resumes. (A body past MAX_BODY: the next test.)"""
    server = NatsServer(tmp_path / "nats", extra_config="max_payload: 512KB\n").start()
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    try:
        assert nc.max_payload == 512 * 1024
        path = tmp_path / "agent.toml"
        path.write_text(agent_config("v1"))
        async with running_registry(server.url, prefix, ttl_s=SILENT_TTL_S):
            agent = Agent(server.url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
            async with agent_said() as said, agent_running(agent):
                await said.until("registered w-a: REGISTERED")
                path.write_text(bulky(agent_config("v2")))  # about 0.55 MB: past the server's 512 KB
                lines = await said.until("drained (seq")
                refused = [line for line in lines if "was refused as too large; the worker is drained" in line]
                assert refused and "nothing was sent" in refused[0], lines
                _, drained = await wait_event(nc, prefix, "w-a", WorkerDrained)
                assert "refused as too large" in drained.reason
                assert [type(e).__name__ for _, e in await worker_events(nc, prefix, "w-a")] == [
                    "WorkerRegistered", "WorkerDrained"]
    finally:
        await nc.close()
        server.kill()


@asynccontextmanager
async def agent_registered(url: str, prefix: str, path, **heard) -> AsyncIterator[Any]:
    """w-a's agent of the file `path` (written as agent_config("v1"), watched every 0.05 s), on a registry of
    counted handlers (`counted_registry`, `heard`), once it has registered the worker: what it says
    (`agent_said`)."""
    path.write_text(agent_config("v1"))
    async with counted_registry(url, prefix, **heard):
        agent = Agent(url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
        async with agent_said() as said, agent_running(agent):
            await said.until("registered w-a: REGISTERED")
            yield said


@asynccontextmanager
async def machine_agent(url: str, prefix: str, tmp_path, first: str | None = None,
                        **options) -> AsyncIterator[tuple[Any, Any, Any, Any]]:
    """w-a's agent of the file `first` (agent_config("v1") if not given) on an amd64 machine whose cpuinfo the test
    swaps (CPUINFO at first), both read every 0.05 s (`counted_probe`: its reads can be awaited), once it has
    registered the worker; `options` are the Agent's. (what it says, `agent_said`; its cpuinfo; its file; its reads
    of the machine)"""
    cpuinfo = tmp_path / "cpuinfo"
    shutil.copy(CPUINFO, cpuinfo)
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1") if first is None else first)
    probe, reads = counted_probe(cpuinfo)
    agent = Agent(url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe_interval_s=0.05,
                  probe=probe, **options)
    async with agent_said() as said, agent_running(agent):
        await said.until("registered w-a: REGISTERED")
        yield said, cpuinfo, path, reads


async def test_an_agent_whose_edit_is_past_max_body_sends_nothing_and_drains_its_worker(nats_url, nc, prefix,
                                                                                         tmp_path):
    """An edit whose registration is past MAX_BODY, which no registry decodes (on warmboot's 2 MB server, which
    would carry it): the agent sends nothing, and drains its worker before its next beat, as for any
    registration refused for its size. The file put back to the registration in force ends the refusal, and
    the worker stays drained. Before, the agent ignored it as an invalid edit, as a typo, and beat on the
    registration in force, which the file no longer made: resumes went on being placed under runtimes the file
    had dropped, where a smaller edit of the same runtimes drained the worker."""
    registers: list = []
    path = tmp_path / "agent.toml"
    async with agent_registered(nats_url, prefix, path, register=registers.append) as said:
        registers.clear()
        path.write_text(bulky(agent_config("v2"), restorable=3))  # about 1.1 MB
        lines = await said.until("drained (seq")
        refused = [line for line in lines if "was refused as too large; the worker is drained" in line]
        assert refused and f"exceeds the limit of {MAX_BODY}" in refused[0], lines
        _, drained = await wait_event(nc, prefix, "w-a", WorkerDrained)
        assert "refused as too large" in drained.reason
        path.write_text(agent_config("v1"))
        await said.until("makes the registration in force again; the edit the agent refused is given up")
        assert registers == [], "the edit past MAX_BODY was sent"
        assert [type(e).__name__ for _, e in await worker_events(nc, prefix, "w-a")] == [
            "WorkerRegistered", "WorkerDrained"]


async def removed_and_beaten(nc, prefix: str, beats: asyncio.Queue, count: int = 3) -> int:
    """Remove w-a as an operator would, then wait for `count` beats of the agent after it: the sequence of the
    removal."""
    removed, _ = await raw_request(nc, prefix, "remove", "w-a", {"reason": "moved its actors"})
    assert "seq" in removed, removed
    while not beats.empty():
        beats.get_nowait()
    for _ in range(count):
        await asyncio.wait_for(beats.get(), 20)
    return removed["seq"]


async def test_an_agent_whose_file_is_past_max_body_registers_no_new_life_until_it_is_mended(nats_url, nc, prefix,
                                                                                             tmp_path):
    """The worker is removed while the file's registration is past MAX_BODY (the agent's own refusal, the worker
    drained). The agent registers nothing: there is no registration the file makes that a registry takes, as when
    a registry refuses it for its size (its new life's registration refused, nothing registered). Mended, the file
    registers the worker anew, undrained. Before, the beat's NOT_FOUND sent the registration in force again, which
    the file no longer made: a new life under runtimes the file had dropped, undrained until the beat after it."""
    beats: asyncio.Queue = asyncio.Queue()
    path = tmp_path / "agent.toml"
    async with agent_registered(nats_url, prefix, path, heartbeat=beats.put_nowait) as said:
        path.write_text(bulky(agent_config("v2"), restorable=3))  # about 1.1 MB
        await said.until("drained (seq")
        removed = await removed_and_beaten(nc, prefix, beats)
        since = [type(e).__name__ for seq, e in await worker_events(nc, prefix, "w-a") if seq > removed]
        assert since == [], since
        path.write_text(agent_config("v2"))  # mended: what fits
        await said.until("registered w-a: REGISTERED")
        since = [(type(e).__name__, e) for seq, e in await worker_events(nc, prefix, "w-a") if seq > removed]
        assert [name for name, _ in since] == ["WorkerRegistered"], since
        assert since[0][1].sandbox_classes[0].default_runtime.version == probed("v2")


async def test_a_cpu_change_while_the_file_is_past_max_body_does_not_end_the_refusal(nats_url, nc, prefix, tmp_path):
    """The file's registration is past MAX_BODY (the worker drained), then the machine moves to another CPU: the
    registration in force is made again on it (a RESTAMP, the same life, drained). That registration taken is
    not the file's: the refusal stays, and the worker, removed, is registered in no new life until the file is
    mended. Before, the new reading of the machine was not taken for the file's (it was not an edit), the
    RESTAMP taken ended the refusal, and after the removal the agent registered, undrained, runtimes the file no
    longer made."""
    beats: asyncio.Queue = asyncio.Queue()
    async with counted_registry(nats_url, prefix, heartbeat=beats.put_nowait):
        async with machine_agent(nats_url, prefix, tmp_path) as (said, cpuinfo, path, _):
            path.write_text(bulky(agent_config("v2"), restorable=3))  # about 1.1 MB
            await said.until("drained (seq")
            shutil.copy(AMD, cpuinfo)
            await said.until("registered w-a: RUNTIME_CHANGED")  # v1 made again on the AMD CPU
            removed = await removed_and_beaten(nc, prefix, beats)
            since = [type(e).__name__ for seq, e in await worker_events(nc, prefix, "w-a") if seq > removed]
            assert since == [], since


@pytest.mark.parametrize("mended", ["v2", "v1"])  # another registration, or the one the worker had (a RESTAMP)
async def test_a_removed_worker_whose_file_is_past_max_body_is_not_registered_when_its_machine_reads_again(
        nats_url, nc, prefix, tmp_path, mended):
    """The agent removed its worker (the probe could not read the machine: `withdrawn`), and meanwhile the file's
    registration went past MAX_BODY. When the machine reads again, no new life is begun: not with the
    registration the worker had (a RESTAMP), which the file no longer makes. Mended, the file registers it.
    Before, a removed worker's file past MAX_BODY was ignored as a typo, and the RESTAMP began a life, undrained,
    under the runtimes the file had dropped."""
    registers: list = []
    async with counted_registry(nats_url, prefix, register=registers.append):
        async with machine_agent(nats_url, prefix, tmp_path, unreadable_grace_s=0.0) as (said, cpuinfo, path, reads):
            cpuinfo.unlink()  # the probe cannot read the machine, twice: the worker is removed
            removed, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved)
            path.write_text(bulky(agent_config("v2"), restorable=3))  # about 1.1 MB
            registers.clear()
            shutil.copy(CPUINFO, cpuinfo)  # the machine reads again
            await said.until(f"exceeds the limit of {MAX_BODY}")
            await reads_after(reads, 20)  # 20 new reads of the machine: a RESTAMP of the removed worker at each
            since = [type(e).__name__ for seq, e in await worker_events(nc, prefix, "w-a") if seq > removed]
            assert since == [] and registers == [], (since, registers)
            path.write_text(agent_config(mended))  # mended: what fits
            _, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=removed, timeout=5)
            assert again.sandbox_classes[0].default_runtime.version == probed(mended)
            assert [type(e).__name__ for seq, e in await worker_events(nc, prefix, "w-a") if seq > removed] == [
                "WorkerRegistered"]


async def test_an_edit_past_max_body_made_while_the_probe_cannot_read_drains_the_worker_once_it_reads(
        nats_url, nc, prefix, tmp_path):
    """The file is edited past MAX_BODY while the probe cannot read the machine (for a moment, within its grace:
    the worker stays registered and beaten). The edit cannot be made then, and is ignored as any read the probe
    fails. Once the machine reads again, as before, the same file makes a registration past MAX_BODY: the worker
    is drained. Before, that read was not an edit (the file's content had not changed since the last read), so
    the refusal went unsaid and unheld, and the registration in force, which the file no longer made, was beaten
    undrained for as long as the agent ran."""
    async with counted_registry(nats_url, prefix):
        async with machine_agent(nats_url, prefix, tmp_path, unreadable_grace_s=120) as (said, cpuinfo, path, reads):
            cpuinfo.unlink()
            await reads_after(reads, 5)  # reads of the machine, each failing
            path.write_text(bulky(agent_config("v2"), restorable=3))  # about 1.1 MB
            await said.until("ignoring the edit of")
            shutil.copy(CPUINFO, cpuinfo)  # the machine reads again, as registered
            await said.until("drained (seq", timeout_s=15)
            _, drained = await wait_event(nc, prefix, "w-a", WorkerDrained)
            assert "refused as too large" in drained.reason
            assert [type(e).__name__ for _, e in await worker_events(nc, prefix, "w-a")] == [
                "WorkerRegistered", "WorkerDrained"]


async def test_an_edit_on_its_way_taken_after_the_file_went_past_max_body_leaves_the_worker_drained(
        nats_url, nc, prefix, tmp_path):
    """An edit that fits (v2) is on its way (the registry holds it) when the file goes past MAX_BODY: taken
    after, it is not what the file makes, and the worker is drained all the same. The file put back to that
    edit, the registration in force, ends the refusal (said), and the worker stays drained in its life. Before,
    the edit taken was held as the file's (`_edit_refused` cleared), so the file put back to it ended nothing:
    the refusal was held, unsaid, and drained the worker at its next beat if it had not been yet."""
    hold = Holding(lambda request: request.sandbox_classes[0].default_runtime.name == "gvisor-v2")
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    async with running_registry(nats_url, prefix, ttl_s=10, heard={"register": hold}), hold:
        agent = Agent(nats_url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
        async with agent_said() as said, agent_running(agent):
            await said.until("registered w-a: REGISTERED")
            path.write_text(agent_config("v2"))
            await asyncio.wait_for(hold.held.wait(), 10)
            path.write_text(bulky(agent_config("v3"), restorable=3))  # about 1.1 MB
            await said.until("was refused as too large")
            hold.release()
            await said.until("registered w-a: RUNTIME_CHANGED")
            await wait_event(nc, prefix, "w-a", WorkerDrained)
            events = [type(e).__name__ for _, e in await worker_events(nc, prefix, "w-a")]
            assert sorted(events[1:]) == ["RuntimeChanged", "WorkerDrained"], events
            path.write_text(agent_config("v2"))  # put back to the registration in force
            await said.until("makes the registration in force again; the edit the agent refused is given up")


async def test_a_restamp_refused_for_the_budget_while_the_file_is_past_max_body_begins_no_life(
        nats_url, nc, prefix, tmp_path):
    """The file's registration is past MAX_BODY (the worker drained; the budget, one write, spent by the
    registration), then the machine moves to another CPU. Its RESTAMP (the registration in force
    made on the new CPU) is refused for the worker's write budget: the agent removes the worker (a removal is
    free), as it must not stay registered with a CPU its machine no longer has. Then nothing is sent: the
    registration in force, which the file no longer makes, begins no life, the budget earned back or not. Mended,
    the file registers the worker anew. Before, `_send` sent that registration again at once after the removal,
    and once the budget was earned back, began a life undrained under runtimes the file had dropped."""
    heard: list[str] = []
    clock = Clock()
    verbs = {verb: (lambda _, verb=verb: heard.append(verb)) for verb in ("register", "drain", "remove")}
    async with running_registry(nats_url, prefix, ttl_s=10, writes=WriteBudget(1, 10.0, clock), heard=verbs):
        async with machine_agent(nats_url, prefix, tmp_path) as (said, cpuinfo, path, reads):
            path.write_text(bulky(agent_config("v2"), restorable=3))  # about 1.1 MB
            await said.until("drained (seq")
            shutil.copy(AMD, cpuinfo)  # the RESTAMP is refused for the budget: the worker is removed
            removed, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved)
            await reads_after(reads, 20)
            assert heard[heard.index("remove"):] == ["remove"], heard
            clock.now += 10.0  # the budget earned back
            await reads_after(reads, 20)
            assert heard[heard.index("remove"):] == ["remove"], heard
            assert [type(e).__name__ for seq, e in await worker_events(nc, prefix, "w-a") if seq > removed] == []
            path.write_text(agent_config("v2"))  # mended: what fits
            _, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=removed, timeout=5)
            assert again.sandbox_classes[0].default_runtime.version == probed("v2", AMD)
            assert [type(e).__name__ for seq, e in await worker_events(nc, prefix, "w-a") if seq > removed] == [
                "WorkerRegistered"]


async def removed_under_a_restamp(nc, prefix: str, hold: Holding, cpuinfo) -> int:
    """The machine moves to the AMD CPU; the RESTAMP the agent sends for it is held at the registry (`hold`, armed
    here: its `which` picks the RESTAMP) while an operator removes w-a, then released: the removal's sequence."""
    hold.armed = True
    shutil.copy(AMD, cpuinfo)
    await asyncio.wait_for(hold.held.wait(), 20)  # the RESTAMP, on its way
    removed, _ = await raw_request(nc, prefix, "remove", "w-a", {"reason": "moved its actors"})
    hold.release()
    return removed["seq"]


async def three_lives(nc, prefix: str, removed: int) -> list:
    """After the removal at `removed`, the life the RESTAMP begins, its end, and the life of the file: the three
    events (WorkerRegistered, WorkerRemoved, WorkerRegistered), each within 10 s of the last."""
    events, after = [], removed
    for _ in range(3):
        after, event = await wait_event(nc, prefix, "w-a", (WorkerRegistered, WorkerRemoved), after=after,
                                        timeout=10)
        events.append(event)
    return events


async def test_a_restamp_that_begins_a_life_while_the_file_is_past_max_body_ends_it(nats_url, nc, prefix, tmp_path):
    """The file's registration is past MAX_BODY (the worker drained), then the machine moves to another CPU, and
    an operator removes the worker while the RESTAMP (the registration in force made on the new CPU) is on its
    way. Taken after the removal, it begins a life under the registration the file no longer makes: the agent
    removes the worker at once, and registers nothing until the file is mended. Before, that life took
    placements, undrained, until the drain before the agent's next beat."""
    hold = Holding(armed=False)
    async with running_registry(nats_url, prefix, ttl_s=10, heard={"register": hold}), hold:
        async with machine_agent(nats_url, prefix, tmp_path) as (said, cpuinfo, path, reads):
            path.write_text(bulky(agent_config("v2"), restorable=3))  # about 1.1 MB
            await said.until("drained (seq")
            removed = await removed_under_a_restamp(nc, prefix, hold, cpuinfo)
            began, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=removed)
            ended, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=began, timeout=10)
            await reads_after(reads, 20)
            since = [type(e).__name__ for seq, e in await worker_events(nc, prefix, "w-a") if seq > removed]
            assert since == ["WorkerRegistered", "WorkerRemoved"], since
            path.write_text(agent_config("v2"))  # mended: what fits
            _, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=ended, timeout=5)
            assert again.sandbox_classes[0].default_runtime.version == probed("v2", AMD)


MICROVM = """
[[sandbox_classes]]
sandbox_class = "microvm"

[sandbox_classes.default_runtime]
name = "fc-1"
profile = "microvm"
attributes = { kernel_digest = "k1", rootfs_digest = "r1" }
"""


async def test_a_restamp_that_begins_a_life_after_a_removal_takes_the_classes_the_file_lists(nats_url, nc, prefix,
                                                                                            tmp_path):
    """The file adds a class, which the registry refuses to the live worker (a change of class needs a new life;
    the agent says so). Then the machine moves to another CPU: the file's registration made on it is refused
    again, and the registration in force is made on it (a RESTAMP). The operator removes the worker, as the
    refusal tells them to, while the RESTAMP is on its way: taken after, it begins a life with the classes of
    the last one. The agent ends that life and begins one with what the file lists, as after a reconnect. Before,
    the worker lived on without the file's class for as long as the agent ran (the file's registration counted
    as sent already)."""
    hold = Holding(lambda request: len(request.sandbox_classes) == 1, armed=False)
    async with running_registry(nats_url, prefix, ttl_s=10, heard={"register": hold}), hold:
        async with machine_agent(nats_url, prefix, tmp_path) as (said, cpuinfo, path, _):
            path.write_text(agent_config("v1") + MICROVM)
            await said.until("the registry refused the edit")
            removed = await removed_under_a_restamp(nc, prefix, hold, cpuinfo)
            events = await three_lives(nc, prefix, removed)
            lives = [sorted(c.sandbox_class for c in getattr(e, "sandbox_classes", ())) for e in events]
            assert lives == [["gvisor"], [], ["gvisor", "microvm"]], lives
            on = {c.sandbox_class: c.default_runtime.version for c in events[-1].sandbox_classes}
            assert on["gvisor"] == probed("v1", AMD)


async def test_a_registration_whose_send_removed_the_worker_begins_the_life_the_file_makes_now(nats_url, nc,
                                                                                               prefix, tmp_path):
    """An edit adding a class waits for the worker's write budget; the file is edited again (the class dropped
    again, a new default), then the machine moves to another CPU: the agent removes the worker (its registration
    claims the old CPU, and the registry takes none for now). Once the budget is earned back, the new life is
    what the file makes now, on the new CPU. Before, it was the edit the file had left (sent again as it was on
    its way), and the file's registration, sent after it, was refused as a change of class: the worker lived on
    with a class the file no longer listed."""
    clock = Clock()
    async with running_registry(nats_url, prefix, ttl_s=10, writes=WriteBudget(1, 10.0, clock)):
        async with machine_agent(nats_url, prefix, tmp_path) as (said, cpuinfo, path, reads):  # its one write
            path.write_text(agent_config("v1") + MICROVM)
            await said.until("spent its write budget")  # the edit, refused for the budget, is sent again
            path.write_text(agent_config("v2"))
            await reads_after(reads, 5)  # the edit read while the last one waits
            shutil.copy(AMD, cpuinfo)
            removed, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved)
            clock.now += 10.0  # a write earned back
            _, began = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=removed)
            assert [c.sandbox_class for c in began.sandbox_classes] == ["gvisor"], began.sandbox_classes
            assert began.sandbox_classes[0].default_runtime.version == probed("v2", AMD)


async def test_a_restamp_that_begins_a_life_after_a_change_refused_as_too_large_takes_the_files_runtimes(
        one_mb, prefix, tmp_path):
    """The file moves the default to v2 and drops v1 (0.55 MB of runtimes): the change is refused, its
    RuntimeChanged past a 1 MB server (the worker drained). The machine moves to another CPU: the file's
    registration made on it is refused again, and the registration in force is made on it (a RESTAMP). The
    operator removes the worker, as the refusal tells them to, while the RESTAMP is on its way: taken after, it
    begins a life with v1, the runtime the file dropped. The agent ends that life and begins one with what the
    file makes (its WorkerRegistered carries the classes once, and fits). Before, only a change of class was
    taken up: the life went on with v1, undrained (a taken registration ends the refusal), and the file's edit
    counted as sent already, for as long as the agent ran."""
    url, nc = one_mb
    hold = Holding(lambda request: request.sandbox_classes[0].default_runtime.name == "gvisor-v1", armed=False)
    async with running_registry(url, prefix, ttl_s=10, heard={"register": hold}), hold:
        async with machine_agent(url, prefix, tmp_path, bulky(agent_config("v1"))) as (said, cpuinfo, path, _):
            path.write_text(bulky(agent_config("v2")))  # v1 dropped: a RuntimeChanged of 1.1 MB
            await said.until("drained (seq")
            removed = await removed_under_a_restamp(nc, prefix, hold, cpuinfo)  # the RESTAMP: v1 on the new CPU
            events = await three_lives(nc, prefix, removed)
            defaults = [getattr(e, "sandbox_classes", ()) and e.sandbox_classes[0].default_runtime.version
                        for e in events]
            assert defaults == [probed("v1", AMD), (), probed("v2", AMD)], [type(e).__name__ for e in events]


async def test_a_registration_whose_send_removed_the_worker_follows_an_edit_made_after_the_removal(nats_url, nc,
                                                                                                  prefix, tmp_path):
    """As above, but the file is edited after the removal, while the registration waits for the worker's
    write budget: an edit adding a class waits for the budget, the machine moves to another CPU (the agent
    removes the worker), then the file drops the class again, with a new default. Once the budget is earned
    back, the new life is what the file makes then. Before, the registration on its way was made to follow the
    file once, at the removal: the edit made since waited its turn, the life began with the class the file had
    dropped, and the file's registration after it was refused as a change of class, for as long as the agent
    ran."""
    clock = Clock()
    async with running_registry(nats_url, prefix, ttl_s=10, writes=WriteBudget(1, 10.0, clock)):
        async with machine_agent(nats_url, prefix, tmp_path) as (said, cpuinfo, path, reads):  # its one write
            path.write_text(agent_config("v1") + MICROVM)
            await said.until("spent its write budget")  # the edit, refused for the budget, is sent again
            shutil.copy(AMD, cpuinfo)
            removed, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved)
            path.write_text(agent_config("v2"))  # the class dropped again, after the removal
            await reads_after(reads, 5)  # the edit read while the registration on its way waits
            clock.now += 10.0  # a write earned back
            _, began = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=removed)
            assert [c.sandbox_class for c in began.sandbox_classes] == ["gvisor"], began.sandbox_classes
            assert began.sandbox_classes[0].default_runtime.version == probed("v2", AMD)


async def test_an_edit_sent_to_a_removed_worker_follows_an_edit_made_while_it_waits(nats_url, nc, prefix, tmp_path):
    """The agent removed its worker (the probe could not read the machine), and the file was edited meanwhile
    (less memory). The machine reads again: the file's registration goes out, to begin a new life, and waits for
    the worker's write budget; meanwhile the file moves the default to v2 and drops v1. Once the budget is earned
    back, the new life is what the file makes then, on v2. Before, the edit sent first began the life on v1, which
    the file had dropped, until the file's registration after it was taken (the next write the budget allowed;
    with a change of class, never: refused to that life). Then the file is put back to the edit given up for the
    later one: it is sent (not held as sent already), and the worker leaves v2, which the file no longer lists."""
    clock = Clock()
    async with running_registry(nats_url, prefix, ttl_s=10, writes=WriteBudget(1, 10.0, clock)):
        async with machine_agent(nats_url, prefix, tmp_path, unreadable_grace_s=0.0) as (said, cpuinfo, path, reads):
            cpuinfo.unlink()  # the probe cannot read the machine, twice: the worker is removed
            removed, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved)
            path.write_text(agent_config("v1", memory_mib=4096))  # read, and not made: the probe cannot read
            await said.until("ignoring the edit of")
            shutil.copy(CPUINFO, cpuinfo)  # the machine reads again: the file's registration goes out
            await said.until("spent its write budget")  # and waits for the budget
            path.write_text(agent_config("v2"))  # v1 dropped
            await reads_after(reads, 5)  # the edit read while the registration on its way waits
            clock.now += 10.0  # a write earned back
            began_at, began = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=removed)
            assert began.sandbox_classes[0].default_runtime.version == probed("v2"), began.sandbox_classes
            assert began.capacity.memory_mib == 8192
            path.write_text(agent_config("v1", memory_mib=4096))  # put back to the edit given up
            clock.now += 10.0
            _, change = await wait_event(nc, prefix, "w-a", RuntimeChanged, after=began_at)
            assert change.sandbox_classes[0].default_runtime.version == probed("v1")


async def test_a_registration_whose_send_removed_the_worker_stops_once_the_file_goes_past_max_body(
        nats_url, nc, prefix, tmp_path, monkeypatch):
    """An edit waits for the worker's write budget; the machine moves to another CPU (the agent removes the
    worker); then, while the edit still waits, the file goes past MAX_BODY. Nothing is sent once the budget is
    earned back: the new life would be under a registration the file no longer makes. Mended, the file registers
    the worker. Before, the edit went on waiting and began a life, undrained until the drain before the next beat."""
    monkeypatch.setattr(agent_module, "RETRY_MAX_S", RETRY_MIN_S)  # an attempt each 0.2 s: 20 reads see several
    heard: list[str] = []
    clock = Clock()
    verbs = {verb: (lambda _, verb=verb: heard.append(verb)) for verb in ("register", "drain", "remove")}
    async with running_registry(nats_url, prefix, ttl_s=10, writes=WriteBudget(1, 10.0, clock), heard=verbs):
        async with machine_agent(nats_url, prefix, tmp_path) as (said, cpuinfo, path, reads):  # its one write
            path.write_text(agent_config("v2"))
            await said.until("spent its write budget")  # the edit, refused for the budget, is sent again
            shutil.copy(AMD, cpuinfo)
            removed, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved)
            path.write_text(bulky(agent_config("v3"), restorable=3))  # about 1.1 MB, while the edit waits
            await said.until(f"exceeds the limit of {MAX_BODY}")
            await said.until("nothing sent")  # the edit given up, its last attempt answered (refused for the budget)
            sent = len(heard)
            clock.now += 10.0  # a write earned back
            await reads_after(reads, 20)
            assert "register" not in heard[sent:], heard
            assert [type(e).__name__ for seq, e in await worker_events(nc, prefix, "w-a") if seq > removed] == []
            path.write_text(agent_config("v3"))  # mended: what fits
            _, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=removed, timeout=10)
            assert again.sandbox_classes[0].default_runtime.version == probed("v3", AMD)


@pytest.mark.parametrize("then", ["edited", "past_max_body"])
async def test_the_files_registration_after_a_restamps_life_follows_the_file_while_it_waits(
        nats_url, nc, prefix, tmp_path, monkeypatch, then):
    """As in the test of a RESTAMP that begins a life after a removal (the file adds a class the live worker was
    refused), but the file's registration the agent sends after ending the RESTAMP's life waits for the worker's
    write budget (refused for it here: the RESTAMP's life just paid), and meanwhile the file changes: it drops
    the class again with a new default (`edited`), or goes past MAX_BODY (`past_max_body`). The life begun once
    the registry takes a registration is what the file makes then, and none while the file is past MAX_BODY.
    Before, that send (its worker removed by the agent itself, but not `withdrawn`) did not follow the file: the
    life began with the class the file had dropped, and the file's registration after it was refused as a change
    of class; or it began under the registration the file no longer made, undrained until the next beat."""
    monkeypatch.setattr(agent_module, "RETRY_MAX_S", RETRY_MIN_S)  # an attempt each 0.2 s
    hold = Holding(lambda request: len(request.sandbox_classes) == 1, armed=False)
    refusing = {"on": False}
    heard: list = []

    def at_the_registry(request):
        heard.append(request)
        if refusing["on"] and hold.held.is_set() and len(request.sandbox_classes) == 2:
            raise exhausted("worker 'w-a' is held back by the test (its write budget)", "worker_id")
        return hold(request)

    async with running_registry(nats_url, prefix, ttl_s=10, heard={"register": at_the_registry}), hold:
        async with machine_agent(nats_url, prefix, tmp_path) as (said, cpuinfo, path, reads):
            path.write_text(agent_config("v1") + MICROVM)
            await said.until("the registry refused the edit")
            refusing["on"] = True  # from the RESTAMP held on: the file's two classes refused for the budget
            removed = await removed_under_a_restamp(nc, prefix, hold, cpuinfo)
            began, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=removed)
            ended, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=began, timeout=10)
            await said.until("held back by the test")  # the file's registration waits
            if then == "edited":
                path.write_text(agent_config("v2"))  # the class dropped again, a new default
            else:
                path.write_text(bulky(agent_config("v3"), restorable=3))  # about 1.1 MB
                await said.until(f"exceeds the limit of {MAX_BODY}")
            await reads_after(reads, 5)  # read while the registration waits
            refusing["on"] = False
            if then == "edited":
                _, life = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=ended, timeout=10)
                assert [c.sandbox_class for c in life.sandbox_classes] == ["gvisor"], life.sandbox_classes
                assert life.sandbox_classes[0].default_runtime.version == probed("v2", AMD)
                return
            await said.until("nothing sent")
            sent = len(heard)
            await reads_after(reads, 20)
            assert heard[sent:] == [], heard[sent:]
            assert [type(e).__name__ for seq, e in await worker_events(nc, prefix, "w-a") if seq > ended] == []
            path.write_text(agent_config("v3"))  # mended: what fits
            _, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=ended, timeout=10)
            assert again.sandbox_classes[0].default_runtime.version == probed("v3", AMD)


MICROVM_ONLY = '\n[capacity]\ncpu_millis = 4000\nmemory_mib = 8192\n\n[labels]\nzone = "a"\n' + MICROVM


async def test_an_edit_to_a_removed_worker_refused_by_a_life_it_did_not_begin_sends_what_the_file_makes_now(
        nats_url, nc, prefix, tmp_path, monkeypatch):
    """The agent removed its worker (the probe could not read the machine), and the file was edited meanwhile (a
    second class). The machine reads again: the file's registration goes out, and waits for the worker's write
    budget; meanwhile the file drops gvisor, and the send follows it (`_send`: a new life takes what the file
    makes). Then a life this agent did not begin holds the worker (gvisor): the file's registration is refused to
    it as a change of class, the agent removes it, and sends again what the file makes now: a life of microvm
    alone. Before, it sent again the edit it had given up (gvisor and microvm), recorded as made of the file's
    latest configuration, and the file's registration after it was refused to that life as a change of class:
    the worker lived on with gvisor, which the file no longer listed."""
    monkeypatch.setattr(agent_module, "RETRY_MAX_S", RETRY_MIN_S)  # an attempt each 0.2 s
    refusing = {"on": False}

    def at_the_registry(request):
        if refusing["on"] and (request.request_id or "").startswith("agent-"):
            raise exhausted("worker 'w-a' is held back by the test (its write budget)", "worker_id")

    async with running_registry(nats_url, prefix, ttl_s=10, heard={"register": at_the_registry}):
        async with machine_agent(nats_url, prefix, tmp_path, unreadable_grace_s=0.0) as (said, cpuinfo, path, reads):
            cpuinfo.unlink()  # the probe cannot read the machine, twice: the worker is removed
            removed, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved)
            refusing["on"] = True
            path.write_text(agent_config("v1") + MICROVM)  # read, and not made: the probe cannot read
            await said.until("ignoring the edit of")
            shutil.copy(CPUINFO, cpuinfo)  # the machine reads again: the file's registration goes out
            await said.until("held back by the test")  # and waits
            path.write_text(MICROVM_ONLY)  # gvisor dropped
            await reads_after(reads, 5)  # read while the registration waits
            other = registration("w-a", revision=time.time_ns() // 1_000_000)  # a life the agent did not begin
            reply, _ = await raw_request(nc, prefix, "register", "w-a", other)
            assert reply.get("outcome") == "REGISTERED", reply
            refusing["on"] = False
            ended, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=reply["seq"], timeout=10)
            _, life = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=ended, timeout=10)
            assert [c.sandbox_class for c in life.sandbox_classes] == ["microvm"], life.sandbox_classes
