"""Which workers are registered: a fold of their events, no I/O.

The registry answers a heartbeat from this fold (`services.registry.fold` keeps it
current from the log and says how current it is). Per worker it keeps whether it is
in a life (a `WorkerRegistered` not followed by a `WorkerRemoved`) and the stream
sequence of its last event; nothing else of a worker's history, so that a
heartbeat reads one dict entry instead of loading the worker's events.

What an event does is read from its type alone (the store's topic header, else the
body's `type`): a registration starts a life, a removal ends it, every other worker
event (RuntimeChanged, WorkerUpdated, WorkerDrained) leaves it as it is.
"""

from __future__ import annotations

from collections.abc import Iterator

STARTS_LIFE = "WorkerRegistered"
ENDS_LIFE = "WorkerRemoved"


class Roster:
    """worker_id -> (alive, sequence of its last event), folded in stream order."""

    __slots__ = ("_last", "_alive", "seq", "events")

    def __init__(self) -> None:
        self._last: dict[str, int] = {}  # every worker with an event: the sequence of its last one
        self._alive: set[str] = set()  # the workers in a life
        self.seq = 0  # the sequence of the last event folded
        self.events = 0

    def apply(self, seq: int, worker_id: str, event_type: str) -> None:
        """Fold the worker event `event_type` stored at `seq` (sequences only grow)."""
        if event_type == STARTS_LIFE:
            self._alive.add(worker_id)
        elif event_type == ENDS_LIFE:
            self._alive.discard(worker_id)
        self._last[worker_id] = seq
        self.seq = seq
        self.events += 1

    def alive(self, worker_id: str) -> bool:
        return worker_id in self._alive

    def last_seq(self, worker_id: str) -> int:
        """The sequence of the worker's last event, 0 if it has none."""
        return self._last.get(worker_id, 0)

    def registered(self) -> Iterator[str]:
        """The workers in a life, in no particular order."""
        return iter(list(self._alive))

    def __len__(self) -> int:
        return len(self._alive)
