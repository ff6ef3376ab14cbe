"""``cost``: prefer the cheapest capacity per slice-hour (spot before on-demand, L4 before H100).

price per slice-hour of a candidate = its node's $/hour / the node's slices (OpenCost's
``node_total_hourly_cost``, or the config's price table, arrives as ``NodeSpec.cost_per_hour``).
score = 1 - price / most expensive price in the cluster, so the cheapest node scores highest and a
cluster without prices (all 0) scores every candidate 1: no price data is neutral, not a penalty.
Inside a node the tightest unit wins, so the policy still packs among equally priced nodes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuslice.packing.state import Candidates, ClusterState, PackRequest
from gpuslice.policies.base import F64, BasePolicy, tightest


def slice_hour_price(state: ClusterState) -> F64:
    """$/slice-hour per node (0 where the node has no price or no slices)."""
    cap = state.node_slice_cap.astype(np.float64)
    return np.asarray(np.where(cap > 0, state.node_cost / np.maximum(cap, 1.0), 0.0), dtype=np.float64)


class Cost(BasePolicy):
    name = "cost"

    def score(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        price = slice_hour_price(state)
        top = float(price.max()) if price.shape[0] else 0.0
        if top <= 0 or not np.isfinite(top):
            return np.ones(len(cands))
        return np.asarray(np.clip(1.0 - price[cands.node] / top, 0.0, 1.0), dtype=np.float64)

    def secondary(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        return tightest(state, req, cands)


POLICY = Cost()
