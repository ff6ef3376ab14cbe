"""How much of each GPU product's capacity the learned workload needs, when spread evenly.

Pods pinned to some products (a model built for one architecture, a team that asked for H100s)
can use only those products; unrestricted pods can use any. When unrestricted pods fill a product
that pinned demand needs, the pinned pods go Pending while other products sit idle. FGD's per-node
fragment cannot see this: a shape that cannot use a node counts all of that node's idle capacity as
fragment, whichever product it is, so restrictions spread over products raise every node alike.

The measure: assign the target distribution's demand (slices per pod shape, scaled so the total
equals the capacity) to the products each shape may use, as evenly as possible, i.e. minimise the
sum over products of load^2 / capacity. The minimiser's loads are unique; unrestricted demand pools
on the least loaded products until they share one level, and a product whose pinned demand alone is
above that level keeps a higher ratio. A product's *load ratio* (load / capacity) is what its
capacity is worth to the workload compared with the others: a pod that could run on a product at
the common level but takes one above it spends capacity that only pinned pods could have used.

The demand is learned from the pods seen, and a sample of n pods can miss a pinned group
altogether: early on, a small product nobody has yet been seen pinned to looks as idle as a large
one, and unrestricted pods use it up before its pinned pods arrive. Once the workload has shown
that it pins pods at all, every product therefore carries one more group pinned to it alone, at
the bound statistics gives for an event not seen in n trials, 3 / n of the GPU demand (the rule
of three, 95 %). It weighs most on the small products, where a few pinned pods need all the
capacity, and fades as pods arrive.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from gpuslice.packing.frag import TargetShapes
from gpuslice.packing.state import ClusterState

F64 = NDArray[np.float64]
B = NDArray[np.bool_]

#: Block-coordinate sweeps; the problem has a handful of products and shape groups, and the loads
#: stop moving (to 1e-9 of the capacity) well before this on every workload in bench/.
SWEEPS = 200
#: The rule of three: a group of pods not seen among n has probability at most 3 / n (95 %).
UNSEEN_BOUND = 3.0


def _fill(base: F64, cap: F64, amount: float) -> F64:
    """Pour ``amount`` into products with loads ``base`` and capacities ``cap`` to one common ratio.

    Returns the amount each product receives: max(0, level * cap - base) for the level at which
    they sum to ``amount`` (water-filling)."""
    ratio = base / cap
    order = np.argsort(ratio)
    r, c, b = ratio[order], cap[order], base[order]
    cum_c = np.cumsum(c)
    cum_b = np.cumsum(b)
    # with the first i+1 products filled, the level is (amount + cum_b[i]) / cum_c[i]; it is valid
    # while it does not exceed the next product's ratio
    level = (amount + cum_b) / cum_c
    nxt = np.append(r[1:], np.inf)
    i = int(np.argmax(level <= nxt))
    out = np.zeros_like(base)
    out[order[: i + 1]] = np.maximum(level[i] * c[: i + 1] - b[: i + 1], 0.0)
    return out


def load_ratios(demand: F64, eligible: B, capacity: F64, start: F64 | None = None) -> tuple[F64, F64]:
    """Load ratio per product (K) for demands (G) that may each use the products in ``eligible`` (G x K).

    Demand with no eligible product of positive capacity is dropped (no placement serves it).
    Products without capacity get ratio 0. The demand is scaled to the total capacity, so the
    ratios describe shares, not volume. Returns the ratios and the assignment (G x K), which a
    later call with the same groups may pass as ``start`` to converge in a few sweeps."""
    k = capacity.shape[0]
    out = np.zeros(k)
    x = np.zeros((demand.shape[0], k))
    has = capacity > 0
    if not has.any() or demand.shape[0] == 0:
        return out, x
    elig = eligible & has[None, :] & (demand > 0)[:, None]
    d = np.where(elig.any(axis=1), demand, 0.0)
    if d.sum() <= 0:
        return out, x
    d = d * (capacity[has].sum() / d.sum())
    if start is not None and start.shape == x.shape:
        x = np.where(elig, start, 0.0)
        x *= (d / np.maximum(x.sum(axis=1), 1e-300))[:, None]  # rescale each group to its demand
    load = x.sum(axis=0)
    for _ in range(SWEEPS):
        moved = 0.0
        for g in np.flatnonzero(d > 0):
            cols = np.flatnonzero(elig[g])
            base = load[cols] - x[g, cols]
            new = _fill(base, capacity[cols], float(d[g]))
            moved = max(moved, float(np.abs(new - x[g, cols]).max()))
            load[cols] = base + new
            x[g, cols] = new
        if moved <= 1e-6 * capacity[has].sum():
            break
    out[has] = load[has] / capacity[has]
    return out, x


def product_free(state: ClusterState) -> F64:
    """Free slices per product (``state.products`` order) on usable units of live nodes."""
    u = state.n_units
    node = state.unit_node[:u]
    ok = state.unit_usable[:u] & state.node_alive[node]
    return np.bincount(state.node_product[node][ok], weights=np.maximum(state.unit_free[:u][ok], 0).astype(np.float64),
                       minlength=len(state.products)).astype(np.float64)


def demand_groups(shapes: TargetShapes, unseen: float = UNSEEN_BOUND) -> tuple[F64, B]:
    """The target's GPU demand (slices per pod, weighted by probability) grouped by allowed products.

    Where some shape is pinned, one more group per product, pinned to it alone, with min(1, ``unseen``
    / GPU pods seen) of the GPU demand: the pinned demand the sample may not have shown yet."""
    k = shapes.prod_ok.shape[0]
    gpu = shapes.gpus > 0
    if not gpu.any():
        return np.zeros(0), np.zeros((0, k), dtype=bool)
    demand = shapes.p * shapes.gpus * shapes.slices
    cols, group = np.unique(shapes.prod_ok[:, gpu].T, axis=0, return_inverse=True)
    per_group = np.bincount(group.reshape(-1), weights=demand[gpu], minlength=cols.shape[0]).astype(np.float64)
    cols = cols.astype(bool)
    if unseen > 0 and k > 1 and shapes.gpu_pods > 0 and not cols.all():
        share = min(1.0, unseen / shapes.gpu_pods) * float(demand[gpu].sum())
        per_group = np.concatenate([per_group, np.full(k, share)])
        cols = np.concatenate([cols, np.eye(k, dtype=bool)])
    return per_group, cols


class ProductLoads:
    """Load ratios of the learned demand over the *free* capacity per product, kept between calls.

    Free, not total, capacity: a product that placements have filled faster than the workload's
    balance allows becomes scarcer for what is left, so pods that may go elsewhere turn away from it
    before the pinned pods that need it arrive. Recomputed (warm-started) when the target changed or
    some product's free capacity moved by more than ``tolerance`` of the cluster's free capacity.
    ``pinned``: per product, the share of its free capacity that the spread gives to pinned demand
    (shapes that may not use every product): what a slice taken there by another pod displaces."""

    def __init__(self, tolerance: float = 0.002, unseen: float = UNSEEN_BOUND) -> None:
        self.tolerance = tolerance
        self.unseen = unseen  # see demand_groups
        self.version = -1
        self.basis = np.zeros(0)
        self.ratios = np.zeros(0)
        self.demand = np.zeros(0)
        self.eligible = np.zeros((0, 0), dtype=bool)
        self.assign: F64 | None = None
        self.pinned = np.zeros(0)

    def get(self, shapes: TargetShapes, version: int, state: ClusterState) -> tuple[F64, F64]:
        """(load ratios, pinned shares) per product of ``state.products``."""
        k = len(state.products)
        fresh = version != self.version or self.eligible.shape[1:] != (k,)
        if fresh:
            self.demand, self.eligible = demand_groups(shapes, self.unseen)
            self.version, self.assign = version, None
        if self.eligible.all():  # nothing pinned: every product is worth the same
            if fresh:
                self.ratios, self.pinned = np.ones(k), np.zeros(k)
            return self.ratios, self.pinned
        free = product_free(state)
        moved = np.abs(free - self.basis).max() if self.basis.shape == free.shape else np.inf
        if not fresh and moved <= self.tolerance * max(free.sum(), 1.0):
            return self.ratios, self.pinned
        self.ratios, self.assign = load_ratios(self.demand, self.eligible, free, self.assign)
        pinned = ~self.eligible.all(axis=1)
        self.pinned = np.where(free > 0, self.assign[pinned].sum(axis=0) / np.maximum(free, 1e-300), 0.0)
        self.basis = free
        return self.ratios, self.pinned
