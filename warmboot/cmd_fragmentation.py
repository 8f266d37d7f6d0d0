"""`warmboot fragmentation`: per class and runtime, the workers that run or can restore it and the memory
snapshots stamped with it (the scheduler's `fragmentation` answer). The views' shared parts are
`warmboot.cmd_views`'."""

from __future__ import annotations

from typing import Any

import click

from events.codec import to_builtins
from events.compat import compat_key
from events.errors import ContractError
from events.runtime_id import Runtimes, short_id
from events.schema import ErrorCode, Fragmentation, FragmentationQuery, RuntimeFragmentation
from warmboot.cli_common import ask, min_seq_option, nats_option, prefix_option, request_field, version_text
from warmboot.client import Client
from warmboot.cmd_views import (by_label, check_class_named, classes_option, echo_json, mib, millis, output_mode,
                                output_option, pin_label, runtime_labels, stamp_labels)
from warmboot.render import Column, render_table, terminal_width


CLASS_COLUMNS = [
    Column("CLASS", lambda c: c.sandbox_class),
    Column("WORKERS", lambda c: str(c.workers), right=True),
    Column("STRANDED", lambda c: str(c.stranded_snapshots), right=True),
    Column("LOST LOCAL", lambda c: str(c.lost_local_snapshots), right=True),
]


def runtime_columns(runtimes: Runtimes) -> list[Column]:
    """Columns of (class, RuntimeFragmentation) rows."""
    return [
        Column("CLASS", lambda r: r[0]),
        Column("RUNTIME", lambda r: pin_label(runtimes, r[0], r[1].version), drop=1,
               narrow=Column("RUNTIME", lambda r: short_id(compat_key(r[0], r[1].version)), about="as ids")),
        Column("DEFAULT", lambda r: str(r[1].workers_default), right=True),
        Column("RESTORABLE", lambda r: str(r[1].workers_restorable), right=True),
        Column("EDGE", lambda r: str(r[1].workers_compatible), right=True, drop=3),
        Column("CPU FREE", lambda r: millis(r[1].free.cpu_millis), right=True, drop=2),
        Column("MEM FREE", lambda r: mib(r[1].free.memory_mib), right=True),
        Column("SNAPSHOTS", lambda r: str(r[1].snapshots_memory), right=True),
        Column("RUNTIME ID", lambda r: short_id(compat_key(r[0], r[1].version)), wide=True),
        Column("ATTRIBUTES", lambda r: version_text(r[1].version), wide=True),
    ]


def drained_only(row: RuntimeFragmentation) -> bool:
    """A runtime fragmentation lists with every count 0: no undrained worker runs it, can restore it or
    accepts it through an edge, and no memory snapshot is stamped with it. The scheduler lists every
    runtime a registered worker offers, drained ones included (counts of 0 are dropped from its snapshot
    tallies), so such a runtime is one only drained workers offer."""
    return not (row.workers_default or row.workers_restorable or row.workers_compatible or row.snapshots_memory)


def render_fragmentation(answer: Fragmentation, runtimes: Runtimes, width: int | None, wide: bool = False,
                         sandbox_class: str | None = None) -> str:
    """The classes, then their runtimes. A runtime only drained workers offer (`drained_only`) is a row of
    zeros: left out, and counted in a note, unless `wide` (as `workers` shows a drained worker's row marked
    DRAINED, and WORKERS counts undrained workers only; a fleet's retired machines listed rows of zeros, a
    user trial); -o json keeps every runtime, as the scheduler answers."""
    if not answer.classes:
        return (f"no worker registers the sandbox class {sandbox_class}" if sandbox_class is not None
                else "no sandbox classes registered")
    classes = render_table(CLASS_COLUMNS, answer.classes, width, wide)
    rows = sorted(((c.sandbox_class, rt) for c in answer.classes for rt in c.runtimes),
                  key=lambda row: by_label(runtimes, row[0], row[1].version))
    idle = sum(1 for _, rt in rows if drained_only(rt))
    shown = rows if wide else [row for row in rows if not drained_only(row[1])]
    parts, notes = [classes.text], []
    if shown:
        table = render_table(runtime_columns(runtimes), shown, width, wide)
        parts.append(table.text)
        notes.append(table.footnote(width))
    if idle:
        which = f"{idle} runtime{'' if idle == 1 else 's'} only drained workers offer, with no memory snapshot"
        notes.append(f"({which}: every count 0)" if wide else f"({which}, left out; -o wide lists them)")
    notes = [n for n in notes if n]
    return "\n\n".join(parts) + ("\n" + "\n".join(notes) if notes else "")


async def fragmentation_labels(nc: Any, prefix: str, answer: Fragmentation) -> Runtimes:
    """The labels of fragmentation's runtimes (`stamp_labels`), those with memory snapshots looked up."""
    with_snapshots = [(c.sandbox_class, rt.version) for c in answer.classes for rt in c.runtimes if rt.snapshots_memory]
    return await stamp_labels(nc, prefix, await runtime_labels(nc, prefix), with_snapshots)


@click.command()
@classes_option("classes and runtimes", request_field(FragmentationQuery, "sandbox_class"))
@min_seq_option
@nats_option
@prefix_option
@output_option
def fragmentation(sandbox_class: tuple[str, ...], min_seq: int | None, nats_url: str, prefix: str,
                  output: str | None, as_json: bool) -> None:
    """Per sandbox class: workers, stranded and lost local snapshots; per runtime: the workers
    running it (DEFAULT), able to restore it (RESTORABLE) or accepting it through a compatible
    version (EDGE), their free room, and the memory snapshots stamped with it (SNAPSHOTS).

    A runtime is labelled as in every view; one no worker runs, by the name its snapshots' stamps
    carry, as `actor list` shows them (the whole log is then read for it, as `actor list` reads it).
    A runtime only drained workers offer, with no memory snapshot (every count 0), is left out, a
    last line saying how many: -o wide and -o json list every runtime.

    A --class the scheduler knows nothing of (no worker has registered it, and no actor of it holds a
    memory snapshot) is NOT_FOUND, exit status 1, naming the classes the registered workers run where
    these credentials may read the log."""
    mode = output_mode(output, as_json)
    named = list(dict.fromkeys(sandbox_class))

    async def work(nc: Any) -> tuple[Fragmentation, Runtimes | None]:
        client = Client(nc, prefix)
        found = []
        for one in named or [None]:  # the endpoint's own answer for each class asked
            try:
                found.append(await client.fragmentation(one, min_seq))
            except ContractError as e:  # the scheduler knows no such class (`Client.fragmentation`)
                if e.code is ErrorCode.NOT_FOUND and e.field == "sandbox_class":
                    await check_class_named(nc, prefix, one)  # the same error, naming the classes the fleet runs
                raise
        if len(found) > 1:  # several classes: their answers as one, by class as the endpoint orders them
            found = [Fragmentation(classes=sorted((c for a in found for c in a.classes),
                                                  key=lambda c: c.sandbox_class))]
        return found[0], (None if mode == "json" else await fragmentation_labels(nc, prefix, found[0]))

    answer, runtimes = ask(nats_url, work)
    if mode == "json":
        echo_json(to_builtins(answer))
        return
    click.echo(render_fragmentation(answer, runtimes, terminal_width(), mode == "wide", ", ".join(named) or None))
