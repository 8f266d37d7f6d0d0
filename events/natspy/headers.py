"""The header blocks of NATS messages, read and written by nats-py's rules, faster than nats-py
(`events.natspy` says why this package exists):

- Header parsing. Every reader of the event log parses 4 to 7 headers per message,
  and a replay is bound by it. `parse_header_lines` gives the same dict as nats-py's
  `Client._parse_header_lines` (last of duplicate names wins, values stripped and
  decoded as UTF-8 with replacement, names that are not printable ASCII without white
  space skipped) faster: an ASCII block (all the store writes) is decoded once and
  each line is parsed once per distinct line, from a bounded table of short lines (most
  lines recur from message to message: the topic, the version, the batch id; a long one
  is a publisher's choice, and is parsed each time rather than kept). `use_lean_headers(nc)`
  installs it on a connection, the only way it is installed (the event store's link
  and the scheduler's fold both call it). nats-py's parser is a private static method:
  if a new nats-py renames it, `use_lean_headers` raises instead of silently running
  slower, and tests/test_natspy.py pins the parser against nats-py's own.
- `parse_header_block`: the headers of a `STREAM.MSG.GET` answer (a `NATS/1.0` block,
  base64 in the JSON), read by the same rule.
- `header_block`: a header block encoded once, by nats-py's rules, for
  `events.natspy.publish.publish` to send as many times as needed.
"""

from __future__ import annotations

import re
from typing import Any

import nats.errors
from nats.aio.client import Client

NATS_PARSER = "_parse_header_lines"  # the private name nats-py calls on every message with headers

_HEADER_NAME = re.compile(rb"^[\x21-\x7e]+(?!\n)$")  # printable ASCII, no white space
_WHITESPACE = " \t\n\r\x0b\x0c"  # what bytes.strip() strips
_LINES_KEPT = 4096
_LINE_KEPT_CHARS = 256  # a longer line is parsed each time, not kept (a publisher chooses its lines)

# line -> (name, value), or () for a line that gives no header
_lines: dict[str, tuple[str, str] | tuple[()]] = {}


def parse_header_lines(raw: bytes) -> dict[str, str]:
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return _parse_bytes(raw)
    headers: dict[str, str] = {}
    seen = _lines.get
    for line in text.split("\r\n"):
        pair = seen(line)
        if pair is None:
            pair = _parse_line(line)
            if len(line) <= _LINE_KEPT_CHARS:
                if len(_lines) >= _LINES_KEPT:
                    _lines.clear()
                _lines[line] = pair
        if pair:
            headers[pair[0]] = pair[1]
    return headers


def header_values(raw: bytes, wanted: tuple[tuple[str, bytes], ...]) -> dict[str, str]:
    """The headers of `wanted`, (name, name.encode()) pairs, that `raw` has, as
    `parse_header_lines(raw)` gives them, without parsing the other lines when the last
    line naming each is in the usual form (`Name:` at the start of a line)."""
    found: dict[str, str] = {}
    for name, key in wanted:
        at = raw.rfind(key)  # any line whose name strips to `name` holds these bytes: the last is at or after it
        if at < 0:
            continue
        end = at + len(key)
        if (at == 0 or raw[at - 2:at] == b"\r\n") and raw[end:end + 1] == b":":
            eol = raw.find(b"\r\n", end)
            value = raw[end + 1:] if eol < 0 else raw[end + 1:eol]
            if value.isascii():
                found[name] = value.decode().strip(_WHITESPACE)
                continue
        full = parse_header_lines(raw)  # another form: the full parser says, for every name
        return {n: full[n] for n, _ in wanted if n in full}
    return found


def header_value(raw: bytes, name: str, encoded: bytes | None = None) -> str | None:
    """`parse_header_lines(raw).get(name)`, by `header_values`; `encoded` is `name.encode()`."""
    return header_values(raw, ((name, encoded if encoded is not None else name.encode()),)).get(name)


def _parse_line(line: str) -> tuple[str, str] | tuple[()]:
    """One ASCII line, as `_parse_bytes` reads it."""
    name, sep, value = line.partition(":")
    if not sep:
        return ()
    name = name.strip(_WHITESPACE)
    if not name or not name.isprintable() or " " in name:  # isprintable: \x20-\x7e, for ASCII
        return ()
    return name, value.strip(_WHITESPACE)


def _parse_bytes(raw: bytes) -> dict[str, str]:
    """Any block, line by line: names must be printable ASCII, values are UTF-8."""
    headers: dict[str, str] = {}
    for line in raw.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep:
            name = name.strip()
            if _HEADER_NAME.match(name):
                headers[name.decode("ascii")] = value.strip().decode("utf-8", "replace")
    return headers


def use_lean_headers(nc: Any) -> None:
    """Have the connection `nc` parse message headers with `parse_header_lines`.

    The connection may be shared: every reader of it gets the same headers as before."""
    if not callable(getattr(Client, NATS_PARSER, None)):
        raise RuntimeError(
            f"nats-py {getattr(Client, '__module__', '?')} no longer has Client.{NATS_PARSER}: "
            "events/natspy/headers.py must be taught the new name (or the workaround dropped)"
        )
    if getattr(nc, NATS_PARSER, None) is not parse_header_lines:
        setattr(nc, NATS_PARSER, parse_header_lines)


_HEADER_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # nats-py's rule for a header name
_LINE_BREAKS = str.maketrans({"\r": " ", "\n": " "})


def header_block(headers: dict[str, str]) -> bytes:
    """The header block nats-py's `publish` writes for `headers`, by its rules (a name it
    refuses raises `BadHeaderError`, an empty one is skipped, a value is stripped and its
    line breaks made spaces): encoded once, for `publish` to send as many times as needed."""
    lines = [b"NATS/1.0\r\n"]
    for name, value in headers.items():
        key = name.strip()
        if not key:
            continue
        if not _HEADER_KEY.fullmatch(key):
            raise nats.errors.BadHeaderError(key)
        lines.append(b"%s: %s\r\n" % (key.encode(), value.strip().translate(_LINE_BREAKS).encode()))
    lines.append(b"\r\n")
    return b"".join(lines)


def parse_header_block(raw: bytes) -> dict[str, str]:
    """Headers of a full block (`NATS/1.0[ status]\r\nName: value\r\n...`): the status line dropped."""
    _, sep, rest = raw.partition(b"\r\n")
    return parse_header_lines(rest) if sep else {}
