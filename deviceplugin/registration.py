"""The plugin socket's lifetime and registration with kubelet, including after kubelet restarts.

A restarting kubelet deletes every socket in the plugin directory and recreates ``kubelet.sock``
(reference/protocols.md 1.5). The registrar polls the directory every ``poll_s`` (inode checks; no
inotify dependency): when our socket is gone it serves a fresh one, and when ``kubelet.sock`` is new
(or registration has not succeeded yet) it registers again. Polling at 200 ms keeps re-registration
well inside the 5 s bar while costing nothing measurable.

The ListAndWatch stream is the registration's real lifetime. In kubelet
(``pkg/kubelet/cm/devicemanager/plugin/v1beta1/handler.go``, ``runClient``) the end of a client's
stream disconnects *whichever client is current* for the resource name (devices marked unhealthy,
the resource dropped after the 5 min grace), and a new Register does not close the old client. So:

* when the last open stream ends (and we are not shutting down), register again: nothing else
  would ever bring the resource back;
* after Register, a stream must open within ``stream_wait_s``; if none does, register again;
* before registering on a re-served socket, wait for the old server's streams to end: an old
  stream ending after the new Register would disconnect the new client.

Sockets are compared by (device, inode): ctime changes on a chmod and says nothing about identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2 as pb
from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from deviceplugin.errors import RegistrationError

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
FileId = tuple[int, int]


def file_id(path: Path) -> FileId | None:
    """(device, inode) of a path, or ``None`` when it does not exist: a recreated file differs."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


class StreamTracker:
    """Counts the ``ListAndWatch`` streams this process serves; the servicer reports, the registrar reads.

    ``opened`` only grows; ``active`` is the number open now. Lives on the event loop.
    """

    def __init__(self) -> None:
        self.opened = 0
        self.active = 0
        self.last_opened_at = 0.0
        self._changed = asyncio.Event()

    def open(self) -> None:
        self.opened += 1
        self.active += 1
        self.last_opened_at = time.monotonic()
        self._wake()

    def close(self) -> None:
        self.active = max(0, self.active - 1)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, timeout: float) -> None:
        """Return on the next open or close, or after ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no stream is open; ``False`` if some still are after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.active > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await self.wait_change(left)
        return True


@dataclass(frozen=True, slots=True)
class RegistrationRecord:
    """One successful Register: when, against which kubelet socket, over which socket of ours."""

    at: float
    kubelet: FileId
    socket: FileId
    count: int


class Registrar:
    """Serves ``DevicePlugin`` on ``<plugin_dir>/<endpoint>`` and keeps it registered with kubelet."""

    def __init__(self, plugin_dir: Path, endpoint: str, resource_name: str,
                 add_servicer: Callable[[grpc.aio.Server], None], *, kubelet_socket: str = "kubelet.sock",
                 poll_s: float = 0.2, register_timeout_s: float = 10.0,
                 on_registered: Callable[[bool], None] | None = None, streams: StreamTracker | None = None,
                 stream_wait_s: float = 3.0, old_stream_wait_s: float = 5.0, missing_warn_s: float = 30.0) -> None:
        self.plugin_dir = plugin_dir
        self.socket_path = plugin_dir / endpoint
        self.kubelet_path = plugin_dir / kubelet_socket
        self.endpoint = endpoint
        self.resource_name = resource_name
        self._add_servicer = add_servicer
        self.poll_s = poll_s
        self.register_timeout_s = register_timeout_s
        self._on_registered = on_registered
        self._server: grpc.aio.Server | None = None
        self._socket_id: FileId | None = None
        self.last: RegistrationRecord | None = None
        self.registrations = 0
        self.serves = 0
        self._changed = asyncio.Event()
        self._retry_at = 0.0
        self._backoff = poll_s
        self._dirty = True
        self.streams = streams
        self.stream_wait_s = stream_wait_s
        self.old_stream_wait_s = old_stream_wait_s
        self._opened_before_register = 0
        self._stream_deadline: float | None = None
        self._stream_seen = False
        self._failed_against: FileId | None = None
        self.missing_warn_s = missing_warn_s
        self._missing_since: float | None = None
        self._missing_warned_at = 0.0
        self.missing_warnings = 0
        self.stream_losses = 0
        self.stream_timeouts = 0

    # ---- serving

    async def serve(self) -> None:
        """(Re)create our socket and serve on it; a stale file is removed first.

        The old server's streams are ended and awaited first (see the module docstring).
        """
        had_server = self._server is not None
        await self._stop_server(grace=0.0)
        if had_server and self.streams is not None and not await self.streams.wait_idle(self.old_stream_wait_s):
            log.warning("%d ListAndWatch stream(s) of the old socket still open after %.1fs; serving anyway",
                        self.streams.active, self.old_stream_wait_s)
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        server = grpc.aio.server()
        self._add_servicer(server)
        try:
            server.add_insecure_port(f"unix://{self.socket_path}")
            await server.start()
        except Exception as exc:
            await server.stop(0)
            raise RegistrationError(f"cannot serve on {self.socket_path}: {exc}") from exc
        self._server = server
        self._socket_id = file_id(self.socket_path)
        self._dirty = True
        self.serves += 1
        log.info("serving the device plugin API on %s", self.socket_path)

    async def _stop_server(self, grace: float) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)

    # ---- registering

    async def register(self) -> RegistrationRecord:
        """One Register call; kubelet dials back and asks our options before it answers."""
        kubelet = file_id(self.kubelet_path)
        if kubelet is None:
            raise RegistrationError(f"kubelet socket {self.kubelet_path} does not exist")
        request = pb.RegisterRequest(
            version=API_VERSION, endpoint=self.endpoint, resource_name=self.resource_name,
            options=pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True))
        if self.streams is not None:
            self._opened_before_register = self.streams.opened
        async with grpc.aio.insecure_channel(f"unix://{self.kubelet_path}",
                                             options=[("grpc.default_authority", "localhost")]) as channel:
            try:
                await pb_grpc.RegistrationStub(channel).Register(request, timeout=self.register_timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise RegistrationError(f"kubelet refused registration: {exc.code().name}: {exc.details()}") from exc
        assert self._socket_id is not None
        self.registrations += 1
        self._dirty = False
        self._stream_seen = False
        self._stream_deadline = time.monotonic() + self.stream_wait_s
        self.last = RegistrationRecord(time.monotonic(), kubelet, self._socket_id, self.registrations)
        log.info("registered %s with kubelet (endpoint %s, registration %d)", self.resource_name, self.endpoint,
                 self.registrations)
        self._changed.set()
        self._changed = asyncio.Event()
        return self.last

    async def wait_registered(self, after: int = 0, timeout: float = 10.0) -> RegistrationRecord:
        """Wait for a registration numbered above ``after`` (tests and the bench)."""
        async with asyncio.timeout(timeout):
            while self.last is None or self.last.count <= after:
                await self._changed.wait()
        return self.last

    def _check_streams(self) -> None:
        """Mark the registration dirty when kubelet's stream ended or never came (module docstring)."""
        streams = self.streams
        if streams is None or self._dirty or self.last is None or self._stream_deadline is None:
            return
        now = time.monotonic()
        if streams.opened > self._opened_before_register:
            self._stream_seen = True
        if self._stream_seen and streams.active > 0 and now - streams.last_opened_at >= 1.0:
            self._backoff = self.poll_s
        if self._stream_seen and streams.active == 0:
            self.stream_losses += 1
            lived = now - streams.last_opened_at
            log.warning("kubelet's ListAndWatch stream ended (after %.1fs); registering again", lived)
            self._dirty = True
            self._stream_deadline = None
            if lived < 1.0:  # a stream that dies at once: do not spin
                self._failed_against = file_id(self.kubelet_path)
                self._retry_at = now + self._backoff
                self._backoff = min(self._backoff * 2, 2.0)
            return
        if not self._stream_seen and now >= self._stream_deadline:
            self.stream_timeouts += 1
            log.warning("no ListAndWatch stream within %.1fs of Register; registering again", self.stream_wait_s)
            self._dirty = True
            self._stream_deadline = None

    def needs_work(self) -> tuple[bool, bool]:
        """(serve again, register again) from what the directory and the streams show now."""
        self._check_streams()
        mine = file_id(self.socket_path)
        reserve = self._server is None or mine is None or mine != self._socket_id
        kubelet = file_id(self.kubelet_path)
        register = kubelet is not None and (
            reserve or self._dirty or self.last is None or self.last.kubelet != kubelet)
        return reserve, register

    def _check_kubelet_socket(self) -> None:
        """Say so, every ``missing_warn_s``, while kubelet's registration socket is absent: a wrong
        ``--plugin-dir`` or a kubelet that is down would otherwise look like a plugin that is waiting."""
        now = time.monotonic()
        if file_id(self.kubelet_path) is not None:
            if self._missing_since is not None and self.missing_warnings:
                log.info("kubelet's socket %s is back after %.0fs", self.kubelet_path, now - self._missing_since)
            self._missing_since = None
            return
        if self._missing_since is None:
            self._missing_since = self._missing_warned_at = now
            return
        if now - self._missing_warned_at >= self.missing_warn_s:
            self._missing_warned_at = now
            self.missing_warnings += 1
            log.warning("kubelet's registration socket %s has been absent for %.0fs: the plugin cannot register "
                        "until it appears. Is kubelet running, and is --plugin-dir kubelet's device-plugins "
                        "directory (/var/lib/kubelet/device-plugins/ by default; check kubelet's --root-dir)?",
                        self.kubelet_path, now - self._missing_since)

    async def step(self) -> None:
        """One poll: re-serve and/or re-register as the directory requires; errors back off."""
        self._check_kubelet_socket()
        reserve, register = self.needs_work()
        if reserve:
            if self._server is not None:
                log.warning("our socket %s was removed (kubelet restart?); serving a new one", self.socket_path)
            await self.serve()
        if not register and not reserve:
            return
        kubelet = file_id(self.kubelet_path)
        if kubelet is None:
            return
        if not reserve and time.monotonic() < self._retry_at and kubelet == self._failed_against:
            return
        try:
            await self.register()
        except RegistrationError as exc:
            self._failed_against = kubelet
            self._retry_at = time.monotonic() + self._backoff
            log.warning("registration failed (%s); retrying in %.1fs", exc, self._backoff)
            self._backoff = min(self._backoff * 2, 2.0)
            if self._on_registered is not None:
                self._on_registered(False)
            return
        if self.streams is None:
            self._backoff = self.poll_s  # with a tracker: reset once a stream has lasted (_check_streams)
        self._retry_at = 0.0
        if self._on_registered is not None:
            self._on_registered(True)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve, register, and watch the directory until ``stop`` is set; then remove our socket."""
        try:
            while not stop.is_set():
                try:
                    await self.step()
                except RegistrationError as exc:
                    log.error("%s", exc)
                await self._wait(stop)
        finally:
            await self.close()

    async def _wait(self, stop: asyncio.Event) -> None:
        """Until the next poll, a stop, or (with a tracker) a stream opening or closing."""
        waits: set[asyncio.Future[Any]] = {asyncio.ensure_future(stop.wait())}
        if self.streams is not None:
            waits.add(asyncio.ensure_future(self.streams.wait_change(self.poll_s)))
        try:
            await asyncio.wait(waits, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def close(self) -> None:
        await self._stop_server(grace=0.5)
        if self._socket_id is not None and file_id(self.socket_path) == self._socket_id:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        self._socket_id = None

    @property
    def server(self) -> Any:
        return self._server
