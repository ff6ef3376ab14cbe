"""The extender's own preemption, for the shortfall kube-scheduler never asks ``/preempt`` about.

kube-scheduler's dry run counts slices: on a node with enough free slices in the wrong shape (the MIG
instance of the needed size is taken; an MPS pod's free slices are split over GPUs) it finds no pod to
evict, reports "expected at least one victim pod on node" and never calls ``/preempt``. So when
``/filter`` refuses every node kube-scheduler offered a pod that may preempt, the extender waits for
the end of that scheduling cycle (kube-scheduler calls ``/preempt`` within it when it does preempt:
then nothing is done here), and otherwise plans the preemption itself by kube-scheduler's rules
(:meth:`gpuslice.scheduler.Scheduler.shape_preemption`: victims of lower priority, fewest and least
important, only sets that break no PodDisruptionBudget, the node kube-scheduler would pick), holds the
slices they free for the pod (:meth:`~gpuslice.scheduler.Scheduler.nominate`), and evicts the victims
through the Eviction API. The Eviction API, not a delete as kube-scheduler does: it checks the
budgets again at the API server (a race with another disruption is refused with 429 rather than
breaking a budget), honours the victims' graceful termination, and is what ``kubectl drain``, the
cluster autoscaler and KAI's reclaim use. When an eviction is refused the hold is given back and the
pod is planned afresh at a later filter.

The cycle ends for a pod when kube-scheduler asks anything about another pod (it schedules one pod at
a time) or ``settle_s`` after the refusal, whichever is first. A pod is planned at most once per
``replan_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from extender.errors import KubeApiError
from extender.events import PodEvent
from extender.logs import RateLimitedLog

if TYPE_CHECKING:
    from extender.service import Extender

log = logging.getLogger(__name__)

#: Outcomes of a planned preemption, for the metric.
OUTCOMES = ("evicted", "no_victims", "eviction_refused", "skipped")


@dataclass
class _Pending:
    pod: Mapping[str, Any]
    nodes: tuple[str, ...]
    due: float


@dataclass
class ShapePreemptor:
    """See the module docstring. ``evict(namespace, name, uid)`` raises ``KubeApiError`` when refused."""

    ext: Extender
    evict: Callable[[str, str, str], None]
    settle_s: float = 2.0
    replan_s: float = 10.0
    on_outcome: Callable[[str], None] | None = None
    clock: Callable[[], float] = time.monotonic
    _pending: dict[str, _Pending] = field(default_factory=dict)
    _planned: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _wake: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _warn: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log))

    # ----- what the verbs tell it -------------------------------------------------------------
    def saw(self, uid: str) -> None:
        """kube-scheduler asked about pod ``uid``: the cycles of every other pending pod are over."""
        with self._lock:
            now = self.clock()
            for other, p in self._pending.items():
                if other != uid:
                    p.due = min(p.due, now)
        self._wake.set()

    def refused(self, pod: Mapping[str, Any], uid: str, nodes: tuple[str, ...]) -> None:
        """``/filter`` refused every node of ``nodes`` (kube-scheduler's candidates) for a pod that asks
        slices: if kube-scheduler does not preempt for it in this cycle, plan it here."""
        if not nodes:
            return
        with self._lock:
            if self.clock() - self._planned.get(uid, -1e18) < self.replan_s:
                return
            self._pending[uid] = _Pending(pod, nodes, self.clock() + self.settle_s)
        self._wake.set()

    def placed(self, uid: str) -> None:
        """The pod passed a filter: nothing to plan for it."""
        with self._lock:
            self._pending.pop(uid, None)

    def kube_preempts(self, uid: str, answered: bool) -> None:
        """kube-scheduler asked ``/preempt`` for the pod; ``answered``: whether any node was answered
        (then kube-scheduler preempts; otherwise nothing will, and it is planned here now)."""
        with self._lock:
            p = self._pending.get(uid)
            if p is None:
                return
            if answered:
                del self._pending[uid]
            else:
                p.due = self.clock()
        self._wake.set()

    # ----- the worker ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shape-preemption", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _due(self) -> list[tuple[str, _Pending]]:
        with self._lock:
            now = self.clock()
            due = [(u, p) for u, p in self._pending.items() if p.due <= now]
            for u, _ in due:
                del self._pending[u]
                self._planned[u] = now
            if len(self._planned) > 4096:  # forget the oldest plans
                for u in sorted(self._planned, key=self._planned.__getitem__)[:2048]:
                    del self._planned[u]
            return due

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.2)
            self._wake.clear()
            for uid, p in self._due():
                try:
                    self.plan(uid, p.pod, p.nodes)
                except Exception:  # one pod's plan must not end the worker
                    log.exception("planning the preemption for pod %s failed", uid)

    def plan(self, uid: str, pod: Mapping[str, Any], nodes: tuple[str, ...]) -> str:
        """Plan and carry out one preemption; returns its outcome (one of :data:`OUTCOMES`)."""
        ext = self.ext
        meta = pod.get("metadata") or {}
        ns, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
        with ext.lock:
            if ext.not_ready() or uid not in ext.view.pods or ext.view.pods[uid].info.node:
                return self._done("skipped")
            held = ext.view.reservations.get(uid)
            if held is not None and held.nominated:
                return self._done("skipped")
            chosen = ext.sched.shape_preemption(pod, nodes, ext.clock(), budgets=list(ext.view.budgets.values()))
            if chosen is None:
                return self._done("no_victims")
            ext.sched.nominate(pod, chosen, ext.clock())
        victims = ", ".join(p.label for p in chosen.victims)
        log.info("preempting %s on %s for %s/%s, whose %d slices fit there by count but in no free shape",
                 victims, chosen.node, ns, name, len(chosen.slice_ids))
        for victim in chosen.victims:
            vns, vname = victim.label.split("/", 1)
            try:
                self.evict(vns, vname, victim.uid)
            except KubeApiError as err:
                if err.status == 404:
                    continue  # already gone: its slices are free
                with ext.lock:
                    ext.view.release(uid)
                self._warn.warning("refused", "eviction of %s for %s/%s refused (%s); the pod is planned afresh "
                                   "later", victim.label, ns, name, err)
                return self._done("eviction_refused")
        if ext.events is not None:
            ext.events.record(PodEvent(ns, name, uid, "Preempting",
                                       f"gpu-slice evicts {victims} on node {chosen.node} to free slices "
                                       f"{', '.join(chosen.slice_ids)} for this pod (held for it until placed)"))
        return self._done("evicted")

    def _done(self, outcome: str) -> str:
        if self.on_outcome is not None:
            self.on_outcome(outcome)
        return outcome


__all__ = ["OUTCOMES", "ShapePreemptor"]
