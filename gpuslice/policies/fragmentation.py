"""``fragmentation``: our default, FGD's expected-fragmentation idea with a leftover-matching rule.

1. Expected fragmentation increase, exactly as :mod:`fgd`, against an **online** target: every pod
   shape (CPU, slices per GPU, GPUs, allowed products) seen so far, counted as pods arrive, no
   coverage cut, re-read when the count of pods seen doubles (see ``FragMemory``). Nothing is
   read from the trace in advance.
2. Among the candidates whose FGD level ``int(100 * sigmoid)`` is within ``window`` of the best
   one, prefer the placement that most lowers sum_g N(g)^2, where N(g) counts the cluster's
   units with g free slices, over T < g < S (T: the share that ``quantile`` of fractional pods
   seen ask or less). It takes from the most common leftover size first, so the leftovers
   stay spread over many sizes and a later pod of any size finds a close fit.
   The FGD level stays an integer on purpose: exact deltas pack worse (reference 0 item 2).

Scores: window candidates map to [0.5, 1) lexicographically (leftover rule, then FGD level);
the rest to 0.49 * level / 100, below all of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuslice.packing.state import KIND_MPS, Candidates, ClusterState, PackRequest
from gpuslice.policies import _slice_terms as slice_terms
from gpuslice.policies.base import F64, BasePolicy, PolicyContext
from gpuslice.policies.fgd import FragMemory, frag_delta, levels, new_frag_memory, sigmoid_score


def leftover_sumsq_change(state: ClusterState, req: PackRequest, cands: Candidates, low: int) -> F64:
    """Change of sum_g N(g)^2 (low < g < S, MPS units) if the pod went on each candidate's unit."""
    n = len(cands)
    if req.gpus != 1 or n == 0:
        return np.zeros(n)
    s = state.slices_per_gpu
    free = state.unit_free[: state.n_units]
    mps = (state.unit_kind[: state.n_units] == KIND_MPS) & state.unit_usable[: state.n_units]
    hist = np.bincount(free[mps], minlength=s + 1).astype(np.float64)
    u = cands.units[:, 0]
    x = state.unit_free[u]
    x2 = x - req.slices
    is_mps = state.unit_kind[u] == KIND_MPS
    in_old = is_mps & (x > low) & (x < s)
    in_new = is_mps & (x2 > low) & (x2 < s)
    d = np.where(in_old, 1.0 - 2.0 * hist[np.clip(x, 0, s)], 0.0)
    d += np.where(in_new, 1.0 + 2.0 * hist[np.clip(x2, 0, s)], 0.0)
    return np.asarray(d, dtype=np.float64)


class Fragmentation(BasePolicy):
    name = "fragmentation"

    def __init__(self, window: int = 20, quantile: float = 0.005) -> None:
        self.window = window
        self.quantile = quantile

    def new_memory(self, ctx: PolicyContext) -> Any:
        mem = new_frag_memory(ctx, offline=False)
        mem.target.aware = True  # slice-model targets: memory floors and isolation (frag.py)
        return mem

    def observe(self, memory: Any, req: PackRequest) -> None:
        memory.target.observe(req)

    def score(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        mem: FragMemory = memory
        n = len(cands)
        if n == 0:
            return np.zeros(0)
        delta = frag_delta(state, req, cands, mem) + slice_terms.extra_delta(state, req, cands)
        level = levels(sigmoid_score(delta, state.slices_per_gpu))
        inside = level >= level.max() - self.window
        low = mem.target.fractional_threshold(self.quantile, state.slices_per_gpu)
        d = leftover_sumsq_change(state, req, cands, low)
        out = 0.49 * level / 100.0
        if inside.any():
            _, rank = np.unique(d[inside], return_inverse=True)
            rank = rank.reshape(-1)
            keys = (rank.max() - rank) + level[inside] / 101.0
            out[inside] = 0.5 + 0.5 * keys / (rank.max() + 1.0)
        return np.asarray(out, dtype=np.float64)


POLICY = Fragmentation()
