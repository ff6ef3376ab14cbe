"""The two tie rules of ``fragmentation``: CPU-only pods by CPU per free GPU, leftover window."""

from __future__ import annotations

import numpy as np

from gpuslice.packing.state import ClusterState, PackRequest, enumerate_candidates
from gpuslice.policies.base import PolicyContext
from gpuslice.policies.fragmentation import Fragmentation, cpu_per_free_gpu

from .helpers import cluster

CPU_POD = PackRequest(cpu_milli=4000)


def pick(pol: Fragmentation, state: ClusterState, req: PackRequest, seen: list[PackRequest]) -> int:
    """Node of the highest score, ties to the lowest node index (the caller's node order)."""
    mem = pol.new_memory(PolicyContext(0))
    for r in seen:
        pol.observe(mem, r)
    cands = enumerate_candidates(state, req)
    score = pol.score(state, req, cands, mem)
    assert np.all((score >= 0) & (score < 1))
    return int(cands.node[int(np.argmax(score))])


def test_cpu_only_pod_goes_where_cpu_per_free_gpu_is_highest() -> None:
    # Only CPU-only pods seen: every node's FGD level is the same neutral one for this pod.
    state = cluster([[1000, 1000], [0, 0], [1000, 0]], cpus=[64000, 16000, 64000])
    seen = [CPU_POD, CPU_POD]
    assert pick(Fragmentation(cpu_rule=False), state, CPU_POD, seen) == 0  # node order alone
    assert pick(Fragmentation(), state, CPU_POD, seen) == 1  # no free GPU: its CPU has no other use
    state2 = cluster([[1000, 1000], [1000, 0]], cpus=[64000, 16000])
    ratio = cpu_per_free_gpu(state2, CPU_POD, enumerate_candidates(state2, CPU_POD))
    assert ratio[0] > ratio[1]
    assert pick(Fragmentation(), state2, CPU_POD, seen) == 0  # 60 cores / 2 GPUs beats 12 cores / 1 GPU


def test_cpu_rule_never_overrides_a_better_fgd_level() -> None:
    # A 1-GPU pod with 60 cores was seen: taking CPU on node 0 (2 free GPUs, 64 cores) makes that
    # shape unplaceable there, so FGD's level is worse on node 0 whatever the CPU ratio says.
    state = cluster([[1000, 1000], [1000, 1000]], cpus=[64000, 128000])
    big = PackRequest(cpu_milli=60000, gpus=1, slices=1000)
    assert pick(Fragmentation(), state, CPU_POD, [big] * 9 + [CPU_POD]) == 1


def test_leftover_rule_only_inside_the_window() -> None:
    # 200-slice pods seen. Node 0's 500 -> 300 lowers sum N(g)^2 (N(500) = 2), but with window 0 a
    # candidate must also have the best FGD level, which the rule does not change.
    state = cluster([[500, 500, 0, 0], [700, 0, 0, 0], [900, 0, 0, 0]])
    req = PackRequest(gpus=1, slices=200)
    assert pick(Fragmentation(), state, req, [req]) == 0
    assert pick(Fragmentation(window=0), state, req, [req]) == 0
