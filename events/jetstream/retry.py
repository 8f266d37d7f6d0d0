"""How the store waits: one loop for transient failures, one for a replica that is behind.

- `Retry.run(attempt)` calls `attempt(timeout)` until it answers, within the time budget
  of one operation (``WARMBOOT_STORE_TIMEOUT``): a retryable failure (`errors.retryable`)
  waits, doubling the pause, and tries again; past the budget it is
  `StoreUnavailableError`; any other failure is `errors.library_error`. An attempt that
  changed its plan (an append that found new expectations) raises `Again`: tried again
  at once. When nobody answers for a stream, or the server says it is not found, the
  stream is asked whether it exists (and made again if it may be): when nobody answers,
  in the background (mostly a leader election, during which nobody answers that either).
  A pause ends early when the stream elects a leader: the next attempt can be answered.
- `catch_up(must_see, from_replica, from_leader)`: on a replicated stream a direct get
  may be answered by a replica behind this process's own writes; such a read is asked
  again a few times, then made through the stream leader.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import nats.errors

from events.jetstream import errors
from events.jetstream.layout import sequence_of

if TYPE_CHECKING:
    from events.jetstream.stream import Stream

log = logging.getLogger("warmboot.jetstream")

REQUEST_TIMEOUT = 5.0  # the longest one attempt waits for its answer
CATCH_UP_ATTEMPTS = 6  # reads answered by a replica behind this process's own writes, asked again
CATCH_UP_DELAY = 0.005  # doubling: about 0.3 s in all before reading through the stream leader

T = TypeVar("T")
M = TypeVar("M")


class Again(Exception):
    """Raised by an attempt that changed its plan: try again at once, without waiting."""


class Retry:
    """The time budget of one operation: per-attempt timeouts, and doubling sleeps between attempts."""

    def __init__(self, what: str, budget: float, stream: "Stream | None" = None, also: Collection[int] = ()):
        self.what = what
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + budget
        self.budget = budget
        self.delay = 0.05
        self.stream = stream
        self.asked = False  # whether the stream was asked if it exists because nobody answered
        self.check: asyncio.Future[None] | None = None  # that question, until its answer is seen
        self.also = also  # err_codes also worth waiting out (creating a stream: no peers yet)

    @property
    def timeout(self) -> float:
        """How long the next attempt may wait for an answer."""
        return max(0.05, min(REQUEST_TIMEOUT, self.deadline - self.loop.time()))

    async def run(self, attempt: Callable[[float], Awaitable[T]]) -> T:
        while True:
            try:
                return await attempt(self.timeout)
            except Again:
                continue
            except Exception as error:
                missing = isinstance(error, errors.ServerError) and error.stream_missing and self.stream is not None
                if not (missing or errors.retryable(error, self.also)):
                    translated = errors.library_error(self.what, error)
                    if translated is error:
                        raise
                    raise translated from None
                await self.wait(error)

    async def wait(self, error: BaseException) -> None:
        if self.stream is not None:
            if isinstance(error, errors.ServerError) and error.stream_missing:
                await self.stream.check_exists()  # made again (then nothing is in it), or an error
            elif isinstance(error, nats.errors.NoRespondersError) and not self.asked:
                self.asked = True  # once: nobody answering is mostly a leader election
                self.check = self.stream.check_soon()
        if self.loop.time() + self.delay > self.deadline:
            raise errors.unavailable(self.what, self.budget, error) from error
        log.debug("%s: retrying after %r", self.what, error)
        await self._pause()
        self.delay = min(self.delay * 2, 1.0)

    async def _pause(self) -> None:
        """Sleep `delay`, or less: until the stream elects a leader, or until the check of
        whether it exists ends, raising what it found (a stream gone that may not be made again)."""
        if self.stream is None:
            await asyncio.sleep(self.delay)
            return
        wake = [self.stream.link.next_election(self.stream.name)]
        if self.check is not None:
            wake.append(self.check)
        await asyncio.wait(wake, timeout=self.delay)
        check = self.check
        if check is not None and check.done():
            self.check = None
            check.result()


async def catch_up(
    must_see: int,
    from_replica: Callable[[], Awaitable[Sequence[M]]],
    from_leader: Callable[[], Awaitable[Sequence[Any]]],
) -> Sequence[Any]:
    """`from_replica()` once its last message is at stream sequence `must_see` or beyond
    (0: any answer will do); asked again with doubling pauses, then `from_leader()`."""
    delay = CATCH_UP_DELAY
    for _ in range(CATCH_UP_ATTEMPTS):
        msgs = await from_replica()
        if not must_see or (msgs and sequence_of(msgs[-1]) >= must_see):
            return msgs
        await asyncio.sleep(delay)  # a replica behind: ask again (maybe another one)
        delay *= 2
    return await from_leader()
