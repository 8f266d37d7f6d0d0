"""The traffic check: the bodies the suite's services receive and answer, and the events they
append, validated against the published JSON Schema with the PyPI `jsonschema` validator (not
warmboot's decoder).

It listens without being a subscriber: a core subscription on the services' subjects, on
`_INBOX.>` or on the event subjects would change what the tests test (a request to a service
that is not running would find a responder and time out instead of failing at once; an
ephemeral push consumer whose client left would still see interest on its inbox). So:

- Requests and replies are seen where nats.micro answers them, in this process: `install`
  wraps `nats.micro.request.Request.respond` and the services' `services.endpoints.ServiceRequest.
  respond` (every endpoint reply and error reply goes through one of them; the real method
  still sends) and records which request and reply type each
  endpoint declares in its metadata (the same `{"request": ..., "reply": ...}` that
  `$SRV.INFO` shows). Services run in other processes (`warmboot up` in a subprocess) are
  not seen.
- Events are read back from every `<PREFIX>_EVENTS` stream of the session's server when the
  session ends (what was committed, in stream order).

Judged: a request answered without an error, as its endpoint's request type (one answered
with an error may be invalid on purpose); every reply, as its endpoint's reply type, or as
`ErrorReply`; every message on `<prefix>.ev.>` whose `Warmboot-Topic` is a warmboot event, as
that event. Skipped: tracking records (`<prefix>.tracking.>`, not read), and messages of other
topics or on subjects of other kinds than warmboot's events use (the event store's tests append
the event-sourcing library's own events, on `<prefix>.ev.aggregate.>` among others).

Cheap and never flaky: at most `PER_PREFIX` bodies of each type are kept per test prefix (the
rest are counted), at most `STREAM_READ` messages are read per stream, and what it could not
read is noted, never failed on. Only a body that does not validate fails the run.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

from events.jetstream import TOPIC_HEADER
from events.jsonschema import narrow, schema_errors
from events.schema import EVENT_TYPES

EVENT_KINDS = {cls.KIND for cls in EVENT_TYPES.values()}  # worker, actor, booking, tag
PER_PREFIX = 10  # bodies of one type judged per test prefix
STREAM_READ = 3000  # messages read back from one event stream at most
STREAMS_AT_ONCE = 8  # event streams read back at once
MAX_FAILURES = 50  # kept in full; the rest are counted
_INVALID = object()

# What the check found that is not the schema's fault, reported to the code's owner: shown in
# every report, not failed on, until fixed (then delete the entry). (what, JSON path, message start, why)
KNOWN: list[tuple[str, str, str, str]] = []


@dataclass
class Failure:
    what: str  # "request", "reply" or "event"
    name: str  # the type it was checked as
    subject: str
    errors: list[tuple[str, str]]
    body: bytes

    def __str__(self) -> str:
        errors = "; ".join(f"{path}: {message}" for path, message in self.errors[:3])
        return f"{self.what} on {self.subject} is not a valid {self.name}: {errors}\n    body: {self.body[:300]!r}"


@dataclass
class Tally:
    checked: Counter = field(default_factory=Counter)  # what -> bodies judged
    capped: int = 0  # bodies not judged: their type's quota for the prefix was used
    unknown_endpoint: int = 0  # replies of endpoints that declared no reply type
    foreign: int = 0  # messages on event subjects that are not warmboot events (skipped)
    streams: int = 0  # event streams read back
    invalid: int = 0
    known: Counter = field(default_factory=Counter)  # why -> bodies matching a KNOWN discrepancy
    failures: list[Failure] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)  # the tap's own errors (a bug in it: fails the run)
    notes: list[str] = field(default_factory=list)
    took: dict[str, float] = field(default_factory=dict)  # "judging the pairs", "reading back": seconds


class TrafficTap:
    def __init__(self) -> None:
        self.tally = Tally()
        self._endpoints: dict[str, tuple[str | None, str | None]] = {}  # subject pattern -> (request, reply)
        self._pairs: list[tuple[str, bytes, bytes]] = []  # (request subject, request body, reply body)
        self._kept: Counter = Counter()  # (prefix, verb, error) -> pairs kept
        self._quota: Counter = Counter()  # (prefix, what, type name) -> judged
        self._lock = threading.Lock()
        self._undo: list[tuple[type, str, Any]] = []
        self.finished = False

    # --- seeing what the services answer (in this process) ---------------------------------------

    def install(self) -> None:
        from nats.micro.request import Request
        from nats.micro.service import Endpoint

        from services.endpoints import ServiceRequest

        tap = self
        init, respond, service_respond = Endpoint.__init__, Request.respond, ServiceRequest.respond

        def endpoint_init(endpoint: Any, service: Any, config: Any) -> None:
            init(endpoint, service, config)
            meta = config.metadata or {}
            tap._endpoints[endpoint._subject] = (meta.get("request"), meta.get("reply"))

        def spied(answer: Any) -> Any:
            async def spied_respond(request: Any, data: bytes = b"", headers: Any = None) -> None:
                tap.record(request.subject, request.data, data)
                await answer(request, data, headers)
            return spied_respond

        # the services' endpoints answer through ServiceRequest.respond (which never calls Request's)
        self._undo = [(Endpoint, "__init__", init), (Request, "respond", respond),
                      (ServiceRequest, "respond", service_respond)]
        Endpoint.__init__ = endpoint_init
        Request.respond = spied(respond)
        ServiceRequest.respond = spied(service_respond)

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo = []

    def record(self, subject: str, request: bytes, reply: bytes) -> None:
        """Keep a (request, reply) pair to judge at the end: cheap, bounded per prefix and verb."""
        tokens = subject.split(".")
        key = (tokens[0], ".".join(tokens[1:3]), reply.startswith(b'{"error"'))
        with self._lock:
            if self._kept[key] >= PER_PREFIX:
                self.tally.capped += 1
                return
            self._kept[key] += 1
            self._pairs.append((subject, bytes(request), bytes(reply)))

    def _endpoint(self, subject: str) -> tuple[str | None, str | None] | None:
        found = self._endpoints.get(subject)
        if found is None:
            found = self._endpoints.get(subject.rsplit(".", 1)[0] + ".*")
        return found

    # --- the end: judging ---------------------------------------------------------------------------

    def finish(self, url: str | None) -> Tally:
        """Judge the pairs seen, read back and judge the events of `url`'s streams; once."""
        if self.finished:
            return self.tally
        self.finished = True
        self.uninstall()
        started = time.monotonic()
        for subject, request, reply in self._pairs:
            self._guarded(self._judge_pair, subject, request, reply)
        self.tally.took["judging the pairs"] = time.monotonic() - started
        if url is not None:
            started = time.monotonic()
            reader = threading.Thread(target=lambda: self._guarded(asyncio.run, self._read_streams(url)))
            reader.start()  # a thread of its own: the session's event loop may still be set here
            reader.join(timeout=300)
            if reader.is_alive():
                self.tally.notes.append("reading the event streams back took over 300 s; stopped judging them")
            self.tally.took["reading back and judging the events"] = time.monotonic() - started
        return self.tally

    def _guarded(self, judge, *args) -> Any:
        try:
            return judge(*args)
        except Exception as e:  # noqa: BLE001 (a bug in the tap: reported, and fails the run)
            if len(self.tally.broken) < MAX_FAILURES:
                self.tally.broken.append(f"{judge.__name__}{args[:1]}: {e!r}")

    def _judge_pair(self, subject: str, request: bytes, reply: bytes) -> None:
        prefix = subject.split(".", 1)[0]
        body = self._json("reply", "AnyReply", subject, reply)
        if body is _INVALID:
            return
        if isinstance(body, dict) and "error" in body:
            self._check("reply", "ErrorReply", prefix, subject, body, reply)
            return  # the request may be invalid on purpose
        request_type, reply_type = self._endpoint(subject) or (None, None)
        if request_type:
            sent = self._json("request", request_type, subject, request) if request.strip() else {}  # as {}
            if sent is not _INVALID:
                self._check("request", request_type, prefix, subject, sent, request)
        if reply_type:
            self._check("reply", reply_type, prefix, subject, body, reply)
        else:
            self.tally.unknown_endpoint += 1

    async def _read_streams(self, url: str) -> None:
        import nats

        nc = await nats.connect(url, name="traffic-check", max_reconnect_attempts=2)
        try:
            js = nc.jetstream()
            offset, reads = 0, []
            while True:  # the server lists 256 streams a page, and a session makes more (the buckets' among them)
                page = await js.streams_info(offset=offset)
                if not page:
                    break
                offset += len(page)
                for info in page:
                    subjects = [s for s in info.config.subjects or [] if s.endswith(".ev.>")]
                    if info.config.name.endswith("_EVENTS") and subjects and info.state.messages:
                        reads.append((info.config.name, subjects[0]))
            at_once = asyncio.Semaphore(STREAMS_AT_ONCE)

            async def read(stream: str, subject: str) -> None:
                async with at_once:
                    await self._read_stream(js, stream, subject)

            await asyncio.gather(*(read(stream, subject) for stream, subject in reads))
        finally:
            await nc.close()

    async def _read_stream(self, js: Any, stream: str, subject: str) -> None:
        from nats.js.errors import NotFoundError

        try:  # a stream of nothing but tracking records: not waited on for a message that never comes (2 s
            await js.get_msg(stream, seq=1, subject=subject, next=True)  # each, 8 s of a whole run's end)
        except NotFoundError:
            return
        self.tally.streams += 1
        prefix = subject.split(".", 1)[0]
        sub = await js.subscribe(subject, stream=stream, ordered_consumer=True)
        try:
            for _ in range(STREAM_READ):
                try:
                    msg = await sub.next_msg(timeout=2.0)
                except asyncio.TimeoutError:
                    break  # not delivered: said nowhere, as before (the check is never flaky)
                self._judge_event(prefix, msg.subject, msg.headers or {}, msg.data)
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()

    def _judge_event(self, prefix: str, subject: str, headers: dict, data: bytes) -> None:
        topic = headers.get(TOPIC_HEADER)
        kind = subject.split(".", 3)[2]
        if kind not in EVENT_KINDS or (topic is not None and topic not in EVENT_TYPES):
            self.tally.foreign += 1  # not a warmboot body; a reader skips a topic it does not know
            return
        body = self._json("event", "AnyEvent", subject, data)
        if body is not _INVALID:
            self._check("event", narrow("AnyEvent", body), prefix, subject, body, data)

    def _json(self, what: str, name: str, subject: str, data: bytes) -> Any:
        """The decoded body, or _INVALID (a failure) when it is not UTF-8 JSON."""
        try:
            return msgspec.json.decode(data)
        except msgspec.DecodeError as e:
            self._fail(Failure(what, name, subject, [("$", f"not JSON: {e}")], data))
            return _INVALID

    def _check(self, what: str, name: str, prefix: str, subject: str, body: Any, raw: bytes) -> None:
        key = (prefix, what, name)
        if self._quota[key] >= PER_PREFIX:
            self.tally.capped += 1
            return
        self._quota[key] += 1
        self.tally.checked[what] += 1
        errors = schema_errors(name, body, events_as_sent=True)  # the services write every field of an event
        if errors:
            self._fail(Failure(what, name, subject, errors, raw))

    def _fail(self, failure: Failure) -> None:
        for what, path, start, why in KNOWN:
            if failure.what == what and any(p == path and m.startswith(start) for p, m in failure.errors):
                self.tally.known[why] += 1
                return
        self.tally.invalid += 1
        if len(self.tally.failures) < MAX_FAILURES:
            self.tally.failures.append(failure)

    def report(self) -> str:
        t = self.tally
        plural = {"request": "requests", "reply": "replies", "event": "events"}
        checked = ", ".join(f"{n} {plural[what]}" for what, n in sorted(t.checked.items())) or "nothing"
        verdict = "TRAFFIC CHECK FAILED" if t.invalid or t.broken else "traffic check"
        lines = [f"{verdict} (JSON Schema, jsonschema): judged {checked} ({t.streams} event streams read "
                 f"back); {t.invalid} invalid; {t.capped} over the per-test quota, {t.unknown_endpoint} replies "
                 f"of endpoints without a declared reply type, {t.foreign} messages of other topics on "
                 f"event subjects"]
        if t.took:  # what the check adds to the end of a run
            lines.append("  took " + ", ".join(f"{s:.1f} s {what}" for what, s in t.took.items()))
        lines += [f"  {f}" for f in t.failures]
        if t.invalid > len(t.failures):
            lines.append(f"  ... and {t.invalid - len(t.failures)} more")
        lines += [f"  known, not failed ({n}): {why}" for why, n in t.known.items()]
        lines += [f"  tap error: {e}" for e in t.broken]
        lines += [f"  note: {n}" for n in t.notes]
        return "\n".join(lines)
