"""The slice map's bearer-token gate against a real kube-apiserver 1.36 (``../shared/k8s``; skipped
with the reason where it is absent), with the shipped RBAC: the extender's service account reviews
tokens (system:auth-delegator); a user bound to ``gpu-slice-slicemap-reader`` reads the map, another
gets 403, a made-up token 401; and an extender that may not review tokens answers 503, never the
data."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from starlette.applications import Starlette

from extender.authgate import AuthGate
from extender.slicemap import routes
from tests import k8s_launcher as launcher
from tests.extender.test_slicemap import Client, extender
from tests.manifests.built import NAMESPACE, build, kubectl, run_kubectl

pytestmark = [
    pytest.mark.skipif(not launcher.CLUSTER.is_file(), reason=f"no real control plane: {launcher.CLUSTER} is absent"),
    pytest.mark.skipif(kubectl() is None, reason="kubectl is not installed (.ci/run installs it)"),
    pytest.mark.timeout(180),
]


def _kubectl(admin: Path, *args: str, stdin: str | None = None) -> str:
    done = run_kubectl(admin, *args, stdin=stdin)
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout.strip()


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix="gst", dir="/tmp"))
    try:
        launcher.run_cluster("up", str(work))
        admin = work / "kubeconfig"
        objs = build("simulated")
        _kubectl(admin, "apply", "--server-side", "--field-manager=gpu-slice-install", "-f", "-",
                 stdin=yaml.safe_dump_all(objs))
        for sa in ("reader", "stranger"):
            _kubectl(admin, "create", "serviceaccount", sa, "-n", NAMESPACE)
        _kubectl(admin, "create", "clusterrolebinding", "slicemap-reader-test", "--clusterrole",
                 "gpu-slice-slicemap-reader", f"--serviceaccount={NAMESPACE}:reader")
        yield work
    finally:
        try:
            launcher.run_cluster("down", str(work), timeout=60)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _api(work: Path, sa: str) -> object:
    from kubernetes import config

    path = launcher.run_cluster("sa-kubeconfig", str(work), f"{NAMESPACE}/{sa}", str(work / f"{sa}.kubeconfig"))
    return config.new_client_from_config(config_file=path)


def test_tokens_are_reviewed_by_the_api_server_under_the_shipped_rbac(work: Path) -> None:
    admin = work / "kubeconfig"
    gate = AuthGate("token", _api(work, "gpu-slice-extender"))
    c = Client(Starlette(routes=routes(extender(), gate)))
    reader = _kubectl(admin, "create", "token", "reader", "-n", NAMESPACE)
    stranger = _kubectl(admin, "create", "token", "stranger", "-n", NAMESPACE)

    ok = c.get("/slicemap/api/status", headers={"Authorization": f"Bearer {reader}"})
    assert ok.status_code == 200, ok.text
    assert ok.json()["pending"][0]["pod"] == "ns/pod-big"
    again = c.get("/slicemap/api/status", headers={"Authorization": f"Bearer {reader}"})
    assert again.status_code == 200  # from the gate's cache

    no = c.get("/slicemap/api/status", headers={"Authorization": f"Bearer {stranger}"})
    assert no.status_code == 403, no.text
    assert "system:serviceaccount:gpu-slice-system:stranger" in no.json()["error"]
    assert "pending" not in no.text

    bad = c.get("/slicemap/api/status", headers={"Authorization": "Bearer not-a-token"})
    assert bad.status_code == 401 and "token not accepted" in bad.json()["error"]


def test_an_extender_that_may_not_review_tokens_shows_nothing(work: Path) -> None:
    admin = work / "kubeconfig"
    gate = AuthGate("token", _api(work, "stranger"))  # no system:auth-delegator
    c = Client(Starlette(routes=routes(extender(), gate)))
    reader = _kubectl(admin, "create", "token", "reader", "-n", NAMESPACE)
    resp = c.get("/slicemap/api/status", headers={"Authorization": f"Bearer {reader}"})
    assert resp.status_code == 503 and "system:auth-delegator" in resp.json()["error"]
    assert "pending" not in resp.text
