"""What one atomic append is made of: its messages, and the guard of each subject they touch.

Built by the recorders (`Batch.add`, in call order), sent by `stream.Stream.append`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eventsourcing.persistence import IntegrityError


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
    """The messages of one atomic append, and the guard of each subject they touch."""

    outs: list[Out] = field(default_factory=list)
    guards: dict[str, Guard] = field(default_factory=dict)

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
