"""The extender's Prometheus metrics, on a registry of its own (no global state; tests make one each).

Label values are bounded, because a label that takes free text (a refusal sentence, a node name in
an error) can grow a Prometheus server without limit: verbs, kinds and signal kinds come from fixed
sets, refusal reasons and policy names must be short codes (``[a-z][a-z0-9_]*``, at most 40 chars)
and only the first ``max_reasons``/``max_policies`` distinct ones get their own series; anything
else is counted under ``other``.

Per-GPU slice gauges are the one large family: 5,000 nodes x 8 GPUs is 80,000 series. They are
served from the last ``set_slices`` rows at scrape time (one immutable tuple swapped atomically, so a
scrape never sees half an update), and ``per_gpu_slices=False`` keeps only the cluster totals.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from extender.informer import ERROR_CODES, KINDS, RELIST_REASONS
from extender.preemptor import OUTCOMES as PREEMPTION_OUTCOMES
from extender.signals import QUERY_ERROR_REASONS, SIGNAL_KINDS, SignalKind
from gpuslice.scheduler import BIND_REFUSALS

PREFIX = "gpu_slice_extender"
VERBS = ("filter", "prioritize", "bind", "preempt")
OUTCOMES = ("ok", "error", "bad_request", "refused")
#: Why a bind was refused: the extender's own checks, then the core's (``BindPlan.code``).
BIND_REFUSAL_CODES = ("not_ready", "lease_unreadable", "pod_gone", "pod_replaced", "bound_elsewhere", "api_error",
                      *BIND_REFUSALS)
EVENT_OUTCOMES = ("written", "failed", "dropped")
SIGNALS: tuple[str, ...] = SIGNAL_KINDS
#: Extender calls take a few ms (the bar is p99 < 25 ms at 1,000 nodes, < 100 ms at 5,000); kube-scheduler
#: gives up at 5 s.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
OTHER = "other"
_CODE = re.compile(r"[a-z][a-z0-9_]{0,39}")


class BoundedLabel:
    """Maps values onto at most ``limit`` distinct short codes (the first seen); the rest is ``other``."""

    def __init__(self, limit: int, known: Iterable[str] = ()) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        for value in known:
            self(value)

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if not isinstance(value, str) or not _CODE.fullmatch(value):
            return OTHER
        with self._lock:
            if len(self._seen) >= self._limit:
                return OTHER
            self._seen.add(value)
        return value


def _fixed(value: str, allowed: tuple[str, ...]) -> str:
    return value if value in allowed else OTHER


@dataclass(frozen=True, slots=True)
class SliceRow:
    """Slices of one GPU for the gauges: total advertised and used (held by pods or reservations)."""

    node: str
    gpu: str
    total: int
    used: int


class _SliceCollector(Collector):
    def __init__(self, metrics: ExtenderMetrics) -> None:
        self._metrics = metrics

    def _families(self) -> list[GaugeMetricFamily]:
        fams = [GaugeMetricFamily(f"{PREFIX}_cluster_slices", "Slices advertised in the cluster."),
                GaugeMetricFamily(f"{PREFIX}_cluster_slices_used", "Slices held by pods or reservations.")]
        if self._metrics.per_gpu_slices:
            fams += [GaugeMetricFamily(f"{PREFIX}_slices", "Slices a GPU advertises.", labels=("node", "gpu")),
                     GaugeMetricFamily(f"{PREFIX}_slices_used", "Slices of a GPU held by pods or reservations.",
                                       labels=("node", "gpu"))]
        return fams

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        rows = self._metrics._slices
        fams = self._families()
        fams[0].add_metric([], sum(r.total for r in rows))
        fams[1].add_metric([], sum(r.used for r in rows))
        if self._metrics.per_gpu_slices:
            for r in rows:
                fams[2].add_metric([r.node, r.gpu], r.total)
                fams[3].add_metric([r.node, r.gpu], r.used)
        return fams


class ExtenderMetrics:
    """Every extender metric on ``registry``; the methods are the only way the app touches them."""

    def __init__(self, registry: CollectorRegistry | None = None, *, per_gpu_slices: bool = True,
                 max_reasons: int = 32, max_policies: int = 16) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.per_gpu_slices = per_gpu_slices
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Extender HTTP calls, by verb and outcome.",
                                ["verb", "outcome"], registry=r)
        self.latency = Histogram(f"{PREFIX}_request_duration_seconds", "Extender call handling time, by verb.",
                                 ["verb"], buckets=LATENCY_BUCKETS, registry=r)
        self.decisions = Counter(f"{PREFIX}_decisions", "Placement decisions, by scoring policy and result.",
                                 ["policy", "result"], registry=r)
        self.filter_rejections = Counter(f"{PREFIX}_filter_rejections", "Nodes refused at filter, by reason code.",
                                         ["reason"], registry=r)
        self.signal_age = Gauge(f"{PREFIX}_signal_age_seconds",
                                "Age of the newest sample of a signal (absent when there is none).",
                                ["signal"], registry=r)
        self.prometheus_query_errors = Counter(f"{PREFIX}_prometheus_query_errors",
                                               "Failed Prometheus queries, by signal and reason.",
                                               ["signal", "reason"], registry=r)
        self.reservations = Gauge(f"{PREFIX}_reservations", "Placements reserved at filter and not yet bound.",
                                  registry=r)
        self.relists = Counter(f"{PREFIX}_relists", "Complete lists of a kind, by reason (initial, gone, "
                               "requested).", ["kind", "reason"], registry=r)
        self.watch_errors = Counter(f"{PREFIX}_watch_errors", "List/watch failures, by kind and error code.",
                                    ["kind", "code"], registry=r)
        self.lease_errors = Counter(f"{PREFIX}_lease_read_errors", "Failed reads of the scheduler Lease.",
                                    registry=r)
        self.bind_refusals = Counter(f"{PREFIX}_bind_refusals", "Binds refused, by reason code.", ["reason"],
                                     registry=r)
        self.bind_events = Counter(f"{PREFIX}_bind_events", "SliceAssigned events, by outcome (written, failed, "
                                   "dropped).", ["outcome"], registry=r)
        self.own_preemptions = Counter(f"{PREFIX}_own_preemptions", "Preemptions the extender planned itself for "
                                       "shape-only shortfalls, by outcome.", ["outcome"], registry=r)
        self.leader = Gauge(f"{PREFIX}_leader", "1 while this replica's scheduler holds the Lease.", registry=r)
        self.ready = Gauge(f"{PREFIX}_ready", "1 while the extender is ready to answer the scheduler.", registry=r)
        self._reason = BoundedLabel(max_reasons)
        self._policy = BoundedLabel(max_policies)
        self._slices: tuple[SliceRow, ...] = ()
        r.register(_SliceCollector(self))

    # ---- requests

    def observe_request(self, verb: str, seconds: float, outcome: str = "ok") -> None:
        verb = _fixed(verb, VERBS)
        self.requests.labels(verb, _fixed(outcome, OUTCOMES)).inc()
        self.latency.labels(verb).observe(seconds)

    @contextmanager
    def time_request(self, verb: str, clock: Callable[[], float] = time.perf_counter) -> Iterator[list[str]]:
        """Time a call; the body may set ``outcome[0]``; an exception counts as ``error``."""
        outcome = ["ok"]
        start = clock()
        try:
            yield outcome
        except BaseException:
            outcome[0] = "error"
            raise
        finally:
            self.observe_request(verb, clock() - start, outcome[0])

    # ---- decisions

    def decision(self, policy: str, result: str = "placed") -> None:
        """One pod decided by ``policy`` (``placed`` or ``unschedulable``)."""
        self.decisions.labels(self._policy(policy), _fixed(result, ("placed", "unschedulable"))).inc()

    def reject(self, reason: str, count: int = 1) -> None:
        """``count`` nodes refused at filter for ``reason`` (a short code, not the operator's sentence)."""
        if count > 0:
            self.filter_rejections.labels(self._reason(reason)).inc(count)

    def rejections(self, reasons: Mapping[str, int] | Iterable[str]) -> None:
        """Many refusals at once: a code -> count mapping, or one code per refused node."""
        if isinstance(reasons, Mapping):
            for reason, count in reasons.items():
                self.reject(reason, count)
            return
        counts: dict[str, int] = {}
        for reason in reasons:
            counts[reason] = counts.get(reason, 0) + 1
        self.rejections(counts)

    def bind_refused(self, code: str) -> None:
        self.bind_refusals.labels(_fixed(code, BIND_REFUSAL_CODES)).inc()

    def own_preemption(self, outcome: str) -> None:
        """Hook for ``ShapePreemptor(on_outcome=...)``."""
        self.own_preemptions.labels(_fixed(outcome, PREEMPTION_OUTCOMES)).inc()

    def bind_event(self, outcome: str) -> None:
        """Hook for ``EventWriter(on_result=...)``."""
        self.bind_events.labels(_fixed(outcome, EVENT_OUTCOMES)).inc()

    # ---- signals

    def set_signal_age(self, signal: str, age_s: float | None) -> None:
        """The newest sample's age; None removes the series (no data is not "infinitely old")."""
        label = _fixed(signal, SIGNALS)
        if age_s is None or math.isnan(age_s):
            with suppress(KeyError):
                self.signal_age.remove(label)
            return
        self.signal_age.labels(label).set(age_s)

    def observe_signals(self, newest_age: Callable[[SignalKind], float | None]) -> None:
        """Every signal's age at once, e.g. ``metrics.observe_signals(snapshot.newest_age)``."""
        for signal in SIGNAL_KINDS:
            self.set_signal_age(signal, newest_age(signal))

    def prometheus_error(self, signal: str, reason: str) -> None:
        """Hook for ``SignalRefresher(on_query_error=...)``."""
        self.prometheus_query_errors.labels(_fixed(signal, SIGNALS), _fixed(reason, QUERY_ERROR_REASONS)).inc()

    # ---- cluster state

    def set_slices(self, rows: Iterable[SliceRow | tuple[str, str, int, int]]) -> None:
        """Replace the per-GPU slice figures (from the cluster view after a change)."""
        self._slices = tuple(r if isinstance(r, SliceRow) else SliceRow(*r) for r in rows)

    def set_reservations(self, count: int) -> None:
        self.reservations.set(count)

    def set_leader(self, leader: bool) -> None:
        self.leader.set(1 if leader else 0)

    def set_ready(self, ready: bool) -> None:
        self.ready.set(1 if ready else 0)

    # ---- hooks for the informer and the fence

    def relisted(self, kind: str, reason: str) -> None:
        """Hook for ``Informer(on_relist_metric=...)``."""
        self.relists.labels(_fixed(kind, KINDS), _fixed(reason, RELIST_REASONS)).inc()

    def watch_error(self, kind: str, code: str) -> None:
        """Hook for ``Informer(on_error_metric=...)``."""
        self.watch_errors.labels(_fixed(kind, KINDS), _fixed(code, ERROR_CODES)).inc()

    def lease_error(self) -> None:
        """Hook for ``Fence(on_error=...)``."""
        self.lease_errors.inc()

    # ---- exposition

    def render(self) -> tuple[bytes, str]:
        """The /metrics body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
