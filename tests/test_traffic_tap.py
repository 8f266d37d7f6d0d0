"""The traffic check itself (tests/traffic_tap.py), on a server of its own so that what it is shown
here (an invalid event, on purpose) never reaches the session's check."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import nats

from events.jetstream import TOPIC_HEADER
from events.schema import Attribute, CompatVersion, RegisterReply, RegisterWorker, Resources, WorkerRuntime
from events.schema import WorkerSandboxClass
from events.subjects import service_subject
from services.endpoints import call
from tests.traffic_tap import TrafficTap
from warmboot.natsserver import NatsServer
from warmboot.runner import start_services


def registration() -> RegisterWorker:
    version = CompatVersion(schema_version="v1", attributes=(Attribute(key="architecture", value="amd64"),))
    return RegisterWorker(worker_id="w-gv-0042", node="node-eu-west-017",
                          capacity=Resources(cpu_millis=4000, memory_mib=8192),
                          sandbox_classes=(WorkerSandboxClass(sandbox_class="gvisor",
                                                              default_runtime=WorkerRuntime(version=version)),))


async def test_the_check_judges_what_is_answered_and_appended(tmp_path):
    server = NatsServer(tmp_path / "nats").start()
    tap = TrafficTap()
    tap.install()
    try:
        async with AsyncExitStack() as exits:
            await start_services(exits, ["registry"], server.url, "tp")
            nc = await nats.connect(server.url)
            exits.push_async_callback(nc.close)
            subject = service_subject("tp", "registry", "register", "w-gv-0042")
            await call(nc, subject, registration(), RegisterReply)  # request, reply and events: valid
            refused = await nc.request(subject, b'{"worker_id": 42}', timeout=10)  # invalid on purpose
            assert b'"INVALID_ARGUMENT"' in refused.data
            js = nc.jetstream()
            await js.publish("tp.ev.actor.a-1", b'{"type":"ActorStopped","actor_id":"a 1"}',
                             headers={TOPIC_HEADER: "ActorStopped"})
            await js.publish("tp.ev.actor.a-2", b"{}", headers={TOPIC_HEADER: "tests:SomethingElse"})
        tally = await asyncio.to_thread(tap.finish, server.url)
    finally:
        tap.uninstall()
        server.stop()
    assert tally.checked["request"] == 1, tap.report()  # the refused one is not judged
    assert tally.checked["reply"] == 2, tap.report()  # its error reply is (as ErrorReply)
    assert tally.checked["event"] == 3, tap.report()  # WorkerRegistered, its fence, the invalid one
    assert (tally.streams, tally.foreign) == (1, 1)
    assert tally.invalid == 1, tally.failures
    failure = tally.failures[0]
    assert (failure.what, failure.name, failure.subject) == ("event", "ActorStopped", "tp.ev.actor.a-1")
    assert ("$.actor_id", "'a 1' does not match '^[A-Za-z0-9][A-Za-z0-9_-]{0,127}(?!\\\\n)$'") in failure.errors
    assert "TRAFFIC CHECK FAILED" in tap.report() and not tally.broken


async def test_the_check_reads_back_every_event_stream_however_many_the_server_lists(tmp_path):
    """The server lists 256 streams a page. A whole run's session server holds more, the buckets'
    streams (`KV_...`) listed first: the check read back none of the event streams, and judged no
    event of a whole run while reporting nothing amiss."""
    server = NatsServer(tmp_path / "nats").start()
    tap = TrafficTap()
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        for i in range(300):  # listed before the event streams, as the buckets' are
            await js.add_stream(name=f"KV_B{i:03d}", subjects=[f"$KV.B{i:03d}.>"])
        await js.add_stream(name="TP_EVENTS", subjects=["tp.ev.>"])
        await js.publish("tp.ev.actor.a-1", b'{"type":"ActorStopped","actor_id":"a 1"}',
                         headers={TOPIC_HEADER: "ActorStopped"})  # invalid on purpose: the check must find it
        await nc.close()
        tally = await asyncio.to_thread(tap.finish, server.url)
    finally:
        server.stop()
    assert (tally.streams, tally.checked["event"], tally.invalid) == (1, 1, 1), tap.report()


def test_a_workers_failed_check_fails_the_run_of_the_suite_split_over_processes(tmp_path):
    """`make test` runs the suite under pytest-xdist: each worker process has its own tap, and a body
    that does not validate in any of them must fail the whole run and be printed, as in one process."""
    import subprocess
    import sys

    from tests.conftest import TESTS

    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import _TAPS, pytest_sessionfinish, pytest_terminal_summary, pytest_testnodedown\n")
    (tmp_path / "test_some.py").write_text(
        "from types import SimpleNamespace\n"
        "from tests.conftest import _TAPS\n"
        "class Tap:\n"
        "    def __init__(self, invalid):\n"
        "        self.tally = SimpleNamespace(invalid=invalid, broken=[])\n"
        "    def finish(self, url):\n"
        "        return self.tally\n"
        "    def report(self):\n"
        "        return f'TAP REPORT invalid={self.tally.invalid}'\n"
        "def test_a(): _TAPS.append(Tap(0))\n"
        "def test_b(): _TAPS.append(Tap(3))\n")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                               "--rootdir", str(tmp_path), *args, str(tmp_path)], cwd=TESTS.parent,
                              capture_output=True, text=True, timeout=120)

    split = run("-n", "2", "--dist", "load")
    assert split.returncode == 1, split.stdout + split.stderr  # every test passed: the check failed it
    assert "2 passed" in split.stdout and "TAP REPORT invalid=3" in split.stdout, split.stdout
    (tmp_path / "test_some.py").write_text(
        (tmp_path / "test_some.py").read_text().replace("Tap(3)", "Tap(0)"))
    assert run("-n", "2", "--dist", "load").returncode == 0
    one = run("-p", "no:xdist")  # and in one process, as before
    assert one.returncode == 0 and "TAP REPORT invalid=0" in one.stdout, one.stdout
