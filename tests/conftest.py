"""Shared fixtures: one real nats-server for the whole session (one per process: `make test` runs the
suite in two, with pytest-xdist), a fresh prefix per test.

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

pytest_plugins = ("tests.xdist_crashes",)  # a worker's crash under `make test` is reported, not a hang


def pytest_configure(config):
    """The CLI's tables fit $COLUMNS when it is set (`warmboot.render.terminal_width`), and the tests read
    them as written to a file, unless a test sets it: a width the runner's environment gives is not
    the tests' to inherit (pytest-xdist's workers run with COLUMNS=80: `workers` then dropped columns
    that two tests read)."""
    import os

    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)
    _keep_real_stderr(config)


def pytest_asyncio_loop_factories(config, item):
    """The tests' event loop is the one the services run on (`services.process.run_serving`):
    uvloop, or asyncio's own with WARMBOOT_EVENT_LOOP=asyncio."""
    name, factory = serving_loop()
    return {name: factory}


_loop: list[asyncio.AbstractEventLoop] = []  # the session's loop, once a test has run on it


@pytest.fixture(autouse=True)
async def _session_loop():
    """Remember the loop the tests run on, for `pytest_timeout_set_timer`'s report of a hung test."""
    if not _loop:
        _loop.append(asyncio.get_running_loop())
    yield


_real_stderr: list = []  # the process's stderr as it was before pytest's capture: `pytest_configure` keeps it
_HANG_REPORT = pytest.StashKey()  # an item's timer of `pytest_timeout_set_timer`


def _keep_real_stderr(config) -> None:
    """A copy of the stderr the process was started with, for `pytest_timeout_set_timer`'s report. During a
    test, fd 2 is pytest's capture file, which a worker that pytest-timeout ends takes with it; and an xdist
    worker's stdout, where pytest-timeout writes its stack dump, is /dev/null. The CI run of d764e5a said of
    a worker's death only "node down: Not properly terminated": not which test it ran, nor where it waited."""
    import os
    import sys

    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=False)
    try:
        _real_stderr.append(os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1, closefd=True))
    except (OSError, ValueError, AttributeError):
        pass  # no stderr to copy: the report goes to sys.stderr as it is then
    finally:
        if capman is not None:
            capman.resume_global_capture()


def pytest_sessionstart(session):
    """A crash of the process (a segfault, an abort) prints its threads' stacks to its own stderr too (pytest's
    faulthandler writes to a copy of fd 2 taken while it was the capture file: lost with the process)."""
    import faulthandler

    if _real_stderr:
        faulthandler.enable(file=_real_stderr[0], all_threads=True)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # pytest-timeout's hook
def pytest_timeout_set_timer(item, settings):
    """A test still running at nine tenths of its time-out (its own, `@pytest.mark.timeout`, or the run's),
    shortly before pytest-timeout ends it and, `thread` method, its process: its id, what every task of the
    session's loop awaits and every thread's stack, written to the process's own stderr (`_keep_real_stderr`),
    so that the report is in the log under `make test` too. pytest-timeout then sets its own timer."""
    import faulthandler
    import sys
    import threading

    if not settings.timeout or settings.timeout <= 0:
        return None
    limit = float(settings.timeout)

    def report() -> None:
        out = _real_stderr[0] if _real_stderr else sys.stderr
        try:
            print(f"\n{item.nodeid} still runs after {limit * 0.9:.0f}s of its {limit:.0f}s time-out; "
                  "the tasks of its loop:", file=out)
            for task in list(asyncio.all_tasks(_loop[0])) if _loop else []:
                task.print_stack(limit=8, file=out)
            print(f"{item.nodeid}: every thread's stack:", file=out)
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
            out.flush()
        except Exception as error:  # a report that fails says so, and the test goes on
            print(f"{item.nodeid}: the hang report failed: {error!r}", file=sys.stderr)

    timer = threading.Timer(limit * 0.9, report)
    timer.daemon = True
    timer.start()
    item.stash[_HANG_REPORT] = timer
    return None  # pytest-timeout's own timer too


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # pytest-timeout's hook
def pytest_timeout_cancel_timer(item):
    timer = item.stash.get(_HANG_REPORT, None)
    if timer is not None:
        timer.cancel()
    return None  # pytest-timeout's own is cancelled too


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


# Under pytest-xdist (`make test` runs the suite in two processes) each worker has its own session,
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
