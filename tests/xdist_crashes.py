"""A pytest plugin: `make test`'s `--dist loadfile`, with a worker's crash ending in a report, not a hang.

pytest-xdist 3.8's loadfile scheduler hands a crashed worker's files back to the queue, and with them
every file that worker had already finished. The replacement worker is then sent one of the finished
files, an empty batch of tests; it asks for no more work, since none of its tests ever completes, and
the run waits for ever. A test that ran past pytest-timeout's limit (which ends its worker, `thread`
method) or any crash of a worker did it: the CI run of d764e5a hung at 97% until it was stopped at
5,400 s, the crash's report never printed.

Worse, a worker runs a test only once it knows the next one (or is told to stop), and the scheduler
gives a worker more only when one of its tests completes: a replacement handed a single test waits
for a next one that never comes.

Here only the files with tests left go back to the queue; the test that was running when the worker
died is reported failed once (by xdist, as "crashed while running"), not run again (a test that hangs
would hang its replacement as well); and a worker is handed files until it holds more than two tests
or none are left, and then told to stop once it has run them.
"""

from __future__ import annotations

import pytest


def crash_requeue(workload: dict[str, dict[str, bool]]) -> tuple[str | None, dict[str, dict[str, bool]]]:
    """The test a crashed worker was running (its first one not completed, in the order it was given
    them) and the files to hand out again: those with tests left, the crashed one counted as done.
    `workload` maps each file the worker was given to {test id: completed}; it is not changed."""
    crashed = next((test for unit in workload.values() for test, done in unit.items() if not done), None)
    requeue: dict[str, dict[str, bool]] = {}
    for scope, unit in workload.items():
        left = {test: done or test == crashed for test, done in unit.items()}
        if not all(left.values()):
            requeue[scope] = left
    return crashed, requeue


def scheduler(config, log):
    """xdist's loadfile scheduler with `crash_requeue` where its own hands back every file."""
    from xdist.scheduler import LoadFileScheduling

    class CrashSafeLoadFile(LoadFileScheduling):
        def remove_node(self, node):  # xdist's contract: the test being run when `node` crashed, or None
            crashed, requeue = crash_requeue(self.assigned_work.pop(node))
            if crashed is None:  # it ended with every test it was given run: as xdist's own
                return None
            self.workqueue.update(requeue)
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

        def _reschedule(self, node):  # xdist's hands out one file at most, and says stop only when none is left
            if node.shutting_down:
                return
            while self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
                self._assign_work_unit(node)
            if not self.workqueue:
                node.shutdown()  # after the tests it holds

    return CrashSafeLoadFile(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadfile":
        return scheduler(config, log)
    return None  # xdist's own for every other mode
