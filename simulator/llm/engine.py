"""Event-driven replay of the built-in day through the extender's own decision code.

Per pod, exactly what the extender does, through the same API (:mod:`gpuslice.scheduler`): the
narrowed filter over the shared ``ClusterState`` (memory floors, isolation, owner spread, the
policy's scores, the consistent node order), a reservation held at filter time and a bind
``bind_latency_s`` later; refused pods get the filter's reasons (:mod:`gpuslice.reasons`).

Around it, what Kubernetes does: new pods are tried at once in creation order; a pod that fits
nowhere waits Pending and is retried whenever slices are freed (kube-scheduler moves
unschedulable pods back to its active queue on pod deletion); a scale-down deletes Pending pods
first, then the newest (ReplicaSet rules); a rollout deletes old-revision pods; Job pods leave
``run_s`` after they were bound. Signals are policies: ``cost`` reads the node prices in the
state, ``utilization`` reads per-unit activity that the engine refreshes like a DCGM scrape.

Why the numbers mean what they say: all policies see the same event list, the same cluster and
the same node order, so differences come from placement alone.
"""

from __future__ import annotations

import heapq
import math
import re
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from gpuslice.decision import NarrowConfig
from gpuslice.packing.build import pack_request as build_pack_request
from gpuslice.packing.build import state_from_inventories
from gpuslice.packing.state import KIND_MPS, ClusterState, NodeSpec, PackRequest
from gpuslice.policies import utilization as utilization_policy
from gpuslice.reasons import explain
from gpuslice.requests import SliceRequest
from gpuslice.reservations import DEFAULT_TTL_S
from gpuslice.scheduler import PackedCluster, Scheduler
from simulator.dra import DeviceChoice, attach
from simulator.llm.cluster import Cluster, S
from simulator.llm.workload import Owner, Workload, diurnal
from simulator.miglayouts import RECUT_WAIT_S, DynamicLayouts

F64 = NDArray[np.float64]
I64 = NDArray[np.int64]

PodPhase = Literal["pending", "reserved", "running", "gone"]


def build_state(cluster: Cluster) -> tuple[ClusterState, I64]:
    """The packing state of the (empty) cluster and, per unit row, a cluster-wide GPU number.

    Built by ``gpuslice.packing.build`` from the node inventories, as the extender builds it.
    """
    entries = []
    for node in cluster.nodes:
        cpu, mem = node.allocatable
        prod = node.inventory.gpus[0].product if node.inventory.gpus else ""
        entries.append((NodeSpec(node.name, cpu, mem, prod, node.hourly_cost), node.inventory))
    state = state_from_inventories(entries, slices_per_gpu=S)
    gpu_number: dict[tuple[int, int], int] = {}
    for v, node in enumerate(cluster.nodes):
        for gpu in node.inventory.gpus:
            gpu_number[(v, gpu.index)] = len(gpu_number)
    numbers = np.array([gpu_number[(int(state.unit_node[u]), int(state.unit_gpu_index[u]))]
                        for u in range(state.n_units)], dtype=np.int64)
    return state, numbers


def pack_request(owner: Owner, uid: str) -> PackRequest:
    """A pod's ``SliceRequest`` in packing terms, with the model server's CPU and host memory."""
    req: SliceRequest = owner.request
    host_mem = 16 * 1024 + math.ceil(owner.variant.memory_gib * 1024)
    return build_pack_request(req, slices_per_gpu=S, cpu_milli=2000 + 250 * req.slices, memory_mib=host_mem,
                              owner=owner.name, uid=uid)


@dataclass(slots=True)
class Pod:
    uid: str
    owner: Owner
    revision: int
    created: float
    req: PackRequest
    phase: PodPhase = "pending"
    node: int = -1
    units: tuple[int, ...] = ()
    bound_at: float = -1.0
    pending_since: float = -1.0
    ever_pending: bool = False
    activity: float = 0.0


@dataclass(slots=True)
class Result:
    """One policy on one seed. Time averages are over the simulated day."""

    policy: str
    seed: int
    pods_created: int = 0
    pods_placed: int = 0
    pods_pending: int = 0  # went Pending at least once for lack of a fitting slice
    pods_never_placed: int = 0  # deleted (scale-down, end of day) while still Pending
    pending_pod_hours: float = 0.0
    gpus_in_use_avg: float = 0.0
    gpus_in_use_peak: int = 0
    fragmentation_pct: float = 0.0  # idle slices on GPUs in use / slices of GPUs in use, time-averaged
    cost_per_hour: float = 0.0  # $/h of nodes holding any GPU pod, time-averaged
    cost_peak: float = 0.0
    gpus_total: int = 0
    cluster_cost_per_hour: float = 0.0
    reasons: Counter[str] = field(default_factory=Counter)
    decisions: int = 0
    wall_s: float = 0.0
    leaked_slices: int = 0
    series: list[tuple[float, int, float]] = field(default_factory=list)  # (hour, GPUs in use, $/h)
    # Dynamic MIG layouts (``mig_dynamic``): pods that waited for a re-cut instead of going Pending
    # (not in ``pods_pending``), the pod-hours of those waits, the re-cuts, and instances destroyed
    # that held or were reserved for a pod (refused and counted: must be 0).
    pods_recut: int = 0
    recut_wait_pod_hours: float = 0.0
    running_pod_hours: float = 0.0  # slice pods bound and running, integrated over the day
    recuts: int = 0
    busy_instances_destroyed: int = 0

    def top_reasons(self, n: int = 3) -> list[tuple[str, int]]:
        return self.reasons.most_common(n)

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy, "seed": self.seed, "pods_created": self.pods_created,
            "pods_placed": self.pods_placed, "pods_pending": self.pods_pending,
            "pods_never_placed": self.pods_never_placed, "pending_pod_hours": round(self.pending_pod_hours, 3),
            "gpus_in_use_avg": round(self.gpus_in_use_avg, 3), "gpus_in_use_peak": self.gpus_in_use_peak,
            "fragmentation_pct": round(self.fragmentation_pct, 3), "cost_per_hour": round(self.cost_per_hour, 3),
            "cost_peak": round(self.cost_peak, 3), "gpus_total": self.gpus_total,
            "cluster_cost_per_hour": round(self.cluster_cost_per_hour, 2),
            "pending_reasons": dict(self.reasons.most_common()), "decisions": self.decisions,
            "leaked_slices": self.leaked_slices, "wall_s": round(self.wall_s, 3),
            "running_pod_hours": round(self.running_pod_hours, 3), "pods_recut": self.pods_recut,
            "recut_wait_pod_hours": round(self.recut_wait_pod_hours, 3),
            "recuts": self.recuts, "busy_instances_destroyed": self.busy_instances_destroyed,
        }


_OWNER_RULE = re.compile(r"already runs a pod of \S+")
_NODE_FREE = re.compile(r", node has \d+m? (MiB )?free")
_NODE_SPECIFIC = re.compile(
    r" \((at most [^)]*|instances here: [^)]*|modes here: [^)]*)\)|, and the node has \d+|^GPU [\d, ]+ could")


def normalise_reasons(texts: Iterable[str]) -> set[str]:
    """The distinct causes in a pod's per-node reasons, without node or owner specifics."""
    out: set[str] = set()
    for text in texts:
        parts = text.split("; ")
        # A node short of host CPU/RAM and of slices is reported by its GPU cause: slices are what
        # this report is about, and a full node is usually short of both.
        gpu_parts = [p for p in parts if not p.startswith(("insufficient cpu", "insufficient memory"))]
        for part in gpu_parts or parts:
            part = _OWNER_RULE.sub("already runs a pod of the same owner", part)
            part = _NODE_FREE.sub("", part).replace("insufficient memory:", "insufficient host memory:")
            part = _NODE_SPECIFIC.sub(lambda m: "GPUs that could" if m.group(0).startswith("GPU") else "", part)
            out.add(part)
    return out


# Event priorities at one instant: departures free slices before arrivals ask for them, binds last.
_P_BIND, _P_DELETE, _P_ROLLOUT, _P_CREATE, _P_JOB_END = 0, 1, 2, 3, 1


class Replay:
    """One policy over one workload. ``run()`` returns a :class:`Result`; the object is single-use."""

    def __init__(self, cluster: Cluster, workload: Workload, policy: str, *, margin: float = 0.0,
                 bind_latency_s: float = 0.5, reservation_ttl_s: float = DEFAULT_TTL_S, scrape_s: float = 30.0,
                 series_step_s: float = 900.0, mig_dynamic: frozenset[str] = frozenset(),
                 recut_wait_s: float = RECUT_WAIT_S, devices: DeviceChoice | None = None) -> None:
        self.cluster = cluster
        self.workload = workload
        self.policy_spec = policy
        self.bind_latency_s = bind_latency_s
        self.scrape_s = scrape_s
        self.series_step_s = series_step_s
        self.state, self.unit_gpu = build_state(cluster)
        self.packed = PackedCluster(self.state, reservation_ttl_s)
        self.sched = Scheduler(self.packed, policy, narrow=NarrowConfig(margin=margin, max_nodes=1),
                               seed=workload.seed)
        self.policy = self.sched.policy
        self.memory = self.sched.memory
        self.n_gpus = int(self.unit_gpu.max()) + 1 if self.unit_gpu.shape[0] else 0
        self.gpu_node = np.zeros(self.n_gpus, dtype=np.int64)
        self.gpu_node[self.unit_gpu] = self.state.unit_node[: self.state.n_units]
        self.gpu_slices = np.bincount(self.unit_gpu, weights=self.state.unit_cap[: self.state.n_units],
                                      minlength=self.n_gpus)
        self.unit_activity = np.zeros(self.state.n_units + 1)
        self.pods: dict[str, Pod] = {}
        self.by_owner: dict[str, list[Pod]] = {}
        self.revision: dict[str, int] = {}
        self.pending: list[Pod] = []  # FIFO by creation, like kube-scheduler's queue (equal priority)
        self.heap: list[tuple[float, int, int, str, str, int]] = []
        self.seq = 0
        self.uid_n = 0
        self.freed = False
        self.result = Result(policy, workload.seed, gpus_total=cluster.gpu_count,
                             cluster_cost_per_hour=cluster.hourly_cost())
        self._t = 0.0
        self._gpus_now = 0
        self._cost_now = 0.0
        self._frag_num = 0.0
        self._frag_den = 0.0
        self._dirty = True
        self._next_scrape = 0.0
        self._next_series = 0.0
        self._frag_cap = 0.0
        self._frag_idle = 0.0
        self._owners = {o.name: o for o in workload.owners}
        self._running = 0
        # Dynamic MIG layouts: the core's re-cuts for pods refused for shape; the pod binds after the
        # modelled wait for its re-cut (``simulator.miglayouts.RECUT_WAIT_S``).
        self.recut_wait_s = recut_wait_s
        self.layouts = DynamicLayouts.build(self.state, {n.name: n.inventory for n in cluster.nodes}, mig_dynamic,
                                            memory_tolerance=self.state.memory_tolerance,
                                            wait_s=recut_wait_s) if mig_dynamic else None
        self.driver = attach(self.sched, devices, self.layouts)  # None: the extender picks the device (today)
        self._gpu_number = {(int(self.state.unit_node[u]), int(self.state.unit_gpu_index[u])): int(self.unit_gpu[u])
                            for u in range(self.state.n_units)}

    # ----- events ---------------------------------------------------------------------------
    def _push(self, t: float, prio: int, kind: str, key: str, count: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, prio, self.seq, kind, key, count))

    def run(self) -> Result:
        started = time.perf_counter()
        for e in self.workload.events:
            prio = {"create": _P_CREATE, "delete": _P_DELETE, "delete-old": _P_DELETE, "rollout": _P_ROLLOUT}[e.kind]
            self._push(e.time_s, prio, e.kind, e.owner, e.count)
        end = self.workload.duration_s
        while self.heap and self.heap[0][0] < end:
            t = self.heap[0][0]
            self._advance(t)
            while self.heap and self.heap[0][0] == t:
                _, _, _, kind, key, count = heapq.heappop(self.heap)
                self._handle(t, kind, key, count)
            if self.freed:
                self.freed = False
                self._retry_pending(t)
        self._advance(end)
        self._drain(end)
        r = self.result
        r.gpus_in_use_avg /= end
        r.cost_per_hour /= end
        r.fragmentation_pct = 100.0 * self._frag_num / self._frag_den if self._frag_den else 0.0
        r.pending_pod_hours /= 3600.0  # accumulated in pod-seconds
        r.wall_s = time.perf_counter() - started
        return r

    def _handle(self, t: float, kind: str, key: str, count: int) -> None:
        if kind == "create":
            owner = self._owners[key]
            for _ in range(count):
                self._create(t, owner)
        elif kind == "delete":
            self._scale_down(t, key, count)
        elif kind == "delete-old":
            self._delete_old(t, key, count)
        elif kind == "rollout":
            self.revision[key] = self.revision.get(key, 0) + 1
        elif kind == "bind":
            self._bind(t, key)
        elif kind == "job-end":
            pod = self.pods.get(key)
            if pod is not None and pod.phase != "gone":
                self._delete(t, pod)
        else:  # pragma: no cover - programming error
            raise ValueError(kind)

    # ----- pods -----------------------------------------------------------------------------
    def _create(self, t: float, owner: Owner) -> None:
        self.uid_n += 1
        uid = f"{owner.name.replace('/', '.')}-{self.uid_n:05d}"
        pod = Pod(uid, owner, self.revision.get(owner.name, 0), t, pack_request(owner, uid))
        pod.activity = owner.variant.utilization
        self.pods[uid] = pod
        self.by_owner.setdefault(owner.name, []).append(pod)
        self.result.pods_created += 1
        self.sched.observe(pod.req)
        if self.layouts is not None:
            self.layouts.observe(pod.req)
        if self.driver is not None:
            self.driver.observe(pod.req)
        if not self._schedule(t, pod, first=True):
            pod.ever_pending = True
            pod.pending_since = t
            self.result.pods_pending += 1
            self.pending.append(pod)

    def _schedule(self, t: float, pod: Pod, *, first: bool) -> bool:
        """One scheduling cycle: filter (narrowed), reserve; False when no node fits."""
        state, req = self.state, pod.req
        self._refresh_signals(t)
        chosen, ranked, _ = self.sched.filter_request(req, None, t, explain_refused=False)
        self.result.decisions += 1
        delay = self.bind_latency_s
        if chosen.node.shape[0] == 0 and self.layouts is not None and self.layouts.recut_for(req, t) is not None:
            self._sync_units()
            chosen, ranked, _ = self.sched.filter_request(req, None, t, explain_refused=False)
            if chosen.node.shape[0]:
                delay = max(self.recut_wait_s, self.bind_latency_s)
                self.result.pods_recut += 1
                self.result.recut_wait_pod_hours += delay / 3600.0
        if chosen.node.shape[0] == 0:
            if first:
                rows = np.flatnonzero(state.node_alive).astype(np.int64)
                for text in normalise_reasons(explain(state, req, ranked.fit, rows).texts):
                    self.result.reasons[text] += 1
            return False
        i = int(chosen.index[0])
        node = int(ranked.cands.node[i])
        units = tuple(int(u) for u in ranked.cands.units[i])
        pod.phase, pod.node, pod.units = "reserved", node, units
        self._mark(units, +pod.activity * req.slices / S, t)
        self._push(t + delay, _P_BIND, "bind", pod.uid)
        self._dirty = True
        self._changed()
        return True

    def _sync_units(self) -> None:
        """A re-cut added unit rows: extend the per-unit arrays and the GPUs' advertised capacity."""
        st = self.state
        n = st.n_units
        old = self.unit_gpu.shape[0]
        if n > old:
            extra = [self._gpu_number[(int(st.unit_node[u]), int(st.unit_gpu_index[u]))] for u in range(old, n)]
            self.unit_gpu = np.concatenate([self.unit_gpu, np.array(extra, dtype=np.int64)])
            self.unit_activity = np.concatenate([self.unit_activity[:old], np.zeros(n - old),
                                                 self.unit_activity[old:]])
        live = np.zeros(n, dtype=bool)
        rows = st.node_units[st.node_alive]
        live[rows[rows >= 0]] = True
        self.gpu_slices = np.bincount(self.unit_gpu, weights=np.where(live, st.unit_cap[:n], 0),
                                      minlength=self.n_gpus)

    def _bind(self, t: float, uid: str) -> None:
        pod = self.pods.get(uid)
        if pod is None or pod.phase != "reserved":
            return
        if self.packed.bind(uid) is None:  # expired before bind: kube-scheduler retries
            self._changed()
            pod.phase = "pending"
            self._mark(pod.units, -pod.activity * pod.req.slices / S, t)
            pod.node, pod.units = -1, ()
            pod.pending_since = t
            self.pending.append(pod)
            return
        pod.phase = "running"
        pod.bound_at = t
        self._running += 1
        self.result.pods_placed += 1
        if pod.owner.kind == "Job":
            self._push(t + pod.owner.run_s, _P_JOB_END, "job-end", uid)

    def _delete(self, t: float, pod: Pod) -> None:
        if pod.phase == "pending":
            self.pending.remove(pod)
            self.result.pending_pod_hours += t - pod.pending_since
            if pod.bound_at < 0:
                self.result.pods_never_placed += 1
        elif pod.phase == "reserved":
            self.packed.release(pod.uid)
            self._freed(pod, t)
        elif pod.phase == "running":
            self._running -= 1
            r = pod.req
            self.state.give_back(pod.node, pod.units, r.slices, r.cpu_milli, r.memory_mib, r.owner)
            self._freed(pod, t)
        pod.phase = "gone"
        self.by_owner[pod.owner.name].remove(pod)
        del self.pods[pod.uid]

    def _freed(self, pod: Pod, t: float) -> None:
        self._mark(pod.units, -pod.activity * pod.req.slices / S, t)
        self.freed = True
        self._dirty = True
        self._changed()

    def _changed(self) -> None:
        """A placement or departure: a steered DRA driver may republish (``devices``)."""
        if self.driver is not None:
            self.driver.event()

    def _scale_down(self, t: float, owner: str, count: int) -> None:
        """ReplicaSet order: unscheduled pods first, then the most recently created."""
        pods = self.by_owner.get(owner, [])
        victims = sorted(pods, key=lambda p: (p.phase != "pending", -p.created, p.uid))[:count]
        for pod in victims:
            self._delete(t, pod)

    def _delete_old(self, t: float, owner: str, count: int) -> None:
        """Rollout step: old-revision pods go, unscheduled first, then the oldest."""
        rev = self.revision.get(owner, 0)
        old = [p for p in self.by_owner.get(owner, []) if p.revision < rev]
        victims = sorted(old, key=lambda p: (p.phase != "pending", p.created, p.uid))[:count]
        for pod in victims:
            self._delete(t, pod)

    def _retry_pending(self, t: float) -> None:
        """Slices were freed: retry waiting pods in queue order; a request shape that found no
        unit even without its owner's spread rule is not retried again in this round."""
        hopeless: set[tuple[int, int, int, str, int, int]] = set()
        for pod in list(self.pending):
            r = pod.req
            key = (r.gpus, r.slices, r.gpu_memory_mib, r.isolation, r.cpu_milli, r.memory_mib)
            if key in hopeless:
                continue
            if self._schedule(t, pod, first=False):
                self.pending.remove(pod)
                self.result.pending_pod_hours += t - pod.pending_since
            elif not self.state.fit(PackRequest(cpu_milli=r.cpu_milli, memory_mib=r.memory_mib, gpus=r.gpus,
                                                slices=r.slices, gpu_memory_mib=r.gpu_memory_mib,
                                                isolation=r.isolation)).feasible.any():
                hopeless.add(key)

    def _drain(self, t: float) -> None:
        """End of the day: every owner is deleted; what stays allocated afterwards is a leak."""
        for pod in sorted(self.pods.values(), key=lambda p: p.uid):
            self._delete(t, pod)
        self.packed.expire(math.inf)
        st = self.state
        self.result.leaked_slices = int((st.unit_cap[: st.n_units] - st.unit_free[: st.n_units]).sum())
        if self.layouts is not None:
            self.result.recuts = self.layouts.recuts
            self.result.busy_instances_destroyed = self.layouts.busy_refused

    # ----- signals and metrics ------------------------------------------------------------------
    def _mark(self, units: Sequence[int], delta: float, t: float) -> None:
        for u in units:
            self.unit_activity[u] = max(0.0, self.unit_activity[u] + delta)

    def _refresh_signals(self, t: float) -> None:
        """A DCGM scrape every ``scrape_s``: the utilization policy sees activity as of the last one,
        scaled by the hour's traffic (decoding load follows requests)."""
        if t < self._next_scrape:
            return
        self._next_scrape = t + self.scrape_s
        mems = self.memory if isinstance(self.memory, tuple) else (self.memory,)
        load = 0.4 + 0.6 * diurnal(t / 3600.0, 14.0)
        n = self.state.n_units
        for m in mems:
            if isinstance(m, utilization_policy.UtilizationMemory):
                caps = np.maximum(self.state.unit_cap[:n], 1)
                share = np.where(self.state.unit_kind[:n] == KIND_MPS, 1.0, S / caps)
                act = np.minimum(1.0, self.unit_activity[:n] * share * load)
                m.update(np.arange(n, dtype=np.int64), act, t, n)
                m.now = t

    def _measure(self) -> None:
        st = self.state
        n = st.n_units
        used = (st.unit_cap[:n] - st.unit_free[:n]).astype(np.float64)
        per_gpu = np.bincount(self.unit_gpu, weights=used, minlength=self.n_gpus)
        in_use = per_gpu > 0
        self._gpus_now = int(in_use.sum())
        nodes_used = np.zeros(st.n_nodes, dtype=bool)
        nodes_used[self.gpu_node[in_use]] = True
        self._cost_now = float(st.node_cost[nodes_used].sum())
        self._frag_cap = float(self.gpu_slices[in_use].sum())
        self._frag_idle = float((self.gpu_slices[in_use] - per_gpu[in_use]).sum())
        self._dirty = False

    def _advance(self, t: float) -> None:
        """Integrate the metrics from the last instant to ``t``."""
        if self._dirty:
            self._measure()
        dt = t - self._t
        if dt > 0:
            r = self.result
            r.gpus_in_use_avg += self._gpus_now * dt
            r.running_pod_hours += self._running * dt / 3600.0
            r.cost_per_hour += self._cost_now * dt
            self._frag_num += self._frag_idle * dt
            self._frag_den += self._frag_cap * dt
            while self._next_series <= t:
                r.series.append((self._next_series / 3600.0, self._gpus_now, self._cost_now))
                self._next_series += self.series_step_s
        r = self.result
        r.gpus_in_use_peak = max(r.gpus_in_use_peak, self._gpus_now)
        r.cost_peak = max(r.cost_peak, self._cost_now)
        self._t = t


def replay(cluster: Cluster, workload: Workload, policy: str, **kwargs: Any) -> Result:
    """Run one policy over one workload (a fresh state each time)."""
    return Replay(cluster, workload, policy, **kwargs).run()
