"""The decision API: filter, prioritize, bind check and preempt, for the extender and the simulator.

Start here. kube-scheduler asks the extender four things about a pod; each is one method of
:class:`Scheduler`, which holds the cluster (a live :class:`gpuslice.view.ClusterView`, or a
:class:`PackedCluster` over a bare array state for trace replays), the configured policies with
what they have learned, and the narrowing rule:

* :meth:`Scheduler.filter`: per node, feasible or not with a reason (:mod:`gpuslice.reasons`),
  unresolvable where no change of usage could help; narrowed to the best node(s) in the extender's
  consistent order (DESIGN 4), and the chosen placement reserved for the pod's UID;
* :meth:`Scheduler.prioritize`: 0..10 per node, the chosen node first;
* :meth:`Scheduler.bind_check`: the placement to write at ``/bind`` (the reservation, else the
  best free one), after fencing and the same-size rule, as an :class:`Assignment`;
* :meth:`Scheduler.preempt`: per node kube-scheduler proposes, the lower-priority pods whose eviction
  frees one valid placement, by kube-scheduler's rules (:mod:`gpuslice.preemption`);
  :meth:`Scheduler.shape_preemption` and :meth:`Scheduler.nominate`: the same rules for the shortfall
  kube-scheduler never asks about (enough slices by count, none in a usable shape), with the freed
  slices held for the preemptor.

The ``*_request`` methods take a :class:`PackRequest` and node rows; the simulator calls those.
The pod-level methods take a pod mapping and node names; the extender calls those. Both run the
same code below them, so what ``gpu-slice simulate`` predicts is what the extender does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import repeat
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from gpuslice import noderules
from gpuslice.annotations import Assignment
from gpuslice.config import Config, default_config
from gpuslice.counting import bind_conflicts, unstamped_same_size
from gpuslice.decision import NarrowConfig, NodeBest, best_per_node, narrowed_filter, node_key, priority_scores
from gpuslice.disruption import Budget
from gpuslice.errors import GpuSliceError, RequestError
from gpuslice.packing.first_fit import PublishedOrder
from gpuslice.packing.state import Candidates, ClusterState, Fit, PackRequest, enumerate_candidates
from gpuslice.placement import Placement
from gpuslice.pods import PodInfo, project
from gpuslice.policies.base import PolicyContext
from gpuslice.policies.registry import Weighted, resolve
from gpuslice.preemption import NOMINATION_TTL_S, NodeVictims, pick_node, victims_on
from gpuslice.reasons import Explained, explain
from gpuslice.requests import SliceRequest
from gpuslice.reservations import DEFAULT_TTL_S, Reservation, Reservations
from gpuslice.rules import mps_share_mib
from gpuslice.view import ClusterView

I64 = NDArray[np.int64]
F64 = NDArray[np.float64]

NARROWED_OUT = "fits, but gpu-slice hands kube-scheduler only the best-packed node"
UNKNOWN_NODE = "node is not known to gpu-slice yet (its watch has not seen it)"
WAITING = "the slices gpu-slice preempted here are held for this pod; waiting for the preempted pods to leave"


class Holder(Protocol):
    """What the scheduler needs of a cluster: its array state and a way to hold reservations."""

    state: ClusterState
    reservations: Reservations

    def hold(self, r: Reservation) -> None: ...

    def release(self, uid: str) -> Reservation | None: ...

    def expire(self, now: float) -> None: ...


class PackedCluster:
    """A bare array state (trace replays): reservations applied with ``take``/``give_back``."""

    def __init__(self, state: ClusterState, reservation_ttl_s: float = DEFAULT_TTL_S) -> None:
        self.state = state
        self.reservations = Reservations(reservation_ttl_s)
        self._keys: dict[tuple[int, str, str], int] = {}
        self._layout = -1

    def rows(self, r: Reservation) -> list[int]:
        st = self.state
        if self._layout != st.layout_version:
            self._keys = {(int(st.unit_node[u]), st.unit_gpu[u], st.unit_instance[u]): u for u in range(st.n_units)}
            self._layout = st.layout_version
        v = st.node_index[r.node]
        return [self._keys[(v, gpu, inst)] for gpu, inst in r.units]

    def hold(self, r: Reservation) -> None:
        self.release(r.uid)
        self.state.take(self.state.node_index[r.node], self.rows(r), r.slices, r.cpu_milli, r.memory_mib, r.owner)
        self.reservations.add(r)

    def release(self, uid: str) -> Reservation | None:
        r = self.reservations.pop(uid)
        if r is not None:
            self.state.give_back(self.state.node_index[r.node], self.rows(r), r.slices, r.cpu_milli, r.memory_mib,
                                 r.owner)
        return r

    def bind(self, uid: str) -> Reservation | None:
        """The pod was bound as reserved: the hold becomes the pod's own (the state keeps it)."""
        return self.reservations.pop(uid)

    def expire(self, now: float) -> None:
        for r in self.reservations.due(now):
            self.state.give_back(self.state.node_index[r.node], self.rows(r), r.slices, r.cpu_milli,
                                 r.memory_mib, r.owner)


@dataclass(frozen=True, slots=True)
class Ranked:
    """A request's feasible placements and each node's best: what filter and prioritize share."""

    fit: Fit
    cands: Candidates
    best: NodeBest
    score: F64
    secondary: F64
    parts: Mapping[str, F64] = field(default_factory=dict)  # each policy's own score per candidate

    def breakdown(self, i: int) -> dict[str, float]:
        """Candidate ``i``'s score per policy and the combined ``total``: the assignment's ``scores``."""
        out = {name: round(float(arr[i]), 6) for name, arr in self.parts.items()}
        out["total"] = round(float(self.score[i]), 6)
        return out


@dataclass(frozen=True, slots=True)
class Cycle:
    """The last filter's ranking of one pod, which ``prioritize`` for the same pod reuses while
    nothing changed in between (kube-scheduler's CycleState: a pod's filter and score read one
    snapshot). ``token`` is what must be unchanged; ``mask``: the rows it ranked (None = all)."""

    req: PackRequest
    token: tuple[int, int, int, object]
    mask: NDArray[np.bool_] | None
    ranked: Ranked


@dataclass(frozen=True, slots=True)
class FilterResult:
    """``feasible``: node names handed to kube-scheduler, best first; ``failed`` and
    ``unresolvable``: name -> reason; ``error``: the pod itself cannot be scheduled as written."""

    feasible: tuple[str, ...] = ()
    failed: Mapping[str, str] = field(default_factory=dict)
    unresolvable: Mapping[str, str] = field(default_factory=dict)
    reservation: Reservation | None = None
    error: str = ""


#: ``BindPlan.code``: a short, fixed name per kind of refusal (metric labels, rate-limited logs).
BIND_REFUSALS = ("fencing", "request", "no_slices", "assigned_elsewhere", "unknown_node", "node_unusable",
                 "node_rules", "no_fit", "same_size")


@dataclass(frozen=True, slots=True)
class BindPlan:
    """What ``/bind`` writes (``assignment``), or why it refuses (``refusal``, of kind ``code``, one of
    :data:`BIND_REFUSALS`; the scheduler retries)."""

    assignment: Assignment | None = None
    refusal: str = ""
    already: bool = False  # the pod already carries this assignment: answer without writing
    code: str = ""

    @property
    def usage_dependent(self) -> bool:
        """A refusal that a fresher view of the node's pods could turn around (worth a re-read)."""
        return self.code in ("no_fit", "same_size")


class Scheduler:
    """Decisions over one cluster with one policy mix; see the module docstring."""

    def __init__(self, cluster: Holder, policy: str | Weighted, *, narrow: NarrowConfig | None = None,
                 seed: int = 0, trace: Sequence[PackRequest] | None = None, owner_spread: bool = True,
                 devices: PublishedOrder | None = None) -> None:
        self.cluster = cluster
        #: ``None``: the extender picks any device (today). Set: DRA picks, first fit in this published
        #: order, and each node is scored by the device it would give (:mod:`gpuslice.packing.first_fit`).
        self.devices = devices
        self.policy = resolve(policy) if isinstance(policy, str) else policy
        self.memory = self.policy.new_memory(PolicyContext(seed, None if trace is None else list(trace)))
        self.narrow = narrow or NarrowConfig()
        self.owner_spread = owner_spread
        self._keys: I64 = np.zeros(0, dtype=np.int64)
        self._keys_for = 0
        self._names: NDArray[np.object_] = np.zeros(0, dtype=object)
        self._names_for: tuple[int, int] = (0, -1)
        #: The last two name lookups (newest last): ``/filter`` over every node and ``/prioritize`` over
        #: the nodes it passed alternate, and neither should evict the other.
        self._lookups: list[tuple[tuple[int, int], tuple[str, ...], I64]] = []
        self._observed = 0
        self._cycle: Cycle | None = None
        #: Dynamic MIG layouts (:meth:`gpuslice.miglayout.LayoutPlanner.instance_order`): among a node's
        #: equally scored candidates, the MIG instance whose use leaves the GPU's free slots most usable
        #: first; None (static layouts) leaves the policy's own order alone.
        self.instance_order: Callable[[ClusterState, PackRequest, Candidates], F64 | None] | None = None

    @classmethod
    def from_config(cls, cluster: Holder, config: Config | None = None, *, seed: int = 0) -> Scheduler:
        """Policies, narrowing and the owner rule as the config says (validated at load)."""
        config = config or default_config()
        return cls(cluster, resolve(config.policy_weights()), narrow=NarrowConfig(margin=config.narrowing.margin),
                   seed=seed, owner_spread=config.owner_spread)

    @property
    def state(self) -> ClusterState:
        return self.cluster.state

    def node_keys(self) -> I64:
        """The consistent tie-break order per node row (a name hash), kept in step with the state."""
        st = self.state
        if self._keys_for != st.generation:
            self._keys, self._keys_for = np.zeros(0, dtype=np.int64), st.generation
        if self._keys.shape[0] < st.n_nodes:
            old = self._keys.shape[0]
            self._keys = np.concatenate([self._keys, np.array([node_key(nm) for nm in st.node_names[old:]],
                                                              dtype=np.int64)])
        return self._keys

    # ----- learning ---------------------------------------------------------------------------
    def observe(self, req: PackRequest) -> None:
        """A pod arrived: policies that learn the workload see it (once per pod, before it is scored)."""
        self.policy.observe(self.memory, req)
        self._observed += 1

    def warm_start(self, reqs: Iterable[PackRequest]) -> int:
        """Learn from the pods already placed (after a restart the workload is not started from nothing)."""
        n = 0
        for req in reqs:
            self.observe(req)
            n += 1
        return n

    # ----- array level ---------------------------------------------------------------------------
    def rank(self, req: PackRequest, node_mask: NDArray[np.bool_] | None = None, *,
             every_device: bool = False) -> Ranked:
        """Fit, candidates, policy scores and each node's best placement. Under DRA (``devices``) a
        node's only candidate is the device first fit gives there, unless ``every_device`` asks for
        all (how the policy ranks devices to build the order it publishes)."""
        st = self.state
        fit = st.fit(req)
        if self.devices is None or every_device:
            cands = enumerate_candidates(st, req, fit, node_mask)
        else:
            cands = self.devices.candidates(st, req, fit, node_mask)
        if len(cands) == 0:
            return Ranked(fit, cands, best_per_node(cands, np.zeros(0)), np.zeros(0), np.zeros(0))
        score, parts = self.policy.score_parts(st, req, cands, self.memory)
        secondary = self.policy.secondary(st, req, cands, self.memory)
        if self.instance_order is not None:  # dynamic MIG layouts: the instance that keeps free slots usable
            order = self.instance_order(st, req, cands)
            if order is not None:
                secondary = before(order, secondary)
        return Ranked(fit, cands, best_per_node(cands, score, secondary), score, secondary, parts)

    def _token(self) -> tuple[int, int, int, object]:
        """Everything a ranking depends on besides the request: the state and what the policies know."""
        st = self.state
        token = self.policy.memory_token(self.memory)
        if self.devices is not None:  # a republished order changes the device each node would give
            token = (token, self.devices.version)
        return st.generation, st.changes, self._observed, token

    def _cycle_ranking(self, req: PackRequest, rows: I64) -> Ranked | None:
        """The last filter's ranking when it was of this request, covers ``rows`` and still holds."""
        cyc = self._cycle
        if cyc is None or cyc.req != req or cyc.token != self._token():
            return None
        if cyc.mask is not None and not bool(cyc.mask[rows].all()):
            return None
        return cyc.ranked

    def forget_cycle(self) -> None:
        """Drop the kept ranking (the next prioritize ranks afresh)."""
        self._cycle = None

    def narrowed(self, ranked: Ranked) -> NodeBest:
        return narrowed_filter(ranked.best, self.node_keys(), self.narrow)

    def reservation_for(self, req: PackRequest, node: int, units: Sequence[int], now: float,
                        scores: Mapping[str, float] | None = None) -> Reservation:
        """A reservation of ``units`` on node row ``node`` for ``req``, by stable keys (and ids in a view);
        ``scores``: the breakdown that chose it, which the assignment carries at bind."""
        st = self.state
        keys = tuple((st.unit_gpu[u], st.unit_instance[u]) for u in units)
        sids: tuple[str, ...] = ()
        if isinstance(self.cluster, ClusterView):
            sids = self._pick_ids(st.node_names[node], units, req.slices)
        return Reservation(req.uid, st.node_names[node], keys, req.slices, sids, req.cpu_milli, req.memory_mib,
                           req.owner, now + self.cluster.reservations.ttl_s, dict(scores or {}))

    def _pick_ids(self, name: str, units: Sequence[int], slices: int) -> tuple[str, ...]:
        view = self.cluster
        assert isinstance(view, ClusterView)
        held = view.nodes[name].held
        out: list[str] = []
        for u in units:
            free = [sid for sid in view.unit_ids(name, int(u)) if sid not in held]
            # A MIG instance or whole GPU is taken whole; an MPS GPU gives the first free ``slices``.
            out.extend(free if int(self.state.unit_cap[u]) == slices else free[:slices])
        return tuple(out)

    def filter_request(self, req: PackRequest, rows: I64 | None, now: float, *, reserve: bool = True,
                       explain_refused: bool = True) -> tuple[NodeBest, Ranked, Explained | None]:
        """The narrowed filter over node ``rows`` (None = every node): the chosen nodes, the ranking,
        and the refused rows with their reasons. Reserves the first node's best placement.

        A pod filtered again (kube-scheduler retries after a refused bind) gives up its earlier
        reservation first, so it is never refused for the slices it holds itself."""
        self.cluster.expire(now)
        held = self.cluster.reservations.get(req.uid) if req.uid else None
        if reserve and req.uid and not (held is not None and held.nominated):
            self.cluster.release(req.uid)
        st = self.state
        mask: NDArray[np.bool_] | None = None
        if rows is not None:
            mask = np.zeros(st.n_nodes, dtype=bool)
            mask[rows] = True
        ranked = self.rank(req, mask)
        chosen = self.narrowed(ranked)
        if reserve and chosen.node.shape[0] and req.uid:
            i = int(chosen.index[0])
            self.cluster.hold(self.reservation_for(req, int(ranked.cands.node[i]), ranked.cands.units[i].tolist(),
                                                   now, ranked.breakdown(i) if ranked.parts else None))
        # The token is read after the hold, which belongs to this pod's cycle: prioritize then gives
        # the other nodes the scores they had before it, what placing the pod there instead would
        # give (it is placed once, not twice).
        self._cycle = Cycle(req, self._token(), mask, ranked) if req.uid else None
        refused: Explained | None = None
        if explain_refused:
            pool = np.flatnonzero(mask) if mask is not None else np.flatnonzero(st.node_alive)
            bad = pool[~ranked.fit.feasible[pool]]
            refused = explain(st, req, ranked.fit, bad.astype(np.int64))
        return chosen, ranked, refused

    def prioritize_request(self, req: PackRequest, rows: I64, now: float) -> I64:
        """0..10 per row in ``rows``: the node the filter reserved for the pod (else the best-scoring
        one) 10, the others at most 9 by their best placement's score, nodes that cannot take it 0.

        The reservation stays in place: the reserved node gets 10 whatever it would score now, and
        the other nodes do not hold it, so their scores are what placing there would give."""
        self.cluster.expire(now)
        st = self.state
        out = np.zeros(rows.shape[0], dtype=np.int64)
        if rows.shape[0] == 0:
            return out
        held = self.cluster.reservations.get(req.uid) if req.uid else None
        lead = -1
        if held is not None and held.node in st.node_index:
            hit = np.flatnonzero(rows == st.node_index[held.node])
            lead = int(hit[0]) if hit.shape[0] else -1
        if lead >= 0 and rows.shape[0] == 1:
            out[0] = 10
            return out
        ranked = self._cycle_ranking(req, rows)
        if ranked is None:
            mask = np.zeros(st.n_nodes, dtype=bool)
            mask[rows] = True
            ranked = self.rank(req, mask)
        per_node = np.full(st.n_nodes, -1.0)
        per_node[ranked.best.node] = ranked.best.score
        scores = per_node[rows]
        ok = scores >= 0
        if lead < 0:
            if not ok.any():
                return out
            cand = np.flatnonzero(ok)
            keys = self.node_keys()[rows]
            lead = int(cand[np.lexsort((keys[cand], -scores[cand]))[0]])
        ok[lead] = True
        sub = np.flatnonzero(ok)
        scores = np.where(ok, scores, 0.0)
        out[sub] = priority_scores(scores[sub], ranked=True, lead=int(np.flatnonzero(sub == lead)[0]))
        return out

    # ----- pod level (the extender) ----------------------------------------------------------------
    def _view(self) -> ClusterView:
        if not isinstance(self.cluster, ClusterView):
            raise TypeError("pod-level decisions need a ClusterView")
        return self.cluster

    def request_of(self, pod: Mapping[str, Any] | PodInfo) -> tuple[PodInfo, PackRequest | None]:
        """The pod's projection and packing request (None: it asks no slices). ``RequestError`` when
        its request cannot be met as written (no node could ever take it)."""
        view = self._view()
        info = pod if isinstance(pod, PodInfo) else project(pod, isolation_default=view.settings.isolation_default)
        if info.request is None and not info.error:
            return info, None
        return info, info.pack(view.settings.slices_per_gpu, owner_spread=self.owner_spread)

    def _layout(self) -> tuple[int, int]:
        st = self.state
        return st.generation, st.layout_version

    def _name_array(self) -> NDArray[np.object_]:
        """Node names by row as an object array, so a set of rows turns into names in one gather."""
        if self._names_for != self._layout():
            self._names = np.array(self.state.node_names, dtype=object)
            self._names_for = self._layout()
        return self._names

    def _found(self, names: Sequence[str]) -> I64:
        """The row of each name (-1: not a live node with slices). kube-scheduler sends the same
        ``NodeNames`` for pod after pod, so the last lookup is kept until the node layout changes."""
        key = self._layout()
        as_tuple = names if isinstance(names, tuple) else tuple(names)
        for n, (k, kept, found) in enumerate(self._lookups):
            if k == key and kept == as_tuple:
                self._lookups.append(self._lookups.pop(n))
                return found
        index = self.state.node_index
        found = np.fromiter(map(index.get, as_tuple, repeat(-1)), dtype=np.int64, count=len(as_tuple))
        self._lookups = [*self._lookups[-1:], (key, as_tuple, found)]
        return found

    def _rows(self, names: Sequence[str]) -> tuple[I64, dict[str, str], dict[str, str]]:
        """The live rows among ``names`` and, for the others, why they take no slices."""
        view = self._view()
        found = self._found(names)
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        missing = np.flatnonzero(found < 0)
        if missing.shape[0] == 0:
            return found, failed, unresolvable
        for i in missing.tolist():
            name = names[i]
            err = view.node_error(name)
            if err is None:
                failed[name] = UNKNOWN_NODE
            else:
                unresolvable[name] = err or f"node {name} has no slices"
        return found[found >= 0], failed, unresolvable

    def filter(self, pod: Mapping[str, Any] | PodInfo, node_names: Sequence[str], now: float) -> FilterResult:
        """The extender's ``/filter`` for one pod over kube-scheduler's candidate nodes."""
        try:
            _, req = self.request_of(pod)
        except GpuSliceError as err:
            return FilterResult(error=str(err))
        if req is None:  # not ours to place: every node passes
            return FilterResult(feasible=tuple(node_names))
        row_arr, failed, unresolvable = self._rows(node_names)
        waiting = self._nominated(req, row_arr, now)
        if isinstance(waiting, FilterResult):
            return waiting
        if waiting is not None:  # the victims have not left the held node yet: the others may still take it
            failed = {**failed, self.state.node_names[waiting]: WAITING}
            row_arr = row_arr[row_arr != waiting]
        chosen, ranked, refused = self.filter_request(req, row_arr, now)
        names = self._name_array()
        feasible = tuple(names[chosen.node].tolist())
        if refused is not None and refused.rows.shape[0]:
            texts = np.array(refused.texts, dtype=object)
            for to, pick in ((unresolvable, refused.unresolvable), (failed, ~refused.unresolvable)):
                if pick.any():
                    to.update(zip(names[refused.rows[pick]].tolist(), texts[pick].tolist(), strict=True))
        passed = row_arr[ranked.fit.feasible[row_arr]] if row_arr.shape[0] else row_arr
        if passed.shape[0] > chosen.node.shape[0]:
            out = passed[~np.isin(passed, chosen.node)]
            failed.update(dict.fromkeys(names[out].tolist(), NARROWED_OUT))
        res = self.cluster.reservations.get(req.uid)
        return FilterResult(feasible, failed, unresolvable, res)

    def _nominated(self, req: PackRequest, rows: I64, now: float) -> FilterResult | int | None:
        """A pod holding slices freed by preemption (:meth:`nominate`) is placed there once its victims
        have left: the filter answers that node alone. While they have not, the held node's row is
        returned (the caller refuses it and filters the others). None: no hold, or one on a node not
        among ``rows`` (the pod is filtered as usual)."""
        view = self._view()
        held = view.reservations.get(req.uid)
        if held is None or not held.nominated:
            return None
        row = self.state.node_index.get(held.node, -1)
        if row < 0 or not bool(np.any(rows == row)):
            return None
        if any(view.holder(held.node, sid) not in (None, req.uid) for sid in held.slice_ids):
            return row
        view.release(req.uid)
        chosen, _, _ = self.filter_request(req, np.array([row], dtype=np.int64), now, explain_refused=False)
        if chosen.node.shape[0]:
            res = view.reservations.get(req.uid)
            return FilterResult((held.node,), {}, {}, res)
        return None  # the held node no longer takes it (CPU went elsewhere, say): filter as usual

    def prioritize(self, pod: Mapping[str, Any], node_names: Sequence[str], now: float) -> list[tuple[str, int]]:
        """The extender's ``/prioritize``: (node, 0..10) for every node given, unknown nodes 0."""
        try:
            _, req = self.request_of(pod)
        except GpuSliceError:
            return [(name, 0) for name in node_names]
        if req is None:
            return [(name, 0) for name in node_names]
        found = self._found(node_names)
        known = found >= 0
        out = np.zeros(found.shape[0], dtype=np.int64)
        if known.any():
            out[known] = self.prioritize_request(req, found[known], now)
        return list(zip(node_names, out.tolist(), strict=True))

    def bind_check(self, pod: Mapping[str, Any] | PodInfo, node: str, now: float, *, lease_held: bool = True,
                   lease: str = "") -> BindPlan:
        """The assignment ``/bind`` should write for ``pod`` on ``node``, or why not.

        ``pod`` is the view's own projection of the pod (the watched view decides), or the pod as read
        from the API server when the view does not hold it (it is upserted first). Refuses when this
        scheduler does not hold its Lease (fencing), when the node is unknown or has no fitting free
        placement, and under the same-size rule (DESIGN 3)."""
        view = self._view()
        if not lease_held:
            return BindPlan(refusal=f"this scheduler does not hold its lease{' ' + lease if lease else ''}; "
                                    "another replica is leading", code="fencing")
        try:
            info, req = self.request_of(pod)
        except GpuSliceError as err:
            return BindPlan(refusal=str(err), code="request")
        if req is None or info.request is None:
            return BindPlan(refusal=f"pod {info.label} asks no slices; gpu-slice does not bind it", code="no_slices")
        if view.pod(info.uid) is not pod:
            view.upsert_pod(pod, now)
        claim = view.claim(info.uid)
        if claim is not None and claim.assignment is not None:
            if claim.assignment.node == node:
                return BindPlan(assignment=claim.assignment, already=True)
            return BindPlan(refusal=f"pod {info.label} is already assigned to node {claim.assignment.node}",
                            code="assigned_elsewhere")
        node_err = view.node_error(node)
        if node_err is None:
            return BindPlan(refusal=UNKNOWN_NODE, code="unknown_node")
        if node_err:
            return BindPlan(refusal=node_err, code="node_unusable")
        # Whoever called /bind: the node's taints, cordon, node selector and required affinity.
        rules = view.node_rules(node)
        spec = info.scheduling_spec() if isinstance(pod, PodInfo) else pod
        why = noderules.refusal(spec, rules) if rules is not None else f"node {node}'s rules cannot be read"
        if why:
            view.release(info.uid)
            return BindPlan(refusal=why, code="node_rules")
        held = view.reservations.get(info.uid)
        placement: Placement | None = None
        scores: dict[str, float] = {}
        if held is not None and held.node == node and all(view.holder(node, s) in (None, info.uid)
                                                           for s in held.slice_ids):
            placement = self._placement(node, held.slice_ids)
            scores = dict(held.scores)
        if placement is None:
            if held is not None:
                view.release(info.uid)
            v = view.node_row(node)
            mask = np.zeros(self.state.n_nodes, dtype=bool)
            mask[v] = True
            ranked = self.rank(req, mask)
            if len(ranked.cands) == 0:
                ex = explain(self.state, req, ranked.fit, np.array([v], dtype=np.int64))
                return BindPlan(refusal=ex.texts[0] or "no fitting free placement on the node", code="no_fit")
            i = int(ranked.best.index[0])
            scores = ranked.breakdown(i)
            r = self.reservation_for(req, v, ranked.cands.units[i].tolist(), now, scores)
            view.hold(r)
            placement = self._placement(node, r.slice_ids)
        assert placement is not None
        holdings = view.holdings(node)
        if unstamped_same_size(holdings, info.request.slices, exclude_uid=info.uid):
            inventory = view.inventory(node)  # built only when the same-size rule has a pod to weigh
            requests: dict[str, SliceRequest] = {}
            for uid in holdings.held:
                p = view.pod(uid)
                if p is not None and p.request is not None:
                    requests[uid] = p.request
            clash = bind_conflicts(placement, info.request, info.uid, holdings, requests, inventory,
                                   memory_tolerance=view.settings.memory_tolerance)
            if clash:
                names = ", ".join(h.pod for h in clash)
                view.release(info.uid)  # kube-scheduler retries from filter, which reserves afresh
                return BindPlan(refusal=f"same-size rule: {names} on {node} ask the same {info.request.slices} "
                                        "slices and kubelet has not admitted them yet; retry after it has",
                                code="same_size")
        view.extend(info.uid, now)
        when = datetime.fromtimestamp(now, UTC)
        return BindPlan(Assignment(info.uid, node, placement.gpus, placement.instance, placement.slice_ids,
                                   self.policy.name, when, scores))

    def _placement(self, node: str, slice_ids: Sequence[str]) -> Placement | None:
        """The placement those ids form on the node (None when they form none)."""
        view = self._view()
        inv = view.layout(node)
        try:
            gpus = []
            for sid in slice_ids:
                g = inv.gpu_of(sid)
                if g not in gpus:
                    gpus.append(g)
        except GpuSliceError:
            return None
        if not gpus:
            return None
        first = gpus[0]
        if first.mode == "mig":
            owner = slice_ids[0].rsplit("::", 1)[0]
            inst = first.instance(owner)
            return Placement(node, "mig", (first.uuid,), inst.uuid, tuple(slice_ids), inst.memory_mib)
        if first.mode == "mps":
            return Placement(node, "mps", (first.uuid,), None, tuple(slice_ids),
                             mps_share_mib(first.memory_mib, len(slice_ids), first.slices))
        return Placement(node, "whole", tuple(g.uuid for g in gpus), None, tuple(slice_ids),
                         sum(g.memory_mib for g in gpus))

    def _preemptor(self, pod: Mapping[str, Any]) -> tuple[PodInfo, PackRequest] | None:
        """The pod's projection and request when it may preempt (it asks slices, and its
        ``preemptionPolicy`` is not ``Never``), else None."""
        try:
            info, req = self.request_of(pod)
        except GpuSliceError:
            return None
        spec = pod.get("spec")
        if req is None or (isinstance(spec, Mapping) and spec.get("preemptionPolicy") == "Never"):
            return None
        return info, req

    def preempt(self, pod: Mapping[str, Any], node_names: Sequence[str], now: float, *,
                allowed: Mapping[str, Collection[str]] | None = None,
                budgets: Sequence[Budget] = ()) -> dict[str, NodeVictims]:
        """The extender's ``/preempt``: per node, the victims that let ``pod`` in (see
        :func:`gpuslice.preemption.victims_on`), only among ``allowed[node]`` where given (kube-scheduler's
        proposal); nodes where no set does are left out. A pod with ``preemptionPolicy: Never`` gets none."""
        got = self._preemptor(pod)
        if got is None:
            return {}
        info, req = got
        view = self._view()
        self.cluster.expire(now)
        out: dict[str, NodeVictims] = {}
        for name in node_names:
            if view.node_row(name) < 0:
                continue
            only = None if allowed is None else allowed.get(name)
            found = victims_on(view, req, info.priority, name, budgets, allowed=only)
            if found is not None:
                out[name] = found
        return out

    def shape_preemption(self, pod: Mapping[str, Any], node_names: Sequence[str], now: float, *,
                         budgets: Sequence[Budget] = ()) -> NodeVictims | None:
        """The node and victims for a pod that fits nowhere by shape though kube-scheduler counts enough
        slices (so it never preempts for it): among ``node_names`` (the nodes kube-scheduler's own filters
        passed), those the pod may run on whose victims break no PodDisruptionBudget, chosen as
        kube-scheduler chooses (:func:`gpuslice.preemption.pick_node`). None: preemption cannot help."""
        got = self._preemptor(pod)
        if got is None:
            return None
        info, req = got
        view = self._view()
        self.cluster.expire(now)
        options = []
        for name in node_names:
            rules = view.node_rules(name)
            if view.node_row(name) < 0 or rules is None or noderules.refusal(pod, rules):
                continue
            found = victims_on(view, req, info.priority, name, budgets)
            if found is not None and found.violations == 0:
                options.append(found)
        return pick_node(options)

    def nominate(self, pod: Mapping[str, Any], chosen: NodeVictims, now: float,
                 ttl_s: float = NOMINATION_TTL_S) -> Reservation:
        """Hold the slices ``chosen``'s victims free for ``pod``: counted at once for every other pod,
        kept across the pod's filters until it is placed, deleted, or ``ttl_s`` passes."""
        info, req = self.request_of(pod)
        if req is None:
            raise RequestError(f"pod {info.label} asks no slices")
        view = self._view()
        st = self.state
        keys = tuple((st.unit_gpu[u], st.unit_instance[u]) for u in chosen.units)
        r = Reservation(req.uid, chosen.node, keys, req.slices, chosen.slice_ids, req.cpu_milli, req.memory_mib,
                        req.owner, now + ttl_s, nominated=True)
        view.hold(r)
        return r


def before(first: F64, then: F64) -> F64:
    """One order key that sorts by ``first`` (higher first), then by ``then``: dense ranks combined, so
    neither value's scale can leak into the other's order."""
    if first.shape[0] == 0:
        return then
    _, a = np.unique(np.round(first, 9), return_inverse=True)
    _, b = np.unique(then, return_inverse=True)
    return np.asarray(a.astype(np.float64) * (int(b.max()) + 1) + b, dtype=np.float64)


def pods_as_requests(view: ClusterView, *, owner_spread: bool = True) -> list[PackRequest]:
    """The packing requests of the pods that hold slices now (what a warm start observes), oldest first."""
    return held_requests((p.info for p in view.pods.values() if p.claim is not None), view.settings.slices_per_gpu,
                         owner_spread=owner_spread)


def held_requests(infos: Iterable[PodInfo], slices_per_gpu: int, *, owner_spread: bool = True) -> list[PackRequest]:
    """The packing requests of pods known to hold slices, oldest first; projections are immutable, so
    a caller may pass pods scanned earlier and run this outside the view's lock."""
    out: list[tuple[str, PackRequest]] = []
    for info in infos:
        if info.request is None or info.terminal:
            continue
        try:
            out.append((info.created, info.pack(slices_per_gpu, owner_spread=owner_spread)))
        except RequestError:
            continue
    return [r for _, r in sorted(out, key=lambda t: t[0])]
