"""Inflation stop rule (per-GPU share in the stop test) and the published metric definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gpuslice.packing.state import PackRequest
from simulator.inflate import inflate
from simulator.kubefile import inflate_requests
from simulator.metrics import binned_curve, first_failure_arrived, unallocated_at
from simulator.openb import OpenbPod


def test_inflation_appends_until_next_per_gpu_share_would_pass_the_target() -> None:
    pods = [OpenbPod(f"p{i}", 1000, 1, 1, 500) for i in range(4)] + [OpenbPod("big", 1000, 1, 8, 1000)]
    capacity = 20000
    out = inflate(pods, capacity, seed=3, ratio=1.3)
    total = sum(p.total_milli for p in out)
    assert sorted(p.name for p in out[:5]) == sorted(p.name for p in pods)  # original trace first, shuffled
    assert all("-tuned-" in p.name for p in out[5:])
    # The stop test used the per-GPU share: total + share of the next draw > target, so the total
    # itself may exceed the target by a multi-GPU pod but never by more than one pod.
    assert total - max(p.total_milli for p in out[5:]) <= 1.3 * capacity
    assert out == inflate(pods, capacity, seed=3, ratio=1.3)
    assert out != inflate(pods, capacity, seed=4, ratio=1.3)


def test_inflation_stops_before_a_fractional_pod_would_pass() -> None:
    pods = [OpenbPod("a", 1, 1, 1, 400)]
    out = inflate(pods, 1000, seed=0, ratio=1.3)
    assert sum(p.total_milli for p in out) == 1200  # a fourth 400 would reach 1600 > 1300


def test_inflation_tunes_down_when_trace_is_too_big() -> None:
    pods = [OpenbPod(f"p{i}", 1, 1, 1, 1000) for i in range(10)]
    out = inflate(pods, 5000, seed=1, ratio=1.0)
    assert len(out) == 5


def test_metrics_follow_the_published_method() -> None:
    arrived = np.array([98.0, 99.4, 99.5, 100.0, 100.49, 100.5, 129.6])
    allocated = np.array([98.0, 99.0, 95.0, 96.0, 97.0, 97.5, 98.0])
    assert math.isclose(unallocated_at(arrived, allocated, 100), 100 - 96.0)
    assert math.isclose(unallocated_at(arrived, allocated, 130), 2.0)
    assert first_failure_arrived(arrived, allocated) == 100.0  # 99.5 - 95 >= 1, rounded
    assert math.isnan(unallocated_at(arrived, allocated, 50))
    x, mean = binned_curve(arrived, allocated)
    assert x.shape == (131,) and mean[98] == 98.0 and math.isnan(mean[10])


def test_inflation_with_no_gpu_demand_returns_the_trace_as_is() -> None:
    pods = [OpenbPod(f"c{i}", 1000, 1, 0, 0) for i in range(3)]
    out = inflate(pods, 8000, seed=0, ratio=1.3)  # used to loop forever, appending CPU-only copies
    assert sorted(p.name for p in out) == ["c0", "c1", "c2"]


def test_inflation_refuses_a_ratio_that_is_not_a_finite_non_negative_number() -> None:
    pods = [OpenbPod("a", 1, 1, 1, 400)]
    for ratio in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match="ratio"):
            inflate(pods, 1000, seed=0, ratio=ratio)


def test_ratio_zero_replays_the_pods_as_listed() -> None:
    """``simulate --inflate 0`` on a v1 List: its creation order, not a shuffle."""
    reqs = [PackRequest(cpu_milli=1, memory_mib=1, gpus=1, slices=i % 7 + 1, uid=f"u{i}") for i in range(40)]
    for seed in (0, 1, 42):
        assert [r.uid for r in inflate_requests(reqs, 280, seed, 0)] == [r.uid for r in reqs]
    assert [r.uid for r in inflate_requests(reqs, 280, 42, 1.0)] != [r.uid for r in reqs]
