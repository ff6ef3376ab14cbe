"""A kubelet stand-in for device plugin tests, over real unix sockets.

It serves what a device plugin talks to on a node: ``Registration`` on
``<plugin_dir>/kubelet.sock`` and ``PodResourcesLister`` on
``<pod_resources_dir>/kubelet.sock``. Admission ports kubelet's device manager
(``pkg/kubelet/cm/devicemanager/manager.go``: ``Allocate``,
``allocateContainerResources``, ``devicesToAllocate``, ``filterByAffinity``;
reference/protocols.md 1.4-1.7) so that a plugin is tested against the choices kubelet
really makes, including the ones that hurt: the plugin's preference is only advice, ids
are topped up at random, ``Allocate`` does not say which pod it serves and has no deadline.

Where Go iterates a set or a map (random order), this stand-in uses a seeded RNG, so a
run is reproducible from its seed while a plugin still cannot rely on any order.

The server side is threaded (``grpc.server``) and the API is synchronous. A plugin
running on an asyncio loop in the same process must not be called from that loop's
thread: use the ``*_async`` helpers (they run the call in a worker thread).

Registration follows kubelet's ``plugin/v1beta1`` server and handler: a new ``Register`` replaces the
current client for a resource without closing the old one, and when *any* client's ListAndWatch
stream ends (``runClient``), whichever client is current for that resource is disconnected (all its
devices unhealthy). ``drop_stream`` ends the current stream from kubelet's side; ``withhold_streams``
makes the next registrations open no stream.

Checked against the real kubelet code (``kubelet-dm``, tests/kubelet/test_kubelet_dm.py): registration,
a dropped stream and the re-registration it needs, kubelet restarts (``restart(as_="kubelet-restart")``
and ``"node-reboot"``: re-admission needs healthy checkpointed ids), an Allocate refusal failing the
pod (kubelet writes ``UnexpectedAdmissionError``), what a container receives, and a resource nobody
registered (admitted without devices).

A resource no plugin ever registered is not refused: kubelet drops extended resources the node
does not have from the fit check, so such a pod is admitted with no devices for it.

Not modelled: the kubelet's general resource-fit predicate, the 5-minute removal of a resource
whose plugin went away, the CPU and memory managers, DRA.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2 as dp
from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from deviceplugin._proto.podresources.v1 import api_pb2 as pr
from deviceplugin._proto.podresources.v1 import api_pb2_grpc as pr_grpc

API_VERSION = "v1beta1"
SUPPORTED_VERSIONS = ("v1beta1",)
KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT_FILE = "kubelet_internal_checkpoint"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
DIAL_TIMEOUT_S = 10.0  # kubelet's dial timeout for a plugin endpoint
PRESTART_TIMEOUT_S = 30.0  # KubeletPreStartContainerRPCTimeoutInSecs
_MAX_UNIX_PATH = 107  # sun_path is 108 bytes including the NUL

_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def is_extended_resource_name(name: str) -> bool:
    """kubelet's v1helper.IsExtendedResourceName: domain-prefixed, not kubernetes.io, a valid qualified name."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    prefix, _, short = ("requests." + name).rpartition("/")
    return (
        len(prefix) <= 253
        and _DNS1123_SUBDOMAIN.match(prefix) is not None
        and 0 < len(short) <= 63
        and _QUALIFIED_NAME.match(short) is not None
    )


# --------------------------------------------------------------------------- pods


@dataclass(frozen=True)
class Container:
    """One container's extended-resource counts (requests == limits, integers).

    ``sidecar`` only means something for an init container (``restartPolicy: Always``):
    it keeps its devices, while a plain init container's devices go to later containers.
    ``numa_affinity`` is the Topology Manager's hint for this container; ``None`` is what
    kubelet has under the default ``none`` policy (every device counts as "no affinity").
    """

    name: str
    resources: Mapping[str, int] = field(default_factory=dict)
    sidecar: bool = False
    numa_affinity: frozenset[int] | None = None


@dataclass(frozen=True)
class Pod:
    """The little of a pod that kubelet's device manager looks at."""

    namespace: str
    name: str
    uid: str
    created: float
    containers: tuple[Container, ...]
    init_containers: tuple[Container, ...] = ()


def slice_pod(
    name: str,
    count: int,
    *,
    created: float,
    resource: str = "example.com/gpu-slice",
    namespace: str = "default",
    uid: str | None = None,
    container: str = "main",
) -> Pod:
    """A one-container pod asking ``count`` of ``resource`` (the common case in plugin tests)."""
    return Pod(
        namespace=namespace,
        name=name,
        uid=uid or f"uid-{namespace}-{name}",
        created=created,
        containers=(Container(container, {resource: count}),),
    )


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class PreferredCall:
    """What kubelet asked GetPreferredAllocation and what the plugin answered."""

    available: tuple[str, ...]
    must_include: tuple[str, ...]
    size: int
    answer: tuple[str, ...]


@dataclass(frozen=True)
class ContainerResult:
    """The devices of one resource given to one container during an admission."""

    container: str
    resource: str
    init: bool
    device_ids: tuple[str, ...]  # sorted
    reused: bool = False  # the container already had them (restart): no Allocate call
    from_init: tuple[str, ...] = ()  # taken from devices freed by init containers
    preferred: PreferredCall | None = None
    response: dp.ContainerAllocateResponse | None = None
    prestart_error: str | None = None


@dataclass(frozen=True)
class AdmissionResult:
    """Outcome of admitting one pod: admitted with per-container results, or the error kubelet reports."""

    pod: Pod
    admitted: bool
    error: str | None
    containers: tuple[ContainerResult, ...]

    def ids(self, resource: str | None = None, container: str | None = None) -> frozenset[str]:
        """All ids this admission handed out (optionally of one resource or container)."""
        return frozenset(
            d
            for c in self.containers
            if (resource is None or c.resource == resource) and (container is None or c.container == container)
            for d in c.device_ids
        )


@dataclass(frozen=True)
class Registration:
    """One accepted Register call. ``generation`` grows with every registration this stand-in accepts."""

    resource: str
    endpoint: str
    version: str
    options: dp.DevicePluginOptions  # as GetDevicePluginOptions answered
    request_options: dp.DevicePluginOptions | None  # as sent in RegisterRequest (kubelet ignores it)
    generation: int
    at: float


@dataclass(frozen=True)
class DeviceState:
    """kubelet's view of one resource: capacity = every device, allocatable = Healthy ones."""

    resource: str
    registered: bool  # an endpoint is connected now
    capacity: frozenset[str]
    allocatable: frozenset[str]
    in_use: frozenset[str]
    topology: Mapping[str, tuple[int, ...]]
    updates: int  # ListAndWatch messages received from the current endpoint

    @property
    def unhealthy(self) -> frozenset[str]:
        return self.capacity - self.allocatable

    @property
    def free(self) -> frozenset[str]:
        return self.allocatable - self.in_use


class AdmissionError(Exception):
    """A pod's admission failed; the message is kubelet's."""


# --------------------------------------------------------------------------- internals


@dataclass
class _Endpoint:
    resource: str
    path: Path
    channel: grpc.Channel
    stub: dp_grpc.DevicePluginStub
    options: dp.DevicePluginOptions
    generation: int
    updates: int = 0
    closed: bool = False
    stream_ended: bool = False
    call: grpc.Future | None = None  # the ListAndWatch call (cancellable)
    thread: threading.Thread | None = None


@dataclass
class _Resource:
    """Per-resource device bookkeeping (kubelet's allDevices / healthyDevices / unhealthyDevices)."""

    all_devices: dict[str, dp.Device] = field(default_factory=dict)
    healthy: set[str] = field(default_factory=set)
    unhealthy: set[str] = field(default_factory=set)


class _RegistrationServicer(dp_grpc.RegistrationServicer):
    def __init__(self, kubelet: KubeletStandin) -> None:
        self._kubelet = kubelet

    def Register(self, request: dp.RegisterRequest, context: grpc.ServicerContext) -> dp.Empty:
        error = self._kubelet._register(request)
        if error is not None:
            # kubelet returns a plain Go error: the plugin sees status UNKNOWN.
            context.abort(grpc.StatusCode.UNKNOWN, error)
        return dp.Empty()


class _PodResourcesServicer(pr_grpc.PodResourcesListerServicer):
    def __init__(self, kubelet: KubeletStandin) -> None:
        self._kubelet = kubelet

    def List(self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext) -> pr.ListPodResourcesResponse:
        return self._kubelet._list_pod_resources()

    def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> pr.AllocatableResourcesResponse:
        return self._kubelet._allocatable_resources()

    def Get(self, request: pr.GetPodResourcesRequest, context: grpc.ServicerContext) -> pr.GetPodResourcesResponse:
        found = self._kubelet._get_pod_resources(request.pod_namespace, request.pod_name)
        if found is None:
            context.abort(
                grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} in namespace {request.pod_namespace} not found"
            )
        return pr.GetPodResourcesResponse(pod_resources=found)


def _answer(call: PreferredCall | None) -> set[str]:
    return set(call.answer or ()) if call is not None else set()


def _unix_target(path: Path) -> str:
    return f"unix://{path.absolute()}"


def _check_socket_path(path: Path) -> None:
    if len(str(path.absolute())) > _MAX_UNIX_PATH:
        raise ValueError(f"unix socket path too long ({len(str(path.absolute()))} > {_MAX_UNIX_PATH}): {path}")


# --------------------------------------------------------------------------- the stand-in


class KubeletStandin:
    """Serves Registration and PodResourcesLister like kubelet and admits pods like its device manager.

    State that kubelet checkpoints (which pod/container holds which ids, known resources)
    survives ``restart()``; device lists and plugin connections do not.
    """

    def __init__(
        self,
        plugin_dir: str | os.PathLike[str],
        pod_resources_dir: str | os.PathLike[str],
        seed: int = 0,
        *,
        dial_timeout: float = DIAL_TIMEOUT_S,
    ) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.pod_resources_dir = Path(pod_resources_dir)
        self.kubelet_socket = self.plugin_dir / KUBELET_SOCKET
        self.pod_resources_socket = self.pod_resources_dir / KUBELET_SOCKET
        self.checkpoint_path = self.plugin_dir / CHECKPOINT_FILE
        _check_socket_path(self.kubelet_socket)
        _check_socket_path(self.pod_resources_socket)
        self._rng = random.Random(seed)
        self._dial_timeout = dial_timeout
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._admit_lock = threading.Lock()  # kubelet admits pods one at a time
        self._servers: list[grpc.Server] = []
        self._running = False
        self._generation = 0
        self._endpoints: dict[str, _Endpoint | None] = {}  # None: known (checkpoint) but not connected
        self._resources: dict[str, _Resource] = {}
        self._in_use: dict[str, set[str]] = {}  # kubelet's allocatedDevices
        # kubelet's podDevices: uid -> container -> resource -> ids
        self._pod_devices: dict[str, dict[str, dict[str, frozenset[str]]]] = {}
        self._pods: dict[str, Pod] = {}  # admitted, not deleted (kubelet's active pods)
        self.registrations: list[Registration] = []
        self._superseded: list[_Endpoint] = []  # replaced by a newer Register, still streaming
        self._still_running: set[str] = set()  # pod uids whose containers survived a kubelet restart
        self.withhold_streams = 0  # this many next registrations get no ListAndWatch stream (a test hook)
        self.disconnects: list[tuple[int, int]] = []  # (generation whose stream ended, generation disconnected)
        self.rejected_registrations: list[tuple[dp.RegisterRequest, str]] = []
        self.allocate_calls: list[tuple[str, str, tuple[str, ...]]] = []  # (pod uid, container, ids)

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Clean the plugin dir like kubelet does at start-up, then serve both sockets."""
        with self._lock:
            if self._running:
                return
            self.plugin_dir.mkdir(parents=True, exist_ok=True)
            self.pod_resources_dir.mkdir(parents=True, exist_ok=True)
            self._cleanup_plugin_dir()
            self._write_checkpoint()
            self._servers = [self._serve_registration(), self._serve_pod_resources()]
            self._running = True
            self._changed.notify_all()

    def stop(self) -> None:
        """Stop serving and drop every plugin connection. Sockets are left behind, as a dead kubelet leaves them."""
        with self._lock:
            servers, self._servers = self._servers, []
            self._running = False
            endpoints = [e for e in self._endpoints.values() if e is not None] + self._superseded
            self._superseded = []
            for resource in self._endpoints:
                self._endpoints[resource] = None
            self._changed.notify_all()
        for server in servers:
            server.stop(grace=0.2).wait(5)
        for ep in endpoints:
            self._close_endpoint(ep)
        for ep in endpoints:
            if ep.thread is not None:
                ep.thread.join(5)

    def restart(self, as_: str = "kubelet-restart") -> None:
        """A kubelet restart: stop, forget devices (capacity 0 until plugins re-register), keep the checkpoint,
        delete the sockets in the plugin dir, recreate kubelet.sock and serve again.

        ``as_`` is kubelet-dm's ``--restart-as``: ``kubelet-restart`` (containers kept running: during the
        first ``admit`` batch their checkpointed devices are kept without any check, manager.go
        devicesToAllocate's ``isContainerAlreadyRunning``) or ``node-reboot`` (nothing survived: every
        pod is re-admitted and fails if its checkpointed devices are not healthy)."""
        if as_ not in ("kubelet-restart", "node-reboot"):
            raise ValueError(f"restart as kubelet-restart or node-reboot, not {as_!r}")
        self.stop()
        with self._lock:
            for resource in self._resources:
                self._resources[resource] = _Resource()
                self._endpoints[resource] = None
            self._still_running = set(self._pods) if as_ == "kubelet-restart" else set()
        self.start()

    def __enter__(self) -> KubeletStandin:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- observing

    @property
    def generation(self) -> int:
        """The generation of the newest accepted registration (0: none yet)."""
        with self._lock:
            return self._generation

    def wait_for_registration(
        self, resource: str, timeout: float = 5.0, *, after: int | None = None, with_devices: bool = True
    ) -> Registration:
        """Wait until ``resource`` has a connected endpoint (newer than generation ``after`` if given) and,
        with ``with_devices``, its first device list arrived. Raises TimeoutError."""

        def ready() -> Registration | None:
            ep = self._endpoints.get(resource)
            if ep is None or ep.closed or (after is not None and ep.generation <= after):
                return None
            if with_devices and ep.updates == 0:
                return None
            return next(r for r in reversed(self.registrations) if r.generation == ep.generation)

        deadline = time.monotonic() + timeout
        with self._changed:
            while (reg := ready()) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no registration of {resource} within {timeout}s")
                self._changed.wait(left)
            return reg

    def wait_for_devices(
        self, resource: str, predicate: Callable[[DeviceState], bool], timeout: float = 5.0
    ) -> DeviceState:
        """Wait until kubelet's view of ``resource`` satisfies ``predicate``. Raises TimeoutError."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(state := self.devices(resource)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"devices of {resource} never matched within {timeout}s: {state}")
                self._changed.wait(left)
            return state

    def devices(self, resource: str) -> DeviceState:
        """A snapshot of kubelet's view of ``resource``."""
        with self._lock:
            res = self._resources.get(resource, _Resource())
            ep = self._endpoints.get(resource)
            return DeviceState(
                resource=resource,
                registered=ep is not None and not ep.closed,
                capacity=frozenset(res.healthy | res.unhealthy),
                allocatable=frozenset(res.healthy),
                in_use=frozenset(self._in_use.get(resource, ())),
                topology={i: tuple(n.ID for n in d.topology.nodes) for i, d in res.all_devices.items()},
                updates=ep.updates if ep is not None else 0,
            )

    def pod_devices(self, uid: str) -> dict[str, dict[str, frozenset[str]]]:
        """What kubelet recorded for a pod: container -> resource -> ids."""
        with self._lock:
            return {c: dict(r) for c, r in self._pod_devices.get(uid, {}).items()}

    # ---------------------------------------------------------------- pods

    def admit(self, pods: Sequence[Pod]) -> list[AdmissionResult]:
        """Admit pods serially, oldest first (ties in random order), as kubelet's HandlePodAdditions does.

        A pod already admitted goes through again as a container restart: it keeps its ids.
        Results come in admission order.
        """
        with self._lock:
            order = list(pods)
            self._rng.shuffle(order)  # Go's sort.Sort is not stable: equal times come in any order
        order.sort(key=lambda p: p.created)
        try:
            return [self.admit_one(p) for p in order]
        finally:
            with self._lock:
                self._still_running = set()  # sources are ready after the first batch

    def admit_one(self, pod: Pod) -> AdmissionResult:
        """Admit one pod: init containers, then app containers, one Allocate call per container and resource."""
        with self._admit_lock:
            results: list[ContainerResult] = []
            reusable: dict[str, set[str]] = {}  # kubelet's devicesToReuse for this pod
            try:
                for c in pod.init_containers:
                    results += self._allocate_container(pod, c, reusable, init=True)
                    mine = self._pod_devices.get(pod.uid, {}).get(c.name, {})
                    for resource, ids in mine.items():
                        if c.sidecar:  # keeps running: its devices are not reusable
                            reusable.get(resource, set()).difference_update(ids)
                        else:
                            reusable.setdefault(resource, set()).update(ids)
                for c in pod.containers:
                    results += self._allocate_container(pod, c, reusable, init=False)
                    for resource, ids in self._pod_devices.get(pod.uid, {}).get(c.name, {}).items():
                        reusable.get(resource, set()).difference_update(ids)
            except AdmissionError as e:
                with self._lock:
                    if pod.uid not in self._pods:  # a rejected pod is not active: kubelet frees what it took
                        self._pod_devices.pop(pod.uid, None)
                    self._recompute_in_use()
                    self._write_checkpoint()
                    self._changed.notify_all()
                return AdmissionResult(pod, False, str(e), tuple(results))
            with self._lock:
                self._pods[pod.uid] = pod
                self._write_checkpoint()
                self._changed.notify_all()
            results = [self._prestart(pod, r) for r in results]
            return AdmissionResult(pod, True, None, tuple(results))

    def delete_pod(self, uid: str) -> None:
        """The pod is gone: its devices are free for the next admission."""
        with self._lock:
            self._pods.pop(uid, None)
            self._pod_devices.pop(uid, None)
            self._recompute_in_use()
            self._write_checkpoint()
            self._changed.notify_all()

    async def admit_async(self, pods: Sequence[Pod]) -> list[AdmissionResult]:
        """``admit`` off the event loop, so a grpc.aio plugin on that loop can answer."""
        return await asyncio.to_thread(self.admit, pods)

    async def wait_for_registration_async(
        self, resource: str, timeout: float = 5.0, *, after: int | None = None, with_devices: bool = True
    ) -> Registration:
        """``wait_for_registration`` off the event loop."""
        return await asyncio.to_thread(
            self.wait_for_registration, resource, timeout, after=after, with_devices=with_devices
        )

    # ---------------------------------------------------------------- registration

    def _register(self, req: dp.RegisterRequest) -> str | None:
        """kubelet's Register handler; returns the error message or None."""
        err: str | None
        if req.version not in SUPPORTED_VERSIONS:
            err = (
                f"requested API version {req.version!r} is not supported by kubelet. "
                f"Supported versions are {list(SUPPORTED_VERSIONS)!r}"
            )
        elif not is_extended_resource_name(req.resource_name):
            err = f"the ResourceName {req.resource_name!r} is invalid"
        else:
            err = self._connect(req)
        if err is not None:
            with self._lock:
                self.rejected_registrations.append((req, err))
                self._changed.notify_all()
        return err

    def _connect(self, req: dp.RegisterRequest) -> str | None:
        """Dial the plugin's socket and ask its options, synchronously, before Register returns."""
        path = self.plugin_dir / req.endpoint
        channel = grpc.insecure_channel(_unix_target(path), options=[("grpc.default_authority", "localhost")])
        try:
            grpc.channel_ready_future(channel).result(timeout=self._dial_timeout)
        except grpc.FutureTimeoutError:
            channel.close()
            return f"failed to dial device plugin: context deadline exceeded ({path})"
        stub = dp_grpc.DevicePluginStub(channel)
        try:
            options = stub.GetDevicePluginOptions(dp.Empty())  # kubelet sets no deadline here
        except grpc.RpcError as e:
            channel.close()
            return f"failed to get device plugin options: {e.code()}: {e.details()}"
        with self._lock:
            if not self._running:
                channel.close()
                return "kubelet is shutting down"
            self._generation += 1
            ep = _Endpoint(req.resource_name, path, channel, stub, options, self._generation)
            old = self._endpoints.get(req.resource_name)
            self._endpoints[req.resource_name] = ep  # the newest registration wins
            self._resources.setdefault(req.resource_name, _Resource())
            self.registrations.append(
                Registration(
                    resource=req.resource_name,
                    endpoint=req.endpoint,
                    version=req.version,
                    options=options,
                    request_options=req.options if req.HasField("options") else None,
                    generation=ep.generation,
                    at=time.monotonic(),
                )
            )
            if self.withhold_streams > 0:  # a test hook: Register succeeds but no stream is opened
                self.withhold_streams -= 1
            else:
                ep.thread = threading.Thread(target=self._watch, args=(ep,), name=f"kubelet-law-{ep.generation}")
                ep.thread.daemon = True
                ep.thread.start()
            if old is not None:
                self._superseded.append(old)  # kubelet keeps the old client running: it is not closed
            self._changed.notify_all()
        return None

    def _watch(self, ep: _Endpoint) -> None:
        """kubelet's client.Run then server.runClient: take every device list the stream sends (from the
        old client too: kubelet's receiver does not check which client sent it); when the stream ends,
        disconnect *whichever client is current* for the resource (handler.go runClient)."""
        try:
            call = ep.stub.ListAndWatch(dp.Empty())
            with self._lock:
                ep.call = call
            for resp in call:
                with self._lock:
                    self._update_devices(ep.resource, resp.devices)
                    ep.updates += 1
                    self._changed.notify_all()
        except grpc.RpcError:
            pass
        finally:
            with self._lock:
                ep.stream_ended = True
                current = self._endpoints.get(ep.resource)
                if current is not None and not current.closed and self._running:
                    self.disconnects.append((ep.generation, current.generation))
                    self._disconnect(current)
                self._changed.notify_all()

    def _disconnect(self, ep: _Endpoint) -> None:
        """kubelet's disconnectClient: deregister, close the connection, PluginDisconnected (all devices
        unhealthy, capacity stays until the 5 min grace ends). Called with the lock held."""
        if self._endpoints.get(ep.resource) is ep:
            self._endpoints[ep.resource] = None
        res = self._resources.get(ep.resource)
        if res is not None:
            res.unhealthy |= res.healthy
            res.healthy = set()
        ep.closed = True
        ep.channel.close()

    def drop_stream(self, resource: str) -> None:
        """End the current client's ListAndWatch stream from kubelet's side (a broken connection)."""
        with self._lock:
            ep = self._endpoints.get(resource)
            call = ep.call if ep is not None else None
        if call is not None:
            call.cancel()

    def _update_devices(self, resource: str, devices: Iterable[dp.Device]) -> None:
        res = _Resource()
        for d in devices:
            res.all_devices[d.ID] = d
            (res.healthy if d.health == HEALTHY else res.unhealthy).add(d.ID)
        self._resources[resource] = res

    def _close_endpoint(self, ep: _Endpoint) -> None:
        ep.closed = True
        ep.channel.close()  # cancels its ListAndWatch stream

    # ---------------------------------------------------------------- allocation (kubelet's device manager)

    def _allocate_container(
        self, pod: Pod, c: Container, reusable: dict[str, set[str]], *, init: bool
    ) -> list[ContainerResult]:
        """kubelet's allocateContainerResources for one container."""
        results: list[ContainerResult] = []
        items = list(c.resources.items())
        with self._lock:
            self._rng.shuffle(items)  # Go map order
        for resource, required in items:
            if required <= 0:
                continue
            with self._lock:
                known = resource in self._resources or resource in self._in_use
            if not known:
                # Not a device plugin resource (manager.go isDevicePluginResource): the device manager
                # skips it, and kubelet's fit predicate drops extended resources the node does not have
                # (lifecycle/predicate.go removeMissingExtendedResources): the pod is admitted without it.
                continue
            chosen = self._devices_to_allocate(pod, c, resource, required, reusable.get(resource, set()))
            if chosen.ids is None:
                existing = self._pod_devices[pod.uid][c.name][resource]
                results.append(ContainerResult(c.name, resource, init, tuple(sorted(existing)), reused=True))
                continue
            with self._lock:
                ep = self._endpoints.get(resource)
            if ep is None or ep.closed:
                self._reset_in_use()
                raise AdmissionError(f"unknown Device Plugin {resource}")
            ids = self._shuffled(chosen.ids)
            self.allocate_calls.append((pod.uid, c.name, tuple(ids)))
            request = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)])
            try:
                resp = ep.stub.Allocate(request)  # no deadline, like kubelet
            except grpc.RpcError as e:
                self._reset_in_use()
                raise AdmissionError(f"rpc error: code = {e.code().name} desc = {e.details()}") from None
            if len(resp.container_responses) == 0:
                raise AdmissionError(f"no containers return in allocation response {resp}")
            with self._lock:
                self._pod_devices.setdefault(pod.uid, {}).setdefault(c.name, {})[resource] = frozenset(chosen.ids)
            results.append(
                ContainerResult(
                    c.name,
                    resource,
                    init,
                    tuple(sorted(chosen.ids)),
                    from_init=tuple(sorted(chosen.from_init)),
                    preferred=chosen.preferred,
                    response=resp.container_responses[0],
                )
            )
        return results

    @dataclass
    class _Choice:
        ids: set[str] | None  # None: nothing to allocate (the container already has its devices)
        from_init: set[str] = field(default_factory=set)
        preferred: PreferredCall | None = None

    def _devices_to_allocate(
        self, pod: Pod, c: Container, resource: str, required: int, reusable: set[str]
    ) -> KubeletStandin._Choice:
        """kubelet's devicesToAllocate: which ids this container gets, before the Allocate call."""
        with self._lock:
            needed = required
            existing = self._pod_devices.get(pod.uid, {}).get(c.name, {}).get(resource)
            if existing is not None:
                needed -= len(existing)
                if needed != 0:
                    raise AdmissionError(
                        f"pod {pod.uid!r} container {c.name!r} changed request for resource {resource!r} "
                        f"from {len(existing)} to {required}"
                    )
            if existing is not None and pod.uid in self._still_running:
                return self._Choice(None)  # a kubelet restart with the container running: nothing to do
            if resource not in self._resources:
                raise AdmissionError(f"cannot allocate unregistered device {resource}")
            healthy = self._resources[resource].healthy
            if not healthy:
                raise AdmissionError(f"no healthy devices present; cannot allocate unhealthy devices {resource}")
            if existing is not None and not existing <= healthy:
                raise AdmissionError(
                    f"previously allocated devices are no longer healthy; cannot allocate unhealthy devices {resource}"
                )
            if needed == 0:
                return self._Choice(None)

            self._in_use.setdefault(resource, set())
            allocated: set[str] = set()

            def take_from(candidates: Iterable[str]) -> bool:
                """kubelet's allocateRemainingFrom: random order; True once nothing more is needed."""
                nonlocal needed
                for d in self._shuffled(set(candidates) - allocated):
                    # re-fetched: a concurrent delete may have rebuilt the map while the lock was free
                    self._in_use.setdefault(resource, set()).add(d)
                    allocated.add(d)
                    needed -= 1
                    if needed == 0:
                        return True
                return False

            if take_from(reusable):
                return self._Choice(allocated, from_init=set(allocated))
            from_init = set(allocated)
            available = healthy - self._in_use[resource]
            if len(available) < needed:
                raise AdmissionError(
                    f"requested number of devices unavailable for {resource}. "
                    f"Requested: {needed}, Available: {len(available)}"
                )
            aligned, unaligned, no_affinity = self._filter_by_affinity(c, resource, available)

        def done(preferred: PreferredCall | None) -> KubeletStandin._Choice:
            return self._Choice(allocated, from_init=from_init, preferred=preferred)

        if needed < len(aligned):
            preferred = self._preferred(resource, aligned | allocated, set(allocated), required)
            with self._lock:
                if take_from(_answer(preferred) & aligned) or take_from(aligned):
                    return done(preferred)
            raise AdmissionError(
                f"unexpectedly allocated less resources than required. Requested: {required}, Got: {required - needed}"
            )
        with self._lock:
            if take_from(aligned):
                return done(None)
        preferred = self._preferred(resource, available | allocated, set(allocated), required)
        with self._lock:
            if take_from(_answer(preferred) & available) or take_from(unaligned) or take_from(no_affinity):
                return done(preferred)
        raise AdmissionError(
            f"unexpectedly allocated less resources than required. Requested: {required}, Got: {required - needed}"
        )

    def _filter_by_affinity(
        self, c: Container, resource: str, available: set[str]
    ) -> tuple[set[str], set[str], set[str]]:
        """kubelet's filterByAffinity: split by the Topology Manager hint into aligned / unaligned / no affinity.

        kubelet sorts NUMA nodes (hinted first, no-topology last) and files a device under the
        first node that has it; since results are sets, that equals: any hinted node -> aligned,
        other nodes only -> unaligned, no nodes -> no affinity.
        """
        devices = self._resources[resource].all_devices
        has_topology = any(len(d.topology.nodes) > 0 for d in devices.values())
        if not has_topology or c.numa_affinity is None:
            return set(), set(), set(available)
        aligned, unaligned, none = set(), set(), set()
        for d in available:
            nodes = {n.ID for n in devices[d].topology.nodes}
            if not nodes:
                none.add(d)
            elif nodes & c.numa_affinity:
                aligned.add(d)
            else:
                unaligned.add(d)
        return aligned, unaligned, none

    def _preferred(self, resource: str, available: set[str], must_include: set[str], size: int) -> PreferredCall | None:
        """kubelet's callGetPreferredAllocationIfAvailable (None: the plugin's options say not to call).

        An RPC error fails the admission."""
        with self._lock:
            ep = self._endpoints.get(resource)
        if ep is None or ep.closed:
            raise AdmissionError(f"endpoint not found in cache for a registered resource: {resource}")
        if not ep.options.get_preferred_allocation_available:
            return None
        avail, must = self._shuffled(available), self._shuffled(must_include)
        request = dp.PreferredAllocationRequest(
            container_requests=[
                dp.ContainerPreferredAllocationRequest(
                    available_deviceIDs=avail, must_include_deviceIDs=must, allocation_size=size
                )
            ]
        )
        try:
            resp = ep.stub.GetPreferredAllocation(request)  # no deadline, like kubelet
        except grpc.RpcError as e:
            self._reset_in_use()
            raise AdmissionError(
                f"device plugin GetPreferredAllocation rpc failed with err: {e.code().name}: {e.details()}"
            ) from None
        answer = tuple(resp.container_responses[0].deviceIDs) if resp.container_responses else ()
        return PreferredCall(tuple(avail), tuple(must), size, answer)

    def _prestart(self, pod: Pod, r: ContainerResult) -> ContainerResult:
        """PreStartContainer before the container starts, when the plugin asked for it (30 s deadline).

        A failure fails the container start, not the admission; it is recorded on the result.
        """
        with self._lock:
            ep = self._endpoints.get(r.resource)
        if ep is None or ep.closed or not ep.options.pre_start_required:
            return r
        try:
            ep.stub.PreStartContainer(
                dp.PreStartContainerRequest(devices_ids=self._shuffled(r.device_ids)), timeout=PRESTART_TIMEOUT_S
            )
        except grpc.RpcError as e:
            return ContainerResult(
                r.container,
                r.resource,
                r.init,
                r.device_ids,
                r.reused,
                r.from_init,
                r.preferred,
                r.response,
                prestart_error=f"device plugin PreStartContainer rpc failed with err: {e.details()}",
            )
        return r

    def _shuffled(self, ids: Iterable[str]) -> list[str]:
        with self._lock:
            out = sorted(ids)
            self._rng.shuffle(out)
            return out

    def _recompute_in_use(self) -> None:
        in_use: dict[str, set[str]] = {r: set() for r in self._in_use}
        for containers in self._pod_devices.values():
            for resources in containers.values():
                for resource, ids in resources.items():
                    in_use.setdefault(resource, set()).update(ids)
        self._in_use = in_use

    def _reset_in_use(self) -> None:
        """After a failed RPC kubelet rebuilds allocatedDevices from what pods really hold."""
        with self._lock:
            self._recompute_in_use()

    # ---------------------------------------------------------------- pod resources

    def _container_devices(self, uid: str, container: str) -> list[pr.ContainerDevices]:
        """One entry per device id (and NUMA node), as kubelet's containerDevicesFromResourceDeviceInstances."""
        out: list[pr.ContainerDevices] = []
        for resource, ids in self._pod_devices.get(uid, {}).get(container, {}).items():
            out += self._device_entries(resource, ids)
        return out

    def _device_entries(self, resource: str, ids: Iterable[str]) -> list[pr.ContainerDevices]:
        known = self._resources.get(resource, _Resource()).all_devices
        out: list[pr.ContainerDevices] = []
        for d in self._shuffled(ids):
            nodes = [n.ID for n in known[d].topology.nodes] if d in known else []
            if not nodes:
                out.append(pr.ContainerDevices(resource_name=resource, device_ids=[d]))
            for n in nodes:
                out.append(
                    pr.ContainerDevices(
                        resource_name=resource,
                        device_ids=[d],
                        topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=n)]),
                    )
                )
        return out

    def _pod_resources(self, pod: Pod) -> pr.PodResources:
        listed = [c for c in pod.init_containers if c.sidecar] + list(pod.containers)
        return pr.PodResources(
            name=pod.name,
            namespace=pod.namespace,
            containers=[
                pr.ContainerResources(name=c.name, devices=self._container_devices(pod.uid, c.name)) for c in listed
            ],
        )

    def _list_pod_resources(self) -> pr.ListPodResourcesResponse:
        with self._lock:
            pods = [self._pods[u] for u in self._shuffled(self._pods)]
            return pr.ListPodResourcesResponse(pod_resources=[self._pod_resources(p) for p in pods])

    def _get_pod_resources(self, namespace: str, name: str) -> pr.PodResources | None:
        with self._lock:
            for pod in self._pods.values():
                if (pod.namespace, pod.name) == (namespace, name):
                    return self._pod_resources(pod)
            return None

    def _allocatable_resources(self) -> pr.AllocatableResourcesResponse:
        with self._lock:
            devices: list[pr.ContainerDevices] = []
            for resource, res in self._resources.items():
                devices += self._device_entries(resource, res.healthy)
            return pr.AllocatableResourcesResponse(devices=devices)

    # ---------------------------------------------------------------- servers and files

    def _serve_registration(self) -> grpc.Server:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kubelet-reg"))
        dp_grpc.add_RegistrationServicer_to_server(_RegistrationServicer(self), server)
        server.add_insecure_port(_unix_target(self.kubelet_socket))
        server.start()
        return server

    def _serve_pod_resources(self) -> grpc.Server:
        with contextlib.suppress(FileNotFoundError):
            self.pod_resources_socket.unlink()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kubelet-podres"))
        pr_grpc.add_PodResourcesListerServicer_to_server(_PodResourcesServicer(self), server)
        server.add_insecure_port(_unix_target(self.pod_resources_socket))
        server.start()
        return server

    def _cleanup_plugin_dir(self) -> None:
        """kubelet's CleanupPluginDirectory: remove every socket in the dir but keep the checkpoint."""
        for entry in self.plugin_dir.iterdir():
            if entry.name == CHECKPOINT_FILE:
                continue
            try:
                if stat.S_ISSOCK(entry.lstat().st_mode):
                    entry.unlink()
            except FileNotFoundError:
                continue

    def _write_checkpoint(self) -> None:
        """A JSON file in the spirit of kubelet's checkpoint (plugins may watch the dir and see it)."""
        data = {
            "PodDeviceEntries": [
                {"PodUID": uid, "ContainerName": c, "ResourceName": r, "DeviceIDs": sorted(ids)}
                for uid, containers in sorted(self._pod_devices.items())
                for c, resources in sorted(containers.items())
                for r, ids in sorted(resources.items())
            ],
            "RegisteredDevices": {r: sorted(res.healthy) for r, res in sorted(self._resources.items())},
        }
        tmp = self.checkpoint_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"Data": data}, indent=1))
        tmp.replace(self.checkpoint_path)
