"""Each policy on tiny clusters picks the node and unit its rule says."""

from __future__ import annotations

import numpy as np
import pytest

from gpuslice.decision import best_per_node, paper_choice
from gpuslice.packing.errors import UnknownPolicyError, WeightError
from gpuslice.packing.frag import TargetWorkload
from gpuslice.packing.state import ClusterState, PackRequest, enumerate_candidates
from gpuslice.policies.base import PolicyContext
from gpuslice.policies.registry import known, resolve

from .helpers import cluster


def choose(state: ClusterState, req: PackRequest, spec: str, trace: list[PackRequest] | None = None,
           seed: int = 0) -> tuple[int, int]:
    """(node, position) of the policy's best placement, ties to the lowest node index."""
    pol = resolve(spec)
    mem = pol.new_memory(PolicyContext(seed, trace))
    pol.observe(mem, req)
    cands = enumerate_candidates(state, req)
    score = pol.score(state, req, cands, mem)
    assert np.all((score >= 0) & (score <= 1))
    c = paper_choice(cands, score, pol.secondary(state, req, cands, mem), np.arange(state.n_nodes))
    return int(cands.node[c]), int(state.unit_pos[cands.units[c, 0]]) if req.gpus else -1


FRAC = PackRequest(cpu_milli=1000, gpus=1, slices=300)


def test_bestfit_takes_tightest_node_and_unit() -> None:
    state = cluster([[1000, 1000], [1000, 500, 400], [1000, 350]])
    # node 1 has least GPU left after placing (1900 - 300) vs node 2 (1350 - 300)? node 2 is tighter.
    assert choose(state, FRAC, "bestfit") == (2, 1)


def test_bestfit_inside_node_prefers_least_leftover_unit() -> None:
    state = cluster([[1000, 500, 400, 350]])
    assert choose(state, FRAC, "bestfit") == (0, 3)


def test_binpack_prefers_most_allocated_node() -> None:
    state = cluster([[1000, 1000], [1000, 200]])
    assert choose(state, PackRequest(cpu_milli=1000, gpus=1, slices=100), "binpack")[0] == 1


def test_spread_prefers_empty_node_and_emptiest_unit() -> None:
    state = cluster([[1000, 200], [1000, 1000]])
    assert choose(state, PackRequest(cpu_milli=1000, gpus=1, slices=100), "spread")[0] == 1


def test_random_is_seeded_and_uniform_over_nodes() -> None:
    state = cluster([[1000] * 8, [1000], [1000], [1000]])
    picks = [choose(state, FRAC, "random", seed=s)[0] for s in range(200)]
    assert picks == [choose(state, FRAC, "random", seed=s)[0] for s in range(200)]
    counts = np.bincount(picks, minlength=4)
    assert counts.min() > 25  # the 8-GPU node is not favoured


def test_gpupacking_fills_partly_used_gpu_first() -> None:
    state = cluster([[1000, 1000], [1000, 600]])
    assert choose(state, FRAC, "gpupacking") == (1, 1)


def test_gpuclustering_keeps_kinds_together() -> None:
    state = cluster([[1000, 1000], [1000, 1000], [1000, 1000]])
    state.take(1, [int(state.node_units[1, 0])], 1000, 0, 0)  # node 1 runs a whole-GPU pod
    state.take(2, [int(state.node_units[2, 0])], 300, 0, 0)  # node 2 runs a fractional pod
    assert choose(state, PackRequest(gpus=1, slices=1000), "gpuclustering")[0] == 1
    assert choose(state, FRAC, "gpuclustering")[0] == 2


def test_dotprod_prefers_smaller_free_vector() -> None:
    state = cluster([[1000, 1000], [1000, 1000]], cpus=[64000, 8000])
    assert choose(state, FRAC, "dotprod")[0] == 1


def test_fgd_keeps_whole_gpus_for_whole_gpu_pods() -> None:
    # Typical pods are whole-GPU pods: placing 300 on the node's already-split GPU keeps its free one.
    state = cluster([[1000, 500]])
    trace = [PackRequest(gpus=1, slices=1000)] * 9 + [FRAC]
    assert choose(state, FRAC, "fgd", trace) == (0, 1)


def test_fgd_prefers_node_where_fragment_grows_least() -> None:
    state = cluster([[1000, 1000], [400, 0]])
    trace = [PackRequest(gpus=1, slices=1000)] * 5 + [PackRequest(gpus=1, slices=400)] * 5
    assert choose(state, PackRequest(gpus=1, slices=400), "fgd", trace)[0] == 1


def test_fragmentation_leftover_rule_lowers_sum_of_squares() -> None:
    # Every candidate leaves the same expected fragment (only 200-slice pods seen). Sum of N(g)^2
    # over leftovers: 500 -> 300 gives 4 (from 6), 700 -> 500 gives 10, 900 -> 700 gives 8.
    state = cluster([[500, 500, 0, 0], [700, 0, 0, 0], [900, 0, 0, 0]])
    req = PackRequest(gpus=1, slices=200)
    assert choose(state, req, "fragmentation") == (0, 0)
    state2 = cluster([[700, 0, 0, 0], [500, 500, 0, 0], [900, 0, 0, 0]])
    assert choose(state2, req, "fragmentation")[0] == 1


def test_fragmentation_learns_online_only_from_observed_pods() -> None:
    pol = resolve("fragmentation")
    mem = pol.new_memory(PolicyContext(0, [PackRequest(gpus=1, slices=1000)] * 100))
    inner = mem[0]
    assert inner.target.seen == 0  # the trace is not read in advance
    pol.observe(mem, FRAC)
    assert inner.target.seen == 1 and inner.target.counts == {inner.target.key(FRAC): 1}


def test_offline_target_keeps_95_percent_most_frequent() -> None:
    reqs = [PackRequest(gpus=1, slices=1000)] * 90 + [PackRequest(gpus=1, slices=500)] * 6 + [FRAC] * 4
    t = TargetWorkload.offline(reqs)
    assert set(t.counts) == {t.key(reqs[0]), t.key(reqs[90])}


def test_weighted_sum_stays_in_unit_range_and_validates() -> None:
    pol = resolve("bestfit:3,spread:1")
    state = cluster([[1000, 300], [1000, 1000]])
    cands = enumerate_candidates(state, FRAC)
    s = pol.score(state, FRAC, cands, pol.new_memory(PolicyContext()))
    assert np.all((s >= 0) & (s <= 1))
    with pytest.raises(WeightError):
        resolve("bestfit:-1")
    with pytest.raises(UnknownPolicyError) as e:
        resolve("tetris")
    assert "fragmentation" in str(e.value) and set(known()) >= {"fgd", "bestfit", "random", "gpupacking"}


def test_cpu_only_and_multi_gpu_candidates() -> None:
    state = cluster([[1000, 1000, 1000], [1000, 300]])
    multi = enumerate_candidates(state, PackRequest(gpus=2, slices=1000))
    assert multi.node.tolist() == [0] and state.unit_pos[multi.units[0]].tolist() == [0, 1]
    cpu = enumerate_candidates(state, PackRequest(cpu_milli=1000))
    assert cpu.node.tolist() == [0, 1] and cpu.units.shape == (2, 0)
    best = best_per_node(cpu, np.array([0.2, 0.9]))
    assert best.node[np.argmax(best.score)] == 1
