"""A node (the plain mapping of a ``v1.Node``) as the scheduler sees it: one compact projection.

What placement needs from a node: its name, allocatable CPU and memory, its slice inventory (the
device plugin's annotation, with the operator's per-GPU cordon applied), its GPU product and its
price. The extender (from watch events) and the simulator (from v1 Lists) both read nodes here.

Price, most specific first: a live figure the caller supplies (OpenCost through Prometheus), the
node's ``example.com/hourly-cost`` annotation (an operator's explicit word for this node), the
config's price table by instance type and capacity type, then the config's $/GPU-hour by product
times the node's GPUs; 0 when nothing is known (``cost`` then has no signal and drops out).

A node that cannot be read (its inventory does not decode, its status is not an object) is kept
with ``error`` set, so filter can name the cause instead of calling the node unknown.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuslice import annotations as ann
from gpuslice.config import Config
from gpuslice.errors import GpuSliceError, InventoryError
from gpuslice.kubelist import with_cordon
from gpuslice.model import Gpu, NodeInventory
from gpuslice.noderules import NodeRules, node_rules
from gpuslice.packing.state import NodeSpec
from gpuslice.pods import expect_object, in_range
from gpuslice.units import MIB, parse_quantity

SPOT_VALUES = frozenset({"spot", "preemptible", "true"})
CAPACITY_LABELS = (ann.CAPACITY_TYPE_LABEL, "eks.amazonaws.com/capacityType", "cloud.google.com/gke-spot",
                   "cloud.google.com/gke-preemptible", "kubernetes.azure.com/scalesetpriority")


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """The projection of one node. ``inventory`` is None for a node without slices."""

    name: str
    spec: NodeSpec
    inventory: NodeInventory | None
    error: str = ""
    decoded: tuple[Gpu, ...] = ()  # its GPUs before the cordon annotation is applied
    rules: NodeRules | None = None  # taints, cordon and labels: who may run here (None: unreadable)


def _obj(value: object, where: str) -> Mapping[str, Any]:
    return expect_object(value, where, InventoryError)


def capacity_type(labels: Mapping[str, Any]) -> str:
    """``spot`` or ``on-demand`` from the node-pool labels Karpenter, EKS, GKE and AKS set."""
    for key in CAPACITY_LABELS:
        value = labels.get(key)
        if isinstance(value, str) and value:
            low = value.lower()
            return "spot" if low in SPOT_VALUES or low == "spot" else "on-demand"
    return "on-demand"


def node_price(node_labels: Mapping[str, Any], annotations: Mapping[str, Any], inventory: NodeInventory | None,
               config: Config | None) -> float:
    """$/hour of a node from its annotation or the config's tables (see the module docstring)."""
    raw = annotations.get(ann.HOURLY_COST_KEY)
    if raw is not None:
        if not isinstance(raw, str):  # annotation values are strings; float() of a huge int overflows
            raise InventoryError(f"annotation {ann.HOURLY_COST_KEY} must be a string, got {type(raw).__name__}")
        try:
            cost = float(raw)
        except ValueError:
            raise InventoryError(f"annotation {ann.HOURLY_COST_KEY}={raw!r} is not a number") from None
        if not cost >= 0 or cost == float("inf"):
            raise InventoryError(f"annotation {ann.HOURLY_COST_KEY}={raw!r} must be a finite number >= 0")
        return cost
    if config is None:
        return 0.0
    itype = node_labels.get(ann.INSTANCE_TYPE_LABEL) or node_labels.get(ann.INSTANCE_TYPE_LABEL_BETA)
    if isinstance(itype, str):
        price = config.node_price(itype, capacity_type(node_labels))
        if price is not None:
            return price
    if inventory is not None:
        per_gpu = [config.gpu_price(g.product) for g in inventory.gpus]
        if per_gpu and all(p is not None for p in per_gpu):
            return float(sum(p for p in per_gpu if p is not None))
    return 0.0


def slim(node: Mapping[str, Any]) -> Mapping[str, Any]:
    """The parts of a node that :func:`project_node` reads (a node's image list and conditions can
    be most of it). Anything of an unexpected shape is kept, so the projection still names it."""
    meta, status = node.get("metadata"), node.get("status")
    if not isinstance(meta, Mapping):
        return node
    out_meta = {k: meta[k] for k in ("name", "uid", "resourceVersion", "labels", "annotations") if k in meta}
    out: dict[str, Any] = {"kind": "Node", "metadata": out_meta}
    spec = node.get("spec")
    if isinstance(spec, Mapping):
        out["spec"] = {k: spec[k] for k in ("taints", "unschedulable") if k in spec}
    elif spec is not None:
        out["spec"] = spec
    if isinstance(status, Mapping):
        out["status"] = {"allocatable": status["allocatable"]} if "allocatable" in status else {}
    elif status is not None:
        out["status"] = status
    return out


def project_node(node: Mapping[str, Any], *, config: Config | None = None,
                 previous: NodeInfo | None = None) -> NodeInfo:
    """The projection of a node mapping; never raises for a node that has a name.

    ``previous`` (this node's last projection) saves decoding an inventory annotation that has not
    changed: most node updates are kubelet heartbeats."""
    meta = node.get("metadata") if isinstance(node, Mapping) else None
    name = meta.get("name") if isinstance(meta, Mapping) else None
    if not isinstance(name, str) or not name:
        raise InventoryError("a node without metadata.name")
    try:
        meta = _obj(meta, "metadata")
        labels = _obj(meta.get("labels"), "metadata.labels")
        annotations = _obj(meta.get("annotations"), "metadata.annotations")
        alloc = _obj(_obj(node.get("status"), "status").get("allocatable"), "status.allocatable")
        cpu_raw, mem_raw = alloc.get("cpu", 0), alloc.get("memory", 0)
        cpu = in_range(int(parse_quantity(cpu_raw, what="status.allocatable.cpu") * 1000), cpu_raw,
                       "status.allocatable.cpu")
        mem = in_range(int(parse_quantity(mem_raw, what="status.allocatable.memory") / MIB), mem_raw,
                       "status.allocatable.memory")
        raw_inv = annotations.get(ann.INVENTORY_KEY)
        decoded: tuple[Gpu, ...] = ()
        inventory: NodeInventory | None = None
        if raw_inv is not None:
            # An annotation that is the previous GPUs as encoded (what the device plugin writes) is
            # not decoded again, and its text is not kept for the comparison: a heartbeat is cheap.
            if previous is not None and previous.decoded and raw_inv == ann.encode_inventory(previous.decoded):
                decoded = previous.decoded
            else:
                decoded = ann.decode_inventory(raw_inv)
            inventory = with_cordon(name, decoded, annotations.get(ann.CORDON_KEY))
        product = labels.get(ann.PRODUCT_LABEL) or (inventory.gpus[0].product if inventory and inventory.gpus
                                                     else "")
        if not isinstance(product, str):
            raise InventoryError(f"label {ann.PRODUCT_LABEL} must be a string")
        cost = node_price(labels, annotations, inventory, config)
        rules = node_rules(node)
    except GpuSliceError as err:
        return NodeInfo(name, NodeSpec(name, 0, 0), None, f"node {name}: {err}")
    return NodeInfo(name, NodeSpec(name, cpu, mem, product, cost), inventory, "", decoded, rules)
