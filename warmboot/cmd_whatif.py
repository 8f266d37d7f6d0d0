"""`warmboot whatif`: before a step of a rolling upgrade, what dropping runtimes or draining workers of one
class would strand (the scheduler's `whatif` answer, which writes nothing), per runtime and per actor,
asked again for fewer actors when an answer would not fit a message (`fitting_whatif`). The views' shared
parts are `warmboot.cmd_views`'."""

from __future__ import annotations

from typing import Any

import click
import msgspec

from events.codec import to_builtins
from events.compat import compat_key
from events.errors import ContractError
from events.runtime_id import PREFIX as ID_PREFIX
from events.runtime_id import Runtimes, UnknownRuntime, short_id
from events.schema import (WHATIF_LIMIT_MAX, CompatVersion, ErrorCode, Location, StrandedActor, WhatIf,
                           WhatIfAnswer)
from events.states import WorkerState
from services.endpoints import past_max_payload
from warmboot.cli_common import (IntRange, ask, last_seq, min_seq_option, nats_option, prefix_option, request_field,
                                 version_text)
from warmboot.client import Client
from warmboot.cmd_views import (asked_runtimes, by_label, echo_json, fleet, mib, millis, named_few, output_mode,
                                output_option, pin_label, registered_classes, runtimes_of, stamp_labels)
from warmboot.render import Column, render_fields, render_table, terminal_width


def resolve_drops(runtimes: Runtimes, texts: tuple[str, ...], sandbox_class: str) -> list[CompatVersion]:
    """The versions `--drop-runtime` names: a label or an `rt-` id names one runtime, a name every
    runtime of the class that carries it (one release on several CPU generations). An unknown
    runtime, or an id several runtimes share, is an error naming the option; the runtimes known are
    those the registered workers offer, so one none offers (a dropped release, whose stamps the
    views still label) is said to have nothing to drop, not left to read as a typo (a trial)."""
    versions: dict[Any, CompatVersion] = {}
    for text in texts:
        try:
            if text.startswith(ID_PREFIX) or "@" in text:
                found = [runtimes.resolve_one(text, sandbox_class)]
            else:
                found = runtimes.resolve(text, sandbox_class)
        except UnknownRuntime as e:
            said = str(e) if e.known is None else (  # none of the fleet's: why that is refused, and what it offers
                f"no runtime of class {sandbox_class} is named {text!r} among those its registered workers offer "
                "(as default, restorable or compatible version): a runtime none offers has nothing to drop (a "
                "release dropped already: its memory snapshots are stranded, `warmboot fragmentation` counts them; "
                f"else a typing error); offered: {', '.join(e.known) or 'none'}")
            raise click.BadParameter(said, param_hint="'--drop-runtime'") from None
        for known in found:
            versions.setdefault(known.key, known.version)
    return list(versions.values())


def check_drains(projection: Any, workers: tuple[str, ...], sandbox_class: str) -> None:
    """Every `--drain` names a registered worker of the class (`services.scheduler.whatif.check_drains`,
    as the endpoint checks it), said before the question is sent."""
    from services.scheduler.whatif import check_drains as refused

    try:
        refused(projection, sandbox_class, workers)
    except ContractError as e:
        raise click.BadParameter(e.message, param_hint="'--drain'") from None


def no_op_notes(projection: Any, drop: tuple[str, ...], drain: tuple[str, ...]) -> list[str]:
    """What of a whatif's question changes nothing, said as kubectl says a no-op: the workers to
    drain that are drained already, or a question that supposes nothing at all."""
    if not drop and not drain:
        return ["nothing is dropped or drained (--drop-runtime, --drain): before and after are the fleet as it is"]
    already = sorted({w for w in drain if projection.workers[w].state is WorkerState.DRAINED})
    if not already:
        return []
    # named a few (DRAINS_NAMED), as DRAIN is: a whole generation asked (2,320 workers) named 654 on one line
    return [f"{named_few(already, DRAINS_NAMED)} {'is' if len(already) == 1 else 'are'} drained already: the "
            f"forecast counts {'it' if len(already) == 1 else 'them'} out before and after"]


COUNT_COLUMNS = [
    Column("SNAPSHOTS", lambda r: r[0]),
    Column("STRANDED", lambda r: str(r[1].stranded_snapshots), right=True),
    Column("MEMORY RESTORABLE", lambda r: str(r[1].memory_restorable_snapshots), right=True),
]


def forecast_columns(sandbox_class: str, runtimes: Runtimes, dropped: set) -> list[Column]:
    """Columns of RuntimeForecast rows: before and after, side by side (CPU gives way first, then labels)."""

    def key(r: Any) -> Any:
        return compat_key(sandbox_class, r.version)

    return [
        Column("RUNTIME", lambda r: pin_label(runtimes, sandbox_class, r.version), drop=1,
               narrow=Column("RUNTIME", lambda r: short_id(key(r)), about="as ids")),
        Column("DROPPED", lambda r: "yes" if key(r) in dropped else "-"),
        Column("WORKERS", lambda r: str(r.workers_before), right=True),
        Column("WORKERS AFTER", lambda r: str(r.workers_after), right=True),
        Column("MEM FREE", lambda r: mib(r.free_before.memory_mib), right=True),
        Column("MEM FREE AFTER", lambda r: mib(r.free_after.memory_mib), right=True),
        Column("CPU FREE", lambda r: millis(r.free_before.cpu_millis), right=True, drop=2),
        Column("CPU FREE AFTER", lambda r: millis(r.free_after.cpu_millis), right=True, drop=3),
        Column("RUNTIME ID", lambda r: short_id(key(r)), wide=True),
        Column("ATTRIBUTES", lambda r: version_text(r.version), wide=True),
    ]


def stranded_columns(runtimes: Runtimes, title: str = "NEWLY STRANDED") -> list[Column]:
    return [
        Column(title, lambda s: s.actor_id),
        Column("STAMP", lambda s: pin_label(runtimes, s.stamp.sandbox_class, s.stamp.version, s.stamp.name), drop=1,
               narrow=Column("STAMP", lambda s: short_id(compat_key(s.stamp.sandbox_class, s.stamp.version)),
                             about="as ids")),
        Column("STAMP ID", lambda s: short_id(compat_key(s.stamp.sandbox_class, s.stamp.version)), wide=True),
        # why it is stranded: a LOCAL image restores only on its node (found by a walkthrough: a drain
        # listed actors whose runtime stayed, and nothing said their images were on the drained nodes)
        Column("IMAGE", image_place),
    ]


def image_place(stranded: StrandedActor) -> str:
    if stranded.location is Location.LOCAL:
        return f"LOCAL on {stranded.node or '?'}"
    return stranded.location.value if stranded.location is not None else "-"


async def whatif_labels(nc: Any, prefix: str, runtimes: Runtimes, sandbox_class: str, answer: WhatIfAnswer
                        ) -> Runtimes:
    """The labels of whatif's runtimes: the fleet's, with the names the stamps of the actors it lists
    carry; for a runtime no live worker accepts before the step (its snapshots stranded already) and
    none of those names, the log's (`stamp_labels`). It said `rt-279f31` where fragmentation and
    `actor list` said `gvisor-2026-10@279f31` (a trial of a rolling upgrade)."""
    for stranded in (*answer.newly_stranded, *answer.created_newly_stranded):
        runtimes.stamp(stranded.stamp.sandbox_class, stranded.stamp.version, stranded.stamp.name)
    unaccepted = [(sandbox_class, r.version) for r in answer.runtimes if not r.workers_before]
    return await stamp_labels(nc, prefix, runtimes, unaccepted)


DRAINS_NAMED = 10  # of the workers a forecast drains, the ids its DRAIN names (-o wide: all)


def render_whatif(query: WhatIf, answer: WhatIfAnswer, runtimes: Runtimes, width: int | None,
                  wide: bool = False, carried: bool = False) -> str:
    """The forecast: what the query supposes, the snapshot counts before and after, per runtime
    the workers and free room before and after, and the actors it would strand. DRAIN names
    DRAINS_NAMED of the workers drained and counts the rest, unless `wide` (a thousand ids were 18 KB of
    one field: a trial at fleet size). `carried`: the actors listed are as many as one answer of the
    server carries (`fitting_whatif`), fewer than asked, and the note says so."""
    cls = query.sandbox_class
    dropped = {compat_key(cls, v) for v in query.drop_runtimes}
    drained = sorted(set(query.drain_workers))
    fields = [
        ("CLASS", cls),
        ("DROP", ", ".join(pin_label(runtimes, cls, v)  # in the order of the table below
                           for v in sorted(query.drop_runtimes, key=lambda v: by_label(runtimes, cls, v))) or "-"),
        ("DRAIN", (", ".join(drained) if wide else named_few(drained, DRAINS_NAMED)) or "-"),
    ]
    parts = [render_fields(fields, None if wide else width)]
    parts.append(render_table(COUNT_COLUMNS, [("before", answer.before), ("after", answer.after)], width, wide).text)
    notes = []
    if answer.runtimes:
        rows = sorted(answer.runtimes, key=lambda r: by_label(runtimes, cls, r.version))
        table = render_table(forecast_columns(cls, runtimes, dropped), rows, width, wide)
        parts.append(table.text)
        notes.append(table.footnote(width))
    newly = answer.after.stranded_snapshots - answer.before.stranded_snapshots  # a drop or drain only takes away
    if answer.newly_stranded:
        table = render_table(stranded_columns(runtimes), answer.newly_stranded, width, wide)
        parts.append(table.text)
        notes.append(table.footnote(width))
    elif newly <= 0:  # said, not left to an absent table (a walkthrough: the answer an upgrade step waits for)
        parts.append("no actor newly stranded")
    if newly > len(answer.newly_stranded):
        listed = len(answer.newly_stranded)
        notes.append(f"({newly} snapshots newly stranded, {listed} actor{'' if listed == 1 else 's'} listed"
                     + (f": {CARRIED})" if carried else f"; --limit 0 lists all, up to {WHATIF_LIMIT_MAX:,})"))
    if answer.created_newly_stranded:
        # not counted above (CONTRACT counts PAUSED and SUSPENDED actors), and as stuck under MEMORY: said apart
        table = render_table(stranded_columns(runtimes, "CREATED, IMAGE NEWLY STRANDED"),
                             answer.created_newly_stranded, width, wide)
        parts.append(table.text)
        notes.append(table.footnote(width))
        notes.append("(CREATED actors whose first resume restores a memory image (golden or tagged) this strands: "
                     "in no count above; each first resume falls back to a lower fidelity, or is refused under "
                     "--min-fidelity MEMORY; at most --limit listed)")
    text = "\n\n".join(parts)
    notes = [n for n in notes if n]
    return text + ("\n" + "\n".join(dict.fromkeys(notes)) if notes else "")


async def fitting_whatif(client: Client, query: WhatIf) -> tuple[WhatIfAnswer, WhatIf]:
    """The forecast of `query`, and the query answered: with a lower `limit` where the answer listing
    `limit` actors is larger than the server carries (RESOURCE_EXHAUSTED naming both sizes: `whatif
    --limit 0` of a thousand drained workers was a 3.1 MB answer, refused, and the command printed only
    that error), as many as fit, asked again at most a few times; the counts are the same whatever
    it lists. Any other refusal is raised. An answer that a lower `limit` does not make smaller is large
    for its rows per runtime, which no limit narrows, or asked for more actors than there are: the answer
    listing one actor is asked once, whose refusal says that no limit narrows it (it said "ask for fewer
    actors" after eight asks for fewer, a worker's registration of the largest one-class size on a 1 MB
    server); answered, fewer are asked for as before (taken for the answer, it listed one actor of a
    thousand where 400 fit: `--limit 0`'s 10,000 cut to 3,685 listed the same thousand)."""
    before = None  # the size of the answer the last ask was refused for
    one = False  # the answer listing one actor was asked (and fits)
    for _ in range(8):
        try:
            return await client.whatif(query), query
        except ContractError as e:
            past = past_max_payload(e.message) if e.code is ErrorCode.RESOURCE_EXHAUSTED else None
            if past is None or query.limit <= 1:
                raise
            size, carried = past
            if before is not None and size >= before and not one:  # fewer actors made it no smaller
                await client.whatif(msgspec.structs.replace(query, limit=1))  # its refusal is raised
                one = True
            before = size
            fits = int(query.limit * carried / size * 0.9)  # a tenth to spare: rows are not all alike
            query = msgspec.structs.replace(query, limit=max(1, fits if fits < query.limit else query.limit // 2))
    return await client.whatif(query), query


CARRIED = "as many as one answer of this NATS server carries (its max_payload)"  # `fitting_whatif`'s cut


def carried_note(limit: int) -> str:
    """What a forecast listing fewer actors than asked (`fitting_whatif`) says of it on stderr (-o json)."""
    return f"newly stranded actors listed at most {limit:,}: {CARRIED}"


@click.command()
@click.option("--class", "sandbox_class", required=True, callback=request_field(WhatIf, "sandbox_class"),
              help="The sandbox class to forecast.")
@click.option("--drop-runtime", "drop", multiple=True, metavar="RUNTIME",
              help="As if every worker of the class stopped offering this runtime (as default, restorable "
                   "or compatible version). A label as the views print it (gvisor-v1, gvisor-v1@3f9a1c), "
                   "an id (rt-3f9a1c), or a name: every runtime of the class that carries it; one a registered "
                   "worker of the class offers (one none offers has nothing to drop). Repeatable.")
@click.option("--drain", "drain", multiple=True, metavar="WORKER",
              callback=request_field(WhatIf, "drain_workers", sandbox_class="c"),
              help="As if this worker were drained. Repeatable.")
@click.option("--limit", type=IntRange(0, WHATIF_LIMIT_MAX), default=100, show_default=True,
              help=f"Newly stranded actors listed at most (0: all, up to {WHATIF_LIMIT_MAX:,}).")
@min_seq_option
@nats_option
@prefix_option
@output_option
def whatif(sandbox_class: str, drop: tuple[str, ...], drain: tuple[str, ...], limit: int, min_seq: int | None,
           nats_url: str, prefix: str, output: str | None, as_json: bool) -> None:
    """Before a step of a rolling upgrade: what dropping runtimes and draining workers would do
    (scheduler.whatif; writes nothing).

    Prints the stranded and memory-restorable snapshots before and after, per runtime the
    workers that accept it and their free room before and after, and the actors that would
    be newly stranded. What changes nothing is said on stderr (`note:`): a worker to drain
    that is drained already, or nothing to drop or drain.
    """
    mode = output_mode(output, as_json)

    async def work(nc: Any) -> tuple[WhatIf, WhatIfAnswer, Runtimes, Any]:
        from services.scheduler.whatif import unknown_class

        target = await last_seq(nc, prefix)
        asked = await asked_runtimes(nc, prefix, target or None)
        if asked is None:  # no scheduler says the runtimes: the fleet's histories, every worker's
            projection = await fleet(nc, prefix, target)
            runtimes = runtimes_of(projection)
        else:  # a scheduler's, at least the log's as it was: the histories of the workers to drain alone
            runtimes, projection = asked, await fleet(nc, prefix, target, drain)
        classes = registered_classes(runtimes)
        if sandbox_class not in classes:  # first: the runtimes and workers named are of the class
            raise unknown_class(sandbox_class, classes)
        query = WhatIf(sandbox_class=sandbox_class, drop_runtimes=tuple(resolve_drops(runtimes, drop, sandbox_class)),
                       drain_workers=tuple(dict.fromkeys(drain)), limit=limit or WHATIF_LIMIT_MAX,
                       min_seq=min_seq or target or None)  # at least the fleet this command resolved against
        check_drains(projection, drain, sandbox_class)
        answer, query = await fitting_whatif(Client(nc, prefix), query)
        if mode != "json":  # a runtime no worker runs, by the name its stamps carry, as the other views say it
            runtimes = await whatif_labels(nc, prefix, runtimes, sandbox_class, answer)
        return query, answer, runtimes, projection

    query, answer, runtimes, projection = ask(nats_url, work)
    for note in no_op_notes(projection, drop, drain):  # on stderr: `-o json` stays the answer alone
        click.echo(f"note: {note}", err=True)
    carried = query.limit < (limit or WHATIF_LIMIT_MAX)
    if mode == "json":
        if carried:
            click.echo(f"note: {carried_note(query.limit)}", err=True)
        echo_json(to_builtins(answer), sandbox_class)
        return
    click.echo(render_whatif(query, answer, runtimes, terminal_width(), mode == "wide", carried))
