"""Static vs dynamic MIG layouts, side by side (issue 51), with the default policy mix.

    .venv/bin/python bench/bench_mig_layouts.py                       # everything: fake clusters and the day
    .venv/bin/python bench/bench_mig_layouts.py --part fake --modes mig --fc-seeds 1 --seeds 42-43
    .venv/bin/python bench/bench_mig_layouts.py --part day --seeds 42-51
    .venv/bin/python bench/bench_mig_layouts.py --json out.json       # every per-seed figure as well

Fake clusters (``bench/robust_workloads.py``: 30 nodes x 8 H100, ``--pods-per-node 8``, modes ``mig``
and ``mixed``), arrivals only (``arr``: inflated to 1.3 x capacity, unallocated % at 100 % arrival) and
with departures (``dep``: ``bench_robust.departures_replay``, offered load 1.2 x capacity, mean lifetime
one hour, the time-averaged unallocated % over its last two thirds). Per cell and seed:

* ``static``: the figure ``bench/bench_robust.py`` prints (capacity = the slices the static layouts
  advertise), unchanged by this work;
* ``static-phys`` and ``dynamic``: the same replay with capacity = every compute slice of the MIG GPUs
  (7 per H100; a static layout of 1g.20gb instances leaves some unadvertised), the one denominator on
  which the two can be compared; ``dynamic`` re-cuts free MIG slots for pods refused for shape
  (:mod:`gpuslice.miglayout`), and with departures a re-cut pod waits ``RECUT_WAIT_S`` (10 s, in
  lifetimes of an hour) before it runs, its slices counted unallocated meanwhile;
* ``cpu-floor`` (``arr`` only): the unallocated % at 100 % arrival if every arriving pod were placed,
  in arrival order, until the cluster's CPU runs out, whatever its GPU shape (every fake-cluster pod
  asks 4 cores of a node's 96). A scheduler that places every pod it can cannot go much below it; a
  replay lands slightly below where pods dropped for their GPU shape left CPU to later, larger ones.

The day (``simulate`` with no arguments): the default mix with static layouts and with the H100 and
A100 MIG layouts dynamic; Pending pods, pods that waited for a re-cut, GPUs in use, $/hour, pod-hours
run. Every replay counts instances destroyed while held or reserved (``busy``): the state refuses such
a re-cut, and the count is printed, not assumed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_robust import departures_replay
from robust_workloads import fake_cluster_file

from gpuslice.config import default_policy_spec
from gpuslice.packing.state import PackRequest
from simulator.cli import parse_seeds
from simulator.engine import EngineOptions, replay
from simulator.kubefile import KubeCluster, inflate_requests, load_kube_cluster
from simulator.metrics import unallocated_at
from simulator.miglayouts import RECUT_WAIT_S, DynamicLayouts, physical_slices

POLICY = default_policy_spec()
DYNAMIC = frozenset({"H100-80GB", "A100-80GB"})
LIFETIME_S = 3600.0  # the departures replay's mean lifetime, in seconds, to scale the re-cut wait


def cpu_floor(cluster: KubeCluster, reqs: Sequence[PackRequest], capacity: int) -> float:
    """Unallocated % at 100 % arrival if pods were placed in arrival order while the cluster's CPU
    (and host memory) lasts, GPU shape ignored (see the module docstring: a level, not a strict bound)."""
    cpu = sum(spec.cpu_milli for spec, _ in cluster.nodes)
    mem = sum(spec.memory_mib for spec, _ in cluster.nodes)
    slices = np.cumsum([r.total_slices for r in reqs])
    fits = (np.cumsum([r.cpu_milli for r in reqs]) <= cpu) & (np.cumsum([r.memory_mib for r in reqs]) <= mem)
    at100 = int(np.searchsorted(slices, capacity))
    last = min(at100, int(fits.sum()) - 1)
    return 100.0 * (1.0 - float(slices[last]) / capacity) if last >= 0 else 100.0


def fake_cell(mode: str, fc: int, dep: bool, seeds: Sequence[int], folder: Path) -> dict[int, dict[str, float]]:
    cluster = load_kube_cluster([fake_cluster_file(mode, fc, folder)])
    inv = {spec.name: inv for spec, inv in cluster.nodes}
    advertised = cluster.state().total_slices
    phys = physical_slices(inv.values(), DYNAMIC)
    out: dict[int, dict[str, float]] = {}
    for seed in seeds:
        row: dict[str, float] = {}
        st = cluster.state()
        wait = RECUT_WAIT_S / LIFETIME_S if dep else 0.0
        dyn = DynamicLayouts.build(st, inv, DYNAMIC, memory_tolerance=cluster.memory_tolerance, wait_s=wait)
        started = time.perf_counter()
        if dep:
            row["static"], _ = departures_replay(cluster.state(), cluster.requests, "default", seed)
            row["static-phys"], row["dropped-static"] = departures_replay(cluster.state(), cluster.requests,
                                                                          "default", seed, capacity=phys)
            row["dynamic"], row["dropped-dynamic"] = departures_replay(st, cluster.requests, "default", seed,
                                                                       capacity=phys, layouts=dyn, wait=wait)
        else:
            opts = EngineOptions(mode="protocol", slices=cluster.slices_per_gpu)
            adv = inflate_requests(cluster.requests, advertised, seed, 1.3)
            r = replay(cluster.state(), adv, cluster.requests, POLICY, seed, opts)
            row["static"] = unallocated_at(r.arrived, r.allocated, 100.0)
            reqs = inflate_requests(cluster.requests, phys, seed, 1.3)
            r = replay(cluster.state(), reqs, cluster.requests, POLICY, seed, opts, capacity=phys)
            row["static-phys"] = unallocated_at(r.arrived, r.allocated, 100.0)
            r = replay(st, reqs, cluster.requests, POLICY, seed, opts, layouts=dyn, capacity=phys)
            row["dynamic"] = unallocated_at(r.arrived, r.allocated, 100.0)
            row["cpu-floor"] = cpu_floor(cluster, reqs, phys)
        row.update({k: float(v) for k, v in dyn.summary().items()})
        row["seconds"] = time.perf_counter() - started
        out[seed] = row
    return out


def _mean(rows: dict[int, dict[str, float]], key: str) -> float:
    vals = [r[key] for r in rows.values() if key in r and not math.isnan(r[key])]
    return sum(vals) / len(vals) if vals else math.nan


def run_fake(modes: Sequence[str], fc_seeds: Sequence[int], kinds: Sequence[str], seeds: Sequence[int],
             results: dict[str, dict[int, dict[str, float]]]) -> list[str]:
    missed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="fc-") as folder:
        for mode in modes:
            for fc in fc_seeds:
                for kind in kinds:
                    name = f"fc-{mode}-s{fc}-{kind}"
                    rows = fake_cell(mode, fc, kind == "dep", seeds, Path(folder))
                    results[name] = rows
                    s, sp, d = _mean(rows, "static"), _mean(rows, "static-phys"), _mean(rows, "dynamic")
                    floor = _mean(rows, "cpu-floor")
                    busy = sum(int(r["busy_instances_destroyed"]) for r in rows.values())
                    recuts = sum(int(r["recuts"]) for r in rows.values())
                    if mode == "mig":
                        ok = d <= sp * 2.0 / 3.0
                        bar = f"a third less: {'met' if ok else 'MISSED'} ({100 * (1 - d / sp):.1f} % less)"
                    else:
                        ok = sp - d >= 3.0
                        bar = f"3 points less: {'met' if ok else 'MISSED'} ({sp - d:.2f} points)"
                    if not ok:
                        missed.append(name)
                    extra = f", cpu-floor {floor:.2f}" if not math.isnan(floor) else ""
                    print(f"{name:<18} static {s:6.2f}  static-phys {sp:6.2f}  dynamic {d:6.2f}{extra}  "
                          f"re-cuts {recuts}, busy destroyed {busy}; {bar}", flush=True)
    return missed


def run_day(seeds: Sequence[int], results: dict[str, dict[int, dict[str, float]]]) -> list[str]:
    from simulator import builtin

    keys = ("pods_pending", "pods_recut", "pods_never_placed", "gpus_in_use_avg", "cost_per_hour",
            "running_pod_hours", "pending_pod_hours", "recut_wait_pod_hours", "recuts", "busy_instances_destroyed")
    for label, dyn in (("day-static", frozenset()), ("day-dynamic", DYNAMIC)):
        started = time.perf_counter()
        rs = builtin.run_all([builtin.DEFAULT_POLICY], seeds, mig_dynamic=dyn)
        results[label] = {r.seed: {k: float(getattr(r, k)) for k in keys} for r in rs}
        print(f"{label}: {time.perf_counter() - started:.0f} s", flush=True)
    st, dy = results["day-static"], results["day-dynamic"]
    print(f"\n{'day (means)':<14}" + "".join(f"{k:>22}" for k in keys))
    for label, rows in (("static", st), ("dynamic", dy)):
        print(f"{label:<14}" + "".join(f"{_mean(rows, k):>22.3f}" for k in keys))
    missed = []
    if not _mean(dy, "pods_pending") < _mean(st, "pods_pending"):
        missed.append("day pending")
    if _mean(dy, "gpus_in_use_avg") > _mean(st, "gpus_in_use_avg"):
        missed.append("day GPUs in use")
    if _mean(dy, "cost_per_hour") > _mean(st, "cost_per_hour"):
        missed.append("day $/hour")
    per_run = _mean(dy, "gpus_in_use_avg") * 24 / _mean(dy, "running_pod_hours")
    per_run_st = _mean(st, "gpus_in_use_avg") * 24 / _mean(st, "running_pod_hours")
    print(f"GPU-hours per pod-hour run: static {per_run_st:.4f}, dynamic {per_run:.4f}")
    print("day bars: " + ("met" if not missed else "MISSED: " + ", ".join(missed)))
    return missed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["fake", "day", "all"], default="all")
    ap.add_argument("--modes", default="mig,mixed")
    ap.add_argument("--fc-seeds", type=parse_seeds, default=parse_seeds("1-5"))
    ap.add_argument("--kinds", default="arr,dep", help="arr (arrivals only), dep (departures)")
    ap.add_argument("--seeds", type=parse_seeds, default=parse_seeds("42-51"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results: dict[str, dict[int, dict[str, float]]] = {}
    missed: list[str] = []
    started = time.perf_counter()
    if args.part in ("fake", "all"):
        missed += run_fake([m for m in args.modes.split(",") if m], args.fc_seeds,
                           [k for k in args.kinds.split(",") if k], args.seeds, results)
    if args.part in ("day", "all"):
        missed += run_day(args.seeds, results)
    busy = sum(int(r.get("busy_instances_destroyed", 0)) for rows in results.values() for r in rows.values())
    print(f"\nrunning or reserved instances destroyed, all replays: {busy}")
    print(f"total {time.perf_counter() - started:.0f} s; bars missed: {', '.join(missed) if missed else 'none'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
