"""Pod and node projections (gpuslice.pods, gpuslice.nodes): what the scheduler reads of each, the
node price fallbacks, and hostile objects (a typed error or a node with ``error`` set, never
another exception)."""

from __future__ import annotations

import contextlib
import copy
import json
import math
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice import annotations as ann
from gpuslice.config import load_config
from gpuslice.counting import claim_of
from gpuslice.errors import GpuSliceError, InventoryError, RequestError
from gpuslice.nodes import NodeInfo, capacity_type, project_node
from gpuslice.pods import PodInfo, project
from gpuslice.scheduler import Scheduler
from gpuslice.view import ClusterView

from .test_view import NOW, S, mig_gpu, mps_gpu, node_obj, pod_obj, sids, unit, whole_gpu

PRICES = load_config({"version": "v1", "prices": {
    "instanceTypes": {"p5.48xlarge": {"on-demand": 98.32, "spot": 39.3}},
    "gpuHourly": {"H100-80GB": 4.1}}})


# --------------------------------------------------------------------------- pods

def test_pod_projection_reads_requests_owner_priority_and_products() -> None:
    pod = pod_obj("u1", 3, node="n1", cpu="1500m", memory="3Gi", owner="web", priority=7, isolation="mig",
                  gpu_memory="20Gi", product="H100-80GB")
    pod["spec"]["initContainers"] = [{"name": "init", "resources": {"requests": {"cpu": "4", "memory": "1Gi"}}},
                                     {"name": "side", "restartPolicy": "Always",
                                      "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}}}]
    pod["spec"]["overhead"] = {"cpu": "100m", "memory": "64Mi"}
    info = project(pod)
    assert info.error == ""
    assert (info.uid, info.label, info.node, info.phase, info.priority) == ("u1", "ns/pod-u1", "n1", "Running", 7)
    assert info.owner == "ns/ReplicaSet/web"
    # the pod-requests rule: max(apps + sidecars = 2000m, init 4000m + sidecars started before it = 4000m) + overhead
    assert info.cpu_milli == 4100
    assert info.memory_mib == 3 * 1024 + 512 + 64
    assert info.products == frozenset({"H100-80GB"})
    assert info.request is not None and info.request.slices == 3 and info.request.isolation == "mig"
    assert info.request.memory_mib == Fraction(20 * 1024)
    req = info.pack(S)
    assert (req.gpus, req.slices, req.gpu_memory_mib, req.owner, req.uid) == (1, 3, 20 * 1024, "ns/ReplicaSet/web",
                                                                             "u1")
    assert info.pack(S, owner_spread=False).owner == ""
    assert project(pod_obj("u2", 2 * S, gpu_memory="100Gi")).pack(S).gpu_memory_mib == 50 * 1024


INIT = {"name": "init", "resources": {"requests": {"cpu": "4", "memory": "1Gi"}}}
SIDE = {"name": "side", "restartPolicy": "Always", "resources": {"requests": {"cpu": "500m", "memory": "3Gi"}}}
SMALL = {"name": "small", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}


@pytest.mark.parametrize(("inits", "cpu", "mem"), [
    ([INIT, SIDE], 4000, 3 * 1024 + 3 * 1024),  # the sidecar starts after the init container ends
    ([SIDE, INIT], 4500, 3 * 1024 + 3 * 1024),  # the init container runs beside the sidecar
    ([SIDE, SMALL], 2000, 6 * 1024),
    ([SMALL], 1500, 3 * 1024),
    ([], 1500, 3 * 1024),
])
def test_pod_requests_rule_with_init_and_sidecar_containers(inits: list[dict[str, Any]], cpu: int, mem: int) -> None:
    """Found by these tests: a sidecar listed after an init container was added on top of the init
    container's peak (Kubernetes adds it to the app containers' sum, then takes the max)."""
    pod = pod_obj("u1", 1, cpu="1500m", memory="3Gi")
    pod["spec"]["initContainers"] = copy.deepcopy(inits)
    info = project(pod)
    assert (info.cpu_milli, info.memory_mib) == (cpu, mem)


def test_required_node_affinity_on_the_product_label_is_read() -> None:
    pod = pod_obj("u1", 1)
    pod["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [
            {"matchExpressions": [{"key": ann.PRODUCT_LABEL, "operator": "In", "values": ["H100-80GB"]}]},
            {"matchExpressions": [{"key": ann.PRODUCT_LABEL, "operator": "In", "values": ["A100-80GB"]},
                                  {"key": "zone", "operator": "In", "values": ["a"]}]}]}}}
    assert project(pod).products == frozenset({"H100-80GB", "A100-80GB"})
    assert project(pod_obj("u2", 1)).products is None


def test_isolation_default_and_the_kept_contract() -> None:
    pod = pod_obj("u1", 1, node="n1", assigned=sids(mps_gpu("n1", 0).uuid, 1))
    info = project(pod, isolation_default="mps")
    assert info.request is not None and info.request.isolation == "mps"
    assert project(pod_obj("u2", 1, isolation="any"), isolation_default="mig").request.isolation == "any"  # type: ignore[union-attr]
    # what the counting rule reads is kept, decoded, and gives the claim the rule gives the pod
    assert isinstance(info.contract[0], ann.Assignment) and info.contract[1] is None
    now, ttl = datetime.fromtimestamp(NOW, UTC), timedelta(seconds=60)
    assert info.claim(now=now, reservation_ttl=ttl) == claim_of(pod, now=now, reservation_ttl=ttl)
    bad = pod_obj("u4", 1, node="n1")
    bad["metadata"]["annotations"] = {ann.ASSIGNMENT_KEY: "{not json"}
    kept = project(bad)
    assert kept.contract == ("{not json", None)  # as written: the rule reports why it does not decode
    assert kept.claim(now=now, reservation_ttl=ttl) == claim_of(bad, now=now, reservation_ttl=ttl)
    assert not info.terminal and project(pod_obj("u3", 1, phase="Succeeded")).terminal


@pytest.mark.parametrize(("where", "value", "needle"), [
    (("metadata", "ownerReferences"), "web", "ownerReferences"),
    (("metadata", "ownerReferences"), ["web"], "ownerReferences"),
    (("spec", "priority"), "high", "spec.priority"),
    (("spec", "priority"), True, "spec.priority"),
    (("spec", "priority"), 1.5, "spec.priority"),
    (("spec", "nodeSelector"), ["x"], "spec.nodeSelector"),
    (("spec", "affinity"), "any", "spec.affinity"),
    (("spec", "overhead"), 5, "spec.overhead"),
    (("spec", "containers"), {"name": "c"}, "spec.containers"),
])
def test_hostile_pod_fields_are_projected_with_an_error(where: tuple[str, str], value: Any, needle: str) -> None:
    pod = pod_obj("u1", 1, node="n1", owner="web", cpu="2")
    pod[where[0]][where[1]] = value
    info = project(pod)
    assert isinstance(info, PodInfo) and needle in info.error and info.error.startswith("pod ns/pod-u1: ")
    with pytest.raises(RequestError):
        info.pack(S)


@pytest.mark.parametrize("pod", [
    "a pod", ["a", "pod"], {"metadata": "x"}, {"metadata": {"name": "p"}}, {"metadata": {"uid": 5}},
    {"metadata": {"uid": "u"}, "spec": "x"}, {"metadata": {"uid": "u"}, "status": ["Running"]},
    {"metadata": {"uid": "u"}, "spec": {"nodeName": 3}}, {"metadata": {"uid": "u", "annotations": ["a"]}},
])
def test_pods_that_cannot_be_projected_raise_request_error(pod: Any) -> None:
    with pytest.raises(RequestError):
        project(pod)


@pytest.mark.parametrize(("cpu", "memory"), [("1e20", "1Gi"), ("-1", "1Gi"), ("1", "1e30"), ("1", "-1Gi")])
def test_cpu_and_memory_out_of_range_are_errors_not_overflows(cpu: str, memory: str) -> None:
    """Found by these tests: a bound pod asking 1e20 CPUs overflowed the state's int64 arrays when
    its node was recomputed (OverflowError out of ``upsert_pod``); a negative request freed CPU."""
    g = mps_gpu("n1", 0)
    pod = pod_obj("u1", 1, node="n1", cpu=cpu, memory=memory, assigned=sids(g.uuid, 1))
    info = project(pod)
    assert "out of range" in info.error and (info.cpu_milli, info.memory_mib) == (0, 0)
    view = ClusterView.from_objects([node_obj("n1", [g], cpu="8")], NOW)
    view.upsert_pod(pod, NOW)
    assert unit(view, "n1", g.uuid) == (S - 1, True)  # its slices still count
    assert int(view.state.node_cpu_free[view.node_row("n1")]) == 8000


def test_a_pod_whose_request_is_bad_still_counts_its_cpu() -> None:
    g = mps_gpu("n1", 0)
    bad = pod_obj("u1", 1, node="n1", cpu="3", assigned=sids(g.uuid, 1), priority=None)
    bad["spec"]["priority"] = "urgent"
    view = ClusterView.from_objects([node_obj("n1", [g], cpu="8"), bad], NOW)
    assert int(view.state.node_cpu_free[view.node_row("n1")]) == 5000
    assert any("spec.priority" in p for p in view.problems())
    res = Scheduler.from_config(view).filter(bad, ["n1"], NOW)
    assert "spec.priority" in res.error and res.feasible == ()


# --------------------------------------------------------------------------- nodes

def test_node_projection() -> None:
    gpus = [mps_gpu("n1", 0), mig_gpu("n1", 1, (("7g.80gb", 0),))]
    info = project_node(node_obj("n1", gpus, cpu="96", memory="1Ti", labels={ann.PRODUCT_LABEL: "H100-80GB"}))
    assert info.error == "" and info.inventory is not None and len(info.inventory.gpus) == 2
    assert (info.spec.cpu_milli, info.spec.memory_mib, info.spec.product) == (96000, 1024 * 1024, "H100-80GB")
    # product from the inventory when the label is missing; no inventory: no product, no slices
    assert project_node(node_obj("n2", [whole_gpu("n2", 0, product="L4")])).spec.product == "L4"
    bare = project_node(node_obj("n3", None))
    assert bare.inventory is None and bare.error == "" and bare.spec.product == ""


def test_an_unchanged_inventory_is_not_decoded_again() -> None:
    """A heartbeat keeps the decoded GPUs (the view's fast path); an annotation written another way
    is decoded afresh, to the same GPUs; a changed one gives the new GPUs."""
    gpus = [mps_gpu("n1", 0), mig_gpu("n1", 1, (("7g.80gb", 0),))]
    first = project_node(node_obj("n1", gpus))
    assert project_node(node_obj("n1", gpus), previous=first).decoded is first.decoded
    spaced = node_obj("n1", gpus)
    text = spaced["metadata"]["annotations"][ann.INVENTORY_KEY]
    spaced["metadata"]["annotations"][ann.INVENTORY_KEY] = json.dumps(json.loads(text), indent=1)
    again = project_node(spaced, previous=first)
    assert again.decoded is not first.decoded and again.decoded == first.decoded
    changed = project_node(node_obj("n1", gpus[:1]), previous=first)
    assert changed.decoded == tuple(gpus[:1])


def test_cordon_annotation_marks_gpus_cordoned() -> None:
    gpus = [mps_gpu("n1", 0), mps_gpu("n1", 1)]
    info = project_node(node_obj("n1", gpus, cordon=[gpus[1].uuid]))
    assert info.inventory is not None
    assert [g.cordoned for g in info.inventory.gpus] == [False, True]
    assert [g.schedulable for g in info.inventory.gpus] == [True, False]


@pytest.mark.parametrize(("where", "value"), [
    ("status", "Ready"), ("status", ["Ready"]), ("labels", ["gpu"]), ("labels", "gpu=yes"),
    ("annotations", ["x"]), ("allocatable", "lots"), ("cpu", {"n": 1}), ("cpu", "1.5.5"), ("memory", float("nan")),
    ("cpu", "1e16"), ("cpu", 9223372036854776.0), ("cpu", "-4"), ("memory", "1e30"),
    ("inventory", "{not json"), ("inventory", 42), ("cordon", 7), ("cordon", "GPU-elsewhere"),
    ("product", 3), ("cost", "cheap"), ("cost", "-1"), ("cost", "inf"), ("cost", 10**400), ("cost", ["1"]),
])
def test_hostile_node_fields_give_a_node_with_error(where: str, value: Any) -> None:
    node = node_obj("n1", [mps_gpu("n1", 0)])
    meta, status = node["metadata"], node["status"]
    if where == "status":
        node["status"] = value
    elif where in ("labels", "annotations"):
        meta[where] = value
    elif where == "allocatable":
        status["allocatable"] = value
    elif where in ("cpu", "memory"):
        status["allocatable"][where] = value
    elif where == "inventory":
        meta["annotations"][ann.INVENTORY_KEY] = value
    elif where == "cordon":
        meta["annotations"][ann.CORDON_KEY] = value
    elif where == "product":
        meta["labels"][ann.PRODUCT_LABEL] = value
    else:
        meta["annotations"][ann.HOURLY_COST_KEY] = value
    info = project_node(node)
    assert isinstance(info, NodeInfo) and info.error.startswith("node n1: ") and info.inventory is None
    view = ClusterView()
    view.upsert_node(node)
    assert view.node_row("n1") == -1 and view.node_error("n1") == info.error
    res = Scheduler.from_config(view).filter(pod_obj("u1", 1), ["n1"], NOW)
    assert res.unresolvable == {"n1": info.error}


@pytest.mark.parametrize("node", ["a node", ["n"], {}, {"metadata": "n1"}, {"metadata": {"name": ""}},
                                  {"metadata": {"name": 5}}])
def test_nodes_without_a_name_raise_inventory_error(node: Any) -> None:
    with pytest.raises(InventoryError):
        project_node(node)
    view = ClusterView()
    view.replace_nodes([node, node_obj("ok", [mps_gpu("ok", 0)])])  # a relist skips it, keeps the rest
    assert list(view.nodes) == ["ok"]


# --------------------------------------------------------------------------- prices

def priced(name: str, *, labels: dict[str, Any] | None = None, annotations: dict[str, Any] | None = None,
           gpus: int = 2, product: str = "H100-80GB", config: Any = PRICES) -> float:
    node = node_obj(name, [mps_gpu(name, i, product=product) for i in range(gpus)], labels=labels,
                    annotations=annotations)
    info = project_node(node, config=config)
    assert info.error == ""
    return info.spec.cost_per_hour


def test_price_annotation_first_then_instance_type_then_gpu_hourly() -> None:
    p5 = {ann.INSTANCE_TYPE_LABEL: "p5.48xlarge"}
    assert priced("a", labels=p5, annotations={ann.HOURLY_COST_KEY: "7.5"}) == 7.5
    assert priced("b", labels=p5) == 98.32
    assert priced("c", labels={**p5, ann.CAPACITY_TYPE_LABEL: "spot"}) == 39.3
    assert priced("d", labels={**p5, "cloud.google.com/gke-spot": "true"}) == 39.3
    assert priced("e", labels={"beta.kubernetes.io/instance-type": "p5.48xlarge"}) == 98.32
    assert math.isclose(priced("f", labels={ann.INSTANCE_TYPE_LABEL: "m5.large"}, gpus=3), 3 * 4.1)
    assert math.isclose(priced("g", gpus=2), 8.2)
    assert priced("h", product="L4") == 0.0  # no price for L4 anywhere
    assert priced("i", labels=p5, config=None) == 0.0
    assert priced("j", annotations={ann.HOURLY_COST_KEY: "0"}) == 0.0  # the operator's word, even zero


def test_capacity_type_labels() -> None:
    assert capacity_type({"eks.amazonaws.com/capacityType": "SPOT"}) == "spot"
    assert capacity_type({"kubernetes.azure.com/scalesetpriority": "spot"}) == "spot"
    assert capacity_type({"cloud.google.com/gke-preemptible": "true"}) == "spot"
    assert capacity_type({ann.CAPACITY_TYPE_LABEL: "on-demand"}) == "on-demand"
    assert capacity_type({}) == "on-demand"


def test_prices_reach_the_state_through_the_view() -> None:
    objs = [node_obj("a", [mps_gpu("a", 0)], labels={ann.INSTANCE_TYPE_LABEL: "p5.48xlarge"}),
            node_obj("b", [mps_gpu("b", 0)], annotations={ann.HOURLY_COST_KEY: "2.25"})]
    view = ClusterView.from_objects(objs, NOW, config=PRICES)
    st_ = view.state
    assert st_.node_cost[view.node_row("a")] == 98.32 and st_.node_cost[view.node_row("b")] == 2.25
    view.upsert_node(node_obj("b", [mps_gpu("b", 0)], annotations={ann.HOURLY_COST_KEY: "3"}))
    assert view.state.node_cost[view.node_row("b")] == 3.0


# --------------------------------------------------------------------------- fuzz: never an untyped exception

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.sampled_from([10**400, -1, 0]) |
    st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8) |
    st.sampled_from(["1", "2Gi", "-3", "1e999", "GPU-x", "Running", "Always", "{}", '{"v": 1}']),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
        ["name", "uid", "kind", "controller", "cpu", "memory", "limits", "requests", "resources", "nodeName",
         "key", "operator", "values", "v"]), inner, max_size=3),
    max_leaves=6)

POD_PATHS = [
    ("metadata",), ("metadata", "uid"), ("metadata", "name"), ("metadata", "annotations"),
    ("metadata", "ownerReferences"), ("metadata", "ownerReferences", 0), ("metadata", "ownerReferences", 0, "kind"),
    ("metadata", "namespace"), ("metadata", "annotations", ann.ASSIGNMENT_KEY),
    ("metadata", "annotations", ann.ALLOCATED_KEY), ("metadata", "annotations", "example.com/gpu-memory"),
    ("metadata", "annotations", "example.com/gpu-isolation"), ("spec",), ("spec", "containers"),
    ("spec", "containers", 0), ("spec", "containers", 0, "resources"), ("spec", "containers", 0, "resources",
                                                                         "requests"),
    ("spec", "containers", 0, "resources", "requests", "cpu"), ("spec", "containers", 0, "resources", "limits"),
    ("spec", "initContainers"), ("spec", "overhead"), ("spec", "priority"), ("spec", "nodeName"),
    ("spec", "nodeSelector"), ("spec", "affinity"), ("status",), ("status", "phase"),
]
NODE_PATHS = [
    ("metadata", "labels"), ("metadata", "annotations"), ("metadata", "labels", ann.PRODUCT_LABEL),
    ("metadata", "labels", ann.INSTANCE_TYPE_LABEL), ("metadata", "labels", ann.CAPACITY_TYPE_LABEL),
    ("metadata", "annotations", ann.INVENTORY_KEY), ("metadata", "annotations", ann.CORDON_KEY),
    ("metadata", "annotations", ann.HOURLY_COST_KEY), ("status",), ("status", "allocatable"),
    ("status", "allocatable", "cpu"), ("status", "allocatable", "memory"),
]


def put(obj: Any, path: tuple[Any, ...], value: Any) -> None:
    """Set ``value`` at ``path`` when the objects on the way are still there (earlier edits may have
    replaced them)."""
    def has(o: Any, key: Any) -> bool:
        return (isinstance(o, dict) and key in o) or (isinstance(o, list) and isinstance(key, int) and len(o) > key)

    for key in path[:-1]:
        if not has(obj, key):
            return
        obj = obj[key]
    if isinstance(obj, dict) or has(obj, path[-1]):
        obj[path[-1]] = value


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(POD_PATHS), json_values), min_size=1, max_size=3))
def test_hostile_pods_raise_only_typed_errors(edits: list[tuple[tuple[Any, ...], Any]]) -> None:
    pod = pod_obj("u1", 2, node="n1", owner="web", priority=3, assigned=sids(mps_gpu("n1", 0).uuid, 2))
    for path, value in edits:
        put(pod, path, copy.deepcopy(value))
    try:
        info = project(pod)
    except GpuSliceError:
        info = None
    if info is not None and not info.error and info.request is not None and info.request.slices <= S:
        info.pack(S)
    view = ClusterView.from_objects([node_obj("n1", [mps_gpu("n1", 0)])], NOW)
    sched = Scheduler.from_config(view)
    sched.filter(pod, ["n1"], NOW)
    sched.prioritize(pod, ["n1"], NOW)
    sched.preempt(pod, ["n1"], NOW)
    sched.bind_check(pod, "n1", NOW)
    with contextlib.suppress(GpuSliceError):
        view.upsert_pod(pod, NOW)
    view.replace_pods([pod], NOW)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(NODE_PATHS), json_values), min_size=1, max_size=3))
def test_hostile_nodes_never_raise(edits: list[tuple[tuple[Any, ...], Any]]) -> None:
    node = node_obj("n1", [mps_gpu("n1", 0)], labels={ann.INSTANCE_TYPE_LABEL: "p5.48xlarge"})
    for path, value in edits:
        put(node, path, copy.deepcopy(value))
    info = project_node(node, config=PRICES)
    assert info.error or info.spec.cost_per_hour >= 0
    view = ClusterView(config=PRICES)
    view.upsert_node(node)
    res = Scheduler.from_config(view, PRICES).filter(pod_obj("u1", 1), ["n1"], NOW)
    assert res.feasible == ("n1",) or res.failed or res.unresolvable


def test_slim_objects_project_exactly_as_the_full_ones() -> None:
    """The extender keeps slim copies of watched objects: they must read the same as the originals."""
    from gpuslice import nodes as node_mod
    from gpuslice import pods as pod_mod
    from gpuslice.fakecluster import FakeClusterSpec, generate

    items = generate(FakeClusterSpec(nodes=4, mode="mixed", pods_per_node=3, seed=7)).document["items"]
    pods = [i for i in items if i["kind"] == "Pod"]
    full_nodes = [i for i in items if i["kind"] == "Node"]
    assert pods and full_nodes
    for pod in pods:
        pod = {**pod, "spec": {**pod["spec"], "volumes": [{"name": "x"}]},
               "status": {**pod.get("status", {}), "conditions": [{"type": "Ready"}]}}
        slim = pod_mod.slim(pod)
        assert "volumes" not in slim["spec"] and "conditions" not in slim["status"]
        assert pod_mod.project(slim) == pod_mod.project(pod)
    for node in full_nodes:
        node = {**node, "status": {**node["status"], "images": [{"names": ["a"] * 50}]}}
        slim = node_mod.slim(node)
        assert "images" not in slim["status"]
        assert node_mod.project_node(slim) == node_mod.project_node(node)


def test_slim_keeps_what_is_malformed_so_the_projection_names_it() -> None:
    from gpuslice import nodes as node_mod
    from gpuslice import pods as pod_mod

    bad_node = {"metadata": {"name": "n"}, "status": "Ready"}
    assert node_mod.project_node(node_mod.slim(bad_node)).error == node_mod.project_node(bad_node).error != ""
    bad_pod = {"metadata": {"name": "p", "uid": "u", "ownerReferences": "rs"}, "spec": {"containers": "c"}}
    assert pod_mod.project(pod_mod.slim(bad_pod)).error == pod_mod.project(bad_pod).error != ""
