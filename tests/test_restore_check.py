"""A worker's own check of a placement against the machine as it is now (`warmboot agent
--check-placement`, `warmboot.restore_check`): the registry's view can be behind the machine (a
runtime dropped from the configuration while a placement on it was in flight, a CPU changed under a
virtual machine, a log that lost its last writes), and the worker is the last that can refuse to
load an image where it cannot load (docs/contract.md)."""

from __future__ import annotations

import asyncio
import json

import msgspec
from click.testing import CliRunner

from events.compat import pin_of
from events.schema import Action, Placement, PlacedFidelity, Resources
from tests.factories import actor, golden
from tests.registry_helpers import AMD, CPUINFO, agent_config as config
from warmboot.agent_config import ProbeSettings, load_registration
from warmboot.cli import main
from warmboot.client import Client
from warmboot.restore_check import cannot_carry_out_here


def machine(tmp_path, text: str, cpuinfo=CPUINFO):
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path, load_registration(path, "w-1", "node-a", ProbeSettings(cpuinfo_path=cpuinfo, architecture="amd64"))


def placement(registration, runtime, *, fidelity=PlacedFidelity.MEMORY, node="node-a", worker_id="w-1",
              matched=None) -> Placement:
    return Placement(actor_id="a-1", worker_id=worker_id, node=node, fidelity=fidelity,
                     booked=Resources(cpu_millis=500, memory_mib=512),
                     action=Action.RESTORE if fidelity is not PlacedFidelity.NONE else Action.RUN,
                     sandbox_runtime=pin_of("gvisor", runtime), snapshot_id="a-1-s", matched_version=matched)


def test_a_placement_the_machine_runs_now_passes_and_each_drift_of_the_machine_is_named(tmp_path):
    _, upgrading = machine(tmp_path, config("v2", ("v1",)))  # v2 the default, v1 still restorable
    (entry,) = upgrading.sandbox_classes
    v2, v1 = entry.default_runtime, entry.restorable_runtimes[0]
    on_v1 = placement(upgrading, v1)
    assert cannot_carry_out_here(upgrading, on_v1) is None
    assert cannot_carry_out_here(upgrading, placement(upgrading, v2)) is None
    _, upgraded = machine(tmp_path, config("v2"))  # v1 dropped from the configuration since
    assert cannot_carry_out_here(upgraded, on_v1) == "no runtime it runs accepts the image's version"
    assert cannot_carry_out_here(upgraded, placement(upgraded, v2)) is None
    _, moved = machine(tmp_path, config("v2", ("v1",)), cpuinfo=AMD)  # the VM moved to another CPU
    assert cannot_carry_out_here(moved, on_v1) == "no runtime it runs accepts the image's version"
    # the image's version accepted, through an edge, but not under the runtime the placement pins
    assert cannot_carry_out_here(upgrading, placement(upgrading, v2, matched=v1.version)) == \
        "the runtime the placement pins no longer accepts the image's version"
    assert cannot_carry_out_here(upgrading, placement(upgrading, v1, node="node-b")) == \
        "it is on node node-a now, not node-b"
    assert cannot_carry_out_here(upgrading, placement(upgrading, v1, worker_id="w-2")) == \
        "it is a placement on worker w-2, not on w-1"
    # a cold boot loads no image, but runs under its pin, which every later snapshot is stamped with
    assert cannot_carry_out_here(upgraded, placement(upgraded, v1, fidelity=PlacedFidelity.NONE)) == \
        "it no longer runs the runtime the placement pins"


def test_an_image_restored_through_an_edge_passes_only_while_the_edge_is_there(tmp_path):
    _, plain = machine(tmp_path, config("v2"))
    v2 = plain.sandbox_classes[0].default_runtime
    _, older = machine(tmp_path, config("v1"))
    v1_version = older.sandbox_classes[0].default_runtime.version
    edged = msgspec.structs.replace(plain, sandbox_classes=(msgspec.structs.replace(
        plain.sandbox_classes[0], default_runtime=msgspec.structs.replace(v2, compatible_versions=(v1_version,))),))
    through_edge = placement(edged, v2, matched=v1_version)
    assert cannot_carry_out_here(edged, through_edge) is None
    assert cannot_carry_out_here(plain, through_edge) == "no runtime it runs accepts the image's version"


def run_check(path, placement_json: bytes, cpuinfo=CPUINFO):
    return CliRunner().invoke(main, ["agent", "--worker-id", "w-1", "--node", "node-a", "--config", str(path),
                                     "--cpuinfo", str(cpuinfo), "--arch", "amd64", "--check-placement", "-"],
                              input=placement_json)


async def test_the_agent_checks_an_assignment_the_scheduler_made_against_its_machine_now(stack, nc, prefix, nats_url,
                                                                                          tmp_path):
    """A worker registered by its config (v2 the default, v1 restorable); an actor with a v1 memory image
    resumed through the CLI; its Assignment (`-o json`) checked by the worker's agent: it can carry it
    out. The operator then drops v1 from the configuration before the registry has the change: the same
    Assignment is refused, exit 1, naming why; a body that is no placement is a usage error."""
    path, registration = machine(tmp_path, config("v2", ("v1",)))
    wb = Client(nc, prefix)
    await wb.register(registration)
    v1 = registration.sandbox_classes[0].restorable_runtimes[0]
    await wb.create(actor("a-1", golden_snapshot=golden(v1.version)))
    resumed = await asyncio.to_thread(CliRunner().invoke, main, ["actor", "resume", "a-1", "-o", "json", "--nats",
                                                                 nats_url, "--prefix", prefix])
    assert resumed.exit_code == 0, resumed.output
    assignment = json.loads(resumed.stdout)
    assert (assignment["fidelity"], assignment["sandbox_runtime"]["name"]) == ("MEMORY", v1.name)
    ok = await asyncio.to_thread(run_check, path, resumed.stdout.encode())
    assert ok.exit_code == 0, ok.output
    assert ok.stdout == f"ok: worker w-1 on node node-a can carry out a-1's placement (RESTORE at MEMORY under " \
                        f"{v1.name})\n"
    path.write_text(config("v2"))  # v1 dropped; the agent has not registered the change yet
    refused = await asyncio.to_thread(run_check, path, resumed.stdout.encode())
    assert refused.exit_code == 1, refused.output
    assert refused.stderr.startswith(f"error: FAILED_PRECONDITION: worker w-1 cannot carry out a-1's placement "
                                     f"(RESTORE at MEMORY under {v1.name}): no runtime it runs accepts the image's "
                                     "version; refuse it"), refused.stderr
    path.write_text(config("v2").replace('profile = "gvisor"', 'profile = "qemu"', 1))  # no registration made
    unjudged = await asyncio.to_thread(run_check, path, resumed.stdout.encode())
    assert unjudged.exit_code == 1, unjudged.output
    assert unjudged.stderr.startswith("error: FAILED_PRECONDITION: worker w-1 cannot judge the placement: the "
                                      "configuration makes no registration of this machine now ("), unjudged.stderr
    assert "unknown profile 'qemu'" in unjudged.stderr and unjudged.stderr.rstrip().endswith("; refuse it")
    path.write_text(config("v2"))
    bad = await asyncio.to_thread(run_check, path, b'{"actor_id": "a-1"}')
    assert bad.exit_code == 2 and "Invalid value for '--check-placement'" in bad.output
    assert "INVALID_ARGUMENT" in bad.output and "worker_id" in bad.output, bad.output


def test_check_placement_beside_print_registration_is_a_usage_error(tmp_path):
    """Given both, the agent checked the placement and left the registration unprinted, exit 0, without a
    word (a user trial): each prints its answer and exits, so both together are refused, exit 2,
    nothing read from standard input."""
    path, _ = machine(tmp_path, config("v2"))
    both = CliRunner().invoke(main, ["agent", "--worker-id", "w-1", "--node", "node-a", "--config", str(path),
                                     "--cpuinfo", str(CPUINFO), "--arch", "amd64", "--check-placement", "-",
                                     "--print-registration"], input=b"{}", prog_name="warmboot")
    assert both.exit_code == 2, both.output
    assert both.stderr.startswith("Usage: warmboot agent "), both.stderr
    assert both.stderr.endswith("error: give --print-registration or --check-placement, not both (each prints its "
                                "answer and exits)\n"), both.stderr
    assert both.stdout == ""


def test_a_restore_of_a_local_image_on_another_disk_than_the_machine_s_is_refused(tmp_path):
    """Rule 5 with node tokens: the placement names the disk its LOCAL image is on; a machine that registers
    another token (a machine replaced under the worker's id, still registered from its old disk in the
    scheduler's view), or none, refuses it; the same disk passes."""
    _, here = machine(tmp_path, config("v1"))
    v1 = here.sandbox_classes[0].default_runtime
    on_disk_a = msgspec.structs.replace(placement(here, v1), node_token="disk-a")
    assert cannot_carry_out_here(msgspec.structs.replace(here, node_token="disk-a"), on_disk_a) is None
    assert cannot_carry_out_here(msgspec.structs.replace(here, node_token="disk-b"), on_disk_a) == \
        "it restores a LOCAL image on the disk of node token disk-a, and this machine has node token disk-b"
    assert cannot_carry_out_here(here, on_disk_a) == ("it restores a LOCAL image on the disk of node token disk-a, "
                                                      "and this machine has no node token (no --node-token-file)")
    assert cannot_carry_out_here(msgspec.structs.replace(here, node_token="disk-b"), placement(here, v1)) is None


async def test_the_agent_refuses_an_assignment_of_an_image_on_the_disk_its_machine_replaced(stack, nc, prefix,
                                                                                            nats_url, tmp_path):
    """Over the bus: an actor paused on w-1 (disk-a); its resume's Assignment names disk-a. The agent of the
    machine that replaced w-1's, with its own token file, refuses it (exit 1, naming both disks) before the
    registry has its registration; the old machine's token file passes it."""
    path, registration = machine(tmp_path, config("v1"))
    wb = Client(nc, prefix)
    await wb.register(msgspec.structs.replace(registration, node_token="disk-a"))
    await wb.create(actor("a-1", cpu=100, mem=256))
    first = await wb.resume("a-1")
    assert first.node_token is None  # a cold boot restores no image
    await wb.pause("a-1", placement_seq=first.seq)
    resumed = await asyncio.to_thread(CliRunner().invoke, main, ["actor", "resume", "a-1", "-o", "json", "--nats",
                                                                 nats_url, "--prefix", prefix])
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.stdout)["node_token"] == "disk-a"
    for token, status in (("disk-a", 0), ("disk-b", 1)):
        token_file = tmp_path / f"{token}.token"
        token_file.write_text(f"{token}\n")
        checked = await asyncio.to_thread(
            CliRunner().invoke, main, ["agent", "--worker-id", "w-1", "--node", "node-a", "--config", str(path),
                                       "--cpuinfo", str(CPUINFO), "--arch", "amd64", "--node-token-file",
                                       str(token_file), "--check-placement", "-"], input=resumed.stdout.encode())
        assert checked.exit_code == status, checked.output
    assert "it restores a LOCAL image on the disk of node token disk-a, and this machine has node token disk-b" \
        in checked.stderr
