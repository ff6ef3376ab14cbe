"""The decision building blocks: fit, narrowed filter, 0..10 mapping, kube-scheduler's pick, and the
array-level reasons and reservations as the simulator uses them (gpuslice.scheduler.PackedCluster)."""

from __future__ import annotations

import numpy as np
import pytest

from gpuslice.decision import (
    NarrowConfig,
    NodeBest,
    best_per_node,
    kube_select,
    narrowed_filter,
    node_order,
    paper_choice,
    priority_scores,
)
from gpuslice.packing.errors import PackingError
from gpuslice.packing.state import (
    KIND_MIG,
    KIND_MPS,
    KIND_WHOLE,
    ClusterState,
    NodeSpec,
    PackRequest,
    UnitSpec,
    enumerate_candidates,
)
from gpuslice.reasons import explain
from gpuslice.reservations import Reservation
from gpuslice.scheduler import PackedCluster


def filter_reasons(state: ClusterState, req: PackRequest) -> dict[int, str]:
    fit = state.fit(req)
    bad = np.flatnonzero(~fit.feasible).astype(np.int64)
    return dict(zip(bad.tolist(), explain(state, req, fit, bad).texts, strict=True))


def small() -> ClusterState:
    nodes = [NodeSpec("a", 4000, 16000, "T4"), NodeSpec("b", 64000, 256000, "G2"),
             NodeSpec("c", 64000, 256000, "A100")]
    units = [UnitSpec(0, 0, KIND_MPS, 1000), UnitSpec(1, 0, KIND_MPS, 1000, free=200),
             UnitSpec(1, 1, KIND_MPS, 1000, free=100), UnitSpec(2, 0, KIND_MIG, 3, memory_mib=20000),
             UnitSpec(2, 0, KIND_MIG, 2, memory_mib=10000)]
    return ClusterState(nodes, units, slices_per_gpu=1000)


def test_reasons_name_the_missing_resource() -> None:
    state = small()
    req = PackRequest(cpu_milli=8000, memory_mib=1000, gpus=1, slices=300, products=frozenset({"T4", "G2"}))
    reasons = filter_reasons(state, req)
    assert set(reasons) == {0, 1, 2}
    assert reasons[0] == "node has 4000m allocatable CPU, the pod asks 8000m"
    assert reasons[1] == "slices in use: no fitting GPU has 300 free slices (at most 200 of 1000 free)"
    assert reasons[2] == "GPU product A100 is not among the pod's allowed products (G2, T4)"


def test_mig_units_need_exact_size_and_reason_says_so() -> None:
    state = small()
    ok = enumerate_candidates(state, PackRequest(gpus=1, slices=3, isolation="mig"))
    assert ok.node.tolist() == [2] and state.unit_cap[ok.units[0, 0]] == 3
    reasons = filter_reasons(state, PackRequest(gpus=1, slices=1, isolation="mig"))
    assert reasons[2] == ("no GPU here can take exactly 1 slices: no MIG instance here has 1 compute slices "
                          "(instances here: 2, 3; the layout would have to change)")
    assert reasons[0] == "pod asks mig isolation and the node has no MIG instances (modes here: mps)"


def test_whole_gpus_only_taken_whole_and_multi_gpu_only_on_whole_mode() -> None:
    nodes = [NodeSpec("w", 64000, 256000, "H100")]
    units = [UnitSpec(0, g, KIND_WHOLE, 7) for g in range(2)] + [UnitSpec(0, 2, KIND_MPS, 7)]
    state = ClusterState(nodes, units, slices_per_gpu=7)
    assert len(enumerate_candidates(state, PackRequest(gpus=1, slices=3))) == 1  # only the MPS GPU
    assert len(enumerate_candidates(state, PackRequest(gpus=2, slices=7))) == 1
    assert len(enumerate_candidates(state, PackRequest(gpus=3, slices=7))) == 0  # MPS GPUs never give several


def test_owner_spread_rule_never_two_pods_of_an_owner_on_one_gpu() -> None:
    state = ClusterState([NodeSpec("n", 64000, 256000, "G2")], [UnitSpec(0, 0, KIND_MPS, 7)], slices_per_gpu=7)
    req = PackRequest(gpus=1, slices=1, owner="rs/web")
    state.take(0, [0], 1, 0, 0, owner="rs/web")
    assert len(enumerate_candidates(state, req)) == 0
    assert "owner-spread" in filter_reasons(state, req)[0]
    assert len(enumerate_candidates(state, PackRequest(gpus=1, slices=1, owner="rs/other"))) == 1
    assert len(enumerate_candidates(state, PackRequest(gpus=1, slices=1))) == 1


def test_narrowed_filter_margin_and_consistent_order() -> None:
    best = NodeBest(np.array([0, 1, 2, 3]), np.array([0, 1, 2, 3]), np.array([0.9, 0.95, 0.95, 0.5]))
    rank = np.array([0, 3, 1, 2])
    one = narrowed_filter(best, rank, NarrowConfig())
    assert one.node.tolist() == [2]  # tie between 1 and 2 goes to the lower rank
    wide = narrowed_filter(best, rank, NarrowConfig(margin=0.06, max_nodes=5))
    assert wide.node.tolist() == [0, 2, 1]  # within the margin all count as tied: node order alone
    assert narrowed_filter(best, rank, NarrowConfig(margin=0.06)).node.tolist() == [0]  # the margin matters
    with pytest.raises(PackingError):
        NarrowConfig(margin=-1)


def test_node_order_is_stable_and_not_grouped() -> None:
    names = [f"node-{i:04d}" for i in range(100)]
    r = node_order(names)
    assert sorted(r.tolist()) == list(range(100))
    assert np.array_equal(r, node_order(list(names)))
    assert not np.array_equal(r, np.arange(100))


def test_priority_scores_map_onto_0_to_10() -> None:
    assert priority_scores(np.array([0.8, 0.8, 0.2]), ranked=False).tolist() == [10, 10, 0]
    assert priority_scores(np.array([0.8, 0.8, 0.2])).tolist() == [10, 9, 0]
    assert priority_scores(np.array([0.5, 0.9, 0.7])).tolist() == [0, 10, 5]  # the best node, not the first
    assert priority_scores(np.array([0.5, 0.9, 0.7]), lead=2).tolist() == [0, 9, 10]
    assert priority_scores(np.array([0.3])).tolist() == [10]
    assert priority_scores(np.array([])).tolist() == []


def test_kube_select_breaks_ties_at_random() -> None:
    rng = np.random.default_rng(1)
    picks = {kube_select(np.array([10, 10, 3]), 1, None, rng) for _ in range(50)}
    assert picks == {0, 1}
    assert kube_select(np.array([10, 9]), 1, np.array([0, 50]), rng) == 1


def test_best_per_node_and_paper_choice() -> None:
    state = small()
    req = PackRequest(gpus=1, slices=100)
    cands = enumerate_candidates(state, req)
    score = np.array([0.504, 0.509, 0.5])  # node a pos 0, node b pos 0, node b pos 1
    best = best_per_node(cands, score)
    assert dict(zip(best.node.tolist(), best.index.tolist(), strict=True)) == {0: 0, 1: 1}
    # integer levels tie (50): the node order decides, then inside node b the secondary.
    assert paper_choice(cands, score, np.array([0.0, 0.0, 1.0]), np.array([1, 0, 2])) == 2


def test_reservations_count_until_bind_or_timeout() -> None:
    state = small()
    cluster = PackedCluster(state, reservation_ttl_s=10)
    r = Reservation("p1", "b", ((state.unit_gpu[1], ""),), 100, (), 100, 0, "", expires=10.0)
    cluster.hold(r)
    assert state.unit_free[1] == 100 and state.node_cpu_free[1] == 63900
    cluster.expire(5)
    assert "p1" in cluster.reservations
    cluster.expire(10)
    assert "p1" not in cluster.reservations and state.unit_free[1] == 200
    cluster.hold(r)
    assert cluster.bind("p1") is not None and state.unit_free[1] == 100 and not cluster.reservations.held
