"""The per-pod budget watch on MPS GPUs: NVML's process lists mapped to pods through cgroups.

The MPS daemon caps each *client process*, not each pod: a pod that runs N CUDA processes gets N
caps, and a process that reaches the GPU without MPS (a pod that points ``CUDA_MPS_PIPE_DIRECTORY``
elsewhere, through ``envFrom`` the admission policy cannot read) is under no cap at all and, under
EXCLUSIVE_PROCESS, can take the GPU from the MPS server and lock its neighbours out. So every
``budget_s`` the plugin reads, for each MPS GPU, the running compute processes and MPS clients
(``Backend.gpu_processes``, host PIDs), maps each PID to its pod UID through ``/proc/<pid>/cgroup``
(cgroupfs ``.../pod<uid>/...`` and systemd ``...-pod<uid_with_underscores>.slice/...`` both), and
finds:

* ``over-share``: a pod whose MPS clients on the GPU use more memory together than its share
  (``gpuslice.rules.mps_share_mib`` for the slices it holds there: the rule the packer counts);
* ``outside-mps``: a compute process on an MPS GPU that is neither the MPS server
  (``nvidia-cuda-mps-server``) nor an MPS client;
* ``no-slices``: an MPS client whose pod holds no slice of that GPU.

Each finding is logged, counted in ``gpu_slice_budget_violations`` and recorded as an event on the
pod once; with ``--evict-over-budget`` the pod is evicted (the Eviction API, so PodDisruptionBudgets
hold). A process of no pod is reported and never acted on.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from deviceplugin.backend import GpuProcess
from gpuslice import ids
from gpuslice.errors import DeviceIdError
from gpuslice.model import Gpu
from gpuslice.rules import mps_share_mib

Kind = Literal["over-share", "outside-mps", "no-slices"]
KINDS: tuple[Kind, ...] = ("over-share", "outside-mps", "no-slices")
MPS_SERVER_COMM = "nvidia-cuda-mps-server"

_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


@dataclass(frozen=True, slots=True)
class Holder:
    """A live pod holding slices on this node: who it is and its slice ids."""

    uid: str
    namespace: str
    name: str
    slice_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Finding:
    """One violation on one GPU; ``pod`` is ``None`` for a process of no pod."""

    kind: Kind
    gpu_uuid: str
    pod: Holder | None
    pod_uid: str | None
    pids: tuple[int, ...]
    message: str

    @property
    def key(self) -> tuple[str, str, str]:
        """Reported once per (kind, GPU, pod or process)."""
        who = self.pod_uid or ",".join(map(str, self.pids))
        return (self.kind, self.gpu_uuid, who)


def pod_uid_of(pid: int, proc_root: Path = Path("/proc")) -> str | None:
    """The pod UID in the process's cgroup path, or ``None`` (a host process, or one that exited)."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    found = _POD_UID.findall(text)
    return found[-1].replace("_", "-") if found else None


def command_of(pid: int, proc_root: Path = Path("/proc")) -> str:
    try:
        return (proc_root / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


def _slices_on(holder: Holder, gpu_uuid: str) -> int:
    n = 0
    for sid in holder.slice_ids:
        try:
            if ids.owner_of(sid) == gpu_uuid:
                n += 1
        except DeviceIdError:
            continue
    return n


def check_gpu(gpu: Gpu, processes: Iterable[GpuProcess], holders: Mapping[str, Holder],
              proc_root: Path = Path("/proc")) -> list[Finding]:
    """The findings on one ``mps`` GPU (``holders``: pod UID -> its holding, for this node)."""
    clients: dict[str | None, list[GpuProcess]] = {}
    out: list[Finding] = []
    for proc in processes:
        uid = pod_uid_of(proc.pid, proc_root)
        if proc.mps_client:
            clients.setdefault(uid, []).append(proc)
            continue
        if command_of(proc.pid, proc_root) == MPS_SERVER_COMM:
            continue
        holder = holders.get(uid) if uid else None
        who = f"pod {holder.namespace}/{holder.name}" if holder else (f"pod UID {uid}" if uid else "a host process")
        out.append(Finding("outside-mps", gpu.uuid, holder, uid, (proc.pid,),
                           f"process {proc.pid} of {who} uses MPS GPU {gpu.uuid} without MPS "
                           f"({proc.used_mib if proc.used_mib is not None else '?'} MiB): no cap holds it, and "
                           f"under EXCLUSIVE_PROCESS it can lock the GPU's MPS clients out"))
    for uid, procs in sorted(clients.items(), key=lambda kv: kv[0] or ""):
        pids = tuple(sorted(p.pid for p in procs))
        holder = holders.get(uid) if uid else None
        k = _slices_on(holder, gpu.uuid) if holder else 0
        if holder is None or k == 0:
            who = f"pod {holder.namespace}/{holder.name}" if holder else (f"pod UID {uid}" if uid else "a host process")
            out.append(Finding("no-slices", gpu.uuid, holder, uid, pids,
                               f"MPS client(s) {', '.join(map(str, pids))} of {who} run on GPU {gpu.uuid}, "
                               f"where it holds no slice"))
            continue
        used = sum(p.used_mib or 0 for p in procs)
        share = mps_share_mib(gpu.memory_mib, k, gpu.slices)
        if used > share:
            out.append(Finding("over-share", gpu.uuid, holder, uid, pids,
                               f"pod {holder.namespace}/{holder.name} uses {used} MiB on GPU {gpu.uuid} in "
                               f"{len(procs)} MPS client process(es) ({', '.join(map(str, pids))}); its {k}-slice "
                               f"share is {share} MiB (the MPS daemon caps each client process, not each pod)"))
    return out
