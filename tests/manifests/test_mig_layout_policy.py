"""The dynamic-MIG-layout admission policy and RBAC on a real kube-apiserver 1.36 (``../shared/k8s``):
only the extender writes the wanted layout, and nothing else on a Node; only the node's device plugin
writes the result (skipped where the kit is absent)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests import k8s_launcher as launcher
from tests.k8s_launcher import run_cluster
from tests.manifests.built import NAMESPACE, build, kubectl, run_kubectl, until_refused

CLUSTER = launcher.CLUSTER
SKIPPED = {"DaemonSet", "Deployment", "PodMonitor", "ServiceMonitor", "PrometheusRule"}
WISH = "example.com/gpu-slice.mig-layout"
RESULT = "example.com/gpu-slice.mig-layout-status"
GENERATION = "example.com/gpu-slice.mig-layout-generation"

pytestmark = [
    pytest.mark.skipif(not CLUSTER.is_file(), reason=f"no real control plane: {CLUSTER} is absent"),
    pytest.mark.skipif(kubectl() is None, reason="kubectl is not installed (.ci/run installs it)"),
    pytest.mark.timeout(180),
]


def _kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run_kubectl(kubeconfig, *args, stdin=stdin)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix="gsl", dir="/tmp"))
    try:
        run_cluster("up", str(work), timeout=120)
        admin = work / "kubeconfig"
        objs = [o for o in build("simulated") if o["kind"] not in SKIPPED]
        done = _kubectl(admin, "apply", "--server-side", "--field-manager=gpu-slice-install", "-f", "-",
                        stdin=yaml.safe_dump_all(objs))
        assert done.returncode == 0, done.stderr
        for node in ("gpu-1", "gpu-2", "probe"):
            done = _kubectl(admin, "create", "-f", "-", stdin=json.dumps(
                {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}))
            assert done.returncode == 0, done.stderr
        holder = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plugin-gpu-1", "namespace": NAMESPACE},
                  "spec": {"nodeName": "gpu-1", "serviceAccountName": "gpu-slice-device-plugin",
                           "containers": [{"name": "p", "image": "gpu-slice:test"}]}}
        assert _kubectl(admin, "create", "-f", "-", stdin=json.dumps(holder)).returncode == 0
        run_cluster("sa-kubeconfig", str(work), f"{NAMESPACE}/gpu-slice-extender", str(work / "ext.kubeconfig"))
        run_cluster("sa-kubeconfig", str(work), f"{NAMESPACE}/gpu-slice-device-plugin", str(work / "dp.kubeconfig"),
                    "--bound-pod", f"{NAMESPACE}/plugin-gpu-1")
        # Until the policy refuses even an admin.
        until_refused(lambda n: _patch(work, "kubeconfig", "probe", annotations={WISH: f'{{"v":1,"n":{n}}}'}),
                      "only gpu-slice's extender may write")
        yield work
    finally:
        try:
            run_cluster("down", str(work), timeout=60)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _patch(cluster: Path, who: str, node: str, *, annotations: dict[str, str] | None = None,
           labels: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    body = {"metadata": {"annotations": annotations or {}, "labels": labels or {}}}
    return _kubectl(cluster / who, "patch", "node", node, "--type=merge", "-p", json.dumps(body))


def test_only_the_extender_writes_the_wanted_layout(cluster: Path) -> None:
    ok = _patch(cluster, "ext.kubeconfig", "gpu-1", annotations={WISH: '{"v":1}'})
    assert ok.returncode == 0, ok.stderr
    for who in ("dp.kubeconfig", "kubeconfig"):  # the node's own plugin, and even a cluster admin
        denied = _patch(cluster, who, "gpu-1", annotations={WISH: '{"v":1,"x":2}'})
        assert denied.returncode != 0 and "only gpu-slice's extender may write" in denied.stderr, denied.stderr


def test_the_extender_may_change_nothing_else_on_a_node(cluster: Path) -> None:
    for change in ({"labels": {"team": "x"}}, {"annotations": {"example.com/gpu-slice.inventory": "{}"}},
                   {"annotations": {WISH: '{"v":1}', "other": "y"}}):
        denied = _patch(cluster, "ext.kubeconfig", "gpu-2", **change)  # type: ignore[arg-type]
        assert denied.returncode != 0 and "may change only the annotation" in denied.stderr, (change, denied.stderr)
    taint = _kubectl(cluster / "ext.kubeconfig", "taint", "node", "gpu-2", "k=v:NoSchedule")
    assert taint.returncode != 0


def test_only_the_nodes_plugin_writes_the_result_and_the_generation_label(cluster: Path) -> None:
    ok = _patch(cluster, "dp.kubeconfig", "gpu-1", annotations={RESULT: '{"v":1}'}, labels={GENERATION: "1"})
    assert ok.returncode == 0, ok.stderr
    other_node = _patch(cluster, "dp.kubeconfig", "gpu-2", annotations={RESULT: '{"v":1}'})
    assert other_node.returncode != 0 and "only the Node it runs on" in other_node.stderr
    for who in ("ext.kubeconfig", "kubeconfig"):
        denied = _patch(cluster, who, "gpu-1", labels={GENERATION: "2"})
        assert denied.returncode != 0 and "only gpu-slice's device plugin may write" in denied.stderr, denied.stderr
