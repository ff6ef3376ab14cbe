"""Scenario 8: sustained load, short (issue 50). The full run is ``bench/bench_load.py`` (20 nodes, faults,
at least five minutes and 2,000 pods; figures in ``e2e/RESULTS.md``); CI runs this one on the session's
three nodes for about a minute: Deployments scaled to a compressed day with bursts, rollouts, Jobs whose
pods complete and are replaced, and one preemption. Every pod the extender's own filter says fits must
be bound within the limit, none may fail admission, and the audit's counts must all be 0.
"""

from __future__ import annotations

from typing import Any

import pytest

from e2e.harness import System
from e2e.load.scenario import SHORT_SERVERS, Load, LoadSpec

pytestmark = pytest.mark.timeout(400)

SHORT = LoadSpec(duration_s=45.0, tick_s=4.0, servers=SHORT_SERVERS, rollout_every_s=8.0, job_every_s=8.0,
                 job_completions=8, job_parallelism=4, job_run_s=(2.0, 5.0), preemptions=1, faults=False,
                 pending_limit_s=30.0, check_every_s=4.0)


def test_a_short_bursty_day_lands_every_pod_it_can(system: System, record: dict[str, Any]) -> None:
    res = Load(system, SHORT).run()
    summary = res.summary()
    record.update({k: summary[k] for k in ("pods_created", "pods_bound", "pods_per_s_bound", "create_to_bind_ms",
                                           "create_to_running_ms", "extender_cpu_ms_per_pod", "stuck_pending",
                                           "admission_failures", "audit")})
    assert not res.errors, res.errors
    assert summary["pods_bound"] >= 40, summary
    assert not res.admission_failures, res.admission_failures
    assert not res.stuck, res.stuck
    assert not any(res.counts.values()), res.problems
    assert res.preempted_for and all(
        any(p.name == name and p.bound is not None for p in res.pods.values()) for name in res.preempted_for), \
        "the preemptor was not placed"
