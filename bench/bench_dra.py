"""How much of our packing survives DRA (issue 52): the default policy under six device choices.

    .venv/bin/python bench/bench_dra.py                                   # everything, seeds 42-51
    .venv/bin/python bench/bench_dra.py --part openb --traces default --seeds 42-43 --json a.json
    .venv/bin/python bench/bench_dra.py --part fake --fc-seeds 1 --seeds 42 --variants free,first-fit
    .venv/bin/python bench/bench_dra.py --report a.json b.json            # tables from saved runs

Device choices (``gpu-slice simulate --device-choice``, :mod:`simulator.dra`):

* ``free``: today; the extender picks node and device;
* ``steered``: DRA picks the first fitting device in the order our policy publishes, republished
  after every placement and departure before the next pod; the extender scores each node by the
  device first fit will give there;
* ``lag1``, ``lag4``, ``lag16``: the same, republished after every 1, 4, 16 events and seen one
  event late (``--republish-every K``): the order in force lags the cluster by 1..K events;
* ``first-fit``: a naive driver's fixed order (device position), the extender still scoring nodes.

Workloads, as the other benches run them (``bench_robust.py``, ``bench_builtin.py``): the six shared
openb traces (inflated to 1.3, the protocol; unallocated GPU % at 100 % arrived), the fake clusters
``mig``/``mixed``/``mps`` (30 nodes x 8 H100, ``--fc-seeds``; ``arr``: arrivals only, unallocated
slice % at 100 %; ``dep``: Poisson arrivals and exponential lifetimes at 1.2 x capacity,
time-averaged unallocated slice %), and the built-in LLM day (Pending pods, GPUs in use, $/hour).
All "lower is better". The policy is the default mix everywhere.

``--json FILE`` is rewritten after every workload, so a long run that stops keeps what it measured;
``--report`` prints the tables from one or more such files.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_robust import SHARED, departures_replay
from robust_workloads import FAKE_MODES, fake_cluster_file

from gpuslice.config import default_policy_spec
from simulator import builtin
from simulator.cli import NODE_FILE, default_trace_dir, parse_seeds
from simulator.dra import DeviceChoice
from simulator.engine import EngineOptions, replay, simulate
from simulator.inflate import inflate
from simulator.kubefile import inflate_requests, load_kube_cluster
from simulator.metrics import unallocated_at
from simulator.openb import MILLI, read_nodes, read_pods

VARIANTS: dict[str, DeviceChoice] = {
    "free": DeviceChoice(),
    "steered": DeviceChoice("steered"),
    "lag1": DeviceChoice("steered", 1),
    "lag4": DeviceChoice("steered", 4),
    "lag16": DeviceChoice("steered", 16),
    "first-fit": DeviceChoice("first-fit"),
}
DAY_FIGURES = (("pending", "pods_pending"), ("GPUs", "gpus_in_use_avg"), ("$/h", "cost_per_hour"))

#: results[workload][variant][seed key] = figure; the day's figure is a dict of DAY_FIGURES.
Results = dict[str, dict[str, dict[str, Any]]]


def through_100(demand: Sequence[int], capacity: int) -> int:
    """How many pods to replay for the figure at 100 %: those tried before the arrived workload
    reaches 100.5 % of capacity (the metric's window is [99.5, 100.5); later pods change nothing
    before them, so the figure is the same and the run about a quarter shorter)."""
    total = 0
    for n, d in enumerate(demand):
        total += d
        if total * 1000 >= capacity * 1005:
            return n
    return len(demand)


def run_openb(traces: Sequence[str], seeds: Sequence[int], variants: Sequence[str], results: Results,
              save: Callable[[], None]) -> None:
    """Seed by seed (every trace for a seed, then the next), so a run cut short has whole seeds."""
    base = default_trace_dir()
    nodes = read_nodes(base / NODE_FILE)
    capacity = sum(n.gpus for n in nodes) * MILLI
    policy = default_policy_spec()
    traces_pods = {trace: read_pods(base / f"openb_pod_list_{trace}.csv") for trace in traces}
    for seed in seeds:
        for trace, pods in traces_pods.items():
            if _done(results, f"openb-{trace}", variants, str(seed)):
                continue
            inflated = inflate(pods, capacity, seed)
            inflated = inflated[: through_100([p.total_milli for p in inflated], capacity)]
            line = []
            for v in variants:
                r = simulate(nodes, inflated, policy, seed, EngineOptions(devices=VARIANTS[v]), trace=pods)
                value = unallocated_at(r.arrived, r.allocated, 100.0)
                results.setdefault(f"openb-{trace}", {}).setdefault(v, {})[str(seed)] = value
                line.append(f"{v} {value:.3f} ({r.seconds:.0f}s)")
            print(f"openb-{trace} seed {seed}: " + ", ".join(line), flush=True)
            save()


def run_fake(fc_seeds: Sequence[int], seeds: Sequence[int], variants: Sequence[str], departures: Sequence[bool],
             results: Results, save: Callable[[], None], folder: Path) -> None:
    """Seed by seed, as :func:`run_openb`."""
    policy = default_policy_spec()
    clusters = {(mode, fc): load_kube_cluster([fake_cluster_file(mode, fc, folder)])
                for mode in FAKE_MODES for fc in fc_seeds}
    for seed in seeds:
        for (mode, fc), cluster in clusters.items():
            capacity = cluster.state().total_slices
            for dep in departures:
                name = f"fc-{mode}-{'dep' if dep else 'arr'}"
                if _done(results, name, variants, f"{fc}/{seed}"):
                    continue
                line = []
                reqs = None if dep else inflate_requests(cluster.requests, capacity, seed, 1.3)
                if reqs is not None:
                    reqs = reqs[: through_100([r.total_slices for r in reqs], capacity)]
                for v in variants:
                    started = time.perf_counter()
                    if dep:
                        value, _ = departures_replay(cluster.state(), cluster.requests, "default", seed,
                                                     devices=VARIANTS[v])
                    else:
                        assert reqs is not None
                        r = replay(cluster.state(), reqs, cluster.requests, policy, seed,
                                   EngineOptions(slices=cluster.slices_per_gpu, devices=VARIANTS[v]))
                        value = unallocated_at(r.arrived, r.allocated, 100.0)
                    results.setdefault(name, {}).setdefault(v, {})[f"{fc}/{seed}"] = value
                    line.append(f"{v} {value:.3f} ({time.perf_counter() - started:.0f}s)")
                print(f"{name} s{fc} seed {seed}: " + ", ".join(line), flush=True)
                save()


def _done(results: Results, name: str, variants: Sequence[str], key: str) -> bool:
    """Whether a resumed run (``--resume``) already has this figure for every variant."""
    return all(key in results.get(name, {}).get(v, {}) for v in variants)


def run_day(seeds: Sequence[int], variants: Sequence[str], results: Results, save: Callable[[], None]) -> None:
    for v in variants:
        started = time.perf_counter()
        for r in builtin.run_all([builtin.DEFAULT_POLICY], seeds, devices=VARIANTS[v]):
            results.setdefault("day", {}).setdefault(v, {})[str(r.seed)] = {
                label: float(getattr(r, attr)) for label, attr in DAY_FIGURES}
        print(f"day {v}: {time.perf_counter() - started:.0f}s", flush=True)
        save()


def _mean(values: Sequence[float]) -> float:
    ok = [x for x in values if not math.isnan(x)]
    return sum(ok) / len(ok) if ok else math.nan


def report(results: Results) -> None:
    """A table per workload kind: means over seeds (and cluster seeds), and how each variant fares
    against ``free`` seed by seed (worse/better: by more than 0.005; the day: by anything)."""
    variants = [v for v in VARIANTS if any(v in res for res in results.values())]
    head = f"{'workload':<24}" + "".join(f"{v:>11}" for v in variants)
    for kind, title in (("openb-", "openb traces: unallocated GPU % at 100 % arrived"),
                        ("fc-", "fake clusters (30 x 8 H100): unallocated slice %, arr at 100 % arrived, "
                                "dep time-averaged")):
        rows = [name for name in results if name.startswith(kind)]
        if not rows:
            continue
        print(f"\n{title} (means; lower is better)\n{head}")
        for name in rows:
            res = results[name]
            print(f"{name.removeprefix('openb-'):<24}" + "".join(
                f"{_mean(list(res[v].values())):>11.3f}" if v in res else f"{'-':>11}" for v in variants))
        print(f"\nthe same, seeds worse/better than free by more than 0.005\n{head}")
        for name in rows:
            print(f"{name.removeprefix('openb-'):<24}" + "".join(f"{_tally(results, [name], v):>11}"
                                                                  for v in variants))
        print(f"{'all':<24}" + "".join(f"{_tally(results, rows, v):>11}" for v in variants))
    if "day" in results:
        day = results["day"]
        print(f"\nbuilt-in LLM day (means over seeds; lower is better; then seeds worse/better than free)\n"
              f"{'variant':<12}{'seeds':>6}" + "".join(f"{label:>10}" for label, _ in DAY_FIGURES)
              + "".join(f"{label + ' w/b':>12}" for label, _ in DAY_FIGURES))
        free = day.get("free", {})
        for v in variants:
            if v not in day:
                continue
            runs = day[v]
            means = "".join(f"{_mean([r[label] for r in runs.values()]):>10.3f}" for label, _ in DAY_FIGURES)
            tallies = ""
            for label, _ in DAY_FIGURES:
                pairs = [(r[label], free[s][label]) for s, r in runs.items() if s in free]
                worse = sum(a > b + 1e-9 for a, b in pairs)
                better = sum(a < b - 1e-9 for a, b in pairs)
                tallies += f"{f'{worse}/{better}':>12}"
            print(f"{v:<12}{len(runs):>6}{means}{tallies}")


def _tally(results: Results, rows: Sequence[str], variant: str) -> str:
    worse = better = 0
    for name in rows:
        free, other = results[name].get("free", {}), results[name].get(variant, {})
        for key, value in other.items():
            base = free.get(key)
            if base is None or math.isnan(value) or math.isnan(base):
                continue
            worse += value > base + 0.005
            better += value < base - 0.005
    return f"{worse}/{better}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["openb", "fake", "day", "all"], default="all")
    ap.add_argument("--traces", default=",".join(SHARED))
    ap.add_argument("--seeds", type=parse_seeds, default=parse_seeds("42-51"))
    ap.add_argument("--fc-seeds", type=parse_seeds, default=parse_seeds("1-5"))
    ap.add_argument("--modes", default="arr,dep", help="fake clusters: arr (arrivals only), dep (departures)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", type=Path, help="write every per-seed figure here (rewritten as the run goes)")
    ap.add_argument("--report", type=Path, nargs="+", help="print the tables of saved runs; run nothing")
    ap.add_argument("--resume", action="store_true",
                    help="with --json: keep the figures already in that file and run only the missing ones")
    args = ap.parse_args()
    results: Results = {}
    if args.resume and args.json and args.json.is_file():
        results = json.loads(args.json.read_text())["results"]
    if args.report:
        for path in args.report:
            for name, per in json.loads(path.read_text())["results"].items():
                for v, figures in per.items():
                    results.setdefault(name, {}).setdefault(v, {}).update(figures)
        report(results)
        return 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps({"variants": {v: VARIANTS[v].label for v in variants},
                                             "results": results}, indent=1) + "\n")

    started = time.perf_counter()
    if args.part in ("openb", "all"):
        if not (default_trace_dir() / NODE_FILE).is_file():
            print(f"openb data not found under {default_trace_dir()} (set GPU_SLICE_OPENB_DIR)", file=sys.stderr)
            return 2
        run_openb([t for t in args.traces.split(",") if t], args.seeds, variants, results, save)
    if args.part in ("fake", "all"):
        with tempfile.TemporaryDirectory(prefix="fc-") as folder:
            run_fake(args.fc_seeds, args.seeds, variants, [m == "dep" for m in args.modes.split(",") if m],
                     results, save, Path(folder))
    if args.part in ("day", "all"):
        run_day(args.seeds, variants, results, save)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    report(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
