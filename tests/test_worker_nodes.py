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
from datetime import datetime, timezone

import msgspec
import nats
import pytest
from click.testing import CliRunner

from events.codec import decode_event
from events.errors import ContractError
from events.schema import ErrorCode, Heartbeat, RegisterOutcome, RegisterWorker, WorkerRegistered, WorkerRemoved
from events.subjects import bucket_name, event_subject, service_subject
from services.registry.binding import SharedBinding
from services.registry.domain import Worker
from services.registry.nodes import (check_node, check_registered, encode_nodes, load_nodes, parse_nodes,
                                     unbound_reason)
from services.registry.roster import Roster
from tests.factories import last_seq
from tests.registry_helpers import PROBE, agent_config, registration, running_registry, wait_event
from tests.secured_helpers import Secured, Serve
from warmboot.agent import Agent
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


def test_a_worker_registered_on_a_node_its_binding_does_not_give_it_is_refused_its_heartbeats():
    nodes = {"w-1": "node-a"}
    check_registered(nodes, "w-1", "node-a")
    check_registered(None, "w-1", "node-z")  # no binding
    check_registered(nodes, "w-1", None)  # a node the roster did not read: not judged
    for worker_id, node, field in (("w-1", "node-b", "node"), ("w-2", "node-a", "worker_id")):
        with pytest.raises(ContractError) as refused:
            check_registered(nodes, worker_id, node)
        assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, field)
        assert f"registered on node {node!r}" in refused.value.message and "LOST" in refused.value.message


def test_the_worker_decides_its_removal_for_its_binding_on_the_node_its_history_names():
    at = datetime(2026, 12, 3, tzinfo=timezone.utc)
    worker = Worker("w-2")
    worker.register(msgspec.convert(registration("w-2", node="node-a"), RegisterWorker), at)
    worker.collect_events()
    assert not worker.remove_unbound({"w-2": "node-a"}, at)  # its own node: nothing recorded
    worker.register(msgspec.convert(registration("w-2", node="node-b"), RegisterWorker), at)  # moved
    worker.collect_events()
    assert not worker.remove_unbound({"w-2": "node-b"}, at) and not worker.collect_events()
    assert worker.remove_unbound({"w-2": "node-a"}, at)
    [removed] = [e.body for e in worker.collect_events()]
    assert isinstance(removed, WorkerRemoved) and removed.reason == unbound_reason("node-b")
    assert not worker.remove_unbound({}, at)  # removed already: once per life
    long_node = "n" * 128
    assert len(unbound_reason(long_node)) <= 256 and long_node in unbound_reason(long_node)


def test_the_roster_keeps_the_node_of_each_worker_in_a_life():
    roster = Roster()
    roster.apply(1, "w-1", "WorkerRegistered", "node-a")
    roster.apply(2, "w-1", "RuntimeChanged")
    assert roster.node("w-1") == "node-a"
    roster.apply(3, "w-1", "WorkerUpdated", "node-b")
    assert roster.node("w-1") == "node-b"
    roster.apply(4, "w-1", "WorkerUpdated", None)  # a body whose node could not be read: not known
    assert roster.node("w-1") is None and roster.alive("w-1")
    roster.apply(5, "w-1", "WorkerUpdated", "node-c")
    roster.apply(6, "w-1", "WorkerRemoved")
    assert roster.node("w-1") is None and not roster.alive("w-1")
    roster.apply(7, "w-2", "WorkerUpdated", "node-d")  # not in a life: nothing kept
    assert roster.node("w-2") is None


@pytest.mark.parametrize("text, says", [
    (b'["w-1"]', "not a JSON object"),
    (b'{"w-1": 3}', "not a JSON object"),
    (b'{"w-1": "node-a"', "not JSON"),
    (b'{"w.1": "node-a"}', "the worker id 'w.1' is not an id"),
    (b'{"w-1": "node a"}', "the node of worker 'w-1' 'node a' is not an id"),
    (b'{"w-1": "node-a", "w-2": "node-b", "w-1": "node-c"}', "the worker id 'w-1' is given more than once"),
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


def test_a_binding_read_late_does_not_undo_a_newer_one():
    """A replica has the binding from two places, its read of the key at the bucket's leader (at start,
    and before each look for unbound workers: `refresh`) and its consumer of the key; an answer of
    the read may come after the consumer delivered a newer value. The newer stays: judged on the older,
    the replica let a worker register on the node the change took from it, and removed one the change
    put where it is. Kills the mutant of `SharedBinding._apply` that takes any revision but the one it has."""
    binding = SharedBinding(None, PREFIX, replicas=1)
    binding._apply(7, encode_nodes({"w-1": "node-b"}))  # the consumer's delivery of the change
    binding._apply(5, encode_nodes({"w-1": "node-a"}))  # a read answered late, before the change
    assert (binding.nodes, binding.judged_nodes, binding.revision) == ({"w-1": "node-b"}, {"w-1": "node-b"}, 7)
    binding._apply(7, encode_nodes({"w-1": "node-a"}))  # the same revision again: what it has stays
    assert binding.nodes == {"w-1": "node-b"}
    binding._apply(9, None)  # deleted since: no binding
    assert binding.nodes is None and binding.revision == 9


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

    bad_file = tmp_path / "bad-workers.txt"
    bad_file.write_text("w-3@node-b\nw.2@node-b\n")
    for case, (args, says) in enumerate([
        (["--worker", "w-1@node-a", "--worker", "w-2"], "give w-2 as ID@NODE"),
        (["--worker", "w-1@node-a", "--worker", "w-1@node-b"], "worker 'w-1' is given two nodes"),
        (["--worker", "w-1@node-a", "--worker", "w-1@node-a"], "Invalid value for '--worker': 'w-1@node-a': "
                                                               "worker 'w-1' is given twice (also at --worker "
                                                               "w-1@node-a)"),
        (["--worker", "w-1@node.a"], "Invalid value for '--worker': 'w-1@node.a': 'node.a' is not an id: 1 to 128"),
        (["--worker", "w-1@node-a", "--workers-file", str(bad_file)],
         f"Invalid value for '--workers-file': {bad_file}:2: 'w.2' is not an id: 1 to 128"),
        (["--worker", "w-1@"], "'' is not an id: 1 to 128"),
        ([], "with no worker"),
    ]):
        out = tmp_path / f"refused-{case}"
        out.mkdir()
        refused = runner.invoke(main, ["nats-config", *args, "--worker-nodes", str(out / "nodes.json"),
                                       "--out", str(out / "auth.conf")])
        assert refused.exit_code == 2 and says in refused.output, refused.output
        assert not list(out.iterdir())  # nothing written
    without = runner.invoke(main, ["nats-config", "--worker", "w-1@node-a"])
    assert without.exit_code == 2 and "only through --worker-nodes" in without.output

    # output paths are checked before any is written: no secrets left behind by a run that failed
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for args, says in [
        (["--worker-nodes", str(fresh / "missing" / "nodes.json")], "is not a directory"),
        (["--worker-nodes", str(fresh / "same"), "--out", str(fresh / "same")], "name the same file"),
    ]:
        refused = runner.invoke(main, ["nats-config", "--worker", "w-1@node-a", "--secrets", str(fresh / "s.json"),
                                       *args])
        assert refused.exit_code == 2 and says in refused.output, refused.output
        assert not list(fresh.iterdir())
    bad_line = tmp_path / "bad.txt"
    bad_line.write_text("w-1@node-a\nw-2@node b\n")
    refused = runner.invoke(main, ["nats-config", "--workers-file", str(bad_line), "--worker-nodes",
                                   str(fresh / "n.json")])
    assert refused.exit_code == 2 and f"{bad_line}:2" in refused.output and not list(fresh.iterdir())


def test_serve_refuses_a_bad_binding_file_before_it_connects(tmp_path):
    bad = tmp_path / "nodes.json"
    bad.write_text('{"w-1": "node a"}')
    # no server listens there: the file is refused first
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    for args in (["registry", "--worker-nodes", str(bad)], ["all", "--worker-nodes", str(tmp_path / "none.json")],
                 ["registry", "--worker-nodes", str(empty)]):
        result = CliRunner().invoke(main, ["serve", *args, "--nats", "nats://127.0.0.1:1"])
        assert result.exit_code == 2, result.output
        assert "--worker-nodes" in result.output and args[2] in result.output


def test_serve_refuses_an_option_of_a_service_it_does_not_run(tmp_path):
    nodes = tmp_path / "nodes.json"
    nodes.write_bytes(encode_nodes({"w-1": "node-a"}))
    for args, flag, owner in ((["scheduler", "--worker-nodes", str(nodes)], "--worker-nodes", "registry"),
                              (["snapshotter", "--ttl", "30"], "--ttl", "registry"),
                              (["scheduler", "--worker-writes", "5"], "--worker-writes", "registry"),
                              (["snapshotter", "--worker-write-interval", "1"], "--worker-write-interval", "registry"),
                              (["registry", "--checkpoint-every", "10"], "--checkpoint-every", "scheduler")):
        result = CliRunner().invoke(main, ["serve", *args, "--nats", "nats://127.0.0.1:1"])
        assert result.exit_code == 2, result.output
        assert f"{flag} is the {owner}'s option" in result.output and f"serve {args[0]}" in result.output


def test_serve_ignores_an_option_of_another_service_from_the_environment_every_service_shares(
        tmp_path, nats_server, prefix):
    nodes = tmp_path / "nodes.json"
    nodes.write_text("not a binding")  # the registry would refuse it: the scheduler does not read it
    serve = Serve("scheduler", "--nats", nats_server.url, "--prefix", prefix,
                  env={"WARMBOOT_WORKER_NODES": str(nodes)})
    try:
        assert serve.start().line("serving scheduler")
    finally:
        serve.stop()


# --- on the bus ----------------------------------------------------------------------------------


class Bus:
    """A nats-server secured by the generated configuration, workers w-1 to w-3, and requests
    made with each worker's own credential."""

    def __init__(self, tmp_path):
        self.secured = Secured(tmp_path / "nats", PREFIX, workers=("w-1", "w-2", "w-3")).start()
        self.serves: list[Serve] = []
        self.connections = []

    def serve(self, *more: str, env: dict[str, str] | None = None) -> Serve:
        serve = Serve("registry", "--nats", self.secured.url("svc"), "--prefix", PREFIX, "--ttl", "60", *more, env=env)
        self.serves.append(serve)
        return serve.start()

    async def connect(self) -> None:
        for user in ("svc", "w-1", "w-2", "w-3"):
            self.connections.append(await self.secured.connect(user))
        self.admin = self.connections[0]
        self.workers = dict(zip(("w-1", "w-2", "w-3"), self.connections[1:]))

    async def heartbeat(self, user: str) -> dict:
        subject = service_subject(PREFIX, "registry", "heartbeat", user)
        return json.loads((await self.workers[user].nc.request(subject, b"{}", timeout=10)).data)

    async def register(self, user: str, node: str) -> dict:
        subject = service_subject(PREFIX, "registry", "register", user)
        reply = await self.workers[user].nc.request(subject, json.dumps(registration(user, node=node)).encode(),
                                                    timeout=10)
        return json.loads(reply.data)

    async def written(self) -> tuple[int, int]:
        """The event log's last sequence and the heartbeat bucket's."""
        info = await self.admin.nc.jetstream().stream_info(f"KV_{bucket_name(PREFIX, 'heartbeats')}")
        return await last_seq(self.admin.nc, PREFIX), info.state.last_seq

    async def binding_revision(self) -> int:
        """The sequence of the binding's last entry (a deletion too), read as the services may."""
        bucket = bucket_name(PREFIX, "settings")
        return (await self.admin.nc.jetstream().get_msg(f"KV_{bucket}", subject=f"$KV.{bucket}.worker-nodes")).seq

    async def close(self) -> None:
        for connection in self.connections:
            await connection.close()
        for serve in self.serves:
            await asyncio.to_thread(serve.stop)
        self.secured.stop()


def binding_file(tmp_path, name: str, *workers: str) -> str:
    path = tmp_path / name
    made = CliRunner().invoke(main, ["nats-config", "--prefix", PREFIX, *(f"--worker={w}" for w in workers),
                                     "--worker-nodes", str(path)])
    assert made.exit_code == 0, made.output
    return str(path)


async def test_a_worker_credential_registers_only_on_the_node_it_is_bound_to(tmp_path):
    bus = Bus(tmp_path)
    try:
        serve = await asyncio.to_thread(bus.serve, "--worker-nodes",
                                        binding_file(tmp_path, "nodes.json", "w-1@node-a", "w-2@node-b"))
        assert serve.line("workers bound to their nodes") == "workers bound to their nodes: 2 worker(s)"
        await bus.connect()
        first = await bus.register("w-1", "node-a")
        assert first["outcome"] == "REGISTERED"
        before = await bus.written()

        # w-2's own credential, claiming w-1's node: the registry refuses it, and writes nothing
        # (no event, and no heartbeat: the worker is not alive anywhere)
        claim = await bus.register("w-2", "node-a")
        assert claim["error"]["code"] == "FAILED_PRECONDITION" and claim["error"]["field"] == "node"
        assert "'node-b'" in claim["error"]["message"]
        # a worker the file does not list registers nowhere
        unlisted = await bus.register("w-3", "node-c")
        assert unlisted["error"]["code"] == "FAILED_PRECONDITION" and unlisted["error"]["field"] == "worker_id"
        # a registered worker does not move to another's node either (a WorkerUpdated refused)
        moved = await bus.register("w-1", "node-b")
        assert moved["error"]["field"] == "node"
        assert await bus.written() == before

        own = await bus.register("w-2", "node-b")
        assert own["outcome"] == "REGISTERED"
        registered = [(event.worker_id, event.node) async for _, _, _, data in log_messages(
                          bus.admin.nc, PREFIX, event_subject(PREFIX, "worker", "*"),
                          stop=await last_seq(bus.admin.nc, PREFIX))
                      if isinstance(event := decode_event(data), WorkerRegistered)]
        assert registered == [("w-1", "node-a"), ("w-2", "node-b")]

        # the agent, started on another worker's node, stops at once and says why
        config = tmp_path / "agent.toml"
        config.write_text(agent_config("v1"))
        agent = Agent(bus.secured.url("w-2"), "w-2", "node-a", config, prefix=PREFIX, probe=PROBE)
        with pytest.raises(ContractError) as refused:
            await asyncio.wait_for(agent.run(asyncio.Event()), 30)
        assert refused.value.field == "node" and "bound to node 'node-b'" in refused.value.message
        assert not bus.secured.violations()
    finally:
        await bus.close()


async def test_every_replica_enforces_the_binding_one_of_them_set_and_follows_its_changes(tmp_path):
    """A replica started without --worker-nodes does not let registrations through: it reads
    the binding the others share, and follows it as replicas started with another file, or
    with `none`, change it."""
    bus = Bus(tmp_path)
    try:
        first = await asyncio.to_thread(bus.serve, "--worker-nodes",
                                        binding_file(tmp_path, "one.json", "w-1@node-a", "w-2@node-b"))
        await bus.connect()
        assert (await bus.register("w-1", "node-a"))["outcome"] == "REGISTERED"
        await asyncio.to_thread(first.stop)

        # started without the option (a forgotten flag, an empty WARMBOOT_WORKER_NODES), and the
        # only replica serving: it enforces what the first one set
        plain = await asyncio.to_thread(bus.serve, env={"WARMBOOT_WORKER_NODES": ""})
        assert plain.line("workers bound to their nodes") == "workers bound to their nodes: 2 worker(s)"
        before = await bus.written()
        assert (await bus.register("w-2", "node-a"))["error"]["field"] == "node"
        assert (await bus.register("w-3", "node-a"))["error"]["field"] == "worker_id"
        assert await bus.written() == before

        # another replica starts with another file: the plain one follows it
        other = await asyncio.to_thread(bus.serve, "--worker-nodes",
                                        binding_file(tmp_path, "two.json", "w-1@node-a", "w-2@node-c"))
        # the file given last wins, and its replica says what it undid (a stale file would show)
        replaced = await asyncio.to_thread(other.line, "is replaced by this replica's file", anywhere=True)
        assert replaced.endswith("1 moved (w-2 node-b -> node-c)")
        revision = await bus.binding_revision()
        await asyncio.to_thread(plain.line, f"workers bound to their nodes: 2 worker(s) (revision {revision})",
                                anywhere=True)
        await asyncio.to_thread(other.stop)
        assert (await bus.register("w-2", "node-b"))["error"]["message"].count("'node-c'") == 1
        assert (await bus.register("w-2", "node-c"))["outcome"] == "REGISTERED"

        # a value that is no binding (written by hand) binds every worker to no node: fail closed
        bucket = bucket_name(PREFIX, "settings")
        await bus.admin.nc.jetstream().publish(f"$KV.{bucket}.worker-nodes", b"w-1 node-a")
        revision = await bus.binding_revision()
        await asyncio.to_thread(plain.line, f"workers bound to their nodes: 0 worker(s) (revision {revision})",
                                anywhere=True)
        assert "every registration is refused" in plain.line("not JSON", anywhere=True)
        assert (await bus.register("w-1", "node-a"))["error"]["field"] == "worker_id"
        # ... but the workers registered are not judged on it: whom it binds where is not known
        assert "ttl_s" in await bus.heartbeat("w-1") and "ttl_s" in await bus.heartbeat("w-2")

        # only `none` removes it: then any node, through the plain replica too
        off = await asyncio.to_thread(bus.serve, "--worker-nodes", "none")
        assert off.line("workers are not bound").endswith("any worker may register on any node")
        revision = await bus.binding_revision()
        await asyncio.to_thread(plain.line, f"workers are not bound to nodes: any worker may register on any node (revision {revision})", anywhere=True)
        await asyncio.to_thread(off.stop)
        assert (await bus.register("w-3", "node-a"))["outcome"] == "REGISTERED"
        assert not bus.secured.violations()
    finally:
        await bus.close()


async def test_a_worker_registered_on_another_node_before_the_binding_is_removed_when_the_binding_comes(tmp_path):
    """A registration made before the binding stays in the log: when a binding that does not give
    the worker its node reaches the registry replicas, they remove it at once (once, whichever
    replicas look), not a TTL later; registered on its own node, it starts a new life."""
    bus = Bus(tmp_path)
    try:
        # two replicas with no binding of their own: the removal comes from their following the key
        plains = [await asyncio.to_thread(bus.serve) for _ in range(2)]
        await bus.connect()
        assert (await bus.register("w-1", "node-a"))["outcome"] == "REGISTERED"
        assert (await bus.register("w-2", "node-a"))["outcome"] == "REGISTERED"  # w-1's node, unbound
        assert "ttl_s" in await bus.heartbeat("w-2")
        registered = await last_seq(bus.admin.nc, PREFIX)

        # the binding as a replica started with it writes it (`warmboot serve registry --worker-nodes`)
        bucket = bucket_name(PREFIX, "settings")
        await bus.admin.nc.jetstream().publish(f"$KV.{bucket}.worker-nodes",
                                               encode_nodes({"w-1": "node-a", "w-2": "node-b"}))
        seq, removal = await wait_event(bus.admin.nc, PREFIX, "w-2", WorkerRemoved, after=registered)
        assert removal.reason == ("registered on node node-a, which the deployment's binding of workers to nodes "
                                  "does not give it")
        # the replica that wrote it says so (the other decided on the history, found it removed, wrote nothing)
        said = "worker w-2 removed: registered on node node-a (it is bound to node node-b)"
        told = [asyncio.ensure_future(asyncio.to_thread(p.line, said, 30, True)) for p in plains]
        done, _ = await asyncio.wait(told, return_when=asyncio.FIRST_COMPLETED)
        for waiting in told:
            waiting.cancel()  # the other's thread ends with its process
        assert said in done.pop().result()
        assert (await bus.heartbeat("w-2"))["error"]["code"] == "NOT_FOUND"
        assert "ttl_s" in await bus.heartbeat("w-1")  # bound to the node it is on: left alone

        # registered on its own node, a new life; and the removal was written once
        assert (await bus.register("w-2", "node-b"))["outcome"] == "REGISTERED"
        assert "ttl_s" in await bus.heartbeat("w-2")
        removals = [s async for s, _, _, data in log_messages(bus.admin.nc, PREFIX, event_subject(PREFIX, "worker", "*"),
                                                               stop=await last_seq(bus.admin.nc, PREFIX))
                    if isinstance(decode_event(data), WorkerRemoved)]
        assert removals == [seq]
        assert not bus.secured.violations()
    finally:
        await bus.close()


def binding_moved(registry) -> asyncio.Event:
    """Set when the replica's binding changes from now on (its own event is cleared by the look)."""
    moved, told = asyncio.Event(), registry.binding.on_change

    def change() -> None:
        told()
        moved.set()

    registry.binding.on_change = change
    return moved


async def removal_failed(worker_id: str, node: str) -> None:
    """`RegistryService._remove_if_unbound` as if every removal failed (the look goes on, removing nothing).
    Not the look's task cancelled: a cancellation that a request's time-out swallowed left the test
    waiting for that task for ever (Python 3.11's asyncio.wait_for; the suite hung so, 2026-12-05)."""


async def test_should_the_removal_fail_a_worker_on_another_node_is_refused_its_heartbeats(nats_server, prefix,
                                                                                         monkeypatch):
    """The second line: a worker registered on a node the binding does not give it, and not removed
    (the look that removes it failed; here, it is stopped), is refused its heartbeats, nothing put,
    so its clock runs out and it ends as LOST; registered on its own node, it beats again."""
    async with running_registry(nats_server.url, prefix) as registry:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        heartbeats = f"KV_{bucket_name(prefix, 'heartbeats')}"

        async def call(verb: str, body: dict) -> dict:
            subject = service_subject(prefix, "registry", verb, "w-2")
            return json.loads((await nc.request(subject, json.dumps(body).encode(), timeout=10)).data)

        try:
            assert (await call("register", registration("w-2", node="node-a")))["outcome"] == "REGISTERED"
            monkeypatch.setattr(registry, "_remove_if_unbound", removal_failed)  # as if every removal failed
            moved = binding_moved(registry)
            await js.publish(f"$KV.{bucket_name(prefix, 'settings')}.worker-nodes",
                             encode_nodes({"w-1": "node-a", "w-2": "node-b"}))
            await asyncio.wait_for(moved.wait(), 10)  # this replica has the binding
            put = (await js.stream_info(heartbeats)).state.last_seq
            for _ in range(4):
                refused = await call("heartbeat", {})
                assert refused["error"]["code"] == "FAILED_PRECONDITION" and refused["error"]["field"] == "node"
                assert "registered on node 'node-a'" in refused["error"]["message"]
            assert (await js.stream_info(heartbeats)).state.last_seq == put  # nothing put: the clock runs out
            assert (await call("register", registration("w-2", node="node-b")))["outcome"] == "UPDATED"
            assert "ttl_s" in await call("heartbeat", {})
        finally:
            await nc.close()


async def test_a_worker_the_roster_does_not_have_is_judged_on_the_node_its_history_names(nats_server, prefix,
                                                                                         monkeypatch):
    """docs/registry.md, "Who may beat": a worker registered on a node the binding does not give it is
    refused its heartbeats, and so is one the roster does not have (its fold stalled), by the node its
    history names. Here w-2 registers on node-a while the replica's fold hears nothing (the barrier
    cannot be had), then the binding gives w-2 node-b (the look that would remove it stopped, as if it
    failed): its heartbeats, answered from its history, are refused on `node`, nothing put. Kills the
    mutant of `RegistryService.heartbeat` that judges the roster's node only (none, for a worker it
    does not have: not judged, and the beat put)."""
    async with running_registry(nats_server.url, prefix) as registry:
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        heartbeats = f"KV_{bucket_name(prefix, 'heartbeats')}"
        try:
            monkeypatch.setattr(registry, "_remove_if_unbound", removal_failed)  # as if every removal failed
            registry.fold.barrier_timeout = 0.2
            await registry.fold._sub.unsubscribe()  # the replica hears of no worker event from now on
            registered = await registry.register("w-2", msgspec.convert(registration("w-2", node="node-a"),
                                                                        RegisterWorker))
            assert registered.outcome is RegisterOutcome.REGISTERED and not registry.roster.alive("w-2")
            moved = binding_moved(registry)
            await js.publish(f"$KV.{bucket_name(prefix, 'settings')}.worker-nodes",
                             encode_nodes({"w-1": "node-a", "w-2": "node-b"}))
            await asyncio.wait_for(moved.wait(), 10)  # this replica has the binding
            put = (await js.stream_info(heartbeats)).state.last_seq
            with pytest.raises(ContractError) as refused:
                await registry.heartbeat("w-2", Heartbeat())
            assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "node"), refused.value
            assert "registered on node 'node-a'" in refused.value.message
            assert (await js.stream_info(heartbeats)).state.last_seq == put  # nothing put: the clock runs out
        finally:
            await nc.close()


async def test_a_look_that_finds_a_worker_on_its_own_node_leaves_its_heartbeat(nats_server, prefix):
    """The look for unbound workers decides on the worker's history (`Worker.remove_unbound`): a
    worker the roster had on another node, registered on its own since, is left registered, nothing
    written, and its heartbeat with it: only a removal that was written drops it. Dropped by a removal
    that wrote nothing, the live worker's key held a tombstone: were its agent to stop then, no marker
    would ever come, and the silent worker stayed registered until a reconciliation. Kills the mutant
    of `RegistryService._remove` that drops the heartbeat whether or not the removal wrote."""
    nc = await nats.connect(nats_server.url)
    try:
        async with running_registry(nats_server.url, prefix) as registry:
            changed = asyncio.Event()
            registry.binding.on_change = changed.set  # (the look itself is the test's to run)
            binding = {"w-1": "node-a"}
            await nc.jetstream().publish(f"$KV.{bucket_name(prefix, 'settings')}.worker-nodes", encode_nodes(binding))
            while registry.binding.judged_nodes != binding:
                await asyncio.wait_for(changed.wait(), 10)
                changed.clear()
            registered = await registry.register("w-1", msgspec.convert(registration("w-1", node="node-a"),
                                                                        RegisterWorker))
            beat = await registry.liveness.last_entry("w-1")
            await registry._remove_if_unbound("w-1", "node-b")  # a look that read w-1 on node-b before it moved
            assert await last_seq(nc, prefix) == registered.seq + 1  # nothing written after its fence
            assert await registry.liveness.state("w-1") == "beating"
            assert await registry.liveness.last_entry("w-1") == beat
    finally:
        await nc.close()


async def test_a_registration_a_lagging_replica_takes_on_the_binding_it_had_is_removed_by_a_replica_that_has_the_new_one(
        nats_server, prefix):
    """Two replicas; the binding's change is not delivered to one of them (its consumer lost with a
    connection, not made again yet), which takes w-1's registration on the node the change took from
    it, as the binding it has allows. The other replica, which has the change and has removed w-1 from
    that node already, folds the new registration and removes it at once: the worker is removed as soon
    as the binding reaches a replica, not once it reaches the last one (meanwhile it beat through the
    lagging replica, drawing that node's LOCAL resumes). And the lagging replica, folding w-1's
    registration on its new node, reads the binding at the bucket's leader before it judges: it does
    not remove a worker the change put where it is."""
    nc = await nats.connect(nats_server.url)
    settings = f"$KV.{bucket_name(prefix, 'settings')}.worker-nodes"

    async def following(registry, nodes: dict) -> None:
        """Until the replica judges by `nodes`: woken by each change of its binding (`on_change`)."""
        changed = asyncio.Event()
        told = registry.binding.on_change

        def on_change() -> None:
            changed.set()
            if told is not None:
                told()

        registry.binding.on_change = on_change
        try:
            while registry.binding.judged_nodes != nodes:
                await changed.wait()
                changed.clear()
        finally:
            registry.binding.on_change = told

    def request(node: str) -> RegisterWorker:
        return msgspec.convert(registration("w-1", node=node), RegisterWorker)

    try:
        async with running_registry(nats_server.url, prefix) as lagging, \
                running_registry(nats_server.url, prefix) as current:
            before = {"w-1": "node-a", "w-2": "node-b"}
            await nc.jetstream().publish(settings, encode_nodes(before))
            await asyncio.wait_for(asyncio.gather(following(lagging, before), following(current, before)), 10)
            assert (await lagging.register("w-1", request("node-a"))).outcome is RegisterOutcome.REGISTERED

            await lagging.binding.stop()  # the change is not delivered to it
            after = {"w-1": "node-b", "w-2": "node-a"}
            await nc.jetstream().publish(settings, encode_nodes(after))
            await asyncio.wait_for(following(current, after), 10)
            removed, _ = await wait_event(nc, prefix, "w-1", WorkerRemoved)

            again = await lagging.register("w-1", request("node-a"))  # on the binding it has
            assert again.outcome is RegisterOutcome.REGISTERED and lagging.binding.judged_nodes == before
            seq, removal = await wait_event(nc, prefix, "w-1", WorkerRemoved, after=again.seq, timeout=10)
            assert removed < again.seq < seq and removal.reason == unbound_reason("node-a")
            with pytest.raises(ContractError) as gone:  # its heartbeats through the lagging replica too
                await lagging.heartbeat("w-1", Heartbeat())
            assert gone.value.code is ErrorCode.NOT_FOUND

            own = await current.register("w-1", request("node-b"))  # on its own node: a new life
            assert own.outcome is RegisterOutcome.REGISTERED
            # the lagging replica folds it, on a node its binding does not give w-1, and looks: the look reads
            # the change at the bucket's leader first (without that read it never has it, and removes w-1)
            await asyncio.wait_for(following(lagging, after), 10)
            assert await last_seq(nc, prefix) == own.seq + 1  # its fence: no removal after it
            assert (await lagging.heartbeat("w-1", Heartbeat())).ttl_s > 0
    finally:
        await nc.close()
