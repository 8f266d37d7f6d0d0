"""What one atomic append is made of: its messages, and the guard of each subject they touch.

Built by the recorders (`Batch.add`, in call order), sent by `stream.Stream.append`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eventsourcing.persistence import IntegrityError, ProgrammingError


@dataclass
class Out:
    """One message of a batch to append."""

    subject: str
    data: bytes
    headers: dict[str, str]
    position: int  # version (events) or notification id (tracking)
    is_event: bool


@dataclass
class Guard:
    """The optimistic-concurrency expectation on one subject of a batch."""

    subject: str
    position_header: str
    first_position: int
    first_index: int
    last_index: int
    last_position: int
    expected: int | None = None  # expected last subject sequence
    given: bool = False  # by the caller (expected_last_seqs): never looked up again


@dataclass
class Batch:
    """The messages of one atomic append, the guard of each subject they touch, and its fences:
    expected last sequences of subjects it writes nothing to (`fence`)."""

    outs: list[Out] = field(default_factory=list)
    guards: dict[str, Guard] = field(default_factory=dict)
    fences: dict[str, int] = field(default_factory=dict)  # subject -> its expected last sequence
    fence_at: dict[int, str] = field(default_factory=dict)  # message index -> the subject it fences

    def fence(self, subject: str, seq: int) -> None:
        """Commit only if `subject`'s last sequence is still `seq` (a subject of none of the batch's
        messages). Carried by a message that has no expectation of its own (one that is not the
        first of its subject), with `Nats-Expected-Last-Subject-Sequence-Subject`; the last such."""
        if subject in self.guards:
            raise ProgrammingError(f"{subject} is written by this call: expect its last sequence, do not fence it")
        if subject in self.fences:
            raise ProgrammingError(f"{subject} is fenced twice in one call")
        firsts = {guard.first_index for guard in self.guards.values()}
        free = [i for i in range(len(self.outs) - 1, -1, -1) if i not in firsts and i not in self.fence_at]
        if not free:
            raise ProgrammingError(
                f"no message of this call can carry a fence on {subject}: each message that is not the first of "
                "its subject carries one"
            )
        self.fences[subject] = seq
        self.fence_at[free[0]] = subject

    def add(self, out: Out, position_header: str) -> None:
        index = len(self.outs)
        guard = self.guards.get(out.subject)
        if guard is None:
            self.guards[out.subject] = Guard(out.subject, position_header, out.position, index, index, out.position)
        else:
            if out.position <= guard.last_position:
                raise IntegrityError(
                    f"{out.subject}: position {out.position} does not follow {guard.last_position} in one call"
                )
            guard.last_index = index
            guard.last_position = out.position
        self.outs.append(out)
