"""The cluster as the extender keeps it: a packing state updated in place from node and pod events.

Every event touches one node: a pod event re-applies the counting rule
(:func:`gpuslice.counting.settle`) to the claims of the node(s) it concerns and writes that node's
usage into the array state (:meth:`ClusterState.set_node_usage`); a cordon or health change flips
unit flags; a new node, or one whose GPU layout changed, appends unit rows. Nothing is rebuilt
whole, so an event costs the same at 5 nodes and at 5,000. Rows retired by removed or re-laid-out
nodes are reclaimed by a rebuild once they outnumber the live ones.

Reservations (:mod:`gpuslice.reservations`) are held here by pod UID, node name and slice ids and
count as the weakest claims on their node; a pod's own assignment, once it arrives, supersedes its
reservation, and a pod's deletion releases it. Times are seconds since the epoch (the caller's clock).

Our own binds are *assumed* (:meth:`ClusterView.assume`), as kube-scheduler's cache assumes the pods
it binds: the pod counts as bound at once, and until the cluster confirms the bind (an event or a list
that shows the pod on that node), a report without it (a relist taken before the bind, or an event
older than it) does not roll the books back. A pod's deletion ends the assumption; so does
:data:`ASSUMED_TTL_S` without a confirmation, after which the view follows what the cluster last
said (a relist that lacked the pod removes it).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from gpuslice import ids
from gpuslice.config import Config
from gpuslice.counting import Claim, Holdings, PodProblem, settle
from gpuslice.disruption import Budget, project_budget
from gpuslice.errors import GpuSliceError, RequestError
from gpuslice.model import Gpu, NodeInventory
from gpuslice.noderules import NodeRules
from gpuslice.nodes import NodeInfo, project_node
from gpuslice.packing.build import units_of
from gpuslice.packing.state import KIND_MPS, POD_CLASSES, ClusterState, NodeSpec, UnitSpec
from gpuslice.pods import PodInfo, project
from gpuslice.requests import Isolation
from gpuslice.reservations import DEFAULT_TTL_S, Reservation, Reservations
from gpuslice.rules import DEFAULT_MEMORY_TOLERANCE

#: More new nodes than this in one relist: build the state in one go rather than node by node.
BULK_NODES = 32

#: How long an assumed bind outlives the lack of any confirmation. A healthy watch confirms a bind in
#: well under a second; the limit only matters when the pod was deleted while the watch was away
#: (its relist then lacks it), and bounds how long its slices stay counted.
ASSUMED_TTL_S = 300.0


@dataclass(frozen=True, slots=True)
class ViewSettings:
    """What the view needs from the config (validated there)."""

    slices_per_gpu: int = 7
    memory_tolerance: float = DEFAULT_MEMORY_TOLERANCE
    isolation_default: Isolation = "any"
    owner_spread: bool = True
    reservation_ttl_s: float = DEFAULT_TTL_S

    @classmethod
    def from_config(cls, config: Config) -> ViewSettings:
        return cls(config.slices, config.memory_tolerance, config.isolation_default, config.owner_spread,
                   config.reservation_ttl_seconds)


@dataclass(slots=True)
class _Pod:
    info: PodInfo
    claim: Claim | None
    problem: PodProblem | None
    concerns: str  # the node the claim or problem concerns ("" for none)


@dataclass(slots=True)
class _Node:
    info: NodeInfo
    row: int = -1  # -1: not in the state (no inventory, or unreadable)
    keys: dict[str, int] = field(default_factory=dict)  # GPU or MIG UUID -> unit row
    # unit row -> (GPU or MIG UUID, slice count): its ids, derived when asked rather than held
    row_ids: dict[int, tuple[str, int]] = field(default_factory=dict)
    owners: Counter[tuple[str, int]] = field(default_factory=Counter)  # (owner, GPU id) counted in the state
    held: dict[str, str] = field(default_factory=dict)  # slice id -> holder UID (pods, then reservations)
    problems: tuple[PodProblem, ...] = ()


def _layout(gpus: Iterable[Gpu]) -> tuple[object, ...]:
    """What fixes a node's unit rows: everything but health and cordon."""
    return tuple((g.uuid, g.index, g.product, g.memory_mib, g.mode, g.slices, g.instances) for g in gpus)


def _advertises(n: _Node, sid: str) -> bool:
    """Whether ``sid`` is among the node's ids (``inventory.all_ids()``, without building that set):
    its owner is one of the node's unit rows and its ordinal is below that row's slice count."""
    try:
        parsed = ids.decode(sid)
    except GpuSliceError:
        return False
    row = n.keys.get(parsed.owner)
    return row is not None and parsed.n < n.row_ids[row][1]


@dataclass(slots=True)
class _Assumed:
    """One of our binds the cluster has not confirmed yet: the pod as the bind made it, until when the
    assumption holds, and what the cluster last reported instead (``absent``: a relist lacked it)."""

    info: PodInfo
    until: float
    observed: PodInfo | None = None
    absent: bool = False


def _confirms(info: PodInfo, assumed: PodInfo) -> bool:
    """A report of the pod that shows our bind (a pod's node never changes once set)."""
    return bool(info.node) and info.node == assumed.node


def _unchanged(prev: _Pod, info: PodInfo) -> bool:
    """Whether ``info`` differs from the pod as filed only in its resourceVersion, and the pod's claim
    does not depend on the time (none, or bound), so filing it again would change nothing."""
    old = prev.info
    if old is info:
        return True
    return (prev.problem is None and (prev.claim is None or prev.claim.bound) and not info.error
            and old.node == info.node and old.phase == info.phase and old.contract == info.contract
            and replace(old, resource_version=info.resource_version) == info)


def _to_datetime(now: float) -> datetime:
    return datetime.fromtimestamp(now, UTC)


class ClusterView:
    """Nodes and pods by event, with the packing state (``state``) kept in step."""

    def __init__(self, settings: ViewSettings | None = None, *, config: Config | None = None) -> None:
        self.settings = settings or (ViewSettings.from_config(config) if config is not None else ViewSettings())
        self.config = config
        self.state = self._empty_state()
        self.nodes: dict[str, _Node] = {}
        self.pods: dict[str, _Pod] = {}
        self.by_node: dict[str, set[str]] = {}  # node name -> UIDs of pods bound or claiming there
        self.reservations = Reservations(self.settings.reservation_ttl_s)
        self.reserved_on: dict[str, set[str]] = {}  # node name -> reserved UIDs
        self._expiry: list[tuple[float, str]] = []  # unbound claims: (expires, uid)
        self._ttl = timedelta(seconds=self.settings.reservation_ttl_s)
        self.pod_errors: dict[str, str] = {}  # uid -> why the pod could not be projected
        self.assumed: dict[str, _Assumed] = {}  # our binds the cluster has not confirmed yet
        self.budgets: dict[tuple[str, str], Budget] = {}  # PodDisruptionBudgets by (namespace, name)

    def _empty_state(self) -> ClusterState:
        return ClusterState([], [], slices_per_gpu=self.settings.slices_per_gpu,
                            memory_tolerance=self.settings.memory_tolerance)

    # ----- reading -------------------------------------------------------------------------
    def node_row(self, name: str) -> int:
        """The node's row in ``state``, -1 when it is unknown or has no usable inventory."""
        n = self.nodes.get(name)
        return -1 if n is None else n.row

    def node_error(self, name: str) -> str | None:
        """Why a known node takes no slices ("" when it does), None when the node is unknown."""
        n = self.nodes.get(name)
        if n is None:
            return None
        if n.info.error:
            return n.info.error
        if n.info.inventory is None:
            return f"node {name} advertises no GPU slices (no inventory annotation from the device plugin)"
        return ""

    def node_rules(self, name: str) -> NodeRules | None:
        """The node's taints, cordon and labels (None when the node is unknown or unreadable)."""
        n = self.nodes.get(name)
        return None if n is None else n.info.rules

    def inventory(self, name: str) -> NodeInventory:
        """The node's inventory with ``used`` = the ids held now (pods and reservations)."""
        n = self.nodes[name]
        assert n.info.inventory is not None
        return n.info.inventory.with_used(i for i in n.held if _advertises(n, i))

    def layout(self, name: str) -> NodeInventory:
        """The node's GPUs and MIG instances, without usage (cheap: no id sets are built)."""
        n = self.nodes[name]
        assert n.info.inventory is not None
        return n.info.inventory

    def holder(self, name: str, slice_id: str) -> str | None:
        n = self.nodes.get(name)
        return None if n is None else n.held.get(slice_id)

    def pod(self, uid: str) -> PodInfo | None:
        p = self.pods.get(uid)
        return None if p is None else p.info

    def pods_on(self, name: str) -> list[PodInfo]:
        return [self.pods[u].info for u in self.by_node.get(name, ())]

    def claim(self, uid: str) -> Claim | None:
        p = self.pods.get(uid)
        return None if p is None else p.claim

    def problems(self) -> list[str]:
        out = [n.info.error for n in self.nodes.values() if n.info.error]
        out += [str(p) for n in self.nodes.values() for p in n.problems]
        out += list(self.pod_errors.values())
        return out

    def holdings(self, name: str) -> Holdings:
        """The counting rule's answer for the node's pods now, settled when asked (``/bind`` asks for
        one node) rather than kept for every node: it is what the last recompute of the node used."""
        return self._settle(name, [self.pods[u] for u in self.by_node.get(name, ())])

    def _settle(self, name: str, pods: list[_Pod]) -> Holdings:
        claims = [p.claim for p in pods if p.claim is not None and p.claim.node == name]
        return settle(name, claims, [p.problem for p in pods if p.problem is not None and p.concerns == name])

    def unit_ids(self, name: str, row: int) -> tuple[str, ...]:
        owner, count = self.nodes[name].row_ids[row]
        return ids.encode_all(owner, count)

    # ----- node events ------------------------------------------------------------------------
    def upsert_node(self, node: Mapping[str, Any]) -> str:
        """A node was added or changed; returns its name."""
        meta = node.get("metadata") if isinstance(node, Mapping) else None
        name = meta.get("name") if isinstance(meta, Mapping) else None
        prev = self.nodes.get(name) if isinstance(name, str) else None
        info = project_node(node, config=self.config, previous=prev.info if prev is not None else None)
        self._put_node(info)
        return info.name

    def remove_node(self, name: str) -> None:
        n = self.nodes.pop(name, None)
        if n is None:
            return
        for uid in sorted(self.reserved_on.pop(name, set())):  # nothing to hold them on any more
            self.reservations.pop(uid)
        if n.row >= 0:
            self._drop_owners(n)
            self.state.remove_node(n.row)
            self._maybe_compact()

    def replace_nodes(self, nodes: Iterable[Mapping[str, Any]]) -> None:
        """A relist: the nodes listed are all there is. Known nodes are updated in place; when many
        nodes are new (the first list, a large scale-up) the state is built in one go instead."""
        seen: set[str] = set()
        fresh: list[NodeInfo] = []
        for node in nodes:
            try:
                meta = node.get("metadata") if isinstance(node, Mapping) else None
                name = meta.get("name") if isinstance(meta, Mapping) else None
                if isinstance(name, str) and name and name not in self.nodes and name not in seen:
                    fresh.append(project_node(node, config=self.config))
                    seen.add(name)
                else:
                    seen.add(self.upsert_node(node))
            except GpuSliceError:
                continue  # a node without a name cannot be placed on or named
        for name in [n for n in self.nodes if n not in seen]:
            self.remove_node(name)
        if len(fresh) > BULK_NODES:
            for info in fresh:
                self.nodes[info.name] = _Node(info)
            self.rebuild()
        else:
            for info in fresh:
                self._put_node(info)

    def _put_node(self, info: NodeInfo) -> None:
        old = self.nodes.get(info.name)
        usable = info.inventory is not None and not info.error
        if old is None:
            n = _Node(info)
            self.nodes[info.name] = n
            if usable:
                self._add_rows(n)
            return
        prev = old.info
        old.info = info
        if old.row >= 0 and not usable:
            self._drop_owners(old)
            self.state.remove_node(old.row)
            old.row, old.keys, old.row_ids, old.held = -1, {}, {}, {}
            self._maybe_compact()
            return
        if old.row < 0:
            if usable:
                self._add_rows(old)
            return
        v = old.row
        spec, pspec = info.spec, prev.spec
        if (spec.cpu_milli, spec.memory_mib) != (pspec.cpu_milli, pspec.memory_mib):
            self.state.set_node_resources(v, spec.cpu_milli, spec.memory_mib)
        if spec.product != pspec.product:
            self.state.set_node_product(v, spec.product)
        self.state.set_node_cost(v, spec.cost_per_hour)
        assert info.inventory is not None and prev.inventory is not None
        if info.decoded is prev.decoded and info.inventory.gpus == prev.inventory.gpus:
            return  # a heartbeat or a label change: the GPUs are as they were
        if info.decoded is not prev.decoded and _layout(info.inventory.gpus) != _layout(prev.inventory.gpus):
            self._drop_owners(old)
            units = self._units(info.inventory)
            self.state.replace_units(v, units)
            self._index_rows(old, units)
            self._recompute(info.name)
            self._maybe_compact()
        else:
            rows, flags = [], []
            for gpu in info.inventory.gpus:
                for key in (gpu.uuid, *(i.uuid for i in gpu.instances)):
                    row = old.keys.get(key)
                    if row is not None and bool(self.state.unit_usable[row]) != gpu.schedulable:
                        rows.append(row)
                        flags.append(gpu.schedulable)
            self.state.set_units_usable(rows, flags)

    def _units(self, inventory: NodeInventory) -> list[UnitSpec]:
        return sorted(units_of(0, inventory.with_used(())), key=lambda u: u.gpu_index)

    def _add_rows(self, n: _Node) -> None:
        assert n.info.inventory is not None
        units = self._units(n.info.inventory)
        n.row = self.state.add_node(n.info.spec, units)
        self._index_rows(n, units)
        self._recompute(n.info.name)

    def _index_rows(self, n: _Node, units: list[UnitSpec] | None = None) -> None:
        assert n.info.inventory is not None
        rows = self.state.node_rows(n.row).tolist()
        keys: dict[str, int] = {}
        row_ids: dict[int, tuple[str, int]] = {}
        if units is None:
            units = self._units(n.info.inventory)
        gpus = {g.uuid: g for g in n.info.inventory.gpus}
        for unit, row in zip(units, rows, strict=True):
            key = unit.instance or unit.gpu
            keys[key] = row
            gpu = gpus[unit.gpu]
            row_ids[row] = (key, gpu.instance(unit.instance).compute_slices if unit.instance else gpu.slices)
        n.keys, n.row_ids = keys, row_ids

    def _drop_owners(self, n: _Node) -> None:
        for (owner, gpu), count in n.owners.items():
            self.state.adjust_owner(owner, gpu, -count)
        n.owners = Counter()

    def _maybe_compact(self) -> None:
        st = self.state
        if st.dead_units > max(1024, st.n_units - st.dead_units) or (
                st.n_nodes > 64 and int((~st.node_alive).sum()) > st.n_nodes // 2):
            self.rebuild()

    def rebuild(self) -> None:
        """A fresh state from what the view holds, built in one go (reclaims retired rows; the
        decisions are the same). A relist that brings many new nodes lands here too."""
        specs: list[NodeSpec] = []
        units: list[UnitSpec] = []
        per_node: list[tuple[_Node, list[UnitSpec]]] = []
        for n in self.nodes.values():
            n.row, n.owners, n.held, n.problems = -1, Counter(), {}, ()
            if n.info.inventory is not None and not n.info.error:
                mine = sorted(units_of(len(specs), n.info.inventory.with_used(())), key=lambda u: u.gpu_index)
                specs.append(n.info.spec)
                units.extend(mine)
                per_node.append((n, mine))
        self.state = ClusterState(specs, units, slices_per_gpu=self.settings.slices_per_gpu,
                                  memory_tolerance=self.settings.memory_tolerance)
        for v, (n, mine) in enumerate(per_node):
            n.row = v
            self._index_rows(n, mine)
        # A node with no pods and no reservations is as built: nothing in use.
        for name in set(self.by_node) | set(self.reserved_on):
            self._recompute(name)

    # ----- pod events -------------------------------------------------------------------------
    def upsert_pod(self, pod: Mapping[str, Any] | PodInfo, now: float) -> str:
        """A pod was added or changed; returns its UID (raises ``RequestError`` without one). The pod is
        a mapping, or its projection made with this view's isolation default (:meth:`project`). A report
        older than one of our assumed binds is remembered, not applied."""
        info = pod if isinstance(pod, PodInfo) else self.project(pod)
        a = self.assumed.get(info.uid)
        if a is not None:
            if not _confirms(info, a.info):
                a.observed, a.absent = info, False
                return info.uid
            del self.assumed[info.uid]
        self._put_pod(info, now)
        return info.uid

    def assume(self, pod: Mapping[str, Any] | PodInfo, now: float, ttl_s: float = ASSUMED_TTL_S) -> str:
        """Our bind of ``pod`` (as bound: ``spec.nodeName`` set) succeeded: count it at once, and keep it
        until the cluster confirms it (see the module docstring). Returns the pod's UID."""
        info = pod if isinstance(pod, PodInfo) else self.project(pod)
        if not info.node:
            raise RequestError(f"pod {info.label}: an assumed bind needs spec.nodeName")
        self.assumed[info.uid] = _Assumed(info, now + ttl_s)
        self._put_pod(info, now)
        return info.uid

    def project(self, pod: Mapping[str, Any]) -> PodInfo:
        """The pod's projection as this view makes it (raises ``RequestError`` without a UID). A watch
        can project pods as they arrive and hand the projections to :meth:`upsert_pod` and
        :meth:`replace_pods`, so no copy of the objects is kept meanwhile."""
        return project(pod, isolation_default=self.settings.isolation_default)

    def remove_pod(self, uid: str) -> None:
        """The pod is gone: its claims, its reservation and any assumption about it go too."""
        self.assumed.pop(uid, None)
        touched: set[str] = set()
        r = self.reservations.pop(uid)
        if r is not None:
            self.reserved_on.get(r.node, set()).discard(uid)
            touched.add(r.node)
        p = self.pods.pop(uid, None)
        self.pod_errors.pop(uid, None)
        if p is not None:
            touched |= self._unindex(uid, p)
        for name in touched:
            self._recompute(name)

    def replace_pods(self, pods: Iterable[Mapping[str, Any] | PodInfo], now: float) -> None:
        """A relist: the pods listed (mappings, or projections from :meth:`project`) are all there is.
        A pod whose resourceVersion is unchanged keeps its projection; nodes whose pods changed are
        recomputed once each at the end."""
        old = self.pods
        before = set(self.by_node)
        self.pods, self.by_node, self.pod_errors, self._expiry = {}, {}, {}, []
        unconfirmed = set(self.assumed)
        for pod in pods:
            uid: object
            rv: object
            if isinstance(pod, PodInfo):
                uid, rv = pod.uid, pod.resource_version
            else:
                meta = pod.get("metadata") if isinstance(pod, Mapping) else None
                uid = meta.get("uid") if isinstance(meta, Mapping) else None
                rv = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
            a = self.assumed.get(uid) if isinstance(uid, str) else None
            prev = old.get(uid) if isinstance(uid, str) else None
            if (a is None and prev is not None and isinstance(rv, str) and rv and prev.info.resource_version == rv
                    and (prev.claim is None or prev.claim.bound)):
                self._register(prev)
                continue
            try:
                info = pod if isinstance(pod, PodInfo) else self.project(pod)
            except GpuSliceError:
                continue
            if a is not None:
                unconfirmed.discard(info.uid)
                if not _confirms(info, a.info):  # a list older than our bind: keep the bind
                    a.observed, a.absent = info, False
                    info = a.info
                else:
                    del self.assumed[info.uid]
            self._index(info, now)
            self._supersede(info)
        for uid in unconfirmed:  # bound by us, and not in a list that may predate the bind
            a = self.assumed[uid]
            a.observed, a.absent = None, True
            self._index(a.info, now)
        del old
        for name in before | set(self.by_node) | set(self.reserved_on):
            self._recompute(name)

    def replace_node_pods(self, name: str, pods: Iterable[Mapping[str, Any]], now: float) -> None:
        """A fresh read of one node's pods (a list by ``spec.nodeName``), for when the watch may be
        behind: each pod listed is upserted, and a pod this view has bound to the node that the list
        lacks is gone (a bound pod never changes node), so it is removed. Pods that only claim the
        node (assigned, not yet bound) are not in such a list and are kept; a pod listed that cannot
        be projected is left as the view had it."""
        listed: set[str] = set()
        for pod in pods:
            meta = pod.get("metadata")
            uid = meta.get("uid") if isinstance(meta, Mapping) else None
            if isinstance(uid, str):
                listed.add(uid)
            try:
                self.upsert_pod(pod, now)
            except GpuSliceError:
                continue
        gone = [u for u in self.by_node.get(name, ()) if u not in listed and self.pods[u].info.node == name]
        for uid in gone:
            self.remove_pod(uid)

    @contextmanager
    def pretend_gone(self, uids: Iterable[str]) -> Iterator[None]:
        """Count the nodes as if these pods were gone, for the duration of the block (preemption asks
        the one fit rule what removing them would free). Reservations and assumptions are untouched."""
        gone = [(uid, self.pods[uid]) for uid in dict.fromkeys(uids) if uid in self.pods]
        touched: set[str] = set()
        for uid, p in gone:
            del self.pods[uid]
            touched |= self._unindex(uid, p)
        for name in touched:
            self._recompute(name)
        try:
            yield
        finally:
            for _uid, p in gone:
                self._register(p)
            for name in touched:
                self._recompute(name)

    def _put_pod(self, info: PodInfo, now: float) -> None:
        touched: set[str] = set()
        prev = self.pods.get(info.uid)
        if prev is not None and _unchanged(prev, info):
            prev.info = info  # only its resourceVersion moved (the watch confirming an assumed bind, a
            return            # status update): nothing the counting rule reads, so no node is recomputed
        if prev is not None:
            touched |= self._unindex(info.uid, prev)
        touched |= self._index(info, now, prev)
        dropped = self._supersede(info)
        if dropped:
            touched.add(dropped)
        for name in touched:
            self._recompute(name)

    def _supersede(self, info: PodInfo) -> str:
        """A pod bound or claiming slices supersedes its reservation: drop it (without recomputing)
        and return the node it was on ("" when nothing was dropped)."""
        if info.uid not in self.reservations or not (info.node or self.pods[info.uid].claim is not None):
            return ""
        r = self.reservations.pop(info.uid)
        if r is None:
            return ""
        self.reserved_on.get(r.node, set()).discard(r.uid)
        return r.node

    def _index(self, info: PodInfo, now: float, prev: _Pod | None = None) -> set[str]:
        claim: Claim | None
        problem: PodProblem | None
        if (prev is not None and prev.claim is not None and prev.claim.bound and prev.problem is None
                and (prev.info.contract, prev.info.node, prev.info.phase) == (info.contract, info.node, info.phase)):
            # A status update of a bound pod: its claim does not depend on the time, keep it.
            claim, problem, concerns = prev.claim, None, prev.concerns
        else:
            claim, problem, concerns = info.claim(now=_to_datetime(now), reservation_ttl=self._ttl)
        return self._register(_Pod(info, claim, problem, concerns))

    def _register(self, p: _Pod) -> set[str]:
        """File a pod under the nodes it concerns (and its expiry, when it is an unbound claim)."""
        info, claim = p.info, p.claim
        self.pods[info.uid] = p
        if info.error:
            self.pod_errors[info.uid] = info.error
        touched = {x for x in (info.node, claim.node if claim else "", p.concerns) if x}
        for name in touched:
            self.by_node.setdefault(name, set()).add(info.uid)
        if claim is not None and not claim.bound and claim.assignment is not None:
            expires = claim.assignment.time.timestamp() + self.settings.reservation_ttl_s
            heapq.heappush(self._expiry, (expires, info.uid))
        return touched

    def _unindex(self, uid: str, p: _Pod) -> set[str]:
        touched = {x for x in (p.info.node, p.claim.node if p.claim else "", p.concerns) if x}
        for name in touched:
            s = self.by_node.get(name)
            if s is not None:
                s.discard(uid)
                if not s:
                    del self.by_node[name]
        return touched

    # ----- disruption budgets -------------------------------------------------------------------
    def upsert_budget(self, pdb: Mapping[str, Any]) -> None:
        """A PodDisruptionBudget was added or changed (``RequestError`` when it cannot be read)."""
        b = project_budget(pdb)
        self.budgets[(b.namespace, b.name)] = b

    def remove_budget(self, pdb: Mapping[str, Any]) -> None:
        meta = pdb.get("metadata")
        if isinstance(meta, Mapping):
            self.budgets.pop((str(meta.get("namespace") or ""), str(meta.get("name") or "")), None)

    def replace_budgets(self, pdbs: Iterable[Mapping[str, Any]]) -> list[str]:
        """A relist of PodDisruptionBudgets; returns why any could not be read (they are left out)."""
        self.budgets = {}
        problems = []
        for pdb in pdbs:
            try:
                self.upsert_budget(pdb)
            except GpuSliceError as err:
                problems.append(str(err))
        return problems

    # ----- reservations and time ----------------------------------------------------------------
    def hold(self, r: Reservation) -> None:
        """Count a reservation at once (replacing the pod's earlier one)."""
        self.release(r.uid)
        self.reservations.add(r)
        self.reserved_on.setdefault(r.node, set()).add(r.uid)
        self._recompute(r.node)

    def release(self, uid: str) -> Reservation | None:
        r = self.reservations.pop(uid)
        if r is not None:
            self.reserved_on.get(r.node, set()).discard(uid)
            self._recompute(r.node)
        return r

    def extend(self, uid: str, now: float) -> None:
        """Keep a bound pod's reservation until its assignment arrives by watch (or the TTL runs out)."""
        r = self.reservations.get(uid)
        if r is not None:
            self.reservations.add(replace(r, expires=now + self.settings.reservation_ttl_s))

    def expire(self, now: float) -> None:
        """Drop reservations, unbound assignments and unconfirmed assumptions whose time is up."""
        for r in self.reservations.due(now):
            self.reserved_on.get(r.node, set()).discard(r.uid)
            self._recompute(r.node)
        for uid in [u for u, a in self.assumed.items() if a.until <= now]:
            a = self.assumed.pop(uid)
            if a.absent:
                self.remove_pod(uid)
            elif a.observed is not None:
                self._put_pod(a.observed, now)
        while self._expiry and self._expiry[0][0] <= now:
            _, uid = heapq.heappop(self._expiry)
            p = self.pods.get(uid)
            if p is not None and p.claim is not None and not p.claim.bound:
                touched = self._unindex(uid, p)
                touched |= self._index(p.info, now)
                for name in touched:
                    self._recompute(name)

    # ----- usage --------------------------------------------------------------------------------
    def _recompute(self, name: str) -> None:
        """Re-apply the counting rule to one node and write its usage into the state."""
        n = self.nodes.get(name)
        if n is None or n.row < 0:
            return
        st = self.state
        pods = [self.pods[u] for u in self.by_node.get(name, ())]
        holdings = self._settle(name, pods)
        problems = list(holdings.problems)
        used: dict[int, int] = {}
        held: dict[str, str] = {}
        owners: Counter[tuple[str, int]] = Counter()
        classes = np.zeros(POD_CLASSES, dtype=np.int64)
        cpu = mem = 0
        spread = self.settings.owner_spread

        def take(uid: str, sids: Iterable[str], owner: str) -> None:
            rows: dict[int, int] = {}
            for sid in sids:
                if sid in held:
                    continue
                try:
                    row = n.keys.get(ids.owner_of(sid))
                except GpuSliceError:
                    row = None
                if row is None:
                    continue
                held[sid] = uid
                rows[row] = rows.get(row, 0) + 1
            for row, k in rows.items():
                used[row] = used.get(row, 0) + k
            if rows:
                first = next(iter(rows))
                cls = 0 if len(rows) == 1 and rows[first] < int(st.unit_cap[first]) else min(len(rows),
                                                                                             POD_CLASSES - 1)
                classes[cls] += 1
                if owner and spread:
                    for g in {int(st.unit_gpu_id[r]) for r in rows}:
                        owners[(owner, g)] += 1

        for uid, h in holdings.held.items():
            missing = sorted(sid for sid in h.slice_ids if not _advertises(n, sid))
            if missing:
                problems.append(PodProblem(h.pod, uid, f"holds ids not advertised on node {name}: "
                                                       f"{', '.join(missing)}"))
            take(uid, h.slice_ids, self.pods[uid].info.owner)
        for p in pods:
            counts = (p.info.node == name and not p.info.terminal) or (
                not p.info.node and p.claim is not None and p.claim.node == name and not p.info.terminal)
            if counts:
                cpu += p.info.cpu_milli
                mem += p.info.memory_mib
        for uid in sorted(self.reserved_on.get(name, ())):
            r = self.reservations.get(uid)
            if r is None:
                continue
            cpu += r.cpu_milli
            mem += r.memory_mib
            take(uid, r.slice_ids, r.owner)
        rows = list(n.row_ids)
        free = []
        for row in rows:
            cap, k = int(st.unit_cap[row]), used.get(row, 0)
            free.append(max(cap - k, 0) if int(st.unit_kind[row]) == KIND_MPS else (0 if k else cap))
        st.set_node_usage(n.row, rows, free, cpu, mem, classes.tolist())
        for key in set(owners) | set(n.owners):
            delta = owners[key] - n.owners[key]
            if delta:
                st.adjust_owner(key[0], key[1], delta)
        n.owners, n.held, n.problems = owners, held, tuple(problems)

    # ----- building from lists ----------------------------------------------------------------
    @classmethod
    def from_objects(cls, items: Iterable[Mapping[str, Any]], now: float, *, config: Config | None = None,
                     settings: ViewSettings | None = None) -> ClusterView:
        """A view of Nodes and Pods given as plain mappings (a v1 List's items)."""
        view = cls(settings, config=config)
        nodes: list[Mapping[str, Any]] = []
        pods: list[Mapping[str, Any]] = []
        for item in items:
            kind = item.get("kind")
            if kind == "Node":
                nodes.append(item)
            elif kind == "Pod":
                pods.append(item)
        view.replace_nodes(nodes)
        view.replace_pods(pods, now)
        return view

