"""Benchmark: the built-in LLM-serving day, every policy, seeds 42-51 (DESIGN 7, second bar).

Prints the per-policy table (means over seeds), the bar's verdict (whether the default mix,
``gpuslice.config.DEFAULT_POLICIES``, is strictly better than every baseline on the means; a
development check that ``gpu-slice simulate`` does not print), how many seeds the default mix wins
against each other policy on Pending pods, GPUs in use and $/hour, and the seconds taken. Run from the repository:
``.venv/bin/python bench/bench_builtin.py [--seeds 42-51] [--policy a,b]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulator import builtin
from simulator.llm.cluster import build_cluster


def _seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seeds", default="42-51")
    p.add_argument("--policy", default=None)
    args = p.parse_args()
    seeds = _seeds(args.seeds)
    policies = builtin.policies_from(args.policy)
    started = time.perf_counter()
    results = builtin.run_all(policies, seeds)
    wall = time.perf_counter() - started
    cluster = build_cluster()
    rows = builtin.summarise(results)
    print(builtin.render(rows, cluster=cluster, seeds=seeds))
    verdict = builtin.bar_verdict(rows)
    if verdict:
        print(f"\n{verdict} (means over {len(seeds)} seed(s); a tie is not better)")
    ours = {r.seed: r for r in results if r.policy == builtin.DEFAULT_POLICY}
    if ours:
        print(f"\nseeds where {builtin.DEFAULT_LABEL} is strictly better (pending / GPUs avg / $/h avg):")
        for policy in [p for p in policies if p != builtin.DEFAULT_POLICY]:
            rs = [r for r in results if r.policy == policy]
            wins = [sum(getattr(ours[r.seed], f) < getattr(r, f) for r in rs)
                    for f in ("pods_pending", "gpus_in_use_avg", "cost_per_hour")]
            print(f"  vs {policy:<28} {wins[0]:>2}/{len(rs)}  {wins[1]:>2}/{len(rs)}  {wins[2]:>2}/{len(rs)}")
    per_seed = wall / len(seeds)
    print(f"\n{len(results)} runs, {wall:.1f} s ({per_seed:.1f} s per seed for {len(policies)} policies)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
