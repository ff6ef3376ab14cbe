"""MPS client settings (pure) and daemon supervision against the stand-in daemon (real processes)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deviceplugin.backend import HealthEvent
from deviceplugin.errors import MpsError
from deviceplugin.mps import (
    CONTAINER_PIPE_DIR,
    Mount,
    MpsDaemon,
    MpsLimits,
    MpsOptions,
    mps_client_settings,
    pipe_dir,
    standin_command,
)
from deviceplugin.mps_supervisor import MpsSupervisor
from gpuslice.model import Gpu, MigInstance

GPU = "GPU-11111111-2222-3333-4444-555555555555"


def mps_gpu(slices: int = 7) -> Gpu:
    return Gpu(GPU, 1, "H100-80GB", 81559, "mps", slices)


def test_client_settings_limit_threads_and_memory_to_the_share() -> None:
    envs, mounts = mps_client_settings(mps_gpu(), 2, "/run/gpu-slice/mps")
    assert envs == {
        "CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIR,
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "28",  # floor(100*2/7)
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=22644M",  # floor((81559 - 512 - 7*256) * 2/7)
    }
    assert mounts == (Mount(CONTAINER_PIPE_DIR, f"/run/gpu-slice/mps/{GPU}/pipe"),
                      Mount("/dev/shm", "/run/gpu-slice/mps/shm"))


def test_client_settings_memory_only_and_whole_share_and_milli_gpu() -> None:
    envs, _ = mps_client_settings(mps_gpu(), 7, "/r", "memory-only", shm_host_path="/dev/shm-mps")
    assert envs == {"CUDA_MPS_PIPE_DIRECTORY": CONTAINER_PIPE_DIR, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=79255M"}
    envs, _ = mps_client_settings(mps_gpu(1000), 1, "/r")
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"  # never 0: that would starve the client
    # S = 1000: client contexts are kept for the 48 clients an MPS server takes at most
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=68M"  # floor((81559 - 512 - 48*256) / 1000)


@pytest.mark.parametrize(("gpu", "k", "mode", "message"), [
    (mps_gpu(), 0, "memory-and-threads", f"GPU {GPU}: an MPS allocation takes 1..7 slices, got 0"),
    (mps_gpu(), 8, "memory-and-threads", f"GPU {GPU}: an MPS allocation takes 1..7 slices, got 8"),
    (mps_gpu(), 2, "threads", "MPS limits mode must be one of memory-and-threads, memory-only, got 'threads'"),
    (Gpu(GPU, 0, "H100-80GB", 81559, "whole", 7), 1, "memory-and-threads",
     f"GPU {GPU} is in whole mode; MPS client settings need an mps GPU"),
    (Gpu(GPU, 0, "H100-80GB", 81559, "mig", 7, instances=(MigInstance("MIG-x", "7g.80gb", 0, 7, 81152),)), 1,
     "memory-and-threads", f"GPU {GPU} is in mig mode; MPS client settings need an mps GPU"),
])
def test_client_settings_refusals(gpu: Gpu, k: int, mode: str, message: str) -> None:
    with pytest.raises(MpsError) as exc:
        mps_client_settings(gpu, k, "/r", mode)  # type: ignore[arg-type]
    assert str(exc.value) == message


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "mps"


def options(root: Path, **kw: object) -> MpsOptions:
    base: dict[str, object] = {
        "root": root, "control_command": standin_command(), "probe_timeout_s": 3.0, "probe_interval_s": 0.0,
        "backoff_initial_s": 1.0, "tick_s": 0.05, "extra_env": {"GPU_SLICE_MPS_STANDIN_LIFETIME_S": "60"}}
    base.update(kw)
    return MpsOptions(**base)  # type: ignore[arg-type]


def daemon_pid(root: Path, gpu: str = GPU) -> int:
    return int((pipe_dir(root, gpu) / "standin.pid").read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


@pytest.fixture
def supervisor(root: Path) -> Iterator[MpsSupervisor]:
    sup = MpsSupervisor(options(root))
    yield sup
    sup.close()


def test_daemon_starts_with_its_own_dirs_env_and_default_percentage(root: Path) -> None:
    daemon = MpsDaemon(GPU, options(root))
    daemon.start()
    try:
        assert daemon.probe() is None
        assert daemon.command("get_default_active_thread_percentage") == "100.0"
        log = (root / GPU / "log" / "control.log").read_text()
        assert f"CUDA_VISIBLE_DEVICES={GPU}" in log
        assert "'set_default_active_thread_percentage 100'" in log
    finally:
        assert daemon.quit_if_idle() == (True, "")
    assert daemon.probe() is not None


def test_killed_daemon_turns_unhealthy_then_is_restarted(root: Path, supervisor: MpsSupervisor) -> None:
    supervisor.set_gpus([GPU])
    assert supervisor.check_once() == [HealthEvent(GPU, True, "MPS daemon answering")]
    assert supervisor.is_up(GPU)
    first = daemon_pid(root)
    os.kill(first, signal.SIGKILL)
    down = supervisor.check_once()
    assert len(down) == 1 and not down[0].healthy
    assert down[0].reason.startswith(f"MPS daemon stopped answering: GPU {GPU}: MPS control answered "
                                     "'get_default_active_thread_percentage' with exit 1: Cannot find MPS control")
    assert not supervisor.is_up(GPU) and supervisor.status() == {GPU: False}
    assert supervisor.check_once() == [HealthEvent(GPU, True, "MPS daemon answering")]
    assert daemon_pid(root) != first


def test_close_quits_every_daemon(root: Path) -> None:
    sup = MpsSupervisor(options(root))
    sup.set_gpus([GPU])
    sup.check_once()
    pid = daemon_pid(root)
    sup.close()
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(pid)
    assert sup.status() == {}


def test_failed_starts_back_off_exponentially(root: Path, tmp_path: Path) -> None:
    counter = tmp_path / "starts"
    script = ("import sys, pathlib\n"
              "p = pathlib.Path(sys.argv[1])\n"
              "if '-d' in sys.argv: p.write_text(p.read_text() + 'x' if p.exists() else 'x')\n"
              "print('no GPU here', file=sys.stderr); sys.exit(3)\n")
    now = [0.0]
    sup = MpsSupervisor(options(root, control_command=(sys.executable, "-c", script, str(counter))),
                        clock=lambda: now[0])
    sup.set_gpus([GPU])
    try:
        events = sup.check_once()
        assert events == [HealthEvent(GPU, False, f"MPS daemon not answering after start: GPU {GPU}: "
                                                  "MPS control daemon exited 3: no GPU here")]
        starts = []
        for t in (0.5, 1.0, 2.9, 3.0, 6.9, 7.0):
            now[0] = t
            assert sup.check_once() == []  # still down: no repeated events
            starts.append(len(counter.read_text()))
        assert starts == [1, 2, 2, 3, 3, 4]  # retries at t=1, 3, 7: backoff 1, 2, 4 s
    finally:
        sup.close()


def test_supervisor_thread_reports_loss_and_recovery(root: Path) -> None:
    sup = MpsSupervisor(options(root))
    events: list[HealthEvent] = []
    sup.set_gpus([GPU])
    sup.start(events.append)
    try:
        deadline = time.monotonic() + 10
        while not events and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [e.healthy for e in events] == [True]
        os.kill(daemon_pid(root), signal.SIGKILL)
        while len(events) < 3 and time.monotonic() < deadline + 10:
            time.sleep(0.02)
        assert [e.healthy for e in events] == [True, False, True]
    finally:
        sup.close()


def test_status_answers_while_a_dropped_daemon_takes_its_time_to_quit(root: Path, tmp_path: Path) -> None:
    """The owner retires a dropped GPU's daemon in its pass, outside the lock the event loop's health
    reads take."""
    slow = tmp_path / "slow-control"
    slow.write_text("#!/bin/sh\nif [ \"$1\" = -d ]; then exec " + " ".join(standin_command()) + " -d; fi\n"
                    "read line\nif [ \"$line\" = quit ]; then sleep 1.5; fi\n"
                    "echo \"$line\" | exec " + " ".join(standin_command()) + "\n")
    slow.chmod(0o755)
    sup = MpsSupervisor(options(root, control_command=(str(slow),)))
    try:
        sup.set_gpus([GPU])
        sup.check_once()
        assert sup.is_up(GPU)
        sup.set_gpus([])
        retirer = threading.Thread(target=sup.check_once)
        retirer.start()
        time.sleep(0.4)  # the quit is under way
        start = time.monotonic()
        assert sup.status() == {} and sup.retiring() == {GPU: ""}
        assert time.monotonic() - start < 0.5
        retirer.join(10)
        assert sup.retiring() == {}
    finally:
        sup.close()


def client(root: Path, line: str, gpu: str = GPU) -> str:
    return MpsDaemon(gpu, options(root)).command(line)


def test_a_daemon_that_stops_answering_is_never_quit_and_is_adopted_when_it_answers_again(root: Path) -> None:
    """A hung daemon may still serve clients: no quit, no second daemon; the same process comes back."""
    sup = MpsSupervisor(options(root, probe_timeout_s=2.0))
    sup.set_gpus([GPU])
    try:
        assert [e.healthy for e in sup.check_once()] == [True]
        pid = daemon_pid(root)
        os.kill(pid, signal.SIGSTOP)
        try:
            down = sup.check_once()
            assert [e.healthy for e in down] == [False] and "did not answer" in down[0].reason
            assert sup.check_once() == []  # the start is refused: the hung daemon still holds its lock
            assert daemon_pid(root) == pid and alive(pid)
        finally:
            os.kill(pid, signal.SIGCONT)
        time.sleep(1.1)  # the start backoff
        assert [e.healthy for e in sup.check_once()] == [True]
        assert daemon_pid(root) == pid and sup.adopted == {GPU: 1} and sup.started == {GPU: 1}
    finally:
        sup.close()


def test_the_plugin_never_starts_or_quits_a_daemon_it_adopts_it_and_marks_the_gpu(root: Path) -> None:
    now = [0.0]
    plugin = MpsSupervisor(options(root), owns_daemons=False, marks_wanted=True, clock=lambda: now[0])
    plugin.set_gpus([GPU])
    assert json.loads((root / GPU / "wanted").read_text()) == {"v": 1, "gpu": GPU, "limits": None}
    down = plugin.check_once()
    assert [e.healthy for e in down] == [False]
    assert "its daemon is run by the gpu-slice-mps DaemonSet" in down[0].reason
    assert not (pipe_dir(root, GPU) / "standin.pid").exists()  # nothing started
    keeper = MpsDaemon(GPU, options(root))
    keeper.start()  # what gpu-slice mps-daemon does
    pid = daemon_pid(root)
    now[0] = 1.0  # after the backoff
    plugin.set_limits({GPU: MpsLimits(2, 28, 23302)})
    assert [e.healthy for e in plugin.check_once()] == [True]
    assert plugin.adopted == {GPU: 1} and plugin.started == {}
    assert keeper.command("get_default_device_pinned_mem_limit 0") == "23302M"
    # The cap it applied is in the marker, so a daemon its owner restarts starts capped.
    assert json.loads((root / GPU / "wanted").read_text())["limits"] == {
        "slices": 2, "activeThreadPercentage": 28, "pinnedMemMiB": 23302}
    plugin.close()  # a plugin stopped (a roll): the daemon and the marker stay
    assert alive(pid) and (root / GPU / "wanted").exists()
    plugin2 = MpsSupervisor(options(root), owns_daemons=False, marks_wanted=True)
    plugin2.set_gpus([GPU])
    assert [e.healthy for e in plugin2.check_once()] == [True] and daemon_pid(root) == pid
    plugin2.set_gpus([])  # the GPU left mps: the marker goes, the daemon is its owner's to retire
    assert not (root / GPU / "wanted").exists() and alive(pid)
    plugin2.close()
    assert keeper.quit_if_idle() == (True, "")


def test_the_owner_retires_a_daemon_only_once_its_last_client_exits(root: Path) -> None:
    sup = MpsSupervisor(options(root))
    sup.set_gpus([GPU])
    try:
        sup.check_once()
        pid = daemon_pid(root)
        assert client(root, "_client_connect 1000 4242") == ""
        assert client(root, "_client_connect 2000 4343").startswith("queued")  # another UID waits
        sup.set_gpus([])
        sup.check_once()
        assert alive(pid) and sup.retiring() == {GPU: "1 client(s) connected (pids 4242)"}
        assert sup.drain(0.0) == {GPU: "1 client(s) connected (pids 4242)"}  # an owner's end: kept too
        client(root, "_client_exit 4242")
        sup.check_once()
        assert sup.retiring() == {}
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(pid)
    finally:
        sup.close()
