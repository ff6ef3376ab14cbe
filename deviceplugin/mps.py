"""MPS on one node: paths, per-client limits, client settings and one GPU's control daemon.

**MPS is a packing boundary, not a security boundary.** Clients of one MPS server share one UID,
a fault in one client can take down the others on that GPU, and a process that reaches the pipe
directory can talk to the daemon. The limits below keep pods to their share so the packer's
arithmetic holds; they do not contain a hostile pod. Use MIG (or whole GPUs) where isolation
matters.

**Whose daemon.** The control daemons belong to the ``gpu-slice-mps`` DaemonSet
(``gpu-slice mps-daemon``, :mod:`deviceplugin.mps_keeper`), not to the plugin: a container's
processes end with it, so a daemon started in the plugin's container would take every MPS
workload of the node down with each roll of the plugin. The plugin *asks* for a daemon by writing
a marker (``<root>/<GPU-uuid>/wanted``, JSON with the cap to start with), then adopts whatever
daemon answers on that GPU's pipe, sets its limits and reads its health
(:class:`deviceplugin.mps_supervisor.MpsSupervisor`). Nothing ever ``quit``s a daemon that still
has clients: a daemon told ``quit`` accepts no new clients and cannot be restarted until the old
ones exit.

**Where the limits live.** A pod's own env comes after the plugin's in its container, so
``CUDA_MPS_*`` env handed out by Allocate is advice a pod can override (and the shipped admission
policy refuses slice pods that set ``CUDA_MPS_*`` themselves). The enforced cap is the daemon's:
NVIDIA's MPS docs say a client's env "will only further constrain" the limit the control daemon
sets, and the daemon's limits are per client. The daemon has two kinds of setting:

* ``set_default_active_thread_percentage <pct>`` and ``set_default_device_pinned_mem_limit <dev>
  <value>``: for servers spawned later;
* ``set_active_thread_percentage <PID> <pct>`` and ``set_device_pinned_mem_limit <PID> <dev> <value>``:
  one running server (PIDs from ``get_server_list``), for clients created afterwards.

The MPS server serves one UID, so every slice pod on a GPU is a client of one server and the
daemon enforces one per-client cap per GPU (see :mod:`deviceplugin.mps_limits` for which cap).

The front end (``nvidia-cuda-mps-control`` reading stdin) exits 0 even when it rejects a command and
prints the error on stdout (man page), so every answer is checked: a set command must answer nothing
(memory) or the percentage it set.

Layout under the configurable root (host side), one directory per GPU so daemons never share pipes::

    <root>/<GPU-uuid>/pipe     CUDA_MPS_PIPE_DIRECTORY of that GPU's daemon (mounted into clients)
    <root>/<GPU-uuid>/log      CUDA_MPS_LOG_DIRECTORY (control.log, server.log)
    <root>/<GPU-uuid>/wanted   the plugin's request for a daemon on this GPU, with its start cap
    <root>/shm                 one bounded tmpfs: /dev/shm of the daemons, their servers and clients

The daemon is started as ``<control> -d`` with ``CUDA_VISIBLE_DEVICES=<GPU-uuid>`` (so its one GPU is
device 0 in its commands). In simulated mode the same code drives ``mps_standin.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from deviceplugin.errors import MpsError
from gpuslice.model import Gpu
from gpuslice.rules import mps_share_mib

log = logging.getLogger(__name__)

LimitsMode = Literal["memory-and-threads", "memory-only"]
LIMITS_MODES: tuple[str, ...] = ("memory-and-threads", "memory-only")
CONTAINER_PIPE_DIR = "/run/gpu-slice/mps/pipe"
"""Where a client container sees its GPU's pipe directory (one MPS GPU per pod, so one fixed path)."""
MAX_MPS_CLIENT_SLICES = 48
"""The MPS client limit per server (Volta+): S above this cannot be honoured on a real node."""
LIMITS_DEVICE = 0
"""The device in the daemon's limit commands: it runs with ``CUDA_VISIBLE_DEVICES=<GPU-uuid>``, so its
one GPU is ordinal 0 in its own numbering (as in the clients' ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``)."""


@dataclass(frozen=True, slots=True)
class MpsLimits:
    """The per-client limits of one GPU's daemon: the share of ``slices`` of the GPU's S."""

    slices: int
    active_thread_percentage: int
    pinned_mem_mib: int


def thread_percentage(k: int, slices: int) -> int:
    """``floor(100*k/S)``, at least 1 (0 would starve the client)."""
    return max(1, 100 * k // slices)


def mps_limits(gpu: Gpu, k: int, limits_mode: LimitsMode = "memory-and-threads") -> MpsLimits:
    """The limits of a ``k``-slice share of ``gpu``: memory by ``gpuslice.rules.mps_share_mib`` (the rule
    the packer uses), threads ``floor(100*k/S)`` (100 when ``limits_mode`` is ``memory-only``)."""
    if gpu.mode != "mps":
        raise MpsError(f"GPU {gpu.uuid} is in {gpu.mode} mode; MPS client settings need an mps GPU")
    if limits_mode not in LIMITS_MODES:
        raise MpsError(f"MPS limits mode must be one of {', '.join(LIMITS_MODES)}, got {limits_mode!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= gpu.slices:
        raise MpsError(f"GPU {gpu.uuid}: an MPS allocation takes 1..{gpu.slices} slices, got {k!r}")
    pct = thread_percentage(k, gpu.slices) if limits_mode == "memory-and-threads" else 100
    return MpsLimits(k, pct, mps_share_mib(gpu.memory_mib, k, gpu.slices))


@dataclass(frozen=True, slots=True)
class Mount:
    """A host path bind-mounted into the container (the fields of the kubelet API's ``Mount``)."""

    container_path: str
    host_path: str
    read_only: bool = False


def pipe_dir(root: str | os.PathLike[str], gpu_uuid: str) -> Path:
    return Path(root) / gpu_uuid / "pipe"


def log_dir(root: str | os.PathLike[str], gpu_uuid: str) -> Path:
    return Path(root) / gpu_uuid / "log"


def shm_dir(root: str | os.PathLike[str]) -> Path:
    return Path(root) / "shm"


def mps_client_settings(
    gpu: Gpu,
    k: int,
    root: str | os.PathLike[str],
    limits_mode: LimitsMode = "memory-and-threads",
    *,
    container_pipe_dir: str = CONTAINER_PIPE_DIR,
    shm_host_path: str | os.PathLike[str] | None = None,
) -> tuple[dict[str, str], tuple[Mount, ...]]:
    """The env and mounts for a container given ``k`` of the ``gpu.slices`` MPS slices of ``gpu``.

    Pure: no I/O. The limits are the pod's own share (``mps_limits``): information for the pod and a
    further constraint its client applies, not the enforcement, which is the daemon's cap
    (``MpsSupervisor.set_limits``); a pod can override its env but only below that cap.
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` is left out in ``memory-only`` mode;
    ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` is ``0=<MiB>M`` (device 0: the container sees only this GPU).
    The pipe directory is mounted read-write (clients create their own pipes there) and ``/dev/shm``
    is shared with the daemon's servers.
    """
    limits = mps_limits(gpu, k, limits_mode)
    envs = {
        "CUDA_MPS_PIPE_DIRECTORY": container_pipe_dir,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{LIMITS_DEVICE}={limits.pinned_mem_mib}M",
    }
    if limits_mode == "memory-and-threads":
        envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(limits.active_thread_percentage)
    shm = Path(shm_host_path) if shm_host_path is not None else shm_dir(root)
    mounts = (
        Mount(container_pipe_dir, str(pipe_dir(root, gpu.uuid))),
        Mount("/dev/shm", str(shm)),
    )
    return envs, mounts


def standin_command() -> tuple[str, ...]:
    """The control command that runs the stand-in daemon (simulated mode and tests)."""
    return (sys.executable, str(Path(__file__).with_name("mps_standin.py")))


@dataclass(frozen=True, slots=True)
class MpsOptions:
    """Where daemons live, which control binary to run, and how patiently to supervise them."""

    root: Path
    control_command: tuple[str, ...] = ("nvidia-cuda-mps-control",)
    default_active_thread_percentage: int = 100
    probe_timeout_s: float = 5.0
    probe_interval_s: float = 10.0
    start_timeout_s: float = 15.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    tick_s: float = 0.5
    extra_env: Mapping[str, str] = field(default_factory=dict)


class MpsDaemon:
    """One GPU's control daemon, driven only through the control binary (as an operator would)."""

    def __init__(self, gpu_uuid: str, options: MpsOptions) -> None:
        self.gpu_uuid = gpu_uuid
        self.options = options
        self.pipe_dir = pipe_dir(options.root, gpu_uuid)
        self.log_dir = log_dir(options.root, gpu_uuid)
        self.last_percentage: float | None = None  # the default percentage the last probe read

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.options.extra_env)
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir)
        env["CUDA_VISIBLE_DEVICES"] = self.gpu_uuid
        return env

    def start(self) -> None:
        """``<control> -d`` then the default thread percentage; raises ``MpsError`` saying why not."""
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run(
                [*self.options.control_command, "-d"], env=self.env(), stdin=subprocess.DEVNULL,
                capture_output=True, text=True, timeout=self.options.start_timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MpsError(f"GPU {self.gpu_uuid}: cannot start MPS control daemon: {exc}") from exc
        if done.returncode != 0:
            raise MpsError(f"GPU {self.gpu_uuid}: MPS control daemon exited {done.returncode}: "
                           f"{(done.stderr or done.stdout).strip()}")
        pct = self.options.default_active_thread_percentage
        self.command(f"set_default_active_thread_percentage {pct}")

    def command(self, line: str, timeout_s: float | None = None) -> str:
        """Send one command on the control binary's stdin; return its answer or raise ``MpsError``."""
        try:
            done = subprocess.run(
                list(self.options.control_command), input=line + "\n", env=self.env(), capture_output=True,
                text=True, timeout=timeout_s or self.options.probe_timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise MpsError(f"GPU {self.gpu_uuid}: MPS daemon did not answer {line!r} within "
                           f"{timeout_s or self.options.probe_timeout_s}s") from exc
        except OSError as exc:
            raise MpsError(f"GPU {self.gpu_uuid}: cannot run the MPS control binary: {exc}") from exc
        if done.returncode != 0:
            raise MpsError(f"GPU {self.gpu_uuid}: MPS control answered {line!r} with exit {done.returncode}: "
                           f"{(done.stderr or done.stdout).strip()}")
        return done.stdout.strip()

    def probe(self) -> str | None:
        """``None`` when the daemon answers with a percentage, else the reason it is considered down."""
        try:
            answer = self.command("get_default_active_thread_percentage")
        except MpsError as exc:
            return str(exc)
        try:
            self.last_percentage = float(answer.split()[-1])
        except (ValueError, IndexError):
            return f"GPU {self.gpu_uuid}: MPS daemon gave an unexpected answer {answer!r}"
        return None

    def server_pids(self) -> list[int]:
        """``get_server_list``: the PIDs of the servers running now (none until a client connects)."""
        answer = self.command("get_server_list")
        words = answer.split()
        if not all(w.isdigit() for w in words):
            raise MpsError(f"GPU {self.gpu_uuid}: MPS daemon answered get_server_list with {answer!r}")
        return [int(w) for w in words]

    def apply_limits(self, limits: MpsLimits) -> None:
        """Per-client limits as the defaults for servers spawned later, then on every running server.

        Each answer is checked (the front end exits 0 on a rejected command): memory commands answer
        nothing, percentage commands nothing or the percentage set. Raises ``MpsError`` on the first
        command the daemon does not take.
        """
        pct, mem = limits.active_thread_percentage, f"{limits.pinned_mem_mib}M"
        self._set_percentage(f"set_default_active_thread_percentage {pct}", pct)
        self._set_silent(f"set_default_device_pinned_mem_limit {LIMITS_DEVICE} {mem}")
        for pid in self.server_pids():
            self._set_percentage(f"set_active_thread_percentage {pid} {pct}", pct)
            self._set_silent(f"set_device_pinned_mem_limit {pid} {LIMITS_DEVICE} {mem}")

    def _set_percentage(self, line: str, pct: int) -> None:
        answer = self.command(line)
        try:
            ok = not answer or abs(float(answer.split()[-1]) - pct) < 0.05
        except ValueError:
            ok = False
        if not ok:
            raise MpsError(f"GPU {self.gpu_uuid}: MPS daemon did not take {line!r}: {answer!r}")

    def _set_silent(self, line: str) -> None:
        answer = self.command(line)
        if answer:
            raise MpsError(f"GPU {self.gpu_uuid}: MPS daemon did not take {line!r}: {answer!r}")

    def clients(self) -> list[int]:
        """PIDs of the clients connected to any of its servers (``get_client_list`` per server).

        Raises ``MpsError`` when the daemon does not answer: then nobody knows, and a caller that
        would quit it must not."""
        pids: list[int] = []
        for server in self.server_pids():
            answer = self.command(f"get_client_list {server}")
            words = answer.split()
            if not all(w.isdigit() for w in words):
                raise MpsError(f"GPU {self.gpu_uuid}: MPS daemon answered get_client_list {server} with {answer!r}")
            pids += [int(w) for w in words]
        return pids

    def quit_if_idle(self) -> tuple[bool, str]:
        """``quit`` only when no client is connected; (quit, why not). A daemon that does not answer
        is left alone (its clients, if any, cannot be counted)."""
        try:
            clients = self.clients()
        except MpsError as exc:
            return False, f"not answering ({exc})"
        if clients:
            return False, f"{len(clients)} client(s) connected (pids {', '.join(map(str, clients[:5]))})"
        try:
            self.command("quit")
        except MpsError as exc:
            return False, f"did not take quit: {exc}"
        return True, ""


@dataclass(frozen=True, slots=True)
class Wanted:
    """The plugin's request for a daemon on one GPU: the cap a freshly started daemon applies."""

    gpu_uuid: str
    limits: MpsLimits | None


def wanted_path(root: str | os.PathLike[str], gpu_uuid: str) -> Path:
    return Path(root) / gpu_uuid / "wanted"


def write_wanted(root: str | os.PathLike[str], gpu_uuid: str, limits: MpsLimits | None) -> None:
    """Ask for a daemon on this GPU (atomically: the keeper never reads half a file)."""
    path = wanted_path(root, gpu_uuid)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, object] = {"v": 1, "gpu": gpu_uuid, "limits": None}
    if limits is not None:
        doc["limits"] = {"slices": limits.slices, "activeThreadPercentage": limits.active_thread_percentage,
                         "pinnedMemMiB": limits.pinned_mem_mib}
    tmp = path.with_name(".wanted.tmp")
    tmp.write_text(json.dumps(doc, sort_keys=True))
    os.replace(tmp, path)


def remove_wanted(root: str | os.PathLike[str], gpu_uuid: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        wanted_path(root, gpu_uuid).unlink()


def read_wanted(root: str | os.PathLike[str]) -> dict[str, Wanted]:
    """Every GPU the plugin wants a daemon on; an unreadable marker still counts (without limits)."""
    out: dict[str, Wanted] = {}
    base = Path(root)
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return out
    for entry in entries:
        path = entry / "wanted"
        if not entry.name.startswith("GPU-") or not path.is_file():
            continue
        limits = None
        try:
            raw = json.loads(path.read_text()).get("limits")
            if isinstance(raw, dict):
                limits = MpsLimits(int(raw["slices"]), int(raw["activeThreadPercentage"]), int(raw["pinnedMemMiB"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("MPS marker %s unreadable (%s); starting its daemon without a cap", path, exc)
        out[entry.name] = Wanted(entry.name, limits)
    return out


