"""ClusterView: a packing state kept in step by node and pod events.

The one property that matters: however events arrive (nodes and pods added, changed, removed, in
any order, pods before their node), the view ends in exactly the state a view built in one go from
the final objects has, and the state ``rebuild()`` gives. The helpers at the top build nodes and
pods as the API server would hand them over; the other decision-API tests import them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice import annotations as ann
from gpuslice import ids
from gpuslice.catalogue import PRODUCTS
from gpuslice.config import load_config
from gpuslice.model import Gpu, MigInstance
from gpuslice.requests import ISOLATION_KEY, MEMORY_KEY, RESOURCE
from gpuslice.reservations import Reservation
from gpuslice.view import ClusterView, ViewSettings

NOW = 1_750_000_000.0  # whole seconds: assignment times round-trip exactly
NOW_DT = datetime.fromtimestamp(NOW, UTC)
S = 7
H100 = "H100-80GB"
H100_MIB = PRODUCTS[H100].memory_mib or 0


# --------------------------------------------------------------------------- builders

def gpu_uuid(node: str, i: int) -> str:
    return f"GPU-{node}-{i:04d}"


def mig_uuid(node: str, i: int, tag: str) -> str:
    return f"MIG-{node}-{i:04d}-{tag}"


def mps_gpu(node: str, i: int, *, product: str = H100, slices: int = S, **kw: Any) -> Gpu:
    return Gpu(gpu_uuid(node, i), i, product, PRODUCTS[product].memory_mib or 0, "mps", slices, **kw)


def whole_gpu(node: str, i: int, *, product: str = H100, slices: int = S, **kw: Any) -> Gpu:
    return Gpu(gpu_uuid(node, i), i, product, PRODUCTS[product].memory_mib or 0, "whole", slices, **kw)


def mig_gpu(node: str, i: int, layout: Sequence[tuple[str, int]], *, product: str = H100, tag: str = "",
            **kw: Any) -> Gpu:
    """A MIG GPU with instances ``(profile, start)``; instance UUIDs end in ``<tag><start>``."""
    prod = PRODUCTS[product]
    insts = tuple(MigInstance(mig_uuid(node, i, f"{tag}{start}"), name, start, prod.profile(name).compute_slices,
                              prod.profile(name).memory_mib) for name, start in layout)
    return Gpu(gpu_uuid(node, i), i, product, prod.memory_mib or 0, "mig",
               sum(x.compute_slices for x in insts), instances=insts, **kw)


def node_obj(name: str, gpus: Iterable[Gpu] | None, *, cpu: str = "64", memory: str = "512Gi",
             cordon: Iterable[str] = (), annotations: Mapping[str, Any] | None = None,
             labels: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A v1 Node; ``gpus`` None: a node without the inventory annotation."""
    notes: dict[str, Any] = {}
    if gpus is not None:
        notes[ann.INVENTORY_KEY] = ann.encode_inventory(tuple(gpus))
    if cordon:
        notes[ann.CORDON_KEY] = ann.encode_cordon(cordon)
    notes.update(annotations or {})
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": notes, "labels": dict(labels or {})},
            "status": {"allocatable": {"cpu": cpu, "memory": memory}}}


def gpus_of(slice_ids: Sequence[str]) -> tuple[tuple[str, ...], str | None]:
    """(GPU UUIDs, MIG instance or None) named by ids built with the helpers above."""
    owners = list(dict.fromkeys(ids.owner_of(s) for s in slice_ids))
    if owners[0].startswith("MIG-"):
        return ("GPU-" + owners[0][4:].rsplit("-", 1)[0],), owners[0]
    return tuple(owners), None


def assignment_of(uid: str, node: str, slice_ids: Sequence[str], at: datetime) -> ann.Assignment:
    gpus, inst = gpus_of(slice_ids)
    return ann.Assignment(uid, node, gpus, inst, tuple(slice_ids), "fragmentation", at)


def pod_obj(uid: str, slices: int = 1, *, node: str | None = None, assigned: Sequence[str] | None = None,
            assign_node: str | None = None, allocated: Sequence[str] | None = None,
            at: datetime = NOW_DT - timedelta(minutes=5), phase: str = "Running", cpu: str = "1",
            memory: str = "1Gi", owner: str | None = None, priority: int | None = None,
            isolation: str | None = None, gpu_memory: str | None = None, product: str | None = None,
            annotations: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A v1 Pod asking ``slices`` (0: none). ``assigned``: the assignment's ids (on ``assign_node``,
    default ``node``); ``allocated``: the plugin's stamp."""
    notes: dict[str, Any] = {}
    if assigned is not None:
        where = assign_node or node
        assert where
        notes[ann.ASSIGNMENT_KEY] = ann.encode_assignment(assignment_of(uid, where, assigned, at))
    if allocated is not None:
        notes[ann.ALLOCATED_KEY] = ann.encode_allocated(ann.Allocated(tuple(allocated), at + timedelta(seconds=2)))
    if isolation is not None:
        notes[ISOLATION_KEY] = isolation
    if gpu_memory is not None:
        notes[MEMORY_KEY] = gpu_memory
    notes.update(annotations or {})
    limits: dict[str, Any] = {RESOURCE: str(slices)} if slices else {}
    spec: dict[str, Any] = {"schedulerName": "gpu-slice-scheduler", "containers": [
        {"name": "server", "resources": {"requests": {"cpu": cpu, "memory": memory}, "limits": limits}}]}
    if node:
        spec["nodeName"] = node
    if priority is not None:
        spec["priority"] = priority
    if product is not None:
        spec["nodeSelector"] = {ann.PRODUCT_LABEL: product}
    meta: dict[str, Any] = {"name": f"pod-{uid}", "namespace": "ns", "uid": uid, "annotations": notes,
                            "creationTimestamp": ann.format_time(at)}
    if owner is not None:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": owner, "uid": owner,
                                    "controller": True}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": {"phase": phase}}


def sids(owner: str, k: int, start: int = 0) -> tuple[str, ...]:
    return tuple(ids.encode(owner, n) for n in range(start, start + k))


# --------------------------------------------------------------------------- what is compared

def snapshot(view: ClusterView) -> dict[str, Any]:
    """The view's packing state by stable keys (node names, GPU/MIG UUIDs), never by row numbers."""
    st = view.state
    units: dict[tuple[str, str], tuple[int, bool, int, int, int]] = {}
    gpu_key: dict[int, tuple[str, str]] = {}
    for name, n in view.nodes.items():
        for key, row in n.keys.items():
            units[(name, key)] = (int(st.unit_free[row]), bool(st.unit_usable[row]), int(st.unit_cap[row]),
                                  int(st.unit_kind[row]), int(st.unit_mem[row]))
            gpu_key[int(st.unit_gpu_id[row])] = (name, st.unit_gpu[row])
        if n.row >= 0:
            assert set(n.row_ids) == set(n.keys.values()) == set(st.node_rows(n.row).tolist())
    nodes = {}
    for name, v in st.node_index.items():
        assert bool(st.node_alive[v])
        nodes[name] = (int(st.node_cpu_free[v]), int(st.node_mem_free[v]), int(st.node_cpu_cap[v]),
                       int(st.node_mem_cap[v]), st.products[int(st.node_product[v])], float(st.node_cost[v]),
                       tuple(int(x) for x in st.node_classes[v]), int(st.node_gpus[v]), int(st.node_slice_cap[v]))
    owners = {(owner, gpu_key[g]): c for owner, per in st._owners.items() for g, c in per.items()}
    live_rows = [r for n in view.nodes.values() for r in n.row_ids]
    return {
        "units": units,
        "nodes": nodes,
        "owners": owners,
        "allocated": st.allocated_slices,
        "total": st.total_slices,
        "allocated_live": int(sum(int(st.unit_cap[r] - st.unit_free[r]) for r in live_rows)),
        "total_live": int(sum(int(st.unit_cap[r]) for r in live_rows)),
        "held": {name: dict(n.held) for name, n in view.nodes.items()},
        "errors": {name: view.node_error(name) for name in view.nodes},
        "reservations": dict(view.reservations.held),
    }


def assert_consistent(snap: Mapping[str, Any]) -> None:
    """Counters kept incrementally agree with the unit rows they summarise."""
    assert snap["allocated"] == snap["allocated_live"]
    assert snap["total"] == snap["total_live"]


# --------------------------------------------------------------------------- a small universe

A_LAYOUT = (("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6))
B_LAYOUT = (("4g.40gb", 0), ("3g.40gb", 4))


def universe_node(name: str, variant: int) -> dict[str, Any]:
    """Versions of one node: 0 base (MPS, MIG, whole GPU), 1 GPU0 cordoned by annotation, 2 GPU1
    unhealthy, 3 MIG layout changed, 4 allocatable CPU and memory changed, 5 no inventory, 6 an
    unreadable cordon, 7 GPU0 switched to whole mode, 8 a price annotation."""
    base = [mps_gpu(name, 0), mig_gpu(name, 1, A_LAYOUT), whole_gpu(name, 2)]
    if variant == 1:
        return node_obj(name, base, cordon=[gpu_uuid(name, 0)])
    if variant == 2:
        return node_obj(name, [base[0], replace(base[1], healthy=False), base[2]])
    if variant == 3:
        return node_obj(name, [base[0], mig_gpu(name, 1, B_LAYOUT, tag="b"), base[2]])
    if variant == 4:
        return node_obj(name, base, cpu="8", memory="16Gi")
    if variant == 5:
        return node_obj(name, None)
    if variant == 6:
        return node_obj(name, base, annotations={ann.CORDON_KEY: "GPU-not-on-this-node"})
    if variant == 7:
        return node_obj(name, [whole_gpu(name, 0), *base[1:]])
    if variant == 8:
        return node_obj(name, base, annotations={ann.HOURLY_COST_KEY: "12.5"})
    return node_obj(name, base)


POD_KINDS = ("mps", "mig", "migb", "whole", "unbound", "expired", "terminal", "badstamp", "plain", "cpuonly",
             "mismatch", "stamped-elsewhere")


def universe_pod(uid: str, kind: str, node: str, other: str, k: int, owner: int) -> dict[str, Any]:
    """Pods in terms of the counting rule; ids may clash with other pods' (the rule settles them)."""
    own = f"rs{owner}"
    at = NOW_DT - timedelta(minutes=5)
    mps = sids(gpu_uuid(node, 0), k, start=k - 1)
    if kind == "mps":
        return pod_obj(uid, k, node=node, assigned=mps, allocated=mps, owner=own)
    if kind == "mig":
        return pod_obj(uid, 2, node=node, assigned=sids(mig_uuid(node, 1, "4"), 2), owner=own)
    if kind == "migb":  # an instance of the other layout: held only while that layout is there
        return pod_obj(uid, 3, node=node, assigned=sids(mig_uuid(node, 1, "b4"), 3), owner=own)
    if kind == "whole":
        return pod_obj(uid, S, node=node, assigned=sids(gpu_uuid(node, 2), S), owner=own, cpu="3")
    if kind == "unbound":
        return pod_obj(uid, k, assigned=mps, assign_node=node, at=NOW_DT - timedelta(seconds=10), owner=own)
    if kind == "expired":
        return pod_obj(uid, k, assigned=mps, assign_node=node, at=NOW_DT - timedelta(seconds=120), owner=own)
    if kind == "terminal":
        return pod_obj(uid, k, node=node, assigned=mps, phase="Succeeded", owner=own, at=at)
    if kind == "badstamp":
        return pod_obj(uid, k, node=node, assigned=mps, owner=own,
                       annotations={ann.ALLOCATED_KEY: '{"v": 1, "sliceIds": 5}'})
    if kind == "plain":
        return pod_obj(uid, k, owner=own)
    if kind == "cpuonly":
        return pod_obj(uid, 0, node=node, cpu="2", memory="3Gi")
    if kind == "mismatch":
        return pod_obj(uid, k, node=node, assigned=sids(gpu_uuid(other, 0), k), assign_node=other, owner=own)
    # bound here, stamped by kubelet with ids of the whole GPU while assigned MPS ids: allocated wins
    return pod_obj(uid, S, node=node, assigned=mps, allocated=sids(gpu_uuid(node, 2), S), owner=own)


NODE_NAMES = ("na", "nb")
POD_UIDS = ("p0", "p1", "p2", "p3", "p4")

node_events = st.tuples(st.just("node"), st.sampled_from(NODE_NAMES), st.integers(0, 8))
node_removals = st.tuples(st.just("rmnode"), st.sampled_from(NODE_NAMES), st.just(0))
pod_events = st.tuples(st.just("pod"), st.sampled_from(POD_UIDS),
                       st.tuples(st.sampled_from(POD_KINDS), st.sampled_from(NODE_NAMES), st.integers(1, 3),
                                 st.integers(0, 1)))
pod_removals = st.tuples(st.just("rmpod"), st.sampled_from(POD_UIDS), st.just(0))
events = st.lists(st.one_of(node_events, node_events, node_removals, pod_events, pod_events, pod_events,
                            pod_removals), max_size=30)


def play(evs: Sequence[tuple[str, str, Any]], view: ClusterView | None = None) -> tuple[
        ClusterView, list[dict[str, Any]]]:
    """Apply events one by one; returns the view and the final objects (nodes, then pods)."""
    view = view or ClusterView()
    nodes: dict[str, dict[str, Any]] = {}
    pods: dict[str, dict[str, Any]] = {}
    for kind, key, arg in evs:
        if kind == "node":
            nodes[key] = universe_node(key, arg)
            view.upsert_node(nodes[key])
        elif kind == "rmnode":
            nodes.pop(key, None)
            view.remove_node(key)
        elif kind == "pod":
            pkind, node, k, owner = arg
            other = next(n for n in NODE_NAMES if n != node)
            pods[key] = universe_pod(key, pkind, node, other, k, owner)
            view.upsert_pod(pods[key], NOW)
        else:
            pods.pop(key, None)
            view.remove_pod(key)
    return view, [*nodes.values(), *pods.values()]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events)
def test_events_in_any_order_end_in_the_state_built_in_one_go(evs: list[tuple[str, str, Any]]) -> None:
    view, final = play(evs)
    got = snapshot(view)
    assert_consistent(got)
    whole = ClusterView.from_objects(final, NOW)
    assert got == snapshot(whole)
    view.rebuild()
    assert snapshot(view) == got
    # and objects listed pods first give the same (a relist does not depend on order either)
    assert snapshot(ClusterView.from_objects(list(reversed(final)), NOW)) == got


def test_scripted_history_matches_one_go() -> None:
    """The cases the brief names, in one deterministic story (a failure here names the step)."""
    steps: list[tuple[str, str, Any]] = [
        ("pod", "p0", ("mps", "na", 2, 0)),  # a pod before its node
        ("pod", "p1", ("whole", "na", 1, 1)),
        ("node", "na", 0),
        ("pod", "p2", ("mig", "na", 1, 0)),
        ("node", "na", 1),  # cordon GPU0
        ("node", "na", 0),  # uncordon
        ("node", "na", 2),  # GPU1 unhealthy
        ("node", "na", 3),  # MIG layout changed under p2: p2's ids are gone
        ("pod", "p3", ("migb", "na", 1, 1)),
        ("node", "na", 4),  # allocatable CPU changed
        ("rmnode", "na", 0),
        ("node", "na", 0),  # re-added
        ("node", "nb", 0),
        ("pod", "p4", ("unbound", "nb", 3, 0)),
        ("pod", "p0", ("terminal", "na", 2, 0)),
        ("rmpod", "p1", 0),
    ]
    view = ClusterView()
    for i in range(len(steps)):
        view, final = play(steps[: i + 1])
        assert snapshot(view) == snapshot(ClusterView.from_objects(final, NOW)), f"after step {i}: {steps[i]}"


# --------------------------------------------------------------------------- single events, by hand

def unit(view: ClusterView, node: str, key: str) -> tuple[int, bool]:
    row = view.nodes[node].keys[key]
    return int(view.state.unit_free[row]), bool(view.state.unit_usable[row])


def test_pod_before_its_node_is_counted_when_the_node_arrives() -> None:
    view = ClusterView()
    g = gpu_uuid("n1", 0)
    view.upsert_pod(pod_obj("u1", 3, node="n1", assigned=sids(g, 3), cpu="2"), NOW)
    assert view.node_row("n1") == -1 and view.node_error("n1") is None
    view.upsert_node(node_obj("n1", [mps_gpu("n1", 0)], cpu="10"))
    assert unit(view, "n1", g) == (4, True)
    v = view.node_row("n1")
    assert int(view.state.node_cpu_free[v]) == 8000
    assert view.state.allocated_slices == 3
    view.remove_pod("u1")
    assert unit(view, "n1", g) == (7, True) and view.state.allocated_slices == 0
    assert int(view.state.node_cpu_free[v]) == 10000


def test_cordon_annotation_and_health_flip_usability_not_usage() -> None:
    g0, g1 = mps_gpu("n1", 0), mps_gpu("n1", 1)
    view = ClusterView.from_objects([node_obj("n1", [g0, g1]),
                                     pod_obj("u1", 2, node="n1", assigned=sids(g0.uuid, 2))], NOW)
    view.upsert_node(node_obj("n1", [g0, g1], cordon=[g0.uuid]))
    assert unit(view, "n1", g0.uuid) == (5, False)  # the running pod keeps its slices
    assert unit(view, "n1", g1.uuid) == (7, True)
    view.upsert_node(node_obj("n1", [g0, replace(g1, healthy=False)], cordon=[g0.uuid]))
    assert unit(view, "n1", g1.uuid) == (7, False)
    view.upsert_node(node_obj("n1", [g0, g1]))
    assert unit(view, "n1", g0.uuid) == (5, True) and unit(view, "n1", g1.uuid) == (7, True)


def test_mig_relayout_retires_rows_and_drops_ids_no_longer_advertised() -> None:
    a = mig_gpu("n1", 0, A_LAYOUT)
    b = mig_gpu("n1", 0, B_LAYOUT, tag="b")
    held = sids(mig_uuid("n1", 0, "4"), 2)  # the 2g instance of layout A
    view = ClusterView.from_objects([node_obj("n1", [a]), pod_obj("u1", 2, node="n1", assigned=held)], NOW)
    assert unit(view, "n1", mig_uuid("n1", 0, "4")) == (0, True)
    assert view.state.allocated_slices == 2 and view.state.total_slices == 6
    view.upsert_node(node_obj("n1", [b]))
    assert set(view.nodes["n1"].keys) == {mig_uuid("n1", 0, "b0"), mig_uuid("n1", 0, "b4")}
    assert view.state.allocated_slices == 0 and view.state.total_slices == 7
    assert any("holds ids not advertised on node n1" in p for p in view.problems())
    view.upsert_node(node_obj("n1", [a]))  # back: the pod's ids are held again
    assert unit(view, "n1", mig_uuid("n1", 0, "4")) == (0, True)
    assert view.state.allocated_slices == 2 and view.state.total_slices == 6


def test_node_removed_and_readded_and_allocatable_change() -> None:
    g = mps_gpu("n1", 0)
    pod = pod_obj("u1", 1, node="n1", assigned=sids(g.uuid, 1), cpu="3", memory="2Gi")
    view = ClusterView.from_objects([node_obj("n1", [g], cpu="16", memory="64Gi"), pod], NOW)
    view.upsert_node(node_obj("n1", [g], cpu="8", memory="32Gi"))
    v = view.node_row("n1")
    assert (int(view.state.node_cpu_free[v]), int(view.state.node_mem_free[v])) == (5000, 30 * 1024)
    view.remove_node("n1")
    assert view.node_row("n1") == -1 and view.state.total_slices == 0 and view.state.allocated_slices == 0
    view.upsert_node(node_obj("n1", [g], cpu="8", memory="32Gi"))
    assert unit(view, "n1", g.uuid) == (6, True)
    v = view.node_row("n1")
    assert (int(view.state.node_cpu_free[v]), int(view.state.node_mem_free[v])) == (5000, 30 * 1024)


def test_unbound_assignment_holds_until_ttl_then_expire_frees_it() -> None:
    g = gpu_uuid("n1", 0)
    view = ClusterView(ViewSettings(reservation_ttl_s=60))
    view.upsert_node(node_obj("n1", [mps_gpu("n1", 0)]))
    view.upsert_pod(pod_obj("u1", 3, assigned=sids(g, 3), assign_node="n1", at=NOW_DT - timedelta(seconds=10),
                            cpu="2"), NOW)
    v = view.node_row("n1")
    assert unit(view, "n1", g) == (4, True)
    assert int(view.state.node_cpu_free[v]) == 62000  # an assigned, unbound pod's CPU counts there too
    view.expire(NOW + 49)
    assert unit(view, "n1", g) == (4, True)
    view.expire(NOW + 50)
    assert unit(view, "n1", g) == (7, True)
    assert int(view.state.node_cpu_free[v]) == 64000
    assert snapshot(view)["units"] == snapshot(ClusterView.from_objects(
        [node_obj("n1", [mps_gpu("n1", 0)])], NOW + 50))["units"]


def test_terminal_pod_holds_nothing() -> None:
    g = gpu_uuid("n1", 0)
    view = ClusterView.from_objects([node_obj("n1", [mps_gpu("n1", 0)], cpu="4"),
                                     pod_obj("u1", 3, node="n1", assigned=sids(g, 3), allocated=sids(g, 3))], NOW)
    assert unit(view, "n1", g) == (4, True)
    view.upsert_pod(pod_obj("u1", 3, node="n1", assigned=sids(g, 3), allocated=sids(g, 3), phase="Failed"), NOW)
    assert unit(view, "n1", g) == (7, True)
    assert int(view.state.node_cpu_free[view.node_row("n1")]) == 4000
    assert view.nodes["n1"].held == {}


def test_an_event_that_moves_only_the_resource_version_changes_nothing_and_the_next_change_counts() -> None:
    """The watch confirming a bind the view already holds (a new resourceVersion, the same pod) leaves
    the state as it was; a later real change (the stamp, then the pod finishing) is still applied."""
    g = gpu_uuid("n1", 0)
    bound = pod_obj("u1", 3, node="n1", assigned=sids(g, 3))
    view = ClusterView.from_objects([node_obj("n1", [mps_gpu("n1", 0)], cpu="4"), bound], NOW)
    before = snapshot(view)
    again = {**bound, "metadata": {**bound["metadata"], "resourceVersion": "2"}}
    view.upsert_pod(again, NOW + 1)
    assert snapshot(view) == before and view.pod("u1") is not None and view.pod("u1").resource_version == "2"
    stamped = pod_obj("u1", 3, node="n1", assigned=sids(g, 3), allocated=sids(g, 3, start=2))
    view.upsert_pod(stamped, NOW + 2)
    assert set(view.nodes["n1"].held) == set(sids(g, 3, start=2))  # the stamp wins over the assignment
    view.upsert_pod(pod_obj("u1", 3, node="n1", assigned=sids(g, 3), allocated=sids(g, 3, start=2),
                            phase="Succeeded"), NOW + 3)
    assert unit(view, "n1", g) == (7, True) and view.nodes["n1"].held == {}


def test_malformed_allocated_stamp_falls_back_to_the_assignment() -> None:
    g = gpu_uuid("n1", 0)
    pod = pod_obj("u1", 2, node="n1", assigned=sids(g, 2, start=3),
                  annotations={ann.ALLOCATED_KEY: "{not json"})
    view = ClusterView.from_objects([node_obj("n1", [mps_gpu("n1", 0)]), pod], NOW)
    assert unit(view, "n1", g) == (5, True)
    assert view.nodes["n1"].held == {f"{g}::3": "u1", f"{g}::4": "u1"}
    assert any("counted by its" in p and ann.ASSIGNMENT_KEY in p for p in view.problems())


def test_allocated_ids_win_over_the_assignment() -> None:
    g0, g1 = mps_gpu("n1", 0), mps_gpu("n1", 1)
    pod = pod_obj("u1", 2, node="n1", assigned=sids(g0.uuid, 2), allocated=sids(g1.uuid, 2))
    view = ClusterView.from_objects([node_obj("n1", [g0, g1]), pod], NOW)
    assert unit(view, "n1", g0.uuid) == (7, True) and unit(view, "n1", g1.uuid) == (5, True)


def test_owner_counts_follow_pods_and_nodes() -> None:
    g0, g1 = mps_gpu("n1", 0), mps_gpu("n1", 1)
    view = ClusterView.from_objects([node_obj("n1", [g0, g1]),
                                     pod_obj("u1", 1, node="n1", assigned=sids(g0.uuid, 1), owner="web"),
                                     pod_obj("u2", 1, node="n1", assigned=sids(g0.uuid, 1, 1), owner="web")], NOW)
    assert snapshot(view)["owners"] == {("ns/ReplicaSet/web", ("n1", g0.uuid)): 2}
    view.remove_pod("u1")
    assert snapshot(view)["owners"] == {("ns/ReplicaSet/web", ("n1", g0.uuid)): 1}
    view.remove_node("n1")
    assert snapshot(view)["owners"] == {}
    # ownerSpread off: the view does not count owners at all (the rule is off)
    off = ClusterView.from_objects([node_obj("n1", [g0]),
                                    pod_obj("u1", 1, node="n1", assigned=sids(g0.uuid, 1), owner="web")], NOW,
                                   config=load_config({"version": "v1", "ownerSpread": False}))
    assert snapshot(off)["owners"] == {}


def test_relist_matches_events_and_drops_what_is_gone() -> None:
    g = mps_gpu("n1", 0)
    view = ClusterView()
    view.upsert_node(node_obj("n1", [g]))
    view.upsert_node(node_obj("gone", [mps_gpu("gone", 0)]))
    view.upsert_pod(pod_obj("u1", 2, node="n1", assigned=sids(g.uuid, 2)), NOW)
    view.upsert_pod(pod_obj("old", 3, node="n1", assigned=sids(g.uuid, 3, 2)), NOW)
    final = [node_obj("n1", [g]), pod_obj("u1", 2, node="n1", assigned=sids(g.uuid, 2))]
    view.replace_nodes([final[0]])
    view.replace_pods([final[1]], NOW)
    assert snapshot(view) == snapshot(ClusterView.from_objects(final, NOW))
    assert "gone" not in view.nodes and unit(view, "n1", g.uuid) == (5, True)


def test_a_node_reread_drops_its_deleted_pods_and_keeps_claims_and_other_nodes() -> None:
    """``replace_node_pods`` with a fresh list of n1's pods: the pod deleted meanwhile goes, the pod
    listed with a new state is upserted, and what such a list cannot show stays (a pod assigned to
    n1 but not bound yet, a pod of another node)."""
    g, h = mps_gpu("n1", 0), mps_gpu("n2", 0)
    assigned = pod_obj("claim", 1, assigned=sids(g.uuid, 1, 6), assign_node="n1", at=NOW_DT)
    other = pod_obj("o1", 2, node="n2", assigned=sids(h.uuid, 2))
    kept = pod_obj("u1", 2, node="n1", assigned=sids(g.uuid, 2))
    view = ClusterView.from_objects([node_obj("n1", [g]), node_obj("n2", [h]), kept, other, assigned,
                                     pod_obj("gone", 3, node="n1", assigned=sids(g.uuid, 3, 2))], NOW)
    assert unit(view, "n1", g.uuid) == (1, True)
    done = pod_obj("u1", 2, node="n1", assigned=sids(g.uuid, 2), phase="Succeeded")
    view.replace_node_pods("n1", [done], NOW)
    final = [node_obj("n1", [g]), node_obj("n2", [h]), done, other, assigned]
    assert snapshot(view) == snapshot(ClusterView.from_objects(final, NOW))
    assert view.pod("gone") is None and view.pod("claim") is not None and view.pod("o1") is not None
    assert unit(view, "n1", g.uuid) == (6, True)


# --------------------------------------------------------------------------- reservations and time in the mix

RESERVE_UIDS = (*POD_UIDS, "r9")
reserve_events = st.tuples(st.just("reserve"), st.sampled_from(RESERVE_UIDS),
                           st.tuples(st.sampled_from(NODE_NAMES), st.integers(1, 3), st.integers(0, 1)))
ticks = st.tuples(st.just("tick"), st.just(""), st.integers(0, 80))
relists = st.tuples(st.just("relist"), st.just(""), st.just(0))
timed_events = st.lists(st.one_of(node_events, node_removals, pod_events, pod_events, pod_removals, reserve_events,
                                  ticks, relists), max_size=30)


def reservation(uid: str, node: str, k: int, which: int, now: float) -> Reservation:
    """``k`` slices of the node's MPS GPU (which 0, its last ids) or its 3g MIG instance (which 1)."""
    owner = gpu_uuid(node, 0) if which == 0 else mig_uuid(node, 1, "0")
    key = (gpu_uuid(node, 0), "") if which == 0 else (gpu_uuid(node, 1), owner)
    taken = sids(owner, k, S - k) if which == 0 else sids(owner, 3)
    return Reservation(uid, node, (key,), k if which == 0 else 3, taken, 500, 100, "ns/ReplicaSet/rs0", now + 60)


def play_timed(evs: Sequence[tuple[str, str, Any]]) -> tuple[ClusterView, list[dict[str, Any]], float]:
    view = ClusterView(ViewSettings(reservation_ttl_s=60))
    nodes: dict[str, dict[str, Any]] = {}
    pods: dict[str, dict[str, Any]] = {}
    now = NOW
    for kind, key, arg in evs:
        if kind == "node":
            nodes[key] = universe_node(key, arg)
            view.upsert_node(nodes[key])
        elif kind == "rmnode":
            nodes.pop(key, None)
            view.remove_node(key)
        elif kind == "pod":
            pkind, node, k, owner = arg
            pods[key] = universe_pod(key, pkind, node, next(n for n in NODE_NAMES if n != node), k, owner)
            view.upsert_pod(pods[key], now)
        elif kind == "rmpod":
            pods.pop(key, None)
            view.remove_pod(key)
        elif kind == "reserve":
            view.hold(reservation(key, *arg, now=now))
        elif kind == "tick":
            now += arg
            view.expire(now)
        else:
            view.replace_pods(list(pods.values()), now)
    return view, [*nodes.values(), *pods.values()], now


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(timed_events)
def test_reservations_expiry_and_relists_match_one_go(evs: list[tuple[str, str, Any]]) -> None:
    """With reservations held, time passing (reservations and unbound assignments expiring) and
    relists: the view equals one built from the final objects with the surviving reservations."""
    view, final, now = play_timed(evs)
    got = snapshot(view)
    assert_consistent(got)
    whole = ClusterView.from_objects(final, now, settings=ViewSettings(reservation_ttl_s=60))
    for r in list(view.reservations.held.values()):
        whole.hold(r)
    assert snapshot(whole) == got
    view.rebuild()
    assert snapshot(view) == got


def test_relist_drops_the_reservation_of_a_pod_now_bound_like_an_event_does() -> None:
    """Found by these tests: ``replace_pods`` kept the reservation of a pod the relist shows bound
    with its assignment, so its CPU and memory counted twice until the TTL ran out."""
    def reserved() -> ClusterView:
        view = ClusterView.from_objects([node_obj("n1", [mps_gpu("n1", 0)], cpu="4")], NOW)
        view.hold(Reservation("u1", "n1", ((gpu_uuid("n1", 0), ""),), 2, sids(gpu_uuid("n1", 0), 2), 1000, 1024,
                              "", NOW + 60))
        return view

    bound = pod_obj("u1", 2, node="n1", assigned=sids(gpu_uuid("n1", 0), 2), cpu="1", memory="1Gi")
    by_event, by_relist = reserved(), reserved()
    by_event.upsert_pod(bound, NOW)
    by_relist.replace_pods([bound], NOW)
    assert "u1" not in by_relist.reservations
    assert snapshot(by_relist) == snapshot(by_event)
    v = by_relist.node_row("n1")
    assert int(by_relist.state.node_cpu_free[v]) == 3000 and unit(by_relist, "n1", gpu_uuid("n1", 0)) == (5, True)


def test_rebuild_keeps_reservations_by_ids() -> None:
    view = ClusterView.from_objects([node_obj("n1", [mps_gpu("n1", 0), mig_gpu("n1", 1, A_LAYOUT)])], NOW)
    view.hold(reservation("u1", "n1", 2, 0, NOW))
    view.hold(reservation("u2", "n1", 3, 1, NOW))
    before = snapshot(view)
    assert unit(view, "n1", gpu_uuid("n1", 0)) == (5, True) and unit(view, "n1", mig_uuid("n1", 1, "0")) == (0, True)
    view.rebuild()
    assert snapshot(view) == before
    assert view.holder("n1", f"{gpu_uuid('n1', 0)}::6") == "u1"
    view.expire(NOW + 60)
    assert unit(view, "n1", gpu_uuid("n1", 0)) == (7, True) and unit(view, "n1", mig_uuid("n1", 1, "0")) == (3, True)
    assert len(view.reservations) == 0
