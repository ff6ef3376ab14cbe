"""The device plugin's DaemonSet: the liveness probe reaches the plugin's /healthz on its metrics port."""

from __future__ import annotations

from pathlib import Path

import yaml

from deviceplugin.settings import Settings

DAEMONSET = Path(__file__).resolve().parents[2] / "manifests" / "deviceplugin" / "daemonset.yaml"


def test_daemonset_has_a_liveness_probe_on_healthz() -> None:
    ds = yaml.safe_load(DAEMONSET.read_text())
    container = ds["spec"]["template"]["spec"]["containers"][0]
    probe = container["livenessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert probe["path"] == "/healthz"
    assert ports[probe["port"]] == Settings(node_name="n").metrics_port


def test_daemonset_mounts_the_cdi_spec_directories() -> None:
    ds = yaml.safe_load(DAEMONSET.read_text())
    container = ds["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {str(d) for d in Settings(node_name="n").cdi_spec_dirs} <= mounts
