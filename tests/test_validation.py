"""Every validation rule of CONTRACT section 2, accepted and rejected at the edge (`decode_request`).

A rejection must be INVALID_ARGUMENT and name the exact offending field.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from events.codec import GIVEN_CHARS, decode_request
from events.errors import ContractError
from events.schema import (
    CreateActor,
    DrainWorker,
    ErrorCode,
    FragmentationQuery,
    PauseActor,
    RegisterWorker,
    ResumeActor,
    SuspendActor,
    TagSnapshot,
    UpdateTemplate,
)

# --- builders of valid bodies (plain JSON-able dicts, mutated per test) --------------


def attr(key: str, value: str) -> dict:
    return {"key": key, "value": value}


def version(features: str = "0ac853df914e2ca0", *, schema: str = "v1", arch: str | None = "amd64", extra=()) -> dict:
    attributes = [] if arch is None else [attr("architecture", arch)]
    attributes.append(attr("cpu_features", features))
    attributes.extend(attr(k, v) for k, v in extra)
    return {"schema_version": schema, "attributes": attributes}


def runtime(features: str = "0ac853df914e2ca0", **kw: Any) -> dict:
    return {"name": kw.pop("name", None), "version": version(features, **kw), "actor_overhead": None}


def class_entry(sandbox_class: str = "gvisor", restorable: int = 0) -> dict:
    return {
        "sandbox_class": sandbox_class,
        "default_runtime": runtime("d0"),
        "restorable_runtimes": [runtime(f"r{i}") for i in range(restorable)],
    }


def register(**changes: Any) -> dict:
    body = {
        "worker_id": "w-1",
        "node": "node-1",
        "capacity": {"cpu_millis": 4000, "memory_mib": 8192},
        "labels": {"zone": "a"},
        "sandbox_classes": [class_entry("gvisor", restorable=4)],
        "request_id": None,
    }
    body.update(changes)
    return body


def snapshot(**changes: Any) -> dict:
    body = {
        "snapshot_id": "snap-1",
        "actor_id": "golden",
        "template_uid": "tpl-1",
        "fidelity": "MEMORY",
        "location": "EXTERNAL",
        "node": None,
        "uri": "s3://bucket/snap-1",
        "sandbox_runtime": {"sandbox_class": "gvisor", "name": "runsc-2024", "version": version()},
        "borrowed": True,
        "taken_at": "2026-01-02T03:04:05Z",
    }
    body.update(changes)
    return body


def create(**changes: Any) -> dict:
    body = {
        "actor_id": "a-1",
        "sandbox_class": "gvisor",
        "template_uid": "tpl-1",
        "resources": {"cpu_millis": 500, "memory_mib": 1024},
        "selectors": {},
        "min_fidelity": "ROOTFS",
    }
    body.update(changes)
    return body


def raw(body: Any) -> bytes:
    return json.dumps(body).encode()


def accept(type_: type, body: Any):
    return decode_request(type_, raw(body))


def reject(type_: type, body: Any, field: str | None, message: str | None = None) -> ContractError:
    data = body if isinstance(body, bytes) else raw(body)
    with pytest.raises(ContractError) as caught:
        decode_request(type_, data)
    error = caught.value
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert error.field == field, error
    if message is not None:
        assert message in error.message, error
    return error


def edit(body: dict, path: str, value: Any) -> dict:
    """A copy of `body` with the value at `a[0].b` replaced (or deleted if value is DELETE)."""
    body = copy.deepcopy(body)
    parts = path.replace("]", "").replace("[", ".").split(".")
    target = body
    for part in parts[:-1]:
        target = target[int(part)] if part.isdigit() else target[part]
    last = int(parts[-1]) if parts[-1].isdigit() else parts[-1]
    if value is DELETE:
        del target[last]
    else:
        target[last] = value
    return body


DELETE = object()


def test_the_valid_bodies_are_valid():
    reg = accept(RegisterWorker, register())
    assert reg.sandbox_classes[0].restorable_runtimes[3].version.attributes[1].value == "r3"
    accept(CreateActor, create(golden_snapshot=snapshot()))


# --- ids ----------------------------------------------------------------------------

GOOD_IDS = ["a", "Z", "0", "w-1", "node_7", "A-b_C-9", "a" * 128, "0" + "-" * 127]
BAD_IDS = ["", "-a", "_a", "a.b", "a b", "a*", "a>", "a/b", "a:b", "é", "a\n", "\na", "a" * 129, "a\x00"]

# every place an id appears in a request, as (request type, builder, path)
ID_FIELDS = [
    (RegisterWorker, register, "worker_id"),
    (RegisterWorker, register, "node"),
    (CreateActor, create, "actor_id"),
    (CreateActor, create, "template_uid"),
    (CreateActor, lambda: create(source_tag="t1"), "source_tag"),
    (CreateActor, lambda: create(golden_snapshot=snapshot()), "golden_snapshot.snapshot_id"),
    (CreateActor, lambda: create(golden_snapshot=snapshot()), "golden_snapshot.actor_id"),
    (TagSnapshot, lambda: {"tag": "t1"}, "tag"),
    (PauseActor, lambda: {"snapshot_id": "s1"}, "snapshot_id"),
    (SuspendActor, lambda: {"snapshot_id": "s1", "fidelity": "MEMORY"}, "snapshot_id"),
    (UpdateTemplate, lambda: {"template_uid": "tpl-2"}, "template_uid"),
]


@pytest.mark.parametrize("type_, build, path", ID_FIELDS)
@pytest.mark.parametrize("good", GOOD_IDS)
def test_id_accepted(type_, build, path, good):
    accept(type_, edit(build(), path, good))


@pytest.mark.parametrize("type_, build, path", ID_FIELDS)
@pytest.mark.parametrize("bad", BAD_IDS)
def test_id_rejected(type_, build, path, bad):
    error = reject(type_, edit(build(), path, bad), path)
    assert error.message.endswith(f"; got {bad!r}") or (len(repr(bad)) > GIVEN_CHARS and error.message.endswith(
        f"; got {repr(bad)[:GIVEN_CHARS]}...")), error  # what was refused, quoted (escaped: printable)


@pytest.mark.parametrize("body, path, message", [
    (create(resources={"cpu_millis": -5, "memory_mib": 1}), "resources.cpu_millis", "Expected `int` >= 1; got -5"),
    (create(sandbox_class="GVisor"), "sandbox_class", "the first a letter; got 'GVisor'"),
    (create(resources={"cpu_millis": "500m", "memory_mib": 1}), "resources.cpu_millis", "Expected `int`, got `str`"),
    (edit(create(), "resources.cpu_millis", DELETE), "resources.cpu_millis",
     "Object missing required field `cpu_millis`"),
    (create(selectors={"zone": "a", "bad key!": "x"}), "selectors", "or digit (in a key); got 'bad key!'"),
    (create(selectors={"zone": "a", "disk": "v" * 300}), "selectors.disk",
     "length <= 256; got '" + "v" * (GIVEN_CHARS - 1) + "..."),
])
def test_a_refused_value_is_quoted_where_its_error_does_not_say_it(body, path, message):
    """The value itself ends its error (`; got ...`), unless msgspec's message says what it got or the
    field is missing: a user sees what was refused without the body. A map's value is named by its key
    (`selectors.<key>`, docs/contract.md; msgspec says `selectors[...]`), a refused key is quoted."""
    error = reject(CreateActor, body, path)
    assert error.message.endswith(message), error


@pytest.mark.parametrize("labels, path, message", [
    ({"zone": "a", "topology.example.com/rack": "r\x01"}, "labels.topology.example.com/rack",
     "Expected printable text (no control characters); got 'r\\x01'"),
    ({"zone": "a", "Bad Key": "x"}, "labels", "(in a key); got 'Bad Key'"),
    ({"zone": "a", "n": 1}, "labels.n", "Expected `str`, got `int`"),
])
def test_a_label_refused_is_named_by_its_key(labels, path, message):
    """A worker's label (a registration's `labels`): the key of the one refused, as docs/contract.md
    names it (`labels.<key>`), where msgspec said `labels[...]` and a worker with many labels was left
    to find which."""
    error = reject(RegisterWorker, register(labels=labels), path)
    assert error.message.endswith(message), error


@pytest.mark.parametrize("bad", BAD_IDS)
def test_a_golden_snapshot_s_node_is_refused_whatever_its_form(bad):
    """An EXTERNAL image is on no node: a golden snapshot naming one is refused, the field named, a
    malformed node as such and a well-formed one too."""
    reject(CreateActor, create(golden_snapshot=snapshot(node=bad)), "golden_snapshot.node")
    reject(CreateActor, create(golden_snapshot=snapshot(node=GOOD_IDS[3])), "golden_snapshot.node")


def test_id_must_be_a_string():
    reject(RegisterWorker, register(worker_id=17), "worker_id", "Expected `str`, got `int`")


# --- sandbox_class ---------------------------------------------------------------------

GOOD_CLASSES = ["g", "gvisor", "micro-vm-2", "a" + "0" * 62]
BAD_CLASSES = ["", "Gvisor", "1gvisor", "-gvisor", "g_visor", "g.visor", "g visor", "a" + "0" * 63, "gvisor\n"]


@pytest.mark.parametrize("good", GOOD_CLASSES)
def test_sandbox_class_accepted(good):
    accept(RegisterWorker, edit(register(), "sandbox_classes[0].sandbox_class", good))
    accept(CreateActor, create(sandbox_class=good))
    accept(FragmentationQuery, {"sandbox_class": good})


@pytest.mark.parametrize("bad", BAD_CLASSES)
def test_sandbox_class_rejected(bad):
    reject(RegisterWorker, edit(register(), "sandbox_classes[0].sandbox_class", bad), "sandbox_classes[0].sandbox_class")
    reject(CreateActor, create(sandbox_class=bad), "sandbox_class")
    reject(
        CreateActor,
        create(golden_snapshot=edit(snapshot(), "sandbox_runtime.sandbox_class", bad)),
        "golden_snapshot.sandbox_runtime.sandbox_class",
    )


# --- name ------------------------------------------------------------------------------


def test_name_up_to_253_printable_characters():
    path = "sandbox_classes[0].restorable_runtimes[2].name"
    for good in ["", "runsc 2024-05-01", "ñame ✓", "n" * 253]:
        accept(RegisterWorker, edit(register(), path, good))
    reject(RegisterWorker, edit(register(), path, "n" * 254), path, "length <= 253")
    for bad in ["tab\there", "line\n", "\x7f", "\x85"]:
        reject(RegisterWorker, edit(register(), path, bad), path)
    reject(RegisterWorker, edit(register(), path, 5), path, "Expected `str | null`")


# --- schema_version ------------------------------------------------------------------


@pytest.mark.parametrize("good", ["v1", "v2", "v10", "v9999"])
def test_schema_version_accepted(good):
    # an unknown version needs no `architecture`: only v1's rules are known
    body = edit(register(), "sandbox_classes[0].default_runtime.version", version(schema=good))
    accept(RegisterWorker, body)


def test_unknown_schema_version_does_not_require_architecture():
    body = edit(register(), "sandbox_classes[0].default_runtime.version", version(schema="v2", arch=None))
    accept(RegisterWorker, body)


@pytest.mark.parametrize("bad", ["", "1", "V1", "v0", "v01", "v10000", "v1.0", "v1 ", "v1\n", "version1"])
def test_schema_version_rejected(bad):
    path = "sandbox_classes[0].restorable_runtimes[1].version.schema_version"
    reject(RegisterWorker, edit(register(), path, bad), path)


# --- attributes ----------------------------------------------------------------------

DEFAULT_ATTRS = "sandbox_classes[0].default_runtime.version.attributes"


def with_attributes(count: int) -> dict:
    attributes = [attr("architecture", "amd64")] + [attr(f"k{i:02}", "v") for i in range(count - 1)]
    return edit(register(), DEFAULT_ATTRS, attributes)


def test_attributes_1_and_32_entries_accepted():
    assert len(accept(RegisterWorker, with_attributes(1)).sandbox_classes[0].default_runtime.version.attributes) == 1
    assert len(accept(RegisterWorker, with_attributes(32)).sandbox_classes[0].default_runtime.version.attributes) == 32


def test_attributes_33_entries_rejected():
    reject(RegisterWorker, with_attributes(33), DEFAULT_ATTRS, "length <= 32")


def test_attributes_empty_rejected():
    reject(RegisterWorker, edit(register(), DEFAULT_ATTRS, []), DEFAULT_ATTRS, "length >= 1")


def test_duplicate_attribute_key_named_at_the_contract_example_path():
    path = "sandbox_classes[0].restorable_runtimes[3].version.attributes"
    body = edit(register(), path, [attr("architecture", "amd64"), attr("architecture", "arm64")])
    reject(RegisterWorker, body, f"{path}[1].key", "duplicate attribute key 'architecture'")
    # the later duplicate is the one named, wherever it is
    body = edit(register(), path, [attr("architecture", "amd64"), attr("a", "1"), attr("b", "2"), attr("a", "3")])
    reject(RegisterWorker, body, f"{path}[3].key")


def test_duplicate_key_with_equal_value_is_still_rejected():
    path = "sandbox_classes[0].default_runtime.version.attributes"
    body = edit(register(), path, [attr("architecture", "amd64"), attr("architecture", "amd64")])
    reject(RegisterWorker, body, f"{path}[1].key")


@pytest.mark.parametrize("good", ["a", "cpu_vendor", "cpu_features", "gvisor_asset_hash", "k9", "a" * 128, "a_"])
def test_attribute_key_accepted(good):
    path = "sandbox_classes[0].restorable_runtimes[3].version.attributes[1].key"
    accept(RegisterWorker, edit(register(), path, good))


@pytest.mark.parametrize("bad", ["", "Architecture", "9a", "_a", "cpu-features", "cpu.features", "a b", "a" * 129, "k\n"])
def test_attribute_key_rejected(bad):
    path = "sandbox_classes[0].restorable_runtimes[3].version.attributes[1].key"
    reject(RegisterWorker, edit(register(), path, bad), path)


@pytest.mark.parametrize("good", ["x", "0ac853df914e2ca0", "sha256:ab/cd=", "with space", "Ünïcødé ✓", "v" * 256, " "])
def test_attribute_value_accepted(good):
    path = "sandbox_classes[0].restorable_runtimes[0].version.attributes[1].value"
    assert accept(RegisterWorker, edit(register(), path, good)).sandbox_classes[0].restorable_runtimes[0].version.attributes[1].value == good


@pytest.mark.parametrize(
    "bad, message",
    [
        ("", "length >= 1"),
        ("v" * 257, "length <= 256"),
        ("a\x00b", "Expected printable text (no control characters)"),
        ("tab\t", "Expected printable text (no control characters)"),
        ("line\nbreak", "Expected printable text (no control characters)"),
        ("trailing\n", "Expected printable text (no control characters)"),
        ("\r", "Expected printable text (no control characters)"),
        ("\x1b[31m", "Expected printable text (no control characters)"),
        ("del\x7f", "Expected printable text (no control characters)"),
        ("c1\x9b", "Expected printable text (no control characters)"),
        (7, "Expected `str`, got `int`"),
        (None, "Expected `str`, got `null`"),
    ],
)
def test_attribute_value_rejected(bad, message):
    path = "sandbox_classes[0].restorable_runtimes[0].version.attributes[1].value"
    reject(RegisterWorker, edit(register(), path, bad), path, message)


def test_v1_requires_architecture():
    path = "sandbox_classes[0].restorable_runtimes[2].version"
    body = edit(register(), path, version("r2", arch=None))
    reject(RegisterWorker, body, f"{path}.attributes", "requires the attribute 'architecture'")
    body = edit(register(), "sandbox_classes[0].default_runtime.version", version("d0", arch=None))
    reject(RegisterWorker, body, "sandbox_classes[0].default_runtime.version.attributes", "architecture")
    # the stamp of a golden snapshot too
    golden = edit(snapshot(), "sandbox_runtime.version", version(arch=None))
    reject(CreateActor, create(golden_snapshot=golden), "golden_snapshot.sandbox_runtime.version.attributes")


def test_architecture_may_be_anywhere_in_the_list():
    path = "sandbox_classes[0].default_runtime.version.attributes"
    accept(RegisterWorker, edit(register(), path, [attr("cpu_features", "x"), attr("z", "1"), attr("architecture", "amd64")]))


@pytest.mark.parametrize("path", [
    "sandbox_classes[0].restorable_runtimes[2].version",
    "sandbox_classes[0].default_runtime.compatible_versions[0]",
    "sandbox_classes[0].restorable_runtimes[1].compatible_versions[0]",
])
def test_a_version_of_another_architecture_than_the_default_is_refused_naming_it(path):
    """A worker runs on one machine: a restorable runtime or a compatible version of another
    architecture than its default runtime's would send it memory images it cannot load."""
    body = register()
    default = body["sandbox_classes"][0]["default_runtime"]
    default["compatible_versions"] = [version("e0")]
    body["sandbox_classes"][0]["restorable_runtimes"][1]["compatible_versions"] = [version("e1")]
    accept(RegisterWorker, body)  # all amd64
    reject(RegisterWorker, edit(body, path, version("x", arch="arm64")), f"{path}.attributes",
           "architecture 'arm64' is not the machine's 'amd64' (its first class's default runtime's, or the first "
           "named: sandbox_classes[0].default_runtime.version): a memory image never restores on another "
           "architecture")


def test_a_default_that_names_no_architecture_still_has_one_machine():
    """A default of another schema may name no architecture: the first version that names one is
    the machine's, and one naming another is refused (the review's entry: restorable runtimes of
    amd64 and of arm64 under a v2 default, accepted)."""
    body = register()
    body["sandbox_classes"][0]["default_runtime"]["version"] = version("d", schema="v2", arch=None)
    accept(RegisterWorker, body)  # its restorable runtimes: all amd64
    path = "sandbox_classes[0].restorable_runtimes[3].version"
    reject(RegisterWorker, edit(body, path, version("x", arch="arm64")), f"{path}.attributes",
           "architecture 'arm64' is not the machine's 'amd64'")


def test_an_architecture_spelled_as_the_machine_names_it_is_the_same_one():
    """`x86_64` is amd64 (the agent keeps such a literal restorable version, warning, for snapshots
    stamped with it); a version that names no architecture (another schema) is not compared."""
    body = register()
    body["sandbox_classes"][0]["restorable_runtimes"][0]["version"] = version("x", arch="x86_64")
    body["sandbox_classes"][0]["restorable_runtimes"][1]["version"] = version("y", schema="v2", arch=None)
    accept(RegisterWorker, body)


def test_attribute_missing_key_or_value_named():
    path = "sandbox_classes[0].restorable_runtimes[3].version.attributes[1]"
    reject(RegisterWorker, edit(register(), f"{path}.key", DELETE), f"{path}.key", "missing required field")
    reject(RegisterWorker, edit(register(), f"{path}.value", DELETE), f"{path}.value", "missing required field")


# --- restorable_runtimes ------------------------------------------------------------------


def test_restorable_runtimes_0_and_32_accepted():
    accept(RegisterWorker, register(sandbox_classes=[class_entry(restorable=0)]))
    entry = {k: v for k, v in class_entry().items() if k != "restorable_runtimes"}
    assert accept(RegisterWorker, register(sandbox_classes=[entry])).sandbox_classes[0].restorable_runtimes == ()
    got = accept(RegisterWorker, register(sandbox_classes=[class_entry(restorable=32)]))
    assert len(got.sandbox_classes[0].restorable_runtimes) == 32


def test_restorable_runtimes_33_rejected():
    reject(
        RegisterWorker,
        register(sandbox_classes=[class_entry(restorable=33)]),
        "sandbox_classes[0].restorable_runtimes",
        "length <= 32",
    )


def test_restorable_equal_to_default_rejected():
    body = edit(register(), "sandbox_classes[0].restorable_runtimes[2]", runtime("d0"))
    reject(RegisterWorker, body, "sandbox_classes[0].restorable_runtimes[2].version", "default_runtime")


def test_restorable_equal_to_another_rejected():
    body = edit(register(), "sandbox_classes[0].restorable_runtimes[3]", runtime("r1"))
    reject(RegisterWorker, body, "sandbox_classes[0].restorable_runtimes[3].version", "restorable_runtimes[1]")


def test_restorable_equality_ignores_attribute_order_name_and_overhead():
    reordered = runtime("r0", name="another name")
    reordered["version"]["attributes"].reverse()
    reordered["actor_overhead"] = {"fixed_mib": 64, "per_gib_mib": 8}
    body = edit(register(), "sandbox_classes[0].restorable_runtimes[3]", reordered)
    reject(RegisterWorker, body, "sandbox_classes[0].restorable_runtimes[3].version", "restorable_runtimes[0]")


def test_restorable_differing_in_schema_version_or_one_key_is_distinct():
    accept(RegisterWorker, edit(register(), "sandbox_classes[0].restorable_runtimes[0]", runtime("d0", schema="v2")))
    accept(RegisterWorker, edit(register(), "sandbox_classes[0].restorable_runtimes[0]", runtime("d0", extra=[("kernel_digest", "k")])))
    # differing in the architecture alone is distinct too, and refused for that reason (one machine)
    reject(RegisterWorker, edit(register(), "sandbox_classes[0].restorable_runtimes[0]", runtime("d0", arch="arm64")),
           "sandbox_classes[0].restorable_runtimes[0].version.attributes", "another architecture")


def test_same_runtime_in_two_classes_is_fine():
    second = class_entry("microvm", restorable=2)
    accept(RegisterWorker, register(sandbox_classes=[class_entry("gvisor", restorable=2), second]))


def test_actor_overhead_bounds():
    path = "sandbox_classes[0].default_runtime.actor_overhead"
    accept(RegisterWorker, edit(register(), path, {"fixed_mib": 0, "per_gib_mib": 0}))
    accept(RegisterWorker, edit(register(), path, {"fixed_mib": 128}))
    reject(RegisterWorker, edit(register(), path, {"fixed_mib": -1, "per_gib_mib": 0}), f"{path}.fixed_mib", ">= 0")
    reject(RegisterWorker, edit(register(), path, {"fixed_mib": 1, "per_gib_mib": -5}), f"{path}.per_gib_mib", ">= 0")
    reject(RegisterWorker, edit(register(), path, {"fixed_mib": 1.5}), f"{path}.fixed_mib", "Expected `int`")


# --- sandbox_classes ------------------------------------------------------------------------


def test_sandbox_classes_1_and_8_accepted():
    accept(RegisterWorker, register(sandbox_classes=[class_entry("c0")]))
    got = accept(RegisterWorker, register(sandbox_classes=[class_entry(f"c{i}", restorable=1) for i in range(8)]))
    assert [c.sandbox_class for c in got.sandbox_classes] == [f"c{i}" for i in range(8)]


def test_sandbox_classes_9_rejected():
    body = register(sandbox_classes=[class_entry(f"c{i}") for i in range(9)])
    reject(RegisterWorker, body, "sandbox_classes", "length <= 8")


def test_sandbox_classes_empty_or_missing_rejected():
    reject(RegisterWorker, register(sandbox_classes=[]), "sandbox_classes", "length >= 1")
    body = register()
    del body["sandbox_classes"]
    reject(RegisterWorker, body, "sandbox_classes", "missing required field `sandbox_classes`")


def test_sandbox_classes_unique():
    body = register(sandbox_classes=[class_entry("a"), class_entry("b"), class_entry("a")])
    reject(RegisterWorker, body, "sandbox_classes[2].sandbox_class", "listed twice")


# --- resources ------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["cpu_millis", "memory_mib"])
def test_resources_positive(field):
    accept(RegisterWorker, edit(register(), f"capacity.{field}", 1))
    reject(RegisterWorker, edit(register(), f"capacity.{field}", 0), f"capacity.{field}", ">= 1")
    reject(CreateActor, edit(create(), f"resources.{field}", -1), f"resources.{field}", ">= 1")
    reject(CreateActor, edit(create(), f"resources.{field}", "1"), f"resources.{field}", "Expected `int`, got `str`")


# --- missing fields name the field ------------------------------------------------------------


@pytest.mark.parametrize(
    "type_, body, path",
    [
        (RegisterWorker, edit(register(), "worker_id", DELETE), "worker_id"),
        (RegisterWorker, edit(register(), "capacity.memory_mib", DELETE), "capacity.memory_mib"),
        (RegisterWorker, edit(register(), "sandbox_classes[0].default_runtime", DELETE), "sandbox_classes[0].default_runtime"),
        (RegisterWorker, edit(register(), "sandbox_classes[0].restorable_runtimes[1].version", DELETE),
         "sandbox_classes[0].restorable_runtimes[1].version"),
        (RegisterWorker, edit(register(), "sandbox_classes[0].default_runtime.version.schema_version", DELETE),
         "sandbox_classes[0].default_runtime.version.schema_version"),
        (CreateActor, edit(create(), "template_uid", DELETE), "template_uid"),
        (CreateActor, create(golden_snapshot=edit(snapshot(), "taken_at", DELETE)), "golden_snapshot.taken_at"),
        (SuspendActor, {"snapshot_id": "s1"}, "fidelity"),
        (TagSnapshot, {}, "tag"),
    ],
)
def test_missing_field_is_named(type_, body, path):
    reject(type_, body, path, "missing required field")


def test_empty_body_is_an_empty_object():
    assert accept(DrainWorker, {}) == decode_request(DrainWorker, b"") == decode_request(DrainWorker, b"  \n")
    reject(TagSnapshot, b"", "tag")


def test_unknown_fields_are_ignored():
    body = register(future_field={"x": 1})
    body["sandbox_classes"][0]["default_runtime"]["future"] = [1, 2]
    accept(RegisterWorker, body)


# --- garbage and wrong JSON types ----------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [b"\xff\xfe\x00garbage", b"{", b'{"worker_id": "w-1",', b"not json", b"{'single': 'quotes'}", b"\x00" * 16],
)
def test_garbage_bytes(data):
    error = reject(RegisterWorker, data, None)
    assert "not valid JSON" in error.message


@pytest.mark.parametrize("data", [b"[]", b"null", b"42", b'"a string"', b"true"])
def test_body_of_the_wrong_json_type(data):
    error = reject(RegisterWorker, data, None)
    assert "Expected `object`" in error.message


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("sandbox_classes", {"gvisor": {}}, "Expected `array`, got `object`"),
        ("sandbox_classes[0]", "gvisor", "Expected `object`, got `str`"),
        ("sandbox_classes[0].restorable_runtimes", None, "Expected `array`, got `null`"),
        ("sandbox_classes[0].default_runtime.version.attributes", {"architecture": "amd64"}, "Expected `array`"),
        ("capacity", [4000, 8192], "Expected `object`, got `array`"),
        ("labels", ["zone"], "Expected `object`, got `array`"),
        ("request_id", 12, "Expected `str | null`, got `int`"),
    ],
)
def test_wrong_json_types_name_the_field(path, value, message):
    reject(RegisterWorker, edit(register(), path, value), path, message)


FIDELITIES = "expected one of MEMORY, VOLUMES, ROOTFS"  # Fidelity's values, in its order


def test_bad_enum_value_named():
    error = reject(SuspendActor, {"fidelity": "nope"}, "fidelity")
    assert error.message == f"{FIDELITIES}; got 'nope'", error
    error = reject(CreateActor, create(min_fidelity="NONE"), "min_fidelity")  # PlacedFidelity's, not Fidelity's
    assert error.message == f"{FIDELITIES}; got 'NONE'", error


@pytest.mark.parametrize("value", ["memory", "volumes", "Rootfs"])
def test_a_bad_enum_value_is_said_once_with_the_values_allowed(value):
    """An enum value was refused as "Invalid enum value 'memory'; got 'memory'": the value said
    twice (msgspec quotes it, and `given` quoted it again) and the values allowed never (found by a
    user walkthrough). Enum values stay upper case: a lower-case one is refused, and told why."""
    error = reject(SuspendActor, {"fidelity": value}, "fidelity")
    assert error.message == f"{FIDELITIES}; got {value!r} (enum values are upper case)", error
    assert str(error) == f"INVALID_ARGUMENT fidelity: {error.message}"
    accept(SuspendActor, {"fidelity": value.upper()})


def test_a_bad_enum_value_nested_names_its_path():
    golden = create(golden_snapshot=snapshot(fidelity="memory"))
    error = reject(CreateActor, golden, "golden_snapshot.fidelity")
    assert error.message == f"{FIDELITIES}; got 'memory' (enum values are upper case)", error
    error = reject(CreateActor, create(golden_snapshot=snapshot(location="SOMEWHERE")), "golden_snapshot.location")
    assert error.message == "expected one of LOCAL, EXTERNAL; got 'SOMEWHERE'", error


def test_a_long_bad_enum_value_is_cut():
    error = reject(SuspendActor, {"fidelity": "m" * 1000}, "fidelity")
    assert error.message == f"{FIDELITIES}; got {repr('m' * 1000)[:GIVEN_CHARS]}...", error


def test_an_enum_field_given_another_json_type_says_so():
    error = reject(SuspendActor, {"fidelity": 1}, "fidelity")
    assert error.message == "Expected `str`, got `int`", error


def test_other_requests_check_their_fields():
    reject(ResumeActor, {"min_seq": -1}, "min_seq", ">= 0")
    reject(ResumeActor, {"request_id": "r" * 129}, "request_id", "length <= 128")
    reject(DrainWorker, {"reason": "x" * 257}, "reason", "length <= 256")
    accept(ResumeActor, {"selectors": {"zone": "a"}, "min_seq": 0, "request_id": "r" * 128})


def test_oversized_body_rejected_before_decoding():
    error = reject(DrainWorker, b" " * ((1 << 20) + 1), None)
    assert "exceeds the limit" in error.message


def test_two_classes_of_one_worker_name_one_machine_s_architecture():
    """A worker runs on one machine, whatever its classes: a registration whose second class says
    arm64 where its first says amd64 (the default, a restorable or an edge) was accepted, each class
    entry checked alone, and arm64 memory images of the second class were then sent to a machine
    its first class says is amd64 (or the reverse): one of the two can only get images it cannot
    load (found by an audit)."""
    second = class_entry("microvm", restorable=1)
    body = register(sandbox_classes=[class_entry("gvisor", restorable=1), second])
    accept(RegisterWorker, body)  # both amd64
    for path in ("sandbox_classes[1].default_runtime.version",
                 "sandbox_classes[1].restorable_runtimes[0].version"):
        arm = edit(body, path, version("k1", arch="arm64"))
        if path.endswith("default_runtime.version"):  # the whole second class on arm64
            arm = edit(arm, "sandbox_classes[1].restorable_runtimes[0].version", version("k0", arch="arm64"))
        reject(RegisterWorker, arm, f"{path}.attributes", "architecture 'arm64' is not the machine's 'amd64'")
    edge = edit(body, "sandbox_classes[1].default_runtime.compatible_versions", [version("e1", arch="arm64")])
    reject(RegisterWorker, edge, "sandbox_classes[1].default_runtime.compatible_versions[0].attributes",
           "architecture 'arm64' is not the machine's 'amd64'")
