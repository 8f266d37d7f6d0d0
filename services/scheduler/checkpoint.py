"""Projection checkpoints: when to save, where, and how a new replica starts from one.

A checkpoint is a cache of the fold, never a source of truth: the projection at one
stream sequence, encoded by `services.scheduler.checkpoint_codec`, stored as an
object of the JetStream object store `<PREFIX>_CHECKPOINTS`. A new replica loads the
newest checkpoint it can use and replays only the tail of the log after it; if none
is usable (none yet, corrupt, an unknown format, another version of the fold's code,
another incarnation of the stream) it says why in a warning and replays the whole log,
which gives the same projection, only slower.

When: every `every_events` events folded (once the fold has caught up with the
stream: a replica replaying a long log saves when it is done, not on the way), or
every `interval_s` seconds if anything was folded since the last one. Before saving,
a replica looks at the store: if another replica saved one recently (within half
the interval in events) it does not save its own.

Consistency: a checkpoint is exactly the projection at its recorded sequence. The
fold applies messages on the event loop, one callback at a time; a save starts
between two of them and copies the projection into Structs in a worker thread while
the fold is paused (`Fold.paused`): its next callback waits until the copy is done.
Requests keep being answered from the projection meanwhile: they only read it.
Encoding, compressing and uploading run after the fold has resumed.

Names: `projection-<seq, 20 digits>-<stream incarnation>-<replica token>`: names sort
by sequence; a replica looks only at checkpoints of the stream as it is now (the
incarnation is a digest of the stream's creation time, so one left over from a
deleted stream is never taken for a recent one); two replicas saving at the same
sequence never write the same object. After each save the `keep` newest of the
current incarnation are kept and every other checkpoint is deleted.

Incarnation: a checkpoint is labelled (its name and its envelope) with the incarnation
the projection is a fold of (`Projection.stream_created`: from the checkpoint it was
restored from, or from the stream as the fold started from sequence 1), never with the
stream as it is when saving. A replica whose stream was deleted and made again while it
ran still holds a projection of the old log: its save is refused (an error logged,
nothing saved, nothing deleted) and its fold gives up (`Fold.give_up`: the scheduler
stops), so the new incarnation's checkpoints are neither replaced nor pruned by it.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import time
import uuid
from contextlib import nullcontext, suppress
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.api import ObjectMeta, ObjectStoreConfig, StorageType
from nats.js.errors import BadRequestError, NotFoundError, ObjectNotFoundError

from events.natspy.connections import describe_error
from events.subjects import bucket_name, stream_name
from events.tasks import cancel_and_wait
from services.process import stream_replicas
from services.scheduler.checkpoint_codec import (
    CheckpointRejected,
    decode_checkpoint,
    encode_checkpoint,
    export_state,
)
from services.scheduler.projection import Projection
from services.streams import continuity, leaders_stream_info, replaced_by, stream_identity, until_answered

log = logging.getLogger("warmboot.scheduler.checkpoint")

DEFAULT_EVERY_EVENTS = 50_000
DEFAULT_INTERVAL_S = 60.0
KEEP = 2  # newest checkpoints kept; the older one is the fallback if the newest cannot be read
CAUGHT_UP = 1_000  # the count trigger waits until at most this many messages are left to fold
LOAD_TIMEOUT_S = 60.0  # reading one checkpoint object, and how long each question of a load is asked again
CLOSE_WAIT_S = 10.0  # a save in progress at stop() may finish within this
NAME_PREFIX = "projection-"


def incarnation_of(stream_created: str) -> str:
    """A short name for one incarnation of the stream (a stream deleted and made again,
    or restored from a backup, is another one: its sequences start over)."""
    return hashlib.blake2b(stream_created.encode(), digest_size=4).hexdigest()


def object_name(seq: int, incarnation: str, token: str) -> str:
    return f"{NAME_PREFIX}{seq:020d}-{incarnation}-{token}"


def parse_name(name: str) -> tuple[int, str] | None:
    """(sequence, stream incarnation) of a checkpoint's object name; None for any other name."""
    if not name.startswith(NAME_PREFIX):
        return None
    digits, _, rest = name[len(NAME_PREFIX):].partition("-")
    incarnation = rest.partition("-")[0]
    return (int(digits), incarnation) if digits.isdigit() and incarnation else None


class Checkpoints:
    """Saves a scheduler's projection now and then; gives a new replica the newest one."""

    def __init__(
        self,
        nc: NATS,
        prefix: str,
        *,
        every_events: int = DEFAULT_EVERY_EVENTS,
        interval_s: float = DEFAULT_INTERVAL_S,
        keep: int = KEEP,
        replicas: int | None = None,
        compress: bool = True,
    ):
        if every_events < 1:
            raise ValueError("every_events must be at least 1")
        self.nc = nc
        self.prefix = prefix
        self.stream = stream_name(prefix)
        self.bucket = bucket_name(prefix, "checkpoints")
        self.every_events = every_events
        self.interval_s = interval_s
        self.keep = max(1, keep)
        self.replicas = replicas or stream_replicas()
        self.compress = compress
        self.token = uuid.uuid4().hex[:8]
        self.store: Any = None
        # Set while a save copies the projection: the fold waits for it (see `hold`).
        self._fold: Any = None  # the fold followed: paused while a save copies its projection
        # What was restored at start: the fold replayed only what came after.
        self.restored_seq = 0
        self.restored_events = 0
        # The last save (or restore): the triggers count from here.
        self.saved_seq = 0
        self.saved_events = 0
        self.saved_at = time.monotonic()
        self.stored_seq = 0  # the newest checkpoint this replica has finished storing
        self.saves = 0
        self.skipped = 0  # saves left to another replica's recent checkpoint
        self.last_capture_s = 0.0  # how long the fold waited during the last save
        self.last_size = 0
        self.load_timings: dict[str, float] = {}  # of the checkpoint restored: read_s, decode_s, bytes
        self._due = asyncio.Event()
        self._closing = False  # ends the saver's loop also when a time-out swallowed close()'s cancellation
        self._task: asyncio.Task[None] | None = None
        self._saving: asyncio.Task[str | None] | None = None
        self._saved = asyncio.Condition()
        self._capture = asyncio.Lock()  # one capture at a time: each gates the fold on its own

    # --- the store ---

    async def open(self) -> "Checkpoints":
        """Create (or bind) the bucket, asked again while JetStream cannot answer (`until_answered`:
        a replica started during an election). A failure is a warning, never fatal: the replica then
        replays the log, and the saver tries to open the bucket again at its next save."""
        try:
            await until_answered(self._open, f"the checkpoint bucket {self.bucket}", LOAD_TIMEOUT_S)
        except Exception as error:
            log.warning("checkpoint bucket %s unavailable (%s: %s); replaying the whole log",
                        self.bucket, type(error).__name__, error)
        return self

    async def _open(self) -> None:
        js = self.nc.jetstream()
        config = ObjectStoreConfig(
            description="warmboot scheduler projection checkpoints (derived from the log)",
            storage=StorageType.FILE, replicas=self.replicas,
        )
        try:
            self.store = await js.create_object_store(self.bucket, config=config)
        except BadRequestError:  # it exists with another configuration (e.g. replicas): use it as it is
            self.store = await js.object_store(self.bucket)

    async def list(self) -> list[tuple[int, str, str]]:
        """(sequence, stream incarnation, name) of the stored checkpoints, newest first."""
        try:
            infos = await self.store.list(ignore_deletes=True)
        except NotFoundError:
            return []
        found = [(*parsed, info.name) for info in infos if (parsed := parse_name(info.name)) is not None]
        return sorted(found, reverse=True)

    async def _read(self, name: str) -> bytes:
        buffer = io.BytesIO()  # nats-py appends chunks to bytes otherwise: quadratic on large objects
        await self.store.get(name, writeinto=buffer)
        return buffer.getvalue()

    async def _stream_identity(self) -> tuple[str, int]:
        """The stream's creation and last sequence, as its leader has them: a member behind (after a
        failover) would refuse a checkpoint past its own end, and the replica replay the whole log (a
        soak's finding)."""
        return stream_identity(await leaders_stream_info(self.nc.jetstream(), self.stream))

    async def _replaced(self, projection: Projection, at: tuple[int, int] | None = None) -> str | None:
        """Why the stream, as it is now, is not the log `projection` is a fold of (it was made again
        since; with `at`, the (sequence, stored at in µs) of the message a capture of it reached, or
        restored from a copy or rolled back since: `continuity`); None if it is. If not, an error is
        logged, and the fold followed gives up when `projection` is its own."""
        created, _ = await self._stream_identity()
        why = replaced_by(self.stream, projection.stream_created, created)
        if why is None and at is not None:
            why = await continuity(self.nc, self.stream, *at)
        if why is not None:
            log.error("checkpoint not saved: %s", why)
            fold = self._fold
            if fold is not None and fold.projection is projection:
                fold.give_up(why)
        return why

    # --- loading ---

    async def load(self) -> Projection | None:
        """The projection of the newest usable checkpoint, or None (then replay the whole log).

        Each question to the server (the stream's identity, the list, the object, the message at its
        sequence) is asked again while JetStream cannot answer it (`until_answered`, up to
        LOAD_TIMEOUT_S each): a replica started while the stream elects a leader, as one started in
        an incident is, loads its checkpoint instead of replaying the whole log."""
        if self.store is None:
            return None
        try:
            created, last_seq = await until_answered(self._stream_identity, f"the stream {self.stream}",
                                                     LOAD_TIMEOUT_S)
            stored = await until_answered(self.list, f"the checkpoint bucket {self.bucket}", LOAD_TIMEOUT_S)
        except Exception as error:
            log.warning("listing checkpoints failed (%s: %s); replaying the whole log", type(error).__name__, error)
            return None
        incarnation = incarnation_of(created)
        for seq, written_for, name in stored:
            if written_for != incarnation:
                log.warning("checkpoint %s ignored: it was written for another incarnation of stream %s", name,
                            self.stream)
                continue
            t0 = time.perf_counter()
            try:
                data = await asyncio.wait_for(until_answered(lambda: self._read(name), f"the checkpoint {name}",
                                                             LOAD_TIMEOUT_S), LOAD_TIMEOUT_S)
            except Exception as error:
                log.warning("checkpoint %s ignored: it could not be read (%s: %s)", name, type(error).__name__, error)
                continue
            t1 = time.perf_counter()
            try:
                envelope, projection = await asyncio.to_thread(decode_checkpoint, data)
                if envelope.stream != self.stream or envelope.stream_created != created:
                    raise CheckpointRejected(
                        f"it belongs to stream {envelope.stream} created {envelope.stream_created or '?'}, "
                        f"not to {self.stream} created {created or '?'}"
                    )
                if envelope.seq > last_seq:
                    raise CheckpointRejected(f"it covers sequence {envelope.seq}, the stream ends at {last_seq}")
                try:
                    rolled = await until_answered(
                        lambda: continuity(self.nc, self.stream, envelope.seq, envelope.seq_time // 1000),
                        f"the stream {self.stream}", LOAD_TIMEOUT_S)
                except Exception as error:  # what is at its sequence is not known: replay instead
                    raise CheckpointRejected(f"whether the message at sequence {envelope.seq} is the one it "
                                             f"folded could not be asked ({describe_error(error)})") from None
                if rolled is not None:
                    raise CheckpointRejected(rolled)
            except CheckpointRejected as why:
                log.warning("checkpoint %s ignored: %s", name, why)
                continue
            self.load_timings = {"read_s": t1 - t0, "decode_s": time.perf_counter() - t1, "bytes": len(data)}
            self.restored_seq = self.saved_seq = projection.seq
            self.restored_events = self.saved_events = projection.events
            self.saved_at = time.monotonic()
            log.info("restored the projection from checkpoint %s: %d events up to sequence %d (%d bytes)",
                     name, projection.events, projection.seq, len(data))
            return projection
        return None

    # --- saving ---

    def folded(self, events: int, behind: int) -> None:
        """After each message folded: wake the saver when enough events have come in."""
        if events - self.saved_events >= self.every_events and behind <= CAUGHT_UP:
            self._due.set()

    async def save(self, projection: Projection) -> str | None:
        """Capture `projection` now and store it, labelled with the incarnation of the stream it is a
        fold of; the object's name. None if the stream is not the log the capture is of (`_replaced`):
        then nothing is saved, and nothing deleted."""
        if self.store is None:
            await self._open()
        folded = projection.stream_created
        fold = self._fold
        async with self._capture, (fold.paused() if fold is not None else nullcontext()):
            t0 = time.perf_counter()
            state = await asyncio.to_thread(export_state, projection)
            self.last_capture_s = time.perf_counter() - t0
            seq_time = int(projection.seq_time) if projection.seq_time else 0  # of the message at state.seq
        if await self._replaced(projection, (state.seq, seq_time // 1000)) is not None:
            return None
        self.saved_seq, self.saved_events, self.saved_at = state.seq, state.events, time.monotonic()
        data = await asyncio.to_thread(
            encode_checkpoint, state, stream=self.stream, stream_created=folded, seq_time=seq_time,
            compress=self.compress
        )
        seq, events = state.seq, state.events
        del state  # the copy can be large: keep only its bytes through the upload
        incarnation = incarnation_of(folded)
        name = object_name(seq, incarnation, self.token)
        meta = ObjectMeta(name=name, description=f"projection at sequence {seq}")
        try:
            await self.store.put(name, data, meta=meta)
        except NotFoundError:  # the bucket deleted since it was opened (always safe: docs/operations.md)
            await self._open()  # made again
            await self.store.put(name, data, meta=meta)
        self.saves += 1
        self.last_size = len(data)
        log.info("saved checkpoint %s (%d events, %d bytes; the fold waited %.3f s)",
                 name, events, len(data), self.last_capture_s)
        async with self._saved:
            self.stored_seq = max(self.stored_seq, seq)
            self._saved.notify_all()
        try:
            # Asked again: a stream made again during the upload must not lose its checkpoints to this
            # one (which is labelled with the old incarnation, and ignored by every load).
            if await self._replaced(projection) is None:
                await self._prune(incarnation)
        except Exception as error:  # the next save prunes again
            log.warning("deleting old checkpoints failed (%s: %s)", type(error).__name__, error)
        return name

    async def _prune(self, incarnation: str) -> None:
        """Keep the `keep` newest of this incarnation of the stream; delete the rest."""
        kept = 0
        for _, written_for, name in await self.list():
            if written_for == incarnation and kept < self.keep:
                kept += 1
                continue
            with suppress(ObjectNotFoundError, NotFoundError):  # another replica pruned it first
                await self.store.delete(name)

    async def wait_saved(self, seq: int, timeout: float) -> None:
        """Return once this replica has stored a checkpoint covering `seq`."""
        async with self._saved:
            await asyncio.wait_for(self._saved.wait_for(lambda: self.stored_seq >= seq), timeout)

    def _busy(self) -> bool:
        return self._saving is not None and not self._saving.done()

    # --- the saver ---

    def follow(self, fold: Any) -> None:
        """Save `fold.projection` on the triggers from now on; the fold holds for captures."""
        self._fold = fold
        fold.listeners.append(lambda seq: self.folded(fold.projection.events, fold.behind))
        self._task = asyncio.create_task(self._run(fold), name="scheduler-checkpoints")
        self.folded(fold.projection.events, fold.behind)  # a long replay at start: save it right away

    async def _run(self, fold: Any) -> None:
        # The loop checks `_closing`, not only its cancellation: on Python 3.11 a request's
        # time-out (`asyncio.wait_for`) that completes as the task is cancelled can swallow the
        # cancellation, and the loop would then wait on `_due` for ever (a stop that hung).
        while not self._closing:
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._due.wait(), self.interval_s if self.interval_s > 0 else None)
            self._due.clear()
            if self._closing or fold.stale is not None:  # a fold given up has nothing more to save
                return
            projection = fold.projection
            fresh = projection.events - self.saved_events
            if fresh <= 0:
                continue
            by_count = fresh >= self.every_events
            by_time = self.interval_s > 0 and time.monotonic() - self.saved_at >= self.interval_s
            if not (by_count or by_time):
                continue
            try:
                if self.store is None:
                    await self._open()
                # Another replica's checkpoint may make this one pointless: on the count
                # trigger, one within half the interval; on the time trigger, one as new.
                slack = self.every_events // 2 if by_count else 0
                if await self._replaced(projection) is not None:  # the fold gave up: no more saves
                    continue
                incarnation = incarnation_of(projection.stream_created)
                newest = max((seq for seq, written_for, _ in await self.list() if written_for == incarnation), default=0)
                if newest >= projection.seq - slack:
                    self.skipped += 1
                    self.saved_seq, self.saved_events, self.saved_at = newest, projection.events, time.monotonic()
                    continue
                if self._closing:  # closed meanwhile: no new save
                    return
                self._saving = asyncio.create_task(self.save(projection))
                await asyncio.shield(self._saving)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the store is unavailable: try again at the next trigger
                self.saved_events, self.saved_at = projection.events, time.monotonic()
                log.warning("saving a checkpoint failed (%s: %s); trying again later", type(error).__name__, error)

    async def close(self) -> None:
        self._closing = True
        self._due.set()  # a saver waiting for its next trigger ends now
        task, self._task = self._task, None
        if self._busy():  # let a save in progress finish, rather than leave chunks without their object
            with suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._saving), CLOSE_WAIT_S)
        await cancel_and_wait(task, self._saving)
