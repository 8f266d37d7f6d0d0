"""Ending background tasks: one way, used by every stop() in the project.

`await task` under `suppress(CancelledError)` (the usual idiom) cannot tell the task's
cancellation from the caller's: a caller that gives up on a stop (a time-out around it,
a shutdown cancelling it) sees it return as if it had finished, and goes on with the
task still running. `cancel_and_wait` waits for the tasks without awaiting them, so a
cancellation of the caller stays the caller's, and a task that ended with an error of
its own has that error logged, not raised into the stop.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("warmboot")


def retrieved(future: asyncio.Future) -> None:
    """A done-callback: the future's exception counts as retrieved (no "exception was never
    retrieved" warning when nobody may be left to await it); whoever awaits it still gets it."""
    if not future.cancelled():
        future.exception()


CANCEL_AGAIN_S = 5.0  # how long a cancelled task may take to end before it is cancelled again


async def cancel_and_wait(*tasks: asyncio.Future | None) -> None:
    """Cancel each of `tasks` (None ones skipped) and return once all have ended. One still running
    `CANCEL_AGAIN_S` after its cancellation is cancelled again, with a warning naming it and where it
    waits: Python 3.11's asyncio.wait_for, inside every nats-py request, swallows a cancellation that
    lands as its future completes (CPython gh-86296), and a loop that ends only when cancelled then
    ran on, its stop waiting for ever (the registry's loops, 2026-12-05, before they checked a flag)."""
    pending = [task for task in tasks if task is not None]
    for task in pending:
        task.cancel()
    if not pending:
        return
    while True:
        _, running = await asyncio.wait(pending, timeout=CANCEL_AGAIN_S)
        if not running:
            break
        for task in running:
            where = "".join(f"\n  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
                            for frame in task.get_stack(limit=6)) if isinstance(task, asyncio.Task) else ""
            log.warning("task %s still runs %.0f s after its cancellation (one swallowed?): cancelled again%s",
                        getattr(task, "get_name", lambda: task)(), CANCEL_AGAIN_S, where)
            task.cancel()
    for task in pending:
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s ended with an error while stopping", getattr(task, "get_name", lambda: task)(),
                      exc_info=task.exception())
