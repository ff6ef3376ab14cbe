"""Tiny hand-built clusters for policy tests, a fragmentation memory that has seen given pods, and
the node a policy picks."""

from __future__ import annotations

import numpy as np

from gpuslice.packing.state import KIND_MPS, ClusterState, NodeSpec, PackRequest, UnitSpec, enumerate_candidates
from gpuslice.policies.base import PolicyContext
from gpuslice.policies.fgd import FragMemory
from gpuslice.policies.fragmentation import Fragmentation


def cluster(free: list[list[int]], *, cpu: int = 64000, products: list[str] | None = None,
            slices: int = 1000, cpus: list[int] | None = None) -> ClusterState:
    """One node per inner list, one MPS unit per entry with that many free slices."""
    nodes = [NodeSpec(f"n{i}", (cpus or [cpu] * len(free))[i], 256000, (products or ["G2"] * len(free))[i])
             for i in range(len(free))]
    units = [UnitSpec(i, g, KIND_MPS, slices, free=f) for i, row in enumerate(free) for g, f in enumerate(row)]
    return ClusterState(nodes, units, slices_per_gpu=slices, allow_mps_multi=True)


def learned(pol: Fragmentation, seen: list[PackRequest]) -> FragMemory:
    """A fresh memory of ``pol`` that has observed ``seen``, in order."""
    mem: FragMemory = pol.new_memory(PolicyContext(0))
    for r in seen:
        pol.observe(mem, r)
    return mem


def pick(pol: Fragmentation, state: ClusterState, req: PackRequest, seen: list[PackRequest]) -> int:
    """Node of the highest score once ``pol`` has learned ``seen``, ties to the lowest node index
    (the caller's node order); every score must lie in [0, 1)."""
    mem = learned(pol, seen)
    cands = enumerate_candidates(state, req)
    score = pol.score(state, req, cands, mem)
    assert np.all((score >= 0) & (score < 1))
    return int(cands.node[int(np.argmax(score))])
