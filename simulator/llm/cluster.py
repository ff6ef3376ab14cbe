"""The built-in LLM-serving cluster: mixed H100/A100/L4/L40S nodes, MIG, MPS and whole GPUs, prices.

The shape is what a team serving many open-weight models tends to run: a few 8-GPU H100/A100
boxes cut into static MIG layouts (chosen once by the operator, never changed while pods run),
some in MPS mode with S=7, some left whole for 34B-70B fp16 models, and many cheap 4-GPU L4/L40S
nodes for whole-GPU 7B-13B replicas. About a third of the nodes are spot capacity.

Prices are approximate AWS us-east-1 on-demand list prices (2024) of the instance types these
nodes stand for; spot prices are on-demand times an assumed typical spot ratio per family. They
only need to be realistic relative to each other: $/hour is compared between policies, not billed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpuslice.catalogue import product
from gpuslice.model import Gpu, GpuMode, MigInstance, NodeInventory, validate_mig_layout

S = 7
"""Cluster-wide MPS slices per GPU (DESIGN 2 default); also the slices of a whole GPU."""

CAPACITY_LABEL = "karpenter.sh/capacity-type"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"

# A static MIG layout: (profile name, memory-slice start) per instance. Names are the A100-80GB /
# H100-80GB profile names, which the two products share.
MigLayout = tuple[tuple[str, int], ...]

LAYOUTS: dict[str, MigLayout] = {
    # 7 compute slices: one 13B-class, one 7B fp16 and two quantised 7B replicas.
    "3g+2g+1g+1g": (("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4)),
    # 70B AWQ (4g) next to a 13B (3g).
    "4g+3g": (("4g.40gb", 0), ("3g.40gb", 4)),
    # Many small quantised models or embedders.
    "7x1g": tuple(("1g.10gb", i) for i in range(7)),
    # Three 7B/8B fp16 replicas and one small one.
    "3x2g+1g": (("2g.20gb", 0), ("2g.20gb", 2), ("2g.20gb", 4), ("1g.10gb", 6)),
    "2x3g": (("3g.40gb", 0), ("3g.40gb", 4)),
    "7g": (("7g.80gb", 0),),
    # Memory-heavy single-slice instances (8B fp16 at one compute slice).
    "4x1g.20gb": (("1g.20gb", 0), ("1g.20gb", 2), ("1g.20gb", 4), ("1g.20gb", 6)),
}


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """How one GPU of a node template is set up: its mode and, for ``mig``, its layout name."""

    mode: GpuMode
    layout: str = ""


@dataclass(frozen=True, slots=True)
class NodeTemplate:
    """A kind of node: instance type, GPU product and the per-GPU setup the operator chose."""

    name: str
    instance_type: str
    product: str
    gpus: tuple[GpuSpec, ...]


@dataclass(frozen=True, slots=True)
class Price:
    """$/hour of one instance type, on-demand and spot."""

    on_demand: float
    spot: float


@dataclass(frozen=True, slots=True)
class SimNode:
    """One node of the scenario: its inventory (empty), labels and hourly price."""

    name: str
    template: str
    instance_type: str
    capacity_type: str  # "on-demand" | "spot", the Karpenter label value
    hourly_cost: float
    inventory: NodeInventory

    @property
    def labels(self) -> dict[str, str]:
        return {INSTANCE_TYPE_LABEL: self.instance_type, CAPACITY_LABEL: self.capacity_type}

    @property
    def gpu_count(self) -> int:
        return len(self.inventory.gpus)

    @property
    def allocatable(self) -> tuple[int, int]:
        """(CPU millicores, RAM MiB) pods may request on this node."""
        return ALLOCATABLE[self.instance_type]


@dataclass(frozen=True, slots=True)
class Cluster:
    """The whole scenario cluster, nodes in a stable order."""

    nodes: tuple[SimNode, ...]

    @property
    def gpu_count(self) -> int:
        return sum(n.gpu_count for n in self.nodes)

    def node(self, name: str) -> SimNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def hourly_cost(self) -> float:
        """What every node costs per hour together (the cluster kept fully up)."""
        return sum(n.hourly_cost for n in self.nodes)


# Approximate us-east-1 on-demand $/hour (2024 list prices) and an assumed spot ratio per family.
_ON_DEMAND = {
    "p5.48xlarge": 98.32,     # 8x H100-80GB
    "p4de.24xlarge": 40.97,   # 8x A100-80GB
    "p4d.24xlarge": 32.77,    # 8x A100-40GB
    "g6e.12xlarge": 10.49,    # 4x L40S
    "g6.12xlarge": 4.60,      # 4x L4
}
_SPOT_RATIO = {"p5.48xlarge": 0.55, "p4de.24xlarge": 0.45, "p4d.24xlarge": 0.40,
               "g6e.12xlarge": 0.40, "g6.12xlarge": 0.35}
PRICES: dict[str, Price] = {
    t: Price(od, round(od * _SPOT_RATIO[t], 2)) for t, od in _ON_DEMAND.items()
}

# Allocatable host CPU (millicores) and RAM (MiB) per instance type: the vCPUs and RAM of the type
# less about 10 % kept back by kubelet and system daemons.
ALLOCATABLE: dict[str, tuple[int, int]] = {
    "p5.48xlarge": (172_000, 1_843_200),
    "p4de.24xlarge": (86_000, 1_036_800),
    "p4d.24xlarge": (86_000, 1_036_800),
    "g6e.12xlarge": (43_000, 345_600),
    "g6.12xlarge": (43_000, 172_800),
}


def _mig(*layouts: str) -> tuple[GpuSpec, ...]:
    return tuple(GpuSpec("mig", name) for name in layouts)


TEMPLATES: dict[str, NodeTemplate] = {
    t.name: t
    for t in (
        NodeTemplate("h100-mig-a", "p5.48xlarge", "H100-80GB", _mig(
            "3g+2g+1g+1g", "3g+2g+1g+1g", "4g+3g", "4g+3g", "3x2g+1g", "3x2g+1g", "7x1g", "2x3g")),
        NodeTemplate("h100-mig-b", "p5.48xlarge", "H100-80GB", _mig(
            "7x1g", "7x1g", "4x1g.20gb", "4x1g.20gb", "3x2g+1g", "3x2g+1g", "3g+2g+1g+1g", "4g+3g")),
        NodeTemplate("h100-mps", "p5.48xlarge", "H100-80GB", (GpuSpec("mps"),) * 8),
        NodeTemplate("h100-whole", "p5.48xlarge", "H100-80GB", (GpuSpec("whole"),) * 8),
        NodeTemplate("a100-mig", "p4de.24xlarge", "A100-80GB", _mig(
            "4g+3g", "4g+3g", "3g+2g+1g+1g", "3g+2g+1g+1g", "3x2g+1g", "3x2g+1g", "7g", "7g")),
        NodeTemplate("a100-mps", "p4de.24xlarge", "A100-80GB", (GpuSpec("mps"),) * 8),
        NodeTemplate("a100-40-whole", "p4d.24xlarge", "A100-40GB", (GpuSpec("whole"),) * 8),
        NodeTemplate("l40s-whole", "g6e.12xlarge", "L40S", (GpuSpec("whole"),) * 4),
        NodeTemplate("l4-whole", "g6.12xlarge", "L4", (GpuSpec("whole"),) * 4),
    )
}

# (template, on-demand nodes, spot nodes): 43 nodes, 252 GPUs.
DEFAULT_FLEET: tuple[tuple[str, int, int], ...] = (
    ("h100-mig-a", 2, 1),
    ("h100-mig-b", 2, 1),
    ("h100-mps", 2, 1),
    ("h100-whole", 2, 0),
    ("a100-mig", 2, 1),
    ("a100-mps", 2, 1),
    ("a100-40-whole", 2, 1),
    ("l40s-whole", 5, 5),
    ("l4-whole", 7, 6),
)


def _gpu(node: str, index: int, prod: str, spec: GpuSpec) -> Gpu:
    memory = product(prod).memory_mib
    assert memory is not None
    uuid = f"GPU-{node}-{index}"
    if spec.mode != "mig":
        return Gpu(uuid, index, prod, memory, spec.mode, S)
    catalogue = product(prod)
    instances = tuple(
        MigInstance(f"MIG-{node}-{index}-{j}", name, start, catalogue.profile(name).compute_slices,
                    catalogue.profile(name).memory_mib)
        for j, (name, start) in enumerate(LAYOUTS[spec.layout]))
    validate_mig_layout(prod, instances, where=f"{node} GPU {index}")
    return Gpu(uuid, index, prod, memory, "mig", sum(i.compute_slices for i in instances), instances=instances)


def build_node(name: str, template: NodeTemplate, capacity_type: str) -> SimNode:
    """One node from a template; the inventory is built through the core model, so it is validated."""
    gpus = tuple(_gpu(name, i, template.product, spec) for i, spec in enumerate(template.gpus))
    price = PRICES[template.instance_type]
    cost = price.spot if capacity_type == "spot" else price.on_demand
    return SimNode(name, template.name, template.instance_type, capacity_type, cost, NodeInventory(name, gpus))


def build_cluster(fleet: Sequence[tuple[str, int, int]] = DEFAULT_FLEET) -> Cluster:
    """The built-in cluster; node names say template, capacity type and ordinal (``l4-whole-spot-03``)."""
    nodes: list[SimNode] = []
    for template_name, on_demand, spot in fleet:
        template = TEMPLATES[template_name]
        for capacity, count in (("on-demand", on_demand), ("spot", spot)):
            short = "od" if capacity == "on-demand" else "spot"
            for n in range(count):
                nodes.append(build_node(f"{template_name}-{short}-{n + 1:02d}", template, capacity))
    return Cluster(tuple(nodes))
