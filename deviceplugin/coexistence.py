"""Refusing GPUs that another resource already advertises (DESIGN 5, coexistence).

If NVIDIA's plugin (``nvidia.com/gpu``, ``nvidia.com/mig-*``) or anything else already hands out a GPU,
advertising its slices too would let kubelet give the same GPU to two pods under two names. Kubelet's
PodResources ``GetAllocatableResources`` lists every resource's device ids; any id that names one of
our GPUs or MIG instances (the UUID itself, ``<uuid>::<n>``, GKE's ``<uuid>/vgpu<n>``, the old
``MIG-GPU-<uuid>/<gi>/<ci>``, or a bare index under an ``nvidia.com/`` resource) makes us refuse it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpuslice.model import Gpu

_INDEX = re.compile(r"^(0|[1-9][0-9]*)$")
_MIG_INDEX = re.compile(r"^(0|[1-9][0-9]*):(0|[1-9][0-9]*)$")


@dataclass(frozen=True, slots=True)
class Refusal:
    """One GPU we will not advertise: which resource already has it, under which device id."""

    gpu_uuid: str
    gpu_index: int
    resource: str
    device_id: str

    @property
    def message(self) -> str:
        return (f"GPU {self.gpu_index} ({self.gpu_uuid}) is not advertised as slices: resource {self.resource} "
                f"already advertises it as device {self.device_id!r}; two resources on one GPU would let "
                f"kubelet give it to two pods")


def _base(device_id: str) -> str:
    """Strip replica suffixes: ``<id>::<n>`` and ``<id>/vgpu<n>``."""
    base = device_id.split("::", 1)[0]
    return re.sub(r"/vgpu[0-9]+$", "", base)


def owner_gpu(device_id: str, resource: str, gpus: Sequence[Gpu]) -> Gpu | None:
    """The GPU of ours that ``device_id`` (advertised under ``resource``) names, if any."""
    base = _base(device_id)
    for gpu in gpus:
        if base == gpu.uuid or any(base == inst.uuid for inst in gpu.instances):
            return gpu
        if base.startswith(f"MIG-{gpu.uuid}/"):
            return gpu
    if resource.startswith("nvidia.com/"):
        index = None
        if _INDEX.match(base):
            index = int(base)
        elif _MIG_INDEX.match(base):
            index = int(base.split(":", 1)[0])
        if index is not None:
            return next((g for g in gpus if g.index == index), None)
    return None


def find_refusals(gpus: Sequence[Gpu], allocatable: Iterable[tuple[str, Iterable[str]]],
                  own_resource: str) -> dict[str, Refusal]:
    """GPU uuid -> refusal, for every GPU another resource advertises (first such id wins)."""
    out: dict[str, Refusal] = {}
    for resource, device_ids in allocatable:
        if resource == own_resource:
            continue
        for device_id in device_ids:
            gpu = owner_gpu(device_id, resource, gpus)
            if gpu is not None and gpu.uuid not in out:
                out[gpu.uuid] = Refusal(gpu.uuid, gpu.index, resource, device_id)
    return out
