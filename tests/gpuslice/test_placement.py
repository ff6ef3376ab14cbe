"""Placement enumeration (DESIGN 2): refusals with reasons, memory tolerance, and a property."""

from __future__ import annotations

import random
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice.catalogue import PRODUCTS
from gpuslice.fakecluster import random_mig_layout
from gpuslice.model import Gpu, GpuMode, MigInstance, NodeInventory
from gpuslice.placement import enumerate_placements, suits
from gpuslice.requests import SliceRequest

GIB = 1024


def h100_mig(*instances: MigInstance, uuid: str = "GPU-m", index: int = 0) -> Gpu:
    return Gpu(uuid, index, "H100-80GB", 81559, "mig", sum(i.compute_slices for i in instances),
               instances=instances)


def mps(uuid: str = "GPU-s", index: int = 0, s: int = 7) -> Gpu:
    return Gpu(uuid, index, "H100-80GB", 81559, "mps", s)


def whole(uuid: str, index: int, s: int = 7) -> Gpu:
    return Gpu(uuid, index, "H100-80GB", 81559, "whole", s)


BALANCED = (MigInstance("MIG-1a", "1g.10gb", 0, 1, 9984), MigInstance("MIG-1b", "1g.20gb", 2, 1, 20096),
            MigInstance("MIG-3g", "3g.40gb", 4, 3, 40448))


def test_five_slices_on_mig_refused_with_reason() -> None:
    inv = NodeInventory("n", (h100_mig(MigInstance("MIG-4", "4g.40gb", 0, 4, 40448),
                                        MigInstance("MIG-3", "3g.40gb", 4, 3, 40448)),))
    f = enumerate_placements(inv, SliceRequest(5))
    assert not f.feasible
    assert f.reason() == ("no GPU here can take exactly 5 slices: no MIG profile of H100-80GB has 5 compute slices "
                          "(profiles: 1, 2, 3, 4, 7)")


def test_nine_slices_with_s7_refused() -> None:
    inv = NodeInventory("n", (mps(),))
    f = enumerate_placements(inv, SliceRequest(9))
    refusal = ("9 slices is neither at most S=7 (one GPU) nor a whole number of GPUs (a multiple of 7); did you "
               "mean 7 or 14?")
    assert f.reason() == refusal
    inv2 = NodeInventory("n", (whole("GPU-a", 0), whole("GPU-b", 1)))
    assert enumerate_placements(inv2, SliceRequest(9)).reason() == refusal


def test_fourteen_slices_on_one_mps_gpu_refused() -> None:
    inv = NodeInventory("n", (mps(),))
    assert enumerate_placements(inv, SliceRequest(14)).reason() == (
        "a 14-slice pod needs 2 whole-mode GPUs of 7 slices (more than one GPU is given only as whole GPUs), and the "
        "node has 0 (modes here: mps)")


def test_memory_floor_no_instance_meets_is_refused() -> None:
    inv = NodeInventory("n", (h100_mig(*BALANCED),))
    f = enumerate_placements(inv, SliceRequest(1, Fraction(30 * GIB)))
    assert not f.feasible
    assert f.reason().endswith("(at most 19.62 GiB here)")


def test_memory_reason_names_the_largest_instance() -> None:
    inv = NodeInventory("n", (h100_mig(*BALANCED),))
    assert enumerate_placements(inv, SliceRequest(1, Fraction(30 * GIB))).reason() == (
        "no GPU or MIG instance here gives 30.00 GiB of GPU memory to a 1-slice pod (at most 19.62 GiB here)")


def test_20gi_matches_1g20gb_within_tolerance() -> None:
    inv = NodeInventory("n", (h100_mig(*BALANCED),))
    f = enumerate_placements(inv, SliceRequest(1, Fraction(20 * GIB)))
    assert [p.instance for p in f.placements] == ["MIG-1b"]
    assert f.placements[0].memory_mib == 20096 and f.placements[0].slice_ids == ("MIG-1b::0",)
    # with no tolerance 20 GiB is more than 19.62 GiB
    assert not enumerate_placements(inv, SliceRequest(1, Fraction(20 * GIB)), memory_tolerance=0).feasible


def test_mig_takes_one_whole_instance_of_exactly_k() -> None:
    inv = NodeInventory("n", (h100_mig(*BALANCED),))
    f = enumerate_placements(inv, SliceRequest(3))
    assert [(p.mode, p.instance, p.slice_ids) for p in f.placements] == [
        ("mig", "MIG-3g", ("MIG-3g::0", "MIG-3g::1", "MIG-3g::2"))]
    used = inv.allocate(["MIG-3g::1"])
    assert enumerate_placements(used, SliceRequest(3)).reason() == (
        "slices in use: every fitting 3-slice MIG instance here is taken")
    assert enumerate_placements(inv, SliceRequest(4)).reason() == (
        "no GPU here can take exactly 4 slices: no MIG instance here has 4 compute slices (instances here: 1, 3; "
        "the layout would have to change)")


def test_mps_memory_is_k_over_s() -> None:
    inv = NodeInventory("n", (mps(),))
    (p,) = enumerate_placements(inv, SliceRequest(2)).placements
    # k/S of what is left after 512 MiB for the MPS server and 256 MiB of context per slice
    assert p.mode == "mps" and p.slice_ids == ("GPU-s::0", "GPU-s::1")
    assert p.memory_mib == (81559 - 512 - 7 * 256) * 2 // 7
    assert enumerate_placements(inv, SliceRequest(1, Fraction(12 * GIB))).reason() == (
        "no GPU or MIG instance here gives 12.00 GiB of GPU memory to a 1-slice pod (at most 11.06 GiB here)")
    busy = inv.allocate([f"GPU-s::{n}" for n in range(6)])
    assert enumerate_placements(busy, SliceRequest(2)).reason() == (
        "slices in use: no fitting GPU has 2 free slices (at most 1 of 7 free)")


def test_whole_multi_gpu() -> None:
    inv = NodeInventory("n", (whole("GPU-a", 0), whole("GPU-b", 1), whole("GPU-c", 2)))
    f = enumerate_placements(inv, SliceRequest(14))
    assert [p.gpus for p in f.placements] == [("GPU-a", "GPU-b"), ("GPU-b", "GPU-c")]
    assert all(p.mode == "whole" and len(p.slice_ids) == 14 and p.memory_mib == 2 * 81559 for p in f.placements)
    partly = inv.allocate(["GPU-b::3"])
    assert enumerate_placements(partly, SliceRequest(14)).placements[0].gpus == ("GPU-a", "GPU-c")
    assert enumerate_placements(partly, SliceRequest(21)).reason() == (
        "slices in use: 2 of the 3 whole GPUs needed are free")


def test_isolation_health_and_cordon() -> None:
    inv = NodeInventory("n", (mps(), h100_mig(*BALANCED, uuid="GPU-m", index=1)))
    assert {p.mode for p in enumerate_placements(inv, SliceRequest(1, isolation="mig")).placements} == {"mig"}
    assert {p.mode for p in enumerate_placements(inv, SliceRequest(1, isolation="mps")).placements} == {"mps"}
    sick = NodeInventory("n", (Gpu("GPU-s", 0, "H100-80GB", 81559, "mps", 7, healthy=False),
                               Gpu("GPU-t", 1, "H100-80GB", 81559, "mps", 7, cordoned=True)))
    assert enumerate_placements(sick, SliceRequest(1)).reason() == (
        "GPU 0, 1 could take the pod but are unhealthy or cordoned")
    assert enumerate_placements(NodeInventory("n", ()), SliceRequest(1)).reason() == (
        "node has no GPUs advertising slices")


def test_suits() -> None:
    inv = NodeInventory("n", (h100_mig(*BALANCED),))
    small = next(p for p in enumerate_placements(inv, SliceRequest(1)).placements if p.instance == "MIG-1a")
    assert suits(small, SliceRequest(1), inv)
    assert not suits(small, SliceRequest(2), inv)
    assert not suits(small, SliceRequest(1, Fraction(15 * GIB)), inv)
    assert not suits(small, SliceRequest(1, isolation="mps"), inv)


# --------------------------------------------------------------------------- property

@st.composite
def nodes(draw: st.DrawFn) -> NodeInventory:
    gpus: list[Gpu] = []
    for index in range(draw(st.integers(1, 4))):
        name = draw(st.sampled_from(["H100-80GB", "A30-24GB", "L4"]))
        prod = PRODUCTS[name]
        assert prod.memory_mib is not None
        modes: list[GpuMode] = ["mig", "mps", "whole"] if prod.mig_capable else ["mps", "whole"]
        mode = draw(st.sampled_from(modes))
        uuid = f"GPU-{index}"
        if mode == "mig":
            layout = random_mig_layout(prod, random.Random(draw(st.integers(0, 10**6))))
            insts = tuple(MigInstance(f"MIG-{index}-{n}", p.name, s, p.compute_slices, p.memory_mib)
                          for n, (p, s) in enumerate(layout))
            gpus.append(Gpu(uuid, index, name, prod.memory_mib, "mig", sum(i.compute_slices for i in insts),
                            healthy=draw(st.integers(0, 9)) > 0, cordoned=draw(st.integers(0, 9)) == 0,
                            instances=insts))
        else:
            gpus.append(Gpu(uuid, index, name, prod.memory_mib, mode, draw(st.sampled_from([4, 7])),
                            healthy=draw(st.integers(0, 9)) > 0, cordoned=draw(st.integers(0, 9)) == 0))
    inv = NodeInventory("n", tuple(gpus))
    all_ids = sorted(inv.all_ids())
    used = draw(st.lists(st.sampled_from(all_ids), unique=True)) if all_ids else []
    return inv.with_used(used)


@settings(max_examples=200)
@given(nodes(), st.integers(1, 16), st.sampled_from([None, 4 * GIB, 12 * GIB, 40 * GIB]),
       st.sampled_from(["any", "mig", "mps"]))
def test_every_placement_is_free_and_valid(inv: NodeInventory, k: int, memory: int | None, isolation: str) -> None:
    request = SliceRequest(k, Fraction(memory) if memory else None, isolation)  # type: ignore[arg-type]
    f = enumerate_placements(inv, request)
    assert f.feasible or f.reason()
    for p in f.placements:
        assert len(p.slice_ids) == k == len(set(p.slice_ids))
        assert set(p.slice_ids) <= inv.free_ids()
        gpus = [inv.gpu(u) for u in p.gpus]
        assert all(g.schedulable for g in gpus)
        assert {inv.gpu_of(s).uuid for s in p.slice_ids} == set(p.gpus)
        if p.mode == "mig":
            inst = gpus[0].instance(p.instance or "")
            assert set(p.slice_ids) == set(inst.slice_ids()) and inst.compute_slices == k
        elif p.mode == "mps":
            assert len(gpus) == 1 and gpus[0].mode == "mps" and k <= gpus[0].slices
        else:
            assert all(g.mode == "whole" for g in gpus)
            assert set(p.slice_ids) == {s for g in gpus for s in g.slice_ids()}
        assert suits(p, request, inv)
        inv.allocate(p.slice_ids)  # must not raise: ids free and known


def test_isolation_pins_the_mode_even_for_whole_gpus() -> None:
    whole = Gpu("GPU-w", 0, "H100-80GB", 81559, "whole", 7)
    inv = NodeInventory("n", (whole,))
    result = enumerate_placements(inv, SliceRequest(7, isolation="mig"))
    assert not result.feasible
    assert result.reason() == "pod asks mig isolation and the node has no MIG instances (modes here: whole)"
    assert enumerate_placements(inv, SliceRequest(7)).feasible
