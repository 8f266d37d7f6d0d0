"""A persistence module for the eventsourcing library that stores events in NATS JetStream.

Select it with the library's setting ``PERSISTENCE_MODULE=events.jetstream``
(`services.process.store_env` builds the whole environment). Settings, read
through the library's environment (so ``<APPNAME>_NATS_URL`` overrides
``NATS_URL`` for one application):

=============================  ==========================================================
``NATS_URL``                   server URL(s), comma-separated for a cluster;
                               default ``nats://127.0.0.1:4222``
``WARMBOOT_PREFIX``            subject prefix, default ``warmboot``
``WARMBOOT_STREAM_REPLICAS``   replicas of a stream this module creates, default 1
``NATS_CREDS``                 path of a credentials file (JWT + nkey seed)
``NATS_USER``/``NATS_PASSWORD``  user and password
``NATS_TOKEN``                 authentication token
``NATS_NKEY_SEED``             path of an nkey seed file (``warmboot nats-config --auth nkey``)
``NATS_INBOX_PREFIX``          inbox prefix of the connection (the services' own, `services_inbox`)
``WARMBOOT_STORE_TIMEOUT``     seconds an operation keeps retrying transient errors
                               (no responders, timeouts, 503, a leader election)
                               before raising `StoreUnavailableError`; default 30
``CREATE_TABLE``               ``no`` skips creating the streams (the library's name)
=============================  ==========================================================

Layout, for a prefix ``p`` (CONTRACT section 4):

- Stream ``P_EVENTS`` (file storage, ``allow_atomic``, ``allow_direct``, a
  duplicate window of 2 minutes, no limit that discards anything) holds the
  events on ``p.ev.<kind>.<entity id>`` and the tracking records of process
  applications on ``p.tracking.<application name>``: tracking records are
  committed in the same atomic batch as the events they caused, and an atomic
  batch cannot span streams.
- An originator id ``<kind>.<entity id>`` (``worker.w-17``) is stored on
  ``p.ev.worker.w-17``. An id without a ``.`` (the library's UUIDs) goes to
  ``p.ev.aggregate.<id>``, with the header ``Warmboot-Id-Type: uuid`` for a UUID
  so that reading gives back a UUID; the kind ``aggregate`` is reserved for that.
- Each event message: body = the stored event's state (for `WireMapper`, the
  event Struct's JSON, so any NATS client can read the log), headers
  ``Nats-Msg-Id: <originator id>:<version>`` (a retried append is stored once),
  `TOPIC_HEADER` and `VERSION_HEADER`.
- Snapshots (the aggregate recorder of purpose ``snapshots``) live in their own
  stream ``P_SNAPSHOTS`` on ``p.snapshots.<kind>.<entity id>``, which keeps the
  last `SNAPSHOTS_KEPT` snapshots of each aggregate: older ones are redundant,
  and the event stream stays nothing but events.

Writing. `insert_events` appends all messages of one call as one JetStream atomic
batch (at most `MAX_BATCH_MESSAGES`), each subject's first message carrying
``Nats-Expected-Last-Subject-Sequence``: the batch is stored whole or not at all,
and only if no subject has moved on since its writer read it. The expected
sequence of a subject comes from what this process last read or wrote there; a
first version (0 or 1) expects an empty subject; otherwise the subject's last
message is looked up. Versions of an aggregate only grow: an event whose version
is not above the stored last version of its aggregate is a conflict,
`eventsourcing.persistence.IntegrityError` (when the server refuses an
expectation, the subject is read again: a conflict if the version is taken,
another attempt if not). Transient errors (no responders, timeouts, 503, a
leader election, a dropped connection) are retried with backoff within
``WARMBOOT_STORE_TIMEOUT``; a resent batch whose first attempt was stored after
all is recognised by its message ids and contents, and not stored twice; a version
found taken by a copy that is not its own is a conflict, however long ago it was
written (past the duplicate window the server no longer refuses the id). The store
hears of each stream's leader elections (JetStream's advisory): a request waiting on
the old leader is sent again to the new one at once, and a pause between attempts
ends, so writes go on within moments of the election, not after a 5 s time-out.
The application recorders return the stream sequences of the events written:
notification ids are stream sequences, so tracking records (and anything else
in the stream) are gaps that readers skip.

Guarding other subjects: ``insert_events(stored_events, expected_last_seqs=...)``
takes a mapping ``{originator_id: stream sequence}``; for those originators the
given sequence (0 for "no event yet") is the expected last sequence of their
subject, instead of the one this module looks up. The library passes keyword
arguments of ``Application.save`` down to the recorder, so::

    app.save(actor, booking, expected_last_seqs={"booking.w-17": 1234})

commits the actor's events and the booking marker atomically, and only if the
booking subject's last message is still sequence 1234 (otherwise IntegrityError,
nothing written). Every originator named there must have an event in the call.
A subject the call writes nothing to is fenced instead: ``fences={originator_id:
stream sequence}`` commits only while that subject's last sequence is still the one
given (IntegrityError otherwise, nothing written). Each fence rides on a message of
the call that has no expectation of its own (one that is not the first of its
subject), as ``Nats-Expected-Last-Subject-Sequence-Subject``; a call with too few
such messages is refused (ProgrammingError). The snapshotter fences a pause on the
history of the worker the actor is placed on.

Reading. ``select_events`` and ``select_notifications`` use batched direct gets
(one request answers up to `READ_PAGE` messages); ``subscribe`` uses an ordered
consumer (made through a leader election as the store's requests are, within
``WARMBOOT_STORE_TIMEOUT``; recreated by nats-py after a server restart, from where it was);
``max_notification_id`` is one direct get of the last event message. Topics are
filtered on the `TOPIC_HEADER` of each message, here, not by the server. On a
replicated stream a direct get may be answered by a replica that is behind: a
read of a subject that comes back older than what this process wrote or read
there is asked again, then made through the stream leader, so a process always
reads its own writes.

Threads. The library is synchronous and nats-py is asyncio: the store runs one
event-loop thread and one connection per (URL, credentials) in the process,
shared by every factory and recorder that uses them, reconnecting forever after
a server restart. Calling a recorder from that loop's own thread is an error;
asyncio code calls recorders through a thread (``asyncio.to_thread``), except the
one append on a hot path: ``insert_events_async`` (the scheduler's group commit)
is the same append awaited from the caller's loop (``Link.submit``). The scheduler
also makes its store with ``links_on(its loop)``: that store's link runs on the
scheduler's own loop, so its appends cross no thread at all.

The package, layer by layer (as the library's sqlite.py and postgres.py separate
the datastore from the recorders), each module using only those above it:

=================  ==============================================================
``layout``         header names, subjects, limits, message <-> event (pure)
``errors``         the one place where server answers and nats-py exceptions
                   become the library's errors (``StoreUnavailableError``, ...)
``retry``          the one retry loop (budget, backoff) and the one catch-up loop
                   (a replica behind: ask again, then read through the leader)
``lastseen``       what this process knows of each subject's last message
``link``           the connection and its event-loop thread (``ConnectOptions``)
``batch``          what one atomic append is made of (messages, per-subject guards)
``stream``         the stream protocol: creation, atomic appends under per-subject
                   expectations, direct gets and leader reads
``grouped``        ``GroupedAppends``: concurrent appends of unrelated histories as
                   one atomic batch (``recorder.group_appends()``; on a one-replica
                   file stream each batch costs the server milliseconds)
``recorders``      the library's recorders and the subscription on a stream
``factory``        ``JetStreamFactory``: settings, streams, recorders
=================  ==============================================================
"""

from events.jetstream.errors import StoreUnavailableError
from events.jetstream.factory import JetStreamFactory
from events.jetstream.lastseen import Last
from events.jetstream.layout import (
    ID_TYPE_HEADER,
    MAX_BATCH_MESSAGES,
    MSG_ID_HEADER,
    SNAPSHOTS_KEPT,
    TOPIC_HEADER,
    TRACKING_HEADER,
    VERSION_HEADER,
    SequencedStoredEvent,
    notification_from_message,
    originator_of,
    originator_subject,
    tracking_subject,
)
from events.jetstream.link import ConnectOptions
from events.jetstream.recorders import (
    JetStreamAggregateRecorder,
    JetStreamApplicationRecorder,
    JetStreamProcessRecorder,
    JetStreamSubscription,
    JetStreamTrackingRecorder,
)

Factory = JetStreamFactory  # the library finds the one factory class of the module named by PERSISTENCE_MODULE
_Last = Last  # the name tests/test_jetstream_store.py imports

__all__ = [
    "TOPIC_HEADER",
    "VERSION_HEADER",
    "ID_TYPE_HEADER",
    "TRACKING_HEADER",
    "MSG_ID_HEADER",
    "MAX_BATCH_MESSAGES",
    "SNAPSHOTS_KEPT",
    "StoreUnavailableError",
    "SequencedStoredEvent",
    "ConnectOptions",
    "JetStreamFactory",
    "JetStreamAggregateRecorder",
    "JetStreamApplicationRecorder",
    "JetStreamTrackingRecorder",
    "JetStreamProcessRecorder",
    "JetStreamSubscription",
    "originator_subject",
    "originator_of",
    "tracking_subject",
    "notification_from_message",
]
