"""Scenario 7: the operator's view.

* ``gpu-slice status`` over the live cluster (the admin kubeconfig, as an operator runs it) agrees
  slice for slice with kubelet's PodResources on every node: each pod kubelet gave slices to is
  listed on that node with exactly those ids, stamped (``allocated``), and no other pod is.
* The slice map on the leading extender, behind its token gate, in a real browser (Debian's
  chromium through chromium-driver): a user bound to ``gpu-slice-slicemap-reader`` signs in with a
  ``kubectl create token`` token and sees one rectangle per GPU and every running pod's name, and the
  Pending pod with its reason; the page is saved as a screenshot (``GPU_SLICE_E2E_SCREENSHOT=FILE``
  keeps it; the README shows one).
* A Pending pod that may not preempt (``gpu-slice-serving``: preemptionPolicy Never) on a full cluster:
  ``status`` names the fewest lower-priority pods to evict; deleting exactly those lets it land, on
  the node named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from e2e import browser as web
from e2e.harness import (
    ASSIGNMENT,
    TEST_NS,
    System,
    _kubelet_ids,
    ann_of,
    clean,
    counts_dict,
    create_all,
    http,
    slice_pod,
    wait,
    wait_placed,
)

pytestmark = pytest.mark.timeout(420)

BATCH = [("v-mig-3", 3, None, "mig"), ("v-mig-2", 2, "20Gi", "mig"), ("v-mps-2", 2, None, "mps"),
         ("v-mps-3", 3, None, "mps"), ("v-7", 7, None, None), ("v-1", 1, "10Gi", None)]
MPS_FILL = [2, 2, 2, 1] * 3  # the three MPS A100s (gpu-mps x2, gpu-mix x1), exactly
VIEWER = "slicemap-viewer"


def status(system: System) -> dict[str, Any]:
    """``gpu-slice status -o json`` as an operator runs it: the admin kubeconfig, the shipped config."""
    done = subprocess.run([sys.executable, "-m", "gpuslice_cli", "status", "--kubeconfig", str(system.admin),
                           "--config", str(system.extender_config), "-o", "json"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def wait_unschedulable(system: System, name: str) -> None:
    """Until kube-scheduler has tried the pod and marked it Unschedulable."""
    wait(f"{name} refused by the scheduler", lambda: any(
        c.get("reason") == "Unschedulable" for c in (system.kube.pod(name) or {}).get("status", {}).get(
            "conditions") or []), 60)


def viewer_token(system: System) -> str:
    """A token of a service account bound to gpu-slice-slicemap-reader, as an operator would use."""
    system.kubectl("create", "serviceaccount", VIEWER, "-n", TEST_NS, check=False)
    system.kubectl("create", "clusterrolebinding", VIEWER, "--clusterrole=gpu-slice-slicemap-reader",
                   f"--serviceaccount={TEST_NS}:{VIEWER}", check=False)
    return system.kubectl("create", "token", VIEWER, "-n", TEST_NS).stdout.strip()


def no_reservations(system: System) -> None:
    """Until the leading extender holds no filter-time reservation (the slice map's data, which
    expires them as the extender does): an earlier scenario's /filter probes of pods that never
    existed hold slices for the reservation TTL, and this scenario needs every slice it counts."""
    token = viewer_token(system)
    lead = system.wait_leader()

    def clear() -> bool:
        status, raw = http("GET", f"{lead.ops_url}/slicemap/api/status", headers={"Authorization": f"Bearer {token}"})
        assert status == 200, (status, raw[:300])
        data = json.loads(raw)
        return not any(h["source"] == "reserved" for n in data["nodes"] for g in n["gpus"] for u in g["units"]
                       for h in u["holders"])
    wait("no reservation held by the leading extender", clear, 90, interval=1.0)


def held_by_status(data: dict[str, Any]) -> dict[str, dict[tuple[str, str], tuple[str, ...]]]:
    out: dict[str, dict[tuple[str, str], list[str]]] = {}
    for node in data["nodes"]:
        for gpu in node["gpus"]:
            for unit in gpu["units"]:
                for h in unit["holders"]:
                    ns, name = h["pod"].split("/", 1)
                    out.setdefault(node["name"], {}).setdefault((ns, name), []).extend(h["ids"])
    return {n: {k: tuple(sorted(v)) for k, v in pods.items()} for n, pods in out.items()}


def test_status_agrees_with_kubelet_and_the_slice_map_shows_it(system: System, record: dict[str, Any],
                                                               tmp_path: Path) -> None:
    create_all(system, [slice_pod(n, k, memory=m, isolation=i) for n, k, m, i in BATCH])
    placed = wait_placed(system, [n for n, *_ in BATCH])
    # One pod that cannot land anywhere: 5 slices of MIG isolation (no 5g profile on an H100).
    create_all(system, [slice_pod("v-pending", 5, isolation="mig")])
    wait_unschedulable(system, "v-pending")

    data = status(system)
    ours = held_by_status(data)
    kubelet = {n.name: {k: tuple(sorted(v)) for k, v in _kubelet_ids(n.pod_resources).items()}
               for n in system.nodes.values()}
    record["pods_compared"] = sum(len(v) for v in kubelet.values())
    assert record["pods_compared"] == len(BATCH)
    for node in system.nodes:
        assert ours.get(node, {}) == kubelet[node], (node, ours.get(node), kubelet[node])
    sources = {h["source"] for n in data["nodes"] for g in n["gpus"] for u in g["units"] for h in u["holders"]}
    assert sources == {"allocated"}
    assert data["disagreements"] == [] and data["capacity"]["gpus"] == 6
    assert data["capacity"]["held"] == sum(k for _, k, *_ in BATCH)
    (pending,) = data["pending"]
    assert pending["pod"] == f"{TEST_NS}/v-pending" and "no MIG profile of H100-80GB has 5 compute slices" in \
        pending["reason"]
    # kubectl-style table too, for the record
    table = subprocess.run([sys.executable, "-m", "gpuslice_cli", "status", "--kubeconfig", str(system.admin),
                            "--config", str(system.extender_config)], capture_output=True, text=True, timeout=120,
                           check=True).stdout
    assert table.splitlines()[0].split()[:3] == ["NODE", "GPU", "PRODUCT"] and "default/v-pending" in table

    reason = web.skip_reason()
    if reason:
        pytest.skip(reason)
    token = viewer_token(system)
    lead = system.wait_leader()
    shot = Path(os.environ.get("GPU_SLICE_E2E_SCREENSHOT") or tmp_path / "slicemap.png")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    t0 = time.monotonic()
    with web.browser(1440, 1000) as driver:
        driver.get(f"{lead.ops_url}/slicemap")
        # Without a token the page asks for one and shows no data.
        WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "login").is_displayed())
        assert not driver.find_elements(By.CSS_SELECTOR, ".gpu")
        driver.find_element(By.ID, "token").send_keys(token)
        driver.find_element(By.ID, "use-token").click()
        WebDriverWait(driver, 30).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded"))
        gpus = driver.find_elements(By.CSS_SELECTOR, ".gpu")
        shown = {e.get_attribute("data-pod")
                 for e in driver.find_elements(By.CSS_SELECTOR, "[data-pod][data-source='allocated']")}
        pending_rows = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#pending tbody tr")]
        totals = driver.find_element(By.ID, "totals").text
        driver.save_screenshot(str(shot))
    record.update(browser_s=round(time.monotonic() - t0, 1), screenshot=str(shot))
    assert len(gpus) == 6, totals
    assert shown == {f"{TEST_NS}/{n}" for n, *_ in BATCH}, shown
    assert any("v-pending" in r and "no MIG profile" in r for r in pending_rows), pending_rows
    assert "6 GPUs" in totals.replace("\n", " ")
    assert shot.stat().st_size > 10_000
    assert placed


def test_a_suggested_eviction_applied_lets_the_pending_pod_land(system: System, record: dict[str, Any]) -> None:
    no_reservations(system)
    low = [slice_pod(f"e-mps-{i}", k, isolation="mps") for i, k in enumerate(MPS_FILL)]
    create_all(system, low)
    placed = wait_placed(system, [p["metadata"]["name"] for p in low])
    # gpu-slice-serving never preempts: kube-scheduler leaves the pod Pending; status says what to do.
    create_all(system, [slice_pod("e-urgent", 3, isolation="mps", priority_class="gpu-slice-serving")])
    wait_unschedulable(system, "e-urgent")
    data = status(system)
    (pending,) = [p for p in data["pending"] if p["pod"] == f"{TEST_NS}/e-urgent"]
    assert pending["priority"] == 1000 and "slices in use" in pending["reason"]
    evict = next(s for s in pending["suggestions"] if s["kind"] == "evict")
    victims = [p.split("/", 1)[1] for p in evict["pods"]]
    record.update(victims=victims, suggestion=evict["text"])
    assert 1 <= len(victims) <= 2 and all(v.startswith("e-mps-") for v in victims), evict
    gpus = {json.loads(ann_of(placed[v])[ASSIGNMENT])["gpus"][0] for v in victims}
    assert len(gpus) == 1 and {placed[v]["spec"]["nodeName"] for v in victims} == {evict["node"]}

    for v in victims:
        system.kube.delete_pod(v)
    urgent = wait_placed(system, ["e-urgent"], timeout=120)["e-urgent"]
    a = json.loads(ann_of(urgent)[ASSIGNMENT])
    assert urgent["spec"]["nodeName"] == evict["node"] and a["gpus"] == list(gpus), (a, evict)
    for name in placed:
        if name not in victims:
            assert (system.kube.pod(name) or {}).get("status", {}).get("phase") == "Running", name
    counts = system.settle_and_audit()
    record["counts"] = counts_dict(counts)
    assert not counts.bad(), counts.problems
    clean(system)
