"""The shipped slice-pod admission policy (``manifests/deviceplugin/slice-pod-policy.yaml``) on a real
kube-apiserver 1.36 (``../shared/k8s``; skipped where it is absent): every refusal with its reason, and
good pods accepted. Pods are created with a server-side dry run (admission runs, nothing is stored),
except where a stored pod is needed (ephemeral containers, the plugin's eviction call).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import k8s_launcher as launcher
from tests.k8s_launcher import run_cluster
from tests.manifests.built import NAMESPACE, build, kubectl, run_kubectl

pytestmark = [
    pytest.mark.skipif(not launcher.CLUSTER.is_file(), reason=f"no real control plane: {launcher.CLUSTER} is absent"),
    pytest.mark.skipif(kubectl() is None, reason="kubectl is not installed (.ci/run installs it)"),
    pytest.mark.timeout(180),
]

POLICY = "gpu-slice-slice-pods"
SLICES = "example.com/gpu-slice"


def _kubectl(kubeconfig: Path, *args: str, stdin: str | None = None,
             check: bool = True) -> subprocess.CompletedProcess[str]:
    done = run_kubectl(kubeconfig, *args, stdin=stdin)
    if check and done.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done


@pytest.fixture(scope="module")
def api() -> Iterator[Any]:
    """A real API server with the shipped policy, its binding and parameters applied; the admin client."""
    from kubernetes import client, config

    work = Path(tempfile.mkdtemp(prefix="gsp", dir="/tmp"))
    try:
        run_cluster("up", str(work))
        admin = work / "kubeconfig"
        objs = [o for o in build("nvidia") if o["kind"] == "Namespace" or o["metadata"]["name"] in (
            POLICY, "gpu-slice-mps-uid")]
        assert {o["kind"] for o in objs} == {"Namespace", "ConfigMap", "ValidatingAdmissionPolicy",
                                             "ValidatingAdmissionPolicyBinding"}, objs
        _kubectl(admin, "apply", "--server-side", "--validate=strict", "-f", "-", stdin=yaml.safe_dump_all(objs))
        got = json.loads(_kubectl(admin, "get", "validatingadmissionpolicy", POLICY, "-o", "json").stdout)
        assert not (got.get("status") or {}).get("typeChecking", {}).get("expressionWarnings"), got["status"]
        core = client.CoreV1Api(config.new_client_from_config(config_file=str(admin)))
        # The policy takes effect once the API server's informers have it: wait for a first refusal.
        deadline = time.monotonic() + 60
        while create(core, pod(env={"NVIDIA_VISIBLE_DEVICES": "all"})) is None:
            assert time.monotonic() < deadline, "the shipped policy never took effect"
            time.sleep(0.5)
        yield core, admin
    finally:
        subprocess.run([str(launcher.CLUSTER), "down", str(work)], capture_output=True, timeout=90, check=False)
        shutil.rmtree(work, ignore_errors=True)


def pod(name: str = "llm", *, env: dict[str, str] | None = None, init_env: dict[str, str] | None = None,
        isolation: str | None = None, shm: bool = False, pod_uid: int | None = None, uid: int | None = None,
        slices: bool = True) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "server", "image": "vllm", "resources": {"limits": {SLICES: "2"}} if slices
                                 else {}}
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    if uid is not None:
        container["securityContext"] = {"runAsUser": uid}
    spec: dict[str, Any] = {"containers": [container]}
    if init_env:
        spec["initContainers"] = [{"name": "fetch-weights", "image": "fetch",
                                   "env": [{"name": k, "value": v} for k, v in init_env.items()]}]
    if shm:
        container["volumeMounts"] = [{"name": "shm", "mountPath": "/dev/shm"}]
        spec["volumes"] = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}]
    if pod_uid is not None:
        spec["securityContext"] = {"runAsUser": pod_uid}
    meta: dict[str, Any] = {"name": name}
    if isolation:
        meta["annotations"] = {"example.com/gpu-isolation": isolation}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def create(core: Any, body: dict[str, Any], *, dry_run: bool = True) -> str | None:
    """``None`` when admission accepted the pod, else the API server's message."""
    from kubernetes.client.exceptions import ApiException

    try:
        core.create_namespaced_pod("default", body, dry_run="All" if dry_run else None, _preload_content=False)
    except ApiException as exc:
        assert exc.status in (403, 422), exc
        return str(json.loads(exc.body)["message"])
    return None


PREFIX = f"admission webhook denied|ValidatingAdmissionPolicy '{POLICY}' with binding '{POLICY}' denied request: "


@pytest.mark.parametrize(("body", "reason"), [
    (pod(env={"NVIDIA_VISIBLE_DEVICES": "all"}),
     "may not set NVIDIA_VISIBLE_DEVICES itself (container(s) server): the device plugin hands the container its "
     "slice by CDI name and sets NVIDIA_VISIBLE_DEVICES=void"),
    (pod(init_env={"CUDA_MPS_PIPE_DIRECTORY": "/var/run/elsewhere"}),
     "may not set CUDA_MPS_* variables itself (container(s) fetch-weights)"),
    (pod(env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}, isolation="mig"),
     "may not set CUDA_MPS_* variables itself (container(s) server)"),
    (pod(shm=True),
     "that may land on an MPS GPU (example.com/gpu-isolation is any) may not mount its own /dev/shm (container(s) "
     "server): it would hide the shm its MPS clients share with the MPS daemon"),
    (pod(shm=True, isolation="mps"), "(example.com/gpu-isolation is mps) may not mount its own /dev/shm"),
    (pod(pod_uid=1000),
     "must run as the MPS UID of its nodes, 0 where it states one (container(s) server): the MPS server serves "
     "one UID"),
    (pod(pod_uid=0, uid=1000), "must run as the MPS UID of its nodes, 0 where it states one (container(s) server)"),
])
def test_each_refusal_with_its_reason(api: Any, body: dict[str, Any], reason: str) -> None:
    core, _ = api
    message = create(core, body)
    assert message is not None and reason in message, message
    assert f"ValidatingAdmissionPolicy '{POLICY}'" in message


@pytest.mark.parametrize("body", [
    pod(),                                                   # a plain slice pod
    pod(env={"HF_HOME": "/models", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}),
    pod(shm=True, isolation="mig"),                          # its own /dev/shm where MPS cannot be
    pod(pod_uid=1000, isolation="mig"),                      # another UID on MIG
    pod(pod_uid=1000, uid=0),                                # the slice container's own UID is the MPS one
    pod(pod_uid=0),
    pod(env={"NVIDIA_VISIBLE_DEVICES": "all"}, slices=False),  # not a slice pod: the toolkit setting's business
])
def test_good_pods_are_accepted(api: Any, body: dict[str, Any]) -> None:
    core, _ = api
    assert create(core, body) is None


def test_an_ephemeral_container_cannot_reopen_the_gpus_and_the_plugin_can_evict(api: Any) -> None:
    from kubernetes.client.exceptions import ApiException

    from deviceplugin.kube import KubeClient

    core, admin = api
    assert create(core, pod("debug-me"), dry_run=False) is None
    debug = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "debug-me", "namespace": "default"},
             "spec": {"ephemeralContainers": [{"name": "debugger", "image": "busybox",
                                               "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}}
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_pod_ephemeralcontainers("debug-me", "default", debug)
    assert "may not set NVIDIA_VISIBLE_DEVICES itself (container(s) debugger)" in json.loads(exc.value.body)["message"]
    # The budget watch's eviction, through the plugin's own client (Eviction API, UID precondition).
    uid = core.read_namespaced_pod("debug-me", "default").metadata.uid
    KubeClient(core.api_client, "n1").evict_pod("default", "debug-me", uid)
    deadline = time.monotonic() + 30
    while _kubectl(admin, "get", "pod", "debug-me", check=False).returncode == 0:
        assert time.monotonic() < deadline, "the evicted pod is still there"
        time.sleep(0.3)
    assert NAMESPACE == "gpu-slice-system"
