"""``fragmentation``'s versatility term: a pod that uses up a unit uses up the kind fewest others need."""

from __future__ import annotations

import numpy as np
import pytest

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
from gpuslice.policies import _slice_terms as slice_terms
from gpuslice.policies import registry
from gpuslice.policies.base import PolicyContext
from gpuslice.policies.fragmentation import Fragmentation

from .helpers import cluster, learned

GIB = 1024
SMALL = PackRequest(cpu_milli=1000, gpus=1, slices=1)
WHOLE = PackRequest(cpu_milli=1000, gpus=1, slices=7)
#: Three small pods for one whole-GPU pod: a small shape is 3/4 of the GPU pods seen.
SEEN = [SMALL, SMALL, SMALL, WHOLE]


def _mixed_node() -> ClusterState:
    """One node: an MPS GPU, a whole GPU, a MIG GPU cut 7g, a MIG GPU with a 1g instance."""
    units = [UnitSpec(0, 0, KIND_MPS, 7, 80 * GIB), UnitSpec(0, 1, KIND_WHOLE, 7, 80 * GIB),
             UnitSpec(0, 2, KIND_MIG, 7, 80 * GIB), UnitSpec(0, 3, KIND_MIG, 1, 10 * GIB)]
    return ClusterState([NodeSpec("n0", 64000, 256000, "H100-80GB")], units, slices_per_gpu=7)


def _change(state: ClusterState, req: PackRequest) -> tuple[list[int], list[float]]:
    mem = learned(Fragmentation(), SEEN)
    mem.current(state)
    cands = enumerate_candidates(state, req)
    change = slice_terms.versatility_change(state, req, cands, mem.cache.unit_versatility(state))
    return [int(state.unit_kind[u]) for u in cands.units[:, 0]], change.tolist()


def test_a_whole_gpu_pod_pays_for_using_up_an_mps_gpu_that_small_pods_share() -> None:
    # Every shape can use the idle MPS GPU (versatility 1), only the 7-slice shape the whole GPU
    # or the 7g instance (1/4): 7 x (1 - 1/4) more for the MPS GPU.
    kinds, change = _change(_mixed_node(), WHOLE)
    assert dict(zip(kinds, change, strict=True)) == {KIND_MPS: pytest.approx(5.25), KIND_WHOLE: 0.0, KIND_MIG: 0.0}


def test_a_small_pod_pays_for_using_up_a_mig_instance_but_not_for_a_share() -> None:
    # The 1g instance serves the small shape (3/4) and is used up; a slice of the MPS GPU leaves
    # the rest of it to the others.
    kinds, change = _change(_mixed_node(), SMALL)
    assert dict(zip(kinds, change, strict=True)) == {KIND_MPS: 0.0, KIND_MIG: pytest.approx(0.75)}


def test_the_term_is_zero_where_every_unit_is_alike() -> None:
    # openb-like: MPS GPUs without floors. Every idle unit serves every shape, so whatever the pod,
    # every candidate costs the same, and the policy scores exactly as without the term.
    state = cluster([[1000, 1000], [400, 1000], [1000, 0]])
    seen = [PackRequest(cpu_milli=2000, gpus=1, slices=s) for s in (100, 400, 1000)]
    seen.append(PackRequest(cpu_milli=8000, gpus=2, slices=1000))
    for req in [*seen, PackRequest(cpu_milli=1000)]:
        cands = enumerate_candidates(state, req)
        mem = learned(Fragmentation(), seen)
        mem.current(state)
        assert not slice_terms.versatility_change(state, req, cands, mem.cache.unit_versatility(state)).any()
        with_term = Fragmentation().score(state, req, cands, learned(Fragmentation(), seen))
        without = Fragmentation(versatility_weight=0.0).score(state, req, cands,
                                                              learned(Fragmentation(versatility_weight=0.0), seen))
        np.testing.assert_array_equal(with_term, without)


def test_in_the_priced_mix_a_whole_gpu_pod_leaves_the_cheap_mps_gpu_to_small_pods(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Node a: an idle MPS GPU at $1/h; node b: an idle whole GPU at $3/h. The price alone sends the
    # 7-slice pod to a; the versatility term keeps the MPS GPU, which small pods share, for them.
    nodes = [NodeSpec("a", 64000, 256000, "H100-80GB", 1.0), NodeSpec("b", 64000, 256000, "H100-80GB", 3.0)]
    units = [UnitSpec(0, 0, KIND_MPS, 7, 80 * GIB), UnitSpec(1, 0, KIND_WHOLE, 7, 80 * GIB)]
    state = ClusterState(nodes, units, slices_per_gpu=7)

    def pick() -> int:
        mix = registry.resolve("fragmentation:1,cost:1")
        mem = mix.new_memory(PolicyContext(0))
        for r in SEEN:
            mix.observe(mem, r)
        cands = enumerate_candidates(state, WHOLE)
        return int(cands.node[int(np.argmax(mix.score(state, WHOLE, cands, mem)))])

    assert pick() == 1
    monkeypatch.setitem(registry._POLICIES, "fragmentation", Fragmentation(versatility_weight=0.0))
    assert pick() == 0
