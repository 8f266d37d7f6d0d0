"""`warmboot agent` (a worker's agent) and `warmboot nats-config` (who may say what on the bus)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import signal
from pathlib import Path

import click

from events.codec import encode
from events.errors import ContractError
from events.probe import ARCHITECTURES, DEFAULT_CPUINFO
from events.schema import ID_PATTERN
from events.subjects import DEFAULT_PREFIX, check_prefix, events_filter, stream_name
from warmboot.agent import Agent, ConfigError, ProbeSettings, load_registration

_ID = re.compile(ID_PATTERN)


def _check_id(ctx: click.Context, param: click.Parameter, value):
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if v is not None and not _ID.match(v):
            raise click.BadParameter(f"{v!r} must match {ID_PATTERN} (one NATS subject token)")
    return value


def _check_prefix(ctx: click.Context, param: click.Parameter, value: str) -> str:
    try:
        return check_prefix(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


# --- warmboot agent -------------------------------------------------------------------------


@click.command("agent")
@click.option("--nats", "nats_url", default="nats://127.0.0.1:4222", show_default=True, envvar="NATS_URL",
              help="NATS server URL; credentials as nats://USER:PASSWORD@HOST:PORT.")
@click.option("--worker-id", required=True, callback=_check_id, help="This worker's id (one subject token).")
@click.option("--node", required=True, callback=_check_id, help="The node (machine) this worker runs on.")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="TOML file: capacity, labels, sandbox classes (see examples/agent.toml). Watched for edits.")
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, envvar="WARMBOOT_PREFIX",
              callback=_check_prefix, help="Subject prefix of the deployment.")
@click.option("--drain-on-exit", is_flag=True, help="Drain the worker on SIGTERM/SIGINT before stopping.")
@click.option("--watch-interval", "watch_interval_s", type=click.FloatRange(min=0.05), default=1.0,
              show_default=True, help="Seconds between checks of the config file for edits.")
@click.option("--cpuinfo", "cpuinfo_path", type=click.Path(path_type=Path), default=DEFAULT_CPUINFO,
              show_default=True, help="cpuinfo file the probe reads.")
@click.option("--arch", type=click.Choice(ARCHITECTURES), default=None,
              help="Architecture the probe reports [default: this machine's].")
@click.option("--print-registration", is_flag=True,
              help="Print the registration the config makes on this machine, as JSON, and exit.")
@click.option("-v", "--verbose", is_flag=True, help="Log at DEBUG level.")
def agent(
    nats_url: str,
    worker_id: str,
    node: str,
    config_path: Path,
    prefix: str,
    drain_on_exit: bool,
    watch_interval_s: float,
    cpuinfo_path: Path,
    arch: str | None,
    print_registration: bool,
    verbose: bool,
) -> None:
    """Register this worker's runtimes with the registry and keep it alive.

    Probes the CPU, registers, heartbeats at a third of the registry's TTL,
    re-registers when the config file changes (a rolling upgrade: make v2 the
    default, move v1 to restorable_runtimes), reconnects after a NATS restart, and
    on SIGTERM drains the worker if --drain-on-exit, then stops.
    """
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    probe = ProbeSettings(cpuinfo_path=cpuinfo_path, architecture=arch)
    if print_registration:
        try:
            registration = load_registration(config_path, worker_id, node, probe)
        except ConfigError as e:
            raise click.ClickException(str(e)) from None
        click.echo(json.dumps(json.loads(encode(registration)), indent=2))
        return

    the_agent = Agent(
        nats_url,
        worker_id,
        node,
        config_path,
        prefix=prefix,
        drain_on_exit=drain_on_exit,
        watch_interval_s=watch_interval_s,
        probe=probe,
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await the_agent.run(stop)

    try:
        asyncio.run(run())
    except (ConfigError, ContractError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"agent {worker_id} stopped")


# --- warmboot nats-config ----------------------------------------------------------------------


def worker_permissions(prefix: str, worker_id: str) -> dict:
    """A worker may speak only for itself, and hear only the replies to its own requests."""
    return {
        "publish": {"allow": [f"{prefix}.registry.*.{worker_id}"]},
        "subscribe": {"allow": [f"_INBOX.{worker_id}.>"]},
    }


def operator_permissions(prefix: str) -> dict:
    """Read the event log (stream info, message gets, consumers of their own), call
    explain and fragmentation, discover services; write nothing."""
    stream = stream_name(prefix)
    return {
        "publish": {
            "allow": [
                f"{prefix}.scheduler.explain.*",
                f"{prefix}.scheduler.fragmentation",
                "$SRV.>",
                "$JS.API.INFO",
                f"$JS.API.STREAM.INFO.{stream}",
                f"$JS.API.STREAM.MSG.GET.{stream}",
                f"$JS.API.DIRECT.GET.{stream}",
                f"$JS.API.DIRECT.GET.{stream}.>",
                f"$JS.API.CONSUMER.CREATE.{stream}",
                f"$JS.API.CONSUMER.CREATE.{stream}.>",
                f"$JS.API.CONSUMER.INFO.{stream}.*",
                f"$JS.API.CONSUMER.DELETE.{stream}.*",
                f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*",
                f"$JS.ACK.{stream}.>",
                f"$JS.FC.{stream}.>",
            ]
        },
        "subscribe": {"allow": ["_INBOX.>"]},
    }


SERVICES_PERMISSIONS = {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}


def _q(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid nats-server config string


def _permissions(perms: dict) -> str:
    parts = []
    for direction in ("publish", "subscribe"):
        allow = ", ".join(_q(s) for s in perms[direction]["allow"])
        parts.append(f"{direction}: {{ allow: [{allow}] }}")
    return "{ " + ", ".join(parts) + " }"


def nats_auth_config(
    prefix: str,
    services_user: str,
    workers: list[str],
    operators: list[str],
    passwords: dict[str, str],
) -> str:
    """The `authorization` block of a nats-server configuration, users per role."""
    lines = [
        f"# warmboot users for the subject prefix {prefix!r}, written by `warmboot nats-config`.",
        "# Include this file from the nats-server configuration:  include \"warmboot-auth.conf\"",
        "# It holds passwords: keep it readable by the server's user only.",
        "authorization {",
        "  users: [",
        "    # services (registry, snapshotter, scheduler): everything",
        f"    {{ user: {_q(services_user)}, password: {_q(passwords[services_user])}, "
        f"permissions: {_permissions(SERVICES_PERMISSIONS)} }}",
    ]
    if operators:
        lines.append(f"    # operators: read the log ({events_filter(prefix)}), call explain and fragmentation")
    for name in operators:
        lines.append(
            f"    {{ user: {_q(name)}, password: {_q(passwords[name])}, "
            f"permissions: {_permissions(operator_permissions(prefix))} }}"
        )
    if workers:
        lines.append(f"    # workers: {prefix}.registry.*.<own id> only, replies on _INBOX.<own id>.>")
    for worker_id in workers:
        lines.append(
            f"    {{ user: {_q(worker_id)}, password: {_q(passwords[worker_id])}, "
            f"permissions: {_permissions(worker_permissions(prefix, worker_id))} }}"
        )
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


@click.command("nats-config")
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, envvar="WARMBOOT_PREFIX",
              callback=_check_prefix, help="Subject prefix of the deployment.")
@click.option("--services-user", default="warmboot-services", show_default=True, callback=_check_id,
              help="User the services connect as (full access).")
@click.option("--worker", "workers", multiple=True, callback=_check_id, metavar="WORKER_ID",
              help="A worker's user, named after its id; repeatable.")
@click.option("--workers-file", type=click.File("r"), default=None,
              help="File with one worker id per line (blank lines and # comments skipped).")
@click.option("--operator", "operators", multiple=True, callback=_check_id, metavar="NAME",
              help="An operator's user (read the log, explain, fragmentation); repeatable.")
@click.option("--secrets", "secrets_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="JSON file of user -> password: passwords found there are kept, new users "
                   "get new ones, and the file is rewritten (mode 0600).")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the configuration here (mode 0600) instead of standard output.")
def nats_config(
    prefix: str,
    services_user: str,
    workers: tuple[str, ...],
    workers_file,
    operators: tuple[str, ...],
    secrets_path: Path | None,
    out_path: Path | None,
) -> None:
    """Write a nats-server `authorization` block with one user per role.

    Services get full access. Each worker may publish only
    PREFIX.registry.*.ITS_ID (register, heartbeat, drain, remove itself) and
    receive replies on _INBOX.ITS_ID.> (the agent's inbox prefix). Operators may
    read the event log and call explain and fragmentation. See docs/security.md.
    """
    worker_ids = list(workers)
    if workers_file is not None:
        for line in workers_file:
            line = line.split("#", 1)[0].strip()
            if line:
                _check_id(click.get_current_context(), None, line)
                worker_ids.append(line)
    worker_ids = list(dict.fromkeys(worker_ids))
    users = [services_user, *operators, *worker_ids]
    clashes = sorted({u for u in users if users.count(u) > 1})
    if clashes:
        raise click.UsageError(f"user names must be unique across roles: {', '.join(clashes)}")

    passwords: dict[str, str] = {}
    if secrets_path is not None and secrets_path.exists():
        try:
            passwords = {str(k): str(v) for k, v in json.loads(secrets_path.read_text()).items()}
        except (OSError, ValueError, AttributeError) as e:
            raise click.ClickException(f"{secrets_path}: not a JSON object of user -> password: {e}") from None
    for user in users:
        passwords.setdefault(user, secrets.token_urlsafe(24))
    passwords = {u: passwords[u] for u in users}

    text = nats_auth_config(prefix, services_user, worker_ids, list(operators), passwords)
    if secrets_path is not None:
        _write_private(secrets_path, json.dumps(passwords, indent=2) + "\n")
    if out_path is None:
        click.echo(text, nl=False)
    else:
        _write_private(out_path, text)
        click.echo(f"wrote {out_path}: {len(worker_ids)} worker(s), {len(operators)} operator(s)", err=True)
