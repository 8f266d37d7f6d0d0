"""The node's token (`--node-token-file`): which disk of its node a worker runs on, for rule 5's LOCAL images.

The agent reads the file on the disk of the node's LOCAL snapshots, makes it when absent (one token for agents
of the node starting at once), refuses a file it did not write, and every registration it sends carries the
token; `--print-registration` shows it without making it."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from events.schema import WorkerRegistered
from tests.registry_helpers import CPUINFO, PROBE, agent_config, running_registry, wait_event, worker_events
from tests.test_agent import agent_running
from warmboot.agent import Agent
from warmboot.agent_state import NodeToken, StateFileError
from warmboot.cli import main


# --- the file ------------------------------------------------------------------------------------


def test_a_token_is_made_when_absent_and_read_back_unchanged(tmp_path):
    path = tmp_path / "node.token"
    assert NodeToken(path).read() is None  # a look makes nothing
    assert not path.exists()
    maker = NodeToken(path)
    token = maker.read_or_make()
    assert maker.made  # said by the agent's log
    assert re.fullmatch(r"[0-9a-f]{32}", token), token
    assert path.read_text() == f"{token}\n"
    reader = NodeToken(path)
    assert reader.read_or_make() == token == NodeToken(path).read()  # kept, not made again
    assert not reader.made
    assert path.read_text() == f"{token}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node.token"]  # no temporary file left
    other = NodeToken(tmp_path / "other.token").read_or_make()
    assert other != token  # random: another disk's file makes another token


def test_agents_of_a_node_starting_at_once_agree_on_one_token(tmp_path):
    """20 makers at once on one absent file, round after round: each reads the same token, the one the file
    holds; exactly one file, no temporary file left beside it. (Threads: each maker's syscalls run outside the
    GIL; a maker that wrote its token over the file made the rounds disagree every time, one that looked for
    the file before writing it over now and then.)"""
    for round_ in range(30):
        directory = tmp_path / f"round-{round_}"
        directory.mkdir()
        path = directory / "node.token"
        start = threading.Barrier(20)
        tokens: list[str] = []

        def make() -> None:
            start.wait()
            try:
                tokens.append(NodeToken(path).read_or_make())
            except Exception as e:  # noqa: BLE001 - said by the assertion below
                tokens.append(f"error: {e}")

        threads = [threading.Thread(target=make) for _ in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert tokens == [path.read_text().rstrip("\n")] * 20, (round_, set(tokens))
        assert [p.name for p in directory.iterdir()] == ["node.token"]


@pytest.mark.parametrize("text", ["not a token!\n", "", "\n", "a" * 129 + "\n", "-abc\n", "tok en\n", "\xff\xfe\n"],
                         ids=["words", "empty", "newline", "too-long", "leading-dash", "space", "binary"])
def test_a_file_warmboot_did_not_write_is_refused_naming_it_and_left_alone(tmp_path, text):
    path = tmp_path / "node.token"
    path.write_bytes(text.encode("latin-1"))
    for call in (NodeToken(path).read, NodeToken(path).read_or_make):
        with pytest.raises(StateFileError) as refused:
            call()
        said = str(refused.value)
        assert said.startswith(f"node token file {path}: holds no node token"), said
        assert "not written by warmboot" in said and "give up the LOCAL snapshots written on this disk" in said
    assert path.read_bytes() == text.encode("latin-1")  # not replaced by a new token


def test_an_unreadable_file_and_a_missing_directory_are_refused_naming_them(tmp_path):
    path = tmp_path / "node.token"
    path.mkdir()  # not a file: cannot be read
    with pytest.raises(StateFileError, match=rf"^node token file {re.escape(str(path))}: cannot read: "):
        NodeToken(path).read_or_make()
    missing = tmp_path / "not-mounted" / "node.token"
    with pytest.raises(StateFileError) as refused:
        NodeToken(missing).read_or_make()
    assert f"no directory {missing.parent}" in str(refused.value) and "mount the disk" in str(refused.value)
    assert not missing.parent.exists()  # not made


def test_any_id_is_a_token(tmp_path):
    """A token is an Id, as the schema's `node_token` is: one of 128 characters is read as it is (the tokens
    the agent makes are 32 hex characters)."""
    path = tmp_path / "node.token"
    path.write_text("A" + "b_-9" * 31 + "xyz\n")
    assert NodeToken(path).read_or_make() == "A" + "b_-9" * 31 + "xyz"


# --- the command line ------------------------------------------------------------------------------


def cli_agent(tmp_path: Path, *more: str, env: dict[str, str] | None = None):
    config = tmp_path / "agent.toml"
    config.write_text(agent_config("v1"))
    return CliRunner().invoke(main, ["agent", "--worker-id", "w-a", "--node", "node-a", "--config", str(config),
                                     "--cpuinfo", str(CPUINFO), "--arch", "amd64", *more], env=env)


def test_print_registration_shows_the_token_and_never_makes_the_file(tmp_path):
    path = tmp_path / "node.token"
    absent = cli_agent(tmp_path, "--print-registration", "--node-token-file", str(path))
    assert absent.exit_code == 0, absent.output
    assert json.loads(absent.stdout)["node_token"] is None
    assert not path.exists()  # a look, not the agent's start
    path.write_text("d1sk-7\n")
    present = cli_agent(tmp_path, "--print-registration", "--node-token-file", str(path))
    assert present.exit_code == 0, present.output
    assert json.loads(present.stdout)["node_token"] == "d1sk-7"
    by_env = cli_agent(tmp_path, "--print-registration", env={"WARMBOOT_NODE_TOKEN_FILE": str(path)})
    assert by_env.exit_code == 0 and json.loads(by_env.stdout)["node_token"] == "d1sk-7", by_env.output
    without = cli_agent(tmp_path, "--print-registration")
    assert without.exit_code == 0 and json.loads(without.stdout)["node_token"] is None, without.output
    path.write_text("not a token!\n")
    refused = cli_agent(tmp_path, "--print-registration", "--node-token-file", str(path))
    assert refused.exit_code == 1 and f"error: node token file {path}: holds no node token" in refused.output


# --- end to end: a real registry on a real server ----------------------------------------------------


async def agent_process(nats_url: str, prefix: str, tmp_path: Path, worker_id: str, token_file: Path | None):
    """`warmboot agent` of `worker_id` on node-a with `--node-token-file token_file` (None: without), a process
    of its own."""
    config = tmp_path / f"{worker_id}.toml"
    config.write_text(agent_config("v1"))
    token = ["--node-token-file", str(token_file)] if token_file is not None else []
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from warmboot.cli import main; main()",
        "agent", "--nats", nats_url, "--worker-id", worker_id, "--node", "node-a", "--config", str(config),
        "--prefix", prefix, "--cpuinfo", str(CPUINFO), "--arch", "amd64", *token,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def ended(process) -> tuple[int, str]:
    """`process` stopped (SIGTERM if it still runs; killed if it has not ended 15 s after): its exit status and
    its output."""
    if process.returncode is None:
        process.terminate()
    try:
        await asyncio.wait_for(process.wait(), 15)
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
    return process.returncode, await output_of(process)


async def output_of(process) -> str:
    """What the ended `process` wrote (its output is a few lines: the pipes never fill)."""
    return (await process.stdout.read() + await process.stderr.read()).decode(errors="replace")


async def test_every_registration_the_agent_sends_carries_the_file_s_token(nats_url, nc, prefix, tmp_path):
    """Heard at the registry, over NATS: the registration carries the token the agent made in the file; an
    agent without the option sends none."""
    config = tmp_path / "agent.toml"
    config.write_text(agent_config("v1"))
    path = tmp_path / "node.token"
    heard: asyncio.Queue = asyncio.Queue()
    async with running_registry(nats_url, prefix, heard={"register": heard.put_nowait}):
        agent = Agent(nats_url, "w-a", "node-a", config, prefix=prefix, watch_interval_s=0.05, probe=PROBE,
                      node_token_file=path)
        token = path.read_text().rstrip("\n")  # made at the start, before the first registration
        async with agent_running(agent):
            sent = [await asyncio.wait_for(heard.get(), 20)]
            _, registered = await wait_event(nc, prefix, "w-a", WorkerRegistered)
            # an edit registers again: with the token too
            config.write_text(agent_config("v2", ("v1",)))
            while sent[-1].sandbox_classes[0].default_runtime.name != "gvisor-v2":
                sent.append(await asyncio.wait_for(heard.get(), 20))
        assert [(r.worker_id, r.node_token) for r in sent] == [("w-a", token)] * len(sent) and len(sent) >= 2
        assert registered.node_token == token  # recorded by the registry
        assert registered.worker_id == "w-a"
        async with agent_running(Agent(nats_url, "w-n", "node-a", config, prefix=prefix, probe=PROBE)):
            while (plain := await asyncio.wait_for(heard.get(), 20)).worker_id != "w-n":
                pass
        assert plain.node_token is None


async def test_two_workers_of_a_node_given_one_file_register_one_token(nats_url, nc, prefix, tmp_path):
    """Two `warmboot agent` processes started at once, the file absent: one token made, both register it."""
    path = tmp_path / "node.token"
    heard: asyncio.Queue = asyncio.Queue()
    async with running_registry(nats_url, prefix, heard={"register": heard.put_nowait}):
        processes = [await agent_process(nats_url, prefix, tmp_path, worker_id, path) for worker_id in ("w-1", "w-2")]
        try:
            sent = {}
            while len(sent) < 2:
                request = await asyncio.wait_for(heard.get(), 30)
                sent[request.worker_id] = request.node_token
            events = [(await wait_event(nc, prefix, worker_id, WorkerRegistered))[1] for worker_id in ("w-1", "w-2")]
        finally:
            outcomes = [await ended(process) for process in processes]
    token = path.read_text().rstrip("\n")
    assert re.fullmatch(r"[0-9a-f]{32}", token)
    assert sent == {"w-1": token, "w-2": token}
    assert [status for status, _ in outcomes] == [0, 0], outcomes
    assert [event.node_token for event in events] == [token, token]  # recorded by the registry
    assert [event.worker_id for event in events] == ["w-1", "w-2"]
    # the one that made the file says so, as a warning (a new disk: the node's images of another disk are not
    # restored here; a disk only not mounted is said how to recover); the other names the token it read
    made = f"node token file {path} was absent: made node token {token}, a new disk of node node-a ("
    read = f"INFO warmboot.agent: node token {token} (file {path})"
    assert sorted((made in output, read in output) for _, output in outcomes) == [(False, True), (True, False)], \
        outcomes
    warned = next(output for _, output in outcomes if made in output)
    assert "WARNING warmboot.agent: " + made in warned
    assert "stop the agent, delete" in warned and "mount the disk" in warned


async def test_an_agent_given_a_corrupt_token_file_exits_and_registers_nothing(nats_url, nc, prefix, tmp_path):
    path = tmp_path / "node.token"
    path.write_text("not a token!\n")
    heard: list = []
    async with running_registry(nats_url, prefix, heard={"register": heard.append}):
        process = await agent_process(nats_url, prefix, tmp_path, "w-c", path)
        status, output = await ended_by_itself(process)
    assert status == 1, output
    assert f"error: node token file {path}: holds no node token" in output
    assert heard == [] and await worker_events(nc, prefix, "w-c") == []
    assert path.read_text() == "not a token!\n"


async def ended_by_itself(process) -> tuple[int, str]:
    """The exit status and output of `process`, which ends by itself (killed if not within 30 s: a failure)."""
    try:
        await asyncio.wait_for(process.wait(), 30)
    except asyncio.TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"the agent did not exit by itself; killed. Its output: {await output_of(process)}") from None
    return process.returncode, await output_of(process)


async def test_an_agent_restarted_without_its_token_file_is_refused_and_says_so(nats_url, nc, prefix, tmp_path):
    """Its worker registered a token before: the registry refuses a registration without one (it could be the
    machine that replaced the node's first, taken as on that first disk), and the agent exits saying why."""
    path = tmp_path / "node.token"
    first = await agent_process(nats_url, prefix, tmp_path, "w-r", path)
    async with running_registry(nats_url, prefix):
        await wait_event(nc, prefix, "w-r", WorkerRegistered)
        status, output = await ended(first)
        assert status == 0, output
        events = await worker_events(nc, prefix, "w-r")
        again = await agent_process(nats_url, prefix, tmp_path, "w-r", None)
        status, output = await ended_by_itself(again)
    assert status == 1, output
    assert "node_token" in output and "--node-token-file" in output
    assert await worker_events(nc, prefix, "w-r") == events  # nothing written
