"""docs/security.md, "Generating the configuration": a name listed under another role than before gets
a new secret, so that a worker's machine, which holds the worker's seed, does not end up with a
client's rights. The seed files of `--seeds-dir` keep the owner they had when written again
(`warmboot.files.write_atomically`, for a file a server's own user reads), and are written through a
symbolic link: a seed file handed to a worker agent's user on this host (chowned to it, or linked to
where it reads it) would then hold the client's new seed, readable by that user, and an agent
following its seed file (`events.natspy.connections.follow_seed_file`) would sign in as the client at
its next reconnect. Checked on a real nats-server run with the generated block."""

from __future__ import annotations

import os
import stat

import nats
import pytest
from click.testing import CliRunner

from events.subjects import service_subject
from warmboot.cli import main
from warmboot.natsserver import NatsServer

PREFIX = "holders"
AGENT_UID = 4242  # the unix user a worker agent on this host runs as


def _run(tmp_path, seeds, *role):
    result = CliRunner().invoke(main, ["nats-config", "--prefix", PREFIX, "--auth", "nkey", "--seeds-dir", str(seeds),
                                       "--operator", "ops", "--worker", "w-1", *role,
                                       "--out", str(tmp_path / "auth.conf")])
    assert result.exit_code == 0, result.output
    return result


async def _signs_in_as_a_client(tmp_path, seed_file) -> bool:
    """Whether the seed in `seed_file` may stop an actor on a server run with the generated block."""
    server = NatsServer(tmp_path / "nats", extra_config=(tmp_path / "auth.conf").read_text()).start()
    refused: list[str] = []

    async def on_error(error: Exception) -> None:
        refused.append(str(error))

    try:
        nc = await nats.connect(server.url, nkeys_seed=str(seed_file), inbox_prefix="_INBOX.bob", error_cb=on_error,
                                allow_reconnect=False)
        try:
            await nc.publish(service_subject(PREFIX, "snapshotter", "stop", "a-1"), b"{}")
            await nc.flush()
            await nc.flush()  # the server's -ERR, if any, comes before the second PONG
        finally:
            await nc.close()
    finally:
        server.stop()
    return not any("permissions violation" in e.lower() for e in refused)


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another owner is made by root only")
async def test_a_client_s_new_seed_is_not_left_to_the_worker_agent_that_held_the_name_s_seed_file(tmp_path):
    seeds = tmp_path / "seeds"
    _run(tmp_path, seeds, "--worker", "bob")
    os.chown(seeds / "bob.nk", AGENT_UID, AGENT_UID)  # handed to bob's agent, which runs on this host
    moved = _run(tmp_path, seeds, "--client", "bob")
    assert "new secrets for users listed in another role than before: bob" in moved.output
    # what bob.nk holds now is a client's seed: it stops actors
    assert await _signs_in_as_a_client(tmp_path, seeds / "bob.nk")
    st = (seeds / "bob.nk").stat()
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid != AGENT_UID, "the worker agent's user reads the client's seed"


async def test_a_client_s_new_seed_is_not_written_through_the_link_the_worker_agent_read_its_seed_by(tmp_path):
    seeds = tmp_path / "seeds"
    _run(tmp_path, seeds, "--worker", "bob")
    agents = tmp_path / "bob-agent"  # where bob's agent reads its seed, linked from the seeds directory
    agents.mkdir()
    (seeds / "bob.nk").rename(agents / "bob.nk")
    (seeds / "bob.nk").symlink_to(agents / "bob.nk")
    worker_seed = (agents / "bob.nk").read_text()
    _run(tmp_path, seeds, "--client", "bob")
    assert await _signs_in_as_a_client(tmp_path, seeds / "bob.nk")
    assert (agents / "bob.nk").read_text() == worker_seed, "the worker agent's seed file holds the client's seed"
    assert not (seeds / "bob.nk").is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="a file of another owner is made by root only")
async def test_a_seed_kept_for_its_role_elsewhere_is_not_written_over_another_role_s_seed_file(tmp_path):
    """The roles the seeds directory records say whose each file is: a secrets file that keeps bob's
    client seed (from a run that listed bob as a client) does not write it over the file the directory
    records as the worker bob's, which that worker's agent holds."""
    seeds = tmp_path / "seeds"
    _run(tmp_path, seeds, "--client", "bob", "--secrets", str(tmp_path / "s1.json"))
    _run(tmp_path, seeds, "--worker", "bob", "--secrets", str(tmp_path / "s2.json"))
    os.chown(seeds / "bob.nk", AGENT_UID, AGENT_UID)  # handed to bob's agent, which runs on this host
    _run(tmp_path, seeds, "--client", "bob", "--secrets", str(tmp_path / "s1.json"))
    assert await _signs_in_as_a_client(tmp_path, seeds / "bob.nk")
    assert (seeds / "bob.nk").stat().st_uid != AGENT_UID, "the worker agent's user reads the client's seed"
