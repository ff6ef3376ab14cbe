"""Device choice under DRA: the first fitting device in the order a driver published.

Under Dynamic Resource Allocation (``resource.k8s.io/v1``) kube-scheduler's DynamicResources plugin,
not the extender, picks the device, in Filter, node by node: a first-fit search over the node's
devices in publication order (pools and slices sorted by name, devices in list order), with no
device scoring (reference/protocols.md 10). A driver cannot choose; it can only *order* what it
publishes. :class:`PublishedOrder` is that order, one place per unit in its node's device list, and
:func:`first_fit_candidates` is the allocator: per node, the first accepting unit (or, for a pod of
m GPUs, the first m) in that order. What "fits" is :meth:`ClusterState.unit_accepts`, the one fit
rule every caller uses; with static MIG layouts a MIG instance is the one placement device of its
profile there, so the per-GPU counters it would consume are free exactly when the instance is.

The order itself is a policy question (:mod:`gpuslice.policies.device_order`); this module only
stores it and applies first fit.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from gpuslice.packing.state import Candidates, ClusterState, Fit, PackRequest, enumerate_candidates

I64 = NDArray[np.int64]
B = NDArray[np.bool_]

#: The place of units that accept nothing (padding, the sentinel) in a first-fit search: last.
LAST = np.iinfo(np.int64).max


class PublishedOrder:
    """Per unit row, its place in its node's published device list (0 first); starts as the fixed
    order (unit position: GPUs by index, MIG instances as listed), which a naive driver never changes.

    ``version`` goes up with every change, so a decision made over one order is known stale after a
    republish. Units added after a layout change enter at their position until the next republish.
    """

    def __init__(self, state: ClusterState) -> None:
        self._generation = state.generation
        self.place: I64 = self._fixed(state)
        self.version = 0

    def reset(self, state: ClusterState) -> None:
        """Back to the fixed order (a new state object, or a driver that forgets its order)."""
        self._generation = state.generation
        self.place = self._fixed(state)
        self.version += 1

    @staticmethod
    def _fixed(state: ClusterState) -> I64:
        place = state.unit_pos[: state.n_units + 1].astype(np.int64, copy=True)
        place[state.n_units] = LAST  # the sentinel row (padding reads it) is never first
        return place

    def sync(self, state: ClusterState) -> I64:
        """The order for ``state`` as it is now: rows added since keep the old places, new ones enter
        at their position. Returns the per-unit places (``n_units + 1`` long, sentinel last)."""
        if self._generation != state.generation:
            self.reset(state)
        elif self.place.shape[0] != state.n_units + 1:
            old = self.place[:-1]
            fresh = self._fixed(state)
            fresh[: old.shape[0]] = old
            self.place = fresh
            self.version += 1
        return self.place

    def publish(self, state: ClusterState, rows: I64, places: I64) -> None:
        """Set the places of unit ``rows`` (a republish of the nodes they belong to)."""
        place = self.sync(state)
        if rows.shape[0]:
            place[rows] = places
            self.version += 1

    def candidates(self, state: ClusterState, req: PackRequest, fit: Fit, node_mask: B | None = None) -> Candidates:
        """What DRA's allocator gives ``req`` on each feasible node (see :func:`first_fit_candidates`)."""
        return first_fit_candidates(state, req, fit, self.sync(state), node_mask)


def first_fit_candidates(state: ClusterState, req: PackRequest, fit: Fit, place: I64,
                         node_mask: B | None = None) -> Candidates:
    """One candidate per feasible node: the accepting unit first in ``place`` order, or for a pod of
    m GPUs the first m accepting units (kube-scheduler's allocator takes devices in list order until
    the request's count is met). CPU-only pods take no device: every feasible node, as always."""
    if req.gpus == 0:
        return enumerate_candidates(state, req, fit, node_mask)
    mask = fit.feasible if node_mask is None else fit.feasible & node_mask
    okm = fit.unit_ok[state.node_units] & mask[:, None]
    nodes = np.flatnonzero(okm.sum(axis=1) >= req.gpus).astype(np.int64)
    w = state.width
    if nodes.shape[0] == 0:
        return Candidates(nodes, np.zeros((0, req.gpus), dtype=np.int64), nodes * w)
    key = np.where(okm[nodes], place[state.node_units[nodes]], LAST)
    if req.gpus == 1:
        pos = np.argmin(key, axis=1).astype(np.int64)[:, None]
    else:
        pos = np.argsort(key, axis=1, kind="stable")[:, : req.gpus].astype(np.int64)
    units = state.node_units[nodes[:, None], pos]
    return Candidates(nodes, units.astype(np.int64), nodes * w + pos[:, 0])
