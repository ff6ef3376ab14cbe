"""MPS: one control daemon per ``mps`` GPU, supervised, with per-client limits set *in the daemon*.

**MPS is a packing boundary, not a security boundary.** Clients of one MPS server share one GPU
address space manager and one UID, a fault in one client can take down the others on that GPU, and
any process that reaches the pipe directory can talk to the daemon (and so change its limits). The
limits below keep pods to their share so the packer's arithmetic holds; they do not contain a
hostile pod. Use MIG (or whole GPUs) where isolation matters.

**Where the limits live.** A pod's own env comes after the plugin's in its container (kubelet appends
it), so ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``/``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` handed out by
Allocate are advice a pod can override. The enforced cap is the daemon's: NVIDIA's MPS docs say a
client's env "will only further constrain" the limit the control daemon sets, and the daemon's limits
are per client. The daemon has two kinds of setting (same docs, control commands):

* ``set_default_active_thread_percentage <pct>`` and ``set_default_device_pinned_mem_limit <dev>
  <value>``: for servers spawned later ("if there is already a server spawned, this command will only
  affect the next server");
* ``set_active_thread_percentage <PID> <pct>`` and ``set_device_pinned_mem_limit <PID> <dev> <value>``:
  one running server (PIDs from ``get_server_list``), for clients created afterwards ("existing
  clients are not affected").

The MPS server serves one UID, so every slice pod on a GPU is a client of one server and the daemon
can enforce one per-client cap per GPU. ``MpsSupervisor.set_limits`` takes that cap (``MpsLimits``:
the share of the *largest* pod on the GPU, see ``deviceplugin.mps_limits``) and the supervisor
thread sends both kinds of command, so servers running now and spawned later agree. Raising happens
before Allocate answers the larger pod (its client connects later, so it gets the raised cap);
lowering when that pod is gone affects only clients that connect afterwards. When all pods on a GPU
are one size (replicas of one Deployment) the cap is each pod's exact share. With mixed sizes it is
the largest share: a smaller pod is held to its own share only by its env (which it can override),
and the daemon still stops any client going past the largest share.

The front end (``nvidia-cuda-mps-control`` reading stdin) exits 0 even when it rejects a command and
prints the error on stdout (man page), so every answer is checked: a set command must answer nothing
(memory) or the percentage it set. A command that fails is logged, counted (``observe_limits``) and
retried with backoff; it never changes health: a GPU's slices are Healthy only while its daemon
answers ``get_default_active_thread_percentage``. That probe also compares the default percentage
with what was applied and applies the limits again when someone changed it.

Layout under the configurable root (host side), one directory per GPU so daemons never share pipes::

    <root>/<GPU-uuid>/pipe   CUDA_MPS_PIPE_DIRECTORY of that GPU's daemon (mounted into clients)
    <root>/<GPU-uuid>/log    CUDA_MPS_LOG_DIRECTORY (control.log, server.log)
    <root>/shm               the /dev/shm shared by the daemon's servers and their clients

The daemon is started as ``<control> -d`` with ``CUDA_VISIBLE_DEVICES=<GPU-uuid>`` (so its one GPU is
device 0 in its commands), told ``set_default_active_thread_percentage 100``, then given the wanted
limits before its GPU turns Healthy. A daemon that stops answering is told ``quit`` and started
again, with exponential backoff between failed starts. No lock is held while a command runs: the
event loop's health reads and ``set_limits`` never wait for a daemon. In simulated mode the same
supervisor drives ``mps_standin.py`` (see ``standin_command``).
"""

from __future__ import annotations

import logging
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
    want: MpsLimits | None = None  # the cap the app wants (set_limits)
    applied: MpsLimits | None = None  # the cap this daemon instance took; None after a (re)start
    limits_next: float = 0.0
    limits_backoff: float = 0.0
    limits_error: str = ""


LimitsObserver = Callable[[str, "MpsLimits | None", str], None]
"""Called after every attempt to set a GPU's limits: (GPU uuid, limits now applied or ``None`` when
the attempt failed, the error or "")."""


class MpsSupervisor:
    """Keeps one daemon per ``mps`` GPU running and reports each daemon's liveness as health.

    ``check_once`` is one deterministic pass (tests drive it); ``start`` runs it on a thread every
    ``tick_s``. Rule: a daemon is probed every ``probe_interval_s``; a failed probe marks the GPU
    unhealthy at once and the next pass restarts the daemon (``quit``, then ``-d``); failed starts back off
    exponentially from ``backoff_initial_s`` to ``backoff_max_s``; the first answered probe after a
    start marks the GPU healthy again.

    Limits: ``set_limits`` records the wanted cap per GPU (under a short lock, no I/O) and wakes the
    thread, which sends the commands (``MpsDaemon.apply_limits``) to a daemon that answers; after a
    (re)start they are sent before the GPU is marked healthy. A failed attempt is logged, reported to
    the ``observe_limits`` callback and retried with the same backoff as starts; health does not
    depend on it. ``wait_limits`` lets Allocate wait (in a worker thread) until a daemon's cap covers
    a pod. Only the supervisor thread (or ``check_once``'s caller) talks to daemons, so commands to
    one daemon never interleave.
    """

    def __init__(self, options: MpsOptions, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self._clock = clock
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._states: dict[str, _State] = {}
        self._emit: Callable[[HealthEvent], None] = lambda _event: None
        self._observe: LimitsObserver = lambda _uuid, _applied, _error: None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def set_gpus(self, gpu_uuids: Iterable[str]) -> None:
        """Supervise exactly these GPUs: new ones are started on the next pass, dropped ones quit."""
        wanted = set(gpu_uuids)
        with self._lock:
            gone = [self._states.pop(uuid) for uuid in sorted(set(self._states) - wanted)]
            for uuid in sorted(wanted - set(self._states)):
                self._states[uuid] = _State(MpsDaemon(uuid, self.options), backoff=self.options.backoff_initial_s,
                                            limits_backoff=self.options.backoff_initial_s)
            self._changed.notify_all()
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

    def observe_limits(self, observer: LimitsObserver) -> None:
        """Where the outcome of every attempt to set limits goes (metrics); called from the thread."""
        self._observe = observer

    def set_limits(self, wanted: Mapping[str, MpsLimits]) -> None:
        """The per-client cap each GPU's daemon should enforce; GPUs not supervised are ignored.

        No I/O and only a short lock: safe on the event loop. A changed cap is tried at once."""
        changed = False
        with self._lock:
            for uuid, limits in wanted.items():
                st = self._states.get(uuid)
                if st is None or st.want == limits:
                    continue
                st.want = limits
                st.limits_next = 0.0
                st.limits_backoff = self.options.backoff_initial_s
                changed = True
        if changed:
            self._wake.set()

    def applied(self, gpu_uuid: str) -> MpsLimits | None:
        """The cap the GPU's daemon took last (``None``: none yet since its start, or not supervised)."""
        with self._lock:
            st = self._states.get(gpu_uuid)
            return None if st is None else st.applied

    def covers(self, gpu_uuid: str, slices: int) -> bool:
        """Whether the GPU's daemon answers and caps clients at a share of at least ``slices``."""
        with self._lock:
            st = self._states.get(gpu_uuid)
            return st is not None and st.up is True and st.applied is not None and st.applied.slices >= slices

    def wait_limits(self, gpu_uuid: str, slices: int, timeout_s: float) -> str | None:
        """Block until ``covers(gpu_uuid, slices)``; ``None`` then, else why not (daemon down, not
        supervised, or not applied within ``timeout_s``, with the last error). Waits on a condition:
        no lock is held while the supervisor thread runs commands. Call it from a worker thread."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                st = self._states.get(gpu_uuid)
                if st is None:
                    return f"GPU {gpu_uuid} has no supervised MPS daemon"
                if st.up is not True:
                    return f"GPU {gpu_uuid}: MPS daemon not answering ({st.reason})"
                if st.applied is not None and st.applied.slices >= slices:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    why = f": {st.limits_error}" if st.limits_error else ""
                    return (f"GPU {gpu_uuid}: the MPS daemon did not take the per-client limits of a "
                            f"{slices}-slice share within {timeout_s:g}s{why}")
                self._changed.wait(left)

    def _apply_limits(self, uuid: str, st: _State, now: float) -> None:
        """Send the wanted cap if the daemon does not have it yet (supervisor thread only)."""
        with self._lock:
            want = st.want
            if want is None or want == st.applied or now < st.limits_next:
                return
        try:
            st.daemon.apply_limits(want)
        except MpsError as exc:
            with self._lock:
                st.limits_error = str(exc)
                st.limits_next = now + st.limits_backoff
                st.limits_backoff = min(st.limits_backoff * 2, self.options.backoff_max_s)
                self._changed.notify_all()
            log.warning("GPU %s: the MPS daemon did not take the limits of a %d-slice share (retry in %.1fs): %s",
                        uuid, want.slices, st.limits_next - now, exc)
            self._observe(uuid, None, str(exc))
            return
        with self._lock:
            st.applied = want
            st.limits_error = ""
            st.limits_next = 0.0
            st.limits_backoff = self.options.backoff_initial_s
            self._changed.notify_all()
        log.info("GPU %s: MPS daemon caps each client at %d%% of threads and %d MiB pinned memory "
                 "(a %d-slice share)", uuid, want.active_thread_percentage, want.pinned_mem_mib, want.slices)
        self._observe(uuid, want, "")

    def check_once(self) -> list[HealthEvent]:
        """One supervision pass over every GPU; returns (and emits) the health changes it saw."""
        events: list[HealthEvent] = []
        with self._lock:
            states = list(self._states.items())
        for uuid, st in states:
            now = self._clock()
            if st.up:
                if now - st.last_probe >= self.options.probe_interval_s:
                    st.last_probe = now
                    why = st.daemon.probe()
                    if why is not None:
                        st.daemon.stop()
                        st.next_attempt = now  # restarted on the next pass
                        st.backoff = self.options.backoff_initial_s
                        self._set(st, uuid, False, f"MPS daemon stopped answering: {why}", events)
                        continue
                    self._check_default(uuid, st)
                self._apply_limits(uuid, st, now)
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
                with self._lock:  # a new daemon instance: it has none of our limits yet
                    st.applied = None
                    st.limits_next = 0.0
                self._apply_limits(uuid, st, st.last_probe)  # before the GPU turns healthy
                self._set(st, uuid, True, "MPS daemon answering", events)
            else:
                st.next_attempt = st.last_probe + st.backoff
                st.backoff = min(st.backoff * 2, self.options.backoff_max_s)
                self._set(st, uuid, False, f"MPS daemon not answering after start: {why}", events)
        for event in events:
            self._emit(event)
        return events

    def _check_default(self, uuid: str, st: _State) -> None:
        """The probe read the default percentage: if it is not what we applied, apply again."""
        with self._lock:
            applied = st.applied
            if applied is None or st.daemon.last_percentage is None:
                return
            if abs(st.daemon.last_percentage - applied.active_thread_percentage) < 0.05:
                return
            st.applied = None
            st.limits_next = 0.0
        log.warning("GPU %s: the MPS daemon's default active thread percentage is %g, not the %d applied; "
                    "applying the limits again", uuid, st.daemon.last_percentage, applied.active_thread_percentage)

    def _set(self, st: _State, uuid: str, up: bool, reason: str, events: list[HealthEvent]) -> None:
        changed = st.up is not up
        with self._lock:
            st.up, st.reason = up, reason
            if not up:
                st.applied = None
            self._changed.notify_all()
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
            self._wake.clear()  # a set_limits during the pass wakes the next wait at once
            try:
                self.check_once()
            except Exception:  # the supervisor must outlive any one surprise
                log.exception("MPS supervision pass failed")
            self._wake.wait(self.options.tick_s)

    def close(self) -> None:
        """Stop supervising and ``quit`` every daemon."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.options.start_timeout_s + self.options.probe_timeout_s * 3)
            self._thread = None
        self.set_gpus(())
