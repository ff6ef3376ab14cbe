"""Scenario 11: a MIG layout that follows demand, on a kubelet-dm node (issue 51; named to run last).

The node's H100 holds seven 1g.10gb instances and one of them runs a pod. A pod asking a 3-slice MIG
instance is refused by the extender (no 3g instance exists); the extender publishes a re-cut of three
free 1g instances into one 3g.40gb on the Node, the device plugin applies it (the used 1g kept),
stamps the result and re-advertises, kube-scheduler retries the pod on the plugin's label change, and
it lands on the new instance. Checked: the used instance and its pod untouched, kubelet's PodResources
ids = each pod's assignment, no instance that held a pod destroyed (counted), the DESIGN 8 audit all 0.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from e2e.harness import (
    ALLOCATED,
    ASSIGNMENT,
    INVENTORY,
    System,
    _kubelet_ids,
    ann_of,
    audit,
    counts_dict,
    create_all,
    slice_pod,
    wait,
    wait_placed,
)
from e2e.miglayouts import dynamic_node

pytestmark = pytest.mark.timeout(300)

STATUS = "example.com/gpu-slice.mig-layout-status"
WISH = "example.com/gpu-slice.mig-layout"


def _on(node: str, body: dict[str, Any]) -> dict[str, Any]:
    body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    return body


def _instances(system: System, node: str) -> dict[str, tuple[str, int]]:
    (gpu,) = json.loads(ann_of(system.kube.node(node))[INVENTORY])["gpus"]
    return {i["uuid"]: (i["profile"], i["start"]) for i in gpu["instances"]}


def test_a_3g_pod_lands_after_a_recut_that_keeps_the_used_1g(system: System, record: dict[str, Any]) -> None:
    with dynamic_node(system) as node:
        create_all(system, [_on(node, slice_pod("small", 1, isolation="mig"))])
        small = wait_placed(system, ["small"])["small"]
        used = json.loads(ann_of(small)[ASSIGNMENT])["instance"]
        before = _instances(system, node)
        assert len(before) == 7 and before[used][0] == "1g.10gb"

        t0 = time.monotonic()
        create_all(system, [_on(node, slice_pod("big", 3, isolation="mig"))])
        big = wait_placed(system, ["big"], timeout=120)["big"]
        landed_s = time.monotonic() - t0
        after = _instances(system, node)
        assignment = json.loads(ann_of(big)[ASSIGNMENT])
        assert after[assignment["instance"]][0] == "3g.40gb" and assignment["instance"] not in before
        # The used 1g instance is kept; only free 1g instances were destroyed (counted, not assumed).
        assert used in after and after[used] == before[used]
        held_before = {used}
        destroyed_in_use = len(held_before - set(after))
        assert destroyed_in_use == 0
        destroyed = sorted(set(before) - set(after))
        assert len(destroyed) == 3 and all(before[u][0] == "1g.10gb" for u in destroyed)
        # The plugin's stamp and the extender's wish.
        notes = ann_of(system.kube.node(node))
        (result,) = json.loads(notes[STATUS])["gpus"]
        assert result["state"] == "applied", result
        assert json.loads(notes[WISH])["gpus"][0]["pods"] == [big["metadata"]["uid"]]
        # kubelet's own ids: each pod's = its assignment = its allocated stamp, the small pod's unchanged.
        kubelet = _kubelet_ids(system.nodes[node].pod_resources)
        for pod in (system.kube.pod("small"), system.kube.pod("big")):
            assert pod is not None
            ids = set(json.loads(ann_of(pod)[ASSIGNMENT])["sliceIds"])
            assert set(kubelet[("default", pod["metadata"]["name"])]) == ids
            assert set(json.loads(ann_of(pod)[ALLOCATED])["sliceIds"]) == ids
        assert system.kube.pod("small")["metadata"]["uid"] == small["metadata"]["uid"]  # type: ignore[index]

        def settled() -> bool:
            return not audit(system.kube, {n.name: n.pod_resources for n in system.nodes.values()}).bad()
        wait("the DESIGN 8 counts at 0", settled, 60, interval=1.0)
        counts = audit(system.kube, {n.name: n.pod_resources for n in system.nodes.values()})
        record.update({"landed_after_recut_s": round(landed_s, 1), "destroyed_free": len(destroyed),
                       "destroyed_in_use": destroyed_in_use, "counts": counts_dict(counts)})
        assert not counts.bad(), counts.problems
        for name in ("small", "big"):
            system.kube.delete_pod(name)
        wait("the scenario's pods gone", lambda: not system.kube.pods(), 60, interval=0.5)
