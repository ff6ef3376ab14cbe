"""Utilization and price signals from Prometheus, refreshed in the background, read as snapshots.

Series read (names and labels configurable, :class:`SignalSettings`; the defaults cover
dcgm-exporter up to 4.8 and the 4.9 renames, reference 3.1-3.3, and OpenCost, reference 4). Only
what scoring uses is asked for:

=================  ==============================================================  ==============
kind               default metric names                                            unit kept
=================  ==============================================================  ==============
``gr_engine``      DCGM_FI_PROF_GR_ENGINE_ACTIVE, DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO  ratio 0..1
``dram``           DCGM_FI_PROF_DRAM_ACTIVE, DCGM_FI_PROF_DRAM_UTIL_RATIO            ratio 0..1
``gpu_util``       DCGM_FI_DEV_GPU_UTIL (percent), DCGM_FI_DEV_GPU_UTIL_RATIO        ratio 0..1
``node_total_cost`` node_total_hourly_cost                                           $/hour
=================  ==============================================================  ==============

Units follow the name (reference 3.3 advises it): ``…_RATIO``/``…_ACTIVE`` are ratios,
``DCGM_FI_DEV_GPU_UTIL`` is a percentage.

A series is mapped to (GPU uuid, GPU-instance id or None) by its ``UUID`` (``uuid`` with
``--use-old-namespace``) and ``GPU_I_ID`` labels: dcgm-exporter labels a MIG instance by its parent
GPU's uuid and its GPU-instance id, which the node inventory carries per instance
(``gpuInstanceId``), so the caller asks for an instance by that id. The node label (``node``,
``kubernetes_node``, ``hostname``, or ``Hostname`` before exporter 4.9) is recorded but GPUs are
found by uuid: without the Helm chart's NODE_NAME the exporter reports the OS hostname, which need
not be the node's name. When two series carry one uuid (two scrape jobs, a renamed node), the one
labelled with the asked node wins, else the newest.

Each metric name is one instant query that answers only the latest sample of each series, with the
time it was taken: ``label_replace(timestamp(NAME), "gpu_slice_sample", "time", "", "") or
last_over_time(NAME[<max_age>s])``. ``timestamp()`` of a plain selector is the sample's own time,
not the evaluation time, so a dead exporter's values age out instead of looking fresh for
Prometheus' 5-minute lookback; ``last_over_time`` over the staleness window leaves out what is older.
One sample per series comes back (a range vector would bring every sample of the window: tens of MB
at 5,000 nodes). A sample older than ``max_age_s`` is absent.

**Activity** of a GPU or MIG instance = max(graphics-engine activity, DRAM bandwidth utilization)
of its fresh samples (LLM decoding is bandwidth-bound); for a whole GPU without profiling metrics,
``DCGM_FI_DEV_GPU_UTIL``/100 (not reported per MIG instance).

**Node price**, first known wins: OpenCost's ``node_total_hourly_cost`` (fresh), then the fallbacks
of :func:`gpuslice.nodes.node_price`, the same the core uses: the node's ``example.com/hourly-cost``
annotation, the config's price table by instance type (``node.kubernetes.io/instance-type``) and
capacity type (``karpenter.sh/capacity-type`` and the EKS, GKE, AKS equivalents), the config's
$/GPU-hour by product; a price of 0 means unknown there, and None here. Nodes are fed in from the
informer (``observe_node``/``forget_node``/``replace_nodes``). The core also takes the live figure
alone (``live_node_cost``) and applies the same fallbacks itself.

Failure is never the caller's problem: Prometheus unreachable, slow, or answering nonsense is a
rate-limited warning, a counted error (``on_query_error(kind, reason)``) and the previous data kept
until it ages out; scoring then packs on its own.
"""

from __future__ import annotations

import logging
import math
import re
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import httpx

from extender.logs import RateLimitedLog
from gpuslice.config import Config
from gpuslice.errors import GpuSliceError
from gpuslice.kubelist import node_inventory
from gpuslice.nodes import node_price

log = logging.getLogger(__name__)

Obj = dict[str, Any]
SignalKind = Literal["gr_engine", "dram", "gpu_util", "node_total_cost"]
GPU_KINDS: tuple[SignalKind, ...] = ("gr_engine", "dram", "gpu_util")
NODE_KINDS: tuple[SignalKind, ...] = ("node_total_cost",)
#: The label that marks the sample-time series of an answer (see the module docstring).
SAMPLE_LABEL = "gpu_slice_sample"
SIGNAL_KINDS: tuple[SignalKind, ...] = GPU_KINDS + NODE_KINDS
#: Reasons passed to ``on_query_error``: a short, bounded set for a metric label.
QUERY_ERROR_REASONS = ("unreachable", "timeout", "http", "prometheus_error", "bad_response")

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def unit_scale(kind: SignalKind, name: str) -> float:
    """Factor from a series' unit to the unit kept for ``kind`` (ratio, $/hour), from its name."""
    if kind in ("gr_engine", "dram", "gpu_util"):
        return 0.01 if name == "DCGM_FI_DEV_GPU_UTIL" or name.endswith(("_PERCENT", "_PCT")) else 1.0
    return 1.0


@dataclass(frozen=True)
class SignalSettings:
    """Where Prometheus is, what to ask it, and how old a sample may be. ``url=None`` disables it."""

    url: str | None = None
    interval_s: float = 15.0
    timeout_s: float = 2.0
    max_age_s: float = 120.0
    gr_engine: tuple[str, ...] = ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO")
    dram: tuple[str, ...] = ("DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_DRAM_UTIL_RATIO")
    gpu_util: tuple[str, ...] = ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_UTIL_RATIO")
    node_total_cost: tuple[str, ...] = ("node_total_hourly_cost",)
    #: GPU series: which label names the node, first present wins.
    node_labels: tuple[str, ...] = ("node", "kubernetes_node", "hostname", "Hostname")
    uuid_labels: tuple[str, ...] = ("UUID", "uuid")
    gpu_instance_labels: tuple[str, ...] = ("GPU_I_ID",)
    #: OpenCost series: which label names the node (``node``; ``instance`` is the node name too).
    cost_node_labels: tuple[str, ...] = ("node", "instance")
    #: Extra label matchers added to every query, e.g. ``job="dcgm-exporter"``.
    matchers: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    #: CA bundle for an https Prometheus (the system's by default).
    ca_file: str | None = None

    def __post_init__(self) -> None:
        for kind in SIGNAL_KINDS:
            for name in self.names(kind):
                if not _METRIC_NAME.fullmatch(name):
                    raise ValueError(f"{kind}: {name!r} is not a Prometheus metric name")
        for labels in (self.node_labels, self.uuid_labels, self.gpu_instance_labels, self.cost_node_labels):
            for label in labels:
                if not _LABEL_NAME.fullmatch(label):
                    raise ValueError(f"{label!r} is not a Prometheus label name")
        if any(c in self.matchers for c in "{}[]"):
            raise ValueError("matchers are label matchers only, like job=\"dcgm\" (no braces)")
        if not (self.interval_s > 0 and self.timeout_s > 0 and self.max_age_s > 0):
            raise ValueError("interval_s, timeout_s and max_age_s must be > 0")

    def names(self, kind: SignalKind) -> tuple[str, ...]:
        names: tuple[str, ...] = getattr(self, kind)
        return names

    def query(self, name: str) -> str:
        """The PromQL for one metric name: each series' latest sample within the staleness window, and
        that sample's own time (an instant vector of both; see the module docstring)."""
        selector = f"{name}{{{self.matchers}}}" if self.matchers.strip() else name
        return (f'label_replace(timestamp({selector}), "{SAMPLE_LABEL}", "time", "", "") '
                f"or last_over_time({selector}[{math.ceil(self.max_age_s)}s])")


@dataclass(frozen=True, slots=True)
class Sample:
    """One series' latest value (in the kind's unit), its sample time (Unix s) and its node label."""

    value: float
    at: float
    node: str | None = None


GpuKey = tuple[str, int | None]  # (GPU uuid, GPU-instance id or None for the whole GPU)


def _pick(samples: tuple[Sample, ...], node: str | None) -> Sample:
    if len(samples) > 1 and node is not None:
        for s in samples:
            if s.node == node:
                return s
    return max(samples, key=lambda s: s.at)


@dataclass(frozen=True)
class SignalSnapshot:
    """An immutable view of the signals at one refresh; ages are measured when asked.

    ``gpu`` maps kind -> (uuid, gi id) -> samples; ``nodes`` maps kind -> node -> sample;
    ``fallback_cost`` maps node -> $/hour from annotations and the price table.
    """

    gpu: Mapping[SignalKind, Mapping[GpuKey, tuple[Sample, ...]]] = field(default_factory=dict)
    nodes: Mapping[SignalKind, Mapping[str, Sample]] = field(default_factory=dict)
    fallback_cost: Mapping[str, float] = field(default_factory=dict)
    max_age_s: float = 120.0
    clock: Callable[[], float] = time.time

    def _fresh(self, sample: Sample | None, now: float | None) -> tuple[float, float] | None:
        if sample is None:
            return None
        age = max(0.0, (self.clock() if now is None else now) - sample.at)
        return (sample.value, age) if age <= self.max_age_s else None

    def sample(self, kind: SignalKind, node: str | None, gpu_uuid: str, gi: int | None = None, *,
               now: float | None = None) -> tuple[float, float] | None:
        """(value, age in s) of one GPU's (``gi`` None) or MIG instance's signal (``gi``: its
        GPU-instance id, the inventory's ``gpuInstanceId``), None when absent or stale."""
        samples = self.gpu.get(kind, {}).get((gpu_uuid, gi))
        return self._fresh(_pick(samples, node), now) if samples else None

    def activity(self, node: str | None, gpu_uuid: str, gi: int | None = None, *,
                 now: float | None = None) -> tuple[float, float] | None:
        """(activity 0..1, age in s) of a GPU (``gi`` None) or MIG instance; None = no signal.

        The larger of graphics-engine activity and DRAM bandwidth; GPU_UTIL only for whole GPUs
        without profiling metrics (dcgm-exporter does not report it per MIG instance). The age is
        that of the oldest sample used.
        """
        now = self.clock() if now is None else now
        parts = [p for p in (self.sample("gr_engine", node, gpu_uuid, gi, now=now),
                             self.sample("dram", node, gpu_uuid, gi, now=now)) if p is not None]
        if not parts and gi is None:
            util = self.sample("gpu_util", node, gpu_uuid, None, now=now)
            parts = [util] if util is not None else []
        if not parts:
            return None
        value = max(v for v, _ in parts)
        return (min(1.0, max(0.0, value)), max(a for _, a in parts))

    def live_node_cost(self, node: str, *, now: float | None = None) -> float | None:
        """OpenCost's ``node_total_hourly_cost`` when fresh (the core's "live figure")."""
        fresh = self._fresh(self.nodes.get("node_total_cost", {}).get(node), now)
        return None if fresh is None else fresh[0]

    def node_cost(self, node: str, *, now: float | None = None) -> float | None:
        """$/hour of a node: live OpenCost figure, else the fallbacks; None when nothing is known."""
        live = self.live_node_cost(node, now=now)
        return live if live is not None else self.fallback_cost.get(node)

    def cost_source(self, node: str, *, now: float | None = None) -> str | None:
        """Where :meth:`node_cost` came from: ``opencost``, ``fallback`` or None."""
        if self.live_node_cost(node, now=now) is not None:
            return "opencost"
        return "fallback" if node in self.fallback_cost else None

    def newest_age(self, kind: SignalKind, *, now: float | None = None) -> float | None:
        """Age of the newest sample of ``kind`` (for the signal-age gauge), None when there is none."""
        now = self.clock() if now is None else now
        table: Iterable[Sample]
        if kind in NODE_KINDS:
            table = self.nodes.get(kind, {}).values()
        else:
            table = (s for samples in self.gpu.get(kind, {}).values() for s in samples)
        newest = max((s.at for s in table), default=None)
        return None if newest is None else max(0.0, now - newest)


class _QueryFailed(Exception):
    def __init__(self, reason: str, detail: str, *, abort_round: bool = False) -> None:
        super().__init__(detail)
        self.reason = reason
        self.abort_round = abort_round


def _float(text: object) -> float | None:
    if not isinstance(text, str | int | float) or isinstance(text, bool):
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _samples(series: list[Obj]) -> list[tuple[Mapping[str, Any], float, float]]:
    """(labels, sample time, value) per series of an answer to :meth:`SignalSettings.query`: the
    value series joined with their sample-time twins (``SAMPLE_LABEL``); a series without its twin,
    or with a value that is no finite number, is left out."""
    times: dict[tuple[tuple[str, Any], ...], float] = {}
    values: list[tuple[tuple[tuple[str, Any], ...], Mapping[str, Any], float]] = []
    for one in series:
        point = one.get("value")
        if not isinstance(point, list) or len(point) != 2:
            continue
        value = _float(point[1])
        if value is None:
            continue
        labels = {k: v for k, v in one["metric"].items() if k != SAMPLE_LABEL}
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "__name__"))
        if one["metric"].get(SAMPLE_LABEL) == "time":
            times[key] = value
        else:
            values.append((key, labels, value))
    return [(labels, times[key], value) for key, labels, value in values if key in times]


def _label(labels: Mapping[str, Any], names: tuple[str, ...]) -> str | None:
    for name in names:
        value = labels.get(name)
        if isinstance(value, str) and value:
            return value
    return None


class SignalRefresher:
    """Queries Prometheus every ``interval_s`` and publishes a fresh :class:`SignalSnapshot`.

    ``config`` gives the price tables for the fallbacks; ``on_query_error(kind, reason)`` feeds the
    metrics (reason in :data:`QUERY_ERROR_REASONS`). Nothing here raises to the caller once
    constructed.
    """

    def __init__(self, settings: SignalSettings, *, config: Config | None = None,
                 client: httpx.Client | None = None, clock: Callable[[], float] = time.time,
                 on_query_error: Callable[[SignalKind, str], None] | None = None,
                 warn_interval_s: float = 300.0) -> None:
        self.settings = settings
        self.config = config
        self._clock = clock
        self._on_query_error = on_query_error
        self._own_client = client is None and settings.url is not None
        self._client = client
        if self._client is None and settings.url is not None:
            # Plain http needs no CA bundle (loading it costs 0.2 s); redirects are not followed,
            # so verify only ever matters for an https URL.
            https = settings.url.lower().startswith("https:")
            verify: ssl.SSLContext | bool = False
            if https:
                verify = ssl.create_default_context(cafile=settings.ca_file) if settings.ca_file else True
            self._client = httpx.Client(base_url=settings.url.rstrip("/"), timeout=settings.timeout_s,
                                        headers=dict(settings.headers), verify=verify)
        self._warn = RateLimitedLog(log, warn_interval_s)
        self._lock = threading.Lock()
        self._gpu: dict[SignalKind, Mapping[GpuKey, tuple[Sample, ...]]] = {}
        self._nodes: dict[SignalKind, Mapping[str, Sample]] = {}
        self._fallback: Mapping[str, float] = MappingProxyType({})
        self._snapshot: SignalSnapshot | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.query_errors = 0
        self.refreshes = 0
        self.last_success: float | None = None

    # ---- nodes, from the informer (prices only)

    def _fallback_for(self, node: Mapping[str, Any]) -> float | None:
        meta = node.get("metadata")
        meta = meta if isinstance(meta, Mapping) else {}
        labels, annotations = meta.get("labels"), meta.get("annotations")
        labels = labels if isinstance(labels, Mapping) else {}
        annotations = annotations if isinstance(annotations, Mapping) else {}
        try:
            inventory = node_inventory(node) if self.config is not None and self.config.prices.gpu_hourly else None
            cost = node_price(labels, annotations, inventory, self.config)
        except GpuSliceError as exc:
            self._warn.warning(f"price-{meta.get('name')}", "node %s: no fallback price (%s)", meta.get("name"), exc)
            return None
        return cost if cost > 0 else None

    def observe_node(self, node: Mapping[str, Any]) -> None:
        """A node was added or changed: recompute its fallback price (copy-on-write, only on change)."""
        meta = node.get("metadata")
        name = meta.get("name") if isinstance(meta, Mapping) else None
        if not isinstance(name, str) or not name:
            return
        cost = self._fallback_for(node)
        with self._lock:
            if self._fallback.get(name) == cost:
                return
            table = dict(self._fallback)
            if cost is None:
                table.pop(name, None)
            else:
                table[name] = cost
            self._fallback = MappingProxyType(table)
            self._snapshot = None

    def forget_node(self, name: str) -> None:
        with self._lock:
            if name in self._fallback:
                table = dict(self._fallback)
                del table[name]
                self._fallback = MappingProxyType(table)
                self._snapshot = None

    def replace_nodes(self, nodes: Iterable[Mapping[str, Any]]) -> None:
        """A relist: the fallback prices of exactly these nodes."""
        table: dict[str, float] = {}
        for node in nodes:
            meta = node.get("metadata")
            name = meta.get("name") if isinstance(meta, Mapping) else None
            if isinstance(name, str) and name:
                cost = self._fallback_for(node)
                if cost is not None:
                    table[name] = cost
        with self._lock:
            self._fallback = MappingProxyType(table)
            self._snapshot = None

    # ---- Prometheus

    def _query(self, name: str) -> list[Obj]:
        assert self._client is not None
        try:
            resp = self._client.get("/api/v1/query", params={"query": self.settings.query(name)})
        except httpx.TimeoutException as exc:
            raise _QueryFailed("timeout", f"timed out after {self.settings.timeout_s:g}s ({type(exc).__name__})",
                               abort_round=True) from None
        except httpx.TransportError as exc:
            raise _QueryFailed("unreachable", f"{type(exc).__name__}: {exc}", abort_round=True) from None
        try:
            body = resp.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and body.get("status") == "error":
            raise _QueryFailed("prometheus_error", f"HTTP {resp.status_code} {body.get('errorType')}: "
                               f"{str(body.get('error'))[:200]}")
        if resp.status_code != 200:
            raise _QueryFailed("http", f"HTTP {resp.status_code}", abort_round=resp.status_code >= 500)
        data = body.get("data") if isinstance(body, dict) and body.get("status") == "success" else None
        if not isinstance(data, dict) or data.get("resultType") != "vector":
            raise _QueryFailed("bad_response", "not a Prometheus success answer with an instant vector")
        result = data.get("result")
        if not isinstance(result, list):
            raise _QueryFailed("bad_response", "the answer's data.result is not a list")
        return [s for s in result if isinstance(s, dict) and isinstance(s.get("metric"), dict)]

    def _gpu_table(self, kind: SignalKind, name: str, series: list[Obj],
                   table: dict[GpuKey, tuple[Sample, ...]]) -> None:
        s = self.settings
        scale = unit_scale(kind, name)
        for labels, at, value in _samples(series):
            uuid = _label(labels, s.uuid_labels)
            if uuid is None:
                continue
            gi_text = _label(labels, s.gpu_instance_labels)
            gi: int | None = None
            if gi_text is not None:
                if not gi_text.isdigit() or len(gi_text) > 6:
                    continue
                gi = int(gi_text)
            sample = Sample(value * scale, at, _label(labels, s.node_labels))
            key = (uuid, gi)
            existing = table.get(key, ())
            prior = next((o for o in existing if o.node == sample.node), None)
            if prior is not None and prior.at >= sample.at:
                continue  # two series for one device and node (e.g. old and new metric name): newest
            table[key] = (*(o for o in existing if o.node != sample.node), sample)

    def _node_table(self, series: list[Obj], table: dict[str, Sample]) -> None:
        for labels, at, value in _samples(series):
            node = _label(labels, self.settings.cost_node_labels)
            if node is None or value < 0:
                continue
            if node not in table or table[node].at < at:
                table[node] = Sample(value, at, node)

    def refresh(self) -> bool:
        """One round of queries (one per metric name); True when every query answered. Never raises."""
        if self._client is None:
            return False
        gpu: dict[SignalKind, Mapping[GpuKey, tuple[Sample, ...]]] = {}
        nodes: dict[SignalKind, Mapping[str, Sample]] = {}
        ok = True
        for kind in SIGNAL_KINDS:
            gpu_table: dict[GpuKey, tuple[Sample, ...]] = {}
            node_table: dict[str, Sample] = {}
            answered = True
            aborted = False
            for name in self.settings.names(kind):
                try:
                    series = self._query(name)
                    if kind in NODE_KINDS:
                        self._node_table(series, node_table)
                    else:
                        self._gpu_table(kind, name, series, gpu_table)
                except _QueryFailed as exc:
                    answered = False
                    self._failed(kind, exc)
                    aborted = exc.abort_round
                    break
                except Exception as exc:  # anything unexpected in a response must not reach the caller
                    answered = False
                    self._failed(kind, _QueryFailed("bad_response", f"{type(exc).__name__}: {exc}"))
                    break
            ok = ok and answered
            if answered:  # a kind that failed keeps its old samples, which age out
                if kind in NODE_KINDS:
                    nodes[kind] = node_table
                else:
                    gpu[kind] = gpu_table
            if aborted:
                break
        with self._lock:
            self._gpu.update(gpu)
            self._nodes.update(nodes)
            self._snapshot = None
            self.refreshes += 1
            if ok:
                self.last_success = self._clock()
        if ok:
            self._warn.reset("prometheus")
        return ok

    def _failed(self, kind: SignalKind, exc: _QueryFailed) -> None:
        with self._lock:
            self.query_errors += 1
        if self._on_query_error is not None:
            self._on_query_error(kind, exc.reason)
        self._warn.warning("prometheus", "Prometheus query for %s failed (%s: %s); scoring without it until it "
                           "answers", kind, exc.reason, exc)

    # ---- snapshots

    def snapshot(self) -> SignalSnapshot:
        """The current signals; the same object until a refresh or a node price changes."""
        with self._lock:
            if self._snapshot is None:
                self._snapshot = SignalSnapshot(
                    gpu=MappingProxyType(dict(self._gpu)),
                    nodes=MappingProxyType(dict(self._nodes)), fallback_cost=self._fallback,
                    max_age_s=self.settings.max_age_s, clock=self._clock)
            return self._snapshot

    # ---- background

    def start(self) -> None:
        """Refresh every ``interval_s`` on a daemon thread, the first at once."""
        if self._thread is not None or self._client is None:
            return

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.refresh()
                except Exception:  # refresh does not raise; keep the thread alive if it ever does
                    log.exception("signal refresh failed")
                self._stop.wait(self.settings.interval_s)

        self._thread = threading.Thread(target=loop, name="signals", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop refreshing; an in-flight query ends within ``timeout_s``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._own_client and self._client is not None:
            self._client.close()
