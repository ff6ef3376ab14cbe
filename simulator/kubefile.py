"""Reading a cluster for ``gpu-slice simulate`` from a Kubernetes ``v1 List`` (YAML or JSON).

The same files ``gpu-slice fake-cluster`` writes and ``kubectl get nodes,pods -o yaml`` prints.
Nodes keep their GPU layout (inventory annotation) and allocatable CPU/memory; the replay starts
from empty GPUs and places the listed pods in creation order, so a dump of a real cluster can be
re-packed under every policy. Pods that ask for no slices still count for CPU and memory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpuslice.config import Config
from gpuslice.errors import GpuSliceError
from gpuslice.kubelist import parse_list_text
from gpuslice.model import NodeInventory
from gpuslice.nodes import project_node
from gpuslice.packing.build import state_from_inventories
from gpuslice.packing.state import ClusterState, NodeSpec, PackRequest
from gpuslice.pods import PodInfo, project
from gpuslice.rules import DEFAULT_MEMORY_TOLERANCE
from simulator.inflate import inflate_items


class KubeFileError(GpuSliceError):
    """A v1 List that cannot be replayed; the message names the file and the object."""

    def __init__(self, path: str | os.PathLike[str], message: str) -> None:
        super().__init__(f"{path}: {message}")


@dataclass(frozen=True, slots=True)
class KubeCluster:
    """Nodes (spec + empty inventory), the cluster-wide S, and the pods to replay in order."""

    nodes: tuple[tuple[NodeSpec, NodeInventory], ...]
    slices_per_gpu: int
    requests: tuple[PackRequest, ...]
    memory_tolerance: float = DEFAULT_MEMORY_TOLERANCE
    #: Objects left out of the replay and why (``file: item N: pod ns/name: reason``): a live snapshot
    #: holds pods that no scheduler could place as written, and one bad pod must not stop the replay.
    skipped: tuple[str, ...] = ()

    def state(self) -> ClusterState:
        return state_from_inventories(self.nodes, slices_per_gpu=self.slices_per_gpu,
                                      memory_tolerance=self.memory_tolerance)

    @property
    def gpus(self) -> int:
        return sum(len(inv.gpus) for _, inv in self.nodes)


def looks_like_kube_list(path: str | os.PathLike[str]) -> bool:
    """YAML/JSON files are v1 Lists; everything else is read as an openb CSV."""
    return Path(path).suffix.lower() in (".yaml", ".yml", ".json")


def load_kube_cluster(paths: Sequence[str | os.PathLike[str]], *, config: Config | None = None) -> KubeCluster:
    """Nodes and pods from one or more v1 List files (nodes and pods may be in the same file).

    Nodes and pods are read by the core's projections (:mod:`gpuslice.nodes`, :mod:`gpuslice.pods`),
    the same code the extender runs on watch events; ``config`` supplies prices, the isolation
    default and the owner-spread rule. A node or pod that cannot be read or placed as written is
    left out and reported in ``skipped`` (what the extender would refuse), and the rest is replayed."""
    nodes: list[tuple[NodeSpec, NodeInventory]] = []
    pods: list[tuple[str, PodInfo, str]] = []
    skipped: list[str] = []
    seen: set[str] = set()
    isolation = config.isolation_default if config is not None else "any"
    for path in paths:
        try:
            items = parse_list_text(Path(path).read_bytes().decode("utf-8"))
        except OSError as err:
            raise KubeFileError(path, f"cannot read: {err.strerror}") from None
        except UnicodeDecodeError as err:
            raise KubeFileError(path, f"not UTF-8 text (byte {err.start})") from None
        except GpuSliceError as err:
            raise KubeFileError(path, str(err)) from None
        for n, item in enumerate(items):
            try:
                if item.get("kind") == "Node":
                    info = project_node(item, config=config)
                    if info.name in seen:
                        continue
                    if info.error:
                        raise GpuSliceError(info.error)
                    if info.inventory is None:
                        continue  # not a slice node: nothing to place there
                    seen.add(info.name)
                    nodes.append((info.spec, info.inventory.with_used(())))
                elif item.get("kind") == "Pod":
                    pod = project(item, isolation_default=isolation) if _has_uid(item) else project(
                        _with_uid(item, f"pod-{len(pods)}"), isolation_default=isolation)
                    if pod.error:
                        raise GpuSliceError(pod.error)
                    pods.append((pod.created, pod, str(path)))
            except GpuSliceError as err:
                skipped.append(f"{path}: item {n}: {err}")
    if not nodes:
        raise KubeFileError(paths[0], "no Node with an example.com/gpu-slice.inventory annotation")
    sizes = {g.slices for _, inv in nodes for g in inv.gpus if g.mode != "mig"}
    if len(sizes) > 1:
        raise KubeFileError(paths[0], f"GPUs advertise different S ({sorted(sizes)}); S is cluster-wide")
    s = sizes.pop() if sizes else 7
    spread = config.owner_spread if config is not None else True
    requests: list[PackRequest] = []
    for _, pod, path in sorted(pods, key=lambda t: t[0]):
        try:
            requests.append(pod.pack(s, owner_spread=spread))
        except GpuSliceError as err:
            skipped.append(f"{path}: pod {pod.label}: {err}")
    return KubeCluster(tuple(nodes), s, tuple(requests),
                       config.memory_tolerance if config is not None else DEFAULT_MEMORY_TOLERANCE, tuple(skipped))


def _has_uid(item: Mapping[str, Any]) -> bool:
    meta = item.get("metadata")
    return isinstance(meta, Mapping) and isinstance(meta.get("uid"), str) and bool(meta.get("uid"))


def _with_uid(item: Mapping[str, Any], uid: str) -> Mapping[str, Any]:
    """A listed pod without a UID (hand-written files) gets a stand-in one, so it can be replayed."""
    meta = item.get("metadata")
    meta = dict(meta) if isinstance(meta, Mapping) else {}
    meta["uid"] = uid
    return {**item, "metadata": meta}


def inflate_requests(requests: Sequence[PackRequest], capacity_slices: int, seed: int,
                     ratio: float = 1.3) -> list[PackRequest]:
    """The FGD artifact's inflation (``simulator.inflate``) over packing requests, in listed order."""
    return inflate_items(requests, capacity_slices, seed, ratio, share=lambda r: r.slices,
                         total=lambda r: r.total_slices, retag=lambda r, n: replace(r, uid=f"{r.uid}-tuned-{n}"))
