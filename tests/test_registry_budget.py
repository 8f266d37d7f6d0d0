"""What a worker's requests may write (`services.registry.budget`): the budget's arithmetic on
its own, then over a real bus: past the budget a request that would write is refused
RESOURCE_EXHAUSTED and writes nothing, what writes nothing is still answered, two replicas
under hundreds of concurrent requests write at most their two budgets (read from the log), and
an agent whose budget is spent registers once it refills instead of ending. And how many of one
worker's requests a replica works on at once: a flood of them is refused past a few, so that it
does not hold up every other worker's."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from contextlib import asynccontextmanager

import msgspec
import nats
import pytest
from prometheus_client import REGISTRY

from eventsourcing.persistence import IntegrityError

from events.errors import ContractError, unavailable
from events.compat import same_version
from events.probe import probe_version
from events.schema import ErrorCode, RuntimeChanged, WorkerRegistered, WorkerRemoved, WorkerUpdated
from events.subjects import bucket_name
from services.registry.budget import FREE, WriteBudget
from services.registry.service import IN_FLIGHT_PER_WORKER
from tests.factories import last_seq
from tests.registry_helpers import (raw_request, registration, running_registry, runtime, wait_event,
                                    worker_events)
from tests.registry_helpers import AMD, CPUINFO, PROBE, a_machine, agent_config, without_cpu_features
from tests.test_agent import agent_running, config
from warmboot.agent import Agent
from warmboot.client import Client


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- the arithmetic ---------------------------------------------------------------------------


def test_a_budget_gives_its_burst_then_one_write_per_interval():
    clock = Clock()
    budget = WriteBudget(3, 10.0, clock)
    for _ in range(3):
        budget.take("w-1")
    with pytest.raises(ContractError) as refused:
        budget.take("w-1")
    assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED and refused.value.field == "worker_id"
    assert "'w-1'" in refused.value.message and "try again in 10.0s" in refused.value.message
    assert budget.left("w-1") == 0.0  # the refusal took nothing
    budget.take("w-2")  # each worker has its own
    clock.now += 4.0
    with pytest.raises(ContractError, match="try again in 6.0s"):
        budget.take("w-1")
    clock.now += 6.0
    budget.take("w-1")
    with pytest.raises(ContractError):
        budget.take("w-1")
    clock.now += 1_000_000  # refilled, never past the burst
    assert budget.left("w-1") == 3.0


def test_a_flood_of_refusals_is_said_once_until_the_worker_writes_again():
    clock = Clock()
    budget = WriteBudget(1, 10.0, clock)
    budget.take("w-1")
    assert budget.first_refusal("w-1") and not budget.first_refusal("w-1")
    assert budget.first_refusal("w-2")
    clock.now += 10.0
    budget.take("w-1")
    assert budget.first_refusal("w-1")


def test_a_ticket_pays_for_the_writes_made_and_gets_back_a_failed_one():
    clock = Clock()
    budget = WriteBudget(2, 10.0, clock)
    ticket = budget.ticket("w-1")
    with pytest.raises(RuntimeError):
        with ticket.paying():
            assert budget.left("w-1") == 1.0
            raise RuntimeError("the append was refused")
    assert budget.left("w-1") == 2.0  # given back
    with ticket.paying():  # the command's next run
        pass
    assert budget.left("w-1") == 1.0
    clock.now += 5.0  # half a write earned back
    with pytest.raises(ContractError):
        with ticket.paying():
            with ticket.paying():
                pass
    assert budget.left("w-1") == 1.5  # the refused inner write took nothing, the outer was given back
    clock.now += 1_000
    with pytest.raises(RuntimeError):
        with ticket.paying():
            raise RuntimeError
    assert budget.left("w-1") == 2.0  # never past the burst
    with FREE.paying():  # no worker's request: nothing to pay
        pass


def test_a_write_cancelled_on_its_way_is_given_back():
    """A request pays only for what it wrote, at most (services/registry/budget.py): a write that fails is
    given back, one whose answer was lost too, and so is one cancelled on its way (the request given up,
    the replica stopping), a BaseException rather than an error. Kills the mutant of `Ticket.paying`
    that gives back only on an Exception."""
    budget = WriteBudget(1, 10.0, Clock())
    with pytest.raises(asyncio.CancelledError):
        with budget.ticket("w-1").paying():
            raise asyncio.CancelledError
    assert budget.left("w-1") == 1.0
    with budget.ticket("w-1").paying():  # its next run pays for it
        pass
    assert budget.left("w-1") == 0.0


def test_no_limit_and_bad_settings():
    unlimited = WriteBudget(0, 10.0)
    for _ in range(10_000):
        unlimited.take("w-1")
    assert len(unlimited) == 0
    for burst, interval in [(-1, 10.0), (1, 0.0), (1, -1.0), (1, float("inf")), (1, float("nan"))]:
        with pytest.raises(ValueError):
            WriteBudget(burst, interval)


def test_only_workers_below_a_whole_budget_are_kept():
    clock = Clock()
    budget = WriteBudget(2, 1.0, clock)
    for i in range(5000):
        budget.take(f"w-{i}")
        clock.now += 0.001
    # each pass over 4,096 takes forgets those refilled by then: not all 5,000 are held
    clock.now += 1.0
    for i in range(5000, 9096):
        budget.take(f"w-{i}")
    assert len(budget) < 4200


# --- over the bus -------------------------------------------------------------------------------


def over_budget() -> float:
    return REGISTRY.get_sample_value("warmboot_registry_writes_over_budget_total") or 0.0


async def replies_held(nc, prefix: str) -> int:
    return (await nc.jetstream().stream_info(f"KV_{bucket_name(prefix, 'replies')}")).state.messages


async def test_past_its_budget_a_worker_s_request_that_would_write_is_refused_and_writes_nothing(
        nats_url, nc, prefix, caplog):
    async with running_registry(nats_url, prefix, writes=WriteBudget(3, 3600.0)):
        answered = []
        first = await raw_request(nc, prefix, "register", "w-1", registration("w-1", request_id="r-0"))
        answered.append(("r-0", first[0]))
        for rid in ("r-1", "r-2"):  # unchanged: each keeps its answer in the reply bucket
            reply, _ = await raw_request(nc, prefix, "register", "w-1", registration("w-1", request_id=rid))
            assert reply["outcome"] == "UNCHANGED", reply
            answered.append((rid, reply))
        log_end, kept = await last_seq(nc, prefix), await replies_held(nc, prefix)
        refusals = over_budget()

        for body in (registration("w-1", request_id="r-3"),  # would keep an answer
                     registration("w-1", labels={"zone": "b"})):  # would append an update
            reply, _ = await raw_request(nc, prefix, "register", "w-1", body)
            assert reply["error"]["code"] == "RESOURCE_EXHAUSTED" and reply["error"]["field"] == "worker_id", reply
            assert "try again in" in reply["error"]["message"]
        assert over_budget() - refusals == 2
        assert await last_seq(nc, prefix) == log_end and await replies_held(nc, prefix) == kept

        # what writes nothing is answered all the same: the requests answered, repeated; a heartbeat
        for rid, reply in answered:
            again, _ = await raw_request(nc, prefix, "register", "w-1", registration("w-1", request_id=rid))
            assert again == reply
        beat, _ = await raw_request(nc, prefix, "heartbeat", "w-1", {})
        assert beat["ttl_s"] == 15
        said = [r.getMessage() for r in caplog.records if "spent its write budget" in r.getMessage()]
        assert len(said) == 1 and "worker w-1 " in said[0], said  # once, naming the worker

        # an operator still drains and removes the worker that spent its budget (once in a life each: free)...
        drained, _ = await raw_request(nc, prefix, "drain", "w-1", {"reason": "it floods", "request_id": "d-1"})
        assert "seq" in drained, drained
        again, _ = await raw_request(nc, prefix, "drain", "w-1", {"reason": "again", "request_id": "d-2"})
        assert again["error"]["code"] == "RESOURCE_EXHAUSTED", again  # changes nothing, would keep an answer
        removed, _ = await raw_request(nc, prefix, "remove", "w-1", {"reason": "it floods"})
        assert "seq" in removed, removed
        # ...and a new life is a registration, which pays
        reply, _ = await raw_request(nc, prefix, "register", "w-1", registration("w-1"))
        assert reply["error"]["code"] == "RESOURCE_EXHAUSTED", reply
        kinds = [type(e).__name__ for _, e in await worker_events(nc, prefix, "w-1")]
        assert kinds == ["WorkerRegistered", "WorkerDrained", "WorkerRemoved"], kinds
        # another worker has a budget of its own
        other, _ = await raw_request(nc, prefix, "register", "w-2", registration("w-2"))
        assert other["outcome"] == "REGISTERED"


async def test_a_refusal_s_mark_pays_once_and_its_repeat_is_refused_as_before(nats_url, nc, prefix):
    """A registration refused on the worker's state (a change of class) with a revision leaves a mark
    (it was sent, `_sent_before`): that write pays; the same request again finds its mark and gets the
    same refusal, not a "try again"; another such request past the budget is refused for it, unmarked."""
    async with running_registry(nats_url, prefix, writes=WriteBudget(2, 3600.0)):
        await raw_request(nc, prefix, "register", "w-1", registration("w-1", request_id="r-0", revision=1))
        adds = registration("w-1", request_id="r-x", revision=2, classes=[
            {"sandbox_class": "gvisor", "default_runtime": runtime("v1")},
            {"sandbox_class": "microvm", "default_runtime": runtime("k1")}])
        for _ in range(3):
            reply, _ = await raw_request(nc, prefix, "register", "w-1", adds)
            assert (reply["error"]["code"], reply["error"]["field"]) == ("FAILED_PRECONDITION", "sandbox_classes")
        kept = await replies_held(nc, prefix)
        reply, _ = await raw_request(nc, prefix, "register", "w-1", {**adds, "request_id": "r-y", "revision": 3})
        assert (reply["error"]["code"], reply["error"]["field"]) == ("RESOURCE_EXHAUSTED", "worker_id"), reply
        assert await replies_held(nc, prefix) == kept


async def test_a_write_that_fails_or_loses_a_race_is_given_back(nats_url, nc, prefix):
    """The request pays for what it wrote: an append that fails (UNAVAILABLE) leaves the budget as it
    was, so its retry is decided; one that loses a race to another writer is decided again and pays
    once."""
    async with running_registry(nats_url, prefix, writes=WriteBudget(3, 3600.0, Clock())) as registry:
        await raw_request(nc, prefix, "register", "w-1", registration("w-1"))
        store = registry.store
        fence, save = store._fence, store.save_async
        failures = [unavailable("the test's outage")]

        async def failing_once(*args):
            if failures:
                raise failures.pop()
            return await fence(*args)

        store._fence = failing_once
        flip = registration("w-1", labels={"zone": "b"}, request_id="r-b")
        reply, _ = await raw_request(nc, prefix, "register", "w-1", flip)
        assert reply["error"]["code"] == "UNAVAILABLE", reply
        assert registry.writes.left("w-1") == 2.0
        reply, _ = await raw_request(nc, prefix, "register", "w-1", flip)  # its retry
        assert reply["outcome"] == "UPDATED", reply
        assert registry.writes.left("w-1") == 1.0

        lost = [IntegrityError("the test's lost race")]

        async def losing_once(*args, **kwargs):
            if lost:
                raise lost.pop()
            return await save(*args, **kwargs)

        store.save_async = losing_once
        reply, _ = await raw_request(nc, prefix, "register", "w-1", registration("w-1", labels={"zone": "c"}))
        assert reply["outcome"] == "UPDATED" and not lost, reply
        assert registry.writes.left("w-1") == 0.0  # one write for the request, not two


async def test_two_replicas_under_hundreds_of_concurrent_writes_write_at_most_their_budgets(nats_url, nc, prefix):
    """Every request would write (a label of its own): each replica lets its budget's worth through,
    whichever of the two gets them; every one let through is in the log, answered with its event,
    and every other one is refused for the budget (or, with 200 at once, for the replica's working on
    too many of the worker's already: `IN_FLIGHT_PER_WORKER`), none lost and none written twice."""
    burst = 6
    async with running_registry(nats_url, prefix, writes=WriteBudget(burst, 3600.0)), \
            running_registry(nats_url, prefix, own_link=True, writes=WriteBudget(burst, 3600.0)):
        for round_ in range(3):
            worker = f"w-{round_}"
            bodies = [registration(worker, labels={"flip": str(i)}, request_id=f"{worker}-r{i}") for i in range(200)]
            replies = await asyncio.gather(*(raw_request(nc, prefix, "register", worker, b) for b in bodies))
            accepted = {b["request_id"]: r for b, (r, _) in zip(bodies, replies) if "error" not in r}
            refused = [r for r, _ in replies if "error" in r]
            assert all((r["error"]["code"], r["error"].get("field")) in (("RESOURCE_EXHAUSTED", "worker_id"),
                                                                         ("RESOURCE_EXHAUSTED", None))
                       for r in refused), refused[:3]
            assert any(r["error"].get("field") == "worker_id" for r in refused)  # the budget refused some
            assert 1 <= len(accepted) <= 2 * burst and len(accepted) + len(refused) == 200

            written = [(seq, e) for seq, e in await worker_events(nc, prefix, worker)
                       if isinstance(e, (WorkerRegistered, WorkerUpdated))]
            assert sorted(e.request_id for _, e in written) == sorted(accepted), "written once each, nothing else"
            at = {e.request_id: seq for seq, e in written}
            assert all(reply["seq"] == at[rid] for rid, reply in accepted.items())


async def test_an_agent_whose_budget_is_spent_registers_once_it_refills(nats_url, nc, prefix, tmp_path):
    """The agent's registration refused RESOURCE_EXHAUSTED at its start is sent again (the registry's
    "try again"), not the end of the agent."""
    path = tmp_path / "agent.toml"
    path.write_text(config("v1"))
    clock = Clock()  # stands still until the test moves it: no write is earned back meanwhile
    budget = WriteBudget(1, 1.0, clock)
    refused = asyncio.Event()
    take = budget.take

    def noting(worker_id: str) -> None:
        try:
            take(worker_id)
        except ContractError:
            refused.set()
            raise

    budget.take = noting
    async with running_registry(nats_url, prefix, writes=budget):
        # another registration of w-a spends its one write; the agent's, which differs, must wait for the next
        await raw_request(nc, prefix, "register", "w-a", registration("w-a", labels={"zone": "spent"}))
        after = await last_seq(nc, prefix)
        agent = Agent(nats_url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe=PROBE)
        async with agent_running(agent) as task:
            noted = asyncio.ensure_future(refused.wait())
            await asyncio.wait({task, noted}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            assert refused.is_set() and not task.done(), task
            clock.now += 3600  # an hour on: the budget is whole again
            _, updated = await wait_event(nc, prefix, "w-a", WorkerUpdated, after=after)
            assert updated.labels == {"zone": "a"}
            assert not task.done()


async def test_the_default_budget_lets_an_agent_s_day_through(nats_url, nc, prefix):
    """The default (100 at once, then one every 10 s) refuses none of a day's ordinary requests:
    a registration, fifty edits in a burst, a drain and a removal, and a registration again."""
    async with running_registry(nats_url, prefix):
        requests = [("register", registration("w-1", request_id=str(uuid.uuid4())))]
        requests += [("register", registration("w-1", labels={"edit": str(i)})) for i in range(50)]
        requests += [("drain", {"reason": "maintenance"}), ("remove", {"reason": "retired"}),
                     ("register", registration("w-1"))]
        for verb, body in requests:
            reply, _ = await raw_request(nc, prefix, verb, "w-1", body)
            assert "error" not in reply, (verb, reply)


async def test_a_worker_whose_cpu_changed_while_its_budget_is_spent_is_removed_not_left_registered(
        nats_url, nc, prefix, tmp_path):
    """The machine moves to another CPU while the registry takes none of the worker's registrations
    (its budget spent): the registration in force claims the old CPU, where its images would be sent.
    The agent removes the worker at once (a removal is free) instead of waiting with it registered,
    and registers the CPU it has now, a new life, once the budget refills."""
    agent, cpuinfo, _ = a_machine(tmp_path, nats_url, prefix)
    async with one_write_budget(nats_url, prefix, agent) as (clock, _, task):
        seq, registered = await wait_event(nc, prefix, "w-a", WorkerRegistered)  # its one write
        shutil.copy(AMD, cpuinfo)
        seq, removed = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        assert "cannot register the CPU its machine has now" in removed.reason and not task.done()
        clock.now += 10.0  # one write earned back
        _, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=seq)
        here = probe_version(AMD.read_text(), "amd64", "gvisor", {"gvisor_asset_hash": "v1"})
        assert same_version(again.sandbox_classes[0].default_runtime.version, here)
        assert not same_version(registered.sandbox_classes[0].default_runtime.version, here)


# --- how many of one worker's requests a replica works on at once -----------------------------------------------


@asynccontextmanager
async def a_held_flood(registry, nc, prefix: str, count: int):
    """`count` registrations of w-evil sent at once to `registry`, the first held by its decision until the
    block ends: (the flood's replies to come)."""
    held, release = asyncio.Event(), asyncio.Event()
    decide = registry.store.register

    async def holding(request, *more):
        if request.worker_id == "w-evil":
            held.set()
            await release.wait()
        return await decide(request, *more)

    registry.store.register = holding
    flood = [asyncio.ensure_future(raw_request(nc, prefix, "register", "w-evil",
                                               registration("w-evil", labels={"n": str(i)})))
             for i in range(count)]
    try:
        await asyncio.wait_for(held.wait(), 10)
        yield flood
    finally:
        release.set()


async def test_a_flood_of_one_worker_s_registrations_does_not_hold_up_another_s(nats_url, nc, prefix):
    """300 registrations of one worker at once, the first held by its decision: a replica works on
    IN_FLIGHT_PER_WORKER of them (the first, the others waiting for the worker's lock) and refuses the
    rest at once, RESOURCE_EXHAUSTED, so another worker's registration is answered while the first is
    still held (before, the flood held every slot of the endpoint, and it waited behind them). What is
    written is what was answered, read from the log."""
    async with running_registry(nats_url, prefix, writes=WriteBudget(0)) as registry:
        await raw_request(nc, prefix, "register", "w-evil", registration("w-evil"))
        after = await last_seq(nc, prefix)
        async with a_held_flood(registry, nc, prefix, 300) as flood:
            reply, _ = await raw_request(nc, prefix, "register", "w-good", registration("w-good"), timeout=5)
            assert reply["outcome"] == "REGISTERED", reply
        replies = [r for r, _ in await asyncio.gather(*flood)]
        refused = [r["error"] for r in replies if "error" in r]
        assert {(e["code"], e.get("field")) for e in refused} == {("RESOURCE_EXHAUSTED", None)}
        answered = [r["seq"] for r in replies if "error" not in r]
        assert len(answered) == IN_FLIGHT_PER_WORKER, len(answered)
        written = [s for s, e in await worker_events(nc, prefix, "w-evil") if s > after]
        assert sorted(set(answered)) == written  # each answered registration wrote its change, nothing else


async def test_an_operator_removes_a_worker_whose_credential_floods_its_registrations(nats_url, nc, prefix):
    """A flood of registrations of one worker keeps IN_FLIGHT_PER_WORKER of them at the replica (one held
    by its decision, the others waiting for the worker's lock): a removal by hand, sent meanwhile, is
    taken once the lock is free, not refused with the flood (each endpoint counts its own: found by a
    review, docs/security.md)."""
    async with running_registry(nats_url, prefix, writes=WriteBudget(0)) as registry:
        for worker_id in ("w-evil", "w-good"):
            await raw_request(nc, prefix, "register", worker_id, registration(worker_id))
        async with a_held_flood(registry, nc, prefix, 50) as flood:
            removal = asyncio.ensure_future(raw_request(nc, prefix, "remove", "w-evil", {"reason": "it floods"}))
            # answered after the removal was read (the replica reads its requests in order): the removal
            # was refused by then, or waits for the worker's lock
            await raw_request(nc, prefix, "heartbeat", "w-good", {})
            assert not removal.done() or "error" not in removal.result()[0], removal.result()
        await asyncio.gather(*flood)
        reply, _ = await removal
        assert "error" not in reply, reply
        _, removed = await wait_event(nc, prefix, "w-evil", WorkerRemoved)
        assert removed.reason == "it floods"


async def test_an_operator_s_removal_refused_behind_a_worker_s_own_removals_is_sent_again(nats_url, nc, prefix):
    """A worker's credential may remove its own id: IN_FLIGHT_PER_WORKER removals of it at the replica (one
    held by its decision, the others waiting for the worker's lock; each carrying a revision below the
    registration's, so each is refused, as copies sent long ago would be) have a removal by hand
    refused, RESOURCE_EXHAUSTED with no field. The client sends it again (the same request id) instead of
    failing the operator's command, and it removes the worker once the flood is answered (found by a
    review: the CLI failed)."""
    async with running_registry(nats_url, prefix) as registry:
        await raw_request(nc, prefix, "register", "w-evil", registration("w-evil", revision=100))
        held, release = asyncio.Event(), asyncio.Event()
        decide = registry.store.remove

        async def holding(worker_id, request, *more):
            if request.reason == "its own":
                held.set()
                await release.wait()
            return await decide(worker_id, request, *more)

        registry.store.remove = holding
        flood = [asyncio.ensure_future(raw_request(nc, prefix, "remove", "w-evil", {"reason": "its own", "revision": 1}))
                 for _ in range(IN_FLIGHT_PER_WORKER)]
        operator = await nats.connect(nats_url, inbox_prefix="_INBOX.operator")
        tap = await nc.subscribe("_INBOX.operator.>")  # the operator's replies, as they reach it
        try:
            await asyncio.wait_for(held.wait(), 10)
            # answered after the flood was read (the replica reads its requests in order): all of it in flight
            await raw_request(nc, prefix, "heartbeat", "w-evil", {})
            removal = asyncio.ensure_future(Client(operator, prefix).remove("w-evil", "the operator's"))
            refusal = msgspec.json.decode((await tap.next_msg(timeout=10)).data)
            assert refusal["error"]["code"] == "RESOURCE_EXHAUSTED" and refusal["error"].get("field") is None, refusal
        finally:
            release.set()
            await tap.unsubscribe()
        try:
            reply = await asyncio.wait_for(removal, 20)
        finally:
            await operator.close()
        replies = [r for r, _ in await asyncio.gather(*flood)]
        assert {r["error"]["code"] for r in replies} == {"FAILED_PRECONDITION"}, replies
        removed = [(seq, event.reason) for seq, event in await worker_events(nc, prefix, "w-evil")
                   if isinstance(event, WorkerRemoved)]
        assert removed == [(reply.seq, "the operator's")]


async def test_a_flood_of_one_worker_s_heartbeats_does_not_hold_up_another_s(nats_url, nc, prefix):
    """The same with heartbeats, whose puts are held: another worker's heartbeat is answered meanwhile,
    and the flood's are refused past IN_FLIGHT_PER_WORKER, RESOURCE_EXHAUSTED."""
    async with running_registry(nats_url, prefix, writes=WriteBudget(0)) as registry:
        for worker_id in ("w-evil", "w-good"):
            await raw_request(nc, prefix, "register", worker_id, registration(worker_id))
        held, release = asyncio.Event(), asyncio.Event()
        beat = registry.liveness.beat

        async def holding(worker_id: str) -> None:
            if worker_id == "w-evil":
                held.set()
                await release.wait()
            await beat(worker_id)

        registry.liveness.beat = holding
        flood = [asyncio.ensure_future(raw_request(nc, prefix, "heartbeat", "w-evil", {})) for _ in range(300)]
        try:
            await asyncio.wait_for(held.wait(), 10)
            reply, _ = await raw_request(nc, prefix, "heartbeat", "w-good", {}, timeout=5)
            assert "error" not in reply, reply
        finally:
            release.set()
        replies = [r for r, _ in await asyncio.gather(*flood)]
        refused = [r["error"] for r in replies if "error" in r]
        assert {(e["code"], e.get("field")) for e in refused} == {("RESOURCE_EXHAUSTED", None)}
        assert len(replies) - len(refused) == IN_FLIGHT_PER_WORKER


# --- the agent's registrations while its budget is spent and its machine changes ----------------------------------


def made_of(registration) -> tuple[str, str]:
    """(the CPU, the asset) a registration's default runtime was probed on."""
    version = registration.sandbox_classes[0].default_runtime.version
    asset = next(a.value for a in version.attributes if a.key == "gvisor_asset_hash")
    for name, cpuinfo in (("intel", CPUINFO), ("amd", AMD)):
        if same_version(version, probe_version(cpuinfo.read_text(), "amd64", "gvisor", {"gvisor_asset_hash": asset})):
            return name, asset
    return "?", asset


class Asked:
    """The registrations a registry replica decides (refused for the budget or not), awaitable."""

    def __init__(self, registry) -> None:
        self.seen: list[tuple[str, str]] = []
        self.changed = asyncio.Event()
        decide = registry.store.register

        async def noted(request, *more):
            self.seen.append(made_of(request))
            self.changed.set()
            return await decide(request, *more)

        registry.store.register = noted

    async def until(self, wanted: tuple[str, str], after: int = 0, within: float = 30.0) -> int:
        """The position of the first registration made of `wanted` from position `after` on."""
        deadline = asyncio.get_running_loop().time() + within
        while True:
            for i in range(after, len(self.seen)):
                if self.seen[i] == wanted:
                    return i
            self.changed.clear()
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0 or not await wait_set(self.changed, left):
                raise AssertionError(f"no registration of {wanted} within {within}s: {self.seen[after:]}")


@asynccontextmanager
async def one_write_budget(nats_url: str, prefix: str, agent: Agent):
    """`agent` running against a registry replica that gives each worker one write, then one every 10 s
    of the test's clock (it stands still until the test moves it): (the clock, the registry's decisions,
    the agent's run)."""
    clock = Clock()
    async with running_registry(nats_url, prefix, writes=WriteBudget(1, 10.0, clock)) as registry:
        asked = Asked(registry)
        async with agent_running(agent) as task:
            yield clock, asked, task


async def wait_set(event: asyncio.Event, timeout: float) -> bool:
    """Whether `event` is set within `timeout` seconds."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        return False
    return True


async def test_a_registration_waiting_for_the_budget_is_made_again_when_the_cpu_changes(nats_url, nc, prefix,
                                                                                          tmp_path):
    """An edit waits for the budget; the machine moves to another CPU meanwhile. The edit is made again
    on the CPU the machine has now (it was sent as first made, and registered a CPU the machine no longer
    had once the budget refilled: found by a review), and the worker, registered with the old CPU, is
    removed meanwhile."""
    agent, cpuinfo, path = a_machine(tmp_path, nats_url, prefix)
    async with one_write_budget(nats_url, prefix, agent) as (clock, asked, task):
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)  # its one write
        path.write_text(agent_config("v2"))
        await asked.until(("intel", "v2"))  # the edit, refused for the budget, waits
        shutil.copy(AMD, cpuinfo)
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        clock.now += 10.0
        _, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=seq)
        assert made_of(again) == ("amd", "v2") and not task.done()


async def test_a_cpu_that_changes_back_while_the_worker_is_removed_is_registered_as_it_is(nats_url, nc, prefix,
                                                                                           tmp_path):
    agent, cpuinfo, _ = a_machine(tmp_path, nats_url, prefix)
    async with one_write_budget(nats_url, prefix, agent) as (clock, asked, _):
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        shutil.copy(AMD, cpuinfo)
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        amd = await asked.until(("amd", "v1"))  # removed, it asks with the CPU it has now
        shutil.copy(CPUINFO, cpuinfo)
        await asked.until(("intel", "v1"), after=amd + 1)  # and with the CPU it has again
        clock.now += 10.0
        _, again = await wait_event(nc, prefix, "w-a", WorkerRegistered, after=seq)
        assert made_of(again) == ("intel", "v1")


async def test_one_failed_read_of_the_machine_while_the_budget_is_spent_removes_nothing(nats_url, nc, prefix,
                                                                                         tmp_path):
    """A read of the machine that fails says nothing of its CPU (the agent's RESTAMP waits for a second
    one): a registration waiting for the budget goes on waiting through it."""
    agent, cpuinfo, path = a_machine(tmp_path, nats_url, prefix)
    judged_unreadable = asyncio.Event()
    stale = agent._why_stale

    def noting() -> str | None:  # the agent judging, on a refusal for the budget, whether to wait
        if agent._machine()[1].text is None:  # on a read that found no cpuinfo
            judged_unreadable.set()
        return stale()

    agent._why_stale = noting
    async with one_write_budget(nats_url, prefix, agent) as (clock, asked, _):
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        path.write_text(agent_config("v2"))
        await asked.until(("intel", "v2"))
        cpuinfo.unlink()
        await asyncio.wait_for(judged_unreadable.wait(), 30)
        shutil.copy(CPUINFO, cpuinfo)
        clock.now += 10.0
        changed, _ = await wait_event(nc, prefix, "w-a", RuntimeChanged, after=seq)
        kinds = [type(e).__name__ for s, e in await worker_events(nc, prefix, "w-a") if seq < s <= changed]
        assert "WorkerRemoved" not in kinds, kinds


async def test_a_registration_made_again_goes_above_the_one_it_replaces(nats_url, nc, prefix, tmp_path):
    """The machine reads AMD, then Intel again, while the registration of AMD is held by a stalled replica
    (unanswered). The agent makes the registration in force again, and sends it above the AMD one's
    revision: that copy, decided late, is refused, and the registry keeps Intel (with the revision in
    force, the late copy won: found by a review)."""
    agent, cpuinfo, _ = a_machine(tmp_path, nats_url, prefix)
    async with running_registry(nats_url, prefix, writes=WriteBudget(0)) as registry:
        held: list = []
        amd_held, intel_after = asyncio.Event(), asyncio.Event()
        decide = registry.store.register

        async def stalled(request, *more):  # a replica that takes the AMD copy and decides it later
            if made_of(request)[0] == "amd":
                held.append(request)
                amd_held.set()
                raise unavailable("the test's stalled replica")
            decided = await decide(request, *more)
            if held:
                intel_after.set()
            return decided

        registry.store.register = stalled
        async with agent_running(agent) as task:
            seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
            shutil.copy(AMD, cpuinfo)
            await asyncio.wait_for(amd_held.wait(), 30)
            shutil.copy(CPUINFO, cpuinfo)
            await asyncio.wait_for(intel_after.wait(), 30)  # Intel again, decided
            registry.store.register = decide
            reply, _ = await raw_request(nc, prefix, "register", "w-a", msgspec.to_builtins(held[0]))
            assert (reply["error"]["code"], reply["error"]["field"]) == ("FAILED_PRECONDITION", "revision"), reply
            changes = [e for _, e in await worker_events(nc, prefix, "w-a") if isinstance(e, RuntimeChanged)]
            assert all(made_of(e)[0] == "intel" for e in changes) and not task.done()


LITERAL = """
[capacity]
cpu_millis = 4000
memory_mib = 8192

[[sandbox_classes]]
sandbox_class = "gvisor"

[sandbox_classes.default_runtime]
name = "gvisor-v1"
attributes = { architecture = "amd64", gvisor_asset_hash = "v1" }
cpu_masked = true
"""


async def test_a_registration_the_new_read_makes_alike_is_not_removed_while_the_budget_is_spent(
        nats_url, nc, prefix, tmp_path):
    """A runtime given literally that masks the CPU (no CPU keys) registers the same on any CPU: the probe
    reading another CPU while the budget is spent leaves the worker registered (it was removed: found by a
    review)."""
    agent, cpuinfo, path = a_machine(tmp_path, nats_url, prefix)
    path.write_text(LITERAL)
    async with one_write_budget(nats_url, prefix, agent) as (_, asked, task):
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)  # its one write
        start = len(asked.seen)
        shutil.copy(AMD, cpuinfo)  # the agent sends its registration again: refused for the budget
        first = await asked.until(("?", "v1"), after=start)
        await asked.until(("?", "v1"), after=first + 1)  # and again: it waited, judged the first refusal
        kinds = [type(e).__name__ for s, e in await worker_events(nc, prefix, "w-a") if s > seq]
        assert "WorkerRemoved" not in kinds and not agent.withdrawn and not task.done(), kinds


async def test_a_machine_unreadable_while_a_registration_waits_for_the_budget_is_removed_at_the_second_read(
        nats_url, nc, prefix, tmp_path):
    """The probe stops reading a key of the machine while an edit waits for the budget: as with no
    registration on its way, the second read that cannot make the registration in force removes the
    worker (it stayed registered for as long as the budget was spent: found by a review)."""
    agent, cpuinfo, path = a_machine(tmp_path, nats_url, prefix)
    async with one_write_budget(nats_url, prefix, agent) as (_, asked, _):
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        path.write_text(agent_config("v2"))
        await asked.until(("intel", "v2"))  # the edit waits for the budget
        without_cpu_features(cpuinfo)  # for good
        _, removed = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        assert "cannot read this machine twice in a row" in removed.reason, removed.reason


async def test_a_read_that_failed_while_a_registration_waited_is_one_read_not_two(tmp_path):
    """The agent's judgement alone (no registry is asked): a read of the machine that made nothing,
    noted while a registration waited for the budget (`_why_stale`), is the first of two for the
    RESTAMP asked on that same read next, not the second (the worker was removed after one failed read:
    found by a review)."""
    agent, cpuinfo, _ = a_machine(tmp_path, "nats://127.0.0.1:1", "t")
    agent.probe_interval_s = 3600.0  # one read of the machine throughout
    agent.registration = agent._read_config()
    agent._in_force_of = agent._desired_of  # in force: Intel, v1
    without_cpu_features(cpuinfo)
    agent._probe_read = None  # the next look reads the machine: cpu_features unreadable
    assert agent._why_stale() is None  # on a refusal for the budget: the first failed read, noted
    removed: list[str] = []

    async def remove_self(reason: str, stop: asyncio.Event) -> None:
        removed.append(reason)

    agent._remove_self = remove_self
    assert await agent._restamp(asyncio.Event()) is None  # the next watch's RESTAMP, on the same read
    assert removed == [] and not agent.withdrawn
    agent._probe_read = None  # a second read, failing too
    assert await agent._restamp(asyncio.Event()) is None
    assert len(removed) == 1 and agent.withdrawn
