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


async def test_a_task_that_swallowed_its_cancellation_is_cancelled_again_and_said(monkeypatch, caplog):
    """A loop that ends only when cancelled, whose first cancellation a request swallowed (Python 3.11's
    asyncio.wait_for), ran on: its stop waited for ever. It is cancelled again, and a warning says so."""
    from events import tasks

    monkeypatch.setattr(tasks, "CANCEL_AGAIN_S", 0.05)
    started = asyncio.Event()

    async def loop_swallowing_once() -> None:
        swallowed = False
        started.set()
        while True:
            try:
                await asyncio.Event().wait()  # the loop's wait for work: nothing comes, it ends only cancelled
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed = True  # as wait_for returns a result that came as it was cancelled

    task = asyncio.create_task(loop_swallowing_once(), name="the-loop")
    await started.wait()
    with caplog.at_level(logging.WARNING, logger="warmboot"):
        await asyncio.wait_for(cancel_and_wait(task), 10)
    assert task.cancelled()
    assert any("the-loop still runs" in r.getMessage() and "cancelled again" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


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


async def test_a_store_request_given_up_on_leaves_no_unretrieved_error():
    """`Stream._answer` waits for a request to the stream leader or the next leader election; on an
    election it cancels the request. nats-py's `request` may end in an error all the same: Python 3.11's
    `asyncio.wait_for` swallows a cancellation that lands as its future completes (CPython gh-86296), and
    the request then raises what the answer says (no responders). Nobody awaited that error, and asyncio
    reported "Task exception was never retrieved" with a traceback (a soak's log, a replica that had just
    woken from a stop, an election meanwhile)."""
    import gc
    from types import SimpleNamespace

    import nats.errors

    from events.jetstream import errors
    from events.jetstream.stream import Stream

    reported: list[dict] = []
    loop = asyncio.get_running_loop()
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        sent = asyncio.Event()

        async def request() -> None:
            sent.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:  # swallowed as the 503 came: the answer's error instead
                raise nats.errors.NoRespondersError from None

        election = loop.create_future()
        stream = SimpleNamespace(name="S", link=SimpleNamespace(next_election=lambda _: election))
        others = asyncio.all_tasks()
        caller = asyncio.ensure_future(Stream._answer(stream, request()))
        await sent.wait()
        [requesting] = asyncio.all_tasks() - others - {caller}  # the request's task, made by `_answer`
        election.set_result(None)  # a new leader: the request is given up on
        with pytest.raises(errors.LeaderElected):
            await caller
        await asyncio.wait([requesting])  # it ends, in its error (not cancelled)
        assert requesting.done() and not requesting.cancelled()
        del caller, stream, requesting
        gc.collect()  # an unretrieved error is reported as its task goes
    finally:
        loop.set_exception_handler(before)
    assert [c.get("message") for c in reported] == []
