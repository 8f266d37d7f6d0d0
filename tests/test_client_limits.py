"""`Client.limits`: a timeout and a number of attempts for the calls made in a `with` block (and the
tasks started in it), on the same client, over a real server. What a caller checks: how many copies
of a request went out, and the wait each told its service (the header a write's service keeps to)."""

from __future__ import annotations

import asyncio
import math

import pytest

from events.errors import ContractError
from events.schema import ErrorCode
from events.subjects import WAIT_HEADER, service_subject
from tests.factories import actor
from warmboot.client import Client


async def heard(nc, sub, expected: int) -> list[str | None]:
    """The wait header of the `expected` copies `sub` heard, and none more once the server has sent all."""
    waits = [((await sub.next_msg(timeout=10)).headers or {}).get(WAIT_HEADER) for _ in range(expected)]
    await nc.flush()
    assert sub.pending_msgs == 0, f"{sub.pending_msgs} more copies than the {expected} expected"
    return waits


async def test_a_block_s_limits_bound_each_attempt_and_how_many_are_made(nc, prefix):
    """Nobody answers: the client's own limits (60 s, 6 attempts) would wait six minutes; the block's say
    two attempts of 0.2 s, each telling its service so, and the client's own stay as they were."""
    subject = service_subject(prefix, "snapshotter", "create", "c-1")
    silent = await nc.subscribe(subject)
    wb = Client(nc, prefix, timeout=60.0, attempts=6)
    with wb.limits(timeout=0.2, attempts=2) as limited:
        assert limited is wb
        with pytest.raises(ContractError) as lost:
            await wb.create(actor("c-1"))
    assert lost.value.code is ErrorCode.UNAVAILABLE and "within 0.2s" in lost.value.message, lost.value
    assert lost.value.request_id is not None  # the id to send again for its answer, as any time-out
    assert await heard(nc, silent, 2) == ["200", "200"]
    assert wb.retries == 1
    assert (wb.timeout, wb.attempts) == (60.0, 6)


async def test_limits_nest_and_bind_only_their_client(nc, prefix):
    """An inner block that leaves `attempts` out keeps the outer block's; another client in the block
    keeps its own; once out of both, the client's own apply."""
    subject = service_subject(prefix, "snapshotter", "create", "c-2")
    silent = await nc.subscribe(subject)
    wb = Client(nc, prefix, timeout=0.3, attempts=1)
    other = Client(nc, prefix, timeout=0.15, attempts=1)
    with wb.limits(attempts=3):
        with wb.limits(timeout=0.1):
            with pytest.raises(ContractError):
                await wb.create(actor("c-2"))
            assert await heard(nc, silent, 3) == ["100"] * 3
            with pytest.raises(ContractError):
                await other.create(actor("c-2"))
            assert await heard(nc, silent, 1) == ["150"]
        with pytest.raises(ContractError):  # the outer block again: its attempts, the client's timeout
            await wb.create(actor("c-2"))
        assert await heard(nc, silent, 3) == ["300"] * 3
    with pytest.raises(ContractError):
        await wb.create(actor("c-2"))
    assert await heard(nc, silent, 1) == ["300"]


async def test_tasks_started_in_a_block_keep_its_limits_and_others_keep_their_own(nc, prefix, stack):
    """Served by the real snapshotter: a task started before the block and one started in it run at once;
    each create is told the wait of the limits it was started under, and both are written (the same
    client's read-your-writes `seq` moves past both)."""
    subject = service_subject(prefix, "snapshotter", "create", "*")
    tap = await nc.subscribe(subject)  # a copy of each request, beside the service's queue group
    wb = Client(nc, prefix, timeout=2.5)
    go = asyncio.Event()

    async def create(actor_id: str):
        await go.wait()
        return await wb.create(actor(actor_id))

    before = asyncio.create_task(create("t-before"))
    with wb.limits(timeout=4.0):
        within = asyncio.create_task(create("t-within"))
    go.set()
    replies = await asyncio.gather(before, within)
    after = await wb.create(actor("t-after"))
    waits = {}
    for _ in range(3):
        msg = await tap.next_msg(timeout=10)
        waits[msg.subject.rsplit(".", 1)[1]] = (msg.headers or {}).get(WAIT_HEADER)
    assert waits == {"t-before": "2500", "t-within": "4000", "t-after": "2500"}
    assert wb.seq == after.seq > max(reply.seq for reply in replies)


@pytest.mark.parametrize("timeout, attempts, field", [
    (0, None, "timeout"), (-1.0, None, "timeout"), (math.nan, None, "timeout"), (math.inf, None, "timeout"),
    ("5", None, "timeout"), (True, None, "timeout"),
    (None, 0, "attempts"), (None, 1.5, "attempts"), (None, True, "attempts"), (None, -2, "attempts"),
])
async def test_a_limit_that_is_not_one_is_refused_naming_it_and_nothing_is_sent(nc, prefix, timeout, attempts, field):
    subject = service_subject(prefix, "snapshotter", "create", "c-3")
    silent = await nc.subscribe(subject)
    wb = Client(nc, prefix, timeout=0.2, attempts=1)
    with pytest.raises(ContractError) as bad:
        with wb.limits(timeout=timeout, attempts=attempts):
            await wb.create(actor("c-3"))
    assert bad.value.code is ErrorCode.INVALID_ARGUMENT and bad.value.field == field, bad.value
    given = {"timeout": timeout} if timeout is not None else {"attempts": attempts}
    with pytest.raises(ContractError) as constructed:  # the constructor alike (`attempts=0` was taken as 1)
        Client(nc, prefix, **given)
    assert (constructed.value.code, constructed.value.field) == (ErrorCode.INVALID_ARGUMENT, field)
    with pytest.raises(ContractError) as connecting:  # and `connect`, before it connects
        await Client.connect("nats://127.0.0.1:1", prefix, connect_timeout=30, **given)
    assert (connecting.value.code, connecting.value.field) == (ErrorCode.INVALID_ARGUMENT, field)
    await nc.flush()
    assert silent.pending_msgs == 0


async def test_a_time_out_after_several_attempts_says_how_many_and_how_long_in_all(nc, prefix):
    """Nobody answers in time at any attempt: the error said `no reply from S within 0.2s` after three
    attempts and some 0.7 s, read as one wait (a user trial of `limits`); it says the attempts and the
    time in all. A single attempt says its wait alone, as before."""
    subject = service_subject(prefix, "snapshotter", "create", "c-4")
    silent = await nc.subscribe(subject)
    wb = Client(nc, prefix, timeout=60.0, attempts=6)
    with wb.limits(timeout=0.2, attempts=3):
        with pytest.raises(ContractError) as lost:
            await wb.create(actor("c-4"))
    message = lost.value.message
    assert lost.value.code is ErrorCode.UNAVAILABLE and lost.value.request_id is not None, lost.value
    assert message.startswith(f"no reply from {subject} within 0.2s, at each of 3 attempts ("), message
    assert message.endswith(" s in all)") and float(message.rsplit("(", 1)[1].split(" ")[0]) >= 0.6, message
    assert await heard(nc, silent, 3) == ["200"] * 3
    with wb.limits(timeout=0.2, attempts=1):
        with pytest.raises(ContractError) as once:
            await wb.create(actor("c-4"))
    assert once.value.message == f"no reply from {subject} within 0.2s", once.value
    assert await heard(nc, silent, 1) == ["200"]


@pytest.mark.parametrize("connect_timeout", [0, -1.0, math.nan, "5", True])
async def test_a_connect_timeout_that_is_not_one_is_refused_naming_it_before_connecting(connect_timeout):
    """`Client.connect(url, connect_timeout=0)` tried for no time and raised UNAVAILABLE "cannot reach NATS ...
    within 0 s: TimeoutError" of a server that was up (a user trial), where `timeout=0` is refused: it is
    INVALID_ARGUMENT naming it, before connecting (here to a port nothing listens on)."""
    with pytest.raises(ContractError) as bad:
        await Client.connect("nats://127.0.0.1:1", connect_timeout=connect_timeout)
    assert (bad.value.code, bad.value.field) == (ErrorCode.INVALID_ARGUMENT, "connect_timeout"), bad.value
    assert bad.value.message == f"{connect_timeout!r} is not a number of seconds above 0"


async def test_limits_set_on_the_client_are_checked_as_the_constructor_checks_them(nc, prefix):
    """`wb.timeout = 0` was taken unchecked (a user trial); a good value applies to the next request."""
    subject = service_subject(prefix, "snapshotter", "create", "c-4")
    silent = await nc.subscribe(subject)
    wb = Client(nc, prefix, timeout=0.3, attempts=1)
    for attribute, value in (("timeout", 0), ("timeout", "1"), ("attempts", 0), ("attempts", 2.0)):
        with pytest.raises(ContractError) as bad:
            setattr(wb, attribute, value)
        assert (bad.value.code, bad.value.field) == (ErrorCode.INVALID_ARGUMENT, attribute), bad.value
    assert (wb.timeout, wb.attempts) == (0.3, 1)
    wb.timeout, wb.attempts = 0.25, 2
    with pytest.raises(ContractError):
        await wb.create(actor("c-4"))
    assert await heard(nc, silent, 2) == ["250", "250"]


@pytest.mark.parametrize("method, parameter", [("create", "actor"), ("register", "registration"), ("actors", "query"),
                                               ("workers", "query"), ("whatif", "query")])
async def test_a_method_given_no_request_body_says_which_parameter_and_sends_nothing(nc, prefix, method, parameter):
    """`wb.whatif("gvisor")` raised `AttributeError: 'str' object has no attribute 'min_seq'` (a user trial)."""
    everything = await nc.subscribe(f"{prefix}.>")
    wb = Client(nc, prefix, timeout=0.2, attempts=1)
    with pytest.raises(ContractError) as bad:
        await getattr(wb, method)("gvisor")
    assert (bad.value.code, bad.value.field) == (ErrorCode.INVALID_ARGUMENT, parameter), bad.value
    assert "'gvisor' is not a" in bad.value.message, bad.value
    await nc.flush()
    assert everything.pending_msgs == 0


async def test_connect_is_awaited_or_entered_as_a_context_manager(stack, nats_url, prefix):
    """`async with Client.connect(url) as wb:`, the idiom a script writes first, raised TypeError ("'coroutine'
    object does not support the asynchronous context manager protocol"): only `async with await
    Client.connect(...)` worked. Both do, each closing the connection it made at the block's end; so does
    a bare `await`, closed by the caller."""
    async with Client.connect(nats_url, prefix) as wb:
        created = await wb.create(actor("cm-1", cpu=100, mem=256))
        assert (await wb.status("cm-1")).seq == created.seq
    assert wb.nc.is_closed
    async with await Client.connect(nats_url, prefix) as again:
        assert (await again.status("cm-1")).seq == created.seq
    assert again.nc.is_closed
    bare = await Client.connect(nats_url, prefix)
    assert not bare.nc.is_closed
    await bare.close()
    assert bare.nc.is_closed
    with pytest.raises(ContractError) as refused:  # a prefix that is not one: raised at the block's start
        async with Client.connect(nats_url, "Not A Prefix"):
            raise AssertionError("entered")
    assert refused.value.code is ErrorCode.INVALID_ARGUMENT and refused.value.field == "prefix"
