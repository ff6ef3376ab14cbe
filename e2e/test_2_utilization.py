"""Scenario 2: utilization. Once Prometheus has scraped a GPU's DCGM activity, new pods avoid it.

A 6-slice MPS pod lands on some GPU G. With G idle, a 1-slice MPS probe lands on G too: it fills G
exactly and keeps the other GPUs whole, packing's strongest preference. Then the first pod's
``example.com/simulated-utilization`` goes to 100: its device plugin's dcgm-exporter-compatible
series report G near saturation, the test waits until the real Prometheus has scraped that and the
leading extender's signal refresher has had time to read it; a second probe must then land on
another GPU.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from typing import Any

import pytest

from e2e.harness import (
    ASSIGNMENT,
    TEST_NS,
    System,
    ann_of,
    clean,
    counts_dict,
    create_all,
    http,
    place_and_remove,
    slice_pod,
    wait,
    wait_placed,
)

pytestmark = pytest.mark.timeout(300)

UTILIZATION = "example.com/simulated-utilization"


def _gpu(pod: dict[str, Any]) -> str:
    gpu: str = json.loads(ann_of(pod)[ASSIGNMENT])["gpus"][0]
    return gpu


def _activity(system: System, gpu: str) -> float | None:
    """The newest DCGM graphics-engine activity Prometheus holds for ``gpu`` (0..1), or None."""
    query = urllib.parse.quote(f'max(DCGM_FI_PROF_GR_ENGINE_ACTIVE{{UUID="{gpu}"}})')
    status, raw = http("GET", f"{system.prometheus_url}/api/v1/query?query={query}")
    if status != 200:
        return None
    result = json.loads(raw)["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def test_busy_gpu_is_avoided_once_scraped(system: System, record: dict[str, Any]) -> None:
    create_all(system, [slice_pod("busy", 6, isolation="mps", annotations={UTILIZATION: "0"})])
    gpu = _gpu(wait_placed(system, ["busy"])["busy"])
    wait("Prometheus holding the idle GPU's activity", lambda: _activity(system, gpu) == 0.0, 60)

    idle_choice = _gpu(place_and_remove(system, slice_pod("probe-idle", 1, isolation="mps")))
    assert idle_choice == gpu, "precondition: with every GPU idle, packing puts the probe beside the busy pod"

    t0 = time.monotonic()
    system.kube.core.patch_namespaced_pod("busy", TEST_NS, {"metadata": {"annotations": {UTILIZATION: "100"}}})
    wait("Prometheus scraping the GPU busy", lambda: (_activity(system, gpu) or 0.0) > 0.5, 60)
    scraped = time.monotonic() - t0
    time.sleep(5)  # the extender's signal refresher runs every 2 s here (--signal-interval 2)

    create_all(system, [slice_pod("probe-busy", 1, isolation="mps")])
    busy_choice = _gpu(wait_placed(system, ["probe-busy"])["probe-busy"])
    record.update(busy_gpu=gpu, probe_when_idle=idle_choice, probe_when_busy=busy_choice,
                  scraped_after_s=round(scraped, 1))
    assert busy_choice != gpu, f"the probe went to the busy GPU {gpu}"
    counts = system.settle_and_audit()
    record["counts"] = counts_dict(counts)
    assert not counts.bad(), counts.problems
    clean(system)
