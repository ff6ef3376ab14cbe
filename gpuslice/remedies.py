"""What new GPU capacity would take a pod: the MIG profile an idle GPU could be re-cut to, and the
catalogue products a new node could bring.

``gpu-slice status`` suggests these for a Pending pod when no eviction lets it in. Both read the
catalogue (:mod:`gpuslice.catalogue`) and the one memory rule (:mod:`gpuslice.rules`), so a
suggested profile or product is one the filter would then accept. A later module that re-cuts free
MIG space to Pending demand (DESIGN 4, "MIG layouts follow demand") replaces the re-cut half.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuslice.catalogue import PRODUCTS, MigProfile, Product
from gpuslice.packing.state import PackRequest
from gpuslice.rules import isolation_allows, memory_floor_met, mps_share_mib


def fitting_profile(product: str, slices: int, floor_mib: int, tolerance: float) -> MigProfile | None:
    """The smallest-memory MIG profile of ``product`` with exactly ``slices`` compute slices that
    meets the memory floor (None when the product has none). Media-extension (+me) profiles are
    left out: they exist for video engines, not for LLM serving."""
    prod = PRODUCTS.get(product)
    if prod is None:
        return None
    fits = [p for p in prod.mig_profiles if p.compute_slices == slices and not p.name.endswith("+me")
            and (floor_mib <= 0 or bool(memory_floor_met(p.memory_mib, floor_mib, tolerance)))]
    return min(fits, key=lambda p: (p.memory_mib, p.profile_id)) if fits else None


@dataclass(frozen=True, slots=True)
class ProductFit:
    """How a GPU of ``product`` would take the pod: its mode and, for MIG, the profile."""

    product: str
    mode: str
    profile: str = ""

    def describe(self, gpus: int) -> str:
        """``2 H100-80GB GPUs in whole mode``, ``an H100-80GB GPU with a 7g.80gb MIG instance``."""
        if self.mode == "whole":
            return f"{gpus} {self.product} GPU{'s' if gpus > 1 else ''} in whole mode"
        what = f"with a {self.profile} MIG instance" if self.mode == "mig" else "in MPS mode"
        return f"a {self.product} GPU {what}"


def _ways(prod: Product, req: PackRequest, per_gpu: int, tolerance: float) -> list[ProductFit]:
    """The modes in which one empty GPU of ``prod`` takes the request's per-GPU part."""
    if prod.memory_mib is None:
        return []
    out: list[ProductFit] = []
    floor = req.gpu_memory_mib
    whole_ok = floor <= 0 or bool(memory_floor_met(prod.memory_mib, floor, tolerance))
    if (req.gpus > 1 or req.slices == per_gpu) and isolation_allows("whole", req.isolation) and whole_ok:
        out.append(ProductFit(prod.name, "whole"))
    if req.gpus == 1:
        profile = fitting_profile(prod.name, req.slices, floor, tolerance)
        if profile is not None and isolation_allows("mig", req.isolation):
            out.append(ProductFit(prod.name, "mig", profile.name))
        share = mps_share_mib(prod.memory_mib, req.slices, per_gpu)
        if isolation_allows("mps", req.isolation) and (floor <= 0 or bool(memory_floor_met(share, floor,
                                                                                           tolerance))):
            out.append(ProductFit(prod.name, "mps"))
    return out


def fitting_products(req: PackRequest, per_gpu: int, tolerance: float,
                     present: frozenset[str] = frozenset()) -> list[ProductFit]:
    """Catalogue products whose empty GPUs take the pod (within its allowed products), one way each:
    products the cluster already runs (``present``) first, then by memory, smallest first."""
    found: list[tuple[tuple[bool, int, str], ProductFit]] = []
    for prod in PRODUCTS.values():
        if req.products is not None and prod.name not in req.products:
            continue
        ways = _ways(prod, req, per_gpu, tolerance)
        if ways:
            found.append(((prod.name not in present, prod.memory_mib or 0, prod.name), ways[0]))
    return [fit for _, fit in sorted(found, key=lambda t: t[0])]


__all__ = ["ProductFit", "fitting_products", "fitting_profile"]
