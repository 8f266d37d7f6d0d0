"""Files written whole or not at all, and files held by one process at a time.

A file another process reads at any time (the agent's state file; the nats-server
configuration a member includes, reloads or restarts on) is written beside itself, synced,
renamed over the old one, and the rename synced: a crash, a full disk or a kill in between
leaves the old file, never an empty or partial one. A `cluster` or `accounts` block read
half-written is one without its authorization, which nats-server takes.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from contextlib import suppress
from pathlib import Path
from typing import IO


def write_atomically(path: Path, text: str, mode: int | None = None, encoding: str = "utf-8") -> None:
    """Replace `path` with `text`, durably. The file keeps the owner, group and mode it had (a
    nats-server running as its own user reads what it read before); with `mode`, it has that mode,
    from its creation on (a secret is never readable by others, not even for a moment). A symbolic
    link is written through: its target is replaced. The temporary file beside it is made anew
    (O_EXCL, a random name), so nothing planted or left there receives the text. OSError if it
    cannot be written: `path` is then as it was. The rename is synced where the file system can
    (some refuse an fsync of a directory): once renamed, the text is in place."""
    path = Path(os.path.realpath(path))
    try:
        before: os.stat_result | None = os.stat(path)
    except FileNotFoundError:
        before = None
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding=encoding) as f:
            f.write(text)
            f.flush()
            if before is not None:
                with suppress(PermissionError):  # another owner than the writer's own: only root can give it
                    os.fchown(f.fileno(), before.st_uid, before.st_gid)
            final = mode if mode is not None else (before.st_mode & 0o7777 if before is not None else _default_mode())
            os.fchmod(f.fileno(), final)
            os.fsync(f.fileno())
        os.replace(name, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(name)
        raise
    _sync_directory(path.parent)


def create_whole(path: Path, text: str, encoding: str = "utf-8") -> bool:
    """Make `path` hold `text`, durably, unless it exists: whether this call made it. The text is
    written to a temporary file beside it and synced, then linked to `path` (`os.link`, which never
    replaces a file): of processes making it at once, exactly one makes it, and each sees it whole,
    never empty or partial. The file gets the mode a file created with open() gets. OSError if it
    cannot be made (its directory missing among others): `path` is then as it was."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding=encoding) as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), _default_mode())
            os.fsync(f.fileno())
        try:
            os.link(name, path)
        except FileExistsError:
            return False
    finally:
        with suppress(OSError):
            os.unlink(name)
    _sync_directory(path.parent)
    return True


def _sync_directory(directory: Path) -> None:
    """Sync `directory` (a rename or a link in it is then on disk), where the file system can: some refuse an
    fsync of a directory."""
    with suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _default_mode() -> int:
    """What a file created with open() gets: 0666 less the process's umask (read without changing
    it where /proc says it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o644


def take_lock(path: Path) -> tuple[IO[str] | None, str | None]:
    """Hold the lock file `path` (made if missing; an advisory `flock`, which the kernel lets go of when its
    holder exits, killed too): (the open file, which holds it until closed, with this process's pid written
    in it, None) if nobody held it; else (None, the pid its holder wrote there, or "?"). OSError if it cannot
    be opened."""
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        return None, holder
    except BaseException:
        handle.close()
        raise
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle, None
