"""``gpu-slice mps-daemon``: markers in, daemons kept (real stand-in daemon processes), the drain at its end,
and the bounded tmpfs its init container mounts (a real mount, in a mount namespace of its own)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deviceplugin.mps import MpsDaemon, MpsLimits, MpsOptions, standin_command, write_wanted
from deviceplugin.mps_keeper import MpsKeeper, mounted_tmpfs, run
from tests.deviceplugin.test_mps import alive, daemon_pid

GPU = "GPU-11111111-2222-3333-4444-555555555555"
GPU2 = "GPU-22222222-2222-3333-4444-555555555555"


def options(root: Path) -> MpsOptions:
    return MpsOptions(root=root, control_command=standin_command(), probe_timeout_s=3.0, probe_interval_s=0.0,
                      backoff_initial_s=0.1, tick_s=0.05, extra_env={"GPU_SLICE_MPS_STANDIN_LIFETIME_S": "60"})


def test_markers_start_capped_daemons_and_a_dropped_gpu_s_daemon_waits_for_its_clients(tmp_path: Path) -> None:
    root = tmp_path / "mps"
    quit_: list[list[str]] = []
    keeper = MpsKeeper(options(root), poll_s=0.05, on_quit=quit_.append)
    write_wanted(root, GPU, MpsLimits(2, 28, 23302))
    write_wanted(root, GPU2, None)
    keeper.step()
    ask = MpsDaemon(GPU, options(root)).command
    # Started with the marker's cap before any client could connect.
    assert ask("get_default_device_pinned_mem_limit 0") == "23302M"
    assert ask("get_default_active_thread_percentage") == "28.0"
    assert keeper.supervisor.started == {GPU: 1, GPU2: 1}
    pid, pid2 = daemon_pid(root, GPU), daemon_pid(root, GPU2)
    ask("_client_connect 0 777")
    (root / GPU / "wanted").unlink()  # the plugin moved the GPU out of mps
    keeper.step()
    assert alive(pid) and keeper.supervisor.retiring() == {GPU: "1 client(s) connected (pids 777)"}
    ask("_client_exit 777")
    keeper.step()
    assert keeper.supervisor.retiring() == {}
    # At its end the keeper quits every idle daemon and says which GPUs it quit.
    stop = threading.Event()
    stop.set()
    assert keeper.run(stop, drain_s=0.0) == {}
    assert quit_ == [[GPU2]]
    deadline = time.monotonic() + 5
    while (alive(pid) or alive(pid2)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(pid) and not alive(pid2)


def test_mountinfo_is_read_for_a_tmpfs_at_the_shm_path(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 0:21 / /run rw,nosuid,nodev - tmpfs tmpfs rw,size=3274812k\n"
        f"90 22 0:52 / {tmp_path}/mps\\040root/shm rw,nosuid,nodev,noexec - tmpfs gpu-slice-mps-shm rw,size=1048576k\n"
        f"91 22 0:53 / {tmp_path}/plain rw - ext4 /dev/sda1 rw\n")
    (tmp_path / "mps root" / "shm").mkdir(parents=True)
    (tmp_path / "plain").mkdir()
    assert mounted_tmpfs(tmp_path / "mps root" / "shm", info)
    assert not mounted_tmpfs(tmp_path / "plain", info)
    assert not mounted_tmpfs(tmp_path / "elsewhere", info)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="mounting a tmpfs needs root and unshare (a mount namespace of its own)")
def test_mount_shm_mounts_one_bounded_tmpfs_once(tmp_path: Path) -> None:
    script = ("import sys\nfrom pathlib import Path\n"
              "from deviceplugin.mps_keeper import mount_shm, mounted_tmpfs\n"
              "root = Path(sys.argv[1])\nprint(mount_shm(root, 64 << 20))\nprint(mount_shm(root, 64 << 20))\n"
              "import os\nst = os.statvfs(root / 'shm')\n"
              "print(st.f_blocks * st.f_frsize, mounted_tmpfs(root / 'shm'))\n")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", script,
                           str(tmp_path / "mps")], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2], check=False)
    assert done.returncode == 0, done.stderr
    first, second, size = done.stdout.splitlines()
    assert first == f"mounted a 67108864-byte tmpfs at {tmp_path / 'mps' / 'shm'}"
    assert second == f"{tmp_path / 'mps' / 'shm'} is already a tmpfs; left as it is"
    assert size == "67108864 True"
    assert not mounted_tmpfs(tmp_path / "mps" / "shm")  # only inside that namespace


@pytest.mark.parametrize(("argv", "message"), [
    (["--mount-shm", "1Mi"], "mount_shm: 1Mi is below the 16Mi an MPS server needs"),
    (["--mount-shm", "lots"], "mount_shm: 'lots'"),
    (["--mps-root", "relative/dir"], "mps_root: relative/dir must be an absolute path"),
    (["--control", ""], "control: must name the MPS control binary or 'standin'"),
    (["--poll-seconds", "0"], "poll_s: must be positive, got 0.0"),
])
def test_bad_flags_stop_it_naming_the_field(argv: list[str], message: str,
                                            caplog: pytest.LogCaptureFixture) -> None:
    import argparse

    from deviceplugin import mps_keeper

    parser = argparse.ArgumentParser()
    mps_keeper.add_arguments(parser)
    assert run(parser.parse_args(argv)) == 2
    assert any(message in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]

