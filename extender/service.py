"""The extender's state and verbs: a thin layer over the core's decision API.

:class:`Extender` owns one :class:`gpuslice.view.ClusterView` fed by the informer (or a static
v1 List), one :class:`gpuslice.scheduler.Scheduler` configured from the config file, and the
binder. Each verb takes the wire form (:mod:`extender.wire`), asks the core, and answers in the wire
form; nothing here decides fit, reasons or scores. A lock serialises decisions with watch events
(kube-scheduler asks one pod at a time; events are applied between its questions).
"""

from __future__ import annotations

import gc
import logging
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from extender import wire
from extender.binder import Binder, MemoryBinder, unclear
from extender.errors import KubeApiError
from extender.lease import Fence
from extender.metrics import ExtenderMetrics
from extender.miglayouts import LayoutPublisher
from extender.signals import SignalSnapshot
from gpuslice import annotations as ann
from gpuslice import nodes, pods
from gpuslice.config import Config
from gpuslice.errors import GpuSliceError
from gpuslice.pods import PodInfo
from gpuslice.policies.utilization import UtilizationMemory
from gpuslice.scheduler import Scheduler, pods_as_requests
from gpuslice.view import ClusterView

log = logging.getLogger("gpu_slice.extender")

Obj = dict[str, Any]

#: A Lease read this recent is trusted at /bind (the Lease's own renew time + duration still decides).
FENCE_MAX_AGE_S = 1.0

#: How many pod UIDs the extender remembers having shown to the learning policies (oldest forgotten).
MAX_LEARNED = 1 << 16


def reason_code(text: str) -> str:
    """A short, bounded label for a refusal reason (metrics must not carry free text)."""
    for prefix, code in (("slices in use", "slices_busy"), ("fits, but", "narrowed"), ("node is not known", "unknown"),
                         ("insufficient cpu", "cpu"), ("insufficient memory", "memory"),
                         ("every fitting GPU already runs", "owner_spread"), ("the GPUs that could", "cordoned"),
                         ("GPU product", "product"), ("a ", "multi_gpu"), ("pod asks", "isolation"),
                         ("no GPU here can take", "size"), ("no GPU or MIG instance", "gpu_memory"),
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
        self.layouts = LayoutPublisher(self, None)  # dynamic MIG layouts; the service gives it a writer
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
                        self.layouts.on_node(obj)
                elif kind == "Pod":
                    if type == "DELETED":
                        uid = (obj.get("metadata") or {}).get("uid")
                        if isinstance(uid, str):
                            self.view.remove_pod(uid)
                    else:
                        self.view.upsert_pod(obj, self.clock())
            except GpuSliceError as err:
                log.warning("ignoring %s event: %s", kind, err)

    def on_relist(self, kind: str, objs: list[Obj | PodInfo]) -> None:
        with self.lock:
            if kind == "Node":
                self.view.replace_nodes([o for o in objs if not isinstance(o, PodInfo)])
                for o in objs:
                    if not isinstance(o, PodInfo):
                        self.layouts.on_node(o)
            else:
                self.view.replace_pods(objs, self.clock())
            self.synced.add(kind)
            self._warm()
            if self.ready:
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
        if self.warmed or self.synced != {"Node", "Pod"}:
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
        return self.synced == {"Node", "Pod"}

    def _remember(self, uid: str) -> None:
        self._learned[uid] = None
        if len(self._learned) > MAX_LEARNED:
            self._learned.popitem(last=False)

    def _learn(self, pod: Mapping[str, Any]) -> None:
        """A pod's first filter: the learning policies observe it once before it is scored, as the
        simulator observes each arriving pod (kube-scheduler filters a pod again on every retry)."""
        uid = (pod.get("metadata") or {}).get("uid")
        if not isinstance(uid, str) or not uid or uid in self._learned:
            return
        try:
            _, req = self.sched.request_of(pod)
        except GpuSliceError:
            return  # the filter answers with the error
        if req is not None:
            self.sched.observe(req)
            self.layouts.observe(req)
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
                for key, row in node.keys.items():
                    gpu = st.unit_gpu[row]
                    inst = key if key != gpu else None
                    got = snap.activity(name, gpu, inst, now=now)
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
        if not self.ready:
            return wire.filter_error(args, "gpu-slice extender has not synced with the API server yet")
        if isinstance(self.binder, MemoryBinder):
            self.binder.learn(args.pod)
        with self.lock:
            self._learn(args.pod)
            res = self.sched.filter(args.pod, args.candidates, self.clock())
        nominated = pods.nominated_node(args.pod)
        if nominated and nominated in res.failed:
            # The pod preempted on that node and kube-scheduler tries it there first. Victims the
            # API server has deleted may still be in the view (the watch is behind), and a refusal
            # here would make kube-scheduler, which no longer sees them, preempt again elsewhere.
            try:
                self._refresh_node(nominated)
            except KubeApiError as err:
                log.warning("filter %s: cannot read the pods of its nominated node: %s", pods.pod_label(args.pod), err)
            else:
                with self.lock:
                    res = self.sched.filter(args.pod, args.candidates, self.clock())
        with self.lock:
            self.metrics.set_reservations(len(self.view.reservations))
            if not res.feasible and not res.error and self.layouts.active:
                try:
                    _, req = self.sched.request_of(args.pod)
                except GpuSliceError:
                    req = None
                self.layouts.note_filter(req, res.feasible, args.candidates, res.error, self.clock())
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
        if not self.ready:
            return wire.host_priority_list({n: 0 for n in args.candidates})
        with self.lock:
            scores = self.sched.prioritize(args.pod, args.candidates, self.clock())
        return wire.host_priorities(scores)

    def preempt(self, args: wire.ExtenderPreemptionArgs) -> wire.PreemptionResult:
        with self.lock:
            found = self.sched.preempt(args.pod, list(args.victims), self.clock())
        return wire.PreemptionResult({n: wire.Victims(tuple(uids)) for n, uids in found.items()})

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

    def _bind(self, args: wire.ExtenderBindingArgs) -> wire.BindingResult:
        ns, name, uid, node = args.pod_namespace, args.pod_name, args.pod_uid, args.node
        try:
            held = self.fence.check_recent(FENCE_MAX_AGE_S)
        except KubeApiError as err:
            return wire.BindingResult(f"cannot read the scheduler's lease {self.lease_name}: {err}")
        try:
            pod = self.binder.read_pod(ns, name)
            if pod is None:
                return wire.BindingResult(f"pod {ns}/{name} no longer exists")
            if (pod.get("metadata") or {}).get("uid") != uid:
                return wire.BindingResult(f"pod {ns}/{name} was replaced (UID {uid} is gone)")
            bound_to = (pod.get("spec") or {}).get("nodeName")
            if bound_to:
                if bound_to == node:  # the same pod bound twice: answered once
                    with self.lock:
                        self.view.upsert_pod(pod, self.clock())
                    return wire.BindingResult()
                return wire.BindingResult(f"pod {ns}/{name} is already bound to {bound_to}")
        except KubeApiError as err:
            return wire.BindingResult(f"bind {ns}/{name}: {err}")
        # The informer's view of the node decides; it is kept by the watch and by this extender's own
        # binds. Only a refusal is checked against the API server: the node's pods are read again (the
        # watch may be behind, e.g. kubelet admitted a pod the same-size rule waits for) and the check
        # is made once more before the refusal is answered.
        with self.lock:
            plan = self.sched.bind_check(pod, node, self.clock(), lease_held=held, lease=self.lease_name)
        if plan.refusal and held:
            try:
                self._refresh_node(node)
            except KubeApiError as err:
                return wire.BindingResult(f"bind {ns}/{name}: {err}")
            with self.lock:
                plan = self.sched.bind_check(pod, node, self.clock(), lease_held=held, lease=self.lease_name)
        if plan.refusal:
            return wire.BindingResult(plan.refusal)
        assert plan.assignment is not None
        value = ann.encode_assignment(plan.assignment)
        updated: Obj = pod
        try:
            if not plan.already:
                updated = self.binder.write_assignment(ns, name, uid, value)
                with self.lock:
                    self.view.upsert_pod(updated, self.clock())
            self.binder.bind(ns, name, uid, node)
        except KubeApiError as err:
            return self._after_failed_write(ns, name, uid, node, err)
        # Count the pod as bound now; the watch confirms it (and is the only source in a live cluster).
        bound = {**updated, "spec": {**(updated.get("spec") or {}), "nodeName": node}}
        with self.lock:
            self.view.upsert_pod(bound, self.clock())
        return wire.BindingResult()

    def _after_failed_write(self, ns: str, name: str, uid: str, node: str, err: KubeApiError) -> wire.BindingResult:
        """Bound (by this call or an earlier one: a 409 "already assigned" to this node) means success;
        an unclear error that cannot be checked keeps the assignment; otherwise undo and release."""
        if unclear(err) or err.status == 409:
            try:
                pod = self.binder.read_pod(ns, name)
            except KubeApiError as read_err:
                if not unclear(err):
                    pod = None
                else:
                    # Still unclear: the Binding may have taken effect, so the assignment stays (unbound,
                    # it holds its slices only until its reservation time is up); the scheduler retries.
                    return wire.BindingResult(f"bind {ns}/{name} to {node}: {err}; the outcome is unknown "
                                              f"(reading the pod back failed: {read_err})")
            if pod is not None and (pod.get("spec") or {}).get("nodeName") == node:
                with self.lock:
                    self.view.upsert_pod(pod, self.clock())
                return wire.BindingResult()
        try:
            undone = self.binder.write_assignment(ns, name, uid, None)
            with self.lock:
                self.view.upsert_pod(undone, self.clock())
        except KubeApiError as undo:
            log.warning("could not take back the assignment of %s/%s: %s", ns, name, undo)
        with self.lock:
            self.view.release(uid)
        return wire.BindingResult(f"bind {ns}/{name} to {node}: {err}")

