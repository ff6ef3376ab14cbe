"""Expected GPU fragmentation (FGD, Weng et al. ATC '23) over the array state, with caching.

For a node and a target pod shape m = (CPU c, slices k per GPU, GPUs n, allowed products):

* m asks no GPU, its product is not allowed, the node lacks c CPU, or fewer than n units accept k:
  every idle slice on the node is fragment for m;
* otherwise the fragment is the idle slices on units that cannot accept k.

A node's fragmentation is the expectation over the target distribution p. Placing a pod only
changes its node's term, so a candidate's score needs F(node after) - F(node before).

The same expectation in the CPU dimension (:func:`frags_from_stats`): a node's free CPU is fragment
for every shape the node cannot host (a GPU shape by the rule above, a CPU-only shape when the node
lacks its CPU). ``fragmentation`` prices it where CPU, not GPU, runs out first
(:func:`cpu_fragment_rate`).

Two acceptance rules. The paper's (``fgd``, memory-blind): a unit accepts k when it has k free
slices and is MPS or has capacity k; a shape is keyed by (CPU, k, GPUs, products). The
*slice-model* rule (``TargetWorkload(aware=True)``, used by ``fragmentation``) mirrors
:meth:`ClusterState.unit_accepts`: a shape also carries its GPU-memory floor and isolation, and a
unit accepts it only if the memory it would get (k/S of an MPS GPU, the whole instance or GPU
otherwise) meets the floor, the isolation allows the unit's kind, MIG instances by exact size, and
multi-GPU shapes only completely free whole GPUs (or MPS GPUs where the state allows it). So a
whole L4 is fragment for a 70B pod, and a 1g.10gb instance for an 18 GiB pod. With no floors and
no isolation (the openb traces) both rules give the same numbers.

Costs: the per-node before-values are refreshed only for nodes whose ``node_version`` moved; the
after-values of every (slot, pod shape) are cached the same way and dropped whenever the target
distribution is re-read. Acceptance depends on (k, memory floor, isolation, multi-GPU) only, so
units are tested against the distinct such *tests* of the targets (22 on the openb traces) rather
than against every shape (up to 285), and a unit's result depends only on its class (kind,
capacity, memory) and free slices, so it is read from a table built from the rule per layout
(:class:`UnitTable`). Shapes that differ only in CPU form one group, whose hostable share on a
node is one search in its CPU-sorted cumulative probabilities, so a workload where every pod asks
a different CPU amount costs per group, not per shape.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np
from numpy.typing import NDArray

from gpuslice.packing.state import KIND_MIG, KIND_MPS, KIND_WHOLE, Candidates, ClusterState, PackRequest
from gpuslice.rules import DEFAULT_MEMORY_TOLERANCE, memory_floor_met, mps_share_mib

I64 = NDArray[np.int64]
F64 = NDArray[np.float64]
B = NDArray[np.bool_]

#: (CPU, slices per GPU, GPUs, products, GPU-memory floor MiB, isolation); the last two are 0 and
#: "any" for the paper's memory-blind rule.
ShapeKey = tuple[int, int, int, frozenset[str] | None, int, str]

#: Owners a target tracks (:meth:`TargetWorkload.other_owners` draws on them); the policy looks at
#: fewer.
TRACKED_OWNERS = 16
#: Single-GPU shapes kept per tracked owner (its pods can differ in GPU-memory floor): an owner with
#: more distinct shapes keeps counting those it has and ignores new ones, so memory stays bounded.
OWNER_SHAPES = 8

ISOLATION_CODES = {"any": 0, "mig": 1, "mps": 2}


@dataclass(slots=True)
class TargetWorkload:
    """Counts of pod shapes seen (or given), the input of the target distribution.

    ``observe`` is how the online learner grows; ``offline`` reproduces FGD's table (most frequent
    shapes first until ``coverage`` of the pods are covered). ``aware``: shapes keep their GPU-memory
    floor and isolation (the slice-model rule, see the module docstring).
    """

    counts: dict[ShapeKey, int] = field(default_factory=dict)
    seen: int = 0
    aware: bool = False
    #: Host memory (MiB) and slices asked by the GPU pods seen: host memory is not in FGD's shape
    #: key, so its rate per slice is kept beside the counts.
    gpu_memory: int = 0
    gpu_slices: int = 0
    #: GPU pods seen per owner (ReplicaSet, StatefulSet): the owner-spread rule makes an owner part
    #: of what a pod can use, and the owner's share of the pods is its weight (``owner_share``).
    owners: dict[str, int] = field(default_factory=dict)
    #: The ``TRACKED_OWNERS`` largest owners, and no other (kept as pods arrive, so a decision never
    #: scans every owner a long-lived cluster has seen; exact, since counts only grow), each with
    #: its single-GPU pods counted by shape (:meth:`gpu_shape` with the owner; empty for an owner
    #: that has asked only multi-GPU pods): the mix its next pod is drawn from (:meth:`owner_mixture`).
    owner_shapes: dict[str, dict[PackRequest, int]] = field(default_factory=dict)
    #: GPU pods seen per multi-GPU shape less its CPU (unit acceptance does not read CPU), kept as
    #: pods arrive: ``fragmentation`` prices the nodes that can still host each (its point 8).
    multi_gpu: dict[PackRequest, int] = field(default_factory=dict)

    def key(self, req: PackRequest) -> ShapeKey:
        c, k, g, prods = req.shape
        if self.aware and g:
            return (c, k, g, prods, req.gpu_memory_mib, req.isolation)
        return (c, k, g, prods, 0, "any")

    def observe(self, req: PackRequest) -> None:
        key = self.key(req)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.seen += 1
        if req.gpus:
            self.gpu_memory += req.memory_mib
            self.gpu_slices += req.gpus * req.slices
            if req.owner:
                self._count_owner(req)
            if req.gpus > 1:
                shape = self.gpu_shape(req)
                self.multi_gpu[shape] = self.multi_gpu.get(shape, 0) + 1

    def _count_owner(self, req: PackRequest) -> None:
        n = self.owners.get(req.owner, 0) + 1
        self.owners[req.owner] = n
        tracked = self.owner_shapes
        if req.owner not in tracked and len(tracked) >= TRACKED_OWNERS:
            smallest = min(tracked, key=self.owners.__getitem__)
            if self.owners[smallest] >= n:
                return
            del tracked[smallest]
        shapes = tracked.setdefault(req.owner, {})
        if req.gpus == 1:
            shape = replace(self.gpu_shape(req), owner=req.owner)
            if shape in shapes or len(shapes) < OWNER_SHAPES:
                shapes[shape] = shapes.get(shape, 0) + 1

    def other_owners(self, owner: str, limit: int, min_share: float) -> list[tuple[float, str]]:
        """(share, owner) of the ``limit`` largest owners other than ``owner`` that have
        asked single-GPU pods (:meth:`owner_mixture` is not empty; the last pod may have been a
        multi-GPU one) with at least ``min_share`` of the pods seen, largest first, among the
        tracked ones."""
        if self.seen == 0:
            return []
        floor = min_share * self.seen
        big = [(self.owners[o], o) for o, shapes in self.owner_shapes.items()
               if shapes and self.owners[o] >= floor and o != owner]
        big.sort(key=lambda no: (-no[0], no[1]))
        return [(n / self.seen, o) for n, o in big[:limit]]

    def owner_mixture(self, owner: str) -> list[tuple[float, PackRequest]]:
        """(part, shape) for each single-GPU shape counted for ``owner`` (parts sum to 1; empty for
        an owner not tracked): what its next pod asks, as a mix rather than its last pod."""
        shapes = self.owner_shapes.get(owner)
        if not shapes:
            return []
        total = sum(shapes.values())
        return [(n / total, shape) for shape, n in shapes.items()]

    def gpu_shape(self, req: PackRequest) -> PackRequest:
        """``req`` as a shape less its CPU (what unit acceptance reads), as :meth:`key` keeps it."""
        _, k, g, prods, floor, isolation = self.key(req)
        return PackRequest(gpus=g, slices=k, gpu_memory_mib=floor, products=prods, isolation=isolation)

    def expected_pods(self, seen: float, free: float) -> float:
        """Of the pods expected to fill ``free`` slices, those of a kind ``seen`` times among the GPU
        pods so far: ``seen`` x free / slices asked (0 before any GPU pod)."""
        return seen * free / self.gpu_slices if self.gpu_slices > 0 else 0.0

    def owner_share(self, owner: str) -> float:
        """Share of the pods seen that belong to ``owner`` (0 for no owner or none seen)."""
        if not owner or self.seen == 0:
            return 0.0
        return self.owners.get(owner, 0) / self.seen

    @classmethod
    def offline(cls, reqs: Iterable[PackRequest], coverage: float = 0.95) -> TargetWorkload:
        full = cls()
        for r in reqs:
            full.observe(r)
        ordered = sorted(full.counts.items(), key=lambda kv: -kv[1])
        kept: dict[ShapeKey, int] = {}
        covered = 0
        for key, n in ordered:
            if covered >= coverage * full.seen:
                break
            kept[key] = n
            covered += n
        return cls(kept, covered, gpu_memory=full.gpu_memory, gpu_slices=full.gpu_slices, owners=full.owners,
                   owner_shapes=full.owner_shapes)

    def fractional_threshold(self, quantile: float, slices_per_gpu: int) -> int:
        """Slices k such that ``quantile`` of the fractional pods seen ask k or fewer (0 if none)."""
        ks = sorted((key[1], n) for key, n in self.counts.items() if key[2] == 1 and key[1] < slices_per_gpu)
        total = sum(n for _, n in ks)
        if total == 0:
            return 0
        acc = 0
        for k, n in ks:
            acc += n
            if acc >= quantile * total:
                return k
        return ks[-1][0]


@dataclass(slots=True)
class Tests:
    """The distinct unit tests of a target distribution: slices k, memory floor, isolation, multi-GPU.

    ``aware`` False is the paper's memory-blind rule (floors 0, isolation any, multi ignored).
    """

    kvals: I64
    mem: I64
    iso: I64
    multi: B
    aware: bool = False
    mps_multi: bool = False
    tolerance: float = DEFAULT_MEMORY_TOLERANCE

    def __len__(self) -> int:
        return int(self.kvals.shape[0])


def accepts(free: I64, kind: I64, cap: I64, mem: I64, t: Tests) -> B:
    """(..., T): whether each unit (free slices, kind, capacity, memory) passes every test."""
    f = free[..., None]
    kd = kind[..., None]
    cp = cap[..., None]
    if not t.aware:
        return np.asarray((f >= t.kvals) & (f > 0) & ((kd == KIND_MPS) | (cp == t.kvals)), dtype=bool)
    single = (f >= t.kvals) & (f > 0) & ((kd == KIND_MPS) | (cp == t.kvals))
    multi_kind = (kd == KIND_WHOLE) | ((kd == KIND_MPS) & t.mps_multi)
    multi = multi_kind & (cp == t.kvals) & (f == t.kvals)
    ok = np.where(t.multi, multi, single)
    ok &= (t.iso == 0) | ((t.iso == 1) & (kd == KIND_MIG)) | ((t.iso == 2) & (kd == KIND_MPS))
    share = np.where(kd == KIND_MPS, mps_share_mib(mem[..., None], t.kvals, cp), mem[..., None])
    ok &= np.asarray(memory_floor_met(share, t.mem, t.tolerance), dtype=bool)
    return np.asarray(ok, dtype=bool)


#: Group i's CPU values are searched as i * _GROUP_STRIDE + CPU, all groups in one sorted array.
_GROUP_STRIDE = 1 << 40


@dataclass(frozen=True, slots=True)
class GroupTable:
    """The GPU shapes grouped by (unit test, GPU count, product set): within a group they differ
    only in CPU, and whether a node can host one depends on its CPU only through ``free CPU >=
    shape CPU``. So a group's hostable probability is a cumulative sum over its shapes sorted by
    CPU, and a node's fragment costs one search per group instead of one column per shape (pods
    whose CPU requests all differ would otherwise make every decision scan thousands of shapes).
    All groups' CPU values lie in one sorted array, so one ``searchsorted`` answers every (node,
    group) pair at once. Each group opens with a floor key of probability 0 below any CPU a node
    can have, so a search never lands in the group before."""

    keys: I64  # group i * _GROUP_STRIDE + CPU, ascending; group i's floor key first
    cum_p: F64  # probability of the group's shapes with CPU <= that key's CPU
    offset: I64  # G: group i * _GROUP_STRIDE, what a node's CPU is added to for the search
    test: I64  # G
    gpus: I64  # G
    prod_ok: B  # products x G
    mass: F64  # G: the group's whole probability

    def __len__(self) -> int:
        return int(self.offset.shape[0])

    @classmethod
    def build(cls, kidx: I64, gpus: I64, prod_ok: B, cpu: I64, p: F64) -> GroupTable:
        """Group the shapes that ask GPUs (CPU-only ones no node can host, see ``idle_mass``)."""
        members: dict[tuple[int, int, bytes], list[int]] = {}
        for j in range(p.shape[0]):
            if gpus[j] > 0:
                members.setdefault((int(kidx[j]), int(gpus[j]), prod_ok[:, j].tobytes()), []).append(j)
        orders = [np.array(sorted(js, key=lambda j: int(cpu[j])), dtype=np.int64) for js in members.values()]
        sums = [np.cumsum(p[o]) for o in orders]
        offset = np.arange(len(orders), dtype=np.int64) * _GROUP_STRIDE
        floor = -(_GROUP_STRIDE // 2)  # node CPU is never this negative (removed nodes have -1)
        empty_i, empty_f = np.zeros(0, dtype=np.int64), np.zeros(0)
        return cls(
            keys=np.concatenate([np.concatenate([[i * _GROUP_STRIDE + floor], i * _GROUP_STRIDE + cpu[o]])
                                 for i, o in enumerate(orders)]).astype(np.int64) if orders else empty_i,
            cum_p=np.concatenate([np.concatenate([[0.0], c]) for c in sums]) if sums else empty_f,
            offset=offset,
            test=np.array([k for k, _, _ in members], dtype=np.int64),
            gpus=np.array([g for _, g, _ in members], dtype=np.int64),
            prod_ok=prod_ok[:, [o[0] for o in orders]] if orders else np.zeros((prod_ok.shape[0], 0), dtype=bool),
            mass=np.array([c[-1] for c in sums], dtype=np.float64))


@dataclass(slots=True)
class TargetShapes:
    """The target distribution as arrays against one state's product table."""

    cpu: I64
    slices: I64
    gpus: I64
    prod_ok: B  # products x M
    p: F64
    tests: Tests  # distinct unit tests
    kidx: I64  # M -> index into the tests
    idle_mass: float  # the probability of shapes no node can host (CPU-only pods)
    groups: GroupTable
    cpu_per_slice: float = 0.0  # CPU (millicores) the GPU shapes ask per slice, by probability
    memory_per_slice: float = 0.0  # host memory (MiB) the GPU pods seen ask per slice
    #: Index k: CPU per slice of the GPU shapes that ask exactly k slices per GPU (the pods a MIG
    #: instance or whole GPU of capacity k can host), ``cpu_per_slice`` where no shape asks k.
    cpu_per_slice_at: F64 = field(default_factory=lambda: np.zeros(1))
    #: The CPU-only shapes' CPU, ascending, and the probability of those asking at most each (a
    #: leading 0 for "none"): which of them a node's free CPU can host, for the CPU fragment.
    idle_cpu: I64 = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    idle_cum: F64 = field(default_factory=lambda: np.zeros(1))
    #: CPU (millicores) the whole workload asks per slice, CPU-only pods included (0: no slices asked).
    cpu_per_slice_all: float = 0.0
    #: GPU pods counted in the distribution: the sample size behind its shares.
    gpu_pods: float = 0.0

    @property
    def kvals(self) -> I64:
        return self.tests.kvals

    @classmethod
    def build(cls, workload: TargetWorkload, products: tuple[str, ...]) -> TargetShapes:
        keys = sorted(workload.counts, key=lambda k: (k[2], k[1], k[0], sorted(k[3] or ()), k[4], k[5]))
        m = len(keys)
        cpu = np.array([k[0] for k in keys], dtype=np.int64)
        slices = np.array([k[1] for k in keys], dtype=np.int64)
        gpus = np.array([k[2] for k in keys], dtype=np.int64)
        prod_ok = np.ones((len(products), m), dtype=bool)
        for j, k in enumerate(keys):
            if k[3] is not None:
                prod_ok[:, j] = [p in k[3] for p in products]
        n = np.array([workload.counts[k] for k in keys], dtype=np.float64)
        p = n / n.sum() if m else n
        if workload.aware:
            test_keys = [(k[1], k[4], ISOLATION_CODES[k[5]], k[2] > 1) for k in keys]
        else:
            test_keys = [(k[1], 0, 0, False) for k in keys]
        distinct = sorted(set(test_keys))
        index = {tk: i for i, tk in enumerate(distinct)}
        tests = Tests(np.array([d[0] for d in distinct], dtype=np.int64),
                      np.array([d[1] for d in distinct], dtype=np.int64),
                      np.array([d[2] for d in distinct], dtype=np.int64),
                      np.array([d[3] for d in distinct], dtype=bool), workload.aware)
        kidx = np.array([index[tk] for tk in test_keys], dtype=np.int64)
        idle_mass = float(p[gpus == 0].sum()) if m else 0.0
        g = gpus > 0
        cpu_per_slice = float((p[g] * cpu[g]).sum()) / max(float((p[g] * gpus[g] * slices[g]).sum()), 1e-9)
        top = int(slices[g].max()) if g.any() else 0
        weight = np.bincount(slices[g], weights=p[g], minlength=top + 1)
        per_gpu = np.bincount(slices[g], weights=p[g] * cpu[g] / gpus[g], minlength=top + 1)
        at = np.full(top + 1, cpu_per_slice)
        asked = (weight > 0) & (np.arange(top + 1) > 0)
        at[asked] = per_gpu[asked] / weight[asked] / np.flatnonzero(asked)
        idle = np.argsort(cpu[~g], kind="stable")
        all_slices = float((p * gpus * slices).sum())
        return cls(cpu, slices, gpus, prod_ok, p, tests, kidx, idle_mass, GroupTable.build(kidx, gpus, prod_ok, cpu, p),
                   cpu_per_slice, workload.gpu_memory / workload.gpu_slices if workload.gpu_slices else 0.0, at,
                   cpu[~g][idle], np.concatenate([[0.0], np.cumsum(p[~g][idle])]),
                   float((p * cpu).sum()) / all_slices if all_slices > 0 else 0.0, float(n[g].sum()))


def unit_versatility(cap: I64, kind: I64, mem: I64, t: TargetShapes) -> F64:
    """Per unit: the probability that a GPU shape of the target passes its unit test on the unit
    when empty (CPU-only shapes use no unit and are left out)."""
    gpu = t.gpus > 0
    if not gpu.any():
        return np.zeros(cap.shape[0])
    counts = np.bincount(t.kidx[gpu], weights=t.p[gpu], minlength=len(t.tests))
    p_test = counts.astype(np.float64) / float(counts.sum())
    return np.asarray(accepts(cap, kind, cap, mem, t.tests) @ p_test, dtype=np.float64)


def cpu_need(free: I64, kind: I64, cap: I64, t: TargetShapes) -> F64:
    """CPU (millicores) the pods that would fill each unit's free slices ask, in expectation.

    An MPS GPU's free slices go to pods of any size, so they need the GPU shapes' CPU per slice; an
    idle MIG instance or whole GPU goes to one pod of exactly its size, whose CPU per slice can be
    far from the average (small instances hosting pods that each ask a fixed CPU amount); a used
    one has nothing free."""
    fr = np.maximum(free, 0)
    table = t.cpu_per_slice_at
    sized = (kind != KIND_MPS) & (fr == cap) & (cap > 0) & (cap < table.shape[0])  # larger: no pod asks it
    rate = np.where(sized, table[np.minimum(cap, table.shape[0] - 1)], t.cpu_per_slice)
    return np.asarray(fr * rate, dtype=np.float64)


@dataclass(frozen=True, slots=True)
class UnitTable:
    """:func:`accepts` and :func:`cpu_need` of every (unit class, free slices) pair, so that a
    decision reads them by indexing instead of re-running the rules' dozen array operations per
    call. A unit's class is its (kind, capacity, memory), which never changes while a layout lives,
    and a state has few of them (GPU models x modes x MIG profiles); free slices run from 0 to the
    largest capacity (less than 0 reads as 0, where nothing accepts and nothing needs CPU)."""

    unit_cls: I64  # per unit row of the state (the sentinel included): its class
    cls_m: I64  # per (node, position), as ``ClusterState.kind_m``: the class, padding the sentinel's
    accept: B  # classes x (free slices + 1) x tests
    need: F64  # classes x (free slices + 1)

    @classmethod
    def build(cls, state: ClusterState, shapes: TargetShapes) -> UnitTable:
        keys = np.stack([state.unit_kind, state.unit_cap, state.unit_mem], axis=1)
        classes, unit_cls = np.unique(keys, axis=0, return_inverse=True)
        unit_cls = np.asarray(unit_cls, dtype=np.int64).reshape(-1)
        top = int(classes[:, 1].max(initial=0))
        free = np.broadcast_to(np.arange(top + 1, dtype=np.int64), (classes.shape[0], top + 1))
        kind, cap, mem = (np.broadcast_to(classes[:, i, None], free.shape) for i in range(3))
        return cls(unit_cls, unit_cls[state.node_units], accepts(free, kind, cap, mem, shapes.tests),
                   cpu_need(free, kind, cap, shapes))

    def accepts(self, free: I64, cls: I64) -> B:
        """``accepts(free, kind, cap, mem, tests)`` of units of classes ``cls``."""
        return np.asarray(self.accept[cls, np.maximum(free, 0)], dtype=bool)  # free <= capacity always

    def cpu_need(self, free: I64, cls: I64) -> F64:
        """``cpu_need(free, kind, cap, shapes)`` of units of classes ``cls``."""
        return np.asarray(self.need[cls, np.maximum(free, 0)], dtype=np.float64)


def unit_stats(free: I64, acc: B) -> tuple[I64, I64, I64]:
    """Per row of a free matrix (B x W) and its acceptance (B x W x T): accepting-unit counts and
    non-accepting idle sums (B x T), idle total."""
    fr = np.maximum(free, 0)
    cnt = acc.sum(axis=1)
    sub = (fr[..., None] * ~acc).sum(axis=1)
    return cnt.astype(np.int64), sub.astype(np.int64), fr.sum(axis=1).astype(np.int64)


def _hosted(cnt: I64, cpu: I64, prod: I64, t: TargetShapes) -> F64:
    """(B x G): per row, the probability of each group's shapes that the node can host (enough
    accepting units, an allowed product, and CPU for the shape)."""
    g = t.groups
    at = np.searchsorted(g.keys, g.offset + cpu[:, None], side="right") - 1  # B x G: last key <= free CPU
    return np.asarray(np.where(g.prod_ok[prod] & (cnt[:, g.test] >= g.gpus), g.cum_p[at], 0.0), dtype=np.float64)


def frags_from_stats(cnt: I64, sub: I64, total: I64, cpu: I64, prod: I64, t: TargetShapes) -> tuple[F64, F64]:
    """(GPU fragment, CPU fragment) per row (B) from per-k stats; see the module docstring for the rule.

    GPU: a shape a node can host contributes its idle slices on non-accepting units (``sub``), any
    other shape all idle slices (``total``). CPU: the node's free CPU for every shape it cannot host
    (a GPU shape as for the GPU fragment, a CPU-only shape when it lacks the CPU), in millicores.
    Evaluated per :class:`GroupTable` group, all groups at once."""
    tot = total.astype(np.float64)
    free_cpu = np.maximum(cpu, 0).astype(np.float64)
    idle_hosted = t.idle_cum[np.searchsorted(t.idle_cpu, cpu, side="right")]
    g = t.groups
    if len(g) == 0:
        return (np.asarray(t.idle_mass * tot, dtype=np.float64),
                np.asarray(free_cpu * np.maximum(1.0 - idle_hosted, 0.0), dtype=np.float64))
    hosted = _hosted(cnt, cpu, prod, t)
    gpu = t.idle_mass * tot + (hosted * sub[:, g.test]).sum(axis=1) + (g.mass - hosted).sum(axis=1) * tot
    cpu_frag = free_cpu * np.maximum(1.0 - hosted.sum(axis=1) - idle_hosted, 0.0)
    return np.asarray(gpu, dtype=np.float64), np.asarray(cpu_frag, dtype=np.float64)


def cpu_fragment_rate(state: ClusterState, t: TargetShapes) -> float:
    """Slices one millicore of CPU fragment is worth: the workload's slices per millicore where it
    asks more CPU per slice than the cluster has (CPU runs out before the GPUs fill, so CPU no
    shape can use is GPU capacity lost), else 0 (GPUs run out first and idle CPU is left over
    wherever the pods go)."""
    if t.cpu_per_slice_all <= 0.0:
        return 0.0
    alive = state.node_alive[: state.n_nodes]
    cpu = float(state.node_cpu_cap[: state.n_nodes][alive].sum())
    if t.cpu_per_slice_all * float(state.total_slices) < cpu:
        return 0.0
    return 1.0 / t.cpu_per_slice_all


class FragCache:
    """Cached before/after fragmentation for one state and one target distribution (see module doc)."""

    def __init__(self) -> None:
        self.state_id = -1
        self.layout = -1
        self.version = -1
        self.shapes: TargetShapes | None = None
        self.node_ver: I64 = np.zeros(0, dtype=np.int64)
        self.before: F64 = np.zeros(0)
        self.cpu_before: F64 = np.zeros(0)
        self.cnt: I64 = np.zeros((0, 0), dtype=np.int64)
        self.sub: I64 = np.zeros((0, 0), dtype=np.int64)
        self.total: I64 = np.zeros(0, dtype=np.int64)
        self.need: F64 = np.zeros(0)
        #: (CPU, slices, GPUs) of a pod -> per slot: node version, GPU fragment after, CPU fragment after
        self.after: dict[tuple[int, int, int], tuple[I64, F64, F64]] = {}
        self.versatility: F64 | None = None
        self.table: UnitTable | None = None

    def sync(self, state: ClusterState, shapes: TargetShapes, version: int) -> None:
        """Drop everything when the state object or the target distribution changed."""
        if (self.state_id != state.generation or self.layout != state.layout_version or self.version != version
                or self.shapes is None):
            self.state_id = state.generation
            self.layout = state.layout_version
            self.version = version
            self.shapes = shapes
            n, k = state.n_nodes, len(shapes.tests)
            self.node_ver = np.full(n, -1, dtype=np.int64)
            self.before = np.zeros(n)
            self.cpu_before = np.zeros(n)
            self.cnt = np.zeros((n, k), dtype=np.int64)
            self.sub = np.zeros((n, k), dtype=np.int64)
            self.total = np.zeros(n, dtype=np.int64)
            self.need = np.zeros(n)
            self.after = {}
            self.versatility = None
            self.table = None
        # Multi-GPU shapes may take free MPS GPUs only where the state allows it (the openb replay).
        shapes.tests.mps_multi = state.allow_mps_multi
        shapes.tests.tolerance = state.memory_tolerance
        if self.table is None:
            self.table = UnitTable.build(state, shapes)

    def node_frag(self, state: ClusterState) -> F64:
        """F(node) now, for every node."""
        assert self.shapes is not None and self.table is not None
        stale = np.flatnonzero(self.node_ver != state.node_version)
        if stale.size:
            free = state.free_matrix()[stale]
            cnt, sub, total = unit_stats(free, self.table.accepts(free, self.table.cls_m[stale]))
            self.cnt[stale], self.sub[stale], self.total[stale] = cnt, sub, total
            self.need[stale] = self.table.cpu_need(free, self.table.cls_m[stale]).sum(axis=1)
            self.before[stale], self.cpu_before[stale] = frags_from_stats(
                cnt, sub, total, state.node_cpu_free[stale], state.node_product[stale], self.shapes)
            self.node_ver[stale] = state.node_version[stale]
        return self.before

    def node_cpu_frag(self, state: ClusterState) -> F64:
        """The CPU fragment (:func:`frags_from_stats`) now, for every node."""
        self.node_frag(state)
        return self.cpu_before

    def unit_versatility(self, state: ClusterState) -> F64:
        """:func:`unit_versatility` of every unit row (the sentinel's is 0), kept until the layout
        or the target changes."""
        assert self.shapes is not None
        if self.versatility is None or self.versatility.shape[0] != state.unit_cap.shape[0]:
            self.versatility = unit_versatility(state.unit_cap, state.unit_kind, state.unit_mem, self.shapes)
        return self.versatility

    def after_frag(self, state: ClusterState, req: PackRequest, cands: Candidates) -> F64:
        """F(node after placing ``req`` as candidate c), per candidate."""
        return self._after(state, req, cands)[0]

    def after_cpu_frag(self, state: ClusterState, req: PackRequest, cands: Candidates) -> F64:
        """The CPU fragment of the node after placing ``req`` as candidate c, per candidate."""
        return self._after(state, req, cands)[1]

    def _after(self, state: ClusterState, req: PackRequest, cands: Candidates) -> tuple[F64, F64]:
        """(GPU fragment, CPU fragment) after each candidate, refreshing the stale slots of the pod's entry."""
        t, table = self.shapes, self.table
        assert t is not None and table is not None
        self.node_frag(state)
        key = (req.cpu_milli, req.slices if req.gpus else 0, req.gpus)
        entry = self.after.get(key)
        size = state.n_nodes * state.width
        if entry is None:
            entry = (np.full(size, -1, dtype=np.int64), np.zeros(size), np.zeros(size))
            self.after[key] = entry
        ver, val, cval = entry
        nodes = cands.node
        stale = np.flatnonzero(ver[cands.slot] != state.node_version[nodes])
        if stale.size:
            sv = nodes[stale]
            cpu_after = state.node_cpu_free[sv] - req.cpu_milli
            if req.gpus == 0:
                f, fc = frags_from_stats(self.cnt[sv], self.sub[sv], self.total[sv], cpu_after,
                                         state.node_product[sv], t)
            elif req.gpus == 1:
                u = cands.units[stale, 0]
                x = state.unit_free[u]
                x2 = x - req.slices
                ucls = table.unit_cls[u]
                a_old = table.accepts(x, ucls)
                a_new = table.accepts(x2, ucls)
                cnt = self.cnt[sv] - a_old + a_new
                sub = self.sub[sv] - x[:, None] * ~a_old + np.maximum(x2, 0)[:, None] * ~a_new
                total = self.total[sv] - req.slices
                f, fc = frags_from_stats(cnt, sub, total, cpu_after, state.node_product[sv], t)
            else:
                free = state.free_matrix()[sv]
                pos = state.unit_pos[cands.units[stale]]
                rows = np.repeat(np.arange(sv.shape[0]), req.gpus)
                free[rows, pos.reshape(-1)] -= req.slices
                cnt, sub, total = unit_stats(free, table.accepts(free, table.cls_m[sv]))
                f, fc = frags_from_stats(cnt, sub, total, cpu_after, state.node_product[sv], t)
            slots = cands.slot[stale]
            val[slots] = f
            cval[slots] = fc
            ver[slots] = state.node_version[sv]
        return val[cands.slot], cval[cands.slot]
