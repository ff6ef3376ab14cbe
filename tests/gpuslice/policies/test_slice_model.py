"""Slice-model scoring: per-GPU owner spread, memory/isolation-aware targets, MIG consolidation,
the price signal of ``cost``, and the default mix scoring exactly as ``fragmentation`` without prices."""

from __future__ import annotations

import numpy as np
import pytest

from gpuslice.config import DEFAULT_POLICIES, default_policy_spec, load_config
from gpuslice.decision import NarrowConfig, best_per_node, narrowed_filter, node_order
from gpuslice.packing.frag import FragCache, TargetShapes, TargetWorkload
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
from gpuslice.policies.base import PolicyContext
from gpuslice.policies.registry import resolve

GIB = 1024


def mig_state(used_first: bool = False) -> ClusterState:
    """One node, two MIG GPUs, each with three 1g.10gb instances and one 1g.20gb (a test layout)."""
    nodes = [NodeSpec("n0", 64000, 256000, "H100-80GB")]
    units = []
    for g in range(2):
        for _ in range(3):
            units.append(UnitSpec(0, g, KIND_MIG, 1, 10 * GIB))
        units.append(UnitSpec(0, g, KIND_MIG, 1, 20 * GIB))
    return ClusterState(nodes, units, slices_per_gpu=7)


def test_owner_spread_is_per_gpu_not_per_mig_instance() -> None:
    st = mig_state()
    req = PackRequest(gpus=1, slices=1, owner="ns/app")
    first = int(np.flatnonzero(st.unit_accepts(req))[0])
    st.take(0, [first], 1, 0, 0, "ns/app")
    ok = st.unit_accepts(req)
    gpu = st.unit_gpu_id[first]
    same_gpu = st.unit_gpu_id[: st.n_units] == gpu
    assert not ok[: st.n_units][same_gpu].any()  # no other instance of that GPU
    assert ok[: st.n_units][~same_gpu].all()  # the other GPU is fine
    assert st.unit_accepts(PackRequest(gpus=1, slices=1, owner="ns/other"))[: st.n_units][same_gpu].sum() == 3
    st.give_back(0, [first], 1, 0, 0, "ns/app")
    assert st.unit_accepts(req)[: st.n_units].all()


def _whole_state() -> ClusterState:
    nodes = [NodeSpec("l4", 48000, 192000, "L4"), NodeSpec("h100", 48000, 192000, "H100-80GB")]
    units = [UnitSpec(0, g, KIND_WHOLE, 7, 22 * GIB) for g in range(4)]
    units += [UnitSpec(1, g, KIND_WHOLE, 7, 80 * GIB) for g in range(4)]
    return ClusterState(nodes, units, slices_per_gpu=7)


def _node_frag(state: ClusterState, target: TargetWorkload) -> list[float]:
    cache = FragCache()
    shapes = TargetShapes.build(target, state.products)
    cache.sync(state, shapes, 1)
    return [float(x) for x in cache.node_frag(state)]


def test_memory_floor_makes_small_gpus_fragment_for_big_pods() -> None:
    state = _whole_state()
    big = PackRequest(gpus=1, slices=7, gpu_memory_mib=70 * GIB)
    blind, aware = TargetWorkload(), TargetWorkload(aware=True)
    blind.observe(big)
    aware.observe(big)
    assert _node_frag(state, blind) == [0.0, 0.0]  # the paper's rule: any free whole GPU will do
    assert _node_frag(state, aware) == [28.0, 0.0]  # an L4 cannot hold a 70 GiB pod


def test_mig_instance_memory_and_isolation_in_targets() -> None:
    state = mig_state()
    floor18 = PackRequest(gpus=1, slices=1, gpu_memory_mib=18 * GIB, isolation="mig")
    t = TargetWorkload(aware=True)
    t.observe(floor18)
    # Per GPU: 3 x 1g.10gb are fragment for an 18 GiB pod, the 1g.20gb is not.
    assert _node_frag(state, t) == [6.0]
    mps_only = TargetWorkload(aware=True)
    mps_only.observe(PackRequest(gpus=1, slices=1, isolation="mps"))
    assert _node_frag(state, mps_only) == [8.0]  # a node with no MPS GPU cannot host it at all


def test_aware_and_blind_targets_agree_without_floors_or_isolation() -> None:
    rng = np.random.default_rng(3)
    free = rng.integers(0, 8, size=(6, 4))
    nodes = [NodeSpec(f"n{i}", int(rng.integers(8, 64)) * 1000, 256000, "G") for i in range(6)]
    units = [UnitSpec(i, g, KIND_MPS, 7, 80 * GIB, free=int(free[i, g])) for i in range(6) for g in range(4)]
    state = ClusterState(nodes, units, slices_per_gpu=7, allow_mps_multi=True)
    reqs = [PackRequest(cpu_milli=int(rng.integers(1, 16)) * 1000, gpus=int(g), slices=7 if g > 1 else int(k))
            for g, k in zip(rng.integers(0, 3, 40), rng.integers(1, 8, 40), strict=True)]
    blind, aware = TargetWorkload(), TargetWorkload(aware=True)
    for r in reqs:
        blind.observe(r)
        aware.observe(r)
    assert _node_frag(state, blind) == _node_frag(state, aware)


def test_fgd_stays_memory_blind_and_fragmentation_is_aware() -> None:
    ctx = PolicyContext(0, None)
    assert resolve("fgd").new_memory(ctx)[0].target.aware is False
    assert resolve("fragmentation").new_memory(ctx)[0].target.aware is True


def test_fragmentation_consolidates_mig_instances_onto_gpus_in_use() -> None:
    state = mig_state()
    state.take(0, [0], 1, 0, 0)  # GPU 0 runs a pod on its first 1g.10gb
    pol = resolve("fragmentation")
    mem = pol.new_memory(PolicyContext())
    req = PackRequest(gpus=1, slices=1, gpu_memory_mib=8 * GIB)
    pol.observe(mem, req)
    cands = enumerate_candidates(state, req)
    score = pol.score(state, req, cands, mem)
    best = int(cands.units[int(np.argmax(score)), 0])
    assert state.unit_gpu_id[best] == 0 and state.unit_mem[best] == 10 * GIB  # used GPU, small instance


def _priced(costs: list[float], used: list[bool]) -> ClusterState:
    nodes = [NodeSpec(f"n{i}", 64000, 256000, "G", c) for i, c in enumerate(costs)]
    units = [UnitSpec(i, 0, KIND_MPS, 7, free=3 if u else 7) for i, u in enumerate(used)]
    return ClusterState(nodes, units, slices_per_gpu=7)


def test_cost_prefers_cheap_nodes_and_nodes_already_paid_for() -> None:
    pol = resolve("cost")
    mem = pol.new_memory(PolicyContext())
    req = PackRequest(gpus=1, slices=2)
    st = _priced([10.0, 10.0, 5.0], [False, True, False])
    s = pol.score(st, req, enumerate_candidates(st, req), mem)
    assert s[1] > s[0]  # same price, node 1 is already paid for
    assert s[2] > s[0]  # cheaper
    none = _priced([0.0, 0.0], [False, True])
    cands = enumerate_candidates(none, req)
    assert pol.score(none, req, cands, mem).tolist() == [1.0, 1.0]
    assert pol.secondary(none, req, cands, mem).tolist() == [0.0, 0.0]  # no prices, no opinion


def test_default_policies_are_one_spec() -> None:
    assert default_policy_spec() == ",".join(f"{n}:{w:g}" for n, w in DEFAULT_POLICIES)
    assert load_config({"version": "v1"}).policy_weights() == dict(DEFAULT_POLICIES)
    assert "cost" in dict(DEFAULT_POLICIES) and "fragmentation" in dict(DEFAULT_POLICIES)


def _openb_like(seed: int) -> tuple[ClusterState, list[PackRequest]]:
    rng = np.random.default_rng(seed)
    n = 30
    nodes = [NodeSpec(f"node-{i:03d}", int(rng.choice([32, 64, 96])) * 1000, 262144,
                      str(rng.choice(["V100M16", "T4", "G2"]))) for i in range(n)]
    units = [UnitSpec(i, g, KIND_MPS, 1000) for i in range(n) for g in range(int(rng.choice([2, 4, 8])))]
    state = ClusterState(nodes, units, slices_per_gpu=1000, allow_mps_multi=True)
    reqs: list[PackRequest] = []
    for j in range(260):
        kind = rng.random()
        cpu = int(rng.integers(1, 12)) * 1000
        if kind < 0.1:
            reqs.append(PackRequest(cpu_milli=cpu, memory_mib=1024, uid=f"p{j}"))
        elif kind < 0.75:
            reqs.append(PackRequest(cpu_milli=cpu, memory_mib=1024, gpus=1,
                                    slices=int(rng.choice([100, 250, 300, 500, 700])), uid=f"p{j}"))
        else:
            reqs.append(PackRequest(cpu_milli=cpu, memory_mib=1024, gpus=int(rng.choice([1, 2, 4])),
                                    slices=1000, products=frozenset({"G2"}) if rng.random() < 0.2 else None,
                                    uid=f"p{j}"))
    return state, reqs


def _replay(spec: str, seed: int, margin: float) -> tuple[list[tuple[int, tuple[int, ...]]], list[np.ndarray]]:
    state, reqs = _openb_like(seed)
    pol = resolve(spec)
    mem = pol.new_memory(PolicyContext(seed))
    rank = node_order(state.node_names)
    narrow = NarrowConfig(margin=margin, max_nodes=3)
    choices: list[tuple[int, tuple[int, ...]]] = []
    scores: list[np.ndarray] = []
    for req in reqs:
        pol.observe(mem, req)
        cands = enumerate_candidates(state, req)
        if len(cands) == 0:
            choices.append((-1, ()))
            continue
        score = pol.score(state, req, cands, mem)
        scores.append(score)
        shown = narrowed_filter(best_per_node(cands, score, pol.secondary(state, req, cands, mem)), rank, narrow)
        i = int(shown.index[0])
        choices.append((int(cands.node[i]), tuple(int(u) for u in cands.units[i])))
        choices.append((-2, tuple(int(v) for v in shown.node)))  # every node handed over, in order
        state.take(int(cands.node[i]), cands.units[i].tolist(), req.slices, req.cpu_milli, req.memory_mib)
    return choices, scores


@pytest.mark.parametrize("margin", [0.0, 0.05])
def test_default_mix_equals_fragmentation_without_prices(margin: float) -> None:
    """openb-like cluster (no prices, no memory floors): same choices, same nodes handed over, and
    bit-identical scores, so neither the ranking nor the narrowed filter's margin moves."""
    a, sa = _replay("fragmentation", 7, margin)
    b, sb = _replay(default_policy_spec(), 7, margin)
    assert a == b
    assert len(sa) == len(sb) and all(np.array_equal(x, y) for x, y in zip(sa, sb, strict=True))
    assert sum(1 for c in a if c[0] >= 0) > 150  # the run placed pods, so the comparison means something


def test_weighted_mix_uses_a_signal_when_there_is_one() -> None:
    st = _priced([10.0, 1.0], [False, False])
    req = PackRequest(gpus=1, slices=2)
    cands = enumerate_candidates(st, req)
    mix = resolve("bestfit:1,cost:1")
    alone = resolve("bestfit")
    ctx = PolicyContext()
    s_mix = mix.score(st, req, cands, mix.new_memory(ctx))
    s_alone = alone.score(st, req, cands, alone.new_memory(ctx))
    assert np.ptp(s_alone) == 0 and s_mix[1] > s_mix[0]  # bestfit ties, cost decides
