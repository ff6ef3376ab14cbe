"""Device plugin latency under kubelet's own device manager (``kubelet-dm`` from ``../shared/k8s``).

The companion of ``bench_deviceplugin.py`` (which drives the kubelet stand-in): here the real kubelet
code is the gRPC client. One etcd + kube-apiserver and one ``kubelet-dm`` node on loopback; the
plugin runs in this process (``DevicePluginApp``, simulated backend, built-in node of one MIG and one
MPS H100). Measured:

* Allocate and GetPreferredAllocation as the plugin's handlers see them (the same timer that feeds
  its RPC-latency histogram), for pods admitted by kubelet-dm: bare pods with an extender assignment,
  created, bound, admitted (Running) and deleted in rounds;
* admission, from the Binding's creation until the pod is Running (API round trips and kubelet-dm's
  one-at-a-time admission included: context, not a plugin figure);
* re-registration after a kubelet restart: from the moment ``kubelet-dm`` is ready again until
  kubelet lists every id healthy (PodResources GetAllocatableResources); and after a dropped
  ListAndWatch stream, from the drop until the plugin has registered again and kubelet lists every
  id healthy.

    .venv/bin/python bench/bench_deviceplugin_kubelet_dm.py [--rounds 20] [--restarts 5]

Bars (DESIGN 7): Allocate p99 under 10 ms; re-registered within 5 s of a kubelet restart.
Prints figures only; skips (exit 0 with a message) when ``../shared/k8s`` is absent.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.kubelet import test_kubelet_dm as kdm  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def line(name: str, seconds: list[float], bar: str) -> str:
    ms = [v * 1000 for v in seconds]
    return (f"{name:30s} n={len(ms)} p50={percentile(ms, 50):.3f} ms p90={percentile(ms, 90):.3f} ms "
            f"p99={percentile(ms, 99):.3f} ms max={max(ms):.3f} ms{bar}")


async def bench(args: argparse.Namespace, cluster: kdm.Cluster) -> None:
    api = kdm.Api(cluster.kubeconfig)
    work = Path(tempfile.mkdtemp(prefix="gkb-"))
    env = kdm.Env(cluster, api, work)
    timings: dict[str, list[float]] = {"Allocate": [], "GetPreferredAllocation": []}
    try:
        async def start() -> kdm.Plugin:
            plugin = await env.start()
            observe = plugin.app.metrics.observe_rpc

            def timed(method: str, seconds: float) -> None:
                timings.setdefault(method, []).append(seconds)
                observe(method, seconds)

            plugin.app.metrics.observe_rpc = timed  # type: ignore[method-assign]
            return plugin

        # the servicer calls this metrics object's observe_rpc: the hook sees every handler's own timer
        plugin = await start()
        plugin_app = plugin.app
        admit: list[float] = []
        mps = kdm.MPS
        mig = kdm.MIG
        ids = mps.slice_ids()
        n = 0
        for r in range(args.rounds):
            names: list[str] = []
            bound: dict[str, float] = {}
            # the whole node, one pod per MPS slice and one per MIG instance, every round
            specs: list[tuple[tuple[str, ...], str, str | None]] = [((i,), mps.uuid, None) for i in ids]
            specs += [(inst.slice_ids(), mig.uuid, inst.uuid) for inst in mig.instances]
            for k, (sids, gpu, inst) in enumerate(specs):
                name = f"b{r}-{k}"
                n += 1
                at = f"2026-01-01T{n // 3600 % 24:02d}:{n // 60 % 60:02d}:{n % 60:02d}Z"
                await kdm.assigned_pod(env, name, sids, gpu, inst, at)
                bound[name] = time.monotonic()
                names.append(name)
            for name in names:
                await env.running(name)
                admit.append(time.monotonic() - bound[name])
            await asyncio.to_thread(api.delete_all)
            await kdm.until(lambda: not api.core.list_namespaced_pod("default").items, what="pods gone")
        warm = min(len(specs), len(timings["Allocate"]) // 10)
        print(f"pods admitted: {len(admit)} in {args.rounds} rounds (first {warm} Allocates dropped as warm-up)")
        bar = " (bar: p99 < 10 ms)"
        print(line("Allocate (kubelet-dm)", timings["Allocate"][warm:], bar))
        if timings.get("GetPreferredAllocation"):
            print(line("GetPreferredAllocation", timings["GetPreferredAllocation"][warm:], ""))
        print(line("admission (bind -> Running)", admit, " (context: API + kubelet-dm, not a bar)"))

        restart: list[float] = []
        assert plugin_app.registrar is not None
        for _ in range(args.restarts):
            await asyncio.to_thread(cluster.stop_node)
            ready = await asyncio.to_thread(cluster.start_node)
            await env.healthy(14, timeout=30)
            restart.append(time.monotonic() - ready)
            await asyncio.sleep(0.3)
        print(f"re-registration after a kubelet-dm restart: n={len(restart)} mean={statistics.mean(restart):.3f} s "
              f"max={max(restart):.3f} s (bar: < 5 s)")

        dropped: list[float] = []
        servicer = plugin_app.servicer
        assert servicer is not None
        registrar = plugin_app.registrar
        for _ in range(args.restarts):
            before = registrar.registrations
            t0 = time.monotonic()
            servicer.end_streams()
            await kdm.until(lambda b=before: registrar.registrations > b, what="a new Register")
            await env.healthy(14, timeout=30)
            dropped.append(time.monotonic() - t0)
            await asyncio.sleep(0.3)
        print(f"re-registration after a dropped stream: n={len(dropped)} mean={statistics.mean(dropped):.3f} s "
              f"max={max(dropped):.3f} s (drop -> new Register -> every id healthy)")
    finally:
        await env.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--restarts", type=int, default=5)
    args = parser.parse_args()
    if not kdm.CLUSTER.exists():
        print(f"skipped: kubelet-dm is not here ({kdm.K8S} is absent)")
        return
    logging.basicConfig(level=logging.ERROR)
    with kdm.running_cluster() as cluster:
        asyncio.run(bench(args, cluster))


if __name__ == "__main__":
    main()
