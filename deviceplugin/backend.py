"""The seam between the device plugin and the GPUs: a backend discovers GPUs and reports changes.

Two implementations exist: ``nvml`` (nvidia-ml-py) and ``simulated`` (a YAML topology). Everything
above this seam works on ``gpuslice`` values only, so it is tested with the simulated backend and the
NVML backend is tested against a fake at the nvidia-ml-py seam.

Health has two views that always agree: ``watch_health`` pushes every change as a ``HealthEvent``,
and ``unhealthy()`` answers the current state (for a ListAndWatch resend or a restart of the watch).
A GPU-wide fault shows as ``Gpu.healthy == False`` in ``discover()``; a fault of one MIG instance
(an XID tagged with its GPU-instance id) marks only that instance's ids, so it is visible through
``unhealthy()`` and the event's ``instance_uuid`` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gpuslice.model import Gpu, GpuMode

MigPlacement = tuple[str, int]
"""A wanted MIG instance: (profile name, memory-slice start), e.g. ``("3g.40gb", 0)``."""


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """A GPU (or one MIG instance of it) turned unhealthy or recovered, and why."""

    gpu_uuid: str
    healthy: bool
    reason: str
    instance_uuid: str | None = None


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A compute process on a GPU (host PID): an MPS client or not, and the memory it uses (MiB;
    ``None`` where the driver cannot tell)."""

    pid: int
    used_mib: int | None
    mps_client: bool


@dataclass(frozen=True, slots=True)
class GpuTarget:
    """What the node config asks of one GPU.

    ``slices`` is S for ``mps`` and ``whole`` (ignored for ``mig``, where the instances decide).
    ``mig_layout`` is the wanted MIG layout; ``None`` keeps whatever instances exist. Only the
    simulated backend creates layouts; the NVML backend reports a layout difference and waits.
    """

    mode: GpuMode
    slices: int
    mig_layout: tuple[MigPlacement, ...] | None = None


class Backend(Protocol):
    """Discovery and health of the node's GPUs.

    ``discover`` returns the GPUs as they are now: a MIG-enabled GPU as ``mig`` with its current
    instances, any other GPU as ``mps`` or ``whole`` per its target (the backend's default target
    until ``apply_targets`` names it). A backend never changes a GPU's mode, S or MIG layout while
    any of its ids is allocated: ``apply_targets`` receives the ids in use and says which changes
    wait.
    """

    name: str

    def discover(self) -> tuple[Gpu, ...]: ...

    def apply_targets(self, targets: Mapping[str, GpuTarget], allocated: frozenset[str]) -> list[str]:
        """Bring GPUs (keyed by GPU UUID) to their targets where none of their ids is allocated.

        Returns one human-readable line per GPU whose state differs from its target: what was
        changed, what waits (and on which ids), what a read-only backend would have changed, or
        why a change is not supported. An empty list means every GPU already matches.
        """
        ...

    def watch_health(self, emit: Callable[[HealthEvent], None]) -> None:
        """Start watching health (critical XIDs, MPS daemon liveness); call ``emit`` on every change.

        ``emit`` is called from a backend thread; it must not block for long.
        """
        ...

    def unhealthy(self) -> Mapping[str, str]:
        """Owners (GPU or MIG UUIDs) that are unhealthy now, with the reason; their ids are Unhealthy."""
        ...

    def gpu_processes(self, gpu_uuid: str) -> tuple[GpuProcess, ...]:
        """The compute processes on one GPU now (the budget watch reads it from a worker thread)."""
        ...

    def close(self) -> None:
        """Stop watching, release NVML. MPS daemons are left running unless this process owns them."""
        ...
