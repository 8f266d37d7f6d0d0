"""The one place where what NATS says becomes the eventsourcing library's errors.

An attempt on the server ends in an answer, a refusal (JetStream's error reply or an
acknowledgement that says no: `ServerError`, `ack_refusal`; the status of a direct get:
`direct_get_refused`) or a nats-py exception. `retryable` says which
failures are worth another attempt within the operation's budget (`retry.Retry`);
`library_error` says what every other one is to the library:

- nobody answered, no answer in time, a connection lost under a write (`unanswered`), a
  503 or 429, a leader election, an incomplete batch, a message id another proposal is
  storing right now (`retryable`): another attempt; past the budget,
  `StoreUnavailableError` (an `OperationalError`);
- a subject that moved on (`ServerError.conflict`): `IntegrityError`, at once when the
  caller gave every expected sequence, else once the append protocol has looked again
  and found it a real conflict;
- a message larger than the server's max_payload: `DataError`;
- any other refusal: `OperationalError`.

Errors the store concludes from what it reads (a version already taken: IntegrityError)
or from what the caller passes (an id that cannot be a subject: ProgrammingError) are
raised where the conclusion is drawn, not here: no answer of the server is behind them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

import nats.errors
import nats.js.errors
from eventsourcing.persistence import DataError, IntegrityError, OperationalError, PersistenceError

from events.nats_codes import (
    ERR_WRONG_LAST_SEQUENCE,
    ERR_BATCH_WRONG_LAST_SEQUENCE,
    ERR_BATCH_DUPLICATE_MSG_ID,
    ERR_BATCH_INCOMPLETE,
    ERR_CLUSTER_NOT_AVAILABLE,
    ERR_CLUSTER_NOT_LEADER,
    ERR_BATCH_TOO_MANY_INFLIGHT,
    ERR_NO_MESSAGE_FOUND,
    ERR_STREAM_NOT_FOUND,
    ERR_DUPLICATE_IN_PROCESS,
)
from events.natspy.connections import PublishRefused, transport_lost

CONFLICT_CODES = {ERR_WRONG_LAST_SEQUENCE, ERR_BATCH_WRONG_LAST_SEQUENCE, ERR_BATCH_DUPLICATE_MSG_ID}
TRANSIENT_CODES = {ERR_BATCH_INCOMPLETE, ERR_CLUSTER_NOT_AVAILABLE, ERR_CLUSTER_NOT_LEADER, ERR_BATCH_TOO_MANY_INFLIGHT,
                   ERR_DUPLICATE_IN_PROCESS}


class LeaderElected(Exception):
    """The stream elected a new leader while a request waited for its answer: the leader it
    went to died or stepped down, and will not answer."""


# Nobody took the request: nothing was done.
NOT_DELIVERED: tuple[type[BaseException], ...] = (nats.errors.NoRespondersError,)
# No answer came: the request may or may not have been carried out.
UNANSWERED: tuple[type[BaseException], ...] = (
    LeaderElected,
    nats.errors.TimeoutError,
    asyncio.TimeoutError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionClosedError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.FlushTimeoutError,
    nats.errors.UnexpectedEOF,
    ConnectionError,
)


class StoreUnavailableError(OperationalError):
    """JetStream did not answer (or answered "unavailable") for longer than the retry budget."""


class ServerError(Exception):
    """JetStream answered a publish or API request with an error."""

    def __init__(self, code: int, err_code: int, description: str):
        super().__init__(f"{description} (code {code}, err_code {err_code})")
        self.code = code
        self.err_code = err_code
        self.description = description

    @property
    def transient(self) -> bool:
        return self.code in (503, 429) or self.err_code in TRANSIENT_CODES

    @property
    def conflict(self) -> bool:
        """A subject's last sequence was not the expected one (or a message id was taken)."""
        return self.err_code in CONFLICT_CODES

    @property
    def stream_missing(self) -> bool:
        return self.err_code == ERR_STREAM_NOT_FOUND

    @property
    def no_message(self) -> bool:
        """A message get found nothing (not a failure: the subject is empty there)."""
        return self.err_code == ERR_NO_MESSAGE_FOUND or (self.code == 404 and not self.stream_missing)

    @classmethod
    def from_reply(cls, data: dict[str, Any]) -> "ServerError":
        error = data["error"]
        return cls(int(error.get("code", 0)), int(error.get("err_code", 0)), str(error.get("description", "")))


def ack_refusal(ack: dict[str, Any], count: int) -> Exception | None:
    """What is wrong with the acknowledgement of an append of `count` messages, if anything."""
    if "error" in ack:
        return ServerError.from_reply(ack)
    if ack.get("duplicate"):  # a message id already stored: another writer's, or ours resent
        return ServerError(400, ERR_BATCH_DUPLICATE_MSG_ID, "duplicate message id")
    if count > 1 and int(ack.get("count", count)) != count:
        return OperationalError(f"atomic batch stored {ack.get('count')} of {count} messages")
    return None


def direct_get_refused(status: str) -> Exception:
    """A direct get answered with a status that is neither a message, 404 nor the end of a batch."""
    if status == "503":  # no responders: the stream has no leader or replica answering right now
        return nats.errors.NoRespondersError()
    return OperationalError(f"direct get failed with status {status}")


def unanswered(error: BaseException) -> bool:
    """Whether no answer came to the attempt that raised `error` (`UNANSWERED`, or a write onto a
    transport closed under nats-py: `transport_lost`): it may or may not have been carried out."""
    return isinstance(error, UNANSWERED) or transport_lost(error)


def not_answering(error: BaseException) -> bool:
    """Whether `error` says JetStream or the connection to it is not answering now (`NOT_DELIVERED`
    or `unanswered`): a transient state."""
    return isinstance(error, NOT_DELIVERED) or unanswered(error)


def retryable(error: BaseException, also: Collection[int] = ()) -> bool:
    """Whether `error` is worth another attempt (with `also`: those err_codes as well)."""
    if isinstance(error, ServerError):
        return error.transient or error.err_code in also
    return not_answering(error)


def from_nats_py(error: nats.js.errors.APIError) -> Exception:
    """JetStream's error answer to a request nats-py made itself (the consumer `subscribe` makes), as
    the store's own requests get it: judged by `retryable` and `library_error` alike. nats-py gives a
    request nobody took (no responders: no JetStream yet) as a 503 with no code at all: it is that
    again (found by a review)."""
    if error.code is None and isinstance(error, nats.js.errors.ServiceUnavailableError):
        return nats.errors.NoRespondersError()
    return ServerError(error.code or 0, error.err_code or 0, error.description or "")


def library_error(what: str, error: BaseException) -> BaseException:
    """What a failure that is not retried (or no longer) is to the library."""
    if isinstance(error, PersistenceError):
        return error
    if isinstance(error, ServerError):
        if error.conflict:
            return IntegrityError(f"{what} refused: {error.description}")
        return OperationalError(f"{what}: {error}")
    if isinstance(error, nats.errors.MaxPayloadError):
        return DataError(f"{what}: a message exceeds the server's max_payload")
    if isinstance(error, PublishRefused):  # waiting changes nothing: the credentials are not the services'
        return OperationalError(f"{what}: {error}; the services need the services' credentials "
                                "(`warmboot nats-config --services-user`: docs/security.md)")
    return error


def unavailable(what: str, budget: float, error: BaseException) -> StoreUnavailableError:
    return StoreUnavailableError(f"{what}: JetStream unavailable for {budget:g}s (last error: {error!r})")


def unreachable(where: str, timeout: float, last_error: BaseException | None) -> StoreUnavailableError:
    return StoreUnavailableError(
        f"could not connect to NATS at {where} within {timeout:g}s (last error: {last_error!r})"
    )
