"""Preemption by kube-scheduler 1.36's rules (issue 47): victims most important first, PodDisruptionBudgets
counted and respected, kube-scheduler's proposal used where it suffices, ``preemptionPolicy: Never``,
its node choice, and the extender's own route for shape-only shortfalls with the freed slices held."""

from __future__ import annotations

from typing import Any

import pytest

from gpuslice.disruption import Budget, project_budget, violating
from gpuslice.errors import RequestError
from gpuslice.preemption import NodeVictims, pick_node
from gpuslice.scheduler import WAITING, Scheduler
from gpuslice.view import ClusterView
from tests.gpuslice.test_preemption import running
from tests.gpuslice.test_view import NOW, mig_gpu, mig_uuid, mps_gpu, node_obj, pod_obj

LOW, MID, HIGH = 0, 100, 1000


def labelled(pod: dict[str, Any], **labels: str) -> dict[str, Any]:
    pod["metadata"]["labels"] = dict(labels)
    return pod


def at(pod: dict[str, Any], stamp: str) -> dict[str, Any]:
    pod["metadata"]["creationTimestamp"] = stamp
    return pod


def pdb(name: str, allowed: int, *, ns: str = "ns", disrupted: tuple[str, ...] = (), **match: str) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": name, "namespace": ns},
            "spec": {"selector": {"matchLabels": dict(match)}},
            "status": {"disruptionsAllowed": allowed, "disruptedPods": {p: "2025-01-01T00:00:00Z" for p in disrupted}}}


def sched_of(objs: list[dict[str, Any]], budgets: list[dict[str, Any]] = ()) -> tuple[Scheduler, ClusterView]:
    view = ClusterView.from_objects(objs, NOW)
    for b in budgets:
        view.upsert_budget(b)
    return Scheduler.from_config(view), view


# --------------------------------------------------------------------------- budgets


def test_budget_projection_and_kubes_violation_count() -> None:
    b = project_budget(pdb("web", 1, app="web"))
    assert b == Budget("ns", "web", b.requirements, 1, frozenset())
    view = ClusterView.from_objects([node_obj("n1", [mps_gpu("n1", 0)]),
                                     labelled(running("a", "GPU-n1-0000", 1, 0), app="web"),
                                     labelled(running("b", "GPU-n1-0000", 1, 1), app="web"),
                                     labelled(running("c", "GPU-n1-0000", 1, 2), app="db")], NOW)
    a, bb, c = (view.pod(u) for u in ("a", "b", "c"))
    assert a is not None and bb is not None and c is not None
    assert violating([a], [b]) == frozenset()           # one disruption allowed
    assert violating([a, bb], [b]) == {"b"}              # the second takes it below zero
    assert violating([a, bb, c], [b, project_budget(pdb("db", 0, app="db"))]) == {"b", "c"}
    # A pod the disruption controller already counts is not counted again.
    assert violating([a, bb], [project_budget(pdb("web", 1, disrupted=("pod-a",), app="web"))]) == frozenset()
    # No selector, another namespace: selects nothing.
    empty = project_budget({"metadata": {"name": "e", "namespace": "ns"}, "spec": {}, "status": {}})
    assert violating([a, bb], [empty, project_budget(pdb("web", 0, ns="other", app="web"))]) == frozenset()
    with pytest.raises(RequestError, match="disruptionsAllowed"):
        project_budget({"metadata": {"name": "x", "namespace": "ns"}, "status": {"disruptionsAllowed": "1"}})


# --------------------------------------------------------------------------- one node


def test_victims_come_most_important_first() -> None:
    g = mps_gpu("n1", 0)
    objs = [node_obj("n1", [g]),
            at(running("young", g.uuid, 2, 0, priority=50), "2025-01-02T00:00:00Z"),
            at(running("old", g.uuid, 2, 2, priority=50), "2025-01-01T00:00:00Z"),
            at(running("low", g.uuid, 3, 4, priority=10), "2025-01-01T00:00:00Z")]
    sched, _ = sched_of(objs)
    got = sched.preempt(pod_obj("new", 7, priority=MID), ["n1"], NOW)["n1"]
    assert [p.uid for p in got.victims] == ["old", "young", "low"]  # priority, then the older first
    assert got.violations == 0


def test_a_budget_is_kept_when_another_set_frees_the_shape() -> None:
    """Two MPS GPUs, each 5 of 7 slices held by one low pod: evicting either frees 7; the one a budget
    protects is kept."""
    g0, g1 = mps_gpu("n1", 0), mps_gpu("n1", 1)
    objs = [node_obj("n1", [g0, g1]), labelled(running("guarded", g0.uuid, 5), app="db"),
            labelled(running("free", g1.uuid, 5), app="web")]
    sched, view = sched_of(objs, [pdb("db", 0, app="db")])
    budgets = list(view.budgets.values())
    got = sched.preempt(pod_obj("new", 7, priority=MID), ["n1"], NOW, budgets=budgets)["n1"]
    assert [p.uid for p in got.victims] == ["free"] and got.violations == 0
    # Only the guarded one can free it: kube-scheduler is told of the violation (it decides).
    objs[2] = labelled(running("free", g1.uuid, 5, priority=HIGH), app="web")
    sched, view = sched_of(objs, [pdb("db", 0, app="db")])
    got = sched.preempt(pod_obj("new", 7, priority=MID), ["n1"], NOW, budgets=list(view.budgets.values()))["n1"]
    assert [p.uid for p in got.victims] == ["guarded"] and got.violations == 1


def test_the_proposal_is_used_where_it_suffices_and_its_bounds_are_kept() -> None:
    """Two MIG 2g instances held by low pods a and b: kube-scheduler proposed b; b it is."""
    g = mig_gpu("n1", 0, [("2g.20gb", 0), ("2g.20gb", 2), ("3g.40gb", 4)])
    objs = [node_obj("n1", [g]), running("a", mig_uuid("n1", 0, "0"), 2), running("b", mig_uuid("n1", 0, "2"), 2),
            running("c", mig_uuid("n1", 0, "4"), 3, priority=HIGH)]
    sched, _ = sched_of(objs)
    pod = pod_obj("new", 2, priority=MID, isolation="mig")
    assert [p.uid for p in sched.preempt(pod, ["n1"], NOW, allowed={"n1": {"b"}})["n1"].victims] == ["b"]
    assert [p.uid for p in sched.preempt(pod, ["n1"], NOW, allowed={"n1": {"a"}})["n1"].victims] == ["a"]
    # A proposal that frees no usable shape: no answer for the node from it alone.
    assert sched.preempt(pod, ["n1"], NOW, allowed={"n1": set()}) == {}


def test_preemption_policy_never_preempts_nothing() -> None:
    g = mps_gpu("n1", 0)
    sched, _ = sched_of([node_obj("n1", [g]), running("low", g.uuid, 7)])
    pod = pod_obj("new", 3, priority=MID)
    assert sched.preempt(pod, ["n1"], NOW)
    pod["spec"]["preemptionPolicy"] = "Never"
    assert sched.preempt(pod, ["n1"], NOW) == {}
    assert sched.shape_preemption(pod, ["n1"], NOW) is None


# --------------------------------------------------------------------------- which node


def nv(node: str, *prios: int, violations: int = 0) -> NodeVictims:
    objs = [node_obj(node, [mps_gpu(node, 0)])]
    objs += [running(f"{node}-{i}", f"GPU-{node}-0000", 1, i, node=node, priority=p) for i, p in enumerate(prios)]
    view = ClusterView.from_objects(objs, NOW)
    pods = [view.pod(f"{node}-{i}") for i in range(len(prios))]
    return NodeVictims(node, tuple(sorted((p for p in pods if p is not None), key=lambda p: -p.priority)),
                       violations, (), ())


def test_pick_node_follows_kube_schedulers_order() -> None:
    assert pick_node([nv("a", 5, 1), nv("b", 1, 1, 1)]).node == "b"             # the lower highest priority
    assert pick_node([nv("a", 5, violations=1), nv("b", 9)]).node == "b"         # fewer PDB violations first
    assert pick_node([nv("a", 5, 5), nv("b", 5, 1)]).node == "b"                 # then the lower sum
    assert pick_node([nv("a", 5, 0, 0), nv("b", 5, 0)]).node == "b"              # then the fewer victims
    assert pick_node([nv("a", 3), nv("b", 3)]).node == "a"                       # full tie: the first given
    assert pick_node([]) is None


# --------------------------------------------------------------------------- the shape-only route


def mig_node(name: str = "n1", *, taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """One H100 with 2g (start 0), 1g (2), 1g (3), 3g (4): seven slices."""
    node = node_obj(name, [mig_gpu(name, 0, [("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4)])])
    if taints:
        node["spec"] = {"taints": taints}
    return node


def test_shape_only_preemption_frees_the_instance_the_pod_needs_and_holds_it() -> None:
    """The 2g instance is taken by a low pod, the two 1g instances are free: by count the 2-slice pod
    fits, by shape nowhere. The holder of the 2g instance is the victim; its slices are held."""
    objs = [mig_node(), running("holder", mig_uuid("n1", 0, "0"), 2),
            running("big", mig_uuid("n1", 0, "4"), 3, priority=HIGH)]
    sched, view = sched_of(objs)
    urgent = pod_obj("urgent", 2, priority=MID, isolation="mig", phase="Pending")
    view.upsert_pod(urgent, NOW)
    res = sched.filter(urgent, ["n1"], NOW)
    assert res.feasible == () and "n1" in res.failed
    chosen = sched.shape_preemption(urgent, ["n1"], NOW)
    assert chosen is not None and [p.uid for p in chosen.victims] == ["holder"]
    sched.nominate(urgent, chosen, NOW)
    # Until the victim has left, the pod waits, and no other pod may take the held slices.
    assert sched.filter(urgent, ["n1"], NOW + 1).failed == {"n1": WAITING}
    other = pod_obj("other", 2, priority=HIGH, isolation="mig", phase="Pending")
    view.upsert_pod(other, NOW)
    view.remove_pod("holder")
    assert sched.filter(other, ["n1"], NOW + 2).feasible == ()
    # The victim gone: the urgent pod is placed on the slices freed for it.
    got = sched.filter(urgent, ["n1"], NOW + 3)
    assert got.feasible == ("n1",) and got.reservation is not None
    assert set(got.reservation.slice_ids) == set(chosen.slice_ids)


def test_shape_only_preemption_respects_budgets_and_node_rules() -> None:
    objs = [mig_node("n1"), labelled(running("guarded", mig_uuid("n1", 0, "0"), 2), app="db"),
            mig_node("n2", taints=[{"key": "team", "value": "b", "effect": "NoSchedule"}]),
            running("x", mig_uuid("n2", 0, "0"), 2, node="n2")]
    sched, view = sched_of(objs, [pdb("db", 0, app="db")])
    urgent = pod_obj("urgent", 2, priority=MID, isolation="mig", phase="Pending")
    budgets = list(view.budgets.values())
    assert sched.shape_preemption(urgent, ["n1", "n2"], NOW, budgets=budgets) is None  # a budget; a taint
    urgent["spec"]["tolerations"] = [{"key": "team", "operator": "Exists"}]
    chosen = sched.shape_preemption(urgent, ["n1", "n2"], NOW, budgets=budgets)
    assert chosen is not None and chosen.node == "n2" and [p.uid for p in chosen.victims] == ["x"]
