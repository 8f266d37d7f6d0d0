"""Feasibility: what a tier of a decision requires of a worker, and the one judgement of it.

`Ask.judge(worker, pending)` runs the checks of CONTRACT placement rule 6 (and 4, 5) in
pipeline order, the way Nomad's feasibility checkers do, and says which one rejects the
worker, or that it fits, with the runtime the actor would run under and the memory it
would book:

1. `class not registered`  the worker does not register the actor's class
2. `drained`               it is drained (a removed worker is not in the projection)
3. `selector mismatch`     a selector (the actor's and the request's) is not among its labels
4. `not on pinned node`    the tier is restricted to a node (a LOCAL image) and it is elsewhere
5. `runtime mismatch`      a memory tier: none of its runtimes accepts the stamp (in the
                           tier's role, when the tier has one)
6. `architecture mismatch` a tier without memory of a stamped snapshot: its class default is
                           of another architecture than the stamp; or, for any tier without
                           memory, of another one than its machine (a registration logged
                           before the registry refused it: `ClassEntry.runs`)
7. `insufficient cpu`, `insufficient memory`: its room (capacity minus the 64 MiB reserve
                           minus what is booked and what this replica has in flight) is short;
                           both may apply. The memory an actor books depends on the runtime
                           (its overhead): where several runtimes of the worker accept the
                           stamp, the first in rule 2's order that has room is the one, and
                           memory is short only if none has.

`fit` is the fast path decisions take (a worker fits or not); `reasons` names the
rejection for explain and refusal messages. Both are the one judgement. `missing_keys`
says which selectors a worker passed over for `selector mismatch` does not match (a
refusal's message names them).

`carrying` (`carries_out` says why not) judges a placement made earlier, which a retry of its
request id would be answered with (not a new decision: room and drains do not count, the
placement holds its booking): whether the worker, as it is now, still runs what it pins, where it
names. `audit verify` judges every placement's record by it, and its worker by `judge`.
"""

from __future__ import annotations

from typing import Mapping

from services.scheduler.records import REGISTERED, WORKER_RESERVE_MIB, Compat, Runtime, Worker

# Tentative bookings a replica has in flight: worker id -> (cpu millis, memory MiB).
Pending = Mapping[str, tuple[int, int]]
NO_PENDING: Pending = {}

# Reasons, in pipeline order.
CLASS_NOT_REGISTERED = "class not registered"
DRAINED = "drained"
SELECTOR_MISMATCH = "selector mismatch"
NOT_ON_PINNED_NODE = "not on pinned node"
RUNTIME_MISMATCH = "runtime mismatch"
ARCHITECTURE_MISMATCH = "architecture mismatch"
INSUFFICIENT_CPU = "insufficient cpu"
INSUFFICIENT_MEMORY = "insufficient memory"
REASONS = (CLASS_NOT_REGISTERED, DRAINED, SELECTOR_MISMATCH, NOT_ON_PINNED_NODE, RUNTIME_MISMATCH,
           ARCHITECTURE_MISMATCH, INSUFFICIENT_CPU, INSUFFICIENT_MEMORY)
# A verdict is 0 (fits), the 1-based position of the failing feasibility check, or the
# resource checks that failed as bits (both may).
FITS = 0
SHORT_CPU, SHORT_MEMORY = 1 << 8, 1 << 9


def room(worker: Worker, pending: Pending) -> tuple[int, int]:
    """(cpu millis, memory MiB) the worker has left: capacity minus the reserve, what is booked
    and what this replica has in flight there. The one judgement of room: a decision's (`Ask.judge`)
    and `audit verify`'s of a placement (PAST_ROOM, with nothing in flight: the room the log gives the
    worker at the placement's position). `Worker.room_cpu` and `room_mem` say the same without what is
    in flight; they are not read here, as a property read costs a sixth of a judgement (measured), and
    a test holds the two equal."""
    room_cpu = worker.cpu_millis - worker.booked_cpu
    room_mem = worker.memory_mib - WORKER_RESERVE_MIB - worker.booked_mem
    if pending:
        held = pending.get(worker.worker_id)
        if held is not None:
            room_cpu -= held[0]
            room_mem -= held[1]
    return room_cpu, room_mem


class Ask:
    """The requirements one tier puts on a worker: `compat` set means a memory restore,
    `arch` the architecture its class default must have, `node` the node it must be on."""

    __slots__ = ("sandbox_class", "cpu", "memory_mib", "selectors", "node", "compat", "arch")

    def __init__(
        self,
        sandbox_class: str,
        cpu: int,
        memory_mib: int,
        selectors: tuple[tuple[str, str], ...],
        node: str | None,
        compat: Compat | None,
        arch: str | None = None,
    ):
        self.sandbox_class = sandbox_class
        self.cpu = cpu
        self.memory_mib = memory_mib
        self.selectors = selectors
        self.node = node
        self.compat = compat
        self.arch = arch

    def judge(self, worker: Worker, pending: Pending, role: int | None = None) -> tuple[int, Runtime | None, int]:
        """(verdict, runtime, memory to book): the checks in pipeline order (module docstring).
        A memory restore considers the runtimes that accept the stamp in `role` only, or in
        any role (None)."""
        entry = worker.classes.get(self.sandbox_class)
        if entry is None:
            return 1, None, 0
        if worker.state is not REGISTERED:
            return 2, None, 0
        if self.selectors:
            labels = worker.labels
            for key, value in self.selectors:
                if labels.get(key) != value:
                    return 3, None, 0
        if self.node is not None and worker.place != self.node:  # rule 5: a place, a disk of a node
            return 4, None, 0
        if self.compat is None:
            runtime = entry.default
            if (self.arch is not None and runtime.compat.arch != self.arch) or not entry.runs:
                return 6, None, 0
            room_cpu, room_mem = room(worker, pending)
            need = runtime.need_mib(self.memory_mib)
            verdict = (SHORT_CPU if room_cpu < self.cpu else 0) | (SHORT_MEMORY if room_mem < need else 0)
            return verdict, runtime, need
        matches = entry.accepting.get(self.compat)
        if matches is None:
            return 5, None, 0
        if role is not None:
            matches = tuple(m for m in matches if m[0] == role) if len(matches) > 1 else (
                matches if matches[0][0] == role else ())
            if not matches:
                return 5, None, 0
        room_cpu, room_mem = room(worker, pending)
        short_cpu = SHORT_CPU if room_cpu < self.cpu else 0
        for _, runtime in matches:  # one, but for a stamp that several of the worker's runtimes accept
            need = runtime.need_mib(self.memory_mib)
            if room_mem >= need:
                return short_cpu, runtime, need
        runtime = matches[0][1]
        return short_cpu | SHORT_MEMORY, runtime, runtime.need_mib(self.memory_mib)

    def fit(self, worker: Worker, pending: Pending, role: int | None = None) -> tuple[Runtime, int] | None:
        """(runtime, memory to book) if the worker passes every check, else None."""
        verdict, runtime, need = self.judge(worker, pending, role)
        return (runtime, need) if verdict == FITS else None  # type: ignore[return-value]

    def reasons(self, worker: Worker, pending: Pending) -> list[str]:
        """Why the worker is passed over: the first failing feasibility check, or every
        failing resource check; empty when it fits."""
        verdict = self.judge(worker, pending)[0]
        if verdict == FITS:
            return []
        if verdict < SHORT_CPU:
            return [REASONS[verdict - 1]]
        return [r for bit, r in ((SHORT_CPU, INSUFFICIENT_CPU), (SHORT_MEMORY, INSUFFICIENT_MEMORY)) if verdict & bit]


def none_passes(candidates: int, counts: Mapping[str, int], check: str) -> bool:
    """Whether, by a tally of every worker (`decide.tally`: how many fit, and how many were passed over
    for each reason), no worker of the class that is not drained passes `check` (`selector mismatch`:
    none has the labels the selectors ask for; `runtime mismatch`: none of those that have them accepts
    the stamp). The checks run in REASONS' order and each worker is counted under the first it fails
    (or every resource check): one that passes `check` fits or is counted under a later reason. So none
    passes it when none fits, none is counted under a later reason, and some worker was passed over for
    it (a tally of no worker of the class says nothing of it)."""
    if candidates or not counts.get(check):
        return False
    return not any(counts.get(reason) for reason in REASONS[REASONS.index(check) + 1:])


def missing_keys(selectors: tuple[tuple[str, str], ...], labels: Mapping[str, str]) -> list[str]:
    """The selector keys (in the selectors' order, sorted) whose value `labels` does not have."""
    return [key for key, value in selectors if labels.get(key) != value]


# Why a worker cannot carry out a placement made on it (`carrying`), in the order checked.
NO_CLASS_NOW = "class not registered now"
OTHER_NODE_NOW = "on another node now"
PIN_NOT_RUN = "pinned runtime not run"
IMAGE_NOT_ACCEPTED = "image not accepted by the pinned runtime"
CARRY_REASONS = (NO_CLASS_NOW, OTHER_NODE_NOW, PIN_NOT_RUN, IMAGE_NOT_ACCEPTED)


def carrying(worker: Worker, sandbox_class: str, node: str, pin: Compat | None,
             image: Compat | None) -> tuple[str | None, Runtime | None]:
    """Whether `worker`, as it is now, can carry out a placement made on it on `node` under the runtime
    `pin` (its compat key; None: one no worker of the log ever ran), restoring, at MEMORY, an image of
    `image` (None for a placement without memory): (None, the worker's runtime the pin names, the first
    accepting the image for one) if it can, else (the check that fails, None): the class no longer
    registered, the worker on another node, the pin no runtime of its class, the pin's runtime not
    accepting the image (any role: each loads it). The one definition: a retry's answer from the log is
    judged by it (`carries_out`), and `audit verify` judges every placement's record by it."""
    entry = worker.classes.get(sandbox_class)
    if entry is None:
        return NO_CLASS_NOW, None
    if worker.node != node:
        return OTHER_NODE_NOW, None
    runs = next((r for r in (entry.default, *entry.restorable) if r.compat is pin), None) if pin is not None else None
    if runs is None:
        return PIN_NOT_RUN, None
    if image is not None:
        runs = next((r for _, r in entry.accepting.get(image, ()) if r.compat is pin), None)
        if runs is None:
            return IMAGE_NOT_ACCEPTED, None
    return None, runs


def carries_out(worker: Worker, sandbox_class: str, node: str, pin: Compat | None, image: Compat | None) -> str | None:
    """Why `worker`, as it is now, cannot carry out a placement made on it earlier on `node` under
    the runtime `pin` (its compat key; None: one no worker of the log ever ran), restoring, at
    MEMORY, an image of `image` (None for a placement without memory); None if it can (`carrying`).
    Sending it then would run the actor under another runtime than its pin (which every later
    snapshot is stamped with), or send the image where it cannot load."""
    why = carrying(worker, sandbox_class, node, pin, image)[0]
    if why == NO_CLASS_NOW:
        return f"it no longer registers class {sandbox_class}"
    if why == OTHER_NODE_NOW:
        return f"it is on node {worker.node} now, not {node}"
    if why == PIN_NOT_RUN:
        return "it no longer runs the runtime the placement pins"
    if why == IMAGE_NOT_ACCEPTED:
        return "the runtime the placement pins no longer accepts the image's version"
    return None
