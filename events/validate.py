"""Validation rules that msgspec's constraints cannot express (CONTRACT section 2).

Each check returns nothing or raises `ContractError(INVALID_ARGUMENT)` with the
offending field's path, e.g. `sandbox_classes[0].restorable_runtimes[3].version.attributes[1].key`.
"""

from __future__ import annotations

from events.compat import compat_key
from events.errors import invalid
from events.schema import CompatVersion, CreateActor, RegisterWorker, Snapshot, WorkerSandboxClass

# Keys each known schema version requires.
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {"v1": ("architecture",)}


def check_version(version: CompatVersion, path: str) -> None:
    seen: dict[str, int] = {}
    for i, attr in enumerate(version.attributes):
        if attr.key in seen:
            raise invalid(
                f"duplicate attribute key {attr.key!r} (also at index {seen[attr.key]})",
                f"{path}.attributes[{i}].key",
            )
        seen[attr.key] = i
    for key in REQUIRED_KEYS.get(version.schema_version, ()):
        if key not in seen:
            raise invalid(
                f"schema {version.schema_version} requires the attribute {key!r}",
                f"{path}.attributes",
            )


def check_class_entry(entry: WorkerSandboxClass, path: str) -> None:
    check_version(entry.default_runtime.version, f"{path}.default_runtime.version")
    seen = {compat_key(entry.sandbox_class, entry.default_runtime.version): "default_runtime"}
    for i, runtime in enumerate(entry.restorable_runtimes):
        rpath = f"{path}.restorable_runtimes[{i}]"
        check_version(runtime.version, f"{rpath}.version")
        key = compat_key(entry.sandbox_class, runtime.version)
        if key in seen:
            raise invalid(f"restorable runtime equals {seen[key]} by version", f"{rpath}.version")
        seen[key] = f"restorable_runtimes[{i}]"


def check_register(req: RegisterWorker, path: str = "") -> None:
    classes: dict[str, int] = {}
    for i, entry in enumerate(req.sandbox_classes):
        epath = f"{path}sandbox_classes[{i}]"
        if entry.sandbox_class in classes:
            raise invalid(
                f"sandbox class {entry.sandbox_class!r} listed twice "
                f"(also at index {classes[entry.sandbox_class]})",
                f"{epath}.sandbox_class",
            )
        classes[entry.sandbox_class] = i
        check_class_entry(entry, epath)


def check_snapshot(snapshot: Snapshot, path: str) -> None:
    if snapshot.sandbox_runtime is not None:
        check_version(snapshot.sandbox_runtime.version, f"{path}.sandbox_runtime.version")


def check_create(req: CreateActor) -> None:
    if req.source_tag is not None and req.golden_snapshot is not None:
        raise invalid("give source_tag or golden_snapshot, not both", "golden_snapshot")
    if req.golden_snapshot is not None:
        check_snapshot(req.golden_snapshot, "golden_snapshot")
        stamp = req.golden_snapshot.sandbox_runtime
        if stamp is not None and stamp.sandbox_class != req.sandbox_class:
            raise invalid(
                f"golden snapshot was taken under class {stamp.sandbox_class!r}, "
                f"not {req.sandbox_class!r}",
                "golden_snapshot.sandbox_runtime.sandbox_class",
            )


# Request type -> its hand-written checks (types absent here need none).
CHECKS = {RegisterWorker: check_register, CreateActor: check_create}
