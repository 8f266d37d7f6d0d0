"""`warmboot whatif` against the real services: runtimes named as a person types them, the
forecast as the endpoint gives it, a table that fits a terminal, and errors naming the option."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner

from events.codec import to_builtins
from events.compat import compat_key
from events.runtime_id import short_id
from events.schema import CompatVersion, WhatIf, WorkerSandboxClass
from tests.factories import actor, last_seq, log_reads, runtime_ids_apart
from tests.test_views import WIDTHS, assert_fits_whole, fleet, folded, possible_cells, runtime
from warmboot.cli import main
from warmboot.client import Client
from warmboot.cmd_views import runtimes_of
from warmboot.cmd_whatif import COUNT_COLUMNS, forecast_columns, stranded_columns

GENERATIONS = (0, 1, 2)


def cli(*args: str, width: int | None = None):
    env = {"COLUMNS": str(width)} if width else {}
    return asyncio.to_thread(CliRunner().invoke, main, list(args), env=env)


@pytest.fixture
async def fleet_on_bus(stack, nc, prefix, nats_url):
    """test_views' fleet (one runtime name on three CPU generations) and gvisor actors suspended
    from memory, stamped with the default runtime (runsc-2024.11) of the worker they ran on."""
    wb = Client(nc, prefix)
    for registration in fleet():
        await wb.register(registration)
    for i in range(12):
        await wb.create(actor(f"a-{i:04d}", cpu=250, mem=256))
        await wb.resume(f"a-{i:04d}")
        await wb.suspend(f"a-{i:04d}", uri=f"s3://snapshots/a-{i:04d}")

    async def run(*args: str, width: int | None = None):
        return await cli("whatif", *args, "--nats", nats_url, "--prefix", prefix, width=width)

    return run, wb


def release(name: str) -> list:
    return [runtime("gvisor", g, name).version for g in GENERATIONS]


async def test_a_name_drops_every_runtime_that_carries_it_and_json_is_the_endpoints_answer(fleet_on_bus, nc, prefix):
    run, wb = fleet_on_bus
    before = await last_seq(nc, prefix)
    shown = await run("--class", "gvisor", "--drop-runtime", "runsc-2024.11", "--json")
    assert shown.exit_code == 0, shown.output
    expected = await wb.whatif(WhatIf(sandbox_class="gvisor", drop_runtimes=tuple(release("2024.11"))))
    answer, ids = runtime_ids_apart(json.loads(shown.output))
    assert answer == to_builtins(expected)  # the endpoint's answer, each version's id beside it
    assert ids and all(i == short_id(compat_key("gvisor", msgspec.convert(v, CompatVersion))) for v, i in ids)
    assert answer["before"]["stranded_snapshots"] == 0
    assert answer["after"]["stranded_snapshots"] == 12 == len(answer["newly_stranded"])  # every image was 2024.11
    assert await last_seq(nc, prefix) == before  # writes nothing


async def test_ids_and_labels_name_one_runtime(fleet_on_bus):
    run, wb = fleet_on_bus
    one = release("2024.11")[0]
    rt_id = short_id(compat_key("gvisor", one))
    by_id = json.loads((await run("--class", "gvisor", "--drop-runtime", rt_id, "-o", "json")).output)
    by_label = json.loads((await run("--class", "gvisor", "--drop-runtime", f"runsc-2024.11@{rt_id[3:]}",
                                     "--json")).output)
    assert by_id == by_label
    assert runtime_ids_apart(by_id)[0] == to_builtins(await wb.whatif(WhatIf(sandbox_class="gvisor",
                                                                               drop_runtimes=(one,))))
    dropped = [r for r in by_id["runtimes"] if r["workers_after"] == 0 and r["workers_before"] > 0]
    assert [(r["version"], r["runtime_id"]) for r in dropped] == [(to_builtins(one), rt_id)]  # the id it was given
    assert {a["stamp"]["runtime_id"] for a in by_id["newly_stranded"]} == {rt_id}


@pytest.mark.parametrize("width", WIDTHS)
async def test_the_table_fits_without_a_cut_cell(fleet_on_bus, width):
    run, wb = fleet_on_bus
    shown = await run("--class", "gvisor", "--drop-runtime", "runsc-2024.11", "--drain", "w-gv-0000", width=width)
    assert shown.exit_code == 0, shown.output
    query = WhatIf(sandbox_class="gvisor", drop_runtimes=tuple(release("2024.11")), drain_workers=("w-gv-0000",))
    answer = await wb.whatif(query)
    runtimes = runtimes_of(folded(fleet()))
    dropped = {compat_key("gvisor", v) for v in query.drop_runtimes}
    allowed = (possible_cells(COUNT_COLUMNS, [("before", answer.before), ("after", answer.after)])
               | possible_cells(forecast_columns("gvisor", runtimes, dropped), answer.runtimes)
               | possible_cells(stranded_columns(runtimes), answer.newly_stranded)
               | {"CLASS", "DROP", "DRAIN", "gvisor", "w-gv-0000"}
               | {w.rstrip(",") for v in query.drop_runtimes for w in [runtimes.label("gvisor", v)]})
    assert_fits_whole(shown.output, width, allowed | {w + "," for w in allowed})
    lines = shown.output.splitlines()
    after = next(line for line in lines if line.startswith("after "))
    assert after.split()[1:] == [str(answer.after.stranded_snapshots), str(answer.after.memory_restorable_snapshots)]
    assert sum(1 for line in lines if line.startswith("a-0")) == len(answer.newly_stranded) == 12
    wide = await run("--class", "gvisor", "--drop-runtime", "runsc-2024.11", "-o", "wide", width=width)
    assert "ATTRIBUTES" in wide.output and "cpu_features=" in wide.output


async def test_a_stranded_local_image_says_its_node_and_limit_0_lists_all(fleet_on_bus, nc, prefix):
    """Draining the workers of a node strands the PAUSED actors whose LOCAL images are there, though
    their runtime stays elsewhere: the list says where each image is (it listed only the stamp, and a
    user could not tell why: found by a walkthrough). `--limit 0` lists them all, as explain's does
    (it listed none)."""
    run, wb = fleet_on_bus
    await wb.create(actor("p-0001", cpu=250, mem=256))
    placed = await wb.resume("p-0001")
    await wb.pause("p-0001")
    on_node = [w.worker_id for w in fleet() if w.node == placed.node]
    drains = [arg for w in on_node for arg in ("--drain", w)]
    shown = await run("--class", "gvisor", *drains, width=200)
    assert shown.exit_code == 0, shown.output
    row = next(line for line in shown.output.splitlines() if line.startswith("p-0001"))
    assert row.split()[-3:] == ["LOCAL", "on", placed.node], shown.output
    listed = json.loads((await run("--class", "gvisor", *drains, "--json")).output)["newly_stranded"]
    assert [(s["actor_id"], s["location"], s["node"]) for s in listed] == [("p-0001", "LOCAL", placed.node)]
    dropped = json.loads((await run("--class", "gvisor", "--drop-runtime", "runsc-2024.11", "--json")).output)
    suspended = {(s["location"], s["node"]) for s in dropped["newly_stranded"] if s["actor_id"].startswith("a-")}
    assert suspended == {("EXTERNAL", None)}  # suspended: their images on no node
    every = await run("--class", "gvisor", "--drop-runtime", "runsc-2024.11", "--limit", "0", width=200)
    some = await run("--class", "gvisor", "--drop-runtime", "runsc-2024.11", "--limit", "2", width=200)
    counted = [sum(1 for line in r.output.splitlines() if line.startswith(("a-0", "p-0"))) for r in (every, some)]
    assert counted == [len(dropped["newly_stranded"]), 2] and counted[0] >= 12, (every.output, some.output)


async def test_unknown_runtimes_and_workers_are_errors_naming_the_option(fleet_on_bus, nc, prefix):
    run, _ = fleet_on_bus
    before = await last_seq(nc, prefix)
    unknown = await run("--class", "gvisor", "--drop-runtime", "runsc-1999")
    assert unknown.exit_code == 2
    assert "'--drop-runtime'" in unknown.output and "no runtime of class gvisor is named 'runsc-1999'" in unknown.output
    other_class = await run("--class", "microvm", "--drop-runtime", "runsc-2024.11")
    assert other_class.exit_code == 2 and "no runtime of class microvm" in other_class.output
    bad_id = await run("--class", "gvisor", "--drop-runtime", "rt-000000")
    assert bad_id.exit_code == 2 and "'--drop-runtime'" in bad_id.output
    typo = await run("--class", "gvisor", "--drain", "w-gv-9999")
    assert typo.exit_code == 2 and "'--drain'" in typo.output and "w-gv-9999" in typo.output
    pattern = await run("--class", "gvisor", "--drain", "w.*")  # not an id: said so, not "not registered"
    assert pattern.exit_code == 2 and "'w.*' is not an id: 1 to 128" in pattern.output, pattern.output
    no_class = await run("--class", "nope")
    assert no_class.exit_code == 1 and no_class.stderr.startswith("error: NOT_FOUND sandbox_class (--class): ")
    assert "(registered: gvisor, microvm)" in no_class.stderr
    # a class typo is said as such, whatever else is named: not that the worker or runtime is unknown
    for named in (("--drain", "w-gv-0000"), ("--drop-runtime", "runsc-2024.11")):
        typo_class = await run("--class", "gvsor", *named)
        assert typo_class.exit_code == 1 and typo_class.stderr.startswith(
            "error: NOT_FOUND sandbox_class (--class): no worker has registered the sandbox class 'gvsor'"), named
    other = await run("--class", "microvm", "--drain", "w-gv-0000")  # registered, but for another class
    assert other.exit_code == 2 and "worker 'w-gv-0000' is registered for gvisor, not for class microvm" in other.output
    assert await last_seq(nc, prefix) == before


async def test_a_forecast_that_changes_nothing_says_why(fleet_on_bus, nc, prefix):
    """A no-op says so: a `--drain` of a worker drained already, or nothing dropped or drained, gives
    a forecast whose before and after are the same; stderr says why (a walkthrough's `--drain` of a
    retired worker read as if draining it stranded nothing), and `-o json` stays the answer alone."""
    run, wb = fleet_on_bus
    drained = "w-gv-0000"
    await wb.drain(drained)
    again = await run("--class", "gvisor", "--drain", drained, "--drain", "w-gv-0002")
    assert again.exit_code == 0, again.output
    assert again.stderr == f"note: {drained} is drained already: the forecast counts it out before and after\n"
    nothing = await run("--class", "gvisor", "--json")
    assert nothing.exit_code == 0 and json.loads(nothing.stdout)["before"] == json.loads(nothing.stdout)["after"]
    assert nothing.stderr == ("note: nothing is dropped or drained (--drop-runtime, --drain): before and after "
                              "are the fleet as it is\n")
    asked = await run("--class", "gvisor", "--drain", "w-gv-0002")
    assert asked.exit_code == 0 and asked.stderr == ""


def test_help_says_how_to_name_a_runtime():
    shown = CliRunner().invoke(main, ["whatif", "--help"])
    assert shown.exit_code == 0
    text = " ".join(shown.output.split())
    assert "--drop-runtime" in text and "--drain" in text and "rt-3f9a1c" in text and "writes nothing" in text


def test_what_the_forecast_supposes_reads_in_the_order_of_its_tables():
    """DROP in the order of the runtime table (by label), DRAIN by id and once each (a walkthrough)."""
    from services.scheduler.whatif import whatif
    from warmboot.cmd_whatif import render_whatif

    projection = folded(fleet())
    runtimes = runtimes_of(projection)
    drops = (runtime("gvisor", 2, "2024.11").version, runtime("gvisor", 0, "2024.05").version)
    query = WhatIf(sandbox_class="gvisor", drop_runtimes=drops, drain_workers=("w-gv-0004", "w-gv-0000", "w-gv-0004"))
    text = render_whatif(query, whatif(projection, query), runtimes, 200)
    fields = {line.split()[0]: line.split(None, 1)[1] for line in text.splitlines()[:3]}
    labels = [runtimes.label("gvisor", v) for v in drops]
    assert fields["DROP"].split(", ") == sorted(labels) and fields["DRAIN"] == "w-gv-0000, w-gv-0004"


async def test_a_forecast_that_strands_nothing_says_so(fleet_on_bus):
    """A step that strands no actor printed no NEWLY STRANDED table and nothing in its place (a
    walkthrough): the answer an upgrade step waits for ("go on when the forecast says 0",
    docs/operations.md) was left to the absence of a table. It is said; `-o json` is unchanged."""
    run, _ = fleet_on_bus
    shown = await run("--class", "gvisor", "--drop-runtime", "runsc-2024.05", width=200)
    assert shown.exit_code == 0, shown.output
    listed = json.loads((await run("--class", "gvisor", "--drop-runtime", "runsc-2024.05", "--json")).output)
    assert listed["newly_stranded"] == [] and listed["after"]["stranded_snapshots"] == 0, listed
    assert shown.stdout.rstrip("\n").endswith("\n\nno actor newly stranded"), shown.stdout
    stranding = await run("--class", "gvisor", "--drop-runtime", "runsc-2024.11", width=200)
    assert "no actor newly stranded" not in stranding.output and "NEWLY STRANDED" in stranding.output


async def test_the_question_is_resolved_against_the_scheduler_s_runtimes_not_every_worker_s_history(
        fleet_on_bus, nc, prefix, monkeypatch):
    """`whatif` folded every worker's history to resolve --drop-runtime and --class (3 s of its 3.5 s at
    10,000 workers, docs/scaling.md): a scheduler's `runtimes` answer says the same, and only the
    workers named by --drain are read from the log, for the checks and notes said of them."""
    run, wb = fleet_on_bus
    read = log_reads(monkeypatch)
    drained = "w-gv-0000"
    await wb.drain(drained)
    shown = await run("--class", "gvisor", "--drop-runtime", "runsc-2024.11", "--drain", drained, "--drain",
                      "w-gv-0002", "--json")
    assert shown.exit_code == 0, shown.output
    expected = await wb.whatif(WhatIf(sandbox_class="gvisor", drop_runtimes=tuple(release("2024.11")),
                                      drain_workers=(drained, "w-gv-0002")))
    assert runtime_ids_apart(json.loads(shown.stdout))[0] == to_builtins(expected)
    assert shown.stderr == f"note: {drained} is drained already: the forecast counts it out before and after\n"
    assert read == [f"{prefix}.ev.worker.{drained}", f"{prefix}.ev.worker.w-gv-0002"]
    read.clear()
    assert (await run("--class", "gvisor", "--drop-runtime", "runsc-2024.11")).exit_code == 0
    typo = await run("--class", "gvsor", "--drop-runtime", "runsc-2024.11")
    assert typo.exit_code == 1 and "(registered: gvisor, microvm)" in typo.stderr
    assert read == []


async def test_a_runtime_no_worker_runs_any_more_is_labelled_as_fragmentation_labels_it(fleet_on_bus, nats_url,
                                                                                        prefix):
    """Once every worker dropped runsc-2024.11, the suspended actors' images stamped with it are stranded,
    and the forecast's rows of those runtimes (no worker accepts them) said `rt-3f9a1c` where
    fragmentation and `actor list` say `runsc-2024.11@3f9a1c`, the name their stamps carry (a trial of a
    rolling upgrade). Both views now say the same labels."""
    run, wb = fleet_on_bus
    for i, w in enumerate(fleet()):
        if w.sandbox_classes[0].sandbox_class == "gvisor":  # 2024.11 dropped: 2025.01 the default
            entry = WorkerSandboxClass(sandbox_class="gvisor",
                                       default_runtime=runtime("gvisor", (0, 0, 1, 2)[(i // 2) % 4], "2025.01"))
            await wb.register(msgspec.structs.replace(w, sandbox_classes=(entry,)))
    some = next(w.worker_id for w in fleet() if w.sandbox_classes[0].sandbox_class == "gvisor")
    shown = await run("--class", "gvisor", "--drain", some, width=250)
    assert shown.exit_code == 0, shown.output
    frag = await cli("fragmentation", "--class", "gvisor", "--nats", nats_url, "--prefix", prefix, width=250)
    assert frag.exit_code == 0, frag.output

    def dropped_labels(output: str) -> set[str]:
        return {word for line in output.splitlines() for word in line.split() if "2024.11" in word}

    labels = dropped_labels(shown.output)
    assert labels and all(label.startswith("runsc-2024.11@") for label in labels), shown.output
    assert labels == dropped_labels(frag.output), (shown.output, frag.output)


# --- at fleet size ------------------------------------------------------------------------------------


def stranding(stranded: int, carried: int) -> tuple[Any, list[int]]:
    """A scheduler's whatif of `stranded` newly stranded actors, each listed up to the query's `limit`, refused
    as the service refuses an answer past `carried` (its `fitting`, with the endpoint's words); and the limits
    it was asked with."""
    from types import SimpleNamespace

    from events.codec import encode
    from events.schema import Location, SnapshotCounts, StrandedActor, WhatIfAnswer
    from services.endpoints import fitting
    from services.scheduler.service import TOO_LARGE
    from tests.factories import stamp, version

    request = SimpleNamespace(_msg=SimpleNamespace(_client=SimpleNamespace(max_payload=carried)))
    asked: list[int] = []

    class Scheduler:
        @staticmethod
        def answer(limit: int) -> WhatIfAnswer:
            return WhatIfAnswer(
                before=SnapshotCounts(stranded_snapshots=0, memory_restorable_snapshots=stranded),
                after=SnapshotCounts(stranded_snapshots=stranded, memory_restorable_snapshots=0), runtimes=[],
                newly_stranded=[StrandedActor(actor_id=f"a-{i:05d}", stamp=stamp(version("b1"), name="runsc-v1"),
                                              location=Location.LOCAL, node=f"node-{i:05d}")
                                for i in range(min(limit, stranded))])

        async def whatif(self, query: WhatIf) -> WhatIfAnswer:
            asked.append(query.limit)
            reply = self.answer(query.limit)
            fitting(request, encode(reply),  # the service's own check, and its words
                    TOO_LARGE["whatif" if query.limit > 1 else "whatif listing at most one actor"])
            return reply

    return Scheduler(), asked


async def test_a_forecast_larger_than_one_answer_carries_lists_as_many_as_fit_and_says_so():
    """`whatif --limit 0` ("all, up to 10,000") of a thousand drained workers was a 3.1 MB answer, past the
    server's max_payload: the scheduler refused it RESOURCE_EXHAUSTED and the command printed that error
    alone, no forecast. It asks again for as many actors as fit (`fitting_whatif`), the counts unchanged,
    and the note says why fewer are listed; any other refusal is raised as it was."""
    from events.codec import encode
    from events.errors import ContractError, exhausted
    from warmboot.cmd_whatif import fitting_whatif, render_whatif

    stranded, carried = 3000, 100_000
    scheduler, asked = stranding(stranded, carried)
    query = WhatIf(sandbox_class="gvisor", drain_workers=("w-1",), limit=10_000)
    got, answered = await fitting_whatif(scheduler, query)
    assert len(encode(got)) <= carried and carried // 2 < len(encode(got)), asked
    assert answered.limit == asked[-1] < 10_000 and len(asked) <= 3 and len(got.newly_stranded) == answered.limit
    text = render_whatif(answered, got, runtimes_of(folded(fleet())), 200, carried=True)
    assert text.endswith(f"({stranded} snapshots newly stranded, {answered.limit} actors listed: as many as one "
                         "answer of this NATS server carries (its max_payload))"), text[-300:]

    class Refusing:
        async def whatif(self, query: WhatIf) -> None:
            raise exhausted("busy")

    with pytest.raises(ContractError, match="busy"):
        await fitting_whatif(Refusing(), query)


async def test_a_forecast_asked_for_more_actors_than_there_are_lists_as_many_as_fit_not_one():
    """`whatif --limit 0` (10,000) of a thousand stranded actors, a 244 KB answer past a 100 KB server: the
    first ask for fewer (3,685) lists the same thousand, an answer no smaller. Taken for one that no limit
    narrows (its rows per runtime), the command asked for one actor and printed that, where 400 fit. It asks
    for one actor only to learn whether no limit narrows it (answered: it does), then for fewer as before."""
    from events.codec import encode
    from warmboot.cmd_whatif import fitting_whatif

    stranded, carried = 1000, 100_000
    scheduler, asked = stranding(stranded, carried)
    assert len(encode(scheduler.answer(stranded))) > 2 * carried
    got, answered = await fitting_whatif(scheduler, WhatIf(sandbox_class="gvisor", drain_workers=("w-1",),
                                                             limit=10_000))
    assert carried // 2 < len(encode(got)) <= carried, asked
    assert len(got.newly_stranded) == answered.limit > 1, asked


def test_a_thousand_workers_drained_are_named_a_few_and_counted():
    """DRAIN listed every worker a forecast drains: 18 KB of one field for a thousand (a trial at fleet
    size). It names ten and counts the rest; -o wide names all."""
    from services.scheduler.whatif import whatif
    from warmboot.cmd_whatif import render_whatif

    workers = fleet(40)
    projection = folded(workers)
    drained = tuple(w.worker_id for w in workers if w.worker_id.startswith("w-gv"))
    query = WhatIf(sandbox_class="gvisor", drain_workers=drained)
    runtimes = runtimes_of(projection)
    fields = render_whatif(query, whatif(projection, query), runtimes, 200).splitlines()[2]
    assert fields == f"DRAIN  {', '.join(sorted(drained)[:10])} (+{len(drained) - 10} more)", fields
    wide = render_whatif(query, whatif(projection, query), runtimes, 200, wide=True).splitlines()[2]
    assert wide == f"DRAIN  {', '.join(sorted(drained))}"


def test_many_workers_drained_already_are_named_a_few_and_counted():
    """The note on the workers asked to drain that are drained already named every one: 654 ids on one
    line of stderr for a generation of 2,320 (a trial at fleet size). It names ten and counts the rest."""
    from types import SimpleNamespace

    from events.states import WorkerState
    from warmboot.cmd_whatif import no_op_notes

    ids = [f"w-{i:04d}" for i in range(30)]
    projection = SimpleNamespace(workers={w: SimpleNamespace(state=WorkerState.DRAINED if i % 2 else
                                                             WorkerState.REGISTERED) for i, w in enumerate(ids)})
    drained = sorted(w for i, w in enumerate(ids) if i % 2)
    assert no_op_notes(projection, (), tuple(ids)) == [
        f"{', '.join(drained[:10])} (+5 more) are drained already: the forecast counts them out before and after"]
    assert no_op_notes(projection, (), ("w-0001",)) == [
        "w-0001 is drained already: the forecast counts it out before and after"]
