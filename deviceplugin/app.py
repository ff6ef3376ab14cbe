"""The composition root: build the backend, pod cache, state, gRPC service, stamper and publishers,
run them as tasks, and shut them down in order.

Start-up order matters: the pod cache is synced (and kubelet's PodResources read once) before the
plugin registers, so the first ``GetPreferredAllocation`` already sees every assignment; GPUs that
another resource advertises are refused before they are ever advertised. Shutdown reverses it: stop
answering kubelet (socket removed), then the background tasks, the watches, the backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry

from deviceplugin import cdi
from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from deviceplugin.allocate import Injector
from deviceplugin.assignments import AssignmentBook, Candidate, PodView, pod_view
from deviceplugin.backend import Backend, GpuTarget, HealthEvent
from deviceplugin.budget_watch import BudgetWatch
from deviceplugin.coexistence import Refusal, find_refusals
from deviceplugin.dcgm import DcgmCollector, DcgmOptions, SliceUse
from deviceplugin.errors import DevicePluginError, KubeApiError, KubeUnavailable
from deviceplugin.kube import KubeClient, Obj, Watcher, load_api_client
from deviceplugin.metrics import PluginMetrics
from deviceplugin.mps_limits import MpsLimitKeeper
from deviceplugin.registration import Registrar
from deviceplugin.server import DevicePluginServicer, PluginState
from deviceplugin.settings import Settings
from deviceplugin.stamping import PodResourcesClient, Stamper, admitted_ids
from gpuslice.annotations import (
    CORDON_KEY,
    INVENTORY_KEY,
    MODE_LABEL,
    PRODUCT_LABEL,
    encode_inventory,
    parse_cordon,
)
from gpuslice.errors import GpuSliceError
from gpuslice.model import Gpu, NodeInventory
from gpuslice.placement import Placement

log = logging.getLogger(__name__)

CONFLICT_TAINT = "example.com/gpu-slice-conflict"
EVENTS_KEPT = 256


def make_backend(settings: Settings) -> Backend:
    """The backend the settings name (imported lazily: the NVML one needs nvidia-ml-py)."""
    from deviceplugin.mps import MpsOptions, standin_command
    from deviceplugin.mps_supervisor import MpsSupervisor

    owns = settings.daemons == "plugin"
    if settings.backend == "simulated":
        from deviceplugin.simulated import SimulatedBackend, builtin_topology, load_topology

        slices = settings.config.slices
        topo = (load_topology(settings.topology, default_slices=slices) if settings.topology is not None
                else builtin_topology(settings.node_name, default_slices=slices))
        mps = MpsSupervisor(MpsOptions(root=settings.mps_dir, control_command=standin_command(),
                                       probe_interval_s=1.0, backoff_initial_s=0.5, backoff_max_s=5.0,
                                       tick_s=0.2), owns_daemons=owns, marks_wanted=True)
        return SimulatedBackend(topo, mps=mps)
    from deviceplugin.nvml_backend import NvmlBackend

    # Adopting a daemon the gpu-slice-mps DaemonSet starts is a cheap probe: retry it often.
    mps_real = None if settings.read_only else MpsSupervisor(
        MpsOptions(root=settings.mps_dir, backoff_max_s=60.0 if owns else 5.0), owns_daemons=owns,
        marks_wanted=True)
    return NvmlBackend(default_target=GpuTarget(settings.config.modes.default, settings.config.slices),
                       read_only=settings.read_only, mps=mps_real,
                       record_root=None if settings.read_only else settings.mps_dir)


def node_labels(gpus: tuple[Gpu, ...]) -> dict[str, str | None]:
    """Mode and product labels: the single value, ``mixed`` when GPUs differ, removed with no GPUs."""
    modes = {g.mode for g in gpus}
    products = {g.product for g in gpus}
    return {
        MODE_LABEL: (modes.pop() if len(modes) == 1 else "mixed") if modes else None,
        PRODUCT_LABEL: (products.pop() if len(products) == 1 else "mixed") if products else None,
    }


@dataclass
class _Kube:
    client: KubeClient
    pods: Watcher
    node: Watcher
    node_uid: str = ""


class DevicePluginApp:
    """One device plugin process; ``run(stop)`` returns after an orderly shutdown."""

    def __init__(self, settings: Settings, *, backend: Backend | None = None, api_client: Any | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.backend: Backend | None = backend
        self._api_client = api_client
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = PluginMetrics(self.registry)
        self.book: AssignmentBook | None = None
        self.state: PluginState | None = None
        self.registrar: Registrar | None = None
        self.stamper: Stamper | None = None
        self.mps_limits: MpsLimitKeeper | None = None
        self.servicer: DevicePluginServicer | None = None
        self.kube: _Kube | None = None
        self.podres = PodResourcesClient(settings.pod_resources_socket)
        self.ready = asyncio.Event()
        self.refusals: dict[str, Refusal] = {}
        self.conflicts: dict[str, Refusal] = {}  # GPU uuid -> another resource's claim while pods hold it
        self._tainted = False
        # (object, reason, message) of the latest events, for logs and tests; bounded
        self.events_sent: deque[tuple[str, str, str]] = deque(maxlen=EVENTS_KEPT)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._publish = asyncio.Event()
        self._published: tuple[str, dict[str, str | None]] | None = None
        self._target_messages: list[str] = []
        self._layout_warned: set[tuple[str, ...]] = set()
        self._metrics_server: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self.failure: str | None = None  # set when a background task died: /healthz red, exit non-zero
        self._stop: asyncio.Event | None = None
        self._beat = time.monotonic()
        self._metrics_snapshot = NodeInventory(settings.node_name, ())
        self._dcgm_uses: dict[str, SliceUse] = {}
        self.cdi_missing: dict[str, str] = {}  # owner uuid -> why its CDI name cannot be resolved
        self._podres_held: frozenset[str] = frozenset()  # without the API: what PodResources shows held
        self._recent: dict[str, float] = {}  # without the API: ids allocated lately -> when
        self._reported_unhealthy: set[str] = set()  # owners a GpuUnhealthy event was sent for
        self._health_synced = False
        self.budget: BudgetWatch | None = None

    # ---------------------------------------------------------------- start-up

    async def run(self, stop: asyncio.Event) -> None:
        """Start everything, serve until ``stop`` is set, then shut down in order."""
        self._stop = stop
        try:
            await self._start(stop)
            await stop.wait()
        finally:
            await self._shutdown(stop)
        if self.failure is not None:
            raise DevicePluginError(self.failure)

    def _supervise(self, coro: Any, name: str) -> None:
        """Run a background task that must live as long as the plugin: if it ends before ``stop`` (an
        exception or a plain return), the plugin shuts down and ``run`` raises, so the process exits
        non-zero and the DaemonSet restarts it; ``/healthz`` turns red meanwhile."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or (self._stop is not None and self._stop.is_set() and task.exception() is None):
            return
        exc = task.exception()
        why = f"background task {task.get_name()} died: {exc!r}" if exc is not None else \
            f"background task {task.get_name()} ended before shutdown"
        log.error("%s; stopping the plugin", why, exc_info=exc)
        if self.failure is None:
            self.failure = why
        if self._stop is not None:
            self._stop.set()

    def liveness(self) -> tuple[bool, str]:
        """For ``/healthz`` (read from the HTTP thread): red when a task died or the event loop stalled."""
        if self.failure is not None:
            return False, self.failure
        stalled = time.monotonic() - self._beat
        limit = max(30.0, 20 * self.settings.rediscover_s)
        if self._loop is not None and stalled > limit:
            return False, f"the event loop has not run its rediscovery for {stalled:.0f}s"
        return True, "ok"

    async def _start(self, stop: asyncio.Event) -> None:
        s = self.settings
        self._loop = asyncio.get_running_loop()
        if s.device_injection == "cdi" and s.backend == "nvml":
            spec = await asyncio.to_thread(cdi.check_cdi_spec, s.cdi_vendor, s.cdi_class, s.cdi_spec_dirs)
            log.info("CDI names %s/%s=<uuid> are defined by %s", s.cdi_vendor, s.cdi_class, spec)
        if self.backend is None:
            self.backend = await asyncio.to_thread(make_backend, s)
        backend = self.backend
        self.book = self._connect_kube()
        state = PluginState(s.node_name, book=self.book)
        self.state = state
        # Before discovery, so each daemon gets its cap before its GPU first turns healthy.
        self.mps_limits = MpsLimitKeeper(getattr(backend, "mps", None), state.inventory, lambda: self.book,
                                         "memory-only" if s.mps_memory_limit_only else "memory-and-threads",
                                         registry=self.registry)
        if self.kube is not None:
            await self._sync_kube(stop)
        await self._read_admitted()
        await self._discover(reconcile=True, quiet=True)
        await self._check_cdi()
        await self._check_coexistence()
        state.listeners.append(self._on_state_change)
        self._refresh_metrics_snapshot()
        self.metrics.watch_inventory(self._metrics_inventory, lambda: dict(state.unhealthy))
        if backend.name == "simulated":
            self.registry.register(DcgmCollector(lambda: self._metrics_snapshot.gpus, lambda: self._dcgm_uses,
                                                 DcgmOptions(hostname=s.node_name)))
        self._start_metrics_server()
        backend.watch_health(self._health_from_thread)
        injector = Injector(mode=s.device_injection, cdi_vendor=s.cdi_vendor, cdi_class=s.cdi_class,
                            mps_root=s.mps_dir, mps_memory_only=s.mps_memory_limit_only)
        servicer = DevicePluginServicer(state, injector, metrics=self.metrics, on_allocate=self._on_allocate,
                                        preferred_wait_s=s.preferred_wait_s,
                                        preferred_wait_empty_s=s.preferred_wait_empty_s,
                                        before_answer=self.mps_limits.before_allocate)
        self.servicer = servicer
        self.registrar = Registrar(
            s.plugin_dir, s.endpoint, s.resource_name,
            lambda server: pb_grpc.add_DevicePluginServicer_to_server(servicer, server),
            kubelet_socket=s.kubelet_socket.name, poll_s=s.dir_poll_s, register_timeout_s=s.register_timeout_s,
            on_registered=self._on_registered, streams=servicer.streams, missing_warn_s=s.kubelet_warn_s)
        if self.kube is not None and self.book is not None:
            self.stamper = Stamper(self.book, self.podres, s.resource_name,
                                   write=self.kube.client.patch_pod_annotations, event=self._pod_event,
                                   metrics=self.metrics, retries=s.stamp_retries,
                                   backoff_s=s.stamp_backoff_s, resync_s=s.stamp_resync_s,
                                   on_admitted=state.pods_changed)
            self._supervise(self.stamper.run(stop), "stamper")
            self._publish.set()
            self._supervise(self._publisher(stop), "inventory-publisher")
        self._supervise(self.registrar.run(stop), "registrar")
        self._supervise(self._rediscover(stop), "rediscover")
        if any(g.mode == "mps" for g in state.gpus) or s.config.modes.default == "mps":
            evict = self.kube.client.evict_pod if (s.budget_evict and self.kube is not None) else None
            self.budget = BudgetWatch(backend, state.inventory, lambda: self.book, interval_s=s.budget_s,
                                      proc_root=s.proc_root, event=self._pod_event, evict=evict,
                                      registry=self.registry)
            self._supervise(self.budget.run(stop), "budget-watch")

    def _connect_kube(self) -> AssignmentBook | None:
        s = self.settings
        if not s.use_kube:
            log.warning("running without Kubernetes API access (--no-kube): assignments are not honoured, "
                        "pods get a best-fit choice, no allocated stamps, no inventory annotation")
            return None
        api = self._api_client
        if api is None:
            try:
                api = load_api_client(s.kubeconfig, timeout_s=s.kube_timeout_s)
            except KubeUnavailable as exc:
                log.warning("running without Kubernetes API access (%s): assignments are not honoured, "
                            "pods get a best-fit choice, no allocated stamps, no inventory annotation", exc)
                return None
            self._api_client = api
        client = KubeClient(api, s.node_name, timeout_s=s.kube_timeout_s)
        self.kube = _Kube(client, client.pod_watcher(self._pods_listed, self._pod_event_from_thread),
                          client.node_watcher(self._node_listed, self._node_event_from_thread))
        return AssignmentBook(s.node_name)

    async def _sync_kube(self, stop: asyncio.Event) -> None:
        """List pods and the node before registering; retry (bounded backoff) until it works or stop."""
        assert self.kube is not None
        delay = 0.2
        for watcher in (self.kube.pods, self.kube.node):
            while True:
                try:
                    await asyncio.to_thread(watcher.sync)
                    break
                except KubeApiError as exc:
                    log.warning("cannot list %s yet (%s); the plugin registers only after its cache has synced",
                                watcher.what, exc)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), delay)
                    if stop.is_set():
                        return
                    delay = min(delay * 2, 5.0)
            watcher.start()
        await asyncio.sleep(0)  # run the sync callbacks queued by the worker thread
        log.info("pod cache synced: %d pods on node %s", len(self.book.pods) if self.book else 0,
                 self.settings.node_name)

    async def _read_admitted(self) -> None:
        """What kubelet already gave (a plugin restart with running pods): those ids are not pending.
        Without the Kubernetes API this is the only view of what is held, read again at every
        reconcile, so GPUs in use are never reconfigured."""
        if not self.settings.pod_resources_socket.exists():
            if self.book is None:
                log.warning("PodResources socket %s absent: without the Kubernetes API the plugin cannot tell "
                            "which slices pods hold, so no GPU is reconfigured until it can",
                            self.settings.pod_resources_socket)
                self._podres_held = frozenset({"*"})
            return
        try:
            resp = await self.podres.list_pods()
        except Exception as exc:  # grpc errors: kubelet may not be up yet
            log.info("PodResources not readable (%s); %s", exc,
                     "stamps will catch up" if self.book is not None else "no GPU is reconfigured until it is")
            if self.book is None:
                self._podres_held = frozenset({"*"})
            return
        admitted = admitted_ids(resp, self.settings.resource_name)
        if self.book is not None:
            self.book.set_admitted(admitted, time.monotonic())
        else:
            self._podres_held = frozenset(sid for ids_ in admitted.values() for sid in ids_)

    def _allocated(self) -> frozenset[str]:
        """Ids in use or promised: admitted, stamped, locally allocated, or pending assignments.

        Without the API: what PodResources showed at the last read plus ids allocated in the last
        minute (kubelet lists a pod only after admitting it); when PodResources could not be read,
        every id counts as held."""
        if self.book is not None:
            return self.book.held()
        if "*" in self._podres_held and self.state is not None:
            return frozenset(sid for g in self.state.gpus for sid in g.slice_ids())
        now = time.monotonic()
        self._recent = {sid: t for sid, t in self._recent.items() if now - t < 60.0}
        return self._podres_held | frozenset(self._recent)

    async def _check_cdi(self) -> None:
        """Advertised GPUs and MIG instances whose CDI name the node's spec lacks turn Unhealthy."""
        s, state = self.settings, self.state
        if not s.validate_cdi or state is None:
            return
        specs = await asyncio.to_thread(cdi.read_specs, s.cdi_vendor, s.cdi_class, s.cdi_spec_dirs)
        missing = cdi.missing(state.gpus, specs)
        if missing == self.cdi_missing:
            return
        for owner in sorted(set(missing) - set(self.cdi_missing)):
            log.error("%s", missing[owner])
        for owner in sorted(set(self.cdi_missing) - set(missing)):
            log.info("CDI device %s/%s=%s is defined now", s.cdi_vendor, s.cdi_class, owner)
        self.cdi_missing = missing
        self._sync_health()

    async def _discover(self, *, reconcile: bool = False, quiet: bool = False) -> None:
        """Discover GPUs (and with ``reconcile``, bring them to the config's targets where idle)."""
        backend, state, s = self.backend, self.state, self.settings
        assert backend is not None and state is not None
        if reconcile and s.config_file is not None:
            gpus = await asyncio.to_thread(backend.discover)
            targets = {}
            for gpu in gpus:
                try:
                    targets[gpu.uuid] = GpuTarget(s.config.mode_for(gpu.product, gpu.uuid), s.config.slices)
                except GpuSliceError as exc:
                    log.error("%s", exc)
            try:
                messages = await self._apply_targets(gpus, targets)
            finally:
                gpus = await asyncio.to_thread(backend.discover)
                state.set_gpus(gpus)
                state.set_changing(())
            if messages != self._target_messages:
                for line in messages:
                    log.warning("layout: %s", line)
                self._target_messages = messages
        gpus = await asyncio.to_thread(backend.discover)
        if state.set_gpus(gpus):
            log.info("GPU layout: %s", ", ".join(f"{g.index}:{g.product}:{g.mode}(S={g.slices})" for g in state.gpus))
            if not quiet:
                await self._check_cdi()
        self._warn_layouts(state.gpus)
        self._sync_health(quiet=quiet)
        if self.mps_limits is not None:  # every rediscovery: a pod that left lowers its GPU's cap
            self.mps_limits.refresh()

    def _warn_layouts(self, gpus: tuple[Gpu, ...]) -> None:
        """One warning per GPU and layout that differs from the config's static MIG layout."""
        from deviceplugin.layouts import layout_differences

        for key, message in layout_differences(self.settings.config, gpus):
            if key not in self._layout_warned:
                self._layout_warned.add(key)
                log.warning("%s", message)

    async def _apply_targets(self, gpus: tuple[Gpu, ...], targets: dict[str, GpuTarget]) -> list[str]:
        """Change idle GPUs to their targets without racing Allocate.

        On the event loop, before any worker thread runs: the GPUs that would change and hold no ids
        are withdrawn (their ids Unhealthy, Allocate refuses them). Then the ids in use are read again
        (an Allocate that ran before the withdrawal is in the book by now), and the backend gets that
        fresh set plus every id of a GPU that differs but was not withdrawn, so only withdrawn, idle
        GPUs can change while the thread runs.
        """
        backend, state = self.backend, self.state
        assert backend is not None and state is not None
        held = self._allocated()
        differ = {g.uuid for g in gpus if g.uuid in targets and _would_change(backend, g, targets[g.uuid])}
        idle = {g.uuid for g in gpus if g.uuid in differ and not held.intersection(g.slice_ids())}
        state.set_changing(idle)
        held = self._allocated()  # again: nothing can be allocated on a withdrawn GPU from here on
        keep = frozenset(sid for g in gpus if g.uuid in differ - idle for sid in g.slice_ids())
        return await asyncio.to_thread(backend.apply_targets, targets, held | keep)

    async def _check_coexistence(self) -> None:
        """Refuse (for good, in this process) GPUs another resource advertises, unless pods hold their ids.

        ``GetAllocatableResources`` lists only the healthy devices of plugins registered *now*, so what
        it shows depends on start order: another plugin may appear after pods already run on our
        slices. Withdrawing such a GPU would turn those pods' ids Unhealthy-then-gone (failed
        re-admission after a restart, allocatable below use). Instead the GPU stays advertised and the
        conflict is reported: an event, ``gpu_slice_plugin_coexistence_conflicts``, and with
        ``conflict_taint`` a NoSchedule taint on the node. Once no pod holds its ids it is refused.
        """
        state = self.state
        assert state is not None
        if not self.settings.pod_resources_socket.exists():
            return
        try:
            allocatable = await self.podres.allocatable()
        except Exception as exc:
            log.info("PodResources GetAllocatableResources failed (%s); coexistence checked later", exc)
            return
        found = find_refusals(state.gpus, allocatable, self.settings.resource_name)
        held = self._allocated()
        by_uuid = {g.uuid: g for g in state.gpus}
        new: dict[str, Refusal] = {}
        conflicts: dict[str, Refusal] = {}
        for uuid, refusal in found.items():
            if uuid in self.refusals:
                continue
            gpu = by_uuid.get(uuid)
            if gpu is not None and held & frozenset(gpu.slice_ids()):
                conflicts[uuid] = refusal
            else:
                new[uuid] = refusal
        await self._set_conflicts(conflicts)
        if not new:
            return
        self.refusals.update(new)
        state.set_refused({u: r.message for u, r in self.refusals.items()})
        for refusal in new.values():
            log.warning("%s", refusal.message)
            await self._node_event("GpuRefused", refusal.message, "Warning")

    async def _set_conflicts(self, conflicts: dict[str, Refusal]) -> None:
        """Report conflicts that began, clear those that ended; keep the taint in step when configured."""
        begun = sorted(set(conflicts) - set(self.conflicts))
        ended = {u: r for u, r in self.conflicts.items() if u not in conflicts}
        self.conflicts = dict(conflicts)
        for uuid in begun:
            r = conflicts[uuid]
            message = (f"GPU {r.gpu_index} ({uuid}): resource {r.resource} also advertises it (device "
                       f"{r.device_id!r}) while pods hold its slices; it stays advertised so they keep running. "
                       f"Remove the other plugin's claim or drain the GPU")
            log.error("%s", message)
            self.metrics.coexistence_conflicts.labels(gpu_uuid=uuid, resource=r.resource).set(1)
            await self._node_event("GpuConflict", message, "Warning")
        for uuid, old in sorted(ended.items()):
            with contextlib.suppress(KeyError):
                self.metrics.coexistence_conflicts.remove(uuid, old.resource)
            log.info("GPU %s: the conflict with %s is over", uuid, old.resource)
        want = bool(conflicts)
        if self.settings.conflict_taint and self.kube is not None and want != self._tainted:
            try:
                await asyncio.to_thread(self.kube.client.set_taint, CONFLICT_TAINT, "NoSchedule", want)
                self._tainted = want
            except KubeApiError as exc:  # retried at the next check
                log.warning("could not %s the taint %s: %s", "set" if want else "remove", CONFLICT_TAINT, exc)

    # ---------------------------------------------------------------- callbacks (loop thread)

    def _call(self, fn: Any, *args: Any) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop closing
                loop.call_soon_threadsafe(fn, *args)

    def _pods_listed(self, items: list[Obj]) -> None:
        self._call(self._apply_pod_list, items)

    def _pod_event_from_thread(self, kind: str, obj: Obj) -> None:
        self._call(self._apply_pod_event, kind, obj)

    def _node_listed(self, items: list[Obj]) -> None:
        if items:
            self._call(self._apply_node, items[0])

    def _node_event_from_thread(self, kind: str, obj: Obj) -> None:
        if kind != "DELETED":
            self._call(self._apply_node, obj)

    def _view(self, obj: Obj) -> PodView | None:
        """One pod's view; a pod that cannot be decoded is logged and skipped, never the whole list."""
        try:
            return pod_view(obj, self.settings.node_name)
        except Exception:  # one bad pod must not stop the node's bookkeeping
            meta = obj.get("metadata") if isinstance(obj, dict) else None
            name = meta.get("name") if isinstance(meta, dict) else "?"
            log.exception("pod %s could not be read; it is left out of the assignment cache", name)
            return None

    def _apply_pod_list(self, items: list[Obj]) -> None:
        if self.book is None or self.state is None:
            return
        self.book.replace_all(v for v in (self._view(obj) for obj in items) if v is not None)
        self.state.pods_changed()

    def _apply_pod_event(self, kind: str, obj: Obj) -> None:
        if self.book is None or self.state is None:
            return
        view = self._view(obj)
        if view is None:
            return
        if kind == "DELETED" or view.node_name != self.settings.node_name:
            self.book.remove(view.uid)
        else:
            self.book.upsert(view)
        self.state.pods_changed()

    def _apply_node(self, obj: Obj) -> None:
        state = self.state
        if state is None:
            return
        if self.kube is not None:
            self.kube.node_uid = str((obj.get("metadata") or {}).get("uid", ""))
        raw = ((obj.get("metadata") or {}).get("annotations") or {}).get(CORDON_KEY)
        try:
            cordoned = parse_cordon(raw)
        except GpuSliceError as exc:
            log.warning("ignoring the node's cordon annotation: %s", exc)
            return
        known = {g.uuid for g in state.gpus}
        unknown = cordoned - known
        if unknown:
            log.info("cordon lists GPUs not on this node: %s", sorted(unknown))
        if state.set_cordoned(cordoned & known):
            log.info("cordoned GPUs now: %s", sorted(cordoned & known) or "none")

    def _health_from_thread(self, event: HealthEvent) -> None:
        self._call(self._on_health, event)

    def _on_health(self, event: HealthEvent) -> None:
        log.log(logging.INFO if event.healthy else logging.WARNING, "GPU %s%s %s: %s", event.gpu_uuid,
                f" instance {event.instance_uuid}" if event.instance_uuid else "",
                "recovered" if event.healthy else "unhealthy", event.reason)
        self._sync_health(event)

    def _sync_health(self, event: HealthEvent | None = None, *, quiet: bool = False) -> None:
        """Take the backend's full unhealthy map (events may arrive out of order) plus the CDI check's,
        and report changes.

        Events: ``GpuUnhealthy`` when an owner turns unhealthy, and at the first sync for owners
        already faulty then; an MPS GPU whose daemon has not answered yet in this process is not
        "failed" (the daemon may simply not be adopted yet). ``GpuRecovered`` only for an owner a
        ``GpuUnhealthy`` was sent for, so a clean start reports nothing. ``quiet`` records without events.
        """
        state, backend = self.state, self.backend
        if state is None or backend is None:
            return
        before = dict(state.unhealthy)
        now = dict(backend.unhealthy())
        if event is not None and not event.healthy:
            now.setdefault(event.instance_uuid or event.gpu_uuid, event.reason)
        for owner, why in self.cdi_missing.items():
            now.setdefault(owner, why)
        state.set_unhealthy(now)
        supervisor = getattr(backend, "mps", None)
        for gpu in state.gpus:
            if gpu.mode == "mps":
                self.metrics.set_mps_up(gpu.uuid, gpu.uuid not in now)
                if supervisor is not None:
                    for how, counts in (("adopted", supervisor.adopted), ("started", supervisor.started)):
                        self.metrics.mps_daemon_takeovers.labels(gpu_uuid=gpu.uuid, how=how).set(
                            counts.get(gpu.uuid, 0))
        if quiet:
            return
        first = not self._health_synced
        self._health_synced = True
        # Not a failure: an MPS GPU whose daemon has never answered this process, for that reason alone.
        never_up = set() if supervisor is None else {
            u for u, seen in supervisor.ever_up().items() if not seen and now.get(u) == supervisor.reason(u)}
        new = set(now) - (set() if first else set(before))
        for owner in sorted(new - never_up - self._reported_unhealthy):
            self._reported_unhealthy.add(owner)
            self._spawn(self._node_event("GpuUnhealthy", f"{owner} is unhealthy: {now[owner]}; its slices are "
                                                         f"advertised Unhealthy", "Warning"))
        for owner in sorted(self._reported_unhealthy - set(now)):
            self._reported_unhealthy.discard(owner)
            self._spawn(self._node_event("GpuRecovered", f"{owner} is healthy again", "Normal"))

    def _on_state_change(self, kind: str) -> None:
        if kind in ("layout", "health", "cordon", "refused"):
            self._publish.set()

    def _on_allocate(self, placement: Placement, match: Candidate | None) -> None:
        if self.book is None:
            now = time.monotonic()
            self._recent.update(dict.fromkeys(placement.slice_ids, now))
        if match is None and self.book is not None and self.book.pending():
            self.metrics.allocation_mismatch("allocate")
        if self.stamper is not None:
            self.stamper.nudge()

    def _on_registered(self, ok: bool) -> None:
        self.metrics.registration(ok)
        if ok:
            self.ready.set()

    def _spawn(self, coro: Any) -> None:
        """A short-lived task (an event): its failure is logged, never lost, and never stops the plugin."""
        task = asyncio.ensure_future(coro)
        self._tasks.append(task)

        def done(t: asyncio.Future[Any]) -> None:
            if t in self._tasks:
                self._tasks.remove(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("background step failed: %r", t.exception(), exc_info=t.exception())

        task.add_done_callback(done)

    def _refresh_metrics_snapshot(self) -> None:
        """The inventory with held ids as ``used``, computed on the loop for the scrape thread."""
        if self.state is None:
            return
        inv = self.state.inventory()
        self._metrics_snapshot = inv.with_used(self._allocated() & inv.all_ids())
        self._dcgm_uses = self._slice_uses()

    def _slice_uses(self) -> dict[str, SliceUse]:
        """Slice id -> the live pod holding it (PodResources' view first, then stamps), for DCGM labels."""
        book = self.book
        if book is None:
            return {}
        out: dict[str, SliceUse] = {}
        by_key = {p.key: p for p in book.pods.values() if p.live}
        for key, ids_ in book.admitted.items():
            pod = by_key.get(key)
            if pod is not None:
                use = SliceUse(pod.namespace, pod.name, pod.container, pod.utilization)
                out.update(dict.fromkeys(ids_, use))
        for pod in by_key.values():
            if pod.allocated_ids and pod.key not in book.admitted:
                use = SliceUse(pod.namespace, pod.name, pod.container, pod.utilization)
                for sid in pod.allocated_ids:
                    out.setdefault(sid, use)
        return out

    def _metrics_inventory(self) -> NodeInventory:
        """Read at scrape time on the metrics thread: only the last snapshot, never the live cache."""
        return self._metrics_snapshot

    # ---------------------------------------------------------------- events and publishing

    async def _node_event(self, reason: str, message: str, type_: str) -> None:
        self.events_sent.append((f"node/{self.settings.node_name}", reason, message))
        if self.kube is None:
            return
        try:
            await asyncio.to_thread(self.kube.client.create_event, kind="Node", name=self.settings.node_name,
                                    namespace="", uid=self.kube.node_uid, reason=reason, message=message,
                                    type_=type_)
        except KubeApiError as exc:
            log.warning("could not record event %s: %s", reason, exc)

    async def _pod_event(self, namespace: str, name: str, uid: str, reason: str, message: str, type_: str) -> None:
        self.events_sent.append((f"pod/{namespace}/{name}", reason, message))
        if self.kube is None:
            return
        try:
            await asyncio.to_thread(self.kube.client.create_event, kind="Pod", name=name, namespace=namespace,
                                    uid=uid, reason=reason, message=message, type_=type_)
        except KubeApiError as exc:
            log.warning("could not record event %s on pod %s/%s: %s", reason, namespace, name, exc)

    async def _publisher(self, stop: asyncio.Event) -> None:
        """Patch the node's inventory annotation and labels when layout, health, cordon or refusals change."""
        assert self.kube is not None and self.state is not None
        delay = 0.2
        while not stop.is_set():
            waiter = asyncio.ensure_future(self._publish.wait())
            stopper = asyncio.ensure_future(stop.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            stopper.cancel()
            if stop.is_set():
                return
            self._publish.clear()
            gpus = self.state.inventory().gpus
            value = (encode_inventory(gpus), node_labels(gpus))
            if value == self._published:
                continue
            try:
                await asyncio.to_thread(self.kube.client.patch_node, {INVENTORY_KEY: value[0]}, value[1])
            except KubeApiError as exc:
                log.warning("publishing the node inventory failed (%s); retrying in %.1fs", exc, delay)
                self._publish.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                delay = min(delay * 2, 10.0)
                continue
            delay = 0.2
            self._published = value
            log.info("published node inventory: %d GPUs", len(gpus))

    async def _rediscover(self, stop: asyncio.Event) -> None:
        """Every ``rediscover_s`` the layout (a change shows within a second); every ``reconcile_s`` the
        config targets (changes that waited may apply now) and coexistence. Also refreshes the
        snapshot the metrics thread reads."""
        loop = asyncio.get_running_loop()
        next_reconcile = loop.time() + self.settings.reconcile_s
        while not stop.is_set():
            self._beat = time.monotonic()
            self._refresh_metrics_snapshot()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.rediscover_s)
            if stop.is_set():
                return
            reconcile = loop.time() >= next_reconcile
            try:
                await self._discover(reconcile=reconcile)
                if reconcile:
                    next_reconcile = loop.time() + self.settings.reconcile_s
                    await self._check_coexistence()
                    await self._check_cdi()
                    if self.book is None:
                        await self._read_admitted()
            except GpuSliceError as exc:
                log.error("rediscovery failed: %s", exc)

    def _start_metrics_server(self) -> None:
        port = self.settings.metrics_port
        if not port:
            return
        self._metrics_server = serve_http(self.settings.metrics_address, port, self.registry, self.liveness)
        log.info("serving /metrics and /healthz on %s:%d", self.settings.metrics_address, port)

    # ---------------------------------------------------------------- shutdown

    async def _shutdown(self, stop: asyncio.Event) -> None:
        stop.set()
        if self.servicer is not None:
            self.servicer.stop_streams()
        for task in list(self._tasks):
            try:
                await asyncio.wait_for(task, 10)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()
            except Exception:
                log.exception("task %s failed", task.get_name())
        if self.registrar is not None:
            await self.registrar.close()
        if self.kube is not None:
            await asyncio.gather(asyncio.to_thread(self.kube.pods.stop), asyncio.to_thread(self.kube.node.stop))
        if self.backend is not None:
            await asyncio.to_thread(self.backend.close)
        await self.podres.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self._api_client is not None and hasattr(self._api_client, "close"):
            with contextlib.suppress(Exception):
                self._api_client.close()
        log.info("device plugin stopped")


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return None


def serve_http(address: str, port: int, registry: CollectorRegistry,
               liveness: Callable[[], tuple[bool, str]]) -> Any:
    """``/metrics`` (the registry) and ``/healthz`` (200 while ``liveness`` says so, else 503) on a thread."""
    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    metrics_app = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO") == "/healthz":
            ok, message = liveness()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [message.encode() + b"\n"]
        return metrics_app(environ, start_response)

    httpd = make_server(address, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd


def _would_change(backend: Backend, gpu: Gpu, target: GpuTarget) -> bool:
    """Whether the backend would change this GPU for this target (``would_change`` when it has one)."""
    fn = getattr(backend, "would_change", None)
    if fn is not None:
        return bool(fn(gpu, target))
    if target.mode == "mig":
        return gpu.mode != "mig" or target.mig_layout is not None
    return (gpu.mode, gpu.slices) != (target.mode, target.slices)
