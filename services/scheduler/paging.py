"""The cursor of a listing's page (`scheduler.actors`, `scheduler.workers`, project additions): given only
when a row that passes the query's filters follows the page's last row, so that `--continue` never
leads to an empty page (it did when every row left failed the filters: `actor list --state RUNNING`
said more follow, and the next page said "no actor matches"). Pure: no I/O.

Cost: finding that row scans the ids after the page up to it (to the end when none follows: the
scan the next page would have made to find it empty). Where it was found is kept, per fold position,
for the next page asked after that cursor with the same filters, which starts there: a walk of every
page at one position scans each id once, as it did before (docs/scaling.md; `bench/views.py`).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Callable, Hashable, Sequence

AHEAD_MAX = 64  # cursors kept per fold position (listings walked at once); more: forgotten, then scanned again


class Ahead:
    """Per fold position (`position`): cursor and filters -> the index of the first id after the cursor
    that passes the filters (or len(ids): none does)."""

    __slots__ = ("position", "found")

    def __init__(self) -> None:
        self.position: Hashable = None
        self.found: dict[tuple[str, Hashable], int] = {}

    def start(self, ids: Sequence[str], position: Hashable, after: str | None, filters: Hashable) -> int:
        """Where a page after `after` begins in `ids` (the ids in order at `position`): where the page
        that gave that cursor found its next row, if it was at this position with these filters, else
        the first id after `after`."""
        if after is None:
            return 0
        if position == self.position:
            index = self.found.get((after, filters))
            if index is not None:
                return index
        return bisect_right(ids, after)

    def cursor(self, ids: Sequence[str], index: int, last: str | None, position: Hashable, filters: Hashable,
               passes: Callable[[str], bool]) -> str | None:
        """The cursor of a page whose last row is `last` (None: an empty page) and whose scan stopped at
        `index`: `last` if an id from `index` on passes the filters, else None. Where it is found is kept
        for the next page."""
        if last is None:
            return None
        while index < len(ids) and not passes(ids[index]):
            index += 1
        if index == len(ids):
            return None
        if position != self.position or len(self.found) >= AHEAD_MAX:
            self.position, self.found = position, {}
        self.found[(last, filters)] = index
        return last
