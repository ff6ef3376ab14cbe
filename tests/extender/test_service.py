"""The extender's state layer (extender.service) against the fake API server, through the real client.

An :class:`Extender` is fed by the :class:`Informer` (as ``extender.cli.Service`` wires them) and
binds with the :class:`ApiBinder`, all over HTTP to the fake API server of tests/fakeapi, whose fault
injection can fail a request before it takes effect or after (the unclear case). The verbs are
called with the wire types directly; the HTTP layer is test_app.py's business.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest

from extender import wire
from extender.binder import ApiBinder, MemoryBinder
from extender.errors import KubeApiError
from extender.informer import Informer
from extender.lease import DEFAULT_NAME, DEFAULT_NAMESPACE, Fence
from extender.service import Extender
from extender.signals import Sample, SignalSnapshot
from gpuslice import annotations as ann
from gpuslice.config import default_config, load_config
from gpuslice.fakecluster import FakeClusterSpec, generate
from tests.extender.helpers import WAIT, wait_for
from tests.extender.test_app import (
    NOW,
    Clock,
    free_by_gpu,
    gpu_uuid,
    held_slices,
    mps_gpu,
    node_obj,
    pod_obj,
    slice_ids,
    small_cluster,
    static_extender,
)
from tests.fakeapi import FakeApiServer

NS = "ml"
POD_PATH = "/api/v1/namespaces/ml/pods/{}"
BINDING_PATH = "/api/v1/namespaces/ml/pods/{}/binding"
ME = "gpu-slice-scheduler-0"


# ------------------------------------------------------------------------------------------ harness


@dataclass
class Live:
    """One extender replica: its state, fed by its informer, writing through its binder."""

    api: FakeApiServer
    ext: Extender
    informer: Informer
    relists: list[tuple[str, str]]

    def pod(self, name: str) -> dict[str, Any]:
        return self.api.store.get_pod(name, NS)

    def filter(self, name: str, nodes: tuple[str, ...] = ("gpu-a", "gpu-b")) -> wire.FilterResult:
        return self.ext.filter(wire.ExtenderArgs(self.pod(name), node_names=nodes))

    def bind(self, name: str, node: str, uid: str | None = None) -> str:
        uid = uid or self.pod(name)["metadata"]["uid"]
        return self.ext.bind(wire.ExtenderBindingArgs(name, NS, uid, node)).error

    def schedule(self, name: str, nodes: tuple[str, ...] = ("gpu-a", "gpu-b")) -> str:
        """filter then bind to the one node the filter passes; the node."""
        res = self.filter(name, nodes)
        assert res.error == "" and len(res.passing) == 1, res
        assert self.bind(name, res.passing[0]) == ""
        return res.passing[0]

    def sees_bound(self, name: str, node: str) -> bool:
        """Whether the watch has delivered the pod bound to ``node`` (with its assignment)."""
        p = self.ext.view.pods.get(self.pod(name)["metadata"]["uid"])
        return p is not None and p.info.node == node and p.claim is not None and p.claim.bound


@pytest.fixture
def live(fake_api: FakeApiServer) -> Iterator[Callable[..., Live]]:
    """Start an extender replica on the fake API server (synced when returned); all stopped afterwards."""
    informers: list[Informer] = []

    def start(*, fence: Fence | None = None, watch_timeout_s: int = 30) -> Live:
        client = fake_api.client(retries=False)
        ext = Extender(default_config(), ApiBinder(client, timeout_s=5.0), fence=fence or Fence.disabled())
        relists: list[tuple[str, str]] = []
        informer = Informer(client, ext, watch_timeout_s=watch_timeout_s, request_timeout_s=5.0,
                            on_relist_metric=lambda kind, why: relists.append((kind, why)))
        informers.append(informer)
        informer.start()
        assert informer.wait_synced(WAIT)
        assert ext.ready
        return Live(fake_api, ext, informer, relists)

    yield start
    for informer in informers:
        informer.stop()


def arrange(api: FakeApiServer, *pending: tuple[str, int]) -> None:
    """The small cluster of test_app (gpu-a idle, gpu-b 5/7 used, cpu-1), plus pending pods (name, slices)."""
    for obj in small_cluster():
        if obj["kind"] == "Node":
            api.store.put_node(obj)
        else:
            api.store.put_pod(obj)
    for name, slices in pending:
        api.store.put_pod(pod_obj(name, slices))


def writes(api: FakeApiServer, name: str) -> list[tuple[str, str]]:
    """The writes made to pod ``name`` (and its binding), in order."""
    return [(r.verb, r.path) for r in api.requests
            if r.verb in ("patch", "create", "update") and r.path in (POD_PATH.format(name), BINDING_PATH.format(name))]


def reads(api: FakeApiServer, name: str) -> int:
    return api.request_count("get", POD_PATH.format(name))


def assignment(pod: dict[str, Any]) -> ann.Assignment | None:
    return ann.decode_assignment_for(pod)


def lease(holder: str) -> dict[str, Any]:
    """kube-scheduler's Lease, renewed just now for an hour (freshness is not what these tests time)."""
    renewed = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": DEFAULT_NAME, "namespace": DEFAULT_NAMESPACE},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 3600, "acquireTime": renewed,
                     "renewTime": renewed, "leaseTransitions": 1}}


# ------------------------------------------------------------------------------------------ binding


def test_bind_is_one_binding_that_carries_the_assignment(fake_api: FakeApiServer,
                                                         live: Callable[..., Live]) -> None:
    arrange(fake_api, ("p1", 2))
    r = live()
    uid = r.pod("p1")["metadata"]["uid"]
    res = r.filter("p1")
    assert res.passing == ("gpu-b",)
    reserved = r.ext.view.reservations.get(uid)
    assert reserved is not None
    fake_api.reset_counts()

    assert r.bind("p1", "gpu-b") == ""

    # One write, no read: the pod comes from the watched view, the assignment rides in the Binding.
    assert writes(fake_api, "p1") == [("create", BINDING_PATH.format("p1"))]
    assert reads(fake_api, "p1") == 0
    (sent,) = [q.body for q in fake_api.requests if q.verb == "create" and q.path == BINDING_PATH.format("p1")]
    assert sent["metadata"]["uid"] == uid and sent["target"] == {"apiVersion": "v1", "kind": "Node", "name": "gpu-b"}
    assert set(sent["metadata"]["annotations"]) == {ann.ASSIGNMENT_KEY}
    stored = r.pod("p1")
    assert stored["spec"]["nodeName"] == "gpu-b"
    written = assignment(stored)
    assert written is not None
    assert written.pod_uid == uid
    assert written.node == "gpu-b"
    assert written.gpus == (gpu_uuid("gpu-b"),)
    assert written.slice_ids == reserved.slice_ids
    # The extender counts the pod as bound at once, and the watch confirms it.
    assert r.ext.view.reservations.get(uid) is None
    assert wait_for(lambda: r.sees_bound("p1", "gpu-b"))
    assert {s for s, u in held_slices(r.ext)["gpu-b"].items() if u == uid} == set(reserved.slice_ids)


def test_the_same_pod_bound_twice_is_answered_once(fake_api: FakeApiServer, live: Callable[..., Live]) -> None:
    arrange(fake_api, ("p1", 2), ("p2", 1))
    r = live()
    assert r.schedule("p1") == "gpu-b"
    assert r.bind("p1", "gpu-b") == ""  # kube-scheduler retried: no second write
    assert writes(fake_api, "p1") == [("create", BINDING_PATH.format("p1"))]
    assert "already bound to gpu-b" in r.bind("p1", "gpu-a")

    # Two binds of one pod at the same time: one writes, the other finds it bound.
    res = r.filter("p2")
    node = res.passing[0]
    answers: list[str] = []
    threads = [threading.Thread(target=lambda: answers.append(r.bind("p2", node))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert answers == ["", ""]
    assert writes(fake_api, "p2") == [("create", BINDING_PATH.format("p2"))]


def test_bind_is_refused_while_another_replica_holds_the_lease(fake_api: FakeApiServer,
                                                               live: Callable[..., Live]) -> None:
    arrange(fake_api, ("p1", 2))
    fake_api.store.put_lease(lease("gpu-slice-scheduler-1_0b8e2c1a-5d4f-4c3b-9a8e-7f6d5c4b3a21"))
    fence = Fence(fake_api.client(retries=False), ME)
    r = live(fence=fence)
    assert r.filter("p1").passing == ("gpu-b",)
    fake_api.reset_counts()

    error = r.bind("p1", "gpu-b")
    assert "does not hold its lease kube-system/gpu-slice-scheduler" in error
    assert writes(fake_api, "p1") == []
    assert fake_api.request_count("get", "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/*") == 1
    stored = r.pod("p1")
    assert "nodeName" not in stored["spec"] and assignment(stored) is None

    fake_api.store.remove("leases", DEFAULT_NAME, DEFAULT_NAMESPACE)  # no Lease: nobody leads
    assert "does not hold its lease" in r.bind("p1", "gpu-b")

    fake_api.store.put_lease(lease(f"{ME}_7f6d5c4b-3a21-4c3b-9a8e-0b8e2c1a5d4f"))  # now we lead
    assert r.bind("p1", "gpu-b") == ""
    assert r.pod("p1")["spec"]["nodeName"] == "gpu-b"


@pytest.mark.parametrize("code", [500, 504])
def test_an_unclear_error_after_the_binding_took_effect_is_success(fake_api: FakeApiServer,
                                                                   live: Callable[..., Live], code: int) -> None:
    arrange(fake_api, ("p1", 2))
    r = live()
    uid = r.pod("p1")["metadata"]["uid"]
    reserved = r.ext.view.reservations.get(uid) if r.filter("p1").passing == ("gpu-b",) else None
    assert reserved is not None
    fault = fake_api.fail_next("create", BINDING_PATH.format("p1"), code=code, commit=True)
    fake_api.reset_counts()

    assert r.bind("p1", "gpu-b") == ""

    assert fault.hits == 1
    assert reads(fake_api, "p1") == 1  # only to find out what happened
    stored = r.pod("p1")
    assert stored["spec"]["nodeName"] == "gpu-b"
    written = assignment(stored)
    assert written is not None and written.slice_ids == reserved.slice_ids  # not undone
    assert wait_for(lambda: r.sees_bound("p1", "gpu-b"))
    assert {s for s, u in held_slices(r.ext)["gpu-b"].items() if u == uid} == set(reserved.slice_ids)


@pytest.mark.parametrize(("code", "reads_after"), [(500, 1), (503, 1), (403, 0), (422, 0)])
def test_a_binding_that_failed_before_taking_effect_leaves_nothing_to_undo(
        fake_api: FakeApiServer, live: Callable[..., Live], code: int, reads_after: int) -> None:
    """Unclear (5xx): the pod is read and found unbound. Clear (4xx): not read. Either way the Binding
    wrote nothing (it is atomic): the pod has no assignment and the reservation is released."""
    arrange(fake_api, ("p1", 2))
    r = live()
    uid = r.pod("p1")["metadata"]["uid"]
    before = free_by_gpu(r.ext)
    assert r.filter("p1").passing == ("gpu-b",)
    fake_api.fail_next("create", BINDING_PATH.format("p1"), code=code)
    fake_api.reset_counts()

    error = r.bind("p1", "gpu-b")

    assert error.startswith("bind ml/p1 to gpu-b: ") and str(code) in error
    assert reads(fake_api, "p1") == reads_after
    assert [v for v, _ in writes(fake_api, "p1")] == ["create"]
    stored = r.pod("p1")
    assert "nodeName" not in stored["spec"]
    assert assignment(stored) is None
    assert r.ext.view.reservations.get(uid) is None
    assert free_by_gpu(r.ext) == before  # released
    assert uid not in set(held_slices(r.ext)["gpu-b"].values())

    # kube-scheduler retries the pod: it is placed as if nothing had happened.
    assert r.schedule("p1") == "gpu-b"
    assert r.pod("p1")["spec"]["nodeName"] == "gpu-b"


@pytest.mark.parametrize("took_effect", [True, False])
def test_an_unclear_error_that_cannot_be_cleared_up_keeps_the_reservation(fake_api: FakeApiServer,
                                                                          live: Callable[..., Live],
                                                                          took_effect: bool) -> None:
    """The Binding failed unclearly and the pod cannot be read either: it may be bound, so the slices
    stay held for the pod (its reservation, until its time is up) and the scheduler retries."""
    arrange(fake_api, ("p1", 2))
    r = live()
    uid = r.pod("p1")["metadata"]["uid"]
    assert r.filter("p1").passing == ("gpu-b",)
    reserved = r.ext.view.reservations.get(uid)
    assert reserved is not None
    fake_api.fail_next("get", POD_PATH.format("p1"), code=503)  # the read after the failure fails
    fake_api.fail_next("create", BINDING_PATH.format("p1"), code=500, commit=took_effect)
    fake_api.reset_counts()

    error = r.bind("p1", "gpu-b")

    assert "500" in error and "the outcome is unknown" in error
    assert [v for v, _ in writes(fake_api, "p1")] == ["create"]
    stored = r.pod("p1")
    assert ("nodeName" in stored["spec"]) is took_effect
    assert (assignment(stored) is not None) is took_effect  # atomic: both or neither
    assert set(reserved.slice_ids) == {s for s, u in held_slices(r.ext)["gpu-b"].items() if u == uid}

    # kube-scheduler retries the bind: bound means done; otherwise the Binding is made for the same slices.
    if took_effect:
        assert wait_for(lambda: r.sees_bound("p1", "gpu-b"))
    assert r.bind("p1", "gpu-b") == ""
    assert r.pod("p1")["spec"]["nodeName"] == "gpu-b"
    written = assignment(r.pod("p1"))
    assert written is not None and written.slice_ids == reserved.slice_ids
    assert [v for v, _ in writes(fake_api, "p1")] == ["create"] + ([] if took_effect else ["create"])


def test_bind_decides_on_the_watched_view_without_listing_the_node(fake_api: FakeApiServer,
                                                                    live: Callable[..., Live]) -> None:
    arrange(fake_api, ("p1", 2))
    r = live()
    assert r.filter("p1").passing == ("gpu-b",)
    fake_api.reset_counts()
    assert r.bind("p1", "gpu-b") == ""
    assert fake_api.request_count("list", "/api/v1/pods") == 0
    assert reads(fake_api, "p1") == 0


def stale_refusal(fake_api: FakeApiServer, r: Live) -> None:
    """The view goes stale (its informer stops) while the runner on gpu-b finishes in the API server:
    the view still counts gpu-b's 5 slices, so a 3-slice pod does not fit there by the view alone."""
    r.informer.stop()
    fake_api.store.set_pod_phase("runner", "Succeeded", namespace=NS)
    fake_api.reset_counts()


def test_a_refusal_is_checked_again_against_the_node_pods_read_afresh(fake_api: FakeApiServer,
                                                                     live: Callable[..., Live]) -> None:
    arrange(fake_api, ("p3", 3))
    r = live()
    stale_refusal(fake_api, r)
    assert r.bind("p3", "gpu-b") == ""
    assert fake_api.request_count("list", "/api/v1/pods") == 1
    stored = r.pod("p3")
    written = assignment(stored)
    assert stored["spec"]["nodeName"] == "gpu-b" and written is not None and len(written.slice_ids) == 3


def test_a_failed_read_of_the_node_pods_is_an_error_without_writes(fake_api: FakeApiServer,
                                                                  live: Callable[..., Live]) -> None:
    arrange(fake_api, ("p3", 3))
    r = live()
    stale_refusal(fake_api, r)
    fake_api.fail_next("list", "/api/v1/pods", code=500)
    error = r.bind("p3", "gpu-b")
    assert error.startswith("bind ml/p3: list pods of node gpu-b: 500")
    assert writes(fake_api, "p3") == []
    assert r.bind("p3", "gpu-b") == ""  # the retry reads the node's pods and succeeds


def test_a_refusal_that_the_node_pods_confirm_is_answered(fake_api: FakeApiServer,
                                                          live: Callable[..., Live]) -> None:
    arrange(fake_api, ("p3", 3))
    r = live()
    fake_api.reset_counts()
    assert r.bind("p3", "gpu-b").startswith("slices in use: no fitting GPU has 3 free slices")
    assert fake_api.request_count("list", "/api/v1/pods") == 1
    assert writes(fake_api, "p3") == []
    assert "nodeName" not in r.pod("p3")["spec"]


def test_a_refusal_is_checked_again_when_the_watch_missed_a_deletion(fake_api: FakeApiServer,
                                                                     live: Callable[..., Live]) -> None:
    """The fresh read also removes: the runner on gpu-b is deleted while the view is stale."""
    arrange(fake_api, ("p3", 3))
    r = live()
    r.informer.stop()
    fake_api.store.remove("pods", "runner", NS)
    fake_api.reset_counts()
    assert r.bind("p3", "gpu-b") == ""
    assert fake_api.request_count("list", "/api/v1/pods") == 1
    assert r.ext.view.pod("uid-runner") is None


def preemptor_after_eviction(fake_api: FakeApiServer, r: Live, nominated: str | None) -> None:
    """kube-scheduler preempted the runner on gpu-b for p3 and deleted it; the view missed the
    deletion (its informer stopped). p3 comes back with gpu-b as its nominated node (or none)."""
    r.informer.stop()
    fake_api.store.remove("pods", "runner", NS)
    if nominated is not None:
        fake_api.store.update_pod("p3", lambda p: p.setdefault("status", {}).update(nominatedNodeName=nominated),
                                  namespace=NS)
    fake_api.reset_counts()


def test_a_preemptor_refused_on_its_nominated_node_is_checked_against_its_pods_read_afresh(
        fake_api: FakeApiServer, live: Callable[..., Live]) -> None:
    arrange(fake_api, ("p3", 7))
    r = live()
    preemptor_after_eviction(fake_api, r, "gpu-b")
    # Asked about gpu-b alone first, as kube-scheduler does with a nominated node: a refusal here would
    # make it preempt again elsewhere, since it no longer sees the runner.
    res = r.filter("p3", ("gpu-b",))
    assert res.passing == ("gpu-b",) and res.error == ""
    assert fake_api.request_count("list", "/api/v1/pods") == 1
    assert r.ext.view.pod("uid-runner") is None
    assert r.bind("p3", "gpu-b") == ""


def test_a_refusal_without_a_nominated_node_is_answered_from_the_view(fake_api: FakeApiServer,
                                                                      live: Callable[..., Live]) -> None:
    arrange(fake_api, ("p3", 7))
    r = live()
    preemptor_after_eviction(fake_api, r, None)
    res = r.filter("p3", ("gpu-b",))
    assert res.passing == () and "gpu-b" in res.failed
    assert fake_api.request_count("list", "/api/v1/pods") == 0


def test_a_failed_read_of_the_nominated_node_keeps_the_views_answer(fake_api: FakeApiServer,
                                                                     live: Callable[..., Live]) -> None:
    arrange(fake_api, ("p3", 7))
    r = live()
    preemptor_after_eviction(fake_api, r, "gpu-b")
    fake_api.fail_next("list", "/api/v1/pods", code=500)
    res = r.filter("p3", ("gpu-b",))
    assert res.passing == () and res.error == "" and "gpu-b" in res.failed
    assert r.filter("p3", ("gpu-b",)).passing == ("gpu-b",)  # the next try reads the node's pods


def test_a_dropped_connection_is_unclear_and_released_once_the_pod_reads_unbound(
        fake_api: FakeApiServer, live: Callable[..., Live]) -> None:
    arrange(fake_api, ("p1", 2))
    r = live()
    uid = r.pod("p1")["metadata"]["uid"]
    assert r.filter("p1").passing == ("gpu-b",)
    fake_api.inject("create", BINDING_PATH.format("p1"), drop=True)
    fake_api.reset_counts()
    assert r.bind("p1", "gpu-b").startswith("bind ml/p1 to gpu-b: bind pod ml/p1 to gpu-b: ")
    assert reads(fake_api, "p1") == 1
    assert assignment(r.pod("p1")) is None
    assert uid not in set(held_slices(r.ext)["gpu-b"].values())


def test_a_pod_replaced_under_the_same_name_is_not_bound(fake_api: FakeApiServer, live: Callable[..., Live]) -> None:
    arrange(fake_api, ("p1", 2))
    r = live()
    old_uid = r.pod("p1")["metadata"]["uid"]
    assert r.filter("p1").passing == ("gpu-b",)
    r.informer.stop()  # the view still holds the old pod: the Binding's UID precondition refuses it
    fake_api.store.remove("pods", "p1", NS)
    fake_api.store.put_pod(pod_obj("p1", 2, uid="uid-p1-again"))
    fake_api.reset_counts()

    assert "was replaced" in r.bind("p1", "gpu-b", uid=old_uid)
    assert writes(fake_api, "p1") == [("create", BINDING_PATH.format("p1"))]  # refused with 409
    assert reads(fake_api, "p1") == 1
    assert "nodeName" not in r.pod("p1")["spec"] and assignment(r.pod("p1")) is None
    assert r.ext.view.reservations.get(old_uid) is None


# ------------------------------------------------------------------------------------------ the watch


def test_watch_events_keep_the_view_in_step(fake_api: FakeApiServer, live: Callable[..., Live]) -> None:
    arrange(fake_api, ("p1", 2))
    r = live()
    runner = "uid-runner"
    assert runner in set(held_slices(r.ext)["gpu-b"].values())

    fake_api.store.set_pod_phase("runner", "Succeeded", namespace=NS)  # leaves the selection: DELETED
    assert wait_for(lambda: runner not in r.ext.view.pods)
    assert held_slices(r.ext)["gpu-b"] == {}

    fake_api.store.remove("nodes", "gpu-b")
    fake_api.store.put_node(node_obj("gpu-new", [mps_gpu("gpu-new")]))
    assert wait_for(lambda: "gpu-new" in r.ext.view.nodes and "gpu-b" not in r.ext.view.nodes)
    res = r.filter("p1", ("gpu-b", "gpu-new"))
    assert res.passing == ("gpu-new",)
    assert "not known" in res.failed["gpu-b"]


def test_a_watch_410_relists_and_the_view_drops_what_it_missed(fake_api: FakeApiServer,
                                                              live: Callable[..., Live]) -> None:
    arrange(fake_api)
    r = live(watch_timeout_s=1)
    assert "uid-runner" in set(held_slices(r.ext)["gpu-b"].values())
    # The next pod watch is answered 410 Gone after a second; the runner goes away meanwhile, so only
    # a fresh list can tell the extender.
    fault = fake_api.inject("watch", "/api/v1/pods", code=410, delay=1.0)
    assert wait_for(lambda: fault.hits == 1)
    fake_api.store.remove("pods", "runner", NS)
    assert wait_for(lambda: ("Pod", "gone") in r.relists)
    assert wait_for(lambda: "uid-runner" not in r.ext.view.pods)
    assert held_slices(r.ext)["gpu-b"] == {}
    assert r.ext.ready
    fake_api.store.put_pod(pod_obj("p9", 1))  # and it watches again
    assert wait_for(lambda: "uid-p9" in r.ext.view.pods)


# ------------------------------------------------------------------------------------------ restart


def learned(ext: Extender) -> list[dict[Any, int]]:
    """What the learning policies have counted (their target workloads), per policy."""
    mems = ext.sched.memory if isinstance(ext.sched.memory, tuple) else (ext.sched.memory,)
    return [dict(m.target.counts) for m in mems if hasattr(m, "target")]


def test_a_restarted_extender_rebuilds_the_same_state_and_decides_the_same(fake_api: FakeApiServer,
                                                                          live: Callable[..., Live]) -> None:
    cluster = generate(FakeClusterSpec(nodes=3, gpus_per_node=2, mode="mps", pods_per_node=2, seed=11))
    for obj in cluster.document["items"]:
        (fake_api.store.put_node if obj["kind"] == "Node" else fake_api.store.put_pod)(obj)
    nodes = tuple(o["metadata"]["name"] for o in cluster.document["items"] if o["kind"] == "Node")
    for name, slices in (("a1", 3), ("a2", 1), ("a3", 2), ("a4", 2)):
        fake_api.store.put_pod(pod_obj(name, slices))

    first = live()
    placed = {name: first.schedule(name, nodes) for name in ("a1", "a2", "a3", "a4")}
    assert all(wait_for(lambda n=n, node=node: first.sees_bound(n, node)) for n, node in placed.items())
    first.informer.stop()
    assert first.ext.view.reservations.get(first.pod("a1")["metadata"]["uid"]) is None

    second = live()  # a new process: nothing but what the API server holds
    assert held_slices(second.ext) == held_slices(first.ext)
    assert free_by_gpu(second.ext) == free_by_gpu(first.ext)
    for name, node in placed.items():
        written = assignment(second.pod(name))
        assert written is not None and written.node == node
        assert {s for s, u in held_slices(second.ext)[node].items()
                if u == written.pod_uid} == set(written.slice_ids)
    assert learned(second.ext) == learned(first.ext)  # the policies learned the same workload

    fake_api.store.put_pod(pod_obj("next", 2))
    a, b = first.filter("next", nodes), second.filter("next", nodes)
    assert a.passing == b.passing and len(a.passing) == 1
    assert dict(a.failed) == dict(b.failed)
    uid = first.pod("next")["metadata"]["uid"]
    ra, rb = first.ext.view.reservations.get(uid), second.ext.view.reservations.get(uid)
    assert ra is not None and rb is not None and ra.slice_ids == rb.slice_ids


def test_the_policies_learn_each_pod_once_as_it_is_first_filtered() -> None:
    """As the simulator observes each arriving pod once, the extender's policies learn each new pod once
    (kube-scheduler filters a pod again on every retry), and the pods already placed at start."""
    ext = static_extender(small_cluster())
    assert sum(learned(ext)[0].values()) == 1  # the runner, at the first sync
    names = ("gpu-a", "gpu-b")
    for _ in range(3):
        ext.filter(wire.ExtenderArgs(pod_obj("p1", 2), node_names=names))
    ext.filter(wire.ExtenderArgs(pod_obj("p2", 1), node_names=names))
    ext.filter(wire.ExtenderArgs(pod_obj("web", 0), node_names=names))  # asks no slices: not a GPU shape
    counts = learned(ext)[0]
    assert sum(counts.values()) == 3
    assert sorted(key[1] for key, n in counts.items() for _ in range(n)) == [1, 2, 5]  # slices per GPU


def test_the_dry_run_binder_keeps_pods_it_was_asked_about() -> None:
    ext = static_extender(small_cluster())
    binder = ext.binder
    assert isinstance(binder, MemoryBinder)
    pod = pod_obj("p1", 2)
    res = ext.filter(wire.ExtenderArgs(pod, node_names=("gpu-a", "gpu-b")))
    assert ext.bind(wire.ExtenderBindingArgs("p1", NS, "uid-p1", res.passing[0])).error == ""
    assert binder.node_pods("gpu-b")[-1]["metadata"]["name"] == "p1"
    assert slice_ids(gpu_uuid("gpu-b"), 2, start=5) == list(
        ann.decode_assignment(binder.pods[(NS, "p1")]["metadata"]["annotations"][ann.ASSIGNMENT_KEY]).slice_ids)


# ------------------------------------------------------------------------------------------ signals


def _probe(ext: Extender, name: str, names: tuple[str, ...]) -> str:
    """The one node a 1-slice pod's narrowed /filter passes; its reservation is let go again."""
    res = ext.filter(wire.ExtenderArgs(pod_obj(name, 1), node_names=names))
    ext.view.release(f"uid-{name}")
    assert len(res.passing) == 1
    return res.passing[0]


def test_live_signals_steer_placement_and_stale_ones_are_neutral() -> None:
    """apply_signals: OpenCost's live node price replaces the annotated one, DCGM activity feeds the
    utilization policy; a sample older than the snapshot's max age counts as no sample."""
    priced = node_obj("gpu-c", [mps_gpu("gpu-c")])
    priced["metadata"]["annotations"][ann.HOURLY_COST_KEY] = "4.00"
    items = [node_obj("gpu-a", [mps_gpu("gpu-a")]), priced]
    config = load_config({"version": "v1", "policies": [{"name": "utilization", "weight": 1}]})
    clock = Clock()
    ext = Extender(config, MemoryBinder([]), clock=clock)
    ext.load(items)
    names = ("gpu-a", "gpu-c")

    def choice(name: str) -> str:
        return _probe(ext, name, names)

    idle = choice("probe")
    busy_node, other = idle, next(n for n in names if n != idle)

    def snapshot(at: float) -> SignalSnapshot:
        return SignalSnapshot(
            gpu={"gr_engine": {(gpu_uuid(busy_node), None): (Sample(0.95, at, busy_node),),
                               (gpu_uuid(other), None): (Sample(0.05, at, other),)}},
            nodes={"node_total_cost": {"gpu-c": Sample(9.5, at, "gpu-c")}}, max_age_s=120.0, clock=clock)

    st = ext.view.state
    row_c = ext.view.node_row("gpu-c")
    assert st.node_cost[row_c] == 4.0
    ext.apply_signals(snapshot(NOW - 10))
    assert st.node_cost[row_c] == 9.5
    assert choice("probe2") == other  # the busy GPU is avoided

    clock.now = NOW + 1000  # Prometheus has had nothing newer since: every sample is stale
    ext.apply_signals(snapshot(NOW - 10))  # back to the annotated price, and activity is neutral
    assert st.node_cost[row_c] == 4.0
    assert choice("probe3") == idle


@pytest.mark.parametrize(("busy", "moved"), [(0.55, False), (0.9, True)])
def test_only_a_hot_gpu_moves_a_pod_off_its_packing_choice(busy: float, moved: bool) -> None:
    """Activity up to utilization.HOT_FROM is headroom: the default mix keeps packing onto it."""
    items = [node_obj("gpu-a", [mps_gpu("gpu-a")]), node_obj("gpu-c", [mps_gpu("gpu-c")])]
    clock = Clock()
    ext = Extender(load_config({"version": "v1"}), MemoryBinder([]), clock=clock)
    ext.load(items)
    names = ("gpu-a", "gpu-c")
    idle = _probe(ext, "probe", names)
    other = next(n for n in names if n != idle)
    ext.apply_signals(SignalSnapshot(
        gpu={"gr_engine": {(gpu_uuid(idle), None): (Sample(busy, NOW - 10, idle),),
                           (gpu_uuid(other), None): (Sample(0.0, NOW - 10, other),)}},
        nodes={}, max_age_s=120.0, clock=clock))
    assert _probe(ext, "probe2", names) == (other if moved else idle)


def test_events_the_core_cannot_read_are_ignored() -> None:
    ext = static_extender(small_cluster())
    before = held_slices(ext)
    ext.on_event("Pod", "ADDED", {"metadata": {"name": "no-uid", "namespace": NS}})
    ext.on_event("Pod", "MODIFIED", {"metadata": {"name": "x", "uid": "u"}, "spec": "not an object"})
    ext.on_event("Node", "ADDED", {"metadata": {}})
    assert held_slices(ext) == before
    ext.on_event("Pod", "DELETED", {"metadata": {"name": "runner", "namespace": NS, "uid": "uid-runner"}})
    ext.on_event("Node", "DELETED", {"metadata": {"name": "gpu-a"}})
    assert held_slices(ext) == {"gpu-b": {}}


def test_the_dry_run_binder_refuses_what_the_api_server_would() -> None:
    binder = MemoryBinder([pod_obj("p1", 2)])
    with pytest.raises(KubeApiError) as err:
        binder.bind(NS, "ghost", "uid-ghost", "gpu-a", {})
    assert err.value.status == 404
    with pytest.raises(KubeApiError) as err:
        binder.bind(NS, "p1", "uid-of-another-p1", "gpu-a", {ann.ASSIGNMENT_KEY: "{}"})
    assert err.value.status == 409
    assert ann.ASSIGNMENT_KEY not in ((binder.read_pod(NS, "p1") or {})["metadata"].get("annotations") or {})
    assert binder.read_pod(NS, "ghost") is None
    binder.bind(NS, "p1", "uid-p1", "gpu-a", {ann.ASSIGNMENT_KEY: "{}"})
    bound = binder.read_pod(NS, "p1")
    assert bound is not None and bound["spec"]["nodeName"] == "gpu-a"
    assert bound["metadata"]["annotations"][ann.ASSIGNMENT_KEY] == "{}"  # merged with the bind, as the API server does
    with pytest.raises(KubeApiError) as err:
        binder.bind(NS, "p1", "uid-p1", "gpu-b", {ann.ASSIGNMENT_KEY: "{\"other\": 1}"})
    assert err.value.status == 409 and "already assigned to node gpu-a" in str(err.value)
    assert (binder.read_pod(NS, "p1") or {})["metadata"]["annotations"][ann.ASSIGNMENT_KEY] == "{}"
    assert binder.binds == [(NS, "p1", "gpu-a")]


class _RacingBinder(MemoryBinder):
    """A binder whose Binding is refused with 409 because another call already bound the pod there."""

    def bind(self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str]) -> None:
        super().bind(namespace, name, uid, node, annotations)
        raise KubeApiError(f'pod {name} is already assigned to node "{node}"', 409)


def test_a_409_already_assigned_to_the_same_node_is_success() -> None:
    from tests.extender.test_app import Clock, pod_obj, small_cluster

    items = small_cluster()
    pod = pod_obj("p1", 1)
    ext = Extender(default_config(), _RacingBinder([i for i in items if i.get("kind") == "Pod"] + [pod]),
                   clock=Clock())
    ext.load([*items, pod])
    chosen = ext.filter(wire.extender_args({"Pod": pod, "NodeNames": ["gpu-a", "gpu-b"], "Nodes": None}))
    node = chosen.node_names[0] if chosen.node_names else ""
    meta = pod["metadata"]
    result = ext.bind(wire.ExtenderBindingArgs(meta["name"], meta["namespace"], meta["uid"], node))
    assert result.error == ""
    assert ext.view.pod(meta["uid"]) is not None and ext.view.pod(meta["uid"]).node == node


# ------------------------------------------------------------------------------- informer transform


def test_pods_projected_by_the_transform_give_the_same_state_as_the_objects() -> None:
    """The informer hands over projections (no dicts held through a list); the counting rule's result
    and the refusal of an unprojectable pod are as with the objects themselves."""
    items = generate(FakeClusterSpec(nodes=4, gpus_per_node=2, pods_per_node=3, seed=5)).document["items"]
    nodes = [i for i in items if i["kind"] == "Node"]
    pods = [i for i in items if i["kind"] == "Pod"]
    by_objects = Extender(default_config(), MemoryBinder([]))
    by_objects.on_relist("Node", [dict(n) for n in nodes])
    by_objects.on_relist("Pod", [dict(p) for p in pods])
    projected = Extender(default_config(), MemoryBinder([]))
    projected.on_relist("Node", [projected.transform("Node", dict(n)) for n in nodes])
    listed = [projected.transform("Pod", dict(p)) for p in pods]
    assert all(not isinstance(p, dict) for p in listed)
    projected.on_relist("Pod", listed)
    assert held_slices(projected) == held_slices(by_objects) and held_slices(projected)
    assert set(projected.view.pods) == set(by_objects.view.pods)

    # Events: a deleted pod frees its slices, a re-added one holds them again.
    gone = pods[0]
    uid = gone["metadata"]["uid"]
    node = gone["spec"]["nodeName"]
    projected.on_event("Pod", "DELETED", projected.transform("Pod", gone))
    assert uid not in set(held_slices(projected)[node].values())
    projected.on_event("Pod", "ADDED", projected.transform("Pod", gone))
    assert held_slices(projected) == held_slices(by_objects)

    # A pod without a UID stays a (slim) mapping and is refused where it is applied.
    broken = {"metadata": {"name": "x", "namespace": "ml"}, "spec": {"containers": []}}
    slim = projected.transform("Pod", broken)
    assert isinstance(slim, dict)
    projected.on_event("Pod", "ADDED", slim)
    assert held_slices(projected) == held_slices(by_objects)
