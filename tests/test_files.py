"""`warmboot.files.write_atomically`, which nats-config's files and the agent's state file are
written with: whole or not at all, and nothing else changed (found by a review of its first
version: a predictable temporary name, the owner lost, a link replaced, an error after the rename
said to have left the file as it was)."""

from __future__ import annotations

import os
import stat

import pytest

from warmboot.files import create_whole, write_atomically
from warmboot.nats_config import _write_private


def test_a_file_planted_at_a_temporary_name_receives_no_secret(tmp_path):
    """Whoever may write in the directory (a shared volume) plants links at the names a temporary
    file could take: the secret goes into none of them, and the file is a file."""
    path = tmp_path / "warmboot-auth.conf"
    theirs = tmp_path / "elsewhere"
    theirs.write_text("")
    os.symlink(theirs, tmp_path / f".{path.name}.{os.getpid()}.tmp")
    _write_private(path, "authorization { password: s3cret }\n")
    assert "s3cret" not in theirs.read_text() and path.read_text() == "authorization { password: s3cret }\n"
    assert not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_temporary_file_left_there_is_not_written_into(tmp_path):
    """A file already at a temporary name (another process's, or planted, held open by a reader)
    is left as it is."""
    path = tmp_path / "warmboot-routes.conf"
    planted = tmp_path / f".{path.name}.{os.getpid()}.tmp"
    planted.write_text("")
    with open(planted) as reader:
        _write_private(path, "routes password s3cret\n")
        assert "s3cret" not in reader.read()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, planted.name])  # nothing else left


def test_an_existing_file_keeps_its_owner_and_group(tmp_path):
    """A nats-server running as its own user, owner of its 0600 accounts file, reads it again on a
    reload: the file written again is still its own. (Another owner than the writer's needs root;
    without root, another group of the writer's own, where it has one.)"""
    path = tmp_path / "warmboot-auth.conf"
    path.write_text("old\n")
    if os.geteuid() == 0:
        uid, gid = 1000, 1001
    else:
        uid, gid = os.getuid(), next((g for g in os.getgroups() if g != os.getgid()), os.getgid())
    os.chown(path, uid, gid)
    os.chmod(path, 0o600)
    _write_private(path, "new\n")
    st = os.stat(path)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), path.read_text()) == (uid, gid, 0o600, "new\n")


def test_without_a_mode_an_existing_file_keeps_its_own_and_a_new_one_gets_the_umask_s(tmp_path):
    kept, new = tmp_path / "kept", tmp_path / "new"
    kept.write_text("old\n")
    os.chmod(kept, 0o640)
    write_atomically(kept, "1\n")
    write_atomically(new, "2\n")
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(kept.stat().st_mode) == 0o640
    assert stat.S_IMODE(new.stat().st_mode) == 0o666 & ~umask


def test_a_symlinked_file_is_written_through_its_link(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "warmboot-auth.conf").write_text("old\n")
    link = tmp_path / "warmboot-auth.conf"
    link.symlink_to(real / "warmboot-auth.conf")
    _write_private(link, "new\n")
    assert link.is_symlink() and (real / "warmboot-auth.conf").read_text() == "new\n"


def test_a_directory_that_refuses_fsync_still_gets_the_file(tmp_path, monkeypatch):
    """Some file systems refuse an fsync of a directory (EINVAL): the rename is done, the new text in
    place, and no error says otherwise."""
    import warmboot.files as files

    path = tmp_path / "warmboot-auth.conf"
    path.write_text("old\n")
    real_fsync = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(22, "Invalid argument")
        return real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    _write_private(path, "new\n")
    assert path.read_text() == "new\n"


def test_create_whole_makes_a_file_once_and_never_replaces_one(tmp_path):
    """`create_whole` (the node's token file): the first call makes the file, with the umask's mode (not the
    temporary file's 0600); a later one, with other text, leaves it as it is; no temporary file stays."""
    path = tmp_path / "node.token"
    assert create_whole(path, "first\n") is True
    assert create_whole(path, "second\n") is False
    assert path.read_text() == "first\n" and [p.name for p in tmp_path.iterdir()] == ["node.token"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    nowhere = tmp_path / "missing" / "node.token"
    with pytest.raises(FileNotFoundError):
        create_whole(nowhere, "x\n")
    assert not nowhere.parent.exists()
