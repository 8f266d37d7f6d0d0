"""A service's load-decide-save commands, run again on a lost OCC race (`run_command`,
`run_command_async`), and decided again on the stream leader's history when what they read may
be behind it (`Recheck`, `confirm_unchanged`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from functools import partial
from typing import Any, Awaitable, Callable, TypeVar

from eventsourcing.persistence import IntegrityError

from events.errors import ContractError, unavailable
from events.schema import ErrorCode

log = logging.getLogger("warmboot.service")
T = TypeVar("T")


# What a command refuses on its entity's state, which a read behind the stream leader can show
# wrongly (`run_command_async`'s `recheck`).
STATE_REFUSALS = frozenset({ErrorCode.FAILED_PRECONDITION, ErrorCode.NOT_FOUND, ErrorCode.ALREADY_EXISTS})


# `run_command_async`'s recheck of a refusal: called before each decision, it notes what this
# process has read of the entities the decision reads (`recorder.seen`), and returns the check
# to await if the decision refuses on their state: whether the stream leader has their history
# past that (`recorder.newer_at_leader_async(aggregate, since)`).
Recheck = Callable[[], Callable[[], Awaitable[bool]]]


async def confirm_unchanged(recorder: Any, aggregate: Any, seq: int) -> None:
    """Before an answer that writes nothing (a registration UNCHANGED, a drain of a drained worker,
    a template already set): it stands on what was read of `aggregate`, up to stream sequence
    `seq`, and a read that a replica of the stream answered behind another process's append
    shows an older state (found by an audit: a worker's runtime changed back, answered
    UNCHANGED, left the log on the other runtime, and memory images were placed where they
    cannot load). IntegrityError if the stream leader has the history past `seq`, so that
    `run_command_async` decides again, on the leader's history (remembered, so the next read
    reaches it). One read of the leader per answer: the registry, whose storms of unchanged
    re-registrations are all such answers, asks its roster first (`RegistryService.
    _confirm_unchanged`) and comes here only when the roster does not say the same."""
    if await recorder.newer_at_leader_async(aggregate, seq):
        raise IntegrityError(f"{aggregate}: the stream leader has its history past {seq}, which was read behind it")


async def run_command(command: Callable[[], T], attempts: int = 8) -> T:
    """Run a load-decide-save `command` off the event loop, again on a lost OCC race.

    `command` must re-read what it decides on each time (the repository does), so
    a retry decides on fresh state. After `attempts` lost races: UNAVAILABLE."""
    return await _retried(partial(asyncio.to_thread, command), attempts, None)


async def run_command_async(command: Callable[[], Awaitable[T]], attempts: int = 8, *,
                            recheck: Recheck | None = None) -> T:
    """Run a load-decide-save `command` (or a read that may refuse, such as the registry's
    lookup of a worker for a heartbeat) on the event loop (its reads and its append awaited
    there: `recorder.select_events_async`, `insert_events_async`), again on a lost OCC race.

    `command` must re-read what it decides on each time (the repository does), so
    a retry decides on fresh state. After `attempts` lost races: UNAVAILABLE.

    A refusal on the entity's state (STATE_REFUSALS) may have been decided on a read that a
    lagging replica of the stream answered, behind another process's append: with `recheck`
    (`Recheck`), such a refusal is answered only once the leader has nothing past what this
    process had read of the entity before the decision, and is otherwise decided again, once,
    on the leader's history. Not past what it has read by the time of the check: another
    command's read meanwhile (the snapshotter's fence reads a worker's history outside the
    registry's lock on it) is not what the decision saw. An accepted command needs no such
    check: its append expects the subject where it read it."""
    return await _retried(command, attempts, recheck)


async def _retried(attempt: Callable[[], Awaitable[T]], attempts: int, recheck: Recheck | None) -> T:
    for tried in range(attempts):
        check = recheck() if recheck is not None else None  # before the decision reads anything
        try:
            return await attempt()
        except IntegrityError:
            # Writers that lost to each other should not meet again at once: a short,
            # growing, random pause spreads them (0-2 ms, then 0-4, 0-8 ... at most 0-64).
            await asyncio.sleep(random.random() * 0.002 * (1 << min(tried, 5)))
        except ContractError as refusal:
            if check is None or refusal.code not in STATE_REFUSALS or not await check():
                raise
            log.info("refused on a read behind the stream leader (%s: %s); deciding again", refusal.code.value,
                     refusal.message)
            return await _retried(attempt, attempts, None)
    raise unavailable(f"lost {attempts} concurrent-write races in a row; try again")
