"""Replay of an openb-style trace through the same decision code the extender runs.

Modes (one pod at a time, arrivals only, a pod that fails is dropped, as in the FGD artifact):

* ``protocol``: what a real cluster does. kube-scheduler's CPU/memory fit and ``gpu_spec`` as a
  GPU-product node affinity (:meth:`ClusterState.fit`); the extender's narrowed filter
  (:func:`gpuslice.decision.narrowed_filter`, ties in the extender's own node order) reserves the
  first node's best placement; ``/prioritize`` maps scores onto 0..10; kube-scheduler adds
  ``weight`` x 10 x priority to its own plugin scores (constant by default: the profile disables
  the CPU/memory spreading scorers; ``kube_scorer="least-allocated"`` models a default profile)
  and breaks ties at random with the seed; ``/bind`` places the reserved placement or, if
  kube-scheduler chose another node, that node's best placement.
* ``wide``: the same without narrowing (the filter passes every feasible node): the cost of the
  0..10 protocol with random ties.
* ``ideal``: the raw float score's argmax (ties in the extender's node order), no protocol.
* ``paper``: the research simulator's rules: ``int(100 * score)``, ties to a fixed per-seed
  random node order, ``fgd`` with the offline target of the original trace.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from gpuslice.decision import NarrowConfig, kube_select, paper_choice, priority_scores
from gpuslice.packing.state import ClusterState, PackRequest
from gpuslice.policies.registry import Weighted
from gpuslice.scheduler import PackedCluster, Scheduler
from simulator.dra import DeviceChoice, attach
from simulator.openb import MILLI, OpenbNode, OpenbPod, build_state, to_request

if TYPE_CHECKING:
    from simulator.miglayouts import DynamicLayouts

MODES = ("protocol", "wide", "ideal", "paper")
F64 = NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class EngineOptions:
    mode: str = "protocol"
    slices: int = MILLI
    narrow: NarrowConfig = field(default_factory=NarrowConfig)
    extender_weight: int = 1
    kube_scorer: str = "none"
    #: Record where each pod landed (``RunResult.placements``): v1 List replays report it; trace
    #: replays of thousands of pods under many seeds do not need it.
    placements: bool = False
    #: Who picks the device (``--device-choice``, :mod:`simulator.dra`); the default is today's.
    devices: DeviceChoice = field(default_factory=DeviceChoice)


@dataclass(slots=True)
class RunResult:
    """One (policy, mode, seed) replay: per-pod arrived and allocated % and the totals."""

    policy: str
    mode: str
    seed: int
    arrived: F64
    allocated: F64
    placed: NDArray[np.bool_]
    seconds: float
    #: Per pod, by its UID: where it landed, ``node/target[+target]`` (a MIG instance's UUID, else each
    #: GPU's), or "" when it found no place; filled when ``EngineOptions.placements`` asks for it.
    placements: dict[str, str] = field(default_factory=dict)

    @property
    def pods_placed(self) -> int:
        return int(self.placed.sum())


def _kube_scores(state: ClusterState, nodes: NDArray[np.int64], req: PackRequest, scorer: str) -> (
        NDArray[np.int64] | None):
    if scorer == "none":
        return None
    cpu = (state.node_cpu_free[nodes] - req.cpu_milli) / np.maximum(state.node_cpu_cap[nodes], 1)
    mem = (state.node_mem_free[nodes] - req.memory_mib) / np.maximum(state.node_mem_cap[nodes], 1)
    return np.floor(50.0 * (cpu + mem)).astype(np.int64)


def simulate(nodes: Sequence[OpenbNode], pods: Sequence[OpenbPod], policy: str | Weighted, seed: int,
             options: EngineOptions, *, trace: Sequence[OpenbPod] | None = None,
             progress: Callable[[int, int], None] | None = None) -> RunResult:
    """Replay ``pods`` (already inflated) in order; ``trace`` is the original trace (FGD's offline target)."""
    base = trace if trace is not None else pods
    return replay(build_state(nodes, options.slices), [to_request(p, options.slices) for p in pods],
                  [to_request(p, options.slices) for p in base], policy, seed, options, progress=progress)


def replay(state: ClusterState, reqs: Sequence[PackRequest], base: Sequence[PackRequest], policy: str | Weighted,
           seed: int, options: EngineOptions, *,
           progress: Callable[[int, int], None] | None = None, layouts: DynamicLayouts | None = None,
           capacity: float | None = None) -> RunResult:
    """Replay requests in order on ``state`` (mutated); ``base`` is the original workload (offline targets).

    Shared by the openb CSV path and the v1 List path, so both go through the same decision code.
    ``layouts`` (protocol mode): a pod the filter refuses everywhere gets the core's MIG re-cut, then
    the filter again; ``capacity``: the slices the percentages are of (default: those advertised now).
    """
    started = time.perf_counter()
    if options.mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}")
    cluster = PackedCluster(state)
    sched = Scheduler(cluster, policy, narrow=options.narrow, seed=seed, trace=list(base))
    driver = attach(sched, options.devices, layouts)
    paper_rank = np.empty(state.n_nodes, dtype=np.int64)
    paper_rank[np.random.default_rng(seed).permutation(state.n_nodes)] = np.arange(state.n_nodes)
    ext_rank = sched.node_keys()
    kube_rng = np.random.default_rng(seed + 104729)
    total = float(state.total_slices if capacity is None else capacity)
    demand = np.array([r.total_slices for r in reqs], dtype=np.float64)
    arrived = np.cumsum(demand) / total * 100.0
    allocated = np.zeros(len(reqs))
    placed = np.zeros(len(reqs), dtype=bool)
    where: dict[str, str] = {}
    held = None
    mode = options.mode
    for i, req in enumerate(reqs):
        sched.observe(req)
        if layouts is not None:
            layouts.observe(req)
        if driver is not None:
            driver.observe(req)
        now = float(i)
        if mode == "protocol":
            # The extender's /filter (narrowed, reserves the first node's best placement) and
            # /prioritize, then kube-scheduler's pick and /bind.
            shown, ranked, _ = sched.filter_request(req, None, now, explain_refused=False)
            if not shown.node.shape[0] and layouts is not None and layouts.recut_for(req) is not None:
                shown, ranked, _ = sched.filter_request(req, None, now, explain_refused=False)
            cands = ranked.cands
            c = -1
            if shown.node.shape[0]:
                prio = sched.prioritize_request(req, shown.node, now)
                kube = _kube_scores(state, shown.node, req, options.kube_scorer)
                pick = kube_select(prio * 10, options.extender_weight, kube, kube_rng)
                c = int(shown.index[pick])
                held = cluster.reservations.get(req.uid)
                if held is not None and held.node == state.node_names[int(cands.node[c])]:
                    cluster.bind(req.uid)
                    c = -2  # already applied by the reservation
                else:
                    cluster.release(req.uid)
        else:
            ranked = sched.rank(req)
            cands = ranked.cands
            c = -1
            if len(cands):
                if mode == "paper":
                    c = paper_choice(cands, ranked.score, ranked.secondary, paper_rank)
                elif mode == "ideal":
                    best = ranked.best
                    c = int(best.index[np.lexsort((ext_rank[best.node], -best.score))[0]])
                else:  # wide: every feasible node, 0..10 with kube-scheduler's random ties
                    best = ranked.best
                    prio = priority_scores(best.score, ranked=False)
                    kube = _kube_scores(state, best.node, req, options.kube_scorer)
                    c = int(best.index[kube_select(prio * 10, options.extender_weight, kube, kube_rng)])
        if c >= 0:
            units = cands.units[c].tolist()
            state.take(int(cands.node[c]), units, req.slices, req.cpu_milli, req.memory_mib, req.owner)
            if options.placements:
                where[req.uid] = _where(state.node_names[int(cands.node[c])],
                                        [(state.unit_gpu[u], state.unit_instance[u]) for u in units if u >= 0])
        elif options.placements:  # -2: bound by the filter's reservation; -1: no place
            where[req.uid] = _where(held.node, held.units) if c == -2 and held is not None else ""
        placed[i] = c != -1
        if driver is not None and c != -1:
            driver.event()
        allocated[i] = state.allocated_slices / total * 100.0
        if progress is not None and (i % 256 == 0 or i == len(reqs) - 1):
            progress(i + 1, len(reqs))
    return RunResult(sched.policy.name, mode, seed, arrived, allocated, placed, time.perf_counter() - started,
                     where)


def _where(node: str, units: Sequence[tuple[str, str]]) -> str:
    """``node/target[+target]``: the MIG instance where there is one, else the GPU, each once."""
    targets = list(dict.fromkeys(instance or gpu for gpu, instance in units))
    return f"{node}/{'+'.join(targets)}"
