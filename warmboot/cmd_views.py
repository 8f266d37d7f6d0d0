"""Operator views: `warmboot explain`, `warmboot fragmentation`, `warmboot workers`.

Tables for people, `--json` for machines. explain and fragmentation ask the
scheduler's endpoints (the answers a resume would get); workers folds the log with
the scheduler's own projection, so it shows exactly what the scheduler sees.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable

import click
from rich.console import Console
from rich.table import Table

from events.codec import to_builtins
from events.compat import compat_key, describe_key
from events.errors import ContractError
from events.schema import Explanation, ExplainResume, Fragmentation, FragmentationQuery
from events.subjects import DEFAULT_PREFIX, service_subject
from services.common import call
from warmboot.runner import connect

console = Console()

nats_option = click.option("--nats", "nats_url", default="nats://127.0.0.1:4222", show_default=True,
                           envvar="NATS_URL", help="NATS server URL(s), comma-separated.")
prefix_option = click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, envvar="WARMBOOT_PREFIX",
                             help="Subject prefix of the deployment.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def ask(nats_url: str, work: Callable[[Any], Awaitable[Any]]) -> Any:
    """Connect, run `work(nc)`, close; contract errors and connection failures become CLI errors."""

    async def run() -> Any:
        try:
            nc = await asyncio.wait_for(connect(nats_url, "warmboot-cli"), 5)
        except (OSError, asyncio.TimeoutError) as e:
            raise click.ClickException(f"cannot reach NATS at {nats_url}: {e}") from None
        try:
            return await work(nc)
        finally:
            await nc.close()

    try:
        return asyncio.run(run())
    except ContractError as e:
        raise click.ClickException(f"{e.code.value}: {e.message}" + (f" (field {e.field})" if e.field else ""))


def version_text(version: Any) -> str:
    return describe_key(compat_key("", version)).strip()


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
