"""`warmboot actor list` from a scheduler's fold, a page at a time (`scheduler.actors`, a project addition),
else from the log folded by the command itself.

At 10,000 workers `actor list` took 4.3 s for 360 actors: it folded the whole log (71,000 messages, half
of them the workers' histories) with the scheduler's projection (docs/scaling.md, "Which commands grow
with the fleet"). A scheduler replica's fold has every actor already: the command asks it for pages
of rows, and folds the log only when no scheduler answers. One function makes the rows and the pages
(`services.scheduler.actor_list.actor_page`) for the endpoint and for the command's own fold alike.
"""

from __future__ import annotations

import asyncio
import json
import random

import msgspec
import pytest
from click.testing import CliRunner

from events.codec import encode
from events.errors import ContractError
from events.schema import (
    ACTORS_LIMIT_MAX,
    ACTORS_PAGE_BYTES,
    MAX_INT,
    ActorPage,
    ActorRuntime,
    ActorsQuery,
    ActorSnapshotSummary,
    ActorStopped,
    ActorSummary,
    Attribute,
    CompatVersion,
    ErrorCode,
    Fidelity,
    Location,
    ReleaseReason,
    Resources,
    SnapshotOrigin,
)
from events.states import ActorState
from events.subjects import service_subject
from services.endpoints import call
from services.scheduler import actor_list
from services.scheduler.actor_list import actor_page, actor_summary, sorted_ids
from services.scheduler.projection import Projection
from tests.factories import (AT, booked, created, entry, first_column, fold, last_seq, log_reads, placed, read_log,
                             registered, released, runtime, snapshot, stamp, taken, version)
from warmboot.cli import main
from warmboot.client import Client
from warmboot.cmd_lifecycle import actor_view, folded_actors, summary_view
from warmboot.cmd_views import runtimes_of

V0, V1, V2 = version("v0"), version("v1"), version("v2")
HISTORY = [
    registered("w-1", entry(runtime(V1, "runsc-v1"))),
    registered("w-2", entry(runtime(V2))),  # an unnamed runtime: its pins carry no name
    registered("m-w", entry(runtime(V2, "fc"), sandbox_class="microvm")),
    created("a-1"),  # CREATED
    created("a-2"), placed("a-2", "w-1", stamp(V1, name="runsc-v1")), booked("w-1", "a-2"),  # RUNNING on w-1
    # SUSPENDED: a snapshot stamped with a runtime no worker runs, without a name, which another
    # actor's stamp names (a STOPPED one's, listed or not): the label is that name with its digits
    # (`Runtimes.stamp`), whatever the filters
    created("a-3"), taken(snapshot("a-3", V0, uri="s3://b/a-3")),
    created("z-9"), taken(snapshot("z-9", stamp(V0, name="old"), uri="s3://b/z-9")), ActorStopped(at=AT, actor_id="z-9"),
    created("b-1", selectors={"zone": "a", "disk": "ssd"}, mem=2048),  # PAUSED, its image LOCAL on w-2's node
    placed("b-1", "w-2", V2, mem=2048), booked("w-2", "b-1"),
    taken(snapshot("b-1", V2, node="node-w-2", borrowed=True), SnapshotOrigin.PAUSE),
    released("b-1", "w-2", ReleaseReason.PAUSED),
    created("c-1"), ActorStopped(at=AT, actor_id="c-1"),  # STOPPED
    created("m-1", sandbox_class="microvm"),  # RUNNING on m-w
    placed("m-1", "m-w", stamp(V2, "microvm", "fc"), sandbox_class="microvm"), booked("m-w", "m-1"),
    created("r-1", min_fidelity=Fidelity.MEMORY), placed("r-1", "w-2", V2), booked("w-2", "r-1"),  # on w-2, unnamed pin
]
# (classes, states, worker ids) as `actor list --class/--state/--worker` take them
FILTERS = [
    ((), (), ()),
    ((), (ActorState.RUNNING,), ()),
    ((), (ActorState.SUSPENDED, ActorState.PAUSED), ()),
    (("microvm",), (), ()),
    (("gvisor", "microvm"), (ActorState.CREATED, ActorState.RUNNING), ()),
    ((), (), ("w-2",)),
    (("gvisor",), (ActorState.RUNNING,), ("w-1", "w-2", "w-gone")),
    (("gvsor",), (), ()),
]


def query(filters, **more) -> ActorsQuery:
    classes, states, workers = filters
    return ActorsQuery(sandbox_classes=classes, states=states, worker_ids=workers, **more)


def listed(projection: Projection, filters) -> list[dict]:
    """The rows `actor list -o json` printed before the endpoint: every actor's view, filtered."""
    classes, states, workers = filters
    views = []
    for actor_id in sorted(projection.actors):
        view = actor_view(actor_id, projection, runtimes_of(projection))
        del view["events"]
        if ((not classes or view["sandbox_class"] in classes) and (not states or view["state"] in
                                                                   [s.value for s in states])
                and (not workers or view["worker_id"] in workers)):
            views.append(view)
    return views


def rows(pages: list[ActorPage]) -> list[ActorSummary]:
    return [row for page in pages for row in page.actors]


# --- the function ------------------------------------------------------------------------------


def test_the_pages_walked_are_the_rows_of_the_log_s_fold_for_every_filter():
    projection = fold(HISTORY, Projection())
    runtimes = runtimes_of(projection)
    states = {a.state for a in projection.actors.values()}
    assert states == set(ActorState), states  # every state is listed below
    for filters in FILTERS:
        for limit in (1, 2, ACTORS_LIMIT_MAX):
            pages = folded_actors(projection, query(filters, limit=limit))
            assert all(len(page.actors) <= limit for page in pages)
            assert [summary_view(row, runtimes) for row in rows(pages)] == listed(projection, filters), filters
            assert all(page.next_after == page.actors[-1].actor_id for page in pages[:-1])
            assert pages[-1].next_after is None
            assert all(page.actors for page in pages[1:]), (filters, limit)  # no cursor leads to an empty page
    # the row is the actor's view without its labels: its stamp and pin as the wire names runtimes
    row = actor_summary(projection.actors["b-1"], projection)
    assert row.snapshot == ActorSnapshotSummary(snapshot_id="b-1-s", template_uid="t1", fidelity=Fidelity.MEMORY,
                                                location=Location.LOCAL, node="node-w-2", borrowed=True,
                                                stamp=stamp(V2))
    assert (row.state, row.selectors, row.worker_id, row.pin, row.booked) == (ActorState.PAUSED, {"zone": "a",
                                                                                "disk": "ssd"}, None, None, None)
    running = actor_summary(projection.actors["r-1"], projection)
    assert (running.worker_id, running.node, running.pin, running.booked) == (
        "w-2", "node-w-2", stamp(V2), Resources(cpu_millis=500, memory_mib=1024))


def test_the_first_page_says_the_classes_and_workers_asked_that_match_nothing():
    projection = fold(HISTORY, Projection())
    first = actor_page(projection, query((("gvsor", "gvisor", "kata"), (), ("w-1", "w-gone", "w-nope")), limit=1))
    assert (first.unknown_classes, first.classes) == (["gvsor", "kata"], ["gvisor", "microvm"])
    assert first.unknown_workers == ["w-gone", "w-nope"]
    later = actor_page(projection, query((("gvsor",), (), ("w-gone",)), after="a-1"))
    assert (later.unknown_classes, later.classes, later.unknown_workers) == ([], [], [])  # said once
    # every class asked has actors: no classes named
    assert actor_page(projection, query((("gvisor",), (), ()))).classes == []
    # the unnamed stamp of a-3 comes with the name another actor's stamp gives its runtime
    page = actor_page(projection, query(((), (ActorState.SUSPENDED,), ())))
    assert [row.actor_id for row in page.actors] == ["a-3"]
    assert page.stamp_names == [stamp(V0, name="old")]


def test_a_cursor_is_given_only_when_an_actor_that_passes_the_filters_follows():
    """The RUNNING actors are a-2, m-1 and r-1; z-9 (STOPPED) sorts after them. A page of 3 RUNNING ones
    gave the cursor r-1 (an id followed it), and the page after it was empty: `actor list --state RUNNING`
    said more follow, and its --continue "no actor matches after r-1". Where the next one was found is
    where the next page at the same fold position starts; after an event, the page after the cursor is
    scanned anew (an actor that passes now, between the cursor and that one, is not skipped)."""
    projection = fold(HISTORY, Projection())
    running = query(((), (ActorState.RUNNING,), ()), limit=3)
    page = actor_page(projection, running)
    assert ([row.actor_id for row in page.actors], page.next_after) == (["a-2", "m-1", "r-1"], None)
    first = actor_page(projection, msgspec.structs.replace(running, limit=1))
    assert ([row.actor_id for row in first.actors], first.next_after) == (["a-2"], "a-2")
    ahead = actor_list._CACHE[projection].ahead
    assert list(ahead.found.values()) == [sorted_ids(projection).index("m-1")]
    # an actor that runs now, whose id sorts between the cursor and m-1: listed on the next page
    for seq, event in enumerate([created("a-5"), placed("a-5", "w-1", stamp(V1, name="runsc-v1")),
                                 booked("w-1", "a-5")], start=projection.seq + 1):
        projection.apply(seq, event)
    after = actor_page(projection, msgspec.structs.replace(running, after="a-2"))
    assert ([row.actor_id for row in after.actors], after.next_after) == (["a-5", "m-1", "r-1"], None)
    # a filter no actor after the page passes: no cursor, whatever the ids that follow
    c1 = actor_page(projection, query(((), (ActorState.CREATED, ActorState.STOPPED), ()), limit=2))
    assert ([row.actor_id for row in c1.actors], c1.next_after) == (["a-1", "c-1"], "c-1")  # z-9 follows
    assert actor_page(projection, query(((), (ActorState.CREATED,), ()), limit=1)).next_after is None


def test_the_sorted_ids_follow_the_actors_created_after_a_page():
    projection = fold(HISTORY, Projection())
    before = list(sorted_ids(projection))
    assert before == sorted(projection.actors)
    for seq, event in enumerate([created("a-0"), created("zz"), created("b-0"), ActorStopped(at=AT, actor_id="a-1"),
                                 created("a-1")], start=len(HISTORY) + 1):
        projection.apply(seq, event)
    assert sorted_ids(projection) == sorted(projection.actors) == sorted([*before, "a-0", "zz", "b-0"])
    many = [created(f"n-{i:04d}") for i in range(actor_list.RESORT_FROM + 1)]  # more than are inserted one by one
    for seq, event in enumerate(many, start=projection.seq + 1):
        projection.apply(seq, event)
    assert sorted_ids(projection) == sorted(projection.actors)


def test_a_page_of_the_largest_rows_fits_the_largest_message_nats_takes():
    """events/schema.py says the arithmetic: a row is at most 161 KB; a page stops at ACTORS_PAGE_BYTES of
    rows and always holds one; the rest of a page is at most 118 KB."""
    wide = "\U0001F600"  # 4 bytes in UTF-8
    ver = CompatVersion(schema_version="v9999", attributes=tuple(
        Attribute(key=f"k{i:03d}" + "a" * 124, value=wide * 256) for i in range(32)))
    largest = ActorRuntime(sandbox_class="c" * 63, version=ver, name=wide * 253)
    selectors = {f"k{i:02d}" + "a" * 250: wide * 256 for i in range(64)}
    most = Resources(cpu_millis=MAX_INT, memory_mib=MAX_INT)
    row = ActorSummary(
        actor_id="a" * 128, state=ActorState.SUSPENDED, sandbox_class="c" * 63, template_uid="t" * 128,
        resources=most, selectors=selectors, min_fidelity=Fidelity.ROOTFS,
        snapshot=ActorSnapshotSummary(snapshot_id="s" * 128, template_uid="t" * 128, fidelity=Fidelity.MEMORY,
                                      location=Location.LOCAL, node="n" * 128, borrowed=True, stamp=largest),
        worker_id="w" * 128, node="n" * 128, pin=largest, booked=most, last_seq=2 ** 63)
    assert len(encode(row)) + 2 * len(encode(largest)) < 240_000
    rest = ActorPage(actors=[], next_after="a" * 128, unknown_classes=["c" * 63] * 256, classes=["c" * 63] * 1024,
                     unknown_workers=["w" * 128] * 256, stamp_names=[])
    assert len(encode(rest)) < 118_500
    assert ACTORS_PAGE_BYTES + len(encode(rest)) + ACTORS_LIMIT_MAX < (1 << 20) - 140_000

    # actors of 64 large labels each: a page stops at the bytes, not at the limit, and each fits
    label = wide * 256
    big = [created(f"a-{i:02d}", selectors={f"k{j:02d}" + "a" * 250: label for j in range(64)}) for i in range(20)]
    projection = fold(big, Projection())
    pages = folded_actors(projection, ActorsQuery(limit=ACTORS_LIMIT_MAX))
    assert len(pages) > 1 and [r.actor_id for r in rows(pages)] == sorted(projection.actors)
    assert all(len(encode(page)) <= ACTORS_PAGE_BYTES + 1_000 for page in pages)


def test_a_page_after_an_actor_is_created_lists_it_in_its_place():
    """The ids in order are kept per projection and the actors created since inserted (not sorted again):
    pages walked after a create list it where its id sorts. What a page costs is bench/views.py's."""
    ids = [f"a-{i:04d}" for i in range(3000)]
    random.Random(1).shuffle(ids)  # created in no order of their ids
    projection = fold([created(actor_id, selectors={"zone": "a"}) for actor_id in ids], Projection())
    first = actor_page(projection, ActorsQuery(limit=ACTORS_LIMIT_MAX))
    assert len(first.actors) == ACTORS_LIMIT_MAX and first.next_after == "a-0999"
    projection.apply(projection.seq + 1, created("a-1000x"))  # one actor more, sorted among the next page's
    walked = first.actors + [row for page in folded_actors(projection, ActorsQuery(limit=ACTORS_LIMIT_MAX,
                                                                                    after=first.next_after))
                             for row in page.actors]
    assert [row.actor_id for row in walked] == sorted([*ids, "a-1000x"])


# --- over the bus -----------------------------------------------------------------------------


def cli(*args: str, width: int = 200):
    return asyncio.to_thread(CliRunner().invoke, main, list(args), env={"COLUMNS": str(width)})


COMMANDS = [
    (),
    ("--state", "running"),
    ("--state", "SUSPENDED", "--state", "paused", "-o", "wide"),
    ("--class", "microvm", "-o", "json"),
    ("--class", "gvisor", "--class", "microvm", "--state", "CREATED", "--state", "RUNNING"),
    ("--worker", "w-2", "-o", "json"),
    ("--class", "gvisor", "--class", "gvsor", "--worker", "w-1", "--worker", "w-gone", "--state", "running"),
    ("--class", "kata",),
]


async def test_the_endpoint_s_pages_are_the_log_s_rows_and_the_command_prints_alike_without_reading_the_log(
        nats_url, nc, prefix, writer, replicas, monkeypatch):
    last = await asyncio.to_thread(writer.write, *HISTORY)
    at = ("--nats", nats_url, "--prefix", prefix)
    read = log_reads(monkeypatch)

    # no scheduler: the command folds the log, as it did before the endpoint
    folded = {args: await cli("actor", "list", *args, *at) for args in COMMANDS}
    assert all(shown.exit_code == 0 for shown in folded.values()), [s.output for s in folded.values()]
    assert None in read  # the whole log
    assert folded[("--class", "kata")].stderr == (
        "note: no actor of the log is of the sandbox class 'kata' (its actors': gvisor, microvm)\n")
    assert folded[COMMANDS[-2]].stderr == (
        "note: no actor of the log is of the sandbox class 'gvsor' (its actors': gvisor, microvm)\n"
        "note: worker 'w-gone' is not registered (`warmboot workers` lists those that are)\n")

    await replicas()
    wb = Client(nc, prefix)
    projection = fold([event for _, event in await read_log(nc, prefix)], Projection())
    for filters in FILTERS:
        pages = [await wb.actors(query(filters, limit=2, min_seq=last))]
        while pages[-1].next_after is not None:
            pages.append(await wb.actors(query(filters, limit=2, min_seq=last, after=pages[-1].next_after)))
        assert pages == folded_actors(projection, query(filters, limit=2)), filters
        assert [row.actor_id for row in rows(pages)] == [v["actor_id"] for v in listed(projection, filters)]
    assert len(rows(folded_actors(projection, ActorsQuery()))) == len(projection.actors) > 2

    # the command asks the scheduler: what it prints is what the log's fold printed, and it reads no log
    read.clear()
    for args, before in folded.items():
        shown = await cli("actor", "list", *args, *at)
        assert (shown.exit_code, shown.stdout, shown.stderr) == (0, before.stdout, before.stderr), args
    assert read == [], read
    if_json = json.loads(folded[("--class", "microvm", "-o", "json")].stdout)
    assert [v["actor_id"] for v in if_json] == ["m-1"] and if_json[0]["pin"]["label"] == "fc"
    shown = folded[("--state", "SUSPENDED", "--state", "paused", "-o", "wide")].stdout
    assert f"old@{stamp_digits(V0)}" in shown.splitlines()[1], shown  # a-3's unnamed stamp, named by z-9's


def stamp_digits(v: CompatVersion) -> str:
    from events.compat import compat_key
    from events.runtime_id import short_id

    return short_id(compat_key("gvisor", v))[3:]


async def test_the_command_walks_every_page(nats_url, nc, prefix, writer, replicas, monkeypatch):
    """Pages of one row: the command lists every actor, by id, as one page did."""
    from warmboot import cmd_lifecycle

    await asyncio.to_thread(writer.write, *HISTORY)
    await replicas()
    asked: list[ActorsQuery] = []
    actors = Client.actors

    async def recorded(self, q: ActorsQuery) -> ActorPage:
        asked.append(q)
        return await actors(self, q)

    monkeypatch.setattr(Client, "actors", recorded)
    at = ("--nats", nats_url, "--prefix", prefix, "-o", "json")
    whole = json.loads((await cli("actor", "list", *at)).stdout)
    assert len(asked) == 1 and asked[0].limit == ACTORS_LIMIT_MAX and asked[0].min_seq == await last_seq(nc, prefix)
    asked.clear()
    monkeypatch.setattr(cmd_lifecycle, "ACTORS_LIMIT_MAX", 1)
    paged = json.loads((await cli("actor", "list", *at)).stdout)
    assert paged == whole and len(whole) == len({e.actor_id for e in HISTORY if hasattr(e, "actor_id")})
    assert [q.after for q in asked] == [None, *[v["actor_id"] for v in whole]][:len(asked)]
    assert len(asked) == len(whole) and len({q.min_seq for q in asked}) == 1  # every page at the same min_seq


async def test_a_bad_query_is_invalid_naming_its_field_and_writes_nothing(nc, prefix, replicas):
    await replicas()
    before = await last_seq(nc, prefix)
    subject = service_subject(prefix, "scheduler", "actors")
    for body, field in (({"limit": 0}, "limit"), ({"limit": ACTORS_LIMIT_MAX + 1}, "limit"),
                        ({"states": ["GONE"]}, "states[0]"), ({"sandbox_classes": ["Bad Class"]}, "sandbox_classes[0]"),
                        ({"worker_ids": ["w-1"] * 257}, "worker_ids"), ({"after": "bad id"}, "after")):
        with pytest.raises(ContractError) as refused:
            await call(nc, subject, body, ActorPage)
        assert (refused.value.code, refused.value.field) == (ErrorCode.INVALID_ARGUMENT, field), refused.value
    assert "GONE" in (await _refusal(nc, subject, {"states": ["GONE"]})).message
    assert await last_seq(nc, prefix) == before  # nothing written
    assert (await call(nc, subject, {}, ActorPage)).actors == []  # an empty fold: no rows, no cursor


async def _refusal(nc, subject: str, body: dict) -> ContractError:
    with pytest.raises(ContractError) as refused:
        await call(nc, subject, body, ActorPage)
    return refused.value


def test_a_class_that_is_none_or_too_many_filters_are_usage_errors_before_anything_is_sent():
    for args, option in ((("--class", "Bad Class"), "--class"),
                         (tuple(a for i in range(257) for a in ("--worker", f"w-{i}")), "--worker")):
        shown = CliRunner().invoke(main, ["actor", "list", *args, "--nats", "nats://127.0.0.1:1"])
        assert shown.exit_code == 2, shown.output
        assert f"Invalid value for '{option}'" in shown.stderr and shown.stdout == "", shown.stderr
    said = " ".join(CliRunner().invoke(main, ["actor", "list", "--class", "Bad Class"]).stderr.split())
    assert "'Bad Class' is not a sandbox class: 1 to 63 lower-case letters" in said, said
    repeated = msgspec.json.decode(encode(ActorsQuery(states=(ActorState.PAUSED,))))  # the wire's names
    assert repeated["states"] == ["PAUSED"]


async def test_a_page_a_busy_replica_refuses_is_asked_again_not_read_from_the_log(nats_url, nc, prefix, writer,
                                                                                  replicas, monkeypatch):
    """A replica with `READS_WAITING` read-only answers waiting refuses one more, UNAVAILABLE at once: the
    command asks in one attempt (to find no scheduler, or one of an earlier version, at once), and such a
    refusal sent it to fold the whole log. It asks again after a jittered pause instead, and prints the
    replica's pages without reading the log; a replica busy past its attempts is read from the log, as
    before. `worker show` and the views' runtimes ask the same way (`cmd_views.unless_busy`)."""
    import services.scheduler.service as scheduler_service
    from events.errors import busy_reads
    from warmboot import cmd_views

    await asyncio.to_thread(writer.write, *HISTORY)
    await replicas()
    at = ("--nats", nats_url, "--prefix", prefix, "-o", "json")
    expected = json.loads((await cli("actor", "list", *at)).stdout)
    read = log_reads(monkeypatch)
    monkeypatch.setattr(cmd_views, "BUSY_PAUSE_S", 0.01)
    refused: list[int] = []
    busy_for = 2  # the requests refused, from the first
    turn = scheduler_service.SchedulerService._read

    async def busy_at_first(self, min_seq, answer):
        if len(refused) < busy_for:
            refused.append(min_seq)
            raise busy_reads(scheduler_service.READS_WAITING)
        return await turn(self, min_seq, answer)

    monkeypatch.setattr(scheduler_service.SchedulerService, "_read", busy_at_first)
    shown = await cli("actor", "list", *at)
    assert shown.exit_code == 0 and json.loads(shown.stdout) == expected, shown.output
    assert len(refused) == 2 and read == [], (refused, read)

    refused.clear()
    busy_for = 1000  # busy past every attempt
    shown = await cli("actor", "list", *at)
    assert shown.exit_code == 0 and json.loads(shown.stdout) == expected, shown.output
    assert None in read  # the whole log, as for no scheduler


# --- at fleet size: a page, and a way to the next --------------------------------------------------


IDS = sorted({e.actor_id for e in HISTORY if hasattr(e, "actor_id")})


async def test_a_table_lists_a_page_and_says_on_stderr_how_to_list_the_next(nats_url, nc, prefix, writer, replicas,
                                                                            monkeypatch):
    """`actor list` printed every actor of the log: 50,000 lines on a terminal at 50,000 actors, without
    being asked (a trial at fleet size). A table lists TABLE_LIMIT (here 3, in pages of 2) and says on
    stderr how to list the next ones (`--continue ID`, the same filters) or all (`--limit 0`); -o json
    lists every one. Alike from a scheduler and from the log's fold."""
    from warmboot import cmd_lifecycle, cmd_views

    await asyncio.to_thread(writer.write, *HISTORY)
    monkeypatch.setattr(cmd_views, "TABLE_LIMIT", 3)
    monkeypatch.setattr(cmd_lifecycle, "ACTORS_LIMIT_MAX", 2)
    at = ("--nats", nats_url, "--prefix", prefix)

    for source in ("log", "scheduler"):
        if source == "scheduler":
            await replicas()
        first = await cli("actor", "list", *at)
        assert first.exit_code == 0 and first_column(first) == IDS[:3], (source, first.output)
        assert first.stderr == (f"note: 3 actors listed, more follow: --continue {IDS[2]} lists the next 3 (the same "
                                "filters), --limit 0 every one\n"), source
        second = await cli("actor", "list", "--continue", IDS[2], *at)
        assert first_column(second) == IDS[3:6] and f"--continue {IDS[5]} " in second.stderr, (source, second.output)
        last = await cli("actor", "list", "--continue", IDS[5], *at)
        assert first_column(last) == IDS[6:] and last.stderr == "", (source, last.output)
        whole = await cli("actor", "list", "--limit", "0", *at)
        assert first_column(whole) == IDS and whole.stderr == "", source
        as_json = await cli("actor", "list", "-o", "json", *at)
        assert [v["actor_id"] for v in json.loads(as_json.stdout)] == IDS and as_json.stderr == "", source
        two = await cli("actor", "list", "-o", "json", "--limit", "2", *at)
        assert [v["actor_id"] for v in json.loads(two.stdout)] == IDS[:2] and "--continue" in two.stderr, source
        running = await cli("actor", "list", "--state", "RUNNING", "--limit", "1", *at)
        assert first_column(running) == ["a-2"] and "--continue a-2 " in running.stderr, (source, running.output)
    past = await cli("actor", "list", "--continue", IDS[-1], *at)
    assert past.stdout == f"no actors after {IDS[-1]} (--continue)\n", past.output
    bad = await cli("actor", "list", "--continue", "no such id!", *at)
    assert bad.exit_code == 2 and "--continue" in bad.stderr, bad.output


async def test_a_listing_says_more_follow_only_when_an_actor_that_passes_its_filters_does(
        nats_url, nc, prefix, writer, replicas):
    """`actor list --state RUNNING --limit 3` listed the three RUNNING actors and said more follow
    (`--continue r-1`), because an actor of another state sorts after r-1; that --continue said "no actor
    matches after r-1". The cursor is the scheduler's (and the log's fold's, the same function): given
    only when a matching actor follows. Alike from the log's fold and from a scheduler."""
    last = await asyncio.to_thread(writer.write, *HISTORY)
    at = ("--nats", nats_url, "--prefix", prefix)

    for source in ("log", "scheduler"):
        if source == "scheduler":
            await replicas()
            page = await Client(nc, prefix).actors(query(((), (ActorState.RUNNING,), ()), limit=3, min_seq=last))
            assert ([row.actor_id for row in page.actors], page.next_after) == (["a-2", "m-1", "r-1"], None)
        every = await cli("actor", "list", "--state", "RUNNING", "--limit", "3", *at)
        assert (every.exit_code, first_column(every), every.stderr) == (0, ["a-2", "m-1", "r-1"], ""), \
            (source, every.output)
        two = await cli("actor", "list", "--state", "RUNNING", "--limit", "2", *at)
        assert first_column(two) == ["a-2", "m-1"] and "--continue m-1 " in two.stderr, (source, two.output)
        rest = await cli("actor", "list", "--state", "RUNNING", "--limit", "2", "--continue", "m-1", *at)
        assert (rest.exit_code, first_column(rest), rest.stderr) == (0, ["r-1"], ""), (source, rest.output)
        json_two = await cli("actor", "list", "--class", "microvm", "-o", "json", "--limit", "1", *at)
        assert [v["actor_id"] for v in json.loads(json_two.stdout)] == ["m-1"] and json_two.stderr == "", source


async def test_json_is_printed_a_page_at_a_time(nats_url, nc, prefix, writer, replicas, monkeypatch):
    """`actor list -o json` held every page, and then their whole text, before printing (890 MB at 50,000
    actors): each page is printed before the next is asked, the whole the same JSON."""
    import sys

    from warmboot import cmd_lifecycle

    await asyncio.to_thread(writer.write, *HISTORY)
    await replicas()
    at = ("--nats", nats_url, "--prefix", prefix, "-o", "json")
    whole = (await cli("actor", "list", *at)).stdout
    monkeypatch.setattr(cmd_lifecycle, "ACTORS_LIMIT_MAX", 2)
    printed: list[int] = []  # what stdout held as each page was asked
    actors = Client.actors

    async def recorded(self, q: ActorsQuery) -> ActorPage:
        sys.stdout.flush()
        printed.append(len(sys.stdout.buffer.getvalue()))
        return await actors(self, q)

    monkeypatch.setattr(Client, "actors", recorded)
    paged = (await cli("actor", "list", *at)).stdout
    assert paged == whole and json.loads(paged) and len(printed) == (len(IDS) + 1) // 2
    assert printed[0] == 0 and all(a < b for a, b in zip(printed, printed[1:])), printed


def test_a_json_list_written_an_element_at_a_time_is_json_dumps_of_it_whole():
    from warmboot.render import JsonList

    for elements in ([], [1], [{"a": [1, {"b": "x\ny"}], "c": {}}, "q", [], None]):
        out: list[str] = []
        listed = JsonList(out.append)
        for element in elements:
            listed.add(element)
        listed.close()
        assert "".join(out) == json.dumps(elements, indent=2) + "\n"


async def test_a_page_is_printed_while_the_connection_s_loop_goes_on(monkeypatch):
    """JSON printed a page at a time is printed while connected: a reader slow to take it (`-o json | less`)
    blocked the loop that answers the server's pings, and a connection silent that long is closed by the
    server. A page is printed from a thread (`print_page`): the loop runs while stdout blocks."""
    import threading

    import click

    from warmboot.cmd_views import print_page

    loop = asyncio.get_running_loop()
    blocked = asyncio.Event()  # the echo has begun, in its thread, and waits for `release`
    release = threading.Event()
    written: list[str] = []

    def slow_echo(text: str, nl: bool = True) -> None:
        loop.call_soon_threadsafe(blocked.set)
        release.wait(3)
        written.append(text)

    monkeypatch.setattr(click, "echo", slow_echo)
    ran_while_blocked = False

    async def loop_runs() -> None:  # reached only if the loop runs while the echo blocks
        nonlocal ran_while_blocked
        await blocked.wait()
        ran_while_blocked = not written
        release.set()

    printed = ["[\n", "  1"]
    await asyncio.wait_for(asyncio.gather(print_page(printed), loop_runs()), 2)
    assert written == ["[\n  1"] and printed == [] and ran_while_blocked


async def test_continue_with_a_filter_says_the_filter_s_notes_and_asks_no_absent_scheduler_twice(
        nats_url, nc, prefix, writer, monkeypatch):
    """`actor list --class C --continue A`: the notes on a filter that matches nothing come only with a page
    asked without `after`, so one row of it is asked first; where no scheduler answers it, the walk goes
    to the log's fold made for that row, without asking (and waiting for) the absent scheduler again."""
    await asyncio.to_thread(writer.write, *HISTORY)
    asked: list[ActorsQuery] = []
    actors = Client.actors

    async def counted(self, q: ActorsQuery) -> ActorPage:
        asked.append(q)
        return await actors(self, q)

    monkeypatch.setattr(Client, "actors", counted)
    shown = await cli("actor", "list", "--class", "kata", "--continue", IDS[0], "--nats", nats_url, "--prefix", prefix)
    assert shown.exit_code == 0 and shown.stdout == f"no actor matches after {IDS[0]} (--continue)\n", shown.output
    assert shown.stderr == "note: no actor of the log is of the sandbox class 'kata' (its actors': gvisor, microvm)\n"
    assert len(asked) == 1 and asked[0].after is None, asked
