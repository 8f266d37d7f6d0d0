"""`warmboot up`'s options, as a user trying the CLI meets them: a demo fleet too small or a
negative size is a usage error before anything starts; a demo option without --demo is refused,
not ignored; a metrics port taken is said before the store is made, and a start that fails
leaves nothing behind of what it made (found by a user trial)."""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.secured_helpers import WARMBOOT
from warmboot.cli import main
from warmboot.demo import MIN_WORKERS, Demo, DemoConfig


def held_port() -> socket.socket:
    """A socket bound and listening on a loopback port: that port is taken."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def contents(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` and each file's bytes: what a run changed in it."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("args, says", [
    (["--workers", "0"], "Invalid value for '--workers': 0 is too few: the demo retires (drains) the oldest CPU "
                         "generation and restores its images on the newest, so it needs a worker of the newest in "
                         "each sandbox class (gvisor, microvm): at least 6"),
    (["--workers", "-1"], "Invalid value for '--workers': -1 is too few"),
    (["--workers", "1", "--actors", "3"], "Invalid value for '--workers': 1 is too few"),
    # a worker of each class, both of the oldest generation: the demo drained both, then resumed onto no
    # worker and printed a whatif of runtimes no worker accepts (a user trial)
    (["--workers", "2", "--actors", "0"], "Invalid value for '--workers': 2 is too few"),
    (["--workers", "5"], "Invalid value for '--workers': 5 is too few"),  # no microvm of the newest yet
    (["--actors", "-5"], "Invalid value for '--actors': -5 is not a number of actors (0 or more)"),
])
def test_a_demo_fleet_it_cannot_run_is_a_usage_error_before_anything_starts(tmp_path, args, says):
    """It started the server and the services, then ended in a traceback (NOT_FOUND sandbox_class
    from the demo's whatif of a class no worker registered); a negative --actors ran."""
    store = tmp_path / "store"
    result = CliRunner().invoke(main, ["up", "--demo", "--exit-after-demo", "--port", "0", "--metrics-port", "0",
                                       "--store", str(store), *args])
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output
    assert not store.exists()  # no server started, nothing written


def test_the_smallest_fleet_it_takes_runs_the_demo_to_its_summary(tmp_path):
    """The minimum is the demo's real one: a worker of the newest CPU generation in each sandbox class
    (to restore the images of the oldest, which it retires), and no actor of its own. Its story then
    reads as it does with the default fleet: no request refused (with a worker of each class, both
    drained, the actors made during the upgrade were refused), and each runtime its whatif lists has a
    worker that accepts it before the drop (there, none had)."""
    args = [WARMBOOT, "up", "--demo", "--exit-after-demo", "--port", "0", "--metrics-port", "0",
            "--store", str(tmp_path / "store"), "--workers", str(MIN_WORKERS), "--actors", "0"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "warmboot demo summary" in done.stdout and "whatif's forecast of the v1 drop" in done.stdout
    assert "Traceback" not in done.stderr
    assert "refused" not in done.stdout, done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("gvisor-v", "microvm-v"))]
    assert len(rows) == 8, done.stdout  # per class: v1 dropped and v2, on the oldest and the newest generation
    assert all(int(row[2]) >= 1 for row in rows), done.stdout  # WORKERS before the drop


def test_a_fleet_too_small_for_its_actors_says_its_refusals_are_the_size_asked_for(tmp_path):
    """Ten actors a worker is more than the demo's fleet holds once it retires its oldest generation (a
    user's trial, `--workers 5000 --actors 50000`, counted 3,115 RESOURCE_EXHAUSTED and as many
    FAILED_PRECONDITION, and said nothing of why). The resumes refused for want of room are said to be
    the size asked for, in the scheduler's words, by phase; the actors they left not running are not
    asked to pause (the FAILED_PRECONDITION were those pauses); and, piped, the progress is plain lines."""
    args = [WARMBOOT, "up", "--demo", "--exit-after-demo", "--port", "0", "--metrics-port", "0",
            "--store", str(tmp_path / "store"), "--workers", str(MIN_WORKERS), "--actors", str(10 * MIN_WORKERS)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "COLUMNS"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout
    assert "refused RESOURCE_EXHAUSTED, resume (see below)" in out and "FAILED_PRECONDITION" not in out, out
    assert "pause not asked, its actor refused before" in out, out
    assert re.search(r"^\d+ resumes in 'memory restores' refused RESOURCE_EXHAUSTED: 0/\d+ workers available: ", out,
                     re.MULTILINE), out
    assert "refused for want of room (RESOURCE_EXHAUSTED naming no field): the fleet was full. That is the size " \
           f"asked for, not a fault: {10 * MIN_WORKERS} actors" in out, out
    assert re.search(r"^\d+ pauses in 'pause again' not asked: the actor was not RUNNING", out, re.MULTILINE), out
    assert "cold-start resumes: done in " in out and "settle: done in " in out  # each phase's line, piped


def test_a_demo_config_it_cannot_run_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=f"workers: {MIN_WORKERS - 1} is too few"):
        DemoConfig(workers=MIN_WORKERS - 1)
    with pytest.raises(ValueError, match="actors: -1 is not a number of actors"):
        DemoConfig(actors=-1)
    assert DemoConfig(workers=MIN_WORKERS, actors=0).workers == MIN_WORKERS


async def test_a_request_cancelled_before_its_turn_is_closed_not_left_never_awaited():
    """A demo stopped by a refusal cancels its requests waiting for their turn: each was printed
    "RuntimeWarning: coroutine 'Client.drain' was never awaited" under the one-line error."""
    demo = Demo(None, "warmboot", DemoConfig(concurrency=1))
    sent: list[int] = []

    async def request() -> None:
        sent.append(1)

    await demo.gate.acquire()  # the only turn is taken
    waiting = request()
    call = demo.call(waiting)
    call.send(None)  # runs until it waits for its turn
    with pytest.raises(asyncio.CancelledError):
        call.throw(asyncio.CancelledError())
    assert inspect.getcoroutinestate(waiting) == inspect.CORO_CLOSED and sent == []


@pytest.mark.parametrize("args, flag", [
    (["--exit-after-demo"], "--exit-after-demo"),
    (["--workers", "8"], "--workers"),
    (["--actors", "10"], "--actors"),
    (["--no-demo", "--workers", "60"], "--workers"),  # its default, but given
])
def test_a_demo_option_without_demo_is_refused_not_ignored(tmp_path, args, flag):
    """`up --exit-after-demo` (or `--workers 8`) without --demo served on as if not given (a process,
    so that one that serves on is ended by the time-out)."""
    store = tmp_path / "store"
    done = subprocess.run([WARMBOOT, "up", "--port", "0", "--metrics-port", "0", "--store", str(store), *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error: {flag} is the demo's option: it needs --demo (`up` without it runs no demo)" in done.stderr
    assert not store.exists()


def test_a_metrics_port_taken_is_said_before_the_store_is_made(tmp_path):
    """It said "new store", then that the metrics port was in use, and left the store (JetStream
    data, the configuration, the lock file); a store that was there was started on and rewritten."""
    kept = tmp_path / "kept"
    from warmboot.natsserver import NatsServer

    NatsServer(kept.resolve(), name="warmboot").start().stop()  # a store with a log in it
    before = contents(kept)
    with held_port() as taken:
        port = taken.getsockname()[1]
        for store in (tmp_path / "new" / "store", kept):
            result = CliRunner().invoke(main, ["up", "--port", "0", "--metrics-port", str(port),
                                               "--store", str(store)])
            assert result.exit_code == 1, result.output
            assert (f"error: [Errno 98] cannot serve metrics on 127.0.0.1:{port}: Address already in use; "
                    "try another --metrics-port, or 0 for any free one") in result.output
            assert "new store" not in result.output and "reusing" not in result.output
            assert "Traceback" not in result.output
    assert not (tmp_path / "new").exists()
    assert contents(kept) == before


def test_a_start_that_fails_removes_what_it_made_and_only_that(tmp_path, monkeypatch):
    """With the NATS port taken: `--store a/b/store` removed the store but left a/ and a/b/, made for
    it; a store directory that was there, empty, kept the configuration and JetStream directory made in
    it (its lock file stays, as a reset leaves it). A review's findings: a dangling symlink in the store
    (a volume not mounted yet) was taken for nothing there, and removed; and what was made was removed
    after the store's lock was let go, so another `up` that had just taken it lost its new store."""
    import warmboot.cmd_up
    from warmboot.natsserver import NatsServer, StoreInUse

    made = tmp_path / "a" / "b" / "store"
    there = tmp_path / "there"
    there.mkdir()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "warmboot").symlink_to(tmp_path / "not-mounted-yet")
    remove, held = warmboot.cmd_up._remove, []

    def remove_under_the_lock(paths, store) -> None:
        try:  # another `up` on the store, meanwhile: refused, so it writes nothing the removal could take
            NatsServer(store, name="warmboot").lock_store()
        except StoreInUse:
            held.append(store)
        remove(paths, store)

    monkeypatch.setattr(warmboot.cmd_up, "_remove", remove_under_the_lock)
    with held_port() as taken:
        port = taken.getsockname()[1]
        for store in (made, there, linked):
            result = CliRunner().invoke(main, ["up", "--port", str(port), "--metrics-port", "0",
                                               "--store", str(store)])
            assert result.exit_code == 1, result.output
            if store is not linked:  # (nats-server cannot make its directory where the symlink is)
                assert f"(is another warmboot or NATS on port {port}? try --port 0)" in result.output
    assert held == [made.resolve(), there.resolve(), linked.resolve()]

    # another `up` took the lock the failed start let go, before this one could remove what it made: kept
    taken_over, others = tmp_path / "taken-over", []
    unlock = NatsServer.unlock

    def then_another_takes_the_store(server) -> None:  # the failed start's letting go of it
        unlock(server)
        if not others and server.store_dir == taken_over.resolve():
            others.append(NatsServer(server.store_dir, name="warmboot"))
            others[0].lock_store()

    monkeypatch.setattr(NatsServer, "unlock", then_another_takes_the_store)
    with held_port() as taken:
        result = CliRunner().invoke(main, ["up", "--port", str(taken.getsockname()[1]), "--metrics-port", "0",
                                           "--store", str(taken_over)])
    assert result.exit_code == 1 and len(others) == 1, result.output
    assert (taken_over / "warmboot.conf").exists()  # its now: nothing removed
    unlock(others[0])
    assert not (tmp_path / "a").exists()
    assert there.is_dir() and [p.name for p in there.iterdir()] == ["warmboot.lock"]
    assert (linked / "warmboot").is_symlink() and os.readlink(linked / "warmboot") == str(tmp_path / "not-mounted-yet")


async def test_up_makes_an_earlier_version_s_synced_heartbeat_bucket_anew_unsynced(tmp_path):
    """A store an earlier version served holds the heartbeat bucket as it made it, each put synced: with every
    write synced that bounds heartbeats (docs/operations.md, Durability), and a stream's mode cannot change.
    `up` holds its store's lock and runs the only registry, so it deletes that bucket before the registry
    starts, says so, and the registry makes it anew unsynced; a bucket of this version is left as it is."""
    import re
    import signal

    import nats
    from nats.js.api import PersistMode

    from events.subjects import DEFAULT_PREFIX, bucket_name
    from services.registry.liveness import Liveness
    from tests.secured_helpers import Child
    from warmboot.natsserver import NatsServer

    store = tmp_path / "store"
    stream = f"KV_{bucket_name(DEFAULT_PREFIX, 'heartbeats')}"
    earlier = NatsServer(store.resolve(), name="warmboot").start()  # as `up` runs it, on the same store
    try:
        nc = await nats.connect(earlier.url)
        try:  # the bucket as the earlier version made it: nats-py's own, synced
            await nc.jetstream().create_key_value(Liveness(nc, DEFAULT_PREFIX, 15, None).bucket_config())
        finally:
            await nc.close()
    finally:
        earlier.stop()
    said = "the heartbeat bucket an earlier version made, each put synced, is made anew unsynced"
    for made_anew in (True, False):  # and a second start leaves this version's bucket as it is
        up = Child([WARMBOOT, "up", "--port", "0", "--metrics-port", "0", "--store", str(store)],
                   re.compile(r"^serving; Ctrl-C stops"))
        up.start(timeout=120)
        try:
            assert (said in up.output) is made_anew, up.output
            nc = await nats.connect(up.line("NATS     ").split()[1])
            try:
                assert (await nc.jetstream().stream_info(stream)).config.persist_mode == PersistMode.ASYNC
            finally:
                await nc.close()
        finally:
            code = up.signal(signal.SIGINT)
        assert code == 0, up.output[-2000:]
        assert "persist mode default" not in up.output, up.output


def test_reset_on_a_port_taken_keeps_the_log(tmp_path):
    """`up --reset --port P` with P taken discarded the store's log ("resetting the store"), then failed on
    the port (a user trial): the reset the user asked for, and no server to show for it. The port is
    checked before the reset: refused, exit 1, the store as it was."""
    from warmboot.natsserver import NatsServer

    kept = tmp_path / "kept"
    NatsServer(kept.resolve(), name="warmboot").start().stop()  # a store with a log in it
    before = contents(kept)
    assert any(name.startswith("warmboot/") for name in before), before
    with held_port() as taken:
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["up", "--reset", "--port", str(port), "--metrics-port", "0",
                                           "--store", str(kept)])
    assert result.exit_code == 1, result.output
    assert "resetting the store" not in result.output, result.output
    assert f"the store {kept} is kept as it was, nothing reset" in result.output, result.output
    assert f"(is another warmboot or NATS on port {port}? try --port 0)" in result.output
    assert contents(kept) == before
