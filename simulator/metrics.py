"""Allocation against arrived workload, and the published figures derived from it.

After every pod: arrived = all GPU requested by pods tried so far (failed ones included) and
allocated = GPU held, both as % of cluster capacity. "At 100 %" is the mean unallocated
(100 - allocated) over rows with arrived in [99.5, 100.5); likewise at 130 %. The first failure
is the arrived % (rounded) where allocation first falls at least one point behind arrival.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

F64 = NDArray[np.float64]


def unallocated_at(arrived: F64, allocated: F64, level: float) -> float:
    rows = (arrived >= level - 0.5) & (arrived < level + 0.5)
    if not rows.any():
        return math.nan
    return float(100.0 - allocated[rows].mean())


def first_failure_arrived(arrived: F64, allocated: F64, shortfall: float = 1.0) -> float:
    behind = np.flatnonzero(arrived - allocated >= shortfall - 1e-9)
    return float(np.round(arrived[behind[0]])) if behind.size else math.nan


def binned_curve(arrived: F64, allocated: F64, top: int = 130) -> tuple[F64, F64]:
    """Mean allocated % per whole arrived % (0..top), NaN where no pod landed in a bin."""
    bins = np.round(arrived).astype(np.int64)
    ok = (bins >= 0) & (bins <= top)
    sums = np.bincount(bins[ok], weights=allocated[ok], minlength=top + 1)
    counts = np.bincount(bins[ok], minlength=top + 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    return np.arange(top + 1, dtype=np.float64), mean
