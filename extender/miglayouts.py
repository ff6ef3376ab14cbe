"""The extender's half of dynamic MIG layouts: plan re-cuts for refused pods, publish them on Nodes.

A pod the filter refuses on every node it was offered is remembered with those nodes. Once a second
(and at once after such a refusal) the publisher asks the core (:class:`gpuslice.miglayout.LayoutPlanner`,
the same decision the simulator replays) for a re-cut of free MIG slots that lets it in, on the nodes
kube-scheduler offered, never on a GPU whose last re-cut is still in flight. It writes the GPU's
wanted layout into the Node annotation ``example.com/gpu-slice.mig-layout`` (:mod:`gpuslice.layoutwire`;
only the extender's service account may write it, ``manifests/deviceplugin/mig-layout-policy.yaml``),
with a generation above any the node has seen. Only the replica that holds the scheduler's Lease
writes.

The device plugin applies it and stamps the result with the new inventory. When the inventory shows
the wanted layout, the new instance is reserved for the pod it was made for (a reservation like the
filter's, by pod UID, with the same TTL), so the pod, which kube-scheduler retries on the plugin's
label change, finds it free. A re-cut the plugin refused or that did not show within
``INTENT_TTL_S`` is dropped and the pod may be planned again.

State: the wanted layouts and the plugin's results live on the Nodes, so a restarted extender reads
what is in flight from them (the remembered refusals are rebuilt as kube-scheduler retries the pods).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from extender.errors import KubeApiError
from gpuslice.errors import GpuSliceError
from gpuslice.layoutwire import (
    LAYOUT_KEY,
    STATUS_KEY,
    LayoutResults,
    WantedGpu,
    WantedLayouts,
    decode_results,
    decode_wanted,
    encode_wanted,
)
from gpuslice.miglayout import LayoutPlanner, LayoutStatus, Recut, Slot, layout_status, slots_from_inventories
from gpuslice.packing.state import Candidates, ClusterState, PackRequest

if TYPE_CHECKING:
    from extender.service import Extender

log = logging.getLogger("gpu_slice.extender.miglayouts")

#: A wanted layout not applied (inventory showing it, or the plugin's refusal) within this long is
#: dropped: the plugin is down or slow, and the pod may be planned again elsewhere.
INTENT_TTL_S = 120.0
#: A refused pod not filtered again for this long is forgotten (deleted, or scheduled elsewhere).
PENDING_TTL_S = 600.0

Write = Callable[[str, str], None]


@dataclass(slots=True)
class Refused:
    req: PackRequest
    nodes: tuple[str, ...]
    seen: float


@dataclass(slots=True)
class Intent:
    """A re-cut written to a Node and not settled yet."""

    recut: Recut
    generation: int
    made: float
    reserved: bool = False


@dataclass(slots=True)
class NodeLayouts:
    """What one Node's annotations say about its MIG layouts."""

    wanted: WantedLayouts | None = None
    results: LayoutResults | None = None


@dataclass(slots=True)
class LayoutPublisher:
    """See the module docstring; every method that reads the view takes the extender's lock."""

    ext: Extender
    write: Write | None
    interval_s: float = 1.0
    planner: LayoutPlanner = field(init=False)
    refused: OrderedDict[str, Refused] = field(default_factory=OrderedDict)
    intents: dict[str, Intent] = field(default_factory=dict)  # GPU uuid -> its re-cut in flight
    nodes: dict[str, NodeLayouts] = field(default_factory=dict)
    written: dict[str, int] = field(default_factory=dict)  # node -> the generation last written here
    outcomes: list[str] = field(default_factory=list)  # the latest settled re-cuts (for logs and status)
    _wake: threading.Event = field(default_factory=threading.Event)
    _slots: dict[int, Slot] = field(default_factory=dict)
    _slots_for: tuple[int, int] = (-1, -1)

    def __post_init__(self) -> None:
        cfg = self.ext.config
        self.planner = LayoutPlanner(cfg.dynamic_mig_products(), memory_tolerance=cfg.memory_tolerance)
        if self.active:
            self.ext.sched.instance_order = self.instance_order

    def slots(self) -> dict[int, Slot]:
        """Unit row -> (profile, start) of every MIG instance the view holds, rebuilt when its layout moves."""
        view = self.ext.view
        st = view.state
        key = (st.generation, st.layout_version)
        if key != self._slots_for:
            self._slots = slots_from_inventories(st, {name: n.info.inventory.gpus for name, n in view.nodes.items()
                                                      if n.info.inventory is not None and n.row >= 0})
            self._slots_for = key
        return self._slots

    def instance_order(self, state: ClusterState, req: PackRequest, cands: Candidates) -> NDArray[np.float64] | None:
        """The filter's tie-break among MIG instances (the simulator's, from the same core function)."""
        return self.planner.instance_order(state, self.slots(), req, cands)

    @property
    def active(self) -> bool:
        return bool(self.planner.dynamic)

    # ----- what the extender tells it (under its lock) -------------------------------------------
    def observe(self, req: PackRequest) -> None:
        if self.active:
            self.planner.observe(req)

    def note_filter(self, req: PackRequest | None, feasible: Sequence[str], candidates: Sequence[str],
                    error: str, now: float) -> None:
        """A filter answered: a pod refused everywhere it was offered is remembered, a placed one forgotten."""
        if not self.active or req is None or not req.uid:
            return
        if feasible or error or not candidates:
            self.refused.pop(req.uid, None)
            return
        self.refused[req.uid] = Refused(req, tuple(candidates), now)
        self.refused.move_to_end(req.uid)
        self._wake.set()

    def recutting(self, uid: str) -> bool:
        """Whether a re-cut for this pod is in flight (the shape preemptor then evicts nobody for it)."""
        return any(i.recut.pod == uid for i in self.intents.values())

    def on_node(self, obj: Mapping[str, Any]) -> None:
        """A Node event or relist item: read its wanted layouts and the plugin's results."""
        meta = obj.get("metadata") or {}
        name = meta.get("name")
        if not isinstance(name, str):
            return
        annotations = meta.get("annotations") or {}
        entry = self.nodes.setdefault(name, NodeLayouts())
        for key, attr, decode in ((LAYOUT_KEY, "wanted", decode_wanted), (STATUS_KEY, "results", decode_results)):
            raw = annotations.get(key)
            if raw is None:
                setattr(entry, attr, None)
                continue
            try:
                setattr(entry, attr, decode(raw))
            except GpuSliceError as exc:
                log.warning("node %s: ignoring %s: %s", name, key, exc)
        if entry.wanted is not None:
            self.written[name] = max(self.written.get(name, 0), entry.wanted.generation)

    # ----- the loop --------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.step(self.ext.clock())
            except Exception:  # a failed step is logged; the next one starts afresh
                log.exception("MIG layout step failed")
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def step(self, now: float) -> list[Recut]:
        """Settle intents, reserve made instances, plan for refused pods, write the Nodes touched."""
        if not self.active:
            return []
        if not self.ext.fence.holds():
            return []
        with self.ext.lock:
            self._settle(now)
            planned = self._plan(now)
            writes = {r.node: self._wanted_for(r.node, now) for r in planned}
        for node, value in writes.items():
            self._write(node, value)
        return planned

    def _settle(self, now: float) -> None:
        view = self.ext.view
        for gpu, intent in list(self.intents.items()):
            r = intent.recut
            entry = self.nodes.get(r.node)
            result = entry.results.gpu(gpu) if entry is not None and entry.results is not None and \
                entry.results.generation >= intent.generation else None
            node = view.nodes.get(r.node)
            inv = node.info.inventory if node is not None else None
            current = next((g for g in inv.gpus if g.uuid == gpu), None) if inv is not None else None
            shown = current is not None and tuple(sorted((i.profile, i.start) for i in current.instances)) == r.wanted
            if shown:
                if not intent.reserved:
                    intent.reserved = self._reserve(intent, now)
                self._done(gpu, f"{r.node} GPU {gpu}: re-cut to {list(r.wanted)} applied")
            elif result is not None and result.state != "applied":
                self._done(gpu, f"{r.node} GPU {gpu}: re-cut {result.state}: {result.message}")
            elif now - intent.made > INTENT_TTL_S:
                self._done(gpu, f"{r.node} GPU {gpu}: re-cut to {list(r.wanted)} not applied within "
                                f"{INTENT_TTL_S:.0f}s; dropped")

    def _done(self, gpu: str, text: str) -> None:
        self.intents.pop(gpu, None)
        self.outcomes = [*self.outcomes[-31:], text]
        log.info("%s", text)

    def _reserve(self, intent: Intent, now: float) -> bool:
        """Hold the made instance for the pod it was made for, while that pod is still unplaced."""
        r = intent.recut
        view = self.ext.view
        refused = self.refused.get(r.pod) if r.pod else None
        if refused is None or r.target is None or view.claim(r.pod) is not None:
            return False
        node = view.nodes.get(r.node)
        inv = node.info.inventory if node is not None else None
        gpu = next((g for g in inv.gpus if g.uuid == r.gpu), None) if inv is not None else None
        inst = next((i for i in gpu.instances if (i.profile, i.start) == r.target), None) if gpu is not None else None
        if inst is None or node is None or node.row < 0 or inst.uuid not in node.keys:
            return False
        if any(view.holder(r.node, sid) is not None for sid in inst.slice_ids()):
            return False
        hold = self.ext.sched.reservation_for(refused.req, node.row, [node.keys[inst.uuid]], now)
        view.hold(hold)
        log.info("reserved %s (%s@%s on %s) for pod %s after its re-cut", inst.uuid, inst.profile, inst.start,
                 r.node, r.pod)
        return True

    def _plan(self, now: float) -> list[Recut]:
        view = self.ext.view
        for uid, p in list(self.refused.items()):
            if now - p.seen > PENDING_TTL_S or view.claim(uid) is not None:
                del self.refused[uid]
        waiting = [uid for uid in self.refused if not any(i.recut.pod == uid for i in self.intents.values())]
        if not waiting:
            return []
        st = view.state
        slots = self.slots()
        planned: list[Recut] = []
        for uid in waiting:
            p = self.refused[uid]
            rows = [view.node_row(n) for n in p.nodes]
            mask = np.zeros(st.n_nodes, dtype=bool)
            mask[[r for r in rows if r >= 0]] = True
            recut = self.planner.for_pending(st, slots, p.req, nodes=mask, exclude=list(self.intents))
            if recut is None:
                continue
            generation = self.written.get(recut.node, 0) + 1
            self.written[recut.node] = generation
            for i in self.intents.values():  # the node's other re-cuts in flight ride along, same generation
                if i.recut.node == recut.node:
                    i.generation = generation
            self.intents[recut.gpu] = Intent(recut, generation, now)
            planned.append(recut)
            log.info("pod %s: re-cut %s GPU %s to %s (destroy %d free instance(s))", uid, recut.node, recut.gpu,
                     list(recut.wanted), len(recut.destroy))
        return planned

    def _wanted_for(self, node: str, now: float) -> str:
        gpus = tuple(WantedGpu(i.recut.gpu, i.recut.wanted, (i.recut.pod,) if i.recut.pod else (), i.recut.reason)
                     for i in self.intents.values() if i.recut.node == node)
        return encode_wanted(WantedLayouts(self.written[node], datetime.fromtimestamp(now, UTC), gpus))

    def _write(self, node: str, value: str) -> None:
        if self.write is None:
            return
        try:
            self.write(node, value)
        except KubeApiError as exc:
            log.warning("writing %s on node %s failed: %s (planned again after its intent expires)",
                        LAYOUT_KEY, node, exc)

    # ----- for gpu-slice status ----------------------------------------------------------------------
    def status(self) -> list[LayoutStatus]:
        """The wanted and actual layout of every MIG GPU and why a re-cut is pending."""
        with self.ext.lock:
            view = self.ext.view
            gpus = {name: n.info.inventory.gpus for name, n in view.nodes.items() if n.info.inventory is not None}
            wanted = {name: {g.uuid: g.instances for g in e.wanted.gpus} for name, e in self.nodes.items()
                      if e.wanted is not None}
            applied = {name: {g.uuid: f"{g.state}: {g.message}" for g in e.results.gpus}
                       for name, e in self.nodes.items() if e.results is not None}
        return layout_status(gpus, wanted, applied, self.planner.dynamic)


def api_writer(api_client: Any, *, timeout_s: float = 10.0) -> Write:
    """A merge patch of the one annotation on a Node (the admission policy allows the extender nothing else)."""
    from kubernetes import client

    core = client.CoreV1Api(api_client)

    def write(node: str, value: str) -> None:
        body = {"metadata": {"annotations": {LAYOUT_KEY: value}}}
        try:
            core.patch_node(node, body, _request_timeout=timeout_s, _content_type="application/merge-patch+json")
        except Exception as exc:
            status = getattr(exc, "status", None)
            raise KubeApiError(f"patch node {node}: {status or ''} {getattr(exc, 'reason', None) or exc}",
                               status=status) from exc

    return write
