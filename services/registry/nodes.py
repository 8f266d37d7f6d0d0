"""Which node each worker may claim: the deployment binds each worker id (so each worker's
credential, `warmboot nats-config`) to one node. Pure: parsing, writing and checking, no I/O
but reading the file.

A node names what a machine has: the PAUSED actors and LOCAL images of node-a restore on
any worker of node-a (CONTRACT rule 5). A registration's `node` is the worker's own claim,
so without a binding a worker's credential could claim another machine's node and be sent
resumes whose images are on that machine's disk. With one (`warmboot serve registry
--worker-nodes FILE`, shared by the replicas: `services.registry.binding`), the registry
refuses a registration whose node is not the one its worker is bound to, and one of a
worker the binding does not list, before anything is written.

The file is a JSON object of worker id -> node, both ids (CONTRACT section 2), as
`warmboot nats-config --worker ID@NODE --worker-nodes FILE` writes it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from events.errors import precondition
from events.schema import ID_RE, ID_WORDS

_decoder = msgspec.json.Decoder(dict[str, str])


def parse_nodes(data: bytes, source: str) -> dict[str, str]:
    """The binding in `data`; ValueError naming `source` and what is wrong (the entry, if one is)."""
    try:
        nodes = _decoder.decode(data)
    except msgspec.ValidationError as e:
        raise ValueError(f"{source}: not a JSON object of worker id -> node: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"{source}: not JSON: {e}") from None
    for worker_id, node in nodes.items():
        for what, value in (("worker id", worker_id), (f"node of worker {worker_id!r}", node)):
            if not ID_RE.match(value):
                raise ValueError(f"{source}: the {what} {value!r} is not an id: {ID_WORDS}")
    _refuse_repeated_ids(data, source)
    return nodes


def _refuse_repeated_ids(data: bytes, source: str) -> None:
    """A worker id given twice (a hand edit): JSON decoding keeps the last, so one of two nodes
    would be dropped without a word."""
    counts: dict[str, int] = {}

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        for key, _ in items:
            counts[key] = counts.get(key, 0) + 1
        return dict(items)

    json.loads(data, object_pairs_hook=pairs)  # valid JSON: msgspec decoded it
    repeated = sorted(key for key, n in counts.items() if n > 1)
    if repeated:
        raise ValueError(f"{source}: the worker id {repeated[0]!r} is given more than once"
                         + (f" (and {len(repeated) - 1} more id(s))" if len(repeated) > 1 else "")
                         + ": which node binds it?")


def load_nodes(path: str | Path) -> dict[str, str]:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    return parse_nodes(data, str(path))


def encode_nodes(nodes: Mapping[str, str]) -> bytes:
    """The file's text: sorted by worker id, one entry per line."""
    return msgspec.json.format(msgspec.json.encode(dict(sorted(nodes.items()))), indent=2) + b"\n"


def allows(nodes: Mapping[str, str] | None, worker_id: str, node: str | None) -> bool:
    """Whether `nodes` lets `worker_id` be on `node` (no binding: any node)."""
    return nodes is None or nodes.get(worker_id) == node


def describe(nodes: Mapping[str, str] | None) -> str:
    """A binding in words, as the registry logs it and `serve` prints it."""
    if nodes is None:
        return "workers are not bound to nodes: any worker may register on any node"
    return f"workers bound to their nodes: {len(nodes)} worker(s)"


UNBOUND_REASON = "registered on node {node}, which the deployment's binding of workers to nodes does not give it"


def unbound_reason(node: str) -> str:
    """The reason of the removal of a worker registered on a node its binding does not give it: at
    most 256 characters (a contract reason), the node an id of at most 128."""
    return UNBOUND_REASON.format(node=node)[:256]


def describe_change(old: Mapping[str, str], new: Mapping[str, str], shown: int = 5) -> str:
    """What a new binding changes of an old one, for a log line: moved, added and dropped workers."""
    def listed(what: str, items: list[str]) -> str:
        more = f", and {len(items) - shown} more" if len(items) > shown else ""
        return f"{len(items)} {what} ({', '.join(items[:shown])}{more})"

    moved = [f"{w} {old[w]} -> {new[w]}" for w in sorted(old.keys() & new.keys()) if old[w] != new[w]]
    added = sorted(new.keys() - old.keys())
    dropped = sorted(old.keys() - new.keys())
    parts = [listed(what, items) for what, items in (("moved", moved), ("added", added), ("dropped", dropped))
             if items]
    return "; ".join(parts) or "the same workers on the same nodes"


def check_registered(nodes: Mapping[str, str] | None, worker_id: str, node: str | None) -> None:
    """FAILED_PRECONDITION if `worker_id`, registered on `node`, is not bound to it by `nodes`: a
    worker that registered before the binding (or before a change of it) is refused its
    heartbeats, and so ends as LOST, unless it registers on its own node. A node not known
    (None: not read from the log) is not judged."""
    if node is None or allows(nodes, worker_id, node):
        return
    bound = nodes.get(worker_id)
    where = f"binds it to node {bound!r}" if bound is not None else "does not list it"
    raise precondition(f"worker {worker_id!r} is registered on node {node!r}, and the deployment's binding of "
                       f"workers to nodes {where}: its heartbeats are refused, so it ends as LOST, unless it "
                       "registers on its own node", "node" if bound is not None else "worker_id")


def check_node(nodes: Mapping[str, str] | None, worker_id: str, node: str) -> None:
    """FAILED_PRECONDITION unless `nodes` lets `worker_id` register on `node` (no binding: any node)."""
    if allows(nodes, worker_id, node):
        return
    bound = nodes.get(worker_id)
    if bound is None:
        raise precondition(f"worker {worker_id!r} is bound to no node: the deployment's binding of workers to nodes "
                           "(`serve registry --worker-nodes`) does not list it, so it may not register", "worker_id")
    raise precondition(f"worker {worker_id!r} is bound to node {bound!r} by the deployment's binding of workers "
                       f"to nodes (`serve registry --worker-nodes`); it may not register on node {node!r}", "node")
