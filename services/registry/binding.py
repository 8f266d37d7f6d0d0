"""The deployment's binding of workers to nodes, shared by every registry replica.

The binding (`services.registry.nodes`) lives in the key `worker-nodes` of the bucket
`<PREFIX>_SETTINGS`, not in each replica's flags: a replica started without
`--worker-nodes` enforces the binding another replica set, so one forgotten flag (or an
empty `WARMBOOT_WORKER_NODES`) does not let every Nth registration through unchecked.

- A replica started with a file writes it to the key when it differs from what the key
  holds: the file given last wins, and a replica that replaces a binding logs a warning
  saying which workers it moved, added and dropped (a stale file on a restarted host
  shows there). One started with `none` deletes the key: the binding is off, any worker
  may register on any node. Of warmboot's commands only those two change it. The bucket
  keeps the key's last 16 entries, deletions included (`nats kv history`).
- Every replica reads the key at the stream leader before it serves, then follows it (an
  ordered consumer on the key's subject): a change reaches the others as soon as the
  server delivers it (after a lost connection, once the consumer is made again), and a
  registration decided in between is judged on the binding as its replica had it; a replica that
  has the change removes it as soon as it folds it (`RegistryService._node_folded`), and each
  replica's look for unbound workers reads the key at the leader first (`refresh`), so one whose
  consumer is late does not remove a worker the change allows.
- A value that is not a binding (written by hand, a newer version's) binds every worker to
  no node: registrations are refused, fail closed, until a replica writes a good one. The
  heartbeats of registered workers are not judged meanwhile (`judged_nodes`): whom such a
  value binds where is not known, and judging them would end the whole fleet as LOST.
- Not covered: the bucket deleted, or JetStream restored from a backup, while replicas run.
  A replica that starts then finds no binding; one that was running keeps the revision it
  had and ignores the new bucket's lower ones. Restart every replica, with the file, after
  either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import suppress
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy, KeyValueConfig, StorageType
from nats.js.errors import NotFoundError

from events.natspy.jetstream import NO_DROPS, ORDERED_IDLE_HEARTBEAT_S
from events.subjects import bucket_name
from services.process import stream_replicas
from services.registry.nodes import describe, describe_change, encode_nodes, parse_nodes
from services.streams import START_WITHIN_S, until_answered

log = logging.getLogger("warmboot.registry")

KEY = "worker-nodes"
HISTORY = 16  # versions of the binding the bucket keeps
UNBIND = "none"  # `--worker-nodes none`: delete the binding
_DELETED = ("DEL", "PURGE")


class SharedBinding:
    """`nodes`: the binding as this replica has it (None: no binding, any node)."""

    def __init__(self, nc: NATS, prefix: str, replicas: int | None = None):
        self.nc = nc
        self.bucket = bucket_name(prefix, "settings")
        self.stream = f"KV_{self.bucket}"
        self.subject = f"$KV.{self.bucket}.{KEY}"
        self.replicas = replicas if replicas is not None else stream_replicas()
        self.nodes: dict[str, str] | None = None  # what registrations are judged on ({} for a value that is none)
        # What the registered workers are judged on: None while the key holds a value that is no binding.
        # That refuses registrations, but must not end every live worker as LOST: whom it binds where is
        # not known.
        self.judged_nodes: dict[str, str] | None = None
        self.on_change: Callable[[], None] | None = None  # told when `judged_nodes` changes
        self.revision = 0  # the bucket's sequence of the value `nodes` came from
        self._sub: Any = None

    async def start(self, given: Mapping[str, str] | str | None = None) -> None:
        """Set the binding to `given` (a binding, or UNBIND), unless None; then read and follow it."""
        js = self.nc.jetstream()
        config = KeyValueConfig(bucket=self.bucket, history=HISTORY, storage=StorageType.FILE,
                                replicas=self.replicas, description="warmboot deployment settings")
        kv = await until_answered(lambda: js.create_key_value(config), f"the bucket {self.bucket}")
        revision, value = await self._read()
        if given == UNBIND:
            if value is not None:
                await until_answered(lambda: kv.delete(KEY), f"the deletion of {KEY} in {self.bucket}")
                log.warning("the binding of workers to nodes (revision %d) is removed: any worker may register on "
                            "any node", revision)
        elif given is not None:
            text = encode_nodes(given)
            if value != text:
                await until_answered(lambda: kv.put(KEY, text), f"the put of {KEY} in {self.bucket}")
                if value is None:
                    log.info("the binding of workers to nodes is set: %d worker(s)", len(given))
                else:  # a file given last wins: say what it undid, in case it was a stale one
                    log.warning("the binding of workers to nodes (revision %d) is replaced by this replica's "
                                "file: %s", revision, describe_change(self._parsed(revision, value) or {}, dict(given)))

        def subscribe() -> Any:  # from the key's last value: a change made after the read below is not missed
            return js.subscribe(self.subject, stream=self.stream, cb=self._on_msg, ordered_consumer=True,
                                idle_heartbeat=ORDERED_IDLE_HEARTBEAT_S, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                                **NO_DROPS)

        self._sub = await until_answered(subscribe, f"the consumer on {self.subject}")
        self._apply(*(await self._read()))

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with suppress(Exception):
                await sub.unsubscribe()

    async def refresh(self) -> None:
        """Take the key's last entry as the bucket's leader has it now, if this replica has an older one
        (a change not delivered to its consumer yet, or lost with a connection): one read, raised if
        not answered. The registry's look for unbound workers reads it before it judges
        (`RegistryService._remove_unbound`)."""
        self._apply(*(await self._read(within=0.0)))

    async def _read(self, within: float = START_WITHIN_S) -> tuple[int, bytes | None]:
        """The key's last entry at the bucket's leader: (its sequence, its value; None if deleted or absent)."""
        try:
            msg = await until_answered(lambda: self.nc.jetstream().get_msg(self.stream, subject=self.subject),
                                       f"the key {KEY} of {self.bucket}", within)
        except NotFoundError:
            return 0, None
        deleted = msg.headers and msg.headers.get("KV-Operation") in _DELETED
        return msg.seq, None if deleted else msg.data

    async def _on_msg(self, msg: Msg) -> None:
        deleted = msg.headers and msg.headers.get("KV-Operation") in _DELETED
        self._apply(msg.metadata.sequence.stream, None if deleted else msg.data)

    def _parsed(self, revision: int, value: bytes) -> dict[str, str] | None:
        """The binding in a value of the key; None (logged) for a value that is no binding."""
        try:
            return parse_nodes(value, f"the key {KEY} of the bucket {self.bucket} (revision {revision})")
        except ValueError as e:
            log.error("%s; every registration is refused until a registry writes a binding (the heartbeats of "
                      "registered workers are not judged meanwhile)", e)
            return None

    def _apply(self, revision: int, value: bytes | None) -> None:
        if revision < self.revision or (revision == self.revision and revision):
            return  # older than what this replica has (the read and the consumer both deliver the last)
        self.revision = revision
        parsed = None if value is None else self._parsed(revision, value)
        nodes = {} if value is not None and parsed is None else parsed  # a value that is none: no worker registers
        if nodes != self.nodes:
            self.nodes = nodes
            log.info("%s (revision %d)", describe(nodes), revision)
        if parsed != self.judged_nodes:
            self.judged_nodes = parsed
            if self.on_change is not None:
                self.on_change()

