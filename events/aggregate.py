"""Aggregates whose events are the wire Structs, plugged into the eventsourcing library.

The library stores what its `Mapper` makes of a domain event. `WireMapper` makes
the contract's JSON of the event's Struct (CONTRACT section 4), with the event's
`type` as the library topic, so that the log is readable by any NATS client and
each event has exactly one definition: its Struct in `events.schema`.

An aggregate's id is `<kind>.<entity id>` (e.g. `worker.w-17`): the JetStream
recorder stores it on the subject `<prefix>.ev.<kind>.<entity id>`.

Aggregates decide in their command methods and change state only in `apply`,
which dispatches on the event type to a `when_<EventType>` method.
"""

from __future__ import annotations

import copy
import logging
import os
from collections import OrderedDict
from datetime import datetime, timezone
from typing import Any, Callable, ClassVar

import msgspec
from eventsourcing.application import Application, ProcessingEvent, project_aggregate
from eventsourcing.persistence import IntegrityError, Mapper, StoredEvent
from eventsourcing.utils import TopicError

from events.codec import decoder, encode
from events.errors import ContractError, UnreadableHistory, from_an_earlier_life, precondition
from events.schema import EVENT_TYPES, ErrorCode, Event

log = logging.getLogger("warmboot.events")

AGGREGATE_KINDS: dict[str, type["WireAggregate"]] = {}
FORKED_CONTAINERS = (list, dict, set)  # what `WireAggregate.fork` copies, one level deep


def now() -> datetime:
    return datetime.now(timezone.utc)


def aggregate_id(kind: str, entity_id: str) -> str:
    return f"{kind}.{entity_id}"


def split_id(originator_id: str) -> tuple[str, str]:
    """`worker.w-17` -> ("worker", "w-17")."""
    kind, _, entity_id = originator_id.partition(".")
    return kind, entity_id


class Recorded:
    """A library domain event that carries one wire event Struct as its whole state."""

    __slots__ = ("originator_id", "originator_version", "body", "seq")

    def __init__(self, originator_id: str, originator_version: int, body: Event, seq: int = 0):
        self.originator_id = originator_id
        self.originator_version = originator_version
        self.body = body
        self.seq = seq  # its stream sequence when read from the store (0: not stored yet)

    @property
    def timestamp(self) -> datetime:
        return self.body.at

    def mutate(self, aggregate: "WireAggregate | None") -> "WireAggregate":
        if aggregate is None:
            kind, entity_id = split_id(self.originator_id)
            aggregate = AGGREGATE_KINDS[kind](entity_id)
        if self.originator_version != aggregate.version + 1:
            raise ValueError(
                f"{self.originator_id}: event version {self.originator_version} "
                f"does not follow {aggregate.version}"
            )
        aggregate.apply(self.body)
        aggregate.seqs.append(self.seq)
        aggregate.version = self.originator_version
        return aggregate

    def __repr__(self) -> str:
        return f"Recorded({self.originator_id}@{self.originator_version}: {self.body!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Recorded)
            and (self.originator_id, self.originator_version, self.body)
            == (other.originator_id, other.originator_version, other.body)
        )


class WireAggregate:
    """Base of the Worker and Actor aggregates: a version, pending events, `apply`, and
    the one rule of idempotency (`prior`).

    Idempotency (CONTRACT section 1, v1.1). Every event carries the `request_id` of the
    request that caused it, so the entity's history says what an earlier request with
    the same id did. A request id is scoped to one *life* of the entity: the events
    since the last one for which `starts_life` is true (a worker's registration after
    a removal, an actor's creation after a stop). A request that starts a new life is
    never answered from an earlier one. A request id whose first event in the life is
    not what the request's verb records (`VERB_FIRST`) names another request: refused
    with FAILED_PRECONDITION, field `request_id`, in every service alike.
    """

    KIND: ClassVar[str]
    # verb -> whether an event is what a request of that verb records first
    VERB_FIRST: ClassVar[dict[str, Callable[[Event], bool]]] = {}
    # the verb whose request starts a new life of an entity that is not alive (register, create)
    LIFE_VERB: ClassVar[str | None] = None
    # verbs whose request, with an id an earlier life used, is refused in a later one (unless it
    # starts a life): a copy of it delivered late would be decided anew on the later life
    REFUSED_FROM_AN_EARLIER_LIFE: ClassVar[frozenset[str]] = frozenset()
    alive: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "KIND" in cls.__dict__:
            AGGREGATE_KINDS[cls.KIND] = cls

    def __init__(self, entity_id: str):
        self.id = aggregate_id(self.KIND, entity_id)
        self.entity_id = entity_id
        self.version = 0
        self.pending_events: list[Recorded] = []
        self.history: list[Event] = []  # bodies applied, oldest first (request_id look-ups)
        self.seqs: list[int] = []  # stream sequence of each version (0 until it is stored)
        self.life_start = 1  # version of the first event of the current life
        self.request_versions: dict[str, tuple[int, ...]] = {}  # request_id -> versions it recorded

    @classmethod
    def create_id(cls, entity_id: str) -> str:
        return aggregate_id(cls.KIND, entity_id)

    def record(self, body: Event) -> None:
        """Trigger an event: apply it now, keep it pending until the application saves."""
        event = Recorded(self.id, self.version + 1, body)
        event.mutate(self)
        self.pending_events.append(event)

    def collect_events(self) -> list[Recorded]:
        events, self.pending_events = self.pending_events, []
        return events

    def apply(self, body: Event) -> None:
        # Called before the version moves on: this event's version is self.version + 1.
        version = self.version + 1
        if self.starts_life(body):
            self.life_start = version
        getattr(self, f"when_{type(body).__name__}")(body)
        self.history.append(body)
        if body.request_id is not None:  # a tuple, so that `fork` copies the dict alone
            self.request_versions[body.request_id] = self.request_versions.get(body.request_id, ()) + (version,)

    def starts_life(self, body: Event) -> bool:
        """Whether `body` begins a new life of the entity (request ids are scoped to one)."""
        return False

    def request_starts_life(self, verb: str) -> bool:
        """Whether a request of `verb` starts a new life (then no earlier request answers it)."""
        return verb == self.LIFE_VERB and not self.alive

    def reused(self, request_id: str, what: str) -> ContractError:
        """The refusal of a request whose id an earlier request of another verb used (`what` it did)."""
        return precondition(f"request_id {request_id!r} was already used for another request on "
                            f"{self.KIND} {self.entity_id!r} ({what})", "request_id")

    def prior(self, verb: str, request_id: str | None) -> list[int]:
        """Versions of the events an earlier `verb` request with `request_id` recorded in
        this life, oldest first; empty if none (or if this request starts a new life).
        Raises FAILED_PRECONDITION if the id recorded another verb's events."""
        if request_id is None or self.request_starts_life(verb):
            return []
        start = self.life_start
        recorded = self.request_versions.get(request_id, ())
        versions = [v for v in recorded if v >= start]
        if versions:
            first = self.history[versions[0] - 1]
            if not self.VERB_FIRST[verb](first):
                raise self.reused(request_id, f"it recorded {type(first).__name__}")
        elif recorded:
            self.refuse_from_an_earlier_life(verb, request_id)
        return versions

    def refuse_from_an_earlier_life(self, verb: str, request_id: str) -> None:
        """FAILED_PRECONDITION (field request_id) for a `verb` of REFUSED_FROM_AN_EARLIER_LIFE whose id
        an earlier life of the entity used, and which does not start a life. A registration's copy
        that a stalled replica decides late, after the worker was removed and registered anew,
        brought the earlier life's runtimes back onto the new one (a CPU its machine no longer
        has): the id says it was made for another life (docs/contract.md)."""
        if verb in self.REFUSED_FROM_AN_EARLIER_LIFE and not self.request_starts_life(verb):
            raise from_an_earlier_life(self.KIND, self.entity_id, verb, request_id)

    def fork(self) -> "WireAggregate":
        """A copy that shares nothing mutable with this one: what the cache hands a command, which
        may record events on it and fail. The state of an aggregate is immutable values (the wire
        Structs are frozen) and containers of them, one level deep (tests/test_aggregate_cache.py checks every kind)."""
        twin = copy.copy(self)
        for name, value in vars(twin).items():
            if type(value) in FORKED_CONTAINERS:
                setattr(twin, name, value.copy())
        return twin

    def events_at(self, versions: list[int]) -> list[Event]:
        return [self.history[v - 1] for v in versions]

    def seq_at(self, version: int) -> int:
        """The stream sequence of event `version`, as read from the store (0 if unknown)."""
        return self.seqs[version - 1] if 0 < version <= len(self.seqs) else 0


class WireMapper(Mapper):
    """Stores a `Recorded` event as its Struct's JSON, topic = the event's `type`.

    Anything else (the library's own snapshots and test events) goes through the
    library's default mapping, so the module stays a general-purpose store.
    """

    def to_stored_event(self, domain_event: Any) -> StoredEvent:
        if isinstance(domain_event, Recorded):
            return StoredEvent(
                originator_id=domain_event.originator_id,
                originator_version=domain_event.originator_version,
                topic=type(domain_event.body).__name__,
                state=encode(domain_event.body),
            )
        return super().to_stored_event(domain_event)

    def to_domain_event(self, stored_event: StoredEvent) -> Any:
        """The stored event as a `Recorded` (or the library's own event); UNAVAILABLE, naming the
        event, when this version cannot read it: a newer version's event type, or a body this
        version refuses. Nothing is decided on a history read in part, and a retry may reach a
        service of a version that reads it."""
        topic = stored_event.topic
        event_type = EVENT_TYPES.get(topic)
        if event_type is not None:
            try:
                body = decoder(event_type).decode(stored_event.state)
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                raise unreadable(stored_event, f"its body does not read as {topic}: {error}") from None
            return Recorded(str(stored_event.originator_id), stored_event.originator_version, body,
                            getattr(stored_event, "seq", 0))
        try:
            return super().to_domain_event(stored_event)
        except (TopicError, ValueError):  # no such type; no type at all ("": not a module name)
            raise unreadable(stored_event, f"its type {topic!r} is not one this version knows") from None


_LOGGED_UNREADABLE: set[tuple[str, int, int]] = set()  # events already logged, so a retry loop logs each once
_MAX_LOGGED = 4096


def unreadable(stored_event: StoredEvent, why: str) -> UnreadableHistory:
    """The UNAVAILABLE of a history that holds an event this version cannot read, logged once per
    event (the caller's answer goes to the caller, and STATS shows only its code)."""
    seq = getattr(stored_event, "seq", 0)
    at = f" at stream sequence {seq}" if seq else ""
    message = (f"the history of {stored_event.originator_id} holds an event this service cannot read (its "
               f"version {stored_event.originator_version}{at}): {why}; the services and the log are of "
               f"different versions of warmboot")
    key = (str(stored_event.originator_id), stored_event.originator_version, seq)
    if key not in _LOGGED_UNREADABLE:
        if len(_LOGGED_UNREADABLE) >= _MAX_LOGGED:
            _LOGGED_UNREADABLE.clear()
        _LOGGED_UNREADABLE.add(key)
        log.warning("%s", message)
    return UnreadableHistory(ErrorCode.UNAVAILABLE, message)


CACHE_ENV = "WARMBOOT_AGGREGATE_CACHE_EVENTS"
CACHE_EVENTS = 100_000  # events held by a service's cache of aggregates, all aggregates together


class AggregateCache:
    """The aggregates a service last read or saved, each as the log held it up to its version,
    so a command reads only the events after it: without it, a command on an actor read the
    actor's whole history, and its cost grew with every resume (about 23 µs an event here:
    half a second for an actor of 20,000 events). Least recently used first out, within a
    budget of events (each cached aggregate counts its version): a long history costs memory.

    Only states the log holds are put here (one just read, one just saved), never a command's
    aggregate while it decides: `WireApplication.get_async` hands out forks. An entry behind the
    log (another replica's write, the scheduler's placement) is brought up to date by reading
    the events after it, as a first read would have read them; an older entry put after a newer
    one only costs a longer read."""

    def __init__(self, budget_events: int):
        self.budget = budget_events
        self.held = 0
        self.entries: OrderedDict[str, WireAggregate] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, aggregate_id: str) -> "WireAggregate | None":
        found = self.entries.get(aggregate_id)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(aggregate_id)
        return found

    def put(self, aggregate: "WireAggregate") -> None:
        """Keep a fork of `aggregate`, whose state the log holds up to its version."""
        if aggregate.version > self.budget or (aggregate.seqs and not aggregate.seqs[-1]):
            self.drop(aggregate.id)  # too long to keep, or a position not known: not kept
            return
        self.drop(aggregate.id)
        self.entries[aggregate.id] = aggregate.fork()
        self.held += aggregate.version
        while self.held > self.budget:
            _, out = self.entries.popitem(last=False)
            self.held -= out.version

    def drop(self, aggregate_id: str) -> None:
        out = self.entries.pop(aggregate_id, None)
        if out is not None:
            self.held -= out.version


class WireApplication(Application[str]):
    """An eventsourcing Application whose aggregates are WireAggregates.

    `CACHE_AGGREGATES`: whether `get_async` and `save_async` keep an `AggregateCache` (its
    budget from $WARMBOOT_AGGREGATE_CACHE_EVENTS, default CACHE_EVENTS; 0: none)."""

    CACHE_AGGREGATES = False
    cache: AggregateCache | None = None

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.CACHE_AGGREGATES:
            budget = int(os.environ.get(CACHE_ENV) or CACHE_EVENTS)
            self.cache = AggregateCache(budget) if budget > 0 else None

    def construct_mapper(self) -> Mapper:
        return WireMapper(transcoder=self.construct_transcoder())

    def stored_event(self, originator_id: str, version: int, body: Event) -> StoredEvent:
        """The stored form of one event, for writers that commit without loading an aggregate."""
        return self.mapper.to_stored_event(Recorded(originator_id, version, body))

    # asyncio code's load and save (the registry's and the snapshotter's commands, on their service's
    # loop): the recorder's `select_events_async` and `insert_events_async`, awaited with no thread.
    # What `repository.get` and `save` do besides is nothing here: no snapshots, no cache, no hooks.

    async def get_async(self, aggregate_id: str) -> Any | None:
        """`repository.get(aggregate_id)` awaited: the aggregate its history makes (each event with
        its stream sequence), None when it has no event. With a cache, a fork of the one kept,
        brought up to the log by the events after it."""
        cached = self.cache.get(aggregate_id) if self.cache is not None else None
        if cached is not None:
            # Read from the cached state's last event on: it must still be there, at its sequence, the
            # same event (a stream made again, rolled back, or whose last message an operator deleted,
            # holds another history, maybe at the same sequences: the cached state is dropped, and
            # the whole history read instead).
            last_seq = cached.seqs[-1]
            stored = await self.recorder.select_events_async(aggregate_id, gt=cached.version - 1,
                                                             after_seq=last_seq - 1)
            if (stored and stored[0].originator_version == cached.version and getattr(stored[0], "seq", 0) == last_seq
                    and self.mapper.to_domain_event(stored[0]).body == cached.history[-1]):
                aggregate = project_aggregate(cached.fork(), map(self.mapper.to_domain_event, stored[1:]))
                if len(stored) > 1:
                    self.cache.put(aggregate)  # type: ignore[union-attr]
                return aggregate
            self.cache.drop(aggregate_id)  # type: ignore[union-attr]
        stored = await self.recorder.select_events_async(aggregate_id)
        if not stored:
            return None
        aggregate = project_aggregate(None, map(self.mapper.to_domain_event, stored))
        if self.cache is not None:
            self.cache.put(aggregate)
        return aggregate

    async def save_async(self, *items: Any, fences: dict[str, int] | None = None,
                         late: Callable[[], BaseException | None] | None = None) -> tuple[list[Any], list[int]]:
        """`save(*items, fences=...)` awaited: one atomic append of what the aggregates recorded (and
        the events given as such), in that order; the events and the stream sequence of each. `late`:
        asked before a grouped append goes out (`events.jetstream.grouped.Late`)."""
        processing: ProcessingEvent[str] = ProcessingEvent()
        processing.collect_events(*items)
        stored = [self.mapper.to_stored_event(event) for event in processing.events]
        try:
            seqs = await self.recorder.insert_events_async(stored, fences=fences, late=late)
        except IntegrityError:
            if self.cache is not None:  # the command runs again: on its entities' whole histories
                for event in processing.events:
                    self.cache.drop(event.originator_id)
            raise
        if self.cache is not None:
            self._saved(items, processing.events, seqs)
        return processing.events, seqs

    def _saved(self, items: tuple[Any, ...], events: list[Any], seqs: Any) -> None:
        """The saved aggregates, now at the versions the log holds, into the cache (each event's
        position filled in); any other subject the append wrote is dropped from it."""
        at = dict(zip(((e.originator_id, e.originator_version) for e in events), seqs or ()))
        saved = set()
        for item in items:
            if isinstance(item, WireAggregate):
                version = item.version
                while version and not item.seqs[version - 1]:  # the versions just saved, from the last
                    item.seqs[version - 1] = at.get((item.id, version), 0)
                    version -= 1
                self.cache.put(item)  # type: ignore[union-attr]
                saved.add(item.id)
        for event in events:
            if event.originator_id not in saved:
                self.cache.drop(event.originator_id)  # type: ignore[union-attr]
