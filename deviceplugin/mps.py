"""MPS: one control daemon per ``mps`` GPU, supervised, and the client settings a slice pod needs.

**MPS is a packing boundary, not a security boundary.** Clients of one MPS server share one GPU
address space manager and one UID; a client can raise its own ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
back to the daemon's default (100 here) and set its own pinned-memory limit, a fault in one client
can take down the others on that GPU, and any process that reaches the pipe directory can talk to
the daemon. The limits below keep well-behaved pods to their share so the packer's arithmetic holds;
they do not contain a hostile pod. Use MIG (or whole GPUs) where isolation matters.

Layout under the configurable root (host side), one directory per GPU so daemons never share pipes::

    <root>/<GPU-uuid>/pipe   CUDA_MPS_PIPE_DIRECTORY of that GPU's daemon (mounted into clients)
    <root>/<GPU-uuid>/log    CUDA_MPS_LOG_DIRECTORY (control.log, server.log)
    <root>/shm               the /dev/shm shared by the daemon's servers and their clients

The daemon is started as ``<control> -d`` with ``CUDA_VISIBLE_DEVICES=<GPU-uuid>``, then told
``set_default_active_thread_percentage 100``. Liveness is ``get_default_active_thread_percentage``
answered within a timeout; a GPU's slices are Healthy only while its daemon answers. A daemon that
stops answering is told ``quit`` and started again, with exponential backoff between failed starts.
In simulated mode the same supervisor drives ``mps_standin.py`` (see ``standin_command``).
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from deviceplugin.backend import HealthEvent
from deviceplugin.errors import MpsError
from gpuslice.model import Gpu

log = logging.getLogger(__name__)

LimitsMode = Literal["memory-and-threads", "memory-only"]
LIMITS_MODES: tuple[str, ...] = ("memory-and-threads", "memory-only")
CONTAINER_PIPE_DIR = "/run/gpu-slice/mps/pipe"
"""Where a client container sees its GPU's pipe directory (one MPS GPU per pod, so one fixed path)."""
MAX_MPS_CLIENT_SLICES = 48
"""The MPS client limit per server (Volta+): S above this cannot be honoured on a real node."""


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

    Pure: no I/O. ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` is ``floor(100*k/S)`` (at least 1) unless
    ``limits_mode`` is ``memory-only``; ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` is
    ``0=<floor(memory*k/S)>M`` (device 0: the container sees only this GPU). The pipe directory is
    mounted read-write (clients create their own pipes there) and ``/dev/shm`` is shared with the
    daemon's servers.
    """
    if gpu.mode != "mps":
        raise MpsError(f"GPU {gpu.uuid} is in {gpu.mode} mode; MPS client settings need an mps GPU")
    if limits_mode not in LIMITS_MODES:
        raise MpsError(f"MPS limits mode must be one of {', '.join(LIMITS_MODES)}, got {limits_mode!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= gpu.slices:
        raise MpsError(f"GPU {gpu.uuid}: an MPS allocation takes 1..{gpu.slices} slices, got {k!r}")
    memory_mib = gpu.memory_mib * k // gpu.slices
    envs = {
        "CUDA_MPS_PIPE_DIRECTORY": container_pipe_dir,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={memory_mib}M",
    }
    if limits_mode == "memory-and-threads":
        envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, math.floor(100 * k / gpu.slices)))
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
            float(answer.split()[-1])
        except (ValueError, IndexError):
            return f"GPU {self.gpu_uuid}: MPS daemon gave an unexpected answer {answer!r}"
        return None

    def stop(self) -> None:
        """``quit``; a daemon that is already gone is not an error."""
        try:
            self.command("quit")
        except MpsError as exc:
            log.info("MPS daemon of %s did not take quit: %s", self.gpu_uuid, exc)


@dataclass(slots=True)
class _State:
    daemon: MpsDaemon
    up: bool | None = None
    reason: str = "MPS daemon not started yet"
    next_attempt: float = 0.0
    backoff: float = 0.0
    last_probe: float = 0.0


class MpsSupervisor:
    """Keeps one daemon per ``mps`` GPU running and reports each daemon's liveness as health.

    ``check_once`` is one deterministic pass (tests drive it); ``start`` runs it on a thread every
    ``tick_s``. Rule: a daemon is probed every ``probe_interval_s``; a failed probe marks the GPU
    unhealthy at once and the next pass restarts the daemon (``quit``, then ``-d``); failed starts back off
    exponentially from ``backoff_initial_s`` to ``backoff_max_s``; the first answered probe after a
    start marks the GPU healthy again.
    """

    def __init__(self, options: MpsOptions, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self._clock = clock
        self._lock = threading.RLock()
        self._states: dict[str, _State] = {}
        self._emit: Callable[[HealthEvent], None] = lambda _event: None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set_gpus(self, gpu_uuids: Iterable[str]) -> None:
        """Supervise exactly these GPUs: new ones are started on the next pass, dropped ones quit."""
        wanted = set(gpu_uuids)
        with self._lock:
            gone = [self._states.pop(uuid) for uuid in sorted(set(self._states) - wanted)]
            for uuid in sorted(wanted - set(self._states)):
                self._states[uuid] = _State(MpsDaemon(uuid, self.options), backoff=self.options.backoff_initial_s)
        # ``quit`` runs a subprocess: never under the lock that status()/is_up() (the RPC path) take.
        for st in gone:
            st.daemon.stop()

    def status(self) -> dict[str, bool]:
        """GPU UUID -> whether its daemon answered the last probe."""
        with self._lock:
            return {uuid: st.up is True for uuid, st in self._states.items()}

    def is_up(self, gpu_uuid: str) -> bool:
        with self._lock:
            st = self._states.get(gpu_uuid)
            return st is not None and st.up is True

    def reason(self, gpu_uuid: str) -> str:
        with self._lock:
            st = self._states.get(gpu_uuid)
            return "not an MPS GPU" if st is None else ("" if st.up else st.reason)

    def check_once(self) -> list[HealthEvent]:
        """One supervision pass over every GPU; returns (and emits) the health changes it saw."""
        events: list[HealthEvent] = []
        with self._lock:
            states = list(self._states.items())
        for uuid, st in states:
            now = self._clock()
            if st.up:
                if now - st.last_probe < self.options.probe_interval_s:
                    continue
                st.last_probe = now
                why = st.daemon.probe()
                if why is None:
                    continue
                st.daemon.stop()
                st.next_attempt = now  # restarted on the next pass
                st.backoff = self.options.backoff_initial_s
                self._set(st, uuid, False, f"MPS daemon stopped answering: {why}", events)
                continue
            if now < st.next_attempt:
                continue
            try:
                st.daemon.start()
                why = st.daemon.probe()
            except MpsError as exc:
                # Maybe a daemon from an earlier plugin run is still there: it counts if it answers.
                why = st.daemon.probe()
                if why is not None:
                    why = str(exc)
            st.last_probe = self._clock()
            if why is None:
                st.backoff = self.options.backoff_initial_s
                self._set(st, uuid, True, "MPS daemon answering", events)
            else:
                st.next_attempt = st.last_probe + st.backoff
                st.backoff = min(st.backoff * 2, self.options.backoff_max_s)
                self._set(st, uuid, False, f"MPS daemon not answering after start: {why}", events)
        for event in events:
            self._emit(event)
        return events

    def _set(self, st: _State, uuid: str, up: bool, reason: str, events: list[HealthEvent]) -> None:
        changed = st.up is not up
        st.up, st.reason = up, reason
        if changed:
            log.log(logging.INFO if up else logging.WARNING, "GPU %s: %s", uuid, reason)
            events.append(HealthEvent(uuid, up, reason))

    def start(self, emit: Callable[[HealthEvent], None]) -> None:
        """Run ``check_once`` on a daemon thread until ``close``."""
        self._emit = emit
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="mps-supervisor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check_once()
            except Exception:  # the supervisor must outlive any one surprise
                log.exception("MPS supervision pass failed")
            self._stop.wait(self.options.tick_s)

    def close(self) -> None:
        """Stop supervising and ``quit`` every daemon."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.options.start_timeout_s + self.options.probe_timeout_s * 3)
            self._thread = None
        self.set_gpus(())
