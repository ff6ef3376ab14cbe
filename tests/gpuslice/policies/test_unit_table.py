"""The per-class tables the fragmentation cache reads (:class:`gpuslice.packing.frag.UnitTable`)
give what the rules give unit by unit, and the cache's after-placement fragment equals the
fragment of the state after the placement, computed afresh."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice.packing.frag import FragCache, TargetShapes, TargetWorkload, accepts, cpu_need
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

GIB = 1024
S = 7
PRODUCTS = ("A100-40GB", "H100-80GB")
MIG_LAYOUTS = ((7,), (4, 3), (3, 3, 1), (2, 2, 2, 1), (1,) * 7)


def random_state(rng: np.random.Generator) -> ClusterState:
    """Nodes of whole, MPS and MIG GPUs with some slices in use and some units unusable."""
    nodes, units = [], []
    for v in range(int(rng.integers(1, 5))):
        product = str(rng.choice(PRODUCTS))
        memory = 40 * GIB if product.startswith("A100") else 80 * GIB
        nodes.append(NodeSpec(f"n{v}", int(rng.integers(4, 64)) * 1000, 256 * GIB, product))
        for g in range(int(rng.integers(1, 5))):
            kind = int(rng.choice([KIND_WHOLE, KIND_MPS, KIND_MIG]))
            caps = MIG_LAYOUTS[int(rng.integers(len(MIG_LAYOUTS)))] if kind == KIND_MIG else (S,)
            for cap in caps:
                mem = memory * cap // S if kind == KIND_MIG else memory
                free = int(rng.integers(0, cap + 1)) if kind == KIND_MPS else int(rng.choice([0, cap]))
                units.append(UnitSpec(v, g, kind, cap, mem, free=free, usable=bool(rng.random() < 0.9)))
    return ClusterState(nodes, units, slices_per_gpu=S, allow_mps_multi=bool(rng.random() < 0.5))


def random_pod(rng: np.random.Generator) -> PackRequest:
    gpus = int(rng.choice([0, 1, 1, 1, 2]))
    return PackRequest(cpu_milli=int(rng.integers(0, 8)) * 1000, gpus=gpus,
                       slices=(int(rng.integers(1, S + 1)) if gpus == 1 else S) if gpus else 0,
                       gpu_memory_mib=int(rng.choice([0, 10 * GIB, 30 * GIB])) if gpus else 0,
                       isolation=str(rng.choice(["any", "mig", "mps"])) if gpus else "any")


def synced_cache(state: ClusterState, target: TargetWorkload) -> tuple[FragCache, TargetShapes]:
    cache = FragCache()
    shapes = TargetShapes.build(target, state.products)
    cache.sync(state, shapes, 1)
    return cache, shapes


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), aware=st.booleans())
def test_tables_give_the_rules_values_for_every_unit_and_free_count(seed: int, aware: bool) -> None:
    rng = np.random.default_rng(seed)
    state = random_state(rng)
    target = TargetWorkload(aware=aware)
    for _ in range(int(rng.integers(1, 40))):
        target.observe(random_pod(rng))
    cache, shapes = synced_cache(state, target)
    table = cache.table
    assert table is not None
    rows = np.arange(state.n_units + 1)  # the sentinel row too
    kind, cap, mem = state.unit_kind[rows], state.unit_cap[rows], state.unit_mem[rows]
    for less in (0, 1, 3, S + 2):  # down to below zero: a placement's remainder, padding, unusable units
        free = state.unit_free[rows] - less
        np.testing.assert_array_equal(table.accepts(free, table.unit_cls[rows]),
                                      accepts(free, kind, cap, mem, shapes.tests))
        np.testing.assert_array_equal(table.cpu_need(free, table.unit_cls[rows]), cpu_need(free, kind, cap, shapes))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_cached_fragment_after_a_placement_equals_a_fresh_one(seed: int) -> None:
    rng = np.random.default_rng(seed)
    state = random_state(rng)
    target = TargetWorkload(aware=True)
    pods = [random_pod(rng) for _ in range(30)]
    for pod in pods:
        target.observe(pod)
    cache, _ = synced_cache(state, target)
    checked = 0
    for pod in pods[:10]:
        cands = enumerate_candidates(state, pod)
        if len(cands) == 0:
            continue
        after = cache.after_frag(state, pod, cands)
        after_cpu = cache.after_cpu_frag(state, pod, cands)
        for i in rng.permutation(len(cands))[:3]:
            node, units = int(cands.node[i]), [int(u) for u in cands.units[i]]
            state.take(node, units, pod.slices, pod.cpu_milli, pod.memory_mib)
            fresh, _ = synced_cache(state, target)
            assert fresh.node_frag(state)[node] == after[i]
            assert fresh.node_cpu_frag(state)[node] == after_cpu[i]
            state.give_back(node, units, pod.slices, pod.cpu_milli, pod.memory_mib)
            checked += 1
        i = int(rng.integers(len(cands)))  # keep one, so later pods see a changed state
        state.take(int(cands.node[i]), [int(u) for u in cands.units[i]], pod.slices, pod.cpu_milli, pod.memory_mib)
    assert checked > 0 or all(len(enumerate_candidates(state, p)) == 0 for p in pods[:10])
