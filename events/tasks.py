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


async def cancel_and_wait(*tasks: asyncio.Future | None) -> None:
    """Cancel each of `tasks` (None ones skipped) and return once all have ended."""
    pending = [task for task in tasks if task is not None]
    for task in pending:
        task.cancel()
    if not pending:
        return
    await asyncio.wait(pending)
    for task in pending:
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s ended with an error while stopping", getattr(task, "get_name", lambda: task)(),
                      exc_info=task.exception())
