"""The agent when things go wrong around it (found by a review of the agent and liveness):
the registry away for a while, a change the registry refused followed by a new life, a
CPU that changes under a running agent, a drain on exit that races the agent's own
registration across two registry replicas, and a cluster's comma-separated URL. On a real
nats-server with real registry replicas."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import shutil
from contextlib import asynccontextmanager, contextmanager
import time
from pathlib import Path
from typing import Iterator

import msgspec
import nats
import pytest
from click.testing import CliRunner

from events.compat import same_version
from events.errors import ContractError, unavailable
from events.natspy.publish import flush_in_order
from events.probe import probe_version
from events.aggregate import now
from events.schema import (ErrorCode, RuntimeChanged, WorkerDrained, WorkerRegistered, WorkerRemoved,
                           WorkerUpdated)
from events.subjects import bucket_name, service_subject
from services.commands import run_command_async
from tests.factories import last_seq
from tests.registry_helpers import (AMD, CPUINFO, PROBE, Said, a_machine, agent_config, raw_request,
                                    running_registry, wait_event, without_cpu_features, worker_events)
from tests.test_agent import agent_running, running_agent
from warmboot.cli import main
from warmboot.agent import (AGAIN, EDIT, RESTAMP, RESTAMP_AGAIN_S, RETRY_MAX_S, RETRY_MIN_S, UNREADABLE_GRACE_S,
                            Agent, next_delay)
from warmboot.agent_config import ConfigError, ProbeSettings, build_registration, load_registration, parse_config


MICROVM = """
[[sandbox_classes]]
sandbox_class = "microvm"

[sandbox_classes.default_runtime]
name = "fc-1"
attributes = { architecture = "amd64", cpu_vendor = "GenuineIntel", cpu_model = "6/143", kernel_digest = "k1", rootfs_digest = "r1" }
"""


def assets(entry) -> tuple[str | None, list[str | None]]:
    def asset(runtime):
        return {a.key: a.value for a in runtime.version.attributes}.get("gvisor_asset_hash")
    return asset(entry.default_runtime), [asset(r) for r in entry.restorable_runtimes]


# --- retries while the registry is away ----------------------------------------------------------


def test_retries_come_closer_together_as_the_last_beats_ttl_runs_out():
    # with time to spare: doubling up to the cap, as before
    assert [next_delay(d, 60.0) for d in (0.2, 0.4, 3.2, 5.0)] == [0.4, 0.8, 5.0, 5.0]
    assert next_delay(4.0) == RETRY_MAX_S  # no beat stored yet: no TTL to watch
    # a third of what is left, never below the floor
    assert next_delay(3.2, 3.9) == pytest.approx(1.3)
    assert next_delay(5.0, 0.3) == RETRY_MIN_S
    # past the TTL: a registry back after the outage gives the worker a new clock of one TTL
    # (`Hearing`), so at most a third of a TTL apart, as beats are (it was RETRY_MAX_S: no rush, the
    # worker being LOST anyway; a TTL shorter than that missed the new clock)
    assert next_delay(5.0, -1.0) == RETRY_MAX_S  # no TTL known
    assert next_delay(5.0, -1.0, 15.0) == RETRY_MAX_S  # a third of the default TTL: 5 s
    assert next_delay(5.0, -1.0, 2.0) == pytest.approx(2.0 / 3)
    assert next_delay(5.0, -1.0, 0.3) == RETRY_MIN_S


async def test_a_registry_away_for_less_than_the_ttl_does_not_get_a_live_agent_removed(nats_url, nc, prefix, tmp_path):
    """TTL 9 s, a beat every 3 s. The only registry replica goes away right after a beat
    and comes back 7 s later, with 2 s of the TTL of that beat left. Doubling
    to a 5 s cap, the agent's next attempts would have been 3.2 s and then 5 s apart, the
    last one after the expiry; they come closer together as the TTL runs out, and one lands
    in time: the worker, whose agent ran all along, is not removed."""
    ttl = 9.0
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    stored: asyncio.Queue[float] = asyncio.Queue()

    async def put(msg) -> None:  # each beat the bucket stores, when it is stored
        stored.put_nowait(time.monotonic())

    sub = await nc.subscribe(f"$KV.{bucket_name(prefix, 'heartbeats')}.w-a", cb=put)
    await flush_in_order(nc)
    try:
        async with running_agent(nats_url, prefix, path):
            async with running_registry(nats_url, prefix, ttl_s=ttl):
                await wait_event(nc, prefix, "w-a", WorkerRegistered)
                previous = await stored.get()  # the registration's beats, the heartbeat that tells the TTL...
                while (beat := await asyncio.wait_for(stored.get(), ttl)) - previous < ttl / 4:
                    previous = beat  # ...until a regular beat, a third of the TTL after the one before
            # away from right after it until 2 s of its TTL are left: the outage is measured against the
            # TTL, a clock, so it is paced by one (no event stands for "2 s before the expiry")
            await asyncio.sleep(beat + ttl - 2.0 - time.monotonic())
            async with running_registry(nats_url, prefix, ttl_s=ttl):
                back = await asyncio.wait_for(stored.get(), 2.5)
                assert back < beat + ttl  # heard before the expiry
                await raw_request(nc, prefix, "heartbeat", "w-a", {})  # registered (not NOT_FOUND) after it
        assert not [e for _, e in await worker_events(nc, prefix, "w-a") if isinstance(e, WorkerRemoved)]
    finally:
        await sub.unsubscribe()


# --- the file and the machine as they are now ------------------------------------------------------


async def test_a_new_life_registers_what_the_file_says_now_after_a_refused_change_of_class(nats_url, nc, prefix,
                                                                                          tmp_path):
    """The file drops restorable v1 and adds a class in one edit: the registry refuses it (a
    worker does not change class; remove it and register it anew). The operator removes the
    worker; the agent's new life registers the file as it is now, not the registration the
    last life had in force (which would advertise v1, dropped from the file, for ever)."""
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v2", ("v1",)))
    async with running_registry(nats_url, prefix), running_agent(nats_url, prefix, path) as agent:
        seq, registered = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        assert assets(registered.sandbox_classes[0]) == ("v2", ["v1"])
        refused = asyncio.get_running_loop().create_future()
        register = agent.register

        async def watched(registration, stop):
            try:
                return await register(registration, stop)
            except ContractError as error:
                if not refused.done():
                    refused.set_result(error)
                raise

        agent.register = watched
        path.write_text(agent_config("v2") + MICROVM)
        error = await asyncio.wait_for(refused, 10)
        assert error.code is ErrorCode.FAILED_PRECONDITION  # a change of class
        await raw_request(nc, prefix, "remove", "w-a", {"reason": "class change"})
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        seq, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=seq)
        classes = {c.sandbox_class: c for c in again.sandbox_classes}
        assert set(classes) == {"gvisor", "microvm"} and assets(classes["gvisor"]) == ("v2", [])


async def test_a_cpu_that_changes_under_a_running_agent_is_probed_and_registered(nats_url, nc, prefix, tmp_path):
    """What the probe reads of the machine is part of the registration: the machine moves to
    another CPU (a virtual machine migrated) and the agent registers the runtimes it probes
    now, without being told (its cpu_features would otherwise be a value it made up)."""
    agent, cpuinfo, _ = a_machine(tmp_path, nats_url, prefix)
    stop = asyncio.Event()
    async with running_registry(nats_url, prefix):
        task = asyncio.create_task(agent.run(stop))
        try:
            seq, registered = await wait_event(nc, prefix, "w-a", WorkerRegistered)
            shutil.copy(AMD, cpuinfo)
            here = probe_version(AMD.read_text(), "amd64", "gvisor", {"gvisor_asset_hash": "v1"})
            assert not same_version(here, registered.sandbox_classes[0].default_runtime.version)
            _, changed = await wait_event(nc, prefix, "w-a", RuntimeChanged, after=seq)
            assert same_version(changed.sandbox_classes[0].default_runtime.version, here)
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)


async def test_a_cpu_that_changes_is_read_before_the_next_heartbeat_and_registered_instead_of_beaten(
        nats_url, nc, prefix, tmp_path):
    """Every heartbeat reads the machine first: one whose CPU changed sends no beat for the old CPU, and
    the CPU it has now is registered at once. Here the agent's watch and its periodic reads of the
    machine never come (an hour apart), so only the heartbeat can see the change. Found by an audit:
    a heartbeat judged the CPU on a read up to 10 s old, and the old CPU stayed registered and beaten,
    where the scheduler committed MEMORY restores of its images, until the next read; the worker's
    next event is now the new CPU's registration, not its removal as LOST."""
    agent, cpuinfo = agent_on_a_machine(tmp_path, nats_url, prefix, agent_config("v1"), probe_interval_s=3600.0)
    agent.watch_interval_s = 3600.0
    async with running_registry(nats_url, prefix, ttl_s=2.0), agent_running(agent):
        seq, registered = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        shutil.copy(AMD, cpuinfo)
        seq, changed = await wait_event(nc, prefix, "w-a", (RuntimeChanged, WorkerRemoved), after=seq)
        assert isinstance(changed, RuntimeChanged) and on_amd(changed) and not on_amd(registered), changed
        events = [type(e).__name__ for s, e in await worker_events(nc, prefix, "w-a")]
        assert events == ["WorkerRegistered", "RuntimeChanged"], events


async def stalled(*_) -> None:
    """A registry store's command that a stalled replica never decides (its reply: UNAVAILABLE)."""
    raise unavailable("the test's stalled replica")


def on_amd(event) -> bool:
    """Whether a registration's default runtime was probed on the AMD machine."""
    here = probe_version(AMD.read_text(), "amd64", "gvisor", {"gvisor_asset_hash": "v1"})
    return same_version(event.sandbox_classes[0].default_runtime.version, here)


@pytest.mark.parametrize("ttl_s, retry_max_s", [(2.0, RETRY_MAX_S), (3.0, 1.0)], ids=["short-ttl", "retries-close"])
async def test_a_cpu_that_changes_while_the_registry_takes_no_registration_gets_the_worker_removed_in_a_ttl(
        nats_url, nc, prefix, tmp_path, monkeypatch, ttl_s, retry_max_s):
    """The registry answers heartbeats, not registrations (a stalled store: UNAVAILABLE), and the
    machine moves to another CPU: the registration in force claims the old one, where its images
    would be sent. The agent sends no heartbeat while it is so; but the registry beats a worker at each
    registration it is sent, so the agent's own attempts would keep the old CPU alive (with retries
    closer together than the TTL, as in production: found by a review). After a TTL of them, the agent
    removes the worker; once the registry takes registrations again, the CPU the machine has now is
    registered, a new life (before, the heartbeats kept the old CPU registered for as long as the
    stall lasted: found by a review)."""
    import warmboot.agent as agent_module

    monkeypatch.setattr(agent_module, "RETRY_MAX_S", retry_max_s)
    agent, cpuinfo, _ = a_machine(tmp_path, nats_url, prefix)
    async with running_registry(nats_url, prefix, ttl_s=ttl_s) as registry, agent_running(agent) as task:
        seq, registered = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        decide, registry.store.register = registry.store.register, stalled
        shutil.copy(AMD, cpuinfo)
        seq, removed = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        assert removed.reason.startswith("its agent cannot register the CPU its machine has now: "), removed
        assert "has taken none of its registrations for" in removed.reason, removed
        registry.store.register = decide
        _, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=seq)
        assert on_amd(again) and not on_amd(registered) and not task.done()


class Logged(logging.Handler):
    """An event set when the agent logs a warning that holds `words`."""

    def __init__(self, words: str) -> None:
        super().__init__(logging.WARNING)
        self.words, self.seen = words, asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.seen.set()


@asynccontextmanager
async def agent_logs(words: str):
    import warmboot.agent as agent_module

    handler = Logged(words)
    agent_module.log.addHandler(handler)
    try:
        yield handler.seen
    finally:
        agent_module.log.removeHandler(handler)


async def test_a_registration_of_the_new_cpu_answered_after_the_agent_s_time_out_ends_no_life(
        nats_url, nc, prefix, tmp_path, monkeypatch):
    """The machine moves to another CPU; the registry takes the agent's registration of it, but answers
    after the agent's time-out (a registry busy with a fleet's registrations). The agent asks again with
    the same request id, which is answered from the worker's history: the worker is neither removed nor
    lost (a change that removed the worker on any time-out did: found by a review)."""
    import warmboot.agent as agent_module

    monkeypatch.setattr(agent_module, "BACKGROUND_REGISTER_TIMEOUT_S", 1.0)
    answered, beat_after = asyncio.Event(), asyncio.Event()
    agent, cpuinfo, _ = a_machine(tmp_path, nats_url, prefix)
    async with agent_logs("register: no reply") as timed_out, running_registry(nats_url, prefix) as registry, \
            agent_running(agent) as task:
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        decide, beat = registry.store.register, registry.liveness.beat

        async def late(request, *more):
            decided = await decide(request, *more)
            if on_amd(request) and not answered.is_set():
                await asyncio.wait_for(timed_out.wait(), 30)  # decided and written; answered once the agent gave up
                answered.set()
            return decided

        async def noting(worker_id: str) -> None:
            await beat(worker_id)
            if answered.is_set() and worker_id == "w-a" and on_amd(agent.registration):
                beat_after.set()

        registry.store.register, registry.liveness.beat = late, noting
        shutil.copy(AMD, cpuinfo)
        await asyncio.wait_for(beat_after.wait(), 30)  # the agent has its answer, and beats again
        kinds = [type(e).__name__ for s, e in await worker_events(nc, prefix, "w-a") if s > seq]
        assert kinds == ["RuntimeChanged"] and not task.done(), kinds  # no removal, no new life


def ttl_learnt(agent: Agent) -> asyncio.Event:
    """Set once the agent has the answer of its first heartbeat, and with it the registry's TTL (it
    counts the shortest there can be until then). A heartbeat reads the machine first, so a CPU that
    changes before that answer is registered without it."""
    learnt, request = asyncio.Event(), agent._request

    async def noting(verb, *args, **kwargs):
        reply = await request(verb, *args, **kwargs)
        if verb == "heartbeat":
            learnt.set()
        return reply

    agent._request = noting
    return learnt


async def test_an_agent_s_own_registrations_piled_up_at_a_slow_replica_end_no_life(nats_url, nc, prefix, tmp_path,
                                                                                    monkeypatch):
    """The machine moves to another CPU; the registry works slowly on the agent's registration of it (a
    store stall shorter than the TTL), and the agent asks again after each time-out with the same request
    id while the earlier attempts are still worked on (a time-out cancels nothing there), until the
    replica refuses one for having too many of them at once. That refusal is not one for the budget: the
    attempts in flight are taken, and the worker is not removed (it was, ending the life that registers
    the CPU the machine has: found by a review)."""
    import warmboot.agent as agent_module

    monkeypatch.setattr(agent_module, "BACKGROUND_REGISTER_TIMEOUT_S", 0.3)
    monkeypatch.setattr(agent_module, "RETRY_MAX_S", 0.3)
    beat_after = asyncio.Event()
    agent, cpuinfo, _ = a_machine(tmp_path, nats_url, prefix)
    learnt = ttl_learnt(agent)
    async with agent_logs("register requests about worker") as piled, running_registry(nats_url, prefix) as registry, \
            agent_running(agent) as task:
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        await asyncio.wait_for(learnt.wait(), 30)  # the stall below is shorter than the TTL the agent counts
        release = asyncio.Event()
        decide, beat = registry.store.register, registry.liveness.beat

        async def slow(request, *more):  # a store stall: the registrations of the new CPU wait
            if on_amd(request):
                await release.wait()
            return await decide(request, *more)

        async def noting(worker_id: str) -> None:
            await beat(worker_id)
            if release.is_set() and worker_id == "w-a" and on_amd(agent.registration) and not agent.withdrawn:
                beat_after.set()

        registry.store.register, registry.liveness.beat = slow, noting
        shutil.copy(AMD, cpuinfo)
        await asyncio.wait_for(piled.wait(), 30)  # the agent's own attempts fill the replica's count
        release.set()  # the stall ends
        await asyncio.wait_for(beat_after.wait(), 30)
        kinds = [type(e).__name__ for s, e in await worker_events(nc, prefix, "w-a") if s > seq]
        assert kinds == ["RuntimeChanged"] and not task.done(), kinds


@pytest.mark.parametrize("profile, cpuinfo, missing", [
    ("gvisor", None, "cpu_features"),  # no cpuinfo at all: the probe reports the architecture alone
    ("microvm", "x86-model-no-family.txt", "cpu_model"),
])
def test_a_probed_runtime_the_probe_cannot_fully_read_is_not_registered(tmp_path, profile, cpuinfo, missing):
    """The probe omits a key it cannot read (CONTRACT section 2). Registered so, the runtime would
    equal that of every machine whose probe read as little, whatever its CPU: the agent refuses it,
    naming the key, and the operator gives the attributes literally."""
    path = tmp_path / "agent.toml"
    path.write_text(f"""
[capacity]
cpu_millis = 1000
memory_mib = 1024

[[sandbox_classes]]
sandbox_class = "c"

[sandbox_classes.default_runtime]
profile = "{profile}"
attributes = {{ asset_digest = "a1" }}
""")
    machine = Path(__file__).parent / "cpuinfo" / cpuinfo if cpuinfo else tmp_path / "none"
    with pytest.raises(ConfigError) as refused:
        load_registration(path, "w-a", "node-a", ProbeSettings(cpuinfo_path=machine, architecture="amd64"))
    assert str(refused.value).startswith(f"{path}: sandbox_classes[0].default_runtime: the {profile} probe cannot read "
                                         f"{missing} from {machine}")
    # a --cpuinfo that is not there is said so (a mistyped path read as a CPU without features:
    # found by a trial of the docs); a file that is there is not
    assert (f"from {machine} (no such file): give this runtime's attributes literally"
            in str(refused.value)) == (cpuinfo is None), str(refused.value)


async def test_a_heartbeat_refused_right_after_a_registration_does_not_stop_the_agent(nats_url, nc, prefix, tmp_path):
    """Registered by one registry replica, the heartbeat that follows refused by another that has
    not yet seen what the first has (a new binding of workers to nodes): the registration stands,
    and the agent, at its start too, goes on beating instead of stopping with that refusal."""
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    agent = Agent(nats_url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
    beat = agent.heartbeat
    refusals = []

    refused_at: list[datetime.datetime] = []

    async def refused_once(stop):
        if not refusals:
            refused_at.append(datetime.datetime.now(datetime.timezone.utc))
            refusals.append(ContractError(ErrorCode.FAILED_PRECONDITION, "not this replica's binding", "node"))
            raise refusals[0]
        await beat(stop)

    agent.heartbeat = refused_once
    stored: asyncio.Queue[bytes] = asyncio.Queue()

    async def put(msg) -> None:
        stored.put_nowait(msg.data)

    sub = await nc.subscribe(f"$KV.{bucket_name(prefix, 'heartbeats')}.w-a", cb=put)
    await flush_in_order(nc)
    stop = asyncio.Event()
    async with running_registry(nats_url, prefix, ttl_s=1.5):
        task = asyncio.create_task(agent.run(stop))
        try:
            await wait_event(nc, prefix, "w-a", WorkerRegistered)
            # a heartbeat of the loop, put after the refused one (the registration's own beats come before)
            while True:
                at = put_at(await asyncio.wait_for(stored.get(), 10))
                if refused_at and at > refused_at[0]:
                    break
            assert refusals and not task.done()
            # soon: the TTL (1.5 s) not learnt, the loop did not wait a third of the default 15 s
            assert not [e for _, e in await worker_events(nc, prefix, "w-a") if isinstance(e, WorkerRemoved)]
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
            await sub.unsubscribe()


def put_at(value: bytes) -> datetime.datetime:
    """When the registry put a heartbeat entry (its value's `at`)."""
    return datetime.datetime.fromisoformat(json.loads(value)["at"].replace("Z", "+00:00"))


class Watched:
    """An agent on a cpuinfo file of its own (the machine, as the probe reads it), read again at
    every watch; what its reads and registrations raise is handed to the test as it happens."""

    def __init__(self, nats_url, prefix, tmp_path, config: str):
        self.cpuinfo = tmp_path / "cpuinfo"
        shutil.copy(CPUINFO, self.cpuinfo)
        self.path = tmp_path / "agent.toml"
        self.path.write_text(config)
        self.nats_url, self.prefix = nats_url, prefix
        self.agent = Agent(nats_url, "w-a", "node-a", self.path, prefix=prefix, watch_interval_s=0.05,
                           probe_interval_s=0.05, unreadable_grace_s=0.0,  # a failed read counts at the second
                           probe=ProbeSettings(cpuinfo_path=self.cpuinfo, architecture="amd64"))
        self.raised: asyncio.Queue[Exception] = asyncio.Queue()
        self.returned: dict[str, asyncio.Event] = {}
        self.sent: list[str] = []  # the verbs of the requests the agent made
        for name in ("_read_config", "register", "_withdraw", "_request", "_restamp"):
            self._watch(name)

    def _watch(self, name):
        call = getattr(self.agent, name)
        returned = self.returned[name] = asyncio.Event()
        if asyncio.iscoroutinefunction(call):
            async def watched(*args, **kwargs):
                if name == "_request":
                    self.sent.append(args[0])
                try:
                    result = await call(*args, **kwargs)
                except Exception as error:
                    self.raised.put_nowait(error)
                    raise
                returned.set()
                return result
        else:
            def watched(*args):
                try:
                    return call(*args)
                except Exception as error:
                    self.raised.put_nowait(error)
                    raise
        setattr(self.agent, name, watched)

    @asynccontextmanager
    async def running(self):
        """A registry replica and this agent, running; the agent's stop event."""
        stop = asyncio.Event()
        async with running_registry(self.nats_url, self.prefix):
            task = asyncio.create_task(self.agent.run(stop))
            try:
                yield stop
            finally:
                stop.set()
                await asyncio.wait_for(task, 15)

    async def next_raised(self, says: str) -> Exception:
        while True:
            error = await asyncio.wait_for(self.raised.get(), 10)
            if says in str(error):
                return error


def amd(asset: str = "v1"):
    return probe_version(AMD.read_text(), "amd64", "gvisor", {"gvisor_asset_hash": asset})


async def test_a_cpu_that_changes_while_the_file_is_unusable_is_registered_with_the_last_good_file(
        nats_url, nc, prefix, tmp_path):
    """An edit the agent cannot use keeps the registration in force, but not the CPU in it: the
    machine moves to another CPU meanwhile, and the agent registers the registration in force
    made on the machine as it is now (else images of the old CPU would be sent to it, and crash)."""
    watched = Watched(nats_url, prefix, tmp_path, agent_config("v1"))
    async with watched.running():
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        watched.path.write_text("capacity = [")  # not TOML
        await watched.next_raised("not valid TOML")
        shutil.copy(AMD, watched.cpuinfo)
        seq, changed = await wait_event(nc, prefix, "w-a", RuntimeChanged, after=seq)
        assert same_version(changed.sandbox_classes[0].default_runtime.version, amd())
        assert assets(changed.sandbox_classes[0]) == ("v1", [])  # the last good file's runtimes


async def test_a_cpu_that_changes_with_an_edit_the_registry_refuses_is_registered_without_the_edit(
        nats_url, nc, prefix, tmp_path):
    """The file adds a class (the registry refuses a change of class to a live worker) and the
    machine moves to another CPU: the refused edit does not keep the old CPU in force; the
    registration in force is registered again on the CPU the machine has now."""
    watched = Watched(nats_url, prefix, tmp_path, agent_config("v1"))
    async with watched.running():
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        watched.path.write_text(agent_config("v1") + MICROVM)
        refused = await watched.next_raised("class")
        assert isinstance(refused, ContractError) and refused.code is ErrorCode.FAILED_PRECONDITION
        shutil.copy(AMD, watched.cpuinfo)
        seq, changed = await wait_event(nc, prefix, "w-a", RuntimeChanged, after=seq)
        assert [c.sandbox_class for c in changed.sandbox_classes] == ["gvisor"]
        assert same_version(changed.sandbox_classes[0].default_runtime.version, amd())


async def test_a_machine_the_probe_can_no_longer_read_is_removed_until_it_can(nats_url, nc, prefix, tmp_path):
    """The probe cannot read the machine any more: no registration of the CPU it has can be made,
    so the worker is removed (not left registered with a CPU it may no longer have) and beats no
    more; once the probe reads it again, on another CPU, the agent registers a new life with it."""
    watched = Watched(nats_url, prefix, tmp_path, agent_config("v1"))
    async with watched.running() as stop:
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        watched.cpuinfo.unlink()
        seq, removed = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        assert removed.reason.startswith("its agent cannot register the CPU its machine has now: ")
        assert "cannot read cpu_features" in removed.reason
        await asyncio.wait_for(watched.returned["_withdraw"].wait(), 10)
        # removed on purpose: neither a heartbeat nor a registration after a reconnect goes out
        watched.sent.clear()
        await watched.agent.heartbeat(stop)
        assert await watched.agent.register(AGAIN, stop) is None
        assert watched.sent == []
        shutil.copy(AMD, watched.cpuinfo)
        seq, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=seq)
        # the first registration after the removal: none was made while the probe could not read
        assert same_version(again.sandbox_classes[0].default_runtime.version, amd())


def test_a_registration_is_made_of_one_read_of_the_machine(tmp_path):
    """What a registration claims of the CPU is what one read said, the read its reading is
    known by: the file changing after the read changes neither."""
    cpuinfo = tmp_path / "cpuinfo"
    shutil.copy(CPUINFO, cpuinfo)
    machine = ProbeSettings(cpuinfo_path=cpuinfo, architecture="amd64").read()
    shutil.copy(AMD, cpuinfo)
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    from warmboot.agent_config import build_registration, parse_config
    made = build_registration(parse_config(path.read_text()), "w-a", "node-a", machine)
    intel = probe_version(CPUINFO.read_text(), "amd64", "gvisor", {"gvisor_asset_hash": "v1"})
    assert same_version(made.sandbox_classes[0].default_runtime.version, intel)
    assert machine.reading() != ProbeSettings(cpuinfo_path=cpuinfo, architecture="amd64").read().reading()


async def test_a_worker_removed_for_want_of_a_registration_comes_back_after_a_reconnect_and_a_removal(
        nats_url, nc, prefix, tmp_path):
    """Removed by its agent (the probe cannot read the machine), asked to register again meanwhile
    (a reconnect, or a NOT_FOUND, does): nothing is sent. Once the machine reads again it begins a
    new life, and a removal of that life is followed by a registration as always."""
    watched = Watched(nats_url, prefix, tmp_path, agent_config("v1"))
    agent = watched.agent
    async with watched.running() as stop:
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        watched.cpuinfo.unlink()
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        await asyncio.wait_for(watched.returned["_withdraw"].wait(), 10)
        agent._register_again(stop)  # what a reconnect and a NOT_FOUND ask for
        await asyncio.gather(*agent._background)
        shutil.copy(AMD, watched.cpuinfo)
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=seq)
        await raw_request(nc, prefix, "remove", "w-a", {"reason": "operator"})
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        await wait_event(nc, prefix, "w-a", WorkerRegistered, after=seq)  # its heartbeat's NOT_FOUND


async def test_a_worker_removed_while_its_file_is_unusable_comes_back_with_its_last_registration(
        nats_url, nc, prefix, tmp_path):
    """The file is unusable and the probe cannot read the machine: the worker is removed. The
    machine reads again (the same CPU): the registration it had is made again, a new life, though
    the file still makes none."""
    watched = Watched(nats_url, prefix, tmp_path, agent_config("v1"))
    async with watched.running():
        seq, registered = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        saved = watched.cpuinfo.read_bytes()
        watched.path.write_text("capacity = [")
        await watched.next_raised("not valid TOML")
        watched.cpuinfo.unlink()
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        watched.cpuinfo.write_bytes(saved)
        seq, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=seq)
        assert again.sandbox_classes == registered.sandbox_classes


async def test_one_read_the_probe_cannot_make_does_not_remove_the_worker(nats_url, nc, prefix, tmp_path):
    """cpuinfo unreadable for one read of the machine (a passing failure), readable at the next:
    the worker, drained by an operator, stays registered and drained (a removal would have undone
    the drain); the probe must fail on two reads in a row."""
    watched = Watched(nats_url, prefix, tmp_path, agent_config("v1"))
    reads: asyncio.Queue[object] = asyncio.Queue()

    class Counted(ProbeSettings):
        def read(self):
            machine = super().read()
            reads.put_nowait(machine)
            return machine

    agent = watched.agent
    agent.probe = Counted(cpuinfo_path=watched.cpuinfo, architecture="amd64")
    agent.probe_interval_s = 1.0  # time to put the file back between two reads
    async with watched.running():
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        await raw_request(nc, prefix, "drain", "w-a", {"reason": "maintenance"})
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerDrained, after=seq)
        saved = watched.cpuinfo.read_bytes()
        while not reads.empty():
            reads.get_nowait()
        watched.returned["_restamp"].clear()
        watched.cpuinfo.write_bytes(b"")  # read as a machine without flags: cpu_features unreadable
        await asyncio.wait_for(watched.returned["_restamp"].wait(), 10)  # made again on that read: failed
        watched.cpuinfo.write_bytes(saved)
        await asyncio.wait_for(reads.get(), 10)  # the next read: the machine as registered
        await asyncio.wait_for(reads.get(), 10)  # and one more, past any decision on the one before
        assert not [e for _, e in await worker_events(nc, prefix, "w-a") if isinstance(e, WorkerRemoved)]
        # a passing failure long after the first is a first one again, not the second in a row
        while not reads.empty():
            reads.get_nowait()
        watched.returned["_restamp"].clear()
        watched.cpuinfo.write_bytes(b"")
        await asyncio.wait_for(watched.returned["_restamp"].wait(), 10)
        watched.cpuinfo.write_bytes(saved)
        await asyncio.wait_for(reads.get(), 10)
        await asyncio.wait_for(reads.get(), 10)
        assert not [e for _, e in await worker_events(nc, prefix, "w-a") if isinstance(e, WorkerRemoved)]


async def test_a_probe_failure_shorter_than_the_grace_removes_nothing_and_the_beats_go_on(
        nats_url, nc, prefix, tmp_path):
    """cpuinfo unreadable for a moment, met by several reads (the machine is read every second and
    before every beat): the heartbeats' reads and the watch's fail, the worker stays registered and
    beaten. A review found a second of it removed the worker (its actors released) when a heartbeat's
    read came first. A failure that has lasted the grace (UNREADABLE_GRACE_S; played here by moving
    its first read back by that much) removes it at the next failed read."""
    agent, cpuinfo = agent_on_a_machine(tmp_path, nats_url, prefix, agent_config("v1"), probe_interval_s=0.0)
    agent.watch_interval_s, agent.unreadable_grace_s = 3600.0, UNREADABLE_GRACE_S  # every look reads anew
    stop = asyncio.Event()
    learnt = ttl_learnt(agent)
    async with running_registry(nats_url, prefix) as registry, agent_running(agent):
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        await asyncio.wait_for(learnt.wait(), 30)  # its own first beat is in (the next, a third of a TTL on)
        beat, beats = registry.liveness.beat, []

        async def counted(worker_id: str) -> None:
            beats.append(worker_id)
            await beat(worker_id)

        registry.liveness.beat = counted
        saved = cpuinfo.read_bytes()
        cpuinfo.write_bytes(b"")  # read as a machine without flags: cpu_features unreadable
        for _ in range(3):  # a heartbeat's read, then the watch's, three times over: six failed reads
            await agent.heartbeat(stop)
            agent._look(stop)
            await asyncio.gather(*agent._background)
        assert len(beats) >= 3 and not agent.withdrawn  # (at least: one of its own may have come too)
        cpuinfo.write_bytes(saved)
        agent._look(stop)  # the machine reads as registered again: the failure is over
        await agent.heartbeat(stop)
        assert agent._unreadable_at is None
        assert not [e for s, e in await worker_events(nc, prefix, "w-a") if s > seq]

        cpuinfo.write_bytes(b"")
        before = len(beats)
        await agent.heartbeat(stop)  # a new failure's first read: passing, beaten
        assert len(beats) == before + 1
        agent._unreadable_at -= UNREADABLE_GRACE_S  # that read, as if the grace had run since
        agent._look(stop)
        await asyncio.gather(*agent._background)
        _, removed = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        assert "the gvisor probe cannot read cpu_features" in removed.reason and agent.withdrawn, removed.reason


def test_a_restamp_on_one_reading_is_asked_again_every_ten_seconds_and_a_new_reading_at_once(tmp_path):
    """The agent's judgement alone: the machine reads another CPU than the one registered. The RESTAMP
    is asked at once; on the same reading again (one that was not taken) only RESTAMP_AGAIN_S later, as
    when reads were that far apart; on another reading at once; and once the machine reads as
    registered, the next change is a new one, asked at once (a review found it held back)."""
    agent, cpuinfo, _ = a_machine(tmp_path, "nats://127.0.0.1:1", "t")
    agent.probe_interval_s = 0.0  # every look reads the machine
    agent.registration = agent._read_config()
    agent._in_force_of = agent._desired_of  # in force: Intel, v1
    asked: list[float] = []

    def beside(kind, *_):
        assert kind is RESTAMP
        asked.append(agent._restamp_asked[0])
        agent._restamp_waiting = False  # asked and answered (not taken): nothing on its way

    agent._beside_heartbeats = beside
    stop = asyncio.Event()
    shutil.copy(AMD, cpuinfo)
    agent._keep_cpu_true(stop)
    agent._keep_cpu_true(stop)  # the same reading, a moment later
    assert len(asked) == 1
    agent._restamp_asked = (agent._restamp_asked[0] - RESTAMP_AGAIN_S, agent._restamp_asked[1])
    agent._keep_cpu_true(stop)  # the same reading, as if RESTAMP_AGAIN_S later
    assert len(asked) == 2
    without_cpu_features(cpuinfo)  # another reading
    agent._keep_cpu_true(stop)
    assert len(asked) == 3
    shutil.copy(CPUINFO, cpuinfo)  # as registered: over
    agent._keep_cpu_true(stop)
    assert len(asked) == 3 and agent._restamp_asked is None
    shutil.copy(AMD, cpuinfo)  # AMD again: a new change
    agent._keep_cpu_true(stop)
    assert len(asked) == 4


# --- stopping, and a cluster ------------------------------------------------------------------------


async def test_a_drain_on_exit_waits_for_the_registration_still_on_its_way(nats_url, nc, prefix, tmp_path):
    """Two registry replicas. The agent is stopped right after its registration went out: the
    drain may reach the replica that has not stored the registration yet (NOT_FOUND). It asks
    again until the registration is there, then drains: the worker is never left registered,
    undrained and placeable with no agent behind it."""
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    async with running_registry(nats_url, prefix, ttl_s=60), running_registry(nats_url, prefix, ttl_s=60):
        for i in range(12):
            worker_id = f"w-d{i}"
            sent = asyncio.Event()

            async def on_register(msg, sent=sent) -> None:
                sent.set()

            spy = await nc.subscribe(service_subject(prefix, "registry", "register", worker_id), cb=on_register)
            await flush_in_order(nc)  # the server has the spy before the agent registers
            agent = Agent(nats_url, worker_id, "node-a", path, prefix=prefix, drain_on_exit=True, probe=PROBE)
            stop = asyncio.Event()
            task = asyncio.create_task(agent.run(stop))
            await asyncio.wait_for(sent.wait(), 10)  # the registration is on the bus
            stop.set()
            await asyncio.wait_for(task, 20)
            await spy.unsubscribe()
            seq, _ = await wait_event(nc, prefix, worker_id, WorkerRegistered)
            kinds = [type(e) for _, e in await worker_events(nc, prefix, worker_id)]
            assert kinds[-1] is WorkerDrained, (worker_id, kinds)


async def test_the_agent_takes_a_clusters_comma_separated_url(nats_url, nc, prefix, tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    members = f"{nats_url},{nats_url}"  # a cluster's members, as `warmboot serve --nats` takes them
    async with running_registry(nats_url, prefix), running_agent(members, prefix, path):
        await wait_event(nc, prefix, "w-a", WorkerRegistered, timeout=10)


async def test_a_registration_refused_for_an_earlier_lifes_id_is_sent_again_with_a_new_one(nats_url, nc, prefix,
                                                                                          tmp_path):
    """The registry refuses a registration whose id an earlier life of the worker used (a retry
    whose id crossed a removal and a life begun since by a stale copy: docs/contract.md). The
    registration is the machine as it is now: the agent sends it again, once, with a new id, and
    the worker is registered with it (it kept the stale life's content before: the edit, not
    asked again, was lost)."""
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    agent = Agent(nats_url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
    request = agent._request
    ids: list[str] = []

    async def refused_once(verb, body, *args, **kwargs):
        if verb == "register":
            ids.append(body.request_id)
            if len(ids) == 1:
                raise ContractError(ErrorCode.FAILED_PRECONDITION, "request_id ... was used in an earlier life",
                                    "request_id")
        return await request(verb, body, *args, **kwargs)

    agent._request = refused_once
    stop = asyncio.Event()
    async with running_registry(nats_url, prefix):
        task = asyncio.create_task(agent.run(stop))
        try:
            _, registered = await wait_event(nc, prefix, "w-a", WorkerRegistered)
            assert len(ids) == 2 and ids[0] != ids[1] and registered.request_id == ids[1]
            assert not task.done()
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)


async def test_a_restarted_agent_goes_on_above_its_last_revision_and_an_older_copy_is_refused(nats_url, nc, prefix,
                                                                                              tmp_path):
    """Each registration carries a revision read off the agent's clock (docs/contract.md), so a new
    process of the agent registers above its last. Its clock may run behind the one that wrote that
    last revision (set back between the two processes): the registry refuses its registration, and the
    agent goes on above the revision the refusal names. Its first registration writes its revision
    even though nothing else changed (UPDATED), so a copy of the first process's registration that
    a replica decides late is refused, and the worker keeps what the new process registered."""
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    async with running_registry(nats_url, prefix):
        async with running_agent(nats_url, prefix, path) as first:
            seq, registered = await wait_event(nc, prefix, "w-a", WorkerRegistered)
            assert registered.revision == first._revision > 0
        old = msgspec.structs.replace(first._revised, request_id="agent-late-copy", revision=first._revision)
        path.write_text(agent_config("v2"))
        second = Agent(nats_url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
        second.clock_ms = lambda: registered.revision - 60_000  # a minute behind the first process's
        stop = asyncio.Event()
        task = asyncio.create_task(second.run(stop))
        try:
            _, changed = await wait_event(nc, prefix, "w-a", RuntimeChanged, after=seq)
            assert changed.revision == registered.revision + 1
            reply, _ = await raw_request(nc, prefix, "register", "w-a", msgspec.to_builtins(old))
            assert reply["error"]["field"] == "revision", reply
            kinds = [type(e) for _, e in await worker_events(nc, prefix, "w-a")]
            assert kinds == [WorkerRegistered, RuntimeChanged], kinds
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)


def spy_registrations(agent: Agent) -> asyncio.Queue:
    """(outcome or "refused", the refusal's field, the body) of every registration the agent sends, as answered."""
    answered: asyncio.Queue = asyncio.Queue()
    request = agent._request

    async def spied(verb, body, *args, **kwargs):
        try:
            reply = await request(verb, body, *args, **kwargs)
        except ContractError as e:
            if verb == "register":
                answered.put_nowait(("refused", e.field, body))
            raise
        if verb == "register":
            answered.put_nowait((reply.outcome.value, None, body))
        return reply

    agent._request = spied
    return answered


def agent_on_a_machine(tmp_path: Path, nats_url: str, prefix: str, config: str,
                       probe_interval_s: float = 0.05) -> tuple[Agent, Path]:
    """An agent of `config` on a machine whose cpuinfo (the Intel sample, to be replaced) is its own."""
    cpuinfo = tmp_path / "cpuinfo"
    shutil.copy(CPUINFO, cpuinfo)
    path = tmp_path / "agent.toml"
    path.write_text(config)
    agent = Agent(nats_url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05,
                  probe_interval_s=probe_interval_s, unreadable_grace_s=0.0,
                  probe=ProbeSettings(cpuinfo_path=cpuinfo, architecture="amd64"))
    return agent, cpuinfo


async def test_a_reconnect_with_an_edit_the_registry_refuses_writes_nothing(nats_url, nc, prefix, tmp_path):
    """After a reconnect the agent sends what its file says (an edit the registry refuses: a class
    added) and then the registration in force again. That one keeps the revision it was answered
    with: UNCHANGED, nothing written, at every reconnect (a review found a WorkerUpdated written at
    each: a fleet's NATS restart would have written two events a worker and moved every fence)."""
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    async with running_registry(nats_url, prefix):
        agent = Agent(nats_url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
        answered = spy_registrations(agent)
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))

        async def next_answer() -> tuple:
            outcome, field, body = await asyncio.wait_for(answered.get(), 20)
            return body.revision, field or outcome

        try:
            first, outcome = await next_answer()
            assert outcome == "REGISTERED"
            path.write_text(agent_config("v1") + MICROVM)
            edit, refused = await next_answer()
            assert refused == "sandbox_classes" and edit > first
            before = await worker_events(nc, prefix, "w-a")
            for _ in range(3):  # three reconnects, as after NATS restarts
                agent._reconnected.set()
                assert await next_answer() == (edit, "sandbox_classes")
                assert await next_answer() == (first, "UNCHANGED")
            assert await worker_events(nc, prefix, "w-a") == before
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)


async def test_a_refused_edit_undone_is_said_and_the_same_edit_made_again_is_sent_again(nats_url, nc, prefix,
                                                                                       tmp_path):
    """A user trial: an edit the registry refused (a class added) was logged as an error, and putting the file
    back as it was said nothing, so the error stayed the last word; and the same edit made again later was not
    sent (held as sent already), so it was not refused again either: nothing said at all. Now the file put
    back is said (nothing sent, nothing written), and the edit made again is sent and refused again."""
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    put_back = "makes the registration in force again; the edit the registry refused is given up"
    said = Said()
    logger = logging.getLogger("warmboot.agent")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(said)
    async with running_registry(nats_url, prefix):
        agent = Agent(nats_url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
        answered = spy_registrations(agent)
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        try:
            outcome, _, _ = await asyncio.wait_for(answered.get(), 20)
            assert outcome == "REGISTERED"
            path.write_text(agent_config("v1") + MICROVM)
            assert (await asyncio.wait_for(answered.get(), 20))[:2] == ("refused", "sandbox_classes")
            before = await worker_events(nc, prefix, "w-a")
            path.write_text(agent_config("v1"))  # put back
            await said.until(put_back)
            assert answered.empty() and await worker_events(nc, prefix, "w-a") == before  # nothing sent
            path.write_text(agent_config("v1") + MICROVM)  # the same edit again: sent again, refused again
            assert (await asyncio.wait_for(answered.get(), 20))[:2] == ("refused", "sandbox_classes")
            assert said.matching(put_back) == [
                f"{path} makes the registration in force again; the edit the registry refused is given up"]
        finally:
            logger.removeHandler(said)
            logger.setLevel(level)
            stop.set()
            await asyncio.wait_for(task, 15)


@pytest.mark.parametrize("how", ["tie", "clock_back"])
async def test_an_unanswered_edit_of_the_last_process_is_not_applied_over_the_next_ones(nats_url, nc, prefix,
                                                                                      tmp_path, how):
    """P1's edit (made on an Intel CPU) is held by a stalled replica, never answered: P1 stops (a
    rolling upgrade). P2, the next process, on the same worker now on an AMD CPU, registers. Then the
    held edit is decided: refused, the worker keeps the AMD CPU (found by a review, both ways):
    - tie: the history's highest revision was ahead of the clock (a process before ran a minute
      ahead), so P1 and P2 each went on at the history's highest + 1: the same revision, refused
      now since its content is another;
    - clock_back: P1's clock ran a minute ahead of P2's, so its edit's revision was above P2's; with
      a state file (`--state-file`), P2 starts above anything P1 sent."""
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    cpuinfo = tmp_path / "cpuinfo"
    shutil.copy(CPUINFO, cpuinfo)  # Intel
    probe = ProbeSettings(cpuinfo_path=cpuinfo, architecture="amd64")
    state = tmp_path / "revision" if how == "clock_back" else None

    def real() -> int:
        return time.time_ns() // 1_000_000

    def agent(clock) -> Agent:
        made = Agent(nats_url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=probe,
                     state_file=state)
        made.clock_ms = clock
        return made

    async def run_until(process: Agent, event_type, after: int):
        stop = asyncio.Event()
        task = asyncio.create_task(process.run(stop))
        try:
            return await wait_event(nc, prefix, "w-a", event_type, after=after)
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)

    def cpu(event) -> str:
        return {a.key: a.value for a in event.sandbox_classes[0].default_runtime.version.attributes}["cpu_features"]

    async with running_registry(nats_url, prefix) as a, running_registry(nats_url, prefix) as stalled:
        if how == "tie":
            seq, _ = await run_until(agent(lambda: real() + 60_000), WorkerRegistered, 0)
            p1 = agent(real)  # refused, goes on at the history's highest + 1
            seq, _ = await run_until(p1, WorkerUpdated, seq)
        else:
            p1 = agent(lambda: real() + 60_000)
            seq, _ = await run_until(p1, WorkerRegistered, 0)
        edit_path = tmp_path / "edit.toml"
        edit_path.write_text(agent_config("v2"))
        edit = load_registration(edit_path, "w-a", "node-a", probe)
        body = msgspec.structs.replace(edit, request_id="agent-p1-edit", revision=p1._revision_of(edit))
        go, held = asyncio.Event(), asyncio.Event()

        async def decided_late():  # the stalled replica's decision, as its endpoint makes it
            held.set()
            await go.wait()
            return await run_command_async(lambda: stalled.store.register(body, now()),
                                           recheck=stalled._recheck("w-a"))

        late = asyncio.create_task(decided_late())
        await asyncio.wait_for(held.wait(), 10)
        path.write_text(agent_config("v2"))
        shutil.copy(AMD, cpuinfo)  # the machine moved while the agent was upgraded
        seq, changed = await run_until(agent(real), RuntimeChanged, seq)
        go.set()
        with pytest.raises(ContractError) as refused:
            await asyncio.wait_for(late, 10)
        assert refused.value.field == "revision", refused.value
        worker = await a.store.load("w-a")
        assert cpu(worker) == cpu(changed) != {a.key: a.value for a in edit.sandbox_classes[0].default_runtime
                                                .version.attributes}["cpu_features"]


def test_the_state_file_keeps_the_last_revision_and_refuses_what_it_cannot_read(tmp_path):
    from warmboot.agent_state import RevisionFile

    kept = RevisionFile(tmp_path / "revision", "w-a")
    assert kept.read() == 0  # none yet: the clock decides
    kept.write(1796297683133)
    assert (tmp_path / "revision").read_text() == "w-a 1796297683133\n"
    assert RevisionFile(tmp_path / "revision", "w-a").read() == 1796297683133
    agent = Agent("nats://127.0.0.1:4222", "w-a", "node-a", tmp_path / "agent.toml", state_file=tmp_path / "revision")
    agent.clock_ms = lambda: 5  # a clock far behind: the next revision is above the kept one, and kept
    assert agent._revision_of(load_registration_of(tmp_path)) == 1796297683134 == kept.read()
    for text, says in (("w-a twelve\n", "holds no revision"), ("w-a " + "9" * 5000 + "\n", "holds no revision"),
                       (f"w-a {1 << 53}\n", "holds no revision"), ("w-b 17\n", "keeps the revision of worker 'w-b'")):
        (tmp_path / "revision").write_text(text)
        with pytest.raises(ConfigError, match=says):
            kept.read()
    result = CliRunner().invoke(main, ["agent", "--worker-id", "w-a", "--node", "node-a", "--config",
                                       str(tmp_path / "agent.toml"), "--state-file", str(tmp_path / "revision")])
    assert result.exit_code == 1 and "state file" in result.output and "not 'w-a'" in result.output
    unwritable = RevisionFile(tmp_path / "no-such-dir" / "revision", "w-a")
    with pytest.raises(ConfigError, match="cannot keep revision 7"):
        unwritable.write(7)


def load_registration_of(tmp_path: Path):
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    return load_registration(path, "w-a", "node-a", PROBE)


def literal_of_this_machine() -> str:
    """A configuration whose default runtime is written out literally, as --print-registration gives it
    on the Intel sample."""
    intel = probe_version(CPUINFO.read_text(), "amd64", "gvisor", {"gvisor_asset_hash": "v1"})
    attributes = ", ".join(f'{a.key} = "{a.value}"' for a in intel.attributes)
    return ("[capacity]\ncpu_millis = 4000\nmemory_mib = 8192\n\n[[sandbox_classes]]\nsandbox_class = \"gvisor\"\n\n"
            f"[sandbox_classes.default_runtime]\nname = \"gvisor-v1\"\nattributes = {{ {attributes} }}\n")


async def test_a_late_copy_does_not_bring_back_a_worker_its_agent_removed(nats_url, nc, prefix, tmp_path, caplog):
    """The machine's CPU changes under a literal runtime that names the old one: the agent removes the
    worker at once (no registration of the CPU it has can be made; not after another read, as when
    the probe fails). A copy of its registration, or of the one it sent again after a reconnect
    (answered UNCHANGED), decided late by a stalled replica, has the revision the history holds and
    would begin a life with the old CPU (found by a review): refused, nothing written."""
    import logging

    agent, cpuinfo = agent_on_a_machine(tmp_path, nats_url, prefix, literal_of_this_machine())
    answered = spy_registrations(agent)
    caplog.set_level(logging.WARNING, logger="warmboot.agent")
    sent = []
    async with running_registry(nats_url, prefix), agent_running(agent):
        outcome, _, body = await asyncio.wait_for(answered.get(), 20)
        assert outcome == "REGISTERED"
        sent.append(body)
        agent._reconnected.set()
        outcome, _, body = await asyncio.wait_for(answered.get(), 20)
        assert outcome == "UNCHANGED"
        sent.append(body)
        seq = await last_seq(nc, prefix)
        shutil.copy(AMD, cpuinfo)  # the virtual machine moved to an AMD host
        _, removed = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        assert "is not this machine's" in removed.reason
        assert "cannot read this machine" not in caplog.text  # withdrawn at once, not after another read
        before = await last_seq(nc, prefix)
        for copy in sent:  # same request id, same revision, same content
            reply, _ = await raw_request(nc, prefix, "register", "w-a", msgspec.to_builtins(copy))
            assert reply["error"]["field"] == "revision", reply
        assert await last_seq(nc, prefix) == before


async def test_an_agent_whose_kept_revision_ran_out_of_bounds_comes_back_to_its_clock(nats_url, nc, prefix,
                                                                                      tmp_path):
    """A clock that ran more than a year ahead left its revision in the state file; the registry refuses
    it (INVALID_ARGUMENT) and recorded none. With the clock set right the agent goes back to it
    (above what the registry holds) and registers; it did not, for good (found by a review)."""
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    state = tmp_path / "revision"
    far = time.time_ns() // 1_000_000 + 2 * 366 * 24 * 3600 * 1000
    state.write_text(f"w-a {far}\n")
    async with running_registry(nats_url, prefix):
        agent = Agent(nats_url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE,
                      state_file=state)
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        try:
            _, registered = await wait_event(nc, prefix, "w-a", WorkerRegistered)
            assert registered.revision < far and int(state.read_text().split()[1]) == registered.revision
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)


async def test_a_late_copy_of_a_refused_edit_does_not_begin_a_life_the_agent_ended(nats_url, nc, prefix, tmp_path):
    """An edit the registry refused (a class added) records nothing, so its revision is above the
    history's. A stalled replica still holds a copy. The machine's CPU changes, and the agent removes
    the worker: the copy, decided then, would begin a life with the old CPU (found by a review). The
    agent's removal carries a revision above everything it sent: the copy is refused, and then the
    agent comes back with what its file makes on the new machine."""
    agent, cpuinfo = agent_on_a_machine(tmp_path, nats_url, prefix, literal_of_this_machine())
    path = tmp_path / "agent.toml"
    answered = spy_registrations(agent)
    async with running_registry(nats_url, prefix), agent_running(agent):
        assert (await asyncio.wait_for(answered.get(), 20))[0] == "REGISTERED"
        path.write_text(literal_of_this_machine() + MICROVM)
        outcome, field, edit = await asyncio.wait_for(answered.get(), 20)
        assert (outcome, field) == ("refused", "sandbox_classes")
        seq = await last_seq(nc, prefix)
        shutil.copy(AMD, cpuinfo)  # the virtual machine moved to an AMD host
        path.write_text(agent_config("v1") + MICROVM.replace(  # what the machine can make now: probed
            'attributes = { architecture = "amd64", cpu_vendor = "GenuineIntel", cpu_model = "6/143", ',
            'profile = "microvm"\nattributes = { '))
        seq, removed = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        assert removed.revision is not None and removed.revision > edit.revision
        reply, _ = await raw_request(nc, prefix, "register", "w-a", msgspec.to_builtins(edit))
        assert reply["error"]["field"] == "revision", reply
        # withdrawn, the agent takes up what its file makes on this machine (it waited for an edit)
        _, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=seq)
        amd = probe_version(AMD.read_text(), "amd64", "gvisor").attributes
        assert {a.key: a.value for a in again.sandbox_classes[0].default_runtime.version.attributes}[
            "cpu_features"] == {a.key: a.value for a in amd}["cpu_features"]
        assert again.revision > removed.revision


async def test_a_withdrawn_agent_removes_a_life_it_did_not_begin(nats_url, nc, prefix, tmp_path):
    """The agent removed its worker (the probe could not read the machine). Then a registration it did
    not make begins a life with other classes (a sender without revisions). When the machine reads
    again, the agent's registration is refused as a change of class: the life is not this machine's,
    and the agent removes it. Before, it stayed, and each refused registration beat it alive."""
    agent, cpuinfo = agent_on_a_machine(tmp_path, nats_url, prefix, agent_config("v1"), probe_interval_s=0.1)
    answered = spy_registrations(agent)
    async with running_registry(nats_url, prefix), agent_running(agent):
        outcome, _, first = await asyncio.wait_for(answered.get(), 20)
        assert outcome == "REGISTERED"
        seq = await last_seq(nc, prefix)
        cpuinfo.unlink()  # the probe cannot read the machine, twice: the worker is removed
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        other = build_registration(parse_config(agent_config("v1") + MICROVM), "w-a", "node-a", PROBE)
        reply, _ = await raw_request(nc, prefix, "register", "w-a", msgspec.to_builtins(other))
        assert reply["outcome"] == "REGISTERED", reply
        shutil.copy(AMD, cpuinfo)  # the machine reads again
        _, removed = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=reply["seq"])
        assert "a registration this agent did not make holds it" in removed.reason


def withdrawals(agent: Agent) -> asyncio.Queue:
    """The reason of every removal of its worker the agent makes (`_withdraw`), once made."""
    made: asyncio.Queue = asyncio.Queue()
    withdraw = agent._withdraw

    async def spied(why, stop):
        await withdraw(why, stop)
        made.put_nowait(why)

    agent._withdraw = spied
    return made


async def test_a_refused_edit_decided_after_an_operator_removed_the_worker_is_refused(nats_url, nc, prefix,
                                                                                    tmp_path):
    """The agent's edit is refused (a class added) and a stalled replica holds a copy. An operator
    removes the worker; then the CPU changes and the agent's own removal finds none (NOT_FOUND), so it
    records nothing. The copy, decided then, began a life with the old CPU (found by a review's fuzz):
    a refusal is marked in the reply bucket, and a registration that would begin a life under a
    request id sent before is refused. Then the file, edited to what the machine can make, brings
    the worker back."""
    agent, cpuinfo = agent_on_a_machine(tmp_path, nats_url, prefix, literal_of_this_machine())
    path = tmp_path / "agent.toml"
    answered, withdrawn = spy_registrations(agent), withdrawals(agent)
    async with running_registry(nats_url, prefix), agent_running(agent):
        assert (await asyncio.wait_for(answered.get(), 20))[0] == "REGISTERED"
        path.write_text(literal_of_this_machine() + MICROVM)
        outcome, field, edit = await asyncio.wait_for(answered.get(), 20)
        assert (outcome, field) == ("refused", "sandbox_classes")
        reply, _ = await raw_request(nc, prefix, "remove", "w-a", {"reason": "an operator's"})
        shutil.copy(AMD, cpuinfo)  # neither the registration in force nor the file can be made now
        assert "is not this machine's" in await asyncio.wait_for(withdrawn.get(), 20)
        before = await last_seq(nc, prefix)
        late, _ = await raw_request(nc, prefix, "register", "w-a", msgspec.to_builtins(edit))
        assert late["error"]["field"] == "request_id", late
        assert "was sent before the last life of worker 'w-a' ended" in late["error"]["message"]
        assert await last_seq(nc, prefix) == before
        path.write_text(agent_config("v1"))  # what this machine makes
        _, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=before)
        amd = {a.key: a.value for a in probe_version(AMD.read_text(), "amd64", "gvisor").attributes}
        assert {a.key: a.value for a in again.sandbox_classes[0].default_runtime.version.attributes}[
            "cpu_features"] == amd["cpu_features"]


async def test_a_withdrawn_agents_edit_refused_by_a_life_it_did_not_begin_removes_that_life(nats_url, nc, prefix,
                                                                                            tmp_path):
    """Withdrawn (its literal runtime names the old CPU), the agent's edit to what the machine makes is
    refused as a change of class: a life it did not begin holds the worker. It removes that life and
    registers the edit (it kept the refused edit and never sent it again: stuck; found by a review)."""
    agent, cpuinfo = agent_on_a_machine(tmp_path, nats_url, prefix, literal_of_this_machine())
    path = tmp_path / "agent.toml"
    answered, withdrawn = spy_registrations(agent), withdrawals(agent)
    async with running_registry(nats_url, prefix), agent_running(agent):
        assert (await asyncio.wait_for(answered.get(), 20))[0] == "REGISTERED"
        shutil.copy(AMD, cpuinfo)
        assert "is not this machine's" in await asyncio.wait_for(withdrawn.get(), 20)
        other = build_registration(parse_config(agent_config("v1") + MICROVM), "w-a", "node-a", PROBE)
        foreign, _ = await raw_request(nc, prefix, "register", "w-a", msgspec.to_builtins(other))
        assert foreign["outcome"] == "REGISTERED", foreign
        path.write_text(agent_config("v1"))  # what this machine makes, of one class
        assert "a registration this agent did not make holds it" in await asyncio.wait_for(withdrawn.get(), 20)
        _, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=foreign["seq"])
        assert [c.sandbox_class for c in again.sandbox_classes] == ["gvisor"]


async def test_a_clock_far_ahead_does_not_keep_the_agent_from_removing_its_worker(nats_url, nc, prefix, tmp_path):
    """The clock runs more than a year ahead when the machine's CPU changes under a literal runtime:
    the agent's removal, its revision out of the registry's bound, was refused, and the worker stayed
    registered with the old CPU, beating, for good (found by a review). It is removed all the same,
    without a revision."""
    agent, cpuinfo = agent_on_a_machine(tmp_path, nats_url, prefix, literal_of_this_machine())
    answered, withdrawn = spy_registrations(agent), withdrawals(agent)
    async with running_registry(nats_url, prefix), agent_running(agent):
        assert (await asyncio.wait_for(answered.get(), 20))[0] == "REGISTERED"
        seq = await last_seq(nc, prefix)
        agent.clock_ms = lambda: time.time_ns() // 1_000_000 + 2 * 366 * 24 * 3600 * 1000
        shutil.copy(AMD, cpuinfo)
        _, removed = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        assert removed.revision is None and "is not this machine's" in removed.reason
        assert "is not this machine's" in await asyncio.wait_for(withdrawn.get(), 20)


async def test_a_registration_taken_after_a_time_out_longer_than_the_ttl_ends_no_life(
        nats_url, nc, prefix, tmp_path, monkeypatch):
    """As above, with the agent's time-out longer than the TTL, as in production (BACKGROUND_REGISTER_TIMEOUT_S
    30 s, TTL 15 s): the registration of the new CPU waits at the replica (the worker's lock, a slot) until the
    agent's time-out, then is beaten, decided and answered. `_stale_since` runs from the CPU change, so the first
    time-out is already a TTL of staleness: the agent removes the worker its own registration just took, and a
    new life begins, its actors released."""
    import warmboot.agent as agent_module

    monkeypatch.setattr(agent_module, "BACKGROUND_REGISTER_TIMEOUT_S", 3.0)  # > the TTL (2 s), as 30 s > 15 s
    agent, cpuinfo, _ = a_machine(tmp_path, nats_url, prefix)
    learnt, beat_after = asyncio.Event(), asyncio.Event()
    heartbeat = agent.heartbeat

    async def learning(stop: asyncio.Event) -> None:
        await heartbeat(stop)
        if agent._ttl_learnt:
            learnt.set()

    agent.heartbeat = learning
    async with agent_logs("no reply from") as timed_out, running_registry(nats_url, prefix, ttl_s=2.0) as registry, \
            agent_running(agent) as task:
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        await asyncio.wait_for(learnt.wait(), 30)  # registered, and its heartbeat answered: the TTL learnt
        beat, switched = registry.liveness.beat, asyncio.Event()

        async def queued(worker_id: str) -> None:  # the request waits its turn before the registry beats
            if switched.is_set() and worker_id == "w-a" and not timed_out.is_set():
                await asyncio.wait_for(timed_out.wait(), 30)
            await beat(worker_id)
            if timed_out.is_set() and worker_id == "w-a" and on_amd(agent.registration):
                beat_after.set()

        registry.liveness.beat = queued
        shutil.copy(AMD, cpuinfo)
        switched.set()
        await wait_event(nc, prefix, "w-a", RuntimeChanged, after=seq)
        await asyncio.wait_for(beat_after.wait(), 30)  # the agent has its answer, and beats again
        kinds = [type(e).__name__ for s, e in await worker_events(nc, prefix, "w-a") if s > seq]
        assert kinds == ["RuntimeChanged"] and not task.done(), kinds  # no removal, no new life


async def test_a_stale_cpu_is_removed_within_the_registry_s_ttl_before_the_agent_learnt_it(
        nats_url, nc, prefix, tmp_path, monkeypatch):
    """A registry with a TTL of 3 s (`warmboot serve --ttl 3`); the machine moves to another CPU before the
    agent's first heartbeat is answered, and the registry takes no registration (a stalled store). The agent
    learns the TTL only from a heartbeat's answer, so `_wait_no_longer` counts the default 15 s, while each
    registration attempt (retries closer than the TTL, as in production) beats the old CPU: it stays
    registered and alive for five TTLs."""
    import warmboot.agent as agent_module

    monkeypatch.setattr(agent_module, "RETRY_MAX_S", 1.0)
    agent, cpuinfo, _ = a_machine(tmp_path, nats_url, prefix)
    async with running_registry(nats_url, prefix, ttl_s=3.0) as registry:
        beat, beats, changed = registry.liveness.beat, [], asyncio.Event()

        async def first_heartbeat_lost(worker_id: str) -> None:
            beats.append(worker_id)
            if len(beats) == 3:  # the registration's two beats, then the first heartbeat: the CPU changes
                registry.store.register = stalled
                shutil.copy(AMD, cpuinfo)
                changed.set()
                raise unavailable("the heartbeat's put was not stored")
            await beat(worker_id)

        registry.liveness.beat = first_heartbeat_lost
        async with agent_running(agent):
            seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
            await asyncio.wait_for(changed.wait(), 30)
            switched = time.monotonic()
            _, removed = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq, timeout=30)
            assert time.monotonic() - switched < 2 * 3.0, (time.monotonic() - switched, removed.reason)


def test_a_stale_episode_is_not_restarted_by_one_unreadable_read(tmp_path):
    """The machine reads as another CPU, then once cannot be read (cpuinfo unreadable for a moment), then
    as the other CPU again: no read in between said the CPU registered is back, so the registration in force
    has been stale all along. `_judge_stale` says nothing on the first unreadable read, and `_why_stale`
    takes that for the end of the episode: `_stale_since` starts again, the TTL's count with it (and a
    heartbeat may go out on that read). A probe failing every other read keeps the count from ever
    reaching the TTL, while the registration attempts beat the old CPU."""
    agent, cpuinfo, _ = a_machine(tmp_path, "nats://127.0.0.1:1", "warmboot")
    registration = agent._read_config()
    agent.registration, agent._in_force_of = registration, agent._desired_of
    agent.ttl_s, agent._ttl_learnt = 3600.0, True

    def read_again() -> None:
        agent._probe_read = None  # the next look reads the machine

    shutil.copy(AMD, cpuinfo)
    read_again()
    assert agent._wait_no_longer(False, 2) is None  # stale, for less than a TTL
    since = agent._stale_since
    assert since is not None
    cpuinfo.unlink()
    read_again()
    agent._wait_no_longer(False, 2)
    shutil.copy(AMD, cpuinfo)
    read_again()
    agent._wait_no_longer(False, 2)
    assert agent._stale_since == since, "stale all along, yet the count started again"
    agent.ttl_s = 0.0
    assert agent._wait_no_longer(False, 2) is not None


def read_otherwise(agent: Agent, reading: tuple) -> asyncio.Event:
    """Set once the agent's probe reads the machine otherwise than `reading` (`_probe_read[2]`):
    its reads are wrapped, and the agent keeps what a read gives before anything else runs."""
    changed, probe = asyncio.Event(), agent.probe

    class Watched:
        def __getattr__(self, name: str):
            return getattr(probe, name)

        def read(self):
            machine = probe.read()
            if machine.reading() != reading:
                changed.set()
            return machine

    agent.probe = Watched()
    return changed


def edit_queued(agent: Agent, asset: str) -> asyncio.Event:
    """Set once the agent queues an edit (`register(EDIT)` beside the heartbeats) of a file whose
    default runtime is `asset`."""
    queued, beside = asyncio.Event(), agent._beside_heartbeats

    def noted(registration, *args):
        if registration is EDIT and agent.desired is not None \
                and default_asset(agent.desired.sandbox_classes[0]) == asset:
            queued.set()
        return beside(registration, *args)

    agent._beside_heartbeats = noted
    return queued


@contextmanager
def nothing_sent() -> Iterator[asyncio.Event]:
    """An event set once a registration beside the heartbeats ends unsent (the agent logs "nothing
    sent": it could not be made on the machine as the probe read it), its task then done."""
    ended = asyncio.Event()

    class Unsent(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("nothing sent:"):
                ended.set()

    handler, logger = Unsent(), logging.getLogger("warmboot.agent")
    logger.addHandler(handler)
    try:
        yield ended
    finally:
        logger.removeHandler(handler)


def default_asset(entry) -> str | None:
    return {a.key: a.value for a in entry.default_runtime.version.attributes}.get("gvisor_asset_hash")


async def test_an_edit_whose_turn_comes_on_an_unreadable_read_is_sent_once_the_machine_reads_again(
        nats_url, nc, prefix, tmp_path):
    """An edit waits its turn behind another registration (the registry slow to answer, as in a
    rollout); when its turn comes the probe cannot read the machine for a moment (well within the
    grace: the worker stays registered, beating). The edit could not be made, so it was not sent,
    nor refused; yet the agent had marked it sent (`_edited`), and once the machine read as before,
    the watch, reading the same file on the same CPU, skipped it for ever: the registry went on
    advertising default v2, which the file (and so the machine) dropped for v3, and v2's memory
    images would be sent there (found by an audit). It is now sent once the machine reads again."""
    from services.registry.service import RegistryService

    hold, held, release = False, asyncio.Event(), asyncio.Event()

    def gated(register):
        async def held_register(worker_id, request):
            if hold and not release.is_set():
                held.set()
                await release.wait()
            return await register(worker_id, request)
        return held_register

    registry_nc = await nats.connect(nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    registry = RegistryService(registry_nc, nats_url=nats_url, prefix=prefix, ttl_s=15.0)
    registry.register = gated(registry.register)
    await registry.start()
    agent, cpuinfo, path = a_machine(tmp_path, nats_url, prefix)
    agent.unreadable_grace_s = 60.0  # a passing failure to read the machine: the worker stays registered
    try:
        async with agent_running(agent):
            seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
            hold = True
            path.write_text(agent_config("v2", ("v1",)))  # an edit, held at the registry
            await asyncio.wait_for(held.wait(), 20)
            queued = edit_queued(agent, "v3")
            path.write_text(agent_config("v3"))  # the next edit waits its turn behind it
            await asyncio.wait_for(queued.wait(), 20)
            unreadable = read_otherwise(agent, agent._probe_read[2])
            without_cpu_features(cpuinfo)  # the probe cannot read cpu_features for a moment
            await asyncio.wait_for(unreadable.wait(), 20)
            release.set()  # the first edit answered: the second's turn, on the unreadable read
            await asyncio.wait(set(agent._background), timeout=20)  # both registrations done, sent or not
            assert not agent._background and not agent._edit_waiting
            shutil.copy(CPUINFO, cpuinfo)  # the machine reads as before
            at, changed = await wait_event(nc, prefix, "w-a", RuntimeChanged, after=seq, timeout=10)
            assert default_asset(changed.sandbox_classes[0]) == "v2"  # the first edit
            # v3, the file's, within a few reads of the file (0.05 s apart)
            at, changed = await wait_event(nc, prefix, "w-a", RuntimeChanged, after=at, timeout=5)
            assert default_asset(changed.sandbox_classes[0]) == "v3"
    finally:
        release.set()
        await registry.stop()
        await registry_nc.close()


async def test_the_registration_in_force_after_a_reconnect_on_an_unreadable_read_is_sent_once_the_machine_reads_again(
        nats_url, nc, prefix, tmp_path):
    """After a reconnect the agent sends the registration in force again, should the server have lost a
    write (the registry would go on advertising a runtime the machine no longer has). When that moment
    finds the probe unable to read the machine (well within the grace: the worker stays registered,
    beating), it cannot be made, so it is not sent; nothing asked for it again, and once the machine read
    as before the watch found nothing new (found by an audit). It is now sent at the next read."""
    agent, cpuinfo, _ = a_machine(tmp_path, nats_url, prefix)
    agent.unreadable_grace_s = 60.0  # a passing failure to read the machine: the worker stays registered
    answered = spy_registrations(agent)
    async with running_registry(nats_url, prefix), agent_running(agent):
        outcome, _, first = await asyncio.wait_for(answered.get(), 20)
        assert outcome == "REGISTERED"
        unreadable = read_otherwise(agent, agent._probe_read[2])
        without_cpu_features(cpuinfo)  # the probe cannot read cpu_features for a moment
        await asyncio.wait_for(unreadable.wait(), 20)
        with nothing_sent() as unsent:
            agent._reconnected.set()  # what nats-py's reconnected callback sets
            await asyncio.wait_for(unsent.wait(), 20)  # the registration after it, tried and ended: nothing sent
        assert answered.empty()
        shutil.copy(CPUINFO, cpuinfo)  # the machine reads as before
        outcome, _, again = await asyncio.wait_for(answered.get(), 10)
        assert outcome == "UNCHANGED"  # the registration in force, sent again, with its revision
        assert (again.sandbox_classes, again.revision) == (first.sandbox_classes, first.revision)
