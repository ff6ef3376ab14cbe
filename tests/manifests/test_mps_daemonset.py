"""The MPS daemons' own DaemonSet agrees with the plugin's, and the budget-eviction component does what it
says. Built with ``kubectl kustomize`` (skipped where kubectl is absent; CI installs it)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from tests.manifests.built import MANIFESTS, OVERLAYS, build, kubectl, one

Obj = dict[str, Any]


def _args(container: Obj, module: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(container["args"][1:])


def _volume(pod: Obj, container: Obj, mount_path: str) -> tuple[Obj, Obj]:
    (mount,) = [m for m in container.get("volumeMounts", []) if m["mountPath"] == mount_path]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return mount, volume


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_mps_daemons_have_their_own_daemonset_rolled_only_on_delete(overlay: str) -> None:
    from deviceplugin import cli, mps_keeper

    objs = build(overlay)
    plugin = one(objs, "DaemonSet", "gpu-slice-device-plugin")["spec"]["template"]["spec"]
    mps_ds = one(objs, "DaemonSet", "gpu-slice-mps")
    mps = mps_ds["spec"]["template"]["spec"]
    assert mps_ds["spec"]["updateStrategy"] == {"type": "OnDelete"}  # a plugin roll never touches the daemons
    (daemon,) = mps["containers"]
    assert daemon["args"][0] == "mps-daemon"
    keeper = _args(daemon, mps_keeper)
    plugin_args = _args(plugin["containers"][0], cli)
    assert plugin_args.mps_daemons == "external" and keeper.mps_root == plugin_args.mps_root
    # The same host directory in both pods, at the host's own path (Allocate hands pods host paths).
    _, vol = _volume(mps, daemon, keeper.mps_root)
    assert vol["hostPath"]["path"] == keeper.mps_root
    # The same nodes and tolerations as the plugin: every node with a plugin has its daemons.
    for key in ("nodeSelector", "affinity"):
        assert mps.get(key) == plugin.get(key), key
    assert mps["tolerations"] == plugin["tolerations"]
    assert mps["priorityClassName"] == "system-node-critical"
    assert 0 < keeper.drain_s < mps["terminationGracePeriodSeconds"]
    if overlay == "nvidia":
        assert mps["hostPID"] is True and keeper.control == "nvidia-cuda-mps-control" and keeper.restore_compute_mode
        (init,) = mps["initContainers"]
        shm = _args(init, mps_keeper)
        assert shm.mount_shm == "1Gi" and shm.mps_root == keeper.mps_root
        mount, _ = _volume(mps, init, keeper.mps_root)
        assert mount["mountPropagation"] == "Bidirectional" and init["securityContext"]["privileged"] is True
        # The daemons' /dev/shm is the tmpfs the init container mounted, where Allocate points clients.
        _, shm_vol = _volume(mps, daemon, "/dev/shm")
        assert PurePosixPath(shm_vol["hostPath"]["path"]) == PurePosixPath(keeper.mps_root) / "shm"
        env = {e["name"]: e.get("value") for e in daemon["env"]}
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and "compute" in env["NVIDIA_DRIVER_CAPABILITIES"]
    else:
        assert keeper.control == "standin" and not mps.get("initContainers") and not mps.get("hostPID")
        assert not daemon["securityContext"].get("privileged")


def test_budget_eviction_is_an_opt_in_component(tmp_path: Path) -> None:
    from deviceplugin import cli

    exe = kubectl()
    if exe is None:
        pytest.skip("kubectl is not installed (.ci/run installs it)")
    base = build("nvidia")
    plugin = one(base, "DaemonSet", "gpu-slice-device-plugin")["spec"]["template"]["spec"]["containers"][0]
    assert "--evict-over-budget" not in plugin["args"]
    assert not [o for o in base if o["metadata"]["name"] == "gpu-slice-device-plugin-evict"]
    overlay = tmp_path / "with-eviction"
    shutil.copytree(MANIFESTS, tmp_path / "manifests")
    overlay = tmp_path / "manifests" / "overlays" / "with-eviction"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": ["../nvidia"],
        "components": ["../../components/budget-eviction"]}))
    done = subprocess.run([exe, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60, check=True)
    objs = [d for d in yaml.safe_load_all(done.stdout) if d]
    container = one(objs, "DaemonSet", "gpu-slice-device-plugin")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][-1] == "--evict-over-budget" and _args(container, cli).budget_evict is True
    role = one(objs, "ClusterRole", "gpu-slice-device-plugin-evict")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]}]
    binding = one(objs, "ClusterRoleBinding", "gpu-slice-device-plugin-evict")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpu-slice-device-plugin",
                                    "namespace": "gpu-slice-system"}]
