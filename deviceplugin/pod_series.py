"""Per-pod GPU series for dashboards and autoscalers, served by each node's plugin on ``/metrics``.

Every pod holding slices on this node gets, per unit it holds (a MIG instance, an MPS GPU or a
whole GPU), with the labels ``namespace``, ``pod``, ``container`` (the one that asks slices),
``pod_uid``, ``node``, ``gpu_uuid``, ``unit`` (the MIG instance's UUID, else the GPU's), ``mode``
and ``profile`` (the MIG profile, else empty):

* ``gpu_slice_pod_slices``: the slices it holds there;
* ``gpu_slice_pod_memory_limit_bytes``: the memory those slices give: the MIG instance's, or the
  MPS share (:func:`gpuslice.rules.mps_share_mib`, the cap the daemon and the budget watch use), or
  the whole GPUs';
* ``gpu_slice_pod_memory_used_bytes``: what the hardware says the pod uses, where it says it. A MIG
  pod owns its instance, so the instance's framebuffer in use is the pod's (``Backend.instance_usage``:
  NVML on a real node, the simulation model on the simulated backend). On an MPS GPU it is the
  memory of the pod's own MPS client processes, from the budget watch's last pass (NVML's process
  list mapped to pods through cgroups: :func:`deviceplugin.budget.map_processes`, the one mapping);
  0 when the pod runs no client there yet. Not served for whole GPUs;
* ``gpu_slice_pod_gpu_activity_ratio`` and ``gpu_slice_pod_memory_bandwidth_ratio``: the ratio of
  time the pod's MIG instance's graphics engine and memory interface were active (NVML's GPU
  performance monitoring, Hopper and later). MIG pods only: under MPS the GPU's activity is every
  client's together, and dividing it by shares would invent a figure the hardware never measured.

Everything is read at scrape time from snapshots the plugin's event loop keeps (the pods holding each
slice id, the inventory, the budget watch's last pass); only the MIG instances' figures are read from
the backend then, so GPM activity is averaged over the time between two scrapes. A backend that
cannot read them leaves those series out, logged once; a scrape never fails for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deviceplugin.backend import UnitUsage
from deviceplugin.dcgm import SliceUse
from gpuslice import ids
from gpuslice.errors import DeviceIdError
from gpuslice.model import Gpu, NodeInventory
from gpuslice.rules import mps_share_mib

log = logging.getLogger(__name__)

POD_LABELS = ("namespace", "pod", "container", "pod_uid", "node", "gpu_uuid", "unit", "mode", "profile")
_MIB = 1024 * 1024
_HELP = {
    "gpu_slice_pod_slices": "Slices this pod holds on this unit (a MIG instance, an MPS GPU or a whole GPU).",
    "gpu_slice_pod_memory_limit_bytes": "GPU memory the pod's slices give on this unit (MIG instance, MPS share "
                                        "or whole GPUs).",
    "gpu_slice_pod_memory_used_bytes": "GPU memory the pod uses on this unit: its MIG instance's framebuffer in "
                                       "use, or its MPS client processes' memory.",
    "gpu_slice_pod_gpu_activity_ratio": "Ratio of time the pod's MIG instance's graphics engine was active "
                                        "(NVML GPM, since the previous scrape).",
    "gpu_slice_pod_memory_bandwidth_ratio": "Ratio of the pod's MIG instance's memory bandwidth in use (NVML GPM, "
                                            "since the previous scrape).",
}

ClientMemory = Mapping[str, Mapping[str, int | None]]  # GPU uuid -> pod UID -> MiB (None: unknown)


@dataclass(frozen=True, slots=True)
class _Held:
    use: SliceUse
    slices: int


def _holdings(uses: Mapping[str, SliceUse]) -> dict[str, dict[str, _Held]]:
    """Owner (GPU or MIG uuid) -> pod key (UID, else namespace/name) -> the pod and its slice count."""
    out: dict[str, dict[str, _Held]] = {}
    for sid, use in uses.items():
        try:
            owner = ids.owner_of(sid)
        except DeviceIdError:
            continue
        key = use.uid or f"{use.namespace}/{use.pod}"
        pods = out.setdefault(owner, {})
        held = pods.get(key)
        pods[key] = _Held(use, 1 if held is None else held.slices + 1)
    return out


class PodSeriesCollector(Collector):
    """The per-pod series (see the module), from the plugin's snapshots at scrape time."""

    def __init__(self, node: str, inventory: Callable[[], NodeInventory], uses: Callable[[], Mapping[str, SliceUse]],
                 instance_usage: Callable[[], Mapping[str, UnitUsage]] | None = None,
                 client_memory: Callable[[], ClientMemory | None] | None = None) -> None:
        self.node = node
        self._inventory = inventory
        self._uses = uses
        self._instance_usage = instance_usage
        self._client_memory = client_memory or (lambda: None)
        self._failed = False

    def _families(self) -> dict[str, GaugeMetricFamily]:
        return {name: GaugeMetricFamily(name, text, labels=POD_LABELS) for name, text in _HELP.items()}

    def describe(self) -> Iterable[Metric]:
        return list(self._families().values())

    def _usage(self) -> Mapping[str, UnitUsage]:
        if self._instance_usage is None:
            return {}
        try:
            usage = self._instance_usage()
        except Exception as exc:  # a backend hiccup must not fail the scrape of every other series
            if not self._failed:
                log.warning("reading the MIG instances' usage failed (%r); their per-pod memory and activity are "
                            "left out until it works again", exc)
            self._failed = True
            return {}
        self._failed = False
        return usage

    def collect(self) -> Iterable[Metric]:
        fams = self._families()
        held = _holdings(self._uses())
        if not held:
            return list(fams.values())
        inv = self._inventory()
        mig_held = any(i.uuid in held for g in inv.gpus if g.mode == "mig" for i in g.instances)
        usage = self._usage() if mig_held else {}
        memory = self._client_memory() or {}
        for gpu in inv.gpus:
            if gpu.mode == "mig":
                for inst in gpu.instances:
                    for h in held.get(inst.uuid, {}).values():
                        use = usage.get(inst.uuid)
                        self._add(fams, gpu, inst.uuid, inst.profile, h, inst.memory_mib,
                                  None if use is None else use.memory_used_mib,
                                  None if use is None else use.gr_active, None if use is None else use.dram_active)
                continue
            for uid_key, h in held.get(gpu.uuid, {}).items():
                if gpu.mode == "mps":
                    limit = mps_share_mib(gpu.memory_mib, h.slices, gpu.slices)
                    seen = memory.get(gpu.uuid)
                    used = None if seen is None else seen.get(uid_key, 0)
                else:
                    limit, used = gpu.memory_mib, None
                self._add(fams, gpu, gpu.uuid, "", h, limit, used, None, None)
        return list(fams.values())

    def _add(self, fams: dict[str, GaugeMetricFamily], gpu: Gpu, unit: str, profile: str, h: _Held, limit_mib: int,
             used_mib: int | None, gr: float | None, dram: float | None) -> None:
        u = h.use
        labels = [u.namespace, u.pod, u.container, u.uid, self.node, gpu.uuid, unit, gpu.mode, profile]
        fams["gpu_slice_pod_slices"].add_metric(labels, h.slices)
        fams["gpu_slice_pod_memory_limit_bytes"].add_metric(labels, limit_mib * _MIB)
        if used_mib is not None:
            fams["gpu_slice_pod_memory_used_bytes"].add_metric(labels, used_mib * _MIB)
        if gr is not None:
            fams["gpu_slice_pod_gpu_activity_ratio"].add_metric(labels, gr)
        if dram is not None:
            fams["gpu_slice_pod_memory_bandwidth_ratio"].add_metric(labels, dram)
