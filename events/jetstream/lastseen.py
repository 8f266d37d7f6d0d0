"""What this process knows of each subject's last message, from its own reads and writes.

The append protocol takes its expected last subject sequences from here, and a read
that comes back older than what is known here is read again (`retry.catch_up`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Last:
    """What is known of a subject's last message: its stream sequence and position."""

    seq: int  # 0: the subject has no message
    position: int | None  # the version (events) or notification id (tracking); None if empty


class LastSeen:
    """A bounded map subject -> Last, filled by reads and by our own writes."""

    def __init__(self, capacity: int = 65_536):
        self.capacity = capacity
        self.entries: OrderedDict[str, Last] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, subject: str) -> Last | None:
        with self.lock:
            last = self.entries.get(subject)
            if last is not None:
                self.entries.move_to_end(subject)
            return last

    def forget(self, prefixes: list[str]) -> None:
        """Drop what is known of subjects under `prefixes` (their stream was made anew)."""
        with self.lock:
            for subject in [s for s in self.entries if s.startswith(tuple(prefixes))]:
                del self.entries[subject]

    def put(self, subject: str, last: Last, authoritative: bool = False) -> None:
        """Remember `last`; a read that may be older than what is known does not replace it,
        what the stream leader said or acknowledged does."""
        with self.lock:
            known = self.entries.get(subject)
            if not authoritative and known is not None and known.seq > last.seq:
                return
            self.entries[subject] = last
            self.entries.move_to_end(subject)
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)
