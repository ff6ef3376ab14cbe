"""gpuslice.noderules: kube-scheduler's TaintToleration, NodeUnschedulable and NodeAffinity filters, as
``/bind`` re-checks them whoever calls it (cases from Kubernetes 1.36's helpers and plugin tests)."""

from __future__ import annotations

from typing import Any

import pytest

from gpuslice.errors import InventoryError
from gpuslice.noderules import UNSCHEDULABLE_TAINT, node_rules, refusal


def node(name: str = "gpu-1", *, labels: dict[str, str] | None = None, taints: list[dict[str, str]] | None = None,
         unschedulable: bool | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if taints is not None:
        spec["taints"] = taints
    if unschedulable is not None:
        spec["unschedulable"] = unschedulable
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def pod(*, tolerations: list[dict[str, Any]] | None = None, selector: dict[str, str] | None = None,
        required: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c"}]}
    if tolerations is not None:
        spec["tolerations"] = tolerations
    if selector is not None:
        spec["nodeSelector"] = selector
    if required is not None:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": required}}}
    return {"metadata": {"name": "p", "uid": "u"}, "spec": spec}


DEDICATED = {"key": "team", "value": "a", "effect": "NoSchedule"}


def test_an_untolerated_hard_taint_refuses_and_names_it() -> None:
    why = refusal(pod(), node_rules(node(taints=[DEDICATED])))
    assert why == "node gpu-1 has the taint team=a:NoSchedule that the pod does not tolerate"
    no_execute = {"key": "gpu", "effect": "NoExecute"}
    assert "gpu:NoExecute" in refusal(pod(), node_rules(node(taints=[no_execute])))


def test_prefer_no_schedule_never_refuses() -> None:
    assert refusal(pod(), node_rules(node(taints=[{"key": "k", "value": "v", "effect": "PreferNoSchedule"}]))) == ""


@pytest.mark.parametrize("tol, ok", [
    ({"key": "team", "operator": "Equal", "value": "a", "effect": "NoSchedule"}, True),
    ({"key": "team", "value": "a"}, True),                              # Equal by default, any effect
    ({"key": "team", "operator": "Exists"}, True),
    ({"operator": "Exists"}, True),                                     # empty key with Exists: every taint
    ({"key": "team", "value": "b"}, False),                             # another value
    ({"key": "team", "operator": "Exists", "effect": "NoExecute"}, False),  # another effect
    ({"key": "other", "operator": "Exists"}, False),
    ({"key": "team", "operator": "Lt", "value": "a"}, False),           # an operator it does not know
])
def test_toleration_matching(tol: dict[str, Any], ok: bool) -> None:
    why = refusal(pod(tolerations=[tol]), node_rules(node(taints=[DEDICATED])))
    assert (why == "") is ok, why


def test_a_cordoned_node_takes_only_pods_that_tolerate_the_unschedulable_taint() -> None:
    cordoned = node_rules(node(unschedulable=True))
    assert "cordoned" in refusal(pod(), cordoned)
    assert refusal(pod(tolerations=[{"key": UNSCHEDULABLE_TAINT, "operator": "Exists",
                                     "effect": "NoSchedule"}]), cordoned) == ""
    assert refusal(pod(), node_rules(node(unschedulable=False))) == ""


def test_node_selector_needs_every_label_equal() -> None:
    rules = node_rules(node(labels={"pool": "a", "zone": "z1"}))
    assert refusal(pod(selector={"pool": "a"}), rules) == ""
    assert refusal(pod(selector={"pool": "a", "zone": "z2"}), rules) == (
        "node gpu-1 does not match the pod's nodeSelector zone=z2")
    assert "nodeSelector pool=a" in refusal(pod(selector={"pool": "a"}), node_rules(node()))


def term(*exprs: dict[str, Any], fields: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"matchExpressions": list(exprs)}
    if fields is not None:
        out["matchFields"] = fields
    return out


def expr(key: str, op: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": op, "values": list(values)}


@pytest.mark.parametrize("terms, ok", [
    ([term(expr("pool", "In", "a", "b"))], True),
    ([term(expr("pool", "NotIn", "a"))], False),
    ([term(expr("pool", "In", "x")), term(expr("gpus", "Gt", "4"))], True),        # terms are ORed
    ([term(expr("pool", "In", "a"), expr("gpus", "Lt", "8"))], False),             # expressions ANDed
    ([term(expr("gpus", "Gt", "7"))], True),
    ([term(expr("pool", "Gt", "1"))], False),                                       # a label that is no number
    ([term(expr("missing", "DoesNotExist")), term(expr("pool", "Exists"))], True),
    ([term(expr("missing", "Exists"))], False),
    ([term()], False),                                                              # only empty terms: nothing
    ([], False),
    ([term(fields=[{"key": "metadata.name", "operator": "In", "values": ["gpu-1"]}])], True),
    ([term(fields=[{"key": "metadata.name", "operator": "NotIn", "values": ["gpu-1"]}])], False),
])
def test_required_node_affinity(terms: list[dict[str, Any]], ok: bool) -> None:
    rules = node_rules(node(labels={"pool": "a", "gpus": "8"}))
    why = refusal(pod(required=terms), rules)
    assert (why == "") is ok, why
    if not ok:
        assert why == "node gpu-1 does not match the pod's required node affinity"


def test_a_pod_whose_constraints_cannot_be_read_is_refused_with_the_field() -> None:
    rules = node_rules(node(labels={"gpus": "8"}))
    assert "spec.tolerations must be a list" in refusal({"spec": {"tolerations": "all"}}, rules)
    why = refusal(pod(required=[term(expr("gpus", "Gt", "x"))]), rules)
    assert why.startswith("the pod's scheduling constraints cannot be read") and "Gt needs exactly one integer" in why
    assert "operator" in refusal(pod(required=[term(expr("gpus", "Near", "1"))]), rules)


def test_a_malformed_node_raises_naming_the_field() -> None:
    with pytest.raises(InventoryError, match=r"spec.taints\[0\] must be an object"):
        node_rules({"metadata": {"name": "n"}, "spec": {"taints": ["x"]}})
    with pytest.raises(InventoryError, match=r"spec\.unschedulable must be a boolean"):
        node_rules({"metadata": {"name": "n"}, "spec": {"unschedulable": "yes"}})


def test_the_projection_keeps_what_the_node_rules_read() -> None:
    """``/bind`` decides on the view's projection (it reads no pod): the projection carries the pod's
    tolerations, nodeSelector and required node affinity, shared by pods that have the same."""
    from gpuslice.pods import project

    tolerant = pod(tolerations=[{"key": "team", "operator": "Exists"}], selector={"pool": "a"},
                   required=[term(expr("gpus", "Gt", "4"))])
    info = project(tolerant)
    rules = node_rules(node(labels={"pool": "a", "gpus": "8"}, taints=[DEDICATED]))
    assert refusal(info.scheduling_spec(), rules) == refusal(tolerant, rules) == ""
    assert "taint team=a:NoSchedule" in refusal(project(pod()).scheduling_spec(), rules)
    assert project(pod()).constraints == "" and project(pod()).scheduling_spec() == {"spec": {}}
    twin = project({**tolerant, "metadata": {"name": "q", "uid": "v"}})
    assert twin.constraints is info.constraints  # one string for pods with the same constraints
