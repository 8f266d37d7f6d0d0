"""One worker as the scheduler's projection has it (`<prefix>.scheduler.worker.<worker_id>`, a project addition).

What `warmboot worker show W` prints: the worker's node, state, labels, capacity and free room, its
classes with their runtimes, the actors booked on it, and the waiting actors whose LOCAL image is on
its node. The CLI folded the whole log for it (71,000 messages, 5.3 s at 10,000 workers: docs/scaling.md);
a scheduler replica's fold has it already. The CLI's fold, when no scheduler answers, gives the same
answer through this function (`warmboot.cmd_worker.worker_view`). Labels are the caller's to give
(`cmd_views.runtime_labels`): the answer names runtimes by version and name, as the wire does. Pure: no I/O.

Its cost to the scheduler: two passes over the actors (those booked on the worker,
`Projection.booked_on`; those whose LOCAL image is on its node, which nothing indexes by node), as
`explain` makes a pass over the workers: an operator's command, not a hot path.
"""

from __future__ import annotations

from typing import Any

from events.errors import no_worker
from events.schema import (ActorOverhead, BookedActor, LocalImage, Resources, Room, WorkerDetail, WorkerRuntime,
                           WorkerSandboxClass)
from events.states import ActorState

_SETTLED = (ActorState.RUNNING, ActorState.STOPPED)  # not waiting for a resume: no image to lose


def wire_runtime(runtime: Any) -> WorkerRuntime:
    """A worker runtime of the projection (`records.Runtime`) as the wire says it: its version, name,
    overhead and the versions its edges accept, as the fold keeps them."""
    overhead = (ActorOverhead(fixed_mib=runtime.fixed_mib, per_gib_mib=runtime.per_gib_mib)
                if runtime.fixed_mib or runtime.per_gib_mib else None)
    return WorkerRuntime(version=runtime.compat.version, name=runtime.name, actor_overhead=overhead,
                         compatible_versions=tuple(edge.version for edge in runtime.edges))


def worker_detail(projection: Any, worker_id: str) -> WorkerDetail:
    """`worker_id` as `projection` has it; NOT_FOUND (field `worker_id`, `no_worker`) when it has no such
    worker (never registered, or removed)."""
    w = projection.workers.get(worker_id)
    if w is None:
        raise no_worker(worker_id)
    classes = [WorkerSandboxClass(sandbox_class=sandbox_class, default_runtime=wire_runtime(entry.default),
                                  restorable_runtimes=tuple(map(wire_runtime, entry.restorable)))
               for sandbox_class, entry in w.classes.items()]
    actors = []
    for actor_id in sorted(projection.booked_on(w)):
        a = projection.actors[actor_id]
        actors.append(BookedActor(actor_id=actor_id, sandbox_class=a.sandbox_class, state=a.state, booked=a.booked,
                                  pin=a.pin.runtime))
    # Waiting actors whose latest image is LOCAL on this worker's place (the disk of its node it registered
    # from: `services.scheduler.places`), of a class it runs: they
    # resume only on that node (CONTRACT rule 5), so draining or removing the node's last worker of
    # the class strands them (docs/operations.md: suspend them first).
    local = []
    for actor_id, a in projection.actors.items():
        kind = a.snapshot
        if (kind is None or not kind.local or a.image_node != w.place or a.state in _SETTLED
                or a.sandbox_class not in w.classes):
            continue
        local.append(LocalImage(actor_id=actor_id, state=a.state, snapshot_id=a.snapshot_id, fidelity=kind.fidelity,
                                stamp=kind.stamp.runtime if kind.stamp is not None else None))
    local.sort(key=lambda image: image.actor_id)
    return WorkerDetail(worker_id=worker_id, node=w.node, node_token=w.token, state=w.state, labels=dict(w.labels),
                        capacity=Resources(cpu_millis=w.cpu_millis, memory_mib=w.memory_mib),
                        free=Room(cpu_millis=w.room_cpu, memory_mib=w.room_mem),
                        classes=classes, actors=actors, local_images=local)
