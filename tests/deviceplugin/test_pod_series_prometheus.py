"""The per-pod series end to end on one node: the plugin (simulated backend) under the kubelet stand-in
serves them for a MIG pod and an MPS pod, a real Prometheus (Debian's) scrapes them, and the shipped
prometheus-adapter rules' queries and ``gpu-slice status``'s advice queries answer from it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gpuslice.rules import mps_share_mib
from gpuslice_cli.advice import fetch_peaks
from tests import prometheus
from tests.kubelet.standin import slice_pod
from tests.manifests.adapter import metric_name, render, rules

from .test_app import MIG, MPS, NODE, Env, _free_port, env, inst, until  # noqa: F401  (env: the fixture)

GIB = 1024**3
DASHBOARD = Path(__file__).resolve().parents[2] / "manifests/components/monitoring/dashboards/gpu-slice-pods.json"


def dashboard_queries() -> list[str]:
    import json

    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


async def test_per_pod_series_reach_prometheus_and_the_adapter_and_advice_queries_answer(
        env: Env, tmp_path: Path) -> None:  # noqa: F811
    if prometheus.binary() is None:
        pytest.skip(prometheus.SKIP)
    port = _free_port()
    await env.start(metrics_port=port, metrics_address="127.0.0.1", budget_s=0.2)
    uuid, ids = inst(3)  # 3g.40gb
    uid = env.bind("llm-mig", ids, at="2025-01-01T00:00:01Z", gpus=(MIG.uuid,), instance=uuid,
                   annotations={"example.com/simulated-utilization": "60", "example.com/simulated-memory": "5Gi"})
    uid_m = env.bind("llm-mps", MPS.slice_ids()[:2], at="2025-01-01T00:00:02Z", gpus=(MPS.uuid,), instance=None,
                     annotations={"example.com/simulated-utilization": "70", "example.com/simulated-memory": "6Gi"})
    await env.seen("llm-mig", "llm-mps")
    results = await env.kubelet.admit_async([slice_pod("llm-mig", 3, created=1.0, uid=uid),
                                             slice_pod("llm-mps", 2, created=2.0, uid=uid_m)])
    assert all(r.admitted for r in results)
    await until(lambda: env.allocated("llm-mig") is not None and env.allocated("llm-mps") is not None)

    with prometheus.running([f"127.0.0.1:{port}"], tmp_path) as prom:
        async def answer(promql: str, n: int) -> dict[str, dict[str, Any]]:
            found: list[dict[str, Any]] = []
            async with asyncio.timeout(30):
                while len(found) < n:
                    found = await asyncio.to_thread(prom.query, promql)
                    await asyncio.sleep(0.3)
            return {r["metric"]["pod"]: r for r in found}

        used = await answer("gpu_slice_pod_memory_used_bytes", 2)
        mig = used["llm-mig"]["metric"]
        assert {k: mig[k] for k in ("namespace", "pod", "container", "pod_uid", "node", "gpu_uuid", "unit", "mode",
                                    "profile")} == {
            "namespace": "default", "pod": "llm-mig", "container": "main", "pod_uid": uid, "node": NODE,
            "gpu_uuid": MIG.uuid, "unit": uuid, "mode": "mig", "profile": "3g.40gb"}
        assert float(used["llm-mig"]["value"][1]) == 5 * GIB
        assert used["llm-mps"]["metric"]["mode"] == "mps" and used["llm-mps"]["metric"]["unit"] == MPS.uuid
        assert float(used["llm-mps"]["value"][1]) == 6 * GIB  # its MPS client, through the budget watch

        # the shipped adapter rules, as prometheus-adapter would query them for both pods
        by_name = {metric_name(r): r for r in rules()}
        pods = ["llm-mig", "llm-mps"]
        activity = await answer(render(by_name["gpu_slice_pod_gpu_activity"], "default", pods), 1)
        assert set(activity) == {"llm-mig"} and float(activity["llm-mig"]["value"][1]) == 0.6
        memory = await answer(render(by_name["gpu_slice_pod_gpu_memory_used"], "default", pods), 2)
        assert {p: float(r["value"][1]) for p, r in memory.items()} == {"llm-mig": 5 * GIB, "llm-mps": 6 * GIB}
        ratio = await answer(render(by_name["gpu_slice_pod_gpu_memory_utilization"], "default", pods), 2)
        share = mps_share_mib(MPS.memory_mib, 2, MPS.slices) * 1024**2
        assert float(ratio["llm-mps"]["value"][1]) == pytest.approx(6 * GIB / share)
        assert float(ratio["llm-mig"]["value"][1]) == pytest.approx(5 * GIB / (MIG.instances[3].memory_mib * 1024**2))
        assert list(ratio["llm-mig"]["metric"]) == ["pod"]  # grouped by the resource label alone

        # the pod dashboard: every query is valid PromQL, and those of the per-pod series see both pods
        for expr in dashboard_queries():
            got = await asyncio.to_thread(prom.answer, expr.replace("$namespace", ".*").replace("$pod", ".*"))
            assert got["status"] == "success", (expr, got)
            if "gpu_slice_cluster_" not in expr and "activity" not in expr and "bandwidth" not in expr:
                assert len(got["data"]["result"]) >= 1 if expr.startswith(("count(", "sum(")) else \
                    len(got["data"]["result"]) == 2, (expr, got["data"]["result"])

        # gpu-slice status's advice queries: each pod's peaks and how long it has been measured
        import time

        peaks = await asyncio.to_thread(fetch_peaks, prom.url, 300, time.time())
        assert peaks[uid].memory_mib == 5 * 1024 and peaks[uid].activity == 0.6
        assert peaks[uid_m].memory_mib == 6 * 1024 and peaks[uid_m].activity is None
        assert peaks[uid].observed_s is not None and 0 <= peaks[uid].observed_s < 120
