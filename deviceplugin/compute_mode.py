"""The compute modes gpu-slice changed, kept on the host so they are restored after any restart.

An ``mps`` GPU runs in EXCLUSIVE_PROCESS (only the MPS server holds a context on it). Remembered
only in memory, a plugin restarted while a GPU was ``mps`` would not know that EXCLUSIVE_PROCESS was
its own doing, and a later ``mps -> whole`` change or an uninstall would leave the GPU exclusive.
So the mode a GPU had before gpu-slice set EXCLUSIVE_PROCESS is written to
``<mps-root>/compute-modes.json`` (host ``/run``: gone after a reboot, as the modes are) and read
back by every later plugin (:class:`deviceplugin.nvml_backend.NvmlBackend`) and by
``gpu-slice mps-daemon`` when it drains at an uninstall (:func:`restore_recorded`).

Writes replace the file atomically; a file that cannot be read counts as empty (and says so).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RECORD_NAME = "compute-modes.json"


def record_path(root: str | os.PathLike[str]) -> Path:
    return Path(root) / RECORD_NAME


def load(root: str | os.PathLike[str] | None) -> dict[str, int]:
    """GPU uuid -> the NVML compute mode it had before gpu-slice set EXCLUSIVE_PROCESS."""
    if root is None:
        return {}
    path = record_path(root)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("the compute-mode record %s is unreadable (%s); treating it as empty", path, exc)
        return {}
    gpus = doc.get("gpus") if isinstance(doc, dict) else None
    if not isinstance(gpus, dict):
        return {}
    return {str(u): int(v) for u, v in gpus.items() if isinstance(v, int) and not isinstance(v, bool)}


def save(root: str | os.PathLike[str] | None, record: Mapping[str, int]) -> None:
    """Replace the record (a missing root directory is created)."""
    if root is None:
        return
    path = record_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RECORD_NAME}.tmp")
    tmp.write_text(json.dumps({"v": 1, "gpus": dict(sorted(record.items()))}, sort_keys=True))
    os.replace(tmp, path)


def restore_recorded(root: str | os.PathLike[str], gpus: Iterable[str], nvml_module: Any = None) -> list[str]:
    """Set each of ``gpus`` that the record names back to its recorded mode, through NVML; one line
    per GPU on what was done. Entries restored are removed from the record."""
    record = load(root)
    todo = [u for u in gpus if u in record]
    if not todo:
        return []
    nvml = nvml_module
    if nvml is None:
        import pynvml

        nvml = pynvml
    lines: list[str] = []
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return [f"compute modes not restored ({', '.join(todo)}): NVML could not be initialised: {exc}"]
    try:
        for uuid in todo:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
                nvml.nvmlDeviceSetComputeMode(handle, record[uuid])
            except nvml.NVMLError as exc:
                lines.append(f"GPU {uuid}: compute mode not restored to {record[uuid]}: {exc}")
                continue
            lines.append(f"GPU {uuid}: compute mode restored to {record[uuid]} (gpu-slice had set EXCLUSIVE_PROCESS)")
            del record[uuid]
        save(root, record)
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:
            log.info("NVML shutdown failed: %s", exc)
    return lines
