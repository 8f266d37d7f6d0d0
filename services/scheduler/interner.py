"""One instance of each thing many records share: the projection's interning tables.

A projection holds every actor of a deployment, and most of what an actor refers to
recurs from actor to actor (its class and template, resources, selectors, stamp,
the runtimes of the workers). The `Interner` keeps one object per distinct value and
hands that one out, so a record holds a reference, and identity stands for content
(decisions compare compat keys with `is`).

Its tables are the public seam of checkpoints: a codec exports them in order
(`compats`, `runtimes`, `stamps`, `resources`, `selector_maps`, `specs`, `kinds`,
`leases`) and a restore rebuilds them by calling the same constructors in that order,
which gives back the very same sharing.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from events.compat import CompatKey, compat_key
from events.schema import ActorRuntime, CompatVersion, Fidelity, Resources, WorkerRuntime
from services.scheduler.records import ClassEntry, Compat, Lease, Runtime, SnapshotKind, Spec, Stamp, worker_machine

EMPTY: Mapping[str, str] = {}

# Distinct snapshot-id suffixes interned at most: past that, a suffix is kept per actor
# (user-chosen ids may all differ; the snapshotter's own are `-v<version>`, few).
SUFFIXES_INTERNED = 1 << 16


class Interner:
    def __init__(self) -> None:
        self._compats: dict[CompatKey, Compat] = {}
        self._compat_by_version: dict[tuple[str, CompatVersion], Compat] = {}
        self._stamps: dict[ActorRuntime, Stamp] = {}
        self._runtimes: dict[tuple[str, WorkerRuntime], Runtime] = {}
        self._entries: dict[tuple[int, ...], ClassEntry] = {}
        self._strings: dict[str, str] = {}
        self._resources: dict[Resources, Resources] = {}
        self._selectors: dict[tuple[tuple[str, str], ...], Mapping[str, str]] = {(): EMPTY}
        self._specs: dict[tuple, Spec] = {}
        self._kinds: dict[tuple, SnapshotKind] = {}
        self._leases: dict[tuple[Resources, Stamp], Lease] = {}
        self._suffixes: dict[str, str] = {}

    # --- what is interned, in the order it was first seen (the checkpoint seam) -------

    @property
    def compats(self) -> Iterable[Compat]:
        return self._compats.values()

    @property
    def runtimes(self) -> Iterable[tuple[str, WorkerRuntime]]:
        """(sandbox class, runtime) of each interned Runtime, in order (`runtime` rebuilds them)."""
        return self._runtimes.keys()

    def runtime_records(self) -> Iterable[Runtime]:
        return self._runtimes.values()

    @property
    def stamps(self) -> Iterable[Stamp]:
        return self._stamps.values()

    @property
    def resource_values(self) -> Iterable[Resources]:
        return self._resources.values()

    @property
    def selector_maps(self) -> Iterable[Mapping[str, str]]:
        return self._selectors.values()

    @property
    def specs(self) -> Iterable[Spec]:
        return self._specs.values()

    @property
    def kinds(self) -> Iterable[SnapshotKind]:
        return self._kinds.values()

    @property
    def leases(self) -> Iterable[Lease]:
        return self._leases.values()

    def add_compat(self, sandbox_class: str, version: CompatVersion) -> Compat:
        """A restore's way in: the compat key of `version` first seen with that very version."""
        key = compat_key(sandbox_class, version)
        if key in self._compats:
            raise ValueError(f"compat key {key} appears twice")
        found = self._compats[key] = Compat(key, version)
        return found

    # --- the constructors --------------------------------------------------------------

    def compat(self, sandbox_class: str, version: CompatVersion) -> Compat:
        found = self._compat_by_version.get((sandbox_class, version))
        if found is not None:
            return found
        key = compat_key(sandbox_class, version)
        found = self._compats.get(key)
        if found is None:
            found = self._compats[key] = Compat(key, version)
        self._compat_by_version[(sandbox_class, version)] = found
        return found

    def compat_of_key(self, key: CompatKey) -> Compat | None:
        """The interned compat key equal to `key`, if the log has named it."""
        return self._compats.get(key)

    def stamp(self, runtime: ActorRuntime) -> Stamp:
        found = self._stamps.get(runtime)
        if found is None:
            found = self._stamps[runtime] = Stamp(runtime, self.compat(runtime.sandbox_class, runtime.version))
        return found

    def runtime(self, sandbox_class: str, runtime: WorkerRuntime) -> Runtime:
        found = self._runtimes.get((sandbox_class, runtime))
        if found is None:
            edges = tuple(self.compat(sandbox_class, v) for v in runtime.compatible_versions)
            found = Runtime(self.compat(sandbox_class, runtime.version), runtime, edges)
            self._runtimes[(sandbox_class, runtime)] = found
        return found

    def entries(self, classes: Iterable[tuple[str, Runtime, tuple[Runtime, ...]]]) -> dict[str, ClassEntry]:
        """A worker's class entries, by class name, from its registration's (name, default, restorable
        runtimes), in its order: each indexes only what the worker's machine can load (`worker_machine`)."""
        classes = list(classes)
        machine = worker_machine((default, restorable) for _, default, restorable in classes)
        return {name: self.entry(default, restorable, machine) for name, default, restorable in classes}

    def entry(self, default: Runtime, restorable: tuple[Runtime, ...], machine: str | None) -> ClassEntry:
        key = (id(default), *map(id, restorable), machine)  # interned runtimes: identity stands for content
        found = self._entries.get(key)
        if found is None:
            found = self._entries[key] = ClassEntry(default, restorable, machine)
        return found

    def text(self, text: str) -> str:
        return self._strings.setdefault(text, text)

    def resources(self, resources: Resources) -> Resources:
        return self._resources.setdefault(resources, resources)

    def selectors(self, selectors: Mapping[str, str]) -> Mapping[str, str]:
        if not selectors:
            return EMPTY
        key = tuple(sorted(selectors.items()))
        found = self._selectors.get(key)
        if found is None:
            found = self._selectors[key] = dict(key)
        return found

    def spec(self, sandbox_class: str, template_uid: str, resources: Resources, selectors: Mapping[str, str],
             min_fidelity: Fidelity) -> Spec:
        """The interned Spec; `resources` and `selectors` must be interned already (their
        identity stands for their content)."""
        key = (sandbox_class, template_uid, id(resources), id(selectors), min_fidelity)
        found = self._specs.get(key)
        if found is None:
            found = self._specs[key] = Spec(
                self.text(sandbox_class), self.text(template_uid), resources, selectors, min_fidelity
            )
        return found

    def snapshot_kind(self, template_uid: str, fidelity: Fidelity, stamp: Stamp | None, borrowed: bool,
                      prefixed: bool, local: bool = False) -> SnapshotKind:
        template_uid = self.text(template_uid)  # the key holds the interned text, not an event's copy
        key = (template_uid, fidelity, stamp, borrowed, prefixed, local)
        found = self._kinds.get(key)
        if found is None:
            found = self._kinds[key] = SnapshotKind(template_uid, fidelity, stamp, borrowed, prefixed, local)
        return found

    def lease(self, booked: Resources, pin: Stamp) -> Lease:
        """The interned Lease; `booked` must be interned already."""
        key = (booked, pin)
        found = self._leases.get(key)
        if found is None:
            found = self._leases[key] = Lease(booked, pin)
        return found

    def snapshot_ref(self, actor_id: str, snapshot_id: str) -> tuple[bool, str]:
        """(prefixed, what an actor keeps of `snapshot_id`): the interned rest after the
        actor's id when the id starts with it, else the id itself."""
        if not snapshot_id.startswith(actor_id):
            return False, snapshot_id
        return True, self.suffix(snapshot_id[len(actor_id):])

    def suffix(self, rest: str) -> str:
        """A snapshot id's rest after the actor's id, interned (while the table has room)."""
        found = self._suffixes.get(rest)
        if found is None:
            if len(self._suffixes) >= SUFFIXES_INTERNED:
                return rest
            found = self._suffixes[rest] = rest
        return found

    def sizes(self) -> dict[str, Any]:
        """How many of each are interned (for the record and the benches)."""
        return {name: len(getattr(self, f"_{name}")) for name in (
            "compats", "stamps", "runtimes", "entries", "strings", "resources", "selectors", "specs", "kinds",
            "leases", "suffixes")}
