"""Encoders and decoders for bodies and events: msgspec, decoding straight into Structs.

`decode_request` is the edge: bytes in, a valid request Struct out, or a
`ContractError(INVALID_ARGUMENT)` naming the field. Nothing past it re-validates.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, TypeVar

import msgspec
import msgspec.inspect

from events.errors import ContractError, invalid
from events.schema import PATTERN_WORDS, AnyEvent, ErrorReply, Event
from events.validate import check_request

T = TypeVar("T")

encoder = msgspec.json.Encoder()
encode = encoder.encode
event_decoder = msgspec.json.Decoder(AnyEvent)

MAX_BODY = 1 << 20  # bigger bodies are refused before decoding

# msgspec ends its message with ` - at `$.a[0].b``, or ` - at `key` in `$.labels`` for a map key
_AT = re.compile(r" - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`$")
_MISSING = re.compile(r"missing required field `(?P<name>[^`]+)`")
# msgspec says a pattern as "`str` matching regex '<the pattern's repr>'"
_PATTERN = re.compile(r"`str` matching regex (?P<regex>'.*')")
_WORDS_BY_REPR = {repr(pattern): words for pattern, words in PATTERN_WORDS.items()}


@lru_cache(maxsize=None)
def decoder(type_: type[T]) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(type_)


def json_path(field_name: str | None) -> str:
    """A contract `field` (`a[0].b`) as a JSON path (`$.a[0].b`), as a body's file is read."""
    if not field_name:
        return "$"
    return "$" + (field_name if field_name.startswith("[") else "." + field_name)


def field_path(error: msgspec.ValidationError) -> tuple[str, str | None]:
    """Split msgspec's message into (message, path): `...- at `$.a[0].b`` -> ("...", "a[0].b")."""
    text = str(error)
    match = _AT.search(text)
    path = match.group("path").lstrip(".") if match else ""
    message = text[: match.start()] if match else text
    pattern = _PATTERN.search(message)
    if pattern:  # the pattern in words (`events.schema.PATTERN_WORDS`)
        words = _WORDS_BY_REPR.get(pattern.group("regex"))
        if words is not None:
            message = message[: pattern.start()] + words + message[pattern.end():]
    if match and match.group("key"):
        message = f"{message} (in a key)"
    missing = _MISSING.search(message)
    if missing:
        path = f"{path}.{missing.group('name')}" if path else missing.group("name")
    return message, path or None


GIVEN_CHARS = 80  # of a refused value, quoted in its error


def given(data: bytes, path: str | None, message: str) -> str:
    """`; got 'bad id!'`: the refused value at `path` of the body `data`, quoted (a string or a
    number; cut at GIVEN_CHARS) to end its error with, so that the caller sees what was refused;
    "" when the message says it already (msgspec's `got `int``), names a key or a missing field, or
    the value is not there to quote."""
    if not path or "got " in message or message.endswith("(in a key)") or message.startswith("Object missing"):
        return ""
    try:
        value: Any = msgspec.json.decode(data)
        for step in re.findall(r"\[(\d+)\]|([^.\[\]]+)", path):
            index, key = step
            value = value[int(index)] if index else value[key]
    except (msgspec.DecodeError, LookupError, TypeError, ValueError):
        return ""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return ""
    text = repr(value)
    return f"; got {text[:GIVEN_CHARS]}{'...' if len(text) > GIVEN_CHARS else ''}"


def unknown_fields(type_: Any, value: Any, path: str = "") -> list[str]:
    """The contract paths (`a[0].b`) of `value`'s object keys that `type_` has no field for.

    The decoders ignore them, as the contract asks of a reader (a newer writer may add fields);
    a file a person wrote is checked with this too, so a misspelt key is said, not dropped.
    `value` is the body as `msgspec.json.decode` gives it untyped; a value of the wrong kind is
    the decoder's to refuse, so it is passed over here."""
    return _unknown(msgspec.inspect.type_info(type_), value, path)


def _unknown(info: Any, value: Any, path: str) -> list[str]:
    inspect = msgspec.inspect
    if isinstance(info, inspect.Metadata):
        return _unknown(info.type, value, path)
    if isinstance(info, inspect.UnionType):
        members = [t for t in info.types if not isinstance(t, inspect.NoneType)]
        if len(members) == 1:  # an optional value: its type
            return _unknown(members[0], value, path)
        structs = [t for t in members if isinstance(t, inspect.StructType)]
        tagged = isinstance(value, dict) and structs and structs[0].tag_field in value
        # a tagged union's member is the one its tag names
        chosen = [t for t in structs if tagged and t.tag == value[t.tag_field]]
        return _unknown(chosen[0], value, path) if len(chosen) == 1 else []
    if isinstance(info, inspect.StructType) and isinstance(value, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        found = []
        for key, item in value.items():
            where = f"{path}.{key}" if path else key
            found += [where] if key not in fields and key != info.tag_field else _unknown(fields.get(key), item, where)
        return found
    if isinstance(info, (inspect.ListType, inspect.VarTupleType)) and isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _unknown(info.item_type, item, f"{path}[{i}]")]
    if isinstance(info, inspect.DictType) and isinstance(value, dict):
        return [p for key, item in value.items() for p in _unknown(info.value_type, item, f"{path}.{key}")]
    return []


def decode_request(type_: type[T], data: bytes, *, path_prefix: str = "") -> T:
    """Decode and validate a request body; raise INVALID_ARGUMENT naming the field."""
    if len(data) > MAX_BODY:
        raise invalid(f"body of {len(data)} bytes exceeds the limit of {MAX_BODY}")
    if not data.strip():
        data = b"{}"
    if not data.isascii():  # msgspec would skip an unknown field's text unchecked: UTF-8 everywhere
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise invalid(f"body is not valid JSON: invalid UTF-8 at byte {e.start}") from None
    try:
        value = decoder(type_).decode(data)
    except msgspec.ValidationError as e:
        message, path = field_path(e)
        message += given(data, path, message)
        raise invalid(message, f"{path_prefix}{path}" if path else None) from None
    except msgspec.DecodeError as e:
        raise invalid(f"body is not valid JSON: {e}") from None
    except RecursionError:
        raise invalid("body nests too deeply") from None
    return check_request(type_, value)


def decode_event(data: bytes) -> Event:
    return event_decoder.decode(data)


def decode_reply(type_: type[T], data: bytes) -> T:
    """Decode a reply; an error body becomes the ContractError it carries."""
    if data.startswith(b'{"error"'):
        raise ContractError.from_detail(decoder(ErrorReply).decode(data).error)
    return decoder(type_).decode(data)


def to_builtins(value: Any) -> Any:
    """Plain JSON values (dicts, lists, str, numbers) exactly as the value goes on the wire."""
    return msgspec.json.decode(encode(value))
