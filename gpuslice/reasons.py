"""Why a node cannot take a pod: the one owner of refusal reasons, worded for an operator.

Each refused node gets one cause, found in this order, and is marked *unresolvable* when no change
of usage could ever let the pod in (wrong product, too little allocatable CPU or memory, no GPU of
the right mode, size or memory), so kube-scheduler does not try preemption there; otherwise the
cause is what is in use now (slices, CPU, the owner-spread rule, a cordon).

Causes are computed for all refused nodes at once over the unit arrays (no per-unit Python loop),
so explaining 5,000 refusals costs a few milliseconds; only the final strings are built per node,
from a cache keyed by the cause and its numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from gpuslice.catalogue import PRODUCTS
from gpuslice.packing.state import KIND_MIG, KIND_MPS, KIND_WHOLE, ClusterState, Fit, PackRequest
from gpuslice.rules import memory_floor_met, mps_share_mib
from gpuslice.units import format_mib

I64 = NDArray[np.int64]
B = NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class Explained:
    """Per refused node row: the reason and whether it is unresolvable."""

    rows: I64
    texts: tuple[str, ...]
    unresolvable: B

    def as_dict(self, names: tuple[str, ...]) -> dict[str, tuple[str, bool]]:
        return {names[int(v)]: (t, bool(u)) for v, t, u in zip(self.rows, self.texts, self.unresolvable, strict=True)}


def _profile_sizes(product_name: str) -> list[int]:
    """Compute-slice sizes of a product's MIG profiles ([] for an unknown or non-MIG product)."""
    if product_name not in PRODUCTS:
        return []
    return sorted({p.compute_slices for p in PRODUCTS[product_name].mig_profiles})


def _kinds_text(kinds: set[int]) -> str:
    names = {KIND_MPS: "mps", KIND_WHOLE: "whole", KIND_MIG: "mig"}
    return ", ".join(sorted(names[k] for k in kinds)) or "none"


def explain(state: ClusterState, req: PackRequest, fit: Fit, rows: I64) -> Explained:
    """Reasons for the node rows in ``rows`` (all expected refused by ``fit``)."""
    n = rows.shape[0]
    texts: list[str] = [""] * n
    unres = np.zeros(n, dtype=bool)
    if n == 0:
        return Explained(rows, (), unres)
    cache: dict[tuple[object, ...], str] = {}
    s = state.slices_per_gpu

    def put(i: int, key: tuple[object, ...], text: str | None = None, hard: bool = False) -> None:
        t = cache.get(key)
        if t is None:
            t = text if text is not None else str(key)
            cache[key] = t
        texts[i] = t
        unres[i] = hard

    alive = state.node_alive[rows]
    prod_ok = fit.product[rows]
    cpu_cap_ok = state.node_cpu_cap[rows] >= req.cpu_milli
    mem_cap_ok = state.node_mem_cap[rows] >= req.memory_mib
    gpu_ok = fit.gpu[rows]
    # The GPU side's static and dynamic causes, per node, over the node's unit positions.
    need = req.gpus > 0
    if need:
        nu = state.node_units[rows]  # (n, width); padding = sentinel row
        kind = state.unit_kind[nu]
        cap = state.unit_cap[nu]
        free = state.unit_free[nu]
        usable = state.unit_usable[nu]
        real = kind != 3
        k = req.slices
        multi = req.gpus > 1
        kind_ok = ((kind == KIND_WHOLE) | ((kind == KIND_MPS) & state.allow_mps_multi)) if multi else real.copy()
        if req.isolation == "mig":
            iso_ok = kind == KIND_MIG
        elif req.isolation == "mps":
            iso_ok = kind == KIND_MPS
        else:
            iso_ok = real
        size_ok = (cap == k) if multi else ((kind == KIND_MPS) | (cap == k))
        if req.gpu_memory_mib > 0:
            share = np.where(kind == KIND_MPS, mps_share_mib(state.unit_mem[nu], k, cap), state.unit_mem[nu])
            mem_ok = np.asarray(memory_floor_met(share, req.gpu_memory_mib, state.memory_tolerance), dtype=bool)
        else:
            share = state.unit_mem[nu]
            mem_ok = np.ones_like(real)
        static = real & kind_ok & iso_ok & size_ok & mem_ok
        static_n = static.sum(axis=1)
        busy_free = (free == k) if multi else (free >= k)
        free_ok = static & busy_free
        usable_ok = free_ok & usable
        owner_blocked = np.zeros_like(real)
        if req.owner:
            taken = state.owner_units(req.owner)
            if taken:
                mark = np.zeros(state.n_units + 1, dtype=bool)
                mark[np.array(taken, dtype=np.int64)] = True
                owner_blocked = mark[nu]
        m = req.gpus
    for i in range(n):
        v = int(rows[i])
        if not alive[i]:
            put(i, ("gone",), "node was removed", True)
            continue
        if not prod_ok[i]:
            product = state.products[int(state.node_product[v])]
            allowed = ", ".join(sorted(req.products or ()))
            put(i, ("product", product), f"GPU product {product or 'none'} is not among the pod's allowed "
                                         f"products ({allowed})", True)
            continue
        if not cpu_cap_ok[i]:
            cap_cpu = int(state.node_cpu_cap[v])
            put(i, ("cpu-cap", cap_cpu), f"node has {cap_cpu}m allocatable CPU, the pod asks {req.cpu_milli}m", True)
            continue
        if not mem_cap_ok[i]:
            cap_mem = int(state.node_mem_cap[v])
            put(i, ("mem-cap", cap_mem), f"node has {cap_mem} MiB allocatable memory, the pod asks "
                                         f"{req.memory_mib} MiB", True)
            continue
        if need and not gpu_ok[i]:
            row_real = real[i]
            if not row_real.any():
                put(i, ("no-gpus",), "node has no GPUs advertising slices", True)
                continue
            if static_n[i] < (m if multi else 1):
                present = {int(x) for x in kind[i][row_real]}
                if multi:
                    whole = int((row_real & kind_ok[i] & (cap[i] == s)).sum())
                    put(i, ("multi", whole, tuple(sorted(present))),
                        f"a {req.total_slices}-slice pod needs {m} whole-mode GPUs of {s} slices (more than one "
                        f"GPU is given only as whole GPUs), and the node has {whole} (modes here: "
                        f"{_kinds_text(present)})",
                        True)
                elif not (row_real & iso_ok[i]).any():
                    want = "MIG instances" if req.isolation == "mig" else "MPS GPUs"
                    put(i, ("iso", req.isolation, tuple(sorted(present))),
                        f"pod asks {req.isolation} isolation and the node has no {want} (modes here: "
                        f"{_kinds_text(present)})", True)
                elif not (row_real & iso_ok[i] & size_ok[i]).any():
                    mig_sizes = sorted({int(c) for c, kd in zip(cap[i], kind[i], strict=True) if kd == KIND_MIG})
                    parts = []
                    if mig_sizes:
                        name = state.products[int(state.node_product[v])]
                        profiles = _profile_sizes(name)
                        if profiles and k not in profiles:
                            parts.append(f"no MIG profile of {name} has {k} compute slices (profiles: "
                                         f"{', '.join(map(str, profiles))})")
                        else:
                            parts.append(f"no MIG instance here has {k} compute slices (instances here: "
                                         f"{', '.join(map(str, mig_sizes))}; the layout would have to change)")
                    if (kind[i] == KIND_WHOLE).any():
                        parts.append(f"whole-mode GPUs are given only whole ({s} slices)")
                    put(i, ("size", k, tuple(mig_sizes), int(state.node_product[v])),
                        f"no GPU here can take exactly {k} slices: {', and '.join(parts)}", True)
                else:
                    fitting = row_real & iso_ok[i] & size_ok[i]
                    best = int(share[i][fitting].max()) if fitting.any() else 0
                    put(i, ("memory", k, best),
                        f"no GPU or MIG instance here gives {format_mib(req.gpu_memory_mib)} of GPU memory to a "
                        f"{k}-slice pod (at most {format_mib(best)} here)", True)
                continue
            # Could fit an empty node: what is in use, cordoned or the owner rule stands in the way.
            need_n = m if multi else 1
            if int(usable_ok[i].sum()) < need_n and int(free_ok[i].sum()) >= need_n:
                blocked = sorted({int(g) for g in state.unit_gpu_index[nu[i]][free_ok[i] & ~usable[i]]})
                listed = ", ".join(map(str, blocked))
                put(i, ("cordon", listed), f"GPU {listed} could take the pod but "
                                           f"{'is' if len(blocked) == 1 else 'are'} unhealthy or cordoned")
            elif req.owner and int((usable_ok[i] & ~owner_blocked[i]).sum()) < need_n <= int(usable_ok[i].sum()):
                put(i, ("owner", req.owner), f"every fitting GPU already runs a pod of {req.owner} "
                                             "(owner-spread rule)")
            elif multi:
                got = int(usable_ok[i].sum())
                put(i, ("busy-multi", got), f"slices in use: {got} of the {m} whole GPUs needed are free")
            else:
                st = static[i]
                if (kind[i][st] == KIND_MPS).any():
                    most = int(free[i][st & (kind[i] == KIND_MPS)].max())
                    put(i, ("busy-mps", most), f"slices in use: no fitting GPU has {k} free slices (at most {most} "
                                               f"of {s} free)")
                elif (kind[i][st] == KIND_MIG).any():
                    put(i, ("busy-mig",), f"slices in use: every fitting {k}-slice MIG instance here is taken")
                else:
                    put(i, ("busy-whole",), "slices in use: every fitting whole GPU here is taken")
            continue
        if not fit.cpu[v]:
            put(i, ("cpu", int(state.node_cpu_free[v])), f"insufficient cpu: pod asks {req.cpu_milli}m, node has "
                                                       f"{int(state.node_cpu_free[v])}m free")
            continue
        if not fit.memory[v]:
            put(i, ("mem", int(state.node_mem_free[v])), f"insufficient memory: pod asks {req.memory_mib} MiB, node "
                                                       f"has {int(state.node_mem_free[v])} MiB free")
            continue
        put(i, ("ok",), "")
    return Explained(rows, tuple(texts), unres)
