"""Which per-client cap each MPS GPU's daemon enforces, kept in step with the pods on the node.

The MPS server serves one UID, so all slice pods on an ``mps`` GPU are clients of one server and
the daemon enforces one per-client cap per GPU (``deviceplugin.mps``). That cap is the share of the
**largest** pod that holds ids on the GPU: admitted (PodResources), stamped, just allocated, or
promised to a pending assignment; one slice when none does. Consequences, said plainly:

* all pods on a GPU one size (replicas of one Deployment, the common case): the daemon's cap is
  each pod's exact share, and a pod cannot raise its limits by changing its env;
* mixed sizes on one GPU: the daemon caps every client at the largest pod's share. A smaller pod is
  held to its own share by the ``CUDA_MPS_*`` env Allocate gives it, which the client honours and
  which the pod cannot override in its spec's env (the slice-pod admission policy refuses it); a
  process that rewrites its own environment before CUDA starts reaches the largest share, never
  more. A pod's processes together are held to its share by the budget watch
  (``deviceplugin.budget``).

This is the default chosen from figures (``bench/RESULTS.md``, "MPS per-pod caps"): one share size
per MPS GPU would make the daemon's cap every pod's exact share, at a measured packing cost.

``refresh`` recomputes the caps from the pod cache (on the event loop, no I/O) and hands them to the
supervisor, whose thread sends the daemon commands: a larger pod raises the cap early when its
assignment is seen, a pod leaving lowers it (new clients only; running ones keep theirs).
``before_allocate`` makes sure the cap covers a pod *before* Allocate answers it: its container, and
so its MPS client, starts only afterwards. When the daemon does not take the cap in time Allocate
fails (the pod is not admitted) rather than start a pod under a smaller cap than its share.

Without the Kubernetes API (``--no-kube``) the plugin never sees a pod leave, so a GPU's cap only
rises, to the largest pod allocated since the plugin started. Without a supervised daemon (the
``--read-only`` NVML backend, or a simulated node without one) nothing is enforced beyond the env.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge

from deviceplugin.assignments import AssignmentBook
from deviceplugin.mps import LimitsMode, MpsLimits, mps_limits
from deviceplugin.mps_supervisor import MpsSupervisor
from gpuslice import ids
from gpuslice.errors import DeviceIdError
from gpuslice.model import NodeInventory
from gpuslice.placement import Placement

log = logging.getLogger(__name__)

DEFAULT_WAIT_S = 10.0
"""How long Allocate waits for a daemon to take a raised cap before it refuses the pod."""


def held_groups(book: AssignmentBook) -> Iterator[tuple[str, ...]]:
    """The id sets of every holder: admitted pods, stamped live pods, Allocate notes, pending assignments."""
    yield from book.admitted.values()
    for pod in book.pods.values():
        if pod.live and pod.allocated_ids:
            yield pod.allocated_ids
    for note in book.local:
        yield tuple(note)
    for pod in book.pending():
        if pod.assignment_ids:
            yield pod.assignment_ids


def largest_shares(inventory: NodeInventory, groups: Iterable[Iterable[str]]) -> dict[str, int]:
    """MPS GPU uuid -> the most slices any one holder has on it (1 when none)."""
    out = {g.uuid: 1 for g in inventory.gpus if g.mode == "mps"}
    for group in groups:
        counts: dict[str, int] = {}
        for sid in group:
            try:
                owner = ids.owner_of(sid)
            except DeviceIdError:
                continue
            if owner in out:
                counts[owner] = counts.get(owner, 0) + 1
        for owner, n in counts.items():
            out[owner] = max(out[owner], n)
    return out


def wanted_limits(inventory: NodeInventory, shares: dict[str, int], limits_mode: LimitsMode) -> dict[str, MpsLimits]:
    """The daemon cap of each MPS GPU for its largest share (clamped to 1..S)."""
    out: dict[str, MpsLimits] = {}
    for gpu in inventory.gpus:
        if gpu.mode == "mps" and gpu.uuid in shares:
            out[gpu.uuid] = mps_limits(gpu, min(max(shares[gpu.uuid], 1), gpu.slices), limits_mode)
    return out


class MpsLimitKeeper:
    """Keeps each MPS daemon's cap at the largest share on its GPU; owned by the event loop."""

    def __init__(self, supervisor: MpsSupervisor | None, inventory: Callable[[], NodeInventory],
                 book: Callable[[], AssignmentBook | None], limits_mode: LimitsMode, *,
                 registry: CollectorRegistry | None = None, wait_s: float = DEFAULT_WAIT_S) -> None:
        self.supervisor = supervisor
        self._inventory = inventory
        self._book = book
        self.limits_mode: LimitsMode = limits_mode
        self.wait_s = wait_s
        self._floor: dict[str, int] = {}  # without a pod cache: the largest share allocated so far
        self.failures: Counter | None = None
        self.cap: Gauge | None = None
        if registry is not None:
            self.failures = Counter(
                "gpu_slice_mps_limit_failures",
                "Attempts to set a GPU's per-client limits in its MPS daemon that failed (retried with backoff).",
                ["gpu_uuid"], registry=registry)
            self.cap = Gauge(
                "gpu_slice_mps_limit_slices",
                "The share, in slices, at which the GPU's MPS daemon caps each client now (the largest pod's).",
                ["gpu_uuid"], registry=registry)
        if supervisor is not None:
            supervisor.observe_limits(self._observed)

    def wanted(self) -> dict[str, MpsLimits]:
        inventory = self._inventory()
        book = self._book()
        shares = largest_shares(inventory, held_groups(book) if book is not None else ())
        for uuid, k in self._floor.items():
            if uuid in shares:
                shares[uuid] = max(shares[uuid], k)
        return wanted_limits(inventory, shares, self.limits_mode)

    def refresh(self) -> None:
        """Recompute every MPS GPU's cap from the pod cache and hand it to the supervisor (no I/O)."""
        if self.supervisor is not None:
            self.supervisor.set_limits(self.wanted())

    async def before_allocate(self, placement: Placement) -> str | None:
        """Make the GPU's daemon cap cover ``placement`` before Allocate answers; ``None`` when it does,
        else why not. The ids are already noted in the book (``PluginState.allocate``)."""
        if placement.mode != "mps" or self.supervisor is None:
            return None
        gpu, k = placement.gpu, len(placement.slice_ids)
        if self._book() is None:
            self._floor[gpu] = max(self._floor.get(gpu, 1), k)
        self.refresh()
        if self.supervisor.covers(gpu, k):
            return None
        return await asyncio.to_thread(self.supervisor.wait_limits, gpu, k, self.wait_s)

    def _observed(self, uuid: str, applied: MpsLimits | None, error: str) -> None:
        """From the supervisor thread: count failures, export the cap in force."""
        if applied is None:
            if self.failures is not None:
                self.failures.labels(gpu_uuid=uuid).inc()
            return
        if self.cap is not None:
            self.cap.labels(gpu_uuid=uuid).set(applied.slices)
