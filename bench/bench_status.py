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
    args = p.parse_args()
    fake = generate(FakeClusterSpec(nodes=args.nodes, mode="mixed", pods_per_node=args.pods_per_node, seed=1))
    items = [*fake.document["items"], *pending(args.pending)]
    t0 = time.perf_counter()
    view = ClusterView.from_objects(items, NOW)
    sched = Scheduler.from_config(view)
    built = time.perf_counter() - t0
    print(f"{args.nodes} nodes x 8 GPUs, {len(view.pods)} pods ({args.pending} Pending); view built in {built:.2f} s")
    from extender.slicemap import EVICTION_NODES, MAX_SUGGESTIONS

    for label, limit, nodes in (("every Pending pod (gpu-slice status)", None, None),
                                (f"the first {MAX_SUGGESTIONS}, {EVICTION_NODES} nodes each (slice map refresh)",
                                 MAX_SUGGESTIONS, EVICTION_NODES)):
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            st = build_status(view, sched, NOW, max_suggestions=limit, eviction_nodes=nodes)
            times.append(time.perf_counter() - t0)
        kinds: dict[str, int] = {}
        for pod in st.pending:
            for s in pod.suggestions[:1]:
                kinds[s.kind] = kinds.get(s.kind, 0) + 1
        print(f"  suggestions for {label}: median {statistics.median(times):.2f} s, min {min(times):.2f} s "
              f"over {args.repeat}; first suggestion kinds {dict(sorted(kinds.items()))}; "
              f"stranded {st.capacity.stranded} of {st.capacity.free} free slices")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
