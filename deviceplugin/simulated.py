"""The simulated backend: GPUs from a YAML topology, for clusters without GPUs, demos and tests.

Topology file (``version: 1``)::

    version: 1
    node: sim-node            # optional; seeds the deterministic UUIDs
    slices: 7                 # optional; S for mps/whole GPUs that do not say (1..1000: milli-GPU allowed here)
    gpus:
      - product: H100-80GB    # a catalogue product name
        mode: mig             # mig | mps | whole
        uuid: GPU-...         # optional; default derived from node and index
        instances:            # mig only: profile and memory-slice start (uuid optional)
          - {profile: 3g.40gb, start: 0}
      - {product: H100-80GB, mode: mps, slices: 7}

Every error names the field (``gpus[1].instances[0].start: ...``). With no file the built-in node has
two H100-80GB: GPU 0 in MIG mode with 2g.20gb@0 + 1g.10gb@2 + 1g.10gb@3 + 3g.40gb@4, GPU 1 in MPS mode.
UUIDs are derived from the node name and position (uuid5), so the same file gives the same ids.

Faults are injected with ``inject_fault``/``recover``; layouts change through ``apply_targets`` or
``change_layout``, which, like the real backend, wait while any id of the GPU is allocated. With an
``MpsSupervisor`` (pointed at ``mps_standin.py``) its MPS GPUs are healthy only while their
stand-in daemons answer, exactly as on a real node. A GPU's processes (what NVML's running-process
lists would show, for the budget watch) are set with ``set_processes``.
"""

from __future__ import annotations

import logging
import threading
import uuid as uuidlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from deviceplugin.backend import GpuProcess, GpuTarget, HealthEvent, MigPlacement
from deviceplugin.dcgm import simulated_gi_id
from deviceplugin.errors import TopologyError
from deviceplugin.mps_supervisor import MpsSupervisor
from gpuslice.catalogue import PRODUCTS, Product
from gpuslice.errors import CatalogueError
from gpuslice.model import GPU_MODES, Gpu, MigInstance, validate_mig_layout

log = logging.getLogger(__name__)

DEFAULT_NODE = "sim-node"
DEFAULT_SLICES = 7
SIM_MAX_SLICES = 1000
_NAMESPACE = uuidlib.UUID("6f1c1f0e-3b7a-4f4e-9a59-5a1c2d9e0b11")
_TOP_KEYS = {"version", "node", "slices", "gpus"}
_GPU_KEYS = {"product", "mode", "uuid", "slices", "instances", "memory_mib"}
_INSTANCE_KEYS = {"profile", "start", "uuid"}


def sim_gpu_uuid(node: str, index: int) -> str:
    return f"GPU-{uuidlib.uuid5(_NAMESPACE, f'{node}/gpu/{index}')}"


def sim_mig_uuid(gpu_uuid: str, profile: str, start: int) -> str:
    return f"MIG-{uuidlib.uuid5(_NAMESPACE, f'{gpu_uuid}/mig/{profile}@{start}')}"


@dataclass(frozen=True, slots=True)
class Topology:
    """A validated simulated node."""

    node: str
    gpus: tuple[Gpu, ...]


def _fail(where: str, message: str) -> TopologyError:
    return TopologyError(f"{where}: {message}")


def _int(value: Any, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _fail(where, f"must be an integer in {low}..{high}, got {value!r}")
    return value


def _mapping(value: Any, where: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(where, f"must be a mapping, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in keys)
    if unknown:
        raise _fail(f"{where}.{unknown[0]}", f"unknown field; known: {', '.join(sorted(keys))}")
    return value


def build_instances(prod: Product, gpu_uuid: str, layout: list[tuple[str, int, str | None]],
                    where: str) -> tuple[MigInstance, ...]:
    """MIG instances from (profile, start, uuid-or-None), validated against the catalogue geometry."""
    instances = []
    for n, (profile_name, start, mig_uuid) in enumerate(layout):
        try:
            prof = prod.profile(profile_name)
        except CatalogueError as exc:
            raise _fail(f"{where}[{n}].profile", str(exc)) from None
        inst = MigInstance(mig_uuid or sim_mig_uuid(gpu_uuid, prof.name, start), prof.name, start,
                           prof.compute_slices, prof.memory_mib)
        instances.append(replace(inst, gi=simulated_gi_id(prod.name, inst)))  # as NVML numbers them
    try:
        validate_mig_layout(prod.name, instances, where=f"GPU {gpu_uuid}")
    except CatalogueError as exc:
        raise _fail(where, str(exc)) from None
    return tuple(sorted(instances, key=lambda i: i.start))


def parse_topology(data: Any, *, source: str = "topology", default_slices: int = DEFAULT_SLICES) -> Topology:
    """Validate a loaded YAML document; every refusal names the field."""
    doc = _mapping(data, source, _TOP_KEYS)
    if doc.get("version", 1) != 1:
        raise _fail(f"{source}: version", f"only version 1 is supported, got {doc.get('version')!r}")
    node = doc.get("node", DEFAULT_NODE)
    if not isinstance(node, str) or not node:
        raise _fail(f"{source}: node", f"must be a non-empty string, got {node!r}")
    slices = _int(doc.get("slices", default_slices), f"{source}: slices", 1, SIM_MAX_SLICES)
    raw_gpus = doc.get("gpus")
    if not isinstance(raw_gpus, list) or not raw_gpus:
        raise _fail(f"{source}: gpus", "must be a non-empty list")
    seen: dict[str, str] = {}
    gpus = []
    for index, raw in enumerate(raw_gpus):
        where = f"{source}: gpus[{index}]"
        entry = _mapping(raw, where, _GPU_KEYS)
        name = entry.get("product")
        if name not in PRODUCTS:
            raise _fail(f"{where}.product", f"unknown GPU product {name!r}; known: {', '.join(PRODUCTS)}")
        prod = PRODUCTS[name]
        mode = entry.get("mode", "mig" if "instances" in entry else "mps")
        if mode not in GPU_MODES:
            raise _fail(f"{where}.mode", f"must be one of {', '.join(GPU_MODES)}, got {mode!r}")
        gpu_uuid = entry.get("uuid", sim_gpu_uuid(node, index))
        if not isinstance(gpu_uuid, str) or not gpu_uuid.startswith("GPU-") or ":" in gpu_uuid:
            raise _fail(f"{where}.uuid", f"must look like GPU-<uuid> without ':', got {gpu_uuid!r}")
        memory = entry.get("memory_mib", prod.memory_mib)
        if memory is None:
            raise _fail(f"{where}.memory_mib", f"product {name} has no known memory size; give memory_mib")
        memory = _int(memory, f"{where}.memory_mib", 1, 10**7)
        instances: tuple[MigInstance, ...] = ()
        if mode == "mig":
            raw_instances = entry.get("instances", [])
            if not isinstance(raw_instances, list):
                raise _fail(f"{where}.instances", "must be a list")
            layout = []
            for n, raw_inst in enumerate(raw_instances):
                iw = f"{where}.instances[{n}]"
                inst = _mapping(raw_inst, iw, _INSTANCE_KEYS)
                start = _int(inst.get("start"), f"{iw}.start", 0, 7)
                mig_uuid = inst.get("uuid")
                if mig_uuid is not None and (not isinstance(mig_uuid, str) or not mig_uuid.startswith("MIG-")):
                    raise _fail(f"{iw}.uuid", f"must look like MIG-<uuid>, got {mig_uuid!r}")
                layout.append((str(inst.get("profile")), start, mig_uuid))
            instances = build_instances(prod, gpu_uuid, layout, f"{where}.instances")
            gpu_slices = sum(i.compute_slices for i in instances)
        else:
            if "instances" in entry:
                raise _fail(f"{where}.instances", f"only mig GPUs have instances (mode is {mode})")
            gpu_slices = _int(entry.get("slices", slices), f"{where}.slices", 1, SIM_MAX_SLICES)
        for owner, field in [(gpu_uuid, f"{where}.uuid"),
                             *((i.uuid, f"{where}.instances[{n}].uuid") for n, i in enumerate(instances))]:
            if owner in seen:
                raise _fail(field, f"duplicate UUID {owner} (also at {seen[owner]})")
            seen[owner] = field
        try:
            gpus.append(Gpu(gpu_uuid, index, prod.name, memory, mode, gpu_slices, instances=instances))
        except CatalogueError as exc:
            raise _fail(where, str(exc)) from None
    return Topology(node, tuple(gpus))


def load_topology(path: str | Path | None, *, default_slices: int = DEFAULT_SLICES) -> Topology:
    """Read and validate a topology file; ``None`` gives the built-in node."""
    if path is None:
        return builtin_topology(default_slices=default_slices)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TopologyError(f"{path}: cannot read topology: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TopologyError(f"{path}: not valid YAML: {exc}") from exc
    return parse_topology(data, source=str(path), default_slices=default_slices)


def builtin_topology(node: str = DEFAULT_NODE, *, default_slices: int = DEFAULT_SLICES) -> Topology:
    """Two H100-80GB: GPU 0 MIG 2g.20gb@0 + 1g.10gb@2 + 1g.10gb@3 + 3g.40gb@4 (all 7 slices), GPU 1 MPS."""
    return parse_topology({
        "version": 1, "node": node, "slices": default_slices,
        "gpus": [
            {"product": "H100-80GB", "mode": "mig", "instances": [
                {"profile": "2g.20gb", "start": 0}, {"profile": "1g.10gb", "start": 2},
                {"profile": "1g.10gb", "start": 3}, {"profile": "3g.40gb", "start": 4}]},
            {"product": "H100-80GB", "mode": "mps"},
        ]}, source="built-in topology")


class SimulatedBackend:
    """GPUs from a topology; health from injected faults and (optionally) stand-in MPS daemons."""

    name = "simulated"

    def __init__(self, topology: Topology | None = None, *, mps: MpsSupervisor | None = None) -> None:
        topo = topology or builtin_topology()
        self.node = topo.node
        self._lock = threading.RLock()
        self._gpus: dict[str, Gpu] = {g.uuid: g for g in topo.gpus}
        self._faults: dict[str, tuple[str, str | None, str]] = {}  # owner -> (gpu, instance, reason)
        self._mps = mps
        self._emit: Callable[[HealthEvent], None] = lambda _event: None
        self._watching = False
        self._processes: dict[str, tuple[GpuProcess, ...]] = {}
        if mps is not None:
            mps.set_gpus(g.uuid for g in topo.gpus if g.mode == "mps")

    @property
    def mps(self) -> MpsSupervisor | None:
        """The supervisor of this backend's MPS daemons (the app sets their limits through it)."""
        return self._mps

    def discover(self) -> tuple[Gpu, ...]:
        with self._lock:
            gpus = sorted(self._gpus.values(), key=lambda g: g.index)
            faults = dict(self._faults)
        return tuple(replace(g, healthy=g.uuid not in faults and self._daemon_ok(g)) for g in gpus)

    def _daemon_ok(self, gpu: Gpu) -> bool:
        return gpu.mode != "mps" or self._mps is None or self._mps.is_up(gpu.uuid)

    def unhealthy(self) -> Mapping[str, str]:
        with self._lock:
            out = {owner: reason for owner, (_g, _i, reason) in self._faults.items()}
            gpus = list(self._gpus.values())
        for gpu in gpus:
            if not self._daemon_ok(gpu) and gpu.uuid not in out and self._mps is not None:
                out[gpu.uuid] = self._mps.reason(gpu.uuid) or "MPS daemon not answering"
        return out

    # ---- faults ----------------------------------------------------------------------------------

    def _owner(self, gpu_uuid: str, instance_uuid: str | None) -> str:
        gpu = self._gpus.get(gpu_uuid)
        if gpu is None:
            raise TopologyError(f"no simulated GPU {gpu_uuid}; known: {', '.join(sorted(self._gpus))}")
        if instance_uuid is not None and not any(i.uuid == instance_uuid for i in gpu.instances):
            raise TopologyError(f"GPU {gpu_uuid} has no MIG instance {instance_uuid}")
        return instance_uuid or gpu_uuid

    def inject_fault(self, gpu_uuid: str, reason: str, instance_uuid: str | None = None) -> HealthEvent | None:
        """Mark a GPU (or one MIG instance) unhealthy; returns the event emitted, or None if it already was."""
        with self._lock:
            owner = self._owner(gpu_uuid, instance_uuid)
            if owner in self._faults:
                return None
            self._faults[owner] = (gpu_uuid, instance_uuid, reason)
        event = HealthEvent(gpu_uuid, False, reason, instance_uuid)
        self._emit(event)
        return event

    def recover(self, gpu_uuid: str, instance_uuid: str | None = None) -> HealthEvent | None:
        """Clear an injected fault; returns the event emitted, or None if there was no fault."""
        with self._lock:
            owner = self._owner(gpu_uuid, instance_uuid)
            fault = self._faults.pop(owner, None)
        if fault is None:
            return None
        event = HealthEvent(gpu_uuid, True, f"recovered (was: {fault[2]})", instance_uuid)
        self._emit(event)
        return event

    def watch_health(self, emit: Callable[[HealthEvent], None]) -> None:
        self._emit = emit
        if self._mps is not None and not self._watching:
            self._mps.start(emit)
        self._watching = True

    # ---- changes ---------------------------------------------------------------------------------

    def apply_targets(self, targets: Mapping[str, GpuTarget], allocated: frozenset[str]) -> list[str]:
        """Apply each named GPU's target; GPUs not named keep their state. Waits on allocated GPUs."""
        messages = []
        with self._lock:
            unknown = sorted(set(targets) - set(self._gpus))
            messages += [f"GPU {u}: no such simulated GPU; target ignored" for u in unknown]
            for gpu_uuid, target in targets.items():
                gpu = self._gpus.get(gpu_uuid)
                if gpu is None:
                    continue
                message = self._apply_one(gpu, target, allocated)
                if message:
                    messages.append(message)
            mps_gpus = [g.uuid for g in self._gpus.values() if g.mode == "mps"]
        if self._mps is not None:
            self._mps.set_gpus(mps_gpus)
        return messages

    def would_change(self, gpu: Gpu, target: GpuTarget) -> bool:
        """Whether ``apply_targets`` would change this GPU when it is idle."""
        with self._lock:
            current = self._gpus.get(gpu.uuid)
            if current is None:
                return False
            try:
                return self._target_gpu(current, target) is not None
            except TopologyError:
                return False

    def change_layout(self, gpu_uuid: str, layout: tuple[MigPlacement, ...],
                      allocated: frozenset[str]) -> list[str]:
        """Put a GPU in MIG mode with exactly this layout (or report why it waits or is refused)."""
        return self.apply_targets({gpu_uuid: GpuTarget("mig", 0, tuple(layout))}, allocated)

    def _apply_one(self, gpu: Gpu, target: GpuTarget, allocated: frozenset[str]) -> str | None:
        try:
            new = self._target_gpu(gpu, target)
        except TopologyError as exc:
            return f"GPU {gpu.uuid}: refused: {exc}"
        if new is None:
            return None
        before = _describe(gpu)
        after = _describe(new)
        busy = sorted(sid for sid in gpu.slice_ids() if sid in allocated)
        if busy:
            return (f"GPU {gpu.uuid}: change waits ({before} -> {after}): {len(busy)} of its ids are allocated "
                    f"({', '.join(busy[:3])}{', ...' if len(busy) > 3 else ''})")
        self._gpus[gpu.uuid] = new
        gone = {i.uuid for i in gpu.instances} - {i.uuid for i in new.instances}
        for owner in gone:
            self._faults.pop(owner, None)
        return f"GPU {gpu.uuid}: changed: {before} -> {after}"

    def _target_gpu(self, gpu: Gpu, target: GpuTarget) -> Gpu | None:
        if target.mode == "mig":
            if target.mig_layout is None:
                if gpu.mode == "mig":
                    return None
                raise TopologyError("target mig needs a mig_layout for a GPU that is not in MIG mode")
            layout = [(p, s, _existing(gpu, p, s)) for p, s in target.mig_layout]
            instances = build_instances(PRODUCTS[gpu.product], gpu.uuid, layout, "mig_layout")
            if gpu.mode == "mig" and instances == gpu.instances:
                return None
            return replace(gpu, mode="mig", slices=sum(i.compute_slices for i in instances), instances=instances)
        if not 1 <= target.slices <= SIM_MAX_SLICES:
            raise TopologyError(f"S must be in 1..{SIM_MAX_SLICES}, got {target.slices}")
        if (gpu.mode, gpu.slices) == (target.mode, target.slices):
            return None
        return replace(gpu, mode=target.mode, slices=target.slices, instances=())

    # ---- processes ---------------------------------------------------------------------------------

    def set_processes(self, gpu_uuid: str, processes: tuple[GpuProcess, ...]) -> None:
        """What NVML's running-process lists show for this GPU from now on."""
        with self._lock:
            self._owner(gpu_uuid, None)
            self._processes[gpu_uuid] = tuple(processes)

    def gpu_processes(self, gpu_uuid: str) -> tuple[GpuProcess, ...]:
        with self._lock:
            self._owner(gpu_uuid, None)
            return self._processes.get(gpu_uuid, ())

    def close(self) -> None:
        if self._mps is not None:
            self._mps.close()


def _existing(gpu: Gpu, profile: str, start: int) -> str | None:
    """Keep an instance's UUID when the same profile stays at the same start."""
    return next((i.uuid for i in gpu.instances if (i.profile, i.start) == (profile, start)), None)


def _describe(gpu: Gpu) -> str:
    if gpu.mode == "mig":
        return "mig[" + ", ".join(f"{i.profile}@{i.start}" for i in gpu.instances) + "]"
    return f"{gpu.mode}(S={gpu.slices})"
