"""Edges of the CLI's and the client's surface a walkthrough found: what a client's credentials are
told after a command that succeeded, an unknown class asked of `Client.fragmentation`, the exit
status of a malformed id, and restorable runtimes shown with their ids and their own edges."""

from __future__ import annotations

import asyncio
import json
import re
from contextlib import AsyncExitStack
from functools import partial

import msgspec
import pytest
from click.testing import CliRunner

from events.compat import compat_key
from events.errors import ContractError
from events.runtime_id import short_id
from events.schema import (CompatVersion, CreateActor, ErrorCode, Fragmentation, PauseActor, RegisterReply, Resources,
                           ResumeActor, SeqReply, SuspendActor, WhatIf)
from events.subjects import service_subject
from services.endpoints import call
from tests.registry_helpers import registration, runtime
from tests.secured_helpers import Secured
from warmboot.cli import main
from warmboot.client import Client
from warmboot.cmd_views import class_runtime_fields
from warmboot.runner import SERVICES, start_services

PREFIX = "se"
# A port nothing listens on: a command that connects says UNAVAILABLE, here once it has waited half a second
NOWHERE = ["--nats", "nats://127.0.0.1:1", "--connect-timeout", "0.5"]


def edged(asset: str, name: str, *accepts: str) -> dict:
    """A runtime (`registry_helpers.runtime`) whose `compatible_versions` accept the assets `accepts`."""
    return {**runtime(asset, name), "compatible_versions": [runtime(a)["version"] for a in accepts]}


# w-1's runtimes: its default accepts v1's snapshots through an edge, its restorable one v0's
W1 = registration("w-1", edged("v2", "runsc-v2", "v1"), [edged("v1b", "runsc-v1b", "v0")])
IDS = {asset: short_id(compat_key("gvisor", msgspec.convert(runtime(asset)["version"], CompatVersion)))
       for asset in ("v0", "v1", "v1b", "v2")}  # each runtime's `rt-` id


def cli(*args: str, env: dict[str, str] | None = None):
    return asyncio.to_thread(CliRunner().invoke, main, list(args), env=env or {})


@pytest.fixture(scope="module")
async def secured(tmp_path_factory):
    """A server under `warmboot nats-config`'s permissions running every service; one worker
    registered, actors a-1 and a-2 created; an operator (ops) and a client (orch)."""
    server = Secured(tmp_path_factory.mktemp("secured"), PREFIX, workers=("w-1",), operators=("ops",),
                     clients=("orch",)).start()
    try:
        async with AsyncExitStack() as stack:
            await start_services(stack, list(SERVICES), server.url("svc"), PREFIX,
                                 options={"scheduler": {"metrics": False}})
            svc = await server.connect("svc")
            stack.push_async_callback(svc.close)
            orch = await server.connect("orch")
            stack.push_async_callback(orch.close)
            worker = await server.connect("w-1")
            stack.push_async_callback(worker.close)
            await call(worker.nc, service_subject(PREFIX, "registry", "register", "w-1"), W1, RegisterReply)
            for actor_id in ("a-1", "a-2"):
                await call(orch.nc, service_subject(PREFIX, "snapshotter", "create", actor_id),
                           {"actor_id": actor_id, "sandbox_class": "gvisor", "template_uid": "tpl-1",
                            "resources": {"cpu_millis": 250, "memory_mib": 256}}, SeqReply)
            yield server
    finally:
        server.stop()


# --- 1. a client's credentials, after a command that succeeded ------------------------------------------


async def test_a_command_that_succeeds_for_a_client_says_in_one_line_what_it_did_not_check(secured, monkeypatch):
    """A client's credentials may not read the log. `actor resume`, `explain` and `fragmentation` label
    runtimes by the names a scheduler says (`scheduler.runtimes`, since 2026-12-06: before, a client's
    labels were ids, and stderr said the names were not looked up), and `explain` names the selector
    keys each mismatched worker misses as the scheduler says them (`Rejection.missing_keys`, since
    2026-12-06). From a scheduler of an earlier version, which does not say them, what a client cannot
    check is said on stderr in one short line (the workers' labels are in the log). Their stderr said,
    over four lines of a terminal, "cannot read the event stream ...: is --prefix se the deployment's,
    and may these credentials read its log?", as if the command had failed (a walkthrough)."""
    env = {"NATS_URL": secured.url("orch"), "WARMBOOT_PREFIX": PREFIX}
    ops_env = {"NATS_URL": secured.url("ops"), "WARMBOOT_PREFIX": PREFIX}
    for args, says in ((["actor", "resume", "a-1"], "DECISION"), (["explain", "a-2"], "SUMMARY"),
                       (["fragmentation"], "SNAPSHOTS")):
        result = await cli(*args, env=env)
        assert result.exit_code == 0, (args, result.output)
        assert says in result.stdout and "runsc-v2" in result.stdout, (args, result.stdout)  # the name
        assert IDS["v2"][3:] not in result.stdout, (args, result.stdout)  # not the id's digits
        assert result.stderr == "", (args, result.stderr)
    for who in (env, ops_env):  # the keys as the scheduler says them: nothing read, nothing said
        named = await cli("explain", "a-2", "--selector", "zone=b", env=who)
        assert named.exit_code == 0 and named.stderr == "", named.output
        assert re.search(r"^w-1 +selector mismatch \(zone\)$", named.stdout, re.M), named.stdout

    explain = Client.explain  # a scheduler of an earlier version: no `missing_keys` in its answer

    async def earlier(self, *args, **kwargs):
        answer = await explain(self, *args, **kwargs)
        return msgspec.structs.replace(answer, rejected=[msgspec.structs.replace(r, missing_keys=[])
                                                         for r in answer.rejected])

    monkeypatch.setattr(Client, "explain", earlier)
    missed = await cli("explain", "a-2", "--selector", "zone=b", env=env)
    assert missed.exit_code == 0 and "selector mismatch" in missed.stdout, missed.output
    assert re.search(r"^w-1 +selector mismatch$", missed.stdout, re.M), missed.stdout  # its keys not looked up
    assert missed.stderr == ("note: selector keys of the mismatched workers not looked up: these credentials may not "
                             "read the log\n"), missed.stderr
    # an operator's credentials read them: nothing said, and the keys named
    ops = await cli("explain", "a-2", "--selector", "zone=b", env=ops_env)
    assert ops.exit_code == 0 and ops.stderr == "", ops.output
    assert re.search(r"^w-1 +selector mismatch \(zone\)$", ops.stdout, re.M), ops.stdout


async def test_a_client_s_actor_show_says_what_the_snapshotter_s_status_does(secured):
    """`actor show` reads the actor's history, which a client's credentials may not: it failed, and a
    client had no command that said an actor's state (a trial). It now prints the snapshotter's status
    (state, the life's creation, the placement, the last sequence; -o json the status with the actor's
    id), and stderr says the rest is in the log. An actor never created is NOT_FOUND, as before."""
    env = {"NATS_URL": secured.url("orch"), "WARMBOOT_PREFIX": PREFIX}
    async with await Client.connect(secured.url("orch"), PREFIX, timeout=5, attempts=1) as wb:
        status = await wb.status("a-2")
    shown = await cli("actor", "show", "a-2", env=env)
    assert shown.exit_code == 0, shown.output
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in shown.stdout.splitlines())
    assert rows == {"ACTOR": "a-2", "STATE": status.state.value, "LIFE": f"created at sequence {status.life_seq}",
                    "PLACEMENT": "none in this life" if status.placement_seq is None
                    else f"at sequence {status.placement_seq}", "LAST SEQ": str(status.seq)}, shown.stdout
    assert shown.stderr == ("note: the snapshotter's status of a-2 only: these credentials may not read the log, "
                            "where its snapshot, stamp, worker and pin are\n"), shown.stderr
    as_json = await cli("actor", "show", "a-2", "-o", "json", env=env)
    assert as_json.exit_code == 0 and json.loads(as_json.stdout) == {"actor_id": "a-2", **msgspec.to_builtins(status)}
    unknown = await cli("actor", "show", "a-404", env=env)
    assert unknown.exit_code == 1 and "NOT_FOUND" in unknown.stderr, unknown.output
    # an operator's credentials read the history: the whole view, nothing said
    ops = await cli("actor", "show", "a-2", env={"NATS_URL": secured.url("ops"), "WARMBOOT_PREFIX": PREFIX})
    assert ops.exit_code == 0 and ops.stderr == "" and "TEMPLATE" in ops.stdout, ops.output


# --- 2. a class the scheduler knows nothing of, asked of the client --------------------------------------


async def test_the_client_says_not_found_of_a_class_the_scheduler_knows_nothing_of(secured):
    """`Client.fragmentation("nope")` answered an empty Fragmentation, where `warmboot fragmentation
    --class nope` says NOT_FOUND and `Client.whatif` raises it (a walkthrough). It raises the
    ContractError the CLI prints, field `sandbox_class`; a class the scheduler knows is answered."""
    async with await Client.connect(secured.url("orch"), PREFIX, timeout=5, attempts=1) as wb:
        for ask in (lambda: wb.fragmentation("nope"), lambda: wb.whatif(WhatIf(sandbox_class="nope"))):
            with pytest.raises(ContractError) as raised:
                await ask()
            assert (raised.value.code, raised.value.field) == (ErrorCode.NOT_FOUND, "sandbox_class")
            assert raised.value.message.startswith("no worker has registered the sandbox class 'nope'")
        assert [c.sandbox_class for c in (await wb.fragmentation("gvisor")).classes] == ["gvisor"]
        assert [c.sandbox_class for c in (await wb.fragmentation()).classes] == ["gvisor"]
        # the endpoint says so itself, to a client of another language (it answered no class)
        with pytest.raises(ContractError) as raised:
            await call(wb.nc, service_subject(PREFIX, "scheduler", "fragmentation"), {"sandbox_class": "nope"},
                       Fragmentation)
        assert (raised.value.code, raised.value.field) == (ErrorCode.NOT_FOUND, "sandbox_class")
        assert raised.value.message == "no worker has registered the sandbox class 'nope'"
    said = "error: NOT_FOUND sandbox_class (--class): no worker has registered the sandbox class 'nope'"
    for user, names in (("orch", ""), ("ops", " (registered: gvisor)")):  # a client may not read the names
        shown = await cli("fragmentation", "--class", "nope", env={"NATS_URL": secured.url(user),
                                                                   "WARMBOOT_PREFIX": PREFIX})
        assert (shown.exit_code, shown.stdout) == (1, ""), (user, shown.output)
        assert shown.stderr == f"{said}{names}\n", (user, shown.stderr)
    helped = " ".join(CliRunner().invoke(main, ["fragmentation", "--help"], terminal_width=200).output.split())
    assert ("A --class the scheduler knows nothing of (no worker has registered it, and no actor of it holds a "
            "memory snapshot) is NOT_FOUND, exit status 1, naming the classes the registered workers run where "
            "these credentials may read the log") in helped, helped


# --- 3. a malformed id on the command line --------------------------------------------------------------

ID_COMMANDS = [  # every command that takes an ACTOR_ID or WORKER_ID, with what else it requires
    (["explain"], "ACTOR_ID", []),
    (["actor", "create"], "ACTOR_ID", ["--class", "gvisor", "--template", "t1", "--cpu", "500", "--memory", "1024"]),
    (["actor", "pause"], "ACTOR_ID", []),
    (["actor", "suspend"], "ACTOR_ID", []),
    (["actor", "resume"], "ACTOR_ID", []),
    (["actor", "tag"], "ACTOR_ID", ["v1"]),
    (["actor", "revert"], "ACTOR_ID", []),
    (["actor", "update-template"], "ACTOR_ID", ["t2"]),
    (["actor", "stop"], "ACTOR_ID", []),
    (["actor", "show"], "ACTOR_ID", []),
    (["audit", "actor"], "ACTOR_ID", []),
    (["worker", "drain"], "WORKER_ID", []),
    (["worker", "remove"], "WORKER_ID", []),
    (["worker", "show"], "WORKER_ID", []),
]


@pytest.mark.parametrize("command, argument, more", ID_COMMANDS, ids=[" ".join(c[0]) for c in ID_COMMANDS])
def test_a_malformed_id_is_a_usage_error_of_every_command_before_anything_is_sent(command, argument, more):
    """`worker show 'bad id'` was a usage error (exit 2) and `explain 'bad id'` INVALID_ARGUMENT
    (exit 1), said only once a server answered; so were the actor's lifecycle steps and `worker
    drain|remove` (a walkthrough). Every command taking an id says it as a usage error naming the
    argument, exit 2, as README says of a mistyped value, before it connects: here to a port no
    server listens on, which is never tried."""
    shown = CliRunner().invoke(main, [*command, "bad id", *more, *NOWHERE], prog_name="warmboot")
    assert shown.exit_code == 2, shown.output
    assert shown.stderr.startswith(f"Usage: warmboot {' '.join(command)} "), shown.stderr
    assert shown.stderr.endswith(f"error: Invalid value for '{argument}': 'bad id' is not an id: 1 to 128 letters, "
                                 "digits, '_' or '-', the first a letter or digit\n"), shown.stderr
    assert "UNAVAILABLE" not in shown.output and shown.stdout == ""


@pytest.mark.parametrize("command, argument", [(["actor", "tag", "a-1"], "TAG"),
                                               (["actor", "update-template", "a-1"], "TEMPLATE_UID")])
def test_a_malformed_tag_or_template_argument_is_a_usage_error_before_anything_is_sent(command, argument):
    """`actor tag a-1 'bad tag'` and `actor update-template a-1 'bad t'` connected and were refused by the
    snapshotter, exit 1, `INVALID_ARGUMENT tag` naming no argument, and with no server only UNAVAILABLE
    (a user trial): both are ids, checked as ACTOR_ID is, exit 2, before connecting."""
    shown = CliRunner().invoke(main, [*command, "bad id", *NOWHERE], prog_name="warmboot")
    assert shown.exit_code == 2, shown.output
    assert shown.stderr.startswith(f"Usage: warmboot {' '.join(command[:2])} "), shown.stderr
    assert shown.stderr.endswith(f"error: Invalid value for '{argument}': 'bad id' is not an id: 1 to 128 letters, "
                                 "digits, '_' or '-', the first a letter or digit\n"), shown.stderr
    assert "UNAVAILABLE" not in shown.output and shown.stdout == ""


def test_a_malformed_worker_id_of_a_filter_is_a_usage_error_before_anything_is_sent():
    """`actor list --worker 'bad id'` connected and listed nothing (a docs check): an option naming
    workers is checked as an argument is, exit 2, before it connects (as `whatif --drain`)."""
    for command in (["actor", "list", "--worker", "w-1", "--worker", "bad id"], ["whatif", "--drain", "bad id"]):
        shown = CliRunner().invoke(main, [*command, *NOWHERE], prog_name="warmboot")
        assert shown.exit_code == 2, (command, shown.output)
        option = command[-2]
        assert shown.stderr.endswith(f"error: Invalid value for '{option}': 'bad id' is not an id: 1 to 128 letters, "
                                     "digits, '_' or '-', the first a letter or digit\n"), shown.stderr


# --- 4. restorable runtimes by id, and the runtime each edge belongs to ----------------------------------


async def test_each_runtime_is_shown_with_its_id_and_its_own_edges(secured):
    """`workers -o wide` and the JSON of `workers` and `worker show` gave the default runtime its
    `rt-` id, a restorable one its name alone; RESUMES FROM listed the edges of every runtime as one,
    as if the default accepted them all (a walkthrough). A restorable runtime has its id as the
    default has (RESTORABLE IDS, `restorable_ids`), and RESUMES FROM names the runtime each edge is
    of (`runtimes`: each with its own); the keys there were keep their values."""
    env = {"NATS_URL": secured.url("ops"), "WARMBOOT_PREFIX": PREFIX, "COLUMNS": "250"}
    ids = IDS
    wide = await cli("workers", "-o", "wide", env=env)
    assert wide.exit_code == 0, wide.output
    header, line = wide.stdout.splitlines()
    assert "  RUNTIME ID  RESTORABLE IDS  RESUMES FROM  " in header, header
    assert re.search(rf" {ids['v2']} +{ids['v1b']} +runsc-v2: {ids['v1']}; runsc-v1b: {ids['v0']} +zone=a ", line), line
    row, = json.loads((await cli("workers", "-o", "json", env=env)).stdout)
    shown = json.loads((await cli("worker", "show", "w-1", "-o", "json", env=env)).stdout)
    for json_row in (row, shown["classes"][0]):
        assert (json_row["runtime"], json_row["runtime_id"]) == ("runsc-v2", ids["v2"])
        assert (json_row["restorable"], json_row["restorable_ids"]) == (["runsc-v1b"], [ids["v1b"]])
        assert json_row["resumes_from"] == json_row["resumes_from_ids"] == [ids["v1"], ids["v0"]]  # as before
        assert [(r["role"], r["runtime"], r["runtime_id"], r["resumes_from_ids"]) for r in json_row["runtimes"]] == [
            ("default", "runsc-v2", ids["v2"], [ids["v1"]]), ("restorable", "runsc-v1b", ids["v1b"], [ids["v0"]])]
    assert shown["classes"][0]["compatible"] == sorted(row["resumes_from"])
    # `worker show`'s fields, as `class_runtime_fields` gives them
    assert class_runtime_fields(row, wide=True)[:3] == [
        ("GVISOR DEFAULT", f"runsc-v2 ({ids['v2']})"), ("GVISOR RESTORABLE", f"runsc-v1b ({ids['v1b']})"),
        ("GVISOR RESUMES FROM", f"runsc-v2: {ids['v1']}; runsc-v1b: {ids['v0']}")]
    assert class_runtime_fields(row)[:2] == [("GVISOR DEFAULT", "runsc-v2"), ("GVISOR RESTORABLE", "runsc-v1b")]


# --- 5. a pause, suspend or resume from a client's credentials, which may not read the log ----------------


async def test_a_client_s_credentials_name_the_placement_and_life_the_snapshotter_says(secured):
    """`actor pause`, `actor suspend` and `actor resume` name the actor's placement or life (a copy of
    the request decided after the actor moved, or lives anew, is then refused). Under `nats-config`
    only a client may send them, and a client's credentials may not read the log: the commands,
    which read the history for it, went on unfenced (a pause said so in one line, a resume said
    nothing). They ask the snapshotter now (`snapshotter.status`, which a client may ask): each request,
    as the services' credentials hear it, names the placement or the life, and nothing says it does
    not; given --placement-seq, the command sends that one."""
    env = {"NATS_URL": secured.url("orch"), "WARMBOOT_PREFIX": PREFIX}
    async with await Client.connect(secured.url("orch"), PREFIX, timeout=5, attempts=1) as wb:
        born = (await wb.create(CreateActor(actor_id="a-5", sandbox_class="gvisor", template_uid="tpl-1",
                                            resources=Resources(cpu_millis=250, memory_mib=256)))).seq
    heard: dict[str, list] = {"pause": [], "suspend": [], "resume": []}
    svc = await secured.connect("svc")
    try:
        for verb in heard:
            service = "scheduler" if verb == "resume" else "snapshotter"
            await svc.nc.subscribe(f"{PREFIX}.{service}.{verb}.a-5", cb=partial(_kept, heard[verb]))
        await svc.nc.flush()
        resumed = await cli("actor", "resume", "a-5", "--json", env=env)
        assert resumed.exit_code == 0 and resumed.stderr == "", resumed.output
        placed = json.loads(resumed.stdout)["seq"]
        paused = await cli("actor", "pause", "a-5", env=env)
        assert paused.exit_code == 0 and paused.stdout.startswith("actor/a-5 paused: "), paused.output
        assert paused.stderr == "", paused.stderr  # its runtime's label from a scheduler: nothing to say
        promoted = await cli("actor", "suspend", "a-5", "--uri", "s3://a-5", "--placement-seq", str(placed), env=env)
        assert promoted.exit_code == 0 and promoted.stdout.startswith("actor/a-5 suspended: "), promoted.output
        assert promoted.stderr == "", promoted.stderr
        await svc.nc.flush()
        assert [msgspec.json.decode(m.data, type=ResumeActor).life_seq for m in heard["resume"]] == [born]
        named = [msgspec.json.decode(m.data, type=PauseActor).placement_seq for m in heard["pause"]]
        assert len(named) == 1 and named[0] in (placed - 1, placed)  # its ActorPlaced (the answer: its booking's)
        assert [msgspec.json.decode(m.data, type=SuspendActor).placement_seq for m in heard["suspend"]] == [placed]
    finally:
        await svc.close()


async def _kept(kept: list, msg) -> None:
    kept.append(msg)


async def test_with_no_scheduler_to_say_them_a_client_s_labels_are_ids_and_stderr_says_so(tmp_path):
    """The labels come from a scheduler (`scheduler.runtimes`), else from the log. With neither (no
    scheduler running, or one of an earlier version; a client's credentials, which may not read the
    log), the command's answer is printed all the same, its runtimes with their ids' digits, and stderr
    says in one line that the names were not looked up, and why."""
    from tests.factories import SILENT_TTL_S

    prefix = "nl"
    server = Secured(tmp_path, prefix, workers=("w-1",), clients=("orch",)).start()
    env = {"NATS_URL": server.url("orch"), "WARMBOOT_PREFIX": prefix}
    try:
        async with AsyncExitStack() as stack:
            await start_services(stack, ["registry", "snapshotter"], server.url("svc"), prefix,
                                 options={"registry": {"ttl_s": SILENT_TTL_S}})
            worker = await server.connect("w-1")
            stack.push_async_callback(worker.close)
            await call(worker.nc, service_subject(prefix, "registry", "register", "w-1"), W1, RegisterReply)
            async with AsyncExitStack() as scheduling:
                await start_services(scheduling, ["scheduler"], server.url("svc"), prefix,
                                     options={"scheduler": {"metrics": False}})
                async with await Client.connect(server.url("orch"), prefix, timeout=5, attempts=1) as wb:
                    await wb.create(CreateActor(actor_id="a-1", sandbox_class="gvisor", template_uid="tpl-1",
                                                resources=Resources(cpu_millis=250, memory_mib=256)))
                    await wb.resume("a-1")
            # the scheduler stopped: nobody says the runtimes, and the log may not be read
            paused = await cli("actor", "pause", "a-1", env=env)
            assert paused.exit_code == 0 and paused.stdout.startswith("actor/a-1 paused: "), paused.output
            # the stamp's own name, with the digits that tell it apart (the fleet's namesakes are not known)
            assert f"stamp runsc-v2@{IDS['v2'][3:]} " in paused.stdout, paused.stdout
            assert paused.stderr == "note: runtime names not looked up: these credentials may not read the log\n", \
                paused.stderr
    finally:
        server.stop()


# --- 5. what --help says of an nkey seed's inbox -----------------------------------------------------------


@pytest.mark.parametrize("command", [["workers"], ["actor", "pause"], ["audit", "verify"], ["whatif"]])
def test_the_nkey_seed_help_says_the_file_s_name_gives_the_inbox(command):
    """`--nkey-seed`'s help said to give the user's inbox prefix in $NATS_INBOX_PREFIX, as if a seed file
    alone could not be used; the commands hear their replies under `_INBOX.<user>`, the user the file's
    name gives (`<user>.nk`, tests/test_cli_connect.py; README), and the variable is needed only for a
    file named otherwise (a user trial of the help against the README)."""
    shown = CliRunner().invoke(main, [*command, "--help"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    helped = " ".join(shown.output.split())
    assert "replies are heard under _INBOX.<user>, the user the file's name gives (<user>.nk, as nats-config " \
           "--seeds-dir names it), else give the user's inbox prefix in $NATS_INBOX_PREFIX." in helped, helped


# --- 6. an empty --request-id ------------------------------------------------------------------------------

REQUEST_ID_COMMANDS = [
    ["actor", "create", "a-1", "--class", "gvisor", "--template", "t1", "--cpu", "500", "--memory", "1024"],
    ["actor", "pause", "a-1"], ["actor", "suspend", "a-1"], ["actor", "resume", "a-1"], ["actor", "tag", "a-1", "v1"],
    ["actor", "revert", "a-1"], ["actor", "update-template", "a-1", "t2"], ["actor", "stop", "a-1"],
    ["worker", "drain", "w-1"], ["worker", "remove", "w-1"],
]


@pytest.mark.parametrize("command", REQUEST_ID_COMMANDS, ids=[" ".join(c[:2]) for c in REQUEST_ID_COMMANDS])
def test_an_empty_request_id_is_a_usage_error_before_anything_is_sent(command):
    """`--request-id ""` (a script's `--request-id "$ID"`, $ID unset) was taken by the client as none: a
    new id at each run, so the request was not the same one sent again, without a word; `actor create`
    sent it and was refused INVALID_ARGUMENT (a user trial). Every command refuses it, exit 2, before it
    connects (here to a port nothing listens on)."""
    shown = CliRunner().invoke(main, [*command, "--request-id", "", *NOWHERE],
                               prog_name="warmboot")
    assert shown.exit_code == 2, shown.output
    assert shown.stderr.endswith("error: Invalid value for '--request-id': an empty request id: give the id of the "
                                 "request to send again, or leave the option out for a new one\n"), shown.stderr
    assert "UNAVAILABLE" not in shown.output and shown.stdout == ""


# --- 7. --cpu and --memory out of a request's bounds ---------------------------------------------------------

CREATE = ["actor", "create", "a-1", "--class", "gvisor", "--template", "t1"]
MAX_INT = 1 << 40  # `events.schema.Positive`'s bound, written out: the test does not read it from the code


@pytest.mark.parametrize("option, value, says", [
    ("--cpu", "0", "'0' is 0 millicores: a request takes 1 to 1099511627776 millicores"),
    ("--cpu", "0m", "'0m' is 0 millicores: a request takes 1 to 1099511627776 millicores"),
    ("--cpu", "-5", "'-5' is -5 millicores"),
    ("--cpu", str(MAX_INT + 1), f"'{MAX_INT + 1}' is {MAX_INT + 1} millicores"),
    ("--memory", "0", "'0' is 0 MiB: a request takes 1 to 1099511627776 MiB"),
    ("--memory", "0Gi", "'0Gi' is 0 MiB"),
    ("--memory", f"{MAX_INT // 1024 + 1}Gi",
     f"'{MAX_INT // 1024 + 1}Gi' is {MAX_INT + 1024} MiB: a request takes 1 to 1099511627776 MiB"),
])
def test_cpu_and_memory_out_of_the_request_s_bounds_are_usage_errors_before_anything_is_sent(option, value, says):
    """`actor create --cpu 0` connected and was refused by the snapshotter, INVALID_ARGUMENT
    resources.cpu_millis, exit 1 (a user trial): the bounds of `Resources` (positive, at most 2^40) are
    checked with the option, exit 2, before it connects (here to a port nothing listens on)."""
    sizes = {"--cpu": "500", "--memory": "1024", option: value}
    shown = CliRunner().invoke(main, [*CREATE, *(w for pair in sizes.items() for w in pair),
                                      *NOWHERE], prog_name="warmboot")
    assert shown.exit_code == 2, shown.output
    assert f"error: Invalid value for '{option}': {says}" in shown.stderr, shown.stderr
    assert "UNAVAILABLE" not in shown.output and shown.stdout == ""


def test_the_largest_cpu_and_memory_a_request_takes_pass_the_option():
    """2^40 millicores and MiB are the largest a request takes: the option passes them on (to a server
    nobody runs here: UNAVAILABLE, exit 1, not a usage error)."""
    shown = CliRunner().invoke(main, [*CREATE, "--cpu", str(MAX_INT), "--memory", f"{MAX_INT // 1024}Gi",
                                      *NOWHERE], prog_name="warmboot")
    assert shown.exit_code == 1 and "UNAVAILABLE" in shown.stderr, shown.output


# --- 8. a --uri the contract does not take -------------------------------------------------------------------


@pytest.mark.parametrize("uri, says", [
    ("", "uri is empty: say where the image is"),
    ("   ", "uri is blank: say where the image is"),
    ("s3://b/a\tb", "'s3://b/a\\tb' is not printable text (no control characters)"),
    ("s3://b/a\u2028b", "text must be printable; U+2028 is not"),
    ("x" * 2049, "Expected `str` of length <= 2048"),
])
def test_a_uri_the_snapshotter_refuses_is_a_usage_error_before_anything_is_sent(uri, says):
    """`actor suspend --uri '  '` connected and was refused by the snapshotter, exit 1 (a user trial): a
    uri is checked as the snapshotter decodes a suspend's (at most 2048 printable characters, not empty
    or blank), exit 2, before it connects (here to a port nothing listens on)."""
    shown = CliRunner().invoke(main, ["actor", "suspend", "a-1", "--uri", uri, *NOWHERE],
                               prog_name="warmboot")
    assert shown.exit_code == 2, shown.output
    assert f"error: Invalid value for '--uri': {says}" in shown.stderr, shown.stderr
    assert "UNAVAILABLE" not in shown.output and shown.stdout == ""


@pytest.mark.parametrize("uri", ["s3://snapshots/a-1", "/var/lib/images/a-1", "a-1", "x" * 2048])
def test_a_uri_of_any_form_passes_the_option(uri):
    """The contract gives a uri no form (no scheme asked for: docs/contract.md): any of these is sent (to a
    server nobody runs here: UNAVAILABLE, exit 1, not a usage error)."""
    shown = CliRunner().invoke(main, ["actor", "suspend", "a-1", "--uri", uri, *NOWHERE],
                               prog_name="warmboot")
    assert shown.exit_code == 1 and "UNAVAILABLE" in shown.stderr, shown.output


# --- 9. every option whose value a request's field takes: checked as the service decodes it -------------------

CREATED = ["actor", "create", "a-1", "--class", "gvisor", "--template", "t1", "--cpu", "500", "--memory", "1024"]
AN_ID = "1 to 128 letters, digits, '_' or '-', the first a letter or digit"
A_CLASS = "a sandbox class: 1 to 63 lower-case letters, digits or '-', the first a letter"
A_LABEL_KEY = "a label key: 1 to 253 letters, digits, '.', '_', '/' or '-', the first and last a letter or digit"
LONG = "x" * 257


def selectors(n: int) -> list[str]:
    return [w for i in range(n) for w in ("--selector", f"k{i}=v")]


@pytest.mark.parametrize("command, option, value, says", [
    (["worker", "drain", "w-1"], "--reason", LONG, f"Expected `str` of length <= 256; got '{'x' * 78}"),
    (["worker", "remove", "w-1"], "--reason", "a\tb", "'a\\tb' is not printable text (no control characters)"),
    (["actor", "revert", "a-1"], "--reason", "a\u2028b", "text must be printable; U+2028 is not"),
    (["actor", "create", "a-1", "--template", "t1", "--cpu", "1", "--memory", "1"], "--class", "Gvisor",
     f"'Gvisor' is not {A_CLASS}"),
    (["actor", "create", "a-1", "--class", "gvisor", "--cpu", "1", "--memory", "1"], "--template", "t 1",
     f"'t 1' is not an id: {AN_ID}"),
    (CREATED, "--source-tag", "x.y", f"'x.y' is not an id: {AN_ID}"),
    (["actor", "pause", "a-1"], "--snapshot-id", "s 1", f"'s 1' is not an id: {AN_ID}"),
    (["actor", "pause", "a-1"], "--snapshot-id", "s; got 1", f"'s; got 1' is not an id: {AN_ID}"),
    (["actor", "suspend", "a-1"], "--snapshot-id", "s" * 129, f"'{'s' * 79}... is not an id: {AN_ID}"),
    (CREATED, "--selector", "bad key=v", f"'bad key' is not {A_LABEL_KEY}"),
    (["actor", "resume", "a-1"], "--selector", "zone=a\tb",
     "selector 'zone': 'a\\tb' is not printable text (no control characters)"),
    (["explain", "a-1"], "--selector", "zone=" + LONG,
     f"selector 'zone': Expected `str` of length <= 256; got '{'x' * 78}"),
    (["actor", "stop", "a-1"], "--request-id", "r" * 129, f"Expected `str` of length <= 128; got '{'r' * 78}"),
    (CREATED, "--request-id", "r\x7f1", "'r\\x7f1' is not printable text (no control characters)"),
    (["fragmentation", "--class", "gvisor"], "--class", "Bad", f"'Bad' is not {A_CLASS}"),
    (["whatif"], "--class", "Bad", f"'Bad' is not {A_CLASS}"),
])
def test_a_value_a_request_s_field_refuses_is_a_usage_error_naming_the_option_before_anything_is_sent(
        command, option, value, says):
    """`worker drain --reason` over 256 characters, `actor create --class Gvisor`, `--template 't 1'`,
    `--source-tag`, `--snapshot-id`, `--selector` and `--request-id` out of their field's form connected
    and were refused by the service, exit 1, once it answered. Each is decoded as the
    service decodes its request (`cli_common.request_field`: the schema is the one definition), exit 2,
    the option named, in the schema's words, before it connects (here to a port nothing listens on)."""
    shown = CliRunner().invoke(main, [*command, option, value, *NOWHERE], prog_name="warmboot")
    assert shown.exit_code == 2, shown.output
    assert f"error: Invalid value for '{option}': {says}" in shown.stderr, shown.stderr
    assert "UNAVAILABLE" not in shown.output and shown.stdout == ""


@pytest.mark.parametrize("command, option, says", [
    ([*CREATED, *selectors(65)], "--selector", "Expected `object` of length <= 64 (65 given)"),
    (["explain", "a-1", *selectors(65)], "--selector", "Expected `object` of length <= 64 (65 given)"),
    (["whatif", "--class", "gvisor", *(w for i in range(10_001) for w in ("--drain", f"w-{i}"))], "--drain",
     "Expected `array` of length <= 10000 (10001 given)"),
    (["actor", "list", *(w for i in range(257) for w in ("--class", f"c-{i}"))], "--class",
     "Expected `array` of length <= 256 (257 given)"),
])
def test_more_values_than_a_request_takes_are_a_usage_error_before_anything_is_sent(command, option, says):
    """A repeated option whose values are one field of the request: as many as the field takes (without
    repeats, as they are sent), else a usage error naming the option, before it connects."""
    shown = CliRunner().invoke(main, [*command, *NOWHERE], prog_name="warmboot")
    assert shown.exit_code == 2, shown.output
    assert shown.stderr.endswith(f"error: Invalid value for '{option}': {says}\n"), shown.stderr[-300:]
    assert "UNAVAILABLE" not in shown.output and shown.stdout == ""


@pytest.mark.parametrize("command", [
    ["worker", "drain", "w-1", "--reason", "x" * 256, "--request-id", "r" * 128],
    ["actor", "revert", "a-1", "--reason", "node gone \u00e9", "--life-seq", "3"],
    [*CREATED, "--source-tag", "t" * 128, *selectors(63), "--selector", "topology.kubernetes.io/zone=" + "v" * 256],
    ["actor", "suspend", "a-1", "--snapshot-id", "s-1", "--placement-seq", "3"],
    ["actor", "list", "--class", "gvisor", *(w for i in range(300) for w in ("--worker", f"w-{i % 256}"))],
    ["whatif", "--class", "gvisor", *(w for i in range(10_001) for w in ("--drain", f"w-{i % 10_000}"))],
])
def test_the_largest_values_a_request_takes_pass_their_options(command):
    """Up to the field's bounds, and repeats counted once as they are sent: the options pass them on (to a
    server nobody runs here: UNAVAILABLE, exit 1, not a usage error)."""
    shown = CliRunner().invoke(main, [*command, *NOWHERE], prog_name="warmboot")
    assert shown.exit_code == 1 and "UNAVAILABLE" in shown.stderr, shown.output[-500:]


def golden_file(tmp_path, **changes) -> str:
    """examples/golden-snapshot.json (a gvisor image), with `changes` (None: the key left out)."""
    from pathlib import Path

    body = {**json.loads((Path(__file__).resolve().parent.parent / "examples" / "golden-snapshot.json").read_text()),
            **changes}
    path = tmp_path / "golden.json"
    path.write_text(json.dumps({k: v for k, v in body.items() if v is not None}))
    return str(path)


@pytest.mark.parametrize("more, changes, says", [
    (["--class", "gvisor", "--source-tag", "base"], {}, "give source_tag or golden_snapshot, not both"),
    (["--class", "kata"], {}, "at $.sandbox_runtime.sandbox_class: golden snapshot was taken under class 'gvisor', "
                              "not 'kata'"),
    (["--class", "gvisor"], {"location": "LOCAL"}, "at $.location: a golden snapshot must be EXTERNAL"),
    (["--class", "gvisor"], {"node": "n-1"}, "at $.node: a golden snapshot is EXTERNAL, on no node (not 'n-1')"),
    (["--class", "gvisor"], {"uri": None}, "at $.uri: a golden snapshot must say where its image is (uri)"),
    (["--class", "gvisor"], {"uri": " "}, "at $.uri: golden_snapshot.uri is blank: say where the image is"),
])
def test_a_create_the_snapshotter_s_rules_across_fields_refuse_is_a_usage_error_before_anything_is_sent(
        tmp_path, more, changes, says):
    """`actor create --golden-snapshot FILE` with --source-tag, or with a --class other than its stamp's, or
    a file of a snapshot no golden one is (LOCAL, on a node, without a uri) connected and was refused by
    the snapshotter, exit 1: the create is decoded as the snapshotter decodes it
    (`events.validate.check_create`, the service's own rules), exit 2, naming --golden-snapshot (and the
    file's field), before it connects."""
    shown = CliRunner().invoke(main, ["actor", "create", "a-1", "--template", "t1", "--cpu", "1", "--memory", "1",
                                      "--golden-snapshot", golden_file(tmp_path, **changes), *more, *NOWHERE],
                               prog_name="warmboot")
    assert shown.exit_code == 2, shown.output
    assert "error: Invalid value for '--golden-snapshot': " in shown.stderr and says in shown.stderr, shown.stderr
    assert "UNAVAILABLE" not in shown.output and shown.stdout == ""


def assignment_file(tmp_path, **changes) -> str:
    """An Assignment of a-1 as `actor resume -o json` prints it, with `changes`."""
    pin = {"sandbox_class": "gvisor", "version": runtime("v1")["version"], "name": "runsc-v1"}
    body = {"actor_id": "a-1", "worker_id": "w-1", "node": "n-1", "action": "RUN", "fidelity": "NONE",
            "sandbox_runtime": pin, "booked": {"cpu_millis": 1, "memory_mib": 1}, "seq": 3, **changes}
    path = tmp_path / "placed.json"
    path.write_text(json.dumps(body))
    return str(path)


@pytest.mark.parametrize("command", [["actor", "pause", "a-1"], ["actor", "suspend", "a-1", "--uri", "s3://a"]])
@pytest.mark.parametrize("changes, says", [
    ({"seq": 0}, "at $.seq: Expected `int` >= 1; got 0"),
    ({"sandbox_runtime": {"sandbox_class": "gvisor", "version": {"schema_version": "v1", "attributes": [
        {"key": "cpu_features", "value": "x"}]}}},
     "at $.sandbox_runtime.version.attributes: schema v1 requires the attribute 'architecture'"),
])
def test_a_placement_file_the_snapshotter_would_refuse_is_a_usage_error_before_anything_is_sent(
        tmp_path, command, changes, says):
    """`actor pause|suspend --placement FILE`: an Assignment (seq 0, a pin's version without the keys its
    schema version requires) that a pause or suspend names as the snapshotter refuses it
    (`events.validate.check_under_placement`, through `decode_request`) connected and was refused, exit 1,
    naming no option: a usage error naming --placement and the file's field, exit 2, before it connects."""
    path = assignment_file(tmp_path, **changes)
    shown = CliRunner().invoke(main, [*command, "--placement", path, *NOWHERE], prog_name="warmboot")
    assert shown.exit_code == 2, shown.output
    assert f"error: Invalid value for '--placement': {path} {says}" in shown.stderr, shown.stderr
    assert "UNAVAILABLE" not in shown.output and shown.stdout == ""


def test_a_placement_file_the_snapshotter_takes_passes_the_option(tmp_path):
    shown = CliRunner().invoke(main, ["actor", "pause", "a-1", "--placement", assignment_file(tmp_path), *NOWHERE],
                               prog_name="warmboot")
    assert shown.exit_code == 1 and "UNAVAILABLE" in shown.stderr, shown.output


def test_the_fields_a_placement_names_are_read_from_its_assignment_by_one_mapping(tmp_path):
    """A pause's or suspend's fields naming its placement (`UnderPlacement`) are its Assignment's under other
    names: `client.placed_under` reads them by one mapping, and `--placement FILE`'s usage error names the
    file's field by the same one (it kept a copy of its own, `PLACED_FIELDS`, which a field added to one and
    not the other would have named wrong)."""
    import msgspec

    from events.schema import UnderPlacement
    from warmboot import cmd_lifecycle
    from warmboot.client import UNDER_PLACEMENT, placed_under

    assert set(UNDER_PLACEMENT) == {f.name for f in msgspec.structs.fields(UnderPlacement)}
    assert not hasattr(cmd_lifecycle, "PLACED_FIELDS")
    from events.schema import Assignment

    with open(assignment_file(tmp_path)) as file:
        placed = msgspec.convert(json.load(file), Assignment)
    under = placed_under(placed)
    for field, of in UNDER_PLACEMENT.items():
        assert getattr(under, field) == getattr(placed, of), field
