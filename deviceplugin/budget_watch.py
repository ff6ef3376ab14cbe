"""The budget watch's loop in the plugin: read each MPS GPU's processes, judge them
(:func:`deviceplugin.budget.check_gpu`), report each finding once, and evict where configured.

NVML and ``/proc`` are read on a worker thread; the pod cache is read on the event loop. A finding
that persists is reported once (log, pod event, metric); the metric counts the findings in force
now, so it falls back to 0 when the pod behaves or leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from deviceplugin.assignments import AssignmentBook
from deviceplugin.backend import Backend, GpuProcess
from deviceplugin.budget import KINDS, Finding, Holder, check_gpu
from deviceplugin.errors import DevicePluginError
from gpuslice.model import NodeInventory

log = logging.getLogger(__name__)

PodEvent = Callable[[str, str, str, str, str, str], Awaitable[None]]
Evict = Callable[[str, str, str], None]
EVENT_REASON = {"over-share": "GpuShareExceeded", "outside-mps": "GpuOutsideMps", "no-slices": "GpuWithoutSlices"}


def holders(book: AssignmentBook | None) -> dict[str, Holder]:
    """Pod UID -> its holding on this node: PodResources' ids first, else the plugin's stamp."""
    if book is None:
        return {}
    out: dict[str, Holder] = {}
    for pod in book.pods.values():
        if not pod.live:
            continue
        sids = book.admitted.get(pod.key) or pod.allocated_ids
        if sids:
            out[pod.uid] = Holder(pod.uid, pod.namespace, pod.name, tuple(sids))
    return out


class BudgetWatch:
    """Reads, judges and reports; ``run`` every ``interval_s`` until ``stop``."""

    def __init__(self, backend: Backend, inventory: Callable[[], NodeInventory],
                 book: Callable[[], AssignmentBook | None], *, interval_s: float, proc_root: Path,
                 event: PodEvent | None, evict: Evict | None, registry: CollectorRegistry | None = None) -> None:
        self.backend = backend
        self._inventory = inventory
        self._book = book
        self.interval_s = interval_s
        self.proc_root = proc_root
        self._event = event
        self._evict = evict
        self.reported: dict[tuple[str, str, str], Finding] = {}
        self.evicted: set[str] = set()
        self.passes = 0
        self.gauge: Gauge | None = None
        self.evictions: Counter | None = None
        if registry is not None:
            self.gauge = Gauge("gpu_slice_budget_violations",
                               "Findings of the MPS budget watch in force now, by GPU and kind (over-share: a pod's "
                               "clients use more than its share; outside-mps: a compute process not under MPS; "
                               "no-slices: an MPS client of a pod holding no slice of that GPU).",
                               ["gpu_uuid", "kind"], registry=registry)
            self.evictions = Counter("gpu_slice_budget_evictions", "Pods the budget watch evicted.",
                                     registry=registry)

    async def pass_once(self) -> list[Finding]:
        """One look at every healthy MPS GPU; returns every finding in force (new ones are reported)."""
        self.passes += 1
        gpus = [g for g in self._inventory().gpus if g.mode == "mps" and g.healthy]
        found: list[Finding] = []
        held = holders(self._book())
        for gpu in gpus:
            try:
                procs: tuple[GpuProcess, ...] = await asyncio.to_thread(self.backend.gpu_processes, gpu.uuid)
            except DevicePluginError as exc:
                log.info("budget watch: %s", exc)
                continue
            found += await asyncio.to_thread(check_gpu, gpu, procs, held, self.proc_root)
        now = {f.key: f for f in found}
        for key in sorted(set(now) - set(self.reported)):
            await self._report(now[key])
        self.reported = now
        if self.gauge is not None:
            for gpu in gpus:
                for kind in KINDS:
                    self.gauge.labels(gpu_uuid=gpu.uuid, kind=kind).set(
                        sum(1 for f in found if f.gpu_uuid == gpu.uuid and f.kind == kind))
        return found

    async def _report(self, f: Finding) -> None:
        log.warning("budget watch: %s", f.message)
        pod = f.pod
        if pod is None:
            return
        if self._event is not None:
            await self._event(pod.namespace, pod.name, pod.uid, EVENT_REASON[f.kind], f.message, "Warning")
        if self._evict is None or pod.uid in self.evicted or f.kind == "no-slices":
            return  # a client on a GPU its pod holds nothing of is reported only: the view may lag
        try:
            await asyncio.to_thread(self._evict, pod.namespace, pod.name, pod.uid)
        except DevicePluginError as exc:
            log.warning("budget watch: could not evict pod %s/%s: %s", pod.namespace, pod.name, exc)
            return
        self.evicted.add(pod.uid)
        if self.evictions is not None:
            self.evictions.inc()
        log.warning("budget watch: evicted pod %s/%s (%s)", pod.namespace, pod.name, f.kind)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.pass_once()
            except Exception:  # the watch must outlive one odd pass (a /proc race, a NVML hiccup)
                log.exception("budget watch pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
