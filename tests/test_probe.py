"""The CPU probe (CONTRACT section 2) on real-looking /proc/cpuinfo samples, and its CLI.

Expected cpu_features values were computed once with an independent FNV-1a
(shell text tools + a one-line fold), not with the code under test.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from events.probe import (
    check_architecture,
    cpuinfo_architecture,
    PROFILES,
    ProbeError,
    cpu_features_hash,
    fnv1a_64,
    host_architecture,
    parse_cpuinfo,
    probe_host,
    probe_version,
    read_cpuinfo,
)
from events.schema import AnyEvent, CompatVersion
from warmboot.cli import main

SAMPLES = Path(__file__).parent / "cpuinfo"


def sample(name: str) -> str:
    return (SAMPLES / name).read_text()


def attrs(version: CompatVersion) -> dict[str, str]:
    return {a.key: a.value for a in version.attributes}


def keys(version: CompatVersion) -> list[str]:
    return [a.key for a in version.attributes]


# --- the hash ------------------------------------------------------------------


def test_contract_test_vector():
    assert cpu_features_hash("fma aes vme fpu avx2 aes") == "0ac853df914e2ca0"


def test_fnv1a_64_standard_vectors():
    assert fnv1a_64(b"") == 0xCBF29CE484222325
    assert fnv1a_64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a_64(b"foobar") == 0x85944171F73967E8


def test_features_hash_ignores_order_duplicates_and_spacing():
    reference = cpu_features_hash("fma aes vme fpu avx2 aes")
    assert cpu_features_hash("aes avx2 fma fpu vme") == reference
    assert cpu_features_hash("  vme\tfpu  fma   avx2 aes aes aes ") == reference
    assert cpu_features_hash("aes avx2 fma fpu") != reference  # one flag fewer
    assert cpu_features_hash("aes avx2 fma fpu vme sse") != reference  # one flag more


def test_features_hash_is_16_lower_hex_digits_with_leading_zeros():
    value = cpu_features_hash("fma aes vme fpu avx2 aes")
    assert value.startswith("0") and len(value) == 16 and value == value.lower()


# --- the samples -----------------------------------------------------------------


def test_intel_xeon():
    text = sample("intel-xeon-8480.txt")
    assert attrs(probe_version(text, "amd64", "gvisor")) == {
        "architecture": "amd64",
        "cpu_features": "4a91bc09ca2d5209",
    }
    assert attrs(probe_version(text, "amd64", "microvm")) == {
        "architecture": "amd64",
        "cpu_vendor": "GenuineIntel",
        "cpu_model": "6/143",
    }


def test_amd_epyc():
    text = sample("amd-epyc-7r13.txt")
    assert attrs(probe_version(text, "amd64", "gvisor")) == {
        "architecture": "amd64",
        "cpu_features": "28d4891cc4b6db3a",
    }
    assert attrs(probe_version(text, "amd64", "microvm")) == {
        "architecture": "amd64",
        "cpu_vendor": "AuthenticAMD",
        "cpu_model": "25/1",
    }


def test_arm64_neoverse_n1():
    text = sample("arm64-neoverse-n1.txt")
    assert attrs(probe_version(text, "arm64", "gvisor")) == {
        "architecture": "arm64",
        "cpu_features": "c67998cdef14d700",
    }
    assert attrs(probe_version(text, "arm64", "microvm")) == {
        "architecture": "arm64",
        "cpu_vendor": "0x41",
        "cpu_model": "0x3/0xd0c",
    }


def test_arm64_without_variant_reports_part_alone():
    text = sample("arm64-neoverse-v1-no-variant.txt")
    assert attrs(probe_version(text, "arm64", "microvm")) == {
        "architecture": "arm64",
        "cpu_vendor": "0x41",
        "cpu_model": "0xd40",
    }
    assert attrs(probe_version(text, "arm64", "gvisor"))["cpu_features"] == "a9b01a4a0937b333"


def test_x86_model_without_family_omits_cpu_model():
    text = sample("x86-model-no-family.txt")
    version = probe_version(text, "amd64", "microvm")
    assert attrs(version) == {"architecture": "amd64", "cpu_vendor": "GenuineIntel"}
    assert attrs(probe_version(text, "amd64", "gvisor"))["cpu_features"] == "36922ae55243a530"


def test_x86_family_without_model_omits_cpu_model():
    text = "vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel name\t: Some CPU\n"
    assert "cpu_model" not in attrs(probe_version(text, "amd64", "microvm"))


def test_x86_non_decimal_family_omits_cpu_model():
    text = "vendor_id\t: GenuineIntel\ncpu family\t: six\nmodel\t\t: 143\n"
    assert "cpu_model" not in attrs(probe_version(text, "amd64", "microvm"))


def test_model_name_is_not_model():
    # `model name` precedes `model` in no sample, but a prefix match would take it
    text = "vendor_id : GenuineIntel\nmodel name : Xeon\ncpu family : 6\nmodel : 85\n"
    assert attrs(probe_version(text, "amd64", "microvm"))["cpu_model"] == "6/85"


def test_arch_decides_which_keys_are_read():
    # an x86 text probed as arm64 has no Features / CPU implementer: nothing invented
    text = sample("intel-xeon-8480.txt")
    assert attrs(probe_version(text, "arm64", "gvisor")) == {"architecture": "arm64"}
    assert attrs(probe_version(text, "arm64", "microvm")) == {"architecture": "arm64"}
    arm = sample("arm64-neoverse-n1.txt")
    assert attrs(probe_version(arm, "amd64", "microvm")) == {"architecture": "amd64"}


def test_a_cpuinfo_names_its_architecture_by_its_keys():
    assert cpuinfo_architecture(parse_cpuinfo(sample("intel-xeon-8480.txt"))) == "amd64"
    assert cpuinfo_architecture(parse_cpuinfo(sample("amd-epyc-7r13.txt"))) == "amd64"
    assert cpuinfo_architecture(parse_cpuinfo(sample("arm64-neoverse-n1.txt"))) == "arm64"
    assert cpuinfo_architecture(parse_cpuinfo(sample("arm64-neoverse-v1-no-variant.txt"))) == "arm64"
    assert cpuinfo_architecture({"processor": "0"}) is None  # neither's keys
    assert cpuinfo_architecture({"flags": "fpu", "Features": "fp"}) is None  # both's: not guessed
    assert cpuinfo_architecture({"flags": "", "Features": "fp"}) == "arm64"  # an empty value is no key


def test_another_architecture_s_cpuinfo_is_refused_naming_what_to_give():
    check_architecture(sample("intel-xeon-8480.txt"), "amd64", "x")  # its own: nothing said
    check_architecture(None, "arm64", "x")  # no cpuinfo: the architecture alone, as before
    check_architecture("processor : 0\n", "arm64", "x")  # no architecture's keys: the probe's warning says it
    with pytest.raises(ProbeError) as refused:
        check_architecture(sample("intel-xeon-8480.txt"), "arm64", "/proc/cpuinfo")
    assert str(refused.value) == (
        "cpuinfo /proc/cpuinfo is an amd64 machine's (it has 'flags' and 'vendor_id'), not arm64's: probed as "
        "arm64 it gives no CPU attribute; give --arch amd64, or the cpuinfo of an arm64 machine")
    with pytest.raises(ProbeError, match="is an arm64 machine's .* give --arch arm64"):
        check_architecture(sample("arm64-neoverse-n1.txt"), "amd64", "f")


# --- parsing rules -----------------------------------------------------------------


def test_first_occurrence_wins():
    text = (
        "processor : 0\nvendor_id : GenuineIntel\ncpu family : 6\nmodel : 143\nflags : fpu vme\n\n"
        "processor : 1\nvendor_id : AuthenticAMD\ncpu family : 25\nmodel : 1\nflags : fpu vme sse\n"
    )
    assert attrs(probe_version(text, "amd64", "microvm")) == {
        "architecture": "amd64",
        "cpu_vendor": "GenuineIntel",
        "cpu_model": "6/143",
    }
    assert attrs(probe_version(text, "amd64", "gvisor"))["cpu_features"] == cpu_features_hash("fpu vme")


def test_split_at_first_colon_and_trim():
    fields = parse_cpuinfo("  CPU implementer\t:  0x41 \nodd key: a: b:c\n")
    assert fields == {"CPU implementer": "0x41", "odd key": "a: b:c"}


def test_empty_value_counts_as_unreadable():
    text = "vendor_id\t:\ncpu family\t: 6\nmodel\t:   \nflags\t\t:\n"
    assert attrs(probe_version(text, "amd64", "microvm")) == {"architecture": "amd64"}
    assert attrs(probe_version(text, "amd64", "gvisor")) == {"architecture": "amd64"}


def test_no_cpuinfo_gives_architecture_alone():
    for profile in ("gvisor", "microvm"):
        version = probe_version(None, "arm64", profile)
        assert version.schema_version == "v1"
        assert attrs(version) == {"architecture": "arm64"}
    assert attrs(probe_version("", "amd64", "microvm")) == {"architecture": "amd64"}


@pytest.mark.parametrize(
    "text",
    ["\x00\x01\x02garbage", "just some words\nwithout any separator\n", "flags : fpu\x00vme\n"],
)
def test_malformed_cpuinfo_is_an_error(text):
    with pytest.raises(ProbeError, match="malformed"):
        probe_version(text, "amd64", "gvisor")


def test_invalid_probed_value_is_an_error_not_an_invented_one():
    text = "vendor_id : " + "G" * 300 + "\n"
    with pytest.raises(ProbeError, match="cpu_vendor"):
        probe_version(text, "amd64", "microvm")


# --- extra attributes and the result's shape ----------------------------------------


def test_extra_attributes_are_added_and_everything_sorted_by_key():
    version = probe_version(
        sample("amd-epyc-7r13.txt"),
        "amd64",
        "microvm",
        {"rootfs_digest": "sha256:22", "kernel_digest": "sha256:11"},
    )
    assert keys(version) == ["architecture", "cpu_model", "cpu_vendor", "kernel_digest", "rootfs_digest"]
    assert attrs(version)["kernel_digest"] == "sha256:11"
    # pairs work as well as a mapping
    assert probe_version(None, "amd64", "gvisor", [("gvisor_asset_hash", "h1")]) == probe_version(
        None, "amd64", "gvisor", {"gvisor_asset_hash": "h1"}
    )


@pytest.mark.parametrize(
    "profile, key",
    [("gvisor", "architecture"), ("gvisor", "cpu_features"), ("microvm", "cpu_vendor"), ("microvm", "cpu_model")],
)
def test_extra_key_colliding_with_a_probed_key_is_an_error(profile, key):
    with pytest.raises(ProbeError, match=f"'{key}' is probed"):
        probe_version(sample("intel-xeon-8480.txt"), "amd64", profile, {key: "x"})
    # also when the probe could not read it: an extra must not stand in for a probe
    with pytest.raises(ProbeError, match=f"'{key}' is probed"):
        probe_version(None, "amd64", profile, {key: "x"})


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"Kernel": "x"}, "key 'Kernel' is invalid"),
        ({"1abc": "x"}, "key '1abc' is invalid"),
        ({"k\n": "x"}, "is invalid"),
        ({"k": ""}, "invalid value"),
        ({"k": "a\tb"}, "invalid value"),
        ({"k": "v" * 257}, "invalid value"),
        ([("k", "a"), ("k", "b")], "given twice"),
        ({f"k{i}": "v" for i in range(32)}, "at most 32"),
    ],
)
def test_invalid_extra_attributes(extra, message):
    with pytest.raises(ProbeError, match=message):
        probe_version(None, "amd64", "gvisor", extra)


def test_31_extras_fill_the_32_attribute_limit():
    version = probe_version(None, "amd64", "gvisor", {f"k{i:02}": "v" for i in range(31)})
    assert len(version.attributes) == 32


def test_unknown_profile_and_architecture():
    with pytest.raises(ProbeError, match="unknown profile"):
        probe_version(None, "amd64", "firecracker")
    with pytest.raises(ProbeError, match="unknown architecture"):
        probe_version(None, "x86_64", "gvisor")


def test_host_architecture_uses_go_naming():
    assert host_architecture("x86_64") == "amd64"
    assert host_architecture("aarch64") == "arm64"
    assert host_architecture("arm64") == "arm64"
    with pytest.raises(ProbeError, match="unsupported machine type 'riscv64'"):
        host_architecture("riscv64")
    assert host_architecture() == {"x86_64": "amd64", "aarch64": "arm64"}[platform.machine()]


# --- reading files ---------------------------------------------------------------------


def test_read_cpuinfo(tmp_path):
    assert read_cpuinfo(tmp_path / "absent") is None
    with pytest.raises(ProbeError, match="directory"):
        read_cpuinfo(tmp_path)
    junk = tmp_path / "junk"
    junk.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ProbeError, match="not UTF-8"):
        read_cpuinfo(junk)
    with pytest.raises(ProbeError, match="cannot read"):
        read_cpuinfo(junk / "below-a-file")  # a path through a file: misconfigured, not missing
    assert read_cpuinfo(SAMPLES / "arm64-neoverse-n1.txt") == sample("arm64-neoverse-n1.txt")


def test_probe_host_reads_a_given_file():
    version = probe_host("microvm", {"kernel_digest": "k"}, cpuinfo_path=SAMPLES / "arm64-neoverse-n1.txt", architecture="arm64")
    assert attrs(version) == {"architecture": "arm64", "cpu_vendor": "0x41", "cpu_model": "0x3/0xd0c", "kernel_digest": "k"}


# --- the command line ------------------------------------------------------------------


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_cli_probe_sample_prints_compat_version_json():
    result = run("probe", "--profile", "microvm", "--cpuinfo", str(SAMPLES / "intel-xeon-8480.txt"), "--arch", "amd64",
                 "--attr", "kernel_digest=sha256:abc=def")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {
        "schema_version": "v1",
        "attributes": [
            {"key": "architecture", "value": "amd64"},
            {"key": "cpu_model", "value": "6/143"},
            {"key": "cpu_vendor", "value": "GenuineIntel"},
            {"key": "kernel_digest", "value": "sha256:abc=def"},  # split at the first '='
        ],
    }


def test_cli_a_given_cpuinfo_that_is_not_there_is_a_usage_error_naming_it(tmp_path):
    """`probe --cpuinfo /nonexistent` printed the architecture alone, exit 0 (a user trial): a mistyped
    path read as a machine without CPU attributes. A path given must be a readable file: a usage error
    naming --cpuinfo, exit 2, nothing printed on stdout."""
    for given, says in ((tmp_path / "nope", "does not exist"), (tmp_path, "is a directory")):
        result = run("probe", "--profile", "gvisor", "--cpuinfo", str(given), "--arch", "arm64")
        assert result.exit_code == 2, result.output
        assert result.stdout == ""
        assert f"error: Invalid value for '--cpuinfo': File '{given}' {says}." in result.stderr, result.stderr


def test_cli_no_cpuinfo_on_the_machine_gives_architecture_only(tmp_path, monkeypatch):
    """Without --cpuinfo, a machine with no /proc/cpuinfo (its default) reports the architecture alone,
    and says so on stderr."""
    from warmboot.cmd_foundation import probe

    (option,) = [p for p in probe.params if p.name == "cpuinfo_path"]
    monkeypatch.setattr(option, "default", tmp_path / "nope")  # as /proc/cpuinfo on a machine without one
    result = run("probe", "--profile", "gvisor", "--arch", "arm64")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"schema_version": "v1", "attributes": [{"key": "architecture", "value": "arm64"}]}
    assert result.stderr.startswith(f"warning: {tmp_path / 'nope'} gave no cpu_features (missing, unreadable")
    whole = run("probe", "--profile", "microvm", "--cpuinfo", str(SAMPLES / "intel-xeon-8480.txt"), "--arch", "amd64")
    assert whole.exit_code == 0 and whole.stderr == ""


def test_cli_arch_of_another_machine_than_its_cpuinfo_is_an_error():
    """`probe --arch arm64` on an amd64 machine said its cpuinfo was missing or unreadable (a
    walkthrough) and printed a version naming no CPU: now an error naming what to give."""
    path = SAMPLES / "intel-xeon-8480.txt"
    for profile in PROFILES:
        result = run("probe", "--profile", profile, "--cpuinfo", str(path), "--arch", "arm64")
        assert result.exit_code == 1 and result.stdout == ""
        assert result.stderr == (f"error: cpuinfo {path} is an amd64 machine's (it has 'flags' and 'vendor_id'), not "
                                 "arm64's: probed as arm64 it gives no CPU attribute; give --arch amd64, or the "
                                 "cpuinfo of an arm64 machine\n")
    arm = run("probe", "--profile", "gvisor", "--cpuinfo", str(SAMPLES / "arm64-neoverse-n1.txt"), "--arch", "arm64")
    assert arm.exit_code == 0 and arm.stderr == ""


def test_cli_binary_junk_is_an_error(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(os.urandom(64) + b"\xff\xfe\x00")
    result = run("probe", "--profile", "microvm", "--cpuinfo", str(junk))
    assert result.exit_code != 0
    assert result.stdout == ""
    assert "malformed" in result.stderr


def test_cli_ascii_junk_without_fields_is_an_error(tmp_path):
    junk = tmp_path / "junk.txt"
    junk.write_bytes(b"\x01\x02\x03 not a cpuinfo\n")
    result = run("probe", "--profile", "microvm", "--cpuinfo", str(junk))
    assert result.exit_code != 0 and "malformed" in result.stderr


@pytest.mark.parametrize(
    "attr, message",
    [
        ("no_equals_sign", "is not KEY=VALUE"),
        ("=value", "is not KEY=VALUE"),
        ("BadKey=1", "key 'BadKey' is invalid"),
        ("cpu_features=1", "'cpu_features' is probed"),
        ("k=", "invalid value"),
    ],
)
def test_cli_bad_attr(attr, message):
    result = run("probe", "--profile", "gvisor", "--cpuinfo", str(SAMPLES / "amd-epyc-7r13.txt"), "--attr", attr)
    assert result.exit_code != 0
    assert result.stdout == ""
    assert message in result.stderr


def test_cli_duplicate_attr():
    result = run("probe", "--profile", "gvisor", "--attr", "k=1", "--attr", "k=2")
    assert result.exit_code != 0 and "given twice" in result.stderr


def test_cli_bad_profile_and_arch():
    assert run("probe", "--profile", "qemu").exit_code == 2
    assert run("probe", "--profile", "gvisor", "--arch", "x86_64").exit_code == 2
    assert run("probe").exit_code == 2  # --profile is required


def _cpuinfo_field(text: str, key: str) -> str:
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    raise AssertionError(f"{key} not in this machine's cpuinfo")


@pytest.mark.parametrize("profile", ["gvisor", "microvm"])
def test_installed_command_on_this_machine(profile):
    """`warmboot probe` as installed, on this machine's /proc/cpuinfo and architecture."""
    warmboot = Path(sys.executable).parent / "warmboot"
    done = subprocess.run([str(warmboot), "probe", "--profile", profile], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["schema_version"] == "v1"
    values = {a["key"]: a["value"] for a in got["attributes"]}
    assert [a["key"] for a in got["attributes"]] == sorted(values)
    arch = {"x86_64": "amd64", "aarch64": "arm64"}[platform.machine()]
    assert values["architecture"] == arch
    cpuinfo = Path("/proc/cpuinfo").read_text()
    if profile == "gvisor":
        flags = _cpuinfo_field(cpuinfo, "flags" if arch == "amd64" else "Features")
        assert values["cpu_features"] == cpu_features_hash(flags)
        assert set(values) == {"architecture", "cpu_features"}
    else:
        vendor = _cpuinfo_field(cpuinfo, "vendor_id" if arch == "amd64" else "CPU implementer")
        assert values["cpu_vendor"] == vendor
        if arch == "amd64":
            family, model = _cpuinfo_field(cpuinfo, "cpu family"), _cpuinfo_field(cpuinfo, "model")
            assert values["cpu_model"] == f"{int(family)}/{int(model)}"
        assert set(values) <= {"architecture", "cpu_vendor", "cpu_model"}


def test_cli_schema_lists_every_event_type():
    result = run("schema")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    event_names = [cls.__name__ for cls in AnyEvent.__args__]
    defs = doc["$defs"]

    def members(union: str) -> list[str]:
        return [ref["$ref"].rsplit("/", 1)[1] for ref in defs[union]["anyOf"]]

    assert members("AnyEvent") == event_names
    for name in [*event_names, *members("AnyRequest"), *members("AnyReply"), "CompatVersion", "Attribute"]:
        assert name in defs, name
    # each event's schema pins its `type` tag to its own name
    registered = doc["$defs"]["WorkerRegistered"]
    assert registered["properties"]["type"]["enum"] == ["WorkerRegistered"]
    assert "type" in registered["required"]
    # constraints made it into the schema
    attr_key = doc["$defs"]["Attribute"]["properties"]["key"]
    assert attr_key["pattern"].startswith("^[a-z]")
    assert doc["$defs"]["CompatVersion"]["properties"]["attributes"]["maxItems"] == 32


def test_probe_warning_when_one_cpu_attribute_is_missing_does_not_say_the_version_names_no_cpu(tmp_path):
    """The agent (`_cpu_unnamed`) refuses only a version naming none of the CPU keys: a cpuinfo with
    vendor_id but no family or model gives cpu_vendor, and the warning names what is missing only
    (it said "names no CPU": a review)."""
    import json

    from click.testing import CliRunner

    from warmboot.cli import main

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse\n\n")
    result = CliRunner().invoke(main, ["probe", "--profile", "microvm", "--cpuinfo", str(info), "--arch", "amd64"])
    assert result.exit_code == 0, result.output
    keys = [a["key"] for a in json.loads(result.stdout)["attributes"]]
    assert "cpu_vendor" in keys  # it names the CPU's vendor
    assert "names no CPU" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"warning: {info} gave no cpu_model (missing, unreadable")
