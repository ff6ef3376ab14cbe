"""The packing state built from inventories agrees with the object model's bookkeeping."""

from __future__ import annotations

from fractions import Fraction

import pytest

from gpuslice.errors import RequestError
from gpuslice.model import Gpu, MigInstance, NodeInventory
from gpuslice.packing.build import pack_request, state_from_inventories, units_of
from gpuslice.packing.state import KIND_MIG, KIND_MPS, KIND_WHOLE, NodeSpec
from gpuslice.placement import enumerate_placements
from gpuslice.requests import SliceRequest

MIG = Gpu("GPU-m", 0, "H100-80GB", 81559, "mig", 7, instances=(
    MigInstance("MIG-a", "4g.40gb", 0, 4, 40448), MigInstance("MIG-b", "3g.40gb", 4, 3, 40448)))
MPS = Gpu("GPU-p", 1, "H100-80GB", 81559, "mps", 7)
WHOLE = Gpu("GPU-w", 2, "H100-80GB", 81559, "whole", 7, cordoned=True)


def test_units_follow_modes_and_used_ids() -> None:
    inv = NodeInventory("n", (MIG, MPS, WHOLE)).allocate(["MIG-b::0", "MIG-b::1", "MIG-b::2", "GPU-p::0", "GPU-p::1"])
    units = units_of(3, inv)
    assert [(u.kind, u.capacity, u.free, u.instance or u.gpu) for u in units] == [
        (KIND_MIG, 4, 4, "MIG-a"), (KIND_MIG, 3, 0, "MIG-b"), (KIND_MPS, 7, 5, "GPU-p"), (KIND_WHOLE, 7, 7, "GPU-w")]
    assert {u.node for u in units} == {3}
    assert [u.usable for u in units] == [True, True, True, False]


def test_a_whole_gpu_with_any_used_id_is_not_free() -> None:
    whole = Gpu("GPU-x", 0, "A100-40GB", 40960, "whole", 7)
    (unit,) = units_of(0, NodeInventory("n", (whole,)).allocate(["GPU-x::3"]))
    assert unit.free == 0


def test_state_counts_free_slices() -> None:
    inv = NodeInventory("n", (MIG, MPS)).allocate(["GPU-p::0"])
    state = state_from_inventories([(NodeSpec("n", 8000, 65536, "H100-80GB"), inv)], slices_per_gpu=7)
    assert state.n_nodes == 1 and state.n_units == 3
    assert state.allocated_slices == 1


def test_pack_request_shapes() -> None:
    assert pack_request(SliceRequest(3), slices_per_gpu=7).gpus == 1
    multi = pack_request(SliceRequest(14, Fraction(150 * 1024)), slices_per_gpu=7)
    assert (multi.gpus, multi.slices, multi.gpu_memory_mib) == (2, 7, 75 * 1024)
    assert pack_request(None, slices_per_gpu=7, cpu_milli=500).gpus == 0
    with pytest.raises(RequestError, match="9 slices is neither at most S=7 \\(one GPU\\) nor a whole number of GPUs"):
        pack_request(SliceRequest(9), slices_per_gpu=7)


@pytest.mark.parametrize("product_name", ["A100-40GB", "H100-80GB", "L4", "T4"])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_placement_and_packing_state_agree_on_mps_memory_edges(product_name: str, k: int) -> None:
    from gpuslice.catalogue import product

    memory = product(product_name).memory_mib
    assert memory is not None
    gpu = Gpu("GPU-e", 0, product_name, memory, "mps", 7)
    inv = NodeInventory("n", (gpu,))
    state = state_from_inventories([(NodeSpec("n", 64000, 262144, product_name), inv)], slices_per_gpu=7)
    edge = (memory * k) // 7
    for floor in range(int(edge / 0.97) - 3, int(edge / 0.97) + 4):
        core = enumerate_placements(inv, SliceRequest(k, Fraction(floor))).feasible
        packed = bool(state.unit_accepts(pack_request(SliceRequest(k, Fraction(floor)), slices_per_gpu=7))[0])
        assert core == packed, (floor, core, packed)
