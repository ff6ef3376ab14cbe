"""Scenario 10: per-pod series, cluster gauges and right-sizing advice on the kubelet-dm cluster.

* A MIG pod and an MPS pod (the simulated backend's figures driven by ``example.com/simulated-
  utilization`` and ``example.com/simulated-memory``) get per-pod series on their node's plugin, scraped
  by the real Prometheus with their own pod, namespace, node and UID labels: the MIG pod its instance's
  memory and activity, the MPS pod its own MPS client's memory (through the budget watch) and no
  activity.
* A Pending 5-slice MIG pod shows in the leading extender's Pending-by-reason gauge.
* ``gpu-slice status --prometheus-url`` advises the over-provisioned MIG pod (4 GiB and 10 % of a
  3g.40gb) a 1g.10gb, and says what the cluster would free; the MPS pod is not advised (no per-pod
  activity under memory-and-threads).
* The HPA example is accepted by the real API server (server-side dry run).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
from typing import Any

import pytest

from e2e.harness import REPO, TEST_NS, System, counts_dict, create_all, http, slice_pod, wait, wait_placed

pytestmark = pytest.mark.timeout(240)

WINDOW = "12s"
GIB = 1024**3


def query(system: System, promql: str) -> dict[str, dict[str, Any]]:
    """pod -> series of an instant query (empty while Prometheus has none)."""
    status, raw = http("GET", f"{system.prometheus_url}/api/v1/query?query={urllib.parse.quote(promql)}")
    if status != 200:
        return {}
    return {r["metric"].get("pod", ""): r for r in json.loads(raw)["data"]["result"]}


def advice(system: System) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "gpuslice_cli", "status", "--kubeconfig", str(system.admin),
                           "--config", str(system.extender_config), "--prometheus-url", system.prometheus_url,
                           "--window", WINDOW, "-o", "json"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)["advice"]
    return out


def test_per_pod_series_gauges_and_advice(system: System, record: dict[str, Any]) -> None:
    t0 = time.monotonic()
    create_all(system, [
        slice_pod("s-mig", 3, isolation="mig", annotations={"example.com/simulated-utilization": "10",
                                                            "example.com/simulated-memory": "4Gi"}),
        slice_pod("s-mps", 2, isolation="mps", annotations={"example.com/simulated-memory": "3Gi"})])
    placed = wait_placed(system, ["s-mig", "s-mps"])
    create_all(system, [slice_pod("s-pending", 5, isolation="mig")])  # no 5g profile on an H100

    want = {"s-mig": 4 * GIB, "s-mps": 3 * GIB}  # the MPS client's shows after the budget watch's next pass

    def memory() -> dict[str, dict[str, Any]] | None:
        got = query(system, f'gpu_slice_pod_memory_used_bytes{{namespace="{TEST_NS}"}}')
        return got if {p: float(got[p]["value"][1]) for p in want if p in got} == want else None
    used = wait("both pods' memory in Prometheus", memory, 90)
    record["series_after_s"] = round(time.monotonic() - t0, 1)
    for name, mode in (("s-mig", "mig"), ("s-mps", "mps")):
        labels = used[name]["metric"]
        pod = placed[name]
        assert (labels["namespace"], labels["node"], labels["pod_uid"], labels["mode"]) == (
            TEST_NS, pod["spec"]["nodeName"], pod["metadata"]["uid"], mode), labels
    assert used["s-mig"]["metric"]["profile"] == "3g.40gb"
    activity = query(system, f'gpu_slice_pod_gpu_activity_ratio{{namespace="{TEST_NS}"}}')
    assert set(activity) == {"s-mig"} and float(activity["s-mig"]["value"][1]) == 0.1

    lead = system.wait_leader()
    wait("the Pending pod in the leader's gauge", lambda: system.metric(
        lead.ops_url, 'gpu_slice_cluster_pending_pods{reason="size"}') >= 1, 60)

    def advised() -> dict[str, Any] | None:
        got = advice(system)
        pods = {p["pod"]: p for p in got["pods"]}
        return got if pods.get(f"{TEST_NS}/s-mig", {}).get("advice", {}).get("advised") else None
    got = wait(f"the MIG pod measured over the {WINDOW} window and advised", advised, 90, interval=2.0)
    pods = {p["pod"]: p for p in got["pods"]}
    mig = pods[f"{TEST_NS}/s-mig"]
    assert (mig["advice"]["slices"], mig["advice"]["profile"], mig["advice"]["frees"]) == (1, "1g.10gb", 2)
    assert mig["peak_memory_mib"] == 4096 and mig["peak_activity"] == 0.1
    assert not pods[f"{TEST_NS}/s-mps"]["advice"]["advised"]
    assert {(f["product"], f["mode"], f["slices"]) for f in got["freed"]} == {("H100-80GB", "mig", 2)}
    record["advised_after_s"] = round(time.monotonic() - t0, 1)

    system.kubectl("apply", "--dry-run=server", "--validate=strict", "-n", TEST_NS, "-f",
                   str(REPO / "manifests/examples/autoscaling/hpa-vllm.yaml"))
    counts = system.settle_and_audit()
    record["counts"] = counts_dict(counts)
    assert not counts.bad(), counts.problems
