"""``binpack``: kube-scheduler's MostAllocated over CPU, memory and GPU slices (node level).

The mean of requested/allocatable after placing, for the three resources; inside a node the
tightest unit wins. It does not see per-GPU fractions beyond that, like the stock scorer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuslice.packing.state import Candidates, ClusterState, PackRequest
from gpuslice.policies.base import F64, BasePolicy, node_slices_left, tightest


def allocated_fraction(state: ClusterState, req: PackRequest, cands: Candidates) -> F64:
    """Mean used share of CPU, memory and (on GPU nodes) slices after placing."""
    v = cands.node
    cpu = 1.0 - (state.node_cpu_free[v] - req.cpu_milli) / np.maximum(state.node_cpu_cap[v], 1)
    mem = 1.0 - (state.node_mem_free[v] - req.memory_mib) / np.maximum(state.node_mem_cap[v], 1)
    cap = state.node_slice_cap[v]
    gpu = np.where(cap > 0, 1.0 - node_slices_left(state, req, cands) / np.maximum(cap, 1), 0.0)
    n = np.where(cap > 0, 3.0, 2.0)
    return np.asarray(np.clip((cpu + mem + gpu) / n, 0.0, 1.0), dtype=np.float64)


class BinPack(BasePolicy):
    name = "binpack"

    def score(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        return allocated_fraction(state, req, cands)

    def secondary(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        return tightest(state, req, cands)


POLICY = BinPack()
