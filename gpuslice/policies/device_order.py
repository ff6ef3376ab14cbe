"""The device order a DRA driver publishes so that kube-scheduler's first fit picks what our policy would.

Under DRA the scheduler's allocator, not the extender, picks a pod's device: the first that fits in
the order the driver published (:mod:`gpuslice.packing.first_fit`). So the policy's lever is the
order. The policy's choice depends on the pod, and one list serves every pod, so the order is
built from the pods the workload is made of:

* **Representative pods**: the single-GPU request classes seen so far (slices, isolation, GPU-memory
  floor), most frequent first, up to 95 % of the single-GPU pods seen (FGD's rule for its target
  table) and at most :data:`MOST_REPRESENTATIVES`; re-read when the pods seen reach the next power
  of two, as the fragmentation policy re-reads its target, so a publication does not churn with
  every arrival. Multi-GPU pods take whole free GPUs, which a node's order does not tell apart.
* **Per node, a precedence**: for each representative in turn, the policy ranks the node's devices
  as it would for that pod (:meth:`gpuslice.scheduler.Scheduler.rank`, every device, the node's
  best placement first), and its choice must come before every other device that pod fits. The
  constraint is kept when it does not contradict those of more frequent representatives (no
  cycle); so first fit gives each representative exactly the policy's choice as far as one list
  can, the most frequent first. A representative that fits one device of the node or none, or
  exactly the devices a more frequent one fits there, has nothing to add and is not ranked.
* **The list**: the fixed order (device position), changed only where a kept constraint needs it
  (the smallest topological order by position). A node whose choices already follow position is
  published in the fixed order.

MIG instances of different profiles never compete for one pod, so each profile is in effect ranked
on its own, as the issue asks; on a mixed node a pod of isolation ``any`` may fit a MIG instance
and an MPS GPU, and the list interleaves them as the representatives' choices say. Which nodes to
republish is :meth:`DeviceSteering.due`: those whose state changed since their last publication,
every node when the representatives change.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
from numpy.typing import NDArray

from gpuslice.packing.state import ClusterState, PackRequest

if TYPE_CHECKING:
    from gpuslice.scheduler import Ranked

I64 = NDArray[np.int64]
B = NDArray[np.bool_]

#: Share of the single-GPU pods seen that the representative classes cover (FGD's 95 % table).
COVERAGE = 0.95
#: At most this many representatives: each costs one ranking per republished node.
MOST_REPRESENTATIVES = 16

ClassKey = tuple[int, str, int]  # slices, isolation, GPU-memory floor (MiB)


class Ranker(Protocol):
    """What the ordering needs of the scheduler: its state, and the policy's ranking of every device."""

    @property
    def state(self) -> ClusterState: ...

    def rank(self, req: PackRequest, node_mask: B | None = None, *, every_device: bool = False) -> Ranked: ...


@dataclass(slots=True)
class Representatives:
    """The single-GPU request classes the order is built for, learned online (see the module doc)."""

    counts: Counter[ClassKey] = field(default_factory=Counter)
    seen: int = 0
    next_read: int = 1
    version: int = 0
    current: tuple[PackRequest, ...] = ()

    def observe(self, req: PackRequest) -> None:
        """A pod arrived; re-read the classes when the single-GPU pods seen reach a power of two."""
        if req.gpus != 1:
            return
        self.counts[(req.slices, req.isolation, req.gpu_memory_mib)] += 1
        self.seen += 1
        if self.seen < self.next_read:
            return
        while self.next_read <= self.seen:
            self.next_read *= 2
        chosen = self._read()
        if chosen != self.current:
            self.current = chosen
            self.version += 1

    def _read(self) -> tuple[PackRequest, ...]:
        ranked = sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))
        out: list[PackRequest] = []
        covered = 0
        for (slices, isolation, memory), n in ranked[:MOST_REPRESENTATIVES]:
            out.append(PackRequest(gpus=1, slices=slices, isolation=isolation, gpu_memory_mib=memory))
            covered += n
            if covered >= COVERAGE * self.seen:
                break
        return tuple(out)


def node_orders(ranker: Ranker, reps: tuple[PackRequest, ...], nodes: I64) -> tuple[I64, I64]:
    """The published order of ``nodes``: (unit rows, their places), built as the module doc says."""
    st = ranker.state
    nodes = nodes[st.node_alive[nodes]]
    units = st.node_units[nodes]
    n, w = units.shape
    places = np.tile(np.arange(w, dtype=np.int64), (n, 1))
    if n and reps:
        mask = np.zeros(st.n_nodes, dtype=bool)
        mask[nodes] = True
        row_of = np.full(st.n_nodes, -1, dtype=np.int64)
        row_of[nodes] = np.arange(n)
        fits: list[B] = []
        picks: list[I64] = []
        seen: list[set[bytes]] = [set() for _ in range(n)]  # per node, the fitting sets already ranked
        moved = np.zeros(n, dtype=bool)
        cols = np.arange(w)
        for rep in reps:
            ok = st.unit_accepts(rep, units.ravel()).reshape(n, w)
            pick = np.full(n, -1, dtype=np.int64)
            # One fitting device or none: nothing to order for this pod. The devices a more frequent
            # representative fits: its choice is already first among them (or this one contradicts it).
            rivals = ok.sum(axis=1) >= 2
            packed = np.packbits(ok, axis=1)
            for i in np.flatnonzero(rivals).tolist():
                key = packed[i].tobytes()
                if key in seen[i]:
                    rivals[i] = False
                else:
                    seen[i].add(key)
            if rivals.any():
                mask[:] = False
                mask[nodes[rivals]] = True
                ranked = ranker.rank(rep, mask, every_device=True)
                best = ranked.best
                if best.node.shape[0]:
                    pick[row_of[best.node]] = st.unit_pos[ranked.cands.units[best.index, 0]]
            first = np.where(ok, cols, w).min(axis=1)
            moved |= (pick >= 0) & (pick != first)
            fits.append(ok)
            picks.append(pick)
        for i in np.flatnonzero(moved).tolist():
            places[i] = precedence_order(w, [(f[i], int(p[i])) for f, p in zip(fits, picks, strict=True)])
    valid = units >= 0
    return units[valid].astype(np.int64), places[valid]


def precedence_order(width: int, choices: list[tuple[B, int]]) -> I64:
    """Places for ``width`` positions such that, for each (fitting positions, chosen position) in
    turn, the choice comes before the other fitting positions, unless that contradicts an earlier
    choice; the smallest such order by position. Returns the place of each position."""
    before = np.zeros((width, width), dtype=bool)  # before[a, b]: a must come before b (closed)
    for fits, pick in choices:
        if pick < 0:
            continue
        rivals = fits.copy()
        rivals[pick] = False
        if not rivals.any() or before[rivals, pick].any():
            continue
        after = rivals | before[rivals].any(axis=0)
        ahead = before[:, pick].copy()
        ahead[pick] = True
        before[np.ix_(ahead, after)] = True
    place = np.empty(width, dtype=np.int64)
    left = np.ones(width, dtype=bool)
    for k in range(width):
        ready = left & ~before[left].any(axis=0)
        j = int(np.argmax(ready))
        place[j] = k
        left[j] = False
    return place


class DeviceSteering:
    """Our policy's side of DRA: the representatives it learns and the orders it publishes.

    ``due`` says which nodes a republish covers now; ``orders`` computes their lists. When a
    publication reaches the scheduler is the caller's (a driver republishing at once, or late).
    """

    def __init__(self, ranker: Ranker) -> None:
        self.ranker = ranker
        self.reps = Representatives()
        self._published_at: I64 = np.zeros(0, dtype=np.int64)
        self._reps_version = 0
        self._generation = ranker.state.generation

    def observe(self, req: PackRequest) -> None:
        self.reps.observe(req)

    def due(self) -> I64:
        """Nodes changed since their last publication (all, after the representatives changed)."""
        st = self.ranker.state
        versions = st.node_version[: st.n_nodes]
        if self._generation != st.generation or self._reps_version != self.reps.version:
            self._generation, self._reps_version = st.generation, self.reps.version
            self._published_at = np.full(st.n_nodes, -1, dtype=np.int64)
        elif self._published_at.shape[0] < st.n_nodes:
            grown = np.full(st.n_nodes, -1, dtype=np.int64)
            grown[: self._published_at.shape[0]] = self._published_at
            self._published_at = grown
        rows = np.flatnonzero((versions != self._published_at) & st.node_alive[: st.n_nodes]).astype(np.int64)
        self._published_at[rows] = versions[rows]
        return rows

    def orders(self) -> tuple[I64, I64]:
        """The lists of the nodes :meth:`due` names now: (unit rows, places)."""
        rows = self.due()
        if rows.shape[0] == 0:
            return rows, rows
        return node_orders(self.ranker, self.reps.current, rows)
