"""The calls ``/bind`` makes: read the pod, patch the assignment, create the Binding; read the node's pods
only to check a refusal again (the decision itself uses the watched view); evict a pod (the extender's
own preemption).

Two implementations: :class:`ApiBinder` over the Kubernetes API (the ``kubernetes`` client, raw JSON
so no model objects are built), and :class:`MemoryBinder` for ``--cluster FILE`` dry runs, which
records binds in memory. Failures raise :class:`KubeApiError` with the HTTP status, None when the
outcome is unclear (a timeout or a dropped connection): the caller then reads the pod before undoing.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from extender.errors import KubeApiError
from gpuslice.annotations import ASSIGNMENT_KEY

Obj = dict[str, Any]


class Binder(Protocol):
    #: Whether calls go over the network (then the HTTP layer makes them off the event loop).
    remote: bool

    def read_pod(self, namespace: str, name: str) -> Obj | None: ...

    def node_pods(self, node: str) -> list[Obj]: ...

    def write_assignment(self, namespace: str, name: str, uid: str, value: str | None) -> Obj: ...

    def bind(self, namespace: str, name: str, uid: str, node: str) -> None: ...


def _unclear(status: int | None) -> bool:
    return status is None or status >= 500 or status == 429


class ApiBinder:
    """Binder over the API server; every call has a timeout, so ``/bind`` never hangs."""

    remote = True

    def __init__(self, api_client: Any, *, timeout_s: float = 10.0) -> None:
        from kubernetes import client

        self.api = client.CoreV1Api(api_client)
        self.timeout_s = timeout_s

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            resp = fn(*args, _preload_content=False, _request_timeout=self.timeout_s, **kwargs)
            data = resp.data
            return json.loads(data) if data else {}
        except ApiException as err:
            raise KubeApiError(f"{what}: {err.status} {err.reason}", err.status) from None
        except (OSError, ValueError) as err:  # urllib3 errors are OSErrors; a broken body is a ValueError
            raise KubeApiError(f"{what}: {type(err).__name__}: {err}", None) from None
        except Exception as err:
            raise KubeApiError(f"{what}: {type(err).__name__}: {err}", None) from None

    def read_pod(self, namespace: str, name: str) -> Obj | None:
        try:
            pod: Obj = self._call(f"read pod {namespace}/{name}", self.api.read_namespaced_pod, name, namespace)
            return pod
        except KubeApiError as err:
            if err.status == 404:
                return None
            raise

    def node_pods(self, node: str) -> list[Obj]:
        body = self._call(f"list pods of node {node}", self.api.list_pod_for_all_namespaces,
                          field_selector=f"spec.nodeName={node}")
        items = body.get("items") or []
        return [i for i in items if isinstance(i, dict)]

    def write_assignment(self, namespace: str, name: str, uid: str, value: str | None) -> Obj:
        # The UID in the patch is a precondition: a pod replaced under the same name gets a 409.
        patch = {"metadata": {"uid": uid, "annotations": {ASSIGNMENT_KEY: value}}}
        pod: Obj = self._call(f"patch pod {namespace}/{name}", self.api.patch_namespaced_pod, name, namespace, patch)
        return pod

    def evict(self, namespace: str, name: str, uid: str) -> None:
        """Evict a pod through the Eviction API (``policy/v1``; the API server checks its
        PodDisruptionBudgets: 429 when one allows no more disruptions), the pod UID a precondition."""
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace},
                "deleteOptions": {"preconditions": {"uid": uid}}}
        self._call(f"evict pod {namespace}/{name}", self.api.create_namespaced_pod_eviction, name, namespace, body)

    def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "namespace": namespace, "uid": uid},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
        self._call(f"bind pod {namespace}/{name} to {node}", self.api.create_namespaced_pod_binding, name, namespace,
                   body)


class MemoryBinder:
    """Binds recorded in memory (``--cluster FILE``): the listed pods are the API server.

    Only pods that may still be bound are kept as objects: the listed pending pods and any pod
    kube-scheduler asks about. A pod the file already shows bound lives on in the view's projection
    alone (kube-scheduler never binds it again), so a file of 50,000 running pods is not held twice.
    """

    remote = False

    def __init__(self, pods: Iterable[Mapping[str, Any]] = ()) -> None:
        self._lock = threading.Lock()
        self.pods: dict[tuple[str, str], Obj] = {}
        for pod in pods:
            self.add(pod)
        self.binds: list[tuple[str, str, str]] = []

    def add(self, pod: Mapping[str, Any]) -> None:
        """A listed pod: kept (a copy) when it is not bound yet."""
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        if isinstance(meta, Mapping) and not (isinstance(spec, Mapping) and spec.get("nodeName")):
            self.pods[(str(meta.get("namespace") or "default"), str(meta.get("name") or ""))] = copy.deepcopy(
                dict(pod))

    def learn(self, pod: Mapping[str, Any]) -> None:
        """A pod kube-scheduler asked about: in a dry run it exists from then on (first sighting wins)."""
        meta = pod.get("metadata") or {}
        if not isinstance(meta, Mapping):
            return
        key = (str(meta.get("namespace") or "default"), str(meta.get("name") or ""))
        with self._lock:
            self.pods.setdefault(key, copy.deepcopy(dict(pod)))

    def read_pod(self, namespace: str, name: str) -> Obj | None:
        with self._lock:
            pod = self.pods.get((namespace, name))
            return copy.deepcopy(pod) if pod is not None else None

    def node_pods(self, node: str) -> list[Obj]:
        with self._lock:
            return [copy.deepcopy(p) for p in self.pods.values() if (p.get("spec") or {}).get("nodeName") == node]

    def _get(self, namespace: str, name: str, uid: str) -> Obj:
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise KubeApiError(f"pod {namespace}/{name} not found", 404)
        if (pod.get("metadata") or {}).get("uid") != uid:
            raise KubeApiError(f"pod {namespace}/{name}: UID precondition failed", 409)
        return pod

    def write_assignment(self, namespace: str, name: str, uid: str, value: str | None) -> Obj:
        with self._lock:
            pod = self._get(namespace, name, uid)
            annotations = pod.setdefault("metadata", {}).setdefault("annotations", {}) or {}
            pod["metadata"]["annotations"] = annotations
            if value is None:
                annotations.pop(ASSIGNMENT_KEY, None)
            else:
                annotations[ASSIGNMENT_KEY] = value
            return copy.deepcopy(pod)

    def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        with self._lock:
            pod = self._get(namespace, name, uid)
            spec = pod.setdefault("spec", {})
            if spec.get("nodeName"):
                raise KubeApiError(f"pod {namespace}/{name} is already assigned to node {spec['nodeName']}", 409)
            spec["nodeName"] = node
            self.binds.append((namespace, name, node))


def unclear(err: KubeApiError) -> bool:
    """Whether a failed write may have taken effect (read the pod before undoing)."""
    return _unclear(err.status)
