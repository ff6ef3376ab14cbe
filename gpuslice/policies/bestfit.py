"""``bestfit``: least CPU and GPU left on the node after placing (the FGD paper's BestFit).

score = 1 - (0.5 * CPU left / largest node CPU + 0.5 * slices left / largest node slices);
inside a node the tightest-fitting unit wins (``secondary``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuslice.packing.state import Candidates, ClusterState, PackRequest
from gpuslice.policies.base import F64, BasePolicy, node_slices_left, tightest


class BestFit(BasePolicy):
    name = "bestfit"

    def score(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        cpu_left = (state.node_cpu_free[cands.node] - req.cpu_milli) / state.max_node_cpu
        gpu_left = node_slices_left(state, req, cands) / state.max_node_slices
        return np.clip(1.0 - (0.5 * cpu_left + 0.5 * gpu_left), 0.0, 1.0)

    def secondary(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        return tightest(state, req, cands)


POLICY = BestFit()
