"""Encoders and decoders for bodies and events: msgspec, decoding straight into Structs.

`decode_request` is the edge: bytes in, a valid request Struct out, or a
`ContractError(INVALID_ARGUMENT)` naming the field. Nothing past it re-validates.
"""

from __future__ import annotations

import ast
import itertools
import re
import types
import typing
from functools import lru_cache
from typing import Any, Generic, TypeVar

import msgspec
import msgspec.inspect

from events.errors import ContractError, body_too_large, invalid
from events.schema import PATTERN_WORDS, AnyEvent, ErrorReply, Event
from events.validate import check_request

T = TypeVar("T")

encoder = msgspec.json.Encoder()
encode = encoder.encode

MAX_BODY = 1 << 20  # bigger bodies are refused before decoding

# msgspec ends its message with ` - at `$.a[0].b``, or ` - at `key` in `$.labels`` for a map key
_AT = re.compile(r" - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`$")
_MISSING = re.compile(r"missing required field `(?P<name>[^`]+)`")
# msgspec says a pattern as "`str` matching regex '<the pattern's repr>'"
_PATTERN = re.compile(r"`str` matching regex (?P<regex>'.*')")
_WORDS_BY_REPR = {repr(pattern): words for pattern, words in PATTERN_WORDS.items()}
# msgspec refuses an enum's (or a Literal's) value as "Invalid enum value <its repr>", and no more
_ENUM = re.compile(r"Invalid enum value (?P<value>.*)", re.S)
# a step of msgspec's path: `[0]`, `[...]` (a map's value) or `.name`
_STEP = re.compile(r"\[(?P<index>\d+)\]|\[\.\.\.\]|\.(?P<name>[^.\[\]]+)")


class Decoder(Generic[T]):
    """msgspec's JSON decoder for `type_`, but for the error of a refused enum value: msgspec says
    only the value (`Invalid enum value 'memory'`), this says what is allowed too (`enum_error`)."""

    __slots__ = ("type", "_decode")

    def __init__(self, type_: Any) -> None:
        self.type = type_
        self._decode = msgspec.json.Decoder(type_).decode

    def decode(self, data: bytes) -> T:
        try:
            return self._decode(data)
        except msgspec.ValidationError as e:
            said = enum_error(self.type, data, e)
            if said is None:
                raise
            raise said from None


@lru_cache(maxsize=None)
def decoder(type_: type[T]) -> Decoder[T]:
    return Decoder(type_)


event_decoder: Decoder[Event] = Decoder(AnyEvent)
_type_info = lru_cache(maxsize=None)(msgspec.inspect.type_info)  # for `enum_error`


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


def quoted(value: Any) -> str:
    """A refused value quoted, cut at GIVEN_CHARS (`'bad id!'`): as an error says it, here and in the
    CLI's usage errors (`warmboot.cli_common.request_field`)."""
    text = repr(value)
    return f"{text[:GIVEN_CHARS]}{'...' if len(text) > GIVEN_CHARS else ''}"


def _got(value: Any) -> str:
    """`; got 'bad id!'`: a refused value quoted to end its error with."""
    return f"; got {quoted(value)}"


def path_steps(path: str) -> list[int | str]:
    """A field path as `field_path` gives it (`classes[0].runtime`) as its steps: indices and names."""
    return [int(index) if index else name for index, name in re.findall(r"\[(\d+)\]|([^.\[\]]+)", path)]


def at_path(value: Any, steps: list[int | str]) -> Any:
    """What the decoded body `value` holds at `steps` (`path_steps`); LookupError or TypeError if nothing."""
    for step in steps:
        value = value[step]
    return value


def given(data: bytes, path: str | None, message: str) -> str:
    """`; got 'bad id!'`: the refused value at `path` of the body `data`, quoted (a string or a
    number; `_got`) to end its error with, so that the caller sees what was refused; "" when the
    message says it already (msgspec's `got `int``, `Invalid enum value 'x'`), names a key or a
    missing field, or the value is not there to quote."""
    if (not path or "got " in message or message.endswith("(in a key)") or message.startswith("Object missing")
            or _ENUM.match(message)):
        return ""
    try:
        value: Any = at_path(msgspec.json.decode(data), path_steps(path))
    except (msgspec.DecodeError, LookupError, TypeError, ValueError):
        return ""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return ""
    return _got(value)


def enum_error(type_: Any, data: bytes, error: msgspec.ValidationError) -> msgspec.ValidationError | None:
    """msgspec's `Invalid enum value 'memory' - at `$.fidelity`` for a body `data` of `type_`, as
    `expected one of MEMORY, VOLUMES, ROOTFS; got 'memory' - at `$.fidelity``: the values the
    field's enum (or Literal) allows, in its order, found from `type_` along the error's path.
    Values stay case-sensitive; one that is an allowed value but for its case is told so.
    None when `error` is not of a refused enum value, or its enum is not found."""
    text = str(error)
    at = _AT.search(text)
    refused = _ENUM.fullmatch(text[: at.start()] if at else text)
    if refused is None:
        return None
    steps = [(m.group("index"), m.group("name")) for m in _STEP.finditer(at.group("path"))] if at else []
    try:
        body = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        body = None
    allowed = _allowed(_type_info(type_), body, steps, in_key=bool(at and at.group("key")))
    if not allowed:
        return None
    try:  # msgspec quotes the value as its repr
        value = ast.literal_eval(refused.group("value"))
    except (ValueError, SyntaxError, RecursionError):
        value = refused.group("value")
    names = [str(v) for v in allowed]
    case = " (enum values are upper case)" if isinstance(value, str) and value.upper() in names else ""
    where = text[at.start():] if at else ""
    return msgspec.ValidationError(f"expected one of {', '.join(names)}{_got(value)}{case}{where}")


def _allowed(info: Any, value: Any, steps: list[tuple[str | None, str | None]], in_key: bool) -> list[Any]:
    """The values of the enum (or Literal) that `info` has at the path `steps` (in a map's key
    there when `in_key`), `value` being the body there as decoded untyped; [] when there is none."""
    inspect = msgspec.inspect
    if isinstance(info, inspect.Metadata):
        return _allowed(info.type, value, steps, in_key)
    if isinstance(info, inspect.UnionType):
        enums = [t for t in info.types if isinstance(t, inspect.EnumType | inspect.LiteralType)]
        member = enums[0] if len(enums) == 1 and not steps and not in_key else _member(info, value)
        return _allowed(member, value, steps, in_key) if member is not None else []
    if not steps:
        if in_key:
            return _allowed(info.key_type, None, [], False) if isinstance(info, inspect.DictType) else []
        if isinstance(info, inspect.EnumType):
            return [member.value for member in info.cls]
        return list(info.values) if isinstance(info, inspect.LiteralType) else []  # (as msgspec orders them)
    (index, name), rest = steps[0], steps[1:]
    if name is not None and isinstance(info, inspect.StructType):
        fields = {f.encode_name: f.type for f in info.fields}
        item = value.get(name) if isinstance(value, dict) else None
        return _allowed(fields[name], item, rest, in_key) if name in fields else []
    if index is not None:
        i = int(index)
        item = value[i] if isinstance(value, list) and i < len(value) else None
        if isinstance(info, inspect.ListType | inspect.VarTupleType | inspect.SetType | inspect.FrozenSetType):
            return _allowed(info.item_type, item, rest, in_key)
        if isinstance(info, inspect.TupleType) and i < len(info.item_types):
            return _allowed(info.item_types[i], item, rest, in_key)
        return []
    if name is None and isinstance(info, inspect.DictType):  # `[...]`: a value of the map, its key unsaid
        return _allowed(info.value_type, None, rest, in_key)
    return []


def _member(info: Any, value: Any) -> Any:
    """The member of the union `info` that `value` (decoded untyped) is: an optional value's type,
    or the member of a tagged union that its tag names; None when it is not told."""
    inspect = msgspec.inspect
    members = [t for t in info.types if not isinstance(t, inspect.NoneType)]
    if len(members) == 1:
        return members[0]
    structs = [t for t in members if isinstance(t, inspect.StructType)]
    tagged = isinstance(value, dict) and structs and structs[0].tag_field in value
    chosen = [t for t in structs if tagged and t.tag == value[t.tag_field]]
    return chosen[0] if len(chosen) == 1 else None


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
    if isinstance(info, inspect.UnionType):  # an optional value's type, a tagged union's member its tag names
        member = _member(info, value)
        return _unknown(member, value, path) if member is not None else []
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


# a refused map entry is looked for among the map's first entries only (a map of the contract holds at
# most 64; a hostile body's, of tens of thousands, took 0.2 s of a service's CPU): past them, `a[...]`
MAP_ENTRIES_SEARCHED = 1024


def map_entry(type_: Any, data: bytes | Any, message: str, path: str | None) -> tuple[str, str] | None:
    """msgspec's refusal (`field_path`'s message and path) of a body of `type_` at a map's entry
    (`labels[...]`: a value, its key unsaid; `labels` with "(in a key)": a key) as (the message ending
    with the value or key refused, unless it says what it got; the path naming the key, `labels.<key>`
    as docs/contract.md names it, or the map's own for a key): the map's first entry its type refuses
    alone (`data`, JSON or decoded). None when the refusal is of no map's entry, or it is not found."""
    in_key = message.endswith("(in a key)")
    if not path or (not in_key and "[...]" not in path):
        return None
    at, _, rest = path.partition("[...]")
    steps = path_steps(at)
    map_type = _map_type(type_, steps)
    try:
        entries: Any = at_path(msgspec.json.decode(data) if isinstance(data, bytes) else data, steps)
    except (msgspec.DecodeError, LookupError, TypeError, ValueError, RecursionError):
        return None
    if map_type is None or not isinstance(entries, dict):
        return None
    for key, value in itertools.islice(entries.items(), MAP_ENTRIES_SEARCHED):
        try:
            msgspec.convert({key: value}, map_type)
        except msgspec.ValidationError as e:
            if field_path(e)[0] != message:
                return None
            said = message if "got " in message else message + _got(key if in_key else value)
            return (said, at) if in_key else (said, f"{at}.{key}{rest}")
    return None


def _map_type(type_: Any, steps: list[int | str]) -> Any:
    """The dict type (its own constraints dropped: one entry is checked) at `steps` of `type_`, a
    Struct; None if there is none."""
    def bare(t: Any) -> Any:  # Annotated and Optional taken off
        while True:
            if typing.get_origin(t) is typing.Annotated:
                t = typing.get_args(t)[0]
            elif typing.get_origin(t) in (typing.Union, types.UnionType):
                members = [m for m in typing.get_args(t) if m is not type(None)]
                if len(members) != 1:
                    return None
                t = members[0]
            else:
                return t

    t = bare(type_)
    for step in steps:
        if isinstance(step, int) and typing.get_origin(t) in (list, tuple, set, frozenset):
            t = bare(typing.get_args(t)[0])
        elif isinstance(step, str) and isinstance(t, type) and issubclass(t, msgspec.Struct):
            t = bare(next((f.type for f in msgspec.structs.fields(t) if f.encode_name == step), None))
        else:
            return None
    return t if typing.get_origin(t) is dict else None


def decode_request(type_: type[T], data: bytes, *, path_prefix: str = "") -> T:
    """Decode and validate a request body; raise INVALID_ARGUMENT naming the field."""
    if len(data) > MAX_BODY:
        raise body_too_large(len(data), MAX_BODY)
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
        keyed = map_entry(type_, data, message, path)
        if keyed is not None:
            message, path = keyed
        else:
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
