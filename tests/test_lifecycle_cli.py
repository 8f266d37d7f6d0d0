"""`warmboot actor ...` and `warmboot worker ...` against the real services on the bus.

What an operator would check: each command does what its reply says (the log holds the
event at the reply's `seq`), `show` tells the state the log folds to, `--json` is the
contract's reply (each runtime version's `rt-` id beside it), and a refused command prints `error: CODE field: message`, exits 1
and writes nothing.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Callable

import msgspec
import pytest
from click.testing import CliRunner

from events.codec import decode_request, to_builtins
from events.compat import compat_key
from events.runtime_id import short_id
from events.schema import (
    ActorCreated,
    ActorPlaced,
    ActorReleased,
    ActorStopped,
    CompatVersion,
    Fidelity,
    Assignment,
    PauseActor,
    SnapshotTaken,
    TagRecorded,
)
from events.states import ActorState
from tests.factories import actor, delivered, golden, last_seq, log_reads, read_log, runtime, version, wait_for, worker
from tests.factories import stamp as stamp_of
from warmboot.cli import main
from warmboot.client import Client

V1, V2 = version("v1"), version("v2")


def cli(*args: str, width: int = 100):
    return asyncio.to_thread(CliRunner().invoke, main, list(args), env={"COLUMNS": str(width)})


@pytest.fixture
async def bus(stack, nc, prefix, nats_url):
    """Running services, two workers (one with an edge to v1), and a `run(*args)` of the CLI on them."""
    wb = Client(nc, prefix)
    await wb.register(worker("w-old", runtime(V1, name="runsc-v1"), node="node-old"))
    await wb.register(worker("w-new", runtime(V2, name="runsc-v2", compatible=(V1,)), node="node-new"))

    async def run(*args: str, width: int = 100):
        if args[:2] == ("actor", "resume") and "--min-seq" not in args:
            # read-your-writes across commands, as a user chains them: the scheduler answers from state
            # that has every write before this command (its fold may lag the log under load)
            args = (*args, "--min-seq", str(await last_seq(nc, prefix)))
        return await cli(*args, "--nats", nats_url, "--prefix", prefix, width=width)

    return run, wb


def fields(text: str) -> dict[str, str]:
    """`KEY  value` lines (the key and its value apart by two spaces or more) as {key: value}."""
    out = {}
    for line in text.splitlines():
        parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        if len(parts) == 2 and parts[0].isupper() and not line.startswith(" "):
            out[parts[0]] = parts[1]
    return out


async def wrote(nc, prefix: str, seq: int) -> list:
    """The events the request whose reply gave `seq` wrote: `seq` is the last of them (CONTRACT
    section 1), and they carry its request id."""
    log = await read_log(nc, prefix)
    last = dict(log)[seq]
    return [e for s, e in log if s <= seq and e.request_id == last.request_id]


def kinds(events: list) -> list[str]:
    return [type(e).__name__ for e in events]


async def test_an_actor_lives_through_the_cli_and_every_reply_is_in_the_log(bus, nc, prefix):
    run, _ = bus
    created = await run("actor", "create", "a-1", "--class", "gvisor", "--template", "t1", "--cpu", "500",
                        "--memory", "1024", "--json")
    assert created.exit_code == 0, created.output
    seq = json.loads(created.output)["seq"]
    assert kinds(await wrote(nc, prefix, seq)) == ["ActorCreated"]

    shown = await run("actor", "show", "a-1", "--json")
    view = json.loads(shown.output)
    assert (view["state"], view["snapshot"], view["worker_id"]) == ("CREATED", None, None)

    resumed = await run("actor", "resume", "a-1")
    assert resumed.exit_code == 0, resumed.output
    placed = fields(resumed.output)
    assert placed["DECISION"] == "RUN (cold boot)" and placed["WORKER"] in ("w-old", "w-new")
    assert placed["RUNTIME"] in ("runsc-v1", "runsc-v2")  # the pin by its label, as the views show it
    (event, _) = await wrote(nc, prefix, int(placed["SEQ"]))  # ActorPlaced and its booking marker
    assert isinstance(event, ActorPlaced) and event.worker_id == placed["WORKER"]
    shown_wide = fields((await run("actor", "show", "a-1", "-o", "wide")).output)
    assert shown_wide["PIN ID"] == short_id(compat_key(event.sandbox_runtime.sandbox_class,
                                                       event.sandbox_runtime.version))

    before = await last_seq(nc, prefix)
    stale = await run("actor", "pause", "a-1", "--placement-seq", str(int(placed["SEQ"]) + 7))
    assert stale.exit_code == 1 and stale.stderr.startswith(
        "error: FAILED_PRECONDITION placement_seq (--placement-seq): cannot record a pause of actor 'a-1' taken "
        f"under the placement at sequence {int(placed['SEQ']) + 7}: it is placed on worker "), stale.stderr
    assert f"its resume answered {int(placed['SEQ']) - 1} or {placed['SEQ']})" in stale.stderr
    assert await last_seq(nc, prefix) == before  # nothing written
    paused = await run("actor", "pause", "a-1", "--placement-seq", placed["SEQ"])  # the placement it was taken under
    assert paused.exit_code == 0, paused.output
    node = "node-old" if placed["WORKER"] == "w-old" else "node-new"
    assert paused.output.startswith(f"actor/a-1 paused: snapshot a-1-v3, MEMORY, LOCAL on {node}, "
                                    f"stamp {placed['RUNTIME']} (seq ")
    view = json.loads((await run("actor", "show", "a-1", "-o", "json")).output)
    assert (view["state"], view["snapshot"]["location"], view["snapshot"]["node"]) == ("PAUSED", "LOCAL", node)
    assert view["snapshot"]["stamp"]["label"] == placed["RUNTIME"]
    stamp_json = view["snapshot"]["stamp"]  # its id once, under the key every JSON gives it
    assert "id" not in stamp_json and stamp_json["runtime_id"] == short_id(
        compat_key(stamp_json["sandbox_class"], msgspec.convert(stamp_json["version"], CompatVersion)))
    wide = await run("actor", "show", "a-1", "-o", "wide")  # the id as the table shows it
    assert wide.exit_code == 0, wide.output
    assert fields(wide.output)["STAMP ID"] == stamp_json["runtime_id"]
    text = (await run("actor", "show", "a-1")).output
    assert fields(text)["STATE"] == "PAUSED" and fields(text)["STAMP"] == placed["RUNTIME"]

    promoted = await run("actor", "suspend", "a-1", "--uri", "s3://bucket/a-1", "--json")
    snap = json.loads(promoted.output)["snapshot"]
    assert (snap["location"], snap["uri"]) == ("EXTERNAL", "s3://bucket/a-1")
    (event,) = await wrote(nc, prefix, json.loads(promoted.output)["seq"])
    assert isinstance(event, SnapshotTaken) and event.origin.value == "PROMOTE"

    tagged = await run("actor", "tag", "a-1", "golden-1")
    assert tagged.exit_code == 0 and tagged.output.startswith("actor/a-1 tagged golden-1: snapshot a-1-v3")
    assert "moved" not in tagged.output  # a new tag

    templated = await run("actor", "update-template", "a-1", "t2", "-o", "json")  # as the views spell it
    assert kinds(await wrote(nc, prefix, json.loads(templated.output)["seq"])) == ["TemplateChanged"]
    assert json.loads(templated.output)["unchanged"] is False
    same = await run("actor", "update-template", "a-1", "t2")
    assert same.output == f"actor/a-1 unchanged: already on template t2 (seq {json.loads(templated.output)['seq']})\n"
    again = json.loads((await run("actor", "resume", "a-1", "--json")).output)
    assert again["fallback"]["reason"] == "TEMPLATE_CHANGED"  # the memory is of the old template

    stopped = await run("actor", "stop", "a-1")
    assert stopped.exit_code == 0 and stopped.output.startswith("actor/a-1 stopped (seq ")
    history = [type(e) for _, e in await read_log(nc, prefix, f"{prefix}.ev.actor.a-1")]
    assert history[-2:] == [ActorReleased, ActorStopped]
    assert json.loads((await run("actor", "show", "a-1", "--json")).output)["state"] == "STOPPED"


async def test_a_restore_through_a_compatible_version_shows_what_matched(bus):
    run, wb = bus
    await run("worker", "drain", "w-new")
    await run("actor", "create", "a-2", "--class", "gvisor", "--template", "t1", "--cpu", "100", "--memory", "256")
    await run("actor", "resume", "a-2")  # on w-old, the only live worker: pinned to v1
    suspended = await run("actor", "suspend", "a-2", "--uri", "s3://a-2")
    assert suspended.output.startswith("actor/a-2 suspended: snapshot a-2-v3, MEMORY, EXTERNAL s3://a-2, "
                                       "stamp runsc-v1 (seq ")
    await run("worker", "drain", "w-old")
    await wb.register(worker("w-edge", runtime(V2, name="runsc-v2", compatible=(V1,)), node="node-edge"))
    placed = fields((await run("actor", "resume", "a-2")).output)
    assert (placed["DECISION"], placed["WORKER"]) == ("RESTORE at MEMORY", "w-edge")
    assert (placed["RUNTIME"], placed["MATCHED"]) == ("runsc-v2", "runsc-v1")  # pinned v2, through its edge to v1


async def test_errors_name_code_and_field_exit_1_and_write_nothing(bus, nc, prefix):
    run, _ = bus
    before = await last_seq(nc, prefix)
    cases = [  # the wire's field, and the option that gave it
        (("actor", "create", "a-9", "--class", "gvisor", "--template", "t1", "--cpu", "10", "--memory", "256",
          "--source-tag", "nosuch"), "error: NOT_FOUND source_tag (--source-tag): tag 'nosuch' does not exist"),
        # an argument: the field alone; one wording for an actor or a worker that is not there, whichever
        # service or command says it
        (("actor", "pause", "nobody"), "error: NOT_FOUND actor_id: actor 'nobody' does not exist"),
        (("actor", "resume", "nobody"), "error: NOT_FOUND actor_id: actor 'nobody' does not exist"),
        (("worker", "drain", "nobody"), "error: NOT_FOUND worker_id: worker 'nobody' is not registered"),
        (("actor", "show", "nobody"), "error: NOT_FOUND actor_id: actor 'nobody' does not exist"),
        (("worker", "show", "nobody"), "error: NOT_FOUND worker_id: worker 'nobody' is not registered"),
    ]
    for args, expected in cases:
        result = await run(*args)
        assert result.exit_code == 1, (args, result.output)
        assert result.stderr.startswith(expected), (args, result.stderr)
        assert result.stdout == ""
    # a usage error before anything is sent: a selector key given twice would drop one of its values
    for args in (("actor", "create", "a-9", "--class", "gvisor", "--template", "t1", "--cpu", "10", "--memory", "256"),
                 ("actor", "resume", "a-9"), ("explain", "a-9")):
        twice = await run(*args, "--selector", "zone=a", "--selector", "zone=b")
        assert twice.exit_code == 2 and "'zone' is given twice ('a' and 'b')" in twice.output, (args, twice.output)
        bare = await run(*args, "--selector", "zone")
        assert bare.exit_code == 2 and "'zone' is not KEY=VALUE" in bare.output, (args, bare.output)
    # a value the request's field refuses: a usage error naming the option (it was INVALID_ARGUMENT selectors
    # (--selector), sandbox_class (--class), exit 1, once the snapshotter answered)
    for more, said in ((("--selector", "bad key=v"), "Invalid value for '--selector': 'bad key' is not a label key"),
                       (("--class", "Gvisor"), "Invalid value for '--class': 'Gvisor' is not a sandbox class")):
        refused = await run("actor", "create", "a-9", "--class", "gvisor", "--template", "t1", "--cpu", "10",
                            "--memory", "256", *more)
        assert refused.exit_code == 2 and said in refused.stderr and not refused.stdout, refused.output
    # a --cpu out of the request's bounds: a usage error too (it was INVALID_ARGUMENT resources.cpu_millis
    # (--cpu), exit 1, once the snapshotter answered: a user trial)
    zero = await run("actor", "create", "a-9", "--class", "gvisor", "--template", "t1", "--cpu", "0", "--memory", "256")
    assert zero.exit_code == 2 and "Invalid value for '--cpu': '0' is 0 millicores" in zero.stderr, zero.output
    # an id that is not one: a usage error too, as every command that takes one says it
    for args, said in ((("actor", "pause", "a.b"), "'a.b' is not an id"),
                       (("worker", "drain", "w x"), "'w x' is not an id")):
        malformed = await run(*args)
        assert malformed.exit_code == 2 and said in malformed.stderr and not malformed.stdout, malformed.output
    assert await last_seq(nc, prefix) == before
    await run("actor", "create", "a-9", "--class", "gvisor", "--template", "t1", "--cpu", "100", "--memory", "256")
    refused = await run("actor", "pause", "a-9", "--json")  # CREATED, not RUNNING
    assert refused.exit_code == 1 and refused.stderr.startswith("error: FAILED_PRECONDITION")


async def test_cpu_and_memory_read_as_kubectl_writes_them_and_fractions_are_refused(bus, nc, prefix):
    """`--cpu 500m` and `--memory 1Gi` are 500 millicores and 1024 MiB (both were 'not a valid
    integer'); a bare number is the unit still; a fraction or a decimal unit is a usage error naming
    what to write, and nothing is sent."""
    run, _ = bus
    made = await run("actor", "create", "a-k", "--class", "gvisor", "--template", "t1", "--cpu", "500m",
                     "--memory", "1Gi", "--json")
    assert made.exit_code == 0, made.output
    (created,) = await wrote(nc, prefix, json.loads(made.output)["seq"])
    assert (created.resources.cpu_millis, created.resources.memory_mib) == (500, 1024)
    made = await run("actor", "create", "a-l", "--class", "gvisor", "--template", "t1", "--cpu", "250",
                     "--memory", "512Mi", "--json")
    (created,) = await wrote(nc, prefix, json.loads(made.output)["seq"])
    assert (created.resources.cpu_millis, created.resources.memory_mib) == (250, 512)
    before = await last_seq(nc, prefix)
    for option, value, says in (("--cpu", "0.5", "'0.5' is not a whole number of millicores: write whole "
                                                 "millicores, e.g. 500 or 500m"),
                                ("--memory", "1.5Gi", "'1.5Gi' is not a whole number of MiB: write whole MiB or GiB, "
                                                      "e.g. 1536"),
                                ("--memory", "1G", "'1G' is not a whole number of MiB"),
                                # the examples are examples, not 10Ti converted (it read "write 1536")
                                ("--memory", "10Ti", "'10Ti' is not a whole number of MiB: write whole MiB or GiB, "
                                                     "e.g. 1536, 1536Mi or 2Gi")):
        sizes = {"--cpu": "100", "--memory": "256", option: value}
        refused = await run("actor", "create", "a-m", "--class", "gvisor", "--template", "t1",
                            *(word for pair in sizes.items() for word in pair))
        assert refused.exit_code == 2 and f"Invalid value for '{option}': {says}" in refused.output, refused.output
    assert await last_seq(nc, prefix) == before


async def test_a_refusal_raised_by_the_client_reads_with_its_code_and_field(bus):
    """An integrator's traceback or log line of a `ContractError` says what the CLI says (code, field,
    message), not the message alone (a walkthrough's traceback read `ContractError: Expected `int` >= 1`,
    with no word of which field); its attributes are as they were."""
    import traceback

    from events.errors import ContractError, not_found
    from events.schema import ErrorCode

    _, wb = bus
    with pytest.raises(ContractError) as refused:
        await wb.create(actor("a-8", cpu=0))
    error = refused.value
    assert (error.code, error.field, error.message) == (ErrorCode.INVALID_ARGUMENT, "resources.cpu_millis",
                                                        "Expected `int` >= 1; got 0")
    assert str(error) == "INVALID_ARGUMENT resources.cpu_millis: Expected `int` >= 1; got 0"
    assert traceback.format_exception_only(error)[-1] == \
        "events.errors.ContractError: INVALID_ARGUMENT resources.cpu_millis: Expected `int` >= 1; got 0\n"
    assert repr(error) == "ContractError(INVALID_ARGUMENT resources.cpu_millis: Expected `int` >= 1; got 0)"
    assert str(not_found("actor 'a-8' does not exist")) == "NOT_FOUND: actor 'a-8' does not exist"  # no field


async def test_the_same_request_id_is_the_same_request(bus, nc, prefix):
    run, _ = bus
    args = ("actor", "create", "a-5", "--class", "gvisor", "--template", "t1", "--cpu", "100", "--memory", "256",
            "--request-id", "op-17", "--json")
    first, second = await run(*args), await run(*args)
    assert json.loads(first.output) == json.loads(second.output)
    created = [e for _, e in await read_log(nc, prefix) if isinstance(e, ActorCreated) and e.actor_id == "a-5"]
    assert len(created) == 1


def answered_unavailable(monkeypatch, subject: str) -> Callable[[], None]:
    """Every answer to a request on `subject` made UNAVAILABLE, as while each retry's check of the
    actor's history at the stream leader fails (the stream without a leader), whatever the service
    carried out; the returned call answers as before again."""
    from events.codec import encode
    from events.errors import unavailable
    from services.endpoints import ServiceRequest, error_headers

    answered = ServiceRequest.respond

    async def unanswered(self, data=b"", headers=None):
        if self._msg.subject == subject:
            error = unavailable("the event log, a bucket or the bus did not answer (TimeoutError); try again")
            data, headers = encode(error.reply()), error_headers(error)
        await answered(self, data, headers)

    monkeypatch.setattr(ServiceRequest, "respond", unanswered)
    return lambda: monkeypatch.setattr(ServiceRequest, "respond", answered)


async def test_a_command_whose_retries_end_unavailable_names_its_request_id(bus, nc, prefix, monkeypatch):
    """A pause recorded, and every answer to it UNAVAILABLE (its reply lost, then each retry's check of
    the actor's history at the stream leader failing, as while the stream has no leader): the client's
    retries end UNAVAILABLE, while the log holds the snapshot. The contract's remedy is to send it again
    with the same request id, which the CLI made up and never said: run again, a new id, the pause was
    refused (the actor is PAUSED already) and its snapshot never printed. The error now names the id, and
    the command run again with it prints the pause the log holds; nothing is written twice."""
    run, wb = bus
    await wb.create(actor("a-1"))
    await wb.resume("a-1")
    restore = answered_unavailable(monkeypatch, f"{prefix}.snapshotter.pause.a-1")
    failed = await run("actor", "pause", "a-1")
    restore()
    assert failed.exit_code == 1 and failed.stderr.startswith("error: UNAVAILABLE: "), failed.output
    (taken,) = [(seq, e) for seq, e in await read_log(nc, prefix) if isinstance(e, SnapshotTaken)]
    request_id = taken[1].request_id
    assert f"--request-id {request_id}" in failed.stderr, failed.stderr
    again = await run("actor", "pause", "a-1", "--request-id", request_id, "--json")
    assert again.exit_code == 0, again.output
    assert (json.loads(again.output)["snapshot"]["snapshot_id"], json.loads(again.output)["seq"]) \
        == (taken[1].snapshot.snapshot_id, taken[0] + 1)  # its SnapshotTaken and the release after it
    assert [e for _, e in await read_log(nc, prefix) if isinstance(e, SnapshotTaken)] == [taken[1]]


async def test_the_client_s_unavailable_carries_the_request_id_it_made_up(bus, nc, prefix, monkeypatch):
    """The same through the library: a caller that gave no request id is given the one the client made
    up on the ContractError (`request_id`), and the call sent again with it returns what the log holds."""
    from events.errors import ContractError
    from events.schema import ErrorCode

    _, wb = bus
    await wb.create(actor("a-2"))
    await wb.resume("a-2")
    restore = answered_unavailable(monkeypatch, f"{prefix}.snapshotter.pause.a-2")
    with pytest.raises(ContractError) as failed:
        await wb.pause("a-2")
    restore()
    assert failed.value.code is ErrorCode.UNAVAILABLE
    (taken,) = [e for _, e in await read_log(nc, prefix) if isinstance(e, SnapshotTaken) and e.actor_id == "a-2"]
    assert failed.value.request_id == taken.request_id is not None
    again = await wb.pause("a-2", request_id=failed.value.request_id)
    assert again.snapshot == taken.snapshot
    with pytest.raises(ContractError) as refused:  # a refusal carries the id too
        await wb.pause("a-2", request_id="another")
    assert (refused.value.code, refused.value.request_id) == (ErrorCode.FAILED_PRECONDITION, "another")


async def test_revert_gives_up_an_image_whose_node_is_gone(bus, nc, prefix):
    run, wb = bus
    await wb.drain("w-new")
    await run("actor", "create", "a-6", "--class", "gvisor", "--template", "t1", "--cpu", "100", "--memory", "256")
    await run("actor", "resume", "a-6")  # on w-old, the only live worker
    await run("actor", "pause", "a-6")
    removed = await run("worker", "remove", "w-old", "--reason", "decommissioned")
    assert removed.exit_code == 0 and removed.stdout.startswith("worker/w-old removed (seq ")
    assert kinds(await wrote(nc, prefix, int(removed.stdout.split()[-1].rstrip(")")))) == ["WorkerRemoved"]
    stuck = await run("actor", "resume", "a-6")
    assert stuck.exit_code == 1
    assert stuck.stderr.startswith("error: FAILED_PRECONDITION") and "node-old" in stuck.stderr
    assert "revert the actor (`warmboot actor revert a-6`)" in stuck.stderr, stuck.stderr  # the command, as others
    reverted = await run("actor", "revert", "a-6", "--reason", "node gone")
    assert reverted.exit_code == 0, reverted.output
    assert reverted.output.startswith("actor/a-6 reverted to no snapshot: it will cold-boot (seq ")
    seq = int(reverted.output.split()[-1].rstrip(")"))
    assert kinds(await wrote(nc, prefix, seq)) == ["ActorReverted"]
    view = json.loads((await run("actor", "show", "a-6", "--json")).output)
    assert (view["state"], view["snapshot"]) == ("SUSPENDED", None)


async def test_worker_show_drain_and_remove(bus, nc, prefix):
    run, wb = bus
    for i in range(3):
        await wb.create(actor(f"b-{i}", cpu=100, mem=256))
    await wb.drain("w-old")  # all three land on w-new
    for i in range(3):
        await wb.resume(f"b-{i}")
    view = json.loads((await run("worker", "show", "w-new", "--json")).output)
    assert (view["node"], view["state"]) == ("node-new", "REGISTERED")
    assert [a["actor_id"] for a in view["actors"]] == ["b-0", "b-1", "b-2"]
    assert all(a["pin"] == "runsc-v2" for a in view["actors"])
    (row,) = view["classes"]
    assert (row["runtime"], row["compatible"]) == ("runsc-v2", ["runsc-v1"])
    listed = json.loads((await run("workers", "--json")).output)
    assert next(r for r in listed if r["worker_id"] == "w-new")["free"] == view["free"] == row["free"]
    text = (await run("worker", "show", "w-new", width=80)).output
    shown = fields(text)
    # the edge after the runtime it is of (`runsc-v2: runsc-v1`), as `workers -o wide` writes it
    assert shown["STATE"] == "REGISTERED" and shown["GVISOR RESUMES FROM"] == "runsc-v2: runsc-v1"
    assert "COMPATIBLE" not in text  # named as `workers -o wide` names it (it was COMPATIBLE here: a review)
    wide = (await run("workers", "-o", "wide")).output.splitlines()
    header = wide[0].split("  ")
    assert "RESUMES FROM" in [h.strip() for h in header if h.strip()], wide[0]
    column = wide[0].index("RESUMES FROM")
    cell = next(line for line in wide if line.startswith("w-new"))[column:].split()[:2]
    assert cell == ["runsc-v2:", "runsc-v1"], wide
    assert all(f"b-{i}" in text for i in range(3)) and max(len(line) for line in text.splitlines()) <= 80

    drained = await run("worker", "drain", "w-new", "--reason", "kernel update", "--json")
    assert kinds(await wrote(nc, prefix, json.loads(drained.output)["seq"])) == ["WorkerDrained"]
    assert json.loads((await run("worker", "show", "w-new", "--json")).output)["state"] == "DRAINED"
    seq = json.loads(drained.output)["seq"]
    # a drain of a drained worker writes nothing and says so, as kubectl says "unchanged"
    before = await last_seq(nc, prefix)
    again = await run("worker", "drain", "w-new")
    assert (again.exit_code, again.output) == (0, f"worker/w-new unchanged: already drained (seq {seq})\n")
    assert await last_seq(nc, prefix) == before
    removed = await run("worker", "remove", "w-new", "--json")
    assert removed.exit_code == 0
    gone = await run("worker", "show", "w-new")
    assert gone.exit_code == 1 and gone.stderr.startswith("error: NOT_FOUND worker_id: ")
    # the snapshotter releases its actors: SUSPENDED, back to their latest snapshot (none here)
    await wait_for(nc, prefix, lambda e: isinstance(e, ActorReleased) and e.actor_id == "b-2"
                   and e.reason.value == "WORKER_REMOVED")
    view = json.loads((await run("actor", "show", "b-2", "--json")).output)
    assert (view["state"], view["worker_id"]) == ("SUSPENDED", None)


async def test_worker_show_lists_the_local_images_on_its_node(bus, nc, prefix):
    """A paused actor's image is LOCAL on its node and resumes only there: `worker show` lists it
    beside the booked actors (it said "no actors booked" alone, the check a user makes before a
    drain; found by a review). Its stamp is shown by its label."""
    run, wb = bus
    await wb.drain("w-old")
    await wb.create(actor("p-1", cpu=100, mem=256))
    await wb.resume("p-1")  # on w-new
    paused = await wb.pause("p-1")
    view = json.loads((await run("worker", "show", "w-new", "--json")).output)
    assert view["actors"] == []
    assert view["local_images"] == [{"actor_id": "p-1", "state": "PAUSED", "snapshot_id": paused.snapshot.snapshot_id,
                                     "fidelity": "MEMORY", "stamp": "runsc-v2"}]
    text = (await run("worker", "show", "w-new", width=80)).output
    assert "no actors booked" in text and "local images on node-new (those actors resume only on this node):" in text
    assert re.search(r"^p-1\s+PAUSED\s+\S+\s+MEMORY\s+runsc-v2$", text, re.M), text
    other = (await run("worker", "show", "w-old")).output
    assert "no local images on node-old" in other

async def test_workers_count_the_actors_of_each_row_s_class(bus):
    """A worker running two classes has a row for each: ACTORS printed the worker's count on both (a
    walkthrough: the same 6 actors on its gvisor and its microvm row). Each row counts the actors of
    its class booked on the worker; -o json says so (`actors` of the row's class, `worker_actors` of
    every class)."""
    from events.schema import RegisterWorker, Resources
    from tests.factories import entry

    run, wb = bus
    await wb.drain("w-old")
    await wb.drain("w-new")
    await wb.register(RegisterWorker(worker_id="w-two", node="node-two",
                                     capacity=Resources(cpu_millis=8000, memory_mib=8192),
                                     sandbox_classes=(entry(V1), entry(V1, sandbox_class="microvm"))))
    for actor_id, sandbox_class in (("g-1", "gvisor"), ("g-2", "gvisor"), ("m-1", "microvm")):
        await wb.create(actor(actor_id, cpu=100, mem=256, sandbox_class=sandbox_class))
        assert (await wb.resume(actor_id)).worker_id == "w-two"
    rows = {r["sandbox_class"]: r for r in json.loads((await run("workers", "-o", "json")).stdout)
            if r["worker_id"] == "w-two"}
    assert {c: (r["actors"], r["worker_actors"]) for c, r in rows.items()} == {"gvisor": (2, 3), "microvm": (1, 3)}
    table = (await run("workers", width=200)).stdout.splitlines()
    assert table[0].split()[:2] == ["WORKER", "CLASS"] and table[0].split()[-2:] == ["ACTORS", "NODE"], table[0]
    counts = {line.split()[1]: line.split()[-2] for line in table[1:] if line.startswith("w-two ")}
    assert counts == {"gvisor": "2", "microvm": "1"}, table
    view = json.loads((await run("worker", "show", "w-two", "--json")).stdout)
    assert sorted(a["actor_id"] for a in view["actors"]) == ["g-1", "g-2", "m-1"]
    assert {r["sandbox_class"]: r["actors"] for r in view["classes"]} == {"gvisor": 2, "microvm": 1}


async def test_worker_remove_says_a_running_agent_registers_it_again(bus):
    """`worker remove` of a worker whose agent still ran: the agent registered it again within
    seconds, undrained, taking placements, and the output said "removed" alone (a walkthrough). The
    removal is as it was; a note on stderr, and the help, say to stop the agent first."""
    run, _ = bus
    note = ("note: if the agent of {w} still runs, it registers {w} again within seconds, undrained, taking "
            "placements: stop the agent (`warmboot agent --drain-on-exit` drains it as it stops)\n")
    removed = await run("worker", "remove", "w-old")
    assert removed.exit_code == 0, removed.output
    assert re.fullmatch(r"worker/w-old removed \(seq \d+\)\n", removed.stdout), removed.stdout
    assert removed.stderr == note.format(w="w-old")
    as_json = await run("worker", "remove", "w-new", "--json")  # the reply alone on stdout
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["seq"] > 0
    assert as_json.stderr == note.format(w="w-new")
    assert (await run("worker", "show", "w-old")).exit_code == 1  # removed all the same
    shown = CliRunner().invoke(main, ["worker", "remove", "--help"], terminal_width=200)
    assert "Stop the worker's agent first (`warmboot agent --drain-on-exit` drains it as it stops)" \
        in " ".join(shown.output.split()), shown.output


async def test_audit_of_an_actor_without_events_is_not_found_as_every_command_says_it(bus):
    run, _ = bus
    result = await run("audit", "actor", "nobody")
    assert result.exit_code == 1 and result.stderr.startswith("error: NOT_FOUND actor_id: no events for actor 'nobody'")
    listed = await run("actor", "list", "--state", "created")  # any case, as the views print it
    assert listed.exit_code == 0, listed.output


async def test_audit_of_an_actor_too_wide_for_the_terminal_shows_every_column_with_the_option_its_note_names(bus):
    """`audit actor` narrowed to the terminal ended "-o wide shows every column", and `-o wide` was refused
    (exit 2: it took only json; a walkthrough at 50 columns). It takes `-o wide`, every column whatever
    the width, as the other tables do."""
    run, wb = bus
    await wb.create(actor("t-1", cpu=100, mem=256))
    await wb.resume("t-1")
    narrow = await run("audit", "actor", "t-1", width=50)
    assert narrow.exit_code == 0 and " ".join(narrow.stdout.split()).endswith("; -o wide shows every column)"), \
        narrow.output
    wide = await run("audit", "actor", "t-1", "-o", "wide", width=50)
    assert wide.exit_code == 0, wide.output
    assert wide.stdout.splitlines()[0].split() == ["SEQ", "AT", "EVENT", "WORKER", "FIDELITY", "FALLBACK", "RUNTIME",
                                                   "DETAIL"], wide.stdout
    assert "every column" not in wide.stdout
    both = await run("audit", "actor", "t-1", "-o", "wide", "--json")
    assert both.exit_code == 2 and "give one" in both.stderr, both.output


async def test_create_from_a_golden_snapshot_file(bus, tmp_path):
    run, _ = bus
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(to_builtins(golden(V1))))
    created = await run("actor", "create", "g-1", "--class", "gvisor", "--template", "t1", "--cpu", "100",
                        "--memory", "256", "--golden-snapshot", str(path))
    assert created.exit_code == 0, created.output
    view = json.loads((await run("actor", "show", "g-1", "--json")).output)
    assert (view["snapshot"]["snapshot_id"], view["snapshot"]["borrowed"]) == ("golden-1", True)
    placed = fields((await run("actor", "resume", "g-1")).output)
    assert (placed["DECISION"], placed["MATCHED"]) == ("RESTORE at MEMORY", "runsc-v1")
    path.write_text(json.dumps({**to_builtins(golden(V1)), "fidelity": "WARM"}))
    bad = await run("actor", "create", "g-2", "--class", "gvisor", "--template", "t1", "--cpu", "100",
                    "--memory", "256", "--golden-snapshot", str(path))
    assert bad.exit_code == 2 and "'--golden-snapshot'" in bad.output and "$.fidelity" in bad.output
    # checked as the service checks it, before anything is sent: text must be printable
    path.write_text(json.dumps({**to_builtins(golden(V1)), "uri": "s3://golden/1\u2028"}))
    unprintable = await run("actor", "create", "g-3", "--class", "gvisor", "--template", "t1", "--cpu", "100",
                            "--memory", "256", "--golden-snapshot", str(path))
    assert unprintable.exit_code == 2, unprintable.output
    assert "at $.uri: text must be printable" in unprintable.output
    shown = await run("actor", "show", "g-3")
    assert shown.exit_code == 1 and "NOT_FOUND" in shown.stderr  # nothing was created
    # a misspelt key would be dropped by the service (a reader ignores what it does not know): said, not sent
    misspelt = to_builtins(golden(V1))
    misspelt["sandbox_runtime"]["vesion"] = misspelt["sandbox_runtime"].pop("version")
    path.write_text(json.dumps({**misspelt, "sandbox_runtime": None, "sandbox_runtme": misspelt["sandbox_runtime"]}))
    dropped = await run("actor", "create", "g-5", "--class", "gvisor", "--template", "t1", "--cpu", "100",
                        "--memory", "256", "--golden-snapshot", str(path))
    assert dropped.exit_code == 2 and "'--golden-snapshot'" in dropped.output, dropped.output
    assert "at $.sandbox_runtme: no such field in a Snapshot" in dropped.output
    assert (await run("actor", "show", "g-5")).exit_code == 1  # nothing was created
    # a field of the file is the file's option, not another one of the same last name (a review)
    path.write_text(json.dumps(to_builtins(golden(V1, sandbox_class="firecracker"))))
    other_class = await run("actor", "create", "g-6", "--class", "gvisor", "--template", "t1", "--cpu", "100",
                            "--memory", "256", "--golden-snapshot", str(path))
    assert other_class.exit_code == 2 and other_class.stderr.endswith(  # the snapshotter's rule, before it is asked
        f"error: Invalid value for '--golden-snapshot': {path} at $.sandbox_runtime.sandbox_class: golden snapshot "
        "was taken under class 'firecracker', not 'gvisor'\n"), other_class.stderr
    assert (await run("actor", "show", "g-6")).exit_code == 1  # nothing was created
    # memory and no stamp: taken (the contract allows it), and said, since its memory is never restored
    assert "no sandbox_runtime" not in created.stderr
    path.write_text(json.dumps({**to_builtins(golden(V1)), "sandbox_runtime": None, "snapshot_id": "golden-4"}))
    unstamped = await run("actor", "create", "g-4", "--class", "gvisor", "--template", "t1", "--cpu", "100",
                          "--memory", "256", "--golden-snapshot", str(path))
    assert unstamped.exit_code == 0, unstamped.output
    assert "warning: the golden snapshot 'golden-4' holds memory but no sandbox_runtime" in unstamped.stderr
    placed = fields((await run("actor", "resume", "g-4")).output)
    assert "SNAPSHOT_NOT_MEMORY" in placed["FALLBACK"], placed
    # another template than the file's: taken (the contract allows it), and said, since it cold-boots
    path.write_text(json.dumps({**to_builtins(golden(V1)), "snapshot_id": "golden-7"}))
    other = await run("actor", "create", "g-7", "--class", "gvisor", "--template", "t9", "--cpu", "100",
                      "--memory", "256", "--golden-snapshot", str(path))
    assert other.exit_code == 0, other.output
    assert "warning: the golden snapshot 'golden-7' was taken from template" in other.stderr
    assert "cold-boots instead of restoring it (TEMPLATE_CHANGED)" in other.stderr
    placed = fields((await run("actor", "resume", "g-7")).output)
    assert "TEMPLATE_CHANGED" in placed["FALLBACK"], placed
    assert "template" not in created.stderr  # the file's own template: nothing said

async def test_create_with_min_fidelity_memory_and_no_stamped_memory_image_warns_it_never_resumes(bus, tmp_path):
    """`--min-fidelity MEMORY` with nothing to restore at MEMORY (no snapshot; a golden snapshot with no
    sandbox_runtime, or of another template; a tag naming a VOLUMES snapshot) is taken, as the contract
    allows, and every resume refused FAILED_PRECONDITION (no resume goes below the floor): the CLI said
    nothing, or that the actor would start without the memory (a walkthrough). It says it can never be
    resumed, and no other warning says otherwise; a stamped MEMORY image, or a lower floor, says nothing."""
    run, wb = bus
    create = ("--class", "gvisor", "--template", "t1", "--cpu", "100", "--memory", "256")
    never = ("; no resume may go below its floor, so every resume is refused (FAILED_PRECONDITION). Create it from "
             "a MEMORY snapshot of its template stamped with a runtime (--source-tag, --golden-snapshot), or with a "
             "lower --min-fidelity\n")

    bare = await run("actor", "create", "n-1", *create, "--min-fidelity", "memory")
    assert bare.exit_code == 0 and bare.stdout.startswith("actor/n-1 created"), bare.output
    assert bare.stderr == ("warning: n-1 can never be resumed: its --min-fidelity is MEMORY and it has no snapshot "
                           "to restore (no --golden-snapshot, no --source-tag): a cold boot is below it" + never)
    refused = await run("actor", "resume", "n-1")
    assert refused.exit_code == 1 and refused.stderr.startswith("error: FAILED_PRECONDITION"), refused.stderr

    path = tmp_path / "golden.json"
    path.write_text(json.dumps({**to_builtins(golden(V1)), "sandbox_runtime": None, "snapshot_id": "golden-u"}))
    unstamped = await run("actor", "create", "n-2", *create, "--min-fidelity", "MEMORY", "--golden-snapshot",
                          str(path), "--json")
    assert unstamped.exit_code == 0 and json.loads(unstamped.stdout)["seq"] > 0, unstamped.output
    assert unstamped.stderr == ("warning: n-2 can never be resumed: its --min-fidelity is MEMORY and its snapshot "
                                "'golden-u' holds memory but no sandbox_runtime: no worker can restore it "
                                "(SNAPSHOT_NOT_MEMORY)" + never)
    assert "starts without it" not in unstamped.stderr
    refused = await run("actor", "resume", "n-2")
    assert refused.exit_code == 1 and refused.stderr.startswith("error: FAILED_PRECONDITION"), refused.stderr

    path.write_text(json.dumps({**to_builtins(golden(V1)), "snapshot_id": "golden-t"}))
    other = await run("actor", "create", "n-3", *create, "--template", "t9", "--min-fidelity", "MEMORY",
                      "--golden-snapshot", str(path))
    assert other.exit_code == 0, other.output
    assert other.stderr == ("warning: n-3 can never be resumed: its --min-fidelity is MEMORY and its snapshot "
                            "'golden-t' was taken from template 't1', not 't9' (TEMPLATE_CHANGED)" + never)
    assert "cold-boots instead" not in other.stderr

    await wb.create(actor("src", cpu=100, mem=256))
    await wb.resume("src")
    await wb.suspend("src", fidelity=Fidelity.VOLUMES, uri="s3://bucket/src", snapshot_id="src-volumes")
    await wb.tag("src", "vols")
    tagged = await run("actor", "create", "n-4", *create, "--min-fidelity", "MEMORY", "--source-tag", "vols")
    assert tagged.exit_code == 0, tagged.output
    assert tagged.stderr == ("warning: n-4 can never be resumed: its --min-fidelity is MEMORY and its snapshot "
                             "'src-volumes' holds VOLUMES only" + never)
    refused = await run("actor", "resume", "n-4")
    assert refused.exit_code == 1 and refused.stderr.startswith("error: FAILED_PRECONDITION"), refused.stderr

    # a stamped MEMORY image of its template, by a golden snapshot or a tag: nothing said, and it resumes
    path.write_text(json.dumps({**to_builtins(golden(V1)), "snapshot_id": "golden-s"}))
    stamped = await run("actor", "create", "y-1", *create, "--min-fidelity", "MEMORY", "--golden-snapshot", str(path))
    assert stamped.exit_code == 0 and stamped.stderr == "", stamped.output
    await wb.resume("src")
    await wb.suspend("src", uri="s3://bucket/src-2", snapshot_id="src-memory")
    await wb.tag("src", "mem")
    from_tag = await run("actor", "create", "y-2", *create, "--min-fidelity", "MEMORY", "--source-tag", "mem")
    assert from_tag.exit_code == 0 and from_tag.stderr == "", from_tag.output
    for actor_id in ("y-1", "y-2"):
        assert fields((await run("actor", "resume", actor_id)).output)["DECISION"] == "RESTORE at MEMORY"
    lower = await run("actor", "create", "y-3", *create, "--min-fidelity", "VOLUMES")  # a lower floor: nothing said
    assert lower.exit_code == 0 and lower.stderr == "", lower.output


@pytest.mark.parametrize("command, usage", [
    (("actor", "resume"), " actor resume [OPTIONS] ACTOR_ID..."),
    (("worker", "drain"), " worker drain [OPTIONS] WORKER_ID..."),
    (("worker", "remove"), " worker remove [OPTIONS] WORKER_ID..."),
])
async def test_the_usage_line_of_a_command_of_several_ids_says_so(command, usage):
    """The usage line, the first a user reads, of a command that takes one or more ids says so, as
    click's own convention (`ID...`): it said `ACTOR_ID`, as of a command of one."""
    shown = await cli(*command, "--help")
    assert shown.exit_code == 0 and shown.output.splitlines()[0].endswith(usage), shown.output


async def test_client_create_says_an_actor_that_can_never_be_resumed(bus, nc, prefix, caplog):
    """`Client.create` of an actor the contract takes but no resume can ever place (min_fidelity MEMORY
    with no stamped MEMORY image of its template to start from) tells its caller, as `actor create`
    warns: `on_never_resumable(actor_id, why)`, else a warning logged. A script's create of it said
    nothing, and only its first resume, refused FAILED_PRECONDITION, told (a walkthrough)."""
    _, wb = bus
    told: list[tuple[str, str]] = []
    heard = Client(nc, prefix, on_never_resumable=lambda actor_id, why: told.append((actor_id, why)))
    floor = dict(cpu=100, mem=256, min_fidelity=Fidelity.MEMORY)
    await heard.create(actor("c-1", **floor))
    assert told == [("c-1", "it has no snapshot to restore (no golden_snapshot, no source_tag): a cold boot is below "
                             "it")]
    await wb.create(actor("src", cpu=100, mem=256))
    await wb.resume("src")
    await wb.suspend("src", fidelity=Fidelity.VOLUMES, uri="s3://bucket/src", snapshot_id="src-volumes")
    await wb.tag("src", "vols")
    await heard.create(actor("c-2", source_tag="vols", **floor))  # the tag's snapshot, as the snapshotter copied it
    assert told[1:] == [("c-2", "its snapshot 'src-volumes' holds VOLUMES only")]
    await heard.create(actor("c-3", golden_snapshot=golden(V1), **floor))  # a stamped MEMORY image: nothing said
    await heard.create(actor("c-4", cpu=100, mem=256, min_fidelity=Fidelity.VOLUMES))  # a lower floor: nothing said
    assert len(told) == 2
    with caplog.at_level("WARNING", logger="warmboot.client"):  # without the hook: a warning logged
        await wb.create(actor("c-5", **floor))
    assert [r.getMessage() for r in caplog.records if r.name == "warmboot.client"] == [
        "c-5 can never be resumed: its min_fidelity is MEMORY and it has no snapshot to restore (no golden_snapshot, "
        "no source_tag): a cold boot is below it; every resume is refused (FAILED_PRECONDITION)"]


async def test_min_seq_chains_commands_and_is_checked(bus, nc, prefix):
    """`--min-seq` (resume, explain, fragmentation, whatif): answered from state that includes the
    seq an earlier command printed; a value that is no sequence is refused before anything is sent."""
    run, _ = bus
    created = json.loads((await run("actor", "create", "a-9", "--class", "gvisor", "--template", "t1", "--cpu",
                                    "100", "--memory", "256", "--json")).output)
    why = await run("explain", "a-9", "--min-seq", str(created["seq"]), "-o", "json")
    assert why.exit_code == 0, why.output
    assert json.loads(why.output)["decision"]["action"] == "RUN"
    before = await last_seq(nc, prefix)
    for command in (("actor", "resume", "a-9"), ("explain", "a-9"), ("fragmentation",), ("whatif", "--class", "gvisor")):
        bad = await run(*command, "--min-seq", "0")
        assert bad.exit_code == 2 and "--min-seq" in bad.output, (command, bad.output)
    assert await last_seq(nc, prefix) == before  # nothing written


async def test_actor_list_shows_every_actor_and_filters(bus):
    run, _ = bus
    for actor_id in ("a-2", "a-1"):
        made = await run("actor", "create", actor_id, "--class", "gvisor", "--template", "t1", "--cpu", "500",
                         "--memory", "1024")
        assert made.exit_code == 0, made.output
    placed = fields((await run("actor", "resume", "a-1")).output)
    await run("actor", "pause", "a-1")
    listed = await run("actor", "list")
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert lines[0].split() == ["ACTOR", "STATE", "CLASS", "WORKER", "SNAPSHOT", "STAMP"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert list(rows) == ["a-1", "a-2"]  # by id
    assert rows["a-1"] == ["PAUSED", "gvisor", "-", "MEMORY", "LOCAL", placed["RUNTIME"]]
    assert rows["a-2"] == ["CREATED", "gvisor", "-", "-", "-"]
    as_json = json.loads((await run("actor", "list", "-o", "json", "--state", "PAUSED")).output)
    assert [v["actor_id"] for v in as_json] == ["a-1"] and as_json[0]["snapshot"]["fidelity"] == "MEMORY"
    typo = await run("actor", "list", "--class", "microvm")
    assert typo.exit_code == 0 and typo.stdout == "no actor matches\n"
    assert typo.stderr == "note: no actor of the log is of the sandbox class 'microvm' (its actors': gvisor)\n"
    nobody = await run("actor", "list", "--worker", "w-nope")  # a typo'd worker id is said, as a typo'd class
    assert nobody.exit_code == 0 and nobody.stdout == "no actor matches\n"
    assert nobody.stderr == "note: worker 'w-nope' is not registered (`warmboot workers` lists those that are)\n"
    # with --continue, as without it (the notes were of the first page alone, which --continue never asked)
    for asked, note in ((("--class", "microvm"), typo.stderr), (("--worker", "w-nope"), nobody.stderr)):
        continued = await run("actor", "list", *asked, "--continue", "a-1")
        assert continued.exit_code == 0 and continued.stdout == "no actor matches after a-1 (--continue)\n"
        assert continued.stderr == note, (asked, continued.stderr)
    idle = await run("actor", "list", "--worker", "w-old", "--class", "gvisor")  # a filter that could match: no note
    assert idle.stdout == "no actor matches\n" and idle.stderr == ""
    assert json.loads((await run("actor", "list", "--class", "microvm", "--json")).stdout) == []  # the note: stderr
    on = json.loads((await run("actor", "list", "--worker", placed["WORKER"], "--state", "running", "-o", "json")).output)
    assert on == []  # paused since: no longer on the worker (and the state is taken in any case)
    wide = (await run("actor", "list", "-o", "wide", width=200)).output.splitlines()
    assert wide[0].split() == ["ACTOR", "STATE", "CLASS", "WORKER", "SNAPSHOT", "STAMP", "TEMPLATE", "NODE", "PIN",
                               "LAST", "SEQ"]
    bad = await run("actor", "list", "--state", "GONE")
    assert bad.exit_code == 2 and "Invalid value for '--state'" in bad.output

async def test_a_filter_given_more_than_once_takes_any_of_its_values(bus):
    """`actor list --state SUSPENDED --state PAUSED` listed the PAUSED actors alone: click kept the last
    value of an option given twice, without a word (a walkthrough). Each filter is repeatable and takes
    any of its values (text and -o json alike); different filters all apply; a value no actor could
    match is said on stderr as a single one is."""
    run, wb = bus
    await wb.register(worker("w-a", V1, labels={"slot": "a"}))
    await wb.register(worker("w-b", V1, labels={"slot": "b"}))
    await wb.create(actor("p-1", cpu=100, mem=256))
    await wb.resume("p-1")
    await wb.pause("p-1")
    await wb.create(actor("s-1", cpu=100, mem=256))
    await wb.resume("s-1")
    await wb.suspend("s-1", uri="s3://bucket/s-1")
    for actor_id, slot in (("r-a", "a"), ("r-b", "b")):
        await wb.create(actor(actor_id, cpu=100, mem=256, selectors={"slot": slot}))
        await wb.resume(actor_id)
    await wb.create(actor("m-1", cpu=100, mem=256, sandbox_class="microvm"))  # CREATED, of a class nobody runs

    def ids(result) -> list[str]:
        assert result.exit_code == 0, result.output
        return [line.split()[0] for line in result.stdout.splitlines()[1:]]

    async def listed(*filters: str) -> list[str]:
        shown = await run("actor", "list", *filters)
        as_json = await run("actor", "list", *filters, "-o", "json")
        assert [v["actor_id"] for v in json.loads(as_json.stdout)] == ids(shown), filters  # filtered alike
        return ids(shown)

    assert await listed("--state", "SUSPENDED", "--state", "paused") == ["p-1", "s-1"]
    assert await listed("--state", "PAUSED") == ["p-1"]  # one value: as before
    assert await listed("--state", "PAUSED", "--state", "PAUSED") == ["p-1"]
    assert await listed("--worker", "w-a", "--worker", "w-b") == ["r-a", "r-b"]
    assert await listed("--worker", "w-b") == ["r-b"]
    assert await listed("--class", "gvisor", "--class", "microvm") == ["m-1", "p-1", "r-a", "r-b", "s-1"]
    assert await listed("--class", "microvm") == ["m-1"]
    assert await listed("--class", "microvm", "--class", "gvisor", "--state", "CREATED", "--state", "RUNNING") \
        == ["m-1", "r-a", "r-b"]  # different filters: all apply
    typo = await run("actor", "list", "--class", "gvisor", "--class", "gvsor", "--worker", "w-a", "--worker", "w-z")
    assert ids(typo) == ["r-a"]
    assert typo.stderr == ("note: no actor of the log is of the sandbox class 'gvsor' (its actors': gvisor, microvm)\n"
                           "note: worker 'w-z' is not registered (`warmboot workers` lists those that are)\n")
    shown = " ".join(CliRunner().invoke(main, ["actor", "list", "--help"], terminal_width=200).output.split())
    for said in ("Only actors of this sandbox class. Repeatable: actors of any class given.",
                 "Only actors in this state (in any case). Repeatable: actors in any state given.",
                 "Only actors placed on this worker. Repeatable: actors placed on any worker given."):
        assert said in shown, shown


async def test_create_of_a_class_no_worker_runs_warns_and_creates(bus, nc, prefix):
    """A mistyped class is accepted (the contract lets an actor wait for its class's workers), and
    its resume refused later as `class not registered`: the command says so at once, on stderr,
    naming the classes the fleet runs; the reply, `--json` included, is unchanged."""
    run, _ = bus
    result = await run("actor", "create", "a-typo", "--class", "gvsor", "--template", "t1", "--cpu", "100",
                       "--memory", "64", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["seq"] == await last_seq(nc, prefix)
    assert result.stderr.strip() == ("warning: no registered worker runs the sandbox class 'gvsor' (the fleet runs: "
                                     "gvisor); resuming a-typo is refused until one does")
    known = await run("actor", "create", "a-ok", "--class", "gvisor", "--template", "t1", "--cpu", "100",
                      "--memory", "64")
    assert known.exit_code == 0 and not known.stderr, known.output


async def test_create_with_no_scheduler_answering_says_nothing_was_checked(nats_url, nc, prefix):
    """With the registry and the snapshotter running and no scheduler, `actor create` of a class no worker
    runs printed the create's line alone: no warning, and nothing said of the checks it could not make
    (a user trial; the other checks not made are said in a note). It says so in one line; the create
    is made, its reply unchanged."""
    from contextlib import AsyncExitStack

    from tests.factories import SILENT_TTL_S
    from warmboot.runner import start_services

    async with AsyncExitStack() as exits:
        await start_services(exits, ["registry", "snapshotter"], nats_url, prefix,
                             options={"registry": {"ttl_s": SILENT_TTL_S}})
        result = await cli("actor", "create", "a-1", "--class", "gvsor", "--template", "t1", "--cpu", "100",
                           "--memory", "64", "--selector", "zone=a", "--nats", nats_url, "--prefix", prefix)
    assert result.exit_code == 0, result.output
    assert result.stdout == f"actor/a-1 created (seq {await last_seq(nc, prefix)})\n"
    assert result.stderr.startswith("note: a-1 not checked against the workers (its class, its size, --selector): "
                                    f"the scheduler did not answer (no service answers {prefix}.scheduler."
                                    "fragmentation after "), result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr


async def test_an_actor_bigger_than_any_worker_is_told_so_at_create_and_at_every_resume(bus, monkeypatch):
    """An actor bigger than any worker of its class is created (a bigger worker may register later),
    with a warning; its resume is refused, RESOURCE_EXHAUSTED as ever, saying no worker of the class
    is big enough, not "no worker of the class fits", which reads as busy (a walkthrough). A refusal
    for selectors names the key not matched, as `explain` does. The create's checks ask the scheduler
    and read no worker's history (they read them all: 2.8 s at 10,000 workers)."""
    run, _ = bus
    read = log_reads(monkeypatch)
    create = ("--class", "gvisor", "--template", "t1", "--cpu", "100")
    sizes = ("the largest has 4000m CPU and 4096 MiB memory (4032 MiB after the 64 MiB reserve), the actor needs "
             "100m CPU and 8192 MiB memory plus its runtime's overhead")
    big = await run("actor", "create", "big-1", *create, "--memory", "8Gi")
    assert big.exit_code == 0 and big.stdout.startswith("actor/big-1 created"), big.output
    assert big.stderr == (f"warning: no registered worker of class gvisor is big enough for big-1: {sizes}; resuming "
                          "big-1 is refused (RESOURCE_EXHAUSTED) until a bigger worker registers\n")
    refused = await run("actor", "resume", "big-1")
    assert refused.exit_code == 1
    # the field names what of the actor the fleet cannot meet: waiting for room will not place it
    assert refused.stderr == ("error: RESOURCE_EXHAUSTED resources: 0/2 workers available: 2 insufficient memory; no "
                              f"worker of the class is big enough: {sizes}; no room freed will fit it, a bigger "
                              "worker must register\n"), refused.stderr
    small = await run("actor", "create", "small-1", *create, "--memory", "4032")  # room of an empty worker
    assert small.exit_code == 0 and small.stderr == "", small.output

    zoned = await run("actor", "create", "zoned-1", *create, "--memory", "64", "--selector", "zone=z9")
    assert zoned.exit_code == 0 and "big enough" not in zoned.stderr, zoned.output
    refused = await run("actor", "resume", "zoned-1")
    assert refused.exit_code == 1
    assert refused.stderr == ("error: RESOURCE_EXHAUSTED selectors (--selector): 0/2 workers available: 2 selector "
                              "mismatch (zone); no undrained worker of the class has the labels its selectors ask "
                              "for; no room freed will place it, an undrained worker with them must register\n"), \
        refused.stderr
    assert read == []


async def test_create_with_a_selector_no_worker_matches_warns_and_creates(bus, nc, prefix):
    """As a mistyped class: a selector no registered worker of the class matches is accepted, and
    the resume refused later; the command says so at once (a walkthrough)."""
    run, wb = bus
    await wb.register(worker("w-zone", V1, labels={"zone": "a", "disk": "ssd"}))
    create = ("actor", "create", "s-1", "--class", "gvisor", "--template", "t1", "--cpu", "100", "--memory", "64")
    nowhere = await run(*create, "--selector", "zone=z9", "--selector", "disk=ssd", "--json")
    assert nowhere.exit_code == 0 and json.loads(nowhere.stdout)["seq"] == await last_seq(nc, prefix)
    assert nowhere.stderr.strip() == ("warning: no undrained worker of class gvisor has the labels disk=ssd, zone=z9; "
                                      "resuming s-1 is refused until one does (`warmboot workers -o wide` shows their "
                                      "labels)")
    somewhere = await run(*create[:2], "s-2", *create[3:], "--selector", "zone=a", "--selector", "disk=ssd")
    assert somewhere.exit_code == 0 and not somewhere.stderr, somewhere.stderr
    # only a drained worker has them: as the scheduler checks a resume (it was not said: drained ones counted)
    await wb.register(worker("w-zone-b", V1, labels={"zone": "b"}))
    await wb.drain("w-zone-b")
    drained = await run(*create[:2], "s-3", *create[3:], "--selector", "zone=b")
    assert drained.exit_code == 0 and drained.stderr.startswith(
        "warning: no undrained worker of class gvisor has the labels zone=b; resuming s-3 is refused"), drained.stderr
    assert "RESOURCE_EXHAUSTED" in (await run("actor", "resume", "s-3")).stderr
    refused = await run("actor", "resume", "s-1")
    assert refused.exit_code == 1 and "RESOURCE_EXHAUSTED" in refused.stderr
    # labels and selectors read alike in every view (`worker show` and `actor show` wrote "disk=ssd, zone=a",
    # `workers -o wide` "disk=ssd,zone=a": a trial of the CLI), as the --selector a user gives
    assert fields((await run("worker", "show", "w-zone", width=200)).output)["LABELS"] == "disk=ssd,zone=a"
    assert fields((await run("actor", "show", "s-2", width=200)).output)["SELECTORS"] == "disk=ssd,zone=a"
    wide = (await run("workers", "-o", "wide", width=300)).output.splitlines()
    assert "disk=ssd,zone=a" in next(line for line in wide if line.startswith("w-zone ")).split(), wide


async def test_create_of_a_class_whose_workers_are_all_drained_says_they_are(bus):
    """A class whose registered workers are all drained was said to be run by none ("the fleet runs:
    none"), while `workers` listed them DRAINED (a trial): the warning says they are drained, naming
    a few of them, and its resume is refused as it says; a class no worker runs is said as before."""
    run, wb = bus
    for worker_id in ("w-old", "w-new"):
        await wb.drain(worker_id)
    create = ("--template", "t1", "--cpu", "100", "--memory", "64")
    drained = await run("actor", "create", "d-1", "--class", "gvisor", *create)
    assert drained.exit_code == 0 and drained.stdout.startswith("actor/d-1 created"), drained.output
    assert drained.stderr == ("warning: every registered worker of class gvisor is drained: w-new, w-old; resuming "
                              "d-1 is refused until an undrained one registers (a drain lasts the worker's life: "
                              "`warmboot worker remove` it and let its agent register it anew)\n")
    refused = await run("actor", "resume", "d-1")
    assert refused.exit_code == 1 and "2 drained" in refused.stderr, refused.stderr
    for i in range(3):
        await wb.register(worker(f"w-{i}", V1))
        await wb.drain(f"w-{i}")
    many = await run("actor", "create", "d-2", "--class", "gvisor", *create)
    assert "every registered worker of class gvisor is drained: w-0, w-1, w-2 (+2 more); resuming d-2" in many.stderr
    typo = await run("actor", "create", "d-3", "--class", "gvsor", *create)
    # the classes of the registered workers, drained ones too (it said "runs: none" of a drained fleet)
    assert typo.stderr == ("warning: no registered worker runs the sandbox class 'gvsor' (the fleet runs: gvisor); "
                           "resuming d-3 is refused until one does\n")


async def test_create_from_a_snapshot_its_resume_will_not_restore_says_so(bus, tmp_path):
    """A tag's snapshot of another template, or a golden snapshot whose stamp no undrained worker
    accepts, is taken (the contract allows it) and its memory given up at the resume: said at create
    (a trial's creates said nothing, and the resume fell back), as for a golden snapshot of another
    template; a snapshot the resume restores says nothing."""
    run, wb = bus
    create = ("--class", "gvisor", "--cpu", "100", "--memory", "256")
    await wb.create(actor("src", cpu=100, mem=256))
    await wb.resume("src")
    await wb.suspend("src", uri="s3://bucket/src", snapshot_id="src-memory")
    await wb.tag("src", "golden-1")
    other = await run("actor", "create", "m-1", *create, "--template", "other", "--source-tag", "golden-1")
    assert other.exit_code == 0 and other.stdout.startswith("actor/m-1 created"), other.output
    assert other.stderr == ("warning: the snapshot 'src-memory' of tag golden-1 was taken from template 't1', not "
                            "'other': m-1 restores it at VOLUMES, without its memory (TEMPLATE_CHANGED)\n")
    placed = fields((await run("actor", "resume", "m-1")).output)
    assert placed["FALLBACK"] == "TEMPLATE_CHANGED (MEMORY -> VOLUMES)", placed
    same = await run("actor", "create", "m-2", *create, "--template", "t1", "--source-tag", "golden-1")
    assert same.exit_code == 0 and same.stderr == "", same.output

    v9 = version("v9")
    named = stamp_of(v9, name="runsc-v9")
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(to_builtins(golden(v9, snapshot_id="golden-9", sandbox_runtime=named))))
    label = f"runsc-v9@{short_id(compat_key('gvisor', v9))[3:]}"
    nowhere = await run("actor", "create", "g-9", *create, "--template", "t1", "--golden-snapshot", str(path))
    assert nowhere.exit_code == 0, nowhere.output
    assert nowhere.stderr == (f"warning: no undrained worker of class gvisor accepts the stamp {label} of the golden "
                              "snapshot 'golden-9': until one does, g-9 cold-boots instead of restoring it "
                              "(NO_COMPATIBLE_WORKER)\n")
    placed = fields((await run("actor", "resume", "g-9")).output)
    assert placed["FALLBACK"] == "NO_COMPATIBLE_WORKER (MEMORY -> NONE)", placed
    floor = await run("actor", "create", "g-10", *create, "--template", "t1", "--golden-snapshot", str(path),
                      "--min-fidelity", "MEMORY")
    assert floor.stderr == (f"warning: no undrained worker of class gvisor accepts the stamp {label} of the golden "
                            "snapshot 'golden-9': until one does, resuming g-10 is refused (its --min-fidelity is "
                            "MEMORY)\n")
    refused = await run("actor", "resume", "g-10")
    assert refused.exit_code == 1 and refused.stderr.startswith("error: RESOURCE_EXHAUSTED"), refused.stderr
    # accepted by a worker's default (w-old) and through an edge (w-new): nothing said, restored
    path.write_text(json.dumps(to_builtins(golden(V1, snapshot_id="golden-one"))))
    accepted = await run("actor", "create", "g-11", *create, "--template", "t1", "--golden-snapshot", str(path))
    assert accepted.exit_code == 0 and accepted.stderr == "", accepted.output
    assert fields((await run("actor", "resume", "g-11")).output)["DECISION"] == "RESTORE at MEMORY"
    # a VOLUMES snapshot restores whatever its template (rule 3): nothing to say of it (it was said to cold-boot)
    path.write_text(json.dumps(to_builtins(golden(V1, snapshot_id="golden-vol", fidelity=Fidelity.VOLUMES))))
    volumes = await run("actor", "create", "g-12", *create, "--template", "t9", "--golden-snapshot", str(path))
    assert volumes.exit_code == 0 and volumes.stderr == "", volumes.output
    assert fields((await run("actor", "resume", "g-12")).output)["DECISION"] == "RESTORE at VOLUMES"


async def test_create_with_a_selector_says_when_only_workers_without_the_labels_accept_the_stamp(bus, tmp_path):
    """A golden snapshot whose stamp a worker of the class accepts, but no worker with the labels the
    actor's selectors ask for: its memory is given up at the resume (refused, under a MEMORY floor), as
    when no worker of the class accepts it, and was said at create only in that case (a carried item:
    the class's count is the fragmentation's, which knows nothing of labels). Read from the scheduler's
    explain of the new actor; a worker with the labels that accepts it says nothing."""
    run, wb = bus
    v9 = version("v9")
    await wb.register(worker("w-v9", runtime(v9, name="runsc-v9")))  # no labels: accepts the stamp
    await wb.register(worker("w-zoned", runtime(V1, name="runsc-v1"), labels={"zone": "a"}))
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(to_builtins(golden(v9, snapshot_id="golden-9",
                                                  sandbox_runtime=stamp_of(v9, name="runsc-v9")))))
    label = "runsc-v9"  # a registered worker runs it: its name alone
    create = ("--class", "gvisor", "--cpu", "100", "--memory", "256", "--template", "t1",
              "--golden-snapshot", str(path))

    zoned = await run("actor", "create", "z-1", *create, "--selector", "zone=a")
    assert zoned.exit_code == 0 and zoned.stdout.startswith("actor/z-1 created"), zoned.output
    assert zoned.stderr == (f"warning: no undrained worker of class gvisor with the labels zone=a accepts the stamp "
                            f"{label} of the golden snapshot 'golden-9': until one does, z-1 cold-boots instead of "
                            "restoring it (NO_COMPATIBLE_WORKER)\n"), zoned.stderr
    placed = fields((await run("actor", "resume", "z-1")).output)
    assert placed["FALLBACK"] == "NO_COMPATIBLE_WORKER (MEMORY -> NONE)" and placed["WORKER"] == "w-zoned", placed

    floor = await run("actor", "create", "z-2", *create, "--selector", "zone=a", "--min-fidelity", "MEMORY")
    assert floor.stderr == (f"warning: no undrained worker of class gvisor with the labels zone=a accepts the stamp "
                            f"{label} of the golden snapshot 'golden-9': until one does, resuming z-2 is refused (its "
                            "--min-fidelity is MEMORY)\n"), floor.stderr
    refused = await run("actor", "resume", "z-2")
    assert refused.exit_code == 1 and refused.stderr.startswith("error: RESOURCE_EXHAUSTED"), refused.stderr

    anywhere = await run("actor", "create", "z-3", *create)  # w-v9 restores it
    assert anywhere.exit_code == 0 and anywhere.stderr == "", anywhere.output
    await wb.register(worker("w-v9-zoned", runtime(v9, name="runsc-v9"), labels={"zone": "a"}))
    accepted = await run("actor", "create", "z-4", *create, "--selector", "zone=a")
    assert accepted.exit_code == 0 and accepted.stderr == "", accepted.output
    placed = fields((await run("actor", "resume", "z-4")).output)
    assert placed["DECISION"] == "RESTORE at MEMORY" and placed["WORKER"] == "w-v9-zoned", placed


def test_create_says_what_it_could_not_check_where_the_log_cannot_be_read():
    """A client's credentials may not read the log (docs/security.md): the tag's snapshot is not
    read, nor the workers of a class the scheduler counts none undrained of. What is said then
    claims no more than was read: not that no worker runs the class, which drained ones may."""
    from events.schema import ClassFragmentation, Fragmentation

    from warmboot.cmd_lifecycle import Created, create_warnings

    why = "these credentials may not read the log"
    gvisor = ClassFragmentation(sandbox_class="gvisor", workers=0, runtimes=[], stranded_snapshots=0)
    kata = ClassFragmentation(sandbox_class="kata", workers=2, runtimes=[], stranded_snapshots=0)
    read = Created(answer=Fragmentation(classes=[gvisor, kata]), unread=why)
    assert create_warnings(actor("a", source_tag=None), read) == [
        f"warning: no undrained worker runs the sandbox class 'gvisor' (the fleet runs: kata; whether drained ones do "
        f"was not looked up: {why}); resuming a is refused until one does"]
    tagged = Created(answer=Fragmentation(classes=[kata]), tag_unread=why, unread=why)
    assert create_warnings(actor("b", sandbox_class="kata", source_tag="base"), tagged) == [
        f"note: the snapshot of tag base not checked against --template and the workers' runtimes: {why}"]
    floor = actor("c", sandbox_class="kata", source_tag="base", min_fidelity=Fidelity.MEMORY)
    assert create_warnings(floor, tagged) == [f"note: --min-fidelity MEMORY not checked against the snapshot of tag "
                                              f"base: {why}"]


def test_whether_no_worker_passes_a_check_is_read_from_the_explain_of_the_actor():
    """`actor create --selector` warns when the scheduler's explain of the new actor found no undrained
    worker of its class with the labels: no candidate, and every worker of the class passed over for
    its labels (or drained). A worker with them is a candidate or passed over for a later check. So
    for the stamp of its snapshot: none with the labels accepts it when every one with them was passed
    over for `runtime mismatch`."""
    from events.schema import ErrorCode, Explanation, Refusal

    from services.scheduler.feasibility import RUNTIME_MISMATCH, SELECTOR_MISMATCH
    from warmboot.cmd_lifecycle import none_passes

    def explained(candidates: int, **counts: int) -> Explanation:
        counts = {reason.replace("_", " "): n for reason, n in counts.items()}
        return Explanation(candidates=candidates, rejected=[], counts=counts)

    def no_labels(explanation: Explanation | None) -> bool:
        return none_passes(explanation, SELECTOR_MISMATCH)

    assert no_labels(explained(0, selector_mismatch=3))
    assert no_labels(explained(0, selector_mismatch=1, drained=2, class_not_registered=4))
    assert not no_labels(explained(1, selector_mismatch=3))  # a candidate has them
    for later in ("runtime mismatch", "insufficient memory", "insufficient cpu", "not on pinned node"):
        assert not no_labels(Explanation(candidates=0, rejected=[], counts={"selector mismatch": 2, later: 1})), later
    assert not no_labels(explained(0, drained=2))  # none passed over for labels: said apart
    refused = Explanation(refusal=Refusal(code=ErrorCode.FAILED_PRECONDITION, message="RUNNING"), candidates=0,
                          rejected=[], counts={})  # an actor that cannot be resumed: nothing tallied
    assert not no_labels(refused) and not no_labels(None)

    assert none_passes(explained(0, runtime_mismatch=2, selector_mismatch=3), RUNTIME_MISMATCH)
    assert not none_passes(explained(0, runtime_mismatch=2, insufficient_memory=1), RUNTIME_MISMATCH)  # one accepts
    assert not none_passes(explained(1, runtime_mismatch=2), RUNTIME_MISMATCH)
    assert not none_passes(explained(0, selector_mismatch=3), RUNTIME_MISMATCH)  # no worker has the labels: said apart


def test_create_checks_the_size_against_the_workers_read_when_the_scheduler_does_not_say_the_largest():
    """A scheduler of an earlier version has no `largest` in its fragmentation: the size is checked
    against the class's workers as read from the log, as before; when the explain could not be
    asked, a note says the labels were not checked."""
    from types import SimpleNamespace

    from events.schema import ClassFragmentation, ErrorCode, Explanation, Fragmentation, Refusal, Room

    from warmboot.cmd_lifecycle import Created, create_warnings

    gvisor = ClassFragmentation(sandbox_class="gvisor", workers=2, runtimes=[], stranded_snapshots=0)
    index = SimpleNamespace(largest=lambda: (4000, 4096))
    read = Created(answer=Fragmentation(classes=[gvisor]), projection=SimpleNamespace(classes={"gvisor": index}))
    big = actor("big", cpu=100, mem=8192)
    said = ("warning: no registered worker of class gvisor is big enough for big: the largest has 4000m CPU and "
            "4096 MiB memory (4032 MiB after the 64 MiB reserve), the actor needs 100m CPU and 8192 MiB memory plus "
            "its runtime's overhead; resuming big is refused (RESOURCE_EXHAUSTED) until a bigger worker registers")
    assert create_warnings(big, read) == [said]
    assert create_warnings(big, Created(answer=Fragmentation(classes=[msgspec.structs.replace(
        gvisor, largest=Room(cpu_millis=4000, memory_mib=4096))]))) == [said]  # the scheduler's, nothing read
    assert create_warnings(actor("small", cpu=100, mem=4032), read) == []
    zoned = actor("z", cpu=100, mem=64, selectors={"zone": "a"})
    unasked = Created(answer=Fragmentation(classes=[gvisor]), unexplained="nats: timeout")
    assert create_warnings(zoned, unasked) == ["note: --selector not checked against the workers' labels: nats: "
                                               "timeout"]
    refused = Explanation(refusal=Refusal(code=ErrorCode.FAILED_PRECONDITION, message="actor z is RUNNING"),
                          candidates=0, rejected=[], counts={})  # a create replayed by its request id, say
    assert create_warnings(zoned, Created(answer=Fragmentation(classes=[gvisor]), explained=refused)) == [
        "note: --selector not checked against the workers' labels: the scheduler's explain of z looked at no worker: "
        "FAILED_PRECONDITION: actor z is RUNNING"]


async def test_a_tag_that_moves_says_what_it_named(bus):
    """A tag names one snapshot; tagging another actor's with it moves it, which the contract
    allows and the output says (a walkthrough moved a team's golden tag without knowing)."""
    run, wb = bus
    for actor_id in ("a-1", "b-1"):
        await wb.create(actor(actor_id))
        await wb.resume(actor_id)
        await wb.suspend(actor_id, uri=f"s3://bucket/{actor_id}")
    first = await run("actor", "tag", "a-1", "base")
    assert first.exit_code == 0 and "moved" not in first.output
    seq = int(re.search(r"\(seq (\d+)\)", first.output)[1])
    end = await last_seq(wb.nc, wb.prefix)
    again = await run("actor", "tag", "a-1", "base")  # the same snapshot again: nothing moved, nothing written
    assert again.exit_code == 0 and "moved" not in again.output
    assert again.output.startswith("actor/a-1 unchanged: already tagged base: snapshot "), again.output
    assert again.output.rstrip().endswith(f"(seq {seq - 1})"), again.output  # the TagRecorded that named it
    assert await last_seq(wb.nc, wb.prefix) == end  # (it wrote two events each time: a user trial's finding)
    moved = await run("actor", "tag", "b-1", "base")
    assert moved.exit_code == 0, moved.output
    name = first.output.split("snapshot ")[1].split(",")[0]
    assert moved.output.splitlines()[1] == f"base moved: it named snapshot {name} of actor a-1 before"
    as_json = await run("actor", "tag", "a-1", "base", "--json")  # -o json: the reply alone on stdout
    assert json.loads(as_json.stdout)["snapshot"]["actor_id"] == "a-1"
    # and the move on stderr, as other commands' warnings (it said nothing of it: a trial of the CLI)
    b_name = moved.output.split("snapshot ")[1].split(",")[0]
    assert as_json.stderr.strip() == f"note: base moved: it named snapshot {b_name} of actor b-1 before"


async def test_a_retag_that_wrote_nothing_is_answered_alike_when_retried_after_the_tag_moved(bus):
    """A tag naming the actor's latest snapshot already writes nothing (`unchanged`), so its answer is
    kept (as an update-template's to the template the actor has): its retry, with the same request id,
    after the tag moved to another actor's snapshot, gets that answer and writes nothing, instead of
    moving the tag back. A new request id moves it back, as a tag does."""
    _, wb = bus
    for actor_id in ("a-1", "b-1"):
        await wb.create(actor(actor_id))
        await wb.resume(actor_id)
        await wb.suspend(actor_id, uri=f"s3://bucket/{actor_id}")
    tagged = await wb.tag("a-1", "base")
    assert not tagged.unchanged
    kept = await wb.tag("a-1", "base", request_id="again")
    assert kept.unchanged and kept.snapshot == tagged.snapshot and kept.seq == tagged.seq - 1, kept
    moved = await wb.tag("b-1", "base")
    end = await last_seq(wb.nc, wb.prefix)
    assert await wb.tag("a-1", "base", request_id="again") == kept  # the first answer; the tag stays on b-1's
    assert await last_seq(wb.nc, wb.prefix) == end
    assert [e.snapshot for _, e in await read_log(wb.nc, wb.prefix) if isinstance(e, TagRecorded)][-1] == \
        moved.snapshot
    back = await wb.tag("a-1", "base")
    assert not back.unchanged and back.snapshot == tagged.snapshot and back.seq > end


async def test_a_pause_names_the_assignment_a_file_holds_and_a_placement_stored_on_another_worker_is_refused(
        bus, nc, prefix, tmp_path):
    """`actor pause|suspend --placement FILE`: the Assignment `actor resume -o json` printed names its
    seq, worker and pin (`placement_worker_id`, `placement_runtime`), heard beside the snapshotter, and
    the image is recorded. One whose seq holds a placement on another worker (as a log rolled back past
    it and written again would: the file's worker edited here) is refused, FAILED_PRECONDITION naming
    the field, nothing written. A file that is not an Assignment, one of another actor, or one beside
    --placement-seq is a usage error naming --placement, before anything is sent."""
    run, wb = bus
    heard: list = []

    async def keep(msg) -> None:
        heard.append(msgspec.json.decode(msg.data, type=PauseActor))
    await nc.subscribe(f"{prefix}.snapshotter.pause.a-1", cb=keep)
    await wb.create(actor("a-1"))
    resumed = await run("actor", "resume", "a-1", "-o", "json")
    assert resumed.exit_code == 0, resumed.output
    placed = tmp_path / "a-1.json"
    placed.write_text(resumed.stdout)
    got = json.loads(resumed.stdout)
    elsewhere = tmp_path / "elsewhere.json"
    another = "w-new" if got["worker_id"] == "w-old" else "w-old"
    elsewhere.write_text(json.dumps(dict(got, worker_id=another)))
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(got, actor_id="b-1")))
    (tmp_path / "bad.json").write_text('{"actor_id": "a-1"}')
    end = await last_seq(nc, prefix)
    for args, said in ((("--placement", str(tmp_path / "bad.json")), "Invalid value for '--placement'"),
                       (("--placement", str(other)), "is an Assignment of actor b-1, not a-1"),
                       (("--placement", str(placed), "--placement-seq", str(got["seq"])),
                        "give --placement or --placement-seq, not both")):
        refused = await run("actor", "pause", "a-1", *args)
        assert refused.exit_code == 2 and said in refused.output, refused.output
    refused = await run("actor", "pause", "a-1", "--placement", str(elsewhere))
    assert refused.exit_code == 1, refused.output
    assert refused.output.startswith("error: FAILED_PRECONDITION placement_worker_id"), refused.output
    assert await last_seq(nc, prefix) == end  # nothing written, nothing sent for the usage errors
    paused = await run("actor", "pause", "a-1", "--placement", str(placed))
    assert paused.exit_code == 0, paused.output
    await nc.flush()
    assert [(h.placement_seq, h.placement_worker_id) for h in heard] == [(got["seq"], another),
                                                                         (got["seq"], got["worker_id"])]
    assert heard[-1].placement_runtime == decode_request(Assignment, placed.read_bytes()).sandbox_runtime


async def test_fidelities_are_read_in_any_case(bus):
    """As `actor list --state paused` is: `--min-fidelity memory` is MEMORY, not a usage error."""
    run, _ = bus
    created = await run("actor", "create", "f-1", "--class", "gvisor", "--template", "t1", "--cpu", "100",
                        "--memory", "256", "--min-fidelity", "volumes")
    assert created.exit_code == 0, created.output
    assert json.loads((await run("actor", "show", "f-1", "--json")).output)["min_fidelity"] == "VOLUMES"
    wrong = await run("actor", "create", "f-2", "--class", "gvisor", "--template", "t1", "--cpu", "100",
                      "--memory", "256", "--min-fidelity", "warm")
    assert wrong.exit_code == 2 and "'--min-fidelity'" in wrong.output


@pytest.mark.parametrize("command, option, default", [("create", "--min-fidelity", "ROOTFS"),
                                                      ("suspend", "--fidelity", "MEMORY")])
def test_fidelity_choices_read_in_the_case_of_their_default(command, option, default):
    """click showed a case-insensitive choice in lower case, `[memory|volumes|rootfs]`, beside
    `[default: ROOTFS]` (a review): choices, default and the usage error all in upper case, as the
    views print a fidelity; any case is still taken (`test_fidelities_are_read_in_any_case`)."""
    shown = CliRunner().invoke(main, ["actor", command, "--help"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    line = " ".join(next(line for line in shown.output.splitlines() if option in line).split())
    assert line.startswith(f"{option} [MEMORY|VOLUMES|ROOTFS]"), line
    assert f"[default: {default}]" in " ".join(shown.output.split())
    wrong = CliRunner().invoke(main, ["actor", command, "a-1", option, "warm"])
    assert wrong.exit_code == 2
    assert f"Invalid value for '{option}': 'warm' is not one of 'MEMORY', 'VOLUMES', 'ROOTFS'." in wrong.output


async def test_a_tag_moved_to_another_actor_s_image_of_the_same_id_says_so(bus):
    """An id names one image across actors (docs/contract.md), but that image may be in two actors'
    histories: b-1 created from a-1's `img` holds a copy. Moving the tag from a-1's snapshot to
    b-1's is a move to another actor's snapshot, said (it compared only snapshot_id: a review)."""
    run, wb = bus
    await wb.create(actor("a-1"))
    await wb.resume("a-1")
    await wb.suspend("a-1", uri="s3://bucket/a-1", snapshot_id="img")
    first = await run("actor", "tag", "a-1", "base")
    assert first.exit_code == 0 and "moved" not in first.output
    await wb.create(actor("b-1", source_tag="base"))
    moved = await run("actor", "tag", "b-1", "base")
    assert moved.exit_code == 0, moved.output
    assert "base moved: it named snapshot img of actor a-1 before" in moved.output, moved.output


async def test_a_tag_recorded_says_so_when_what_it_named_before_cannot_be_read(bus, nc, prefix, monkeypatch):
    """Of a snapshotter that does not say what the tag named before (`tagged_before`, before
    2026-12-07), `actor tag` reads the tag's history, after the tag is recorded, to say it.
    A CLI older than the services cannot read a newer event there (`read_subject` refuses it,
    `test_placement_review`): that ended the command with a traceback, exit 1, after the tag was
    recorded. The tag is shown as done, and what it named before as not known, with the reason."""
    import msgspec

    import warmboot.cmd_lifecycle
    from events.errors import precondition
    from warmboot.client import Client

    said = Client.tag

    async def earlier(self, *args, **kwargs):  # a snapshotter of an earlier version: no tagged_before
        return msgspec.structs.replace(await said(self, *args, **kwargs), tagged_before=None)

    monkeypatch.setattr(Client, "tag", earlier)

    async def newer(nc, prefix, subject):  # what read_subject says of a history holding a newer event
        raise precondition(f"message 7 of {subject} (TagMovedV2, version 2) is not an event this version "
                           "of warmboot reads (...): a newer warmboot may read it")

    run, wb = bus
    await wb.create(actor("a-1"))
    await wb.resume("a-1")
    await wb.suspend("a-1", uri="s3://bucket/a-1")
    monkeypatch.setattr(warmboot.cmd_lifecycle, "read_subject", newer)
    tagged = await run("actor", "tag", "a-1", "base")
    assert tagged.exit_code == 0, (tagged.output, tagged.exception)
    assert tagged.stdout.splitlines()[1] == (f"what base named before is not known: message 7 of {prefix}.ev.tag.base "
                                             "(TagMovedV2, version 2) is not an event this version of warmboot reads "
                                             "(...): a newer warmboot may read it"), tagged.stdout
    assert tagged.stdout.startswith("actor/a-1 tagged base: snapshot a-1-"), tagged.stdout


def test_pins_and_stamps_of_runtimes_the_fleet_no_longer_runs_are_told_apart():
    """One release (runsc-v1) on two CPU generations pins two running actors and stamps a paused
    one's image; the release is then dropped (each worker runs runsc-v2 on its generation). `actor
    show`, `actor list`, `worker show` and the replies of pause and suspend label them as the
    timeline does (`cmd_audit.timeline_labels`): with their digits, since the fleet no longer holds
    every runtime of that name (a walkthrough: 75 running actors pinned to four runtimes read
    `microvm-v1` alike in `actor list -o wide` and `worker show` once the demo dropped v1)."""
    from events.schema import RuntimeChanged, SnapshotOrigin
    from services.scheduler.projection import Projection
    from tests.factories import booked, created, entry, fold, placed, registered, released, snapshot, stamp, taken
    from warmboot.cmd_lifecycle import actor_view, stamp_label
    from warmboot.cmd_worker import worker_view
    from warmboot.cmd_views import runtimes_of

    gen1, gen2 = version("v1", cpu_features="g1"), version("v1", cpu_features="g2")
    new1, new2 = version("v2", cpu_features="g1"), version("v2", cpu_features="g2")
    old = {w: entry(runtime(v, name="runsc-v1")) for w, v in (("w-1", gen1), ("w-2", gen2))}
    pin1, pin2 = stamp(gen1, name="runsc-v1"), stamp(gen2, name="runsc-v1")
    events = [registered("w-1", old["w-1"]), registered("w-2", old["w-2"]),
              created("a"), placed("a", "w-1", pin1), booked("w-1", "a"),
              created("b"), placed("b", "w-2", pin2), booked("w-2", "b"),
              created("c"), placed("c", "w-1", pin1), booked("w-1", "c"),
              taken(snapshot("c", pin1, node="node-w-1"), SnapshotOrigin.PAUSE), released("c", "w-1")]
    for w, v in (("w-1", new1), ("w-2", new2)):  # the release dropped: each worker runs runsc-v2 only
        events.append(RuntimeChanged(at=events[0].at, worker_id=w, sandbox_classes=(entry(runtime(v, name="runsc-v2")),),
                                     previous=(old[w],)))
    projection = fold(events, Projection())
    runtimes = runtimes_of(projection)
    digits = {v: short_id(compat_key("gvisor", v))[3:] for v in (gen1, gen2)}
    one, two = f"runsc-v1@{digits[gen1]}", f"runsc-v1@{digits[gen2]}"

    pins = {a: actor_view(a, projection, runtimes)["pin"] for a in ("a", "b")}
    assert (pins["a"]["label"], pins["b"]["label"]) == (one, two), pins
    assert actor_view("c", projection, runtimes)["snapshot"]["stamp"]["label"] == one
    assert [a["pin"] for a in worker_view("w-1", projection)["actors"]] == [one]
    assert [i["stamp"] for i in worker_view("w-1", projection)["local_images"]] == [one]
    assert stamp_label(pin2, runtimes) == two  # a pause's or a suspend's reply
    # a runtime the fleet runs reads by its name alone, as in `workers`
    assert stamp_label(stamp(new1, name="runsc-v2"), runtimes) == f"runsc-v2@{short_id(compat_key('gvisor', new1))[3:]}"
    assert stamp_label(stamp(new1, name="runsc-v2"), runtimes) == runtimes.label("gvisor", new1, "runsc-v2")


async def held_while_unanswered(nc, subject: str, *command: str, answered: tuple[str, bytes] | None = None):
    """Run the CLI `command` while its service is down and what hears `subject` keeps each request
    and says "try again", as a replica whose log does not answer: the command gives up (UNAVAILABLE).
    Its request, as it sent it every time (one body, one request id): what a NATS server stopped with
    it in its buffers delivers later. `answered`: a subject and the reply given there meanwhile (the
    service's answer to a read the command makes first, given before it went down)."""
    from events.codec import encode
    from events.errors import unavailable
    from services.endpoints import error_headers

    kept: list = []

    async def keep(msg) -> None:
        kept.append(msg)
        error = unavailable("the event log, a bucket or the bus did not answer (TimeoutError); try again")
        await nc.publish(msg.reply, encode(error.reply()), headers=error_headers(error))

    async def answer(msg) -> None:
        await nc.publish(msg.reply, answered[1])

    caught = await nc.subscribe(subject, cb=keep)
    reads = await nc.subscribe(answered[0], cb=answer) if answered is not None else None
    gave_up = await cli(*command)
    await caught.unsubscribe()
    if reads is not None:
        await reads.unsubscribe()
    assert gave_up.exit_code == 1 and "UNAVAILABLE" in gave_up.stderr, gave_up.output
    assert kept and len({m.data for m in kept}) == 1, kept
    return kept[0]


async def test_a_pause_or_suspend_from_the_cli_names_the_placement_it_read(nats_url, nc, prefix):
    """A failover test held a suspend (no `placement_seq`) in a stopped NATS server's buffers, its
    caller gone, and once the server resumed it recorded life 1's image in the actor's next life,
    stamped with that life's pin: the next resume sent it at MEMORY to a worker that cannot load it.
    `warmboot.client.Client` fences its own resumes' actors; the CLI, a process per command, sent no
    placement. Now `actor pause` and `actor suspend` name the placement the snapshotter says the
    actor has when the command starts (`snapshotter.status`, through the client's fence). Here the
    command's every attempt goes unanswered (the snapshotter went down once it had said where the
    actor is: the caller gives up), and its request is delivered once the actor lives again on a
    worker of another runtime: refused, nothing written. The same copy without its placement (what
    the CLI sent before) records life 1's image with life 2's pin."""
    from contextlib import AsyncExitStack

    from events.errors import ContractError
    from events.schema import ErrorCode, SnapshotReply, SuspendActor
    from tests.factories import SILENT_TTL_S
    from warmboot.runner import start_services

    wb = Client(nc, prefix)
    async with AsyncExitStack() as services:
        await start_services(services, ["registry", "scheduler"], nats_url, prefix,
                             options={"registry": {"ttl_s": SILENT_TTL_S}})
        snapshotter = AsyncExitStack()
        await start_services(snapshotter, ["snapshotter"], nats_url, prefix)
        await wb.register(worker("w-1", runtime(V1), node="node-1"))
        await wb.create(actor("a-1", cpu=1, mem=1))
        first = await wb.resume("a-1")  # life 1 on w-1 (V1): its image is taken there
        placed = [s for s, e in await read_log(nc, prefix) if isinstance(e, ActorPlaced)][-1]
        assert first.worker_id == "w-1" and first.seq in (placed, placed + 1)

        where = await wb.status("a-1")
        assert (where.state, where.placement_seq) == (ActorState.RUNNING, placed)
        await snapshotter.aclose()
        held = await held_while_unanswered(nc, f"{prefix}.snapshotter.suspend.a-1", "actor", "suspend", "a-1",
                                           "--uri", "s3://life-1-image", "--nats", nats_url, "--prefix", prefix,
                                           answered=(f"{prefix}.snapshotter.status.a-1", msgspec.json.encode(where)))
        sent = msgspec.json.decode(held.data, type=SuspendActor)
        assert sent.placement_seq == placed  # the placement the snapshotter said: life 1's

        await start_services(services, ["snapshotter"], nats_url, prefix)  # back; life 2 elsewhere
        await wb.stop("a-1")
        await wb.remove("w-1")
        await wb.register(worker("w-2", runtime(V2), node="node-2"))
        await wb.create(actor("a-1", cpu=1, mem=1))
        second = await wb.resume("a-1")
        assert (second.worker_id, second.sandbox_runtime.version) == ("w-2", V2)

        before = await last_seq(nc, prefix)
        with pytest.raises(ContractError) as refused:
            await delivered(nc, held, held.data, SnapshotReply)
        assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "placement_seq")
        assert "placed on worker 'w-2'" in refused.value.message
        assert await last_seq(nc, prefix) == before  # nothing written

        unfenced = msgspec.json.encode(msgspec.structs.replace(sent, placement_seq=None))
        recorded = await delivered(nc, held, unfenced, SnapshotReply)
        assert (recorded.snapshot.uri, recorded.snapshot.sandbox_runtime.version) == ("s3://life-1-image", V2)


async def test_a_resume_from_the_cli_names_the_life_it_read(nats_url, nc, prefix):
    """The same failover test: a resume its caller gave up on, held in a stopped NATS server's
    buffers, placed the actor's next life once the server resumed (an actor RUNNING that nobody
    started). `actor resume` names the life the snapshotter says the actor is in when the command
    starts (`life_seq`, from `snapshotter.status`): here its every attempt goes unanswered (the scheduler is down), the actor is
    stopped and created anew, and its request is delivered: refused, nothing written. The same copy
    without its life (what the CLI sent before) places life 2; given --life-seq, the command sends
    that one."""
    from contextlib import AsyncExitStack

    from events.errors import ContractError
    from events.schema import Assignment, ErrorCode, ResumeActor
    from tests.factories import SILENT_TTL_S
    from warmboot.runner import start_services

    wb = Client(nc, prefix)
    async with AsyncExitStack() as services:
        await start_services(services, ["registry", "snapshotter"], nats_url, prefix,
                             options={"registry": {"ttl_s": SILENT_TTL_S}})
        await wb.register(worker("w-1", runtime(V1), node="node-1"))
        born = (await wb.create(actor("a-1", cpu=1, mem=1))).seq  # life 1: its ActorCreated
        assert isinstance(dict(await read_log(nc, prefix))[born], ActorCreated)

        held = await held_while_unanswered(nc, f"{prefix}.scheduler.resume.a-1", "actor", "resume", "a-1",
                                           "--nats", nats_url, "--prefix", prefix)
        sent = msgspec.json.decode(held.data, type=ResumeActor)
        assert sent.life_seq == born  # the life the snapshotter said

        await start_services(services, ["scheduler"], nats_url, prefix)
        await wb.stop("a-1")
        reborn = (await wb.create(actor("a-1", cpu=1, mem=1))).seq  # life 2, not resumed by anyone
        before = await last_seq(nc, prefix)
        with pytest.raises(ContractError) as refused:
            await delivered(nc, held, held.data, Assignment)
        assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "life_seq")
        assert refused.value.message.startswith(f"actor 'a-1' was created anew at sequence {reborn}, after the "
                                                f"life this resume names (life_seq {born}): nothing placed")
        assert await last_seq(nc, prefix) == before  # nothing written

        unfenced = msgspec.json.encode(msgspec.structs.replace(sent, life_seq=None))
        ghost = await delivered(nc, held, unfenced, Assignment)  # what it was: life 2 placed
        assert ghost.worker_id == "w-1" and ghost.seq > reborn

        await wb.stop("a-1")
        third = (await wb.create(actor("a-1", cpu=1, mem=1))).seq
        given = await cli("actor", "resume", "a-1", "--life-seq", str(reborn), "--nats", nats_url, "--prefix", prefix)
        assert given.exit_code == 1 and given.stderr.startswith(
            f"error: FAILED_PRECONDITION life_seq (--life-seq): actor 'a-1' was created anew at sequence {third}"), \
            given.output
        resumed = await cli("actor", "resume", "a-1", "--nats", nats_url, "--prefix", prefix, "--json")
        assert resumed.exit_code == 0 and json.loads(resumed.output)["seq"] > third, resumed.output


@pytest.mark.parametrize("verb", ["stop", "update-template"])
async def test_a_stop_or_update_template_from_the_cli_names_the_life_it_was_told(nats_url, nc, prefix, verb):
    """The failover test's other late writes: a stop (or an update-template) its caller gave up on,
    held in a stopped NATS server's buffers, ended (or changed) the actor's next life once the server
    resumed. The CLI names the life the snapshotter says the actor is in when the command starts
    (`life_seq`): here the command's every attempt goes unanswered (the snapshotter went down once it
    had said where the actor is), the actor is stopped and created anew, and its request is
    delivered: refused, nothing written. The same copy without its life (what the CLI sent before)
    acts on life 2."""
    from contextlib import AsyncExitStack

    from events.errors import ContractError
    from events.schema import ErrorCode, SeqReply, StopActor, TemplateChanged, UpdateTemplate
    from warmboot.runner import start_services

    wb = Client(nc, prefix)
    request_type = StopActor if verb == "stop" else UpdateTemplate
    args = ("tpl-2",) if verb == "update-template" else ()
    async with AsyncExitStack() as services:
        snapshotter = AsyncExitStack()
        await start_services(snapshotter, ["snapshotter"], nats_url, prefix)
        born = (await wb.create(actor("a-1", cpu=1, mem=1))).seq
        where = await wb.status("a-1")
        assert (where.state, where.life_seq) == (ActorState.CREATED, born)
        await snapshotter.aclose()
        held = await held_while_unanswered(nc, f"{prefix}.snapshotter.{verb}.a-1", "actor", verb, "a-1", *args,
                                           "--nats", nats_url, "--prefix", prefix,
                                           answered=(f"{prefix}.snapshotter.status.a-1", msgspec.json.encode(where)))
        sent = msgspec.json.decode(held.data, type=request_type)
        assert sent.life_seq == born  # the life the snapshotter said

        await start_services(services, ["snapshotter"], nats_url, prefix)
        await wb.stop("a-1")
        reborn = (await wb.create(actor("a-1", cpu=1, mem=1))).seq
        before = await last_seq(nc, prefix)
        with pytest.raises(ContractError) as refused:
            await delivered(nc, held, held.data, SeqReply)
        assert (refused.value.code, refused.value.field) == (ErrorCode.FAILED_PRECONDITION, "life_seq")
        assert refused.value.message.startswith(f"actor 'a-1' was created anew at sequence {reborn}, after the "
                                                f"life this {verb} names (life_seq {born}): nothing "), refused.value
        assert await last_seq(nc, prefix) == before  # nothing written

        unfenced = msgspec.json.encode(msgspec.structs.replace(sent, life_seq=None))
        acted = await delivered(nc, held, unfenced, SeqReply)  # what it was: life 2 stopped, or changed
        event = dict(await read_log(nc, prefix))[acted.seq]
        assert isinstance(event, ActorStopped if verb == "stop" else TemplateChanged) and acted.seq > reborn


async def test_a_pause_or_stop_a_snapshotter_of_an_earlier_version_serves_goes_as_before_and_says_so(
        nats_url, nc, prefix):
    """A snapshotter of an earlier version carries out a pause or a stop but has no `status` (and
    ignores `placement_seq` and `life_seq`): a client that knows no placement of the actor, and the
    CLI, send the request without one, as before they asked, and say so (the CLI on stderr, the
    library to its `on_unfenced`), once the snapshotter that answers discovery (`$SRV.INFO`) lists no
    `status`. Where none answers discovery (none running) or one lists `status` (one restarting: the
    question reached none, a request sent now might reach one that fences), and where the question
    was heard and answered UNAVAILABLE, the call fails and nothing is sent (a review's finding: it
    went without a fence)."""
    from events.errors import ContractError
    from events.schema import ErrorCode, PauseActor, SeqReply, SnapshotReply, StopActor
    from tests.factories import snapshot
    from warmboot.client import NobodyAnswered

    heard: dict[str, list] = {"pause": [], "stop": []}

    async def pause(msg) -> None:  # what a snapshotter before `status` answers
        heard["pause"].append(msgspec.json.decode(msg.data, type=PauseActor))
        await msg.respond(msgspec.json.encode(SnapshotReply(snapshot=snapshot("a-1", None, node="node-1"), seq=7)))

    async def stop(msg) -> None:
        heard["stop"].append(msgspec.json.decode(msg.data, type=StopActor))
        await msg.respond(msgspec.json.encode(SeqReply(seq=8)))

    def info(*verbs: str, of: str = prefix) -> bytes:
        return msgspec.json.encode({"name": "warmboot-snapshotter", "id": "x", "version": "0.0.9", "type":
                                    "io.nats.micro.v1.info_response", "metadata": {"prefix": of},
                                    "endpoints": [{"name": v, "subject": f"{of}.snapshotter.{v}.*"} for v in verbs]})

    served = {"info": [info("pause", "stop", of="another-deployment"), info("pause", "stop")]}

    async def discovery(msg) -> None:
        for answer in served["info"]:
            await msg.respond(answer)

    await nc.subscribe(f"{prefix}.snapshotter.pause.a-1", cb=pause)
    await nc.subscribe(f"{prefix}.snapshotter.stop.a-1", cb=stop)
    await nc.subscribe("$SRV.INFO.warmboot-snapshotter", cb=discovery)
    told: list = []
    wb = Client(nc, prefix, attempts=2, timeout=1, on_unfenced=lambda actor_id, error: told.append((actor_id, error)))
    assert (await wb.pause("a-1")).seq == 7
    assert [h.placement_seq for h in heard["pause"]] == [None] and [a for a, _ in told] == ["a-1"]
    assert isinstance(told[0][1], NobodyAnswered) and f"{prefix}.snapshotter.status.a-1" in told[0][1].message

    cli_args = ("a-1", "--nats", nats_url, "--prefix", prefix)
    paused = await cli("actor", "pause", *cli_args)
    assert paused.exit_code == 0 and paused.stdout.startswith("actor/a-1 paused: "), paused.output
    assert paused.stderr.startswith(
        "note: not fenced to the actor's placement (give --placement-seq: a copy of this request decided after the "
        "actor is placed anew is then refused, not carried out): the snapshotter lists no status endpoint (an "
        "earlier version)\n"), paused.stderr
    stopped = await cli("actor", "stop", *cli_args)
    assert stopped.exit_code == 0 and stopped.stderr == (
        "note: not fenced to the actor's life (give --life-seq: a copy of this request decided after the actor is "
        "created anew is then refused, not carried out): the snapshotter lists no status endpoint (an earlier "
        "version)\n"), stopped.output
    assert [h.placement_seq for h in heard["pause"]] == [None, None] and [h.life_seq for h in heard["stop"]] == [None]

    for answers in ([], [info("pause", "stop", "status")]):  # none running; one restarting
        served["info"] = answers
        with pytest.raises(NobodyAnswered):
            await wb.pause("a-1")
        refused = await cli("actor", "stop", *cli_args)
        assert refused.exit_code == 1 and "no service answers" in refused.stderr, refused.output

    async def failing(msg) -> None:
        await msg.respond(b'{"error": {"code": "UNAVAILABLE", "message": "the event log did not answer"}}')

    await nc.subscribe(f"{prefix}.snapshotter.status.a-1", cb=failing)
    with pytest.raises(ContractError) as failed:
        await wb.pause("a-1")
    assert failed.value.code is ErrorCode.UNAVAILABLE and "the event log did not answer" in failed.value.message
    failed_stop = await cli("actor", "stop", *cli_args)
    assert failed_stop.exit_code == 1 and "the event log did not answer" in failed_stop.stderr, failed_stop.output
    assert (len(heard["pause"]), len(heard["stop"]), len(told)) == (2, 1, 1)  # nothing more sent, or told unfenced


async def test_a_command_s_fence_passes_over_an_event_of_a_newer_version_in_the_history(
        stack, nc, prefix, nats_url, writer):
    """An event this version cannot read (a newer snapshotter's, in the actor's last life) does not
    fail `actor resume`, which the scheduler places (it failed, FAILED_PRECONDITION naming the
    message, when the fence decoded every body: a review; before the fence the command was sent).
    The snapshotter, which cannot read that history, does not say which life the actor is in: the
    resume is sent without one, and says so on stderr."""
    from tests.factories import AT, created
    from tests.test_placement_review import SnapshotTakenV2

    wb = Client(nc, prefix)
    await wb.register(worker("w0", V1))
    await wb.create(actor("a"))
    await asyncio.to_thread(writer.write, SnapshotTakenV2(at=AT, actor_id="a", snapshot_id="a-2", stamp="x"))
    reborn = await asyncio.to_thread(writer.write, ActorStopped(at=AT, actor_id="a"), created("a"))
    resumed = await cli("actor", "resume", "a", "--min-seq", str(await last_seq(nc, prefix)), "--nats", nats_url,
                        "--prefix", prefix, "--json")
    assert resumed.exit_code == 0, resumed.output
    seq, event = await wait_for(nc, prefix, lambda e: isinstance(e, ActorPlaced), after=reborn)  # life 2's
    assert event.actor_id == "a" and json.loads(resumed.stdout)["seq"] in (seq, seq + 1)
    assert resumed.stderr.startswith("note: not fenced to the actor's life (give --life-seq: ") and \
        "the snapshotter did not say which life the actor is in (UNAVAILABLE: " in resumed.stderr, resumed.stderr


async def test_several_workers_are_drained_and_removed_by_one_command(bus, nc, prefix):
    """`worker drain` and `remove` took one worker: a loop of commands, 0.5 s each, ten minutes for a thousand
    workers (a trial at fleet size). One command takes several, sends them over one connection, prints a
    line each as it is done; one refused is said and the others go on, exit status 1; --json a list."""
    run, wb = bus
    await wb.register(worker("w-3", runtime(V2, name="runsc-v2"), node="node-3"))
    drained = await run("worker", "drain", "w-old", "w-new", "nobody", "w-old")
    assert drained.exit_code == 1, drained.output
    assert sorted(re.sub(r"\d+", "N", line) for line in drained.stdout.splitlines()) == [
        "worker/w-new drained (seq N)", "worker/w-old drained (seq N)"], drained.stdout
    assert drained.stderr == ("error: worker/nobody: NOT_FOUND worker_id: worker 'nobody' is not registered\n"
                              "error: 1 of 3 workers not drained: nobody\n")
    again = await run("worker", "drain", "w-new", "w-3", "--json")
    assert again.exit_code == 0, again.output
    listed = json.loads(again.stdout)
    assert [(r["worker_id"], r["unchanged"]) for r in listed] == [("w-new", True), ("w-3", False)], listed
    twice = await run("worker", "drain", "w-new", "w-3", "--request-id", "r-1")
    assert twice.exit_code == 2 and "--request-id names one request" in twice.stderr, twice.output
    removed = await run("worker", "remove", "w-old", "w-new", "w-3")
    assert removed.exit_code == 0 and len(removed.stdout.splitlines()) == 3, removed.output
    assert "stop the agents" in removed.stderr
    for worker_id in ("w-old", "w-new", "w-3"):
        assert (await run("worker", "show", worker_id)).exit_code == 1  # removed


async def test_several_actors_are_resumed_by_one_command(bus, nc, prefix):
    """`actor resume` took one actor: 0.7 s a command, twelve minutes for a thousand (a trial at fleet
    size). One command takes several: a line each as it is placed, one refused said while the others go
    on, exit status 1; --json a list; --request-id and --life-seq name one actor's request."""
    run, _ = bus
    for actor_id in ("a-1", "a-2", "a-3"):
        created = await run("actor", "create", actor_id, "--class", "gvisor", "--template", "t1", "--cpu", "500",
                            "--memory", "1024")
        assert created.exit_code == 0, created.output
    resumed = await run("actor", "resume", "a-1", "a-2", "nobody")
    assert resumed.exit_code == 1, resumed.output
    lines = sorted(resumed.stdout.splitlines())
    assert [re.sub(r"w-(old|new)", "W", re.sub(r"runsc-v\d", "R", re.sub(r"\d+\)", "N)", line)))
            for line in lines] == [f"actor/{a} RUN (cold boot) on W, runtime R (seq N)" for a in ("a-1", "a-2")], lines
    assert resumed.stderr.startswith("error: actor/nobody: NOT_FOUND") and resumed.stderr.endswith(
        "error: 1 of 3 actors not placed: nobody\n"), resumed.stderr
    for line in lines:  # each is the log's placement
        (event, _) = await wrote(nc, prefix, int(line.rsplit(" ", 1)[1].rstrip(")")))
        assert isinstance(event, ActorPlaced) and event.actor_id == line.split()[0].split("/")[1]
    as_json = await run("actor", "resume", "a-3", "--json", "a-1")  # a-1 runs: refused, the list says so
    listed = json.loads(as_json.stdout)
    assert [r["actor_id"] for r in listed] == ["a-3", "a-1"] and listed[0]["worker_id"] in ("w-old", "w-new")
    assert as_json.exit_code == 1 and "error" in listed[1], listed
    for option in (("--life-seq", "3"), ("--request-id", "r-1")):
        refused = await run("actor", "resume", "a-1", "a-2", *option)
        assert refused.exit_code == 2 and f"{option[0]} names one" in refused.stderr, refused.output


async def test_several_ids_sent_where_no_service_answers_are_said_once_as_one_id_is(bus, nats_url):
    """`worker drain` of several workers (and `actor resume` of several actors) with a --prefix no
    service answers: nothing subscribes to any of their subjects, so no id fares better than the first.
    It said the same UNAVAILABLE once per id, each after its attempts (40 lines, 5 s for 40 workers: at a
    thousand, over a minute and a thousand lines), and none of them said where the logs are, which the
    command of one id says (`logs here: --prefix P`). Now the first such answer ends the command, said
    as the command of one id says it."""
    for command in (["worker", "drain", *(f"w-{i}" for i in range(40))],
                    ["actor", "resume", *(f"a-{i}" for i in range(40))]):
        shown = await cli(*command, "--nats", nats_url, "--prefix", "wrongpfx")
        assert shown.exit_code == 1 and shown.stdout == "", (command, shown.output)
        lines = shown.stderr.splitlines()
        assert len(lines) == 1, (command, lines[:3])
        assert re.match(r"error: UNAVAILABLE: no service answers wrongpfx\.\w+\.\w+\.[aw]-\d+ after \d+ attempts in "
                        r"[\d.]+ s \(is --prefix wrongpfx the deployment's\? logs here: --prefix ", lines[0]), lines
