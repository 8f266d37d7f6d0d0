"""`make test` after one of its workers died (a test past pytest-timeout's limit, which ends its worker;
any crash): the run ends, the crash reported as the failure of the test it ran, every other test run
once (tests/xdist_crashes.py). With pytest-xdist's own loadfile scheduler such a run waited for ever.

The runs here are real `pytest -n N --dist loadfile` sessions of a small suite whose one test kills
its own worker (SIGKILL)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.xdist_crashes import crash_requeue

QUICK = {f"test_quick_{n}.py": [f"test_q{n}"] for n in range(1, 5)}  # four files of one test each
TESTS_IN_THE_CRASHING_FILE = ["test_before", "test_middle", "test_last"]


def suite(tmp_path, crashing: str) -> dict[str, str]:
    """Write the small suite, `crashing` (a test of test_crashes.py) killing its worker; return {test id:
    outcome expected}."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    expected = {}
    for name, tests in QUICK.items():
        (tmp_path / name).write_text("".join(f"def {test}():\n    pass\n" for test in tests))
        expected.update({f"{name}::{test}": "PASSED" for test in tests})
    body = ["import os, signal\n"]
    for test in TESTS_IN_THE_CRASHING_FILE:
        body.append(f"def {test}():\n")
        body.append("    os.kill(os.getpid(), signal.SIGKILL)\n" if test == crashing else "    pass\n")
        expected[f"test_crashes.py::{test}"] = "FAILED" if test == crashing else "PASSED"
    (tmp_path / "test_crashes.py").write_text("".join(body))
    return expected


def run(tmp_path, workers: int, *options: str, timeout: float = 120) -> tuple[str, str]:
    """The small suite run in `workers` xdist workers with `options` (`-p PLUGIN`, ...): its stdout and
    stderr; TimeoutExpired if it had not ended after `timeout` s (its process group then killed: no
    worker is left behind)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this run's own
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-n", str(workers), "--dist", "loadfile",
            *options]
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def outcomes(output: str) -> dict[str, list[str]]:
    """Each test id's outcomes as the summary lines (`-rA`) say them."""
    found: dict[str, list[str]] = {}
    for outcome, test in re.findall(r"^(PASSED|FAILED) (\S+)", output, re.M):
        found.setdefault(test, []).append(outcome)
    return found


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("crashing", ["test_middle", "test_last"])
def test_a_worker_that_dies_fails_its_test_and_the_run_ends_with_every_other_test_run_once(
        tmp_path, workers, crashing):
    expected = suite(tmp_path, crashing)
    output, _ = run(tmp_path, workers, "-p", "tests.xdist_crashes")
    assert "node down: Not properly terminated" in output, output[-3000:]
    assert outcomes(output) == {test: [outcome] for test, outcome in expected.items()}, output[-3000:]
    assert re.search(rf"worker 'gw\d' crashed while running 'test_crashes.py::{crashing}'", output)
    assert f"1 failed, {len(expected) - 1} passed" in output


def test_xdist_s_own_loadfile_waits_for_ever_after_such_a_crash(tmp_path):
    """Why the plugin is there: the same run with pytest-xdist 3.8's own scheduler does not end (it
    ends in about 3 s with the plugin). If a later pytest-xdist ends it as the plugin does (the crash
    reported, every other test run once), this test fails, and the plugin may go. A run that ended
    otherwise (the CI run of 3664ec4 saw one end within 20 s, on a machine where it waited for ever in
    12 runs of 12, 9 of them under load) is no such fix, and the test holds: what that run printed is in
    the test's captured output (`pytest -rP` shows it)."""
    expected = suite(tmp_path, "test_middle")
    try:
        output, errors = run(tmp_path, 1, timeout=10)
    except subprocess.TimeoutExpired:
        return
    print(f"xdist's own loadfile ended the run; it printed:\n{output[-3000:]}\n{errors[-3000:]}")
    assert outcomes(output) != {test: [outcome] for test, outcome in expected.items()}, output[-3000:]


# --- what a worker that dies says ---------------------------------------------------------------------------------


@pytest.mark.parametrize("death", ["hang", "segfault"])
def test_a_worker_that_dies_says_which_test_it_ran_and_where(tmp_path, death):
    """A test past its time-out (pytest-timeout ends its process) and a segfault each print, on the run's
    stderr, the test and every thread's stack (tests/hang_reports.py), and the run's own output (its
    summary, the crash as a failure) reaches its stdout. The CI run of d764e5a said only "node down"."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_default_fixture_loop_scope = function\n"
                                         "timeout_method = thread\n")
    body = {"hang": "import threading\n\ndef test_dies():\n    threading.Event().wait()  # for ever\n",
            "segfault": "import ctypes\n\ndef test_dies():\n    ctypes.string_at(0)\n"}[death]
    (tmp_path / "test_dies.py").write_text(body)
    (tmp_path / "test_lives.py").write_text("def test_lives():\n    pass\n")
    out, err = run(tmp_path, 1, "-p", "tests.xdist_crashes", "-p", "tests.hang_reports", "--timeout", "5")
    assert "node down" in out and "crashed while running 'test_dies.py::test_dies'" in out, out[-2000:]
    assert re.search(r"^FAILED test_dies.py::test_dies", out, re.M) and re.search(r"^PASSED test_lives.py", out, re.M)
    assert "1 failed, 1 passed" in out, out[-2000:]
    if death == "hang":
        assert "test_dies.py::test_dies still runs after 4s of its 5s time-out" in err, err[-3000:]
        assert "test_dies.py::test_dies: every thread's stack:" in err, err[-3000:]
    else:
        assert "Fatal Python error: Segmentation fault" in err, err[-3000:]
    assert re.search(r'File ".*test_dies.py", line 4 in test_dies', err), err[-3000:]


# --- the requeue, on its own ----------------------------------------------------------------------------


def test_only_files_with_tests_left_go_back_and_the_crashed_test_is_not_among_them():
    workload = {
        "a.py": {"a.py::t1": True, "a.py::t2": True},  # finished before the crash
        "b.py": {"b.py::t1": True, "b.py::t2": False, "b.py::t3": False},  # t2 was running
        "c.py": {"c.py::t1": False},  # handed out, not begun
    }
    crashed, requeue = crash_requeue(workload)
    assert crashed == "b.py::t2"
    assert requeue == {"b.py": {"b.py::t1": True, "b.py::t2": True, "b.py::t3": False}, "c.py": {"c.py::t1": False}}
    assert workload["b.py"]["b.py::t2"] is False  # the worker's record is not changed


def test_a_crash_on_a_file_s_last_test_hands_nothing_of_that_file_back():
    crashed, requeue = crash_requeue({"a.py": {"a.py::t1": True, "a.py::t2": False}})
    assert (crashed, requeue) == ("a.py::t2", {})


def test_a_worker_that_had_finished_everything_crashed_while_running_nothing():
    assert crash_requeue({"a.py": {"a.py::t1": True}}) == (None, {})
