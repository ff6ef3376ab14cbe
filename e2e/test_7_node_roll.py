"""Scenario 7: a device plugin roll under running MPS pods, as a DaemonSet update does it on a node.

MPS slice pods run on the kubelet-dm nodes; each node's plugin gets SIGTERM (what kubelet sends a
DaemonSet pod being replaced) and a new plugin process starts. Checked: every MPS control daemon keeps
running (the same process: they belong to ``gpu-slice mps-daemon``, the ``gpu-slice-mps`` DaemonSet's
process) and the new plugin adopts each (its takeover series says ``adopted``, never ``started``), its
GPUs healthy in kubelet without a ``GpuRecovered`` event; the pods keep running (same UID); new MPS
pods land; what a container would receive names exactly its GPU, with the MPS pipe and shm; the
DESIGN 8 audit counts 0.
"""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import pytest

from e2e.harness import (
    ASSIGNMENT,
    RUN_OPTIONS,
    System,
    ann_of,
    check_run_options,
    clean,
    counts_dict,
    create_all,
    mps_daemon_pids,
    restart_plugin,
    slice_pod,
    wait,
    wait_placed,
)

pytestmark = pytest.mark.timeout(300)

MPS_NODES = ("gpu-mps", "gpu-mix")


def _series(system: System, node: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one series family on the node's plugin /metrics."""
    from e2e.harness import http

    _status, body = http("GET", f"http://127.0.0.1:{system.nodes[node].metrics_port}/metrics")
    out = {}
    for line in body.decode(errors="replace").splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name):].rsplit(" ", 1)
            out[labels] = float(value)
    return out


def test_plugin_roll_keeps_and_adopts_every_mps_daemon(system: System, record: dict[str, Any]) -> None:
    names = [f"roll-{i}" for i in range(5)]
    create_all(system, [slice_pod(n, k, isolation="mps") for n, k in zip(names, [1, 2, 3, 1, 2], strict=True)])
    running = wait_placed(system, names)
    daemons = {n: mps_daemon_pids(system, n) for n in MPS_NODES}
    assert all(daemons.values()), daemons
    recovered_before = sum(1 for e in system.kube.events(None) if e.get("reason") == "GpuRecovered")
    t0 = time.monotonic()
    for node in MPS_NODES:
        restart_plugin(system, node, signal.SIGTERM)
        system.fault("device plugin rolled (SIGTERM, new process)")
    record["roll_s"] = round(time.monotonic() - t0, 1)
    for node in MPS_NODES:
        assert mps_daemon_pids(system, node) == daemons[node], f"{node}: an MPS daemon was replaced"
        for uuid in daemons[node]:
            label = f'{{gpu_uuid="{uuid}"}}'
            wait(f"{node}: the new plugin adopted the daemon of {uuid}",
                 lambda label=label, node=node: _series(system, node, "gpu_slice_mps_daemon_up").get(label) == 1.0,
                 30)
            takeovers = _series(system, node, "gpu_slice_mps_daemon_takeovers")
            assert takeovers[f'{{gpu_uuid="{uuid}",how="adopted"}}'] == 1.0, takeovers
            assert takeovers[f'{{gpu_uuid="{uuid}",how="started"}}'] == 0.0, takeovers
    for name, pod in running.items():
        now = system.kube.pod(name)
        assert now is not None and now["status"].get("phase") == "Running", (name, now and now["status"])
        assert now["metadata"]["uid"] == pod["metadata"]["uid"]
    more = [f"after-roll-{i}" for i in range(4)]
    create_all(system, [slice_pod(n, k, isolation="mps") for n, k in zip(more, [1, 2, 1, 1], strict=True)])
    placed = wait_placed(system, more)
    assert not check_run_options(system, [*placed.values(), *running.values()])
    for pod in placed.values():
        opts = json.loads(ann_of(pod)[RUN_OPTIONS])["server"]
        node = pod["spec"]["nodeName"]
        gpu = json.loads(ann_of(pod)[ASSIGNMENT])["gpus"][0]
        mounts = {m["containerPath"]: m["hostPath"] for m in opts["mounts"]}
        assert mounts["/dev/shm"] == str(system.work / "mps" / node / "shm")
        assert mounts["/run/gpu-slice/mps/pipe"] == str(system.work / "mps" / node / gpu / "pipe")
    assert sum(1 for e in system.kube.events(None) if e.get("reason") == "GpuRecovered") == recovered_before
    counts = system.settle_and_audit()
    record["counts"] = counts_dict(counts)
    record.setdefault("faults", {})["device plugin rolled"] = len(MPS_NODES)
    assert not counts.bad(), counts.problems
    clean(system)
