"""The HPA example and the prometheus-adapter rules it needs: the rules discover and read only series
the device plugin exports, the HPA asks only for metrics the rules serve, and the adapter's query for
a pod metric is built as prometheus-adapter builds it (the PromQL runs against a real Prometheus in
``tests/deviceplugin/test_pod_series_prometheus.py``)."""

from __future__ import annotations

import re

import yaml
from prometheus_client import CollectorRegistry

from deviceplugin.pod_series import PodSeriesCollector
from gpuslice.model import NodeInventory
from gpuslice.requests import parse_request
from tests.manifests.adapter import HPA_FILE, metric_name, render, rules, series_of

PROMQL_WORDS = {"sum", "max", "min", "avg", "by", "avg_over_time", "max_over_time", "rate", "on", "ignoring"}


def pod_series() -> set[str]:
    registry = CollectorRegistry()
    registry.register(PodSeriesCollector("n", lambda: NodeInventory("n", ()), dict))
    return {fam.name for fam in registry.collect()}


def test_rules_read_only_series_the_plugin_exports() -> None:
    exported = pod_series()
    assert {"gpu_slice_pod_gpu_activity_ratio", "gpu_slice_pod_memory_used_bytes"} <= exported
    for rule in rules():
        assert series_of(rule) in exported, rule["seriesQuery"]
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        query = re.sub(r"<<\.\w+>>", "", rule["metricsQuery"])
        query = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\bby\s*\([^)]*\)", "", query)
        names = {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", query) if w not in PROMQL_WORDS}
        assert names <= exported, names - exported


def test_the_hpa_asks_for_metrics_the_rules_serve_of_pods_that_are_measured() -> None:
    served = {metric_name(r) for r in rules()}
    assert served == {"gpu_slice_pod_gpu_activity", "gpu_slice_pod_gpu_memory_used",
                      "gpu_slice_pod_gpu_memory_utilization"}
    docs = [d for d in yaml.safe_load_all(HPA_FILE.read_text()) if d]
    (hpa,) = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deploy["metadata"]["name"]}
    asked = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert asked and asked <= served
    # activity is measured per MIG instance only: the target's pods must ask MIG isolation
    tpl = deploy["spec"]["template"]
    req = parse_request({"metadata": tpl["metadata"], "spec": tpl["spec"]})
    assert req is not None and req.isolation == "mig"
    assert "custom metrics API" in HPA_FILE.read_text()


def test_queries_are_built_as_prometheus_adapter_builds_them() -> None:
    by_name = {metric_name(r): r for r in rules()}
    assert render(by_name["gpu_slice_pod_gpu_activity"], "default", ["a", "b"]) == (
        'max by (pod) (avg_over_time(gpu_slice_pod_gpu_activity_ratio{namespace="default",pod=~"a|b"}[2m]))')
    assert render(by_name["gpu_slice_pod_gpu_memory_used"], "llm", ["x"]) == (
        'sum by (pod) (gpu_slice_pod_memory_used_bytes{namespace="llm",pod="x"})')
