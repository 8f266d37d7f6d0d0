"""A worker's own check of a placement before it carries it out (`warmboot agent --check-placement`).

The registry's view of a machine can be behind the machine: a CPU that changed under a virtual
machine before the agent's next read, a runtime dropped from the configuration while a placement
on it was in flight, or a log that lost its last writes in a crash. So a worker checks every
placement against the machine as it is now before it loads anything (docs/contract.md): its
configuration and its CPU, read now, as the agent would register them. The judgement is the
scheduler's own for a placement made earlier (`Projection.cannot_carry_out`: the pin one of the
machine's runtimes, on its node, and at MEMORY the image's version accepted by that runtime),
made on a fleet of this one machine. Pure: no I/O.
"""

from __future__ import annotations

from datetime import datetime, timezone

from events.schema import Placement, RegisterWorker, WorkerRegistered
from services.scheduler.projection import Projection


def cannot_carry_out_here(registration: RegisterWorker, placement: Placement) -> str | None:
    """Why the machine `registration` describes (built now, as its agent would send it) cannot
    carry out `placement`; None if it can."""
    if placement.worker_id != registration.worker_id:
        return f"it is a placement on worker {placement.worker_id}, not on {registration.worker_id}"
    if placement.node_token is not None and placement.node_token != registration.node_token:
        # rule 5: the image is on another disk (a machine replaced under the worker's id, registered from its
        # old disk still in the scheduler's view): loading it here would crash
        mine = (f"node token {registration.node_token}" if registration.node_token
                else "no node token (no --node-token-file)")
        return (f"it restores a LOCAL image on the disk of node token {placement.node_token}, and this machine "
                f"has {mine}")
    fleet = Projection()
    fleet.apply(1, WorkerRegistered(at=datetime.now(timezone.utc), worker_id=registration.worker_id,
                                    node=registration.node, capacity=registration.capacity,
                                    labels=dict(registration.labels), sandbox_classes=registration.sandbox_classes))
    return fleet.cannot_carry_out(placement)
