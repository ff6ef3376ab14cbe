"""ContainerAllocateResponse building: injection strategies, MIG vs MPS vs whole, sizing envs."""

from __future__ import annotations

from pathlib import Path

from deviceplugin.allocate import Injector, build_response, format_fraction
from deviceplugin.assignments import check_placement
from deviceplugin.simulated import builtin_topology, parse_topology
from gpuslice.model import NodeInventory

NODE = "node-a"
TOPO = builtin_topology(NODE)
MIG, MPS = TOPO.gpus
INV = NodeInventory(NODE, TOPO.gpus)


def test_cdi_names_the_mig_uuid_with_the_configured_vendor() -> None:
    inst = MIG.instances[0]
    placement = check_placement(INV, inst.slice_ids())
    resp = build_response(placement, INV, Injector(mode="cdi", cdi_vendor="nvidia.com"))
    assert [d.name for d in resp.cdi_devices] == [f"nvidia.com/gpu={inst.uuid}"]
    # An image's NVIDIA_VISIBLE_DEVICES=all must expose nothing beside the CDI device.
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert not resp.mounts
    assert resp.envs["GPU_SLICE_COUNT"] == "2"
    assert resp.envs["GPU_SLICE_FRACTION"] == "0.285714"
    assert resp.envs["GPU_SLICE_MEMORY_BYTES"] == str(inst.memory_mib * 1024 * 1024)


def test_volume_mounts_strategy_matches_nvidia_conventions() -> None:
    placement = check_placement(INV, MIG.instances[3].slice_ids())
    resp = build_response(placement, INV, Injector(mode="volume-mounts"))
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
    [mount] = list(resp.mounts)
    assert mount.host_path == "/dev/null"
    assert mount.container_path == f"/var/run/nvidia-container-devices/{MIG.instances[3].uuid}"
    assert not resp.cdi_devices


def test_env_only_strategy_lists_uuids() -> None:
    placement = check_placement(INV, MPS.slice_ids()[:1])
    resp = build_response(placement, INV, Injector(mode="env", mps_root=Path("/mps")))
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == MPS.uuid


def test_mps_placement_gets_pipe_shm_and_limits() -> None:
    placement = check_placement(INV, MPS.slice_ids()[:3])
    resp = build_response(placement, INV, Injector(mode="cdi", mps_root=Path("/run/mps")))
    mounts = {m.container_path: m.host_path for m in resp.mounts}
    pipe = resp.envs["CUDA_MPS_PIPE_DIRECTORY"]
    assert mounts[pipe] == f"/run/mps/{MPS.uuid}/pipe"
    assert mounts["/dev/shm"] == "/run/mps/shm"
    assert resp.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "42"
    share = (MPS.memory_mib - 512 - 7 * 256) * 3 // 7  # the MPS server and 7 client contexts kept out
    assert resp.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={share}M"
    assert resp.envs["GPU_SLICE_MEMORY_BYTES"] == str(share << 20)
    memory_only = build_response(placement, INV, Injector(mps_root=Path("/run/mps"), mps_memory_only=True))
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in memory_only.envs


def test_whole_gpus_expose_each_gpu() -> None:
    topo = parse_topology({"version": 1, "node": NODE, "gpus": [
        {"product": "H100-80GB", "mode": "whole"}, {"product": "H100-80GB", "mode": "whole"}]})
    inv = NodeInventory(NODE, topo.gpus)
    ids = [sid for g in topo.gpus for sid in g.slice_ids()]
    resp = build_response(check_placement(inv, ids), inv, Injector())
    assert sorted(d.name for d in resp.cdi_devices) == sorted(
        f"nvidia.com/gpu={g.uuid}" for g in topo.gpus)
    assert resp.envs["GPU_SLICE_FRACTION"] == "2"
    assert resp.envs["GPU_SLICE_COUNT"] == "14"


def test_format_fraction() -> None:
    from fractions import Fraction

    assert format_fraction(Fraction(1, 2)) == "0.5"
    assert format_fraction(Fraction(3, 7)) == "0.428571"
    assert format_fraction(Fraction(1)) == "1"


def test_cdi_names_default_to_the_container_toolkits_and_a_spec_must_define_them(tmp_path: Path) -> None:
    import asyncio

    import pytest

    from deviceplugin.app import DevicePluginApp
    from deviceplugin.cdi import check_cdi_spec, find_cdi_spec
    from deviceplugin.errors import SettingsError
    from deviceplugin.settings import Settings

    assert Injector().cdi_vendor == "nvidia.com" and Settings(node_name="n").cdi_vendor == "nvidia.com"
    etc, run = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    etc.mkdir()
    (etc / "other.yaml").write_text("cdiVersion: 0.5.0\nkind: example.com/fpga\ndevices: []\n")
    (etc / "broken.json").write_text("{not json")
    with pytest.raises(SettingsError, match=r"no CDI spec of kind nvidia\.com/gpu in .*nvidia-ctk cdi generate"):
        check_cdi_spec("nvidia.com", "gpu", [etc, run])
    run.mkdir()
    (run / "nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: GPU-1\n")
    assert find_cdi_spec("nvidia.com", "gpu", [etc, run]) == run / "nvidia.yaml"
    # The nvml backend refuses to start without a spec, before it touches NVML.
    settings = Settings(node_name="n", backend="nvml", plugin_dir=tmp_path / "dp", use_kube=False, metrics_port=0,
                        cdi_spec_dirs=(etc,)).validate()
    with pytest.raises(SettingsError, match="no CDI spec"):
        asyncio.run(DevicePluginApp(settings).run(asyncio.Event()))
