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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from gpuslice.model import Gpu, GpuMode, MigInstance

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
    ``None`` where the driver cannot tell). ``pod_uid`` is set only where the backend itself knows the
    pod (the simulated backend's clients); otherwise the budget watch finds it through cgroups."""

    pid: int
    used_mib: int | None
    mps_client: bool
    pod_uid: str | None = None


@dataclass(frozen=True, slots=True)
class UnitUsage:
    """What the hardware reports for one MIG instance now: framebuffer memory in use (MiB), and the
    ratio (0..1) of time its graphics engine and its memory interface were active since the previous
    reading; ``None`` where the GPU cannot tell (activity needs NVML's GPU performance monitoring,
    Hopper and later)."""

    memory_used_mib: int | None
    gr_active: float | None = None
    dram_active: float | None = None


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

    def instance_usage(self) -> Mapping[str, UnitUsage]:
        """Each advertised MIG instance's usage now, by MIG UUID (read at scrape time from the metrics
        thread; an instance that cannot be read is left out). A MIG pod owns its instance, so these are
        its pod's figures."""
        ...

    def close(self) -> None:
        """Stop watching, release NVML. MPS daemons are left running unless this process owns them."""
        ...


@dataclass(frozen=True, slots=True)
class RecutOutcome:
    """What a MIG re-cut did on one GPU: the MIG UUIDs destroyed and created, in order."""

    destroyed: tuple[str, ...]
    created: tuple[str, ...]


@runtime_checkable
class MigRecutter(Protocol):
    """A backend that can re-cut a MIG GPU's free placement slots (DESIGN 2: a MIG layout changes only
    in free slots). ``recut_mig`` destroys the named free instances and creates the named (profile,
    start) ones; it raises ``RecutRefused`` before changing anything when an instance to destroy holds
    one of ``allocated``, the resulting layout breaks the product's rules, or it may not change GPUs,
    and ``RecutFailed`` when the driver stops part-way."""

    def recut_mig(self, gpu_uuid: str, destroy: Sequence[str], create: Sequence[MigPlacement],
                  allocated: frozenset[str]) -> RecutOutcome: ...


def recut_victims(gpu: Gpu | None, gpu_uuid: str, destroy: Sequence[str],
                  allocated: frozenset[str]) -> dict[str, MigInstance]:
    """The one check every backend makes before a re-cut changes anything: the GPU is here and in MIG
    mode, each instance to destroy exists and none holds an id of ``allocated``. Returns the GPU's
    instances by UUID; ``RecutRefused`` says which rule failed."""
    from deviceplugin.errors import RecutRefused

    if gpu is None:
        raise RecutRefused(f"no GPU {gpu_uuid} on this node")
    if gpu.mode != "mig":
        raise RecutRefused(f"GPU {gpu_uuid} is in {gpu.mode} mode, not MIG")
    have = {i.uuid: i for i in gpu.instances}
    unknown = [u for u in destroy if u not in have]
    if unknown:
        raise RecutRefused(f"GPU {gpu_uuid} has no MIG instance {', '.join(unknown)}")
    busy = [u for u in destroy if any(sid in allocated for sid in have[u].slice_ids())]
    if busy:
        raise RecutRefused(f"MIG instance {', '.join(busy)} on GPU {gpu_uuid} holds allocated ids; an instance "
                           "in use is never destroyed")
    return have
