"""request_id idempotency's long memory: the first answer to each request id, kept in the reply
bucket (`ReplyCache`), and the answers of requests that wrote nothing (`NoWriteAnswers`).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Awaitable, TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import NotFoundError

from events.codec import encode
from events.errors import ContractError, unavailable
from events.nats_codes import ERR_NO_MESSAGE_FOUND
from events.natspy.connections import describe_error
from events.schema import Base
from events.subjects import bucket_name
from services import deadline
from services.process import stream_replicas
from services.streams import until_answered

T = TypeVar("T")


class ReplyCache:
    """The first answer to each `request_id`, shared by every replica (JetStream KV).

    It is the long memory of idempotency only: services answer a repeated request
    from the entity's history first (every event carries the `request_id` that caused
    it), and look here only for what the history they keep no longer holds (the
    scheduler keeps an actor's last few placements). An entry is written before the
    write that makes the kept history forget it (the scheduler's: before the placement
    that pushes an older one out of the actor's recent ones), so a crash between the
    two loses nothing: at worst the entry is there and the placement is not, and the
    entry only says what the log already holds.
    """

    def __init__(self, nc: NATS, prefix: str, ttl_s: float = 3600.0):
        self.nc = nc
        self.bucket = bucket_name(prefix, "replies")
        self.ttl_s = ttl_s
        self.kv = None

    async def start(self) -> "ReplyCache":
        js = self.nc.jetstream()
        config = KeyValueConfig(bucket=self.bucket, ttl=self.ttl_s, storage=StorageType.FILE, history=1,
                                replicas=stream_replicas())
        self.kv = await until_answered(lambda: js.create_key_value(config), f"the bucket {self.bucket}")
        return self

    @staticmethod
    def key(scope: str, request_id: str) -> str:
        return f"{scope}.{hashlib.sha256(request_id.encode()).hexdigest()[:40]}"

    async def get(self, key: str) -> bytes | None:
        """The entry under `key`, as the bucket's stream leader has it: an entry is read where
        its absence would be decided on (a retry placed or decided again), and a direct get
        may be answered by a replica that has not caught up with a put a moment ago."""
        if self.kv is None:
            raise unavailable("the reply cache is not open")
        try:
            msg = await self.nc.jetstream().get_msg(f"KV_{self.bucket}", subject=f"$KV.{self.bucket}.{key}")
        except NotFoundError as error:
            if getattr(error, "err_code", None) == ERR_NO_MESSAGE_FOUND:
                return None
            # no bucket (deleted, being made again): nothing says the request was not answered
            raise unavailable(f"the reply cache cannot be read ({describe_error(error)}); try again") from None
        if msg.headers and msg.headers.get("KV-Operation") in ("DEL", "PURGE"):
            return None
        return msg.data or None

    async def put(self, key: str, data: bytes) -> None:
        """Store `data` under `key`; returns once the bucket has it, else raises UNAVAILABLE."""
        if self.kv is None:
            raise unavailable("the reply cache is not open")
        try:
            await self.kv.put(key, data)
        except Exception as error:
            raise unavailable(f"the reply cache did not take an entry ({type(error).__name__}: {error}); "
                              "try again") from None


class Kept(msgspec.Struct, frozen=True):
    """The answer of a request that wrote nothing, as `NoWriteAnswers` keeps it: the verb, the
    version of the entity's history it stood on, the reply's JSON, and the incarnation of the
    event stream that history is in (its creation time, `stream_identity`; None in an entry an
    earlier version kept, which an older replica, ignoring the field, still reads)."""

    verb: str
    version: int
    reply: msgspec.Raw
    stream: str | None = None


def _cache_failed(error: Exception) -> ContractError:
    return unavailable(f"the reply cache did not answer ({type(error).__name__}: {error}); try again")


class NoWriteAnswers:
    """The first answers of requests that wrote nothing: a registration that changed nothing
    (UNCHANGED), a drain of a drained worker, an update to the template an actor has.

    A repeated request is answered from the entity's history, where its events name it
    (`WireAggregate.prior`); one that wrote nothing left no event to answer from, so its
    retry, or a copy a stalled replica decides late, would be decided again on whatever
    the entity is by then (a registration's stale copy undoing a later runtime change).
    So its answer is kept in the reply bucket, under the entity and the request id, before
    it is given, and looked up, as the stream leader has it, before a request with an id
    the history does not answer is decided: after the entity was read, so a change the
    entity shows came after the kept answer was there to be read. It is honoured within
    the entity's current life only (`Kept.version`), and for the verb it was kept for
    (another verb reusing the id is refused, as `WireAggregate.prior` refuses one). The bucket
    outlives an event stream deleted and made again, whose versions start over: an answer, or a
    refusal's mark, kept on another incarnation of the stream (`created`, the stream's creation
    time) says nothing of this one and is not read (an audit, 2026-12-04: an UNCHANGED kept on the
    old stream answered a registration with the same id on the new one, whose worker the log then
    held on another runtime than it runs). A command
    on the service's loop (`run_command_async`) awaits `recall_async` and `keep_async`; one on
    a thread of its own (`run_command`) calls `recall` and `keep`, which wait for the service's
    loop to run those: either way the reads and writes are on the service's connection.
    """

    def __init__(self, replies: ReplyCache, scope: str, loop: asyncio.AbstractEventLoop, created: str,
                 timeout: float = 5.0):
        self.replies = replies
        self.scope = scope  # e.g. "registry": the service whose entities these are
        self.loop = loop
        self.created = created  # the incarnation of the event stream the service reads (`stream_identity`)
        self.timeout = timeout
        self._refused = b"refused " + created.encode()

    def _key(self, entity_id: str, request_id: str) -> str:
        return self.replies.key(f"{self.scope}.{entity_id}", request_id)

    def _run(self, coroutine: Awaitable[T]) -> T:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:  # it would wait for itself
            coroutine.close()  # type: ignore[attr-defined]
            raise RuntimeError("NoWriteAnswers is called from a command's thread (run_command), not from its loop")
        try:
            return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(self.timeout + 1.0)  # its own first
        except ContractError:
            raise
        except Exception as error:
            raise _cache_failed(error) from None

    async def _answered(self, coroutine: Awaitable[T]) -> T:
        """A read or write of the reply cache, on the service's loop: UNAVAILABLE if it fails."""
        try:
            return await asyncio.wait_for(coroutine, self.timeout)
        except ContractError:
            raise
        except Exception as error:
            raise _cache_failed(error) from None

    def recall(self, aggregate: Any, verb: str, request_id: str | None, reply_type: type[T]) -> tuple[T, int] | None:
        """`recall_async`, from a command's thread (which waits for the loop only to read)."""
        if self._nothing_kept(aggregate, verb, request_id):
            return None
        return self._run(self.recall_async(aggregate, verb, request_id, reply_type))

    def keep(self, aggregate: Any, verb: str, request_id: str | None, reply: Base) -> None:
        """`keep_async`, from a command's thread (which waits for the loop only to write)."""
        if request_id is not None:
            self._run(self.keep_async(aggregate, verb, request_id, reply))

    @staticmethod
    def _nothing_kept(aggregate: Any, verb: str, request_id: str | None) -> bool:
        # no history has answered anything, and a new life is answered by none
        return request_id is None or not aggregate.version or aggregate.request_starts_life(verb)

    async def recall_async(self, aggregate: Any, verb: str, request_id: str | None,
                           reply_type: type[T]) -> tuple[T, int] | None:
        """The kept answer (reply, version) of an earlier `verb` request with `request_id` in the
        aggregate's current life, if any (none when this request starts a new one);
        FAILED_PRECONDITION if one was kept for another verb."""
        if self._nothing_kept(aggregate, verb, request_id):
            return None
        kept = self._of_this_stream(await self._answered(self.replies.get(self._key(aggregate.entity_id, request_id))))
        if kept is None:
            return None
        if kept.version < aggregate.life_start:  # an earlier life's (request ids are scoped to one)
            aggregate.refuse_from_an_earlier_life(verb, request_id)
            return None
        if kept.version > aggregate.version:
            return None
        if kept.verb != verb:
            raise aggregate.reused(request_id, f"a {kept.verb} that changed nothing")
        try:
            return msgspec.json.decode(kept.reply, type=reply_type), kept.version
        except msgspec.DecodeError as error:  # a ValidationError is one: a newer version's answer
            raise unavailable(f"the answer kept for request_id {request_id!r} on {aggregate.KIND} "
                              f"{aggregate.entity_id!r} is not one this version reads ({error}): a newer "
                              "version may read it") from None

    async def was_answered_async(self, aggregate: Any, request_id: str) -> bool:
        """Whether `request_id` was answered for the aggregate, in any life, with an answer kept here or a
        refusal marked (`mark_refused_async`), as the stream leader has them."""
        if self._of_this_stream(await self._answered(self.replies.get(self._key(aggregate.entity_id, request_id)))):
            return True
        return await self.refusal_marked_async(aggregate, request_id)

    async def refusal_marked_async(self, aggregate: Any, request_id: str) -> bool:
        """Whether `request_id` is marked refused for the aggregate (`mark_refused_async`) on this
        incarnation of the stream, as the stream leader has it."""
        mark = await self._answered(self.replies.get(self._refused_key(aggregate.entity_id, request_id)))
        return mark in (self._refused, b"refused")  # the latter: marked by an earlier version, on no stream named

    async def mark_refused_async(self, aggregate: Any, request_id: str) -> None:
        """Mark `request_id` refused for the aggregate (a refusal writes no event: this says it was sent)."""
        await self._answered(self.replies.put(self._refused_key(aggregate.entity_id, request_id), self._refused))

    def _of_this_stream(self, data: bytes | None) -> Kept | None:
        """The kept answer `data` holds, if it is of the stream's incarnation the service reads (or
        of none named: kept by an earlier version); None otherwise, or for no entry."""
        if not data:
            return None
        try:
            kept = msgspec.json.decode(data, type=Kept)
        except msgspec.DecodeError:
            return None
        return kept if kept.stream in (None, self.created) else None

    def _refused_key(self, entity_id: str, request_id: str) -> str:
        return self.replies.key(f"{self.scope}-refused.{entity_id}", request_id)

    async def keep_async(self, aggregate: Any, verb: str, request_id: str | None, reply: Base) -> None:
        """Keep the answer of a request that wrote nothing, before it is given (UNAVAILABLE if the
        bucket does not take it: the request wrote nothing, so its retry is safe)."""
        if request_id is None:
            return
        deadline.check("its answer, kept for a retry,")
        data = encode(Kept(verb=verb, version=aggregate.version, reply=msgspec.Raw(encode(reply)), stream=self.created))
        await self._answered(self.replies.put(self._key(aggregate.entity_id, request_id), data))
