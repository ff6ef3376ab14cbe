"""The extender's metrics: one registry per instance, bounded labels, hooks that fit their callers."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from extender import informer, signals
from extender.metrics import LATENCY_BUCKETS, PREFIX, ExtenderMetrics, SliceRow


@pytest.fixture
def m() -> ExtenderMetrics:
    return ExtenderMetrics()


def value(m: ExtenderMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(f"{PREFIX}_{name}", labels)


def test_each_instance_has_its_own_registry() -> None:
    a, b = ExtenderMetrics(), ExtenderMetrics()
    a.set_ready(True)
    assert a.registry is not b.registry and a.registry is not REGISTRY
    assert value(b, "ready") == 0.0
    assert REGISTRY.get_sample_value(f"{PREFIX}_ready") is None
    shared = CollectorRegistry()
    assert ExtenderMetrics(shared).registry is shared


def test_requests_and_latency_per_verb(m: ExtenderMetrics) -> None:
    m.observe_request("filter", 0.004)
    m.observe_request("filter", 0.030, "error")
    ticks = iter([1.0, 1.002])
    with m.time_request("bind", clock=lambda: next(ticks)) as outcome:
        outcome[0] = "refused"
    with pytest.raises(RuntimeError), m.time_request("preempt"):
        raise RuntimeError("boom")
    m.observe_request("GET /etc/passwd", 0.001)
    assert value(m, "requests_total", verb="filter", outcome="ok") == 1
    assert value(m, "requests_total", verb="filter", outcome="error") == 1
    assert value(m, "requests_total", verb="bind", outcome="refused") == 1
    assert value(m, "requests_total", verb="preempt", outcome="error") == 1
    assert value(m, "requests_total", verb="other", outcome="ok") == 1
    assert value(m, "request_duration_seconds_bucket", verb="filter", le="0.005") == 1
    assert value(m, "request_duration_seconds_bucket", verb="filter", le="0.05") == 2
    assert value(m, "request_duration_seconds_sum", verb="bind") == pytest.approx(0.002)
    assert LATENCY_BUCKETS[0] < 0.001 and 0.025 in LATENCY_BUCKETS and LATENCY_BUCKETS[-1] >= 5.0


def test_decisions_per_policy(m: ExtenderMetrics) -> None:
    m.decision("fragmentation")
    m.decision("fragmentation", "unschedulable")
    m.decision("cost", "maybe")
    assert value(m, "decisions_total", policy="fragmentation", result="placed") == 1
    assert value(m, "decisions_total", policy="fragmentation", result="unschedulable") == 1
    assert value(m, "decisions_total", policy="cost", result="other") == 1


def test_rejection_reasons_are_bounded_codes() -> None:
    m = ExtenderMetrics(max_reasons=3)
    m.rejections(["no_fit", "no_fit", "cordoned"])
    m.rejections({"memory": 2, "isolation": 5})
    m.reject("node gpu-1 has only 2 free slices on GPU-abc")
    m.reject("no_fit", 0)
    assert value(m, "filter_rejections_total", reason="no_fit") == 2
    assert value(m, "filter_rejections_total", reason="cordoned") == 1
    assert value(m, "filter_rejections_total", reason="memory") == 2
    assert value(m, "filter_rejections_total", reason="isolation") is None  # over the limit of 3 codes
    assert value(m, "filter_rejections_total", reason="other") == 6  # 5 + the free-text sentence


def test_signal_ages_from_a_snapshot(m: ExtenderMetrics) -> None:
    ages = {"gr_engine": 12.5, "dram": 3.0}
    m.observe_signals(lambda kind: ages.get(kind))
    assert value(m, "signal_age_seconds", signal="gr_engine") == 12.5
    assert value(m, "signal_age_seconds", signal="node_total_cost") is None
    ages.pop("dram")
    m.observe_signals(lambda kind: ages.get(kind))
    assert value(m, "signal_age_seconds", signal="dram") is None  # gone, not infinitely old
    snap = signals.SignalSnapshot()
    m.observe_signals(snap.newest_age)  # the snapshot's own method fits the hook


def test_slices_per_gpu_and_cluster_totals(m: ExtenderMetrics) -> None:
    m.set_slices([SliceRow("n1", "GPU-a", 7, 3), ("n1", "GPU-b", 7, 0), ("n2", "GPU-c", 4, 4)])
    assert value(m, "slices", node="n1", gpu="GPU-a") == 7
    assert value(m, "slices_used", node="n2", gpu="GPU-c") == 4
    assert value(m, "cluster_slices") == 18 and value(m, "cluster_slices_used") == 7
    m.set_slices([("n2", "GPU-c", 4, 1)])  # replaces, so removed GPUs disappear
    assert value(m, "slices", node="n1", gpu="GPU-a") is None
    assert value(m, "cluster_slices_used") == 1


def test_per_gpu_slices_can_be_switched_off() -> None:
    m = ExtenderMetrics(per_gpu_slices=False)
    m.set_slices([("n1", "GPU-a", 7, 3)])
    assert value(m, "slices", node="n1", gpu="GPU-a") is None
    assert value(m, "cluster_slices") == 7


def test_state_gauges(m: ExtenderMetrics) -> None:
    m.set_reservations(4)
    m.set_leader(True)
    m.set_ready(False)
    assert value(m, "reservations") == 4 and value(m, "leader") == 1 and value(m, "ready") == 0


def test_hooks_fit_the_informer_signals_and_fence(m: ExtenderMetrics) -> None:
    for reason in informer.RELIST_REASONS:
        m.relisted("Pod", reason)
    for code in informer.ERROR_CODES:
        m.watch_error("Node", code)
    for reason in signals.QUERY_ERROR_REASONS:
        m.prometheus_error("dram", reason)
    m.lease_error()
    m.relisted("Secret", "because")
    assert value(m, "relists_total", kind="Pod", reason="gone") == 1
    assert value(m, "relists_total", kind="other", reason="other") == 1
    assert value(m, "watch_errors_total", kind="Node", code="http_5xx") == 1
    assert value(m, "prometheus_query_errors_total", signal="dram", reason="timeout") == 1
    assert value(m, "lease_read_errors_total") == 1


def test_render_is_parseable_exposition(m: ExtenderMetrics) -> None:
    m.observe_request("filter", 0.001)
    m.set_slices([("n1", "GPU-a", 7, 3)])
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert {f"{PREFIX}_requests", f"{PREFIX}_request_duration_seconds", f"{PREFIX}_slices",
            f"{PREFIX}_cluster_slices", f"{PREFIX}_ready"} <= names
