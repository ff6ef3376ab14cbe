"""The extender under the real kube-scheduler 1.36 and kube-apiserver, with the shipped config (DESIGN 8).

``../shared/k8s`` (beside the repository) starts etcd, kube-apiserver and kube-scheduler on
loopback. The GPU nodes are plain Node objects from ``gpu-slice fake-cluster`` (their allocatable
set through the status subresource, as kubelet would post it); no kubelet runs, so pods are only
scheduled and bound, never started. ``gpu-slice extender`` runs as a process against the API
server, and kube-scheduler runs ``manifests/scheduler/scheduler-config.yaml`` with only the
extender's port changed. When this test runs as root, kube-scheduler gets its own host name
(``cluster scheduler --hostname``) and the extender fences ``/bind`` on the scheduler's Lease with
that identity; otherwise the extender runs with ``--no-fencing``.

What is checked, through the real protocol only: kube-scheduler called our verbs, every slice pod
is bound to the node its assignment names, no GPU is overbooked, and a pod no GPU can take stays
Pending with the extender's reason in its FailedScheduling event.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import k8s_launcher as launcher
from tests.k8s_launcher import run_cluster

REPO = Path(__file__).resolve().parents[2]
K8S, CLUSTER = launcher.K8S, launcher.CLUSTER
SHIPPED_CONFIG = REPO / "manifests" / "scheduler" / "scheduler-config.yaml"

RESOURCE = "example.com/gpu-slice"
ASSIGNMENT = "example.com/gpu-slice.assignment"
INVENTORY = "example.com/gpu-slice.inventory"
SCHEDULER_NAME = "gpu-slice-scheduler"
LEASE = "kube-system/gpu-slice-scheduler"
HOSTNAME = "gpu-slice-sched-0"
NS = "default"

pytestmark = [
    pytest.mark.skipif(not CLUSTER.is_file(), reason=f"no real control plane: {CLUSTER} is absent "
                                                     "(the shared k8s kit beside the repository)"),
    pytest.mark.timeout(240),
]


# ---- plumbing ----------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cluster(*args: str, timeout: float = 180) -> str:
    return run_cluster(*args, timeout=timeout)


def _wait(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")
    except OSError:
        return 0, ""


def _fake_nodes(*args: str) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "gpuslice_cli", "fake-cluster", *args], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    return [i for i in yaml.safe_load(out)["items"] if i["kind"] == "Node"]


class Api:
    """A thin raw-JSON client over the kubernetes package (only what this test needs)."""

    def __init__(self, kubeconfig: str) -> None:
        from kubernetes import client, config

        self.client = config.new_client_from_config(config_file=kubeconfig)
        self.core = client.CoreV1Api(self.client)

    def _json(self, resp: Any) -> Any:
        try:
            return json.loads(resp.data)
        finally:
            resp.release_conn()

    def create_node(self, node: dict[str, Any]) -> None:
        meta = node["metadata"]
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": meta["name"], "labels": meta["labels"], "annotations": meta["annotations"]},
                "spec": node.get("spec") or {}}
        self._json(self.core.create_node(body, _preload_content=False))
        # What kubelet posts: capacity, allocatable (the device plugin's slices among them), Ready.
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = {"capacity": node["status"]["capacity"], "allocatable": node["status"]["allocatable"],
                  "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                  "message": "plain Node object for the extender test",
                                  "lastHeartbeatTime": now, "lastTransitionTime": now}]}
        self._json(self.core.patch_node_status(meta["name"], {"status": status}, _preload_content=False))

    def node(self, name: str) -> dict[str, Any]:
        return dict(self._json(self.core.read_node(name, _preload_content=False)))

    def create_pod(self, name: str, slices: int, annotations: dict[str, str] | None = None,
                   priority_class: str | None = None) -> None:
        body = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": NS, "annotations": annotations or {}},
                "spec": {"schedulerName": SCHEDULER_NAME, "terminationGracePeriodSeconds": 0,
                         **({"priorityClassName": priority_class} if priority_class else {}),
                         "containers": [{"name": "server", "image": "registry.invalid/llm-server:1",
                                         "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                                                       "limits": {RESOURCE: str(slices)}}}]}}
        self._json(self.core.create_namespaced_pod(NS, body, _preload_content=False))

    def create_pod_once_admitted(self, name: str, slices: int, priority_class: str) -> None:
        """:meth:`create_pod`, retried while kube-apiserver's Priority admission plugin answers 403 "no
        PriorityClass": it reads classes from an informer, which may not have seen one created a
        moment ago (the test's own class), so the first try can race it."""
        from kubernetes.client.exceptions import ApiException

        def attempt() -> bool:
            try:
                self.create_pod(name, slices, priority_class=priority_class)
            except ApiException as err:
                if err.status == 403 and "no PriorityClass" in str(err):
                    return False
                raise
            return True

        _wait(f"admission to know PriorityClass {priority_class}", attempt, 15)

    def pods(self) -> list[dict[str, Any]]:
        return list(self._json(self.core.list_namespaced_pod(NS, _preload_content=False))["items"])

    def events_for(self, pod: str) -> list[dict[str, Any]]:
        body = self._json(self.core.list_namespaced_event(NS, field_selector=f"involvedObject.name={pod}",
                                                          _preload_content=False))
        return list(body["items"])

    def create_priority_class(self, name: str, value: int) -> None:
        from kubernetes import client

        body = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": name},
                "value": value, "preemptionPolicy": "PreemptLowerPriority"}
        self._json(client.SchedulingV1Api(self.client).create_priority_class(body, _preload_content=False))

    def lease_holder(self) -> str:
        from kubernetes import client

        ns, name = LEASE.split("/")
        try:
            lease = self._json(client.CoordinationV1Api(self.client).read_namespaced_lease(
                name, ns, _preload_content=False))
        except Exception:
            return ""
        return str((lease.get("spec") or {}).get("holderIdentity") or "")


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _request_counts(metrics_text: str) -> dict[str, float]:
    """``gpu_slice_extender_requests_total`` summed per verb over outcomes."""
    counts: dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = re.match(r'gpu_slice_extender_requests_total\{([^}]*)\}\s+(\S+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            counts[labels["verb"]] = counts.get(labels["verb"], 0.0) + float(m.group(2))
    return counts


# ---- the cluster -------------------------------------------------------------------------------------

class Setup:
    def __init__(self, work: Path, api: Api, port: int, fencing: bool, extender_log: Path,
                 gpus: dict[str, dict[str, set[str]]], ops_port: int) -> None:
        self.work, self.api, self.port, self.fencing, self.extender_log, self.gpus = (
            work, api, port, fencing, extender_log, gpus)
        self.ops_port = ops_port

    def metrics(self) -> dict[str, float]:
        status, text = _http_get(f"http://127.0.0.1:{self.ops_port}/metrics")
        assert status == 200, text
        return _request_counts(text)

    def logs(self) -> str:
        parts = [f"--- extender log ---\n{self.extender_log.read_text(errors='replace')[-4000:]}"]
        sched = self.work / "logs" / "scheduler.log"
        if sched.is_file():
            parts.append(f"--- kube-scheduler log ---\n{sched.read_text(errors='replace')[-4000:]}")
        return "\n".join(parts)


@pytest.fixture(scope="module")
def real() -> Iterator[Setup]:
    # Short: the launcher's unix sockets and pid files live under it.
    work = Path(tempfile.mkdtemp(prefix="gsx-"))
    extender: subprocess.Popen[bytes] | None = None
    log_file = None
    try:
        _cluster("up", str(work))
        kubeconfig = str(work / "kubeconfig")
        api = Api(kubeconfig)

        # Three MPS nodes of 4 GPUs (28 slices each) and one node with 2 whole-mode GPUs (14 slices):
        # a 14-slice pod can only go to the latter, a 21-slice pod fits NodeResourcesFit on the MPS
        # nodes but no GPU layout anywhere.
        nodes = (_fake_nodes("--nodes", "3", "--gpus-per-node", "4", "--mode", "mps", "--seed", "1",
                             "--node-prefix", "mps")
                 + _fake_nodes("--nodes", "1", "--gpus-per-node", "2", "--mode", "whole", "--seed", "2",
                               "--node-prefix", "whole"))
        gpus: dict[str, dict[str, set[str]]] = {}
        for node in nodes:
            api.create_node(node)
            inv = json.loads(node["metadata"]["annotations"][INVENTORY])
            gpus[node["metadata"]["name"]] = {g["uuid"]: {f"{g['uuid']}::{n}" for n in range(g["slices"])}
                                               for g in inv["gpus"]}

        fencing = hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("unshare") is not None
        port, ops_port = _free_port(), _free_port()
        log_path = work / "extender.log"
        log_file = open(log_path, "wb")  # noqa: SIM115 - closed in finally
        argv = [sys.executable, "-m", "gpuslice_cli", "extender", "--kubeconfig", kubeconfig, "--port", str(port),
                "--ops-address", "127.0.0.1", "--ops-port", str(ops_port), "--lease", LEASE, "--identity", HOSTNAME]
        if not fencing:
            argv.append("--no-fencing")
        extender = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO)

        def ready() -> bool:
            assert extender is not None
            if extender.poll() is not None:
                raise AssertionError(f"extender exited ({extender.returncode}):\n{log_path.read_text()[-3000:]}")
            return _http_get(f"http://127.0.0.1:{ops_port}/readyz")[0] == 200
        _wait("extender /readyz", ready, 30)

        # The shipped config, with only the extender's port changed.
        config = yaml.safe_load(SHIPPED_CONFIG.read_text())
        (ext,) = config["extenders"]
        assert ext["urlPrefix"] == "http://127.0.0.1:8888"
        ext["urlPrefix"] = f"http://127.0.0.1:{port}"
        sched_config = work / "scheduler-config.yaml"
        sched_config.write_text(yaml.safe_dump(config, sort_keys=False))
        _cluster("scheduler", str(work), str(sched_config), *(["--hostname", HOSTNAME] if fencing else []))
        if fencing:
            _wait("kube-scheduler to take the Lease", lambda: api.lease_holder().startswith(HOSTNAME + "_"), 30)
        yield Setup(work, api, port, fencing, log_path, gpus, ops_port)
    finally:
        try:
            _stop(extender)
        finally:
            try:
                subprocess.run([sys.executable, str(CLUSTER), "down", str(work)], capture_output=True, timeout=60,
                               check=False)
            finally:
                if log_file is not None:
                    log_file.close()
                shutil.rmtree(work, ignore_errors=True)


# ---- the test ----------------------------------------------------------------------------------------

SIZES = (14, 1, 2, 3, 7, 1, 2, 3, 7)  # the whole-GPU pod first: it has one node that can take it


def test_real_scheduler_places_slice_pods_through_the_extender(real: Setup) -> None:
    api = real.api
    for i, k in enumerate(SIZES):
        api.create_pod(f"slice-{i}-{k}", k)
    api.create_pod("too-many-slices", 21)  # NodeResourcesFit passes the MPS nodes (28); no GPU layout fits
    api.create_pod("too-much-memory", 1, {"example.com/gpu-memory": "200Gi"})  # no 200 GiB GPU here

    def all_bound() -> list[dict[str, Any]] | None:
        pods = [p for p in api.pods() if p["metadata"]["name"].startswith("slice-")]
        return pods if len(pods) == len(SIZES) and all(p["spec"].get("nodeName") for p in pods) else None

    try:
        pods = _wait("every slice pod bound", all_bound, 60)
    except AssertionError as err:
        pending = [p["metadata"]["name"] for p in api.pods() if not p["spec"].get("nodeName")]
        raise AssertionError(f"{err}; pending: {pending}\n{real.logs()}") from None

    # kube-scheduler asked our verbs (nodeCacheCapable: the node names only) and bound through us.
    counts = real.metrics()
    assert counts.get("filter", 0) > 0 and counts.get("bind", 0) > 0, (counts, real.logs())
    # No prioritize assertion: the narrowed filter hands kube-scheduler exactly one node
    # (gpuslice.decision.NarrowConfig.max_nodes is 1), and kube-scheduler skips scoring, extenders
    # included, when one feasible node is left (schedule_one.go). /prioritize is therefore not
    # reachable through kube-scheduler with this extender; its wire form is tested in test_wire.py.

    # Each pod sits where its assignment says, on ids its node's inventory has, and no id twice.
    used: dict[tuple[str, str], set[str]] = {}
    for pod in pods:
        name, node = pod["metadata"]["name"], pod["spec"]["nodeName"]
        slices = int(pod["spec"]["containers"][0]["resources"]["limits"][RESOURCE])
        raw = (pod["metadata"].get("annotations") or {}).get(ASSIGNMENT)
        assert raw, f"{name} is bound to {node} without an assignment"
        a = json.loads(raw)
        assert a["v"] == 1 and a["node"] == node, (name, node, a)
        assert a["podUID"] == pod["metadata"]["uid"], (name, a)
        ids = a["sliceIds"]
        assert len(ids) == len(set(ids)) == slices, (name, slices, ids)
        inventory = real.gpus[node]
        for gpu in a["gpus"]:
            assert gpu in inventory, (name, gpu, sorted(inventory))
        for sid in ids:
            gpu = sid.split("::")[0]
            assert gpu in a["gpus"] and sid in inventory[gpu], (name, sid, a["gpus"])
            held = used.setdefault((node, gpu), set())
            assert sid not in held, f"slice {sid} given twice (second: {name})"
            held.add(sid)
        if slices == 14:
            assert node.startswith("whole-") and len(a["gpus"]) == 2, (name, node, a)
        else:
            assert len(a["gpus"]) == 1, (name, a)
    for (node, gpu), held in used.items():
        assert held <= real.gpus[node][gpu], (node, gpu)

    # What kube-scheduler counted matches: no node past its allocatable slices.
    per_node: dict[str, int] = {}
    for pod in pods:
        per_node[pod["spec"]["nodeName"]] = per_node.get(pod["spec"]["nodeName"], 0) + int(
            pod["spec"]["containers"][0]["resources"]["limits"][RESOURCE])
    for node, n in per_node.items():
        assert n <= int(api.node(node)["status"]["allocatable"][RESOURCE]), (node, n)

    # The impossible pods stay Pending, and the event says why in the extender's words.
    # (the extender's own reasons, gpuslice/reasons.py; kube-scheduler's would be "Insufficient ...")
    expect = {"too-many-slices": r"a 21-slice pod needs 3 whole-mode GPUs",
              "too-much-memory": r"no GPU or MIG instance here gives .*GPU memory to a 1-slice pod"}
    for pod_name, words in expect.items():
        def failed(pod_name: str = pod_name) -> list[str]:
            return [e.get("message") or "" for e in api.events_for(pod_name) if e.get("reason") == "FailedScheduling"]
        try:
            messages = _wait(f"a FailedScheduling event for {pod_name}", failed, 30)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{real.logs()}") from None
        assert any(re.search(words, m) for m in messages), "\n".join([pod_name, *messages])
    for pod in api.pods():
        if pod["metadata"]["name"] in expect:
            assert not pod["spec"].get("nodeName"), pod["metadata"]["name"]
            assert pod["status"].get("phase") == "Pending"
            assert ASSIGNMENT not in (pod["metadata"].get("annotations") or {})

    if real.fencing:  # binds were fenced on the Lease kube-scheduler really holds
        assert api.lease_holder().startswith(HOSTNAME + "_")


def test_real_scheduler_preempts_through_the_extender(real: Setup) -> None:
    """A high-priority 14-slice pod takes the whole-GPU node: kube-scheduler asks /preempt, evicts the
    victim the extender names, and the preemptor is bound there through /bind with a fresh assignment."""
    api = real.api
    whole = next(n for n in real.gpus if n.startswith("whole-"))

    def on_whole() -> list[dict[str, Any]]:
        return [p for p in api.pods() if p["spec"].get("nodeName") == whole and not p["metadata"].get(
            "deletionTimestamp")]
    if not on_whole():  # run alone: fill the node first
        api.create_pod("filler-14", 14)
        _wait("the filler bound", on_whole, 30)
    (victim,) = on_whole()
    before = real.metrics().get("preempt", 0)
    api.create_priority_class("gpu-slice-test-high", 1000)
    api.create_pod_once_admitted("urgent-14", 14, "gpu-slice-test-high")

    def placed() -> dict[str, Any] | None:
        got = [p for p in api.pods() if p["metadata"]["name"] == "urgent-14"]
        return got[0] if got and got[0]["spec"].get("nodeName") else None
    try:
        pod = _wait("the preemptor bound", placed, 45)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{real.logs()}") from None
    assert real.metrics().get("preempt", 0) > before
    assert pod["spec"]["nodeName"] == whole
    names = {p["metadata"]["name"] for p in api.pods()}
    assert victim["metadata"]["name"] not in names, "the victim was not evicted"
    a = json.loads(pod["metadata"]["annotations"][ASSIGNMENT])
    assert a["node"] == whole and a["podUID"] == pod["metadata"]["uid"]
    assert set(a["sliceIds"]) == set().union(*real.gpus[whole].values())


def test_one_binding_carries_the_assignment_on_the_real_apiserver(real: Setup) -> None:
    """The contract ``/bind`` rests on, checked on kube-apiserver 1.36 through the extender's own binder:
    the binding subresource merges the Binding's ``metadata.annotations`` into the pod with
    ``spec.nodeName`` in one 201; its UID is a precondition (a 409 that writes nothing); a second
    Binding is refused and leaves the first one's annotation as it was."""
    from kubernetes import client

    from extender.binder import ApiBinder
    from extender.errors import KubeApiError

    api = real.api
    node = sorted(real.gpus)[0]
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bind-contract", "namespace": NS},
            "spec": {"schedulerName": "nobody-schedules-this",
                     "containers": [{"name": "c", "image": "registry.invalid/x:1"}]}}
    created = api._json(api.core.create_namespaced_pod(NS, body, _preload_content=False))
    uid = created["metadata"]["uid"]
    binder = ApiBinder(api.client, timeout_s=10.0)
    watch = client.CoreV1Api(api.client).list_namespaced_pod(
        NS, watch=True, field_selector="metadata.name=bind-contract", resource_version=created["metadata"][
            "resourceVersion"], timeout_seconds=3, _preload_content=False)

    with pytest.raises(KubeApiError) as refused:
        binder.bind(NS, "bind-contract", "00000000-0000-0000-0000-000000000000", node, {ASSIGNMENT: "{\"v\":1}"})
    assert refused.value.status == 409 and "Precondition failed" in str(refused.value)
    pod = binder.read_pod(NS, "bind-contract")
    assert pod is not None and not pod["spec"].get("nodeName") and ASSIGNMENT not in (
        pod["metadata"].get("annotations") or {})

    binder.bind(NS, "bind-contract", uid, node, {ASSIGNMENT: "{\"v\":1,\"first\":true}"})
    pod = binder.read_pod(NS, "bind-contract")
    assert pod is not None and pod["spec"]["nodeName"] == node
    assert pod["metadata"]["annotations"][ASSIGNMENT] == "{\"v\":1,\"first\":true}"
    assert {"type": "PodScheduled", "status": "True"}.items() <= next(
        c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled").items()

    with pytest.raises(KubeApiError) as again:
        binder.bind(NS, "bind-contract", uid, node, {ASSIGNMENT: "{\"v\":1,\"second\":true}"})
    assert again.value.status == 409 and "already assigned" in str(again.value)
    assert (binder.read_pod(NS, "bind-contract") or {})["metadata"]["annotations"][ASSIGNMENT] == (
        "{\"v\":1,\"first\":true}")

    # One write: the watch saw exactly one change, which carried the node and the annotation together.
    events = [json.loads(line) for line in watch.read().splitlines() if line.strip()]
    watch.release_conn()
    changes = [e for e in events if e["type"] == "MODIFIED"]
    assert len(changes) == 1, [e["type"] for e in events]
    assert changes[0]["object"]["spec"]["nodeName"] == node
    assert ASSIGNMENT in changes[0]["object"]["metadata"]["annotations"]
    api.core.delete_namespaced_pod("bind-contract", NS, grace_period_seconds=0, _preload_content=False)
