"""Point 10 of ``fragmentation``: an idle MPS GPU is not opened for a pod a GPU in use takes."""

from __future__ import annotations

import numpy as np

from gpuslice.packing.state import PackRequest, enumerate_candidates
from gpuslice.policies._any_fit import idle_gpu_openers
from gpuslice.policies.fragmentation import Fragmentation

from .helpers import cluster, pick

SEEN = [PackRequest(gpus=1, slices=k, cpu_milli=2000) for k in (3, 3, 1, 1)]
POD = PackRequest(gpus=1, slices=2, cpu_milli=2000)


def test_a_small_pod_goes_to_the_gpu_in_use_where_fgd_would_open_an_idle_one() -> None:
    # node 0: one GPU with 3 of 7 slices free and one full; node 1: two idle GPUs
    layout = [[3, 0], [7, 7]]
    assert pick(Fragmentation(any_fit=False), cluster(layout, slices=7), POD, SEEN) == 1
    assert pick(Fragmentation(), cluster(layout, slices=7), POD, SEEN) == 0


def test_gpus_of_another_product_are_not_compared() -> None:
    # the GPU in use is another product than the idle ones: the product terms decide, not this rule
    state = cluster([[3, 0], [7, 7]], slices=7, products=["A100", "H100"])
    cands = enumerate_candidates(state, POD)
    assert not idle_gpu_openers(state, POD, cands).any()
    assert pick(Fragmentation(), state, POD, SEEN) == pick(Fragmentation(any_fit=False), state, POD, SEEN)


def test_openers_are_exactly_the_idle_gpus_of_the_in_use_product() -> None:
    state = cluster([[3, 7], [7, 1]], slices=7, products=["A100", "A100"])
    cands = enumerate_candidates(state, POD)
    openers = idle_gpu_openers(state, POD, cands)
    free = state.unit_free[cands.units[:, 0]]
    assert openers.any()
    assert np.array_equal(openers, free == 7)


def test_an_idle_gpu_is_opened_when_no_gpu_in_use_takes_the_pod() -> None:
    state = cluster([[1, 0], [7, 7]], slices=7)
    req = PackRequest(gpus=1, slices=3, cpu_milli=2000)
    assert not idle_gpu_openers(state, req, enumerate_candidates(state, req)).any()
    assert pick(Fragmentation(), state, req, SEEN) == 1


def test_multi_gpu_pods_are_left_to_the_host_terms() -> None:
    state = cluster([[3, 7, 7], [7, 7, 7]], slices=7)
    req = PackRequest(gpus=2, slices=7, cpu_milli=2000)
    cands = enumerate_candidates(state, req)
    assert len(cands) > 0
    assert not idle_gpu_openers(state, req, cands).any()
