"""DRA's device choice (first fit in a published order) and the order our policy publishes (issue 52)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice.packing.first_fit import PublishedOrder, first_fit_candidates
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
from gpuslice.policies.device_order import (
    COVERAGE,
    DeviceSteering,
    Representatives,
    node_orders,
    precedence_order,
)
from gpuslice.scheduler import PackedCluster, Scheduler

S = 7


def mps_state(free: list[list[int]]) -> ClusterState:
    """One node per inner list, one MPS GPU (S=7) per entry with that many free slices."""
    nodes = [NodeSpec(f"n{i}", 64000, 256000, "H100") for i in range(len(free))]
    units = [UnitSpec(i, g, KIND_MPS, S, memory_mib=81920, free=f) for i, row in enumerate(free)
             for g, f in enumerate(row)]
    return ClusterState(nodes, units, slices_per_gpu=S)


def one_gpu(slices: int, **kw: object) -> PackRequest:
    return PackRequest(gpus=1, slices=slices, **kw)  # type: ignore[arg-type]


def chosen_positions(state: ClusterState, req: PackRequest, order: PublishedOrder) -> dict[int, list[int]]:
    c = order.candidates(state, req, state.fit(req))
    return {int(v): [int(state.unit_pos[u]) for u in c.units[i]] for i, v in enumerate(c.node)}


# ----- first fit ---------------------------------------------------------------------------------

def test_first_fit_takes_the_first_fitting_device_in_the_published_order() -> None:
    state = mps_state([[7, 3, 5], [2, 7]])
    order = PublishedOrder(state)
    assert chosen_positions(state, one_gpu(3), order) == {0: [0], 1: [1]}  # the fixed order: positions
    rows = state.node_rows(0)
    order.publish(state, rows, np.array([2, 0, 1]))  # node 0 lists GPU 1, then GPU 2, then GPU 0
    assert chosen_positions(state, one_gpu(3), order) == {0: [1], 1: [1]}
    assert chosen_positions(state, one_gpu(4), order) == {0: [2], 1: [1]}  # GPU 1 has 3 free: skipped
    assert chosen_positions(state, one_gpu(6), order) == {0: [0], 1: [1]}
    assert chosen_positions(state, one_gpu(7), order) == {0: [0], 1: [1]}


def test_first_fit_gives_a_multi_gpu_pod_the_first_free_devices_in_order() -> None:
    nodes = [NodeSpec("w", 64000, 256000, "H100")]
    units = [UnitSpec(0, g, KIND_WHOLE, S, free=0 if g == 1 else S) for g in range(4)]
    state = ClusterState(nodes, units, slices_per_gpu=S)
    order = PublishedOrder(state)
    req = PackRequest(gpus=2, slices=S)
    assert chosen_positions(state, req, order) == {0: [0, 2]}
    order.publish(state, state.node_rows(0), np.array([3, 0, 1, 2]))  # listed: 1, 2, 3, 0
    assert chosen_positions(state, req, order) == {0: [2, 3]}  # GPU 1 is taken
    assert chosen_positions(state, PackRequest(gpus=4, slices=S), order) == {}


def test_first_fit_respects_the_fit_rule_and_leaves_cpu_only_pods_alone() -> None:
    nodes = [NodeSpec("m", 64000, 256000, "H100"), NodeSpec("p", 1000, 256000, "H100")]
    units = [UnitSpec(0, 0, KIND_MIG, 1, memory_mib=10240, instance="a"),
             UnitSpec(0, 0, KIND_MIG, 2, memory_mib=20480, instance="b"),
             UnitSpec(0, 1, KIND_MPS, S, memory_mib=81920),
             UnitSpec(1, 0, KIND_MPS, S, memory_mib=81920)]
    state = ClusterState(nodes, units, slices_per_gpu=S)
    order = PublishedOrder(state)
    order.publish(state, state.node_rows(0), np.array([2, 1, 0]))  # MPS GPU, 2g, 1g
    assert chosen_positions(state, one_gpu(2), order) == {0: [2], 1: [0]}
    assert chosen_positions(state, one_gpu(2, isolation="mig"), order) == {0: [1]}
    assert chosen_positions(state, one_gpu(1, isolation="mig"), order) == {0: [0]}
    assert chosen_positions(state, one_gpu(2, cpu_milli=2000), order) == {0: [2]}  # node p lacks the CPU
    cpu_only = PackRequest(cpu_milli=500)
    fit = state.fit(cpu_only)
    got, want = order.candidates(state, cpu_only, fit), enumerate_candidates(state, cpu_only, fit)
    assert got.node.tolist() == want.node.tolist() and got.units.shape == (2, 0)


def test_the_published_order_follows_a_growing_state() -> None:
    state = mps_state([[7, 7]])
    order = PublishedOrder(state)
    order.publish(state, state.node_rows(0), np.array([1, 0]))
    v = order.version
    row = state.add_node(NodeSpec("n9", 64000, 256000, "H100"),
                         [UnitSpec(0, g, KIND_MPS, S, memory_mib=81920) for g in range(3)])
    assert chosen_positions(state, one_gpu(1), order) == {0: [1], row: [0]}
    assert order.version > v
    other = mps_state([[7, 7]])
    assert first_fit_candidates(other, one_gpu(1), other.fit(one_gpu(1)), order.sync(other)).units.tolist() == [[0]]


# ----- the order -------------------------------------------------------------------------------

def test_precedence_puts_each_choice_first_among_what_its_pod_fits() -> None:
    t, f = True, False
    assert precedence_order(3, [(np.array([t, t, t]), 2)]).tolist() == [1, 2, 0]
    # a later, less frequent choice that contradicts an earlier one is dropped
    assert precedence_order(3, [(np.array([t, t, f]), 1), (np.array([t, t, t]), 0)]).tolist() == [1, 0, 2]
    # constraints chain: 2 before 1, 1 before 0; then "0 before 2" would close a cycle
    got = precedence_order(3, [(np.array([f, t, t]), 2), (np.array([t, t, f]), 1), (np.array([t, f, t]), 0)])
    assert got.tolist() == [2, 1, 0]
    # nothing to order: the fixed order
    assert precedence_order(3, [(np.array([f, t, f]), 1), (np.array([t, t, t]), -1)]).tolist() == [0, 1, 2]


def test_representatives_are_the_frequent_single_gpu_classes_reread_at_powers_of_two() -> None:
    reps = Representatives()
    reps.observe(PackRequest(gpus=2, slices=S))
    reps.observe(PackRequest(cpu_milli=100))
    assert reps.seen == 0 and reps.current == ()
    reps.observe(one_gpu(2))
    assert [r.slices for r in reps.current] == [2] and reps.version == 1
    for _ in range(2):
        reps.observe(one_gpu(3))
    assert [r.slices for r in reps.current] == [2, 3]  # read at 2 seen; at 3 (no power of two) kept
    reps.observe(one_gpu(3, gpu_memory_mib=20480))
    assert [(r.slices, r.gpu_memory_mib) for r in reps.current] == [(3, 0), (2, 0), (3, 20480)]
    for _ in range(60):
        reps.observe(one_gpu(1))
    # seen 64: 60 of 64 are 1-slice pods; 95 % needs the 3-slice ones too (62 of 64), then stops
    assert [r.slices for r in reps.current] == [1, 3]
    assert 62 / 64 >= COVERAGE > 60 / 64


def steered(state: ClusterState, policy: str, seen: list[PackRequest]) -> tuple[Scheduler, PublishedOrder,
                                                                               DeviceSteering]:
    sched = Scheduler(PackedCluster(state), policy)
    order = PublishedOrder(state)
    steering = DeviceSteering(sched)
    for r in seen:
        sched.observe(r)
        steering.observe(r)
    sched.devices = order
    order.publish(state, *steering.orders())
    return sched, order, steering


def policy_choice(sched: Scheduler, req: PackRequest) -> dict[int, list[int]]:
    ranked = sched.rank(req, every_device=True)
    st_ = sched.state
    return {int(v): [int(st_.unit_pos[u]) for u in ranked.cands.units[i]]
            for v, i in zip(ranked.best.node, ranked.best.index, strict=True)}


def test_first_fit_in_the_published_order_is_the_policys_choice() -> None:
    state = mps_state([[7, 3, 5], [6, 7, 2]])
    seen = [one_gpu(2)] * 3 + [one_gpu(4)]
    sched, order, _ = steered(state, "bestfit", seen)
    for req in (one_gpu(2), one_gpu(4)):
        assert chosen_positions(state, req, order) == policy_choice(sched, req)
    assert chosen_positions(state, one_gpu(2), order) == {0: [1], 1: [2]}  # the tightest fits
    assert chosen_positions(state, one_gpu(4), order) == {0: [2], 1: [0]}


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, S), min_size=1, max_size=8), st.lists(st.integers(1, S), min_size=1, max_size=12),
       st.sampled_from(["fragmentation", "bestfit", "fgd"]))
def test_the_most_frequent_pod_always_gets_the_policys_choice(free: list[int], sizes: list[int],
                                                              policy: str) -> None:
    # One node: the nodes a republish covers are ranked together, as one call, so on several nodes a
    # policy that scores relative to all candidates could rank a node's devices a little differently.
    state = mps_state([free])
    seen = [one_gpu(k) for k in sizes]
    sched, order, steering = steered(state, policy, seen)
    top = steering.reps.current[0]
    assert chosen_positions(state, top, order) == policy_choice(sched, top)


def test_only_changed_nodes_are_republished_until_the_representatives_change() -> None:
    state = mps_state([[7, 7], [7, 7], [7, 7]])
    _, _, steering = steered(state, "fragmentation", [one_gpu(2)])
    assert steering.due().tolist() == []
    state.take(1, [int(state.node_rows(1)[0])], 2, 0, 0)
    assert steering.due().tolist() == [1]
    assert steering.due().tolist() == []
    steering.observe(one_gpu(5))  # seen 2: re-read, a new class
    assert steering.due().tolist() == [0, 1, 2]


def test_the_scheduler_reserves_the_device_first_fit_gives() -> None:
    state = mps_state([[7, 3, 5]])
    sched = Scheduler(PackedCluster(state), "bestfit")
    order = PublishedOrder(state)
    sched.devices = order
    req = PackRequest(gpus=1, slices=2, uid="p1")
    _, ranked, _ = sched.filter_request(req, None, 0.0, explain_refused=False)
    assert len(ranked.cands) == 1
    held = sched.cluster.reservations.get("p1")
    assert held is not None and held.units == ((state.unit_gpu[0], ""),)  # position 0, not bestfit's GPU 1
    assert state.unit_free[0] == S - 2
    token = sched._token()
    order.publish(state, state.node_rows(0), np.array([2, 0, 1]))
    assert sched._token() != token  # a republish makes the kept ranking stale
    assert len(sched.rank(req, every_device=True).cands) == 3


def test_node_orders_skip_dead_nodes_and_keep_unordered_nodes_fixed() -> None:
    state = mps_state([[7, 7], [3, 5]])
    sched = Scheduler(PackedCluster(state), "bestfit")
    state.remove_node(0)
    rows, places = node_orders(sched, (one_gpu(1),), np.array([0, 1]))
    assert rows.tolist() == state.node_rows(1).tolist()
    assert places.tolist() == [0, 1]  # bestfit takes the 3-free GPU, already first
    rows, places = node_orders(sched, (one_gpu(4),), np.array([1]))
    assert places.tolist() == [0, 1]  # one GPU fits: nothing to order
    assert node_orders(sched, (), np.array([1]))[1].tolist() == [0, 1]  # no pods seen: the fixed order
