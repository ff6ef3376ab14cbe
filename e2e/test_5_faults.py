"""Scenario 5: faults, each followed by a batch that must land and a DESIGN 8 audit whose counts are all 0.

Each test injects one kind of fault with slice pods running or arriving, then checks that new pods land
and counts what can really go wrong (``harness.Counts``): invalid placements, wrong isolation,
assignment != allocated, kubelet's ids != assignment, admission failures, double-counted ids, leaked
ids, lost assignments, unstamped pods.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest

from e2e.harness import (
    ASSIGNMENT,
    CORDON,
    System,
    ann_of,
    clean,
    counts_dict,
    create_all,
    http,
    mps_daemon_pids,
    restart_node,
    restart_plugin,
    slice_pod,
    wait,
    wait_placed,
)

pytestmark = pytest.mark.timeout(200)


def _batch(system: System, prefix: str, sizes: list[int], **kw: Any) -> dict[str, dict[str, Any]]:
    names = [f"{prefix}-{i}" for i in range(len(sizes))]
    create_all(system, [slice_pod(n, k, **kw) for n, k in zip(names, sizes, strict=True)])
    return wait_placed(system, names)


def _audit(system: System, record: dict[str, Any], kind: str, n: int = 1) -> None:
    counts = system.settle_and_audit()
    record.setdefault("faults", {})[kind] = record.get("faults", {}).get(kind, 0) + n
    record["counts"] = counts_dict(counts)
    system.fault(kind)
    assert not counts.bad(), counts.problems


def test_kill_leader_mid_batch_then_restart_it(system: System, record: dict[str, Any]) -> None:
    if len(system.replicas) < 2:
        pytest.skip("one replica only (no root or no unshare: no distinct leader identities)")
    _batch(system, "pre", [2, 1])
    leader = system.wait_leader()
    names = [f"lk-{i}" for i in range(8)]
    create_all(system, [slice_pod(n, 1) for n in names[:4]])
    leader.extender.kill()
    system.stop_scheduler(leader)
    create_all(system, [slice_pod(n, 1) for n in names[4:]])
    t0 = time.monotonic()
    other = system.wait_leader(timeout=120, exclude=leader)
    placed = wait_placed(system, names, timeout=180)
    record["takeover_s"] = round(time.monotonic() - t0, 1)
    assert other is not leader
    for p in placed.values():
        assert json.loads(ann_of(p)[ASSIGNMENT])["node"] == p["spec"]["nodeName"]
    # Restart the killed replica: it comes back as a follower and the batch goes on.
    leader.extender.start()
    wait("the restarted extender /healthz", lambda: http("GET", f"{leader.ops_url}/healthz")[0] == 200, 60)
    system.start_scheduler(leader)
    _batch(system, "after", [1, 2])
    assert system.leader() is other, "the lease moved back although its holder kept running"
    _audit(system, record, "leader extender+scheduler killed")
    system.fault("extender restarted")
    record["faults"]["extender restarted"] = 1
    clean(system)


def test_restart_kubelet_and_plugin_with_pods_running(system: System, record: dict[str, Any]) -> None:
    running = _batch(system, "kr", [1, 2, 3, 1, 2])
    nodes = {p["spec"]["nodeName"] for p in running.values()}
    node = sorted(nodes)[0]
    restart_node(system, node)
    system._wait_node_ready(system.nodes[node])
    _audit(system, record, "kubelet-dm restarted")
    restart_plugin(system, node)
    _batch(system, "kr2", [1, 1])
    for name, pod in running.items():
        now = system.kube.pod(name)
        assert now is not None and now["status"].get("phase") == "Running", (name, now and now["status"])
        assert now["metadata"]["uid"] == pod["metadata"]["uid"]
    _audit(system, record, "device plugin killed and restarted")
    clean(system)


def test_prometheus_stopped_scheduling_goes_on(system: System, record: dict[str, Any]) -> None:
    assert system.prometheus is not None
    leader = system.wait_leader()
    errors = "gpu_slice_extender_prometheus_query_errors_total"
    before = system.metric(leader.ops_url, errors)
    system.prometheus.stop()
    try:
        _batch(system, "np", [1, 2, 7])
        # Packing alone, and the operator is told: the failed queries are counted.
        wait("the extender counting failed Prometheus queries",
             lambda: system.metric(leader.ops_url, errors) > before, 30)
        _audit(system, record, "prometheus stopped")
    finally:
        system._start_prometheus()
    clean(system)


def test_mps_daemon_killed(system: System, record: dict[str, Any]) -> None:
    running = _batch(system, "mp", [1, 2], isolation="mps")
    before = mps_daemon_pids(system, "gpu-mps")
    assert before, "no stand-in MPS daemon found for gpu-mps"
    gpu, pid = sorted(before.items())[0]
    os.kill(pid, signal.SIGKILL)
    wait("the MPS daemon restarted by its node's gpu-slice mps-daemon",
         lambda: mps_daemon_pids(system, "gpu-mps").get(gpu, pid) != pid, 60)
    _batch(system, "mp2", [1, 1], isolation="mps")
    for name in running:
        now = system.kube.pod(name)
        assert now is not None and now["status"].get("phase") == "Running"
    _audit(system, record, "MPS daemon killed (its GPU unhealthy until restarted)")
    clean(system)


def test_cordoned_gpu_gets_no_new_pods(system: System, record: dict[str, Any]) -> None:
    inv = json.loads(ann_of(system.kube.node("gpu-mps"))["example.com/gpu-slice.inventory"])
    cordoned = inv["gpus"][0]["uuid"]
    system.kube.patch_node("gpu-mps", {"metadata": {"annotations": {CORDON: cordoned}}})
    try:
        time.sleep(2)  # the extender's watch sees the annotation
        placed = _batch(system, "cd", [1, 1, 2, 1], isolation="mps")
        for p in placed.values():
            assert cordoned not in json.loads(ann_of(p)[ASSIGNMENT])["gpus"], p["metadata"]["name"]
        _audit(system, record, "GPU cordoned")
    finally:
        system.kube.patch_node("gpu-mps", {"metadata": {"annotations": {CORDON: None}}})
    clean(system)


def test_pods_deleted_between_bind_and_admission(system: System, record: dict[str, Any]) -> None:
    names = [f"dl-{i}" for i in range(6)]
    create_all(system, [slice_pod(n, 1) for n in names])
    deleted: set[str] = set()

    def delete_bound() -> bool:
        for p in system.kube.pods():
            n = p["metadata"]["name"]
            if n in names and n not in deleted and p["spec"].get("nodeName"):
                system.kube.delete_pod(n)
                deleted.add(n)
        return len(deleted) == len(names)
    wait("every pod bound and deleted at once", delete_bound, 120, interval=0.05)
    wait("the deleted pods gone", lambda: not [p for p in system.kube.pods() if p["metadata"]["name"] in names], 60)
    _batch(system, "dl2", [7, 7])  # the freed slices are free again
    _audit(system, record, "pods deleted right after bind", len(names))
    clean(system)


def test_apiserver_restarted(system: System, record: dict[str, Any]) -> None:
    running = _batch(system, "ar", [1, 2, 3])
    system.restart_apiserver()
    _batch(system, "ar2", [1, 2])
    # A leader that could not renew its Lease while kube-apiserver was down has exited: the kubelet
    # would start it again, and so does the harness (the next scenarios meet both replicas).
    record["schedulers_restarted"] = system.revive_schedulers()
    for name in running:
        now = system.kube.pod(name)
        assert now is not None and now["status"].get("phase") == "Running"
    _audit(system, record, "kube-apiserver restarted (every watch cut: relist)")
    clean(system)
