"""Whether a pod may run on a node at all: taints, cordon, node selector and required node affinity.

kube-scheduler checks these with its TaintToleration, NodeUnschedulable and NodeAffinity filter
plugins before it asks the extender, but ``/bind`` can be called by anyone who reaches the verbs,
and kubelet's admission does not check taints or cordon. So ``/bind`` asks :func:`refusal` again,
and so does the extender's own preemption route, which picks nodes itself. The rules are ported from
Kubernetes 1.36 (``component-helpers/scheduling/corev1``, the plugins above):

* a taint of effect ``NoSchedule`` or ``NoExecute`` must be tolerated (``PreferNoSchedule`` is a
  preference); a toleration matches when its effect is empty or equal, its key empty or equal, and
  ``Exists``, or ``Equal`` (the default) with the same value;
* a cordoned node (``spec.unschedulable``) takes only pods that tolerate
  ``node.kubernetes.io/unschedulable:NoSchedule``;
* every ``nodeSelector`` entry must equal the node's label;
* required node affinity: terms are ORed, the expressions of a term ANDed (``In``, ``NotIn``,
  ``Exists``, ``DoesNotExist``, ``Gt``, ``Lt`` on labels; ``In``/``NotIn`` on ``metadata.name``);
  empty terms are skipped, so a list of only empty terms matches no node.

A field of the wrong shape refuses with its path: a pod or node the API server would not have
admitted is not one to bind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gpuslice.errors import GpuSliceError, InventoryError, RequestError

UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
_HARD_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str
    effect: str


@dataclass(frozen=True, slots=True)
class NodeRules:
    """What of a node decides who may run there (its name, labels, hard taints and cordon)."""

    name: str
    labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    taints: tuple[Taint, ...] = ()
    unschedulable: bool = False


def _obj(value: object, where: str, error: type[GpuSliceError]) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise error(f"{where} must be an object, got {type(value).__name__}")
    return value


def _list(value: object, where: str, error: type[GpuSliceError]) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise error(f"{where} must be a list, got {type(value).__name__}")
    return value


def _text(value: object, where: str, error: type[GpuSliceError]) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise error(f"{where} must be a string, got {type(value).__name__}")
    return value


def node_rules(node: Mapping[str, Any]) -> NodeRules:
    """The rules of a node mapping (raises ``InventoryError`` naming a field of the wrong shape)."""
    meta = _obj(node.get("metadata"), "metadata", InventoryError)
    spec = _obj(node.get("spec"), "spec", InventoryError)
    name = _text(meta.get("name"), "metadata.name", InventoryError)
    raw_labels = _obj(meta.get("labels"), "metadata.labels", InventoryError)
    labels = {str(k): _text(v, f"metadata.labels[{k}]", InventoryError) for k, v in raw_labels.items()}
    taints = []
    for i, raw in enumerate(_list(spec.get("taints"), "spec.taints", InventoryError)):
        t = _obj(raw, f"spec.taints[{i}]", InventoryError)
        effect = _text(t.get("effect"), f"spec.taints[{i}].effect", InventoryError)
        if effect in _HARD_EFFECTS:  # PreferNoSchedule never refuses a pod
            taints.append(Taint(_text(t.get("key"), f"spec.taints[{i}].key", InventoryError),
                                _text(t.get("value"), f"spec.taints[{i}].value", InventoryError), effect))
    unschedulable = spec.get("unschedulable")
    if unschedulable is not None and not isinstance(unschedulable, bool):
        raise InventoryError("spec.unschedulable must be a boolean")
    return NodeRules(name, MappingProxyType(labels) if labels else _EMPTY, tuple(taints), bool(unschedulable))


def _tolerates(tolerations: Sequence[Mapping[str, Any]], taint: Taint) -> bool:
    for i, tol in enumerate(tolerations):
        effect = _text(tol.get("effect"), f"spec.tolerations[{i}].effect", RequestError)
        key = _text(tol.get("key"), f"spec.tolerations[{i}].key", RequestError)
        if effect and effect != taint.effect:
            continue
        if key and key != taint.key:
            continue
        op = _text(tol.get("operator"), f"spec.tolerations[{i}].operator", RequestError)
        if op == "Exists" or (op in ("", "Equal") and
                              _text(tol.get("value"), f"spec.tolerations[{i}].value", RequestError) == taint.value):
            return True
    return False


def _int(text: str) -> int | None:
    try:
        return int(text, 10)
    except ValueError:
        return None


def _expression(expr: Mapping[str, Any], where: str, values_of: Mapping[str, str]) -> bool:
    key = _text(expr.get("key"), f"{where}.key", RequestError)
    op = _text(expr.get("operator"), f"{where}.operator", RequestError)
    values = [_text(v, f"{where}.values[]", RequestError) for v in _list(expr.get("values"), f"{where}.values",
                                                                           RequestError)]
    has = key in values_of
    value = values_of.get(key, "")
    if op == "In":
        return has and value in values
    if op == "NotIn":
        return not has or value not in values
    if op == "Exists":
        return has
    if op == "DoesNotExist":
        return not has
    if op in ("Gt", "Lt"):
        if len(values) != 1 or _int(values[0]) is None:
            raise RequestError(f"{where}.values: {op} needs exactly one integer value")
        got = _int(value) if has else None
        if got is None:
            return False
        bound = _int(values[0])
        assert bound is not None
        return got > bound if op == "Gt" else got < bound
    raise RequestError(f"{where}.operator: {op!r} is not one of In, NotIn, Exists, DoesNotExist, Gt, Lt")


def _term(term: Mapping[str, Any], where: str, node: NodeRules) -> bool | None:
    """Whether a node selector term matches (None: an empty term, which is skipped)."""
    exprs = _list(term.get("matchExpressions"), f"{where}.matchExpressions", RequestError)
    fields = _list(term.get("matchFields"), f"{where}.matchFields", RequestError)
    if not exprs and not fields:
        return None
    for i, e in enumerate(exprs):
        if not _expression(_obj(e, f"{where}.matchExpressions[{i}]", RequestError),
                           f"{where}.matchExpressions[{i}]", node.labels):
            return False
    for i, f in enumerate(fields):
        f = _obj(f, f"{where}.matchFields[{i}]", RequestError)
        if f.get("key") != "metadata.name" or f.get("operator") not in ("In", "NotIn"):
            raise RequestError(f"{where}.matchFields[{i}]: only metadata.name with In or NotIn is supported")
        if not _expression(f, f"{where}.matchFields[{i}]", {"metadata.name": node.name}):
            return False
    return True


def refusal(pod: Mapping[str, Any], node: NodeRules) -> str:
    """Why ``pod`` may not run on ``node`` ("" when it may), as kube-scheduler's filters would say."""
    try:
        spec = _obj(pod.get("spec"), "spec", RequestError)
        tolerations = [_obj(t, f"spec.tolerations[{i}]", RequestError)
                       for i, t in enumerate(_list(spec.get("tolerations"), "spec.tolerations", RequestError))]
        if node.unschedulable and not _tolerates(tolerations, Taint(UNSCHEDULABLE_TAINT, "", "NoSchedule")):
            return f"node {node.name} is cordoned (spec.unschedulable) and the pod does not tolerate it"
        for taint in node.taints:
            if not _tolerates(tolerations, taint):
                shown = f"{taint.key}={taint.value}" if taint.value else taint.key
                return f"node {node.name} has the taint {shown}:{taint.effect} that the pod does not tolerate"
        selector = _obj(spec.get("nodeSelector"), "spec.nodeSelector", RequestError)
        for key, want in selector.items():
            if node.labels.get(str(key)) != want:
                return f"node {node.name} does not match the pod's nodeSelector {key}={want}"
        affinity = _obj(_obj(spec.get("affinity"), "spec.affinity", RequestError).get("nodeAffinity"),
                        "spec.affinity.nodeAffinity", RequestError)
        required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
        if required is not None:
            where = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"
            terms = _list(_obj(required, where, RequestError).get("nodeSelectorTerms"), where, RequestError)
            # Terms in order, the first match wins (a later term's fault does not matter then).
            if not any(_term(_obj(t, f"{where}[{i}]", RequestError), f"{where}[{i}]", node)
                       for i, t in enumerate(terms)):
                return f"node {node.name} does not match the pod's required node affinity"
    except RequestError as err:
        return f"the pod's scheduling constraints cannot be read: {err}"
    return ""


__all__ = ["UNSCHEDULABLE_TAINT", "NodeRules", "Taint", "node_rules", "refusal"]
