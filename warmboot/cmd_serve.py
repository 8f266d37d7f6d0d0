"""`warmboot serve`: run one service, or all of them, against an existing NATS server."""

from __future__ import annotations

import logging
import math
import os
from contextlib import AsyncExitStack

import click
from click.core import ParameterSource
from eventsourcing.persistence import OperationalError

from events.natsauth import NKEY_SEED_ENV
from events.subjects import DEFAULT_PREFIX
from services.process import ALL_INTERFACES, run_serving, tune_gc
from services.registry.binding import UNBIND
from services.registry.budget import DEFAULT_BURST, DEFAULT_INTERVAL_S as WRITE_INTERVAL_S, WriteBudget
from services.registry.nodes import describe, load_nodes
from warmboot.cli_common import (SIGN_IN_ENV_HELP, FloatRange, IntRange, check_nats_option, check_nkey_seed_option,
                                 check_prefix_option, event_loop_option)
from services.scheduler.checkpoint import DEFAULT_EVERY_EVENTS, DEFAULT_INTERVAL_S
from warmboot.runner import SERVICES, StopBound, dump_on_signal, start_services, stop_signals, until_stopped


# Options only one service reads, by parameter: (that service, the option). Given on the command
# line to a `serve` that does not run that service, they are refused rather than ignored; from the
# environment (shared by every service of a deployment) they are ignored where not read.
SERVICE_OPTIONS = {
    "ttl_s": ("registry", "--ttl"),
    "worker_nodes_path": ("registry", "--worker-nodes"),
    "worker_writes": ("registry", "--worker-writes"),
    "worker_write_interval_s": ("registry", "--worker-write-interval"),
    "checkpoint_every": ("scheduler", "--checkpoint-every"),
    "checkpoint_interval_s": ("scheduler", "--checkpoint-interval"),
}


def check_ttl(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """click callback: a TTL the registry takes (a finite number of seconds, at least 1)."""
    if not math.isfinite(value) or value < 1:
        raise click.BadParameter(f"{value:g} is not a number of seconds of at least 1")
    return value


def check_interval(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """click callback: a positive, finite number of seconds."""
    if not math.isfinite(value) or value <= 0:
        raise click.BadParameter(f"{value:g} is not a positive number of seconds")
    return value


@click.command()
@click.argument("service", type=click.Choice([*SERVICES, "all"]))
@click.option("--nats", "nats_url", default="nats://127.0.0.1:4222", show_default=True,
              callback=check_nats_option,
              envvar="NATS_URL", show_envvar=True,
              help="NATS server URL(s); credentials as nats://USER:PASSWORD@HOST:PORT, best given in $NATS_URL (a process's arguments are visible to every user)." + SIGN_IN_ENV_HELP)
@click.option("--nkey-seed", type=click.Path(exists=True, dir_okay=False), default=None, envvar=NKEY_SEED_ENV,
              show_envvar=True, callback=check_nkey_seed_option, help="Sign in with the nkey seed in this file (warmboot nats-config --auth nkey).")
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, envvar="WARMBOOT_PREFIX", show_envvar=True,
              callback=check_prefix_option, help="Subject prefix of the deployment.")
@click.option("--metrics-port", type=IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on this port (0: any free port)  [default: none, no metrics]")
@click.option("--metrics-host", default=ALL_INTERFACES, show_default=True,
              help="Interface the metrics are served on (all by default, for a Prometheus on another host).")
@click.option("--ttl", "ttl_s", type=float, default=15.0, show_default=True, callback=check_ttl,
              help="Registry: seconds of silence after which a worker is removed as LOST (at least 1; "
                   "heartbeat TTLs are whole seconds, so a fraction is rounded up).")
@click.option("--worker-nodes", "worker_nodes_path", type=click.Path(dir_okay=False), default=None,
              envvar="WARMBOOT_WORKER_NODES", show_envvar=True,
              help="Registry: JSON file of worker id -> node (`nats-config --worker ID@NODE --worker-nodes FILE`): "
                   "every registry replica, with this option or without, then lets a worker register only on its "
                   "own node, and only if listed, and removes one registered elsewhere; `none` removes the binding. "
                   "Give it to the one replica that changes the binding: the file given last wins "
                   "(docs/security.md).")
@click.option("--worker-writes", type=IntRange(min=0), default=DEFAULT_BURST, show_default=True,
              envvar="WARMBOOT_WORKER_WRITES", show_envvar=True,
              help="Registry: writes the requests about one worker (a registration, a refused one's mark, a "
                   "drain that changes nothing) may make at once, in each replica; past them such a request is refused "
                   "RESOURCE_EXHAUSTED, nothing written, until the budget refills (--worker-write-interval). "
                   "0: no limit (docs/security.md).")
@click.option("--worker-write-interval", "worker_write_interval_s", type=float, callback=check_interval,
              default=WRITE_INTERVAL_S, show_default=True, envvar="WARMBOOT_WORKER_WRITE_INTERVAL", show_envvar=True,
              help="Registry: seconds in which a worker earns back one write of --worker-writes.")
@click.option("--replicas", type=IntRange(1, 5), default=None, envvar="WARMBOOT_STREAM_REPLICAS",
              show_envvar=True, help="Replica count of the event stream when this process creates it (3 on a cluster)  "
                                     "[default: 1]")
@click.option("--checkpoint-every", type=IntRange(min=0), default=DEFAULT_EVERY_EVENTS, show_default=True,
              help="Scheduler: save a projection checkpoint every N events folded (0: no checkpoints, "
                   "a new replica replays the whole log).")
@click.option("--checkpoint-interval", "checkpoint_interval_s", type=FloatRange(min=0),
              default=DEFAULT_INTERVAL_S, show_default=True,
              help="Scheduler: also save one after this many seconds if anything was folded (0: off).")
@event_loop_option
def serve(service: str, nats_url: str, nkey_seed: str | None, prefix: str, metrics_port: int | None,
          metrics_host: str, ttl_s: float, worker_nodes_path: str | None, worker_writes: int,
          worker_write_interval_s: float, replicas: int | None, checkpoint_every: int,
          checkpoint_interval_s: float, event_loop: str | None) -> None:
    """Run SERVICE (registry, snapshotter, scheduler, or all) until SIGINT/SIGTERM.

    NATS URLs may be a comma-separated list (the members of a cluster).
    """
    names = list(SERVICES) if service == "all" else [service]
    ctx = click.get_current_context()
    for param, (owner, flag) in SERVICE_OPTIONS.items():
        if owner not in names and ctx.get_parameter_source(param) is ParameterSource.COMMANDLINE:
            raise click.UsageError(f"{flag} is the {owner}'s option: `serve {service}` does not run the {owner}")
    registry: dict = {"ttl_s": ttl_s, "writes": WriteBudget(worker_writes, worker_write_interval_s)}
    if worker_nodes_path == UNBIND:
        registry["worker_nodes"] = UNBIND
    elif worker_nodes_path is not None and "registry" in names:
        try:
            registry["worker_nodes"] = load_nodes(worker_nodes_path)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="'--worker-nodes'") from None
        if not registry["worker_nodes"]:  # it would remove every worker registered, at once
            raise click.BadParameter(f"{worker_nodes_path} binds no worker: no worker could register, and every one "
                                     "registered would be removed (`none` removes the binding)",
                                     param_hint="'--worker-nodes'")
    if replicas is not None:
        os.environ["WARMBOOT_STREAM_REPLICAS"] = str(replicas)
    if nkey_seed is not None:  # the services' connection and their event store sign with it
        os.environ[NKEY_SEED_ENV] = os.path.abspath(nkey_seed)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def run() -> str | None:
        async with AsyncExitStack() as stack:
            dump_on_signal()
            running = await start_services(
                stack, names, nats_url, prefix, metrics_port,
                {"registry": registry,
                 "scheduler": {"checkpoint_every": checkpoint_every, "checkpoint_interval_s": checkpoint_interval_s}},
                metrics_host=metrics_host,
            )
            tune_gc()
            with stop_signals(bound) as stop:  # before the line that says it serves: see stop_signals
                click.echo(f"serving {', '.join(names)} on {running.where} (prefix {prefix})")
                if "registry" in names:
                    # the binding it serves with (another replica's, maybe)
                    click.echo(describe(running.services[names.index("registry")].binding.nodes))
                if running.metrics_url:
                    click.echo(f"metrics on {running.metrics_url}")
                failed = await until_stopped(stop, running)
            click.echo("stopping")
        return failed

    bound = StopBound(f"warmboot serve {service}")
    try:
        failed = run_serving(run, event_loop)
    except (OSError, OperationalError) as e:  # a store not to be had (credentials that may not make it): one line
        raise click.ClickException(str(e)) from None
    finally:
        bound.disarm()
    if failed is not None:  # a service could not go on (it logged why): a supervisor sees a failure
        raise SystemExit(1)
