"""The API calls ``/bind`` makes: one Binding that carries the assignment; a pod or node read only to
clear up an unclear outcome or to check a refusal again (the decision itself uses the watched view);
and the Eviction the extender's own preemption makes.

The binding subresource merges the Binding's own ``metadata.annotations`` into the pod together with
``spec.nodeName``, in one update guarded by the Binding's UID precondition (kube-apiserver's
``BindingREST.setPodNodeAndMetadata``), so the assignment and the bind are one atomic write: a pod is
never seen with the assignment and no node, nor bound without it, and a failed Binding leaves
nothing to take back.

Two implementations: :class:`ApiBinder` over the Kubernetes API, and :class:`MemoryBinder` for
``--cluster FILE`` dry runs, which records binds in memory. ``ApiBinder`` sends raw JSON over the
kubernetes client's own connection pool and credentials: no model objects, no parameter
sanitising, one request per call. Failures raise :class:`KubeApiError` with the HTTP status, None
when the outcome is unclear (a timeout or a dropped connection): the caller then reads the pod.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Protocol
from urllib.parse import quote, urlencode

from extender.errors import KubeApiError

Obj = dict[str, Any]


class Binder(Protocol):
    #: Whether calls go over the network (then the HTTP layer makes them off the event loop).
    remote: bool

    def read_pod(self, namespace: str, name: str) -> Obj | None: ...

    def node_pods(self, node: str) -> list[Obj]: ...

    def bind(self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str]) -> None: ...


def _unclear(status: int | None) -> bool:
    return status is None or status >= 500 or status == 429


def binding_body(namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str]) -> Obj:
    """A v1 Binding: the UID is the API server's precondition (a pod replaced under the same name gets
    a 409), the annotations are merged into the pod with ``spec.nodeName``."""
    meta: Obj = {"name": name, "namespace": namespace, "uid": uid}
    if annotations:
        meta["annotations"] = dict(annotations)
    return {"apiVersion": "v1", "kind": "Binding", "metadata": meta,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}


def _status_text(data: bytes) -> str:
    """The ``message`` of a metav1.Status answer (short), else nothing."""
    try:
        body = json.loads(data)
    except ValueError:
        return ""
    message = body.get("message") if isinstance(body, dict) else None
    return str(message)[:300] if message else ""


class ApiBinder:
    """Binder over the API server; every call has a timeout, so ``/bind`` never hangs.

    ``api_client`` is a ``kubernetes.client.ApiClient``: its configuration gives the server, the
    credentials (a bearer token is read per call, so a rotated service-account token is used) and
    its pool of open connections, shared with the informer and the fence."""

    remote = True

    def __init__(self, api_client: Any, *, timeout_s: float = 10.0) -> None:
        import urllib3

        self._conf = api_client.configuration
        self._pool = api_client.rest_client.pool_manager
        self._base = str(self._conf.host).rstrip("/")
        self._agent = str(getattr(api_client, "user_agent", "") or "gpu-slice-extender")
        self._timeout = urllib3.Timeout(connect=timeout_s, read=timeout_s)
        self.timeout_s = timeout_s

    def _headers(self, body: bool) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": self._agent}
        if body:
            headers["Content-Type"] = "application/json"
        for auth in self._conf.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                headers[str(auth["key"])] = str(auth["value"])
        return headers

    def _request(self, what: str, method: str, path: str, body: Obj | None = None) -> Obj:
        import urllib3

        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        try:
            resp = self._pool.request(method, self._base + path, body=data, headers=self._headers(data is not None),
                                      timeout=self._timeout, retries=False, redirect=False, preload_content=True)
        except (urllib3.exceptions.HTTPError, OSError) as err:  # refused, reset, timed out: the outcome is unclear
            raise KubeApiError(f"{what}: {type(err).__name__}: {err}", None) from None
        status, raw = int(resp.status), resp.data or b""
        if not 200 <= status < 300:
            detail = _status_text(raw) or str(resp.reason or "")
            raise KubeApiError(f"{what}: {status} {detail}".rstrip(), status)
        try:
            out = json.loads(raw) if raw else {}
        except ValueError as err:
            raise KubeApiError(f"{what}: the API server answered something other than JSON ({err})", None) from None
        if not isinstance(out, dict):
            raise KubeApiError(f"{what}: expected a JSON object, got {type(out).__name__}", None)
        return out

    def read_pod(self, namespace: str, name: str) -> Obj | None:
        try:
            return self._request(f"read pod {namespace}/{name}", "GET",
                                 f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}")
        except KubeApiError as err:
            if err.status == 404:
                return None
            raise

    def node_pods(self, node: str) -> list[Obj]:
        query = urlencode({"fieldSelector": f"spec.nodeName={node}"})
        body = self._request(f"list pods of node {node}", "GET", f"/api/v1/pods?{query}")
        items = body.get("items") or []
        return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []

    def evict(self, namespace: str, name: str, uid: str) -> None:
        """Evict a pod through the Eviction API (``policy/v1``; the API server checks its
        PodDisruptionBudgets: 429 when one allows no more disruptions), the pod UID a precondition."""
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace},
                "deleteOptions": {"preconditions": {"uid": uid}}}
        self._request(f"evict pod {namespace}/{name}", "POST",
                      f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}/eviction", body)

    def create_event(self, namespace: str, body: Obj) -> None:
        """Create one core/v1 Event (the extender's ``SliceAssigned``); raw JSON through the same pool,
        because the generated client's per-call validation cost more CPU than the bind itself."""
        self._request(f"create event in {namespace}", "POST",
                      f"/api/v1/namespaces/{quote(namespace, safe='')}/events", body)

    def bind(self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str]) -> None:
        self._request(f"bind pod {namespace}/{name} to {node}", "POST",
                      f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}/binding",
                      binding_body(namespace, name, uid, node, annotations))


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

    def bind(self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str]) -> None:
        """As the binding subresource does it: UID precondition, once only, annotations merged."""
        with self._lock:
            pod = self.pods.get((namespace, name))
            if pod is None:
                raise KubeApiError(f"pod {namespace}/{name} not found", 404)
            if (pod.get("metadata") or {}).get("uid") != uid:
                raise KubeApiError(f"pod {namespace}/{name}: UID precondition failed", 409)
            spec = pod.setdefault("spec", {})
            if spec.get("nodeName"):
                raise KubeApiError(f"pod {namespace}/{name} is already assigned to node {spec['nodeName']}", 409)
            spec["nodeName"] = node
            meta = pod.setdefault("metadata", {})
            meta["annotations"] = {**(meta.get("annotations") or {}), **annotations}
            self.binds.append((namespace, name, node))


def unclear(err: KubeApiError) -> bool:
    """Whether a failed write may have taken effect (read the pod before answering)."""
    return _unclear(err.status)
