"""The node's token (`--node-token-file`): which disk of its node a worker runs on, for rule 5's LOCAL images.

The agent reads the file on the disk of the node's LOCAL snapshots, makes it when absent (one token for agents
of the node starting at once), refuses a file it did not write, and every registration it sends carries the
token; `--print-registration` shows it without making it."""

from __future__ import annotations

import re
import threading

import pytest

from warmboot.agent_state import NodeToken, StateFileError


# --- the file ------------------------------------------------------------------------------------


def test_a_token_is_made_when_absent_and_read_back_unchanged(tmp_path):
    path = tmp_path / "node.token"
    assert NodeToken(path).read() is None  # a look makes nothing
    assert not path.exists()
    token = NodeToken(path).read_or_make()
    assert re.fullmatch(r"[0-9a-f]{32}", token), token
    assert path.read_text() == f"{token}\n"
    assert NodeToken(path).read_or_make() == token == NodeToken(path).read()  # kept, not made again
    assert path.read_text() == f"{token}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node.token"]  # no temporary file left
    other = NodeToken(tmp_path / "other.token").read_or_make()
    assert other != token  # random: another disk's file makes another token


def test_agents_of_a_node_starting_at_once_agree_on_one_token(tmp_path):
    """20 makers at once on one absent file, round after round: each reads the same token, the one the file
    holds; exactly one file, no temporary file left beside it. (Threads: each maker's syscalls run outside the
    GIL; a maker that wrote its token over the file made the rounds disagree every time, one that looked for
    the file before writing it over now and then.)"""
    for round_ in range(30):
        directory = tmp_path / f"round-{round_}"
        directory.mkdir()
        path = directory / "node.token"
        start = threading.Barrier(20)
        tokens: list[str] = []

        def make() -> None:
            start.wait()
            try:
                tokens.append(NodeToken(path).read_or_make())
            except Exception as e:  # noqa: BLE001 - said by the assertion below
                tokens.append(f"error: {e}")

        threads = [threading.Thread(target=make) for _ in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert tokens == [path.read_text().rstrip("\n")] * 20, (round_, set(tokens))
        assert [p.name for p in directory.iterdir()] == ["node.token"]


@pytest.mark.parametrize("text", ["not a token!\n", "", "\n", "a" * 129 + "\n", "-abc\n", "tok en\n", "\xff\xfe\n"],
                         ids=["words", "empty", "newline", "too-long", "leading-dash", "space", "binary"])
def test_a_file_warmboot_did_not_write_is_refused_naming_it_and_left_alone(tmp_path, text):
    path = tmp_path / "node.token"
    path.write_bytes(text.encode("latin-1"))
    for call in (NodeToken(path).read, NodeToken(path).read_or_make):
        with pytest.raises(StateFileError) as refused:
            call()
        said = str(refused.value)
        assert said.startswith(f"node token file {path}: holds no node token"), said
        assert "not written by warmboot" in said and "give up the LOCAL snapshots written on this disk" in said
    assert path.read_bytes() == text.encode("latin-1")  # not replaced by a new token


def test_an_unreadable_file_and_a_missing_directory_are_refused_naming_them(tmp_path):
    path = tmp_path / "node.token"
    path.mkdir()  # not a file: cannot be read
    with pytest.raises(StateFileError, match=rf"^node token file {re.escape(str(path))}: cannot read: "):
        NodeToken(path).read_or_make()
    missing = tmp_path / "not-mounted" / "node.token"
    with pytest.raises(StateFileError) as refused:
        NodeToken(missing).read_or_make()
    assert f"no directory {missing.parent}" in str(refused.value) and "mount the disk" in str(refused.value)
    assert not missing.parent.exists()  # not made


def test_any_id_is_a_token(tmp_path):
    """A token is an Id, as the schema's `node_token` is: one of 128 characters is read as it is (the tokens
    the agent makes are 32 hex characters)."""
    path = tmp_path / "node.token"
    path.write_text("A" + "b_-9" * 31 + "xyz\n")
    assert NodeToken(path).read_or_make() == "A" + "b_-9" * 31 + "xyz"
