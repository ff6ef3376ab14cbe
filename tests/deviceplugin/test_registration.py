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

RESOURCE = "example.com/gpu-slice"


def make_registrar(plugin_dir: Path, resource: str = RESOURCE,
                   on_registered: Callable[[bool], None] | None = None) -> Registrar:
    state = PluginState("node-a", book=None)
    state.set_gpus(builtin_topology("node-a").gpus)
    servicer = DevicePluginServicer(state, Injector())
    return Registrar(plugin_dir, "gpu-slice.sock", resource,
                     lambda server: pb_grpc.add_DevicePluginServicer_to_server(servicer, server), poll_s=0.05,
                     on_registered=on_registered)


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
    assert registrar.registrations == 1 and stale.is_socket()
    stop.set()
    await asyncio.wait_for(task, 10)
    assert not stale.exists()


async def test_kubelet_restart_re_registers_on_a_new_socket(kubelet: KubeletStandin, running: Registrar) -> None:
    gen = kubelet.generation
    await asyncio.to_thread(kubelet.restart)
    await kubelet.wait_for_registration_async(RESOURCE, after=gen)
    assert running.serves == 2 and running.registrations == 2


async def test_our_socket_deleted_alone_is_served_and_registered_again(
        kubelet: KubeletStandin, running: Registrar) -> None:
    gen = kubelet.generation
    running.socket_path.unlink()
    await kubelet.wait_for_registration_async(RESOURCE, after=gen)
    assert running.socket_path.is_socket()


async def test_waits_for_kubelet_to_appear(sock_dir: Path) -> None:
    registrar = make_registrar(sock_dir / "dp")
    stop = asyncio.Event()
    task = asyncio.create_task(registrar.run(stop))
    try:
        await asyncio.sleep(0.2)
        assert registrar.registrations == 0 and registrar.socket_path.is_socket()
        kubelet = KubeletStandin(sock_dir / "dp", sock_dir / "pr")
        await asyncio.to_thread(kubelet.start)  # cleans the dir: our socket goes, we serve again
        try:
            await kubelet.wait_for_registration_async(RESOURCE)
        finally:
            await asyncio.to_thread(kubelet.stop)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_refused_registration_is_retried_with_backoff(kubelet: KubeletStandin) -> None:
    outcomes: list[bool] = []
    registrar = make_registrar(kubelet.plugin_dir, resource="not-extended", on_registered=outcomes.append)
    stop = asyncio.Event()
    task = asyncio.create_task(registrar.run(stop))
    async with asyncio.timeout(5):
        while len(outcomes) < 2:
            await asyncio.sleep(0.02)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert not any(outcomes) and registrar.registrations == 0
    assert "invalid" in kubelet.rejected_registrations[0][1]
