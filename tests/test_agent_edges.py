"""The agent's `compatible_versions` (one-way edges, CONTRACT v1.1): declared per runtime in
its TOML file, validated like everything else (a bad entry names its field), registered,
and used by the scheduler."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from events.errors import ContractError
from events.probe import probe_version
from events.schema import Attribute, CompatVersion, ErrorCode, RuntimeChanged, WorkerRegistered, WorkerRemoved
from tests.factories import actor, golden
from tests.registry_helpers import AMD, CPUINFO, PROBE, agent_config, wait_event
from tests.test_agent import agent_running, probed, running_agent
from warmboot.agent import Agent
from warmboot.agent_config import ConfigError, ProbeSettings, load_registration
from warmboot.client import Client

ROOT = Path(__file__).parent.parent
OLD_CPU = "5f1d0c3b2a994e17"  # the previous generation's cpu_features


def literal(asset: str, cpu_features: str = OLD_CPU) -> str:
    return (f'schema_version = "v1"\nattributes = {{ architecture = "amd64", cpu_features = "{cpu_features}", '
            f'gvisor_asset_hash = "{asset}" }}\n')


def with_edges(text: str, *edges: str, where: str = "default_runtime") -> str:
    """`text` (agent_config's) with these edge tables under its first class's `where` runtime."""
    block = "".join(f"\n[[sandbox_classes.{where}.compatible_versions]]\n{edge}" for edge in edges)
    return text + block


def old_version(asset: str) -> CompatVersion:
    pairs = {"architecture": "amd64", "cpu_features": OLD_CPU, "gvisor_asset_hash": asset}
    return CompatVersion(schema_version="v1", attributes=tuple(Attribute(key=k, value=v) for k, v in pairs.items()))


def test_the_example_declares_an_edge_to_the_previous_cpu_generation():
    registration = load_registration(ROOT / "examples" / "agent.toml", "w-17", "node-a", PROBE)
    gvisor = next(c for c in registration.sandbox_classes if c.sandbox_class == "gvisor")
    (edge,) = gvisor.default_runtime.compatible_versions
    attrs = {a.key: a.value for a in edge.attributes}
    own = {a.key: a.value for a in gvisor.default_runtime.version.attributes}
    assert attrs["cpu_features"] == OLD_CPU != own["cpu_features"]  # another CPU, the same release
    assert attrs["gvisor_asset_hash"] == own["gvisor_asset_hash"]


def test_edges_load_probed_or_literal(tmp_path):
    path = tmp_path / "agent.toml"
    text = with_edges(agent_config("v2", ("v1",)), literal("v2"), 'profile = "gvisor"\n'
                      'attributes = { gvisor_asset_hash = "v0" }\n')
    path.write_text(with_edges(text, literal("v1"), where="restorable_runtimes"))
    entry = load_registration(path, "w-a", "node-a", PROBE).sandbox_classes[0]
    assert set(entry.default_runtime.compatible_versions) == {old_version("v2"), probed("v0")}
    assert entry.restorable_runtimes[0].compatible_versions == (old_version("v1"),)


@pytest.mark.parametrize(
    "edges, where, field",
    [
        ((literal("v1").replace("schema_version", "schema_verison"),), "default_runtime",
         "sandbox_classes[0].default_runtime.compatible_versions[0]: Object contains unknown field `schema_verison`"),
        (('profile = "qemu"\n',), "default_runtime", "sandbox_classes[0].default_runtime.compatible_versions[0].profile"),
        (('profile = "gvisor"\nattributes = { gvisor_asset_hash = "v1" }\n',), "default_runtime",
         "sandbox_classes[0].default_runtime.compatible_versions[0]"),  # equal to the runtime's own version
        ((literal("v0"), literal("v0")), "default_runtime", "sandbox_classes[0].default_runtime.compatible_versions[1]"),
        (('schema_version = "v1"\nattributes = { gvisor_asset_hash = "v0" }\n',), "restorable_runtimes",
         "sandbox_classes[0].restorable_runtimes[0].compatible_versions[0].attributes"),  # v1 needs architecture
        (('attributes = { architecture = "amd64", cpu_features = "" }\n',), "default_runtime",
         "sandbox_classes[0].default_runtime.compatible_versions[0].attributes"),
    ],
    ids=["unknown-key", "profile", "equals-own-version", "duplicate", "no-architecture", "empty-value"],
)
def test_a_bad_edge_names_its_field(tmp_path, edges, where, field):
    path = tmp_path / "agent.toml"
    path.write_text(with_edges(agent_config("v1", ("v0",)), *edges, where=where))
    with pytest.raises(ConfigError) as error:
        load_registration(path, "w-a", "node-a", PROBE)
    assert field in str(error.value)


def test_an_architecture_spelled_otherwise_is_refused_for_new_stamps_and_warned_of_for_old_ones(tmp_path, caplog):
    """A literal version whose architecture is spelled as `uname -m` does (`x86_64`) or in
    capitals never equals a probed version. As a default runtime's version (what new snapshots
    are stamped with) it is refused, naming the field; as an edge or a restorable runtime
    (snapshots stamped with it before may exist) it is registered, with a warning."""
    import logging

    path = tmp_path / "agent.toml"
    literal_default = agent_config("v1").replace(
        'profile = "gvisor"\nattributes = { gvisor_asset_hash = "v1" }',
        'attributes = { architecture = "x86_64", gvisor_asset_hash = "v1" }', 1)
    assert literal_default != agent_config("v1")
    path.write_text(literal_default)
    with pytest.raises(ConfigError) as error:
        load_registration(path, "w-a", "node-a", PROBE)
    assert str(error.value) == (f"{path}: sandbox_classes[0].default_runtime.attributes.architecture: 'x86_64' is the "
                                "machine's name; schema v1 names it 'amd64', as the probe reports it, so this "
                                "version never equals a probed one")

    caplog.set_level(logging.WARNING, logger="warmboot.agent")
    edge = 'attributes = { architecture = "AMD64", gvisor_asset_hash = "v0" }\n'
    path.write_text(with_edges(agent_config("v1", ("v0",)), edge, where="restorable_runtimes"))
    registration = load_registration(path, "w-a", "node-a", PROBE)
    (restorable,) = registration.sandbox_classes[0].restorable_runtimes
    assert dict((a.key, a.value) for a in restorable.compatible_versions[0].attributes)["architecture"] == "AMD64"
    warned = [r.getMessage() for r in caplog.records if "AMD64" in r.getMessage()]
    assert warned == [f"{path}: sandbox_classes[0].restorable_runtimes[0].compatible_versions[0].attributes."
                      "architecture: 'AMD64': schema v1 spells it 'amd64', as the probe reports it, so this version "
                      "never equals a probed one; kept, to restore snapshots stamped with it"]
    load_registration(path, "w-a", "node-a", PROBE)  # read again, as every watch interval: not warned again
    assert len([r for r in caplog.records if "AMD64" in r.getMessage()]) == 1


def literal_default(attributes: str, masked: bool = False) -> str:
    """agent_config's default runtime (gvisor, asset v1), given literally with `attributes` (TOML
    `key = "value"` pairs), masked or not."""
    text = agent_config("v1").replace('profile = "gvisor"\nattributes = { gvisor_asset_hash = "v1" }',
                                      f"attributes = {{ {attributes} }}" + ("\ncpu_masked = true" if masked else ""), 1)
    assert text != agent_config("v1")
    return text


def literal_runtime(cpu_features: str, masked: bool = False, architecture: str = "amd64") -> str:
    """agent_config's default runtime (gvisor, asset v1), given literally with these CPU attributes."""
    return literal_default(f'architecture = "{architecture}", cpu_features = "{cpu_features}", '
                           'gvisor_asset_hash = "v1"', masked)


def test_a_literal_runtime_naming_another_cpu_is_refused_unless_masked(tmp_path):
    """A default or restorable runtime is run as its version both ways: an actor restored under it
    keeps it, and its next snapshot, taken here, is stamped with it and sent to machines of the CPU
    it names. Literal CPU attributes other than this machine's are refused, naming the field and
    the way out (`cpu_masked` if the runtime runs actors on that CPU's features, or an edge); this
    machine's own, copied from --print-registration, are taken; an edge may name any CPU. The
    architecture is never masked."""
    path = tmp_path / "agent.toml"
    mine = {a.key: a.value for a in probed("v1").attributes}["cpu_features"]
    path.write_text(literal_runtime(OLD_CPU))
    with pytest.raises(ConfigError) as error:
        load_registration(path, "w-a", "node-a", PROBE)
    assert str(error.value).startswith(f"{path}: sandbox_classes[0].default_runtime.attributes.cpu_features: "
                                       f"'{OLD_CPU}' is not this machine's ('{mine}', as the gvisor probe reads it)")
    assert "cpu_masked = true" in str(error.value) and "compatible_versions" in str(error.value)
    path.write_text(literal_runtime(OLD_CPU, masked=True))
    entry = load_registration(path, "w-a", "node-a", PROBE).sandbox_classes[0]
    assert {a.key: a.value for a in entry.default_runtime.version.attributes}["cpu_features"] == OLD_CPU
    path.write_text(literal_runtime(mine))  # this machine's reading, written out
    assert load_registration(path, "w-a", "node-a", PROBE).sandbox_classes[0].default_runtime.version == probed("v1")
    path.write_text(literal_runtime(mine, masked=True, architecture="arm64"))
    with pytest.raises(ConfigError) as error:
        load_registration(path, "w-a", "node-a", PROBE)
    assert "attributes.architecture: 'arm64' is not this machine's ('amd64'" in str(error.value)
    assert "never crosses architectures" in str(error.value)

    restorable = f'name = "old"\n{literal("v0")}'
    path.write_text(agent_config("v1") + f"\n[[sandbox_classes.restorable_runtimes]]\n{restorable}")
    with pytest.raises(ConfigError) as error:
        load_registration(path, "w-a", "node-a", PROBE)
    assert "sandbox_classes[0].restorable_runtimes[0].attributes.cpu_features" in str(error.value)
    path.write_text(with_edges(agent_config("v1"), literal("v0")))  # an edge: one way, any CPU
    assert load_registration(path, "w-a", "node-a", PROBE).sandbox_classes[0].default_runtime.compatible_versions

    path.write_text(agent_config("v1").replace('profile = "gvisor"', 'profile = "gvisor"\ncpu_masked = true', 1))
    with pytest.raises(ConfigError) as error:  # a probed runtime's CPU is this machine's: nothing to mask
        load_registration(path, "w-a", "node-a", PROBE)
    assert str(error.value).startswith(f"{path}: sandbox_classes[0].default_runtime.cpu_masked:")


def test_a_literal_runtime_naming_no_cpu_key_is_refused_unless_masked(tmp_path):
    """A literal default or restorable runtime that names only the architecture and its assets has
    the same version on every machine of that architecture, whatever its CPU: an Intel and an AMD
    worker so configured looked alike to the scheduler, and the images of one were sent to the other
    (found by an audit). Refused, naming the field and the ways out; taken when the runtime says it
    masks the CPU, or names a CPU key (this machine's)."""
    path = tmp_path / "agent.toml"
    path.write_text(literal_default('architecture = "amd64", gvisor_asset_hash = "v1"'))
    with pytest.raises(ConfigError) as error:
        load_registration(path, "w-a", "node-a", PROBE)
    assert str(error.value).startswith(f"{path}: sandbox_classes[0].default_runtime.attributes: names none of "
                                       "the CPU's keys (cpu_features, cpu_model, cpu_vendor)"), error.value
    assert "profile" in str(error.value) and "cpu_masked = true" in str(error.value)
    restorable = ('name = "old"\nschema_version = "v1"\n'
                  'attributes = { architecture = "amd64", gvisor_asset_hash = "v0" }')
    path.write_text(agent_config("v1") + f"\n[[sandbox_classes.restorable_runtimes]]\n{restorable}")
    with pytest.raises(ConfigError) as error:
        load_registration(path, "w-a", "node-a", PROBE)
    assert str(error.value).startswith(f"{path}: sandbox_classes[0].restorable_runtimes[0].attributes: names none"), \
        error.value
    path.write_text(literal_default('architecture = "amd64", gvisor_asset_hash = "v1"', masked=True))
    entry = load_registration(path, "w-a", "node-a", PROBE).sandbox_classes[0]
    assert {a.key for a in entry.default_runtime.version.attributes} == {"architecture", "gvisor_asset_hash"}
    mine = {a.key: a.value for a in probed("v1").attributes}["cpu_features"]
    path.write_text(literal_runtime(mine))
    assert load_registration(path, "w-a", "node-a", PROBE).sandbox_classes[0].default_runtime.version == probed("v1")


@pytest.mark.parametrize("attributes, key", [
    ('architecture = "amd64", cpu_vendor = "AuthenticAMD", kernel_digest = "k"', "cpu_vendor"),
    ('architecture = "amd64", cpu_model = "25/1", kernel_digest = "k"', "cpu_model"),
    ('architecture = "amd64", cpu_vendor = "GenuineIntel", cpu_model = "25/1", kernel_digest = "k"', "cpu_model"),
])
def test_a_literal_runtime_naming_part_of_a_profile_otherwise_than_this_machine_is_refused(tmp_path, attributes,
                                                                                           key):
    """The sample machine is a GenuineIntel 6/143. A runtime naming some of the microvm profile's keys,
    one of them another CPU's, was taken unchecked (only one naming every key was compared; found by
    a review): its actors' next snapshots, taken here, were stamped AMD and sent to AMD machines
    registering the same literal version. Now every key it names is compared; masked, it is taken."""
    path = tmp_path / "agent.toml"
    path.write_text(literal_default(attributes))
    with pytest.raises(ConfigError) as error:
        load_registration(path, "w-a", "node-a", PROBE)
    assert str(error.value).startswith(f"{path}: sandbox_classes[0].default_runtime.attributes.{key}: ")
    assert "as the microvm probe reads it" in str(error.value)
    path.write_text(literal_default(attributes, masked=True))
    load_registration(path, "w-a", "node-a", PROBE)
    path.write_text(literal_default('architecture = "amd64", cpu_vendor = "GenuineIntel", cpu_model = "6/143", '
                                    'kernel_digest = "k"'))
    load_registration(path, "w-a", "node-a", PROBE)  # what it names is this machine's, all of the profile's keys


@pytest.mark.parametrize("named", ['cpu_vendor = "GenuineIntel"', 'cpu_model = "6/143"'])
@pytest.mark.parametrize("table", ["default", "restorable"])
def test_a_literal_runtime_naming_this_machine_s_cpu_in_part_is_refused_unless_masked(tmp_path, named, table):
    """`cpu_vendor = "GenuineIntel"` alone (this machine's) made a version equal to that of every Intel
    machine whose file says the same, whatever its model: the memory images of a newer model were sent to
    an older one, where they crash (found by an audit; a probed runtime that reads no `cpu_model` was
    refused, its literal copy taken). Refused, naming what it names and what one profile needs; taken
    with the profile's other key, with `cpu_features` (the gvisor profile's), or masked."""
    path = tmp_path / "agent.toml"
    attributes = f'architecture = "amd64", {named}, kernel_digest = "k"'

    def write(attributes: str, masked: bool = False) -> None:
        if table == "default":
            path.write_text(literal_default(attributes, masked))
        else:
            path.write_text(agent_config("v1") + '\n[[sandbox_classes.restorable_runtimes]]\nname = "old"\n'
                            f'schema_version = "v1"\nattributes = {{ {attributes} }}\n'
                            + ("cpu_masked = true\n" if masked else ""))

    write(attributes)
    with pytest.raises(ConfigError) as error:
        load_registration(path, "w-a", "node-a", PROBE)
    field = "default_runtime" if table == "default" else "restorable_runtimes[0]"
    key = named.split(" ")[0]
    assert str(error.value).startswith(f"{path}: sandbox_classes[0].{field}.attributes: names {key} of the CPU but "
                                       "not all of one profile's keys (cpu_features (as the gvisor probe reads "
                                       "them) or cpu_vendor and cpu_model (as the microvm probe reads them))"), \
        error.value
    assert "--print-registration" in str(error.value) and "cpu_masked = true" in str(error.value)
    write(attributes, masked=True)
    load_registration(path, "w-a", "node-a", PROBE)
    write('architecture = "amd64", cpu_vendor = "GenuineIntel", cpu_model = "6/143", kernel_digest = "k"')
    load_registration(path, "w-a", "node-a", PROBE)
    mine = {a.key: a.value for a in probed("v1").attributes}["cpu_features"]
    write(f'{attributes}, cpu_features = "{mine}"')
    load_registration(path, "w-a", "node-a", PROBE)


@pytest.mark.parametrize("attributes", ['architecture = "arm64", gvisor_asset_hash = "v1"',
                                        'architecture = "arm64", cpu_vendor = "0x41", kernel_digest = "k"'])
def test_a_literal_runtime_of_another_architecture_is_refused_whatever_else_it_names(tmp_path, attributes):
    """Not every key of a profile given, the architecture alone is compared (a review found these taken:
    the registry then held the amd64 worker as arm64, and arm64 images would have been sent to it)."""
    path = tmp_path / "agent.toml"
    path.write_text(literal_default(attributes, masked=True))
    with pytest.raises(ConfigError) as error:
        load_registration(path, "w-a", "node-a", PROBE)
    assert str(error.value).startswith(f"{path}: sandbox_classes[0].default_runtime.attributes.architecture: "
                                       "'arm64' is not this machine's ('amd64')")


def test_an_agent_given_another_architecture_than_its_cpuinfo_s_registers_nothing(tmp_path):
    """`agent --arch amd64` reading an arm64 machine's cpuinfo made a version naming no CPU (the
    amd64 keys are not in it); now the probe's error says which architecture the file is."""
    from warmboot.agent_config import ProbeSettings

    path = tmp_path / "agent.toml"
    path.write_text(agent_config("v1"))
    arm = Path(__file__).parent / "cpuinfo" / "arm64-neoverse-n1.txt"
    with pytest.raises(ConfigError, match=r"default_runtime: cpuinfo .* is an arm64 machine's "
                                          r"\(it has 'Features' and 'CPU implementer'\), not "
                                          r"amd64's: .* give --arch arm64"):
        load_registration(path, "w-a", "node-a", ProbeSettings(cpuinfo_path=arm, architecture="amd64"))
    assert load_registration(path, "w-a", "node-a", ProbeSettings(cpuinfo_path=arm, architecture="arm64"))


def test_a_literal_runtime_is_taken_when_the_probe_cannot_read_the_machine(tmp_path):
    """Where the probe reads nothing (no cpuinfo), a literal version is the way to register: not checked."""
    from warmboot.agent_config import ProbeSettings

    path = tmp_path / "agent.toml"
    path.write_text(literal_runtime(OLD_CPU))
    nowhere = ProbeSettings(cpuinfo_path=tmp_path / "no-cpuinfo", architecture="amd64")
    entry = load_registration(path, "w-a", "node-a", nowhere).sandbox_classes[0]
    assert {a.key: a.value for a in entry.default_runtime.version.attributes}["cpu_features"] == OLD_CPU


async def test_an_agent_registers_its_edge_and_the_scheduler_restores_through_it(stack, nats_url, nc, prefix,
                                                                                tmp_path):
    """A v1 image taken on the previous CPU generation restores from memory on this worker's v1
    through its edge; dropping the edge from the file is a runtime change."""
    wb = Client(nc, prefix)
    path = tmp_path / "agent.toml"
    path.write_text(with_edges(agent_config("v1"), literal("v1")))
    async with running_agent(nats_url, prefix, path):
        seq, registered = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        assert registered.sandbox_classes[0].default_runtime.compatible_versions == (old_version("v1"),)
        await wb.create(actor("a", golden_snapshot=golden(old_version("v1"))))
        placed = await wb.resume("a", min_seq=seq)
        assert (placed.worker_id, placed.fidelity.value, placed.matched_version) == ("w-a", "MEMORY",
                                                                                   old_version("v1"))
        assert placed.sandbox_runtime.version == probed("v1")  # pinned to this worker's own version
        frag = (await wb.fragmentation("gvisor")).classes[0]
        old = next(r for r in frag.runtimes if r.version == old_version("v1"))
        assert (old.workers_default, old.workers_compatible) == (0, 1)

        path.write_text(agent_config("v1"))  # the edge withdrawn
        _, changed = await wait_event(nc, prefix, "w-a", RuntimeChanged, after=seq)
        assert changed.sandbox_classes[0].default_runtime.compatible_versions == ()


async def test_a_machine_moved_to_the_cpu_its_edge_names_is_removed_at_once(stack, nats_url, nc, prefix, tmp_path):
    """A walkthrough: the machine moves to the CPU its default's edge names (a VM migrated from an
    Intel host to an AMD one), so the file's registration of it is invalid (the edge is the default's
    own version). That was taken for a probe that could not read the machine: the Intel runtime stayed
    registered for the grace (10 s), and MEMORY resumes of Intel images were placed there. The probe
    read the machine fine: the worker is removed at once (here the grace is 10 minutes)."""
    amd = {a.key: a.value for a in probe_version(AMD.read_text(), "amd64", "gvisor").attributes}["cpu_features"]
    cpuinfo, path = tmp_path / "cpuinfo", tmp_path / "agent.toml"
    shutil.copy(CPUINFO, cpuinfo)
    path.write_text(with_edges(agent_config("v1"), literal("v1", amd)))
    agent = Agent(nats_url, "w-a", "node-a", path, prefix=prefix, watch_interval_s=0.05, probe_interval_s=0.05,
                  unreadable_grace_s=600.0, probe=ProbeSettings(cpuinfo_path=cpuinfo, architecture="amd64"))
    wb = Client(nc, prefix)
    async with agent_running(agent):
        seq, _ = await wait_event(nc, prefix, "w-a", WorkerRegistered)
        await wb.create(actor("a", golden_snapshot=golden(probed("v1"))))  # an Intel image
        shutil.copy(AMD, cpuinfo)  # the machine is AMD now
        seq, removed = await wait_event(nc, prefix, "w-a", WorkerRemoved, after=seq)
        assert removed.reason.startswith("its agent cannot register the CPU its machine has now: ")
        assert "compatible version equals the runtime's own version" in removed.reason
        with pytest.raises(ContractError) as refused:  # nowhere to load the Intel image: not placed
            await wb.resume("a", min_seq=seq)
        assert refused.value.code is ErrorCode.RESOURCE_EXHAUSTED
