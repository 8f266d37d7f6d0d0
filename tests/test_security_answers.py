"""A worker's credential cannot take the scheduler's fleet-wide answers away from everyone else
(docs/security.md, "What a worker's credential may write"), on a real server secured by `warmboot
nats-config`: the registration it sends is one NATS request, and the answers built from it must still
reach the clients and operators who ask."""

from __future__ import annotations


import pytest

from events.codec import encode
from events.errors import ContractError
from events.schema import FleetRuntimes, RegisterReply, RuntimesQuery
from events.subjects import service_subject
from services.endpoints import call
from tests.factories import last_seq
from tests.registry_helpers import registration
from tests.secured_helpers import Secured, served

PREFIX = "ans"


def sub(service: str, verb: str, entity: str | None = None) -> str:
    return service_subject(PREFIX, service, verb, entity)


def version(n: int, pad: int) -> dict:
    return {"schema_version": "v1", "attributes": [{"key": "architecture", "value": "amd64"},
                                                    {"key": "gvisor_asset_hash", "value": f"{n:x}".rjust(pad, "0")}]}


def many_runtimes(edges: int, pad: int) -> list[dict]:
    """8 classes of 33 runtimes, each accepting `edges` versions of its own: every version distinct."""
    counter = iter(range(1, 1 << 30))
    classes = []
    for c in range(8):
        runtimes = [{"version": version(next(counter), pad), "compatible_versions": [version(next(counter), pad)
                                                                                for _ in range(edges)]}
                    for _ in range(33)]
        classes.append({"sandbox_class": f"c{c}", "default_runtime": runtimes[0], "restorable_runtimes": runtimes[1:]})
    return classes


@pytest.fixture
async def deployment(tmp_path):
    secured = Secured(tmp_path / "secured", PREFIX, workers=("w-1", "w-big"), operators=("ops",),
                      clients=("orch",))
    # as docs/security.md's server configuration has it: nats-server's default max_payload (1 MB)
    secured.server.extra_config += "max_payload: 1MB\n"
    async with served(secured, ("w-1", "w-big", "ops", "orch")) as conns:
        yield secured, conns


async def test_a_workers_registration_leaves_no_ones_runtimes_question_unanswered(deployment):
    """A registration the registry takes (every field within the schema's bounds, under the server's
    max_payload) holds thousands of distinct runtime versions; `scheduler.runtimes` names each once, with
    more around it than the registration did (about 1.4 times its bytes). Its answer, past max_payload,
    was sent to nobody: every client's and operator's question went unanswered, each waiting out its
    time-out, for as long as that worker was registered. Now it is refused at once, naming why."""
    secured, conns = deployment
    await call(conns["w-1"].nc, sub("registry", "register", "w-1"), registration("w-1"), RegisterReply)
    big = registration("w-big", node="node-big", classes=many_runtimes(edges=26, pad=2))
    assert len(encode(big)) < 900_000  # a request NATS carries, a body the registry decodes, an event the log stores
    await call(conns["w-big"].nc, sub("registry", "register", "w-big"), big, RegisterReply, timeout=30)
    svc = await secured.connect(secured.services)
    seq = await last_seq(svc.nc, PREFIX)
    await svc.close()
    for user in ("orch", "ops"):
        with pytest.raises(ContractError) as refused:  # answered at once: the caller is not left to time out
            await call(conns[user].nc, sub("scheduler", "runtimes"), RuntimesQuery(min_seq=seq), FleetRuntimes,
                       timeout=10)
        assert refused.value.code.value == "RESOURCE_EXHAUSTED", f"{user}: {refused.value.message}"
        assert "max_payload" in refused.value.message
