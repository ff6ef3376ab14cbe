"""Point 8 of :mod:`gpuslice.policies.fragmentation`: the hosts a multi-GPU shape has left.

A multi-GPU pod needs that many free whole units on one node. FGD weighs each shape by its share
of the pods, so a rare large shape's fragment is small, and its last hosts look cheap to break,
though the pod that then finds none loses all its slices. A host is worth the shape's slices times
the chance that it will be needed: that the shape's pods still to come (Poisson, with mean ``E``,
its pods expected among those that fill the free slices) are at least the hosts left (``R``). With
hosts many against ``E`` the chance is nil, so the term stays out of the way while capacity is
plentiful, and it nears the shape's slices as the last hosts go.
"""

from __future__ import annotations

import math

import numpy as np

from gpuslice.packing.frag import I64, B, TargetWorkload
from gpuslice.packing.state import Candidates, ClusterState, PackRequest
from gpuslice.policies.base import F64

#: A host whose tail probability is below this costs nothing (saves the acceptance pass).
NEGLIGIBLE = 1e-6


def poisson_tail(mean: float, at_least: int) -> float:
    """P(N >= ``at_least``) for N ~ Poisson(``mean``)."""
    if at_least <= 0:
        return 1.0
    if mean <= 0.0 or at_least > mean + 6.0 * math.sqrt(mean) + 10.0:
        return 0.0  # the second: far in the tail, under NEGLIGIBLE for any mean
    term = math.exp(-mean)
    below = term
    for i in range(1, at_least):
        term *= mean / i
        below += term
        if i > mean and term < 1e-15:  # the rest of the sum is smaller still
            break
    return max(0.0, 1.0 - below)


def shape_reach_change(state: ClusterState, req: PackRequest, cands: Candidates, target: TargetWorkload,
                       free: float) -> F64:
    """Per candidate, the sum over learned multi-GPU shapes (other than the pod's own) of slices x
    P(N >= R) for each shape whose host the placement ends: a node that, after it, has fewer free
    units accepting the shape than it asks. Hosts are counted by their units only (a node's CPU
    is point 3's). ``free``: the cluster's free slices
    (:func:`gpuslice.policies.fragmentation.usable_free_slices`)."""
    n = len(cands)
    out = np.zeros(n)
    if n == 0 or req.gpus == 0 or target.gpu_slices <= 0 or not target.multi_gpu:
        return out
    own = PackRequest(gpus=req.gpus, slices=req.slices, gpu_memory_mib=req.gpu_memory_mib,
                      products=req.products, isolation=req.isolation)
    node = cands.node
    # Acceptance of a multi-GPU shape's units does not depend on how many GPUs it asks.
    tested: dict[tuple[int, int, str], tuple[B, I64]] = {}
    for shape, seen in target.multi_gpu.items():
        if target.key(shape)[1:] == target.key(own)[1:]:
            continue  # the pod's own shape: taking a host is what hosts are for
        test = (shape.slices, shape.gpu_memory_mib, shape.isolation)
        if test not in tested:
            accepts = state.unit_accepts(shape)
            tested[test] = accepts, accepts[state.node_units].sum(axis=1)
        accepts, per_node = tested[test]
        hosts = (per_node >= shape.gpus) & state.product_mask(shape.products)[: state.n_nodes] & state.node_alive
        left = int(np.count_nonzero(hosts))
        if left == 0:
            continue
        chance = poisson_tail(seen * free / target.gpu_slices, left)
        if chance < NEGLIGIBLE:
            continue
        after = per_node[node] - accepts[cands.units].sum(axis=1)
        ends = hosts[node] & (after < shape.gpus)
        out += np.where(ends, chance * shape.gpus * shape.slices, 0.0)
    return out
