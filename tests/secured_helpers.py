"""Helpers for the tests on a server secured by `warmboot nats-config`: users, connections
that collect the server's permission refusals, and `warmboot serve` as a child process."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Iterable

import nats

from events.subjects import services_inbox
from warmboot.nats_config import Identity, identities, nats_auth_config
from warmboot.natsserver import NatsServer, _die_with_parent

WARMBOOT = str(Path(sys.executable).parent / "warmboot")


class Client:
    """A connection as one user, collecting the permission violations the server reports."""

    def __init__(self):
        self.violations: asyncio.Queue[str] = asyncio.Queue()
        self.nc = None

    async def connect(self, url: str, **options) -> "Client":
        async def on_error(error: Exception) -> None:
            if "permissions violation" in str(error).lower():
                self.violations.put_nowait(str(error))

        self.nc = await nats.connect(url, error_cb=on_error, **options)
        return self

    async def violation(self, subject: str) -> str:
        """The server's refusal of `subject` (waits for the -ERR it sends back; the
        client reports it in lower case)."""
        deadline = time.monotonic() + 10  # in all: refusals of other subjects may go on coming
        while True:
            message = await asyncio.wait_for(self.violations.get(), max(deadline - time.monotonic(), 0.001))
            if subject.lower() in message.lower():
                return message

    async def close(self) -> None:
        await self.nc.close()


class Secured:
    """A nats-server with the generated `accounts` block for one prefix.

    `passwords` are random per run, so that a test can grep output for them.
    """

    def __init__(self, store_dir: Path, prefix: str, *, services: str = "svc", workers=(), operators=(),
                 clients=(), auth: str = "password"):
        self.prefix = prefix
        self.services = services
        self.auth = auth
        self.workers, self.operators, self.clients = list(workers), list(operators), list(clients)
        users = [services, *operators, *clients, *workers]
        self.secrets = {u: self.new_secret() for u in users}
        self.config = self._config()
        self.server = NatsServer(store_dir, extra_config=self.config)

    def new_secret(self) -> str:
        """A password, or an nkey seed with `auth="nkey"`."""
        return secrets.token_urlsafe(18) if self.auth != "nkey" else _seed()

    def _config(self) -> str:
        ids: dict[str, Identity] = identities(self.auth, self.secrets)
        return nats_auth_config(self.prefix, self.services, self.workers, self.operators, clients=self.clients, ids=ids)

    async def reload(self, *, rotate: tuple[str, ...] = (), workers: list[str] | None = None) -> None:
        """Give the users in `rotate` new secrets (and, with `workers`, keep only those workers), write
        the configuration again and reload the server (SIGHUP); return once it says it reloaded. From
        then on the old secrets are refused and connections signed in with them are closed."""
        for user in rotate:
            self.secrets[user] = self.new_secret()
        if workers is not None:
            self.workers = list(workers)
        server = self.server
        self.config = server.extra_config = self._config()
        server.config_path.write_text(server.config())
        seen = len(server.log)
        os.kill(server.pid, signal.SIGHUP)
        deadline = time.monotonic() + 20
        while not any("Reloaded server configuration" in line for line in list(server.log)[seen:]):
            assert not any("Failed to reload" in line for line in server.log), list(server.log)[-5:]
            assert time.monotonic() < deadline, "the server did not say it reloaded"
            await asyncio.sleep(0.05)  # polling the server's log with a deadline: it keeps no event to await

    def start(self) -> "Secured":
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def url(self, user: str | None = None) -> str:
        if user is None:
            return self.server.url
        return f"nats://{user}:{self.secrets[user]}@{self.server.host}:{self.server.port}"

    def inbox(self, user: str) -> str:
        """The inbox prefix a user's connection must use to hear its replies."""
        if user == self.services:
            return services_inbox(self.prefix)
        return f"_INBOX.{user}"

    async def connect(self, user: str, **options) -> Client:
        options.setdefault("inbox_prefix", self.inbox(user))
        return await Client().connect(self.url(user), **options)

    def violations(self) -> list[str]:
        """The permission violations the server logged (of the lines it still keeps)."""
        return [line for line in self.server.log if "Violation" in line]


@asynccontextmanager
async def served(secured: Secured, users: Iterable[str], *serve_args: str) -> AsyncIterator[dict[str, Client]]:
    """`secured`'s server started, `warmboot serve all` on its prefix signed in as its services (`--ttl 300`
    and `serve_args`), and a connection of each of `users`, by name; all stopped after, and serve's
    output printed (shown when a test fails)."""
    secured.start()
    serve = Serve("all", "--nats", secured.url(secured.services), "--prefix", secured.prefix, "--ttl", "300",
                  *serve_args)
    conns: dict[str, Client] = {}
    try:
        await asyncio.to_thread(serve.start)
        for user in users:
            conns[user] = await secured.connect(user)
        yield conns
    finally:
        for conn in conns.values():
            await conn.close()
        await asyncio.to_thread(serve.stop)
        secured.stop()
        print(serve.output)


def _seed() -> str:
    from warmboot.nats_config import new_nkey_seed

    return new_nkey_seed()


class Child:
    """A warmboot command as a child process; its whole output (stdout and stderr) kept, line
    by line, and awaitable: `start` returns when a line matches `ready`, `line` when a line
    with that start has been printed (or the process ended without it)."""

    def __init__(self, args: list[str], ready: re.Pattern[str], env: dict[str, str] | None = None):
        self.args = args
        self.ready = ready
        self.env = {**os.environ, **(env or {})}
        self.lines: list[str] = []
        self.process: subprocess.Popen[str] | None = None
        self._changed = threading.Condition()
        self._ended = False
        self._serving = False

    def start(self, timeout: float = 60.0) -> "Child":
        self.process = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env,
            preexec_fn=functools.partial(_die_with_parent, os.getpid()),
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        with self._changed:
            self._changed.wait_for(lambda: self._serving or self._ended, timeout)
        if not self._serving:
            self.stop()
            raise AssertionError(f"{' '.join(self.args[:2])} did not start:\n" + self.output)
        return self

    def _read(self) -> None:
        assert self.process and self.process.stdout
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._serving = self._serving or bool(self.ready.match(line))
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def line(self, start: str, timeout: float = 30.0, anywhere: bool = False, after: int = 0) -> str:
        """The first line that starts with `start` (with `anywhere`, that holds it: a log line
        begins with its time), once printed (a line printed after the ready line may not have
        been read yet when `start` returns); with `after`, among the lines after the first `after`."""
        def found() -> str | None:
            return next((line for line in self.lines[after:]
                         if (start in line if anywhere else line.startswith(start))), None)

        with self._changed:
            self._changed.wait_for(lambda: found() is not None or self._ended, timeout)
            line = found()
        if line is None:
            raise AssertionError(f"no line starting {start!r} in:\n{self.output}")
        return line

    def signal(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig`, wait for the process and its whole output; its exit code."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:  # stuck: what it waits on goes into the output, then kill
                self.dump(timeout=10)
                self.process.kill()
                self.process.wait()
                print(f"{' '.join(self.args[:2])} did not end within {timeout:g}s of signal {sig}; killed. Its output:\n"
                      + self.output, flush=True)
        self._reader.join(10)  # the whole output, to its last line
        return self.process.returncode

    def stop(self, timeout: float = 30.0) -> int:
        return self.signal(signal.SIGTERM, timeout)

    def dump(self, timeout: float = 10.0) -> bool:
        """Have a running `warmboot serve|up` print every task's stack (`warmboot.runner.dump_tasks`)
        into its output; whether the dump ended within `timeout`."""
        from warmboot.runner import DUMP_HEADER, DUMP_SIGNAL

        if self.process is None or self.process.poll() is not None:
            return False
        with self._changed:
            seen = len(self.lines)
        self.process.send_signal(DUMP_SIGNAL)

        def dumped() -> bool:
            return any(line.startswith(f"{DUMP_HEADER}: end") for line in self.lines[seen:])

        with self._changed:
            self._changed.wait_for(lambda: self._ended or dumped(), timeout)
            return dumped()  # not a process that ended instead (the signal's default action)


class Serve(Child):
    """`warmboot serve ARGS` as a child process, ready once it says what it serves."""

    SERVING = re.compile(r"^serving (.+) on (\S+) \(prefix (\S+)\)")

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        super().__init__([WARMBOOT, "serve", *args], self.SERVING, env)
