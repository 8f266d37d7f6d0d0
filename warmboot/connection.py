"""How every warmboot process connects to NATS: the services, the CLI, the demo and the client library.

`connect` makes a connection that keeps reconnecting while the server restarts, signs in
as the URL, an nkey seed or a credentials file says, listens for its replies under the inbox
prefix its user may subscribe to (`events.natsauth.inbox_prefix`: `_INBOX.<user>` under the
permissions of `warmboot nats-config`), reports each error once while it repeats instead of
a traceback per attempt (`events.natspy.connections.ErrorsOnce`), and reads its frames through the frame
reader (`events.natspy.frames.guard_reads`). `connect_within` bounds the first connection: a server
that does not answer is UNAVAILABLE, naming it, within the bound.
"""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import suppress
from typing import Any

import nats
import nats.errors
from nats import nuid

from events.errors import precondition, unavailable
from events.natsauth import (
    CREDS_ENV,
    TOKEN_ENV,
    USER_ENV,
    carries_secret,
    env_sign_in,
    inbox_prefix as chosen_inbox_prefix,
    nkey_options,
    nkey_seed_path,
    nkey_seed_problem,
    redact_url,
)
from events.natspy.connections import ErrorsOnce, abandon, connecting, describe_error, inbox_of
from events.natspy.frames import guard_reads
from events.natspy.publish import flush_in_order

log = logging.getLogger("warmboot")

CONNECT_TIMEOUT_S = 5.0  # how long a one-shot command, or a client, waits for its server


async def connect(url: str, name: str, *, inbox_prefix: str | None = None, nkey_seed: str | None = None,
                  errors: ErrorsOnce | None = None, reconnect_time_wait: float = 0.5, **options: Any) -> nats.NATS:
    """A client that keeps reconnecting while the server restarts (and waits for it at the
    start); its errors go to `errors` (default: logged once each while they repeat).

    Signs in with the nkey seed file `nkey_seed` or $NATS_NKEY_SEED when there is one,
    besides any user:password in `url`, and with what the environment gives
    (`events.natsauth.env_sign_in`: $NATS_CREDS, and $NATS_USER/$NATS_PASSWORD or $NATS_TOKEN
    when `url` carries no secret). Its inbox prefix is `inbox_prefix`, else $NATS_INBOX_PREFIX,
    else `_INBOX.<user>` when `url` (or else $NATS_USER, or else the nkey seed file's name,
    `<user>.nk`) names a user (`events.natsauth.inbox_prefix`). `options` go to `nats.connect` as they are
    (`user_credentials`, ...), over the environment's.
    """
    if errors is None:  # a process that keeps trying (the services, the demo): its log says what to check
        errors = ErrorsOnce(log, redact_url(url), sign_in_hint(url, nkey_seed_path(nkey_seed), options))
    options = {**env_sign_in(url), **options}
    options.update(nkey_options(nkey_seed_path(nkey_seed)))
    inbox = chosen_inbox_prefix(url, inbox_prefix, nkey_seed_path(nkey_seed))
    if inbox:
        options["inbox_prefix"] = inbox

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
    problem = nkey_seed_problem(seed) if seed is not None else None
    if problem is not None:  # nats-py raises it only as it connects, an exception no caller expects
        raise precondition(f"{problem}: cannot sign in to NATS at {where} with it")
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
        raise precondition(f"NATS at {where} refuses the sign-in: {describe_error(errors.refusal)} "
                           f"({sign_in_hint(url, seed, options)})")
    raise unavailable(f"cannot reach NATS at {where} within {timeout_s:g} s: "
                      f"{describe_error(errors.last or asyncio.TimeoutError())}")


def sign_in_hint(url: str, seed: str | None, options: dict[str, Any]) -> str:
    """What to check when the server refuses the sign-in: the credentials this connection signed in
    with, where they came from (the URL, $NATS_USER/$NATS_PASSWORD, $NATS_TOKEN, $NATS_CREDS, the nkey
    seed, or the caller's options; `connect`), or, when there were none, where to give them."""
    given = []
    if carries_secret(url):  # wins over the environment's user or token (`env_sign_in`)
        given.append("the user and password or token in the URL")
    elif "user" in options or "token" in options:
        given.append("the user and password or token given to connect")
    else:
        given += [what for env, what in ((USER_ENV, "$NATS_USER/$NATS_PASSWORD"), (TOKEN_ENV, "$NATS_TOKEN"))
                  if os.environ.get(env)]
    if options.get("user_credentials") or os.environ.get(CREDS_ENV):
        given.append("the credentials file ($NATS_CREDS)")
    if seed is not None:
        given.append(f"the nkey seed in {seed}")
    if not given:
        return ("no credentials were given: put user:password@ in the URL, or give $NATS_USER/$NATS_PASSWORD, "
                "$NATS_TOKEN, $NATS_CREDS or an nkey seed")
    return f"check {', '.join(given)}"


async def hears_replies(url: str, nc: nats.NATS, errors: ErrorsOnce) -> None:
    """FAILED_PRECONDITION, before any request is sent, if the server at `url` refuses this connection's
    user a subscription under the inbox prefix it hears its replies under: every request would be
    carried out unanswered, and a caller told only that it timed out (a user signed in with an nkey
    seed and no NATS_INBOX_PREFIX, or with another user's prefix). One subscription like the one
    nats-py makes for its requests, and a flush: nats-py hands the server's refusal, which comes
    before the flush's answer, to `errors` (`ErrorsOnce.watch_inbox`) as it reads it."""
    prefix = inbox_of(nc)
    errors.watch_inbox(prefix)
    probe = await nc.subscribe(f"{prefix}.{nuid.NUID().next().decode()}.*")
    try:
        await flush_in_order(nc, CONNECT_TIMEOUT_S)
    except Exception as error:  # the server went away just now, or does not answer
        raise unavailable(f"NATS at {redact_url(url)} did not answer: {describe_error(error)}") from None
    finally:
        with suppress(Exception):
            await probe.unsubscribe()
    refusal = errors.inbox_refusal
    if refusal is not None:
        raise precondition(f"NATS at {redact_url(url)} does not let this user hear its replies under {prefix}.> "
                           f"({describe_error(refusal)}): give the user's own inbox prefix, _INBOX.<user> "
                           "(NATS_INBOX_PREFIX, or the client's inbox_prefix; docs/security.md, \"Connecting "
                           "with the credentials\"); nothing was sent")
