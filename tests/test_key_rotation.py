"""A key rotated under running processes (docs/operations.md): a server's user given a new nkey and
the server reloaded, the new seed then put in the file the process signs in with. The process's
connections come back by themselves, signed with the new seed under its own public key; until the
file holds the new seed they stay refused. nats-py read the public key once, at the first connect,
and signed the reconnects with the new seed under the old key: refused until a restart."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack, asynccontextmanager

from events.natspy.connections import ErrorsOnce
from events.schema import HeartbeatReply, RegisterReply, SeqReply
from events.subjects import service_subject
from services.endpoints import call
from tests.factories import until
from tests.registry_helpers import PROBE, agent_config, registration
from tests.secured_helpers import Secured, _seed
from warmboot.connection import connect
from warmboot.runner import start_services

PREFIX = "kr"


@asynccontextmanager
async def nkey_registry(tmp_path, monkeypatch):
    """A server that signs users in by nkey (the services' user, and worker w-1) running a registry
    (TTL 60 s) signed in with its seed file: (the server, the services' seed file, w-1's seed file)."""
    secured = Secured(tmp_path / "store", PREFIX, workers=("w-1",), auth="nkey").start()
    services_seed, worker_seed = tmp_path / "svc.nk", tmp_path / "w-1.nk"
    services_seed.write_text(secured.secrets["svc"])
    worker_seed.write_text(secured.secrets["w-1"])
    monkeypatch.setenv("NATS_NKEY_SEED", str(services_seed))  # the services' connection and their event store's
    try:
        async with AsyncExitStack() as stack:
            await start_services(stack, ["registry"], secured.url(), PREFIX, options={"registry": {"ttl_s": 60}})
            yield secured, services_seed, worker_seed
    finally:
        secured.stop()


class Heard(ErrorsOnce):
    """The connection's errors, as the CLI's are kept; `heard` is set once one says `words`."""

    def __init__(self, words: str) -> None:
        super().__init__(None)
        self.words = words
        self.heard = asyncio.Event()

    async def report(self, error: Exception) -> None:
        if self.words in str(error):
            self.heard.set()
        await super().report(error)


async def answered(request, within: float = 30.0):
    """`request()`'s answer once its connections are back (each attempt fails fast while they are not)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await request()
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)  # a back-off between attempts while the connections come back


async def test_running_services_and_a_worker_follow_a_rotation_of_their_keys_without_a_restart(tmp_path, monkeypatch):
    """The services' key and a worker's rotated at once: the worker's connection is refused, then
    reads its file half written (that attempt fails, the next reads it again), then signs in; the
    registry answers its heartbeat and writes its drain (the registry's two connections came back)."""
    async with nkey_registry(tmp_path, monkeypatch) as (secured, services_seed, worker_seed), \
            AsyncExitStack() as stack:
        refusals = Heard("holds no nkey seed")
        worker = await connect(secured.url(), "w-1", nkey_seed=str(worker_seed), inbox_prefix="_INBOX.w-1",
                               errors=refusals, reconnect_time_wait=0.1)
        stack.push_async_callback(worker.close)

        def ask(verb: str, body, reply_type, timeout: float = 5.0):
            return call(worker, service_subject(PREFIX, "registry", verb, "w-1"), body, reply_type, timeout)

        assert (await ask("register", registration("w-1"), RegisterReply)).seq > 0

        await secured.reload(rotate=("svc", "w-1"))
        refused = await asyncio.wait_for(refusals.refused(), 20)  # the old seed is refused from the reload on
        assert "authorization" in str(refused).lower()
        services_seed.write_text(secured.secrets["svc"])  # each machine gets its new seed
        worker_seed.write_text(secured.secrets["w-1"][:20])  # the worker's half written, as a reconnect reads it
        await asyncio.wait_for(refusals.heard.wait(), 20)  # that attempt failed, not its reconnecting
        worker_seed.write_text(secured.secrets["w-1"])

        assert (await answered(lambda: ask("heartbeat", {}, HeartbeatReply, 2.0))).ttl_s == 60
        # a write through the registry's event store: its own connection came back too
        drained = await answered(lambda: ask("drain", {"reason": "rotated"}, SeqReply, 2.0))
        assert drained.seq > 0 and not drained.unchanged


async def test_a_running_agent_signs_in_again_with_its_new_seed_without_a_restart(tmp_path, monkeypatch):
    """`warmboot agent`'s own connection (made as every process's is: `connecting`) follows its seed
    file: refused from the reload on, beating again at once when the file holds the new seed."""
    from warmboot.agent import Agent

    config = tmp_path / "agent.toml"
    config.write_text(agent_config("v1"))
    async with nkey_registry(tmp_path, monkeypatch) as (secured, _, worker_seed):
        agent = Agent(secured.url(), "w-1", "node-a", config, prefix=PREFIX, probe=PROBE,
                      nkey_seed=str(worker_seed))
        stop = asyncio.Event()
        running = asyncio.create_task(agent.run(stop))
        try:
            await until(lambda: agent.beat_at is not None)  # registered, and beating
            await secured.reload(rotate=("w-1",))
            await asyncio.wait_for(agent._errors.refused(), 20)  # its old seed is refused from the reload on
            worker_seed.write_text(secured.secrets["w-1"])
            rotated = time.monotonic()
            await until(lambda: agent.beat_at > rotated)  # a beat the registry stored, sent since
            assert agent.registered is not None and not running.done()
        finally:
            stop.set()
            await asyncio.wait_for(running, 15)


async def test_a_process_started_while_its_file_holds_the_revoked_seed_signs_in_once_it_holds_the_new_one(
        tmp_path, monkeypatch):
    """An agent or a service (re)started between the reload and the new seed's arrival (the order
    docs/operations.md gives): its first connect is refused, and goes on trying as it always has; it
    signs in as soon as the file holds the new seed. nats-py read the public key as it started
    connecting, so it was refused for good (found by a review)."""
    async with nkey_registry(tmp_path, monkeypatch) as (secured, _, worker_seed):
        await secured.reload(rotate=("w-1",))  # the file still holds the revoked seed
        refusals = ErrorsOnce(None)
        connecting = asyncio.ensure_future(connect(secured.url(), "w-1", nkey_seed=str(worker_seed),
                                                   inbox_prefix="_INBOX.w-1", errors=refusals,
                                                   reconnect_time_wait=0.1))
        try:
            await asyncio.wait_for(refusals.refused(), 20)
            assert not connecting.done()
            worker_seed.write_text(secured.secrets["w-1"])
            worker = await asyncio.wait_for(connecting, 20)
        except BaseException:
            connecting.cancel()
            raise
        try:
            reply = await call(worker, service_subject(PREFIX, "registry", "register", "w-1"), registration("w-1"),
                               RegisterReply)
            assert reply.seq > 0
        finally:
            await worker.close()


def test_a_credentials_file_s_own_seed_signs_and_a_seed_file_signs_with_its_key(tmp_path):
    """Who signs a sign-in (no server: the callback nats-py's connect installs, given the options it
    sets): with a credentials file (a JWT and its user's seed) and an nkey seed file both given, the
    credentials file's seed, as nats-py does (a review found the seed file signing for the JWT, refused
    at every reconnect); with the seed file alone, the file's seed as it is at each signature, under
    its own public key."""
    import base64

    import nkeys
    from nats.aio.client import Client

    from events.natspy.connections import follow_seed_file

    first, second = _seed(), _seed()
    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\neyJ0eXAiOiJKV1QifQ.e30.sig\n------END NATS USER JWT------\n\n"
                     f"-----BEGIN USER NKEY SEED-----\n{first}\n------END USER NKEY SEED------\n")
    seed_file = tmp_path / "w-1.nk"
    seed_file.write_text(second)

    def signed(seed: str) -> bytes:
        return base64.b64encode(nkeys.from_seed(bytearray(seed.encode())).sign(b"nonce"))

    def public(seed: str) -> str:
        return nkeys.from_seed(bytearray(seed.encode())).public_key.decode()

    both = Client()
    follow_seed_file(both)
    both._user_credentials, both._nkeys_seed = str(creds), str(seed_file)  # as `connect` sets them
    both._setup_nkeys_connect()
    assert both._signature_cb("nonce") == signed(first)

    alone = Client()
    follow_seed_file(alone)
    alone._nkeys_seed = str(seed_file)
    alone._setup_nkeys_connect()
    assert alone._signature_cb("nonce") == signed(second) and alone._public_nkey == public(second)
    seed_file.write_text(first)  # rotated: the next sign-in reads it again
    assert alone._signature_cb("nonce") == signed(first) and alone._public_nkey == public(first)
