"""`warmboot nats-config`: who may say what on the bus (docs/security.md).

The permissions of each role are pure functions of the deployment's prefix, and
the configuration text a pure function of the users and their credentials; the
command only reads and writes the files.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click

from events.jetstream.layout import LEADER_ELECTED_ADVISORY
from events.subjects import DEFAULT_PREFIX, bucket_name, events_filter, services_inbox, stream_name
from events.schema import ID_RE, ID_WORDS
from services.registry.liveness import SWEEPER
from services.registry.nodes import encode_nodes
from warmboot.cli_common import check_id, check_prefix_option
from warmboot.files import write_atomically

SERVICES = ("registry", "snapshotter", "scheduler")
ROUTES_USER = "warmboot-routes"  # the one user a cluster member's route signs in as
AUTH_MODES = ("password", "bcrypt", "nkey")
BCRYPT_ROUNDS = 11  # nats-server's own default (`nats server passwd`)


# --- who may say what ---------------------------------------------------------------------------


def worker_permissions(prefix: str, worker_id: str) -> dict:
    """A worker may speak only for itself, and hear only the replies to its own requests."""
    return {
        "publish": {"allow": [f"{prefix}.registry.*.{worker_id}"]},
        "subscribe": {"allow": [f"_INBOX.{worker_id}.>"]},
    }


def client_permissions(prefix: str, name: str) -> dict:
    """The orchestrator that drives actors: every snapshotter and scheduler endpoint, and
    service discovery; replies on its own inbox prefix, as a worker's."""
    return {
        "publish": {"allow": [f"{prefix}.snapshotter.>", f"{prefix}.scheduler.>", "$SRV.>"]},
        "subscribe": {"allow": [f"_INBOX.{name}.>"]},
    }


def operator_permissions(prefix: str, name: str) -> dict:
    """In the operators' own account (`accounts`): call what it imports from the deployment's
    (read the log by direct gets, the scheduler's read-only queries, service discovery) and
    hear the answers on its own inbox prefix, as a client's: the operators share their
    account, and one that heard another's inboxes would learn the subjects to aim its own
    requests' answers at (a reply subject is not checked against the sender's rights).
    JetStream answers a request onto its reply subject with its account's rights, so a
    credential with any JetStream API right in the log's own account could have an answer,
    or a consumer's deliveries, stored in the log: an operator has none there, and no
    consumer anywhere."""
    return {
        "publish": {"allow": [subject for subject, _ in operator_imports(prefix)]},
        "subscribe": {"allow": [f"_INBOX.{name}.>"]},
    }


def operator_imports(prefix: str) -> list[tuple[str, bool]]:
    """What the operators' account imports from the deployment's: (subject, many answers).

    Each is a service import: the request crosses into the deployment's account with a reply
    subject the server makes (`_R_.`), and its answers come back to the caller's inbox in the
    operators' account, out of reach of every stream."""
    stream = stream_name(prefix)
    return [
        (f"{prefix}.scheduler.explain.*", False),
        (f"{prefix}.scheduler.fragmentation", False),
        (f"{prefix}.scheduler.whatif", False),
        (f"{prefix}.scheduler.runtimes", False),  # the fleet's runtimes, as the views label them
        (f"{prefix}.scheduler.worker.*", False),  # one worker, as `worker show` prints it
        (f"{prefix}.scheduler.actors", False),  # the actors of the fold, a page at a time (`actor list`)
        (f"{prefix}.scheduler.workers", False),  # the registered workers, a page at a time (`workers`)
        ("$SRV.>", True),  # every service answers discovery
        ("$JS.API.INFO", False),
        (f"$JS.API.STREAM.INFO.{stream}", False),
        (f"$JS.API.STREAM.MSG.GET.{stream}", False),
        (f"$JS.API.DIRECT.GET.{stream}", True),  # a batch is many messages and an end-of-batch status
        (f"$JS.API.DIRECT.GET.{stream}.>", False),
    ]


def account_names(prefix: str) -> tuple[str, str]:
    """The deployment's account (the log, the services, clients, workers) and the operators'.
    The deployment's has no `-` (`team-a` -> `TEAM_A`) and the operators' always has one
    (`TEAM_A-OPERATORS`), so no deployment's account is another's operators' account when their
    blocks are merged on one server (with `_OPERATORS`, prefix `x`'s operators were prefix
    `x-operators`' deployment account, its JetStream included)."""
    base = prefix.upper().replace("-", "_")
    return base, f"{base}-OPERATORS"


def services_api(prefix: str) -> list[str]:
    """The JetStream API calls the services make, stream by stream (found by running every
    flow under these permissions and watching the API: tests/test_security.py). Why
    each one is there: docs/security.md."""
    events = stream_name(prefix)
    heartbeats = f"KV_{bucket_name(prefix, 'heartbeats')}"
    replies = f"KV_{bucket_name(prefix, 'replies')}"
    checkpoints = f"OBJ_{bucket_name(prefix, 'checkpoints')}"
    settings = f"KV_{bucket_name(prefix, 'settings')}"
    calls = [
        "INFO",
        "STREAM.NAMES",
        # the event log: the event store, the scheduler's fold, the registry's start-up reconciliation
        f"STREAM.CREATE.{events}", f"STREAM.UPDATE.{events}", f"STREAM.INFO.{events}",
        f"STREAM.MSG.GET.{events}", f"DIRECT.GET.{events}", f"DIRECT.GET.{events}.>",
        f"CONSUMER.CREATE.{events}", f"CONSUMER.CREATE.{events}.>", f"CONSUMER.INFO.{events}.*",
        f"CONSUMER.MSG.NEXT.{events}.*",
        # heartbeats: the registry's puts and reads, its durable sweeper of expiry markers
        f"STREAM.CREATE.{heartbeats}", f"STREAM.INFO.{heartbeats}", f"STREAM.MSG.GET.{heartbeats}",
        f"DIRECT.GET.{heartbeats}.>", f"CONSUMER.CREATE.{heartbeats}.>", f"CONSUMER.DURABLE.CREATE.{heartbeats}.*",
        f"CONSUMER.INFO.{heartbeats}.*", f"CONSUMER.MSG.NEXT.{heartbeats}.*",
        # the sweeper unpins itself when it stops, and replaces an earlier version's consumer
        f"CONSUMER.UNPIN.{heartbeats}.{SWEEPER}", f"CONSUMER.DELETE.{heartbeats}.{SWEEPER}",
        # the reply cache: key gets and puts
        f"STREAM.CREATE.{replies}", f"STREAM.INFO.{replies}", f"STREAM.MSG.GET.{replies}",
        f"DIRECT.GET.{replies}.>",
        # scheduler checkpoints: object puts, gets (an ordered consumer per object), deletes (purges)
        f"STREAM.CREATE.{checkpoints}", f"STREAM.INFO.{checkpoints}", f"STREAM.MSG.GET.{checkpoints}",
        f"DIRECT.GET.{checkpoints}.>", f"STREAM.PURGE.{checkpoints}",
        f"CONSUMER.CREATE.{checkpoints}", f"CONSUMER.CREATE.{checkpoints}.>",
        # deployment settings (the registry's binding of workers to nodes): created, read at the leader, followed
        f"STREAM.CREATE.{settings}", f"STREAM.MSG.GET.{settings}", f"CONSUMER.CREATE.{settings}",
    ]
    return [f"$JS.API.{call}" for call in calls] + [
        f"$JS.ACK.{heartbeats}.>",  # the sweeper acknowledges (all at once) and hands back markers
        f"$JS.FC.{events}.>",  # flow control of the ordered consumers on the log
        f"$JS.FC.{checkpoints}.>",  # and of those that read a checkpoint's chunks
        f"$JS.FC.{settings}.>",  # and of the one that follows the settings
    ]


def services_permissions(prefix: str) -> dict:
    """Publish only into the services' own streams and buckets (through the JetStream API
    and onto their subjects) and onto inboxes; never onto any service's request subject.
    Subscribe where they serve, to discovery, to their own inboxes, and to the log's leader
    elections (the event store resends an append the old leader will not answer)."""
    p = prefix
    publish = [
        events_filter(p),  # <prefix>.ev.>: events, booking markers, whatever the log gains
        f"{p}.tracking.>",  # process applications' tracking records, in the same stream
        f"$KV.{bucket_name(p, 'heartbeats')}.>",
        f"$KV.{bucket_name(p, 'replies')}.>",
        f"$O.{bucket_name(p, 'checkpoints')}.>",
        f"$KV.{bucket_name(p, 'settings')}.>",
        *services_api(p),
        "_INBOX.>",  # replies (the endpoints answer only inboxes)
        "_R_.>",  # replies to an operator's call, through its account's import (the server's reply subject)
    ]
    return {
        "publish": {"allow": publish, "deny": [f"{services_inbox(p)}.>"]},
        "subscribe": {
            "allow": [*(f"{p}.{service}.>" for service in SERVICES), "$SRV.>", f"{services_inbox(p)}.>",
                      f"{LEADER_ELECTED_ADVISORY}.{stream_name(p)}"],
        },
    }


# --- credentials ------------------------------------------------------------------------------


def new_password() -> str:
    return secrets.token_urlsafe(24)


def new_nkey_seed() -> str:
    """A new user nkey seed (`SU...`), as `nsc`/`nk -gen user` make one."""
    import nkeys

    return nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER).decode()


def nkey_public(seed: str) -> str:
    import nkeys

    pair = nkeys.from_seed(bytearray(seed.encode()))
    try:
        return pair.public_key.decode()
    finally:
        pair.wipe()


def bcrypt_hash(password: str, rounds: int = BCRYPT_ROUNDS) -> str:
    import bcrypt

    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds, prefix=b"2a")).decode()


@dataclass(frozen=True)
class Identity:
    """How the server knows one user: `user` + `password` (clear or bcrypt), or `nkey` alone."""

    user: str
    password: str | None = None
    nkey: str | None = None

    def fields(self) -> str:
        if self.nkey is not None:
            return f"nkey: {_q(self.nkey)}"
        return f"user: {_q(self.user)}, password: {_q(self.password or '')}"


def identities(auth: str, secrets_of: dict[str, str]) -> dict[str, Identity]:
    """What the configuration holds of each user: the password, its bcrypt hash, or the
    nkey seed's public key (the seed itself never goes into the configuration)."""
    if auth == "password":
        return {u: Identity(u, password=s) for u, s in secrets_of.items()}
    if auth == "bcrypt":
        return {u: Identity(u, password=bcrypt_hash(s)) for u, s in secrets_of.items()}
    if auth == "nkey":
        return {u: Identity(u, nkey=nkey_public(s)) for u, s in secrets_of.items()}
    raise ValueError(f"auth must be one of {', '.join(AUTH_MODES)}, not {auth!r}")


# --- the configuration text ---------------------------------------------------------------------


def _q(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid nats-server config string


def _permissions(perms: dict) -> str:
    parts = []
    for direction in ("publish", "subscribe"):
        rules = [f"{kind}: [{', '.join(_q(s) for s in perms[direction][kind])}]"
                 for kind in ("allow", "deny") if perms[direction].get(kind)]
        parts.append(f"{direction}: {{ {', '.join(rules)} }}")
    return "{ " + ", ".join(parts) + " }"


def nats_auth_config(
    prefix: str,
    services_user: str,
    workers: list[str],
    operators: list[str],
    passwords: dict[str, str] | None = None,
    clients: list[str] | None = None,
    ids: dict[str, Identity] | None = None,
    file_name: str = "warmboot-auth.conf",
) -> str:
    """The `accounts` block of a nats-server configuration: the deployment's account (its
    JetStream, the services, clients and workers, one user each) and the operators' (no
    JetStream; what it may call of the deployment's, imported).

    Users are given by `ids` (any auth mode), or by clear `passwords`.
    """
    clients = clients or []
    if ids is None:
        ids = identities("password", passwords or {})
    held = "nkey public keys" if any(i.nkey for i in ids.values()) else "passwords (or their hashes)"
    deployment, operators_account = account_names(prefix)
    imports = operator_imports(prefix)

    def user(name: str, perms: dict) -> str:
        return f"      {{ {ids[name].fields()}, permissions: {_permissions(perms)} }}"

    lines = [
        f"# warmboot users for the subject prefix {prefix!r}, written by `warmboot nats-config`.",
        f"# Include this file from the nats-server configuration:  include {_q(file_name)}",
        f"# It holds {held}: keep it readable by the server's user only.",
        "accounts {",
        f"  {_q(deployment)}: {{",
        "    jetstream: enabled",
        "    users: [",
        "      # services (registry, snapshotter, scheduler): their own streams and buckets, inboxes",
        user(services_user, services_permissions(prefix)),
    ]
    if clients:
        lines.append("      # clients: the snapshotter and the scheduler, replies on _INBOX.<own name>.>")
    lines += [user(name, client_permissions(prefix, name)) for name in clients]
    if workers:
        lines.append(f"      # workers: {prefix}.registry.*.<own id> only, replies on _INBOX.<own id>.>")
    lines += [user(worker_id, worker_permissions(prefix, worker_id)) for worker_id in workers]
    lines += [
        "    ]",
        "    # what the operators' account may call (docs/security.md, Operators)",
        "    exports: [",
        *(f"      {{ service: {_q(subject)}, accounts: [{_q(operators_account)}]"
          + (", response: stream }" if many else " }") for subject, many in imports),
        "    ]",
        "  }",
        f"  {_q(operators_account)}: {{",
        "    users: [",
    ]
    if operators:
        lines.append(f"      # operators: read the log ({events_filter(prefix)}, by direct gets), call explain, "
                     "fragmentation, whatif, runtimes, worker, actors, workers; "
                     "replies on _INBOX.<own name>.>")
    lines += [user(name, operator_permissions(prefix, name)) for name in operators]
    lines += [
        "    ]",
        "    imports: [",
        *(f"      {{ service: {{ account: {_q(deployment)}, subject: {_q(subject)} }} }}" for subject, _ in imports),
        "    ]",
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def route_urls(given: str) -> list[str]:
    """The cluster members' route URLs (`nats://HOST:PORT` or `nats-route://HOST:PORT`, comma-separated),
    checked: no credentials of their own (`routes_config` gives them theirs), nothing but a host and a
    port. A bad one is a BadParameter naming it."""
    urls = [u.strip() for u in given.split(",") if u.strip()]
    if not urls:
        raise click.BadParameter("no route given: one nats://HOST:PORT per cluster member, comma-separated",
                                 param_hint="'--routes'")
    for url in urls:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise click.BadParameter(f"{url!r}: {e}", param_hint="'--routes'") from None
        if (parts.scheme not in ("nats", "nats-route") or not parts.hostname or not port
                or not re.fullmatch(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]",
                                    parts.netloc.rpartition("@")[2].rpartition(":")[0])):
            raise click.BadParameter(f"{url!r} is not nats://HOST:PORT (a member's cluster port)",
                                     param_hint="'--routes'")
        if parts.username is not None or parts.password is not None:
            raise click.BadParameter(f"{url!r} carries credentials: the routes are given theirs "
                                     f"({ROUTES_USER}), leave them out", param_hint="'--routes'")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise click.BadParameter(f"{url!r}: a route is a host and a port, nothing after them",
                                     param_hint="'--routes'")
    twice = sorted({u for u in urls if urls.count(u) > 1})
    if twice:
        raise click.BadParameter(f"{', '.join(twice)} given twice", param_hint="'--routes'")
    return urls


def routes_config(urls: list[str], password: str, file_name: str = "warmboot-routes.conf") -> str:
    """What a member's `cluster` block includes: the credential a route must sign in with (so that no
    process that reaches a cluster port joins the cluster, and sees and says everything, bypassing
    every user's permissions), and the members' routes, signed in with it."""
    signed = [urlsplit(u)._replace(netloc=f"{ROUTES_USER}:{password}@{urlsplit(u).netloc}").geturl() for u in urls]
    lines = [
        "# The cluster's routes and their credential, written by `warmboot nats-config --routes`.",
        f"# Include it inside the members' `cluster` block:  cluster {{ ... include {_q(file_name)} }}",
        "# It holds the routes' password in clear (each member signs its own routes in with it): keep it",
        "# readable by the server's user only.",
        f"authorization {{ user: {_q(ROUTES_USER)}, password: {_q(password)}, timeout: 2 }}",
        "routes: [",
        *(f"  {_q(url)}" for url in signed),
        "]",
    ]
    return "\n".join(lines) + "\n"


def kept_route_password(path: Path) -> str | None:
    """The routes' password of a file `routes_config` wrote before (kept: every member must have the
    same, and a member reloads the file it has), or None."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise click.ClickException(f"{path}: cannot read the routes' credential kept there: {e}") from None
    found = re.search(r'^authorization \{ user: "[^"]*", password: "([A-Za-z0-9_-]+)"', text, re.M)
    return found.group(1) if found else None


# --- the command ------------------------------------------------------------------------------


def _write_private(path: Path, text: str) -> None:
    """`text` to `path`, mode 0600, whole or not at all (`write_atomically`): a member that reloads or
    restarts on a file half-written would run without its authorization."""
    try:
        write_atomically(path, text, 0o600)
    except OSError as e:
        raise click.ClickException(f"{path}: cannot write it ({e}); the file there is as it was") from None


def _worker_nodes(entries: list[tuple[str, str]]) -> tuple[dict[str, str | None], dict[str, str]]:
    """worker id -> its node (None if not given), and worker id -> where it was given (`--worker ID`, or
    the file's line), from `WORKER_ID[@NODE]` entries, each with where it was given; a bad id, or one
    worker given twice (a typo of another id, or two nodes), is a usage error naming where."""
    nodes: dict[str, str | None] = {}
    given_at: dict[str, str] = {}
    for where, entry in entries:
        # the option the entry came by, quoted as click quotes an option it names, and the entry where it
        # was: the file's line, or the --worker value itself (`--worker 'w 1'` said `--worker: w 1: 'w 1'
        # is not an id`, where every other usage error says `'--worker': 'w 1' is not an id`: a user trial)
        given = where.startswith("--worker ")
        option, shown = ("'--worker'", repr(entry)) if given else ("'--workers-file'", where)
        worker_id, _, node = entry.partition("@")
        for value in (worker_id, node) if node or "@" in entry else (worker_id,):
            if not ID_RE.match(value):
                said = "" if given and value == entry else f"{shown}: "  # a --worker that is the id alone: once
                raise click.BadParameter(f"{said}{value!r} is not an id: {ID_WORDS}", param_hint=option)
        if worker_id in nodes:
            known = nodes[worker_id]
            twice = (f"given two nodes, {known!r} and {node!r}" if known and node and known != node
                     else "given twice")
            said = "" if given and entry == worker_id else f"{shown}: "
            raise click.BadParameter(f"{said}worker {worker_id!r} is {twice} (also at {given_at[worker_id]})",
                                     param_hint=option)
        nodes[worker_id] = node or None
        given_at[worker_id] = where
    return nodes, given_at


# Beside the secrets (in the --secrets file, and as --seeds-dir's ROLES_FILE), the role each user's
# secret was made for: a secret is never handed on to another role under the same name. Never a
# user: an id starts with a letter or a digit.
ROLES_KEY = "_roles"
ROLES_FILE = "_roles.json"


def _read_map(path: Path | None, what: str) -> dict[str, Any]:
    """A JSON object of `what` read from `path` ({} if there is none), or a ClickException naming it."""
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        return {str(k): v for k, v in data.items()}
    except (OSError, ValueError, AttributeError) as e:
        raise click.ClickException(f"{path}: not a JSON object of {what}: {e}") from None


def _read_secrets(path: Path | None) -> tuple[dict[str, str], dict[str, str]]:
    """(user -> secret, user -> the role it was made for) of a secrets file; a file written before
    roles were kept has none."""
    data = _read_map(path, "user -> secret")
    roles = data.pop(ROLES_KEY, None)
    if roles is not None and not isinstance(roles, dict):
        raise click.ClickException(f"{path}: {ROLES_KEY} is not a JSON object of user -> role")
    return {k: str(v) for k, v in data.items()}, {str(k): str(v) for k, v in (roles or {}).items()}


def _read_roles(seeds_dir: Path | None) -> dict[str, str]:
    return {k: str(v) for k, v in _read_map(seeds_dir / ROLES_FILE if seeds_dir else None, "user -> role").items()}


def _usable_seed(seed: str) -> bool:
    try:
        nkey_public(seed)
        return True
    except Exception:
        return False


@click.command("nats-config")
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, envvar="WARMBOOT_PREFIX", show_envvar=True,
              callback=check_prefix_option, help="Subject prefix of the deployment.")
@click.option("--services-user", default="warmboot-services", show_default=True, callback=check_id,
              help="User the services connect as.")
@click.option("--worker", "workers", multiple=True, metavar="WORKER_ID[@NODE]",
              help="A worker's user, named after its id, and the node it runs on (for --worker-nodes); repeatable.")
@click.option("--workers-file", type=click.File("r"), default=None,
              help="File with one WORKER_ID[@NODE] per line (blank lines and # comments skipped).")
@click.option("--worker-nodes", "worker_nodes_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the node each worker is bound to (every worker given as ID@NODE) to this JSON "
                   "file, for `warmboot serve registry --worker-nodes`: a worker's credential then registers "
                   "only on its own node.")
@click.option("--operator", "operators", multiple=True, callback=check_id, metavar="NAME",
              help="An operator's user (read the log, explain, fragmentation, whatif, runtimes, worker, actors, "
                   "workers); repeatable.")
@click.option("--client", "clients", multiple=True, callback=check_id, metavar="NAME",
              help="A client's user (calls the snapshotter and the scheduler; inbox _INBOX.NAME); repeatable.")
@click.option("--auth", type=click.Choice(AUTH_MODES), default="password", show_default=True,
              help="password: clear passwords in the configuration; bcrypt: their bcrypt hashes; "
                   "nkey: one nkey pair per user, only public keys in the configuration.")
@click.option("--secrets", "secrets_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="JSON file of user -> password (or nkey seed with --auth nkey), and _roles: user -> the "
                   "role each was made for: secrets found there are kept for their role, new users (or a user "
                   "in another role) get new ones, and the file is rewritten (mode 0600).")
@click.option("--seeds-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="--auth nkey: also write each user's seed to DIR/USER.nk (mode 0600), the file that "
                   "--nkey-seed / NATS_NKEY_SEED take, and the users' roles to DIR/_roles.json; a seed found "
                   "there is kept for the role recorded for it, and the USER.nk of a user this command made "
                   "before that this run leaves out is removed. No other output may be a file of DIR.")
@click.option("--services-seed", "services_seed_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="--auth nkey: also write the services user's seed alone to this file (mode 0600), for the "
                   "services to sign in with, so that they need not be given every user's seed (--seeds-dir).")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the configuration here (mode 0600) instead of standard output.")
@click.option("--routes", "routes", default=None, metavar="URL[,URL...]",
              help="The cluster members' route URLs (nats://HOST:PORT, each member's cluster port): write, to "
                   "--routes-out, the credential every route must sign in with and these routes signed in with "
                   "it, for the members' `cluster` block to include. Its password is kept from the file "
                   "already there.")
@click.option("--routes-out", "routes_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where --routes is written (mode 0600).")
@click.option("--rotate", "rotated", multiple=True, callback=check_id, metavar="USER",
              help="Give this user a new secret (password or nkey seed) even if one is kept: its old one "
                   "signs in no more once the server reloads the configuration; repeatable.")
def nats_config(
    prefix: str,
    services_user: str,
    workers: tuple[str, ...],
    workers_file,
    worker_nodes_path: Path | None,
    operators: tuple[str, ...],
    clients: tuple[str, ...],
    auth: str,
    secrets_path: Path | None,
    seeds_dir: Path | None,
    services_seed_path: Path | None,
    out_path: Path | None,
    routes: str | None,
    routes_path: Path | None,
    rotated: tuple[str, ...],
) -> None:
    """Write a nats-server `accounts` block with one user per role.

    The services may publish only into their own streams and buckets and onto
    inboxes, never onto a request subject. Each worker may publish only
    PREFIX.registry.*.ITS_ID (register, heartbeat, drain, remove itself) and
    receive replies on _INBOX.ITS_ID.> (the agent's inbox prefix). Clients call
    the snapshotter and the scheduler. Operators, in an account of their own, may
    read the event log by direct gets and call the scheduler's read-only queries.
    With --routes, also the credential a cluster's routes sign in with.
    See docs/security.md.
    """
    entries = [(f"--worker {w}", w) for w in workers]
    if workers_file is not None:
        for number, line in enumerate(workers_file, 1):
            line = line.split("#", 1)[0].strip()
            if line:
                entries.append((f"{workers_file.name}:{number}", line))
    nodes, given_at = _worker_nodes(entries)
    worker_ids = list(nodes)
    if worker_nodes_path is None and any(nodes.values()):
        raise click.UsageError("a worker given as ID@NODE is bound to its node only through --worker-nodes FILE "
                               "(which `warmboot serve registry --worker-nodes` reads)")
    if worker_nodes_path is not None and not nodes:
        raise click.UsageError("--worker-nodes with no worker would let no worker register: give them as ID@NODE")
    unbound = [w for w, node in nodes.items() if node is None]
    if worker_nodes_path is not None and unbound:
        raise click.UsageError(f"--worker-nodes binds every worker to its node: give {', '.join(unbound)} "
                               "as ID@NODE")
    users = [services_user, *operators, *clients, *worker_ids]
    given_as: dict[str, list[str]] = {}  # user -> the options that name it
    for option, names in (("--services-user", [services_user]), ("--operator", operators), ("--client", clients),
                          ("--worker", worker_ids)):
        for name in names:
            # a worker of --workers-file is said with its line (`--workers-file workers.txt:3`), not as --worker
            by = option if option != "--worker" or given_at[name].startswith("--worker ") else \
                f"--workers-file {given_at[name]}"
            given_as.setdefault(name, []).append(by)
    clashes = [f"{user!r} as {' and '.join(options)}" for user, options in sorted(given_as.items())
               if len(options) > 1]
    if clashes:
        raise click.UsageError(f"a user has one role, and is given once: {'; '.join(clashes)}")
    if seeds_dir is not None and auth != "nkey":
        raise click.UsageError("--seeds-dir goes with --auth nkey")
    if seeds_dir is not None:  # USER.nk each: on a filesystem blind to case (macOS, Windows) one file for two users
        folded = [u.casefold() for u in users]
        alike = sorted({u for u in users if folded.count(u.casefold()) > 1})
        if alike:
            raise click.UsageError(f"user names must differ in more than case with --seeds-dir: {', '.join(alike)} "
                                   "(their seed files would be one file where the filesystem ignores case, and "
                                   "one user's seed handed to the other)")
    if services_seed_path is not None and auth != "nkey":
        raise click.UsageError("--services-seed goes with --auth nkey")
    unknown = sorted(set(rotated) - set(users))
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)}: not a user of this run", param_hint="'--rotate'")

    if auth == "nkey" and secrets_path is None and seeds_dir is None:
        raise click.UsageError("--auth nkey needs --secrets or --seeds-dir: a seed nobody keeps signs nothing")
    if auth == "bcrypt" and secrets_path is None:
        raise click.UsageError("--auth bcrypt needs --secrets FILE: the block holds only hashes, and a password "
                               "nobody keeps signs nobody in")

    if (routes is None) != (routes_path is None):
        raise click.UsageError("--routes and --routes-out go together: the routes are written to that file")
    urls = route_urls(routes) if routes is not None else []
    outputs = {"--secrets": secrets_path, "--out": out_path, "--worker-nodes": worker_nodes_path,
               "--routes-out": routes_path, "--services-seed": services_seed_path}
    written: dict[Path, str] = {}
    for option, path in outputs.items():  # checked before anything is written
        if path is None:
            continue
        if not path.parent.is_dir():
            raise click.BadParameter(f"{path.parent} is not a directory", param_hint=f"'{option}'")
        other = written.setdefault(path.resolve(), option)
        if other != option:
            raise click.UsageError(f"{option} and {other} name the same file, {path}")
    if seeds_dir is not None:  # nor a file of the seeds directory: a user's seed would be another's, or removed
        for path, option in written.items():
            if path.parent != seeds_dir.resolve() or not (path.suffix == ".nk" or path.name == ROLES_FILE):
                continue
            if option == "--services-seed" and path.name == f"{services_user}.nk":
                continue  # the services' own seed, written twice alike
            raise click.UsageError(f"{option} names {seeds_dir / path.name}, a file of --seeds-dir "
                                   f"({'the roles' if path.name == ROLES_FILE else 'a seed file'})")

    kept, kept_roles = _read_secrets(secrets_path)
    dir_roles = _read_roles(seeds_dir)  # the users this command made seeds for in the directory, and their roles
    roles_recorded = seeds_dir is not None and (seeds_dir / ROLES_FILE).is_file()
    kept_roles = {**dir_roles, **kept_roles}
    role_of = {services_user: "services", **{u: "operator" for u in operators}, **{u: "client" for u in clients},
               **{u: "worker" for u in worker_ids}}
    # A secret is its holder's: one made for another role (a worker's, on its machine) is not handed
    # on with this one's rights (found by an audit); the user gets a new one.
    moved = sorted(u for u in users if kept_roles.get(u, role_of[u]) != role_of[u])
    for u in moved:
        kept.pop(u, None)
    # the seed files of users this command made before (its secrets file and the directory's roles
    # say which; without a secrets file, every USER.nk in the directory) that this run leaves out:
    # removed once the rest is written. The directory's roles count with a secrets file too: a
    # secrets file made anew (moved, lost) left a dropped worker's seed, and a later run listing
    # the name as a client took it up, the worker's machine signing in as a client (a review).
    made_before = set(kept) | set(dir_roles) if secrets_path is not None else (
        {path.stem for path in seeds_dir.glob("*.nk") if ID_RE.match(path.stem)} if seeds_dir is not None else set())
    # The seed files whose holder is not the one of this run's secret (a role it was not made for, or nobody
    # this command knows of) are made anew, not written over: a file written over keeps its owner and is
    # written through a link, so the user of a worker's agent on this host, handed its seed file (chowned
    # to it, or linked to where it reads it), read the client's new seed the next run listed the name as
    # a client, and an agent following its seed file signed in as the client (an audit's finding).
    new_holders = set(moved)
    if seeds_dir is not None:  # seeds handed out earlier are kept too: those of a role recorded as this run's
        for u in users:
            path = seeds_dir / f"{u}.nk"
            # a seed with no role recorded, in a directory that records them, is nobody's this command
            # knows of: not handed on (a directory from before roles were recorded keeps its seeds)
            known = u in kept_roles or not roles_recorded
            if roles_recorded and dir_roles.get(u) != role_of[u]:  # the file is nobody's, or another role's
                new_holders.add(u)
            if u not in kept and u not in moved and known and path.is_file():
                kept[u] = path.read_text().strip()
    fresh = new_nkey_seed if auth == "nkey" else new_password
    # a password kept from a password run is no seed, and the other way round: make a new one
    usable = _usable_seed if auth == "nkey" else (lambda s: not _usable_seed(s))
    secrets_of = {u: kept[u] if u in kept and usable(kept[u]) and u not in rotated else fresh() for u in users}
    # kept, but of the other kind (`--auth` changed between runs): new ones, said below, as a rotation is
    switched = sorted(u for u in users if u in kept and not usable(kept[u]) and u not in rotated and u not in moved)

    text = nats_auth_config(prefix, services_user, worker_ids, list(operators), clients=list(clients),
                            ids=identities(auth, secrets_of),
                            **({"file_name": out_path.name} if out_path is not None else {}))
    if routes_path is not None:
        routes_text = routes_config(urls, kept_route_password(routes_path) or new_password(), routes_path.name)
    if secrets_path is not None:
        _write_private(secrets_path, json.dumps({**secrets_of, ROLES_KEY: role_of}, indent=2) + "\n")
    if seeds_dir is not None:
        seeds_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for u, seed in secrets_of.items():
            if u in new_holders:
                _unlink_seed(seeds_dir / f"{u}.nk")
            _write_private(seeds_dir / f"{u}.nk", seed + "\n")
        _write_private(seeds_dir / ROLES_FILE, json.dumps(role_of, indent=2) + "\n")
    if services_seed_path is not None:
        _write_private(services_seed_path, secrets_of[services_user] + "\n")
        click.echo(f"wrote {services_seed_path}: the seed of {services_user}", err=True)
    if worker_nodes_path is not None:
        worker_nodes_path.write_bytes(encode_nodes(nodes))  # no secret in it
        click.echo(f"wrote {worker_nodes_path}: the nodes of {len(nodes)} worker(s)", err=True)
    if routes_path is not None:
        _write_private(routes_path, routes_text)
        click.echo(f"wrote {routes_path}: {len(urls)} route(s), signed in as {ROUTES_USER}", err=True)
    if out_path is None:
        click.echo(text, nl=False)
    else:
        _write_private(out_path, text)
        click.echo(f"wrote {out_path}: {len(worker_ids)} worker(s), {len(operators)} operator(s), "
                   f"{len(clients)} client(s), auth {auth}", err=True)
    if seeds_dir is not None:  # a user left out loses its seed too: listed again later, it gets a new one
        _remove_seeds(seeds_dir, sorted(made_before - set(secrets_of)))
    if moved:
        click.echo(f"new secrets for users listed in another role than before: {', '.join(moved)} (the old ones "
                   "sign in no more once the server has this configuration)", err=True)
    if rotated:
        click.echo(f"rotated: {', '.join(sorted(set(rotated)))} (the old secrets sign in no more once the server has "
                   "this configuration)", err=True)
    if switched:  # (a trial: a secrets file of nkey seeds, run with --auth password, gave everyone new ones unsaid)
        kind = "an nkey seed" if auth == "nkey" else "a password"
        click.echo(f"new secrets for users whose kept secret is not {kind} (--auth {auth} now): {', '.join(switched)} "
                   "(the old ones sign in no more once the server has this configuration)", err=True)
    if secrets_path is None and seeds_dir is None:  # (password auth: nkey and bcrypt need somewhere to keep them)
        click.echo("note: every user got a new password, kept nowhere but in this configuration: a run without "
                   "--secrets FILE signs every user out once the server reloads it (services included); give "
                   "--secrets FILE to keep them for the next run", err=True)


def _unlink_seed(path: Path) -> None:
    """Remove the seed file (or the link) at `path`, if any, so that the seed written there next is a file
    of its own: the writer's, mode 0600, in the directory."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        raise click.ClickException(f"{path}: the seed file of another holder could not be removed ({e}); "
                                   "nothing of it was written over") from None


def _remove_seeds(seeds_dir: Path, users: list[str]) -> None:
    gone = [u for u in users if (seeds_dir / f"{u}.nk").is_file()]
    for u in gone:
        try:
            (seeds_dir / f"{u}.nk").unlink()
        except OSError as e:
            raise click.ClickException(f"the seed of {u}, no longer listed, could not be removed: {e}") from None
    if gone:
        click.echo(f"removed the seeds of users no longer listed: {', '.join(gone)}", err=True)
