"""A client's view with no scheduler running (docs/security.md, Roles): `workers`, `actor list` and `worker
show` ask a scheduler, and fold the log only when none answers, which a client's credentials may not read.
The error then names the scheduler first. Until 2026-12-07 it said only that the credentials may not read
the log, and asked whether --prefix was the deployment's (a trial of the docs, the scheduler being down)."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

from click.testing import CliRunner

from tests.secured_helpers import Secured
from warmboot.cli import main
from warmboot.runner import start_services

PREFIX = "ns"


async def test_a_clients_view_with_no_scheduler_says_that_none_answers(tmp_path):
    secured = Secured(tmp_path / "store", PREFIX, clients=("orch",)).start()
    try:
        async with AsyncExitStack() as stack:
            await start_services(stack, ["registry"], secured.url("svc"), PREFIX)  # the log is there
            env = {"NATS_URL": secured.url("orch"), "WARMBOOT_PREFIX": PREFIX}
            for args, endpoint in ((["workers"], "workers"), (["actor", "list"], "actors"),
                                   (["worker", "show", "w-1"], "worker.w-1")):
                result = await asyncio.to_thread(CliRunner().invoke, main, args, env=env)
                assert result.exit_code == 1, (args, result.output)
                said = " ".join(result.stderr.split())
                assert said.startswith(f"error: no scheduler answers {PREFIX}.scheduler.{endpoint} (does the "
                                       "scheduler run?), and the log cannot be folded here in its place: these "
                                       "credentials may not read the log"), said
                assert "--prefix" not in said, said
    finally:
        secured.stop()


async def test_a_clients_whatif_is_told_its_credentials_may_not_read_the_log_not_asked_about_the_prefix(tmp_path):
    """`whatif` reads the log's end first (its answer at least at it), which a client's credentials may not
    read: the server refuses it, and the error asked whether --prefix was the deployment's (a trial of the
    docs). It says what the server said, and whose credentials may."""
    secured = Secured(tmp_path / "store", PREFIX, clients=("orch",)).start()
    try:
        async with AsyncExitStack() as stack:
            await start_services(stack, ["registry"], secured.url("svc"), PREFIX)
            env = {"NATS_URL": secured.url("orch"), "WARMBOOT_PREFIX": PREFIX}
            result = await asyncio.to_thread(CliRunner().invoke, main, ["whatif", "--class", "gvisor"], env=env)
            assert result.exit_code == 1, result.output
            said = " ".join(result.stderr.split())
            assert said.startswith(f"error: cannot read the event stream {PREFIX.upper()}_EVENTS: these credentials "
                                   "may not read the log (the server refused it: "), said
            assert said.endswith("A client's may not; an operator's may (docs/security.md, Roles)"), said
            assert "--prefix" not in said, said
    finally:
        secured.stop()
