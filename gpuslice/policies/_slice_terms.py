"""Slice-model terms of ``fragmentation`` that FGD's per-unit view cannot see (kept apart from the
leftover rule in :mod:`gpuslice.policies.fragmentation`, which is tuned on the openb traces).

FGD scores units. A MIG instance is a unit, so FGD cannot tell an instance on a GPU that already
runs pods from one on an idle GPU, though only the latter puts one more GPU in use and strands the
rest of it. The *stranded-slice* change of a placement on a MIG instance is:

* on a GPU already in use: -k (the pod fills k idle slices that were paid for, the GPU stays one GPU);
* on an idle GPU: (GPU's slices - k) (the other instances of that GPU are now idle on a GPU in use).

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

import numpy as np

from gpuslice.packing.state import KIND_MIG, Candidates, ClusterState, PackRequest
from gpuslice.policies.base import F64

#: Slices of FGD's fragment one stranded MIG slice counts as. Below 1 on purpose: a stranded slice
#: can still take a later pod, a fragmented one cannot; much higher and small "any" pods fill the
#: small instances that MIG-only pods need (bench/RESULTS.md section 10 has the measurements).
MIG_WEIGHT = 0.75


def mig_stranded_change(state: ClusterState, req: PackRequest, cands: Candidates) -> F64:
    """Change of idle slices on MIG GPUs in use, per candidate (0 off MIG and for multi-GPU pods)."""
    n = len(cands)
    if req.gpus != 1 or n == 0:
        return np.zeros(n)
    u = cands.units[:, 0]
    mig = state.unit_kind[u] == KIND_MIG
    if not mig.any():
        return np.zeros(n)
    g = state.unit_gpu_id[u]
    used = state.gpu_used_slices()[g]
    change = np.where(used > 0, -float(req.slices), (state.gpu_cap[g] - req.slices).astype(np.float64))
    return np.asarray(np.where(mig, change, 0.0), dtype=np.float64)


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
