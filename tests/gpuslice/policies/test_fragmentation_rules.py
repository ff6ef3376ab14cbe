"""Rules of ``fragmentation`` beside FGD's level: CPU stranding, the CPU fragment, the leftover window."""

from __future__ import annotations

import numpy as np

from gpuslice.packing.frag import cpu_fragment_rate
from gpuslice.packing.state import (
    KIND_MIG,
    KIND_MPS,
    ClusterState,
    NodeSpec,
    PackRequest,
    UnitSpec,
    enumerate_candidates,
)
from gpuslice.policies.fragmentation import Fragmentation, host_stranding_change

from .helpers import cluster, learned, pick

CPU_POD = PackRequest(cpu_milli=4000)
#: A GPU pod asking 16 cores per GPU: the learned CPU per slice is 16 cores / 1000 slices.
GPU_POD = PackRequest(cpu_milli=16000, gpus=1, slices=1000)


def test_cpu_only_pod_spends_cpu_that_no_idle_gpu_needs() -> None:
    # Node 0: 2 idle GPUs and exactly the 32 cores they need; node 1: no idle GPU; node 2: one idle
    # GPU and 64 cores. The 16-core shape still fits on node 0 after 4 cores go, so FGD's level is
    # the same everywhere; only node 0 would strand a quarter of a GPU.
    state = cluster([[1000, 1000], [0, 0], [1000, 0]], cpus=[32000, 16000, 64000])
    seen = [GPU_POD, GPU_POD, CPU_POD]
    assert pick(Fragmentation(stranding_weight=0.0), state, CPU_POD, seen) == 0  # node order alone
    assert pick(Fragmentation(), state, CPU_POD, seen) == 1
    shapes = learned(Fragmentation(), seen).current(state)
    change = host_stranding_change(state, CPU_POD, enumerate_candidates(state, CPU_POD), shapes)
    np.testing.assert_allclose(change, [250.0, 0.0, 0.0])


def test_a_light_gpu_pod_takes_the_gpu_that_a_cpu_poor_node_would_strand() -> None:
    # Learned: 16 cores per GPU. Node 0 has 2 idle GPUs and 64 cores, node 1 2 idle GPUs and 20
    # cores (feeds 1.25 GPUs: 750 slices stranded). A 4-core GPU pod on node 1 leaves 16 cores for
    # its last GPU, nothing stranded; the 16-core shape fits either node before and after, so FGD's
    # level is the same on both.
    state = cluster([[1000, 1000], [1000, 1000]], cpus=[64000, 20000])
    light = PackRequest(cpu_milli=4000, gpus=1, slices=1000)
    seen = [GPU_POD] * 3 + [light]
    cands = enumerate_candidates(state, light)
    shapes = learned(Fragmentation(), [GPU_POD]).current(state)
    np.testing.assert_allclose(host_stranding_change(state, light, cands, shapes),
                               np.where(cands.node == 1, -750.0, 0.0))
    assert pick(Fragmentation(), state, light, seen) == 1
    assert pick(Fragmentation(stranding_weight=0.0), state, light, seen) == 0  # node order alone


def test_host_memory_strands_slices_as_cpu_does() -> None:
    # Learned: 16 GiB of host memory per GPU. Both nodes have 2 idle GPUs and 64 cores; node 0 has
    # 16 GiB of memory (it feeds one GPU: 1000 slices stranded), node 1 256 GiB. A CPU-only pod
    # asking 4 GiB would strand a quarter more of a GPU on node 0 and nothing on node 1.
    nodes = [NodeSpec("n0", 64000, 16384, "G2"), NodeSpec("n1", 64000, 262144, "G2")]
    units = [UnitSpec(v, g, KIND_MPS, 1000) for v in range(2) for g in range(2)]
    state = ClusterState(nodes, units, slices_per_gpu=1000, allow_mps_multi=True)
    gpu_pod = PackRequest(cpu_milli=1000, memory_mib=16384, gpus=1, slices=1000)
    small = PackRequest(cpu_milli=1000, memory_mib=4096)
    seen = [gpu_pod] * 3 + [small]
    shapes = learned(Fragmentation(), seen).current(state)
    assert shapes.memory_per_slice == 16384 / 1000
    change = host_stranding_change(state, small, enumerate_candidates(state, small), shapes)
    np.testing.assert_allclose(change, [250.0, 0.0])
    assert pick(Fragmentation(), state, small, seen) == 1
    assert pick(Fragmentation(stranding_weight=0.0), state, small, seen) == 0  # node order alone


#: CPU-only pods of 8 and 12 cores and a GPU pod asking 32 cores for one GPU: 52 cores per GPU of
#: work, CPU-only pods included (a cluster with fewer cores per GPU runs out of CPU first).
CPU_HEAVY = [PackRequest(cpu_milli=8000), PackRequest(cpu_milli=12000),
             PackRequest(cpu_milli=32000, gpus=1, slices=1000)]


def test_cpu_fragment_counts_where_cpu_runs_out_first() -> None:
    # Two nodes whose GPU is taken: 20 and 8 free cores, 28 in all for 2 GPUs (104 asked). No idle
    # GPU anywhere, so FGD's GPU fragment and the stranding term are 0 on both. An 8-core pod on
    # node 1 uses its CPU up (8 cores that only the 8-core shape could use: fragment 8 x 2/3 -> 0);
    # on node 0 it leaves 12 cores (fragment 20 x 1/3 -> 12 x 1/3). So node 1 gains more.
    state = cluster([[0], [0]], cpus=[20000, 8000])
    pod = PackRequest(cpu_milli=8000)
    shapes = learned(Fragmentation(), CPU_HEAVY).current(state)
    assert shapes.cpu_per_slice_all == 52.0
    assert cpu_fragment_rate(state, shapes) == 1.0 / 52.0
    mem = learned(Fragmentation(), CPU_HEAVY)
    cands = enumerate_candidates(state, pod)
    pol = Fragmentation()
    pol.score(state, pod, cands, mem)  # fills the cache
    change = mem.cache.after_cpu_frag(state, pod, cands) - mem.cache.node_cpu_frag(state)[cands.node]
    np.testing.assert_allclose(change, [(12000 - 20000) / 3, -8000 * 2 / 3])
    assert pick(Fragmentation(), state, pod, CPU_HEAVY) == 1
    assert pick(Fragmentation(cpu_weight=0.0), state, pod, CPU_HEAVY) == 0  # node order alone


def test_cpu_fragment_is_free_where_gpus_run_out_first() -> None:
    # The same nodes with 200 and 188 free cores: 388 for 2 GPUs, more than the 104 the work asks,
    # so idle CPU is left over wherever the pod goes and the term is 0.
    state = cluster([[0], [0]], cpus=[200000, 188000])
    shapes = learned(Fragmentation(), CPU_HEAVY).current(state)
    assert cpu_fragment_rate(state, shapes) == 0.0
    pod = PackRequest(cpu_milli=8000)
    cands = enumerate_candidates(state, pod)
    on, off = Fragmentation(), Fragmentation(cpu_weight=0.0)
    np.testing.assert_array_equal(on.score(state, pod, cands, learned(on, CPU_HEAVY)),
                                  off.score(state, pod, cands, learned(off, CPU_HEAVY)))


#: Learned on a MIG cluster: 1-slice and 7-slice pods, each asking 4 cores, one of each; 1 core
#: per slice on average, but a 1g instance's pod asks 4 cores per slice and a 7g one's 4/7.
SMALL_MIG = PackRequest(cpu_milli=4000, gpus=1, slices=1)
WHOLE_MIG = PackRequest(cpu_milli=4000, gpus=1, slices=7)


def test_cpu_per_slice_is_learned_per_unit_size() -> None:
    state = cluster([[1000]])
    shapes = learned(Fragmentation(), [SMALL_MIG, WHOLE_MIG]).current(state)
    assert shapes.cpu_per_slice == 1000.0
    np.testing.assert_allclose(shapes.cpu_per_slice_at[[1, 7]], [4000.0, 4000.0 / 7])
    np.testing.assert_allclose(shapes.cpu_per_slice_at[[2, 3]], [1000.0, 1000.0])  # no pod asks 2 or 3


def test_small_mig_instances_need_the_cpu_of_their_own_pods() -> None:
    # Node 0: seven idle 1g instances and 16 cores; their pods would ask 28, so 16 cores feed 4 of
    # the 7 slices (3 stranded). Node 1: one idle 7g instance and 16 cores, far more than its pod's
    # 4. At the average rate (1 core per slice) node 0 would look fine. A 4-core CPU-only pod on
    # node 0 leaves 12 cores for 7 x 4 needed: one more slice stranded; on node 1 none.
    nodes = [NodeSpec("n0", 16000, 262144, "A100"), NodeSpec("n1", 16000, 262144, "A100")]
    units = [UnitSpec(0, 0, KIND_MIG, 1) for _ in range(7)] + [UnitSpec(1, 0, KIND_MIG, 7)]
    state = ClusterState(nodes, units, slices_per_gpu=7)
    seen = [SMALL_MIG, WHOLE_MIG, CPU_POD]
    shapes = learned(Fragmentation(), seen).current(state)
    cands = enumerate_candidates(state, CPU_POD)
    np.testing.assert_allclose(host_stranding_change(state, CPU_POD, cands, shapes), [1.0, 0.0])
    assert pick(Fragmentation(), state, CPU_POD, seen) == 1
    assert pick(Fragmentation(stranding_weight=0.0), state, CPU_POD, seen) == 0  # node order alone
    # A 1g pod on node 0 takes its own 4 cores with its instance: 6 slices, 12 cores for 24 needed.
    small = enumerate_candidates(state, SMALL_MIG)
    np.testing.assert_allclose(host_stranding_change(state, SMALL_MIG, small, shapes), [0.0] * len(small))


def test_leftover_rule_only_inside_the_window() -> None:
    # 200-slice pods seen. Node 0's 500 -> 300 lowers sum N(g)^2 (N(500) = 2), but with window 0 a
    # candidate must also have the best FGD level, which the rule does not change.
    state = cluster([[500, 500, 0, 0], [700, 0, 0, 0], [900, 0, 0, 0]])
    req = PackRequest(gpus=1, slices=200)
    assert pick(Fragmentation(), state, req, [req]) == 0
    assert pick(Fragmentation(window=0), state, req, [req]) == 0
