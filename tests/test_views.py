"""The operator views fit a terminal: plain aligned columns, short runtime identities, no cell cut.

Rendered at 80 and 100 columns from a fleet with realistic ids (workers `w-gv-0042`,
nodes `node-eu-west-017`, one runtime name shared by three CPU generations), both
from the pure renderers and through the CLI against real services on the bus.
"""

from __future__ import annotations

import asyncio
import json
import re
from contextlib import AsyncExitStack
from datetime import datetime, timezone

import msgspec
import pytest
from click.testing import CliRunner

from events.codec import to_builtins
from events.compat import compat_key
from events.runtime_id import Runtimes, UnknownRuntime, short_id
from events.schema import (
    ActorRuntime,
    Assignment,
    Attribute,
    CompatVersion,
    CreateActor,
    ErrorCode,
    Explanation,
    ExplainResume,
    Fragmentation,
    FragmentationQuery,
    PauseActor,
    Refusal,
    Rejection,
    RegisterReply,
    RegisterWorker,
    Resources,
    ResumeActor,
    SeqReply,
    SnapshotReply,
    WorkerRegistered,
    WorkerRuntime,
    WorkerSandboxClass,
)
from events.subjects import service_subject
from services.endpoints import call
from services.scheduler.fragmentation import fragmentation
from services.scheduler.projection import Projection
from tests.factories import SILENT_TTL_S, last_seq, log_reads, version
from warmboot.cli import main
from services.scheduler.decide import _how_far
from warmboot.cmd_explain import REJECTED_COLUMNS, render_explanation
from warmboot.cmd_fragmentation import CLASS_COLUMNS, render_fragmentation, runtime_columns
from warmboot.cmd_views import WORKER_COLUMNS, render_workers, runtimes_of, with_runtime_ids, worker_rows
from warmboot.runner import SERVICES, start_services

WIDTHS = (80, 100)
AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
GENERATIONS = {
    "gvisor": [{"architecture": "amd64", "cpu_features": f"{h:016x}"}
               for h in (0x0AC853DF914E2CA0, 0x5F1D0C3B2A994E17, 0x9E3779B97F4A7C15)],
    "microvm": [{"architecture": "amd64", "cpu_vendor": "GenuineIntel", "cpu_model": m}
                for m in ("6/106", "6/143", "25/17")],
}
NAMES = {"gvisor": "runsc", "microvm": "firecracker"}


def runtime(sandbox_class: str, generation: int, release: str) -> WorkerRuntime:
    attrs = {**GENERATIONS[sandbox_class][generation], "asset_digest": f"sha256-{sandbox_class}-{release}"}
    return WorkerRuntime(
        name=f"{NAMES[sandbox_class]}-{release}",  # one name on three CPU generations, as in a real fleet
        version=CompatVersion(schema_version="v1",
                              attributes=tuple(Attribute(key=k, value=v) for k, v in sorted(attrs.items()))),
    )


def fleet(n: int = 24) -> list[RegisterWorker]:
    workers = []
    for i in range(n):
        cls = ("gvisor", "microvm")[i % 2]
        generation = (0, 0, 1, 2)[(i // 2) % 4]
        entry = WorkerSandboxClass(
            sandbox_class=cls, default_runtime=runtime(cls, generation, "2024.11"),
            restorable_runtimes=(runtime(cls, generation, "2024.05"),) if i % 3 else (),
        )
        workers.append(RegisterWorker(
            worker_id=f"w-{cls[:2]}-{i:04d}", node=f"node-eu-west-{i:03d}",
            capacity=Resources(cpu_millis=16000, memory_mib=65536), sandbox_classes=(entry,)))
    return workers


def folded(workers: list[RegisterWorker]) -> Projection:
    projection = Projection()
    for seq, w in enumerate(workers, 1):
        projection.apply(seq, WorkerRegistered(at=AT, worker_id=w.worker_id, node=w.node, capacity=w.capacity,
                                               labels=w.labels, sandbox_classes=w.sandbox_classes), 1)
    return projection


def possible_cells(columns, rows) -> set[str]:
    """Every cell the columns can show for these rows (full and narrow forms), and the header words."""
    cells: set[str] = set()
    for column in columns:
        for c in (column, column.narrow) if column.narrow else (column,):
            cells.update(c.header.split())
            cells.update(word for row in rows for word in c.value(row).split())
    return cells


def assert_fits_whole(text: str, width: int, allowed: set[str]) -> None:
    """No line is wider than the terminal, and every word shown is a whole cell (none was cut)."""
    lines = text.splitlines()
    too_wide = [line for line in lines if len(line) > width]
    assert not too_wide, f"{len(too_wide)} lines over {width} columns: {too_wide[0]!r}"
    assert "…" not in text and "│" not in text and "─" not in text  # no ellipsis, no box borders
    note = next((i for i, line in enumerate(lines) if line.startswith("(to fit")), len(lines))
    for line in lines[:note]:  # up to the note on what gave way
        for word in line.split():
            assert word in allowed, f"{word!r} is not a whole cell, in {line!r}"


# --- the short runtime identity --------------------------------------------------------------------


def test_short_id_is_a_pure_function_of_the_compat_key():
    a = runtime("gvisor", 0, "2024.11").version
    shuffled = CompatVersion(schema_version="v1", attributes=tuple(reversed(a.attributes)))
    assert short_id(compat_key("gvisor", a)) == short_id(compat_key("gvisor", shuffled))
    assert short_id(compat_key("gvisor", a)) != short_id(compat_key("microvm", a))
    # the documented vector (docs/events.md): a client in another language computes the same
    v = CompatVersion(schema_version="v1", attributes=(Attribute(key="cpu_features", value="0ac853df914e2ca0"),
                                                       Attribute(key="architecture", value="amd64")))
    assert short_id(compat_key("gvisor", v)) == "rt-00e9f5"


def test_labels_tell_runtimes_apart_and_read_back():
    gen0, gen1 = runtime("gvisor", 0, "2024.11"), runtime("gvisor", 1, "2024.11")
    unique = runtime("gvisor", 2, "2024.05")
    runtimes = Runtimes([("gvisor", r.version, r.name) for r in (gen0, gen1, unique)])
    runtimes.add("gvisor", runtime("microvm", 0, "x").version)  # a runtime without a name
    label0 = runtimes.label("gvisor", gen0.version)
    assert label0 == "runsc-2024.11@" + short_id(compat_key("gvisor", gen0.version))[3:]
    assert runtimes.label("gvisor", unique.version) == "runsc-2024.05"
    assert runtimes.label("gvisor", runtime("microvm", 0, "x").version).startswith("rt-")
    assert runtimes.resolve_one(label0).version == gen0.version
    assert runtimes.resolve_one(short_id(compat_key("gvisor", gen1.version))).version == gen1.version
    assert runtimes.resolve_one("runsc-2024.05").version == unique.version
    assert [k.version for k in runtimes.resolve("runsc-2024.11")] == sorted(
        [gen0.version, gen1.version], key=lambda v: compat_key("gvisor", v))
    with pytest.raises(UnknownRuntime, match="names 2 runtimes"):
        runtimes.resolve_one("runsc-2024.11")
    with pytest.raises(UnknownRuntime, match="no runtime of class microvm is named 'runsc-2024.05'"):
        runtimes.resolve("runsc-2024.05", sandbox_class="microvm")


def test_a_name_written_like_a_label_never_passes_for_another_runtime():
    """A worker names its runtime freely: one named like another runtime's label (`name@digits`,
    `rt-...`) is shown with its own digits, so a view never shows two runtimes alike (found by a
    review: a runtime named 'gvisor-v2@cf49e0' read as the real one in `workers`). Without the fleet
    (`complete=False`: the log could not be read) no name stands alone."""
    real, other = runtime("gvisor", 0, "2024.11"), runtime("gvisor", 1, "2024.11")
    real_digits = short_id(compat_key("gvisor", real.version))[3:]
    other_digits = short_id(compat_key("gvisor", other.version))[3:]
    fake_name = f"runsc-2024.11@{real_digits}"
    runtimes = Runtimes([("gvisor", real.version, "runsc-2024.11"), ("gvisor", other.version, fake_name)])
    assert runtimes.label("gvisor", other.version) == f"{fake_name}@{other_digits}"
    assert runtimes.resolve_one(f"{fake_name}@{other_digits}").version == other.version
    assert runtimes.resolve_one(f"runsc-2024.11@{real_digits}").version == real.version
    spoof = Runtimes([("gvisor", other.version, "rt-" + real_digits)])
    assert spoof.label("gvisor", other.version) == f"rt-{real_digits}@{other_digits}"
    unknown = Runtimes(complete=False)
    assert unknown.label("gvisor", real.version, "runsc-2024.11") == f"runsc-2024.11@{real_digits}"
    assert unknown.label("gvisor", real.version) == f"rt-{real_digits}"


def test_fragmentation_rows_come_in_the_order_of_their_labels():
    """Rows by class, then label, whatever order the reply gives them in (they followed none)."""
    from events.schema import ClassFragmentation, Fragmentation, Room, RuntimeFragmentation

    named = [runtime("gvisor", g, release) for g, release in ((0, "2024.11"), (1, "2024.05"), (2, "2025.01"))]
    runtimes = Runtimes([("gvisor", r.version, r.name) for r in named])
    rows = [RuntimeFragmentation(version=r.version, workers_default=1, workers_restorable=0,
                                 free=Room(cpu_millis=0, memory_mib=0), snapshots_memory=0) for r in named]
    answer = Fragmentation(classes=[ClassFragmentation(sandbox_class="gvisor", workers=3, runtimes=rows,
                                                       stranded_snapshots=0)])
    text = render_fragmentation(answer, runtimes, None)
    shown = [line.split()[1] for line in text.split("\n\n", 1)[1].splitlines()[1:]]
    assert shown == ["runsc-2024.05", "runsc-2024.11", "runsc-2025.01"], text


# --- the renderers -------------------------------------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
def test_workers_fit_without_a_cut_cell(width):
    rows = worker_rows(folded(fleet()))
    rendered = render_workers(rows, width)
    assert_fits_whole(rendered.text, width, possible_cells(WORKER_COLUMNS, rows))
    header = rendered.text.splitlines()[0].split()
    assert header[:2] == ["WORKER", "RUNTIME"] or header[:3] == ["WORKER", "CLASS", "RUNTIME"]
    assert {"STATE", "CPU", "MEM", "FREE"} <= set(header)
    assert len(rendered.text.splitlines()) == len(rows) + 1
    if width == 100:  # the labels, not only the ids, have room
        assert all(r["runtime"] in rendered.text for r in rows)
    assert rendered.left_out and rendered.footnote(width).startswith(f"(to fit {width} columns: NODE")


def test_wide_shows_every_column_and_the_full_attributes():
    rows = worker_rows(folded(fleet()))
    text = render_workers(rows, 80, wide=True).text
    assert text.splitlines()[0].split()[-9:] == ["MEM", "RUNTIME", "ID", "RESTORABLE", "IDS", "RESUMES", "FROM",
                                                  "LABELS", "ATTRIBUTES"]
    first = next(r for r in rows if r["restorable"])
    line = next(line for line in text.splitlines() if line.startswith(first["worker_id"] + " "))
    assert first["node"] in line and first["runtime_id"] in line and "cpu_features=" in line
    assert first["restorable_ids"] and ",".join(first["restorable_ids"]) in line.split()  # as the default's id


def test_wide_shows_the_versions_a_worker_resumes_through_its_edges_and_its_labels():
    """`compatible_versions` (one-way edges) had no view: `-o wide` lists them by label, as the
    other runtimes; -o json by version too. And the labels selectors match (a walkthrough)."""
    workers = fleet(4)
    workers[0] = msgspec.structs.replace(workers[0], labels={"zone": "b", "disk": "ssd"})
    older = runtime("gvisor", 0, "2024.05").version
    edged = workers[0].sandbox_classes[0]
    default = msgspec.structs.replace(edged.default_runtime, compatible_versions=(older,))
    workers[0] = msgspec.structs.replace(workers[0], sandbox_classes=(
        msgspec.structs.replace(edged, default_runtime=default, restorable_runtimes=()),))
    projection = folded(workers)
    runtimes = runtimes_of(projection)
    rows = {r["worker_id"]: r for r in worker_rows(projection, runtimes)}
    edge = rows[workers[0].worker_id]
    assert edge["resumes_from"] == [runtimes.label("gvisor", older)]
    assert edge["resumes_from_versions"] == [to_builtins(older)]
    assert rows[workers[1].worker_id]["resumes_from"] == []
    text = render_workers(list(rows.values()), 80, wide=True).text
    line = next(line for line in text.splitlines() if line.startswith(workers[0].worker_id + " "))
    assert runtimes.label("gvisor", older) in line.split() and "disk=ssd,zone=b" in line.split()
    assert edge["labels"] == {"zone": "b", "disk": "ssd"} and rows[workers[1].worker_id]["labels"] == {}


@pytest.mark.parametrize("width", WIDTHS)
def test_fragmentation_fits_without_a_cut_cell(width):
    projection = folded(fleet())
    answer = fragmentation(projection)
    runtimes = runtimes_of(projection)
    text = render_fragmentation(answer, runtimes, width)
    rows = [(c.sandbox_class, rt) for c in answer.classes for rt in c.runtimes]
    allowed = possible_cells(CLASS_COLUMNS, answer.classes) | possible_cells(runtime_columns(runtimes), rows)
    assert_fits_whole(text, width, allowed)
    assert "LOST LOCAL" in text and "STRANDED" in text
    for cls, rt in rows:  # every runtime shown by its label
        assert runtimes.label(cls, rt.version) in text


def test_fragmentation_leaves_out_the_runtimes_only_drained_workers_offer_unless_wide():
    """A fleet's retired (drained) machines listed, per runtime only they offered, a row of zeros (a user
    trial): WORKERS counts undrained workers only, and so do the runtime rows. Such rows are left out and
    counted in a note that says -o wide lists them; -o wide lists them, noted; the classes stay."""
    from events.schema import WorkerDrained

    workers = fleet(8)  # gvisor: w-gv-0000 and -0002 of generation 0, -0004 of 1, -0006 of 2
    projection = folded(workers)
    projection.apply(len(workers) + 1, WorkerDrained(at=AT, worker_id="w-gv-0004", reason="retired"), 1)
    answer = fragmentation(projection)
    runtimes = runtimes_of(projection)
    idle = [(c.sandbox_class, rt) for c in answer.classes for rt in c.runtimes
            if not (rt.workers_default or rt.workers_restorable or rt.workers_compatible or rt.snapshots_memory)]
    retired = {runtimes.label("gvisor", rt.version) for _, rt in idle}
    assert retired == {runtimes.label("gvisor", runtime("gvisor", 1, r).version) for r in ("2024.11", "2024.05")}
    text = render_fragmentation(answer, runtimes, None)
    listed = {line.split()[1] for line in text.split("\n\n", 1)[1].splitlines()[1:] if not line.startswith("(")}
    assert listed and not listed & retired, text
    assert text.endswith("\n(2 runtimes only drained workers offer, with no memory snapshot, left out; -o wide lists "
                         "them)"), text
    assert text.splitlines()[1].split()[:2] == ["gvisor", "3"]  # the class, its undrained workers
    wide = render_fragmentation(answer, runtimes, None, wide=True)
    assert retired <= set(wide.split()), wide
    assert wide.endswith("\n(2 runtimes only drained workers offer, with no memory snapshot: every count 0)"), wide
    # a fleet with no worker drained says nothing of it
    assert "drained" not in render_fragmentation(fragmentation(folded(workers)), runtimes, None)


@pytest.mark.parametrize("width", WIDTHS)
def test_explain_fits_and_wraps_without_cutting(width):
    projection = folded(fleet())
    runtimes = runtimes_of(projection)
    refused = Explanation(
        refusal=Refusal(code=ErrorCode.FAILED_PRECONDITION,
                        message="the LOCAL image of a-0042 is on node node-eu-west-017, which has no registered "
                                "worker of class gvisor; give it up with revert to go back to its latest "
                                "EXTERNAL snapshot"),
        candidates=12, counts={"runtime mismatch": 7},
        rejected=[Rejection(worker_id=f"w-gv-{i:04d}", reasons=["runtime mismatch", "insufficient memory"])
                  for i in range(12)],
        message="0/12 workers available: 7 runtime mismatch, 3 insufficient memory, 2 drained",
    )
    text = render_explanation("a-0042", refused, runtimes, width, wide=True)  # a worker a row
    words = {w for field in ("ACTOR", "SUMMARY", "REFUSED", "a-0042", refused.message,
                             "FAILED_PRECONDITION: " + refused.refusal.message) for w in field.split()}
    rows = [(r.worker_id, ", ".join(r.reasons)) for r in refused.rejected]
    assert_fits_whole(text.split("\n\n")[1], width, possible_cells(REJECTED_COLUMNS, rows))
    assert " ".join(text.split()).count(refused.refusal.message) == 1  # wrapped, every word kept
    assert all(f"{r.worker_id}  {', '.join(r.reasons)}" in text for r in refused.rejected)
    grouped = render_explanation("a-0042", refused, runtimes, width)  # the twelve alike: one row
    head, table, *_ = grouped.split("\n\n")
    assert_fits_whole(head, width, words)
    assert table.splitlines()[1:] == [
        "w-gv-0000, w-gv-0001, w-gv-0002 (+9 more)  runtime mismatch, insufficient memory",
        "(workers passed over for the same reasons share a row: -o wide lists each)"]


# --- through the CLI, against the services -----------------------------------------------------------------


@pytest.fixture(scope="module")
async def operated(nats_server):
    """Real services on their own prefix; the fleet registered, actors created, resumed and paused."""
    prefix = "t" + __import__("uuid").uuid4().hex[:12]
    async with AsyncExitStack() as exits:
        await start_services(exits, list(SERVICES), nats_server.url, prefix,
                             options={"scheduler": {"metrics": False}, "registry": {"ttl_s": SILENT_TTL_S}})
        import nats

        nc = await nats.connect(nats_server.url)
        exits.push_async_callback(nc.close)
        for w in fleet():
            await call(nc, service_subject(prefix, "registry", "register", w.worker_id), w, RegisterReply)
        for i in range(6):
            actor = f"a-{i:04d}"
            cls = ("gvisor", "microvm")[i % 2]
            created = await call(nc, service_subject(prefix, "snapshotter", "create", actor),
                                 CreateActor(actor_id=actor, sandbox_class=cls, template_uid="tpl-2026-01",
                                             resources=Resources(cpu_millis=500, memory_mib=1024)), SeqReply)
            # read-your-writes: the scheduler's fold may not have the create yet (NOT_FOUND, seen under load)
            placed = await call(nc, service_subject(prefix, "scheduler", "resume", actor),
                                ResumeActor(min_seq=created.seq), Assignment)
            if i % 2:
                await call(nc, service_subject(prefix, "snapshotter", "pause", actor),
                           PauseActor(), SnapshotReply)
            assert placed.worker_id
        # the views read the scheduler without min_seq: its fold has every write above before the tests run
        await call(nc, service_subject(prefix, "scheduler", "fragmentation"),
                   FragmentationQuery(min_seq=await last_seq(nc, prefix)), Fragmentation)
        yield prefix, nc


def cli(*args: str, width: int | None = None):
    env = {"COLUMNS": str(width)} if width else {}
    return asyncio.to_thread(CliRunner().invoke, main, list(args), env=env)


@pytest.mark.parametrize("width", WIDTHS)
async def test_workers_command_fits(operated, nats_url, width):
    prefix, _ = operated
    shown = await cli("workers", "--nats", nats_url, "--prefix", prefix, width=width)
    assert shown.exit_code == 0, shown.output
    listed = await cli("workers", "-o", "json", "--nats", nats_url, "--prefix", prefix)
    rows = json.loads(listed.output)
    assert len(rows) == len(fleet()) and sum(r["actors"] for r in rows) == 3  # three run, three paused
    assert_fits_whole(shown.output, width, possible_cells(WORKER_COLUMNS, rows))
    legacy = await cli("workers", "--json", "--nats", nats_url, "--prefix", prefix)
    assert json.loads(legacy.output) == rows


@pytest.mark.parametrize("width", WIDTHS)
async def test_fragmentation_command_fits_and_labels_like_workers(operated, nats_url, width):
    prefix, nc = operated
    answer = await call(nc, service_subject(prefix, "scheduler", "fragmentation"), FragmentationQuery(),
                        Fragmentation)
    shown = await cli("fragmentation", "--nats", nats_url, "--prefix", prefix, width=width)
    assert shown.exit_code == 0, shown.output
    workers = json.loads((await cli("workers", "-o", "json", "--nats", nats_url, "--prefix", prefix)).output)
    runtimes = runtimes_of(folded(fleet()))
    rows = [(c.sandbox_class, rt) for c in answer.classes for rt in c.runtimes]
    allowed = possible_cells(CLASS_COLUMNS, answer.classes) | possible_cells(runtime_columns(runtimes), rows)
    assert_fits_whole(shown.output, width, allowed)
    assert {r["runtime"] for r in workers} <= set(shown.output.split())  # the same label in both views
    assert sum(rt.snapshots_memory for _, rt in rows) == 3  # the paused actors' images


async def test_a_class_no_worker_runs_is_an_error_naming_the_classes_the_fleet_runs(operated, nats_url):
    """As whatif's `--class` is: `workers --class nope` and `fragmentation --class nope` exited 0
    with a line saying nothing of the classes there are (a review); `-o json` too, on stderr."""
    prefix, _ = operated
    for command in ("workers", "fragmentation"):
        for output in ((), ("-o", "json"), ("-o", "wide")):
            shown = await cli(command, "--class", "nope", *output, "--nats", nats_url, "--prefix", prefix)
            assert shown.exit_code == 1, (command, output, shown.output)
            assert shown.stderr == ("error: NOT_FOUND sandbox_class (--class): no worker has registered the sandbox "
                                    "class 'nope' (registered: gvisor, microvm)\n"), (command, output, shown.stderr)
            assert shown.stdout == "", (command, output, shown.stdout)
    # a class that is there is still shown
    for command in ("workers", "fragmentation"):
        shown = await cli(command, "--class", "microvm", "--nats", nats_url, "--prefix", prefix)
        assert shown.exit_code == 0 and "microvm" in shown.stdout and "gvisor" not in shown.stdout, shown.output


async def test_a_class_asked_of_an_empty_fleet_says_no_worker_is_registered(nats_server, nats_url):
    """An empty fleet (a log, services, no worker): `--class` names no class, and says why."""
    prefix = "t" + __import__("uuid").uuid4().hex[:12]
    async with AsyncExitStack() as exits:
        await start_services(exits, list(SERVICES), nats_server.url, prefix, options={"scheduler": {"metrics": False}})
        for command in (("workers",), ("fragmentation",), ("whatif",)):
            shown = await cli(*command, "--class", "gvisor", "--nats", nats_url, "--prefix", prefix)
            assert shown.exit_code == 1, (command, shown.output)
            assert shown.stderr == ("error: NOT_FOUND sandbox_class (--class): no worker has registered the sandbox "
                                    "class 'gvisor' (no worker is registered)\n"), (command, shown.stderr)
        listed = await cli("workers", "--nats", nats_url, "--prefix", prefix)
        assert (listed.exit_code, listed.output) == (0, "no workers registered\n")

async def test_a_class_given_more_than_once_shows_each_of_them(operated, nats_url):
    """`workers --class gvisor --class microvm` showed the microvm rows alone: click kept the last
    value of an option given twice, without a word (a walkthrough). `--class` is repeatable in
    `workers` and `fragmentation`, the rows of any class given, in the text and -o json alike; one
    class is as before; a class no worker runs among them is the error a single one is."""
    prefix, _ = operated
    at = ("--nats", nats_url, "--prefix", prefix)
    for command in ("workers", "fragmentation"):
        every = json.loads((await cli(command, "-o", "json", *at)).stdout)
        both = await cli(command, "--class", "gvisor", "--class", "microvm", "-o", "json", *at)
        assert both.exit_code == 0, (command, both.output)
        assert json.loads(both.stdout) == every, command
        one = json.loads((await cli(command, "--class", "microvm", "-o", "json", *at)).stdout)
        rows = one if command == "workers" else one["classes"]
        assert rows and {r["sandbox_class"] for r in rows} == {"microvm"}, command
        text = await cli(command, "--class", "microvm", "--class", "gvisor", *at, width=200)
        assert text.exit_code == 0 and {"gvisor", "microvm"} <= set(text.stdout.split()), (command, text.output)
        typo = await cli(command, "--class", "gvisor", "--class", "nope", *at)
        assert typo.exit_code == 1 and typo.stdout == "", (command, typo.output)
        assert typo.stderr == ("error: NOT_FOUND sandbox_class (--class): no worker has registered the sandbox class "
                               "'nope' (registered: gvisor, microvm)\n"), (command, typo.stderr)
        shown = " ".join(CliRunner().invoke(main, [command, "--help"], terminal_width=200).output.split())
        assert "--class TEXT Only this sandbox class. Repeatable:" in shown, shown


async def test_a_class_no_worker_runs_is_the_same_error_with_continue(operated, nats_url):
    """`workers --class` judged a class against the first page's `unknown_classes` and `classes`, which the
    scheduler gives only on a page asked without `after`: with --continue, `--class nope` listed nothing,
    exit 0 (`no workers registered after W`), where without it is NOT_FOUND naming the classes run, exit 1;
    and a name that is no class's said that no worker is registered at all. The classes are judged as
    without --continue."""
    prefix, _ = operated
    at = ("--nats", nats_url, "--prefix", prefix)
    first = json.loads((await cli("workers", "-o", "json", *at)).stdout)[0]["worker_id"]
    for asked in ("nope", "Bad Class"):
        alone = await cli("workers", "--class", "gvisor", "--class", asked, *at)
        continued = await cli("workers", "--class", "gvisor", "--class", asked, "--continue", first, *at)
        assert alone.exit_code == continued.exit_code == 1, (asked, alone.output, continued.output)
        assert continued.stderr == alone.stderr and "(registered: gvisor, microvm)" in alone.stderr, \
            (asked, alone.stderr, continued.stderr)
    listed = await cli("workers", "--class", "gvisor", "--continue", first, "-o", "json", *at)
    assert listed.exit_code == 0 and all(r["worker_id"] > first for r in json.loads(listed.stdout)), listed.output


async def test_a_prefix_no_service_answers_is_named_as_the_likely_cause(operated, nats_url):
    """As a prefix whose log cannot be read is (`cli_common.last_seq`): a walkthrough's `fragmentation
    --prefix wrong` said only that no service answers a subject."""
    shown = await cli("fragmentation", "--nats", nats_url, "--prefix", "wrong")
    assert shown.exit_code == 1
    assert re.match(r"error: UNAVAILABLE: no service answers wrong\.scheduler\.fragmentation after 6 attempts in "
                    r"\d+\.\d s \(is --prefix wrong the deployment's\? logs here: --prefix ", shown.stderr), shown.stderr
    # a log on the server and nobody answering its requests: the service is not running, the prefix is right
    from tests.factories import ensure_stream

    idle = "t" + __import__("uuid").uuid4().hex[:12]
    await ensure_stream(nats_url, idle)
    stopped = await cli("explain", "a-1", "--nats", nats_url, "--prefix", idle)
    assert stopped.exit_code == 1
    assert re.fullmatch(f"error: UNAVAILABLE: no service answers {idle}\\.scheduler\\.explain\\.a-1 after 6 attempts "
                        rf"in \d+\.\d s \(the log of --prefix {idle} is on this server: does the scheduler run\?\)\n",
                        stopped.stderr), stopped.stderr


async def test_no_service_is_said_of_the_attempts_that_reached_none(nc, prefix):
    """"after N attempts" says no service answered any; when an earlier attempt was answered
    UNAVAILABLE (a replica stopping, say), the message says how many reached none (a review: the
    text claimed all of them from the last attempt's error alone)."""
    import msgspec

    from events.errors import ContractError
    from warmboot.client import Client

    subject = f"{prefix}.scheduler.fragmentation"
    replica = await nc.subscribe(subject)

    async def stopping() -> None:  # one answer, UNAVAILABLE, given once it is gone: the retries reach none
        msg = await replica.next_msg(timeout=10)
        await replica.unsubscribe()
        await nc.flush()
        await msg.respond(msgspec.json.encode({"error": {"code": "UNAVAILABLE", "message": "stopping"}}))

    answering = asyncio.create_task(stopping())
    client = Client(nc, prefix, attempts=3)
    with pytest.raises(ContractError) as refused:
        await client.fragmentation()
    await answering
    assert client.retries == 2
    assert re.fullmatch(f"no service answers {subject} at the last of 3 attempts \\(2 reached no service\\) in "
                        r"\d+\.\d s: the scheduler was reached before; it may be stopping or restarting",
                        refused.value.message), refused.value.message
    import click

    from warmboot.cli_common import Failed

    with click.Context(click.Command("fragmentation")) as context:  # as the CLI prints it: no prefix hint
        context.params["prefix"] = prefix
        assert Failed(refused.value, [prefix]).message == f"UNAVAILABLE: {refused.value.message}"
    with pytest.raises(ContractError) as none:
        await Client(nc, prefix, attempts=2).fragmentation()
    assert re.match(f"no service answers {subject} after 2 attempts in ", none.value.message), none.value.message


async def test_a_prefix_whose_log_this_server_does_not_hold_is_named_with_those_it_holds(operated, nats_url):
    """A command that reads the log, given a prefix whose stream the server says does not exist: one
    line as every refusal reads (`error: CODE field (option): ...`), naming the prefixes whose logs the
    server holds, not a question about credentials (a walkthrough: `workers --prefix wrongpfx` said
    `Error: cannot read the event stream WRONGPFX_EVENTS (nats: NotFoundError: code=404 ...): is --prefix
    wrongpfx the deployment's, and may these credentials read its log? ...`)."""
    prefix, _ = operated
    for command in (("workers",), ("actor", "list"), ("audit", "verify"), ("whatif", "--class", "gvisor")):
        shown = await cli(*command, "--nats", nats_url, "--prefix", "wrongpfx")
        assert shown.exit_code == 1, (command, shown.output)
        said = " ".join(shown.stderr.split())
        assert said.startswith("error: NOT_FOUND prefix (--prefix): no event stream WRONGPFX_EVENTS on this "
                               "server: is --prefix wrongpfx the deployment's? (logs here: --prefix "), (command, said)
        # the server holds every module's log of this session: this one's, or a note of more than are named
        assert prefix in said or " more)" in said, (command, said)
        assert "credentials" not in said and "NotFoundError" not in said, (command, said)
        assert shown.stdout == ""


async def test_explain_command_fits_and_shows_the_pin_by_its_label(operated, nats_url):
    prefix, nc = operated
    why = await call(nc, service_subject(prefix, "scheduler", "explain", "a-0001"), ExplainResume(), Explanation)
    for width in WIDTHS:
        shown = await cli("explain", "a-0001", "--nats", nats_url, "--prefix", prefix, width=width)
        assert shown.exit_code == 0, shown.output
        assert max(len(line) for line in shown.output.splitlines()) <= width
        pin = why.decision.sandbox_runtime
        label = runtimes_of(folded(fleet())).label(pin.sandbox_class, pin.version, pin.name)
        head = shown.output.strip().split("\n\n")[0]  # the fields, before the table of rejected workers
        fields = {line.split()[0]: line.split()[1:] for line in head.splitlines()}
        assert fields["RUNTIME"] == [label]
        assert fields["WORKER"] == [why.decision.worker_id]
    for flag in (["-o", "json"], ["--json"]):
        out = await cli("explain", "a-0001", *flag, "--nats", nats_url, "--prefix", prefix)
        assert json.loads(out.output)["decision"]["worker_id"] == why.decision.worker_id
    wide = await cli("explain", "a-0001", "-o", "wide", "--nats", nats_url, "--prefix", prefix, width=80)
    assert "ATTRIBUTES" in wide.output and "cpu_" in wide.output
    # the workers passed over, those that came furthest through the checks first (a worker of the
    # actor's class before one of another class), then by id; at most --limit of them, the rest counted
    assert len(why.rejected) >= 2
    furthest = [_how_far(r.reasons) for r in why.rejected]
    assert furthest == sorted(furthest, reverse=True) and furthest[0] > _how_far(["class not registered"])
    assert all(a.worker_id < b.worker_id for a, b, fa, fb in zip(why.rejected, why.rejected[1:], furthest,
                                                               furthest[1:]) if fa == fb)
    passed = [r.worker_id for r in why.rejected]
    alike = [r.worker_id for r in why.rejected if r.reasons == why.rejected[0].reasons]
    limited = await cli("explain", "a-0001", "--limit", "1", "--nats", nats_url, "--prefix", prefix, width=200)
    table = limited.output.strip().split("\n\n")[1].splitlines()  # one row: the first reasons' workers
    assert table[1].split()[0].rstrip(",") == passed[0]
    assert table[2] == f"({len(passed) - len(alike)} more worker(s) passed over for other reasons: --limit 0 lists them)"
    one = await cli("explain", "a-0001", "--limit", "1", "-o", "wide", "--nats", nats_url, "--prefix", prefix,
                    width=200)  # -o wide: a worker a row, --limit of them
    table = one.output.strip().split("\n\n")[1].splitlines()
    assert table[1].split()[0] == passed[0] and len(table) == 3
    assert table[2] == f"({len(passed) - 1} more worker(s) passed over: --limit 0 lists them)"
    every = await cli("explain", "a-0001", "--limit", "0", "-o", "wide", "--nats", nats_url, "--prefix", prefix,
                      width=200)  # a worker a row
    assert [line.split()[0] for line in every.output.strip().split("\n\n")[1].splitlines()[1:]] == passed


async def test_explain_of_a_refusal_says_each_thing_once(operated, nats_url, monkeypatch):
    """A review: REFUSED repeated the SUMMARY line, and workers passed over for the same reasons were
    listed a row each, up to 20 alike. Now REFUSED gives the code alone when its message is the
    summary, the workers passed over alike share a row naming a few, `selector mismatch` names the
    keys not matched (the actor's and --selector's, as the scheduler's answer names them: no worker's
    history is read, where it was 2.8 s of 3.3 at 10,000 workers), -o wide lists a worker a row, and
    -o json is the scheduler's answer as it is."""
    prefix, nc = operated
    read = log_reads(monkeypatch)
    await call(nc, service_subject(prefix, "snapshotter", "create", "sel-1"),
               CreateActor(actor_id="sel-1", sandbox_class="gvisor", template_uid="tpl-2026-01",
                           resources=Resources(cpu_millis=500, memory_mib=1024), selectors={"zone": "eu-1"}),
               SeqReply)
    seq = str(await last_seq(nc, prefix))
    args = ("explain", "sel-1", "--selector", "disk=ssd", "--min-seq", seq, "--nats", nats_url, "--prefix", prefix)
    why = await call(nc, service_subject(prefix, "scheduler", "explain", "sel-1"),
                     ExplainResume(selectors={"disk": "ssd"}, min_seq=int(seq)), Explanation)
    assert why.refusal is not None and why.refusal.message == why.message  # the case of the review
    shown = await cli(*args, width=80)
    assert shown.exit_code == 0, shown.output
    head, table = shown.stdout.strip().split("\n\n")
    assert " ".join(head.split()) == f"ACTOR sel-1 SUMMARY {why.message} REFUSED {why.refusal.code.value}", head
    gv = sorted(w.worker_id for w in fleet() if w.worker_id.startswith("w-gv"))
    mi = sorted(w.worker_id for w in fleet() if w.worker_id.startswith("w-mi"))
    assert table.splitlines() == [
        "WORKERS                                    REASONS",
        f"{', '.join(gv[:3])} (+{len(gv) - 3} more)  selector mismatch (disk, zone)",
        f"{', '.join(mi[:3])} (+{len(mi) - 3} more)  class not registered",  # --limit counts rows, not workers
        "(workers passed over for the same reasons share a row: -o wide lists each)",
    ], table
    first = await cli(*args, "--limit", "1", width=80)
    assert first.stdout.strip().split("\n\n")[1].splitlines()[1:] == [
        f"{', '.join(gv[:3])} (+{len(gv) - 3} more)  selector mismatch (disk, zone)",
        f"({len(mi)} more worker(s) passed over for other reasons: --limit 0 lists them)",
        "(workers passed over for the same reasons share a row: -o wide lists each)",
    ]
    wide = await cli(*args, "-o", "wide", "--limit", "0", width=80)
    rows = wide.stdout.strip().split("\n\n")[1].splitlines()
    assert rows[0].split() == ["WORKER", "REASONS"] and len(rows) == 1 + len(gv) + len(mi), rows
    assert f"{gv[0]}  selector mismatch (disk, zone)" in rows
    as_json = await cli(*args, "-o", "json")
    assert json.loads(as_json.stdout) == json.loads(json.dumps(to_builtins(why)))
    assert {tuple(r.missing_keys) for r in why.rejected if "selector mismatch" in r.reasons} == {("disk", "zone")}
    assert read == []


async def test_a_mismatch_of_one_selector_names_its_key_without_reading_the_fleet(operated, nats_url, monkeypatch):
    """The workers passed over for `selector mismatch` of an actor that selects by one key miss that
    key: said without folding every worker's history (2.8 s of `explain`'s 3.3 s at 10,000 workers,
    docs/scaling.md). Of several keys, the workers' labels are read (the test above)."""
    prefix, nc = operated
    await call(nc, service_subject(prefix, "snapshotter", "create", "sel-one"),
               CreateActor(actor_id="sel-one", sandbox_class="gvisor", template_uid="tpl-2026-01",
                           resources=Resources(cpu_millis=500, memory_mib=1024), selectors={"zone": "eu-1"}),
               SeqReply)
    read = log_reads(monkeypatch)
    seq = str(await last_seq(nc, prefix))
    gv = sorted(w.worker_id for w in fleet() if w.worker_id.startswith("w-gv"))
    for asked in ((), ("--selector", "zone=eu-1")):  # the actor's key, and the same asked again
        shown = await cli("explain", "sel-one", *asked, "--min-seq", seq, "--nats", nats_url, "--prefix", prefix,
                          width=80)
        assert shown.exit_code == 0 and shown.stderr == "", shown.output
        table = shown.stdout.strip().split("\n\n")[1].splitlines()
        assert table[1] == f"{', '.join(gv[:3])} (+{len(gv) - 3} more)  selector mismatch (zone)", table
    wide = await cli("explain", "sel-one", "-o", "wide", "--limit", "0", "--min-seq", seq, "--nats", nats_url,
                     "--prefix", prefix, width=80)
    assert [f"{w}  selector mismatch (zone)" in wide.stdout.splitlines() for w in gv] == [True] * len(gv)
    assert read == []


async def test_the_names_of_a_large_fleet_are_read_however_long_that_takes(monkeypatch):
    """Only the stream's first answer is bounded (a client's credentials get none); the fleet's read
    that follows is not: at 50,000 workers it takes seconds, and the names gave way to ids with a
    note that the log could not be read (found by a review)."""
    from warmboot import cmd_views

    async def stream_answers(nc, prefix, timeout=5.0):
        assert timeout == cmd_views.LABELS_TIMEOUT_S
        return 7

    async def slow_fleet(nc, prefix, target=None):
        assert target == 7
        read = asyncio.Event()  # the read takes a turn of the loop: past a bound of 0 s, had it one
        asyncio.get_running_loop().call_soon(read.set)
        await read.wait()
        return folded(fleet())

    async def nobody_says(nc, prefix, min_seq=None):  # no scheduler answers `runtimes`: the labels are the log's
        return None

    monkeypatch.setattr(cmd_views, "LABELS_TIMEOUT_S", 0)
    monkeypatch.setattr(cmd_views, "asked_runtimes", nobody_says)
    monkeypatch.setattr(cmd_views, "last_seq", stream_answers)
    monkeypatch.setattr(cmd_views, "fleet", slow_fleet)
    labels = await cmd_views.runtime_labels(None, "x")
    assert labels.complete and labels.known == runtimes_of(folded(fleet())).known


def test_json_gives_each_runtime_version_its_id_by_the_class_it_belongs_to():
    """`-o json` is the endpoint's answer with the `rt-` id beside every runtime version it names
    (what `whatif --drop-runtime` takes and each label's digits are): a version's class is its
    object's, its placement's pin's (for `matched_version`), or the one the command asked about."""
    v1, v2 = version("1"), version("2")
    pin = ActorRuntime(sandbox_class="gvisor", version=v2, name="runsc-2")
    placed = {"sandbox_runtime": to_builtins(pin), "matched_version": to_builtins(v1), "seq": 7}
    shown = with_runtime_ids({"decision": placed, "version": 3, "runtimes": [{"version": to_builtins(v1)}]},
                             "microvm")
    assert shown["decision"]["sandbox_runtime"]["runtime_id"] == short_id(compat_key("gvisor", v2))
    assert shown["decision"]["matched_runtime_id"] == short_id(compat_key("gvisor", v1))  # the pin's class
    assert shown["runtimes"][0]["runtime_id"] == short_id(compat_key("microvm", v1))  # the command's class
    assert "runtime_id" not in shown  # a `version` that is no runtime's is left alone
    assert with_runtime_ids({"runtimes": [{"version": to_builtins(v1)}]}) == {"runtimes": [{"version": to_builtins(v1)}]}
    kept = {"sandbox_class": "gvisor", "version": to_builtins(v1), "runtime_id": "rt-given"}
    assert with_runtime_ids(kept) == kept


async def test_the_logs_a_server_holds_are_read_past_the_first_page_of_its_streams(tmp_path):
    """The server lists its streams 256 at a time: a log past the first page was missed, and the
    suite's server (hundreds of streams) said "no warmboot log here" of its own logs (found by CI)."""
    import nats as nats_py

    from tests.factories import ensure_stream
    from warmboot.cli_common import prefixes_held
    from warmboot.natsserver import NatsServer

    with NatsServer(str(tmp_path)) as server:
        nc = await nats_py.connect(server.url)
        try:
            js = nc.jetstream()
            for i in range(300):  # listed before the log: names sort before its
                await js.add_stream(name=f"A{i:03d}", subjects=[f"other{i}.>"], storage="memory")
            await ensure_stream(server.url, "zlog")
            assert await prefixes_held(nc, timeout=10) == ["zlog"]
        finally:
            await nc.close()


def test_wide_names_the_runtime_id_column_alike_in_every_view():
    """`workers -o wide` and `explain -o wide` head the `rt-` id RUNTIME ID; `fragmentation -o wide`
    and `whatif -o wide` headed the same column ID (a walkthrough): one name for one thing."""
    from events.schema import WhatIf

    from services.scheduler.whatif import whatif as forecast
    from warmboot.cmd_whatif import render_whatif

    projection = folded(fleet())
    runtimes = runtimes_of(projection)
    workers = render_workers(worker_rows(projection), None, wide=True).text.splitlines()[0]
    assert "  RUNTIME ID  " in workers
    text = render_fragmentation(fragmentation(projection), runtimes, None, wide=True)
    header = text.split("\n\n", 1)[1].splitlines()[0]
    assert header.split()[-3:] == ["RUNTIME", "ID", "ATTRIBUTES"], header
    query = WhatIf(sandbox_class="gvisor", drop_runtimes=(), drain_workers=())
    shown = render_whatif(query, forecast(projection, query), runtimes, None, wide=True)
    header = next(line for line in shown.splitlines() if line.startswith("RUNTIME "))
    assert header.split()[-3:] == ["RUNTIME", "ID", "ATTRIBUTES"], header


async def test_wide_and_json_together_are_a_usage_error(operated, nats_url):
    """`-o wide --json` printed JSON, the wide asked for dropped without a word (a walkthrough):
    two outputs asked of one command are a usage error, exit status 2, in every view that takes
    both, whichever comes first; each alone is as before."""
    prefix, _ = operated
    views = (("workers",), ("fragmentation",), ("actor", "list"), ("actor", "show", "a-0001"),
             ("worker", "show", fleet()[0].worker_id), ("explain", "a-0001"), ("whatif", "--class", "gvisor"))
    for view in views:
        for both in (("-o", "wide", "--json"), ("--json", "-o", "wide")):
            shown = await cli(*view, *both, "--nats", nats_url, "--prefix", prefix)
            assert shown.exit_code == 2, (view, both, shown.output)
            assert shown.stdout == "", (view, both, shown.stdout)
            assert "error: -o wide and --json (the same as -o json) ask for two outputs: give one" in shown.stderr
        alone = [await cli(*view, *one, "--nats", nats_url, "--prefix", prefix) for one in (("-o", "wide"), ("--json",))]
        assert [r.exit_code for r in alone] == [0, 0], (view, [r.output for r in alone])
        json.loads(alone[1].stdout)


async def test_a_runtime_no_worker_runs_reads_alike_in_fragmentation_actor_list_and_whatif(stack, nc, prefix,
                                                                                            nats_url):
    """A release dropped (its worker registered again on the next) and a worker removed leave
    snapshots stamped with runtimes no worker runs: `fragmentation` showed them as `rt-c46e5a`, while
    `actor list` and `actor show` labelled the same stamps `gvisor-2026-10@c46e5a` (a trial). Every
    view labels them by the name their stamps carry, with their digits; whatif refuses to drop one,
    saying that no registered worker offers it (it read as a typo: "no runtime ... is named")."""
    from tests.factories import actor, runtime as offered, worker
    from warmboot.client import Client

    wb = Client(nc, prefix)
    old, new, kata = version("2026-10"), version("2026-11"), version("kata-1")
    await wb.register(worker("w-gv", offered(old, name="gvisor-2026-10")))
    await wb.register(worker("w-k", offered(kata, name="kata-1"), sandbox_class="kata"))
    for actor_id, sandbox_class in (("g-1", "gvisor"), ("k-1", "kata")):
        await wb.create(actor(actor_id, cpu=100, mem=256, sandbox_class=sandbox_class))
        await wb.resume(actor_id)
        await wb.suspend(actor_id, uri=f"s3://bucket/{actor_id}")
    await wb.register(worker("w-gv", offered(new, name="gvisor-2026-11")))  # the release dropped
    await wb.remove("w-k")  # the worker removed
    labels = {a: f"{name}@{short_id(compat_key(c, v))[3:]}"
              for a, c, v, name in (("g-1", "gvisor", old, "gvisor-2026-10"), ("k-1", "kata", kata, "kata-1"))}
    at = ("--min-seq", str(await last_seq(nc, prefix)), "--nats", nats_url, "--prefix", prefix)

    shown = await cli("fragmentation", *at, width=200)
    assert shown.exit_code == 0, shown.output
    rows = {line.split()[1]: line.split() for line in shown.output.split("\n\n", 1)[1].splitlines()[1:]}
    assert rows[labels["g-1"]][0] == "gvisor" and rows[labels["g-1"]][-1] == "1", shown.output  # SNAPSHOTS
    assert rows[labels["k-1"]][0] == "kata" and rows[labels["k-1"]][-1] == "1", shown.output
    assert rows["gvisor-2026-11"][2] == "1", shown.output  # a runtime a worker runs: by its name, as in `workers`
    listed = json.loads((await cli("actor", "list", "-o", "json", "--nats", nats_url, "--prefix", prefix)).output)
    assert {v["actor_id"]: v["snapshot"]["stamp"]["label"] for v in listed} == labels
    for actor_id, label in labels.items():
        view = json.loads((await cli("actor", "show", actor_id, "--json", "--nats", nats_url, "--prefix",
                                     prefix)).output)
        assert view["snapshot"]["stamp"]["label"] == label

    for named in (labels["g-1"], short_id(compat_key("gvisor", old))):
        refused = await cli("whatif", "--class", "gvisor", "--drop-runtime", named, *at)
        assert refused.exit_code == 2 and "'--drop-runtime'" in refused.output, refused.output
        assert (f"no runtime of class gvisor is named '{named}' among those its registered workers offer (as "
                "default, restorable or compatible version): a runtime none offers has nothing to drop (a release "
                "dropped already: its memory snapshots are stranded, `warmboot fragmentation` counts them; else a "
                "typing error); offered: gvisor-2026-11"
                ) in " ".join(refused.output.split()), refused.output


@pytest.mark.parametrize("width", range(40, 200, 3))
def test_no_column_is_shown_whole_while_a_more_important_one_gave_way(width):
    """The columns give way in the order of their `drop` ranks, and come back in the reverse order:
    never a less important one shown whole while a more important one is left out or narrowed. A
    trial's `COLUMNS=80 warmboot workers` left out NODE and CLASS and kept RESTORABLE's list, whose
    rank says it goes before CLASS: its rows read `w-1  gvisor-2026-11 ...`, with no class (the
    re-fit brought RESTORABLE back after CLASS could not come back)."""
    from warmboot.render import fit

    rows = worker_rows(folded(fleet()))
    shown, _ = fit(WORKER_COLUMNS, rows, width)
    whole = [c for c in WORKER_COLUMNS if c in shown]
    gave_way = [c for c in WORKER_COLUMNS if not c.wide and c not in shown]
    for kept in whole:
        for given in gave_way:
            assert kept.drop < given.drop or kept.drop == 0, (width, kept.header, given.header)


def test_an_explanation_naming_as_many_workers_as_the_scheduler_names_says_that_summary_counts_the_rest():
    """At 5,000 workers explain's rows read `w-1, w-2, w-3 (+997 more)  not on pinned node` under a SUMMARY
    of 1665 not on pinned node and 2500 of another class, in no row: the scheduler names
    EXPLAIN_REJECTED_LIMIT workers at most (a trial at fleet size). A last line says so; fewer, nothing."""
    from events.schema import Explanation, Rejection
    from services.scheduler.decide import EXPLAIN_REJECTED_LIMIT

    def explained(named: int) -> Explanation:
        return Explanation(candidates=0, counts={"not on pinned node": 1665, "class not registered": 2500},
                           rejected=[Rejection(worker_id=f"w-{i:04d}", reasons=["not on pinned node"])
                                     for i in range(named)],
                           message="0/4165 workers available: 2500 class not registered, 1665 not on pinned node")

    said = (f"(the scheduler names {EXPLAIN_REJECTED_LIMIT:,} of the workers passed over, those that came furthest "
            "through the checks; SUMMARY counts every one)")
    for wide in (False, True):
        text = render_explanation("a-1", explained(EXPLAIN_REJECTED_LIMIT), Runtimes(), 200, wide)
        assert text.endswith(said), text[-400:]
        assert said not in render_explanation("a-1", explained(10), Runtimes(), 200, wide)
