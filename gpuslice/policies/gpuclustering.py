"""``gpuclustering``: the paper's baseline that keeps GPU pods of one kind together.

Bands (best first): the node runs only pods of the same kind (fractional, or m whole GPUs); the node
runs that kind among others; the node is empty; the node runs other kinds only. Within a band, less
free GPU scores higher. CPU-only pods score 0 everywhere. Best-fit unit inside the node.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuslice.packing.state import POD_CLASSES, Candidates, ClusterState, PackRequest
from gpuslice.policies.base import F64, BasePolicy, tightest


def pod_class(state: ClusterState, req: PackRequest) -> int:
    """0 for a fractional pod, m for a pod of m whole units."""
    if req.gpus == 1 and req.slices < state.slices_per_gpu:
        return 0
    return min(req.gpus, POD_CLASSES - 1)


class GpuClustering(BasePolicy):
    name = "gpuclustering"

    def score(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        if req.gpus == 0:
            return np.zeros(len(cands))
        cls = state.node_classes[cands.node]
        same = cls[:, pod_class(state, req)] > 0
        total = cls.sum(axis=1)
        band = np.where(total == 0, 1, np.where(same, np.where(cls[:, pod_class(state, req)] == total, 3, 2), 0))
        free = state.node_free_slices()[cands.node] / state.max_node_slices
        return np.asarray((band + (1.0 - free)) / 4.0, dtype=np.float64)

    def secondary(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        return tightest(state, req, cands)


POLICY = GpuClustering()
