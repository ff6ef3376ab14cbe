"""Tests of the kubelet stand-in itself, against a tiny threaded device plugin defined here."""

from __future__ import annotations

import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2 as dp
from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from deviceplugin._proto.podresources.v1 import api_pb2 as pr
from deviceplugin._proto.podresources.v1 import api_pb2_grpc as pr_grpc

from .standin import (
    CHECKPOINT_FILE,
    Container,
    KubeletStandin,
    Pod,
    is_extended_resource_name,
    slice_pod,
)

pytestmark = pytest.mark.timeout(60)

RESOURCE = "example.com/gpu-slice"
Prefer = Callable[[dp.ContainerPreferredAllocationRequest], Sequence[str]]


def device(i: str, *, numa: int | None = None, health: str = "Healthy") -> dp.Device:
    topo = dp.TopologyInfo(nodes=[dp.NUMANode(ID=numa)]) if numa is not None else None
    return dp.Device(ID=i, health=health, topology=topo)


def slices(n: int, prefix: str = "GPU-a::") -> list[dp.Device]:
    return [device(f"{prefix}{k}") for k in range(n)]


class DummyPlugin(dp_grpc.DevicePluginServicer):
    """Just enough device plugin to drive the stand-in: serves, registers, streams, answers."""

    def __init__(
        self,
        plugin_dir: Path,
        devices: Sequence[dp.Device],
        *,
        endpoint: str = "dummy.sock",
        resource: str = RESOURCE,
        preferred: bool = True,
        prefer: Prefer | None = None,
        pre_start: bool = False,
    ) -> None:
        self.plugin_dir = plugin_dir
        self.socket = plugin_dir / endpoint
        self.endpoint = endpoint
        self.resource = resource
        self.options = dp.DevicePluginOptions(
            get_preferred_allocation_available=preferred, pre_start_required=pre_start
        )
        self.prefer = prefer
        self.calls: list[tuple[str, object]] = []
        self.allocate_error: str | None = None
        self.allocate_empty = False
        self._cond = threading.Condition()
        self._devices = list(devices)
        self._version = 0
        self._server: grpc.Server | None = None
        self._stop_watch = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- DevicePlugin service
    def GetDevicePluginOptions(self, request: dp.Empty, context: object) -> dp.DevicePluginOptions:
        self.calls.append(("GetDevicePluginOptions", request))
        return self.options

    def ListAndWatch(self, request: dp.Empty, context: grpc.ServicerContext) -> Iterator[dp.ListAndWatchResponse]:
        sent = -1
        while context.is_active():
            with self._cond:
                if sent == self._version:
                    self._cond.wait(0.05)
                    continue
                sent, devices = self._version, list(self._devices)
            yield dp.ListAndWatchResponse(devices=devices)

    def GetPreferredAllocation(
        self, request: dp.PreferredAllocationRequest, context: object
    ) -> dp.PreferredAllocationResponse:
        self.calls.append(("GetPreferredAllocation", request))
        (req,) = request.container_requests
        ids = self.prefer(req) if self.prefer else list(req.available_deviceIDs)[: req.allocation_size]
        return dp.PreferredAllocationResponse(
            container_responses=[dp.ContainerPreferredAllocationResponse(deviceIDs=ids)]
        )

    def Allocate(self, request: dp.AllocateRequest, context: grpc.ServicerContext) -> dp.AllocateResponse:
        self.calls.append(("Allocate", request))
        if self.allocate_error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.allocate_error)
        if self.allocate_empty:
            return dp.AllocateResponse()
        return dp.AllocateResponse(
            container_responses=[
                dp.ContainerAllocateResponse(envs={"SLICES": ",".join(sorted(r.devices_ids))})
                for r in request.container_requests
            ]
        )

    def PreStartContainer(self, request: dp.PreStartContainerRequest, context: object) -> dp.PreStartContainerResponse:
        self.calls.append(("PreStartContainer", request))
        return dp.PreStartContainerResponse()

    # -- driving it
    def set_devices(self, devices: Sequence[dp.Device]) -> None:
        with self._cond:
            self._devices, self._version = list(devices), self._version + 1
            self._cond.notify_all()

    def serve(self) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        dp_grpc.add_DevicePluginServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server

    def register(self, version: str = "v1beta1", resource: str | None = None) -> None:
        with grpc.insecure_channel(f"unix://{self.plugin_dir / 'kubelet.sock'}") as ch:
            dp_grpc.RegistrationStub(ch).Register(
                dp.RegisterRequest(
                    version=version,
                    endpoint=self.endpoint,
                    resource_name=resource or self.resource,
                    options=self.options,
                ),
                timeout=15,
                wait_for_ready=True,
            )

    def start(self, *, register: bool = True) -> DummyPlugin:
        self.serve()
        if register:
            self.register()
        return self

    def stop_serving(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0).wait(5)
            self._server = None

    def watch_for_kubelet_restart(self) -> None:
        """Re-serve and re-register when the socket disappears (what a real plugin must do)."""

        def loop() -> None:
            while not self._stop_watch.wait(0.05):
                if self._server is not None and not self.socket.exists():
                    self.stop_serving()
                    self.serve()
                    self.register()

        self._watcher = threading.Thread(target=loop, daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        self._stop_watch.set()
        if self._watcher is not None:
            self._watcher.join(20)
        self.stop_serving()

    def called(self, method: str) -> list[object]:
        return [req for m, req in self.calls if m == method]


@pytest.fixture
def dirs() -> Iterator[tuple[Path, Path]]:
    root = Path(tempfile.mkdtemp(prefix="kl"))  # short: unix socket paths are capped at 107 bytes
    (root / "dp").mkdir()
    (root / "pr").mkdir()
    yield root / "dp", root / "pr"
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def kubelet(dirs: tuple[Path, Path]) -> Iterator[KubeletStandin]:
    with KubeletStandin(*dirs, seed=7) as k:
        yield k


@pytest.fixture
def make_plugin(kubelet: KubeletStandin) -> Iterator[Callable[..., DummyPlugin]]:
    made: list[DummyPlugin] = []

    def make(devices: Sequence[dp.Device] | None = None, *, register: bool = True, **kw: object) -> DummyPlugin:
        p = DummyPlugin(kubelet.plugin_dir, slices(4) if devices is None else devices, **kw)  # type: ignore[arg-type]
        made.append(p)
        return p.start(register=register)

    yield make
    for p in made:
        p.stop()


def pod_resources_stub(kubelet: KubeletStandin) -> tuple[grpc.Channel, pr_grpc.PodResourcesListerStub]:
    ch = grpc.insecure_channel(f"unix://{kubelet.pod_resources_socket}")
    return ch, pr_grpc.PodResourcesListerStub(ch)


# ----------------------------------------------------------------------------- registration


def test_register_reads_options_synchronously_then_watches(
    kubelet: KubeletStandin, make_plugin: Callable[..., DummyPlugin]
) -> None:
    plugin = make_plugin(preferred=True)
    # Register returned: kubelet must already have dialled the plugin and read its options.
    assert len(plugin.called("GetDevicePluginOptions")) == 1
    reg = kubelet.wait_for_registration(RESOURCE, timeout=5)
    assert (reg.resource, reg.endpoint, reg.version) == (RESOURCE, "dummy.sock", "v1beta1")
    assert reg.options.get_preferred_allocation_available
    state = kubelet.devices(RESOURCE)
    assert state.registered and state.capacity == state.allocatable == {f"GPU-a::{k}" for k in range(4)}


@pytest.mark.parametrize(
    ("version", "resource", "message"),
    [
        ("v1alpha", RESOURCE, "requested API version 'v1alpha' is not supported"),
        ("v1beta1", "gpu-slice", "the ResourceName 'gpu-slice' is invalid"),
        ("v1beta1", "kubernetes.io/gpu", "is invalid"),
        ("v1beta1", "example.com/bad name", "is invalid"),
    ],
)
def test_register_validates_version_and_resource_name(
    kubelet: KubeletStandin, make_plugin: Callable[..., DummyPlugin], version: str, resource: str, message: str
) -> None:
    plugin = make_plugin(register=False)
    with pytest.raises(grpc.RpcError) as err:
        plugin.register(version=version, resource=resource)
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert message in (err.value.details() or "")
    assert not plugin.calls, "kubelet validates before dialling the plugin"
    assert kubelet.rejected_registrations[-1][1] == err.value.details()


def test_register_fails_when_the_endpoint_does_not_serve(dirs: tuple[Path, Path]) -> None:
    with KubeletStandin(*dirs, dial_timeout=0.3) as kubelet:
        with grpc.insecure_channel(f"unix://{kubelet.kubelet_socket}") as ch, pytest.raises(grpc.RpcError) as err:
            dp_grpc.RegistrationStub(ch).Register(
                dp.RegisterRequest(version="v1beta1", endpoint="absent.sock", resource_name=RESOURCE), timeout=5
            )
        assert "failed to dial device plugin" in (err.value.details() or "")
        assert not kubelet.devices(RESOURCE).registered


def test_extended_resource_names() -> None:
    assert is_extended_resource_name("example.com/gpu-slice")
    assert is_extended_resource_name("nvidia.com/mig-1g.10gb")
    for bad in ("gpu", "kubernetes.io/x", "requests.example.com/x", "Example.com/x", "example.com/", "a/b c"):
        assert not is_extended_resource_name(bad), bad


def test_health_changes_and_plugin_exit(kubelet: KubeletStandin, make_plugin: Callable[..., DummyPlugin]) -> None:
    plugin = make_plugin()
    kubelet.wait_for_registration(RESOURCE)
    plugin.set_devices([*slices(3), device("GPU-a::3", health="Unhealthy")])
    state = kubelet.wait_for_devices(RESOURCE, lambda s: len(s.allocatable) == 3)
    assert state.capacity == {f"GPU-a::{k}" for k in range(4)} and state.unhealthy == {"GPU-a::3"}
    plugin.stop()
    state = kubelet.wait_for_devices(RESOURCE, lambda s: not s.registered)
    assert state.allocatable == set() and len(state.capacity) == 4  # all unhealthy, capacity kept


def test_newer_registration_replaces_the_endpoint_but_the_old_stream_ending_disconnects_it(
    kubelet: KubeletStandin, make_plugin: Callable[..., DummyPlugin]
) -> None:
    """kubelet (plugin/v1beta1/handler.go runClient): a new Register does not close the old client, and
    when the old client's stream ends, whichever client is current for the resource is disconnected."""
    old = make_plugin(endpoint="old.sock")
    first = kubelet.wait_for_registration(RESOURCE)
    new = make_plugin(slices(2, "GPU-b::"), endpoint="new.sock")
    second = kubelet.wait_for_registration(RESOURCE, after=first.generation)
    assert second.endpoint == "new.sock"
    assert kubelet.devices(RESOURCE).capacity == {"GPU-b::0", "GPU-b::1"}
    (res,) = kubelet.admit([slice_pod("p", 1, created=1)])
    assert res.admitted and res.ids() <= {"GPU-b::0", "GPU-b::1"}
    assert new.called("Allocate") and not old.called("Allocate")
    old.stop()  # the replaced endpoint's stream ends: the *new* client is disconnected
    state = kubelet.wait_for_devices(RESOURCE, lambda s: not s.registered)
    assert state.allocatable == set() and kubelet.disconnects == [(first.generation, second.generation)]


def test_dropped_stream_disconnects_the_plugin(
    kubelet: KubeletStandin, make_plugin: Callable[..., DummyPlugin]
) -> None:
    make_plugin()
    kubelet.wait_for_registration(RESOURCE)
    kubelet.drop_stream(RESOURCE)
    state = kubelet.wait_for_devices(RESOURCE, lambda s: not s.registered)
    assert state.allocatable == set() and len(state.capacity) == 4


# ----------------------------------------------------------------------------- admission


def test_serial_admission_oldest_first_one_allocate_per_container(
    kubelet: KubeletStandin, make_plugin: Callable[..., DummyPlugin]
) -> None:
    plugin = make_plugin(slices(9))
    kubelet.wait_for_registration(RESOURCE)
    two = (Container("a", {RESOURCE: 1}), Container("b", {RESOURCE: 2}))
    pods = [
        Pod("ns", "late", "u3", created=3.0, containers=two),
        Pod("ns", "early", "u1", created=1.0, containers=two),
        Pod("ns", "middle", "u2", created=2.0, containers=two),
    ]
    results = kubelet.admit(pods)
    assert [r.pod.uid for r in results] == ["u1", "u2", "u3"]
    assert all(r.admitted for r in results)
    assert [(uid, c) for uid, c, _ in kubelet.allocate_calls] == [
        (u, c) for u in ("u1", "u2", "u3") for c in ("a", "b")
    ]
    for req in plugin.called("Allocate"):
        assert isinstance(req, dp.AllocateRequest) and len(req.container_requests) == 1
    given = [r.ids() for r in results]
    assert sum(len(g) for g in given) == 9 and len(frozenset().union(*given)) == 9  # never shared
    assert results[0].containers[0].response is not None
    assert results[0].containers[0].response.envs["SLICES"]


def test_preference_is_advice_and_shortfall_is_topped_up_at_random(
    dirs: tuple[Path, Path],
) -> None:
    def prefer(req: dp.ContainerPreferredAllocationRequest) -> list[str]:
        return ["not-a-candidate", "GPU-a::5"]

    picks = []
    for _ in range(2):  # same seed, same answer
        with KubeletStandin(*dirs, seed=3) as kubelet:
            plugin = DummyPlugin(kubelet.plugin_dir, slices(8), prefer=prefer).start()
            try:
                kubelet.wait_for_registration(RESOURCE)
                (res,) = kubelet.admit([slice_pod("p", 3, created=1)])
            finally:
                plugin.stop()
        assert res.admitted
        (c,) = res.containers
        assert c.preferred is not None
        assert set(c.preferred.available) == {f"GPU-a::{k}" for k in range(8)}
        assert c.preferred.must_include == () and c.preferred.size == 3
        assert "GPU-a::5" in c.device_ids and "not-a-candidate" not in c.device_ids
        assert len(c.device_ids) == 3
        picks.append(c.device_ids)
    assert picks[0] == picks[1]


def test_no_preferred_call_when_the_plugin_says_so(
    kubelet: KubeletStandin, make_plugin: Callable[..., DummyPlugin]
) -> None:
    plugin = make_plugin(preferred=False)
    kubelet.wait_for_registration(RESOURCE)
    (res,) = kubelet.admit([slice_pod("p", 2, created=1)])
    assert res.admitted and len(res.ids()) == 2
    assert res.containers[0].preferred is None and not plugin.called("GetPreferredAllocation")


def test_too_few_devices(kubelet: KubeletStandin, make_plugin: Callable[..., DummyPlugin]) -> None:
    plugin = make_plugin()
    kubelet.wait_for_registration(RESOURCE)
    (res,) = kubelet.admit([slice_pod("p", 5, created=1)])
    assert not res.admitted
    assert res.error == f"requested number of devices unavailable for {RESOURCE}. Requested: 5, Available: 4"
    assert not plugin.called("Allocate") and kubelet.devices(RESOURCE).in_use == set()


def test_unknown_resource_is_dropped_and_the_pod_admitted(kubelet: KubeletStandin) -> None:
    """kubelet's predicate removes extended resources the node lacks (checked against kubelet-dm)."""
    (res,) = kubelet.admit([slice_pod("p", 1, created=1)])
    assert res.admitted and res.ids() == frozenset()


def test_allocate_error_fails_admission_and_frees_ids(
    kubelet: KubeletStandin, make_plugin: Callable[..., DummyPlugin]
) -> None:
    plugin = make_plugin()
    kubelet.wait_for_registration(RESOURCE)
    plugin.allocate_error = "slices not assigned"
    (bad,) = kubelet.admit([slice_pod("bad", 2, created=1)])
    assert not bad.admitted and "slices not assigned" in (bad.error or "")
    assert kubelet.devices(RESOURCE).in_use == set() and kubelet.pod_devices(bad.pod.uid) == {}
    plugin.allocate_error = None
    plugin.allocate_empty = True
    (empty,) = kubelet.admit([slice_pod("empty", 2, created=2)])
    assert not empty.admitted and "no containers return in allocation response" in (empty.error or "")
    plugin.allocate_empty = False
    (good,) = kubelet.admit([slice_pod("good", 4, created=3)])
    assert good.admitted and len(good.ids()) == 4


def test_init_container_ids_are_reused_sidecar_ids_are_not(
    kubelet: KubeletStandin, make_plugin: Callable[..., DummyPlugin]
) -> None:
    make_plugin(slices(8))
    kubelet.wait_for_registration(RESOURCE)
    plain = Pod(
        "ns",
        "plain",
        "u-plain",
        created=1,
        init_containers=(Container("init", {RESOURCE: 2}),),
        containers=(Container("app", {RESOURCE: 2}),),
    )
    sidecar = Pod(
        "ns",
        "side",
        "u-side",
        created=2,
        init_containers=(Container("proxy", {RESOURCE: 2}, sidecar=True),),
        containers=(Container("app", {RESOURCE: 2}),),
    )
    r_plain, r_side = kubelet.admit([plain, sidecar])
    assert r_plain.ids(container="app") == r_plain.ids(container="init")
    assert set(r_plain.containers[1].from_init) == r_plain.ids(container="init")
    assert r_side.ids(container="app").isdisjoint(r_side.ids(container="proxy"))
    assert len(kubelet.devices(RESOURCE).in_use) == 2 + 4


def test_container_restart_keeps_its_ids(kubelet: KubeletStandin, make_plugin: Callable[..., DummyPlugin]) -> None:
    make_plugin(pre_start=True)
    kubelet.wait_for_registration(RESOURCE)
    pod = slice_pod("p", 2, created=1)
    (first,) = kubelet.admit([pod])
    calls = len(kubelet.allocate_calls)
    (again,) = kubelet.admit([pod])
    assert again.admitted and again.containers[0].reused and again.ids() == first.ids()
    assert len(kubelet.allocate_calls) == calls  # no Allocate for a container that already has its ids


def test_topology_split(kubelet: KubeletStandin, make_plugin: Callable[..., DummyPlugin]) -> None:
    devs = [
        device("n0a", numa=0),
        device("n0b", numa=0),
        device("n1a", numa=1),
        device("n1b", numa=1),
        device("free1"),
        device("free2"),
    ]
    answer: list[str] = []
    plugin = make_plugin(devs, prefer=lambda req: answer)
    kubelet.wait_for_registration(RESOURCE)

    def pod(name: str, n: int, created: float) -> Pod:
        return Pod("ns", name, name, created, (Container("c", {RESOURCE: n}, numa_affinity=frozenset({0})),))

    # needed (1) < aligned (2): the plugin only chooses among aligned devices.
    (small,) = kubelet.admit([pod("small", 1, 1)])
    pref = small.containers[0].preferred
    assert pref is not None and set(pref.available) == {"n0a", "n0b"} and pref.size == 1
    assert small.ids() <= {"n0a", "n0b"}
    kubelet.delete_pod("small")

    # needed (3) >= aligned (2): all aligned first, then the plugin chooses among all available.
    answer[:] = ["free2"]
    (big,) = kubelet.admit([pod("big", 3, 2)])
    pref = big.containers[0].preferred
    assert pref is not None and set(pref.available) == {d.ID for d in devs}
    assert big.ids() == {"n0a", "n0b", "free2"}
    kubelet.delete_pod("big")

    # no useful answer: unaligned (other NUMA node) before devices without topology.
    answer[:] = []
    (topped,) = kubelet.admit([pod("topped", 3, 3)])
    assert {"n0a", "n0b"} < topped.ids() and topped.ids() - {"n0a", "n0b"} <= {"n1a", "n1b"}
    assert plugin.called("GetPreferredAllocation")


# ----------------------------------------------------------------------------- pod resources


def test_pod_resources_list_get_allocatable_and_delete(
    kubelet: KubeletStandin, make_plugin: Callable[..., DummyPlugin]
) -> None:
    make_plugin([*slices(3), device("GPU-a::3", health="Unhealthy")])
    kubelet.wait_for_registration(RESOURCE)
    a, b = kubelet.admit([slice_pod("a", 2, created=1), slice_pod("b", 1, created=2)])
    ch, stub = pod_resources_stub(kubelet)
    with ch:
        listed = stub.List(pr.ListPodResourcesRequest(), timeout=5)
        got: dict[str, set[str]] = {}
        for p in listed.pod_resources:
            (c,) = p.containers
            assert c.name == "main" and all(len(d.device_ids) == 1 for d in c.devices)  # one entry per id
            got[p.name] = {i for d in c.devices if d.resource_name == RESOURCE for i in d.device_ids}
        assert got == {"a": set(a.ids()), "b": set(b.ids())}

        one = stub.Get(pr.GetPodResourcesRequest(pod_name="b", pod_namespace="default"), timeout=5)
        assert {i for d in one.pod_resources.containers[0].devices for i in d.device_ids} == b.ids()
        with pytest.raises(grpc.RpcError) as err:
            stub.Get(pr.GetPodResourcesRequest(pod_name="zz", pod_namespace="default"), timeout=5)
        assert "not found" in (err.value.details() or "")

        alloc = stub.GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=5)
        assert {i for d in alloc.devices for i in d.device_ids} == {"GPU-a::0", "GPU-a::1", "GPU-a::2"}

        kubelet.delete_pod(a.pod.uid)
        listed = stub.List(pr.ListPodResourcesRequest(), timeout=5)
        assert [p.name for p in listed.pod_resources] == ["b"]
    (after,) = kubelet.admit([slice_pod("c", 2, created=3)])
    assert after.admitted and after.ids() == a.ids()  # a's ids were freed


# ----------------------------------------------------------------------------- kubelet restart


def test_restart_cleans_sockets_keeps_checkpoint_and_allocations(
    kubelet: KubeletStandin, make_plugin: Callable[..., DummyPlugin]
) -> None:
    plugin = make_plugin()
    first = kubelet.wait_for_registration(RESOURCE)
    (held,) = kubelet.admit([slice_pod("held", 2, created=1)])
    (kubelet.plugin_dir / "notes.txt").write_text("not a socket")

    kubelet.restart()

    assert not plugin.socket.exists(), "kubelet deletes plugin sockets at start"
    assert (kubelet.plugin_dir / CHECKPOINT_FILE).exists() and (kubelet.plugin_dir / "notes.txt").exists()
    assert stat.S_ISSOCK(kubelet.kubelet_socket.stat().st_mode)
    state = kubelet.devices(RESOURCE)
    assert not state.registered and state.capacity == set() and state.in_use == held.ids()
    (early,) = kubelet.admit([slice_pod("early", 1, created=2)])
    assert not early.admitted and "no healthy devices present" in (early.error or "")

    plugin.stop_serving()
    plugin.start()  # what a plugin does when it notices the restart
    kubelet.wait_for_registration(RESOURCE, after=first.generation)
    (late,) = kubelet.admit([slice_pod("late", 2, created=3)])
    assert late.admitted and late.ids().isdisjoint(held.ids())
    assert kubelet.pod_devices(held.pod.uid) == {"main": {RESOURCE: held.ids()}}


def test_plugin_that_watches_the_dir_re_registers(
    kubelet: KubeletStandin, make_plugin: Callable[..., DummyPlugin]
) -> None:
    plugin = make_plugin()
    plugin.watch_for_kubelet_restart()
    for _ in range(2):
        gen = kubelet.wait_for_registration(RESOURCE).generation
        kubelet.restart()
        reg = kubelet.wait_for_registration(RESOURCE, timeout=10, after=gen)
        assert reg.endpoint == "dummy.sock" and len(kubelet.devices(RESOURCE).allocatable) == 4


# ----------------------------------------------------------------------------- asyncio callers


async def test_async_helpers(kubelet: KubeletStandin, make_plugin: Callable[..., DummyPlugin]) -> None:
    make_plugin()
    await kubelet.wait_for_registration_async(RESOURCE)
    (res,) = await kubelet.admit_async([slice_pod("p", 1, created=1)])
    assert res.admitted
