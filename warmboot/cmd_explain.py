"""`warmboot explain ACTOR`: why a resume of the actor would be placed where it would, or refused: the
scheduler's `explain` answer (what a resume would get, writes nothing), each worker passed over with its
reasons, grouped, and a selector mismatch's keys read from the workers' histories. The views' shared parts
(labels, output modes) are `warmboot.cmd_views`'."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import click
import nats.errors

from events.codec import to_builtins
from events.errors import ContractError
from events.runtime_id import Runtimes
from events.schema import ExplainResume, Explanation, Rejection
from events.subjects import event_subject
from services.scheduler.decide import EXPLAIN_REJECTED_LIMIT
from services.scheduler.feasibility import SELECTOR_MISMATCH
from warmboot.cli_common import (IntRange, ask, check_id, min_seq_option, nats_option, prefix_option, request_field,
                                 selectors_of)
from warmboot.client import Client
from warmboot.cmd_views import (NAMES_SHOWN, asked_runtimes, decision_fields, echo_json, named_few, output_mode,
                                output_option, readable_fleet, runtimes_of)
from warmboot.render import Column, render_fields, render_table, terminal_width


REJECTED_COLUMNS = [  # a row: (worker id, reasons); -o wide, a worker a row
    Column("WORKER", lambda r: r[0]),
    Column("REASONS", lambda r: r[1]),
]
GROUPED_COLUMNS = [  # a row: (worker ids, reasons), the workers passed over for the same reasons
    Column("WORKERS", lambda r: r[0]),
    Column("REASONS", lambda r: r[1]),
]


def reasons_text(rejection: Rejection, missing: dict[str, list[str]]) -> str:
    """A worker's reasons; `selector mismatch` naming the selector keys its labels do not match,
    where `missing` (worker id: keys, read from the log) has them."""
    keys = missing.get(rejection.worker_id)
    return ", ".join(f"{r} ({', '.join(keys)})" if r == SELECTOR_MISMATCH and keys else r
                     for r in rejection.reasons)


def rejected_groups(rejected: list[Rejection], missing: dict[str, list[str]]) -> list[tuple[str, list[str]]]:
    """The workers passed over, as (reasons, worker ids) of those passed over for the same reasons, in
    the scheduler's order (a group where its first worker is)."""
    groups: dict[str, list[str]] = {}
    for r in rejected:
        groups.setdefault(reasons_text(r, missing), []).append(r.worker_id)
    return list(groups.items())


def group_row(reasons: str, workers: list[str], names: int) -> tuple[str, str]:
    """A group's row, naming at most `names` of its workers (`named_few`)."""
    return named_few(workers, names), reasons


def render_explanation(actor_id: str, answer: Explanation, runtimes: Runtimes, width: int | None,
                       wide: bool = False, limit: int = 0, missing: dict[str, list[str]] | None = None) -> str:
    """The explanation as fields, and the workers passed over in the scheduler's order (those that
    came furthest through the checks first, then by id); SUMMARY counts them all. Those passed over
    for the same reasons are one row naming a few of them, at most `limit` rows (0: all); with `wide`,
    a worker a row, at most `limit` workers. A REFUSED whose message is the SUMMARY's gives its code
    alone. The scheduler names EXPLAIN_REJECTED_LIMIT workers at most, and a last line says so where it
    names that many: at 5,000 workers, `w-1, w-2, w-3 (+997 more)  not on pinned node` read as the whole
    of SUMMARY's 1665 not on pinned node, and its 2500 of another class were in no row (a trial)."""
    missing = missing or {}
    fields = [("ACTOR", actor_id), ("SUMMARY", answer.message or f"{answer.candidates} candidates")]
    if answer.decision is not None:
        fields += decision_fields(answer.decision, runtimes, wide)
    if answer.refusal is not None:
        code, said = answer.refusal.code.value, answer.refusal.message
        fields.append(("REFUSED", code if said == answer.message else f"{code}: {said}"))
    parts = [render_fields(fields, None if wide else width)]
    if answer.rejected and wide:  # a worker a row, at most `limit` of them
        shown = answer.rejected[:limit] if limit else answer.rejected
        rendered = render_table(REJECTED_COLUMNS, [(r.worker_id, reasons_text(r, missing)) for r in shown], width,
                                wide)
        more = len(answer.rejected) - len(shown)
        notes = [f"({more} more worker(s) passed over: --limit 0 lists them)"] if more else []
        parts.append("\n".join([rendered.text, *notes]))
    elif answer.rejected:  # a row for the workers passed over for the same reasons, at most `limit` rows
        groups = rejected_groups(answer.rejected, missing)
        shown_groups = groups[:limit] if limit else groups
        for names in range(NAMES_SHOWN, 0, -1):  # fewer ids named until the rows fit
            rendered = render_table(GROUPED_COLUMNS, [group_row(reasons, workers, names)
                                                      for reasons, workers in shown_groups], width, wide)
            if width is None or rendered.width <= width:
                break
        more = len(answer.rejected) - sum(len(workers) for _, workers in shown_groups)
        notes = [f"({more} more worker(s) passed over for other reasons: --limit 0 lists them)"] if more else []
        if any(len(workers) > names for _, workers in shown_groups):
            notes.append("(workers passed over for the same reasons share a row: -o wide lists each)")
        parts.append("\n".join([rendered.text, *notes]))
    if len(answer.rejected) >= EXPLAIN_REJECTED_LIMIT:  # the rows count only those the answer names
        parts[-1] += (f"\n(the scheduler names {EXPLAIN_REJECTED_LIMIT:,} of the workers passed over, those that came "
                      "furthest through the checks; SUMMARY counts every one)")
    return "\n\n".join(parts)


async def selector_misses(nc: Any, prefix: str, actor_id: str, asked: dict[str, str] | None,
                          rejected: list[Rejection], workers: Callable[[], Awaitable[Any]]) -> dict[str, list[str]]:
    """For each worker passed over for `selector mismatch`: the selector keys (the actor's, from its
    ActorCreated, and the request's) its labels do not match. As the scheduler names them in its answer
    (`Rejection.missing_keys`, a project addition), reading nothing; from a scheduler of an earlier
    version, which does not: of one key, that key: the scheduler found
    each such worker's labels not to match it, and no worker's labels are read. Of several, those its
    labels, as the log has them now (`workers()`: the registered workers, None where the log cannot be
    read, which it says), do not match; a worker whose labels match now is left out (the reason stays
    bare). Empty where the log cannot be read (nor the actor's history: an event of a newer version in
    it; `workers()` is asked all the same, for what it says of the log)."""
    from events.schema import ActorCreated

    from warmboot.cli_common import read_subject

    mismatched = [r.worker_id for r in rejected if SELECTOR_MISMATCH in r.reasons]
    if not mismatched:
        return {}
    said = {r.worker_id: list(r.missing_keys) for r in rejected if r.missing_keys}
    if said:  # the scheduler's, from the labels it judged (`Rejection.missing_keys`); an earlier version's says none
        return said
    try:
        history = await read_subject(nc, prefix, event_subject(prefix, "actor", actor_id))
    except (click.ClickException, ContractError, nats.errors.Error):  # ContractError: an event it cannot read
        await workers()  # a log these credentials may not read: said as of the workers' labels (`readable_fleet`)
        return {}
    created = [event for _, event in history if isinstance(event, ActorCreated)]
    wanted = {**(created[-1].selectors if created else {}), **(asked or {})}
    if len(wanted) == 1:  # no worker's labels to read (every worker's history: 2.8 s at 10,000 workers)
        return {worker_id: list(wanted) for worker_id in mismatched}
    projection = await workers()
    if projection is None:
        return {}
    misses = {}
    for worker_id in mismatched:
        worker = projection.workers.get(worker_id)
        keys = sorted(k for k, v in wanted.items() if worker is not None and worker.labels.get(k) != v)
        if keys:
            misses[worker_id] = keys
    return misses


@click.command()
@click.argument("actor_id", callback=check_id)
@click.option("--selector", "selectors", multiple=True, metavar="KEY=VALUE",
              callback=request_field(ExplainResume, "selectors"),
              help="Extra label selector. Repeatable, one value per key.")
@click.option("--limit", type=IntRange(min=0), default=20, show_default=True,
              help="List at most N rows of the workers passed over, those that came furthest through the checks "
                   "first, then by id: a row for the workers passed over for the same reasons, or with -o wide a "
                   "worker a row (0: all the scheduler names, at most 1,000 workers; SUMMARY counts every one).")
@min_seq_option
@nats_option
@prefix_option
@output_option
def explain(actor_id: str, selectors: tuple[str, ...], limit: int, min_seq: int | None, nats_url: str, prefix: str,
            output: str | None, as_json: bool) -> None:
    """Why a resume of ACTOR_ID would land where it would (writes nothing).

    The workers passed over for the same reasons are one row naming a few of them
    (`w-1, w-2, w-3 (+18 more)`); -o wide lists each on its own row, -o json gives the
    scheduler's answer as it is. A `selector mismatch` names the selector keys the worker's
    labels do not match (the actor's selectors and --selector), as the scheduler judged them."""
    sel = selectors_of(selectors) or None
    mode = output_mode(output, as_json)

    async def work(nc: Any) -> tuple[Explanation, Runtimes | None, dict[str, list[str]]]:
        answer = await Client(nc, prefix).explain(actor_id, sel, min_seq)
        if mode == "json":  # the endpoint's answer, as it is
            return answer, None, {}
        # the labels from a scheduler (`asked_runtimes`); the workers' histories only when they are needed:
        # for the keys a selector mismatch of several names where the scheduler (an earlier version's) does not
        # say them, or when no scheduler said the labels
        asked = await asked_runtimes(nc, prefix)
        projection = None if asked is not None else await readable_fleet(nc, prefix)

        async def workers() -> Any:
            return projection if asked is None else await readable_fleet(nc, prefix,
                                                                         "selector keys of the mismatched workers")

        runtimes = (asked if asked is not None else runtimes_of(projection) if projection is not None
                    else Runtimes(complete=False))
        return answer, runtimes, await selector_misses(nc, prefix, actor_id, sel, answer.rejected, workers)

    answer, runtimes, missing = ask(nats_url, work)
    if mode == "json":
        echo_json(to_builtins(answer))
        return
    click.echo(render_explanation(actor_id, answer, runtimes, terminal_width(), mode == "wide", limit, missing))
