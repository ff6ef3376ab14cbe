"""The shipped RBAC and admission policies on the real kube-apiserver 1.36 (``../shared/k8s``), with the
tokens each component really has (issue 47):

* a tenant whose RBAC lets it create, update and patch pods, their status and their bindings still
  cannot create a pre-bound slice pod, nor write (or remove) gpu-slice's annotations through ``pods``,
  ``pods/status`` or ``pods/binding``;
* the extender (its service account's token) writes its assignment, in a patch or a Binding, and
  nothing else of a pod; the device plugin (a token bound to a pod on its node, as kubelet projects
  it) writes its stamp on pods of its own node only, and nothing else;
* kube-scheduler's account and the extender's hold each their own rights, not the other's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice import annotations as ann
from tests import k8s_launcher as launcher
from tests.k8s_launcher import run_cluster
from tests.manifests.built import NAMESPACE, build, kubectl, run_kubectl, until_refused

pytestmark = [
    pytest.mark.skipif(not launcher.CLUSTER.is_file(), reason=f"no real control plane: {launcher.CLUSTER} is absent"),
    pytest.mark.skipif(kubectl() is None, reason="kubectl is not installed (.ci/run installs it)"),
    pytest.mark.timeout(240),
]

TENANT_NS = "tenant"
SLICE = "example.com/gpu-slice"
SKIPPED = frozenset({"DaemonSet", "Deployment", "PodMonitor", "ServiceMonitor", "PrometheusRule"})


class Who:
    """kubectl as one identity (a kubeconfig file)."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig

    def run(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return run_kubectl(self.kubeconfig, *args, stdin=stdin)

    def ok(self, *args: str, stdin: str | None = None) -> str:
        done = self.run(*args, stdin=stdin)
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def refused(self, *args: str, stdin: str | None = None, says: str | tuple[str, ...] = "") -> str:
        """The command fails, saying ``says`` (or one of them: where two policies refuse a request, the
        API server reports whichever it evaluated first)."""
        done = self.run(*args, stdin=stdin)
        assert done.returncode != 0, f"kubectl {' '.join(args)} was allowed:\n{done.stdout}"
        options = (says,) if isinstance(says, str) else says
        assert any(s in done.stderr for s in options), done.stderr
        return done.stderr

    def patch_status(self, name: str, body: dict[str, Any], ns: str = TENANT_NS) -> tuple[int, str]:
        """A merge patch of ``pods/status`` as this identity (kubectl would GET the status first,
        which kube-scheduler's rights do not cover); (HTTP status, body)."""
        from kubernetes import config
        from kubernetes.client import CoreV1Api
        from kubernetes.client.exceptions import ApiException

        api = CoreV1Api(config.new_client_from_config(config_file=str(self.kubeconfig)))
        try:
            resp = api.patch_namespaced_pod_status(name, ns, body, _preload_content=False, _request_timeout=20)
        except ApiException as err:
            return int(err.status), str(err.body)
        return int(resp.status), resp.data.decode()

    def can(self, verb: str, resource: str, ns: str = TENANT_NS) -> bool:
        """``kubectl auth can-i``; ``pods/status`` names a subresource, ``leases/NAME`` an object."""
        what, _, sub = resource.partition("/")
        args = [what, f"--subresource={sub}"] if sub and what == "pods" else [resource]
        return self.run("auth", "can-i", verb, *args, "-n", ns).stdout.strip() == "yes"


def _wait_for_policies(admin: Who) -> None:
    """The API server compiles new admission policies within a second or two, all from one informer:
    wait until one of them (only the extender writes a Node's wanted MIG layout) refuses an admin."""
    until_refused(lambda n: admin.run("patch", "node", "probe", "--type=merge", "-p", json.dumps(
        {"metadata": {"annotations": {"example.com/gpu-slice.mig-layout": f'{{"v":1,"n":{n}}}'}}})),
                  "only gpu-slice's extender may write")


@pytest.fixture(scope="module")
def real() -> Iterator[dict[str, Who]]:
    work = Path(tempfile.mkdtemp(prefix="gsa", dir="/tmp"))
    try:
        run_cluster("up", str(work))
        admin = Who(work / "kubeconfig")
        objs = [o for o in build("nvidia") if o["kind"] not in SKIPPED]
        admin.ok("apply", "--server-side", "--field-manager=gpu-slice-install", "--validate=strict", "-f", "-",
                 stdin=yaml.safe_dump_all(objs))
        for name in ("gpu-1", "gpu-2", "probe"):
            admin.ok("create", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "Node",
                                                           "metadata": {"name": name}}))
        _wait_for_policies(admin)
        # A tenant with broad rights on pods in its namespace: what stops it must be admission.
        admin.ok("create", "namespace", TENANT_NS)
        admin.ok("create", "serviceaccount", "dev", "-n", TENANT_NS)
        admin.ok("apply", "-f", "-", stdin=yaml.safe_dump_all([
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": "pods-all", "namespace": TENANT_NS},
             "rules": [{"apiGroups": [""], "resources": ["pods", "pods/status", "pods/binding"],
                        "verbs": ["get", "list", "create", "update", "patch", "delete"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "dev-pods-all", "namespace": TENANT_NS},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pods-all"},
             "subjects": [{"kind": "ServiceAccount", "name": "dev", "namespace": TENANT_NS}]}]))
        # The plugin's token is bound to its DaemonSet pod's stand-in on gpu-1, as kubelet projects it.
        admin.ok("create", "-n", NAMESPACE, "-f", "-", stdin=json.dumps({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plugin-gpu-1"},
            "spec": {"nodeName": "gpu-1", "serviceAccountName": "gpu-slice-device-plugin",
                     "containers": [{"name": "p", "image": "gpu-slice:test"}]}}))
        who = {"admin": admin}
        for key, account, extra in (("tenant", f"{TENANT_NS}/dev", ()),
                                    ("extender", f"{NAMESPACE}/gpu-slice-extender", ()),
                                    ("scheduler", f"{NAMESPACE}/gpu-slice-scheduler", ()),
                                    ("plugin", f"{NAMESPACE}/gpu-slice-device-plugin",
                                     ("--bound-pod", f"{NAMESPACE}/plugin-gpu-1"))):
            who[key] = Who(Path(run_cluster("sa-kubeconfig", str(work), account, str(work / f"{key}.kubeconfig"),
                                            *extra)))
        yield who
    finally:
        subprocess.run(["python3", str(launcher.CLUSTER), "down", str(work)], capture_output=True, timeout=120,
                       check=False)
        shutil.rmtree(work, ignore_errors=True)


def slice_pod(name: str, *, node: str | None = None, slices: int = 1, notes: dict[str, str] | None = None,
              init: bool = False) -> str:
    container = {"name": "c", "image": "registry.invalid/llm:1",
                 "resources": {"limits": {SLICE: str(slices)}} if slices else {}}
    spec: dict[str, Any] = {"schedulerName": "gpu-slice-scheduler", "containers": [container]}
    if init:
        spec["initContainers"] = [dict(container, name="init")]
        spec["containers"] = [{"name": "c", "image": "registry.invalid/llm:1"}]
    if node:
        spec["nodeName"] = node
    return json.dumps({"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": name, "namespace": TENANT_NS, "annotations": notes or {}}, "spec": spec})


def assignment_for(pod: dict[str, Any], node: str) -> str:
    from datetime import UTC, datetime

    uuid = "GPU-0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9"
    return ann.encode_assignment(ann.Assignment(pod["metadata"]["uid"], node, (uuid,), None, (f"{uuid}::0",),
                                                "fragmentation", datetime(2025, 1, 1, tzinfo=UTC)))


def notes(who: Who, name: str) -> dict[str, str]:
    pod = json.loads(who.ok("get", "pod", name, "-n", TENANT_NS, "-o", "json"))
    return dict(pod["metadata"].get("annotations") or {})


def test_a_tenant_cannot_create_a_pre_bound_slice_pod(real: dict[str, Who]) -> None:
    tenant = real["tenant"]
    says = "cannot be created with spec.nodeName set"
    tenant.refused("create", "-f", "-", stdin=slice_pod("prebound", node="gpu-1"), says=says)
    # Slices in an init container: refused by this policy and by the slice-request policy (either may answer).
    tenant.refused("create", "-f", "-", stdin=slice_pod("prebound-init", node="gpu-1", init=True),
                   says=(says, "only one app container may request slices"))
    tenant.ok("create", "-f", "-", stdin=slice_pod("plain-bound", node="gpu-1", slices=0))  # no slices: not ours
    tenant.ok("create", "-f", "-", stdin=slice_pod("pending"))  # scheduled by gpu-slice-scheduler: fine
    real["admin"].refused("create", "-f", "-", stdin=slice_pod("admin-prebound", node="gpu-1"), says=says)


def test_a_tenant_writes_no_annotation_of_ours_through_any_path(real: dict[str, Who]) -> None:
    tenant, extender, admin = real["tenant"], real["extender"], real["admin"]
    tenant.ok("create", "-f", "-", stdin=slice_pod("victim"))
    pod = json.loads(tenant.ok("get", "pod", "victim", "-n", TENANT_NS, "-o", "json"))
    forged = json.dumps({"metadata": {"annotations": {ann.ASSIGNMENT_KEY: assignment_for(pod, "gpu-1")}}})
    says = "only gpu-slice's extender and device plugin may write"
    # pods: create with ours, patch ours
    tenant.refused("create", "-f", "-", stdin=slice_pod("forged", notes={ann.ALLOCATED_KEY: "{}"}), says=says)
    tenant.refused("patch", "pod", "victim", "-n", TENANT_NS, "--type=merge", "-p", forged, says=says)
    # pods/status: the same patch through the status subresource
    done = tenant.run("patch", "pod", "victim", "-n", TENANT_NS, "--subresource=status", "--type=merge", "-p", forged)
    assert ann.ASSIGNMENT_KEY not in notes(admin, "victim"), done.stderr
    assert done.returncode != 0 and says in done.stderr, done.stderr
    # pods/binding: annotations in a Binding are merged into the pod
    binding = json.dumps({"apiVersion": "v1", "kind": "Binding",
                          "metadata": {"name": "victim", "namespace": TENANT_NS,
                                       "annotations": {ann.ASSIGNMENT_KEY: assignment_for(pod, "gpu-1")}},
                          "target": {"apiVersion": "v1", "kind": "Node", "name": "gpu-1"}})
    path = f"/api/v1/namespaces/{TENANT_NS}/pods/victim/binding"
    tenant.refused("create", "--raw", path, "-f", "-", stdin=binding,
                   says="only gpu-slice's extender may bind with example.com/gpu-slice.* annotations")
    assert ann.ASSIGNMENT_KEY not in notes(admin, "victim")
    # Taking away what the extender wrote is a write too.
    extender.ok("patch", "pod", "victim", "-n", TENANT_NS, "--type=merge", "-p", forged)
    tenant.refused("annotate", "pod", "victim", "-n", TENANT_NS, f"{ann.ASSIGNMENT_KEY}-", says=says)
    assert ann.ASSIGNMENT_KEY in notes(admin, "victim")


def test_the_extender_writes_its_assignment_and_nothing_else(real: dict[str, Who]) -> None:
    tenant, extender = real["tenant"], real["extender"]
    tenant.ok("create", "-f", "-", stdin=slice_pod("mine"))
    pod = json.loads(tenant.ok("get", "pod", "mine", "-n", TENANT_NS, "-o", "json"))
    only = "gpu-slice may change only the annotation example.com/gpu-slice.assignment"
    extender.refused("label", "pod", "mine", "-n", TENANT_NS, "team=x", says=only)
    extender.refused("annotate", "pod", "mine", "-n", TENANT_NS, "other=1", says=only)
    extender.refused("annotate", "pod", "mine", "-n", TENANT_NS, f"{ann.ALLOCATED_KEY}={{}}",
                     says=("the extender may write only example.com/gpu-slice.assignment", only))
    binding = json.dumps({"apiVersion": "v1", "kind": "Binding",
                          "metadata": {"name": "mine", "namespace": TENANT_NS, "uid": pod["metadata"]["uid"],
                                       "annotations": {ann.ASSIGNMENT_KEY: assignment_for(pod, "gpu-2")}},
                          "target": {"apiVersion": "v1", "kind": "Node", "name": "gpu-2"}})
    extender.ok("create", "--raw", f"/api/v1/namespaces/{TENANT_NS}/pods/mine/binding", "-f", "-", stdin=binding)
    bound = json.loads(tenant.ok("get", "pod", "mine", "-n", TENANT_NS, "-o", "json"))
    assert bound["spec"]["nodeName"] == "gpu-2" and ann.ASSIGNMENT_KEY in bound["metadata"]["annotations"]


def test_the_device_plugin_stamps_pods_of_its_own_node_only(real: dict[str, Who]) -> None:
    admin, plugin, extender = real["admin"], real["plugin"], real["extender"]
    for name, node in (("on-1", "gpu-1"), ("on-2", "gpu-2")):
        real["tenant"].ok("create", "-f", "-", stdin=slice_pod(name))
        pod = json.loads(admin.ok("get", "pod", name, "-n", TENANT_NS, "-o", "json"))
        binding = json.dumps({"apiVersion": "v1", "kind": "Binding",
                              "metadata": {"name": name, "namespace": TENANT_NS,
                                           "annotations": {ann.ASSIGNMENT_KEY: assignment_for(pod, node)}},
                              "target": {"apiVersion": "v1", "kind": "Node", "name": node}})
        extender.ok("create", "--raw", f"/api/v1/namespaces/{TENANT_NS}/pods/{name}/binding", "-f", "-",
                    stdin=binding)
    stamp = ann.ALLOCATED_KEY + '={"v":1}'
    plugin.ok("annotate", "pod", "on-1", "-n", TENANT_NS, stamp)
    plugin.refused("annotate", "pod", "on-2", "-n", TENANT_NS, stamp, says="only on pods of its own node")
    plugin.refused("annotate", "pod", "on-1", "-n", TENANT_NS, f"{ann.ASSIGNMENT_KEY}-",
                   says=("the device plugin may write only example.com/gpu-slice.allocated",
                         "gpu-slice may change only the annotation example.com/gpu-slice.allocated"))
    plugin.refused("label", "pod", "on-1", "-n", TENANT_NS, "x=y",
                   says="gpu-slice may change only the annotation example.com/gpu-slice.allocated")


def test_kube_scheduler_and_the_extender_hold_each_their_own_rights(real: dict[str, Who]) -> None:
    scheduler, extender = real["scheduler"], real["extender"]
    lease = "leases/gpu-slice-scheduler"
    assert scheduler.can("update", lease, "kube-system") and not extender.can("update", lease, "kube-system")
    assert extender.can("get", lease, "kube-system")
    assert scheduler.can("update", "pods/status") and not extender.can("update", "pods/status")
    assert scheduler.can("delete", "pods") and not extender.can("delete", "pods")
    assert extender.can("create", "pods/eviction") and extender.can("patch", "pods")
    assert extender.can("list", "poddisruptionbudgets.policy") and extender.can("create", "events")
    assert not extender.can("get", "secrets", NAMESPACE) and not scheduler.can("get", "secrets", NAMESPACE)
    # kube-scheduler's account writes none of gpu-slice's annotations: not by patching pods (RBAC), not
    # through pods/status, which it may update (admission).
    real["tenant"].ok("create", "-f", "-", stdin=slice_pod("sched-try"))
    scheduler.refused("annotate", "pod", "sched-try", "-n", TENANT_NS, f"{ann.ASSIGNMENT_KEY}=x", says="forbidden")
    code, text = scheduler.patch_status("sched-try", {"metadata": {"annotations": {ann.ASSIGNMENT_KEY: "x"}}})
    assert code == 403 and "only gpu-slice's extender and device plugin may write" in text, (code, text)
    code, text = scheduler.patch_status("sched-try", {"status": {"nominatedNodeName": "gpu-1"}})
    assert code == 200, text  # what kube-scheduler does write there
