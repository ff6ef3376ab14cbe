"""MPS limits set in the per-GPU control daemon (issue 9 point 9), not only in the pod's env.

A pod's env comes after the plugin's in the container (kubelet appends it), so
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``/``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` from the plugin are only
advice; the daemon's per-client limits are what a client cannot raise. These tests drive the stand-in
daemon through the same control commands the real ``nvidia-cuda-mps-control`` takes on stdin and
read the limits back from it.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.assignments import AssignmentBook, PodView
from deviceplugin.mps import (
    MpsLimits,
    MpsOptions,
    mps_client_settings,
    mps_limits,
    pipe_dir,
    standin_command,
)
from deviceplugin.mps_limits import MpsLimitKeeper, held_groups, largest_shares, wanted_limits
from deviceplugin.mps_supervisor import MpsSupervisor
from deviceplugin.simulated import SimulatedBackend
from gpuslice.model import Gpu, NodeInventory
from tests.deviceplugin.test_app import MPS, TOPO, Env, until
from tests.deviceplugin.test_app import env as env  # the whole-plugin fixture
from tests.kubelet.standin import slice_pod

GPU = "GPU-11111111-2222-3333-4444-555555555555"
H100 = Gpu(GPU, 1, "H100-80GB", 81559, "mps", 7)


def ask(root: Path, line: str, gpu: str = GPU) -> str:
    """One command to a GPU's daemon through the control binary, as an operator would type it."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir(root, gpu)), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(list(standin_command()), input=line + "\n", env=env, capture_output=True, text=True,
                          timeout=10, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def options(root: Path, **kw: object) -> MpsOptions:
    base: dict[str, object] = {
        "root": root, "control_command": standin_command(), "probe_timeout_s": 3.0, "probe_interval_s": 0.0,
        "backoff_initial_s": 1.0, "backoff_max_s": 4.0, "tick_s": 0.05,
        "extra_env": {"GPU_SLICE_MPS_STANDIN_LIFETIME_S": "60"}}
    base.update(kw)
    return MpsOptions(**base)  # type: ignore[arg-type]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "mps"


@pytest.fixture
def supervisor(root: Path) -> Iterator[MpsSupervisor]:
    sup = MpsSupervisor(options(root))
    yield sup
    sup.close()


# --------------------------------------------------------------------------- the one share rule


def test_daemon_limits_and_client_env_come_from_the_same_share() -> None:
    assert mps_limits(H100, 3) == MpsLimits(3, 42, 33966)  # floor(300/7), floor((81559 - 512 - 7*256)*3/7) MiB
    assert mps_limits(H100, 7) == MpsLimits(7, 100, 79255)
    assert mps_limits(H100, 2, "memory-only") == MpsLimits(2, 100, 22644)
    envs, _ = mps_client_settings(H100, 3, "/r")
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "42"
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=33966M"


def _pod(name: str, *, assignment: tuple[str, ...] | None = None, allocated: tuple[str, ...] | None = None,
         phase: str = "Running") -> PodView:
    return PodView("default", name, f"uid-{name}", "n", phase, assignment_ids=assignment, allocated_ids=allocated)


def test_largest_share_per_gpu_counts_every_holder_and_is_one_slice_when_idle() -> None:
    other = Gpu("GPU-22222222-2222-3333-4444-555555555555", 2, "H100-80GB", 81559, "mps", 7)
    inv = NodeInventory("n", (H100, other))
    ids, ids2 = H100.slice_ids(), other.slice_ids()
    book = AssignmentBook("n")
    book.upsert(_pod("stamped", allocated=ids[:2]))
    book.upsert(_pod("pending", assignment=ids[2:5], phase="Pending"))  # 3 slices promised
    book.upsert(_pod("done", allocated=ids2[:6], phase="Succeeded"))  # holds nothing
    book.admitted[("default", "running")] = ids[5:6]
    book.note_allocated(ids2[:2])
    assert largest_shares(inv, held_groups(book)) == {GPU: 3, other.uuid: 2}
    assert largest_shares(inv, []) == {GPU: 1, other.uuid: 1}
    wanted = wanted_limits(inv, {GPU: 3, other.uuid: 2}, "memory-and-threads")
    assert wanted == {GPU: MpsLimits(3, 42, 33966), other.uuid: MpsLimits(2, 28, 22644)}


# --------------------------------------------------------------------------- the stand-in daemon


def test_standin_servers_take_the_defaults_at_spawn_and_per_server_commands_after(root: Path) -> None:
    """The documented semantics: defaults reach only servers spawned later; per-server commands reach
    a running server."""
    pipe = pipe_dir(root, GPU)
    pipe.mkdir(parents=True)
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(root / "log"),
           "GPU_SLICE_MPS_STANDIN_LIFETIME_S": "60", "PATH": "/usr/bin:/bin"}
    subprocess.run([*standin_command(), "-d"], env=env, check=True, timeout=15)
    try:
        assert ask(root, "get_server_list") == ""
        assert ask(root, "start_server -uid 1000") == ""
        [first] = ask(root, "get_server_list").split()
        assert ask(root, "set_default_active_thread_percentage 42") == "42.0"
        assert ask(root, "set_default_device_pinned_mem_limit 0 33966M") == ""
        assert ask(root, "get_default_device_pinned_mem_limit 0") == "33966M"
        assert ask(root, f"get_active_thread_percentage {first}") == "100.0"  # spawned before: unchanged
        assert ask(root, f"get_device_pinned_mem_limit {first} 0") == ""
        assert ask(root, "start_server -uid 1001") == ""
        second = next(p for p in ask(root, "get_server_list").split() if p != first)
        assert ask(root, f"get_active_thread_percentage {second}") == "42.0"  # spawned after: defaults
        assert ask(root, f"get_device_pinned_mem_limit {second} 0") == "33966M"
        assert ask(root, f"set_active_thread_percentage {first} 14") == "14.0"
        assert ask(root, f"set_device_pinned_mem_limit {first} 0 11322M") == ""
        assert ask(root, f"get_device_pinned_mem_limit {first} 0") == "11322M"
        # A rejected command prints an error on stdout and the front end still exits 0 (man page).
        assert ask(root, "set_device_pinned_mem_limit 999999 0 1G").startswith("Error")
        assert ask(root, "set_default_device_pinned_mem_limit 0 12X").startswith("Error")
    finally:
        ask(root, "quit")


# --------------------------------------------------------------------------- the supervisor


def test_limits_are_in_the_daemon_before_its_gpu_turns_healthy(root: Path, supervisor: MpsSupervisor) -> None:
    supervisor.set_gpus([GPU])
    supervisor.set_limits({GPU: mps_limits(H100, 1)})
    [event] = supervisor.check_once()
    assert event.healthy
    assert ask(root, "get_default_active_thread_percentage") == "14.0"
    assert ask(root, "get_default_device_pinned_mem_limit 0") == "11322M"
    assert supervisor.applied(GPU) == MpsLimits(1, 14, 11322)


def test_raising_and_lowering_reach_the_running_server_and_later_ones(root: Path,
                                                                      supervisor: MpsSupervisor) -> None:
    supervisor.set_gpus([GPU])
    supervisor.set_limits({GPU: mps_limits(H100, 1)})
    supervisor.check_once()
    ask(root, "start_server -uid 1000")  # a client connected: its server took the 1-slice defaults
    [server] = ask(root, "get_server_list").split()
    assert ask(root, f"get_active_thread_percentage {server}") == "14.0"
    supervisor.set_limits({GPU: mps_limits(H100, 3)})
    assert not supervisor.covers(GPU, 3)
    supervisor.check_once()
    assert supervisor.covers(GPU, 3)
    assert ask(root, f"get_active_thread_percentage {server}") == "42.0"
    assert ask(root, f"get_device_pinned_mem_limit {server} 0") == "33966M"
    assert ask(root, "get_default_active_thread_percentage") == "42.0"
    supervisor.set_limits({GPU: mps_limits(H100, 1)})
    supervisor.check_once()
    assert ask(root, f"get_active_thread_percentage {server}") == "14.0"
    assert ask(root, f"get_device_pinned_mem_limit {server} 0") == "11322M"
    assert ask(root, "get_default_device_pinned_mem_limit 0") == "11322M"


def test_a_refused_limit_is_logged_counted_retried_with_backoff_and_health_follows_the_probe_only(
        root: Path, caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    seen: list[tuple[str, MpsLimits | None, str]] = []
    sup = MpsSupervisor(options(root, extra_env={"GPU_SLICE_MPS_STANDIN_LIFETIME_S": "60",
                                                 "GPU_SLICE_MPS_STANDIN_REFUSE": "set_default_device_pinned"}),
                        clock=lambda: now[0])
    sup.observe_limits(lambda uuid, applied, error: seen.append((uuid, applied, error)))
    try:
        sup.set_gpus([GPU])
        sup.set_limits({GPU: mps_limits(H100, 2)})
        with caplog.at_level(logging.WARNING, logger="deviceplugin.mps"):
            [event] = sup.check_once()
        assert event.healthy and sup.is_up(GPU)  # the daemon answers: its slices stay Healthy
        assert len(seen) == 1 and seen[0][0] == GPU and seen[0][1] is None
        assert "set_default_device_pinned_mem_limit 0 22644M" in seen[0][2] and "Error" in seen[0][2]
        assert "did not take the limits" in caplog.text
        assert sup.applied(GPU) is None and not sup.covers(GPU, 2)
        attempts = []
        for t in (0.5, 1.0, 2.9, 3.0, 6.9, 7.0):
            now[0] = t
            assert sup.check_once() == []
            attempts.append(len(seen))
        assert attempts == [1, 2, 2, 3, 3, 4]  # retried at t=1, 3, 7: backoff 1, 2, 4 s
        assert sup.is_up(GPU)
        assert sup.wait_limits(GPU, 2, timeout_s=0.1) is not None  # Allocate would be refused, not hang
    finally:
        sup.close()


def test_probe_re_applies_limits_changed_behind_the_supervisor(root: Path, supervisor: MpsSupervisor) -> None:
    supervisor.set_gpus([GPU])
    supervisor.set_limits({GPU: mps_limits(H100, 2)})
    supervisor.check_once()
    ask(root, "set_default_active_thread_percentage 100")  # someone else, or a daemon restarted by hand
    supervisor.check_once()  # probe notices; the same pass puts the limits back
    assert ask(root, "get_default_active_thread_percentage") == "28.0"


def test_wait_limits_returns_once_applied_and_health_reads_never_wait_for_the_daemon(root: Path,
                                                                                    tmp_path: Path) -> None:
    """No lock is held across a daemon command: status() answers while a slow command runs."""
    slow = tmp_path / "slow-control"
    slow.write_text("#!/bin/sh\nif [ \"$1\" = -d ]; then exec " + " ".join(standin_command()) + " -d; fi\n"
                    "read line\ncase \"$line\" in set_default_device*) sleep 1.0;; esac\n"
                    "echo \"$line\" | exec " + " ".join(standin_command()) + "\n")
    slow.chmod(0o755)
    sup = MpsSupervisor(options(root, control_command=(str(slow),), probe_interval_s=30.0))
    events: list[object] = []
    try:
        sup.set_gpus([GPU])
        sup.set_limits({GPU: mps_limits(H100, 1)})
        sup.start(events.append)
        deadline = time.monotonic() + 15
        while not sup.covers(GPU, 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sup.covers(GPU, 1)
        result: list[str | None] = []
        sup.set_limits({GPU: mps_limits(H100, 4)})
        waiter = threading.Thread(target=lambda: result.append(sup.wait_limits(GPU, 4, timeout_s=10)))
        waiter.start()
        time.sleep(0.3)  # the slow command is under way
        start = time.monotonic()
        assert sup.status() == {GPU: True} and sup.is_up(GPU)
        assert time.monotonic() - start < 0.5
        waiter.join(15)
        assert result == [None]
        assert ask(root, "get_default_active_thread_percentage") == "57.0"
    finally:
        sup.close()


# --------------------------------------------------------------------------- the whole plugin


async def test_allocate_answers_only_after_the_daemon_caps_clients_at_the_pods_share(env: Env) -> None:
    """A 4-slice pod of another scheduler (only the MPS GPU fits it; no assignment raises the cap
    early): when kubelet has Allocate's answer, the daemon already caps new clients and the running
    server at 4/7; once the pod is gone, at 1/7 again."""
    root = env.dir / "mps"
    sup = MpsSupervisor(MpsOptions(root=root, control_command=standin_command(), probe_interval_s=0.2,
                                   probe_timeout_s=3.0, tick_s=0.05, backoff_initial_s=0.1, backoff_max_s=0.5,
                                   extra_env={"GPU_SLICE_MPS_STANDIN_LIFETIME_S": "60"}))
    await env.start(backend=SimulatedBackend(TOPO, mps=sup))
    await asyncio.to_thread(env.kubelet.wait_for_devices, "example.com/gpu-slice", lambda d: not d.unhealthy, 15)
    await until(lambda: sup.covers(MPS.uuid, 1))
    assert await asyncio.to_thread(ask, root, "get_default_active_thread_percentage", MPS.uuid) == "14.0"
    await asyncio.to_thread(ask, root, "start_server -uid 1000", MPS.uuid)  # a client already connected
    [server] = (await asyncio.to_thread(ask, root, "get_server_list", MPS.uuid)).split()
    pod = slice_pod("foreign", 4, created=1.0)
    [res] = await env.kubelet.admit_async([pod])
    assert res.admitted, res.error
    assert res.ids() <= frozenset(MPS.slice_ids())
    # Allocate has answered: the cap is already in the daemon, for new servers and the running one.
    assert await asyncio.to_thread(ask, root, "get_default_active_thread_percentage", MPS.uuid) == "57.0"
    assert await asyncio.to_thread(ask, root, "get_default_device_pinned_mem_limit 0", MPS.uuid) == "45288M"
    assert await asyncio.to_thread(ask, root, f"get_active_thread_percentage {server}", MPS.uuid) == "57.0"
    assert await asyncio.to_thread(ask, root, f"get_device_pinned_mem_limit {server} 0", MPS.uuid) == "45288M"
    assert env.app.registry.get_sample_value("gpu_slice_mps_limit_slices", {"gpu_uuid": MPS.uuid}) == 4.0
    # The pod's env still carries its own share, as information (a client takes the lower of the two).
    response = res.containers[0].response
    assert response is not None and response.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "57"
    await until(lambda: env.app.book is not None and ("default", "foreign") in env.app.book.admitted)
    await asyncio.to_thread(env.kubelet.delete_pod, pod.uid)
    await until(lambda: sup.applied(MPS.uuid) == MpsLimits(1, 14, 11322), timeout=15)
    assert await asyncio.to_thread(ask, root, f"get_active_thread_percentage {server}", MPS.uuid) == "14.0"
    assert env.app.registry.get_sample_value("gpu_slice_mps_limit_slices", {"gpu_uuid": MPS.uuid}) == 1.0


def test_keeper_without_a_supervisor_changes_nothing() -> None:
    keeper = MpsLimitKeeper(None, lambda: NodeInventory("n", (H100,)), lambda: None, "memory-and-threads")
    keeper.refresh()
    assert asyncio.run(keeper.before_allocate(_placement())) is None


def _placement() -> object:
    from gpuslice.placement import Placement
    return Placement("n", "mps", (GPU,), None, H100.slice_ids()[:2], 22644)

