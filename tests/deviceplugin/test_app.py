"""End to end: the whole plugin (``DevicePluginApp``) with the kubelet stand-in and the fake API server.

Every scenario of the issue: registration after the pod cache synced, inventory publishing, the
assignment path with stamps, kubelet restart, plugin restart with running pods, health change and
recovery, an MPS daemon dying, cordon, two same-size pods admitted in the opposite order of their
binds, a pod deleted between bind and admission, a GPU another resource advertises, no API access,
and /metrics. Waits are bounded; nothing asserts on elapsed time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable
from concurrent import futures
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from deviceplugin.app import DevicePluginApp
from deviceplugin.assignments import check_placement
from deviceplugin.errors import DevicePluginError
from deviceplugin.mps import MpsOptions, pipe_dir, standin_command
from deviceplugin.mps_supervisor import MpsSupervisor
from deviceplugin.settings import Settings, load_config_file
from deviceplugin.simulated import SimulatedBackend, builtin_topology
from gpuslice.model import Gpu
from tests.fakeapi.server import FakeApiServer
from tests.kubelet.standin import KubeletStandin, slice_pod

RESOURCE = "example.com/gpu-slice"
NODE = "node-a"
TOPO = builtin_topology(NODE)
MIG: Gpu = TOPO.gpus[0]  # 2g.20gb@0, 1g.10gb@2, 1g.10gb@3, 3g.40gb@4
MPS: Gpu = TOPO.gpus[1]
ALL_IDS = frozenset(sid for g in TOPO.gpus for sid in g.slice_ids())


async def until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` every 20 ms; fail the test after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


@dataclass
class Running:
    app: DevicePluginApp
    stop: asyncio.Event
    task: asyncio.Task[None]

    async def close(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 20)


@dataclass
class Env:
    kubelet: KubeletStandin
    api: FakeApiServer
    dir: Path
    plugin: Running | None = None

    @property
    def app(self) -> DevicePluginApp:
        assert self.plugin is not None
        return self.plugin.app

    def settings(self, **overrides: Any) -> Settings:
        base = Settings(node_name=NODE, backend="simulated", plugin_dir=self.kubelet.plugin_dir,
                        pod_resources_socket=self.kubelet.pod_resources_socket, metrics_port=0,
                        mps_root=self.dir / "mps", dir_poll_s=0.05, stamp_backoff_s=0.02, stamp_resync_s=0.5,
                        rediscover_s=0.3, kube_timeout_s=5.0, preferred_wait_s=0.3,
                        preferred_wait_empty_s=0.3)
        return replace(base, **overrides).validate()

    async def start(self, *, backend: SimulatedBackend | None = None, kube: bool = True,
                    wait: bool = True, **overrides: Any) -> Running:
        settings = self.settings(use_kube=kube, **overrides)
        app = DevicePluginApp(settings, backend=backend or SimulatedBackend(TOPO),
                              api_client=self.api.client() if kube else None)
        stop = asyncio.Event()
        task = asyncio.create_task(app.run(stop))
        self.plugin = Running(app, stop, task)
        if wait:
            await asyncio.wait_for(app.ready.wait(), 10)
            await self.kubelet.wait_for_registration_async(RESOURCE, after=self.kubelet.generation - 1)
        return self.plugin

    # ---- the extender's side, written by hand as JSON (the wire contract)

    def bind(self, name: str, ids: tuple[str, ...], *, at: str, gpus: tuple[str, ...], instance: str | None,
             created: str = "2025-01-01T00:00:00Z", annotations: dict[str, str] | None = None) -> str:
        uid = f"uid-{name}"
        assignment = {"v": 1, "podUID": uid, "node": NODE, "gpus": list(gpus), "instance": instance,
                      "sliceIds": list(ids), "policy": "fragmentation", "scores": {"fragmentation": 0.5},
                      "time": at}
        self.api.store.put_pod({
            "metadata": {"name": name, "namespace": "default", "uid": uid, "creationTimestamp": created,
                         "annotations": {"example.com/gpu-slice.assignment": json.dumps(assignment),
                                         **(annotations or {})}},
            "spec": {"nodeName": NODE, "schedulerName": "gpu-slice-scheduler", "containers": [{
                "name": "main", "image": "llm",
                "resources": {"limits": {RESOURCE: str(len(ids))}, "requests": {RESOURCE: str(len(ids))}}}]},
        })
        return uid

    def cordon(self, value: str | None) -> None:
        def mutate(node: dict[str, Any]) -> None:
            annotations = node["metadata"].setdefault("annotations", {})
            if value is None:
                annotations.pop("example.com/gpu-slice.cordon", None)
            else:
                annotations["example.com/gpu-slice.cordon"] = value
        self.api.store.update_node(NODE, mutate)

    def allocated(self, name: str) -> list[str] | None:
        raw = self.api.store.get_pod(name).get("metadata", {}).get("annotations", {}).get(
            "example.com/gpu-slice.allocated")
        return None if raw is None else sorted(json.loads(raw)["sliceIds"])

    def events(self, reason: str) -> list[dict[str, Any]]:
        items, _ = self.api.store.list("events")
        return [e for e in items if e.get("reason") == reason]

    async def seen(self, *names: str) -> None:
        """The plugin's pod cache has these pods (the watch delivered them)."""
        await until(lambda: all(self.app.book is not None and self.app.book.pod_by_key(("default", n))
                                for n in names), what=f"pods {names} in the cache")


@pytest.fixture
async def env(kubelet: KubeletStandin, fake_api: FakeApiServer, sock_dir: Path) -> AsyncIterator[Env]:
    fake_api.store.put_node({"metadata": {"name": NODE}})
    e = Env(kubelet, fake_api, sock_dir)
    try:
        yield e
    finally:
        if e.plugin is not None and not e.plugin.task.done():
            await e.plugin.close()


def inst(n: int) -> tuple[str, tuple[str, ...]]:
    i = MIG.instances[n]
    return i.uuid, i.slice_ids()


# --------------------------------------------------------------------------- registration


async def test_registers_only_after_the_pod_cache_synced(env: Env) -> None:
    uuid, ids = inst(0)
    env.bind("early", ids, at="2025-01-01T00:00:00Z", gpus=(MIG.uuid,), instance=uuid)
    env.api.fail_next("list", "/api/v1/pods", code=500, times=3)
    plugin = await env.start()
    assert env.api.request_count("list", "/api/v1/pods") >= 4
    assert plugin.app.book is not None and plugin.app.book.pod_by_key(("default", "early")) is not None
    reg = env.kubelet.registrations[-1]
    assert reg.resource == RESOURCE and reg.options.get_preferred_allocation_available
    assert env.kubelet.devices(RESOURCE).allocatable == ALL_IDS


async def test_publishes_inventory_annotation_and_labels(env: Env) -> None:
    await env.start()

    def published() -> bool:
        meta = env.api.store.get_node(NODE)["metadata"]
        return "example.com/gpu-slice.inventory" in (meta.get("annotations") or {})

    await until(published)
    meta = env.api.store.get_node(NODE)["metadata"]
    inventory = json.loads(meta["annotations"]["example.com/gpu-slice.inventory"])
    assert inventory["v"] == 1
    assert [g["uuid"] for g in inventory["gpus"]] == [MIG.uuid, MPS.uuid]
    assert [g["mode"] for g in inventory["gpus"]] == ["mig", "mps"]
    assert meta["labels"]["example.com/gpu-slice.mode"] == "mixed"
    assert meta["labels"]["example.com/gpu-slice.product"] == "H100-80GB"


# --------------------------------------------------------------------------- the assignment path


async def test_assignment_is_honoured_and_stamped(env: Env) -> None:
    await env.start()
    uuid, ids = inst(3)  # 3g.40gb
    uid = env.bind("llm", ids, at="2025-01-01T00:00:01Z", gpus=(MIG.uuid,), instance=uuid)
    await env.seen("llm")
    [res] = await env.kubelet.admit_async([slice_pod("llm", 3, created=1.0, uid=uid)])
    assert res.admitted, res.error
    assert res.ids() == frozenset(ids)
    assert res.containers[0].preferred is not None and set(res.containers[0].preferred.answer) == set(ids)
    await until(lambda: env.allocated("llm") is not None)
    assert env.allocated("llm") == sorted(ids)
    assert env.app.stamper is not None and env.app.stamper.mismatches == 0


async def _bind_and_admit_two(env: Env, second_created: str) -> tuple[list[Any], tuple[str, ...], tuple[str, ...]]:
    """"second" is bound first (older assignment) with ``second_created``, "first" after it, created
    at 00:00:00; this kubelet admits "first" first. Returns the admissions and both pods' ids."""
    await env.start()
    u1, ids1 = inst(1)
    u2, ids2 = inst(2)
    uid_second = env.bind("second", ids1, at="2025-01-01T00:00:01Z", gpus=(MIG.uuid,), instance=u1,
                          created=second_created)
    uid_first = env.bind("first", ids2, at="2025-01-01T00:00:02Z", gpus=(MIG.uuid,), instance=u2,
                         created="2025-01-01T00:00:00Z")
    await env.seen("first", "second")
    results = await env.kubelet.admit_async([slice_pod("second", 1, created=2.0, uid=uid_second),
                                             slice_pod("first", 1, created=1.0, uid=uid_first)])
    assert [r.pod.name for r in results] == ["first", "second"]
    assert all(r.admitted for r in results), [r.error for r in results]
    return results, ids1, ids2


async def test_same_size_pods_bound_out_of_creation_order_each_get_their_own(env: Env) -> None:
    # "second" was created later: kubelet admits by creation time, and so does the plugin's guess.
    results, ids1, ids2 = await _bind_and_admit_two(env, "2025-01-01T00:00:01Z")
    assert results[0].ids() == frozenset(ids2) and results[1].ids() == frozenset(ids1)
    await until(lambda: env.allocated("first") == sorted(ids2) and env.allocated("second") == sorted(ids1))
    assert env.app.stamper is not None and env.app.stamper.mismatches == 0


async def test_same_size_pods_admitted_against_the_plugins_guess_are_counted(env: Env) -> None:
    # Same creation second: the plugin guesses binding order ("second" first), but this kubelet
    # admits "first" first (its own tie-break), so the two swap.
    results, ids1, ids2 = await _bind_and_admit_two(env, "2025-01-01T00:00:00Z")
    inventory = env.app.state.inventory() if env.app.state else None
    assert inventory is not None
    for r in results:  # each pod ends on one valid placement
        check_placement(inventory, r.ids())
    assert results[0].ids() | results[1].ids() == frozenset(ids1) | frozenset(ids2)
    await until(lambda: env.allocated("first") is not None and env.allocated("second") is not None)
    assert env.allocated("first") == sorted(results[0].ids())
    assert env.allocated("second") == sorted(results[1].ids())
    # The plugin guessed binding order, so the pod admitted first took the other pod's slices:
    # both mismatches are counted (metric) and reported (events), once each.
    assert results[0].ids() == frozenset(ids1) and results[1].ids() == frozenset(ids2)
    assert env.app.stamper is not None
    await until(lambda: len(env.events("SliceAssignmentMismatch")) == 2)
    assert env.app.stamper.mismatches == 2
    count = env.app.registry.get_sample_value("gpu_slice_plugin_allocation_mismatches_total", {"kind": "stamp"})
    assert count == 2.0


async def test_pod_deleted_between_bind_and_admission(env: Env) -> None:
    await env.start()
    u1, ids1 = inst(1)
    u2, ids2 = inst(2)
    env.bind("gone", ids1, at="2025-01-01T00:00:01Z", gpus=(MIG.uuid,), instance=u1)
    uid = env.bind("stays", ids2, at="2025-01-01T00:00:02Z", gpus=(MIG.uuid,), instance=u2)
    await env.seen("gone", "stays")
    env.api.store.remove("pods", "gone", "default")
    await until(lambda: env.app.book is not None and env.app.book.pod_by_key(("default", "gone")) is None)
    [res] = await env.kubelet.admit_async([slice_pod("stays", 1, created=1.0, uid=uid)])
    assert res.admitted and res.ids() == frozenset(ids2)
    await until(lambda: env.allocated("stays") == sorted(ids2))
    assert env.app.stamper is not None and env.app.stamper.mismatches == 0


async def test_pod_without_assignment_gets_a_best_fit_that_skips_pending_assignments(env: Env) -> None:
    await env.start()
    held = MPS.slice_ids()[:3]  # a pending 3-slice MPS assignment
    env.bind("assigned", held, at="2025-01-01T00:00:01Z", gpus=(MPS.uuid,), instance=None)
    await env.seen("assigned")
    # A 2-slice pod of another scheduler (no pending assignment of that size): the tightest fit is
    # the MPS GPU's remaining slices, never the pending ones.
    [res] = await env.kubelet.admit_async([slice_pod("foreign", 2, created=1.0)])
    assert res.admitted, res.error
    assert res.ids() <= frozenset(MPS.slice_ids())
    assert not res.ids() & frozenset(held)


# --------------------------------------------------------------------------- restarts


async def test_kubelet_restart_re_registers(env: Env) -> None:
    plugin = await env.start()
    assert plugin.app.registrar is not None
    before, count = env.kubelet.generation, plugin.app.registrar.registrations
    await asyncio.to_thread(env.kubelet.restart)
    await env.kubelet.wait_for_registration_async(RESOURCE, after=before, timeout=10)
    # kubelet records the Register call before it returns; the plugin counts it after the reply
    registrar = plugin.app.registrar
    await until(lambda: registrar.registrations > count, 5.0, "the new registration counted")
    assert env.kubelet.devices(RESOURCE).allocatable == ALL_IDS


async def test_plugin_restart_with_running_pods_keeps_ids_and_frees_nothing(env: Env) -> None:
    plugin = await env.start()
    uuid, ids = inst(3)
    uid = env.bind("running", ids, at="2025-01-01T00:00:01Z", gpus=(MIG.uuid,), instance=uuid)
    mps_ids = MPS.slice_ids()[:2]
    uid_m = env.bind("mps-running", mps_ids, at="2025-01-01T00:00:02Z", gpus=(MPS.uuid,), instance=None)
    await env.seen("running", "mps-running")
    results = await env.kubelet.admit_async([slice_pod("running", 3, created=1.0, uid=uid),
                                             slice_pod("mps-running", 2, created=2.0, uid=uid_m)])
    assert all(r.admitted for r in results)
    await until(lambda: env.allocated("running") is not None and env.allocated("mps-running") is not None)
    stamps = (env.allocated("running"), env.allocated("mps-running"))
    await plugin.close()
    assert not (env.kubelet.plugin_dir / "gpu-slice.sock").exists()

    plugin2 = await env.start()
    assert env.kubelet.devices(RESOURCE).capacity == ALL_IDS  # the same ids
    in_use = env.kubelet.devices(RESOURCE).in_use
    assert frozenset(ids) | frozenset(mps_ids) <= in_use  # nothing freed
    assert plugin2.app.book is not None
    assert set(plugin2.app.book.admitted) == {("default", "running"), ("default", "mps-running")}
    assert not plugin2.app.book.pending()
    assert (env.allocated("running"), env.allocated("mps-running")) == stamps
    # A new pod of another scheduler does not land on the running pods' slices.
    [res] = await env.kubelet.admit_async([slice_pod("next", 2, created=3.0)])
    assert res.admitted and not res.ids() & in_use


# --------------------------------------------------------------------------- health, MPS, cordon


async def test_health_change_and_recovery(env: Env) -> None:
    backend = SimulatedBackend(TOPO)
    await env.start(backend=backend)
    backend.inject_fault(MIG.uuid, "XID 79: GPU has fallen off the bus")
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE,
                            lambda d: d.unhealthy == frozenset(MIG.slice_ids()))
    await until(lambda: bool(env.events("GpuUnhealthy")))
    assert "XID 79" in env.events("GpuUnhealthy")[0]["message"]

    def gpu0_healthy() -> bool | None:
        raw = (env.api.store.get_node(NODE)["metadata"].get("annotations") or {}).get(
            "example.com/gpu-slice.inventory")
        return None if raw is None else bool(json.loads(raw)["gpus"][0]["healthy"])

    await until(lambda: gpu0_healthy() is False)
    backend.recover(MIG.uuid)
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE, lambda d: not d.unhealthy)
    await until(lambda: gpu0_healthy() is True)


async def test_mig_instance_fault_marks_only_its_slices(env: Env) -> None:
    backend = SimulatedBackend(TOPO)
    await env.start(backend=backend)
    uuid, ids = inst(3)
    backend.inject_fault(MIG.uuid, "XID 48", instance_uuid=uuid)
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE, lambda d: d.unhealthy == frozenset(ids))


async def test_mps_daemon_dying_turns_its_slices_unhealthy_until_it_answers_again(env: Env) -> None:
    root = env.dir / "mps"
    supervisor = MpsSupervisor(MpsOptions(root=root, control_command=standin_command(), probe_interval_s=0.1,
                                          probe_timeout_s=2.0, tick_s=0.05, backoff_initial_s=0.1,
                                          backoff_max_s=0.5, extra_env={"GPU_SLICE_MPS_STANDIN_LIFETIME_S": "60"}))
    backend = SimulatedBackend(TOPO, mps=supervisor)
    await env.start(backend=backend)
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE, lambda d: not d.unhealthy, 15)
    pid_file = pipe_dir(root, MPS.uuid) / "standin.pid"
    await until(pid_file.exists)
    restarts_before = len(env.events("GpuRecovered"))
    os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE,
                            lambda d: d.unhealthy == frozenset(MPS.slice_ids()), 15)
    await until(lambda: bool(env.events("GpuUnhealthy")))
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE, lambda d: not d.unhealthy, 15)
    await until(lambda: len(env.events("GpuRecovered")) > restarts_before)


async def test_cordon_stops_new_pods_but_not_pending_assignments(env: Env) -> None:
    await env.start()
    mps_ids = MPS.slice_ids()[:3]
    uid = env.bind("before-cordon", mps_ids, at="2025-01-01T00:00:01Z", gpus=(MPS.uuid,), instance=None)
    await env.seen("before-cordon")
    cordon = env.cordon
    cordon(MPS.uuid)
    others = frozenset(MPS.slice_ids()) - frozenset(mps_ids)
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE, lambda d: d.unhealthy == others)
    [res] = await env.kubelet.admit_async([slice_pod("before-cordon", 3, created=1.0, uid=uid)])
    assert res.admitted and res.ids() == frozenset(mps_ids)
    cordon(None)
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE, lambda d: not d.unhealthy)


async def test_cordon_keeps_running_pods_ids_healthy_so_they_are_re_admitted_after_a_reboot(env: Env) -> None:
    """kubelet re-admits a pod only if its checkpointed ids are Healthy (manager.go devicesToAllocate)."""
    await env.start()
    mps_ids = MPS.slice_ids()[:3]
    uid = env.bind("running", mps_ids, at="2025-01-01T00:00:01Z", gpus=(MPS.uuid,), instance=None)
    await env.seen("running")
    [res] = await env.kubelet.admit_async([slice_pod("running", 3, created=1.0, uid=uid)])
    assert res.admitted and res.ids() == frozenset(mps_ids)
    await until(lambda: env.allocated("running") is not None)
    env.cordon(MPS.uuid)
    others = frozenset(MPS.slice_ids()) - frozenset(mps_ids)
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE, lambda d: d.unhealthy == others)
    gen = env.kubelet.generation
    await asyncio.to_thread(env.kubelet.restart, "node-reboot")
    await env.kubelet.wait_for_registration_async(RESOURCE, after=gen)
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE, lambda d: d.unhealthy == others)
    [again] = await env.kubelet.admit_async([slice_pod("running", 3, created=1.0, uid=uid)])
    assert again.admitted, again.error
    assert again.ids() == frozenset(mps_ids)
    # A new pod still cannot land on the cordoned GPU.
    [new] = await env.kubelet.admit_async([slice_pod("new", 2, created=2.0)])
    assert new.admitted and not new.ids() & frozenset(MPS.slice_ids())


# --------------------------------------------------------------------------- coexistence, no API, metrics


class _NvidiaPlugin(pb_grpc.DevicePluginServicer):
    """A stand-in for NVIDIA's plugin advertising one GPU as nvidia.com/gpu."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids

    def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions()

    def ListAndWatch(self, request: pb.Empty, context: Any) -> Any:
        yield pb.ListAndWatchResponse(devices=[pb.Device(ID=i, health="Healthy") for i in self.ids])
        done = threading.Event()
        context.add_callback(done.set)  # the stream stays open until kubelet hangs up (bounded)
        done.wait(30)


async def test_gpu_already_advertised_by_another_resource_is_refused(env: Env,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_DevicePluginServicer_to_server(_NvidiaPlugin([MPS.uuid]), server)
    sock = env.kubelet.plugin_dir / "nvidia-gpu.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        def register() -> None:
            with grpc.insecure_channel(f"unix://{env.kubelet.kubelet_socket}") as ch:
                pb_grpc.RegistrationStub(ch).Register(pb.RegisterRequest(
                    version="v1beta1", endpoint="nvidia-gpu.sock", resource_name="nvidia.com/gpu"), timeout=10)

        await asyncio.to_thread(register)
        await env.kubelet.wait_for_registration_async("nvidia.com/gpu")
        with caplog.at_level(logging.WARNING, logger="deviceplugin"):
            await env.start()
        assert env.kubelet.devices(RESOURCE).capacity == frozenset(MIG.slice_ids())
        assert any("nvidia.com/gpu already advertises it" in r.getMessage() for r in caplog.records)
        await until(lambda: bool(env.events("GpuRefused")))
        assert MPS.uuid in env.events("GpuRefused")[0]["message"]
    finally:
        if env.plugin is not None:
            await env.plugin.close()
        server.stop(0)


async def test_gpu_with_running_pods_is_never_withdrawn_when_another_resource_appears(env: Env) -> None:
    """GetAllocatableResources lists only plugins registered now: a later one must not cost running pods."""
    await env.start(reconcile_s=0.2, conflict_taint=True)
    mps_ids = MPS.slice_ids()[:2]
    uid = env.bind("held", mps_ids, at="2025-01-01T00:00:01Z", gpus=(MPS.uuid,), instance=None)
    await env.seen("held")
    [res] = await env.kubelet.admit_async([slice_pod("held", 2, created=1.0, uid=uid)])
    assert res.admitted
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_DevicePluginServicer_to_server(_NvidiaPlugin([MPS.uuid]), server)
    server.add_insecure_port(f"unix://{env.kubelet.plugin_dir / 'nvidia-gpu.sock'}")
    server.start()
    try:
        def register() -> None:
            with grpc.insecure_channel(f"unix://{env.kubelet.kubelet_socket}") as ch:
                pb_grpc.RegistrationStub(ch).Register(pb.RegisterRequest(
                    version="v1beta1", endpoint="nvidia-gpu.sock", resource_name="nvidia.com/gpu"), timeout=10)

        await asyncio.to_thread(register)
        await until(lambda: bool(env.events("GpuConflict")))
        assert MPS.uuid in env.app.conflicts and MPS.uuid not in env.app.refusals
        assert env.kubelet.devices(RESOURCE).allocatable == ALL_IDS  # still advertised, all Healthy
        taint = {"key": "example.com/gpu-slice-conflict", "effect": "NoSchedule"}
        await until(lambda: taint in (env.api.store.get_node(NODE).get("spec") or {}).get("taints", []))
        sample = env.app.registry.get_sample_value("gpu_slice_plugin_coexistence_conflicts",
                                                    {"gpu_uuid": MPS.uuid, "resource": "nvidia.com/gpu"})
        assert sample == 1
    finally:
        server.stop(0)


async def test_runs_without_api_access(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="deviceplugin"):
        plugin = await env.start(kube=False)
    assert any("without Kubernetes API access" in r.getMessage() for r in caplog.records)
    assert plugin.app.book is None
    [res] = await env.kubelet.admit_async([slice_pod("any", 3, created=1.0)])
    assert res.admitted and res.ids() == frozenset(MIG.instances[3].slice_ids())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_serves_metrics(env: Env) -> None:
    port = _free_port()
    await env.start(metrics_port=port, metrics_address="127.0.0.1")
    await env.kubelet.admit_async([slice_pod("any", 1, created=1.0)])

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    text = await asyncio.to_thread(scrape)
    assert 'gpu_slice_plugin_rpc_duration_seconds_count{method="Allocate"} 1.0' in text
    assert 'gpu_slice_plugin_registrations_total{result="ok"}' in text
    assert "gpu_slice_slices_total" in text

    def healthz() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    assert await asyncio.to_thread(healthz) == (200, "ok\n")
    env.app.failure = "background task x died"
    code, body = await asyncio.to_thread(healthz)
    assert code == 503 and "x died" in body
    env.app.failure = None


async def test_a_dying_background_task_stops_the_plugin_with_an_error(env: Env) -> None:
    plugin = await env.start()
    registrar = plugin.app.registrar
    assert registrar is not None

    async def broken() -> None:
        raise OSError("the plugin directory went read-only")  # not a RegistrationError: the loop dies

    registrar.step = broken  # type: ignore[method-assign]
    with pytest.raises(DevicePluginError, match="registrar died: OSError"):
        await asyncio.wait_for(plugin.task, 20)
    assert not plugin.app.liveness()[0]


# --------------------------------------------------------------------------- settings and the command


def test_settings_flags_override_the_config_file_and_bad_values_name_the_field(tmp_path: Path) -> None:
    from deviceplugin.errors import SettingsError
    from deviceplugin.settings import build

    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nslices: 4\nmpsLimits: memory-only\n")
    s = build({"config": str(config), "backend": "simulated", "node_name": "n1", "device_injection": "env"})
    assert s.config.slices == 4 and s.mps_memory_limit_only and s.device_injection == "env"
    s = build({"config": str(config), "backend": "simulated", "node_name": "n1", "mps_memory_limit_only": False})
    assert not s.mps_memory_limit_only  # the flag wins
    assert build({"backend": "simulated"}, env={"NODE_NAME": "from-env"}).node_name == "from-env"
    bad = {
        "node_name": {"backend": "simulated"},
        "device_injection": {"backend": "simulated", "node_name": "n", "device_injection": "magic"},
        "metrics_port": {"backend": "simulated", "node_name": "n", "metrics_port": 70000},
        "plugin_dir": {"backend": "simulated", "node_name": "n", "plugin_dir": "relative/dir"},
        "config.slices": {"backend": "simulated", "node_name": "n", "config": str(config)},
    }
    config_bad = tmp_path / "bad.yaml"
    config_bad.write_text("version: v1\nslices: 0\n")
    bad["config.slices"]["config"] = str(config_bad)
    for field, flags in bad.items():
        with pytest.raises(SettingsError) as err:
            build(flags, env={})
        assert err.value.field == field, str(err.value)
    # The simulated backend stands in for a real node: the simulator's milli-GPU S is refused.
    milli = tmp_path / "milli.yaml"
    milli.write_text("version: v1\nslices: 1000\n")
    with pytest.raises(SettingsError) as err:
        build({"backend": "simulated", "node_name": "n", "config": str(milli)}, env={})
    assert err.value.field == "config.slices" and "48" in str(err.value)


async def test_command_runs_with_nothing_else_present(sock_dir: Path) -> None:
    import sys

    plugin_dir = sock_dir / "plugins"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["TMPDIR"] = str(sock_dir)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpuslice_cli", "device-plugin", "--backend", "simulated", "--plugin-dir",
        str(plugin_dir), "--node-name", "lonely", "--metrics-port", "0",
        "--pod-resources-socket", str(sock_dir / "no-kubelet.sock"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
        cwd=str(Path(__file__).resolve().parents[2]))
    try:
        await until(lambda: (plugin_dir / "gpu-slice.sock").exists(), 20)
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 20)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = out.decode()
    assert proc.returncode == 0, text
    assert "without Kubernetes API access" in text
    assert not (plugin_dir / "gpu-slice.sock").exists()


async def test_layout_change_is_advertised_and_published(env: Env) -> None:
    backend = SimulatedBackend(TOPO)
    await env.start(backend=backend)
    messages = backend.change_layout(MIG.uuid, (("7g.80gb", 0),), frozenset())
    assert "changed" in messages[0]
    new_mig = backend.discover()[0]
    expected = frozenset(new_mig.slice_ids()) | frozenset(MPS.slice_ids())
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE, lambda d: d.capacity == expected)

    def published_profiles() -> list[str]:
        raw = (env.api.store.get_node(NODE)["metadata"].get("annotations") or {}).get(
            "example.com/gpu-slice.inventory")
        return [] if raw is None else [i["profile"] for i in json.loads(raw)["gpus"][0]["instances"]]

    await until(lambda: published_profiles() == ["7g.80gb"])


class _SlowBackend(SimulatedBackend):
    """Applies targets only when told, so a test can act while the change runs in its worker thread."""

    def __init__(self) -> None:
        super().__init__(TOPO)
        self.go = threading.Event()
        self.entered = threading.Event()
        self.allocated_seen: list[frozenset[str]] = []
        self.calls = 0

    def apply_targets(self, targets: Any, allocated: frozenset[str]) -> list[str]:
        self.calls += 1
        if self.calls == 1:  # start-up: the plugin registers first, the change comes with a later reconcile
            return ["held back by the test"]
        if any(self.would_change(g, targets[g.uuid]) for g in self.discover() if g.uuid in targets):
            self.allocated_seen.append(allocated)
            self.entered.set()
            self.go.wait(10)
        return super().apply_targets(targets, allocated)


async def test_mode_change_withdraws_the_gpu_before_it_races_allocate(env: Env, tmp_path: Path) -> None:
    """The change runs in a worker thread: its GPU's ids are withdrawn on the event loop first, and
    Allocate refuses them until the change is done."""
    config = tmp_path / "config.yaml"
    config.write_text(f"version: v1\nslices: 7\nmodes:\n  default: mps\n  gpus: {{{MPS.uuid}: whole}}\n")
    backend = _SlowBackend()
    await env.start(backend=backend, reconcile_s=0.2, config_file=config, config=load_config_file(config))
    await until(lambda: backend.entered.is_set(), 15)
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE,
                            lambda d: frozenset(MPS.slice_ids()) <= d.unhealthy, 10)
    assert env.app.state is not None
    with pytest.raises(Exception, match="being reconfigured"):
        env.app.state.allocate(MPS.slice_ids()[:2])
    backend.go.set()
    await until(lambda: env.app.state is not None and env.app.state.gpus[1].mode == "whole", 10)
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE, lambda d: not d.unhealthy, 10)


async def test_sent_events_are_kept_bounded(env: Env) -> None:
    app = DevicePluginApp(env.settings(use_kube=False), backend=SimulatedBackend(TOPO))
    for n in range(300):
        await app._node_event("GpuUnhealthy", f"event {n}", "Warning")
    assert len(app.events_sent) == 256 and app.events_sent[-1][2] == "event 299"


def test_numa_topology_flag_is_gone_and_devices_carry_no_topology(capsys: pytest.CaptureFixture[str]) -> None:
    """Under a topology-manager policy kubelet picks ids from its hinted NUMA node only, overriding the
    extender's GPU; on ordinary 8-GPU hosts (four per socket) nothing could be advertised safely."""
    import argparse

    from deviceplugin.cli import add_arguments
    from deviceplugin.server import PluginState

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--numa-topology"])
    assert "unrecognized arguments: --numa-topology" in capsys.readouterr().err
    state = PluginState("n", book=None)
    state.set_gpus(TOPO.gpus)
    assert all(not d.HasField("topology") for d in state.device_list().devices)


async def test_simulated_backend_serves_dcgm_series_with_pod_labels_to_a_real_prometheus(
        env: Env, tmp_path: Path) -> None:
    """The README's promise: dcgm-exporter-compatible series on the plugin's /metrics (simulated backend),
    per GPU and per MIG instance, with the pod labels; scraped by Debian's prometheus where present."""
    port = _free_port()
    await env.start(metrics_port=port, metrics_address="127.0.0.1")
    uuid, ids = inst(3)  # 3g.40gb
    uid = env.bind("llm-mig", ids, at="2025-01-01T00:00:01Z", gpus=(MIG.uuid,), instance=uuid,
                   annotations={"example.com/simulated-utilization": "60"})
    mps_ids = MPS.slice_ids()[:2]
    uid_m = env.bind("llm-mps", mps_ids, at="2025-01-01T00:00:02Z", gpus=(MPS.uuid,), instance=None,
                     annotations={"example.com/simulated-utilization": "70"})
    await env.seen("llm-mig", "llm-mps")
    results = await env.kubelet.admit_async([slice_pod("llm-mig", 3, created=1.0, uid=uid),
                                             slice_pod("llm-mps", 2, created=2.0, uid=uid_m)])
    assert all(r.admitted for r in results)
    await until(lambda: env.allocated("llm-mig") is not None and env.allocated("llm-mps") is not None)

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    async def series() -> str:
        text = ""
        async with asyncio.timeout(10):
            while 'pod="llm-mps"' not in text or 'pod="llm-mig"' not in text:
                text = await asyncio.to_thread(scrape)
                await asyncio.sleep(0.1)
        return text

    text = await series()
    mig_line = next(line for line in text.splitlines()
                    if line.startswith("DCGM_FI_PROF_GR_ENGINE_ACTIVE{") and 'pod="llm-mig"' in line)
    assert 'GPU_I_PROFILE="3g.40gb"' in mig_line and mig_line.endswith(" 0.6")
    assert f'UUID="{MIG.uuid}"' in mig_line and 'namespace="default"' in mig_line and 'container="main"' in mig_line
    gpu_line = next(line for line in text.splitlines()
                    if line.startswith("DCGM_FI_DEV_GPU_UTIL{") and 'pod="llm-mps"' in line)
    assert f'UUID="{MPS.uuid}"' in gpu_line and f'Hostname="{NODE}"' not in gpu_line
    assert float(gpu_line.rsplit(" ", 1)[1]) == 20.0  # 70 % on 2 of 7 slices

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Debian's prometheus binary is absent (apt-get install -y prometheus): "
                    "the exposition was checked, a real scrape was not")
    prom_port = _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                      "scrape_configs:\n  - job_name: gpu-slice-device-plugin\n"
                      f"    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def query(promql: str) -> list[dict[str, Any]]:
            url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    body = json.loads(resp.read())
            except OSError:
                return []
            result: list[dict[str, Any]] = body["data"]["result"]
            return result

        promql = 'max by (pod, namespace, container, UUID, GPU_I_PROFILE) (DCGM_FI_PROF_GR_ENGINE_ACTIVE{pod!=""})'
        found: list[dict[str, Any]] = []
        async with asyncio.timeout(30):
            while len(found) < 2:
                found = await asyncio.to_thread(query, promql)
                await asyncio.sleep(0.3)
        by_pod = {r["metric"]["pod"]: r for r in found}
        assert by_pod["llm-mig"]["metric"]["GPU_I_PROFILE"] == "3g.40gb"
        assert float(by_pod["llm-mig"]["value"][1]) == 0.6
        assert by_pod["llm-mps"]["metric"]["UUID"] == MPS.uuid and "GPU_I_PROFILE" not in by_pod["llm-mps"]["metric"]
        assert float(by_pod["llm-mps"]["value"][1]) == 0.2
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_preferred_wait_flag_reaches_the_settings() -> None:
    import argparse

    from deviceplugin import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--node-name", "n", "--preferred-wait-seconds", "0.5", "--taint-on-conflict"])
    settings = cli.settings_from(args)
    assert settings.preferred_wait_s == 0.5 and settings.conflict_taint
    with pytest.raises(Exception, match="preferred_wait_s"):
        cli.settings_from(parser.parse_args(["--node-name", "n", "--preferred-wait-seconds", "99"]))


async def test_a_layout_other_than_the_configs_is_warned_once_with_the_field_path(
        env: Env, caplog: pytest.LogCaptureFixture) -> None:
    """migLayouts.H100-80GB.layout says what the MIG manager lays out; the simulated GPU carries another
    layout: one warning naming the field, none on later rediscoveries, none once the GPU matches, one
    again when it changes away."""
    from gpuslice.config import load_config

    config = load_config({"version": "v1", "modes": {"default": "mps", "products": {"H100-80GB": "mig"}},
                          "migLayouts": {"H100-80GB": {"layout": ["7g.80gb"], "dynamic": False}}})
    backend = SimulatedBackend(TOPO)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and "migLayouts.H100-80GB.layout" in r.getMessage() and MIG.uuid in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="deviceplugin"):
        await env.start(backend=backend, config=config)
        await until(lambda: len(warnings()) == 1)
        await asyncio.sleep(1.0)  # three more rediscoveries at rediscover_s=0.3
        (first,) = warnings()
        assert f"GPU 0 ({MIG.uuid}, H100-80GB) carries MIG instances [1g.10gb, 1g.10gb, 2g.20gb, 3g.40gb]" in first
        assert "says it carries [7g.80gb]" in first and "nvidia.com/mig.config" in first
        backend.change_layout(MIG.uuid, (("7g.80gb", 0),), frozenset())
        await asyncio.sleep(1.0)
        assert len(warnings()) == 1
        backend.change_layout(MIG.uuid, (("4g.40gb", 0),), frozenset())
        await until(lambda: len(warnings()) == 2)
        assert "carries MIG instances [4g.40gb]" in warnings()[1]
    # The MPS H100 beside it is named too (once): the config says such GPUs carry MIG instances.
    other = [r.getMessage() for r in caplog.records if MPS.uuid in r.getMessage()]
    assert len(other) == 1 and "is in mps mode, not MIG" in other[0]
