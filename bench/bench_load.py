"""Benchmark: the whole system under sustained load (issue 50), on the e2e harness. Prints figures; asserts nothing.

Starts :class:`e2e.harness.System` with ``--nodes`` (20) kubelet-dm nodes, each with its own
``gpu-slice device-plugin --backend simulated``, in four mixed layouts (two MIG H100s; two MPS A100s; a
whole-mode H100 beside an MPS A100; a MIG H100 beside an MPS H100), the shipped manifests, a real
Prometheus and two extender + kube-scheduler replicas fenced on one Lease, with kube-controller-manager
allowed more API calls than its defaults (``--kube-api-qps=100 --kube-api-burst=200``: the Deployment,
Job and garbage-collection controllers carry the churn). Then runs one compressed day of
:mod:`e2e.load.scenario` (``--minutes``, default 5.5): ten Deployments scaled to a diurnal curve with
bursts and rolled out, Jobs whose pods complete and are replaced, preemptions at the peak, and two faults
(the leading extender and its kube-scheduler killed at a third of the day, one node's kubelet-dm
restarted at two thirds).

Printed: pods created, bound and deleted; pods/s; p50/p99 from creation to bind and to Running; the
extenders' CPU per pod bound and RSS over time (growth from the end of the first minute to the end:
bar < 10 %); pods Pending past 30 s that the extender's own filter says fit (bar 0); admission failures
and every DESIGN 8 audit count (bar 0); the faults and their recovery. ``--json FILE`` writes it all.
Run from the repository as root (two fenced replicas): ``.venv/bin/python bench/bench_load.py``
(about 8 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from e2e.harness import System, skip_reason  # noqa: E402
from e2e.load.scenario import FULL_SERVERS, Load, LoadSpec, scaled  # noqa: E402

#: Four layouts of two GPUs (14 slices each, as the harness expects), cycled over the nodes.
LAYOUTS: tuple[list[dict[str, Any]], ...] = (
    [{"product": "H100-80GB", "mode": "mig", "instances": [
        {"profile": "3g.40gb", "start": 4}, {"profile": "2g.20gb", "start": 0},
        {"profile": "1g.10gb", "start": 2}, {"profile": "1g.10gb", "start": 3}]},
     {"product": "H100-80GB", "mode": "mig", "instances": [
         {"profile": "4g.40gb", "start": 0}, {"profile": "2g.20gb", "start": 4},
         {"profile": "1g.10gb", "start": 6}]}],
    [{"product": "A100-80GB", "mode": "mps"}, {"product": "A100-80GB", "mode": "mps"}],
    [{"product": "H100-80GB", "mode": "whole"}, {"product": "A100-80GB", "mode": "mps"}],
    [{"product": "H100-80GB", "mode": "mig", "instances": [
        {"profile": "1g.10gb", "start": 0}, {"profile": "1g.10gb", "start": 1}, {"profile": "1g.10gb", "start": 2},
        {"profile": "1g.10gb", "start": 3}, {"profile": "3g.40gb", "start": 4}]},
     {"product": "H100-80GB", "mode": "mps"}],
)


def topologies(count: int) -> dict[str, dict[str, Any]]:
    return {f"load-{i:02d}": {"version": 1, "node": f"load-{i:02d}", "gpus": LAYOUTS[i % len(LAYOUTS)]}
            for i in range(count)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--minutes", type=float, default=5.5, help="length of the day (default 5.5)")
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--json", help="write the figures (and the run's problems) to this file")
    parser.add_argument("--keep-logs", metavar="DIR", help="copy every process's log here before stopping")
    args = parser.parse_args(argv)
    reason = skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    print(f"bench_load: {os.cpu_count()} CPUs, {args.nodes} kubelet-dm nodes, a {args.minutes} minute day; "
          f"load {os.getloadavg()}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="gsl-"))
    system = System(work, topologies=topologies(args.nodes),
                    controller_flags=["--kube-api-qps=100", "--kube-api-burst=200"])
    try:
        t0 = time.monotonic()
        system.start()
        print(f"started in {time.monotonic() - t0:.0f} s: {len(system.nodes)} nodes, {len(system.replicas)} "
              f"replicas (fencing {'on' if system.fencing else 'off'}); load {os.getloadavg()}", flush=True)
        spec = LoadSpec(duration_s=60.0 * args.minutes, servers=scaled(FULL_SERVERS, args.nodes),
                        faults=not args.no_faults)
        res = Load(system, spec).run()
        summary = res.summary()
        print(json.dumps(summary, indent=1), flush=True)
        rss_ok = [e.get("growth_pct") for e in summary["rss"].values() if "growth_pct" in e]
        print(f"bars: audit all 0: {not any(res.counts.values())}; admission failures 0: "
              f"{not res.admission_failures}; stuck Pending 0: {not res.stuck}; RSS growth < 10 %: "
              f"{bool(rss_ok) and all(g < 10.0 for g in rss_ok)} ({rss_ok}); pods >= 2,000: "
              f"{summary['pods_created'] >= 2000}; minutes >= 5: {summary['duration_s'] >= 300}", flush=True)
        for what, items in (("stuck", list(res.stuck.items())), ("admission failures", res.admission_failures),
                            ("audit problems", res.problems), ("errors", res.errors)):
            if items:
                print(f"{what}: {items[:20]}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({**summary, "stuck": res.stuck, "admission": res.admission_failures,
                                                   "problems": res.problems, "errors": res.errors}, indent=1))
    finally:
        if args.keep_logs:
            keep = Path(args.keep_logs)
            keep.mkdir(parents=True, exist_ok=True)
            for log in [*work.glob("*.log"), *work.glob("logs/*.log")]:
                shutil.copy(log, keep / log.name)
        system.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
