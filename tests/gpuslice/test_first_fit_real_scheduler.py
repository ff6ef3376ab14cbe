"""The first-fit model of :mod:`gpuslice.packing.first_fit` against the real kube-scheduler 1.36 (DRA).

``gpu-slice simulate --device-choice`` assumes that, under DRA, kube-scheduler's DynamicResources
plugin gives a claim the first device in the driver's list that fits, skipping devices already
allocated and, for a device with consumable capacity (an MPS GPU's shares), those whose remaining
shares are too few; and that a republished list (a new pool generation) is what later claims
see. Here the real kube-scheduler and kube-apiserver from ``../shared/k8s`` allocate claims on one
node whose ResourceSlice lists three whole GPUs and two MPS GPUs out of name order, and every
allocation is compared with what the model gives on the same devices in the same order. No kubelet
runs: the scheduler allocates and binds; nothing is started.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuslice.packing.first_fit import PublishedOrder
from gpuslice.packing.state import KIND_MPS, KIND_WHOLE, ClusterState, NodeSpec, PackRequest, UnitSpec
from tests.k8s_launcher import CLUSTER, run_cluster

pytestmark = [
    pytest.mark.skipif(not CLUSTER.is_file(), reason=f"no real control plane: {CLUSTER} is absent "
                                                     "(the shared k8s kit beside the repository)"),
    pytest.mark.timeout(300),
]

DRIVER = "gpu-slice.example.com"
NODE = "dra-node"
S = 7
#: The node's devices: (name, kind); the model's unit positions follow this tuple.
DEVICES = (("gpu-0", "whole"), ("gpu-1", "whole"), ("gpu-2", "whole"), ("mps-a", "mps"), ("mps-b", "mps"))


class Cluster:
    """The API server through the kubernetes client, objects as dicts."""

    def __init__(self, work: Path) -> None:
        from kubernetes import client, config

        self.work = work
        api = config.new_client_from_config(config_file=str(work / "kubeconfig"))
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def apply(self, *objects: dict[str, Any]) -> None:
        """Create each object, or replace it (a republished ResourceSlice) when it exists."""
        from kubernetes.client.exceptions import ApiException

        for obj in objects:
            kind, name, ns = obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace")
            if kind == "Pod":
                self.core.create_namespaced_pod(ns, obj)
                continue
            plural = {"DeviceClass": "deviceclasses", "ResourceSlice": "resourceslices",
                      "ResourceClaim": "resourceclaims"}[kind]
            args = ("resource.k8s.io", "v1", *((ns,) if ns else ()), plural)
            create = self.custom.create_namespaced_custom_object if ns else self.custom.create_cluster_custom_object
            try:
                create(*args, obj)
            except ApiException as err:
                if err.status != 409 or ns:
                    raise
                current = self.custom.get_cluster_custom_object(*args, name)
                obj["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                self.custom.replace_cluster_custom_object(*args, name, obj)

    def allocation(self, name: str) -> list[dict[str, Any]]:
        got = self.custom.get_namespaced_custom_object("resource.k8s.io", "v1", "default", "resourceclaims", name)
        results: list[dict[str, Any]] = got.get("status", {}).get("allocation", {}).get("devices", {}).get(
            "results", [])
        return results

    def node_of(self, pod: str) -> str:
        return str(self.core.read_namespaced_pod(pod, "default").spec.node_name or "")


@pytest.fixture(scope="module")
def real() -> Iterator[Cluster]:
    work = Path(tempfile.mkdtemp(prefix="gsd-"))  # short: the launcher's sockets live under it
    try:
        run_cluster("up", str(work))
        config = work / "sched.yaml"
        config.write_text("apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n"
                          "leaderElection:\n  leaderElect: false\n")
        run_cluster("scheduler", str(work), str(config))
        cluster = Cluster(work)
        cluster.core.create_node({"apiVersion": "v1", "kind": "Node",
                                  "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}}})
        cluster.apply({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": DRIVER},
                       "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}})
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        resources = {"cpu": "8", "memory": "32Gi", "pods": "110"}
        status = {"status": {"capacity": resources, "allocatable": resources, "conditions": [
            {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": now,
             "lastTransitionTime": now}]}}
        cluster.core.patch_node_status(NODE, status)
        yield cluster
    finally:
        subprocess.run([sys.executable, str(CLUSTER), "down", str(work)], capture_output=True, timeout=60,
                       check=False)
        shutil.rmtree(work, ignore_errors=True)


def device(name: str, kind: str) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "attributes": {"kind": {"string": kind}}}
    if kind == "mps":  # one device per MPS GPU, S consumable shares (DESIGN 2's MPS slices)
        out["allowMultipleAllocations"] = True
        out["capacity"] = {"shares": {"value": str(S), "requestPolicy": {
            "default": "1", "validRange": {"min": "1", "max": str(S)}}}}
    return out


def publish(cluster: Cluster, names: list[str], generation: int) -> None:
    kinds = dict(DEVICES)
    cluster.apply({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{NODE}-gpus"},
                   "spec": {"driver": DRIVER, "nodeName": NODE,
                            "pool": {"name": NODE, "generation": generation, "resourceSliceCount": 1},
                            "devices": [device(n, kinds[n]) for n in names]}})


def claim(cluster: Cluster, name: str, kind: str, shares: int | None = None) -> str:
    """A pod with one claim for one device of ``kind``; the device the scheduler allocated."""
    request: dict[str, Any] = {"deviceClassName": DRIVER, "selectors": [
        {"cel": {"expression": f'device.attributes["{DRIVER}"].kind == "{kind}"'}}]}
    if shares is not None:
        request["capacity"] = {"requests": {"shares": str(shares)}}
    cluster.apply(
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
         "metadata": {"name": name, "namespace": "default"},
         "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
         "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                  "containers": [{"name": "c", "image": "none", "resources": {"claims": [{"name": "gpu"}]}}]}})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        results = cluster.allocation(name)
        if results:
            assert cluster.node_of(name) in ("", NODE)  # allocated at Filter, bound right after
            return str(results[0]["device"])
        time.sleep(0.2)
    raise AssertionError(f"claim {name} was not allocated within 60 s")


class Model:
    """The same node in the packing state, and the published order of :mod:`first_fit`."""

    def __init__(self) -> None:
        units = [UnitSpec(0, i, KIND_WHOLE if kind == "whole" else KIND_MPS, S, memory_mib=81920)
                 for i, (_, kind) in enumerate(DEVICES)]
        self.state = ClusterState([NodeSpec(NODE, 8000, 32768, "H100")], units, slices_per_gpu=S)
        self.order = PublishedOrder(self.state)
        self.row = {name: int(self.state.node_units[0, i]) for i, (name, _) in enumerate(DEVICES)}

    def publish(self, names: list[str]) -> None:
        rows = np.array([self.row[n] for n in names], dtype=np.int64)
        self.order.publish(self.state, rows, np.arange(len(names), dtype=np.int64))

    def claim(self, kind: str, shares: int | None = None) -> str:
        # A whole-GPU pod (S slices) would also fit an idle MPS GPU in the model; the lists below put
        # the whole GPUs first, as the real claims' selector asks, so first fit never reaches one.
        req = PackRequest(gpus=1, slices=S if shares is None else shares, isolation="mps" if kind == "mps" else "any")
        cands = self.order.candidates(self.state, req, self.state.fit(req))
        assert len(cands) == 1
        unit = int(cands.units[0, 0])
        self.state.take(0, [unit], req.slices, 0, 0)
        return next(n for n, r in self.row.items() if r == unit)


def test_kube_scheduler_gives_the_first_fitting_device_in_the_published_order(real: Cluster) -> None:
    model = Model()
    steps: list[tuple[str, str, int | None]] = []
    first = ["gpu-2", "gpu-0", "gpu-1", "mps-b", "mps-a"]  # not name order: the list order decides
    publish(real, first, 1)
    model.publish(first)
    steps += [("w1", "whole", None)]
    got = {name: claim(real, name, kind, shares) for name, kind, shares in steps}
    want = {name: model.claim(kind, shares) for name, kind, shares in steps}
    assert got == want == {"w1": "gpu-2"}
    # A republish: a new pool generation with another order; already allocated devices are skipped.
    second = ["gpu-2", "gpu-1", "gpu-0", "mps-b", "mps-a"]
    publish(real, second, 2)
    model.publish(second)
    later = [("w2", "whole", None), ("m1", "mps", 3), ("m2", "mps", 5), ("m3", "mps", 4), ("m4", "mps", 1)]
    got = {name: claim(real, name, kind, shares) for name, kind, shares in later}
    want = {name: model.claim(kind, shares) for name, kind, shares in later}
    # m2 does not fit in what m1 left on mps-b; m3 does (first fit, not best fit); m4 fits mps-a only
    assert got == want == {"w2": "gpu-1", "m1": "mps-b", "m2": "mps-a", "m3": "mps-b", "m4": "mps-a"}
