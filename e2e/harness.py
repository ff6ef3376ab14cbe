"""The whole system on loopback, on the real Kubernetes 1.36 code from ``../shared/k8s`` (DESIGN 8).

:class:`System` starts, in this order, and stops all of it again (``System.close``):

* etcd, kube-apiserver and kube-controller-manager (``cluster up`` / ``cluster controller-manager``);
* the shipped ``simulated`` overlay, applied server-side and strict, except the DaemonSet and the
  scheduler Deployment (their processes run here, below) and the Prometheus operator's kinds (no
  operator runs here): namespace, quota, PriorityClass, ConfigMaps, service accounts, RBAC and the
  ValidatingAdmissionPolicies;
* three GPU nodes, each a ``kubelet-dm`` (kubelet's own device manager, admission and PodResources)
  with its own ``gpu-slice mps-daemon`` (the ``gpu-slice-mps`` DaemonSet's process: the stand-in MPS
  daemons outlive every plugin) and ``gpu-slice device-plugin --backend simulated`` process, running
  as the plugin's service account with a token bound to a pod on its node (as kubelet projects a
  DaemonSet pod's token), so the admission policy's own-node rules apply. Topologies mix MIG, MPS
  and whole-GPU modes and two products (:data:`TOPOLOGIES`);
* a real Prometheus scraping every plugin's DCGM-compatible series and every extender's metrics;
* two replicas of the scheduler pod: ``gpu-slice extender`` (verbs on a loopback port, probes and
  metrics on an ops port of their own) beside a real kube-scheduler with the shipped
  ``KubeSchedulerConfiguration`` (leader election on ``kube-system/gpu-slice-scheduler``), each as its
  own service account (the extender's, kube-scheduler's). As root each kube-scheduler gets its own
  host name (its own UTS namespace, ``cluster scheduler --hostname``) so the two hold distinct leader
  identities and the extenders fence ``/bind`` on them; otherwise one replica runs, unfenced, and the
  tests that need two say so when they skip.

Every process started here is in its own process group and is stopped by its pid; the launcher's
components are stopped with ``cluster down``. :meth:`System.audit` counts what DESIGN 8 says can go
wrong (see :class:`Counts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from tests.k8s_launcher import CLUSTER, run_cluster

if TYPE_CHECKING:
    from deviceplugin.stamping import PodResourcesClient

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"
NAMESPACE = "gpu-slice-system"
RESOURCE = "example.com/gpu-slice"
ASSIGNMENT = "example.com/gpu-slice.assignment"
ALLOCATED = "example.com/gpu-slice.allocated"
INVENTORY = "example.com/gpu-slice.inventory"
CORDON = "example.com/gpu-slice.cordon"
RUN_OPTIONS = "kubelet-dm/run-options"
SCHEDULER_NAME = "gpu-slice-scheduler"
LEASE_NS, LEASE_NAME = "kube-system", "gpu-slice-scheduler"
PLUGIN_SA = f"{NAMESPACE}/gpu-slice-device-plugin"
EXTENDER_SA = f"{NAMESPACE}/gpu-slice-extender"
SCHEDULER_SA = f"{NAMESPACE}/gpu-slice-scheduler"
TEST_NS = "default"

#: Not applied here: the processes run as processes, and no Prometheus operator serves these kinds.
SKIPPED_KINDS = frozenset({"DaemonSet", "Deployment", "PodMonitor", "ServiceMonitor", "PrometheusRule"})

#: Three nodes, 14 slices each: MIG (two H100 layouts), MPS (two A100), and a mixed node with a
#: whole-mode H100 and an MPS A100.
TOPOLOGIES: dict[str, dict[str, Any]] = {
    "gpu-mig": {"version": 1, "node": "gpu-mig", "gpus": [
        {"product": "H100-80GB", "mode": "mig", "instances": [
            {"profile": "3g.40gb", "start": 4}, {"profile": "2g.20gb", "start": 0},
            {"profile": "1g.10gb", "start": 2}, {"profile": "1g.10gb", "start": 3}]},
        {"product": "H100-80GB", "mode": "mig", "instances": [
            {"profile": "4g.40gb", "start": 0}, {"profile": "2g.20gb", "start": 4},
            {"profile": "1g.10gb", "start": 6}]}]},
    "gpu-mps": {"version": 1, "node": "gpu-mps", "gpus": [
        {"product": "A100-80GB", "mode": "mps"}, {"product": "A100-80GB", "mode": "mps"}]},
    "gpu-mix": {"version": 1, "node": "gpu-mix", "gpus": [
        {"product": "H100-80GB", "mode": "whole"}, {"product": "A100-80GB", "mode": "mps"}]},
}
SLICES_PER_NODE = 14
# The plugin's successful registrations with kubelet: the counter starts at 0 in every plugin
# process, so 1 or more means the process now running has registered.
PLUGIN_REGISTERED = 'gpu_slice_plugin_registrations_total{result="ok"}'


def skip_reason() -> str | None:
    """Why the whole-system tests cannot run here, or None."""
    if not CLUSTER.is_file():
        return "no real control plane: ../shared/k8s/cluster (the shared k8s kit beside the repository) is absent"
    if shutil.which("kubectl") is None:
        return "kubectl is not installed (.ci/run installs it): the shipped kustomize tree cannot be built"
    if shutil.which("prometheus") is None:
        return "Debian's prometheus binary is absent (.ci/run installs it)"
    return None


# --------------------------------------------------------------------------- small helpers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.25,
         on_timeout: Callable[[], str] | None = None) -> Any:
    """Poll ``check`` until truthy; exceptions count as 'not yet' (the API server may be restarting)."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            got = check()
            if got:
                return got
        except AssertionError:
            raise
        except Exception as exc:
            last = exc
        if time.monotonic() > deadline:
            extra = f"; last error: {last!r}" if last else ""
            detail = f"\n{on_timeout()}" if on_timeout else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{extra}{detail}")
        time.sleep(interval)


def http(method: str, url: str, body: bytes | None = None, timeout: float = 10.0,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except OSError:
        return 0, b""


def cluster(*args: str, timeout: float = 240) -> str:
    return run_cluster(*args, timeout=timeout)


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class Proc:
    """A process of ours, in its own process group, logging to a file; stopped by its pid only."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log = name, argv, log
        self._env = env
        self.popen: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        assert self.popen is None or self.popen.poll() is not None, f"{self.name} already runs"
        with self.log.open("ab") as out:
            out.write(f"\n==== {time.strftime('%H:%M:%S')} {shlex.join(self.argv)}\n".encode())
            out.flush()
            self.popen = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          cwd=REPO, start_new_session=True,
                                          env={**os.environ, **(self._env or {})})

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def check(self) -> None:
        if not self.alive:
            code = None if self.popen is None else self.popen.returncode
            raise AssertionError(f"{self.name} exited ({code}):\n{tail(self.log)}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        p = self.popen
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill would end it."""
        self.stop(signal.SIGKILL)


# --------------------------------------------------------------------------- the API, as admin

class Kube:
    """Raw JSON over the official client (admin kubeconfig)."""

    def __init__(self, kubeconfig: Path) -> None:
        from kubernetes import client, config

        self.api_client = config.new_client_from_config(config_file=str(kubeconfig))
        self.api_client.configuration.retries = 3
        self.core = client.CoreV1Api(self.api_client)
        self.apps = client.AppsV1Api(self.api_client)
        self.coord = client.CoordinationV1Api(self.api_client)
        self.sched = client.SchedulingV1Api(self.api_client)

    @staticmethod
    def _json(resp: Any) -> Any:
        try:
            return json.loads(resp.data)
        finally:
            resp.release_conn()

    def pods(self, ns: str | None = TEST_NS) -> list[dict[str, Any]]:
        resp = (self.core.list_namespaced_pod(ns, _preload_content=False, _request_timeout=20) if ns
                else self.core.list_pod_for_all_namespaces(_preload_content=False, _request_timeout=20))
        return list(self._json(resp)["items"])

    def pod(self, name: str, ns: str = TEST_NS) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return dict(self._json(self.core.read_namespaced_pod(name, ns, _preload_content=False,
                                                                  _request_timeout=20)))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def create_pod(self, body: dict[str, Any], ns: str = TEST_NS) -> dict[str, Any]:
        return dict(self._json(self.core.create_namespaced_pod(ns, body, _preload_content=False,
                                                                _request_timeout=20)))

    def delete_pod(self, name: str, ns: str = TEST_NS) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self._json(self.core.delete_namespaced_pod(name, ns, grace_period_seconds=0, _preload_content=False,
                                                        _request_timeout=20))
        except ApiException as err:
            if err.status != 404:
                raise

    def nodes(self) -> list[dict[str, Any]]:
        return list(self._json(self.core.list_node(_preload_content=False, _request_timeout=20))["items"])

    def node(self, name: str) -> dict[str, Any]:
        return dict(self._json(self.core.read_node(name, _preload_content=False, _request_timeout=20)))

    def patch_node(self, name: str, patch: dict[str, Any]) -> None:
        self._json(self.core.patch_node(name, patch, _preload_content=False, _request_timeout=20))

    def events(self, ns: str | None = None) -> list[dict[str, Any]]:
        resp = (self.core.list_namespaced_event(ns, _preload_content=False, _request_timeout=20) if ns
                else self.core.list_event_for_all_namespaces(_preload_content=False, _request_timeout=20))
        return list(self._json(resp)["items"])

    def lease_holder(self) -> str:
        try:
            lease = self._json(self.coord.read_namespaced_lease(LEASE_NAME, LEASE_NS, _preload_content=False,
                                                                _request_timeout=10))
        except Exception:
            return ""
        return str((lease.get("spec") or {}).get("holderIdentity") or "")

    def scale(self, deployment: str, replicas: int, ns: str = TEST_NS) -> None:
        self._json(self.apps.patch_namespaced_deployment_scale(deployment, ns, {"spec": {"replicas": replicas}},
                                                               _preload_content=False, _request_timeout=20))


def follow_pods(core: Any, namespace: str, on_event: Callable[[str, dict[str, Any], float], None],
                stop: threading.Event, *, clock: Callable[[], float] = time.monotonic,
                started: threading.Event | None = None) -> None:
    """List, then watch, the pods of ``namespace`` until ``stop``: ``on_event(type, pod, when)`` for each
    listed pod (as ADDED) and each watch event, ``when`` by ``clock`` as the line arrived. A watch that
    ends resumes from the last version seen; an ERROR event (410) or a failure lists again. For the
    benchmarks' and scenarios' own clocks on what the API server shows."""
    rv = ""
    while not stop.is_set():
        try:
            if not rv:
                resp = core.list_namespaced_pod(namespace, _preload_content=False, _request_timeout=30)
                listed = json.loads(resp.data)
                resp.release_conn()
                now = clock()
                for pod in listed["items"]:
                    on_event("ADDED", pod, now)
                rv = listed["metadata"]["resourceVersion"]
            resp = core.list_namespaced_pod(namespace, watch=True, resource_version=rv, timeout_seconds=30,
                                            allow_watch_bookmarks=True, _preload_content=False,
                                            _request_timeout=(5, 60))
            if started is not None:
                started.set()
            buf = b""
            for chunk in resp.stream(65536):
                buf += chunk
                *lines, buf = buf.split(b"\n")
                now = clock()
                for line in lines:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        rv = ""  # 410: list again
                        break
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if event.get("type") != "BOOKMARK":
                        on_event(str(event.get("type")), obj, now)
                if stop.is_set() or not rv:
                    break
            resp.release_conn()
        except Exception:
            if stop.is_set():
                return
            rv = ""
            time.sleep(0.2)


def slice_pod(name: str, slices: int, *, memory: str | None = None, isolation: str | None = None,
              priority_class: str | None = None, labels: dict[str, str] | None = None,
              annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A bare LLM-style pod for gpu-slice-scheduler asking ``slices`` (and a memory floor / isolation)."""
    ann = dict(annotations or {})
    if memory:
        ann["example.com/gpu-memory"] = memory
    if isolation:
        ann["example.com/gpu-isolation"] = isolation
    spec: dict[str, Any] = {
        "schedulerName": SCHEDULER_NAME, "terminationGracePeriodSeconds": 0, "restartPolicy": "Always",
        "containers": [{"name": "server", "image": "registry.invalid/llm-server:1",
                        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                                      "limits": {RESOURCE: str(slices)}}}]}
    if priority_class:
        spec["priorityClassName"] = priority_class
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels or {}, "annotations": ann}, "spec": spec}


def slices_of(pod: dict[str, Any]) -> int:
    total = 0
    for c in pod["spec"].get("containers") or []:
        res = c.get("resources") or {}
        total += int((res.get("limits") or {}).get(RESOURCE) or (res.get("requests") or {}).get(RESOURCE) or 0)
    return total


def ann_of(pod: dict[str, Any]) -> dict[str, str]:
    return dict(pod["metadata"].get("annotations") or {})


def live(pod: dict[str, Any]) -> bool:
    return pod["status"].get("phase") not in ("Succeeded", "Failed") and not pod["metadata"].get("deletionTimestamp")


# --------------------------------------------------------------------------- the DESIGN 8 counts

@dataclass
class Counts:
    """What can really go wrong (DESIGN 8). Every field must be 0 after each scenario."""

    invalid_placements: int = 0      # ids not one whole MIG instance / one MPS GPU / whole GPUs, or unknown ids
    wrong_isolation: int = 0         # mig-only pod on an MPS GPU and the like, or memory floor not met
    assignment_not_allocated: int = 0  # the plugin's stamp (kubelet's choice) differs from the assignment
    kubelet_not_assignment: int = 0  # kubelet's PodResources ids for the pod differ from its assignment
    admission_failures: int = 0      # UnexpectedAdmissionError / OutOf... (pods and events, whole session)
    double_counted: int = 0          # an id held by two live pods (counting rule clashes, or kubelet)
    leaked: int = 0                  # ids kubelet still gives to pods that are gone or terminal, or vice versa
    lost_assignments: int = 0        # a bound slice pod without its assignment (or for another node/UID)
    unstamped: int = 0               # a Running slice pod the plugin never stamped with `allocated`
    problems: list[str] = field(default_factory=list)

    def bad(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if k != "problems" and v}


def _ask_kubelet(socket_path: str, call: Callable[[PodResourcesClient], Awaitable[T]]) -> T:
    """One PodResources call to the kubelet listening at ``socket_path``, on a client of its own."""
    from deviceplugin.stamping import PodResourcesClient

    async def go() -> T:
        client = PodResourcesClient(Path(socket_path))
        try:
            return await call(client)
        finally:
            await client.close()

    return asyncio.run(go())


def _kubelet_allocatable(socket_path: str) -> int:
    """How many ids of ours kubelet can allocate now (PodResources GetAllocatableResources): only
    the healthy devices of a plugin registered with this kubelet process count."""
    return sum(len(ids) for r, ids in _ask_kubelet(socket_path, lambda c: c.allocatable()) if r == RESOURCE)


def _kubelet_ids(socket_path: str) -> dict[tuple[str, str], tuple[str, ...]]:
    """(namespace, pod name) → the slice ids kubelet's device manager gave it (PodResources List)."""
    resp = _ask_kubelet(socket_path, lambda c: c.list_pods())
    out: dict[tuple[str, str], tuple[str, ...]] = {}
    for p in resp.pod_resources:
        ids: list[str] = []
        for c in p.containers:
            for d in c.devices:
                if d.resource_name == RESOURCE:
                    ids.extend(d.device_ids)
        if ids:
            out[(p.namespace, p.name)] = tuple(ids)
    return out


def audit(kube: Kube, pod_resources: dict[str, str], *, scheduler_names: Iterable[str] = (SCHEDULER_NAME,)
          ) -> Counts:
    """One consistent look at the API server and every kubelet; see :class:`Counts`."""
    from gpuslice.annotations import decode_allocated_for, decode_assignment_for, decode_inventory
    from gpuslice.counting import held_by_node, placement_from_assignment
    from gpuslice.model import NodeInventory
    from gpuslice.placement import isolation_allows, suits
    from gpuslice.requests import parse_request

    c = Counts()
    names = set(scheduler_names)
    inventories: dict[str, NodeInventory] = {}
    for node in kube.nodes():
        raw = ann_of(node).get(INVENTORY)
        if raw:
            inventories[node["metadata"]["name"]] = NodeInventory(node["metadata"]["name"], decode_inventory(raw))
    pods = kube.pods(None)
    by_key = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
    kubelet = {node: _kubelet_ids(sock) for node, sock in pod_resources.items()}

    for pod in pods:
        meta, status = pod["metadata"], pod["status"]
        label = f"{meta['namespace']}/{meta['name']}"
        if status.get("phase") == "Failed" and (status.get("reason") == "UnexpectedAdmissionError"
                                                or str(status.get("reason", "")).startswith("OutOf")):
            c.admission_failures += 1
            c.problems.append(f"{label}: {status.get('reason')}: {status.get('message')}")
        if not slices_of(pod) or pod["spec"].get("schedulerName") not in names or not live(pod):
            continue
        node = pod["spec"].get("nodeName")
        if not node:
            continue
        assignment = decode_assignment_for(pod)
        if assignment is None or assignment.node != node or assignment.pod_uid != meta["uid"]:
            c.lost_assignments += 1
            c.problems.append(f"{label} bound to {node} without its assignment: {ann_of(pod).get(ASSIGNMENT)}")
            continue
        request = parse_request(pod)
        inv = inventories.get(node)
        try:
            assert inv is not None and request is not None
            placement = placement_from_assignment(assignment, inv)
            ok_ids = set(assignment.slice_ids) <= inv.all_ids()
            gpus = [inv.gpu(u) for u in placement.gpus]
            if placement.instance is not None:
                ok_ids = ok_ids and set(assignment.slice_ids) == set(gpus[0].instance(placement.instance).slice_ids())
            elif gpus[0].mode == "whole":
                ok_ids = ok_ids and set(assignment.slice_ids) == {s for g in gpus for s in g.slice_ids()}
            else:
                ok_ids = ok_ids and len(gpus) == 1 and set(assignment.slice_ids) <= set(gpus[0].slice_ids())
            if not ok_ids:
                c.invalid_placements += 1
                c.problems.append(f"{label}: ids {assignment.slice_ids} are no valid placement on {node}")
            elif not suits(placement, request, inv) or not all(isolation_allows(g.mode, request) for g in gpus):
                c.wrong_isolation += 1
                c.problems.append(f"{label}: {placement} does not suit {request}")
        except Exception as exc:
            c.invalid_placements += 1
            c.problems.append(f"{label}: assignment {assignment} cannot be placed on {node}: {exc!r}")
            continue
        if status.get("phase") != "Running":
            continue
        allocated = decode_allocated_for(pod)
        if allocated is None:
            c.unstamped += 1
            c.problems.append(f"{label}: Running without the allocated stamp")
        elif set(allocated.slice_ids) != set(assignment.slice_ids):
            c.assignment_not_allocated += 1
            c.problems.append(f"{label}: allocated {allocated.slice_ids} != assignment {assignment.slice_ids}")
        given = kubelet.get(node, {}).get((meta["namespace"], meta["name"]))
        if given is not None and set(given) != set(assignment.slice_ids):
            c.kubelet_not_assignment += 1
            c.problems.append(f"{label}: kubelet gave {given}, assignment says {assignment.slice_ids}")

    # Bookkeeping: the counting rule (what the extender and the plugin count) against kubelet's truth.
    holdings, problems = held_by_node(pods, now=datetime.now(UTC), reservation_ttl=timedelta(seconds=60))
    for prob in problems:
        if "claim" in prob.reason or "twice" in prob.reason or "clash" in prob.reason:
            c.double_counted += 1
            c.problems.append(f"counting rule: {prob}")
    for knode, kgiven in kubelet.items():
        seen: dict[str, tuple[str, str]] = {}
        for key, ids in kgiven.items():
            kpod = by_key.get(key)
            if kpod is None or not live(kpod):
                c.leaked += 1
                c.problems.append(f"kubelet on {knode} still gives {ids} to {key[0]}/{key[1]}, which is "
                                  f"{'gone' if kpod is None else kpod['status'].get('phase')}")
            for sid in ids:
                if sid in seen:
                    c.double_counted += 1
                    c.problems.append(f"kubelet on {knode} gives {sid} to {seen[sid]} and {key}")
                seen[sid] = key
        rule_ids = {s for h in holdings[knode].held.values() if h.bound for s in h.slice_ids} \
            if knode in holdings else set()
        # Bound pods that kubelet has admitted: the rule must count exactly kubelet's ids.
        admitted = {s for key, ids in kgiven.items() if (q := by_key.get(key)) is not None and live(q) for s in ids}
        extra = admitted - rule_ids
        if extra:
            c.leaked += 1
            c.problems.append(f"{knode}: kubelet holds {sorted(extra)} that the counting rule does not count")
    return c


# --------------------------------------------------------------------------- the system

@dataclass
class Node:
    name: str
    info: dict[str, Any]
    topology: Path
    metrics_port: int
    plugin: Proc | None = None
    mps: Proc | None = None
    config: Path | None = None  # the plugin's config file, when not the session's

    @property
    def pod_resources(self) -> str:
        return str(self.info["podResourcesSocket"])


@dataclass
class Replica:
    """One scheduler pod: an extender beside its kube-scheduler."""

    index: int
    identity: str
    port: int
    extender: Proc
    scheduler_config: Path
    scheduler_name: str
    ops_port: int = 0
    #: kube-scheduler's flags as the shipped Deployment gives them (every start of this replica uses them).
    flags: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        """The verbs (/filter, /prioritize, /bind, /preempt)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def ops_url(self) -> str:
        """/healthz, /readyz and /metrics."""
        return f"http://127.0.0.1:{self.ops_port}"


class System:
    def __init__(self, work: Path, *, topologies: dict[str, dict[str, Any]] | None = None,
                 controller_flags: Iterable[str] = ()) -> None:
        """``topologies``: node name -> simulated topology (default :data:`TOPOLOGIES`; every node must
        advertise :data:`SLICES_PER_NODE` slices); ``controller_flags``: extra kube-controller-manager
        flags (a load run raises its API rate limits)."""
        # Unix socket paths are limited to 107 bytes: the plugin's socket lies under work/nodes/NAME/.
        self.work = work
        self.topologies = dict(topologies if topologies is not None else TOPOLOGIES)
        self.controller_flags = list(controller_flags)
        probe = work / "nodes" / "gpu-mig" / "device-plugins" / "gpu-slice-device-plugin-00000.sock"
        assert len(str(probe)) < 100, f"{work} is too long a path for the nodes' unix sockets"
        self.admin = self.work / "kubeconfig"
        self.procs: list[Proc] = []
        self.nodes: dict[str, Node] = {}
        self.replicas: list[Replica] = []
        self.prometheus: Proc | None = None
        self.prometheus_port = 0
        self.fencing = os.geteuid() == 0 and shutil.which("unshare") is not None
        self.kube: Kube
        self.extender_config = self.work / "extender-config.yaml"
        self.plugin_config = self.work / "plugin-config.yaml"
        self.timings: dict[str, float] = {}
        self.faults: dict[str, int] = {}
        self.built: list[dict[str, Any]] = []

    # -- start

    def start(self) -> None:
        t0 = time.monotonic()
        cluster("up", str(self.work))
        self.kube = Kube(self.admin)
        self._apply_manifests()
        extra = ["--", *self.controller_flags] if self.controller_flags else []
        cluster("controller-manager", str(self.work), *extra)
        for name, topo in self.topologies.items():
            self._start_node(name, topo)
        for node in self.nodes.values():
            self._wait_node_ready(node)
        self._start_prometheus()
        for i in range(2 if self.fencing else 1):
            self._start_replica(i)
        self.wait_leader()
        self.timings["start_s"] = time.monotonic() - t0

    def _apply_manifests(self) -> None:
        from tests.manifests.built import build, named_prefix

        self.built = build("simulated")
        objs = [o for o in self.built if o["kind"] not in SKIPPED_KINDS]
        self.kubectl("apply", "--server-side", "--field-manager=gpu-slice-install", "--validate=strict", "-f", "-",
                     stdin=yaml.safe_dump_all(objs))
        config = named_prefix(self.built, "ConfigMap", "gpu-slice-config")["data"]["config.yaml"]
        prices = named_prefix(self.built, "ConfigMap", "gpu-slice-prices")["data"]["prices.yaml"]
        self.plugin_config.write_text(config)
        self.extender_config.write_text(config + prices)  # what the scheduler pod's init container joins

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        exe = shutil.which("kubectl")
        assert exe is not None
        done = subprocess.run([exe, "--kubeconfig", str(self.admin), *args], input=stdin, capture_output=True,
                              text=True, timeout=120, check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{done.stderr[-4000:]}")
        return done

    def _start_node(self, name: str, topo: dict[str, Any], config: Path | None = None) -> None:
        info = json.loads(cluster("node", str(self.work), name, "--", "--cpu=64", "--memory=512Gi").splitlines()[-1])
        path = self.work / f"topology-{name}.yaml"
        path.write_text(yaml.safe_dump(topo, sort_keys=False))
        node = Node(name, info, path, free_port(), config=config)
        self.nodes[name] = node
        # The DaemonSet pod's stand-in: its token is bound to a pod on this node, so the API server puts
        # the node's name in the plugin's user info (the admission policy's own-node rules read it).
        holder = f"gpu-slice-device-plugin-{name}"
        if self.kube.pod(holder, NAMESPACE) is None:
            self.kube.create_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": holder, "labels": {
                "app.kubernetes.io/name": "gpu-slice-device-plugin"}}, "spec": {
                "nodeName": name, "serviceAccountName": "gpu-slice-device-plugin",
                "containers": [{"name": "device-plugin", "image": "gpu-slice:e2e"}]}}, NAMESPACE)
        sa = self.work / f"plugin-{name}.kubeconfig"
        cluster("sa-kubeconfig", str(self.work), PLUGIN_SA, str(sa), "--bound-pod", f"{NAMESPACE}/{holder}")
        self._start_mps(node)
        self._start_plugin(node, sa)

    def _start_mps(self, node: Node) -> None:
        """The simulated overlay's gpu-slice-mps DaemonSet on this node: its arguments, this machine's paths."""
        from tests.manifests.built import one

        (container,) = one(self.built, "DaemonSet", "gpu-slice-mps")["spec"]["template"]["spec"]["containers"]
        args = [a for a in container["args"] if not a.startswith("--mps-root=")]
        assert args[0] == "mps-daemon" and "--control=standin" in args, args
        argv = [sys.executable, "-m", "gpuslice_cli", *args, "--mps-root", str(self.work / "mps" / node.name),
                "--drain-seconds", "2"]
        node.mps = Proc(f"mps-{node.name}", argv, self.work / f"mps-{node.name}.log",
                        {"GPU_SLICE_MPS_STANDIN_LIFETIME_S": "1800"})
        self.procs.append(node.mps)

    def _start_plugin(self, node: Node, sa: Path | None = None) -> None:
        sa = sa or self.work / f"plugin-{node.name}.kubeconfig"
        from tests.manifests.built import one

        # The simulated overlay's DaemonSet arguments, with this machine's paths.
        (container,) = one(self.built, "DaemonSet", "gpu-slice-device-plugin")["spec"]["template"]["spec"]["containers"]
        shipped = [a for a in container["args"] if not a.startswith(("--config=", "--mps-root="))]
        assert shipped[0] == "device-plugin" and "--backend=simulated" in shipped, shipped
        argv = [sys.executable, "-m", "gpuslice_cli", *shipped,
                "--config", str(node.config or self.plugin_config), "--topology", str(node.topology),
                "--node-name", node.name,
                "--kubeconfig", str(sa), "--plugin-dir", node.info["pluginDir"],
                "--pod-resources-socket", node.pod_resources, "--metrics-port", str(node.metrics_port),
                "--metrics-address", "127.0.0.1", "--mps-root", str(self.work / "mps" / node.name)]
        if node.plugin is None:
            node.plugin = Proc(f"plugin-{node.name}", argv, self.work / f"plugin-{node.name}.log")
            self.procs.append(node.plugin)
        else:
            node.plugin.argv = argv
            node.plugin.start()

    def _wait_node_ready(self, node: Node, timeout: float = 120, slices: int = SLICES_PER_NODE) -> None:
        """The node's status and inventory show every slice, and the running plugin process has
        registered with the running kubelet, which lists every slice healthy. The node object alone
        would pass at once after a plugin or kubelet restart: it keeps the old allocatable and
        annotation, and a pod bound before the new registration fails admission."""
        def ready() -> bool:
            assert node.plugin is not None
            node.plugin.check()
            n = self.kube.node(node.name)
            return (int((n["status"].get("allocatable") or {}).get(RESOURCE, "0")) == slices
                    and INVENTORY in ann_of(n)
                    and self.metric(f"http://127.0.0.1:{node.metrics_port}", PLUGIN_REGISTERED, timeout=2.0) >= 1
                    and _kubelet_allocatable(node.pod_resources) == slices)
        wait(f"node {node.name}: {slices} slices allocatable, the inventory written, the plugin "
             "registered and every slice healthy in kubelet", ready, timeout,
             on_timeout=lambda: tail(node.plugin.log) if node.plugin else "")

    def _start_prometheus(self) -> None:
        if self.prometheus is None:  # a restart keeps the port the extenders were given
            self.prometheus_port = free_port()
            self._write_prometheus_config()
        data = self.work / "prometheus"
        data.mkdir(exist_ok=True)
        argv = ["prometheus", f"--config.file={self.work / 'prometheus.yml'}", f"--storage.tsdb.path={data}",
                f"--web.listen-address=127.0.0.1:{self.prometheus_port}", "--storage.tsdb.retention.time=1h",
                "--web.enable-lifecycle"]
        if self.prometheus is None:
            self.prometheus = Proc("prometheus", argv, self.work / "prometheus.log")
            self.procs.append(self.prometheus)
        else:
            self.prometheus.start()
        wait("prometheus ready", lambda: self.prometheus is not None and self.prometheus.alive
             and http("GET", f"{self.prometheus_url}/-/ready")[0] == 200, 60)

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.prometheus_port}"

    def _write_prometheus_config(self, extender_ports: Iterable[int] = ()) -> None:
        cfg = {"global": {"scrape_interval": "2s", "evaluation_interval": "5s"},
               "scrape_configs": [
                   # honor_labels as the monitoring component's PodMonitor: the per-pod series keep their
                   # own pod, namespace and node labels
                   {"job_name": "gpu-slice-device-plugin", "honor_labels": True,
                    "static_configs": [{"targets": [f"127.0.0.1:{n.metrics_port}"], "labels": {"node": n.name}}
                                       for n in self.nodes.values()]},
                   {"job_name": "gpu-slice-extender",
                    "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in extender_ports]}]}]}
        (self.work / "prometheus.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    def reload_prometheus(self) -> None:
        self._write_prometheus_config([r.ops_port for r in self.replicas])
        status, body = http("POST", f"{self.prometheus_url}/-/reload")
        assert status == 200, body

    def _start_replica(self, i: int) -> None:
        from tests.manifests.built import named_prefix, one

        identity = f"gpu-slice-scheduler-{i}"
        sa = self.work / "extender.kubeconfig"
        if not sa.exists():
            cluster("sa-kubeconfig", str(self.work), EXTENDER_SA, str(sa))
        sched_sa = self.work / "scheduler.kubeconfig"
        if not sched_sa.exists():
            cluster("sa-kubeconfig", str(self.work), SCHEDULER_SA, str(sched_sa))
        port, ops_port = free_port(), free_port()
        argv = [sys.executable, "-m", "gpuslice_cli", "extender", f"--config={self.extender_config}",
                "--address=127.0.0.1", f"--port={port}", "--ops-address=127.0.0.1", f"--ops-port={ops_port}",
                f"--lease={LEASE_NS}/{LEASE_NAME}",
                f"--identity={identity}", "--kubeconfig", str(sa), "--prometheus-url", self.prometheus_url,
                "--signal-interval", "2", "--slice-map=token"]
        if not self.fencing:
            argv.append("--no-fencing")
        ext = Proc(f"extender-{i}", argv, self.work / f"extender-{i}.log")
        self.procs.append(ext)
        healthz = f"http://127.0.0.1:{ops_port}/healthz"
        wait(f"extender-{i} /healthz", lambda: (ext.check(), http("GET", healthz)[0] == 200)[1], 60,
             on_timeout=lambda: tail(ext.log))
        config = yaml.safe_load(named_prefix(self.built, "ConfigMap", "gpu-slice-scheduler-config")["data"][
            "scheduler-config.yaml"])
        (ext_cfg,) = config["extenders"]
        ext_cfg["urlPrefix"] = f"http://127.0.0.1:{port}"
        config["clientConnection"]["kubeconfig"] = str(sched_sa)
        path = self.work / f"scheduler-{i}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        dep = one(self.built, "Deployment", "gpu-slice-scheduler")
        (sched,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "kube-scheduler"]
        flags = [f for f in sched["command"][1:] if not f.startswith("--config=")]
        replica = Replica(i, identity, port, ext, path, f"sched-{i}", ops_port, tuple(flags))
        self.replicas.append(replica)
        self.start_scheduler(replica)
        if self.prometheus is not None:
            self.reload_prometheus()

    def start_scheduler(self, replica: Replica) -> None:
        """Start the replica's kube-scheduler with the Deployment's flags: a restart that dropped them
        (``--pod-max-in-unschedulable-pods-duration`` among them) would test another scheduler."""
        host = ["--hostname", replica.identity] if self.fencing else []
        cluster("scheduler", str(self.work), str(replica.scheduler_config), "--name", replica.scheduler_name, *host,
                "--", *replica.flags)

    def running_schedulers(self) -> set[str]:
        """The names of the replicas' kube-schedulers that are running now (the launcher's status)."""
        return {f[0] for f in (ln.split() for ln in cluster("status", str(self.work)).splitlines())
                if len(f) > 1 and f[1] != "-"}

    def revive_schedulers(self) -> list[str]:
        """Start again every replica's kube-scheduler that has exited, as the kubelet restarts a
        Deployment's container: kube-scheduler exits when it loses its Lease (a kube-apiserver restart
        longer than its renew deadline does that), and a scenario that follows must not meet a cluster
        with fewer schedulers than the manifests run. Returns the names started."""
        running = self.running_schedulers()
        started = [r.scheduler_name for r in self.replicas if r.scheduler_name not in running]
        for r in self.replicas:
            if r.scheduler_name in started:
                self.start_scheduler(r)
        return started

    def stop_scheduler(self, replica: Replica) -> None:
        cluster("stop", str(self.work), replica.scheduler_name)

    def leader(self) -> Replica | None:
        holder = self.kube.lease_holder()
        for r in self.replicas:
            if holder.startswith(r.identity + "_") or (not self.fencing and holder):
                return r
        return None

    def wait_leader(self, timeout: float = 90, exclude: Replica | None = None) -> Replica:
        def ready() -> Replica | None:
            for r in self.replicas:
                if r.extender.alive is False and r is not exclude:
                    r.extender.check()
            lead = self.leader()
            if lead is None or lead is exclude:
                return None
            return lead if http("GET", f"{lead.ops_url}/readyz")[0] == 200 else None
        got: Replica = wait("a scheduler to hold the Lease and its extender to be ready", ready, timeout,
                            on_timeout=self.logs)
        return got

    def restart_apiserver(self) -> None:
        """Stop kube-apiserver and start it again with the same flags, port and certificates (etcd keeps
        the data), through the launcher's own start so ``cluster down`` still stops it."""
        import importlib.machinery
        import importlib.util

        log = (self.work / "logs" / "apiserver.log").read_text()
        header = [ln for ln in log.splitlines() if ln.startswith("==== ")][-1]
        argv = header.split(" ", 2)[2].split(" ")
        cluster("stop", str(self.work), "apiserver")
        loader = importlib.machinery.SourceFileLoader("gpu_slice_k8s_cluster", str(CLUSTER))
        spec = importlib.util.spec_from_loader(loader.name, loader)
        assert spec is not None
        launcher = importlib.util.module_from_spec(spec)
        loader.exec_module(launcher)
        launcher.start(str(self.work), "apiserver", argv)
        wait("kube-apiserver /readyz after its restart",
             lambda: self.kubectl("get", "--raw", "/readyz", check=False).returncode == 0, 180, interval=0.5)

    # -- looking

    def audit(self) -> Counts:
        return audit(self.kube, {n.name: n.pod_resources for n in self.nodes.values()})

    def settle_and_audit(self, timeout: float = 90) -> Counts:
        """Wait until every bound live slice pod is Running and stamped (or the timeout), then count."""
        def settled() -> bool:
            for p in self.kube.pods(None):
                if not slices_of(p) or not live(p) or not p["spec"].get("nodeName"):
                    continue
                if p["status"].get("phase") != "Running" or ALLOCATED not in ann_of(p):
                    return False
            return True
        with contextlib.suppress(AssertionError):  # audit() counts what is still wrong
            wait("bound slice pods Running and stamped", settled, timeout, interval=0.5)
        return self.audit()

    def admission_failure_events(self) -> list[str]:
        return [f"{e['involvedObject'].get('name')}: {e.get('reason')}: {e.get('message')}"
                for e in self.kube.events(None)
                if e.get("reason") == "UnexpectedAdmissionError" or str(e.get("reason", "")).startswith("OutOf")]

    def metric(self, url: str, name: str, timeout: float = 10.0) -> float:
        """The sum of the series ``name`` (a metric name, or one series with its labels) served at
        ``url``; 0 when nothing answers (a process that is down has counted nothing)."""
        _status, body = http("GET", f"{url}/metrics", timeout=timeout)
        total = 0.0
        for line in body.decode(errors="replace").splitlines():
            if line.startswith(name) and (line[len(name)] in " {"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def diagnose(self, pods: Iterable[str] = ()) -> str:
        """A few lines on why pods may not be moving: who holds the Lease, which of our processes and
        kube-schedulers are down, and what each kube-scheduler last said about each pod. Never raises:
        it runs while a failure is being reported."""
        try:
            return self._diagnose(pods)
        except Exception as exc:
            return f"(no diagnosis: {exc!r})"

    def _diagnose(self, pods: Iterable[str]) -> str:
        out = [f"lease holder: {self.kube.lease_holder() or '(none)'}"]
        down = [p.name for p in self.procs if p.alive is False]
        running = self.running_schedulers()
        down += [r.scheduler_name for r in self.replicas if r.scheduler_name not in running]
        out.append(f"down: {', '.join(down) or 'nothing'}")
        for r in self.replicas:
            log = tail(self.work / "logs" / f"{r.scheduler_name}.log", 400_000).splitlines()
            for name in sorted(set(pods)):
                said = [ln for ln in log if f'pod="{TEST_NS}/{name}"' in ln][-3:]
                out += [f"{r.scheduler_name} on {name}: {ln[:700]}" for ln in said]
            out += [f"{r.scheduler_name}: {ln[:300]}" for ln in log if "Leaderelection lost" in ln][-1:]
        return "\n".join(out)

    def logs(self) -> str:
        parts = []
        for p in self.procs:
            parts.append(f"--- {p.name} ---\n{tail(p.log, 2000)}")
        for r in self.replicas:
            parts.append(f"--- {r.scheduler_name} ---\n{tail(self.work / 'logs' / f'{r.scheduler_name}.log', 2000)}")
        return "\n".join(parts)

    def fault(self, kind: str) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1

    # -- stop

    def close(self) -> None:
        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                p.stop(timeout=10)
        subprocess.run([sys.executable, str(CLUSTER), "down", str(self.work)], capture_output=True, timeout=120,
                       check=False)
        # The stand-in MPS daemons exit with their pipe directories (pytest's tmp_path keeps the last few
        # runs): remove them now.
        shutil.rmtree(self.work / "mps", ignore_errors=True)


# --------------------------------------------------------------------------- scenario helpers

def create_all(system: System, pods: Iterable[dict[str, Any]]) -> None:
    for body in pods:
        system.kube.create_pod(body)


def wait_placed(system: System, names: Iterable[str], timeout: float = 180) -> dict[str, dict[str, Any]]:
    """Every named pod Running (admitted by kubelet-dm) and stamped by its device plugin."""
    want = set(names)

    def done() -> dict[str, dict[str, Any]] | None:
        pods = {p["metadata"]["name"]: p for p in system.kube.pods()}
        ok = {n: pods[n] for n in want if n in pods and pods[n]["status"].get("phase") == "Running"
              and ALLOCATED in ann_of(pods[n])}
        return ok if len(ok) == len(want) else None

    def why() -> str:
        pods = {p["metadata"]["name"]: p for p in system.kube.pods()}
        lines = [f"{n}: {pods[n]['spec'].get('nodeName')} {pods[n]['status'].get('phase')} "
                 f"{pods[n]['status'].get('reason')}" if n in pods else f"{n}: gone" for n in sorted(want)]
        # The short diagnosis first: CI keeps the head and the tail of a long failure, not its middle.
        return "\n".join(lines) + "\n" + system.diagnose(want) + "\n" + system.logs()
    got: dict[str, dict[str, Any]] = wait(f"{len(want)} pods Running and stamped", done, timeout, interval=0.5,
                                          on_timeout=why)
    return got


def place_and_remove(system: System, body: dict[str, Any]) -> dict[str, Any]:
    """A probe: create the pod, wait until it runs stamped, delete it and wait until it is gone, so
    the next probe meets the same cluster; returns the pod as it ran (its assignment tells where)."""
    name = body["metadata"]["name"]
    create_all(system, [body])
    placed = wait_placed(system, [name])[name]
    system.kube.delete_pod(name)
    wait(f"{name} gone", lambda: system.kube.pod(name) is None, 60)
    return placed


def clean(system: System, timeout: float = 120) -> None:
    """Delete the test namespace's Deployments and pods and wait until kubelet-dm has let them go."""
    system.kubectl("delete", "deployment,job,hpa,service", "--all", "-n", TEST_NS, "--ignore-not-found",
                   "--wait=false", check=False)
    for p in system.kube.pods():
        system.kube.delete_pod(p["metadata"]["name"])
    wait("the test pods gone", lambda: not system.kube.pods(), timeout, interval=0.5)


def owners_uuid(assignment: dict[str, Any]) -> set[str]:
    """The GPU or MIG instance uuids a container of this assignment must be handed."""
    return {assignment["instance"]} if assignment.get("instance") else set(assignment["gpus"])


def run_options_uuids(pod: dict[str, Any], all_uuids: Iterable[str]) -> set[str]:
    """Which GPU / MIG uuids appear in what kubelet-dm would hand the container (run-options)."""
    raw = ann_of(pod).get(RUN_OPTIONS)
    assert raw, f"{pod['metadata']['name']} has no {RUN_OPTIONS}"
    (container,) = [c["name"] for c in pod["spec"]["containers"]
                    if RESOURCE in ((c.get("resources") or {}).get("limits") or {})]
    opts = json.loads(raw)[container]
    text = json.dumps({k: opts.get(k) for k in ("envs", "devices", "cdiDevices", "mounts")})
    return {u for u in all_uuids if u in text}


def all_uuids(system: System) -> dict[str, set[str]]:
    """node → every GPU and MIG instance uuid in its inventory."""
    out: dict[str, set[str]] = {}
    for node in system.kube.nodes():
        raw = ann_of(node).get(INVENTORY)
        if not raw:
            continue
        inv = json.loads(raw)
        ids = set()
        for g in inv["gpus"]:
            ids.add(g["uuid"])
            ids.update(i["uuid"] for i in g.get("instances") or [])
        out[node["metadata"]["name"]] = ids
    return out


def owner_of(pod: dict[str, Any]) -> str:
    """The Deployment (``app`` label) or Job (``job-name``) a pod belongs to, else its own name."""
    labels = pod["metadata"].get("labels") or {}
    return str(labels.get("app") or labels.get("job-name") or pod["metadata"]["name"])


def running_by_owner(system: System) -> dict[str, list[dict[str, Any]]]:
    """Live slice pods of the test namespace that kubelet-dm runs and their plugin stamped, by owner."""
    out: dict[str, list[dict[str, Any]]] = {}
    for p in system.kube.pods():
        if live(p) and slices_of(p) and p["status"].get("phase") == "Running" and ALLOCATED in ann_of(p):
            out.setdefault(owner_of(p), []).append(p)
    return out


def wait_owners(system: System, want: dict[str, int], timeout: float = 180) -> dict[str, list[dict[str, Any]]]:
    """Until exactly ``want[owner]`` pods of each owner run stamped, and no other live pod of theirs exists."""
    def done() -> dict[str, list[dict[str, Any]]] | None:
        run = running_by_owner(system)
        alive: dict[str, int] = {}
        for p in system.kube.pods():
            if live(p):
                alive[owner_of(p)] = alive.get(owner_of(p), 0) + 1
        ok = all(len(run.get(o, [])) == n and alive.get(o, 0) == n for o, n in want.items())
        return run if ok else None

    def why() -> str:
        lines = [f"{p['metadata']['name']}: {p['spec'].get('nodeName')} {p['status'].get('phase')} "
                 f"{[c.get('message') for c in p['status'].get('conditions') or [] if c.get('message')]}"
                 for p in system.kube.pods()]
        return "\n".join(lines) + "\n" + system.logs()
    got: dict[str, list[dict[str, Any]]] = wait(f"pods running per owner {want}", done, timeout, interval=0.5,
                                                on_timeout=why)
    return got


def check_run_options(system: System, pods: Iterable[dict[str, Any]]) -> list[str]:
    """For each pod: what kubelet-dm would hand its container names exactly its assignment's GPU/MIG instance."""
    uuids = all_uuids(system)
    wrong = []
    for p in pods:
        assignment = json.loads(ann_of(p)[ASSIGNMENT])
        got = run_options_uuids(p, uuids[p["spec"]["nodeName"]])
        if got != owners_uuid(assignment):
            wrong.append(f"{p['metadata']['name']}: run-options name {sorted(got)}, assignment "
                         f"{sorted(owners_uuid(assignment))}")
    return wrong


def counts_dict(counts: Counts) -> dict[str, int]:
    return {k: v for k, v in asdict(counts).items() if k != "problems"}


def restart_node(system: System, name: str) -> None:
    """Stop this node's kubelet-dm and start it again on the same root (a kubelet restart)."""
    cluster("stop", str(system.work), f"node-{name}")
    system.nodes[name].info = json.loads(cluster("node", str(system.work), name, "--", "--cpu=64",
                                                 "--memory=512Gi").splitlines()[-1])


def restart_plugin(system: System, name: str, sig: int = signal.SIGKILL) -> None:
    """Stop this node's device plugin (SIGKILL: a crash; SIGTERM: what a DaemonSet roll sends) and start
    a new one."""
    node = system.nodes[name]
    assert node.plugin is not None
    node.plugin.stop(sig)
    system._start_plugin(node)
    system._wait_node_ready(node)


def mps_daemon_pids(system: System, node: str) -> dict[str, int]:
    """GPU uuid → pid of its stand-in MPS control daemon on ``node``."""
    out = {}
    for pid_file in (system.work / "mps" / node).glob("*/pipe/standin.pid"):
        with contextlib.suppress(OSError, ValueError):
            out[pid_file.parent.parent.name] = int(pid_file.read_text().strip())
    return out
