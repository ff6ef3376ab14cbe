"""Scenario 9: the extender in a shared cluster (issue 47), on the real Kubernetes 1.36 code.

* A tenant whose RBAC lets it create, patch and update pods, their status and their bindings cannot
  create a pre-bound slice pod, write gpu-slice's annotations through any path, or land a pod on a
  tainted or cordoned GPU node, even by calling ``/bind`` itself.
* Shape-only preemption (kube-scheduler counts enough free slices, so it never preempts): on the MIG
  node the 2g instance goes to the urgent pod, its least important holder evicted; on the MPS node,
  whose free slices are split over two GPUs, the holder a PodDisruptionBudget protects is kept and the
  other evicted. The urgent pod lands on the freed slices; every count is 0.
* kube-scheduler's own preemption, two candidate nodes whose victims differ in priority: it evicts on
  the node whose most important victim is the least important, as ``pickOneNodeForPreemption`` reads
  the extender's answer (victims most important first).
* A busy MIG instance is avoided once Prometheus has its series (matched by GPU-instance id).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import yaml

from e2e.harness import (
    ASSIGNMENT,
    CORDON,
    INVENTORY,
    TEST_NS,
    System,
    ann_of,
    clean,
    cluster,
    counts_dict,
    http,
    place_and_remove,
    slice_pod,
    wait,
    wait_placed,
)

pytestmark = pytest.mark.timeout(360)

TENANT = "e2e-tenant7"


def _class(system: System, name: str, value: int, *, preempts: bool = False) -> None:
    system.kubectl("apply", "-f", "-", stdin=json.dumps({
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name}, "value": value,
        "preemptionPolicy": "PreemptLowerPriority" if preempts else "Never", "description": "e2e scenario 9"}))


def _pod(name: str, slices: int, *, isolation: str | None = None, klass: str | None = None) -> dict[str, Any]:
    body = slice_pod(name, slices, isolation=isolation, priority_class=klass, labels={"e2e-pod": name})
    return body


def _create(system: System, bodies: list[dict[str, Any]]) -> None:
    """Create pods, retrying while the Priority admission plugin has not seen a class made a moment ago."""
    for body in bodies:
        wait(f"pod {body['metadata']['name']} created", lambda b=body: _try_create(system, b), 30)


def _try_create(system: System, body: dict[str, Any]) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        system.kube.create_pod(body)
    except ApiException as err:
        if err.status == 403 and "no PriorityClass" in str(err):
            return False
        raise
    return True


def _assignment(system: System, name: str) -> dict[str, Any]:
    pod = system.kube.pod(name)
    assert pod is not None, name
    return dict(json.loads(ann_of(pod)[ASSIGNMENT]))


def _gone(system: System, uids: dict[str, str]) -> set[str]:
    return {n for n, uid in uids.items() if (p := system.kube.pod(n)) is None or p["metadata"]["uid"] != uid}


def _audit(system: System, record: dict[str, Any]) -> None:
    counts = system.settle_and_audit()
    record["counts"] = counts_dict(counts)
    assert not counts.bad(), counts.problems


# --------------------------------------------------------------------------- the tenant


@pytest.fixture
def tenant(system: System) -> Iterator[Any]:
    """kubectl as a tenant service account with broad rights on pods, their status and bindings."""
    kc = system.work / "tenant7.kubeconfig"
    system.kubectl("create", "serviceaccount", TENANT, "-n", TEST_NS, check=False)
    system.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all([
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": TENANT, "namespace": TEST_NS},
         "rules": [{"apiGroups": [""], "resources": ["pods", "pods/status", "pods/binding"],
                    "verbs": ["get", "list", "create", "update", "patch", "delete"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": TENANT, "namespace": TEST_NS},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": TENANT},
         "subjects": [{"kind": "ServiceAccount", "name": TENANT, "namespace": TEST_NS}]}]))
    if not kc.exists():
        cluster("sa-kubeconfig", str(system.work), f"{TEST_NS}/{TENANT}", str(kc))

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["kubectl", "--kubeconfig", str(kc), *args], input=stdin, capture_output=True, text=True,
                              timeout=60, check=False)

    yield run


def test_a_tenant_cannot_steer_slices(system: System, tenant: Any, record: dict[str, Any]) -> None:
    refused: dict[str, str] = {}
    # 1. A slice pod created already bound: no scheduler chose its slices.
    prebound = slice_pod("t-prebound", 1)
    prebound["spec"]["nodeName"] = "gpu-mix"
    done = tenant("create", "-f", "-", stdin=json.dumps(prebound))
    assert done.returncode != 0 and "cannot be created with spec.nodeName set" in done.stderr, done.stderr
    refused["pre-bound pod"] = done.stderr.strip()[-120:]
    # A pod no scheduler will pick up (another scheduler's name), to aim at.
    target = slice_pod("t-target", 1)
    target["spec"]["schedulerName"] = "e2e-nobody"
    assert tenant("create", "-f", "-", stdin=json.dumps(target)).returncode == 0
    pod = system.kube.pod("t-target")
    assert pod is not None
    forged = {"v": 1, "podUID": pod["metadata"]["uid"], "node": "gpu-mix", "gpus": ["GPU-forged"], "instance": None,
              "sliceIds": ["GPU-forged::0"], "policy": "fragmentation", "scores": {}, "time": "2026-01-01T00:00:00Z"}
    patch = json.dumps({"metadata": {"annotations": {ASSIGNMENT: json.dumps(forged)}}})
    # 2. Our annotations through pods, pods/status and pods/binding.
    for label, args in (("pods", ("patch", "pod", "t-target", "--type=merge", "-p", patch)),
                        ("pods/status", ("patch", "pod", "t-target", "--subresource=status", "--type=merge",
                                         "-p", patch))):
        done = tenant(*args)
        assert done.returncode != 0 and "may write example.com/gpu-slice" in done.stderr, (label, done.stderr)
        refused[label] = done.stderr.strip()[-120:]
    binding = {"apiVersion": "v1", "kind": "Binding",
               "metadata": {"name": "t-target", "namespace": TEST_NS, "annotations": {ASSIGNMENT: json.dumps(forged)}},
               "target": {"apiVersion": "v1", "kind": "Node", "name": "gpu-mix"}}
    done = tenant("create", "--raw", f"/api/v1/namespaces/{TEST_NS}/pods/t-target/binding", "-f", "-",
                  stdin=json.dumps(binding))
    assert done.returncode != 0 and "only gpu-slice's extender may bind" in done.stderr, done.stderr
    refused["pods/binding"] = done.stderr.strip()[-120:]
    pod = system.kube.pod("t-target")
    assert pod is not None and not pod["spec"].get("nodeName") and ASSIGNMENT not in ann_of(pod)

    # 3. A tainted node and a cordoned node: /bind refuses them, whoever calls it.
    leader = system.wait_leader()
    system.kube.patch_node("gpu-mix", {"spec": {"taints": [{"key": "team", "value": "other", "effect": "NoSchedule"}]}})
    system.kube.patch_node("gpu-mps", {"spec": {"unschedulable": True}})
    try:
        time.sleep(2)  # the extender's watch sees both
        for node, says in (("gpu-mix", "taint team=other:NoSchedule"), ("gpu-mps", "cordoned")):
            body = json.dumps({"PodName": "t-target", "PodNamespace": TEST_NS, "PodUID": pod["metadata"]["uid"],
                               "Node": node}).encode()
            status, raw = http("POST", f"{leader.url}/bind", body, headers={"Content-Type": "application/json"})
            assert status == 200 and says in json.loads(raw)["Error"], (node, raw)
            refused[f"/bind to {node}"] = json.loads(raw)["Error"][:120]
        pod = system.kube.pod("t-target")
        assert pod is not None and not pod["spec"].get("nodeName")
        # The scheduler places the tenant's ordinary slice pod where it may run: gpu-mig.
        assert tenant("create", "-f", "-", stdin=json.dumps(slice_pod("t-ok", 1))).returncode == 0
        placed = wait_placed(system, ["t-ok"])["t-ok"]
        assert placed["spec"]["nodeName"] == "gpu-mig", placed["spec"]["nodeName"]
    finally:
        system.kube.patch_node("gpu-mix", {"spec": {"taints": None}})
        system.kube.patch_node("gpu-mps", {"spec": {"unschedulable": None}})
    record.update(refused=refused)
    system.kube.delete_pod("t-target")
    _audit(system, record)
    clean(system)


# --------------------------------------------------------------------------- shape-only preemption


def test_shape_only_preemption_on_a_mig_node(system: System, record: dict[str, Any]) -> None:
    """gpu-mig's 2g instances are held by priority-0 and priority-5 pods, its 3g and 4g by pods the
    urgent one may not preempt; its three 1g instances are free. A 2-slice MIG pod fits by count,
    by shape nowhere: the extender evicts the priority-0 holder and the pod lands on its instance."""
    _class(system, "e2e7-five", 5)
    _class(system, "e2e7-high", 1000)
    _class(system, "e2e7-urgent", 100, preempts=True)
    _create(system, [_pod("m-low", 2, isolation="mig"), _pod("m-five", 2, isolation="mig", klass="e2e7-five"),
                     _pod("m-3", 3, isolation="mig", klass="e2e7-high"),
                     _pod("m-4", 4, isolation="mig", klass="e2e7-high")])
    placed = wait_placed(system, ["m-low", "m-five", "m-3", "m-4"])
    uids = {n: p["metadata"]["uid"] for n, p in placed.items()}
    low_instance = _assignment(system, "m-low")["instance"]
    assert all(_assignment(system, n)["node"] == "gpu-mig" for n in placed)
    leader = system.wait_leader()
    evicted = 'gpu_slice_extender_own_preemptions_total{outcome="evicted"}'
    before = system.metric(leader.ops_url, evicted)
    t0 = time.monotonic()
    _create(system, [_pod("m-urgent", 2, isolation="mig", klass="e2e7-urgent")])
    urgent = wait_placed(system, ["m-urgent"], timeout=120)["m-urgent"]
    took = time.monotonic() - t0
    a = json.loads(ann_of(urgent)[ASSIGNMENT])
    gone = _gone(system, uids)
    record.update(victims=sorted(gone), preempt_and_bind_s=round(took, 1), instance=a["instance"])
    assert gone == {"m-low"}, gone
    assert a["instance"] == low_instance, (a, low_instance)
    assert system.metric(leader.ops_url, evicted) >= before + 1  # the extender preempted, not kube-scheduler
    events = [e for e in system.kube.events(TEST_NS) if e.get("reason") == "Preempting"
              and e["involvedObject"].get("name") == "m-urgent"]
    assert events and "m-low" in events[0]["message"], events
    _audit(system, record)
    clean(system)


def test_shape_only_preemption_on_split_mps_gpus_keeps_a_budget(system: System, record: dict[str, Any]) -> None:
    """gpu-mps's two MPS GPUs each run a 5-slice pod (2 free on each: 4 by count); gpu-mix's MPS GPU is
    cordoned. A 3-slice MPS pod fits by count, by shape nowhere. The priority-0 holder is the least
    important, but a PodDisruptionBudget protects it: the priority-10 holder is evicted instead."""
    _class(system, "e2e7-ten", 10)
    _class(system, "e2e7-urgent", 100, preempts=True)
    inv = json.loads(ann_of(system.kube.node("gpu-mix"))[INVENTORY])
    a100 = next(g["uuid"] for g in inv["gpus"] if g["mode"] == "mps")
    system.kube.patch_node("gpu-mix", {"metadata": {"annotations": {CORDON: a100}}})
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "e2e7-guard",
                                                                                "namespace": TEST_NS},
           "spec": {"minAvailable": 1, "selector": {"matchLabels": {"e2e-pod": "s-guarded"}}}}
    try:
        _create(system, [_pod("s-guarded", 5, isolation="mps")])
        wait_placed(system, ["s-guarded"])
        _create(system, [_pod("s-ten", 5, isolation="mps", klass="e2e7-ten")])
        placed = wait_placed(system, ["s-guarded", "s-ten"])
        where = {n: _assignment(system, n) for n in placed}
        assert {w["node"] for w in where.values()} == {"gpu-mps"}
        assert where["s-guarded"]["gpus"] != where["s-ten"]["gpus"], where
        uids = {n: p["metadata"]["uid"] for n, p in placed.items()}
        system.kubectl("apply", "-f", "-", stdin=json.dumps(pdb))

        def budget_counted() -> bool:
            got = json.loads(system.kubectl("get", "pdb", "e2e7-guard", "-n", TEST_NS, "-o", "json").stdout)
            status = got.get("status") or {}
            return status.get("observedGeneration") == got["metadata"]["generation"] and \
                status.get("disruptionsAllowed") == 0 and status.get("currentHealthy") == 1
        wait("the disruption controller counting the budget", budget_counted, 60)
        time.sleep(2)  # the extender's watch sees the budget's status
        _create(system, [_pod("s-urgent", 3, isolation="mps", klass="e2e7-urgent")])
        urgent = wait_placed(system, ["s-urgent"], timeout=120)["s-urgent"]
        a = json.loads(ann_of(urgent)[ASSIGNMENT])
        gone = _gone(system, uids)
        record.update(victims=sorted(gone), kept_by_budget="s-guarded")
        assert gone == {"s-ten"}, gone
        assert a["gpus"] == where["s-ten"]["gpus"], (a, where)
        freed = set(where["s-ten"]["sliceIds"])
        assert len(set(a["sliceIds"]) & freed) >= 1, (a["sliceIds"], freed)
        _audit(system, record)
    finally:
        system.kubectl("delete", "pdb", "e2e7-guard", "-n", TEST_NS, "--ignore-not-found", check=False)
        system.kube.patch_node("gpu-mix", {"metadata": {"annotations": {CORDON: None}}})
    clean(system)


def test_kube_scheduler_preempts_where_the_victims_matter_least(system: System, record: dict[str, Any]) -> None:
    """No node fits a 7-slice MPS pod by count. gpu-mps would lose a priority-50 pod, gpu-mix a priority-60
    and a priority-10 pod: kube-scheduler reads the most important victim first and evicts on gpu-mps."""
    _class(system, "e2e7-ten", 10)
    _class(system, "e2e7-fifty", 50)
    _class(system, "e2e7-sixty", 60)
    _class(system, "e2e7-high", 1000)
    _class(system, "e2e7-urgent", 100, preempts=True)
    inv = json.loads(ann_of(system.kube.node("gpu-mix"))[INVENTORY])
    a100 = next(g["uuid"] for g in inv["gpus"] if g["mode"] == "mps")
    system.kube.patch_node("gpu-mix", {"metadata": {"annotations": {CORDON: a100}}})  # x1 and x2 on gpu-mps
    try:
        time.sleep(2)
        _create(system, [_pod("k-x1", 7, isolation="mps", klass="e2e7-fifty"),
                         _pod("k-x2", 7, isolation="mps", klass="e2e7-fifty")])
        wait_placed(system, ["k-x1", "k-x2"])
    finally:
        system.kube.patch_node("gpu-mix", {"metadata": {"annotations": {CORDON: None}}})
    time.sleep(2)
    _create(system, [_pod("k-y4", 4, isolation="mps", klass="e2e7-sixty"),
                     _pod("k-y3", 3, isolation="mps", klass="e2e7-ten")])
    wait_placed(system, ["k-y4", "k-y3"])
    _create(system, [_pod("k-w7", 7, klass="e2e7-high")])
    placed = wait_placed(system, ["k-x1", "k-x2", "k-y4", "k-y3", "k-w7"])
    where = {n: _assignment(system, n)["node"] for n in placed}
    assert where == {"k-x1": "gpu-mps", "k-x2": "gpu-mps", "k-y4": "gpu-mix", "k-y3": "gpu-mix",
                     "k-w7": "gpu-mix"}, where
    uids = {n: p["metadata"]["uid"] for n, p in placed.items()}
    _create(system, [_pod("k-urgent", 7, isolation="mps", klass="e2e7-urgent")])
    urgent = wait_placed(system, ["k-urgent"], timeout=120)["k-urgent"]
    gone = _gone(system, uids)
    record.update(victims=sorted(gone), node=urgent["spec"]["nodeName"])
    assert len(gone) == 1 and gone <= {"k-x1", "k-x2"}, gone
    assert urgent["spec"]["nodeName"] == "gpu-mps"
    _audit(system, record)
    clean(system)


# --------------------------------------------------------------------------- a busy MIG instance


class _Dcgm:
    """A dcgm-exporter stand-in on 127.0.0.1 for gpu-mig's MIG instances, as dcgm-exporter 4.8 labels
    them: ``busy`` maps an instance to the activity a process outside Kubernetes keeps it at."""

    def __init__(self, instances: dict[str, tuple[str, int, str]]) -> None:
        self.instances = instances
        self.busy: dict[str, float] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                body = outer.render()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()

    def render(self) -> bytes:
        lines = []
        for name in ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE"):
            lines.append(f"# TYPE {name} gauge")
            for uuid, (gpu, gi, profile) in sorted(self.instances.items()):
                lines.append(f'{name}{{gpu="0",UUID="{gpu}",device="nvidia0",GPU_I_PROFILE="{profile}",'
                             f'GPU_I_ID="{gi}",Hostname="gpu-mig"}} {self.busy.get(uuid, 0.0)}')
        return ("\n".join(lines) + "\n").encode()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _scrape_with(system: System, dcgm: _Dcgm | None) -> None:
    """Prometheus' configuration with gpu-mig's DCGM series from ``dcgm`` instead of its plugin (None:
    as the harness writes it)."""
    if dcgm is None:
        system.reload_prometheus()
        return
    cfg = yaml.safe_load((system.work / "prometheus.yml").read_text())
    plugins = cfg["scrape_configs"][0]
    plugins["static_configs"] = [c for c in plugins["static_configs"] if c["labels"]["node"] != "gpu-mig"]
    cfg["scrape_configs"].append({"job_name": "dcgm-gpu-mig", "static_configs": [
        {"targets": [dcgm.target], "labels": {"node": "gpu-mig"}}]})
    (system.work / "prometheus.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    status, body = http("POST", f"{system.prometheus_url}/-/reload")
    assert status == 200, body


def test_a_busy_mig_instance_is_avoided_once_prometheus_has_its_series(system: System,
                                                                        record: dict[str, Any]) -> None:
    """gpu-mig has three 1g instances. In turn, each is the only one left idle while DCGM shows the other
    two saturated (a process outside Kubernetes, say): a 1-slice MIG probe lands on the idle one every
    time (by chance: one time in 27)."""
    inv = json.loads(ann_of(system.kube.node("gpu-mig"))[INVENTORY])
    gi = {i["uuid"]: (g["uuid"], i["gpuInstanceId"], i["profile"]) for g in inv["gpus"] for i in g["instances"]}
    assert all(isinstance(v[1], int) for v in gi.values()), "the inventory names every GPU-instance id"
    small = sorted(u for u, v in gi.items() if v[2] == "1g.10gb")
    assert len(small) == 3, gi
    dcgm = _Dcgm(gi)
    landed: dict[str, str] = {}
    try:
        _scrape_with(system, dcgm)
        for n, idle in enumerate(small):
            dcgm.busy = {u: 0.95 for u in small if u != idle}

            def scraped(idle: str = idle) -> bool:
                for uuid in small:
                    gpu, i, _ = gi[uuid]
                    query = f'DCGM_FI_PROF_GR_ENGINE_ACTIVE{{GPU_I_ID="{i}",UUID="{gpu}"}}'
                    status, raw = http("GET", f"{system.prometheus_url}/api/v1/query?query={query}")
                    result = json.loads(raw)["data"]["result"] if status == 200 else []
                    if len(result) != 1 or (float(result[0]["value"][1]) > 0.9) != (uuid != idle):
                        return False
                return True
            wait("Prometheus holding the stand-in's series (and only those)", scraped, 60)
            time.sleep(5)  # the extender's signal refresher runs every 2 s here
            probe = place_and_remove(system, slice_pod(f"b-probe-{n}", 1, isolation="mig"))
            landed[idle] = json.loads(ann_of(probe)[ASSIGNMENT])["instance"]
        record.update(idle_then_landed=landed, gpu_instance_ids={u: gi[u][1] for u in small})
        assert all(landed[u] == u for u in small), landed
    finally:
        _scrape_with(system, None)
        dcgm.stop()
    _audit(system, record)
    clean(system)
