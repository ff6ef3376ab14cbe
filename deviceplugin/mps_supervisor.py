"""One MPS control daemon per ``mps`` GPU: adopted (or, where this process owns them, started), probed
for health, given per-client limits, and never told ``quit`` while it has clients.

Two roles use this class (:mod:`deviceplugin.mps` says why the daemons are not the plugin's):

* **the plugin** (``owns_daemons=False``, ``marks_wanted=True``): for each MPS GPU it writes the
  marker that asks for a daemon, adopts the daemon that answers on that GPU's pipe, sets its
  limits before the GPU turns healthy and keeps them, and reports the GPU unhealthy while its
  daemon does not answer. A GPU that leaves ``mps`` loses its marker; the daemon is left to its
  owner. The plugin never starts and never quits a daemon, so a plugin stopped, rolled or crashed
  leaves every daemon (and every MPS workload) running, and the next plugin adopts them.
* **the owner** (``owns_daemons=True``): ``gpu-slice mps-daemon`` in the ``gpu-slice-mps``
  DaemonSet, or the plugin itself with ``--mps-daemons plugin`` (a node without that DaemonSet: a
  laptop, the simulated quick start). It also starts a daemon where none answers (with the cap the
  marker names, before any client can reach it), and retires the daemon of a GPU that is no longer
  wanted once no client is connected.

Rule: a daemon is probed every ``probe_interval_s``; a failed probe marks the GPU unhealthy at once
and is never answered with ``quit`` (a daemon that stopped answering may still serve clients). The
owner then tries ``-d`` again (a daemon that still runs refuses it, one that died is replaced);
failed attempts back off exponentially from ``backoff_initial_s`` to ``backoff_max_s``. The first
answered probe marks the GPU healthy again.

Limits: ``set_limits`` records the wanted cap per GPU (under a short lock, no I/O) and wakes the
thread, which sends the commands (``MpsDaemon.apply_limits``) to a daemon that answers; after an
adoption or a (re)start they are sent before the GPU is marked healthy. A failed attempt is
logged, reported to the ``observe_limits`` callback and retried with the same backoff; health does
not depend on it. ``wait_limits`` lets Allocate wait (in a worker thread) until a daemon's cap
covers a pod. Only the supervisor thread (or ``check_once``'s caller) talks to daemons, so commands
to one daemon never interleave.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from deviceplugin.backend import HealthEvent
from deviceplugin.errors import MpsError
from deviceplugin.mps import MpsDaemon, MpsLimits, MpsOptions, remove_wanted, write_wanted

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _State:
    daemon: MpsDaemon
    up: bool | None = None
    reason: str = "MPS daemon not seen yet"
    next_attempt: float = 0.0
    backoff: float = 0.0
    last_probe: float = 0.0
    want: MpsLimits | None = None  # the cap the app wants (set_limits)
    start_limits: MpsLimits | None = None  # the owner's cap for a daemon it starts (the marker's)
    applied: MpsLimits | None = None  # the cap this daemon instance took; None after an adoption/start
    limits_next: float = 0.0
    limits_backoff: float = 0.0
    limits_error: str = ""
    marked: MpsLimits | None = None  # what the marker file says now (marks_wanted only)
    ever_up: bool = False  # answered at least once in this process


LimitsObserver = Callable[[str, "MpsLimits | None", str], None]
"""Called after every attempt to set a GPU's limits: (GPU uuid, limits now applied or ``None`` when
the attempt failed, the error or "")."""


class MpsSupervisor:
    """Keeps track of one daemon per ``mps`` GPU and reports each daemon's liveness as health.

    ``check_once`` is one deterministic pass (tests drive it); ``start`` runs it on a thread every
    ``tick_s``. See the module docstring for the two roles and the rules.
    """

    def __init__(self, options: MpsOptions, *, owns_daemons: bool = True, marks_wanted: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self.owns_daemons = owns_daemons
        self.marks_wanted = marks_wanted
        self._clock = clock
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._states: dict[str, _State] = {}
        self._retiring: dict[str, tuple[MpsDaemon, str]] = {}  # owner only: GPU -> (daemon, last reason)
        self._emit: Callable[[HealthEvent], None] = lambda _event: None
        self._observe: LimitsObserver = lambda _uuid, _applied, _error: None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.adopted: dict[str, int] = {}  # GPU -> times a running daemon was taken over
        self.started: dict[str, int] = {}  # GPU -> daemons this process started

    # ---- what to supervise

    def set_gpus(self, gpu_uuids: Iterable[str], start_limits: Mapping[str, MpsLimits | None] | None = None) -> None:
        """Supervise exactly these GPUs. New ones are probed (and, by an owner, started) on the next pass;
        dropped ones lose their marker (``marks_wanted``) and, by an owner, are quit once idle.

        ``start_limits`` (owner): the cap each GPU's daemon applies right after this process starts it."""
        wanted = set(gpu_uuids)
        with self._lock:
            gone = {uuid: self._states.pop(uuid) for uuid in sorted(set(self._states) - wanted)}
            for uuid in sorted(wanted - set(self._states)):
                self._states[uuid] = _State(MpsDaemon(uuid, self.options), backoff=self.options.backoff_initial_s,
                                            limits_backoff=self.options.backoff_initial_s)
                self._retiring.pop(uuid, None)
            for uuid, limits in (start_limits or {}).items():
                if uuid in self._states:
                    self._states[uuid].start_limits = limits
            if self.owns_daemons:
                for uuid, st in gone.items():
                    self._retiring[uuid] = (st.daemon, "")
            self._changed.notify_all()
        # File writes outside the lock that status()/is_up() (the RPC path) take.
        if self.marks_wanted:
            for uuid in gone:
                remove_wanted(self.options.root, uuid)
            for uuid in sorted(wanted):
                mine = self._states.get(uuid)
                if mine is not None and not (self.options.root / uuid / "wanted").exists():
                    self._mark(uuid, mine)
        if gone or wanted:
            self._wake.set()

    def _mark(self, uuid: str, st: _State) -> None:
        limits = st.applied or st.want
        try:
            write_wanted(self.options.root, uuid, limits)
            st.marked = limits
        except OSError as exc:
            log.error("GPU %s: cannot write the MPS marker under %s: %s", uuid, self.options.root, exc)

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

    def ever_up(self) -> dict[str, bool]:
        """GPU UUID -> whether its daemon has answered at least once in this process."""
        with self._lock:
            return {uuid: st.ever_up for uuid, st in self._states.items()}

    def retiring(self) -> dict[str, str]:
        """Owner: GPUs no longer wanted whose daemon still runs, with why it was not quit yet."""
        with self._lock:
            return {uuid: why for uuid, (_d, why) in self._retiring.items()}

    # ---- limits

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
        """The cap the GPU's daemon took last (``None``: none yet since its adoption, or not supervised)."""
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
        if self.marks_wanted and st.marked != want:
            self._mark(uuid, st)  # a daemon its owner restarts starts with this cap
        self._observe(uuid, want, "")

    # ---- one pass

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
                        # Never quit: a daemon that stopped answering may still serve clients.
                        st.next_attempt = now if self.owns_daemons else now + self.options.backoff_initial_s
                        st.backoff = self.options.backoff_initial_s
                        self._set(st, uuid, False, f"MPS daemon stopped answering: {why}", events)
                        continue
                    self._check_default(uuid, st)
                self._apply_limits(uuid, st, now)
                continue
            if now < st.next_attempt:
                continue
            self._bring_up(uuid, st, events)
        if self.owns_daemons:
            self._retire_idle()
        for event in events:
            self._emit(event)
        return events

    def _bring_up(self, uuid: str, st: _State, events: list[HealthEvent]) -> None:
        """Adopt the daemon that answers on this GPU's pipe; the owner starts one where none does."""
        why = st.daemon.probe()
        adopted = why is None
        if why is not None and self.owns_daemons:
            try:
                st.daemon.start()
                why = st.daemon.probe()
            except MpsError as exc:
                why = st.daemon.probe()  # a daemon that answers now (started meanwhile) is adopted
                adopted = why is None
                if why is not None:
                    why = str(exc)
            if why is None and not adopted:
                self.started[uuid] = self.started.get(uuid, 0) + 1
                limits = st.start_limits
                if limits is not None:  # before any client can reach it
                    try:
                        st.daemon.apply_limits(limits)
                    except MpsError as exc:
                        log.warning("GPU %s: the new MPS daemon did not take its start cap: %s", uuid, exc)
        st.last_probe = self._clock()
        if why is None:
            if adopted:
                self.adopted[uuid] = self.adopted.get(uuid, 0) + 1
                log.info("GPU %s: adopted the running MPS control daemon", uuid)
            st.backoff = self.options.backoff_initial_s
            with self._lock:  # a daemon instance new to us: it has none of our limits yet
                st.applied = None
                st.limits_next = 0.0
            self._apply_limits(uuid, st, st.last_probe)  # before the GPU turns healthy
            self._set(st, uuid, True, "MPS daemon answering", events)
            return
        st.next_attempt = st.last_probe + st.backoff
        st.backoff = min(st.backoff * 2, self.options.backoff_max_s)
        where = "after start" if self.owns_daemons else \
            "(its daemon is run by the gpu-slice-mps DaemonSet on this node)"
        self._set(st, uuid, False, f"MPS daemon not answering {where}: {why}", events)

    def _retire_idle(self) -> None:
        """Owner: quit the daemons of GPUs no longer wanted, each once no client is connected."""
        with self._lock:
            retiring = list(self._retiring.items())
        for uuid, (daemon, last) in retiring:
            done, why = daemon.quit_if_idle()
            with self._lock:
                if uuid not in self._retiring:
                    continue
                if done or why.startswith("not answering"):
                    del self._retiring[uuid]
                else:
                    self._retiring[uuid] = (daemon, why)
            if done:
                log.info("GPU %s left MPS mode: its idle MPS daemon was told quit", uuid)
            elif why != last and not why.startswith("not answering"):
                log.warning("GPU %s left MPS mode but its MPS daemon is kept: %s; it is quit once they exit",
                            uuid, why)

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
            st.ever_up = st.ever_up or up
            if not up:
                st.applied = None
            self._changed.notify_all()
        if changed:
            log.log(logging.INFO if up else logging.WARNING, "GPU %s: %s", uuid, reason)
            events.append(HealthEvent(uuid, up, reason))

    # ---- thread and end

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

    def stop_thread(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.options.start_timeout_s + self.options.probe_timeout_s * 3)
            self._thread = None

    def drain(self, timeout_s: float = 0.0, poll_s: float = 0.5) -> dict[str, str]:
        """Owner, at its end: quit every daemon as soon as it has no client, waiting up to ``timeout_s``
        for busy ones. Returns the GPUs whose daemon still runs, with why (they end with the process's
        container, if it has one). Not for the plugin: its daemons outlive it."""
        with self._lock:
            for uuid, st in self._states.items():
                self._retiring.setdefault(uuid, (st.daemon, ""))
            self._states.clear()
        deadline = time.monotonic() + timeout_s
        while True:
            self._retire_idle()
            left = self.retiring()
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        """Stop supervising. An owner quits its idle daemons (busy ones are left running); the plugin
        quits nothing: its daemons outlive it."""
        self.stop_thread()
        if self.owns_daemons:
            busy = self.drain(0.0)
            for uuid, why in sorted(busy.items()):
                log.warning("GPU %s: MPS daemon left running at exit: %s", uuid, why)
        else:
            with self._lock:
                self._states.clear()
