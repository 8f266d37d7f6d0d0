"""Where the event store puts things: header names, subjects, limits, and the message <-> event mapping.

Pure: no connection, no loop. Every other module of the package (and any reader of
the log outside it) takes its names from here; the package docstring says why each is so.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from eventsourcing.persistence import Notification, ProgrammingError, StoredEvent

from events.subjects import bucket_name, stream_name

TOPIC_HEADER = "Warmboot-Topic"  # the library topic of the event (WireMapper: the event `type`)
VERSION_HEADER = "Warmboot-Version"  # the originator version
ID_TYPE_HEADER = "Warmboot-Id-Type"  # "uuid" when the originator id is a UUID
TRACKING_HEADER = "Warmboot-Tracking"  # on a tracking record: the notification id processed
MSG_ID_HEADER = "Nats-Msg-Id"
EXPECTED_SUBJECT_SEQ_HEADER = "Nats-Expected-Last-Subject-Sequence"
EXPECTED_SUBJECT_SEQ_SUBJECT_HEADER = "Nats-Expected-Last-Subject-Sequence-Subject"  # a fence's subject
BATCH_ID_HEADER = "Nats-Batch-Id"
BATCH_SEQ_HEADER = "Nats-Batch-Sequence"
BATCH_COMMIT_HEADER = "Nats-Batch-Commit"
SEQUENCE_HEADER = "Nats-Sequence"  # of a direct-get answer (and of a leader read, shaped alike)
SUBJECT_HEADER = "Nats-Subject"
# JetStream's advisory that a stream has a new leader, `<this>.<stream name>` (nats-server's
# JSAdvisoryStreamLeaderElectedPre)
LEADER_ELECTED_ADVISORY = "$JS.EVENT.ADVISORY.STREAM.LEADER_ELECTED"

EVENTS_PURPOSE = "events"
SNAPSHOTS_PURPOSE = "snapshots"
EVENTS_TOKEN = "ev"  # CONTRACT section 4: <prefix>.ev.<kind>.<id>
TRACKING_TOKEN = "tracking"
UUID_KIND = "aggregate"  # the kind of originator ids without one (UUIDs)

MAX_BATCH_MESSAGES = 1000  # nats-server's limit for one atomic batch
DUPLICATE_WINDOW_NS = 120 * 1_000_000_000
SNAPSHOTS_KEPT = 4

_TOKEN = re.compile(r"^[^\s.*>]+(?!\n)$")
_DOTTED = re.compile(r"^[^\s.*>]+(\.[^\s.*>]+)*(?!\n)$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_-]+(?!\n)$")


@dataclass(frozen=True, eq=False)
class SequencedStoredEvent(StoredEvent):
    """A stored event as `select_events` reads it: also its stream sequence, `seq`.

    Equal (and hashing alike) to a StoredEvent of the same four fields, so the library
    and its tests see a StoredEvent; the aggregates of this project keep `seq` so that
    the answer to a repeated request names its event's position without another read.
    """

    seq: int = 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StoredEvent):
            return NotImplemented
        return (self.originator_id, self.originator_version, self.topic, self.state) == (
            other.originator_id, other.originator_version, other.topic, other.state)

    __hash__ = StoredEvent.__hash__


# --- subjects ---------------------------------------------------------------------------


def originator_subject(namespace: str, originator_id: UUID | str) -> str:
    """`<namespace>.<kind>.<entity id>` of an originator id; see the package docstring."""
    if isinstance(originator_id, UUID):
        return f"{namespace}.{UUID_KIND}.{originator_id}"
    text = str(originator_id)
    kind, dot, entity = text.partition(".")
    if not dot:
        kind, entity = UUID_KIND, text
    elif kind == UUID_KIND:
        raise ProgrammingError(f"originator id {text!r}: the kind {UUID_KIND!r} is reserved")
    if not _TOKEN.match(kind) or not _DOTTED.match(entity):
        raise ProgrammingError(f"originator id {text!r} cannot be a NATS subject")
    return f"{namespace}.{kind}.{entity}"


def originator_of(namespace: str, subject: str, headers: Mapping[str, str] | None) -> UUID | str:
    """The originator id stored on `subject` (the inverse of `originator_subject`)."""
    rest = subject[len(namespace) + 1 :]
    kind, _, entity = rest.partition(".")
    if kind != UUID_KIND:
        return rest
    if headers and headers.get(ID_TYPE_HEADER) == "uuid":
        return UUID(entity)
    return entity


def application_token(application_name: str) -> str:
    """A subject token for an application name (names with other characters are encoded)."""
    if _SAFE_NAME.match(application_name):
        return application_name
    encoded = base64.urlsafe_b64encode(application_name.encode()).decode().rstrip("=")
    return f"~{encoded}"


def events_namespace(prefix: str) -> str:
    return f"{prefix}.{EVENTS_TOKEN}"


def tracking_subject(prefix: str, application_name: str) -> str:
    return f"{prefix}.{TRACKING_TOKEN}.{application_token(application_name)}"


@dataclass(frozen=True)
class StreamLayout:
    """The stream of one recorder purpose: its name and subjects, the namespace of its
    aggregates, and how many messages a subject keeps (-1: all)."""

    name: str
    namespace: str
    subjects: list[str]
    per_subject_limit: int


def stream_layout(prefix: str, purpose: str) -> StreamLayout:
    """Events and tracking records share a stream (one atomic batch holds both); any other
    purpose (snapshots) has a stream of its own on `<prefix>.<purpose>.>`."""
    if purpose == EVENTS_PURPOSE:
        namespace = events_namespace(prefix)
        subjects = [f"{namespace}.>", f"{prefix}.{TRACKING_TOKEN}.>"]
        return StreamLayout(stream_name(prefix), namespace, subjects, -1)
    if not _TOKEN.match(purpose) or purpose in (EVENTS_TOKEN, TRACKING_TOKEN):
        raise ProgrammingError(f"recorder purpose {purpose!r} cannot name a stream")
    namespace = f"{prefix}.{purpose}"
    limit = SNAPSHOTS_KEPT if purpose == SNAPSHOTS_PURPOSE else -1
    name = bucket_name(prefix, purpose)  # P_SNAPSHOTS: the buckets' naming rule
    return StreamLayout(name, namespace, [f"{namespace}.>"], limit)


# --- messages ---------------------------------------------------------------------------


def event_headers(event: StoredEvent) -> dict[str, str]:
    """The headers of an event message (`Nats-Msg-Id` makes a resent append a duplicate)."""
    headers = {
        MSG_ID_HEADER: f"{event.originator_id}:{event.originator_version}",
        TOPIC_HEADER: event.topic,
        VERSION_HEADER: str(event.originator_version),
    }
    if isinstance(event.originator_id, UUID):
        headers[ID_TYPE_HEADER] = "uuid"
    return headers


def tracking_message(application_name: str, notification_id: int) -> tuple[bytes, dict[str, str]]:
    """The body and headers of a tracking record."""
    body = json.dumps({"application_name": application_name, "notification_id": notification_id}).encode()
    headers = {
        MSG_ID_HEADER: f"tracking:{application_name}:{notification_id}",
        TRACKING_HEADER: str(notification_id),
    }
    return body, headers


def notification_from_message(
    prefix: str, seq: int, subject: str, headers: Mapping[str, str] | None, data: bytes
) -> Notification:
    """Turn a raw message of `<prefix>.ev.>` (from any reader) into the library's Notification."""
    headers = headers or {}
    return Notification(
        id=seq,
        originator_id=originator_of(events_namespace(prefix), subject, headers),
        originator_version=version_of(headers),
        topic=headers.get(TOPIC_HEADER) or _body_type(data),  # topic_of, inline: once per message of a replay
        state=data,
    )


def sequence_of(msg: Any) -> int:
    """The stream sequence of a message read by a direct get (or shaped like one)."""
    return int(msg.headers[SEQUENCE_HEADER])


def status_of(msg: Any) -> str | None:
    """The status of a direct-get answer that carries none of the stream's messages
    (headers only: 404 none, 204 end of a batch, ...); None for a message."""
    headers = msg.headers
    return headers.get("Status") if headers and not msg.data else None


def version_of(headers: Mapping[str, str]) -> int:
    """The originator version of a message: its header, else the end of its Nats-Msg-Id."""
    value = headers.get(VERSION_HEADER)
    if value is None:
        value = headers.get(MSG_ID_HEADER, "").rpartition(":")[2]
    return int(value or 0)


def topic_of(headers: Mapping[str, str], data: bytes) -> str:
    """The topic of a message: its header, else (another client's message) the body's `type`."""
    return headers.get(TOPIC_HEADER) or _body_type(data)


def _body_type(data: bytes) -> str:
    try:
        body = json.loads(data)
    except ValueError:
        return ""
    return str(body.get("type", "")) if isinstance(body, dict) else ""
