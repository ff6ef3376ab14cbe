"""Seconds per seed of one openb replay (default: fragmentation, protocol mode, default trace).

    .venv/bin/python bench/bench_openb.py [--trace default] [--policy fragmentation] [--mode protocol]
                                          [--seeds 42-44]

Prints, per seed, the wall-clock seconds of the replay (reading and inflating the trace excluded,
building the state and all scheduling included) and the figures of the run. Bar: under 15 s per
seed on a 2-core machine for the default trace (about 10,800 pods, 1,213 nodes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulator.cli import NODE_FILE, default_trace_dir, parse_seeds
from simulator.engine import MODES, EngineOptions, simulate
from simulator.inflate import inflate
from simulator.openb import MILLI, read_nodes, read_pods
from simulator.report import Summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="default")
    ap.add_argument("--policy", default="fragmentation")
    ap.add_argument("--mode", default="protocol", choices=MODES)
    ap.add_argument("--seeds", type=parse_seeds, default=parse_seeds("42"))
    ap.add_argument("--slices", type=int, default=MILLI)
    args = ap.parse_args()
    base = default_trace_dir()
    if not (base / NODE_FILE).is_file():
        print(f"openb data not found under {base} (set GPU_SLICE_OPENB_DIR)", file=sys.stderr)
        return 2
    nodes = read_nodes(base / NODE_FILE)
    pods = read_pods(base / f"openb_pod_list_{args.trace}.csv")
    capacity = sum(n.gpus for n in nodes) * MILLI
    times = []
    for seed in args.seeds:
        inflated = inflate(pods, capacity, seed)
        r = simulate(nodes, inflated, args.policy, seed, EngineOptions(mode=args.mode, slices=args.slices),
                     trace=pods)
        s = Summary.of(args.trace, r)
        times.append(r.seconds)
        print(f"seed {seed}: {r.seconds:.2f} s for {s.pods} pods on {len(nodes)} nodes "
              f"({s.pods / r.seconds:.0f} pods/s); unallocated@100 {s.unallocated_gpu_pct_at_100:.2f}% "
              f"@130 {s.unallocated_gpu_pct_at_130:.2f}% first failure {s.first_failure_arrived_pct:.0f}% "
              f"placed {s.pods_placed}", flush=True)
    print(f"{args.trace} {args.policy} {args.mode}: mean {sum(times) / len(times):.2f} s per seed, "
          f"max {max(times):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
