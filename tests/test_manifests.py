"""The shipped manifests agree with the code: the config map validates and the flags exist."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from gpuslice.config import load_config_text

MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]


def test_kustomization_lists_existing_files() -> None:
    (kust,) = _docs("deviceplugin/kustomization.yaml")
    for resource in kust["resources"]:
        assert (MANIFESTS / "deviceplugin" / resource).is_file(), resource


def test_shipped_config_validates() -> None:
    (cm,) = _docs("deviceplugin/configmap.yaml")
    config = load_config_text(cm["data"]["config.yaml"])
    assert config.slices == 7


def test_daemonset_args_are_accepted_by_the_cli() -> None:
    from deviceplugin import cli

    (ds,) = _docs("deviceplugin/daemonset.yaml")
    container = ds["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "device-plugin"
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(container["args"][1:])
    assert args.backend == "nvml"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources"} <= mounts
