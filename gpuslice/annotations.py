"""The annotation contract between extender and device plugin (DESIGN 3), as versioned JSON codecs.

Three annotations carry state between the two services, and both must read exactly what the other
wrote, across rolling updates, so every value carries ``"v": 1`` and this module is the only place
that writes or reads them:

``example.com/gpu-slice.inventory`` (node, written by the device plugin)::

    {"v": 1, "gpus": [{"uuid": "GPU-…", "index": 0, "product": "H100-80GB", "memoryMiB": 81559,
      "mode": "mig", "slices": 7, "healthy": true, "cordoned": false,
      "instances": [{"uuid": "MIG-…", "profile": "3g.40gb", "start": 0, "slices": 3,
                     "memoryMiB": 40448, "gpuInstanceId": 2}]}]}

``gpuInstanceId`` (optional in version 1) is the instance's GPU-instance id, the ``GPU_I_ID`` label of
its dcgm-exporter series: the extender matches DCGM activity to MIG instances by it.

``example.com/gpu-slice.assignment`` (pod, written by the extender at bind)::

    {"v": 1, "podUID": "…", "node": "gpu-1", "gpus": ["GPU-…"], "instance": "MIG-…" | null,
     "sliceIds": ["MIG-…::0", …], "policy": "fragmentation", "scores": {"fragmentation": 0.8},
     "time": "2025-01-01T00:00:00Z"}

``example.com/gpu-slice.allocated`` (pod, written by the device plugin after admission)::

    {"v": 1, "sliceIds": ["GPU-…::3", …], "time": "2025-01-01T00:00:01Z"}

Encoding is deterministic (sorted keys, compact separators) so an unchanged value patches as a
no-op. Decoding is strict about what it needs (every field present and well typed, ids valid) and
ignores fields it does not know, so a plugin that adds an optional field in version 1 does not make
an older extender drop the node during a rolling update; incompatible changes bump ``v``.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, NoReturn, TypeVar, cast

from gpuslice import ids
from gpuslice.errors import AnnotationError, GpuSliceError
from gpuslice.model import GPU_MODES, Gpu, GpuMode, MigInstance

VERSION = 1

PREFIX = "example.com/gpu-slice"
INVENTORY_KEY = "example.com/gpu-slice.inventory"
ASSIGNMENT_KEY = "example.com/gpu-slice.assignment"
ALLOCATED_KEY = "example.com/gpu-slice.allocated"
MODE_LABEL = "example.com/gpu-slice.mode"
PRODUCT_LABEL = "example.com/gpu-slice.product"
CORDON_KEY = "example.com/gpu-slice.cordon"
HOURLY_COST_KEY = "example.com/hourly-cost"
SIMULATED_UTILIZATION_KEY = "example.com/simulated-utilization"

# Labels written by others that the services read (reference/protocols.md 4 and 4.1).
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
INSTANCE_TYPE_LABEL_BETA = "beta.kubernetes.io/instance-type"
CAPACITY_TYPE_LABEL = "karpenter.sh/capacity-type"
REGION_LABEL = "topology.kubernetes.io/region"
ZONE_LABEL = "topology.kubernetes.io/zone"
GFD_PRODUCT_LABEL = "nvidia.com/gpu.product"
GFD_MEMORY_LABEL = "nvidia.com/gpu.memory"
GFD_COUNT_LABEL = "nvidia.com/gpu.count"
GFD_MIG_CAPABLE_LABEL = "nvidia.com/mig.capable"

_RFC3339 = re.compile(
    r"\A\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})\Z")


# --------------------------------------------------------------------------- time

def format_time(when: datetime) -> str:
    """RFC 3339 in UTC with a ``Z``; microseconds only when present, so hand-written times round-trip."""
    if when.tzinfo is None or when.utcoffset() is None:
        raise AnnotationError(f"time {when.isoformat()} has no timezone; the contract stores UTC times")
    utc = when.astimezone(UTC)
    spec = "microseconds" if utc.microsecond else "seconds"
    return utc.replace(tzinfo=None).isoformat(timespec=spec) + "Z"


def parse_time(text: object, *, what: str = "time") -> datetime:
    """Parse an RFC 3339 timestamp (``Z`` or an offset; fractions beyond microseconds truncated)."""
    if not isinstance(text, str):
        raise AnnotationError(f"{what} must be an RFC 3339 string, got {_type_name(text)}")
    match = _RFC3339.match(text)
    if match is None:
        raise AnnotationError(f"{what} {text!r} is not an RFC 3339 timestamp such as 2025-01-01T00:00:00Z")
    normal = text.upper().replace("Z", "+00:00")
    fraction = match.group(1)
    if fraction and len(fraction) > 7:  # Python keeps microseconds: drop nanosecond digits
        normal = normal.replace(fraction, fraction[:7], 1)
    try:
        return datetime.fromisoformat(normal).astimezone(UTC)
    except (ValueError, OverflowError) as err:
        raise AnnotationError(f"{what} {text!r} is not a valid date and time: {err}") from None


# --------------------------------------------------------------------------- values

@dataclass(frozen=True, slots=True)
class Assignment:
    """The extender's decision for one pod, written before its Binding.

    ``scores`` is the policy breakdown (name → score in the policy's own range) kept for operators;
    it is excluded from the hash so assignments can live in sets.
    """

    pod_uid: str
    node: str
    gpus: tuple[str, ...]
    instance: str | None
    slice_ids: tuple[str, ...]
    policy: str
    time: datetime
    scores: Mapping[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _need_text(self.pod_uid, "podUID")
        _need_text(self.node, "node")
        _need_text(self.policy, "policy")
        if not self.gpus:
            raise AnnotationError("gpus must name at least one GPU")
        for uuid in self.gpus:
            _check_owner(uuid, "gpus")
        if len(set(self.gpus)) != len(self.gpus):
            raise AnnotationError(f"gpus lists a GPU twice: {list(self.gpus)}")
        if self.instance is not None:
            _check_owner(self.instance, "instance")
            if len(self.gpus) != 1:
                raise AnnotationError("a MIG assignment (instance set) must name exactly one GPU")
        owners = {self.instance} if self.instance is not None else set(self.gpus)
        _check_slice_ids(self.slice_ids, "sliceIds", owners=owners)
        if self.time.tzinfo is None or self.time.utcoffset() is None:
            raise AnnotationError("time must be timezone-aware")
        clean: dict[str, float] = {}
        for name, value in self.scores.items():
            _need_text(name, "scores key")
            if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
                raise AnnotationError(f"scores.{name} must be a finite number, got {repr(value)[:40]}")
            clean[name] = float(value)
        object.__setattr__(self, "scores", MappingProxyType(dict(sorted(clean.items()))))

    @property
    def size(self) -> int:
        """The number of slices assigned (the pod's request)."""
        return len(self.slice_ids)


@dataclass(frozen=True, slots=True)
class Allocated:
    """The slice ids kubelet really gave a pod (from PodResources) and when the plugin saw them."""

    slice_ids: tuple[str, ...]
    time: datetime

    def __post_init__(self) -> None:
        _check_slice_ids(self.slice_ids, "sliceIds", owners=None)
        if self.time.tzinfo is None or self.time.utcoffset() is None:
            raise AnnotationError("time must be timezone-aware")


# --------------------------------------------------------------------------- encoders

def _dump(obj: Mapping[str, Any]) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def encode_inventory(gpus: Iterable[Gpu]) -> str:
    """The node inventory annotation for these GPUs (in index order, as given)."""
    out = []
    for gpu in gpus:
        out.append({
            "uuid": gpu.uuid, "index": gpu.index, "product": gpu.product, "memoryMiB": gpu.memory_mib,
            "mode": gpu.mode, "slices": gpu.slices, "healthy": gpu.healthy, "cordoned": gpu.cordoned,
            "instances": [
                {"uuid": i.uuid, "profile": i.profile, "start": i.start, "slices": i.compute_slices,
                 "memoryMiB": i.memory_mib, **({} if i.gi is None else {"gpuInstanceId": i.gi})}
                for i in gpu.instances],
        })
    return _dump({"v": VERSION, "gpus": out})


def encode_assignment(assignment: Assignment) -> str:
    """The pod assignment annotation."""
    return _dump({
        "v": VERSION, "podUID": assignment.pod_uid, "node": assignment.node, "gpus": list(assignment.gpus),
        "instance": assignment.instance, "sliceIds": list(assignment.slice_ids), "policy": assignment.policy,
        "scores": dict(assignment.scores), "time": format_time(assignment.time),
    })


def encode_allocated(allocated: Allocated) -> str:
    """The pod allocated annotation."""
    return _dump({"v": VERSION, "sliceIds": list(allocated.slice_ids), "time": format_time(allocated.time)})


# --------------------------------------------------------------------------- decoders

def decode_inventory(text: object) -> tuple[Gpu, ...]:
    """Read a node inventory annotation into GPUs; ``AnnotationError`` says what is wrong and where."""
    reader = _Reader(_load(text, INVENTORY_KEY), INVENTORY_KEY)
    gpus: list[Gpu] = []
    for n, raw in enumerate(reader.array("gpus")):
        g = _Reader(_need_object(raw, INVENTORY_KEY, f"gpus[{n}]"), INVENTORY_KEY, f"gpus[{n}]")
        instances: list[MigInstance] = []
        for m, raw_inst in enumerate(g.array("instances")):
            iwhere = f"gpus[{n}].instances[{m}]"
            r = _Reader(_need_object(raw_inst, INVENTORY_KEY, iwhere), INVENTORY_KEY, iwhere)
            uuid = sys.intern(r.text("uuid"))
            with r.wrapped():
                _check_owner(uuid, "uuid")
            gi = r.integer("gpuInstanceId", 0) if "gpuInstanceId" in r.obj else None
            instances.append(MigInstance(uuid=uuid, profile=sys.intern(r.text("profile")),
                                         start=r.integer("start", 0),
                                         compute_slices=r.integer("slices", 1),
                                         memory_mib=r.integer("memoryMiB", 0), gi=gi))
        # Interned, as pods' assignments name them (text_array), and so are the few products and modes.
        uuid = sys.intern(g.text("uuid"))
        with g.wrapped():
            _check_owner(uuid, "uuid")
        mode = g.text("mode")
        if mode not in GPU_MODES:
            g.fail(f"field mode must be one of {', '.join(GPU_MODES)}, got {mode!r}")
        mode = sys.intern(mode)
        index, product = g.integer("index", 0), sys.intern(g.text("product"))
        memory, slices = g.integer("memoryMiB", 0), g.integer("slices", 0)
        healthy, cordoned = g.boolean("healthy"), g.boolean("cordoned")
        with g.wrapped():
            gpus.append(Gpu(uuid=uuid, index=index, product=product, memory_mib=memory,
                            mode=cast(GpuMode, mode), slices=slices, healthy=healthy, cordoned=cordoned,
                            instances=tuple(instances)))
    seen: set[str] = set()
    indexes: set[int] = set()
    for gpu in gpus:
        if gpu.index in indexes:
            raise AnnotationError(f"{INVENTORY_KEY}: GPU index {gpu.index} is listed twice")
        indexes.add(gpu.index)
        for owner in (gpu.uuid, *(i.uuid for i in gpu.instances)):
            if owner in seen:
                raise AnnotationError(f"{INVENTORY_KEY}: UUID {owner} is listed twice")
            seen.add(owner)
    return tuple(gpus)


def decode_assignment(text: object) -> Assignment:
    """Read a pod assignment annotation; see ``decode_assignment_for`` to also check the pod UID.

    Values are immutable, so a text seen before (a pod's status update) is not parsed again."""
    if isinstance(text, str) and len(text) <= _CACHED_TEXT:
        return _cached(_decode_assignment, text)
    return _decode_assignment(text)


def _decode_assignment(text: object) -> Assignment:
    reader = _Reader(_load(text, ASSIGNMENT_KEY), ASSIGNMENT_KEY)
    pod_uid = reader.text("podUID")
    node = sys.intern(reader.text("node"))  # interned: every pod on a node names it, as do the scores
    gpus = reader.text_array("gpus")
    instance = reader.optional_text("instance")
    slice_ids = reader.text_array("sliceIds")
    policy = sys.intern(reader.text("policy"))
    scores = {sys.intern(name): value for name, value in reader.object("scores").items()}
    time = reader.time("time")
    with reader.wrapped():
        return Assignment(pod_uid=pod_uid, node=node, gpus=tuple(gpus), instance=instance,
                          slice_ids=tuple(slice_ids), policy=policy, time=time, scores=scores)


def decode_allocated(text: object) -> Allocated:
    """Read a pod allocated annotation (cached by text, like :func:`decode_assignment`)."""
    if isinstance(text, str) and len(text) <= _CACHED_TEXT:
        return _cached(_decode_allocated, text)
    return _decode_allocated(text)


_CACHED_TEXT = 4096
_T = TypeVar("_T")


@functools.lru_cache(maxsize=16384)
def _cached_result(fn: Callable[[object], object], text: str) -> tuple[bool, object]:
    try:
        return True, fn(text)
    except AnnotationError as err:
        return False, str(err)


def _cached(fn: Callable[[object], _T], text: str) -> _T:
    ok, value = _cached_result(fn, text)
    if not ok:
        raise AnnotationError(str(value))
    return cast(_T, value)


def _decode_allocated(text: object) -> Allocated:
    reader = _Reader(_load(text, ALLOCATED_KEY), ALLOCATED_KEY)
    slice_ids = reader.text_array("sliceIds")
    time = reader.time("time")
    with reader.wrapped():
        return Allocated(slice_ids=tuple(slice_ids), time=time)


def pod_annotations(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """``metadata.annotations`` of a pod or node mapping (empty when absent)."""
    metadata = pod.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise AnnotationError("metadata must be an object")
    annotations = metadata.get("annotations") or {}
    if not isinstance(annotations, Mapping):
        raise AnnotationError("metadata.annotations must be an object")
    return annotations


def decode_assignment_for(pod: Mapping[str, Any]) -> Assignment | None:
    """The pod's assignment, or ``None`` when it has none; refuse one written for another pod UID.

    A copied manifest (``kubectl get -o yaml | kubectl apply``) carries the old pod's annotations;
    the UID check stops such a copy from claiming the old pod's slices.
    """
    raw = pod_annotations(pod).get(ASSIGNMENT_KEY)
    if raw is None:
        return None
    assignment = decode_assignment(raw)
    uid = (pod.get("metadata") or {}).get("uid")
    if assignment.pod_uid != uid:
        raise AnnotationError(
            f"{ASSIGNMENT_KEY} is for pod UID {assignment.pod_uid!r}, but this pod's metadata.uid is {uid!r}")
    return assignment


def decode_allocated_for(pod: Mapping[str, Any]) -> Allocated | None:
    """The pod's allocated stamp, or ``None`` when the plugin has not written one yet."""
    raw = pod_annotations(pod).get(ALLOCATED_KEY)
    return None if raw is None else decode_allocated(raw)


def parse_cordon(text: object) -> frozenset[str]:
    """GPU UUIDs listed in the node's cordon annotation (comma- or space-separated, as typed by hand)."""
    if text is None:
        return frozenset()
    if not isinstance(text, str):
        raise AnnotationError(f"{CORDON_KEY} must be a string of GPU UUIDs, got {_type_name(text)}")
    uuids = [part for part in re.split(r"[\s,]+", text) if part]
    for uuid in uuids:
        if not uuid.startswith("GPU-"):
            raise AnnotationError(f"{CORDON_KEY}: {uuid!r} is not a GPU UUID (GPU-…)")
        try:
            ids.encode(uuid, 0)
        except GpuSliceError as err:
            raise AnnotationError(f"{CORDON_KEY}: {err}") from None
    return frozenset(uuids)


def encode_cordon(uuids: Iterable[str]) -> str:
    """The cordon annotation value for these GPU UUIDs (sorted, comma-separated)."""
    return ",".join(sorted(set(uuids)))


# --------------------------------------------------------------------------- helpers

def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _finite(value: int | float) -> bool:
    """``math.isfinite`` without its OverflowError on integers beyond a float's range."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _load(text: object, key: str) -> dict[str, Any]:
    """Parse JSON, check it is an object of a version this build reads."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise AnnotationError(f"{key} must be a JSON string, got {_type_name(text)}")
    try:
        obj = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_object)
    except ValueError as err:
        raise AnnotationError(f"{key} is not valid JSON: {err}") from None
    except RecursionError:
        raise AnnotationError(f"{key} is nested too deeply to be an annotation of this contract") from None
    if not isinstance(obj, dict):
        raise AnnotationError(f"{key} must be a JSON object, got {_type_name(obj)}")
    if "v" not in obj:
        raise AnnotationError(f"{key} has no version field \"v\"; this build reads version {VERSION}")
    version = obj["v"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise AnnotationError(f"{key}: field v must be an integer version, got {_type_name(version)}")
    if version != VERSION:
        raise AnnotationError(f"unsupported version {version} of {key}; this build reads version {VERSION}")
    return obj


def _need_object(raw: object, key: str, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise AnnotationError(f"{key}: {where} must be an object, got {_type_name(raw)}")
    return raw


def _need_text(value: object, name: str) -> None:
    if not isinstance(value, str) or not value:
        raise AnnotationError(f"{name} must be a non-empty string, got {value!r}")


def _check_owner(uuid: str, name: str) -> None:
    try:
        ids.encode(uuid, 0)
    except GpuSliceError as err:
        raise AnnotationError(f"{name}: {err}") from None


def _check_slice_ids(values: tuple[str, ...], name: str, *, owners: set[str] | None) -> None:
    if not values:
        raise AnnotationError(f"{name} must list at least one slice id")
    for text in values:
        try:
            sid = ids.decode(text)
        except GpuSliceError as err:
            raise AnnotationError(f"{name}: {err}") from None
        if str(sid) != text:
            raise AnnotationError(f"{name}: device id {text!r} is not in canonical form")
        if owners is not None and sid.owner not in owners:
            raise AnnotationError(f"{name}: {text} does not belong to {', '.join(sorted(owners))}")
    if len(set(values)) != len(values):
        raise AnnotationError(f"{name} lists a slice id twice")


class _Reader:
    """Typed field access on one JSON object, with errors naming the annotation and field path."""

    def __init__(self, obj: dict[str, Any], key: str, where: str = "") -> None:
        self.obj = obj
        self.key = key
        self.where = where

    def _path(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def fail(self, message: str) -> NoReturn:
        prefix = f"{self.where}: " if self.where else ""
        raise AnnotationError(f"{self.key}: {prefix}{message}")

    def _get(self, name: str) -> Any:
        if name not in self.obj:
            raise AnnotationError(f"{self.key}: missing field {self._path(name)}")
        return self.obj[name]

    def _wrong(self, name: str, expected: str, value: object) -> NoReturn:
        raise AnnotationError(
            f"{self.key}: field {self._path(name)} must be {expected}, got {_type_name(value)}")

    def text(self, name: str) -> str:
        value = self._get(name)
        if not isinstance(value, str) or not value:
            self._wrong(name, "a non-empty string", value)
        return value

    def optional_text(self, name: str) -> str | None:
        value = self._get(name)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            self._wrong(name, "a non-empty string or null", value)
        return value

    def integer(self, name: str, minimum: int) -> int:
        value = self._get(name)
        if isinstance(value, bool) or not isinstance(value, int):
            self._wrong(name, "an integer", value)
        if value < minimum:
            raise AnnotationError(f"{self.key}: field {self._path(name)} must be >= {minimum}, got {value}")
        return value

    def boolean(self, name: str) -> bool:
        value = self._get(name)
        if not isinstance(value, bool):
            self._wrong(name, "a boolean", value)
        return value

    def array(self, name: str) -> list[Any]:
        value = self._get(name)
        if not isinstance(value, list):
            self._wrong(name, "an array", value)
        return value

    def text_array(self, name: str) -> list[str]:
        """Strings, interned: a pod's assignment and allocated stamp name the same slice ids, and
        tens of thousands of pods name the same GPUs (one copy shared with the node inventories)."""
        value = self.array(name)
        for item in value:
            if not isinstance(item, str):
                raise AnnotationError(f"{self.key}: field {self._path(name)} must be an array of strings, "
                                      f"got an array holding {_type_name(item)}")
        return [sys.intern(item) for item in value]

    def object(self, name: str) -> dict[str, Any]:
        value = self._get(name)
        if not isinstance(value, dict):
            self._wrong(name, "an object", value)
        return value

    def time(self, name: str) -> datetime:
        value = self._get(name)
        with self.wrapped():
            return parse_time(value, what=f"field {self._path(name)}")

    @contextmanager
    def wrapped(self) -> Iterator[None]:
        """Re-raise model and id errors with the annotation key and path, so callers see where."""
        try:
            yield
        except AnnotationError as err:
            if str(err).startswith(self.key):
                raise
            self.fail(str(err))
        except GpuSliceError as err:
            self.fail(str(err))
