"""Cluster gauges from the operator's view, on the extender's ``/metrics``: stranded slices and Pending
slice pods by reason.

* ``gpu_slice_cluster_stranded_slices{product, mode}``: free, healthy slices that no pod shape of the
  cluster can use (``gpu-slice status``'s STRANDED, counted by the same rule);
* ``gpu_slice_cluster_pending_pods{reason}``: Pending slice pods by why they wait: ``invalid_request``
  (the request cannot be met as written), ``reserved`` (placed at filter, waiting for the bind),
  ``fits`` (kube-scheduler has not placed it yet), ``no_nodes``, or, when every node refuses it, the
  code of the most common node reason (the codes ``gpu_slice_extender_filter_rejections`` uses:
  ``slices_busy``, ``layout``, ``size``, ``gpu_memory``, ``isolation``, ``cpu``, ...);
* ``gpu_slice_cluster_summary_seconds``: how long the last summary took.

They come from :class:`gpuslice.status.Summarizer` over the extender's own view at scrape time, never
per filter call: the stranded test and the reasons are ``build_status``'s, without its per-GPU rows
and suggestions. Like the slice map's build it takes the extender's lock one step at a time (the pod
scan, one shape's fit, the stranded count, one Pending pod), packs pods outside it, and only those
whose projection changed. One summary serves every scrape for ``MIN_INTERVAL_S``, and for ``DUTY``
times as long as it took when that is longer. Every replica serves them
from its own view: aggregate with ``max``, not ``sum``. Nothing is served until the view has synced.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extender.service import Extender, reason_code
from gpuslice.status import Summarizer, Summary

MIN_INTERVAL_S = 10.0
DUTY = 10.0
CAUSE_LABELS = {"invalid": "invalid_request", "reserved": "reserved", "fits": "fits", "no-nodes": "no_nodes"}


def reason_label(cause: str, top_reason: str) -> str:
    """The bounded label of one Pending pod's reason."""
    return CAUSE_LABELS.get(cause) or reason_code(top_reason)


class StatusGauges(Collector):
    """The gauges above, for ``registry.register``."""

    def __init__(self, ext: Extender, *, clock: Callable[[], float] = time.monotonic,
                 min_interval_s: float = MIN_INTERVAL_S) -> None:
        self._ext = ext
        self._clock = clock
        self.min_interval_s = min_interval_s
        self._summarizer = Summarizer()
        self._lock = threading.Lock()
        self._kept: tuple[float, float, Summary, float] | None = None  # built at, fresh for, summary, took
        self.builds = 0

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (GaugeMetricFamily("gpu_slice_cluster_stranded_slices",
                                  "Free healthy slices no pod shape of the cluster can use, by GPU product and mode.",
                                  labels=("product", "mode")),
                GaugeMetricFamily("gpu_slice_cluster_pending_pods", "Pending slice pods by why they wait.",
                                  labels=("reason",)),
                GaugeMetricFamily("gpu_slice_cluster_summary_seconds",
                                  "Seconds the last stranded/Pending summary took (it holds the extender's lock "
                                  "one step at a time)."))

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def summary(self) -> tuple[Summary, float] | None:
        """The kept summary while fresh, else a new one (None before the view has synced)."""
        ext = self._ext
        if not ext.ready:
            return None
        with self._lock:
            kept = self._kept
            if kept is not None and self._clock() - kept[0] < kept[1]:
                return kept[2], kept[3]
            started = self._clock()
            got = self._summarizer.summary(ext.view, ext.sched, ext.clock(), hold=lambda: ext.lock)
            took = self._clock() - started
            self._kept = (started, max(self.min_interval_s, DUTY * took), got, took)
            self.builds += 1
            return got, took

    def collect(self) -> Iterable[Metric]:
        stranded, pending, took = self._families()
        found = self.summary()
        if found is None:
            return (stranded, pending, took)
        summary, seconds = found
        for (product, mode), n in sorted(summary.stranded.items()):
            stranded.add_metric([product, mode], n)
        for label, n in sorted(Counter(reason_label(c, r) for c, r in summary.pending).items()):
            pending.add_metric([label], n)
        took.add_metric([], seconds)
        return (stranded, pending, took)
