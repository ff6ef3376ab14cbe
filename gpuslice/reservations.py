"""Placements chosen at filter, held by pod UID until bind or a timeout (DESIGN 4).

kube-scheduler filters the next pod before the last ``/bind`` arrives, so the placement chosen at
filter must count at once. A reservation names what it holds by stable keys (node name, GPU and
MIG instance UUIDs, slice ids), never by row numbers of one in-memory state, so it survives a
rebuild, a relist or a node re-laid out; whoever holds the cluster resolves the keys to rows.
Times are seconds on the caller's clock (the core has none).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field

#: The config's ``reservationTTLSeconds`` default; the one place the number lives.
DEFAULT_TTL_S = 60.0


@dataclass(frozen=True, slots=True)
class Reservation:
    """``units``: (GPU key, MIG instance UUID or "") per unit; ``slices`` per unit; ``slice_ids``
    the exact ids where the cluster has ids (empty in trace replays that have none)."""

    uid: str
    node: str
    units: tuple[tuple[str, str], ...]
    slices: int
    slice_ids: tuple[str, ...]
    cpu_milli: int
    memory_mib: int
    owner: str
    expires: float
    #: The policy breakdown that chose this placement (policy -> score, and ``total``), written into
    #: the assignment at bind so an operator sees why it won; not part of what is held.
    scores: Mapping[str, float] = field(default_factory=dict, compare=False)
    #: Slices freed by preemption and held for the preemptor: kept across its filters until it is
    #: placed, deleted, or the hold expires (a filter reservation is given up at the pod's next filter).
    nominated: bool = False


class Reservations:
    """The held reservations by pod UID, with their expiry order."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        if not ttl_s > 0:
            raise ValueError(f"reservation TTL must be > 0 seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        self.held: dict[str, Reservation] = {}
        self._heap: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, uid: object) -> bool:
        return uid in self.held

    def get(self, uid: str) -> Reservation | None:
        return self.held.get(uid)

    def add(self, r: Reservation) -> None:
        self.held[r.uid] = r
        heapq.heappush(self._heap, (r.expires, r.uid))

    def pop(self, uid: str) -> Reservation | None:
        return self.held.pop(uid, None)

    def due(self, now: float) -> list[Reservation]:
        """Remove and return the reservations whose time is up (``expires <= now``)."""
        out: list[Reservation] = []
        while self._heap and self._heap[0][0] <= now:
            expires, uid = heapq.heappop(self._heap)
            r = self.held.get(uid)
            if r is not None and r.expires == expires:
                del self.held[uid]
                out.append(r)
        return out
