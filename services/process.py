"""A serving process: its collector (`tune_gc`), its event loop (`run_serving`), its metrics server
(`serve_metrics`), and the environment of its services' event store (`store_env`) and of the
streams and buckets they create (`stream_replicas`).
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
from typing import Awaitable, Callable, NamedTuple, TypeVar

from events.subjects import services_inbox

log = logging.getLogger("warmboot.service")
T = TypeVar("T")


# A serving process's collector (`tune_gc`). Python's default collects the youngest generation
# every 700 net allocations: at thousands of requests a second in flight, a request's objects
# (its message, task, futures) are still alive at a collection, survive two of them, and count
# toward a full collection, which then walks the whole heap (20 to 30 ms at 10,000 workers in
# the registry, about three times in two seconds of heartbeats). Collected every 50,000, they
# are mostly freed by their reference counts first, and a full collection is much rarer
# (bench/registry.py: heartbeat p99 36 to 42 ms against 51 to 61, README).
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """For a process that serves (`warmboot serve`, `warmboot up`, the benches' serving
    processes), once its services have started: what the start loaded (modules, the state
    folded from the log) is moved out of the collector's sight (`gc.freeze`: still freed by
    reference counting, but a reference cycle among those objects that becomes garbage later
    is never collected; they are modules, connections and state that live as long as the
    process), and the thresholds become GC_THRESHOLDS."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


# The event loop a serving process runs on (`run_serving`): uvloop, libuv's loop, unless the
# environment says WARMBOOT_EVENT_LOOP=asyncio. What a wake-up of the loop costs is most of what
# a small request costs a service (docs/scaling.md, "The event loop"), and uvloop's is smaller.
EVENT_LOOP_ENV = "WARMBOOT_EVENT_LOOP"
EVENT_LOOPS = ("uvloop", "asyncio")


def serving_loop(choice: str | None = None) -> tuple[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The event loop `run_serving` runs on: its name, and the factory that makes one.

    `choice` (else WARMBOOT_EVENT_LOOP) names it: `uvloop`, the default, or `asyncio`; any other
    value is a ValueError naming the variable. uvloop not installed (a platform without its
    wheels): asyncio's loop, unless uvloop was asked for by name."""
    named = choice if choice is not None else os.environ.get(EVENT_LOOP_ENV, "")
    if named not in ("", *EVENT_LOOPS):
        raise ValueError(f"{EVENT_LOOP_ENV}={named!r}: expected one of {', '.join(EVENT_LOOPS)}")
    if named != "asyncio":
        try:
            import uvloop
        except ImportError:
            if named:
                raise ValueError(f"{EVENT_LOOP_ENV}=uvloop, but uvloop is not installed") from None
        else:
            return "uvloop", uvloop.new_event_loop
    return "asyncio", asyncio.new_event_loop


def run_serving(main: Callable[[], Awaitable[T]], loop: str | None = None) -> T:
    """`asyncio.run(main())` on the serving event loop (`serving_loop(loop)`): what `warmboot
    serve`, `warmboot up` and the benches' serving processes run on. Threads that make loops of
    their own (the event store's link for synchronous callers) keep asyncio's. Unlike
    `asyncio.run`, the loop is not made the thread's current loop outside `main`."""
    name, factory = serving_loop(loop)  # a bad choice is refused before anything starts
    log.info("event loop: %s", name)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


def stream_replicas() -> int:
    """Replicas of the streams and buckets a service creates: WARMBOOT_STREAM_REPLICAS, else 1."""
    return int(os.environ.get("WARMBOOT_STREAM_REPLICAS") or 1)


def store_env(nats_url: str, prefix: str, replicas: int | None = None) -> dict[str, str]:
    """The eventsourcing environment that selects the JetStream event store for a deployment.

    Without `replicas`, the stream's replica count comes from the process environment
    (WARMBOOT_STREAM_REPLICAS, which `warmboot serve --replicas` sets), else 1. So do
    credentials not in the URL (NATS_NKEY_SEED, NATS_USER, ...: events.jetstream).
    """
    env = {"PERSISTENCE_MODULE": "events.jetstream", "NATS_URL": nats_url, "WARMBOOT_PREFIX": prefix,
           "NATS_INBOX_PREFIX": services_inbox(prefix)}  # the services' inboxes (docs/security.md)
    if replicas is not None:
        env["WARMBOOT_STREAM_REPLICAS"] = str(replicas)
    return env


# --- metrics --------------------------------------------------------------------------


LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "::"  # IPv6's and, dual-stack as Linux has it by default, IPv4's too
IPV4_INTERFACES = "0.0.0.0"  # where a host has no IPv6


class Metrics(NamedTuple):
    """Metrics being served: the port, and how to stop (the server's thread ends, its port is free)."""

    port: int
    close: Callable[[], None]


def serve_metrics(port: int | None, host: str = LOOPBACK) -> Metrics | None:
    """Serve prometheus-client's default registry on `host`:`port` (0: any free port), until closed.
    On every interface (ALL_INTERFACES) of a host without IPv6, on every IPv4 one."""
    if port is None:
        return None
    from prometheus_client import start_http_server

    try:
        try:
            server, _thread = start_http_server(port, addr=host)
        except OSError as e:
            if host != ALL_INTERFACES or e.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise
            server, _thread = start_http_server(port, addr=IPV4_INTERFACES)
    except OSError as e:  # said as what it is: the caller's option, not a traceback of the http server
        raise OSError(e.errno, f"cannot serve metrics on {host}:{port}: {e.strerror or e}"
                               + ("; try another --metrics-port, or 0 for any free one" if port else "")) from None

    def close() -> None:
        server.shutdown()
        server.server_close()

    return Metrics(server.server_port, close)


def metrics_url(host: str, port: int) -> str:
    """The URL a scraper uses: for a server on every interface, this host's name (no DNS
    look-up: the name as the host knows itself)."""
    if host in (ALL_INTERFACES, IPV4_INTERFACES, ""):
        import socket

        host = socket.gethostname()
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"
