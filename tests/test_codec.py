"""Property tests of the codec: every wire type, request, reply and event round-trips,
and the compat key is invariant under attribute order and sensitive to every value.

Strategies are derived from the schema itself (`msgspec.inspect`), so a field added
to `events/schema.py` is generated with its constraints without touching this file;
the few types with cross-field rules (CONTRACT section 2) have hand-written strategies.
"""

from __future__ import annotations

import datetime as dt
import enum
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from events import schema as s
from events.codec import decode_event, decode_reply, decode_request, encode
from events.jsonschema import SENT_SUFFIX, UNIONS, json_schema
from events.compat import compat_key, matches
from events.errors import ContractError
from events.schema import PATTERN_WORDS

SETTINGS = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_COLLECTION = 3  # generated lists and maps stay small; the limits are tested in test_validation
INT64 = (-(1 << 63), (1 << 63) - 1)

# printable: what str.isprintable() accepts (CONTRACT section 2, v1.1)
printable = st.characters(codec="utf-8", exclude_categories=["Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"]) \
    | st.just(" ")
# Struct type -> its hand-written strategy (filled in below, looked up at draw time)
OVERRIDES: dict[type, st.SearchStrategy] = {}


def _string(t: mi.StrType) -> st.SearchStrategy[str]:
    if t.pattern == s.PRINTABLE_PATTERN:
        return st.text(printable, min_size=t.min_length or 0, max_size=min(t.max_length or 64, 64))
    strategy = st.from_regex(t.pattern, fullmatch=True) if t.pattern else st.text(printable, max_size=32)
    if t.min_length or t.max_length:
        lo, hi = t.min_length or 0, t.max_length or 1 << 30
        strategy = strategy.filter(lambda v: lo <= len(v) <= hi)
    return strategy


def _integer(t: mi.IntType) -> st.SearchStrategy[int]:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else INT64[0])
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else INT64[1])
    return st.integers(lo, hi)


def _sequence(t: mi.ListType | mi.VarTupleType) -> st.SearchStrategy:
    lo = t.min_length or 0
    items = st.lists(strategy_of(t.item_type), min_size=lo, max_size=max(lo, min(t.max_length or MAX_COLLECTION, MAX_COLLECTION)))
    return items.map(tuple) if isinstance(t, mi.VarTupleType) else items


def strategy_of(t: mi.Type) -> st.SearchStrategy[Any]:
    """A strategy of valid values for a msgspec type description."""
    if isinstance(t, mi.Metadata):
        return strategy_of(t.type)
    if isinstance(t, mi.StructType):
        if t.cls in OVERRIDES:
            return st.deferred(lambda: OVERRIDES[t.cls])
        return st.builds(t.cls, **{f.name: strategy_of(f.type) for f in t.fields})
    if isinstance(t, mi.StrType):
        return _string(t)
    if isinstance(t, mi.IntType):
        return _integer(t)
    if isinstance(t, mi.FloatType):
        return st.floats(allow_nan=False, allow_infinity=False)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.EnumType):
        return st.sampled_from(list(t.cls))
    if isinstance(t, mi.DateTimeType):
        # RFC 3339 UTC (CONTRACT section 1)
        return st.datetimes(timezones=st.just(dt.timezone.utc))
    if isinstance(t, mi.UnionType):
        return st.one_of([strategy_of(member) for member in t.types])
    if isinstance(t, (mi.ListType, mi.VarTupleType)):
        return _sequence(t)
    if isinstance(t, mi.DictType):
        return st.dictionaries(
            strategy_of(t.key_type), strategy_of(t.value_type), max_size=min(t.max_length or MAX_COLLECTION, MAX_COLLECTION)
        )
    raise TypeError(f"no strategy for {t!r}: teach tests/test_codec.py about it")


def of(cls: type) -> st.SearchStrategy[Any]:
    return strategy_of(mi.type_info(cls))


# --- the types with cross-field rules ------------------------------------------------------

ids = st.from_regex(s.ID_PATTERN, fullmatch=True)
of_class = st.from_regex(s.CLASS_PATTERN, fullmatch=True)
attr_key = st.from_regex(s.ATTR_KEY_PATTERN, fullmatch=True)
attr_value = st.text(printable, min_size=1, max_size=64)
known_or_unknown_schema = st.one_of(st.just("v1"), st.from_regex(s.SCHEMA_VERSION_PATTERN, fullmatch=True))


@st.composite
def compat_versions(draw, max_attributes: int = 6) -> s.CompatVersion:
    """Unique keys, 1 to 32 of them, `architecture` under v1, in any order."""
    schema_version = draw(known_or_unknown_schema)
    entries = draw(st.dictionaries(attr_key, attr_value, min_size=1, max_size=max_attributes))
    if schema_version == "v1" and "architecture" not in entries:
        entries["architecture"] = draw(st.sampled_from(["amd64", "arm64"]))
        if len(entries) > 32:
            del entries[next(k for k in entries if k != "architecture")]
    pairs = draw(st.permutations(list(entries.items())))
    return s.CompatVersion(schema_version=schema_version, attributes=tuple(s.Attribute(key=k, value=v) for k, v in pairs))


@st.composite
def worker_runtimes(draw) -> s.WorkerRuntime:
    """Compatible versions that differ from the runtime's own version and from each other."""
    versions = draw(st.lists(compat_versions(), min_size=1, max_size=3, unique_by=lambda v: compat_key("", v)))
    return s.WorkerRuntime(
        version=versions[0],
        name=draw(st.none() | st.text(printable, max_size=40)),
        actor_overhead=draw(st.none() | of(s.ActorOverhead)),
        compatible_versions=tuple(versions[1:]),
    )


def on_machine(version: s.CompatVersion, arch: str | None) -> s.CompatVersion:
    """`version` with its `architecture` (if it names one) set to `arch` (if there is one)."""
    if arch is None:
        return version
    attrs = tuple(s.Attribute(key=a.key, value=arch) if a.key == "architecture" else a for a in version.attributes)
    return msgspec.structs.replace(version, attributes=attrs)


@st.composite
def worker_sandbox_classes(draw, machine: str | None = None) -> s.WorkerSandboxClass:
    """The default and the restorable runtimes all differ by version, and every version the entry
    names is of one machine's architecture: `machine`, or (None) its default's."""
    runtimes = draw(st.lists(worker_runtimes(), min_size=1, max_size=3, unique_by=lambda r: compat_key("", r.version)))
    named = [a.value for r in runtimes for v in (r.version, *r.compatible_versions) for a in v.attributes
             if a.key == "architecture"]
    # the default's, or the first named (events.compat.machine_architecture)
    arch = machine if machine is not None else named[0] if named else None
    runtimes = [msgspec.structs.replace(r, version=on_machine(r.version, arch),
                                        compatible_versions=tuple(on_machine(v, arch) for v in r.compatible_versions))
                for r in runtimes]
    for r in runtimes:  # set to one architecture, two versions may have become one
        assume(len({compat_key("", v) for v in (r.version, *r.compatible_versions)}) == 1 + len(r.compatible_versions))
    assume(len({compat_key("", r.version) for r in runtimes}) == len(runtimes))
    return s.WorkerSandboxClass(
        sandbox_class=draw(of_class),
        default_runtime=runtimes[0],
        restorable_runtimes=tuple(runtimes[1:]),
    )



@st.composite
def register_workers(draw) -> s.RegisterWorker:
    generic = draw(st.builds(s.RegisterWorker, **{
        f.name: strategy_of(f.type) for f in mi.type_info(s.RegisterWorker).fields if f.name != "sandbox_classes"
    }, sandbox_classes=st.just(())))
    machine = draw(st.sampled_from(["amd64", "arm64"]))  # one machine, whatever its classes (check_one_machine)
    classes = draw(st.lists(worker_sandbox_classes(machine), min_size=1, max_size=3,
                            unique_by=lambda c: c.sandbox_class))
    return msgspec.structs.replace(generic, sandbox_classes=tuple(classes))


uris = st.text(printable, min_size=1, max_size=64).filter(str.strip)  # a uri given is not blank


def under_placement(request):
    """A pause's or suspend's placement: its worker and pin only with its seq (`UnderPlacement`)."""
    if request.placement_seq is None:
        return msgspec.structs.replace(request, placement_worker_id=None, placement_node=None, placement_runtime=None)
    return request


@st.composite
def suspend_actors(draw) -> s.SuspendActor:
    generic = draw(st.builds(s.SuspendActor, **{
        f.name: strategy_of(f.type) for f in mi.type_info(s.SuspendActor).fields if f.name != "uri"}))
    return under_placement(msgspec.structs.replace(generic, uri=draw(st.none() | uris)))


@st.composite
def pause_actors(draw) -> s.PauseActor:
    return under_placement(draw(st.builds(s.PauseActor, **{
        f.name: strategy_of(f.type) for f in mi.type_info(s.PauseActor).fields})))


@st.composite
def create_actors(draw) -> s.CreateActor:
    """A source_tag or a golden snapshot (or neither), the golden one stamped in the actor's class."""
    generic = draw(st.builds(s.CreateActor, **{
        f.name: strategy_of(f.type) for f in mi.type_info(s.CreateActor).fields
        if f.name not in ("source_tag", "golden_snapshot")
    }))
    source = draw(st.sampled_from(["none", "tag", "golden"]))
    if source == "tag":
        return msgspec.structs.replace(generic, source_tag=draw(ids))
    if source == "golden":  # EXTERNAL, on no node, with a uri (v1.1)
        golden = msgspec.structs.replace(draw(of(s.Snapshot)), location=s.Location.EXTERNAL, node=None,
                                         uri=draw(uris))
        if golden.sandbox_runtime is not None:
            stamp = msgspec.structs.replace(golden.sandbox_runtime, sandbox_class=generic.sandbox_class)
            golden = msgspec.structs.replace(golden, sandbox_runtime=stamp)
        return msgspec.structs.replace(generic, golden_snapshot=golden)
    return generic


OVERRIDES.update({
    s.CompatVersion: compat_versions(),
    s.WorkerRuntime: worker_runtimes(),
    s.WorkerSandboxClass: worker_sandbox_classes(),
    s.RegisterWorker: register_workers(),
    s.CreateActor: create_actors(),
    s.SuspendActor: suspend_actors(),
    s.PauseActor: pause_actors(),
})

WIRE_TYPES = [
    s.Attribute, s.CompatVersion, s.ActorOverhead, s.WorkerRuntime, s.WorkerSandboxClass,
    s.ActorRuntime, s.Resources, s.Room, s.Snapshot, s.Fallback, s.ErrorDetail, s.Rejection,
    s.Placement, s.RuntimeFragmentation, s.ClassFragmentation, s.Refusal, s.SnapshotCounts, s.StrandedActor,
    s.RuntimeForecast, s.FleetRuntime, s.BookedActor, s.LocalImage,
    s.ActorSnapshotSummary, s.ActorSummary,  # scheduler.actors
    s.WorkerSummary,  # scheduler.workers
    s.Drained,  # HeartbeatReply.drained
    s.TaggedBefore,  # SnapshotReply.tagged_before
]
EVENT_TYPES = list(s.AnyEvent.__args__)


def names(types):
    return [t.__name__ for t in types]


# --- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("type_", s.REQUEST_TYPES, ids=names(s.REQUEST_TYPES))
@SETTINGS
@given(data=st.data())
def test_every_request_round_trips_through_the_edge(type_, data):
    request = data.draw(of(type_))
    assert decode_request(type_, encode(request)) == request


@pytest.mark.parametrize("type_", s.REPLY_TYPES[:-1], ids=names(s.REPLY_TYPES[:-1]))
@SETTINGS
@given(data=st.data())
def test_every_reply_round_trips(type_, data):
    reply = data.draw(of(type_))
    assert decode_reply(type_, encode(reply)) == reply


@SETTINGS
@given(reply=of(s.ErrorReply))
def test_an_error_reply_decodes_into_the_error_it_carries(reply):
    with pytest.raises(ContractError) as caught:
        decode_reply(s.SeqReply, encode(reply))
    assert caught.value.detail() == reply.error


@pytest.mark.parametrize("type_", WIRE_TYPES, ids=names(WIRE_TYPES))
@SETTINGS
@given(data=st.data())
def test_every_type_round_trips(type_, data):
    value = data.draw(of(type_))
    assert msgspec.json.decode(encode(value), type=type_) == value
    # and validating a plain-JSON form gives the same value back
    assert msgspec.convert(msgspec.to_builtins(value), type_) == value


@pytest.mark.parametrize("type_", EVENT_TYPES, ids=names(EVENT_TYPES))
@SETTINGS
@given(data=st.data())
def test_every_event_round_trips_through_decode_event(type_, data):
    event = data.draw(of(type_))
    body = encode(event)
    assert msgspec.json.decode(body)["type"] == type_.__name__
    decoded = decode_event(body)
    assert type(decoded) is type_
    assert decoded == event


def test_the_strategies_cover_every_type_of_the_contract():
    covered = {*s.REQUEST_TYPES, *s.REPLY_TYPES, *WIRE_TYPES, *EVENT_TYPES}
    published = {n.removesuffix(SENT_SUFFIX) for n in json_schema()["$defs"]} - set(UNIONS)
    assert published <= {t.__name__ for t in covered} | {t.__name__ for t in _enums()}


def _enums() -> list[type]:
    return [v for v in vars(s).values() if isinstance(v, type) and issubclass(v, enum.Enum)]


# --- the compat key --------------------------------------------------------------------------


@SETTINGS
@given(sandbox_class=of_class, version=compat_versions(max_attributes=32), data=st.data())
def test_compat_key_is_invariant_under_attribute_order(sandbox_class, version, data):
    shuffled = data.draw(st.permutations(version.attributes))
    other = s.CompatVersion(schema_version=version.schema_version, attributes=tuple(shuffled))
    assert compat_key(sandbox_class, other) == compat_key(sandbox_class, version)
    assert hash(compat_key(sandbox_class, other)) == hash(compat_key(sandbox_class, version))
    stamp = s.ActorRuntime(sandbox_class=sandbox_class, version=version)
    runtime = s.WorkerRuntime(version=other)
    entry = s.WorkerSandboxClass(sandbox_class=sandbox_class, default_runtime=runtime)
    assert matches(stamp, entry) is runtime


@st.composite
def other_value(draw, value: str) -> str:
    """A valid value unlike `value`: one character replaced, one appended, or a fresh one."""
    how = draw(st.sampled_from(["replace", "append", "fresh"]))
    if how == "replace":
        at = draw(st.integers(0, len(value) - 1))
        char = draw(printable.filter(lambda c: c != value[at]))
        return value[:at] + char + value[at + 1 :]
    if how == "append" and len(value) < 256:
        return value + draw(printable)
    return draw(attr_value.filter(lambda v: v != value))


def _replace_attribute(version: s.CompatVersion, index: int, attribute: s.Attribute) -> s.CompatVersion:
    attributes = list(version.attributes)
    attributes[index] = attribute
    return s.CompatVersion(schema_version=version.schema_version, attributes=tuple(attributes))


@SETTINGS
@given(sandbox_class=of_class, version=compat_versions(), data=st.data())
def test_compat_key_differs_when_any_value_differs(sandbox_class, version, data):
    index = data.draw(st.integers(0, len(version.attributes) - 1))
    old = version.attributes[index]
    changed = _replace_attribute(version, index, s.Attribute(key=old.key, value=data.draw(other_value(old.value))))
    assert compat_key(sandbox_class, changed) != compat_key(sandbox_class, version)
    entry = s.WorkerSandboxClass(sandbox_class=sandbox_class, default_runtime=s.WorkerRuntime(version=changed))
    assert matches(s.ActorRuntime(sandbox_class=sandbox_class, version=version), entry) is None


@SETTINGS
@given(sandbox_class=of_class, version=compat_versions(), data=st.data())
def test_compat_key_differs_when_a_key_is_renamed(sandbox_class, version, data):
    index = data.draw(st.integers(0, len(version.attributes) - 1))
    old = version.attributes[index]
    taken = {a.key for a in version.attributes}
    new_key = data.draw(attr_key.filter(lambda k: k not in taken))
    renamed = _replace_attribute(version, index, s.Attribute(key=new_key, value=old.value))
    assert compat_key(sandbox_class, renamed) != compat_key(sandbox_class, version)


@SETTINGS
@given(sandbox_class=of_class, version=compat_versions(), key=attr_key, value=attr_value)
def test_compat_key_differs_with_an_extra_key(sandbox_class, version, key, value):
    if key in {a.key for a in version.attributes}:
        return
    bigger = s.CompatVersion(
        schema_version=version.schema_version,
        attributes=(*version.attributes, s.Attribute(key=key, value=value)),
    )
    assert compat_key(sandbox_class, bigger) != compat_key(sandbox_class, version)


@SETTINGS
@given(version=compat_versions(), first=of_class, second=of_class, schema=known_or_unknown_schema)
def test_compat_key_differs_with_class_or_schema_version(version, first, second, schema):
    other_schema = s.CompatVersion(schema_version=schema, attributes=version.attributes)
    assert (compat_key(first, version) == compat_key(second, version)) == (first == second)
    assert (compat_key(first, other_schema) == compat_key(first, version)) == (schema == version.schema_version)


@SETTINGS
@given(version=compat_versions())
def test_compat_key_survives_the_wire(version):
    decoded = msgspec.json.decode(encode(version), type=s.CompatVersion)
    assert compat_key("gvisor", decoded) == compat_key("gvisor", version)


@pytest.mark.parametrize("pattern", list(PATTERN_WORDS))
def test_every_pattern_is_said_in_words_not_as_a_regular_expression(pattern):
    """A field refused for its pattern is told what it must be (a review found `'^[A-Za-z0-9]...(?!\\n)$'`)."""
    body = msgspec.defstruct("Body", [("field", Annotated[str, msgspec.Meta(pattern=pattern)])])
    with pytest.raises(ContractError) as refused:
        decode_request(body, b'{"field": "\\u0001 not it \\u0001"}')
    assert refused.value.field == "field"
    assert refused.value.message == f"Expected {PATTERN_WORDS[pattern]}; got {chr(1) + ' not it ' + chr(1)!r}"
    assert "regex" not in refused.value.message


# --- a refused enum value: the values allowed, said once (events.codec.enum_error) -------------

PLACED_FIDELITIES = "expected one of MEMORY, VOLUMES, ROOTFS, NONE"  # PlacedFidelity's values, in its order


@SETTINGS
@given(answer=of(s.WhatIfAnswer), stranded=st.lists(of(s.StrandedActor), min_size=2, max_size=3))
def test_a_bad_enum_value_in_a_list_lists_the_values_allowed(answer, stranded):
    """An enum in a list (WhatIfAnswer.newly_stranded[].location), as a reply is decoded: msgspec said
    only "Invalid enum value 'local'", not what is allowed (found by a user walkthrough)."""
    body = msgspec.json.decode(encode(msgspec.structs.replace(answer, newly_stranded=stranded)))
    body["newly_stranded"][1]["location"] = "local"
    with pytest.raises(msgspec.ValidationError) as refused:
        decode_reply(s.WhatIfAnswer, encode(body))
    assert str(refused.value) == ("expected one of LOCAL, EXTERNAL; got 'local' (enum values are upper case)"
                                  " - at `$.newly_stranded[1].location`")


@SETTINGS
@given(event=of(s.ActorPlaced))
def test_a_bad_enum_value_of_an_event_lists_the_values_allowed(event):
    """An event is a member of a tagged union (AnyEvent): its enum is found by the event's type."""
    for field, value, said in (("fidelity", "memory", f"{PLACED_FIDELITIES}; got 'memory' (enum values are upper case)"),
                               ("fidelity", "BEST", f"{PLACED_FIDELITIES}; got 'BEST'"),
                               ("action", "Run", "expected one of RESTORE, RUN; got 'Run' (enum values are upper case)")):
        body = msgspec.json.decode(encode(event))
        body[field] = value
        with pytest.raises(msgspec.ValidationError) as refused:
            decode_event(encode(body))
        assert str(refused.value) == f"{said} - at `${'.' + field}`"


def test_schema_check_s_decoder_verdict_lists_an_enum_s_values():
    """`warmboot schema --check FILE --as Snapshot` said "Invalid enum value 'memory'; got 'memory'"."""
    from warmboot.schema_check import decoder_verdict

    verdict = decoder_verdict("Snapshot", b'{"fidelity": "memory"}')
    assert verdict.errors == [("$.fidelity", "INVALID_ARGUMENT: expected one of MEMORY, VOLUMES, ROOTFS; "
                                             "got 'memory' (enum values are upper case)")]
    stranded = {"actor_id": "a", "stamp": {"sandbox_class": "gvisor", "name": None,
                                           "version": {"schema_version": "v1", "attributes": [{"key": "k", "value": "v"}]}}}
    counts = {"stranded_snapshots": 0, "memory_restorable_snapshots": 0}
    answer = {"before": counts, "after": counts, "runtimes": [],
              "newly_stranded": [{**stranded, "location": "LOCAL"}, {**stranded, "location": "OUTSIDE"}]}
    verdict = decoder_verdict("WhatIfAnswer", encode(answer))  # a reply: decoded, not checked as a request
    assert verdict.errors == [("$.newly_stranded[1].location", "expected one of LOCAL, EXTERNAL; got 'OUTSIDE'")]


class _Colour(enum.Enum):
    RED = "RED"
    GREEN = "GREEN"


class _Size(enum.IntEnum):
    SMALL = 1
    LARGE = 2


class _Cat(msgspec.Struct, tag=True):
    colour: _Colour


class _Dog(msgspec.Struct, tag=True):
    size: _Size


class _Holder(msgspec.Struct):
    optional: _Colour | None = None
    literal: Literal["on", "off"] = "on"
    by_name: dict[str, _Colour] = {}
    by_colour: dict[_Colour, int] = {}
    pair: tuple[int, _Colour] = (0, _Colour.RED)
    pets: list[_Cat | _Dog] = []
    renamed: Annotated[_Colour, msgspec.Meta(description="x")] = msgspec.field(default=_Colour.RED, name="colour")


@pytest.mark.parametrize("body, said", [
    ({"optional": "red"}, "expected one of RED, GREEN; got 'red' (enum values are upper case) - at `$.optional`"),
    ({"literal": "ON"}, "expected one of off, on; got 'ON' - at `$.literal`"),
    ({"by_name": {"a": "RED", "b": "BLUE"}}, "expected one of RED, GREEN; got 'BLUE' - at `$.by_name[...]`"),
    ({"by_colour": {"BLUE": 1}}, "expected one of RED, GREEN; got 'BLUE' - at `key` in `$.by_colour`"),
    ({"pair": [1, "Green"]}, "expected one of RED, GREEN; got 'Green' (enum values are upper case) - at `$.pair[1]`"),
    ({"pets": [{"type": "_Cat", "colour": "RED"}, {"type": "_Dog", "size": 3}]},
     "expected one of 1, 2; got 3 - at `$.pets[1].size`"),
    ({"pets": [{"type": "_Cat", "colour": "PINK"}]}, "expected one of RED, GREEN; got 'PINK' - at `$.pets[0].colour`"),
    ({"colour": "it's \"blue\"\n"}, "expected one of RED, GREEN; got 'it\\'s \"blue\"\\n' - at `$.colour`"),
])
def test_a_bad_enum_value_is_found_wherever_its_enum_is(body, said):
    """`events.codec.enum_error` follows msgspec's path through the type: optional, Literal, a map's
    value and key, a tuple, a tagged union in a list, a renamed field; the value quoted as msgspec does."""
    from events.codec import decoder

    with pytest.raises(msgspec.ValidationError) as refused:
        decoder(_Holder).decode(encode(body))
    assert str(refused.value) == said


def test_other_refusals_are_msgspec_s_own():
    from events.codec import decoder

    for data in (b'{"optional": 1}', b'{"pets": [{"type": "_Fish"}]}', b'{"pair": [1]}'):
        with pytest.raises(msgspec.ValidationError) as refused:
            decoder(_Holder).decode(data)
        with pytest.raises(msgspec.ValidationError) as own:
            msgspec.json.decode(data, type=_Holder)
        assert str(refused.value) == str(own.value)
