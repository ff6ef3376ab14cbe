"""``/bind`` whoever calls it (issue 47): the node's rules for the pod, refusals counted and logged at
a bounded rate, and an event per bind written off the bind's path. Against the fake API server through
the real client (the Live harness of test_service.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from extender import wire
from extender.binder import MemoryBinder
from extender.events import REASON, api_event_writer
from extender.service import Extender
from extender.signals import Sample, SignalSnapshot
from gpuslice.config import load_config
from gpuslice.model import Gpu, MigInstance
from tests.extender import test_service
from tests.extender.helpers import wait_for
from tests.extender.test_app import NOW, Clock, gpu_uuid, mps_gpu, node_obj, pod_obj
from tests.extender.test_service import NS, Live, arrange, writes
from tests.fakeapi import FakeApiServer
from tests.gpuslice.test_view import mig_gpu

live = test_service.live  # the Live harness's fixture


def refusals(r: Live, code: str) -> float:
    return r.ext.metrics.bind_refusals.labels(code)._value.get()


@pytest.mark.parametrize("change, says", [
    ({"spec": {"taints": [{"key": "team", "value": "b", "effect": "NoSchedule"}]}},
     "has the taint team=b:NoSchedule that the pod does not tolerate"),
    ({"spec": {"unschedulable": True}}, "is cordoned"),
    ({"metadata": {"labels": {"pool": "other"}}}, None),
])
def test_bind_refuses_a_node_the_pod_may_not_run_on_whoever_calls_it(
        fake_api: FakeApiServer, live: Callable[..., Live], change: dict[str, object], says: str | None) -> None:
    arrange(fake_api, ("p", 2))
    if says is None:
        fake_api.store.update_pod("p", lambda p: p["spec"].__setitem__("nodeSelector", {"pool": "mine"}), NS)
    node = node_obj("gpu-c", [mps_gpu("gpu-c")])
    node["metadata"]["labels"]["pool"] = "mine"
    for key, value in change.items():
        node.setdefault(key, {}).update(value)  # type: ignore[attr-defined]
    fake_api.store.put_node(node)
    r = live()
    assert wait_for(lambda: "gpu-c" in r.ext.view.nodes)
    err = r.bind("p", "gpu-c")  # no filter first: a caller that is not kube-scheduler
    assert err, "bound to a node the pod may not run on"
    assert (says or "does not match the pod's nodeSelector pool=mine") in err
    assert writes(fake_api, "p") == []
    assert refusals(r, "node_rules") == 1
    assert fake_api.store.get_pod("p", NS)["spec"].get("nodeName") is None


def test_refusals_are_logged_once_a_minute_per_reason(fake_api: FakeApiServer, live: Callable[..., Live],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    arrange(fake_api, ("p", 2))
    r = live()
    with caplog.at_level(logging.WARNING, logger="gpu_slice.extender"):
        for _ in range(5):
            assert "no longer exists" in r.bind("gone", "gpu-a", uid="uid-gone")
    lines = [rec for rec in caplog.records if "refused (pod_gone)" in rec.getMessage()]
    assert len(lines) == 1 and refusals(r, "pod_gone") == 5


def test_each_bind_writes_a_slice_assigned_event_off_its_path(fake_api: FakeApiServer,
                                                              live: Callable[..., Live]) -> None:
    arrange(fake_api, ("p", 2))
    r = live()
    r.ext.events = api_event_writer(fake_api.client(retries=False), instance="sched-0",
                                    on_result=r.ext.metrics.bind_event)
    r.ext.events.start()
    try:
        fake_api.hang_next("create", "/api/v1/namespaces/ml/events", 3.0)  # a slow event never slows a bind
        node = r.schedule("p")
        assert fake_api.store.get_pod("p", NS)["spec"]["nodeName"] == node
        assert wait_for(lambda: any(e.get("reason") == REASON for e in fake_api.store.list("events", NS)[0]))
    finally:
        r.ext.events.stop()
    (event,) = [e for e in fake_api.store.list("events", NS)[0] if e.get("reason") == REASON]
    pod = fake_api.store.get_pod("p", NS)
    assignment = test_service.assignment(pod)
    assert assignment is not None
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": NS, "name": "p",
                                       "uid": pod["metadata"]["uid"]}
    assert event["type"] == "Normal" and event["reportingComponent"] == "gpu-slice-extender"
    assert f"node {node}" in event["message"] and f"GPU {gpu_uuid(node)}" in event["message"]
    assert ", ".join(assignment.slice_ids) in event["message"]
    assert r.ext.metrics.bind_events.labels("written")._value.get() == 1


def test_a_busy_mig_instance_is_avoided_by_its_gpu_instance_id() -> None:
    """DCGM activity reaches MIG instances through the inventory's gpuInstanceId (dcgm-exporter's
    GPU_I_ID): of two idle 1g instances the one DCGM shows saturated is not chosen."""
    gpu = mig_gpu("gpu-m", 0, [("1g.10gb", 0), ("1g.10gb", 1), ("3g.40gb", 4)])
    insts = tuple(MigInstance(i.uuid, i.profile, i.start, i.compute_slices, i.memory_mib, gi)
                  for i, gi in zip(gpu.instances, (9, 10, 1), strict=True))
    gpu = Gpu(gpu.uuid, gpu.index, gpu.product, gpu.memory_mib, gpu.mode, gpu.slices, instances=insts)
    clock = Clock()
    ext = Extender(load_config({"version": "v1", "policies": [{"name": "utilization", "weight": 1}]}),
                   MemoryBinder([]), clock=clock)
    ext.load([node_obj("gpu-m", [gpu])])
    def chosen(name: str) -> str:
        pod = pod_obj(name, 1)
        res = ext.filter(wire.ExtenderArgs(pod, node_names=("gpu-m",)))
        held = ext.view.reservations.get(f"uid-{name}")
        assert res.passing == ("gpu-m",) and held is not None
        ext.view.release(f"uid-{name}")
        return held.units[0][1]

    first = chosen("probe")
    busy = next(i for i in insts if i.uuid == first)
    ext.apply_signals(SignalSnapshot(gpu={"gr_engine": {(gpu.uuid, busy.gi): (Sample(0.97, NOW - 5, "gpu-m"),)}},
                                     max_age_s=120.0, clock=clock))
    second = chosen("probe2")
    assert second != first and second in {i.uuid for i in insts if i.profile == "1g.10gb"}
