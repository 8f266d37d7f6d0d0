"""`warmboot schema --check`: one body, judged by the published JSON Schema and by warmboot's decoder.

The two should agree; where they do not, the report says so (a rule that the schema
cannot express, events.jsonschema.CANNOT_SAY, is the expected case).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import click
import msgspec

from events.codec import decode_event, decode_request, decoder, field_path, json_path, unknown_fields
from events.errors import ContractError
from events.jsonschema import SchemaUnavailable, body_names, narrow, part_types, schema_errors
from events.schema import EVENT_TYPES, REPLY_TYPES, REQUEST_TYPES

TYPES = {**part_types(), **{t.__name__: t for t in (*REQUEST_TYPES, *REPLY_TYPES, *EVENT_TYPES.values())}}


@dataclass
class Verdict:
    judge: str
    errors: list[tuple[str, str]] = field(default_factory=list)  # (JSON path, message)
    note: str = ""  # why this judge gave no verdict

    @property
    def valid(self) -> bool:
        return not self.errors


@dataclass
class Report:
    name: str
    schema: Verdict
    decoder: Verdict
    ignored: list[str] = field(default_factory=list)  # contract paths of keys the type has no field for
    strict: bool = False  # whether such a key fails the check (`--strict`: a person's file, as create reads it)

    @property
    def valid(self) -> bool:
        return self.schema.valid and self.decoder.valid and not (self.strict and self.ignored)

    def text(self) -> str:
        lines = []
        for verdict in (self.schema, self.decoder):
            if verdict.note:
                lines.append(f"{verdict.judge}: {verdict.note}")
                continue
            lines.append(f"{verdict.judge}: {'valid' if verdict.valid else 'invalid'} {self.name}")
            lines.extend(f"  {path}: {message}" for path, message in verdict.errors)
        if not self.decoder.note and self.schema.valid != self.decoder.valid:
            lines.append("the JSON Schema and the decoder disagree on this body")
        if self.ignored and self.strict:  # a person's file: a misspelt key is an error (as create says it)
            lines.append(f"--strict: invalid {self.name}: no such field in a {self.name} (a reader would drop it):")
            lines.extend(f"  {json_path(path)}" for path in self.ignored)
        elif self.ignored:  # not an error on the wire (a newer writer may add fields), but a misspelt key is lost
            lines.append(f"note: {self.name} has no field for these keys, which a reader ignores (--strict fails "
                         "on them):")
            lines.extend(f"  {json_path(path)}" for path in self.ignored)
        return "\n".join(lines)


def decoder_verdict(name: str, data: bytes) -> Verdict:
    verdict = Verdict("decoder (events.codec)")
    kind = body_names()[name]
    try:
        if kind in ("request", "part"):  # a part as a request sends it: the service's checks, printable text too
            decode_request(TYPES[name], data)
        elif name == "AnyEvent":
            decode_event(data)
        elif kind == "union":
            verdict.note = f"no decoder takes any of {name}; give the body's own type with --as"
        else:
            decoder(TYPES[name]).decode(data)
    except ContractError as e:
        verdict.errors.append((json_path(e.field), f"{e.code.value}: {e.message}"))
    except msgspec.ValidationError as e:
        message, path = field_path(e)
        verdict.errors.append((json_path(path), message))
    except msgspec.DecodeError as e:
        verdict.errors.append(("$", f"not valid JSON: {e}"))
    return verdict


def schema_verdict(name: str, data: bytes) -> Verdict:
    verdict = Verdict("JSON Schema (jsonschema, 2020-12)")
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError as e:
        verdict.errors.append(("$", f"not valid JSON: {e}"))
        return verdict
    try:
        verdict.errors = schema_errors(name, body)
    except SchemaUnavailable as e:
        raise click.ClickException(str(e)) from None
    return verdict


def check_body(name: str, data: bytes, strict: bool = False) -> Report:
    names = body_names()
    if name not in names:
        raise click.BadParameter(f"{name!r} is not a body type; one of: {', '.join(sorted(names))}",
                                 param_hint="'--as'")
    if names[name] == "request" and not data.strip():
        data = b"{}"  # as the services read an empty request
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError:
        member, ignored = name, []
    else:
        member = narrow(name, body)  # a union's member, told by the body
        ignored = unknown_fields(TYPES[member], body) if member in TYPES else []
    return Report(member, schema_verdict(name, data), decoder_verdict(member, data), ignored, strict)
