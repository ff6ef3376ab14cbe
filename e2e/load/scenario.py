"""Sustained load on the whole system (issue 50): a bursty day of LLM serving on real kubelet-dm nodes.

:class:`Load` drives a running :class:`e2e.harness.System` (real kube-apiserver, kube-controller-manager
and two kube-scheduler 1.36 replicas with their extenders, kubelet-dm nodes with their device plugins,
Prometheus) through one compressed day:

* **Deployments** of LLM servers (1 to 7 slices; any isolation, MIG-only, MPS-only; memory floors),
  each scaled every tick to a diurnal curve (night, morning ramp, peak, evening) with random bursts
  (one Deployment's demand doubled for a tick or two), and rolled out now and then (a template
  change: kube-controller-manager replaces every pod);
* **Jobs** of batch pods (1 slice), each pod run for a few seconds and then completed through
  kubelet-dm's ``kubelet-dm/complete`` annotation, so the Job controller starts the next;
* a few **preemptions**: at the peak, a pod of a PriorityClass that may preempt asks for a whole GPU;
* **faults** (when asked): the leading extender and its kube-scheduler killed (the other replica takes
  over, the killed one is restarted as a follower), and one node's kubelet-dm restarted.

Measured throughout, by a watch of the namespace with this process's clock: when each pod appears,
is bound and runs (so p50/p99 from creation to bind and to Running, and pods/s), pods failed at
admission; every few seconds the extenders' CPU and RSS (``/proc``); and every few seconds the pods
Pending for longer than ``pending_limit_s`` are checked with the extender's own filter (the core's
``Scheduler.filter`` over a fresh list of the cluster, with the extender's config): one that the
filter says fits, continuously for longer than the limit, is a **stuck** pod. At the end every bound
pod must run stamped and ``System.audit`` counts what DESIGN 8 says can go wrong.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e.harness import (
    RESOURCE,
    SCHEDULER_NAME,
    TEST_NS,
    System,
    counts_dict,
    follow_pods,
    http,
    restart_node,
    wait,
)

COMPLETE = "kubelet-dm/complete"
URGENT_CLASS = "load-urgent"
LOAD_LABEL = "gpu-slice.example.com/load"


@dataclass(frozen=True)
class Server:
    """One Deployment of LLM servers: its pods' shape and its share of the day's demand."""

    name: str
    slices: int
    most: int  # replicas at the peak (before bursts); the owner-spread rule allows one pod per GPU
    isolation: str | None = None
    memory: str | None = None


@dataclass(frozen=True)
class LoadSpec:
    duration_s: float = 330.0
    tick_s: float = 6.0
    servers: tuple[Server, ...] = ()
    night: float = 0.25  # the curve's floor, as a fraction of each Deployment's peak
    burst_chance: float = 0.15  # per tick: one Deployment's demand doubled for this tick
    rollout_every_s: float = 5.0
    job_every_s: float = 6.0
    job_completions: int = 20
    job_parallelism: int = 8
    job_run_s: tuple[float, float] = (2.0, 6.0)
    preemptions: int = 2
    faults: bool = True
    pending_limit_s: float = 30.0
    check_every_s: float = 5.0
    seed: int = 50


#: The full run's Deployments: LLM servers of every shape the nodes can hold.
FULL_SERVERS = (
    Server("chat-1s", 1, 30), Server("chat-2s", 2, 20), Server("code-3s", 3, 12),
    Server("embed-1s-mig", 1, 10, isolation="mig"), Server("rag-1s-mps", 1, 16, isolation="mps"),
    Server("summ-2s-mps", 2, 10, isolation="mps"), Server("tool-1s-10g", 1, 10, memory="10Gi"),
    Server("big-7s", 7, 4), Server("guard-1s", 1, 16), Server("rank-2s", 2, 10),
)
def scaled(servers: tuple[Server, ...], nodes: int, full_nodes: int = 20) -> tuple[Server, ...]:
    """``servers`` (sized for ``full_nodes``) for a cluster of ``nodes`` of the same layouts."""
    return tuple(Server(s.name, s.slices, max(1, round(s.most * nodes / full_nodes)), s.isolation, s.memory)
                 for s in servers)


#: CI's short run on the session's three nodes (six GPUs: one pod of a Deployment per GPU).
SHORT_SERVERS = (
    Server("chat-1s", 1, 5), Server("chat-2s", 2, 3), Server("embed-1s-mig", 1, 2, isolation="mig"),
    Server("rag-1s-mps", 1, 3, isolation="mps"), Server("code-3s", 3, 2),
)


def diurnal(frac: float, night: float) -> float:
    """Demand over one compressed day (0 = midnight, 0.5 = noon): ``night`` .. 1."""
    return night + (1.0 - night) * math.sin(math.pi * min(max(frac, 0.0), 1.0)) ** 2


def _template(name: str, slices: int, *, labels: dict[str, str], isolation: str | None = None,
              memory: str | None = None, restart: str = "Always", priority_class: str | None = None,
              ) -> dict[str, Any]:
    ann: dict[str, str] = {}
    if memory:
        ann["example.com/gpu-memory"] = memory
    if isolation:
        ann["example.com/gpu-isolation"] = isolation
    spec: dict[str, Any] = {
        "schedulerName": SCHEDULER_NAME, "terminationGracePeriodSeconds": 0, "restartPolicy": restart,
        "containers": [{"name": "server", "image": "registry.invalid/llm-server:1",
                        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                                      "limits": {RESOURCE: str(slices)}}}]}
    if priority_class:
        spec["priorityClassName"] = priority_class
    return {"metadata": {"labels": {**labels, LOAD_LABEL: "1"}, "annotations": ann}, "spec": spec}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def _proc_cpu_rss(pid: int) -> tuple[float, float] | None:
    """(CPU seconds, VmRSS MB) of ``pid``, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        rss = 0.0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), rss


@dataclass
class PodTrack:
    name: str
    uid: str
    owner: str
    slices: int
    seen: float
    bound: float | None = None
    running: float | None = None
    gone: float | None = None
    completed: bool = False
    node: str = ""


@dataclass
class LoadResult:
    spec: LoadSpec
    started: float = 0.0
    ended: float = 0.0
    pods: dict[str, PodTrack] = field(default_factory=dict)
    admission_failures: list[str] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)  # t, replica, pid, cpu_s, rss_mb, load
    stuck: dict[str, str] = field(default_factory=dict)  # pod -> why it counts as stuck
    checks: int = 0
    faults: list[dict[str, Any]] = field(default_factory=list)
    preempted_for: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """The figures issue 50 asks for (times in ms, CPU in ms per pod bound, RSS in MB)."""
        d = max(1e-9, self.ended - self.started)
        bound = [p for p in self.pods.values() if p.bound is not None]
        to_bind = [1000 * (p.bound - p.seen) for p in bound if p.bound is not None]
        to_run = [1000 * (p.running - p.seen) for p in self.pods.values() if p.running is not None]
        out: dict[str, Any] = {
            "duration_s": round(d, 1), "pods_created": len(self.pods), "pods_bound": len(bound),
            "pods_deleted": sum(1 for p in self.pods.values() if p.gone is not None),
            "pods_per_s_bound": round(len(bound) / d, 2),
            "create_to_bind_ms": {"p50": round(_pct(to_bind, 50)), "p99": round(_pct(to_bind, 99)),
                                  "max": round(max(to_bind, default=0))},
            "create_to_running_ms": {"p50": round(_pct(to_run, 50)), "p99": round(_pct(to_run, 99)),
                                     "max": round(max(to_run, default=0))},
            "admission_failures": len(self.admission_failures), "stuck_pending": len(self.stuck),
            "pending_checks": self.checks, "faults": self.faults, "preemptors": self.preempted_for,
            "audit": self.counts,
        }
        # Peak 10-second bind rate.
        times = sorted(p.bound for p in bound if p.bound is not None)
        peak, j = 0, 0
        for i, t in enumerate(times):
            while times[j] < t - 10.0:
                j += 1
            peak = max(peak, i - j + 1)
        out["peak_pods_per_s_bound_10s"] = round(peak / 10.0, 1)
        cpu: dict[tuple[int, int], list[float]] = {}
        for s in self.samples:
            cpu.setdefault((s["replica"], s["pid"]), []).append(s["cpu_s"])
        used = sum(v[-1] - v[0] for v in cpu.values())
        out["extender_cpu_s"] = round(used, 2)
        out["extender_cpu_s_by_process"] = {f"extender-{r} pid {pid}": round(v[-1] - v[0], 2)
                                            for (r, pid), v in sorted(cpu.items())}
        out["extender_cpu_ms_per_pod"] = round(1000 * used / max(1, len(bound)), 2)
        out["rss"] = self.rss_report()
        out["load_avg"] = [round(s["load"], 2) for s in self.samples[:: max(1, len(self.samples) // 12)]]
        return out

    def rss_report(self) -> dict[str, Any]:
        """Per extender process: RSS at the end of its first minute and at the end, and the growth."""
        by: dict[tuple[int, int], list[tuple[float, float]]] = {}
        for s in self.samples:
            by.setdefault((s["replica"], s["pid"]), []).append((s["t"], s["rss_mb"]))
        out: dict[str, Any] = {}
        for (replica, pid), series in sorted(by.items()):
            t0 = series[0][0]
            after = [r for t, r in series if t >= t0 + 60.0]
            key = f"extender-{replica} pid {pid}"
            entry: dict[str, Any] = {"first_s": round(t0 - self.started, 1),
                                     "last_s": round(series[-1][0] - self.started, 1),
                                     "series_mb": [round(r) for _, r in series[:: max(1, len(series) // 12)]]}
            if after and series[-1][0] - t0 >= 120.0:
                entry["at_1min_mb"] = round(after[0], 1)
                entry["end_mb"] = round(series[-1][1], 1)
                entry["growth_pct"] = round(100.0 * (series[-1][1] - after[0]) / after[0], 1)
            out[key] = entry
        return out


class Load:
    """One run of :class:`LoadSpec` on ``system``; :meth:`run` returns the :class:`LoadResult`."""

    def __init__(self, system: System, spec: LoadSpec, *, say: Callable[[str], None] = print) -> None:
        self.system, self.spec, self.say = system, spec, say
        self.rng = random.Random(spec.seed)
        self.result = LoadResult(spec)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        from kubernetes import client

        self.batch = client.BatchV1Api(system.kube.api_client)
        self.core = system.kube.core
        self.jobs = 0
        self.burst: dict[str, int] = {}
        self.fault_busy = threading.Event()

    # ----- the run

    def run(self) -> LoadResult:
        spec, res = self.spec, self.result
        self._setup()
        res.started = time.monotonic()
        for target in (self._watch, self._sample, self._complete_jobs, self._check_pending):
            t = threading.Thread(target=self._guard(target), name=target.__name__, daemon=True)
            t.start()
            self.threads.append(t)
        next_rollout = res.started + spec.rollout_every_s
        next_job = res.started + 2.0
        preempt_at = [res.started + spec.duration_s * (0.42 + 0.1 * i) for i in range(spec.preemptions)]
        faults = [(res.started + 0.33 * spec.duration_s, self._kill_leader),
                  (res.started + 0.62 * spec.duration_s, self._restart_kubelet)] if spec.faults else []
        try:
            while (now := time.monotonic()) < res.started + spec.duration_s:
                self._scale((now - res.started) / spec.duration_s)
                if now >= next_rollout:
                    self._rollout()
                    next_rollout = now + spec.rollout_every_s
                if now >= next_job:
                    self._job()
                    next_job = now + spec.job_every_s
                while preempt_at and now >= preempt_at[0]:
                    preempt_at.pop(0)
                    self._preemptor()
                while faults and now >= faults[0][0]:
                    _, fn = faults.pop(0)
                    t = threading.Thread(target=self._guard(fn), name=fn.__name__, daemon=True)
                    t.start()
                    self.threads.append(t)
                self.stop.wait(max(0.0, spec.tick_s - (time.monotonic() - now)))
            res.ended = time.monotonic()
            for t in self.threads:
                if t.name in ("_kill_leader", "_restart_kubelet"):
                    t.join(240)
            self._settle_and_audit()
        finally:
            self.stop.set()
            for t in self.threads:
                t.join(15)
        return res

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except Exception as exc:  # recorded and reported: the scenario goes on
                with self.lock:
                    self.result.errors.append(f"{fn.__name__}: {exc!r}"[:500])
        return run

    def _setup(self) -> None:
        kube = self.system.kube
        for server in self.spec.servers:
            body = {"apiVersion": "apps/v1", "kind": "Deployment",
                    "metadata": {"name": server.name, "namespace": TEST_NS},
                    "spec": {"replicas": 0, "selector": {"matchLabels": {"app": server.name}},
                             "strategy": {"type": "RollingUpdate",
                                          "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}},
                             "template": _template(server.name, server.slices, labels={"app": server.name},
                                                   isolation=server.isolation, memory=server.memory)}}
            kube._json(kube.apps.create_namespaced_deployment(TEST_NS, body, _preload_content=False))
        if self.spec.preemptions:
            with contextlib.suppress(Exception):  # kept from an earlier run in this session
                kube._json(kube.sched.create_priority_class({
                    "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": URGENT_CLASS},
                    "value": 100000, "preemptionPolicy": "PreemptLowerPriority",
                    "description": "load scenario: may preempt"}, _preload_content=False))

    # ----- the workload

    def _scale(self, frac: float) -> None:
        level = diurnal(frac, self.spec.night)
        if self.rng.random() < self.spec.burst_chance:
            server = self.rng.choice(self.spec.servers)
            self.burst[server.name] = 1 + self.rng.randrange(2)
        for server in self.spec.servers:
            want = round(server.most * level * (0.85 + 0.3 * self.rng.random()))
            if self.burst.get(server.name):
                want = min(2 * want + 1, 2 * server.most)
                self.burst[server.name] -= 1
            self.system.kube.scale(server.name, max(0, want))

    def _rollout(self) -> None:
        server = self.rng.choice(self.spec.servers)
        patch = {"spec": {"template": {"metadata": {"annotations": {"load.example.com/rollout": str(time.time())}}}}}
        kube = self.system.kube
        kube._json(kube.apps.patch_namespaced_deployment(server.name, TEST_NS, patch, _preload_content=False))

    def _job(self) -> None:
        self.jobs += 1
        name = f"batch-{self.jobs:03d}"
        body = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": TEST_NS},
                "spec": {"completions": self.spec.job_completions, "parallelism": self.spec.job_parallelism,
                         "backoffLimit": 2, "ttlSecondsAfterFinished": 5,
                         "template": _template(name, 1, labels={"job-name": name}, restart="Never")}}
        self.system.kube._json(self.batch.create_namespaced_job(TEST_NS, body, _preload_content=False))

    def _preemptor(self) -> None:
        name = f"urgent-{len(self.result.preempted_for)}"
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": TEST_NS},
                **_template(name, 7, labels={"app": name}, priority_class=URGENT_CLASS)}
        body["metadata"] = {**body["metadata"], "name": name, "namespace": TEST_NS}
        self.system.kube.create_pod(body)
        with self.lock:
            self.result.preempted_for.append(name)

    # ----- faults

    def _kill_leader(self) -> None:
        system = self.system
        if len(system.replicas) < 2:
            with self.lock:
                self.result.faults.append({"kind": "leader kill",
                                           "skipped": "one replica only (no root or no unshare)"})
            return
        t0 = time.monotonic()
        leader = system.wait_leader()
        leader.extender.kill()
        system.stop_scheduler(leader)
        other = system.wait_leader(timeout=120, exclude=leader)
        took = time.monotonic() - t0
        leader.extender.start()
        wait("the restarted extender /healthz", lambda: http("GET", f"{leader.url}/healthz")[0] == 200, 60)
        system.start_scheduler(leader)
        system.fault("leader extender + kube-scheduler killed")
        with self.lock:
            self.result.faults.append({"kind": "leader kill", "at_s": round(t0 - self.result.started, 1),
                                       "killed": leader.identity, "new_leader": other.identity,
                                       "takeover_s": round(took, 1)})

    def _restart_kubelet(self) -> None:
        system = self.system
        with self.lock:
            on: dict[str, int] = {}
            for p in self.result.pods.values():
                if p.node and p.running is not None and p.gone is None:
                    on[p.node] = on.get(p.node, 0) + 1
        name = max(sorted(system.nodes), key=lambda n: on.get(n, 0))
        t0 = time.monotonic()
        restart_node(system, name)
        system._wait_node_ready(system.nodes[name])
        system.fault("kubelet-dm restarted")
        with self.lock:
            self.result.faults.append({"kind": "kubelet-dm restart", "node": name,
                                       "pods_running_there": on.get(name, 0),
                                       "at_s": round(t0 - self.result.started, 1),
                                       "ready_again_s": round(time.monotonic() - t0, 1)})

    # ----- watching

    def _watch(self) -> None:
        follow_pods(self.core, TEST_NS, lambda kind, pod, now: self._seen(pod, now, kind), self.stop)

    def _seen(self, pod: dict[str, Any], now: float, kind: str) -> None:
        meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
        labels = meta.get("labels") or {}
        if labels.get(LOAD_LABEL) != "1":
            return
        uid = str(meta.get("uid"))
        with self.lock:
            track = self.result.pods.get(uid)
            if track is None:
                slices = 0
                for c in spec.get("containers") or []:
                    slices += int(((c.get("resources") or {}).get("limits") or {}).get(RESOURCE) or 0)
                owner = str(labels.get("app") or labels.get("job-name") or meta.get("name"))
                track = self.result.pods[uid] = PodTrack(str(meta.get("name")), uid, owner, slices, now)
            if spec.get("nodeName") and track.bound is None:
                track.bound, track.node = now, str(spec["nodeName"])
            if status.get("phase") == "Running" and track.running is None:
                track.running = now
            if status.get("phase") == "Failed" and (status.get("reason") == "UnexpectedAdmissionError"
                                                    or str(status.get("reason", "")).startswith("OutOf")):
                label = f"{meta.get('name')}: {status.get('reason')}: {status.get('message')}"
                if label not in self.result.admission_failures:
                    self.result.admission_failures.append(label)
            if (kind == "DELETED" or meta.get("deletionTimestamp")) and track.gone is None:
                track.gone = now

    def _sample(self) -> None:
        while not self.stop.is_set():
            now = time.monotonic()
            for r in list(self.system.replicas):
                p = r.extender.popen
                if p is None or p.poll() is not None:
                    continue
                got = _proc_cpu_rss(p.pid)
                if got is not None:
                    with self.lock:
                        self.result.samples.append({"t": now, "replica": r.index, "pid": p.pid, "cpu_s": got[0],
                                                    "rss_mb": got[1], "load": os.getloadavg()[0]})
            self.stop.wait(2.0)

    def _complete_jobs(self) -> None:
        lo, hi = self.spec.job_run_s
        while not self.stop.is_set():
            now = time.monotonic()
            with self.lock:
                due = [p for p in self.result.pods.values()
                       if p.owner.startswith("batch-") and p.running is not None and p.gone is None and not p.completed
                       and now - p.running >= lo + (hi - lo) * (hash(p.uid) % 1000) / 1000]
            for p in due:
                with contextlib.suppress(Exception):  # deleted meanwhile
                    done = {"metadata": {"annotations": {COMPLETE: "Succeeded"}}}
                    self.system.kube._json(self.core.patch_namespaced_pod(p.name, TEST_NS, done,
                                                                          _preload_content=False))
                p.completed = True
            self.stop.wait(0.5)

    def _check_pending(self) -> None:
        """Pods Pending past the limit, asked of the extender's own filter (the core, the extender's config,
        a fresh list of the cluster): one the filter keeps saying fits for longer than the limit is stuck."""
        from gpuslice.config import load_config_text
        from gpuslice.scheduler import Scheduler
        from gpuslice.view import ClusterView

        config = load_config_text(self.system.extender_config.read_text())
        fits_since: dict[str, float] = {}
        limit = self.spec.pending_limit_s
        while not self.stop.wait(self.spec.check_every_s):
            now = time.monotonic()
            with self.lock:
                waiting = {p.uid for p in self.result.pods.values()
                           if p.bound is None and p.gone is None and now - p.seen > limit}
            if not waiting:
                fits_since.clear()
                continue
            nodes = self.system.kube.nodes()
            pods = self.system.kube.pods(None)
            items = [{**n, "kind": "Node"} for n in nodes] + [{**p, "kind": "Pod"} for p in pods]
            view = ClusterView.from_objects(items, time.time(), config=config)
            sched = Scheduler.from_config(view, config)
            names = [n["metadata"]["name"] for n in nodes]
            self.result.checks += 1
            for pod in sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or ""):
                uid = pod["metadata"]["uid"]
                if uid not in waiting or pod["spec"].get("nodeName") or pod["metadata"].get("deletionTimestamp"):
                    continue
                res = sched.filter(pod, names, time.time())
                if res.feasible:
                    first = fits_since.setdefault(uid, now)
                    name = pod["metadata"]["name"]
                    if now - first > limit and name not in self.result.stuck:
                        why = f"Pending {now - self.result.pods[uid].seen:.0f} s; the extender's filter has passed " \
                              f"{res.feasible[0]} for {now - first:.0f} s; {self._scheduler_says(pod)}"
                        with self.lock:
                            self.result.stuck[name] = why
                else:
                    fits_since.pop(uid, None)

    def _scheduler_says(self, pod: dict[str, Any]) -> str:
        """What kube-scheduler last said about the pod: its PodScheduled condition and latest event."""
        cond = next((c for c in pod["status"].get("conditions") or [] if c.get("type") == "PodScheduled"), {})
        said = f"PodScheduled {cond.get('status')} {cond.get('reason')}: {str(cond.get('message'))[:200]}"
        name = pod["metadata"]["name"]
        with contextlib.suppress(Exception):
            events = [e for e in self.system.kube.events(TEST_NS)
                      if (e.get("involvedObject") or {}).get("name") == name]
            if events:
                last = max(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
                said += f"; last event {last.get('reason')} x{last.get('count')}: {str(last.get('message'))[:300]}"
        return said

    # ----- the end

    def _settle_and_audit(self) -> None:
        """The workload frozen (the Jobs deleted, the Deployments left at their last size), every bound
        pod Running and stamped, then one audit."""
        kube = self.system.kube
        for i in range(1, self.jobs + 1):
            with contextlib.suppress(Exception):  # finished and collected already
                kube._json(self.batch.delete_namespaced_job(f"batch-{i:03d}", TEST_NS, propagation_policy="Background",
                                                            grace_period_seconds=0, _preload_content=False))
        with contextlib.suppress(AssertionError):  # the audit says what is left
            wait("the Jobs' pods gone", lambda: not [p for p in kube.pods() if (p["metadata"].get("labels") or {})
                                                     .get("job-name")], 90, interval=1.0)
        # kubelet frees a deleted pod's devices when it has seen the deletion: give every kubelet time to
        # catch up before counting ids it still gives to pods that are gone.
        with contextlib.suppress(AssertionError):
            wait("every kubelet to let the deleted pods go", lambda: self.system.audit().leaked == 0, 90, interval=3.0)
        counts = self.system.settle_and_audit(timeout=120)
        self.result.counts = counts_dict(counts)
        self.result.problems = list(counts.problems)

