"""Files written whole or not at all.

A file another process reads at any time (the agent's state file; the nats-server
configuration a member includes, reloads or restarts on) is written beside itself, synced,
renamed over the old one, and the rename synced: a crash, a full disk or a kill in between
leaves the old file, never an empty or partial one. A `cluster` or `accounts` block read
half-written is one without its authorization, which nats-server takes.
"""

from __future__ import annotations

import os
from contextlib import suppress
from pathlib import Path


def write_atomically(path: Path, text: str, mode: int | None = None, encoding: str = "utf-8") -> None:
    """Replace `path` with `text`, durably; with `mode`, the file has that mode from its creation
    (a secret is never readable by others, not even for a moment). OSError if it cannot be: `path`
    is then as it was."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
        with os.fdopen(fd, "w", encoding=encoding) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(temporary, mode)  # a leftover temporary file kept its mode through O_CREAT: set it
        os.replace(temporary, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(temporary)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
