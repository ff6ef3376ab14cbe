"""Stamping ``example.com/gpu-slice.allocated`` with the ids kubelet really gave, from PodResources.

``Allocate`` cannot say which pod it serves, so the truth comes afterwards: kubelet's PodResources
``List`` maps each admitted pod to its device ids. After every Allocate the stamper is nudged and
reads ``List`` (retrying with backoff while the new pod is not visible yet, or a patch fails), and
every ``resync_s`` it reads it anyway. Each newly admitted pod gets its stamp; a pod whose ids differ
from its assignment is counted (metric) and reported (event) once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import grpc

from deviceplugin._proto.podresources.v1 import api_pb2 as pr
from deviceplugin._proto.podresources.v1 import api_pb2_grpc as pr_grpc
from deviceplugin.assignments import AssignmentBook
from deviceplugin.errors import KubeApiError
from gpuslice.annotations import ALLOCATED_KEY, Allocated, encode_allocated

log = logging.getLogger(__name__)

PodKey = tuple[str, str]


class PodResourcesClient:
    """kubelet's PodResources API over its unix socket (the channel reconnects after kubelet restarts)."""

    def __init__(self, socket_path: Path, *, timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None

    def _stub(self) -> Any:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(f"unix://{self.socket_path}",
                                                      options=[("grpc.default_authority", "localhost")])
        return pr_grpc.PodResourcesListerStub(self._channel)

    async def list_pods(self) -> pr.ListPodResourcesResponse:
        resp: pr.ListPodResourcesResponse = await self._stub().List(pr.ListPodResourcesRequest(),
                                                                     timeout=self.timeout_s)
        return resp

    async def allocatable(self) -> list[tuple[str, list[str]]]:
        """(resource, device ids) of every resource kubelet can allocate, ours included."""
        resp = await self._stub().GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=self.timeout_s)
        return [(d.resource_name, list(d.device_ids)) for d in resp.devices]

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None


def admitted_ids(resp: pr.ListPodResourcesResponse, resource: str) -> dict[PodKey, tuple[str, ...]]:
    """(namespace, name) -> sorted ids of ``resource`` over the pod's containers."""
    out: dict[PodKey, tuple[str, ...]] = {}
    for pod in resp.pod_resources:
        ids = sorted({i for c in pod.containers for d in c.devices if d.resource_name == resource
                      for i in d.device_ids})
        if ids:
            out[(pod.namespace, pod.name)] = tuple(ids)
    return out


class StampWriter(Protocol):
    def __call__(self, namespace: str, name: str, uid: str, annotations: Mapping[str, str]) -> object: ...


class Mismatches(Protocol):
    def allocation_mismatch(self, kind: str) -> None: ...


EventFn = Callable[[str, str, str, str, str, str], Awaitable[None]]
"""(namespace, name, uid, reason, message, type) -> an Event on the pod (never raises)."""


@dataclass(frozen=True, slots=True)
class PassResult:
    """What one pass over ``List`` did."""

    admitted: int
    new: int
    stamped: int
    missing: int
    failed: int
    mismatched: int


class Stamper:
    """Writes ``allocated`` stamps from PodResources; see the module docstring for the retry rule."""

    def __init__(self, book: AssignmentBook, client: PodResourcesClient, resource: str, *,
                 write: StampWriter | None, event: EventFn | None = None, metrics: Mismatches | None = None,
                 retries: int = 8, backoff_s: float = 0.1, resync_s: float = 5.0,
                 on_admitted: Callable[[], None] | None = None) -> None:
        self.book = book
        self.client = client
        self.resource = resource
        self.write = write
        self.event = event
        self.metrics = metrics
        self.retries = retries
        self.backoff_s = backoff_s
        self.resync_s = resync_s
        self.on_admitted = on_admitted
        self._nudged = asyncio.Event()
        self._pending = 0
        self._stamped: dict[str, frozenset[str]] = {}  # pod uid -> ids we wrote
        self._reported: set[str] = set()  # pod uids whose mismatch was reported
        self._seen: set[PodKey] = set()
        self.mismatches = 0
        self.passes = 0

    def nudge(self) -> None:
        """An Allocate just happened: a newly admitted pod should show up in ``List`` soon."""
        self._pending += 1
        self._nudged.set()

    async def pass_once(self) -> PassResult:
        """Read ``List`` once and stamp every admitted pod whose stamp is missing or wrong."""
        self.passes += 1
        resp = await self.client.list_pods()
        admitted = admitted_ids(resp, self.resource)
        self.book.set_admitted(admitted, time.monotonic())
        new = len(set(admitted) - self._seen)
        self._seen = set(admitted)
        if self.on_admitted is not None:
            self.on_admitted()
        stamped = missing = failed = mismatched = 0
        for key, ids in sorted(admitted.items()):
            pod = self.book.pod_by_key(key)
            if pod is None:
                missing += 1
                continue
            wanted = frozenset(ids)
            if (pod.allocated_ids is not None and frozenset(pod.allocated_ids) == wanted) or \
                    self._stamped.get(pod.uid) == wanted:
                continue
            if pod.assignment_ids is not None and frozenset(pod.assignment_ids) != wanted:
                mismatched += 1
                if pod.uid not in self._reported:
                    self._reported.add(pod.uid)
                    self.mismatches += 1
                    if self.metrics is not None:
                        self.metrics.allocation_mismatch("stamp")
                    message = (f"kubelet gave slices {sorted(wanted)}, the assignment named "
                               f"{sorted(pod.assignment_ids)}; both are valid placements of this size")
                    log.warning("pod %s/%s: %s", key[0], key[1], message)
                    if self.event is not None:
                        await self.event(key[0], key[1], pod.uid, "SliceAssignmentMismatch", message, "Warning")
            if self.write is None:
                continue
            value = encode_allocated(Allocated(tuple(ids), datetime.now(UTC)))
            try:
                await asyncio.to_thread(self.write, key[0], key[1], pod.uid, {ALLOCATED_KEY: value})
            except KubeApiError as exc:
                failed += 1
                log.warning("stamping pod %s/%s failed (will retry): %s", key[0], key[1], exc)
                continue
            self._stamped[pod.uid] = wanted
            current = self.book.pods.get(pod.uid)
            if current is not None:
                self.book.upsert(replace(current, allocated_ids=tuple(ids)))
            stamped += 1
            log.info("stamped pod %s/%s allocated=%s", key[0], key[1], list(ids))
        live = {p.uid for p in self.book.pods.values()}
        self._stamped = {u: v for u, v in self._stamped.items() if u in live}
        self._reported &= live  # bounded by the pods on this node, like _stamped
        return PassResult(len(admitted), new, stamped, missing, failed, mismatched)

    async def _burst(self) -> None:
        """Passes with backoff until nudged pods are seen and nothing is missing or failed."""
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                result = await self.pass_once()
            except grpc.aio.AioRpcError as exc:
                log.warning("PodResources List failed: %s", exc.details() or exc.code().name)
                result = None
            if result is not None:
                self._pending = max(0, self._pending - result.new)
                if self._pending == 0 and not result.missing and not result.failed:
                    return
            if attempt < self.retries:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        if self._pending:
            log.info("%d Allocate call(s) not followed by a new pod in PodResources (admission failed?)",
                     self._pending)
        self._pending = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``: a burst after each nudge, a single pass every ``resync_s``."""
        while not stop.is_set():
            waiter = asyncio.ensure_future(self._nudged.wait())
            stopper = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({waiter, stopper}, timeout=self.resync_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                stopper.cancel()
            if stop.is_set():
                return
            self._nudged.clear()
            await self._burst()
