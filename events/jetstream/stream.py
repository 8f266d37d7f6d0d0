"""The stream protocol: creating a stream, appending atomic batches under per-subject
optimistic concurrency, and reading (direct gets, leader reads). Coroutines on a link's loop.

Appending (`Stream.append`): every subject of a batch carries, on its first message,
the stream sequence its writer expects as the subject's last (`Guard.expected`), given
by the caller, remembered (`LastSeen`) or looked up. A refusal because a subject moved
on is a conflict (`IntegrityError`) at once when the caller gave every expectation;
otherwise it is looked at again through the stream leader: a conflict if a given
expectation or the position is taken, a new plan and another attempt if not. A batch
whose reply was lost may have been stored: when it is sent again and refused, it is
recognised as ours by its message ids and contents where it landed, right after the
sequences it expected, whatever was written after it since (`Stream._landed`).

Reading: a direct get may be answered by a replica that is behind this process's own
writes; `last` and `subject_from` ask again, then read through the leader (`catch_up`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from dataclasses import dataclass
from collections.abc import Awaitable
from typing import Any, Callable

from eventsourcing.persistence import IntegrityError, OperationalError
from nats.aio.msg import Msg

from events.jetstream import errors
from events.jetstream.batch import Batch, Guard, Out
from events.jetstream.errors import ServerError
from events.jetstream.lastseen import Last
from events.jetstream.layout import (
    BATCH_COMMIT_HEADER,
    BATCH_ID_HEADER,
    BATCH_SEQ_HEADER,
    DUPLICATE_WINDOW_NS,
    EXPECTED_SUBJECT_SEQ_HEADER,
    EXPECTED_SUBJECT_SEQ_SUBJECT_HEADER,
    MSG_ID_HEADER,
    SEQUENCE_HEADER,
    SUBJECT_HEADER,
    VERSION_HEADER,
    sequence_of,
    status_of,
    version_of,
)
from events.jetstream.link import Link
from events.jetstream.retry import REQUEST_TIMEOUT, Again, Retry, catch_up
from events.nats_codes import ERR_CLUSTER_NO_PEERS, ERR_CLUSTER_NOT_AVAILABLE, ERR_STREAM_NAME_IN_USE
from events.natspy.connections import unless_refused
from events.natspy.headers import parse_header_block
from events.tasks import retrieved

log = logging.getLogger("warmboot.jetstream")

READ_PAGE = 1000  # messages one batched direct get asks for
MAX_REPLANS = 16  # rounds of "someone else appended, look again" before giving up


@dataclass
class Stored:
    """A message read through the stream leader, shaped like a direct-get reply."""

    headers: dict[str, str]
    data: bytes


class Stream:
    """One JetStream stream on a link: creation, appends and reads (coroutines on the link's loop)."""

    def __init__(self, link: Link, name: str, subjects: list[str], replicas: int, budget: float,
                 per_subject_limit: int = -1):
        self.link = link
        self.name = name
        self.subjects = subjects
        self.replicas = replicas
        self.budget = budget
        self.per_subject_limit = per_subject_limit
        self.create = True  # whether a missing stream may be created (CREATE_TABLE)
        self._check: asyncio.Future[None] | None = None  # `check_exists` in the background (check_soon)

    # -- setup

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": "warmboot event store (events.jetstream)",
            "subjects": self.subjects,
            "retention": "limits",
            "storage": "file",
            "num_replicas": self.replicas,
            "max_consumers": -1,
            "max_msgs": -1,
            "max_bytes": -1,
            "max_age": 0,
            "max_msgs_per_subject": self.per_subject_limit,
            "max_msg_size": -1,
            "discard": "old",
            "duplicate_window": DUPLICATE_WINDOW_NS,
            "allow_atomic": True,
            "allow_direct": True,
        }

    async def ensure(self, create: bool) -> None:
        """Connect; create the stream (idempotently) or bring an existing one up to what we need."""
        self.create = create
        link = self.link
        await link.connect(self.budget)
        await link.watch_elections(self.name)
        if not create or self.name in link.ready_streams:
            return
        # No peers for the replicas yet: a cluster still forming, or a member restarting.
        retry = Retry(f"creating stream {self.name}", self.budget, also={ERR_CLUSTER_NO_PEERS})
        await retry.run(self._create_or_update)
        link.ready_streams.add(self.name)

    async def _api(self, subject: str, payload: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        body = json.dumps(payload).encode() if payload is not None else b""
        api = f"$JS.API.{subject}"  # refused to these credentials: said at once (`errors.library_error`)
        reply = await self._answer(unless_refused(self.link.nc, api, self.link.nc.request(api, body, timeout=timeout),
                                                  self.link.errors))
        data = json.loads(reply.data)
        if "error" in data:
            raise ServerError.from_reply(data)
        return data

    async def _create_or_update(self, timeout: float) -> None:
        wanted = self.config()
        try:
            made = await self._api(f"STREAM.CREATE.{self.name}", wanted, timeout)
            refuse_without_atomic(self.name, made.get("config") or {}, self._server_version())
            return
        except ServerError as said:
            if said.err_code != ERR_STREAM_NAME_IN_USE:
                raise
        try:
            current = (await self._api(f"STREAM.INFO.{self.name}", None, timeout))["config"]
        except ServerError as said:
            if not said.stream_missing:
                raise
            # "in use" and "not found" at once: a cluster between two states; ask again
            raise ServerError(503, ERR_CLUSTER_NOT_AVAILABLE, f"stream {self.name} is settling") from None
        self._refuse_foreign(current.get("subjects") or [])
        merged = dict(current)
        merged["subjects"] = sorted(set(current.get("subjects") or []) | set(self.subjects))
        merged["allow_atomic"] = True
        merged["allow_direct"] = True
        merged["duplicate_window"] = max(int(current.get("duplicate_window") or 0), DUPLICATE_WINDOW_NS)
        if merged != current:
            log.info("updating stream %s to what the event store needs", self.name)
            current = (await self._api(f"STREAM.UPDATE.{self.name}", merged, timeout)).get("config") or {}
        refuse_without_atomic(self.name, current, self._server_version())

    def _server_version(self) -> str:
        return str((getattr(self.link.nc, "_server_info", None) or {}).get("version") or "of unknown version")

    def _refuse_foreign(self, subjects: list[str]) -> None:
        """An existing stream of this name with subjects under another first token belongs to
        another deployment: stream and bucket names fold '-' into '_' (`events.subjects`), so
        prefixes `team-a` and `team_a` name the same stream, and merging their subjects would
        have the two share one log, its buckets and their workers' liveness."""
        ours = {subject.split(".", 1)[0] for subject in self.subjects}
        foreign = sorted(subject for subject in subjects if subject.split(".", 1)[0] not in ours)
        if foreign:
            raise OperationalError(
                f"stream {self.name} holds the subjects {', '.join(foreign)} of another deployment: prefixes "
                f"that differ only in '-' and '_' name the same stream and buckets; give this deployment "
                f"another prefix than {', '.join(sorted(ours))}"
            )

    async def _answer(self, request: Awaitable[Msg]) -> Msg:
        """The reply to `request` (one to the stream leader), or `errors.LeaderElected` if the
        stream elects a new leader first: an append is then unanswered and sent again, to the
        new leader, at once instead of after its time-out (a resent batch that had been stored
        is recognised by `_landed`)."""
        elected = self.link.next_election(self.name)
        task = asyncio.ensure_future(request)
        # given up on below (an election, or the caller cancelled), it may still end in an error that
        # nobody awaits: "Task exception was never retrieved" (a soak's log, after a replica's stop)
        task.add_done_callback(retrieved)
        try:
            await asyncio.wait((task, elected), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        if task.done():
            return task.result()
        task.cancel()
        raise errors.LeaderElected(f"stream {self.name} elected a new leader before answering")

    def check_soon(self) -> asyncio.Future[None]:
        """`check_exists` in the background, one at a time: during a leader election nobody
        answers it for its whole time-out, while the operation that asked goes on trying."""
        if self._check is None or self._check.done():
            self._check = asyncio.ensure_future(self.check_exists())
            self._check.add_done_callback(retrieved)  # raised to whoever waits on it (`Retry`); nobody may
        return self._check

    async def check_exists(self) -> None:
        """Nobody answers for the stream: if it does not exist, create it again or say so."""
        try:
            await self._api(f"STREAM.INFO.{self.name}", None, REQUEST_TIMEOUT)
        except ServerError as said:
            if not said.stream_missing or await self._listed():
                return  # there, between leaders: the caller's retries ride it out
            self.link.ready_streams.discard(self.name)
            if not self.create:
                raise OperationalError(
                    f"stream {self.name} does not exist (and CREATE_TABLE says not to create it)"
                ) from None
            log.warning("stream %s is gone (deleted, or a new server); creating it again", self.name)
            self.link.last_seen.forget([subject.rstrip(">") for subject in self.subjects])
            await self.ensure(True)
        except Exception as error:
            if not errors.not_answering(error):
                raise
            # JetStream itself is not answering: a transient state, retried by the caller

    async def _listed(self) -> bool:
        """Whether the account's stream list (the meta leader's word) names this stream."""
        try:
            names = await self._api("STREAM.NAMES", {"subject": self.subjects[0]}, REQUEST_TIMEOUT)
        except Exception as error:
            if not (isinstance(error, ServerError) or errors.not_answering(error)):
                raise
            return True  # cannot tell: do not conclude it is gone
        return self.name in (names.get("streams") or [])

    # -- reads

    async def read(
        self,
        filter_subject: str,
        start_seq: int,
        *,
        stop: int | None = None,
        limit: int | None = None,
        keep: Callable[[Msg], bool] | None = None,
    ) -> list[Msg]:
        """Messages on `filter_subject` from `start_seq` (to `stop`), at most `limit` kept ones."""
        msgs: list[Msg] = []
        seq = max(start_seq, 1)
        retry = Retry(f"reading {filter_subject}", self.budget, self)
        while True:
            want = READ_PAGE
            if limit is not None and keep is None:
                want = min(want, limit - len(msgs))
            if stop is not None:
                want = min(want, stop - seq + 1)
            if want <= 0:
                return msgs
            request = {"seq": seq, "next_by_subj": filter_subject, "batch": want}
            page, pending = await retry.run(lambda timeout: self.link.direct_batch(self.name, request, timeout))
            for msg in page:
                msg_seq = int(msg.headers[SEQUENCE_HEADER])  # sequence_of, inline: per message of a replay
                if stop is not None and msg_seq > stop:
                    return msgs
                if keep is None or keep(msg):
                    msgs.append(msg)
                    if limit is not None and len(msgs) >= limit:
                        return msgs
                seq = msg_seq + 1
            if not page or pending == 0:
                return msgs

    async def last_direct(self, subject: str) -> Msg | None:
        """The last message on `subject` (a wildcard is allowed), from any replica."""
        request = json.dumps({"last_by_subj": subject}).encode()

        async def attempt(timeout: float) -> Msg | None:
            reply = await self.link.nc.request(f"$JS.API.DIRECT.GET.{self.name}", request, timeout=timeout)
            status = status_of(reply)
            if status is None:
                return reply
            if status == "404":
                return None
            raise errors.direct_get_refused(status)

        return await Retry(f"reading the last message of {subject}", self.budget, self).run(attempt)

    async def _leader_get(self, request: dict[str, Any], retry: Retry) -> Stored | None:
        """One message as the stream leader has it, or None when there is none (within `retry`)."""

        async def attempt(timeout: float) -> Stored | None:
            try:
                data = await self._api(f"STREAM.MSG.GET.{self.name}", request, timeout)
            except ServerError as said:
                if said.no_message:
                    return None
                raise
            message = data["message"]
            headers = parse_header_block(base64.b64decode(message["hdrs"])) if message.get("hdrs") else {}
            headers[SEQUENCE_HEADER] = str(message["seq"])
            headers[SUBJECT_HEADER] = message["subject"]
            return Stored(headers, base64.b64decode(message["data"]) if message.get("data") else b"")

        return await retry.run(attempt)

    async def last_from_leader(self, subject: str) -> Stored | None:
        """The last message on `subject` as the stream leader has it."""
        retry = Retry(f"reading the last message of {subject}", self.budget, self)
        return await self._leader_get({"last_by_subj": subject}, retry)

    def _must_see(self, subject: str, start: int) -> int:
        """The stream sequence a read of `subject` from `start` must reach: what this process saw there."""
        known = self.link.last_seen.get(subject)
        return known.seq if known is not None and known.seq >= max(start, 1) else 0

    async def last(self, subject: str) -> Msg | Stored | None:
        """The last message on `subject`, never older than what this process saw there."""

        async def from_replica() -> list[Msg]:
            msg = await self.last_direct(subject)
            return [msg] if msg is not None else []

        async def from_leader() -> list[Stored]:
            stored = await self.last_from_leader(subject)
            return [stored] if stored is not None else []

        found = await catch_up(self._must_see(subject, 1), from_replica, from_leader)
        return found[-1] if found else None

    async def subject_from(self, subject: str, start: int) -> list[Msg] | list[Stored]:
        """Every message on `subject` from `start`, at least up to what this process saw there."""
        return await catch_up(
            self._must_see(subject, start),
            lambda: self.read(subject, start),
            lambda: self._subject_from_leader(subject, start),
        )

    async def _subject_from_leader(self, subject: str, start: int) -> list[Stored]:
        stored: list[Stored] = []
        seq = max(start, 1)
        retry = Retry(f"reading {subject} through the leader", self.budget, self)
        while (found := await self._leader_get({"seq": seq, "next_by_subj": subject}, retry)) is not None:
            stored.append(found)
            seq = sequence_of(found) + 1
        return stored

    # -- appends

    async def append(self, batch: Batch, *, retried: bool = False,
                     late: Callable[[], BaseException | None] | None = None) -> list[int]:
        """Append `batch` atomically; return the stream sequence of each of its messages.

        `retried` says an earlier attempt of this very batch may have been stored
        (its reply was lost): then a duplicate, or a position found taken, is recognised as
        ours when our copy is there, and is a conflict otherwise.
        An error raised says, as `maybe_stored`, whether an attempt of the batch may have
        been stored all the same (one went out and no answer came back); False when none
        can have been (refused before it was sent, or by the server each time it asked).

        `late`, asked before each attempt: the error to fail with instead of sending, the caller's
        request having been held past its caller's wait meanwhile. While no attempt may have been
        stored (every one so far refused, or taken by nobody: a stream without a leader, for
        seconds of an election), another would be a first write, made late: not sent. Once one may
        have been stored (sent to a leader that did not answer: killed, frozen, stepped down), it is
        looked for at the stream leader instead of sent again (a resend stored what that leader had
        never stored: a frozen leader's batches, once another was elected): found, its sequences;
        else StoreUnavailableError, saying the earlier attempt may still be stored (an old leader's
        proposal committed by the next one: "an append already sent lands or not").
        """
        uncertain = retried
        replans = 0

        async def attempt(timeout: float) -> list[int]:
            nonlocal uncertain, replans
            if late is not None and (error := late()) is not None:
                if not uncertain:
                    raise error
                if (seqs := await self._landed(batch)) is not None:
                    return seqs
                if getattr(error, "as_is", False):  # the caller's own (a group's member late): it sorts it out
                    raise error
                raise errors.StoreUnavailableError(
                    f"{error}; not sent again: an attempt sent before, unanswered, may still be stored "
                    "(ask again with the same request id)") from error
            try:
                last_seq = await self._send(batch, timeout)
            except ServerError as said:
                if not said.conflict:
                    raise
                if uncertain and (seqs := await self._landed(batch)) is not None:
                    return seqs
                replans += 1
                if replans > MAX_REPLANS:
                    raise IntegrityError(f"gave up after {MAX_REPLANS} concurrent appends: {said}") from None
                await self._replan(batch, said)
                raise Again from None
            except Exception as error:
                if errors.unanswered(error):
                    uncertain = True  # it may have been stored
                raise
            first_seq = last_seq - len(batch.outs) + 1
            self._remember(batch, first_seq)
            return list(range(first_seq, last_seq + 1))

        try:
            try:
                await self._expect(batch)
            except IntegrityError:
                # A position taken is this batch's own copy only if that copy is found there; else it is
                # another writer's, however old (past the duplicate window the server no longer refuses
                # the message id, and the expectation from a read of the subject would let it in again).
                if not retried or (seqs := await self._landed(batch)) is None:
                    raise
                return seqs
            return await Retry(f"appending to {self.name}", self.budget, self).run(attempt)
        except Exception as error:
            error.maybe_stored = uncertain  # type: ignore[attr-defined]
            raise

    async def _expect(self, batch: Batch) -> None:
        """Fill in each guard's expected last sequence: given, remembered or looked up.

        A position at or below the subject's last one is refused here
        (versions are never taken back). What this process remembers is only a hint:
        a refusal is confirmed with the stream leader first.
        """
        seen = self.link.last_seen
        missing, doubtful = [], []
        for guard in batch.guards.values():
            last = seen.get(guard.subject)
            if last is not None and last.position is not None and guard.first_position <= last.position:
                doubtful.append(guard)
            elif guard.given:
                continue
            elif last is not None:
                guard.expected = last.seq
            elif guard.first_position <= 1:
                guard.expected = 0  # a first version expects an empty subject; if not, the server says so
            else:
                missing.append(guard)
        if doubtful:
            found = await asyncio.gather(*(self.last_from_leader(guard.subject) for guard in doubtful))
            for guard, current in zip(doubtful, found):
                last = self._last_of(guard, current, authoritative=True)
                self._check_position(guard, last)
                if not guard.given:
                    guard.expected = last.seq
        if missing:
            found = await asyncio.gather(*(self.last_direct(guard.subject) for guard in missing))
            for guard, msg in zip(missing, found):
                last = self._last_of(guard, msg)
                self._check_position(guard, last)
                guard.expected = last.seq

    def _last_of(self, guard: Guard, msg: Msg | Stored | None, authoritative: bool = False) -> Last:
        """What `msg`, the last message on the guard's subject, says of it; remembered."""
        if msg is None:
            last = Last(0, None)
        elif guard.position_header == VERSION_HEADER:
            last = Last(sequence_of(msg), version_of(msg.headers))
        else:
            value = msg.headers.get(guard.position_header)
            last = Last(sequence_of(msg), int(value) if value is not None else None)
        self.link.last_seen.put(guard.subject, last, authoritative=authoritative)
        return last

    @staticmethod
    def _check_position(guard: Guard, last: Last) -> None:
        if last.position is not None and guard.first_position <= last.position:
            raise IntegrityError(
                f"{guard.subject}: position {guard.first_position} is already taken (last is {last.position})"
            )

    async def _replan(self, batch: Batch, said: ServerError) -> None:
        """After a rejected append: raise IntegrityError, or update expectations to try again.

        When the caller gave every expectation (`expected_last_seqs` for every subject, as the
        scheduler's group commit does), the refusal itself says one of them no longer holds:
        IntegrityError at once, and the caller, who knows what it decided on, looks again.
        Asking the leader for each subject would only say which one, at a read per subject
        of the batch (with three scheduler replicas, most of what a lost race cost them)."""
        if batch.fences:  # the caller's word, like a given expectation: a fence that moved is a conflict
            subjects = list(batch.fences)
            found = await asyncio.gather(*(self.last_from_leader(subject) for subject in subjects))
            for subject, current in zip(subjects, found):
                now = sequence_of(current) if current is not None else 0
                # remembered: the caller's next read of that subject is no older (`last`)
                self.link.last_seen.put(subject, Last(now, version_of(current.headers) if current is not None else None),
                                        authoritative=True)
                if now != batch.fences[subject]:
                    raise IntegrityError(f"{subject}: fenced at last sequence {batch.fences[subject]}, now {now}")
        guards = list(batch.guards.values())
        if all(guard.given for guard in guards):
            raise IntegrityError(
                f"appending to {self.name} was refused ({said.description or 'a conflict'}): a subject "
                "of the batch has moved on from the last sequence the caller expected"
            )
        found = await asyncio.gather(*(self.last_from_leader(guard.subject) for guard in guards))
        changed = False
        for guard, current in zip(guards, found):
            last = self._last_of(guard, current, authoritative=True)
            if guard.given:
                if guard.expected != last.seq:
                    raise IntegrityError(
                        f"{guard.subject}: expected last sequence {guard.expected}, found {last.seq}"
                    )
                self._check_position(guard, last)
                continue
            self._check_position(guard, last)
            if guard.expected != last.seq:
                guard.expected = last.seq
                changed = True
        if not changed:
            raise errors.library_error(f"append to {self.name}", said)

    async def _landed(self, batch: Batch) -> list[int] | None:
        """If an earlier attempt of `batch` was stored, the sequences it got; else None."""
        starts = await asyncio.gather(*(self._landed_at(batch, guard) for guard in batch.guards.values()))
        if None in starts or len(set(starts)) != 1:
            return None
        first_seq = starts[0]
        assert first_seq is not None
        self._remember(batch, first_seq)
        return list(range(first_seq, first_seq + len(batch.outs)))

    async def _landed_at(self, batch: Batch, guard: Guard) -> int | None:
        """Where `batch` begins if an attempt of it was stored, as `guard`'s subject tells: its
        message there right after the sequence the attempt expected, whatever was written after it
        (a drain's fence on a placement's booking subject, between the lost ack and this look: an
        audit found such a placement refused although stored); else the subject's last message (an
        attempt stored before a re-plan moved the expectation onto it). None if neither is ours."""

        def ours(found: Stored | None, index: int) -> bool:
            out = batch.outs[index]
            return found is not None and found.headers.get(MSG_ID_HEADER) == out.headers[MSG_ID_HEADER] \
                and found.data == out.data

        if guard.expected is not None:
            retry = Retry(f"reading {guard.subject} after {guard.expected} through the leader", self.budget, self)
            after = await self._leader_get({"seq": guard.expected + 1, "next_by_subj": guard.subject}, retry)
            if ours(after, guard.first_index):
                return sequence_of(after) - guard.first_index
        last = await self.last_from_leader(guard.subject)
        return sequence_of(last) - guard.last_index if ours(last, guard.last_index) else None

    def _remember(self, batch: Batch, first_seq: int) -> None:
        for guard in batch.guards.values():
            last = Last(first_seq + guard.last_index, guard.last_position)
            self.link.last_seen.put(guard.subject, last, authoritative=True)

    async def _send(self, batch: Batch, timeout: float) -> int:
        """One attempt: publish the batch; the stream sequence of its last message."""
        nc = self.link.nc
        outs = batch.outs
        expectations = {guard.first_index: guard.expected for guard in batch.guards.values()}

        def headers_of(index: int, out: Out) -> dict[str, str]:
            headers = dict(out.headers)
            expected = expectations.get(index)
            if expected is not None:
                headers[EXPECTED_SUBJECT_SEQ_HEADER] = str(expected)
            fenced = batch.fence_at.get(index)
            if fenced is not None:
                headers[EXPECTED_SUBJECT_SEQ_HEADER] = str(batch.fences[fenced])
                headers[EXPECTED_SUBJECT_SEQ_SUBJECT_HEADER] = fenced
            return headers

        if len(outs) == 1:
            reply = await self._answer(
                nc.request(outs[0].subject, outs[0].data, timeout=timeout, headers=headers_of(0, outs[0])))
        else:
            batch_id = self.link.nuid.next().decode()
            for index, out in enumerate(outs[:-1]):
                headers = headers_of(index, out)
                headers[BATCH_ID_HEADER] = batch_id
                headers[BATCH_SEQ_HEADER] = str(index + 1)
                await nc.publish(out.subject, out.data, headers=headers)
            last = len(outs) - 1
            headers = headers_of(last, outs[last])
            headers[BATCH_ID_HEADER] = batch_id
            headers[BATCH_SEQ_HEADER] = str(len(outs))
            headers[BATCH_COMMIT_HEADER] = "1"
            reply = await self._answer(nc.request(outs[last].subject, outs[last].data, timeout=timeout, headers=headers))
        ack = json.loads(reply.data)
        refusal = errors.ack_refusal(ack, len(outs))
        if refusal is not None:
            raise refusal
        return int(ack["seq"])


MIN_SERVER = "2.12"  # the first nats-server with atomic batch publish (`allow_atomic`)


def refuse_without_atomic(stream: str, config: dict[str, Any], server: str) -> None:
    """OperationalError unless the stream's config, as the server answered it, keeps `allow_atomic`.
    A server older than MIN_SERVER drops the field it does not know, and then stores the messages
    of a "batch" one by one: a placement's events without the booking marker that fences it
    (CONTRACT placement rule 8), a worker's edit half written. Nothing is appended to such a stream."""
    if not config.get("allow_atomic"):
        raise OperationalError(
            f"stream {stream} does not allow atomic batches on nats-server {server}: warmboot's appends are "
            f"JetStream atomic batches, which need nats-server {MIN_SERVER} or later")
