"""Operator views: `warmboot explain`, `warmboot fragmentation`, `warmboot workers`.

Tables for people, `--json` for machines. explain and fragmentation ask the
scheduler's endpoints (the answers a resume would get); workers folds the log with
the scheduler's own projection, so it shows exactly what the scheduler sees.
"""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from events.codec import to_builtins
from events.schema import Explanation, ExplainResume, Fragmentation, FragmentationQuery
from events.subjects import service_subject
from services.common import call
from warmboot.cli_common import ask, json_option, nats_option, prefix_option, version_text

console = Console()


@click.command()
@click.argument("actor_id")
@click.option("--selector", "selectors", multiple=True, metavar="KEY=VALUE", help="Extra label selector.")
@nats_option
@prefix_option
@json_option
def explain(actor_id: str, selectors: tuple[str, ...], nats_url: str, prefix: str, as_json: bool) -> None:
    """Why a resume of ACTOR_ID would land where it would (writes nothing)."""
    try:
        sel = dict(s.split("=", 1) for s in selectors) or None
    except ValueError:
        raise click.BadParameter("selectors are KEY=VALUE", param_hint="--selector") from None
    subject = service_subject(prefix, "scheduler", "explain", actor_id)
    answer: Explanation = ask(nats_url, lambda nc: call(nc, subject, ExplainResume(selectors=sel), Explanation))
    if as_json:
        click.echo(json.dumps(to_builtins(answer), indent=2))
        return
    console.print(answer.message or f"{answer.candidates} candidates")
    if answer.decision:
        d = answer.decision
        fallback = f", fallback {d.fallback.reason.value}" if d.fallback else ""
        console.print(
            f"would {d.action.value} at fidelity {d.fidelity.value} on [bold]{d.worker_id}[/] "
            f"(node {d.node}) pinned to {version_text(d.sandbox_runtime.version)}{fallback}"
        )
    if answer.error:
        console.print(f"[red]{answer.error.code.value}[/]: {answer.error.message}")
    if answer.rejected:
        table = Table(title="rejected workers")
        table.add_column("worker")
        table.add_column("reasons")
        for r in answer.rejected:
            table.add_row(r.worker_id, ", ".join(r.reasons))
        console.print(table)


@click.command()
@click.option("--class", "sandbox_class", default=None, help="Only this sandbox class.")
@nats_option
@prefix_option
@json_option
def fragmentation(sandbox_class: str | None, nats_url: str, prefix: str, as_json: bool) -> None:
    """Runtimes per sandbox class: workers, free capacity, memory snapshots, stranded."""
    subject = service_subject(prefix, "scheduler", "fragmentation")
    query = FragmentationQuery(sandbox_class=sandbox_class)
    answer: Fragmentation = ask(nats_url, lambda nc: call(nc, subject, query, Fragmentation))
    if as_json:
        click.echo(json.dumps(to_builtins(answer), indent=2))
        return
    for cls in answer.classes:
        table = Table(title=f"{cls.sandbox_class}: {cls.workers} workers, "
                            f"{cls.stranded_snapshots} stranded memory snapshots")
        for col in ("runtime", "default on", "restorable on", "free cpu (m)", "free mem (MiB)", "memory snapshots"):
            table.add_column(col, justify="left" if col == "runtime" else "right")
        for rt in cls.runtimes:
            table.add_row(version_text(rt.version), str(rt.workers_default), str(rt.workers_restorable),
                          str(rt.free.cpu_millis), str(rt.free.memory_mib), str(rt.snapshots_memory))
        console.print(table)
    if not answer.classes:
        console.print("no sandbox classes registered")


def worker_rows(projection) -> list[dict]:
    """One row per (worker, sandbox class), sorted by class, default runtime and worker."""
    from events.codec import to_builtins

    rows = []
    for worker in projection.workers.values():
        for sandbox_class, entry in worker.classes.items():
            rows.append({
                "sandbox_class": sandbox_class,
                "worker_id": worker.worker_id,
                "node": worker.node,
                "state": worker.state,
                "default_runtime": to_builtins(entry.default.compat.version),
                "restorable_runtimes": [to_builtins(r.compat.version) for r in entry.restorable],
                "capacity": {"cpu_millis": worker.cpu_millis, "memory_mib": worker.memory_mib},
                "free": {"cpu_millis": worker.room_cpu, "memory_mib": worker.room_mem},
                "actors": len(worker.actors),
            })
    rows.sort(key=lambda r: (r["sandbox_class"], json.dumps(r["default_runtime"], sort_keys=True), r["worker_id"]))
    return rows


@click.command()
@click.option("--class", "sandbox_class", default=None, help="Only this sandbox class.")
@nats_option
@prefix_option
@json_option
def workers(sandbox_class: str | None, nats_url: str, prefix: str, as_json: bool) -> None:
    """Registered workers by class and runtime, with free capacity and drain state.

    Folds the log with the scheduler's projection: what it shows is what the scheduler sees.
    """
    from warmboot.audit import Sink
    from warmboot.cli_common import replay

    sink = ask(nats_url, lambda nc: replay(nc, prefix, Sink(), not as_json))
    rows = [r for r in worker_rows(sink.projection) if sandbox_class in (None, r["sandbox_class"])]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        console.print("no workers registered")
        return
    table = Table(title=f"workers at sequence {sink.seq}")
    for col in ("class", "default runtime", "restorable", "worker", "node", "state", "free cpu (m)",
                "free mem (MiB)", "actors"):
        table.add_column(col, justify="right" if col.startswith(("free", "actors", "restorable")) else "left")
    for r in rows:
        version = sink.projection.workers[r["worker_id"]].classes[r["sandbox_class"]].default.compat.version
        table.add_row(r["sandbox_class"], version_text(version), str(len(r["restorable_runtimes"])), r["worker_id"],
                      r["node"], r["state"], str(r["free"]["cpu_millis"]), str(r["free"]["memory_mib"]),
                      str(r["actors"]))
    console.print(table)
