"""Point 8 of :mod:`gpuslice.policies.fragmentation`: the hosts a multi-GPU shape has left.

A multi-GPU pod needs that many free whole units on one node. FGD weighs each shape by its share
of the pods, so a rare large shape's fragment is small, and its last hosts look cheap to break,
though the pod that then finds none loses all its slices. A host is worth the shape's slices times
the chance that it will be needed: that the shape's pods still to come (Poisson, with mean ``E``,
its pods expected among those that fill the free slices) are at least the hosts left (``R``). With
hosts many against ``E`` the chance is nil, so the term stays out of the way while capacity is
plentiful, and it nears the shape's slices as the last hosts go.

The sizes learned are those seen so far, and a node can be broken up before the first pod of its
size arrives. Once the workload has shown multi-GPU pods, every size from two GPUs to the largest
node's that no pod seen has asked is counted as if ``unseen`` of its pods had been seen (the rule
of three: a kind of pod not seen among n has probability at most 3 / n), so the last nodes able to
take a size nobody has asked for yet are not given away for free while few pods have been seen.
"""

from __future__ import annotations

import math
from weakref import WeakKeyDictionary

import numpy as np

from gpuslice.packing.frag import I64, TargetWorkload
from gpuslice.packing.scarcity import UNSEEN_BOUND
from gpuslice.packing.state import Candidates, ClusterState, PackRequest
from gpuslice.policies.base import F64

#: A host whose tail probability is below this costs nothing (saves the acceptance pass).
NEGLIGIBLE = 1e-6

#: The key of a unit acceptance test: a multi-GPU shape's (slices, GPU-memory floor, isolation).
Test = tuple[int, int, str]


class _HostCounts:
    """Per acceptance test, each node's units that pass it, kept per state and brought up to date
    from the nodes whose ``node_version`` moved (a decision changes one node, and a full pass reads
    every unit of the cluster)."""

    def __init__(self, state: ClusterState) -> None:
        self.layout = state.layout_version
        self.nodes = state.n_nodes
        self.counts: dict[Test, tuple[I64, I64, int]] = {}  # per node, node versions, state.changes

    def per_node(self, state: ClusterState, shape: PackRequest) -> I64:
        # Acceptance of a multi-GPU shape's units does not depend on how many GPUs it asks.
        test = (shape.slices, shape.gpu_memory_mib, shape.isolation)
        kept = self.counts.get(test)
        if kept is None:
            per_node: I64 = np.asarray(state.unit_accepts(shape)[state.node_units].sum(axis=1), dtype=np.int64)
            self.counts[test] = per_node, state.node_version[: state.n_nodes].copy(), state.changes
            return per_node
        per_node, versions, changes = kept
        if changes != state.changes:
            moved = np.flatnonzero(state.node_version[: state.n_nodes] != versions)
            if moved.shape[0]:
                rows = state.node_units[moved]
                per_node[moved] = state.unit_accepts(shape, rows.reshape(-1)).reshape(rows.shape).sum(axis=1)
                versions[moved] = state.node_version[moved]
            self.counts[test] = per_node, versions, state.changes
        return per_node


_HOST_COUNTS: WeakKeyDictionary[ClusterState, _HostCounts] = WeakKeyDictionary()


def _host_counts(state: ClusterState) -> _HostCounts:
    kept = _HOST_COUNTS.get(state)
    if kept is None or kept.layout != state.layout_version or kept.nodes != state.n_nodes:
        kept = _HOST_COUNTS[state] = _HostCounts(state)
    return kept


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


def multi_gpu_shapes(state: ClusterState, target: TargetWorkload,
                     unseen: float = UNSEEN_BOUND) -> dict[PackRequest, float]:
    """The learned multi-GPU shapes with their pods seen and, once there is one, a whole-GPU shape of
    every size from 2 GPUs to the largest node's that none of them asks, counted as ``unseen`` pods."""
    shapes: dict[PackRequest, float] = {shape: float(seen) for shape, seen in target.multi_gpu.items()}
    if not shapes or unseen <= 0:
        return shapes
    asked = {shape.gpus for shape in shapes}
    for gpus in range(2, state.max_node_gpus + 1):
        if gpus not in asked:
            shapes[PackRequest(gpus=gpus, slices=state.slices_per_gpu)] = unseen
    return shapes


def shape_reach_change(state: ClusterState, req: PackRequest, cands: Candidates, target: TargetWorkload,
                       free: float, unseen: float = UNSEEN_BOUND) -> F64:
    """Per candidate, the sum over multi-GPU shapes (:func:`multi_gpu_shapes`, other than the pod's
    own) of slices x P(N >= R) for each shape whose host the placement ends: a node that, after it,
    has fewer free units accepting the shape than it asks. Hosts are counted by their units only (a
    node's CPU is point 3's). ``free``: the cluster's free slices
    (:func:`gpuslice.policies.fragmentation.usable_free_slices`)."""
    n = len(cands)
    out = np.zeros(n)
    if n == 0 or req.gpus == 0 or target.gpu_slices <= 0 or not target.multi_gpu:
        return out
    own = target.gpu_shape(req)
    node = cands.node
    counts = _host_counts(state)
    for shape, seen in multi_gpu_shapes(state, target, unseen).items():
        if shape == own:
            continue  # the pod's own shape: taking a host is what hosts are for
        per_node = counts.per_node(state, shape)
        hosts = (per_node >= shape.gpus) & state.product_mask(shape.products)[: state.n_nodes] & state.node_alive
        left = int(np.count_nonzero(hosts))
        if left == 0:
            continue
        chance = poisson_tail(target.expected_pods(seen, free), left)
        if chance < NEGLIGIBLE:
            continue
        taken = state.unit_accepts(shape, cands.units.reshape(-1)).reshape(cands.units.shape)
        after = per_node[node] - taken.sum(axis=1)
        ends = hosts[node] & (after < shape.gpus)
        out += np.where(ends, chance * shape.gpus * shape.slices, 0.0)
    return out
