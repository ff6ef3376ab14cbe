"""``fragmentation`` point 8: the hosts a learned multi-GPU shape has left."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from gpuslice.packing.frag import TargetWorkload
from gpuslice.packing.state import KIND_MPS, ClusterState, PackRequest, UnitSpec, enumerate_candidates
from gpuslice.policies._shape_reach import _host_counts, multi_gpu_shapes, poisson_tail, shape_reach_change
from gpuslice.policies.fragmentation import Fragmentation, usable_free_slices

from .helpers import cluster, pick

SMALL = PackRequest(cpu_milli=1000, memory_mib=1024, gpus=1, slices=1)
TWO = PackRequest(cpu_milli=1000, memory_mib=1024, gpus=1, slices=2)
PAIR = PackRequest(cpu_milli=1000, memory_mib=1024, gpus=2, slices=7)


def _target(seen: list[PackRequest]) -> TargetWorkload:
    target = TargetWorkload(aware=True)
    for r in seen:
        target.observe(r)
    return target


def test_poisson_tail_matches_the_closed_form() -> None:
    assert poisson_tail(3.0, 0) == 1.0
    assert poisson_tail(0.0, 2) == 0.0
    assert poisson_tail(3.0, 1) == pytest.approx(1.0 - math.exp(-3.0))
    assert poisson_tail(2.0, 3) == pytest.approx(1.0 - math.exp(-2.0) * (1.0 + 2.0 + 2.0))
    tails = [poisson_tail(4.0, r) for r in range(12)]
    assert all(a > b for a, b in itertools.pairwise(tails))
    assert poisson_tail(2.0, 200) < 1e-12


def test_shapes_that_differ_only_in_cpu_are_one_shape() -> None:
    wide = PackRequest(cpu_milli=8000, memory_mib=1024, gpus=2, slices=7)
    assert _target([PAIR, wide, PAIR, SMALL]).multi_gpu == {PackRequest(gpus=2, slices=7): 3}


def test_ending_the_last_host_costs_the_shapes_slices_times_the_chance_it_is_needed() -> None:
    # Node 0: two idle 7-slice GPUs, the only host of a 2 x 7 pod; node 1: one idle GPU.
    state = cluster([[7, 7], [7]], slices=7)
    target = _target([SMALL] * 9 + [PAIR])
    cands = enumerate_candidates(state, SMALL)
    free = usable_free_slices(state)
    expected = 1 * free / target.gpu_slices  # the pair's pods to come: its one pod seen x free / asked
    cost = shape_reach_change(state, SMALL, cands, target, free)
    np.testing.assert_allclose(cost, np.where(cands.node == 0, 14.0 * poisson_tail(expected, 1), 0.0))
    assert cost.max() > 0.0


def test_many_hosts_against_few_expected_pods_cost_nothing() -> None:
    state = cluster([[7, 7]] * 40, slices=7)
    target = _target([SMALL] * 99 + [PAIR])
    cands = enumerate_candidates(state, SMALL)
    np.testing.assert_allclose(shape_reach_change(state, SMALL, cands, target, usable_free_slices(state)), 0.0)


def test_a_pod_of_the_shape_itself_pays_nothing_for_using_a_host() -> None:
    state = cluster([[7, 7], [7, 7]], slices=7)
    target = _target([SMALL] * 9 + [PAIR])
    cands = enumerate_candidates(state, PAIR)
    np.testing.assert_allclose(shape_reach_change(state, PAIR, cands, target, usable_free_slices(state)), 0.0)


#: One pod in a hundred asks two GPUs; the rest one or two slices of one.
SEEN = [SMALL] * 60 + [TWO] * 39 + [PAIR]


def test_the_policy_keeps_the_last_host_where_fgd_alone_would_break_it() -> None:
    # Node 1's two free slices are a better home for a 2-slice pod than for this 1-slice one, so
    # the rest of the policy puts it on node 0, the only node with two idle GPUs. One pod in a
    # hundred has asked for two of them; the term keeps that node whole. (Point 10, Any-Fit, would
    # keep it too, as node 1's GPU is in use: it is off here so that the term is tested alone.)
    state = cluster([[7, 7], [2]], slices=7)
    assert pick(Fragmentation(shape_reach_weight=0.0, any_fit=False), state, SMALL, SEEN) == 0
    assert pick(Fragmentation(any_fit=False), state, SMALL, SEEN) == 1
    assert pick(Fragmentation(), state, SMALL, SEEN) == 1


def test_each_size_no_pod_has_asked_yet_counts_as_three_pods_once_multi_gpu_pods_are_seen() -> None:
    state = cluster([[7, 7, 7, 7], [7, 7]], slices=7)  # the largest node has 4 GPUs
    pair = PackRequest(gpus=2, slices=7)
    assert multi_gpu_shapes(state, _target([SMALL] * 9 + [PAIR])) == {
        pair: 1.0, PackRequest(gpus=3, slices=7): 3.0, PackRequest(gpus=4, slices=7): 3.0}
    assert multi_gpu_shapes(state, _target([SMALL] * 9 + [PAIR]), unseen=0.0) == {pair: 1.0}
    assert multi_gpu_shapes(state, _target([SMALL] * 10)) == {}  # no multi-GPU pod seen: none assumed


def test_the_policy_keeps_the_last_host_of_a_size_not_seen_yet() -> None:
    # Node 0 is the only node with four idle GPUs. The pods seen ask one slice, two slices or two
    # GPUs, never four, and the rest of the policy would break node 0 up (node 1's two free slices
    # suit a 2-slice pod better); with 100 pods seen, a 4-GPU pod cannot be ruled out. (Any-Fit is
    # off so that the rule of three is tested alone: node 1's GPU in use would keep the pod too.)
    state = cluster([[7, 7, 7, 7], [2, 7, 7]], slices=7)
    assert pick(Fragmentation(unseen_bound=0.0, any_fit=False), state, SMALL, SEEN) == 0
    assert pick(Fragmentation(any_fit=False), state, SMALL, SEEN) == 1
    assert pick(Fragmentation(), state, SMALL, SEEN) == 1


def test_host_counts_kept_per_state_match_a_full_pass_after_every_change() -> None:
    state = cluster([[7, 7], [7, 7, 7], [7]], slices=7)
    shape = PackRequest(gpus=2, slices=7)

    def fresh(st: ClusterState) -> list[int]:
        return [int(x) for x in st.unit_accepts(shape)[st.node_units].sum(axis=1)]

    def kept(st: ClusterState) -> list[int]:
        return [int(x) for x in _host_counts(st).per_node(st, shape)]

    assert kept(state) == fresh(state) == [2, 3, 1]
    state.take(1, [2], 1, 0, 0)
    assert kept(state) == fresh(state) == [2, 2, 1]
    state.take(0, [0], 7, 0, 0)
    state.give_back(1, [2], 1, 0, 0)
    assert kept(state) == fresh(state) == [1, 3, 1]
    state.set_units_usable([3], [False])
    assert kept(state) == fresh(state) == [1, 2, 1]
    state.replace_units(2, [UnitSpec(2, g, KIND_MPS, 7) for g in range(4)])
    assert kept(state) == fresh(state) == [1, 2, 4]
