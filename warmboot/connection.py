"""How every warmboot process connects to NATS: the services, the CLI, the demo and the client library.

`connect` makes a connection that keeps reconnecting while the server restarts, signs in
as the URL, an nkey seed or a credentials file says, listens for its replies under the inbox
prefix its user may subscribe to (`events.natsauth.inbox_prefix`: `_INBOX.<user>` under the
permissions of `warmboot nats-config`), reports each error once while it repeats instead of
a traceback per attempt (`events.natspy.ErrorsOnce`), and reads its frames through the frame
reader (`events.natspy.guard_reads`). `connect_within` bounds the first connection: a server
that does not answer is UNAVAILABLE, naming it, within the bound.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import nats
import nats.errors

from events.errors import ContractError, precondition, unavailable
from events.natsauth import inbox_prefix as chosen_inbox_prefix, nkey_options, nkey_seed_path, redact_url
from events.natspy import ErrorsOnce, abandon, connecting, describe_error, guard_reads, inbox_of

log = logging.getLogger("warmboot")

CONNECT_TIMEOUT_S = 5.0  # how long a one-shot command, or a client, waits for its server


async def connect(url: str, name: str, *, inbox_prefix: str | None = None, nkey_seed: str | None = None,
                  errors: ErrorsOnce | None = None, reconnect_time_wait: float = 0.5, **options: Any) -> nats.NATS:
    """A client that keeps reconnecting while the server restarts (and waits for it at the
    start); its errors go to `errors` (default: logged once each while they repeat).

    Signs in with the nkey seed file `nkey_seed` or $NATS_NKEY_SEED when there is one,
    besides any user:password in `url`. Its inbox prefix is `inbox_prefix`, else
    $NATS_INBOX_PREFIX, else `_INBOX.<user>` when `url` names a user (`events.natsauth.inbox_prefix`).
    `options` go to `nats.connect` as they are (`user_credentials`, ...).
    """
    options.update(nkey_options(nkey_seed_path(nkey_seed)))
    inbox = chosen_inbox_prefix(url, inbox_prefix)
    if inbox:
        options["inbox_prefix"] = inbox
    if errors is None:
        errors = ErrorsOnce(log, redact_url(url))

    async def reconnected() -> None:
        errors.reset()

    nc = await connecting(  # ends when cancelled, even as the TCP connection is made, and closes
        nats.NATS(),
        servers=url.split(","),
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=reconnect_time_wait,
        allow_reconnect=True,
        error_cb=errors.report,
        reconnected_cb=reconnected,
        **options,
    )
    guard_reads(nc)  # a message nats-py cannot read is dropped, not the end of its read loop
    return nc


async def connect_within(url: str, name: str, timeout_s: float = CONNECT_TIMEOUT_S, *,
                         errors: ErrorsOnce | None = None, nkey_seed: str | None = None,
                         **options: Any) -> nats.NATS:
    """`connect`, or a ContractError naming the server (redacted): FAILED_PRECONDITION when the server
    refuses the credentials (at once for a URL of one server, no retry changes that:
    `ErrorsOnce.refused`; for a cluster's members, once `timeout_s` has passed without one taking
    them, since another member may: a password being rotated) or the nkey seed file does not exist;
    UNAVAILABLE with its last error if no server answers within `timeout_s`."""
    where = redact_url(url)
    seed = nkey_seed_path(nkey_seed)
    if seed is not None and not os.path.isfile(seed):
        raise precondition(f"no nkey seed file {seed!r} to sign in to NATS at {where} with")
    errors = errors if errors is not None else ErrorsOnce(None)  # the last one is in the refusal
    attempt = asyncio.ensure_future(connect(url, name, errors=errors, nkey_seed=seed, **options))
    one_server = len(url.split(",")) == 1
    refused = asyncio.ensure_future(errors.refused()) if one_server else asyncio.get_running_loop().create_future()
    try:
        await asyncio.wait((attempt, refused), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled: a connection made meanwhile is nobody's
        refused.cancel()
        await abandon(attempt)
        raise
    refused.cancel()
    if attempt.done():  # nothing awaited from here to the return: a cancellation cannot lose it
        try:
            return attempt.result()
        except (OSError, nats.errors.Error) as e:
            raise unavailable(f"cannot reach NATS at {where}: {describe_error(errors.last or e)}") from None
    await abandon(attempt)  # given up on (`connect` closes what it made), or made at the last moment
    if errors.refusal is not None:
        raise precondition(f"NATS at {where} refuses the sign-in: {describe_error(errors.refusal)} (check "
                           "the user and password or token in the URL, or the nkey seed)")
    raise unavailable(f"cannot reach NATS at {where} within {timeout_s:g} s: "
                      f"{describe_error(errors.last or asyncio.TimeoutError())}")


def inbox_refused(url: str, nc: nats.NATS, error: Exception) -> ContractError:
    """FAILED_PRECONDITION: the server at `url` refuses this connection's user the inbox it hears its
    replies under (`events.natspy.ErrorsOnce.watch_inbox`), and says what to set."""
    return precondition(f"NATS at {redact_url(url)} does not let this user hear its replies under "
                        f"{inbox_of(nc)}. ({describe_error(error)}): with an nkey seed, set "
                        "NATS_INBOX_PREFIX=_INBOX.<user> (docs/security.md, \"Connecting with the credentials\")")
