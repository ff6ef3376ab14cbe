"""The CDI specs on the node: which device names the container runtime can resolve.

Allocate hands out ``<vendor>/<class>=<GPU or MIG uuid>``. A spec of the right kind is not enough:
one written with ``--device-name-strategy=index`` only, or before MIG instances were re-created,
lacks the uuids, and a pod given such a name fails to start (the runtime cannot resolve it) after
kubelet admitted it. So every advertised GPU or MIG instance is checked against the names the specs
define; one that is missing is advertised Unhealthy, with the reason, until the spec has it.

The specs are YAML or JSON (``cdiVersion``, ``kind``, ``devices[].name``); every readable spec of the
kind counts (the runtime merges the directories too). Unreadable files are skipped and named.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from deviceplugin.errors import SettingsError
from gpuslice.model import Gpu

SPEC_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True, slots=True)
class CdiSpecs:
    """The specs of one kind found in the spec directories, and the device names they define."""

    kind: str
    paths: tuple[Path, ...] = ()
    names: frozenset[str] = frozenset()
    unreadable: tuple[str, ...] = field(default=())


def read_specs(vendor: str, class_: str, dirs: Iterable[Path]) -> CdiSpecs:
    """Every spec file of kind ``<vendor>/<class>`` in ``dirs`` and the union of its device names."""
    kind = f"{vendor}/{class_}"
    paths: list[Path] = []
    names: set[str] = set()
    unreadable: list[str] = []
    for directory in dirs:
        try:
            entries = sorted(directory.iterdir())
        except OSError:
            continue
        for path in entries:
            if path.suffix not in SPEC_SUFFIXES:
                continue
            try:
                doc = yaml.safe_load(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
                unreadable.append(f"{path}: {exc.__class__.__name__}")
                continue
            if not isinstance(doc, dict) or doc.get("kind") != kind:
                continue
            paths.append(path)
            for dev in doc.get("devices") or []:
                if isinstance(dev, dict) and isinstance(dev.get("name"), str):
                    names.add(dev["name"])
    return CdiSpecs(kind, tuple(paths), frozenset(names), tuple(unreadable))


def find_cdi_spec(vendor: str, class_: str, dirs: Iterable[Path]) -> Path | None:
    """The first CDI spec file in ``dirs`` whose ``kind`` is ``<vendor>/<class>``, or ``None``."""
    specs = read_specs(vendor, class_, dirs)
    return specs.paths[0] if specs.paths else None


def check_cdi_spec(vendor: str, class_: str, dirs: Iterable[Path]) -> Path:
    """The spec that defines our CDI names; ``SettingsError`` with what to do when none does."""
    dirs = list(dirs)
    found = find_cdi_spec(vendor, class_, dirs)
    if found is None:
        raise SettingsError(
            "cdi_vendor", f"no CDI spec of kind {vendor}/{class_} in {', '.join(str(d) for d in dirs)}: "
            f"the container runtime could not resolve the names this plugin hands out "
            f"({vendor}/{class_}=<GPU or MIG uuid>). Generate one with the NVIDIA Container Toolkit "
            f"(v1.18+ writes /var/run/cdi/nvidia.yaml itself; else `nvidia-ctk cdi generate "
            f"--device-name-strategy=uuid --output=/etc/cdi/nvidia.yaml`), mount that directory into the "
            f"plugin, or choose --device-injection volume-mounts")
    return found


def owners(gpus: Iterable[Gpu]) -> list[str]:
    """The uuids Allocate names: each MIG instance of a ``mig`` GPU, the GPU itself otherwise."""
    out: list[str] = []
    for gpu in gpus:
        out.extend(i.uuid for i in gpu.instances) if gpu.mode == "mig" else out.append(gpu.uuid)
    return out


def missing(gpus: Iterable[Gpu], specs: CdiSpecs) -> dict[str, str]:
    """Owner uuid -> why it is Unhealthy, for every advertised owner the specs do not name."""
    where = ", ".join(str(p) for p in specs.paths) or "no spec of that kind"
    out: dict[str, str] = {}
    for uuid in owners(gpus):
        if uuid not in specs.names:
            out[uuid] = (f"CDI device {specs.kind}={uuid} is not defined by the node's CDI spec ({where}): a pod "
                         f"given it could not start. Regenerate the spec with uuid names (NVIDIA Container "
                         f"Toolkit: nvidia-ctk cdi generate --device-name-strategy=uuid, after any MIG change)")
    return out
