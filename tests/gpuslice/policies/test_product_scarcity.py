"""Product scarcity: pods that may use any GPU product leave the products that pinned pods need.

The balanced load of :mod:`gpuslice.packing.scarcity` is checked against its optimality conditions,
and the policy term against small clusters where only it can tell two nodes apart."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice.packing.scarcity import load_ratios
from gpuslice.packing.state import ClusterState, PackRequest, enumerate_candidates
from gpuslice.policies.fragmentation import Fragmentation
from tests.gpuslice.policies.helpers import cluster, learned


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), groups=st.integers(1, 12), products=st.integers(1, 6))
def test_balanced_loads_meet_the_optimality_conditions(seed: int, groups: int, products: int) -> None:
    rng = np.random.default_rng(seed)
    demand = rng.uniform(0.0, 10.0, size=groups)
    eligible = rng.random((groups, products)) < 0.5
    eligible[rng.integers(groups)] = True  # an unrestricted group
    capacity = rng.uniform(0.5, 20.0, size=products)
    ratios, x = load_ratios(demand, eligible, capacity)
    served = np.where(eligible.any(axis=1), demand, 0.0)  # a group no product may host is dropped
    scale = capacity.sum() / served.sum()
    np.testing.assert_allclose(x.sum(axis=1), served * scale, rtol=1e-9, atol=1e-9)
    assert (x[~eligible] == 0).all() and (x >= 0).all()
    np.testing.assert_allclose(ratios, x.sum(axis=0) / capacity, rtol=1e-9)
    tol = 1e-4 * ratios.max()
    for g in range(groups):
        if served[g] <= 0:
            continue
        lowest = ratios[eligible[g]].min()
        # a group's demand sits only on the least loaded products it may use (else moving some of
        # it would lower the sum of load^2 / capacity)
        assert (ratios[(x[g] > 1e-9 * scale)] <= lowest + tol).all()


def test_unpinned_demand_loads_every_product_alike() -> None:
    ratios, _ = load_ratios(np.array([5.0]), np.ones((1, 3), dtype=bool), np.array([1.0, 4.0, 10.0]))
    np.testing.assert_allclose(ratios, 1.0)


def test_a_product_asked_for_beyond_its_share_is_loaded_above_the_rest() -> None:
    # half the demand may use only product 0, which has a fifth of the capacity
    ratios, _ = load_ratios(np.array([5.0, 5.0]), np.array([[True, False], [True, True]]), np.array([2.0, 8.0]))
    assert ratios[0] > 1.0 > ratios[1]
    np.testing.assert_allclose(ratios, [2.5, 0.625])


ANY = PackRequest(cpu_milli=1000, gpus=1, slices=500)
T4_ONLY = PackRequest(cpu_milli=1000, gpus=1, slices=500, products=frozenset({"T4"}))
G2_ONLY = PackRequest(cpu_milli=1000, gpus=1, slices=500, products=frozenset({"G2"}))
#: As many pods pinned to each product, so every node's FGD delta is the same; but T4 has a third of
#: G2's capacity, so its pinned demand loads it far more.
SEEN = [T4_ONLY] * 3 + [G2_ONLY] * 3 + [ANY] * 4


def _two_products() -> ClusterState:
    """Three G2 nodes and one T4 node, 2 idle GPUs each."""
    return cluster([[1000, 1000]] * 4, products=["G2", "G2", "G2", "T4"])


def test_an_unpinned_pod_leaves_the_product_that_pinned_pods_need() -> None:
    state = _two_products()
    cands = enumerate_candidates(state, ANY)
    t4 = np.asarray(cands.node) == 3
    on = Fragmentation()
    score = on.score(state, ANY, cands, learned(on, SEEN))
    assert score[~t4].min() > score[t4].max()
    off = Fragmentation(scarcity_gain=0.0, pinned_weight=0.0)  # without the terms every node scores alike
    plain = off.score(state, ANY, cands, learned(off, SEEN))
    assert plain.min() == plain.max()


def test_pinned_pods_and_unpinned_workloads_are_scored_as_without_the_term() -> None:
    state = _two_products()
    for req, seen in ((T4_ONLY, SEEN), (ANY, [ANY] * 10)):
        cands = enumerate_candidates(state, req)
        on, off = Fragmentation(), Fragmentation(scarcity_gain=0.0, pinned_weight=0.0)
        a = on.score(state, req, cands, learned(on, seen))
        b = off.score(state, req, cands, learned(off, seen))
        assert np.array_equal(a, b)


def test_at_equal_loads_an_unpinned_pod_leaves_the_product_whose_capacity_pinned_pods_hold() -> None:
    # One pod in ten pinned to each product: FGD sees every node alike. Unpinned demand levels
    # both products, but pinned demand holds 0.8 of T4's 2 GPUs' worth against 0.8 of G2's 6.
    state = cluster([[1000, 1000]] * 4, products=["G2", "G2", "G2", "T4"])
    seen = [T4_ONLY, G2_ONLY] + [ANY] * 8
    cands = enumerate_candidates(state, ANY)
    t4 = np.asarray(cands.node) == 3
    pol = Fragmentation()
    mem = learned(pol, seen)
    score = pol.score(state, ANY, cands, mem)
    np.testing.assert_allclose(mem.loads.ratios, 1.0)
    np.testing.assert_allclose(mem.loads.pinned, [0.8 / 6, 0.8 / 2])
    assert score[~t4].min() > score[t4].max()
    off = Fragmentation(pinned_weight=0.0)
    plain = off.score(state, ANY, cands, learned(off, seen))
    assert plain.min() == plain.max()
