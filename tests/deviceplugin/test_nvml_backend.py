"""The NVML backend against a fake ``pynvml`` at the nvidia-ml-py seam.

The fake raises the real ``pynvml.NVMLError`` (and its per-code subclasses) for unsupported calls,
returns the real ctypes structures where the backend reads fields, models MIG devices and GPU
instances, and delivers events through a queue with the real timeout behaviour.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml as real
import pytest

from deviceplugin.backend import GpuTarget, HealthEvent
from deviceplugin.errors import DiscoveryError
from deviceplugin.nvml_backend import APPLICATION_XIDS, NO_INSTANCE, NvmlBackend

MIB = 1024 * 1024
SETTERS = {"nvmlDeviceSetMigMode", "nvmlDeviceSetComputeMode", "nvmlDeviceCreateGpuInstance",
           "nvmlDeviceCreateGpuInstanceWithPlacement", "nvmlGpuInstanceDestroy",
           "nvmlGpuInstanceCreateComputeInstance", "nvmlComputeInstanceDestroy"}


@dataclass
class FakeMig:
    uuid: str
    gi_id: int
    profile_id: int
    start: int
    memory_mib: int
    gi_slices: int
    ci_slices: int | None = None


@dataclass
class FakeGpu:
    uuid: str
    name: str
    memory_mib: int
    mig: bool | None = False  # None: MIG not supported
    compute_mode: int = real.NVML_COMPUTEMODE_DEFAULT
    migs: dict[int, FakeMig] = field(default_factory=dict)
    events: int = real.nvmlEventTypeXidCriticalError | real.nvmlEventTypeSingleBitEccError
    lost: bool = False
    remap: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # None: not supported (pre-Ampere)
    retired_pending: bool | None = None  # None: not supported
    processes: list[Any] = field(default_factory=list)  # (pid, used bytes or None)
    mps_clients: list[Any] = field(default_factory=list)


def err(code: int) -> real.NVMLError:
    return real.NVMLError(code)


class FakeNvml:
    """The subset of pynvml the backend uses, with the real error class and constants."""

    NVMLError = real.NVMLError

    def __init__(self, gpus: list[FakeGpu], *, privileged: bool = True, set_fails: int | None = None,
                 init_fails: bool = False) -> None:
        for name in dir(real):
            if name.startswith(("NVML_ERROR_", "NVML_DEVICE_MIG_", "NVML_COMPUTEMODE_", "nvmlEventType",
                                "NVML_FEATURE_")):
                setattr(self, name, getattr(real, name))
        self.gpus = gpus
        self.privileged = privileged
        self.set_fails = set_fails
        self.init_fails = init_fails
        self.calls: list[str] = []
        self.registered: dict[str, int] = {}
        self.events: queue.Queue[Any] = queue.Queue()
        self.wait_error: int | None = None

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml"):
            object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)

    def nvmlInit(self) -> None:
        if self.init_fails:
            raise err(real.NVML_ERROR_DRIVER_NOT_LOADED)

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if getattr(handle, "lost", False):
            raise err(real.NVML_ERROR_GPU_IS_LOST)
        return str(handle.uuid)

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str:
        return handle.name

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        if getattr(handle, "lost", False):
            raise err(real.NVML_ERROR_GPU_IS_LOST)
        return real.c_nvmlMemory_t(handle.memory_mib * MIB, handle.memory_mib * MIB, 0)

    def nvmlDeviceGetMigMode(self, handle: FakeGpu) -> list[int]:
        if handle.mig is None:
            raise err(real.NVML_ERROR_NOT_SUPPORTED)
        mode = real.NVML_DEVICE_MIG_ENABLE if handle.mig else real.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeGpu) -> int:
        if handle.mig is None:
            raise err(real.NVML_ERROR_NOT_SUPPORTED)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeGpu, index: int) -> FakeMig:
        if index not in handle.migs:
            raise err(real.NVML_ERROR_NOT_FOUND)
        return handle.migs[index]

    def nvmlDeviceGetGpuInstanceId(self, mig: FakeMig) -> int:
        return mig.gi_id

    def nvmlDeviceGetGpuInstanceById(self, handle: FakeGpu, gi_id: int) -> Any:
        if not self.privileged:
            raise err(real.NVML_ERROR_NO_PERMISSION)
        for mig in handle.migs.values():
            if mig.gi_id == gi_id:
                return mig
        raise err(real.NVML_ERROR_NOT_FOUND)

    def nvmlGpuInstanceGetInfo(self, gi: FakeMig) -> Any:
        info = real.c_nvmlGpuInstanceInfo_t()
        info.id = gi.gi_id
        info.profileId = gi.profile_id
        info.placement.start = gi.start
        info.placement.size = 0
        return info

    def nvmlDeviceGetAttributes(self, mig: FakeMig) -> Any:
        attrs = real.c_nvmlDeviceAttributes()
        attrs.gpuInstanceSliceCount = mig.gi_slices
        attrs.computeInstanceSliceCount = mig.ci_slices if mig.ci_slices is not None else mig.gi_slices
        attrs.memorySizeMB = mig.memory_mib
        return attrs

    def nvmlDeviceGetComputeMode(self, handle: FakeGpu) -> int:
        return handle.compute_mode

    def nvmlDeviceSetComputeMode(self, handle: FakeGpu, mode: int) -> None:
        if self.set_fails is not None:
            raise err(self.set_fails)
        handle.compute_mode = mode

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        raise err(real.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetRemappedRows(self, handle: FakeGpu) -> tuple[int, int, int, int]:
        if handle.remap is None:
            raise err(real.NVML_ERROR_NOT_SUPPORTED)
        return handle.remap

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: FakeGpu) -> int:
        if handle.retired_pending is None:
            raise err(real.NVML_ERROR_NOT_SUPPORTED)
        return real.NVML_FEATURE_ENABLED if handle.retired_pending else real.NVML_FEATURE_DISABLED

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeGpu) -> list[Any]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle.processes]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: FakeGpu) -> list[Any]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle.mps_clients]

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceGetSupportedEventTypes(self, handle: FakeGpu) -> int:
        return handle.events

    def nvmlDeviceRegisterEvents(self, handle: FakeGpu, mask: int, event_set: str) -> None:
        if not handle.events:
            raise err(real.NVML_ERROR_NOT_SUPPORTED)
        self.registered[handle.uuid] = mask

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        if self.wait_error is not None:
            code, self.wait_error = self.wait_error, None
            raise err(code)
        try:
            return self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise err(real.NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass

    def xid(self, gpu: FakeGpu, xid: int, gi: int = NO_INSTANCE) -> None:
        self.events.put(SimpleNamespace(device=gpu, eventType=real.nvmlEventTypeXidCriticalError, eventData=xid,
                                        gpuInstanceId=gi, computeInstanceId=0 if gi != NO_INSTANCE else gi))


H100 = "NVIDIA H100 80GB HBM3"


def mig_gpu() -> FakeGpu:
    return FakeGpu("GPU-aaaa", H100, 81559, mig=True, migs={
        0: FakeMig("MIG-3g", 1, 9, 0, 40448, 3),
        2: FakeMig("MIG-2g", 5, 14, 4, 20096, 2),  # index 1 unused: skipped like NVML's NOT_FOUND
        3: FakeMig("MIG-1g", 13, 19, 6, 9984, 1),
    })


def node() -> list[FakeGpu]:
    return [mig_gpu(), FakeGpu("GPU-bbbb", H100, 81559), FakeGpu("GPU-cccc", "Tesla T4", 15360, mig=None),
            FakeGpu("GPU-dddd", "NVIDIA Mystery X", 1000)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_discovery_reads_gpus_mig_instances_and_skips_unknown_products() -> None:
    nv = FakeNvml(node())
    backend = NvmlBackend(nv, default_target=GpuTarget("mps", 7))
    gpus = backend.discover()
    assert [(g.uuid, g.index, g.product, g.mode, g.slices) for g in gpus] == [
        ("GPU-aaaa", 0, "H100-80GB", "mig", 6), ("GPU-bbbb", 1, "H100-80GB", "mps", 7),
        ("GPU-cccc", 2, "T4", "mps", 7)]
    assert [(i.uuid, i.profile, i.start, i.compute_slices, i.memory_mib) for i in gpus[0].instances] == [
        ("MIG-3g", "3g.40gb", 0, 3, 40448), ("MIG-2g", "2g.20gb", 4, 2, 20096), ("MIG-1g", "1g.10gb", 6, 1, 9984)]
    assert gpus[1].memory_mib == 81559 and all(g.healthy for g in gpus)
    assert backend.warnings == ["GPU 3 (GPU-dddd) skipped: GPU model 'NVIDIA Mystery X' is not in the catalogue"]
    assert not SETTERS & set(nv.calls)


def test_unprivileged_discovery_matches_profiles_from_attributes_and_infers_placement() -> None:
    nv = FakeNvml([mig_gpu()], privileged=False)
    gpu, = NvmlBackend(nv).discover()
    assert [(i.profile, i.start) for i in gpu.instances] == [("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)]


def test_unprivileged_warning_says_placement_was_inferred() -> None:
    backend = NvmlBackend(FakeNvml([mig_gpu()], privileged=False))
    backend.discover()
    assert "GPU GPU-aaaa: placement of a 3g.40gb instance inferred as start 0 (GPU instance info needs a " \
           "privileged user)" in backend.warnings


def test_gpu_instance_split_into_compute_instances_is_skipped_with_reason() -> None:
    gpu = mig_gpu()
    gpu.migs[0].ci_slices = 1
    backend = NvmlBackend(FakeNvml([gpu]))
    found, = backend.discover()
    assert [i.uuid for i in found.instances] == ["MIG-2g", "MIG-1g"]
    assert backend.warnings == ["GPU GPU-aaaa: GPU instance 1 is split into compute instances (MIG-3g); "
                                "gpu-slice advertises whole GPU instances only, skipped"]


def test_nvml_init_failure_is_a_discovery_error() -> None:
    with pytest.raises(DiscoveryError, match="NVML could not be initialised: Driver Not Loaded"):
        NvmlBackend(FakeNvml([], init_fails=True))


def test_read_only_never_calls_a_setter_and_says_what_it_would_change() -> None:
    nv = FakeNvml(node())
    backend = NvmlBackend(nv, read_only=True, default_target=GpuTarget("mps", 7))
    messages = backend.apply_targets({"GPU-aaaa": GpuTarget("mps", 7), "GPU-cccc": GpuTarget("whole", 7)},
                                     frozenset())
    assert messages == [
        "GPU GPU-aaaa: target is mps but MIG mode is on; gpu-slice does not disable MIG mode "
        "(operator: nvidia-smi -i GPU-aaaa -mig 0); advertised as mig",
        "GPU GPU-bbbb: read-only, would have changed: set compute mode EXCLUSIVE_PROCESS (now DEFAULT); "
        "start an MPS control daemon; advertised as mps(S=7) without changing the GPU",
        "GPU GPU-cccc: read-only, would have changed: mps(S=7) -> whole(S=7); advertised as whole(S=7) "
        "without changing the GPU",
    ]
    assert not SETTERS & set(nv.calls)
    assert all(g.compute_mode == real.NVML_COMPUTEMODE_DEFAULT for g in nv.gpus)
    assert [g.mode for g in backend.discover()] == ["mig", "mps", "whole"]


def test_apply_sets_exclusive_process_for_mps_and_waits_while_ids_are_allocated() -> None:
    nv = FakeNvml(node())
    backend = NvmlBackend(nv, default_target=GpuTarget("whole", 7))
    allocated = frozenset({"GPU-bbbb::0"})
    messages = backend.apply_targets({"GPU-bbbb": GpuTarget("mps", 7), "GPU-cccc": GpuTarget("mps", 7)}, allocated)
    assert messages == [
        "GPU GPU-bbbb: change waits (whole(S=7) -> mps(S=7); set compute mode EXCLUSIVE_PROCESS (now DEFAULT)): "
        "1 of its ids are allocated (GPU-bbbb::0)",
        "GPU GPU-cccc: changed: whole(S=7) -> mps(S=7); set compute mode EXCLUSIVE_PROCESS (now DEFAULT)",
    ]
    assert nv.gpus[1].compute_mode == real.NVML_COMPUTEMODE_DEFAULT
    assert nv.gpus[2].compute_mode == real.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert [g.mode for g in backend.discover()] == ["mig", "whole", "mps"]
    # back to whole: the compute mode gpu-slice set is undone
    assert backend.apply_targets({"GPU-cccc": GpuTarget("whole", 7)}, frozenset()) == [
        "GPU GPU-cccc: changed: mps(S=7) -> whole(S=7); set compute mode DEFAULT (gpu-slice had set EXCLUSIVE_PROCESS)"]
    assert nv.gpus[2].compute_mode == real.NVML_COMPUTEMODE_DEFAULT


def test_apply_refuses_more_mps_slices_than_mps_clients_and_reports_permission_errors() -> None:
    nv = FakeNvml(node()[1:3], set_fails=real.NVML_ERROR_NO_PERMISSION)
    backend = NvmlBackend(nv, default_target=GpuTarget("whole", 7))
    messages = backend.apply_targets({"GPU-bbbb": GpuTarget("mps", 64), "GPU-cccc": GpuTarget("mps", 7)},
                                     frozenset())
    assert messages == [
        "GPU GPU-bbbb: refused target mps with S=64: MPS serves at most 48 clients per GPU; keeping whole(S=7)",
        "GPU GPU-cccc: changed: whole(S=7) -> mps(S=7); set compute mode EXCLUSIVE_PROCESS (now DEFAULT) "
        "(could not set compute mode: Insufficient Permissions)",
    ]


def test_mig_layout_differences_are_reported_not_acted_on() -> None:
    nv = FakeNvml([mig_gpu(), FakeGpu("GPU-bbbb", H100, 81559)])
    backend = NvmlBackend(nv)
    messages = backend.apply_targets({
        "GPU-aaaa": GpuTarget("mig", 0, (("7g.80gb", 0),)), "GPU-bbbb": GpuTarget("mig", 0)}, frozenset())
    assert messages == [
        "GPU GPU-aaaa: MIG layout [('1g.10gb', 6), ('2g.20gb', 4), ('3g.40gb', 0)] differs from target "
        "[('7g.80gb', 0)]; gpu-slice does not create or destroy MIG instances on NVML; keeping the current layout",
        "GPU GPU-bbbb: target is mig but MIG mode is off; gpu-slice does not enable MIG mode "
        "(operator: nvidia-smi -i GPU-bbbb -mig 1, then create instances); advertised as whole",
    ]
    assert not SETTERS & set(nv.calls)


def wait_for(events: list[HealthEvent], n: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while len(events) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(events) >= n, events


def test_critical_xids_mark_gpus_and_mig_instances_unhealthy_application_xids_are_ignored() -> None:
    nv = FakeNvml(node()[:2])
    clock = Clock()
    backend = NvmlBackend(nv, event_timeout_ms=20, quiet_period_s=60, clock=clock)
    backend.discover()
    events: list[HealthEvent] = []
    lock = threading.Lock()

    def emit(event: HealthEvent) -> None:
        with lock:
            events.append(event)

    backend.watch_health(emit)
    try:
        assert nv.registered == {"GPU-aaaa": real.nvmlEventTypeXidCriticalError,
                                 "GPU-bbbb": real.nvmlEventTypeXidCriticalError}
        for xid in sorted(APPLICATION_XIDS):
            nv.xid(nv.gpus[1], xid)
        nv.xid(nv.gpus[1], 92)
        nv.xid(nv.gpus[0], 94, gi=5)
        wait_for(events, 2)
        assert events == [
            HealthEvent("GPU-bbbb", False, "critical XID 92"),
            HealthEvent("GPU-aaaa", False, "critical XID 94 on MIG instance MIG-2g (GPU instance 5)", "MIG-2g"),
        ]
        assert backend.unhealthy() == {"GPU-bbbb": "critical XID 92",
                                       "MIG-2g": "critical XID 94 on MIG instance MIG-2g (GPU instance 5)"}
        mig, whole = backend.discover()
        assert mig.healthy and not whole.healthy
        # recovery: nothing before the quiet period, then a probe decides
        assert backend.check_recovery() == []
        clock.now += 61
        nv.gpus[1].lost = True
        assert [e.gpu_uuid for e in backend.check_recovery()] == ["GPU-aaaa"]
        nv.gpus[1].lost = False
        recovered = backend.check_recovery()
        assert recovered == [HealthEvent("GPU-bbbb", True, "recovered: no critical XID for 60s and NVML answers "
                                                           "(was: critical XID 92)")]
        assert backend.unhealthy() == {} and all(g.healthy for g in backend.discover())
    finally:
        backend.close()


def test_failed_event_wait_marks_every_gpu_unhealthy() -> None:
    nv = FakeNvml(node()[:2])
    backend = NvmlBackend(nv, event_timeout_ms=20)
    events: list[HealthEvent] = []
    nv.wait_error = real.NVML_ERROR_UNKNOWN
    backend.watch_health(events.append)
    try:
        wait_for(events, 2)
        assert {(e.gpu_uuid, e.healthy) for e in events} == {("GPU-aaaa", False), ("GPU-bbbb", False)}
        assert events[0].reason == "waiting for NVML events failed: Unknown Error"
    finally:
        backend.close()


def test_gpu_without_xid_events_is_not_marked_unhealthy() -> None:
    gpu = FakeGpu("GPU-eeee", H100, 81559, events=0)
    nv = FakeNvml([gpu])
    backend = NvmlBackend(nv, event_timeout_ms=20)
    events: list[HealthEvent] = []
    backend.watch_health(events.append)
    backend.close()
    assert events == [] and nv.registered == {}


RESET = "the GPU needs a reset (nvidia-smi -r, or a reboot), then a restart of the plugin"


def test_xid_95_needs_a_reset_and_never_recovers_even_when_nvml_answers() -> None:
    nv = FakeNvml(node()[:2])
    clock = Clock()
    backend = NvmlBackend(nv, quiet_period_s=60, clock=clock)
    backend.discover()
    events: list[HealthEvent] = []
    backend._emit = events.append
    nv.xid(nv.gpus[1], 95)
    backend.handle_event(nv.events.get_nowait())
    why = f"critical XID 95 (uncontained ECC error): {RESET}"
    assert events == [HealthEvent("GPU-bbbb", False, why)]
    clock.now += 3600  # an hour of quiet, and UUID and memory reads answer
    assert backend.check_recovery() == []
    assert backend.unhealthy() == {"GPU-bbbb": why}
    nv.xid(nv.gpus[1], 92)  # a lesser XID later does not replace the reason or the stickiness
    backend.handle_event(nv.events.get_nowait())
    clock.now += 3600
    assert backend.check_recovery() == [] and backend.unhealthy() == {"GPU-bbbb": why}
    assert [g.healthy for g in backend.discover()] == [True, False]


def test_pending_row_remaps_and_retired_pages_need_a_reset() -> None:
    gpus = node()[:2]
    gpus[0].remap = (3, 1, 1, 0)  # a remap pending: applied only by a reset
    gpus[1].remap = None
    gpus[1].retired_pending = True
    nv = FakeNvml(gpus)
    clock = Clock()
    backend = NvmlBackend(nv, quiet_period_s=60, event_timeout_ms=20, clock=clock)
    events: list[HealthEvent] = []
    backend.watch_health(events.append)
    try:
        assert sorted(events, key=lambda e: e.gpu_uuid) == [
            HealthEvent("GPU-aaaa", False, f"row remapping pending: {RESET}"),
            HealthEvent("GPU-bbbb", False, f"retired pages pending: {RESET}")]
        clock.now += 3600
        assert backend.check_recovery() == []
    finally:
        backend.close()
    gpus[0].remap, gpus[1].retired_pending = (0, 0, 0, 1), False
    again = NvmlBackend(FakeNvml(gpus))
    again.discover()
    assert again.check_reset_needed() == ["GPU-aaaa"]
    assert again.unhealthy() == {"GPU-aaaa": f"row remapping failed (the GPU may need replacing): {RESET}"}


def test_an_unadvertised_mig_instance_s_xid_touches_no_advertised_instance() -> None:
    gpu = mig_gpu()
    gpu.migs[5] = FakeMig("MIG-split", 7, 14, 4, 20096, 2, ci_slices=1)  # split: not advertised
    del gpu.migs[2]
    nv = FakeNvml([gpu])
    backend = NvmlBackend(nv)
    found, = backend.discover()
    assert "MIG-split" not in {i.uuid for i in found.instances}
    events: list[HealthEvent] = []
    backend._emit = events.append
    nv.xid(gpu, 43 + 1, gi=7)  # XID 44, a graphics engine fault, in the unadvertised instance
    backend.handle_event(nv.events.get_nowait())
    assert events == [] and backend.unhealthy() == {}
    assert backend.discover()[0].healthy
    nv.xid(gpu, 95, gi=7)  # uncontained ECC: the whole GPU, whichever instance reported it
    backend.handle_event(nv.events.get_nowait())
    assert events == [HealthEvent("GPU-aaaa", False, f"critical XID 95 (uncontained ECC error) (reported by GPU "
                                                     f"instance 7): {RESET}")]


def test_exclusive_process_set_by_gpu_slice_is_restored_after_a_plugin_restart(tmp_path: Path) -> None:
    gpus = [FakeGpu("GPU-bbbb", H100, 81559, compute_mode=real.NVML_COMPUTEMODE_PROHIBITED)]
    nv = FakeNvml(gpus)
    first = NvmlBackend(nv, default_target=GpuTarget("whole", 7), record_root=tmp_path)
    first.apply_targets({"GPU-bbbb": GpuTarget("mps", 7)}, frozenset())
    assert gpus[0].compute_mode == real.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    first.close()
    # A new plugin process: only the host record says EXCLUSIVE_PROCESS was gpu-slice's doing.
    second = NvmlBackend(FakeNvml(gpus), default_target=GpuTarget("mps", 7), record_root=tmp_path)
    assert second.apply_targets({"GPU-bbbb": GpuTarget("whole", 7)}, frozenset()) == [
        "GPU GPU-bbbb: changed: mps(S=7) -> whole(S=7); set compute mode PROHIBITED (gpu-slice had set "
        "EXCLUSIVE_PROCESS)"]
    assert gpus[0].compute_mode == real.NVML_COMPUTEMODE_PROHIBITED
    assert json.loads((tmp_path / "compute-modes.json").read_text()) == {"v": 1, "gpus": {}}
    # Without the record a restarted plugin would have left the GPU exclusive.
    gpus[0].compute_mode = real.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    blind = NvmlBackend(FakeNvml(gpus), default_target=GpuTarget("mps", 7))
    assert blind.apply_targets({"GPU-bbbb": GpuTarget("whole", 7)}, frozenset()) == [
        "GPU GPU-bbbb: changed: mps(S=7) -> whole(S=7)"]
    assert gpus[0].compute_mode == real.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


def test_the_mps_keeper_restores_recorded_compute_modes_at_an_uninstall(tmp_path: Path) -> None:
    from deviceplugin.compute_mode import restore_recorded, save

    gpus = [FakeGpu("GPU-bbbb", H100, 81559, compute_mode=real.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS),
            FakeGpu("GPU-cccc", H100, 81559, compute_mode=real.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)]
    save(tmp_path, {"GPU-bbbb": real.NVML_COMPUTEMODE_DEFAULT})
    lines = restore_recorded(tmp_path, ["GPU-bbbb", "GPU-cccc"], FakeNvml(gpus))
    assert lines == ["GPU GPU-bbbb: compute mode restored to 0 (gpu-slice had set EXCLUSIVE_PROCESS)"]
    # GPU-cccc was exclusive before gpu-slice came: the operator's choice stays.
    assert [g.compute_mode for g in gpus] == [real.NVML_COMPUTEMODE_DEFAULT,
                                              real.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS]


def test_gpu_processes_list_mps_clients_and_other_compute_processes() -> None:
    gpu = FakeGpu("GPU-bbbb", H100, 81559, processes=[(100, 300 * MIB), (200, 5000 * MIB), (300, None)],
                  mps_clients=[(200, 5000 * MIB), (201, 7000 * MIB)])
    backend = NvmlBackend(FakeNvml([gpu]))
    backend.discover()
    from deviceplugin.backend import GpuProcess

    assert backend.gpu_processes("GPU-bbbb") == (
        GpuProcess(100, 300, False), GpuProcess(200, 5000, True), GpuProcess(201, 7000, True),
        GpuProcess(300, None, False))
    with pytest.raises(DiscoveryError, match="no GPU GPU-zzzz"):
        backend.gpu_processes("GPU-zzzz")


def test_mps_gpus_are_marked_for_their_daemons_without_a_config_file(tmp_path: Path) -> None:
    """apply_targets runs only with a config file; the mps GPUs found at start still get their daemons."""
    from deviceplugin.mps import MpsOptions
    from deviceplugin.mps_supervisor import MpsSupervisor

    sup = MpsSupervisor(MpsOptions(root=tmp_path, control_command=("false",), tick_s=3600),
                        owns_daemons=False, marks_wanted=True)
    backend = NvmlBackend(FakeNvml([mig_gpu(), FakeGpu("GPU-bbbb", H100, 81559)]), mps=sup, event_timeout_ms=20)
    backend.watch_health(lambda _e: None)
    try:
        assert sorted(p.parent.name for p in tmp_path.glob("*/wanted")) == ["GPU-bbbb"]
        assert sup.status() == {"GPU-bbbb": False}
    finally:
        backend.close()
