"""Why a node cannot take a pod: the one owner of refusal reasons, worded for an operator.

Each refused node gets one cause, found in this order, and is marked *unresolvable* when no change
of usage could ever let the pod in (wrong product, too little allocatable CPU or memory, no GPU of
the right mode, size or memory), so kube-scheduler does not try preemption there; otherwise the
cause is what is in use now (slices, CPU, the owner-spread rule, a cordon).

Causes are computed for all refused nodes at once over the unit arrays (no per-unit Python loop),
so explaining 5,000 refusals costs a few milliseconds; a sentence is written once per distinct
cause and numbers, then shared by every node with that cause.
"""

from __future__ import annotations

from collections.abc import Sequence
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

    def as_dict(self, names: Sequence[str]) -> dict[str, tuple[str, bool]]:
        return {names[int(v)]: (t, bool(u)) for v, t, u in zip(self.rows, self.texts, self.unresolvable, strict=True)}


def _profile_sizes(product_name: str) -> list[int]:
    """Compute-slice sizes of a product's MIG profiles ([] for an unknown or non-MIG product)."""
    if product_name not in PRODUCTS:
        return []
    return sorted({p.compute_slices for p in PRODUCTS[product_name].mig_profiles})


def _kinds_text(kinds: set[int]) -> str:
    names = {KIND_MPS: "mps", KIND_WHOLE: "whole", KIND_MIG: "mig"}
    return ", ".join(sorted(names[k] for k in kinds)) or "none"


# Cause codes, in the order they are tested; the first HARD ones are unresolvable.
(GONE, PRODUCT, CPU_CAP, MEM_CAP, NO_GPUS, MULTI, ISOLATION, SIZE, MEMORY, HARD,
 CORDON, OWNER, BUSY_MULTI, LAYOUT_BUSY, BUSY_MPS, BUSY_MIG, BUSY_WHOLE, CPU, MEM, OK) = range(20)
_KIND_BITS = {KIND_MPS: 1, KIND_WHOLE: 2, KIND_MIG: 4}


def _bits(mask: int, table: dict[int, int]) -> set[int]:
    return {k for k, bit in table.items() if mask & bit}


def _ones(mask: int) -> list[int]:
    """The positions of the set bits, lowest first (MIG sizes and GPU indexes travel as bit masks)."""
    return [x for x in range(mask.bit_length()) if mask >> x & 1]


def explain(state: ClusterState, req: PackRequest, fit: Fit, rows: I64) -> Explained:
    """Reasons for the node rows in ``rows`` (all expected refused by ``fit``).

    Each row gets a cause code and up to three numbers, computed for all rows at once; the text is
    then written once per distinct (cause, numbers), so thousands of refusals cost a few ms."""
    n = rows.shape[0]
    if n == 0:
        return Explained(rows, (), np.zeros(0, dtype=bool))
    code = np.full(n, OK, dtype=np.int64)
    p1 = np.zeros(n, dtype=np.int64)
    p2 = np.zeros(n, dtype=np.int64)
    p3 = np.zeros(n, dtype=np.int64)
    open_ = np.ones(n, dtype=bool)  # rows whose cause is not decided yet

    def assign(mask: NDArray[np.bool_], c: int, a: object = 0, b: object = 0, d: object = 0) -> None:
        m = mask & open_
        code[m] = c
        for arr, val in ((p1, a), (p2, b), (p3, d)):
            if isinstance(val, np.ndarray):
                arr[m] = val[m]
            elif val:
                arr[m] = int(val)  # type: ignore[call-overload]
        open_[m] = False

    s = state.slices_per_gpu
    assign(~state.node_alive[rows], GONE)
    assign(~fit.product[rows], PRODUCT, state.node_product[rows])
    assign(state.node_cpu_cap[rows] < req.cpu_milli, CPU_CAP, state.node_cpu_cap[rows])
    assign(state.node_mem_cap[rows] < req.memory_mib, MEM_CAP, state.node_mem_cap[rows])
    if req.gpus > 0:
        nu = state.node_units[rows]  # (n, width); padding = sentinel row
        kind = state.unit_kind[nu]
        cap = state.unit_cap[nu]
        free = state.unit_free[nu]
        usable = state.unit_usable[nu]
        real = kind != 3
        k = req.slices
        multi = req.gpus > 1
        need = req.gpus if multi else 1
        kind_ok = ((kind == KIND_WHOLE) | ((kind == KIND_MPS) & state.allow_mps_multi)) if multi else real
        iso_ok = (kind == KIND_MIG) if req.isolation == "mig" else (kind == KIND_MPS) if req.isolation == "mps" \
            else real
        size_ok = (cap == k) if multi else ((kind == KIND_MPS) | (cap == k))
        if req.gpu_memory_mib > 0:
            share = np.where(kind == KIND_MPS, mps_share_mib(state.unit_mem[nu], k, cap), state.unit_mem[nu])
            mem_ok = np.asarray(memory_floor_met(share, req.gpu_memory_mib, state.memory_tolerance), dtype=bool)
        else:
            share = state.unit_mem[nu]
            mem_ok = np.ones_like(real)
        static = real & kind_ok & iso_ok & size_ok & mem_ok
        free_ok = static & ((free == k) if multi else (free >= k))
        usable_ok = free_ok & usable
        blocked = np.zeros_like(real)
        if req.owner:
            taken = state.owner_units(req.owner)
            if taken:
                mark = np.zeros(state.n_units + 1, dtype=bool)
                mark[np.array(taken, dtype=np.int64)] = True
                blocked = mark[nu]
        gpu_bad = ~fit.gpu[rows]
        kinds_mask = ((kind == KIND_MPS).any(axis=1) * 1 + (kind == KIND_WHOLE).any(axis=1) * 2
                      + (kind == KIND_MIG).any(axis=1) * 4)
        assign(gpu_bad & ~real.any(axis=1), NO_GPUS)
        short = gpu_bad & (static.sum(axis=1) < need)
        if multi:
            whole = (real & kind_ok & (cap == s)).sum(axis=1)
            assign(short, MULTI, whole, kinds_mask)
        assign(short & ~(real & iso_ok).any(axis=1), ISOLATION, 0, kinds_mask)
        mig_sizes = np.bitwise_or.reduce(np.where(kind == KIND_MIG, np.left_shift(1, np.minimum(cap, 62)), 0),
                                         axis=1)
        has_whole = (kind == KIND_WHOLE).any(axis=1)
        assign(short & ~(real & iso_ok & size_ok).any(axis=1), SIZE, mig_sizes, has_whole, state.node_product[rows])
        fitting = real & iso_ok & size_ok
        best = np.where(fitting, share, -1).max(axis=1)
        assign(short, MEMORY, np.maximum(best, 0))
        n_usable = usable_ok.sum(axis=1)
        n_free = free_ok.sum(axis=1)
        gpu_index_bits = np.where(free_ok & ~usable, np.left_shift(1, np.minimum(state.unit_gpu_index[nu], 62)), 0)
        assign(gpu_bad & (n_usable < need) & (n_free >= need), CORDON, np.bitwise_or.reduce(gpu_index_bits, axis=1))
        if req.owner:
            assign(gpu_bad & ((usable_ok & ~blocked).sum(axis=1) < need) & (n_usable >= need), OWNER)
        if multi:
            assign(gpu_bad, BUSY_MULTI, n_usable)
        else:
            mps_static = static & (kind == KIND_MPS)
            most = np.where(mps_static, free, -1).max(axis=1)
            # MIG GPUs whose layout has no instance of the size: waiting frees nothing there, so
            # the sentence must say so before naming what is busy elsewhere on the node.
            wrong_size = (real & iso_ok & (kind == KIND_MIG) & ~size_ok).any(axis=1)
            right_size = (static & (kind == KIND_MIG)).any(axis=1)
            assign(gpu_bad & static.any(axis=1) & wrong_size & ~right_size, LAYOUT_BUSY,
                   np.where(mps_static.any(axis=1), np.maximum(most, 0), -1), mig_sizes, state.node_product[rows])
            assign(gpu_bad & mps_static.any(axis=1), BUSY_MPS, np.maximum(most, 0))
            assign(gpu_bad & (static & (kind == KIND_MIG)).any(axis=1), BUSY_MIG)
            assign(gpu_bad, BUSY_WHOLE)
    assign(~fit.cpu[rows], CPU, state.node_cpu_free[rows])
    assign(~fit.memory[rows], MEM, state.node_mem_free[rows])
    first, inverse = _groups((code, p1, p2, p3))
    words = [_word(state, req, int(code[i]), int(p1[i]), int(p2[i]), int(p3[i])) for i in first.tolist()]
    texts = tuple(map(words.__getitem__, inverse.tolist()))
    return Explained(rows, texts, code < HARD)


def _groups(columns: Sequence[I64]) -> tuple[I64, I64]:
    """Rows with equal values in every column: the first row of each group and each row's group.

    Each column is replaced by its dense rank (a 1-D ``np.unique``) and folded into one integer per
    row, re-ranked whenever the next fold could overflow; one more 1-D ``np.unique`` then groups
    the rows. Far cheaper than ``np.unique(axis=0)``, which sorts rows as opaque byte strings."""
    n = columns[0].shape[0]
    combined = np.zeros(n, dtype=np.int64)
    distinct = 1
    for col in columns:
        uniq, rank = np.unique(col, return_inverse=True)
        if distinct * uniq.shape[0] >= 2**62:
            seen, combined = np.unique(combined, return_inverse=True)
            combined, distinct = combined.reshape(-1).astype(np.int64), int(seen.shape[0])
        combined = combined * uniq.shape[0] + rank.reshape(-1)
        distinct *= int(uniq.shape[0])
    _, first, inverse = np.unique(combined, return_index=True, return_inverse=True)
    return first.astype(np.int64), inverse.reshape(-1).astype(np.int64)


def _layout_text(state: ClusterState, k: int, size_bits: int, product: int) -> str:
    """Why no MIG instance of the node takes ``k`` slices: its product has no such profile, or its
    layout has no such instance; in either case waiting for pods to leave will not help."""
    name = state.products[product]
    profiles = _profile_sizes(name)
    if profiles and k not in profiles:
        return (f"no MIG profile of {name} has {k} compute slices (profiles: {', '.join(map(str, profiles))})")
    return (f"no MIG instance here has {k} compute slices (instances here: "
            f"{', '.join(map(str, _ones(size_bits)))}; the layout would have to change)")


def _word(state: ClusterState, req: PackRequest, code: int, a: int, b: int, c: int) -> str:
    """The operator's sentence for one cause and its numbers."""
    s = state.slices_per_gpu
    k = req.slices
    if code == GONE:
        return "node was removed"
    if code == PRODUCT:
        product = state.products[a]
        return (f"GPU product {product or 'none'} is not among the pod's allowed products "
                f"({', '.join(sorted(req.products or ()))})")
    if code == CPU_CAP:
        return f"node has {a}m allocatable CPU, the pod asks {req.cpu_milli}m"
    if code == MEM_CAP:
        return f"node has {a} MiB allocatable memory, the pod asks {req.memory_mib} MiB"
    if code == NO_GPUS:
        return "node has no GPUs advertising slices"
    if code == MULTI:
        return (f"a {req.total_slices}-slice pod needs {req.gpus} whole-mode GPUs of {s} slices (more than one "
                f"GPU is given only as whole GPUs), and the node has {a} (modes here: "
                f"{_kinds_text(_bits(b, _KIND_BITS))})")
    if code == ISOLATION:
        want = "MIG instances" if req.isolation == "mig" else "MPS GPUs"
        return (f"pod asks {req.isolation} isolation and the node has no {want} (modes here: "
                f"{_kinds_text(_bits(b, _KIND_BITS))})")
    if code == SIZE:
        mig_sizes = _ones(a)
        parts = []
        if mig_sizes:
            parts.append(_layout_text(state, k, a, c))
        if b:
            parts.append(f"whole-mode GPUs are given only whole ({s} slices)")
        return f"no GPU here can take exactly {k} slices: {', and '.join(parts)}"
    if code == MEMORY:
        return (f"no GPU or MIG instance here gives {format_mib(req.gpu_memory_mib)} of GPU memory to a "
                f"{k}-slice pod (at most {format_mib(a)} here)")
    if code == CORDON:
        blocked = _ones(a)
        listed = ", ".join(map(str, blocked))
        return f"GPU {listed} could take the pod but {'is' if len(blocked) == 1 else 'are'} unhealthy or cordoned"
    if code == OWNER:
        return f"every fitting GPU already runs a pod of {req.owner} (owner-spread rule)"
    if code == BUSY_MULTI:
        return f"slices in use: {a} of the {req.gpus} whole GPUs needed are free"
    if code == LAYOUT_BUSY:
        busy = (f"no MPS GPU has {k} free slices now (at most {a} of {s} free)" if a >= 0
                else "every fitting whole GPU is taken now")
        return f"{_layout_text(state, k, b, c)}, so waiting will not help on the MIG GPUs; and {busy}"
    if code == BUSY_MPS:
        return f"slices in use: no fitting GPU has {k} free slices (at most {a} of {s} free)"
    if code == BUSY_MIG:
        return f"slices in use: every fitting {k}-slice MIG instance here is taken"
    if code == BUSY_WHOLE:
        return "slices in use: every fitting whole GPU here is taken"
    if code == CPU:
        return f"insufficient cpu: pod asks {req.cpu_milli}m, node has {a}m free"
    if code == MEM:
        return f"insufficient memory: pod asks {req.memory_mib} MiB, node has {a} MiB free"
    return ""
