"""What an agent does with a heartbeat refused for its revision (`warmboot.agent.superseded_by`), on the
refusal the registry makes (`services.registry.domain.check_beats_in_force`): register its machine again,
or stop, another agent of its worker id on another node having registered it since (docs/registry.md)."""

from __future__ import annotations

import pytest

from events.errors import ContractError, in_force_named, latest_revision, revision_refused
from events.schema import ErrorCode
from services.registry.domain import check_beats_in_force
from warmboot.agent import Superseded, superseded_by


def refusal(beats: int, in_force: int, node: str | None) -> ContractError:
    with pytest.raises(ContractError) as refused:
        check_beats_in_force("w-1", beats, in_force, node)
    return refused.value


def test_the_refusal_names_the_revision_and_node_in_force_and_keeps_its_wording():
    refused = refusal(100, 200, "n2")
    assert (refused.code, refused.field) == (ErrorCode.FAILED_PRECONDITION, "revision")
    assert "registration in force is revision 200, not 100 (registered on node n2)" in refused.message
    assert in_force_named(refused) == (200, "n2")
    assert latest_revision(refused) is None  # not a refusal of a registration's revision


def test_no_node_is_read_where_none_is_named():
    assert in_force_named(refusal(100, 200, None)) is None  # (a registry of an earlier version names none)
    assert in_force_named(revision_refused("w-1", 100, 200)) is None
    other = ContractError(ErrorCode.FAILED_PRECONDITION, refusal(100, 200, "n2").message, "node")
    assert in_force_named(other) is None


@pytest.mark.parametrize("in_force, node, last, stops", [
    (200, "n2", 100, True),  # another node registered it since: a twin, or the machine's replacement
    (50, "n2", 100, False),  # an earlier one the log rolled back to (this agent ran on n2 before)
    (50, "n1", 100, False),  # its own earlier one, the log rolled back (a crash lost its latest)
    (100, "n2", 100, False),  # not above the last this agent made: its own
    (200, "n1", 100, False),  # on its own node: not told apart from this machine (docs/registry.md)
])
def test_an_agent_stops_only_for_another_node_s_registration_above_its_own(in_force, node, last, stops):
    decided = superseded_by(refusal(last - 1, in_force, node), "w-1", "n1", last)
    assert (decided is not None) == stops
    if stops:
        assert isinstance(decided, Superseded) and isinstance(decided, ContractError)
        assert (decided.code, decided.field) == (ErrorCode.FAILED_PRECONDITION, "revision")
        for said in ("worker w-1", "node n2", "revision 200", "node n1", "up to 100",
                     "give each machine a worker id of its own", "stop an agent before starting its replacement"):
            assert said in decided.message, (said, decided.message)


def test_a_refusal_of_an_earlier_registry_registers_again():
    """A registry of an earlier version names no node: its refusals are answered as they were."""
    assert superseded_by(refusal(99, 200, None), "w-1", "n1", 100) is None
