"""Benchmark: the decision API (``gpuslice.scheduler.Scheduler`` over ``gpuslice.view.ClusterView``).

Prints figures for the issue 7 bars; it asserts nothing about time. Per cluster mode (``mps``,
``mixed``), on a ``gpu-slice fake-cluster`` of N nodes x 8 H100s with K running pods per node:

1. building the view (``ClusterView.from_objects``): seconds and resident memory (VmRSS grown by
   the build, and the process peak VmHWM);
2. one decision = ``Scheduler.filter`` (narrowed filter, with a reason for every refused node) +
   ``Scheduler.prioritize``, both over ALL node names, for ~200 pods of mixed shapes (1/2/3/7
   slices, memory floors, ``mig`` isolation, 14-slice multi-GPU, owner references, pods that fit
   nowhere): p50/p99/max ms at N nodes and at 1,000 nodes. Between decisions the bind is applied as
   the extender does it (``bind_check``, the assignment annotation and ``spec.nodeName`` written
   back, ``view.upsert_pod``) so the cluster fills up. Bar: p99 < 20 ms at 5,000 nodes. Also timed:
   filter + prioritize over only the nodes filter passed, which is what kube-scheduler really sends
   (with the narrowed filter: one node, and no /prioritize at all when filter passed none), so that
   row is the protocol's real per-pod cost; prioritize over all nodes is its worst case.
   ``prioritize`` reuses the ranking its pod's filter made when nothing changed in between (one
   snapshot per pod cycle, as kube-scheduler's own CycleState); the row "prioritize, all nodes,
   cold" times it again with that ranking dropped, which is what it costs after any change;
3. one watch event applied to the view at N nodes: pod add / update (assignment, then the allocated
   stamp) / delete, node updates (heartbeat, GPU cordon, allocatable change), node remove and add.
   Bar: < 1 ms per event (judged on p99).

Each (mode, pods-per-node) runs in a child process of this script, so memory figures do not see
earlier runs. The fake cluster comes from ``gpuslice.fakecluster.generate`` (what ``gpu-slice
fake-cluster`` writes), in process; ``--via-cli`` writes it with the command into a temporary
directory and reads it back with ``gpuslice.kubelist.parse_list_text`` instead (slower).

Run from the repository: ``.venv/bin/python bench/bench_decisions.py`` (default: 5,000 and 1,000
nodes, mps and mixed, 3 pods per node, 200 decision pods; a few minutes on 2 cores), or ``--quick``
(300 and 100 nodes, 40 pods; seconds). ``--profile`` writes the top of a cProfile of the decision
and event loops of each child.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuslice import annotations as ann
from gpuslice.fakecluster import FakeClusterSpec, generate
from gpuslice.kubelist import parse_list_text
from gpuslice.requests import ISOLATION_KEY, MEMORY_KEY, RESOURCE
from gpuslice.scheduler import NARROWED_OUT, Scheduler
from gpuslice.view import ClusterView

DECISION_BAR_MS = 20.0
EVENT_BAR_MS = 1.0
NOW = "2025-01-01T00:00:00+00:00"
SCHEDULER_NAME = "gpu-slice-scheduler"

Json = dict[str, Any]


# ----------------------------------------------------------------------------- measuring helpers

def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` figure in KiB (0 where there is no /proc)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    if field == "VmHWM":
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux
    return 0


def _pct(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


@dataclass(frozen=True, slots=True)
class Cost:
    """One timed call: wall-clock ms (``perf_counter``) and this thread's CPU ms (``thread_time``, which
    leaves out time the OS gave to other processes: on a busy machine the wall tail is theirs)."""

    wall: float
    cpu: float

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.wall + other.wall, self.cpu + other.cpu)


def _summary(xs: Sequence[Cost]) -> Json:
    if not xs:
        nan = float("nan")
        return {"n": 0, "p50": nan, "p99": nan, "max": nan, "cpu_p50": nan, "cpu_p99": nan}
    wall = [x.wall for x in xs]
    cpu = [x.cpu for x in xs]
    return {"n": len(xs), "p50": statistics.median(wall), "p99": _pct(wall, 99), "max": max(wall),
            "cpu_p50": statistics.median(cpu), "cpu_p99": _pct(cpu, 99)}


class _GcLog:
    """Collector pauses (per generation) while ``on``: attributes latency spikes to the GC."""

    def __init__(self) -> None:
        self.on = False
        self.pauses: list[tuple[int, float]] = []
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: Mapping[str, Any]) -> None:
        if not self.on:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((int(info["generation"]), (time.perf_counter() - self._t0) * 1000.0))

    def take(self) -> Json:
        """Counts, total and longest pause (ms) per generation since the last take."""
        out: Json = {}
        for g in (0, 1, 2):
            ms = [d for gen, d in self.pauses if gen == g]
            out[str(g)] = {"n": len(ms), "total": sum(ms), "max": max(ms, default=0.0)}
        self.pauses = []
        return out


GC = _GcLog()


def _timed(fn: Callable[[], Any]) -> tuple[Any, Cost]:
    c0 = time.thread_time()
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    c1 = time.thread_time()
    return out, Cost((t1 - t0) * 1000.0, (c1 - c0) * 1000.0)


# ----------------------------------------------------------------------------- inputs

def _cluster_items(nodes: int, mode: str, pods_per_node: int, seed: int, via_cli: bool,
                   tmp: Path) -> list[Mapping[str, Any]]:
    if not via_cli:
        spec = FakeClusterSpec(nodes=nodes, mode=mode, pods_per_node=pods_per_node, seed=seed)  # type: ignore[arg-type]
        return list(generate(spec).document["items"])
    out = tmp / f"fc-{mode}-{nodes}-{pods_per_node}.yaml"
    exe = Path(sys.executable).with_name("gpu-slice")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "gpuslice_cli"]
    subprocess.run([*cmd, "fake-cluster", "--nodes", str(nodes), "--mode", mode, "--pods-per-node",
                    str(pods_per_node), "--seed", str(seed), "-o", str(out)], check=True)
    return parse_list_text(out.read_text(encoding="utf-8"))


def _subset(items: Sequence[Mapping[str, Any]], nodes: int) -> list[Mapping[str, Any]]:
    """The first ``nodes`` Nodes and the Pods bound to them."""
    keep = [i for i in items if i.get("kind") == "Node"][:nodes]
    names = {i["metadata"]["name"] for i in keep}
    return keep + [i for i in items if i.get("kind") == "Pod" and i.get("spec", {}).get("nodeName") in names]


# Decision pod shapes: (label, slices, memory floor, isolation, owned, weight). "nowhere" shapes
# fit no node of these clusters, so filter gives every node a reason.
SHAPES: list[tuple[str, int, str | None, str | None, bool, int]] = [
    ("1 slice", 1, None, None, False, 14),
    ("1 slice, owner", 1, None, None, True, 14),
    ("2 slices", 2, None, None, False, 8),
    ("2 slices, 20Gi, owner", 2, "20Gi", None, True, 8),
    ("3 slices", 3, None, None, False, 6),
    ("3 slices, 30Gi", 3, "30Gi", None, False, 5),
    ("7 slices, owner", 7, None, None, True, 6),
    ("1 slice, mig", 1, None, "mig", False, 6),
    ("2 slices, mig, 15Gi", 2, "15Gi", "mig", True, 5),
    ("3 slices, mig", 3, None, "mig", False, 4),
    ("14 slices (2 GPUs)", 14, None, None, True, 6),
    ("nowhere: 1 slice, 500Gi", 1, "500Gi", None, False, 9),
    ("nowhere: 7 slices, mps, 100Gi", 7, "100Gi", "mps", True, 9),
]


def _decision_pod(i: int, shape: tuple[str, int, str | None, str | None, bool, int], tag: str) -> Json:
    _, slices, memory, isolation, owned, _ = shape
    annotations: dict[str, str] = {}
    if memory:
        annotations[MEMORY_KEY] = memory
    if isolation:
        annotations[ISOLATION_KEY] = isolation
    meta: Json = {"name": f"bench-{tag}-{i}", "namespace": "bench", "uid": f"bench-{tag}-{i:05d}",
                  "creationTimestamp": NOW, "annotations": annotations, "labels": {"app": "bench"}}
    if owned:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": f"bench-{slices}s",
                                    "uid": f"bench-owner-{slices}", "controller": True}]
    count = str(slices)
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "spec": {"schedulerName": SCHEDULER_NAME, "containers": [{
            "name": "server", "image": "vllm/vllm-openai:v0.6.4",
            "resources": {"requests": {RESOURCE: count, "cpu": "2", "memory": "16Gi"},
                          "limits": {RESOURCE: count, "memory": "16Gi"}}}]},
        "status": {"phase": "Pending"},
    }


def _decision_pods(n: int, seed: int, tag: str) -> list[tuple[str, Json]]:
    rng = random.Random(seed)
    weights = [s[5] for s in SHAPES]
    out = []
    for i in range(n):
        shape = rng.choices(SHAPES, weights)[0]
        out.append((shape[0], _decision_pod(i, shape, tag)))
    return out


# ----------------------------------------------------------------------------- the three measurements

def _build(items: Sequence[Mapping[str, Any]], now: float) -> tuple[ClusterView, Json]:
    gc.collect()
    rss0 = _status_kib("VmRSS")
    view, cost = _timed(lambda: ClusterView.from_objects(items, now))
    gc.collect()
    rss1 = _status_kib("VmRSS")
    return view, {"seconds": cost.wall / 1000, "rss_grown_mib": (rss1 - rss0) / 1024, "rss_mib": rss1 / 1024,
                  "hwm_mib": _status_kib("VmHWM") / 1024, "nodes": view.state.n_nodes,
                  "units": view.state.n_units, "pods": len(view.pods)}


def _decisions(view: ClusterView, pods: list[tuple[str, Json]], now: float, warmup: int) -> Json:
    sched = Scheduler.from_config(view)
    names = list(view.nodes)
    # Warm-up: a few decisions whose reservations are dropped again (caches, first-call costs).
    for _, pod in _decision_pods(warmup, 99, "warm"):
        res = sched.filter(pod, names, now)
        sched.prioritize(pod, names, now)
        sched.prioritize(pod, list(res.feasible), now)
        view.release(pod["metadata"]["uid"])
    ms: dict[str, list[Cost]] = {k: [] for k in ("decision", "filter", "prioritize", "fits", "nowhere",
                                                  "prioritize_cold", "prioritize_feasible", "protocol", "bind")}
    by_shape: dict[str, Json] = {}
    bound = errors = bind_refused = explained = 0
    t = now
    GC.take()
    GC.on = True
    for label, pod in pods:
        t += 0.05
        res, fm = _timed(lambda: sched.filter(pod, names, t))  # noqa: B023
        _, pm = _timed(lambda: sched.prioritize(pod, names, t))  # noqa: B023
        ms["filter"].append(fm)
        ms["prioritize"].append(pm)
        sched.forget_cycle()  # the same prioritize with nothing kept from the filter: its cold cost
        ms["prioritize_cold"].append(_timed(lambda: sched.prioritize(pod, names, t))[1])  # noqa: B023
        ms["decision"].append(fm + pm)
        ms["fits" if res.feasible else "nowhere"].append(fm + pm)
        why = len(res.unresolvable) + sum(1 for r in res.failed.values() if r != NARROWED_OUT)
        explained += why
        s = by_shape.setdefault(label, {"n": 0, "bound": 0, "ms": [], "reasons": 0})
        s["n"] += 1
        s["ms"].append((fm + pm).wall)
        s["reasons"] += why
        if res.error or not res.feasible:
            # kube-scheduler sends no /prioritize when filter passed no node: the protocol's cost is filter's.
            ms["protocol"].append(fm)
        if res.error:
            errors += 1
            s.setdefault("error", res.error)
            continue
        if not res.feasible:
            continue
        # What kube-scheduler really sends to /prioritize: the nodes filter let through (one, narrowed).
        pf = _timed(lambda: sched.prioritize(pod, list(res.feasible), t))[1]  # noqa: B023
        ms["prioritize_feasible"].append(pf)
        ms["protocol"].append(fm + pf)
        node = res.feasible[0]
        plan, bm = _timed(lambda: sched.bind_check(pod, node, t))  # noqa: B023
        if plan.assignment is None:
            s.setdefault("refusal", plan.refusal)
            bind_refused += 1
            continue
        written = copy.deepcopy(pod)
        written["metadata"]["annotations"][ann.ASSIGNMENT_KEY] = ann.encode_assignment(plan.assignment)
        written["spec"]["nodeName"] = node
        _, um = _timed(lambda: view.upsert_pod(written, t))  # noqa: B023
        ms["bind"].append(bm + um)
        bound += 1
        s["bound"] += 1
    GC.on = False
    return {"nodes": len(names), "pods": len(pods), "bound": bound, "errors": errors, "bind_refused": bind_refused,
            "gc": GC.take(), "explained_per_decision": explained / max(1, len(pods)),
            **{k: _summary(v) for k, v in ms.items()},
            "shapes": {k: {"n": v["n"], "bound": v["bound"], "p99": _pct(v["ms"], 99),
                           "reasons": v["reasons"] // max(1, v["n"]),
                           **({"error": v["error"]} if "error" in v else {}),
                           **({"refusal": v["refusal"]} if "refusal" in v else {})} for k, v in by_shape.items()}}


def _events(view: ClusterView, items: Sequence[Mapping[str, Any]], mode: str, n: int, now: float,
            seed: int) -> Json:
    """Each kind of event ``n`` times on distinct random nodes/pods; the cluster ends as it began
    (every change is undone by the next event of the cycle)."""
    rng = random.Random(seed)
    nodes = {i["metadata"]["name"]: i for i in items if i.get("kind") == "Node"}
    running = [i for i in items if i.get("kind") == "Pod"]
    ms: dict[str, list[Cost]] = {k: [] for k in (
        "pod add (pending)", "pod update (assignment+node)", "pod update (allocated stamp)", "pod delete",
        "node update (heartbeat only)", "node update (cordon a GPU)", "node update (uncordon)",
        "node update (allocatable)", "node remove", "node add (rejoin, with its pods)", "node add (new)")}
    t = now

    def rec(kind: str, fn: Callable[[], Any]) -> None:
        ms[kind].append(_timed(fn)[1])

    # Warm-up on a node and pods that are not measured: every kind of event once (first-call costs).
    warm = sorted(nodes)[-1]
    nodes_w = dict(nodes)
    del nodes[warm]
    running = [p for p in running if p["spec"]["nodeName"] != warm]
    wnode = nodes_w[warm]
    wgpus = ann.decode_inventory(wnode["metadata"]["annotations"][ann.INVENTORY_KEY])
    wcord = copy.deepcopy(wnode)
    wcord["metadata"]["annotations"][ann.CORDON_KEY] = ann.encode_cordon([wgpus[0].uuid])
    for obj in (wcord, wnode):
        view.upsert_node(obj)
    view.remove_node(warm)
    view.upsert_node(wnode)
    for pod in running[-20:]:
        view.upsert_pod(pod, t)
    GC.take()
    GC.on = True
    # Pods: delete a running pod, add it back Pending, bind it (assignment + nodeName), stamp it.
    for pod in rng.sample(running, min(n, len(running))):
        t += 0.01
        uid = pod["metadata"]["uid"]
        pending: Json = copy.deepcopy(dict(pod))
        meta, spec = pending["metadata"], pending["spec"]
        stamps = meta["annotations"]
        allocated = stamps.pop(ann.ALLOCATED_KEY)
        assignment = stamps.pop(ann.ASSIGNMENT_KEY)
        node = spec.pop("nodeName")
        pending["status"] = {"phase": "Pending"}
        bound = copy.deepcopy(pending)
        bound["metadata"]["annotations"][ann.ASSIGNMENT_KEY] = assignment
        bound["spec"]["nodeName"] = node
        bound["metadata"]["resourceVersion"] = "2"
        stamped = copy.deepcopy(bound)
        stamped["metadata"]["annotations"][ann.ALLOCATED_KEY] = allocated
        stamped["status"] = pod["status"]
        stamped["metadata"]["resourceVersion"] = "3"
        rec("pod delete", lambda: view.remove_pod(uid))  # noqa: B023
        rec("pod add (pending)", lambda: view.upsert_pod(pending, t))  # noqa: B023
        rec("pod update (assignment+node)", lambda: view.upsert_pod(bound, t))  # noqa: B023
        rec("pod update (allocated stamp)", lambda: view.upsert_pod(stamped, t))  # noqa: B023
    # Nodes: heartbeat, cordon/uncordon one GPU, allocatable change and back.
    for name in rng.sample(sorted(nodes), min(n, len(nodes))):
        node = nodes[name]
        beat = copy.deepcopy(node)
        beat["metadata"]["resourceVersion"] = "2"
        beat["status"]["conditions"][0]["lastHeartbeatTime"] = "2025-01-01T00:00:10Z"
        rec("node update (heartbeat only)", lambda: view.upsert_node(beat))  # noqa: B023
        gpus = ann.decode_inventory(node["metadata"]["annotations"][ann.INVENTORY_KEY])
        cordoned = copy.deepcopy(beat)
        cordoned["metadata"]["annotations"][ann.CORDON_KEY] = ann.encode_cordon([rng.choice(gpus).uuid])
        rec("node update (cordon a GPU)", lambda: view.upsert_node(cordoned))  # noqa: B023
        rec("node update (uncordon)", lambda: view.upsert_node(beat))  # noqa: B023
        alloc = copy.deepcopy(beat)
        alloc["status"]["allocatable"]["cpu"] = "90"
        alloc["status"]["allocatable"]["memory"] = "1000Gi"
        rec("node update (allocatable)", lambda: view.upsert_node(alloc))  # noqa: B023
        view.upsert_node(node)
    # Node remove and rejoin (its pods are counted again), fewer: each retires unit rows.
    for name in rng.sample(sorted(nodes), min(n // 2, len(nodes))):
        rec("node remove", lambda: view.remove_node(name))  # noqa: B023
        rec("node add (rejoin, with its pods)", lambda: view.upsert_node(nodes[name]))  # noqa: B023
    # Brand-new nodes (another prefix, same mode).
    extra = [i for i in generate(FakeClusterSpec(nodes=max(1, n // 2), mode=mode, seed=seed + 1,  # type: ignore[arg-type]
                                                 node_prefix="extra-node")).document["items"]
             if i.get("kind") == "Node"]
    for node in extra:
        rec("node add (new)", lambda: view.upsert_node(node))  # noqa: B023
    GC.on = False
    for node in extra:
        view.remove_node(node["metadata"]["name"])
    return {"kinds": {k: _summary(v) for k, v in ms.items()}, "gc": GC.take()}


# ----------------------------------------------------------------------------- one child run

def _child(args: argparse.Namespace) -> int:
    mode, ppn = args.child.split(":")
    ppn_i = int(ppn)
    from datetime import datetime

    now = datetime.fromisoformat(NOW).timestamp()
    out: Json = {"mode": mode, "pods_per_node": ppn_i, "sizes": {}}
    sizes = sorted(args.nodes, reverse=True)
    with tempfile.TemporaryDirectory(prefix="bench-decisions-") as tmp:
        items, gen_ms = _timed(lambda: _cluster_items(sizes[0], mode, ppn_i, args.seed, args.via_cli, Path(tmp)))
    out["generate_s"] = gen_ms.wall / 1000
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    for i, n in enumerate(sizes):
        sub = items if n == sizes[0] else _subset(items, n)
        view, build = _build(sub, now)
        if args.gc_freeze:
            gc.freeze()
        r: Json = {"build": build}
        print(f"  [{mode} k={ppn_i} n={n}] built in {build['seconds']:.1f} s", file=sys.stderr, flush=True)
        pods = _decision_pods(args.pods, args.seed + n, f"{mode}{n}")
        if prof is not None:
            prof.enable()
        r["decisions"] = _decisions(view, pods, now + 1, args.warmup)
        if prof is not None:
            prof.disable()
        print(f"  [{mode} k={ppn_i} n={n}] decisions done", file=sys.stderr, flush=True)
        if i == 0 and args.events:
            if prof is not None:
                prof.enable()
            r["events"] = _events(view, sub, mode, args.events, now + 100, args.seed)
            if prof is not None:
                prof.disable()
            print(f"  [{mode} k={ppn_i} n={n}] events done", file=sys.stderr, flush=True)
        out["sizes"][str(n)] = r
        del view
        gc.unfreeze()
        gc.collect()
    if prof is not None:
        import io
        import pstats

        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        text = buf.getvalue().replace(str(Path(__file__).resolve().parents[1]) + os.sep, "")
        for prefix in {sys.base_prefix, sys.prefix, sys.exec_prefix}:
            text = text.replace(prefix + os.sep, "<python>" + os.sep)
        out["profile"] = "\n".join(line for line in text.splitlines() if line.strip())
    print(json.dumps(out))
    return 0


# ----------------------------------------------------------------------------- report

def _fmt(x: float) -> str:
    return f"{x:7.2f}" if x < 1000 else f"{x:7.0f}"


def _verdict(s: Json, bar: float) -> str:
    if s["p99"] < bar:
        return "  MEETS"
    return "  MISSES" if s["cpu_p99"] >= bar else "  MISSES on wall time only (CPU p99 meets)"


def _gc_line(g: Json) -> str:
    return "GC pauses in these: " + ", ".join(
        f"gen{k} {v['n']}x/{v['total']:.0f} ms (max {v['max']:.1f})" for k, v in g.items())


def _report(runs: list[Json], args: argparse.Namespace) -> None:
    for run in runs:
        mode, k = run["mode"], run["pods_per_node"]
        print(f"\n== mode {mode}, 8 x H100 per node, {k} running pods per node "
              f"(cluster generated in {run['generate_s']:.1f} s) ==")
        print(f"  {'view build':<34} {'nodes':>6} {'units':>7} {'pods':>7} {'seconds':>8} {'RSS grown':>10} "
              f"{'VmHWM':>8}")
        for i, (n, r) in enumerate(run["sizes"].items()):
            b = r["build"]
            # Only the first build starts from a fresh heap; later ones reuse memory freed before them.
            grown = f"{b['rss_grown_mib']:>7.0f} MiB" if i == 0 else f"{'-':>11}"
            print(f"  {'ClusterView.from_objects':<34} {n:>6} {b['units']:>7} {b['pods']:>7} {b['seconds']:>8.2f} "
                  f"{grown} {b['hwm_mib']:>5.0f} MiB")
        print(f"  {'decision, ms (* = not in the bar)':<34} {'nodes':>6} {'p50':>7} {'p99':>7} {'max':>7} "
              f"{'cpu p99':>7} {'n':>5}  bar p99 < {DECISION_BAR_MS:g} ms at 5000 nodes")
        for n, r in run["sizes"].items():
            d = r["decisions"]
            for part, name in (("decision", "filter+prioritize"), ("filter", "  filter (with reasons)"),
                               ("prioritize", "  prioritize (all nodes)"), ("fits", "  pods that fit somewhere"),
                               ("nowhere", "  pods refused on every node"),
                               ("prioritize_cold", "prioritize, all nodes, cold*"),
                               ("prioritize_feasible", "prioritize, filter's nodes only*"),
                               ("protocol", "filter+prioritize(filter's nodes)"),
                               ("bind", "bind_check + upsert_pod*")):
                s = d[part]
                verdict = _verdict(s, DECISION_BAR_MS) if part in ("decision", "protocol") and n == "5000" else ""
                print(f"  {name:<34} {n:>6} {_fmt(s['p50'])} {_fmt(s['p99'])} {_fmt(s['max'])} {_fmt(s['cpu_p99'])} "
                      f"{s['n']:>5}{verdict}")
            print(f"  {'':<34} {'':>6} {d['pods']} pods: {d['bound']} bound, {d['bind_refused']} bind refusals, "
                  f"{d['errors']} refused as written; {d['explained_per_decision']:.0f} nodes/decision given a "
                  "refusal reason")
            print(f"  {'':<34} {'':>6} {_gc_line(d['gc'])}")
        if args.shapes:
            for n, r in run["sizes"].items():
                print(f"  per pod shape at {n} nodes: n, bound, p99 ms, reasons/decision")
                for label, s in r["decisions"]["shapes"].items():
                    extra = f"  ({s.get('error') or s.get('refusal', '')})" if ("error" in s or "refusal" in s) else ""
                    print(f"    {label:<32} {s['n']:>4} {s['bound']:>4} {s['p99']:>8.2f} {s['reasons']:>6}{extra}")
        for n, r in run["sizes"].items():
            if "events" not in r:
                continue
            print(f"  {'event applied to the view, ms':<34} {'nodes':>6} {'p50':>7} {'p99':>7} {'max':>7} "
                  f"{'cpu p99':>7} {'n':>5}  bar p99 < {EVENT_BAR_MS:g} ms")
            for kind, s in r["events"]["kinds"].items():
                print(f"  {kind:<34} {n:>6} {_fmt(s['p50'])} {_fmt(s['p99'])} {_fmt(s['max'])} {_fmt(s['cpu_p99'])} "
                      f"{s['n']:>5}{_verdict(s, EVENT_BAR_MS)}")
            print(f"  {'':<34} {'':>6} {_gc_line(r['events']['gc'])}")
        if "profile" in run:
            print("  cProfile of the decision and event loops (top by own time):")
            for line in run["profile"].splitlines()[:40]:
                print("    " + line)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default=None, help="comma-separated node counts (default 5000,1000; quick 300,100); "
                                                  "the largest is generated, smaller ones are its first nodes")
    p.add_argument("--modes", default="mps,mixed", help="comma-separated fake-cluster modes (default mps,mixed)")
    p.add_argument("--pods-per-node", default="3", help="comma-separated running pods per node (default 3)")
    p.add_argument("--pods", type=int, default=None, help="decision pods per run (default 200; quick 40)")
    p.add_argument("--events", type=int, default=None,
                   help="events of each pod/node-update kind at the largest size (default 300; quick 40; 0 = none)")
    p.add_argument("--warmup", type=int, default=10, help="warm-up decisions before timing (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a small fast run (300 and 100 nodes, 40 pods, 40 events)")
    p.add_argument("--shapes", action="store_true", help="also print per pod shape: bound count, p99, reasons")
    p.add_argument("--profile", action="store_true", help="cProfile the decision and event loops of each run")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() after each build (what an extender could do after its first list)")
    p.add_argument("--via-cli", action="store_true",
                   help="generate with `gpu-slice fake-cluster -o` into a temp dir and parse the YAML")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.nodes = [int(x) for x in (args.nodes or ("300,100" if args.quick else "5000,1000")).split(",")]
    args.pods = args.pods if args.pods is not None else (40 if args.quick else 200)
    args.events = args.events if args.events is not None else (40 if args.quick else 300)
    if args.child:
        return _child(args)
    started = time.perf_counter()
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    runs: list[Json] = []
    for k in args.pods_per_node.split(","):
        for mode in args.modes.split(","):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", f"{mode}:{k}",
                   "--nodes", ",".join(map(str, args.nodes)), "--pods", str(args.pods), "--events",
                   str(args.events), "--warmup", str(args.warmup), "--seed", str(args.seed)]
            cmd += ["--profile"] * args.profile + ["--via-cli"] * args.via_cli + ["--gc-freeze"] * args.gc_freeze
            print(f"run: mode={mode} pods/node={k} nodes={args.nodes}", file=sys.stderr, flush=True)
            res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
            if res.returncode != 0:
                print(f"bench_decisions: the run mode={mode} pods/node={k} failed (exit {res.returncode}); "
                      "its error is above", file=sys.stderr)
                return 1
            runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(f"bench_decisions: modes {args.modes}, nodes {','.join(map(str, args.nodes))}, pods/node "
          f"{args.pods_per_node}, {args.pods} decision pods, {args.events} events per kind, seed {args.seed}, "
          f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    _report(runs, args)
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\ntotal {time.perf_counter() - started:.0f} s; 1-min load average {load0:.1f} at start, {load1:.1f} at "
          "the end (other work on the machine inflates the tails)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
