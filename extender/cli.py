"""``gpu-slice extender``: flags, validated start-up, and the running service.

Everything is checked before the servers listen: the config file (a bad field stops start-up
naming it), the cluster source (``--kubeconfig``, ``--cluster`` or the in-cluster service
account), the lease name, TLS files, and where the verbs listen: on loopback (the scheduler pod's
own kube-scheduler is the only caller), or elsewhere only with TLS and client-certificate
verification (``--tls-client-ca``). Probes and metrics have a port of their own (``--ops-port``).
Then the informer syncs the cluster state in the background and the verbs and ``/readyz`` turn
ready once it has, and again after a change of leader once a fresh list has caught up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
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
DEFAULT_OPS_PORT = 8889
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
    ops_address: str = "0.0.0.0"
    ops_port: int = DEFAULT_OPS_PORT
    tls_client_ca: str | None = None
    slice_map: str = "off"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--kubeconfig", help="kubeconfig file (default: the in-cluster service account)")
    src.add_argument("--cluster", help="a static v1 List of nodes and pods (gpu-slice fake-cluster output or "
                                       "kubectl get nodes,pods -o yaml) for dry runs; binds are recorded in memory")
    parser.add_argument("--config", help="versioned config file (YAML): policies, narrowing, reservations, prices")
    parser.add_argument("--address", default="127.0.0.1",
                        help="where the verbs (/filter, /prioritize, /bind, /preempt) listen (default 127.0.0.1: "
                             "a sidecar of the scheduler); any other address needs --tls-client-ca")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"the verbs' port (default {DEFAULT_PORT})")
    parser.add_argument("--ops-address", default="0.0.0.0",
                        help="where /healthz, /readyz and /metrics listen (default 0.0.0.0: kubelet's probes and "
                             "Prometheus reach the pod IP)")
    parser.add_argument("--ops-port", type=int, default=DEFAULT_OPS_PORT,
                        help=f"port of /healthz, /readyz and /metrics (default {DEFAULT_OPS_PORT})")
    parser.add_argument("--tls-client-ca", help="serve the verbs only to clients with a certificate signed by this CA "
                                                "(PEM; kube-scheduler's tlsConfig certFile/keyFile); needs --tls-cert")
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
    parser.add_argument("--slice-map", default="off", choices=("off", "token", "loopback"),
                        help="serve the read-only web slice map at /slicemap: token (a bearer token the API server "
                             "reviews; RBAC get on /slicemap/*), loopback (kubectl port-forward only) or off "
                             "(default)")
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
    if not 0 < args.ops_port < 65536:
        raise SettingsError(f"--ops-port must be 1..65535, got {args.ops_port}")
    if args.ops_port == args.port and (args.ops_address == args.address or "0.0.0.0" in (args.ops_address,
                                                                                          args.address)):
        raise SettingsError(f"--ops-port {args.ops_port} is the verbs' --port: probes and metrics need a port "
                            "of their own")
    if args.tls_client_ca and not args.tls_cert:
        raise SettingsError("--tls-client-ca needs --tls-cert and --tls-key (client certificates are checked "
                            "in the TLS handshake)")
    if not args.tls_client_ca and not _loopback(args.address):
        raise SettingsError(f"--address {args.address} would let anyone who reaches it steer placement and binds; "
                            "listen on 127.0.0.1 beside kube-scheduler, or give --tls-client-ca (with --tls-cert and "
                            "--tls-key) so only kube-scheduler's client certificate is served")
    ns, sep, name = args.lease.partition("/")
    if not sep or not ns or not name or "/" in name:
        raise SettingsError(f"--lease must be NAMESPACE/NAME, got {args.lease!r}")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SettingsError("--tls-cert and --tls-key go together")
    for flag in ("tls_cert", "tls_key", "tls_client_ca", "kubeconfig", "cluster"):
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
    slice_map = getattr(args, "slice_map", "off")
    if slice_map == "token" and args.cluster:
        raise SettingsError("--slice-map token reviews tokens with the API server; with --cluster use "
                            "--slice-map loopback")
    return Settings(config, args.kubeconfig, Path(args.cluster) if args.cluster else None, args.address, args.port,
                    ns, name, fencing, identity, args.prometheus_url, args.signal_interval, args.signal_max_age,
                    args.tls_cert, args.tls_key, args.max_body_bytes, args.ops_address, args.ops_port,
                    args.tls_client_ca, slice_map)


def _loopback(address: str) -> bool:
    """Whether ``address`` is a loopback address (or ``localhost``)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


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
        from extender.events import api_event_writer
        from extender.informer import Informer
        from extender.lease import Fence
        from extender.metrics import ExtenderMetrics
        from extender.preemptor import ShapePreemptor
        from extender.service import Extender
        from gpuslice.kubelist import iter_list_items

        self.settings = settings
        self.metrics = ExtenderMetrics()
        self.informer: Informer | None = None
        self.api: Any = None  # the API client (None for a --cluster dry run)
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
            api = self.api = _api_client(settings.kubeconfig)
            self.fence = Fence(api, settings.identity, namespace=settings.lease_namespace,
                               name=settings.lease_name, enabled=settings.fencing,
                               on_change=self._leader_changed,
                               on_error=self.metrics.lease_error) if settings.fencing else Fence.disabled()
            self.ext = Extender(settings.config, ApiBinder(api), fence=self.fence, metrics=self.metrics,
                                lease_name=lease)
            self.informer = Informer(api, self.ext, on_relist_metric=self.metrics.relisted,
                                     on_error_metric=self.metrics.watch_error, transform=self.ext.transform,
                                     budgets=True)
            self.ext.expect.add("PodDisruptionBudget")
            self.ext.events = api_event_writer(api, instance=settings.identity, on_result=self.metrics.bind_event)
            api_binder = self.ext.binder
            assert isinstance(api_binder, ApiBinder)
            self.ext.shape = ShapePreemptor(self.ext, api_binder.evict, on_outcome=self.metrics.own_preemption)
        self._ticket_lock = threading.Lock()
        self._ticket: int | None = None
        self.ext.gate = self._catching_up
        self.signals: Any = None
        if settings.prometheus_url:
            from extender.signals import SignalRefresher, SignalSettings

            self.signals = SignalRefresher(
                SignalSettings(url=settings.prometheus_url, interval_s=settings.signal_interval_s,
                               max_age_s=settings.signal_max_age_s),
                config=settings.config, on_query_error=self.metrics.prometheus_error)

    def _leader_changed(self, old: Any, new: Any) -> None:
        """The fence saw another leader: list afresh, and the verbs wait until that list is in
        (DESIGN 4: a new leader must not decide from a cache that missed what the old one did). Runs
        on whichever thread read the Lease (the fence's poller, or a /bind)."""
        if self.informer is None or old is None or not getattr(old, "holder", None):
            return  # the first leader (no Lease, or none held it, before): nobody else decided before it
        with self._ticket_lock:
            self._ticket = self.informer.request_relist()
        log.info("leadership changed; the verbs wait for a fresh list of nodes and pods")

    def _catching_up(self) -> str:
        """The extender's readiness gate: "" once the list requested at the last change of leader is in."""
        with self._ticket_lock:
            ticket = self._ticket
        if ticket is None or self.informer is None:
            return ""
        if not self.informer.relisted(ticket):
            return "leadership changed; catching up with a fresh list"
        with self._ticket_lock:
            if self._ticket == ticket:
                self._ticket = None
        return ""

    def ready(self) -> tuple[bool, str]:
        """Readiness beyond the extender's own (kept for /readyz; the verbs check the same gate)."""
        why = self._catching_up()
        return not why, why

    def start(self) -> None:
        if self.informer is not None:
            self.informer.start()
        if self.fence.enabled:
            self.fence.start()
        if self.ext.events is not None:
            self.ext.events.start()
        if self.ext.shape is not None:
            self.ext.shape.start()
        if self.signals is not None:
            t = threading.Thread(target=self._signal_loop, name="signals", daemon=True)
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
        if self.ext.shape is not None:
            self.ext.shape.stop()
        if self.ext.events is not None:
            self.ext.events.stop()
        for t in self._threads:
            t.join(timeout=5)


class _SharedSignals:
    """One SIGTERM/SIGINT handler for both uvicorn servers: each drains and stops (uvicorn's own
    handler, installed per server, would leave the other running)."""

    def __init__(self, servers: list[Any]) -> None:
        self.servers = servers
        self.received = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        for server in self.servers:
            if server.should_exit and signum == signal.SIGINT:
                server.force_exit = True
            server.should_exit = True


def _servers(service: Service, settings: Settings, ops_routes: Any = ()) -> list[Any]:
    """The verbs' server and the ops server, each a uvicorn.Server that leaves signals to the caller."""
    import ssl

    import uvicorn

    from extender.app import build_ops_app, build_verbs_app

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # run() installs one handler for both
            yield

    verbs = uvicorn.Config(build_verbs_app(service.ext, max_body=settings.max_body_bytes), host=settings.address,
                           port=settings.port, log_level="warning", access_log=False,
                           ssl_certfile=settings.tls_cert, ssl_keyfile=settings.tls_key,
                           ssl_ca_certs=settings.tls_client_ca,
                           ssl_cert_reqs=ssl.CERT_REQUIRED if settings.tls_client_ca else ssl.CERT_NONE)
    ops = uvicorn.Config(build_ops_app(service.ext, ready=service.ready, routes=ops_routes),
                         host=settings.ops_address, port=settings.ops_port, log_level="warning", access_log=False)
    return [Server(verbs), Server(ops)]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every Prometheus query at INFO: failures are the signal refresher's to report, rate-limited.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        settings = build_settings(args)
        service = Service(settings)
    except GpuSliceError as err:
        print(f"gpu-slice extender: {err}", file=sys.stderr)
        return 2
    ops_routes: list[Any] = []
    if settings.slice_map != "off":
        from extender.authgate import AuthGate
        from extender.slicemap import routes

        ops_routes = routes(service.ext, AuthGate(settings.slice_map, service.api))
    servers = _servers(service, settings, ops_routes)
    service.start()
    scheme = "https" if settings.tls_cert else "http"
    log.info("gpu-slice extender: verbs on %s://%s:%d%s, probes and metrics on http://%s:%d (lease %s/%s, "
             "fencing %s)", scheme, settings.address, settings.port,
             " (client certificates required)" if settings.tls_client_ca else "", settings.ops_address,
             settings.ops_port, settings.lease_namespace, settings.lease_name, "on" if settings.fencing else "off")
    main = threading.current_thread() is threading.main_thread()
    handler = _SharedSignals(servers)
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}

    async def serve() -> None:
        tasks = [asyncio.create_task(s.serve()) for s in servers]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for s in servers:  # one ended (a signal, or it could not bind its port): end the other too
            s.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in done:
            t.result()

    try:
        asyncio.run(serve())
    finally:
        service.stop()
        for sig, old in previous.items():
            signal.signal(sig, old)
    started = all(s.started for s in servers)
    return 0 if started or handler.received else 1
