"""The stamping rules (CONTRACT section 3, Snapshotter): the stamp every snapshot gets.

A snapshot says the runtime its memory image was produced under. While an actor runs,
that is the pin on its assignment (`ActorPlaced.sandbox_runtime`), which the scheduler
chose when it placed the actor; it is never read from the worker's current default,
because a rolling upgrade moves a worker's default to v2 while the actors already
running on it still run v1. Every copy or move of a snapshot keeps its stamp. Each
rule is one pure function, used by the Actor aggregate (`services.snapshotter.domain`).
"""

from __future__ import annotations

import hashlib
import re
from datetime import datetime

import msgspec

from events.schema import ActorPlaced, ActorRuntime, Fidelity, Location, Snapshot

MAX_ID = 128  # ids are at most 128 characters (ID_PATTERN)
DIGEST_CHARS = 24  # of a shortened default snapshot id (`default_snapshot_id`): 96 bits


def stamp_from_pin(assignment: ActorPlaced) -> ActorRuntime:
    """The stamp of a snapshot taken from a running actor: its assignment's pin.

    The pin is what the actor actually runs under: the runtime entry that matched
    its memory snapshot on a warm boot, or the worker's class default on a cold
    boot or a downgraded restore, fixed when it was placed. The worker's current
    default is never consulted: after a rolling upgrade it may be v2 while this
    actor still runs v1, and a v1 image stamped v2 would be restored on a worker
    that cannot load it.
    """
    return assignment.sandbox_runtime


def default_snapshot_id(actor_id: str, version: int, step: int = 0) -> str:
    """The id of a snapshot taken without one: `<actor_id>-v<version>` (`...-<step>` after it when a
    caller has given that id to another of the actor's snapshots: `Actor.next_snapshot_id`).

    `version` is the actor's version at the event that records the snapshot, so
    the id is deterministic (a replay or a second replica deciding the same step
    derives the same id) and unique within the actor. One that would reach the 128-char limit
    is shortened with a digest of the full actor id to exactly 128 characters, and only such
    a one has 128: a plain default is at most 127, so no actor's plain default is another's
    shortened one (the actor id that is a shortened one's stem, `<prefix>-<digest>`, gets a
    shortened default of its own; found by a review). The digest is 96 bits, so that two actor
    ids with one digest cannot be searched for.
    """
    suffix = f"-v{version}" + (f"-{step}" if step else "")
    if len(actor_id) + len(suffix) < MAX_ID:
        return actor_id + suffix
    digest = hashlib.sha256(actor_id.encode()).hexdigest()[:DIGEST_CHARS]
    return f"{actor_id[: MAX_ID - len(suffix) - len(digest) - 1]}-{digest}{suffix}"


_DEFAULT_FORM = re.compile(r"-v([1-9][0-9]*)(?:-([1-9][0-9]*))?$")


def anothers_default_id(actor_id: str, snapshot_id: str) -> bool:
    """Whether `snapshot_id`, given by a caller for `actor_id`'s image, has the form of a default id
    (`<id>-v<version>`, `...-<step>`: `default_snapshot_id`) that is not one of `actor_id`'s own: the
    actor it names would take it by default. A worker finds an image by its id, so that actor's
    resume could load this one (another actor's memory, maybe of another stamp)."""
    form = _DEFAULT_FORM.search(snapshot_id)
    if form is None:
        return False
    return snapshot_id != default_snapshot_id(actor_id, int(form[1]), int(form[2] or 0))


def free_form_id(snapshot_id: str) -> bool:
    """Whether no default id has the form of `snapshot_id` (`default_snapshot_id`). An id of that form
    is one actor's alone (`anothers_default_id` refuses it to every other actor), so one that is not is
    the only kind two actors can give alike: the snapshotter records which image it names on its own
    subject (`ImageNamed`, `domain.Image`)."""
    return _DEFAULT_FORM.search(snapshot_id) is None


def same_image(one: Snapshot, other: Snapshot) -> bool:
    """Whether two snapshots are the same image: all but whose they are, whether borrowed, and when
    recorded (a golden snapshot an actor is created from again, in a new life)."""
    return msgspec.structs.replace(one, actor_id=other.actor_id, borrowed=other.borrowed,
                                   taken_at=other.taken_at) == other


def paused_snapshot(
    actor_id: str, snapshot_id: str, template_uid: str, assignment: ActorPlaced,
    borrowed: bool, at: datetime,
) -> Snapshot:
    """pause: a LOCAL MEMORY snapshot on the assigned node, stamped from the assignment's pin."""
    return Snapshot(
        snapshot_id=snapshot_id,
        actor_id=actor_id,
        template_uid=template_uid,
        fidelity=Fidelity.MEMORY,
        location=Location.LOCAL,
        node=assignment.node,
        uri=None,
        sandbox_runtime=stamp_from_pin(assignment),
        borrowed=borrowed,
        taken_at=at,
    )


def suspended_snapshot(
    actor_id: str, snapshot_id: str, template_uid: str, assignment: ActorPlaced,
    fidelity: Fidelity, uri: str | None, at: datetime,
) -> Snapshot:
    """suspend from RUNNING: an EXTERNAL snapshot of the requested fidelity, stamped from the pin.

    A VOLUMES or ROOTFS snapshot is stamped too, for the record. It is the actor's
    own durable copy, so it is never `borrowed`.
    """
    return Snapshot(
        snapshot_id=snapshot_id,
        actor_id=actor_id,
        template_uid=template_uid,
        fidelity=fidelity,
        location=Location.EXTERNAL,
        node=None,
        uri=uri,
        sandbox_runtime=stamp_from_pin(assignment),
        borrowed=False,
        taken_at=at,
    )


def promoted_snapshot(
    local: Snapshot, snapshot_id: str | None, fidelity: Fidelity, uri: str | None
) -> Snapshot:
    """suspend from PAUSED: the local snapshot uploaded as EXTERNAL, keeping its stamp.

    The actor holds no assignment any more (pause released it), so there is no pin
    to read: the stamp is the one the pause recorded, which is the pin the actor
    ran under. The image is the one taken at pause, so `taken_at` is kept too, and
    so is the id unless the caller names the uploaded copy. The node is cleared:
    the snapshot no longer lives on one machine. It is now the actor's own
    durable copy, so it is not `borrowed`.
    """
    return msgspec.structs.replace(
        local,
        snapshot_id=snapshot_id or local.snapshot_id,
        fidelity=fidelity,
        location=Location.EXTERNAL,
        node=None,
        uri=uri,
        borrowed=False,
    )


def tagged_copy(latest: Snapshot) -> Snapshot:
    """tag: the tag names a copy of the actor's latest snapshot, stamp (and all else) unchanged.

    The copy keeps the snapshot's id: it names the same image, and a worker asked
    to restore it looks it up by that id.
    """
    return latest


def initial_snapshot(
    actor_id: str, tagged: Snapshot | None, golden: Snapshot | None
) -> Snapshot | None:
    """create: the new actor's first snapshot, from a tag or a golden snapshot, keeping its stamp.

    The copy becomes the new actor's (`actor_id`); id, image, template, fidelity
    and stamp are the source's. A golden snapshot is `borrowed: true`: the actor
    holds no durable volumes of its own until its first suspend. A tag's copy
    keeps the `borrowed` flag of the snapshot the tag names.
    """
    if golden is not None:
        return msgspec.structs.replace(golden, actor_id=actor_id, borrowed=True)
    if tagged is not None:
        return msgspec.structs.replace(tagged, actor_id=actor_id)
    return None
