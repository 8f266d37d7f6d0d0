"""The one compatibility rule (CONTRACT section 2) and the compat key the scheduler indexes.

A snapshot stamped S warm-boots on a worker runtime R when the classes are equal,
the schema versions are equal and the attribute sets are equal key for key and
value for value. `name` and `actor_overhead` never take part.
"""

from __future__ import annotations

from collections.abc import Iterable

from events.schema import ActorRuntime, Attribute, CompatVersion, WorkerRuntime, WorkerSandboxClass

# (sandbox_class, schema_version, ((key, value), ...) sorted by key)
CompatKey = tuple[str, str, tuple[tuple[str, str], ...]]

ARCHITECTURE = "architecture"  # the attribute schema v1 requires
# `uname -m` / platform.machine() -> Go's GOARCH naming (the probe's, and schema v1's)
MACHINE_TO_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def architecture(version: CompatVersion) -> str | None:
    """The `architecture` attribute of `version` in Go's naming (`x86_64` reads as `amd64`), None
    when it has none."""
    value = next((a.value for a in version.attributes if a.key == ARCHITECTURE), None)
    return None if value is None else MACHINE_TO_ARCH.get(value.lower(), value)


def machine_architecture(versions: Iterable[CompatVersion]) -> str | None:
    """The architecture of the machine a class entry runs on: the first one its versions name,
    its default runtime's first (a default of another schema may name none)."""
    return next((arch for arch in map(architecture, versions) if arch is not None), None)


def other_architecture(version: CompatVersion, machine: str | None) -> str | None:
    """`version`'s architecture when it names one and it is not `machine`'s (`machine_architecture`);
    else None. A memory image never restores on another architecture, so a worker's runtime of one
    architecture cannot restore, nor accept through an edge, a version of another
    (docs/contract.md)."""
    mine = architecture(version)
    return mine if mine is not None and machine is not None and mine != machine else None


def sorted_attributes(attributes: tuple[Attribute, ...]) -> tuple[Attribute, ...]:
    return tuple(sorted(attributes, key=lambda a: a.key))


def canonical_version(version: CompatVersion) -> CompatVersion:
    """The stored form of a version: attributes sorted by key (order carries no meaning)."""
    attrs = sorted_attributes(version.attributes)
    if attrs == version.attributes:
        return version
    return CompatVersion(schema_version=version.schema_version, attributes=attrs)


def compat_key(sandbox_class: str, version: CompatVersion) -> CompatKey:
    """Canonical, hashable form: equal runtimes have equal keys, whatever the attribute order."""
    return (
        sandbox_class,
        version.schema_version,
        tuple(sorted((a.key, a.value) for a in version.attributes)),
    )


def stamp_key(stamp: ActorRuntime) -> CompatKey:
    return compat_key(stamp.sandbox_class, stamp.version)


def same_version(a: CompatVersion, b: CompatVersion) -> bool:
    return compat_key("", a) == compat_key("", b)


def matches(stamp: ActorRuntime, entry: WorkerSandboxClass) -> WorkerRuntime | None:
    """The runtime of a worker's class entry that can restore `stamp`, or None.

    The default runtime is tried first, then the restorable runtimes in their order.
    """
    if stamp.sandbox_class != entry.sandbox_class:
        return None
    want = stamp_key(stamp)
    for runtime in (entry.default_runtime, *entry.restorable_runtimes):
        if compat_key(entry.sandbox_class, runtime.version) == want:
            return runtime
    return None


def pin_of(sandbox_class: str, runtime: WorkerRuntime) -> ActorRuntime:
    """The pin an actor placed under `runtime` carries (and later stamps its snapshots with)."""
    return ActorRuntime(sandbox_class=sandbox_class, name=runtime.name, version=runtime.version)


def describe_key(key: CompatKey) -> str:
    """Short human form, e.g. `gvisor v1 architecture=amd64,cpu_features=0ac8…`."""
    sandbox_class, schema_version, attrs = key
    return f"{sandbox_class} {schema_version} " + ",".join(f"{k}={v}" for k, v in attrs)
