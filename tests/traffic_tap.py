"""The traffic check: every body the suite sends to the services and gets back, and every event
published, validated against the published JSON Schema with the PyPI `jsonschema` validator
(not warmboot's decoder).

`TrafficTap` listens on the session's nats-server from a thread of its own (its own event
loop and connection, so tests never wait for it), to every subject, and keeps what is on
the services' request subjects (`<prefix>.registry|snapshotter|scheduler.>`), their
replies on `_INBOX.>` (correlated with the requests by reply subject, in the order the
server delivered them) and the events on `<prefix>.ev.>` as they are appended. It learns which request and reply type each endpoint takes from the services'
own `$SRV.INFO` metadata, as a client in another language would.

- A request answered without an error must validate as the endpoint's request type (one
  answered with an error may be invalid on purpose: it is not judged), and its reply as
  the endpoint's reply type; an error reply as `ErrorReply`.
- A message on `<prefix>.ev.<kind>.<id>`, for the kinds warmboot's events use, must
  validate as the event union (by its `type`). Tracking records are on `<prefix>.tracking.>`
  and not listened to; `<prefix>.ev.aggregate.>` (the library's own aggregates) is skipped.

It stays cheap and cannot become flaky: per test prefix at most `PER_PREFIX` bodies of each
type are validated (the rest are counted), pending requests are bounded, and what it could
not see (a slow-consumer drop, an endpoint whose metadata it could not read) is counted
and reported, never failed on. Only a body that does not validate fails the run.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats

from events.jetstream import TOPIC_HEADER
from events.jsonschema import narrow, schema_errors
from events.schema import EVENT_TYPES

SERVICES = ("registry", "snapshotter", "scheduler")
EVENT_KINDS = {cls.KIND for cls in EVENT_TYPES.values()}
PER_PREFIX = 10  # bodies of one type validated per test prefix
MAX_PENDING = 20_000  # requests waiting for their reply
MAX_FAILURES = 50  # kept in full; the rest are counted
INFO_WAIT_S = 0.5
_INVALID = object()

# What the check found that is not the schema's fault, reported to the code's owner: shown in
# every report, not failed on, until fixed (then delete the entry). (what, JSON path, message start, why)
KNOWN = [
    ("request", "$", "not JSON: Invalid UTF-8",
     "events.codec.decode_request accepts a body with invalid UTF-8 inside a field it does not know "
     "(msgspec skips unknown fields unchecked), e.g. test_hostile's b'{\"worker_id\": \"\\xff\"}' to "
     "scheduler.fragmentation; CONTRACT section 1 says bodies are UTF-8 JSON"),
]


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
    checked: Counter = field(default_factory=Counter)  # what -> bodies validated
    capped: int = 0  # bodies not validated: their type's quota for the prefix was used
    unknown_endpoint: int = 0  # replies whose endpoint's types the tap could not learn
    dropped: int = 0  # messages the server dropped for the tap (slow consumer)
    foreign: int = 0  # messages on event subjects that are not warmboot events (skipped)
    unmatched: int = 0  # requests whose reply the tap never saw
    invalid: int = 0
    known: Counter = field(default_factory=Counter)  # why -> bodies matching a KNOWN discrepancy
    failures: list[Failure] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)  # the tap's own errors (a bug in it: fails the run)
    notes: list[str] = field(default_factory=list)


class TrafficTap:
    def __init__(self, url: str):
        self.url = url
        self.tally = Tally()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="traffic-tap", daemon=True)
        self._pending: OrderedDict[str, tuple[str, bytes]] = OrderedDict()  # reply subject -> request
        self._quota: Counter = Counter()  # (prefix, type name) -> validated
        self._types: dict[tuple[str, str], dict[str, tuple[str, str | None]]] = {}  # (prefix, service) -> verbs
        self._any: dict[str, dict[str, tuple[str, str | None]]] = {}  # service -> verbs, from any prefix
        self._asking: set[tuple[str, str]] = set()
        self._tries: Counter = Counter()
        self._learned: dict[tuple[str, str], threading.Event] = {}
        self._waiting: list[tuple[str, bytes, bytes]] = []  # answered before their endpoint was known
        self._nc: Any = None

    # --- life -----------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=15)

    def stop(self) -> Tally:
        if not self._thread.is_alive():
            return self.tally
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=60)
        except Exception as e:  # noqa: BLE001 (the server went first, say): what was heard is judged
            self.tally.notes.append(f"the tap did not stop cleanly: {e!r}")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self.tally.unmatched += len(self._pending)
        return self.tally

    async def _start(self) -> None:
        async def error_cb(e: Exception) -> None:
            if isinstance(e, nats.errors.SlowConsumerError):
                self.tally.dropped += 1

        self._nc = await nats.connect(self.url, name="traffic-tap", error_cb=error_cb, max_reconnect_attempts=-1,
                                      reconnect_time_wait=0.2)
        # One subscription: nats-py runs each subscription's callbacks in a task of its own, so a
        # reply heard on another subscription could be handled before the request it answers.
        await self._nc.subscribe(">", cb=self._guarded(self._on_message), pending_msgs_limit=500_000,
                                 pending_bytes_limit=512 * 1024 * 1024)
        await self._nc.flush()

    async def _stop(self) -> None:
        if self._nc.is_connected:
            await self._nc.drain()  # every message received so far is handled first
        else:
            await self._nc.close()
        for subject, request, reply in self._waiting:
            self._check_pair(subject, request, reply, final=True)

    def _guarded(self, handler):
        async def cb(msg: Any) -> None:
            try:
                handler(msg)
            except Exception as e:  # noqa: BLE001
                if len(self.tally.broken) < MAX_FAILURES:
                    self.tally.broken.append(f"{msg.subject}: {e!r}")

        return cb

    # --- listening ----------------------------------------------------------------------------------

    def _on_message(self, msg: Any) -> None:
        subject = msg.subject
        if subject.startswith("_INBOX."):
            self._on_reply(msg)
            return
        kind = subject.split(".", 2)[1:2]
        if kind == ["ev"]:
            self._on_event(msg)
        elif kind and kind[0] in SERVICES:
            self._on_request(msg)

    def _on_request(self, msg: Any) -> None:
        reply = msg.reply
        if not reply.startswith("_INBOX."):
            return  # not served (CONTRACT section 1, Replies): nothing comes back to check
        self._pending[reply] = (msg.subject, msg.data)
        if len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)
            self.tally.unmatched += 1
        prefix, service = msg.subject.split(".", 2)[:2]
        key = (prefix, service)
        if key not in self._types and key not in self._asking and self._tries[key] < 3:
            self._asking.add(key)
            self._tries[key] += 1
            asyncio.ensure_future(self._learn_quietly(prefix, service))

    def _on_reply(self, msg: Any) -> None:
        request = self._pending.pop(msg.subject, None)
        if request is not None:
            self._check_pair(request[0], request[1], msg.data)

    def _on_event(self, msg: Any) -> None:
        prefix, _, kind = msg.subject.split(".", 3)[:3]
        topic = (msg.headers or {}).get(TOPIC_HEADER)
        if kind not in EVENT_KINDS or (topic is not None and topic not in EVENT_TYPES):
            # not a warmboot body: `aggregate` is the event-sourcing library's own, and the event
            # store's conformance tests append the library's test events (their own topics); a
            # reader skips a topic it does not know, as warmboot's fold does
            self.tally.foreign += 1
            return
        body = self._json("event", "AnyEvent", msg.subject, msg.data)
        if body is not _INVALID:
            self._check("event", narrow("AnyEvent", body), prefix, msg.subject, body, msg.data)

    def _json(self, what: str, name: str, subject: str, data: bytes) -> Any:
        """The decoded body, or _INVALID (a failure) when it is not UTF-8 JSON."""
        try:
            return msgspec.json.decode(data)
        except msgspec.DecodeError as e:
            self._fail(Failure(what, name, subject, [("$", f"not JSON: {e}")], data))
            return _INVALID

    # --- what each endpoint takes, from $SRV.INFO -------------------------------------------------------

    async def _learn_quietly(self, prefix: str, service: str) -> None:
        try:
            await self._learn(prefix, service)
        except Exception as e:  # noqa: BLE001 (the connection went, say): its replies are counted unknown
            self._asking.discard((prefix, service))
            self.tally.notes.append(f"reading $SRV.INFO of {service} on {prefix}: {e!r}")

    async def _learn(self, prefix: str, service: str) -> None:
        answers: list[dict] = []

        async def collect(msg: Any) -> None:
            try:
                answers.append(json.loads(msg.data))
            except ValueError:
                pass

        inbox = self._nc.new_inbox()
        sub = await self._nc.subscribe(inbox, cb=collect)
        try:
            await self._nc.publish(f"$SRV.INFO.warmboot-{service}", b"", reply=inbox)
            await asyncio.sleep(INFO_WAIT_S)  # every instance answers; there is no "last answer" to wait for
        finally:
            await sub.unsubscribe()
        for info in answers:
            verbs = {e["name"]: ((e.get("metadata") or {}).get("request"), (e.get("metadata") or {}).get("reply"))
                     for e in info.get("endpoints") or []}
            if verbs:
                self._any[service] = verbs
                if (info.get("metadata") or {}).get("prefix") == prefix:
                    self._types[(prefix, service)] = verbs
        self._asking.discard((prefix, service))
        if (prefix, service) in self._types:
            self._learned.setdefault((prefix, service), threading.Event()).set()
        waiting, self._waiting = self._waiting, []
        for subject, request, reply in waiting:
            self._check_pair(subject, request, reply)

    def wait_learned(self, prefix: str, service: str, timeout: float) -> bool:
        """Whether the tap has read the endpoints of `service` on `prefix` within `timeout` (from any thread)."""
        event = self._learned.setdefault((prefix, service), threading.Event())
        return event.wait(timeout)

    def _endpoint(self, subject: str) -> tuple[str, str | None] | None:
        prefix, service, verb = (subject.split(".") + ["", ""])[:3]
        verbs = self._types.get((prefix, service)) or self._any.get(service)
        return None if verbs is None else verbs.get(verb)

    # --- judging -------------------------------------------------------------------------------------------

    def _check_pair(self, subject: str, request: bytes, reply: bytes, final: bool = False) -> None:
        prefix = subject.split(".", 1)[0]
        body = self._json("reply", "AnyReply", subject, reply)
        if body is _INVALID:
            return
        if isinstance(body, dict) and "error" in body:
            self._check("reply", "ErrorReply", prefix, subject, body, reply)
            return  # the request may be invalid on purpose
        types = self._endpoint(subject)
        if types is None:
            if final:
                self.tally.unknown_endpoint += 1
            elif len(self._waiting) < MAX_PENDING:
                self._waiting.append((subject, request, reply))
            return
        request_type, reply_type = types
        if request_type:
            sent = self._json("request", request_type, subject, request) if request.strip() else {}  # as {}
            if sent is not _INVALID:
                self._check("request", request_type, prefix, subject, sent, request)
        if reply_type:
            self._check("reply", reply_type, prefix, subject, body, reply)
        else:
            self.tally.unknown_endpoint += 1

    def _check(self, what: str, name: str, prefix: str, subject: str, body: Any, raw: bytes) -> None:
        key = (prefix, what, name)
        if self._quota[key] >= PER_PREFIX:
            self.tally.capped += 1
            return
        self._quota[key] += 1
        self.tally.checked[what] += 1
        errors = schema_errors(name, body)
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
        lines = [f"{verdict} (JSON Schema, jsonschema): validated {checked}; {t.invalid} invalid; "
                 f"{t.capped} over the per-test quota, {t.unmatched} requests without a reply seen, "
                 f"{t.unknown_endpoint} replies of endpoints with unknown types, {t.foreign} messages on event "
                 f"subjects that are not warmboot events, {t.dropped} slow-consumer drops"]
        lines += [f"  {f}" for f in t.failures]
        lines += [f"  known, not failed ({n}): {why}" for why, n in t.known.items()]
        if t.invalid > len(t.failures):
            lines.append(f"  ... and {t.invalid - len(t.failures)} more")
        lines += [f"  tap error: {e}" for e in t.broken]
        lines += [f"  note: {n}" for n in t.notes]
        return "\n".join(lines)

