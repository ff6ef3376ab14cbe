"""Benchmark: what one ``gpu-slice status`` (and one slice-map refresh) costs on a large cluster.

Builds a ``gpu-slice fake-cluster`` (mixed MIG/MPS/whole H100 nodes, a few pods per node), adds
Pending pods that fit nowhere as they are (7-slice MIG pods: re-cut suggestions; MPS pods bigger than
any free share, at a higher priority than the running pods: eviction searches), then times
``gpuslice.status.build_status`` over the same ClusterView and Scheduler the extender keeps: with
suggestions for every Pending pod (the CLI) and with the slice map's bounds (suggestions for the first
20, 20 nodes per eviction search: how long one refresh holds the extender's lock). Prints the figures;
``--nodes``, ``--pending``, ``--repeat``. Run from the repository:
``.venv/bin/python bench/bench_status.py [--nodes 1000] [--pending 100]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuslice.fakecluster import FakeClusterSpec, generate
from gpuslice.scheduler import Scheduler
from gpuslice.status import build_status
from gpuslice.view import ClusterView

NOW = 1_735_689_600.0  # the fake cluster's 2025-01-01T00:00:00Z


def pending(n: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        mig = i % 2 == 0
        notes = {"example.com/gpu-isolation": "mig" if mig else "mps"}
        spec: dict[str, Any] = {"schedulerName": "gpu-slice-scheduler", "priority": 1000, "containers": [
            {"name": "server", "resources": {"requests": {"cpu": "4", "memory": "16Gi"},
                                             "limits": {"example.com/gpu-slice": "7" if mig else "6"}}}]}
        out.append({"kind": "Pod", "metadata": {"name": f"pending-{i}", "namespace": "bench", "uid": f"pending-{i}",
                                                "annotations": notes, "creationTimestamp": "2025-01-01T00:00:00Z"},
                    "spec": spec, "status": {"phase": "Pending"}})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--pending", type=int, default=100)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--pods-per-node", type=int, default=60, help="fake-cluster pods per node (60: nodes full)")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() once the view is built, as the extender does after each relist, so full "
                        "collections do not walk the view (they otherwise show as the longest steps)")
    args = p.parse_args()
    fake = generate(FakeClusterSpec(nodes=args.nodes, mode="mixed", pods_per_node=args.pods_per_node, seed=1))
    items = [*fake.document["items"], *pending(args.pending)]
    t0 = time.perf_counter()
    view = ClusterView.from_objects(items, NOW)
    sched = Scheduler.from_config(view)
    built = time.perf_counter() - t0
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    print(f"{args.nodes} nodes x 8 GPUs, {len(view.pods)} pods ({args.pending} Pending); view built in {built:.2f} s")
    from extender.slicemap import EVICTION_NODES, MAX_SUGGESTIONS

    for label, limit, nodes in (("every Pending pod (gpu-slice status)", None, None),
                                (f"the first {MAX_SUGGESTIONS}, {EVICTION_NODES} nodes each (slice map refresh)",
                                 MAX_SUGGESTIONS, EVICTION_NODES)):
        times: list[float] = []
        holds: list[float] = []  # each step's time under the hold (the extender's lock in a live build)

        class Hold:
            def __init__(self, sink: list[float] = holds) -> None:
                self.sink = sink

            def __enter__(self) -> None:
                self.t0 = time.perf_counter()

            def __exit__(self, *exc: object) -> None:
                self.sink.append(time.perf_counter() - self.t0)

        for _ in range(args.repeat):
            t0 = time.perf_counter()
            st = build_status(view, sched, NOW, max_suggestions=limit, eviction_nodes=nodes, hold=Hold)
            times.append(time.perf_counter() - t0)
        kinds: dict[str, int] = {}
        for pod in st.pending:
            for s in pod.suggestions[:1]:
                kinds[s.kind] = kinds.get(s.kind, 0) + 1
        print(f"  suggestions for {label}: median {statistics.median(times):.2f} s, min {min(times):.2f} s "
              f"over {args.repeat}; first suggestion kinds {dict(sorted(kinds.items()))}; "
              f"stranded {st.capacity.stranded} of {st.capacity.free} free slices")
        holds.sort()
        print(f"    one step under the hold: p50 {1e3 * holds[len(holds) // 2]:.2f} ms, "
              f"p99 {1e3 * holds[int(len(holds) * 0.99)]:.1f} ms, longest {1e3 * holds[-1]:.1f} ms "
              f"({len(holds) // args.repeat} steps a build)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
