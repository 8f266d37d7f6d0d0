"""Shared fixtures: one real nats-server for the whole session (one per process: `make test` runs the
suite in three, with pytest-xdist), a fresh prefix per test.

Every bus test uses `nats_server` (session-scoped, JetStream on a temporary store)
and `prefix` (a new subject prefix, so tests never see each other's streams).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import nats
import pytest

from services.process import serving_loop
from warmboot.natsserver import NatsServer

TESTS = Path(__file__).parent
ONE_MB = 1024 * 1024  # nats-server's default max_payload, as `max_payload: 1MB` gives it (`one_mb`)

# a worker's crash under `make test` is reported, not a hang; a test near its time-out, or a crash, says where
pytest_plugins = ("tests.xdist_crashes", "tests.hang_reports")


def pytest_configure(config):
    """The CLI's tables fit $COLUMNS when it is set (`warmboot.render.terminal_width`), and the tests read
    them as written to a file, unless a test sets it: a width the runner's environment gives is not
    the tests' to inherit (pytest-xdist's workers run with COLUMNS=80: `workers` then dropped columns
    that two tests read)."""
    import os

    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)


def pytest_asyncio_loop_factories(config, item):
    """The tests' event loop is the one the services run on (`services.process.run_serving`):
    uvloop, or asyncio's own with WARMBOOT_EVENT_LOOP=asyncio."""
    name, factory = serving_loop()
    return {name: factory}


@pytest.fixture(autouse=True)
async def _session_loop():
    """Remember the loop the tests run on, for the report of a hung test (`tests.hang_reports`)."""
    from tests.hang_reports import LOOPS

    if not LOOPS:
        LOOPS.append(asyncio.get_running_loop())
    yield


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    # killed, not stopped: its store is thrown away, and the session's thousands of streams made a
    # SIGTERM outlast `stop`'s 15 s before its SIGKILL (26 s of the suite, the last test's teardown)
    server.kill()


@pytest.fixture(scope="session")
def nats_url(nats_server) -> str:
    return nats_server.url


@pytest.fixture
def prefix() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
async def nc(nats_server):
    client = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    yield client
    await client.close()


@pytest.fixture
async def one_mb(tmp_path):
    """A nats-server of the test's own whose max_payload is nats-server's default, 1 MB (docs/security.md's
    configuration; warmboot's own servers carry 2 MB): (its URL, a client connection to it)."""
    server = NatsServer(tmp_path / "nats", extra_config="max_payload: 1MB\n").start()
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    try:
        assert nc.max_payload == ONE_MB
        yield server.url, nc
    finally:
        await nc.close()
        server.kill()


@pytest.fixture
async def stack(nats_server, prefix):
    """Every warmboot service, started in this process against the session server on a fresh prefix.

    The workers these tests register do not heartbeat: the registry's TTL is SILENT_TTL_S."""
    from contextlib import AsyncExitStack

    from tests.factories import SILENT_TTL_S
    from warmboot.runner import SERVICES, start_services

    async with AsyncExitStack() as exits:
        yield await start_services(exits, list(SERVICES), nats_server.url, prefix,
                                   options={"registry": {"ttl_s": SILENT_TTL_S}})


@pytest.fixture
async def writer(nats_url, prefix):
    """`tests.factories.Writer` on the test's prefix: events appended straight into the stream."""
    from tests.factories import Writer

    log = await asyncio.to_thread(Writer, nats_url, prefix)
    yield log
    await asyncio.to_thread(log.close)


@pytest.fixture
async def replicas(nats_url, prefix):
    """`await replicas(**options)` starts a scheduler replica on a connection of its own (options
    are SchedulerService's); all are stopped at the end."""
    from services.scheduler.service import SchedulerService

    started: list[tuple[SchedulerService, nats.NATS]] = []

    async def start(**options) -> SchedulerService:
        client = await nats.connect(nats_url)
        service = SchedulerService(client, nats_url=nats_url, prefix=prefix, **options)
        await service.start()
        started.append((service, client))
        return service

    yield start
    for service, client in started:
        await service.stop()
        await client.close()


@pytest.fixture
async def stalled(stack, nats_url, prefix):
    """A second scheduler replica that serves no requests itself (its endpoints stopped):
    the tests hand it the stale attempt directly, as if it had received it before stalling."""
    from contextlib import AsyncExitStack

    from services.scheduler.service import SchedulerService
    from warmboot.runner import connect

    async with AsyncExitStack() as exits:
        nc = await connect(nats_url, "stalled-replica")
        exits.push_async_callback(nc.close)
        replica = await SchedulerService(nc, nats_url=nats_url, prefix=prefix, metrics=False).start()
        exits.push_async_callback(replica.stop)
        await replica.service.stop()
        replica.service = None
        yield replica


# --- the traffic check (tests/traffic_tap.py) ---------------------------------------------------------
# What the services of this process receive and answer, and the events in the session server's
# streams, are judged against the published JSON Schema with the PyPI `jsonschema` validator when
# the session ends. A body that does not validate fails the run (the report is printed in the
# terminal summary); what the check could not read is only noted.

_TAPS: list = []


@pytest.fixture(scope="session", autouse=True)
def _traffic_check(request):
    from tests.traffic_tap import TrafficTap

    server = None
    if any("nats_server" in getattr(item, "fixturenames", ()) for item in request.session.items):
        server = request.getfixturevalue("nats_server")  # set up first, so torn down after the check
    tap = TrafficTap()
    tap.install()
    _TAPS.append(tap)
    yield tap
    tap.finish(server.url if server is not None else None)


# Under pytest-xdist (`make test` runs the suite in three processes) each worker has its own session,
# server and tap; its report and verdict reach the controller in its `workeroutput`, which prints
# them and fails the run for them.
_WORKER_REPORTS: list[tuple[str, str, bool]] = []  # (worker, report, failed): at the controller


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    workeroutput = getattr(session.config, "workeroutput", None)  # set in an xdist worker only
    for tap in _TAPS:
        failed = bool(tap.finish(None).invalid or tap.tally.broken)
        if failed:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if workeroutput is not None:
            workeroutput["traffic_check"] = (tap.report(), failed)
    if any(failed for _, _, failed in _WORKER_REPORTS):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    report = getattr(node, "workeroutput", {}).get("traffic_check")
    if report is not None:
        _WORKER_REPORTS.append((node.gateway.id, *report))


def pytest_terminal_summary(terminalreporter):
    for tap in _TAPS:
        terminalreporter.write_line(tap.report())
    for worker, report, _ in _WORKER_REPORTS:
        terminalreporter.write_line(f"[{worker}] {report}")
