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
from gpuslice.units import format_mib

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
    """The placements found on a node and, per GPU, why the others were not possible."""

    node: str
    placements: tuple[Placement, ...]
    reasons: tuple[str, ...]

    @property
    def feasible(self) -> bool:
        return bool(self.placements)

    def reason(self) -> str:
        """One line for a FailedNodes entry or an event: the distinct reasons, most common first."""
        if self.placements:
            return ""
        if not self.reasons:
            return "node has no GPUs advertising example.com/gpu-slice"
        counts: dict[str, int] = {}
        for r in self.reasons:
            counts[r] = counts.get(r, 0) + 1
        ordered = sorted(counts.items(), key=lambda kv: -kv[1])
        return "; ".join(f"{r} (x{n})" if n > 1 else r for r, n in ordered)


def memory_fits(available_mib: float, request: SliceRequest, tolerance: float) -> bool:
    """Whether ``available_mib`` meets the request's memory floor (the one rule: :mod:`gpuslice.rules`)."""
    return rules.memory_fits(available_mib, None if request.memory_mib is None else float(request.memory_mib),
                             tolerance)


def isolation_allows(mode: GpuMode, request: SliceRequest) -> bool:
    """``mig`` and ``mps`` pin the GPU mode; ``any`` takes all (:func:`gpuslice.rules.isolation_allows`)."""
    return rules.isolation_allows(mode, request.isolation)


def _memory_reason(gpu: Gpu, what: str, available: float, request: SliceRequest) -> str:
    assert request.memory_mib is not None
    return (f"{what} on {gpu.product} has {format_mib(available)}, "
            f"less than the {format_mib(float(request.memory_mib))} requested")


def _mig(node: str, gpu: Gpu, used: frozenset[str], request: SliceRequest, tol: float,
         out: list[Placement], reasons: list[str]) -> None:
    k = request.slices
    sizes = sorted({p.compute_slices for p in product(gpu.product).mig_profiles})
    if k not in sizes:
        reasons.append(f"a {k}-slice request matches no MIG profile of {gpu.product} "
                       f"(compute slices {', '.join(map(str, sizes))})")
        return
    matching = [i for i in gpu.instances if i.compute_slices == k]
    if not matching:
        reasons.append(f"GPU {gpu.index} has no MIG instance with {k} compute slices")
        return
    found = False
    short: tuple[float, str] | None = None
    for inst in matching:
        sids = inst.slice_ids()
        if any(s in used for s in sids):
            continue
        if not memory_fits(inst.memory_mib, request, tol):
            if short is None or inst.memory_mib > short[0]:
                short = (inst.memory_mib, inst.profile)
            continue
        found = True
        out.append(Placement(node, "mig", (gpu.uuid,), inst.uuid, sids, inst.memory_mib))
    if not found:
        if short is not None:
            reasons.append(_memory_reason(gpu, f"MIG instance {short[1]}", short[0], request))
        else:
            reasons.append(f"every {k}-slice MIG instance on GPU {gpu.index} is in use")


def _mps(node: str, gpu: Gpu, used: frozenset[str], request: SliceRequest, tol: float,
         out: list[Placement], reasons: list[str]) -> None:
    k, s = request.slices, gpu.slices
    if k > s:
        reasons.append(f"{k} slices exceed the {s} slices of one MPS GPU")
        return
    memory = rules.mps_share_mib(gpu.memory_mib, k, s)
    if not memory_fits(memory, request, tol):
        reasons.append(_memory_reason(gpu, f"{k}/{s} of an MPS GPU", memory, request))
        return
    free = [sid for sid in gpu.slice_ids() if sid not in used]
    if len(free) < k:
        reasons.append(f"GPU {gpu.index} has {len(free)} of {s} slices free, {k} needed")
        return
    out.append(Placement(node, "mps", (gpu.uuid,), None, tuple(free[:k]), memory))


def enumerate_placements(inventory: NodeInventory, request: SliceRequest, *,
                         memory_tolerance: float = DEFAULT_MEMORY_TOLERANCE) -> Feasibility:
    """Every feasible placement of ``request`` on ``inventory``, with reasons for what failed."""
    placements: list[Placement] = []
    reasons: list[str] = []
    used = inventory.used
    whole_free: list[Gpu] = []
    whole_seen: list[Gpu] = []
    for gpu in inventory.gpus:
        if not gpu.healthy:
            reasons.append(f"GPU {gpu.index} is unhealthy")
            continue
        if gpu.cordoned:
            reasons.append(f"GPU {gpu.index} is cordoned")
            continue
        if not isolation_allows(gpu.mode, request):
            reasons.append(f"GPU {gpu.index} is in {gpu.mode} mode, pod asks {request.isolation} isolation")
            continue
        if request.memory_mib is not None and product(gpu.product).memory_mib is None:
            reasons.append(f"memory of {gpu.product} GPUs is not known, pod asks a memory floor")
            continue
        if gpu.mode == "mig":
            _mig(inventory.node, gpu, used, request, memory_tolerance, placements, reasons)
        elif gpu.mode == "mps":
            _mps(inventory.node, gpu, used, request, memory_tolerance, placements, reasons)
        else:
            whole_seen.append(gpu)
            if not any(sid in used for sid in gpu.slice_ids()):
                whole_free.append(gpu)
    if whole_seen:
        placements.extend(_whole(inventory.node, whole_seen, whole_free, request, memory_tolerance, reasons))
    return Feasibility(inventory.node, tuple(placements), tuple(reasons))


def _whole(node: str, seen: list[Gpu], free: list[Gpu], request: SliceRequest, tol: float,
           reasons: list[str]) -> list[Placement]:
    """Whole-GPU placements: m fully free GPUs of equal S (one placement per first-fit window)."""
    k = request.slices
    out: list[Placement] = []
    by_s: dict[int, list[Gpu]] = {}
    for gpu in seen:
        by_s.setdefault(gpu.slices, [])
    for gpu in free:
        by_s[gpu.slices].append(gpu)
    for s, gpus in by_s.items():
        if k % s:
            reasons.append(f"{k} slices is not a whole number of GPUs (S={s}) for whole-mode GPUs")
            continue
        m = k // s
        if len(gpus) < m:
            reasons.append(f"{len(gpus)} whole GPUs free, {m} needed")
            continue
        # Each window of m consecutive free GPUs (in index order) is one candidate, so a policy can
        # choose among GPUs without an exponential number of combinations.
        for start in range(len(gpus) - m + 1):
            chosen = gpus[start:start + m]
            memory = sum(g.memory_mib for g in chosen)
            if not memory_fits(memory, request, tol):
                reasons.append(_memory_reason(chosen[0], f"{m} whole GPU(s)", memory, request))
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
