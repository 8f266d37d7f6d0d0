"""What a command says about its NATS URL and its server: a URL nats-py cannot connect to is
refused before anything runs, naming --nats; a server that does not answer ends a one-shot
command with one line naming it, and a service waiting for its server logs each error once,
not a traceback per attempt (nats-py's default)."""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import asynccontextmanager
import logging
import os
import socket
import threading

import nats.errors
import pytest
from click.testing import CliRunner

from events.natsauth import check_url
from events.natspy.connections import ErrorsOnce
from tests.registry_helpers import CPUINFO, agent_config
from tests.secured_helpers import Serve
from warmboot.cli import main
from warmboot.natsserver import NatsServer, free_port


@pytest.mark.parametrize("url", ["nats://127.0.0.1:4222", "127.0.0.1:4222", "tls://h", "ws://h:80",
                                 "nats://svc:secret@h:1,nats://h2:2"])
def test_a_url_nats_py_connects_to_is_taken_as_it_is(url):
    assert check_url(url) == url


@pytest.mark.parametrize("url, says", [
    ("nats://127.0.0.1:notaport", "'nats://127.0.0.1:notaport': the port must be a number"),
    ("nats://h:99999", "the port must be a number from 0 to 65535"),
    ("http://h:4222", "the scheme must be one of nats, tls, ws, wss, not 'http'"),
    ("nats://", "'nats://' names no host"),
    ("nats://a:1,,nats://b:2", "has an empty member"),
    ("nats://svc:secret@h:x", "'nats://h:x': the port"),  # the password is not shown
    ("NATS://127.0.0.1:4222", "wss (in lower case), not 'NATS'"),  # nats-py would dial a host named NATS
    ("nats://svc:se/cret@h:1", "'nats://h:1': the user or password holds '/', '?' or '#'"),
    ("nats://svc:se#cret@h:1", "nats-py does not decode %-escapes: use a password without them"),
])
def test_a_url_nats_py_cannot_connect_to_is_refused_naming_the_member(url, says):
    with pytest.raises(ValueError) as refused:
        check_url(url)
    assert says in str(refused.value) and "secret" not in str(refused.value)


@pytest.mark.parametrize("command", [["workers"], ["serve", "scheduler"],
                                     ["agent", "--worker-id", "w-1", "--node", "n-1", "--config", "x.toml"]])
def test_every_command_refuses_a_bad_nats_url_before_it_runs(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.toml").write_text("")  # there (the agent refuses a --config that is not, first)
    result = CliRunner().invoke(main, [*command, "--nats", "nats://127.0.0.1:notaport"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--nats'" in result.output and "the port must be a number" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("args, says", [
    (["nosuch"], "error: No such command 'nosuch'."),
    (["--nosuch"], "error: No such option '--nosuch'."),
    (["actor", "create"], "error: Missing argument 'ACTOR_ID'."),
    (["workers", "--nats", "nats://h:x"], "error: Invalid value for '--nats'"),
    (["actor", "list", "--state", "warm"], "error: Invalid value for '--state'"),
])
def test_a_usage_error_is_printed_as_every_error_is_with_click_s_usage_and_status(args, says):
    """click's own usage errors said `Error: ...` where warmboot's refusals say `error: ...`: one
    style now (cli.Commands), click's usage line and hint and its exit status 2 kept."""
    result = CliRunner().invoke(main, args, prog_name="warmboot")
    assert result.exit_code == 2, result.output
    assert says in result.output and "Usage: warmboot" in result.output, result.output
    assert "Error" not in result.output, result.output


@pytest.mark.parametrize("url, where, warned", [
    ("nats://svc:secret@127.0.0.1:{port}", "argv", True),
    ("nats://127.0.0.1:1,nats://s3cr3t-token@127.0.0.1:{port}", "argv", True),  # a token, in any member
    ("nats://svc:secret@127.0.0.1:{port}", "env", False),  # NATS_URL: not in the process list
    ("nats://127.0.0.1:{port}", "argv", False),
])
def test_a_password_on_the_command_line_is_warned_of(tmp_path, url, where, warned):
    """Any user of the machine reads a process's arguments (ps): a password or token in --nats is
    warned of (on stderr, naming $NATS_URL and --nkey-seed), and never shown; the command runs."""
    url = url.format(port=free_port())
    config = tmp_path / "agent.toml"
    config.write_text(agent_config("v1"))
    command = ["agent", "--worker-id", "w-1", "--node", "n-1", "--config", str(config), "--print-registration",
               "--cpuinfo", str(CPUINFO), "--arch", "amd64"]
    args, env = (command + ["--nats", url], {}) if where == "argv" else (command, {"NATS_URL": url})
    result = CliRunner().invoke(main, args, env=env)
    assert result.exit_code == 0, result.output
    assert ("warning: --nats carries a password (or token)" in result.output) is warned, result.output
    if warned:
        assert "$NATS_URL" in result.output and "--nkey-seed" in result.output
    assert "secret" not in result.output and "s3cr3t" not in result.output


@pytest.mark.parametrize("terminal", [False, True])
def test_a_command_whose_server_does_not_answer_ends_with_one_line_naming_it(monkeypatch, terminal):
    """No traceback per attempt: one line naming the server and why. On a terminal, a line after
    a second says what it waits for and why (a walkthrough sat 5 s before a silent prompt); in a
    pipe, nothing but the error (a script reading the output is not given progress)."""
    from warmboot import cli_common

    monkeypatch.setattr(cli_common, "stderr_is_terminal", lambda: terminal)
    closed = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    result = CliRunner().invoke(main, ["workers", "--nats", closed])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    if not terminal:
        assert len(lines) == 1 and lines[0].startswith(f"error: UNAVAILABLE: cannot reach NATS at {closed} "), lines
        return
    assert len(lines) == 2, result.output
    assert lines[0].startswith(f"waiting up to 5 s for NATS at {closed} (") and "Connect call failed" in lines[0], lines[0]
    assert lines[1].startswith(f"error: UNAVAILABLE: cannot reach NATS at {closed} within 5 s: ")
    assert lines[1].split("within 5 s: ")[1], "the reason is named"


@pytest.mark.parametrize("given", ["option", "environment"])
def test_the_wait_for_a_server_that_does_not_answer_is_the_one_asked_for(given):
    """`--connect-timeout SECONDS` (or $WARMBOOT_CONNECT_TIMEOUT): a script that would rather fail fast, or
    a user who waits out a longer restart, is not held to 5 s."""
    closed = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    args, env = (["--connect-timeout", "0.5"], {}) if given == "option" else ([], {"WARMBOOT_CONNECT_TIMEOUT": "0.5"})
    result = CliRunner().invoke(main, ["workers", "--nats", closed, *args], env=env)
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"error: UNAVAILABLE: cannot reach NATS at {closed} within 0.5 s: "), result.output


@pytest.mark.parametrize("value, says", [
    ("0", "0.0 is not in the range 0<x<=3600.0"),
    ("-1", "-1.0 is not in the range 0<x<=3600.0"),
    ("3601", "3601.0 is not in the range 0<x<=3600.0"),
    ("inf", "inf is not in the range 0<x<=3600.0"),
    ("nan", "nan is not a number of seconds"),
    ("1m", "'1m' is not a valid float"),
])
def test_a_connect_timeout_that_is_no_wait_is_a_usage_error(value, says):
    closed = f"nats://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(main, ["actor", "stop", "a-1", "--nats", closed, "--connect-timeout", value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '--connect-timeout' (env var: 'WARMBOOT_CONNECT_TIMEOUT'): {says}" in result.output
    assert "UNAVAILABLE" not in result.output


async def test_the_client_library_gives_up_on_a_server_that_does_not_answer_naming_it(caplog):
    """`Client.connect` to a closed port: UNAVAILABLE naming the server within its bound (it
    waited for ever, printing nats-py's traceback every 0.25 s). The error is the one raised, and not
    logged as well: logged once, it reached a script that set up no logging as a second, bare line on
    stderr (Python's last-resort handler; a user trial). What a connection meets once made is logged:
    `test_a_client_closed_while_its_server_is_down_closes_without_an_error`."""
    from events.errors import ContractError
    from events.schema import ErrorCode
    from warmboot.client import Client

    closed = f"nats://svc:secret@127.0.0.1:{free_port()}"
    caplog.set_level(logging.WARNING)
    with pytest.raises(ContractError) as refused:
        await Client.connect(closed, connect_timeout=1.0)
    assert refused.value.code is ErrorCode.UNAVAILABLE
    assert refused.value.message.startswith(f"cannot reach NATS at nats://127.0.0.1:{closed.rsplit(':', 1)[1]} "
                                            "within 1 s: ")
    assert [r.getMessage() for r in caplog.records] == []


@pytest.mark.parametrize("attempts", [1, 3])
async def test_a_request_no_service_answers_says_how_it_was_tried_and_names_the_prefix(nats_url, prefix, attempts):
    """It said only "no service answers SUBJECT" (a review): how often and over how long it was
    sent, and the likely cause, the prefix it used or its service not running. UNAVAILABLE as before."""
    import re

    from events.errors import ContractError
    from events.schema import ErrorCode
    from warmboot.client import Client

    async with await Client.connect(nats_url, prefix, attempts=attempts) as wb:
        with pytest.raises(ContractError) as refused:
            await wb.explain("a-1")
    assert (refused.value.code, refused.value.field) == (ErrorCode.UNAVAILABLE, None)
    tried = "1 attempt" if attempts == 1 else f"{attempts} attempts"
    assert re.fullmatch(rf"no service answers {prefix}\.scheduler\.explain\.a-1 after {tried} in \d+\.\d s: is "
                        rf"'{prefix}' the deployment's prefix, and is its scheduler running\?",
                        refused.value.message), refused.value.message
    assert wb.retries == attempts - 1


async def test_a_resume_nothing_answered_says_the_error_alone(nats_url, prefix):
    """`actor resume` asks the snapshotter which life the actor is in first, and, not told, says on stderr that
    the resume goes without that fence. With nothing serving the prefix (a mistyped `--prefix`), that note came
    first, then the error that no scheduler answers either (a user trial): the error alone now. The note when a
    scheduler answers: tests/test_lifecycle_cli.py (`..._passes_over_an_event_of_a_newer_version_...`)."""
    result = await asyncio.to_thread(CliRunner().invoke, main,
                                     ["actor", "resume", "a-1", "--nats", nats_url, "--prefix", prefix])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"error: UNAVAILABLE: no service answers {prefix}.scheduler.resume.a-1 after 6 "
                                    "attempts in "), result.stderr
    assert result.stderr.count("\n") == 1 and "note:" not in result.stderr, result.stderr


def test_an_error_is_logged_once_while_it_repeats_and_again_after_a_reconnect(caplog):
    errors = ErrorsOnce(logging.getLogger("test.nats"), "nats://h:1")
    refused, reset = ConnectionRefusedError(111, "Connection refused"), ConnectionResetError(104, "reset")
    other = ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 2)")  # another member of a cluster

    async def report(*seen):
        for error in seen:
            await errors.report(error)

    with caplog.at_level(logging.WARNING, logger="test.nats"):
        asyncio.run(report(refused, other, refused, reset, reset, TimeoutError()))
        errors.reset()  # connected again: the same error is news
        asyncio.run(report(TimeoutError()))
    assert [r.getMessage() for r in caplog.records] == [
        "NATS at nats://h:1: [Errno 111] Connection refused", "NATS at nats://h:1: [Errno 104] reset",
        "NATS at nats://h:1: TimeoutError", "NATS at nats://h:1: TimeoutError"]
    assert all(r.exc_info is None for r in caplog.records)  # one line each, no traceback
    assert isinstance(errors.last, TimeoutError)
    silent = ErrorsOnce(None)
    asyncio.run(silent.report(refused))
    assert silent.last is refused
    caplog.clear()
    alternating = ErrorsOnce(logging.getLogger("test.nats"), "nats://h:1")
    denied = nats.errors.Error("nats: 'Authorization Violation'")  # and the reset that follows it, again and again
    with caplog.at_level(logging.WARNING, logger="test.nats"):
        asyncio.run(report_all(alternating, denied, reset, denied, reset, denied))
    assert [r.getMessage() for r in caplog.records] == ["NATS at nats://h:1: nats: 'Authorization Violation'"]
    assert alternating.refusal is denied and alternating.last is denied
    caplog.clear()
    first_reset = ErrorsOnce(logging.getLogger("test.nats"), "nats://h:1")  # a reset before any refusal is news
    with caplog.at_level(logging.WARNING, logger="test.nats"):
        asyncio.run(report_all(first_reset, reset, denied, reset))
    assert [r.getMessage() for r in caplog.records] == [
        "NATS at nats://h:1: [Errno 104] reset", "NATS at nats://h:1: nats: 'Authorization Violation'"]


async def report_all(errors: ErrorsOnce, *seen: Exception) -> None:
    for error in seen:
        await errors.report(error)


def test_a_service_waits_for_its_server_saying_so_once_and_serves_when_it_comes(tmp_path, prefix):
    port = free_port()
    serve = Serve("scheduler", "--nats", f"nats://127.0.0.1:{port}", "--prefix", prefix)
    started = threading.Thread(target=serve.start, daemon=True)
    started.start()
    server = NatsServer(tmp_path / "nats", port=port)
    try:
        serve.line(f"NATS at nats://127.0.0.1:{port}: ", anywhere=True)  # it has tried, and said why it waits
        server.start()
        started.join(60)
        assert serve.line("serving scheduler")
    finally:
        serve.stop()
        server.stop()
    # nats-py's own callback logs "encountered error" with a traceback, every half second
    assert "Traceback" not in serve.output and "encountered error" not in serve.output, serve.output


# --- more of what a first user runs into (a review that used the CLI as a new user would) ----------


def test_up_refuses_a_bad_prefix_and_port_before_it_starts_anything(tmp_path):
    store = tmp_path / "store"
    for args, says in ((["--prefix", "bad prefix"], "Invalid value for '--prefix'"),
                       (["--port", "70000"], "Invalid value for '--port'")):
        result = CliRunner().invoke(main, ["up", "--store", str(store), *args])
        assert result.exit_code == 2 and says in result.output, result.output
    assert not store.exists()  # nothing started, nothing written


def test_up_refuses_a_store_another_server_writes_and_resets_nothing(tmp_path):
    """Two nats-servers writing one JetStream directory corrupt it, and nats-server does not refuse
    it: a second `up` on the first one's store (a walkthrough) is refused, before its --reset."""
    store = tmp_path / "store"
    running = NatsServer(store.resolve(), name="warmboot").start()  # what `up` starts on it
    try:
        kept = sorted(p.name for p in store.iterdir())
        result = CliRunner().invoke(main, ["up", "--store", str(store), "--port", "0", "--reset",
                                           "--metrics-port", "0"])
        assert result.exit_code == 1, result.output
        assert f"the store {store} is in use by another warmboot up (process {os.getpid()})" in result.output
        assert sorted(p.name for p in store.iterdir()) == kept and running.running  # not reset, still serving
        # its metrics port taken too (the first `up`'s, by default): the store in use is said first (a
        # review: a metrics port checked before the store said that instead, the store in use only after)
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            result = CliRunner().invoke(main, ["up", "--store", str(store), "--port", "0", "--metrics-port",
                                               str(taken.getsockname()[1])])
        assert result.exit_code == 1 and "is in use by another warmboot up" in result.output, result.output
        assert "cannot serve metrics" not in result.output
    finally:
        running.stop()


def test_up_on_a_port_in_use_leaves_no_store_and_says_nothing_of_one(tmp_path):
    """`up --port P` with P taken (a walkthrough): it said "new store" and left an empty store
    directory. Now a store it made is gone again and nothing is said of it; a store that was
    there stays as it was, not said to be reused."""
    held = NatsServer((tmp_path / "other").resolve(), name="other").start()  # a NATS on the port
    try:
        store = tmp_path / "store"
        result = CliRunner().invoke(main, ["up", "--store", str(store), "--port", str(held.port),
                                           "--metrics-port", "0"])
        assert result.exit_code == 1, result.output
        assert f"(is another warmboot or NATS on port {held.port}? try --port 0)" in result.output
        assert "new store" not in result.output and not store.exists()

        kept = tmp_path / "kept"
        NatsServer(kept.resolve(), name="warmboot").start().stop()  # a store with a log in it
        before = sorted(str(p.relative_to(kept)) for p in kept.rglob("*"))
        result = CliRunner().invoke(main, ["up", "--store", str(kept), "--port", str(held.port),
                                           "--metrics-port", "0"])
        assert result.exit_code == 1, result.output
        assert "reusing" not in result.output and "new store" not in result.output
        assert sorted(str(p.relative_to(kept)) for p in kept.rglob("*")) == before
    finally:
        held.stop()


@pytest.mark.parametrize("args, says", [
    (["--ttl", "0"], "Invalid value for '--ttl': 0 is not a number of seconds of at least 1"),
    (["--ttl", "0.5"], "Invalid value for '--ttl': 0.5 is not"),
    (["--ttl", "-3"], "Invalid value for '--ttl'"),
    (["--ttl", "nan"], "Invalid value for '--ttl': nan is not"),
    (["--metrics-port", "99999"], "Invalid value for '--metrics-port': 99999 is not in the range 0<=x<=65535"),
    (["--worker-writes", "-1"], "'--worker-writes' (env var: 'WARMBOOT_WORKER_WRITES'): -1 is not in the range x>=0"),
    (["--worker-write-interval", "0"], "'--worker-write-interval' (env var: 'WARMBOOT_WORKER_WRITE_INTERVAL'): 0 is "
                                       "not a positive number of seconds"),
    (["--worker-write-interval", "inf"], "'WARMBOOT_WORKER_WRITE_INTERVAL'): inf is not a positive number of"),
    (["--worker-write-interval", "nan"], "'WARMBOOT_WORKER_WRITE_INTERVAL'): nan is not a positive number of"),
])
def test_serve_refuses_a_bad_value_before_it_connects(args, says):
    """Named as a usage error before anything runs (they were tracebacks, and only once NATS answered)."""
    closed = f"nats://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(main, ["serve", "registry", "--nats", closed, *args])
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("args, says", [
    (["explain", "a-1", "--min-seq", "abc"], "Invalid value for '--min-seq': 'abc' is not a valid integer."),
    (["actor", "pause", "a-1", "--placement-seq", "x"], "Invalid value for '--placement-seq': 'x' is not a valid integer."),
    (["audit", "replay", "--until", "last"], "Invalid value for '--until': 'last' is not a valid integer."),
    (["whatif", "--class", "gvisor", "--limit", "all"], "Invalid value for '--limit': 'all' is not a valid integer."),
    (["up", "--port", "any"], "Invalid value for '--port': 'any' is not a valid integer."),
    (["serve", "scheduler", "--checkpoint-interval", "1m"],
     "Invalid value for '--checkpoint-interval': '1m' is not a valid float."),
])
def test_a_value_that_is_no_number_is_said_so(args, says):
    """click's ranges said "is not a valid integer range" of a value that is no number at all (a walkthrough)."""
    closed = f"nats://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(main, [*args] + ([] if args[0] == "up" else ["--nats", closed]))
    assert result.exit_code == 2, result.output
    assert says in result.output and "range" not in result.output.splitlines()[-1]


def test_a_metrics_port_taken_is_one_line_naming_it(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["up", "--port", "0", "--metrics-port", str(port),
                                           "--store", str(tmp_path / "store")])
    assert result.exit_code == 1, result.output
    assert (f"error: [Errno 98] cannot serve metrics on 127.0.0.1:{port}: Address already in use; "
            "try another --metrics-port, or 0 for any free one") in result.output
    assert "Traceback" not in result.output


def test_nats_config_bcrypt_without_secrets_is_refused_writing_nothing(tmp_path):
    out = tmp_path / "auth.conf"
    result = CliRunner().invoke(main, ["nats-config", "--auth", "bcrypt", "--worker", "w-1", "--out", str(out)])
    assert result.exit_code == 2 and "--auth bcrypt needs --secrets FILE" in result.output
    assert not out.exists()


def test_schema_check_of_a_missing_file_names_it(tmp_path):
    result = CliRunner().invoke(main, ["schema", "--check", str(tmp_path / "none.json"), "--as", "CreateActor"])
    assert result.exit_code == 2 and "does not exist" in result.output and "Traceback" not in result.output


def test_ids_and_prefixes_are_refused_in_words():
    result = CliRunner().invoke(main, ["nats-config", "--worker", "bad id"])
    assert result.exit_code == 2 and "'bad id' is not an id: 1 to 128 letters, digits" in result.output
    result = CliRunner().invoke(main, ["workers", "--prefix", "Bad"])
    assert result.exit_code == 2 and "must be 1 to 32 lower-case letters" in result.output
    for command in (["audit", "actor", "a b"], ["actor", "show", "a b"], ["worker", "show", "x y"]):
        result = CliRunner().invoke(main, command)  # refused before it connects (a review found them looked up)
        assert result.exit_code == 2 and "is not an id: 1 to 128 letters" in result.output, (command, result.output)
    result = CliRunner().invoke(main, ["actor", "list", "--state", "bogus"])
    assert result.exit_code == 2 and "'bogus' is not one of CREATED, RUNNING, PAUSED, SUSPENDED, STOPPED" in result.output


@pytest.mark.parametrize("args, as_json", [([], False), (["--json"], True), (["-o", "json"], True),
                                           (["-o", "json", "--json"], True), (["--json", "-o", "json"], True)])
def test_json_is_asked_for_either_way_in_any_order(args, as_json):
    import click

    from warmboot.cli_common import json_option

    @click.command()
    @json_option
    def command(as_json: bool) -> None:
        click.echo(repr(as_json))

    result = CliRunner().invoke(command, args)
    assert (result.exit_code, result.output) == (0, f"{as_json!r}\n")


async def test_a_cluster_member_that_refuses_the_password_does_not_end_the_connection(tmp_path):
    """One member of the URL refuses the credentials (a password rotated on it first), the next takes
    them: connected, as nats-py does on its own (the refusal ended the connection at once; found by a
    review). A single server that refuses is said at once."""
    from events.errors import ContractError
    from events.schema import ErrorCode
    from warmboot.connection import connect_within

    old = NatsServer(tmp_path / "a", extra_config='authorization { user: "alice", password: "old" }')
    new = NatsServer(tmp_path / "b", extra_config='authorization { user: "alice", password: "new" }')
    for server in (old, new):
        server.store_dir.mkdir()
        server.start()
    try:
        url = f"nats://alice:new@127.0.0.1:{old.port},nats://alice:new@127.0.0.1:{new.port}"
        nc = await connect_within(url, "test", dont_randomize=True)
        assert nc.connected_url.port == new.port
        await nc.close()
        with pytest.raises(ContractError) as refused:
            await connect_within(f"nats://alice:new@127.0.0.1:{old.port}", "test", 20)
        assert refused.value.code is ErrorCode.FAILED_PRECONDITION and "refuses the sign-in" in refused.value.message
    finally:
        old.stop()
        new.stop()


def test_a_refused_sign_in_says_which_credentials_were_refused(tmp_path):
    """A refused sign-in names where the credentials it signed in with came from: the URL,
    $NATS_USER/$NATS_PASSWORD, $NATS_TOKEN, or none at all. It said "check the user and password or
    token in the URL, or the nkey seed" whatever was given, also to a command signed in by $NATS_USER
    alone, which has none in its URL (found by a trial of the docs)."""
    server = NatsServer(tmp_path / "s", extra_config='authorization { user: "alice", password: "right" }')
    server.store_dir.mkdir()
    server.start()
    try:
        url = f"nats://127.0.0.1:{server.port}"
        for env, says in (({"NATS_URL": f"nats://alice:wrong@127.0.0.1:{server.port}"},
                           "(check the user and password or token in the URL)"),
                          ({"NATS_URL": url, "NATS_USER": "alice", "NATS_PASSWORD": "wrong"},
                           "(check $NATS_USER/$NATS_PASSWORD)"),
                          ({"NATS_URL": url, "NATS_TOKEN": "wrong"}, "(check $NATS_TOKEN)"),
                          ({"NATS_URL": url}, "(no credentials were given: put user:password@ in the URL, or give "
                                              "$NATS_USER/$NATS_PASSWORD, $NATS_TOKEN, $NATS_CREDS or an nkey seed)")):
            env = {"NATS_USER": "", "NATS_PASSWORD": "", "NATS_TOKEN": "", "NATS_CREDS": "", "NATS_NKEY_SEED": "",
                   **env}
            refused = CliRunner().invoke(main, ["workers"], env=env)
            assert refused.exit_code == 1 and "refuses the sign-in" in refused.stderr, refused.output
            assert says in refused.stderr and "wrong" not in refused.stderr.replace(says, ""), refused.stderr
    finally:
        server.stop()


@pytest.mark.parametrize("command", [["workers"], ["serve", "registry"],
                                     ["agent", "--worker-id", "w-1", "--node", "n-1", "--config", "{config}"]])
def test_a_file_that_holds_no_nkey_seed_is_a_usage_error_naming_it(tmp_path, command):
    """--nkey-seed (or $NATS_NKEY_SEED) given another file (the secrets file, a public key): a usage
    error naming the option and the file, quoting nothing of it, before anything connects. It was a
    traceback of nkeys.ErrInvalidSeed from the commands and `serve`, and the agent retried it for ever
    (found by a trial of the docs)."""
    config = tmp_path / "agent.toml"
    config.write_text(agent_config("sha256-1"))
    wrong = tmp_path / "secrets.json"
    wrong.write_text('{"w-1": "the-password-itself"}')
    args = [part.replace("{config}", str(config)) for part in command]
    for how, env in ((["--nkey-seed", str(wrong)], {}), ([], {"NATS_NKEY_SEED": str(wrong)})):
        result = CliRunner().invoke(main, [*args, "--nats", "nats://127.0.0.1:1", *how], env=env)
        assert result.exit_code == 2, result.output
        assert "Invalid value for '--nkey-seed'" in result.stderr and f"{str(wrong)!r} holds no nkey seed" \
            in result.stderr, result.output
        assert "the-password-itself" not in result.output and "Traceback" not in result.output


async def test_the_client_refuses_a_file_that_holds_no_nkey_seed_before_it_connects(tmp_path):
    """`Client.connect(nkeys_seed=...)` of a file that is no seed: FAILED_PRECONDITION naming it (it
    was nkeys.ErrInvalidSeed, raised from inside nats-py's connect)."""
    from events.errors import ContractError
    from events.schema import ErrorCode
    from warmboot.client import Client

    wrong = tmp_path / "public.nk"
    wrong.write_text("UDXU4RCSJNZOIQHZNWXHXORDPRTGNJAHAHFRGZNEEJCPQTT2M7NLCNF4\n")
    with pytest.raises(ContractError) as refused:
        await Client.connect("nats://127.0.0.1:1", nkeys_seed=str(wrong), connect_timeout=1)
    assert refused.value.code is ErrorCode.FAILED_PRECONDITION
    assert f"{str(wrong)!r} holds no nkey seed" in refused.value.message, refused.value.message


async def test_the_client_refuses_a_bad_prefix_or_option_leaving_no_connection_open(nats_url, monkeypatch):
    """`Client.connect(url, "Bad Prefix")` connected first, then raised check_prefix's ValueError with
    the connection left open (its reader, flusher and pinger tasks running, reconnecting for ever),
    and so did a mistyped Client option (`timout=`), with its TypeError (an audit's finding). The
    prefix is INVALID_ARGUMENT naming it, before anything connects; a mistyped option raises its
    TypeError before anything connects too (it connected first: a user trial's finding)."""
    import warmboot.client as client_module
    from events.errors import ContractError
    from events.schema import ErrorCode
    from warmboot.client import Client

    made = []

    async def recording(*args, **kwargs):
        made.append(await connect_within(*args, **kwargs))
        return made[-1]

    connect_within = client_module.connect_within
    monkeypatch.setattr(client_module, "connect_within", recording)
    with pytest.raises(ContractError) as refused:
        await Client.connect(nats_url, "Bad Prefix")
    assert refused.value.code is ErrorCode.INVALID_ARGUMENT and refused.value.field == "prefix", refused.value
    assert "'Bad Prefix'" in refused.value.message
    assert made == []  # refused before connecting
    with pytest.raises(TypeError, match="timout"):
        await Client.connect(nats_url, "tp", timout=3)
    assert made == []  # refused before connecting
    async with await Client.connect(nats_url, "tp", timeout=3, attempts=2) as wb:  # its options, spelt right
        assert (wb.timeout, wb.attempts) == (3, 2) and len(made) == 1
    assert made[0].is_closed



async def test_an_id_that_is_not_a_string_is_refused_naming_its_field_and_nothing_is_sent(nats_url):
    """`wb.resume(5)` raised the regular expression's own TypeError ("expected string or bytes-like
    object, got 'int'"), naming neither the argument nor what an id is (a user trial's finding). Now
    INVALID_ARGUMENT naming the field, as a malformed id is, before anything is sent."""
    import nats

    from events.errors import ContractError
    from events.schema import ErrorCode
    from warmboot.client import Client

    nc = await nats.connect(nats_url)
    watch = await nc.subscribe("tp.>")
    wb = Client(nc, "tp", attempts=1, timeout=1)
    try:
        for call, field in ((lambda: wb.resume(5), "actor_id"), (lambda: wb.pause(7), "actor_id"),
                            (lambda: wb.status(b"a-1"), "actor_id"), (lambda: wb.drain(3), "worker_id")):
            with pytest.raises(ContractError) as refused:
                await call()
            assert (refused.value.code, refused.value.field) == (ErrorCode.INVALID_ARGUMENT, field), refused.value
            assert "is not an id: 1 to 128 letters" in refused.value.message, refused.value.message
        await nc.flush()
        assert watch.pending_msgs == 0  # nothing sent
    finally:
        await watch.unsubscribe()
        await nc.close()

async def test_a_request_within_max_payload_whose_headers_take_it_past_is_refused_unsent(tmp_path):
    """The server's max_payload bounds a message's header block and payload together (a message past it gets
    the connection cut: "Maximum Payload Violation"); nats-py's own check is on the payload alone. A write's
    body within a few bytes of max_payload, its wait header (`Warmboot-Wait-Ms`) taking it past, was sent: the
    server cut the connection, every request on it was lost, and the caller was told UNAVAILABLE (the agent
    sends such a registration again after each reconnect). Now it is refused as one past max_payload is:
    INVALID_ARGUMENT, nothing sent, the connection kept."""
    from events.codec import encode
    from events.errors import ContractError
    from events.schema import ErrorCode, Placement, ResumeActor
    from warmboot.client import Client

    server = NatsServer(tmp_path, extra_config="max_payload: 64KB\n").start()
    try:
        client = await Client.connect(server.url, "tp", timeout=2, attempts=1)
        limit = client.nc.max_payload
        selectors = {f"k{i}": "v" * 100 for i in range((limit - 200) // 110)}
        body = ResumeActor(selectors=selectors, request_id="r-edge")
        selectors["pad"] = "p" * (limit - 8 - len(encode(body)) - len(',"pad":""'))
        body = ResumeActor(selectors=selectors, request_id="r-edge")
        assert limit - 16 < len(encode(body)) <= limit, len(encode(body))  # the payload alone fits
        with pytest.raises(ContractError) as large:
            await client.request("scheduler", "resume", "a-1", body, Placement)
        assert large.value.code is ErrorCode.INVALID_ARGUMENT, large.value
        assert f"more than NATS takes in a message (its max_payload: {limit} bytes)" in large.value.message
        assert client.nc.is_connected and client.nc.stats["reconnects"] == 0
        await client.close()
    finally:
        server.stop()


async def test_a_request_nats_py_will_not_send_is_a_contract_error_naming_why(tmp_path):
    """What nats-py refuses to send came out of the client as its own exception, not a ContractError
    (an audit's finding): a call after `close` (ConnectionClosedError), a request larger than the
    server's max_payload (MaxPayloadError), one made while reconnecting with the connection's buffer
    full (OutboundBufferLimitError). Now: FAILED_PRECONDITION and INVALID_ARGUMENT, not retried, and
    UNAVAILABLE, retried as a lost request is; each with the request's id."""
    import nats

    from events.errors import ContractError
    from events.natspy.connections import close_given_up
    from events.schema import ErrorCode
    from warmboot.client import Client

    server = NatsServer(tmp_path).start()
    try:
        client = await Client.connect(server.url, "tp", timeout=1, attempts=3)
        with pytest.raises(ContractError) as large:
            await client.resume("a-1", {f"k{i}": "v" * 100 for i in range(25_000)}, request_id="r-big")
        assert large.value.code is ErrorCode.INVALID_ARGUMENT, large.value
        assert "more than NATS takes in a message (its max_payload: 2097152 bytes)" in large.value.message
        assert large.value.request_id == "r-big" and client.retries == 0
        await client.close()
        with pytest.raises(ContractError) as closed:
            await client.resume("a-1", request_id="r-closed")
        assert closed.value.code is ErrorCode.FAILED_PRECONDITION, closed.value
        assert "connection to NATS is closed" in closed.value.message and closed.value.request_id == "r-closed"
        assert client.retries == 0

        gone = asyncio.Event()

        async def disconnected() -> None:
            gone.set()

        nc = await nats.connect(server.url, pending_size=0, max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                                disconnected_cb=disconnected)
        try:
            unbuffered = Client(nc, "tp", timeout=1, attempts=2)
            await asyncio.to_thread(server.stop)
            await asyncio.wait_for(gone.wait(), 10)
            with pytest.raises(ContractError) as full:
                await unbuffered.resume("a-1", request_id="r-full")
            assert full.value.code is ErrorCode.UNAVAILABLE, full.value
            assert "requests waiting to be sent fill the connection's buffer" in full.value.message
            assert full.value.request_id == "r-full" and unbuffered.retries == 1
        finally:
            await close_given_up(nc)  # nats-py's own close of it may raise while disconnected
    finally:
        server.stop()


async def test_a_client_closed_while_its_server_is_down_closes_without_an_error(tmp_path, caplog):
    """An orchestrator leaving `async with await Client.connect(...)` while NATS is down, a request
    sent meanwhile: nats-py's close wrote the request held to be sent onto the lost transport, and
    `close` raised ConnectionResetError (RuntimeError under uvloop) out of the `async with`, the
    subscription's task left running (an audit's finding). Now it closes, and nothing is left. The
    connection lost is logged once, naming the server, to `warmboot.client`."""
    from events.errors import ContractError
    from events.schema import ErrorCode
    from warmboot.client import Client

    server = NatsServer(tmp_path).start()
    try:
        before = asyncio.all_tasks()
        async with await Client.connect(server.url, "tp", timeout=0.3, attempts=1) as client:
            gone = asyncio.Event()

            async def disconnected() -> None:
                gone.set()

            client.nc._disconnected_cb = disconnected
            caplog.set_level(logging.WARNING, logger="warmboot.client")
            await asyncio.to_thread(server.stop)
            await asyncio.wait_for(gone.wait(), 10)
            with pytest.raises(ContractError) as unanswered:  # held by nats-py, to be sent once reconnected
                await client.resume("a-1")
            assert unanswered.value.code is ErrorCode.UNAVAILABLE, unanswered.value
            lost = [r.getMessage() for r in caplog.records if r.name == "warmboot.client"]
            assert lost and all(m.startswith(f"NATS at {server.url}: ") for m in lost), lost
            assert len(lost) == len(set(lost)), lost  # each kind once while it repeats
        assert client.nc.is_closed
        left = [t for t in asyncio.all_tasks() - before if not (t.done() or t.cancelling())]
        assert left == [], left
    finally:
        server.stop()


async def test_a_reply_the_client_cannot_read_is_a_contract_error_naming_the_subject(nats_url, prefix):
    """Something answering on a warmboot subject with what is not the endpoint's reply (another
    version, another program): msgspec's ValidationError or DecodeError came out of the client (an
    audit's finding). It is INTERNAL, naming the subject and what was wrong, with the request's id,
    and not retried."""
    from events.errors import ContractError
    from events.schema import ErrorCode
    from warmboot.client import Client

    async with await Client.connect(nats_url, prefix, timeout=5, attempts=3) as client:
        answers = iter([b'{"worker_id": 5}', b"not json"])

        async def answer(msg) -> None:
            await msg.respond(next(answers))

        await client.nc.subscribe(f"{prefix}.scheduler.resume.*", cb=answer)
        await client.nc.flush()
        for said in ("Expected `str`, got `int` - at `$.worker_id`", "JSON is malformed"):
            with pytest.raises(ContractError) as unreadable:
                await client.resume("a-1", request_id="r-1")
            assert unreadable.value.code is ErrorCode.INTERNAL, unreadable.value
            assert f"the reply from {prefix}.scheduler.resume.a-1 cannot be read as its Assignment" \
                in unreadable.value.message and said in unreadable.value.message, unreadable.value.message
            assert unreadable.value.request_id == "r-1"
        assert client.retries == 0


@pytest.mark.parametrize("url, says", [
    ("nats://[::1", "'nats://[::1': Invalid IPv6 URL"),
    ("nats://127.0.0.1:99999", "the port must be a number from 0 to 65535"),
    ("foo://127.0.0.1:4222", "the scheme must be one of nats, tls, ws, wss, not 'foo'"),
])
async def test_the_client_refuses_a_url_that_is_none_as_the_cli_does(url, says):
    """`Client.connect` of a URL that is none: a ValueError of nats-py's own came out of it for some
    ('Invalid IPv6 URL'), others were UNAVAILABLE after the connect's time-out, as if the server were
    down (an audit's finding). It is INVALID_ARGUMENT (field `servers`) at once, in the words of the
    CLI's --nats."""
    from events.errors import ContractError
    from events.schema import ErrorCode
    from warmboot.client import Client

    with pytest.raises(ContractError) as refused:
        await asyncio.wait_for(Client.connect(url, connect_timeout=30), 10)
    assert refused.value.code is ErrorCode.INVALID_ARGUMENT and refused.value.field == "servers", refused.value
    assert says in refused.value.message, refused.value.message


SIGINT_AT_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                     "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT]); os.execv(sys.argv[1], sys.argv[1:])")


def test_a_ctrl_c_stops_a_command_with_status_130_and_says_so():
    """A one-shot command stopped by Ctrl-C (SIGINT) while it waits for its server: exit status 130
    and "interrupted", as shells report it; it was click's "Aborted!" and status 1, which scripts
    read as the command having failed."""
    import signal
    import socket
    import subprocess
    import sys

    from tests.secured_helpers import WARMBOOT

    with socket.create_server(("127.0.0.1", 0)) as listener:  # greets, then says nothing more
        listener.settimeout(30)
        port = listener.getsockname()[1]
        # started as a shell in a terminal starts it, SIGINT at its default: a process started in the
        # background by a shell without job control (`make test &`, a CI runner) ignores SIGINT, and its
        # children inherit that, so the command never heard the Ctrl-C (it failed that way under xdist)
        command = subprocess.Popen([sys.executable, "-c", SIGINT_AT_DEFAULT, WARMBOOT, "workers", "--nats",
                                    f"nats://127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        try:
            while True:  # the command's connection, told by the name it signs in with: a client of another
                # test reconnecting to a server whose port this listener was given since (the suite runs in
                # two processes) connects too, and a Ctrl-C sent then reached the command as it started
                connection, _ = listener.accept()
                connection.settimeout(30)
                connection.sendall(b'INFO {"server_id":"silent","version":"2.10.0","proto":1,"headers":true,'
                                   b'"max_payload":1048576}\r\n')
                if b'"warmboot-cli"' in connection.recv(65536):  # CONNECT {..., "name": "warmboot-cli", ...}
                    break
                connection.close()
            with connection:  # the command is waiting for the server's answer to its CONNECT and PING
                command.send_signal(signal.SIGINT)
                _, err = command.communicate(timeout=30)
        finally:
            command.kill()
            command.wait()
    assert command.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted" and "Aborted" not in err, err


@asynccontextmanager
async def connecting_to_a_silent_server():
    """`warmboot.connection.connect` (every process's) to a server that takes the TCP connection and
    says nothing: (the connect's task, the server's end of the connection, non-blocking)."""
    import socket

    from warmboot.connection import connect

    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        task = asyncio.ensure_future(connect(f"nats://127.0.0.1:{listener.getsockname()[1]}", "test"))
        connection, _ = await asyncio.wait_for(asyncio.get_running_loop().sock_accept(listener), 10)
        with connection:
            connection.setblocking(False)
            yield task, connection


async def read_to_its_end(connection) -> bool:
    """Whether the client closed its end (the server reads nothing more)."""
    return await asyncio.wait_for(asyncio.get_running_loop().sock_recv(connection, 100), 10) == b""


@pytest.mark.parametrize("turns", [0, 1, 2, 3, 4, 5, 20])
async def test_a_connect_given_up_on_ends_and_closes_its_socket_whenever_it_is_cancelled(turns):
    """`connect` cancelled `turns` turns of the loop after the server took its TCP connection: it ends,
    and its socket is closed (the server reads its end). nats-py's connect, cancelled right as a step
    completed, went on connecting for good (Python 3.11's asyncio.wait_for swallows that cancellation:
    `events.natspy.connections.connecting`), so a Ctrl-C of a command waiting for its server did nothing; and a
    connect given up on mid-handshake left its socket open until the garbage collector came (found by
    a review)."""
    async with connecting_to_a_silent_server() as (task, connection):
        for _ in range(turns):
            await asyncio.sleep(0)  # a turn of the loop: where the cancellation lands
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=10)
        assert done and task.cancelled(), "the connect went on after it was cancelled"
        assert await read_to_its_end(connection), "the socket is open"


class MadeConnections:
    """A stand-in for nats-py's client whose connect succeeds after a turn of the loop; every one made
    is kept, to tell which were closed."""

    made: list["MadeConnections"] = []

    def __init__(self):
        self.closed = False
        MadeConnections.made.append(self)

    async def connect(self, **_options):
        await asyncio.sleep(0)  # a turn of the loop: the connection is made in the next one

    async def close(self):
        self.closed = True


@pytest.mark.parametrize("again", [None, 0, 1, 2])
@pytest.mark.parametrize("turns", range(10))
@pytest.mark.parametrize("who", ["agent", "connect_within"])
async def test_a_connection_made_as_its_caller_is_cancelled_is_closed(monkeypatch, tmp_path, who, turns, again):
    """The caller cancelled `turns` turns of the loop after it asked (and, with `again`, once more that
    many turns later: a second Ctrl-C, a shutdown): whatever connection was made is the caller's (it
    got it) or closed by the time the caller has ended. One made in the very turn the caller was
    cancelled was left open, reconnecting for good, and so was one whose close a second
    cancellation cut short (found by reviews)."""
    import nats

    import warmboot.agent as agent_module
    import warmboot.connection as connection_module
    from tests.registry_helpers import PROBE
    from warmboot.agent import Agent

    MadeConnections.made.clear()
    monkeypatch.setattr(nats, "NATS", MadeConnections)
    monkeypatch.setattr(agent_module, "guard_reads", lambda nc: None)
    monkeypatch.setattr(connection_module, "guard_reads", lambda nc: None)
    if who == "agent":
        asked = Agent("nats://127.0.0.1:1", "w-a", "node-a", tmp_path / "agent.toml", probe=PROBE)._connect(
            asyncio.Event())
    else:
        asked = connection_module.connect_within("nats://127.0.0.1:1,nats://127.0.0.1:2", "test", 5)
    task = asyncio.ensure_future(asked)
    for _ in range(turns):
        await asyncio.sleep(0)  # turns of the loop: where the cancellation lands (the parameter)
    task.cancel()
    if again is not None:
        for _ in range(again):
            await asyncio.sleep(0)  # turns of the loop: where the second one lands
        task.cancel()
    done, _ = await asyncio.wait({task}, timeout=10)
    assert done
    given = None if task.cancelled() else task.result()
    assert [c for c in MadeConnections.made if not c.closed and c is not given] == []


class SlowToClose(MadeConnections):
    """A client whose server never answers, and whose close takes turns of the loop, as nats-py's
    does (it closes the socket a turn after it starts)."""

    def __init__(self):
        super().__init__()
        self.connecting = asyncio.Event()  # its connect under way

    async def connect(self, **_options):
        self.connecting.set()
        await asyncio.Event().wait()

    async def close(self):
        for _ in range(3):
            await asyncio.sleep(0)  # turns of the loop: the close's length
        self.closed = True


@pytest.mark.parametrize("turns", range(6))
async def test_a_second_cancellation_does_not_cut_the_close_of_a_connect_given_up_on_short(turns):
    """`connecting` cancelled, then again `turns` turns later, while it closes the client it gave up
    on: the close is finished before the cancellation goes on (it was cancelled with it, and the
    socket left open; found by a review)."""
    from events.natspy.connections import connecting

    client = SlowToClose()
    task = asyncio.ensure_future(connecting(client))
    await client.connecting.wait()
    task.cancel()
    for _ in range(turns):
        await asyncio.sleep(0)  # turns of the loop: where the second cancellation lands (the parameter)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.closed


async def test_a_connect_given_up_on_ends_though_its_caller_is_cancelled_again():
    """The connect swallows its first cancellation (as Python 3.11's wait_for can), and the caller of
    `connecting` is cancelled again while it cancels the connect (a second Ctrl-C, a shutdown): the
    connect is still ended, and its client closed, before the cancellation goes on (it was left
    connecting for good; found by a review)."""
    from events.natspy.connections import connecting

    started, swallowed, ended = asyncio.Event(), asyncio.Event(), asyncio.Event()

    class Stubborn(MadeConnections):
        async def connect(self, **_options):
            started.set()
            try:
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    swallowed.set()  # the first cancellation, swallowed
                await asyncio.Event().wait()
            finally:
                ended.set()

    MadeConnections.made.clear()
    client = Stubborn()
    task = asyncio.ensure_future(connecting(client))
    await started.wait()  # the connect under way
    task.cancel()
    await swallowed.wait()  # `connecting` is cancelling it, and goes on
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended.is_set() and client.closed


@pytest.mark.parametrize("turns", range(4))
async def test_a_socket_given_up_on_is_closed_though_its_caller_is_cancelled_again(monkeypatch, turns):
    """nats-py's own client and a server that says nothing: `connect` cancelled, then again `turns`
    turns after the close of the client it gave up on began (0: in that very turn). The socket is
    closed all the same (the server reads its end): the second cancellation cut nats-py's close
    short, a turn before it closes the socket (found by a review)."""
    import nats

    closing = asyncio.Event()

    class Watched(nats.NATS):
        async def close(self):
            closing.set()
            if turns == 0:
                task.cancel()
            await super().close()

    monkeypatch.setattr(nats, "NATS", Watched)
    async with connecting_to_a_silent_server() as (task, connection):
        task.cancel()
        await asyncio.wait_for(closing.wait(), 10)
        for _ in range(turns):
            await asyncio.sleep(0)  # turns of the loop: where the second cancellation lands (the parameter)
        task.cancel()
        await asyncio.wait({task}, timeout=10)
        assert task.cancelled()
        assert await read_to_its_end(connection), "the socket is open"


@pytest.mark.parametrize("how", ["stopped", "cancelled"])
async def test_an_agent_waiting_for_its_server_ends_as_it_is_told(tmp_path, how):
    """An agent whose server does not answer: stopped, its run returns; cancelled, its run ends
    cancelled (it returned as if stopped, so a caller's cancellation, Ctrl-C's included, was lost:
    found by a review), and no connection is left trying."""
    from tests.registry_helpers import PROBE, agent_config
    from warmboot.agent import Agent

    import socket

    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    with socket.create_server(("127.0.0.1", 0)) as listener:  # takes connections, says nothing
        listener.setblocking(False)
        agent = Agent(f"nats://127.0.0.1:{listener.getsockname()[1]}", "w-a", "node-a", path, probe=PROBE)
        stop = asyncio.Event()
        run = asyncio.ensure_future(agent.run(stop))
        connection, _ = await asyncio.wait_for(asyncio.get_running_loop().sock_accept(listener), 10)
        with connection:  # the agent waits for the server's greeting
            connection.setblocking(False)
            if how == "stopped":
                stop.set()
            else:
                run.cancel()
            done, _ = await asyncio.wait({run}, timeout=10)
            assert done and run.cancelled() == (how == "cancelled")
            if how == "stopped":
                assert run.result() is None
            assert await read_to_its_end(connection), "the agent's connection is left open"


def test_a_one_shot_command_signs_in_with_nkey_seed(tmp_path):
    """The docs and the --nats warning say a command may sign in with `--nkey-seed FILE` (or
    `$NATS_NKEY_SEED`): only `serve` and `agent` took it, and every other command said "No such
    option" (found by a docs review). On a server that signs users in by nkey: without the seed the
    sign-in is refused at once; with it (option or environment) the command signs in and goes on,
    here to the stream it is asked for, which this server has not."""
    from tests.secured_helpers import Secured

    secured = Secured(tmp_path / "store", "hx", operators=("ops",), auth="nkey").start()
    try:
        seed = tmp_path / "ops.nk"
        seed.write_text(secured.secrets["ops"])
        env = {"NATS_URL": secured.url(), "NATS_INBOX_PREFIX": secured.inbox("ops")}
        refused = CliRunner().invoke(main, ["workers", "--prefix", "hx"], env=env)
        assert refused.exit_code == 1 and "refuses the sign-in" in refused.stderr, refused.output
        for args, more in ((["--nkey-seed", str(seed)], {}), ([], {"NATS_NKEY_SEED": str(seed)})):
            signed = CliRunner().invoke(main, ["workers", "--prefix", "hx", *args], env={**env, **more})
            assert signed.exit_code == 1, signed.output
            assert "no event stream HX_EVENTS on this server" in signed.stderr, signed.output  # signed in
            assert "refuses the sign-in" not in signed.stderr
        missing = CliRunner().invoke(main, ["workers", "--nkey-seed", str(tmp_path / "none.nk")], env=env)
        assert missing.exit_code == 2 and "Invalid value for '--nkey-seed'" in missing.output, missing.output
        # no NATS_INBOX_PREFIX: the seed file's name, `<user>.nk` as `nats-config --seeds-dir` writes it,
        # says the user, whose inbox it listens under (until 2026-12-07 nats-py's own, refused: a trial of a
        # secured deployment, whose docs' `worker drain W --nkey-seed W.nk` was so refused)
        named = CliRunner().invoke(main, ["workers", "--prefix", "hx", "--nkey-seed", str(seed)],
                                   env={"NATS_URL": secured.url()})
        assert named.exit_code == 1 and "no event stream HX_EVENTS on this server" in named.stderr, named.output
        # signed in, but listening for replies where the user may not (a seed file named otherwise): said at
        # once, with what to do (each request only timed out, about 30 s, then UNAVAILABLE)
        other = tmp_path / "seed" / "operator.nk"
        other.parent.mkdir()
        other.write_text(secured.secrets["ops"])
        deaf = CliRunner().invoke(main, ["workers", "--prefix", "hx", "--nkey-seed", str(other)],
                                  env={"NATS_URL": secured.url()})
        assert deaf.exit_code == 1, deaf.output
        assert "FAILED_PRECONDITION" in deaf.stderr and "does not let this user hear its replies under " \
            "_INBOX.operator" in deaf.stderr and "_INBOX.<user> (NATS_INBOX_PREFIX" in deaf.stderr, deaf.stderr
    finally:
        secured.stop()


@contextlib.asynccontextmanager
async def secured_with(tmp_path, service: str):
    """A server under `warmboot nats-config`'s permissions (prefix hx, one client: carol) running
    `service`: (the server, the stack the test may add to, the services' own connection)."""
    from tests.secured_helpers import Secured
    from warmboot.runner import start_services

    secured = Secured(tmp_path / "store", "hx", clients=("carol",)).start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            await start_services(stack, [service], secured.url("svc"), "hx")
            svc = await secured.connect("svc")
            stack.push_async_callback(svc.close)
            yield secured, stack, svc
    finally:
        secured.stop()


async def test_a_user_refused_its_inbox_is_told_before_anything_is_sent(tmp_path):
    """A client listening where its permissions do not let it (nats-py's own `_INBOX.<nuid>`, as with
    an nkey seed and no NATS_INBOX_PREFIX): the server refuses that subscription, not its requests, so
    a create was written and its caller told only that no reply came (and, for a while this session,
    FAILED_PRECONDITION, as if refused: found by a review). Now the client and the CLI find out before
    they send anything, FAILED_PRECONDITION naming the prefix, and the log holds no creation."""
    from events.errors import ContractError
    from events.schema import ErrorCode
    from tests.factories import last_seq
    from warmboot.client import Client

    async with secured_with(tmp_path, "snapshotter") as (secured, stack, svc):
        before = await last_seq(svc.nc, "hx")
        with pytest.raises(ContractError) as refused:
            await Client.connect(secured.url("carol"), "hx", inbox_prefix="_INBOX", timeout=2, attempts=3)
        assert refused.value.code is ErrorCode.FAILED_PRECONDITION
        assert "does not let this user hear its replies under _INBOX.>" in refused.value.message
        assert "nothing was sent" in refused.value.message
        env = {"NATS_URL": secured.url("carol"), "NATS_INBOX_PREFIX": "_INBOX", "WARMBOOT_PREFIX": "hx"}
        created = await asyncio.to_thread(CliRunner().invoke, main, [
            "actor", "create", "a-1", "--class", "gvisor", "--template", "t1", "--cpu", "500",
            "--memory", "1024"], env=env)
        assert created.exit_code == 1 and "FAILED_PRECONDITION" in created.stderr, created.output
        assert await last_seq(svc.nc, "hx") == before  # no ActorCreated: nothing was sent
        env["NATS_INBOX_PREFIX"] = "_INBOX.carol"  # as the message says: then it is created
        created = await asyncio.to_thread(CliRunner().invoke, main, [
            "actor", "create", "a-1", "--class", "gvisor", "--template", "t1", "--cpu", "500",
            "--memory", "1024"], env=env)
        assert created.exit_code == 0, created.output
        assert await last_seq(svc.nc, "hx") > before


async def test_a_request_the_server_refuses_to_carry_is_told_at_once_not_retried_until_unavailable(tmp_path):
    """A client's credential may not publish on the registry's subjects (docs/security.md): its
    `warmboot worker drain` reached nobody, and the client sent it again after each time-out,
    ending UNAVAILABLE "no reply" some 30 s later, as if the registry were down. The server says
    why at once (a permissions violation); the client and the CLI now answer FAILED_PRECONDITION
    naming the subject as soon as the server says so, not after the first attempt's time-out (a 5 s
    wait by default, found by a trial of the docs), and nothing of the worker changes."""
    from events.errors import ContractError
    from events.schema import ErrorCode
    from tests.factories import last_seq
    from warmboot.client import Client

    async with secured_with(tmp_path, "registry") as (secured, stack, svc):
        before = await last_seq(svc.nc, "hx")
        client = await Client.connect(secured.url("carol"), "hx", inbox_prefix="_INBOX.carol", timeout=120,
                                      attempts=5)
        stack.push_async_callback(client.close)
        with pytest.raises(ContractError) as refused:  # long before the attempt's 120 s time-out
            await asyncio.wait_for(client.drain("w-1", "upgrade"), 30)
        assert refused.value.code is ErrorCode.FAILED_PRECONDITION, refused.value
        assert "does not let these credentials publish to hx.registry.drain.w-1" in refused.value.message
        assert client.retries == 0  # told after the first attempt, not sent again
        env = {"NATS_URL": secured.url("carol"), "NATS_INBOX_PREFIX": "_INBOX.carol", "WARMBOOT_PREFIX": "hx"}
        drained = await asyncio.to_thread(CliRunner().invoke, main, ["worker", "drain", "w-1"], env=env)
        assert drained.exit_code == 1, drained.output
        assert "FAILED_PRECONDITION" in drained.stderr and "hx.registry.drain.w-1" in drained.stderr, \
            drained.stderr
        assert await last_seq(svc.nc, "hx") == before


async def test_a_tag_recorded_by_a_client_that_may_not_read_the_log_is_said_done_and_a_create_from_it_checked(
        tmp_path):
    """A client's credential may not read the log (docs/security.md). `actor tag` read the tag's history
    once the tag was recorded, to say what it named before: that ended the command with "error: cannot
    read the event stream", exit 1, after the tag was recorded; then (until 2026-12-07) it said "what
    base named before is not known", so a client moving a tag was never told it moved (a secured
    deployment's trial). The snapshotter's reply says it now (`tagged_before`): no log is read."""
    from events.schema import TagRecorded
    from tests.factories import actor, golden, read_log, version
    from warmboot.client import Client

    async with secured_with(tmp_path, "snapshotter") as (secured, stack, svc):
        client = await Client.connect(secured.url("carol"), "hx", inbox_prefix="_INBOX.carol")
        stack.push_async_callback(client.close)
        await client.create(actor("a-1", golden_snapshot=golden(version("v1"))))
        env = {"NATS_URL": secured.url("carol"), "NATS_INBOX_PREFIX": "_INBOX.carol", "WARMBOOT_PREFIX": "hx"}
        tagged = await asyncio.to_thread(CliRunner().invoke, main, ["actor", "tag", "a-1", "base"], env=env)
        recorded = [(seq, e) for seq, e in await read_log(svc.nc, "hx") if isinstance(e, TagRecorded)]
        assert len(recorded) == 1
        assert tagged.exit_code == 0, tagged.output
        said = tagged.stdout.splitlines()
        assert said[0].startswith(f"actor/a-1 tagged base: snapshot {recorded[0][1].snapshot.snapshot_id}, "), said
        assert said[1:] == [], said  # a new tag: nothing moved
        await client.create(actor("b-1", golden_snapshot=golden(version("v1"), snapshot_id="gold-b")))
        moved = await asyncio.to_thread(CliRunner().invoke, main, ["actor", "tag", "b-1", "base"], env=env)
        assert moved.exit_code == 0, moved.output
        assert moved.stdout.splitlines()[1:] == [
            f"base moved: it named snapshot {recorded[0][1].snapshot.snapshot_id} of actor a-1 before"], moved.stdout
        back = await asyncio.to_thread(CliRunner().invoke, main, ["actor", "tag", "a-1", "base"], env=env)
        named = [e.snapshot for _, e in await read_log(svc.nc, "hx") if isinstance(e, TagRecorded)]
        assert [s.actor_id for s in named] == ["a-1", "b-1", "a-1"]
        assert back.stdout.splitlines()[1:] == [f"base moved: it named snapshot {named[1].snapshot_id} of actor b-1 "
                                                "before"], back.stdout
        # a create from the tag checks the tag's snapshot all the same, as the snapshotter's status says it
        # (until 2026-12-07 it read it from the log alone, and said that it could not: a trial of a secured
        # deployment found every create from a tag unchecked for the one role that may create)
        from warmboot.runner import start_services
        await start_services(stack, ["scheduler"], secured.url("svc"), "hx")
        made = await asyncio.to_thread(CliRunner().invoke, main, [
            "actor", "create", "a-2", "--class", "gvisor", "--template", "t2", "--cpu", "500", "--memory", "1024",
            "--min-fidelity", "MEMORY", "--source-tag", "base"], env=env)
        assert made.exit_code == 0, made.output
        assert made.stderr.splitlines()[0].startswith(
            "warning: a-2 can never be resumed: its --min-fidelity is MEMORY and "), made.stderr
        assert "not checked" not in made.stderr and "t1" in made.stderr.splitlines()[0], made.stderr


@pytest.mark.parametrize("module", ["warmboot", "warmboot.cli"])
def test_the_cli_runs_as_a_module(module):
    """`python -m warmboot` (and `-m warmboot.cli`, which a walkthrough ran from a checkout) runs the
    CLI as the `warmboot` script does; `-m warmboot.cli` printed nothing and exited 0, whatever it
    was asked (a command that did nothing, said nothing and reported success)."""
    import subprocess
    from pathlib import Path
    import sys

    shown = subprocess.run([sys.executable, "-m", module, "actor", "--help"], capture_output=True, text=True,
                           timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert shown.returncode == 0 and "Usage: warmboot actor" in shown.stdout, shown
    refused = subprocess.run([sys.executable, "-m", module, "nosuch"], capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).resolve().parents[1])
    assert refused.returncode == 2 and "No such command 'nosuch'" in refused.stderr, refused


def _leaf_commands(group, path=()):
    import click

    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _leaf_commands(command, (*path, name))
        else:
            yield " ".join((*path, name)), command


def test_every_command_s_help_ends_with_examples_that_parse(tmp_path, monkeypatch):
    """A review: most --help texts had no example. Every command now shows some after its options
    (`warmboot.examples`), and each example is a command line its parser takes as shown (options and
    arguments that exist, values of their types): nothing runs, nothing connects. The files they
    name are there, as in the repository's root (`examples/`) or as a user would have written them."""
    import shlex
    from pathlib import Path

    from warmboot.examples import EXAMPLES

    (tmp_path / "examples").symlink_to(Path(__file__).resolve().parent.parent / "examples")
    for name in ("workers.txt", "worker-nodes.json", "a-1.json"):
        (tmp_path / name).write_text("")
    monkeypatch.chdir(tmp_path)

    leaves = dict(_leaf_commands(main))
    assert set(EXAMPLES) == set(leaves), set(leaves) ^ set(EXAMPLES)  # every command, and no other
    for path, command in leaves.items():
        shown = CliRunner().invoke(main, [*path.split(), "--help"], terminal_width=200)
        assert shown.exit_code == 0, shown.output
        examples = shown.output.split("Examples:\n\n", 1)[1].splitlines()
        assert [line.strip() for line in examples if line.strip()] == EXAMPLES[path], path
        for example in EXAMPLES[path]:
            words = shlex.split(example, comments=True)
            words = words[:words.index(">")] if ">" in words else words  # a shell's redirection
            assert words[:len(path.split()) + 1] == ["warmboot", *path.split()], example
            with command.make_context(f"warmboot {path}", words[1 + len(path.split()):]) as ctx:
                assert ctx.params is not None, example  # parsed: click raised nothing


def test_a_ctrl_c_as_the_command_line_is_read_stops_it_with_status_130_too(monkeypatch):
    """A Ctrl-C that comes while the top level reads the command line (the command's first moments) is
    said as one that comes later: it was click's "Aborted!" and status 1 (seen once in 40 Ctrl-Cs sent
    at random moments of a command's start)."""
    import click
    from click.testing import CliRunner

    from warmboot.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(click.Group, "parse_args", interrupted)
    result = CliRunner().invoke(main, ["workers"])
    assert (result.exit_code, result.output.strip()) == (130, "interrupted"), result.output


def test_up_that_fails_to_start_leaves_its_metrics_port_free(tmp_path):
    """`up` binds its metrics port before it starts NATS; a start that fails (NATS's port taken) left the
    metrics server bound in the process, so an in-process caller (a test, an embedding) could not bind
    it again. Its metrics port is free once it has failed."""
    import socket

    held = NatsServer((tmp_path / "other").resolve(), name="other").start()  # a NATS on the port
    metrics_port = free_port()
    try:
        result = CliRunner().invoke(main, ["up", "--store", str(tmp_path / "store"), "--port", str(held.port),
                                           "--metrics-port", str(metrics_port)])
        assert result.exit_code == 1, result.output
    finally:
        held.stop()
    with socket.socket() as again:
        again.bind(("127.0.0.1", metrics_port))  # OSError (address in use) while the metrics server holds it


async def test_a_close_while_a_sent_request_waits_is_unavailable_not_nothing_sent(tmp_path):
    """A client closed while its requests waited for their answers (an orchestrator's shutdown, a
    gather of resumes cancelled by closing the client): the close ends each wait as a time-out, the
    retry then meets the closed connection, and the call said FAILED_PRECONDITION "nothing was sent
    ... and nothing will be on it", when the first attempt had been sent and carried out (a user
    trial: 292 of 300 resumes so told were placed). Now UNAVAILABLE saying an earlier attempt may
    have been carried out, with the request id to send again; a call made after the close is still
    FAILED_PRECONDITION (nothing sent)."""
    from events.errors import ContractError
    from events.schema import ErrorCode
    from warmboot.client import Client

    server = NatsServer(tmp_path).start()
    try:
        import nats

        listener = await nats.connect(server.url)
        heard = asyncio.Event()

        async def hold(msg) -> None:  # a service that takes the request and has not answered yet
            heard.set()

        await listener.subscribe("tp.scheduler.resume.*", cb=hold)
        await listener.flush()
        client = await Client.connect(server.url, "tp", timeout=5, attempts=3)
        waiting = asyncio.ensure_future(client.resume("a-1", request_id="r-sent"))
        await asyncio.wait_for(heard.wait(), 10)
        await client.close()
        with pytest.raises(ContractError) as lost:
            await waiting
        assert lost.value.code is ErrorCode.UNAVAILABLE, lost.value
        assert "may have been carried out" in lost.value.message and lost.value.request_id == "r-sent"
        with pytest.raises(ContractError) as closed:
            await client.resume("a-2", request_id="r-after")
        assert closed.value.code is ErrorCode.FAILED_PRECONDITION, closed.value
        assert "nothing was sent" in closed.value.message
        await listener.close()
    finally:
        server.stop()
