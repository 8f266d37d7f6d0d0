"""Which workers are registered: a fold of their events, no I/O.

The registry answers a heartbeat from this fold (`services.registry.fold` keeps it
current from the log and says how current it is). It keeps the workers in a life (a
`WorkerRegistered` not followed by a `WorkerRemoved`), each with the stream sequence
of its last event, the node it registered on and the revision of its registration in force
(its fold reads those two fields of a registration's, an update's and a runtime change's
body), and its drain in force (the sequence of its `WorkerDrained` and the reason that body
gives: a heartbeat's answer says it); nothing else of a worker's history, so that a heartbeat reads a dict entry or two
instead of loading the worker's events. A removed worker leaves nothing behind: the roster
grows with the fleet, not with every worker id it ever saw.

What an event does to a life is read from its type alone (the store's topic header, else the
body's `type`): a registration starts a life, a removal ends it, every other worker
event (RuntimeChanged, WorkerUpdated, WorkerDrained) leaves it as it is; a drain lasts as
long as the life it was written in (a new life is undrained). A type this
replica does not know (a newer registry's event, which may end a life, or a message
that is no event) leaves the roster unable to vouch for the worker: it drops it, and
the worker's history answers for it from then on.
"""

from __future__ import annotations

from collections.abc import Iterator

from events.schema import Drained, WorkerEvent

STARTS_LIFE = "WorkerRegistered"
ENDS_LIFE = "WorkerRemoved"
NAMES_NODE = frozenset((STARTS_LIFE, "WorkerUpdated"))  # the events whose body says the worker's node
REVISES = NAMES_NODE | {"RuntimeChanged"}  # the events a registration writes: their body says its revision
DRAINS = "WorkerDrained"  # its body says the drain's reason
KNOWN = frozenset(cls.__name__ for cls in WorkerEvent.__subclasses__())  # the events of a worker's history


class Roster:
    """worker_id -> sequence of its last event, for the workers in a life; folded in stream order."""

    __slots__ = ("_alive", "_nodes", "_revisions", "_drains", "seq", "events")

    def __init__(self) -> None:
        self._alive: dict[str, int] = {}  # the workers in a life: the sequence of the last event of each
        self._nodes: dict[str, str] = {}  # the node of each worker in a life, when its events said it
        self._revisions: dict[str, int] = {}  # the revision of each one's registration in force, when said
        self._drains: dict[str, Drained] = {}  # the drain of each drained one in its life (a heartbeat's answer)
        self.seq = 0  # the sequence of the last event folded
        self.events = 0

    def apply(self, seq: int, worker_id: str, event_type: str, node: str | None = None,
              revision: int | None = None, reason: str | None = None) -> None:
        """Fold the worker event `event_type` stored at `seq` (sequences only grow); `node`, the
        node a registration or an update names, and `revision`, the revision of the registration
        that wrote it (None: not read, or none); `reason`, the reason a drain gives."""
        if event_type == ENDS_LIFE or event_type not in KNOWN:
            self._alive.pop(worker_id, None)
            self._nodes.pop(worker_id, None)
            self._revisions.pop(worker_id, None)
            self._drains.pop(worker_id, None)
        elif event_type == STARTS_LIFE or worker_id in self._alive:
            self._alive[worker_id] = seq
            if event_type == STARTS_LIFE:
                self._drains.pop(worker_id, None)
            elif event_type == DRAINS:
                self._drains[worker_id] = Drained(seq=seq, reason=reason)
            if event_type in NAMES_NODE:
                _keep(self._nodes, worker_id, node)
            if event_type in REVISES:
                _keep(self._revisions, worker_id, revision)
        self.seq = seq
        self.events += 1

    def alive(self, worker_id: str) -> bool:
        return worker_id in self._alive

    def node(self, worker_id: str) -> str | None:
        """The node the worker registered on, in its current life (None: not in one, or not read)."""
        return self._nodes.get(worker_id)

    def revision(self, worker_id: str) -> int | None:
        """The revision of the worker's registration in force (None: not in a life, or registered
        without one, or not read)."""
        return self._revisions.get(worker_id)

    def drained(self, worker_id: str) -> Drained | None:
        """The worker's drain in its current life (None: not drained, or not in a life)."""
        return self._drains.get(worker_id)

    def last_seq(self, worker_id: str) -> int:
        """The sequence of the worker's last event in its current life, 0 if it is not in one."""
        return self._alive.get(worker_id, 0)

    def registered(self) -> Iterator[str]:
        """The workers in a life, in no particular order."""
        return iter(list(self._alive))

    def __len__(self) -> int:
        return len(self._alive)


def _keep(values: dict, worker_id: str, value: object) -> None:
    if value is None:
        values.pop(worker_id, None)
    else:
        values[worker_id] = value
