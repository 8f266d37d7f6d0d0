"""The embedded nats-server: starts, serves JetStream, stops with SIGTERM, and leaves no
process behind, also when its parent is killed with SIGKILL."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import nats
import pytest
from nats.js.api import StreamConfig

from warmboot.natsserver import (
    NatsCluster,
    NatsServer,
    NatsServerError,
    StoreInUse,
    _ephemeral_floor,
    free_port,
    server_binary,
    wait_jetstream,
)

ROOT = Path(__file__).resolve().parent.parent


def alive(pid: int) -> bool:
    """True while `pid` is a running (not zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def wait_gone(pid: int, timeout: float = 20.0) -> bool:
    """Wait for `pid` to exit: a pidfd becomes readable when the process ends (an event,
    not a poll). The process is not our child, so waitpid cannot be used."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    return bool(readable) or not alive(pid)


def servers_using(config_path: Path) -> list[int]:
    """Running nats-server processes started with this config file."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(config_path).encode() in argv and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


async def test_starts_serves_jetstream_and_stops_with_sigterm(tmp_path):
    server = NatsServer(tmp_path).start()
    pid = server.pid
    assert server.running and alive(pid)
    assert Path(f"/proc/{pid}/exe").resolve() == Path(server_binary()).resolve()
    assert server.host == "127.0.0.1" and server.url == f"nats://127.0.0.1:{server.port}"

    nc = await nats.connect(server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="PROBE", subjects=["probe.>"]))
        ack = await js.publish("probe.one", b"hello")
        assert (ack.stream, ack.seq) == ("PROBE", 1)
        msg = await js.get_msg("PROBE", 1)
        assert msg.data == b"hello"
        assert (await js.account_info()).streams == 1
    finally:
        await nc.close()
    assert (tmp_path / server.name / "jetstream").is_dir()  # JetStream stores under store_dir

    server.stop()
    assert not server.running
    assert not alive(pid)
    assert servers_using(server.config_path) == []
    # (not "the port refuses connections": other tests may take a freed port at once)
    server.stop()  # stopping twice is harmless


async def test_each_write_is_on_disk_before_its_ack(tmp_path):
    """The server syncs every write before acknowledging it (`sync_interval: always`), as its own
    monitoring says: nats-server's default syncs every 2 minutes, and its atomic batches sync only their
    staging files (strace, nats-server 2.15.1), so a machine crash lost acknowledged events, a
    placement's among them (docs/operations.md, Durability). A cluster member's configuration is the same."""
    monitor = free_port()
    server = NatsServer(tmp_path, extra_config=f"http: 127.0.0.1:{monitor}").start()
    try:
        varz = await asyncio.to_thread(
            lambda: json.loads(urllib.request.urlopen(f"http://127.0.0.1:{monitor}/varz", timeout=10).read()))
    finally:
        server.stop()
    assert varz["jetstream"]["config"]["sync_always"] is True
    member = NatsCluster(tmp_path / "cluster").node("n1")
    assert "sync_interval: always" in member.config().split("jetstream {")[1].split("}")[0]


async def test_stop_is_a_graceful_sigterm(tmp_path):
    server = NatsServer(tmp_path).start()
    process = server.process
    server.stop()
    # SIGTERM lets nats-server shut down on its own: it exits rather than being killed
    assert process.returncode in (0, -signal.SIGTERM)
    assert any("Server Exiting" in line or "Initiating Shutdown" in line for line in server.log)


async def test_restart_keeps_the_jetstream_store(tmp_path):
    server = NatsServer(tmp_path, port=free_port()).start()
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="KEEP", subjects=["keep.>"]))
        await js.publish("keep.a", b"1")
        await nc.close()
        server.restart()
        nc = await nats.connect(server.url)
        msg = await nc.jetstream().get_msg("KEEP", 1)
        assert msg.data == b"1"
        await nc.close()
    finally:
        server.stop()


def test_a_server_that_cannot_start_is_an_error_not_a_hang(tmp_path, nats_server):
    taken = NatsServer(tmp_path, port=nats_server.port)
    started = time.monotonic()
    with pytest.raises(NatsServerError, match="exited before it was ready") as caught:
        taken.start(timeout=20)
    assert "address already in use" in str(caught.value)  # the log's tail says why
    assert time.monotonic() - started < 15  # noticed the exit, did not wait out the timeout
    assert not taken.running


def listening_on(port: int) -> socket.socket:
    """Another program's listener on `port`: what takes a chosen port before the server binds it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_chosen_ports_are_outside_the_range_outgoing_connections_take():
    """A port the kernel may give an outgoing connection could be taken by any client between
    the choice and the server's bind (a CI run lost a cluster's start so); chosen ports are below."""
    floor = _ephemeral_floor()
    ports = {free_port() for _ in range(50)}
    assert all(port < floor for port in ports), sorted(ports)
    assert len(ports) > 1  # chosen at random, not one port for everyone
    # and it is free: the server can bind it
    listening_on(ports.pop()).close()


@pytest.mark.parametrize("floor", [1024, 1000])
def test_a_host_whose_ephemeral_range_starts_low_gets_the_kernel_s_choice(monkeypatch, floor):
    """net.ipv4.ip_local_port_range tuned to start at 1024 or lower leaves no port below it: the
    kernel chooses (randrange of an empty range was a ValueError: a review)."""
    from warmboot import natsserver

    monkeypatch.setattr(natsserver, "_ephemeral_floor", lambda: floor)
    listening_on(free_port()).close()


def test_a_store_is_one_server_s_while_it_runs_and_free_once_it_stops(tmp_path):
    first = NatsServer(tmp_path, name="one").start()
    try:
        second = NatsServer(tmp_path, name="one")
        with pytest.raises(NatsServerError, match=rf"the store {tmp_path / 'one'} is in use by another nats-server "
                                                  rf"\(started by process {os.getpid()}\)"):
            second.start()
        assert not second.running
        other = NatsServer(tmp_path, name="two").start()  # another store in the same directory: a cluster's way
        other.stop()
    finally:
        first.stop()
    NatsServer(tmp_path, name="one").start().stop()  # stopped: free


def test_a_store_reset_keeps_its_lock_from_before_the_wipe_until_the_server_stops(tmp_path):
    """`warmboot up --reset` takes the store's lock before it wipes the store and holds it into the
    start: a server starting on the store meanwhile is refused (it looked, then wiped: another
    `up` could start between the two; and the wipe removed the lock file itself, so a second
    server took a new one beside the held one)."""
    sibling = NatsServer(tmp_path, name="n2")  # a cluster's member beside it, its store held
    sibling.lock_store()
    first = NatsServer(tmp_path, name="warmboot")
    first.lock_store()
    try:
        (tmp_path / "warmboot").mkdir()
        (tmp_path / "warmboot" / "old-log").write_text("x")
        (tmp_path / "warmboot.conf").write_text("x")
        (tmp_path / "n2").mkdir()
        assert first.has_store
        first.reset_store()
        assert not first.has_store
        assert sorted(p.name for p in tmp_path.iterdir()) == ["n2", "n2.lock", "warmboot.lock"]  # its own gone
        with pytest.raises(StoreInUse):
            NatsServer(tmp_path, name="n2").start()  # the sibling's lock still holds
        with pytest.raises(StoreInUse) as taken:
            NatsServer(tmp_path, name="warmboot").start()
        assert taken.value.holder == str(os.getpid())
        first.start()  # the lock it holds is its own
    finally:
        first.stop()
        sibling.stop()
    NatsServer(tmp_path, name="warmboot").start().stop()  # stopped: free


def test_a_first_start_whose_chosen_port_was_taken_chooses_again(tmp_path):
    server = NatsServer(tmp_path)
    taken = server.port
    with listening_on(taken):
        try:
            server.start()
            assert server.running and server.port != taken
            assert accepts_connections(server.port)
        finally:
            server.stop()


def test_a_restart_keeps_its_port_even_when_it_was_chosen(tmp_path):
    """Clients know a started server by its port: a restart never moves it, taken or not."""
    server = NatsServer(tmp_path).start()
    port = server.port
    server.stop()
    with listening_on(port):
        with pytest.raises(NatsServerError, match="address already in use"):
            server.start(timeout=20)
    assert server.port == port and not server.running


def test_a_cluster_whose_route_port_was_taken_starts_on_ports_chosen_again(tmp_path):
    cluster = NatsCluster(tmp_path)
    member = cluster.nodes[-1]
    taken = member.cluster_port
    with listening_on(taken):
        with cluster:
            assert member.cluster_port != taken and all(node.running for node in cluster.nodes)
            for node in cluster.nodes:  # every member routes to the others' ports as they are now
                others = {f"nats://127.0.0.1:{o.cluster_port}" for o in cluster.nodes if o is not node}
                assert set(node.routes) == others
                assert accepts_connections(node.port)
            asyncio.run(wait_jetstream(cluster.url))  # routed: the members elected a meta leader


async def test_waiting_for_jetstream_on_a_server_that_never_greets_ends_within_its_timeout():
    """The wait's timeout covers the connect: a port that accepts and says nothing (a server
    stuck in its start, another program) is an error after the timeout, not a wait for good."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        with pytest.raises(NatsServerError, match="took a connection within 1.0s"):
            # the outer bound only turns a regression (it waited for good) into a failure, not a hung suite
            await asyncio.wait_for(wait_jetstream(f"nats://127.0.0.1:{silent.getsockname()[1]}", timeout=1.0), 60)


async def test_the_session_server_answers_jetstream(nc, prefix):
    js = nc.jetstream()
    info = await js.add_stream(StreamConfig(name=prefix.upper(), subjects=[f"{prefix}.>"]))
    assert info.config.name == prefix.upper()
    await js.publish(f"{prefix}.x", b"x")
    assert (await js.stream_info(prefix.upper())).state.messages == 1
    await js.delete_stream(prefix.upper())


CHILD = textwrap.dedent(
    """
    import sys
    from warmboot.natsserver import NatsServer

    server = NatsServer(sys.argv[1]).start()
    print(server.pid, server.port, flush=True)
    sys.stdin.read()  # until the test kills us
    """
)


async def publish_acked(url: str, data: bytes) -> None:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="KEEP", subjects=["keep.>"]))
        await js.publish("keep.a", data)
    finally:
        await nc.close()


async def read_kept(url: str) -> bytes:
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().get_msg("KEEP", 1)).data
    finally:
        await nc.close()


@pytest.mark.parametrize("frozen", [False, True])
def test_parent_killed_with_sigkill_leaves_no_orphan(tmp_path, frozen):
    """Its parent killed (SIGKILL), the server dies too (its parent-death signal). Frozen (SIGSTOP) as its
    parent dies, it is killed all the same: a SIGTERM would be held until someone resumed it, the frozen server
    keeping its port and its store (then resumed, it would stop gracefully, writing its state into a store
    another server may use by then). Killed so, what it acknowledged is there at the next start on its store."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        line = child.stdout.readline()
        assert line, "the child did not start its nats-server"
        server_pid, port = map(int, line.split())
        assert alive(server_pid) and accepts_connections(port)
        config = next(tmp_path.glob("*.conf"))
        assert servers_using(config) == [server_pid]
        if frozen:
            asyncio.run(publish_acked(f"nats://127.0.0.1:{port}", b"acked"))
            os.kill(server_pid, signal.SIGSTOP)

        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)

        assert wait_gone(server_pid), f"nats-server {server_pid} outlived its killed parent"
        assert servers_using(config) == []
        if frozen:
            server = NatsServer(tmp_path, port=port).start()  # its store: recovered from the crash
            try:
                assert asyncio.run(read_kept(server.url)) == b"acked"
            finally:
                server.stop()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pid in servers_using(next(tmp_path.glob("*.conf"), tmp_path / "none")):
            os.kill(pid, signal.SIGKILL)  # only if the test failed: the server this test started


def test_a_frozen_server_is_stopped_by_its_sigterm_within_the_timeout(tmp_path):
    """`stop_process` of a server frozen by SIGSTOP resumes it (SIGCONT) with the SIGTERM: it shuts down on
    its own, as `test_stop_is_a_graceful_sigterm`, not killed once the timeout is out (the SIGTERM held
    meanwhile). A generous timeout: it is the SIGTERM that ends it, not the timeout's SIGKILL."""
    server = NatsServer(tmp_path).start()
    process = server.process
    try:
        os.kill(server.pid, signal.SIGSTOP)
        server.stop_process(timeout=30)
        assert not server.running
        assert process.returncode in (0, -signal.SIGTERM), process.returncode
        assert any("Server Exiting" in line or "Initiating Shutdown" in line for line in server.log)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        server.stop()
