"""Running warmboot's services in one process until a signal: used by `serve` and `up`."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import importlib
import logging
import os
import signal
import sys
import threading
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from events.natsauth import redact_url
from events.natspy.connections import CLOSE_GIVEN_UP_S, close_within, closed_for_good, describe_error
from events.subjects import check_prefix, services_inbox
from services.endpoints import drain_until
from services.process import LOOPBACK, metrics_url, serve_metrics
from warmboot.connection import connect

log = logging.getLogger("warmboot")

# How long a stop (SIGTERM, SIGINT) may take, whatever NATS does meanwhile (docs/operations.md, "Stopping"):
# the requests in progress are given STOP_DRAIN_S to be answered, all the services of the process together,
# and the rest of the stop (each service's own, the connection's close: CLOSE_GIVEN_UP_S) is bounded too.
STOP_BOUND_S = 10.0
STOP_DRAIN_S = 5.0
STOP_ANSWER_S = 1.0  # a server that has not answered a round trip this long after the stop began is said not to

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
    answering: list[asyncio.Future] = []  # the round trip to the server sent as the stop begins (`stopping`)
    began: list[float] = []  # when, in the loop's time
    where = redact_url(nats_url)

    async def closing() -> None:  # the last step of the stop: said if the server did not answer meanwhile
        heard = answering[0] if answering else None
        if heard is not None and not heard.done():  # a stop quicker than a round trip: its answer is waited for
            loop = asyncio.get_running_loop()
            await asyncio.wait({heard}, timeout=max(0.0, began[0] + STOP_ANSWER_S - loop.time()))
        if heard is not None and (not heard.done() or heard.cancelled() or heard.exception() is not None):
            why = (describe_error(heard.exception()) if heard.done() and not heard.cancelled()
                   else f"no answer in {asyncio.get_running_loop().time() - began[0]:.1f}s")
            log.warning("stopping: NATS at %s did not answer during the stop (%s): frozen or unreachable; a request "
                        "still in progress was given up after at most %gs (a client's retry with the same request id "
                        "finds what was written)", where, why, STOP_DRAIN_S)
        if heard is not None:
            heard.cancel()
        drain_until(nc, None)
        await close_within(nc, CLOSE_GIVEN_UP_S)  # its server frozen or gone too (nats-py's own close hung, or raised)

    stack.push_async_callback(closing)
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

    async def stopping() -> None:  # the first step of the stop: its bound begins
        loop = asyncio.get_running_loop()
        began.append(loop.time())
        drain_until(nc, began[0] + STOP_DRAIN_S)
        if lost.done() and not lost.cancelled():  # closed for good, said once (`closed`): no server to hear
            return
        if nc.is_connected:
            answering.append(asyncio.ensure_future(nc.flush(timeout=STOP_DRAIN_S)))
            answering[0].add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: `closing` says it
        else:
            answering.append(loop.create_future())  # reconnecting: no answer to wait for
            answering[0].set_exception(ConnectionError("disconnected, reconnecting"))

    stack.push_async_callback(stopping)
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


STOP_GIVEN_UP_EXIT = 1  # the exit status of a process whose stop outlasted its bound (`StopBound`)


class StopBound:
    """The bound of a process's stop (STOP_BOUND_S), kept whatever a step of the stop waits on: armed by the
    stop signal (`stop_signals`), it ends the process `bound_s` later if it still runs, with a line that says
    so and exit status STOP_GIVEN_UP_EXIT (os._exit: no further clean-up; what the process wrote is in the log,
    and a request it had not answered is retried with its request id). Each step of a stop has a bound of its
    own that keeps the whole within it; this one holds if a step waits longer than they allow. Disarmed once
    the process's work ends (a caller in a process that goes on: `warmboot serve` or `up` run in a test)."""

    def __init__(self, what: str, bound_s: float = STOP_BOUND_S) -> None:
        self.what, self.bound_s = what, bound_s
        self._timer: threading.Timer | None = None

    def arm(self) -> None:
        if self._timer is None:
            self._timer = threading.Timer(self.bound_s, self._give_up)
            self._timer.daemon = True
            self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _give_up(self) -> None:
        line = (f"{self.what}: the stop did not end within {self.bound_s:g}s (NATS frozen or unreachable?): "
                f"exiting now, status {STOP_GIVEN_UP_EXIT} (docs/operations.md, \"Running\": stopping)\n")
        with contextlib.suppress(OSError):
            os.write(2, line.encode())
        os._exit(STOP_GIVEN_UP_EXIT)


@contextmanager
def stop_signals(bound: StopBound | None = None) -> Iterator[asyncio.Event]:
    """While in the block, SIGINT or SIGTERM sets the event yielded (a graceful stop); they get
    Python's defaults back when it ends (during the shutdown a second Ctrl-C raises
    KeyboardInterrupt). SIGUSR1 dumps the stacks (`dump_on_signal`).

    Enter it once the services have started and before the process says it serves: a stop
    sent as soon as that line is read (a supervisor, a test) is then handled, not met by the
    default action, and a Ctrl-C during a long start (a replay) still interrupts it.

    `bound`: armed by the signal (`StopBound`), for the caller to disarm once the process's work ends."""
    dump_on_signal()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def stopping() -> None:
        if bound is not None:
            bound.arm()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping)
    try:
        yield stop
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
