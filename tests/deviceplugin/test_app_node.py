"""The plugin on a GPU node, whole app: CDI names checked against the spec, held ids without the API,
health events on a clean start, the API server's own refusal message, a missing kubelet socket."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path

import pytest

from deviceplugin.app import DevicePluginApp
from deviceplugin.mps import MpsOptions, pipe_dir, standin_command
from deviceplugin.mps_supervisor import MpsSupervisor
from deviceplugin.simulated import SimulatedBackend
from tests.deviceplugin.test_app import MIG, MPS, RESOURCE, TOPO, Env, until
from tests.kubelet.standin import slice_pod


def _spec(path: Path, names: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
                                "devices": [{"name": n, "containerEdits": {}} for n in names]}))


async def test_gpus_and_instances_the_cdi_spec_lacks_are_unhealthy_with_the_reason(env: Env) -> None:
    spec = env.dir / "cdi" / "nvidia.json"
    # An index-named spec with one MIG instance re-created since: only the MPS GPU and three instances.
    kept = [i.uuid for i in MIG.instances[:3]]
    _spec(spec, ["0", "1", "all", MPS.uuid, *kept])
    await env.start(cdi_validate=True, cdi_spec_dirs=(spec.parent,))
    gone = MIG.instances[3]
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE,
                            lambda d: d.unhealthy == frozenset(gone.slice_ids()))
    why = env.app.state.unhealthy[gone.uuid] if env.app.state else ""
    assert why.startswith(f"CDI device nvidia.com/gpu={gone.uuid} is not defined by the node's CDI spec ({spec})")
    assert "nvidia-ctk cdi generate --device-name-strategy=uuid" in why
    await until(lambda: any(gone.uuid in e["message"] for e in env.events("GpuUnhealthy")))
    _spec(spec, [MPS.uuid, *kept, gone.uuid])  # the operator regenerates the spec
    await env.app._check_cdi()
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE, lambda d: not d.unhealthy)
    await until(lambda: any(gone.uuid in e["message"] for e in env.events("GpuRecovered")))


async def test_without_the_api_held_ids_come_from_pod_resources(env: Env) -> None:
    await env.start(kube=False)
    [res] = await env.kubelet.admit_async([slice_pod("running", 3, created=1.0)])
    assert res.admitted
    await env.app._read_admitted()
    assert env.app._allocated() >= res.ids() and len(env.app._allocated()) == 3
    # PodResources unreadable: every id counts as held, so no GPU is reconfigured in use.
    env.app.settings = env.app.settings.__class__(**{**{f: getattr(env.app.settings, f)
                                                         for f in env.app.settings.__dataclass_fields__},
                                                      "pod_resources_socket": env.dir / "gone.sock"})
    await env.app._read_admitted()
    assert env.app._allocated() == frozenset(sid for g in TOPO.gpus for sid in g.slice_ids())


async def test_a_clean_start_reports_no_gpu_as_recovered(env: Env) -> None:
    """The MPS GPU is not healthy until its daemon answers; that is no failure and no recovery."""
    root = env.dir / "mps"
    sup = MpsSupervisor(MpsOptions(root=root, control_command=standin_command(), probe_interval_s=0.1,
                                   probe_timeout_s=3.0, tick_s=0.05, backoff_initial_s=0.1, backoff_max_s=0.5,
                                   extra_env={"GPU_SLICE_MPS_STANDIN_LIFETIME_S": "60"}))
    await env.start(backend=SimulatedBackend(TOPO, mps=sup))
    await asyncio.to_thread(env.kubelet.wait_for_devices, RESOURCE, lambda d: not d.unhealthy, 15)
    await asyncio.sleep(1.0)  # a few rediscoveries
    assert not [e for e in env.app.events_sent if e[1] in ("GpuRecovered", "GpuUnhealthy")], env.app.events_sent
    # A real failure afterwards is reported, and so is its recovery.
    os.kill(int((pipe_dir(root, MPS.uuid) / "standin.pid").read_text()), signal.SIGKILL)
    await until(lambda: any(e[1] == "GpuUnhealthy" for e in env.app.events_sent), 15)
    await until(lambda: any(e[1] == "GpuRecovered" for e in env.app.events_sent), 15)


def test_a_refused_write_logs_the_api_server_s_own_message() -> None:
    from kubernetes.client.exceptions import ApiException

    from deviceplugin.kube import _wrap

    exc = ApiException(status=422, reason="Unprocessable Entity")
    exc.body = json.dumps({"kind": "Status", "status": "Failure", "reason": "Invalid", "code": 422, "message": (
        "pods \"llm\" is forbidden: ValidatingAdmissionPolicy 'gpu-slice-annotations' with binding "
        "'gpu-slice-annotations' denied request: the device plugin may write example.com/gpu-slice.* annotations "
        "only on pods of its own node")}).encode()
    text = str(_wrap("patch pod default/llm", exc))
    assert text.startswith("patch pod default/llm: 422 Unprocessable Entity: pods \"llm\" is forbidden: ")
    assert text.endswith("may write example.com/gpu-slice.* annotations only on pods of its own node")
    plain = ApiException(status=500, reason="Internal Server Error")
    assert str(_wrap("list pods", plain)) == "list pods: 500 Internal Server Error"


async def test_a_missing_kubelet_socket_is_reported_again_and_again(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    from deviceplugin.settings import Settings

    settings = Settings(node_name="n", backend="simulated", plugin_dir=tmp_path / "dp", use_kube=False,
                        metrics_port=0, mps_root=tmp_path / "mps", dir_poll_s=0.05, kubelet_warn_s=0.2).validate()
    app = DevicePluginApp(settings, backend=SimulatedBackend(TOPO))
    stop = asyncio.Event()
    task = asyncio.create_task(app.run(stop))
    with caplog.at_level(logging.WARNING, logger="deviceplugin.registration"):
        await until(lambda: app.registrar is not None and app.registrar.missing_warnings >= 2, 10)
        stop.set()
        await asyncio.wait_for(task, 20)
    lines = [r.getMessage() for r in caplog.records if "registration socket" in r.getMessage()]
    assert len(lines) >= 2 and f"{tmp_path / 'dp' / 'kubelet.sock'} has been absent for" in lines[0]
    assert "is --plugin-dir kubelet's device-plugins directory" in lines[0]
