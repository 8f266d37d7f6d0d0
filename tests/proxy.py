"""A TCP proxy in front of a nats-server that can lose what the server sends, with the connection, or
hold it for a while."""

from __future__ import annotations

import asyncio
import threading
from contextlib import suppress
from typing import Callable

from warmboot.natsserver import free_port


class LosingProxy:
    """Clients connect to `url`; each connection is relayed to the server at `port`. `lose(pattern)`:
    the next chunk the server sends to a client that holds `pattern` never reaches it, and that
    connection is cut, as a network fault or a server that drops a slow client would (`lost` is set;
    the client reconnects through the proxy, and is relayed again). `hold(pattern, release)`: the next
    chunk holding `pattern`, and whatever the server sends that client after it, reaches it only once
    `release` is set, all of it in one write (a slow link; what follows the chunk read with it)."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.host, self.port = host, port
        self.listen = free_port(host)
        self.lost = asyncio.Event()
        self._pattern: bytes | None = None
        self._server: asyncio.Server | None = None
        self._links: dict[asyncio.Task[None], Callable[[], None]] = {}  # each relay, and how to cut it
        self._relayed: list[tuple[bytes, threading.Event]] = []  # (pattern, set once relayed to a client)
        self._hold: tuple[bytes, asyncio.Event] | None = None
        self.holding = asyncio.Event()  # set once a held chunk came (`hold`)
        self._arrived: list[tuple[bytes, asyncio.Event]] = []  # (pattern, set once the server sent it)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.listen}"

    def lose(self, pattern: bytes) -> None:
        self._pattern = pattern
        self.lost.clear()

    def hold(self, pattern: bytes, release: asyncio.Event) -> None:
        self._hold = (pattern, release)
        self.holding.clear()

    def arrived(self, pattern: bytes) -> asyncio.Event:
        """Set once the server sent a client a chunk holding `pattern`, relayed yet or held."""
        event = asyncio.Event()
        self._arrived.append((pattern, event))
        return event

    def _saw(self, chunk: bytes) -> None:
        for pattern, event in self._arrived:
            if pattern in chunk:
                event.set()

    def relayed(self, pattern: bytes) -> threading.Event:
        """Set (from the proxy's thread) once a chunk holding `pattern` was written to a client's socket;
        a thread-safe event, for a test whose own loop does not run meanwhile."""
        event = threading.Event()
        self._relayed.append((pattern, event))
        return event

    def cut_all(self) -> None:
        """Cut every connection relayed now, as a server that drops its clients would (they reconnect)."""
        for cut in list(self._links.values()):
            cut()

    async def cut_and_ended(self) -> None:
        """`cut_all`, and return once every relay cut has ended (its sockets closed)."""
        self.cut_all()  # each relay ends as its two pumps see their connections end
        await asyncio.gather(*self._links, return_exceptions=True)

    async def __aenter__(self) -> "LosingProxy":
        self._server = await asyncio.start_server(self._relay, self.host, self.listen)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self.cut_and_ended()

    async def _relay(self, from_client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        try:
            from_server, to_server = await asyncio.open_connection(self.host, self.port)
        except OSError:
            to_client.transport.abort()
            return

        def cut() -> None:
            to_client.transport.abort()
            to_server.transport.abort()

        self._links[asyncio.current_task()] = cut

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, watched: bool) -> None:
            with suppress(OSError, asyncio.IncompleteReadError):
                while chunk := await reader.read(65536):
                    if watched:
                        self._saw(chunk)
                    if watched and self._pattern is not None and self._pattern in chunk:
                        self._pattern = None
                        self.lost.set()
                        return  # not relayed: lost with the connection, cut below
                    if watched and self._hold is not None and self._hold[0] in chunk:
                        release, self._hold = self._hold[1], None
                        self.holding.set()
                        chunk = await self._held(reader, chunk, release, self._saw)
                    writer.write(chunk)
                    await writer.drain()
                    if watched:
                        for pattern, event in self._relayed:
                            if pattern in chunk:
                                event.set()

        pumps = [asyncio.ensure_future(pump(from_client, to_server, False)),
                 asyncio.ensure_future(pump(from_server, to_client, True))]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)  # either side ended: both end
        finally:
            cut()
            for each in pumps:
                each.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._links.pop(asyncio.current_task(), None)

    @staticmethod
    async def _held(reader: asyncio.StreamReader, first: bytes, release: asyncio.Event,
                    saw: Callable[[bytes], None]) -> bytes:
        """`first` and what `reader` gives until `release` is set, as one chunk."""
        held = [first]
        released = asyncio.ensure_future(release.wait())
        try:
            while not release.is_set():
                read = asyncio.ensure_future(reader.read(65536))
                await asyncio.wait({read, released}, return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    read.cancel()  # what it would have read stays in the reader's buffer
                    await asyncio.gather(read, return_exceptions=True)  # ended before the next read begins
                if read.cancelled() or not read.result():
                    break
                held.append(read.result())
                saw(read.result())
        finally:
            released.cancel()
        return b"".join(held)
