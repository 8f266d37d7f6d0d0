"""The scheduler's decisions, on the real Projection, against an oracle of CONTRACT section 3's
resume rules written from the contract's text (and docs/contract.md's recorded choices) alone,
over a model of the fleet the oracle keeps itself (`tests/fleet_oracle.py`; no ClassEntry, no
index, no code of `services.scheduler` in the oracle).

Seeded lives of a small fleet (two classes; runtimes of two architectures, amd64 also spelt x86_64,
versions that differ in one attribute key, one value or the schema only, a version naming no
architecture, attributes in any order; restorable runtimes, one-way `compatible_versions` edges,
overheads fixed and per GiB; capacities that run short; labels) and its actors (no snapshot,
golden, from a tag, paused LOCAL images, suspends and promotions of any fidelity, foreign
snapshots of any stamp, template and place, template changes, stops, reverts, requests'
selectors), with registrations, runtime changes, node/capacity/label changes, drains, removals
(releases late or on time), placements and releases that consume room, and bookings in flight.

Each resume decided by `decide` is checked: a placement must be one the contract allows (the
image loads there at that fidelity, through the pin's own version or an edge, `matched_version`
the version that matched; the stamp's architecture kept without memory; a LOCAL image on its
node; nothing below `min_fidelity`; the worker undrained, of the class, meeting every selector,
with room for the resources and the pinned runtime's overhead); a MEMORY one whenever a
compatible worker has room, in rule 2's best tier that has room; a refusal only when nothing
fits, with the code the contract gives (rule 5's FAILED_PRECONDITION naming revert, 4a's
FAILED_PRECONDITION or RESOURCE_EXHAUSTED, rule 6's INVALID_ARGUMENT). A remembered refusal
(`refusals`) must equal a fresh decision; a fresh fold of the log and a checkpoint decide alike;
a request id's answer from the log (`check_retry`) is given exactly when its worker still carries
it out. (Written by an audit, which found no decision breaking these rules: kept as a guard.)
"""

from __future__ import annotations

from tests.fleet_oracle import fuzz


def test_decisions_on_small_fleets_keep_every_placement_rule():
    failures, stats = fuzz(range(500), steps=120, legacy=True)
    assert not failures, "\n".join(failures[:10])
    # what the lives reached, so that a change of the generator cannot make this test vacuous
    for what, least in (("fidelity MEMORY", 300), ("fidelity MEMORY LOCAL", 300), ("through an edge", 40),
                        ("fidelity VOLUMES NO_COMPATIBLE_WORKER", 20), ("fidelity NONE NO_COMPATIBLE_WORKER", 20),
                        ("fidelity VOLUMES TEMPLATE_CHANGED", 40), ("fidelity VOLUMES SNAPSHOT_NOT_MEMORY", 5),
                        ("fidelity ROOTFS", 100), ("retry answered", 300), ("retry refused", 200),
                        ("refused RESOURCE_EXHAUSTED (PAUSED)", 100), ("refused FAILED_PRECONDITION (PAUSED)", 50),
                        ("refused INVALID_ARGUMENT (SUSPENDED)", 50)):
        assert stats.get(what, 0) >= least, (what, stats.get(what, 0))


def test_decisions_on_a_larger_fleet_keep_every_placement_rule():
    failures, stats = fuzz(range(40), steps=400, legacy=True, workers=14, actors=8)
    assert not failures, "\n".join(failures[:10])
    assert stats.get("fidelity MEMORY", 0) >= 150 and stats.get("through an edge", 0) >= 15, stats
