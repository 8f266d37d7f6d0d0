"""Heartbeats in a JetStream KV bucket with per-message TTLs; expiry markers swept once.

Heartbeats are not events. Each one is a put of the worker's key in the bucket
`<PREFIX>_HEARTBEATS` with a per-message TTL (the registry's `ttl_s`, whole seconds).
When a key outlives its TTL the server itself removes it and writes a "MaxAge"
marker in its place; the replicas share one durable consumer on the bucket, pinned to
one of them at a time, so each marker reaches one replica, which removes the worker as
`LOST` (and a crash before that leaves the marker to the next replica pinned, which
reconciles first). Replicas do not poll or scan per worker; two that do handle the
same marker write one event between them, as the aggregate decides on fresh state (and
reads the key after it loads the worker: `RegistryStore.lose`).

A beat returns once the server has stored the put (its ack), so the `ttl_s` a
heartbeat answers counts from a put that is in the bucket. Puts are pipelined:
`Acks` publishes each with a reply subject under one wildcard inbox
(`events.natspy.publish.Replies`) and matches the acks as they come back, so any number are
in flight and each costs one publish and one small ack decode (nats-py's `publish`
is a request with its own timer and a JSON parse into a dataclass).

The sweeper's consumer delivers every message of the bucket, each heartbeat's put
among them (the server writes a marker on the key's own subject, so no filter tells
the two apart). `Sweeper` reads it with one pull request of many messages at a time
into a callback, acknowledges them all at once now and then, never past a marker it has
not handled, and hands markers to `MARKER_LANES` tasks that remove their workers
(nats-py's `fetch` costs a task and a timer per message, and its time-outs can swallow
a cancellation).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import time
from contextlib import suppress
from typing import Awaitable, Callable, Mapping

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig, PersistMode, StorageType
from nats.js.errors import NotFoundError

from events.aggregate import now
from events.codec import encode
from events.errors import ContractError, unavailable
from events.nats_codes import ERR_NO_MESSAGE_FOUND, ERR_WRONG_LAST_SEQUENCE
from events.natspy.frames import DirectDelivery, subscribe_core
from events.natspy.headers import header_block, parse_header_block
from events.natspy.jetstream import ApiError, MsgGetAnswer, ack_positions, consumer_seq, create_key_value
from events.natspy.publish import Replies, publish
from events.schema import ErrorCode
from events.subjects import bucket_name
from events.tasks import cancel_and_wait
from services.endpoints import OutageLog, is_outage
from services.registry.ackfloor import AckFloor
from services.streams import until_answered

log = logging.getLogger("warmboot.registry")

# How long the server keeps an expiry marker: the registry may be down this long
# and still remove every worker that went silent meanwhile (reconciliation, at start and
# every RECONCILE_INTERVAL_S, covers longer outages). Part of the bucket's configuration,
# so not tied to ttl_s.
MARKER_TTL_S = 300.0
# How often each registry replica reconciles while it runs (`RegistryService.reconcile`): well
# within a marker's life, so one whose removal kept failing (the event log unavailable) is handled,
# or its worker's clock started again, before the server deletes it.
RECONCILE_INTERVAL_S = MARKER_TTL_S / 3
SWEEPER = "registry-sweeper"
MARKER_REASON = "Nats-Marker-Reason"
EXPIRED = "MaxAge"  # the reason of the marker the server writes where a key outlived its TTL
ACK_TIMEOUT_S = 5.0
# How long a stopping replica waits for the server to unpin it (`Sweeper.stop`): a courtesy (another replica is
# pinned at once, not a pin time-out later) that a server frozen or gone never answers, and which waited out
# ACK_TIMEOUT_S of the process's stop (its bound: docs/operations.md, "Stopping").
UNPIN_TIMEOUT_S = 1.0
ACK_WAIT_S = 30.0  # the sweep's consumer delivers again what was not acknowledged within this
# The sweep's priority group: the server pins it to one replica, and pins another once that one has
# not pulled for PIN_TIMEOUT_S (it died) or unpinned itself (it stopped). A replica's pulls last
# PULL_EXPIRES_S and follow each other at once, so a live one keeps the pin.
PIN_GROUP = "sweep"
PIN_TIMEOUT_S = 15.0
PIN_ID = "Nats-Pin-Id"
RETRY_S = 1.0  # a marker whose removal failed is tried again this much later (held all the while)
PULL_BATCH = 1024  # messages one pull request of the sweeper asks for
PULL_EXPIRES_S = 5.0  # how long the server holds a pull request that is not filled
# Expiry markers handled at once: a rack's workers lost together are removed together, their
# writes sharing atomic appends (events.jetstream.grouped), not one after the other.
MARKER_LANES = 32


class _PubAck(msgspec.Struct):
    seq: int = 0
    error: ApiError | None = None


_ack_decoder = msgspec.json.Decoder(_PubAck)
_msg_get_decoder = msgspec.json.Decoder(MsgGetAnswer)


def key_state(headers: Mapping[str, str]) -> str:
    """What a heartbeat key's last entry says, from its headers: `expired` (the server's marker),
    `absent` (a removal's tombstone, another marker) or `beating`."""
    reason = headers.get(MARKER_REASON)
    if reason == EXPIRED:
        return "expired"
    if reason is not None or "KV-Operation" in headers:
        return "absent"
    return "beating"


class Acks:
    """JetStream publishes whose acks come back on one wildcard inbox (`Replies`): many in flight.

    `publish` returns the stream sequence the server stored the message at, or raises
    UNAVAILABLE (no stream listens, the server refused it, no ack within `timeout`).
    """

    def __init__(self, nc: NATS, timeout: float = ACK_TIMEOUT_S):
        self.replies = Replies(nc, timeout)

    async def start(self) -> None:
        await self.replies.start()

    async def stop(self) -> None:
        await self.replies.stop()

    async def publish(self, subject: str, payload: bytes, headers: bytes) -> int:
        try:
            msg = await self.replies.request(subject, payload, headers)
        except nats.errors.NoRespondersError:
            raise unavailable("no JetStream stream stored the heartbeat (no responders)") from None
        except nats.errors.TimeoutError:
            raise unavailable(f"the heartbeat bucket did not answer within {self.replies.timeout:g}s") from None
        try:
            reply = _ack_decoder.decode(msg.data)
        except msgspec.DecodeError:
            raise unavailable(f"the heartbeat bucket answered {msg.data[:200]!r}") from None
        if reply.error is not None:
            raise unavailable(f"the heartbeat bucket refused the put: {reply.error.description}")
        return reply.seq


class Sweeper:
    """A durable pull consumer shared by the replicas, pinned to one of them, read into a callback.

    The consumer has one priority group (`PIN_GROUP`, policy `pinned_client`): the server delivers to
    one replica at a time, the one it pinned, and holds the others' pull requests until that replica
    stops pulling for `PIN_TIMEOUT_S` (it died, or it stopped and unpinned itself). So the sweep can
    acknowledge all at once (`AckPolicy.ALL`): one ack now and then, of the highest delivery below
    the lowest marker not yet handled (`services.registry.ackfloor.AckFloor`), instead of one ack per
    heartbeat put (0.87x the server's CPU per put, 0.92x the registry's; docs/scaling.md).

    One pull request of `PULL_BATCH` messages is outstanding at a time; when it is filled, or the
    server ends it (408: expired; 423: another replica is pinned now; 409, 404), the next one goes out.
    Deliveries come from the connection's read loop (`events.natspy.frames.subscribe_core`); a marker
    is queued for `on_marker(worker_id)` (`MARKER_LANES` of them at once: the removals of workers lost
    together share their appends), and tried again `RETRY_S` later, held all the while, if that failed.

    A replica newly pinned (a delivery with a pin id it did not have) first runs `on_pinned()`, the
    registry's reconciliation, and acknowledges nothing before it returns: a marker delivered to the
    replica pinned before (which died holding it, or whose later acks went past it) is still the
    last entry of its worker's key, and the reconciliation removes that worker. A replica that dies
    leaves its unacknowledged deliveries to the next one pinned (the consumer's ack wait) and its
    markers to that one's reconciliation; one that stops hands back at once the markers it has not
    handled (nak) and unpins itself, so that another replica is pinned and removes those workers within
    their TTL, not a pin time-out later. A delivery that never reached the pinned replica (lost with its
    connection, the pin kept across the reconnect) shows as a gap in the consumer sequences it reads, and
    is taken as a pin taken anew: reconciled before the next ack, which would acknowledge a marker among
    them unhandled. (A consumer leader that changes forgets the pin: the next delivery pins anew.)
    """

    def __init__(self, nc: NATS, stream: str, config: dict,
                 on_marker: Callable[[str], Awaitable[None]],
                 on_pinned: Callable[[], Awaitable[None]] | None = None):
        self.nc = nc
        self.stream = stream
        self.config = config
        self.name = config["durable_name"]
        self.on_marker = on_marker
        self.on_pinned = on_pinned
        self._next = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{self.name}"
        self._inbox = ""
        self._sub = None
        self._direct: DirectDelivery | None = None
        self._floor = AckFloor()
        self._acking: asyncio.Task[None] | None = None
        self._credit = 0
        self._ended: asyncio.Event | None = None
        self._status = ""  # how the server ended the last pull request
        self._stopping = False
        self._pin = ""  # the pin id the server gave this replica, "" while it holds none
        self._delivery = 0  # the consumer sequence of the last delivery this replica read (0: none yet)
        # Reconciliations asked for since start (at each pin taken, and at deliveries missed): acks wait
        # until `_reconciled`, those whose `on_pinned` has returned, is `_asked`
        self._asked = 0
        self._reconciled = 0
        self._reconciling: asyncio.Task[None] | None = None
        self._markers: asyncio.Queue[Msg] = asyncio.Queue()  # the markers `_floor` holds, to be handled
        self._outages = OutageLog(log, f"could not remove lost workers; each is tried again {RETRY_S:g}s later")
        self._retries: dict[int, asyncio.TimerHandle] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def _api(self, call: str, body: dict | None = None, timeout: float = ACK_TIMEOUT_S) -> dict:
        msg = await self.nc.request(f"$JS.API.{call}", json.dumps(body).encode() if body is not None else b"",
                                    timeout=timeout)
        answer = json.loads(msg.data)
        if "error" in answer:
            nats.js.errors.APIError.from_error(answer["error"])  # raises the error's own class
        return answer

    async def ensure_consumer(self) -> bool:
        """The shared durable consumer, made if it is not there; True if it was not (deleted by hand, or
        lost with its group on a cluster: found by an audit, no replica made it again, and no silent
        worker was found LOST until one restarted), or was the sweep of an earlier version (explicit
        acks, no pin: the server cannot change those, so it is deleted and made anew; the replicas of
        that version, whose pulls name no group, sweep no more)."""
        try:
            info = await self._api(f"CONSUMER.INFO.{self.stream}.{self.name}")
        except NotFoundError:
            await self._create()
            return True
        config = info.get("config", {})
        if config.get("ack_policy") == "all" and config.get("priority_policy") == "pinned_client":
            return False
        log.warning("the heartbeat sweep's consumer %s acknowledges each put (an earlier version's): made anew, "
                    "pinned to one replica and acknowledged all at once", self.name)
        with suppress(NotFoundError):
            await self._api(f"CONSUMER.DELETE.{self.stream}.{self.name}")
        await self._create()
        return True

    async def _create(self) -> None:
        await self._api(f"CONSUMER.CREATE.{self.stream}.{self.name}", {"stream_name": self.stream, "config": self.config})

    async def start(self) -> None:
        await until_answered(self.ensure_consumer, f"the consumer {self.name}")
        self._inbox = self.nc.new_inbox()
        self._ended = asyncio.Event()
        self._sub, self._direct = await subscribe_core(self.nc, self._inbox, self._delivered)
        self._tasks = [asyncio.create_task(self._pull(), name=f"{self.stream}-sweep-pull"),
                       *(asyncio.create_task(self._handle_markers(), name=f"{self.stream}-sweep-{lane}")
                         for lane in range(MARKER_LANES))]

    async def stop(self) -> None:
        self._stopping = True  # also ends a loop whose cancellation a time-out swallowed
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        if self._sub is not None:  # first: no more deliveries (the server drops a pull nobody hears)
            with suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        for handle in self._retries.values():
            handle.cancel()
        self._retries.clear()
        await cancel_and_wait(*self._tasks, *([self._reconciling] if self._reconciling else []))
        self._tasks = []
        if self._acking is not None:  # the acks of what was handled (else delivered again, and acked, elsewhere)
            with suppress(Exception):
                await self._acking
        held = self._floor.held_replies()
        for reply in held:  # to the next replica pinned (if one was removed here already, it finds it removed)
            with suppress(Exception):
                await publish(self.nc, reply, b"-NAK")
        if self._pin:  # another replica is pinned at the next delivery, not a pin time-out from now
            with suppress(Exception):
                await self._api(f"CONSUMER.UNPIN.{self.stream}.{self.name}", {"group": PIN_GROUP}, UNPIN_TIMEOUT_S)
            self._pin = ""
        if held:
            log.info("heartbeat sweep stopped: %d expiry markers handed back to the other replicas", len(held))

    def _request(self) -> bytes:
        request = {"batch": PULL_BATCH, "expires": int(PULL_EXPIRES_S * 1e9), "group": PIN_GROUP}
        if self._pin:
            request["id"] = self._pin
        return json.dumps(request).encode()

    async def _pull(self) -> None:
        backoff = 0.1
        while not self._stopping:
            self._ended.clear()
            self._credit, self._status = PULL_BATCH, ""
            try:
                await self.nc.publish(self._next, self._request(), reply=self._inbox)
                # Filled, expired (408), ended otherwise by the server, or lost (a reconnect).
                with suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._ended.wait(), PULL_EXPIRES_S + 1.0)
            except Exception as error:  # disconnected
                self._status = repr(error)
            if self._status in ("", "408", "423"):  # 423: another replica is pinned; this one waits its turn
                backoff = 0.1
                continue
            # No consumer or stream (503, 409, 404: deleted, a leader change): not in a tight loop.
            log.debug("heartbeat sweep: the pull ended with %s; asking again in %.1fs", self._status, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _delivered(self, msg: Msg) -> None:
        headers = msg.headers
        if not msg.reply:  # a status: 100 (a heartbeat) keeps the request; 404, 408, 409, 423, 503 end it
            status = headers.get("Status", "") if headers else ""
            if status != "100":
                if status == "423":  # the server pinned another replica
                    self._pin = ""
                self._status = status or "an empty message"
                self._ended.set()
            return
        self._credit -= 1
        if self._credit <= 0:
            self._ended.set()
        delivery, last = consumer_seq(msg.reply), self._delivery
        self._delivery = delivery
        pin = headers.get(PIN_ID) if headers else None
        if pin and pin != self._pin:
            self._pin = pin
            self._reconcile_first()
        elif last and delivery != last + 1:
            self._missed(last, delivery)
        if headers:
            if headers.get(MARKER_REASON) == EXPIRED:
                if self._floor.hold(msg.reply) is not None:  # (None: delivered again while held here)
                    self._markers.put_nowait(msg)
                return
        self._floor.delivered(msg.reply)
        self._kick()  # one task acks for all that one read of the socket brought

    def _missed(self, last: int, delivery: int) -> None:
        """A delivery of the consumer's that never reached this replica, pinned all the while: lost with
        its connection (a reconnect within the pin's time-out keeps the pin; found by an audit). It may
        have been a marker, which the next ack would acknowledge unhandled, the worker then found only by
        the next periodic round: reconciled first, as at a pin taken. (Any other jump of the sequence,
        which nats-server is not known to make while the pin holds, is taken the same way.)"""
        log.warning("heartbeat sweep: deliveries %d to %d of its consumer never reached this replica (lost "
                    "with its connection); reconciling before acknowledging past them", last + 1, delivery - 1)
        self._reconcile_first()

    def _reconcile_first(self) -> None:
        """`on_pinned` (the registry's reconciliation) before the next ack: whatever this replica did not
        read of the consumer's deliveries is found by it in the bucket."""
        self._asked += 1
        if self.on_pinned is None:
            self._reconciled = self._asked
        elif self._reconciling is None:
            self._reconciling = asyncio.create_task(self._reconcile(), name=f"{self.stream}-sweep-reconcile")

    async def _reconcile(self) -> None:
        """`on_pinned` once for each reconciliation asked for while it ran; then the acks that waited for it."""
        try:
            while self._reconciled < self._asked:
                asked = self._asked
                try:
                    await self.on_pinned()
                except asyncio.CancelledError:
                    raise
                except Exception:  # logged; the periodic reconciliation finds what this one missed
                    log.exception("reconciling heartbeats on taking the sweep failed")
                self._reconciled = asked
        finally:
            self._reconciling = None
        self._kick()

    def _kick(self) -> None:
        if self._acking is None and not self._stopping:
            self._acking = asyncio.create_task(self._ack(), name=f"{self.stream}-sweep-acks")

    async def _ack(self) -> None:
        try:
            while self._reconciled == self._asked:
                reply = self._floor.target()
                if reply is None:
                    break
                with suppress(Exception):
                    await publish(self.nc, reply, b"+ACK")
        finally:
            self._acking = None

    def _again(self, seq: int, msg: Msg) -> None:
        self._retries.pop(seq, None)
        if not self._stopping and self._floor.holds(seq):
            self._markers.put_nowait(msg)

    async def _handle_markers(self) -> None:
        """One of `MARKER_LANES`: takes the next marker, removes its worker, releases it to the acks."""
        while not self._stopping:  # also ends when on_marker swallowed the cancellation of stop()
            msg = await self._markers.get()
            seq = ack_positions(msg.reply)[0]
            worker_id = msg.subject.rsplit(".", 1)[-1]
            try:
                await self.on_marker(worker_id)
            except asyncio.CancelledError:
                raise  # `stop` hands it back
            except Exception as error:
                if is_outage(error) or (isinstance(error, ContractError) and error.code is ErrorCode.UNAVAILABLE):
                    # the log or the bus not answering, during a fault: a line per OUTAGE_LOG_S, with a
                    # count (a soak's logs held a traceback for each, then a line for each: one per lost
                    # worker and second of the outage); anything else, a bug, keeps its traceback
                    self._outages.seen(error)
                else:
                    log.warning("could not remove lost worker %s; trying again in %gs", worker_id, RETRY_S,
                                exc_info=True)
                self._retries[seq] = asyncio.get_running_loop().call_later(RETRY_S, self._again, seq, msg)
                continue
            self._floor.release(seq)
            self._kick()


class Hearing:
    """How long a replica has heard the workers' heartbeats without a break: since its start, or since its
    connection to NATS last came back (the server restarted, or the connection was lost), whichever is
    later. While NATS or every registry replica is down, no beat reaches the bucket, whatever the workers
    send: their keys run out all the same, and the server writes their expiry markers then, or at its
    restart. A marker handled before the replica has heard for a whole TTL says nothing of its worker
    (`RegistryService._expired` gives it a new clock instead of removing it as LOST: docs/contract.md).
    A restart of `warmboot up` longer than the TTL removed every worker as LOST, released every actor
    they ran and undid their drains, though no worker had stopped (a trial of the client, 2026-12-07).
    The break is read off nats-py's count of reconnects, which it counts before it resubscribes, so
    before any marker of the new connection is delivered."""

    def __init__(self, nc: NATS, clock: Callable[[], float] = time.monotonic):
        self._nc = nc
        self._clock = clock
        self._reconnects = 0
        self._since: float | None = None  # none before `begin`: nothing heard yet

    def _count(self) -> int:
        return int(getattr(self._nc, "stats", {}).get("reconnects", 0))

    def begin(self) -> None:
        """The replica hears beats from now on (its heartbeat endpoint is served)."""
        self._reconnects, self._since = self._count(), self._clock()

    def heard_for(self) -> float:
        """Seconds since `begin`, or since the connection came back after it; 0 before it."""
        if self._since is None:
            return 0.0
        count = self._count()
        if count != self._reconnects:
            self._reconnects, self._since = count, self._clock()
        return self._clock() - self._since


def persist_mode(replicas: int) -> PersistMode:
    """The heartbeat bucket's persist mode: unsynced puts (`async`), which nats-server allows one-replica
    streams only, for a put synced costs a sync per heartbeat where the server syncs every write
    (docs/operations.md, Durability); a replicated bucket, the server's default."""
    return PersistMode.ASYNC if replicas == 1 else PersistMode.DEFAULT


async def remake_synced_bucket(nc: NATS, prefix: str) -> bool:
    """Delete the heartbeat bucket of `prefix` if an earlier version made it synced (the server's default
    persist mode) on one replica; True if it did. Only for a caller that knows no registry replica runs on
    it (`warmboot up`, which holds its store's lock and starts the only one after): the registry makes it
    anew, unsynced (`persist_mode`), and its start's reconciliation starts each registered worker's
    clock again, so none is removed for it (a worker silent since is removed LOST within its TTL)."""
    js = nc.jetstream()
    stream = f"KV_{bucket_name(prefix, 'heartbeats')}"
    try:
        config = (await js.stream_info(stream)).config
    except NotFoundError:
        return False
    if PersistMode(config.persist_mode or PersistMode.DEFAULT) == persist_mode(config.num_replicas or 1):
        return False
    await js.delete_stream(stream)
    return True


class Liveness:
    """Heartbeats in a JetStream KV bucket with per-message TTLs; expiry markers swept once.

    `on_expired(worker_id)` is awaited for each worker whose last heartbeat the
    server expired; at most one replica gets each marker. `on_pinned()` is awaited when the
    sweep is pinned to this replica (the registry reconciles: `Sweeper`).
    """

    def __init__(
        self,
        nc: NATS,
        prefix: str,
        ttl_s: float,
        on_expired: Callable[[str], Awaitable[None]],
        replicas: int = 1,
        on_pinned: Callable[[], Awaitable[None]] | None = None,
    ):
        self.nc = nc
        self.js = nc.jetstream()
        self.bucket = bucket_name(prefix, "heartbeats")
        self.stream = f"KV_{self.bucket}"
        self._msg_get = f"$JS.API.STREAM.MSG.GET.{self.stream}"  # `entry`'s request
        self.ttl_s = ttl_s
        self.on_expired = on_expired
        self.replicas = replicas
        # The server counts TTLs in whole seconds; round up so a worker never expires early.
        self.ttl_header = {"Nats-TTL": f"{max(1, math.ceil(ttl_s))}s"}
        self._ttl_block = header_block(self.ttl_header)  # what each beat sends, encoded once
        self.acks = Acks(nc)
        self.sweeper = Sweeper(nc, self.stream, {
            "durable_name": SWEEPER,
            "description": "registry replicas share it, pinned to one at a time: each expiry marker reaches one",
            "filter_subject": f"$KV.{self.bucket}.>",
            "deliver_policy": "new",
            "ack_policy": "all",
            "ack_wait": int(ACK_WAIT_S * 1e9),
            "headers_only": True,
            "max_ack_pending": -1,
            "priority_groups": [PIN_GROUP],
            "priority_policy": "pinned_client",
            "priority_timeout": int(PIN_TIMEOUT_S * 1e9),
        }, on_expired, on_pinned)

    def subject(self, worker_id: str) -> str:
        return f"$KV.{self.bucket}.{worker_id}"

    def bucket_config(self) -> KeyValueConfig:
        return KeyValueConfig(
            bucket=self.bucket,
            description="warmboot worker heartbeats: one key per worker, expiring after the registry's TTL",
            history=1,
            storage=StorageType.FILE,
            limit_marker_ttl=MARKER_TTL_S,
            replicas=self.replicas,
        )

    async def start(self) -> None:
        config, wanted = self.bucket_config(), persist_mode(self.replicas)
        mode = await until_answered(lambda: create_key_value(self.js, config, wanted), f"the bucket {self.bucket}")
        if mode != wanted:
            log.warning("the bucket %s was made with persist mode %s (by an earlier version): where the "
                        "server syncs every write (`sync_interval: always`), each heartbeat waits for its sync; to "
                        "make it anew, stop every registry replica, delete the bucket (`nats kv del %s`) and start "
                        "them again (docs/operations.md, Durability)", self.bucket, mode.value, self.bucket)
        await self.acks.start()
        await self.sweeper.start()

    async def stop(self) -> None:
        await self.sweeper.stop()
        await self.acks.stop()

    async def beat(self, worker_id: str) -> None:
        """Put the worker's heartbeat; returns once the server has stored it."""
        value = encode({"at": now(), "ttl_s": self.ttl_s})
        await self.acks.publish(self.subject(worker_id), value, self._ttl_block)

    async def last_entry(self, worker_id: str) -> int:
        """The bucket's sequence of the worker's last heartbeat entry, 0 if it has none."""
        return (await self.entry(worker_id))[1]

    async def forget(self, worker_id: str, last_entry: int) -> bool:
        """Drop a removed worker's heartbeat, leaving a tombstone that expires by itself, only if
        `last_entry` (read before the removal was written) is still the key's last entry; False
        when something was put since. That put is a heartbeat that raced the removal, or the
        beat of a registration of the worker's next life through another replica: a tombstone
        over it would leave the new life with no clock (an expiring tombstone leaves no marker),
        never found LOST. Left in place, it expires within the TTL and is swept: a removed worker
        is found removed (nothing written), a new life that has not beaten since is LOST."""
        try:
            await self.js.publish(
                self.subject(worker_id),
                b"",
                headers={"KV-Operation": "PURGE", "Nats-Rollup": "sub", "Nats-TTL": f"{int(MARKER_TTL_S)}s",
                         "Nats-Expected-Last-Subject-Sequence": str(last_entry)},
            )
        except nats.js.errors.APIError as error:
            if error.err_code == ERR_WRONG_LAST_SEQUENCE:
                return False
            raise
        return True

    async def state(self, worker_id: str) -> str:
        """`beating`, `expired` (the server's marker is the last entry) or `absent`."""
        return (await self.entry(worker_id))[0]

    async def entry(self, worker_id: str) -> tuple[str, int]:
        """`state`, and the bucket's sequence of the key's last entry (0: none), as the stream leader
        has it (`STREAM.MSG.GET`). Asked through the beats' inbox (`Acks`' `Replies`), the answer read
        raw: a round of reconciliation asks it of every registered worker, and nats-py's `get_msg`
        (a request with its own inbox and timer, the answer built into objects) cost about 90 µs of
        the registry's CPU each (docs/scaling.md). Failures are nats-py's: `TimeoutError`,
        `NoRespondersError`, or the API error's own class (`APIError.from_error`)."""
        request = msgspec.json.encode({"last_by_subj": self.subject(worker_id)})
        msg = await self.acks.replies.request(self._msg_get, request)
        answer = _msg_get_decoder.decode(msg.data)
        if answer.error is not None:
            if answer.error.err_code == ERR_NO_MESSAGE_FOUND:
                return "absent", 0
            nats.js.errors.APIError.from_error(msgspec.structs.asdict(answer.error))  # raises its own class
        stored = answer.message
        if stored is None:
            raise nats.js.errors.APIError(description=f"the heartbeat bucket answered {msg.data[:200]!r}")
        return key_state(parse_header_block(base64.b64decode(stored.hdrs)) if stored.hdrs else {}), stored.seq

    async def start_clock(self, worker_id: str, after: int = 0) -> None:
        """A heartbeat on behalf of a worker that has none, unless one arrives first: only if the
        key's last entry is still `after` (0: none; a tombstone's sequence: its removal's purge,
        which a put must follow, or the clock of a worker registered anew past it never starts)."""
        headers = {**self.ttl_header, "Nats-Expected-Last-Subject-Sequence": str(after)}
        try:
            await self.js.publish(self.subject(worker_id), encode({"at": now(), "ttl_s": self.ttl_s}), headers=headers)
        except nats.js.errors.APIError as error:
            if error.err_code != ERR_WRONG_LAST_SEQUENCE:  # (a beat came first: its clock runs)
                raise
        # Any other failure is the caller's: a put lost in an election left the worker with no clock, for
        # good, when it was swallowed here (found by an audit).
