"""Rule 4 of ``fragmentation``: coarse slices switch on the wide window and the MIG term in the FGD
delta only once a departure has been seen; until then window 0 and the MIG term as a tie-break."""

from __future__ import annotations

import numpy as np

from gpuslice.packing.state import KIND_MIG, ClusterState, NodeSpec, PackRequest, UnitSpec, enumerate_candidates
from gpuslice.policies.base import PolicyContext
from gpuslice.policies.fragmentation import ChurnMemory, Fragmentation

from .helpers import cluster

GIB = 1024


def _memory(pol: Fragmentation, seen: list[PackRequest], *, departed: bool) -> ChurnMemory:
    mem = pol.new_memory(PolicyContext(0))
    assert isinstance(mem, ChurnMemory)
    for r in seen:
        pol.observe(mem, r)
    mem.departed = departed
    return mem


def test_departure_is_seen_only_when_capacity_frees_up() -> None:
    state = cluster([[7, 7], [7, 7]], slices=7)
    mem = _memory(Fragmentation(), [], departed=False)
    assert not mem.saw_departure(state)
    state.take(0, [0], 3, 0, 0)
    assert not mem.saw_departure(state)  # placements only lower free slices
    state.take(1, [2], 7, 0, 0)
    assert not mem.saw_departure(state)
    state.give_back(0, [0], 3, 0, 0)
    state.take(1, [3], 7, 0, 0)  # net allocation still grew: the freed unit tells
    assert mem.saw_departure(state)
    state.take(0, [0], 3, 0, 0)
    assert mem.saw_departure(state)  # sticky


def _scores(pol: Fragmentation, state: ClusterState, req: PackRequest, seen: list[PackRequest],
            departed: bool) -> np.ndarray:
    mem = _memory(pol, seen, departed=departed)
    return pol.score(state, req, enumerate_candidates(state, req), mem)


def test_coarse_mps_scores_window_zero_until_a_departure() -> None:
    rng = np.random.default_rng(3)
    free = rng.integers(0, 8, size=(6, 4)).tolist()
    state = cluster(free, slices=7)
    seen = [PackRequest(gpus=1, slices=int(k)) for k in rng.integers(1, 8, size=40)]
    for k in (1, 2, 3, 5):
        req = PackRequest(gpus=1, slices=k)
        before = _scores(Fragmentation(), state, req, seen, departed=False)
        assert np.array_equal(before, _scores(Fragmentation(window=0), state, req, seen, departed=True))
        after = _scores(Fragmentation(), state, req, seen, departed=True)
        assert np.array_equal(after, _scores(Fragmentation(window=20), state, req, seen, departed=True))


def test_fine_slices_never_watch_for_departures() -> None:
    state = cluster([[1000, 500], [300, 0]])
    pol = Fragmentation()
    mem = _memory(pol, [PackRequest(gpus=1, slices=200)], departed=False)
    req = PackRequest(gpus=1, slices=200)
    first = pol.score(state, req, enumerate_candidates(state, req), mem)
    assert mem.last_free is None and not mem.departed
    assert np.array_equal(first, _scores(pol, state, req, [req], departed=True))


def test_mig_pod_still_prefers_a_gpu_in_use_before_any_departure() -> None:
    nodes = [NodeSpec("n0", 64000, 256000, "H100-80GB")]
    units = [UnitSpec(0, g, KIND_MIG, 1, 10 * GIB) for g in range(2) for _ in range(3)]
    state = ClusterState(nodes, units, slices_per_gpu=7)
    state.take(0, [3], 1, 0, 0)  # GPU 1 runs a pod
    req = PackRequest(gpus=1, slices=1, gpu_memory_mib=8 * GIB)
    cands = enumerate_candidates(state, req)
    score = _scores(Fragmentation(), state, req, [req], departed=False)
    assert state.unit_gpu_id[int(cands.units[int(np.argmax(score)), 0])] == 1
