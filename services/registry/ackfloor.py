"""Which delivery the sweep may acknowledge, all at once, without acknowledging a marker it holds.

The sweep's consumer acknowledges with `AckPolicy.ALL`: one ack of a delivery acknowledges every
message of the stream up to it. So the sweep acknowledges, now and then, the highest delivery below
the lowest expiry marker it has not handled (`AckFloor.target`), never past one: a marker a replica
holds stays unacknowledged until its worker is removed, and one it held when it died is delivered
again (after the consumer's ack wait) or found by the next holder's reconciliation.

Pure bookkeeping, no I/O: a delivery is its ack reply subject, which names its stream sequence
(`$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>...`). While no marker is held, the newest
delivery is the target and nothing is parsed; while markers are held, the deliveries between two of
them are kept as the highest of each gap, so the bookkeeping stays as small as the markers in hand.
"""

from __future__ import annotations

from bisect import bisect_left

from events.natspy.jetstream import ack_positions

Delivery = tuple[int, str]  # (stream sequence, ack reply subject)


def stream_seq(reply: str) -> int:
    return ack_positions(reply)[0]


def _higher(a: Delivery | None, b: Delivery | None) -> Delivery | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if a[0] >= b[0] else b


class AckFloor:
    """The deliveries of one sweep, and the markers it holds, by stream sequence."""

    def __init__(self) -> None:
        self._held: list[int] = []  # the stream sequences of the markers held, ascending
        self._replies: dict[int, str] = {}  # each held marker's ack reply subject
        # While markers are held, the highest delivery of each gap: below the first held marker, between
        # each two, above the last. With none held, `[None]`, and the newest delivery kept unparsed.
        self._gaps: list[Delivery | None] = [None]
        self._newest = ""  # with no marker held: the newest delivery's reply subject
        self._acked = ""  # the reply subject last handed out by `target`

    def delivered(self, reply: str) -> None:
        """A delivery that is not a marker: acknowledged with the next target past it."""
        if not self._held:  # the usual case: nothing held, the newest delivery is the target
            self._newest = reply
            return
        seq = stream_seq(reply)
        gap = bisect_left(self._held, seq)
        self._gaps[gap] = _higher(self._gaps[gap], (seq, reply))

    def hold(self, reply: str) -> int | None:
        """A marker delivered: its stream sequence, held until `release`; None if it is held already
        (delivered again while this sweep handles it)."""
        seq = stream_seq(reply)
        if seq in self._replies:
            return None
        if not self._held:  # the unparsed newest delivery gets its place
            self._gaps = [(stream_seq(self._newest), self._newest) if self._newest else None]
            self._newest = ""
        gap = bisect_left(self._held, seq)
        below = self._gaps[gap]
        # The gap splits in two at the marker; its highest delivery goes to the side it is on (the
        # other side's highest is not known: none, which only delays an ack).
        self._gaps[gap:gap + 1] = [below, None] if below is None or below[0] < seq else [None, below]
        self._held.insert(gap, seq)
        self._replies[seq] = reply
        return seq

    def release(self, seq: int) -> None:
        """The marker at `seq` was handled: it and the gaps on each side of it become one."""
        gap = bisect_left(self._held, seq)
        if gap == len(self._held) or self._held[gap] != seq:
            return
        merged = _higher(_higher(self._gaps[gap], (seq, self._replies.pop(seq))), self._gaps[gap + 1])
        del self._held[gap]
        self._gaps[gap:gap + 2] = [merged]
        if not self._held:  # back to the usual case
            self._newest, self._gaps = merged[1], [None]

    def held(self) -> list[int]:
        return list(self._held)

    def holds(self, seq: int) -> bool:
        return seq in self._replies

    def held_replies(self) -> list[str]:
        """The ack reply subjects of the markers held (to hand them back: a nak of each)."""
        return [self._replies[seq] for seq in self._held]

    def target(self) -> str | None:
        """The reply subject to acknowledge now (everything up to it), None if there is nothing new."""
        if self._held:
            lowest = self._gaps[0]
            reply = lowest[1] if lowest is not None else ""
        else:
            reply = self._newest
        if not reply or reply == self._acked:
            return None
        self._acked = reply
        return reply
