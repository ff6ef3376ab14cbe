"""The three patch flavours the API server accepts for built-in types.

Merge patch (RFC 7386) and JSON patch (RFC 6902) are exact. Strategic merge patch is approximated:
maps merge like a merge patch, lists named in ``MERGE_KEYS`` merge element-wise by their key (as
``patchMergeKey`` does for the core types), ``finalizers`` merges as a set, every other list is
replaced, and the directives ``$patch`` (replace/delete), ``$retainKeys``,
``$deleteFromPrimitiveList/...`` and ``$setElementOrder/...`` (ignored) are understood. The field name
alone selects the merge key, which is right for Pods, Nodes, Leases and Events.
"""

from __future__ import annotations

import copy
from typing import Any

# patchMergeKey of the list fields of Pod and Node (k8s.io/api/core/v1/types.go).
MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "containerStatuses": "name",
    "initContainerStatuses": "name",
    "ephemeralContainerStatuses": "name",
    "conditions": "type",
    "addresses": "type",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "env": "name",
    "ports": "containerPort",
    "ownerReferences": "uid",
    "taints": "key",
    "imagePullSecrets": "name",
    "resourceClaims": "name",
}
SET_LISTS = frozenset({"finalizers"})


class PatchError(Exception):
    """A patch that cannot be applied; ``code`` is the HTTP status the API server answers."""

    def __init__(self, message: str, code: int = 422) -> None:
        super().__init__(message)
        self.code = code


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: maps merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Strategic merge as far as the core types need it (see the module docstring)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return _strip_directives(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            result[field] = [x for x in result.get(field, []) if x not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(result.get(key), list):
            result[key] = _merge_keyed_list(result[key], value, MERGE_KEYS[key])
        elif isinstance(value, list) and key in SET_LISTS and isinstance(result.get(key), list):
            result[key] = result[key] + [x for x in value if x not in result[key]]
        else:
            result[key] = _strip_directives(value)
    retain = patch.get("$retainKeys")
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_keyed_list(old: list[Any], patch: list[Any], merge_key: str) -> list[Any]:
    result = copy.deepcopy(old)
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise PatchError(f"map: {item!r} does not contain declared merge key: {merge_key}")
        index = next(
            (i for i, x in enumerate(result) if isinstance(x, dict) and x.get(merge_key) == item[merge_key]),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(_strip_directives(item))
        else:
            result[index] = strategic_merge_patch(result[index], item)
    return result


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return copy.deepcopy(value)


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902: add, remove, replace, move, copy and test, applied atomically to a copy."""
    if not isinstance(operations, list):
        raise PatchError("json patch must be a list of operations", code=400)
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"invalid json patch operation: {op!r}", code=400)
        kind, path = op["op"], op["path"]
        if kind == "add":
            doc = _pointer_add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            doc, _ = _pointer_remove(doc, path)
        elif kind == "replace":
            doc, _ = _pointer_remove(doc, path)
            doc = _pointer_add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "move":
            doc, value = _pointer_remove(doc, op["from"])
            doc = _pointer_add(doc, path, value)
        elif kind == "copy":
            doc = _pointer_add(doc, path, copy.deepcopy(_pointer_get(doc, op["from"])))
        elif kind == "test":
            if _pointer_get(doc, path) != op.get("value"):
                raise PatchError(f"testing value {path} failed: test failed")
        else:
            raise PatchError(f"Unexpected kind: {kind}", code=400)
    return doc


def _split(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer: {path!r}", code=400)
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str]) -> Any:
    for part in parts:
        if isinstance(doc, dict) and part in doc:
            doc = doc[part]
        elif isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
            doc = doc[int(part)]
        else:
            raise PatchError(f"doc is missing path: {'/' + '/'.join(parts)}")
    return doc


def _pointer_get(doc: Any, path: str) -> Any:
    return _walk(doc, _split(path))


def _pointer_add(doc: Any, path: str, value: Any) -> Any:
    parts = _split(path)
    if not parts:
        return value
    parent, last = _walk(doc, parts[:-1]), parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list) and last == "-":
        parent.append(value)
    elif isinstance(parent, list) and last.isdigit() and int(last) <= len(parent):
        parent.insert(int(last), value)
    else:
        raise PatchError(f"doc is missing path: {path}")
    return doc


def _pointer_remove(doc: Any, path: str) -> tuple[Any, Any]:
    parts = _split(path)
    if not parts:
        return None, doc
    parent, last = _walk(doc, parts[:-1]), parts[-1]
    if isinstance(parent, dict) and last in parent:
        return doc, parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return doc, parent.pop(int(last))
    raise PatchError(f"doc is missing path: {path}")
