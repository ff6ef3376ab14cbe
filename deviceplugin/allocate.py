"""Building kubelet's ``ContainerAllocateResponse`` for one valid placement.

Devices are injected by CDI names or by NVIDIA's volume-mount list, not by env, because a pod can
override its env (DESIGN 3); the env-only strategy exists as an explicit option for runtimes with
neither. With CDI names the answer also sets ``NVIDIA_VISIBLE_DEVICES=void``: every CUDA image sets
it to ``all``, and where the NVIDIA runtime still reads that variable (legacy or ``jit-cdi`` mode with
``accept-nvidia-visible-devices-envvar-when-unprivileged = true``, the toolkit's default) the
container would get every GPU. ``void`` beats the image's value; a pod's own env comes after ours
and would win, so the shipped admission policy refuses slice pods that set it, and the README lists
the toolkit setting that closes the rest. A MIG placement exposes its MIG UUID, MPS and whole
placements the GPU UUID. MPS placements also get the client settings of ``deviceplugin.mps`` (pipe
directory, ``/dev/shm``, and the pod's own share as ``CUDA_MPS_*`` env: information a pod can
override, since the cap a client cannot raise is set in the GPU's MPS daemon before Allocate
answers, see ``deviceplugin.mps_limits``), and every placement gets ``GPU_SLICE_COUNT``,
``GPU_SLICE_FRACTION`` and ``GPU_SLICE_MEMORY_BYTES`` so an LLM
server can size its KV cache and batch without querying the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplugin.assignments import slice_fraction
from deviceplugin.mps import mps_client_settings
from deviceplugin.settings import Injection
from gpuslice.model import NodeInventory
from gpuslice.placement import Placement

VOLUME_MOUNT_ROOT = "/var/run/nvidia-container-devices"
VOLUME_MOUNT_HOST_PATH = "/dev/null"
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
VISIBLE_NONE = "void"
"""The NVIDIA runtime's value for "no GPU through this variable" (devices come by CDI only)."""
ENV_COUNT = "GPU_SLICE_COUNT"
ENV_FRACTION = "GPU_SLICE_FRACTION"
ENV_MEMORY = "GPU_SLICE_MEMORY_BYTES"
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class Injector:
    """How devices reach the container, fixed at start-up from settings."""

    mode: Injection = "cdi"
    cdi_vendor: str = "nvidia.com"
    cdi_class: str = "gpu"
    mps_root: Path = Path("/run/gpu-slice/mps")
    mps_memory_only: bool = False


def device_uuids(placement: Placement) -> tuple[str, ...]:
    """The UUIDs the container runtime must expose: the MIG instance, else each GPU."""
    return (placement.instance,) if placement.instance is not None else placement.gpus


def format_fraction(value: Fraction) -> str:
    """A short decimal (``0.428571``), easy for any language's float parser."""
    text = f"{float(value):.6f}".rstrip("0").rstrip(".")
    return text or "0"


def build_response(placement: Placement, inventory: NodeInventory,
                   injector: Injector) -> pb.ContainerAllocateResponse:
    """The answer for one container: devices, MPS settings, and the GPU_SLICE_* sizing envs."""
    resp = pb.ContainerAllocateResponse()
    uuids = device_uuids(placement)
    if injector.mode == "cdi":
        resp.envs[VISIBLE_DEVICES] = VISIBLE_NONE
        for uuid in uuids:
            resp.cdi_devices.add(name=f"{injector.cdi_vendor}/{injector.cdi_class}={uuid}")
    elif injector.mode == "volume-mounts":
        resp.envs[VISIBLE_DEVICES] = VOLUME_MOUNT_ROOT
        for uuid in uuids:
            resp.mounts.add(container_path=f"{VOLUME_MOUNT_ROOT}/{uuid}", host_path=VOLUME_MOUNT_HOST_PATH,
                            read_only=True)
    else:
        resp.envs[VISIBLE_DEVICES] = ",".join(uuids)
    if placement.mode == "mps":
        gpu = inventory.gpu(placement.gpu)
        envs, mounts = mps_client_settings(
            gpu, len(placement.slice_ids), injector.mps_root,
            "memory-only" if injector.mps_memory_only else "memory-and-threads")
        for key, value in envs.items():
            resp.envs[key] = value
        for mount in mounts:
            resp.mounts.add(container_path=mount.container_path, host_path=mount.host_path,
                            read_only=mount.read_only)
    resp.envs[ENV_COUNT] = str(len(placement.slice_ids))
    resp.envs[ENV_FRACTION] = format_fraction(slice_fraction(inventory, placement))
    resp.envs[ENV_MEMORY] = str(placement.memory_mib * MIB)
    return resp
