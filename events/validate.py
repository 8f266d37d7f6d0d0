"""Validation rules that msgspec's constraints cannot express (CONTRACT section 2).

`check_request(type_, value)` is the edge: it runs right after msgspec has decoded a
request (patterns, lengths and bounds are checked by then) and either returns the
request, possibly normalised, or raises `ContractError(INVALID_ARGUMENT)` with the
offending field's path, e.g. `sandbox_classes[0].restorable_runtimes[3].version.attributes[1].key`.

- Printable text (v1.1): every field typed with a `PRINTABLE`-marked string in
  `events.schema` must satisfy `str.isprintable()`; the checker of each request type
  is derived once from its annotations, so a new printable field is covered as soon
  as it is declared.
- Versions: unique attribute keys, the keys a known schema version requires.
- Class entries: restorable runtimes distinct from the default and from each other;
  compatible versions distinct from the runtime's own version and from each other.
- Create: a golden snapshot is EXTERNAL, on no node, with a uri, and its time is normalised to UTC.
- A uri given (a golden snapshot's, a suspend's) is not empty or blank.
"""

from __future__ import annotations

from datetime import timezone
from functools import lru_cache
from typing import Any, Callable

import msgspec
import msgspec.inspect as mi

from events.compat import architecture, compat_key, machine_architecture, other_architecture
from events.errors import invalid
from events.schema import (
    CompatVersion,
    CreateActor,
    Location,
    RegisterWorker,
    PauseActor,
    Snapshot,
    SuspendActor,
    UnderPlacement,
    WhatIf,
    WorkerRuntime,
    WorkerSandboxClass,
)

# Keys each known schema version requires.
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {"v1": ("architecture",)}


# --- printable text -------------------------------------------------------------------

Check = Callable[[Any, str], None]


def _not_printable(text: str, path: str) -> None:
    bad = next(c for c in text if not c.isprintable())
    raise invalid(f"text must be printable; U+{ord(bad):04X} is not", path)


def _text_check(value: Any, path: str) -> None:
    if not value.isprintable():
        _not_printable(value, path)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


@lru_cache(maxsize=None)
def _struct_check(cls: type) -> Check | None:
    fields = []
    for f in mi.type_info(cls).fields:
        check = _check_of(f.type)
        if check is not None:
            fields.append((f.name, f.encode_name, check))
    if not fields:
        return None

    def check_struct(value: Any, path: str) -> None:
        for name, encoded, check in fields:
            item = getattr(value, name)
            if item is not None:
                check(item, _join(path, encoded))

    return check_struct


def _check_of(t: mi.Type) -> Check | None:
    """The printable check of values of type `t`, or None when `t` holds no printable text."""
    if isinstance(t, mi.Metadata):
        if (t.extra or {}).get("printable") and isinstance(t.type, mi.StrType):
            return _text_check
        return _check_of(t.type)
    if isinstance(t, mi.StructType):
        return _struct_check(t.cls)
    if isinstance(t, (mi.ListType, mi.TupleType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        item = _check_of(t.item_type) if not isinstance(t, mi.TupleType) else None
        if item is None:
            return None

        def check_items(value: Any, path: str) -> None:
            for i, v in enumerate(value):
                item(v, f"{path}[{i}]")

        return check_items
    if isinstance(t, mi.DictType):
        key, val = _check_of(t.key_type), _check_of(t.value_type)
        if key is None and val is None:
            return None

        def check_map(value: Any, path: str) -> None:
            for k, v in value.items():
                where = f"{path}.{k}"
                if key is not None:
                    key(k, where)
                if val is not None:
                    val(v, where)

        return check_map
    if isinstance(t, mi.UnionType):
        checks = [c for c in (_check_of(u) for u in t.types) if c is not None]
        if not checks:
            return None
        if len(checks) == 1:
            only = checks[0]
            return lambda value, path: None if value is None else only(value, path)
        kinds = [(u.cls, _check_of(u)) for u in t.types if isinstance(u, mi.StructType)]

        def check_union(value: Any, path: str) -> None:
            for cls, check in kinds:
                if isinstance(value, cls) and check is not None:
                    check(value, path)

        return check_union
    return None


def check_printable(value: msgspec.Struct) -> None:
    """Every printable-typed text of `value` passes `str.isprintable()`; else INVALID_ARGUMENT."""
    check = _struct_check(type(value))
    if check is not None:
        check(value, "")


# --- versions and class entries ----------------------------------------------------------


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


def check_runtime(runtime: WorkerRuntime, path: str) -> None:
    """The runtime's version, and its compatible versions: valid, none equal to the
    runtime's own version or to another entry (CONTRACT section 2, v1.1)."""
    check_version(runtime.version, f"{path}.version")
    seen = {compat_key("", runtime.version): "the runtime's own version"}
    for i, version in enumerate(runtime.compatible_versions):
        vpath = f"{path}.compatible_versions[{i}]"
        check_version(version, vpath)
        key = compat_key("", version)
        if key in seen:
            raise invalid(f"compatible version equals {seen[key]}", vpath)
        seen[key] = f"compatible_versions[{i}]"


def check_class_entry(entry: WorkerSandboxClass, path: str) -> None:
    check_runtime(entry.default_runtime, f"{path}.default_runtime")
    seen = {compat_key(entry.sandbox_class, entry.default_runtime.version): "default_runtime"}
    for i, runtime in enumerate(entry.restorable_runtimes):
        rpath = f"{path}.restorable_runtimes[{i}]"
        check_runtime(runtime, rpath)
        key = compat_key(entry.sandbox_class, runtime.version)
        if key in seen:
            raise invalid(f"restorable runtime equals {seen[key]} by version", f"{rpath}.version")
        seen[key] = f"restorable_runtimes[{i}]"


def _named_versions(req: RegisterWorker, path: str) -> list[tuple[str, CompatVersion]]:
    """Every version a registration names, with its path: each class entry's default runtime, its
    restorable runtimes, and the compatible versions of each, in that order."""
    versions = []
    for i, entry in enumerate(req.sandbox_classes):
        epath = f"{path}sandbox_classes[{i}]"
        runtimes = [(f"{epath}.default_runtime", entry.default_runtime),
                    *((f"{epath}.restorable_runtimes[{j}]", r) for j, r in enumerate(entry.restorable_runtimes))]
        for rpath, runtime in runtimes:
            versions.append((f"{rpath}.version", runtime.version))
            versions += [(f"{rpath}.compatible_versions[{k}]", v) for k, v in enumerate(runtime.compatible_versions)]
    return versions


def check_one_machine(req: RegisterWorker, path: str = "") -> None:
    """Every version a registration names (in any of its classes: runtimes and compatible versions)
    names the architecture of its machine (`machine_architecture`: the first class's default
    runtime's, or, when that names none, the first named) or none: a worker runs on one machine
    whatever its classes, and a memory image never restores on another architecture
    (docs/contract.md). Checked class by class alone, two classes of two architectures passed, and
    one of them could only be sent images it cannot load (an audit, 2026-12-04)."""
    versions = _named_versions(req, path)
    machine = machine_architecture(v for _, v in versions)
    for vpath, version in versions:
        differ = other_architecture(version, machine)
        if differ is not None:
            named = next(p for p, v in versions if architecture(v) == machine)
            raise invalid(f"architecture {differ!r} is not the machine's {machine!r} (its first class's default "
                          f"runtime's, or the first named: {named}): a memory image never restores on another "
                          "architecture, and a worker runs on one machine whatever its classes", f"{vpath}.attributes")


def check_register(req: RegisterWorker, path: str = "") -> RegisterWorker:
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
    check_one_machine(req, path)
    return req


# --- snapshots ---------------------------------------------------------------------------------


def check_snapshot(snapshot: Snapshot, path: str) -> Snapshot:
    """A snapshot a caller hands in: its stamp valid, its time in UTC (normalised)."""
    if snapshot.sandbox_runtime is not None:
        check_version(snapshot.sandbox_runtime.version, f"{path}.sandbox_runtime.version")
    taken_at = snapshot.taken_at
    if taken_at.utcoffset():
        snapshot = msgspec.structs.replace(snapshot, taken_at=taken_at.astimezone(timezone.utc))
    return snapshot


def check_create(req: CreateActor) -> CreateActor:
    if req.source_tag is not None and req.golden_snapshot is not None:
        raise invalid("give source_tag or golden_snapshot, not both", "golden_snapshot")
    golden = req.golden_snapshot
    if golden is None:
        return req
    if golden.location is not Location.EXTERNAL:
        raise invalid(
            "a golden snapshot must be EXTERNAL: a LOCAL image exists on one node only and "
            "cannot be shared by other actors",
            "golden_snapshot.location",
        )
    if golden.node is not None:  # (found by an audit: taken, and kept, though nothing reads it)
        raise invalid(f"a golden snapshot is EXTERNAL, on no node (not {golden.node!r}): only a LOCAL image is on one",
                      "golden_snapshot.node")
    if golden.uri is None:
        raise invalid("a golden snapshot must say where its image is (uri)", "golden_snapshot.uri")
    check_uri(golden.uri, "golden_snapshot.uri")
    stamp = golden.sandbox_runtime
    if stamp is not None and stamp.sandbox_class != req.sandbox_class:
        raise invalid(
            f"golden snapshot was taken under class {stamp.sandbox_class!r}, "
            f"not {req.sandbox_class!r}",
            "golden_snapshot.sandbox_runtime.sandbox_class",
        )
    normalised = check_snapshot(golden, "golden_snapshot")
    return req if normalised is golden else msgspec.structs.replace(req, golden_snapshot=normalised)


def check_uri(uri: str | None, path: str) -> None:
    """A uri given is not empty or blank: it says where an image is (found by an audit: a golden
    snapshot's `""` was taken, as a uri)."""
    if uri is not None and not uri.strip():
        raise invalid(f"{path} is {'empty' if not uri else 'blank'}: say where the image is", path)


def check_under_placement(req: UnderPlacement) -> UnderPlacement:
    """The placement's worker and pin name the placement at `placement_seq`: given only with it."""
    if req.placement_seq is None:
        for name in ("placement_worker_id", "placement_node", "placement_runtime"):
            if getattr(req, name) is not None:
                raise invalid(f"{name} names the placement at placement_seq, which is not given: give both, or "
                              "neither", name)
    if req.placement_runtime is not None:
        check_version(req.placement_runtime.version, "placement_runtime.version")
    return req


def check_suspend(req: SuspendActor) -> SuspendActor:
    check_uri(req.uri, "uri")
    return check_under_placement(req)


def check_whatif(req: WhatIf) -> WhatIf:
    for i, version in enumerate(req.drop_runtimes):
        check_version(version, f"drop_runtimes[{i}]")
    return req


# Request type -> its hand-written checks (types absent here need none). Each returns
# the request, normalised where a rule says so.
CHECKS: dict[type, Callable[[Any], Any]] = {
    RegisterWorker: check_register,
    CreateActor: check_create,
    PauseActor: check_under_placement,
    SuspendActor: check_suspend,
    WhatIf: check_whatif,
}


def check_request(type_: type, value: Any) -> Any:
    """Every rule msgspec cannot express, for a decoded request of `type_`; the request, normalised."""
    check_printable(value)
    check = CHECKS.get(type_)
    return check(value) if check is not None else value
