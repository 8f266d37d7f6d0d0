"""A write onto a connection whose transport closed before nats-py saw it go: an outage, not a bug.

Under uvloop, nats-py's flusher stops on the RuntimeError of a write onto a closed transport (it takes
it for the loop closing) without reporting the connection lost, and every later publish writes inline
onto that transport, raising `RuntimeError: unable to perform operation on <TCPTransport closed=True
...>; the handler is closed` to its caller until the read loop sees the connection go. A chaos soak
found it in the snapshotter's store reads (traces in stream.read -> link.direct_batch): the store did
not retry it and the endpoint answered INTERNAL, so a client did not retry a suspend either. Each test
below raises it through the real stack (nats-py on uvloop, a real server) and checks who sees what.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

import nats
import pytest
import uvloop

from events.errors import ContractError
from events.jetstream import errors
from events.jetstream.retry import Retry
from events.natspy.connections import transport_lost
from events.schema import ErrorCode, Heartbeat, HeartbeatReply
from events.subjects import service_subject
from services.endpoints import EndpointSpec, add_endpoints, is_outage
from warmboot.client import Client

T = TypeVar("T")


def on_uvloop(work: Callable[[], Awaitable[T]]) -> Awaitable[T]:
    """`work()` run to its end on a uvloop loop of its own, in a thread: the error is uvloop's (asyncio's own
    transport drops a write onto a closed socket silently), and the tests run on either loop
    (WARMBOOT_EVENT_LOOP)."""
    return asyncio.to_thread(uvloop.run, work())


async def lose_transport(nc) -> None:
    """nats-py's state in the soak's traces: the socket under `nc` closed, nats-py's read loop not (yet)
    aware of it, its flusher stopped by the RuntimeError of its write. (The read loop is stopped here so
    that it does not see the connection go first, which it mostly does: the state is a race's.)"""
    nc._reading_task.cancel()
    await asyncio.wait([nc._reading_task])
    transport = nc._transport._io_writer.transport
    transport.close()
    for _ in range(100):  # uvloop marks the handle closed once libuv closed it: an iteration or two
        if "closed=True" in repr(transport):
            break
        await asyncio.sleep(0)
    assert "closed=True" in repr(transport)
    await nc.publish("x.lost", b"")  # queued; nats-py's flusher writes it, meets the RuntimeError, and stops
    await asyncio.wait([nc._flusher_task], timeout=10)
    assert nc._flusher_task.done() and nc.is_connected  # nothing told nats-py the connection is gone


async def discard(nc) -> None:
    """Close `nc` after `lose_transport`: what it holds to be sent cannot be, and would raise again."""
    nc._pending, nc._pending_data_size = [], 0
    await nc.close()


async def the_error(nats_url) -> RuntimeError:
    async def raised() -> RuntimeError:
        nc = await nats.connect(nats_url, allow_reconnect=False)
        try:
            await lose_transport(nc)
            with pytest.raises(RuntimeError) as raised:
                await nc.publish("x.lost", b"")
            return raised.value
        finally:
            await discard(nc)

    return await on_uvloop(raised)


async def test_the_error_is_an_outage_that_the_store_retries(nats_url):
    error = await the_error(nats_url)
    assert transport_lost(error) and "closed=True" in str(error)
    assert is_outage(error)  # the endpoints: UNAVAILABLE, not INTERNAL
    assert errors.retryable(error) and errors.unanswered(error)  # the store: another attempt; an append, uncertain
    # another RuntimeError is still a bug, even one that speaks of a closed handle
    for other in (RuntimeError("unable to perform operation on a thing"), RuntimeError("the handler is closed"),
                  RuntimeError("Event loop is closed")):
        assert not transport_lost(other) and not is_outage(other) and not errors.retryable(other)

    attempts = []

    async def attempt(timeout: float) -> str:
        attempts.append(timeout)
        if len(attempts) == 1:
            raise error
        return "read"

    assert await Retry("reading", 5.0).run(attempt) == "read"
    assert len(attempts) == 2


async def test_an_endpoint_that_meets_it_answers_unavailable(nc, nats_url, prefix):
    error = await the_error(nats_url)

    async def read(entity_id: str, request: Heartbeat) -> HeartbeatReply:
        raise error

    micro = await add_endpoints(nc, prefix, "probe", "a test service", [EndpointSpec("answer", Heartbeat, read)])
    try:
        msg = await nc.request(service_subject(prefix, "probe", "answer", "w-1"), b"{}", timeout=10)
    finally:
        await micro.stop()
    assert msg.headers["Nats-Service-Error-Code"] == "503"
    assert b'"UNAVAILABLE"' in msg.data


async def test_a_client_whose_connection_meets_it_says_unavailable(nats_url, prefix):
    async def refused() -> ContractError:
        nc = await nats.connect(nats_url, allow_reconnect=False)
        try:
            client = Client(nc, prefix, timeout=2.0, attempts=1)
            await lose_transport(nc)
            with pytest.raises(ContractError) as refused:
                await client.heartbeat("w-1")
            return refused.value
        finally:
            await discard(nc)

    error = await on_uvloop(refused)
    assert error.code is ErrorCode.UNAVAILABLE
    assert "connection to NATS was lost" in error.message and "same request_id" in error.message
