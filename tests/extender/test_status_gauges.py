"""Stranded-slice and Pending-by-reason gauges on the extender's /metrics (extender.status_gauges):
the status's own figures, bounded labels, served from one summary for a while, nothing before sync,
and registered by the Service so ``GET /metrics`` carries them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from extender.app import build_app
from extender.binder import MemoryBinder
from extender.cli import Service, build_settings
from extender.service import Extender
from extender.status_gauges import StatusGauges, reason_label
from gpuslice.config import default_config
from tests.extender.test_app import TestClient
from tests.extender.test_cli import parse
from tests.gpuslice.test_view import A_LAYOUT, NOW, mig_gpu, mps_gpu, node_obj, pod_obj, sids


def objects() -> list[dict[str, Any]]:
    mps, mig = mps_gpu("n1", 0), mig_gpu("n1", 1, A_LAYOUT)  # MIG 3g + 2g + 1g
    three_g = mig.instances[0]
    return [node_obj("n1", [mps, mig]),
            pod_obj("a", 3, node="n1", assigned=sids(three_g.uuid, 3), isolation="mig"),
            pod_obj("b", 5, node="n1", assigned=sids(mps.uuid, 5)),
            pod_obj("big", 7, isolation="mig"),  # no 7g instance: refused, a layout matter
            pod_obj("big2", 7, isolation="mig"),
            pod_obj("bad", 2, gpu_memory="20GB"),  # not a quantity
            pod_obj("small", 2, isolation="mps")]  # fits the MPS GPU now


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def extender(ready: bool = True) -> Extender:
    ext = Extender(default_config(), MemoryBinder(), clock=lambda: NOW)
    if ready:
        ext.load(objects())
    return ext


def gauges(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in registry.collect() for s in fam.samples
            if s.name.startswith("gpu_slice_cluster_")}


def test_stranded_slices_and_pending_pods_by_reason() -> None:
    registry = CollectorRegistry()
    registry.register(StatusGauges(extender()))
    got = gauges(registry)
    # the 2g and 1g MIG instances are free and no shape takes them: 3 and 7 MIG slices, 5 and 2 MPS ones
    assert got[("gpu_slice_cluster_stranded_slices", (("mode", "mig"), ("product", "H100-80GB")))] == 3
    pending = {dict(k[1])["reason"]: v for k, v in got.items() if k[0] == "gpu_slice_cluster_pending_pods"}
    assert pending == {"size": 2, "invalid_request": 1, "fits": 1}  # size: no instance of 7 slices anywhere
    assert got[("gpu_slice_cluster_summary_seconds", ())] >= 0


def test_one_summary_serves_scrapes_for_a_while_and_nothing_is_served_before_sync() -> None:
    clock = Clock()
    g = StatusGauges(extender(), clock=clock, min_interval_s=10)
    registry = CollectorRegistry()
    registry.register(g)
    gauges(registry)
    gauges(registry)
    assert g.builds == 1
    clock.now += 11
    gauges(registry)
    assert g.builds == 2
    idle = CollectorRegistry()
    idle.register(StatusGauges(extender(ready=False)))
    assert gauges(idle) == {}


def test_reason_labels_are_bounded_codes() -> None:
    assert reason_label("invalid", "") == "invalid_request" and reason_label("no-nodes", "") == "no_nodes"
    assert reason_label("refused", "slices in use: no fitting GPU has 3 free slices (at most 1 of 7 free)") == \
        "slices_busy"
    assert reason_label("refused", "something nobody wrote yet") == "other"


def test_the_service_serves_them_on_metrics(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objects()}))
    service = Service(build_settings(parse("--cluster", str(path))))
    service.start()
    try:
        with TestClient(build_app(service.ext)) as c:
            text = c.get("/metrics").text
        assert 'gpu_slice_cluster_stranded_slices{mode="mig",product="H100-80GB"} 3.0' in text
        assert 'gpu_slice_cluster_pending_pods{reason="size"} 2.0' in text
    finally:
        service.stop()
