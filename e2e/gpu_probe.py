"""Probe a machine with a real NVIDIA GPU through the NVML backend, read-only, and prove it changed nothing.

    python e2e/gpu_probe.py [--default-mode mps|whole] [--slices 7] [--health-seconds 3] [--out probe.json]
                            [--cdi-spec-dir DIR ...] [--cdi-vendor nvidia.com]

Prints (as JSON) the GPUs discovered, each GPU's MIG mode and instances, the device ids and the
kubelet ``Device`` list the plugin would advertise (with the plugin's CDI check: a GPU or MIG
instance the node's CDI spec does not name is advertised Unhealthy), the CDI specs found and every
device name they hold, what ``apply_targets`` would have changed, the row-remapping and
retired-page state (a GPU needing a reset), each GPU's compute processes and MPS clients (what the
budget watch reads), and the health events seen while watching XIDs for a few seconds. Every
pynvml call goes through a guard that refuses setters (mode, compute mode, MIG instance
create/destroy, resets, ...) before they reach NVML, and the MIG mode, compute mode and MIG device
list are compared before and after. Exit status 0 only when nothing changed and no setter was
attempted.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pynvml

from deviceplugin import cdi
from deviceplugin.backend import GpuTarget, HealthEvent
from deviceplugin.errors import DevicePluginError
from deviceplugin.nvml_backend import NvmlBackend

_SETTER = re.compile(r"^nvml(Device|GpuInstance|ComputeInstance|Unit|System|Vgpu\w*|Gpm\w*)?"
                     r"(Set|Create|Destroy|Reset|Clear|Enable|Disable|Modify|Remove|Discover)"
                     r"|^nvml\w*(?<!Event)Set(?!Create|Wait|Free|Get)[A-Z]")


class SetterRefused(RuntimeError):
    """A setter was about to reach NVML."""


class ReadOnlyNvml:
    """Forwards to pynvml, refusing every state-changing function by name."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.calls: list[str] = []
        self.refused: list[str] = []

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if not callable(value) or not name.startswith("nvml") or isinstance(value, type):
            return value
        if _SETTER.search(name):
            def refuse(*_args: Any, **_kw: Any) -> Any:
                self.refused.append(name)
                raise SetterRefused(f"read-only probe refused {name}")
            return refuse

        def call(*args: Any, **kw: Any) -> Any:
            self.calls.append(name)
            return value(*args, **kw)
        return call


def snapshot(nv: Any) -> list[dict[str, Any]]:
    """MIG mode, compute mode and MIG devices of every GPU, read straight from NVML."""
    out = []
    for index in range(nv.nvmlDeviceGetCount()):
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        entry: dict[str, Any] = {"index": index, "uuid": str(nv.nvmlDeviceGetUUID(handle))}
        try:
            entry["mig_mode"] = list(nv.nvmlDeviceGetMigMode(handle))
        except nv.NVMLError as exc:
            entry["mig_mode"] = f"error: {exc}"
        try:
            entry["compute_mode"] = int(nv.nvmlDeviceGetComputeMode(handle))
        except nv.NVMLError as exc:
            entry["compute_mode"] = f"error: {exc}"
        migs = []
        if isinstance(entry["mig_mode"], list) and entry["mig_mode"][0] == nv.NVML_DEVICE_MIG_ENABLE:
            for i in range(nv.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
                except nv.NVMLError:
                    continue
                migs.append([str(nv.nvmlDeviceGetUUID(mig)), int(nv.nvmlDeviceGetGpuInstanceId(mig))])
        entry["mig_devices"] = migs
        out.append(entry)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--default-mode", choices=("mps", "whole"), default="mps")
    parser.add_argument("--slices", type=int, default=7)
    parser.add_argument("--health-seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cdi-spec-dir", dest="cdi_spec_dirs", action="append", type=Path,
                        help="where CDI specs are read (repeatable; default /etc/cdi and /var/run/cdi)")
    parser.add_argument("--cdi-vendor", default="nvidia.com")
    args = parser.parse_args()
    spec_dirs = args.cdi_spec_dirs or [Path("/etc/cdi"), Path("/var/run/cdi")]

    guard = ReadOnlyNvml(pynvml)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        print(f"PROBE FAILED: NVML not usable here: {exc}", file=sys.stderr)
        return 2
    before = snapshot(pynvml)
    backend = NvmlBackend(guard, default_target=GpuTarget(args.default_mode, args.slices), read_only=True,
                          event_timeout_ms=500)
    events: list[HealthEvent] = []
    report: dict[str, Any] = {}
    try:
        gpus = backend.discover()
        would = backend.apply_targets({}, frozenset())
        gpus = backend.discover()
        specs = cdi.read_specs(args.cdi_vendor, "gpu", spec_dirs)
        missing = cdi.missing(gpus, specs)
        backend.watch_health(events.append)
        time.sleep(args.health_seconds)
        unhealthy = {**missing, **backend.unhealthy()}
        report["cdi"] = {"kind": specs.kind, "specs": [str(p) for p in specs.paths], "names": sorted(specs.names),
                         "unreadable": list(specs.unreadable), "advertised_without_a_name": missing}
        report["reset_needed"] = backend.check_reset_needed()
        processes: dict[str, Any] = {}
        for g in gpus:
            try:
                processes[g.uuid] = [{"pid": p.pid, "used_mib": p.used_mib, "mps_client": p.mps_client}
                                     for p in backend.gpu_processes(g.uuid)]
            except DevicePluginError as exc:
                processes[g.uuid] = f"error: {exc}"
        report["processes"] = processes
        report["driver_version"] = str(pynvml.nvmlSystemGetDriverVersion())
        report["gpus"] = [{
            "uuid": g.uuid, "index": g.index, "product": g.product, "memory_mib": g.memory_mib, "mode": g.mode,
            "slices": g.slices, "healthy": g.healthy,
            "mig_instances": [{"uuid": i.uuid, "profile": i.profile, "start": i.start,
                               "compute_slices": i.compute_slices, "memory_mib": i.memory_mib} for i in g.instances],
        } for g in gpus]
        report["mig_mode"] = {s["uuid"]: s["mig_mode"] for s in before}
        report["device_ids"] = [sid for g in gpus for sid in g.slice_ids()]
        report["devices"] = [
            {"ID": sid, "health": "Unhealthy" if (not g.healthy or owner in unhealthy or g.uuid in unhealthy)
             else "Healthy"}
            for g in gpus for sid in g.slice_ids() for owner in [sid.rsplit("::", 1)[0]]]
        report["unhealthy"] = unhealthy
        report["apply_targets_read_only"] = would
        report["warnings"] = backend.warnings
        report["health_events"] = [e.__repr__() for e in events]
    finally:
        backend.close()
    after = snapshot(pynvml)
    pynvml.nvmlShutdown()
    report["unchanged"] = before == after
    report["setters_refused"] = guard.refused
    report["nvml_calls"] = sorted(set(guard.calls))
    if before != after:
        report["before"], report["after"] = before, after
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    ok = report["unchanged"] and not guard.refused
    print("PROBE OK: read-only, nothing changed" if ok else "PROBE FAILED", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
