"""Operating warmboot: `up` with the demo, audit by replay, and the operator views."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from contextlib import AsyncExitStack
from datetime import datetime, timezone
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from rich.console import Console

from events.codec import encode, to_builtins
from events.compat import compat_key
from events.jetstream import TOPIC_HEADER, VERSION_HEADER
from events.runtime_id import short_id
from events.schema import (
    Action,
    ActorPlaced,
    ActorRuntime,
    CompatVersion,
    Explanation,
    ExplainResume,
    Fragmentation,
    FragmentationQuery,
    PlacedFidelity,
    Resources,
)
from events.subjects import event_subject, service_subject
from services.endpoints import call
from services.scheduler.records import PAUSED
from tests.factories import SILENT_TTL_S, runtime_ids_apart
from warmboot.audit import summary
from warmboot.cli import main
from warmboot.demo import DemoConfig, run_demo
from warmboot.runner import SERVICES, start_services

SMALL = DemoConfig(workers=12, actors=40)


def table_rows(text: str) -> dict[str, str]:
    """The demo summary table as {what: value}."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃]", line) if c.strip()]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    return rows


def check_demo_summary(rows: dict[str, str]) -> None:
    assert int(rows["placements RESTORE MEMORY"]) > 0
    assert int(rows["placements RUN NONE"]) > 0
    assert int(rows["fallbacks NO_COMPATIBLE_WORKER"]) > 0
    assert int(rows["stranded snapshots during upgrade (v1 restorable)"]) == 0
    assert int(rows["stranded snapshots after v1 dropped"]) > 0
    # whatif asked before the drop forecast what fragmentation counted after it
    assert rows["stranded snapshots after v1 dropped, forecast by whatif"] == rows["stranded snapshots after v1 dropped"]
    assert rows["whatif forecast agrees with the drop"] == "yes"
    assert int(rows["stranded snapshots after the actors moved"]) == 0
    # the newest CPU generation restored the retired oldest one's images through its compatible version
    assert int(rows["restores through a compatible version"]) > 0


def test_up_runs_the_demo_and_twice_in_a_row(tmp_path):
    store = tmp_path / "store"
    args = [str(Path(sys.executable).parent / "warmboot"), "up", "--demo", "--exit-after-demo", "--port", "0",
            "--metrics-port", "0", "--store", str(store), "--workers", str(SMALL.workers),
            "--actors", str(SMALL.actors)]
    first = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert first.returncode == 0, first.stderr[-2000:]
    assert "new store" in first.stdout and "NATS     nats://127.0.0.1:" in first.stdout
    assert "what-if before dropping v1" in first.stdout and "MEMORY RESTORABLE" in first.stdout  # the forecast
    check_demo_summary(table_rows(first.stdout))
    # to a file, with no $COLUMNS: every column of the forecast (it was cut to rich's 80: found by a walkthrough)
    second = subprocess.run(args, capture_output=True, text=True, timeout=300,
                            env={k: v for k, v in os.environ.items() if k != "COLUMNS"})
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resetting the store" in second.stdout
    assert "MEMORY RESTORABLE" in second.stdout and "(to fit" not in second.stdout, second.stdout[-3000:]
    check_demo_summary(table_rows(second.stdout))


def test_the_demos_closing_hint_names_its_prefix():
    """The command the demo suggests shows its fleet: with `up --prefix x` it names the prefix (it
    did not, and the views said there was no stream WARMBOOT_EVENTS; found by a review)."""
    from warmboot.demo import views_command

    assert views_command("nats://127.0.0.1:4222", "warmboot") == "warmboot workers --nats nats://127.0.0.1:4222"
    assert views_command("nats://u:pw@h:1", "revcli") == "warmboot workers --nats nats://h:1 --prefix revcli"


async def test_up_keeps_the_demo_fleet_heartbeating_while_it_serves(tmp_path):
    """After the demo's summary `up` serves on, and the demo's workers stay registered: a put in
    the heartbeat bucket after "serving" (not an expiry marker), the views list every worker,
    and Ctrl-C stops it cleanly."""
    import nats
    from nats.js.api import DeliverPolicy

    from events.subjects import DEFAULT_PREFIX, bucket_name
    from tests.secured_helpers import WARMBOOT, Child

    up = Child([WARMBOOT, "up", "--demo", "--port", "0", "--metrics-port", "0", "--store", str(tmp_path / "store"),
                "--workers", str(SMALL.workers), "--actors", str(SMALL.actors)],
               re.compile(r"^serving; Ctrl-C stops"), env={"COLUMNS": "200"})
    up.start(timeout=300)
    try:
        url = up.line("NATS     ").split()[1]
        assert "workers keep heartbeating: try warmboot workers --nats " + url in up.output
        nc = await nats.connect(url)
        try:
            bucket = bucket_name(DEFAULT_PREFIX, "heartbeats")
            beats = await nc.jetstream().subscribe(f"$KV.{bucket}.>", ordered_consumer=True,
                                                   deliver_policy=DeliverPolicy.NEW)
            while True:  # the first heartbeat stored after the demo ended
                msg = await beats.next_msg(timeout=60)
                if not (msg.headers or {}).get("Nats-Marker-Reason") and not (msg.headers or {}).get("KV-Operation"):
                    break
            await beats.unsubscribe()
        finally:
            await nc.close()
        listed = await cli("workers", "--nats", url, "--json")
        assert listed.exit_code == 0, listed.output
        assert len({row["worker_id"] for row in json.loads(listed.output)}) == SMALL.workers
    finally:
        code = up.signal(signal.SIGINT)
    assert code == 0, up.output[-2000:]
    assert up.lines[-1] == "stopping" or "stopping" in up.lines[-3:], up.output[-2000:]


@pytest.fixture(scope="module")
async def demo(nats_server):
    """The demo, in-process, on its own prefix; the services keep running for the checks."""
    prefix = "t" + uuid.uuid4().hex[:12]
    async with AsyncExitStack() as exits:
        running = await start_services(exits, list(SERVICES), nats_server.url, prefix,  # the demo's fleet stops
                                       options={"scheduler": {"metrics": False},   # beating when it ends
                                                "registry": {"ttl_s": SILENT_TTL_S}})
        tally = await run_demo(nats_server.url, prefix, SMALL, Console(file=open("/dev/null", "w")))
        yield running, prefix, tally


def cli(*args: str):
    return asyncio.to_thread(CliRunner().invoke, main, list(args))


async def test_audit_verify_passes_on_the_demo_log(demo, nats_url):
    _, prefix, _ = demo
    result = await cli("audit", "verify", "--nats", nats_url, "--prefix", prefix)
    assert result.exit_code == 0, result.output
    assert "no violation" in result.output


async def test_replay_until_a_sequence_gives_what_the_scheduler_had_then(demo, nats_url, nc):
    running, prefix, _ = demo
    scheduler = running.services[list(SERVICES).index("scheduler")]
    then = summary(scheduler.projection)  # the scheduler's projection and its sequence, at one instant
    # The log moves on: a worker leaves.
    await nc.request(service_subject(prefix, "registry", "remove", "w-gv0-000"), b"{}", timeout=10)
    result = await cli("audit", "replay", "--until", str(then["seq"]), "--json", "--nats", nats_url,
                       "--prefix", prefix)
    assert result.exit_code == 0, result.output
    replayed = json.loads(result.output)
    assert replayed == then
    now = await cli("audit", "replay", "--json", "--nats", nats_url, "--prefix", prefix)
    assert json.loads(now.output)["seq"] > then["seq"]


async def test_replay_reads_the_log_only_as_far_as_its_bound(demo, nats_url, nc, monkeypatch):
    """`audit replay --until SEQ` (or `--until-time`) read the whole log and folded only its start: on
    a log of millions of events, minutes for a look at its first hundred (a review). It now stops
    reading at the first page past its bound."""
    from events.codec import decode_event
    from events.jetstream import link, stream
    from events.subjects import stream_name

    _, prefix, _ = demo
    READ_PAGE = 50  # pages of 50 messages: the demo's log is several of them
    monkeypatch.setattr(stream, "READ_PAGE", READ_PAGE)
    last = (await nc.jetstream().stream_info(stream_name(prefix))).state.last_seq
    assert last > 4 * READ_PAGE, last
    pages: list[int] = []
    real = link.direct_batch

    async def counted(nc_, stream, request, *args):
        pages.append(request["seq"])
        return await real(nc_, stream, request, *args)

    monkeypatch.setattr(link, "direct_batch", counted)
    early = await cli("audit", "replay", "--until", "3", "--json", "--nats", nats_url, "--prefix", prefix)
    assert early.exit_code == 0 and json.loads(early.stdout)["seq"] == 3, early.output
    assert pages == [1], pages  # one page, not the whole log
    pages.clear()
    when = to_builtins(decode_event((await nc.jetstream().get_msg(stream_name(prefix), seq=1)).data).at)
    result = await cli("audit", "replay", "--until-time", when, "--json", "--nats", nats_url, "--prefix", prefix)
    assert result.exit_code == 0 and json.loads(result.stdout)["events"] >= 1, result.output
    assert len(pages) < last // READ_PAGE, pages  # stopped once past the time, not at the log's end
    pages.clear()
    whole = await cli("audit", "replay", "--json", "--nats", nats_url, "--prefix", prefix)
    assert json.loads(whole.stdout)["seq"] >= last and len(pages) >= last // READ_PAGE, pages


async def test_replay_until_a_time_stops_there(demo, nats_url, nc):
    """A time before the log's first event folds nothing, and says why on stderr, with that event's
    time (it said only "folded 0 events": a review); exit status 0, JSON the summary alone."""
    _, prefix, _ = demo
    result = await cli("audit", "replay", "--until-time", "2000-01-01T00:00:00", "--json", "--nats", nats_url,
                       "--prefix", prefix)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["events"] == 0
    from events.codec import decode_event
    from events.subjects import stream_name

    first = decode_event((await nc.jetstream().get_msg(stream_name(prefix), seq=1)).data)
    note = (f"note: --until-time 2000-01-01T00:00:00Z is before the log's first event (sequence 1, at "
            f"{to_builtins(first.at)}): nothing folded\n")
    assert result.stderr == note, result.stderr
    shown = await cli("audit", "replay", "--until-time", "2000-01-01", "--nats", nats_url, "--prefix", prefix)
    assert shown.exit_code == 0 and shown.stderr == note, shown.output
    assert shown.stdout.startswith("folded 0 events up to sequence 0\n"), shown.stdout
    # a time after it: no note
    later = await cli("audit", "replay", "--until-time", to_builtins(first.at), "--json", "--nats", nats_url,
                      "--prefix", prefix)
    assert later.exit_code == 0 and later.stderr == "" and json.loads(later.stdout)["events"] >= 1, later.output
    # ISO 8601 as people write it: a Z, an offset, a bare date; anything else named
    for when in ("2000-01-01T00:00:00Z", "2000-01-01T01:00:00+01:00", "2000-01-01"):
        result = await cli("audit", "replay", "--until-time", when, "--json", "--nats", nats_url, "--prefix", prefix)
        assert result.exit_code == 0 and json.loads(result.stdout)["events"] == 0, (when, result.output)
    result = await cli("audit", "replay", "--until-time", "yesterday", "--nats", nats_url, "--prefix", prefix)
    assert result.exit_code == 2 and "'yesterday' is not an ISO 8601 time" in result.output
    # a sequence past the end folds it all, and says where it ended (it said nothing: a trial)
    end = (await nc.jetstream().stream_info(stream_name(prefix))).state.last_seq
    past = await cli("audit", "replay", "--until", str(end + 1000), "--json", "--nats", nats_url, "--prefix", prefix)
    assert past.exit_code == 0 and json.loads(past.stdout)["seq"] == end, past.output
    assert past.stderr == f"note: --until {end + 1000} is past the log's end (sequence {end}): folded to its end\n"
    at_end = await cli("audit", "replay", "--until", str(end), "--json", "--nats", nats_url, "--prefix", prefix)
    assert at_end.exit_code == 0 and at_end.stderr == "", at_end.output
    # so does a time past the last event (it said nothing: a trial)
    beyond = await cli("audit", "replay", "--until-time", "2100-01-01", "--json", "--nats", nats_url, "--prefix", prefix)
    assert beyond.exit_code == 0 and json.loads(beyond.stdout)["seq"] == end, beyond.output
    assert beyond.stderr.startswith(f"note: --until-time 2100-01-01T00:00:00Z is past the log's last event (sequence "
                                    f"{end}, its last event at ") and \
        beyond.stderr.endswith("): folded to its end\n"), beyond.stderr


async def test_actor_timeline_shows_stamps_pins_and_fallbacks(demo, nats_url):
    _, prefix, _ = demo
    result = await cli("audit", "actor", "a-0000", "--json", "--nats", nats_url, "--prefix", prefix)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    kinds = [r["event"] for r in rows]
    assert kinds[0] == "ActorCreated"
    assert "ActorPlaced" in kinds and "SnapshotTaken PAUSE" in kinds
    placed = [r for r in rows if r["event"] == "ActorPlaced"]
    assert all(r["runtime_role"] == "pin" and r["worker"] for r in placed)
    # as the wire has them: the runtime a Struct's fields, the time RFC 3339 in UTC
    assert {"sandbox_class", "version", "name"} <= set(placed[0]["runtime"])
    assert placed[0]["runtime"]["version"]["schema_version"].startswith("v")
    # each runtime's `rt-` id beside its version, as every view's JSON gives it (it had none)
    for row in (r for r in rows if r["runtime"] is not None):
        pin = row["runtime"]
        assert pin["runtime_id"] == short_id(compat_key(pin["sandbox_class"], msgspec.convert(
            pin["version"], CompatVersion))), row
    assert all(r["at"].endswith("Z") for r in rows)
    paused = [r for r in rows if r["event"] == "SnapshotTaken PAUSE"]
    assert all(r["runtime_role"] == "stamp" and r["runtime"]["sandbox_class"] for r in paused)
    assert any(r["fallback"] == "NO_COMPATIBLE_WORKER" for r in placed)
    assert [r["seq"] for r in rows] == sorted(r["seq"] for r in rows)
    # what else each event says: the template, the snapshots taken and restored, why released
    assert rows[0]["detail"].startswith("template ")
    taken_ids = [r["detail"].split()[1] for r in rows if r["event"].startswith("SnapshotTaken")]
    assert taken_ids and all(r["detail"].startswith("snapshot ") for r in rows if r["event"].startswith("Snap"))
    restored = [r["detail"].split()[1] for r in placed if r["detail"].startswith("restore ")]
    assert restored and set(restored) <= set(taken_ids), (restored, taken_ids)
    assert any(r["detail"] == "paused" for r in rows if r["event"] == "ActorReleased")
    missing = await cli("audit", "actor", "nobody", "--nats", nats_url, "--prefix", prefix)
    assert missing.exit_code != 0 and "no events" in missing.output
    # the table, as the other views: plain aligned columns, runtimes by their short label
    table = await cli("audit", "actor", "a-0000", "--nats", nats_url, "--prefix", prefix)
    assert table.exit_code == 0, table.output
    lines = table.output.splitlines()
    assert lines[0].split() == ["SEQ", "AT", "EVENT", "WORKER", "FIDELITY", "FALLBACK", "RUNTIME", "DETAIL"]
    assert len(lines) == 1 + len(rows) and not set("┃│━─┏") & set(table.output)
    assert lines[1].split()[1] == rows[0]["at"][:19] + "Z"  # to the second, said to be UTC
    assert "architecture=" not in table.output and any(" pin " in f" {line} " for line in lines)


def test_a_timeline_tells_apart_the_runtimes_it_names_that_the_fleet_no_longer_runs():
    """Two CPU generations of one runtime name pin an actor in turn; the fleet then runs neither (the
    release was dropped). The timeline's labels are told apart among every runtime it names, not only
    the fleet's (a walkthrough read both pins as one: no runtime of the fleet carried the name)."""
    from events.compat import compat_key
    from events.runtime_id import Runtimes, short_id
    from tests.factories import placed, snapshot, stamp, taken, version
    from warmboot.cmd_audit import timeline_labels

    old, new = version("gen-1"), version("gen-2")

    def fleet_of() -> Runtimes:
        fleet = Runtimes()
        fleet.add("gvisor", version("gen-3"), "runsc-v2", run=True)  # the next release, on a third generation
        return fleet

    fleet = fleet_of()
    named_old, named_new = stamp(old, name="runsc-v1"), stamp(new, name="runsc-v1")
    pins = [placed("a", "w-1", named_old), taken(snapshot("a", named_old)), placed("a", "w-2", named_new)]
    labels = timeline_labels(pins, fleet)
    digits = [short_id(compat_key("gvisor", v))[3:] for v in (old, new)]
    assert labels == [f"pin runsc-v1@{digits[0]}", f"stamp runsc-v1@{digits[0]}", f"pin runsc-v1@{digits[1]}"], labels
    # Two actors' timelines, each naming one of them: neither knows of the other's namesake, and
    # a dropped runtime is qualified all the same, so the two do not read alike (a walkthrough).
    alone = [timeline_labels([placed(a, "w-1", pin)], fleet_of()) for a, pin in (("a", named_old), ("b", named_new))]
    assert alone == [[f"pin runsc-v1@{digits[0]}"], [f"pin runsc-v1@{digits[1]}"]], alone
    # a runtime the fleet runs reads as in the other views: by its name alone when that is unique
    running = fleet_of()
    running.add("gvisor", old, "runsc-v1", run=True)
    assert timeline_labels([placed("a", "w-1", named_old)], running) == ["pin runsc-v1"]
    # ones it only accepts through edges (the usual end of a rolling upgrade) are not run: qualified,
    # so two actors' timelines do not read alike (a review)
    accepting = fleet_of()
    accepting.add("gvisor", old)
    accepting.add("gvisor", new)
    assert [timeline_labels([placed(a, "w-1", pin)], accepting) for a, pin in (("a", named_old), ("b", named_new))] \
        == [[f"pin runsc-v1@{digits[0]}"], [f"pin runsc-v1@{digits[1]}"]]


async def test_views_json_agree_with_the_endpoints(demo, nats_url, nc):
    _, prefix, _ = demo
    frag = await call(nc, service_subject(prefix, "scheduler", "fragmentation"), FragmentationQuery(), Fragmentation)
    shown = await cli("fragmentation", "--json", "--nats", nats_url, "--prefix", prefix)
    assert shown.exit_code == 0, shown.output
    answer, ids = runtime_ids_apart(json.loads(shown.output))
    assert answer == to_builtins(frag)  # the endpoint's answer, each runtime's id beside its version
    assert ids == [(to_builtins(rt.version), short_id(compat_key(c.sandbox_class, rt.version)))
                   for c in frag.classes for rt in c.runtimes]

    why = await call(nc, service_subject(prefix, "scheduler", "explain", "a-0001"), ExplainResume(), Explanation)
    shown = await cli("explain", "a-0001", "--json", "--nats", nats_url, "--prefix", prefix)
    assert shown.exit_code == 0, shown.output
    answer, ids = runtime_ids_apart(json.loads(shown.output))
    assert answer == to_builtins(why)
    expected = []  # the pin's id, and the matched version's (of the pin's class)
    if why.decision is not None:
        pin = why.decision.sandbox_runtime
        expected = [(to_builtins(v), short_id(compat_key(pin.sandbox_class, v)))
                    for v in (pin.version, why.decision.matched_version) if v is not None]
    assert sorted(ids, key=repr) == sorted(expected, key=repr)

    listed = await cli("workers", "--json", "--nats", nats_url, "--prefix", prefix)
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.output)
    for cls in frag.classes:  # fragmentation counts the workers that take placements
        assert sum(1 for r in rows if r["sandbox_class"] == cls.sandbox_class and r["state"] == "REGISTERED") \
            == cls.workers
        free = sum(r["free"]["memory_mib"] for r in rows
                   if r["sandbox_class"] == cls.sandbox_class and r["state"] == "REGISTERED")
        assert free == sum(rt.free.memory_mib for rt in cls.runtimes if rt.workers_default)
    # the demo retired (drained) its oldest CPU generation
    assert {r["worker_id"][4] for r in rows if r["state"] == "DRAINED"} == {"0"}


async def test_verify_names_the_sequence_of_a_forged_overbooking(demo, nats_url, nc):
    running, prefix, _ = demo
    scheduler = running.services[list(SERVICES).index("scheduler")]
    projection = scheduler.projection
    actor = next(a for a in projection.actors.values() if a.state is PAUSED)
    worker = next(w for w in projection.workers.values() if w.live)
    entry = next(iter(worker.classes.values()))
    forged = ActorPlaced(
        actor_id=actor.actor_id, at=datetime.now(timezone.utc), worker_id=worker.worker_id, node=worker.node,
        action=Action.RUN, fidelity=PlacedFidelity.NONE,
        sandbox_runtime=ActorRuntime(sandbox_class=entry.default.compat.sandbox_class,
                                     version=entry.default.compat.version),
        booked=Resources(cpu_millis=1, memory_mib=worker.memory_mib * 2),
    )
    ack = await nc.jetstream().publish(
        event_subject(prefix, "actor", actor.actor_id), encode(forged),
        headers={TOPIC_HEADER: "ActorPlaced", VERSION_HEADER: str(actor.version + 1)},
    )
    result = await cli("audit", "verify", "--nats", nats_url, "--prefix", prefix)
    assert result.exit_code == 1
    assert f"sequence {ack.seq}" in result.output
    assert "booked past its room" in result.output


def test_a_timeline_says_what_each_event_names_besides_its_runtime():
    """The DETAIL of a timeline: the template and golden snapshot of a creation, the snapshot a
    placement restores (or that it runs without one), the image a revert gives up and where it
    goes back to (a walkthrough found none of them in the audit trail)."""
    from events.schema import ActorReverted, TemplateChanged
    from tests.factories import AT, created, placed, snapshot, version
    from warmboot.cmd_audit import timeline_detail

    v1 = version("gen-1")
    golden = snapshot("g", v1, snapshot_id="golden-1", template="t9", borrowed=True)
    local = snapshot("a", v1, snapshot_id="s-2", node="n1")
    external = snapshot("a", v1, snapshot_id="s-1", uri="s3://x")
    assert timeline_detail(created("a", template="t9", snapshot=golden)) == \
        "template t9, from snapshot golden-1 (EXTERNAL)"
    assert timeline_detail(TemplateChanged(at=AT, actor_id="a", template_uid="t10")) == "template t10"
    assert timeline_detail(placed("a", "w1", v1, action=Action.RESTORE, snapshot_id="s-1")) == "restore s-1"
    assert timeline_detail(placed("a", "w1", v1)) == "cold boot"
    assert timeline_detail(placed("a", "w1", v1, snapshot_id="golden-1")) == "run (snapshot golden-1 not restored)"
    assert timeline_detail(ActorReverted(at=AT, actor_id="a", snapshot=external, abandoned=local)) == \
        "to snapshot s-1 (EXTERNAL), gave up s-2 (LOCAL on n1)"
    assert timeline_detail(ActorReverted(at=AT, actor_id="a", abandoned=local)) == \
        "to a cold boot, gave up s-2 (LOCAL on n1)"
