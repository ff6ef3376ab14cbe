"""The ``DevicePlugin`` gRPC service (grpc.aio) and the node state its answers come from.

``PluginState`` lives on the event loop: backend health, the pod watch and the stamper change it
through loop callbacks only, so the RPCs read it without locks. The RPCs are thin: they call the pure
functions of ``assignments`` and ``allocate`` and translate domain errors into gRPC statuses here and
nowhere else. ``GetPreferredAllocation`` and ``Allocate`` do no I/O: the stamp that follows an
Allocate is a nudge to the stamper's own task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, Protocol

import grpc

from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from deviceplugin.allocate import Injector, build_response
from deviceplugin.assignments import AssignmentBook, Candidate, check_placement, preferred
from deviceplugin.backend import HealthEvent
from deviceplugin.errors import DevicePluginError, MpsError, PlacementRefused
from deviceplugin.registration import StreamTracker
from gpuslice.errors import GpuSliceError
from gpuslice.model import Gpu, NodeInventory
from gpuslice.placement import Placement

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class RpcObserver(Protocol):
    """Where RPC latencies and outcomes go (``deviceplugin.metrics`` in the app, nothing in unit tests)."""

    def observe_rpc(self, method: str, seconds: float) -> None: ...


class _NoMetrics:
    def observe_rpc(self, method: str, seconds: float) -> None:
        return None


class PluginState:
    """GPUs, health, cordon, refusals and the assignment book of this node; owned by the event loop.

    Every change bumps ``generation`` and wakes ``ListAndWatch``; listeners (inventory publisher)
    are called with the kind of change so the node annotation changes only with layout, health or
    cordon, never per allocation.
    """

    def __init__(self, node: str, *, book: AssignmentBook | None) -> None:
        self.node = node
        self.book = book
        self.gpus: tuple[Gpu, ...] = ()
        self.unhealthy: dict[str, str] = {}  # GPU or MIG uuid -> reason
        self.cordoned: frozenset[str] = frozenset()
        self.refused: dict[str, str] = {}  # GPU uuid -> why another resource owns it
        self.changing: frozenset[str] = frozenset()  # GPUs being reconfigured: withdrawn, Allocate refused
        self.generation = 0
        self._changed = asyncio.Event()
        self._pods_event = asyncio.Event()
        self._inventory: NodeInventory | None = None
        self.listeners: list[Callable[[str], None]] = []
        self.allocations = 0

    # ---- changes

    def _bump(self, kind: str) -> None:
        self.generation += 1
        self._inventory = None
        self._changed.set()
        self._changed = asyncio.Event()
        for listener in list(self.listeners):
            try:
                listener(kind)
            except Exception:
                log.exception("state listener failed on %s change", kind)

    def set_gpus(self, gpus: Iterable[Gpu]) -> bool:
        """A (re)discovered layout; health is kept apart (``set_unhealthy``), so only layout counts here."""
        new = tuple(sorted((replace(g, healthy=True, cordoned=False) for g in gpus), key=lambda g: g.index))
        if new == self.gpus:
            return False
        self.gpus = new
        self._bump("layout")
        return True

    def set_unhealthy(self, unhealthy: Mapping[str, str]) -> bool:
        """Owners (GPU or MIG UUIDs) unhealthy now, with reasons; ``True`` when the set changed."""
        new = dict(unhealthy)
        if set(new) == set(self.unhealthy):
            self.unhealthy = new
            return False
        self.unhealthy = new
        self._bump("health")
        return True

    def on_health(self, event: HealthEvent) -> bool:
        """Apply one backend event (when the backend's full map is not at hand)."""
        key = event.instance_uuid or event.gpu_uuid
        new = dict(self.unhealthy)
        if event.healthy:
            new.pop(key, None)
        else:
            new[key] = event.reason or "unhealthy"
        return self.set_unhealthy(new)

    def set_cordoned(self, uuids: Iterable[str]) -> bool:
        new = frozenset(uuids)
        if new == self.cordoned:
            return False
        self.cordoned = new
        self._bump("cordon")
        return True

    def set_refused(self, refused: Mapping[str, str]) -> bool:
        new = dict(refused)
        if new == self.refused:
            return False
        self.refused = new
        self._bump("refused")
        return True

    def set_changing(self, uuids: Iterable[str]) -> bool:
        """GPUs about to change mode or layout: their ids go Unhealthy and Allocate refuses them."""
        new = frozenset(uuids)
        if new == self.changing:
            return False
        self.changing = new
        self._bump("changing")
        return True

    def pods_changed(self) -> None:
        """The pod cache changed: wakes preferred-allocation waiters; the device list depends on it only
        through the cordon exception."""
        self._pods_event.set()
        self._pods_event = asyncio.Event()
        if self.cordoned:
            self._bump("pods")

    async def wait_pods(self, timeout: float) -> bool:
        """Wait for the next pod-cache change; ``False`` after ``timeout`` seconds without one."""
        try:
            await asyncio.wait_for(self._pods_event.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def wait_change(self, generation: int) -> int:
        """Wait until ``generation`` is stale; return the new one."""
        while self.generation == generation:
            await self._changed.wait()
        return self.generation

    # ---- derived views

    def inventory(self) -> NodeInventory:
        """The node as advertised: refused GPUs left out, health and cordon applied."""
        if self._inventory is None:
            gpus = []
            for gpu in self.gpus:
                if gpu.uuid in self.refused:
                    continue
                sick = gpu.uuid in self.unhealthy or any(i.uuid in self.unhealthy for i in gpu.instances)
                gpus.append(replace(gpu, healthy=not sick, cordoned=gpu.uuid in self.cordoned))
            self._inventory = NodeInventory(self.node, tuple(gpus))
        return self._inventory

    def id_health(self) -> list[tuple[str, str]]:
        """(id, health) for every advertised id, in a stable order. No NUMA topology is advertised:
        under a topology-manager policy kubelet would then pick ids only from its hinted NUMA node and
        override the extender's GPU (DESIGN 5).

        Unhealthy: the GPU or its MIG instance is unhealthy. A cordoned GPU's free ids are Unhealthy
        too, so kubelet hands them to no new pod; ids that live pods hold (admitted, stamped, just
        allocated) or that pending assignments were bound to before the cordon stay Healthy. kubelet
        re-admits a pod after a restart only if its ids are healthy (manager.go devicesToAllocate:
        "previously allocated devices are no longer healthy"), shows them in ResourceHealthStatus, and
        counts allocatable from Healthy ids: a cordon must stop new placements and nothing else.
        """
        keep = (self.book.held() | self.book.held_by_candidates()) if (self.book is not None and self.cordoned) \
            else frozenset()
        out: list[tuple[str, str]] = []
        for gpu in self.inventory().gpus:
            withdrawn = gpu.uuid in self.changing
            if gpu.mode == "mig":
                for inst in gpu.instances:
                    bad = withdrawn or gpu.uuid in self.unhealthy or inst.uuid in self.unhealthy
                    for sid in inst.slice_ids():
                        ok = not bad and (not gpu.cordoned or sid in keep)
                        out.append((sid, HEALTHY if ok else UNHEALTHY))
            else:
                bad = withdrawn or gpu.uuid in self.unhealthy
                for sid in gpu.slice_ids():
                    ok = not bad and (not gpu.cordoned or sid in keep)
                    out.append((sid, HEALTHY if ok else UNHEALTHY))
        return out

    def device_list(self) -> pb.ListAndWatchResponse:
        resp = pb.ListAndWatchResponse()
        for sid, health in self.id_health():
            resp.devices.add(ID=sid, health=health)
        return resp

    # ---- decisions (pure over the state)

    def preferred(self, available: Iterable[str], must_include: Iterable[str], size: int) -> list[str]:
        ids, _ = preferred(self.book, self.inventory(), available, must_include, size)
        return ids

    async def preferred_waiting(self, available: Iterable[str], must_include: Iterable[str], size: int,
                                wait_s: float, empty_wait_s: float = 0.0) -> tuple[list[str], Candidate | None]:
        """``preferred``, but when no assignment of that size matches, wait up to ``wait_s`` for the pod
        cache to catch up (kubelet's informer may see a bound pod before our watch does) before the
        best-fit fallback; and up to ``empty_wait_s`` in all while no valid best fit is left either,
        since an empty answer lets kubelet pick ids itself, which on a MIG GPU never form the instance
        the pod needs. No I/O: it only waits for the watch already running."""
        avail, must = list(available), list(must_include)
        ids, cand = preferred(self.book, self.inventory(), avail, must, size)
        if cand is not None or self.book is None or max(wait_s, empty_wait_s) <= 0:
            return ids, cand
        start = time.monotonic()
        while True:
            limit = wait_s if ids else max(wait_s, empty_wait_s)
            left = start + limit - time.monotonic()
            if left <= 0:
                break
            if not await self.wait_pods(left):
                continue  # timed out: the next turn sees no time left
            ids, cand = preferred(self.book, self.inventory(), avail, must, size)
            if cand is not None:
                break
        return ids, cand

    def allocate(self, slice_ids: Iterable[str]) -> tuple[Placement, Candidate | None]:
        """Check kubelet's ids form one valid placement and find the assignment they match."""
        wanted = list(slice_ids)
        placement = check_placement(self.inventory(), wanted)
        busy = self.changing.intersection(placement.gpus)
        if busy:
            raise PlacementRefused(f"GPU {', '.join(sorted(busy))} is being reconfigured (mode or MIG layout); "
                                   f"its ids are withdrawn")
        match = self.book.match(wanted) if self.book is not None else None
        if self.book is not None:
            self.book.note_allocated(wanted, time.monotonic())
        self.allocations += 1
        return placement, match


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    """The five RPCs; every answer comes from ``PluginState`` in memory."""

    def __init__(self, state: PluginState, injector: Injector, *, metrics: RpcObserver | None = None,
                 on_allocate: Callable[[Placement, Candidate | None], None] | None = None,
                 streams: StreamTracker | None = None, preferred_wait_s: float = 5.0,
                 preferred_wait_empty_s: float = 30.0,
                 before_answer: Callable[[Placement], Awaitable[str | None]] | None = None) -> None:
        self.state = state
        # Awaited for every placement before Allocate answers (the MPS daemon cap, deviceplugin.mps_limits);
        # a reason string refuses the request.
        self.before_answer = before_answer
        self.preferred_wait_s = preferred_wait_s
        self.preferred_wait_empty_s = preferred_wait_empty_s
        self.streams = streams if streams is not None else StreamTracker()
        self._end = asyncio.Event()
        self.injector = injector
        self.metrics: RpcObserver = metrics or _NoMetrics()
        self.on_allocate = on_allocate
        self._stopping = asyncio.Event()

    def stop_streams(self) -> None:
        """End every open ListAndWatch stream (the server is going away)."""
        self._stopping.set()

    def end_streams(self) -> None:
        """End the streams open now (kubelet sees its ListAndWatch end); later ones are served as usual."""
        self._end.set()
        self._end = asyncio.Event()

    async def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(self, request: pb.Empty, context: Any) -> AsyncIterator[pb.ListAndWatchResponse]:
        """The full list at once, then a new full list whenever it changes."""
        last: pb.ListAndWatchResponse | None = None
        generation = -1
        stopping = asyncio.ensure_future(self._stopping.wait())
        ending = asyncio.ensure_future(self._end.wait())
        change: asyncio.Future[int] | None = None
        self.streams.open()
        try:
            while not self._stopping.is_set() and not ending.done():
                if generation != self.state.generation:
                    generation = self.state.generation
                    current = self.state.device_list()
                    if current != last:
                        last = current
                        yield current
                change = asyncio.ensure_future(self.state.wait_change(generation))
                await asyncio.wait({change, stopping, ending}, return_when=asyncio.FIRST_COMPLETED)
                change.cancel()
        finally:
            self.streams.close()
            stopping.cancel()
            ending.cancel()
            if change is not None:
                change.cancel()

    async def GetPreferredAllocation(self, request: pb.PreferredAllocationRequest,
                                     context: Any) -> pb.PreferredAllocationResponse:
        start = time.perf_counter()
        try:
            resp = pb.PreferredAllocationResponse()
            for creq in request.container_requests:
                ids, cand = await self.state.preferred_waiting(
                    creq.available_deviceIDs, creq.must_include_deviceIDs, creq.allocation_size,
                    self.preferred_wait_s, self.preferred_wait_empty_s)
                if cand is None and self.state.book is not None:
                    log.info("GetPreferredAllocation of %d: no assignment matches (after waiting up to %.1fs, "
                             "%.1fs with no best fit, for the pod cache); best fit %s", creq.allocation_size,
                             self.preferred_wait_s, self.preferred_wait_empty_s, ids)
                resp.container_responses.add(deviceIDs=ids)
            return resp
        except GpuSliceError as exc:
            log.warning("GetPreferredAllocation failed: %s", exc)
            await context.abort(grpc.StatusCode.INTERNAL, f"gpu-slice preferred allocation: {exc}")
            raise  # unreachable: abort raises
        finally:
            self.metrics.observe_rpc("GetPreferredAllocation", time.perf_counter() - start)

    async def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        start = time.perf_counter()
        try:
            resp = pb.AllocateResponse()
            done: list[tuple[Placement, Candidate | None]] = []
            for creq in request.container_requests:
                ids = list(creq.devices_ids)
                placement, match = self.state.allocate(ids)
                if match is None and self.state.book is not None:
                    log.info("Allocate %s matches no assignment on this node (a pod of another scheduler, "
                             "or kubelet ignored the preference)", sorted(ids))
                resp.container_responses.append(build_response(placement, self.state.inventory(), self.injector))
                done.append((placement, match))
            if self.before_answer is not None:
                for placement, _ in done:
                    why = await self.before_answer(placement)
                    if why is not None:
                        raise MpsError(why)
        except PlacementRefused as exc:
            log.warning("Allocate refused %s: %s", [list(c.devices_ids) for c in request.container_requests], exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"gpu-slice: ids form no valid placement: {exc}")
            raise
        except (DevicePluginError, GpuSliceError) as exc:
            log.error("Allocate failed: %s", exc)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"gpu-slice: {exc}")
            raise
        finally:
            self.metrics.observe_rpc("Allocate", time.perf_counter() - start)
        if self.on_allocate is not None:
            for placement, match in done:
                self.on_allocate(placement, match)
        return resp

    async def PreStartContainer(self, request: pb.PreStartContainerRequest,
                                context: Any) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()
