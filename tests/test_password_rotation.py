"""A password rotated under running processes (docs/security.md, "Generating the configuration"): the
server reloaded with the user's new password closes the connection signed in with the old one, with an
'Authorization Violation', and nats-py closes it for good (it reconnects only after a disconnection).
A process signed in with a password cannot come back by itself; it must end, saying why, so that a
supervisor restarts it with the new one. Until 2026-12-07 `warmboot serve` and `warmboot agent` went on
running on the closed connection: the agent logging "connection closed" for ever, the services nothing
at all, none of them answering, none of them exiting (a trial of the docs)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack

from tests.factories import until
from tests.registry_helpers import PROBE, agent_config
from tests.secured_helpers import Secured
from warmboot.agent import Agent
from warmboot.agent_config import ConfigError
from warmboot.runner import start_services, until_stopped

PREFIX = "pr"


async def test_a_rotated_password_ends_the_services_and_the_agent_that_signed_in_with_it(tmp_path):
    secured = Secured(tmp_path / "store", PREFIX, workers=("w-1",)).start()
    config = tmp_path / "agent.toml"
    config.write_text(agent_config("v1"))
    try:
        async with AsyncExitStack() as stack:
            running = await start_services(stack, ["registry"], secured.url("svc"), PREFIX,
                                           options={"registry": {"ttl_s": 60}})
            agent = Agent(secured.url("w-1"), "w-1", "node-a", config, prefix=PREFIX, probe=PROBE)
            stop = asyncio.Event()
            agent_run = asyncio.create_task(agent.run(stop))
            try:
                await until(lambda: agent.beat_at is not None)  # registered, and beating
                services_run = asyncio.create_task(until_stopped(asyncio.Event(), running))
                await secured.reload(rotate=("svc", "w-1"))

                why = await asyncio.wait_for(services_run, 20)  # `serve` then stops, exit status 1
                assert why is not None and "NATS closed the services' connection for good" in why
                assert "authoriz" in why.lower()
                refused = await asyncio.wait_for(asyncio.gather(agent_run, return_exceptions=True), 30)
                assert isinstance(refused[0], ConfigError), refused  # the CLI says it, exit status 1
                assert "NATS closed this agent's connection for good" in str(refused[0])
            finally:
                stop.set()
                if not agent_run.done():
                    agent_run.cancel()
                await asyncio.gather(agent_run, return_exceptions=True)
    finally:
        secured.stop()


async def test_a_stop_is_no_failure_of_the_connection(tmp_path):
    """The services' own close, at a stop, is not a connection lost: nothing is logged, no failure."""
    secured = Secured(tmp_path / "store", PREFIX).start()
    try:
        async with AsyncExitStack() as stack:
            running = await start_services(stack, ["registry"], secured.url("svc"), PREFIX)
        assert running.connection_lost is not None and running.connection_lost.cancelled()
    finally:
        secured.stop()


async def test_a_connection_closed_for_good_is_not_said_frozen_or_unreachable_at_the_stop(tmp_path, caplog):
    """The stop after the services' connection was closed for good says that once (the ERROR line), not
    that NATS "did not answer during the stop ... frozen or unreachable" with a request given up: the
    server answered, it refused the user (a trial of the password rotation, 2026-12-07, found both lines,
    the second sending the operator after a frozen server)."""
    secured = Secured(tmp_path / "store", PREFIX).start()
    try:
        async with AsyncExitStack() as stack:
            running = await start_services(stack, ["registry"], secured.url("svc"), PREFIX)
            services_run = asyncio.create_task(until_stopped(asyncio.Event(), running))
            await secured.reload(rotate=("svc",))
            why = await asyncio.wait_for(services_run, 20)
            assert why is not None and "NATS closed the services' connection for good" in why
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert [m for m in said if "connection for good" in m], said
        assert not [m for m in said if "frozen or unreachable" in m], said
    finally:
        secured.stop()
