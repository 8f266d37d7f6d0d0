"""Every NATS name warmboot uses, derived from the deployment's prefix (CONTRACT sections 1 and 4)."""

from __future__ import annotations

import re

DEFAULT_PREFIX = "warmboot"
PREFIX_PATTERN = re.compile(r"^[a-z][a-z0-9_-]{0,31}(?!\n)$")


def check_prefix(prefix: str) -> str:
    if not PREFIX_PATTERN.match(prefix):
        raise ValueError(f"prefix {prefix!r} must be 1 to 32 lower-case letters, digits, '_' or '-', the first a "
                         f"letter ({PREFIX_PATTERN.pattern})")
    return prefix


def stream_name(prefix: str) -> str:
    """`warmboot` -> `WARMBOOT_EVENTS` (stream names may not contain '.', '*', '>')."""
    return f"{prefix.upper().replace('-', '_')}_EVENTS"


def events_filter(prefix: str) -> str:
    return f"{prefix}.ev.>"


def event_subject(prefix: str, kind: str, entity_id: str) -> str:
    return f"{prefix}.ev.{kind}.{entity_id}"


# A request's header: how many milliseconds its caller waits for the answer. A service writes
# nothing for a request it has held longer (`services.deadline`); `warmboot.client` sends its time-out.
WAIT_HEADER = "Warmboot-Wait-Ms"
MAX_WAIT_MS = 24 * 3600 * 1000  # a day: what the header may say (a larger value is INVALID_ARGUMENT)


def service_subject(prefix: str, service: str, verb: str, entity_id: str | None = None) -> str:
    """e.g. `warmboot.registry.register.w-17`, `warmboot.scheduler.fragmentation`."""
    base = f"{prefix}.{service}.{verb}"
    return f"{base}.{entity_id}" if entity_id is not None else base


def micro_name(service: str) -> str:
    """The name a service's replicas serve under (`nats.micro`, `$SRV.<verb>.<name>`) and its queue group."""
    return f"warmboot-{service}"


def bucket_name(prefix: str, purpose: str) -> str:
    """Key-value / object store names, e.g. `WARMBOOT_HEARTBEATS`."""
    return f"{prefix.upper().replace('-', '_')}_{purpose.upper()}"


def services_inbox(prefix: str) -> str:
    """The inbox prefix of the services' connections, `_INBOX._<prefix>`.

    Its second token starts with `_`, which no worker id (an inbox prefix of its own)
    and no nats-py inbox (base62) can: the services never answer a request whose
    reply subject is one of their own inboxes, and other roles may not read them.
    """
    return f"_INBOX._{prefix}"
