"""The extender's books never roll back and hold nothing for what the cluster does not hold (issue 47),
against the fake API server through the real client (the Live harness of test_service.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kubernetes import client as k8s

from extender import wire
from tests.extender import test_service
from tests.extender.test_app import free_by_gpu, gpu_uuid
from tests.extender.test_service import NS, Live, arrange
from tests.fakeapi import FakeApiServer

live = test_service.live  # the Live harness's fixture


def listed_pods(api: FakeApiServer) -> list[dict[str, Any]]:
    """Every pod, as a list call answers now (what a relist would deliver)."""
    resp = k8s.CoreV1Api(api.client(retries=False)).list_pod_for_all_namespaces(_preload_content=False)
    try:
        return list(json.loads(resp.data)["items"])
    finally:
        resp.release_conn()


def test_a_relist_older_than_our_bind_delivered_right_after_it_leaves_the_books_unchanged(
        fake_api: FakeApiServer, live: Callable[..., Live]) -> None:
    arrange(fake_api, ("big", 7), ("big2", 7))
    r = live()
    stale = listed_pods(fake_api)  # taken before the bind
    assert r.schedule("big", ("gpu-a",)) == "gpu-a"
    books = free_by_gpu(r.ext)
    assert books[("gpu-a", gpu_uuid("gpu-a"))] == 0
    # What a lagging API server (or the relist after a change of leader) hands over: big unbound.
    r.ext.on_relist("Pod", [r.ext.transform("Pod", p) for p in stale])
    assert free_by_gpu(r.ext) == books
    res = r.filter("big2", ("gpu-a",))
    assert res.passing == () and "gpu-a" in res.failed, res
    # The watch then confirms the bind; the books are what they were.
    assert r.sees_bound("big", "gpu-a") or r.ext.view.assumed
    uid = r.pod("big")["metadata"]["uid"]
    r.ext.on_relist("Pod", [r.ext.transform("Pod", p) for p in listed_pods(fake_api)])
    assert uid not in r.ext.view.assumed and free_by_gpu(r.ext)[("gpu-a", gpu_uuid("gpu-a"))] == 0


def test_a_filtered_pod_that_is_deleted_releases_its_reservation(fake_api: FakeApiServer,
                                                                   live: Callable[..., Live]) -> None:
    arrange(fake_api, ("p", 3))
    r = live()
    uid = r.pod("p")["metadata"]["uid"]
    assert r.filter("p", ("gpu-a",)).passing == ("gpu-a",)
    assert uid in r.ext.view.reservations
    fake_api.store.remove("pods", "p", NS)
    from tests.extender.helpers import wait_for

    assert wait_for(lambda: uid not in r.ext.view.reservations)
    assert free_by_gpu(r.ext)[("gpu-a", gpu_uuid("gpu-a"))] == 7


def test_a_made_up_pod_holds_nothing(fake_api: FakeApiServer, live: Callable[..., Live]) -> None:
    arrange(fake_api)
    r = live()
    ghost = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ghost", "namespace": NS, "uid": "uid-ghost"},
             "spec": {"schedulerName": "gpu-slice-scheduler", "containers": [{"name": "c", "resources": {
                 "limits": {"example.com/gpu-slice": "7"}}}]}, "status": {"phase": "Pending"}}
    for _ in range(20):
        res = r.ext.filter(wire.ExtenderArgs(ghost, node_names=("gpu-a",)))
        assert res.passing == () and "does not exist" in res.error, res
    assert not r.ext.view.reservations and free_by_gpu(r.ext)[("gpu-a", gpu_uuid("gpu-a"))] == 7
    # A pod the watch has not delivered yet, but the API server holds, is confirmed with one read.
    fake_api.store.put_pod({**ghost, "metadata": {**ghost["metadata"], "name": "late", "uid": "uid-late"}})
    late = fake_api.store.get_pod("late", NS)
    r.ext.view.remove_pod("uid-late")  # as if the watch had not delivered it yet
    fake_api.reset_counts()
    res = r.ext.filter(wire.ExtenderArgs(late, node_names=("gpu-a",)))
    assert res.passing == ("gpu-a",) and "uid-late" in r.ext.view.reservations
    assert fake_api.request_count("get", "/api/v1/namespaces/ml/pods/late") == 1
    # The same UID under a name the API server gives to another pod is not confirmed.
    impostor = {**late, "metadata": {**late["metadata"], "uid": "uid-impostor"}}
    res = r.ext.filter(wire.ExtenderArgs(impostor, node_names=("gpu-a",)))
    assert res.passing == () and "uid-impostor" not in r.ext.view.reservations


def test_a_slow_api_server_never_stalls_the_event_loop(fake_api: FakeApiServer, live: Callable[..., Live]) -> None:
    """A filter that must read the API server (here a pod the watch has not delivered) reads it off the
    event loop: while the read hangs, /healthz and another pod's filter are answered."""
    import threading

    import httpx

    from tests.extender.test_app import _serve

    arrange(fake_api, ("p", 1), ("q", 1))
    r = live()
    late = fake_api.store.get_pod("p", NS)
    with r.ext.lock:
        r.ext.view.remove_pod(late["metadata"]["uid"])  # as if the watch had not delivered it yet
    quick = fake_api.store.get_pod("q", NS)
    fake_api.reset_counts()
    fake_api.hang_next("get", "/api/v1/namespaces/ml/pods/p", 3.0)  # its confirmation read hangs
    with _serve(r.ext, 1 << 20) as url:
        slow_done = threading.Event()

        def slow() -> None:
            body = json.dumps({"Pod": late, "NodeNames": ["gpu-a"]})
            httpx.post(f"{url}/filter", content=body, headers={"Content-Type": "application/json"}, timeout=20)
            slow_done.set()

        worker = threading.Thread(target=slow)
        worker.start()
        from tests.extender.helpers import wait_for

        assert wait_for(lambda: fake_api.request_count("get", "/api/v1/namespaces/ml/pods/p") >= 1)
        assert httpx.get(f"{url}/healthz", timeout=20).status_code == 200
        got = httpx.post(f"{url}/filter", content=json.dumps({"Pod": quick, "NodeNames": ["gpu-a"]}),
                         headers={"Content-Type": "application/json"}, timeout=20).json()
        assert got["NodeNames"] == ["gpu-a"]
        assert not slow_done.is_set(), "answered only after the slow read"
        worker.join(20)
        assert slow_done.is_set()
