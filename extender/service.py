"""The extender's state and verbs: a thin layer over the core's decision API.

:class:`Extender` owns one :class:`gpuslice.view.ClusterView` fed by the informer (or a static
v1 List), one :class:`gpuslice.scheduler.Scheduler` configured from the config file, and the
binder. Each verb takes the wire form (:mod:`extender.wire`), asks the core, and answers in the wire
form; nothing here decides fit, reasons or scores. A lock serialises decisions with watch events
(kube-scheduler asks one pod at a time; events are applied between its questions).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from extender import wire
from extender.binder import Binder, MemoryBinder, unclear
from extender.errors import KubeApiError
from extender.events import EventWriter, bind_event
from extender.lease import Fence
from extender.logs import RateLimitedLog
from extender.metrics import ExtenderMetrics
from extender.preemptor import ShapePreemptor
from extender.signals import SignalSnapshot
from gpuslice import annotations as ann
from gpuslice import nodes, pods
from gpuslice.config import Config
from gpuslice.errors import GpuSliceError
from gpuslice.pods import PodInfo
from gpuslice.policies.utilization import UtilizationMemory
from gpuslice.scheduler import WAITING, Scheduler, pods_as_requests
from gpuslice.view import ClusterView

log = logging.getLogger("gpu_slice.extender")

Obj = dict[str, Any]

#: A Lease read this recent is trusted at /bind (the Lease's own renew time + duration still decides).
FENCE_MAX_AGE_S = 1.0

#: How many pod UIDs the extender remembers having shown to the learning policies (oldest forgotten).
MAX_LEARNED = 1 << 16

#: At most this many proposed nodes per ``/preempt`` have their pods read afresh when kube-scheduler's
#: proposal does not free a usable shape there (the others are answered from the view or left out).
MAX_PREEMPT_READS = 16


def reason_code(text: str) -> str:
    """A short, bounded label for a refusal reason (metrics must not carry free text)."""
    for prefix, code in (("slices in use", "slices_busy"), ("fits, but", "narrowed"), ("node is not known", "unknown"),
                         ("insufficient cpu", "cpu"), ("insufficient memory", "memory"),
                         ("every fitting GPU already runs", "owner_spread"), ("the GPUs that could", "cordoned"),
                         ("GPU product", "product"), ("a ", "multi_gpu"), ("pod asks", "isolation"),
                         ("no GPU here can take", "size"), ("no GPU or MIG instance", "gpu_memory"),
                         ("no MIG instance here", "layout"), ("no MIG profile", "layout"),
                         ("node has", "node_capacity"), ("node ", "node")):
        if text.startswith(prefix):
            return code
    return "other"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a verb answered, for the HTTP layer: the JSON body and the HTTP status."""

    body: Obj | list[Obj]
    status: int = 200


class Extender:
    """See the module docstring. ``clock`` is seconds since the epoch."""

    def __init__(self, config: Config, binder: Binder, *, fence: Fence | None = None,
                 metrics: ExtenderMetrics | None = None, clock: Callable[[], float] = time.time,
                 lease_name: str = "kube-system/gpu-slice-scheduler") -> None:
        self.config = config
        self.binder = binder
        self.fence = fence or Fence.disabled()
        self.metrics = metrics or ExtenderMetrics()
        self.clock = clock
        self.lease_name = lease_name
        self.lock = threading.RLock()
        self.view = ClusterView(config=config)
        self.sched = Scheduler.from_config(self.view, config)
        self.synced: set[str] = set()
        self.warmed = False
        self._learned: OrderedDict[str, None] = OrderedDict()  # UIDs the policies have observed
        self._binding: dict[str, list[Any]] = {}  # pod UID -> [lock, callers]
        self._binding_guard = threading.Lock()
        #: Extra readiness (Service sets it): "" when ready, else why not. Checked by every verb.
        self.gate: Callable[[], str] = lambda: ""
        #: The kinds listed before the verbs answer (Service adds PodDisruptionBudget with its informer).
        self.expect: set[str] = {"Node", "Pod"}
        #: The extender's own preemption for shape-only shortfalls (None: off, as in dry runs).
        self.shape: ShapePreemptor | None = None
        #: Where a SliceAssigned event per bind goes (None: no events, as in dry runs).
        self.events: EventWriter | None = None
        self._warn = RateLimitedLog(log)
        self.policy_label = re.sub(r"[^a-z0-9_]+", "_", self.sched.policy.name.lower()).strip("_")[:40] or "policy"

    # ----- the informer's handler -------------------------------------------------------------
    def transform(self, kind: str, obj: Obj) -> Obj | PodInfo:
        """The informer's transform, run on its thread as each object arrives (outside the lock): a pod
        becomes its compact projection at once, so a list of 50,000 pods is never held as dicts (nor
        leaves their freed heap behind); a node is slimmed to what its projection reads. A pod that
        cannot be projected stays a slim mapping and is refused, with its reason, where it is applied."""
        if kind == "Pod":
            try:
                return self.view.project(obj)
            except GpuSliceError:
                return dict(pods.slim(obj))
        return dict(nodes.slim(obj)) if kind == "Node" else obj

    def on_event(self, kind: str, type: str, obj: Obj | PodInfo) -> None:
        with self.lock:
            try:
                if isinstance(obj, PodInfo):
                    if type == "DELETED":
                        self.view.remove_pod(obj.uid)
                    else:
                        self.view.upsert_pod(obj, self.clock())
                elif kind == "Node":
                    if type == "DELETED":
                        meta = obj.get("metadata") or {}
                        self.view.remove_node(str(meta.get("name") or ""))
                    else:
                        self.view.upsert_node(obj)
                elif kind == "Pod":
                    if type == "DELETED":
                        uid = (obj.get("metadata") or {}).get("uid")
                        if isinstance(uid, str):
                            self.view.remove_pod(uid)
                    else:
                        self.view.upsert_pod(obj, self.clock())
                elif kind == "PodDisruptionBudget":
                    if type == "DELETED":
                        self.view.remove_budget(obj)
                    else:
                        self.view.upsert_budget(obj)
            except GpuSliceError as err:
                self._warn.warning(f"event-{kind}", "ignoring a %s event: %s", kind, err)

    def on_relist(self, kind: str, objs: list[Obj | PodInfo]) -> None:
        with self.lock:
            if kind == "Node":
                self.view.replace_nodes([o for o in objs if not isinstance(o, PodInfo)])
            elif kind == "PodDisruptionBudget":
                for why in self.view.replace_budgets([o for o in objs if not isinstance(o, PodInfo)]):
                    self._warn.warning("pdb", "ignoring a PodDisruptionBudget: %s", why)
            else:
                self.view.replace_pods(objs, self.clock())
            self.synced.add(kind)
            self._warm()
            if self.synced >= self.expect:
                # The listed state is long-lived: move it out of the collector's way, so a full
                # collection does not walk tens of thousands of pod objects in the middle of a filter.
                gc.collect()
                gc.freeze()

    def load(self, items: Iterable[Mapping[str, Any]]) -> None:
        """A static cluster (``--cluster FILE``): the listed nodes and pods, then ready. Each item is
        slimmed or projected as it comes (``transform``), so a streamed file is never held whole."""
        nodes: list[Obj | PodInfo] = []
        projected: list[Obj | PodInfo] = []
        for item in items:
            kind = item.get("kind")
            if kind == "Node":
                nodes.append(self.transform("Node", dict(item)))
            elif kind == "Pod":
                projected.append(self.transform("Pod", dict(item)))
        self.on_relist("Node", nodes)
        self.on_relist("Pod", projected)

    def _warm(self) -> None:
        """Once both kinds have synced: the default policy learns from the pods already placed."""
        if self.warmed or not self.synced >= {"Node", "Pod"}:
            return
        placed = pods_as_requests(self.view, owner_spread=self.sched.owner_spread)
        n = self.sched.warm_start(placed)
        for req in placed:
            self._remember(req.uid)
        self.warmed = True
        log.info("synced: %d nodes, %d pods; policies warm-started from %d placed pods", len(self.view.nodes),
                 len(self.view.pods), n)

    @property
    def ready(self) -> bool:
        return not self.not_ready()

    def not_ready(self) -> str:
        """Why the verbs may not answer from this state now ("" when they may): not synced yet, or
        the ``gate`` (after a change of leader, until a fresh list has caught up)."""
        if not self.synced >= self.expect:
            return "cluster state not synced with the API server yet"
        return self.gate()

    def filter_needs_io(self, args: wire.ExtenderArgs) -> bool:
        """Whether ``/filter`` for this pod reads the API server (so it must run off the event loop):
        a pod the watched view does not hold yet, or a pod nominated after a preemption."""
        if not self.binder.remote:
            return False
        uid = str((args.pod.get("metadata") or {}).get("uid") or "")
        return uid not in self.view.pods or bool(self._nominated_node(args.pod, uid))

    def _nominated_node(self, pod: Mapping[str, Any], uid: str) -> str:
        """Where the pod preempted: kube-scheduler's ``status.nominatedNodeName``, else the node where
        this extender's own preemption holds slices for it ("" when neither)."""
        nominated = pods.nominated_node(pod)
        if nominated:
            return nominated
        held = self.view.reservations.get(uid)
        return held.node if held is not None and held.nominated else ""

    def _confirm(self, pod: Mapping[str, Any]) -> str:
        """"" when the cluster holds ``pod``: the watched view has it, or one read of the API server
        finds it under the same UID (then the view takes it, as the watch will). Otherwise why not:
        nothing is learned from, reserved for or held for a pod the cluster does not hold."""
        meta = pod.get("metadata") or {}
        uid, ns, name = meta.get("uid"), meta.get("namespace") or "default", meta.get("name")
        with self.lock:
            if uid in self.view.pods:
                return ""
        try:
            got = self.binder.read_pod(str(ns), str(name))
        except KubeApiError as err:
            return f"cannot confirm pod {ns}/{name} with the API server ({err}); gpu-slice holds nothing for it yet"
        if got is None or (got.get("metadata") or {}).get("uid") != uid:
            return f"pod {ns}/{name} (UID {uid}) does not exist in the API server; gpu-slice holds nothing for it"
        with self.lock:
            try:
                self.view.upsert_pod(got, self.clock())
            except GpuSliceError as err:
                return f"pod {ns}/{name}: {err}"
        return ""

    def _remember(self, uid: str) -> None:
        self._learned[uid] = None
        if len(self._learned) > MAX_LEARNED:
            self._learned.popitem(last=False)

    def _learn(self, pod: Mapping[str, Any] | PodInfo) -> None:
        """A pod's first filter: the learning policies observe it once before it is scored, as the
        simulator observes each arriving pod (kube-scheduler filters a pod again on every retry)."""
        uid = pod.uid if isinstance(pod, PodInfo) else (pod.get("metadata") or {}).get("uid")
        if not isinstance(uid, str) or not uid or uid in self._learned:
            return
        try:
            _, req = self.sched.request_of(pod)
        except GpuSliceError:
            return  # the filter answers with the error
        if req is not None:
            self.sched.observe(req)
            self._remember(uid)

    def slice_rows(self) -> list[tuple[str, str, int, int]]:
        """(node, GPU, slices advertised, slices used) per live GPU, for the slice gauges."""
        with self.lock:
            st = self.view.state
            n = st.n_units
            attached = np.zeros(n + 1, dtype=bool)
            attached[st.node_units[st.node_alive]] = True  # retired rows are in no live node's positions
            live = np.flatnonzero(attached[:n])
            if live.shape[0] == 0:
                return []
            gid = st.unit_gpu_id[live]
            used = np.bincount(gid, weights=(st.unit_cap[live] - st.unit_free[live]), minlength=st.n_gpus)
            total = np.bincount(gid, weights=st.unit_cap[live], minlength=st.n_gpus)
            first: dict[int, int] = {}
            for u, g in zip(live.tolist(), gid.tolist(), strict=True):
                first.setdefault(g, u)
            return [(st.node_names[int(st.unit_node[u])], st.unit_gpu[u], int(total[g]), int(used[g]))
                    for g, u in first.items()]

    # ----- signals --------------------------------------------------------------------------------
    def apply_signals(self, snap: SignalSnapshot) -> None:
        """Live node prices into the state, DCGM activity into the utilization policy's memory."""
        with self.lock:
            st = self.view.state
            now = self.clock()
            for name, node in self.view.nodes.items():
                if node.row < 0:
                    continue
                cost = snap.live_node_cost(name, now=now)
                st.set_node_cost(node.row, cost if cost is not None else node.info.spec.cost_per_hour)
            mems = self.sched.memory if isinstance(self.sched.memory, tuple) else (self.sched.memory,)
            util = [m for m in mems if isinstance(m, UtilizationMemory)]
            if not util:
                return
            rows: list[int] = []
            values: list[float] = []
            for name, node in self.view.nodes.items():
                if node.info.inventory is None:
                    continue
                # A MIG instance is matched by its GPU-instance id (dcgm-exporter's GPU_I_ID), which the
                # plugin writes into the inventory; an instance without one has no activity signal.
                gis = {i.uuid: i.gi for g in node.info.inventory.gpus for i in g.instances}
                for key, row in node.keys.items():
                    gpu = st.unit_gpu[row]
                    if key == gpu:
                        got = snap.activity(name, gpu, None, now=now)
                    else:
                        gi = gis.get(key)
                        got = None if gi is None else snap.activity(name, gpu, gi, now=now)
                    if got is not None:
                        rows.append(row)
                        values.append(float(got[0]))
            for m in util:
                m.now = now
                if rows:
                    m.update(np.array(rows, dtype=np.int64), np.array(values), now, st.n_units)

    def _refresh_node(self, node: str) -> None:
        """Read the node's pods afresh from the API server into the view (raises ``KubeApiError``):
        the watch may be behind, both on pods added (kubelet admitted one) and on pods deleted."""
        node_pods = self.binder.node_pods(node)
        with self.lock:
            self.view.replace_node_pods(node, node_pods, self.clock())

    # ----- verbs ------------------------------------------------------------------------------------
    def filter(self, args: wire.ExtenderArgs) -> wire.FilterResult:
        why = self.not_ready()
        if why:
            return wire.filter_error(args, f"gpu-slice extender is not ready: {why}")
        if isinstance(self.binder, MemoryBinder):
            self.binder.learn(args.pod)
        uid = str((args.pod.get("metadata") or {}).get("uid") or "")
        if self.shape is not None:
            self.shape.saw(uid)
        why = self._confirm(args.pod)
        if why:
            self.metrics.decision(self.policy_label, "unschedulable")
            return wire.filter_error(args, why)
        # The pod is projected once, outside the lock, for both the learning policies and the filter;
        # one that cannot be projected goes to the filter as it came, which answers why.
        pod: Mapping[str, Any] | PodInfo = args.pod
        meta = args.pod.get("metadata") or {}
        known = self.view.pod(uid)
        if known is not None and known.resource_version and known.resource_version == meta.get("resourceVersion"):
            pod = known  # the watch already projected this very version of the pod
        else:
            with contextlib.suppress(GpuSliceError):
                pod = self.view.project(args.pod)
        with self.lock:
            self._learn(pod)
            res = self.sched.filter(pod, args.candidates, self.clock())
        nominated = self._nominated_node(args.pod, uid)
        if nominated and nominated in res.failed:
            # The pod preempted on that node (kube-scheduler's nomination, or slices this extender's own
            # preemption holds for it). Victims the API server has deleted may still be in the view (the
            # watch is behind), and kube-scheduler retries the pod when it sees them go: a refusal then
            # would leave the pod waiting for a next event that may not come, or make kube-scheduler,
            # which no longer sees them, preempt again elsewhere.
            try:
                self._refresh_node(nominated)
            except KubeApiError as err:
                log.warning("filter %s: cannot read the pods of its nominated node: %s", pods.pod_label(args.pod), err)
            else:
                with self.lock:
                    res = self.sched.filter(pod, args.candidates, self.clock())
        with self.lock:
            self.metrics.set_reservations(len(self.view.reservations))
        if self.shape is not None:
            if res.feasible or res.error:
                self.shape.placed(uid)
            else:  # every offered node refused: kube-scheduler may not preempt for a shape (see preemptor)
                self.shape.refused(args.pod, uid, tuple(n for n, why in res.failed.items() if why != WAITING))
        if res.error:
            self.metrics.decision(self.policy_label, "unschedulable")
            return wire.filter_error(args, res.error)
        self.metrics.decision(self.policy_label, "placed" if res.feasible else "unschedulable")
        codes: dict[str, int] = {}
        texts = Counter(res.failed.values())
        texts.update(res.unresolvable.values())
        for text, count in texts.items():  # a few distinct reasons over thousands of nodes
            code = reason_code(text)
            codes[code] = codes.get(code, 0) + count
        self.metrics.rejections(codes)
        return wire.filter_result(args, res.feasible, failed=res.failed, failed_unresolvable=res.unresolvable)

    def prioritize(self, args: wire.ExtenderArgs) -> list[Obj]:
        if self.not_ready():
            return wire.host_priority_list({n: 0 for n in args.candidates})
        with self.lock:
            scores = self.sched.prioritize(args.pod, args.candidates, self.clock())
        return wire.host_priorities(scores)

    def preempt(self, args: wire.ExtenderPreemptionArgs) -> wire.PreemptionResult:
        """kube-scheduler's ``/preempt``: per node it proposes, victims by shape and its rules, within its
        proposal where that suffices (those pods are in its snapshot); beyond it only after reading the
        node's pods afresh, so no pod the cluster no longer holds is named (kube-scheduler fails the
        whole attempt for a victim it cannot find). Nodes without a set are left out."""
        uid = str((args.pod.get("metadata") or {}).get("uid") or "")
        if self.shape is not None:
            self.shape.saw(uid)
        if self.not_ready():
            return wire.PreemptionResult({})
        nodes = list(args.victims)
        proposal = {n: set(v.pod_uids) for n, v in args.victims.items()}
        with self.lock:
            budgets = list(self.view.budgets.values())
            found = self.sched.preempt(args.pod, nodes, self.clock(), allowed=proposal, budgets=budgets)
        rest = [n for n in nodes if n not in found][:MAX_PREEMPT_READS]
        if rest and self.binder.remote:
            for n in list(rest):
                try:
                    self._refresh_node(n)
                except KubeApiError as err:
                    self._warn.warning("preempt-read", "preempt: cannot read the pods of node %s: %s", n, err)
                    rest.remove(n)
        if rest:
            with self.lock:
                found.update(self.sched.preempt(args.pod, rest, self.clock(), budgets=budgets))
        if self.shape is not None:
            self.shape.kube_preempts(uid, bool(found))
        return wire.PreemptionResult({n: wire.Victims(tuple(p.uid for p in nv.victims), nv.violations)
                                      for n, nv in found.items()})

    def bind(self, args: wire.ExtenderBindingArgs) -> wire.BindingResult:
        """Fencing, the reserved placement, the same-size rule, assignment, then the Binding."""
        with self._binding_guard:  # one lock per pod UID, dropped when its last caller leaves
            entry = self._binding.setdefault(args.pod_uid, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                return self._bind(args)
        finally:
            with self._binding_guard:
                entry[1] -= 1
                if entry[1] == 0:
                    self._binding.pop(args.pod_uid, None)

    def _refuse(self, code: str, message: str, args: wire.ExtenderBindingArgs) -> wire.BindingResult:
        """A refused bind: counted by reason code, logged at most once a minute per code."""
        self.metrics.bind_refused(code)
        self._warn.warning(f"bind-{code}", "bind %s/%s to %s refused (%s): %s", args.pod_namespace, args.pod_name,
                           args.node, code, message)
        return wire.BindingResult(message)

    def _bind(self, args: wire.ExtenderBindingArgs) -> wire.BindingResult:
        ns, name, uid, node = args.pod_namespace, args.pod_name, args.pod_uid, args.node
        why = self.not_ready()
        if why:
            return self._refuse("not_ready", f"gpu-slice extender is not ready: {why}", args)
        try:
            held = self.fence.check_recent(FENCE_MAX_AGE_S)
        except KubeApiError as err:
            return self._refuse("lease_unreadable", f"cannot read the scheduler's lease {self.lease_name}: {err}",
                                args)
        # The pod as the watch (plus this extender's own assumed binds) shows it; read from the API
        # server only when the view does not hold it. The Binding's UID precondition and its "already
        # assigned" conflict make the API server the judge of what a stale view could miss.
        pod: Obj | PodInfo | None
        with self.lock:
            pod = self.view.pod(uid)
        if pod is None or pod.label != f"{ns}/{name}":
            try:
                pod = self.binder.read_pod(ns, name)
            except KubeApiError as err:
                return self._refuse("api_error", f"bind {ns}/{name}: {err}", args)
            if pod is None:
                return self._refuse("pod_gone", f"pod {ns}/{name} no longer exists", args)
            if (pod.get("metadata") or {}).get("uid") != uid:
                return self._refuse("pod_replaced", f"pod {ns}/{name} was replaced (UID {uid} is gone)", args)
        bound_to = pod.node if isinstance(pod, PodInfo) else str((pod.get("spec") or {}).get("nodeName") or "")
        if bound_to:
            if bound_to == node:  # the same pod bound twice: answered once
                if not isinstance(pod, PodInfo):
                    with self.lock:
                        self.view.upsert_pod(pod, self.clock())
                return wire.BindingResult()
            return self._refuse("bound_elsewhere", f"pod {ns}/{name} is already bound to {bound_to}", args)
        # The informer's view of the node decides; it is kept by the watch and by this extender's own
        # binds. Only a refusal that fresher usage could turn around is checked against the API server:
        # the node's pods are read again (the watch may be behind, e.g. kubelet admitted a pod the
        # same-size rule waits for) and the check is made once more before the refusal is answered.
        with self.lock:
            plan = self.sched.bind_check(pod, node, self.clock(), lease_held=held, lease=self.lease_name)
        if plan.refusal and plan.usage_dependent:
            try:
                self._refresh_node(node)
            except KubeApiError as err:
                return self._refuse("api_error", f"bind {ns}/{name}: {err}", args)
            with self.lock:
                plan = self.sched.bind_check(self.view.pod(uid) or pod, node, self.clock(), lease_held=held,
                                             lease=self.lease_name)
        if plan.refusal:
            return self._refuse(plan.code, plan.refusal, args)
        assert plan.assignment is not None
        value = ann.encode_assignment(plan.assignment)
        try:
            # One write: the binding subresource merges the Binding's annotations into the pod.
            self.binder.bind(ns, name, uid, node, {ann.ASSIGNMENT_KEY: value})
        except KubeApiError as err:
            res = self._after_failed_bind(ns, name, uid, node, err)
            if res.error:
                self.metrics.bind_refused("api_error")
                self._warn.warning("bind-api_error", "bind %s/%s to %s failed: %s", ns, name, node, res.error)
            return res
        # Count the pod as bound now, assumed until the watch confirms it: a relist or an event older
        # than this bind does not roll it back (kube-scheduler's cache does the same).
        with self.lock:
            info = self.view.pod(uid)
            if info is not None:
                self.view.assume(replace(info, node=node, contract=(plan.assignment, info.contract[1])),
                                 self.clock())
        if self.events is not None:
            self.events.record(bind_event(ns, name, uid, plan.assignment))
        return wire.BindingResult()

    def _after_failed_bind(self, ns: str, name: str, uid: str, node: str, err: KubeApiError) -> wire.BindingResult:
        """Bound (by this call or an earlier one: a 409 "already assigned" to this node) means success.
        The Binding is atomic, so a clear failure wrote nothing: release and refuse. An unclear one that
        cannot be checked keeps the reservation (the scheduler retries, and the retry finds out)."""
        if unclear(err) or err.status == 409:
            try:
                pod = self.binder.read_pod(ns, name)
            except KubeApiError as read_err:
                if unclear(err):
                    return wire.BindingResult(f"bind {ns}/{name} to {node}: {err}; the outcome is unknown "
                                              f"(reading the pod back failed: {read_err})")
                pod = None
            if pod is not None and (pod.get("metadata") or {}).get("uid") == uid and (
                    pod.get("spec") or {}).get("nodeName") == node:
                with self.lock:
                    self.view.upsert_pod(pod, self.clock())
                return wire.BindingResult()
            if pod is not None and (pod.get("metadata") or {}).get("uid") != uid:
                with self.lock:
                    self.view.release(uid)
                return wire.BindingResult(f"pod {ns}/{name} was replaced (UID {uid} is gone)")
        with self.lock:
            self.view.release(uid)
        return wire.BindingResult(f"bind {ns}/{name} to {node}: {err}")
