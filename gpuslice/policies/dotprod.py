"""``dotprod``: the paper's Tetris-style baseline.

The dot product of the node's free (CPU, slices) with the pod's request, both scaled by the largest
node; a smaller product scores higher (it leans toward packing). Best-fit unit inside the node.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuslice.packing.state import Candidates, ClusterState, PackRequest
from gpuslice.policies.base import F64, BasePolicy, tightest


class DotProd(BasePolicy):
    name = "dotprod"

    def score(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        free = state.node_free_slices()[cands.node]
        cpu = state.node_cpu_free[cands.node] / state.max_node_cpu
        gpu = free / state.max_node_slices
        dot = cpu * (req.cpu_milli / state.max_node_cpu) + gpu * (req.total_slices / state.max_node_slices)
        return np.asarray(np.clip(1.0 - dot / 2.0, 0.0, 1.0), dtype=np.float64)

    def secondary(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        return tightest(state, req, cands)


POLICY = DotProd()
