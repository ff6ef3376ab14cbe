"""The fake API server, exercised only through the real ``kubernetes`` client over HTTP."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import urllib3
from kubernetes import client, watch
from kubernetes.client import ApiException

from tests.fakeapi import FakeApiServer

NS = "default"


def pod(name: str, *, node: str | None = None, labels: dict[str, str] | None = None,
        slices: str | None = None) -> client.V1Pod:
    resources = client.V1ResourceRequirements(limits={"example.com/gpu-slice": slices}) if slices else None
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1PodSpec(node_name=node,
                              containers=[client.V1Container(name="main", image="busybox", resources=resources)]),
    )


def node(name: str) -> client.V1Node:
    return client.V1Node(metadata=client.V1ObjectMeta(name=name, labels={"zone": "a"}))


def binding(pod_name: str, node_name: str, uid: str | None = None) -> client.V1Binding:
    return client.V1Binding(metadata=client.V1ObjectMeta(name=pod_name, uid=uid),
                            target=client.V1ObjectReference(kind="Node", name=node_name))


def bind(core: client.CoreV1Api, pod_name: str, node_name: str, uid: str | None = None) -> dict[str, Any]:
    """The API server answers a Binding with a Status, which the typed client cannot parse into a
    V1Binding; real callers must read the raw answer too."""
    resp = core.create_namespaced_pod_binding(pod_name, NS, binding(pod_name, node_name, uid),
                                              _preload_content=False)
    assert resp.status == 201
    result: dict[str, Any] = json.loads(resp.data)
    return result


def error_body(exc: pytest.ExceptionInfo[ApiException]) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(exc.value.body)
    return body


@pytest.fixture
def core(fake_api: FakeApiServer) -> client.CoreV1Api:
    return client.CoreV1Api(fake_api.client())


@pytest.fixture
def coord(fake_api: FakeApiServer) -> client.CoordinationV1Api:
    return client.CoordinationV1Api(fake_api.client())


# ------------------------------------------------------------------------------------------- CRUD


def test_pod_create_get_list_delete(core: client.CoreV1Api) -> None:
    created = core.create_namespaced_pod(NS, pod("a", slices="2", labels={"app": "x"}))
    assert created.metadata.uid and created.metadata.creation_timestamp
    assert created.status.phase == "Pending"
    assert created.spec.scheduler_name == "default-scheduler"
    assert created.spec.containers[0].resources.requests == {"example.com/gpu-slice": "2"}  # from limits
    core.create_namespaced_pod(NS, pod("b", node="n1", labels={"app": "y"}))
    core.create_namespaced_pod("other", pod("c", node="n1"))

    assert core.read_namespaced_pod("a", NS).metadata.uid == created.metadata.uid
    listed = core.list_namespaced_pod(NS)
    assert [p.metadata.name for p in listed.items] == ["a", "b"]
    assert int(listed.metadata.resource_version) == 3
    on_n1 = core.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1").items
    assert sorted(p.metadata.name for p in on_n1) == ["b", "c"]
    assert [p.metadata.name for p in core.list_namespaced_pod(NS, field_selector="metadata.name=b").items] == ["b"]
    assert [p.metadata.name for p in core.list_namespaced_pod(NS, field_selector="spec.nodeName=").items] == ["a"]
    assert [p.metadata.name for p in core.list_namespaced_pod(NS, label_selector="app=x").items] == ["a"]
    assert [p.metadata.name for p in core.list_namespaced_pod(NS, label_selector="app in (x,y),app!=y").items] \
        == ["a"]

    deleted = core.delete_namespaced_pod("a", NS)
    assert deleted.metadata.name == "a"
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_pod("a", NS)
    assert exc.value.status == 404
    assert error_body(exc) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": 'pods "a" not found', "reason": "NotFound", "details": {"name": "a", "kind": "pods"},
        "code": 404,
    }


def test_create_errors_are_real_status_objects(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("a"))
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod(NS, pod("a"))
    assert exc.value.status == 409 and error_body(exc)["reason"] == "AlreadyExists"

    bad = client.V1Pod(metadata=client.V1ObjectMeta(name="Bad_Name"),
                       spec=client.V1PodSpec(containers=[client.V1Container(name="c")]))
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod(NS, bad)
    body = error_body(exc)
    assert exc.value.status == 422 and body["reason"] == "Invalid" and body["status"] == "Failure"
    assert {c["field"] for c in body["details"]["causes"]} == {"metadata.name", "spec.containers[0].image"}

    mismatch = pod("m")
    mismatch.spec.containers[0].resources = client.V1ResourceRequirements(
        requests={"example.com/gpu-slice": "1"}, limits={"example.com/gpu-slice": "2"})
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod(NS, mismatch)
    assert exc.value.status == 422

    with pytest.raises(ApiException) as exc:
        core.list_namespaced_pod(NS, field_selector="spec.priority=1")
    assert exc.value.status == 400


def test_patch_flavours_and_status_subresource(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("a"))
    p = core.patch_namespaced_pod("a", NS, {"metadata": {"annotations": {"k": "v", "gone": "x"}}})
    assert p.metadata.annotations == {"k": "v", "gone": "x"}
    p = core.patch_namespaced_pod("a", NS, {"metadata": {"annotations": {"gone": None}}},
                                  _content_type="application/merge-patch+json")
    assert p.metadata.annotations == {"k": "v"}
    # JSON patch (a list body) with a test op: a compare-and-swap on an annotation.
    p = core.patch_namespaced_pod("a", NS, [
        {"op": "test", "path": "/metadata/annotations/k", "value": "v"},
        {"op": "replace", "path": "/metadata/annotations/k", "value": "w"},
    ])
    assert p.metadata.annotations == {"k": "w"}
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_pod("a", NS, [{"op": "test", "path": "/metadata/annotations/k", "value": "v"}])
    assert exc.value.status == 422

    # The main resource ignores status; the status subresource ignores spec.
    rv = p.metadata.resource_version
    p = core.patch_namespaced_pod("a", NS, {"status": {"phase": "Running"}})
    assert p.status.phase == "Pending" and p.metadata.resource_version == rv  # no-op: no new version
    p = core.patch_namespaced_pod_status("a", NS, {"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}]}})
    assert p.status.phase == "Running"
    p = core.patch_namespaced_pod_status("a", NS, {"status": {"conditions": [
        {"type": "Ready", "status": "False"}, {"type": "ContainersReady", "status": "False"}]}})
    assert {c.type: c.status for c in p.status.conditions} == {"Ready": "False", "ContainersReady": "False"}

    # spec.nodeName may only be set through pods/binding.
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_pod("a", NS, {"spec": {"nodeName": "n1"}})
    assert exc.value.status == 422
    # A resourceVersion inside a patch is a precondition.
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_pod("a", NS, {"metadata": {"resourceVersion": "1", "labels": {"x": "y"}}})
    assert exc.value.status == 409 and error_body(exc)["reason"] == "Conflict"


def test_node_status_patch_and_replace_conflict(core: client.CoreV1Api) -> None:
    core.create_node(node("n1"))
    n = core.patch_node_status("n1", {"status": {
        "capacity": {"example.com/gpu-slice": "14"}, "allocatable": {"example.com/gpu-slice": "14"}}})
    assert n.status.allocatable == {"example.com/gpu-slice": "14"}
    n = core.patch_node("n1", {"metadata": {"annotations": {"example.com/gpu-slice.inventory": "{}"}},
                               "status": {"capacity": {"example.com/gpu-slice": "99"}}})
    assert n.status.capacity == {"example.com/gpu-slice": "14"}
    assert n.metadata.annotations == {"example.com/gpu-slice.inventory": "{}"}

    fresh = core.read_node("n1")
    fresh.metadata.labels["example.com/gpu-slice.mode"] = "mps"
    stale = core.read_node("n1")
    core.replace_node("n1", fresh)
    stale.metadata.labels["example.com/gpu-slice.mode"] = "mig"
    with pytest.raises(ApiException) as exc:
        core.replace_node("n1", stale)
    assert exc.value.status == 409
    assert "the object has been modified" in error_body(exc)["message"]
    assert core.read_node("n1").metadata.labels["example.com/gpu-slice.mode"] == "mps"
    assert [x.metadata.name for x in core.list_node(label_selector="zone=a").items] == ["n1"]
    core.delete_node("n1")
    assert core.list_node().items == []


# ---------------------------------------------------------------------------------------- binding


def test_binding_success_conflict_missing_and_uid(core: client.CoreV1Api) -> None:
    created = core.create_namespaced_pod(NS, pod("a"))
    b = binding("a", "n1", uid=created.metadata.uid)
    b.metadata.annotations = {"example.com/gpu-slice.assignment": "{}"}
    resp = core.create_namespaced_pod_binding("a", NS, b, _preload_content=False)
    assert resp.status == 201
    assert json.loads(resp.data) == {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                     "status": "Success", "code": 201}
    bound = core.read_namespaced_pod("a", NS)
    assert bound.spec.node_name == "n1"
    assert bound.metadata.annotations == {"example.com/gpu-slice.assignment": "{}"}
    assert [(c.type, c.status) for c in bound.status.conditions] == [("PodScheduled", "True")]

    with pytest.raises(ApiException) as exc:
        bind(core, "a", "n2")
    assert exc.value.status == 409
    assert error_body(exc)["details"] == {"name": "a", "kind": "pods/binding"}
    assert core.read_namespaced_pod("a", NS).spec.node_name == "n1"

    with pytest.raises(ApiException) as exc:
        bind(core, "missing", "n1")
    assert exc.value.status == 404

    core.create_namespaced_pod(NS, pod("b"))
    with pytest.raises(ApiException) as exc:
        bind(core, "b", "n1", uid="not-the-uid")
    assert exc.value.status == 409 and "Precondition failed" in error_body(exc)["message"]
    assert core.read_namespaced_pod("b", NS).spec.node_name is None

    # The older namespaced /bindings endpoint behaves the same.
    resp = core.create_namespaced_binding(NS, binding("b", "n2"), _preload_content=False)
    assert resp.status == 201 and core.read_namespaced_pod("b", NS).spec.node_name == "n2"


# ------------------------------------------------------------------------------------------ watch


def test_watch_from_resource_version(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("old"))
    start = core.list_namespaced_pod(NS).metadata.resource_version
    core.create_namespaced_pod(NS, pod("a"))
    core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"x": "1"}}})
    core.delete_namespaced_pod("a", NS)
    core.create_node(node("n1"))  # another resource: not in a pod watch

    events = [(e["type"], e["object"].metadata.name, e["object"].metadata.resource_version)
              for e in watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=start,
                                            timeout_seconds=1)]
    assert [(t, n) for t, n, _ in events] == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]
    versions = [int(rv) for _, _, rv in events]
    assert versions == sorted(versions) and versions[0] > int(start)


def test_watch_streams_live_events_and_selector_transitions(fake_api: FakeApiServer,
                                                            core: client.CoreV1Api) -> None:
    """A node-scoped pod watch (what the device plugin runs) sees a pod appear when it is bound."""
    start = core.list_pod_for_all_namespaces().metadata.resource_version
    seen: list[tuple[str, str]] = []
    w = watch.Watch()

    def run() -> None:
        for e in w.stream(core.list_pod_for_all_namespaces, field_selector="spec.nodeName=n1",
                          resource_version=start, timeout_seconds=30):
            seen.append((e["type"], e["object"].metadata.name))
            if len(seen) == 2:
                w.stop()

    thread = threading.Thread(target=run)
    thread.start()
    core.create_namespaced_pod(NS, pod("a"))
    core.create_namespaced_pod(NS, pod("b"))
    bind(core, "a", "n1")
    core.delete_namespaced_pod("a", NS)
    # The thread ends as soon as it has both events; the long server timeout and join only give a
    # loaded CI machine room (a 5 s budget once ran out there), they never add time to a passing run.
    thread.join(timeout=30)
    assert not thread.is_alive(), f"watch still running after 30 s; events seen: {seen}"
    assert seen == [("ADDED", "a"), ("DELETED", "a")]


def test_watch_without_version_sends_current_state(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("a"))
    events = list(watch.Watch().stream(core.list_namespaced_pod, NS, timeout_seconds=1))
    assert [(e["type"], e["object"].metadata.name) for e in events] == [("ADDED", "a")]


def test_watch_gone_after_compaction(fake_api: FakeApiServer, core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("a"))
    old = core.list_namespaced_pod(NS).metadata.resource_version
    core.create_namespaced_pod(NS, pod("b"))
    fake_api.store.compact()

    # With a timeout the client does not retry: the ERROR event becomes ApiException(410).
    with pytest.raises(ApiException) as exc:
        list(watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=old, timeout_seconds=2))
    assert exc.value.status == 410
    # Without one it retries once from the same version, then gives up the same way.
    with pytest.raises(ApiException) as exc:
        list(watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=old))
    assert exc.value.status == 410

    # The raw stream carries the API server's ERROR event with a Status object.
    raw = core.list_namespaced_pod(NS, watch=True, resource_version=old, _preload_content=False)
    lines = [json.loads(line) for line in raw.data.decode().splitlines()]
    assert lines == [{"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": f"too old resource version: {old} ({fake_api.store.compacted_rv})",
        "reason": "Expired", "code": 410}}]

    # The current version still works.
    now = core.list_namespaced_pod(NS).metadata.resource_version
    assert list(watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=now,
                                     timeout_seconds=1)) == []


def test_bounded_history_expires_old_versions() -> None:
    with FakeApiServer(history_size=3) as api:
        core = client.CoreV1Api(api.client())
        for i in range(5):
            core.create_namespaced_pod(NS, pod(f"p{i}"))
        with pytest.raises(ApiException) as exc:
            list(watch.Watch().stream(core.list_namespaced_pod, NS, resource_version="1", timeout_seconds=1))
        assert exc.value.status == 410
        events = list(watch.Watch().stream(core.list_namespaced_pod, NS, resource_version="2",
                                           timeout_seconds=1))
        assert [e["object"].metadata.name for e in events] == ["p2", "p3", "p4"]


def test_list_pagination_and_expired_continue(fake_api: FakeApiServer, core: client.CoreV1Api) -> None:
    for i in range(5):
        core.create_namespaced_pod(NS, pod(f"p{i}"))
    first = core.list_namespaced_pod(NS, limit=2)
    assert [p.metadata.name for p in first.items] == ["p0", "p1"] and first.metadata._continue
    second = core.list_namespaced_pod(NS, limit=2, _continue=first.metadata._continue)
    assert [p.metadata.name for p in second.items] == ["p2", "p3"]
    core.create_namespaced_pod(NS, pod("p5"))
    fake_api.store.compact()
    with pytest.raises(ApiException) as exc:
        core.list_namespaced_pod(NS, limit=2, _continue=second.metadata._continue)
    assert exc.value.status == 410 and error_body(exc)["reason"] == "Expired"


def test_watch_timeout_and_server_stop_end_watches() -> None:
    api = FakeApiServer().start()
    core = client.CoreV1Api(api.client())
    began = time.monotonic()
    assert list(watch.Watch().stream(core.list_node, timeout_seconds=1)) == []
    assert 0.9 <= time.monotonic() - began < 3

    ended = threading.Event()

    def forever() -> None:
        try:
            for _ in watch.Watch().stream(core.list_node, resource_version="0"):
                pass
        except (urllib3.exceptions.HTTPError, OSError):
            pass  # ending the stream by closing the socket is fine too
        finally:
            ended.set()

    thread = threading.Thread(target=forever, daemon=True)
    thread.start()
    time.sleep(0.2)
    api.stop()
    assert ended.wait(3), "a watch outlived the server"


# ----------------------------------------------------------------------------------- leases, events


def test_lease_create_replace_conflict(coord: client.CoordinationV1Api) -> None:
    lease = client.V1Lease(metadata=client.V1ObjectMeta(name="gpu-slice-scheduler"),
                           spec=client.V1LeaseSpec(holder_identity="a", lease_duration_seconds=15))
    created = coord.create_namespaced_lease("kube-system", lease)
    assert created.api_version == "coordination.k8s.io/v1" and created.kind == "Lease"
    mine = coord.read_namespaced_lease("gpu-slice-scheduler", "kube-system")
    theirs = coord.read_namespaced_lease("gpu-slice-scheduler", "kube-system")
    theirs.spec.holder_identity = "b"
    coord.replace_namespaced_lease("gpu-slice-scheduler", "kube-system", theirs)
    mine.spec.holder_identity = "a2"
    with pytest.raises(ApiException) as exc:
        coord.replace_namespaced_lease("gpu-slice-scheduler", "kube-system", mine)
    assert exc.value.status == 409
    got = coord.read_namespaced_lease("gpu-slice-scheduler", "kube-system")
    assert got.spec.holder_identity == "b"
    assert [x.metadata.name for x in coord.list_namespaced_lease("kube-system").items] == ["gpu-slice-scheduler"]


def test_events_create_and_list(core: client.CoreV1Api) -> None:
    event = client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name="gpu-"),
        involved_object=client.V1ObjectReference(kind="Node", name="n1"),
        reason="GPUUnhealthy", message="XID 79", type="Warning",
    )
    created = core.create_namespaced_event(NS, event)
    assert created.metadata.name.startswith("gpu-") and len(created.metadata.name) == 9
    listed = core.list_namespaced_event(NS, field_selector="involvedObject.name=n1,reason=GPUUnhealthy")
    assert [e.message for e in listed.items] == ["XID 79"]
    assert core.list_event_for_all_namespaces(field_selector="type=Normal").items == []


# ------------------------------------------------------------------------- faults and test helpers


def test_fault_injection_fail_commit_hang_drop_and_counts(fake_api: FakeApiServer,
                                                          core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("a"))
    fake_api.fail_next("patch", "/api/v1/namespaces/*/pods/*", code=500)
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"x": "1"}}})
    assert exc.value.status == 500 and error_body(exc)["reason"] == "InternalError"
    assert core.read_namespaced_pod("a", NS).metadata.labels is None
    core.patch_namespaced_pod("a", NS, {"metadata": {"labels": {"x": "1"}}})  # only the next one failed

    # An unclear error: the Binding took effect but the client hears 503.
    core.create_namespaced_pod(NS, pod("b"))
    fake_api.inject("create", "*/pods/b/binding", code=503, commit=True)
    with pytest.raises(ApiException) as exc:
        bind(core, "b", "n1")
    assert exc.value.status == 503
    assert core.read_namespaced_pod("b", NS).spec.node_name == "n1"

    # A slow API server: the client's timeout fires. (urllib3 by default retries a GET after a read
    # timeout, which would hit the next, unfaulted request; hence a client without retries.)
    no_retry = client.CoreV1Api(fake_api.client(retries=False))
    fake_api.hang_next("get", "/api/v1/nodes/*", seconds=1.0)
    core.create_node(node("n1"))
    with pytest.raises(urllib3.exceptions.HTTPError):
        no_retry.read_node("n1", _request_timeout=0.2)
    assert core.read_node("n1").metadata.name == "n1"

    # A dropped connection: no answer at all.
    fake_api.inject("create", "/api/v1/nodes", drop=True)
    with pytest.raises(urllib3.exceptions.HTTPError):
        no_retry.create_node(node("n2"))

    assert fake_api.request_count("patch", "/api/v1/namespaces/default/pods/a") == 2
    assert fake_api.request_count("create", "*/binding") == 1
    assert fake_api.request_count("get", "/api/v1/nodes/n1") == 2
    assert fake_api.counts[("create", "/api/v1/nodes")] == 2


def test_store_helpers_are_seen_by_clients_and_watches(fake_api: FakeApiServer,
                                                       core: client.CoreV1Api) -> None:
    store = fake_api.store
    store.put_node({"metadata": {"name": "n1"}, "status": {"allocatable": {"example.com/gpu-slice": "7"}}})
    start = str(store.resource_version)  # not "0", which means "current state, then changes"
    store.put_pod(pod("a", node="n1"))  # models are accepted too
    store.set_pod_phase("a", "Succeeded")
    assert core.read_namespaced_pod("a", NS).status.phase == "Succeeded"
    assert core.read_node("n1").status.allocatable == {"example.com/gpu-slice": "7"}
    events = list(watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=start, timeout_seconds=1))
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED"]

    def annotate() -> None:
        time.sleep(0.1)
        core.patch_namespaced_pod("a", NS, {"metadata": {"annotations": {"done": "1"}}})

    threading.Thread(target=annotate).start()
    assert store.wait_until(lambda s: "done" in (s.get_pod("a")["metadata"].get("annotations") or {}), 3)
    assert not store.wait_until(lambda s: False, timeout=0.1)


def test_graceful_pod_deletion() -> None:
    with FakeApiServer(graceful_pod_deletion=True) as api:
        core = client.CoreV1Api(api.client())
        core.create_namespaced_pod(NS, pod("a"))
        core.create_namespaced_pod(NS, pod("b"))
        bind(core, "a", "n1")
        terminating = core.delete_namespaced_pod("a", NS)
        assert terminating.metadata.deletion_timestamp is not None
        with pytest.raises(ApiException) as exc:
            bind(core, "a", "n2")
        assert exc.value.status == 409
        core.delete_namespaced_pod("a", NS, grace_period_seconds=0)
        core.delete_namespaced_pod("b", NS)  # never bound: gone at once
        assert core.list_namespaced_pod(NS).items == []


def test_delete_preconditions_and_collection(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod(NS, pod("a", labels={"app": "x"}))
    core.create_namespaced_pod(NS, pod("b", labels={"app": "y"}))
    with pytest.raises(ApiException) as exc:
        core.delete_namespaced_pod("a", NS, body=client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid="wrong")))
    assert exc.value.status == 409
    core.delete_collection_namespaced_pod(NS, label_selector="app=x")
    assert [p.metadata.name for p in core.list_namespaced_pod(NS).items] == ["b"]


def test_strategic_merge_lists_by_key(core: client.CoreV1Api) -> None:
    core.create_node(node("n1"))
    core.patch_node_status("n1", {"status": {"conditions": [
        {"type": "Ready", "status": "True"}, {"type": "DiskPressure", "status": "False"}]}})
    n = core.patch_node_status("n1", {"status": {"conditions": [
        {"type": "Ready", "status": "False"}, {"type": "DiskPressure", "$patch": "delete"}]}})
    assert [(c.type, c.status) for c in n.status.conditions] == [("Ready", "False")]
    n = core.patch_node("n1", {"spec": {"taints": [{"key": "gpu", "effect": "NoSchedule"}]}})
    n = core.patch_node("n1", {"spec": {"taints": [{"key": "other", "effect": "NoSchedule"}]}})
    assert [t.key for t in n.spec.taints] == ["gpu", "other"]


def test_watch_is_idle_while_other_resources_change(fake_api: FakeApiServer, core: client.CoreV1Api) -> None:
    """A pod watch must sleep, not spin, while nodes change or when started from a future version."""
    fake_api.store.put_node({"metadata": {"name": "n0"}})
    future = str(fake_api.store.resource_version + 100)
    cpu = time.process_time()
    for w_rv in (None, future):
        kwargs = {"resource_version": w_rv} if w_rv else {}
        w = watch.Watch()
        for i in range(3):
            fake_api.store.put_node({"metadata": {"name": f"n{i}"}})
        assert list(w.stream(core.list_namespaced_pod, NS, timeout_seconds=1, **kwargs)) == []
    assert time.process_time() - cpu < 1.0


def test_raw_watch_query_forms(fake_api: FakeApiServer) -> None:
    fake_api.store.put_node({"metadata": {"name": "n1"}})
    http = urllib3.PoolManager()
    for flag in ("1", "true"):
        resp = http.request("GET", f"{fake_api.url}/api/v1/nodes?watch={flag}&timeoutSeconds=1"
                            "&allowWatchBookmarks=true", timeout=5)
        assert resp.status == 200 and resp.headers["Transfer-Encoding"] == "chunked"
        events = [json.loads(line) for line in resp.data.decode().splitlines()]
        assert [e["type"] for e in events] == ["ADDED", "BOOKMARK"]
        assert events[0]["object"]["kind"] == "Node"
    http.clear()
