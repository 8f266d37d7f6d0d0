"""A key rotated under running processes (docs/operations.md): a server's user given a new nkey and
the server reloaded, the new seed then put in the file the process signs in with. The process's
connections come back by themselves, signed with the new seed under its own public key; until the
file holds the new seed they stay refused. nats-py read the public key once, at the first connect,
and signed the reconnects with the new seed under the old key: refused until a restart."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import AsyncExitStack

from events.natspy.connections import ErrorsOnce
from events.schema import HeartbeatReply, RegisterReply, SeqReply
from events.subjects import service_subject
from services.endpoints import call
from tests.registry_helpers import registration
from tests.secured_helpers import Secured, _seed
from warmboot.connection import connect
from warmboot.nats_config import identities, nats_auth_config
from warmboot.runner import start_services

PREFIX = "kr"


async def rotate(secured: Secured, *users: str) -> None:
    """Give `users` new seeds in the server's configuration and reload it: from the reload on, their
    old keys are refused, and connections signed in with them are closed."""
    for user in users:
        secured.secrets[user] = _seed()
    server = secured.server
    server.extra_config = nats_auth_config(PREFIX, secured.services, ["w-1"], [], clients=[],
                                           ids=identities("nkey", secured.secrets))
    server.config_path.write_text(server.config())
    seen = len(server.log)
    os.kill(server.pid, signal.SIGHUP)
    deadline = time.monotonic() + 20
    while not any("Reloaded server configuration" in line for line in list(server.log)[seen:]):
        assert not any("Failed to reload" in line for line in server.log), list(server.log)[-5:]
        assert time.monotonic() < deadline, "the server did not say it reloaded"
        await asyncio.sleep(0.05)  # polling the server's log with a deadline, not a fixed wait


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
    secured = Secured(tmp_path / "store", PREFIX, workers=("w-1",), auth="nkey").start()
    services_seed, worker_seed = tmp_path / "svc.nk", tmp_path / "w-1.nk"
    services_seed.write_text(secured.secrets["svc"])
    worker_seed.write_text(secured.secrets["w-1"])
    monkeypatch.setenv("NATS_NKEY_SEED", str(services_seed))  # the services' connection and their event store's
    try:
        async with AsyncExitStack() as stack:
            await start_services(stack, ["registry"], secured.url(), PREFIX, options={"registry": {"ttl_s": 60}})
            refusals = Heard("holds no nkey seed")
            worker = await connect(secured.url(), "w-1", nkey_seed=str(worker_seed), inbox_prefix="_INBOX.w-1",
                                   errors=refusals, reconnect_time_wait=0.1)
            stack.push_async_callback(worker.close)

            def ask(verb: str, body, reply_type, timeout: float = 5.0):
                return call(worker, service_subject(PREFIX, "registry", verb, "w-1"), body, reply_type, timeout)

            assert (await ask("register", registration("w-1"), RegisterReply)).seq > 0

            await rotate(secured, "svc", "w-1")
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
    finally:
        secured.stop()
