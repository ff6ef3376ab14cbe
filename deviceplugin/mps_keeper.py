"""``gpu-slice mps-daemon``: the MPS control daemons of one node, in a DaemonSet of their own.

A container's processes end with it, so the daemons live in the ``gpu-slice-mps`` DaemonSet, whose
updates are ``OnDelete``: a roll, a liveness failure or an OOM kill of the device plugin leaves every
daemon, and every MPS workload, running (the next plugin adopts them). This process:

* every ``poll_s`` reads the markers the plugin writes (``<root>/<GPU-uuid>/wanted``) and keeps one
  daemon per marked GPU (:class:`deviceplugin.mps_supervisor.MpsSupervisor` as the owner): started
  with the marker's cap before any client can reach it, started again if it dies, never told
  ``quit`` while a client is connected; a GPU whose marker is gone has its daemon quit once idle;
* on SIGTERM (the DaemonSet deleted, or the operator replacing its pod) stops starting daemons,
  quits each as soon as its last client exits, for up to ``--drain-seconds``, and restores the
  compute mode the plugin recorded for each GPU whose daemon it quit
  (:mod:`deviceplugin.compute_mode`), so an uninstall leaves no GPU in EXCLUSIVE_PROCESS;
* with ``--mount-shm SIZE`` (the DaemonSet's init container) mounts one bounded tmpfs at
  ``<root>/shm`` and exits: the daemon container sees it at ``/dev/shm`` (its servers' shared
  memory) and Allocate mounts the same host path at each MPS client's ``/dev/shm``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from deviceplugin.errors import MpsError, SettingsError
from deviceplugin.mps import MpsOptions, read_wanted, shm_dir, standin_command
from deviceplugin.mps_supervisor import MpsSupervisor
from gpuslice.errors import GpuSliceError
from gpuslice.units import parse_quantity

log = logging.getLogger("deviceplugin.mps_keeper")

DEFAULT_ROOT = Path("/run/gpu-slice/mps")
MIN_SHM_BYTES = 16 << 20
TMPFS_OPTIONS = "rw,nosuid,nodev,noexec"


class MpsKeeper:
    """The owner's loop: markers in, daemons kept; ``drain`` at the end."""

    def __init__(self, options: MpsOptions, *, poll_s: float = 1.0,
                 on_quit: Callable[[list[str]], None] | None = None) -> None:
        self.options = options
        self.poll_s = poll_s
        self.supervisor = MpsSupervisor(options, owns_daemons=True, marks_wanted=False)
        self._on_quit = on_quit

    def step(self) -> None:
        """Read the markers, then one supervision pass (start, adopt, retire)."""
        wanted = read_wanted(self.options.root)
        self.supervisor.set_gpus(wanted, {u: w.limits for u, w in wanted.items()})
        self.supervisor.check_once()

    def run(self, stop: threading.Event, drain_s: float) -> dict[str, str]:
        """Until ``stop``; then drain. Returns the GPUs whose daemon still had clients at the end."""
        while not stop.is_set():
            try:
                self.step()
            except Exception:  # one bad pass must not end the daemons' keeper (and its container)
                log.exception("MPS keeper pass failed")
            stop.wait(self.poll_s)
        gpus = sorted(self.supervisor.status()) + sorted(self.supervisor.retiring())
        log.info("stopping: quitting %d MPS daemon(s) as their clients exit (up to %.0fs)", len(gpus), drain_s)
        left = self.supervisor.drain(drain_s)
        quit_ = [u for u in gpus if u not in left]
        for uuid, why in sorted(left.items()):
            log.warning("GPU %s: MPS daemon still has clients (%s); it ends with this container", uuid, why)
        if self._on_quit is not None and quit_:
            self._on_quit(quit_)
        return left


# ---------------------------------------------------------------------------- the shm tmpfs

def mounted_tmpfs(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> bool:
    """Whether ``path`` is the mount point of a tmpfs (``/proc/self/mountinfo`` fields 5 and 9)."""
    target = os.path.realpath(path)
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and tail and _unescape(fields[4]) == target and tail[0] == "tmpfs":
            return True
    return False


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def mount_shm(root: Path, size_bytes: int, *, mount: tuple[str, ...] = ("mount",)) -> str:
    """Mount a tmpfs of ``size_bytes`` at ``<root>/shm`` unless one is there; returns what was done.

    Raises ``MpsError`` with mount's own message when it fails (not root, no CAP_SYS_ADMIN)."""
    target = shm_dir(root)
    target.mkdir(parents=True, exist_ok=True)
    if mounted_tmpfs(target):
        return f"{target} is already a tmpfs; left as it is"
    cmd = [*mount, "-t", "tmpfs", "-o", f"{TMPFS_OPTIONS},size={size_bytes}", "gpu-slice-mps-shm", str(target)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise MpsError(f"cannot mount a tmpfs at {target}: {(done.stderr or done.stdout).strip()}")
    return f"mounted a {size_bytes}-byte tmpfs at {target}"


# ---------------------------------------------------------------------------- the command

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mps-root", dest="mps_root", default=str(DEFAULT_ROOT),
                        help="host directory of the MPS pipes, logs, markers and shm (default /run/gpu-slice/mps; "
                             "the device plugin's --mps-root)")
    parser.add_argument("--control", default="nvidia-cuda-mps-control",
                        help="the MPS control binary, or 'standin' for the simulated daemon (no GPU)")
    parser.add_argument("--mount-shm", dest="mount_shm", metavar="SIZE",
                        help="mount a tmpfs of SIZE (a Kubernetes quantity, e.g. 1Gi) at <mps-root>/shm and exit "
                             "(the DaemonSet's init container)")
    parser.add_argument("--drain-seconds", dest="drain_s", type=float, default=25.0,
                        help="at SIGTERM, how long to wait for MPS clients to exit before leaving their daemons "
                             "to end with the container (default 25; keep it under the pod's grace period)")
    parser.add_argument("--restore-compute-mode", dest="restore_compute_mode", action="store_true",
                        help="at SIGTERM, set each GPU whose daemon was quit back to the compute mode the device "
                             "plugin recorded before it set EXCLUSIVE_PROCESS (needs NVML)")
    parser.add_argument("--poll-seconds", dest="poll_s", type=float, default=1.0,
                        help="how often the markers are read and the daemons probed (default 1)")
    parser.add_argument("--log-level", dest="log_level", default="INFO")


def _control(value: str) -> tuple[str, ...]:
    if value == "standin":
        return standin_command()
    if not value:
        raise SettingsError("control", "must name the MPS control binary or 'standin'")
    return (value,)


def _restorer(root: Path) -> Callable[[list[str]], None]:
    def restore(gpus: list[str]) -> None:
        from deviceplugin.compute_mode import restore_recorded

        for line in restore_recorded(root, gpus):
            log.info("%s", line)
    return restore


def run(args: argparse.Namespace) -> int:
    """Run until SIGTERM (exit 0), or mount the shm and exit; 2 for a bad flag, 1 for a failure."""
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = Path(args.mps_root)
    try:
        if not root.is_absolute():
            raise SettingsError("mps_root", f"{root} must be an absolute path")
        if not args.poll_s > 0:
            raise SettingsError("poll_s", f"must be positive, got {args.poll_s}")
        if args.drain_s < 0:
            raise SettingsError("drain_s", f"must not be negative, got {args.drain_s}")
        control = _control(args.control)
        size = None
        if args.mount_shm is not None:
            size = int(parse_quantity(args.mount_shm, what="mount_shm"))
            if size < MIN_SHM_BYTES:
                raise SettingsError("mount_shm", f"{args.mount_shm} is below the 16Mi an MPS server needs")
    except (SettingsError, GpuSliceError) as exc:
        log.error("invalid setting %s", exc)
        return 2
    if size is not None:
        try:
            log.info("%s", mount_shm(root, size))
        except MpsError as exc:
            log.error("%s", exc)
            return 1
        return 0
    keeper = MpsKeeper(MpsOptions(root=root, control_command=control, backoff_max_s=10.0),
                       poll_s=args.poll_s, on_quit=_restorer(root) if args.restore_compute_mode else None)
    stop = threading.Event()

    def _term(_sig: int, _frame: FrameType | None) -> None:
        stop.set()

    old: dict[int, Any] = {s: signal.signal(s, _term) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        keeper.run(stop, args.drain_s)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return 0
