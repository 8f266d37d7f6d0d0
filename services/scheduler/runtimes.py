"""The runtimes the registered workers offer (`<prefix>.scheduler.runtimes`, a project addition).

What every view labels runtimes with (`warmboot.cmd_views.runtimes_of`, `events.runtime_id.Runtimes`):
each runtime a worker runs (a default or restorable one, with the names workers give it) and each
version one of them only accepts (an edge). The CLI asked the log for it, folding every worker's
history on each command that prints a label (an `actor resume` at 10,000 workers read 33,000 events,
about 3 s on the development machine); the scheduler's fold has it already. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from events.compat import CompatKey
from events.schema import CompatVersion, FleetRuntime, FleetRuntimes


def offered_runtimes(projection: Any) -> FleetRuntimes:
    """The runtimes of `projection`'s registered workers, drained ones included, in compat-key order:
    one pass over the workers, and each distinct class entry read once (workers configured alike
    share one: `Interner.entry`)."""
    entries: dict[tuple[str, int], Any] = {}
    for worker in projection.workers.values():
        for sandbox_class, entry in worker.classes.items():
            entries.setdefault((sandbox_class, id(entry)), entry)
    versions: dict[CompatKey, tuple[str, CompatVersion]] = {}
    names: dict[CompatKey, set[str]] = {}
    run: set[CompatKey] = set()  # the keys a worker runs (not only accepts through an edge)
    for (sandbox_class, _), entry in entries.items():
        for runtime in (entry.default, *entry.restorable):
            key = runtime.compat.key
            versions.setdefault(key, (sandbox_class, runtime.compat.version))
            named = names.setdefault(key, set())
            if runtime.name:
                named.add(runtime.name)
            run.add(key)
            for edge in runtime.edges:
                versions.setdefault(edge.key, (sandbox_class, edge.version))
                names.setdefault(edge.key, set())
    return FleetRuntimes(runtimes=[
        FleetRuntime(sandbox_class=versions[key][0], version=versions[key][1], names=sorted(names[key]),
                     run=key in run)
        for key in sorted(versions)])
