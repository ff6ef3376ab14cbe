"""Placement enumeration: every feasible way to give a request slices on one node (DESIGN 2).

* ``mig`` GPU: one whole existing instance with exactly k compute slices, all of its ids free;
* ``mps`` GPU: k <= S free slices of one GPU (slices are interchangeable, so the lowest free
  ordinals stand for every choice on that GPU);
* ``whole`` GPUs: k = m*S takes m completely free GPUs of the node.

Memory is checked on every mode against the catalogue's real sizes with a relative tolerance, so a
``20Gi`` request matches 1g.20gb's 19.62 GiB. This module filters and explains; it never ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuslice import rules
from gpuslice.catalogue import product
from gpuslice.model import Gpu, GpuMode, NodeInventory
from gpuslice.requests import SliceRequest
from gpuslice.rules import DEFAULT_MEMORY_TOLERANCE

__all__ = ["DEFAULT_MEMORY_TOLERANCE", "Feasibility", "Placement", "enumerate_placements", "suits"]



@dataclass(frozen=True, slots=True)
class Placement:
    """One feasible answer: the node, its GPU(s), the MIG instance if any, and the exact ids."""

    node: str
    mode: GpuMode
    gpus: tuple[str, ...]
    instance: str | None
    slice_ids: tuple[str, ...]
    memory_mib: int

    @property
    def gpu(self) -> str:
        """The first (for single-GPU placements, the only) GPU."""
        return self.gpus[0]


@dataclass(frozen=True, slots=True)
class Feasibility:
    """The placements found on a node and, when there is none, why (one reason)."""

    node: str
    placements: tuple[Placement, ...]
    reasons: tuple[str, ...]

    @property
    def feasible(self) -> bool:
        return bool(self.placements)

    def reason(self) -> str:
        """One line for a FailedNodes entry or an event ("" when a placement exists)."""
        if self.placements:
            return ""
        return "; ".join(self.reasons) or "no placement"


def memory_fits(available_mib: float, request: SliceRequest, tolerance: float) -> bool:
    """Whether ``available_mib`` meets the request's memory floor (the one rule: :mod:`gpuslice.rules`)."""
    return rules.memory_fits(available_mib, None if request.memory_mib is None else float(request.memory_mib),
                             tolerance)


def isolation_allows(mode: GpuMode, request: SliceRequest) -> bool:
    """``mig`` and ``mps`` pin the GPU mode; ``any`` takes all (:func:`gpuslice.rules.isolation_allows`)."""
    return rules.isolation_allows(mode, request.isolation)


def _mig(node: str, gpu: Gpu, used: frozenset[str], request: SliceRequest, tol: float,
         out: list[Placement]) -> None:
    for inst in gpu.instances:
        if inst.compute_slices != request.slices:
            continue
        sids = inst.slice_ids()
        if any(s in used for s in sids) or not memory_fits(inst.memory_mib, request, tol):
            continue
        out.append(Placement(node, "mig", (gpu.uuid,), inst.uuid, sids, inst.memory_mib))


def _mps(node: str, gpu: Gpu, used: frozenset[str], request: SliceRequest, tol: float,
         out: list[Placement]) -> None:
    k, s = request.slices, gpu.slices
    if k > s:
        return
    memory = rules.mps_share_mib(gpu.memory_mib, k, s)
    if not memory_fits(memory, request, tol):
        return
    free = [sid for sid in gpu.slice_ids() if sid not in used]
    if len(free) >= k:
        out.append(Placement(node, "mps", (gpu.uuid,), None, tuple(free[:k]), memory))


def enumerate_placements(inventory: NodeInventory, request: SliceRequest, *,
                         memory_tolerance: float = DEFAULT_MEMORY_TOLERANCE) -> Feasibility:
    """Every feasible placement of ``request`` on ``inventory``; when there is none, the reason,
    worded by the one owner of refusal reasons (:mod:`gpuslice.reasons`)."""
    placements: list[Placement] = []
    used = inventory.used
    whole_free: list[Gpu] = []
    for gpu in inventory.gpus:
        if not gpu.schedulable or not isolation_allows(gpu.mode, request):
            continue
        if request.memory_mib is not None and product(gpu.product).memory_mib is None:
            continue
        if gpu.mode == "mig":
            _mig(inventory.node, gpu, used, request, memory_tolerance, placements)
        elif gpu.mode == "mps":
            _mps(inventory.node, gpu, used, request, memory_tolerance, placements)
        elif not any(sid in used for sid in gpu.slice_ids()):
            whole_free.append(gpu)
    placements.extend(_whole(inventory.node, whole_free, request, memory_tolerance))
    reasons = () if placements else (_explain(inventory, request, memory_tolerance),)
    return Feasibility(inventory.node, tuple(placements), reasons)


def _explain(inventory: NodeInventory, request: SliceRequest, tolerance: float) -> str:
    """Why ``request`` has no placement here, from the same reasons the filter gives."""
    import numpy as np

    from gpuslice.errors import GpuSliceError
    from gpuslice.packing.build import pack_request, state_from_inventories
    from gpuslice.packing.state import NodeSpec
    from gpuslice.reasons import explain

    s = next((g.slices for g in inventory.gpus if g.mode != "mig"), 7)
    try:
        req = pack_request(request, slices_per_gpu=s)
    except GpuSliceError as err:
        return str(err)
    name = inventory.gpus[0].product if inventory.gpus else ""
    state = state_from_inventories([(NodeSpec(inventory.node, 0, 0, name), inventory)], slices_per_gpu=s,
                                   memory_tolerance=tolerance)
    fit = state.fit(req)
    text = explain(state, req, fit, np.zeros(1, dtype=np.int64)).texts[0]
    return text or "no placement"


def _whole(node: str, free: list[Gpu], request: SliceRequest, tol: float) -> list[Placement]:
    """Whole-GPU placements: m fully free GPUs of equal S (one placement per first-fit window)."""
    k = request.slices
    out: list[Placement] = []
    by_s: dict[int, list[Gpu]] = {}
    for gpu in free:
        by_s.setdefault(gpu.slices, []).append(gpu)
    for s, gpus in by_s.items():
        if k % s:
            continue
        m = k // s
        # Each window of m consecutive free GPUs (in index order) is one candidate, so a policy can
        # choose among GPUs without an exponential number of combinations.
        for start in range(len(gpus) - m + 1):
            chosen = gpus[start:start + m]
            memory = sum(g.memory_mib for g in chosen)
            if not memory_fits(memory, request, tol):
                break
            sids = tuple(sid for g in chosen for sid in g.slice_ids())
            out.append(Placement(node, "whole", tuple(g.uuid for g in chosen), None, sids, memory))
    return out


def suits(placement: Placement, request: SliceRequest, inventory: NodeInventory, *,
          memory_tolerance: float = DEFAULT_MEMORY_TOLERANCE) -> bool:
    """Whether ``placement`` would be a correct answer for ``request`` (size, isolation, memory).

    Used at bind: kubelet may hand one pod's ids to another pod of the same size, so a second
    unstamped same-size assignment on a node is accepted only if each placement suits both pods.
    """
    if len(placement.slice_ids) != request.slices:
        return False
    for uuid in placement.gpus:
        gpu = inventory.gpu(uuid)
        if not isolation_allows(gpu.mode, request):
            return False
    return memory_fits(placement.memory_mib, request, memory_tolerance)
