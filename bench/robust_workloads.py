"""Workload generators for the robustness bench (issue 12): seeded variants, not copies of a trace.

Each openb-style generator takes the default trace's pods (the shapes real users asked for) and a
seed, and returns a new pod list in the openb format, which the bench then inflates to 1.3 x the
GPU capacity exactly like the shared traces. The variants:

* ``cpux15``, ``cpux25``: the GPU pods as they are, plus CPU-only pods drawn (with replacement)
  from the trace's CPU-only pods until there are 1.5 / 2.5 times as many;
* ``fatpods``: every GPU pod asks for more CPU and host memory per GPU (x1.5 to x2.5, drawn per
  pod, capped at the largest node);
* ``multigpu40``: GPU pods resampled so that multi-GPU pods carry 40 % of the GPU request (the
  default trace: about 9 %), CPU-only pods kept;
* ``modelmix``: 35 % of the GPU pods restricted to one or two GPU models drawn uniformly over the
  cluster's models (so rare models are asked for far beyond their share of capacity).

The fake-cluster workloads come from ``gpu-slice fake-cluster`` (:func:`gpuslice.fakecluster.generate`,
the same code as the command) in ``mig``, ``mixed`` and ``mps`` mode with a given ``--seed``; the
bench replays the generated pods' shapes with and without departures (see ``bench_robust.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from simulator.openb import MILLI, OpenbNode, OpenbPod

Generator = Callable[[Sequence[OpenbPod], Sequence[OpenbNode], int], list[OpenbPod]]


def _rng(seed: int, salt: int) -> np.random.Generator:
    return np.random.default_rng([seed, salt])


def more_cpu_only(factor: float) -> Generator:
    """GPU pods kept; CPU-only pods drawn from the trace's own until ``factor`` times as many."""

    def gen(pods: Sequence[OpenbPod], nodes: Sequence[OpenbNode], seed: int) -> list[OpenbPod]:
        rng = _rng(seed, int(factor * 100))
        cpu_only = [p for p in pods if p.num_gpu == 0]
        gpu = [p for p in pods if p.num_gpu > 0]
        want = round(factor * len(cpu_only))
        drawn = [replace(cpu_only[int(i)], name=f"cpu-{n:05d}") for n, i in
                 enumerate(rng.integers(len(cpu_only), size=want))]
        return gpu + drawn

    return gen


def fat_gpu_pods(pods: Sequence[OpenbPod], nodes: Sequence[OpenbNode], seed: int) -> list[OpenbPod]:
    """Every GPU pod x1.5-2.5 CPU and host memory (one factor per pod), capped at the largest node."""
    rng = _rng(seed, 7)
    cpu_cap = max(n.cpu_milli for n in nodes)
    mem_cap = max(n.memory_mib for n in nodes)
    out = []
    for p in pods:
        if p.num_gpu == 0:
            out.append(p)
            continue
        f = float(rng.uniform(1.5, 2.5))
        out.append(replace(p, cpu_milli=min(cpu_cap, int(p.cpu_milli * f)),
                           memory_mib=min(mem_cap, int(p.memory_mib * f))))
    return out


def multi_gpu_share(share: float) -> Generator:
    """GPU pods resampled (same count) so multi-GPU pods carry ``share`` of the GPU request."""

    def gen(pods: Sequence[OpenbPod], nodes: Sequence[OpenbNode], seed: int) -> list[OpenbPod]:
        rng = _rng(seed, int(share * 1000))
        cpu_only = [p for p in pods if p.num_gpu == 0]
        multi = [p for p in pods if p.num_gpu > 1]
        single = [p for p in pods if p.num_gpu == 1]
        m_mean = float(np.mean([p.total_milli for p in multi]))
        s_mean = float(np.mean([p.total_milli for p in single]))
        n = len(multi) + len(single)
        # n_m * m_mean / (n_m * m_mean + (n - n_m) * s_mean) = share
        n_m = round(share * n * s_mean / (m_mean * (1 - share) + share * s_mean))
        pick_m = rng.integers(len(multi), size=n_m)
        pick_s = rng.integers(len(single), size=n - n_m)
        out = list(cpu_only)
        out += [replace(multi[int(i)], name=f"multi-{k:05d}") for k, i in enumerate(pick_m)]
        out += [replace(single[int(i)], name=f"single-{k:05d}") for k, i in enumerate(pick_s)]
        return out

    return gen


def model_mix(share: float) -> Generator:
    """``share`` of the GPU pods restricted to one or two models drawn uniformly over the models."""

    def gen(pods: Sequence[OpenbPod], nodes: Sequence[OpenbNode], seed: int) -> list[OpenbPod]:
        rng = _rng(seed, 31)
        models = sorted({n.model for n in nodes if n.gpus})
        out = []
        for p in pods:
            if p.num_gpu and rng.random() < share:
                k = 1 if rng.random() < 0.5 else 2
                chosen = frozenset(str(models[int(i)]) for i in rng.choice(len(models), size=k, replace=False))
                # a multi-GPU pod needs nodes with that many GPUs: keep it only if some model has them
                if any(n.model in chosen and n.gpus >= p.num_gpu for n in nodes):
                    p = replace(p, gpu_spec=chosen)
            out.append(p)
        return out

    return gen


OPENB_VARIANTS: dict[str, Generator] = {
    "cpux15": more_cpu_only(1.5),
    "cpux25": more_cpu_only(2.5),
    "fatpods": fat_gpu_pods,
    "multigpu40": multi_gpu_share(0.40),
    "modelmix": model_mix(0.35),
}


def describe(pods: Sequence[OpenbPod]) -> str:
    """One line: pods, CPU-only count, multi-GPU share of GPU request, mean CPU per GPU pod."""
    gpu = [p for p in pods if p.num_gpu]
    total = sum(p.total_milli for p in gpu) or 1
    multi = sum(p.total_milli for p in gpu if p.num_gpu > 1) / total
    spec = sum(1 for p in gpu if p.gpu_spec) / max(len(gpu), 1)
    cpu = np.mean([p.cpu_milli for p in gpu]) / 1000 if gpu else 0.0
    return (f"{len(pods)} pods, {len(pods) - len(gpu)} CPU-only, multi-GPU {100 * multi:.0f} % of GPU request, "
            f"{100 * spec:.0f} % model-restricted, {cpu:.1f} cores per GPU pod, {total / MILLI:.0f} GPUs asked")


# ----- fake clusters -----------------------------------------------------------------------------

FAKE_MODES = ("mig", "mixed", "mps")


def fake_cluster_file(mode: str, seed: int, folder: Path, *, nodes: int = 30, gpus: int = 8,
                      product: str = "H100-80GB", pods_per_node: int = 8) -> Path:
    """What ``gpu-slice fake-cluster --nodes N --gpus-per-node G --product P --mode M --pods-per-node K
    --seed S -o FILE`` writes (same generator), as a JSON v1 List in ``folder``. The caller owns the
    folder and removes it (a temp dir made here would outlive the run)."""
    from gpuslice.fakecluster import FakeClusterSpec, generate

    fc = generate(FakeClusterSpec(nodes=nodes, gpus_per_node=gpus, product=product, mode=mode,  # type: ignore[arg-type]
                                  pods_per_node=pods_per_node, seed=seed))
    path = folder / f"fc_{mode}_{seed}.json"
    path.write_text(json.dumps(fc.document))
    return path
