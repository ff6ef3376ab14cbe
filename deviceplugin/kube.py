"""A thin wrapper over the ``kubernetes`` client: this node's pods and Node object, patches, events.

Everything here is blocking I/O and runs on worker threads (watches) or via ``asyncio.to_thread``
(patches, events), never on the Allocate path. Objects are kept as the API server's plain JSON
mappings (``_preload_content=False``), the form the ``gpuslice`` codecs read. Library exceptions are
chained into ``KubeApiError`` so callers handle one class.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from deviceplugin.errors import KubeApiError, KubeUnavailable

log = logging.getLogger(__name__)

Obj = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"
COMPONENT = "gpu-slice-device-plugin"


def load_api_client(kubeconfig: Path | None, *, timeout_s: float) -> Any:
    """An ``ApiClient`` from ``--kubeconfig`` or the in-cluster service account; ``KubeUnavailable`` if neither."""
    from kubernetes import client, config

    try:
        if kubeconfig is not None:
            cfg = client.Configuration()
            config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)  # type: ignore[no-untyped-call]
        else:
            cfg = client.Configuration()
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except config.ConfigException as exc:
        raise KubeUnavailable(f"no Kubernetes API configuration: {exc}") from exc
    except OSError as exc:
        raise KubeUnavailable(f"cannot read the Kubernetes configuration: {exc}") from exc
    cfg.retries = False
    return client.ApiClient(cfg)


def _wrap(what: str, exc: Exception) -> KubeApiError:
    """One line for a failed call: the status, its reason, and the API server's own message (an
    admission policy's refusal says why only there: ``422 Unprocessable Entity`` alone says nothing)."""
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None) or str(exc)
    message = _status_message(getattr(exc, "body", None))
    tail = f": {message}" if message else ""
    return KubeApiError(f"{what}: {status} {reason}{tail}" if status else f"{what}: {reason}{tail}")


def _status_message(body: Any) -> str:
    """The ``message`` of a ``metav1.Status`` body (bytes or text), cut to a readable length."""
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if not isinstance(body, str) or not body:
        return ""
    try:
        doc = json.loads(body)
    except ValueError:
        return body.strip()[:500]
    message = doc.get("message") if isinstance(doc, dict) else None
    return str(message)[:1000] if message else ""


class KubeClient:
    """The calls the plugin makes, each bounded by ``timeout_s``."""

    def __init__(self, api_client: Any, node_name: str, *, timeout_s: float = 10.0) -> None:
        from kubernetes import client

        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.node_name = node_name
        self.timeout_s = timeout_s

    def _json(self, what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Obj:
        try:
            resp = call(*args, _preload_content=False, _request_timeout=self.timeout_s, **kwargs)
        except Exception as exc:  # ApiException, urllib3 errors, pydantic validation
            raise _wrap(what, exc) from exc
        try:
            data = json.loads(resp.data)
        except ValueError as exc:
            raise KubeApiError(f"{what}: the API server answered something other than JSON") from exc
        if not isinstance(data, dict):
            raise KubeApiError(f"{what}: unexpected answer {type(data).__name__}")
        return data

    # ---- reads

    def list_pods(self) -> tuple[list[Obj], str]:
        """This node's pods and the list's resourceVersion (to watch from)."""
        body = self._json("list pods", self.core.list_pod_for_all_namespaces,
                          field_selector=f"spec.nodeName={self.node_name}")
        return list(body.get("items") or []), str((body.get("metadata") or {}).get("resourceVersion", ""))

    def list_node(self) -> tuple[list[Obj], str]:
        """This node (a one-item list, so it is watched like the pods)."""
        body = self._json("list node", self.core.list_node, field_selector=f"metadata.name={self.node_name}")
        return list(body.get("items") or []), str((body.get("metadata") or {}).get("resourceVersion", ""))

    def get_node(self) -> Obj:
        return self._json("get node", self.core.read_node, self.node_name)

    # ---- writes

    def patch_pod_annotations(self, namespace: str, name: str, uid: str, annotations: Mapping[str, str]) -> Obj:
        """Merge-patch annotations, with the UID as a precondition so a re-created pod is not stamped."""
        body = {"metadata": {"uid": uid, "annotations": dict(annotations)}}
        return self._json(f"patch pod {namespace}/{name}", self.core.patch_namespaced_pod, name, namespace, body,
                          _content_type=MERGE_PATCH)

    def patch_node(self, annotations: Mapping[str, str | None], labels: Mapping[str, str | None]) -> Obj:
        body = {"metadata": {"annotations": dict(annotations), "labels": dict(labels)}}
        return self._json(f"patch node {self.node_name}", self.core.patch_node, self.node_name, body,
                          _content_type=MERGE_PATCH)

    def set_taint(self, key: str, effect: str, present: bool) -> bool:
        """Add or remove one taint on this node (read, then a merge patch of the whole list guarded by the
        resourceVersion read, so a concurrent change is not overwritten); ``True`` when it changed."""
        node = self.get_node()
        meta = node.get("metadata") or {}
        taints = list((node.get("spec") or {}).get("taints") or [])
        has = any(t.get("key") == key and t.get("effect") == effect for t in taints)
        if has == present:
            return False
        taints = [t for t in taints if not (t.get("key") == key and t.get("effect") == effect)]
        if present:
            taints.append({"key": key, "effect": effect})
        body = {"metadata": {"resourceVersion": meta.get("resourceVersion")}, "spec": {"taints": taints}}
        self._json(f"taint node {self.node_name}", self.core.patch_node, self.node_name, body,
                   _content_type=MERGE_PATCH)
        return True

    def evict_pod(self, namespace: str, name: str, uid: str) -> None:
        """Evict through the Eviction API (PodDisruptionBudgets hold), for this pod UID only."""
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace},
                "deleteOptions": {"preconditions": {"uid": uid}}}
        try:
            resp: Any = self.core.create_namespaced_pod_eviction(
                name, namespace, body, _preload_content=False,  # type: ignore[arg-type]
                _request_timeout=self.timeout_s)
            resp.release_conn()
        except Exception as exc:  # ApiException (429: a PDB forbids it now), urllib3 errors
            raise _wrap(f"evict pod {namespace}/{name}", exc) from exc

    def create_event(self, *, kind: str, name: str, namespace: str, uid: str, reason: str, message: str,
                     type_: str = "Normal") -> Obj:
        """A core/v1 Event about a Pod or the Node (Node events live in ``default``)."""
        from datetime import UTC, datetime

        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        ns = namespace or "default"
        body = {
            "metadata": {"generateName": f"{name}.", "namespace": ns},
            "involvedObject": {"kind": kind, "name": name, "namespace": namespace, "uid": uid,
                               "apiVersion": "v1"},
            "reason": reason, "message": message[:1024], "type": type_, "count": 1,
            "firstTimestamp": now, "lastTimestamp": now,
            "source": {"component": COMPONENT, "host": self.node_name},
            "reportingComponent": COMPONENT, "reportingInstance": self.node_name,
        }
        return self._json(f"create event {reason}", self.core.create_namespaced_event, ns, body)

    # ---- watches

    def watcher(self, what: str, lister: Callable[[], tuple[list[Obj], str]], watch_call: Callable[..., Any],
                selector: str, on_sync: Callable[[list[Obj]], None],
                on_event: Callable[[str, Obj], None]) -> Watcher:
        return Watcher(what, lister, watch_call, selector, on_sync, on_event, self.timeout_s)

    def pod_watcher(self, on_sync: Callable[[list[Obj]], None], on_event: Callable[[str, Obj], None]) -> Watcher:
        return self.watcher("pods", self.list_pods, self.core.list_pod_for_all_namespaces,
                            f"spec.nodeName={self.node_name}", on_sync, on_event)

    def node_watcher(self, on_sync: Callable[[list[Obj]], None], on_event: Callable[[str, Obj], None]) -> Watcher:
        return self.watcher("node", self.list_node, self.core.list_node,
                            f"metadata.name={self.node_name}", on_sync, on_event)


class Watcher:
    """List then watch on a thread; relist on 410 or a broken stream; ``stop`` ends it at once.

    ``sync`` does the first list on the caller's thread, so the caller knows the cache is synced
    before the plugin registers; ``start`` then watches from that list's resourceVersion.
    """

    def __init__(self, what: str, lister: Callable[[], tuple[list[Obj], str]], watch_call: Callable[..., Any],
                 selector: str, on_sync: Callable[[list[Obj]], None], on_event: Callable[[str, Obj], None],
                 timeout_s: float) -> None:
        self.what = what
        self._lister = lister
        self._watch_call = watch_call
        self._selector = selector
        self._on_sync = on_sync
        self._on_event = on_event
        self._timeout_s = timeout_s
        self._rv = ""
        self._stop = threading.Event()
        self._resp: Any = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.relists = 0

    def sync(self) -> None:
        items, self._rv = self._lister()
        self._on_sync(items)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"watch-{self.what}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            resp = self._resp
        if resp is not None:
            try:
                resp.shutdown()
            except Exception:  # already closed
                log.debug("closing the %s watch", self.what, exc_info=True)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                if not self._rv:
                    self.sync()
                    self.relists += 1
                self._watch_once()
                backoff = 0.1
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.warning("watch of %s broke (%s); listing again in %.1fs", self.what, exc, backoff)
                self._rv = ""
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _watch_once(self) -> None:
        from kubernetes.watch.watch import iter_resp_lines

        resp = self._watch_call(field_selector=self._selector, watch=True, resource_version=self._rv,
                                allow_watch_bookmarks=True, timeout_seconds=300, _preload_content=False,
                                _request_timeout=(self._timeout_s, 360))
        status = getattr(resp, "status", 200)
        if status != 200:
            resp.release_conn()
            if status == 410:
                self._rv = ""
                return
            raise KubeApiError(f"watch of {self.what}: HTTP {status}")
        with self._lock:
            self._resp = resp
        if self._stop.is_set():
            resp.shutdown()
            return
        try:
            for line in iter_resp_lines(resp):  # type: ignore[no-untyped-call]
                if self._stop.is_set():
                    return
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        log.info("watch of %s expired; listing again", self.what)
                        self._rv = ""
                        return
                    raise KubeApiError(f"watch of {self.what}: {obj.get('code')} {obj.get('message')}")
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if rv:
                    self._rv = str(rv)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._on_event(kind, obj)
        finally:
            with self._lock:
                self._resp = None
            resp.release_conn()
