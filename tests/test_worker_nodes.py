"""Workers bound to their nodes: a worker's credential registers only on its own node.

A node names what a machine has (its PAUSED actors, its LOCAL images: CONTRACT rule 5), so
a worker that could claim another machine's node would be sent resumes whose images are not
on its disk. `warmboot nats-config --worker ID@NODE --worker-nodes FILE` writes the binding,
`warmboot serve registry --worker-nodes FILE` enforces it; here both run for real, against a
nats-server secured by the generated configuration.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner

from events.codec import decode_event
from events.errors import ContractError
from events.schema import ErrorCode, WorkerRegistered
from events.subjects import bucket_name, event_subject, service_subject
from services.registry.nodes import check_node, encode_nodes, load_nodes, parse_nodes
from tests.registry_helpers import last_seq, registration
from tests.secured_helpers import Secured, Serve
from warmboot.cli import main
from warmboot.cli_common import log_messages

PREFIX = "nb"


# --- the binding, pure ---------------------------------------------------------------------------


def test_a_binding_lets_each_worker_register_on_its_own_node_only():
    nodes = {"w-1": "node-a"}
    check_node(nodes, "w-1", "node-a")
    check_node(None, "w-1", "node-z")  # no binding: any node, as before
    with pytest.raises(ContractError) as other:
        check_node(nodes, "w-1", "node-b")
    assert (other.value.code, other.value.field) == (ErrorCode.FAILED_PRECONDITION, "node")
    assert "'node-a'" in other.value.message and "'node-b'" in other.value.message
    with pytest.raises(ContractError) as unlisted:
        check_node(nodes, "w-2", "node-a")
    assert (unlisted.value.code, unlisted.value.field) == (ErrorCode.FAILED_PRECONDITION, "worker_id")


@pytest.mark.parametrize("text, says", [
    (b'["w-1"]', "not a JSON object"),
    (b'{"w-1": 3}', "not a JSON object"),
    (b'{"w-1": "node-a"', "not JSON"),
    (b'{"w.1": "node-a"}', "the worker id 'w.1' is not an id"),
    (b'{"w-1": "node a"}', "the node of worker 'w-1' 'node a' is not an id"),
])
def test_a_bad_binding_file_is_refused_naming_the_file_and_the_entry(text, says):
    with pytest.raises(ValueError) as refused:
        parse_nodes(text, "nodes.json")
    assert str(refused.value).startswith("nodes.json: ") and says in str(refused.value)


def test_the_file_reads_back_what_was_written(tmp_path):
    path = tmp_path / "nodes.json"
    path.write_bytes(encode_nodes({"w-2": "node-b", "w-1": "node-a"}))
    assert load_nodes(path) == {"w-1": "node-a", "w-2": "node-b"}
    assert path.read_text().index('"w-1"') < path.read_text().index('"w-2"')  # sorted: a diff shows a change
    with pytest.raises(ValueError, match="missing.json"):
        load_nodes(tmp_path / "missing.json")


# --- the commands --------------------------------------------------------------------------------


def test_nats_config_writes_the_binding_and_refuses_an_incomplete_one(tmp_path):
    runner = CliRunner()
    listed = tmp_path / "workers.txt"
    listed.write_text("# rack 1\nw-2@node-b\n\nw-3@node-b  # second on the node\n")
    nodes, conf = tmp_path / "nodes.json", tmp_path / "auth.conf"
    made = runner.invoke(main, ["nats-config", "--prefix", PREFIX, "--worker", "w-1@node-a", "--workers-file",
                                str(listed), "--worker-nodes", str(nodes), "--out", str(conf)])
    assert made.exit_code == 0, made.output
    assert json.loads(nodes.read_text()) == {"w-1": "node-a", "w-2": "node-b", "w-3": "node-b"}
    text = conf.read_text()
    assert '"nb.registry.*.w-3"' in text and "node-b" not in text  # users are worker ids; nodes are not users

    for case, (args, says) in enumerate([
        (["--worker", "w-1@node-a", "--worker", "w-2"], "give w-2 as ID@NODE"),
        (["--worker", "w-1@node-a", "--worker", "w-1@node-b"], "worker 'w-1' is given two nodes"),
        (["--worker", "w-1@node.a"], "'node.a' must match"),
        (["--worker", "w-1@"], "'' must match"),
    ]):
        out = tmp_path / f"refused-{case}"
        out.mkdir()
        refused = runner.invoke(main, ["nats-config", *args, "--worker-nodes", str(out / "nodes.json"),
                                       "--out", str(out / "auth.conf")])
        assert refused.exit_code == 2 and says in refused.output, refused.output
        assert not list(out.iterdir())  # nothing written
    without = runner.invoke(main, ["nats-config", "--worker", "w-1@node-a"])
    assert without.exit_code == 2 and "only through --worker-nodes" in without.output


def test_serve_refuses_a_bad_binding_file_before_it_connects(tmp_path):
    bad = tmp_path / "nodes.json"
    bad.write_text('{"w-1": "node a"}')
    # no server listens there: the file is refused first
    for args in (["registry", "--worker-nodes", str(bad)], ["all", "--worker-nodes", str(tmp_path / "none.json")]):
        result = CliRunner().invoke(main, ["serve", *args, "--nats", "nats://127.0.0.1:1"])
        assert result.exit_code == 2, result.output
        assert "--worker-nodes" in result.output and args[2] in result.output


# --- on the bus ----------------------------------------------------------------------------------


async def test_a_worker_credential_registers_only_on_the_node_it_is_bound_to(tmp_path):
    nodes = tmp_path / "nodes.json"
    made = CliRunner().invoke(main, ["nats-config", "--prefix", PREFIX, "--worker", "w-1@node-a",
                                     "--worker", "w-2@node-b", "--worker-nodes", str(nodes)])
    assert made.exit_code == 0, made.output
    secured = Secured(tmp_path / "nats", PREFIX, workers=("w-1", "w-2", "w-3")).start()
    serve = Serve("registry", "--nats", secured.url("svc"), "--prefix", PREFIX, "--worker-nodes", str(nodes))
    connections = []
    try:
        await asyncio.to_thread(serve.start)
        assert serve.line("workers bound to their nodes").endswith(": 2 worker(s)")
        admin = await secured.connect("svc")
        connections.append(admin)
        workers = {}
        for user in ("w-1", "w-2", "w-3"):
            workers[user] = await secured.connect(user)
            connections.append(workers[user])
        heartbeats = f"KV_{bucket_name(PREFIX, 'heartbeats')}"

        async def register(user: str, node: str) -> dict:
            subject = service_subject(PREFIX, "registry", "register", user)
            reply = await workers[user].nc.request(subject, json.dumps(registration(user, node=node)).encode(),
                                                   timeout=10)
            return json.loads(reply.data)

        async def written() -> tuple[int, int]:
            """The event log's last sequence and the heartbeat bucket's."""
            info = await admin.nc.jetstream().stream_info(heartbeats)
            return await last_seq(admin.nc, PREFIX), info.state.last_seq

        first = await register("w-1", "node-a")
        assert first["outcome"] == "REGISTERED"
        before = await written()

        # w-2's own credential, claiming w-1's node: the registry refuses it, and writes nothing
        # (no event, and no heartbeat: the worker is not alive anywhere)
        claim = await register("w-2", "node-a")
        assert claim["error"]["code"] == "FAILED_PRECONDITION" and claim["error"]["field"] == "node"
        assert "'node-b'" in claim["error"]["message"]
        # a worker the file does not list registers nowhere
        unlisted = await register("w-3", "node-c")
        assert unlisted["error"]["code"] == "FAILED_PRECONDITION" and unlisted["error"]["field"] == "worker_id"
        # a registered worker does not move to another's node either (a WorkerUpdated refused)
        moved = await register("w-1", "node-b")
        assert moved["error"]["field"] == "node"
        assert await written() == before

        own = await register("w-2", "node-b")
        assert own["outcome"] == "REGISTERED"
        registered = [(event.worker_id, event.node) async for _, _, _, data in log_messages(
                          admin.nc, PREFIX, event_subject(PREFIX, "worker", "*"), stop=await last_seq(admin.nc, PREFIX))
                      if isinstance(event := decode_event(data), WorkerRegistered)]
        assert registered == [("w-1", "node-a"), ("w-2", "node-b")]
        assert not secured.violations()
    finally:
        for connection in connections:
            await connection.close()
        await asyncio.to_thread(serve.stop)
        secured.stop()
