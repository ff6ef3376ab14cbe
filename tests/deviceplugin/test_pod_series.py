"""Per-pod series (deviceplugin.pod_series): a MIG pod's figures are its instance's, read through the
backend seam (the simulated backend; NVML through a fake with the real GPM structures); an MPS pod's
memory is its own MPS clients', mapped to it by the budget watch (cgroups, or the simulated backend's
own clients); never the GPU's activity divided by share."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pynvml as real
import pytest
from prometheus_client import CollectorRegistry

from deviceplugin.assignments import AssignmentBook, PodView
from deviceplugin.backend import GpuProcess, UnitUsage
from deviceplugin.budget_watch import BudgetWatch
from deviceplugin.dcgm import DcgmCollector, SliceUse, render_text
from deviceplugin.nvml_backend import NvmlBackend
from deviceplugin.pod_series import PodSeriesCollector
from deviceplugin.simulated import SIM_PID_BASE, SimulatedBackend, builtin_topology
from gpuslice.model import NodeInventory
from gpuslice.rules import mps_share_mib

from .test_budget import UID_A, proc_root
from .test_nvml_backend import MIB, Clock, FakeNvml, mig_gpu

NODE = "n1"
TOPO = builtin_topology(NODE)
MIG, MPS = TOPO.gpus  # 2g.20gb@0, 1g.10gb@2, 1g.10gb@3, 3g.40gb@4; MPS S=7
THREE_G = next(i for i in MIG.instances if i.profile == "3g.40gb")
UID_M, UID_P, UID_Q = "uid-mig", "uid-mps", "uid-mps-2"


def workload() -> dict[str, SliceUse]:
    mig = SliceUse("llm", "big", "server", "60", UID_M, None)
    mps = SliceUse("llm", "chat", "server", "70", UID_P, "6Gi")
    other = SliceUse("team", "batch", "main", None, UID_Q, None)
    return {**dict.fromkeys(THREE_G.slice_ids(), mig), **dict.fromkeys(MPS.slice_ids()[:2], mps),
            MPS.slice_ids()[2]: other}


def samples(registry: CollectorRegistry, name: str) -> dict[str, tuple[dict[str, str], float]]:
    """pod -> (labels, value) of one family."""
    out = {}
    for fam in registry.collect():
        for s in fam.samples:
            if s.name == name:
                out[s.labels["pod"]] = (s.labels, s.value)
    return out


def test_the_simulated_backend_serves_mig_usage_and_mps_clients_from_its_workload() -> None:
    backend = SimulatedBackend(TOPO)
    backend.set_workload(workload())
    usage = backend.instance_usage()
    assert set(usage) == {i.uuid for i in MIG.instances}
    assert usage[THREE_G.uuid] == UnitUsage(round(THREE_G.memory_mib * 0.9), 0.6, 0.48)
    assert usage[MIG.instances[0].uuid] == UnitUsage(0, 0.0, 0.0)  # idle instance
    procs = {p.pod_uid: p for p in backend.gpu_processes(MPS.uuid)}
    assert set(procs) == {UID_P, UID_Q} and all(p.mps_client and p.pid >= SIM_PID_BASE for p in procs.values())
    assert procs[UID_P].used_mib == 6 * 1024  # its simulated-memory annotation
    assert procs[UID_Q].used_mib == round(MPS.memory_mib / 7 * 0.9)  # the share model
    # the DCGM-compatible series add up to the same figures (one model)
    text = render_text(DcgmCollector(lambda: TOPO.gpus, workload).collect())
    fb = next(line for line in text.splitlines() if line.startswith("DCGM_FI_DEV_FB_USED{") and 'pod="chat"' in line)
    assert fb.endswith(f" {procs[UID_P].used_mib + procs[UID_Q].used_mib}")
    # a pod that leaves takes its client with it; the PIDs of those that stay are stable
    backend.set_workload({k: v for k, v in workload().items() if v.uid != UID_Q})
    assert [(p.pid, p.pod_uid) for p in backend.gpu_processes(MPS.uuid)] == [(procs[UID_P].pid, UID_P)]


async def test_series_for_a_mig_pod_and_an_mps_pod_with_their_labels() -> None:
    backend = SimulatedBackend(TOPO)
    uses = workload()
    backend.set_workload(uses)
    book = AssignmentBook(NODE)
    for uid, name, ids in ((UID_P, "chat", MPS.slice_ids()[:2]), (UID_Q, "batch", MPS.slice_ids()[2:3])):
        book.upsert(PodView("llm" if uid == UID_P else "team", name, uid, NODE, "Running",
                            created="2025-01-01T00:00:00Z", allocated_ids=ids))
    watch = BudgetWatch(backend, lambda: NodeInventory(NODE, TOPO.gpus), lambda: book, interval_s=1,
                        proc_root=Path("/nonexistent"), event=None, evict=None)
    registry = CollectorRegistry()
    registry.register(PodSeriesCollector(NODE, lambda: NodeInventory(NODE, TOPO.gpus), lambda: uses,
                                         backend.instance_usage, lambda: watch.client_memory))
    assert "chat" not in samples(registry, "gpu_slice_pod_memory_used_bytes")  # no budget pass yet: unknown
    found = await watch.pass_once()
    assert found == []  # the simulated clients are within their shares
    used = samples(registry, "gpu_slice_pod_memory_used_bytes")
    labels, value = used["big"]
    assert labels == {"namespace": "llm", "pod": "big", "container": "server", "pod_uid": UID_M, "node": NODE,
                      "gpu_uuid": MIG.uuid, "unit": THREE_G.uuid, "mode": "mig", "profile": "3g.40gb"}
    assert value == round(THREE_G.memory_mib * 0.9) * MIB * 1024 * 1024 // MIB
    assert used["chat"][1] == 6 * 1024**3 and used["chat"][0]["unit"] == MPS.uuid and used["chat"][0]["mode"] == "mps"
    assert used["batch"][1] == round(MPS.memory_mib / 7 * 0.9) * 1024**2
    limit = samples(registry, "gpu_slice_pod_memory_limit_bytes")
    assert limit["big"][1] == THREE_G.memory_mib * 1024**2
    assert limit["chat"][1] == mps_share_mib(MPS.memory_mib, 2, 7) * 1024**2
    slices = {p: v for p, (_, v) in samples(registry, "gpu_slice_pod_slices").items()}
    assert slices == {"big": 3, "chat": 2, "batch": 1}
    # activity: the MIG pod's own instance; no MPS pod gets one (never the GPU's divided by share)
    assert {p: v for p, (_, v) in samples(registry, "gpu_slice_pod_gpu_activity_ratio").items()} == {"big": 0.6}
    assert {p: v for p, (_, v) in samples(registry, "gpu_slice_pod_memory_bandwidth_ratio").items()} == {"big": 0.48}


async def test_mps_memory_is_the_pods_own_clients_mapped_through_cgroups(tmp_path: Path) -> None:
    """Real PIDs (no pod hint from the backend) reach their pod through /proc/<pid>/cgroup: pod A's two
    clients add up; a pod with no client yet uses 0; a process outside MPS counts for nobody."""
    root = proc_root(tmp_path)
    backend = SimulatedBackend(TOPO)
    backend.set_processes(MPS.uuid, (GpuProcess(101, 3000, True), GpuProcess(102, 1500, True),
                                     GpuProcess(500, 9000, False)))
    uses = {**dict.fromkeys(MPS.slice_ids()[:2], SliceUse("default", "llm-a", "main", None, UID_A)),
            MPS.slice_ids()[2]: SliceUse("default", "idle", "main", None, "uid-idle")}
    book = AssignmentBook(NODE)
    book.upsert(PodView("default", "llm-a", UID_A, NODE, "Running", created="2025-01-01T00:00:00Z",
                        allocated_ids=MPS.slice_ids()[:2]))
    watch = BudgetWatch(backend, lambda: NodeInventory(NODE, TOPO.gpus), lambda: book, interval_s=1,
                        proc_root=root, event=None, evict=None)
    await watch.pass_once()
    assert watch.client_memory == {MPS.uuid: {UID_A: 4500}}
    registry = CollectorRegistry()
    registry.register(PodSeriesCollector(NODE, lambda: NodeInventory(NODE, TOPO.gpus), lambda: uses, None,
                                         lambda: watch.client_memory))
    used = samples(registry, "gpu_slice_pod_memory_used_bytes")
    assert {p: v for p, (_, v) in used.items()} == {"llm-a": 4500 * 1024**2, "idle": 0}


def test_a_failing_usage_read_leaves_those_series_out_not_the_scrape(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def broken() -> dict[str, UnitUsage]:
        calls.append(1)
        raise RuntimeError("NVML went away")

    uses = workload()
    registry = CollectorRegistry()
    registry.register(PodSeriesCollector(NODE, lambda: NodeInventory(NODE, TOPO.gpus), lambda: uses, broken))
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert samples(registry, "gpu_slice_pod_slices")["big"][1] == 3
            assert "big" not in samples(registry, "gpu_slice_pod_memory_used_bytes")
    assert len(calls) == 4 and sum("NVML went away" in r.getMessage() for r in caplog.records) == 1
    # nothing held on a MIG instance: the backend is not asked at all
    registry = CollectorRegistry()
    registry.register(PodSeriesCollector(NODE, lambda: NodeInventory(NODE, TOPO.gpus), dict, broken))
    assert samples(registry, "gpu_slice_pod_slices") == {} and len(calls) == 4


# ---- NVML: memory from the MIG device, activity from GPM -----------------------------------------------

class GpmNvml(FakeNvml):
    """FakeNvml plus MIG memory in use and GPM, with the real pynvml structures and constants."""

    c_nvmlGpmMetricsGet_t = real.c_nvmlGpmMetricsGet_t
    NVML_GPM_METRICS_GET_VERSION = real.NVML_GPM_METRICS_GET_VERSION
    NVML_GPM_METRIC_GRAPHICS_UTIL = real.NVML_GPM_METRIC_GRAPHICS_UTIL
    NVML_GPM_METRIC_DRAM_BW_UTIL = real.NVML_GPM_METRIC_DRAM_BW_UTIL
    NVML_SUCCESS = real.NVML_SUCCESS

    def __init__(self, *args: Any, gpm: bool = True, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gpm = gpm
        self.used: dict[str, int] = {}  # MIG uuid -> MiB in use
        self.busy: dict[int, tuple[float, float]] = {}  # gi id -> (graphics %, dram %) from now on
        self.live: set[int] = set()  # allocated sample ids
        self._n = 0

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        info = super().nvmlDeviceGetMemoryInfo(handle)
        used = self.used.get(getattr(handle, "uuid", ""), 0) * MIB
        return real.c_nvmlMemory_t(info.total, info.total - used, used)

    def nvmlGpmQueryDeviceSupport(self, handle: Any) -> Any:
        support = real.c_nvmlGpmSupport_t()
        support.isSupportedDevice = 1 if self.gpm else 0
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        self._n += 1
        self.live.add(self._n)
        return {"id": self._n}

    def nvmlGpmMigSampleGet(self, handle: Any, gi_id: int, sample: Any) -> Any:
        sample["gi"] = gi_id
        sample["busy"] = self.busy.get(gi_id, (0.0, 0.0))
        return sample

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self.live.discard(sample["id"])

    def nvmlGpmMetricsGet(self, query: Any) -> Any:
        raise NotImplementedError  # replaced per test: ctypes cannot carry the dict samples

    def metrics_from(self, first: dict[str, Any], second: dict[str, Any], query: Any) -> None:
        assert first["gi"] == second["gi"] and query.version == real.NVML_GPM_METRICS_GET_VERSION
        assert query.numMetrics == 2
        values = {real.NVML_GPM_METRIC_GRAPHICS_UTIL: second["busy"][0], real.NVML_GPM_METRIC_DRAM_BW_UTIL:
                  second["busy"][1]}
        for i in range(query.numMetrics):
            query.metrics[i].value = values[query.metrics[i].metricId]
            query.metrics[i].nvmlReturn = real.NVML_SUCCESS


def gpm_backend(gpm: bool = True, clock: Clock | None = None) -> tuple[NvmlBackend, GpmNvml]:
    nv = GpmNvml([mig_gpu()], gpm=gpm)
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []

    class Query(real.c_nvmlGpmMetricsGet_t):  # type: ignore[misc,valid-type]
        """The real structure, remembering the Python samples ctypes cannot hold."""

        def __setattr__(self, name: str, value: Any) -> None:
            if name in ("sample1", "sample2"):
                pairs.append(value)
                return
            super().__setattr__(name, value)

    def metrics_get(query: Any) -> None:
        second, first = pairs.pop(), pairs.pop()
        nv.metrics_from(first, second, query)

    nv.c_nvmlGpmMetricsGet_t = Query  # type: ignore[misc]
    nv.nvmlGpmMetricsGet = metrics_get  # type: ignore[method-assign]
    backend = NvmlBackend(nv, clock=clock or Clock())
    backend.discover()
    return backend, nv


def test_nvml_reads_a_mig_instances_memory_and_its_gpm_activity_between_scrapes() -> None:
    clock = Clock()
    backend, nv = gpm_backend(clock=clock)
    nv.used = {"MIG-3g": 12000, "MIG-1g": 512}
    first = backend.instance_usage()
    assert first["MIG-3g"] == UnitUsage(12000, None, None)  # one GPM sample: no interval yet
    assert first["MIG-1g"].memory_used_mib == 512 and set(first) == {"MIG-3g", "MIG-2g", "MIG-1g"}
    nv.busy = {1: (42.5, 61.0)}  # GPU instance 1 is MIG-3g
    clock.now += 30  # the next scrape
    second = backend.instance_usage()
    assert second["MIG-3g"] == UnitUsage(12000, 0.425, 0.61)
    assert second["MIG-2g"] == UnitUsage(0, 0.0, 0.0)
    assert len(nv.live) == 3  # one sample kept per instance, the older ones freed
    # a scrape right after reuses the figures instead of measuring a moment
    assert backend.instance_usage()["MIG-3g"] == UnitUsage(12000, 0.425, 0.61) and len(nv.live) == 3
    backend.close()
    assert nv.live == set()


def test_a_gpu_without_gpm_serves_memory_only_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    backend, nv = gpm_backend(gpm=False)
    nv.used = {"MIG-2g": 700}
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert backend.instance_usage()["MIG-2g"] == UnitUsage(700, None, None)
    assert sum("no GPU performance monitoring" in r.getMessage() for r in caplog.records) == 1
    assert nv.live == set()


async def test_the_app_feeds_the_simulated_workload_and_drops_a_deleted_pods_client() -> None:
    """The plugin passes who holds what to the simulated backend on each refresh and at once when a pod
    is deleted, so the budget watch never sees a client of a pod that is gone."""
    from deviceplugin.app import DevicePluginApp
    from deviceplugin.settings import Settings

    backend = SimulatedBackend(TOPO)
    app = DevicePluginApp(Settings(node_name=NODE, backend="simulated", use_kube=False), backend=backend)
    book = AssignmentBook(NODE)
    app.book = book
    from deviceplugin.server import PluginState

    app.state = PluginState(NODE, book=book)
    app.state.set_gpus(TOPO.gpus)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "chat", "namespace": "llm", "uid": UID_P, "creationTimestamp": "2025-01-01T00:00:00Z",
        "annotations": {"example.com/simulated-memory": "5Gi"}},
        "spec": {"nodeName": NODE, "containers": [{"name": "server"}]}, "status": {"phase": "Running"}}
    app._apply_pod_event("ADDED", pod)
    book.set_admitted({("llm", "chat"): MPS.slice_ids()[:2]})
    app._refresh_metrics_snapshot()
    (client,) = backend.gpu_processes(MPS.uuid)
    assert (client.pod_uid, client.used_mib) == (UID_P, 5 * 1024)
    app._apply_pod_event("DELETED", pod)
    assert backend.gpu_processes(MPS.uuid) == ()
    await asyncio.sleep(0)
