"""The extender's decision logic as pure functions, shared by the extender service and the simulator.

* :func:`filter_reasons`: per-node verdicts with a human-readable reason for each refused node;
* :func:`best_per_node`: a node's best placement (score, then the policy's secondary order, then
  unit position);
* :func:`narrowed_filter`: the node(s) to hand kube-scheduler, best first within ``margin``, ties
  in the extender's own consistent order (:func:`node_order`), because kube-scheduler would break
  them at random and that destroys packing (DESIGN 4);
* :func:`priority_scores`: the 0..10 integers for ``/prioritize``;
* :func:`paper_choice`: the research simulator's rule (integer scores, fixed node order);
* :class:`Reservations`: placements chosen at filter, held by pod UID until bind or timeout
  (``now`` is always passed in: the core has no clock).

The owner-spread rule (never two pods of one owner on a unit) is part of the unit fit in
:meth:`ClusterState.unit_accepts`, so every caller gets it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from gpuslice.packing.errors import PackingError
from gpuslice.packing.state import KIND_MIG, Candidates, ClusterState, Fit, PackRequest

I64 = NDArray[np.int64]
F64 = NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class NarrowConfig:
    """``margin``: score distance from the best still handed over; ``max_nodes``: at most this many."""

    margin: float = 0.0
    max_nodes: int = 1

    def __post_init__(self) -> None:
        if self.margin < 0 or self.max_nodes < 1:
            raise PackingError(f"narrowed filter needs margin >= 0 and max_nodes >= 1, got {self}")


@dataclass(frozen=True, slots=True)
class NodeBest:
    """Per feasible node: the node, the index of its best candidate, that candidate's score."""

    node: I64
    index: I64
    score: F64


def node_order(names: Sequence[str], salt: str = "") -> I64:
    """A consistent, seed-independent pseudo-random rank per node (0 = first), from a name hash.

    A random-looking order matters: grouped orders (big nodes first, say) pack much worse
    (reference/fgd-benchmark.md 0b).
    """
    keys = [hashlib.blake2b((salt + n).encode(), digest_size=8).digest() for n in names]
    order = sorted(range(len(names)), key=lambda i: (keys[i], names[i]))
    rank = np.empty(len(names), dtype=np.int64)
    rank[np.array(order, dtype=np.int64)] = np.arange(len(names), dtype=np.int64)
    return rank


def best_per_node(cands: Candidates, score: F64, secondary: F64 | None = None) -> NodeBest:
    """Each node's best candidate: highest score, then highest secondary, then first position.

    Candidates from :func:`enumerate_candidates` come ordered by slot, so this runs as segment
    reductions (no sort); other orders are sorted first.
    """
    n = len(cands)
    if n == 0:
        return NodeBest(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0))
    perm: I64 | None = None
    if n > 1 and not bool(np.all(np.diff(cands.slot) > 0)):
        perm = np.argsort(cands.slot, kind="stable")
        node, score = cands.node[perm], score[perm]
        secondary = None if secondary is None else secondary[perm]
    else:
        node = cands.node
    change = np.empty(n, dtype=bool)
    change[0] = True
    np.not_equal(node[1:], node[:-1], out=change[1:])
    starts = np.flatnonzero(change)
    seg = np.cumsum(change) - 1
    top = np.maximum.reduceat(score, starts)
    ok = score >= top[seg]
    if secondary is not None:
        sec = np.where(ok, secondary, -np.inf)
        ok &= sec >= np.maximum.reduceat(sec, starts)[seg]
    idx = np.minimum.reduceat(np.where(ok, np.arange(n), n), starts)
    if perm is not None:
        idx = perm[idx]
    return NodeBest(cands.node[idx], idx.astype(np.int64), top)


def narrowed_filter(best: NodeBest, rank: I64, config: NarrowConfig) -> NodeBest:
    """The nodes to pass on: within ``margin`` of the best score, best first, ties by ``rank``."""
    if best.node.shape[0] == 0:
        return best
    keep = best.score >= best.score.max() - config.margin - 1e-12
    node, index, score = best.node[keep], best.index[keep], best.score[keep]
    order = np.lexsort((rank[node], -score))[: config.max_nodes]
    return NodeBest(node[order], index[order], score[order])


def priority_scores(scores: F64, *, ranked: bool = True) -> I64:
    """Map scores onto kube-scheduler's 0..10 extender range.

    Min-max scaled over the nodes given. With ``ranked`` (the nodes come from the narrowed
    filter, best first) the first node alone gets 10 and the others at most 9, so kube-scheduler's
    random tie-break cannot undo the extender's order.
    """
    n = scores.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    lo, hi = float(scores.min()), float(scores.max())
    scaled = np.full(n, 10.0) if hi - lo <= 1e-12 else 10.0 * (scores - lo) / (hi - lo)
    out = np.floor(scaled + 1e-9).astype(np.int64)
    if ranked and n > 1:
        out[1:] = np.minimum(out[1:], 9)
        out[0] = 10
    return np.clip(out, 0, 10)


def kube_select(priorities: I64, weight: int, kube_scores: I64 | None, rng: np.random.Generator) -> int:
    """What a stock kube-scheduler does with the extender's scores: add ``weight`` x priority to its
    own plugin scores and pick the maximum, ties at random. Returns a position in ``priorities``."""
    total = priorities * weight
    if kube_scores is not None:
        total = total + kube_scores
    best = np.flatnonzero(total == total.max())
    return int(best[rng.integers(best.shape[0])]) if best.shape[0] > 1 else int(best[0])


def paper_choice(cands: Candidates, score: F64, secondary: F64, rank: I64) -> int:
    """The research simulator's rule: integer score ``int(100 * score)``; inside a node the best
    integer, then ``secondary``, then the first unit; across nodes the best integer, then the fixed
    node order ``rank``. Returns a candidate index, -1 when there is none."""
    if len(cands) == 0:
        return -1
    level = np.floor(score * 100.0 + 1e-9)
    best = best_per_node(cands, level, secondary)
    order = np.lexsort((rank[best.node], -best.score))
    return int(best.index[order[0]])


def filter_reasons(state: ClusterState, req: PackRequest, fit: Fit | None = None) -> dict[int, str]:
    """A reason per refused node (node index -> text); feasible nodes are absent."""
    if fit is None:
        fit = state.fit(req)
    bad = np.flatnonzero(~fit.feasible)
    out: dict[int, str] = {}
    s = state.slices_per_gpu
    for v in bad.tolist():
        parts: list[str] = []
        if not fit.cpu[v]:
            parts.append(f"insufficient cpu: pod asks {req.cpu_milli}m, node has {int(state.node_cpu_free[v])}m free")
        if not fit.memory[v]:
            parts.append(f"insufficient memory: pod asks {req.memory_mib} MiB, node has "
                         f"{int(state.node_mem_free[v])} MiB free")
        if not fit.product[v]:
            allowed = ", ".join(sorted(req.products or ()))
            parts.append(f"GPU product {state.products[int(state.node_product[v])]} not in pod's allowed "
                         f"models ({allowed})")
        elif not fit.gpu[v]:
            parts.append(_gpu_reason(state, req, v, s))
        out[v] = "; ".join(parts)
    return out


def _gpu_reason(state: ClusterState, req: PackRequest, v: int, s: int) -> str:
    units = [int(u) for u in state.node_units[v] if u < state.n_units]
    if not units:
        return "node has no GPUs advertising slices"
    if req.owner:
        plain = PackRequest(cpu_milli=0, gpus=req.gpus, slices=req.slices, gpu_memory_mib=req.gpu_memory_mib,
                            isolation=req.isolation)
        ok = state.unit_accepts(plain)
        if (req.gpus == 1 and any(ok[u] for u in units)) or (req.gpus > 1 and sum(bool(ok[u]) for u in units)
                                                             >= req.gpus):
            return f"every fitting GPU already runs a pod of owner {req.owner} (owner-spread rule)"
    if req.isolation == "mig" and not any(state.unit_kind[u] == KIND_MIG for u in units):
        return "pod asks MIG isolation and the node has no MIG instances"
    if req.gpus > 1:
        return f"fewer than {req.gpus} completely free GPUs of {req.slices} slices"
    if req.gpu_memory_mib:
        return f"no GPU with {req.slices} free slices of {s} and {req.gpu_memory_mib} MiB of GPU memory"
    if any(state.unit_kind[u] == KIND_MIG for u in units):
        return f"no free MIG instance with exactly {req.slices} compute slices"
    return f"no GPU with {req.slices} free slices of {s}"


@dataclass(frozen=True, slots=True)
class Reservation:
    """A placement chosen at filter, held for ``uid`` until bind or ``expires``."""

    uid: str
    node: int
    units: tuple[int, ...]
    slices: int
    cpu_milli: int
    memory_mib: int
    owner: str
    expires: float


class Reservations:
    """Filter-time reservations; applied to the state at once so later filters count them."""

    def __init__(self, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self.held: dict[str, Reservation] = {}

    def reserve(self, state: ClusterState, req: PackRequest, node: int, units: Sequence[int],
                now: float) -> Reservation:
        if req.uid in self.held:
            self.release(state, req.uid)
        r = Reservation(req.uid, node, tuple(int(u) for u in units), req.slices, req.cpu_milli,
                        req.memory_mib, req.owner, now + self.timeout)
        state.take(node, r.units, r.slices, r.cpu_milli, r.memory_mib, r.owner)
        self.held[req.uid] = r
        return r

    def release(self, state: ClusterState, uid: str) -> Reservation | None:
        r = self.held.pop(uid, None)
        if r is not None:
            state.give_back(r.node, r.units, r.slices, r.cpu_milli, r.memory_mib, r.owner)
        return r

    def bind(self, uid: str) -> Reservation | None:
        """The pod was bound as reserved: the hold becomes the pod's own (the state keeps it)."""
        return self.held.pop(uid, None)

    def expire(self, state: ClusterState, now: float) -> list[Reservation]:
        gone = [uid for uid, r in self.held.items() if r.expires <= now]
        return [r for uid in gone if (r := self.release(state, uid)) is not None]
