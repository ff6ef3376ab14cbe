"""Refusing GPUs another resource advertises, for every id form seen in the wild."""

from __future__ import annotations

from deviceplugin.coexistence import find_refusals
from deviceplugin.simulated import builtin_topology

TOPO = builtin_topology("node-a")
MIG, MPS = TOPO.gpus
OWN = "example.com/gpu-slice"


def test_each_id_form_is_recognised() -> None:
    forms = {
        "nvidia.com/gpu": [MPS.uuid],
        "nvidia.com/gpu.shared": [f"{MPS.uuid}::3"],
        "nvidia.com/vgpu": [f"{MPS.uuid}/vgpu2"],
        f"nvidia.com/mig-{MIG.instances[0].profile}": [MIG.instances[0].uuid],
    }
    for resource, ids in forms.items():
        refusals = find_refusals(TOPO.gpus, [(resource, ids)], OWN)
        assert len(refusals) == 1, resource
        refusal = next(iter(refusals.values()))
        assert refusal.resource == resource
        assert refusal.gpu_uuid in refusal.message and resource in refusal.message


def test_old_mig_form_and_indices_under_nvidia_resources() -> None:
    assert set(find_refusals(TOPO.gpus, [("nvidia.com/gpu", [f"MIG-{MIG.uuid}/1/0"])], OWN)) == {MIG.uuid}
    assert set(find_refusals(TOPO.gpus, [("nvidia.com/gpu", ["1"])], OWN)) == {MPS.uuid}
    assert set(find_refusals(TOPO.gpus, [("nvidia.com/gpu", ["0:1"])], OWN)) == {MIG.uuid}
    assert find_refusals(TOPO.gpus, [("vendor.example/fpga", ["0", "1"])], OWN) == {}


def test_our_own_resource_and_unrelated_ids_are_ignored() -> None:
    own = [(OWN, [sid for g in TOPO.gpus for sid in g.slice_ids()])]
    assert find_refusals(TOPO.gpus, own, OWN) == {}
    assert find_refusals(TOPO.gpus, [("nvidia.com/gpu", ["GPU-ffffffff-0000-0000-0000-000000000000"])], OWN) == {}
