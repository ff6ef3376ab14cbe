"""PodDisruptionBudgets as preemption counts them (kube-scheduler 1.36's ``filterPodsWithPDBViolation``).

A budget selects pods of its namespace by a label selector (``matchLabels`` and ``matchExpressions``
with ``In``, ``NotIn``, ``Exists``, ``DoesNotExist``; a missing or empty selector selects nothing, as
the scheduler reads it) and allows ``status.disruptionsAllowed`` more disruptions. Going through the
victims most important first, each victim a budget selects uses one of that budget's disruptions,
unless the disruption controller already lists it in ``status.disruptedPods``; a victim that takes a
budget below zero violates it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuslice.errors import RequestError
from gpuslice.pods import PodInfo

_OPERATORS = frozenset({"In", "NotIn", "Exists", "DoesNotExist"})


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: str
    values: frozenset[str]

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "In":
            return labels.get(self.key) in self.values
        if self.operator == "NotIn":
            return self.key not in labels or labels[self.key] not in self.values
        if self.operator == "Exists":
            return self.key in labels
        return self.key not in labels  # DoesNotExist


@dataclass(frozen=True, slots=True)
class Budget:
    """One PodDisruptionBudget: where, whom it selects, how many more disruptions it allows."""

    namespace: str
    name: str
    requirements: tuple[Requirement, ...]
    allowed: int
    disrupted: frozenset[str] = frozenset()

    def selects(self, pod: PodInfo) -> bool:
        if pod.namespace != self.namespace or not self.requirements or not pod.labels:
            return False
        labels = dict(pod.labels)
        return all(r.matches(labels) for r in self.requirements)


def _obj(value: object, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RequestError(f"{where} must be an object, got {type(value).__name__}")
    return value


def project_budget(pdb: Mapping[str, Any]) -> Budget:
    """A ``policy/v1`` PodDisruptionBudget mapping as a :class:`Budget` (``RequestError`` naming the
    field when it cannot be read)."""
    meta = _obj(pdb.get("metadata"), "metadata")
    spec = _obj(pdb.get("spec"), "spec")
    status = _obj(pdb.get("status"), "status")
    ns, name = meta.get("namespace"), meta.get("name")
    if not isinstance(ns, str) or not isinstance(name, str) or not ns or not name:
        raise RequestError("a PodDisruptionBudget needs metadata.namespace and metadata.name")
    selector = _obj(spec.get("selector"), "spec.selector")
    reqs: list[Requirement] = []
    for label, value in _obj(selector.get("matchLabels"), "spec.selector.matchLabels").items():
        if not isinstance(value, str):
            raise RequestError(f"spec.selector.matchLabels[{label}] must be a string")
        reqs.append(Requirement(str(label), "In", frozenset([value])))
    exprs = selector.get("matchExpressions") or []
    if not isinstance(exprs, list):
        raise RequestError("spec.selector.matchExpressions must be a list")
    for i, e in enumerate(exprs):
        e = _obj(e, f"spec.selector.matchExpressions[{i}]")
        op, key, values = e.get("operator"), e.get("key"), e.get("values") or []
        if op not in _OPERATORS or not isinstance(key, str) or not isinstance(values, list):
            raise RequestError(f"spec.selector.matchExpressions[{i}] is not a label selector requirement")
        reqs.append(Requirement(key, str(op), frozenset(str(v) for v in values)))
    allowed = status.get("disruptionsAllowed", 0)
    if isinstance(allowed, bool) or not isinstance(allowed, int):
        raise RequestError("status.disruptionsAllowed must be an integer")
    disrupted = _obj(status.get("disruptedPods"), "status.disruptedPods")
    return Budget(ns, name, tuple(reqs), allowed, frozenset(str(k) for k in disrupted))


def violating(victims: Sequence[PodInfo], budgets: Iterable[Budget]) -> frozenset[str]:
    """UIDs of the ``victims`` (most important first) whose eviction would take a budget below zero."""
    left: dict[tuple[str, str], int] = {}
    out: set[str] = set()
    chosen = list(budgets)
    for pod in victims:
        for b in chosen:
            if not b.selects(pod) or pod.name in b.disrupted:
                continue
            key = (b.namespace, b.name)
            left[key] = left.get(key, b.allowed) - 1
            if left[key] < 0:
                out.add(pod.uid)
    return frozenset(out)


__all__ = ["Budget", "Requirement", "project_budget", "violating"]
