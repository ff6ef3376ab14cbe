"""kube-scheduler's HTTP extender JSON (``k8s.io/kube-scheduler/extender/v1``), parsed and built here only.

The Go types have no json tags, so every key is the Go field name in PascalCase (reference 2.2):
``Pod``, ``Nodes``/``NodeNames``, ``FailedNodes``, ``Host``/``Score``, ``PodUID``,
``NodeNameToMetaVictims``… The pod and node objects inside stay the API server's plain camelCase
dicts, the form the core reads, and are never copied or rewritten.

Requests come from the network, so parsing is defensive: a body over ``max_bytes``, not UTF-8, not
JSON, nested deeper than ``max_depth``, or of the wrong shape raises :class:`WireError` naming the
field, never ``KeyError``/``TypeError``. Unknown keys are ignored (a newer scheduler may add some).
The result builders, on the other hand, are fed by our own code: a score outside 0..10 or a passing
node the scheduler did not offer is a bug and raises ``ValueError`` instead of reaching the scheduler,
which would fail the whole scheduling attempt ("a name not in the input ⇒ error").

Result parsers (``parse_filter_result``…) exist for whoever plays kube-scheduler: the benchmarks and
the tests' round trips.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from extender.errors import WireError

Obj = dict[str, Any]

MIN_EXTENDER_PRIORITY = 0
MAX_EXTENDER_PRIORITY = 10
#: A NodeList of 5,000 nodes (``nodeCacheCapable: false``) is about 50 MB; with ``NodeNames`` a
#: request is a pod and a few hundred KB of names.
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
#: Real pods nest about 15 levels (managedFields, affinity terms); victims add 3, a NodeList 2.
DEFAULT_MAX_DEPTH = 64
#: Node names are DNS subdomains; UIDs are 36 characters. Anything longer is not from the API server.
MAX_NAME_CHARS = 253
#: FailedNodes reasons end up in the pod's FailedScheduling event; keep them readable.
MAX_REASON_CHARS = 512
_INT64 = (-(2**63), 2**63 - 1)

_EMPTY: Mapping[str, str] = MappingProxyType({})


# ------------------------------------------------------------------------------------- decoding


def load_json(body: bytes | bytearray | memoryview | str, *, max_bytes: int = DEFAULT_MAX_BODY_BYTES,
              max_depth: int = DEFAULT_MAX_DEPTH) -> object:
    """Decode a request body: size, UTF-8, JSON (no NaN/Infinity) and nesting depth are checked."""
    size = len(body.encode("utf-8", errors="surrogatepass")) if isinstance(body, str) else len(body)
    if size > max_bytes:
        raise WireError(f"request body of {size} bytes is over the limit of {max_bytes} bytes")
    if isinstance(body, str):
        text = body
    else:
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as err:
            raise WireError(f"request body is not UTF-8 (bad byte at offset {err.start})") from None
    if not text.strip():
        raise WireError("request body is empty; expected a JSON object")
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise WireError(f"request body is nested too deeply (limit {max_depth} levels)") from None
    except ValueError as err:  # JSONDecodeError, our NaN refusal, over-long integer literals
        raise WireError(f"request body is not valid JSON: {err}") from None
    _check_depth(value, max_depth)
    return value


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


_CONTAINERS = frozenset({dict, list})


def _check_depth(value: object, max_depth: int) -> None:
    """Iteratively, so a hostile body cannot exhaust the stack of whoever walks it later. A container
    whose members are all scalars (a list of 5,000 node names) is not walked member by member: the
    types of its members are collected in one C-level pass (``json.loads`` makes exact dicts and lists)."""
    if not isinstance(value, dict | list):
        return
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(value, 1)]
    while stack:
        container, depth = stack.pop()
        if depth > max_depth:
            raise WireError(f"request body is nested too deeply (limit {max_depth} levels)")
        children = container.values() if isinstance(container, dict) else container
        if _CONTAINERS.isdisjoint(set(map(type, children))):
            continue
        for child in children:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _object(value: object, where: str, what: str = "a JSON object") -> Obj:
    if not isinstance(value, dict):
        raise WireError(f"expected {what}, got {_type_name(value)}", where)
    return value


def _top(value: object, what: str) -> Obj:
    if not isinstance(value, dict):
        raise WireError(f"request body must be a JSON object ({what}), got {_type_name(value)}")
    return value


def _required(obj: Obj, key: str, where: str) -> object:
    """``obj[key]``; a missing key says that keys are PascalCase when a differently-cased one is there."""
    if key in obj:
        return obj[key]
    path = f"{where}.{key}" if where else key
    near = [k for k in obj if isinstance(k, str) and k.lower() == key.lower()]
    hint = f" (keys are case-sensitive PascalCase; found {near[0]!r})" if near else ""
    raise WireError(f"missing{hint}", path)


def _string(value: object, where: str, *, allow_empty: bool = False, max_chars: int = MAX_NAME_CHARS) -> str:
    if not isinstance(value, str):
        raise WireError(f"expected a string, got {_type_name(value)}", where)
    if not value and not allow_empty:
        raise WireError("must not be empty", where)
    if len(value) > max_chars:
        raise WireError(f"is {len(value)} characters long, over the limit of {max_chars}", where)
    return value


def _int64(value: object, where: str, *, minimum: int = _INT64[0]) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WireError(f"expected an integer, got {_type_name(value)}", where)
    if not minimum <= value <= _INT64[1]:
        raise WireError(f"integer out of range ({minimum}..{_INT64[1]})", where)
    return value


def _array(value: object, where: str, *, null_ok: bool = True) -> list[Any]:
    """A JSON array; Go encodes a nil slice as ``null``, which means empty."""
    if value is None and null_ok:
        return []
    if not isinstance(value, list):
        raise WireError(f"expected an array, got {_type_name(value)}", where)
    return value


def _pod(value: object, where: str) -> Obj:
    """A v1.Pod as the core reads it: an object whose metadata names it and carries its UID."""
    pod = _object(value, where, "a v1.Pod object")
    meta = _object(_required(pod, "metadata", where), f"{where}.metadata")
    _string(_required(meta, "name", f"{where}.metadata"), f"{where}.metadata.name")
    _string(_required(meta, "uid", f"{where}.metadata"), f"{where}.metadata.uid")
    if "namespace" in meta:
        _string(meta["namespace"], f"{where}.metadata.namespace", allow_empty=True)
    if pod.get("spec") is not None:
        _object(pod["spec"], f"{where}.spec")
    return pod


def _node(value: object, where: str) -> Obj:
    node = _object(value, where, "a v1.Node object")
    meta = _object(_required(node, "metadata", where), f"{where}.metadata")
    _string(_required(meta, "name", f"{where}.metadata"), f"{where}.metadata.name")
    return node


def node_name(node: Obj) -> str:
    """The name of a node dict that came through :func:`parse_extender_args`."""
    name: str = node["metadata"]["name"]
    return name


# ------------------------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class ExtenderArgs:
    """A /filter or /prioritize request: the pod and its candidate nodes, in one of two forms.

    ``node_names`` is set when the scheduler is ``nodeCacheCapable`` (our shipped configuration);
    otherwise ``nodes`` holds the full v1.Node dicts. Exactly one is not None.
    """

    pod: Obj
    node_names: tuple[str, ...] | None = None
    nodes: tuple[Obj, ...] | None = None

    @property
    def node_cache_capable(self) -> bool:
        return self.node_names is not None

    @property
    def candidates(self) -> tuple[str, ...]:
        """The candidate node names in the order the scheduler sent them, whatever the form."""
        if self.node_names is not None:
            return self.node_names
        return tuple(node_name(n) for n in self.nodes or ())

    def to_json(self) -> Obj:
        """The request as kube-scheduler sends it (for benchmarks and tests that play the scheduler)."""
        nodes = None if self.nodes is None else {"metadata": {}, "items": list(self.nodes)}
        names = None if self.node_names is None else list(self.node_names)
        return {"Pod": self.pod, "Nodes": nodes, "NodeNames": names}


def _plain_names(names: list[Any]) -> bool:
    """Whether every member is a non-empty string of at most ``MAX_NAME_CHARS`` characters."""
    if not names:
        return True
    if set(map(type, names)) != {str}:
        return False
    lengths = list(map(len, names))
    return min(lengths) > 0 and max(lengths) <= MAX_NAME_CHARS


def extender_args(value: object) -> ExtenderArgs:
    """Validate a decoded ExtenderArgs body (the /filter and /prioritize request)."""
    body = _top(value, "ExtenderArgs")
    pod = _pod(_required(body, "Pod", ""), "Pod")
    raw_names, raw_nodes = body.get("NodeNames"), body.get("Nodes")
    if raw_names is not None and raw_nodes is not None:
        raise WireError("both Nodes and NodeNames are set; kube-scheduler sends exactly one "
                        "(NodeNames when nodeCacheCapable: true)")
    if raw_names is None and raw_nodes is None:
        for key in ("NodeNames", "Nodes"):
            if any(isinstance(k, str) and k.lower() == key.lower() for k in body):
                _required(body, key, "")  # says "keys are PascalCase" when a client sent "nodeNames"
        raise WireError("neither Nodes nor NodeNames is set; expected the candidate nodes (NodeNames when "
                        "nodeCacheCapable: true, else a v1.NodeList in Nodes)")
    if raw_names is not None:
        names = _array(raw_names, "NodeNames", null_ok=False)
        if _plain_names(names):  # the usual case: C-level passes, no per-name Python code
            return ExtenderArgs(pod, node_names=tuple(names))
        return ExtenderArgs(pod, node_names=tuple(_string(n, f"NodeNames[{i}]") for i, n in enumerate(names)))
    node_list = _object(raw_nodes, "Nodes", "a v1.NodeList object")
    items = _array(node_list.get("items"), "Nodes.items")
    return ExtenderArgs(pod, nodes=tuple(_node(n, f"Nodes.items[{i}]") for i, n in enumerate(items)))


def parse_extender_args(body: bytes | str, **limits: int) -> ExtenderArgs:
    """``extender_args(load_json(body))``; ``limits`` are ``max_bytes``/``max_depth``."""
    return extender_args(load_json(body, **limits))


@dataclass(frozen=True, slots=True)
class ExtenderBindingArgs:
    """A /bind request: which pod (by name and UID) goes to which node."""

    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str

    def to_json(self) -> Obj:
        return {"PodName": self.pod_name, "PodNamespace": self.pod_namespace, "PodUID": self.pod_uid,
                "Node": self.node}


def binding_args(value: object) -> ExtenderBindingArgs:
    """Validate a decoded ExtenderBindingArgs body; every field must be a non-empty string."""
    body = _top(value, "ExtenderBindingArgs")
    fields = [_string(_required(body, key, ""), key) for key in ("PodName", "PodNamespace", "PodUID", "Node")]
    return ExtenderBindingArgs(*fields)


def parse_binding_args(body: bytes | str, **limits: int) -> ExtenderBindingArgs:
    return binding_args(load_json(body, **limits))


@dataclass(frozen=True, slots=True)
class Victims:
    """The pods the scheduler would evict on one node: by UID always, as full pods when it sent them."""

    pod_uids: tuple[str, ...]
    num_pdb_violations: int = 0
    pods: tuple[Obj, ...] | None = None

    def to_meta_json(self) -> Obj:
        return {"Pods": [{"UID": uid} for uid in self.pod_uids], "NumPDBViolations": self.num_pdb_violations}


@dataclass(frozen=True, slots=True)
class ExtenderPreemptionArgs:
    """A /preempt request: the preemptor and, per candidate node, the victims the scheduler chose.

    ``meta`` tells which form arrived (``NodeNameToMetaVictims`` when nodeCacheCapable); the answer
    is always the meta form.
    """

    pod: Obj
    victims: Mapping[str, Victims]
    meta: bool = True

    def to_json(self) -> Obj:
        if self.meta:
            table = {n: v.to_meta_json() for n, v in self.victims.items()}
            return {"Pod": self.pod, "NodeNameToVictims": None, "NodeNameToMetaVictims": table}
        full = {n: {"Pods": list(v.pods or ()), "NumPDBViolations": v.num_pdb_violations}
                for n, v in self.victims.items()}
        return {"Pod": self.pod, "NodeNameToVictims": full, "NodeNameToMetaVictims": None}


def _victims(value: object, where: str, *, meta: bool) -> Victims:
    obj = _object(value, where, "a MetaVictims object" if meta else "a Victims object")
    pods = _array(obj.get("Pods"), f"{where}.Pods")
    raw_pdb = obj.get("NumPDBViolations")
    pdb = 0 if raw_pdb is None else _int64(raw_pdb, f"{where}.NumPDBViolations", minimum=0)
    if meta:
        uids = tuple(
            _string(_required(_object(p, f"{where}.Pods[{i}]", "a MetaPod object"), "UID", f"{where}.Pods[{i}]"),
                    f"{where}.Pods[{i}].UID")
            for i, p in enumerate(pods))
        return Victims(uids, pdb)
    full = tuple(_pod(p, f"{where}.Pods[{i}]") for i, p in enumerate(pods))
    return Victims(tuple(p["metadata"]["uid"] for p in full), pdb, full)


def _victim_table(value: object, where: str, *, meta: bool) -> dict[str, Victims]:
    table = _object(value, where)
    return {_string(n, f"{where} key"): _victims(v, f"{where}.{n}", meta=meta) for n, v in table.items()}


def preemption_args(value: object) -> ExtenderPreemptionArgs:
    """Validate a decoded ExtenderPreemptionArgs body. A null map is Go's empty map: no candidates."""
    body = _top(value, "ExtenderPreemptionArgs")
    pod = _pod(_required(body, "Pod", ""), "Pod")
    raw_full, raw_meta = body.get("NodeNameToVictims"), body.get("NodeNameToMetaVictims")
    full = None if raw_full is None else _victim_table(raw_full, "NodeNameToVictims", meta=False)
    meta = None if raw_meta is None else _victim_table(raw_meta, "NodeNameToMetaVictims", meta=True)
    if full and meta:
        raise WireError("both NodeNameToVictims and NodeNameToMetaVictims are set; kube-scheduler sends one "
                        "(NodeNameToMetaVictims when nodeCacheCapable: true)")
    if full:
        return ExtenderPreemptionArgs(pod, full, meta=False)
    return ExtenderPreemptionArgs(pod, meta or {}, meta=True)


def parse_preemption_args(body: bytes | str, **limits: int) -> ExtenderPreemptionArgs:
    return preemption_args(load_json(body, **limits))


# ------------------------------------------------------------------------------------- results


def _reason(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 1] + "…"


def _reasons_out(table: Mapping[str, str]) -> dict[str, str]:
    """Node -> reason with each reason shortened to ``MAX_REASON_CHARS``. Thousands of nodes share a
    handful of texts: each distinct text is looked at once, and a table whose texts are all short
    enough is copied as it is."""
    texts = set(table.values())
    if not texts or max(map(len, texts)) <= MAX_REASON_CHARS:
        return dict(table)
    short = {t: _reason(t) for t in texts}
    return {n: short[r] for n, r in table.items()}


@dataclass(frozen=True, slots=True)
class FilterResult:
    """An ExtenderFilterResult. Build it with :func:`filter_result` so the form matches the request."""

    node_names: tuple[str, ...] | None = None
    nodes: tuple[Obj, ...] | None = None
    failed: Mapping[str, str] = field(default_factory=dict)
    failed_unresolvable: Mapping[str, str] = field(default_factory=dict)
    error: str = ""

    def to_json(self) -> Obj:
        """Every key, as Go's encoder writes the struct (nil pointers as ``null``)."""
        return {
            "Nodes": None if self.nodes is None else {"metadata": {}, "items": list(self.nodes)},
            "NodeNames": None if self.node_names is None else list(self.node_names),
            "FailedNodes": _reasons_out(self.failed),
            "FailedAndUnresolvableNodes": _reasons_out(self.failed_unresolvable),
            "Error": self.error,
        }

    @property
    def passing(self) -> tuple[str, ...]:
        if self.node_names is not None:
            return self.node_names
        return tuple(node_name(n) for n in self.nodes or ())


def filter_result(args: ExtenderArgs, passing: Iterable[str], *, failed: Mapping[str, str] = _EMPTY,
                  failed_unresolvable: Mapping[str, str] = _EMPTY) -> FilterResult:
    """The answer to ``args``: ``NodeNames`` if it came with names, else the passing v1.Node dicts.

    Raises ``ValueError`` for a passing node that was not a candidate (the scheduler would fail the
    whole attempt) and for a node both passing and failed.
    """
    chosen = tuple(passing)
    offered = set(args.candidates)
    unknown = [n for n in chosen if n not in offered]
    if unknown:
        raise ValueError(f"filter passes nodes the scheduler did not offer: {unknown[:5]}")
    both = [n for n in chosen if n in failed or n in failed_unresolvable]
    if both:
        raise ValueError(f"filter both passes and fails nodes: {both[:5]}")
    if args.node_names is not None:
        return FilterResult(node_names=chosen, failed=dict(failed), failed_unresolvable=dict(failed_unresolvable))
    by_name = {node_name(n): n for n in args.nodes or ()}
    return FilterResult(nodes=tuple(by_name[n] for n in chosen), failed=dict(failed),
                        failed_unresolvable=dict(failed_unresolvable))


def filter_error(args: ExtenderArgs | None, message: str) -> FilterResult:
    """A filter that failed as a whole (``Error`` set): no node passes. The scheduler retries the pod."""
    if not message:
        raise ValueError("a filter error needs a message")
    if args is not None and args.nodes is not None:
        return FilterResult(nodes=(), error=message)
    return FilterResult(node_names=(), error=message)


@dataclass(frozen=True, slots=True)
class HostPriority:
    """One node's extender score, an integer in 0..10 (the scheduler multiplies it by weight x 10)."""

    host: str
    score: int

    def __post_init__(self) -> None:
        if isinstance(self.score, bool) or not isinstance(self.score, int):
            raise ValueError(f"score of {self.host} must be an int, got {type(self.score).__name__}")
        if not MIN_EXTENDER_PRIORITY <= self.score <= MAX_EXTENDER_PRIORITY:
            raise ValueError(f"score of {self.host} is {self.score}, outside "
                             f"{MIN_EXTENDER_PRIORITY}..{MAX_EXTENDER_PRIORITY}")

    def to_json(self) -> Obj:
        return {"Host": self.host, "Score": self.score}


def host_priority_list(scores: Iterable[HostPriority] | Mapping[str, int]) -> list[Obj]:
    """A HostPriorityList: a bare JSON array of ``{"Host", "Score"}``."""
    items = [HostPriority(h, s) for h, s in scores.items()] if isinstance(scores, Mapping) else list(scores)
    return [p.to_json() for p in items]


def host_priorities(scores: Sequence[tuple[str, int]]) -> list[Obj]:
    """A HostPriorityList from (node, score) pairs, as :func:`host_priority_list` builds it (same
    checks: every score an int in 0..10, else ``ValueError``) without an object per node: the
    checks are C-level passes over the scores and the answer is built in one comprehension."""
    if not scores:
        return []
    values = [s for _, s in scores]
    if set(map(type, values)) != {int} or not (
            min(values) >= MIN_EXTENDER_PRIORITY and max(values) <= MAX_EXTENDER_PRIORITY):
        for h, s in scores:
            HostPriority(h, s)  # raises, naming the node
    return [{"Host": h, "Score": s} for h, s in scores]


@dataclass(frozen=True, slots=True)
class BindingResult:
    """An ExtenderBindingResult; a non-empty ``error`` makes the scheduler retry the pod."""

    error: str = ""

    def to_json(self) -> Obj:
        return {"Error": self.error}


@dataclass(frozen=True, slots=True)
class PreemptionResult:
    """An ExtenderPreemptionResult: the nodes still worth preempting on, and their victims by UID."""

    victims: Mapping[str, Victims] = field(default_factory=dict)

    def to_json(self) -> Obj:
        return {"NodeNameToMetaVictims": {n: v.to_meta_json() for n, v in self.victims.items()}}


def encode(value: Obj | list[Obj]) -> bytes:
    """Compact UTF-8 JSON for a response body."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


# ------------------------------------------------------------------- results, as the scheduler reads them


def _reasons(value: object, where: str) -> dict[str, str]:
    if value is None:
        return {}
    table = _object(value, where)
    return {k: _string(v, f"{where}.{k}", allow_empty=True, max_chars=1 << 20) for k, v in table.items()}


def parse_filter_result(value: object) -> FilterResult:
    """An ExtenderFilterResult as kube-scheduler reads it (exact keys; no key means zero nodes pass)."""
    body = _top(value, "ExtenderFilterResult")
    names = body.get("NodeNames")
    nodes = body.get("Nodes")
    return FilterResult(
        node_names=None if names is None else tuple(
            _string(n, f"NodeNames[{i}]") for i, n in enumerate(_array(names, "NodeNames"))),
        nodes=None if nodes is None else tuple(
            _node(n, f"Nodes.items[{i}]")
            for i, n in enumerate(_array(_object(nodes, "Nodes").get("items"), "Nodes.items"))),
        failed=_reasons(body.get("FailedNodes"), "FailedNodes"),
        failed_unresolvable=_reasons(body.get("FailedAndUnresolvableNodes"), "FailedAndUnresolvableNodes"),
        error=_string(body.get("Error") or "", "Error", allow_empty=True, max_chars=1 << 20),
    )


def parse_host_priority_list(value: object) -> tuple[HostPriority, ...]:
    """A HostPriorityList; ``Score`` must be a JSON integer, as Go's decoder insists."""
    items = _array(value, "HostPriorityList", null_ok=True)
    out = []
    for i, item in enumerate(items):
        obj = _object(item, f"[{i}]", "a HostPriority object")
        host = _string(_required(obj, "Host", f"[{i}]"), f"[{i}].Host")
        score = _int64(_required(obj, "Score", f"[{i}]"), f"[{i}].Score")
        try:
            out.append(HostPriority(host, score))
        except ValueError as err:
            raise WireError(str(err), f"[{i}].Score") from None
    return tuple(out)


def parse_binding_result(value: object) -> BindingResult:
    body = _top(value, "ExtenderBindingResult")
    return BindingResult(_string(body.get("Error") or "", "Error", allow_empty=True, max_chars=1 << 20))


def parse_preemption_result(value: object) -> PreemptionResult:
    body = _top(value, "ExtenderPreemptionResult")
    raw = body.get("NodeNameToMetaVictims")
    return PreemptionResult({} if raw is None else _victim_table(raw, "NodeNameToMetaVictims", meta=True))
