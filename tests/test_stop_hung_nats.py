"""A long-running warmboot process stopped (SIGTERM, as systemd or Kubernetes stop it) while its NATS
server is frozen (SIGSTOP: a frozen VM, a stuck disk) or gone (killed: a partition), with requests in
flight: it exits within STOP_BOUND_S, says why, and a restart on the server, resumed or started again,
finds nothing lost or doubled (the stream read in order: one event per request id).

Each process runs as a subprocess, its output read on a thread (`Process`); the freeze comes once the
first request in flight is answered (an acknowledged append, or for the agent its registration stored),
the others then on their way. No sleep: what the tests wait on is an answer, an event, or a line said;
a time is only ever a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from contextlib import AsyncExitStack
from pathlib import Path
from urllib.parse import urlsplit

import nats
import pytest

from events.errors import ContractError
from events.natspy.connections import CLOSE_GIVEN_UP_S, close_within
from events.schema import ActorCreated, ActorPlaced, Assignment, ResumeActor, RuntimeChanged, WorkerDrained, WorkerRegistered
from events.subjects import service_subject
from services.endpoints import call
from tests.factories import SILENT_TTL_S, logged
from tests.registry_helpers import CPUINFO, agent_config, wait_event, worker_events
from tests.test_faults import Load
from warmboot.cli_common import read_subject
from warmboot.natsserver import NatsServer
from warmboot.runner import STOP_BOUND_S, STOP_DRAIN_S, STOP_GIVEN_UP_EXIT, start_services

EXE = str(Path(sys.executable).parent / "warmboot")
WORKERS = 100
ACTORS = 100


def said_in(words: str, line: str) -> bool:
    return line.startswith(words[1:]) if words.startswith("^") else words in line


class Process:
    """`warmboot ARGS` (or `command` ARGS), its output (stdout and its log, stderr) read line by line on a thread of
    its own."""

    def __init__(self, *args: str, command: tuple[str, ...] = (EXE,)) -> None:
        self.args = args
        self.popen = subprocess.Popen([*command, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self._waiting: list[tuple[str, asyncio.Future, asyncio.AbstractEventLoop]] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            with self._lock:
                self.lines.append(line)
                for waiting in [w for w in self._waiting if said_in(w[0], line)]:
                    self._waiting.remove(waiting)
                    waiting[2].call_soon_threadsafe(lambda f=waiting[1], l=line: f.done() or f.set_result(l))
        with self._lock:
            for _, future, loop in self._waiting:
                loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))
            self._waiting.clear()

    @property
    def text(self) -> str:
        with self._lock:
            return "".join(self.lines)

    async def said(self, words: str, within: float = 30.0) -> str:
        """The first line of its output with `words` in it (at its start, for words that begin with `^`: the
        line that says a process serves, not a service's log line before it); AssertionError if it ends, or
        `within` passes, without one."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            line = next((line for line in self.lines if said_in(words, line)), None)
            if line is None and self._reader.is_alive():
                self._waiting.append((words, future, loop))
        if line is None and not future.done() and self._reader.is_alive():
            try:
                line = await asyncio.wait_for(future, within)
            except asyncio.TimeoutError:
                raise AssertionError(f"{self.args[0]} did not say {words!r} within {within:g}s:\n{self.text}") from None
        if line is None:
            raise AssertionError(f"{self.args[0]} ended (exit {self.popen.wait()}) without saying {words!r}:\n"
                                 f"{self.text}")
        return line

    async def stopped(self, bound: float = STOP_BOUND_S) -> tuple[int, float, str]:
        """SIGTERM; its exit status, the seconds it took to end, and its output. One that has not ended within
        `bound` (and 2 s of the test's slack) is asked for its stacks (in its output), killed, and the test fails."""
        started = time.monotonic()
        self.popen.send_signal(signal.SIGTERM)
        try:
            status = await asyncio.to_thread(self.popen.wait, bound + 2.0)
        except subprocess.TimeoutExpired:
            self.popen.send_signal(signal.SIGUSR1)
            try:
                await asyncio.to_thread(self.popen.wait, 1.0)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
            raise AssertionError(f"did not exit within {bound + 2:g}s of SIGTERM; its output:\n{self.text}") from None
        took = time.monotonic() - started
        await asyncio.to_thread(self._reader.join, 5)
        return status, took, self.text

    def end(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def freeze(server: NatsServer, how: str) -> None:
    if how == "frozen":
        os.kill(server.pid, signal.SIGSTOP)
    else:
        server.process.kill()
        server.process.wait()


def thaw(server: NatsServer, how: str) -> None:
    if how == "frozen":
        os.kill(server.pid, signal.SIGCONT)
    else:
        server.stop()
        server.start()


async def storm(load: Load, workers: list[str], actors: list[str]) -> list[asyncio.Future]:
    """Registrations and creations sent at once, each with its request id; returned once the first is
    answered (the rest are in flight)."""
    asks = [asyncio.ensure_future(once(load.register(w))) for w in workers]
    asks += [asyncio.ensure_future(once(load.create(a))) for a in actors]
    await asyncio.wait_for(load.answered.wait(), 15)
    return asks


async def once(ask) -> None:
    """One attempt (the retries come after the restart: `Load.register`, `Load.create`, with the same ids)."""
    try:
        await ask
    except (ContractError, nats.errors.Error, asyncio.TimeoutError, AssertionError):
        pass


async def check_once_each(nc, prefix: str, workers: list[str], actors: list[str]) -> None:
    """Read in stream order: one WorkerRegistered per worker, one ActorCreated per actor."""
    for w in workers:
        history = [type(e) for _, e in await read_subject(nc, prefix, f"{prefix}.ev.worker.{w}")]
        assert history == [WorkerRegistered], (w, history)
    for a in actors:
        history = [type(e) for _, e in await read_subject(nc, prefix, f"{prefix}.ev.actor.{a}")]
        assert history == [ActorCreated], (a, history)


def assert_stopped(status: int, took: float, text: str) -> None:
    """Exit 0 within the bound, and the log says NATS did not answer (`warmboot.runner`)."""
    print(f"stopped in {took:.1f}s; its log:\n{text}")
    # within the bound: exit 0, and not by `StopBound` (which ends it at the bound with status 1, saying so)
    assert status == 0, text
    assert "did not answer during the stop" in text, text
    assert "the stop did not end within" not in text, text  # its own steps' bounds kept it, not `StopBound`


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["frozen", "killed"])
@pytest.mark.parametrize("service", ["registry", "snapshotter", "all"])
async def test_serve_stops_within_the_bound_with_nats_hung_mid_requests(tmp_path, service, how):
    """`warmboot serve SERVICE`, its requests in flight (registrations, creations), NATS frozen or killed,
    then SIGTERM. Started again on the server resumed (or restarted on its store), the clients' retries
    with their request ids find each write once."""
    server = NatsServer(tmp_path / "nats").start()
    prefix = "t" + uuid.uuid4().hex[:10]
    workers = [f"w-{i:02d}" for i in range(WORKERS)] if service != "snapshotter" else []
    actors = [f"a-{i:02d}" for i in range(ACTORS)] if service != "registry" else []
    args = ("serve", service, "--nats", server.url, "--prefix", prefix)
    nc = None
    proc = Process(*args)
    try:
        await proc.said("^serving")
        nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        load = Load(nc, prefix)
        asks = await storm(load, workers, actors)
        freeze(server, how)
        assert_stopped(*await proc.stopped())
        thaw(server, how)
        for ask in asks:
            ask.cancel()
        proc = Process(*args)
        await proc.said("^serving")
        for w in workers:
            await load.register(w)
        for a in actors:
            await load.create(a)
        await check_once_each(nc, prefix, workers, actors)
    finally:
        if server.running and how == "frozen":
            os.kill(server.pid, signal.SIGCONT)
        proc.end()
        if nc is not None:
            await nc.close()
        server.stop()
def agent_args(server: NatsServer, prefix: str, tmp_path: Path, *more: str) -> tuple[str, ...]:
    return ("agent", "--nats", server.url, "--worker-id", "w-a", "--node", "node-a",
            "--config", str(tmp_path / "agent.toml"), "--prefix", prefix, "--cpuinfo", str(CPUINFO), "--arch", "amd64",
            "--state-file", str(tmp_path / "agent.revision"), "--drain-on-exit", *more)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["frozen", "killed"])
async def test_agent_stops_within_the_bound_with_nats_hung_as_it_registers(tmp_path, how):
    """`warmboot agent --drain-on-exit`, NATS frozen or killed as its registration is stored (the reply maybe
    not heard yet), then SIGTERM: its drain at exit is given up within the bound, said. Started again with
    its state file on the server resumed (or restarted), it serves the worker again: in stream order, one
    registration, and at most one drain (the one given up on, stored once the server went on)."""
    server = NatsServer(tmp_path / "nats").start()
    prefix = "t" + uuid.uuid4().hex[:10]
    config = tmp_path / "agent.toml"
    config.write_text(agent_config("v1"))
    args = agent_args(server, prefix, tmp_path)
    nc = None
    registry = Process("serve", "registry", "--nats", server.url, "--prefix", prefix)
    agent = None
    try:
        await registry.said("^serving")
        nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        agent = Process(*args)
        await wait_event(nc, prefix, "w-a", WorkerRegistered)
        freeze(server, how)
        status, took, text = await agent.stopped()
        print(f"stopped in {took:.1f}s; its output:\n{text}")
        assert status == 0, text  # within the bound: not ended by `StopBound` (status 1, and its line)
        assert "could not drain w-a: no answer within" in text, text
        assert "the stop did not end within" not in text, text
        thaw(server, how)
        agent = Process(*args)
        print(await agent.said("registered w-a"))
        history = [type(e).__name__ for _, e in await worker_events(nc, prefix, "w-a")]
        print(history)
        assert history.count("WorkerRegistered") == 1 and history.count("WorkerDrained") <= 1, history
    finally:
        if server.running and how == "frozen":
            os.kill(server.pid, signal.SIGCONT)
        for p in (agent, registry):
            if p is not None:
                p.end()
        if nc is not None:
            await nc.close()
        server.stop()




@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["frozen", "killed"])
async def test_agent_stops_within_the_bound_with_nats_hung_as_it_registers_a_change(tmp_path, how):
    """`warmboot agent --drain-on-exit`, its config changed (a rolling upgrade: v2 the default, v1 restorable),
    NATS frozen or killed as that registration is stored (its reply maybe not heard), then SIGTERM: it exits 0
    within the bound, by its own steps' bounds (not `StopBound`), saying why its drain was given up. Started
    again on the server resumed (or restarted), the log read in order holds each registration once: the first
    (v1), the change (v2), then the restart's own and at most the drain given up on; the change is in force."""
    server = NatsServer(tmp_path / "nats").start()
    prefix = "t" + uuid.uuid4().hex[:10]
    config = tmp_path / "agent.toml"
    config.write_text(agent_config("v1"))
    args = agent_args(server, prefix, tmp_path, "--watch-interval", "0.05")
    nc = agent = None
    registry = Process("serve", "registry", "--nats", server.url, "--prefix", prefix)
    try:
        await registry.said("^serving")
        nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        agent = Process(*args)
        first, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        await agent.said("registered w-a")
        config.write_text(agent_config("v2", ("v1",)))
        await wait_event(nc, prefix, "w-a", RuntimeChanged, after=first)
        freeze(server, how)
        status, took, text = await agent.stopped()
        print(f"stopped in {took:.1f}s; its output:\n{text}")
        assert status == 0, text  # within the bound: not ended by `StopBound` (status 1, and its line)
        assert "could not drain w-a: no answer within" in text, text
        assert "the stop did not end within" not in text, text
        thaw(server, how)
        agent = Process(*args)
        print(await agent.said("registered w-a"))
        history = [e for _, e in await worker_events(nc, prefix, "w-a")]
        print([type(e).__name__ for e in history])
        names = [type(e).__name__ for e in history]
        assert names[:2] == ["WorkerRegistered", "RuntimeChanged"], names
        # after them: the restarted agent's registration (its revision above: `WorkerUpdated`, docs/registry.md),
        # and the drain given up on if it reached the registry once the server went on
        assert sorted(names[2:]) in (["WorkerUpdated"], ["WorkerDrained", "WorkerUpdated"]), names
        assert history[1].sandbox_classes[0].default_runtime.name == "gvisor-v2", history[1]
        revisions = [e.revision for e in history if not isinstance(e, WorkerDrained)]
        assert revisions == sorted(set(revisions)), revisions  # each registration once, in the order made
    finally:
        if server.running and how == "frozen":
            os.kill(server.pid, signal.SIGCONT)
        for p in (agent, registry):
            if p is not None:
                p.end()
        if nc is not None:
            await nc.close()
        server.stop()


# Run as `python -c`: the agent, its drain at exit waiting for ever (a step of its stop no bound of its own covers).
HUNG_DRAIN = """
import asyncio, sys
from warmboot.agent import Agent

async def drain(self, reason, timeout_s=5.0):
    print("draining, for ever", flush=True)
    while True:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass

Agent.drain = drain
from warmboot.cli import main
main(sys.argv[1:], prog_name="warmboot")
"""


@pytest.mark.timeout(60)
async def test_an_agent_whose_stop_outlasts_the_bound_ends_saying_so(tmp_path):
    """The agent's stop is bounded as `serve`'s and `up`'s are (`StopBound`): a step of it that waits past every
    bound of its own (here its drain, made to wait for ever) ends the process at STOP_BOUND_S, with the line that
    says so and exit status STOP_GIVEN_UP_EXIT."""
    server = NatsServer(tmp_path / "nats").start()
    prefix = "t" + uuid.uuid4().hex[:10]
    (tmp_path / "agent.toml").write_text(agent_config("v1"))
    registry = Process("serve", "registry", "--nats", server.url, "--prefix", prefix)
    agent = None
    try:
        await registry.said("^serving")
        agent = Process(*agent_args(server, prefix, tmp_path), command=(sys.executable, "-c", HUNG_DRAIN))
        await agent.said("registered w-a")
        status, took, text = await agent.stopped(STOP_BOUND_S + 3)
        print(f"stopped in {took:.1f}s; its output:\n{text}")
        assert "draining, for ever" in text, text
        assert status == STOP_GIVEN_UP_EXIT, text
        assert f"warmboot agent w-a: the stop did not end within {STOP_BOUND_S:g}s" in text, text
    finally:
        for p in (agent, registry):
            if p is not None:
                p.end()
        server.stop()


async def held_up(nc) -> asyncio.Future:
    """Publish on `nc`, its server frozen, until the kernel takes no more (the socket's buffers full on both ends:
    the transport pauses its writer, an event, not a time); the publisher (held up, never to end), returned. A
    close of `nc` then never ends by itself (nats-py's waits for what it holds to be sent)."""
    transport = nc._transport._io_writer.transport
    # a send buffer of a fixed size: the kernel's own grows while the server's kernel acknowledges what it holds
    # for the frozen process, and what the transport held could be taken by the kernel later (its close then ended)
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    protocol = transport.get_protocol()
    held = asyncio.Event()
    pause = protocol.pause_writing

    def paused() -> None:
        pause()
        held.set()

    protocol.pause_writing = paused

    async def fill() -> None:  # for as long as the kernel takes it: what it holds is never sent
        with contextlib.suppress(nats.errors.ConnectionClosedError):  # (how it ends: the connection closed)
            while True:
                await nc.publish("t.fill", b"x" * 512 * 1024)

    filling = asyncio.ensure_future(fill())
    await asyncio.wait_for(held.wait(), 20)
    assert not filling.done(), filling
    return filling


async def socket_closed(nc) -> bool:
    """Whether the socket of `nc` is closed (its file descriptor let go). An aborted transport closes it in a
    callback it schedules (`call_soon`), which runs before one scheduled after it: that one is awaited."""
    loop = asyncio.get_running_loop()
    after = loop.create_future()
    loop.call_soon(after.set_result, None)
    await after
    return nc._transport._io_writer.transport.get_extra_info("socket").fileno() == -1


@pytest.mark.timeout(30)
async def test_the_close_of_a_connection_to_a_frozen_server_is_given_up_within_its_bound(tmp_path):
    """nats-py's close of a connection whose server is frozen, its socket's buffers full (what the process
    sent before the freeze), never ends: `close_within` gives it up after CLOSE_GIVEN_UP_S. Two connections,
    filled alike: one closed by nats-py alone, the other by `close_within`."""
    server = NatsServer(tmp_path / "nats").start()
    try:
        plain, bounded = [await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
                          for _ in range(2)]
        os.kill(server.pid, signal.SIGSTOP)
        for nc in (plain, bounded):
            await held_up(nc)
        closing = asyncio.ensure_future(plain.close())
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert not await close_within(bounded)
        assert loop.time() - started < CLOSE_GIVEN_UP_S + 5  # given up, not waited out (it never ends)
        assert not closing.done(), "nats-py's own close ended: nothing to give up"
        # given up, its socket is closed all the same: a process that goes on keeps none to the frozen server
        assert await socket_closed(bounded)
        closing.cancel()
    finally:
        if server.running:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


@pytest.mark.timeout(30)
async def test_a_client_s_close_with_its_server_frozen_is_given_up_and_its_socket_closed(tmp_path):
    """`warmboot.client.Client.close` of a connection it made, its server frozen with the socket's buffers full
    (a library's caller stopping while NATS is stuck): given up after CLOSE_GIVEN_UP_S, its socket closed, where
    it waited for ever (nats-py's own close)."""
    from warmboot.client import Client

    server = NatsServer(tmp_path / "nats").start()
    try:
        client = await Client.connect(server.url)
        os.kill(server.pid, signal.SIGSTOP)
        filling = await held_up(client.nc)
        await asyncio.wait_for(client.close(), CLOSE_GIVEN_UP_S + 5)  # without the bound: never ends
        assert await socket_closed(client.nc)
        await asyncio.wait_for(filling, 5)  # the publisher held up ends with the connection
    finally:
        if server.running:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


def child_of(pid: int) -> int:
    """The one child process of `pid` (`warmboot up`'s nats-server)."""
    children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    assert len(children) == 1, children
    return children[0]


@pytest.mark.timeout(60)
async def test_up_stops_within_the_bound_with_its_nats_frozen_mid_requests(tmp_path):
    """`warmboot up`, its registrations in flight, its own nats-server frozen (a stuck disk), then SIGTERM: its
    services give up within the bound and its server, resumed to take the SIGTERM or else killed, ends too.
    Started again on the store, the retries find each registration once."""
    prefix = "t" + uuid.uuid4().hex[:10]
    workers = [f"w-{i:02d}" for i in range(WORKERS)]
    args = ("up", "--port", "0", "--store", str(tmp_path / "store"), "--metrics-port", "0", "--prefix", prefix)
    up = Process(*args)
    nc = nats_pid = None
    try:
        url = (await up.said("NATS ")).split()[1]
        await up.said("^serving")
        nats_pid = child_of(up.popen.pid)
        nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        load = Load(nc, prefix)
        asks = await storm(load, workers, [])
        os.kill(nats_pid, signal.SIGSTOP)
        assert_stopped(*await up.stopped())
        with pytest.raises(ProcessLookupError):
            os.kill(nats_pid, 0)  # (its parent reaped it)
        for ask in asks:
            ask.cancel()
        up = Process(*args[:2], str(urlsplit(url).port), *args[3:])  # its port again: the client reconnects
        await up.said("^serving")
        for w in workers:
            await load.register(w)
        await check_once_each(nc, prefix, workers, [])
    finally:
        if nats_pid is not None:  # (left frozen by a failure before the stop: `up.end` then stops it)
            with contextlib.suppress(ProcessLookupError):
                os.kill(nats_pid, signal.SIGCONT)
        up.end()
        if nc is not None:
            await nc.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["frozen", "killed"])
async def test_serve_scheduler_stops_within_the_bound_with_nats_hung_mid_placements(tmp_path, how):
    """`warmboot serve scheduler`, resumes in flight, NATS frozen or killed once the first is placed, then
    SIGTERM. Started again, each resume retried with its request id is placed once: one ActorPlaced per
    actor in stream order, the one each retry is answered with."""
    server = NatsServer(tmp_path / "nats").start()
    prefix = "t" + uuid.uuid4().hex[:10]
    actors = [f"a-{i:02d}" for i in range(ACTORS)]
    args = ("serve", "scheduler", "--nats", server.url, "--prefix", prefix)
    nc = proc = None
    try:
        async with AsyncExitStack() as exits:
            await start_services(exits, ["registry", "snapshotter"], server.url, prefix,
                                 options={"registry": {"ttl_s": SILENT_TTL_S}})
            nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
            load = Load(nc, prefix)
            for i in range(3):
                await load.register(f"w-{i}")
            await asyncio.gather(*(load.create(a) for a in actors))
            proc = Process(*args)
            await proc.said("^serving")
            requests = {a: ResumeActor(request_id=f"resume-{a}") for a in actors}
            resumes = [asyncio.ensure_future(call(nc, service_subject(prefix, "scheduler", "resume", a), requests[a],
                                                  Assignment, timeout=15)) for a in actors]
            await asyncio.wait(resumes, return_when=asyncio.FIRST_COMPLETED)
            freeze(server, how)
            assert_stopped(*await proc.stopped())
            thaw(server, how)
            for resume in resumes:
                resume.cancel()
            proc = Process(*args)
            await proc.said("^serving")
            retried = {a: await load.ask("scheduler", "resume", a, requests[a], Assignment) for a in actors}
            for a in actors:
                placed = [e for _, e in await read_subject(nc, prefix, f"{prefix}.ev.actor.{a}")
                          if isinstance(e, ActorPlaced)]
                assert [(e.worker_id, e.request_id) for e in placed] == [(retried[a].worker_id, f"resume-{a}")], \
                    (a, placed)
    finally:
        if server.running and how == "frozen":
            os.kill(server.pid, signal.SIGCONT)
        if proc is not None:
            proc.end()
        if nc is not None:
            await nc.close()
        server.stop()


@pytest.mark.timeout(60)
async def test_the_snapshotters_stop_ends_within_the_bound_with_its_follower_in_a_store_call(tmp_path,
                                                                                           monkeypatch):
    """The snapshotter's follower (its worker-removal process, on a thread of its own) in a call to the store
    as NATS freezes: the service's stop waited for the thread, which waited out the store's time-out
    (WARMBOOT_STORE_TIMEOUT, 30 s). It gives the thread a moment, then closes the store under it (the call
    ends, interrupted), within the bound. The follower is held, as it folds the first event of the log, until
    the server is frozen, then reads the stream's last sequence there (the registry runs too, for a
    registration: an event the follower folds)."""
    from services.snapshotter.service import WorkerRemovalProcess

    entered, frozen = threading.Event(), threading.Event()
    act = WorkerRemovalProcess._act

    def held(self, releases, at, tracking):
        if not entered.is_set():
            entered.set()
            frozen.wait(30)
            self.recorder.max_notification_id()  # to the frozen server
        return act(self, releases, at, tracking)

    monkeypatch.setattr(WorkerRemovalProcess, "_act", held)
    server = NatsServer(tmp_path / "nats").start()
    prefix = "t" + uuid.uuid4().hex[:10]
    nc = None
    try:
        exits = AsyncExitStack()
        running = await start_services(exits, ["registry", "snapshotter"], server.url, prefix,
                                       options={"registry": {"ttl_s": SILENT_TTL_S}})
        nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        await Load(nc, prefix).register("w-1")  # an event the follower folds
        assert await asyncio.to_thread(entered.wait, 15)
        os.kill(server.pid, signal.SIGSTOP)
        frozen.set()
        loop = asyncio.get_running_loop()
        started = loop.time()
        await running.services[1].stop()
        took = loop.time() - started
        print(f"the snapshotter stopped in {took:.1f}s")
        assert took < STOP_BOUND_S - 2, f"the snapshotter took {took:.1f}s to stop"
        os.kill(server.pid, signal.SIGCONT)
        await exits.aclose()
    finally:
        frozen.set()
        if server.running:
            os.kill(server.pid, signal.SIGCONT)
        if nc is not None:
            await nc.close()
        server.stop()


def test_a_stop_that_outlasts_its_bound_ends_the_process_saying_so():
    """`StopBound`, armed by a stop signal, ends a process whose stop still runs at the bound (a step of the
    stop hung on what no other bound covers): exit status STOP_GIVEN_UP_EXIT and a line saying so. Here the
    process, once armed, waits on an event nobody sets."""
    code = ("import threading\nfrom warmboot.runner import StopBound\n"
            "StopBound('warmboot serve all', 0.5).arm()\nthreading.Event().wait(30)\n")
    started = time.monotonic()
    ended = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    took = time.monotonic() - started
    assert ended.returncode == STOP_GIVEN_UP_EXIT, ended
    assert "warmboot serve all: the stop did not end within 0.5s" in ended.stderr, ended.stderr
    assert took < 10, took


@pytest.mark.timeout(60)
async def test_a_stop_with_nats_answering_says_nothing_of_it(tmp_path):
    """`warmboot serve scheduler` stopped with its server well: nothing in progress, a stop quicker than a round
    trip to the server; it does not say the server did not answer."""
    server = NatsServer(tmp_path / "nats").start()
    try:
        proc = Process("serve", "scheduler", "--nats", server.url, "--prefix", "t" + uuid.uuid4().hex[:10])
        try:
            await proc.said("^serving")
            status, took, text = await proc.stopped()
        finally:
            proc.end()
        print(f"stopped in {took:.1f}s; its output:\n{text}")
        assert status == 0, text
        assert "did not answer" not in text and "not answered" not in text, text
        # nothing in progress: it did not wait out the drain's bound (a generous bound: the machine may be loaded)
        assert took < STOP_DRAIN_S, (took, text)
    finally:
        server.stop()


@pytest.mark.timeout(60)
async def test_a_command_ends_with_nats_frozen_right_after_its_answer(tmp_path):
    """`warmboot workers -o json`, its server frozen once the answer is printed (its last line, before the
    command closes its connection): it ends at once, its answer whole, exit 0. (nats-py's close of a connection
    that has nothing left to send does not wait on the server; one that has is given up after CLOSE_GIVEN_UP_S:
    the next test.)"""
    server = NatsServer(tmp_path / "nats").start()
    prefix = "t" + uuid.uuid4().hex[:10]
    nc = command = None
    registry = Process("serve", "registry", "--nats", server.url, "--prefix", prefix)
    try:
        await registry.said("^serving")
        nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        load = Load(nc, prefix)
        for w in ("w-1", "w-2"):
            await load.register(w)
        command = Process("workers", "--nats", server.url, "--prefix", prefix, "-o", "json")
        await command.said("^]")  # the answer's last line
        os.kill(server.pid, signal.SIGSTOP)
        status = await asyncio.to_thread(command.popen.wait, CLOSE_GIVEN_UP_S + 10)
        await asyncio.to_thread(command._reader.join, 5)
        print(command.text)
        assert status == 0, command.text
        assert '"w-1"' in command.text and '"w-2"' in command.text
    finally:
        if server.running:
            os.kill(server.pid, signal.SIGCONT)
        for p in (command, registry):
            if p is not None:
                p.end()
        if nc is not None:
            await nc.close()
        server.stop()


@pytest.mark.timeout(60)
async def test_a_command_s_close_with_nats_frozen_after_its_answer_is_given_up_within_its_bound(tmp_path):
    """A one-shot command (`cli_common.ask`, every command's connection) whose server froze after its answer
    with the connection's socket buffers full (what the command sent before it ended, here a publisher held
    up): nats-py's close never ends then. `ask` gives it up after CLOSE_GIVEN_UP_S and returns the answer."""
    from warmboot.cli_common import ask

    server = NatsServer(tmp_path / "nats").start()
    frozen = threading.Event()

    async def work(nc):
        answer = await nc.jetstream().account_info()
        os.kill(server.pid, signal.SIGSTOP)
        frozen.set()
        await held_up(nc)
        return answer

    try:
        started = time.monotonic()
        answer = await asyncio.wait_for(asyncio.to_thread(ask, server.url, work), CLOSE_GIVEN_UP_S + 25)
        took = time.monotonic() - started
        print(f"ask ended in {took:.1f}s")
        assert frozen.is_set() and answer.memory is not None
        assert took < CLOSE_GIVEN_UP_S + 20
    finally:
        if server.running:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on", ["thread", "loop"])
async def test_a_store_s_close_with_nats_frozen_ends_within_its_bound(tmp_path, on):
    """A store (its JetStream factory) closed while its server is frozen, its connection's socket buffers full
    (appends sent before the freeze): the close of its link's connection is given up after CLOSE_GIVEN_UP_S,
    said, and the whole within the link's SHUTDOWN_S, on a link of its own thread (`on` "thread": the
    snapshotter's worker-removal process) or on its caller's loop (`links_on`: the services' stores). It waited
    5 s for the close, then up to 10 for the loop and 10 for the thread."""
    from events.jetstream.factory import JetStreamFactory
    from events.jetstream.link import SHUTDOWN_S, links_on

    server = NatsServer(tmp_path / "nats").start()
    env = {"NATS_URL": server.url, "WARMBOOT_PREFIX": "t" + uuid.uuid4().hex[:10]}
    factory = None
    try:
        if on == "loop":
            with links_on(asyncio.get_running_loop()):
                factory = await asyncio.to_thread(JetStreamFactory, env)
        else:
            factory = await asyncio.to_thread(JetStreamFactory, env)
        await asyncio.to_thread(factory.application_recorder)  # connected, its stream made
        link = factory.link
        os.kill(server.pid, signal.SIGSTOP)
        if on == "loop":
            await held_up(link.nc)
        else:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(held_up(link.nc), link.loop))
        given_up = f"did not end within {CLOSE_GIVEN_UP_S:g}s: given up"
        with logged("warmboot.natspy", given_up) as said:
            started = time.monotonic()
            await asyncio.to_thread(factory.close)
            took = time.monotonic() - started
            print(f"the store closed in {took:.1f}s")
            assert took < SHUTDOWN_S + 5, took
            # on the caller's loop the give-up is said on that loop, which the closing thread does not await
            # beyond the link's deadline: under load the close can return first
            await asyncio.wait_for(said.wait(), 10)
        if link.thread is not None:
            await asyncio.to_thread(link.thread.join, 10)
            assert not link.thread.is_alive(), "the link's loop did not end"
    finally:
        if server.running:
            os.kill(server.pid, signal.SIGCONT)
        if factory is not None:
            await asyncio.to_thread(factory.close)
        server.stop()
