"""``gpu-slice extender``: flags, validated start-up, and the running service.

Everything is checked before the server listens: the config file (a bad field stops start-up
naming it), the cluster source (``--kubeconfig``, ``--cluster`` or the in-cluster service
account), the lease name, TLS files. Then the informer syncs the cluster state in the background
and ``/readyz`` turns green once it has (and again after a change of leader, once a fresh list has
caught up).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

from extender.errors import ExtenderError
from gpuslice.config import Config, default_config, load_config_text
from gpuslice.errors import GpuSliceError

log = logging.getLogger("gpu_slice.extender")

DEFAULT_LEASE = "kube-system/gpu-slice-scheduler"
DEFAULT_PORT = 8888
API_POOL_SIZE = 64


class SettingsError(ExtenderError):
    """A flag or file that stops start-up; the message names it."""


@dataclass(frozen=True, slots=True)
class Settings:
    config: Config
    kubeconfig: str | None
    cluster: Path | None
    address: str
    port: int
    lease_namespace: str
    lease_name: str
    fencing: bool
    identity: str
    prometheus_url: str | None
    signal_interval_s: float
    signal_max_age_s: float
    tls_cert: str | None
    tls_key: str | None
    max_body_bytes: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--kubeconfig", help="kubeconfig file (default: the in-cluster service account)")
    src.add_argument("--cluster", help="a static v1 List of nodes and pods (gpu-slice fake-cluster output or "
                                       "kubectl get nodes,pods -o yaml) for dry runs; binds are recorded in memory")
    parser.add_argument("--config", help="versioned config file (YAML): policies, narrowing, reservations, prices")
    parser.add_argument("--address", default="127.0.0.1", help="listen address (default 127.0.0.1: a sidecar of "
                                                              "the scheduler)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"listen port (default {DEFAULT_PORT})")
    parser.add_argument("--lease", default=DEFAULT_LEASE,
                        help="NAMESPACE/NAME of the Lease the scheduler elects its leader on "
                             f"(default {DEFAULT_LEASE})")
    parser.add_argument("--no-fencing", action="store_true",
                        help="bind without checking the Lease (one scheduler replica without leader election)")
    parser.add_argument("--identity", default=None,
                        help="this scheduler's leader identity prefix (default: $POD_NAME, else the host name)")
    parser.add_argument("--prometheus-url", default=None,
                        help="Prometheus base URL for DCGM utilization and OpenCost prices (default: none, "
                             "packing and price tables only)")
    parser.add_argument("--signal-interval", type=float, default=15.0, help="seconds between Prometheus queries")
    parser.add_argument("--signal-max-age", type=float, default=120.0,
                        help="samples older than this many seconds are ignored (stale data is neutral)")
    parser.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM); needs --tls-key")
    parser.add_argument("--tls-key", help="private key (PEM) for --tls-cert")
    parser.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024,
                        help="largest request body accepted (default 16 MiB)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")


def build_settings(args: argparse.Namespace) -> Settings:
    """Validate every flag and file once; ``SettingsError``/``ConfigError`` name what is wrong."""
    config = default_config()
    if args.config:
        try:
            text = Path(args.config).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise SettingsError(f"--config {args.config}: cannot read: {err}") from None
        config = load_config_text(text)
    if not 0 < args.port < 65536:
        raise SettingsError(f"--port must be 1..65535, got {args.port}")
    ns, sep, name = args.lease.partition("/")
    if not sep or not ns or not name or "/" in name:
        raise SettingsError(f"--lease must be NAMESPACE/NAME, got {args.lease!r}")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SettingsError("--tls-cert and --tls-key go together")
    for flag in ("tls_cert", "tls_key", "kubeconfig", "cluster"):
        value = getattr(args, flag)
        if value and not Path(value).is_file():
            raise SettingsError(f"--{flag.replace('_', '-')} {value}: no such file")
    if not args.signal_interval > 0 or not args.signal_max_age > 0:
        raise SettingsError("--signal-interval and --signal-max-age must be > 0")
    if args.max_body_bytes < 1024:
        raise SettingsError("--max-body-bytes must be at least 1024")
    if args.prometheus_url and not args.prometheus_url.startswith(("http://", "https://")):
        raise SettingsError(f"--prometheus-url must start with http:// or https://, got {args.prometheus_url!r}")
    identity = args.identity or os.environ.get("POD_NAME") or socket.gethostname()
    fencing = not args.no_fencing and not args.cluster
    return Settings(config, args.kubeconfig, Path(args.cluster) if args.cluster else None, args.address, args.port,
                    ns, name, fencing, identity, args.prometheus_url, args.signal_interval, args.signal_max_age,
                    args.tls_cert, args.tls_key, args.max_body_bytes)


def _api_client(kubeconfig: str | None) -> Any:
    from kubernetes import client, config

    try:
        # /bind runs on up to 40 worker threads: a pool of 10 connections would open (and TLS-handshake)
        # a new one for most binds under load.
        conf = client.Configuration()
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=conf)  # type: ignore[no-untyped-call]
        else:
            config.load_incluster_config(client_configuration=conf)  # type: ignore[no-untyped-call]
        conf.connection_pool_maxsize = API_POOL_SIZE
        return client.ApiClient(conf)
    except config.ConfigException as err:
        where = kubeconfig or "the in-cluster service account"
        raise SettingsError(f"cannot use {where}: {err} (give --kubeconfig or --cluster)") from None


class Service:
    """The running pieces, started and stopped together (tests drive this without uvicorn)."""

    def __init__(self, settings: Settings) -> None:
        from extender.binder import ApiBinder, MemoryBinder
        from extender.informer import Informer
        from extender.lease import Fence
        from extender.metrics import ExtenderMetrics
        from extender.service import Extender
        from gpuslice.kubelist import iter_list_items

        self.settings = settings
        self.metrics = ExtenderMetrics()
        self.informer: Informer | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        lease = f"{settings.lease_namespace}/{settings.lease_name}"
        if settings.cluster is not None:
            binder = MemoryBinder()
            self.ext = Extender(settings.config, binder, fence=Fence.disabled(), metrics=self.metrics,
                                lease_name=lease)

            def listed(stream: IO[str]) -> Iterator[Mapping[str, Any]]:
                # One item at a time from the file: projected as it is read, never held as a list.
                for item in iter_list_items(stream):
                    if item.get("kind") == "Pod":
                        binder.add(item)
                    yield item
            try:
                with settings.cluster.open(encoding="utf-8") as stream:
                    self.ext.load(listed(stream))
            except (OSError, UnicodeDecodeError, GpuSliceError) as err:
                raise SettingsError(f"--cluster {settings.cluster}: {err}") from None
            self.fence = self.ext.fence
        else:
            api = _api_client(settings.kubeconfig)
            self.fence = Fence(api, settings.identity, namespace=settings.lease_namespace,
                               name=settings.lease_name, enabled=settings.fencing,
                               on_error=self.metrics.lease_error) if settings.fencing else Fence.disabled()
            self.ext = Extender(settings.config, ApiBinder(api), fence=self.fence, metrics=self.metrics,
                                lease_name=lease)
            from extender.miglayouts import api_writer

            self.ext.layouts.write = api_writer(api)
            self.informer = Informer(api, self.ext, on_relist_metric=self.metrics.relisted,
                                     on_error_metric=self.metrics.watch_error, transform=self.ext.transform)
        self._generation = self.fence.generation
        self._ticket: int | None = None
        self.signals: Any = None
        if settings.prometheus_url:
            from extender.signals import SignalRefresher, SignalSettings

            self.signals = SignalRefresher(
                SignalSettings(url=settings.prometheus_url, interval_s=settings.signal_interval_s,
                               max_age_s=settings.signal_max_age_s),
                config=settings.config, on_query_error=self.metrics.prometheus_error)

    def ready(self) -> tuple[bool, str]:
        """Not ready after a change of leader until a fresh list has caught up (DESIGN 4)."""
        if self.fence.generation != self._generation and self.informer is not None:
            self._generation = self.fence.generation
            self._ticket = self.informer.request_relist()
        if self._ticket is not None and self.informer is not None:
            if not self.informer.relisted(self._ticket):
                return False, "leadership changed; catching up with a fresh list"
            self._ticket = None
        self.metrics.set_leader(self.fence.holds())
        return True, ""

    def start(self) -> None:
        if self.informer is not None:
            self.informer.start()
        if self.fence.enabled:
            self.fence.start()
        if self.signals is not None:
            t = threading.Thread(target=self._signal_loop, name="signals", daemon=True)
            t.start()
            self._threads.append(t)
        if self.ext.layouts.active:
            t = threading.Thread(target=self.ext.layouts.run, args=(self._stop,), name="mig-layouts", daemon=True)
            t.start()
            self._threads.append(t)

    def _signal_loop(self) -> None:
        assert self.signals is not None
        while not self._stop.is_set():
            self.signals.refresh()
            snap = self.signals.snapshot()
            self.ext.apply_signals(snap)
            self.metrics.observe_signals(snap.newest_age)
            self._stop.wait(self.settings.signal_interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self.informer is not None:
            self.informer.stop()
        if self.fence.enabled:
            self.fence.stop()
        for t in self._threads:
            t.join(timeout=5)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = build_settings(args)
        service = Service(settings)
    except GpuSliceError as err:
        print(f"gpu-slice extender: {err}", file=sys.stderr)
        return 2
    import uvicorn

    from extender.app import build_app

    app = build_app(service.ext, max_body=settings.max_body_bytes, ready=service.ready)
    server = uvicorn.Server(uvicorn.Config(app, host=settings.address, port=settings.port, log_level="warning",
                                           ssl_certfile=settings.tls_cert, ssl_keyfile=settings.tls_key,
                                           access_log=False))
    service.start()
    log.info("gpu-slice extender on %s://%s:%d (lease %s/%s, fencing %s)", "https" if settings.tls_cert else "http",
             settings.address, settings.port, settings.lease_namespace, settings.lease_name,
             "on" if settings.fencing else "off")
    # uvicorn drains on SIGTERM, then raises it again for the handler found at start: make that one
    # leave through the finally below (stopping the service, exit 0) instead of killing the process.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None
    try:
        server.run()
    finally:
        service.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0
