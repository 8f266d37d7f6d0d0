"""How much a worker's requests may write: a token bucket per worker id, in one replica. Pure: the
clock is given, no I/O.

A worker's credential may send `register`, `drain` and `remove` for its own id
(docs/security.md), and each of them may write: the worker's events (a label flipped back and
forth appends two each time, and the log never discards), an answer kept in the reply bucket (a
registration or a drain that changed nothing, under a new request id each time), or a refused
registration's mark. With nothing to stop it, one credential could grow the server's storage as
fast as it can send. So each such write costs the worker one write of its budget: `burst` at once,
then one more every `interval_s`. A request that would write past it is refused
RESOURCE_EXHAUSTED (field `worker_id`), nothing written (but a registration's heartbeat, put before
any decision), and says when to try again. A write that fails is given back (`Ticket.paying`), one
whose acknowledgement was lost too: a request pays only for what it wrote, at most.

Free, so never refused for the budget:
- what writes nothing: a heartbeat, a request repeated with its id (answered from the history or a
  kept answer), a refusal whose mark is there already, a change of nothing without a request id;
- a drain that drains the worker and a removal that ends its life: each happens at most once in a
  life, and a life begins only with a registration, which pays. So the worker's own credential can
  always drain or remove it (an agent removes its worker at once when its CPU changed); no operator's
  or client's credential may (docs/security.md), a flooding worker's is withdrawn instead;
- the registry's own writes (LOST, a removal for the binding's sake): no worker's request.

The budget is each replica's own (a queue group spreads a worker's requests over the replicas),
so a worker may write up to `replicas` times as much; what it bounds is the rate, hence the
storage, one credential can take, not an exact count. A worker an agent runs sends a handful of
registrations an hour (its start, a reconnect, an edit of its file, a change of its CPU); the
default, 100 at once and then one every 10 s, leaves it far inside, and bounds one credential to
about 8,640 writes a day per replica.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from events.errors import exhausted

DEFAULT_BURST = 100
DEFAULT_INTERVAL_S = 10.0
_PRUNE_EVERY = 4096  # takes between two sweeps of the workers whose budget is whole again


class WriteBudget:
    """Writes per worker id: at most `burst` at once, one more earned back every `interval_s`.
    `burst` 0 means no limit. Only workers below a whole budget are kept."""

    def __init__(self, burst: int = DEFAULT_BURST, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] | None = None):
        if burst < 0:
            raise ValueError(f"burst must be 0 (no limit) or more, not {burst}")
        if burst and not (math.isfinite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s must be a positive number of seconds, not {interval_s}")
        self.burst = burst
        self.interval_s = interval_s
        self.clock = clock if clock is not None else time.monotonic
        self._spent: dict[str, tuple[float, float]] = {}  # worker id -> (writes left, when counted)
        self._refused: set[str] = set()  # refused since their last write (`first_refusal`)
        self._takes = 0

    def left(self, worker_id: str) -> float:
        """The writes `worker_id` may make now (fractions earned back count)."""
        if not self.burst:
            return math.inf
        return self._left_at(worker_id, self.clock())

    def _left_at(self, worker_id: str, at: float) -> float:
        entry = self._spent.get(worker_id)
        if entry is None:
            return float(self.burst)
        left, counted = entry
        return min(float(self.burst), left + max(0.0, at - counted) / self.interval_s)

    def take(self, worker_id: str) -> None:
        """One write for `worker_id`; RESOURCE_EXHAUSTED (field `worker_id`), nothing taken, if it has
        none left."""
        if not self.burst:
            return
        at = self.clock()
        left = self._left_at(worker_id, at)
        if left < 1.0:
            wait = (1.0 - left) * self.interval_s
            raise exhausted(
                f"worker {worker_id!r} has spent its write budget ({self.burst} at once, then one every "
                f"{self.interval_s:g}s): nothing was written; try again in {wait:.1f}s", "worker_id")
        self._spent[worker_id] = (left - 1.0, at)
        self._refused.discard(worker_id)
        self._takes += 1
        if self._takes >= _PRUNE_EVERY:
            self._prune(at)

    def _prune(self, at: float) -> None:
        """Forget the workers whose budget is whole again: the table holds only recent writers."""
        self._takes = 0
        whole = [w for w in self._spent if self._left_at(w, at) >= self.burst]
        for worker_id in whole:
            del self._spent[worker_id]
            self._refused.discard(worker_id)

    def first_refusal(self, worker_id: str) -> bool:
        """Whether this is `worker_id`'s first refusal since its last write (noted): a flood of
        refused requests is said once, not once a request."""
        if worker_id in self._refused:
            return False
        self._refused.add(worker_id)
        return True

    def give_back(self, worker_id: str) -> None:
        """A write taken for `worker_id` and not made (its append failed)."""
        if not self.burst:
            return
        at = self.clock()
        self._spent[worker_id] = (min(float(self.burst), self._left_at(worker_id, at) + 1.0), at)

    def ticket(self, worker_id: str) -> "Ticket":
        """What one request about `worker_id` pays its write with."""
        return Ticket(self, worker_id)

    def __len__(self) -> int:
        return len(self._spent)


class Ticket:
    """What a request about one worker pays its writes with: each taken from the budget as it is
    about to be made, and given back if it fails (a lost race: the command's next run takes it
    again), so a request pays only for the writes it made."""

    __slots__ = ("budget", "worker_id")

    def __init__(self, budget: WriteBudget | None, worker_id: str):
        self.budget = budget
        self.worker_id = worker_id

    @contextmanager
    def paying(self) -> Iterator[None]:
        """Around a write: RESOURCE_EXHAUSTED before it if the budget is spent; the write given back
        if the block raises (the append refused, lost or unanswered)."""
        if self.budget is None:
            yield
            return
        self.budget.take(self.worker_id)  # raises, nothing taken, if none is left
        try:
            yield
        except BaseException:
            self.budget.give_back(self.worker_id)
            raise


FREE = Ticket(None, "")  # writes no worker's request pays for
