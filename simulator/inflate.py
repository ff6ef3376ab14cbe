"""The FGD artifact's workload inflation ("tune ratio"), as reference/fgd-benchmark.md 0 item 5.

Pods sorted by name, shuffled with the seed; then pods drawn at random with replacement from the
original trace are appended until the next draw would pass ``ratio`` x capacity. The stop test
adds the drawn pod's *per-GPU* share (gpu_milli), while the running total adds its full request
(num_gpu x gpu_milli), exactly like the artifact. If the trace already exceeds the target, random
pods are removed until it does not (the artifact's tune-down).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from simulator.openb import OpenbPod


def inflate(pods: Sequence[OpenbPod], capacity_milli: int, seed: int, ratio: float = 1.3) -> list[OpenbPod]:
    rng = np.random.default_rng(seed)
    ordered = sorted(pods, key=lambda p: p.name)
    out = [ordered[i] for i in rng.permutation(len(ordered))]
    total = sum(p.total_milli for p in out)
    target = ratio * capacity_milli
    if ratio <= 0 or total == target:
        return out
    if total > target:
        while total > target and out:
            victim = out.pop(int(rng.integers(len(out))))
            total -= victim.total_milli
        return out
    i = 0
    while True:
        pod = ordered[int(rng.integers(len(ordered)))]
        if total + pod.gpu_milli > target:
            break
        out.append(replace(pod, name=f"{pod.name}-tuned-{i}"))
        total += pod.total_milli
        i += 1
    return out
