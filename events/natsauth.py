"""How a warmboot process shows a NATS URL and proves who it is (docs/security.md).

One definition for the services, the event store, the agent and the CLI:

- `check_url`: a URL (or a comma-separated list) nats-py can connect to, or a ValueError
  naming the member and what is wrong with it (nats-py's own says only "invalid connect
  url option", as a traceback, or, for a host that does not resolve, retries forever).
- `redact_url`: a URL (or a comma-separated list of them) as it may appear in a log
  line, a repr or an error message: without the `user:password@` of any member.
- `NKEY_SEED_ENV`: the environment variable that names a file holding an nkey seed
  (`warmboot nats-config --auth nkey` writes one per user); `nkey_options` turns
  it into nats-py's connect options. nats-py reads the file again for each
  signature, so the seed is not kept in the process's memory between connects.
- `inbox_prefix`: the inbox prefix a command connects with. A user of `warmboot
  nats-config` hears replies only under its own `_INBOX.<name>.` (an operator too:
  its account is shared with the other operators), so a URL that names a user gives
  that prefix; `INBOX_PREFIX_ENV` names one explicitly (an nkey user's URL names none).
- `sign_in_options`, `env_sign_in`: nats-py connect options for a credentials file (JWT
  accounts), a user and password, or a token, as given or as the environment gives them
  (`NATS_CREDS`, `NATS_USER`/`NATS_PASSWORD`, `NATS_TOKEN`). A URL's own `user:password@`
  or `token@` is what a command line says, and wins over the environment's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

NKEY_SEED_ENV = "NATS_NKEY_SEED"
INBOX_PREFIX_ENV = "NATS_INBOX_PREFIX"
CREDS_ENV = "NATS_CREDS"  # a credentials file (a user JWT and its nkey seed)
USER_ENV = "NATS_USER"
PASSWORD_ENV = "NATS_PASSWORD"
TOKEN_ENV = "NATS_TOKEN"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}(?!\n)$")  # a user name that is one subject token (every nats-config user)

# A member's scheme, when it has one; the rest of the member is `user:password@host:port`.
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)(.*)$", re.DOTALL)


NATS_SCHEMES = ("nats", "tls", "ws", "wss")  # what nats-py connects to


def check_url(url: str) -> str:
    """`url` itself when each comma-separated member is a URL nats-py connects to (a bare
    `host:port` is `nats://host:port`, as nats-py reads it); else ValueError naming the member
    (redacted) and what is wrong with it."""
    members = [member.strip() for member in url.split(",")]
    for member in members:
        if not member:
            raise ValueError(f"{redact_url(url)!r} has an empty member: give URLs separated by single commas")
        split = urlsplit(member if "//" in member else f"nats://{member}")
        shown = redact_url(member)
        scheme = _SCHEME.match(member)
        written = scheme.group(1)[:-3] if scheme else split.scheme
        if written not in NATS_SCHEMES:  # nats-py reads `NATS://h` as a host named NATS
            case = " (in lower case)" if written.lower() in NATS_SCHEMES else ""
            raise ValueError(f"{shown!r}: the scheme must be one of {', '.join(NATS_SCHEMES)}{case}, not {written!r}")
        if any(c in _parts(member)[1] for c in "/?#"):
            # nats-py sends a URL's user and password as written, %-escapes included: no encoding helps
            raise ValueError(f"{shown!r}: the user or password holds '/', '?' or '#', which end a URL's user "
                             "part, and nats-py does not decode %-escapes: use a password without them (`warmboot "
                             f"nats-config` writes letters, digits, '-' and '_'), or an nkey seed (${NKEY_SEED_ENV})")
        try:
            split.port
        except ValueError:
            raise ValueError(f"{shown!r}: the port must be a number from 0 to 65535") from None
        if not split.hostname:
            raise ValueError(f"{shown!r} names no host")
    return url


def redact_url(url: str) -> str:
    """`nats://svc:secret@h:4222,nats://svc:secret@h2` -> `nats://h:4222,nats://h2`: each
    member without everything up to its last '@', so a password holding an unencoded '@',
    '/', '?' or '#' is removed whole."""
    return ",".join(head + host for head, _, host in map(_parts, url.split(",")))


def _parts(member: str) -> tuple[str, str, str]:
    """One member of a URL list, as written: (`scheme://` or '', `user:password` or '', the rest
    after its last '@')."""
    scheme = _SCHEME.match(member)
    head, rest = (scheme.group(1), scheme.group(2)) if scheme else ("", member)
    userinfo, _, host = rest.rpartition("@")
    return head, userinfo, host


def carries_secret(url: str) -> bool:
    """Whether a member of `url` carries a secret: `user:password@` or a token (`token@`)."""
    return any(_parts(member.strip())[1] for member in url.split(","))


def nkey_seed_path(explicit: str | None = None) -> str | None:
    """The nkey seed file to sign with: `explicit`, else $NATS_NKEY_SEED, else none."""
    return explicit or os.environ.get(NKEY_SEED_ENV) or None


@contextmanager
def seed_key_pair(seed_path: str) -> Iterator[Any]:
    """The nkey key pair of the seed in the file `seed_path`, for the block: then wiped, and the
    seed's bytes zeroed, as nats-py does with its own. OSError if the file cannot be read; ValueError
    if it holds no nkey seed (its text is never quoted)."""
    import nkeys  # nats-py's own dependency for nkey sign-ins

    with open(seed_path, "rb") as f:
        seed = bytearray(f.read().strip())
    try:
        try:
            pair = nkeys.from_seed(seed)  # keeps `seed` itself: its public key is read from it
        except Exception:
            raise ValueError(f"{seed_path!r} holds no nkey seed") from None
        try:
            yield pair
        finally:
            pair.wipe()
    finally:
        seed[:] = bytes(len(seed))


def nkey_seed_problem(seed_path: str) -> str | None:
    """Why the file `seed_path` cannot sign in as an nkey user, or None if it can: unreadable, or not
    an nkey seed (another file given by mistake: nats-py raised its ErrInvalidSeed only as it connected,
    a traceback). Read once and wiped (`seed_key_pair`); the message quotes nothing of the file."""
    try:
        with seed_key_pair(seed_path):
            pass
    except OSError as e:
        return f"cannot read the nkey seed file {seed_path!r}: {e.strerror or e}"
    except ValueError:
        return (f"{seed_path!r} holds no nkey seed (one line, SU..., as `warmboot nats-config --auth nkey "
                "--seeds-dir DIR` writes DIR/USER.nk)")
    return None


def nkey_options(seed_path: str | None) -> dict[str, str]:
    """nats-py connect options for an nkey seed file (none without one)."""
    return {"nkeys_seed": seed_path} if seed_path else {}


def inbox_prefix(url: str, explicit: str | None = None, seed: str | None = None) -> str | None:
    """The inbox prefix to connect with: `explicit`, else $NATS_INBOX_PREFIX, else
    `_INBOX.<user>` for the first member of `url` that names a user who is one subject token,
    else for $NATS_USER when `url` names no user, else, signing in with the nkey seed file `seed`,
    for the user its name gives (`<user>.nk`, as `warmboot nats-config --seeds-dir` names each
    user's); None (nats-py's own random `_INBOX.<nuid>`) when there is none of these. (An nkey
    user's commands, `worker drain W --nkey-seed W.nk` the docs' own, were refused the inbox
    nats-py chose until $NATS_INBOX_PREFIX said it: a trial of a secured deployment.)"""
    chosen = explicit or os.environ.get(INBOX_PREFIX_ENV)
    if chosen:
        return chosen
    for member in url.split(","):
        member = member.strip()
        user = urlsplit(member if "//" in member else f"nats://{member}").username
        if user:  # as nats-py sends it: written, not %-decoded
            return f"_INBOX.{user}" if _TOKEN.match(user) else None
    user = os.environ.get(USER_ENV)  # the user the environment signs in (`env_sign_in`)
    if user:
        return f"_INBOX.{user}" if _TOKEN.match(user) else None
    if seed is not None:
        name = os.path.basename(seed)
        user = name[:-len(".nk")] if name.endswith(".nk") else None
        return f"_INBOX.{user}" if user and _TOKEN.match(user) else None
    return None


def sign_in_options(url: str, *, creds: str | None = None, user: str | None = None,
                    password: str | None = None, token: str | None = None) -> dict[str, str]:
    """nats-py connect options for a credentials file `creds`, a `user` (with `password`, empty if
    none) or a `token`. nats-py lets a user or token option win over a URL's `user:password@` or
    `token@`; here the URL's wins, as what a command line says: `user` and `token` count only when
    no member of `url` carries a secret."""
    options = {"user_credentials": creds} if creds else {}
    if not carries_secret(url):
        if user:
            options.update(user=user, password=password or "")
        if token:
            options["token"] = token
    return options


def env_sign_in(url: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`sign_in_options` from the environment: $NATS_CREDS, $NATS_USER/$NATS_PASSWORD, $NATS_TOKEN.
    One reading for every warmboot process that connects (the services, their event store, the
    agent, the commands and `warmboot.client`)."""
    env = os.environ if env is None else env
    return sign_in_options(url, creds=env.get(CREDS_ENV) or None, user=env.get(USER_ENV) or None,
                           password=env.get(PASSWORD_ENV) or None, token=env.get(TOKEN_ENV) or None)
