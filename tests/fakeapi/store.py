"""The fake API server's state: objects, one global resourceVersion and a bounded event history.

Everything the HTTP layer does goes through ``Store`` methods that enforce the API server's rules
(validation, optimistic concurrency, status subresources, pod binding). Tests arrange state with the
``put_*``/``update_*`` helpers, which skip validation but still bump the resourceVersion and emit watch
events, so watchers see arranged changes exactly like API changes.
"""

from __future__ import annotations

import builtins
import collections
import copy
import datetime
import random
import re
import string
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .patch import PatchError, json_patch, merge_patch, strategic_merge_patch

Obj = dict[str, Any]


@dataclass(frozen=True)
class Resource:
    """One REST resource: where it lives and how it behaves."""

    plural: str
    kind: str
    api_version: str
    namespaced: bool
    has_status: bool
    field_labels: frozenset[str]

    @property
    def prefix(self) -> str:
        return "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"


_META = frozenset({"metadata.name", "metadata.namespace"})
RESOURCES: dict[str, Resource] = {
    r.plural: r
    for r in (
        Resource(
            "pods", "Pod", "v1", True, True,
            _META | {"spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
                     "spec.hostNetwork", "status.phase", "status.podIP", "status.nominatedNodeName"},
        ),
        Resource("nodes", "Node", "v1", False, True, frozenset({"metadata.name", "spec.unschedulable"})),
        Resource(
            "events", "Event", "v1", True, False,
            _META | {"involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                     "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
                     "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type"},
        ),
        Resource("leases", "Lease", "coordination.k8s.io/v1", True, False, _META),
        Resource("poddisruptionbudgets", "PodDisruptionBudget", "policy/v1", True, True, _META),
    )
}

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class ApiError(Exception):
    """An API failure, rendered as the API server's ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str, details: Obj | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> Obj:
        body: Obj = {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def not_found(res: Resource, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{res.plural} "{name}" not found', {"name": name, "kind": res.plural})


def conflict(kind: str, name: str, why: str) -> ApiError:
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {kind} "{name}": {why}',
                    {"name": name, "kind": kind})


def stale(res: Resource, name: str) -> ApiError:
    return conflict(res.plural, name, "the object has been modified; please apply your changes to the "
                    "latest version and try again")


def invalid(res: Resource, name: str, causes: list[tuple[str, str, str]]) -> ApiError:
    """422 with causes given as (field, reason, message), as the API server's validation answers."""
    text = ", ".join(f"{field}: {msg}" for field, _, msg in causes)
    return ApiError(
        422, "Invalid", f'{res.kind} "{name}" is invalid: {text}',
        {"name": name, "kind": res.kind,
         "causes": [{"reason": r, "message": m, "field": f} for f, r, m in causes]},
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ----------------------------------------------------------------------------------------- selectors


def _field_value(obj: Obj, path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def _split_top(text: str) -> list[str]:
    """Split on commas outside parentheses (``a in (x,y),b=c``)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


@dataclass(frozen=True)
class Selector:
    """fieldSelector (=, ==, !=) plus labelSelector (=, ==, !=, in, notin, exists, !exists)."""

    fields: tuple[tuple[str, str, str], ...] = ()
    labels: tuple[tuple[str, str, frozenset[str]], ...] = ()

    @classmethod
    def parse(cls, res: Resource, field_selector: str | None, label_selector: str | None) -> Selector:
        fields = []
        for term in _split_top(field_selector or ""):
            m = re.fullmatch(r"([^=!]+)(==|!=|=)(.*)", term)
            if not m:
                raise bad_request(f'invalid selector: \'{field_selector}\'; can\'t understand \'{term}\'')
            key, op, value = m.group(1).strip(), m.group(2), m.group(3).strip()
            if key not in res.field_labels:
                raise bad_request(f'field label not supported: {key}')
            fields.append((key, "!=" if op == "!=" else "=", value))
        labels = []
        for term in _split_top(label_selector or ""):
            m = re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", term)
            if m:
                values = frozenset(v.strip() for v in m.group(3).split(",") if v.strip())
                labels.append((m.group(1), m.group(2), values))
            elif m := re.fullmatch(r"([^=!\s]+)\s*(==|!=|=)\s*(\S*)", term):
                labels.append((m.group(1), "!=" if m.group(2) == "!=" else "=", frozenset({m.group(3)})))
            elif m := re.fullmatch(r"(!?)([^=!\s]+)", term):
                labels.append((m.group(2), "!" if m.group(1) else "exists", frozenset()))
            else:
                raise bad_request(f"unable to parse requirement: {term!r}")
        return cls(tuple(fields), tuple(labels))

    def matches(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        for key, op, value in self.fields:
            if (_field_value(obj, key) == value) != (op == "="):
                return False
        obj_labels = obj.get("metadata", {}).get("labels") or {}
        for key, op, values in self.labels:
            has, val = key in obj_labels, obj_labels.get(key)
            ok = {
                "=": has and val in values,
                "in": has and val in values,
                "!=": not has or val not in values,
                "notin": not has or val not in values,
                "exists": has,
                "!": not has,
            }[op]
            if not ok:
                return False
        return True


# --------------------------------------------------------------------------------------- the store


@dataclass(frozen=True)
class Event:
    """One committed change; ``old`` lets a selector-filtered watch turn MODIFIED into ADDED/DELETED."""

    rv: int
    resource: str
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj
    old: Obj | None


Key = tuple[str, str]  # (namespace or "", name)


class Store:
    """All objects of all resources behind one lock; ``cond`` is notified on every commit and on close."""

    def __init__(self, history_size: int = 1000, graceful_pod_deletion: bool = False) -> None:
        self.cond = threading.Condition(threading.RLock())
        self.graceful_pod_deletion = graceful_pod_deletion
        self.closed = False
        self._objects: dict[str, dict[Key, Obj]] = {plural: {} for plural in RESOURCES}
        self._rv = 0
        self._history: collections.deque[Event] = collections.deque(maxlen=max(1, history_size))
        self._compacted_rv = 0

    # ---- versions and history

    @property
    def resource_version(self) -> int:
        """The newest resourceVersion handed out (0 before the first write)."""
        with self.cond:
            return self._rv

    @property
    def compacted_rv(self) -> int:
        """Watches and continue tokens from a version older than this get 410 Gone."""
        with self.cond:
            return self._compacted_rv

    def compact(self) -> int:
        """Forget all history, like etcd compaction: every watch from an older version gets 410."""
        with self.cond:
            self._history.clear()
            self._compacted_rv = self._rv
            self.cond.notify_all()
            return self._rv

    def events_after(self, rv: int, resource: str) -> tuple[list[Event], int] | None:
        """Events of ``resource`` newer than ``rv`` and the version they reach up to (a watch's next
        cursor), or None when the history no longer reaches back to ``rv`` (410 Gone)."""
        with self.cond:
            if rv < self._compacted_rv:
                return None
            out: list[Event] = []
            for event in reversed(self._history):
                if event.rv <= rv:
                    break
                if event.resource == resource:
                    out.append(event)
            out.reverse()
            return out, max(rv, self._rv)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def _commit(self, res: Resource, type_: str, obj: Obj, old: Obj | None) -> Obj:
        self._rv += 1
        obj = copy.deepcopy(obj)
        obj["kind"], obj["apiVersion"] = res.kind, res.api_version
        obj["metadata"]["resourceVersion"] = str(self._rv)
        key = (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        if type_ == "DELETED":
            self._objects[res.plural].pop(key, None)
        else:
            self._objects[res.plural][key] = obj
        if len(self._history) == self._history.maxlen:
            self._compacted_rv = self._history[0].rv
        self._history.append(Event(self._rv, res.plural, type_, obj, old))
        self.cond.notify_all()
        return copy.deepcopy(obj)

    # ---- reads

    def _key(self, res: Resource, namespace: str | None, name: str) -> Key:
        return (namespace or "", name) if res.namespaced else ("", name)

    def get(self, resource: str, name: str, namespace: str | None = None) -> Obj:
        """A copy of the object; raises ApiError 404."""
        res = RESOURCES[resource]
        with self.cond:
            obj = self._objects[resource].get(self._key(res, namespace, name))
            if obj is None:
                raise not_found(res, name)
            return copy.deepcopy(obj)

    def find(self, resource: str, name: str, namespace: str | None = None) -> Obj | None:
        """Like ``get`` but None when missing."""
        try:
            return self.get(resource, name, namespace)
        except ApiError:
            return None

    def list(self, resource: str, namespace: str | None = None,
             selector: Selector | None = None) -> tuple[list[Obj], int]:
        """Copies of the matching objects in etcd key order, and the list's resourceVersion."""
        with self.cond:
            items = [
                copy.deepcopy(obj)
                for key, obj in sorted(self._objects[resource].items())
                if (namespace is None or key[0] == namespace) and (selector is None or selector.matches(obj))
            ]
            return items, self._rv

    # ---- API writes (validated)

    def create(self, resource: str, obj: Obj, namespace: str | None = None) -> Obj:
        res = RESOURCES[resource]
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {}) or {}
        obj["metadata"] = meta
        if res.namespaced:
            if meta.get("namespace") not in (None, "", namespace):
                raise bad_request("the namespace of the provided object does not match the namespace sent "
                                  "on the request")
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
            meta["name"] = meta["generateName"] + suffix
        for field in ("resourceVersion", "uid", "deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(field, None)
        _validate(res, obj)
        if resource == "pods":
            _default_pod(obj)
        with self.cond:
            key = self._key(res, namespace, meta["name"])
            if key in self._objects[resource]:
                raise ApiError(409, "AlreadyExists", f'{res.plural} "{meta["name"]}" already exists',
                               {"name": meta["name"], "kind": res.plural})
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            return self._commit(res, "ADDED", obj, None)

    def replace(self, resource: str, name: str, namespace: str | None, obj: Obj,
                subresource: str | None = None) -> Obj:
        """PUT: optimistic concurrency on metadata.resourceVersion (unconditional when it is absent)."""
        res = RESOURCES[resource]
        with self.cond:
            old = self.get(resource, name, namespace)
            return self._update(res, old, copy.deepcopy(obj), subresource)

    def patch(self, resource: str, name: str, namespace: str | None, content_type: str, body: Any,
              subresource: str | None = None) -> Obj:
        res = RESOURCES[resource]
        with self.cond:
            old = self.get(resource, name, namespace)
            try:
                if content_type == "application/merge-patch+json":
                    new = merge_patch(old, body)
                elif content_type == "application/strategic-merge-patch+json":
                    new = strategic_merge_patch(old, body)
                elif content_type == "application/json-patch+json":
                    new = json_patch(old, body)
                else:
                    raise ApiError(415, "UnsupportedMediaType",
                                   f"the body of the request was in an unknown format - accepted media "
                                   f"types include: application/json-patch+json, "
                                   f"application/merge-patch+json, application/strategic-merge-patch+json "
                                   f"(not {content_type})")
            except PatchError as e:
                raise ApiError(e.code, "Invalid" if e.code == 422 else "BadRequest", str(e)) from e
            if not isinstance(new, dict) or not isinstance(new.get("metadata"), dict):
                raise bad_request("patch result is not an object with metadata")
            return self._update(res, old, new, subresource)

    def _update(self, res: Resource, old: Obj, new: Obj, subresource: str | None) -> Obj:
        old_meta, meta = old["metadata"], new.setdefault("metadata", {})
        name = old_meta["name"]
        if meta.get("name", name) != name:
            raise bad_request(f"the name of the object ({meta.get('name')}) does not match the name on the "
                              f"URL ({name})")
        if res.namespaced and meta.get("namespace", old_meta["namespace"]) != old_meta["namespace"]:
            raise bad_request("the namespace of the provided object does not match the namespace sent on "
                              "the request")
        if meta.get("uid") not in (None, "", old_meta["uid"]):
            raise ApiError(409, "Conflict", f"Precondition failed: UID in precondition: {meta['uid']}, UID "
                           f"in object meta: {old_meta['uid']}", {"name": name, "kind": res.plural})
        if meta.get("resourceVersion") not in (None, "", old_meta["resourceVersion"]):
            raise stale(res, name)
        for field in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds",
                      "namespace", "name"):
            if field in old_meta:
                meta[field] = old_meta[field]
            else:
                meta.pop(field, None)
        if res.has_status:
            # The main resource ignores status and the status subresource ignores spec, as for real.
            keep = "spec" if subresource == "status" else "status"
            if keep in old:
                new[keep] = copy.deepcopy(old[keep])
            else:
                new.pop(keep, None)
            if subresource == "status":
                for field in ("finalizers", "ownerReferences"):
                    if field in old_meta:
                        meta[field] = old_meta[field]
                    else:
                        meta.pop(field, None)
        _validate(res, new, old)
        if res.plural == "pods" and subresource != "status":
            _check_pod_spec_update(res, name, old.get("spec") or {}, new.get("spec") or {})
        meta["resourceVersion"] = old_meta["resourceVersion"]
        new["kind"], new["apiVersion"] = res.kind, res.api_version
        if new == old:
            return old  # a no-op write changes nothing: no new resourceVersion, no event
        return self._commit(res, "MODIFIED", new, old)

    def delete(self, resource: str, name: str, namespace: str | None, options: Obj | None = None) -> Obj:
        """Delete honouring preconditions; bound pods terminate gracefully if ``graceful_pod_deletion``."""
        res = RESOURCES[resource]
        options = options or {}
        with self.cond:
            old = self.get(resource, name, namespace)
            pre = options.get("preconditions") or {}
            if pre.get("uid") and pre["uid"] != old["metadata"]["uid"]:
                raise ApiError(409, "Conflict", f"Precondition failed: UID in precondition: {pre['uid']}, "
                               f"UID in object meta: {old['metadata']['uid']}",
                               {"name": name, "kind": res.plural})
            if pre.get("resourceVersion") and pre["resourceVersion"] != old["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", f"Precondition failed: ResourceVersion in precondition: "
                               f"{pre['resourceVersion']}, ResourceVersion in object meta: "
                               f"{old['metadata']['resourceVersion']}", {"name": name, "kind": res.plural})
            if resource == "pods" and self.graceful_pod_deletion:
                grace = options.get("gracePeriodSeconds")
                if grace is None:
                    grace = (old.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
                running = (old.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
                if grace > 0 and running and (old.get("spec") or {}).get("nodeName"):
                    if "deletionTimestamp" in old["metadata"]:
                        return old
                    new = copy.deepcopy(old)
                    when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=grace)
                    new["metadata"]["deletionTimestamp"] = when.strftime("%Y-%m-%dT%H:%M:%SZ")
                    new["metadata"]["deletionGracePeriodSeconds"] = grace
                    return self._commit(res, "MODIFIED", new, old)
            return self._commit(res, "DELETED", old, old)

    def bind(self, namespace: str, name: str, binding: Obj) -> None:
        """pods/binding: set spec.nodeName once, copy the Binding's annotations, mark PodScheduled."""
        res = RESOURCES["pods"]
        target = binding.get("target") or {}
        if not target.get("name"):
            raise invalid(res, name, [("target.name", "FieldValueRequired", "Required value")])
        if target.get("kind") not in (None, "", "Node"):
            raise invalid(res, name, [("target.kind", "FieldValueNotSupported",
                                       f'Unsupported value: "{target["kind"]}": supported values: "Node"')])
        with self.cond:
            old = self.get("pods", name, namespace)
            uid = (binding.get("metadata") or {}).get("uid")
            if uid and uid != old["metadata"]["uid"]:
                raise ApiError(409, "Conflict", f"Precondition failed: UID in precondition: {uid}, UID in "
                               f"object meta: {old['metadata']['uid']}", {"name": name, "kind": "pods"})
            if old["metadata"].get("deletionTimestamp"):
                raise conflict("pods/binding", name, f"pod {name} is being deleted, cannot be assigned to "
                               "a host")
            node = (old.get("spec") or {}).get("nodeName")
            if node:
                raise conflict("pods/binding", name, f'pod {name} is already assigned to node "{node}"')
            new = copy.deepcopy(old)
            new["spec"]["nodeName"] = target["name"]
            annotations = (binding.get("metadata") or {}).get("annotations") or {}
            if annotations:
                new["metadata"].setdefault("annotations", {}).update(annotations)
            status = new.setdefault("status", {})
            conditions = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
            conditions.append({"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                               "lastTransitionTime": now_rfc3339()})
            status["conditions"] = conditions
            self._commit(res, "MODIFIED", new, old)

    def evict(self, namespace: str, name: str, eviction: Obj) -> None:
        """pods/eviction (policy/v1): refused with 429 while a PodDisruptionBudget selecting the pod (by
        ``matchLabels``) allows no more disruptions; otherwise the budget's allowance goes down by one
        and the pod is deleted with the Eviction's delete options."""
        with self.cond:
            pod = self.get("pods", name, namespace)
            labels = pod["metadata"].get("labels") or {}
            budgets = []
            for pdb in self._objects["poddisruptionbudgets"].values():
                sel = ((pdb.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
                if pdb["metadata"].get("namespace") == namespace and sel and all(
                        labels.get(k) == v for k, v in sel.items()):
                    budgets.append(pdb)
            for pdb in budgets:
                if int((pdb.get("status") or {}).get("disruptionsAllowed", 0)) <= 0:
                    raise ApiError(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's "
                                   "disruption budget.", {"causes": [{"reason": "DisruptionBudget", "message":
                                   f"The disruption budget {pdb['metadata']['name']} needs more healthy pods"}]})
            self.delete("pods", name, namespace, dict(eviction.get("deleteOptions") or {}))
            for pdb in budgets:
                new = copy.deepcopy(pdb)
                status = new.setdefault("status", {})
                status["disruptionsAllowed"] = int(status.get("disruptionsAllowed", 0)) - 1
                status.setdefault("disruptedPods", {})[name] = now_rfc3339()
                self._commit(RESOURCES["poddisruptionbudgets"], "MODIFIED", new, pdb)

    # ---- test helpers (no validation, but versions and watch events as usual)

    def put(self, resource: str, obj: Any) -> Obj:
        """Create or overwrite an object as given (dict or kubernetes model), for arranging tests."""
        res = RESOURCES[resource]
        obj = copy.deepcopy(_to_dict(obj))
        meta = obj.setdefault("metadata", {})
        if res.namespaced:
            meta.setdefault("namespace", "default")
        with self.cond:
            old = self._objects[resource].get(self._key(res, meta.get("namespace"), meta["name"]))
            meta.setdefault("uid", old["metadata"]["uid"] if old else str(uuid.uuid4()))
            meta.setdefault("creationTimestamp",
                            old["metadata"]["creationTimestamp"] if old else now_rfc3339())
            if resource == "pods":
                _default_pod_spec(obj)
                obj.setdefault("status", {}).setdefault("phase", "Pending")
            return self._commit(res, "MODIFIED" if old else "ADDED", obj, old)

    def update(self, resource: str, name: str, namespace: str | None, mutate: Callable[[Obj], None]) -> Obj:
        """Apply ``mutate`` to a copy of the object and store it (skipping API rules)."""
        res = RESOURCES[resource]
        with self.cond:
            old = self.get(resource, name, namespace)
            new = copy.deepcopy(old)
            mutate(new)
            return self._commit(res, "MODIFIED", new, old)

    def remove(self, resource: str, name: str, namespace: str | None = None) -> Obj:
        """Delete at once, whatever the object's state (no grace, no preconditions)."""
        res = RESOURCES[resource]
        with self.cond:
            return self._commit(res, "DELETED", self.get(resource, name, namespace), None)

    def put_pod(self, obj: Any) -> Obj:
        return self.put("pods", obj)

    def put_node(self, obj: Any) -> Obj:
        return self.put("nodes", obj)

    def put_lease(self, obj: Any) -> Obj:
        return self.put("leases", obj)

    def get_pod(self, name: str, namespace: str = "default") -> Obj:
        return self.get("pods", name, namespace)

    def get_node(self, name: str) -> Obj:
        return self.get("nodes", name)

    def update_pod(self, name: str, mutate: Callable[[Obj], None], namespace: str = "default") -> Obj:
        return self.update("pods", name, namespace, mutate)

    def update_node(self, name: str, mutate: Callable[[Obj], None]) -> Obj:
        return self.update("nodes", name, None, mutate)

    def set_pod_phase(self, name: str, phase: str, namespace: str = "default") -> Obj:
        """What kubelet would report; e.g. ``Succeeded`` to release a pod's slices."""
        return self.update_pod(name, lambda p: p.setdefault("status", {}).update(phase=phase), namespace)

    def pods(self, namespace: str | None = None) -> builtins.list[Obj]:
        return self.list("pods", namespace)[0]

    def nodes(self) -> builtins.list[Obj]:
        return self.list("nodes")[0]

    def wait_until(self, predicate: Callable[[Store], bool], timeout: float = 5.0) -> bool:
        """Block until ``predicate(store)`` holds (re-checked after every write) or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate(self):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.closed:
                    return False
                self.cond.wait(remaining)
            return True


def _to_dict(obj: Any) -> Obj:
    if isinstance(obj, dict):
        return obj
    from kubernetes.client import ApiClient  # only when a test passes a model

    serializer: Any = ApiClient()
    result: Obj = serializer.sanitize_for_serialization(obj)
    return result


# ---------------------------------------------------------------------------------- validation


def _is_extended(resource_name: str) -> bool:
    if "/" not in resource_name or resource_name.startswith("requests."):
        return False
    domain = resource_name.split("/", 1)[0]
    return not (domain == "kubernetes.io" or domain.endswith(".kubernetes.io"))


def _containers(spec: Obj) -> Iterable[tuple[str, Obj]]:
    for field in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(field) or []):
            yield f"spec.{field}[{i}]", c


def _validate(res: Resource, obj: Obj, old: Obj | None = None) -> None:
    """422 for what the API server rejects; on update only for problems the old object did not have
    (objects arranged with ``Store.put`` may skip required fields and stay patchable)."""
    causes = _causes(res, obj)
    if old is not None:
        known = set(_causes(res, old))
        causes = [c for c in causes if c not in known]
    if causes:
        raise invalid(res, (obj.get("metadata") or {}).get("name") or "", causes)


def _causes(res: Resource, obj: Obj) -> list[tuple[str, str, str]]:
    meta = obj.get("metadata") or {}
    name = meta.get("name") or ""
    causes: list[tuple[str, str, str]] = []
    if not name:
        causes.append(("metadata.name", "FieldValueRequired", "name or generateName is required"))
    elif len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        causes.append(("metadata.name", "FieldValueInvalid",
                       f'Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of lower case '
                       "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric "
                       "character"))
    if res.plural == "pods":
        spec = obj.get("spec") or {}
        if not spec.get("containers"):
            causes.append(("spec.containers", "FieldValueRequired", "Required value"))
        for path, c in _containers(spec):
            if not c.get("name"):
                causes.append((f"{path}.name", "FieldValueRequired", "Required value"))
            if not c.get("image"):
                causes.append((f"{path}.image", "FieldValueRequired", "Required value"))
            resources = c.get("resources") or {}
            requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
            for rname, qty in requests.items():
                if not _is_extended(rname):
                    continue
                if rname not in limits:
                    causes.append((f"{path}.resources.limits", "FieldValueRequired",
                                   "Required value: Limit must be set for non overcommitable resources"))
                elif str(limits[rname]) != str(qty):
                    causes.append((f"{path}.resources.requests[{rname}]", "FieldValueInvalid",
                                   f'Invalid value: "{qty}": must be equal to {rname} limit of '
                                   f"{limits[rname]}"))
    return causes


def _default_pod(obj: Obj) -> None:
    """The API server's defaulting that matters to schedulers: requests from limits, a Pending status."""
    _default_pod_spec(obj)
    obj["status"] = {"phase": "Pending"}


def _default_pod_spec(obj: Obj) -> None:
    spec = obj.setdefault("spec", {})
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("priority", 0)
    for _, c in _containers(spec):
        resources = c.setdefault("resources", {})
        limits = resources.get("limits") or {}
        if limits:
            requests = resources.setdefault("requests", {})
            for rname, qty in limits.items():
                requests.setdefault(rname, qty)


_MUTABLE_POD_SPEC = ("activeDeadlineSeconds", "tolerations", "schedulingGates", "terminationGracePeriodSeconds")


def _check_pod_spec_update(res: Resource, name: str, old: Obj, new: Obj) -> None:
    """Pod specs are immutable apart from images and a few fields (spec.nodeName only via binding)."""

    def comparable(spec: Obj) -> Obj:
        spec = copy.deepcopy(spec)
        for field in _MUTABLE_POD_SPEC:
            spec.pop(field, None)
        for _, c in _containers(spec):
            c.pop("image", None)
        return spec

    if comparable(old) != comparable(new):
        raise invalid(res, name, [("spec", "FieldValueForbidden",
                                   "Forbidden: pod updates may not change fields other than "
                                   "`spec.containers[*].image`,`spec.initContainers[*].image`,"
                                   "`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to "
                                   "existing tolerations),`spec.terminationGracePeriodSeconds` "
                                   "(allow it to be set to 1 if it was previously negative)")])
