"""A runtime's short identity, shown the same way by every view, and read back wherever a runtime is named.

`short_id(key)` is a pure function of the compat key (`events.compat`): ``rt-`` and the
first 6 hex digits of the SHA-256 of the key written as compact JSON,
``["gvisor","v1",[["architecture","amd64"],["cpu_features","0ac853df914e2ca0"]]]``
(class, schema version, attributes sorted by key; UTF-8, no spaces), so that a
client in any language computes the same id.

A runtime's *label* is its `name` when it has one and that name tells it apart
(among the fleet's runtimes, and not itself written like a label: `rt-...`, `x@...`),
else the short id: a worker's runtime name is informational and often shared by
runtimes that are not compatible (one release on three CPU generations), so a name
that several compat keys carry is shown as ``name@3f9a1c`` (its short id's digits),
and a runtime without a name as ``rt-3f9a1c``. `Runtimes` holds the runtimes a view
knows (with their names) and gives each its label; `Runtimes.resolve` reads any of
those forms back (a name alone may stand for several runtimes). A runtime no worker names
(one the fleet no longer runs) may still be named by the log's stamps (`Runtimes.stamp`):
those names label it as `name@3f9a1c` (`Runtimes.qualified`), and tell no other runtime apart.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Iterable

from events.compat import CompatKey, compat_key
from events.schema import CompatVersion

PREFIX = "rt-"
DIGITS = 6


def short_id(key: CompatKey) -> str:
    """`rt-` + 6 hex digits of SHA-256 over the compat key as compact JSON (see the module doc)."""
    sandbox_class, schema_version, attrs = key
    text = json.dumps([sandbox_class, schema_version, [list(a) for a in attrs]], separators=(",", ":"),
                      ensure_ascii=False)
    return PREFIX + hashlib.sha256(text.encode()).hexdigest()[:DIGITS]


def readable_alone(name: str) -> bool:
    """Whether a runtime name may stand alone as a label: not if it reads as another label
    (`rt-...`, `name@digits`), which a worker could choose to pass for another runtime."""
    return "@" not in name and not name.startswith(PREFIX)


class UnknownRuntime(LookupError):
    """A runtime named on input that is none of the known ones (`known`: their labels), or stands
    for several (`known` None)."""

    def __init__(self, message: str, known: list[str] | None = None):
        super().__init__(message)
        self.known = known


@dataclass
class Known:
    key: CompatKey
    version: CompatVersion
    names: set[str] = field(default_factory=set)
    run: bool = False  # a worker runs it (a default or restorable runtime), not only accepts it (an edge)


class Runtimes:
    """The runtimes a view knows, by compat key, with the names workers give them. `entries`: runtimes
    workers run (as `add(..., run=True)`)."""

    def __init__(self, entries: Iterable[tuple[str, CompatVersion, str | None]] = (), *, complete: bool = True):
        self.known: dict[CompatKey, Known] = {}
        self._by_name: dict[str, set[CompatKey]] = {}
        # the names the log's stamps and pins give runtimes (`stamp`), apart from the workers' names:
        # they name a runtime no worker names, and leave the labels of the fleet's runtimes as they are
        self.stamped: dict[CompatKey, set[str]] = {}
        # Whether `entries` are every runtime a name could be shared with (the fleet's): if not (the
        # fleet could not be read), a name alone tells nothing apart, and every label carries digits.
        self.complete = complete
        for sandbox_class, version, name in entries:
            self.add(sandbox_class, version, name, run=True)

    def add(self, sandbox_class: str, version: CompatVersion, name: str | None = None, *,
            run: bool = False) -> CompatKey:
        key = compat_key(sandbox_class, version)
        known = self.known.setdefault(key, Known(key, version))
        known.run = known.run or run
        if name:
            known.names.add(name)
            self._by_name.setdefault(name, set()).add(key)
        return key

    def stamp(self, sandbox_class: str, version: CompatVersion, name: str | None) -> None:
        """A name a stamp (or a pin) of the log gives a runtime: `qualified` labels with it a runtime
        no worker names (one the fleet no longer runs)."""
        if name:
            self.stamped.setdefault(compat_key(sandbox_class, version), set()).add(name)

    def label(self, sandbox_class: str, version: CompatVersion, name: str | None = None) -> str:
        """`name`, `name@3f9a1c` when other runtimes carry the name too, or `rt-3f9a1c`."""
        key = compat_key(sandbox_class, version)
        known = self.known.get(key)
        names = set(known.names) if known else set()
        if name:
            names.add(name)
        if not names:
            return short_id(key)
        chosen = name or min(names)
        if self.complete and len(names) == 1 and self._by_name.get(chosen, {key}) == {key} and readable_alone(chosen):
            return chosen
        return f"{chosen}@{short_id(key)[len(PREFIX):]}"

    def qualified(self, sandbox_class: str, version: CompatVersion, name: str | None = None) -> str:
        """`name@3f9a1c` (or `rt-3f9a1c` without a name) whatever else is known: for a runtime
        this set may not hold every namesake of (one the fleet no longer runs). Without `name`, a
        worker's name for it, else one of the log's stamps' (`stamp`), the least of them."""
        key = compat_key(sandbox_class, version)
        known = self.known.get(key)
        names = known.names if known and known.names else self.stamped.get(key)
        chosen = name or (min(names) if names else None)
        return f"{chosen}@{short_id(key)[len(PREFIX):]}" if chosen else short_id(key)

    def resolve(self, text: str, sandbox_class: str | None = None) -> list[Known]:
        """The runtimes `text` names: a short id (`rt-3f9a1c`), `name@3f9a1c`, or a name (all that
        carry it); only of `sandbox_class` if given. UnknownRuntime if none."""
        candidates = [k for k in self.known.values() if sandbox_class in (None, k.key[0])]
        name, at, digits = text.rpartition("@")
        if at:
            found = [k for k in candidates if short_id(k.key) == PREFIX + digits and name in k.names]
        elif text.startswith(PREFIX):
            found = [k for k in candidates if short_id(k.key) == text]
        else:
            found = [k for k in candidates if text in k.names]
        if not found:
            where = f" of class {sandbox_class}" if sandbox_class else ""
            shown = sorted({self.label(k.key[0], k.version) for k in candidates})
            raise UnknownRuntime(f"no runtime{where} is named {text!r}; known: {', '.join(shown) or 'none'}", shown)
        return sorted(found, key=lambda k: k.key)

    def resolve_one(self, text: str, sandbox_class: str | None = None) -> Known:
        found = self.resolve(text, sandbox_class)
        if len(found) > 1:
            ids = ", ".join(short_id(k.key) for k in found)
            raise UnknownRuntime(f"{text!r} names {len(found)} runtimes ({ids}); give one of their ids")
        return found[0]
