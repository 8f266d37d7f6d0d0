"""The worker agent's file, and the registration it makes on this machine.

`warmboot agent --config FILE` reads a TOML file (see examples/agent.toml) that declares
the worker's capacity, labels and, per sandbox class, the default runtime and the
restorable runtimes (`AgentConfig`, `parse_config`). A runtime is a probe profile plus
literal attributes, or literal attributes alone; the probe reads this machine's CPU once
per registration (`ProbeSettings.read`, `MachineRead`), and `build_registration` makes the
`RegisterWorker` the file declares on that reading, checked by the registry's own rules, so
that a bad edit is refused here with the field's path (`ConfigError`). What runs the agent
and keeps the registry told is `warmboot.agent`; this module reads and decides, no I/O
but the file and the probe's reads.
"""

from __future__ import annotations

import logging
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from events.codec import decode_request, encode, field_path, map_entry, to_builtins
from events.compat import MACHINE_TO_ARCH
from events.errors import ContractError
from events.probe import (DEFAULT_CPUINFO, PROFILES, SCHEMA_VERSION, ProbeError, check_architecture,
                          host_architecture, probe_version, read_cpuinfo)
from events.schema import ActorOverhead, CompatVersion, RegisterWorker

log = logging.getLogger("warmboot.agent")  # the agent's log: what the operator of the worker reads


class ConfigError(ValueError):
    """The agent's configuration cannot make a valid registration; says where: the file, then the field's
    path in it (`FILE: capacity.cpu_millis: ...`)."""


class MachineMismatch(ConfigError):
    """The machine reads fine, but the file's literal runtime names another CPU than it has: no
    read of the machine will change that (unlike a probe that failed to read it)."""


class NotRegistrable(MachineMismatch):
    """The machine reads fine, but the registration the file makes of it breaks the registry's
    rules (a `compatible_versions` edge that is now the default's own version: the machine moved
    to the CPU the edge names). As certain as a MachineMismatch: no read of this machine changes
    it, and a registration in force made of an earlier read claims a CPU it no longer has (an
    audit: taken for a probe that could not read the machine, the old CPU stayed registered for
    the 10 s of grace, and resumes of its images were placed there). `refusal` is the registry's rule it
    breaks, as the registry would refuse it (`events.errors.too_large` reads a body past MAX_BODY in it)."""

    def __init__(self, message: str, refusal: ContractError) -> None:
        super().__init__(message)
        self.refusal = refusal


class VersionConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A CompatVersion as the TOML file declares it: probed (`profile`) plus literal attributes,
    or literal attributes alone (another machine's, copied from its `--print-registration`)."""

    profile: str | None = None  # probe this machine's CPU with this profile
    schema_version: str = SCHEMA_VERSION
    attributes: dict[str, str] = msgspec.field(default_factory=dict)


class RuntimeConfig(VersionConfig, kw_only=True, forbid_unknown_fields=True):
    """One runtime of a sandbox class, as the TOML file declares it."""

    name: str | None = None
    # Literal attributes naming another CPU than this machine's are refused for a runtime the
    # worker runs actors as (`_cpu_named_otherwise`), unless the runtime masks the CPU to them.
    cpu_masked: bool = False
    actor_overhead: ActorOverhead | None = None
    # one-way edges (CONTRACT v1.1): this runtime also restores snapshots stamped with these
    compatible_versions: list[VersionConfig] = msgspec.field(default_factory=list)


class ClassConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    sandbox_class: str
    default_runtime: RuntimeConfig
    restorable_runtimes: list[RuntimeConfig] = msgspec.field(default_factory=list)


class CapacityConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    cpu_millis: int
    memory_mib: int


class AgentConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    capacity: CapacityConfig
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    sandbox_classes: list[ClassConfig]


@dataclass(frozen=True)
class ProbeSettings:
    """Where the probe reads this machine: tests point it at a sample cpuinfo."""

    cpuinfo_path: Path = DEFAULT_CPUINFO
    architecture: str | None = None  # None: this machine's

    def read(self) -> "MachineRead":
        """The machine, read once: every runtime made of it is of the same reading."""
        try:
            text = read_cpuinfo(self.cpuinfo_path)
            arch = self.architecture if self.architecture is not None else host_architecture()
            check_architecture(text, arch, str(self.cpuinfo_path))
        except ProbeError as e:
            return MachineRead(self, None, None, str(e))
        return MachineRead(self, text, arch, None)


@dataclass(frozen=True)
class MachineRead:
    """What one read of the machine gave (`ProbeSettings.read`): the cpuinfo text and the
    architecture, or why they could not be read."""

    settings: ProbeSettings
    text: str | None  # None: no cpuinfo file
    architecture: str | None
    error: str | None

    def version(self, profile: str, extra: dict[str, str]) -> CompatVersion:
        """`probe_version` of this reading (ProbeError if the machine could not be read)."""
        if self.error is not None or self.architecture is None:
            raise ProbeError(self.error or "no architecture")
        return probe_version(self.text, self.architecture, profile, extra)

    def reading(self) -> tuple:
        """What this read says of the machine for each profile, or why it cannot: two reads
        that say the same of it are equal."""
        try:
            return tuple(self.version(profile, {}) for profile in PROFILES)
        except ProbeError as e:
            return (str(e),)


def parse_config(text: str, source: str = "config") -> AgentConfig:
    """TOML text -> AgentConfig; unknown keys are errors (a typo must not pass silently)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None
    try:
        return msgspec.convert(raw, AgentConfig)
    except msgspec.ValidationError as e:
        keyed = map_entry(AgentConfig, raw, *field_path(e))  # a label or an attribute: named by its key
        raise ConfigError(f"{source}: {_where(str(e)) if keyed is None else f'{keyed[1]}: {keyed[0]}'}") from None


def _where(text: str) -> str:
    """msgspec's "... - at `$.a[0].b`" -> "a[0].b: ..."."""
    message, sep, path = text.rpartition(" - at `$")
    if not sep:
        return text
    return f"{path.rstrip('`').lstrip('.')}: {message}"


def _architecture_named_otherwise(runtime: VersionConfig, path: str, stamps: bool) -> None:
    """A literal version of schema v1 whose `architecture` is not spelled as the probe spells it
    (`x86_64`, `AMD64`): it never equals a probed version. As the version a worker stamps new
    snapshots with (`stamps`, a default runtime's own) it is refused; as a version it restores
    (a restorable runtime, a compatible version) it is taken with a warning, since snapshots
    stamped with it before may exist and be worth restoring."""
    arch = runtime.attributes.get("architecture")
    named = MACHINE_TO_ARCH.get(arch.lower()) if arch is not None else None
    if runtime.schema_version != SCHEMA_VERSION or named is None or named == arch:
        return
    detail = (f"{arch!r}: schema {SCHEMA_VERSION} spells it {named!r}" if arch.lower() == named
              else f"{arch!r} is the machine's name; schema {SCHEMA_VERSION} names it {named!r}")
    problem = (f"{path}.attributes.architecture: {detail}, as the probe reports it, so this version never "
               f"equals a probed one")
    if stamps:
        raise ConfigError(problem)
    if problem not in _WARNED:  # once per process: the file is read again every watch interval
        _WARNED.add(problem)
        log.warning("%s; kept, to restore snapshots stamped with it", problem)


_WARNED: set[str] = set()


# what each probe profile reads of the CPU (not its architecture), and all of those keys
CPU_KEYS_OF = {profile: tuple(key for key in keys if key != "architecture") for profile, keys in PROFILES.items()}
CPU_KEYS = tuple(sorted({key for keys in CPU_KEYS_OF.values() for key in keys}))


def _cpu_named_otherwise(runtime: RuntimeConfig, path: str, probe: MachineRead) -> None:
    """A literal version (schema v1) of a default or restorable runtime that names another architecture
    than this machine's, or any key a probe profile reads (all of them or some) otherwise than the
    probe reads this machine: MachineMismatch. The worker
    runs actors as such a version, both ways: a snapshot stamped with it is restored here, and the
    actor's next snapshot is stamped with it again, to be restored on machines of the CPU it names.
    Only a runtime that runs actors on that CPU's features (masking its own: `cpu_masked`) may say
    so; another CPU's snapshots restored one way are a compatible version. The architecture is never
    masked. A profile's keys are not checked when the probe cannot read them all on this machine (a
    literal version is then the way)."""
    if runtime.schema_version != SCHEMA_VERSION:
        return
    named_arch = runtime.attributes.get("architecture")
    if named_arch is not None and probe.architecture is not None and (
            MACHINE_TO_ARCH.get(named_arch.lower(), named_arch) != probe.architecture):
        raise MachineMismatch(
            f"{path}.attributes.architecture: {named_arch!r} is not this machine's ({probe.architecture!r}): a "
            "memory image never crosses architectures, and actors restored under this runtime would be stamped "
            "with it")
    for profile, keys in CPU_KEYS_OF.items():
        named_keys = [key for key in keys if key in runtime.attributes]
        if not named_keys or runtime.cpu_masked:
            continue
        try:
            mine = {a.key: a.value for a in probe.version(profile, {}).attributes}
        except ProbeError:
            continue  # this profile's keys are not all read here: nothing to compare them with
        for key in named_keys:
            named = runtime.attributes[key]
            if key not in mine or named == mine[key]:
                continue
            raise MachineMismatch(
                f"{path}.attributes.{key}: {named!r} is not this machine's ({mine[key]!r}, as the {profile} probe "
                "reads it). Actors restored under a default or restorable runtime run as its version and their "
                "next snapshots are stamped with it, to be restored on machines of the CPU it names: declare "
                "one only if this runtime runs actors on that CPU's features (then say `cpu_masked = true`); "
                "to restore snapshots of another CPU here, one way, list its version under the runtime's "
                "`compatible_versions`")


def _cpu_unnamed(runtime: RuntimeConfig, path: str) -> None:
    """A literal version (schema v1) of a default or restorable runtime that names not every key one
    probe profile reads of the CPU (`cpu_features`; or `cpu_vendor` and `cpu_model`): ConfigError,
    unless the runtime masks the CPU (`cpu_masked`). Naming none, its version equals that of every
    machine of its architecture and assets, whatever their CPU, so the snapshots of each would be
    restored on the others (found by an audit: taken on an Intel and an AMD machine alike); naming
    `cpu_vendor` alone, that of every machine of the vendor, whatever its model (found by an audit,
    2026-12-07: a probed runtime that reads no `cpu_model` was refused, its literal copy taken)."""
    if runtime.schema_version != SCHEMA_VERSION or runtime.cpu_masked:
        return
    if any(all(key in runtime.attributes for key in keys) for keys in CPU_KEYS_OF.values()):
        return
    ways = ("give a `profile` to probe this machine, or copy the keys from this machine's `warmboot agent "
            "--print-registration`; only a runtime that runs actors on a CPU it masks may leave them out (then "
            "say `cpu_masked = true`)")
    named = [key for key in CPU_KEYS if key in runtime.attributes]
    if not named:
        raise ConfigError(
            f"{path}.attributes: names none of the CPU's keys ({', '.join(CPU_KEYS)}), so its version equals that "
            f"of every machine of its architecture whatever their CPU, and their memory images would be restored "
            f"here: {ways}")
    every = " or ".join(f"{' and '.join(keys)} (as the {profile} probe reads them)" for profile, keys in CPU_KEYS_OF.items())
    raise ConfigError(
        f"{path}.attributes: names {' and '.join(named)} of the CPU but not all of one profile's keys ({every}), so "
        f"its version equals that of every machine of its architecture with the same {' and '.join(named)}, "
        f"whatever else of their CPU, and their memory images would be restored here: {ways}")


def _version(runtime: VersionConfig, path: str, probe: MachineRead, stamps: bool = False) -> dict[str, Any]:
    if runtime.profile is None:
        _architecture_named_otherwise(runtime, path, stamps)
        if isinstance(runtime, RuntimeConfig):
            _cpu_named_otherwise(runtime, path, probe)  # a key of another CPU: said first, the more precise
            _cpu_unnamed(runtime, path)
        attributes = sorted(runtime.attributes.items())
        return {
            "schema_version": runtime.schema_version,
            "attributes": [{"key": k, "value": v} for k, v in attributes],
        }
    if runtime.profile not in PROFILES:
        raise ConfigError(f"{path}.profile: unknown profile {runtime.profile!r}; expected one of {', '.join(PROFILES)}")
    if runtime.schema_version != SCHEMA_VERSION:
        raise ConfigError(
            f"{path}.schema_version: the probe reports schema {SCHEMA_VERSION}, "
            f"not {runtime.schema_version!r}; give the attributes literally for another schema"
        )
    try:
        version = probe.version(runtime.profile, runtime.attributes)
    except ProbeError as e:
        raise ConfigError(f"{path}: {e}") from None
    missing = [key for key in PROFILES[runtime.profile] if key not in {a.key for a in version.attributes}]
    if missing:
        # The probe omits what it cannot read (CONTRACT section 2); registered so, this runtime would
        # equal that of any machine whose probe read as little, whatever its CPU, and memory images
        # would cross CPUs (docs/contract.md, "A probe that cannot read a key").
        source = probe.settings.cpuinfo_path
        gone = "" if os.path.exists(source) else " (no such file)"
        raise ConfigError(f"{path}: the {runtime.profile} probe cannot read {', '.join(missing)} from "
                          f"{source}{gone}: give this runtime's attributes literally, or fix the probe")
    return to_builtins(version)


def _runtime(runtime: RuntimeConfig, path: str, probe: MachineRead, stamps: bool = False) -> dict[str, Any]:
    if runtime.cpu_masked and runtime.profile is not None:
        raise ConfigError(f"{path}.cpu_masked: says literal CPU attributes are masked; this runtime is probed "
                          f"({runtime.profile!r}), so its CPU is this machine's")
    body: dict[str, Any] = {"version": _version(runtime, path, probe, stamps)}
    if runtime.name is not None:
        body["name"] = runtime.name
    if runtime.actor_overhead is not None:
        body["actor_overhead"] = to_builtins(runtime.actor_overhead)
    if runtime.compatible_versions:
        body["compatible_versions"] = [_version(v, f"{path}.compatible_versions[{k}]", probe)
                                       for k, v in enumerate(runtime.compatible_versions)]
    return body


def build_registration(
    config: AgentConfig, worker_id: str, node: str, probe: ProbeSettings | MachineRead = ProbeSettings(),
    source: str | None = None, node_token: str | None = None,
) -> RegisterWorker:
    """The RegisterWorker this configuration makes on this machine (read once, or as `probe`
    read it), checked by the registry's own rules (so a bad edit is caught here, with the
    field's path, after the file it was read from, `source`, as `parse_config` names it:
    `FILE: sandbox_classes[0].default_runtime.profile: ...`); with `node_token`, the token of
    the node's disk it runs on (`warmboot.agent_state.NodeToken`), else none."""
    if isinstance(probe, ProbeSettings):
        probe = probe.read()
    file = f"{source}: " if source is not None else ""
    classes = []
    for i, entry in enumerate(config.sandbox_classes):
        path = f"{file}sandbox_classes[{i}]"
        classes.append(
            {
                "sandbox_class": entry.sandbox_class,
                "default_runtime": _runtime(entry.default_runtime, f"{path}.default_runtime", probe, stamps=True),
                "restorable_runtimes": [
                    _runtime(r, f"{path}.restorable_runtimes[{j}]", probe)
                    for j, r in enumerate(entry.restorable_runtimes)
                ],
            }
        )
    raw = {
        "worker_id": worker_id,
        "node": node,
        "capacity": to_builtins(config.capacity),
        "labels": config.labels,
        "sandbox_classes": classes,
    }
    if node_token is not None:
        raw["node_token"] = node_token
    try:
        return decode_request(RegisterWorker, encode(raw))
    except ContractError as e:  # every runtime was made of the machine as read: the registration is what is wrong
        where = f"{e.field}: " if e.field else ""
        raise NotRegistrable(f"{file}{where}{e.message}", e) from None


def load_registration(path: Path, worker_id: str, node: str, probe: ProbeSettings = ProbeSettings(),
                      node_token: str | None = None) -> RegisterWorker:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read: {e}") from None
    return build_registration(parse_config(text, str(path)), worker_id, node, probe, str(path), node_token)
