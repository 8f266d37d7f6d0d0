"""A pytest plugin: a test near its time-out, or a crash of the process running it, says where it was,
in the log of `make test` too.

Under `make test` a test still running at pytest-timeout's limit ends its process (`thread` method),
and pytest-xdist says of it only "[gw0] node down: Not properly terminated" (the CI run of d764e5a):
an xdist worker's stdout, where pytest-timeout writes its stack dump, is /dev/null, and during a test
fd 2 is pytest's capture file, which dies with the process. So the process's own stderr is copied
when pytest configures (the global capture is suspended then: it captures the loading of conftests
and stops before `pytest_configure`), and:

- a test still running at nine tenths of its time-out (its own `@pytest.mark.timeout`, `--timeout`,
  or the ini's) writes there its id, what every task of the session's loop awaits (`LOOPS`, which
  the conftest fills: an awaiting coroutine shows in no thread's stack) and every thread's stack;
- faulthandler writes there too: a segfault or an abort prints `Fatal Python error` and the stacks.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import sys
import threading

import pytest

LOOPS: list[asyncio.AbstractEventLoop] = []  # the session's loop, once a test has run on it
_STDERR: list = []  # a copy of the process's own stderr, made at configure
_TIMER = pytest.StashKey[threading.Timer]()  # an item's report timer


def pytest_configure(config):
    """Copy fd 2 as it is now: the process's own stderr. (Not by suspending the capture and resuming
    it: resumed here, it ran on in xdist's controller, which runs no test to suspend it, and the whole
    run's output went into pytest's temporary files.)"""
    try:
        _STDERR.append(os.fdopen(os.dup(2), "w", buffering=1, closefd=True))
    except OSError:
        pass  # no stderr to copy: reports go to sys.stderr as it then is


def pytest_sessionstart(session):
    if _STDERR:
        faulthandler.enable(file=_STDERR[0], all_threads=True)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # pytest-timeout's hook
def pytest_timeout_set_timer(item, settings):
    """The report's timer, at nine tenths of the test's time-out; pytest-timeout then sets its own."""
    if not settings.timeout or settings.timeout <= 0:
        return None
    limit = float(settings.timeout)
    timer = threading.Timer(limit * 0.9, report, (item.nodeid, limit))
    timer.daemon = True
    timer.start()
    item.stash[_TIMER] = timer
    return None


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # pytest-timeout's hook
def pytest_timeout_cancel_timer(item):
    timer = item.stash.get(_TIMER, None)
    if timer is not None:
        timer.cancel()
    return None  # pytest-timeout's own is cancelled too


def report(nodeid: str, limit: float) -> None:
    out = _STDERR[0] if _STDERR else sys.stderr
    try:
        print(f"\n{nodeid} still runs after {limit * 0.9:.0f}s of its {limit:.0f}s time-out; the tasks of its loop:",
              file=out)
        for task in list(asyncio.all_tasks(LOOPS[0])) if LOOPS else []:
            task.print_stack(limit=8, file=out)
        print(f"{nodeid}: every thread's stack:", file=out)
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.flush()
    except Exception as error:  # noqa: BLE001 (a report that fails says so, and the test goes on)
        print(f"{nodeid}: the hang report failed: {error!r}", file=sys.stderr)
