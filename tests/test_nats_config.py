"""`warmboot nats-config` on a real nats-server: what each role may and may not say, and
each way of proving who one is (passwords, bcrypt hashes, nkeys).

A server runs with the generated authorization block; the registry connects as the
services user; a worker's credentials register that worker and nothing else.
"""

from __future__ import annotations

import asyncio
import json
import re
import stat
from contextlib import AsyncExitStack

import nats
import pytest
from click.testing import CliRunner

from events.codec import decode_event
from events.natsauth import INBOX_PREFIX_ENV, NKEY_SEED_ENV, env_sign_in, inbox_prefix, redact_url
from events.schema import RuntimeChanged, WorkerRegistered
from events.subjects import event_subject, service_subject, stream_name
from tests.factories import SILENT_TTL_S
from tests.factories import last_seq
from tests.registry_helpers import PROBE, agent_config, registration, wait_event
from tests.secured_helpers import Secured, Serve
from warmboot.agent import Agent
from warmboot.cli import main
from warmboot.cli_common import log_messages
from warmboot.nats_config import new_nkey_seed, nkey_public
from warmboot.natsserver import NatsServer
from warmboot.runner import start_services

PREFIX = "authz"
HEARTBEATS = f"KV_{PREFIX.upper()}_HEARTBEATS"


@pytest.fixture(scope="module")
async def secured(tmp_path_factory):
    server = Secured(tmp_path_factory.mktemp("secured"), PREFIX, workers=("w-1", "w-2", "w-3"),
                     operators=("ops",)).start()
    async with AsyncExitStack() as stack:
        # workers registered here beat once at most: a long TTL keeps their removals (LOST) out of
        # the "nothing written" checks, however slowly a loaded machine runs the module
        await start_services(stack, ["registry"], server.url("svc"), PREFIX,
                             options={"registry": {"ttl_s": SILENT_TTL_S}})
        yield server
    server.stop()


async def test_no_credentials_no_connection(secured):
    with pytest.raises(Exception):
        await nats.connect(secured.url(), max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=2)


async def test_a_worker_speaks_only_for_itself(secured):
    admin = await secured.connect("svc")
    worker = await secured.connect("w-1")
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

        # the scheduler and the snapshotter
        for verb in ("scheduler.resume.a-1", "scheduler.explain.a-1", "scheduler.fragmentation",
                     "snapshotter.create.a-1"):
            subject = f"{PREFIX}.{verb}"
            await worker.nc.publish(subject, b"{}")
            await worker.violation(subject)

        # other clients' replies
        await worker.nc.subscribe("_INBOX.>")
        await worker.violation("_INBOX.>")

        # a round trip proves the server has handled all of the above, then: nothing written
        assert (await worker.nc.request(service_subject(PREFIX, "registry", "heartbeat", "w-1"), b"{}", timeout=10))
        assert await last_seq(admin.nc, PREFIX) == before
    finally:
        await worker.close()
        await admin.close()


async def test_an_operator_reads_the_log_and_queries_but_writes_nothing(secured):
    admin = await secured.connect("svc")
    worker = await secured.connect("w-2")
    ops = await secured.connect("ops")
    try:
        subject = service_subject(PREFIX, "registry", "register", "w-2")
        await worker.nc.request(subject, json.dumps(registration("w-2")).encode(), timeout=10)
        before = await last_seq(admin.nc, PREFIX)
        beats = (await admin.nc.jetstream().stream_info(HEARTBEATS)).state.last_seq

        js = ops.nc.jetstream()
        info = await js.stream_info(stream_name(PREFIX))
        assert info.state.last_seq == before
        last = await js.get_last_msg(stream_name(PREFIX), event_subject(PREFIX, "worker", "w-2"))
        assert decode_event(last.data).worker_id == "w-2"
        # the whole log, by batched direct gets (what `warmboot audit`, `workers` and `whatif` read with)
        read = [(seq, subject) async for seq, subject, _, _ in log_messages(ops.nc, PREFIX)]
        assert [seq for seq, _ in read] == list(range(1, before + 1))
        assert event_subject(PREFIX, "worker", "w-2") in {subject for _, subject in read}

        # JetStream answers onto the reply subject it is given, with its account's rights: an
        # operator's request names one of the log's subjects, or the heartbeat bucket's, and
        # what it gets stays in the operators' account (nothing lands in the log, nor the bucket)
        for api in ("$JS.API.INFO", f"$JS.API.STREAM.INFO.{stream_name(PREFIX)}"):
            for target in (event_subject(PREFIX, "worker", "w-2"), f"$KV.{PREFIX.upper()}_HEARTBEATS.w-2"):
                await ops.nc.publish(api, b"", reply=target)
        await ops.nc.publish(f"$JS.API.DIRECT.GET.{stream_name(PREFIX)}", json.dumps({"seq": 1}).encode(),
                             reply=event_subject(PREFIX, "copy", "x"))
        # and it creates no consumer (whose deliveries it could point at the log)
        for subject in (f"$JS.API.CONSUMER.CREATE.{stream_name(PREFIX)}",
                        f"$JS.API.CONSUMER.CREATE.{stream_name(PREFIX)}.c.{PREFIX}.ev.>"):
            await ops.nc.publish(subject, b"{}")
            await ops.violation(subject)
        await ops.nc.flush()
        assert await ops.nc.jetstream().stream_info(stream_name(PREFIX))  # the answers above were sent

        # explain and fragmentation may be called (no scheduler runs here: no responders)
        with pytest.raises(nats.errors.NoRespondersError):
            await ops.nc.request(f"{PREFIX}.scheduler.fragmentation", b"{}", timeout=5)
        with pytest.raises(nats.errors.NoRespondersError):
            await ops.nc.request(f"{PREFIX}.scheduler.explain.a-1", b"{}", timeout=5)

        for subject in (f"{PREFIX}.ev.worker.w-2", f"{PREFIX}.registry.remove.w-2", f"{PREFIX}.scheduler.resume.a-1",
                        f"{PREFIX}.snapshotter.stop.a-1", f"$JS.API.STREAM.PURGE.{stream_name(PREFIX)}",
                        f"$JS.API.CONSUMER.DELETE.{stream_name(PREFIX)}.any"):
            await ops.nc.publish(subject, b"{}")
            await ops.violation(subject)
        await ops.nc.flush()
        assert await last_seq(admin.nc, PREFIX) == before
        assert (await admin.nc.jetstream().stream_info(HEARTBEATS)).state.last_seq == beats
    finally:
        for client in (ops, worker, admin):
            await client.close()


async def test_the_services_unpin_and_replace_the_sweep_s_consumer_and_delete_no_other(secured):
    """A registry replica that stops unpins the sweep (`CONSUMER.UNPIN`), and the first of a new version
    replaces an earlier version's consumer (`CONSUMER.DELETE`): the generated permissions let the
    services do both to `registry-sweeper`, and delete no other consumer of the bucket."""
    from services.registry.liveness import PIN_GROUP, SWEEPER

    admin = await secured.connect("svc")
    try:
        unpin = f"$JS.API.CONSUMER.UNPIN.{HEARTBEATS}.{SWEEPER}"
        answer = json.loads((await admin.nc.request(unpin, json.dumps({"group": PIN_GROUP}).encode(), timeout=10)).data)
        assert answer == {"type": "io.nats.jetstream.api.v1.consumer_unpin_response"}, answer  # no error
        other = f"$JS.API.CONSUMER.DELETE.{HEARTBEATS}.another"
        await admin.nc.publish(other, b"")
        assert "publish" in await admin.violation(other)
        assert not [line for line in secured.violations() if f"UNPIN.{HEARTBEATS}" in line]
        # the module's registry, unpinned, is pinned again at its next delivery: it still sweeps
        assert (await admin.nc.jetstream().consumer_info(HEARTBEATS, SWEEPER)).name == SWEEPER
    finally:
        await admin.close()


def test_command_writes_private_files_and_keeps_passwords(tmp_path):
    conf, secrets = tmp_path / "auth.conf", tmp_path / "secrets.json"
    runner = CliRunner()
    args = ["nats-config", "--prefix", "wb", "--worker", "w-1", "--operator", "ops", "--client", "orch",
            "--secrets", str(secrets), "--out", str(conf)]
    first = runner.invoke(main, args)
    assert first.exit_code == 0, first.output
    assert "note:" not in first.stderr, first.stderr  # kept: nothing to warn of
    passwords = json.loads(secrets.read_text())
    assert passwords.pop("_roles") == {"warmboot-services": "services", "ops": "operator", "orch": "client",
                                       "w-1": "worker"}  # what each secret was made for
    assert set(passwords) == {"warmboot-services", "ops", "orch", "w-1"}
    for path in (conf, secrets):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = conf.read_text()
    assert 'include "auth.conf"' in text.splitlines()[1]  # the file's own name, not warmboot-auth.conf (a trial)
    assert '"wb.registry.*.w-1"' in text and '"_INBOX.w-1.>"' in text and '"_INBOX.orch.>"' in text
    assert '"wb.scheduler.fragmentation"' in text
    services = next(line for line in text.splitlines() if '"warmboot-services"' in line)
    assert '"wb.ev.>"' in services and '"wb.registry.>"' in services  # publishes events, serves requests
    assert '"wb.registry.' not in services.split("subscribe:")[0]  # never publishes onto a request subject

    second = runner.invoke(main, [*args, "--worker", "w-2"])
    assert second.exit_code == 0, second.output
    again = json.loads(secrets.read_text())
    assert {k: again[k] for k in passwords} == passwords and "w-2" in again

    # a name listed under another role than its secret was made for gets a new one: a worker's secret,
    # on the worker's machine, does not become a client's, which may stop any actor (found by an audit)
    moved = runner.invoke(main, ["--client" if a == "--worker" else a for a in args])
    assert moved.exit_code == 0, moved.output
    assert "new secrets for users listed in another role than before: w-1" in moved.output
    roles = json.loads(secrets.read_text())
    assert roles["w-1"] != again["w-1"] and roles["_roles"]["w-1"] == "client"
    assert {k: roles[k] for k in ("ops", "orch")} == {k: again[k] for k in ("ops", "orch")}

    # without --secrets, every run makes every password anew: said, since a reload then signs everyone out
    # (the --help example had no --secrets, and a trial's second run did so in silence)
    unkept = [runner.invoke(main, ["nats-config", "--worker", "w-1", "--out", str(tmp_path / f"{n}.conf")])
              for n in "ab"]
    assert all(r.exit_code == 0 and "note: every user got a new password, kept nowhere but in this configuration"
               in r.stderr and "--secrets FILE" in r.stderr for r in unkept), [r.output for r in unkept]
    assert (tmp_path / "a.conf").read_text() != (tmp_path / "b.conf").read_text()

    clash = runner.invoke(main, ["nats-config", "--worker", "ops", "--operator", "ops"])
    assert clash.exit_code == 2 and "'ops' as --operator and --worker" in clash.output
    bad = runner.invoke(main, ["nats-config", "--worker", "w.1"])
    assert bad.exit_code == 2
    # said as every other usage error: the option quoted, the value once (it read `Invalid value for --worker:
    # w 1: 'w 1' is not an id`: a user trial), and nothing written
    out = tmp_path / "refused"
    out.mkdir()
    for given, says in ((["--worker", "w 1"], "'--worker': 'w 1' is not an id"),
                        (["--worker", "w-1", "--worker", "w-1"], "'--worker': worker 'w-1' is given twice (also at "
                                                                 "--worker w-1)")):
        refused = runner.invoke(main, ["nats-config", *given, "--secrets", str(out / "s.json"), "--out",
                                       str(out / "auth.conf")], prog_name="warmboot")
        assert refused.exit_code == 2 and refused.stdout == "", refused.output
        assert refused.stderr.startswith("Usage: warmboot nats-config [OPTIONS]\n"), refused.stderr
        assert f"\nerror: Invalid value for {says}" in refused.stderr, refused.stderr
        assert not list(out.iterdir())
    routes = runner.invoke(main, ["nats-config", "--worker", "w-1", "--routes", "http://n1:6222", "--routes-out",
                                  str(out / "routes.conf")])
    assert routes.exit_code == 2 and "Invalid value for '--routes': 'http://n1:6222' is not" in routes.stderr
    assert not list(out.iterdir())
    orphan = runner.invoke(main, ["nats-config", "--auth", "nkey"])
    assert orphan.exit_code == 2 and "--secrets or --seeds-dir" in orphan.output


async def test_the_agent_works_with_worker_credentials(secured, tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    admin = await secured.connect("svc")
    agent = Agent(secured.url("w-3"), "w-3", "node-c", path, prefix=PREFIX, watch_interval_s=0.05, probe=PROBE)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        seq, _ = await wait_event(admin.nc, PREFIX, "w-3", WorkerRegistered)
        path.write_text(agent_config("v2", ("v1",)))
        await wait_event(admin.nc, PREFIX, "w-3", RuntimeChanged, after=seq)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await admin.close()


# --- beyond clear passwords ------------------------------------------------------------------------


def nats_config(tmp_path, *more: str) -> tuple[str, dict[str, str]]:
    conf, secrets = tmp_path / "auth.conf", tmp_path / "secrets.json"
    result = CliRunner().invoke(main, ["nats-config", "--prefix", "hx", "--services-user", "svc", "--worker", "w-1",
                                       "--operator", "ops", "--secrets", str(secrets), "--out", str(conf), *more])
    assert result.exit_code == 0, result.output
    kept = json.loads(secrets.read_text())
    del kept["_roles"]
    return conf.read_text(), kept


def test_a_change_of_auth_gives_every_kept_user_a_new_secret_and_says_so(tmp_path):
    """A secrets file kept from an nkey run, given to a password run: a seed is no password, so every
    user got a new one, every connection signed out at the reload, and nothing said so (a trial of the
    docs; a run without --secrets says it). Said as a rotation is; a password run after another says nothing."""
    _, seeds = nats_config(tmp_path, "--auth", "nkey")
    conf, secrets = tmp_path / "auth.conf", tmp_path / "secrets.json"
    args = ["nats-config", "--prefix", "hx", "--services-user", "svc", "--worker", "w-1", "--operator", "ops",
            "--secrets", str(secrets), "--out", str(conf), "--auth", "password"]
    switched = CliRunner().invoke(main, args)
    assert switched.exit_code == 0, switched.output
    assert ("new secrets for users whose kept secret is not a password (--auth password now): ops, svc, w-1 "
            "(the old ones sign in no more once the server has this configuration)") in switched.stderr
    passwords = {u: p for u, p in json.loads(secrets.read_text()).items() if u != "_roles"}
    assert set(passwords) == set(seeds) and not set(passwords.values()) & set(seeds.values())
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0 and "new secrets" not in again.stderr, again.output
    assert {u: p for u, p in json.loads(secrets.read_text()).items() if u != "_roles"} == passwords  # kept


async def test_bcrypt_keeps_only_hashes_in_the_configuration(tmp_path):
    text, passwords = nats_config(tmp_path, "--auth", "bcrypt")
    assert text.count('password: "$2a$11$') == 3
    assert not [p for p in passwords.values() if p in text]
    server = NatsServer(tmp_path / "nats", extra_config=text).start()
    try:
        url = f"nats://w-1:{passwords['w-1']}@{server.host}:{server.port}"
        async with AsyncExitStack() as stack:
            await start_services(stack, ["registry"], f"nats://svc:{passwords['svc']}@{server.host}:{server.port}",
                                 "hx")
            worker = await nats.connect(url, inbox_prefix="_INBOX.w-1")
            stack.push_async_callback(worker.close)
            reply = await worker.request(service_subject("hx", "registry", "register", "w-1"),
                                         json.dumps(registration("w-1")).encode(), timeout=10)
            assert json.loads(reply.data)["outcome"] == "REGISTERED"
        with pytest.raises(Exception):
            await nats.connect(url.replace(passwords["w-1"], "wrong"), max_reconnect_attempts=0,
                               allow_reconnect=False, connect_timeout=2)
    finally:
        server.stop()


async def test_nkeys_one_pair_per_user_seeds_private_and_only_public_keys_configured(tmp_path, monkeypatch):
    seeds = tmp_path / "seeds"
    text, kept = nats_config(tmp_path, "--auth", "nkey", "--seeds-dir", str(seeds))
    assert set(kept) == {"svc", "ops", "w-1"}
    for user, seed in kept.items():
        path = seeds / f"{user}.nk"
        assert path.read_text().strip() == seed and seed.startswith("SU")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert seed not in text
    assert text.count('nkey: "U') == 3 and "password" not in text
    again, kept_again = nats_config(tmp_path, "--auth", "nkey", "--seeds-dir", str(seeds))
    assert kept_again == kept and again == text  # a second run rotates nothing

    server = NatsServer(tmp_path / "nats", extra_config=text).start()
    serve = Serve("registry", "--nats", server.url, "--nkey-seed", str(seeds / "svc.nk"), "--prefix", "hx",
                  env={NKEY_SEED_ENV: ""})
    try:
        await asyncio.to_thread(serve.start)
        path = tmp_path / "agent.toml"
        path.write_text(agent_config("v1"))
        agent = Agent(server.url, "w-1", "node-a", path, prefix="hx", probe=PROBE, nkey_seed=str(seeds / "w-1.nk"))
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        svc = await nats.connect(server.url, nkeys_seed=str(seeds / "svc.nk"), inbox_prefix="_INBOX._hx")
        ops = await nats.connect(server.url, nkeys_seed=str(seeds / "ops.nk"), inbox_prefix="_INBOX.ops")
        try:
            seq, _ = await wait_event(svc, "hx", "w-1", WorkerRegistered)
            # the operator's key reads it (by direct gets, from its own account)
            read = [(s, decode_event(data)) async for s, _, _, data in log_messages(ops, "hx", stop=seq)]
            assert isinstance(read[-1][1], WorkerRegistered) and read[-1][0] == seq
            # and so does the CLI with the operator's seed: an nkey user's URL names no user, so
            # its inbox prefix is given
            shown = await asyncio.to_thread(
                CliRunner().invoke, main, ["workers", "--nats", server.url, "--prefix", "hx", "-o", "json"],
                env={NKEY_SEED_ENV: str(seeds / "ops.nk"), INBOX_PREFIX_ENV: "_INBOX.ops"})
            assert shown.exit_code == 0, shown.output
            assert [row["worker_id"] for row in json.loads(shown.stdout)] == ["w-1"]
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
            await ops.close()
            await svc.close()
    finally:
        await asyncio.to_thread(serve.stop)
        server.stop()
    assert not [seed for seed in kept.values() if seed in serve.output]


async def test_an_operator_hears_only_its_own_replies_and_the_cli_connects_with_its_inbox(tmp_path):
    """Operators share their account: each hears only under its own `_INBOX.<name>.`, so none
    can learn the subjects another's answers go to (and aim its own requests' answers there:
    a reply subject is not checked against the sender's rights). The CLI takes the prefix
    from the user its URL names."""
    server = Secured(tmp_path / "nats", "opx", workers=("w-1",), operators=("alice", "bob")).start()
    try:
        async with AsyncExitStack() as stack:
            await start_services(stack, ["registry"], server.url("svc"), "opx")
            worker = await server.connect("w-1")
            alice = await server.connect("alice")
            bob = await server.connect("bob")
            stack.push_async_callback(worker.close)
            stack.push_async_callback(alice.close)
            stack.push_async_callback(bob.close)
            await worker.nc.request(service_subject("opx", "registry", "register", "w-1"),
                                    json.dumps(registration("w-1")).encode(), timeout=10)
            for subject in ("_INBOX.>", "_INBOX.bob.>", "_INBOX.*.*"):
                await alice.nc.subscribe(subject)
                await alice.violation(subject)
            info = await bob.nc.request(f"$JS.API.STREAM.INFO.{stream_name('opx')}", b"", timeout=10)
            assert info.subject.startswith("_INBOX.bob.") and json.loads(info.data)["state"]["messages"] >= 1

            shown = await asyncio.to_thread(CliRunner().invoke, main,
                                            ["workers", "--nats", server.url("alice"), "--prefix", "opx", "-o", "json"],
                                            env={INBOX_PREFIX_ENV: ""})
            assert shown.exit_code == 0, shown.output
            assert [row["worker_id"] for row in json.loads(shown.stdout)] == ["w-1"]
    finally:
        server.stop()


async def test_the_services_sign_in_with_the_credentials_their_event_store_reads_from_the_environment(
        tmp_path, monkeypatch):
    """`NATS_USER`/`NATS_PASSWORD` (as `NATS_TOKEN` and `NATS_CREDS`: docs/security.md) sign in the
    services' own connection too, not only their event store's: the URL names no user. It read
    none of them, and `warmboot serve` waited for ever, refused (an audit of the docs)."""
    server = Secured(tmp_path / "nats", "envc", workers=("w-1",)).start()
    monkeypatch.setenv("NATS_USER", "svc")
    monkeypatch.setenv("NATS_PASSWORD", server.secrets["svc"])
    try:
        async with AsyncExitStack() as stack:
            await asyncio.wait_for(start_services(stack, ["registry"], server.url(), "envc"), 30)
            worker = await server.connect("w-1")
            stack.push_async_callback(worker.close)
            reply = await worker.nc.request(service_subject("envc", "registry", "register", "w-1"),
                                            json.dumps(registration("w-1")).encode(), timeout=10)
            assert json.loads(reply.data)["outcome"] == "REGISTERED"
    finally:
        server.stop()


async def test_a_token_in_the_environment_signs_in_the_services_the_agent_and_the_commands(tmp_path, monkeypatch):
    """A server that takes a token (`authorization { token: ... }`): $NATS_TOKEN alone signs in
    `serve`'s services, the agent and a command, none of whose URLs carries it. Only the services
    read it; the agent retried for ever and a command was refused the sign-in."""
    token = "tok-" + "x" * 20
    server = NatsServer(tmp_path / "nats", extra_config=f'authorization {{ token: "{token}" }}').start()
    monkeypatch.setenv("NATS_TOKEN", token)
    monkeypatch.delenv(INBOX_PREFIX_ENV, raising=False)
    try:
        async with AsyncExitStack() as stack:
            await asyncio.wait_for(start_services(stack, ["registry"], server.url, "tokn"), 30)
            path = tmp_path / "agent.toml"
            path.write_text(agent_config("v1"))
            stop = asyncio.Event()
            running = asyncio.create_task(Agent(server.url, "w-1", "node-a", path, prefix="tokn", probe=PROBE).run(stop))
            try:
                bare = await nats.connect(server.url, token=token)
                stack.push_async_callback(bare.close)
                await wait_event(bare, "tokn", "w-1", WorkerRegistered)
            finally:
                stop.set()
                await asyncio.wait_for(running, 30)
            shown = await asyncio.to_thread(CliRunner().invoke, main,
                                            ["workers", "--nats", server.url, "--prefix", "tokn", "-o", "json"])
            assert shown.exit_code == 0, shown.output
            assert [row["worker_id"] for row in json.loads(shown.stdout)] == ["w-1"]
            refused = await asyncio.to_thread(CliRunner().invoke, main, ["workers", "--nats", server.url, "--prefix",
                                                                         "tokn"], env={"NATS_TOKEN": "not-it"})
            assert refused.exit_code == 1 and "refuses the sign-in" in refused.stderr, refused.output
            assert "not-it" not in refused.output
    finally:
        server.stop()


@pytest.mark.parametrize("url, env, options", [
    ("nats://h:4222", {"NATS_USER": "alice", "NATS_PASSWORD": "pw"}, {"user": "alice", "password": "pw"}),
    ("nats://h:4222", {"NATS_USER": "alice"}, {"user": "alice", "password": ""}),
    ("nats://h:4222", {"NATS_TOKEN": "t"}, {"token": "t"}),
    ("nats://h:4222", {"NATS_CREDS": "/c.creds"}, {"user_credentials": "/c.creds"}),
    # a URL that carries a secret is what a command line says: the environment's user or token do not
    # override it (nats-py would let them); a credentials file still signs, as nats-py sends both
    ("nats://bob:pw@h:4222", {"NATS_USER": "alice", "NATS_PASSWORD": "x", "NATS_TOKEN": "t"}, {}),
    ("nats://h1:4222,nats://tok@h2:4222", {"NATS_TOKEN": "t"}, {}),
    ("nats://bob:pw@h:4222", {"NATS_CREDS": "/c.creds"}, {"user_credentials": "/c.creds"}),
    ("nats://h:4222", {"NATS_USER": "", "NATS_TOKEN": ""}, {}),  # set but empty: not given
])
def test_what_the_environment_signs_in_with(url, env, options):
    assert env_sign_in(url, env) == options


def test_the_environments_user_gives_the_inbox_prefix_when_the_url_names_none(monkeypatch):
    monkeypatch.delenv(INBOX_PREFIX_ENV, raising=False)
    monkeypatch.setenv("NATS_USER", "alice")
    assert inbox_prefix("nats://h:4222") == "_INBOX.alice"
    assert inbox_prefix("nats://bob:pw@h:4222") == "_INBOX.bob"  # the URL's user is the one signed in
    # still when that user is not one subject token: alice is not signed in, her inbox is not this one's
    assert inbox_prefix("nats://a.b:pw@h:4222") is None
    assert inbox_prefix("nats://w%2D1:pw@h:4222") is None
    monkeypatch.setenv(INBOX_PREFIX_ENV, "_INBOX.mine")
    assert inbox_prefix("nats://h:4222") == "_INBOX.mine"
    monkeypatch.delenv(INBOX_PREFIX_ENV)
    monkeypatch.setenv("NATS_USER", "a.b")  # not one subject token: nats-py's own inbox
    assert inbox_prefix("nats://h:4222") is None
    # signed in with an nkey seed file alone: the user its name gives, as `nats-config --seeds-dir` names them
    monkeypatch.delenv("NATS_USER")
    assert inbox_prefix("nats://h:4222", seed="/etc/warmboot/seeds/w-1.nk") == "_INBOX.w-1"
    assert inbox_prefix("nats://h:4222", seed="w-1.nk") == "_INBOX.w-1"
    assert inbox_prefix("nats://bob:pw@h:4222", seed="w-1.nk") == "_INBOX.bob"  # a user named first wins
    monkeypatch.setenv("NATS_USER", "alice")
    assert inbox_prefix("nats://h:4222", seed="w-1.nk") == "_INBOX.alice"
    monkeypatch.delenv("NATS_USER")
    for named_otherwise in ("/s/seed", "/s/a.b.nk", "/s/.nk", "/s/w-1.seed"):  # no user said: nats-py's own
        assert inbox_prefix("nats://h:4222", seed=named_otherwise) is None, named_otherwise


@pytest.mark.parametrize("url, env, prefix", [
    ("nats://alice:s3cret@h:4222", None, "_INBOX.alice"),
    ("nats://h1:4222,nats://orch:pw@h2:4222", None, "_INBOX.orch"),  # the first member that names a user
    ("alice:s3cret@h:4222", None, "_INBOX.alice"),
    ("nats://w%2D1:pw@h:4222", None, None),  # nats-py sends the user as written, not %-decoded
    ("nats://h:4222", None, None),  # no user: nats-py's own random inbox
    ("nats://a.b:pw@h:4222", None, None),  # not one subject token: no prefix made of it
    ("nats://alice:s3cret@h:4222", "_INBOX.mine", "_INBOX.mine"),  # $NATS_INBOX_PREFIX says
])
def test_the_inbox_prefix_a_command_connects_with(url, env, prefix, monkeypatch):
    monkeypatch.delenv("NATS_USER", raising=False)
    if env is None:
        monkeypatch.delenv(INBOX_PREFIX_ENV, raising=False)
    else:
        monkeypatch.setenv(INBOX_PREFIX_ENV, env)
    assert inbox_prefix(url) == prefix
    assert inbox_prefix(url, "_INBOX.given") == "_INBOX.given"


@pytest.mark.parametrize("url, shown", [
    ("nats://svc:s3cret@h:4222", "nats://h:4222"),
    ("nats://svc:s3cret@h1:4222,nats://svc:s3cret@h2:4222", "nats://h1:4222,nats://h2:4222"),
    ("nats://svc:p@ss@h:4222", "nats://h:4222"),  # an unencoded '@' in the password
    ("nats://svc:p/ss@h:4222", "nats://h:4222"),  # an unencoded '/' (check_url refuses it, naming it redacted)
    ("nats://svc:p#s?s@h:4222,svc:x/y@h2:1", "nats://h:4222,h2:1"),
    ("svc:s3cret@h:4222", "h:4222"),
    ("tls://token@h:4222", "tls://h:4222"),
    ("nats://h:4222", "nats://h:4222"),
])
def test_urls_are_shown_without_credentials(url, shown):
    assert redact_url(url) == shown


def test_no_repr_holds_a_password():
    from events.jetstream import ConnectOptions
    from warmboot.runner import Running

    options = ConnectOptions.from_env({"NATS_URL": "nats://svc:s3cret@h:4222", "NATS_PASSWORD": "other-secret"})
    running = Running("nats://svc:s3cret@h:4222", "wb", ["registry"], None)
    for text in (repr(options), options.where, repr(running), running.where):
        assert "s3cret" not in text and "other-secret" not in text


def test_no_deployment_account_is_another_deployments_operators_account():
    """`x`'s operators' account and `x-operators`' (or `x_operators`') deployment account had one
    name; merged into one `accounts` block, as docs/security.md says to host two deployments, the
    operators of `x` sat in the account holding the other deployment's JetStream."""
    from warmboot.nats_config import account_names

    prefixes = ["x", "x-operators", "x_operators", "operators", "x-operators-operators", "team-a"]
    deployments = {account_names(p)[0] for p in prefixes} - {account_names("team_a")[0]}
    operators = {account_names(p)[1] for p in prefixes}
    assert not deployments & operators
    assert len(operators) == len({p.replace("-", "_") for p in prefixes})


async def test_two_deployments_merged_into_one_accounts_block_each_keep_their_users(tmp_path):
    """The blocks of `x` and `x-operators`, merged by hand into one `accounts` block, as
    docs/security.md says: the server takes it, and every user of both signs in to its own
    account (before, `x`'s operator was refused: the second entry of one name replaced the first)."""
    from warmboot.nats_config import identities, nats_auth_config

    secrets_ = {"svc": "s1", "alice": "p1", "w-1": "p2", "svc2": "s3", "bob": "p3", "w-2": "p4"}
    ids = identities("password", secrets_)
    blocks = [nats_auth_config("x", "svc", ["w-1"], ["alice"], ids=ids),
              nats_auth_config("x-operators", "svc2", ["w-2"], ["bob"], ids=ids)]

    def entries(block: str) -> str:  # what is inside `accounts { ... }`
        inside = block[block.index("accounts {") + len("accounts {"):]
        return inside[:inside.rindex("}")]

    server = NatsServer(tmp_path / "nats", extra_config="accounts {" + "".join(map(entries, blocks)) + "}\n")
    server.start()
    try:
        for user, secret in secrets_.items():
            nc = await nats.connect(f"nats://{user}:{secret}@{server.host}:{server.port}", inbox_prefix=f"_INBOX.{user}",
                                    allow_reconnect=False, max_reconnect_attempts=0)
            await nc.close()
    finally:
        server.stop()


def test_a_user_left_out_loses_its_seed_and_rotate_gives_a_new_one(tmp_path):
    """A worker dropped from a run lost its user but kept its seed file, and got the same key back
    when listed again: a retired (or leaked) key came back to life (found by a review). Its seed is
    removed now, and `--rotate USER` gives a listed user a new secret, keeping everyone else's; a
    user to rotate that the run does not list is refused, nothing written."""
    seeds, conf, secrets = tmp_path / "seeds", tmp_path / "auth.conf", tmp_path / "secrets.json"

    def run(*args: str):
        return CliRunner().invoke(main, ["nats-config", "--prefix", "hx", "--services-user", "svc", "--auth", "nkey",
                                         "--seeds-dir", str(seeds), "--secrets", str(secrets), "--out", str(conf),
                                         *args])

    assert run("--worker", "w-1", "--worker", "w-2").exit_code == 0
    first = {p.stem: p.read_text() for p in seeds.glob("*.nk")}
    (seeds / "notes.txt").write_text("kept")  # not a seed
    left_out = run("--worker", "w-1")
    assert left_out.exit_code == 0 and "removed the seeds of users no longer listed: w-2" in left_out.output
    assert sorted(p.name for p in seeds.iterdir()) == ["_roles.json", "notes.txt", "svc.nk", "w-1.nk"]
    assert run("--worker", "w-1", "--worker", "w-2").exit_code == 0
    assert (seeds / "w-2.nk").read_text() != first["w-2"]
    assert (seeds / "w-1.nk").read_text() == first["w-1"]

    before = {p.name: p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    refused = run("--worker", "w-1", "--worker", "w-2", "--rotate", "w-9")
    assert refused.exit_code == 2 and "--rotate" in refused.output and "w-9: not a user of this run" in refused.output
    assert {p.name: p.read_text() for p in tmp_path.rglob("*") if p.is_file()} == before
    w2 = (seeds / "w-2.nk").read_text()
    rotated = run("--worker", "w-1", "--worker", "w-2", "--rotate", "w-1")
    assert rotated.exit_code == 0 and "rotated: w-1 (the old secrets sign in no more" in rotated.stderr, rotated.output
    assert (seeds / "w-1.nk").read_text() != first["w-1"] and (seeds / "w-2.nk").read_text() == w2
    assert json.loads(secrets.read_text())["w-1"] == (seeds / "w-1.nk").read_text().strip()


def test_seeds_removed_are_only_files_this_command_made_and_a_bad_seeds_dir_writes_nothing(tmp_path):
    """Only the seed files of users the secrets file listed are removed, once everything else is
    written: another deployment's seed in the directory, and a directory named like a seed, stay
    (a directory there ended a run half-way with a traceback; found by a review). A --seeds-dir that
    is a file is refused before anything is written."""
    seeds, conf, secrets = tmp_path / "seeds", tmp_path / "auth.conf", tmp_path / "secrets.json"

    def run(*args: str):
        return CliRunner().invoke(main, ["nats-config", "--auth", "nkey", "--seeds-dir", str(seeds),
                                         "--secrets", str(secrets), "--out", str(conf), *args])

    (seeds / "backup.nk").mkdir(parents=True)
    (seeds / "other-deployment.nk").write_text("SU...")
    assert run("--worker", "w-1", "--worker", "w-2").exit_code == 0
    left_out = run("--worker", "w-1")
    assert left_out.exit_code == 0, left_out.output
    assert sorted(p.name for p in seeds.iterdir()) == ["_roles.json", "backup.nk", "other-deployment.nk", "w-1.nk",
                                                      "warmboot-services.nk"]
    assert "removed the seeds of users no longer listed: w-2" in left_out.output

    file = tmp_path / "not-a-dir"
    file.write_text("x")
    before = sorted(p.name for p in tmp_path.iterdir())
    refused = CliRunner().invoke(main, ["nats-config", "--auth", "nkey", "--worker", "w-1", "--seeds-dir", str(file),
                                        "--secrets", str(tmp_path / "s2.json"), "--out", str(tmp_path / "c2.conf")])
    assert refused.exit_code == 2 and "--seeds-dir" in refused.output and "is a file" in refused.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_routes_are_written_signed_in_and_their_password_kept(tmp_path):
    """`--routes` writes, to `--routes-out` (mode 0600), the credential a route must sign in with and
    the members' routes signed in with it; a second run keeps the password (every member reloads the
    same file). Bad routes are refused naming the option, and nothing is written."""
    out, routes_out = tmp_path / "auth.conf", tmp_path / "routes.conf"

    def run(*args: str):
        return CliRunner().invoke(main, ["nats-config", "--worker", "w-1", "--out", str(out), *args])

    first = run("--routes", "nats://n1:6222, nats://n2:6222", "--routes-out", str(routes_out))
    assert first.exit_code == 0, first.output
    text = routes_out.read_text()
    password = re.search(r'password: "([^"]+)"', text).group(1)
    assert len(password) >= 32
    assert f'"nats://warmboot-routes:{password}@n1:6222"' in text
    assert f'"nats://warmboot-routes:{password}@n2:6222"' in text
    assert stat.S_IMODE(routes_out.stat().st_mode) == 0o600
    assert password not in out.read_text()  # the accounts block holds no route credential
    again = run("--routes", "nats://n1:6222,nats://n2:6222,nats://n3:6222", "--routes-out", str(routes_out))
    assert again.exit_code == 0, again.output
    assert routes_out.read_text().count(f"warmboot-routes:{password}@") == 3

    out.unlink()
    fresh = tmp_path / "fresh.conf"
    for args, error in [
        (("--routes", "nats://n1:6222"), "--routes and --routes-out go together"),
        (("--routes-out", str(fresh)), "--routes and --routes-out go together"),
        (("--routes", "nats://u:p@n1:6222", "--routes-out", str(fresh)), "carries credentials"),
        (("--routes", "http://n1:6222", "--routes-out", str(fresh)), "is not nats://HOST:PORT"),
        (("--routes", "nats://n1", "--routes-out", str(fresh)), "is not nats://HOST:PORT"),
        (("--routes", "nats://n1:99999", "--routes-out", str(fresh)), "--routes"),
        (("--routes", "nats://n1:6222/x", "--routes-out", str(fresh)), "nothing after them"),
        (("--routes", "nats://n1:0", "--routes-out", str(fresh)), "is not nats://HOST:PORT"),
        (("--routes", 'nats://n"1:6222', "--routes-out", str(fresh)), "is not nats://HOST:PORT"),
        (("--routes", "nats://n1:6222,nats://n1:6222", "--routes-out", str(fresh)), "given twice"),
        (("--routes", " , ", "--routes-out", str(fresh)), "no route given"),
        (("--routes", "nats://n1:6222", "--routes-out", str(tmp_path / "none" / "r.conf")), "is not a directory"),
        (("--routes", "nats://n1:6222", "--routes-out", str(out)), "name the same file"),
    ]:
        refused = run(*args)
        assert refused.exit_code != 0 and error in refused.output, (args, refused.output)
        assert not fresh.exists() and not out.exists(), args


def test_a_file_written_again_is_never_left_half_written(tmp_path, monkeypatch):
    """nats-auth run again (compose: every `up`) writes the files the members include once more; should
    a write fail half-way (a full disk here), each file is as it was, and the command says which: an
    empty routes file is a `cluster` block with no authorization, which nats-server 2.15.1 takes on a
    reload or a restart (any process that reaches a cluster port then joins), an empty accounts block
    lets anyone in, and the next run, finding no password to keep, would make a new one the members
    do not have (found by a review)."""
    import errno
    import os

    out, routes_out = tmp_path / "auth.conf", tmp_path / "routes.conf"
    args = ["nats-config", "--worker", "w-1", "--out", str(out), "--routes", "nats://n1:6222,nats://n2:6222",
            "--routes-out", str(routes_out)]
    assert CliRunner().invoke(main, args).exit_code == 0
    before = {path: path.read_text() for path in (out, routes_out)}
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: Full(real_fdopen(fd, *a, **k)))
    refused = CliRunner().invoke(main, [*args, "--worker", "w-2"])
    monkeypatch.undo()
    assert refused.exit_code != 0 and "No space left on device" in refused.output, refused.output
    assert "as it was" in refused.output
    assert {path: path.read_text() for path in (out, routes_out)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["auth.conf", "routes.conf"]  # no leftover



def test_the_services_seed_is_written_alone_for_the_services(tmp_path):
    """`--services-seed FILE` writes the services user's seed, and only it, so that the services need
    not mount every user's seed (`--seeds-dir`): it is the seed the accounts block knows the services
    by, kept across runs, and refused without nkeys."""
    seeds, alone, out = tmp_path / "seeds", tmp_path / "services.nk", tmp_path / "auth.conf"
    args = ["nats-config", "--auth", "nkey", "--services-user", "svc", "--worker", "w-1", "--seeds-dir", str(seeds),
            "--services-seed", str(alone), "--out", str(out)]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert alone.read_text() == (seeds / "svc.nk").read_text() != (seeds / "w-1.nk").read_text()
    assert stat.S_IMODE(alone.stat().st_mode) == 0o600
    assert nkey_public(alone.read_text().strip()) in out.read_text()
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0 and alone.read_text() == (seeds / "svc.nk").read_text(), again.output
    refused = CliRunner().invoke(main, ["nats-config", "--worker", "w-1", "--services-seed", str(tmp_path / "x.nk")])
    assert refused.exit_code != 0 and "--services-seed goes with --auth nkey" in refused.output
    assert not (tmp_path / "x.nk").exists()


@pytest.mark.parametrize("first_with_secrets", [True, False])
def test_a_dropped_worker_s_seed_is_not_handed_to_a_client_of_its_name_though_the_secrets_file_is_new(
        tmp_path, first_with_secrets):
    """A red-team review: bob a worker (its seed on bob's machine); the next run, with a secrets file
    made anew (moved, lost; or --secrets given for the first time), drops bob: its seed file was kept
    (only the users of the secrets file counted as made by this command) and its role forgotten; a
    third run listing bob as a client took the worker's seed up, and the worker's machine signed in
    with a client's rights. Now the directory's roles count too: the seed goes with the worker."""
    seeds = tmp_path / "seeds"

    def run(*args: str):
        result = CliRunner().invoke(main, ["nats-config", "--prefix", "wb", "--auth", "nkey", "--seeds-dir",
                                           str(seeds), "--operator", "alice", "--worker", "carol",
                                           "--out", str(tmp_path / "auth.conf"), *args])
        assert result.exit_code == 0, result.output
        return result

    run("--worker", "bob", *(["--secrets", str(tmp_path / "s1.json")] if first_with_secrets else []))
    on_bobs_machine = (seeds / "bob.nk").read_text()
    dropped = run("--secrets", str(tmp_path / "s2.json"))
    assert "removed the seeds of users no longer listed: bob" in dropped.output
    assert not (seeds / "bob.nk").exists()
    run("--client", "bob", "--secrets", str(tmp_path / "s2.json"))
    assert (seeds / "bob.nk").read_text() != on_bobs_machine
    public = nkey_public(on_bobs_machine.strip())
    assert public not in (tmp_path / "auth.conf").read_text()  # the worker's machine signs in as nobody


def test_a_seed_file_with_no_role_recorded_is_taken_up_only_from_a_directory_that_records_none(tmp_path):
    """A seed in the directory for which the roles it records say nothing (left by an earlier version,
    or put there) is nobody's this command knows of: the user gets a new one. A directory from before
    roles were recorded (no _roles.json) keeps its seeds, as it did."""
    seeds = tmp_path / "seeds"
    base = ["nats-config", "--auth", "nkey", "--seeds-dir", str(seeds), "--out", str(tmp_path / "auth.conf")]
    assert CliRunner().invoke(main, [*base, "--worker", "w-1"]).exit_code == 0
    stray = new_nkey_seed()
    (seeds / "c-1.nk").write_text(stray + "\n")
    assert CliRunner().invoke(main, [*base, "--worker", "w-1", "--client", "c-1"]).exit_code == 0
    assert (seeds / "c-1.nk").read_text().strip() != stray

    legacy = tmp_path / "legacy"
    legacy.mkdir(mode=0o700)
    kept = new_nkey_seed()
    (legacy / "w-1.nk").write_text(kept + "\n")
    made = CliRunner().invoke(main, ["nats-config", "--auth", "nkey", "--seeds-dir", str(legacy), "--worker", "w-1"])
    assert made.exit_code == 0 and (legacy / "w-1.nk").read_text().strip() == kept
    assert nkey_public(kept) in made.stdout


@pytest.mark.parametrize("option, name, says", [
    ("--services-seed", "w-1.nk", "a seed file"),
    ("--out", "w-1.nk", "a seed file"),
    ("--secrets", "ops.nk", "a seed file"),
    ("--out", "w-old.nk", "a seed file"),  # a user this run leaves out: written, then removed as its seed
    ("--out", "_roles.json", "the roles"),
])
def test_an_output_naming_a_file_of_the_seeds_dir_is_refused_and_nothing_written(tmp_path, option, name, says):
    """`--services-seed seeds/w-1.nk --seeds-dir seeds` was taken: w-1's seed file then held the
    services' seed, and whoever was handed it had their rights (a red-team review)."""
    seeds = tmp_path / "seeds"
    seeds.mkdir(mode=0o700)
    args = ["nats-config", "--auth", "nkey", "--worker", "w-1", "--operator", "ops", "--seeds-dir", str(seeds),
            option, str(seeds / name)]
    if option != "--out":
        args += ["--out", str(tmp_path / "auth.conf")]
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code == 2, refused.output
    assert f"error: {option} names {seeds / name}, a file of --seeds-dir ({says})" in refused.output
    assert not any(tmp_path.rglob("*.*"))  # nothing written
    # the services' own seed file in the directory is the same seed: named, it is written once
    same = CliRunner().invoke(main, ["nats-config", "--auth", "nkey", "--worker", "w-1", "--seeds-dir", str(seeds),
                                     "--services-seed", str(seeds / "warmboot-services.nk"),
                                     "--out", str(tmp_path / "auth.conf")])
    assert same.exit_code == 0, same.output


@pytest.mark.parametrize("args, says", [
    (["--operator", "ops", "--client", "ops"], "'ops' as --operator and --client"),
    (["--operator", "ops", "--operator", "ops"], "'ops' as --operator and --operator"),
    (["--services-user", "w-1", "--worker", "w-1", "--client", "c", "--operator", "c"],
     "'c' as --operator and --client; 'w-1' as --services-user and --worker"),
])
def test_a_user_given_twice_is_refused_naming_the_options_and_nothing_written(tmp_path, args, says):
    """A user named by two options (or one twice) was refused as "user names must be unique across roles:
    ops", naming no option, also when both were --operator (a walkthrough): each is said with the options
    that give it, before anything is written."""
    refused = CliRunner().invoke(main, ["nats-config", *args, "--out", str(tmp_path / "auth.conf")])
    assert refused.exit_code == 2, refused.output
    assert refused.output.endswith(f"error: a user has one role, and is given once: {says}\n"), refused.output
    assert not any(tmp_path.rglob("*"))


def test_users_whose_names_differ_only_in_case_are_refused_with_a_seeds_dir_and_nothing_written(tmp_path):
    """Each user's seed is the file USER.nk: on a filesystem that ignores case (macOS's, Windows'), worker
    `orch` and client `Orch` would be one file, holding the seed written last, so that the client's holder
    signed in as the worker (a security review). Refused, naming both, before anything is written; without
    --seeds-dir (no files of users) the names stay distinct NATS users."""
    seeds = tmp_path / "seeds"
    refused = CliRunner().invoke(main, ["nats-config", "--auth", "nkey", "--worker", "orch", "--client", "Orch",
                                        "--seeds-dir", str(seeds), "--out", str(tmp_path / "auth.conf")])
    assert refused.exit_code == 2, refused.output
    assert "user names must differ in more than case with --seeds-dir: Orch, orch" in refused.output
    assert not any(tmp_path.rglob("*"))  # nothing written, not even the directory
    kept = CliRunner().invoke(main, ["nats-config", "--auth", "nkey", "--worker", "orch", "--client", "Orch",
                                     "--secrets", str(tmp_path / "s.json"), "--out", str(tmp_path / "auth.conf")])
    assert kept.exit_code == 0, kept.output


def test_a_seed_kept_in_a_seeds_dir_is_not_handed_to_another_role(tmp_path):
    """Without --secrets, the seeds directory keeps the roles: a worker's seed file is not taken up
    as a client's when the next run lists the name as a client."""
    seeds = tmp_path / "seeds"
    base = ["nats-config", "--auth", "nkey", "--seeds-dir", str(seeds), "--operator", "ops"]
    first = CliRunner().invoke(main, [*base, "--worker", "w-5"])
    assert first.exit_code == 0, first.output
    worker_seed, ops_seed = (seeds / "w-5.nk").read_text(), (seeds / "ops.nk").read_text()
    second = CliRunner().invoke(main, [*base, "--client", "w-5"])
    assert second.exit_code == 0, second.output
    assert (seeds / "w-5.nk").read_text() != worker_seed and (seeds / "ops.nk").read_text() == ops_seed
    assert json.loads((seeds / "_roles.json").read_text())["w-5"] == "client"
    assert stat.S_IMODE((seeds / "_roles.json").stat().st_mode) == 0o600


def test_a_worker_of_the_workers_file_given_as_another_user_is_named_with_its_line(tmp_path):
    """A clash of a worker given in --workers-file was said `as --operator and --worker`, naming an option
    the user never gave: it names the file's line."""
    workers = tmp_path / "workers.txt"
    workers.write_text("# workers\nw-1\nops\n")
    refused = CliRunner().invoke(main, ["nats-config", "--operator", "ops", "--workers-file", str(workers),
                                        "--out", str(tmp_path / "auth.conf")])
    assert refused.exit_code == 2, refused.output
    assert refused.output.endswith(f"error: a user has one role, and is given once: 'ops' as --operator and "
                                   f"--workers-file {workers}:3\n"), refused.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["workers.txt"]  # nothing written
