"""Every overlay builds with ``kubectl kustomize``, and every object validates, strictly (unknown fields
are errors), against the Kubernetes schemas of the oldest and the newest supported version.

The Prometheus operator's kinds have no Kubernetes schema: they are checked against the subset of the
operator's CRD fields this project uses (``MONITORING_SCHEMAS``), with unknown fields refused too.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from tests.manifests.built import (
    MONITORING_KINDS,
    NEWEST,
    OLDEST,
    OVERLAYS,
    build,
    examples,
)

VERSIONS = (OLDEST, NEWEST)


def _obj(props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


_STR = {"type": "string"}
_LABELS = {"type": "object", "additionalProperties": _STR}
_SELECTOR = _obj({"matchLabels": _LABELS})
_META = {"type": "object"}  # checked by the API server test against the real CRD machinery
_ENDPOINT = _obj({"port": _STR, "path": _STR, "interval": _STR, "honorLabels": {"type": "boolean"}}, ("port",))
_RULE = _obj({"alert": _STR, "record": _STR, "expr": _STR, "for": _STR, "labels": _LABELS,
              "annotations": _LABELS}, ("expr",))

#: monitoring.coreos.com/v1 fields used here, as the operator's CRDs define them.
MONITORING_SCHEMAS: dict[str, dict[str, Any]] = {
    "PodMonitor": _obj({"apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": _STR, "metadata": _META,
                        "spec": _obj({"selector": _SELECTOR, "podMetricsEndpoints": {"type": "array",
                                                                                    "items": _ENDPOINT}},
                                     ("selector",))}, ("spec",)),
    "ServiceMonitor": _obj({"apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": _STR, "metadata": _META,
                            "spec": _obj({"selector": _SELECTOR, "endpoints": {"type": "array",
                                                                               "items": _ENDPOINT}},
                                         ("selector", "endpoints"))}, ("spec",)),
    "PrometheusRule": _obj({"apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": _STR, "metadata": _META,
                            "spec": _obj({"groups": {"type": "array", "items": _obj(
                                {"name": _STR, "interval": _STR, "rules": {"type": "array", "items": _RULE}},
                                ("name", "rules"))}}, ("groups",))}, ("spec",)),
}


def _validate(obj: dict[str, Any], version: str) -> None:
    if obj["kind"] in MONITORING_KINDS:
        jsonschema.validate(obj, MONITORING_SCHEMAS[obj["kind"]])
        return
    try:
        kubernetes_validate.validate(obj, f"{version}.0", strict=True)
    except kubernetes_validate.ValidationError as err:
        raise AssertionError(f"{obj['kind']} {obj['metadata'].get('name')} is invalid for Kubernetes {version}: "
                             f"{err.message} at {'.'.join(map(str, err.path))}") from None


@pytest.mark.parametrize("monitoring", [False, True])
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_built_object_validates(overlay: str, version: str, monitoring: bool) -> None:
    """Each overlay as shipped and with the opt-in monitoring component (README "Install")."""
    objs = build(overlay, monitoring=monitoring)
    assert objs, f"{overlay} built nothing"
    assert bool({o["kind"] for o in objs} & MONITORING_KINDS) == monitoring
    for obj in objs:
        _validate(obj, version)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_example_validates(version: str) -> None:
    docs = examples()
    assert {name for name, _ in docs} >= {"vllm.yaml", "tgi.yaml", "mig-only.yaml", "batch-spot.yaml"}
    for _, obj in docs:
        _validate(obj, version)


def test_validation_is_strict() -> None:
    """An unknown field is an error (so a typo in a manifest cannot pass silently)."""
    bad = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {}, "dataa": {}}
    with pytest.raises(AssertionError, match="dataa"):
        _validate(bad, NEWEST)
    bad_rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": {"name": "x"},
                "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "1", "fro": "5m"}]}]}}
    with pytest.raises(jsonschema.ValidationError):
        _validate(bad_rule, NEWEST)


def test_overlays_differ_only_where_they_should() -> None:
    """Same objects in both overlays; only the device plugin's and the MPS daemons' DaemonSets differ."""
    def index(objs: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
        return {(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in objs}

    nvidia, simulated = index(build("nvidia")), index(build("simulated"))
    assert nvidia.keys() == simulated.keys()
    differ = {k for k in nvidia if nvidia[k] != simulated[k]}
    assert differ == {("DaemonSet", "gpu-slice-system", "gpu-slice-device-plugin"),
                      ("DaemonSet", "gpu-slice-system", "gpu-slice-mps")}
