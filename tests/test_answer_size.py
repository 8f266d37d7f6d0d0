"""Every answer the services give reaches its caller, however large what it would say: on a real nats-server
of nats-server's default max_payload (1 MB, `one_mb`), an answer past it is refused RESOURCE_EXHAUSTED at
once (`services.endpoints.fitting`), saying what it holds and what to do (`services.scheduler.service.
TOO_LARGE`: it said "ask for less" of every endpoint, which `scheduler.worker` cannot), and an error reply past
it has its message cut to fit (`services.endpoints.fitting_error`); the service goes on answering. Before,
whatif's NOT_FOUND for an unknown class, naming every class registered workers run, was past max_payload on a
fleet of 2,200 workers of 8 classes each (a 1.1 MB message): it was sent to nobody, and its caller waited out
its time-out; it names the first CLASSES_NAMED now. The largest registration the registry takes makes four of
the scheduler's answers past max_payload."""

from __future__ import annotations

import asyncio
import re
from contextlib import AsyncExitStack

import msgspec
import nats.errors
import pytest
from click.testing import CliRunner

from events.codec import encode
from events.errors import ContractError
from events.schema import (Assignment, CreateActor, ErrorCode, ExplainResume, Explanation, FleetRuntimes,
                           Fragmentation, FragmentationQuery, RegisterReply, RegisterWorker, Resources, ResumeActor,
                           RuntimesQuery, SeqReply, WhatIf, WhatIfAnswer, WorkerDetail, WorkerPage, WorkerQuery,
                           WorkersQuery)
from events.subjects import service_subject
from events.natspy.headers import header_block
from services.endpoints import (CUT_MESSAGE, EndpointSpec, add_endpoints, call, error_headers, fitting_error,
                                past_max_payload)
from services.scheduler.service import TOO_LARGE
from services.scheduler.whatif import CLASSES_NAMED
from tests.conftest import ONE_MB
from tests.factories import SILENT_TTL_S, last_seq
from tests.registry_helpers import registration, runtime
from tests.test_registry_event_size import classes
from warmboot.cli import main
from warmboot.client import Client
from warmboot.runner import SERVICES, start_services


def reply_size(error: ContractError) -> int:
    """What an error reply is on the wire: its body and its two headers (what the server's limit is on)."""
    return len(encode(error.reply())) + len(header_block(error_headers(error)))


def cut_at(message: str) -> tuple[int, int]:
    """(characters kept, characters the message had) that a message cut by `fitting_error` says."""
    found = re.search(re.escape(CUT_MESSAGE).replace(r"\{kept\}", r"(\d+)").replace(r"\{total\}", r"(\d+)") + "$",
                      message)
    assert found is not None, message[-300:]
    return int(found[1]), int(found[2])


# --- the cut, pure -------------------------------------------------------------------------------


def test_an_error_that_fits_is_left_as_it_is():
    error = ContractError(ErrorCode.NOT_FOUND, "no worker has registered the sandbox class 'x'", "sandbox_class")
    assert fitting_error(error, reply_size(error)) is error
    assert fitting_error(error, None) is error  # the server's limit not known


@pytest.mark.parametrize("char", ["a", "\u00e9", "\U0001f600", "\x01"])  # 1 to 4 bytes of UTF-8; an escaped one: 6
def test_an_error_past_the_limit_keeps_its_code_and_field_and_is_cut_to_fit_saying_so(char):
    error = ContractError(ErrorCode.NOT_FOUND, "registered: " + char * 300_000, "sandbox_class")
    limit = 64 * 1024
    cut = fitting_error(error, limit)
    assert reply_size(error) > limit >= reply_size(cut)
    assert (cut.code, cut.field) == (error.code, error.field)
    kept, total = cut_at(cut.message)
    assert total == len(error.message) and 0 < kept < total
    assert cut.message == error.message[:kept] + CUT_MESSAGE.format(kept=kept, total=total)
    assert reply_size(cut) > limit - 6 * len(CUT_MESSAGE) - 64  # cut near the limit, not far below it


# --- on a real 1 MB server -----------------------------------------------------------------------


def many_classes(i: int) -> list[dict]:
    """8 classes of the longest name (63 characters), told apart by the worker's number."""
    return [{"sandbox_class": (f"c{i:05d}x{j}-" + "y" * 63)[:63], "default_runtime": runtime("v1"),
             "restorable_runtimes": []} for j in range(8)]


async def test_an_error_reply_past_max_payload_is_answered_at_once_cut_to_fit(one_mb, prefix):
    """The endpoint layer on a real 1 MB server: a refusal whose message alone is past max_payload (a 2 MB
    one) is answered at once, its code and field kept, its message cut to fit and saying so; the endpoint
    goes on answering."""
    url, nc = one_mb
    message = "registered: " + "c" * (2 * ONE_MB)

    async def refuse(_: str | None, query: RuntimesQuery) -> FleetRuntimes:
        if query.min_seq == 1:
            raise ContractError(ErrorCode.NOT_FOUND, message, "sandbox_class")
        return FleetRuntimes(runtimes=[])

    service = await add_endpoints(nc, prefix, "sizes", "answers of every size",
                                  [EndpointSpec("ask", RuntimesQuery, refuse, per_entity=False)])
    try:
        with pytest.raises(ContractError) as refused:  # a time-out would be UNAVAILABLE ("no reply ... within")
            await call(nc, service_subject(prefix, "sizes", "ask"), RuntimesQuery(min_seq=1), FleetRuntimes,
                       timeout=30)
        error = refused.value
        assert (error.code, error.field) == (ErrorCode.NOT_FOUND, "sandbox_class"), error
        kept, total = cut_at(error.message)
        assert total == len(message) and ONE_MB - 1024 < kept < ONE_MB
        assert error.message == message[:kept] + CUT_MESSAGE.format(kept=kept, total=total)
        assert await call(nc, service_subject(prefix, "sizes", "ask"), RuntimesQuery(), FleetRuntimes) == \
            FleetRuntimes(runtimes=[])
    finally:
        await service.stop()


async def test_an_unknown_class_of_a_fleet_of_thousands_of_classes_is_refused_at_once_naming_the_first(
        one_mb, prefix):
    """whatif's NOT_FOUND for an unknown class named every class registered workers run: 17,600 of them at
    2,200 workers of 8 classes each, a 1.1 MB message sent to nobody (its caller waited out its time-out). It
    names the first CLASSES_NAMED and how many more."""
    url, nc = one_mb
    workers = 2_200  # 17,600 classes of 63 characters: about 1.2 MB of names, past the 1 MB the server carries
    async with AsyncExitStack() as exits:
        await start_services(exits, list(SERVICES), url, prefix, options={"registry": {"ttl_s": SILENT_TTL_S}})

        def subject(verb: str, entity: str | None = None, service: str = "scheduler") -> str:
            return service_subject(prefix, service, verb, entity)

        wb = Client(nc, prefix, timeout=60)  # as a fleet's agents do: an UNAVAILABLE under load is asked again
        for first in range(0, workers, 200):
            await asyncio.gather(*(
                wb.register(msgspec.convert(registration(f"w{i}", node=f"n{i}", classes=many_classes(i)),
                                            RegisterWorker))
                for i in range(first, min(workers, first + 200))))
        seq = await last_seq(nc, prefix)
        query = WhatIf(sandbox_class="nope", min_seq=seq)
        with pytest.raises(ContractError) as refused:  # a time-out would be UNAVAILABLE ("no reply ... within")
            await call(nc, subject("whatif"), query, WhatIfAnswer, timeout=30)
        error = refused.value
        assert (error.code, error.field) == (ErrorCode.NOT_FOUND, "sandbox_class"), error
        named = sorted(c["sandbox_class"] for i in range(workers) for c in many_classes(i))[:CLASSES_NAMED]
        assert error.message == (f"no worker has registered the sandbox class 'nope' (registered: {', '.join(named)}, "
                                 f"and {8 * workers - CLASSES_NAMED:,} more)")
        # the scheduler goes on answering: a known class's forecast, a page of its workers
        known = many_classes(7)[3]["sandbox_class"]
        answer = await call(nc, subject("whatif"), WhatIf(sandbox_class=known, min_seq=seq), WhatIfAnswer)
        assert answer.before.stranded_snapshots == 0
        page = await call(nc, subject("workers"), WorkersQuery(sandbox_classes=(known,), min_seq=seq), WorkerPage)
        assert [w.worker_id for w in page.workers] == ["w7"]
        fragmentation = await call(nc, subject("fragmentation"), FragmentationQuery(sandbox_class=known, min_seq=seq),
                                   Fragmentation)
        assert [c.workers for c in fragmentation.classes] == [1]


def one_class(pad: int) -> list[dict]:
    """One class of 33 runtimes, each accepting 4 compatible versions of its own, every version 32 attributes
    of `pad` characters: the registration whose versions the scheduler's answers spell out the most of."""
    return classes("a", pad, edges=4, count=1)


async def largest_taken(nc, subject, shape) -> int:
    """The longest attribute values (`pad`) for which the registry takes a registration of `shape(pad)`: its
    WorkerRegistered within max_payload less 1 KiB (`services.registry.domain.check_fits`)."""
    taken, refused = 16, 257  # an attribute's value is at most 256 characters
    while refused - taken > 1:
        pad = (taken + refused) // 2
        try:
            await call(nc, subject("register", "w-probe", "registry"), registration("w-probe", classes=shape(pad)),
                       RegisterReply, timeout=30)
        except (ContractError, nats.errors.MaxPayloadError):  # past the event's room, or past the message's
            refused = pad
            continue
        await call(nc, subject("remove", "w-probe", "registry"), {}, SeqReply)
        taken = pad
    return taken


async def test_the_answers_spelling_out_the_largest_registration_taken_are_refused_at_once_saying_what_to_do(
        one_mb, prefix):
    """The worst registration the registry takes on a 1 MB server makes four of the scheduler's answers larger
    than the server carries: each is RESOURCE_EXHAUSTED at once, naming both sizes, what the answer holds and
    what to do (`TOO_LARGE`); the others answer (a resume, an explanation, a page of workers), and the service
    goes on answering."""
    url, nc = one_mb
    async with AsyncExitStack() as exits:
        await start_services(exits, list(SERVICES), url, prefix, options={"registry": {"ttl_s": SILENT_TTL_S}})

        def subject(verb: str, entity: str | None = None, service: str = "scheduler") -> str:
            return service_subject(prefix, service, verb, entity)

        shape = one_class(await largest_taken(nc, subject, one_class))
        await call(nc, subject("register", "w-big", "registry"),
                   registration("w-big", node="node-big", classes=shape), RegisterReply, timeout=30)
        for a in ("a0", "a1", "a2"):  # actors booked on it, each pinned to its default (a version of 32 attributes)
            await call(nc, subject("create", a, "snapshotter"),
                       CreateActor(actor_id=a, sandbox_class="c0", template_uid="t1",
                                   resources=Resources(cpu_millis=100, memory_mib=128)), SeqReply)
            placed = await call(nc, subject("resume", a), ResumeActor(), Assignment)
            assert placed.worker_id == "w-big"
        seq = await last_seq(nc, prefix)
        asked = {  # what each says it holds and what to do (TOO_LARGE), by what was asked
            "worker": (subject("worker", "w-big"), WorkerQuery(min_seq=seq), WorkerDetail),
            "fragmentation": (subject("fragmentation"), FragmentationQuery(min_seq=seq), Fragmentation),
            "fragmentation of a class": (subject("fragmentation"), FragmentationQuery(sandbox_class="c0", min_seq=seq),
                                         Fragmentation),
            "whatif": (subject("whatif"), WhatIf(sandbox_class="c0", drain_workers=("w-big",), min_seq=seq),
                       WhatIfAnswer),
            "whatif listing at most one actor": (
                subject("whatif"), WhatIf(sandbox_class="c0", drain_workers=("w-big",), limit=1, min_seq=seq),
                WhatIfAnswer),
            "runtimes": (subject("runtimes"), RuntimesQuery(min_seq=seq), FleetRuntimes),
        }
        for verb, (where, query, reply) in asked.items():
            with pytest.raises(ContractError) as refused:  # a time-out would be UNAVAILABLE ("no reply ... within")
                await call(nc, where, query, reply, timeout=30)
            error = refused.value
            assert error.code is ErrorCode.RESOURCE_EXHAUSTED, f"{verb}: {error}"
            size, limit = past_max_payload(error.message)
            assert size > limit == ONE_MB, verb
            assert error.message.endswith(f"(its max_payload): {TOO_LARGE[verb]}; or raise the server's max_payload"), \
                f"{verb}: {error.message}"
        # `warmboot whatif`, which asks again for fewer actors (`fitting_whatif`), ends on the answer listing one
        said = await asyncio.to_thread(CliRunner().invoke, main, ["whatif", "--class", "c0", "--drain", "w-big",
                                                                  "--nats", url, "--prefix", prefix])
        assert said.exit_code == 1 and TOO_LARGE["whatif listing at most one actor"] in said.output, said.output
        explanation = await call(nc, subject("explain", "a0"), ExplainResume(min_seq=seq), Explanation)
        assert explanation.decision is None and explanation.refusal is not None  # it runs: nothing to place
        page = await call(nc, subject("workers"), WorkersQuery(min_seq=seq), WorkerPage)
        assert [w.worker_id for w in page.workers] == ["w-big"] and page.workers[0].actors == 3
