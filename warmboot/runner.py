"""Running warmboot's services in one process until a signal: used by `serve` and `up`."""

from __future__ import annotations

import asyncio
import faulthandler
import importlib
import logging
import signal
import sys
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from events.natsauth import redact_url
from events.natspy.connections import close, closed_for_good
from events.subjects import check_prefix, services_inbox
from services.process import LOOPBACK, metrics_url, serve_metrics
from warmboot.connection import connect

log = logging.getLogger("warmboot")

# name -> "module:Class"; each class takes (nc, *, nats_url, prefix) and has async start()/stop(), and
# may have `failed`: a future done, with the reason, once the service cannot serve any more (`until_stopped`).
SERVICES: dict[str, str] = {
    "registry": "services.registry.service:RegistryService",
    "snapshotter": "services.snapshotter.service:SnapshotterService",
    "scheduler": "services.scheduler.service:SchedulerService",
}


def service_class(name: str) -> type:
    module, _, cls = SERVICES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


@dataclass
class Running:
    """Services started in this process, and where they can be reached."""

    nats_url: str = field(repr=False)  # may hold a password: show `where`
    prefix: str
    names: list[str]
    metrics_port: int | None
    services: list[Any] = field(default_factory=list)
    metrics_host: str = LOOPBACK
    # done, with the reason, once nats-py has closed the services' connection for good (`until_stopped`)
    connection_lost: asyncio.Future | None = field(default=None, repr=False)

    @property
    def where(self) -> str:
        return redact_url(self.nats_url)

    @property
    def metrics_url(self) -> str | None:
        return metrics_url(self.metrics_host, self.metrics_port) if self.metrics_port else None


async def start_services(
    stack: AsyncExitStack,
    names: list[str],
    nats_url: str,
    prefix: str,
    metrics_port: int | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    metrics_host: str = LOOPBACK,
) -> Running:
    """Start `names` (in registry, snapshotter, scheduler order); `stack` stops them in reverse.

    Their connection uses the services' inbox prefix (`services_inbox`), as their
    event store does (`store_env`).
    """
    check_prefix(prefix)
    options = options or {}
    lost: asyncio.Future = asyncio.get_running_loop().create_future()
    made: list[Any] = []

    async def closed() -> None:  # nats-py closed it: on a server's -ERR it never reconnects (closed_for_good)
        if made and not lost.done():
            reason = closed_for_good(made[0], "the services'")
            log.error("%s", reason)
            lost.set_result(reason)

    nc = await connect(nats_url, f"warmboot-{'+'.join(names)}", inbox_prefix=services_inbox(prefix), closed_cb=closed)
    made.append(nc)
    stack.push_async_callback(close, nc)  # its server gone too (nats-py's own close raised then)
    stack.callback(lambda: lost.done() or lost.cancel())  # closed by the stop, first: no failure
    metrics = serve_metrics(metrics_port, metrics_host)
    if metrics is not None:  # stopped with the services: in-process callers (tests, `up`) go on after
        stack.callback(metrics.close)
    running = Running(nats_url, prefix, names, metrics and metrics.port, metrics_host=metrics_host,
                      connection_lost=lost)
    for name in names:
        service = service_class(name)(nc, nats_url=nats_url, prefix=prefix, **options.get(name, {}))
        await service.start()
        stack.push_async_callback(service.stop)
        running.services.append(service)
        log.info("%s serving on %s (prefix %s)", name, running.where, prefix)
    return running


async def until_stopped(stop: asyncio.Event, running: Running) -> str | None:
    """Wait for `stop` (a stop signal, `stop_signals`) or for a service of `running` to fail (its
    `failed` future done: a service whose event stream was made again or restored); the failure's reason,
    or None for a stop. The caller stops the services either way, and ends with a failure status
    after a failure (the service has logged why)."""
    failures = [f for service in running.services if (f := getattr(service, "failed", None)) is not None]
    if running.connection_lost is not None:
        failures.append(running.connection_lost)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([stopped, *failures], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    return next((f.result() for f in failures if f.done() and not f.cancelled()), None)


DUMP_SIGNAL = signal.SIGUSR1
DUMP_HEADER = "--- warmboot: every task and thread"


def dump_tasks() -> None:
    """Print the stack of every asyncio task and every thread to stderr: what a process
    that does not stop, or does not answer, is waiting on."""
    tasks = asyncio.all_tasks()
    print(f"{DUMP_HEADER} ({len(tasks)} tasks) ---", file=sys.stderr)
    for task in sorted(tasks, key=lambda t: t.get_name()):
        print(f"task {task.get_name()}:", file=sys.stderr)
        task.print_stack(file=sys.stderr)
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    print(f"{DUMP_HEADER}: end ---", file=sys.stderr, flush=True)


def dump_on_signal() -> None:
    """From here on, until the running loop closes (through the shutdown too), SIGUSR1 prints
    every task's and thread's stack (`dump_tasks`): call it first, so that a start that hangs
    can be asked where (its default action would end the process)."""
    asyncio.get_running_loop().add_signal_handler(DUMP_SIGNAL, dump_tasks)


@contextmanager
def stop_signals() -> Iterator[asyncio.Event]:
    """While in the block, SIGINT or SIGTERM sets the event yielded (a graceful stop); they get
    Python's defaults back when it ends (during the shutdown a second Ctrl-C raises
    KeyboardInterrupt). SIGUSR1 dumps the stacks (`dump_on_signal`).

    Enter it once the services have started and before the process says it serves: a stop
    sent as soon as that line is read (a supervisor, a test) is then handled, not met by the
    default action, and a Ctrl-C during a long start (a replay) still interrupts it."""
    dump_on_signal()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
