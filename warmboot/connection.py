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
from typing import Any

import nats
import nats.errors

from events.errors import unavailable
from events.natsauth import inbox_prefix as chosen_inbox_prefix, nkey_options, nkey_seed_path, redact_url
from events.natspy import ErrorsOnce, describe_error, guard_reads

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

    nc = await nats.connect(
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
                         errors: ErrorsOnce | None = None, **options: Any) -> nats.NATS:
    """`connect`, or UNAVAILABLE naming the server (redacted) and its last error if it does not
    answer within `timeout_s`."""
    errors = errors if errors is not None else ErrorsOnce(None)  # the last one is in the refusal
    try:
        return await asyncio.wait_for(connect(url, name, errors=errors, **options), timeout_s)
    except (OSError, asyncio.TimeoutError, nats.errors.Error) as e:
        raise unavailable(f"cannot reach NATS at {redact_url(url)} within {timeout_s:g} s: "
                          f"{describe_error(errors.last or e)}") from None
