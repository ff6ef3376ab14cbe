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
position) to a unit row, padding with -1: every unit array is ``n_units + 1`` long and ends with a
sentinel row (free -1, capacity 0, kind NONE), so index -1 reads the sentinel and per-node
reductions are plain numpy over an N x width matrix with no Python loop over nodes. A fixed padding
value means appending units never rewrites other nodes' positions.

Arrays grow in place with spare room (amortised doubling, :meth:`ClusterState._room`), so a node
joining a live cluster of thousands costs a few small writes, not a copy of every array.

The state is mutable on purpose: the simulator and the extender's bookkeeping apply and release
placements in place and bump ``node_version`` so cached per-node values (policies) know what changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import numpy as np
from numpy.typing import NDArray

from gpuslice.packing.errors import PackingError
from gpuslice.rules import DEFAULT_MEMORY_TOLERANCE, memory_floor_met, mps_share_mib

I64 = NDArray[np.int64]
F64 = NDArray[np.float64]
B = NDArray[np.bool_]



#: Unit arrays and their sentinel values (the last row of each).
_UNIT_SENTINELS: tuple[tuple[str, object], ...] = (
    ("unit_node", -1), ("unit_gpu_index", -1), ("unit_kind", 3), ("unit_cap", 0), ("unit_mem", 0),
    ("unit_free", -1), ("unit_usable", False), ("unit_gpu_id", -1), ("unit_pos", 0))
#: Per-position matrices, the unit values they copy, and their padding values.
_POSITION_VIEWS: tuple[tuple[str, str, int], ...] = (
    ("kind_m", "unit_kind", 3), ("cap_m", "unit_cap", 0), ("mem_m", "unit_mem", 0))
#: Per-node arrays (1-D and N x something), in the order ``add_node`` fills a new row.
_NODE_ARRAYS = ("node_product", "node_cpu_cap", "node_mem_cap", "node_cpu_free", "node_mem_free", "node_cost",
                "node_version", "node_alive", "node_gpus", "node_slice_cap", "node_classes", "node_units",
                *(m for m, _, _ in _POSITION_VIEWS))
PAD = -1  # node_units padding: index -1 is the sentinel row of every unit array
_GENERATIONS = count(1)  # one number per state object ever built (id() is reused after a free)


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
                 allow_mps_multi: bool = False, memory_tolerance: float = DEFAULT_MEMORY_TOLERANCE) -> None:
        if slices_per_gpu < 1:
            raise PackingError(f"slices per GPU must be at least 1, got {slices_per_gpu}")
        if not 0 <= memory_tolerance < 1:
            raise PackingError(f"memory tolerance must be in [0, 1), got {memory_tolerance}")
        n = len(nodes)
        self.slices_per_gpu = slices_per_gpu
        self.memory_tolerance = memory_tolerance
        self.allow_mps_multi = allow_mps_multi
        self.node_names: list[str] = [x.name for x in nodes]  # lists: a live cluster appends
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
        self.unit_gpu: list[str] = [x.gpu or f"{self.node_names[x.node]}/gpu{x.gpu_index}" for x in us]
        self.unit_instance: list[str] = [x.instance for x in us]
        # One integer per physical GPU (node, GPU index); the sentinel row gets -1. The owner-spread
        # rule and GPU-level consolidation work on GPUs, not on units (MIG instances share a GPU).
        gpu_keys: dict[tuple[int, int], int] = {}
        self.unit_gpu_id: I64 = np.array([gpu_keys.setdefault((x.node, x.gpu_index), len(gpu_keys)) for x in us]
                                         + [-1], dtype=np.int64)
        self.n_gpus = len(gpu_keys)
        if np.any(self.unit_free[:u] > self.unit_cap[:u]) or np.any(self.unit_free[:u] < 0):
            raise PackingError("unit free slices outside 0..capacity")
        self.n_units = u
        self.node_units: I64 = np.full((n, self.width), PAD, dtype=np.int64)
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
        # Structure changes (a node added, removed or re-laid out) bump this; caches keyed by node
        # row, unit row or slot compare it, as they compare ``node_version`` for usage changes.
        self.layout_version = 0
        # Any change at all (usage, capacity, health, owners, prices, layout) bumps this, so a
        # decision computed at one value holds while it is unchanged (the scheduler's pod cycle).
        self.changes = 0
        # Which state object a cache was built for: unlike id(), never reused by a later state.
        self.generation = next(_GENERATIONS)
        self.node_alive: B = np.ones(n, dtype=bool)
        self.dead_units = 0
        self._base: dict[str, NDArray[Any]] = {}  # array name -> its buffer with spare room
        # Room for a quarter more nodes and units up front: nodes joining a live cluster then
        # cost no copy until many have joined (growth is by half again, amortised).
        for name in _NODE_ARRAYS:
            self._room(name, n, spare=n // 4 + 16)
        for name, _ in _UNIT_SENTINELS:
            self._room(name, u + 1, spare=u // 4 + 128)

    def _room(self, name: str, length: int, spare: int = 0) -> NDArray[Any]:
        """The array ``name`` as ``length`` rows (rows past its current length are uninitialised):
        a view of a buffer grown by half when full, so appending one node copies nothing usually."""
        cur: NDArray[Any] = getattr(self, name)
        base = self._base.get(name)
        if base is None or cur.base is not base or base.shape[0] < length:
            rows = max(length + spare, cur.shape[0] + cur.shape[0] // 2 + 16)
            base = np.empty((rows, *cur.shape[1:]), dtype=cur.dtype)
            base[: cur.shape[0]] = cur
            self._base[name] = base
        view = base[:length]
        setattr(self, name, view)
        return view

    # ----- views ---------------------------------------------------------------------------
    @property
    def n_nodes(self) -> int:
        return len(self.node_names)

    def free_matrix(self) -> I64:
        """Free slices per (node, position); usable units only, padding -1, unusable 0."""
        free = np.where(self.unit_usable, self.unit_free, np.minimum(self.unit_free, 0))
        return free[self.node_units]

    def node_free_slices(self) -> I64:
        """Free slices per node, usable units only (what every per-node packing term counts)."""
        return np.asarray(np.maximum(self.free_matrix(), 0).sum(axis=1), dtype=np.int64)

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

    def owner_held(self, owner: str) -> B | None:
        """Per GPU id, whether it already holds a pod of ``owner`` (None if none does), for the
        owner-spread rule; one entry more than there are GPUs, False, which the sentinel's and
        padding's GPU id -1 reads, so the mask can be indexed by ``unit_gpu_id`` directly."""
        gpus = [g for g, c in self._owners.get(owner, {}).items() if c > 0]
        if not gpus:
            return None
        held = np.zeros(self.n_gpus + 1, dtype=bool)
        held[gpus] = True
        return held

    def owner_units(self, owner: str) -> list[int]:
        """Units on a GPU that already holds a pod of ``owner``: the owner-spread rule refuses them all
        (DESIGN 4: never two pods of one owner on one GPU, so not on two MIG instances of it either)."""
        held = self.owner_held(owner)
        if held is None:
            return []
        return np.flatnonzero(held[self.unit_gpu_id[: self.n_units]]).tolist()

    # ----- feasibility ----------------------------------------------------------------------
    def unit_accepts(self, req: PackRequest, rows: I64 | None = None, *, as_if_empty: bool = False) -> B:
        """Units (length n_units + 1, sentinel False) a request's per-GPU part could go on; with
        ``rows`` (unit rows, the sentinel allowed), only those, in that order. ``as_if_empty``: whether
        it could go there once every pod left the unit (preemption; the owner rule is then the
        caller's, who knows which pods would leave)."""
        k = req.slices
        at: slice | I64 = slice(None) if rows is None else rows
        kind, cap, free = self.unit_kind[at], self.unit_cap[at], self.unit_free[at]
        if as_if_empty:
            free = cap
        usable, mem = self.unit_usable[at], self.unit_mem[at]
        if req.gpus <= 1:
            ok = usable & (free >= k) & ((kind == KIND_MPS) | (cap == k))
        else:
            multi_kind = (kind == KIND_WHOLE) | ((kind == KIND_MPS) & self.allow_mps_multi)
            ok = usable & multi_kind & (cap == k) & (free == k)
        if req.isolation == "mig":
            ok &= kind == KIND_MIG
        elif req.isolation == "mps":
            ok &= kind == KIND_MPS
        if req.gpu_memory_mib > 0:
            share = np.where(kind == KIND_MPS, mps_share_mib(mem, k, cap), mem)
            ok &= np.asarray(memory_floor_met(share, req.gpu_memory_mib, self.memory_tolerance), dtype=bool)
        if req.owner and not as_if_empty:
            held = self.owner_held(req.owner)
            if held is not None:
                ok &= ~held[self.unit_gpu_id[at]]
        return np.asarray(ok, dtype=bool)

    def fit(self, req: PackRequest) -> Fit:
        """kube-scheduler's CPU/RAM fit, the product affinity and the GPU fit, per node."""
        cpu = (self.node_cpu_free >= req.cpu_milli) & self.node_alive
        mem = (self.node_mem_free >= req.memory_mib) & self.node_alive
        if req.gpus == 0:
            ones = np.ones(self.n_nodes, dtype=bool)
            return Fit(cpu, mem, ones, ones)
        prod = self.product_mask(req.products)
        ok = self.unit_accepts(req)
        okm = ok[self.node_units]
        gpu = np.asarray(okm.any(axis=1) if req.gpus == 1 else okm.sum(axis=1) >= req.gpus, dtype=bool)
        return Fit(cpu, mem, prod, gpu, ok)

    # ----- structure: a live cluster changes shape one node at a time ---------------------------
    def add_node(self, spec: NodeSpec, units: Sequence[UnitSpec]) -> int:
        """Append a node and its units (their ``node`` field is ignored); returns the node's row.

        Arrays grow in place into their spare room, so the cost does not depend on the cluster's
        size (except when the room runs out); rows of other nodes and units never move.
        """
        if spec.name in self.node_index:
            raise PackingError(f"node {spec.name} is already in the state")
        v = self.n_nodes
        self.node_names.append(spec.name)
        self.node_index[spec.name] = v
        if spec.product not in self.product_index:
            self.products = (*self.products, spec.product)
            self.product_index[spec.product] = len(self.products) - 1
        self._product_masks = {}
        values = (self.product_index[spec.product], spec.cpu_milli, spec.memory_mib, spec.cpu_milli, spec.memory_mib,
                  spec.cost_per_hour, 0, True, 0, 0, 0, PAD, *(pad for _, _, pad in _POSITION_VIEWS))
        for name, value in zip(_NODE_ARRAYS, values, strict=True):
            self._room(name, v + 1)[v] = value
        self._append_units(v, units)
        self.max_node_cpu = max(self.max_node_cpu, spec.cpu_milli)
        return v

    def remove_node(self, v: int) -> None:
        """Take a node out: it never fits again and its units stop counting. Its row stays (rows
        never move); callers release what pods hold there first, so owner counts stay right."""
        self._check_node(v)
        self._detach_units(v)
        del self.node_index[self.node_names[v]]
        self.node_alive[v] = False
        self.node_cpu_cap[v] = self.node_mem_cap[v] = 0
        self.node_cpu_free[v] = self.node_mem_free[v] = -1
        self.node_classes[v] = 0
        self._touched(v)
        self.layout_version += 1
        self._refresh_maxima()

    def _refresh_maxima(self) -> None:
        """The largest live node's CPU, slices and GPUs (policies scale by them), as a fresh build has."""
        alive = self.node_alive
        self.max_node_cpu = int(self.node_cpu_cap[alive].max()) if alive.any() else 1
        self.max_node_slices = int(self.node_slice_cap[alive].max()) if alive.any() else 1
        self.max_node_gpus = int(self.node_gpus[alive].max()) if alive.any() else 1

    def replace_units(self, v: int, units: Sequence[UnitSpec]) -> None:
        """A node's GPU layout changed (GPUs, modes, S or MIG instances): its old unit rows are
        retired and new ones appended. Usage on them is the caller's to re-apply."""
        self._check_node(v)
        self._detach_units(v)
        self._append_units(v, units)
        self._refresh_maxima()

    def set_node_resources(self, v: int, cpu_milli: int, memory_mib: int) -> None:
        """New allocatable CPU and memory; what pods use there is kept."""
        self._check_node(v)
        self.node_cpu_free[v] += cpu_milli - int(self.node_cpu_cap[v])
        self.node_mem_free[v] += memory_mib - int(self.node_mem_cap[v])
        self.node_cpu_cap[v], self.node_mem_cap[v] = cpu_milli, memory_mib
        self._refresh_maxima()
        self._touched(v)

    def set_node_product(self, v: int, product: str) -> None:
        self._check_node(v)
        if product not in self.product_index:
            self.products = (*self.products, product)
            self.product_index[product] = len(self.products) - 1
        self.node_product[v] = self.product_index[product]
        self._product_masks = {}
        self._touched(v)

    def set_node_cost(self, v: int, cost_per_hour: float) -> None:
        """The node's price now (list price, or the live one from OpenCost)."""
        if float(self.node_cost[v]) != cost_per_hour:
            self.node_cost[v] = cost_per_hour
            self.changes += 1

    def set_units_usable(self, rows: Sequence[int], usable: Sequence[bool]) -> None:
        """Health or cordon of units changed in place (same layout)."""
        if not rows:
            return
        r = np.asarray(rows, dtype=np.int64)
        if np.any((r < 0) | (r >= self.n_units)):
            raise PackingError("unit row out of range")
        self.unit_usable[r] = np.asarray(usable, dtype=bool)
        self._touched(np.unique(self.unit_node[r]))

    def set_node_usage(self, v: int, rows: Sequence[int], free: Sequence[int], cpu_used: int, memory_used: int,
                       classes: Sequence[int]) -> None:
        """Set what is in use on one node in place: free slices of its units, CPU and memory used,
        pods per class. The live view computes these from the counting rule; owners are adjusted
        separately (:meth:`adjust_owner`)."""
        self._check_node(v)
        if rows:
            r = np.asarray(rows, dtype=np.int64)
            f = np.asarray(free, dtype=np.int64)
            if np.any(self.unit_node[r] != v):
                raise PackingError(f"units not on node {v}")
            if np.any(f < 0) or np.any(f > self.unit_cap[r]):
                raise PackingError("unit free slices outside 0..capacity")
            self.allocated_slices += int((self.unit_free[r] - f).sum())
            self.unit_free[r] = f
        self.node_cpu_free[v] = int(self.node_cpu_cap[v]) - cpu_used
        self.node_mem_free[v] = int(self.node_mem_cap[v]) - memory_used
        self.node_classes[v] = np.asarray(classes, dtype=np.int64)
        self._touched(v)

    def adjust_owner(self, owner: str, gpu_id: int, delta: int) -> None:
        """Pods of ``owner`` on GPU ``gpu_id`` changed by ``delta`` (the owner-spread bookkeeping)."""
        self.changes += 1
        d = self._owners.setdefault(owner, {})
        c = d.get(gpu_id, 0) + delta
        if c < 0:
            raise PackingError(f"owner {owner} would hold {c} pods on GPU {gpu_id}")
        if c:
            d[gpu_id] = c
        else:
            d.pop(gpu_id, None)
            if not d:
                del self._owners[owner]

    def node_rows(self, v: int) -> I64:
        """Unit rows of node ``v`` in position order."""
        row: I64 = self.node_units[v]
        return np.asarray(row[row >= 0], dtype=np.int64)

    def _check_node(self, v: int) -> None:
        if not 0 <= v < self.n_nodes or not self.node_alive[v]:
            raise PackingError(f"no live node at row {v}")

    def _detach_units(self, v: int) -> None:
        rows = self.node_rows(v)
        if rows.shape[0]:
            self.allocated_slices -= int((self.unit_cap[rows] - self.unit_free[rows]).sum())
            self.total_slices -= int(self.unit_cap[rows].sum())
            self.unit_usable[rows] = False
            self.unit_free[rows] = self.unit_cap[rows]
            self.dead_units += int(rows.shape[0])
        self.node_units[v] = PAD
        self.node_gpus[v] = 0
        self.node_slice_cap[v] = 0
        self._refresh_views(v)
        self._touched(v)
        self.layout_version += 1

    def _append_units(self, v: int, units: Sequence[UnitSpec]) -> None:
        us = sorted(units, key=lambda x: x.gpu_index)
        for x in us:
            if x.kind not in (KIND_MPS, KIND_WHOLE, KIND_MIG) or x.capacity < 1:
                raise PackingError(f"bad unit {x}")
            if (x.free if x.free is not None else x.capacity) not in range(x.capacity + 1):
                raise PackingError("unit free slices outside 0..capacity")
        k = len(us)
        old = self.n_units
        new_sentinel = old + k
        if k:
            gpu_ids: dict[int, int] = {}
            for x in us:
                gpu_ids.setdefault(x.gpu_index, self.n_gpus + len(gpu_ids))
            values: dict[str, list[Any]] = {
                "unit_node": [v] * k, "unit_gpu_index": [x.gpu_index for x in us], "unit_kind": [x.kind for x in us],
                "unit_cap": [x.capacity for x in us], "unit_mem": [x.memory_mib for x in us],
                "unit_free": [x.capacity if x.free is None else x.free for x in us],
                "unit_usable": [x.usable for x in us], "unit_gpu_id": [gpu_ids[x.gpu_index] for x in us],
                "unit_pos": list(range(k))}
            for arr, sentinel in _UNIT_SENTINELS:
                view = self._room(arr, new_sentinel + 1)
                view[old:new_sentinel] = values[arr]  # over the old sentinel row
                view[new_sentinel] = sentinel
            name = self.node_names[v]
            self.unit_gpu.extend(x.gpu or f"{name}/gpu{x.gpu_index}" for x in us)
            self.unit_instance.extend(x.instance for x in us)
            self.n_gpus += len(gpu_ids)
            if k > self.width:
                self.node_units = np.hstack([self.node_units,
                                             np.full((self.n_nodes, k - self.width), PAD, dtype=np.int64)])
                for m, _, pad in _POSITION_VIEWS:
                    setattr(self, m, np.hstack([getattr(self, m),
                                                np.full((self.n_nodes, k - self.width), pad, dtype=np.int64)]))
                self.width = k
            self.node_units[v, :k] = np.arange(old, new_sentinel, dtype=np.int64)
            self.n_units = new_sentinel
            caps_new = np.array([x.capacity for x in us], dtype=np.int64)
            free_new = np.array([x.capacity if x.free is None else x.free for x in us], dtype=np.int64)
            self.total_slices += int(caps_new.sum())
            self.allocated_slices += int((caps_new - free_new).sum())
        self.node_gpus[v] = k  # positions, as the constructor counts them
        self.node_slice_cap[v] = sum(x.capacity for x in us)
        self.max_node_slices = max(self.max_node_slices, int(self.node_slice_cap[v]))
        self.max_node_gpus = max(self.max_node_gpus, k)
        self._refresh_views(v)
        self._touched(v)
        self.layout_version += 1

    def _touched(self, nodes: int | I64) -> None:
        """Node(s) ``nodes`` changed: their cached per-node values and any whole-state decision are stale."""
        self.node_version[nodes] += 1
        self.changes += 1

    def _refresh_views(self, v: int) -> None:
        """Node ``v``'s row of the per-position matrices, after its positions changed."""
        row = self.node_units[v]
        for m, unit_arr, _ in _POSITION_VIEWS:
            getattr(self, m)[v] = getattr(self, unit_arr)[row]

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
        self._touched(node)


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
