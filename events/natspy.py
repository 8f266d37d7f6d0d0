"""Every workaround of nats-py this project relies on, in one module, installed one way.

nats-py is the project's only NATS client; where its public API is too slow for a
replay of the log, or says less than needed, the gap is closed here and nowhere else:

- Header parsing. Every reader of the event log parses 4 to 7 headers per message,
  and a replay is bound by it. `parse_header_lines` gives the same dict as nats-py's
  `Client._parse_header_lines` (last of duplicate names wins, values stripped and
  decoded as UTF-8 with replacement, names that are not printable ASCII without white
  space skipped) faster: an ASCII block (all the store writes) is decoded once and
  each line is parsed once per distinct line, from a bounded table (most lines recur
  from message to message: the topic, the version, the batch id). `use_lean_headers(nc)`
  installs it on a connection, the only way it is installed (the event store's link
  and the scheduler's fold both call it). nats-py's parser is a private static method:
  if a new nats-py renames it, `use_lean_headers` raises instead of silently running
  slower, and tests/test_natspy.py pins the parser against nats-py's own.
- `parse_header_block`: the headers of a `STREAM.MSG.GET` answer (a `NATS/1.0` block,
  base64 in the JSON), read by the same rule.
- `ack_positions`: the stream sequence and the number pending, from the reply subject
  of a JetStream push delivery (`$JS.ACK...`), without building nats-py's metadata
  object per message.
"""

from __future__ import annotations

import re
from typing import Any

from nats.aio.client import Client

NATS_PARSER = "_parse_header_lines"  # the private name nats-py calls on every message with headers

_HEADER_NAME = re.compile(rb"^[\x21-\x7e]+$")  # printable ASCII, no white space
_WHITESPACE = " \t\n\r\x0b\x0c"  # what bytes.strip() strips
_LINES_KEPT = 4096

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
            if len(_lines) >= _LINES_KEPT:
                _lines.clear()
            _lines[line] = pair
        if pair:
            headers[pair[0]] = pair[1]
    return headers


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
            "events/natspy.py must be taught the new name (or the workaround dropped)"
        )
    if getattr(nc, NATS_PARSER, None) is not parse_header_lines:
        setattr(nc, NATS_PARSER, parse_header_lines)


def parse_header_block(raw: bytes) -> dict[str, str]:
    """Headers of a full block (`NATS/1.0[ status]\r\nName: value\r\n...`): the status line dropped."""
    _, sep, rest = raw.partition(b"\r\n")
    return parse_header_lines(rest) if sep else {}


def ack_positions(reply: str) -> tuple[int, int]:
    """(stream sequence, messages pending) from a JetStream delivery's reply subject.

    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<time>.<pending>`, or with a
    domain and an account hash after `ACK` (12 tokens)."""
    tokens = reply.split(".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[8])
    return int(tokens[7]), int(tokens[10])
