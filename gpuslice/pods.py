"""A pod (the plain mapping of a ``v1.Pod``) as the scheduler sees it: one compact projection.

The extender keeps tens of thousands of pods; it keeps this projection, not the API objects, and
the simulator reads pods from v1 Lists through the same code, so both ask the same things of a pod:

* CPU and memory by Kubernetes' pod-requests rule (max of the app containers' sum and each init
  container), plus ``spec.overhead``;
* the slice request (:func:`gpuslice.requests.parse_request`, with the config's isolation default);
* the GPU products it allows (``nodeSelector`` or required node affinity on the product label);
* its owner (the first ``ownerReferences`` entry: the owner-spread rule) and its priority;
* a minimal copy of what the counting rule reads (UID, node, phase, the two contract annotations).

Hostile input (a string where an object belongs, a list of labels) raises ``RequestError`` naming
the field; it never raises anything else.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from gpuslice import annotations as ann
from gpuslice.counting import Claim, PodProblem, claim_from
from gpuslice.errors import GpuSliceError, RequestError
from gpuslice.packing.build import pack_request
from gpuslice.packing.state import PackRequest
from gpuslice.requests import ISOLATION_KEY, MEMORY_KEY, Isolation, SliceRequest, parse_request
from gpuslice.units import MIB, parse_quantity

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


def expect_object(value: object, where: str, error: type[GpuSliceError] = RequestError) -> Mapping[str, Any]:
    """``value`` as an object (absent = empty), else ``error`` naming ``where``: one check for pods and nodes."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise error(f"{where} must be an object, got {type(value).__name__}")
    return value


def _obj(value: object, where: str) -> Mapping[str, Any]:
    return expect_object(value, where)


def _list(value: object, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError(f"{where} must be a list, got {type(value).__name__}")
    return value


def _text(value: object, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RequestError(f"{where} must be a string, got {type(value).__name__}")
    return value


#: The largest CPU (millicores) or memory (MiB) one pod or node may state (about a billion cores, an
#: exbibyte): far above any real machine, and low enough that sums over a cluster fit the state's int64.
MAX_AMOUNT = 2**40


def in_range(amount: int, value: object, what: str) -> int:
    """``amount`` when it is in 0..MAX_AMOUNT, else ``RequestError`` naming ``what``."""
    if not 0 <= amount <= MAX_AMOUNT:
        raise RequestError(f"{what}: {str(value)[:40]!r} is out of range (0 to {MAX_AMOUNT})")
    return amount


def _milli(value: object, what: str) -> int:
    return in_range(int(parse_quantity(value, what=what) * 1000), value, what)


def _mib(value: object, what: str) -> int:
    return in_range(int(parse_quantity(value, what=what) / MIB), value, what)


def pod_label(pod: Mapping[str, Any]) -> str:
    """``namespace/name`` for messages (never raises)."""
    meta = pod.get("metadata") if isinstance(pod, Mapping) else None
    meta = meta if isinstance(meta, Mapping) else {}
    ns, name = meta.get("namespace"), meta.get("name")
    return f"{ns if isinstance(ns, str) and ns else 'default'}/{name if isinstance(name, str) and name else '?'}"


def nominated_node(pod: Mapping[str, Any]) -> str:
    """``status.nominatedNodeName`` (set by kube-scheduler after the pod preempted there), or ``""``
    (never raises)."""
    status = pod.get("status") if isinstance(pod, Mapping) else None
    name = status.get("nominatedNodeName") if isinstance(status, Mapping) else None
    return name if isinstance(name, str) else ""


def pod_cpu_memory(pod: Mapping[str, Any]) -> tuple[int, int]:
    """Kubernetes' pod-requests rule for CPU (millicores) and memory (MiB)."""
    spec = _obj(pod.get("spec"), "spec")

    def requests(c: object, where: str) -> tuple[int, int]:
        c = _obj(c, where)
        req = _obj(_obj(c.get("resources"), f"{where}.resources").get("requests"), f"{where}.resources.requests")
        name = c.get("name")
        label = f"container {name!r}"
        return (_milli(req.get("cpu", 0), f"{label} cpu"), _mib(req.get("memory", 0), f"{label} memory"))

    apps = [requests(c, f"spec.containers[{i}]") for i, c in enumerate(_list(spec.get("containers"),
                                                                               "spec.containers"))]
    # max(apps + every sidecar, each init container + the sidecars started before it)
    sidecar_cpu = sidecar_mem = init_cpu = init_mem = 0
    for i, c in enumerate(_list(spec.get("initContainers"), "spec.initContainers")):
        ic, im = requests(c, f"spec.initContainers[{i}]")
        if _obj(c, "init container").get("restartPolicy") == "Always":  # a sidecar runs beside the app
            sidecar_cpu, sidecar_mem = sidecar_cpu + ic, sidecar_mem + im
        else:
            init_cpu, init_mem = max(init_cpu, ic + sidecar_cpu), max(init_mem, im + sidecar_mem)
    cpu = max(sum(a[0] for a in apps) + sidecar_cpu, init_cpu)
    mem = max(sum(a[1] for a in apps) + sidecar_mem, init_mem)
    overhead = _obj(spec.get("overhead"), "spec.overhead")
    cpu += _milli(overhead.get("cpu", 0), "spec.overhead.cpu")
    mem += _mib(overhead.get("memory", 0), "spec.overhead.memory")
    return cpu, mem


def pod_products(pod: Mapping[str, Any]) -> frozenset[str] | None:
    """GPU products the pod allows, from ``nodeSelector`` or required node affinity (None = any)."""
    spec = _obj(pod.get("spec"), "spec")
    selector = _obj(spec.get("nodeSelector"), "spec.nodeSelector")
    wanted = selector.get(ann.PRODUCT_LABEL)
    if wanted is not None:
        return frozenset([_text(wanted, f"spec.nodeSelector[{ann.PRODUCT_LABEL}]")])
    affinity = _obj(_obj(spec.get("affinity"), "spec.affinity").get("nodeAffinity"), "spec.affinity.nodeAffinity")
    required = _obj(affinity.get("requiredDuringSchedulingIgnoredDuringExecution"),
                    "nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution")
    allowed: set[str] = set()
    found = False
    for term in _list(required.get("nodeSelectorTerms"), "nodeSelectorTerms"):
        for expr in _list(_obj(term, "nodeSelectorTerm").get("matchExpressions"), "matchExpressions"):
            expr = _obj(expr, "matchExpression")
            if expr.get("key") == ann.PRODUCT_LABEL and expr.get("operator") == "In":
                found = True
                allowed |= {_text(v, "matchExpression value") for v in _list(expr.get("values"), "values")}
    # Terms are ORed: any term that names products widens the set.
    return frozenset(allowed) if found else None


def pod_owner(pod: Mapping[str, Any]) -> str:
    """``namespace/Kind/name`` of the controller (or first) owner reference, ``""`` when none."""
    meta = _obj(pod.get("metadata"), "metadata")
    refs = [_obj(r, "metadata.ownerReferences[]") for r in _list(meta.get("ownerReferences"),
                                                                   "metadata.ownerReferences")]
    if not refs:
        return ""
    ref = next((r for r in refs if r.get("controller") is True), refs[0])
    ns = _text(meta.get("namespace"), "metadata.namespace") or "default"
    return f"{ns}/{_text(ref.get('kind'), 'ownerReferences.kind')}/{_text(ref.get('name'), 'ownerReferences.name')}"


def pod_priority(pod: Mapping[str, Any]) -> int:
    """``spec.priority`` (set by admission from the PriorityClass), 0 when absent."""
    value = _obj(pod.get("spec"), "spec").get("priority")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"spec.priority must be an integer, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class PodInfo:
    """The projection of one pod: what scheduling, preemption and the counting rule read."""

    uid: str
    label: str
    node: str  # spec.nodeName, "" while unbound
    phase: str
    priority: int
    owner: str
    cpu_milli: int
    memory_mib: int
    products: frozenset[str] | None
    request: SliceRequest | None
    created: str
    # The assignment and allocated annotations: decoded (an Assignment, an Allocated) when they
    # decode, as written when not (the counting rule then says why), None when absent.
    contract: tuple[object, object]
    error: str = ""  # why the slice request could not be read ("" when fine)
    resource_version: str = ""  # the API server's version of the object: an unchanged pod is not read again
    # Its labels as sorted (key, value) pairs, one shared tuple per distinct set (PodDisruptionBudgets
    # select victims by them), and whether it is being deleted (``metadata.deletionTimestamp``).
    labels: tuple[tuple[str, str], ...] = ()
    terminating: bool = False
    # Where it may run: its tolerations, nodeSelector and required node affinity as canonical JSON
    # (one shared string per distinct set; "" for none), which ``/bind`` checks against the node.
    constraints: str = ""

    def scheduling_spec(self) -> Mapping[str, Any]:
        """The pod's scheduling constraints as a pod mapping (``{"spec": {...}}``) for
        :func:`gpuslice.noderules.refusal`."""
        return {"spec": json.loads(self.constraints) if self.constraints else {}}

    @property
    def namespace(self) -> str:
        return self.label.split("/", 1)[0]

    @property
    def name(self) -> str:
        return self.label.split("/", 1)[1]

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES

    def claim(self, *, now: datetime, reservation_ttl: timedelta) -> tuple[Claim | None, PodProblem | None, str]:
        """The counting rule's claim for this pod (:func:`gpuslice.counting.claim_of` of the pod)."""
        if self.terminal:
            return None, None, self.node
        return claim_from(self.uid, self.label, self.node, *self.contract, now=now,
                          reservation_ttl=reservation_ttl)

    def pack(self, slices_per_gpu: int, *, owner_spread: bool = True) -> PackRequest:
        """This pod as a packing request (raises ``RequestError`` when the request cannot be met as written)."""
        if self.error:
            raise RequestError(self.error)
        return pack_request(self.request, slices_per_gpu=slices_per_gpu, cpu_milli=self.cpu_milli,
                            memory_mib=self.memory_mib, products=self.products,
                            owner=self.owner if owner_spread else "", uid=self.uid)


_KEPT_ANNOTATIONS = frozenset({ann.ASSIGNMENT_KEY, ann.ALLOCATED_KEY, MEMORY_KEY, ISOLATION_KEY})
_KEPT_META = ("name", "namespace", "uid", "resourceVersion", "creationTimestamp", "ownerReferences", "labels",
              "deletionTimestamp")
#: One tuple per distinct label set (the pods of one ReplicaSet share theirs); bounded, beyond which a
#: new set is kept per pod.
_LABEL_SETS: dict[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]] = {}
_MAX_LABEL_SETS = 1 << 16


def _labels(meta: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    raw = meta.get("labels")
    if not isinstance(raw, Mapping) or not raw:
        return ()
    items = tuple(sorted((str(k), v) for k, v in raw.items() if isinstance(v, str)))
    shared = _LABEL_SETS.get(items)
    if shared is not None:
        return shared
    if len(_LABEL_SETS) < _MAX_LABEL_SETS:
        _LABEL_SETS[items] = items
    return items
_KEPT_SPEC = ("nodeName", "nodeSelector", "priority", "overhead", "schedulerName", "tolerations")


def _slim_containers(value: object) -> object:
    if not isinstance(value, list):
        return value
    return [{k: c[k] for k in ("name", "resources", "restartPolicy") if k in c} if isinstance(c, Mapping) else c
            for c in value]


def slim(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """The parts of a pod that :func:`project` reads, so a watch cache of tens of thousands of pods
    does not hold their env, volumes and status. Anything of an unexpected shape is kept as it is, so
    :func:`project` still names the fault."""
    meta, spec, status = pod.get("metadata"), pod.get("spec"), pod.get("status")
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        return pod
    out_meta: dict[str, Any] = {k: meta[k] for k in _KEPT_META if k in meta}
    annotations = meta.get("annotations")
    if isinstance(annotations, Mapping):
        out_meta["annotations"] = {k: v for k, v in annotations.items() if k in _KEPT_ANNOTATIONS}
    elif annotations is not None:
        out_meta["annotations"] = annotations
    out_spec: dict[str, Any] = {k: spec[k] for k in _KEPT_SPEC if k in spec}
    for key in ("containers", "initContainers"):
        if key in spec:
            out_spec[key] = _slim_containers(spec[key])
    affinity = spec.get("affinity")
    if isinstance(affinity, Mapping):
        if "nodeAffinity" in affinity:
            out_spec["affinity"] = {"nodeAffinity": affinity["nodeAffinity"]}
    elif affinity is not None:
        out_spec["affinity"] = affinity
    out: dict[str, Any] = {"kind": "Pod", "metadata": out_meta, "spec": out_spec}
    if isinstance(status, Mapping):
        out["status"] = {"phase": status["phase"]} if "phase" in status else {}
    elif status is not None:
        out["status"] = status
    return out


def project(pod: Mapping[str, Any], *, isolation_default: Isolation = "any") -> PodInfo:
    """The projection of a pod mapping. A pod whose slice request is invalid is still projected (its
    CPU and memory count on its node) with ``error`` set; a pod that is not an object, or has no
    UID, raises ``RequestError``."""
    if not isinstance(pod, Mapping):
        raise RequestError(f"a pod must be an object, got {type(pod).__name__}")
    label = pod_label(pod)
    meta = _obj(pod.get("metadata"), "metadata")
    uid = _text(meta.get("uid"), "metadata.uid")
    if not uid:
        raise RequestError(f"pod {label} has no metadata.uid")
    spec = _obj(pod.get("spec"), "spec")
    status = _obj(pod.get("status"), "status")
    node = _text(spec.get("nodeName"), "spec.nodeName")
    phase = _text(status.get("phase"), "status.phase")
    created = meta.get("creationTimestamp")
    error = ""
    request: SliceRequest | None = None
    owner = ""
    products: frozenset[str] | None = None
    priority = 0
    try:
        request = parse_request(pod, isolation_default=isolation_default)
        owner = pod_owner(pod)
        products = pod_products(pod)
        priority = pod_priority(pod)
    except GpuSliceError as err:
        error = f"pod {label}: {err}"
    try:
        cpu, mem = pod_cpu_memory(pod)
    except GpuSliceError as err:
        cpu, mem = 0, 0
        error = error or f"pod {label}: {err}"
    annotations = _obj(meta.get("annotations"), "metadata.annotations")
    assignment = _decoded(annotations.get(ann.ASSIGNMENT_KEY), ann.decode_assignment)
    contract = (assignment, _decoded(annotations.get(ann.ALLOCATED_KEY), ann.decode_allocated))
    # One copy of strings that tens of thousands of pods repeat: node names, phases, owners, and the
    # UID the pod's own assignment also holds.
    node, phase, owner = sys.intern(node), sys.intern(phase), sys.intern(owner)
    if isinstance(assignment, ann.Assignment) and assignment.pod_uid == uid:
        uid = assignment.pod_uid
    return PodInfo(uid, label, node, phase, priority, owner, cpu, mem, products, request,
                   created if isinstance(created, str) else "", contract, error,
                   rv if isinstance(rv := meta.get("resourceVersion"), str) else "", _labels(meta),
                   meta.get("deletionTimestamp") is not None, _constraints(spec))


def _constraints(spec: Mapping[str, Any]) -> str:
    """The spec's tolerations, nodeSelector and required node affinity as canonical JSON, interned
    (pods of one owner share one string); "" when it has none. Values of the wrong shape are kept as
    they are, for :func:`gpuslice.noderules.refusal` to name."""
    out: dict[str, Any] = {}
    for key in ("tolerations", "nodeSelector"):
        if spec.get(key):
            out[key] = spec[key]
    affinity = spec.get("affinity")
    node_affinity = affinity.get("nodeAffinity") if isinstance(affinity, Mapping) else None
    required = (node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
                if isinstance(node_affinity, Mapping) else None)
    if required is not None:
        out["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
    elif affinity is not None and not isinstance(affinity, Mapping):
        out["affinity"] = affinity
    if not out:
        return ""
    try:
        return sys.intern(json.dumps(out, sort_keys=True, separators=(",", ":")))
    except (TypeError, ValueError):
        return sys.intern(json.dumps({"tolerations": "unreadable"}))


def _decoded(raw: object, decode: Callable[[object], object]) -> object:
    """A contract annotation decoded (the pod's claim holds the same value, so the projection keeps no
    text beside it); as written when it does not decode, for the counting rule to report."""
    if raw is None:
        return None
    try:
        return decode(raw)
    except GpuSliceError:
        return raw
