"""``gpupacking``: the paper's baseline that fills partly used GPUs, then used nodes, then idle ones.

Bands: the pod fits on units already partly used (less leftover is better); it needs idle units on a
node already in use (fewer idle units consumed, i.e. a fuller node, is better); it opens an idle node
(fewer GPUs on that node is better). CPU-only pods score 0 everywhere. Best-fit unit inside the node.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuslice.packing.state import Candidates, ClusterState, PackRequest
from gpuslice.policies.base import F64, BasePolicy, tightest


class GpuPacking(BasePolicy):
    name = "gpupacking"

    def score(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        if req.gpus == 0:
            return np.zeros(len(cands))
        v = cands.node
        free = np.maximum(state.free_matrix(), 0)
        node_free = free.sum(axis=1)[v]
        node_cap = np.maximum(state.node_slice_cap[v], 1)
        units = cands.units
        ufree = state.unit_free[units[:, 0]]
        ucap = np.maximum(state.unit_cap[units[:, 0]], 1)
        partly = (ufree < ucap) if req.gpus == 1 else np.zeros(len(cands), dtype=bool)
        node_used = node_free < state.node_slice_cap[v]
        left = (ufree - req.slices) / ucap
        s_partly = 2.0 + (1.0 - left)
        s_used = 1.0 + (1.0 - node_free / node_cap)
        s_idle = 1.0 - state.node_gpus[v] / max(state.max_node_gpus, 1)
        s = np.where(partly, s_partly, np.where(node_used, s_used, s_idle))
        return np.asarray(np.clip(s / 3.0, 0.0, 1.0), dtype=np.float64)

    def secondary(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        return tightest(state, req, cands)


POLICY = GpuPacking()
