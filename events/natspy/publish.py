"""Publishing on a connection, and requests answered over one inbox (`events.natspy` says why this
package exists):

- `flush_in_order`: a flush whose PONG says the server has every command sent before
  it. nats-py's `flush` writes its PING straight to the socket, ahead of the commands
  its flusher task has not written yet (the SUB of a subscription just made): a
  service that flushed after subscribing could still answer "no responders" to a
  request sent right after its start.
- `publish`: nats-py's `publish`, with the same refusals, writing into the same buffer,
  for a header block encoded once (`header_block`, by nats-py's rules): nats-py builds and
  checks the block, and formats the command, for every message (4 to 5 µs with headers
  and a reply against 2, measured). The services answer requests with it, and the registry
  puts heartbeats and acknowledges the sweeper's deliveries with it.
- `Replies`: many requests in flight over one wildcard inbox, each answered into a
  future. nats-py's `request` arms a timer (`wait_for`) and draws a NUID per call,
  and `publish_async` a timer per call on its semaphore; at thousands of requests a
  second that is a good part of what a request costs. Here one task checks deadlines,
  and the replies are delivered directly (`deliver_core`).
"""

from __future__ import annotations

import asyncio
import itertools
import re
from contextlib import suppress
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from events.natspy.frames import DirectDelivery, subscribe_core
from events.tasks import cancel_and_wait

NATS_PENDING = "_flush_pending"  # the private coroutine that has nats-py's flusher task write what it holds


async def flush_in_order(nc: Any, timeout: float = 10.0) -> None:
    """`nc.flush()` once every command nats-py holds is written: then the PONG says the server
    has them all (nats-py's flush writes its PING ahead of the commands its flusher task
    has not written yet, such as the SUB of a subscription just made)."""
    write_pending = getattr(nc, NATS_PENDING, None)
    if not callable(write_pending):
        raise RuntimeError(
            f"nats-py no longer has Client.{NATS_PENDING}: events/natspy/publish.py must be taught how to have its "
            "pending commands written before a flush"
        )
    await write_pending(force_flush=True)
    await nc.flush(timeout)


_UNSAFE_SUBJECT = re.compile(r"[ \t\r\n]")  # nats-py's publish refuses these: they would split or end the command line


async def publish(nc: Any, subject: str, payload: bytes, reply: str = "", headers: bytes = b"") -> None:
    """`nc.publish(subject, payload, reply, headers)`, with the header block encoded once by
    `header_block`: the same refusals (`BadSubjectError` for an empty subject or one, or a
    reply, with white space, which would add a protocol command; a closed or draining
    connection; a payload past the server's limit; a full buffer while reconnecting), the
    same command in nats-py's buffer, its flusher woken the same way (and waited for when
    the buffer is full). It saves what nats-py does per message: the header block built and
    checked, the command formatted and encoded twice, a coroutine more. The services send
    three messages per heartbeat this way (its put, the sweeper's ack, the answer). Unlike
    nats-py's, its limit is on the header block and the payload together, as the server's is."""
    if not subject or _UNSAFE_SUBJECT.search(subject) or (reply and _UNSAFE_SUBJECT.search(reply)):
        raise nats.errors.BadSubjectError
    if nc.is_closed:
        raise nats.errors.ConnectionClosedError
    if nc.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError
    size = len(payload)
    try:
        # the server's limit is on the header block and the payload together (a message past it
        # gets the connection cut: nats-py's own publish checks the payload alone)
        if size + len(headers) > nc._max_payload:
            raise nats.errors.MaxPayloadError
        limit = nc._max_pending_size
        if not nc.is_connected and (limit <= 0 or size + nc._pending_data_size > limit):
            raise nats.errors.OutboundBufferLimitError
        target = b"%s %s" % (subject.encode(), reply.encode()) if reply else subject.encode()
        if headers:
            command = b"HPUB %s %d %d\r\n%s%s\r\n" % (target, len(headers), len(headers) + size, headers, payload)
        else:
            command = b"PUB %s %d\r\n%s\r\n" % (target, size, payload)
        nc.stats["out_msgs"] += 1
        nc.stats["out_bytes"] += size
        nc._pending.append(command)
        nc._pending_data_size += len(command)
        if limit > 0 and nc._pending_data_size > limit:
            await nc._flush_pending(force_flush=True)
        elif nc._flush_queue is not None and nc._flush_queue.empty():
            await nc._flush_pending()
    except AttributeError as error:
        raise RuntimeError(f"nats-py no longer keeps its outgoing buffer as events/natspy/publish.py's `publish` "
                           f"writes into it ({error}): teach `publish` the new one") from None


class Replies:
    """Requests over one wildcard inbox (`<inbox>.<n>`), their replies matched by token.

    `request` returns the reply message, or raises nats-py's own errors:
    `NoRespondersError` (a 503 status: nobody listens on the subject) and
    `TimeoutError` (no reply within `timeout`, checked every `timeout / 4` at most).
    A caller cancelled while it waits cancels its reply's future (nothing is left to
    retrieve). Before `start` and after `stop` it raises `ConnectionClosedError`: no
    reply could arrive, nor expire.
    """

    def __init__(self, nc: Client, timeout: float = 5.0):
        self.nc = nc
        self.timeout = timeout
        self._pending: dict[str, tuple[asyncio.Future[Msg], float]] = {}
        self._tokens = itertools.count(1)
        self._inbox = ""
        self._sub: Any = None
        self._direct: DirectDelivery | None = None
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> "Replies":
        self._inbox = self.nc.new_inbox() + "."
        self._sub, self._direct = await subscribe_core(self.nc, self._inbox + "*", self._reply)
        self._watch = asyncio.create_task(self._expire(), name="replies-deadlines")
        return self

    async def stop(self) -> None:
        sub, self._sub = self._sub, None  # first: no request is sent from here on
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        if self._watch is not None:
            await cancel_and_wait(self._watch)
            self._watch = None
        if sub is not None:
            with suppress(Exception):
                await sub.unsubscribe()
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(nats.errors.ConnectionClosedError())
                future.exception()
        self._pending.clear()

    async def request(self, subject: str, payload: bytes, headers: bytes = b"") -> Msg:
        if self._sub is None:
            raise nats.errors.ConnectionClosedError()
        token = str(next(self._tokens))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Msg] = loop.create_future()
        self._pending[token] = (future, loop.time() + self.timeout)  # until answered or expired
        try:
            await publish(self.nc, subject, payload, self._inbox + token, headers)
        except BaseException:
            self._pending.pop(token, None)
            raise
        return await future  # its outcome retrieved here, or the future cancelled with the caller

    def _reply(self, msg: Msg) -> None:
        entry = self._pending.pop(msg.subject[len(self._inbox):], None)
        if entry is None or entry[0].done():
            return  # too late: its request timed out
        if not msg.data and msg.headers and msg.headers.get("Status") == "503":
            entry[0].set_exception(nats.errors.NoRespondersError())
        else:
            entry[0].set_result(msg)

    async def _expire(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(0.25, self.timeout / 4))
            moment = loop.time()
            late = [token for token, (_, deadline) in self._pending.items() if deadline < moment]
            for token in late:
                future = self._pending.pop(token)[0]
                if not future.done():
                    future.set_exception(nats.errors.TimeoutError())
