"""Any-Fit for shared GPUs: an idle MPS GPU is not opened for a pod that a GPU already in use takes.

Online bin packing's first and best fit share one property, *Any-Fit*: a new bin is opened only
when no open bin holds the item. FGD does not have it. Its fragment is measured node by node
against the learned shapes, and for a small pod the rest of an idle GPU can look a better fragment
than the rest of a GPU in use, so FGD opens idle GPUs for pods that fit elsewhere. But an idle GPU
is the only place a whole-GPU share (and a spread owner's pod, once every GPU in use holds one of
its own) still fits, and a GPU opened for a small pod stays in use: under arrivals alone it never
comes back. So among single-GPU candidates on MPS GPUs, those that would open an idle GPU are
scored at the lowest level whenever a GPU of the same product already runs pods and takes the pod.
Products are compared so that the rule never pushes a pod onto a product the pinned demand needs
(the product-scarcity term decides between products); MIG instances and whole GPUs are left to the
stranded-slice and versatility terms (:mod:`gpuslice.policies._slice_terms`).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from gpuslice.packing.state import KIND_MPS, Candidates, ClusterState, PackRequest


def idle_gpu_openers(state: ClusterState, req: PackRequest, cands: Candidates) -> NDArray[np.bool_]:
    """Per candidate: it puts a single-GPU pod on an idle MPS GPU while another candidate puts it on
    an MPS GPU of the same product that already runs pods."""
    n = len(cands)
    if req.gpus != 1 or n == 0:
        return np.zeros(n, dtype=bool)
    u = cands.units[:, 0]
    mps = state.unit_kind[u] == KIND_MPS
    idle = state.unit_free[u] == state.unit_cap[u]
    in_use = mps & ~idle
    if not in_use.any():
        return np.zeros(n, dtype=bool)
    product = state.node_product[cands.node]
    return np.asarray(mps & idle & np.isin(product, product[in_use]), dtype=bool)
