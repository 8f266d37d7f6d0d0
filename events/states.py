"""The states of a worker and of an actor, as every service names them (one definition).

The snapshotter decides with them, the scheduler's projection folds into them, and
explanations and views print their values.
"""

from __future__ import annotations

import enum


class WorkerState(enum.Enum):
    """A registered worker: taking placements, or drained (a removed worker has no state)."""

    REGISTERED = "REGISTERED"
    DRAINED = "DRAINED"


class ActorState(enum.Enum):
    CREATED = "CREATED"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    SUSPENDED = "SUSPENDED"
    STOPPED = "STOPPED"


# States in which an actor waits for a resume: its latest snapshot is what a resume restores.
WAITING = frozenset((ActorState.CREATED, ActorState.PAUSED, ActorState.SUSPENDED))
