"""JetStream as nats-py's objects would give it, read without them, and its ordered consumer
as this project runs it (`events.natspy` says why this package exists):

- `ApiError`: the error of a JetStream API answer read as raw JSON.
- `ack_positions`: the stream sequence and the number pending, from the reply subject
  of a JetStream push delivery (`$JS.ACK...`), without building nats-py's metadata
  object per message (`ack_time`: its stream time).
- `ORDERED_IDLE_HEARTBEAT_S`: the idle heartbeat of every ordered consumer (nats-py
  re-creates one only after two missed heartbeats).
- `guard_recreation`: nats-py re-creates an ordered consumer on its own (missed heartbeats,
  a delivery out of order), from the stream sequence after the last one received, on
  whatever stream has the name then: one deleted and made again included. The caller
  gets to run that re-creation itself (a fold holds its messages, then checks which
  stream its consumer is now on).
- `NO_DROPS`: the subscription options of an ordered consumer whose every message counts
  (nats-py drops what its queue cannot take, silently to its reader); `reset_from`: the
  consumer made again from a sequence its reader chooses.
- `create_key_value`: nats-py's bucket, its stream made with a persist mode (`KeyValueConfig`
  has none, and a stream's mode cannot change once it is made).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Awaitable, Callable

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, PersistMode, StreamConfig
from nats.js.errors import BadRequestError

from events.nats_codes import ERR_STREAM_NAME_IN_USE

# nats-py re-creates an ordered consumer (from the message after the last one received) when
# two heartbeats in a row are missed, and tries again every two heartbeats until it works: a
# consumer lost with its server (a stream leader killed) comes back within 1 to 2 s of a new
# one being possible. An idle stream costs each ordered consumer two messages a second.
ORDERED_IDLE_HEARTBEAT_S = 0.5

# nats-py queues a push subscription's messages for its callback up to `pending_msgs_limit`
# (524,288) or `pending_bytes_limit` (256 MiB) and drops the rest, telling only the connection's
# error callback (SlowConsumerError). For an ordered consumer it has already counted a dropped
# message as delivered (its delivery and stream sequences move before the queue is tried), so it
# never re-creates the consumer for it: the reader just never gets it. Its flow-control replies
# do not wait for the callback either. A reader that holds its callback (the scheduler's fold while
# a checkpoint copies the projection, a process application's follower behind its thread) while
# enough traffic arrives lost messages for good (an audit reproduced it: a worker's dropped
# runtime change, a memory image placed where it cannot load). Zero is no limit, in nats-py: the
# queue grows while the reader is held and drains after.
NO_DROPS = {"pending_msgs_limit": 0, "pending_bytes_limit": 0}


def guard_recreation(psub: Any, guard: Callable[[Callable[[], Awaitable[None]]], Awaitable[None]]) -> None:
    """From now on, where nats-py would re-create the consumer of `psub` (an ordered push
    subscription), it runs `guard(recreate)` instead, in the task nats-py starts for it;
    `recreate()` is nats-py's own re-creation (one consumer request, from the sequence after
    the last message received, to the new deliver subject; a failure goes to the connection's
    error callback, and nats-py tries again after two more missed heartbeats). A guard may
    call it, or not (then no consumer is made this time), and may hold the caller's messages
    while it does (the new consumer's messages arrive once the request is answered).

    nats-py resets the subscription (a new deliver subject) before that task starts, and
    every reset starts one: a guard still running when the next reset comes may leave the
    next one undone (its `recreate()`, called later, uses the newest deliver subject)."""
    jsi = getattr(psub, "_sub", None) and psub._sub._jsi
    recreate = getattr(jsi, "recreate_consumer", None)
    if recreate is None or not getattr(jsi, "_ordered", False):
        raise RuntimeError(
            "nats-py's ordered consumer no longer re-creates itself through _JSI.recreate_consumer as "
            "events/natspy/jetstream.py expects: teach `guard_recreation` the new way"
        )

    async def guarded() -> None:
        await guard(recreate)

    jsi.recreate_consumer = guarded


async def reset_from(psub: Any, seq: int) -> None:
    """Have nats-py make the ordered consumer of `psub` again from stream sequence `seq` (not from
    the one after the last it received, as it does on its own): a new deliver subject at once
    (the old one's messages are dropped from then on), the consumer made in nats-py's background
    task, through `guard_recreation`'s guard if one is installed."""
    jsi = getattr(getattr(psub, "_sub", None), "_jsi", None)
    reset = getattr(jsi, "reset_ordered_consumer", None)
    if reset is None or not hasattr(jsi, "_sseq"):
        raise RuntimeError("nats-py's ordered consumer no longer resets through _JSI.reset_ordered_consumer as "
                           "events/natspy/jetstream.py expects: teach `reset_from` the new way")
    jsi._sseq = seq - 1  # what nats-py's own resets start after, until a message of the new consumer moves it
    await reset(seq)


def ack_positions(reply: str) -> tuple[int, int]:
    """(stream sequence, messages pending) from a JetStream delivery's reply subject.

    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<time>.<pending>`, or with a
    domain and an account hash after `ACK` (12 tokens)."""
    tokens = reply.split(".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[8])
    return int(tokens[7]), int(tokens[10])


def consumer_seq(reply: str) -> int:
    """The consumer sequence of a JetStream delivery (see `ack_positions`): one more for each message the
    consumer delivers, to whichever client, redeliveries included."""
    tokens = reply.split(".")
    return int(tokens[6] if len(tokens) == 9 else tokens[8])


def ack_time(reply: str | bytes) -> int:
    """The stream time (nanoseconds since the epoch) of a JetStream delivery, from its reply
    subject (see `ack_positions`); a direct handler's last argument spells it as bytes."""
    tokens = reply.split(b"." if isinstance(reply, bytes) else ".")
    return int(tokens[7] if len(tokens) == 9 else tokens[9])


class ApiError(msgspec.Struct):
    """The `error` of a JetStream API answer, for readers of the raw JSON (which skip the
    objects nats-py builds per answer)."""

    code: int = 0
    err_code: int = 0
    description: str = ""


class StoredMsg(msgspec.Struct):
    """The `message` of a `STREAM.MSG.GET` answer, as its raw readers read it: its stream sequence,
    and its header block (base64, as the server sends it; None: it has none)."""

    seq: int
    hdrs: str | None = None


class MsgGetAnswer(msgspec.Struct):
    """A `STREAM.MSG.GET` answer (one from the stream leader), for readers of the raw JSON."""

    message: StoredMsg | None = None
    error: ApiError | None = None


async def create_key_value(js: JetStreamContext, config: KeyValueConfig,
                          persist_mode: PersistMode | None = None) -> PersistMode:
    """nats-py's `js.create_key_value(config)`, the bucket's stream made with `persist_mode` (none: the
    server's default, each write synced as the server's `sync_interval` says); the mode the bucket has.

    nats-py makes the stream through `add_stream`, which is given it here with the mode set (what nats-py
    returns is not kept: its `KeyValue` would hold this call's context). A stream's mode cannot change
    once it is made: a bucket already made with another mode (by an earlier version) is taken as it is,
    and its mode returned; any other difference is nats-py's error, as before."""
    class WithMode:  # the context nats-py's code runs on: its stream made with the mode
        account_info = js.account_info

        def __init__(self, mode: PersistMode) -> None:  # the default as nats-py sends it: none (never stored)
            self.mode = None if mode == PersistMode.DEFAULT else mode

        async def add_stream(self, stream: StreamConfig) -> Any:
            return await js.add_stream(dataclasses.replace(stream, persist_mode=self.mode))

    wanted = PersistMode(persist_mode or PersistMode.DEFAULT)
    try:
        await JetStreamContext.create_key_value(WithMode(wanted), config)  # type: ignore[arg-type]
        return wanted
    except BadRequestError as error:
        if error.err_code != ERR_STREAM_NAME_IN_USE:
            raise
        info = await js.stream_info(f"KV_{config.bucket}")
        made = PersistMode(info.config.persist_mode or PersistMode.DEFAULT)
        if made == wanted:
            raise
        await JetStreamContext.create_key_value(WithMode(made), config)  # type: ignore[arg-type]
        return made
