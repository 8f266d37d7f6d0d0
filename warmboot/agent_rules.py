"""The worker agent's pure decisions (`warmboot.agent` runs the agent): whether a heartbeat refused for its
revision means that another agent of the worker id holds the worker (`superseded_by`, and at the start of an
agent that stopped for that, `still_superseded`), and which drain a heartbeat's answer names that the agent
says (`drain_to_say`, `said_drained`). No I/O: each takes what was read and returns what to do or say."""

from __future__ import annotations

from pathlib import Path

from events.errors import ContractError, in_force_named
from events.schema import Drained, ErrorCode, HeartbeatReply


class Superseded(ContractError):
    """FAILED_PRECONDITION, field revision: another agent of this worker id registered the worker since this
    agent's last registration (a twin, on another node or on this one, or the machine's replacement). This agent
    stops (`Agent.run` raises it; `warmboot agent` exits 1 saying it) rather than take the worker back
    from it: each take fences every placement on the worker (docs/registry.md, "The agent"). `node` and
    `revision`: the registration in force the refusal named, which an agent with a state file records
    (`SupersededRecord`) so that its next process does not take the worker back at its start."""

    def __init__(self, code: ErrorCode, message: str, field: str | None = None, *, node: str, revision: int):
        super().__init__(code, message, field)
        self.node = node
        self.revision = revision


class StillSuperseded(Superseded):
    """At its start, an agent that stopped as Superseded (its record says so: `SupersededRecord`) finds
    the worker still held by another agent's registration above its own (`still_superseded`): it does not
    register, and `warmboot agent` exits SUPERSEDED_AT_START_EXIT, for a supervisor to leave it stopped
    (systemd's `RestartPreventExitStatus=`). Registering would take the worker back, the other agent would
    stop in turn and be restarted: the two take it from each other at their supervisors' restart pace, each
    take fencing every placement on the worker (found by a review, 2026-12-06)."""


# `warmboot agent`'s exit status for StillSuperseded, and for nothing else: 1 is every other error (a
# Superseded while running included: restarted, the agent looks again), 2 a usage error, 130 a Ctrl-C.
SUPERSEDED_AT_START_EXIT = 3


def superseded_by(refusal: ContractError, worker_id: str, node: str, last_revision: int) -> Superseded | None:
    """What a heartbeat refused for its revision (`refusal`) means to the agent of `worker_id` on `node`,
    whose last revision made is `last_revision` (each it sent is at most that): Superseded when the
    registration in force it names is at a revision above `last_revision` (none of this agent's, so another
    agent's, registered since: on another node, or on this one: a second agent of the worker id started on
    this machine, or a machine configured alike, `--node` included); None, and the agent registers its
    machine again, otherwise: a lower revision is its own earlier registration (a crash rolled the log back
    and lost its latest), one not above its own is its own too (the beat crossed it); and a refusal naming
    no node is an earlier registry's, answered as it was. (Until 2026-12-07 a registration on its own node
    was taken for this machine's, and two agents of one worker id on one node took it from each other at
    every beat, each take fencing every placement on it.)"""
    named = in_force_named(refusal)
    if named is None:
        return None
    revision, other = named
    if revision <= last_revision:
        return None
    return Superseded(
        ErrorCode.FAILED_PRECONDITION,
        f"worker {worker_id} was registered since by {another_agent(other, node)}: its registration in force "
        f"is revision {revision}, above every one this agent (node {node}) made, up to {last_revision}. This agent "
        "stops rather than take the worker back (each take fences every placement on it): give each machine a "
        "worker id of its own, and run one agent of it; stop an agent before starting its replacement",
        "revision", node=other, revision=revision)


def another_agent(other: str, node: str) -> str:
    """Who made the registration in force on `other`, to the agent on `node` that did not."""
    if other != node:
        return f"another agent, on node {other}"
    return (f"another agent on this agent's node {node} (a second agent of the worker id started on this machine, "
            "or a machine configured alike, --node included)")


def still_superseded(answer: HeartbeatReply | ContractError | None, worker_id: str, node: str, kept: int,
                     record: Path, recorded: tuple[str, int]) -> StillSuperseded | str:
    """What the agent of `worker_id` on `node`, which stopped as Superseded (`recorded`: the node and the
    revision in force it stopped for, kept in `record`), does at its start with the `answer` to a beat naming
    `kept`, its last revision made (None: no answer): StillSuperseded, and it does not register, when the
    registry refuses the beat for another agent's registration above `kept` (`superseded_by`); else why it
    registers, as it does without a record (the record is cleared): the beat was answered (the registration
    in force is this agent's), NOT_FOUND (the other's life ended: removed, or LOST), refused otherwise, or
    not answered (the agent cannot tell, and does as it did before it kept a record)."""
    if answer is None:
        return "the registry did not answer its beat"
    if isinstance(answer, HeartbeatReply):
        return f"the registry answers its beat (revision {kept}): the registration in force is this agent's"
    if answer.code is ErrorCode.NOT_FOUND:
        return f"the other's registration ended: {answer.message}"
    held = superseded_by(answer, worker_id, node, kept) \
        if (answer.code, answer.field) == (ErrorCode.FAILED_PRECONDITION, "revision") else None
    if held is None:
        return f"its beat was refused otherwise ({answer})"
    return StillSuperseded(
        ErrorCode.FAILED_PRECONDITION,
        f"worker {worker_id} is held by {another_agent(held.node, node)}, which registered it since: its "
        f"registration (revision {held.revision}) is in force, above every one this agent (node {node}) made, "
        f"up to {kept}. "
        f"This agent stopped for node {recorded[0]}'s revision {recorded[1]} before ({record} says so), and does "
        "not register: that would take the worker back, fence every placement on it, and stop the other agent "
        "in turn. Give each machine a worker id of its own; to take the worker over on purpose, delete "
        f"{record} and start this agent again (it also registers at its next start once the other's "
        "registration has ended: removed, or LOST)", "revision", node=held.node, revision=held.revision)


def drain_to_say(drained: Drained | None, known: int) -> bool:
    """Whether a heartbeat's answer names a drain the agent says: one (its `WorkerDrained`'s sequence) above
    `known`, the sequence of the latest drain it said, or sent itself (its answer's, which is at or after the
    drain's). So each drain is said once, at the first beat that names it, and not the agent's own at its
    exit; a drain of a later life of the worker (a new life is undrained) has a higher sequence, and is said
    too. None (not drained, or a registry of an earlier version, which says nothing) says nothing."""
    return drained is not None and drained.seq > known


def said_drained(worker_id: str, drained: Drained) -> str:
    """What the agent says of a drain `drain_to_say` chose."""
    reason = "no reason given" if drained.reason is None else f"reason {drained.reason!r}"
    return (f"worker {worker_id} is drained (seq {drained.seq}, {reason}): it takes no new placements; its actors "
            "stay until stopped or moved")
