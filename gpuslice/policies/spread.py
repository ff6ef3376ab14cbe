"""``spread``: kube-scheduler's LeastAllocated; inside a node the unit with most free slices.

For latency-sensitive pods that should not share a GPU when there is room; the opposite of packing.
"""

from __future__ import annotations

from typing import Any

from gpuslice.packing.state import Candidates, ClusterState, PackRequest
from gpuslice.policies.base import F64, BasePolicy, unit_leftover
from gpuslice.policies.binpack import allocated_fraction


class Spread(BasePolicy):
    name = "spread"

    def score(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        return 1.0 - allocated_fraction(state, req, cands)

    def secondary(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        return unit_leftover(state, req, cands)


POLICY = Spread()
