"""The NVML backend: GPUs, MIG instances and critical XIDs read through nvidia-ml-py (``pynvml``).

The ``pynvml`` module is injected (tests pass a fake at this seam); every NVML call goes through it.

Discovery: each GPU's UUID, index, name (mapped to a catalogue product), memory and current MIG mode.
A MIG-enabled GPU is reported as ``mig`` with one ``MigInstance`` per GPU instance (profile id mapped
through the catalogue, placement start from ``nvmlGpuInstanceGetInfo``). ``nvmlDeviceGetGpuInstanceById``
needs a privileged user; without it the profile is matched from the MIG device's attributes and the
placement is inferred (first legal start, larger instances first) and a warning says so. A GPU
instance split into several compute instances cannot be advertised as one instance and is skipped
with a warning; so is a GPU the catalogue does not know. Any other GPU is reported as ``mps`` or
``whole`` per its target.

Health: a thread waits on ``nvmlEventSetWait_v2`` for ``nvmlEventTypeXidCriticalError``. The XIDs
NVIDIA's own plugin treats as application errors (13, 31, 43, 45, 68, 109) are ignored. An XID
carrying the GPU-instance id of an advertised MIG instance marks that instance unhealthy; one of a
MIG instance gpu-slice does not advertise (split into compute instances, or made by someone else)
touches no advertised instance; any other marks the whole GPU; a failed wait marks every GPU.
**Recovery rule**: an owner is healthy again once ``quiet_period_s`` has passed without another
critical XID on it *and* a probe (UUID and memory info read through its handle) succeeds, checked
at every wait timeout, except where the GPU needs a reset: the XIDs in ``RESET_REQUIRED_XIDS``
(uncontained ECC, fallen off the bus, GSP errors, ...; always GPU-wide, even when tagged with a MIG
instance), a pending or failed row remapping (``nvmlDeviceGetRemappedRows``) and pending retired
pages (``nvmlDeviceGetRetiredPagesPendingStatus``), read at start and every ``reset_check_s``. Those
never recover in this process, as in NVIDIA's plugin: reset the GPU, then restart the plugin.
``mps`` GPUs are additionally healthy only while their MPS daemon answers
(``deviceplugin.mps_supervisor``).

Changes (``apply_targets``): only the compute mode (EXCLUSIVE_PROCESS for ``mps`` GPUs; a GPU leaving
``mps`` gets back the mode it had before gpu-slice changed it, read from the host record
``deviceplugin.compute_mode`` so a restarted plugin knows too) and the MPS markers. Switching MIG mode
and creating or destroying MIG instances are left out: such differences are reported, never acted on.
Under ``read_only=True`` no NVML setter is called and no marker written; the messages say what would
have changed. A GPU with any allocated id is never changed; its change waits and the message says so.

Processes (``gpu_processes``, for the budget watch): NVML's running compute processes and MPS
clients of one GPU, with the memory each uses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deviceplugin import compute_mode
from deviceplugin.backend import GpuProcess, GpuTarget, HealthEvent
from deviceplugin.errors import DiscoveryError
from deviceplugin.mps import MAX_MPS_CLIENT_SLICES
from deviceplugin.mps_supervisor import MpsSupervisor
from gpuslice.catalogue import MigProfile, Product, product_for_nvml_name
from gpuslice.errors import CatalogueError
from gpuslice.model import Gpu, MigInstance

log = logging.getLogger(__name__)

APPLICATION_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
"""XIDs caused by applications (NVIDIA k8s-device-plugin ignores these too): the GPU stays healthy."""
RESET_REQUIRED_XIDS: dict[int, str] = {
    48: "double-bit ECC error", 64: "ECC page retirement or row remapping failure", 74: "NVLink error",
    79: "GPU has fallen off the bus", 95: "uncontained ECC error", 119: "GSP RPC timeout", 120: "GSP error",
    140: "unrecovered ECC error"}
"""XIDs after which the GPU needs a reset (NVIDIA's XID catalogue): never recovered automatically."""
RESET_HINT = "the GPU needs a reset (nvidia-smi -r, or a reboot), then a restart of the plugin"
NO_INSTANCE = 0xFFFFFFFF
_MIB = 1024 * 1024
DEFAULT_TARGET = GpuTarget("mps", 7)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass(slots=True)
class _Fault:
    gpu_uuid: str
    instance_uuid: str | None
    reason: str
    last_seen: float
    sticky: bool = False  # needs a reset: never recovered by this process


class NvmlBackend:
    """Discovery, health and (unless read-only) compute-mode/MPS changes through NVML."""

    name = "nvml"

    def __init__(
        self,
        nvml: Any = None,
        *,
        default_target: GpuTarget = DEFAULT_TARGET,
        read_only: bool = False,
        mps: MpsSupervisor | None = None,
        ignored_xids: Iterable[int] = APPLICATION_XIDS,
        quiet_period_s: float = 600.0,
        event_timeout_ms: int = 5000,
        reset_check_s: float = 60.0,
        record_root: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if nvml is None:
            import pynvml as nvml_module

            nvml = nvml_module
        self._nvml = nvml
        self.default_target = default_target
        self.read_only = read_only
        self._mps = None if read_only else mps
        self._ignored = frozenset(ignored_xids)
        self.quiet_period_s = quiet_period_s
        self._event_timeout_ms = event_timeout_ms
        self.reset_check_s = reset_check_s
        self._next_reset_check = 0.0
        self._record_root = record_root
        self._clock = clock
        self._lock = threading.RLock()
        self._targets: dict[str, GpuTarget] = {}
        self._handles: dict[str, Any] = {}
        self._mig_by_gi: dict[tuple[str, int], str] = {}
        self._parent_of: dict[str, str] = {}
        self._faults: dict[str, _Fault] = {}
        # GPU -> the compute mode it had before gpu-slice set EXCLUSIVE_PROCESS (host record, so a
        # restarted plugin restores it too)
        self._before: dict[str, int] = compute_mode.load(record_root)
        self._emit: Callable[[HealthEvent], None] = lambda _event: None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        self.warnings: list[str] = []
        try:
            nvml.nvmlInit()
        except (nvml.NVMLError, OSError) as exc:
            raise DiscoveryError(f"NVML could not be initialised: {exc}") from exc

    # ---- discovery -------------------------------------------------------------------------------

    @property
    def mps(self) -> MpsSupervisor | None:
        """The supervisor of this backend's MPS daemons (the app sets their limits through it)."""
        return self._mps

    def discover(self) -> tuple[Gpu, ...]:
        """The GPUs as NVML reports them now (skipped GPUs and instances are in ``warnings``)."""
        nv = self._nvml
        warnings: list[str] = []
        gpus: list[Gpu] = []
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as exc:
            raise DiscoveryError(f"NVML could not count GPUs: {exc}") from exc
        for index in range(count):
            try:
                gpu = self._discover_one(index, warnings)
            except nv.NVMLError as exc:
                raise DiscoveryError(f"NVML failed reading GPU {index}: {exc}") from exc
            if gpu is not None:
                gpus.append(gpu)
        with self._lock:
            self.warnings = warnings
        for line in warnings:
            log.warning("%s", line)
        return tuple(gpus)

    def _discover_one(self, index: int, warnings: list[str]) -> Gpu | None:
        nv = self._nvml
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nv.nvmlDeviceGetUUID(handle))
        name = _text(nv.nvmlDeviceGetName(handle))
        with self._lock:
            self._handles[uuid] = handle
        try:
            prod = product_for_nvml_name(name)
        except CatalogueError as exc:
            warnings.append(f"GPU {index} ({uuid}) skipped: {exc}")
            return None
        memory_mib = int(nv.nvmlDeviceGetMemoryInfo(handle).total) // _MIB
        if self._mig_enabled(handle):
            instances = self._instances(handle, uuid, prod, warnings)
            try:
                return Gpu(uuid, index, prod.name, memory_mib, "mig", sum(i.compute_slices for i in instances),
                           healthy=self._gpu_healthy(uuid, "mig"), instances=instances)
            except CatalogueError as exc:
                warnings.append(f"GPU {index} ({uuid}) skipped: its MIG layout does not validate: {exc}")
                return None
        target = self._target(uuid)
        mode = target.mode if target.mode != "mig" else "whole"
        slices = target.slices if target.mode != "mig" else self.default_target.slices
        if target.mode == "mig":
            warnings.append(f"GPU {index} ({uuid}): target is mig but MIG mode is off; advertised as whole")
        return Gpu(uuid, index, prod.name, memory_mib, mode, slices, healthy=self._gpu_healthy(uuid, mode))

    def _mig_enabled(self, handle: Any) -> bool:
        nv = self._nvml
        try:
            current, _pending = nv.nvmlDeviceGetMigMode(handle)
        except nv.NVMLError as exc:
            if exc.value == nv.NVML_ERROR_NOT_SUPPORTED:
                return False
            raise
        return bool(current == nv.NVML_DEVICE_MIG_ENABLE)

    def _instances(self, handle: Any, gpu_uuid: str, prod: Product,
                   warnings: list[str]) -> tuple[MigInstance, ...]:
        nv = self._nvml
        found: dict[int, list[tuple[str, MigProfile, int | None, int]]] = {}
        split: set[int] = set()
        with self._lock:  # re-read: instances re-created since the last discovery get new ids
            for key in [k for k in self._mig_by_gi if k[0] == gpu_uuid]:
                del self._mig_by_gi[key]
        for mig_index in range(nv.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
            except nv.NVMLError:
                continue  # unused index
            mig_uuid = _text(nv.nvmlDeviceGetUUID(mig))
            gi_id = int(nv.nvmlDeviceGetGpuInstanceId(mig))
            memory_mib = int(nv.nvmlDeviceGetMemoryInfo(mig).total) // _MIB
            attrs = self._attributes(mig)
            if attrs is not None and attrs.computeInstanceSliceCount != attrs.gpuInstanceSliceCount:
                split.add(gi_id)
            try:
                profile, start = self._profile_and_start(handle, gi_id, prod, attrs)
            except (CatalogueError, nv.NVMLError) as exc:
                warnings.append(f"GPU {gpu_uuid}: MIG device {mig_uuid} skipped: {exc}")
                continue
            found.setdefault(gi_id, []).append((mig_uuid, profile, start, memory_mib))
        chosen: list[tuple[int, str, MigProfile, int | None, int]] = []
        for gi_id, devices in sorted(found.items()):
            if len(devices) > 1 or gi_id in split:
                warnings.append(
                    f"GPU {gpu_uuid}: GPU instance {gi_id} is split into compute instances "
                    f"({', '.join(d[0] for d in devices)}); gpu-slice advertises whole GPU instances only, skipped")
                continue
            mig_uuid, profile, start, memory_mib = devices[0]
            chosen.append((gi_id, mig_uuid, profile, start, memory_mib))
        starts = self._infer_starts(gpu_uuid, [(c[2], c[3]) for c in chosen], warnings)
        instances = []
        with self._lock:
            for (gi_id, mig_uuid, profile, _start, memory_mib), start in zip(chosen, starts, strict=True):
                self._mig_by_gi[(gpu_uuid, gi_id)] = mig_uuid
                self._parent_of[mig_uuid] = gpu_uuid
                instances.append(MigInstance(mig_uuid, profile.name, start, profile.compute_slices, memory_mib,
                                             gi_id))
        return tuple(sorted(instances, key=lambda i: i.start))

    def _attributes(self, mig: Any) -> Any:
        nv = self._nvml
        try:
            return nv.nvmlDeviceGetAttributes(mig)
        except nv.NVMLError:
            return None

    def _profile_and_start(self, handle: Any, gi_id: int, prod: Product, attrs: Any) -> tuple[MigProfile, int | None]:
        """Exact profile and start from the GPU instance; without privileges, matched from attributes."""
        nv = self._nvml
        try:
            info = nv.nvmlGpuInstanceGetInfo(nv.nvmlDeviceGetGpuInstanceById(handle, gi_id))
        except nv.NVMLError as exc:
            if attrs is None:
                raise
            candidates = [p for p in prod.mig_profiles
                          if p.compute_slices == attrs.gpuInstanceSliceCount and not p.name.endswith("+me")]
            if not candidates:
                raise CatalogueError(
                    f"no {prod.name} profile has {attrs.gpuInstanceSliceCount} compute slices ({exc})") from exc
            best = min(candidates, key=lambda p: abs(p.memory_mib - int(attrs.memorySizeMB)))
            return best, None
        return prod.profile_by_id(int(info.profileId)), int(info.placement.start)

    def _infer_starts(self, gpu_uuid: str, items: list[tuple[MigProfile, int | None]],
                      warnings: list[str]) -> list[int]:
        used: set[int] = set()
        for profile, start in items:
            if start is not None:
                used |= profile.covers(start)
        result: list[int | None] = [start for _p, start in items]
        order = sorted((i for i, (_p, s) in enumerate(items) if s is None), key=lambda i: -items[i][0].memory_slices)
        for i in order:
            profile = items[i][0]
            start = next((s for s in profile.starts if not profile.covers(s) & used), profile.starts[0])
            used |= profile.covers(start)
            result[i] = start
            warnings.append(f"GPU {gpu_uuid}: placement of a {profile.name} instance inferred as start {start} "
                            "(GPU instance info needs a privileged user)")
        return [s if s is not None else 0 for s in result]

    def _target(self, uuid: str) -> GpuTarget:
        with self._lock:
            return self._targets.get(uuid, self.default_target)

    def _gpu_healthy(self, uuid: str, mode: str) -> bool:
        with self._lock:
            fault = self._faults.get(uuid)
        if fault is not None:
            return False
        return not (mode == "mps" and self._mps is not None and not self._mps.is_up(uuid))

    def unhealthy(self) -> Mapping[str, str]:
        with self._lock:
            out = {owner: f.reason for owner, f in self._faults.items()}
        if self._mps is not None:
            for uuid, up in self._mps.status().items():
                if not up and uuid not in out:
                    out[uuid] = self._mps.reason(uuid)
        return out

    # ---- changes ---------------------------------------------------------------------------------

    def apply_targets(self, targets: Mapping[str, GpuTarget], allocated: frozenset[str]) -> list[str]:
        """Bring non-MIG GPUs to ``mps``/``whole``; report MIG differences; wait on allocated GPUs.

        GPUs not named follow ``default_target`` if MIG is off and are left alone if MIG is on.
        """
        messages: list[str] = []
        for gpu in self.discover():
            if gpu.uuid not in targets and gpu.mode == "mig":
                continue  # the default target is for non-MIG GPUs; a MIG GPU is named to be changed
            target = targets.get(gpu.uuid, self.default_target)
            busy = sorted(sid for sid in gpu.slice_ids() if sid in allocated)
            if gpu.mode == "mig" or target.mode == "mig":
                messages += self._mig_difference(gpu, target)
                continue
            if target.mode == "mps" and not 1 <= target.slices <= MAX_MPS_CLIENT_SLICES:
                messages.append(f"GPU {gpu.uuid}: refused target mps with S={target.slices}: MPS serves at most "
                                f"{MAX_MPS_CLIENT_SLICES} clients per GPU; keeping {gpu.mode}(S={gpu.slices})")
                continue
            changes = self._planned_changes(gpu, target)
            if not changes:
                continue
            what = "; ".join(changes)
            if busy:
                messages.append(f"GPU {gpu.uuid}: change waits ({what}): {len(busy)} of its ids are allocated "
                                f"({', '.join(busy[:3])}{', ...' if len(busy) > 3 else ''})")
                continue
            if self.read_only:
                with self._lock:
                    self._targets[gpu.uuid] = target
                messages.append(f"GPU {gpu.uuid}: read-only, would have changed: {what}; advertised as "
                                f"{target.mode}(S={target.slices}) without changing the GPU")
                continue
            messages.append(self._apply(gpu, target, what))
        if self._mps is not None:
            self._mps.set_gpus(g.uuid for g in self.discover() if g.mode == "mps")
        return messages

    def would_change(self, gpu: Gpu, target: GpuTarget) -> bool:
        """Whether ``apply_targets`` would change this GPU's ids when idle (never MIG, never read-only).

        A compute-mode-only change keeps the ids, so it does not count. No NVML call: this runs on
        the event loop."""
        if self.read_only or gpu.mode == "mig" or target.mode == "mig":
            return False
        if target.mode == "mps" and not 1 <= target.slices <= MAX_MPS_CLIENT_SLICES:
            return False
        return (gpu.mode, gpu.slices) != (target.mode, target.slices)

    def _mig_difference(self, gpu: Gpu, target: GpuTarget) -> list[str]:
        if gpu.mode != "mig":
            return [f"GPU {gpu.uuid}: target is mig but MIG mode is off; gpu-slice does not enable MIG mode "
                    f"(operator: nvidia-smi -i {gpu.uuid} -mig 1, then create instances); advertised as whole"]
        if target.mode != "mig":
            return [f"GPU {gpu.uuid}: target is {target.mode} but MIG mode is on; gpu-slice does not disable MIG "
                    f"mode (operator: nvidia-smi -i {gpu.uuid} -mig 0); advertised as mig"]
        if target.mig_layout is not None:
            current = sorted((i.profile, i.start) for i in gpu.instances)
            if sorted(target.mig_layout) != current:
                return [f"GPU {gpu.uuid}: MIG layout {current} differs from target {sorted(target.mig_layout)}; "
                        "gpu-slice does not create or destroy MIG instances on NVML; keeping the current layout"]
        return []

    def _planned_changes(self, gpu: Gpu, target: GpuTarget) -> list[str]:
        changes = []
        if (gpu.mode, gpu.slices) != (target.mode, target.slices):
            changes.append(f"{gpu.mode}(S={gpu.slices}) -> {target.mode}(S={target.slices})")
        compute = self._compute_mode(gpu.uuid)
        nv = self._nvml
        if target.mode == "mps" and compute is not None and compute != nv.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS:
            changes.append(f"set compute mode EXCLUSIVE_PROCESS (now {self._compute_name(compute)})")
        if target.mode != "mps" and gpu.uuid in self._before:
            changes.append(f"set compute mode {self._compute_name(self._before[gpu.uuid])} "
                           "(gpu-slice had set EXCLUSIVE_PROCESS)")
        if target.mode == "mps" and self._mps is None and self.read_only:
            changes.append("start an MPS control daemon")
        return changes

    def _compute_mode(self, uuid: str) -> int | None:
        nv = self._nvml
        try:
            return int(nv.nvmlDeviceGetComputeMode(self._handles[uuid]))
        except nv.NVMLError:
            return None

    def _compute_name(self, mode: int) -> str:
        nv = self._nvml
        names = {nv.NVML_COMPUTEMODE_DEFAULT: "DEFAULT", nv.NVML_COMPUTEMODE_PROHIBITED: "PROHIBITED",
                 nv.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "EXCLUSIVE_PROCESS"}
        return names.get(mode, str(mode))

    def _apply(self, gpu: Gpu, target: GpuTarget, what: str) -> str:
        nv = self._nvml
        handle = self._handles[gpu.uuid]
        compute = self._compute_mode(gpu.uuid)
        problems: list[str] = []
        try:
            if target.mode == "mps" and compute is not None and compute != nv.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS:
                nv.nvmlDeviceSetComputeMode(handle, nv.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
                self._before.setdefault(gpu.uuid, compute)
                self._save_record(problems)
            elif target.mode != "mps" and gpu.uuid in self._before:
                nv.nvmlDeviceSetComputeMode(handle, self._before[gpu.uuid])
                del self._before[gpu.uuid]
                self._save_record(problems)
        except nv.NVMLError as exc:
            problems.append(f"could not set compute mode: {exc}")
        with self._lock:
            self._targets[gpu.uuid] = target
        tail = f" ({'; '.join(problems)})" if problems else ""
        return f"GPU {gpu.uuid}: changed: {what}{tail}"

    def _save_record(self, problems: list[str]) -> None:
        try:
            compute_mode.save(self._record_root, self._before)
        except OSError as exc:
            problems.append(f"could not record the compute mode under {self._record_root}: {exc}")

    # ---- health ----------------------------------------------------------------------------------

    def watch_health(self, emit: Callable[[HealthEvent], None]) -> None:
        """Register critical-XID events for every GPU and start the waiting thread (and MPS supervision)."""
        nv = self._nvml
        self._emit = emit
        if self._thread is not None:
            return
        if not self._handles:
            self.discover()
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            raise DiscoveryError(f"NVML event set could not be created: {exc}") from exc
        for uuid, handle in list(self._handles.items()):
            try:
                supported = int(nv.nvmlDeviceGetSupportedEventTypes(handle))
                mask = nv.nvmlEventTypeXidCriticalError & supported
                if not mask:
                    log.warning("GPU %s does not report XID events; health from MPS and probes only", uuid)
                    continue
                nv.nvmlDeviceRegisterEvents(handle, mask, self._event_set)
            except nv.NVMLError as exc:
                if exc.value == nv.NVML_ERROR_NOT_SUPPORTED:
                    log.warning("GPU %s is too old for XID health checks: %s", uuid, exc)
                else:
                    self._fault(uuid, None, f"XID events could not be registered: {exc}")
        self.check_reset_needed()
        if self._mps is not None:
            # Without a config file apply_targets never runs: the mps GPUs discovered now get their daemons.
            self._mps.set_gpus(g.uuid for g in self.discover() if g.mode == "mps")
            self._mps.start(emit)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="nvml-health", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        nv = self._nvml
        while not self._stop.is_set():
            try:
                data = nv.nvmlEventSetWait_v2(self._event_set, self._event_timeout_ms)
            except nv.NVMLError as exc:
                if exc.value != nv.NVML_ERROR_TIMEOUT and not self._stop.is_set():
                    for uuid in list(self._handles):
                        self._fault(uuid, None, f"waiting for NVML events failed: {exc}")
                    self._stop.wait(min(1.0, self._event_timeout_ms / 1000))
                self._periodic()
                continue
            try:
                self.handle_event(data)
            except Exception:  # never let one odd event end health watching
                log.exception("NVML event could not be handled")
            self._periodic()

    def _periodic(self) -> None:
        if self._clock() >= self._next_reset_check:
            self.check_reset_needed()
        self.check_recovery()

    def check_reset_needed(self) -> list[str]:
        """Read every GPU's row-remapping and retired-page state; a GPU that needs a reset gets a
        sticky fault. Returns the GPUs found needing one (counters NVML does not support are skipped)."""
        self._next_reset_check = self._clock() + self.reset_check_s
        found = []
        for uuid, handle in list(self._handles.items()):
            why = self._reset_reason(handle)
            if why is not None:
                found.append(uuid)
                self._fault(uuid, None, f"{why}: {RESET_HINT}", sticky=True)
        return found

    def _reset_reason(self, handle: Any) -> str | None:
        nv = self._nvml
        try:
            _corr, _unc, pending, failed = nv.nvmlDeviceGetRemappedRows(handle)
            if failed:
                return "row remapping failed (the GPU may need replacing)"
            if pending:
                return "row remapping pending"
        except nv.NVMLError as exc:
            if exc.value not in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                log.info("remapped rows not readable: %s", exc)
        except AttributeError:
            pass  # an nvidia-ml-py without the call
        try:
            if int(nv.nvmlDeviceGetRetiredPagesPendingStatus(handle)) == nv.NVML_FEATURE_ENABLED:
                return "retired pages pending"
        except nv.NVMLError as exc:
            if exc.value not in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                log.info("retired pages not readable: %s", exc)
        except AttributeError:
            pass
        return None

    def handle_event(self, data: Any) -> None:
        """Turn one ``c_nvmlEventData_t`` into a fault (public so the probe script can replay one)."""
        nv = self._nvml
        if int(data.eventType) != nv.nvmlEventTypeXidCriticalError:
            return
        xid = int(data.eventData)
        if xid in self._ignored:
            log.info("ignoring application XID %d", xid)
            return
        try:
            uuid = _text(nv.nvmlDeviceGetUUID(data.device))
        except nv.NVMLError as exc:
            for gpu_uuid in list(self._handles):
                self._fault(gpu_uuid, None, f"XID {xid} on a GPU whose UUID NVML cannot read ({exc})")
            return
        if uuid not in self._handles:
            log.info("ignoring XID %d on unknown GPU %s", xid, uuid)
            return
        gi = int(data.gpuInstanceId)
        if xid in RESET_REQUIRED_XIDS:  # GPU-wide whatever instance reported it
            where = f" (reported by GPU instance {gi})" if gi != NO_INSTANCE else ""
            self._fault(uuid, None, f"critical XID {xid} ({RESET_REQUIRED_XIDS[xid]}){where}: {RESET_HINT}",
                        sticky=True)
            return
        with self._lock:
            mig_uuid = self._mig_by_gi.get((uuid, gi)) if gi != NO_INSTANCE else None
        if mig_uuid is not None:
            self._fault(mig_uuid, mig_uuid, f"critical XID {xid} on MIG instance {mig_uuid} (GPU instance {gi})",
                        gpu_uuid=uuid)
        elif gi != NO_INSTANCE:
            log.warning("XID %d on GPU %s in GPU instance %d, which gpu-slice does not advertise: no advertised "
                        "instance is affected", xid, uuid, gi)
        else:
            self._fault(uuid, None, f"critical XID {xid}")

    def _fault(self, owner: str, instance: str | None, reason: str, *, gpu_uuid: str | None = None,
               sticky: bool = False) -> None:
        now = self._clock()
        with self._lock:
            known = self._faults.get(owner)
            if known is not None and known.sticky and not sticky:
                known.last_seen = now  # a reset is still needed: keep its reason
                return
            self._faults[owner] = _Fault(gpu_uuid or owner, instance, reason, now, sticky)
        if known is None or (sticky and not known.sticky):
            log.warning("%s unhealthy: %s", owner, reason)
            self._emit(HealthEvent(gpu_uuid or owner, False, reason, instance))

    def check_recovery(self) -> list[HealthEvent]:
        """Apply the recovery rule (quiet period, then a successful probe); emits and returns recoveries."""
        nv = self._nvml
        now = self._clock()
        with self._lock:
            due = [(o, f) for o, f in self._faults.items()
                   if not f.sticky and now - f.last_seen >= self.quiet_period_s]
        events = []
        for owner, fault in due:
            handle = self._handles.get(fault.gpu_uuid)
            try:
                if handle is None:
                    raise DiscoveryError("no handle")
                nv.nvmlDeviceGetUUID(handle)
                nv.nvmlDeviceGetMemoryInfo(handle)
            except (nv.NVMLError, DiscoveryError) as exc:
                log.info("%s still unhealthy, probe failed: %s", owner, exc)
                continue
            with self._lock:
                if self._faults.get(owner) is not fault:
                    continue
                del self._faults[owner]
            event = HealthEvent(fault.gpu_uuid, True,
                                f"recovered: no critical XID for {self.quiet_period_s:g}s and NVML answers "
                                f"(was: {fault.reason})", fault.instance_uuid)
            events.append(event)
            self._emit(event)
        return events

    # ---- processes (the budget watch) -------------------------------------------------------------

    def gpu_processes(self, gpu_uuid: str) -> tuple[GpuProcess, ...]:
        """The compute processes on one GPU now: each MPS client with its memory, and every other
        compute process (the MPS server among them; the budget watch tells it apart by name)."""
        nv = self._nvml
        with self._lock:
            handle = self._handles.get(gpu_uuid)
        if handle is None:
            raise DiscoveryError(f"no GPU {gpu_uuid} on this node")
        try:
            compute = list(nv.nvmlDeviceGetComputeRunningProcesses(handle))
            mps = list(nv.nvmlDeviceGetMPSComputeRunningProcesses(handle))
        except nv.NVMLError as exc:
            raise DiscoveryError(f"GPU {gpu_uuid}: NVML could not list its processes: {exc}") from exc
        out: dict[int, GpuProcess] = {}
        for proc, is_client in [(p, False) for p in compute] + [(p, True) for p in mps]:
            pid = int(proc.pid)
            used = proc.usedGpuMemory  # None where NVML cannot tell (pynvml maps NOT_AVAILABLE)
            mib = None if used is None else int(used) // _MIB
            if pid in out and not is_client:
                continue
            out[pid] = GpuProcess(pid, mib, is_client or (pid in out and out[pid].mps_client))
        return tuple(sorted(out.values(), key=lambda p: p.pid))

    def close(self) -> None:
        nv = self._nvml
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._event_timeout_ms / 1000 + 5)
            self._thread = None
        if self._mps is not None:
            self._mps.close()
        if self._event_set is not None:
            try:
                nv.nvmlEventSetFree(self._event_set)
            except nv.NVMLError as exc:
                log.info("NVML event set free failed: %s", exc)
            self._event_set = None
        try:
            nv.nvmlShutdown()
        except nv.NVMLError as exc:
            log.info("NVML shutdown failed: %s", exc)
