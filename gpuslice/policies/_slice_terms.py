"""Slice-model terms of ``fragmentation`` that FGD's per-unit view cannot see (kept apart from the
leftover rule in :mod:`gpuslice.policies.fragmentation`, which is tuned on the openb traces).

FGD scores units. A MIG instance is a unit, so FGD cannot tell an instance on a GPU that already
runs pods from one on an idle GPU, though only the latter puts one more GPU in use and strands the
rest of it. But an instance is a fixed-size bin, and what an idle one is worth depends on whether
the workload asks for its size: one of a size the learned pods ask for will be filled, one of a size
they do not ask for stays idle on a GPU that is paid for. The *fill* of size s is the share of the
free size-s instances that the pods expected to fill the free MIG capacity would take, min(1, E_s /
N_s): E_s counts the learned single-GPU shapes of size s (not MPS-only) in proportion to the MIG
sizes the cluster has, N_s the free size-s instances. A slice of a size-s instance weighs (1 - fill).
The *stranded-slice* change of a placement on a MIG instance of size k is then:

* on a GPU already in use: -k x (1 - fill of k) (the pod fills idle slices that were paid for);
* on an idle GPU: the weighted slices of the GPU's other idle instances, less the same.

``fragmentation`` adds it to FGD's fragment change (both in slices, weighted by ``MIG_WEIGHT``) and
uses it again to order placements at the best level. MPS and whole GPUs are one unit per GPU, so
FGD's own terms cover them and the term is 0 there; a cluster without MIG (the openb traces) is
scored exactly as plain FGD would score it.

FGD also cannot tell units apart by *who else could use them*. A full unit leaves no fragment
whichever it is, so a whole-GPU pod on a mixed node is as welcome on an idle MPS GPU (which any
small pod could share) as on a whole-GPU unit (which only whole-GPU pods can take). The
*versatility* of a unit is the probability that a learned GPU shape passes its unit test on the
unit when empty (:func:`gpuslice.packing.frag.unit_versatility`: kind, size, memory floor,
isolation). A pod that takes an idle unit whole (a whole GPU, an idle MPS GPU, a MIG
instance of exactly its size) uses it up for every other shape; a placement costs the slices of
the units it so uses up x their versatility, less the cheapest candidate's cost, so the pod uses up
the units the fewest other shapes could use. A share of an MPS GPU leaves the rest of it to the
others and costs nothing here (FGD's fragment change prices the rest). Where every unit is alike
(the openb traces: MPS GPUs, no floors) the cost is the same for every candidate and the term is 0.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import numpy as np
from numpy.typing import NDArray

from gpuslice.packing.frag import TargetWorkload
from gpuslice.packing.state import KIND_MIG, Candidates, ClusterState, PackRequest
from gpuslice.policies.base import F64

#: Slices of FGD's fragment one stranded MIG slice counts as. Below 1 on purpose: a stranded slice
#: can still take a later pod, a fragmented one cannot; much higher and small "any" pods fill the
#: small instances that MIG-only pods need (bench/RESULTS.md section 10 has the measurements).
MIG_WEIGHT = 0.75


class _MigRows:
    """The unit rows of MIG instances and their sizes, kept per state until its layout changes (a
    decision reads only those rows, not every unit of a large cluster)."""

    def __init__(self, state: ClusterState) -> None:
        self.layout = state.layout_version
        live = state.node_units[state.node_alive].reshape(-1)  # rows retired by a layout change are in no node's
        live = np.unique(live[live >= 0])
        self.rows = live[state.unit_kind[live] == KIND_MIG]
        self.cap = state.unit_cap[self.rows]
        self.gpu = state.unit_gpu_id[self.rows]
        self.size = int(self.cap.max()) + 1 if self.rows.size else 1
        self.present = np.bincount(self.cap, minlength=self.size) > 0


_MIG_ROWS: WeakKeyDictionary[ClusterState, _MigRows] = WeakKeyDictionary()


def _mig_rows(state: ClusterState) -> _MigRows:
    kept = _MIG_ROWS.get(state)
    if kept is None or kept.layout != state.layout_version:
        kept = _MIG_ROWS[state] = _MigRows(state)
    return kept


def _idle(state: ClusterState, mig: _MigRows) -> NDArray[np.bool_]:
    """Per MIG row: usable and holding no pod."""
    return np.asarray((state.unit_free[mig.rows] == mig.cap) & state.unit_usable[mig.rows], dtype=bool)


def instance_fill(state: ClusterState, target: TargetWorkload, idle: NDArray[np.bool_] | None = None) -> F64:
    """Per MIG instance size (index: slices), the share of the free instances of that size that the
    learned demand is expected to fill: min(1, E_s / N_s) (see the module docstring); 1 where no
    instance of the size is free, 0 for every size before any GPU pod is seen. ``idle``: per MIG
    row, if the caller has it."""
    mig = _mig_rows(state)
    if idle is None:
        idle = _idle(state, mig)
    count = np.bincount(mig.cap[idle], minlength=mig.size).astype(np.float64)
    demand = np.zeros(mig.size)
    for (_, k, g, _, _, isolation), pods in target.counts.items():
        if g == 1 and isolation != "mps" and k < mig.size and mig.present[k]:
            demand[k] += pods
    sizes = np.arange(mig.size, dtype=np.float64)
    asked = float((demand * sizes).sum())
    if asked <= 0:
        return np.where(count > 0, 0.0, 1.0)
    expected = demand * float((count * sizes).sum()) / asked
    fill = np.minimum(1.0, expected / np.maximum(count, 1.0))
    return np.asarray(np.where(count > 0, fill, 1.0), dtype=np.float64)


def mig_stranded_change(state: ClusterState, req: PackRequest, cands: Candidates, target: TargetWorkload) -> F64:
    """Change of unfilled idle slices on MIG GPUs in use, per candidate (0 off MIG and for
    multi-GPU pods): each idle instance's slices x (1 - :func:`instance_fill` of its size)."""
    n = len(cands)
    if req.gpus != 1 or n == 0:
        return np.zeros(n)
    u = cands.units[:, 0]
    on_mig = state.unit_kind[u] == KIND_MIG
    if not on_mig.any():
        return np.zeros(n)
    mig = _mig_rows(state)
    idle = _idle(state, mig)
    fill = instance_fill(state, target, idle)
    unfilled = mig.cap[idle] * (1.0 - fill[mig.cap[idle]])
    per_gpu = np.bincount(mig.gpu[idle], weights=unfilled, minlength=state.n_gpus)
    used = np.bincount(mig.gpu, weights=mig.cap - state.unit_free[mig.rows], minlength=state.n_gpus)
    g = state.unit_gpu_id[u]
    own = req.slices * (1.0 - fill[min(req.slices, fill.shape[0] - 1)])
    change = np.where(used[g] > 0, -own, per_gpu[g] - own)
    return np.asarray(np.where(on_mig, change, 0.0), dtype=np.float64)


def versatility_change(state: ClusterState, req: PackRequest, cands: Candidates, versatility: F64) -> F64:
    """Slices taken x the versatility (per unit row, :func:`gpuslice.packing.frag.unit_versatility`)
    of the units the pod takes whole, less the candidates' least."""
    n = len(cands)
    if req.gpus == 0 or n == 0:
        return np.zeros(n)
    units = cands.units  # (C, G)
    cap = state.unit_cap[units]
    whole = (state.unit_free[units] == cap) & (cap == req.slices)  # emptied by the pod, unused before
    if not whole.any():
        return np.zeros(n)
    cost = np.where(whole, versatility[units], 0.0).sum(axis=1) * float(req.slices)
    return np.asarray(cost - cost.min(), dtype=np.float64)
