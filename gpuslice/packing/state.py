"""Array state of a cluster for vectorised packing: one row per GPU *unit*, one row per node.

A unit is what a single-GPU request is placed on:

* an ``mps`` GPU: capacity S slices, accepts any k <= its free slices;
* a ``whole`` GPU: capacity S, only taken whole (k = S per GPU, m GPUs for k = m*S);
* a MIG instance: capacity K compute slices, taken only whole by a request of exactly K.

Requests for m > 1 GPUs take m completely free units of capacity S on one node, ``whole`` or
``mps`` (the latter is a simulation-only relaxation used to replay the openb traces, where
multi-GPU pods take fully free shared GPUs as in the research simulator; DESIGN 2 allows several
GPUs only on ``whole`` GPUs, and the services build states with ``allow_mps_multi=False``).

Every node has the same number of unit *positions* (``width``); ``node_units`` maps (node,
position) to a unit row, padding with a sentinel row whose free is -1, so per-node reductions are
plain numpy over an N x width matrix with no Python loop over nodes.

The state is mutable on purpose: the simulator and the extender's bookkeeping apply and release
placements in place and bump ``node_version`` so cached per-node values (policies) know what changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from gpuslice.packing.errors import PackingError

I64 = NDArray[np.int64]
F64 = NDArray[np.float64]
B = NDArray[np.bool_]

KIND_MPS = 0
KIND_WHOLE = 1
KIND_MIG = 2
KIND_NONE = 3  # the sentinel padding row
KIND_NAMES = ("mps", "whole", "mig")

#: GPU pod classes tracked per node (for ``gpuclustering``): 0 = fractional, m = m whole GPUs.
POD_CLASSES = 9


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A node as the packing engine needs it: allocatable CPU/RAM, GPU product, price."""

    name: str
    cpu_milli: int
    memory_mib: int
    product: str = ""
    cost_per_hour: float = 0.0


@dataclass(frozen=True, slots=True)
class UnitSpec:
    """One unit on node ``node`` (an index into the node list); ``free`` defaults to ``capacity``."""

    node: int
    gpu_index: int
    kind: int
    capacity: int
    memory_mib: int = 0
    free: int | None = None
    usable: bool = True
    gpu: str = ""
    instance: str = ""


@dataclass(frozen=True, slots=True)
class PackRequest:
    """A pod as the packing engine sees it.

    ``gpus`` is the number of units (0 = CPU-only); ``slices`` the slices per unit (S for whole
    GPUs). ``products`` restricts GPU products (None = any). ``owner`` drives the owner-spread rule.
    """

    cpu_milli: int = 0
    memory_mib: int = 0
    gpus: int = 0
    slices: int = 0
    gpu_memory_mib: int = 0
    products: frozenset[str] | None = None
    isolation: str = "any"
    owner: str = ""
    uid: str = ""

    def __post_init__(self) -> None:
        if self.gpus < 0 or self.slices < 0 or self.cpu_milli < 0 or self.memory_mib < 0:
            raise PackingError(f"negative request: {self}")
        if self.gpus > 0 and self.slices < 1:
            raise PackingError(f"request for {self.gpus} GPU(s) with {self.slices} slices each")
        if self.isolation not in ("mig", "mps", "any"):
            raise PackingError(f"isolation must be mig, mps or any, got {self.isolation!r}")

    @property
    def shape(self) -> tuple[int, int, int, frozenset[str] | None]:
        """The key of a pod *shape*: (CPU, slices per GPU, GPUs, products), memory ignored as in FGD."""
        return (self.cpu_milli, self.slices if self.gpus else 0, self.gpus, self.products)

    @property
    def total_slices(self) -> int:
        return self.gpus * self.slices


@dataclass(frozen=True, slots=True)
class Candidates:
    """Feasible placements of one request: node, unit rows (C x gpus), slot = node*width + position."""

    node: I64
    units: I64
    slot: I64

    def __len__(self) -> int:
        return int(self.node.shape[0])


@dataclass(slots=True)
class Fit:
    """Per-node filter verdict parts (all N-long), kept apart so reasons can be worded later."""

    cpu: B
    memory: B
    product: B
    gpu: B
    unit_ok: B = field(default_factory=lambda: np.zeros(0, dtype=bool))

    @property
    def feasible(self) -> B:
        return self.cpu & self.memory & self.product & self.gpu


class ClusterState:
    """Nodes and units as numpy arrays; see the module docstring for the layout."""

    def __init__(self, nodes: Sequence[NodeSpec], units: Sequence[UnitSpec], *, slices_per_gpu: int,
                 allow_mps_multi: bool = False) -> None:
        if slices_per_gpu < 1:
            raise PackingError(f"slices per GPU must be at least 1, got {slices_per_gpu}")
        n = len(nodes)
        self.slices_per_gpu = slices_per_gpu
        self.allow_mps_multi = allow_mps_multi
        self.node_names: tuple[str, ...] = tuple(x.name for x in nodes)
        self.node_index: dict[str, int] = {name: i for i, name in enumerate(self.node_names)}
        if len(self.node_index) != n:
            raise PackingError("duplicate node names")
        self.products: tuple[str, ...] = tuple(sorted({x.product for x in nodes}))
        self.product_index: dict[str, int] = {p: i for i, p in enumerate(self.products)}
        self.node_product: I64 = np.array([self.product_index[x.product] for x in nodes], dtype=np.int64)
        self.node_cpu_cap: I64 = np.array([x.cpu_milli for x in nodes], dtype=np.int64)
        self.node_mem_cap: I64 = np.array([x.memory_mib for x in nodes], dtype=np.int64)
        self.node_cpu_free: I64 = self.node_cpu_cap.copy()
        self.node_mem_free: I64 = self.node_mem_cap.copy()
        self.node_cost: F64 = np.array([x.cost_per_hour for x in nodes], dtype=np.float64)
        self.node_version: I64 = np.zeros(n, dtype=np.int64)
        self.node_classes: I64 = np.zeros((n, POD_CLASSES), dtype=np.int64)

        order = sorted(range(len(units)), key=lambda i: (units[i].node, units[i].gpu_index, i))
        us = [units[i] for i in order]
        u = len(us)
        for x in us:
            if not 0 <= x.node < n:
                raise PackingError(f"unit on node index {x.node}, but there are {n} nodes")
            if x.kind not in (KIND_MPS, KIND_WHOLE, KIND_MIG) or x.capacity < 1:
                raise PackingError(f"bad unit {x}")
        per_node = np.bincount(np.array([x.node for x in us], dtype=np.int64), minlength=n) if u else \
            np.zeros(n, dtype=np.int64)
        self.width = max(1, int(per_node.max()) if n else 1)
        # Sentinel row u: free -1 never fits, capacity 0, kind NONE.
        self.unit_node: I64 = np.array([x.node for x in us] + [-1], dtype=np.int64)
        self.unit_gpu_index: I64 = np.array([x.gpu_index for x in us] + [-1], dtype=np.int64)
        self.unit_kind: I64 = np.array([x.kind for x in us] + [KIND_NONE], dtype=np.int64)
        self.unit_cap: I64 = np.array([x.capacity for x in us] + [0], dtype=np.int64)
        self.unit_mem: I64 = np.array([x.memory_mib for x in us] + [0], dtype=np.int64)
        self.unit_free: I64 = np.array([x.capacity if x.free is None else x.free for x in us] + [-1],
                                       dtype=np.int64)
        self.unit_usable: B = np.array([x.usable for x in us] + [False], dtype=bool)
        self.unit_gpu: tuple[str, ...] = tuple(x.gpu or f"{self.node_names[x.node]}/gpu{x.gpu_index}"
                                               for x in us)
        self.unit_instance: tuple[str, ...] = tuple(x.instance for x in us)
        # One integer per physical GPU (node, GPU index); the sentinel row gets -1. The owner-spread
        # rule and GPU-level consolidation work on GPUs, not on units (MIG instances share a GPU).
        gpu_keys: dict[tuple[int, int], int] = {}
        self.unit_gpu_id: I64 = np.array([gpu_keys.setdefault((x.node, x.gpu_index), len(gpu_keys)) for x in us]
                                         + [-1], dtype=np.int64)
        self.n_gpus = len(gpu_keys)
        self.gpu_cap: I64 = np.bincount(self.unit_gpu_id[:u], weights=self.unit_cap[:u],
                                        minlength=self.n_gpus).astype(np.int64)
        if np.any(self.unit_free[:u] > self.unit_cap[:u]) or np.any(self.unit_free[:u] < 0):
            raise PackingError("unit free slices outside 0..capacity")
        self.n_units = u
        self.node_units: I64 = np.full((n, self.width), u, dtype=np.int64)
        self.unit_pos: I64 = np.zeros(u + 1, dtype=np.int64)
        fill = np.zeros(n, dtype=np.int64)
        for i, x in enumerate(us):
            self.node_units[x.node, fill[x.node]] = i
            self.unit_pos[i] = fill[x.node]
            fill[x.node] += 1
        # Static per-position views (kind and capacity never change while the state lives).
        self.kind_m: I64 = self.unit_kind[self.node_units]
        self.cap_m: I64 = self.unit_cap[self.node_units]
        self.mem_m: I64 = self.unit_mem[self.node_units]
        self.node_gpus: I64 = per_node.astype(np.int64)
        self.node_slice_cap: I64 = self.cap_m.sum(axis=1) if u else np.zeros(n, dtype=np.int64)
        self.max_node_cpu = int(self.node_cpu_cap.max()) if n else 1
        self.max_node_slices = int(self.node_slice_cap.max()) if n else 1
        self.max_node_gpus = int(self.node_gpus.max()) if n else 1
        self.total_slices = int(self.unit_cap[:u].sum())
        self.allocated_slices = int((self.unit_cap[:u] - self.unit_free[:u]).sum())
        self._owners: dict[str, dict[int, int]] = {}  # owner -> GPU id -> pods of that owner on it
        self._product_masks: dict[frozenset[str] | None, B] = {}

    # ----- views ---------------------------------------------------------------------------
    @property
    def n_nodes(self) -> int:
        return len(self.node_names)

    def free_matrix(self) -> I64:
        """Free slices per (node, position); usable units only, padding -1, unusable 0."""
        free = np.where(self.unit_usable, self.unit_free, np.minimum(self.unit_free, 0))
        return free[self.node_units]

    def product_mask(self, products: frozenset[str] | None) -> B:
        """Nodes whose GPU product is allowed (N-long)."""
        mask = self._product_masks.get(products)
        if mask is None:
            if products is None:
                mask = np.ones(self.n_nodes, dtype=bool)
            else:
                ids = [self.product_index[p] for p in products if p in self.product_index]
                mask = np.isin(self.node_product, np.array(ids, dtype=np.int64))
            self._product_masks[products] = mask
        return mask

    def owner_gpus(self, owner: str) -> list[int]:
        """GPU ids (``unit_gpu_id``) already holding a pod of ``owner`` (for the owner-spread rule)."""
        return [g for g, c in self._owners.get(owner, {}).items() if c > 0]

    def owner_units(self, owner: str) -> list[int]:
        """Units on a GPU that already holds a pod of ``owner``: the owner-spread rule refuses them all
        (DESIGN 4: never two pods of one owner on one GPU, so not on two MIG instances of it either)."""
        gpus = self.owner_gpus(owner)
        if not gpus:
            return []
        return np.flatnonzero(np.isin(self.unit_gpu_id[: self.n_units], np.array(gpus, dtype=np.int64))).tolist()

    def gpu_used_slices(self) -> I64:
        """Allocated slices per GPU id (length ``n_gpus``)."""
        n = self.n_units
        used = (self.unit_cap[:n] - self.unit_free[:n]).astype(np.int64)
        return np.bincount(self.unit_gpu_id[:n], weights=used, minlength=self.n_gpus).astype(np.int64)

    # ----- feasibility ----------------------------------------------------------------------
    def unit_accepts(self, req: PackRequest, *, memory_tolerance: float = 0.03) -> B:
        """Units (length n_units + 1, sentinel False) a request's per-GPU part could go on."""
        k = req.slices
        kind = self.unit_kind
        if req.gpus <= 1:
            ok = self.unit_usable & (self.unit_free >= k) & ((kind == KIND_MPS) | (self.unit_cap == k))
        else:
            multi_kind = (kind == KIND_WHOLE) | ((kind == KIND_MPS) & self.allow_mps_multi)
            ok = self.unit_usable & multi_kind & (self.unit_cap == k) & (self.unit_free == k)
        if req.isolation == "mig":
            ok &= kind == KIND_MIG
        elif req.isolation == "mps":
            ok &= kind == KIND_MPS
        if req.gpu_memory_mib > 0:
            cap = np.maximum(self.unit_cap, 1)
            # k/S of the GPU floored to whole MiB, exactly as gpuslice.placement computes it.
            share = np.where(kind == KIND_MPS, (self.unit_mem * k) // cap, self.unit_mem)
            ok &= share >= req.gpu_memory_mib * (1.0 - memory_tolerance)
        if req.owner:
            taken = self.owner_units(req.owner)
            if taken:
                ok = ok.copy()
                ok[np.array(taken, dtype=np.int64)] = False
        return np.asarray(ok, dtype=bool)

    def fit(self, req: PackRequest, *, memory_tolerance: float = 0.03) -> Fit:
        """kube-scheduler's CPU/RAM fit, the product affinity and the GPU fit, per node."""
        cpu = self.node_cpu_free >= req.cpu_milli
        mem = self.node_mem_free >= req.memory_mib
        if req.gpus == 0:
            ones = np.ones(self.n_nodes, dtype=bool)
            return Fit(cpu, mem, ones, ones)
        prod = self.product_mask(req.products)
        ok = self.unit_accepts(req, memory_tolerance=memory_tolerance)
        okm = ok[self.node_units]
        gpu = np.asarray(okm.any(axis=1) if req.gpus == 1 else okm.sum(axis=1) >= req.gpus, dtype=bool)
        return Fit(cpu, mem, prod, gpu, ok)

    # ----- mutation -------------------------------------------------------------------------
    def take(self, node: int, units: Sequence[int], slices: int, cpu_milli: int, memory_mib: int,
             owner: str = "") -> None:
        """Apply a placement in place (no checks beyond non-negativity: callers place candidates)."""
        self._apply(node, units, slices, cpu_milli, memory_mib, owner, +1)

    def give_back(self, node: int, units: Sequence[int], slices: int, cpu_milli: int, memory_mib: int,
                  owner: str = "") -> None:
        """Undo :meth:`take` (a departure or an expired reservation)."""
        self._apply(node, units, slices, cpu_milli, memory_mib, owner, -1)

    def _apply(self, node: int, units: Sequence[int], slices: int, cpu_milli: int, memory_mib: int,
               owner: str, sign: int) -> None:
        for u in units:
            if self.unit_node[u] != node:
                raise PackingError(f"unit {u} is not on node {node}")
            newfree = int(self.unit_free[u]) - sign * slices
            if newfree < 0 or newfree > int(self.unit_cap[u]):
                raise PackingError(f"unit {u}: free would become {newfree}")
            self.unit_free[u] = newfree
            if owner:
                d = self._owners.setdefault(owner, {})
                g = int(self.unit_gpu_id[u])
                d[g] = d.get(g, 0) + sign
        self.node_cpu_free[node] -= sign * cpu_milli
        self.node_mem_free[node] -= sign * memory_mib
        self.allocated_slices += sign * slices * len(units)
        if units:
            cls = 0 if (len(units) == 1 and slices < int(self.unit_cap[units[0]])) else min(
                len(units), POD_CLASSES - 1)
            self.node_classes[node, cls] += sign
        self.node_version[node] += 1


def enumerate_candidates(state: ClusterState, req: PackRequest, fit: Fit | None = None,
                         node_mask: B | None = None) -> Candidates:
    """Every feasible placement, ordered by (node, position).

    Single-GPU requests: one candidate per accepting unit. m-GPU requests: one per node, its first
    m accepting units (the research simulator's rule). CPU-only requests: one per node, no units.
    """
    if fit is None:
        fit = state.fit(req)
    mask = fit.feasible if node_mask is None else fit.feasible & node_mask
    w = state.width
    if req.gpus == 0:
        nodes = np.flatnonzero(mask).astype(np.int64)
        return Candidates(nodes, np.zeros((nodes.shape[0], 0), dtype=np.int64), nodes * w)
    okm = fit.unit_ok[state.node_units] & mask[:, None]
    if req.gpus == 1:
        nodes, pos = np.nonzero(okm)
        nodes = nodes.astype(np.int64)
        pos = pos.astype(np.int64)
        return Candidates(nodes, state.node_units[nodes, pos][:, None], nodes * w + pos)
    nodes = np.flatnonzero(okm.sum(axis=1) >= req.gpus).astype(np.int64)
    sub = okm[nodes]
    rank = np.cumsum(sub, axis=1)
    pick = sub & (rank <= req.gpus)
    rows, pos = np.nonzero(pick)
    units = state.node_units[nodes[rows], pos].reshape(nodes.shape[0], req.gpus)
    first = pos.reshape(nodes.shape[0], req.gpus)[:, 0] if nodes.shape[0] else np.zeros(0, dtype=np.int64)
    return Candidates(nodes, units.astype(np.int64), nodes * w + first.astype(np.int64))
