"""Fragmentation (CONTRACT `scheduler.fragmentation`): per class and runtime version, from
the counts the projection keeps (no pass over the actors; one over each version's workers
for their free room)."""

from __future__ import annotations

from events.schema import ClassFragmentation, Fragmentation, Room, RuntimeFragmentation
from services.scheduler.projection import Projection
from services.scheduler.records import EDGE_DEFAULT, EDGE_RESTORABLE, OWN_DEFAULT, OWN_RESTORABLE


def fragmentation(projection: Projection, sandbox_class: str | None = None) -> Fragmentation:
    """Per class and runtime version: live workers running it as default, able to restore
    it (a restorable runtime), or accepting it only through a compatibility edge, their
    free room, and the counted memory snapshots stamped with it; per class the
    `stranded_snapshots` (CONTRACT section 3: counted memory snapshots no registered,
    undrained worker could restore at MEMORY; a LOCAL one only by a worker on its node)
    and the `lost_local_snapshots` (waiting actors whose LOCAL latest snapshot is on a
    node with no registered worker of the class); and, a project addition, the class's `largest`
    capacities (`ClassIndex.largest`: over the distinct capacities, no pass over the workers).
    """
    classes = []
    names = sorted(projection.classes) if sandbox_class is None else [sandbox_class]
    for name in names:
        index = projection.classes.get(name)
        if index is None:
            continue
        compats = {c for table in index.members for c in table} | set(index.external_memory)
        compats |= {c for _, c in index.local_memory}
        runtimes = []
        for compat in sorted(compats, key=lambda c: c.key):
            seen: set[str] = set()
            free_cpu = free_mem = 0
            for table in index.members:
                for worker in table.get(compat, ()):
                    if worker.live and worker.worker_id not in seen:
                        seen.add(worker.worker_id)
                        free_cpu += max(worker.room_cpu, 0)
                        free_mem += max(worker.room_mem, 0)
            live = index.live
            runtimes.append(
                RuntimeFragmentation(
                    version=compat.version,
                    workers_default=live[OWN_DEFAULT].get(compat, 0),
                    workers_restorable=live[OWN_RESTORABLE].get(compat, 0),
                    workers_compatible=live[EDGE_DEFAULT].get(compat, 0) + live[EDGE_RESTORABLE].get(compat, 0),
                    free=Room(cpu_millis=free_cpu, memory_mib=free_mem),
                    snapshots_memory=index.memory_snapshots(compat),
                )
            )
        largest = index.largest()
        classes.append(
            ClassFragmentation(
                sandbox_class=name, workers=index.live_count(), runtimes=runtimes, stranded_snapshots=index.stranded(),
                lost_local_snapshots=index.lost_local(),
                largest=Room(cpu_millis=largest[0], memory_mib=largest[1]) if largest is not None else None,
            )
        )
    return Fragmentation(classes=classes)
