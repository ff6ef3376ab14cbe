"""The extender's HTTP surface (extender.app) with kube-scheduler's own JSON, and the filter end to end.

Every request body here is written by hand from reference/protocols.md 2 (the Go field names, so
PascalCase envelopes around camelCase v1 objects), never built with ``extender.wire``, so a wire
codec that drifted from the protocol fails here. The extender runs on a small static cluster
(``Extender.load`` with a :class:`MemoryBinder`, as ``--cluster`` does) and a fixed clock:

* ``gpu-a``: one idle H100 in MPS mode (7 slices);
* ``gpu-b``: one H100 in MPS mode with 5 of its 7 slices held by the running pod ``runner``, so a
  2-slice pod fills it exactly (the packing policies' favourite);
* ``cpu-1``: a node without the inventory annotation (no GPU slices).

The builders at the top are shared with test_service.py and test_cli.py.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from extender.app import build_app
from extender.binder import MemoryBinder
from extender.service import Extender
from gpuslice import annotations as ann
from gpuslice import ids
from gpuslice.catalogue import PRODUCTS
from gpuslice.config import Config, default_config
from gpuslice.model import Gpu
from gpuslice.requests import MEMORY_KEY, RESOURCE
from gpuslice.scheduler import NARROWED_OUT, UNKNOWN_NODE
from tests.extender.helpers import wait_for

with warnings.catch_warnings():  # starlette 1.x asks for httpx2 in its TestClient; httpx is what the venv has
    warnings.filterwarnings("ignore", message=".*starlette.testclient.*")
    from starlette.testclient import TestClient

NOW = 1_750_000_000.0  # whole seconds: assignment times round-trip exactly
NOW_DT = datetime.fromtimestamp(NOW, UTC)
H100 = "H100-80GB"
S = 7
JSON_HEADERS = {"Content-Type": "application/json"}


# ------------------------------------------------------------------------------------------ builders


def gpu_uuid(node: str, i: int = 0) -> str:
    return f"GPU-{node}-{i:04d}"


def mps_gpu(node: str, i: int = 0) -> Gpu:
    return Gpu(gpu_uuid(node, i), i, H100, PRODUCTS[H100].memory_mib or 0, "mps", S)


def slice_ids(gpu: str, k: int, start: int = 0) -> list[str]:
    return [ids.encode(gpu, n) for n in range(start, start + k)]


def node_obj(name: str, gpus: Sequence[Gpu] | None, *, cpu: str = "64", memory: str = "512Gi") -> dict[str, Any]:
    """A v1 Node as the API server serves it; ``gpus`` None: no inventory annotation (no slices)."""
    notes = {} if gpus is None else {ann.INVENTORY_KEY: ann.encode_inventory(tuple(gpus))}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": notes, "labels": {"kubernetes.io/hostname": name}},
            "status": {"allocatable": {"cpu": cpu, "memory": memory, "pods": "110"},
                       "capacity": {"cpu": cpu, "memory": memory, "pods": "110"}}}


def pod_obj(name: str, slices: int, *, uid: str | None = None, namespace: str = "ml", node: str | None = None,
            assigned: Sequence[str] | None = None, priority: int | None = None, gpu_memory: str | None = None,
            at: datetime = NOW_DT - timedelta(minutes=5)) -> dict[str, Any]:
    """A v1 Pod asking ``slices`` (0: none); with ``node`` and ``assigned`` a running pod that holds
    those slice ids (its assignment annotation, written at ``at``)."""
    uid = uid or f"uid-{name}"
    notes: dict[str, Any] = {}
    if assigned is not None:
        assert node is not None
        gpus = tuple(dict.fromkeys(ids.owner_of(s) for s in assigned))
        notes[ann.ASSIGNMENT_KEY] = ann.encode_assignment(
            ann.Assignment(uid, node, gpus, None, tuple(assigned), "fragmentation", at))
    if gpu_memory is not None:
        notes[MEMORY_KEY] = gpu_memory
    resources: dict[str, Any] = {"requests": {"cpu": "1", "memory": "1Gi"}}
    if slices:
        resources["limits"] = {RESOURCE: str(slices)}
        resources["requests"][RESOURCE] = str(slices)
    spec: dict[str, Any] = {"schedulerName": "gpu-slice-scheduler",
                            "containers": [{"name": "server", "image": "vllm/vllm-openai:v0.6.4",
                                            "resources": resources}]}
    if node is not None:
        spec["nodeName"] = node
    if priority is not None:
        spec["priority"] = priority
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": uid, "annotations": notes,
                         "creationTimestamp": ann.format_time(at)},
            "spec": spec, "status": {"phase": "Running" if node else "Pending"}}


def small_cluster() -> list[dict[str, Any]]:
    """gpu-a idle, gpu-b with 5 of 7 slices held by ``runner``, cpu-1 without GPU slices."""
    return [node_obj("gpu-a", [mps_gpu("gpu-a")]), node_obj("gpu-b", [mps_gpu("gpu-b")]), node_obj("cpu-1", None),
            pod_obj("runner", 5, node="gpu-b", assigned=slice_ids(gpu_uuid("gpu-b"), 5), priority=0)]


class Clock:
    """A settable clock in seconds since the epoch."""

    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def static_extender(items: list[dict[str, Any]], *, config: Config | None = None,
                    clock: Clock | None = None) -> Extender:
    """An extender over a static list of objects, as ``--cluster`` runs it (binds kept in memory)."""
    ext = Extender(config or default_config(), MemoryBinder([i for i in items if i.get("kind") == "Pod"]),
                   clock=clock or Clock())
    ext.load(items)
    return ext


def held_slices(ext: Extender) -> dict[str, dict[str, str]]:
    """Per node, slice id -> holder UID (pods and reservations), as the extender counts them now."""
    return {name: dict(n.held) for name, n in ext.view.nodes.items() if n.row >= 0}


def free_by_gpu(ext: Extender) -> dict[tuple[str, str], int]:
    """Free slices per (node, GPU or MIG UUID) in the packing state, by stable keys."""
    st = ext.view.state
    return {(name, key): int(st.unit_free[row]) for name, n in ext.view.nodes.items() for key, row in n.keys.items()}


# --------------------------------------------------------------------------- kube-scheduler's JSON, by hand


POD_TEMPLATE = """{
  "kind": "Pod",
  "apiVersion": "v1",
  "metadata": {
    "name": "@NAME@",
    "namespace": "ml",
    "uid": "@UID@",
    "resourceVersion": "4711",
    "creationTimestamp": "2025-06-15T14:00:00Z",
    "labels": {"app": "llm"},
    "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"}
  },
  "spec": {
    "schedulerName": "gpu-slice-scheduler",
    "priority": @PRIORITY@,
    "restartPolicy": "Always",
    "terminationGracePeriodSeconds": 30,
    "dnsPolicy": "ClusterFirst",
    "containers": [
      {
        "name": "server",
        "image": "vllm/vllm-openai:v0.6.4",
        "resources": {
          "limits": {"example.com/gpu-slice": "@SLICES@", "memory": "1Gi"},
          "requests": {"cpu": "1", "example.com/gpu-slice": "@SLICES@", "memory": "1Gi"}
        }
      }
    ],
    "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
                     "tolerationSeconds": 300}]
  },
  "status": {"phase": "Pending", "qosClass": "Burstable"}
}"""

CPU_POD = """{
  "kind": "Pod",
  "apiVersion": "v1",
  "metadata": {"name": "web", "namespace": "ml", "uid": "uid-web", "resourceVersion": "17"},
  "spec": {"schedulerName": "gpu-slice-scheduler",
           "containers": [{"name": "nginx", "image": "nginx",
                           "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}]},
  "status": {"phase": "Pending"}
}"""


def pod_json(name: str, slices: int, *, priority: int = 0) -> str:
    return (POD_TEMPLATE.replace("@NAME@", name).replace("@UID@", f"uid-{name}")
            .replace("@SLICES@", str(slices)).replace("@PRIORITY@", str(priority)))


def names_json(names: Sequence[str]) -> str:
    return "[" + ", ".join(f'"{n}"' for n in names) + "]"


def filter_names(pod: str, names: Sequence[str]) -> str:
    """ExtenderArgs as a nodeCacheCapable scheduler sends it."""
    return '{"Pod": ' + pod + ', "Nodes": null, "NodeNames": ' + names_json(names) + "}"


def filter_nodes(pod: str, nodes: Sequence[Mapping[str, Any]]) -> str:
    """ExtenderArgs with the full v1.NodeList (nodeCacheCapable: false)."""
    items = ", ".join(json.dumps(n) for n in nodes)
    return '{"Pod": ' + pod + ', "Nodes": {"metadata": {"resourceVersion": "99"}, "items": [' + items + \
        ']}, "NodeNames": null}'


def bind_body(name: str, node: str, *, uid: str | None = None, namespace: str = "ml") -> str:
    return ('{"PodName": "' + name + '", "PodNamespace": "' + namespace + '", "PodUID": "' + (uid or f"uid-{name}")
            + '", "Node": "' + node + '"}')


def post(client: TestClient, verb: str, body: str | bytes) -> httpx.Response:
    return client.post(f"/{verb}", content=body.encode() if isinstance(body, str) else body, headers=JSON_HEADERS)


def ok_json(resp: httpx.Response) -> Any:
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "application/json"
    return json.loads(resp.text)


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def ext(clock: Clock) -> Extender:
    return static_extender(small_cluster(), clock=clock)


@pytest.fixture
def client(ext: Extender) -> Iterator[TestClient]:
    with TestClient(build_app(ext, max_body=64 * 1024)) as c:
        yield c


# ------------------------------------------------------------------------------------------ /filter


def test_filter_with_node_names_narrows_to_the_best_packed_node(client: TestClient) -> None:
    got = ok_json(post(client, "filter", filter_names(pod_json("p1", 2), ["gpu-a", "gpu-b", "cpu-1"])))
    assert list(got) == ["Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"]
    assert got["Nodes"] is None
    assert got["NodeNames"] == ["gpu-b"]  # packing: the GPU that is already in use
    assert got["FailedNodes"] == {"gpu-a": NARROWED_OUT}
    assert list(got["FailedAndUnresolvableNodes"]) == ["cpu-1"]
    assert "advertises no GPU slices" in got["FailedAndUnresolvableNodes"]["cpu-1"]
    assert got["Error"] == ""


def test_filter_with_full_nodes_answers_the_passing_node_objects(client: TestClient) -> None:
    nodes = small_cluster()[:3]
    got = ok_json(post(client, "filter", filter_nodes(pod_json("p1", 2), nodes)))
    assert got["NodeNames"] is None
    assert got["Nodes"]["items"] == [nodes[1]]  # gpu-b, as sent
    assert got["FailedNodes"] == {"gpu-a": NARROWED_OUT}
    assert list(got["FailedAndUnresolvableNodes"]) == ["cpu-1"]
    assert got["Error"] == ""


def test_unknown_nodes_are_failed_nodes_not_an_error(client: TestClient) -> None:
    got = ok_json(post(client, "filter", filter_names(pod_json("p1", 2), ["gpu-b", "new-node"])))
    assert got["NodeNames"] == ["gpu-b"]
    assert got["FailedNodes"] == {"new-node": UNKNOWN_NODE}
    assert got["FailedAndUnresolvableNodes"] == {}
    assert got["Error"] == ""


def test_a_pod_without_slice_requests_passes_every_node(client: TestClient, ext: Extender) -> None:
    names = ["gpu-a", "gpu-b", "cpu-1", "new-node"]
    got = ok_json(post(client, "filter", filter_names(CPU_POD, names)))
    assert got == {"Nodes": None, "NodeNames": names, "FailedNodes": {}, "FailedAndUnresolvableNodes": {},
                   "Error": ""}
    assert len(ext.view.reservations) == 0
    prio = ok_json(post(client, "prioritize", filter_names(CPU_POD, names)))
    assert prio == [{"Host": n, "Score": 0} for n in names]


@pytest.mark.parametrize(("slices", "annotation", "reason"), [
    (14, "", r"14.slice.*GPUs"),  # two whole GPUs; every node has one, in MPS mode
    (1, '"example.com/gpu-memory": "200Gi", ', r"GPU memory"),  # more than an H100 has
])
def test_a_pod_asking_more_than_any_node_has_is_unresolvable_everywhere(client: TestClient, ext: Extender,
                                                                        slices: int, annotation: str,
                                                                        reason: str) -> None:
    pod = pod_json("huge", slices).replace('"annotations": {', '"annotations": {' + annotation)
    got = ok_json(post(client, "filter", filter_names(pod, ["gpu-a", "gpu-b", "cpu-1"])))
    assert got["NodeNames"] == []
    assert got["FailedNodes"] == {}
    assert set(got["FailedAndUnresolvableNodes"]) == {"gpu-a", "gpu-b", "cpu-1"}
    assert re.search(reason, got["FailedAndUnresolvableNodes"]["gpu-a"])
    assert re.search(reason, got["FailedAndUnresolvableNodes"]["gpu-b"])
    assert got["Error"] == ""
    assert len(ext.view.reservations) == 0


def test_a_request_that_no_node_could_ever_meet_is_a_filter_error(client: TestClient) -> None:
    """8 slices is neither one GPU nor whole GPUs: the pod is wrong as written, whatever the nodes."""
    got = ok_json(post(client, "filter", filter_names(pod_json("odd", 8), ["gpu-a", "gpu-b"])))
    assert got["NodeNames"] == []
    assert "8 slices" in got["Error"]


def test_filter_before_the_first_sync_is_an_error_and_prioritize_scores_zero() -> None:
    ext = Extender(default_config(), MemoryBinder([]), clock=Clock())
    with TestClient(build_app(ext)) as c:
        got = ok_json(post(c, "filter", filter_names(pod_json("p1", 2), ["gpu-a"])))
        assert got["NodeNames"] == [] and "not synced" in got["Error"]
        assert ok_json(post(c, "prioritize", filter_names(pod_json("p1", 2), ["gpu-a"]))) == [
            {"Host": "gpu-a", "Score": 0}]


# ------------------------------------------------------------------------- filter semantics end to end


def test_filter_reserves_by_uid_so_the_next_pods_get_other_slices(client: TestClient, ext: Extender) -> None:
    names = ["gpu-a", "gpu-b"]
    runner = set(slice_ids(gpu_uuid("gpu-b"), 5))
    assert ok_json(post(client, "filter", filter_names(pod_json("p1", 2), names)))["NodeNames"] == ["gpu-b"]
    first = ext.view.reservations.get("uid-p1")
    assert first is not None and first.node == "gpu-b"
    assert set(first.slice_ids) == set(slice_ids(gpu_uuid("gpu-b"), 2, start=5))  # the two the runner left

    # Filtered before p1 is bound: p1's reservation counts, so gpu-b is full now and says so.
    second = ok_json(post(client, "filter", filter_names(pod_json("p2", 2), names)))
    assert second["NodeNames"] == ["gpu-a"]
    assert second["FailedNodes"]["gpu-b"].startswith("slices in use")
    # And the next pod on gpu-a does not get p2's slices either.
    assert ok_json(post(client, "filter", filter_names(pod_json("p3", 2), names)))["NodeNames"] == ["gpu-a"]
    reserved = [ext.view.reservations.get(f"uid-p{i}") for i in (1, 2, 3)]
    taken = [set(r.slice_ids) for r in reserved if r is not None]
    assert [len(t) for t in taken] == [2, 2, 2]
    assert len(set().union(runner, *taken)) == 5 + 2 + 2 + 2  # pairwise disjoint
    assert held_slices(ext)["gpu-a"] == {s: f"uid-p{i}" for i in (2, 3) for s in taken[i - 1]}


def test_prioritize_gives_the_filtered_node_ten_as_a_bare_array(client: TestClient) -> None:
    args = filter_names(pod_json("p1", 2), ["gpu-a", "gpu-b", "cpu-1"])
    assert ok_json(post(client, "filter", args))["NodeNames"] == ["gpu-b"]
    resp = post(client, "prioritize", args)
    got = ok_json(resp)
    assert resp.text.startswith("[")
    assert [sorted(item) for item in got] == [["Host", "Score"]] * 3
    assert [item["Host"] for item in got] == ["gpu-a", "gpu-b", "cpu-1"]
    scores = {item["Host"]: item["Score"] for item in got}
    assert all(type(s) is int for s in scores.values())  # a JSON integer, as Go's decoder insists
    assert scores["gpu-b"] == 10
    assert 0 <= scores["gpu-a"] < 10
    assert scores["cpu-1"] == 0


def test_bind_writes_the_reserved_slices_and_creates_the_binding(client: TestClient, ext: Extender,
                                                                 clock: Clock) -> None:
    assert ok_json(post(client, "filter", filter_names(pod_json("p1", 2), ["gpu-a", "gpu-b"])))["NodeNames"] == [
        "gpu-b"]
    reserved = ext.view.reservations.get("uid-p1")
    assert reserved is not None
    resp = post(client, "bind", bind_body("p1", "gpu-b"))
    assert ok_json(resp) == {"Error": ""}
    assert resp.text == '{"Error":""}'

    binder = ext.binder
    assert isinstance(binder, MemoryBinder)
    assert binder.binds == [("ml", "p1", "gpu-b")]
    stored = binder.pods[("ml", "p1")]
    assert stored["spec"]["nodeName"] == "gpu-b"
    written = ann.decode_assignment(stored["metadata"]["annotations"][ann.ASSIGNMENT_KEY])
    assert written.pod_uid == "uid-p1"
    assert written.node == "gpu-b"
    assert written.gpus == (gpu_uuid("gpu-b"),)
    assert written.instance is None
    assert written.slice_ids == reserved.slice_ids
    assert written.time == NOW_DT
    # The pod now holds them as a bound pod, not as a reservation.
    assert ext.view.reservations.get("uid-p1") is None
    assert {s for s, u in held_slices(ext)["gpu-b"].items() if u == "uid-p1"} == set(reserved.slice_ids)

    # Bound twice (a retry): answered once, nothing written again.
    assert ok_json(post(client, "bind", bind_body("p1", "gpu-b"))) == {"Error": ""}
    assert binder.binds == [("ml", "p1", "gpu-b")]


def test_bind_to_an_unknown_node_or_an_unknown_pod_is_an_error_result(client: TestClient, ext: Extender) -> None:
    assert ok_json(post(client, "filter", filter_names(pod_json("p1", 2), ["gpu-b"])))["NodeNames"] == ["gpu-b"]
    assert ok_json(post(client, "bind", bind_body("p1", "new-node"))) == {"Error": UNKNOWN_NODE}
    assert "no longer exists" in ok_json(post(client, "bind", bind_body("ghost", "gpu-b")))["Error"]
    replaced = ok_json(post(client, "bind", bind_body("p1", "gpu-b", uid="uid-of-an-older-p1")))
    assert "was replaced" in replaced["Error"]
    binder = ext.binder
    assert isinstance(binder, MemoryBinder) and binder.binds == []
    assert ok_json(post(client, "bind", bind_body("p1", "gpu-b"))) == {"Error": ""}


def test_filtering_the_same_pod_again_keeps_its_node() -> None:
    with TestClient(build_app(static_extender(small_cluster()))) as c:
        body = filter_names(pod_json("p1", 2), ["gpu-a", "gpu-b"])
        assert ok_json(post(c, "filter", body))["NodeNames"] == ["gpu-b"]
        again = ok_json(post(c, "filter", body))
        assert again["NodeNames"] == ["gpu-b"], again


# ------------------------------------------------------------------------------------------ /preempt


def test_preempt_answers_meta_victims_on_the_nodes_where_eviction_helps(client: TestClient) -> None:
    body = ('{"Pod": ' + pod_json("urgent", 7, priority=1000) + ', "NodeNameToVictims": null, '
            '"NodeNameToMetaVictims": {"gpu-b": {"Pods": [{"UID": "uid-runner"}], "NumPDBViolations": 0}, '
            '"cpu-1": {"Pods": [], "NumPDBViolations": 0}}}')
    got = ok_json(post(client, "preempt", body))
    assert got == {"NodeNameToMetaVictims": {"gpu-b": {"Pods": [{"UID": "uid-runner"}], "NumPDBViolations": 0}}}


def test_preempt_with_full_victims_answers_the_meta_form(client: TestClient) -> None:
    runner = json.dumps(small_cluster()[3])
    body = ('{"Pod": ' + pod_json("urgent", 7, priority=1000) + ', "NodeNameToVictims": {"gpu-b": {"Pods": ['
            + runner + '], "NumPDBViolations": 1}}, "NodeNameToMetaVictims": null}')
    got = ok_json(post(client, "preempt", body))
    assert list(got) == ["NodeNameToMetaVictims"]
    assert got["NodeNameToMetaVictims"]["gpu-b"]["Pods"] == [{"UID": "uid-runner"}]


def test_preempt_never_names_pods_of_equal_or_higher_priority(client: TestClient) -> None:
    body = ('{"Pod": ' + pod_json("peer", 7, priority=0) + ', "NodeNameToVictims": null, '
            '"NodeNameToMetaVictims": {"gpu-b": {"Pods": [{"UID": "uid-runner"}], "NumPDBViolations": 0}}}')
    assert ok_json(post(client, "preempt", body)) == {"NodeNameToMetaVictims": {}}


# ------------------------------------------------------------------------------------ malformed requests


GOOD_FILTER = filter_names(pod_json("p1", 2), ["gpu-a", "gpu-b"])

BAD_REQUESTS: list[tuple[str, bytes, str]] = [
    ("filter", b"", "empty"),
    ("filter", b"{", "not valid JSON"),
    ("filter", b"Pod=p1&Node=gpu-a", "not valid JSON"),
    ("filter", b"\xff\xfe{}", "not UTF-8"),
    ("filter", b"[]", "must be a JSON object"),
    ("filter", b'{"Pod": {"metadata": {"name": "p", "uid": "u"}}, "NodeNames": NaN}', "not valid JSON"),
    ("filter", b'{"Pod": 1, "NodeNames": ["gpu-a"]}', "Pod: expected a v1.Pod object"),
    ("filter", b'{"Pod": {"metadata": {"name": "p", "uid": 7}}, "NodeNames": ["gpu-a"]}', "Pod.metadata.uid"),
    ("filter", b'{"Pod": {"metadata": {"name": "p", "uid": "u"}}, "NodeNames": "gpu-a"}',
     "NodeNames: expected an array"),
    ("filter", b'{"Pod": {"metadata": {"name": "p", "uid": "u"}}, "NodeNames": [1]}', "NodeNames[0]"),
    ("filter", b'{"Pod": {"metadata": {"name": "p", "uid": "u"}}}', "neither Nodes nor NodeNames"),
    ("filter", b'{"pod": {"metadata": {"name": "p", "uid": "u"}}, "nodeNames": ["gpu-a"]}', "PascalCase"),
    ("filter", b'{"Pod": {"metadata": {"name": "p", "uid": "u"}}, "NodeNames": ["gpu-a"], '
               b'"Nodes": {"items": []}}', "both Nodes and NodeNames"),
    ("filter", b'{"Pod": {"metadata": {"name": "p", "uid": "u"}}, "Nodes": {"items": [{"metadata": {}}]}}',
     "Nodes.items[0].metadata.name"),
    ("filter", b'{"Pod": ' + b'{"a": ' * 100 + b"1" + b"}" * 100 + b', "NodeNames": []}', "nested too deeply"),
    ("prioritize", b'{"Pod": {"metadata": {"name": "p"}}, "NodeNames": ["gpu-a"]}', "Pod.metadata.uid"),
    ("prioritize", b"null", "must be a JSON object"),
    ("bind", b'{"PodName": "p1", "PodNamespace": "ml", "PodUID": "uid-p1"}', "Node: missing"),
    ("bind", b'{"PodName": "p1", "PodNamespace": "ml", "PodUID": 5, "Node": "gpu-a"}', "PodUID: expected a string"),
    ("bind", b'{"podName": "p1", "podNamespace": "ml", "podUID": "u", "node": "gpu-a"}', "PascalCase"),
    ("bind", b'{"PodName": "", "PodNamespace": "ml", "PodUID": "u", "Node": "gpu-a"}', "PodName: must not be empty"),
    ("preempt", b'{"Pod": {"metadata": {"name": "p", "uid": "u"}}, "NodeNameToMetaVictims": '
                b'{"gpu-b": {"Pods": [{"Uid": "x"}]}}}', "UID: missing"),
    ("preempt", b'{"Pod": {"metadata": {"name": "p", "uid": "u"}}, "NodeNameToMetaVictims": '
                b'{"gpu-b": {"Pods": [], "NumPDBViolations": "0"}}}', "NumPDBViolations: expected an integer"),
    ("preempt", b'{"Pod": {"metadata": {"name": "p", "uid": "u"}}, "NodeNameToMetaVictims": []}',
     "NodeNameToMetaVictims: expected a JSON object"),
]


@pytest.mark.parametrize(("verb", "body", "says"), BAD_REQUESTS,
                         ids=[f"{v}-{i}" for i, (v, _, _) in enumerate(BAD_REQUESTS)])
def test_a_malformed_request_is_a_400_naming_the_fault_and_the_next_is_answered(
        client: TestClient, ext: Extender, verb: str, body: bytes, says: str) -> None:
    resp = post(client, verb, body)
    assert resp.status_code == 400
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["Error"]
    assert error.startswith(f"bad {verb} request: ")
    assert says in error
    assert len(ext.view.reservations) == 0
    assert ok_json(post(client, "filter", GOOD_FILTER))["NodeNames"] == ["gpu-b"]


def test_an_oversize_body_is_413_by_its_length_or_as_it_streams(ext: Extender) -> None:
    with TestClient(build_app(ext, max_body=4096)) as c:
        resp = post(c, "filter", b'{"Pod": "' + b"x" * 5000 + b'"}')
        assert resp.status_code == 413
        assert resp.json() == {"Error": "request body over 4096 bytes"}

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"Pod": "'
            for _ in range(10):
                yield b"x" * 1000
            yield b'"}'

        resp = c.post("/filter", content=chunks(), headers=JSON_HEADERS)
        assert resp.status_code == 413
        resp = c.post("/filter", content=b"{}", headers={**JSON_HEADERS, "Content-Length": "many"})
        assert resp.status_code == 400 and "Content-Length" in resp.json()["Error"]
        assert ok_json(post(c, "filter", GOOD_FILTER))["NodeNames"] == ["gpu-b"]


def test_an_unexpected_failure_is_a_500_with_the_error_and_the_next_is_answered(
        client: TestClient, ext: Extender, monkeypatch: pytest.MonkeyPatch) -> None:
    real = ext.sched.filter
    calls = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(ext.sched, "filter", broken)
    resp = post(client, "filter", GOOD_FILTER)
    assert resp.status_code == 500
    assert resp.json() == {"Error": "filter failed: RuntimeError: boom"}
    assert ok_json(post(client, "filter", GOOD_FILTER))["NodeNames"] == ["gpu-b"]


def test_verbs_are_post_only_and_unknown_paths_are_404(client: TestClient) -> None:
    assert client.get("/filter").status_code == 405
    assert client.put("/bind", content=b"{}").status_code == 405
    assert client.post("/healthz").status_code == 405
    assert client.post("/filterx", content=GOOD_FILTER.encode()).status_code == 404


# ------------------------------------------------------------------------- health, readiness, metrics


def test_healthz_and_readyz() -> None:
    ext = Extender(default_config(), MemoryBinder([]), clock=Clock())
    leading = {"ok": True}
    app = build_app(ext, ready=lambda: (leading["ok"], "leadership changed; catching up"))
    with TestClient(app) as c:
        assert c.get("/healthz").status_code == 200 and c.get("/healthz").text == "ok\n"
        resp = c.get("/readyz")
        assert resp.status_code == 503 and "not synced" in resp.text
        ext.on_relist("Node", [node_obj("gpu-a", [mps_gpu("gpu-a")])])
        assert c.get("/readyz").status_code == 503  # pods not listed yet
        ext.on_relist("Pod", [])
        assert c.get("/readyz").status_code == 200 and c.get("/readyz").text == "ok\n"
        leading["ok"] = False
        resp = c.get("/readyz")
        assert resp.status_code == 503 and "catching up" in resp.text
        assert c.get("/healthz").status_code == 200  # alive all along


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_are_parseable_and_count_requests_by_verb_and_outcome(client: TestClient) -> None:
    post(client, "filter", GOOD_FILTER)
    post(client, "filter", b"{")
    post(client, "prioritize", GOOD_FILTER)
    post(client, "bind", bind_body("p1", "gpu-b"))
    client.get("/readyz")
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    got = samples(resp.text)
    total = "gpu_slice_extender_requests_total"
    assert got[(total, (("outcome", "ok"), ("verb", "filter")))] == 1
    assert got[(total, (("outcome", "bad_request"), ("verb", "filter")))] == 1
    assert got[(total, (("outcome", "ok"), ("verb", "prioritize")))] == 1
    assert got[(total, (("outcome", "ok"), ("verb", "bind")))] == 1
    assert got[("gpu_slice_extender_request_duration_seconds_count", (("verb", "filter"),))] == 2
    assert got[("gpu_slice_extender_ready", ())] == 1
    assert any(name == "gpu_slice_extender_decisions_total" for name, _ in got)
    assert got[("gpu_slice_extender_filter_rejections_total", (("reason", "narrowed"),))] == 1


# ------------------------------------------------------------------------- over a real socket (uvicorn)


@pytest.fixture
def served(ext: Extender) -> Iterator[str]:
    """The app under uvicorn on 127.0.0.1 (a port the kernel picked), stopped afterwards."""
    with _serve(ext, 4096) as url:
        yield url


@contextlib.contextmanager
def _serve(ext: Extender, max_body: int) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(ext, max_body=max_body), log_level="warning",
                                           access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: server.started or not thread.is_alive())
        assert server.started
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        assert not thread.is_alive()


def test_a_client_still_sending_an_oversize_body_reads_the_413_not_a_reset(ext: Extender) -> None:
    """Far more than the socket buffers hold: without draining, the server's close resets the sender."""
    with _serve(ext, 4 << 20) as url:
        for size in (15 << 20, (4 << 20) + 1):
            req = urllib.request.Request(f"{url}/filter", data=b"x" * size, method="POST", headers=JSON_HEADERS)
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=30)
            assert err.value.code == 413
            assert json.loads(err.value.read()) == {"Error": f"request body over {4 << 20} bytes"}


def test_one_keep_alive_connection_survives_bad_and_oversize_requests(served: str) -> None:
    """kube-scheduler reuses its connection: after a 400 and an early 413 the next call still works."""
    with httpx.Client(base_url=served, timeout=10) as c:
        assert c.get("/readyz").status_code == 200
        assert c.post("/filter", content=b"x" * 50_000, headers=JSON_HEADERS).status_code == 413
        assert c.post("/filter", content=b"{", headers=JSON_HEADERS).status_code == 400
        got = c.post("/filter", content=GOOD_FILTER.encode(), headers=JSON_HEADERS)
        assert got.status_code == 200 and got.json()["NodeNames"] == ["gpu-b"]
        assert c.post("/bind", content=bind_body("p1", "gpu-b").encode(), headers=JSON_HEADERS).json() == {
            "Error": ""}
        prio = c.post("/prioritize", content=GOOD_FILTER.encode(), headers=JSON_HEADERS).json()
        assert isinstance(prio, list) and {p["Host"] for p in prio} == {"gpu-a", "gpu-b"}
