"""Explain and the reference scan: what a resume would get and why every other worker was
passed over (writes nothing), and the same placement rule as a scan of every worker
(the yardstick of `bench/scheduler.py` and the oracle of the tests)."""

from __future__ import annotations

from typing import Mapping

from events.compat import compat_key, describe_key
from events.errors import ContractError, exhausted
from events.schema import ErrorCode, Explanation, Placement, Refusal, Rejection
from services.scheduler.decide import (
    Draw,
    exhausted_message,
    choose,
    decide,
    placement,
    plan,
    refusal_cause,
    resolve,
    seed,
    summary,
    tally,
)
from services.scheduler.feasibility import NO_PENDING, Pending
from services.scheduler.projection import Projection

# --- explain -----------------------------------------------------------------------------------------


def explain(
    projection: Projection,
    actor_id: str,
    selectors: Mapping[str, str] | None,
    position: int,
    pending: Pending = NO_PENDING,
) -> Explanation:
    """What a resume would get now and why every other worker was passed over; writes nothing.

    A resume that would be refused is a successful explanation with `refusal` set (never
    a top-level `error`, which means the explain request itself failed: an unknown actor,
    a selector that conflicts with the actor's). Reasons and counts are against the
    actor's first requirement (a memory restore on a compatible worker when its snapshot
    allows one; otherwise any worker of its class), over every registered worker. Each
    rejected worker carries the first feasibility check it fails or, past those, every
    resource check it fails.
    """
    try:
        actor = resolve(projection, actor_id)
        the_plan = plan(projection, actor, selectors)
    except ContractError as error:
        if error.code in (ErrorCode.NOT_FOUND, ErrorCode.INVALID_ARGUMENT):
            raise
        return Explanation(refusal=Refusal(code=error.code, message=error.message, field=error.field), candidates=0,
                           rejected=[], counts={}, message=error.message)
    rejected: list[Rejection] = []
    keys: dict[str, int] = {}
    total, candidates, counts = tally(projection.workers.values(), the_plan.primary, pending, rejected, keys)
    text = summary(candidates, total, counts, keys)
    try:
        decision = decide(projection, actor_id, selectors, position, pending)
    except ContractError as error:
        return Explanation(
            refusal=Refusal(code=error.code, message=error.message, field=error.field), candidates=candidates,
            rejected=rejected, counts=counts,
            message=f"{text}; {refusal_cause(projection, the_plan, candidates, counts).text}",
        )
    outcome = f"{decision.action.value} {decision.fidelity.value} on {decision.worker_id}"
    matched = decision.matched_version
    if matched is not None and compat_key("", matched) != compat_key("", decision.sandbox_runtime.version):
        outcome += f" (restorable through compatible version {describe_key(compat_key('', matched)).strip()})"
    if decision.fallback is not None:
        outcome += f" (fallback {decision.fallback.reason.value})"
    return Explanation(
        decision=decision, candidates=candidates, rejected=rejected, counts=counts, message=f"{text}; {outcome}"
    )


# --- the reference scan ----------------------------------------------------------------------------------


def decide_by_scan(
    projection: Projection,
    actor_id: str,
    selectors: Mapping[str, str] | None,
    position: int,
    pending: Pending = NO_PENDING,
) -> Placement:
    """The same rule as `decide`, without the index: every worker of the fleet is run
    through the named pipeline and sorted into the plan's tiers.

    It is the yardstick of `bench/scheduler.py` and the oracle of the tests: it
    finds the same tier and a worker the index would deem feasible, though the member
    order (fleet order here, index order there) can make the two choices differ.
    """
    actor = resolve(projection, actor_id)
    the_plan = plan(projection, actor, selectors)
    draw = Draw(seed(actor_id, position))
    for tier in the_plan.tiers:
        ask = tier.ask
        keep = []
        for worker in projection.workers.values():
            if ask.fit(worker, pending, tier.role) is not None:  # a memory tier: a runtime in its role
                keep.append(worker)
        choice = choose(ask, keep, draw, pending, tier.role)
        if choice is not None:
            return placement(actor, tier, choice)
    raise exhausted(*exhausted_message(projection, the_plan, pending))
