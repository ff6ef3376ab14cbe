"""The extender's decision logic as pure functions, shared by the extender service and the simulator.

* :func:`best_per_node`: a node's best placement (score, then the policy's secondary order, then
  unit position);
* :func:`narrowed_filter`: the node(s) to hand kube-scheduler, best first within ``margin``, ties
  in the extender's own consistent order (:func:`node_order`), because kube-scheduler would break
  them at random and that destroys packing (DESIGN 4);
* :func:`priority_scores`: the 0..10 integers for ``/prioritize``;
* :func:`paper_choice`: the research simulator's rule (integer scores, fixed node order).

These are the building blocks of :mod:`gpuslice.scheduler` (start there); refusal reasons live in
:mod:`gpuslice.reasons`, reservations in :mod:`gpuslice.reservations`. The owner-spread rule (never
two pods of one owner on a GPU) is part of the unit fit in :meth:`ClusterState.unit_accepts`, so
every caller gets it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from gpuslice.packing.errors import PackingError
from gpuslice.packing.state import Candidates

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


def node_key(name: str, salt: str = "") -> int:
    """A node's place in the extender's consistent tie-break order: a 62-bit hash of its name.

    A random-looking order matters: grouped orders (big nodes first, say) pack much worse
    (reference/fgd-benchmark.md 0b). A key per name (not a rank over all names) lets a live
    cluster add nodes without reordering the others.
    """
    return int.from_bytes(hashlib.blake2b((salt + name).encode(), digest_size=8).digest(), "big") >> 2


def node_order(names: Sequence[str], salt: str = "") -> I64:
    """Ranks (0 = first) in the order of :func:`node_key`, ties by name."""
    keys = [node_key(n, salt) for n in names]
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


def narrowed_filter(best: NodeBest, rank: NDArray[np.int64] | F64, config: NarrowConfig) -> NodeBest:
    """The nodes to pass on: those within ``margin`` of the best score count as tied and go in the
    consistent order ``rank`` (lower first), at most ``max_nodes`` of them. ``margin`` 0 keeps only
    the best score."""
    if best.node.shape[0] == 0:
        return best
    keep = best.score >= best.score.max() - config.margin - 1e-12
    node, index, score = best.node[keep], best.index[keep], best.score[keep]
    order = np.argsort(rank[node], kind="stable")[: config.max_nodes]
    return NodeBest(node[order], index[order], score[order])


def priority_scores(scores: F64, *, ranked: bool = True, lead: int | None = None) -> I64:
    """Map scores onto kube-scheduler's 0..10 extender range.

    Min-max scaled over the nodes given. With ``ranked``, one node alone gets 10 and the others at
    most 9, so kube-scheduler's random tie-break cannot undo the extender's choice: ``lead`` (the
    node the filter reserved), else the highest score (the first of equal highest in the order
    given, which callers make the consistent node order).
    """
    n = scores.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    lo, hi = float(scores.min()), float(scores.max())
    scaled = np.full(n, 10.0) if hi - lo <= 1e-12 else 10.0 * (scores - lo) / (hi - lo)
    out = np.floor(scaled + 1e-9).astype(np.int64)
    if ranked and n > 1:
        top = int(np.argmax(scores)) if lead is None else lead
        out = np.minimum(out, 9)
        out[top] = 10
    return np.asarray(np.clip(out, 0, 10), dtype=np.int64)


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
