"""Scenario 4: preemption on a full cluster.

Every GPU is filled with priority-0 slice pods: the MIG instances with MIG-only pods, the three MPS
GPUs with pods of 2, 2, 2 and 1 slices, the whole-mode H100 with a 7-slice pod. Then a pod of 3
MPS slices in a PriorityClass that may preempt arrives. The real kube-scheduler finds it
unschedulable, asks the extender's ``/preempt`` which victims free a valid placement, evicts them and
binds the pod on the next try. Asserted, against a rule this test computes itself from where the
low-priority pods really are: the evicted pods are the fewest that free 3 slices on one MPS GPU
(largest holders first), all on that GPU; the urgent pod lands on that GPU; no other pod is
touched; every DESIGN 8 count is 0.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from e2e.harness import (
    ASSIGNMENT,
    System,
    ann_of,
    clean,
    counts_dict,
    create_all,
    slice_pod,
    wait,
    wait_placed,
)

pytestmark = pytest.mark.timeout(300)

URGENT_CLASS = "e2e-urgent"
MIG_FILL = [3, 2, 1, 1, 4, 2, 1]   # the MIG node's seven instances, exactly
MPS_FILL = [2, 2, 2, 1] * 3        # the three MPS A100s (gpu-mps x2, gpu-mix x1)
URGENT_SLICES = 3


def fewest_victims(holders: dict[str, list[int]], need: int) -> int:
    """Per MPS GPU, the fewest pods (largest first) whose slices add up to ``need``; the least over GPUs."""
    best = 10**9
    for sizes in holders.values():
        total, n = 0, 0
        for k in sorted(sizes, reverse=True):
            if total >= need:
                break
            total += k
            n += 1
        if total >= need:
            best = min(best, n)
    return best


def test_urgent_pod_evicts_the_fewest_and_lands_there(system: System, record: dict[str, Any]) -> None:
    system.kubectl("apply", "-f", "-", stdin=json.dumps({
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": URGENT_CLASS},
        "value": 100000, "preemptionPolicy": "PreemptLowerPriority", "description": "e2e: may preempt"}))
    low = [slice_pod(f"mig-{i}", k, isolation="mig") for i, k in enumerate(MIG_FILL)]
    low += [slice_pod(f"mps-{i}", k, isolation="mps") for i, k in enumerate(MPS_FILL)]
    create_all(system, low)
    placed = wait_placed(system, [p["metadata"]["name"] for p in low])
    # The whole-mode H100 is the only place left for a 7-slice pod.
    create_all(system, [slice_pod("whole-0", 7)])
    placed.update(wait_placed(system, ["whole-0"]))
    assignments = {n: json.loads(ann_of(p)[ASSIGNMENT]) for n, p in placed.items()}
    assert assignments["whole-0"]["node"] == "gpu-mix" and not assignments["whole-0"]["instance"]
    holders: dict[str, list[int]] = {}
    for name, a in assignments.items():
        if name.startswith("mps-"):
            holders.setdefault(a["gpus"][0], []).append(len(a["sliceIds"]))
    assert sorted(sum(v) for v in holders.values()) == [7, 7, 7], holders
    expected = fewest_victims(holders, URGENT_SLICES)
    uids = {n: p["metadata"]["uid"] for n, p in placed.items()}

    t0 = time.monotonic()
    create_all(system, [slice_pod("urgent", URGENT_SLICES, isolation="mps", priority_class=URGENT_CLASS)])
    urgent = wait_placed(system, ["urgent"], timeout=120)["urgent"]
    took = time.monotonic() - t0
    a = json.loads(ann_of(urgent)[ASSIGNMENT])
    gone = sorted(n for n in placed if (now := system.kube.pod(n)) is None or now["metadata"]["uid"] != uids[n])
    record.update(low_priority_pods=len(placed), victims=len(gone), fewest_possible=expected,
                  preempt_and_bind_s=round(took, 1))
    assert gone, "nothing was evicted, yet every GPU was full"
    assert len(gone) == expected, (gone, holders)
    victim_gpus = {assignments[n]["gpus"][0] for n in gone}
    assert all(n.startswith("mps-") for n in gone) and len(victim_gpus) == 1, (gone, victim_gpus)
    assert a["gpus"] == list(victim_gpus), (a, victim_gpus)
    freed = {s for n in gone for s in assignments[n]["sliceIds"]}
    assert set(a["sliceIds"]) <= freed, (a["sliceIds"], freed)
    for name in placed:
        if name not in gone:
            now = system.kube.pod(name)
            assert now is not None and now["status"].get("phase") == "Running", name
    wait("the urgent pod Running", lambda: (system.kube.pod("urgent") or {}).get("status", {}).get("phase")
         == "Running", 60)
    counts = system.settle_and_audit()
    record["counts"] = counts_dict(counts)
    assert not counts.bad(), counts.problems
    clean(system)
