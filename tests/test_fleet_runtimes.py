"""The fleet's runtimes, as every view labels them: a scheduler's `runtimes` answer (a project addition),
else the log's worker histories folded by the command itself.

Every command that printed a runtime's label (`actor resume`, `pause`, `show`, `explain`,
`fragmentation`, `audit actor`) folded every worker's history for it: at 10,000 workers an `actor
show` read 33,000 events, 3.4 s on the development machine (measured by hand on `up --demo --workers
10000`). One request now answers it from the scheduler's fold; the log's fold stays as the way when no
scheduler says (none runs, or one of an earlier version).
"""

from __future__ import annotations

import asyncio

from events.schema import WorkerDrained, WorkerRemoved
from services.scheduler.projection import Projection
from services.scheduler.runtimes import offered_runtimes
from tests.factories import AT, CLASS, entry, registered, runtime, version
from warmboot.client import Client
from warmboot.cmd_views import asked_runtimes, fleet, runtime_labels, runtimes_from

V0, V1, V1B, V2, V9 = (version(b) for b in ("v0", "v1", "v1b", "v2", "v9"))
EDGED = entry(runtime(V2, "runsc-v2", compatible=(V1,)), (runtime(V1B, "runsc-v1b", compatible=(V0,)),))
FLEET = (
    registered("w-1", EDGED),
    registered("w-4", EDGED),  # configured as w-1: one class entry for both
    registered("w-2", entry(runtime(V2, "runsc"))),  # the same version under another name
    WorkerDrained(at=AT, worker_id="w-2"),  # drained: still registered, its runtimes still offered
    registered("w-3", entry(runtime(V9, "gone"))),
    WorkerRemoved(at=AT, worker_id="w-3"),  # removed: its runtime no longer offered
    registered("m-1", entry(runtime(V2, "fc-v2"), sandbox_class="microvm")),  # V2 of another class
)
# (class, version) -> (names, run) as the fleet above offers them
EXPECTED = {
    (CLASS, V0): ([], False),  # accepted through an edge only
    (CLASS, V1): ([], False),
    (CLASS, V1B): (["runsc-v1b"], True),
    (CLASS, V2): (["runsc", "runsc-v2"], True),
    ("microvm", V2): (["fc-v2"], True),
}


def folded(*events) -> Projection:
    projection = Projection()
    for seq, event in enumerate(events, 1):
        projection.apply(seq, event)
    return projection


def test_the_runtimes_offered_are_every_registered_worker_s_with_their_names_and_edges():
    answer = offered_runtimes(folded(*FLEET))
    assert {(r.sandbox_class, r.version): (r.names, r.run) for r in answer.runtimes} == EXPECTED
    assert len(answer.runtimes) == len(EXPECTED)  # each once
    labels = runtimes_from(answer)
    assert labels.label(CLASS, V1B) == "runsc-v1b"
    assert labels.label(CLASS, V2).startswith("runsc@")  # two names for one runtime: told apart by digits
    assert labels.label("microvm", V2) == "fc-v2"
    assert labels.known[next(k for k in labels.known if labels.known[k].version == V0)].run is False
    assert offered_runtimes(folded()).runtimes == []


async def test_a_scheduler_says_the_runtimes_the_log_holds_and_without_one_the_labels_come_from_the_log(
        nats_url, nc, prefix, writer, replicas):
    last = await asyncio.to_thread(writer.write, *FLEET)
    # no scheduler: nobody says them, and the labels are the log's (the way before the endpoint)
    assert await asked_runtimes(nc, prefix) is None
    from_log = await runtime_labels(nc, prefix)
    assert from_log.complete
    await replicas()
    answer = await Client(nc, prefix).runtimes(min_seq=last)
    assert answer == offered_runtimes(await fleet(nc, prefix))  # the scheduler's fold, the log's
    assert {(r.sandbox_class, r.version): (r.names, r.run) for r in answer.runtimes} == EXPECTED
    asked = await asked_runtimes(nc, prefix)
    assert asked is not None
    assert {key: asked.label(*key) for key in EXPECTED} == {key: from_log.label(*key) for key in EXPECTED}
