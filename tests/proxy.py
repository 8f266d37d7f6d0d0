"""A TCP proxy in front of a nats-server that can lose what the server sends, with the connection."""

from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import Callable

from warmboot.natsserver import free_port


class LosingProxy:
    """Clients connect to `url`; each connection is relayed to the server at `port`. `lose(pattern)`:
    the next chunk the server sends to a client that holds `pattern` never reaches it, and that
    connection is cut, as a network fault or a server that drops a slow client would (`lost` is set;
    the client reconnects through the proxy, and is relayed again)."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.host, self.port = host, port
        self.listen = free_port(host)
        self.lost = asyncio.Event()
        self._pattern: bytes | None = None
        self._server: asyncio.Server | None = None
        self._links: dict[asyncio.Task[None], Callable[[], None]] = {}  # each relay, and how to cut it

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.listen}"

    def lose(self, pattern: bytes) -> None:
        self._pattern = pattern
        self.lost.clear()

    async def __aenter__(self) -> "LosingProxy":
        self._server = await asyncio.start_server(self._relay, self.host, self.listen)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for cut in list(self._links.values()):
            cut()  # each relay ends as its two pumps see their connections end
        await asyncio.gather(*self._links, return_exceptions=True)

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
                    if watched and self._pattern is not None and self._pattern in chunk:
                        self._pattern = None
                        self.lost.set()
                        return  # not relayed: lost with the connection, cut below
                    writer.write(chunk)
                    await writer.drain()

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
