"""Preemption through the extender against the fake API server (issue 47): ``/preempt`` within
kube-scheduler's proposal, most important first, budgets counted; the node's pods read afresh before
naming a pod outside the proposal; the extender's own route for shape-only shortfalls (Eviction API,
slices held for the preemptor, a refused eviction gives the hold back)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from extender import wire
from extender.binder import ApiBinder
from extender.informer import Informer
from extender.lease import Fence
from extender.preemptor import ShapePreemptor
from extender.service import Extender
from gpuslice import annotations as ann
from gpuslice.config import default_config
from gpuslice.requests import ISOLATION_KEY
from gpuslice.scheduler import WAITING
from tests.extender.helpers import WAIT, wait_for
from tests.extender.test_app import NOW_DT, node_obj, pod_obj
from tests.fakeapi import FakeApiServer
from tests.gpuslice.test_view import mig_gpu, mig_uuid

NS = "ml"


def mig_node(name: str) -> dict[str, Any]:
    """One H100: 2g (start 0), 1g (2), 1g (3), 3g (4)."""
    return node_obj(name, [mig_gpu(name, 0, [("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4)])])


def on_mig(name: str, node: str, start: int, k: int, priority: int, **labels: str) -> dict[str, Any]:
    inst = mig_uuid(node, 0, str(start))
    held = [f"{inst}::{n}" for n in range(k)]
    pod = pod_obj(name, k, node=node, priority=priority)
    pod["metadata"]["annotations"][ann.ASSIGNMENT_KEY] = ann.encode_assignment(ann.Assignment(
        f"uid-{name}", node, (f"GPU-{node}-0000",), inst, tuple(held), "fragmentation", NOW_DT))
    pod["metadata"]["labels"] = dict(labels)
    return pod


def budget(name: str, allowed: int, **match: str) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"matchLabels": dict(match)}}, "status": {"disruptionsAllowed": allowed}}


@pytest.fixture
def started(fake_api: FakeApiServer) -> Iterator[Callable[..., Extender]]:
    informers: list[Informer] = []

    def start(*, budgets: bool = True) -> Extender:
        client = fake_api.client(retries=False)
        ext = Extender(default_config(), ApiBinder(client, timeout_s=5.0), fence=Fence.disabled())
        informer = Informer(client, ext, watch_timeout_s=30, request_timeout_s=5.0, budgets=budgets)
        if budgets:
            ext.expect.add("PodDisruptionBudget")
        informers.append(informer)
        informer.start()
        assert informer.wait_synced(WAIT) and ext.ready
        return ext

    yield start
    for informer in informers:
        informer.stop()


def arrange(api: FakeApiServer, *objs: dict[str, Any]) -> None:
    for obj in objs:
        if obj["kind"] == "Node":
            api.store.put_node(obj)
        elif obj["kind"] == "Pod":
            api.store.put_pod(obj)
        else:
            api.store.put("poddisruptionbudgets", obj)


def preempt_args(pod: dict[str, Any], proposal: dict[str, list[str]]) -> wire.ExtenderPreemptionArgs:
    return wire.ExtenderPreemptionArgs(pod, {n: wire.Victims(tuple(u)) for n, u in proposal.items()})


def test_preempt_answers_within_the_proposal_most_important_first_with_violations(
        fake_api: FakeApiServer, started: Callable[..., Extender]) -> None:
    arrange(fake_api, mig_node("n1"), on_mig("two", "n1", 0, 2, 5, app="db"), on_mig("one", "n1", 2, 1, 1),
            on_mig("three", "n1", 4, 3, 1), budget("db", 0, app="db"))
    ext = started()
    urgent = pod_obj("urgent", 2, priority=100)
    urgent["metadata"]["annotations"][ISOLATION_KEY] = "mig"
    fake_api.store.put_pod(urgent)
    everyone = ["uid-two", "uid-one", "uid-three"]
    got = ext.preempt(preempt_args(urgent, {"n1": everyone})).to_json()
    # The only 2-slice shape is the 2g instance: its holder goes, and its budget is broken (counted).
    assert got == {"NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": "uid-two"}], "NumPDBViolations": 1}}}


def test_a_victim_outside_the_proposal_is_named_only_after_reading_the_node(
        fake_api: FakeApiServer, started: Callable[..., Extender]) -> None:
    arrange(fake_api, mig_node("n1"), on_mig("holder", "n1", 0, 2, 1), on_mig("big", "n1", 4, 3, 1000))
    ext = started()
    urgent = pod_obj("urgent", 2, priority=100)
    urgent["metadata"]["annotations"][ISOLATION_KEY] = "mig"
    fake_api.store.put_pod(urgent)
    # A pod the API server no longer holds, still in the view (the watch is behind), on the 1g instances.
    ghost = on_mig("ghost", "n1", 2, 1, 0)
    ghost["metadata"]["uid"] = "uid-ghost"
    with ext.lock:
        ext.view.upsert_pod(ghost, ext.clock())
    fake_api.reset_counts()
    got = ext.preempt(preempt_args(urgent, {"n1": ["uid-ghost"]})).to_json()
    assert got["NodeNameToMetaVictims"] == {"n1": {"Pods": [{"UID": "uid-holder"}], "NumPDBViolations": 0}}
    assert fake_api.request_count("list", "/api/v1/pods") == 1  # the node's pods, read once
    assert "uid-ghost" not in ext.view.pods


def shape_setup(fake_api: FakeApiServer, started: Callable[..., Extender], *, budgets: bool = True,
                **holder_labels: str) -> tuple[Extender, ShapePreemptor, dict[str, Any], list[str]]:
    """n1 (one H100: 2g, 1g, 1g, 3g) with its 2g held by a priority-0 pod and its 3g by a priority-1000
    one, and a pending 2-slice MIG pod of priority 100: enough free slices by count, none in its shape."""
    urgent = pod_obj("urgent", 2, priority=100)
    urgent["metadata"]["annotations"][ISOLATION_KEY] = "mig"
    arrange(fake_api, mig_node("n1"), on_mig("holder", "n1", 0, 2, 0, **holder_labels),
            on_mig("big", "n1", 4, 3, 1000), urgent)
    ext = started(budgets=budgets)
    outcomes: list[str] = []
    binder = ext.binder
    assert isinstance(binder, ApiBinder)
    ext.shape = ShapePreemptor(ext, binder.evict, settle_s=0.2, on_outcome=outcomes.append)
    ext.shape.start()
    urgent = fake_api.store.get_pod("urgent", NS)
    return ext, ext.shape, urgent, outcomes


def test_a_shape_only_shortfall_is_preempted_here_and_the_freed_slices_are_held(
        fake_api: FakeApiServer, started: Callable[..., Extender]) -> None:
    ext, shape, urgent, outcomes = shape_setup(fake_api, started)
    try:
        res = ext.filter(wire.ExtenderArgs(urgent, node_names=("n1",)))
        assert res.passing == ()
        # kube-scheduler does not call /preempt (its dry run counts 2 free slices): the extender does.
        assert wait_for(lambda: outcomes == ["evicted"])
        assert fake_api.store.find("pods", "holder", NS) is None  # evicted (deleted) through pods/eviction
        assert fake_api.request_count("create", "/api/v1/namespaces/ml/pods/holder/eviction") == 1
        assert wait_for(lambda: "uid-holder" not in ext.view.pods)
        # kube-scheduler retries the pod as soon as it sees the victim go; the watch here may still be
        # behind (the victim put back into the view): the held node's pods are read afresh, not waited on.
        with ext.lock:
            ext.view.upsert_pod(on_mig("holder", "n1", 0, 2, 0), ext.clock())
        res = ext.filter(wire.ExtenderArgs(urgent, node_names=("n1",)))
        assert res.passing == ("n1",), res
        assert "uid-holder" not in ext.view.pods
        held = ext.view.reservations.get("uid-urgent")
        assert held is not None and held.slice_ids == tuple(f"{mig_uuid('n1', 0, '0')}::{n}" for n in range(2))
    finally:
        shape.stop()


def test_kube_scheduler_preempting_itself_means_nothing_is_done_here(
        fake_api: FakeApiServer, started: Callable[..., Extender]) -> None:
    ext, shape, urgent, outcomes = shape_setup(fake_api, started)
    try:
        shape.settle_s = 5.0
        assert ext.filter(wire.ExtenderArgs(urgent, node_names=("n1",))).passing == ()
        answer = ext.preempt(preempt_args(urgent, {"n1": ["uid-holder"]}))
        assert list(answer.victims) == ["n1"]
        shape.saw("uid-next-pod")  # kube-scheduler moved on
        assert not wait_for(lambda: bool(outcomes), timeout=1.0)
        assert fake_api.store.find("pods", "holder", NS) is not None
    finally:
        shape.stop()


def test_a_refused_eviction_gives_the_hold_back(fake_api: FakeApiServer, started: Callable[..., Extender]) -> None:
    """A budget the extender has not seen yet (a race): the API server refuses the eviction (429)."""
    ext, shape, urgent, outcomes = shape_setup(fake_api, started, budgets=False, app="db")
    fake_api.store.put("poddisruptionbudgets", budget("db", 0, app="db"))
    try:
        assert ext.filter(wire.ExtenderArgs(urgent, node_names=("n1",))).passing == ()
        assert wait_for(lambda: outcomes == ["eviction_refused"])
        assert fake_api.store.find("pods", "holder", NS) is not None
        assert "uid-urgent" not in ext.view.reservations
        res = ext.filter(wire.ExtenderArgs(urgent, node_names=("n1",)))
        assert res.passing == () and res.failed.get("n1") != WAITING
    finally:
        shape.stop()
