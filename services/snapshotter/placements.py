"""Who is placed where: the fold the worker-removal process follows (pure, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Sequence

from events.codec import decoder
from events.schema import ActorPlaced, ActorReleased, ActorStopped, Event, WorkerRegistered, WorkerRemoved, WorkerUpdated


@dataclass(frozen=True)
class Release:
    """A placement to end because its worker was removed."""

    actor_id: str
    worker_id: str
    placed_version: int  # the actor version of the ActorPlaced that made the placement


class PlacementFold:
    """Which actor is placed on which worker, folded from the log in stream order.

    `apply` returns the placements that must be released because of the event:
    every placement on a worker when it is removed, and a placement made on a
    worker that was already removed (a scheduler that had not yet seen the
    removal). A later `WorkerRegistered` of the same id makes it a live worker again.
    """

    def __init__(self) -> None:
        self.on_worker: dict[str, dict[str, int]] = {}  # worker_id -> {actor_id: placed_version}
        self.worker_of: dict[str, str] = {}  # actor_id -> worker_id
        self.removed: set[str] = set()
        # actor_id -> (release, the time of the event that called for it): placements on removed
        # workers whose end the log does not hold yet (a release, a stop, or a placement anew)
        self.unreleased: dict[str, tuple[Release, datetime]] = {}

    def placed_on(self, worker_id: str) -> dict[str, int]:
        return dict(self.on_worker.get(worker_id, {}))

    def apply(self, originator_version: int, e: Event) -> list[Release]:
        if isinstance(e, ActorPlaced):
            self._forget(e.actor_id)
            if e.worker_id in self.removed:
                release = Release(e.actor_id, e.worker_id, originator_version)
                self.unreleased[e.actor_id] = (release, e.at)
                return [release]
            self.on_worker.setdefault(e.worker_id, {})[e.actor_id] = originator_version
            self.worker_of[e.actor_id] = e.worker_id
        elif isinstance(e, (ActorReleased, ActorStopped)):
            self._forget(e.actor_id)
        elif isinstance(e, WorkerRemoved):
            self.removed.add(e.worker_id)
            placed = self.on_worker.pop(e.worker_id, {})
            for actor_id in placed:
                del self.worker_of[actor_id]
            releases = [Release(a, e.worker_id, v) for a, v in sorted(placed.items())]
            for release in releases:
                self.unreleased[release.actor_id] = (release, e.at)
            return releases
        elif isinstance(e, WorkerRegistered):
            self.removed.discard(e.worker_id)
        return []

    def worker_unread(self, worker_id: str) -> None:
        """An event of the worker's history this version cannot read (a newer registry's: its next
        life, say): the worker is no longer taken for removed, so a placement on it afterwards is
        not released as one on a removed worker (it may run there). Its placements stay as folded."""
        self.removed.discard(worker_id)

    def _forget(self, actor_id: str) -> None:
        if self.unreleased:
            self.unreleased.pop(actor_id, None)
        worker_id = self.worker_of.pop(actor_id, None)
        if worker_id is not None:
            actors = self.on_worker[worker_id]
            del actors[actor_id]
            if not actors:
                del self.on_worker[worker_id]


def removed_since(history: Sequence[tuple[int, str]], placed_seq: int) -> int:
    """The sequence of the first `WorkerRemoved` of a worker's `history` ((sequence, topic) of
    each of its events) after `placed_seq`, 0 if none: a placement made at `placed_seq` ended
    there (the worker-removal process releases it), whatever the worker did next."""
    for seq, topic in history:
        if seq > placed_seq and topic == WorkerRemoved.__name__:
            return seq
    return 0


def node_since(history: Sequence[tuple[int, str, bytes]], placed_seq: int, node: str) -> tuple[int, str] | None:
    """(sequence, node) of the first `WorkerUpdated` of a worker's `history` ((sequence, topic, body)
    of each of its events) after `placed_seq` that names another node than `node`, None if none: a
    worker placed on `node` at `placed_seq` that has reported another since (even if back now:
    what ran there may not have come back with it)."""
    for seq, topic, body in history:
        if seq > placed_seq and topic == WorkerUpdated.__name__:
            moved = decoder(WorkerUpdated).decode(body).node
            if moved != node:
                return seq, moved
    return None
