"""What a worker agent keeps on disk across its processes, beside its state file: the last revision it made
(`RevisionFile`, the state file itself) and that it stopped as superseded (`SupersededRecord`); and, on the disk
of its node's LOCAL snapshots, which disk that is (`NodeToken`)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import IO

from events.schema import ID_RE, ID_WORDS, MAX_REVISION
from warmboot.agent_config import ConfigError
from warmboot.files import create_whole, take_lock, write_atomically


class StateFileError(ConfigError):
    """A file the agent keeps (its state file, the node's token) cannot be read or written: no registration
    goes out with a revision, or a node token, it does not keep."""


class RevisionFile:
    """The last revision an agent made for its worker, kept on disk across its processes.

    A revision read off the clock orders an agent's registrations only while its clock never
    goes back: a process whose clock ran ahead (stepped back by NTP before the next one starts)
    could leave an edit in flight, unanswered, with a revision above the next process's, and a
    stalled replica deciding it late would apply it. Written (and synced) before the revision is
    sent, this file makes the next process start above anything an earlier one sent. It names
    its worker (`<worker_id> <revision>`): a file of another worker's is refused."""

    def __init__(self, path: Path, worker_id: str):
        self.path = path
        self.worker_id = worker_id

    def read(self) -> int:
        """The revision kept (0 if the file does not exist yet); StateFileError if it cannot be read."""
        try:
            text = self.path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return 0
        except (OSError, UnicodeDecodeError) as e:
            raise StateFileError(f"state file {self.path}: cannot read: {e}") from None
        worker_id, _, number = text.partition(" ")
        if worker_id != self.worker_id:
            raise StateFileError(f"state file {self.path}: keeps the revision of worker {worker_id[:128]!r}, not "
                                 f"{self.worker_id!r}: give each agent a file of its own")
        if not (number.isdigit() and len(number) <= 16 and int(number) <= MAX_REVISION):
            raise StateFileError(f"state file {self.path}: holds no revision (a whole number up to {MAX_REVISION}), "
                                 f"but {number[:40]!r}; remove it to start from the clock")
        return int(number)

    def hold(self) -> IO[str]:
        """Hold the file for this process (`FILE.lock` beside it; the open lock file, which holds it until closed
        or the process ends): StateFileError if another process holds it. Two agents given one state file, of
        one worker id on one machine, would each go above the other's revisions, take the worker from each
        other, and each, restarted, find the other's revision there as if it were its own."""
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            handle, holder = take_lock(lock)
        except OSError as e:
            raise StateFileError(f"state file {self.path}: cannot take its lock {lock}: {e}") from None
        if handle is None:
            raise StateFileError(
                f"state file {self.path} is in use by another agent (process {holder}, {lock}): two agents of "
                f"worker {self.worker_id} on one machine take the worker from each other, fencing every placement "
                "on it; run one agent of it (stop an agent before starting its replacement), and give each agent "
                "a state file of its own")
        return handle

    def write(self, revision: int) -> None:
        """Replace the kept revision, durably (written, synced, renamed over): StateFileError if it cannot be."""
        try:
            write_atomically(self.path, f"{self.worker_id} {revision}\n", encoding="ascii")
        except OSError as e:
            raise StateFileError(f"state file {self.path}: cannot keep revision {revision} there: {e}; no "
                                 "registration is sent with a revision it does not keep") from None


class SupersededRecord:
    """That the agent stopped as Superseded, kept across its processes beside its state file, in
    `<state-file>.superseded`: `<worker_id> <node> <revision>`, the node and the revision of the
    registration in force it stopped for. A file of its own, not a line or a token added to the state
    file: an agent of an earlier version refuses a state file holding more than `<worker_id> <revision>`
    (`RevisionFile.read`), and ignores this one (it takes the worker back at its start, as it did). The
    next process reads it at its start (`Agent._check_still_superseded`), and clears it once it registers."""

    SUFFIX = ".superseded"

    def __init__(self, state_file: Path, worker_id: str):
        self.path = state_file.with_name(state_file.name + self.SUFFIX)
        self.worker_id = worker_id

    def read(self) -> tuple[str, int] | None:
        """The node and the revision recorded (None: the agent did not stop as Superseded); StateFileError
        if the file cannot be read or holds something else."""
        try:
            text = self.path.read_text(encoding="ascii")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            raise StateFileError(f"{self.path}: cannot read: {e}") from None
        words = text.split()
        if words and words[0] != self.worker_id:
            raise StateFileError(f"{self.path}: records a stop of worker {words[0][:128]!r}, not {self.worker_id!r}: "
                                 "give each agent a state file of its own")
        if len(words) != 3 or not (words[2].isdigit() and len(words[2]) <= 16):
            raise StateFileError(f"{self.path}: holds no record of a stop as superseded (`{self.worker_id} NODE "
                                 f"REVISION`), but {text[:80]!r}; remove it (this agent then registers at its "
                                 "start, taking the worker from another agent, if one holds it)")
        return words[1], int(words[2])

    def write(self, node: str, revision: int) -> None:
        """Record a stop for `node`'s registration `revision`, durably: StateFileError if it cannot be."""
        try:
            write_atomically(self.path, f"{self.worker_id} {node} {revision}\n", encoding="ascii")
        except OSError as e:
            raise StateFileError(f"{self.path}: cannot record the stop as superseded: {e}") from None

    def clear(self) -> None:
        """No longer superseded; StateFileError if the record cannot be removed."""
        try:
            self.path.unlink(missing_ok=True)
        except OSError as e:
            raise StateFileError(f"{self.path}: cannot remove the record of a stop as superseded: {e}") from None


class NodeToken:
    """Which disk of its node a worker runs on: a token kept in a file on the disk that holds the node's LOCAL
    snapshots (`--node-token-file`), the same file for every worker of the node, registered with each of their
    registrations (`RegisterWorker.node_token`). A LOCAL image restores only where the token of the disk it was
    written to is registered (docs/contract.md, rule 5): a machine replaced under the old node name, a new disk,
    makes a new token, and is not sent the old disk's images, which it does not have.

    The file holds the token and a newline. Made when absent, with a new random token (`uuid4().hex`), written
    whole beside it and linked into place (`create_whole`): agents of one node starting at once agree on one
    token. Its directory is not made: a disk not mounted must not be given a token of another disk's."""

    def __init__(self, path: Path):
        self.path = path
        self.made = False  # whether `read_or_make` made the file (not another process, nor an earlier start)

    def read(self) -> str | None:
        """The token the file holds (None if there is no file); StateFileError if it cannot be read or holds
        something else."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(256)  # a token and its newline are 129 bytes at most
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StateFileError(f"node token file {self.path}: cannot read: {e}") from None
        text = data.decode("ascii", errors="replace").rstrip()
        if not ID_RE.match(text):
            raise StateFileError(
                f"node token file {self.path}: holds no node token ({ID_WORDS}), but {text[:40]!r}: it was not "
                "written by warmboot. Give the agent the file warmboot made on this disk; delete this one only to "
                "give up the LOCAL snapshots written on this disk (a new token is then made, and their actors must "
                "be reverted: `warmboot actor revert`)")
        return text

    def read_or_make(self) -> str:
        """The token the file holds, the file made first if absent (by this process or another at once: one
        token either way); StateFileError if it cannot be read or made."""
        token = self.read()
        if token is not None:
            return token
        directory = self.path.parent
        if not directory.is_dir():
            raise StateFileError(
                f"node token file {self.path}: no directory {directory}: the file is kept on the disk that holds "
                "this node's LOCAL snapshots, and the agent does not make its directory (a disk not mounted would "
                "be given a token of its own); mount the disk, or make the directory")
        try:
            self.made = create_whole(self.path, f"{uuid.uuid4().hex}\n", encoding="ascii")
        except OSError as e:
            raise StateFileError(f"node token file {self.path}: cannot make it: {e}") from None
        token = self.read()  # this process's token, or that of another which made the file first
        if token is None:
            raise StateFileError(f"node token file {self.path}: removed as soon as it was made; start the agent again")
        return token
