"""The gRPC service over a real unix socket, registered with the kubelet stand-in.

Covers the core flow without the API server: register -> ListAndWatch -> preferred -> Allocate with
an assignment, refusals of ids that form no placement, options, and health changes reaching kubelet.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from deviceplugin.allocate import Injector
from deviceplugin.assignments import AssignmentBook, PodView
from deviceplugin.registration import Registrar
from deviceplugin.server import DevicePluginServicer, PluginState
from deviceplugin.simulated import builtin_topology
from gpuslice.model import Gpu
from tests.kubelet.standin import KubeletStandin, slice_pod

RESOURCE = "example.com/gpu-slice"
NODE = "node-a"


@dataclass
class Plugin:
    state: PluginState
    servicer: DevicePluginServicer
    registrar: Registrar
    stop: asyncio.Event
    task: asyncio.Task[None]

    @property
    def mig(self) -> Gpu:
        return self.state.gpus[0]

    @property
    def mps(self) -> Gpu:
        return self.state.gpus[1]


@pytest.fixture
async def plugin(kubelet: KubeletStandin) -> AsyncIterator[Plugin]:
    state = PluginState(NODE, book=AssignmentBook(NODE))
    state.set_gpus(builtin_topology(NODE).gpus)
    servicer = DevicePluginServicer(state, Injector(mps_root=Path("/run/gpu-slice/mps")), preferred_wait_s=0.3,
                                    preferred_wait_empty_s=0.3)
    registrar = Registrar(kubelet.plugin_dir, "gpu-slice.sock", RESOURCE,
                          lambda server: pb_grpc.add_DevicePluginServicer_to_server(servicer, server), poll_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(registrar.run(stop))
    await kubelet.wait_for_registration_async(RESOURCE)
    try:
        yield Plugin(state, servicer, registrar, stop, task)
    finally:
        servicer.stop_streams()
        stop.set()
        await asyncio.wait_for(task, 10)


def assign(state: PluginState, name: str, ids: tuple[str, ...], at: str) -> PodView:
    assert state.book is not None
    pod = PodView("default", name, f"uid-default-{name}", NODE, "Pending", created=at, assigned_at=at,
                  assignment_ids=ids)
    state.book.upsert(pod)
    return pod


async def test_registers_with_preferred_allocation_and_advertises_every_id(
        plugin: Plugin, kubelet: KubeletStandin) -> None:
    reg = kubelet.registrations[-1]
    assert reg.options.get_preferred_allocation_available
    assert reg.version == "v1beta1" and reg.endpoint == "gpu-slice.sock"
    devices = kubelet.devices(RESOURCE)
    expected = {sid for g in plugin.state.gpus for sid in g.slice_ids()}
    assert devices.capacity == expected
    assert devices.allocatable == expected
    assert all(not t for t in devices.topology.values()), "no NUMA topology by default"


async def test_allocate_follows_the_assignment(plugin: Plugin, kubelet: KubeletStandin) -> None:
    inst = plugin.mig.instances[0]  # 2g.20gb
    assign(plugin.state, "p1", inst.slice_ids(), "2025-01-01T00:00:00Z")
    [result] = await kubelet.admit_async([slice_pod("p1", 2, created=1.0)])
    assert result.admitted, result.error
    assert result.ids() == frozenset(inst.slice_ids())
    resp = result.containers[0].response
    assert resp is not None
    assert [d.name for d in resp.cdi_devices] == [f"nvidia.com/gpu={inst.uuid}"]
    assert resp.envs["GPU_SLICE_COUNT"] == "2"
    assert resp.envs["GPU_SLICE_MEMORY_BYTES"] == str(inst.memory_mib << 20)
    assert resp.envs["GPU_SLICE_FRACTION"] == "0.285714"


async def test_mps_allocation_gets_mps_settings(plugin: Plugin, kubelet: KubeletStandin) -> None:
    ids = plugin.mps.slice_ids()[2:5]
    assign(plugin.state, "m1", ids, "2025-01-01T00:00:00Z")
    [result] = await kubelet.admit_async([slice_pod("m1", 3, created=1.0)])
    assert result.admitted, result.error
    assert result.ids() == frozenset(ids)
    resp = result.containers[0].response
    assert resp is not None
    assert resp.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "42"
    assert resp.envs["CUDA_MPS_PIPE_DIRECTORY"]
    assert {m.container_path for m in resp.mounts} >= {"/dev/shm", resp.envs["CUDA_MPS_PIPE_DIRECTORY"]}
    assert [d.name for d in resp.cdi_devices] == [f"nvidia.com/gpu={plugin.mps.uuid}"]


async def test_pod_without_assignment_gets_best_fit_skipping_pending_assignments(
        plugin: Plugin, kubelet: KubeletStandin) -> None:
    one_g = [i for i in plugin.mig.instances if i.compute_slices == 1]
    assign(plugin.state, "held", one_g[0].slice_ids(), "2025-01-01T00:00:00Z")
    # A 1-slice pod of another scheduler: pending assignments are of size 1 too, so it would get the
    # assignment's ids; ask for 2 slices instead, which only the 2g instance or MPS can serve.
    [result] = await kubelet.admit_async([slice_pod("other", 2, created=1.0)])
    assert result.admitted, result.error
    ids = result.ids()
    assert not ids & set(one_g[0].slice_ids())
    assert ids == frozenset(plugin.mig.instances[0].slice_ids())


async def test_allocate_refuses_ids_that_form_no_placement(plugin: Plugin) -> None:
    mig = plugin.mig
    bad_sets = {
        "two instances": [mig.instances[1].slice_ids()[0], mig.instances[2].slice_ids()[0]],
        "part of an instance": [mig.instances[3].slice_ids()[0]],
        "two GPUs": [mig.instances[1].slice_ids()[0], plugin.mps.slice_ids()[0]],
        "unknown": ["GPU-00000000-0000-0000-0000-000000000000::0"],
        "malformed": ["not-an-id"],
    }
    async with grpc.aio.insecure_channel(f"unix://{plugin.registrar.socket_path}") as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        for why, ids in bad_sets.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(
                    devices_ids=ids)]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, why
            assert "no valid placement" in (err.value.details() or ""), why


async def test_health_change_and_recovery_reach_kubelet(plugin: Plugin, kubelet: KubeletStandin) -> None:
    inst = plugin.mig.instances[3]
    plugin.state.set_unhealthy({inst.uuid: "XID 48"})
    state = await asyncio.to_thread(kubelet.wait_for_devices, RESOURCE,
                                    lambda d: d.unhealthy == frozenset(inst.slice_ids()))
    assert len(state.capacity) == 14
    plugin.state.set_unhealthy({})
    await asyncio.to_thread(kubelet.wait_for_devices, RESOURCE, lambda d: not d.unhealthy)


async def test_kubelet_restart_re_registers(plugin: Plugin, kubelet: KubeletStandin) -> None:
    before = kubelet.generation
    await asyncio.to_thread(kubelet.restart)
    await kubelet.wait_for_registration_async(RESOURCE, after=before)
    assert kubelet.devices(RESOURCE).allocatable == {sid for g in plugin.state.gpus for sid in g.slice_ids()}
    assert plugin.registrar.serves >= 2


async def test_preferred_waits_briefly_for_the_pod_cache_before_a_best_fit() -> None:
    """kubelet's informer can see a bound pod before the plugin's watch: GetPreferredAllocation then
    waits (bounded) for the cache instead of handing out another placement."""
    state = PluginState(NODE, book=AssignmentBook(NODE))
    state.set_gpus(builtin_topology(NODE).gpus)
    servicer = DevicePluginServicer(state, Injector(), preferred_wait_s=2.0)
    mps = state.gpus[1]
    wanted = mps.slice_ids()[4:7]
    request = pb.PreferredAllocationRequest(container_requests=[pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=[s for g in state.gpus for s in g.slice_ids()], allocation_size=3)])
    call = asyncio.create_task(servicer.GetPreferredAllocation(request, None))
    await asyncio.sleep(0.2)
    assert not call.done()
    assign(state, "late", wanted, "2025-01-01T00:00:01Z")
    state.pods_changed()
    resp = await asyncio.wait_for(call, 2)
    assert sorted(resp.container_responses[0].deviceIDs) == sorted(wanted)
    # With nothing arriving the wait is bounded and ends in a best fit.
    servicer.preferred_wait_s = 0.2
    other = pb.PreferredAllocationRequest(container_requests=[pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=[s for s in mps.slice_ids()[:4]], allocation_size=2)])
    resp = await asyncio.wait_for(servicer.GetPreferredAllocation(other, None), 2)
    assert len(resp.container_responses[0].deviceIDs) == 2


async def test_preferred_waits_longer_while_no_valid_best_fit_is_left() -> None:
    """An empty answer lets kubelet pick ids itself, which never form the MIG instance a pod needs: while
    no best fit is left, GetPreferredAllocation waits for the assignment past the short bound."""
    state = PluginState(NODE, book=AssignmentBook(NODE))
    state.set_gpus(builtin_topology(NODE).gpus)
    servicer = DevicePluginServicer(state, Injector(), preferred_wait_s=0.1, preferred_wait_empty_s=3.0)
    mig = state.gpus[0]
    inst = next(i for i in mig.instances if i.compute_slices == 1)
    # Only one id of a 1g instance is offered for a 2-slice request: no valid placement in it.
    request = pb.PreferredAllocationRequest(container_requests=[pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=list(inst.slice_ids()), allocation_size=2)])
    call = asyncio.create_task(servicer.GetPreferredAllocation(request, None))
    await asyncio.sleep(0.5)
    assert not call.done()  # past the short bound: still waiting, since nothing valid could be offered
    two = next(i for i in mig.instances if i.compute_slices == 2)
    wide = pb.PreferredAllocationRequest(container_requests=[pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=list(two.slice_ids()), allocation_size=2)])
    # A request with a valid best fit is answered at the short bound all the same.
    resp = await asyncio.wait_for(servicer.GetPreferredAllocation(wide, None), 1)
    assert sorted(resp.container_responses[0].deviceIDs) == sorted(two.slice_ids())
    resp = await asyncio.wait_for(call, 4)
    assert list(resp.container_responses[0].deviceIDs) == []  # bounded: ends empty when nothing arrives
