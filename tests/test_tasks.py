"""events.tasks.cancel_and_wait: how every stop() ends its background tasks."""

from __future__ import annotations

import asyncio
import logging

import pytest

from events.tasks import cancel_and_wait


async def test_a_stop_given_up_on_is_not_reported_as_finished():
    """A task that swallows its first cancellation (as asyncio.wait_for of Python 3.11 may, when
    its future completes as it is cancelled) keeps running; the caller's time-out around the
    stop must end the caller with that time-out, not return as if the stop had finished."""
    started, release = asyncio.Event(), asyncio.Event()

    async def stubborn() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass  # swallowed
        await release.wait()

    task = asyncio.create_task(stubborn())
    await started.wait()  # the task is in its first wait
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(cancel_and_wait(task), 0.2)
    assert not task.done()
    release.set()
    await cancel_and_wait(task)
    assert task.done()


async def test_cancelled_tasks_end_and_errors_are_logged_not_raised(caplog):
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    async def failing() -> None:
        raise RuntimeError("boom")

    a, b = asyncio.create_task(forever()), asyncio.create_task(failing())
    await started.wait()
    await asyncio.wait([b])  # it has failed before the stop
    with caplog.at_level(logging.ERROR, logger="warmboot"):
        await cancel_and_wait(a, None, b)
    assert a.cancelled() and b.done()
    assert any("boom" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)
    await cancel_and_wait()  # nothing to end
