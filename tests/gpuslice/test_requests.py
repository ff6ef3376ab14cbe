"""Reading a pod's slice request: every refusal, and Kubernetes' pod-requests rule."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from gpuslice.errors import RequestError
from gpuslice.requests import ISOLATION_KEY, MEMORY_KEY, RESOURCE, SliceRequest, parse_request, pod_slice_count


def container(name: str, requests: object = None, limits: object = None, **extra: Any) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if requests is not None:
        resources["requests"] = {RESOURCE: requests}
    if limits is not None:
        resources["limits"] = {RESOURCE: limits}
    return {"name": name, "resources": resources, **extra}


def pod(*containers: dict[str, Any], init: list[dict[str, Any]] | None = None,
        annotations: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers)}
    if init is not None:
        spec["initContainers"] = init
    return {"metadata": {"name": "p", "annotations": annotations or {}}, "spec": spec}


def refusal(p: dict[str, Any]) -> str:
    with pytest.raises(RequestError) as err:
        parse_request(p)
    return str(err.value)


def test_plain_request() -> None:
    assert parse_request(pod(container("llm", "3", "3"))) == SliceRequest(3, None, "any", "llm")


def test_limits_alone_imply_requests() -> None:
    assert parse_request(pod(container("llm", limits=2))) == SliceRequest(2, None, "any", "llm")
    assert parse_request(pod(container("llm", requests="2"))) == SliceRequest(2, None, "any", "llm")


def test_no_request_is_none() -> None:
    assert parse_request(pod(container("web"))) is None
    assert parse_request(pod(container("web", "0", "0"))) is None


def test_memory_and_isolation() -> None:
    req = parse_request(pod(container("llm", 1), annotations={MEMORY_KEY: "20Gi", ISOLATION_KEY: "mig"}))
    assert req == SliceRequest(1, Fraction(20480), "mig", "llm")
    assert parse_request(pod(container("llm", 1), annotations={MEMORY_KEY: "0.5Gi"})).memory_mib == 512  # type: ignore[union-attr]
    assert parse_request(pod(container("llm", 1), annotations={MEMORY_KEY: "40G"})).memory_mib == Fraction(  # type: ignore[union-attr]
        40 * 10**9, 2**20)


def test_other_app_containers_without_slices_are_fine() -> None:
    assert parse_request(pod(container("proxy"), container("llm", 2), container("log"))) == SliceRequest(
        2, None, "any", "llm")
    count, name = pod_slice_count(pod(container("proxy"), container("llm", 2),
                                      init=[container("setup"), container("agent", restartPolicy="Always")]))
    assert (count, name) == (2, "llm")


@pytest.mark.parametrize(("p", "message"), [
    (pod(container("llm", 1), init=[container("warm", 1)]),
     "init container 'warm' requests example.com/gpu-slice; only one app container may request slices"),
    (pod(container("llm", 1), init=[container("mesh", 1, restartPolicy="Always")]),
     "sidecar container 'mesh' requests example.com/gpu-slice; only one app container may request slices"),
    (pod(container("a", 1), container("b", 2)),
     "containers 'a', 'b' all request example.com/gpu-slice; only one container per pod may"),
    (pod(container("llm", "-1")),
     "container 'llm': requests[example.com/gpu-slice] must not be negative, got '-1'"),
    (pod(container("llm", limits=-2)),
     "container 'llm': limits[example.com/gpu-slice] must not be negative, got -2"),
    (pod(container("llm", "500m")),
     "container 'llm': requests[example.com/gpu-slice] must be a whole number of slices, got '500m'"),
    (pod(container("llm", "1.5")),
     "container 'llm': requests[example.com/gpu-slice] must be a whole number of slices, got '1.5'"),
    (pod(container("llm", 1.5)),
     "container 'llm': requests[example.com/gpu-slice] must be a whole number of slices, got 1.5"),
    (pod(container("llm", "2", "3")),
     "container 'llm': requests[example.com/gpu-slice]='2' differs from limits='3'; extended resources need "
     "them equal"),
    (pod(container("llm", "two")),
     "container 'llm': requests[example.com/gpu-slice]: 'two' is not a Kubernetes quantity"),
    (pod(container("llm", True)),
     "container 'llm': requests[example.com/gpu-slice]: expected a quantity, got a boolean"),
    (pod(container("llm", 1), annotations={ISOLATION_KEY: "strong"}),
     "annotation example.com/gpu-isolation must be one of mig, mps, any, got 'strong'"),
    (pod(container("llm", 1), annotations={MEMORY_KEY: "20GB"}),
     "annotation example.com/gpu-memory: '20GB' is not a Kubernetes quantity; did you mean '20Gi'?"),
    (pod(container("llm", 1), annotations={MEMORY_KEY: "20 gib"}),
     "annotation example.com/gpu-memory: '20 gib' is not a Kubernetes quantity; did you mean '20Gi'?"),
    (pod(container("llm", 1), annotations={MEMORY_KEY: "20"}),
     "annotation example.com/gpu-memory: '20' is less than 1Mi; did you mean '20Gi'?"),
    (pod(container("llm", 1), annotations={MEMORY_KEY: "40m"}),
     "annotation example.com/gpu-memory: '40m' is less than 1Mi; did you mean '40Mi'?"),
    (pod(container("llm", 1), annotations={MEMORY_KEY: "lots"}),
     "annotation example.com/gpu-memory: 'lots' is not a Kubernetes quantity"),
    (pod(container("llm", 1), annotations={MEMORY_KEY: "0"}),
     "annotation example.com/gpu-memory must be positive, got '0'"),
    (pod(container("llm", 1), annotations={MEMORY_KEY: "-1Gi"}),
     "annotation example.com/gpu-memory must be positive, got '-1Gi'"),
    (pod(container("web"), annotations={MEMORY_KEY: "20Gi"}),
     "annotation example.com/gpu-memory is set but no container requests example.com/gpu-slice"),
    ({"metadata": {}}, "pod has no spec object"),
    ({"spec": {"containers": {"name": "x"}}}, "spec.containers must be a list of objects"),
    (pod({"name": "llm", "resources": ["cpu"]}), "container 'llm': resources must be an object"),
])
def test_refusals(p: dict[str, Any], message: str) -> None:
    assert refusal(p) == message


def test_slice_request_constructor_refusals() -> None:
    with pytest.raises(RequestError, match=r"example.com/gpu-slice must be at least 1, got 0"):
        SliceRequest(0)
    with pytest.raises(RequestError, match=r"example.com/gpu-isolation must be one of mig, mps, any, got 'x'"):
        SliceRequest(1, isolation="x")  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "message"), [
    ("1e99999999", "is out of range for a Kubernetes quantity"),
    ("9" * 5001, "is out of range for a Kubernetes quantity"),
    (10**50, "is out of range for a Kubernetes quantity"),
    ("\u0663Gi", "is not a Kubernetes quantity"),
    ("\uff11", "is not a Kubernetes quantity"),
])
def test_absurd_quantities_are_refused_quickly(value: object, message: str) -> None:
    from gpuslice.units import parse_quantity

    with pytest.raises(RequestError, match=message) as err:
        parse_quantity(value, what="annotation example.com/gpu-memory")
    assert len(str(err.value)) < 200


@pytest.mark.parametrize(("pod", "message"), [
    (None, "a pod must be an object, got NoneType"),
    ([], "a pod must be an object, got list"),
    ({"spec": {"containers": []}, "metadata": "x"}, "metadata must be an object"),
])
def test_malformed_pods_are_refused(pod: object, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        parse_request(pod)  # type: ignore[arg-type]
