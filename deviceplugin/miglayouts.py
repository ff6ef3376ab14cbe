"""Applying the extender's wanted MIG layouts on this node (dynamic layouts, DESIGN 2 and 4).

The extender writes ``example.com/gpu-slice.mig-layout`` on the Node (:mod:`gpuslice.layoutwire`); the
node watch hands every new value here. Each generation is applied once, GPU by GPU:

1. refused, with the reason, when the GPU is not here, not in MIG mode, refused to gpu-slice, sick,
   its product's ``migLayouts.<product>.dynamic`` is off in this node's config, the backend cannot
   re-cut, or the wanted layout breaks the product's rules;
2. refused when an instance the layout drops holds or is promised to a pod: ids kubelet admitted,
   stamped, allocated here, or named by a pending assignment. The instances to destroy are then
   withdrawn (Unhealthy in ListAndWatch, refused by Allocate), the ids in use are read again (an
   Allocate that ran before the withdrawal is counted by now), and only then does the backend change
   the GPU; an instance in use is never destroyed;
3. with the NVML backend and CDI injection, the toolkit's spec is generated again and must name every
   created instance (:mod:`deviceplugin.cdi_refresh`); else they are destroyed again (never advertised)
   and the re-cut is reported failed. While a GPU is re-cut its inventory entry says unhealthy, so the
   extender places no new pod on it; its other instances' ids stay Healthy for kubelet;
4. the GPUs are rediscovered (ListAndWatch re-advertises), and one patch writes the new inventory, the
   result (``example.com/gpu-slice.mig-layout-status``) and the label
   ``example.com/gpu-slice.mig-layout-generation``: a label change is what makes kube-scheduler retry
   a pod the extender refused (UpdateNodeLabel is an event its plugins register; an annotation alone
   is not), so the Pending pod is filtered again against the new inventory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from deviceplugin.backend import Backend, MigRecutter
from deviceplugin.cdi_refresh import CdiRefresher
from deviceplugin.errors import KubeApiError, RecutFailed, RecutRefused
from deviceplugin.server import PluginState
from gpuslice.annotations import INVENTORY_KEY, encode_inventory
from gpuslice.catalogue import PRODUCTS
from gpuslice.config import Config
from gpuslice.errors import GpuSliceError
from gpuslice.layoutwire import (
    LAYOUT_KEY,
    STATUS_KEY,
    GpuResult,
    LayoutResults,
    WantedGpu,
    WantedLayouts,
    decode_results,
    decode_wanted,
    encode_results,
)
from gpuslice.miglayout import legal

log = logging.getLogger(__name__)

GENERATION_LABEL = "example.com/gpu-slice.mig-layout-generation"

Write = Callable[[Mapping[str, str | None], Mapping[str, str | None]], Any]


class LayoutApplier:
    """One node's applier; ``on_node`` is called on the event loop with every Node object seen."""

    def __init__(self, *, state: PluginState, backend: Backend, config: Config,
                 held: Callable[[], frozenset[str]], rediscover: Callable[[], Awaitable[None]],
                 labels: Callable[[], Mapping[str, str | None]], write: Write | None,
                 refresher: CdiRefresher | None, event: Callable[[str, str, str], Awaitable[None]],
                 registry: CollectorRegistry | None = None) -> None:
        self.state = state
        self.backend = backend
        self.config = config
        self.held = held
        self.rediscover = rediscover
        self.labels = labels
        self.write = write
        self.refresher = refresher
        self.event = event
        self.applied = -1  # generation last applied (-1: not known yet; read from the status annotation)
        self.wanted: WantedLayouts | None = None
        self.results: LayoutResults | None = None
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.recuts = Counter("gpu_slice_plugin_mig_recuts_total",
                              "MIG re-cuts of one GPU by result (applied, refused, failed)", ["result"],
                              registry=registry if registry is not None else CollectorRegistry())

    def on_node(self, obj: Mapping[str, Any]) -> None:
        """A Node event: note the last applied generation, and start applying a newer wanted one."""
        annotations = (obj.get("metadata") or {}).get("annotations") or {}
        if self.applied < 0:
            raw = annotations.get(STATUS_KEY)
            try:
                self.applied = decode_results(raw).generation if raw is not None else 0
            except GpuSliceError as exc:
                log.warning("ignoring the node's %s: %s", STATUS_KEY, exc)
                self.applied = 0
        raw = annotations.get(LAYOUT_KEY)
        if raw is None:
            return
        try:
            wanted = decode_wanted(raw)
        except GpuSliceError as exc:
            log.warning("ignoring the node's %s: %s", LAYOUT_KEY, exc)
            return
        if wanted.generation <= self.applied or (self.wanted is not None and
                                                 wanted.generation <= self.wanted.generation):
            return
        self.wanted = wanted
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._apply_latest())

    async def _apply_latest(self) -> None:
        async with self._lock:
            while self.wanted is not None and self.wanted.generation > self.applied:
                wanted = self.wanted
                try:
                    await self.apply(wanted)
                except Exception:  # never let one generation stop the node's re-cuts
                    log.exception("applying MIG layout generation %d failed", wanted.generation)
                    self.applied = wanted.generation

    async def apply(self, wanted: WantedLayouts) -> LayoutResults:
        """Apply one generation (see the module docstring); returns and publishes what happened."""
        results = [await self._apply_gpu(g) for g in wanted.gpus]
        await self.rediscover()
        self.results = LayoutResults(wanted.generation, datetime.now(UTC), tuple(results))
        self.applied = wanted.generation
        for r in results:
            self.recuts.labels(result=r.state).inc()
            if r.state != "applied" or r.message != "already in place":
                await self.event("MigRecut" if r.state == "applied" else "MigRecutRefused",
                                 f"GPU {r.uuid}: {r.state}: {r.message}",
                                 "Normal" if r.state == "applied" else "Warning")
        await self._publish(self.results)
        return self.results

    async def _publish(self, results: LayoutResults) -> None:
        if self.write is None:
            return
        annotations = {STATUS_KEY: encode_results(results),
                       INVENTORY_KEY: encode_inventory(self.state.inventory().gpus)}
        labels = {**self.labels(), GENERATION_LABEL: str(results.generation)}
        delay = 0.2
        for _ in range(6):
            try:
                await asyncio.to_thread(self.write, annotations, labels)
                return
            except KubeApiError as exc:
                log.warning("writing %s failed (%s); retrying in %.1fs", STATUS_KEY, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        log.error("could not write %s for generation %d", STATUS_KEY, results.generation)

    async def _apply_gpu(self, want: WantedGpu) -> GpuResult:
        try:
            return await self._recut(want)
        except RecutRefused as exc:
            log.warning("MIG re-cut of GPU %s refused: %s", want.uuid, exc)
            return GpuResult(want.uuid, "refused", str(exc))
        except RecutFailed as exc:
            log.error("MIG re-cut of GPU %s failed: %s", want.uuid, exc)
            return GpuResult(want.uuid, "failed", str(exc))

    async def _recut(self, want: WantedGpu) -> GpuResult:
        state = self.state
        gpu = next((g for g in state.gpus if g.uuid == want.uuid), None)
        if gpu is None:
            raise RecutRefused(f"no GPU {want.uuid} on this node")
        if gpu.mode != "mig":
            raise RecutRefused(f"GPU {gpu.uuid} is in {gpu.mode} mode; only MIG layouts are re-cut")
        if gpu.product not in self.config.dynamic_mig_products():
            raise RecutRefused(f"migLayouts.{gpu.product}.dynamic is off in this node's config")
        if not isinstance(self.backend, MigRecutter):
            raise RecutRefused(f"the {self.backend.name} backend cannot re-cut MIG instances")
        if gpu.uuid in state.refused or gpu.uuid in state.unhealthy or any(i.uuid in state.unhealthy
                                                                           for i in gpu.instances):
            raise RecutRefused(f"GPU {gpu.uuid} is refused or unhealthy; it is not re-cut")
        prod = PRODUCTS[gpu.product]
        known = {p.name for p in prod.mig_profiles}
        bad = [p for p, _ in want.instances if p not in known]
        if bad:
            raise RecutRefused(f"{gpu.product} has no MIG profile {', '.join(bad)}")
        if not legal(gpu.product, tuple(sorted(want.instances))):
            raise RecutRefused(f"the wanted layout {list(want.instances)} breaks {gpu.product}'s MIG placement rules")
        actual = {(i.profile, i.start): i for i in gpu.instances}
        wanted = set(want.instances)
        destroy = [i for slot, i in actual.items() if slot not in wanted]
        create = [slot for slot in want.instances if slot not in actual]
        if not destroy and not create:
            return GpuResult(gpu.uuid, "applied", "already in place")
        self._check_free(destroy)
        gone = frozenset(i.uuid for i in destroy)
        state.set_withdrawn(state.withdrawn | gone)
        created: tuple[str, ...] = ()
        try:
            held = self._check_free(destroy)  # again, now that nothing new can be allocated there
            started = time.monotonic()
            outcome = await asyncio.to_thread(self.backend.recut_mig, gpu.uuid, [i.uuid for i in destroy], create,
                                              held)
            created = outcome.created
            if self.refresher is not None and created:
                fresh = frozenset(created)
                state.set_withdrawn(state.withdrawn | fresh)  # not advertised until the CDI spec names them
                try:
                    await asyncio.to_thread(self.refresher.refresh, created)
                except RecutFailed as exc:
                    await asyncio.to_thread(self.backend.recut_mig, gpu.uuid, list(created), [], self.held())
                    raise RecutFailed(f"{exc}; the instances created for it were destroyed again") from exc
                finally:
                    state.set_withdrawn(state.withdrawn - fresh)
        finally:
            state.set_withdrawn(state.withdrawn - gone)
        took = time.monotonic() - started
        text = (f"destroyed {len(destroy)} free instance(s) ({', '.join(f'{i.profile}@{i.start}' for i in destroy)}), "
                f"created {', '.join(f'{p}@{s}' for p, s in create)} in {took:.2f}s"
                + (f" for pod {', '.join(want.pods)}" if want.pods else ""))
        log.info("GPU %s re-cut: %s", gpu.uuid, text)
        return GpuResult(gpu.uuid, "applied", text)

    def _check_free(self, destroy: list[Any]) -> frozenset[str]:
        """The ids in use now; ``RecutRefused`` when an instance to destroy holds one of them."""
        held = self.held()
        busy = [i.uuid for i in destroy if held.intersection(i.slice_ids())]
        if busy:
            raise RecutRefused(f"MIG instance {', '.join(busy)} holds or is promised to a pod; an instance in "
                               "use is never destroyed")
        return held
