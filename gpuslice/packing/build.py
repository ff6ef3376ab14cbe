"""Building the packing state from the slice model, as the extender and the simulator both must.

One unit row per MPS or whole GPU and per MIG instance; a unit's free slices come from the
inventory's ``used`` set (the counting rule), so the state and the object model never disagree.
Requests become ``PackRequest``: k <= S on one unit, k = m*S as m whole units.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gpuslice.model import NodeInventory
from gpuslice.packing.state import KIND_MIG, KIND_MPS, KIND_WHOLE, ClusterState, NodeSpec, PackRequest, UnitSpec
from gpuslice.requests import SliceRequest
from gpuslice.rules import DEFAULT_MEMORY_TOLERANCE, gpus_for

_KIND = {"mps": KIND_MPS, "whole": KIND_WHOLE, "mig": KIND_MIG}


def units_of(node_index: int, inventory: NodeInventory) -> list[UnitSpec]:
    """The unit rows of one node, with free slices taken from ``inventory.used``."""
    used = inventory.used
    units: list[UnitSpec] = []
    for gpu in inventory.gpus:
        if gpu.mode == "mig":
            for inst in gpu.instances:
                busy = any(sid in used for sid in inst.slice_ids())
                units.append(UnitSpec(node_index, gpu.index, KIND_MIG, inst.compute_slices, inst.memory_mib,
                                      free=0 if busy else inst.compute_slices, usable=gpu.schedulable,
                                      gpu=gpu.uuid, instance=inst.uuid))
            continue
        taken = sum(1 for sid in gpu.slice_ids() if sid in used)
        free = gpu.slices - taken
        if gpu.mode == "whole" and taken:
            free = 0
        units.append(UnitSpec(node_index, gpu.index, _KIND[gpu.mode], gpu.slices, gpu.memory_mib, free=free,
                              usable=gpu.schedulable, gpu=gpu.uuid))
    return units


def state_from_inventories(nodes: Sequence[tuple[NodeSpec, NodeInventory]], *, slices_per_gpu: int,
                           allow_mps_multi: bool = False,
                           memory_tolerance: float = DEFAULT_MEMORY_TOLERANCE) -> ClusterState:
    """The packing state of a cluster given each node's spec and slice inventory."""
    units: list[UnitSpec] = []
    for v, (_, inventory) in enumerate(nodes):
        units.extend(units_of(v, inventory))
    return ClusterState([spec for spec, _ in nodes], units, slices_per_gpu=slices_per_gpu,
                        allow_mps_multi=allow_mps_multi, memory_tolerance=memory_tolerance)


def pack_request(request: SliceRequest | None, *, slices_per_gpu: int, cpu_milli: int = 0, memory_mib: int = 0,
                 products: frozenset[str] | None = None, owner: str = "", uid: str = "") -> PackRequest:
    """A pod in packing terms; ``request`` None is a CPU-only pod.

    The memory floor is the pod's total; spread over m whole GPUs each must hold its share.
    """
    if request is None:
        return PackRequest(cpu_milli=cpu_milli, memory_mib=memory_mib, products=products, owner=owner, uid=uid)
    gpus, per = gpus_for(request.slices, slices_per_gpu)
    floor = 0 if request.memory_mib is None else math.ceil(request.memory_mib / gpus)
    return PackRequest(cpu_milli=cpu_milli, memory_mib=memory_mib, gpus=gpus, slices=per, gpu_memory_mib=floor,
                       products=products, isolation=request.isolation, owner=owner, uid=uid)
