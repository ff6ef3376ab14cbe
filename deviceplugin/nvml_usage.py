"""MIG instances' memory and activity through NVML, for the per-pod series (a MIG pod owns its instance,
so the instance's figures are the pod's).

* **Memory**: ``nvmlDeviceGetMemoryInfo`` on the MIG device handle: the instance's framebuffer in use.
* **Activity**: NVML's GPU performance monitoring (GPM), what DCGM's profiling fields read on Hopper
  and later: ``nvmlGpmMigSampleGet`` of the parent GPU and the GPU-instance id at each reading, and
  ``nvmlGpmMetricsGet`` between it and the previous one for ``NVML_GPM_METRIC_GRAPHICS_UTIL`` and
  ``NVML_GPM_METRIC_DRAM_BW_UTIL`` (percent, kept as ratios 0..1). The first reading of an instance
  has no activity yet; readings closer than ``min_interval_s`` reuse the last figures (two scrapes a
  moment apart would measure a moment). A GPU without GPM (``nvmlGpmQueryDeviceSupport`` says so:
  A100, A30) has no activity here, said once in the log; dcgm-exporter's profiling module is the
  source there.

Every NVML failure leaves that figure out (None) and is logged once per instance and cause; a
reading never raises.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from deviceplugin.backend import UnitUsage

log = logging.getLogger(__name__)

_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class MigDevice:
    """What NVML needs to read one advertised MIG instance."""

    uuid: str
    handle: Any  # the MIG device handle
    parent_uuid: str
    parent: Any  # the parent GPU's handle
    gi_id: int


@dataclass(slots=True)
class _Sampled:
    sample: Any
    at: float
    gr: float | None = None
    dram: float | None = None


class MigUsageReader:
    """Reads :class:`UnitUsage` for MIG instances; keeps each instance's last GPM sample."""

    def __init__(self, nvml: Any, *, min_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._nv = nvml
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._lock = threading.Lock()  # scrapes may overlap
        self._last: dict[tuple[str, int], _Sampled] = {}
        self._gpm: dict[str, bool] = {}  # parent uuid -> GPM supported
        self._said: set[tuple[str, str]] = set()

    def _once(self, who: str, why: str, message: str) -> None:
        if (who, why) not in self._said:
            self._said.add((who, why))
            log.warning("%s", message)

    def read(self, devices: Iterable[MigDevice]) -> dict[str, UnitUsage]:
        """Every instance's figures now (the metrics thread calls this at scrape time)."""
        with self._lock:
            out: dict[str, UnitUsage] = {}
            seen: set[tuple[str, int]] = set()
            for dev in devices:
                seen.add((dev.parent_uuid, dev.gi_id))
                gr, dram = self._activity(dev)
                out[dev.uuid] = UnitUsage(self._memory(dev), gr, dram)
            for key in set(self._last) - seen:  # instances destroyed or no longer advertised
                self._free(self._last.pop(key).sample)
            return out

    def close(self) -> None:
        with self._lock:
            for entry in self._last.values():
                self._free(entry.sample)
            self._last.clear()

    def _memory(self, dev: MigDevice) -> int | None:
        nv = self._nv
        try:
            return int(nv.nvmlDeviceGetMemoryInfo(dev.handle).used) // _MIB
        except nv.NVMLError as exc:
            self._once(dev.uuid, "memory", f"MIG instance {dev.uuid}: NVML cannot read its memory use: {exc}")
            return None

    def _supported(self, dev: MigDevice) -> bool:
        nv = self._nv
        known = self._gpm.get(dev.parent_uuid)
        if known is not None:
            return known
        try:
            ok = bool(nv.nvmlGpmQueryDeviceSupport(dev.parent).isSupportedDevice)
            why = "the GPU does not support it"
        except (nv.NVMLError, AttributeError) as exc:  # an older driver lacks the GPM entry points
            ok, why = False, str(exc)
        if not ok:
            log.warning("GPU %s: no GPU performance monitoring (%s): its MIG instances' activity is not "
                        "served (memory is); dcgm-exporter's profiling metrics are the source on such GPUs",
                        dev.parent_uuid, why)
        self._gpm[dev.parent_uuid] = ok
        return ok

    def _activity(self, dev: MigDevice) -> tuple[float | None, float | None]:
        if not self._supported(dev):
            return None, None
        nv = self._nv
        key = (dev.parent_uuid, dev.gi_id)
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last.at < self.min_interval_s:
            return last.gr, last.dram
        try:
            sample = nv.nvmlGpmSampleAlloc()
        except nv.NVMLError as exc:
            self._once(dev.uuid, "alloc", f"MIG instance {dev.uuid}: NVML cannot allocate a GPM sample: {exc}")
            return None, None
        try:
            nv.nvmlGpmMigSampleGet(dev.parent, dev.gi_id, sample)
        except nv.NVMLError as exc:
            self._free(sample)
            self._once(dev.uuid, "sample", f"MIG instance {dev.uuid}: NVML cannot sample its activity: {exc}")
            return None, None
        entry = _Sampled(sample, now)
        if last is not None:
            entry.gr, entry.dram = self._metrics(dev, last.sample, sample)
            self._free(last.sample)
        self._last[key] = entry
        return entry.gr, entry.dram

    def _metrics(self, dev: MigDevice, first: Any, second: Any) -> tuple[float | None, float | None]:
        nv = self._nv
        query = nv.c_nvmlGpmMetricsGet_t()
        query.version = nv.NVML_GPM_METRICS_GET_VERSION
        query.numMetrics = 2
        query.sample1 = first
        query.sample2 = second
        query.metrics[0].metricId = nv.NVML_GPM_METRIC_GRAPHICS_UTIL
        query.metrics[1].metricId = nv.NVML_GPM_METRIC_DRAM_BW_UTIL
        try:
            nv.nvmlGpmMetricsGet(query)
        except nv.NVMLError as exc:
            self._once(dev.uuid, "metrics", f"MIG instance {dev.uuid}: NVML cannot compute its GPM metrics: {exc}")
            return None, None
        values = []
        for metric in (query.metrics[0], query.metrics[1]):
            ok = metric.nvmlReturn == nv.NVML_SUCCESS
            values.append(round(min(max(float(metric.value) / 100, 0.0), 1.0), 6) if ok else None)
        return values[0], values[1]

    def _free(self, sample: Any) -> None:
        nv = self._nv
        try:
            nv.nvmlGpmSampleFree(sample)
        except nv.NVMLError as exc:
            log.info("NVML GPM sample free failed: %s", exc)
