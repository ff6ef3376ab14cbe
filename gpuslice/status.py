"""The operator's view of the cluster: every GPU and its slices, who holds them, what is free and
stranded, where assignment and ``allocated`` disagree, and each Pending pod with its reason and the
smallest change that lets it in.

``gpu-slice status`` (live or from a dump) and the extender's slice map both build it here, from a
:class:`gpuslice.view.ClusterView` and its :class:`gpuslice.scheduler.Scheduler`, so they show the
same thing the extender decides on. Nothing is re-derived: holdings come from the counting rule
(:mod:`gpuslice.counting`, through the view), free slices from the packing state, fit from
:meth:`ClusterState.fit`, reasons from :mod:`gpuslice.reasons`, victims from
:mod:`gpuslice.preemption`, new capacity from :mod:`gpuslice.remedies`.

*Stranded* slices are free, healthy slices that no shape can use: neither a Pending pod's nor that
of any pod in the cluster (its slices, memory floor, isolation, products, CPU and memory), so
nothing the cluster runs would ever land there as it is laid out now. Suggestions, smallest change
first: re-cut an idle MIG GPU (nobody is disturbed), evict the fewest lower-priority pods, add a
node of a product that takes the pod.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
from numpy.typing import NDArray

from gpuslice.counting import Claim
from gpuslice.errors import GpuSliceError
from gpuslice.miglayout import Recut, RecutAdvisor
from gpuslice.model import Gpu
from gpuslice.packing.state import KIND_MIG, KIND_MPS, KIND_WHOLE, Fit, PackRequest
from gpuslice.pods import PodInfo
from gpuslice.preemption import victims_on
from gpuslice.reasons import explain
from gpuslice.remedies import fitting_products
from gpuslice.rules import isolation_allows
from gpuslice.scheduler import Scheduler, held_requests
from gpuslice.units import format_mib
from gpuslice.view import ClusterView

STATUS_VERSION = "gpu-slice.example.com/v1"

#: Why a slice pod is Pending, in one word: its request cannot be read (``invalid``), the extender
#: holds a placement for it until kube-scheduler binds (``reserved``), it fits now and kube-scheduler
#: has not placed it yet (``fits``), no node advertises slices (``no-nodes``), or every node refuses
#: it (``refused``: the node reasons say why).
CAUSES = ("invalid", "reserved", "fits", "no-nodes", "refused")

#: How many refused nodes an eviction search tries per Pending pod shape, as kube-scheduler's
#: preemption does (DefaultPreemption's minCandidateNodesAbsolute 100 and minCandidateNodesPercentage
#: 10 %): at least this many, or 10 % of the nodes when that is more.
EVICTION_NODES = 100


@dataclass(frozen=True, slots=True)
class Holder:
    """One pod (or a filter-time reservation) holding slices of a unit."""

    pod: str  # namespace/name
    uid: str
    slices: int
    source: str  # allocated | assignment | reserved
    ids: tuple[str, ...]

    @property
    def namespace(self) -> str:
        return self.pod.split("/", 1)[0]


@dataclass(frozen=True, slots=True)
class UnitStatus:
    """A MIG instance, or an MPS or whole GPU: what a pod is placed on."""

    uuid: str
    profile: str  # MIG profile, "" for an MPS or whole GPU
    start: int  # MIG memory-slice start, -1 otherwise
    slices: int
    memory_mib: int
    free: int
    stranded: int
    holders: tuple[Holder, ...]


@dataclass(frozen=True, slots=True)
class GpuStatus:
    uuid: str
    index: int
    product: str
    mode: str
    slices: int
    memory_mib: int
    healthy: bool
    cordoned: bool
    units: tuple[UnitStatus, ...]

    @property
    def free(self) -> int:
        return sum(u.free for u in self.units) if self.healthy and not self.cordoned else 0


@dataclass(frozen=True, slots=True)
class NodeStatus:
    name: str
    product: str
    error: str
    gpus: tuple[GpuStatus, ...]


@dataclass(frozen=True, slots=True)
class Disagreement:
    """A pod whose ``allocated`` ids (what kubelet gave) differ from its assignment's."""

    pod: str
    uid: str
    node: str
    assigned: tuple[str, ...]
    allocated: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Suggestion:
    """One change that lets a Pending pod in: ``recut`` (node, GPU, profile), ``evict`` (node, pods),
    ``add-node`` (product), or ``fix`` (the pod itself)."""

    kind: str
    text: str
    node: str = ""
    gpu: str = ""
    profile: str = ""
    product: str = ""
    pods: tuple[str, ...] = ()
    uids: tuple[str, ...] = ()
    #: ``recut``: the GPU's whole MIG layout afterwards, (profile, start) per instance.
    layout: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class PendingPod:
    pod: str
    uid: str
    slices: int
    memory: str  # the floor as asked, "" for none
    isolation: str
    priority: int
    reason: str  # one line: the most common node reason, or the pod's own error
    reasons: dict[str, int]  # node reason -> how many nodes give it
    suggestions: tuple[Suggestion, ...]
    cause: str = ""  # one of CAUSES: why it is Pending, in one word


@dataclass(frozen=True, slots=True)
class Capacity:
    """Cluster totals in slices: ``free`` is healthy and uncordoned; ``stranded`` is part of it."""

    slices: int = 0
    held: int = 0
    free: int = 0
    stranded: int = 0
    unavailable: int = 0
    gpus: int = 0
    shapes: int = 0  # distinct pod shapes the stranded count was judged against


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    time: datetime
    capacity: Capacity
    nodes: tuple[NodeStatus, ...]
    pending: tuple[PendingPod, ...]
    disagreements: tuple[Disagreement, ...]
    problems: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (``-o json|yaml``, the slice map's API)."""
        out = asdict(self)
        out["time"] = self.time.astimezone(UTC).isoformat().replace("+00:00", "Z")
        return {"apiVersion": STATUS_VERSION, "kind": "ClusterStatus", **out}


# --------------------------------------------------------------------------- building

def _shape(req: PackRequest) -> PackRequest:
    """A request as a shape: the owner-spread rule and identity do not belong to it."""
    return replace(req, owner="", uid="")


Packed = tuple[PodInfo, PackRequest | None]  # a pod's projection and its (interned) shape


def _packed(info: PodInfo, slices_per_gpu: int, owner_spread: bool, intern: dict[PackRequest, PackRequest]
            ) -> tuple[PackRequest | None, PackRequest | None]:
    """A slice pod's packing request (None: it cannot be met as written) and its shape, one object per
    distinct shape (``intern``), so shapes are told apart by identity without hashing each again."""
    if info.error:
        return None, None
    try:
        req = info.pack(slices_per_gpu, owner_spread=owner_spread)
    except GpuSliceError:
        return None, None
    shape = _shape(req)
    return req, intern.setdefault(shape, shape)


def _shapes_and_pending(scanned: Iterable[tuple[PodInfo, bool]], slices_per_gpu: int, owner_spread: bool,
                        cache: dict[str, Packed] | None = None, intern: dict[PackRequest, PackRequest] | None = None
                        ) -> tuple[dict[PackRequest, None], list[tuple[PodInfo, PackRequest | None]]]:
    """From the pods as scanned (projection, no claim): the distinct shapes of the cluster's slice pods
    (what stranded is judged against), and its Pending slice pods with their requests (None: it cannot
    be met as written). Projections are immutable, so this needs no hold. ``cache`` (pod UID -> its
    last projection and shape) is kept to the pods counted, in place: a pod whose projection is the
    same object as last time is not packed again, unless it is Pending; shapes are interned in
    ``intern`` (one object per distinct shape, whatever the number of pods)."""
    interned: dict[PackRequest, PackRequest] = {} if intern is None else intern
    pending_info = []
    by_id: dict[int, PackRequest] = {}
    counted: list[str] = []
    for info, unclaimed in scanned:
        if info.terminal or (info.request is None and not info.error):
            continue
        pending = not info.node and unclaimed
        hit = cache.get(info.uid) if cache is not None else None
        req: PackRequest | None = None
        if hit is not None and hit[0] is info:
            shape = hit[1]
            if pending:  # only a Pending pod's own request is needed again (they are few)
                req, _ = _packed(info, slices_per_gpu, owner_spread, interned)
        else:
            req, shape = _packed(info, slices_per_gpu, owner_spread, interned)
            if cache is not None:
                cache[info.uid] = (info, shape)
        counted.append(info.uid)
        if shape is not None:
            by_id[id(shape)] = shape
        if pending:
            pending_info.append((info, req))
    if cache is not None and len(cache) != len(counted):  # pods gone (or no longer slice pods) since
        keep = set(counted)
        for uid in [u for u in cache if u not in keep]:
            del cache[uid]
    return dict.fromkeys(by_id.values()), pending_info


def _usable_by(view: ClusterView, shapes: Iterable[PackRequest],
               hold: Callable[[], AbstractContextManager[Any]] = nullcontext) -> NDArray[np.bool_]:
    """Per unit row: some shape could be placed there now (the state's own fit, CPU and memory of
    the unit's node included). One shape's fit per ``hold``."""
    found: list[NDArray[np.intp]] = []
    for shape in shapes:
        with hold():
            st = view.state
            fit = st.fit(shape)
            if fit.unit_ok.shape[0] == 0:
                continue
            rows = np.flatnonzero(fit.unit_ok[: st.n_units])
            if rows.shape[0]:
                found.append(rows[fit.feasible[st.unit_node[rows]]])
    with hold():
        out = np.zeros(view.state.n_units + 1, dtype=bool)  # rows only ever get appended
    for rows in found:
        out[rows[rows < out.shape[0]]] = True
    return out


def _holders(view: ClusterView, name: str) -> dict[str, list[tuple[str, str]]]:
    """Per id owner (GPU or MIG UUID): (slice id, holder UID) as the view counts them."""
    out: dict[str, list[tuple[str, str]]] = {}
    for sid, uid in view.nodes[name].held.items():
        out.setdefault(sid.rsplit("::", 1)[0], []).append((sid, uid))
    return out


def _claims(view: ClusterView, name: str, uids: Iterable[str]) -> dict[str, Claim]:
    """The pods' claims on this node, for those that hold ids here (the view settled them when it
    last counted the node, so their sources are what the counting rule used)."""
    out: dict[str, Claim] = {}
    for uid in uids:
        claim = view.claim(uid)
        if claim is not None and claim.node == name:
            out[uid] = claim
    return out


def _holder_list(view: ClusterView, claims: Mapping[str, Claim], held: list[tuple[str, str]]) -> tuple[Holder, ...]:
    by_uid: dict[str, list[str]] = {}
    for sid, uid in held:
        by_uid.setdefault(uid, []).append(sid)
    out = []
    for uid, sids in sorted(by_uid.items(), key=lambda t: (min(t[1]), t[0])):
        c = claims.get(uid)
        info = view.pod(uid)
        label = c.pod if c is not None else info.label if info is not None else uid
        out.append(Holder(label, uid, len(sids), c.source if c is not None else "reserved", tuple(sorted(sids))))
    return tuple(out)


def _units(view: ClusterView, name: str, gpu: Gpu, usable_by: NDArray[np.bool_],
           held: dict[str, list[tuple[str, str]]], claims: Mapping[str, Claim]) -> tuple[UnitStatus, ...]:
    st = view.state
    keys = view.nodes[name].keys
    parts = ([(i.uuid, i.profile, i.start, i.compute_slices, i.memory_mib) for i in gpu.instances]
             if gpu.mode == "mig" else [(gpu.uuid, "", -1, gpu.slices, gpu.memory_mib)])
    out = []
    for uuid, profile, start, slices, memory in parts:
        row = keys.get(uuid)
        free = int(st.unit_free[row]) if row is not None else 0
        ok = row is not None and bool(st.unit_usable[row])
        # a row appended since usable_by was worked out counts as usable: never called stranded unseen
        stranded = free if ok and free and row < usable_by.shape[0] and not usable_by[row] else 0
        out.append(UnitStatus(uuid, profile, start, slices, memory, free, stranded,
                              _holder_list(view, claims, held.get(uuid, []))))
    return tuple(out)


def _disagreements(name: str, claims: Mapping[str, Claim]) -> list[Disagreement]:
    out = []
    for uid, c in sorted(claims.items()):
        if c.assignment is not None and c.allocated is not None and \
                frozenset(c.assignment.slice_ids) != frozenset(c.allocated.slice_ids):
            out.append(Disagreement(c.pod, uid, name, tuple(sorted(c.assignment.slice_ids)),
                                    tuple(sorted(c.allocated.slice_ids))))
    return out


def build_status(view: ClusterView, sched: Scheduler, now: float, *,
                 max_suggestions: int | None = None, eviction_nodes: int | None = None,
                 hold: Callable[[], AbstractContextManager[Any]] = nullcontext) -> ClusterStatus:
    """The whole picture at ``now`` (seconds since the epoch, the caller's clock).

    ``max_suggestions``: work out suggestions for at most this many Pending pods (highest priority,
    then oldest, first; the slice map bounds its cost with it), the rest get reasons only.
    ``eviction_nodes``: refused nodes an eviction search tries per pod shape (default: kube-scheduler's
    own sample, ``EVICTION_NODES`` or 10 % of the nodes); Pending pods of one shape and priority share
    one search, as nothing changes between them.
    ``hold``: entered around each step (the pod scan, one node, one Pending pod) that reads the view; a
    live service passes its lock, so its verbs wait for one step at most, never for the whole picture.
    Each node and each Pending pod is then consistent in itself; the picture as a whole may straddle
    events that arrived between steps, as any live listing does."""
    with hold():
        view.expire(now)
        scanned = [(p.info, p.claim is None) for p in view.pods.values()]
        names = sorted(view.nodes)
    # pod projections are immutable: no hold needed to read them
    shapes, pending_info = _shapes_and_pending(scanned, view.settings.slices_per_gpu, sched.owner_spread)
    usable_by = _usable_by(view, shapes, hold)
    nodes: list[NodeStatus] = []
    disagreements: list[Disagreement] = []
    cap = Capacity(shapes=len(shapes))
    totals = Counter[str]()
    idle_mig: list[tuple[str, int, Gpu]] = []  # (node, row, GPU): MIG GPUs no pod or reservation holds
    for name in names:
        with hold():
            n = view.nodes.get(name)
            if n is None:
                continue  # removed since the scan
            inv = n.info.inventory
            if inv is None and not n.info.error:
                continue  # not a GPU node of ours
            gpus: list[GpuStatus] = []
            if inv is not None and n.row >= 0:
                held = _holders(view, name)
                claims = _claims(view, name, set(n.held.values()))
                for gpu in sorted(inv.gpus, key=lambda g: g.index):
                    units = _units(view, name, gpu, usable_by, held, claims)
                    if gpu.mode == "mig" and gpu.schedulable and not any(u.holders for u in units):
                        idle_mig.append((name, n.row, gpu))
                    g = GpuStatus(gpu.uuid, gpu.index, gpu.product, gpu.mode, gpu.slices, gpu.memory_mib,
                                  gpu.healthy, gpu.cordoned, units)
                    gpus.append(g)
                    totals["gpus"] += 1
                    totals["slices"] += gpu.slices
                    totals["held"] += sum(h.slices for u in units for h in u.holders)
                    if gpu.schedulable:
                        totals["free"] += sum(u.free for u in units)
                        totals["stranded"] += sum(u.stranded for u in units) if shapes else 0
                    else:
                        totals["unavailable"] += sum(u.free for u in units)
                disagreements += _disagreements(name, claims)
            nodes.append(NodeStatus(name, n.info.spec.product, n.info.error, tuple(gpus)))
    cap = replace(cap, **{k: int(v) for k, v in totals.items()})
    pending_info.sort(key=lambda t: (-t[0].priority, t[0].created, t[0].label))
    with hold():
        alive = int(view.state.node_alive[: view.state.n_nodes].sum())
    search = _Search(eviction_nodes if eviction_nodes is not None else max(EVICTION_NODES, alive // 10), idle_mig)
    if any(req is not None and _mig_able(req) for _, req in pending_info) and any(
            g.mode == "mig" for n in nodes for g in n.gpus):
        search.advisor = _advisor(scanned, view, sched.owner_spread)
        with hold():
            search.advisor.read_slots(view)
    pending: list[PendingPod] = []
    for i, (info, req) in enumerate(pending_info):
        with hold():
            now_pod = view.pods.get(info.uid)
            if now_pod is None or now_pod.info.node or now_pod.claim is not None:
                continue  # deleted or placed since the scan
            pending.append(_pending(view, info, req, now, search,
                                    suggest=max_suggestions is None or i < max_suggestions))
    with hold():
        problems = tuple(view.problems())
    when = datetime.fromtimestamp(now, UTC)
    return ClusterStatus(when, cap, tuple(nodes), tuple(pending), tuple(disagreements), problems)


# --------------------------------------------------------------------------- the cheap summary

_KIND_NAMES = {KIND_MPS: "mps", KIND_WHOLE: "whole", KIND_MIG: "mig"}


@dataclass(frozen=True, slots=True)
class Summary:
    """What gauges need of the status, without its per-GPU rows or suggestions: stranded slices by
    (product, mode), exactly as :func:`build_status` counts them, and each Pending slice pod's cause
    (``CAUSES``) with, when every node refuses it, the most common node reason."""

    stranded: dict[tuple[str, str], int]
    pending: tuple[tuple[str, str], ...]
    shapes: int


class Summarizer:
    """Builds :class:`Summary` over a view, cheaply enough for every metrics scrape: the stranded test
    and the Pending reasons are :func:`build_status`'s own (:func:`_usable_by`, :func:`_why`), steps
    are held one at a time as :func:`build_status` holds them, each pod is packed again only when its
    projection changed (outside any hold), and Pending pods of one request share one reason."""

    def __init__(self) -> None:
        self._cache: dict[str, Packed] = {}
        self._intern: dict[PackRequest, PackRequest] = {}

    def summary(self, view: ClusterView, sched: Scheduler, now: float, *,
                hold: Callable[[], AbstractContextManager[Any]] = nullcontext) -> Summary:
        with hold():
            view.expire(now)
            scanned = [(p.info, p.claim is None) for p in view.pods.values()]
        shapes, pending_info = _shapes_and_pending(scanned, view.settings.slices_per_gpu, sched.owner_spread,
                                                   self._cache, self._intern)
        if len(self._intern) > 4 * len(shapes) + 1024:  # shapes that no pod has any more
            self._intern = {shape: shape for _, shape in self._cache.values() if shape is not None}
        stranded: Counter[tuple[str, str]] = Counter()
        if shapes:
            usable_by = _usable_by(view, shapes, hold)
            with hold():
                st = view.state
                live = st.node_units[: st.n_nodes][st.node_alive[: st.n_nodes]]
                rows = live[(live >= 0) & (live < usable_by.shape[0])]  # a row appended since is not judged
                rows = rows[st.unit_usable[rows] & (st.unit_free[rows] > 0) & ~usable_by[rows]]
                for row in rows.tolist():
                    key = (st.products[int(st.node_product[st.unit_node[row]])], _KIND_NAMES[int(st.unit_kind[row])])
                    stranded[key] += int(st.unit_free[row])
        memo: dict[PackRequest, tuple[str, str]] = {}
        pending: list[tuple[str, str]] = []
        for info, req in pending_info:
            same = replace(req, uid="") if req is not None else None
            with hold():
                now_pod = view.pods.get(info.uid)
                if now_pod is None or now_pod.info.node or now_pod.claim is not None:
                    continue  # deleted or placed since the scan
                if same is not None and same in memo and view.reservations.get(info.uid) is None:
                    got = memo[same]
                else:
                    why = _why(view, info, req)
                    got = (why.cause, next(iter(why.counts)) if why.cause == "refused" else "")
                    if same is not None and why.cause != "reserved":
                        memo[same] = got
            pending.append(got)
        return Summary(dict(stranded), tuple(pending), len(shapes))


# --------------------------------------------------------------------------- Pending pods

class _Search:
    """What suggestions share within one status: the idle MIG GPUs, and eviction answers by (request
    without its UID, priority), at most ``nodes`` refused nodes tried each, stopping at a one-pod
    answer (none has fewer)."""

    def __init__(self, nodes: int, idle_mig: list[tuple[str, int, Gpu]]) -> None:
        self.nodes = nodes
        self.idle_mig = idle_mig
        self.found: dict[tuple[PackRequest, int], Suggestion | None] = {}
        self.advisor: RecutAdvisor | None = None  # set when a Pending pod could take a MIG instance
        self.recuts: dict[PackRequest, Recut | None] = {}

    def best(self, view: ClusterView, info: PodInfo, req: PackRequest, resolvable: list[int],
             now: float) -> Suggestion | None:
        key = (replace(req, uid=""), info.priority)
        if key not in self.found:
            self.found[key] = _evict(view, info, req, resolvable[: self.nodes], now)
        return self.found[key]


@dataclass(frozen=True, slots=True)
class _Why:
    """Why one Pending pod waits: its cause (one of ``CAUSES``), the sentence, the node reasons and
    their counts, and (refused) the fit and the node rows some eviction could open."""

    cause: str
    reason: str
    counts: dict[str, int]
    fit: Fit | None = None
    resolvable: tuple[int, ...] = ()


def _why(view: ClusterView, info: PodInfo, req: PackRequest | None) -> _Why:
    """The one rule of why a Pending slice pod waits (status, the slice map and the gauges read it)."""
    if req is None:
        reason = info.error or "the pod's slice request cannot be read"
        return _Why("invalid", reason, {reason: 1})
    held = view.reservations.get(info.uid)
    if held is not None:
        reason = f"reserved on node {held.node} at filter; waiting for kube-scheduler's bind"
        return _Why("reserved", reason, {reason: 1})
    st = view.state
    fit = st.fit(req)
    alive = np.flatnonzero(st.node_alive[: st.n_nodes])
    feasible = alive[fit.feasible[alive]]
    if feasible.shape[0]:
        reason = (f"fits on {feasible.shape[0]} node(s) now; kube-scheduler has not placed it yet (its own checks, "
                  "such as taints, affinity or the queue's back-off, decide when)")
        return _Why("fits", reason, {reason: 1})
    if alive.shape[0] == 0:
        reason = "no node advertises GPU slices"
        return _Why("no-nodes", reason, {reason: 1}, fit)
    ex = explain(st, req, fit, alive.astype(np.int64))
    counts = dict(Counter(ex.texts).most_common())
    resolvable = tuple(int(v) for v, hard in zip(ex.rows, ex.unresolvable, strict=True) if not hard)
    reason = f"0/{alive.shape[0]} nodes: " + "; ".join(f"{n} x {t}" for t, n in counts.items())
    return _Why("refused", reason, counts, fit, resolvable)


def _pending(view: ClusterView, info: PodInfo, req: PackRequest | None, now: float, search: _Search, *,
             suggest: bool) -> PendingPod:
    request = info.request
    slices = request.slices if request is not None else 0
    memory = format_mib(float(request.memory_mib)) if request is not None and request.memory_mib else ""
    isolation = request.isolation if request is not None else ""
    why = _why(view, info, req)
    suggestions: tuple[Suggestion, ...] = ()
    if why.cause == "invalid":
        suggestions = (Suggestion("fix", f"fix the pod: {why.reason}"),)
    elif suggest and req is not None and why.fit is not None:
        suggestions = tuple(_suggest(view, info, req, why.fit, list(why.resolvable), now, search))
    return PendingPod(info.label, info.uid, slices, memory, isolation, info.priority, why.reason, why.counts,
                      suggestions, why.cause)


def _suggest(view: ClusterView, info: PodInfo, req: PackRequest, fit: Fit, resolvable: list[int],
             now: float, search: _Search) -> list[Suggestion]:
    """Smallest change first: a re-cut disturbs nobody, an eviction some pods, a node costs money."""
    out: list[Suggestion] = []
    recut = _recut(view, req, search)
    if recut is not None:
        out.append(recut)
    evict = search.best(view, info, req, resolvable, now)
    if evict is not None:
        out.append(evict)
    st = view.state
    present = frozenset(p for p in st.products if p)
    products = fitting_products(req, view.settings.slices_per_gpu, view.settings.memory_tolerance, present)
    if products:
        best = products[0]
        out.append(Suggestion("add-node", f"add a node with {best.describe(req.gpus)} and room for "
                                          f"{req.cpu_milli}m CPU and {req.memory_mib} MiB of memory",
                              product=best.product))
    elif not out:
        out.append(Suggestion("fix", "no GPU product in the catalogue takes this request as written: lower its "
                                     "slices or memory floor, or widen its isolation or products"))
    return out


def _mig_able(req: PackRequest) -> bool:
    return req.gpus == 1 and isolation_allows("mig", req.isolation)


def _advisor(scanned: Iterable[tuple[PodInfo, bool]], view: ClusterView, owner_spread: bool) -> RecutAdvisor:
    """The core's re-cut planner, its demand learned from the pods that hold slices (as the extender's
    warm start observes them), outside any hold."""
    held = held_requests((info for info, unclaimed in scanned if not unclaimed), view.settings.slices_per_gpu,
                         owner_spread=owner_spread)
    return RecutAdvisor(held, memory_tolerance=view.settings.memory_tolerance)


def _recut(view: ClusterView, req: PackRequest, search: _Search) -> Suggestion | None:
    """The re-cut of free MIG slots the extender's own planner (:class:`gpuslice.miglayout.LayoutPlanner`)
    would make for this pod: free instances destroyed, the instance it needs created, nothing any pod
    holds or a reservation keeps touched. On an idle GPU that is a re-cut of the whole GPU."""
    if search.advisor is None or not _mig_able(req):
        return None
    key = replace(req, uid="")
    if key not in search.recuts:  # Pending pods of one shape get one answer, as for evictions
        search.recuts[key] = search.advisor.for_pod(view, req)
    cut = search.recuts[key]
    if cut is None or cut.target is None:
        return None
    return Suggestion("recut", _recut_text(view, cut, search), node=cut.node, gpu=cut.gpu, profile=cut.target[0],
                      product=cut.product, layout=tuple(cut.wanted))


def _recut_text(view: ClusterView, cut: Recut, search: _Search) -> str:
    node = view.nodes.get(cut.node)
    inv = node.info.inventory if node is not None else None
    gpu = next((g for g in inv.gpus if g.uuid == cut.gpu), None) if inv is not None else None
    now = ", ".join(i.profile for i in gpu.instances) if gpu is not None and gpu.instances else "no instances"
    idle = any(g.uuid == cut.gpu for _, _, g in search.idle_mig)
    where = (f"idle MIG GPU {cut.gpu_index} ({cut.gpu})" if idle else
             f"the free MIG slots of GPU {cut.gpu_index} ({cut.gpu})")
    made = ", ".join(p for p, _ in cut.create)
    gone = f"destroy {len(cut.destroy)} free instance{'s' if len(cut.destroy) != 1 else ''}, " if cut.destroy else ""
    assert cut.target is not None
    return (f"re-cut {where} on node {cut.node} (now {now}) to include a {cut.target[0]} instance: "
            f"{gone}create {made}")


def _label(view: ClusterView, uid: str) -> tuple[str, int]:
    p = view.pod(uid)
    return (p.label, p.priority) if p is not None else (uid, 0)


def _evict(view: ClusterView, info: PodInfo, req: PackRequest, resolvable: list[int],
           now: float) -> Suggestion | None:
    """The node where the fewest lower-priority pods make room (the core's preemption rule)."""
    st = view.state
    best: tuple[tuple[int, int, str], str, list[str]] | None = None
    budgets = list(view.budgets.values())
    for v in resolvable:
        name = st.node_names[v]
        found = victims_on(view, req, info.priority, name, budgets)
        if found is None:
            continue
        victims = [p.uid for p in found.victims]  # most important first
        key = (len(victims), sum(_label(view, u)[1] for u in victims), name)
        if best is None or key < best[0]:
            best = (key, name, victims)
        if len(victims) == 1:
            break  # no node needs fewer
    if best is None:
        return None
    _, name, victims = best
    who = [_label(view, u) for u in victims]
    listed = ", ".join(f"{label} (priority {prio})" for label, prio in who)
    return Suggestion("evict", f"evict {len(victims)} lower-priority pod{'s' if len(victims) > 1 else ''} on node "
                               f"{name}: {listed}", node=name, pods=tuple(label for label, _ in who),
                      uids=tuple(victims))


__all__ = ["CAUSES", "STATUS_VERSION", "Capacity", "ClusterStatus", "Disagreement", "GpuStatus", "Holder", "NodeStatus",
           "PendingPod", "Suggestion", "Summarizer", "Summary", "UnitStatus", "build_status"]
