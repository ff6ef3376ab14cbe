"""Events of our own on pods: per bind, which node, GPU or MIG instance and slice ids a pod got; per
preemption of our own, whom it evicts.

kube-scheduler records ``Scheduled`` with the node only; the assignment annotation says more but is
not where an operator looks first (``kubectl describe pod``, ``kubectl get events``). So every
successful ``/bind`` queues a core/v1 Event ``SliceAssigned`` on the pod, and a worker thread writes
it: the bind never waits for it (off the critical path), a full queue drops the event and counts it,
and a failed write is counted and logged at most once a minute. The extender's RBAC has ``create``
on ``events`` for this.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from extender.logs import RateLimitedLog
from gpuslice.annotations import Assignment, format_time

log = logging.getLogger(__name__)

REASON = "SliceAssigned"
COMPONENT = "gpu-slice-extender"
#: Binds waiting for their event; past this the newest are dropped (and counted), never the bind.
QUEUE_SIZE = 1000


@dataclass(frozen=True, slots=True)
class PodEvent:
    """One core/v1 Event about a pod."""

    namespace: str
    name: str
    uid: str
    reason: str
    message: str
    type: str = "Normal"

    def body(self, instance: str, now: datetime) -> dict[str, Any]:
        """The core/v1 Event, as client-go's recorder names and fills it."""
        stamp = format_time(now.replace(microsecond=0))
        return {"apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{self.name}.{time.time_ns():x}", "namespace": self.namespace},
                "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": self.namespace,
                                   "name": self.name, "uid": self.uid},
                "reason": self.reason, "message": self.message[:1024], "type": self.type, "count": 1,
                "firstTimestamp": stamp, "lastTimestamp": stamp,
                "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
                "reportingInstance": instance}


def bind_event(namespace: str, name: str, uid: str, a: Assignment) -> PodEvent:
    """``SliceAssigned``: the node, GPU or MIG instance and slice ids a bind gave the pod."""
    where = f"MIG instance {a.instance} of GPU {a.gpus[0]}" if a.instance else (
        f"GPU {a.gpus[0]}" if len(a.gpus) == 1 else f"GPUs {', '.join(a.gpus)}")
    return PodEvent(namespace, name, uid, REASON,
                    f"gpu-slice assigned node {a.node}, {where}, slices {', '.join(a.slice_ids)}")


class EventWriter:
    """Writes :class:`PodEvent` s on a daemon thread through ``create(namespace, body)`` (raises on
    failure). ``on_result(outcome)`` counts ``written``, ``failed`` and ``dropped``."""

    def __init__(self, create: Callable[[str, dict[str, Any]], None], *, instance: str = "",
                 on_result: Callable[[str], None] | None = None, size: int = QUEUE_SIZE) -> None:
        self._create = create
        self._instance = instance
        self._on_result = on_result
        self._queue: queue.Queue[PodEvent | None] = queue.Queue(maxsize=size)
        self._warn = RateLimitedLog(log)
        self._thread: threading.Thread | None = None

    def record(self, event: PodEvent) -> None:
        """Queue one event; never blocks."""
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._count("dropped")

    def _count(self, outcome: str) -> None:
        if self._on_result is not None:
            self._on_result(outcome)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="bind-events", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Write what is queued (within ``timeout``), then end."""
        if self._thread is None:
            return
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            if event is None:
                return
            try:
                self._create(event.namespace, event.body(self._instance, datetime.now(UTC)))
            except Exception as err:  # an event is worth a line, never the thread
                self._count("failed")
                self._warn.warning("write", "could not write the %s event of pod %s/%s: %s", event.reason,
                                   event.namespace, event.name, err)
            else:
                self._count("written")


def api_event_writer(api_client: Any, *, instance: str, on_result: Callable[[str], None] | None = None,
                     timeout_s: float = 5.0) -> EventWriter:
    """An :class:`EventWriter` that creates core/v1 Events through the API server, raw JSON over the
    Kubernetes client's own connection pool and credentials (as the binder sends its Binding)."""
    from extender.binder import ApiBinder

    return EventWriter(ApiBinder(api_client, timeout_s=timeout_s).create_event, instance=instance,
                       on_result=on_result)


__all__ = ["REASON", "EventWriter", "PodEvent", "api_event_writer", "bind_event"]
