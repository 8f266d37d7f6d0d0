"""The one compatibility rule (CONTRACT section 2): exact equality of class, schema version
and attribute set; `name` and `actor_overhead` never take part."""

from __future__ import annotations

import pytest

from events.compat import canonical_version, compat_key, matches, pin_of, same_version, stamp_key
from events.schema import ActorOverhead, ActorRuntime, Attribute, CompatVersion, WorkerRuntime, WorkerSandboxClass


def version(*pairs: tuple[str, str], schema: str = "v1") -> CompatVersion:
    return CompatVersion(schema_version=schema, attributes=tuple(Attribute(key=k, value=v) for k, v in pairs))


BASE = (("architecture", "amd64"), ("cpu_features", "0ac853df914e2ca0"), ("gvisor_asset_hash", "h1"))
OTHER = (("architecture", "amd64"), ("cpu_features", "0ac853df914e2ca0"), ("gvisor_asset_hash", "h0"))


def stamp(*pairs: tuple[str, str], sandbox_class: str = "gvisor", schema: str = "v1", name: str | None = "runsc-new") -> ActorRuntime:
    return ActorRuntime(sandbox_class=sandbox_class, name=name, version=version(*(pairs or BASE), schema=schema))


def worker_runtime(*pairs: tuple[str, str], schema: str = "v1", name: str | None = "runsc-new", fixed_mib: int = 0) -> WorkerRuntime:
    return WorkerRuntime(
        name=name,
        version=version(*(pairs or BASE), schema=schema),
        actor_overhead=ActorOverhead(fixed_mib=fixed_mib, per_gib_mib=0),
    )


def entry(default: WorkerRuntime, *restorable: WorkerRuntime, sandbox_class: str = "gvisor") -> WorkerSandboxClass:
    return WorkerSandboxClass(sandbox_class=sandbox_class, default_runtime=default, restorable_runtimes=restorable)


# --- equality --------------------------------------------------------------------------------


def test_identical_runtime_matches_the_default():
    default = worker_runtime()
    assert matches(stamp(), entry(default)) is default


def test_attribute_order_is_ignored():
    default = worker_runtime(*BASE)
    assert matches(stamp(*reversed(BASE)), entry(default)) is default
    assert matches(stamp(BASE[1], BASE[2], BASE[0]), entry(default)) is default
    assert compat_key("gvisor", version(*BASE)) == compat_key("gvisor", version(*reversed(BASE)))
    assert same_version(version(*BASE), version(*reversed(BASE)))


def test_name_is_ignored():
    default = worker_runtime(name="runsc-release-20240101")
    assert matches(stamp(name="something else entirely"), entry(default)) is default
    assert matches(stamp(name=None), entry(default)) is default
    assert matches(stamp(name="x"), entry(worker_runtime(name=None))) is not None


def test_actor_overhead_is_ignored():
    heavy = worker_runtime(fixed_mib=512)
    assert matches(stamp(), entry(heavy)) is heavy
    bare = WorkerRuntime(version=version(*BASE))  # no overhead at all
    assert matches(stamp(), entry(bare)) is bare


def test_schema_version_differs():
    assert matches(stamp(schema="v2"), entry(worker_runtime(schema="v1"))) is None
    assert matches(stamp(schema="v1"), entry(worker_runtime(schema="v2"))) is None
    assert compat_key("gvisor", version(*BASE, schema="v1")) != compat_key("gvisor", version(*BASE, schema="v2"))


def test_unknown_schema_versions_match_by_exact_equality():
    default = worker_runtime(("anything", "x"), schema="v7")
    assert matches(stamp(("anything", "x"), schema="v7"), entry(default)) is default


def test_extra_key_on_the_stamp_side():
    assert matches(stamp(*BASE, ("kernel_digest", "k")), entry(worker_runtime(*BASE))) is None


def test_extra_key_on_the_worker_side():
    assert matches(stamp(*BASE), entry(worker_runtime(*BASE, ("kernel_digest", "k")))) is None


def test_missing_key_is_not_a_wildcard():
    # a probe that could not read cpu_features leaves it out: that is a different runtime
    assert matches(stamp(*BASE[::2]), entry(worker_runtime(*BASE))) is None


@pytest.mark.parametrize("index", range(len(BASE)))
def test_value_differs(index):
    changed = list(BASE)
    key, value = changed[index]
    changed[index] = (key, value + "x")
    assert matches(stamp(*changed), entry(worker_runtime(*BASE))) is None


@pytest.mark.parametrize("value", ["AMD64", "amd64 ", " amd64", "arm64"])
def test_values_compare_exactly(value):
    worker = worker_runtime(("architecture", "amd64"))
    assert matches(stamp(("architecture", value)), entry(worker)) is None


def test_same_values_under_swapped_keys_differ():
    a = version(("architecture", "amd64"), ("x", "1"), ("y", "2"))
    b = version(("architecture", "amd64"), ("x", "2"), ("y", "1"))
    assert compat_key("gvisor", a) != compat_key("gvisor", b)


def test_class_differs():
    default = worker_runtime()
    assert matches(stamp(sandbox_class="microvm"), entry(default, sandbox_class="gvisor")) is None
    assert matches(stamp(sandbox_class="gvisor"), entry(default, sandbox_class="microvm")) is None
    assert compat_key("gvisor", version(*BASE)) != compat_key("microvm", version(*BASE))


# --- which entry matches ------------------------------------------------------------------------


def test_a_restorable_runtime_matches():
    old = worker_runtime(*OTHER, name="runsc-old", fixed_mib=32)
    newer = worker_runtime(("architecture", "amd64"), ("gvisor_asset_hash", "h2"))
    got = matches(stamp(*OTHER), entry(worker_runtime(*BASE), newer, old))
    assert got is old
    assert got.actor_overhead == ActorOverhead(fixed_mib=32, per_gib_mib=0)  # the matched entry books


def test_no_entry_matches():
    assert matches(stamp(("architecture", "arm64")), entry(worker_runtime(), worker_runtime(*OTHER))) is None


def test_restorable_order_decides_which_entry_matches_first():
    # equal by version, different by name and overhead: only order can tell them apart
    first = worker_runtime(*OTHER, name="first", fixed_mib=10)
    second = worker_runtime(*reversed(OTHER), name="second", fixed_mib=20)
    assert matches(stamp(*OTHER), entry(worker_runtime(*BASE), first, second)) is first
    assert matches(stamp(*OTHER), entry(worker_runtime(*BASE), second, first)) is second


def test_default_is_preferred_over_an_equal_restorable():
    default = worker_runtime(*BASE, name="default", fixed_mib=1)
    restorable = worker_runtime(*BASE, name="restorable", fixed_mib=2)
    assert matches(stamp(), entry(default, restorable)) is default
    assert matches(stamp(), entry(default, worker_runtime(*OTHER), restorable)) is default


# --- keys, canonical form, pins -------------------------------------------------------------


def test_compat_key_is_hashable_and_indexes_equal_runtimes_together():
    index = {compat_key("gvisor", version(*BASE)): "w1"}
    assert index[compat_key("gvisor", version(*reversed(BASE)))] == "w1"
    assert stamp_key(stamp(*reversed(BASE), name="n")) in index
    assert stamp_key(stamp(*OTHER)) not in index


def test_canonical_version_sorts_attributes_by_key():
    reordered = version(("z", "1"), ("architecture", "amd64"), ("m", "2"))
    canonical = canonical_version(reordered)
    assert [a.key for a in canonical.attributes] == ["architecture", "m", "z"]
    assert canonical.schema_version == "v1"
    assert same_version(canonical, reordered)
    already = version(("architecture", "amd64"), ("m", "2"))
    assert canonical_version(already) is already


def test_pin_of_carries_the_matched_runtime_and_the_class():
    runtime = worker_runtime(*OTHER, name="runsc-old", fixed_mib=64)
    pin = pin_of("gvisor", runtime)
    assert pin == ActorRuntime(sandbox_class="gvisor", name="runsc-old", version=runtime.version)
    # a snapshot stamped with that pin restores on the same runtime
    assert matches(pin, entry(worker_runtime(*BASE), runtime)) is runtime


@pytest.mark.parametrize(
    "a, b",
    [("x" * 255 + "a", "x" * 255 + "b"), ("sha256:ABCDEF", "sha256:abcdef"), ("h1", "h1 ")],
)
def test_values_differing_in_the_last_character_or_in_case_differ(a, b):
    worker = worker_runtime(("architecture", "amd64"), ("kernel_digest", a))
    assert matches(stamp(("architecture", "amd64"), ("kernel_digest", b)), entry(worker)) is None
    assert compat_key("gvisor", version(("kernel_digest", a))) != compat_key("gvisor", version(("kernel_digest", b)))
