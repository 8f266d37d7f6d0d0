"""Operator views: what they share, and `warmboot workers` (`warmboot explain`, `warmboot fragmentation` and
`warmboot whatif` are warmboot.cmd_explain's, cmd_fragmentation's and cmd_whatif's, on these parts).

Plain aligned columns for people (warmboot.render), `-o wide` for every column and
the full runtime attributes, `-o json` (or `--json`) for machines. A runtime is shown
by its label (events.runtime_id: its name, `name@3f9a1c` when the name is shared, or
`rt-3f9a1c`), the same in every view: each view labels runtimes against the runtimes
of the registered workers (`pin_label`: one the fleet does not run, by the name its stamps
carry, with its digits). explain, fragmentation and whatif ask the scheduler's
endpoints through `warmboot.client` (the answers a resume would get) and take the names
from a scheduler's `runtimes` answer (`asked_runtimes`; the workers' histories folded only
when none says them). whatif reads the runtimes it is given back from that answer too (a
label, an `rt-` id or a name), and the log for the workers it drains alone; explain, every
worker's history for a selector mismatch of several keys (the keys each worker misses);
fragmentation and whatif, the whole log when a runtime no worker runs has snapshots (`stamp_labels`);
workers asks a scheduler replica's fold for its rows, a page at a time (`listed_pages`), and folds
the whole log with the scheduler's own projection (warmboot.audit.Sink) only when none answers,
into the same pages (`folded_workers`): either way it shows what the scheduler sees. Their JSON
is the endpoint's answer with each runtime version's `rt-` id beside it (`with_runtime_ids`).
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Mapping, TypeVar

import click
import msgspec
import nats.errors

from events.codec import to_builtins
from events.compat import compat_key
from events.errors import ContractError, is_busy_reads, unavailable
from events.runtime_id import Runtimes, short_id
from events.schema import CompatVersion, FleetRuntimes, Placement
from events.schema import (ACTORS_FILTER_MAX, WORKERS_LIMIT_MAX, WorkerPage, WorkersQuery,
                           WorkerSummary)  # workers
from events.subjects import event_subject
from warmboot.cli_common import (IntRange, LogUnreadable, ask, last_seq, log_messages, nats_option, prefix_option,
                                 request_field, unread_why, version_text)
from warmboot.client import Client
from warmboot.render import (Column, JsonList, cell_columns, key_values, render_table, terminal_width)

# --- what every view shares -----------------------------------------------------------------------


def output_option(command: Callable) -> Callable:
    """`-o wide|json`, and `--json` as the alias it always was."""
    command = click.option("--json", "as_json", is_flag=True,
                           help="Print JSON instead of text (the same as -o json).")(command)
    return click.option("-o", "--output", type=click.Choice(["wide", "json"]), default=None,
                        help="wide: every column and the full runtime attributes; json: print JSON instead of "
                             "text.")(command)


def classes_option(what: str, callback: Callable | None = None) -> Callable:
    """`--class`, repeatable: the union of the classes given (none: every class). Its parameter keeps
    the name `sandbox_class`, the request field an error names it by (`cli_common.flag_of`); `callback`
    checks each value (`request_field`) where each is sent as a request's class."""
    return click.option("--class", "sandbox_class", multiple=True, callback=callback,
                        help=f"Only this sandbox class. Repeatable: the {what} of any class given.")


def output_mode(output: str | None, as_json: bool) -> str:
    """The output asked for; `-o wide` with `--json` asks for two, a usage error (json won, silently)."""
    if as_json and output == "wide":
        raise click.UsageError("-o wide and --json (the same as -o json) ask for two outputs: give one")
    return "json" if as_json else (output or "table")


# The keys under which a reply names a runtime's version, and the key its id is given under beside it.
VERSION_KEYS = {"version": "runtime_id", "matched_version": "matched_runtime_id"}


def with_runtime_ids(value: Any, sandbox_class: str | None = None) -> Any:
    """`value` (a reply as JSON builtins) with the id of every runtime version it names beside it:
    `runtime_id` beside `version`, `matched_runtime_id` beside `matched_version` (the `rt-` id
    `whatif --drop-runtime` takes and every label's digits are, events.runtime_id), so that JSON
    can be matched with what the views print without a read of the log. A version's class is its
    object's `sandbox_class`, its `sandbox_runtime`'s (a placement's pin), or the nearest enclosing
    one's (`sandbox_class` for a reply that names none: whatif's). An id already given is kept."""
    if isinstance(value, list):
        return [with_runtime_ids(v, sandbox_class) for v in value]
    if not isinstance(value, dict):
        return value
    pin = value.get("sandbox_runtime")
    here = value.get("sandbox_class") or (pin.get("sandbox_class") if isinstance(pin, dict) else None)
    here = here if isinstance(here, str) else sandbox_class
    out = {k: with_runtime_ids(v, here) for k, v in value.items()}
    for key, id_key in VERSION_KEYS.items():
        version = value.get(key)
        if here is not None and id_key not in out and isinstance(version, dict) and "attributes" in version:
            out[id_key] = short_id(compat_key(here, msgspec.convert(version, CompatVersion)))
    return out


def echo_json(value: Any, sandbox_class: str | None = None) -> None:
    """`value` as indented JSON, each runtime version it names given its id (`with_runtime_ids`)."""
    click.echo(json.dumps(with_runtime_ids(value, sandbox_class), indent=2))


def echo_table(rendered, width: int | None) -> None:
    click.echo(rendered.text)
    note = rendered.footnote(width)
    if note:
        click.echo(note)


def runtimes_of(projection: Any) -> Runtimes:
    """Every runtime the projection's workers offer (default, restorable, edges), with its names
    (`offered_runtimes`, what the scheduler answers); and the names its actors' stamps and pins give
    runtimes (`Runtimes.stamp`: a projection of the whole log has them, the fleet's alone none), for
    those no worker runs (`pin_label`)."""
    from services.scheduler.runtimes import offered_runtimes

    runtimes = runtimes_from(offered_runtimes(projection))
    for a in projection.actors.values():
        for stamp in (a.snapshot.stamp if a.snapshot is not None else None, a.pin):
            if stamp is not None:
                r = stamp.runtime
                runtimes.stamp(r.sandbox_class, r.version, r.name)
    return runtimes


def runtimes_from(answer: FleetRuntimes) -> Runtimes:
    """The labels of the runtimes a scheduler's `runtimes` answer (or `offered_runtimes`) names."""
    runtimes = Runtimes()
    for offered in answer.runtimes:
        runtimes.add(offered.sandbox_class, offered.version, run=offered.run)
        for name in offered.names:
            runtimes.add(offered.sandbox_class, offered.version, name, run=offered.run)
    return runtimes


def pin_label(runtimes: Runtimes, sandbox_class: str, version: CompatVersion, name: str | None = None) -> str:
    """A runtime's label in every view: a pin's, a stamp's, a version's a reply names (`name`: the
    one the pin or stamp carries, if any). As the views label the fleet's runtimes (`Runtimes.label`)
    when a worker runs it (a default or restorable runtime), else always `name@3f9a1c`
    (`Runtimes.qualified`; a version given without a name is named as the log's stamps name it, where
    `runtimes` holds them, `runtimes_of`): the fleet does not hold every runtime of that name then (a
    dropped release on several CPU generations), so a name alone would read alike for runtimes that
    are not compatible (the rule of `audit actor`'s timeline, `cmd_audit.timeline_labels`)."""
    known = runtimes.known.get(compat_key(sandbox_class, version))
    if known is not None and known.run:
        return runtimes.label(sandbox_class, version, name)
    return runtimes.qualified(sandbox_class, version, name)


async def fleet_runtimes(nc: Any, prefix: str) -> Runtimes:
    """The runtimes of the registered workers: a scheduler's answer (`asked_runtimes`), else folded from
    their histories (`fleet`)."""
    asked = await asked_runtimes(nc, prefix)
    return asked if asked is not None else runtimes_of(await fleet(nc, prefix))


T = TypeVar("T")
BUSY_ATTEMPTS = 5  # attempts of a view's request a busy replica refuses (`unless_busy`)
BUSY_PAUSE_S = 0.1  # its pause before the n-th attempt: n times this, jittered
LABELS_TIMEOUT_S = 2.0  # how long a command's text waits for the stream to say it may be read


async def unless_busy(ask: Callable[[], Awaitable[T]]) -> T:
    """`await ask()`, a request to a scheduler replica's read-only endpoint in one attempt, asked again
    after a jittered pause while a busy replica refuses it (`events.errors.is_busy_reads`: it answered,
    and would a moment later), up to BUSY_ATTEMPTS attempts in all; any other ContractError at once.
    The views ask in one attempt so that no scheduler (or one of an earlier version) is found at once,
    and then read the log instead: a busy replica's refusal sent them to the whole log."""
    for attempt in range(1, BUSY_ATTEMPTS + 1):
        try:
            return await ask()
        except ContractError as error:
            if not is_busy_reads(error) or attempt == BUSY_ATTEMPTS:
                raise
        await asyncio.sleep(BUSY_PAUSE_S * attempt * (0.5 + random.random()))
    raise AssertionError("unreachable: the last attempt returns or raises")


async def asked_runtimes(nc: Any, prefix: str, min_seq: int | None = None) -> Runtimes | None:
    """The fleet's runtimes as a scheduler replica's fold has them (`<prefix>.scheduler.runtimes`, a
    project addition; once it includes `min_seq`): one request, where the log's answer is every
    worker's history (33,000 events, about 3 s, at 10,000 workers). None when no scheduler answers it
    within LABELS_TIMEOUT_S, in one attempt: none runs, one of an earlier version (no such endpoint),
    or credentials that may not ask it (an operator's of a configuration made before it). The classes
    the registered workers run are `registered_classes(runtimes)`."""
    try:
        client = Client(nc, prefix, timeout=LABELS_TIMEOUT_S, attempts=1)
        answer = await unless_busy(lambda: client.runtimes(min_seq=min_seq))
    except ContractError:
        return None
    return runtimes_from(answer)


def registered_classes(runtimes: Runtimes) -> list[str]:
    """The classes the registered workers (drained ones included) run, from the runtimes they offer (each
    runs its class's default runtime), as `services.scheduler.whatif.registered_classes` names them from
    a projection."""
    return sorted({known.key[0] for known in runtimes.known.values() if known.run})


async def runtime_labels(nc: Any, prefix: str, min_seq: int | None = None) -> Runtimes:
    """The fleet's runtimes, to label those a reply names (`fleet_runtimes`). A reply is printed
    all the same when neither a scheduler says them nor the log can be read (a client's credentials
    may not read it: docs/security.md; NATS refuses the question at once; else the stream's question
    waits at most LABELS_TIMEOUT_S): then every label carries its runtime's digits
    (`Runtimes(complete=False)`), and stderr says so in one line (`readable_fleet`). Once the stream
    has answered, the fleet is read whole, however long that takes. `min_seq`: a scheduler's answer
    at least of that sequence (`asked_runtimes`)."""
    asked = await asked_runtimes(nc, prefix, min_seq)
    if asked is not None:
        return asked
    projection = await readable_fleet(nc, prefix)
    return runtimes_of(projection) if projection is not None else Runtimes(complete=False)


async def readable_fleet(nc: Any, prefix: str, looked_up: str = "runtime names") -> Any | None:
    """The registered workers (`fleet`), or None when the log cannot be read (see `runtime_labels`):
    then one line on stderr says what was not looked up (`looked_up`), and why in a few words
    (`LogUnreadable.why`).
    The command goes on and succeeds: the note must not read as a failure (it was the four lines of
    `last_seq`'s error, asking whether the credentials may read the log: a walkthrough)."""
    try:
        target = await last_seq(nc, prefix, LABELS_TIMEOUT_S)
        return await fleet(nc, prefix, target)
    except (click.ClickException, ContractError, nats.errors.Error) as e:
        click.echo(f"note: {looked_up} not looked up: {unread_why(e)}", err=True)
        return None


async def fleet(nc: Any, prefix: str, target: int | None = None, worker_ids: tuple[str, ...] | None = None) -> Any:
    """The registered workers: their histories alone (`<prefix>.ev.worker.>`) up to `target` (the
    stream's last sequence by default), folded with the scheduler's projection as its fold reads
    them (`Fold.fold_message`: an event of a newer version is unread, the worker drained), a small
    part of the log (no actor, no booking). With `worker_ids`, those workers' histories alone
    (`<prefix>.ev.worker.<id>` each), in the log's order: a few workers of a fleet of any size."""
    from services.scheduler.fold import Fold
    from services.scheduler.projection import Projection

    projection = Projection()
    if target is None:
        target = await last_seq(nc, prefix)
    fold = Fold(nc, prefix, projection)
    if worker_ids is None:
        async for seq, subject, headers, data in log_messages(nc, prefix, event_subject(prefix, "worker", ">"),
                                                              target):
            fold.fold_message(seq, subject, headers, data)
        return projection
    messages = [message for worker_id in dict.fromkeys(worker_ids)
                async for message in log_messages(nc, prefix, event_subject(prefix, "worker", worker_id), target)]
    for seq, subject, headers, data in sorted(messages, key=lambda message: message[0]):
        fold.fold_message(seq, subject, headers, data)
    return projection


async def check_class_named(nc: Any, prefix: str, sandbox_class: str) -> None:
    """NOT_FOUND (field `sandbox_class`, `--class`) unless a registered worker runs the class, as
    whatif's endpoint checks it (`services.scheduler.whatif.check_class`): the message names the
    classes the fleet runs, or, when the log cannot be read (a client's credentials may not), none."""
    from services.scheduler.whatif import check_class, unknown_class

    try:
        projection = await fleet(nc, prefix, await last_seq(nc, prefix, LABELS_TIMEOUT_S))
    except (click.ClickException, ContractError, nats.errors.Error):
        raise unknown_class(sandbox_class, None) from None
    check_class(projection, sandbox_class)


def mib(value: int) -> str:
    return f"{value}Mi"


def millis(value: int) -> str:
    return f"{value}m"


NAMES_SHOWN = 3  # of a group of workers passed over for the same reasons, the ids named at most


def named_few(ids: list[str], names: int = NAMES_SHOWN) -> str:
    """At most `names` of `ids`, in their order, and how many more: `w-1, w-2, w-3 (+18 more)`."""
    more = len(ids) - names
    return ", ".join(ids[:names]) + (f" (+{more} more)" if more > 0 else "")


def by_label(runtimes: Runtimes, sandbox_class: str, version: CompatVersion) -> tuple[str, str, str]:
    """A runtime row's place in a table: by class, then label (its id between equal labels)."""
    return sandbox_class, pin_label(runtimes, sandbox_class, version), short_id(compat_key(sandbox_class, version))


def named_by_stamps_only(versions: Iterable[tuple[str, CompatVersion]], runtimes: Runtimes) -> bool:
    """Whether one of `versions` ((class, version) of runtimes a view shows with snapshots stamped with
    them) is one no worker runs and `runtimes` holds no name for (a dropped release, a removed
    worker's): its name is then in the log's stamps alone."""
    for sandbox_class, version in versions:
        key = compat_key(sandbox_class, version)
        known = runtimes.known.get(key)
        if (known is None or not known.run) and not runtimes.stamped.get(key):
            return True
    return False


async def stamp_labels(nc: Any, prefix: str, runtimes: Runtimes, versions: Iterable[tuple[str, CompatVersion]]
                       ) -> Runtimes:
    """`runtimes` (the fleet's: `runtime_labels`) to label a view's runtimes with; where one of `versions`
    is named by stamps only (`named_by_stamps_only`), the whole log's, folded as `actor list` folds it, so
    that it reads as there and in `actor show`, by the name its stamps carry (`gvisor-v1@3f9a1c`, not
    `rt-3f9a1c`: a trial). A log that cannot be read so far leaves those by id, said on stderr."""
    from warmboot.audit import Sink
    from warmboot.cli_common import replay

    if not runtimes.complete or not named_by_stamps_only(versions, runtimes):
        return runtimes
    try:
        return runtimes_of((await replay(nc, prefix, Sink(), True)).projection)
    except (click.ClickException, ContractError, nats.errors.Error) as e:
        click.echo(f"note: the names the log's stamps give runtimes no worker runs not looked up: {unread_why(e)}",
                   err=True)
        return runtimes


def decision_fields(d: Placement, runtimes: Runtimes, wide: bool) -> list[tuple[str, str]]:
    stamp = d.sandbox_runtime
    fields = [
        ("DECISION", f"{d.action.value} at {d.fidelity.value}" if d.fidelity.value != "NONE" else
         f"{d.action.value} (cold boot)"),
        ("WORKER", d.worker_id),
        ("NODE", d.node),
        ("RUNTIME", runtimes.label(stamp.sandbox_class, stamp.version, stamp.name)),
    ]
    matched = d.matched_version
    if matched is not None:
        fields.append(("MATCHED", runtimes.label(stamp.sandbox_class, matched)))
    if d.snapshot_id:
        fields.append(("SNAPSHOT", d.snapshot_id))
    if d.fallback:
        f = d.fallback
        fields.append(("FALLBACK", f"{f.reason.value} ({f.from_fidelity.value} -> {f.to_fidelity.value})"))
    fields.append(("BOOKED", f"{millis(d.booked.cpu_millis)} cpu, {mib(d.booked.memory_mib)} memory"))
    if wide:
        fields.append(("RUNTIME ID", short_id(runtimes.add(stamp.sandbox_class, stamp.version))))
        fields.append(("ATTRIBUTES", version_text(stamp.version)))
    return fields


# --- workers ------------------------------------------------------------------------------------------


def edges_of(entry: Any) -> list[Any]:
    """The compat versions an entry's runtimes accept through `compatible_versions`: its default's,
    then its restorable ones', each once."""
    seen: dict[Any, Any] = {}
    for runtime in (entry.default, *entry.restorable):
        for edge in runtime.edges:
            seen.setdefault(edge.key, edge)
    return list(seen.values())


def runtime_entries(sandbox_class: str, entry: Any, runtimes: Runtimes) -> list[dict]:
    """A class entry's runtimes, its default first, then its restorable ones: each with its label, its
    `rt-` id, its role, its version, and the versions its own `compatible_versions` edges accept (by
    label and by id): which runtime an edge belongs to, the runtime a snapshot so restored runs on."""
    return [{
        "role": role,
        "runtime": runtimes.label(sandbox_class, r.compat.version, r.name),
        "runtime_id": short_id(r.compat.key),
        "version": to_builtins(r.compat.version),
        "resumes_from": [runtimes.label(sandbox_class, e.version) for e in r.edges],
        "resumes_from_ids": [short_id(e.key) for e in r.edges],
    } for role, r in (("default", entry.default), *(("restorable", r) for r in entry.restorable))]


def resumes_from_text(row: dict) -> str:
    """A row's RESUMES FROM: the versions each of its runtimes accepts through its edges, after that
    runtime's label (`runsc-2024.11: runsc-2024.05; runsc-2024.05: runsc-2024.01`), so that an edge of
    a restorable runtime does not read as the default's (the column listed them all as one: a
    walkthrough); `-` if none has an edge."""
    return "; ".join(f"{r['runtime']}: {','.join(r['resumes_from'])}" for r in row["runtimes"]
                     if r["resumes_from"]) or "-"


def class_runtime_fields(row: dict, wide: bool = False) -> list[tuple[str, str]]:
    """A `worker_rows` row's runtimes as `worker show` fields: DEFAULT and RESTORABLE by label, with
    `wide` each with its `rt-` id, the restorable ones as the default (`runsc-v2 (rt-3f9a1c)`), and
    RESUMES FROM (`resumes_from_text`); with `wide`, the default's ATTRIBUTES too."""
    cls = row["sandbox_class"].upper()
    named = [f"{r['runtime']} ({r['runtime_id']})" if wide else r["runtime"] for r in row["runtimes"]]
    fields = [(f"{cls} DEFAULT", named[0]),
              (f"{cls} RESTORABLE", ", ".join(named[1:]) or "-"),
              (f"{cls} RESUMES FROM", resumes_from_text(row))]
    if wide:
        fields.append((f"{cls} ATTRIBUTES", version_text(_version(row["default_runtime"]))))
    return fields


def worker_rows(projection: Any, runtimes: Runtimes | None = None) -> list[dict]:
    """One row per (worker, sandbox class) of the projection's registered workers (`summary_rows` of
    every page `services.scheduler.worker_list.worker_page` makes, what a scheduler answers), labelled
    by `runtimes` (`runtimes_of(projection)` by default)."""
    pages = folded_workers(projection, WorkersQuery(limit=WORKERS_LIMIT_MAX))
    return summary_rows([w for page in pages for w in page.workers], runtimes or runtimes_of(projection))


def summary_rows(summaries: list[WorkerSummary], runtimes: Runtimes) -> list[dict]:
    """One row per (worker, sandbox class) of `summaries` (a scheduler's `workers` pages, or the fold's:
    `worker_rows`), sorted by class, default runtime and worker. A row's `actors` counts the actors of
    its class booked on the worker (the table's ACTORS), its `worker_actors` those of every class (the
    worker's whole count, on each of its rows): a worker's count was printed on each of its class rows,
    as if each held them all (a walkthrough). Each runtime has its `rt-` id beside its label
    (`runtime_id`, `restorable_ids`); `resumes_from` lists the edges of all its runtimes as one,
    `runtimes` each runtime with its own (`runtime_entries`): keys added, none renamed, for the JSON a
    script reads."""
    from services.scheduler.interner import Interner

    intern = Interner()  # the summaries' classes as the fold's records, which the views' helpers read
    # a fleet's workers share a few registrations' classes: each made into entries, and labelled, once
    made: dict[tuple, dict[str, Any]] = {}
    labelled: dict[tuple[str, int], dict] = {}
    rows = []
    for w in summaries:
        classes = tuple(w.classes)
        entries = made.get(classes)
        if entries is None:
            entries = made[classes] = intern.entries(
                (c.sandbox_class, intern.runtime(c.sandbox_class, c.default_runtime),
                 tuple(intern.runtime(c.sandbox_class, r) for r in c.restorable_runtimes)) for c in classes)
        capacity, free = to_builtins(w.capacity), to_builtins(w.free)
        for sandbox_class, entry in entries.items():
            rows.append(class_row(sandbox_class, entry, runtimes, worker_id=w.worker_id, node=w.node,
                                  state=w.state.value, capacity=capacity, free=free,
                                  actors=w.class_actors.get(sandbox_class, 0), worker_actors=w.actors,
                                  labels=w.labels, labelled=labelled, node_token=w.node_token))
    rows.sort(key=lambda r: (r["sandbox_class"], r["runtime"], r["worker_id"]))
    return rows


def folded_workers(projection: Any, query: WorkersQuery) -> list[WorkerPage]:
    """Every page of `query` from a fold of the log (`worker_page`, what a scheduler answers)."""
    from services.scheduler.worker_list import worker_page

    return folded_pages(lambda q: worker_page(projection, q), query)


TABLE_LIMIT = 500  # rows a listing's table shows unless --limit says: a page, --continue for the next


def paging_options(what: str, cursor: str, query: type) -> Callable[[Callable], Callable]:
    """`--limit N` and `--continue ID` of a listing (`workers`, `actor list`), as kubectl's: a table lists
    TABLE_LIMIT of `what` unless asked (50,000 lines of `actor list` on a terminal, at fleet size: a user
    trial), -o json every one; a listing cut short says on stderr how to ask for the next page. A
    --continue that is not an id is a usage error, as the `query`'s `after` takes it (sent, the
    scheduler's refusal read as no scheduler, and the whole log was folded)."""
    def options(command: Callable) -> Callable:
        command = click.option(
            "--continue", "after", default=None, metavar=cursor, callback=request_field(query, "after"),
            help=f"List the {what} after this id (by id): the one a listing cut short names, for the next "
                 "page (with the same filters).")(command)
        return click.option(
            "--limit", type=IntRange(min=0), default=None,
            help=f"List at most N {what} (0: every one). Default: {TABLE_LIMIT} in a table, every one with -o "
                 "json; a listing cut short says on stderr how to list the next page (--continue).")(command)
    return options


def listing_limit(limit: int | None, mode: str) -> int:
    """The rows a listing shows at most (0: all): --limit, else TABLE_LIMIT in a table, all in JSON."""
    return limit if limit is not None else (0 if mode == "json" else TABLE_LIMIT)


async def listed_pages(ask: Callable[[Any], Awaitable[Any]], folded: Callable[[], Awaitable[Callable[[Any], Any]]],
                       query: Any, limit: int, page_max: int, rows: Callable[[Any], list]
                       ) -> AsyncIterator[tuple[Any, bool]]:
    """The pages of `query`, `limit` rows in all at most (0: every one), each yielded as it comes, so that
    a caller prints it before the next is asked (its memory is a page's, not the listing's); each asked of
    a scheduler replica (`ask`, in one attempt, again while a busy one refuses it: `unless_busy`). Once one
    is not answered, it and the rest from the log's fold (`folded()`, made once: a query's page from it), from
    where the answered ones stopped. Yields (page, whether it is the log's)."""
    page_of: Callable[[Any], Any] | None = None
    left = limit
    while True:
        asked = msgspec.structs.replace(query, limit=min(page_max, left) if limit else page_max)
        page = None
        if page_of is None:
            try:
                page = await unless_busy(lambda: ask(asked))
            except ContractError:
                page_of = await folded()
        if page is None:
            page = page_of(asked)
        yield page, page_of is not None
        left -= len(rows(page))
        if page.next_after is None or (limit and left <= 0):
            return
        query = msgspec.structs.replace(query, after=page.next_after)


def unless_folded(ask: Callable[[Any], Awaitable[Any]], fold: list) -> Callable[[Any], Awaitable[Any]]:
    """`ask` (a listing's scheduler endpoint), until the log's fold is made (`fold`: a listing's, once no
    scheduler answered a page of it): then refused at once, so that `listed_pages` goes to that fold
    without waiting for a scheduler that did not answer the page before."""
    async def asking(query: Any) -> Any:
        if fold:
            raise unavailable("no scheduler answered this listing's page before: the log's fold answers")
        return await ask(query)
    return asking


class Walked:
    """What `walk_listing` walked: the rows counted, the cursor of the page after the last one listed
    (None: none follows), and the runtimes' labels the rows were labelled with."""

    def __init__(self) -> None:
        self.count = 0
        self.next_after: str | None = None
        self.runtimes: Runtimes | None = None


async def walk_listing(nc: Any, prefix: str, what: str, mode: str, query: Any, most: int, page_max: int,
                       endpoint: Callable[[Client], Callable[[Any], Awaitable[Any]]],
                       page_of: Callable[[Any, Any], Any], rows_of: Callable[[Any], list],
                       first: Callable[[Any], None], first_apart: bool,
                       each: Callable[[Any, bool, Runtimes, JsonList | None], None]) -> Walked:
    """The walk of a listing (`workers`, `actor list`) over its pages (`listed_pages`), `most` rows at
    most (0: all), each page asked of a scheduler replica (`endpoint(client)`) at least at the log's end
    as it is now, else of the log folded here once (`page_of(projection, query)`); `first(page)` told the
    first page without a cursor, which says what of the filters matches nothing (asked apart, one row of
    it, when `first_apart`: a --continue); `each(page, from_log, runtimes, listed)` told every page in turn,
    to put its rows in the caller's table, or in `listed` (-o json: printed a page at a time, before the
    next is asked, `print_page`), with a count on a terminal's stderr meanwhile (`listing_progress`)."""
    from warmboot.audit import Sink
    from warmboot.cli_common import replay_for

    try:  # at least the log as it is now, as whatif asks; a client's credentials may not read it: without
        target = await last_seq(nc, prefix, LABELS_TIMEOUT_S)
    except LogUnreadable:
        target = 0
    walked = Walked()
    fold: list[Callable[[Any], Any]] = []  # made once, for the filters' page and the walk

    async def folded() -> Callable[[Any], Any]:  # no scheduler answers: the whole log, here
        if not fold:
            projection = (await replay_for(nc, prefix, what, Sink(), mode != "json")).projection
            walked.runtimes = runtimes_of(projection)
            fold.append(lambda q: page_of(projection, q))
        return fold[0]

    asking = endpoint(Client(nc, prefix, timeout=LABELS_TIMEOUT_S, attempts=1))
    begin = msgspec.structs.replace(query, min_seq=target or None)
    if first_apart:
        async for page, _ in listed_pages(asking, folded, msgspec.structs.replace(begin, after=None), 1, 1, rows_of):
            first(page)
    printed: list[str] = []
    listed = JsonList(printed.append) if mode == "json" else None
    last = None
    with listing_progress(what, mode) as progress:
        task = progress.add_task("", total=None)
        async for page, from_log in listed_pages(unless_folded(asking, fold), folded, begin, most, page_max, rows_of):
            if last is None and query.after is None:
                first(page)
            if walked.runtimes is None:
                walked.runtimes = await runtime_labels(nc, prefix, target or None)
            each(page, from_log, walked.runtimes, listed)
            walked.count += len(rows_of(page))
            last = page
            await print_page(printed)
            progress.update(task, completed=walked.count)
    if listed is not None:
        listed.close()
        await print_page(printed)
    walked.next_after = last.next_after
    return walked


async def print_page(printed: list[str]) -> None:
    """Print what a page gave (`printed`, emptied) from a thread: the connection's loop goes on meanwhile,
    answering the server's pings while stdout is slow to take it (`-o json | less`, read for minutes:
    the server would close a connection that long silent, and the next page be asked of none)."""
    if printed:
        text = "".join(printed)
        printed.clear()
        await asyncio.to_thread(click.echo, text, nl=False)


def listing_progress(what: str, mode: str) -> Any:
    """A count of the rows listed so far, on stderr while a listing walks its pages, where someone
    watches: stderr a terminal, and the rows not printed there as they come (a table is laid out at the
    end; JSON to a terminal is its own progress). `actor list --limit 0` took 14 s at 50,000 actors
    without a word."""
    from rich.console import Console
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    from warmboot.cli_common import stderr_is_terminal

    return Progress(TextColumn(f"listing {what}"), TextColumn("{task.completed:,}"), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True,
                    disable=not stderr_is_terminal() or (mode == "json" and sys.stdout.isatty()))


def cut_short(what: str, listed: int, next_after: str | None, limit: int) -> str | None:
    """What a listing stopped at its limit with rows left says on stderr: how to list the next page."""
    if next_after is None or not limit or listed < limit:
        return None
    return (f"note: {listed:,} {what} listed, more follow: --continue {next_after} lists the next {limit:,} "
            "(the same filters), --limit 0 every one")


def folded_pages(page_of: Callable[[Any], Any], query: Any) -> list:
    """Every page of `query` that `page_of` makes from a fold of the log (`worker_page`, `actor_page`:
    what a scheduler answers), each from the one before's `next_after`."""
    pages = [page_of(query)]
    while pages[-1].next_after is not None:
        pages.append(page_of(msgspec.structs.replace(query, after=pages[-1].next_after)))
    return pages


def unknown_class_asked(first: WorkerPage, asked: tuple[str, ...], sent: tuple[str, ...]) -> str | None:
    """The first class of `asked` (`workers --class`) no registered worker runs, as `first` (a first page
    of `workers`, asked for the classes `sent`) says it: one sent, if the page names it unknown; one not
    sent (not a class's name), if the classes run do not name it."""
    for sandbox_class in dict.fromkeys(asked):
        if sandbox_class in first.unknown_classes if sandbox_class in sent else sandbox_class not in first.classes:
            return sandbox_class
    return None


def class_row(sandbox_class: str, entry: Any, runtimes: Runtimes, *, worker_id: str, node: str, state: str,
              capacity: dict, free: dict, actors: int, worker_actors: int, labels: Mapping[str, str],
              labelled: dict[tuple[str, int], dict] | None = None, node_token: str | None = None) -> dict:
    """A worker's row of `warmboot workers` for one of its classes (`entry`: the fold's record of it), as
    JSON values; `actors` counts its actors of this class, `worker_actors` those of every class. The one
    definition of a row: `worker_rows` and `worker show` (`cmd_worker.detail_view`) both make it here.
    `labelled`: the runtime fields of the entries labelled already (an interned entry's, kept while it
    lives), shared by the rows of a fleet whose workers run the same runtimes (read, never changed)."""
    key = (sandbox_class, id(entry))
    fields = labelled.get(key) if labelled is not None else None
    if fields is None:
        fields = runtime_fields(sandbox_class, entry, runtimes)
        if labelled is not None:
            labelled[key] = fields
    return {
        "sandbox_class": sandbox_class,
        "worker_id": worker_id,
        "node": node,
        "state": state,
        **fields,
        "capacity": dict(capacity),
        "free": dict(free),
        "actors": actors,  # of this class
        "worker_actors": worker_actors,  # of every class: the worker's whole count
        "labels": dict(labels),
        "node_token": node_token,  # the disk of its node it registered (docs/contract.md, rule 5)
    }


def runtime_fields(sandbox_class: str, entry: Any, runtimes: Runtimes) -> dict:
    """The runtime fields of a `class_row`, in its order: the default's label, id and version, the
    restorable runtimes', the edges' (all its runtimes' as one), and each runtime with its own."""
    default = entry.default
    edges = edges_of(entry)
    return {
        "runtime": runtimes.label(sandbox_class, default.compat.version, default.name),
        "runtime_id": short_id(default.compat.key),
        "default_runtime": to_builtins(default.compat.version),
        "restorable": [runtimes.label(sandbox_class, r.compat.version, r.name) for r in entry.restorable],
        "restorable_ids": [short_id(r.compat.key) for r in entry.restorable],
        "restorable_runtimes": [to_builtins(r.compat.version) for r in entry.restorable],
        # the one-way edges: versions whose memory snapshots it also resumes (compatible_versions)
        "resumes_from": [runtimes.label(sandbox_class, e.version) for e in edges],
        "resumes_from_ids": [short_id(e.key) for e in edges],
        "resumes_from_versions": [to_builtins(e.version) for e in edges],
        "runtimes": runtime_entries(sandbox_class, entry, runtimes),  # each with its own edges
    }


WORKER_COLUMNS = [  # `drop`: the highest gives way first when the terminal is narrow
    Column("WORKER", lambda r: r["worker_id"]),
    Column("CLASS", lambda r: r["sandbox_class"], drop=3),
    Column("RUNTIME", lambda r: r["runtime"], drop=1,
           narrow=Column("RUNTIME", lambda r: r["runtime_id"], about="as ids")),
    Column("RESTORABLE", lambda r: ",".join(r["restorable"]) or "-", drop=4,
           narrow=Column("RESTORABLE", lambda r: str(len(r["restorable"])), right=True, about="as a count")),
    Column("STATE", lambda r: r["state"]),
    Column("CPU FREE", lambda r: millis(r["free"]["cpu_millis"]), right=True),
    Column("MEM FREE", lambda r: mib(r["free"]["memory_mib"]), right=True),
    Column("ACTORS", lambda r: str(r["actors"]), right=True, drop=2),
    Column("NODE", lambda r: r["node"], drop=5),
    Column("NODE TOKEN", lambda r: r["node_token"] or "-", wide=True),
    Column("CPU", lambda r: millis(r["capacity"]["cpu_millis"]), right=True, wide=True),
    Column("MEM", lambda r: mib(r["capacity"]["memory_mib"]), right=True, wide=True),
    Column("RUNTIME ID", lambda r: r["runtime_id"], wide=True),
    Column("RESTORABLE IDS", lambda r: ",".join(r["restorable_ids"]) or "-", wide=True),
    Column("RESUMES FROM", resumes_from_text, wide=True),
    Column("LABELS", lambda r: key_values(r["labels"]), wide=True),
    Column("ATTRIBUTES", lambda r: version_text(_version(r["default_runtime"])), wide=True),
]


def _version(builtins: dict) -> CompatVersion:
    return msgspec.convert(builtins, CompatVersion)


def render_workers(rows: list[dict], width: int | None, wide: bool = False):
    return render_table(WORKER_COLUMNS, rows, width, wide)


def classes_a_query_carries(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    """click callback of `workers --class`: at most ACTORS_FILTER_MAX classes (without repeats), what a
    `WorkersQuery` carries, else a usage error naming the option (exit 2), as `actor list --class` refuses
    more. More were filtered here, from pages of every worker, while --limit counted every worker: a page
    could list fewer rows than the limit, or none, with rows following. A name that is no class's is left
    to the first page, which names the classes the fleet runs (`unknown_class_asked`)."""
    given = len(dict.fromkeys(values))
    if given > ACTORS_FILTER_MAX:
        raise click.BadParameter(f"at most {ACTORS_FILTER_MAX:,} classes ({given:,} given), what one listing's query "
                                 "carries: without --class every class is listed")
    return values


@click.command()
@classes_option("rows", classes_a_query_carries)
@paging_options("workers", "WORKER", WorkersQuery)
@nats_option
@prefix_option
@output_option
def workers(sandbox_class: tuple[str, ...], limit: int | None, after: str | None, nats_url: str, prefix: str,
            output: str | None, as_json: bool) -> None:
    """Registered workers by class and runtime, with free capacity and drain state.

    A row per worker and class: ACTORS counts the actors of that class booked on the worker
    (-o json: `actors`; `worker_actors` counts those of every class, the worker's whole count).
    Asked of a scheduler replica, a page at a time (`scheduler.workers`: pages are not one snapshot, a
    worker registered meanwhile is listed if its id sorts after those listed already); only when none
    answers, the log folded with the scheduler's projection: either way, what the scheduler sees.
    A --class no registered worker runs is an error naming the classes they run, exit status 1,
    as whatif's is; more than 256 classes is a usage error (exit 2), as actor list's is.

    A table lists the first 500 workers by id (--limit), their rows sorted by class, runtime and
    worker, and then says on stderr how to list the next ones (--continue ID); -o json lists every
    one, by worker id (and class), printed a page at a time.
    """
    from warmboot.cmd_lifecycle import CLASS_RE

    from services.scheduler.whatif import unknown_class
    from services.scheduler.worker_list import worker_page

    mode = output_mode(output, as_json)
    most = listing_limit(limit, mode)
    asked = tuple(dict.fromkeys(sandbox_class))
    # the classes a query may carry; a name that is none (`Bad Class`) is unknown: one row says the classes run
    sent = tuple(c for c in asked if CLASS_RE.match(c))
    query = WorkersQuery(sandbox_classes=sent, after=after)
    page_max = WORKERS_LIMIT_MAX if sent == asked else 1
    columns, cells_of = cell_columns(WORKER_COLUMNS)

    def check_classes(first: WorkerPage) -> None:
        named = unknown_class_asked(first, asked, sent)
        if named is not None:  # a typo names the classes the fleet runs, as whatif's does (`check_class`)
            raise unknown_class(named, first.classes)

    table: list[tuple[tuple, tuple[str, ...]]] = []  # (sort key, cells) of each row, not the row

    def each(page: WorkerPage, from_log: bool, runtimes: Runtimes, listed: JsonList | None) -> None:
        rows = summary_rows(page.workers, runtimes)
        if listed is not None:  # by worker, as the pages come: the same order whatever a page holds
            rows.sort(key=lambda row: (row["worker_id"], row["sandbox_class"]))
        for row in rows:  # (a page's workers carry the classes asked alone)
            if listed is not None:
                listed.add(with_runtime_ids(row))
            else:
                table.append(((row["sandbox_class"], row["runtime"], row["worker_id"]), cells_of(row)))

    async def work(nc: Any) -> Walked:  # (only a page asked without --continue says the classes run)
        return await walk_listing(nc, prefix, "workers", mode, query, most, page_max, lambda c: c.workers,
                                  worker_page, lambda page: page.workers, check_classes,
                                  bool(asked) and after is not None, each)

    walked = ask(nats_url, work)
    count, next_after = walked.count, walked.next_after
    more = cut_short("workers", count, next_after, most)
    if mode != "json":
        if not table:
            click.echo(f"no workers registered after {after} (--continue)" if after else "no workers registered")
        else:
            table.sort(key=lambda row: row[0])
            width = terminal_width()
            echo_table(render_table(columns, [cells for _, cells in table], width, mode == "wide"), width)
    if more is not None:
        click.echo(more, err=True)
