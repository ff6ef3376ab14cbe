"""``random``: one feasible node drawn uniformly gets the top score; a random fitting unit inside it.

As the FGD artifact's Random baseline: drawing per node (not per unit) keeps nodes with many free
units from being favoured. The RNG lives in the memory, seeded from the context.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuslice.packing.state import Candidates, ClusterState, PackRequest
from gpuslice.policies.base import F64, BasePolicy, PolicyContext


def _rng(memory: Any) -> np.random.Generator:
    return memory if isinstance(memory, np.random.Generator) else np.random.default_rng(0)


class RandomPolicy(BasePolicy):
    name = "random"

    def new_memory(self, ctx: PolicyContext) -> Any:
        return np.random.default_rng(ctx.seed + 7919)

    def score(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        if len(cands) == 0:
            return np.zeros(0)
        change = np.empty(len(cands), dtype=bool)
        change[0] = True
        np.not_equal(cands.node[1:], cands.node[:-1], out=change[1:])
        nodes = cands.node[change] if bool(np.all(np.diff(cands.node) >= 0)) else np.unique(cands.node)
        chosen = nodes[_rng(memory).integers(nodes.shape[0])]
        return np.where(cands.node == chosen, 1.0, 0.0)

    def secondary(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        return _rng(memory).random(len(cands))


POLICY = RandomPolicy()
