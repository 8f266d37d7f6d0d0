"""One asyncio lock per key (an actor, a worker), dropped when nobody holds or waits for it.

A replica serialises its own requests about one entity with it, so that concurrent
duplicates and conflicting requests it receives itself are decided one after the
other on fresh state instead of racing each other on the store's optimistic
concurrency; replicas still race each other, which the store decides.

And how many requests about each key are in progress (`KeyedCount`), so that a service can
refuse one key's flood before it holds the slots every key shares.
"""

from __future__ import annotations

import asyncio


class KeyedLock:
    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    def __call__(self, key: str) -> "_Held":
        return _Held(self, key)

    def __len__(self) -> int:
        return len(self._locks)


class _Held:
    __slots__ = ("owner", "key")

    def __init__(self, owner: KeyedLock, key: str):
        self.owner = owner
        self.key = key

    async def __aenter__(self) -> None:
        entry = self.owner._locks.get(self.key)
        if entry is None:
            entry = self.owner._locks[self.key] = (asyncio.Lock(), [0])
        entry[1][0] += 1
        try:
            await entry[0].acquire()
        except BaseException:
            self._leave(entry)
            raise

    async def __aexit__(self, *exc: object) -> None:
        entry = self.owner._locks[self.key]
        entry[0].release()
        self._leave(entry)

    def _leave(self, entry: tuple[asyncio.Lock, list[int]]) -> None:
        entry[1][0] -= 1
        if not entry[1][0]:
            del self.owner._locks[self.key]


class KeyedCount:
    """How many requests about each key are in progress, at most `limit` (`enter` says False, and
    counts nothing, at the limit); a key is dropped when it has none."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        self.limit = limit
        self._counts: dict[str, int] = {}

    def enter(self, key: str) -> bool:
        count = self._counts.get(key, 0)
        if count >= self.limit:
            return False
        self._counts[key] = count + 1
        return True

    def leave(self, key: str) -> None:
        count = self._counts[key] - 1
        if count:
            self._counts[key] = count
        else:
            del self._counts[key]

    def __contains__(self, key: str) -> bool:
        return key in self._counts

    def __len__(self) -> int:
        return len(self._counts)
