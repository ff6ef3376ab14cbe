"""Readers for the Alibaba openb CSV format (node list; 11- or 5-column pod lists).

Malformed input raises :class:`TraceError` naming the file, line and column.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuslice.errors import GpuSliceError
from gpuslice.packing.state import KIND_MPS, ClusterState, NodeSpec, PackRequest, UnitSpec

NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
POD_COLUMNS_FULL = (*POD_COLUMNS, "gpu_spec", "qos", "pod_phase", "creation_time", "deletion_time",
                    "scheduled_time")
MILLI = 1000


class TraceError(GpuSliceError):
    """A trace file that cannot be read; the message names file, line and column."""

    def __init__(self, path: str | os.PathLike[str], line: int, column: str, message: str) -> None:
        self.path, self.line, self.column = str(path), line, column
        where = f"{path}, line {line}" + (f", column {column!r}" if column else "")
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True, slots=True)
class OpenbNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True, slots=True)
class OpenbPod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: frozenset[str] | None = None

    @property
    def total_milli(self) -> int:
        """The pod's GPU request in milli-GPU (what 'arrived workload' adds up)."""
        return self.num_gpu * self.gpu_milli


def _text(path: Path) -> str:
    """The file as UTF-8 text (a byte-order mark is dropped); undecodable or binary content is a
    ``TraceError`` naming the line, not a ``UnicodeDecodeError`` traceback."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TraceError(path, 0, "", f"cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise TraceError(path, line, "", f"not UTF-8 text (byte 0x{data[e.start]:02x}); a CSV must be "
                         "UTF-8, and a compressed file must be uncompressed first") from None
    nul = text.find("\0")
    if nul >= 0:
        raise TraceError(path, text.count("\n", 0, nul) + 1, "", "contains a NUL byte: a binary file, not a CSV")
    return text


def _rows(path: Path, required: Sequence[str]) -> list[tuple[int, dict[str, str]]]:
    reader = csv.reader(io.StringIO(_text(path), newline=""))
    try:
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise TraceError(path, 1, "", "empty file (no header)") from None
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(path, 1, missing[0], f"header lacks column(s) {', '.join(missing)}; "
                             f"expected {', '.join(required)}")
        out = []
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise TraceError(path, line, "", f"{len(row)} fields, header has {len(header)}")
            out.append((line, dict(zip(header, (c.strip() for c in row), strict=True))))
        return out
    except csv.Error as e:
        raise TraceError(path, reader.line_num, "", f"not a valid CSV: {e}") from None


def _int(path: Path, line: int, row: dict[str, str], col: str, *, minimum: int = 0) -> int:
    text = row[col]
    try:
        value = int(text)
    except ValueError:
        try:
            f = float(text)
        except ValueError:
            raise TraceError(path, line, col, f"not a number: {text!r}") from None
        if not f.is_integer():
            raise TraceError(path, line, col, f"not a whole number: {text!r}") from None
        value = int(f)
    if value < minimum:
        raise TraceError(path, line, col, f"must be >= {minimum}, got {value}")
    return value


def read_nodes(path: str | os.PathLike[str]) -> list[OpenbNode]:
    p = Path(path)
    nodes: list[OpenbNode] = []
    seen: set[str] = set()
    for line, row in _rows(p, NODE_COLUMNS):
        name = row["sn"]
        if not name:
            raise TraceError(p, line, "sn", "empty node name")
        if name in seen:
            raise TraceError(p, line, "sn", f"duplicate node name {name!r}")
        seen.add(name)
        gpus = _int(p, line, row, "gpu")
        model = row["model"]
        if gpus and not model:
            raise TraceError(p, line, "model", "a node with GPUs needs a GPU model")
        nodes.append(OpenbNode(name, _int(p, line, row, "cpu_milli"), _int(p, line, row, "memory_mib"),
                               gpus, model))
    if not nodes:
        raise TraceError(p, 1, "", "no nodes")
    return nodes


def read_pods(path: str | os.PathLike[str]) -> list[OpenbPod]:
    p = Path(path)
    pods: list[OpenbPod] = []
    for line, row in _rows(p, POD_COLUMNS):
        num = _int(p, line, row, "num_gpu")
        milli = _int(p, line, row, "gpu_milli")
        if milli > MILLI:
            raise TraceError(p, line, "gpu_milli", f"must be <= {MILLI}, got {milli}")
        if num > 1 and milli != MILLI:
            raise TraceError(p, line, "gpu_milli", f"a {num}-GPU pod must take whole GPUs (1000), got {milli}")
        if (num == 0) != (milli == 0):
            raise TraceError(p, line, "gpu_milli" if num else "num_gpu",
                             f"num_gpu={num} with gpu_milli={milli}: both or neither must be zero")
        spec_text = row.get("gpu_spec", "")
        spec = frozenset(s.strip() for s in spec_text.split("|") if s.strip()) or None
        pods.append(OpenbPod(row["name"], _int(p, line, row, "cpu_milli"), _int(p, line, row, "memory_mib"),
                             num, milli, spec))
    if not pods:
        raise TraceError(p, 1, "", "no pods")
    return pods


def build_state(nodes: Sequence[OpenbNode], slices: int = MILLI) -> ClusterState:
    """GPUs become MPS units of ``slices`` slices; multi-GPU pods may take fully free MPS units."""
    specs = [NodeSpec(n.name, n.cpu_milli, n.memory_mib, n.model) for n in nodes]
    units = [UnitSpec(i, g, KIND_MPS, slices) for i, n in enumerate(nodes) for g in range(n.gpus)]
    return ClusterState(specs, units, slices_per_gpu=slices, allow_mps_multi=True)


def pod_slices(pod: OpenbPod, slices: int) -> int:
    """Per-GPU slices of a pod at granularity ``slices``: rounded up, so a pod never gets less."""
    if pod.gpu_milli >= MILLI:
        return slices
    return max(1, -(-pod.gpu_milli * slices // MILLI))


def to_request(pod: OpenbPod, slices: int = MILLI, uid: str = "") -> PackRequest:
    if pod.num_gpu == 0:
        return PackRequest(cpu_milli=pod.cpu_milli, memory_mib=pod.memory_mib, uid=uid or pod.name)
    return PackRequest(cpu_milli=pod.cpu_milli, memory_mib=pod.memory_mib, gpus=pod.num_gpu,
                       slices=pod_slices(pod, slices), products=pod.gpu_spec, uid=uid or pod.name)
