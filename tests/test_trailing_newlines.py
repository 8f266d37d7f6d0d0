"""A name that ends in a newline is not a name. Python's `$` also matches before a final newline, so
`re.match(r"^...$", "abc\\n")` passes: every pattern that guards a subject token ends in `(?!\\n)$`, as
the schema's do (events/schema.py). Found by an audit: `check_prefix("abc\\n")` was accepted, and that
prefix went into every subject and the generated NATS configuration."""

from __future__ import annotations

import pytest
from eventsourcing.persistence import ProgrammingError

from events.jetstream.layout import application_token, originator_subject, stream_layout
from events.natsauth import INBOX_PREFIX_ENV, USER_ENV, inbox_prefix
from events.subjects import check_prefix
from warmboot.client import Client


@pytest.mark.parametrize("name", ["abc\n", "abc\n\n", "\nabc"])
def test_a_prefix_with_a_newline_is_refused(name):
    with pytest.raises(ValueError, match="must be 1 to 32 lower-case letters"):
        check_prefix(name)
    assert check_prefix("abc") == "abc"


async def test_a_client_refuses_such_a_prefix_before_it_connects():
    with pytest.raises(Exception) as refused:
        await Client.connect("nats://127.0.0.1:1", "wb\n", connect_timeout=30)
    assert getattr(refused.value, "field", None) == "prefix", refused.value


@pytest.mark.parametrize("originator", ["actor.a-1\n", "actor\n.a-1", "a-1\n"])
def test_an_originator_id_with_a_newline_cannot_be_a_subject(originator):
    with pytest.raises(ProgrammingError, match="cannot be a NATS subject"):
        originator_subject("wb.ev", originator)
    assert originator_subject("wb.ev", "actor.a-1") == "wb.ev.actor.a-1"


def test_an_application_name_with_a_newline_is_encoded_and_a_purpose_refused():
    assert application_token("scheduler") == "scheduler"
    token = application_token("scheduler\n")
    assert token.startswith("~") and "\n" not in token
    with pytest.raises(ProgrammingError, match="cannot name a stream"):
        stream_layout("wb", "snapshots\n")


def test_a_user_name_with_a_newline_gets_no_inbox_of_its_own(monkeypatch):
    monkeypatch.delenv(INBOX_PREFIX_ENV, raising=False)
    monkeypatch.setenv(USER_ENV, "bob\n")
    assert inbox_prefix("nats://127.0.0.1:4222") is None  # nats-py's own random inbox, not `_INBOX.bob\n`
    monkeypatch.setenv(USER_ENV, "bob")
    assert inbox_prefix("nats://127.0.0.1:4222") == "_INBOX.bob"
    monkeypatch.delenv(USER_ENV)
    assert inbox_prefix("nats://127.0.0.1:4222", seed="/keys/bob\n.nk") is None
    assert inbox_prefix("nats://127.0.0.1:4222", seed="/keys/bob.nk") == "_INBOX.bob"
