"""`warmboot nats-config` on a real nats-server: what each role may and may not say.

A server runs with the generated authorization block; the registry connects as the
services user; a worker's credentials register that worker and nothing else.
"""

from __future__ import annotations

import asyncio
import json
import stat

import nats
import pytest
from click.testing import CliRunner

from events.codec import decode_event
from events.schema import RuntimeChanged, WorkerRegistered
from events.subjects import event_subject, service_subject, stream_name
from tests.registry_helpers import PROBE, agent_config, last_seq, registration, running_registry, wait_event
from warmboot.agent import Agent
from warmboot.cli import main
from warmboot.cmd_registry import nats_auth_config
from warmboot.natsserver import NatsServer

PREFIX = "authz"
PASSWORDS = {"svc": "svc-secret", "ops": "ops-secret", "w-1": "w1-secret", "w-2": "w2-secret", "w-3": "w3-secret"}


class Client:
    """A connection as one user, collecting the permission violations the server reports."""

    def __init__(self):
        self.violations: asyncio.Queue[str] = asyncio.Queue()
        self.nc = None

    async def connect(self, server: NatsServer, user: str, **options) -> "Client":
        async def on_error(error: Exception) -> None:
            if "permissions violation" in str(error).lower():
                self.violations.put_nowait(str(error))

        url = f"nats://{user}:{PASSWORDS[user]}@{server.host}:{server.port}"
        self.nc = await nats.connect(url, error_cb=on_error, **options)
        return self

    async def violation(self, subject: str) -> str:
        """The server's refusal of `subject` (waits for the -ERR it sends back; the
        client reports it in lower case)."""
        while True:
            message = await asyncio.wait_for(self.violations.get(), 10)
            if subject.lower() in message.lower():
                return message


@pytest.fixture(scope="module")
async def secured(tmp_path_factory):
    conf = nats_auth_config(PREFIX, "svc", ["w-1", "w-2", "w-3"], ["ops"], PASSWORDS)
    server = NatsServer(tmp_path_factory.mktemp("secured"), extra_config=conf).start()
    services_url = f"nats://svc:{PASSWORDS['svc']}@{server.host}:{server.port}"
    async with running_registry(services_url, PREFIX):
        yield server
    server.stop()


async def test_no_credentials_no_connection(secured):
    with pytest.raises(Exception):
        await nats.connect(secured.url, max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=2)


async def test_a_worker_speaks_only_for_itself(secured):
    admin = await Client().connect(secured, "svc")
    worker = await Client().connect(secured, "w-1", inbox_prefix="_INBOX.w-1")
    try:
        subject = service_subject(PREFIX, "registry", "register", "w-1")
        reply = await worker.nc.request(subject, json.dumps(registration("w-1")).encode(), timeout=10)
        assert json.loads(reply.data)["outcome"] == "REGISTERED"
        hb = await worker.nc.request(service_subject(PREFIX, "registry", "heartbeat", "w-1"), b"{}", timeout=10)
        assert "ttl_s" in json.loads(hb.data)
        before = await last_seq(admin.nc, PREFIX)

        # another worker's subject, even with the other worker's body
        other = service_subject(PREFIX, "registry", "register", "w-2")
        await worker.nc.publish(other, json.dumps(registration("w-2")).encode())
        assert "publish" in await worker.violation(other)

        # the event log
        forged = event_subject(PREFIX, "worker", "w-1")
        await worker.nc.publish(forged, b'{"type":"WorkerRemoved","at":"2026-01-01T00:00:00Z","worker_id":"w-1"}')
        await worker.violation(forged)
        js_api = f"$JS.API.STREAM.INFO.{stream_name(PREFIX)}"
        await worker.nc.publish(js_api, b"")
        await worker.violation(js_api)

        # the scheduler
        for verb in ("resume.a-1", "explain.a-1", "fragmentation"):
            subject = f"{PREFIX}.scheduler.{verb}"
            await worker.nc.publish(subject, b"{}")
            await worker.violation(subject)

        # other clients' replies
        await worker.nc.subscribe("_INBOX.>")
        await worker.violation("_INBOX.>")

        # a round trip proves the server has handled all of the above, then: nothing written
        assert (await worker.nc.request(service_subject(PREFIX, "registry", "heartbeat", "w-1"), b"{}", timeout=10))
        assert await last_seq(admin.nc, PREFIX) == before
    finally:
        await worker.nc.close()
        await admin.nc.close()


async def test_an_operator_reads_the_log_and_queries_but_writes_nothing(secured):
    admin = await Client().connect(secured, "svc")
    ops = await Client().connect(secured, "ops")
    try:
        subject = service_subject(PREFIX, "registry", "register", "w-2")
        await admin.nc.request(subject, json.dumps(registration("w-2")).encode(), timeout=10)
        before = await last_seq(admin.nc, PREFIX)

        js = ops.nc.jetstream()
        info = await js.stream_info(stream_name(PREFIX))
        assert info.state.last_seq == before
        last = await js.get_last_msg(stream_name(PREFIX), event_subject(PREFIX, "worker", "w-2"))
        assert decode_event(last.data).worker_id == "w-2"
        sub = await js.subscribe(f"{PREFIX}.ev.>", ordered_consumer=True, stream=stream_name(PREFIX))
        first = await sub.next_msg(timeout=10)
        assert first.metadata.sequence.stream >= 1
        await sub.unsubscribe()

        # explain and fragmentation may be called (no scheduler runs here: no responders)
        with pytest.raises(nats.errors.NoRespondersError):
            await ops.nc.request(f"{PREFIX}.scheduler.fragmentation", b"{}", timeout=5)
        with pytest.raises(nats.errors.NoRespondersError):
            await ops.nc.request(f"{PREFIX}.scheduler.explain.a-1", b"{}", timeout=5)

        for subject in (f"{PREFIX}.ev.worker.w-2", f"{PREFIX}.registry.remove.w-2",
                        f"{PREFIX}.scheduler.resume.a-1", f"$JS.API.STREAM.PURGE.{stream_name(PREFIX)}"):
            await ops.nc.publish(subject, b"{}")
            await ops.violation(subject)
        await ops.nc.flush()
        assert await last_seq(admin.nc, PREFIX) == before
    finally:
        await ops.nc.close()
        await admin.nc.close()


def test_command_writes_private_files_and_keeps_passwords(tmp_path):
    conf, secrets = tmp_path / "auth.conf", tmp_path / "secrets.json"
    runner = CliRunner()
    args = ["nats-config", "--prefix", "wb", "--worker", "w-1", "--operator", "ops",
            "--secrets", str(secrets), "--out", str(conf)]
    first = runner.invoke(main, args)
    assert first.exit_code == 0, first.output
    passwords = json.loads(secrets.read_text())
    assert set(passwords) == {"warmboot-services", "ops", "w-1"}
    for path in (conf, secrets):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = conf.read_text()
    assert '"wb.registry.*.w-1"' in text and '"_INBOX.w-1.>"' in text
    assert '"wb.scheduler.fragmentation"' in text

    second = runner.invoke(main, [*args, "--worker", "w-2"])
    assert second.exit_code == 0, second.output
    again = json.loads(secrets.read_text())
    assert {k: again[k] for k in passwords} == passwords and "w-2" in again

    clash = runner.invoke(main, ["nats-config", "--worker", "ops", "--operator", "ops"])
    assert clash.exit_code == 2 and "unique" in clash.output
    bad = runner.invoke(main, ["nats-config", "--worker", "w.1"])
    assert bad.exit_code == 2


async def test_the_agent_works_with_worker_credentials(secured, tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    admin = await Client().connect(secured, "svc")
    url = f"nats://w-3:{PASSWORDS['w-3']}@{secured.host}:{secured.port}"
    agent = Agent(url, "w-3", "node-c", path, prefix=PREFIX, watch_interval_s=0.05, probe=PROBE)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        seq, _ = await wait_event(admin.nc, PREFIX, "w-3", WorkerRegistered)
        path.write_text(agent_config("v2", ("v1",)))
        await wait_event(admin.nc, PREFIX, "w-3", RuntimeChanged, after=seq)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await admin.nc.close()
