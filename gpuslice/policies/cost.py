"""``cost``: prefer the cheapest capacity, and capacity already paid for.

What a day costs is the price of the nodes that hold GPU pods (an autoscaler removes empty ones),
so a placement has two prices: the node's $/slice-hour (OpenCost's ``node_total_hourly_cost``, or
the config's price table, arrives as ``NodeSpec.cost_per_hour``; spot before on-demand, L4 before
H100), and what it adds to the bill now, the node's whole $/hour if the node holds no GPU pod yet
and nothing if it already does. With ``p`` the candidate node's $/slice-hour over the most
expensive one, and ``o`` 1 when the placement opens a node:

    score = 1 - (1 - OPEN_SHARE) * p - OPEN_SHARE * o * p

so among nodes in use the cheapest wins (the dear ones drain first), and opening a node costs a
third more. OPEN_SHARE = 1 (only what is added now) packs small pods onto open H100 nodes that
then never drain, and 0 (only the list price) opens cheap nodes while paid ones sit half empty;
0.25 was chosen on the built-in LLM day (bench/bench_builtin.py, figures in bench/RESULTS.md).
A cluster without prices (all 0) scores every candidate 1 and has no
secondary order: no price data is neutral, not a penalty, and leaves a weighted mix as it was
(see :mod:`gpuslice.policies.registry`). With prices, the tightest unit wins inside a node.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from gpuslice.packing.state import Candidates, ClusterState, PackRequest
from gpuslice.policies.base import F64, BasePolicy, tightest

NDArrayBool = NDArray[np.bool_]

#: Weight of "opens a node" in the price term (see the module docstring).
OPEN_SHARE = 0.25


def slice_hour_price(state: ClusterState) -> F64:
    """$/slice-hour per node (0 where the node has no price or no slices)."""
    cap = state.node_slice_cap.astype(np.float64)
    return np.asarray(np.where(cap > 0, state.node_cost / np.maximum(cap, 1.0), 0.0), dtype=np.float64)


def has_prices(state: ClusterState) -> bool:
    top = float(state.node_cost.max()) if state.node_cost.shape[0] else 0.0
    return top > 0 and bool(np.isfinite(top))


def nodes_in_use(state: ClusterState) -> NDArrayBool:
    """Nodes holding at least one allocated slice (what the bill counts)."""
    return np.asarray(state.node_free_slices() < state.node_slice_cap, dtype=bool)


class Cost(BasePolicy):
    name = "cost"

    def score(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        if not has_prices(state):
            return np.ones(len(cands))
        price = slice_hour_price(state)
        top = float(price.max())
        if top <= 0 or not np.isfinite(top):
            return np.ones(len(cands))
        p = price[cands.node] / top
        opens = ~nodes_in_use(state)[cands.node] if req.gpus else np.zeros(len(cands), dtype=bool)
        s = 1.0 - (1.0 - OPEN_SHARE) * p - OPEN_SHARE * np.where(opens, p, 0.0)
        return np.asarray(np.clip(s, 0.0, 1.0), dtype=np.float64)

    def secondary(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        if not has_prices(state):
            return np.zeros(len(cands))
        return tightest(state, req, cands)


POLICY = Cost()
