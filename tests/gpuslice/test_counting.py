"""The counting rule (DESIGN 3), clause by clause, and the same-size bind predicate."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice import annotations as ann
from gpuslice.annotations import Allocated, Assignment
from gpuslice.counting import (
    bind_conflicts,
    held_by_node,
    held_slices,
    inventory_with_pods,
    placement_from_assignment,
    placements_suit_both,
)
from gpuslice.model import Gpu, MigInstance, NodeInventory
from gpuslice.placement import Placement, enumerate_placements
from gpuslice.requests import SliceRequest

NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)
TTL = timedelta(seconds=30)
GPU = "GPU-aaaaaaaa-0000-4000-8000-000000000001"
GPU2 = "GPU-aaaaaaaa-0000-4000-8000-000000000002"
MIG1 = "MIG-bbbbbbbb-0000-4000-8000-000000000001"
MIG2 = "MIG-bbbbbbbb-0000-4000-8000-000000000002"


def sid(owner: str, n: int) -> str:
    return f"{owner}::{n}"


def make_pod(uid: str, *, node: str | None = "n1", assigned: tuple[str, ...] | None = None,
             assign_node: str = "n1", assign_uid: str | None = None, allocated: tuple[str, ...] | None = None,
             phase: str = "Running", at: datetime = NOW - timedelta(minutes=5),
             raw: dict[str, str] | None = None) -> dict[str, Any]:
    annotations: dict[str, str] = {}
    if assigned is not None:
        annotations[ann.ASSIGNMENT_KEY] = ann.encode_assignment(Assignment(
            assign_uid or uid, assign_node, (GPU,), None, assigned, "fragmentation", at))
    if allocated is not None:
        annotations[ann.ALLOCATED_KEY] = ann.encode_allocated(Allocated(allocated, at + timedelta(seconds=1)))
    annotations.update(raw or {})
    spec: dict[str, Any] = {"containers": [{"name": "c"}]}
    if node is not None:
        spec["nodeName"] = node
    return {"metadata": {"name": f"pod-{uid}", "namespace": "ns", "uid": uid, "annotations": annotations},
            "spec": spec, "status": {"phase": phase}}


def count(pods: list[dict[str, Any]], node: str = "n1") -> dict[str, frozenset[str]]:
    return {uid: h.slice_ids for uid, h in held_slices(node, pods, now=NOW, reservation_ttl=TTL).held.items()}


A = (sid(GPU, 0), sid(GPU, 1))
B = (sid(GPU, 2), sid(GPU, 3))


def test_bound_pod_holds_its_assignment() -> None:
    h = held_slices("n1", [make_pod("u1", assigned=A)], now=NOW, reservation_ttl=TTL)
    assert h.held["u1"].slice_ids == frozenset(A)
    assert h.held["u1"].source == "assignment" and h.held["u1"].bound
    assert h.problems == ()
    assert h.ids() == frozenset(A)


def test_allocated_wins_over_assignment() -> None:
    h = held_slices("n1", [make_pod("u1", assigned=A, allocated=B)], now=NOW, reservation_ttl=TTL)
    held = h.held["u1"]
    assert held.slice_ids == frozenset(B) and held.source == "allocated" and held.drift


def test_terminal_phases_hold_nothing() -> None:
    assert count([make_pod("u1", assigned=A, phase="Succeeded"), make_pod("u2", assigned=B, phase="Failed")]) == {}
    assert count([make_pod("u1", assigned=A, phase="Pending")]) == {"u1": frozenset(A)}


def test_node_mismatch_holds_nothing_and_is_reported() -> None:
    h = held_slices("n1", [make_pod("u1", node="n1", assigned=A, assign_node="n2")], now=NOW, reservation_ttl=TTL)
    assert h.held == {}
    assert [str(p) for p in h.problems] == [
        "pod ns/pod-u1 (u1): bound to node n1 but assigned to n2; it holds nothing by the assignment"]
    # and on the assigned node it holds nothing either
    assert count([make_pod("u1", node="n1", assigned=A, assign_node="n2")], node="n2") == {}


def test_pods_of_other_nodes_are_ignored() -> None:
    h = held_slices("n1", [make_pod("u1", node="n2", assigned=A, assign_node="n2")], now=NOW, reservation_ttl=TTL)
    assert h.held == {} and h.problems == ()


def test_uid_mismatch_holds_nothing() -> None:
    h = held_slices("n1", [make_pod("copy", assigned=A, assign_uid="original")], now=NOW, reservation_ttl=TTL)
    assert h.held == {}
    assert [p.reason for p in h.problems] == [
        "example.com/gpu-slice.assignment is for pod UID 'original', not this pod; it holds nothing"]


def test_unbound_assignment_holds_until_reservation_expires() -> None:
    fresh = make_pod("u1", node=None, assigned=A, at=NOW - TTL + timedelta(seconds=1))
    expired = make_pod("u2", node=None, assigned=B, at=NOW - TTL)
    h = held_slices("n1", [fresh, expired], now=NOW, reservation_ttl=TTL)
    assert {u: x.slice_ids for u, x in h.held.items()} == {"u1": frozenset(A)}
    assert not h.held["u1"].bound
    assert h.problems == ()
    # a bound pod keeps its slices however old its assignment
    assert count([make_pod("u3", assigned=A, at=NOW - timedelta(days=30))]) == {"u3": frozenset(A)}


def test_malformed_annotations_hold_nothing_and_are_reported() -> None:
    bad_json = make_pod("u1", raw={ann.ASSIGNMENT_KEY: "{not json"})
    future = make_pod("u2", raw={ann.ASSIGNMENT_KEY: '{"v": 2}'})
    good = make_pod("u4", assigned=B)
    h = held_slices("n1", [bad_json, future, good], now=NOW, reservation_ttl=TTL)
    assert set(h.held) == {"u4"}
    reasons = {p.pod_uid: p.reason for p in h.problems}
    assert reasons["u1"].startswith("example.com/gpu-slice.assignment is not valid JSON")
    assert reasons["u2"] == ("unsupported version 2 of example.com/gpu-slice.assignment; this build reads "
                             "version 1; the pod holds nothing until it is fixed")


def test_malformed_allocated_stamp_falls_back_to_the_assignment() -> None:
    """A running pod whose stamp is broken keeps its slices: freeing them would double-book the GPU."""
    bad_alloc = make_pod("u3", assigned=A, raw={ann.ALLOCATED_KEY: '{"v": 1, "sliceIds": ["x"], '
                                                                   '"time": "2025-01-01T00:00:00Z"}'})
    h = held_slices("n1", [bad_alloc], now=NOW, reservation_ttl=TTL)
    assert {u: (x.slice_ids, x.source) for u, x in h.held.items()} == {"u3": (frozenset(A), "assignment")}
    assert [p.reason for p in h.problems] == [
        "example.com/gpu-slice.allocated: sliceIds: device id 'x' is not of the form <uuid>::<n>; counted by "
        "its example.com/gpu-slice.assignment instead"]


def test_malformed_assignment_of_a_stamped_bound_pod_counts_the_stamp() -> None:
    stamped = make_pod("u5", allocated=A, raw={ann.ASSIGNMENT_KEY: "{not json"})
    h = held_slices("n1", [stamped], now=NOW, reservation_ttl=TTL)
    assert {u: x.slice_ids for u, x in h.held.items()} == {"u5": frozenset(A)}
    assert h.problems[0].reason.endswith("counted by its example.com/gpu-slice.allocated stamp instead")


def test_pod_without_assignment_holds_its_allocated_ids() -> None:
    other_scheduler = make_pod("u1", allocated=A)
    h = held_slices("n1", [other_scheduler], now=NOW, reservation_ttl=TTL)
    assert h.held["u1"].slice_ids == frozenset(A) and h.held["u1"].assignment is None
    assert count([make_pod("u2", node=None, allocated=A)]) == {}


def test_pods_without_annotations_hold_nothing() -> None:
    assert held_slices("n1", [make_pod("u1"), {"metadata": {}}], now=NOW, reservation_ttl=TTL).held == {}


def test_an_id_is_never_counted_twice() -> None:
    reserved = make_pod("r", node=None, assigned=(sid(GPU, 1), sid(GPU, 2)), at=NOW - timedelta(seconds=5))
    running = make_pod("x", assigned=A, allocated=A)
    h = held_slices("n1", [reserved, running], now=NOW, reservation_ttl=TTL)
    assert h.held["x"].slice_ids == frozenset(A)
    assert h.held["r"].slice_ids == frozenset({sid(GPU, 2)})
    assert [str(p) for p in h.problems] == [
        f"pod ns/pod-r (r): ids {sid(GPU, 1)} are already held by ns/pod-x; not counted twice"]


def test_inventory_with_pods_sets_used_and_reports_unknown_ids() -> None:
    gpus = (Gpu(GPU, 0, "H100-80GB", 81559, "mps", 7),)
    pods = [make_pod("u1", assigned=A), make_pod("u2", assigned=(sid(GPU, 9),))]
    inv, holdings = inventory_with_pods("n1", gpus, pods, now=NOW, reservation_ttl=TTL)
    assert inv.used == frozenset(A)
    assert [str(p) for p in holdings.problems] == [
        f"pod ns/pod-u2 (u2): holds ids not advertised on node n1: {sid(GPU, 9)}"]


def test_held_by_node_reports_each_problem_once() -> None:
    pods = [make_pod("u1", node=None, raw={ann.ASSIGNMENT_KEY: "{"}), make_pod("u2", assigned=A),
            make_pod("u3", node="n2", assigned=B, assign_node="n2")]
    by_node, problems = held_by_node(pods, now=NOW, reservation_ttl=TTL)
    assert {n: set(h.held) for n, h in by_node.items()} == {"n1": {"u2"}, "n2": {"u3"}}
    assert [p.pod_uid for p in problems] == ["u1"]


# --------------------------------------------------------------------------- property: no id twice

claims = st.lists(st.tuples(
    st.sampled_from(["a", "b", "c", "d", "e", "f"]),                     # uid (duplicates allowed)
    st.sampled_from([None, "n1", "n2"]),                                # nodeName
    st.sampled_from(["n1", "n2"]),                                      # assignment node
    st.lists(st.integers(0, 6), min_size=1, max_size=4, unique=True),   # assigned ordinals
    st.one_of(st.none(), st.lists(st.integers(0, 6), min_size=1, max_size=4, unique=True)),  # allocated
    st.sampled_from(["Running", "Pending", "Succeeded", "Failed"]),
    st.integers(0, 120),                                                # assignment age (s)
), max_size=12)


@settings(max_examples=300)
@given(claims)
def test_property_no_id_counted_twice(specs: list[tuple[Any, ...]]) -> None:
    pods = [make_pod(uid, node=node, assigned=tuple(sid(GPU, n) for n in assigned), assign_node=an,
                     allocated=None if alloc is None else tuple(sid(GPU, n) for n in alloc), phase=phase,
                     at=NOW - timedelta(seconds=age))
            for uid, node, an, assigned, alloc, phase, age in specs]
    for node in ("n1", "n2"):
        h = held_slices(node, pods, now=NOW, reservation_ttl=TTL)
        seen: set[str] = set()
        for held in h.held.values():
            assert not (held.slice_ids & seen)
            seen |= held.slice_ids
        for uid, held in h.held.items():
            mine = [p for p in pods if p["metadata"]["uid"] == uid]
            assert any(p["status"]["phase"] not in ("Succeeded", "Failed") for p in mine)
            assert held.assignment is None or held.assignment.node == node
            if held.source == "allocated" and held.allocated is not None:
                assert held.slice_ids <= frozenset(held.allocated.slice_ids)


# --------------------------------------------------------------------------- same-size pods at bind

def mig_inventory() -> NodeInventory:
    insts = (MigInstance(MIG1, "1g.10gb", 0, 1, 9984), MigInstance(MIG2, "1g.20gb", 2, 1, 20096))
    return NodeInventory("n1", (Gpu(GPU, 0, "H100-80GB", 81559, "mig", 2, instances=insts),
                                Gpu(GPU2, 1, "H100-80GB", 81559, "mps", 7)))


def test_identical_replicas_suit_each_other() -> None:
    inv = mig_inventory()
    req = SliceRequest(1)
    first, second = enumerate_placements(inv, req).placements[:2]
    assert placements_suit_both(first, req, second, req, inv)


def test_memory_floor_breaks_the_swap() -> None:
    inv = mig_inventory()
    small, big = SliceRequest(1), SliceRequest(1, Fraction(15 * 1024))
    p_small = Placement("n1", "mig", (GPU,), MIG1, (sid(MIG1, 0),), 9984)
    p_big = Placement("n1", "mig", (GPU,), MIG2, (sid(MIG2, 0),), 20096)
    assert not placements_suit_both(p_small, small, p_big, big, inv)
    assert not placements_suit_both(p_big, big, p_small, small, inv)


def test_isolation_breaks_the_swap_and_sizes_must_match() -> None:
    inv = mig_inventory()
    mig_only, anything = SliceRequest(1, isolation="mig"), SliceRequest(1)
    p_mig = Placement("n1", "mig", (GPU,), MIG1, (sid(MIG1, 0),), 9984)
    p_mps = Placement("n1", "mps", (GPU2,), None, (sid(GPU2, 0),), 81559 // 7)
    assert not placements_suit_both(p_mig, mig_only, p_mps, anything, inv)
    assert placements_suit_both(p_mig, anything, p_mps, anything, inv)
    assert not placements_suit_both(p_mig, SliceRequest(2), p_mps, anything, inv)


def test_placement_from_assignment() -> None:
    inv = mig_inventory()
    a = Assignment("u", "n1", (GPU2,), None, (sid(GPU2, 0), sid(GPU2, 1)), "p", NOW)
    # (81559 MiB - 512 for the MPS server - 7 x 256 for client contexts) x 2/7
    assert placement_from_assignment(a, inv) == Placement("n1", "mps", (GPU2,), None, a.slice_ids, 22644)
    m = Assignment("u", "n1", (GPU,), MIG2, (sid(MIG2, 0),), "p", NOW)
    assert placement_from_assignment(m, inv).memory_mib == 20096


def test_bind_conflicts_only_for_unstamped_same_size_that_do_not_suit() -> None:
    inv = mig_inventory()
    pending_big = make_pod("big", raw={})
    pending_big["metadata"]["annotations"][ann.ASSIGNMENT_KEY] = ann.encode_assignment(
        Assignment("big", "n1", (GPU,), MIG2, (sid(MIG2, 0),), "p", NOW - timedelta(seconds=3)))
    holdings = held_slices("n1", [pending_big], now=NOW, reservation_ttl=TTL)
    new_placement = Placement("n1", "mig", (GPU,), MIG1, (sid(MIG1, 0),), 9984)
    requests = {"big": SliceRequest(1, Fraction(15 * 1024))}
    # the pending pod needs 15 GiB: kubelet could give it the new pod's 9.75 GiB instance -> refuse
    conflicts = bind_conflicts(new_placement, SliceRequest(1), "new", holdings, requests, inv)
    assert [h.pod_uid for h in conflicts] == ["big"]
    # if the pending pod asks no memory floor, either instance suits both -> bind
    assert bind_conflicts(new_placement, SliceRequest(1), "new", holdings, {"big": SliceRequest(1)}, inv) == ()
    # other sizes never conflict
    assert bind_conflicts(new_placement, SliceRequest(2), "new", holdings, requests, inv) == ()
    # once stamped, kubelet has decided: no conflict
    pending_big["metadata"]["annotations"][ann.ALLOCATED_KEY] = ann.encode_allocated(Allocated((sid(MIG2, 0),), NOW))
    stamped = held_slices("n1", [pending_big], now=NOW, reservation_ttl=TTL)
    assert bind_conflicts(new_placement, SliceRequest(1), "new", stamped, requests, inv) == ()


def test_an_assignment_near_the_end_of_time_does_not_overflow() -> None:
    from datetime import UTC, datetime, timedelta

    from gpuslice.counting import held_slices

    far = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)
    pod = {"metadata": {"name": "p", "namespace": "d", "uid": "u", "annotations": {
        "example.com/gpu-slice.assignment": (
            '{"gpus":["GPU-a"],"instance":null,"node":"n","podUID":"u","policy":"x","scores":{},'
            '"sliceIds":["GPU-a::0"],"time":"9999-12-31T23:59:59Z","v":1}')}},
        "spec": {}, "status": {"phase": "Pending"}}
    held = held_slices("n", [pod], now=far, reservation_ttl=timedelta(seconds=60))
    assert held.ids() == frozenset({"GPU-a::0"})  # reserved, not expired, and no OverflowError
