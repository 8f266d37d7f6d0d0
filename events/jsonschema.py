"""The wire contract as one JSON Schema 2020-12 document, for clients in other languages.

Generated from the msgspec Structs of `events.schema`, so it follows every change
there; `warmboot schema` prints it. What it adds to msgspec's own schema:

- One document: `$schema`, `$id`, `title`, `description` and `$defs`, nothing else at
  the top. The bodies are listed as the unions `AnyRequest`, `AnyReply` and `AnyEvent`
  (an `anyOf` of `$ref`s); validate a body against `<$id>#/$defs/<type name>`.
- Required fields as sent: the services send every field of a reply (msgspec writes
  defaults and nulls too), so there every property is required. A type that requests
  and replies share (e.g. `Snapshot`, a request's golden snapshot and a reply's
  snapshot) is published twice when that makes a difference: as a request may send it,
  under its name, and as the services send it, `<name>AsSent`.
- Events as a log may hold them: the services write every field too, but an event
  written by an earlier version lacks the fields added since, so a field with a
  `default` is not required (a reader takes the default for a missing one, as
  warmboot's decoder does). Until 2026-12-04 events required every field, and an
  older event failed the document its own decoder reads it by (found by a review).
  `validator(name, events_as_sent=True)` checks events as this version writes them
  (the test suite's traffic check does).
- The rules of `events.validate` that JSON Schema can say (`RULES` below): a schema
  version's required attribute keys (`if`/`then` with `contains`); no two identical
  entries in a list that must be unique; at most one entry for each attribute key the
  contract names; a golden snapshot is EXTERNAL, on no node, with a uri that is not
  blank, and not given together with a source tag; a suspend's uri, if given, is not
  blank. What it cannot say is in `CANNOT_SAY` (and the document's
  `description`): the service checks those after decoding.
- Nothing non-standard (msgspec's OpenAPI `discriminator` is dropped: the event
  union tells its members apart by the `type` constant each one requires), so a
  strict validator (ajv in strict mode) accepts it.

Unknown fields stay allowed everywhere (CONTRACT section 1: forward compatibility).
`validator(name)` checks a body against one definition with the PyPI `jsonschema`
package (an optional dependency: `pip install 'warmboot[schema]'`).
"""

from __future__ import annotations

import copy
from functools import lru_cache
from typing import Any, Callable, Iterator

import msgspec

from events.probe import PROFILES
from events.schema import (
    REPLY_TYPES,
    REQUEST_TYPES,
    AnyEvent,
    CompatVersion,
    CreateActor,
    ErrorReply,
    Location,
    RegisterWorker,
    SuspendActor,
    WorkerRuntime,
    WorkerSandboxClass,
)
from events.validate import REQUIRED_KEYS

SCHEMA_URI = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_ID = "urn:warmboot:wire-contract:v1.1"
TITLE = "warmboot wire contract v1.1"
SENT_SUFFIX = "AsSent"  # the name of a shared type as the services send it
UNIONS = ("AnyRequest", "AnyReply", "AnyEvent")

# What JSON Schema cannot say; the services check it after decoding (events.validate).
CANNOT_SAY = (
    "printable text is what Python's str.isprintable() accepts; the patterns here only "
    "exclude C0/C1 control characters and DEL",
    "attribute keys are unique within a version (only identical entries, and a second entry "
    "for a key the contract names, are excluded here)",
    "sandbox classes are unique by sandbox_class, restorable runtimes and compatible versions "
    "distinct by version whatever the order of their attributes (only identical entries are "
    "excluded here)",
    "a golden snapshot's stamp has the class of the actor created from it",
    "the worker_id of a registration equals its subject's last token",
)

Schema = dict[str, Any]


def _event_types() -> tuple[type, ...]:
    return tuple(AnyEvent.__args__)


def _walk(node: Any) -> Iterator[dict]:
    """Every JSON object of a schema, depth first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _refs_to(node: Any, rename: dict[str, str]) -> None:
    for obj in _walk(node):
        ref = obj.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/") and ref[8:] in rename:
            obj["$ref"] = "#/$defs/" + rename[ref[8:]]


def _as_sent(defs: dict[str, Schema]) -> dict[str, Schema]:
    """The same definitions with every property of every object required."""
    sent = copy.deepcopy(defs)
    for schema in sent.values():
        if schema.get("type") == "object" and "properties" in schema:
            schema["required"] = list(schema["properties"])
    return sent


# --- the rules of events.validate that JSON Schema can say ---------------------------------------


def _attribute_key_is(key: str) -> Schema:
    return {"type": "object", "properties": {"key": {"const": key}}, "required": ["key"]}


def _version_rules(schema: Schema) -> None:
    """A schema version's required keys; no identical entries; one entry per named key."""
    attributes = schema["properties"]["attributes"]
    attributes["uniqueItems"] = True
    rules = schema.setdefault("allOf", [])
    for version, keys in sorted(REQUIRED_KEYS.items()):
        rules.append({
            "if": {"type": "object", "properties": {"schema_version": {"const": version}},
                   "required": ["schema_version"]},
            "then": {"type": "object", "properties": {"attributes": {
                "type": "array", "allOf": [{"contains": _attribute_key_is(k)} for k in keys]}}},
        })
    named = sorted({k for keys in (*REQUIRED_KEYS.values(), *PROFILES.values()) for k in keys})
    rules.append({"type": "object", "properties": {"attributes": {"type": "array", "allOf": [
        {"contains": _attribute_key_is(k), "minContains": 0, "maxContains": 1} for k in named]}}})


def _unique(*fields: str) -> Callable[[Schema], None]:
    def rule(schema: Schema) -> None:
        for name in fields:
            schema["properties"][name]["uniqueItems"] = True

    return rule


NOT_BLANK = {"type": "string", "pattern": "\\S"}  # a uri given says where: not empty, not only blanks


def _suspend_rules(schema: Schema) -> None:
    uri = dict(schema["properties"]["uri"])
    default = {"default": uri.pop("default")} if "default" in uri else {}  # annotations stay on the property
    schema["properties"]["uri"] = {**default, "allOf": [uri, {"anyOf": [{"type": "null"}, NOT_BLANK]}]}


def _create_rules(schema: Schema) -> None:
    golden = {"type": "object", "required": ["golden_snapshot"],
              "properties": {"golden_snapshot": {"type": "object"}}}
    schema.setdefault("allOf", []).extend([
        {"if": golden,
         "then": {"type": "object", "properties": {"golden_snapshot": {
             "type": "object", "required": ["location", "uri"],
             "properties": {"location": {"const": Location.EXTERNAL.value}, "node": {"type": "null"},
                            "uri": NOT_BLANK}}}}},
        {"not": {"type": "object", "required": ["source_tag", "golden_snapshot"],
                 "properties": {"source_tag": {"type": "string"}, "golden_snapshot": {"type": "object"}}}},
    ])


# definition name -> what it adds; a rule whose type or field is gone fails loudly (KeyError)
RULES: dict[str, Callable[[Schema], None]] = {
    CompatVersion.__name__: _version_rules,
    WorkerRuntime.__name__: _unique("compatible_versions"),
    WorkerSandboxClass.__name__: _unique("restorable_runtimes"),
    RegisterWorker.__name__: _unique("sandbox_classes"),
    CreateActor.__name__: _create_rules,
    SuspendActor.__name__: _suspend_rules,
}


def _apply_rules(defs: dict[str, Schema]) -> None:
    for name, rule in RULES.items():
        for variant in (name, name + SENT_SUFFIX):
            if variant in defs:
                rule(defs[variant])


# --- the document ---------------------------------------------------------------------------------


def _components(types: tuple[type, ...]) -> dict[str, Schema]:
    _, defs = msgspec.json.schema_components(types)
    for obj in _walk(defs):
        obj.pop("discriminator", None)  # OpenAPI, not JSON Schema
    return defs


@lru_cache(maxsize=2)
def _document(events_as_sent: bool = False) -> Schema:
    """The document. Events are published as a log may hold them (a field with a default may be
    missing: an earlier version did not write it, and a reader takes the default, as warmboot's
    decoder does); with `events_as_sent`, as this version writes them (every field), for a check
    of what the services write (tests/traffic_tap.py)."""
    requests, replies, events = REQUEST_TYPES, REPLY_TYPES, _event_types()
    accepted = _components(requests)
    if events_as_sent:
        read: dict[str, Schema] = {}
        sent = _as_sent(_components((*replies, *events)))
    else:
        read = _components(events)
        sent = _as_sent(_components(replies))
    given = {**accepted, **read}  # the same type has the same form in both (msgspec's, as a request may send it)
    # A shared type whose sent form differs, or refers to one that does, gets a name of
    # its own on the sent side.
    rename: dict[str, str] = {}
    while True:
        renamed = copy.deepcopy(sent)
        _refs_to(renamed, rename)
        more = {n for n, s in renamed.items() if n in given and given[n] != s} - set(rename)
        if not more:
            break
        rename.update({n: n + SENT_SUFFIX for n in more})
    defs = {**given, **{rename.get(n, n): s for n, s in renamed.items()}}
    clash = (set(given) | set(sent)) & ({*UNIONS} | set(rename.values()))
    if clash:
        raise RuntimeError(f"a type of events.schema is named like a definition the schema adds: {sorted(clash)}")
    _apply_rules(defs)
    for union, members in zip(UNIONS, (requests, replies, events)):
        defs[union] = {"anyOf": [{"$ref": f"#/$defs/{t.__name__}"} for t in members]}
    document = {
        "$schema": SCHEMA_URI,
        "$id": SCHEMA_ID,
        "title": TITLE,
        "description": (
            "Every request, reply and event body of warmboot (CONTRACT.md), generated from "
            "events/schema.py. Validate a body against #/$defs/<type name>; the unions "
            f"{', '.join(UNIONS)} list the bodies of each kind. Unknown fields are allowed. "
            f"Types shared by requests and replies are published as a request may send them "
            f"(<name>) and as the services send them (<name>{SENT_SUFFIX}, every field "
            "required). " + (
                "Events as the services write them: every field required. " if events_as_sent else
                "Events as a log may hold them: a field with a default may be missing (an earlier "
                "version did not write it; read it as the default). ") +
            "Not expressed here, checked by the service: " + "; ".join(CANNOT_SAY) + "."
        ),
        "$defs": defs,
    }
    return msgspec.json.decode(msgspec.json.encode(document))  # plain JSON values (a default of () is [])


def json_schema() -> Schema:
    """The document (a fresh copy: callers may change it)."""
    return copy.deepcopy(_document())


def body_names() -> dict[str, str]:
    """Every name a body can be checked as -> its kind (`request`, `reply`, `event`, `union`, or
    `part`: an object inside bodies, such as the `Snapshot` a create's golden snapshot file holds)."""
    names = {name: "part" for name in part_types()}
    names.update({t.__name__: "request" for t in REQUEST_TYPES})
    names.update({t.__name__: "reply" for t in REPLY_TYPES})
    names.update({t.__name__: "event" for t in _event_types()})
    names.update({u: "union" for u in UNIONS})
    return names


@lru_cache(maxsize=None)
def part_types() -> dict[str, type]:
    """The objects inside bodies that the document defines under their own name (as a request may
    send them): name -> its Struct."""
    import events.schema as wire

    defined = _document()["$defs"]
    return {name: t for name, t in vars(wire).items()
            if name in defined and isinstance(t, type) and issubclass(t, msgspec.Struct)}


# --- validating a body (the PyPI `jsonschema` package) ---------------------------------------------


class SchemaUnavailable(RuntimeError):
    """`jsonschema` (or its date-time checker, `rfc3339-validator`) is not installed."""


@lru_cache(maxsize=None)
def validator(name: str, events_as_sent: bool = False) -> Any:
    """A Draft 2020-12 validator of the definition `name`, checking formats (date-time); with
    `events_as_sent`, of the document whose events require every field (`_document`)."""
    try:
        from jsonschema import Draft202012Validator
    except ImportError:
        raise SchemaUnavailable(
            "checking a body needs the jsonschema package: pip install 'warmboot[schema]'"
        ) from None
    document = _document(events_as_sent)
    if name not in document["$defs"]:
        raise KeyError(name)
    checker = Draft202012Validator.FORMAT_CHECKER
    if checker.conforms("not a time", "date-time"):  # the checker is silently absent without its package
        raise SchemaUnavailable(
            "checking date-time fields needs the rfc3339-validator package: pip install 'warmboot[schema]'"
        )
    root = {**copy.deepcopy(document), "$ref": f"#/$defs/{name}"}
    return Draft202012Validator(root, format_checker=checker)


def narrow(name: str, body: Any) -> str:
    """The member of a union a body is checked against, for errors that name its fields: an
    event by its `type`, a reply with a top-level `error` as the ErrorReply it then is."""
    if isinstance(body, dict):
        if name == "AnyEvent" and body.get("type") in {t.__name__ for t in _event_types()}:
            return body["type"]
        if name == "AnyReply" and "error" in body:
            return ErrorReply.__name__
    return name


def schema_errors(name: str, body: Any, events_as_sent: bool = False) -> list[tuple[str, str]]:
    """(JSON path, message) of each way `body` (decoded JSON) breaks the definition `name`, by path
    (`events_as_sent`: see `validator`).

    An error under `anyOf` (a nullable field, a union) is reported by the alternative
    that came closest, so that the path points at the field itself.
    """
    found = set()
    for error in validator(narrow(name, body), events_as_sent).iter_errors(body):
        for leaf in _leaves(error):
            found.add((leaf.json_path, _message(leaf)))
    return sorted(found)


def _leaves(error: Any) -> list[Any]:
    if not error.context:
        return [error]
    branches: dict[Any, list[Any]] = {}
    for e in error.context:
        branches.setdefault(e.relative_schema_path[0], []).append(e)

    def other_kind(errors: list[Any]) -> bool:  # the value is not of this alternative's type at all
        return any(e.validator == "type" and not e.relative_path for e in errors)

    candidates = [b for b in branches.values() if not other_kind(b)] or list(branches.values())
    return [leaf for e in min(candidates, key=len) for leaf in _leaves(e)]


def _message(error: Any) -> str:
    """jsonschema's message, said in the contract's words for the rules this module adds."""
    if error.validator in ("contains", "maxContains"):
        contains = error.schema.get("contains", {})
        key = contains.get("properties", {}).get("key", {}).get("const")
        if key is not None and error.validator == "contains":
            return f"requires an attribute with key {key!r}"
        if key is not None:
            return f"attribute key {key!r} appears more than once"
    if error.validator == "uniqueItems":
        return "has two identical entries"
    return error.message
