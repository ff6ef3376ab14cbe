"""``utilization``: steer away from busy GPUs, by DCGM activity of the target GPU or MIG instance.

LLM decoding is memory-bandwidth bound, so a unit's activity is the larger of its graphics-engine
activity and its memory-bandwidth utilization (both 0..1). Only what is above ``HOT_FROM`` counts:
a GPU with headroom serves one more share at no cost to the others, and scoring moderate activity
would only spread pods off partly used GPUs (the opposite of packing); nearer saturation each share
slows every pod on it. A unit scores 1 - (activity - HOT_FROM) / (1 - HOT_FROM), clipped to 0..1,
and a candidate the mean over its units. The signal lives in :class:`UtilizationMemory`, which the caller (extender
signal refresher, simulator) updates; a unit whose sample is missing or older than ``max_age_s``
scores 0.5, and with no fresh sample at all every candidate scores 0.5: stale data is neutral.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from gpuslice.packing.state import Candidates, ClusterState, PackRequest
from gpuslice.policies.base import F64, BasePolicy, PolicyContext

NEUTRAL = 0.5
#: Activity up to this level is headroom, not heat (see the module docstring).
HOT_FROM = 0.6


@dataclass(slots=True)
class UtilizationMemory:
    """Per-unit activity (0..1) and the time of its sample; ``now`` is set by the caller."""

    activity: F64 = field(default_factory=lambda: np.zeros(0))
    sampled_at: F64 = field(default_factory=lambda: np.zeros(0))
    now: float = 0.0
    max_age_s: float = 120.0
    version: int = 0  # bumped by every update, so a ranking knows whether it saw these samples

    def update(self, units: NDArray[np.int64], activity: F64, at: float, n_units: int) -> None:
        """Record samples for ``units`` taken at ``at`` (arrays grow to ``n_units`` + sentinel)."""
        if self.activity.shape[0] < n_units + 1:
            grow = n_units + 1 - self.activity.shape[0]
            self.activity = np.concatenate([self.activity, np.zeros(grow)])
            self.sampled_at = np.concatenate([self.sampled_at, np.full(grow, -np.inf)])
        self.activity[units] = np.clip(activity, 0.0, 1.0)
        self.sampled_at[units] = at
        self.version += 1


class Utilization(BasePolicy):
    name = "utilization"

    def new_memory(self, ctx: PolicyContext) -> Any:
        return UtilizationMemory()

    def memory_token(self, memory: Any) -> object:
        # Freshness is judged against ``now``, so a ranking holds only at the same ``now`` too.
        return (memory.version, memory.now) if isinstance(memory, UtilizationMemory) else None

    def score(self, state: ClusterState, req: PackRequest, cands: Candidates, memory: Any) -> F64:
        n = len(cands)
        mem = memory if isinstance(memory, UtilizationMemory) else None
        if n == 0 or mem is None or req.gpus == 0 or mem.activity.shape[0] <= state.n_units:
            return np.full(n, NEUTRAL)
        units = cands.units
        fresh = (mem.now - mem.sampled_at[units]) <= mem.max_age_s
        heat = np.clip((mem.activity[units] - HOT_FROM) / (1.0 - HOT_FROM), 0.0, 1.0)
        per_unit = np.where(fresh, 1.0 - heat, NEUTRAL)
        return np.asarray(np.clip(per_unit.mean(axis=1), 0.0, 1.0), dtype=np.float64)


POLICY = Utilization()
