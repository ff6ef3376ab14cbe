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

from gpuslice import annotations as ann
from gpuslice.errors import GpuSliceError
from gpuslice.kubelist import node_inventory, node_name, parse_list_text
from gpuslice.model import NodeInventory
from gpuslice.packing.build import pack_request, state_from_inventories
from gpuslice.packing.state import ClusterState, NodeSpec, PackRequest
from gpuslice.requests import parse_request
from gpuslice.units import MIB, parse_quantity
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

    def state(self) -> ClusterState:
        return state_from_inventories(self.nodes, slices_per_gpu=self.slices_per_gpu)

    @property
    def gpus(self) -> int:
        return sum(len(inv.gpus) for _, inv in self.nodes)


def looks_like_kube_list(path: str | os.PathLike[str]) -> bool:
    """YAML/JSON files are v1 Lists; everything else is read as an openb CSV."""
    return Path(path).suffix.lower() in (".yaml", ".yml", ".json")


def _milli(value: object, what: str) -> int:
    return int(parse_quantity(value, what=what) * 1000)


def _mib(value: object, what: str) -> int:
    return int(parse_quantity(value, what=what) / MIB)


def _node_spec(node: Mapping[str, Any], inventory: NodeInventory) -> NodeSpec:
    name = node_name(node)
    alloc = (node.get("status") or {}).get("allocatable") or {}
    cpu = _milli(alloc.get("cpu", 0), f"node {name}: status.allocatable.cpu")
    mem = _mib(alloc.get("memory", 0), f"node {name}: status.allocatable.memory")
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    product = labels.get(ann.PRODUCT_LABEL) or (inventory.gpus[0].product if inventory.gpus else "")
    raw_cost = ann.pod_annotations(node).get(ann.HOURLY_COST_KEY)
    try:
        cost = float(raw_cost) if raw_cost is not None else 0.0
    except ValueError:
        raise GpuSliceError(f"node {name}: annotation {ann.HOURLY_COST_KEY}={raw_cost!r} is not a number") from None
    return NodeSpec(name, cpu, mem, str(product), cost)


def _pod_cpu_memory(pod: Mapping[str, Any], where: str) -> tuple[int, int]:
    """Kubernetes' pod-requests rule for CPU and memory: max(app containers, each init container)."""
    spec = pod.get("spec") or {}

    def requests(c: Mapping[str, Any]) -> tuple[int, int]:
        req = (c.get("resources") or {}).get("requests") or {}
        return (_milli(req.get("cpu", 0), f"{where}: container {c.get('name')!r} cpu"),
                _mib(req.get("memory", 0), f"{where}: container {c.get('name')!r} memory"))

    apps = [requests(c) for c in spec.get("containers") or []]
    cpu, mem = sum(a[0] for a in apps), sum(a[1] for a in apps)
    for c in spec.get("initContainers") or []:
        ic, im = requests(c)
        cpu, mem = max(cpu, ic), max(mem, im)
    return cpu, mem


def _products(pod: Mapping[str, Any]) -> frozenset[str] | None:
    """A GPU-product constraint from nodeSelector or required node affinity on the product label."""
    spec = pod.get("spec") or {}
    wanted = (spec.get("nodeSelector") or {}).get(ann.PRODUCT_LABEL)
    if wanted:
        return frozenset([str(wanted)])
    terms = ((((spec.get("affinity") or {}).get("nodeAffinity") or {})
              .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or [])
    for term in terms:
        for expr in term.get("matchExpressions") or []:
            if expr.get("key") == ann.PRODUCT_LABEL and expr.get("operator") == "In":
                return frozenset(str(v) for v in expr.get("values") or [])
    return None


def _owner(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    refs = meta.get("ownerReferences") or []
    if refs:
        return f"{meta.get('namespace', 'default')}/{refs[0].get('kind')}/{refs[0].get('name')}"
    return ""


def load_kube_cluster(paths: Sequence[str | os.PathLike[str]]) -> KubeCluster:
    """Nodes and pods from one or more v1 List files (nodes and pods may be in the same file)."""
    nodes: list[tuple[NodeSpec, NodeInventory]] = []
    pods: list[tuple[str, Mapping[str, Any], str]] = []
    seen: set[str] = set()
    for path in paths:
        try:
            items = parse_list_text(Path(path).read_text())
        except OSError as err:
            raise KubeFileError(path, f"cannot read: {err.strerror}") from None
        except GpuSliceError as err:
            raise KubeFileError(path, str(err)) from None
        for item in items:
            try:
                if item.get("kind") == "Node":
                    name = node_name(item)
                    if name in seen:
                        continue
                    inventory = node_inventory(item)
                    if inventory is None:
                        continue  # not a slice node: nothing to place there
                    seen.add(name)
                    nodes.append((_node_spec(item, inventory), inventory.with_used(())))
                elif item.get("kind") == "Pod":
                    meta = item.get("metadata") or {}
                    pods.append((str(meta.get("creationTimestamp", "")), item, str(path)))
            except GpuSliceError as err:
                raise KubeFileError(path, str(err)) from None
    if not nodes:
        raise KubeFileError(paths[0], "no Node with an example.com/gpu-slice.inventory annotation")
    sizes = {g.slices for _, inv in nodes for g in inv.gpus if g.mode != "mig"}
    if len(sizes) > 1:
        raise KubeFileError(paths[0], f"GPUs advertise different S ({sorted(sizes)}); S is cluster-wide")
    s = sizes.pop() if sizes else 7
    requests: list[PackRequest] = []
    for n, (_, pod, path) in enumerate(sorted(pods, key=lambda t: t[0])):
        meta = pod.get("metadata") or {}
        where = f"pod {meta.get('namespace', 'default')}/{meta.get('name', '?')}"
        try:
            slice_request = parse_request(pod)
            cpu, mem = _pod_cpu_memory(pod, where)
            requests.append(pack_request(slice_request, slices_per_gpu=s, cpu_milli=cpu, memory_mib=mem,
                                         products=_products(pod), owner=_owner(pod),
                                         uid=str(meta.get("uid") or f"pod-{n}")))
        except GpuSliceError as err:
            raise KubeFileError(path, f"{where}: {err}") from None
    return KubeCluster(tuple(nodes), s, tuple(requests))


def inflate_requests(requests: Sequence[PackRequest], capacity_slices: int, seed: int,
                     ratio: float = 1.3) -> list[PackRequest]:
    """The FGD artifact's inflation (``simulator.inflate``) over packing requests, in listed order."""
    return inflate_items(requests, capacity_slices, seed, ratio, share=lambda r: r.slices,
                         total=lambda r: r.total_slices, retag=lambda r, n: replace(r, uid=f"{r.uid}-tuned-{n}"))
