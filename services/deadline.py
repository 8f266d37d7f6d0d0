"""How long a request's caller waits for its answer, and the refusal of a write decided after that.

A caller may say, in the request header `Warmboot-Wait-Ms` (`events.subjects.WAIT_HEADER`), how
many milliseconds it waits for the answer; `warmboot.client` sends its time-out there. A replica
that has held such a request longer than that, counted from when it received it, writes nothing
for it: the write is refused UNAVAILABLE (`Expired`) at the moment it would be made, so its
caller, which has gone, is answered as if the replica had stalled a moment longer.

Why: a request id is scoped to one life of its entity (CONTRACT, v1.1). A first attempt held
by a stalled replica (its store retrying through a leader election) is decided after the
caller's retry was answered elsewhere and the caller went on, a stop and a creation anew, say;
the copy, a new request in the new life by that rule, then stopped, suspended, paused or removed
the next life (an audit's finding, docs/contract.md). Where the retry was answered in the earlier
life, the copy's id says so, and the registry and the snapshotter refuse it by that
(`REFUSED_FROM_AN_EARLIER_LIFE`); this bound is for the rest: a request its caller gave up on, and
a resume, whose id the scheduler looks up in this life only. Past its caller's wait no request is
anyone's any more, so it is refused instead. What is decided in time is unchanged: an append
already sent lands or not as before, and it expects each subject where it was read, so a
copy decided on the earlier life that lands after the next one began fails its append, is
decided again, and is refused here.

A request without the header (a client of another language that does not send it) is decided
however long it waited, as before.

The deadline is the current task's: set by the endpoint wrapper (`services.endpoints.wrap`) in
the request's own task, and read only from that task (`check`), so a task the request started
does not inherit it. The scheduler decides in its committer's task, from each job's own
deadline (`passed`).
"""

from __future__ import annotations

import asyncio
import time
from contextvars import ContextVar

from events.errors import ContractError, invalid
from events.schema import ErrorCode
from events.subjects import WAIT_HEADER

_WAIT_LOWER = WAIT_HEADER.lower()
MAX_WAIT_MS = 24 * 3600 * 1000  # a day: what the header may say (a larger value is INVALID_ARGUMENT)

# (the request's task, the deadline in time.perf_counter_ns(), the wait it says, when it was received)
_current: ContextVar[tuple[asyncio.Task, int, int, int] | None] = ContextVar("warmboot_request_deadline",
                                                                            default=None)


class Expired(ContractError):
    """UNAVAILABLE: the request was held past its caller's wait, and nothing was written for it."""

    def __init__(self, wait_ms: int, held_ms: int, what: str):
        super().__init__(
            ErrorCode.UNAVAILABLE,
            f"this replica held the request {held_ms} ms, longer than the {wait_ms} ms its caller waits "
            f"({WAIT_HEADER}): {what} is not written so late, as it could act on what happened since (a retry "
            "answered elsewhere, a new life); nothing was written, and a retry with the same request_id gets "
            "the answer")


def wait_ms(headers: dict[str, str] | None) -> int | None:
    """The wait the request's header says, in ms; None without the header. INVALID_ARGUMENT naming
    the header for anything but an integer from 1 to MAX_WAIT_MS."""
    if not headers:
        return None
    text = headers.get(WAIT_HEADER)
    if text is None:  # as another language's client may spell it: header names are case-insensitive
        text = next((value for name, value in headers.items() if name.lower() == _WAIT_LOWER), None)
        if text is None:
            return None
    text = text.strip()
    if not text.isdigit() or not 1 <= int(text) <= MAX_WAIT_MS:
        raise invalid(f"header {WAIT_HEADER} must be the milliseconds the caller waits for the answer, an integer "
                      f"from 1 to {MAX_WAIT_MS}; got {text[:32]!r}", f"headers.{WAIT_HEADER}")
    return int(text)


def begin(wait: int | None, received_ns: int) -> None:
    """The current task serves a request received at `received_ns` (time.perf_counter_ns) whose
    caller waits `wait` ms (None: no deadline)."""
    if wait is None:
        return
    _current.set((asyncio.current_task(), received_ns + wait * 1_000_000, wait, received_ns))  # type: ignore[arg-type]


def deadline() -> tuple[int, int, int] | None:
    """The current task's request deadline: (deadline, wait in ms, received), in perf_counter_ns; None if none."""
    found = _current.get()
    if found is None:
        return None
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no loop runs in this thread: not the request's task
        return None
    if task is not found[0]:
        return None
    return found[1], found[2], found[3]


def passed(at: tuple[int, int, int] | None, what: str) -> Expired | None:
    """The refusal of a write decided now for a request with deadline `at` (`deadline()`), or None."""
    if at is None:
        return None
    now = time.perf_counter_ns()
    if now <= at[0]:
        return None
    return Expired(at[1], (now - at[2]) // 1_000_000, what)


def check(what: str) -> None:
    """Raise `Expired` if the current task serves a request held past its caller's wait."""
    refusal = passed(deadline(), what)
    if refusal is not None:
        raise refusal
