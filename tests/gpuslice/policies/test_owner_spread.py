"""``fragmentation`` point 6: the owner-spread rule closes a GPU to its owner's later pods."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from gpuslice.packing.frag import OWNER_SHAPES, TRACKED_OWNERS, TargetWorkload
from gpuslice.packing.state import KIND_MIG, ClusterState, NodeSpec, PackRequest, UnitSpec, enumerate_candidates
from gpuslice.policies.fragmentation import (
    OWNER_LIMIT,
    Fragmentation,
    owner_reach_change,
    owner_reach_weight,
    owner_spread_change,
)

from .helpers import cluster, learned, pick

POD = PackRequest(cpu_milli=1000, memory_mib=1024, gpus=1, slices=1, owner="llm-a")


def test_mps_gpu_left_open_to_the_shape_is_closed_to_the_owner() -> None:
    # Node 0: an idle 7-slice MPS GPU (6 slices left would still take the shape); node 1: 2 free.
    state = cluster([[7], [2]], slices=7)
    cands = enumerate_candidates(state, POD)
    np.testing.assert_allclose(owner_spread_change(state, POD, cands), np.where(cands.node == 0, 6.0, 1.0))
    no_owner = PackRequest(cpu_milli=1000, memory_mib=1024, gpus=1, slices=1)
    np.testing.assert_allclose(owner_spread_change(state, no_owner, enumerate_candidates(state, no_owner)), 0.0)


def test_a_large_mps_request_leaves_nothing_its_shape_could_take() -> None:
    # 4 slices out of 7 leave 3, which a 4-slice pod of the owner could not take anyway.
    state = cluster([[7]], slices=7)
    req = PackRequest(cpu_milli=1000, gpus=1, slices=4, owner="llm-b")
    np.testing.assert_allclose(owner_spread_change(state, req, enumerate_candidates(state, req)), [0.0])


def test_mig_counts_only_instances_of_the_pods_size_on_the_same_gpu() -> None:
    # Node 0's GPU: instances of 1, 1 and 2 slices; node 1's GPU: 1 and 4. A 1-slice pod on node 0
    # closes the other 1-slice instance to its owner; the 2- and 4-slice ones never took it.
    nodes = [NodeSpec("n0", 64000, 256000, "H100"), NodeSpec("n1", 64000, 256000, "H100")]
    units = [UnitSpec(0, 0, KIND_MIG, c) for c in (1, 1, 2)] + [UnitSpec(1, 0, KIND_MIG, c) for c in (1, 4)]
    state = ClusterState(nodes, units, slices_per_gpu=7, allow_mps_multi=True)
    cands = enumerate_candidates(state, POD)
    np.testing.assert_allclose(owner_spread_change(state, POD, cands), np.where(cands.node == 0, 1.0, 0.0))


def test_owner_share_is_the_owners_part_of_the_pods_seen() -> None:
    other = PackRequest(cpu_milli=1000, memory_mib=1024, gpus=1, slices=1, owner="llm-other")
    target = TargetWorkload()
    for r in [POD, POD, POD, other, PackRequest(cpu_milli=1000)]:
        target.observe(r)
    assert target.owner_share("llm-a") == 0.6
    assert target.owner_share("llm-other") == 0.2
    assert target.owner_share("") == 0.0
    assert target.owner_share("never-seen") == 0.0


def test_the_owner_spread_change_weighs_on_mps_but_not_on_mig() -> None:
    seen = [POD] * 4
    pol = Fragmentation()
    # MPS: the owner's later pods could have shared the idle slices its pod closes (6 on node 0's
    # idle GPU, 2 on node 1's): weighted by the owner's share of the pods seen (all of them here).
    mps = cluster([[7], [3]], slices=7)
    cands = enumerate_candidates(mps, POD)
    terms = pol._owner_terms(mps, POD, cands, learned(pol, seen).target)
    np.testing.assert_allclose(terms, np.where(cands.node == 0, 6.0, 2.0))
    # MIG: one pod per GPU, so the owner's reach loses one GPU wherever its pod goes; the idle
    # instances it closes to itself count for nothing, and the pick is the rest of the policy's.
    nodes = [NodeSpec("n0", 64000, 256000, "H100"), NodeSpec("n1", 64000, 256000, "H100")]
    units = [UnitSpec(0, 0, KIND_MIG, c) for c in (1, 1)] + [UnitSpec(1, 0, KIND_MIG, c) for c in (1, 2)]
    mig = ClusterState(nodes, units, slices_per_gpu=7, allow_mps_multi=True)
    cands = enumerate_candidates(mig, POD)
    np.testing.assert_allclose(pol._owner_terms(mig, POD, cands, learned(pol, seen).target), 0.0)
    assert pick(pol, mig, POD, seen) == pick(Fragmentation(owner_weight=0.0), mig, POD, seen)


def test_on_mig_another_owners_reach_weighs_as_likely_as_it_is_to_be_missed() -> None:
    # Owner A (ten 3-slice pods seen) fits one pod per GPU. GPU 0 has one 3g instance and already
    # runs a pod on its 1g; GPU 1 has two 3g instances and is idle. B's pod on GPU 0 takes the last
    # unit A fits there; on GPU 1 it leaves A the other 3g. A's pods to come outnumber the GPUs it
    # still fits, so that loss is near certain and outweighs opening an idle GPU: B goes to GPU 1
    # (with A's share, 10/11, as the weight it went to GPU 0, the GPU in use).
    a = PackRequest(cpu_milli=1000, gpus=1, slices=3, owner="llm-a")
    b = PackRequest(cpu_milli=1000, gpus=1, slices=3, owner="llm-b")
    state = _mig([[3, 1], [3, 3]])
    state.take(0, [1], 1, 1000, 0, "other")
    seen = [a] * 10 + [b]
    pol = Fragmentation()
    target = learned(pol, seen).target
    assert owner_reach_weight(state, target, a) == 1.0  # 10 pods x 9 free slices / 31 asked, over 2 GPUs
    assert pick(pol, state, b, seen) == 1
    # A small owner among many free slices: E / R below 1.
    few = [a] + [PackRequest(cpu_milli=1000, gpus=1, slices=1, owner=f"x{i}") for i in range(20)]
    target = learned(pol, few).target
    np.testing.assert_allclose(owner_reach_weight(state, target, a), 1 * 9 / 23 / 2)


def test_on_mig_another_owners_reach_is_the_mix_of_the_shapes_its_pods_ask() -> None:
    # Owner A's 3-slice pods: nine without a memory floor, one with a floor no 3g instance here
    # meets. GPU 0: one 3g (its 1g in use); GPU 1: two idle 3g. B's pod on GPU 0 takes the last 3g
    # there, which nine in ten of A's next pods fit: that is the loss, whatever order A's pods came
    # in (A's last pod alone would say all of it or none), and B goes to GPU 1.
    nodes = [NodeSpec(f"n{i}", 64000, 256000, "H100") for i in range(2)]
    units = [UnitSpec(0, 0, KIND_MIG, 3, memory_mib=40000), UnitSpec(0, 0, KIND_MIG, 1, memory_mib=10000),
             UnitSpec(1, 0, KIND_MIG, 3, memory_mib=40000), UnitSpec(1, 0, KIND_MIG, 3, memory_mib=40000)]
    state = ClusterState(nodes, units, slices_per_gpu=7, allow_mps_multi=True)
    state.take(0, [1], 1, 1000, 0, "other")
    a = PackRequest(cpu_milli=1000, gpus=1, slices=3, owner="llm-a")
    floored = replace(a, gpu_memory_mib=50000)
    b = PackRequest(cpu_milli=1000, gpus=1, slices=3, owner="llm-b")
    pol = Fragmentation()
    cands = enumerate_candidates(state, b)
    for seen in ([a] * 9 + [floored, b], [floored] + [a] * 9 + [b]):
        target = learned(pol, seen).target
        # A's weight is 1: 10 pods x 9 free slices / 33 asked outnumber the 2 GPUs it fits
        np.testing.assert_allclose(pol._owner_terms(state, b, cands, target), np.where(cands.node == 0, 0.9 * 3, 0.0))
        assert pick(pol, state, b, seen) == 1
    # Every pod of A with the floor: no 3g here is in its reach, so there is nothing to lose.
    target = learned(pol, [floored] * 10 + [b]).target
    np.testing.assert_allclose(pol._owner_terms(state, b, cands, target), 0.0)


def test_an_owner_keeps_the_mix_of_its_single_gpu_shapes() -> None:
    target = TargetWorkload(aware=True)  # as the policy's: shapes keep their memory floor
    for floor in (0, 20000, 0, 0):
        target.observe(PackRequest(cpu_milli=1000, gpus=1, slices=1, gpu_memory_mib=floor, owner="a"))
    target.observe(PackRequest(cpu_milli=1000, gpus=2, slices=7, owner="a"))  # multi-GPU: not in the mix
    mix = target.owner_mixture("a")
    assert {shape.gpu_memory_mib: part for part, shape in mix} == {0: 0.75, 20000: 0.25}
    assert all(shape.owner == "a" and shape.gpus == 1 and shape.cpu_milli == 0 for _, shape in mix)
    assert target.owner_mixture("never-seen") == []
    # More distinct shapes than OWNER_SHAPES: the first ones go on counting, later ones are ignored.
    for floor in [*range(1, 3 * OWNER_SHAPES), 1, 1]:
        target.observe(PackRequest(gpus=1, slices=1, gpu_memory_mib=floor, owner="b"))
    mix = target.owner_mixture("b")
    assert sorted(shape.gpu_memory_mib for _, shape in mix) == list(range(1, OWNER_SHAPES + 1))
    assert {shape.gpu_memory_mib: part for part, shape in mix}[1] == 3 / (OWNER_SHAPES + 2)


def _mig(layouts: list[list[int]]) -> ClusterState:
    """One node per layout, one MIG GPU per node with instances of those sizes."""
    nodes = [NodeSpec(f"n{i}", 64000, 256000, "H100") for i in range(len(layouts))]
    units = [UnitSpec(i, 0, KIND_MIG, c) for i, sizes in enumerate(layouts) for c in sizes]
    return ClusterState(nodes, units, slices_per_gpu=7, allow_mps_multi=True)


def test_reach_counts_the_last_unit_another_owner_fits_on_a_gpu() -> None:
    # Node 0's GPU keeps a second 1-slice instance for the other owner, node 1's has one only.
    state = _mig([[1, 1], [1, 2]])
    other = PackRequest(cpu_milli=1000, gpus=1, slices=1, owner="llm-b")
    cands = enumerate_candidates(state, POD)
    change = owner_reach_change(state, POD, cands, [(0.25, other)])
    np.testing.assert_allclose(change, np.where(cands.node == 1, 0.25, 0.0))
    # A GPU that already holds the other owner was out of its reach: nothing more to lose there.
    state.take(1, [int(state.node_units[1][1])], 2, 1000, 0, "llm-b")
    cands = enumerate_candidates(state, POD)
    np.testing.assert_allclose(owner_reach_change(state, POD, cands, [(0.25, other)]), 0.0)


def test_reach_on_mps_counts_only_what_the_other_owner_no_longer_fits() -> None:
    # 3 free slices: a 1-slice pod leaves 2, where a 2-slice owner still fits and a 3-slice one not.
    state = cluster([[3]], slices=7)
    cands = enumerate_candidates(state, POD)
    two = PackRequest(cpu_milli=1000, gpus=1, slices=2, owner="llm-2")
    three = PackRequest(cpu_milli=1000, gpus=1, slices=3, owner="llm-3")
    np.testing.assert_allclose(owner_reach_change(state, POD, cands, [(0.5, two), (0.1, three)]), [0.3])


def test_other_owners_are_the_largest_single_gpu_ones_but_the_pods_own() -> None:
    target = TargetWorkload()
    pods = ([POD] * 5 + [PackRequest(gpus=1, slices=2, owner="b")] * 3 + [PackRequest(gpus=1, slices=3, owner="c")]
            + [PackRequest(gpus=2, slices=7, owner="multi")] * 4 + [PackRequest(cpu_milli=10)] * 87)
    for r in pods:
        target.observe(r)
    assert target.other_owners("llm-a", 8, 0.01) == [(0.03, "b"), (0.01, "c")]
    assert [o for _, o in target.other_owners("llm-a", 1, 0.01)] == ["b"]
    assert [o for _, o in target.other_owners("llm-a", 8, 0.02)] == ["b"]
    assert [o for _, o in target.other_owners("b", 8, 0.01)] == ["llm-a", "c"]


def test_an_owner_whose_last_pod_took_two_gpus_still_counts_by_its_single_gpu_pods() -> None:
    # Owner "d" asks mostly one GPU; its latest pod happened to ask two. Its reach is still the
    # GPUs its single-GPU pods fit, so it stays among the other owners; "multi" never asked one.
    target = TargetWorkload()
    pods = ([PackRequest(gpus=1, slices=2, owner="d")] * 3 + [PackRequest(gpus=2, slices=7, owner="d")]
            + [PackRequest(gpus=2, slices=7, owner="multi")] * 5 + [PackRequest(cpu_milli=10)] * 91)
    for r in pods:
        target.observe(r)
    assert target.other_owners("llm-a", 8, 0.01) == [(0.04, "d")]
    assert [(part, shape.slices) for part, shape in target.owner_mixture("d")] == [(1.0, 2)]


def test_unit_accepts_on_rows_matches_the_full_vector() -> None:
    state = _mig([[1, 1, 2], [1, 2, 4], [7]])
    state.take(0, [0], 1, 1000, 0, "llm-a")
    rows = np.array([5, 0, 3, -1, 2, 6, 1, 4], dtype=np.int64)
    for req in (POD, PackRequest(gpus=1, slices=2), PackRequest(gpus=1, slices=7, gpu_memory_mib=1),
                PackRequest(gpus=1, slices=1, owner="llm-b", isolation="mps")):
        np.testing.assert_array_equal(state.unit_accepts(req, rows), state.unit_accepts(req)[rows])


def test_reach_terms_give_the_same_figures_from_the_callers_acceptance_scan() -> None:
    # _owner_terms scans each other shape's units once and hands the vector to both reach functions.
    state = _mig([[1, 1, 2], [1, 2, 4], [1, 1]])
    state.take(0, [0], 1, 1000, 0, "llm-b")
    target = TargetWorkload()
    others = [PackRequest(cpu_milli=1000, gpus=1, slices=1, owner="llm-b"),
              PackRequest(cpu_milli=1000, gpus=1, slices=2, owner="llm-c")]
    for r in [POD] * 4 + others * 3:
        target.observe(r)
    cands = enumerate_candidates(state, POD)
    weighted = [(0.25, others[0]), (np.linspace(0.1, 0.5, len(cands)), others[1])]
    scans = [state.unit_accepts(o) for o in others]
    np.testing.assert_array_equal(owner_reach_change(state, POD, cands, weighted, scans),
                                  owner_reach_change(state, POD, cands, weighted))
    assert owner_reach_change(state, POD, cands, weighted).any()  # the case is not trivially zero
    for o, acc in zip(others, scans, strict=True):
        assert owner_reach_weight(state, target, o, accepts=acc) == owner_reach_weight(state, target, o)


def test_the_tracked_owners_are_the_largest_however_many_owners_come_and_go() -> None:
    # 40 owners with distinct final counts, their pods interleaved in a shuffled order: the target
    # keeps exactly the TRACKED_OWNERS largest, and no others, each with its one shape.
    rng = np.random.default_rng(7)
    arrivals = [f"rs-{i:02d}" for i in range(40) for _ in range(i + 1)]
    rng.shuffle(arrivals)
    target = TargetWorkload()
    for n, owner in enumerate(arrivals):
        target.observe(PackRequest(cpu_milli=n, gpus=1, slices=1, owner=owner))
    largest = {f"rs-{i:02d}" for i in range(40 - TRACKED_OWNERS, 40)}
    assert set(target.owner_shapes) == largest  # an owner dropped takes its shapes with it
    ranked = target.other_owners("", TRACKED_OWNERS, 0.0)  # their counts, largest first
    assert [round(share * target.seen) for share, _ in ranked] == list(range(40, 40 - TRACKED_OWNERS, -1))
    assert all([(part, shape.owner, shape.slices) for part, shape in target.owner_mixture(o)] == [(1.0, o, 1)]
               for o in largest)
    assert target.owner_mixture("rs-00") == []  # not tracked
    assert OWNER_LIMIT < TRACKED_OWNERS  # the policy asks for fewer owners than the target keeps
