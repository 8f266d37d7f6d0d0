"""What an agent does with a heartbeat refused for its revision (`warmboot.agent_rules.superseded_by`), on the
refusal the registry makes (`services.registry.domain.check_beats_in_force`): register its machine again,
or stop, another agent of its worker id on another node having registered it since (docs/registry.md); and
at the start of one that stopped so (`still_superseded`), with the record of it beside its state file."""

from __future__ import annotations

from pathlib import Path

import pytest

from events.errors import ContractError, in_force_named, latest_revision, revision_refused
from events.schema import ErrorCode, HeartbeatReply
from services.registry.domain import check_beats_in_force
from warmboot.agent_rules import (SUPERSEDED_AT_START_EXIT, StillSuperseded, Superseded, still_superseded,
                                  superseded_by)
from warmboot.agent_state import RevisionFile, StateFileError, SupersededRecord


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
    # on its own node: a second agent of the worker id on this machine, or one configured alike (until
    # 2026-12-07 taken for this machine's, and the two took the worker from each other at every beat)
    (200, "n1", 100, True),
])
def test_an_agent_stops_only_for_another_agent_s_registration_above_its_own(in_force, node, last, stops):
    decided = superseded_by(refusal(last - 1, in_force, node), "w-1", "n1", last)
    assert (decided is not None) == stops
    if stops:
        assert isinstance(decided, Superseded) and isinstance(decided, ContractError)
        assert (decided.code, decided.field, decided.node) == (ErrorCode.FAILED_PRECONDITION, "revision", node)
        who = ("another agent, on node n2" if node == "n2" else
               "another agent on this agent's node n1 (a second agent of the worker id started on this machine")
        for said in ("worker w-1", who, "revision 200", "node n1", "up to 100",
                     "give each machine a worker id of its own, and run one agent of it",
                     "stop an agent before starting its replacement"):
            assert said in decided.message, (said, decided.message)


def test_a_refusal_of_an_earlier_registry_registers_again():
    """A registry of an earlier version names no node: its refusals are answered as they were."""
    assert superseded_by(refusal(99, 200, None), "w-1", "n1", 100) is None


# --- at the start of an agent that stopped as superseded (`still_superseded`, `SupersededRecord`) -----------

RECORD = Path("/var/lib/warmboot/agent.revision.superseded")


def at_start(answer):
    return still_superseded(answer, "w-1", "n1", 100, RECORD, ("n2", 200))


@pytest.mark.parametrize("node, who", [
    ("n2", "worker w-1 is held by another agent, on node n2, which registered it since"),
    ("n1", "worker w-1 is held by another agent on this agent's node n1 (a second agent of the worker id started "
           "on this machine, or a machine configured alike, --node included), which registered it since"),
])
def test_a_restarted_agent_does_not_register_while_another_agent_s_registration_above_its_own_is_in_force(node, who):
    held = at_start(refusal(100, 300, node))
    assert isinstance(held, StillSuperseded) and isinstance(held, Superseded)
    assert (held.code, held.field, held.node, held.revision) == (ErrorCode.FAILED_PRECONDITION, "revision", node, 300)
    for said in (who, "revision 300", "up to 100",
                 "node n2's revision 200 before", "Give each machine a worker id of its own",
                 f"delete {RECORD} and start this agent again"):
        assert said in held.message, (said, held.message)
    assert SUPERSEDED_AT_START_EXIT == 3


@pytest.mark.parametrize("answer, why", [
    (HeartbeatReply(ttl_s=15.0), "the registration in force is this agent's"),
    (ContractError(ErrorCode.NOT_FOUND, "worker 'w-1' was removed (LOST)", "worker_id"), "registration ended"),
    (None, "did not answer"),
    (refusal(100, 50, "n2"), "refused otherwise"),  # below its own: the log rolled back
    (refusal(100, 300, None), "refused otherwise"),  # an earlier registry's: names no node
    (ContractError(ErrorCode.FAILED_PRECONDITION, "bound to node n2", "node"), "refused otherwise"),
])
def test_a_restarted_agent_registers_otherwise_and_says_why(answer, why):
    decided = at_start(answer)
    assert isinstance(decided, str) and why in decided, decided


def test_the_record_is_a_file_beside_the_state_file_which_keeps_its_format(tmp_path):
    """An agent of an earlier version reads the state file as before (it refuses anything but `<worker_id>
    <revision>` there), and knows nothing of the record beside it."""
    state = tmp_path / "agent.revision"
    RevisionFile(state, "w-1").write(100)
    record = SupersededRecord(state, "w-1")
    assert record.path == tmp_path / "agent.revision.superseded" and record.read() is None
    record.write("n2", 200)
    assert record.read() == ("n2", 200) and record.path.read_text() == "w-1 n2 200\n"
    assert state.read_text() == "w-1 100\n" and RevisionFile(state, "w-1").read() == 100
    record.clear()
    assert record.read() is None
    record.clear()  # (cleared already: nothing to do)


@pytest.mark.parametrize("text, says", [
    ("w-2 n2 200\n", "records a stop of worker 'w-2', not 'w-1': give each agent a state file of its own"),
    ("w-1 n2\n", "holds no record of a stop as superseded (`w-1 NODE REVISION`)"),
    ("w-1 n2 soon\n", "remove it"),
])
def test_a_record_of_something_else_is_refused_naming_the_file(tmp_path, text, says):
    record = SupersededRecord(tmp_path / "agent.revision", "w-1")
    record.path.write_text(text)
    with pytest.raises(StateFileError) as refused:
        record.read()
    assert str(record.path) in str(refused.value) and says in str(refused.value), refused.value
