"""Socket lifetime and (re-)registration against the kubelet stand-in over real unix sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from deviceplugin.allocate import Injector
from deviceplugin.registration import Registrar
from deviceplugin.server import DevicePluginServicer, PluginState
from deviceplugin.simulated import builtin_topology
from tests.kubelet.standin import KubeletStandin

from .test_app import until

RESOURCE = "example.com/gpu-slice"


def make_registrar(plugin_dir: Path, resource: str = RESOURCE,
                   on_registered: Callable[[bool], None] | None = None) -> Registrar:
    state = PluginState("node-a", book=None)
    state.set_gpus(builtin_topology("node-a").gpus)
    servicer = DevicePluginServicer(state, Injector())
    return Registrar(plugin_dir, "gpu-slice.sock", resource,
                     lambda server: pb_grpc.add_DevicePluginServicer_to_server(servicer, server), poll_s=0.05,
                     on_registered=on_registered, streams=servicer.streams, stream_wait_s=0.5)


@pytest.fixture
async def running(kubelet: KubeletStandin) -> AsyncIterator[Registrar]:
    registrar = make_registrar(kubelet.plugin_dir)
    stop = asyncio.Event()
    task = asyncio.create_task(registrar.run(stop))
    await kubelet.wait_for_registration_async(RESOURCE)
    try:
        yield registrar
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_serves_then_registers_and_removes_its_socket_on_stop(kubelet: KubeletStandin) -> None:
    stale = kubelet.plugin_dir / "gpu-slice.sock"
    stale.write_text("left over from a crash")
    registrar = make_registrar(kubelet.plugin_dir)
    stop = asyncio.Event()
    task = asyncio.create_task(registrar.run(stop))
    reg = await kubelet.wait_for_registration_async(RESOURCE)
    assert reg.endpoint == "gpu-slice.sock" and reg.version == "v1beta1"
    # the stand-in records a Register as it arrives; the registrar counts it when the reply is back
    await until(lambda: registrar.registrations == 1, 5.0, "the registration counted")
    assert registrar.registrations == 1 and stale.is_socket()
    stop.set()
    await asyncio.wait_for(task, 10)
    assert not stale.exists()


async def test_kubelet_restart_re_registers_on_a_new_socket(kubelet: KubeletStandin, running: Registrar) -> None:
    gen = kubelet.generation
    await asyncio.to_thread(kubelet.restart)
    await kubelet.wait_for_registration_async(RESOURCE, after=gen)
    await until(lambda: running.registrations == 2, 5.0, "the second registration counted")
    assert running.serves == 2 and running.registrations == 2


async def test_our_socket_deleted_alone_is_served_and_registered_again(
        kubelet: KubeletStandin, running: Registrar) -> None:
    gen = kubelet.generation
    running.socket_path.unlink()
    await kubelet.wait_for_registration_async(RESOURCE, after=gen)
    assert running.socket_path.is_socket()
    await asyncio.sleep(0.3)  # the old socket's stream ended before the new Register: nothing disconnected it
    state = kubelet.devices(RESOURCE)
    assert state.registered and len(state.allocatable) == 14
    assert all(current <= gen for _ended, current in kubelet.disconnects)


async def test_dropped_stream_registers_again(kubelet: KubeletStandin, running: Registrar) -> None:
    """kubelet disconnects a plugin whose ListAndWatch stream ends; only a new Register brings it back."""
    gen = kubelet.generation
    kubelet.drop_stream(RESOURCE)
    await kubelet.wait_for_registration_async(RESOURCE, after=gen)
    state = await asyncio.to_thread(kubelet.wait_for_devices, RESOURCE, lambda s: len(s.allocatable) == 14)
    assert state.registered and running.stream_losses == 1 and running.serves == 1


async def test_no_stream_after_register_registers_again(kubelet: KubeletStandin) -> None:
    kubelet.withhold_streams = 1
    registrar = make_registrar(kubelet.plugin_dir)
    stop = asyncio.Event()
    task = asyncio.create_task(registrar.run(stop))
    try:
        reg = await kubelet.wait_for_registration_async(RESOURCE, timeout=5)
        assert reg.generation == 2 and registrar.stream_timeouts == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_shutdown_does_not_register_again(kubelet: KubeletStandin) -> None:
    registrar = make_registrar(kubelet.plugin_dir)
    stop = asyncio.Event()
    task = asyncio.create_task(registrar.run(stop))
    await kubelet.wait_for_registration_async(RESOURCE)
    stop.set()  # streams end because we stop, not because kubelet dropped them
    await asyncio.wait_for(task, 10)
    assert registrar.registrations == 1 and registrar.stream_losses == 0
