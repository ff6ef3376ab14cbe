"""The slice model: GPU modes, MIG layout validation, and inventory bookkeeping refusals."""

from __future__ import annotations

import pytest

from gpuslice.errors import CatalogueError, InventoryError
from gpuslice.model import Gpu, MigInstance, NodeInventory, validate_mig_layout

G = "GPU-0000"
H = "GPU-1111"


def inst(uuid: str, profile: str, start: int, slices: int, mem: int = 9984) -> MigInstance:
    return MigInstance(uuid, profile, start, slices, mem)


def mig_gpu(*instances: MigInstance, uuid: str = G) -> Gpu:
    return Gpu(uuid, 0, "H100-80GB", 81559, "mig", sum(i.compute_slices for i in instances), instances=instances)


def test_mig_gpu_ids_and_ownership() -> None:
    gpu = mig_gpu(inst("MIG-a", "4g.40gb", 0, 4), inst("MIG-b", "3g.40gb", 4, 3))
    assert gpu.slice_ids() == ("MIG-a::0", "MIG-a::1", "MIG-a::2", "MIG-a::3", "MIG-b::0", "MIG-b::1", "MIG-b::2")
    assert gpu.owns("MIG-b") and gpu.owns(G) and not gpu.owns("MIG-c")
    assert gpu.instance("MIG-b").profile == "3g.40gb"
    with pytest.raises(InventoryError, match=r"GPU GPU-0000 has no MIG instance MIG-z"):
        gpu.instance("MIG-z")


def test_mps_and_whole_ids() -> None:
    gpu = Gpu(H, 1, "L4", 23034, "mps", 3)
    assert gpu.slice_ids() == ("GPU-1111::0", "GPU-1111::1", "GPU-1111::2")
    assert gpu.schedulable
    assert not Gpu(H, 1, "L4", 23034, "whole", 3, healthy=False).schedulable
    assert not Gpu(H, 1, "L4", 23034, "whole", 3, cordoned=True).schedulable


@pytest.mark.parametrize(("instances", "message"), [
    ((inst("MIG-a", "3g.40gb", 2, 3),),
     "GPU GPU-0000: instance MIG-a (3g.40gb) cannot start at memory slice 2; legal starts [0, 4]"),
    ((inst("MIG-a", "1g.10gb", 7, 1),),
     "GPU GPU-0000: instance MIG-a (1g.10gb) cannot start at memory slice 7; legal starts [0, 1, 2, 3, 4, 5, 6]"),
    ((inst("MIG-a", "4g.40gb", 0, 4), inst("MIG-b", "2g.20gb", 2, 2)),
     "GPU GPU-0000: instance MIG-b overlaps another instance's memory slices"),
    ((inst("MIG-a", "2g.20gb", 0, 3),),
     "GPU GPU-0000: instance MIG-a claims 3 compute slices, profile 2g.20gb has 2"),
    ((inst("MIG-a", "5g.50gb", 0, 5),),
     "H100-80GB has no MIG profile '5g.50gb'; known: 1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, "
     "7g.80gb"),
    ((inst("MIG-a", "1g.10gb+me", 0, 1), inst("MIG-b", "1g.10gb+me", 1, 1)),
     "GPU GPU-0000: more than 1 instances of 1g.10gb+me"),
])
def test_layout_refusals(instances: tuple[MigInstance, ...], message: str) -> None:
    with pytest.raises(CatalogueError) as err:
        mig_gpu(*instances)
    assert str(err.value) == message


def test_layout_refuses_non_mig_product_and_wrong_mode_fields() -> None:
    with pytest.raises(CatalogueError, match=r"^GPU GPU-0000: product L4 does not support MIG$"):
        Gpu(G, 0, "L4", 23034, "mig", 1, instances=(inst("MIG-a", "1g.10gb", 0, 1),))
    with pytest.raises(CatalogueError, match=r"^GPU GPU-0000: MIG instances listed but mode is mps$"):
        Gpu(G, 0, "H100-80GB", 81559, "mps", 7, instances=(inst("MIG-a", "1g.10gb", 0, 1),))
    with pytest.raises(CatalogueError, match=r"^GPU GPU-0000: slices=7 but its MIG instances hold 1$"):
        Gpu(G, 0, "H100-80GB", 81559, "mig", 7, instances=(inst("MIG-a", "1g.10gb", 0, 1),))
    with pytest.raises(CatalogueError, match=r"^GPU GPU-0000: slices must be at least 1, got 0$"):
        Gpu(G, 0, "H100-80GB", 81559, "whole", 0)
    with pytest.raises(CatalogueError, match=r"mode must be one of mig, mps, whole, got 'shared'"):
        Gpu(G, 0, "H100-80GB", 81559, "shared", 7)  # type: ignore[arg-type]


def test_legal_layouts() -> None:
    validate_mig_layout("H100-80GB", [inst(f"MIG-{n}", "1g.10gb", n, 1) for n in range(7)], where="x")
    validate_mig_layout("H100-80GB", [inst("MIG-a", "4g.40gb", 0, 4), inst("MIG-b", "3g.40gb", 4, 3)], where="x")
    validate_mig_layout("H100-80GB", [inst(f"MIG-{n}", "1g.20gb", 2 * n, 1) for n in range(4)], where="x")
    validate_mig_layout("A30-24GB", [inst("MIG-a", "2g.12gb", 0, 2), inst("MIG-b", "2g.12gb", 2, 2)], where="x")
    assert mig_gpu().slice_ids() == ()  # MIG mode with no instances advertises nothing


def test_duplicate_instance_uuid_in_one_gpu_is_refused() -> None:
    with pytest.raises((CatalogueError, InventoryError)):
        NodeInventory("n", (mig_gpu(inst("MIG-a", "1g.10gb", 0, 1), inst("MIG-a", "1g.10gb", 1, 1)),))


def inventory() -> NodeInventory:
    return NodeInventory("n1", (mig_gpu(inst("MIG-a", "2g.20gb", 0, 2)), Gpu(H, 1, "H100-80GB", 81559, "mps", 3)))


def test_inventory_allocate_release() -> None:
    inv = inventory()
    assert inv.all_ids() == {"MIG-a::0", "MIG-a::1", "GPU-1111::0", "GPU-1111::1", "GPU-1111::2"}
    used = inv.allocate(["GPU-1111::0", "MIG-a::1"])
    assert used.used == {"GPU-1111::0", "MIG-a::1"}
    assert inv.used == frozenset()  # values are immutable
    assert used.free_on(used.gpu(H)) == ("GPU-1111::1", "GPU-1111::2")
    assert used.release(["MIG-a::1"]).used == {"GPU-1111::0"}
    assert used.gpu_of("MIG-a::0").uuid == G


def test_inventory_refusals() -> None:
    inv = inventory().allocate(["GPU-1111::0"])
    with pytest.raises(InventoryError, match=r"^node n1: device ids already in use \['GPU-1111::0'\]$"):
        inv.allocate(["GPU-1111::0"])
    with pytest.raises(InventoryError, match=r"^node n1: unknown device ids \['GPU-1111::7'\]$"):
        inv.allocate(["GPU-1111::7"])
    with pytest.raises(InventoryError, match=r"^node n1: releasing ids that are not in use \['GPU-1111::1'\]$"):
        inv.release(["GPU-1111::1"])
    with pytest.raises(InventoryError, match=r"^node n1: used ids not on this node: \['GPU-9::0'\]$"):
        NodeInventory("n1", inv.gpus, frozenset({"GPU-9::0"}))
    with pytest.raises(InventoryError, match=r"^node n1 has no GPU GPU-9$"):
        inv.gpu("GPU-9")
    with pytest.raises(InventoryError, match=r"^node n1 has no device GPU-9::0$"):
        inv.gpu_of("GPU-9::0")
    with pytest.raises(InventoryError, match=r"^node n1: GPU or MIG UUID listed twice near GPU-1111$"):
        NodeInventory("n1", (Gpu(H, 0, "L4", 1, "mps", 1), Gpu(H, 1, "L4", 1, "mps", 1)))
    with pytest.raises(InventoryError, match=r"^node n1 has no GPU GPU-7$"):
        inv.with_gpu(Gpu("GPU-7", 0, "L4", 1, "mps", 1))


def test_unhealthy_and_cordoned_ids_are_never_free() -> None:
    inv = inventory()
    sick = inv.with_gpu(Gpu(H, 1, "H100-80GB", 81559, "mps", 3, healthy=False))
    assert sick.free_ids() == {"MIG-a::0", "MIG-a::1"}
    assert sick.all_ids() == inv.all_ids()
    cordoned = inv.with_gpu(Gpu(H, 1, "H100-80GB", 81559, "mps", 3, cordoned=True))
    assert cordoned.free_ids() == {"MIG-a::0", "MIG-a::1"}
