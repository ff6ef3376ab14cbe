"""The shipped prometheus-adapter rules (``manifests/examples/autoscaling/prometheus-adapter-rules.yaml``) and the
PromQL prometheus-adapter builds from them for a pod metric, as its ``metricsQuery.Build`` does
(kubernetes-sigs/prometheus-adapter ``pkg/naming/metrics_query.go``): ``<<.Series>>`` is the series
name, ``<<.LabelMatchers>>`` the namespace matcher and then the resource's (``pod="a"`` for one
name, ``pod=~"a|b"`` for several, values Go-quoted), ``<<.GroupBy>>`` the resource's label."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from tests.manifests.built import EXAMPLES

RULES_FILE = EXAMPLES / "autoscaling" / "prometheus-adapter-rules.yaml"
HPA_FILE = EXAMPLES / "autoscaling" / "hpa-vllm.yaml"


def rules() -> list[dict[str, Any]]:
    (cm,) = [d for d in yaml.safe_load_all(RULES_FILE.read_text()) if d]
    assert cm["kind"] == "ConfigMap"
    config = yaml.safe_load(cm["data"]["config.yaml"])
    assert set(config) == {"rules"}
    return list(config["rules"])


def series_of(rule: dict[str, Any]) -> str:
    """The series a rule discovers: the metric name of its seriesQuery."""
    found = re.match(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"])
    assert found, rule["seriesQuery"]
    return found.group(1)


def metric_name(rule: dict[str, Any]) -> str:
    """The custom metric a rule serves (``name.as``, with ``matches`` applied to the series)."""
    series = series_of(rule)
    assert re.search(rule["name"]["matches"], series), (rule["name"], series)
    return str(re.sub(rule["name"]["matches"], rule["name"]["as"], series))


def render(rule: dict[str, Any], namespace: str, pods: list[str]) -> str:
    """The query prometheus-adapter sends for these pods of one namespace."""
    labels = rule["resources"]["overrides"]
    ns_label = next(k for k, v in labels.items() if v == {"resource": "namespace"})
    pod_label = next(k for k, v in labels.items() if v == {"resource": "pod"})
    pod_matcher = f"{pod_label}={json.dumps(pods[0])}" if len(pods) == 1 else \
        f"{pod_label}=~{json.dumps('|'.join(pods))}"
    args = {"Series": series_of(rule), "LabelMatchers": f"{ns_label}={json.dumps(namespace)},{pod_matcher}",
            "GroupBy": pod_label}
    query = str(rule["metricsQuery"])
    for key, value in args.items():
        query = query.replace(f"<<.{key}>>", value)
    assert "<<" not in query, f"a template field this renderer does not know: {query}"
    return query
