"""dcgm-exporter-compatible series for the simulated backend, so the extender's utilization policy and
the dashboards work on clusters without GPUs.

Names, label names and label order follow dcgm-exporter <= 4.8 (reference/protocols.md section 3):
``gpu, UUID, pci_bus_id, device, modelName, [GPU_I_PROFILE, GPU_I_ID], <hostname label>,
[DCGM_FI_DRIVER_VERSION], [container, namespace, pod]``. ``UUID`` is the parent GPU's UUID also on
MIG instance series. A MIG GPU is exported per GPU instance, without ``DCGM_FI_DEV_GPU_UTIL`` (not
supported on MIG); other GPUs get one series set per pod using them (the device value repeated, as
the exporter does for a shared GPU), or one without pod labels when idle. Served through
prometheus_client the labels come out sorted by name (the same series to Prometheus);
``render_text`` writes them in the exporter's order.

The driver is each pod's ``example.com/simulated-utilization`` annotation (0-100), given as a
mapping of allocated slice id -> ``SliceUse``. A MIG instance's activity is its pod's value; an
MPS/whole GPU's is sum(u_pod * k_pod / S), capped at 100. Memory bandwidth is
``dram_factor * activity`` (LLM decoding is bandwidth-bound) and framebuffer use is
``fb_fraction`` of the memory share each pod holds (a serving engine preallocates its share).
A bad annotation is ignored (the pod counts as idle), logged once per pod and value, and counted in
``gpu_slice_simulated_utilization_invalid_total``; it never fails a scrape.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuslice import ids
from gpuslice.catalogue import PRODUCTS
from gpuslice.model import Gpu, MigInstance

log = logging.getLogger(__name__)

UTILIZATION_ANNOTATION = "example.com/simulated-utilization"
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
GR_ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
DRAM_ACTIVE = "DCGM_FI_PROF_DRAM_ACTIVE"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
_HELP = {
    GPU_UTIL: "GPU utilization (in %).",
    GR_ENGINE_ACTIVE: "Ratio of time the graphics engine is active.",
    DRAM_ACTIVE: "Ratio of cycles the device memory interface is active sending or receiving data.",
    FB_USED: "Framebuffer memory used (in MiB).",
    FB_FREE: "Framebuffer memory free (in MiB).",
}


@dataclass(frozen=True, slots=True)
class SliceUse:
    """Who holds an allocated slice, and the raw value of its pod's utilization annotation (or None)."""

    namespace: str
    pod: str
    container: str
    utilization: str | float | int | None = None


@dataclass(frozen=True, slots=True)
class DcgmOptions:
    """Exporter details that differ between deployments and versions."""

    hostname: str = "sim-node"
    hostname_label: str = "hostname"  # "Hostname" before dcgm-exporter 4.6.0-4.8.3
    driver_version: str | None = "550.54.15"
    dram_factor: float = 0.8
    fb_fraction: float = 0.9
    replace_blanks_in_model_name: bool = False


def parse_utilization(raw: str | float | int | None) -> float:
    """0..100 from the annotation value; raises ``ValueError`` saying why not."""
    if raw is None:
        return 0.0
    if isinstance(raw, bool):
        raise ValueError(f"utilization must be a number 0-100, got {raw!r}")
    try:
        value = float(raw.strip()) if isinstance(raw, str) else float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"utilization must be a number 0-100, got {raw!r}") from None
    if not math.isfinite(value) or not 0 <= value <= 100:
        raise ValueError(f"utilization must be a number 0-100, got {raw!r}")
    return value


def simulated_gi_id(product: str, inst: MigInstance) -> int:
    """A GPU-instance id by NVML's fixed-placement convention: larger instances get smaller ids.

    With M memory slices: the full-size instance is 0, then M/4-size... e.g. on 8 slices size 4 -> 1-2,
    size 2 -> 3-6, size 1 -> 7-13 (start order). Simulated only; real ids come from NVML.
    """
    prod = PRODUCTS[product]
    size = prod.profile(inst.profile).memory_slices
    total = prod.memory_slices
    base, span = 0, total
    while span > size:
        base += total // span
        span //= 2
    return base + inst.start // size


def pci_bus_id(index: int) -> str:
    return f"00000000:{(0x07 + 8 * index) & 0xFF:02X}:00.0"


def model_name(gpu: Gpu, replace_blanks: bool = False) -> str:
    prod = PRODUCTS.get(gpu.product)
    name = prod.nvml_names[0] if prod is not None and prod.nvml_names else gpu.product
    return name.replace(" ", "-") if replace_blanks else name


def _value(value: float) -> str:
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_text(metrics: Iterable[Metric]) -> str:
    """Text exposition with labels in the exporter's order (prometheus_client sorts them by name).

    Prometheus treats both orders alike; this is for a standalone exporter-style endpoint and for
    comparing with dcgm-exporter output byte for byte.
    """
    lines = []
    for metric in metrics:
        if not metric.samples:
            continue
        lines.append(f"# HELP {metric.name} {metric.documentation}")
        lines.append(f"# TYPE {metric.name} {metric.type}")
        for sample in metric.samples:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sample.labels.items())
            lines.append(f"{sample.name}{{{labels}}} {_value(sample.value)}" if labels
                         else f"{sample.name} {_value(sample.value)}")
    return "\n".join(lines) + "\n"


class DcgmCollector(Collector):
    """Collects the dcgm-compatible series from the GPUs and slice uses at scrape time."""

    def __init__(self, gpus: Callable[[], Iterable[Gpu]], uses: Callable[[], Mapping[str, SliceUse]],
                 options: DcgmOptions | None = None) -> None:
        self._gpus = gpus
        self._uses = uses
        self.options = options or DcgmOptions()
        self._lock = threading.Lock()
        self._invalid_seen: set[tuple[str, str, str]] = set()
        self.invalid_total = 0

    def _utilization(self, use: SliceUse) -> float:
        try:
            return parse_utilization(use.utilization)
        except ValueError as exc:
            key = (use.namespace, use.pod, repr(use.utilization))
            with self._lock:
                fresh = key not in self._invalid_seen
                if fresh:
                    self._invalid_seen.add(key)
                    self.invalid_total += 1
            if fresh:
                log.warning("pod %s/%s: annotation %s ignored: %s", use.namespace, use.pod,
                            UTILIZATION_ANNOTATION, exc)
            return 0.0

    def describe(self) -> Iterable[Metric]:
        return [*self._families().values(), self._invalid_family()]

    def _families(self) -> dict[str, GaugeMetricFamily]:
        return {name: GaugeMetricFamily(name, help_text) for name, help_text in _HELP.items()}

    def _invalid_family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(
            "gpu_slice_simulated_utilization_invalid",
            f"Distinct bad values of the {UTILIZATION_ANNOTATION} annotation seen (pod, value).")
        family.add_metric([], self.invalid_total)
        return family

    def collect(self) -> Iterable[Metric]:
        fams = self._families()
        uses = self._uses()
        by_owner: dict[str, list[SliceUse]] = {}
        for slice_id, use in sorted(uses.items()):
            try:
                owner = ids.owner_of(slice_id)
            except Exception:  # a malformed id from the caller must not fail the scrape
                log.warning("ignoring malformed slice id %r in utilization input", slice_id)
                continue
            by_owner.setdefault(owner, []).append(use)
        for gpu in self._gpus():
            if gpu.mode == "mig":
                for inst in gpu.instances:
                    self._instance(fams, gpu, inst, by_owner.get(inst.uuid, []))
            else:
                self._gpu(fams, gpu, by_owner.get(gpu.uuid, []))
        return [*fams.values(), self._invalid_family()]

    def _base(self, gpu: Gpu, inst: MigInstance | None) -> dict[str, str]:
        labels = {"gpu": str(gpu.index), "UUID": gpu.uuid, "pci_bus_id": pci_bus_id(gpu.index),
                  "device": f"nvidia{gpu.index}",
                  "modelName": model_name(gpu, self.options.replace_blanks_in_model_name)}
        if inst is not None:
            labels["GPU_I_PROFILE"] = inst.profile
            # The inventory's id when the backend gave one (the extender matches on it), else NVML's convention.
            labels["GPU_I_ID"] = str(inst.gi if inst.gi is not None else simulated_gi_id(gpu.product, inst))
        labels[self.options.hostname_label] = self.options.hostname
        if self.options.driver_version is not None:
            labels["DCGM_FI_DRIVER_VERSION"] = self.options.driver_version
        return labels

    @staticmethod
    def _pods(uses: list[SliceUse]) -> dict[tuple[str, str, str], list[SliceUse]]:
        pods: dict[tuple[str, str, str], list[SliceUse]] = {}
        for use in uses:
            pods.setdefault((use.container, use.namespace, use.pod), []).append(use)
        return dict(sorted(pods.items()))

    def _emit(self, fams: dict[str, GaugeMetricFamily], base: dict[str, str],
              pods: Iterable[tuple[str, str, str]], values: dict[str, float]) -> None:
        label_sets = [{**base, "container": c, "namespace": n, "pod": p} for c, n, p in pods] or [base]
        for labels in label_sets:
            for name, value in values.items():
                fams[name].add_sample(name, labels, value)

    def _instance(self, fams: dict[str, GaugeMetricFamily], gpu: Gpu, inst: MigInstance,
                  uses: list[SliceUse]) -> None:
        pods = self._pods(uses)
        util = min(100.0, max((self._utilization(u[0]) for u in pods.values()), default=0.0))
        used = round(inst.memory_mib * self.options.fb_fraction) if pods else 0
        self._emit(fams, self._base(gpu, inst), pods, {
            GR_ENGINE_ACTIVE: round(util / 100, 6),
            DRAM_ACTIVE: round(min(1.0, self.options.dram_factor * util / 100), 6),
            FB_USED: used,
            FB_FREE: inst.memory_mib - used,
        })

    def _gpu(self, fams: dict[str, GaugeMetricFamily], gpu: Gpu, uses: list[SliceUse]) -> None:
        pods = self._pods(uses)
        activity = sum(self._utilization(u[0]) * len(u) / gpu.slices for u in pods.values())
        util = min(100.0, activity)
        held = sum(len(u) for u in pods.values())
        used = min(gpu.memory_mib, round(gpu.memory_mib * held / gpu.slices * self.options.fb_fraction))
        self._emit(fams, self._base(gpu, None), pods, {
            GPU_UTIL: round(util),
            GR_ENGINE_ACTIVE: round(util / 100, 6),
            DRAM_ACTIVE: round(min(1.0, self.options.dram_factor * util / 100), 6),
            FB_USED: used,
            FB_FREE: gpu.memory_mib - used,
        })
