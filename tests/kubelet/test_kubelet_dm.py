"""The device plugin against kubelet's own device manager (``kubelet-dm`` from ``../shared/k8s``).

One cluster (etcd, kube-apiserver) per module and one ``kubelet-dm`` node; the plugin runs in this
process (``DevicePluginApp``, simulated backend) with the admin kubeconfig. Checked here, against the
real kubelet code: registration, a dropped ListAndWatch stream (kubelet's ``runClient`` disconnects the
plugin), kubelet-dm restarts (as a kubelet restart and as a node reboot), the plugin's restart, pods
admitted in kubelet's order with the assignment honoured, an ``Allocate`` refusal turning into
``UnexpectedAdmissionError``, and what each container would receive (``kubelet-dm/run-options``).

Where ``../shared/k8s`` is absent every test here skips and says why. Waits are bounded; the
cluster is stopped with ``cluster down`` whatever happens.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from deviceplugin.app import DevicePluginApp
from deviceplugin.kube import load_api_client
from deviceplugin.settings import Settings
from deviceplugin.simulated import SimulatedBackend, builtin_topology
from deviceplugin.stamping import PodResourcesClient

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT.parent / "shared" / "k8s"
CLUSTER = K8S / "cluster"
RESOURCE = "example.com/gpu-slice"
NODE = "n1"
TOPO = builtin_topology(NODE)
MIG, MPS = TOPO.gpus

pytestmark = [
    pytest.mark.skipif(not CLUSTER.exists(), reason=f"kubelet-dm is not here: {K8S} is absent"),
    pytest.mark.timeout(120),
]


def _cluster(*args: str, timeout: float = 60) -> str:
    done = subprocess.run([str(CLUSTER), *args], capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"cluster {' '.join(args)} failed: {done.stderr[-2000:]}")
    return done.stdout


@dataclass
class Cluster:
    dir: Path
    node: dict[str, Any]

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    def start_node(self, *flags: str) -> float:
        """(Re)start kubelet-dm for NODE; returns the monotonic time it was ready."""
        extra = ["--", *flags] if flags else []
        self.node = json.loads(_cluster("node", str(self.dir), NODE, *extra).strip().splitlines()[-1])
        return time.monotonic()

    def stop_node(self) -> None:
        _cluster("stop", str(self.dir), f"node-{NODE}")

    def log(self) -> str:
        return Path(self.node["log"]).read_text(errors="replace")


@contextmanager
def running_cluster() -> Iterator[Cluster]:
    """etcd, kube-apiserver and one kubelet-dm node (NODE), stopped with ``cluster down`` however it ends."""
    path = Path(tempfile.mkdtemp(prefix="gk-", dir="/tmp"))
    try:
        _cluster("up", str(path))
        c = Cluster(path, {})
        c.start_node()
        yield c
    finally:
        subprocess.run([str(CLUSTER), "down", str(path)], capture_output=True, timeout=90, check=False)
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with running_cluster() as c:
        yield c


class Api:
    """The test's side of the API server (admin), through the official client."""

    def __init__(self, kubeconfig: Path) -> None:
        from kubernetes import client

        self.api_client = load_api_client(kubeconfig, timeout_s=10)
        self.core = client.CoreV1Api(self.api_client)

    def create_pod(self, name: str, count: int, *, ids: tuple[str, ...] | None = None, gpu: str = "",
                   instance: str | None = None, at: str = "2026-01-01T00:00:00Z") -> str:
        """A bare pod bound to NODE asking ``count`` slices, with an extender assignment when ``ids``."""
        meta: dict[str, Any] = {"name": name, "namespace": "default"}
        body: dict[str, Any] = {
            "apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"nodeName": NODE, "restartPolicy": "Never", "containers": [{
                "name": "main", "image": "llm",
                "resources": {"limits": {RESOURCE: str(count)}, "requests": {RESOURCE: str(count)}}}]}}
        created = self.core.create_namespaced_pod("default", body)
        uid = str(created.metadata.uid)
        if ids is not None:
            assignment = {"v": 1, "podUID": uid, "node": NODE, "gpus": [gpu], "instance": instance,
                          "sliceIds": list(ids), "policy": "fragmentation", "scores": {}, "time": at}
            # kubelet-dm may admit before the patch lands: tests that need the assignment create the
            # pod, patch it, and only then look at admission (see ``assigned_pod``).
            self.core.patch_namespaced_pod(name, "default", {"metadata": {"annotations": {
                "example.com/gpu-slice.assignment": json.dumps(assignment)}}})
        return uid

    def pod(self, name: str) -> Any:
        return self.core.read_namespaced_pod(name, "default")

    def delete_all(self) -> None:
        self.core.delete_collection_namespaced_pod("default", grace_period_seconds=0)

    def allocatable(self) -> int:
        node = self.core.read_node(NODE)
        return int((node.status.allocatable or {}).get(RESOURCE, "0"))

    def close(self) -> None:
        self.api_client.close()


async def until(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    """Poll ``predicate`` (run in a thread: it may call the API) every 50 ms until it is truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


@dataclass
class Plugin:
    app: DevicePluginApp
    stop: asyncio.Event
    task: asyncio.Task[None]

    async def close(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 30)


@dataclass
class Env:
    cluster: Cluster
    api: Api
    dir: Path
    plugin: Plugin | None = None

    def settings(self, **overrides: Any) -> Settings:
        node = self.cluster.node
        base = Settings(node_name=NODE, backend="simulated", plugin_dir=Path(node["pluginDir"]),
                        pod_resources_socket=Path(node["podResourcesSocket"]), kubeconfig=self.cluster.kubeconfig,
                        metrics_port=0, mps_root=self.dir / "mps", dir_poll_s=0.05, stamp_backoff_s=0.05,
                        stamp_resync_s=0.5, rediscover_s=0.3)
        return replace(base, **overrides).validate()

    async def start(self, **overrides: Any) -> Plugin:
        plugin = await self.start_unready(**overrides)
        await self.healthy(14)
        return plugin

    async def start_unready(self, **overrides: Any) -> Plugin:
        """Registered, without waiting for every slice to be healthy."""
        app = DevicePluginApp(self.settings(**overrides), backend=SimulatedBackend(TOPO))
        stop = asyncio.Event()
        self.plugin = Plugin(app, stop, asyncio.create_task(app.run(stop)))
        await asyncio.wait_for(app.ready.wait(), 20)
        return self.plugin

    async def healthy(self, n: int, timeout: float = 20.0) -> None:
        """kubelet lists ``n`` healthy ids of ours (PodResources GetAllocatableResources)."""
        client = PodResourcesClient(Path(self.cluster.node["podResourcesSocket"]))
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    got = sum(len(ids) for r, ids in await client.allocatable() if r == RESOURCE)
                except Exception:  # kubelet-dm restarting
                    got = -1
                if got == n:
                    return
                if time.monotonic() > deadline:
                    raise AssertionError(f"kubelet lists {got} healthy ids of {RESOURCE}, not {n}")
                await asyncio.sleep(0.05)
        finally:
            await client.close()

    async def running(self, name: str) -> Any:
        return await until(lambda: (p := self.api.pod(name)).status.phase == "Running" and p, what=f"{name} Running")

    async def failed(self, name: str) -> Any:
        return await until(lambda: (p := self.api.pod(name)).status.phase == "Failed" and p, what=f"{name} Failed")

    async def close(self) -> None:
        """Stop the plugin, delete every pod, close the client, remove the work directory."""
        if self.plugin is not None and not self.plugin.task.done():
            await self.plugin.close()
        await asyncio.to_thread(self.api.delete_all)
        self.api.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
async def env(cluster: Cluster) -> AsyncIterator[Env]:
    api = Api(cluster.kubeconfig)
    work = Path(tempfile.mkdtemp(prefix="gkp-", dir="/tmp"))
    e = Env(cluster, api, work)
    try:
        yield e
    finally:
        await e.close()


def run_options(pod: Any) -> dict[str, Any]:
    raw = (pod.metadata.annotations or {}).get("kubelet-dm/run-options")
    assert raw, f"pod {pod.metadata.name} has no run-options"
    value: dict[str, Any] = json.loads(raw)["main"]
    return value


# --------------------------------------------------------------------------- registration and streams


async def test_registers_and_kubelet_sees_every_slice(env: Env) -> None:
    await env.start()
    assert await until(lambda: env.api.allocatable() == 14, what="node allocatable 14")


async def test_dropped_stream_is_noticed_and_the_plugin_registers_again(env: Env) -> None:
    plugin = await env.start()
    registrar = plugin.app.registrar
    servicer = plugin.app.servicer
    assert registrar is not None and servicer is not None
    before = registrar.registrations
    t0 = time.monotonic()
    servicer.end_streams()  # kubelet's client.Run returns; runClient disconnects the plugin
    await until(lambda: registrar.registrations > before, what="a new Register")
    await env.healthy(14)
    elapsed = time.monotonic() - t0
    assert registrar.registrations == before + 1 and registrar.stream_losses == 1
    assert "ListAndWatch ended unexpectedly" in env.cluster.log()
    assert elapsed < 5, f"re-registered after a dropped stream in {elapsed:.2f}s"
    await asyncio.sleep(0.5)  # and it stays registered
    await env.healthy(14, timeout=1)


async def test_kubelet_restart_re_registers_within_the_bar(env: Env) -> None:
    plugin = await env.start()
    assert plugin.app.registrar is not None
    before = plugin.app.registrar.registrations
    await asyncio.to_thread(env.cluster.stop_node)
    ready = await asyncio.to_thread(env.cluster.start_node)
    await env.healthy(14)
    elapsed = time.monotonic() - ready
    assert plugin.app.registrar.registrations > before
    assert elapsed < 5, f"re-registered {elapsed:.2f}s after kubelet-dm came back"


# --------------------------------------------------------------------------- admission


async def assigned_pod(env: Env, name: str, ids: tuple[str, ...], gpu: str, instance: str | None,
                       at: str) -> str:
    """A pod with an extender assignment, bound to NODE afterwards (as the extender's /bind does)."""
    return await asyncio.to_thread(_create_assigned, env.api, name, ids, gpu, instance, at)


def _create_assigned(api: Api, name: str, ids: tuple[str, ...], gpu: str, instance: str | None, at: str) -> str:
    """Create unbound, write the assignment with the UID, then bind (as the extender's /bind does)."""
    from kubernetes import client

    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"restartPolicy": "Never", "schedulerName": "none", "containers": [{
                "name": "main", "image": "llm",
                "resources": {"limits": {RESOURCE: str(len(ids))}, "requests": {RESOURCE: str(len(ids))}}}]}}
    created = api.core.create_namespaced_pod("default", body)
    uid = str(created.metadata.uid)
    assignment = {"v": 1, "podUID": uid, "node": NODE, "gpus": [gpu], "instance": instance,
                  "sliceIds": list(ids), "policy": "fragmentation", "scores": {}, "time": at}
    api.core.patch_namespaced_pod(name, "default", {"metadata": {"annotations": {
        "example.com/gpu-slice.assignment": json.dumps(assignment)}}})
    binding = client.V1Binding(metadata=client.V1ObjectMeta(name=name, namespace="default"),
                               target=client.V1ObjectReference(kind="Node", name=NODE, api_version="v1"))
    api.core.create_namespaced_binding("default", binding, _preload_content=False)
    return uid


def allocated(pod: Any) -> list[str] | None:
    raw = (pod.metadata.annotations or {}).get("example.com/gpu-slice.allocated")
    return None if raw is None else sorted(json.loads(raw)["sliceIds"])


async def test_assignment_honoured_and_each_container_gets_its_devices(env: Env) -> None:
    await env.start()
    inst = MIG.instances[3]  # 3g.40gb
    await assigned_pod(env, "mig-pod", inst.slice_ids(), MIG.uuid, inst.uuid, "2026-01-01T00:00:01Z")
    mps_ids = MPS.slice_ids()[2:4]
    await assigned_pod(env, "mps-pod", mps_ids, MPS.uuid, None, "2026-01-01T00:00:02Z")
    mig_pod = await env.running("mig-pod")
    mps_pod = await env.running("mps-pod")
    opts = run_options(mig_pod)
    vendor = env.settings().cdi_vendor
    # Exactly the slice's MIG instance, and an image's NVIDIA_VISIBLE_DEVICES=all exposes nothing more.
    assert opts["cdiDevices"] == [f"{vendor}/gpu={inst.uuid}"]
    assert opts["envs"]["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert opts["envs"]["GPU_SLICE_COUNT"] == "3"
    mps_opts = run_options(mps_pod)
    assert mps_opts["cdiDevices"] == [f"{vendor}/gpu={MPS.uuid}"]
    assert mps_opts["envs"]["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert {m["containerPath"] for m in mps_opts["mounts"]} >= {"/dev/shm", "/run/gpu-slice/mps/pipe"}
    got = await until(lambda: allocated(env.api.pod("mps-pod")), what="the allocated stamp")
    assert got == sorted(mps_ids)
    assert await until(lambda: allocated(env.api.pod("mig-pod")), what="stamp") == sorted(inst.slice_ids())


async def test_a_cdi_spec_without_an_advertised_uuid_turns_it_unhealthy_in_kubelet(env: Env) -> None:
    """A stale spec (the 3g instance re-created since it was written, names by index): kubelet sees that
    instance's ids Unhealthy and allocates none of them; a regenerated spec brings them back."""
    spec = env.dir / "cdi" / "nvidia.yaml"
    spec.parent.mkdir(parents=True)
    stale = MIG.instances[3]
    names = ["0", "1", "all", MPS.uuid, *(i.uuid for i in MIG.instances[:3])]
    spec.write_text(yaml.safe_dump({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
                                    "devices": [{"name": n, "containerEdits": {}} for n in names]}))
    plugin = await env.start_unready(cdi_validate=True, cdi_spec_dirs=(spec.parent,), reconcile_s=0.5)
    await env.healthy(14 - stale.compute_slices)
    assert plugin.app.state is not None and plugin.app.state.unhealthy[stale.uuid].startswith(
        f"CDI device nvidia.com/gpu={stale.uuid} is not defined by the node's CDI spec")
    await asyncio.to_thread(env.api.create_pod, "wants-3", 3)  # the stale 3g instance is the best fit
    await env.running("wants-3")
    got = await until(lambda: allocated(env.api.pod("wants-3")), what="the allocated stamp")
    assert not set(got) & set(stale.slice_ids()) and set(got) <= set(MPS.slice_ids())
    names.append(stale.uuid)
    spec.write_text(yaml.safe_dump({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
                                    "devices": [{"name": n} for n in names]}))
    await env.healthy(14)


async def test_allocate_refusal_is_an_unexpected_admission_error(env: Env) -> None:
    await env.start()
    await asyncio.to_thread(env.api.create_pod, "too-big", 9)  # fits no GPU: kubelet tops up at random
    pod = await env.failed("too-big")
    assert pod.status.reason == "UnexpectedAdmissionError"
    assert "gpu-slice: ids form no valid placement" in pod.status.message


async def test_cordon_keeps_a_running_pod_admissible_after_a_node_reboot(env: Env) -> None:
    await env.start()
    mps_ids = MPS.slice_ids()[:3]
    await assigned_pod(env, "survivor", mps_ids, MPS.uuid, None, "2026-01-01T00:00:03Z")
    await env.running("survivor")
    # kubelet-dm's informer may see the bound pod before the plugin's watch: the preferred
    # allocation waits for the cache, so the assignment is still what kubelet gives.
    assert await until(lambda: allocated(env.api.pod("survivor")), what="the stamp") == sorted(mps_ids)
    await asyncio.to_thread(env.api.core.patch_node, NODE, {"metadata": {"annotations": {
        "example.com/gpu-slice.cordon": MPS.uuid}}})
    await env.healthy(14 - (7 - 3))  # the cordoned GPU's free ids go Unhealthy, the pod's stay Healthy
    try:
        await asyncio.to_thread(env.cluster.stop_node)
        await asyncio.to_thread(env.cluster.start_node, "--restart-as=node-reboot")
        pod = await until(lambda: (p := env.api.pod("survivor")).status.container_statuses
                          and p.status.container_statuses[0].restart_count >= 1 and p, what="re-admission")
        assert pod.status.phase == "Running", pod.status.message
    finally:
        await asyncio.to_thread(env.api.core.patch_node, NODE, {"metadata": {"annotations": {
            "example.com/gpu-slice.cordon": None}}})
        await asyncio.to_thread(env.cluster.stop_node)
        await asyncio.to_thread(env.cluster.start_node)


async def test_a_resource_nobody_registered_is_dropped_as_the_stand_in_says(env: Env) -> None:
    """lifecycle/predicate.go removeMissingExtendedResources: the pod is admitted without devices."""
    from tests.kubelet.standin import KubeletStandin, slice_pod

    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "unknown", "namespace": "default"},
            "spec": {"nodeName": NODE, "restartPolicy": "Never", "containers": [{
                "name": "main", "image": "x",
                "resources": {"limits": {"example.com/unknown": "1"}, "requests": {"example.com/unknown": "1"}}}]}}
    await asyncio.to_thread(env.api.core.create_namespaced_pod, "default", body)
    pod = await env.running("unknown")
    assert not run_options(pod).get("cdiDevices")
    standin = KubeletStandin(env.dir / "dp", env.dir / "pr")
    standin.start()
    try:
        [res] = standin.admit([slice_pod("unknown", 1, created=1.0, resource="example.com/unknown")])
    finally:
        standin.stop()
    assert res.admitted and res.ids() == frozenset()
