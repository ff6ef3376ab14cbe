"""MIG re-cuts on the node: the NVML backend against a fake NVML with the MIG guide's placement rules,
the simulated backend, the CDI refresh, and the applier end to end (fake API server, kubelet stand-in)."""

from __future__ import annotations

import asyncio
import ctypes
import json
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pynvml as real
import pytest

from deviceplugin.backend import MigRecutter
from deviceplugin.cdi_refresh import CdiRefresher
from deviceplugin.errors import RecutFailed, RecutRefused
from deviceplugin.miglayouts import GENERATION_LABEL
from deviceplugin.nvml_backend import NvmlBackend
from deviceplugin.simulated import SimulatedBackend, parse_topology
from gpuslice.config import load_config
from gpuslice.layoutwire import LAYOUT_KEY, STATUS_KEY, WantedGpu, WantedLayouts, decode_results, encode_wanted
from tests.deviceplugin import test_app
from tests.deviceplugin.test_app import RESOURCE, Env, until
from tests.deviceplugin.test_nvml_backend import H100, FakeGpu, FakeMig, FakeNvml, err
from tests.fakeapi.server import FakeApiServer
from tests.kubelet.standin import KubeletStandin, slice_pod

# The MIG User Guide's H100 placement table, written out here independently of gpuslice.catalogue:
# profile id -> (compute slices, memory slices, legal starts, max count).
GUIDE = {19: (1, 1, (0, 1, 2, 3, 4, 5, 6), 7), 20: (1, 1, (0, 1, 2, 3, 4, 5, 6), 1), 15: (1, 2, (0, 2, 4, 6), 4),
         14: (2, 2, (0, 2, 4), 3), 9: (3, 4, (0, 4), 2), 5: (4, 4, (0,), 1), 0: (7, 8, (0,), 1)}
MEMORY = {1: 9984, 2: 20096, 4: 40448, 8: 81152}


class _Gi:
    def __init__(self, gpu: FakeGpu, gi_id: int) -> None:
        self.gpu, self.gi_id = gpu, gi_id


class RecutNvml(FakeNvml):
    """FakeNvml plus GPU and compute instance creation and destruction, refused as NVML refuses."""

    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = real.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    c_nvmlGpuInstancePlacement_t = real.c_nvmlGpuInstancePlacement_t

    def __init__(self, gpus: list[FakeGpu], **kw: Any) -> None:
        super().__init__(gpus, **kw)
        for name in dir(real):
            if name.startswith("NVML_COMPUTE_INSTANCE_PROFILE_"):
                setattr(self, name, getattr(real, name))
        self.busy_gis: set[int] = set()  # GPU instances with a process running (NVML: IN_USE)
        self.fail_create = False

    def _migs(self, gpu: FakeGpu, gi_id: int) -> list[int]:
        return [k for k, m in gpu.migs.items() if m.gi_id == gi_id]

    def nvmlDeviceGetComputeInstanceId(self, mig: FakeMig) -> int:
        return 0

    def nvmlDeviceGetGpuInstanceById(self, handle: FakeGpu, gi_id: int) -> Any:
        if not self._migs(handle, gi_id):
            raise err(real.NVML_ERROR_NOT_FOUND)
        return _Gi(handle, gi_id)

    def nvmlGpuInstanceGetInfo(self, gi: Any) -> Any:
        if isinstance(gi, _Gi):
            gi = gi.gpu.migs[self._migs(gi.gpu, gi.gi_id)[0]]
        return super().nvmlGpuInstanceGetInfo(gi)

    def nvmlGpuInstanceGetComputeInstanceById(self, gi: _Gi, ci_id: int) -> tuple[_Gi, int]:
        return gi, ci_id

    def nvmlComputeInstanceDestroy(self, ci: tuple[_Gi, int]) -> None:
        gi, _ = ci
        if gi.gi_id in self.busy_gis:
            raise err(real.NVML_ERROR_IN_USE)
        for k in self._migs(gi.gpu, gi.gi_id):
            gi.gpu.migs[k].ci_slices = 0  # no compute instance left: the MIG device is gone with the GI

    def nvmlGpuInstanceDestroy(self, gi: _Gi) -> None:
        keys = self._migs(gi.gpu, gi.gi_id)
        if any(gi.gpu.migs[k].ci_slices != 0 for k in keys):
            raise err(real.NVML_ERROR_IN_USE)
        for k in keys:
            del gi.gpu.migs[k]

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, handle: FakeGpu, profile_id: int, placement: Any) -> _Gi:
        p = ctypes.cast(placement, ctypes.POINTER(real.c_nvmlGpuInstancePlacement_t)).contents
        if self.fail_create:
            raise err(real.NVML_ERROR_UNKNOWN)
        if profile_id not in GUIDE:
            raise err(real.NVML_ERROR_INVALID_ARGUMENT)
        compute, size, starts, most = GUIDE[profile_id]
        if p.start not in starts or p.size != size:
            raise err(real.NVML_ERROR_INVALID_ARGUMENT)
        taken: set[int] = set()
        used = 0
        count = 0
        for m in handle.migs.values():
            c, s, _, _ = GUIDE[m.profile_id]
            taken |= set(range(m.start, m.start + s))
            used += c
            count += m.profile_id == profile_id
        if taken & set(range(p.start, p.start + size)) or used + compute > 7 or count >= most:
            raise err(real.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi_id = max([m.gi_id for m in handle.migs.values()] + [0]) + 1
        index = next(i for i in range(7) if i not in handle.migs)
        handle.migs[index] = FakeMig(f"MIG-new-{gi_id}", gi_id, profile_id, p.start, MEMORY[size], compute, 0)
        return _Gi(handle, gi_id)

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi: _Gi, profile: int, eng: int) -> Any:
        info = real.c_nvmlComputeInstanceProfileInfo_v2_t()
        info.id = profile
        return info

    def nvmlGpuInstanceCreateComputeInstance(self, gi: _Gi, profile_id: int) -> tuple[_Gi, int]:
        for k in self._migs(gi.gpu, gi.gi_id):
            gi.gpu.migs[k].ci_slices = None  # spans the GPU instance
        return gi, 0


def seven_1g() -> FakeGpu:
    return FakeGpu("GPU-aaaa", H100, 81559, mig=True,
                   migs={i: FakeMig(f"MIG-1g-{i}", i + 1, 19, i, 9984, 1) for i in range(7)})


def test_nvml_recut_destroys_free_instances_and_creates_at_the_placement() -> None:
    nv = RecutNvml([seven_1g()])
    backend = NvmlBackend(nv)
    assert isinstance(backend, MigRecutter)
    out = backend.recut_mig("GPU-aaaa", ["MIG-1g-4", "MIG-1g-5", "MIG-1g-6"], [("3g.40gb", 4)],
                            frozenset({"MIG-1g-0::0"}))
    assert out.destroyed == ("MIG-1g-4", "MIG-1g-5", "MIG-1g-6") and len(out.created) == 1
    (gpu,) = backend.discover()
    assert [(i.profile, i.start) for i in gpu.instances] == [("1g.10gb", s) for s in range(4)] + [("3g.40gb", 4)]
    assert gpu.instances[-1].uuid == out.created[0] and gpu.slices == 7


def test_nvml_recut_refuses_before_any_change() -> None:
    nv = RecutNvml([seven_1g()])
    backend = NvmlBackend(nv)
    with pytest.raises(RecutRefused, match="holds allocated ids"):
        backend.recut_mig("GPU-aaaa", ["MIG-1g-0"], [], frozenset({"MIG-1g-0::0"}))
    with pytest.raises(RecutRefused, match="overlaps"):  # 3g@4 over a 1g that stays
        backend.recut_mig("GPU-aaaa", ["MIG-1g-4"], [("3g.40gb", 4)], frozenset())
    with pytest.raises(RecutRefused, match="no MIG instance"):
        backend.recut_mig("GPU-aaaa", ["MIG-gone"], [], frozenset())
    ro = NvmlBackend(nv, read_only=True)
    with pytest.raises(RecutRefused, match="read-only: would destroy MIG-1g-6"):
        ro.recut_mig("GPU-aaaa", ["MIG-1g-6"], [("1g.10gb", 6)], frozenset())
    assert "nvmlGpuInstanceDestroy" not in nv.calls and "nvmlDeviceCreateGpuInstanceWithPlacement" not in nv.calls
    assert len(nv.gpus[0].migs) == 7


def test_nvml_in_use_and_part_way_failures_are_reported() -> None:
    nv = RecutNvml([seven_1g()])
    nv.busy_gis.add(7)  # a process runs in MIG-1g-6 although no id of ours is allocated (another user)
    backend = NvmlBackend(nv)
    with pytest.raises(RecutFailed, match="done before it: destroyed MIG-1g-4; destroyed MIG-1g-5"):
        backend.recut_mig("GPU-aaaa", ["MIG-1g-4", "MIG-1g-5", "MIG-1g-6"], [("3g.40gb", 4)], frozenset())
    assert {m.uuid for m in nv.gpus[0].migs.values()} >= {"MIG-1g-6"}
    nv2 = RecutNvml([seven_1g()])
    nv2.fail_create = True
    with pytest.raises(RecutFailed, match="stopped at NVML error"):
        NvmlBackend(nv2).recut_mig("GPU-aaaa", ["MIG-1g-6"], [("1g.10gb", 6)], frozenset())


def test_simulated_recut_follows_the_same_rules_and_gives_fresh_uuids() -> None:
    topo = parse_topology({"version": 1, "node": "n", "gpus": [
        {"product": "H100-80GB", "mode": "mig", "instances": [{"profile": "1g.10gb", "start": s} for s in range(7)]}]})
    backend = SimulatedBackend(topo)
    gpu = backend.discover()[0]
    free = [i.uuid for i in gpu.instances if i.start >= 4]
    with pytest.raises(RecutRefused, match="holds allocated ids"):
        backend.recut_mig(gpu.uuid, free, [("3g.40gb", 4)], frozenset(gpu.instances[5].slice_ids()))
    with pytest.raises(RecutRefused, match="overlaps"):
        backend.recut_mig(gpu.uuid, free[:2], [("3g.40gb", 4)], frozenset())
    out = backend.recut_mig(gpu.uuid, free, [("3g.40gb", 4)], frozenset())
    again = backend.recut_mig(gpu.uuid, list(out.created), [("3g.40gb", 4)], frozenset())
    assert out.created != again.created
    assert [(i.profile, i.start) for i in backend.discover()[0].instances][-1] == ("3g.40gb", 4)


def test_cdi_refresh_runs_the_generator_and_checks_the_names(tmp_path: Path) -> None:
    spec = tmp_path / "nvidia.yaml"
    script = tmp_path / "gen.py"
    script.write_text("import sys, yaml\nnames = sys.argv[2:]\nyaml.safe_dump({'cdiVersion': '0.5.0', 'kind': "
                      "'nvidia.com/gpu', 'devices': [{'name': n, 'containerEdits': {}} for n in names]}, "
                      "open(sys.argv[1], 'w'))\n")
    ok = CdiRefresher(f"{sys.executable} {script} {spec} MIG-a MIG-b", "nvidia.com", "gpu", [tmp_path])
    assert ok.refresh(["MIG-a"]) == spec
    with pytest.raises(RecutFailed, match="do not name MIG-c"):
        ok.refresh(["MIG-c"])
    with pytest.raises(RecutFailed, match="exited 1"):
        CdiRefresher(f"{sys.executable} -c 'raise SystemExit(1)'", "nvidia.com", "gpu", [tmp_path]).refresh(["x"])
    with pytest.raises(RecutFailed, match="no --cdi-refresh-command"):
        CdiRefresher("", "nvidia.com", "gpu", [tmp_path]).refresh(["x"])


# --------------------------------------------------------------------------- the applier, end to end


@pytest.fixture
async def env(kubelet: KubeletStandin, fake_api: FakeApiServer, sock_dir: Path) -> AsyncIterator[Env]:
    """test_app's plugin environment (fake API server, kubelet stand-in), for this module's scenarios."""
    async for e in test_app.env.__wrapped__(kubelet, fake_api, sock_dir):
        yield e

TOPO7 = parse_topology({"version": 1, "node": "node-a", "gpus": [
    {"product": "H100-80GB", "mode": "mig", "instances": [{"profile": "1g.10gb", "start": s} for s in range(7)]}]})
DYNAMIC = load_config({"version": "v1", "migLayouts": {"H100-80GB": {"dynamic": True}}})
WANT_3G = (*(("1g.10gb", s) for s in range(4)), ("3g.40gb", 4))


def _want(env: Env, generation: int, instances: tuple[tuple[str, int], ...] = WANT_3G) -> None:
    from datetime import UTC, datetime

    value = encode_wanted(WantedLayouts(generation, datetime.now(UTC), (
        WantedGpu(TOPO7.gpus[0].uuid, instances, ("uid-p",), "a Pending pod"),)))

    def mutate(node: dict[str, Any]) -> None:
        node["metadata"].setdefault("annotations", {})[LAYOUT_KEY] = value
    env.api.store.update_node("node-a", mutate)


def _status(env: Env) -> Any:
    raw = (env.api.store.get_node("node-a")["metadata"].get("annotations") or {}).get(STATUS_KEY)
    return None if raw is None else decode_results(raw)


async def test_wanted_layout_is_applied_keeping_the_used_instance(env: Env) -> None:
    gpu = TOPO7.gpus[0]
    await env.start(backend=SimulatedBackend(TOPO7), config=DYNAMIC)
    used = gpu.instances[0]
    uid = env.bind("small", used.slice_ids(), at="2025-01-01T00:00:01Z", gpus=(gpu.uuid,), instance=used.uuid)
    await env.seen("small")
    [res] = await env.kubelet.admit_async([slice_pod("small", 1, created=1.0, uid=uid)])
    assert res.admitted, res.error
    _want(env, 1)
    await until(lambda: _status(env) is not None and _status(env).generation == 1, 15)
    (r,) = _status(env).gpus
    assert r.state == "applied", r.message
    node = env.api.store.get_node("node-a")["metadata"]
    assert node["labels"][GENERATION_LABEL] == "1"
    inv = json.loads(node["annotations"]["example.com/gpu-slice.inventory"])["gpus"][0]["instances"]
    assert [(i["profile"], i["start"]) for i in inv] == list(WANT_3G) and inv[0]["uuid"] == used.uuid
    new = env.app.state.gpus[0].instances[-1]  # type: ignore[union-attr]
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE,
                            lambda d: frozenset(new.slice_ids()) <= d.allocatable, 10)
    assert env.events("MigRecut")


async def test_a_layout_that_drops_a_used_instance_is_refused_and_nothing_changes(env: Env) -> None:
    gpu = TOPO7.gpus[0]
    await env.start(backend=SimulatedBackend(TOPO7), config=DYNAMIC)
    used = gpu.instances[5]
    uid = env.bind("small", used.slice_ids(), at="2025-01-01T00:00:01Z", gpus=(gpu.uuid,), instance=used.uuid)
    await env.seen("small")  # a pending assignment is enough: its instance is promised
    _want(env, 4)
    await until(lambda: _status(env) is not None, 15)
    (r,) = _status(env).gpus
    assert r.state == "refused" and used.uuid in r.message and "never destroyed" in r.message
    assert env.app.state.gpus[0].instances == gpu.instances  # type: ignore[union-attr]
    assert uid and env.events("MigRecutRefused")


async def test_recut_is_refused_where_the_config_keeps_layouts_static(env: Env) -> None:
    await env.start(backend=SimulatedBackend(TOPO7))
    _want(env, 2)
    await until(lambda: _status(env) is not None, 15)
    (r,) = _status(env).gpus
    assert r.state == "refused" and "migLayouts.H100-80GB.dynamic is off" in r.message


class _Held(SimulatedBackend):
    """Re-cuts only when told, so a test can act while the backend call runs in its worker thread."""

    def __init__(self) -> None:
        super().__init__(TOPO7)
        self.entered, self.go = threading.Event(), threading.Event()

    def recut_mig(self, *args: Any, **kw: Any) -> Any:
        self.entered.set()
        self.go.wait(10)
        return super().recut_mig(*args, **kw)


async def test_instances_being_destroyed_are_withdrawn_and_allocate_refuses_them(env: Env) -> None:
    backend = _Held()
    await env.start(backend=backend, config=DYNAMIC)
    _want(env, 1)
    await until(backend.entered.is_set, 15)
    doomed = [i for i in TOPO7.gpus[0].instances if i.start >= 4]
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE,
                            lambda d: {s for i in doomed for s in i.slice_ids()} <= d.unhealthy, 10)
    with pytest.raises(Exception, match="being destroyed by a re-cut"):
        env.app.state.allocate(doomed[0].slice_ids())  # type: ignore[union-attr]
    assert not env.app.state.inventory().gpus[0].healthy  # type: ignore[union-attr]  # no new placements

    def published_sick() -> bool:
        raw = (env.api.store.get_node("node-a")["metadata"].get("annotations") or {}).get(
            "example.com/gpu-slice.inventory")
        return raw is not None and json.loads(raw)["gpus"][0]["healthy"] is False
    await until(published_sick, 10)
    backend.go.set()
    await until(lambda: _status(env) is not None, 15)
    assert _status(env).gpus[0].state == "applied"
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE, lambda d: not d.unhealthy, 10)


class _NoCdi:
    def refresh(self, uuids: Any) -> Path:
        raise RecutFailed("CDI refresh 'nvidia-ctk cdi generate' exited 1: no driver")


async def test_instances_the_cdi_spec_cannot_name_are_destroyed_again() -> None:
    from datetime import UTC, datetime

    from deviceplugin.miglayouts import LayoutApplier
    from deviceplugin.server import PluginState

    backend = SimulatedBackend(TOPO7)
    state = PluginState("node-a", book=None)
    state.set_gpus(backend.discover())

    async def rediscover() -> None:
        state.set_gpus(backend.discover())

    async def event(reason: str, message: str, type_: str) -> None:
        return None

    applier = LayoutApplier(state=state, backend=backend, config=DYNAMIC, held=frozenset, rediscover=rediscover,
                            labels=dict, write=None, refresher=_NoCdi(), event=event)  # type: ignore[arg-type]
    out = await applier.apply(WantedLayouts(1, datetime.now(UTC), (WantedGpu(TOPO7.gpus[0].uuid, WANT_3G),)))
    (r,) = out.gpus
    assert r.state == "failed" and "destroyed again" in r.message and "no driver" in r.message
    assert [(i.profile, i.start) for i in state.gpus[0].instances] == [("1g.10gb", s) for s in range(4)]
    assert not state.withdrawn and state.inventory().gpus[0].healthy


def test_simulated_recut_layouts_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "layouts.yaml"
    backend = SimulatedBackend(TOPO7, layout_file=path)
    gpu = backend.discover()[0]
    out = backend.recut_mig(gpu.uuid, [i.uuid for i in gpu.instances if i.start >= 4], [("3g.40gb", 4)], frozenset())
    again = SimulatedBackend(TOPO7, layout_file=path).discover()[0]
    assert again.instances == backend.discover()[0].instances and again.instances[-1].uuid == out.created[0]
    other = parse_topology({"version": 1, "node": "other", "gpus": [{"product": "H100-80GB", "mode": "mps"}]})
    assert SimulatedBackend(other, layout_file=path).discover()[0].mode == "mps"  # not its file: ignored
