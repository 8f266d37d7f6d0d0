"""docs/security.md on a real nats-server secured by `warmboot nats-config`.

- Every flow of every service runs under the services' least-privilege permissions
  with no permission violation logged by the server (this is how the permission set
  was found, and what keeps it true as the services change).
- No request is answered anywhere but to an inbox: each reply-subject attack of
  issue 12 (a worker's own heartbeat whose reply names another worker's drain or
  removal, an actor's stop or resume, the event log, the heartbeat bucket; the same
  through `$SRV.PING`) changes nothing, and the services keep serving.
- The services' user cannot publish onto a request subject; an operator cannot delete
  the services' consumers nor read their inboxes; the services' output holds no password.

`warmboot serve all` runs as a child process, as it is deployed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request

import nats.errors
import pytest

from events.codec import decode_event, encode
from events.errors import ContractError
from events.schema import (
    ActorPage,
    ActorsQuery,
    WorkerPage,
    WorkersQuery,
    ErrorCode,
    CreateActor,
    DrainWorker,
    ExplainResume,
    Explanation,
    Fidelity,
    Fragmentation,
    FleetRuntimes,
    FragmentationQuery,
    Heartbeat,
    HeartbeatReply,
    PauseActor,
    RegisterReply,
    RemoveWorker,
    Resources,
    ResumeActor,
    RuntimesQuery,
    Assignment,
    SeqReply,
    SnapshotReply,
    StopActor,
    SuspendActor,
    TagSnapshot,
    UpdateTemplate,
    WorkerRemoved,
    WorkerRegistered,
)
from events.subjects import bucket_name, event_subject, service_subject, stream_name
from events.natspy.publish import flush_in_order
from services.endpoints import call
from tests.factories import last_seq
from tests.registry_helpers import CPUINFO, PROBE, agent_config, registration, wait_event
from tests.secured_helpers import WARMBOOT, Secured, Serve
from warmboot.cli_common import log_messages
from warmboot.agent import Agent

PREFIX = "sec"
STREAM = stream_name(PREFIX)
HEARTBEATS = bucket_name(PREFIX, "heartbeats")
WORKERS = ("w-1", "w-2", "w-3", "w-lost", "w-agent")


def sub(service: str, verb: str, entity: str | None = None) -> str:
    return service_subject(PREFIX, service, verb, entity)


def serve_args(secured: Secured, *more: str) -> list[str]:
    return ["all", "--nats", secured.url(secured.services), "--prefix", PREFIX,
            "--metrics-port", "0", "--metrics-host", "127.0.0.1", *more]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text; 0 if absent."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            got = head[len(name):].strip("{}")
            if ",".join(sorted(got.split(","))) == want or (not labels and not got):
                return float(value)
    return 0.0


async def history(nc, kind: str, entity: str) -> list[int]:
    """Stream sequences of the messages on one entity's subject."""
    js, subject, seqs = nc.jetstream(), event_subject(PREFIX, kind, entity), []
    while True:
        try:
            msg = await js.get_msg(STREAM, seq=(seqs[-1] if seqs else 0) + 1, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return seqs
        seqs.append(msg.seq)


async def heartbeat_entry(nc, worker_id: str) -> int:
    msg = await nc.jetstream().get_msg(f"KV_{HEARTBEATS}", subject=f"$KV.{HEARTBEATS}.{worker_id}")
    return msg.seq


def create_body(actor_id: str, **fields) -> CreateActor:
    return CreateActor(actor_id=actor_id, sandbox_class="gvisor", template_uid="tpl-1",
                       resources=Resources(cpu_millis=250, memory_mib=256), **fields)


# --- every flow under the generated permissions --------------------------------------------------------


async def test_every_flow_runs_under_least_privilege_with_no_violation(tmp_path):
    secured = Secured(tmp_path / "nats", PREFIX, workers=WORKERS, operators=("ops",), clients=("orch",)).start()
    checkpoints = ("--checkpoint-every", "3", "--checkpoint-interval", "0")
    serves = [Serve(*serve_args(secured, "--ttl", "15", *checkpoints))]
    agents: list[tuple[asyncio.Event, asyncio.Task]] = []
    clients = []
    try:
        await asyncio.to_thread(serves[0].start)
        svc = await secured.connect("svc")  # reads the streams as the services do
        orch = await secured.connect("orch")
        ops = await secured.connect("ops")
        clients += [svc, orch, ops]

        # two workers run the agent with their own credentials
        for worker_id, node in (("w-1", "node-a"), ("w-2", "node-b")):
            path = tmp_path / f"{worker_id}.toml"
            path.write_text(agent_config("v1", memory_mib=16384))
            agent = Agent(secured.url(worker_id), worker_id, node, path, prefix=PREFIX, watch_interval_s=0.05,
                          probe=PROBE)
            stop = asyncio.Event()
            agents.append((stop, asyncio.create_task(agent.run(stop))))
            await wait_event(svc.nc, PREFIX, worker_id, WorkerRegistered)
        nc = orch.nc

        # the snapshotter and the scheduler, driven by a client
        await call(nc, sub("snapshotter", "create", "a-1"), create_body("a-1", request_id="c-1"), SeqReply)
        created = await call(nc, sub("snapshotter", "create", "a-2"), create_body("a-2"), SeqReply)
        resume = ResumeActor(request_id="r-1", min_seq=created.seq)  # read-your-writes: the fold has both creates
        placed = await call(nc, sub("scheduler", "resume", "a-1"), resume, Assignment)
        again = await call(nc, sub("scheduler", "resume", "a-1"), resume, Assignment)
        assert again == placed  # a repeated request is answered, not placed again
        await call(nc, sub("snapshotter", "pause", "a-1"), PauseActor(request_id="p-1"), SnapshotReply)
        await call(nc, sub("scheduler", "resume", "a-1"), ResumeActor(min_seq=placed.seq), Assignment)
        await call(nc, sub("snapshotter", "suspend", "a-1"), SuspendActor(fidelity=Fidelity.MEMORY, uri="s3://x/a-1"),
                   SnapshotReply)
        await call(nc, sub("snapshotter", "tag", "a-1"), TagSnapshot(tag="gold"), SnapshotReply)
        await call(nc, sub("snapshotter", "create", "a-3"), create_body("a-3", source_tag="gold"), SeqReply)
        changed = await call(nc, sub("snapshotter", "update-template", "a-2"), UpdateTemplate(template_uid="tpl-2"),
                             SeqReply)
        on_worker = await call(nc, sub("scheduler", "resume", "a-2"), ResumeActor(min_seq=changed.seq), Assignment)
        await call(nc, sub("snapshotter", "stop", "a-3"), StopActor(), SeqReply)
        await call(nc, sub("scheduler", "fragmentation"), FragmentationQuery(), Fragmentation)
        offered = await call(nc, sub("scheduler", "runtimes"), RuntimesQuery(), FleetRuntimes)

        # an operator reads: explain, fragmentation, the runtimes, the log, service discovery
        await call(ops.nc, sub("scheduler", "explain", "a-1"), ExplainResume(), Explanation)
        await call(ops.nc, sub("scheduler", "fragmentation"), FragmentationQuery(), Fragmentation)
        assert await call(ops.nc, sub("scheduler", "runtimes"), RuntimesQuery(), FleetRuntimes) == offered
        read = [decode_event(data) async for _, _, _, data in log_messages(ops.nc, PREFIX, stop=changed.seq)]
        assert len(read) == changed.seq  # by batched direct gets, from the operators' own account
        stats = await ops.nc.request("$SRV.STATS.warmboot-scheduler", b"", timeout=10)
        assert json.loads(stats.data)["name"] == "warmboot-scheduler"

        # the worker that runs a-2 drains and removes itself: a-2 is released
        worker_id = on_worker.worker_id
        worker = await secured.connect(worker_id)
        clients.append(worker)
        stop, task = agents.pop(["w-1", "w-2"].index(worker_id))
        stop.set()
        await asyncio.wait_for(task, 15)
        await call(worker.nc, sub("registry", "drain", worker_id), DrainWorker(reason="maintenance"), SeqReply)
        await call(worker.nc, sub("registry", "remove", worker_id), RemoveWorker(reason="gone"), SeqReply)

        # the scheduler saves checkpoints (every 3 events); every service restarts and goes on from one
        checkpoint_bucket = bucket_name(PREFIX, "checkpoints")
        saved = await svc.nc.jetstream().subscribe(f"$O.{checkpoint_bucket}.M.>", stream=f"OBJ_{checkpoint_bucket}",
                                                   ordered_consumer=True)
        await saved.next_msg(timeout=30)  # a checkpoint's metadata: it is stored
        await saved.unsubscribe()
        assert await asyncio.to_thread(serves[0].stop) == 0
        serves.append(Serve(*serve_args(secured, "--ttl", "15", *checkpoints)))
        await asyncio.to_thread(serves[1].start)
        assert "restored the projection from checkpoint" in serves[1].output
        explained = await call(ops.nc, sub("scheduler", "explain", "a-1"),
                               ExplainResume(min_seq=await last_seq(svc.nc, PREFIX)), Explanation)
        assert explained.candidates == 1
        assert await call(nc, sub("scheduler", "resume", "a-1"), ResumeActor(), Assignment)

        # a worker that goes silent is removed as LOST by the sweeper (a registry with a heartbeat TTL of 1 s)
        assert await asyncio.to_thread(serves[1].stop) == 0
        serves.append(Serve(*serve_args(secured, "--ttl", "1", *checkpoints)))
        await asyncio.to_thread(serves[2].start)
        lost = await secured.connect("w-lost")
        await call(lost.nc, sub("registry", "register", "w-lost"), registration("w-lost"), RegisterReply)
        await lost.close()
        _, removed = await wait_event(svc.nc, PREFIX, "w-lost", WorkerRemoved)
        assert removed.reason == "LOST"

        assert secured.violations() == []
    finally:
        for stop, task in agents:
            stop.set()
            await asyncio.wait_for(task, 15)
        for client in clients:
            await client.close()
        for serve in serves:
            await asyncio.to_thread(serve.stop)
        secured.stop()
        print(*(serve.output for serve in serves), *secured.violations(), sep="\n")  # shown when it fails
    assert not [serve for serve in serves if secured.secrets["svc"] in serve.output]


# --- a deployment under attack -----------------------------------------------------------------------


class Deployment:
    """A secured server, `warmboot serve all` as the services' user, and a connection per role."""

    def __init__(self, secured: Secured, serve: Serve):
        self.secured, self.serve = secured, serve
        self.conns: dict[str, object] = {}

    async def open(self) -> "Deployment":
        for user in ("svc", "ops", "orch", "w-1", "w-2"):
            self.conns[user] = await self.secured.connect(user)
        return self

    def __getattr__(self, user: str):
        return self.conns[user.replace("_", "-")]

    def metrics(self) -> str:
        url = self.serve.line("metrics on ").split()[-1]
        return urllib.request.urlopen(url, timeout=10).read().decode()

    def dropped(self, service: str, endpoint: str, reason: str) -> float:
        return metric(self.metrics(), "warmboot_requests_dropped_total", service=service, endpoint=endpoint,
                      reason=reason)


@pytest.fixture(scope="module")
async def deployment(tmp_path_factory):
    secured = Secured(tmp_path_factory.mktemp("secured"), PREFIX, workers=WORKERS, operators=("ops",),
                      clients=("orch",)).start()
    serve = Serve(*serve_args(secured, "--ttl", "300"))
    await asyncio.to_thread(serve.start)
    d = await Deployment(secured, serve).open()
    for worker_id, node in (("w-1", "node-a"), ("w-2", "node-b")):
        await call(d.conns[worker_id].nc, sub("registry", "register", worker_id), registration(worker_id, node=node),
                   RegisterReply)
    await call(d.orch.nc, sub("snapshotter", "create", "a-1"), create_body("a-1"), SeqReply)
    await call(d.orch.nc, sub("snapshotter", "create", "a-2"), create_body("a-2"), SeqReply)
    try:
        yield d
    finally:
        for conn in d.conns.values():
            await conn.close()
        await asyncio.to_thread(serve.stop)
        secured.stop()


class State:
    """What an attack must leave alone: the stream's last sequence, the victims' histories,
    w-2's heartbeat entry."""

    @classmethod
    async def of(cls, d: Deployment) -> "State":
        state = cls()
        nc = d.svc.nc
        state.last = await last_seq(nc, PREFIX)
        state.w2 = await history(nc, "worker", "w-2")
        state.a1 = await history(nc, "actor", "a-1")
        state.kv_w2 = await heartbeat_entry(nc, "w-2")
        return state

    def __eq__(self, other: object) -> bool:
        return vars(self) == vars(other)

    def __repr__(self) -> str:
        return f"State({vars(self)})"


TARGETS = {
    "drain w-2": sub("registry", "drain", "w-2"),
    "remove w-2": sub("registry", "remove", "w-2"),
    "stop a-1": sub("snapshotter", "stop", "a-1"),
    "resume a-1": sub("scheduler", "resume", "a-1"),
    "append to w-2's history": event_subject(PREFIX, "worker", "w-2"),
    "overwrite w-2's heartbeat": f"$KV.{HEARTBEATS}.w-2",
}


@pytest.mark.parametrize("target", list(TARGETS))
async def test_a_workers_request_with_a_reply_subject_that_is_no_inbox_changes_nothing(deployment, target):
    d = deployment
    before = await State.of(d)
    dropped = d.dropped("registry", "heartbeat", "not_inbox")

    # w-1's own heartbeat, answered "to" the target: the registry must not publish there
    await d.w_1.nc.publish(sub("registry", "heartbeat", "w-1"), encode(Heartbeat()), reply=TARGETS[target])
    # the same endpoint's next request is served: the attack was handled before it (one subscription, in order)
    assert await call(d.w_1.nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply)
    assert d.dropped("registry", "heartbeat", "not_inbox") == dropped + 1
    # and every service still answers (the snapshotter and the scheduler hear about a-1 as before)
    with pytest.raises(ContractError) as refused:
        await call(d.orch.nc, sub("snapshotter", "pause", "a-1"), PauseActor(), SnapshotReply)
    assert refused.value.code.value == "FAILED_PRECONDITION"
    await call(d.ops.nc, sub("scheduler", "explain", "a-1"), ExplainResume(min_seq=before.last), Explanation)
    assert await State.of(d) == before


async def test_a_reply_subject_with_a_wildcard_is_not_answered(deployment):
    """`_INBOX.w-2.>` is an inbox prefix, but as a reply it would reach every subscription of w-2's
    that matches through a wildcard of its own: w-1 must not be able to answer into w-2's inbox."""
    d = deployment
    received: list[str] = []

    async def seen(msg) -> None:
        received.append(msg.subject)

    spy = await d.w_2.nc.subscribe("_INBOX.w-2.>", cb=seen)
    await flush_in_order(d.w_2.nc)
    dropped = d.dropped("registry", "heartbeat", "wildcard")
    replies = ("_INBOX.w-2.>", "_INBOX.w-2.*.*", "_INBOX.w-2.*", "_INBOX.>", "_INBOX.*.>")
    for reply in replies:
        await d.w_1.nc.publish(sub("registry", "heartbeat", "w-1"), encode(Heartbeat()), reply=reply)
    # served in order on one subscription: once w-1's next heartbeat is answered, those were handled
    assert await call(d.w_1.nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply)
    own = await d.w_2.nc.request(sub("registry", "heartbeat", "w-2"), encode(Heartbeat()), timeout=10)
    await spy.unsubscribe()
    assert received == [own.subject]  # w-2's own answer, and none of those meant for w-1
    assert d.dropped("registry", "heartbeat", "wildcard") == dropped + len(replies)


async def test_a_reply_subject_with_an_empty_token_is_not_answered(deployment):
    """`_INBOX..x`, `_INBOX.`, `_INBOX.w-1.` start like an inbox but are no subject: answering them
    made the services' user commit a permission violation per request, each logged, at a worker's
    will (the sign docs/security.md gives of a misconfiguration). Dropped, counted, and the server
    logs no violation of the services' user."""
    d = deployment
    violations = len(d.secured.violations())
    dropped = d.dropped("registry", "heartbeat", "empty_token")
    replies = ("_INBOX..x", "_INBOX.", "_INBOX.w-1.", "_INBOX.w-1..a", "_INBOX.w-1.a.")
    for reply in replies:
        await d.w_1.nc.publish(sub("registry", "heartbeat", "w-1"), encode(Heartbeat()), reply=reply)
    # served in order on one subscription: once w-1's next heartbeat is answered, those were handled
    assert await call(d.w_1.nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply)
    assert d.dropped("registry", "heartbeat", "empty_token") == dropped + len(replies)
    assert len(d.secured.violations()) == violations, d.secured.violations()[violations:]


async def test_a_client_cannot_name_a_reply_subject_of_the_servers_own(deployment):
    """`_R_.` is the reply prefix nats-server makes for an operator's request through its account's
    import, and the services answer it as they answer inboxes (`services.endpoints.REPLY_PREFIXES`):
    no client may name one. The server refuses such a publish itself, and no service hears it."""
    d = deployment
    before = await State.of(d)
    dropped = d.dropped("registry", "heartbeat", "not_inbox")
    await d.w_1.nc.publish(sub("registry", "heartbeat", "w-1"), encode(Heartbeat()), reply="_R_.abc.def")
    assert "publish with reply" in (await d.w_1.violation("_R_.abc.def")).lower()
    # served in order on one subscription: once w-1's next heartbeat is answered, that one was not heard
    assert await call(d.w_1.nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply)
    assert d.dropped("registry", "heartbeat", "not_inbox") == dropped
    assert await State.of(d) == before


@pytest.mark.parametrize("verb", ["PING", "INFO", "STATS"])
async def test_discovery_requests_with_a_reply_subject_that_is_no_inbox_change_nothing(deployment, verb):
    """A client (of the deployment's account, where the targets are) asks with those reply subjects.
    An operator's request crosses from its own account with a reply subject the server makes, and
    is answered into the operator's account, where none of the targets is (`test_an_operator_...`)."""
    d = deployment
    before = await State.of(d)
    dropped = [d.dropped(s, f"$SRV.{verb}", "not_inbox") for s in ("registry", "snapshotter", "scheduler")]
    for target in TARGETS.values():
        await d.orch.nc.publish(f"$SRV.{verb}", b"", reply=target)
        await d.ops.nc.publish(f"$SRV.{verb}", b"", reply=target)
    await d.orch.nc.publish(f"$SRV.{verb}", b"")  # no reply subject at all

    # each of the three services answers the next discovery request on the same subject
    inbox = d.orch.nc.new_inbox()
    answers = await d.orch.nc.subscribe(inbox, max_msgs=3)
    await d.orch.nc.publish(f"$SRV.{verb}", b"", reply=inbox)
    names = sorted([json.loads((await answers.next_msg(timeout=10)).data)["name"] for _ in range(3)])
    assert names == ["warmboot-registry", "warmboot-scheduler", "warmboot-snapshotter"]
    after = [d.dropped(s, f"$SRV.{verb}", "not_inbox") for s in ("registry", "snapshotter", "scheduler")]
    assert after == [n + len(TARGETS) for n in dropped]
    assert all(d.dropped(s, f"$SRV.{verb}", "no_reply") >= 1 for s in ("registry", "snapshotter", "scheduler"))
    assert await State.of(d) == before


async def test_a_request_without_a_reply_subject_is_not_processed(deployment):
    d = deployment
    kv_w1 = await heartbeat_entry(d.svc.nc, "w-1")
    await d.w_1.nc.publish(sub("registry", "heartbeat", "w-1"), encode(Heartbeat()))  # would put w-1's heartbeat
    await call(d.w_2.nc, sub("registry", "heartbeat", "w-2"), Heartbeat(), HeartbeatReply)  # same subscription
    assert await heartbeat_entry(d.svc.nc, "w-1") == kv_w1
    assert d.dropped("registry", "heartbeat", "no_reply") >= 1


async def test_a_reply_to_the_services_own_inbox_is_refused(deployment):
    """An inbox, but one of the services' own: answering there would feed their own
    subscriptions (JetStream replies, deliveries) with a forged message."""
    d = deployment
    dropped = d.dropped("registry", "heartbeat", "services_inbox")
    # under it, and the inbox's own name (no subscription of theirs is on it, and the rule is one)
    replies = (f"{secured_inbox()}.abc.1", secured_inbox())
    for reply in replies:
        await d.w_1.nc.publish(sub("registry", "heartbeat", "w-1"), encode(Heartbeat()), reply=reply)
    assert await call(d.w_1.nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply)
    assert d.dropped("registry", "heartbeat", "services_inbox") == dropped + len(replies)


def secured_inbox() -> str:
    from events.subjects import services_inbox

    return services_inbox(PREFIX)


async def test_the_services_user_cannot_publish_onto_a_request_subject(deployment):
    d = deployment
    before = await last_seq(d.svc.nc, PREFIX)
    for subject in (sub("registry", "drain", "w-2"), sub("registry", "register", "w-9"),
                    sub("snapshotter", "stop", "a-1"), sub("scheduler", "resume", "a-1"),
                    sub("scheduler", "fragmentation"), f"{secured_inbox()}.forged",
                    f"$JS.API.CONSUMER.DELETE.{STREAM}.any"):
        await d.svc.nc.publish(subject, b"{}")
        await d.svc.violation(subject)
    assert await last_seq(d.svc.nc, PREFIX) == before


async def test_an_operator_cannot_delete_consumers_nor_read_the_services_inboxes(deployment):
    d = deployment
    # no consumer of its own (its deliveries could be pointed at the log), and none of anyone else's
    for subject in (f"$JS.API.CONSUMER.CREATE.{STREAM}", f"$JS.API.CONSUMER.CREATE.{STREAM}.mine.{PREFIX}.ev.>",
                    f"$JS.API.CONSUMER.DELETE.{STREAM}.any", f"$JS.API.CONSUMER.DELETE.KV_{HEARTBEATS}.registry-sweeper"):
        await d.ops.nc.publish(subject, b"")
        await d.ops.violation(subject)
    assert (await d.svc.nc.jetstream().consumer_info(f"KV_{HEARTBEATS}", "registry-sweeper")).name

    # its account holds only operators' inboxes, and it hears only under its own prefix: no reply
    # meant for a worker or the services reaches it
    await d.ops.nc.subscribe("_INBOX.>")
    await d.ops.violation("_INBOX.>")
    seen: list[str] = []
    arrived = asyncio.Event()

    async def on_msg(msg):
        seen.append(msg.subject)
        arrived.set()

    spy = await d.ops.nc.subscribe("_INBOX.ops.>", cb=on_msg)
    await flush_in_order(d.ops.nc)
    await d.svc.nc.jetstream().stream_info(STREAM)  # its reply goes to the services' inbox
    await call(d.w_1.nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply)
    await d.svc.nc.publish("_INBOX.marker", b"")  # an inbox subject of the deployment's account
    await flush_in_order(d.svc.nc)
    # its own request, after all of the above: its reply is the first thing its inboxes get
    mine = await d.ops.nc.request("$SRV.PING.warmboot-registry", b"", timeout=10)

    async def spied() -> None:
        while mine.subject not in seen:
            arrived.clear()
            await arrived.wait()

    await asyncio.wait_for(spied(), 10)
    await spy.unsubscribe()
    assert seen == [mine.subject], seen


@pytest.mark.parametrize("user, inbox", [
    ("w-1", "_INBOX.w-2.>"), ("w-1", "_INBOX.*.>"), ("w-1", "_INBOX.orch.>"),
    ("orch", "_INBOX.w-1.>"), ("orch", "_INBOX.*.>"), ("orch", "_INBOX.>"),
])
async def test_no_worker_nor_client_hears_another_users_replies(deployment, user, inbox):
    """A worker hears only under `_INBOX.<its id>.`, a client only under `_INBOX.<its name>.`
    (docs/security.md, Roles): a subscription to another user's inboxes, or to everyone's by a
    wildcard, is refused by the server, and w-2's answer reaches no one but w-2. Kills the mutants
    of the generated permissions that let a worker subscribe `_INBOX.*.>` and a client `_INBOX.>`
    (each would read the answers meant for others, and learn the inboxes to aim its own at)."""
    d = deployment
    conn = d.conns[user]
    heard: list[str] = []

    async def overhear(msg) -> None:
        heard.append(msg.subject)

    spy = await conn.nc.subscribe(inbox, cb=overhear)
    assert "subscription" in (await conn.violation(inbox)).lower()
    answer = await d.w_2.nc.request(sub("registry", "heartbeat", "w-2"), encode(Heartbeat()), timeout=10)
    assert json.loads(answer.data)["ttl_s"] > 0
    await flush_in_order(conn.nc)  # anything the server sent `user` before this round trip has arrived
    await spy.unsubscribe()
    assert heard == []


async def test_an_operator_publishes_onto_no_inbox(deployment):
    """An operator may publish only what its account imports: not onto an inbox of its own account,
    where another operator's answers arrive (it could forge the answers of another operator's read of
    the log there), nor its own. Kills the mutant of `operator_permissions` that also allows `_INBOX.>`."""
    d = deployment
    for subject in ("_INBOX.ops.x", "_INBOX.other.x"):
        await d.ops.nc.publish(subject, b"{}")
        await d.ops.violation(subject)  # refused by the server


async def test_the_agent_works_with_worker_credentials_and_no_output_holds_a_password(deployment, tmp_path):
    d = deployment
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    agent = await asyncio.create_subprocess_exec(
        WARMBOOT, "agent", "--nats", d.secured.url("w-3"), "--worker-id", "w-3", "--node", "node-c",
        "--config", str(path), "--prefix", PREFIX, "--cpuinfo", str(CPUINFO), "--arch", "amd64", "-v",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    try:
        await wait_event(d.svc.nc, PREFIX, "w-3", WorkerRegistered)
    finally:
        agent.terminate()
        agent_output = (await asyncio.wait_for(agent.communicate(), 20))[0].decode()
    assert "agent w-3 stopped" in agent_output

    # the operator commands: a server that is not there, a wrong password
    dead = d.secured.url("ops").replace(f":{d.secured.server.port}", ":1")
    cli = []
    for url in (dead, d.secured.url("ops").replace(d.secured.secrets["ops"], d.secured.secrets["ops"][::-1])):
        proc = await asyncio.create_subprocess_exec(
            WARMBOOT, "fragmentation", "--nats", url, "--prefix", PREFIX,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        cli.append((await asyncio.wait_for(proc.communicate(), 30))[0].decode())
        assert proc.returncode != 0
    assert "cannot reach NATS at nats://127.0.0.1:1" in cli[0]

    outputs = {"serve": d.serve.output, "agent": agent_output, "cli": "\n".join(cli)}
    assert "serving registry, snapshotter, scheduler on nats://127.0.0.1:" in outputs["serve"]
    for user, secret in d.secured.secrets.items():
        for name, text in outputs.items():
            assert secret not in text and secret[::-1] not in text, f"{user}'s password in the {name} output"


async def test_a_clients_commands_print_their_answer_though_it_cannot_read_the_log(deployment):
    """A client's credentials may drive actors but not read the log. The command's answer is printed
    all the same (it said `error: no event stream` after the resume was placed, and a retry was refused
    as RUNNING), its runtimes labelled as a scheduler says them (`scheduler.runtimes`: these have no
    names, so their ids), and nothing on stderr: until 2026-12-06 the labels came from the log alone,
    and stderr said they were not looked up (tests/test_surface_edges.py has a client's named ones)."""
    from click.testing import CliRunner

    from warmboot.cli import main

    env = {"NATS_URL": deployment.secured.url("orch"), "WARMBOOT_PREFIX": PREFIX}
    for args, says in ((["actor", "resume", "a-2"], "DECISION"), (["explain", "a-1"], "SUMMARY")):
        result = await asyncio.to_thread(CliRunner().invoke, main, args, env=env)
        assert result.exit_code == 0, (args, result.output)
        assert says in result.stdout and "rt-" in result.stdout, result.stdout
        assert result.stderr == "", result.stderr
        assert deployment.secured.secrets["orch"] not in result.output
    history = [decode_event(m.data) async for m in _history_messages(deployment, "actor", "a-2")]
    assert [type(e).__name__ for e in history][-1] == "ActorPlaced"  # placed once: no retry was needed


async def test_a_clients_create_warns_of_labels_and_a_size_no_worker_has(deployment):
    """`actor create` warns when no worker of the class has the labels `--selector` asks for, or is big
    enough (README). It learned both from the log, which a client's credentials may not read: the
    orchestrator, the role that creates actors, got a note that the labels were not checked, and
    nothing of the size (a trial of the docs). Both now come from the scheduler (its explain of the
    actor, and the class's `largest` in its fragmentation), which a client may ask."""
    from click.testing import CliRunner

    from warmboot.cli import main

    env = {"NATS_URL": deployment.secured.url("orch"), "WARMBOOT_PREFIX": PREFIX}
    args = ["actor", "create", "a-sel", "--class", "gvisor", "--template", "tpl-1", "--cpu", "100", "--memory", "64",
            "--selector", "zone=nowhere"]
    result = await asyncio.to_thread(CliRunner().invoke, main, args, env=env)
    assert result.exit_code == 0 and "actor/a-sel created" in result.stdout, result.output
    assert result.stderr == ("warning: no undrained worker of class gvisor has the labels zone=nowhere; resuming a-sel "
                             "is refused until one does (`warmboot workers -o wide` shows their labels)\n"), result.stderr
    args = ["actor", "create", "a-big", "--class", "gvisor", "--template", "tpl-1", "--cpu", "100", "--memory", "512Gi"]
    result = await asyncio.to_thread(CliRunner().invoke, main, args, env=env)
    assert result.exit_code == 0 and "actor/a-big created" in result.stdout, result.output
    assert result.stderr.startswith("warning: no registered worker of class gvisor is big enough for a-big: the "
                                    "largest has "), result.stderr


async def test_a_command_that_reads_the_log_is_told_at_once_that_a_clients_credentials_may_not(deployment):
    """`audit replay` reads the log, which a client's credentials may not (docs/security.md): NATS
    refuses the question at once, and the command says so, naming what was refused, rather than
    waiting out the question's 5 s and saying "nats: timeout" (found by a trial of the docs). A text
    command that labels runtimes prints its answer, labelled as a scheduler says them; `actor show`
    says what the snapshotter's status does (tests/test_surface_edges.py); `actor list` and `workers`
    ask a scheduler since 2026-12-06 (the tests below: `workers` was this test's command)."""
    from click.testing import CliRunner

    from warmboot.cli import main

    env = {"NATS_URL": deployment.secured.url("orch"), "WARMBOOT_PREFIX": PREFIX}
    for args in (["audit", "replay"],):
        result = await asyncio.to_thread(CliRunner().invoke, main, args, env=env)
        assert result.exit_code == 1, (args, result.output)
        assert f"cannot read the event stream {STREAM}" in result.stderr, result.stderr
        assert f"does not let these credentials publish to $JS.API.STREAM.INFO.{STREAM}" in result.stderr, \
            result.stderr
    explained = await asyncio.to_thread(CliRunner().invoke, main, ["explain", "a-1"], env=env)
    assert explained.exit_code == 0 and "SUMMARY" in explained.stdout, explained.output
    assert explained.stderr == "", explained.stderr


async def test_a_client_and_an_operator_ask_a_scheduler_what_worker_show_prints(deployment, monkeypatch):
    """`worker show` asks a scheduler (`scheduler.worker`, a project addition) before it folds the log: an
    operator's credentials may ask it (its account imports it: `nats_config.operator_imports`), and a
    client's, which may not read the log, get the same answer (the command said it could not read the
    log). Nothing of the log is folded for either."""
    from click.testing import CliRunner

    from tests.factories import log_reads
    from warmboot.cli import main

    read = log_reads(monkeypatch)
    shown = {}
    for user in ("ops", "orch"):
        env = {"NATS_URL": deployment.secured.url(user), "WARMBOOT_PREFIX": PREFIX}
        result = await asyncio.to_thread(CliRunner().invoke, main, ["worker", "show", "w-1", "-o", "json"], env=env)
        assert result.exit_code == 0 and result.stderr == "", (user, result.output)
        shown[user] = json.loads(result.stdout)
        gone = await asyncio.to_thread(CliRunner().invoke, main, ["worker", "show", "nobody"], env=env)
        assert gone.exit_code == 1, (user, gone.output)
        assert gone.stderr == "error: NOT_FOUND worker_id: worker 'nobody' is not registered\n", (user, gone.stderr)
    assert (shown["ops"]["worker_id"], shown["ops"]["node"]) == ("w-1", "node-a")
    assert shown["orch"] == shown["ops"]
    assert read == []


async def test_a_client_and_an_operator_list_the_actors_a_scheduler_says(deployment):
    """`scheduler.actors` (a project addition) answers a client's credentials and an operator's (whose
    account imports it: nats-config). `actor list` asks it: a client's lists the actors (it said that
    these credentials may not read the log, before 2026-12-06), and both print the same."""
    from click.testing import CliRunner

    from warmboot.cli import main

    pages = [await call(deployment.conns[user].nc, sub("scheduler", "actors"), ActorsQuery(limit=1), ActorPage)
             for user in ("orch", "ops")]
    assert pages[0] == pages[1] and [row.actor_id for row in pages[0].actors] == ["a-1"], pages
    assert pages[0].next_after == "a-1"
    shown = []
    for user in ("orch", "ops"):
        env = {"NATS_URL": deployment.secured.url(user), "WARMBOOT_PREFIX": PREFIX}
        result = await asyncio.to_thread(CliRunner().invoke, main, ["actor", "list", "-o", "json"], env=env)
        assert result.exit_code == 0 and result.stderr == "", (user, result.output)
        shown.append(json.loads(result.stdout))
    assert shown[0] == shown[1] and {"a-1", "a-2"} <= {view["actor_id"] for view in shown[0]}, shown


async def test_a_client_and_an_operator_list_the_workers_a_scheduler_says(deployment, monkeypatch):
    """`scheduler.workers` (a project addition) answers a client's credentials and an operator's (whose
    account imports it: nats-config). `workers` asks it: a client's lists the workers (it said that these
    credentials may not read the log, before 2026-12-06), an unknown --class is the same error for both,
    and both print the same, folding nothing of the log."""
    from click.testing import CliRunner

    from tests.factories import log_reads
    from warmboot.cli import main

    pages = [await call(deployment.conns[user].nc, sub("scheduler", "workers"), WorkersQuery(limit=1), WorkerPage)
             for user in ("orch", "ops")]
    assert pages[0] == pages[1] and [w.worker_id for w in pages[0].workers] == ["w-1"], pages
    read = log_reads(monkeypatch)
    shown = []
    for user in ("orch", "ops"):
        env = {"NATS_URL": deployment.secured.url(user), "WARMBOOT_PREFIX": PREFIX}
        result = await asyncio.to_thread(CliRunner().invoke, main, ["workers", "-o", "json"], env=env)
        assert result.exit_code == 0 and result.stderr == "", (user, result.output)
        shown.append(json.loads(result.stdout))
        unknown = await asyncio.to_thread(CliRunner().invoke, main, ["workers", "--class", "kata"], env=env)
        assert unknown.exit_code == 1 and "no worker has registered the sandbox class 'kata' (registered: " \
            in unknown.stderr, (user, unknown.output)
    assert shown[0] == shown[1] and "w-1" in {row["worker_id"] for row in shown[0]}, shown
    assert read == []


async def test_the_client_library_signs_in_with_a_clients_url_alone(deployment):
    """`Client.connect` with a client's URL hears its replies where the permissions let it
    (`_INBOX.<user>.`), as the CLI does: with nats-py's own inbox it was refused its subscription,
    and every request ended UNAVAILABLE after its retries."""
    from warmboot.client import Client

    async with await Client.connect(deployment.secured.url("orch"), PREFIX, timeout=5, attempts=1) as wb:
        answer = await wb.fragmentation("gvisor")
        assert [c.sandbox_class for c in answer.classes] == ["gvisor"]


async def test_the_commands_the_client_and_the_agent_sign_in_with_the_environments_user_and_password(
        deployment, tmp_path, monkeypatch):
    """$NATS_USER/$NATS_PASSWORD sign in a command, `Client.connect` and the agent whose URL names
    no user, and give the inbox prefix the permissions let that user hear (`_INBOX.<user>`), as
    they did the services alone: the commands and the client were refused the sign-in, and the agent
    retried for ever. A URL that names a user is what a command line says, and wins."""
    from click.testing import CliRunner

    from warmboot.cli import main
    from warmboot.client import Client

    d = deployment
    bare = d.secured.url()  # no user in it
    env = {"NATS_URL": bare, "WARMBOOT_PREFIX": PREFIX, "NATS_INBOX_PREFIX": None,
           "NATS_USER": "ops", "NATS_PASSWORD": d.secured.secrets["ops"]}
    shown = await asyncio.to_thread(CliRunner().invoke, main, ["workers", "-o", "json"], env=env)
    assert shown.exit_code == 0, shown.output
    assert {"w-1", "w-2"} <= {row["worker_id"] for row in json.loads(shown.stdout)}
    wrong = await asyncio.to_thread(CliRunner().invoke, main, ["workers"], env={**env, "NATS_PASSWORD": "wrong"})
    assert wrong.exit_code == 1 and "refuses the sign-in" in wrong.stderr, wrong.output
    # the URL's user and password win over the environment's (here a wrong one)
    named = await asyncio.to_thread(CliRunner().invoke, main, ["workers", "-o", "json"],
                                    env={**env, "NATS_URL": d.secured.url("ops"), "NATS_PASSWORD": "wrong"})
    assert named.exit_code == 0, named.output

    monkeypatch.delenv("NATS_INBOX_PREFIX", raising=False)
    monkeypatch.setenv("NATS_USER", "orch")
    monkeypatch.setenv("NATS_PASSWORD", d.secured.secrets["orch"])
    async with await Client.connect(bare, PREFIX, timeout=5, attempts=1) as wb:
        assert wb.nc.connected_url is not None and (await wb.fragmentation("gvisor")).classes

    monkeypatch.setenv("NATS_USER", "w-agent")
    monkeypatch.setenv("NATS_PASSWORD", d.secured.secrets["w-agent"])
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    agent = Agent(bare, "w-agent", "node-e", path, prefix=PREFIX, probe=PROBE)
    stop = asyncio.Event()
    running = asyncio.create_task(agent.run(stop))
    try:
        _, registered = await asyncio.wait_for(wait_event(d.svc.nc, PREFIX, "w-agent", WorkerRegistered), 30)
        assert registered.node == "node-e"
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)


async def test_a_process_that_keeps_trying_a_refused_sign_in_logs_which_credentials_to_check(
        deployment, tmp_path, monkeypatch):
    """The agent and the services (`warmboot.connection.connect`, as `serve` connects) keep trying a
    refused sign-in (a password may be being rotated); the line each logs once said only
    "Authorization Violation" (found by a trial of the docs). It now says which credentials were
    refused, here $NATS_USER/$NATS_PASSWORD, and never the password."""
    import logging

    from warmboot.connection import connect

    heard: list[str] = []
    said = asyncio.Event()

    class Heard(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:  # on the loop's thread: the loop is the caller
            line = record.getMessage()
            if "Authorization Violation" in line:
                heard.append(line)
                said.set()

    handler = Heard(logging.WARNING)
    logging.getLogger("warmboot").addHandler(handler)
    monkeypatch.setenv("NATS_USER", "w-agent")
    monkeypatch.setenv("NATS_PASSWORD", "not-the-password")
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    try:
        for start in (lambda stop: Agent(deployment.secured.url(), "w-agent", "node-e", path, prefix=PREFIX,
                                         probe=PROBE).run(stop),
                      lambda stop: connect(deployment.secured.url(), "warmboot-registry")):
            heard.clear()
            said.clear()
            stop = asyncio.Event()
            trying = asyncio.ensure_future(start(stop))
            try:
                await asyncio.wait_for(said.wait(), 30)
            finally:
                stop.set()
                trying.cancel()
                await asyncio.wait({trying}, timeout=30)
            assert "(check $NATS_USER/$NATS_PASSWORD)" in heard[0], heard
            assert "not-the-password" not in heard[0]
    finally:
        logging.getLogger("warmboot").removeHandler(handler)


async def test_an_agent_with_another_workers_credentials_stops_saying_so(deployment, tmp_path):
    """w-1's credentials running the agent of w-2: NATS refuses every publish (and the inbox). The
    agent ends at once with the reason (it asked again for ever, a timeout each time), and nothing
    of w-2's changes."""
    from warmboot.agent_config import ConfigError

    before = await State.of(deployment)
    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    agent = Agent(deployment.secured.url("w-1"), "w-2", "node-b", path, prefix=PREFIX, probe=PROBE)
    with pytest.raises(ConfigError) as refused:
        await asyncio.wait_for(agent.run(asyncio.Event()), 30)
    assert "NATS refuses this agent: nats: permissions violation" in str(refused.value)
    assert "Are the credentials those of worker 'w-2'" in str(refused.value)
    assert deployment.secured.secrets["w-1"] not in str(refused.value)
    assert await State.of(deployment) == before


async def test_a_wrong_password_is_said_at_once_and_not_retried(deployment, tmp_path):
    """The server refuses the sign-in: the client and the CLI say so at once, as FAILED_PRECONDITION
    (not retried), naming the server but not the password; it took the whole timeout and came back
    as UNAVAILABLE, "cannot reach NATS", sometimes naming only the reset that follows the refusal."""
    from warmboot.client import Client

    url = deployment.secured.url("orch").replace(deployment.secured.secrets["orch"], "not-the-password")
    started = time.monotonic()
    with pytest.raises(ContractError) as refused:
        await Client.connect(url, PREFIX, connect_timeout=20)
    assert time.monotonic() - started < 10
    assert refused.value.code is ErrorCode.FAILED_PRECONDITION
    assert "refuses the sign-in" in refused.value.message and "not-the-password" not in refused.value.message
    with pytest.raises(ContractError) as no_seed:
        await Client.connect(deployment.secured.url(), PREFIX, nkeys_seed=str(tmp_path / "none.nk"))
    assert no_seed.value.code is ErrorCode.FAILED_PRECONDITION and "no nkey seed file" in no_seed.value.message
    from click.testing import CliRunner

    from warmboot.cli import main
    shown = await asyncio.to_thread(CliRunner().invoke, main, ["workers", "--prefix", PREFIX], env={"NATS_URL": url})
    assert shown.exit_code == 1 and "error: FAILED_PRECONDITION: NATS at " in shown.stderr, shown.output
    assert "refuses the sign-in" in shown.stderr and "not-the-password" not in shown.output


async def _history_messages(d, kind: str, entity: str):
    js = d.svc.nc.jetstream()
    for seq in await history(d.svc.nc, kind, entity):
        yield await js.get_msg(STREAM, seq=seq)


async def test_a_trace_destination_aims_nothing_where_the_worker_may_not_publish(deployment):
    """NATS message tracing (`Nats-Trace-Dest`) makes the server publish a trace of the message to a
    subject the publisher names: a worker naming another's inbox, another's history or a request
    subject is refused it, and nothing reaches there (found safe by an audit; kept as a guard)."""
    d = deployment
    before = await State.of(d)
    heard: list[str] = []

    async def overhear(msg) -> None:
        heard.append(msg.subject)

    spy = await d.w_2.nc.subscribe("_INBOX.w-2.>", cb=overhear)
    await flush_in_order(d.w_2.nc)
    for dest in ("_INBOX.w-2.trace", event_subject(PREFIX, "worker", "w-2"), sub("registry", "drain", "w-2")):
        await d.w_1.nc.publish(sub("registry", "heartbeat", "w-1"), encode(Heartbeat()), reply="_INBOX.w-1.x",
                               headers={"Nats-Trace-Dest": dest})
    # w-1's next request is answered after the server routed those (one connection, in order), and
    # w-2's flush comes after anything the server sent it before the answer
    assert await call(d.w_1.nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply)
    await flush_in_order(d.w_2.nc)
    await spy.unsubscribe()
    assert heard == []
    assert await State.of(d) == before


@pytest.mark.parametrize("user", ["ops", "orch"])
async def test_no_operator_nor_client_drains_or_removes_a_worker(deployment, user):
    """Under the generated permissions a worker is drained or removed only with its own credential:
    an operator's (its account imports no registry subject) and a client's are refused by the
    server, and nothing of w-2 changes. docs/security.md said an operator could always drain or
    remove a worker that floods; the way is to withdraw that worker's credential (found by an audit)."""
    d = deployment
    before = await State.of(d)
    conn = d.conns[user]
    for verb, body in (("drain", DrainWorker()), ("remove", RemoveWorker())):
        subject = sub("registry", verb, "w-2")
        await conn.nc.publish(subject, encode(body), reply=f"_INBOX.{user}.x")
        await conn.violation(subject)  # refused by the server: no service ever hears it
    assert await State.of(d) == before


async def test_no_permission_violation_but_the_ones_the_tests_provoked(deployment):
    """Run last: over all the attacks above, the services' user was refused only where a
    test published as it on purpose (the request subjects and its own inbox)."""
    d = deployment
    await call(d.w_1.nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply)
    provoked = {sub("registry", "drain", "w-2"), sub("registry", "register", "w-9"), sub("snapshotter", "stop", "a-1"),
                sub("scheduler", "resume", "a-1"), sub("scheduler", "fragmentation"), f"{secured_inbox()}.forged",
                f"$JS.API.CONSUMER.DELETE.{STREAM}.any"}
    svc = [line for line in d.secured.violations() if "user:svc" in line]
    assert {line.rsplit('Subject "', 1)[1].rstrip('"') for line in svc} <= provoked, svc


def _hpub(subject: bytes, reply: bytes, head: bytes, body: bytes) -> bytes:
    return b"HPUB %s %s %d %d\r\n%s%s\r\n" % (subject, reply, len(head), len(head) + len(body), head, body)


# What a client's own connection can send, written raw (nats-py would not build these): each one
# ended the read loop of the services' connection (nats-py decodes subjects, reply subjects and
# status lines strictly), which then stayed connected and took its share of every request.
HOSTILE_FRAMES = {
    "w-1: a reply subject that is not UTF-8": ("w-1", lambda: b"PUB %s _INBOX.w-1.\xff\xfe 2\r\n{}\r\n" % (
        sub("registry", "heartbeat", "w-1").encode())),
    "w-1: a status line that is not ASCII": ("w-1", lambda: _hpub(
        sub("registry", "heartbeat", "w-1").encode(), b"_INBOX.w-1.x", b"NATS/1.0 503 \xff\xfe\r\n\r\n", b"{}")),
    "w-1: a header block that ends at NATS/1.0": ("w-1", lambda: _hpub(
        sub("registry", "heartbeat", "w-1").encode(), b"_INBOX.w-1.x", b"NATS/1.0", b"{}")),
    "orch: a subject that is not UTF-8": ("orch", lambda: b"PUB %s _INBOX.orch.x 2\r\n{}\r\n" % (
        sub("scheduler", "explain", "a-1").encode() + b"\xff\xfe")),
}


@pytest.mark.parametrize("attack", list(HOSTILE_FRAMES))
async def test_a_message_nats_py_cannot_read_silences_no_service(deployment, attack):
    d = deployment
    before = await State.of(d)
    user, frame = HOSTILE_FRAMES[attack]
    nc = d.conns[user].nc
    await flush_in_order(nc)
    for _ in range(3):
        nc._transport.write(frame())  # after everything this connection sent, before what it sends next
    # the same connection's next requests reach the services after the attack: they are answered
    if user == "orch":
        await call(nc, sub("scheduler", "explain", "a-1"), ExplainResume(min_seq=before.last), Explanation, timeout=10)
    assert await call(d.w_1.nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply, timeout=10)
    with pytest.raises(ContractError) as refused:
        await call(d.orch.nc, sub("snapshotter", "pause", "a-1"), PauseActor(), SnapshotReply, timeout=10)
    assert refused.value.code.value == "FAILED_PRECONDITION"
    await call(d.ops.nc, sub("scheduler", "explain", "a-1"), ExplainResume(min_seq=before.last), Explanation,
               timeout=10)
    assert await State.of(d) == before


async def test_discovery_answers_no_request_headers_and_a_big_header_block_is_dropped_unread(deployment):
    """nats.micro's discovery handlers answered with the request's own headers: a client's header
    block as large as the server allows made the answer larger than that, and the server cut
    the services' connection (a process serving one service: closed for good). Discovery now
    answers without them, and a message whose header block is over 16 KiB is dropped where
    the services read it, before anything parses it."""
    d = deployment
    nc = d.orch.nc
    info = await nc.request("$SRV.INFO.warmboot-registry", b"", headers={"X-Padding": "a" * 8000}, timeout=10)
    assert json.loads(info.data)["name"] == "warmboot-registry" and not info.headers

    heard: list[bytes] = []

    async def answered(msg) -> None:
        heard.append(msg.data)

    inbox = nc.new_inbox()
    spy = await nc.subscribe(inbox, cb=answered)
    await nc.publish("$SRV.INFO", b"", reply=inbox, headers={"X-Padding": "a" * (nc.max_payload - 200)})
    await flush_in_order(nc)
    d.serve.line("dropped a message nats-py could not read", anywhere=True)  # every service's connection
    assert await call(d.w_1.nc, sub("registry", "heartbeat", "w-1"), Heartbeat(), HeartbeatReply, timeout=10)
    await call(nc, sub("scheduler", "explain", "a-1"), ExplainResume(), Explanation, timeout=10)
    await spy.unsubscribe()
    assert heard == []  # no answer to the padded one
    assert "Maximum Payload Violation" not in "\n".join(d.secured.server.log)


@pytest.mark.parametrize("who", ["orch", "ops"])
async def test_services_run_with_credentials_that_are_not_the_services_stop_at_once_saying_why(deployment, who):
    """`warmboot serve` given a client's or an operator's credentials waited out its store's 30 s
    budget in silence, the server having refused its first request at once, then ended in 80 lines
    of traceback ending `JetStream unavailable for 30s (last error: TimeoutError())` (a trial of the
    docs). Now the server's refusal ends it at once, in one line naming the subject refused and the
    credentials to use, exit status 1."""
    done = await asyncio.to_thread(
        subprocess.run, [WARMBOOT, "serve", "scheduler", "--nats", deployment.secured.url(who), "--prefix", PREFIX],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, (done.returncode, done.stderr)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: creating stream {STREAM}: NATS does not let these credentials publish to "
                           f"$JS.API.STREAM.CREATE.{STREAM}; the services need the services' credentials"), last
    assert "--services-user" in last and "Traceback" not in done.stderr, done.stderr
    assert deployment.secured.secrets[who] not in done.stderr


async def test_an_operator_s_resume_or_pause_is_refused_naming_the_question_it_asks_first(deployment):
    """An operator may not resume nor pause. The command asks the snapshotter first which life or
    placement it names, and that question's refusal was all it said (`FAILED_PRECONDITION: NATS does
    not let these credentials publish to sec.snapshotter.status.a-1`), as if the status call were the
    command (a trial). It now says it was the question asked first, and nothing is sent."""
    from click.testing import CliRunner

    from warmboot.cli import main

    env = {"NATS_URL": deployment.secured.url("ops"), "WARMBOOT_PREFIX": PREFIX}
    before = [m.data async for m in _history_messages(deployment, "actor", "a-1")]
    for args, what in ((["actor", "resume", "a-1"], "life"), (["actor", "pause", "a-1"], "placement"),
                       (["actor", "stop", "a-1"], "life")):
        result = await asyncio.to_thread(CliRunner().invoke, main, args, env=env)
        assert result.exit_code == 1, (args, result.output)
        assert (f"the command asks the snapshotter first which {what} a-1 is in (its fence), and NATS does not let "
                f"these credentials publish to {PREFIX}.snapshotter.status.a-1") in result.stderr, result.stderr
    assert [m.data async for m in _history_messages(deployment, "actor", "a-1")] == before  # nothing written
