"""The device plugin's Prometheus metrics, all on an injected registry (no global state in tests).

Slice counts are read from the current inventory at scrape time by a ``Collector``, so they can never
drift from what the plugin advertises. The instruments (RPC latency, registrations, allocation
mismatches, MPS daemon liveness) are updated by the gRPC server, registration and Allocate code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpuslice.model import NodeInventory

SLICE_LABELS = ("node", "gpu_uuid", "gpu_index", "product", "mode")
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class SliceCollector(Collector):
    """``gpu_slice_slices_{total,allocated,healthy}`` per GPU, from the inventory at scrape time.

    ``unhealthy`` gives the owners (GPU or MIG UUIDs) whose ids are Unhealthy, as ``Backend.unhealthy``.
    """

    def __init__(self, inventory: Callable[[], NodeInventory],
                 unhealthy: Callable[[], Mapping[str, str]] = dict) -> None:
        self._inventory = inventory
        self._unhealthy = unhealthy

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily("gpu_slice_slices_total", "Slices this GPU advertises.", labels=SLICE_LABELS),
            GaugeMetricFamily("gpu_slice_slices_allocated", "Slices of this GPU held by pods or reservations.",
                              labels=SLICE_LABELS),
            GaugeMetricFamily("gpu_slice_slices_healthy", "Slices of this GPU advertised Healthy.",
                              labels=SLICE_LABELS),
        )

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        total, allocated, healthy = self._families()
        inv = self._inventory()
        bad = self._unhealthy()
        for gpu in inv.gpus:
            labels = [inv.node, gpu.uuid, str(gpu.index), gpu.product, gpu.mode]
            ids = gpu.slice_ids()
            total.add_metric(labels, len(ids))
            allocated.add_metric(labels, sum(1 for sid in ids if sid in inv.used))
            if not gpu.healthy or gpu.uuid in bad:
                good = 0
            elif gpu.mode == "mig":
                good = sum(i.compute_slices for i in gpu.instances if i.uuid not in bad)
            else:
                good = len(ids)
            healthy.add_metric(labels, good)
        return (total, allocated, healthy)


class PluginMetrics:
    """Every device-plugin metric, registered on one registry.

    The server code calls ``time_rpc``/``observe_rpc``, ``registration``, ``allocation_mismatch`` and
    ``set_mps_up``; the app calls ``watch_inventory`` once it has a backend and an inventory.
    """

    def __init__(self, registry: CollectorRegistry, *, inventory: Callable[[], NodeInventory] | None = None,
                 unhealthy: Callable[[], Mapping[str, str]] = dict) -> None:
        self.registry = registry
        self.rpc_duration = Histogram(
            "gpu_slice_plugin_rpc_duration_seconds", "Device plugin gRPC handling time, by method.",
            ["method"], registry=registry, buckets=RPC_BUCKETS)
        self.registrations = Counter(
            "gpu_slice_plugin_registrations", "Registrations with kubelet, by result (ok or error).",
            ["result"], registry=registry)
        self.allocation_mismatches = Counter(
            "gpu_slice_plugin_allocation_mismatches",
            "Allocate calls or PodResources stamps whose ids did not match an assignment, by kind.",
            ["kind"], registry=registry)
        self.mps_daemon_up = Gauge(
            "gpu_slice_mps_daemon_up", "1 while this GPU's MPS control daemon answers.", ["gpu_uuid"],
            registry=registry)
        self.mps_daemon_takeovers = Gauge(
            "gpu_slice_mps_daemon_takeovers",
            "MPS control daemons this plugin process took over running (adopted) or started itself (started: "
            "only with --mps-daemons plugin), per GPU.", ["gpu_uuid", "how"], registry=registry)
        self.coexistence_conflicts = Gauge(
            "gpu_slice_plugin_coexistence_conflicts",
            "1 while another resource advertises this GPU and pods hold its slices (kept advertised).",
            ["gpu_uuid", "resource"], registry=registry)
        self._slices: SliceCollector | None = None
        if inventory is not None:
            self.watch_inventory(inventory, unhealthy)

    def watch_inventory(self, inventory: Callable[[], NodeInventory],
                        unhealthy: Callable[[], Mapping[str, str]] = dict) -> None:
        """Register the slice collector (once)."""
        if self._slices is None:
            self._slices = SliceCollector(inventory, unhealthy)
            self.registry.register(self._slices)

    def observe_rpc(self, method: str, seconds: float) -> None:
        self.rpc_duration.labels(method=method).observe(seconds)

    @contextmanager
    def time_rpc(self, method: str) -> Iterator[None]:
        """``with metrics.time_rpc("Allocate"): ...`` (records even when the body raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe_rpc(method, time.perf_counter() - start)

    def registration(self, ok: bool) -> None:
        self.registrations.labels(result="ok" if ok else "error").inc()

    def allocation_mismatch(self, kind: str) -> None:
        self.allocation_mismatches.labels(kind=kind).inc()

    def set_mps_up(self, gpu_uuid: str, up: bool) -> None:
        self.mps_daemon_up.labels(gpu_uuid=gpu_uuid).set(1 if up else 0)

    def forget_mps(self, gpu_uuid: str) -> None:
        """Drop the series of a GPU that left ``mps`` mode."""
        with suppress(KeyError):
            self.mps_daemon_up.remove(gpu_uuid)
