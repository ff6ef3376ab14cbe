"""Our figures next to the FGD artifact's published means, per trace and policy, plus per-seed pairs.

Usage (from the repository root):

    .venv/bin/python bench/compare_published.py                     # everything below, seeds 42-51
    .venv/bin/python bench/compare_published.py --part paper        # random, bestfit, fgd in paper mode
    .venv/bin/python bench/compare_published.py --part protocol     # fragmentation vs fgd, protocol mode
    .venv/bin/python bench/compare_published.py --traces default --seeds 42-44 --json out.json

The traces are read from ``$GPU_SLICE_OPENB_DIR`` or ``../shared/data/openb``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulator.cli import NODE_FILE, _published, default_trace_dir, parse_seeds
from simulator.engine import EngineOptions, simulate
from simulator.inflate import inflate
from simulator.metrics import unallocated_at
from simulator.openb import MILLI, read_nodes, read_pods

TRACES = ("default", "cpu050", "gpushare40", "gpushare80", "gpuspec20", "multigpu30")
PAPER = ("random", "bestfit", "fgd")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["paper", "protocol", "all"], default="all")
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--seeds", type=parse_seeds, default=parse_seeds("42-51"))
    ap.add_argument("--policy", default="fragmentation", help="our policy for the protocol part")
    ap.add_argument("--baseline", default="fgd", help="baseline for the protocol part")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    base = default_trace_dir()
    if not (base / NODE_FILE).is_file():
        print(f"openb data not found under {base} (set GPU_SLICE_OPENB_DIR)", file=sys.stderr)
        return 2
    nodes = read_nodes(base / NODE_FILE)
    published = _published(base / "published_results.csv")
    capacity = sum(n.gpus for n in nodes) * MILLI
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    jobs: list[tuple[str, str]] = []
    if args.part in ("paper", "all"):
        jobs += [(p, "paper") for p in PAPER]
    if args.part in ("protocol", "all"):
        jobs += [(args.policy, "protocol"), (args.baseline, "protocol")]
    started = time.perf_counter()
    for trace in args.traces.split(","):
        pods = read_pods(base / f"openb_pod_list_{trace}.csv")
        res = results.setdefault(trace, {})
        for seed in args.seeds:
            inflated = inflate(pods, capacity, seed)
            for policy, mode in jobs:
                r = simulate(nodes, inflated, policy, seed, EngineOptions(mode=mode), trace=pods)
                v = unallocated_at(r.arrived, r.allocated, 100.0)
                res.setdefault(f"{policy}/{mode}", []).append(v)
                res.setdefault(f"{policy}/{mode}/seconds", []).append(r.seconds)
                print(f"{trace:<11} seed {seed} {policy:<14} {mode:<8} {v:6.2f}  ({r.seconds:.1f}s)", flush=True)
    print(f"\ntotal {time.perf_counter() - started:.0f}s\n")
    print(f"{'trace':<11} {'policy':<14} {'mode':<8} {'ours':>6} {'sd':>5} {'published':>9} {'diff':>6}")
    for trace, res in results.items():
        for policy, mode in jobs:
            vals = res[f"{policy}/{mode}"]
            mean = sum(vals) / len(vals)
            sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / max(len(vals) - 1, 1))
            pub = published.get((trace, policy if policy != args.policy else "fgd"))
            label = "FGD pub" if policy == args.policy else ""
            diff = f"{mean - pub:+6.2f}" if pub is not None else ""
            pub_t = f"{pub:9.2f}" if pub is not None else ""
            print(f"{trace:<11} {policy:<14} {mode:<8} {mean:6.2f} {sd:5.2f} {pub_t} {diff} {label}")
    if args.part in ("protocol", "all"):
        print(f"\nper-seed pairs, protocol mode: {args.policy} vs {args.baseline} (unallocated % at 100 % arrival)")
        for trace, res in results.items():
            ours = res[f"{args.policy}/protocol"]
            theirs = res[f"{args.baseline}/protocol"]
            pairs = " ".join(f"{s}:{a:.2f}/{b:.2f}" for s, a, b in zip(args.seeds, ours, theirs, strict=True))
            wins = sum(a < b for a, b in zip(ours, theirs, strict=True))
            pub = published.get((trace, "fgd"))
            m_ours, m_theirs = sum(ours) / len(ours), sum(theirs) / len(theirs)
            print(f"{trace:<11} wins {wins}/{len(ours)}  mean {m_ours:.2f} vs {m_theirs:.2f}"
                  f" (published FGD {pub})\n    {pairs}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
