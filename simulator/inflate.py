"""The FGD artifact's workload inflation ("tune ratio"), as reference/fgd-benchmark.md 0 item 5.

Pods sorted by name, shuffled with the seed; then pods drawn at random with replacement from the
original trace are appended until the next draw would pass ``ratio`` x capacity. The stop test
adds the drawn pod's *per-GPU* share (gpu_milli), while the running total adds its full request
(num_gpu x gpu_milli), exactly like the artifact. If the trace already exceeds the target, random
pods are removed until it does not (the artifact's tune-down). A workload that asks for no GPU has
nothing to scale and is returned shuffled but otherwise as listed (drawing copies would never reach
the target).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import numpy as np

from simulator.openb import OpenbPod

T = TypeVar("T")


def inflate_items(items: Sequence[T], capacity: int, seed: int, ratio: float, *, share: Callable[[T], int],
                  total: Callable[[T], int], retag: Callable[[T, int], T]) -> list[T]:
    """The method over any workload: ``share`` is an item's per-GPU request, ``total`` its full one,
    ``retag`` names the n-th drawn copy. ``items`` come in the order the shuffle starts from.

    ``ValueError`` for a ratio that is not a finite number >= 0 (NaN or infinity would never stop)."""
    if not (math.isfinite(ratio) and ratio >= 0):
        raise ValueError(f"inflation ratio must be a finite number >= 0, got {ratio}")
    if ratio == 0:  # "replay as listed" (simulate --inflate 0): listed order, nothing drawn
        return list(items)
    rng = np.random.default_rng(seed)
    out = [items[i] for i in rng.permutation(len(items))]
    running = sum(total(x) for x in out)
    target = ratio * capacity
    if running == target or not has_gpu_demand(items, total):
        return out
    if running > target:
        while running > target and out:
            running -= total(out.pop(int(rng.integers(len(out)))))
        return out
    n = 0
    while True:
        item = items[int(rng.integers(len(items)))]
        if running + share(item) > target:
            return out
        out.append(retag(item, n))
        running += total(item)
        n += 1


def has_gpu_demand(items: Sequence[T], total: Callable[[T], int]) -> bool:
    """Whether any item asks for GPU; without one, inflation has nothing to scale."""
    return any(total(x) > 0 for x in items)


def inflate(pods: Sequence[OpenbPod], capacity_milli: int, seed: int, ratio: float = 1.3) -> list[OpenbPod]:
    """Openb pods, sorted by name first as the artifact does."""
    return inflate_items(sorted(pods, key=lambda p: p.name), capacity_milli, seed, ratio,
                         share=lambda p: p.gpu_milli, total=lambda p: p.total_milli,
                         retag=lambda p, n: replace(p, name=f"{p.name}-tuned-{n}"))
