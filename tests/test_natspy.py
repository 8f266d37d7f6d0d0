"""The nats-py workarounds (events.natspy): the lean header parser reads every block as
its line-by-line byte parser does, and as nats-py does for the names NATS clients write
(its table of lines seen changes nothing but the speed); it is installed on a connection
the one way the project installs it, and a nats-py that renames the private parser
fails here, loudly, instead of leaving replays silently slower."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

import pytest

from events import natspy as headers
from events.natspy import (NATS_PARSER, _parse_bytes, ack_positions, header_value, header_values, parse_header_block, parse_header_lines,
                           use_lean_headers)

SAMPLES = [
    b"Nats-Msg-Id: worker.w-1:1\r\nWarmboot-Topic: WorkerDrained\r\nWarmboot-Version: 1\r\n",
    b"Nats-Stream: T_EVENTS\r\nNats-Subject: t.ev.worker.w-1\r\nNats-Sequence: 7\r\n\r\n",
    b"A:b\r\nBad Name: x\r\nC:\t d \r\nno colon here\r\n",
    "Reason: caf\u00e9 \u2014 ok\r\n".encode(),
    b"\xff\xfe: dropped\r\nKept: \xff\r\n",
    b": no name\r\n \x0b: blank name\r\nDel\x7f: x\r\nCtl\x01: y\r\nSep\x1c: z\r\nA: 1\r\nA: 2\r\n",
    b"K:\x0c v \x0b\r\nL: a\nb\r\nM:\r\nN: \r\n\r\n\r\n",
]

# the characters header blocks are made of, the awkward ones included
_CHARS = st.sampled_from(list(":- \t\r\n\x0b\x0c\x1c\x7f\x01aZ09é\u2014") + ["\r\n"])
_LINE = st.lists(_CHARS, max_size=12).map("".join)
_BLOCK = st.lists(_LINE, max_size=6).map(lambda lines: "\r\n".join(lines).encode())
_TOKEN = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, blacklist_characters=":"), min_size=1,
                 max_size=8)
_VALUE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12)
_WELL_FORMED = st.lists(st.tuples(_TOKEN, _VALUE), max_size=8).map(
    lambda pairs: "".join(f"{k}: {v}\r\n" for k, v in pairs).encode() + b"\r\n")


def test_samples_read_as_the_byte_parser_and_nats_py_read_them():
    for raw in SAMPLES:
        assert parse_header_lines(raw) == _parse_bytes(raw)
        assert parse_header_lines(raw) == parse_header_lines(raw)  # again, from the table
    for raw in SAMPLES[:5]:  # names that are tokens (or not ASCII at all): nats-py agrees
        assert parse_header_lines(raw) == Client._parse_header_lines(raw)


@settings(max_examples=400, deadline=None)
@given(_BLOCK)
def test_any_block_reads_as_the_byte_parser_reads_it(raw):
    assert parse_header_lines(raw) == _parse_bytes(raw)
    assert parse_header_lines(raw) == _parse_bytes(raw)


@settings(max_examples=300, deadline=None)
@given(_WELL_FORMED)
def test_blocks_of_tokens_read_as_nats_py_reads_them(raw):
    assert parse_header_lines(raw) == Client._parse_header_lines(raw)


# blocks made of header names and the bytes around them that make a line read otherwise
_PIECES = st.sampled_from(["Warmboot-Topic", "X-Warmboot-Topic", "Warmboot-Topics", "warmboot-topic", ":", ": ",
                           " ", "\t", "\x0b", "\r\n", "\n", "\r", "a", "7", "\u00e9", "\x01"])
_NAMED_BLOCK = st.lists(_PIECES, max_size=24).map(lambda pieces: "".join(pieces).encode())


@settings(max_examples=3000, deadline=None)
@given(_NAMED_BLOCK, st.sampled_from(["Warmboot-Topic", "a", "X-Warmboot-Topic"]))
def test_one_header_s_value_is_the_one_the_full_parser_gives(raw, name):
    assert header_value(raw, name) == parse_header_lines(raw).get(name) == _parse_bytes(raw).get(name)


@settings(max_examples=3000, deadline=None)
@given(_NAMED_BLOCK, st.lists(st.sampled_from(["Warmboot-Topic", "a", "X-Warmboot-Topic", "Warmboot-Topics"]),
                              min_size=1, max_size=3, unique=True))
def test_several_headers_values_are_the_ones_the_full_parser_gives(raw, names):
    full = parse_header_lines(raw)
    assert header_values(raw, tuple((n, n.encode()) for n in names)) == {n: full[n] for n in names if n in full}


@given(_BLOCK | _WELL_FORMED, st.sampled_from(["a", "Z", "a-", "A"]))
def test_one_header_s_value_is_the_full_parser_s_for_any_block(raw, name):
    assert header_value(raw, name) == parse_header_lines(raw).get(name)


def test_one_header_s_value_from_the_blocks_the_store_writes():
    raw = (b"Nats-Msg-Id: actor.a1:3\r\nWarmboot-Topic: ActorPlaced\r\nWarmboot-Version: 3\r\n"
           b"Nats-Expected-Last-Subject-Sequence: 52\r\nNats-Batch-Id: mo9H\r\nNats-Batch-Sequence: 5\r\n\r\n")
    assert header_value(raw, "Warmboot-Topic") == "ActorPlaced"
    assert header_value(raw, "Warmboot-Version", b"Warmboot-Version") == "3"
    assert header_value(raw, "Nats-Batch-Commit") is None
    assert header_value(b"Warmboot-Topic: A\r\n Warmboot-Topic : B\r\n", "Warmboot-Topic") == "B"  # the last wins


def test_the_table_of_lines_stays_bounded_and_is_only_a_cache():
    blocks = [f"Nats-Msg-Id: actor.a{i}:1\r\nWarmboot-Topic: ActorCreated\r\n\r\n".encode() for i in range(10_000)]
    for raw in blocks:
        assert parse_header_lines(raw) == _parse_bytes(raw)
        assert len(headers._lines) <= headers._LINES_KEPT


def test_nats_py_still_has_the_parser_this_module_replaces():
    # If this fails, a new nats-py renamed or removed its private header parser: teach
    # events/natspy.py the new name (replays would otherwise run at nats-py's own speed).
    assert callable(getattr(Client, NATS_PARSER, None))
    assert Client._parse_header_lines(SAMPLES[0]) == parse_header_lines(SAMPLES[0])


def test_the_lean_parser_is_installed_on_a_connection_and_refuses_a_changed_nats_py(monkeypatch):
    nc = Client()
    use_lean_headers(nc)
    assert getattr(nc, NATS_PARSER) is parse_header_lines
    assert Client._parse_header_lines is not parse_header_lines  # the class is left as it is
    monkeypatch.delattr(Client, NATS_PARSER)
    with pytest.raises(RuntimeError, match="natspy"):
        use_lean_headers(Client())


def test_a_stream_msg_get_block_and_an_ack_subject_are_read_alike_everywhere():
    assert parse_header_block(b"NATS/1.0\r\nA: 1\r\nA: 2\r\n\r\n") == {"A": "2"}  # the last wins, as nats-py
    assert parse_header_block(b"") == {}
    assert ack_positions("$JS.ACK.S.C.1.42.7.1700000000.3") == (42, 3)
    assert ack_positions("$JS.ACK.dom.acc.S.C.1.42.7.1700000000.3.rnd") == (42, 3)
