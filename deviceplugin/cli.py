"""``gpu-slice device-plugin``: flags, settings, logging, signals.

Flags default to ``None`` so ``settings.build`` can tell a given flag from a default and let flags
override the config file. SIGTERM and SIGINT start an orderly shutdown (the DaemonSet's rolling
update waits for it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Any

from deviceplugin.errors import DevicePluginError, SettingsError
from deviceplugin.settings import BACKENDS, INJECTIONS, MPS_DAEMONS, build
from gpuslice.errors import GpuSliceError

log = logging.getLogger("deviceplugin")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The device plugin's flags (every default lives in ``Settings``)."""
    parser.add_argument("--config", help="versioned config file (YAML): slices per GPU, modes, MPS limits")
    parser.add_argument("--backend", choices=BACKENDS, help="GPU backend (default nvml)")
    parser.add_argument("--topology", help="simulated backend: topology YAML (default: built-in two-H100 node)")
    parser.add_argument("--plugin-dir", dest="plugin_dir",
                        help="kubelet device plugin directory (default /var/lib/kubelet/device-plugins/)")
    parser.add_argument("--endpoint", help="socket file name in the plugin directory (default gpu-slice.sock)")
    parser.add_argument("--pod-resources-socket", dest="pod_resources_socket",
                        help="kubelet PodResources socket (default /var/lib/kubelet/pod-resources/kubelet.sock)")
    parser.add_argument("--node-name", dest="node_name", help="this node's name (default: $NODE_NAME)")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account)")
    parser.add_argument("--no-kube", dest="use_kube", action="store_const", const=False, default=None,
                        help="run without the Kubernetes API: no assignments honoured, no stamps or inventory")
    parser.add_argument("--device-injection", dest="device_injection", choices=INJECTIONS,
                        help="how devices reach containers: CDI names (default), NVIDIA volume mounts, or "
                             "env only (NVIDIA_VISIBLE_DEVICES; pods can override it)")
    parser.add_argument("--cdi-vendor", dest="cdi_vendor",
                        help="CDI vendor of the names handed out, <vendor>/gpu=<GPU or MIG uuid> (default "
                             "nvidia.com: the NVIDIA Container Toolkit's specs); with the nvml backend a spec of "
                             "that kind must exist in a --cdi-spec-dir at start-up")
    parser.add_argument("--cdi-spec-dir", dest="cdi_spec_dirs", action="append",
                        help="where CDI specs are looked for at start-up (repeatable; default /etc/cdi and "
                             "/var/run/cdi)")
    parser.add_argument("--taint-on-conflict", dest="conflict_taint", action="store_const", const=True,
                        default=None,
                        help="taint the node example.com/gpu-slice-conflict:NoSchedule while another resource "
                             "advertises a GPU whose slices pods hold (it stays advertised; an event and a "
                             "metric say so either way)")
    parser.add_argument("--preferred-wait-seconds", dest="preferred_wait_s", type=float,
                        help="how long GetPreferredAllocation waits for the pod cache when no assignment of the "
                             "asked size matches, before a best fit (default 5; 0 = never; a pod of another "
                             "scheduler pays it once per container at admission)")
    parser.add_argument("--preferred-wait-empty-seconds", dest="preferred_wait_empty_s", type=float,
                        help="how long it waits in all when no valid best fit is left either (default 30): an "
                             "empty answer lets kubelet pick ids itself, which on a MIG GPU fail admission")
    parser.add_argument("--metrics-port", dest="metrics_port", type=int,
                        help="port for /metrics (0 = off; default 9402)")
    parser.add_argument("--metrics-address", dest="metrics_address", help="address for /metrics (default 0.0.0.0)")
    parser.add_argument("--mps-root", dest="mps_root",
                        help="host directory of the MPS daemons' pipes, markers and shm, shared with the "
                             "gpu-slice-mps DaemonSet (default /run/gpu-slice/mps). Each mps GPU's daemon caps "
                             "every client at the share of the largest pod on that GPU (set before Allocate "
                             "answers; 1 slice when idle): exact when the GPU's pods are one size; with mixed "
                             "sizes a smaller pod's clients may use up to that largest share (README)")
    parser.add_argument("--mps-daemons", dest="mps_daemons", choices=MPS_DAEMONS,
                        help="who runs the MPS control daemons: 'external', the gpu-slice-mps DaemonSet "
                             "(gpu-slice mps-daemon; the plugin adopts them and they outlive it; default with "
                             "--backend nvml), or 'plugin', this process (default with --backend simulated: a "
                             "node without that DaemonSet; its daemons end with its container)")
    parser.add_argument("--cdi-validate", dest="cdi_validate", action=argparse.BooleanOptionalAction, default=None,
                        help="check every advertised GPU and MIG instance against the CDI spec's device names; "
                             "one the spec lacks is advertised Unhealthy, with the reason (default: on with "
                             "--backend nvml and CDI injection)")
    parser.add_argument("--budget-seconds", dest="budget_s", type=float,
                        help="how often the budget watch reads each MPS GPU's processes (default 10)")
    parser.add_argument("--evict-over-budget", dest="budget_evict", action="store_const", const=True, default=None,
                        help="evict (Eviction API) a pod whose MPS clients use more than its share, or that runs a "
                             "process outside MPS on an MPS GPU; without it such pods are reported only (event, "
                             "metric, log). Needs the RBAC of manifests/components/budget-eviction")
    parser.add_argument("--proc-root", dest="proc_root",
                        help="where host processes are read (PID -> pod through cgroups; default /proc: the "
                             "DaemonSet runs in the host's PID namespace)")
    parser.add_argument("--read-only", dest="read_only", action="store_const", const=True, default=None,
                        help="nvml backend: never change modes or MIG layouts, only report")
    parser.add_argument("--log-level", dest="log_level", default="INFO", help="logging level (default INFO)")


def settings_from(args: argparse.Namespace) -> Any:
    """Validated settings from parsed flags; ``SettingsError`` names the bad field."""
    flags = {k: v for k, v in vars(args).items() if k not in ("log_level", "func", "command")}
    return build(flags)


async def _main(settings: Any) -> None:
    from deviceplugin.app import DevicePluginApp

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await DevicePluginApp(settings).run(stop)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def run(args: argparse.Namespace) -> int:
    """Run the plugin until SIGTERM; exit 2 for bad settings, 1 for a start-up failure."""
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from(args)
    except SettingsError as exc:
        log.error("invalid setting %s", exc)
        return 2
    try:
        asyncio.run(_main(settings))
    except (DevicePluginError, GpuSliceError) as exc:
        log.error("device plugin failed: %s", exc)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m deviceplugin.cli``); ``gpu-slice device-plugin`` calls ``run``."""
    parser = argparse.ArgumentParser(prog="gpu-slice device-plugin", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
