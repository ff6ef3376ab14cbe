"""Plugin metrics on an injected registry: slice counts read at scrape time, and the instruments."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from deviceplugin.metrics import PluginMetrics
from deviceplugin.simulated import builtin_topology
from gpuslice.model import NodeInventory


def labels(inv: NodeInventory, i: int) -> dict[str, str]:
    g = inv.gpus[i]
    return {"node": inv.node, "gpu_uuid": g.uuid, "gpu_index": str(g.index), "product": g.product, "mode": g.mode}


def test_slice_counts_follow_the_current_inventory() -> None:
    topo = builtin_topology()
    inv = NodeInventory(topo.node, topo.gpus)
    current = [inv]
    bad: dict[str, str] = {}
    registry = CollectorRegistry()
    PluginMetrics(registry, inventory=lambda: current[0], unhealthy=lambda: bad)
    get = registry.get_sample_value
    assert [get("gpu_slice_slices_total", labels(inv, i)) for i in (0, 1)] == [7, 7]
    assert [get("gpu_slice_slices_allocated", labels(inv, i)) for i in (0, 1)] == [0, 0]
    assert [get("gpu_slice_slices_healthy", labels(inv, i)) for i in (0, 1)] == [7, 7]
    mig, mps = inv.gpus
    used = inv.allocate([*mig.instances[3].slice_ids(), f"{mps.uuid}::0", f"{mps.uuid}::5"])
    current[0] = used.with_gpu(replace(mps, healthy=False))
    bad[mig.instances[3].uuid] = "XID 94"
    assert [get("gpu_slice_slices_allocated", labels(inv, i)) for i in (0, 1)] == [3, 2]
    assert [get("gpu_slice_slices_healthy", labels(inv, i)) for i in (0, 1)] == [4, 0]
    assert REGISTRY.get_sample_value("gpu_slice_slices_total", labels(inv, 0)) is None  # never the global one


def test_instruments_the_server_updates() -> None:
    registry = CollectorRegistry()
    m = PluginMetrics(registry)
    with m.time_rpc("Allocate"):
        pass
    with pytest.raises(RuntimeError), m.time_rpc("Allocate"):
        raise RuntimeError("boom")
    m.observe_rpc("ListAndWatch", 0.002)
    m.registration(True)
    m.registration(False)
    m.registration(True)
    m.allocation_mismatch("no-assignment")
    m.set_mps_up("GPU-x", True)
    m.set_mps_up("GPU-y", False)
    get = registry.get_sample_value
    assert get("gpu_slice_plugin_rpc_duration_seconds_count", {"method": "Allocate"}) == 2
    assert get("gpu_slice_plugin_rpc_duration_seconds_bucket", {"method": "ListAndWatch", "le": "0.0025"}) == 1
    assert get("gpu_slice_plugin_registrations_total", {"result": "ok"}) == 2
    assert get("gpu_slice_plugin_registrations_total", {"result": "error"}) == 1
    assert get("gpu_slice_plugin_allocation_mismatches_total", {"kind": "no-assignment"}) == 1
    assert get("gpu_slice_mps_daemon_up", {"gpu_uuid": "GPU-x"}) == 1
    assert get("gpu_slice_mps_daemon_up", {"gpu_uuid": "GPU-y"}) == 0
    m.forget_mps("GPU-y")
    m.forget_mps("GPU-never")
    assert get("gpu_slice_mps_daemon_up", {"gpu_uuid": "GPU-y"}) is None
    assert b"gpu_slice_slices_total" not in generate_latest(registry)  # no inventory yet: no slice series


def test_two_plugin_metrics_on_separate_registries_do_not_clash() -> None:
    PluginMetrics(CollectorRegistry())
    PluginMetrics(CollectorRegistry())
