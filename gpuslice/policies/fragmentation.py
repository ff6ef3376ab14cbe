"""``fragmentation``: our default, FGD's expected-fragmentation idea, aware of the slice model.

The idea in short: a placement costs what it adds to the cluster's expected fragmentation, measured
against the mix of pod shapes seen so far, in every resource that can run out (GPU slices, CPU, host
memory), with MIG instances as fixed bins worth the demand for their size, and with the owner-spread
rule as part of what a later pod can still use. The points below are its parts: FGD's own measure
(1), the slice model (2, 7), CPU and memory (3, 9), GPU products (5), owners (6), multi-GPU hosts
(8), the order among near-equal placements (4) and the online packing rule it keeps (10). None
reads a history of events.

1. FGD level: ``int(100 * sigmoid(-(F_after - F_before) / S))`` as in :mod:`fgd` (an integer level
   on purpose: exact deltas pack worse), against an **online** target: every pod shape seen so far
   (CPU, slices per GPU, GPUs, allowed products, and here also the GPU-memory floor and isolation),
   counted as pods arrive and re-read when the count doubles. Nothing is read in advance.
2. MIG instances are fixed-size bins. FGD scores units, so it cannot tell an instance on a GPU that
   already runs pods from one on an idle GPU, though only the latter puts one more GPU in use and
   strands the rest of it; the stranded-slice change (:mod:`_slice_terms`) is added to the FGD
   delta. An idle instance strands its slices only as far as the learned demand for its size will
   not fill it (the size's *fill*: its expected pods against its free instances), so an instance
   is worth what the workload asks of its size.
3. CPU and host memory run out too. FGD counts a node's idle GPUs as fragment for a shape whose
   CPU the node lacks; the same holds in expectation for what the node can still host. Filling
   the node's free units needs CPU: an MPS GPU's free slices at the learned GPU pods' CPU per
   slice, an idle MIG instance or whole GPU the CPU of the learned pods of exactly its size (seven
   1g instances need seven pods' CPU, one 7g instance one pod's). Free CPU C against that need N
   feeds free x C / N slices (host memory: M / memory per slice), and free slices beyond what the
   scarcer of the two feeds are stranded. The change of max(0, free slices - min(CPU feeds,
   memory feeds)) is added to the delta (slices of stranded capacity count as slices of
   fragment). So a CPU-only pod spends CPU that no idle unit needs, and a GPU pod goes where its
   CPU matches what the node has left.
4. Single-GPU pods: among the candidates within ``window`` levels of the best, the placement that
   most lowers sum_g N(g)^2 over MPS units with g free slices (leftovers spread over many sizes,
   so a later pod of any size finds a close fit), plus the stranded-slice change (point 2).
5. GPU products are worth what the workload needs of them. Pods pinned to some products can use
   only those, and FGD's per-node fragment cannot see a product running short. The learned demand
   is spread over the free capacity of the products each shape may use, as evenly as possible
   (:mod:`gpuslice.packing.scarcity`). A pod that takes a product loaded above the least loaded
   one it may use adds its slices x ``SCARCITY_GAIN`` x the difference (at most ``SCARCITY_CAP``
   x its slices) to the delta, plus its slices x the share of that product's
   capacity the spread gives to pinned demand beyond its least pinned choice (a slice taken there
   displaces that share of a pinned pod's slice). Without pinned shapes both terms are 0. A sample
   of pods can miss a product's pinned pods altogether, so once some pod is pinned, each product
   also carries the pinned demand the sample may not have shown yet (the rule of three: 3 / n of
   the GPU demand), which protects the small products while few pods have been seen.
6. The owner-spread rule (never two pods of one owner on a GPU) makes the owner part of what a pod
   can use. A pod closes the GPUs it takes to its owner's later pods, so the idle slices left
   there that would still take the pod's shape become fragment for that owner; weighted by the
   owner's share of the pods seen (its probability in the target, as any shape's), their count
   is added to the delta. An owner's pods so go where they close the least. The other side of
   the rule: a GPU serves each owner once, so an owner's reach is the GPUs that still fit its next
   pod. A placement that takes the last unit another large owner fits on a GPU (one it does not
   hold) costs that owner's share x the slices its pod asks. On MIG both halves change. The
   instances a pod leaves idle beside it are what point 2 prices (as unfilled slices), so the
   first half, which would count those of its size again, is left out there. And an instance
   takes one size only, so a unit taken from another owner's reach can be made up only by pods of
   that size: its weight is how likely that owner is to miss it, min(1, E / R) with E its pods
   expected among those that fill the free slices and R the GPUs it still fits
   (:func:`owner_reach_weight`), not its share. On MPS a slot closed to one owner stays open to
   every other shape, and the share is the weight. Either way the owner's next pod is the mix of
   shapes its pods have asked (:meth:`TargetWorkload.owner_mixture`; one owner's pods can differ
   in GPU-memory floor, and a 1g instance does not take a pod whose floor it lacks), each shape's
   loss weighted by its part of them: the expected loss, of which the owner's last pod would be
   one random draw. Pods without an owner, and traces without owners, are scored as before.
7. A full unit leaves no fragment whichever unit it is, so FGD cannot tell a whole GPU, which only
   whole-GPU pods can use, from an idle MPS GPU, which any pod could share. A pod that uses up an
   idle unit pays its slices x the unit's *versatility* (the probability that a learned shape
   could use it when empty), less the cheapest candidate's cost (:mod:`_slice_terms`); the same
   for every candidate where all units are alike (the openb traces).
8. A multi-GPU shape needs enough free whole units on one node, and FGD, weighing it by its share
   of the pods, prices its last hosts as cheaply as any fragment, though its pod that finds none
   loses all its slices. A placement that ends a host of another learned multi-GPU shape pays the
   shape's slices x the chance the host will be needed: P(N >= R), N Poisson with mean the
   shape's pods expected among those that fill the free slices, R the hosts left
   (:mod:`_shape_reach`). Nil while hosts are many; near the shape's slices at its last hosts.
   Once multi-GPU pods have been seen, a size none of them has asked yet counts as seen 3 times
   (the rule of three, as in point 5), so a node is not broken up just before its size arrives.
9. Where the workload asks more CPU per slice than the cluster has (CPU-only pods included), CPU
   runs out before the GPUs fill, and CPU that no shape can use is GPU work lost. FGD's fragment
   in the CPU dimension: a node's free CPU counts for every learned shape the node cannot host (a
   GPU shape as FGD's rule says, a CPU-only shape when the node lacks its CPU), in expectation
   (:func:`gpuslice.packing.frag.frags_from_stats`); its change, at the workload's slices per
   millicore, joins the delta (:func:`gpuslice.packing.frag.cpu_fragment_rate`). So pods use CPU
   up where what is left would fit nothing. Where GPUs run out first, idle CPU is left over
   wherever the pods go, and the term is 0.
10. Any-Fit (:mod:`_any_fit`): a single-GPU pod does not open an idle MPS GPU while an MPS GPU of
   the same product that already runs pods takes it; such candidates are scored at the lowest
   level. FGD's per-node fragment can prefer the idle GPU for a small pod, but an idle GPU is the
   only place a whole-GPU share still fits, and one opened for a small pod stays in use.

The window depends only on the slice granularity: a few levels for fine slices (the milli-GPU
simulation), none for the coarse slices of real MPS/MIG nodes, where one slice already moves the
level by several steps. The rules read the state and the learned shapes only, never a history of
events, so a restarted scheduler that has warm-started its shapes decides as one that never stopped
(point 5's loads are refreshed when a product's free capacity has moved by 0.2 % of the cluster's,
so within that margin they reflect the last refresh, not the current state).

Scores: the candidates a rule ranks map to [0.5, 1) by that rule's rank (then FGD level); all
other candidates to 0.49 * level / 100, below them. Equal scores fall to the caller's node order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gpuslice.packing.frag import I64, TargetShapes, TargetWorkload, UnitTable, cpu_fragment_rate
from gpuslice.packing.scarcity import UNSEEN_BOUND, ProductLoads
from gpuslice.packing.state import KIND_MIG, KIND_MPS, B, Candidates, ClusterState, PackRequest
from gpuslice.policies import _slice_terms as slice_terms
from gpuslice.policies._any_fit import idle_gpu_openers
from gpuslice.policies._shape_reach import shape_reach_change
from gpuslice.policies.base import F64, BasePolicy, PolicyContext
from gpuslice.policies.fgd import FragMemory, frag_delta, levels, sigmoid_score


def leftover_sumsq_change(state: ClusterState, req: PackRequest, cands: Candidates, low: int) -> F64:
    """Change of sum_g N(g)^2 (low < g < S, MPS units) if the pod went on each candidate's unit."""
    n = len(cands)
    if req.gpus != 1 or n == 0:
        return np.zeros(n)
    s = state.slices_per_gpu
    free = state.unit_free[: state.n_units]
    mps = (state.unit_kind[: state.n_units] == KIND_MPS) & state.unit_usable[: state.n_units]
    hist = np.bincount(free[mps], minlength=s + 1).astype(np.float64)
    u = cands.units[:, 0]
    x = state.unit_free[u]
    x2 = x - req.slices
    is_mps = state.unit_kind[u] == KIND_MPS
    in_old = is_mps & (x > low) & (x < s)
    in_new = is_mps & (x2 > low) & (x2 < s)
    # np.minimum(np.maximum()) rather than np.clip: the same values without np.clip's Python wrapper,
    # which costs more than the two ufuncs on these few elements
    d = np.where(in_old, 1.0 - 2.0 * hist[np.minimum(np.maximum(x, 0), s)], 0.0)
    d += np.where(in_new, 1.0 + 2.0 * hist[np.minimum(np.maximum(x2, 0), s)], 0.0)
    return np.asarray(d, dtype=np.float64)


def product_scarcity(state: ClusterState, req: PackRequest, cands: Candidates, ratios: F64, pinned: F64,
                     gain: float, pinned_weight: float) -> F64:
    """Slices the pod takes x (min(``SCARCITY_CAP``, ``gain`` x how far its candidate's product is
    loaded above the least loaded product the pod may use) + ``pinned_weight`` x how much more of
    the candidate's product the balanced spread gives to pinned demand than of the pod's least
    pinned choice); see :mod:`gpuslice.packing.scarcity`."""
    n = len(cands)
    if n == 0 or req.gpus == 0 or ratios.shape[0] < 2 or (np.ptp(ratios) <= 1e-9 and np.ptp(pinned) <= 1e-9):
        return np.zeros(n)
    allowed = state.product_mask(req.products)[: ratios.shape[0]] & (ratios > 0)
    if not allowed.any():
        return np.zeros(n)
    prod = state.node_product[cands.node]
    above = ratios[prod] - float(ratios[allowed].min())
    cost = np.clip(gain * np.where(above > 1e-9, above, 0.0), 0.0, SCARCITY_CAP)
    if pinned_weight:
        cost = cost + pinned_weight * np.maximum(pinned[prod] - float(pinned[allowed].min()), 0.0)
    return np.asarray(cost * float(req.gpus * req.slices), dtype=np.float64)


def host_stranding_change(state: ClusterState, req: PackRequest, cands: Candidates, shapes: TargetShapes,
                          node_free: I64 | None = None, node_need: F64 | None = None,
                          table: UnitTable | None = None) -> F64:
    """Change of the node's free slices that its free CPU (or host memory) cannot feed, per
    candidate: max(0, free - min(free x C / need, M / memory per slice)), where ``need`` is the
    CPU the pods filling the free units would ask (:func:`gpuslice.packing.frag.cpu_need`; free x
    CPU per slice on MPS GPUs). ``node_free``, ``node_need``, ``table`` (of ``shapes``): if the
    caller has them."""
    n = len(cands)
    if n == 0 or shapes.cpu_per_slice <= 0:
        return np.zeros(n)
    node = cands.node
    if table is None:
        table = UnitTable.build(state, shapes)
    if node_free is None or node_need is None:
        fm = state.free_matrix()
        node_free = np.maximum(fm, 0).sum(axis=1)
        node_need = table.cpu_need(fm, table.cls_m).sum(axis=1)
    free = node_free[node].astype(np.float64)
    need = node_need[node]
    cpu = state.node_cpu_free[node].astype(np.float64)
    taken = float(req.gpus * req.slices)
    need_after = need.copy()
    if req.gpus:
        units = cands.units
        x, cls = state.unit_free[units], table.unit_cls[units]
        need_after -= (table.cpu_need(x, cls) - table.cpu_need(x - req.slices, cls)).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):  # no need: nothing to feed, nothing stranded
        feeds = np.where(need > 1e-9, free * cpu / need, np.inf)
        feeds_after = np.where(need_after > 1e-9, (free - taken) * (cpu - req.cpu_milli) / need_after, np.inf)
    if shapes.memory_per_slice > 0:
        mem = state.node_mem_free[node].astype(np.float64)
        feeds = np.minimum(feeds, mem / shapes.memory_per_slice)
        feeds_after = np.minimum(feeds_after, (mem - req.memory_mib) / shapes.memory_per_slice)
    before = np.maximum(free - feeds, 0.0)
    after = np.maximum(free - taken - feeds_after, 0.0)
    return np.asarray(after - before, dtype=np.float64)


def _candidate_node_units(state: ClusterState, cands: Candidates) -> tuple[I64, I64]:
    """Unit rows of the candidates' nodes and their GPU ids: every unit on a GPU a candidate takes
    (PAD rows are the sentinel, which accepts nothing)."""
    rows = state.node_units[np.unique(cands.node)].reshape(-1)
    return rows, state.unit_gpu_id[rows]


def owner_spread_change(state: ClusterState, req: PackRequest, cands: Candidates) -> F64:
    """Idle slices that would still take the pod's shape, left on the GPUs each candidate takes:
    the owner-spread rule closes them to the pod's owner (0 for a pod without an owner)."""
    n = len(cands)
    if n == 0 or req.gpus == 0 or not req.owner:
        return np.zeros(n)
    # The candidates' GPUs hold no pod of this owner (the rule refused those), so acceptance there
    # with the rule equals acceptance of the shape alone.
    rows, gid_rows = _candidate_node_units(state, cands)
    accepts = state.unit_accepts(req, rows)  # never the sentinel, whose GPU id is -1
    per_gpu = np.bincount(gid_rows[accepts], weights=state.unit_free[rows][accepts].astype(np.float64),
                          minlength=state.n_gpus)
    units = cands.units
    free = state.unit_free[units].astype(np.float64)
    left = free - req.slices
    still = np.where(left >= req.slices, left, 0.0)  # an MPS unit's remainder may take the shape again
    closed = per_gpu[state.unit_gpu_id[units]] - free + still
    return np.asarray(closed.sum(axis=1), dtype=np.float64)


def owner_reach_change(state: ClusterState, req: PackRequest, cands: Candidates,
                       others: Sequence[tuple[float | F64, PackRequest]],
                       accepts: Sequence[B | None] | None = None) -> F64:
    """Per candidate, sum over other owners of weight x slices asked, for each owner whose last unit
    on a GPU this placement takes (the GPU then holds nothing that owner's next pod fits); a weight
    is one number or one per candidate. ``accepts``: ``state.unit_accepts(other)`` for each of
    ``others`` (None where the caller has not scanned it), else only the candidates' nodes are
    scanned."""
    n = len(cands)
    if n == 0 or req.gpus == 0 or not others:
        return np.zeros(n)
    rows, gid_rows = _candidate_node_units(state, cands)
    units = cands.units  # (C, G)
    gid = state.unit_gpu_id[units]
    free_after = state.unit_free[units] - req.slices
    out = np.zeros(n)
    for i, (share, other) in enumerate(others):
        acc = None if accepts is None else accepts[i]
        if acc is None:  # one scan of the candidates' nodes, spread to unit ids (the sentinel reads False)
            acc_rows = state.unit_accepts(other, rows)
            acc = np.zeros(state.unit_free.shape[0], dtype=bool)
            acc[rows] = acc_rows
        else:
            acc_rows = acc[rows]
        on_gpu = np.bincount(gid_rows[acc_rows], minlength=state.n_gpus)[gid]  # its units per taken GPU
        acc_u = acc[units]
        # an MPS unit keeps taking the other owner's pod if enough is left of it
        last = acc_u & (on_gpu == 1) & (free_after < other.slices)
        out += share * other.slices * last.sum(axis=1)
    return out


def usable_free_slices(state: ClusterState) -> float:
    """Free slices on the usable units of the whole cluster."""
    n = state.n_units
    return float(state.unit_free[:n][state.unit_usable[:n]].sum())


def owner_reach_weight(state: ClusterState, target: TargetWorkload, other: PackRequest,
                       free: float | None = None, accepts: B | None = None) -> float:
    """How likely a GPU of ``other``'s owner's reach is one it will miss: min(1, E / R), with E its
    pods expected among those that fill the cluster's free slices (its pods seen x free slices /
    slices asked by the GPU pods seen) and R the GPUs that still fit its next pod (1 if none does).
    ``free``: :func:`usable_free_slices`, ``accepts``: ``state.unit_accepts(other)``, if the caller
    has them."""
    pods = target.owners.get(other.owner, 0)
    if pods == 0 or target.gpu_slices <= 0:
        return 0.0
    n = state.n_units
    if accepts is None:
        accepts = state.unit_accepts(other)
    ok = accepts[:n]
    reach = int(np.count_nonzero(np.bincount(state.unit_gpu_id[:n][ok], minlength=state.n_gpus)))
    if reach == 0:
        return 1.0
    if free is None:
        free = usable_free_slices(state)
    return min(1.0, target.expected_pods(pods, free) / reach)


def _rank_scores(key: F64, level: F64) -> F64:
    """Map ``key`` (higher better, then ``level``) onto [0.5, 1), order preserved."""
    _, rank = np.unique(key, return_inverse=True)
    rank = rank.reshape(-1).astype(np.float64)
    top = rank.max() + 1.0
    return np.asarray(0.5 + 0.5 * (rank + level / 101.0) / top, dtype=np.float64)


FINE_SLICES = 100  # S at or above this is the simulator's milli-GPU granularity
FINE_WINDOW = 10
COARSE_WINDOW = 0
#: Product scarcity (point 5): a product 5 % more loaded than the pod's least loaded one costs as
#: much as the slices the pod takes; at most ``SCARCITY_CAP`` times them.
SCARCITY_GAIN = 20.0
SCARCITY_CAP = 5.0
#: Point 6's reach term looks at the largest other owners only, each with at least this share of the
#: pods seen: its cost grows with their number, and a rare owner's reach moves little.
OWNER_LIMIT = 8
OWNER_MIN_SHARE = 0.01


class Fragmentation(BasePolicy):
    name = "fragmentation"

    def __init__(self, window: int | None = None, quantile: float = 0.005, stranding_weight: float = 1.0,
                 scarcity_gain: float = SCARCITY_GAIN, pinned_weight: float = 1.0,
                 owner_weight: float = 1.0, reach_weight: float = 1.0, versatility_weight: float = 1.0,
                 shape_reach_weight: float = 1.0, cpu_weight: float = 1.0,
                 unseen_bound: float = UNSEEN_BOUND, any_fit: bool = True) -> None:
        self.window = window
        self.quantile = quantile
        self.stranding_weight = stranding_weight
        self.scarcity_gain = scarcity_gain
        self.pinned_weight = pinned_weight
        self.owner_weight = owner_weight
        self.reach_weight = reach_weight
        self.versatility_weight = versatility_weight
        self.shape_reach_weight = shape_reach_weight
        self.cpu_weight = cpu_weight
        self.unseen_bound = unseen_bound
        self.any_fit = any_fit

    def window_for(self, slices_per_gpu: int) -> int:
        """The leftover rule's window in FGD levels: as set, else by slice granularity."""
        if self.window is not None:
            return self.window
        return FINE_WINDOW if slices_per_gpu >= FINE_SLICES else COARSE_WINDOW

    def new_memory(self, ctx: PolicyContext) -> Any:
        mem = FragMemory(TargetWorkload(), online=True,  # as new_frag_memory(ctx, offline=False)
                         loads=ProductLoads(unseen=self.unseen_bound))
        mem.target.aware = True  # slice-model targets: memory floors and isolation (frag.py)
        return mem

    def observe(self, memory: Any, req: PackRequest) -> None:
        memory.target.observe(req)

    def score(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        mem: FragMemory = memory
        n = len(cands)
        if n == 0:
            return np.zeros(0)
        target = mem.target
        stranded = slice_terms.mig_stranded_change(state, req, cands, target)  # 0 off MIG (openb: always)
        delta = frag_delta(state, req, cands, mem) + slice_terms.MIG_WEIGHT * stranded
        if self.versatility_weight:
            versatility = mem.cache.unit_versatility(state)  # frag_delta above synced the cache
            delta += self.versatility_weight * slice_terms.versatility_change(state, req, cands, versatility)
        ratios, pinned = mem.product_loads(state)
        delta += product_scarcity(state, req, cands, ratios, pinned, self.scarcity_gain, self.pinned_weight)
        if self.cpu_weight:
            rate = cpu_fragment_rate(state, mem.current(state))
            if rate > 0.0:  # frag_delta above filled the cache's CPU fragments for this pod
                cpu_frag = mem.cache.after_cpu_frag(state, req, cands) - mem.cache.node_cpu_frag(state)[cands.node]
                delta += self.cpu_weight * rate * cpu_frag
        if self.stranding_weight:
            # frag_delta above refreshed the cache's per-node idle totals (free slices, usable units)
            stranded_host = host_stranding_change(state, req, cands, mem.current(state), mem.cache.total,
                                                  mem.cache.need, mem.cache.table)
            delta += self.stranding_weight * stranded_host
        # The cluster's free slices, summed once for the terms below that read it.
        free = usable_free_slices(state) if self.shape_reach_weight and req.gpus and target.multi_gpu else None
        if req.owner and req.gpus:
            delta += self._owner_terms(state, req, cands, target, free)
        if free is not None:
            delta += self.shape_reach_weight * shape_reach_change(state, req, cands, target, free, self.unseen_bound)
        level = levels(sigmoid_score(delta, state.slices_per_gpu))
        if self.any_fit:
            level[idle_gpu_openers(state, req, cands)] = 0.0
        out = 0.49 * level / 100.0
        if req.gpus == 0:
            return np.asarray(out, dtype=np.float64)
        inside = level >= level.max() - self.window_for(state.slices_per_gpu)
        low = target.fractional_threshold(self.quantile, state.slices_per_gpu)
        d = leftover_sumsq_change(state, req, cands, low) + stranded
        out[inside] = _rank_scores(-d[inside], level[inside])
        return np.asarray(out, dtype=np.float64)

    def _owner_terms(self, state: ClusterState, req: PackRequest, cands: Candidates, target: TargetWorkload,
                     free: float | None = None) -> F64:
        """Point 6: the owner-spread change and the other owners' reach, weighted per candidate (a
        MIG candidate by :func:`owner_reach_weight`, any other by the owner's share) and per shape
        of the other owner by its part of that owner's pods. ``free``: :func:`usable_free_slices`,
        if the caller has it."""
        out = np.zeros(len(cands))
        mig = (state.unit_kind[cands.units] == KIND_MIG).all(axis=1)
        share = target.owner_share(req.owner)
        if share > 0.0 and self.owner_weight:
            out += self.owner_weight * np.where(mig, 0.0, share) * owner_spread_change(state, req, cands)
        if not self.reach_weight:
            return out
        others = target.other_owners(req.owner, OWNER_LIMIT, OWNER_MIN_SHARE)
        if not others:
            return out
        any_mig = bool(mig.any())
        if any_mig and free is None:
            free = usable_free_slices(state)
        weighted: list[tuple[float | F64, PackRequest]] = []
        # MIG candidates' weights scan the whole cluster per shape; that scan then serves the
        # reach change too. Without them the change scans the candidates' nodes only.
        accepts: list[B | None] = []
        for s, o in others:  # each shape the owner's pods ask, by its part of them
            for part, shape in target.owner_mixture(o):
                acc = state.unit_accepts(shape) if any_mig else None
                w: float | F64 = part * s
                if acc is not None:
                    w = np.where(mig, part * owner_reach_weight(state, target, shape, free, acc), w)
                weighted.append((w, shape))
                accepts.append(acc)
        return out + self.reach_weight * owner_reach_change(state, req, cands, weighted, accepts)


POLICY = Fragmentation()
