"""Appends of unrelated histories, gathered while one is in flight, sent as one atomic batch.

nats-server stages every atomic batch of a one-replica file stream (the embedded default,
`warmboot up`) in a file store of its own, created and removed on disk for that batch:
three directories, three fsyncs (of those staging files, not the stream's own:
docs/operations.md, Durability) and about twenty other file operations whatever the batch
holds (measured with strace on nats-server 2.15). That is 2 to 7 ms of the server's CPU
per batch, against 0.07 ms for the same batch on a memory stream. A registry that appends
each worker's change (its events and the fence on its booking subject, CONTRACT placement
rule 8) as a batch of its own is bound by it: 93 first registrations/s at 256 in flight,
the server's CPU 7 ms each. A replicated stream stages batches in memory, so there this
only saves the batches' fixed cost.

A recorder uses it once told to (`recorder.group_appends()`, the registry's and the
snapshotter's, whose commands hold their entity's lock, so that their appends in flight at
once never touch one history): each call of `insert_events`/`insert_events_async` of more
than one event, with fences or none but no tracking record or expected sequences, becomes
`GroupedAppends.insert(events, fences=...)`; a single event stays a plain publish, which
costs the server less alone than any batch. One append is in flight at a time: a call that
finds none goes out with whatever was queued in the same step of the loop, and the calls
that come while it is in flight go out next, together, as one batch (at most
`max_messages` messages, no history written twice, none both written and fenced, a history
fenced by two only at one sequence, then by one fence). Commands on executor threads would
gain less: a batch can only hold what the threads have in flight (asyncio's default executor
has six on two cores); the registry's and the snapshotter's run on their service's loop.
The callers' locks are what keeps two appends of one history apart: the snapshotter's
tag commands, which write the tag's history beside their actor's, hold the tag's lock too.
Each caller gets the stream sequences of its own events. What a caller can rely on
does not change: its events are stored whole or not at all, each history only if no one
else appended to it since it was read, and never twice. A grouped batch the server refuses
as a whole for a reason that may be one member's (a history that moved on, a message id
already stored, a message too large, an id that cannot be a subject) is tried again member
by member, so each gets its own answer and no member pays for another's conflict: as a
first attempt when nothing of the batch can have been stored, as possibly stored already when
the refused batch was a resend of one whose reply was lost (a member's copy found in the log,
byte for byte its events, is then its own, not a conflict). An unavailable
store fails the group and every call queued behind it at once, as each would have failed
on its own: they are not made to wait one more time-out per group.

A caller cancelled before its events go out is left out of the batch (nothing written),
as a cancelled `insert_events_async` would be; once they are out, they may be stored.
`close()` (the service stopping) answers every caller still waiting UNAVAILABLE (`Store
UnavailableError`): what was in flight may have been stored, and a retry with the same
request id is answered from the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import suppress
from functools import partial
from typing import Any

from eventsourcing.persistence import DataError, IntegrityError, OperationalError, ProgrammingError, StoredEvent

from events.jetstream.errors import StoreUnavailableError
from events.tasks import cancel_and_wait

log = logging.getLogger("warmboot.events")

MAX_GROUP_MESSAGES = 256  # well under nats-server's 1,000 messages per batch

Insert = Callable[..., Awaitable[list[int]]]  # (events, *, fences=None, retried=False, late=None): one atomic append
# What a caller says of its append when it is about to go out: the error to fail it with instead (its
# request was held past its caller's wait meanwhile, queued behind the batch in flight), or None.
Late = Callable[[], "BaseException | None"]


class _Append:
    __slots__ = ("events", "fences", "originators", "result", "late")

    def __init__(self, events: list[StoredEvent], fences: Mapping[Any, int] | None,
                 result: asyncio.Future[list[int]], late: Late | None = None):
        self.events = events
        self.fences = dict(fences or {})  # originator id -> the last sequence its subject must still have
        self.originators = {event.originator_id for event in events}
        self.result = result
        self.late = late  # asked right before the append first goes out (`Late`)

    def too_late(self) -> bool:
        """Whether its caller says it is too late for it to go out; if so, it is failed so."""
        error = self.late() if self.late is not None else None
        if error is not None:
            _settle(self, error=error)
        return error is not None


class _Group:
    """The appends of one batch: no history written twice, none both written and fenced, one
    expectation per fenced history (two equal fences are one)."""

    def __init__(self) -> None:
        self.appends: list[_Append] = []
        self.written: set[Any] = set()
        self.fences: dict[Any, int] = {}
        self.messages = 0

    def admits(self, append: _Append, max_messages: int) -> bool:
        if not self.appends:
            return True  # the first goes, whatever its size
        if self.messages + len(append.events) > max_messages:
            return False
        if append.originators & self.written or append.originators & self.fences.keys():
            return False
        return all(fenced not in self.written and self.fences.get(fenced, seq) == seq
                   for fenced, seq in append.fences.items())

    def add(self, append: _Append) -> None:
        self.appends.append(append)
        self.written |= append.originators
        self.fences.update(append.fences)
        self.messages += len(append.events)


def _each_again(error: BaseException) -> bool:
    """Whether a grouped batch refused with `error` may have been refused for one member's sake."""
    if isinstance(error, StoreUnavailableError):
        return False  # the store, not a member: trying each again would wait that long again, each
    return isinstance(error, (IntegrityError, DataError, OperationalError, ProgrammingError))


def _copy(error: BaseException) -> BaseException:
    """One exception per caller (a shared one would gather every caller's traceback)."""
    try:
        copy = type(error)(*error.args)
    except Exception:
        return error
    copy.__cause__ = error.__cause__
    return copy


class GroupedAppends:
    """`insert` gathers concurrent appends of unrelated histories into one atomic batch.

    `on_group(n)` is called with the number of appends of each batch sent (a refused
    grouped batch included, and each of its members tried again alone)."""

    def __init__(self, insert: Insert, *, max_messages: int = MAX_GROUP_MESSAGES,
                 on_group: Callable[[int], None] | None = None):
        self._insert = insert
        self.max_messages = max_messages
        self._on_group = on_group
        self._pending: deque[_Append] = deque()
        self._sender: asyncio.Task[None] | None = None
        self._closed = False

    async def insert(self, events: Sequence[StoredEvent], *, fences: Mapping[Any, int] | None = None,
                     late: Late | None = None) -> list[int]:
        """Append `events` (histories no other call in flight appends to), only if each history
        `fences` names still ends at its sequence; their stream sequences. `late`, asked right before
        they first go out (queued behind the batch in flight, they go out later than they were
        decided): an error, and they do not go out but fail with it."""
        if self._closed:
            raise StoreUnavailableError("the store's appends are closed (the service is stopping)")
        if not events:
            return []
        append = _Append(list(events), fences, asyncio.get_running_loop().create_future(), late)
        self._pending.append(append)
        if self._sender is None:
            self._sender = asyncio.create_task(self._send(), name="grouped-appends")
        return await append.result  # a cancelled caller cancels its future: left out if not yet sent

    async def close(self) -> None:
        """No more appends; the callers still waiting are answered UNAVAILABLE (what was in flight
        may have been stored)."""
        self._closed = True
        await cancel_and_wait(self._sender)
        self._sender = None
        self._fail_pending(_stopping())

    async def _send(self) -> None:
        group = _Group()
        try:
            while self._pending:
                group = self._take()
                if group.appends:
                    await self._append(group)
                group = _Group()
        except BaseException as error:  # close(), or a failure of the sender's own: nobody is left waiting
            stopping = isinstance(error, asyncio.CancelledError)
            if not stopping:
                log.error("grouped appends: the sender failed; its callers get the error", exc_info=True)
            for append in group.appends:
                _settle(append, error=_stopping() if stopping else _copy(error))
            self._fail_pending(_stopping() if stopping else error)
            if stopping:
                raise
        finally:
            self._sender = None

    def _fail_pending(self, error: BaseException) -> None:
        while self._pending:
            _settle(self._pending.popleft(), error=_copy(error))

    def _group_sent(self, size: int) -> None:
        if self._on_group is not None:
            with suppress(Exception):  # a metric: never the appends' failure
                self._on_group(size)

    def _take(self) -> _Group:
        """The next group: pending appends in order, as long as each fits (`_Group.admits`)."""
        group = _Group()
        while self._pending:
            append = self._pending[0]
            if append.result.done() or append.too_late():  # its caller was cancelled, or its wait is over
                self._pending.popleft()
                continue
            if not group.admits(append, self.max_messages):
                break
            group.add(self._pending.popleft())
        return group

    async def _append(self, batch: _Group) -> None:
        group = batch.appends
        self._group_sent(len(group))
        if len(group) == 1:
            await self._alone(group[0])
            return
        try:
            seqs = await self._insert([event for append in group for event in append.events],
                                      fences=batch.fences or None, late=partial(_member_late, group))
        except Exception as error:
            if isinstance(error, _MemberLate):
                # A member's caller has gone meanwhile, and the batch was not sent again (`Stream.append`):
                # each alone, the late one not sent (as a first attempt if nothing of the batch can have
                # been stored, else looked for where it may have landed).
                again = [append for append in group if not append.result.done()]
                for _ in again:
                    self._group_sent(1)
                retried = bool(getattr(error, "maybe_stored", False))
                await asyncio.gather(*(self._alone(append, retried=retried) for append in again))
                return
            if not _each_again(error):
                for append in group:
                    _settle(append, error=_copy(error))
                if isinstance(error, StoreUnavailableError):  # those queued meanwhile would only wait as long
                    self._fail_pending(error)
                return
            log.debug("a grouped append of %d histories was refused (%r); each is tried alone", len(group), error)
            again = [append for append in group if not append.result.done()]  # not for a caller gone
            for _ in again:
                self._group_sent(1)
            # As possibly stored only if the batch may have been (it went out and its answer was lost,
            # `Stream.append`'s `maybe_stored`): a member's copy found in the log is then its own. One
            # refused before it was sent, or by the server each time, stored nothing: each is checked
            # as a first attempt, its versions verified (a rival's copy of them is a conflict).
            maybe_stored = bool(getattr(error, "maybe_stored", False))
            await asyncio.gather(*(self._alone(append, retried=maybe_stored) for append in again))
            return
        start = 0
        for append in group:
            end = start + len(append.events)
            _settle(append, seqs[start:end])
            start = end

    async def _alone(self, append: _Append, retried: bool = False) -> None:
        if not retried and append.too_late():  # tried alone after a refused batch: a first attempt again
            return
        try:
            seqs = await self._insert(append.events, fences=append.fences or None, retried=retried, late=append.late)
        except Exception as error:
            _settle(append, error=error)
        else:
            _settle(append, seqs)


class _MemberLate(Exception):
    """A grouped batch not sent again: one of its members' callers has gone (`_member_late`)."""

    as_is = True  # raised by `Stream.append` as it is, also when an earlier attempt may have been stored


def _member_late(group: list[_Append]) -> BaseException | None:
    """Asked before each attempt of a grouped batch (`Stream.append`'s `late`): whether one of its
    members is too late to go out now (its request held past its caller's wait)."""
    for append in group:
        if append.late is not None and append.late() is not None:
            return _MemberLate()
    return None


def _stopping() -> StoreUnavailableError:
    return StoreUnavailableError("the store's appends were interrupted (the service is stopping); an append "
                                 "that had gone out may have been stored: ask again with the same request id")


def _settle(append: _Append, seqs: list[int] | None = None, *, error: BaseException | None = None) -> None:
    if append.result.done():  # the caller gave up meanwhile
        return
    if error is not None:
        append.result.set_exception(error)
    else:
        append.result.set_result(seqs or [])
