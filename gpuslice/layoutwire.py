"""The two Node annotations of dynamic MIG layouts (DESIGN 3 and 4), as versioned JSON codecs.

``example.com/gpu-slice.mig-layout`` (node, written by the extender only; the admission policy in
``manifests/deviceplugin/mig-layout-policy.yaml`` refuses anyone else)::

    {"v": 1, "generation": 7, "time": "2025-01-01T00:00:00Z",
     "gpus": [{"uuid": "GPU-…", "instances": [{"profile": "3g.40gb", "start": 4}, …],
               "pods": ["<pod UID>"], "reason": "a Pending pod asks 3g …"}]}

The whole wanted layout of each GPU named (instances that stay are listed too, matched by profile
and start); GPUs not named are left as they are. ``generation`` grows with every new wish, so the
device plugin applies each one once.

``example.com/gpu-slice.mig-layout-status`` (node, written by that node's device plugin only)::

    {"v": 1, "generation": 7, "time": "…",
     "gpus": [{"uuid": "GPU-…", "state": "applied" | "refused" | "failed", "message": "…"}]}

Encoding is deterministic; decoding is strict about what it needs and ignores unknown fields, as
:mod:`gpuslice.annotations` does for the other annotations (whose helpers it shares).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal, cast

from gpuslice.annotations import VERSION, _dump, _load, _need_object, _Reader, format_time
from gpuslice.errors import AnnotationError

LAYOUT_KEY = "example.com/gpu-slice.mig-layout"
STATUS_KEY = "example.com/gpu-slice.mig-layout-status"
MAX_START = 7
ResultState = Literal["applied", "refused", "failed"]
RESULT_STATES: tuple[str, ...] = ("applied", "refused", "failed")


@dataclass(frozen=True, slots=True)
class WantedGpu:
    """One GPU's wanted layout: (profile, start) per instance, the pods it is for, and why."""

    uuid: str
    instances: tuple[tuple[str, int], ...]
    pods: tuple[str, ...] = ()
    reason: str = ""


@dataclass(frozen=True, slots=True)
class WantedLayouts:
    generation: int
    time: datetime
    gpus: tuple[WantedGpu, ...]

    def gpu(self, uuid: str) -> WantedGpu | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)


@dataclass(frozen=True, slots=True)
class GpuResult:
    uuid: str
    state: ResultState
    message: str = ""


@dataclass(frozen=True, slots=True)
class LayoutResults:
    generation: int
    time: datetime
    gpus: tuple[GpuResult, ...]

    def gpu(self, uuid: str) -> GpuResult | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)


def encode_wanted(w: WantedLayouts) -> str:
    return _dump({"v": VERSION, "generation": w.generation, "time": format_time(w.time), "gpus": [
        {"uuid": g.uuid, "instances": [{"profile": p, "start": s} for p, s in sorted(g.instances, key=lambda x: x[1])],
         "pods": list(g.pods), "reason": g.reason} for g in sorted(w.gpus, key=lambda g: g.uuid)]})


def encode_results(r: LayoutResults) -> str:
    return _dump({"v": VERSION, "generation": r.generation, "time": format_time(r.time), "gpus": [
        {"uuid": g.uuid, "state": g.state, "message": g.message} for g in sorted(r.gpus, key=lambda g: g.uuid)]})


def _gpu_uuid(r: _Reader, name: str) -> str:
    uuid = r.text(name)
    if not uuid.startswith("GPU-") or "::" in uuid or any(c.isspace() for c in uuid):
        r.fail(f"field {name} must be a GPU UUID (GPU-…), got {uuid!r}")
    return uuid


def _optional_text(r: _Reader, name: str) -> str:
    if name not in r.obj:
        return ""
    value = r.obj[name]
    if not isinstance(value, str):
        r.fail(f"field {name} must be a string")
    return value


def decode_wanted(text: object) -> WantedLayouts:
    """Read the extender's wanted layouts; ``AnnotationError`` says what is wrong and where."""
    reader = _Reader(_load(text, LAYOUT_KEY), LAYOUT_KEY)
    generation = reader.integer("generation", 1)
    when = reader.time("time")
    gpus: list[WantedGpu] = []
    seen: set[str] = set()
    for n, raw in enumerate(reader.array("gpus")):
        where = f"gpus[{n}]"
        g = _Reader(_need_object(raw, LAYOUT_KEY, where), LAYOUT_KEY, where)
        uuid = _gpu_uuid(g, "uuid")
        if uuid in seen:
            raise AnnotationError(f"{LAYOUT_KEY}: GPU {uuid} is listed twice")
        seen.add(uuid)
        slots: list[tuple[str, int]] = []
        for m, raw_inst in enumerate(g.array("instances")):
            iwhere = f"{where}.instances[{m}]"
            i = _Reader(_need_object(raw_inst, LAYOUT_KEY, iwhere), LAYOUT_KEY, iwhere)
            start = i.integer("start", 0)
            if start > MAX_START:
                i.fail(f"field start must be <= {MAX_START}, got {start}")
            slots.append((i.text("profile"), start))
        if len({s for _, s in slots}) != len(slots):
            g.fail("two instances start at the same memory slice")
        pods = tuple(g.text_array("pods")) if "pods" in g.obj else ()
        gpus.append(WantedGpu(uuid, tuple(sorted(slots, key=lambda x: x[1])), pods, _optional_text(g, "reason")))
    return WantedLayouts(generation, when, tuple(gpus))


def decode_results(text: object) -> LayoutResults:
    """Read the device plugin's stamp of what it did with a generation of wanted layouts."""
    reader = _Reader(_load(text, STATUS_KEY), STATUS_KEY)
    generation = reader.integer("generation", 0)
    when = reader.time("time")
    out: list[GpuResult] = []
    for n, raw in enumerate(reader.array("gpus")):
        where = f"gpus[{n}]"
        g = _Reader(_need_object(raw, STATUS_KEY, where), STATUS_KEY, where)
        uuid = _gpu_uuid(g, "uuid")
        state = g.text("state")
        if state not in RESULT_STATES:
            g.fail(f"field state must be one of {', '.join(RESULT_STATES)}, got {state!r}")
        out.append(GpuResult(uuid, cast(ResultState, state), _optional_text(g, "message")))
    return LayoutResults(generation, when, tuple(out))
