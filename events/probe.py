"""The CPU probe: what a worker reports as its runtime's CompatVersion (CONTRACT section 2).

The core is one pure function, `probe_version(cpuinfo, architecture, profile, extra)`:
the text of /proc/cpuinfo (or None when there is none), the machine's architecture
in Go's naming, the profile, and the runtime asset digests the worker's configuration
supplies. It returns a `CompatVersion` of schema v1 with its attributes sorted by key:

- `gvisor`:  architecture, cpu_features
- `microvm`: architecture, cpu_vendor, cpu_model

A key the probe cannot read is left out; it never invents a value. Workers written in
other languages must produce byte-identical values, so every rule below is spelled out:

- cpuinfo is read line by line, each line split at its first `:`, both sides trimmed
  of white space; the first occurrence of a key wins (cores are taken as alike). A
  line without `:` carries no key. A key whose value is empty counts as unreadable.
- cpu_features: the flags (`flags` on amd64, `Features` on arm64) split on white
  space, deduplicated, sorted by code point (the same order as by UTF-8 bytes),
  joined by one space, hashed with 64-bit FNV-1a over the UTF-8 bytes, printed as
  `%016x`.
- cpu_vendor: `vendor_id` (amd64) or `CPU implementer` (arm64), as written.
- cpu_model: amd64 `<cpu family>/<model>`, both decimal integers (printed without
  leading zeros), left out if either is missing or not a decimal integer; arm64
  `<CPU variant>/<CPU part>` as written, or `<CPU part>` alone when there is no
  variant, left out without a part.

`host_architecture()` and `read_cpuinfo(path)` are the two impure helpers around it;
`probe_host(profile, extra)` combines the three for a worker agent on this machine.
`check_architecture(cpuinfo, architecture, source)` refuses a cpuinfo of the other
architecture than the one probed (by its keys: `cpuinfo_architecture`), which would give a
version naming no CPU; `warmboot probe` and the agent's read of the machine call it.
"""

from __future__ import annotations

import platform
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec

from events.compat import MACHINE_TO_ARCH
from events.schema import ATTR_KEY_PATTERN, CompatVersion

SCHEMA_VERSION = "v1"
PROFILES: dict[str, tuple[str, ...]] = {
    "gvisor": ("architecture", "cpu_features"),
    "microvm": ("architecture", "cpu_vendor", "cpu_model"),
}
ARCHITECTURES = ("amd64", "arm64")
DEFAULT_CPUINFO = Path("/proc/cpuinfo")
# /proc/cpuinfo of a 512-core machine is well under 2 MiB; anything far bigger is not one
MAX_CPUINFO_BYTES = 16 << 20

FNV64_OFFSET = 0xCBF29CE484222325
FNV64_PRIME = 0x100000001B3
_U64 = (1 << 64) - 1

# Per architecture: the cpuinfo keys each probed attribute comes from.
_FLAGS_KEY = {"amd64": "flags", "arm64": "Features"}
_VENDOR_KEY = {"amd64": "vendor_id", "arm64": "CPU implementer"}

_ATTR_KEY = re.compile(ATTR_KEY_PATTERN)
_DECIMAL = re.compile(r"^[0-9]+$")
# Control characters other than tab, CR and LF: a text with these is not a cpuinfo file.
_BINARY = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


class ProbeError(ValueError):
    """The probe's input is unusable: unknown profile or architecture, malformed
    cpuinfo, an unreadable file, or extra attributes that are invalid or collide."""


def fnv1a_64(data: bytes) -> int:
    """64-bit FNV-1a with the standard offset basis and prime."""
    h = FNV64_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV64_PRIME) & _U64
    return h


def cpu_features_hash(flags: str) -> str:
    """`flags` as cpuinfo writes them -> 16 lower-case hex digits (CONTRACT section 2).

    >>> cpu_features_hash("fma aes vme fpu avx2 aes")
    '0ac853df914e2ca0'
    """
    canonical = " ".join(sorted(set(flags.split())))
    return f"{fnv1a_64(canonical.encode('utf-8')):016x}"


def parse_cpuinfo(text: str) -> dict[str, str]:
    """Every `key: value` line of a cpuinfo text, the first occurrence of each key kept.

    Raises ProbeError when the text is not a cpuinfo file at all: it holds binary
    control characters, or it has non-blank lines of which none is `key: value`.
    """
    bad = _BINARY.search(text)
    if bad:
        raise ProbeError(f"cpuinfo is malformed: control character {bad.group()!r} at offset {bad.start()}")
    fields: dict[str, str] = {}
    saw_text = False
    saw_field = False
    for line in text.splitlines():
        if not line.strip():
            continue
        saw_text = True
        key, sep, value = line.partition(":")
        if not sep:
            continue
        saw_field = True
        key = key.strip()
        if key and key not in fields:
            fields[key] = value.strip()
    if saw_text and not saw_field:
        raise ProbeError("cpuinfo is malformed: no line has the form `key: value`")
    return fields


def _cpu_features(fields: Mapping[str, str], architecture: str) -> str | None:
    flags = fields.get(_FLAGS_KEY[architecture], "")
    return cpu_features_hash(flags) if flags.split() else None


def _cpu_vendor(fields: Mapping[str, str], architecture: str) -> str | None:
    return fields.get(_VENDOR_KEY[architecture]) or None


def _cpu_model(fields: Mapping[str, str], architecture: str) -> str | None:
    if architecture == "amd64":
        family, model = fields.get("cpu family", ""), fields.get("model", "")
        if _DECIMAL.match(family) and _DECIMAL.match(model):
            return f"{int(family)}/{int(model)}"
        return None
    part, variant = fields.get("CPU part", ""), fields.get("CPU variant", "")
    if not part:
        return None
    return f"{variant}/{part}" if variant else part


_PROBES = {"cpu_features": _cpu_features, "cpu_vendor": _cpu_vendor, "cpu_model": _cpu_model}


def _extra_pairs(extra: Mapping[str, str] | Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    pairs = list(extra.items()) if isinstance(extra, Mapping) else [tuple(p) for p in extra]
    seen: set[str] = set()
    for pair in pairs:
        if len(pair) != 2:
            raise ProbeError(f"extra attribute {pair!r} is not a (key, value) pair")
        key, value = pair
        if not isinstance(key, str) or not _ATTR_KEY.search(key):
            raise ProbeError(
                f"attribute key {key!r} is invalid: it must be a lower-case letter followed by "
                "at most 127 lower-case letters, digits or '_'"
            )
        if not isinstance(value, str):
            raise ProbeError(f"attribute {key!r} has a value that is not a string: {value!r}")
        if key in seen:
            raise ProbeError(f"attribute {key!r} is given twice")
        seen.add(key)
    return pairs


def probe_version(
    cpuinfo: str | None,
    architecture: str,
    profile: str,
    extra: Mapping[str, str] | Iterable[tuple[str, str]] = (),
) -> CompatVersion:
    """The CompatVersion (schema v1, attributes sorted by key) a worker reports.

    cpuinfo:      the text of /proc/cpuinfo, or None when the machine has none
                  (then only `architecture` is reported, plus `extra`).
    architecture: `amd64` or `arm64` (Go's naming; see `host_architecture()`).
    profile:      `gvisor` or `microvm` (see `PROFILES`).
    extra:        runtime asset digests from the worker's configuration, e.g.
                  {"gvisor_asset_hash": "sha256-..."}; a key the profile probes
                  (whether or not it could be read) is refused, as are duplicates.

    Raises ProbeError on any unusable input; never returns an invalid version.
    """
    if profile not in PROFILES:
        raise ProbeError(f"unknown profile {profile!r}: expected one of {', '.join(PROFILES)}")
    if architecture not in ARCHITECTURES:
        raise ProbeError(f"unknown architecture {architecture!r}: expected one of {', '.join(ARCHITECTURES)}")
    probed_keys = PROFILES[profile]
    attributes = {"architecture": architecture}
    fields = parse_cpuinfo(cpuinfo) if cpuinfo is not None else {}
    for key in probed_keys[1:]:
        value = _PROBES[key](fields, architecture)
        if value is not None:
            attributes[key] = value
    for key, value in _extra_pairs(extra):
        if key in probed_keys:
            raise ProbeError(f"attribute {key!r} is probed by profile {profile!r}; it cannot be given as extra")
        attributes[key] = value
    raw = {
        "schema_version": SCHEMA_VERSION,
        "attributes": [{"key": k, "value": v} for k, v in sorted(attributes.items())],
    }
    try:
        # Struct constructors do not check constraints; converting does (value
        # length and printability, at most 32 attributes).
        return msgspec.convert(raw, CompatVersion)
    except msgspec.ValidationError as e:
        raise ProbeError(_describe(e, raw)) from None


def _describe(error: msgspec.ValidationError, raw: dict) -> str:
    """Say which attribute a validation error is about, by key rather than by index."""
    text = str(error)
    match = re.search(r"`\$\.attributes\[(\d+)\]", text)
    if match:
        attr = raw["attributes"][int(match.group(1))]
        # keys were checked before; only a value can be wrong here
        return (
            f"attribute {attr['key']!r} has an invalid value {attr['value']!r}: "
            "a value is 1 to 256 printable characters"
        )
    if "attributes" in text and "length" in text:
        return f"{len(raw['attributes'])} attributes are too many: a version has at most 32"
    return f"probed version is invalid: {text}"


def cpuinfo_architecture(fields: Mapping[str, str]) -> str | None:
    """The architecture whose keys a parsed cpuinfo has (`flags` or `vendor_id`: amd64;
    `Features` or `CPU implementer`: arm64); None when it has neither's, or both's."""
    found = [arch for arch in ARCHITECTURES if fields.get(_FLAGS_KEY[arch]) or fields.get(_VENDOR_KEY[arch])]
    return found[0] if len(found) == 1 else None


def check_architecture(cpuinfo: str | None, architecture: str, source: str) -> None:
    """ProbeError when `cpuinfo` is another architecture's: probed as `architecture` it gives
    none of its CPU attributes, a version naming no CPU (a walkthrough's `--arch arm64` on an
    amd64 machine was told its cpuinfo file was missing or unreadable)."""
    if cpuinfo is None:
        return
    fields = parse_cpuinfo(cpuinfo)
    theirs = cpuinfo_architecture(fields)
    if theirs is None or theirs == architecture:
        return
    has = [key for key in (_FLAGS_KEY[theirs], _VENDOR_KEY[theirs]) if fields.get(key)]
    raise ProbeError(
        f"cpuinfo {source} is an {theirs} machine's (it has {' and '.join(map(repr, has))}), not {architecture}'s: "
        f"probed as {architecture} it gives no CPU attribute; give --arch {theirs}, or the cpuinfo of an "
        f"{architecture} machine"
    )


def host_architecture(machine: str | None = None) -> str:
    """This machine's architecture in Go's naming (x86_64 -> amd64, aarch64 -> arm64)."""
    machine = platform.machine() if machine is None else machine
    try:
        return MACHINE_TO_ARCH[machine.lower()]
    except KeyError:
        raise ProbeError(
            f"unsupported machine type {machine!r}: warmboot knows {', '.join(ARCHITECTURES)}"
        ) from None


def read_cpuinfo(path: str | Path = DEFAULT_CPUINFO) -> str | None:
    """The text of a cpuinfo file; None if it does not exist (the probe then reports
    the architecture alone). Raises ProbeError if it exists but cannot be read as
    text: a directory, no permission, too large, not UTF-8."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CPUINFO_BYTES + 1)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise ProbeError(f"cannot read cpuinfo {str(path)!r}: it is a directory") from None
    except OSError as e:
        raise ProbeError(f"cannot read cpuinfo {str(path)!r}: {e.strerror or e}") from None
    if len(data) > MAX_CPUINFO_BYTES:
        raise ProbeError(f"cpuinfo {str(path)!r} is larger than {MAX_CPUINFO_BYTES} bytes: not a cpuinfo file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProbeError(f"cpuinfo {str(path)!r} is malformed: not UTF-8 text (byte {e.start})") from None


def probe_host(
    profile: str,
    extra: Mapping[str, str] | Iterable[tuple[str, str]] = (),
    *,
    cpuinfo_path: str | Path = DEFAULT_CPUINFO,
    architecture: str | None = None,
) -> CompatVersion:
    """`probe_version` on this machine: its /proc/cpuinfo and its architecture."""
    arch = architecture if architecture is not None else host_architecture()
    return probe_version(read_cpuinfo(cpuinfo_path), arch, profile, extra)
