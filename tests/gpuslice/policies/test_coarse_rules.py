"""``fragmentation`` decides from the state and the learned pod shapes only: no history switch.

A scheduler in a live cluster restarts and sees pods leave all the time; the policy must score a
state the same whether capacity was freed before or not, and after a warm-started restart."""

from __future__ import annotations

import numpy as np

from gpuslice.packing.state import (
    KIND_MIG,
    KIND_MPS,
    ClusterState,
    NodeSpec,
    PackRequest,
    UnitSpec,
    enumerate_candidates,
)
from gpuslice.policies import _slice_terms as slice_terms
from gpuslice.policies.fragmentation import Fragmentation

from .helpers import learned

GIB = 1024


def _mixed_state() -> ClusterState:
    """Two nodes: MIG H100s (3g+2g+1g+1g per GPU) and MPS H100s, some slices in use on each."""
    nodes = [NodeSpec("mig", 64000, 256000, "H100-80GB"), NodeSpec("mps", 64000, 256000, "H100-80GB")]
    units: list[UnitSpec] = []
    for g in range(4):
        units += [UnitSpec(0, g, KIND_MIG, k, 10 * GIB * k) for k in (3, 2, 1, 1)]
    units += [UnitSpec(1, g, KIND_MPS, 7, 80 * GIB) for g in range(4)]
    state = ClusterState(nodes, units, slices_per_gpu=7)
    state.take(0, [0], 3, 0, 0)      # GPU 0 of the MIG node runs a 3g pod
    state.take(1, [16], 4, 0, 0)     # MPS GPU 0: 3 of 7 free
    state.take(1, [17], 6, 0, 0)     # MPS GPU 1: 1 of 7 free
    return state


def test_freed_capacity_does_not_change_how_a_state_is_scored() -> None:
    pol = Fragmentation()
    rng = np.random.default_rng(3)
    seen = [PackRequest(gpus=1, slices=int(k)) for k in rng.integers(1, 8, size=40)]
    state = _mixed_state()
    mem = learned(pol, seen)
    reqs = [PackRequest(gpus=1, slices=k) for k in (1, 2, 3)]
    before = [pol.score(state, r, enumerate_candidates(state, r), mem) for r in reqs]
    # a pod arrives on MPS GPU 2 and leaves again: the same state, capacity seen freed
    state.take(1, [18], 5, 0, 0)
    for r in reqs:
        pol.score(state, r, enumerate_candidates(state, r), mem)
    state.give_back(1, [18], 5, 0, 0)
    after = [pol.score(state, r, enumerate_candidates(state, r), mem) for r in reqs]
    restarted = learned(pol, seen)  # a restart that warm-started the same shapes
    again = [pol.score(state, r, enumerate_candidates(state, r), restarted) for r in reqs]
    for b, a, g in zip(before, after, again, strict=True):
        assert np.array_equal(b, a) and np.array_equal(b, g)


def _two_mig_gpus() -> ClusterState:
    """One node, two MIG GPUs of 2g+1g+1g; GPU 1 runs a pod on one 1g instance."""
    nodes = [NodeSpec("n0", 64000, 256000, "H100-80GB")]
    units = [UnitSpec(0, g, KIND_MIG, k, 10 * GIB * k) for g in range(2) for k in (2, 1, 1)]
    state = ClusterState(nodes, units, slices_per_gpu=7)
    state.take(0, [4], 1, 0, 0)
    return state


def test_mig_pod_prefers_an_instance_on_a_gpu_in_use() -> None:
    # Nine 2-slice pods seen for every 1-slice one: the 2g instances will be filled, the 1g ones
    # mostly not, so a 1g pod on the idle GPU would strand its other 1g instance.
    state = _two_mig_gpus()
    req = PackRequest(gpus=1, slices=1, gpu_memory_mib=8 * GIB)
    seen = [req] + [PackRequest(gpus=1, slices=2)] * 9
    pol = Fragmentation()
    mem = learned(pol, seen)
    fill = slice_terms.instance_fill(state, mem.target)  # 7 free slices; 1g: 1 x 7 / 19 of 3 free
    np.testing.assert_allclose(fill[1:3], [7 / 19 / 3, 1.0])
    cands = enumerate_candidates(state, req)
    change = slice_terms.mig_stranded_change(state, req, cands, mem.target)
    gpu = state.unit_gpu_id[cands.units[:, 0]]
    np.testing.assert_allclose(change, np.where(gpu == 1, -(1 - fill[1]), 1 - fill[1]))  # the other 1g
    score = pol.score(state, req, cands, mem)
    assert gpu[int(np.argmax(score))] == 1


def test_mig_instances_the_demand_fills_strand_nothing() -> None:
    # Only 1-slice pods seen, and 1g instances to hold them: every free 1g instance is expected to
    # be filled, so neither GPU strands anything; the 2g instances nobody asks for weigh in full.
    state = _two_mig_gpus()
    req = PackRequest(gpus=1, slices=1)
    mem = learned(Fragmentation(), [req] * 3)
    fill = slice_terms.instance_fill(state, mem.target)
    np.testing.assert_allclose(fill[1:3], [1.0, 0.0])
    cands = enumerate_candidates(state, req)
    gpu = state.unit_gpu_id[cands.units[:, 0]]
    np.testing.assert_allclose(slice_terms.mig_stranded_change(state, req, cands, mem.target),
                               np.where(gpu == 1, 0.0, 2.0))
    # MPS-only shapes do not count as demand for MIG instances, and before any GPU pod nothing does.
    mps_only = learned(Fragmentation(), [PackRequest(gpus=1, slices=1, isolation="mps")] * 3)
    np.testing.assert_allclose(slice_terms.instance_fill(state, mps_only.target)[1:3], 0.0)
    np.testing.assert_allclose(slice_terms.instance_fill(state, learned(Fragmentation(), []).target)[1:3], 0.0)


def test_window_follows_slice_granularity_only() -> None:
    assert Fragmentation().window_for(1000) == 10
    assert Fragmentation().window_for(7) == 0
    assert Fragmentation(window=3).window_for(7) == 3


def test_instance_sizes_come_from_the_live_layout() -> None:
    # A GPU re-laid out from 3g+3g+1g to seven 1g instances: its retired 3g rows no longer make
    # 3-slice pods count as MIG demand, so the 1g instances are the only MIG size there is.
    nodes = [NodeSpec("n0", 64000, 256000, "H100-80GB")]
    state = ClusterState(nodes, [UnitSpec(0, 0, KIND_MIG, k) for k in (3, 3, 1)], slices_per_gpu=7)
    mem = learned(Fragmentation(), [PackRequest(gpus=1, slices=3)] * 6 + [PackRequest(gpus=1, slices=1)])
    before = slice_terms.instance_fill(state, mem.target)
    np.testing.assert_allclose(before[[1, 3]], [7 / 19, 1.0])  # 7 free slices; 1 of 19 asked is 1-slice
    state.replace_units(0, [UnitSpec(0, 0, KIND_MIG, 1) for _ in range(7)])
    after = slice_terms.instance_fill(state, mem.target)
    assert after.shape[0] == 2
    np.testing.assert_allclose(after[1], 1.0)
