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
