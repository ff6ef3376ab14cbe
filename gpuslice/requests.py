"""Reading a pod's slice request from its plain mapping (the JSON of a ``v1.Pod``).

The rules, each refused with a message that names the container or key at fault:

* only ``spec.containers`` may ask for ``example.com/gpu-slice``, and only one of them (a process
  sees one MIG instance or one MPS pipe, so two containers could not share what they were given);
  init containers and sidecars (init containers with ``restartPolicy: Always``) may not;
* the count follows Kubernetes' rule for extended resources: ``limits`` alone implies equal
  ``requests``; ``requests`` and ``limits`` must agree; the value is a positive integer;
* the effective pod request is Kubernetes' pod-requests rule, max(sum of app containers and
  sidecars, each init container plus the sidecars started before it); with the one-container rule
  it equals that container's count, and the computation stays here so the rule is in one place;
* ``example.com/gpu-memory`` (pod annotation, a quantity) is the GPU memory the pod needs in total;
* ``example.com/gpu-isolation`` (pod annotation) is ``mig``, ``mps`` or ``any`` (default).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal, get_args

from gpuslice.errors import RequestError
from gpuslice.units import parse_quantity, quantity_to_mib

RESOURCE = "example.com/gpu-slice"
MEMORY_KEY = "example.com/gpu-memory"
ISOLATION_KEY = "example.com/gpu-isolation"

#: A GPU memory floor below this is a unit slip (a bare ``20`` is 20 bytes), refused with a hint.
MIN_MEMORY_MIB = 1
_UNIT_SLIP = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KkMmGgTtPpEe])[iI]?[bB]?\s*")
_LEADING_NUMBER = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)")

Isolation = Literal["mig", "mps", "any"]
ISOLATIONS: tuple[str, ...] = get_args(Isolation)


@dataclass(frozen=True, slots=True)
class SliceRequest:
    """What a pod asks of the GPU side: k slices, a memory floor in MiB, an isolation kind."""

    slices: int
    memory_mib: Fraction | None = None
    isolation: Isolation = "any"
    container: str = ""

    def __post_init__(self) -> None:
        if self.slices < 1:
            raise RequestError(f"{RESOURCE} must be at least 1, got {self.slices}")
        if self.isolation not in ISOLATIONS:
            raise RequestError(f"{ISOLATION_KEY} must be one of {', '.join(ISOLATIONS)}, got {self.isolation!r}")


def memory_hint(value: object) -> str:
    """The quantity a memory floor probably meant ("" when there is no guess): ``20GB``, ``20 gb``,
    ``20GiB`` and ``20G B`` -> ``20Gi``; a bare number (bytes) -> that many ``Gi``. The shipped
    admission policy (manifests/admission) words the same hint."""
    if not isinstance(value, str | int) or isinstance(value, bool):
        return ""
    text = str(value)
    slip = _UNIT_SLIP.fullmatch(text)
    if slip is not None:
        return f"{slip.group(1)}{slip.group(2).upper()}i"
    bare = _LEADING_NUMBER.match(text)
    return f"{bare.group(1)}Gi" if bare is not None else ""


def _did_you_mean(value: object) -> str:
    hint = memory_hint(value)
    return f"; did you mean '{hint}'?" if hint and hint != str(value) else ""


def memory_floor(value: object) -> Fraction:
    """The ``example.com/gpu-memory`` annotation in MiB; ``RequestError`` with the unit it probably
    meant when it is not a quantity, not positive, or below 1Mi."""
    what = f"annotation {MEMORY_KEY}"
    try:
        memory = quantity_to_mib(value, what=what)
    except RequestError as err:
        raise RequestError(f"{err}{_did_you_mean(value)}") from None
    if memory <= 0:
        raise RequestError(f"{what} must be positive, got {value!r}")
    if memory < MIN_MEMORY_MIB:
        raise RequestError(f"{what}: {value!r} is less than 1Mi"
                           f"{_did_you_mean(value)}")
    return memory


def _container_count(container: Mapping[str, Any], where: str) -> int:
    """The container's integer slice count (0 when it asks for none)."""
    resources = container.get("resources")
    resources = {} if resources is None else resources
    if not isinstance(resources, Mapping):
        raise RequestError(f"{where}: resources must be an object")
    requests = resources.get("requests")
    limits = resources.get("limits")
    requests = {} if requests is None else requests
    limits = {} if limits is None else limits
    if not isinstance(requests, Mapping) or not isinstance(limits, Mapping):
        raise RequestError(f"{where}: resources.requests and resources.limits must be objects")
    req = requests.get(RESOURCE)
    lim = limits.get(RESOURCE)
    if req is None and lim is None:
        return 0
    values: dict[str, Fraction] = {}
    for label, raw in (("requests", req), ("limits", lim)):
        if raw is None:
            continue
        qty = parse_quantity(raw, what=f"{where}: {label}[{RESOURCE}]")
        if qty.denominator != 1:
            raise RequestError(f"{where}: {label}[{RESOURCE}] must be a whole number of slices, got {raw!r}")
        if qty < 0:
            raise RequestError(f"{where}: {label}[{RESOURCE}] must not be negative, got {raw!r}")
        values[label] = qty
    if "requests" in values and "limits" in values and values["requests"] != values["limits"]:
        raise RequestError(
            f"{where}: requests[{RESOURCE}]={req!r} differs from limits={lim!r}; extended resources need them equal")
    return int(values.get("limits", values.get("requests", Fraction(0))))


def _containers(spec: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    items = spec.get(key) or []
    if not isinstance(items, list) or not all(isinstance(c, Mapping) for c in items):
        raise RequestError(f"spec.{key} must be a list of objects")
    return items


def pod_slice_count(pod: Mapping[str, Any]) -> tuple[int, str]:
    """The pod's effective slice count and the container asking, after the one-container rule."""
    if not isinstance(pod, Mapping):
        raise RequestError(f"a pod must be an object, got {type(pod).__name__}")
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        raise RequestError("pod has no spec object")
    app = [(c, _container_count(c, f"container {c.get('name', '?')!r}")) for c in _containers(spec, "containers")]
    inits = _containers(spec, "initContainers")
    sidecar_total = 0
    init_peak = 0
    for c in inits:
        is_sidecar = c.get("restartPolicy") == "Always"
        kind = "sidecar container" if is_sidecar else "init container"
        count = _container_count(c, f"{kind} {c.get('name', '?')!r}")
        if count:
            raise RequestError(
                f"{kind} {c.get('name', '?')!r} requests {RESOURCE}; only one app container may request slices")
        if is_sidecar:
            sidecar_total += count
        else:
            init_peak = max(init_peak, count + sidecar_total)
    asking = [(c, n) for c, n in app if n]
    if len(asking) > 1:
        names = ", ".join(repr(c.get("name", "?")) for c, _ in asking)
        raise RequestError(f"containers {names} all request {RESOURCE}; only one container per pod may")
    total = max(sum(n for _, n in app) + sidecar_total, init_peak)
    return total, (str(asking[0][0].get("name", "")) if asking else "")


def parse_request(pod: Mapping[str, Any], *, isolation_default: Isolation = "any") -> SliceRequest | None:
    """The pod's ``SliceRequest``, or ``None`` when it asks for no slices; ``RequestError`` if invalid.

    ``isolation_default`` (config ``isolationDefault``) applies when the pod sets no isolation.
    """
    count, container = pod_slice_count(pod)
    metadata = pod.get("metadata")
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, Mapping):
        raise RequestError("metadata must be an object")
    annotations = metadata.get("annotations")
    annotations = {} if annotations is None else annotations
    if not isinstance(annotations, Mapping):
        raise RequestError("metadata.annotations must be an object")
    if count == 0:
        for key in (MEMORY_KEY, ISOLATION_KEY):
            if key in annotations:
                raise RequestError(f"annotation {key} is set but no container requests {RESOURCE}")
        return None
    memory: Fraction | None = None
    if MEMORY_KEY in annotations:
        memory = memory_floor(annotations[MEMORY_KEY])
    isolation = annotations.get(ISOLATION_KEY, isolation_default)
    if isolation not in ISOLATIONS:
        raise RequestError(f"annotation {ISOLATION_KEY} must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
    return SliceRequest(count, memory, isolation, container)
