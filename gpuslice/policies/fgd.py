"""``fgd``: Fragmentation Gradient Descent (Weng et al., ATC '23), the paper's policy.

score = int(100 * sigmoid(-(F(node after) - F(node before)) / S)) / 100: a placement that raises
the expected fragment of its node by one GPU's worth scores 0.26, one that lowers it scores above
0.5. The integer rounding is the paper's (its kube-scheduler plugin returns the integer).

Target distribution: with ``PolicyContext.trace`` (paper baseline) FGD's offline table, the most
frequent shapes of the whole trace up to 95 % of pods, fixed for the run; without a trace, online
(see :class:`FragMemory`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuslice.packing.frag import FragCache, TargetShapes, TargetWorkload
from gpuslice.packing.scarcity import ProductLoads
from gpuslice.packing.state import Candidates, ClusterState, PackRequest
from gpuslice.policies.base import F64, BasePolicy, PolicyContext


@dataclass(slots=True)
class FragMemory:
    """What a fragmentation policy remembers: the shape counts, the published distribution, caches.

    Online learning: every pod that arrives is counted (``observe``) before it is scored, so the
    distribution is the empirical one over all pods seen so far, every shape kept. To keep the
    cached fragment values valid, the *published* distribution is re-read only when the number of
    pods seen reaches the next power of two (1, 2, 4, ..., 8192, 16384, ...); between re-reads the
    counts keep growing.
    """

    target: TargetWorkload
    online: bool
    cache: FragCache = field(default_factory=FragCache)
    version: int = 0
    shapes: TargetShapes | None = None
    products: tuple[str, ...] = ()
    next_refresh: int = 1
    growth: float = 2.0
    loads: ProductLoads = field(default_factory=ProductLoads)

    def current(self, state: ClusterState) -> TargetShapes:
        due = self.online and self.target.seen >= self.next_refresh
        if self.shapes is None or due or self.products != state.products:
            if due:
                while self.next_refresh <= self.target.seen:
                    self.next_refresh = max(self.next_refresh + 1, int(self.next_refresh * self.growth))
            self.shapes = TargetShapes.build(self.target, state.products)
            self.products = state.products
            self.version += 1
        self.cache.sync(state, self.shapes, self.version)
        return self.shapes

    def product_loads(self, state: ClusterState) -> tuple[F64, F64]:
        """Per-product load ratios and pinned shares of the current target over the free capacity
        (:class:`gpuslice.packing.scarcity.ProductLoads`)."""
        return self.loads.get(self.current(state), self.version, state)


def new_frag_memory(ctx: PolicyContext, *, offline: bool) -> FragMemory:
    if offline and ctx.trace is not None:
        return FragMemory(TargetWorkload.offline(ctx.trace), online=False)
    return FragMemory(TargetWorkload(), online=True)


def frag_delta(state: ClusterState, req: PackRequest, cands: Candidates, memory: FragMemory) -> F64:
    """F(after) - F(before) per candidate, in slices."""
    shapes = memory.current(state)
    if len(shapes.p) == 0:
        return np.zeros(len(cands))
    before = memory.cache.node_frag(state)[cands.node]
    after = memory.cache.after_frag(state, req, cands)
    return after - before


def sigmoid_score(delta: F64, slices_per_gpu: int) -> F64:
    x = np.minimum(np.maximum(delta / slices_per_gpu, -50.0), 50.0)  # np.clip's values, cheaper to call
    return np.asarray(1.0 / (1.0 + np.exp(x)), dtype=np.float64)


def levels(score: F64) -> F64:
    """FGD's integer score ``int(100 * sigmoid)``."""
    return np.floor(score * 100.0 + 1e-9)


class Fgd(BasePolicy):
    name = "fgd"

    def new_memory(self, ctx: PolicyContext) -> Any:
        return new_frag_memory(ctx, offline=True)

    def observe(self, memory: Any, req: PackRequest) -> None:
        if memory.online:
            memory.target.observe(req)

    def score(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        # The paper's integer score, scaled into [0, 1]: the rounding is part of the method (exact
        # deltas pack worse, reference/fgd-benchmark.md 0 item 2), so every mode sees it.
        return levels(sigmoid_score(frag_delta(state, req, cands, memory), state.slices_per_gpu)) / 100.0


POLICY = Fgd()
