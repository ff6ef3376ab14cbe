"""The shipped slice-request admission policy (``manifests/admission``) on a real kube-apiserver 1.36
(``../shared/k8s``; skipped with the reason where it is absent): each bad request is refused with
its reason, worded as the extender's own refusal (``gpuslice.requests``, ``gpuslice.rules``), and
good ones are admitted. Also: every overlay applies, as shipped, to a plain API server that has no
Prometheus-operator CRDs."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice.errors import GpuSliceError
from gpuslice.pods import project
from tests import k8s_launcher as launcher
from tests.manifests.built import MANIFESTS, build, kubectl, run_kubectl, until_refused

pytestmark = [
    pytest.mark.skipif(not launcher.CLUSTER.is_file(), reason=f"no real control plane: {launcher.CLUSTER} is absent"),
    pytest.mark.skipif(kubectl() is None, reason="kubectl is not installed (.ci/run installs it)"),
    pytest.mark.timeout(240),
]

OVERLAYS = sorted(p.name for p in (MANIFESTS / "overlays").iterdir() if (p / "kustomization.yaml").is_file())


def _kubectl(admin: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run_kubectl(admin, *args, stdin=stdin)


@pytest.fixture(scope="module")
def apiserver() -> Iterator[Path]:
    """A bare control plane (etcd and kube-apiserver): no CRDs, no controllers."""
    work = Path(tempfile.mkdtemp(prefix="gsa", dir="/tmp"))
    try:
        launcher.run_cluster("up", str(work))
        yield work / "kubeconfig"
    finally:
        try:
            launcher.run_cluster("down", str(work), timeout=60)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def test_every_overlay_applies_to_a_plain_cluster_without_prometheus_operator_crds(apiserver: Path) -> None:
    """As shipped: no PodMonitor, ServiceMonitor or PrometheusRule unless the monitoring component is
    opted into; the first overlay is applied for real, the others as a server-side dry run over it."""
    apply = ["apply", "--server-side", "--field-manager=gpu-slice-install", "--validate=strict", "-f", "-"]
    assert OVERLAYS, "no overlays found"
    for n, overlay in enumerate(OVERLAYS):
        objs = build(overlay)
        kinds = {o["kind"] for o in objs}
        assert not kinds & {"PodMonitor", "ServiceMonitor", "PrometheusRule"}, (overlay, kinds)
        done = _kubectl(apiserver, *apply, *(["--dry-run=server"] if n else []), stdin=yaml.safe_dump_all(objs))
        assert done.returncode == 0, f"{overlay}:\n{done.stderr}"
        assert done.stdout.count("serverside-applied") == len(objs), done.stdout
    crds = _kubectl(apiserver, "get", "crd", "-o", "name")
    assert "monitoring.coreos.com" not in crds.stdout


def pod(name: str, slices: int | None = 2, *, memory: str | None = None, isolation: str | None = None,
        extra: list[dict[str, Any]] | None = None, init: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    notes = {}
    if memory is not None:
        notes["example.com/gpu-memory"] = memory
    if isolation is not None:
        notes["example.com/gpu-isolation"] = isolation
    limits = {"example.com/gpu-slice": str(slices)} if slices else {}
    spec: dict[str, Any] = {"schedulerName": "gpu-slice-scheduler", "containers": [
        {"name": "server", "image": "registry.invalid/llm:1", "resources": {"limits": limits}}, *(extra or [])]}
    if init:
        spec["initContainers"] = init
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "annotations": notes},
            "spec": spec}


def asker(name: str, slices: int = 1, **kw: Any) -> dict[str, Any]:
    limits = {"example.com/gpu-slice": str(slices)}
    return {"name": name, "image": "registry.invalid/x:1", "resources": {"limits": limits}, **kw}


BAD = [
    ("memory-gb", pod("memory-gb", memory="20GB"),
     "annotation example.com/gpu-memory: '20GB' is not a Kubernetes quantity; did you mean '20Gi'?"),
    ("memory-spaced", pod("memory-spaced", memory="40 gib"),
     "annotation example.com/gpu-memory: '40 gib' is not a Kubernetes quantity; did you mean '40Gi'?"),
    ("memory-bytes", pod("memory-bytes", memory="20"),
     "annotation example.com/gpu-memory: '20' is less than 1Mi; did you mean '20Gi'?"),
    ("memory-zero", pod("memory-zero", memory="0"), "annotation example.com/gpu-memory must be positive, got '0'"),
    ("isolation", pod("isolation", isolation="secure"),
     "annotation example.com/gpu-isolation must be one of mig, mps, any, got 'secure'"),
    ("thirty", pod("thirty", 30),
     "30 slices is neither at most S=7 (one GPU) nor a whole number of GPUs (a multiple of 7); did you mean 28 "
     "or 35?"),
    ("two-containers", pod("two-containers", extra=[asker("sidecar")]),
     "containers 'server', 'sidecar' all request example.com/gpu-slice; only one container per pod may"),
    ("init", pod("init", init=[asker("warmup")]),
     "init container 'warmup' requests example.com/gpu-slice; only one app container may request slices"),
]

GOOD = [pod("good", 2, memory="20Gi", isolation="mig"), pod("two-gpus", 14, isolation="any"),
        pod("one-gpu", 7, memory="1.5Ti"), pod("plain", None)]


def _core_refusal(body: dict[str, Any]) -> str:
    """The extender's own reason for the same pod (projection, then the packing request)."""
    info = project(body)
    if info.error:
        return info.error.removeprefix(f"pod {info.label}: ")
    try:
        info.pack(7)
    except GpuSliceError as err:
        return str(err)
    return ""


def _create(admin: Path, body: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    clean = copy.deepcopy(body)
    clean["metadata"].pop("uid", None)
    return _kubectl(admin, "create", "-f", "-", "-o", "name", stdin=json.dumps(clean))


def _install_policy(admin: Path) -> None:
    objs = [o for o in build("simulated") if o["kind"] in ("Namespace", "ValidatingAdmissionPolicy",
                                                           "ValidatingAdmissionPolicyBinding")
            or (o["kind"] == "ConfigMap" and o["metadata"]["name"] == "gpu-slice-admission")]
    done = _kubectl(admin, "apply", "--server-side", "--field-manager=gpu-slice-install", "-f", "-",
                    stdin=yaml.safe_dump_all(objs))
    assert done.returncode == 0, done.stderr
    probe = pod("probe", memory="20GB")

    def attempt(_: int) -> subprocess.CompletedProcess[str]:
        done = _create(admin, probe)
        if done.returncode == 0:  # admitted before the policy took effect
            _kubectl(admin, "delete", "pod", "probe", "--wait=false")
        return done

    until_refused(attempt, "gpu-slice-requests")


def test_bad_requests_are_refused_with_the_extenders_reason_and_good_ones_admitted(apiserver: Path) -> None:
    _install_policy(apiserver)
    for name, body, reason in BAD:
        assert _core_refusal(body) == reason, f"{name}: the extender words it {_core_refusal(body)!r}"
        done = _create(apiserver, body)
        assert done.returncode != 0, f"{name} was admitted"
        assert "ValidatingAdmissionPolicy 'gpu-slice-requests'" in done.stderr and reason in done.stderr, \
            f"{name}: {done.stderr}"
    for body in GOOD:
        assert _core_refusal(body) == ""
        done = _create(apiserver, body)
        assert done.returncode == 0, f"{body['metadata']['name']}: {done.stderr}"


def test_an_update_is_checked_only_where_it_changes_our_annotations(apiserver: Path) -> None:
    _install_policy(apiserver)
    _create(apiserver, pod("upd", 2, memory="20Gi"))
    bad = _kubectl(apiserver, "annotate", "pod", "upd", "--overwrite", "example.com/gpu-memory=20GB")
    assert bad.returncode != 0 and "did you mean '20Gi'?" in bad.stderr
    ok = _kubectl(apiserver, "annotate", "pod", "upd", "--overwrite", "team=llm")
    assert ok.returncode == 0, ok.stderr
    ok = _kubectl(apiserver, "annotate", "pod", "upd", "--overwrite", "example.com/gpu-memory=40Gi")
    assert ok.returncode == 0, ok.stderr


def test_the_policys_slices_match_the_shared_config() -> None:
    objs = build("simulated")
    params = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "gpu-slice-admission")
    config = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("gpu-slice-config-"))
    assert int(params["data"]["slices"]) == yaml.safe_load(config["data"]["config.yaml"])["slices"]
