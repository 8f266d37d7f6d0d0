"""The worker agent end to end: a config file, the real registry, the real bus.

It registers, follows edits of its file (the rolling upgrade), registers again when
the registry forgot it, survives a NATS restart, and drains on SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import nats
import pytest

from events.compat import same_version
from events.errors import ContractError
from events.probe import probe_version
from events.schema import ErrorCode, RuntimeChanged, WorkerDrained, WorkerRegistered, WorkerRemoved
from tests.factories import cancelled_and_ended
from tests.registry_helpers import (AMD, CPUINFO, PROBE, Said, agent_config as config, raw_request,
                                    running_registry, wait_event)
from warmboot.agent import Agent
from warmboot.agent_config import ConfigError, ProbeSettings, load_registration, parse_config
from warmboot.natsserver import NatsServer

ROOT = Path(__file__).parent.parent


def probed(asset: str, cpuinfo: Path = CPUINFO):
    """The version the probe reads of gvisor asset `asset` on the amd64 machine whose cpuinfo is `cpuinfo`."""
    return probe_version(cpuinfo.read_text(), "amd64", "gvisor", {"gvisor_asset_hash": asset})


@asynccontextmanager
async def running_agent(nats_url: str, prefix: str, config_path: Path, worker_id: str = "w-a"):
    agent = Agent(nats_url, worker_id, "node-a", config_path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
    async with agent_running(agent):
        yield agent


@asynccontextmanager
async def agent_running(agent: Agent):
    """`agent` runs in the block, and is stopped at its end (its run's error raised there). One that has not
    stopped 15 s after its stop is cancelled, and the block fails saying so: not `asyncio.wait_for(task, 15)`,
    which then waits, with no bound, for the cancelled task to end (Python 3.11; a task that swallowed the
    cancellation, as nats-py's requests can, never does)."""
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait({task}, timeout=15)
        if not task.done():
            await cancelled_and_ended(task, 15, "the agent's task, cancelled")
            raise AssertionError(f"the agent {agent.worker_id} did not stop within 15 s of its stop")
        task.result()


# --- configuration -------------------------------------------------------------------------------


def test_example_config_makes_a_valid_registration():
    registration = load_registration(ROOT / "examples" / "agent.toml", "w-17", "node-a", PROBE)
    classes = {c.sandbox_class: c for c in registration.sandbox_classes}
    assert set(classes) == {"gvisor", "microvm"}
    gvisor = classes["gvisor"]
    keys = {a.key for a in gvisor.default_runtime.version.attributes}
    assert keys == {"architecture", "cpu_features", "gvisor_asset_hash"}
    assert [r.name for r in gvisor.restorable_runtimes] == ["gvisor-2026-09"]
    microvm = {a.key for a in classes["microvm"].default_runtime.version.attributes}
    assert {"architecture", "cpu_vendor", "cpu_model", "kernel_digest", "rootfs_digest"} == microvm


@pytest.mark.parametrize(
    "text, where",
    [
        ("[capacity\n", "not valid TOML"),
        (config("v1").replace("zone = ", "zone_typo = 1\nzone = "), "labels.zone_typo: Expected `str`, got `int`"),
        (config("v1").replace('zone = "a"', 'zone = "a"\n"rack 7" = "b"'), "labels: Expected a label key"),
        (config("v1").replace('"v1" }', '"v1", digest = 7 }'),
         "sandbox_classes[0].default_runtime.attributes.digest: Expected `str`, got `int`"),
        (config("v1").replace('name = "gvisor-v1"', 'nmae = "gvisor-v1"'), "nmae"),
        (config("v1").replace('profile = "gvisor"', 'profile = "qemu"'), "sandbox_classes[0].default_runtime.profile"),
        (config("v1", ("v1",)), "sandbox_classes[0].restorable_runtimes[0].version"),
        (config("v1").replace("cpu_millis = 4000", "cpu_millis = 0"), "capacity.cpu_millis"),
        (config("v1").replace('"v1" }', '"v1", architecture = "arm64" }'), "architecture"),
    ],
    ids=["toml", "label-type", "label-key", "attribute-value", "unknown-key", "profile", "restorable-equals-default", "capacity", "probed-key-given"],
)
def test_bad_config_says_where(tmp_path, text, where):
    """The field of the error, a label's or an attribute's by its key (msgspec said `labels[...]`), a
    refused key or value quoted."""
    path = tmp_path / "agent.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_registration(path, "w-a", "node-a", PROBE)
    assert where in str(error.value) and str(error.value).startswith(f"{path}: "), error.value


async def test_a_broken_edit_keeps_the_registration_in_force(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text(config("v1"))
    agent = Agent("nats://127.0.0.1:1", "w-a", "node-a", path, probe=PROBE)
    agent.registration = agent._read_config()
    path.write_text(config("v2").replace("[capacity]", "[capacity"))
    agent._sync_config(asyncio.Event())  # logs the error, sends nothing
    assert not agent._background  # no registration started
    assert agent.registration.sandbox_classes[0].default_runtime.name == "gvisor-v1"
    assert parse_config(config("v2")).sandbox_classes[0].default_runtime.name == "gvisor-v2"


async def test_a_mended_edit_is_said_even_when_it_changes_nothing(tmp_path, caplog):
    """A broken edit is logged as an error; the edit that mends it is logged too, also when it
    puts back the registration in force and so sends nothing (an operator watching the log
    saw the error and then nothing, a walkthrough's finding)."""
    caplog.set_level(logging.INFO, logger="warmboot.agent")
    path = tmp_path / "agent.toml"
    path.write_text(config("v1"))
    agent = Agent("nats://127.0.0.1:1", "w-a", "node-a", path, probe=PROBE)
    agent.registration = agent._read_config()
    path.write_text(config("v1").replace("[capacity]", "[capacity"))
    agent._sync_config(asyncio.Event())
    assert [r.levelno for r in caplog.records if str(path) in r.getMessage()] == [logging.ERROR]
    path.write_text(config("v1"))  # put back as it was
    agent._sync_config(asyncio.Event())
    assert not agent._background  # nothing to send
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert said == [f"{path} reads again without error; it makes the registration in force"]
    agent._sync_config(asyncio.Event())  # said once
    assert len([r for r in caplog.records if r.levelno == logging.INFO]) == 1

    # a file that cannot be read (moved away), put back as it was: said mended too (a review found
    # its digest equal to the last good read's, so nothing was new and nothing said)
    path.rename(tmp_path / "away.toml")
    agent._sync_config(asyncio.Event())
    assert [r.levelno for r in caplog.records if "cannot read" in r.getMessage()] == [logging.ERROR]
    (tmp_path / "away.toml").rename(path)
    agent._sync_config(asyncio.Event())
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO][1:] == [said[0]]
    assert not agent._background


BROKEN = [  # a file the agent cannot use, and what its error says after the file's name
    (config("v1").replace("cpu_millis = 4000", 'cpu_millis = "x"'), "capacity.cpu_millis: Expected `int`, got `str`"),
    (config("v1").replace('profile = "gvisor"', 'profile = "nosuch"'),
     "sandbox_classes[0].default_runtime.profile: unknown profile 'nosuch'; expected one of gvisor, microvm"),
    (config("v1", ("v1",)),  # the registry's own rules
     "sandbox_classes[0].restorable_runtimes[0].version: restorable runtime equals default_runtime by version"),
    (config("v1").replace('"v1" }', '"v1", architecture = "arm64" }'),  # what the probe makes of it
     "sandbox_classes[0].default_runtime: attribute 'architecture' is probed by profile 'gvisor'"),
]


@pytest.mark.parametrize("text, says", BROKEN, ids=["capacity", "profile", "registry-rule", "probed-key"])
def test_every_error_of_the_file_names_it_first_wherever_it_is_said(tmp_path, caplog, text, says):
    """A user trial: a capacity error named the file (`error: FILE: capacity.cpu_millis: ...`), a profile
    error did not (`error: sandbox_classes[0].default_runtime.profile: ...`), nor any other error the
    registration's rules found. Each now says `FILE: FIELD: ...`: at the start of the agent, with
    --print-registration and --check-placement, and in the log line of an edit the agent ignores."""
    from click.testing import CliRunner

    from warmboot.cli import main

    path = tmp_path / "a1.toml"
    path.write_text(text)
    error = f"{path}: {says}"
    agent = ["agent", "--worker-id", "w-a", "--node", "node-a", "--config", str(path), "--cpuinfo", str(CPUINFO),
             "--arch", "amd64"]
    printed = CliRunner().invoke(main, [*agent, "--print-registration"])
    assert printed.exit_code == 1 and f"error: {error}" in printed.output, printed.output
    started = CliRunner().invoke(main, [*agent, "--nats", "nats://127.0.0.1:1"])  # refused before it connects
    assert started.exit_code == 1 and f"error: {error}" in started.output, started.output
    checked = CliRunner().invoke(main, [*agent, "--check-placement", "-"], input=b"{}")
    assert checked.exit_code == 1, checked.output
    assert f"the configuration makes no registration of this machine now ({error}" in checked.output

    caplog.set_level(logging.INFO, logger="warmboot.agent")
    path.write_text(config("v1"))
    running = Agent("nats://127.0.0.1:1", "w-a", "node-a", path, probe=PROBE)
    running.registration = running._read_config()
    path.write_text(text)  # an edit while it runs
    running._sync_config(asyncio.Event())
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert line.startswith(f"ignoring the edit of {error}") and line.endswith("; keeping the registration in force")


# --- end to end ----------------------------------------------------------------------------------


async def test_agent_registers_follows_the_rolling_upgrade_and_comes_back(nats_url, nc, prefix, tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text(config("v1"))
    async with running_registry(nats_url, prefix, ttl_s=3), running_agent(nats_url, prefix, path):
        seq, registered = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        [entry] = registered.sandbox_classes
        assert same_version(entry.default_runtime.version, probed("v1"))
        assert entry.default_runtime.actor_overhead.fixed_mib == 16
        assert registered.capacity.memory_mib == 8192 and registered.labels == {"zone": "a"}

        # v2 becomes the default; v1 moves to the restorable list
        path.write_text(config("v2", ("v1",)))
        seq, changed = await wait_event(nc, prefix, "w-a", RuntimeChanged, after=seq)
        assert changed.previous == registered.sandbox_classes
        [entry] = changed.sandbox_classes
        assert same_version(entry.default_runtime.version, probed("v2"))
        assert [r.name for r in entry.restorable_runtimes] == ["gvisor-v1"]
        assert same_version(entry.restorable_runtimes[0].version, probed("v1"))

        # removed behind its back, the agent's next heartbeat hears NOT_FOUND and registers anew
        await raw_request(nc, prefix, "remove", "w-a", {"reason": "test"})
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        _, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=seq)
        assert again.sandbox_classes == changed.sandbox_classes


async def test_a_config_file_moved_away_is_said_once_and_its_return_too(nats_url, nc, prefix, tmp_path, caplog):
    """A user trial: `mv a1.toml a1.toml.bak` under a running agent logged `ignoring the edit of ...
    cannot read` at every watch (3 lines in 3 s, for ever), where broken TOML is said once. Now said
    once while the file stays away (the registration in force kept); its return is said, and handled
    as an edit; gone again, it is said again."""
    caplog.set_level(logging.INFO, logger="warmboot.agent")
    path, away = tmp_path / "a1.toml", tmp_path / "a1.toml.bak"
    path.write_text(config("v1"))
    agent = Agent(nats_url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
    looked: asyncio.Queue[None] = asyncio.Queue()
    look = agent._look

    def counted(stop: asyncio.Event) -> None:  # the agent's watch, counted
        look(stop)
        looked.put_nowait(None)

    agent._look = counted

    async def watches(count: int) -> None:
        """The agent's next `count` watches, from now."""
        while not looked.empty():
            looked.get_nowait()
        for _ in range(count):
            await asyncio.wait_for(looked.get(), 10)

    def said(words: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if words in r.getMessage()]

    gone = (f"ignoring the edit of {path}: cannot read: [Errno 2] No such file or directory: '{path}'; keeping the "
            "registration in force")
    async with running_registry(nats_url, prefix), agent_running(agent):
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        path.rename(away)
        await watches(5)
        assert said("cannot read") == [gone]
        away.rename(path)  # back as it was
        await watches(1)
        assert said("reads again") == [f"{path} reads again without error; it makes the registration in force"]
        path.rename(away)
        await watches(3)
        assert said("cannot read") == [gone, gone]
        path.write_text(config("v2"))  # back, edited: sent
        _, changed = await wait_event(nc, prefix, "w-a", RuntimeChanged, after=seq)
        assert changed.sandbox_classes[0].default_runtime.name == "gvisor-v2"
        assert said("cannot read") == [gone, gone] and said("reads again")[1:] == [f"{path} reads again without error"]


async def test_a_dropped_runtime_is_said_once_the_registry_has_the_drop(nats_url, nc, prefix, tmp_path, caplog):
    """Dropping v1 (docs/operations.md, step 5): the operator may remove v1's binary only once the log
    no longer offers it, and the agent said nothing that told when (an audit): its edit is sent beside
    the heartbeats, may wait, or be ignored or refused, and meanwhile v1 is placed here. The agent now
    says which runtimes the registry no longer offers, with the sequence of the change, after it; not
    a runtime made again on another CPU read under its name (its binary is still in use)."""
    import warmboot.agent as agent_module

    caplog.set_level(logging.INFO, logger="warmboot.agent")
    cpuinfo = tmp_path / "cpuinfo"
    shutil.copy(CPUINFO, cpuinfo)
    path = tmp_path / "agent.toml"
    path.write_text(config("v2", ("v1",)))
    agent = Agent(nats_url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe_interval_s=0.05,
                  probe=ProbeSettings(cpuinfo_path=cpuinfo, architecture="amd64"))
    said = Said()
    agent_module.log.addHandler(said)
    try:
        async with running_registry(nats_url, prefix), agent_running(agent):
            await said.until("registered w-a: REGISTERED")
            path.write_text(config("v2"))
            *before, done = await said.until("registered w-a: RUNTIME_CHANGED")
            line = before[-1] if before else "(nothing said before it)"
            _, changed = await wait_event(nc, prefix, "w-a", RuntimeChanged)
            assert changed.sandbox_classes[0].restorable_runtimes == ()
            assert "w-a: the registry no longer offers gvisor gvisor-v1 (rt-" in line, line
            assert f"as of seq {done.rsplit(' ', 1)[-1].rstrip(')')};" in line and "gvisor-v2" not in line
            # the machine moves to another CPU: gvisor-v2 is registered again, made on it, under its name
            shutil.copy(AMD, cpuinfo)
            said_then = await said.until("registered w-a: RUNTIME_CHANGED")
            assert not [s for s in said_then if "no longer offers" in s], said_then
    finally:
        agent_module.log.removeHandler(said)


async def test_a_registration_refused_at_start_is_raised_once_and_not_logged_again(nats_url, prefix, tmp_path,
                                                                                    caplog):
    """The registry refusing the first registration ends the agent with that error (the
    command prints it); the stop that follows does not log it a second time with a traceback."""
    path = tmp_path / "agent.toml"
    path.write_text(config("v1"))
    agent = Agent(nats_url, "w-refused", "node-a", path, prefix=prefix, probe=PROBE)

    async def refused(registration, stop):
        raise ContractError(ErrorCode.FAILED_PRECONDITION, "refused for the test")

    agent.register = refused
    with pytest.raises(ContractError, match="refused for the test"):
        await asyncio.wait_for(agent.run(asyncio.Event()), 15)
    assert not [r for r in caplog.records if r.exc_info is not None], [r.getMessage() for r in caplog.records]


async def test_agent_survives_a_nats_restart(tmp_path, prefix):
    server = NatsServer(tmp_path / "nats").start()
    client = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    try:
        path = tmp_path / "agent.toml"
        path.write_text(config("v1"))
        async with running_registry(server.url, prefix, ttl_s=5), running_agent(server.url, prefix, path):
            seq, _ = await wait_event(client, prefix, "w-a", WorkerRegistered)
            await asyncio.to_thread(server.restart)  # same port, same store directory
            path.write_text(config("v2", ("v1",)))
            _, changed = await wait_event(client, prefix, "w-a", RuntimeChanged, after=seq, timeout=30)
            assert same_version(changed.sandbox_classes[0].default_runtime.version, probed("v2"))
            reply, _ = await raw_request(client, prefix, "heartbeat", "w-a", {})
            assert reply == {"ttl_s": 5.0, "drained": None}
    finally:
        await client.close()
        server.stop()


@asynccontextmanager
async def agent_registered(tmp_path: Path, prefix: str, ttl_s: float, register=None, heartbeat=None):
    """A nats-server of the test's own (to restart), a client connection to it, a registry
    replica whose register and heartbeat endpoints, if given, are `register(its own)` and
    `heartbeat(its own)` (the real service, with a gate or a count around it), and an agent
    of w-a whose file says v1: (server, client, registry, agent, the file's path), once the
    agent's first registration is stored."""
    from services.registry.service import RegistryService

    server = NatsServer(tmp_path / "nats").start()
    client = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    registry_nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    registry = RegistryService(registry_nc, nats_url=server.url, prefix=prefix, ttl_s=ttl_s)
    if register is not None:
        registry.register = register(registry.register)
    if heartbeat is not None:
        registry.heartbeat = heartbeat(registry.heartbeat)
    await registry.start()
    try:
        path = tmp_path / "agent.toml"
        path.write_text(config("v1"))
        async with running_agent(server.url, prefix, path) as agent:
            await wait_event(client, prefix, "w-a", WorkerRegistered)
            yield server, client, registry, agent, path
    finally:
        await registry.stop()
        await registry_nc.close()
        await client.close()
        server.stop()


class Beats:
    """A heartbeat endpoint wrapper for `agent_registered`: `enough` is set once `count`
    heartbeats of `worker_id` were answered while `counting()`, `not_found` at a NOT_FOUND."""

    def __init__(self, worker_id: str, counting, count: int):
        self.worker_id, self.counting, self.count = worker_id, counting, count
        self.answered = 0
        self.enough, self.not_found = asyncio.Event(), asyncio.Event()

    def __call__(self, heartbeat):
        async def counted(worker_id, request):
            try:
                reply = await heartbeat(worker_id, request)
            except ContractError as e:
                if e.code == ErrorCode.NOT_FOUND:
                    self.not_found.set()
                raise
            if worker_id == self.worker_id and self.counting():
                self.answered += 1
                if self.answered == self.count:
                    self.enough.set()
            return reply
        return counted


async def test_after_a_nats_restart_the_agent_heartbeats_while_its_registration_waits(tmp_path, prefix):
    """When a fleet comes back from a NATS restart, every agent registers again and the
    registry takes tens of seconds to answer them all. An agent must go on beating
    meanwhile: here its registration is held at the registry for more than a TTL, and the
    worker is still alive (an agent that waited for the answer before beating again would
    have had it removed as LOST). The TTL, 6 s, leaves room for the restart itself. Nor is
    the registration sent again every 5 s while it waits: each repeat would cost the
    registry, busy with a fleet's, as much as the first."""
    hold, held, release, answered = False, asyncio.Event(), asyncio.Event(), asyncio.Event()
    arrivals = 0
    # a beat every TTL / 3 = 2 s: 4 of them while the registration is held are more than a TTL
    beats = Beats("w-a", lambda: held.is_set() and not release.is_set(), 4)

    def held_register(register):
        async def gated(worker_id, request):
            nonlocal arrivals
            if not hold:
                return await register(worker_id, request)
            arrivals += 1
            held.set()
            await release.wait()
            reply = await register(worker_id, request)
            answered.set()
            return reply
        return gated

    async with agent_registered(tmp_path, prefix, 6, held_register, beats) as (server, client, registry, agent, path):
        try:
            hold = True
            await asyncio.to_thread(server.restart)  # same port, same store directory
            await asyncio.wait_for(held.wait(), 30)  # the agent's registration again, held
            await asyncio.wait_for(beats.enough.wait(), 30)  # the agent beats while its registration waits
            assert agent.registering  # still on its way, a TTL on
            assert arrivals == 1  # 8 s on, not asked again
            reply, _ = await raw_request(client, prefix, "heartbeat", "w-a", {})
            assert reply == {"ttl_s": 6.0, "drained": None}, reply  # not NOT_FOUND: never removed as LOST
            release.set()
            await asyncio.wait_for(answered.wait(), 30)
            reply, _ = await raw_request(client, prefix, "heartbeat", "w-a", {})
            assert reply == {"ttl_s": 6.0, "drained": None}, reply
        finally:
            release.set()


async def test_a_worker_removed_while_its_registration_waits_comes_back_and_keeps_beating(tmp_path, prefix):
    """A heartbeat answered NOT_FOUND while the registration after a reconnect waits at the
    registry (the worker was removed meanwhile: by an operator, or as LOST after a long
    outage) sends no second registration behind it: the one on its way brings the worker
    back, and the agent goes on beating while the rest of the fleet's registrations are
    answered. A second one, held like the rest, would have stopped its heartbeats and had
    the new life removed as LOST."""
    hold, first_id = False, None
    first_held, release_first, release_rest = asyncio.Event(), asyncio.Event(), asyncio.Event()
    beats = Beats("w-a", release_first.is_set, 4)  # a beat every TTL / 3 = 2 s: 4 are more than a TTL

    def held_register(register):
        async def gated(worker_id, request):
            nonlocal first_id
            if hold:
                first_id = first_id or request.request_id
                if request.request_id == first_id:  # the registration after the reconnect, and its retries
                    first_held.set()
                    await release_first.wait()
                else:  # any other: the rest of the fleet's storm, still being answered
                    await release_rest.wait()
            return await register(worker_id, request)
        return gated

    async with agent_registered(tmp_path, prefix, 6, held_register, beats) as (server, client, registry, agent, path):
        try:
            hold = True
            await asyncio.to_thread(server.restart)
            await asyncio.wait_for(first_held.wait(), 30)
            reply, _ = await raw_request(client, prefix, "remove", "w-a", {"reason": "test"})
            await asyncio.wait_for(beats.not_found.wait(), 30)  # the agent's next beat hears it
            release_first.set()  # the registration on its way is decided: a new life
            await wait_event(client, prefix, "w-a", WorkerRegistered, after=reply["seq"])
            await asyncio.wait_for(beats.enough.wait(), 30)  # the new life beats on while the rest waits
            reply, _ = await raw_request(client, prefix, "heartbeat", "w-a", {})
            assert reply == {"ttl_s": 6.0, "drained": None}, reply  # alive: not removed as LOST again
        finally:
            release_first.set()
            release_rest.set()


async def test_a_registration_edited_while_the_one_before_waits_is_decided_after_it(tmp_path, prefix):
    """Registrations are sent one after the other: the file edited to v2 while the
    re-registration after a NATS restart (still v1) is held at the registry is sent once
    that one is answered. Sent beside it, v2 would be decided first and the held v1 after
    it, leaving the registry with runtimes the worker no longer runs. And the edit's
    registration, waiting its turn, does not hold up the heartbeats (a rollout that edits
    every agent's file at once is a storm too)."""
    hold, edited, release, v2_after_release = False, False, asyncio.Event(), asyncio.Event()
    one_held = asyncio.Event()
    # a beat every TTL / 3 = 2 s: 4 of them while the edit waits its turn are more than a TTL
    beats = Beats("w-a", lambda: edited and not release.is_set(), 4)

    def is_v1(request) -> bool:
        return same_version(request.sandbox_classes[0].default_runtime.version, probed("v1"))

    def held_register(register):
        async def gated(worker_id, request):
            if hold and is_v1(request):
                one_held.set()
                await release.wait()
            reply = await register(worker_id, request)
            if not is_v1(request) and release.is_set():
                v2_after_release.set()
            return reply
        return gated

    async with agent_registered(tmp_path, prefix, 6, held_register, beats) as (server, client, registry, agent, path):
        try:
            hold = True
            await asyncio.to_thread(server.restart)
            await asyncio.wait_for(one_held.wait(), 30)  # the registration after the reconnect, v1, held
            path.write_text(config("v2", ("v1",)))  # read by the agent's watch every 0.05 s
            edited = True
            # 4 beats, 8 s: long enough for a v2 sent beside the held v1 to be decided before it
            await asyncio.wait_for(beats.enough.wait(), 30)  # beating while v1 is held and v2 waits
            release.set()
            await asyncio.wait_for(v2_after_release.wait(), 30)
            worker = await registry.store.load("w-a")  # its history, as the registry decides on it
            [entry] = worker.sandbox_classes
            assert same_version(entry.default_runtime.version, probed("v2"))
        finally:
            release.set()


class Gate:
    """A register endpoint wrapper for `agent_registered`: registrations that `holds(request)`
    wait for `release` (`arrived` is set by the first); every one that arrives is kept in
    `requests`, and `refused` is set at the first refusal."""

    def __init__(self, holds):
        self.holds = holds
        self.requests: list = []
        self.arrived, self.release, self.refused = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def __call__(self, register):
        async def gated(worker_id, request):
            self.requests.append(request)
            if not self.release.is_set() and self.holds(request):
                self.arrived.set()
                await self.release.wait()
            try:
                return await register(worker_id, request)
            except ContractError:
                self.refused.set()
                raise
        return gated


def classes_of(registration) -> set[str]:
    return {c.sandbox_class for c in registration.sandbox_classes}


def default_of(registration) -> str:
    return registration.sandbox_classes[0].default_runtime.name


def reads_of(agent: Agent) -> asyncio.Queue:
    """What the agent reads of its file from now on (each new read), in order."""
    reads: asyncio.Queue = asyncio.Queue()
    read = agent._read_config

    def watched():
        registration = read()
        if registration is not None:
            reads.put_nowait(registration)
        return registration

    agent._read_config = watched
    return reads


async def test_an_edit_read_while_a_registration_waits_is_sent_only_if_still_the_files(tmp_path, prefix):
    """The file edited to v2 (its registration held at the registry), then to v2 and a microvm
    class by mistake, then back to v2 at once: only what the file says when the edit's turn
    comes is sent. A read the file has moved on from is never registered: in a new life
    (the worker removed meanwhile) it would have made the registry believe the worker runs
    microvm for the whole of that life."""
    from tests.test_agent_faults import MICROVM

    gate = Gate(lambda r: default_of(r) == "gvisor-v2" and classes_of(r) == {"gvisor"})
    async with agent_registered(tmp_path, prefix, 6, gate) as (server, client, registry, agent, path):
        try:
            reads = reads_of(agent)
            path.write_text(config("v2", ("v1",)))
            await asyncio.wait_for(gate.arrived.wait(), 10)  # the v2 edit, held
            path.write_text(config("v2", ("v1",)) + MICROVM)  # a mistake...
            while "microvm" not in classes_of(await asyncio.wait_for(reads.get(), 10)):
                pass
            path.write_text(config("v2", ("v1",)))  # ...undone at once
            while "microvm" in classes_of(await asyncio.wait_for(reads.get(), 10)):
                pass
            gate.release.set()
            await asyncio.wait_for(asyncio.gather(*list(agent._background)), 30)  # every registration done
            assert [(default_of(r), classes_of(r)) for r in gate.requests[1:]] == [("gvisor-v2", {"gvisor"})] * (
                len(gate.requests) - 1)  # the microvm read never sent (the held v2 may be asked again)
            worker = await registry.store.load("w-a")
            assert classes_of(worker) == {"gvisor"} and default_of(worker) == "gvisor-v2"
        finally:
            gate.release.set()


@asynccontextmanager
async def held_after_a_refused_class_change(tmp_path, prefix, holds):
    """An agent whose change of class the registry refused (a worker does not change class);
    then NATS restarts and the first registration after it that `holds(gate, request)` is held
    at the registry. Yields (client, agent, path, gate): `gate.release` lets it through."""
    from tests.test_agent_faults import MICROVM

    gate = Gate(lambda r: False)
    async with agent_registered(tmp_path, prefix, 6, gate) as (server, client, registry, agent, path):
        try:
            path.write_text(config("v1") + MICROVM)
            await asyncio.wait_for(gate.refused.wait(), 10)  # a change of class: refused
            await asyncio.wait_for(asyncio.gather(*list(agent._background)), 30)
            gate.refused.clear()
            gate.holds = lambda r: holds(gate, r)
            await asyncio.to_thread(server.restart)
            await asyncio.wait_for(gate.arrived.wait(), 30)
            yield client, agent, path, gate
        finally:
            gate.release.set()


def in_force(gate: Gate, request) -> bool:
    """The registration in force, sent again after the file's was refused (the worker is alive)."""
    return gate.refused.is_set() and classes_of(request) == {"gvisor"}


async def test_a_new_life_after_a_reconnect_takes_up_the_change_of_class_the_last_one_was_refused(tmp_path, prefix):
    """A change of class is refused (a worker does not change class). NATS restarts, and while
    the registration after the reconnect waits at the registry, the worker is removed: the new
    life registers what the file says, the new class included, not the registration the last
    life had in force."""
    first = lambda gate, r: True  # noqa: E731  (the first registration after the restart, whichever)
    async with held_after_a_refused_class_change(tmp_path, prefix, first) as (client, agent, path, gate):
        reply, _ = await raw_request(client, prefix, "remove", "w-a", {"reason": "class change"})
        gate.release.set()
        _, again = await wait_event(client, prefix, "w-a", WorkerRegistered, after=reply["seq"])
        assert classes_of(again) == {"gvisor", "microvm"}


async def test_a_new_life_begun_by_the_registration_in_force_is_ended_for_the_file_s(tmp_path, prefix):
    """The worker is removed while the registration in force waits at the registry,
    so it begins a new life with the classes of the last one, which the file no longer lists (a
    scheduler would send that worker resumes of a class it dropped). The agent ends that life
    and begins one with what the file says."""
    async with held_after_a_refused_class_change(tmp_path, prefix, in_force) as (client, agent, path, gate):
        removed, _ = await raw_request(client, prefix, "remove", "w-a", {"reason": "class change"})
        gate.release.set()
        seq, stale = await wait_event(client, prefix, "w-a", WorkerRegistered, after=removed["seq"])
        assert classes_of(stale) == {"gvisor"}  # the race this test makes: a life with the old classes
        ended, gone = await wait_event(client, prefix, "w-a", WorkerRemoved, after=seq)
        _, again = await wait_event(client, prefix, "w-a", WorkerRegistered, after=ended)
        assert classes_of(again) == {"gvisor", "microvm"}
        assert "file" in gone.reason


async def test_a_new_life_begun_by_the_registration_in_force_stays_when_the_file_keeps_its_classes(tmp_path, prefix):
    """As above, but while the registration in force waits the file is edited back to its
    classes, with a new runtime: the new life has the file's classes, so it stays, and the edit
    is a runtime change on it (nothing removed by the agent)."""
    async with held_after_a_refused_class_change(tmp_path, prefix, in_force) as (client, agent, path, gate):
        removed, _ = await raw_request(client, prefix, "remove", "w-a", {"reason": "operator"})
        reads = reads_of(agent)
        path.write_text(config("v2", ("v1",)))  # gvisor only again, at v2
        read = await asyncio.wait_for(reads.get(), 10)
        assert classes_of(read) == {"gvisor"} and default_of(read) == "gvisor-v2"
        gate.release.set()
        seq, stale = await wait_event(client, prefix, "w-a", WorkerRegistered, after=removed["seq"])
        assert classes_of(stale) == {"gvisor"} and default_of(stale) == "gvisor-v1"
        _, then = await wait_event(client, prefix, "w-a", (RuntimeChanged, WorkerRemoved), after=seq)
        assert isinstance(then, RuntimeChanged) and then.sandbox_classes[0].default_runtime.name == "gvisor-v2"


async def test_agent_command_drains_on_sigterm(nats_url, nc, prefix, tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text(config("v1"))
    async with running_registry(nats_url, prefix):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "from warmboot.cli import main; main()",
            "agent", "--nats", nats_url, "--worker-id", "w-cli", "--node", "node-a", "--config", str(path),
            "--prefix", prefix, "--drain-on-exit", "--cpuinfo", str(CPUINFO), "--arch", "amd64",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        try:
            seq, _ = await wait_event(nc, prefix, "w-cli", WorkerRegistered)
            proc.send_signal(signal.SIGTERM)
            _, drained = await wait_event(nc, prefix, "w-cli", WorkerDrained, after=seq)
            assert drained.reason == "agent stopped"
            out, err = await asyncio.wait_for(proc.communicate(), 15)
            assert proc.returncode == 0, err.decode()
            assert b"agent w-cli stopped" in out
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


def test_agent_command_prints_the_registration(tmp_path):
    from click.testing import CliRunner

    from warmboot.cli import main

    path = tmp_path / "agent.toml"
    path.write_text(config("v1"))
    result = CliRunner().invoke(main, ["agent", "--worker-id", "w-a", "--node", "node-a", "--config", str(path),
                                       "--cpuinfo", str(CPUINFO), "--arch", "amd64", "--print-registration"])
    assert result.exit_code == 0, result.output
    assert '"gvisor_asset_hash"' in result.output and '"cpu_features"' in result.output
    bad = CliRunner().invoke(main, ["agent", "--worker-id", "bad id", "--node", "n", "--config", str(path)])
    assert bad.exit_code == 2 and "is not an id: 1 to 128 letters" in bad.output
    # a config file that is not there is a usage error, said before anything starts (it was said after
    # the agent's loop had started, exit 1, as if the file had become unreadable while it ran)
    missing = CliRunner().invoke(main, ["agent", "--worker-id", "w-a", "--node", "n", "--nats", "nats://127.0.0.1:1",
                                        "--config", str(tmp_path / "missing.toml")])
    assert missing.exit_code == 2, missing.output
    assert "Invalid value for '--config'" in missing.output and "missing.toml' does not exist" in missing.output
    # so is a --cpuinfo given that is not there (it registered the architecture alone, as on a machine
    # without /proc/cpuinfo: `probe --cpuinfo`'s user trial)
    nowhere = CliRunner().invoke(main, ["agent", "--worker-id", "w-a", "--node", "n", "--config", str(path),
                                        "--cpuinfo", str(tmp_path / "nope"), "--print-registration"])
    assert nowhere.exit_code == 2 and nowhere.stdout == "", nowhere.output
    assert f"Invalid value for '--cpuinfo': File '{tmp_path / 'nope'}' does not exist." in nowhere.stderr


async def test_agent_stops_promptly_while_nats_is_unreachable(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text(config("v1"))
    agent = Agent("nats://127.0.0.1:1", "w-a", "node-a", path, drain_on_exit=True, probe=PROBE)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    await asyncio.sleep(0)  # let it start connecting (one turn of the loop, not a wait)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert agent.nc is None and not agent.sent_registration
