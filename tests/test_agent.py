"""The worker agent end to end: a config file, the real registry, the real bus.

It registers, follows edits of its file (the rolling upgrade), registers again when
the registry forgot it, survives a NATS restart, and drains on SIGTERM.
"""

from __future__ import annotations

import asyncio
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
from tests.registry_helpers import CPUINFO, PROBE, agent_config as config, raw_request, running_registry, wait_event
from warmboot.agent import Agent, ConfigError, load_registration, parse_config
from warmboot.natsserver import NatsServer

ROOT = Path(__file__).parent.parent


def probed(asset: str):
    return probe_version(CPUINFO.read_text(), "amd64", "gvisor", {"gvisor_asset_hash": asset})


@asynccontextmanager
async def running_agent(nats_url: str, prefix: str, config_path: Path, worker_id: str = "w-a"):
    agent = Agent(nats_url, worker_id, "node-a", config_path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        yield agent
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


# --- configuration -------------------------------------------------------------------------------


def test_example_config_makes_a_valid_registration():
    registration = load_registration(ROOT / "examples" / "agent.toml", "w-17", "node-a", PROBE)
    classes = {c.sandbox_class: c for c in registration.sandbox_classes}
    assert set(classes) == {"gvisor", "microvm"}
    gvisor = classes["gvisor"]
    keys = {a.key for a in gvisor.default_runtime.version.attributes}
    assert keys == {"architecture", "cpu_features", "gvisor_asset_hash"}
    assert [r.name for r in gvisor.restorable_runtimes] == ["gvisor-2026-09", "gvisor-2026-08"]
    microvm = {a.key for a in classes["microvm"].default_runtime.version.attributes}
    assert {"architecture", "cpu_vendor", "cpu_model", "kernel_digest", "rootfs_digest"} == microvm


@pytest.mark.parametrize(
    "text, where",
    [
        ("[capacity\n", "not valid TOML"),
        (config("v1").replace("zone = ", "zone_typo = 1\nzone = "), "labels"),
        (config("v1").replace('name = "gvisor-v1"', 'nmae = "gvisor-v1"'), "nmae"),
        (config("v1").replace('profile = "gvisor"', 'profile = "qemu"'), "sandbox_classes[0].default_runtime.profile"),
        (config("v1", ("v1",)), "sandbox_classes[0].restorable_runtimes[0].version"),
        (config("v1").replace("cpu_millis = 4000", "cpu_millis = 0"), "capacity.cpu_millis"),
        (config("v1").replace('"v1" }', '"v1", architecture = "arm64" }'), "architecture"),
    ],
    ids=["toml", "label-type", "unknown-key", "profile", "restorable-equals-default", "capacity", "probed-key-given"],
)
def test_bad_config_says_where(tmp_path, text, where):
    path = tmp_path / "agent.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_registration(path, "w-a", "node-a", PROBE)
    assert where in str(error.value)


async def test_a_broken_edit_keeps_the_registration_in_force(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text(config("v1"))
    agent = Agent("nats://127.0.0.1:1", "w-a", "node-a", path, probe=PROBE)
    agent.registration = agent._read_config()
    path.write_text(config("v2").replace("[capacity]", "[capacity"))
    await agent._sync_config(asyncio.Event())  # logs the error, sends nothing
    assert agent.registration.sandbox_classes[0].default_runtime.name == "gvisor-v1"
    assert parse_config(config("v2")).sandbox_classes[0].default_runtime.name == "gvisor-v2"


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
            assert reply == {"ttl_s": 5.0}
    finally:
        await client.close()
        server.stop()


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
    assert bad.exit_code == 2 and "one NATS subject token" in bad.output


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
