"""Random orders of what happens around one agent, against the registry's revision rules.

A real agent, two registry replicas and a real nats-server. Each seed draws a sequence of steps
(edits of the agent's file, the machine's CPU changing or becoming unreadable, reconnects,
heartbeats, a removal by hand, copies of the agent's registrations held by a stalled replica
and decided by it late, and copies sent again on the bus), and after a step the test either lets
the agent act on it to the end or goes straight on to the next, so that registrations are still
on their way when the next thing happens.

Nothing waits for time to pass: the agent's own watch is switched off (an hour), and the test
makes its looks at the file and the machine (`Agent._sync_config`, `Agent._keep_cpu_true`, what
the watch calls) and awaits the registrations they start; the verdict is read from the worker's
history in stream order. Whenever the agent has acted on everything, and at the end after every
held copy is decided:
- the promise: the worker, if alive, holds no runtime naming a CPU other than the machine's
  (a resume of an image of that CPU would be sent to it and crash);
- not stuck: with the file made usable and the machine readable, the agent registers it.

`WARMBOOT_ORDER_SEEDS` (a count, or a comma-separated list) and `WARMBOOT_ORDER_STEPS` run more.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
from pathlib import Path

import msgspec
import pytest

from events.errors import ContractError
from events.probe import probe_version
from events.schema import RuntimeChanged, WorkerRegistered, WorkerRemoved
from services.registry.domain import canonical_classes
from tests.registry_helpers import AMD, CPUINFO, raw_request, running_registry, worker_events
from tests.test_agent import agent_running
from warmboot.agent import Agent
from warmboot.agent_config import ProbeSettings

CPUS = {"intel": CPUINFO, "amd": AMD}
WID = "w-a"
PASSES = 8  # looks at the file and the machine before the agent counts as having acted on everything


def _seeds() -> list[int]:
    given = os.environ.get("WARMBOOT_ORDER_SEEDS", "40")
    return [int(s) for s in given.split(",")] if "," in given else list(range(1, int(given) + 1))


STEPS_PER_SEED = int(os.environ.get("WARMBOOT_ORDER_STEPS", "16"))


def attributes_of(cpu: str, profile: str) -> dict[str, str]:
    """What the probe reads of the sample machine `cpu` for `profile`."""
    return {a.key: a.value for a in probe_version(CPUS[cpu].read_text(), "amd64", profile, {}).attributes}


def config(mode: str, asset: str, microvm: bool, restorable: bool) -> str:
    """The agent's file. `mode`: "probed", or "literal-intel" / "literal-amd" (the runtimes written
    out as --print-registration gives them on that machine), or "partial-intel" / "partial-amd"
    (gvisor probed, the microvm runtime written out naming that machine's CPU vendor and the gvisor
    profile's `cpu_features`, not the microvm profile's `cpu_model`: each key it names is compared)."""

    def runtime(table: str, name: str, profile: str, extra: dict[str, str]) -> str:
        if mode == "probed" or (mode.startswith("partial-") and profile == "gvisor"):
            attrs = extra
            head = f'name = "{name}"\nprofile = "{profile}"\n'
        elif mode.startswith("partial-"):
            cpu = mode.split("-")[1]
            read = attributes_of(cpu, profile)
            attrs = {"architecture": read["architecture"], "cpu_vendor": read["cpu_vendor"],
                     "cpu_features": attributes_of(cpu, "gvisor")["cpu_features"], **extra}
            head = f'name = "{name}"\n'
        else:
            attrs = {**attributes_of(mode.split("-")[1], profile), **extra}
            head = f'name = "{name}"\n'
        return (f"\n[{table}]\n{head}attributes = {{ "
                + ", ".join(f'{k} = "{v}"' for k, v in sorted(attrs.items())) + " }\n")

    text = ("[capacity]\ncpu_millis = 4000\nmemory_mib = 8192\n\n[labels]\nzone = \"a\"\n\n"
            "[[sandbox_classes]]\nsandbox_class = \"gvisor\"\n")
    text += runtime("sandbox_classes.default_runtime", f"gvisor-{asset}", "gvisor", {"gvisor_asset_hash": asset})
    if restorable:
        text += runtime("[sandbox_classes.restorable_runtimes]", "gvisor-v0", "gvisor", {"gvisor_asset_hash": "v0"})
    if microvm:
        text += "\n[[sandbox_classes]]\nsandbox_class = \"microvm\"\n"
        text += runtime("sandbox_classes.default_runtime", "fc-1", "microvm",
                        {"kernel_digest": "k1", "rootfs_digest": "r1"})
    return text


def foreign_attributes(classes, cpu: str) -> list[str]:
    """What runtimes of `classes` say of the CPU that the machine `cpu` does not have."""
    wrong = []
    mine = {**attributes_of(cpu, "gvisor"), **attributes_of(cpu, "microvm")}
    for entry in classes:
        for runtime in (entry.default_runtime, *entry.restorable_runtimes):
            for a in runtime.version.attributes:
                if a.key in mine and a.value != mine[a.key]:
                    wrong.append(f"{entry.sandbox_class} runtime {runtime.name}: {a.key}={a.value}, "
                                 f"the machine ({cpu}) has {mine[a.key]}")
    return wrong


async def life(nc, prefix: str):
    """The worker's classes as its history makes them, in stream order (None: not alive)."""
    classes = None
    for _, event in await worker_events(nc, prefix, WID):
        if isinstance(event, (WorkerRegistered, RuntimeChanged)):
            classes = event.sandbox_classes
        elif isinstance(event, WorkerRemoved):
            classes = None
    return classes


class Rig:
    """The agent, its machine and file, and copies of what it sent."""

    def __init__(self, nats_url: str, prefix: str, tmp_path: Path, rnd: random.Random, log):
        self.rnd, self.log = rnd, log
        self.cpuinfo = tmp_path / "cpuinfo"
        self.cpu: str | None = "intel"  # None: the probe cannot read the machine
        shutil.copy(CPUINFO, self.cpuinfo)
        self.path = tmp_path / "agent.toml"
        self.mode = rnd.choice(["probed", "literal-intel"])
        self.asset, self.microvm, self.restorable = "v1", False, False
        self.write()
        self.agent = Agent(nats_url, WID, "node-a", self.path, prefix=prefix, watch_interval_s=3600.0,
                           probe_interval_s=0.0, unreadable_grace_s=0.0,
                           probe=ProbeSettings(cpuinfo_path=self.cpuinfo, architecture="amd64"))
        self.sent: list = []  # every distinct registration the agent sent
        self.first_answer = asyncio.Event()  # the agent's first registration answered
        self.hold_next = False
        self.held: list = []  # copies a stalled replica holds, decided when released
        request = self.agent._request

        async def spied(verb, body, *args, **kwargs):
            if verb == "register" and body not in self.sent:
                self.sent.append(body)
                if self.hold_next:
                    self.hold_next = False
                    self.held.append(body)
            try:
                reply = await request(verb, body, *args, **kwargs)
            except ContractError as e:
                self.log(f"    agent {verb} revision={getattr(body, 'revision', None)}: {e.code.value} {e.field}")
                raise
            finally:
                if verb == "register":
                    self.first_answer.set()
            if verb == "register":
                self.log(f"    agent register revision={body.revision}: {reply.outcome.value}")
            return reply

        self.agent._request = spied

    def write(self) -> None:
        self.path.write_text(config(self.mode, self.asset, self.microvm, self.restorable))

    async def act(self, stop: asyncio.Event) -> None:
        """Let the agent act on everything: look at the file and the machine as its watch does, and
        await what that starts, until a look starts nothing (a withdrawn agent on a machine it cannot
        register tries again at every look: `PASSES` of them)."""
        agent = self.agent
        for _ in range(PASSES):
            agent._sync_config(stop)
            agent._keep_cpu_true(stop)
            if not agent._background and not agent._one_registration.locked():
                return
            while agent._background or agent._one_registration.locked():
                await asyncio.gather(*agent._background, return_exceptions=True)
                if agent._one_registration.locked():
                    async with agent._one_registration:
                        pass

    async def step(self, step: str, nc, prefix: str, stall, stop: asyncio.Event) -> None:
        rnd = self.rnd
        if step == "edit_asset":
            self.asset = rnd.choice([a for a in ("v1", "v2", "v3") if a != self.asset])
        elif step == "edit_class":
            self.microvm = not self.microvm
        elif step == "edit_restorable":
            self.restorable = not self.restorable
        elif step == "edit_mode":
            self.mode = rnd.choice(["probed", "literal-intel", "literal-amd", "partial-intel", "partial-amd"])
        elif step in ("cpu_intel", "cpu_amd"):
            self.cpu = step[4:]
            shutil.copy(CPUS[self.cpu], self.cpuinfo)
        elif step == "cpu_unreadable":
            self.cpu = None
            self.cpuinfo.unlink(missing_ok=True)
        elif step == "reconnect":
            self.agent._register_again(stop)  # what the agent does when its connection comes back
            await self.agent.heartbeat(stop)
        elif step == "heartbeat":
            await self.agent.heartbeat(stop)
        elif step == "operator_remove":
            reply, _ = await raw_request(nc, prefix, "remove", WID, {"reason": "operator"})
            self.log(f"    operator remove: {reply.get('error', {}).get('code', 'removed')}")
        elif step == "hold_next":
            self.hold_next = True
        elif step == "release" and self.held:
            await self.release(self.held.pop(rnd.randrange(len(self.held))), stall)
        elif step == "resend" and self.sent:
            body = rnd.choice(self.sent)
            reply, _ = await raw_request(nc, prefix, "register", WID, msgspec.to_builtins(body))
            self.log(f"    a copy of revision={body.revision} sent again: "
                     f"{reply.get('outcome') or reply['error']['field']}")
        if step.startswith("edit_"):
            self.write()

    async def release(self, body, stall) -> None:
        """The stalled replica decides its copy of `body` now."""
        try:
            reply = await stall.register(WID, body)
            self.log(f"    held copy of revision={body.revision} decided late: {reply.outcome.value}")
        except ContractError as e:
            self.log(f"    held copy of revision={body.revision} decided late: refused, {e.field}")


# Each step with its weight: the orders that took a review's fuzzing to find (a copy held, the
# worker removed, the CPU changed, the copy decided) are made likely.
STEPS = {"edit_asset": 1, "edit_class": 2, "edit_restorable": 1, "edit_mode": 1, "cpu_intel": 2, "cpu_amd": 2,
         "cpu_unreadable": 1, "reconnect": 1, "heartbeat": 1, "operator_remove": 2, "hold_next": 3, "release": 3,
         "resend": 2}


async def check_the_promise(rig: Rig, nc, prefix: str, where: str) -> None:
    """With the agent having acted on everything: the worker's history holds what the agent has in
    force (nothing, if it removed the worker), and no CPU the machine does not have."""
    classes = await life(nc, prefix)
    if classes is not None and rig.cpu is not None:
        wrong = foreign_attributes(classes, rig.cpu)
        assert not wrong, f"{where}: the registry holds a CPU the machine does not have: {wrong}"
    agent = rig.agent
    if agent.withdrawn:
        assert classes is None, f"{where}: the agent removed its worker, yet it is alive with {classes}"
    elif classes is not None:
        assert agent.registration is not None
        held = canonical_classes(agent.registration.sandbox_classes)
        assert classes == held, (f"{where}: the registry holds another registration than the agent's in force "
                                 f"(a runtime the worker does not run): {classes} against {held}")


@pytest.mark.parametrize("seed", _seeds())
async def test_no_order_leaves_the_registry_with_a_cpu_the_machine_does_not_have(nats_url, nc, prefix, tmp_path,
                                                                                seed):
    rnd = random.Random(seed)
    steps = rnd.choices(list(STEPS), weights=list(STEPS.values()), k=STEPS_PER_SEED)
    lines: list[str] = [f"seed {seed}"]
    rig = Rig(nats_url, prefix, tmp_path, rnd, lines.append)
    lines.append(f"  start: {rig.mode} v1 on intel")
    try:
        async with running_registry(nats_url, prefix), running_registry(nats_url, prefix) as stall:
            stop = asyncio.Event()
            async with agent_running(rig.agent):
                await asyncio.wait_for(rig.first_answer.wait(), 20)
                await rig.act(stop)
                for step in steps:
                    settle = rnd.random() < 0.6
                    lines.append(f"  {step}{'' if settle else ' (not waited for)'}")
                    await rig.step(step, nc, prefix, stall, stop)
                    lines.append(f"    now: file {rig.mode} {rig.asset}{' +restorable' if rig.restorable else ''}"
                                 f"{' +microvm' if rig.microvm else ''}, machine {rig.cpu}")
                    if settle:
                        await rig.act(stop)
                        await check_the_promise(rig, nc, prefix, f"after {step}")
                lines.append("  end: every held copy decided")
                while rig.held:
                    await rig.release(rig.held.pop(0), stall)
                await rig.act(stop)
                await check_the_promise(rig, nc, prefix, "at the end")
                # not stuck: the file made usable, on a machine the probe reads
                if rig.cpu is None:
                    rig.cpu = rnd.choice(["intel", "amd"])
                    shutil.copy(CPUS[rig.cpu], rig.cpuinfo)
                classes = await life(nc, prefix)
                rig.mode, rig.asset, rig.restorable = "probed", "vfin", False
                rig.microvm = classes is not None and any(c.sandbox_class == "microvm" for c in classes)
                rig.write()
                lines.append(f"  end: file probed vfin{' +microvm' if rig.microvm else ''}, machine {rig.cpu}")
                await rig.agent.heartbeat(stop)  # learns of a removal it did not make
                await rig.act(stop)
                await check_the_promise(rig, nc, prefix, "with the file usable")
                classes = await life(nc, prefix)
                assert classes is not None, "the agent did not register the usable file"
                assets = {a.value for c in classes for a in c.default_runtime.version.attributes
                          if a.key == "gvisor_asset_hash"}
                assert assets == {"vfin"}, f"the agent did not register the usable file: {assets}"
    except BaseException:
        print("\n".join(lines))
        raise

