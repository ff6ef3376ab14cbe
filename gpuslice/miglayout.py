"""MIG layouts that follow demand: which free placement slots of which GPUs to re-cut into which profiles.

The one owner of the decision (DESIGN 2 and 4). With MIG mode on, GPU instances can be created and
destroyed in free placement slots while the other instances of the GPU keep running; this module
says when and where, for the products the config opts in (``migLayouts.<product>.dynamic``). The
extender publishes what it decides (:mod:`gpuslice.layoutwire`), the device plugin applies it, the
simulator applies it to its array state; all three call the functions here.

Safety, the rule before any other: an instance that holds or is reserved for a pod (``busy``) is
never destroyed; a re-cut only destroys free instances and creates new ones in memory slices that
are free after that, and every resulting layout is checked by the catalogue's one layout rule
(:func:`gpuslice.model.validate_mig_layout`: legal starts, no overlap, compute and count limits, one
``+me``). Media-extension profiles are never created (no pod can ask for one).

Two triggers, each with its measure:

* **A Pending pod refused for shape** (no free instance of its size, memory floor and isolation on any
  node it may run on): :meth:`LayoutPlanner.for_pending` looks for a GPU whose free slots can hold an
  instance of a profile that fits the pod. Among those it takes the one that least raises FGD's
  expected fragment *under dynamic layouts* (:func:`dynamic_fragment`: for each learned pod shape,
  the GPU's idle compute slices that no re-cut of its free slots could give to pods of that shape),
  then a GPU already in use (bin packing keeps idle GPUs idle), then the fewest instances destroyed,
  then the consistent node order. The rest of the freed slots is filled with the instances that
  best serve the learned demand without a wait (the static measure below), so later pods of common
  sizes find an instance ready.
* **The expected fit rises by more than a margin** (:meth:`LayoutPlanner.proactive`): FGD's expected
  fragment with the GPU's existing instances as units, as ``fragmentation`` counts MIG units
  (:func:`static_fragment`: for each learned shape, the free instances that cannot take it, plus
  compute slices no instance covers), weighted by the shapes' share of the pods seen. A GPU's free
  slots are re-cut to the layout that lowers it most when that lowers it by more than
  :data:`DEFAULT_MARGIN` slices. A re-cut made moves the GPU to a layout the same measure ranks best,
  so the reverse re-cut would raise it by as much: layouts do not flap while the demand holds, and the
  demand is re-read only when the pods seen double (as the policy re-reads its target).

And one order: which free instance of a size a pod takes decides which placements stay possible on
its GPU (a 1g at memory slice 2 breaks both halves a 3g or 4g could use). The policies see instances
as units and tie such choices; :meth:`LayoutPlanner.instance_order` breaks the tie by the dynamic
measure (``Scheduler.instance_order``), so the extender and the simulator pick the same instance.

The learned demand is a :class:`gpuslice.packing.frag.TargetWorkload` (the slice-model rule: size,
memory floor, isolation, products), fed one pod at a time by :meth:`LayoutPlanner.observe`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from gpuslice.catalogue import PRODUCTS, MigProfile, Product, product
from gpuslice.decision import node_key
from gpuslice.errors import CatalogueError
from gpuslice.model import Gpu, MigInstance, validate_mig_layout
from gpuslice.packing.frag import TargetWorkload
from gpuslice.packing.state import KIND_MIG, Candidates, ClusterState, PackRequest
from gpuslice.rules import DEFAULT_MEMORY_TOLERANCE, isolation_allows, memory_fits

if TYPE_CHECKING:
    from gpuslice.view import ClusterView

#: A re-cut made only to raise the expected fit must lower FGD's expected fragment of its GPU by more
#: than this many compute slices (of 7, or 4 on A30): one slice is the smallest unit a pod can take, so
#: a smaller gain is within what one pod's arrival moves, and re-cutting for it would chase noise.
DEFAULT_MARGIN = 1.0

Slot = tuple[str, int]
"""A MIG instance's place: (profile name, memory-slice start), e.g. ``("3g.40gb", 4)``."""


@dataclass(frozen=True, slots=True)
class Held:
    """One existing instance as the planner sees it; ``busy``: it holds or is reserved for a pod."""

    profile: str
    start: int
    key: str
    busy: bool

    @property
    def slot(self) -> Slot:
        return (self.profile, self.start)


@dataclass(frozen=True, slots=True)
class GpuLayout:
    """One MIG GPU of a product with dynamic layouts: where it is and what instances it has."""

    node: str
    node_row: int
    gpu: str
    gpu_index: int
    gpu_id: int
    product: str
    instances: tuple[Held, ...]

    @property
    def busy(self) -> tuple[Slot, ...]:
        return tuple(sorted(h.slot for h in self.instances if h.busy))

    @property
    def in_use(self) -> bool:
        return any(h.busy for h in self.instances)


@dataclass(frozen=True, slots=True)
class Recut:
    """A decided re-cut of one GPU: destroy ``destroy`` (instance keys, all free), create ``create``.

    ``wanted`` is the GPU's whole layout afterwards (what the extender publishes); ``pod`` the UID of
    the Pending pod it is for ("" for a re-cut that raises the expected fit) and ``target`` the new
    instance that pod is to get; ``gain``: how much it lowers the GPU's expected fragment (slices)."""

    node: str
    gpu: str
    gpu_index: int
    product: str
    destroy: tuple[str, ...]
    create: tuple[Slot, ...]
    wanted: tuple[Slot, ...]
    pod: str = ""
    target: Slot | None = None
    gain: float = 0.0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class DemandShape:
    """A learned single-GPU pod shape that a MIG instance could take, with its share of the pods seen."""

    weight: float
    slices: int
    memory_mib: int
    isolation: str
    products: frozenset[str] | None


# ----- geometry (cached per product; the catalogue's rule decides every layout) -------------------

def _prod(name: str) -> Product:
    return product(name)


@functools.lru_cache(maxsize=65536)
def legal(product_name: str, layout: tuple[Slot, ...]) -> bool:
    """Whether a set of instances is a legal layout of the product (the catalogue's one rule)."""
    prod = _prod(product_name)
    try:
        insts = [MigInstance(f"MIG-{n}", p, s, prod.profile(p).compute_slices, prod.profile(p).memory_mib)
                 for n, (p, s) in enumerate(layout)]
        validate_mig_layout(product_name, insts, where="layout")
    except CatalogueError:
        return False
    return True


def _mask(product_name: str, layout: Iterable[Slot]) -> int:
    m = 0
    for p, s in layout:
        m |= _slot_mask(product_name, p, s)
    return m


@functools.lru_cache(maxsize=4096)
def _slot_mask(product_name: str, profile: str, start: int) -> int:
    m = 0
    for i in _prod(product_name).profile(profile).covers(start):
        m |= 1 << i
    return m


@functools.lru_cache(maxsize=64)
def creatable(product_name: str) -> tuple[MigProfile, ...]:
    """The profiles a re-cut may create: every profile but media extensions (no pod asks for one)."""
    return tuple(p for p in _prod(product_name).mig_profiles if not p.name.endswith("+me"))


@functools.lru_cache(maxsize=65536)
def fills(product_name: str, kept: tuple[Slot, ...], profiles: tuple[str, ...] | None = None
          ) -> tuple[tuple[Slot, ...], ...]:
    """Every legal set of new instances (of ``profiles``, default :func:`creatable`) that ``kept``
    leaves room for, the empty set included; each set once, in start order."""
    prod = _prod(product_name)
    names = profiles if profiles is not None else tuple(p.name for p in creatable(product_name))
    options = [prod.profile(n) for n in names]
    used = _mask(product_name, kept)
    out: list[tuple[Slot, ...]] = []

    def walk(i: int, mask: int, chosen: tuple[Slot, ...]) -> None:
        while i < prod.memory_slices and mask >> i & 1:
            i += 1
        if i >= prod.memory_slices:
            if legal(product_name, tuple(sorted(kept + chosen))):
                out.append(chosen)
            return
        walk(i + 1, mask | (1 << i), chosen)  # slice i stays without an instance
        for prof in options:
            if i not in prof.starts:
                continue
            cover = _mask(product_name, [(prof.name, i)])
            if cover & mask:
                continue
            nxt = (*chosen, (prof.name, i))
            if legal(product_name, tuple(sorted(kept + nxt))):
                walk(i + 1, mask | cover, nxt)

    walk(0, used, ())
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def most_instances(product_name: str, kept: tuple[Slot, ...], profiles: tuple[str, ...]) -> int:
    """The most instances of ``profiles`` a re-cut could add beside ``kept`` (0 when none fits)."""
    if not profiles:
        return 0
    return max(len(f) for f in fills(product_name, kept, profiles))


@functools.lru_cache(maxsize=65536)
def accepting(product_name: str, shape: DemandShape, tolerance: float) -> tuple[str, ...]:
    """The creatable profiles of the product that a pod of ``shape`` may be given."""
    if shape.products is not None and product_name not in shape.products:
        return ()
    if not isolation_allows("mig", shape.isolation):
        return ()
    floor = float(shape.memory_mib) if shape.memory_mib else None
    return tuple(p.name for p in creatable(product_name)
                 if p.compute_slices == shape.slices and memory_fits(p.memory_mib, floor, tolerance))


def _compute(product_name: str, layout: Iterable[Slot]) -> int:
    prod = _prod(product_name)
    return sum(prod.profile(p).compute_slices for p, _ in layout)


# ----- the two measures --------------------------------------------------------------------------

@functools.lru_cache(maxsize=1 << 16)
def dynamic_fragment(product_name: str, busy: tuple[Slot, ...], shapes: tuple[DemandShape, ...],
                     tolerance: float = DEFAULT_MEMORY_TOLERANCE) -> float:
    """FGD's expected fragment of a GPU whose free slots may be re-cut: per shape, the idle compute
    slices no re-cut could give to pods of that shape, weighted by the shape's share of the pods."""
    idle = _prod(product_name).compute_slices - _compute(product_name, busy)
    if idle <= 0:
        return 0.0
    total = 0.0
    for s in shapes:
        profs = accepting(product_name, s, tolerance)
        usable = s.slices * most_instances(product_name, busy, profs) if profs else 0
        total += s.weight * (idle - min(idle, usable))
    return total


def static_fragment(product_name: str, layout: Sequence[Held] | Sequence[tuple[Slot, bool]],
                    shapes: tuple[DemandShape, ...], tolerance: float = DEFAULT_MEMORY_TOLERANCE) -> float:
    """FGD's expected fragment of a GPU with its instances as units (``fragmentation``'s view of MIG):
    per shape, the free instances that cannot take it plus the compute slices no instance covers."""
    items = tuple(sorted((h.slot, h.busy) if isinstance(h, Held) else h for h in layout))
    return _static_fragment(product_name, items, shapes, tolerance)


@functools.lru_cache(maxsize=1 << 16)
def _static_fragment(product_name: str, items: tuple[tuple[Slot, bool], ...], shapes: tuple[DemandShape, ...],
                     tolerance: float) -> float:
    prod = _prod(product_name)
    stranded = prod.compute_slices - _compute(product_name, [s for s, _ in items])
    free = [s for s, b in items if not b]
    if stranded <= 0 and not free:
        return 0.0
    total = 0.0
    for s in shapes:
        ok = set(accepting(product_name, s, tolerance))
        frag = stranded + sum(prod.profile(p).compute_slices for p, _ in free if p not in ok)
        total += s.weight * frag
    return total


# ----- demand --------------------------------------------------------------------------------------

def demand_shapes(target: TargetWorkload) -> tuple[DemandShape, ...]:
    """The learned single-GPU shapes a MIG instance could take, CPU merged, by share of pods seen."""
    if target.seen == 0:
        return ()
    merged: dict[tuple[int, int, str, frozenset[str] | None], int] = {}
    for (_cpu, k, gpus, prods, floor, iso), n in target.counts.items():
        if gpus != 1 or not isolation_allows("mig", iso):
            continue
        key = (k, floor, iso, prods)
        merged[key] = merged.get(key, 0) + n
    return tuple(DemandShape(n / target.seen, k, floor, iso, prods)
                 for (k, floor, iso, prods), n in sorted(merged.items(), key=lambda kv: (-kv[1], repr(kv[0]))))


# ----- reading a cluster -----------------------------------------------------------------------------

def slots_from_inventories(state: ClusterState, gpus: Mapping[str, Sequence[Gpu]]) -> dict[int, Slot]:
    """Unit row -> (profile, start) of every live MIG instance, from the nodes' inventories by name."""
    by_uuid: dict[tuple[str, str], Slot] = {}
    for name, node_gpus in gpus.items():
        for g in node_gpus:
            for inst in g.instances:
                by_uuid[(name, inst.uuid)] = (inst.profile, inst.start)
    out: dict[int, Slot] = {}
    for v in np.flatnonzero(state.node_alive).tolist():
        name = state.node_names[v]
        for u in state.node_rows(v).tolist():
            if int(state.unit_kind[u]) == KIND_MIG:
                slot = by_uuid.get((name, state.unit_instance[u]))
                if slot is not None:
                    out[u] = slot
    return out


def gpu_layouts(state: ClusterState, slots: Mapping[int, Slot], products: frozenset[str],
                nodes: NDArray[np.bool_] | None = None,
                cache: dict[int, tuple[int, int, list[GpuLayout]]] | None = None) -> list[GpuLayout]:
    """The MIG GPUs of ``products`` on live nodes (``nodes``: a node mask) whose every instance is
    usable (a sick or cordoned GPU is never re-cut), with each instance's busy flag. ``cache`` keeps
    each node's answer until its ``node_version`` moves (a re-cut or any usage change moves it)."""
    out: list[GpuLayout] = []
    if not products:
        return out
    alive = state.node_alive if nodes is None else state.node_alive & nodes
    prod_ids = {state.product_index[p] for p in products if p in state.product_index}
    keep = np.isin(state.node_product[: state.n_nodes], np.array(sorted(prod_ids), dtype=np.int64)) & alive
    for v in np.flatnonzero(keep).tolist():
        version = int(state.node_version[v])
        if cache is not None:
            hit = cache.get(v)
            if hit is not None and hit[0] == state.generation and hit[1] == version:
                out.extend(hit[2])
                continue
        found = _node_layouts(state, slots, v)
        if cache is not None:
            cache[v] = (state.generation, version, found)
        out.extend(found)
    return out


def _node_layouts(state: ClusterState, slots: Mapping[int, Slot], v: int) -> list[GpuLayout]:
    """One node's MIG GPUs (see :func:`gpu_layouts`); a GPU whose profiles its product lacks is skipped."""
    by_gpu: dict[int, list[int]] = {}
    for u in state.node_rows(v).tolist():
        if int(state.unit_kind[u]) == KIND_MIG:
            by_gpu.setdefault(int(state.unit_gpu_index[u]), []).append(u)
    name = state.node_names[v]
    prod = state.products[int(state.node_product[v])]
    known = {p.name for p in _prod(prod).mig_profiles} if prod in PRODUCTS else set()
    out: list[GpuLayout] = []
    for index, us in sorted(by_gpu.items()):
        if any(u not in slots or slots[u][0] not in known for u in us) or not all(
                bool(state.unit_usable[u]) for u in us):
            continue
        held = tuple(sorted((Held(slots[u][0], slots[u][1], state.unit_instance[u] or str(u),
                                  int(state.unit_free[u]) < int(state.unit_cap[u])) for u in us),
                            key=lambda h: h.start))
        out.append(GpuLayout(name, v, state.unit_gpu[us[0]], index, int(state.unit_gpu_id[us[0]]), prod, held))
    return out


# ----- the planner ---------------------------------------------------------------------------------------

@dataclass(slots=True)
class LayoutPlanner:
    """Decides re-cuts for the products in ``dynamic`` from the learned demand (see the module docstring)."""

    dynamic: frozenset[str]
    margin: float = DEFAULT_MARGIN
    memory_tolerance: float = DEFAULT_MEMORY_TOLERANCE
    target: TargetWorkload = field(default_factory=lambda: TargetWorkload(aware=True))
    _shapes: tuple[DemandShape, ...] = ()
    _read_at: int = 0
    _layouts: dict[int, tuple[int, int, list[GpuLayout]]] = field(default_factory=dict)

    def observe(self, req: PackRequest) -> None:
        """A pod arrived: the learned demand counts it (once per pod)."""
        self.target.observe(req)

    def shapes(self) -> tuple[DemandShape, ...]:
        """The published demand: re-read when the pods seen have doubled since the last read."""
        seen = self.target.seen
        if not self._shapes or seen >= 2 * self._read_at or (seen < 16 and seen != self._read_at):
            self._shapes = demand_shapes(self.target)
            self._read_at = seen
        return self._shapes

    def for_pending(self, state: ClusterState, slots: Mapping[int, Slot], req: PackRequest, *,
                    nodes: NDArray[np.bool_] | None = None, exclude: Iterable[str] = ()) -> Recut | None:
        """The re-cut that lets a pod refused for shape in, or None when no free slots of any GPU it may
        run on can hold an instance that fits it. ``nodes``: the node rows it may run on (None = all);
        ``exclude``: GPU UUIDs with a re-cut still in flight."""
        if not self.dynamic or req.gpus != 1 or not isolation_allows("mig", req.isolation):
            return None
        fit = state.fit(req)
        node_ok = fit.cpu & fit.memory & fit.product & state.node_alive
        if nodes is not None:
            node_ok = node_ok & nodes
        held_by_owner = state.owner_held(req.owner) if req.owner else None
        skip = set(exclude)
        shape = DemandShape(1.0, req.slices, req.gpu_memory_mib, req.isolation, req.products)
        demand = self.shapes()
        best: tuple[tuple[float, int, int, int, str], Recut] | None = None
        for g in gpu_layouts(state, slots, self.dynamic, node_ok, self._layouts):
            if g.gpu in skip or (held_by_owner is not None and bool(held_by_owner[g.gpu_id])):
                continue
            profs = accepting(g.product, shape, self.memory_tolerance)
            if not profs:
                continue
            busy = g.busy
            before = dynamic_fragment(g.product, busy, demand, self.memory_tolerance)
            for name in profs:
                prof = _prod(g.product).profile(name)
                for start in prof.starts:
                    option = self._option(g, prof, start)
                    if option is None:
                        continue
                    kept, destroy = option
                    after = dynamic_fragment(g.product, tuple(sorted((*busy, (name, start)))), demand,
                                             self.memory_tolerance)
                    key = (after - before, 0 if g.in_use else 1, len(destroy), node_key(g.node), g.gpu)
                    if best is not None and key >= best[0]:
                        continue
                    best = (key, self._build(g, kept, destroy, (name, start), req.uid, before - after, demand))
        return None if best is None else best[1]

    def _option(self, g: GpuLayout, prof: MigProfile, start: int) -> tuple[tuple[Held, ...], tuple[Held, ...]] | None:
        """Keep/destroy split for a new instance ``prof``@``start``: None when a busy instance is in the way
        or the layout would be illegal (compute or count limits)."""
        cover = _mask(g.product, [(prof.name, start)])
        kept: list[Held] = []
        destroy: list[Held] = []
        for h in g.instances:
            if _mask(g.product, [h.slot]) & cover:
                if h.busy:
                    return None
                destroy.append(h)
            else:
                kept.append(h)
        if not legal(g.product, tuple(sorted((*(h.slot for h in kept), (prof.name, start))))):
            return None
        return tuple(kept), tuple(destroy)

    def _build(self, g: GpuLayout, kept: tuple[Held, ...], destroy: tuple[Held, ...], target: Slot, pod: str,
               gain: float, demand: tuple[DemandShape, ...]) -> Recut:
        """The re-cut with the rest of the freed slots filled for the learned demand (static measure)."""
        base = tuple(sorted((*(h.slot for h in kept), target)))
        items: list[tuple[Slot, bool]] = [(h.slot, h.busy) for h in kept] + [(target, True)]
        best_fill: tuple[Slot, ...] = ()
        best_key: tuple[float, int] | None = None
        for fill in fills(g.product, base):
            key = (static_fragment(g.product, items + [(s, False) for s in fill], demand, self.memory_tolerance),
                   len(fill))
            if best_key is None or key < best_key:
                best_key, best_fill = key, fill
        create = tuple(sorted((target, *best_fill)))
        wanted = tuple(sorted((*(h.slot for h in kept), *create)))
        freed = f"after destroying {len(destroy)} free instance(s)" if destroy else "in slots no instance used"
        reason = f"a Pending pod fits {target[0]}@{target[1]}, made {freed}"
        return Recut(g.node, g.gpu, g.gpu_index, g.product, tuple(h.key for h in destroy), create, wanted, pod,
                     target, gain, reason)

    def instance_order(self, state: ClusterState, slots: Mapping[int, Slot], req: PackRequest,
                       cands: Candidates) -> NDArray[np.float64] | None:
        """Per candidate, higher first: minus the rise of its GPU's dynamic fragment when the pod takes
        that MIG instance (0 for other units). Which free instance of a size a pod takes decides which
        placements stay possible after it (a 1g at slice 2 breaks both halves a 3g or 4g could use), and
        the policy, which sees instances as units, ties them; ``Scheduler.rank`` breaks its ties with
        this. None when no candidate is a MIG instance of a dynamic product (static layouts)."""
        if not self.dynamic or req.gpus != 1 or len(cands) == 0:
            return None
        units = cands.units[:, 0]
        mig = np.flatnonzero(state.unit_kind[units] == KIND_MIG)
        if mig.shape[0] == 0:
            return None
        demand = self.shapes()
        out = np.zeros(len(cands))
        busy_of: dict[tuple[int, int], tuple[str, tuple[Slot, ...]] | None] = {}
        found = False
        for i in mig.tolist():
            u = int(units[i])
            slot = slots.get(u)
            if slot is None:
                continue
            key = (int(state.unit_node[u]), int(state.unit_gpu_index[u]))
            if key not in busy_of:
                busy_of[key] = self._busy(state, slots, *key)
            got = busy_of[key]
            if got is None:
                continue
            prod, busy = got
            before = dynamic_fragment(prod, busy, demand, self.memory_tolerance)
            after = dynamic_fragment(prod, tuple(sorted((*busy, slot))), demand, self.memory_tolerance)
            out[i] = before - after
            found = True
        return out if found else None

    def _busy(self, state: ClusterState, slots: Mapping[int, Slot], v: int, index: int
              ) -> tuple[str, tuple[Slot, ...]] | None:
        """(product, busy slots) of a dynamic GPU, or None for a GPU of a static product."""
        prod = state.products[int(state.node_product[v])]
        if prod not in self.dynamic:
            return None
        busy = [slots[u] for u in state.node_rows(v).tolist() if int(state.unit_gpu_index[u]) == index
                and u in slots and int(state.unit_free[u]) < int(state.unit_cap[u])]
        return prod, tuple(sorted(busy))

    def proactive(self, state: ClusterState, slots: Mapping[int, Slot], *, exclude: Iterable[str] = (),
                  nodes: NDArray[np.bool_] | None = None) -> list[Recut]:
        """Re-cuts of free slots that lower a GPU's expected fragment (static measure) by more than
        ``margin`` slices, one per GPU, best first."""
        demand = self.shapes()
        if not self.dynamic or not demand:
            return []
        skip = set(exclude)
        out: list[Recut] = []
        for g in gpu_layouts(state, slots, self.dynamic, nodes, self._layouts):
            if g.gpu in skip:
                continue
            found = self.best_layout(g, demand)
            if found is not None:
                out.append(found)
        return sorted(out, key=lambda r: (-r.gain, node_key(r.node), r.gpu))

    def best_layout(self, g: GpuLayout, demand: tuple[DemandShape, ...] | None = None) -> Recut | None:
        """The layout of ``g``'s free slots that serves the demand best, if it beats the current one by
        more than the margin."""
        demand = self.shapes() if demand is None else demand
        busy = g.busy
        current = static_fragment(g.product, g.instances, demand, self.memory_tolerance)
        if current <= self.margin:
            return None
        best, best_fill = current, None
        for fill in fills(g.product, busy):
            f = static_fragment(g.product, [(s, True) for s in busy] + [(s, False) for s in fill], demand,
                                self.memory_tolerance)
            if f < best - 1e-12:
                best, best_fill = f, fill
        if best_fill is None or current - best <= self.margin:
            return None
        have = {h.slot: h for h in g.instances}
        wanted = tuple(sorted((*busy, *best_fill)))
        destroy = tuple(h.key for h in g.instances if not h.busy and h.slot not in wanted)
        create = tuple(s for s in best_fill if s not in have)
        return Recut(g.node, g.gpu, g.gpu_index, g.product, destroy, create, wanted, "", None, current - best,
                     f"expected fragment {current:.2f} -> {best:.2f} slices for the learned demand")


# ----- what gpu-slice status shows ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LayoutStatus:
    """One MIG GPU for ``gpu-slice status``: its layout now, the layout wanted, and why (or why not)."""

    node: str
    gpu: str
    product: str
    dynamic: bool
    actual: tuple[Slot, ...]
    wanted: tuple[Slot, ...] | None
    pending: str


def layout_status(gpus: Mapping[str, Sequence[Gpu]], wanted: Mapping[str, Mapping[str, Sequence[Slot]]],
                  applied: Mapping[str, Mapping[str, str]], dynamic: frozenset[str]) -> list[LayoutStatus]:
    """Per MIG GPU of every node: actual layout, wanted layout (from the extender's annotation) and why a
    re-cut is pending. ``gpus``: node -> its GPUs (the inventory); ``wanted``: node -> GPU -> slots;
    ``applied``: node -> GPU -> the plugin's last word on it (:mod:`gpuslice.layoutwire`)."""
    out: list[LayoutStatus] = []
    for node in sorted(gpus):
        for g in gpus[node]:
            if g.mode != "mig":
                continue
            actual = tuple(sorted((i.profile, i.start) for i in g.instances))
            want_raw = wanted.get(node, {}).get(g.uuid)
            want = tuple(sorted(want_raw)) if want_raw is not None else None
            word = applied.get(node, {}).get(g.uuid, "")
            if want is None or want == actual:
                why = "" if g.product in dynamic else "static layout (migLayouts.<product>.dynamic is off)"
            else:
                why = f"re-cut to {_describe(want)} not applied yet" + (f": {word}" if word else
                                                                       " (the device plugin has not answered)")
            out.append(LayoutStatus(node, g.uuid, g.product, g.product in dynamic, actual, want, why))
    return out


def _describe(layout: Sequence[Slot]) -> str:
    return "[" + ", ".join(f"{p}@{s}" for p, s in layout) + "]"


def layout_status_of_nodes(nodes: Iterable[Mapping[str, object]], dynamic: frozenset[str]) -> list[LayoutStatus]:
    """:func:`layout_status` from Node objects as the API server serves them (live or from a dump):
    the inventory, the extender's wish and the plugin's result are read from their annotations; a node
    whose annotations do not decode is left out (``gpu-slice status`` reports it as a problem)."""
    from gpuslice import annotations as ann
    from gpuslice.errors import GpuSliceError
    from gpuslice.layoutwire import LAYOUT_KEY, STATUS_KEY, decode_results, decode_wanted

    gpus: dict[str, tuple[Gpu, ...]] = {}
    wanted: dict[str, dict[str, Sequence[Slot]]] = {}
    applied: dict[str, dict[str, str]] = {}
    for node in nodes:
        meta = node.get("metadata")
        if not isinstance(meta, Mapping) or not isinstance(meta.get("name"), str):
            continue
        name = str(meta["name"])
        notes = meta.get("annotations")
        if not isinstance(notes, Mapping) or ann.INVENTORY_KEY not in notes:
            continue
        try:
            gpus[name] = ann.decode_inventory(notes[ann.INVENTORY_KEY])
            if LAYOUT_KEY in notes:
                wanted[name] = {g.uuid: g.instances for g in decode_wanted(notes[LAYOUT_KEY]).gpus}
            if STATUS_KEY in notes:
                applied[name] = {g.uuid: f"{g.state}: {g.message}" for g in decode_results(notes[STATUS_KEY]).gpus}
        except GpuSliceError:
            gpus.pop(name, None)
    return layout_status(gpus, wanted, applied, dynamic)


class RecutAdvisor:
    """``gpu-slice status``'s re-cut suggestions for many Pending pods in one build: the demand is
    learned once from the pods that hold slices, the free slots read once (:meth:`read_slots`, under
    the caller's hold), then :meth:`for_pod` per pod (the same :meth:`LayoutPlanner.for_pending`
    the extender acts on). ``products``: the MIG products to consider (default every MIG-capable
    one: a suggestion, not an act)."""

    def __init__(self, requests: Iterable[PackRequest], *, products: frozenset[str] | None = None,
                 memory_tolerance: float = DEFAULT_MEMORY_TOLERANCE) -> None:
        self.planner = LayoutPlanner(products if products is not None else
                                     frozenset(p.name for p in PRODUCTS.values() if p.mig_capable),
                                     memory_tolerance=memory_tolerance)
        for r in requests:
            self.planner.observe(r)
        self.slots: dict[int, Slot] | None = None

    def read_slots(self, view: ClusterView) -> None:
        """The MIG instances every node advertises now (call under the view's hold)."""
        self.slots = slots_from_inventories(view.state, {name: n.info.inventory.gpus for name, n in view.nodes.items()
                                                         if n.info.inventory is not None and n.row >= 0})

    def for_pod(self, view: ClusterView, req: PackRequest, *, nodes: Sequence[str] | None = None) -> Recut | None:
        """The re-cut of free MIG slots that would let ``req`` in (call under the view's hold);
        ``nodes``: the node names the pod may run on (default all)."""
        if self.slots is None:
            self.read_slots(view)
        assert self.slots is not None
        st = view.state
        self.planner.observe(req)
        mask = None
        if nodes is not None:
            mask = np.zeros(st.n_nodes, dtype=bool)
            rows = [view.node_row(n) for n in nodes]
            mask[[r for r in rows if r >= 0]] = True
        return self.planner.for_pending(st, self.slots, req, nodes=mask)


def suggest_recut(view: ClusterView, req: PackRequest, *, products: frozenset[str] | None = None,
                  nodes: Sequence[str] | None = None) -> Recut | None:
    """The re-cut of free MIG slots that would let a Pending pod in (``gpu-slice status``'s "smallest
    change" for a pod refused for shape), with the demand learned from the pods the view holds now.
    ``products``: the MIG products to consider (default every MIG-capable one: a suggestion, not an act);
    ``nodes``: the node names the pod may run on (default all)."""
    from gpuslice.scheduler import pods_as_requests

    advisor = RecutAdvisor(pods_as_requests(view, owner_spread=view.settings.owner_spread), products=products,
                           memory_tolerance=view.settings.memory_tolerance)
    return advisor.for_pod(view, req, nodes=nodes)
