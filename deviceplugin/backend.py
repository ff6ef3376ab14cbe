"""The seam between the device plugin and the GPUs: a backend discovers GPUs and reports changes.

Two implementations exist: ``nvml`` (nvidia-ml-py) and ``simulated`` (a YAML topology). Everything
above this seam works on ``gpuslice`` values only, so it is tested with the simulated backend and the
NVML backend is tested against a fake at the nvidia-ml-py seam.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gpuslice.model import Gpu, GpuMode


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """A GPU (or one MIG instance of it) turned unhealthy or recovered, and why."""

    gpu_uuid: str
    healthy: bool
    reason: str
    instance_uuid: str | None = None


@dataclass(frozen=True, slots=True)
class GpuTarget:
    """What the node config asks of one GPU: its mode, S, and (mig) the wanted layout if any."""

    mode: GpuMode
    slices: int


class Backend(Protocol):
    """Discovery and health of the node's GPUs.

    ``discover`` returns the GPUs as they are now, in the modes the config asks for where the
    backend has made them so; a backend never changes a GPU's mode, S or MIG layout while any of its
    ids is allocated: ``apply_targets`` receives the ids in use and answers which changes wait.
    """

    name: str

    def discover(self) -> tuple[Gpu, ...]: ...

    def apply_targets(self, targets: dict[str, GpuTarget], allocated: frozenset[str]) -> list[str]:
        """Bring GPUs to their targets where nothing is allocated; return messages for changes that wait."""
        ...

    def watch_health(self, emit: Callable[[HealthEvent], None]) -> None:
        """Start watching health (critical XIDs, MPS daemon liveness); call ``emit`` on every change."""
        ...

    def close(self) -> None: ...
