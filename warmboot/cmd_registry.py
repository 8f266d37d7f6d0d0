"""`warmboot agent`: a worker's agent (`warmboot nats-config` is in warmboot.nats_config)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import BinaryIO

import click

from events.codec import decode_request, encode
from events.compat import describe_key, stamp_key
from events.errors import ContractError, precondition
from events.probe import ARCHITECTURES, DEFAULT_CPUINFO
from events.natsauth import NKEY_SEED_ENV
from events.schema import Placement, RegisterWorker
from events.subjects import DEFAULT_PREFIX
from services.process import run_serving, serving_loop
from warmboot.agent import Agent
from warmboot.agent_rules import SUPERSEDED_AT_START_EXIT, StillSuperseded
from warmboot.agent_config import ConfigError, ProbeSettings, load_registration
from warmboot.agent_state import NodeToken
from warmboot.cli_common import (SIGN_IN_ENV_HELP, Failed, FloatRange, check_given_file, check_id,
                                 check_nats_option, check_nkey_seed_option, check_prefix_option)
from warmboot.restore_check import cannot_carry_out_here
from warmboot.runner import StopBound, stop_signals


# --- warmboot agent -------------------------------------------------------------------------


class HeldElsewhere(click.ClickException):
    """`warmboot agent` at its start, after a stop as superseded, finds the worker still held by another
    node's agent (`StillSuperseded`): exit SUPERSEDED_AT_START_EXIT, which a supervisor is told to leave
    stopped (systemd's `RestartPreventExitStatus=3`: docs/operations.md)."""

    exit_code = SUPERSEDED_AT_START_EXIT


def check_placement(registration: RegisterWorker, placement_file: BinaryIO) -> None:
    """`agent --check-placement`: whether this machine (`registration`, built now) can carry out the
    placement the file holds (`restore_check`); exit 1 naming why not."""
    try:
        placement = decode_request(Placement, placement_file.read())
    except ContractError as e:
        where = getattr(placement_file, "name", "-")
        raise click.BadParameter(f"{where}: {e}", param_hint="'--check-placement'") from None
    why = cannot_carry_out_here(registration, placement)
    what = (f"{placement.actor_id}'s placement ({placement.action.value} at {placement.fidelity.value} under "
            f"{placement.sandbox_runtime.name or describe_key(stamp_key(placement.sandbox_runtime))})")
    if why is not None:
        raise Failed(precondition(f"worker {registration.worker_id} cannot carry out {what}: {why}; refuse it "
                                  "(whoever runs the worker releases the actor, and its next resume places it anew)"))
    click.echo(f"ok: worker {registration.worker_id} on node {registration.node} can carry out {what}")


@click.command("agent")
@click.option("--nats", "nats_url", default="nats://127.0.0.1:4222", show_default=True, envvar="NATS_URL",
              show_envvar=True, callback=check_nats_option,
              help="NATS server URL; credentials as nats://USER:PASSWORD@HOST:PORT, best given in $NATS_URL (a process's arguments are visible to every user)." + SIGN_IN_ENV_HELP)
@click.option("--nkey-seed", type=click.Path(exists=True, dir_okay=False), default=None, envvar=NKEY_SEED_ENV,
              show_envvar=True, callback=check_nkey_seed_option, help="Sign in with the nkey seed in this file (warmboot nats-config --auth nkey).")
@click.option("--worker-id", required=True, callback=check_id, help="This worker's id (one subject token).")
@click.option("--node", required=True, callback=check_id, help="The node (machine) this worker runs on.")
@click.option("--config", "config_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="TOML file: capacity, labels, sandbox classes (see examples/agent.toml). Watched for edits.")
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, envvar="WARMBOOT_PREFIX", show_envvar=True,
              callback=check_prefix_option, help="Subject prefix of the deployment.")
@click.option("--drain-on-exit", is_flag=True, help="Drain the worker on SIGTERM/SIGINT before stopping.")
@click.option("--watch-interval", "watch_interval_s", type=FloatRange(min=0.05), default=1.0,
              show_default=True, help="Seconds between checks of the config file for edits.")
@click.option("--cpuinfo", "cpuinfo_path", type=click.Path(path_type=Path), default=DEFAULT_CPUINFO,
              show_default=True, callback=check_given_file,
              help="cpuinfo file the probe reads; one given must be a readable file when the agent starts (a "
                   "usage error otherwise).")
@click.option("--arch", type=click.Choice(ARCHITECTURES), default=None,
              help="Architecture the probe reports [default: this machine's].")
@click.option("--state-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              envvar="WARMBOOT_AGENT_STATE", show_envvar=True,
              help="File the agent keeps its last registration revision in (written before it is sent), so that "
                   "its next process registers above anything this one sent, whatever the clock does "
                   "(docs/registry.md). Without it, revisions come from the clock alone. The agent holds FILE "
                   "while it runs (FILE.lock): a second agent given it exits 1 at once. An agent that stopped "
                   "because another agent registered its worker since records it in FILE.superseded; "
                   "restarted, it exits 3 without registering while that agent holds the worker (delete "
                   "FILE.superseded to take the worker over).")
@click.option("--node-token-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              envvar="WARMBOOT_NODE_TOKEN_FILE", show_envvar=True,
              help="File on the disk that holds this node's LOCAL snapshots, the same file for every worker of the "
                   "node: it keeps the token of that disk, which every registration carries. Made when absent (its "
                   "directory is not). A new disk (a machine replaced) makes a new token: the registry then starts "
                   "the worker's new life, and the scheduler no longer sends that node's older LOCAL images to it "
                   "(docs/contract.md, rule 5). A file holding anything else is refused (exit 1, nothing registered).")
@click.option("--print-registration", is_flag=True,
              help="Print the registration the config makes on this machine, as JSON, and exit (with the node's "
                   "token if --node-token-file exists; it is not made).")
@click.option("--check-placement", "placement_file", type=click.File("rb"), default=None, metavar="FILE",
              help="Check the placement in FILE ('-': standard input; an Assignment as `actor resume -o json` "
                   "prints it) against this machine as the config and the probe read it now, and exit: 0 if it "
                   "can carry it out, 1 naming why not (a worker refuses such a placement: docs/worker-agents.md).")
@click.option("-v", "--verbose", is_flag=True, help="Log at DEBUG level.")
def agent(
    nats_url: str,
    nkey_seed: str | None,
    worker_id: str,
    node: str,
    config_path: Path,
    prefix: str,
    drain_on_exit: bool,
    watch_interval_s: float,
    cpuinfo_path: Path,
    arch: str | None,
    state_file: Path | None,
    node_token_file: Path | None,
    print_registration: bool,
    placement_file: BinaryIO | None,
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
    if print_registration and placement_file is not None:
        # each prints its answer and exits: given both, the check ran and the registration was not
        # printed, without a word (a user trial)
        raise click.UsageError("give --print-registration or --check-placement, not both (each prints its answer "
                               "and exits)")
    if print_registration or placement_file is not None:
        try:
            # the token the node has, if it has one: a look, not the agent's start, which would make one
            token = NodeToken(node_token_file).read() if node_token_file is not None else None
            registration = load_registration(config_path, worker_id, node, probe, token)
        except ConfigError as e:
            if placement_file is None:
                raise click.ClickException(str(e)) from None
            # no verdict can be given, and a placement this machine cannot be shown to carry out is refused
            raise Failed(precondition(f"worker {worker_id} cannot judge the placement: the configuration makes "
                                      f"no registration of this machine now ({e}); refuse it")) from None
        if placement_file is None:
            click.echo(json.dumps(json.loads(encode(registration)), indent=2))
        else:
            check_placement(registration, placement_file)
        return

    try:
        the_agent = Agent(
            nats_url,
            worker_id,
            node,
            config_path,
            prefix=prefix,
            drain_on_exit=drain_on_exit,
            watch_interval_s=watch_interval_s,
            probe=probe,
            nkey_seed=nkey_seed,
            state_file=state_file,
            node_token_file=node_token_file,
        )
    except ConfigError as e:  # the state file, or the node token file, cannot be read (or made)
        raise click.ClickException(str(e)) from None

    # The bound of its stop, as `serve`'s and `up`'s: its own steps (the check that it still holds the worker,
    # the drain: EXIT_ASKS_S together; the close) come to about 7 s with NATS frozen or gone; should one wait longer, the process ends
    # at STOP_BOUND_S all the same, saying so (docs/operations.md, "Stopping").
    bound = StopBound(f"warmboot agent {worker_id}")

    async def run() -> None:
        with stop_signals(bound) as stop:  # SIGINT, SIGTERM; SIGUSR1 prints every task's and thread's stack
            await the_agent.run(stop)

    try:
        serving_loop()  # WARMBOOT_EVENT_LOOP names a loop
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    try:
        run_serving(run)  # on the loop the services run on, and the tests
    except StillSuperseded as e:
        raise HeldElsewhere(str(e)) from None
    except (ConfigError, ContractError) as e:
        raise click.ClickException(str(e)) from None
    finally:
        bound.disarm()
    click.echo(f"agent {worker_id} stopped")
