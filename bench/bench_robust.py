"""Robustness bench (issue 12): the default policy vs ``fgd`` vs every baseline, in one run.

    .venv/bin/python bench/bench_robust.py                       # everything, seeds 42-51
    .venv/bin/python bench/bench_robust.py --part openb --traces default,cpux25 --seeds 42-43
    .venv/bin/python bench/bench_robust.py --part fake --fc-seeds 1-5 --seeds 42-44
    .venv/bin/python bench/bench_robust.py --json out.json       # every per-seed figure as well

Workloads:

* ``openb``: the six shared traces (``../shared/data/openb``) and the generated variants of
  ``bench/robust_workloads.py`` (each generated afresh from the default trace with the run's seed),
  inflated to 1.3 x capacity, replayed through the protocol (narrowed filter, as
  ``gpu-slice simulate``). Figure: unallocated GPU % at 100 % arrived workload.
* ``fake``: ``gpu-slice fake-cluster`` clusters (30 nodes x 8 H100, ``--pods-per-node 8``) in
  ``mig``, ``mixed`` and ``mps`` mode for each ``--fc-seeds`` seed; the generated pods are the
  shapes. ``arr``: arrivals only, inflated to 1.3 x capacity, unallocated slice % at 100 % arrival.
  ``dep``: departures too: pods drawn from the shapes arrive as a Poisson stream and live an
  exponential time, the offered load 1.2 x capacity at steady state, a pod that fits nowhere is
  dropped; figure: the time-averaged unallocated slice % over the last two thirds of the run
  (the saturated part). Same event list for every policy.

A seed whose replay has no arrival step within half a point of 100 % (one large pod can jump
over it) has no figure at 100 %; the means leave it out and the verdict names it.

Every figure is "lower is better". ``default`` is the policy mix a fresh install runs
(``gpuslice.config.DEFAULT_POLICIES``): on the openb traces it scores as ``fragmentation`` alone
(no prices, no DCGM samples), on the fake clusters its ``cost`` part sees their node prices. The
verdict lines compare it with ``fgd`` and with the best baseline, on the means, and list seeds
where the margin is under 0.1.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from robust_workloads import FAKE_MODES, OPENB_VARIANTS, describe, fake_cluster_file

from gpuslice.config import default_policy_spec
from gpuslice.packing.state import ClusterState, PackRequest
from gpuslice.scheduler import PackedCluster, Scheduler
from simulator.cli import NODE_FILE, _published, default_trace_dir, parse_seeds
from simulator.dra import DeviceChoice, attach
from simulator.engine import EngineOptions, replay, simulate
from simulator.inflate import inflate
from simulator.kubefile import inflate_requests, load_kube_cluster
from simulator.metrics import unallocated_at
from simulator.miglayouts import DynamicLayouts
from simulator.openb import MILLI, read_nodes, read_pods

SHARED = ("default", "cpu050", "gpushare40", "gpushare80", "gpuspec20", "multigpu30")
DEFAULT = "default"  # the configured default mix (see ``spec``)
BASELINES = ("fgd", "random", "bestfit", "binpack", "dotprod", "gpupacking", "gpuclustering", "spread", "cost",
             "utilization")
POLICIES = (DEFAULT, *BASELINES)


def spec(policy: str) -> str:
    """The registry spec to run for a policy name of this bench (``default``: the default mix)."""
    return default_policy_spec() if policy == DEFAULT else policy


def departures_replay(state: ClusterState, shapes: Sequence[PackRequest], policy: str, seed: int, *,
                      load: float = 1.2, horizon: float = 3.0, layouts: DynamicLayouts | None = None,
                      capacity: float | None = None, wait: float = 0.0,
                      devices: DeviceChoice | None = None) -> tuple[float, float]:
    """Poisson arrivals of ``shapes`` (drawn with the seed), exponential lifetimes (mean 1), offered
    load ``load`` x capacity; pods that fit nowhere are dropped. Returns (time-averaged unallocated
    slice % over t in [horizon/3, horizon], % of pods dropped).

    ``layouts``: a pod refused everywhere gets the core's MIG re-cut (``bench_mig_layouts.py``); it
    then waits ``wait`` (in lifetimes) before it runs, its slices counted unallocated meanwhile.
    ``capacity``: the slices the load and the figure are of (default: those advertised now).
    ``devices``: who picks the device (``simulate --device-choice``; default: the extender, as today);
    not together with ``layouts`` (DRA's devices are a static layout's instances)."""
    rng = np.random.default_rng([seed, 99])
    total = float(state.total_slices if capacity is None else capacity)
    mean_slices = float(np.mean([r.total_slices for r in shapes]))
    rate = load * total / mean_slices  # arrivals per unit time, mean lifetime 1
    n = int(rate * horizon)
    times = np.cumsum(rng.exponential(1.0 / rate, size=n))
    lives = rng.exponential(1.0, size=n)
    picks = rng.integers(len(shapes), size=n)
    cluster = PackedCluster(state)
    sched = Scheduler(cluster, spec(policy), seed=seed, trace=list(shapes))
    driver = attach(sched, devices, layouts)
    heap: list[tuple[float, int, int, list[int], int, int, int, str]] = []
    start = horizon / 3.0
    area = 0.0
    last = 0.0
    dropped = 0
    counted = 0
    waiting = 0  # slices held by pods that wait for their re-cut (not yet running)
    starts: list[tuple[float, int]] = []

    def advance(t: float) -> None:
        nonlocal area, last
        area += (max(t, start) - max(last, start)) * (state.allocated_slices - waiting)
        last = t

    for i in range(n):
        t = float(times[i])
        while (heap and heap[0][0] <= t) or (starts and starts[0][0] <= t):
            if starts and (not heap or starts[0][0] <= heap[0][0]):
                when, held = heapq.heappop(starts)
                advance(when)
                waiting -= held
                continue
            d = heapq.heappop(heap)
            advance(d[0])
            state.give_back(d[2], d[3], d[4], d[5], d[6], d[7])
            if driver is not None:
                driver.event()
        advance(t)
        req = replace(shapes[int(picks[i])], uid=f"p{i}")
        sched.observe(req)
        if driver is not None:
            driver.observe(req)
        chosen, ranked, _ = sched.filter_request(req, None, float(i), explain_refused=False)
        delay = 0.0
        if layouts is not None:
            layouts.observe(req)
            if chosen.node.shape[0] == 0 and layouts.recut_for(req, t) is not None:
                chosen, ranked, _ = sched.filter_request(req, None, float(i), explain_refused=False)
                delay = wait
        if t > start:
            counted += 1
        if chosen.node.shape[0] == 0:
            dropped += t > start
            continue
        cluster.bind(req.uid)  # the reservation's take stays as the pod's own
        if driver is not None:
            driver.event()
        c = int(chosen.index[0])
        node = int(ranked.cands.node[c])
        units = ranked.cands.units[c].tolist() if req.gpus else []
        if delay > 0 and units:
            waiting += req.slices * len(units)
            heapq.heappush(starts, (t + delay, req.slices * len(units)))
        heapq.heappush(heap, (t + delay + float(lives[i]), i, node, units, req.slices, req.cpu_milli, req.memory_mib,
                              req.owner))
    end = float(times[-1])
    allocated = area / max(end - start, 1e-9) / total
    return 100.0 * (1.0 - allocated), 100.0 * dropped / max(counted, 1)


def run_openb(traces: Sequence[str], seeds: Sequence[int], policies: Sequence[str],
              results: dict[str, dict[str, dict[int, float]]]) -> dict[str, float]:
    base = default_trace_dir()
    nodes = read_nodes(base / NODE_FILE)
    published = _published(base / "published_results.csv")
    default_pods = read_pods(base / "openb_pod_list_default.csv")
    capacity = sum(n.gpus for n in nodes) * MILLI
    for trace in traces:
        shared = trace in SHARED
        pods0 = read_pods(base / f"openb_pod_list_{trace}.csv") if shared else None
        for seed in seeds:
            pods = pods0 if pods0 is not None else OPENB_VARIANTS[trace](default_pods, nodes, seed)
            if not shared and seed == seeds[0]:
                print(f"# {trace} (seed {seed}): {describe(pods)}", flush=True)
            inflated = inflate(pods, capacity, seed)
            line = []
            for policy in policies:
                r = simulate(nodes, inflated, spec(policy), seed, EngineOptions(mode="protocol"), trace=pods)
                v = unallocated_at(r.arrived, r.allocated, 100.0)
                results.setdefault(trace, {}).setdefault(policy, {})[seed] = v
                line.append(f"{policy} {v:.2f} ({r.seconds:.1f}s)")
            print(f"{trace:<11} seed {seed}: " + ", ".join(line), flush=True)
    return {t: published[(t, "fgd")] for t in traces if (t, "fgd") in published}


def run_fake(fc_seeds: Sequence[int], seeds: Sequence[int], policies: Sequence[str], departures: Sequence[bool],
             results: dict[str, dict[str, dict[int, float]]], folder: Path,
             modes: Sequence[str] = FAKE_MODES) -> None:
    for mode in modes:
        for fc in fc_seeds:
            cluster = load_kube_cluster([fake_cluster_file(mode, fc, folder)])
            capacity = cluster.state().total_slices
            for dep in departures:
                name = f"fc-{mode}-s{fc}-{'dep' if dep else 'arr'}"
                line = []
                for seed in seeds:
                    reqs = None if dep else inflate_requests(cluster.requests, capacity, seed, 1.3)
                    for policy in policies:
                        if dep:
                            v, _ = departures_replay(cluster.state(), cluster.requests, policy, seed)
                        else:
                            assert reqs is not None
                            r = replay(cluster.state(), reqs, cluster.requests, spec(policy), seed,
                                       EngineOptions(mode="protocol", slices=cluster.slices_per_gpu))
                            v = unallocated_at(r.arrived, r.allocated, 100.0)
                        results.setdefault(name, {}).setdefault(policy, {})[seed] = v
                    line.append(f"{seed}: {results[name][DEFAULT][seed]:.2f}")
                print(f"{name}: default " + ", ".join(line), flush=True)


def _mean(d: dict[int, float]) -> float:
    vals = [v for v in d.values() if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def report(results: dict[str, dict[str, dict[int, float]]], published: dict[str, float],
           policies: Sequence[str]) -> list[str]:
    """Tables and verdicts; returns the workloads where a bar is missed."""
    missed: list[str] = []
    short = {"gpuclustering": "gpuclust", "utilization": "util", "gpupacking": "gpupack"}
    head = f"{'workload':<22}" + "".join(f"{short.get(p, p):>9}" for p in policies) + f"{'pub FGD':>9}"
    print("\nmeans (lower is better); default = " + default_policy_spec())
    print(head)
    for name, res in results.items():
        means = {p: _mean(res[p]) for p in policies if p in res}
        pub = published.get(name)
        print(f"{name:<22}" + "".join(f"{means.get(p, math.nan):9.2f}" for p in policies)
              + (f"{pub:9.2f}" if pub is not None else f"{'-':>9}"))
    print("\nverdicts (default vs fgd, vs best baseline; seeds with margin < 0.1 listed)")
    for name, res in results.items():
        if DEFAULT not in res:
            continue
        ours = res[DEFAULT]
        m = _mean(ours)
        if math.isnan(m):
            print(f"{name:<22} no figure: no seed's replay had an arrival step at 100 %")
            continue
        others = {p: _mean(res[p]) for p in policies if p != DEFAULT and p in res}
        best = min(others, key=lambda p: others[p]) if others else ""
        worse = [p for p, v in others.items() if m > v + 1e-9]
        pub = published.get(name)
        bad = bool(worse) or (pub is not None and not m < pub)
        if bad:
            missed.append(name)
        parts = [f"default {m:.2f}"]
        if "fgd" in others:
            parts.append(f"fgd {others['fgd']:.2f} ({m - others['fgd']:+.2f})")
        if best:
            parts.append(f"best baseline {best} {others[best]:.2f} ({m - others[best]:+.2f})")
        if pub is not None:
            parts.append(f"published FGD {pub:.2f} ({m - pub:+.2f})")
        status = "MISSED (worse than " + ", ".join(worse) + ")" if worse else ("MISSED (not below published)"
                                                                               if bad else "met")
        print(f"{name:<22} {status}: " + "; ".join(parts))
        close = []
        for s, v in sorted(ours.items()):
            rivals = {p: res[p][s] for p in ("fgd", best) if p and p in res and s in res[p]}
            if pub is not None:
                rivals["pub"] = pub
            tight = {p: v - w for p, w in rivals.items() if abs(v - w) < 0.1}
            if tight:
                close.append(f"{s}: {v:.2f} (" + ", ".join(f"{p} {d:+.2f}" for p, d in tight.items()) + ")")
        if close:
            print(f"{'':<22}   margin < 0.1: " + "; ".join(close))
        gaps = [str(s) for s, v in sorted(ours.items()) if math.isnan(v)]
        if gaps:  # the arrived share depends on the workload only, so every policy lacks the same seeds
            print(f"{'':<22}   means leave out seeds " + ", ".join(gaps) + " (no arrival step at 100 %)")
    return missed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["openb", "fake", "all"], default="all")
    ap.add_argument("--traces", default=",".join((*SHARED, *OPENB_VARIANTS)))
    ap.add_argument("--seeds", type=parse_seeds, default=parse_seeds("42-51"))
    ap.add_argument("--fc-seeds", type=parse_seeds, default=parse_seeds("1-5"))
    ap.add_argument("--modes", default="arr,dep", help="fake clusters: arr (arrivals only), dep (departures)")
    ap.add_argument("--fake-modes", dest="fake_modes", default=",".join(FAKE_MODES),
                    help="fake clusters: which GPU modes (default mig,mixed,mps; a rule of MPS GPUs alone moves "
                         "nothing on mig clusters)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    results: dict[str, dict[str, dict[int, float]]] = {}
    published: dict[str, float] = {}
    started = time.perf_counter()
    if args.part in ("openb", "all"):
        base = default_trace_dir()
        if not (base / NODE_FILE).is_file():
            print(f"openb data not found under {base} (set GPU_SLICE_OPENB_DIR)", file=sys.stderr)
            return 2
        published = run_openb([t for t in args.traces.split(",") if t], args.seeds, policies, results)
    if args.part in ("fake", "all"):
        import tempfile

        deps = [m == "dep" for m in args.modes.split(",") if m]
        with tempfile.TemporaryDirectory(prefix="fc-") as folder:
            fake_modes = [m for m in args.fake_modes.split(",") if m]
            unknown = sorted(set(fake_modes) - set(FAKE_MODES))
            if unknown:
                print(f"--fake-modes: unknown mode(s) {', '.join(unknown)}; known: {', '.join(FAKE_MODES)}",
                      file=sys.stderr)
                return 2
            run_fake(args.fc_seeds, args.seeds, policies, deps, results, Path(folder), fake_modes)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    missed = report(results, published, policies)
    print(f"\nbars missed on {len(missed)} of {len(results)} workloads" + (": " + ", ".join(missed) if missed else ""))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "published": published}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
