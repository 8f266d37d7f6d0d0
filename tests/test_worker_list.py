"""`warmboot workers` from a scheduler's fold, a page at a time (`scheduler.workers`, a project addition),
else from the log folded by the command itself.

At 10,000 workers `workers` took 5.3 s, 3.8 s of it folding the whole log (71,000 messages) with the
scheduler's projection (docs/scaling.md, "Which commands grow with the fleet"). A scheduler replica's fold
has every row already: the command asks it for pages of workers, and folds the log only when no scheduler
answers. One function makes the pages (`services.scheduler.worker_list.worker_page`) for the endpoint and
for the command's own fold alike; `warmboot.cmd_views.class_row` makes the rows from them.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner

from events.codec import encode, to_builtins
from events.errors import ContractError
from events.schema import (
    ACTORS_FILTER_MAX,
    WORKERS_CLASSES_MAX,
    WORKERS_LIMIT_MAX,
    WORKERS_PAGE_BYTES,
    ErrorCode,
    WorkerDrained,
    WorkerPage,
    WorkersQuery,
    WorkerSummary,
)
from events.subjects import service_subject
from services.endpoints import call
from services.scheduler.projection import Projection
from services.scheduler.worker_detail import worker_detail
from services.scheduler.worker_list import worker_page
from tests.factories import (AT, booked, created, entry, first_column, fold, last_seq, log_reads, placed, read_log,
                             registered, runtime, stamp, version)
from warmboot.cli import main
from warmboot.client import Client
from warmboot.cmd_views import class_row, folded_workers, runtimes_of, summary_rows, worker_rows

V1, V1B, V2, FC = (version(b) for b in ("v1", "v1b", "v2", "fc1"))
GVISOR = entry(runtime(V2, "runsc-v2", 16, compatible=(V1,)), (runtime(V1B, "runsc-v1b", compatible=(V1,)),))
MICROVM = entry(runtime(FC, "fc-1"), sandbox_class="microvm")
PIN = stamp(V2, name="runsc-v2")
FC_PIN = stamp(FC, "microvm", name="fc-1")
HISTORY = [
    registered("w-1", GVISOR, MICROVM, node="node-a", labels={"zone": "a", "disk": "ssd"}, cpu=8000, mem=8192),
    registered("w-2", entry(runtime(V1, "runsc-v1")), node="node-a"),  # gvisor alone
    registered("w-3", GVISOR, node="node-b"),
    registered("m-w", MICROVM, node="node-c"),  # microvm alone
    registered("w-0", entry(runtime(V2))),  # an unnamed runtime
    WorkerDrained(at=AT, worker_id="w-3"),  # drained: listed all the same
    created("r-2", cpu=250, mem=512), placed("r-2", "w-1", PIN, node="node-a", cpu=250, mem=512), booked("w-1", "r-2"),
    created("r-1"), placed("r-1", "w-1", PIN, node="node-a"), booked("w-1", "r-1"),
    created("m-1", sandbox_class="microvm"), placed("m-1", "w-1", FC_PIN, node="node-a", sandbox_class="microvm"),
    booked("w-1", "m-1"),
    created("r-3"), placed("r-3", "w-3", PIN, node="node-b"), booked("w-3", "r-3"),
    created("q-1"),  # not placed
]
CLASSES = [(), ("microvm",), ("gvisor", "microvm"), ("gvisor",)]


def before_rows(projection: Any) -> list[dict]:
    """The rows `workers -o json` printed before the endpoint (`worker_rows` as it was: straight from the
    projection's records, one pass over the actors for every worker)."""
    runtimes = runtimes_of(projection)
    held: dict[tuple[int, str], int] = {}
    for a in projection.actors.values():
        if a.worker is not None:
            held[(id(a.worker), a.sandbox_class)] = held.get((id(a.worker), a.sandbox_class), 0) + 1
    rows = []
    for worker in projection.workers.values():
        capacity = {"cpu_millis": worker.cpu_millis, "memory_mib": worker.memory_mib}
        free = {"cpu_millis": worker.room_cpu, "memory_mib": worker.room_mem}
        for sandbox_class, e in worker.classes.items():
            rows.append(class_row(sandbox_class, e, runtimes, worker_id=worker.worker_id, node=worker.node,
                                  state=worker.state.value, capacity=capacity, free=free,
                                  actors=held.get((id(worker), sandbox_class), 0), worker_actors=worker.holding,
                                  labels=worker.labels))
    rows.sort(key=lambda r: (r["sandbox_class"], r["runtime"], r["worker_id"]))
    return rows


def summaries(pages: list[WorkerPage]) -> list[WorkerSummary]:
    return [w for page in pages for w in page.workers]


# --- the function ------------------------------------------------------------------------------


def test_the_pages_walked_are_the_rows_of_the_log_s_fold_for_every_class_filter():
    projection = fold(HISTORY, Projection())
    runtimes = runtimes_of(projection)
    whole = before_rows(projection)
    assert {r["state"] for r in whole} == {"REGISTERED", "DRAINED"}
    assert worker_rows(projection) == whole
    for classes in CLASSES:
        wanted = [r for r in whole if not classes or r["sandbox_class"] in classes]
        for limit in (1, 2, WORKERS_LIMIT_MAX):
            pages = folded_workers(projection, WorkersQuery(sandbox_classes=classes, limit=limit))
            assert all(len(page.workers) <= limit for page in pages)
            assert summary_rows(summaries(pages), runtimes) == wanted, (classes, limit)
            ids = [w.worker_id for w in summaries(pages)]
            assert ids == sorted({r["worker_id"] for r in wanted})  # by id, each once
            assert all(page.next_after == page.workers[-1].worker_id for page in pages[:-1])
            assert pages[-1].next_after is None
    # a worker's summary: its registration as the fold has it, and its booked actors per class and in all
    w1 = next(w for w in summaries(folded_workers(projection, WorkersQuery())) if w.worker_id == "w-1")
    assert (w1.node, w1.labels, w1.capacity.cpu_millis, w1.free.cpu_millis) == (
        "node-a", {"zone": "a", "disk": "ssd"}, 8000, 8000 - 250 - 500 - 500)
    assert w1.classes == worker_detail(projection, "w-1").classes  # as `worker show`'s answer carries them
    assert [c.sandbox_class for c in w1.classes] == ["gvisor", "microvm"]
    assert (w1.class_actors, w1.actors) == ({"gvisor": 2, "microvm": 1}, 3)
    only = summaries(folded_workers(projection, WorkersQuery(sandbox_classes=("microvm",))))
    assert [(w.worker_id, [c.sandbox_class for c in w.classes], w.class_actors, w.actors) for w in only] == [
        ("m-w", ["microvm"], {"microvm": 0}, 0), ("w-1", ["microvm"], {"microvm": 1}, 3)]


def test_the_first_page_says_the_classes_asked_that_no_registered_worker_runs():
    projection = fold(HISTORY, Projection())
    first = worker_page(projection, WorkersQuery(sandbox_classes=("gvsor", "gvisor", "kata"), limit=1))
    assert (first.unknown_classes, first.classes) == (["gvsor", "kata"], ["gvisor", "microvm"])
    assert [w.worker_id for w in first.workers] == ["w-0"]
    later = worker_page(projection, WorkersQuery(sandbox_classes=("gvsor",), after="w-0"))
    assert (later.unknown_classes, later.classes) == ([], [])  # said once
    assert worker_page(projection, WorkersQuery()).classes == ["gvisor", "microvm"]  # named on every first page
    # a class only an actor has (its index outlives no worker) is no registered worker's
    assert worker_page(fold([created("a-1", sandbox_class="kata")], Projection()),
                       WorkersQuery(sandbox_classes=("kata",))).unknown_classes == ["kata"]


def test_the_counts_follow_the_fold_between_pages():
    """The ids in order and the counts per class are kept per fold position: an event between two pages
    is in the next one."""
    projection = fold(HISTORY, Projection())
    first = worker_page(projection, WorkersQuery(limit=1))
    assert first.next_after == "m-w"
    more = [registered("w-00", GVISOR), created("r-9"), placed("r-9", "w-1", PIN, node="node-a"), booked("w-1", "r-9")]
    for seq, event in enumerate(more, start=projection.seq + 1):
        projection.apply(seq, event)
    rest = summaries(folded_workers(projection, WorkersQuery(after=first.next_after)))
    assert [w.worker_id for w in rest] == ["w-0", "w-00", "w-1", "w-2", "w-3"]
    assert next(w for w in rest if w.worker_id == "w-1").class_actors == {"gvisor": 3, "microvm": 1}


def test_a_page_stops_at_its_bytes_and_fits_the_largest_message_nats_takes():
    """events/schema.py says the arithmetic: a page stops at WORKERS_PAGE_BYTES of rows and always holds
    one; the rest of a page is at most 85 KB."""
    rest = WorkerPage(workers=[], next_after="w" * 128, unknown_classes=["c" * 63] * ACTORS_FILTER_MAX,
                      classes=["c" * 63] * WORKERS_CLASSES_MAX)
    assert len(encode(rest)) < 85_000
    assert WORKERS_PAGE_BYTES + len(encode(rest)) + WORKERS_LIMIT_MAX < (1 << 20) - 176_000
    wide = "\U0001F600"  # 4 bytes in UTF-8
    labels = {f"k{j:02d}" + "a" * 250: wide * 256 for j in range(64)}  # the largest labels: 82 KB
    big = [registered(f"w-{i:02d}", GVISOR, labels=labels) for i in range(20)]
    projection = fold(big, Projection())
    pages = folded_workers(projection, WorkersQuery(limit=WORKERS_LIMIT_MAX))
    assert len(pages) > 1 and [w.worker_id for w in summaries(pages)] == sorted(projection.workers)
    assert all(len(encode(page)) <= WORKERS_PAGE_BYTES + 1_000 for page in pages)
    one = worker_page(projection, WorkersQuery(limit=1))
    assert 80_000 < len(encode(one)) < 90_000  # a row is its registration (labels, classes) and a few numbers


def test_every_worker_s_booked_actors_are_counted_on_its_page():
    """The actors booked per worker and class, counted once per fold position for every page: walked, each
    worker holds its own (what a page costs is bench/views.py's)."""
    events: list = [registered(f"w-{i:03d}", GVISOR, MICROVM, cpu=1_000_000, mem=10_000_000) for i in range(300)]
    for i in range(3000):
        actor_id, worker_id = f"a-{i:05d}", f"w-{i % 300:03d}"
        events += [created(actor_id, cpu=1, mem=1), placed(actor_id, worker_id, PIN, node=f"node-{worker_id}",
                                                             cpu=1, mem=1), booked(worker_id, actor_id)]
    projection = fold(events, Projection())
    walked = folded_workers(projection, WorkersQuery(limit=100))
    assert len(walked) == 3 and len(summaries(walked)) == 300
    assert {w.actors for w in summaries(walked)} == {10} and sum(w.actors for w in summaries(walked)) == 3000


# --- over the bus -----------------------------------------------------------------------------


def cli(*args: str, width: int = 200):
    return asyncio.to_thread(CliRunner().invoke, main, list(args), env={"COLUMNS": str(width)})


COMMANDS = [
    (),
    ("-o", "wide"),
    ("-o", "json"),
    ("--class", "microvm"),
    ("--class", "gvisor", "--class", "microvm", "-o", "json"),
    ("--class", "microvm", "--class", "microvm", "-o", "wide"),
]
UNKNOWN = [("--class", "kata"), ("--class", "gvisor", "--class", "gvsor"), ("--class", "Bad Class"),
           ("--class", "microvm", "--class", "Bad Class", "--class", "kata")]


def said(shown) -> str:
    return " ".join(shown.stderr.split())


async def test_the_endpoint_s_pages_are_the_log_s_rows_and_the_command_prints_alike_without_reading_the_log(
        nats_url, nc, prefix, writer, replicas, monkeypatch):
    last = await asyncio.to_thread(writer.write, *HISTORY)
    at = ("--nats", nats_url, "--prefix", prefix)
    read = log_reads(monkeypatch)

    # no scheduler: the command folds the log, as it did before the endpoint
    folded = {args: await cli("workers", *args, *at) for args in [*COMMANDS, *UNKNOWN]}
    assert all(folded[args].exit_code == 0 for args in COMMANDS), [folded[a].output for a in COMMANDS]
    assert None in read  # the whole log
    projection = fold([event for _, event in await read_log(nc, prefix)], Projection())
    # -o json by worker (and class), printed a page at a time (it held every row to sort them by class first)
    by_worker = sorted(before_rows(projection), key=lambda r: (r["worker_id"], r["sandbox_class"]))
    assert json.loads(folded[("-o", "json")].stdout) == json.loads(json.dumps(to_builtins(by_worker)))
    for args, named in zip(UNKNOWN, ("kata", "gvsor", "Bad Class", "Bad Class")):
        shown = folded[args]
        assert shown.exit_code == 1 and shown.stdout == "", shown.output
        assert (f"error: NOT_FOUND sandbox_class (--class): no worker has registered the sandbox class '{named}' "
                "(registered: gvisor, microvm)") in said(shown), shown.stderr

    await replicas()
    wb = Client(nc, prefix)
    for classes in CLASSES:
        pages = [await wb.workers(WorkersQuery(sandbox_classes=classes, limit=2, min_seq=last))]
        while pages[-1].next_after is not None:
            pages.append(await wb.workers(WorkersQuery(sandbox_classes=classes, limit=2, min_seq=last,
                                                       after=pages[-1].next_after)))
        assert pages == folded_workers(projection, WorkersQuery(sandbox_classes=classes, limit=2)), classes
        # pages of 2, none empty: a cursor only where a worker of the classes follows (microvm: m-w and w-1,
        # then two gvisor workers alone, w-2 and w-3; it gave w-1, and the page after it was empty)
        assert [len(page.workers) for page in pages] == [2] * (len(summaries(pages)) // 2) + [1] * (
            len(summaries(pages)) % 2), classes

    # the command asks the scheduler: what it prints is what the log's fold printed, and it reads no log
    read.clear()
    for args, before in folded.items():
        shown = await cli("workers", *args, *at)
        assert (shown.exit_code, shown.stdout, shown.stderr) == (before.exit_code, before.stdout, before.stderr), args
    assert read == [], read


async def test_the_command_walks_every_page_at_one_min_seq(nats_url, nc, prefix, writer, replicas, monkeypatch):
    """Pages of one worker: the command lists every row, as one page did; a class unknown stops at the
    first page."""
    from warmboot import cmd_views

    await asyncio.to_thread(writer.write, *HISTORY)
    await replicas()
    asked: list[WorkersQuery] = []
    workers = Client.workers

    async def recorded(self, q: WorkersQuery) -> WorkerPage:
        asked.append(q)
        return await workers(self, q)

    monkeypatch.setattr(Client, "workers", recorded)
    at = ("--nats", nats_url, "--prefix", prefix, "-o", "json")
    whole = await cli("workers", *at)
    assert len(asked) == 1 and asked[0].limit == WORKERS_LIMIT_MAX and asked[0].min_seq == await last_seq(nc, prefix)
    asked.clear()
    monkeypatch.setattr(cmd_views, "WORKERS_LIMIT_MAX", 1)
    paged = await cli("workers", *at)
    assert paged.stdout == whole.stdout and len({r["worker_id"] for r in json.loads(whole.stdout)}) == 5
    assert [q.after for q in asked] == [None, "m-w", "w-0", "w-1", "w-2"]
    assert len({q.min_seq for q in asked}) == 1  # every page at the same min_seq
    asked.clear()
    unknown = await cli("workers", "--class", "kata", *at)
    assert unknown.exit_code == 1 and len(asked) == 1, unknown.output


async def test_a_bad_query_is_invalid_naming_its_field_and_writes_nothing(nc, prefix, replicas):
    await replicas()
    before = await last_seq(nc, prefix)
    subject = service_subject(prefix, "scheduler", "workers")
    for body, field in (({"limit": 0}, "limit"), ({"limit": WORKERS_LIMIT_MAX + 1}, "limit"),
                        ({"sandbox_classes": ["Bad Class"]}, "sandbox_classes[0]"),
                        ({"sandbox_classes": ["gvisor"] * (ACTORS_FILTER_MAX + 1)}, "sandbox_classes"),
                        ({"after": "bad id"}, "after"), ({"min_seq": -1}, "min_seq")):
        with pytest.raises(ContractError) as refused:
            await call(nc, subject, body, WorkerPage)
        assert (refused.value.code, refused.value.field) == (ErrorCode.INVALID_ARGUMENT, field), refused.value
    assert await last_seq(nc, prefix) == before  # nothing written
    empty = await call(nc, subject, {}, WorkerPage)  # an empty fold: no rows, no cursor, no classes
    assert (empty.workers, empty.next_after, empty.classes) == ([], None, [])
    assert msgspec.json.decode(encode(WorkersQuery(sandbox_classes=("gvisor",))))["sandbox_classes"] == ["gvisor"]


async def test_a_table_lists_a_page_of_workers_and_says_on_stderr_how_to_list_the_next(nats_url, nc, prefix, writer,
                                                                                       replicas, monkeypatch):
    """`workers` printed every worker: 5,000 lines at 5,000 workers, without being asked (a trial at fleet
    size). A table lists TABLE_LIMIT workers by id (here 2, in pages of 1), its rows sorted as before, and
    says on stderr how to list the next ones (`--continue ID`) or all (`--limit 0`); -o json every one."""
    from warmboot import cmd_views

    await asyncio.to_thread(writer.write, *HISTORY)
    await replicas()
    monkeypatch.setattr(cmd_views, "TABLE_LIMIT", 2)
    monkeypatch.setattr(cmd_views, "WORKERS_LIMIT_MAX", 1)
    at = ("--nats", nats_url, "--prefix", prefix)

    first = await cli("workers", *at)
    assert first.exit_code == 0 and set(first_column(first)) == {"m-w", "w-0"}, first.output
    assert first.stderr == ("note: 2 workers listed, more follow: --continue w-0 lists the next 2 (the same filters), "
                            "--limit 0 every one\n")
    second = await cli("workers", "--continue", "w-0", *at)
    assert set(first_column(second)) == {"w-1", "w-2"} and "--continue w-2 " in second.stderr, second.output
    last = await cli("workers", "--continue", "w-2", *at)
    assert set(first_column(last)) == {"w-3"} and last.stderr == "", last.output
    past = await cli("workers", "--continue", "w-3", *at)
    assert past.stdout == "no workers registered after w-3 (--continue)\n", past.output
    whole = await cli("workers", "--limit", "0", *at)
    rows = whole.stdout.splitlines()[1:]
    assert set(first_column(whole)) == {"m-w", "w-0", "w-1", "w-2", "w-3"} and whole.stderr == ""
    assert rows == sorted(rows, key=lambda line: (line.split()[1], line.split()[2], line.split()[0]))
    as_json = await cli("workers", "-o", "json", *at)
    assert {r["worker_id"] for r in json.loads(as_json.stdout)} == set(first_column(whole)) and as_json.stderr == ""


async def test_a_listing_says_more_follow_only_when_a_worker_of_its_classes_does(nats_url, nc, prefix, writer,
                                                                                 replicas):
    """`workers --class microvm --limit 2` listed m-w and w-1, the two workers that run it, and said more
    follow (`--continue w-1`: w-2 and w-3, of gvisor alone, sort after it); that --continue said "no
    workers registered after w-1". The cursor is given only when a worker of the classes follows: alike
    from the log's fold and from a scheduler."""
    last = await asyncio.to_thread(writer.write, *HISTORY)
    at = ("--nats", nats_url, "--prefix", prefix)

    for source in ("log", "scheduler"):
        if source == "scheduler":
            await replicas()
            page = await Client(nc, prefix).workers(WorkersQuery(sandbox_classes=("microvm",), limit=2, min_seq=last))
            assert ([w.worker_id for w in page.workers], page.next_after) == (["m-w", "w-1"], None)
        both = await cli("workers", "--class", "microvm", "--limit", "2", *at)
        assert (both.exit_code, sorted(first_column(both)), both.stderr) == (0, ["m-w", "w-1"], ""), \
            (source, both.output)
        one = await cli("workers", "--class", "microvm", "--limit", "1", *at)
        assert first_column(one) == ["m-w"] and "--continue m-w " in one.stderr, (source, one.output)
        rest = await cli("workers", "--class", "microvm", "--limit", "1", "--continue", "m-w", *at)
        assert (rest.exit_code, first_column(rest), rest.stderr) == (0, ["w-1"], ""), (source, rest.output)


async def test_more_classes_than_a_query_carries_are_a_usage_error_before_anything_is_sent(
        nats_url, nc, prefix, writer, replicas):
    """`workers` with more than 256 --class values asked the scheduler for every worker and filtered here,
    while --limit counted every worker: a page held fewer rows than the limit, or none, with rows
    following. It is refused as `actor list --class` refuses it: a usage error naming --class, exit 2,
    before any connection (no server at this URL). A class repeated counts once."""
    too_many = [arg for i in range(ACTORS_FILTER_MAX + 1) for arg in ("--class", f"c-{i:03d}")]
    refused = await cli("workers", *too_many, "--nats", "nats://127.0.0.1:1", "--prefix", prefix)
    assert refused.exit_code == 2 and refused.stdout == "", refused.output
    assert ("Invalid value for '--class': at most 256 classes (257 given), what one listing's query carries: "
            "without --class every class is listed") in " ".join(refused.stderr.split()), refused.stderr
    await asyncio.to_thread(writer.write, *HISTORY)
    await replicas()
    at = ("--nats", nats_url, "--prefix", prefix)
    repeated = await cli("workers", *["--class", "microvm"] * (ACTORS_FILTER_MAX + 1), "--limit", "1", *at)
    assert repeated.exit_code == 0 and first_column(repeated) == ["m-w"]
    assert "--continue m-w " in repeated.stderr, repeated.output
