"""A seeded generator of fake GPU clusters: Kubernetes Node and Pod objects as the API server shows them.

The simulator, the e2e tests and people trying the extender without GPUs need nodes that look like
what the device plugin publishes (inventory annotation, labels, capacity) and running pods whose
annotations obey the contract. Everything comes from one ``random.Random(seed)``, so the same
arguments give byte-identical output; the time is an argument too (the core has no clock).
Pod placements come from ``gpuslice.placement``, so every pod's ids are a valid placement, and
pods of one owner never share a GPU (the extender's default owner spread).
"""

from __future__ import annotations

import random
import re
import uuid as uuidlib
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any, Literal, get_args

from gpuslice import annotations as ann
from gpuslice.catalogue import PRODUCTS, MigProfile, Product
from gpuslice.config import MAX_SLICES_REAL
from gpuslice.counting import HeldSlices
from gpuslice.errors import CatalogueError, GpuSliceError
from gpuslice.model import Gpu, GpuMode, MigInstance, NodeInventory, validate_mig_layout
from gpuslice.placement import Placement, enumerate_placements
from gpuslice.requests import MEMORY_KEY, RESOURCE, SliceRequest

ClusterMode = Literal["mps", "mig", "whole", "mixed"]
CLUSTER_MODES: tuple[str, ...] = get_args(ClusterMode)
MAX_NODES = 100_000
MAX_GPUS_PER_NODE = 64
SCHEDULER_NAME = "gpu-slice-scheduler"

# Instance types whose GPU count and model match, with on-demand $/hour (public list prices,
# us-east, rounded); other GPU counts get a synthetic type priced per GPU-hour.
_INSTANCE_TYPES: dict[str, tuple[str, int, float]] = {
    "H100-80GB": ("p5.48xlarge", 8, 98.32),
    "H200-141GB": ("p5e.48xlarge", 8, 113.62),
    "A100-40GB": ("p4d.24xlarge", 8, 32.77),
    "A100-80GB": ("p4de.24xlarge", 8, 40.97),
    "A30-24GB": ("a30.fake-4x", 4, 8.0),
    "L4": ("g6.12xlarge", 4, 4.60),
    "L40S": ("g6e.12xlarge", 4, 10.49),
    "A10": ("g5.12xlarge", 4, 5.67),
    "T4": ("g4dn.12xlarge", 4, 3.91),
    "V100M16": ("p3.16xlarge", 8, 24.48),
    "V100M32": ("p3dn.24xlarge", 8, 31.21),
}
_DEFAULT_GPU_HOUR = 2.0
_SPOT_SHARE = 0.25
_SPOT_DISCOUNT = 0.4
_NODE_CPUS = 96
_NODE_MEMORY_GI = 1024


#: Nodes are created 7 days before ``now`` (pods at most that long ago), so ``now`` must leave room
#: for that date to exist.
CREATED_BEFORE = timedelta(days=7)
EARLIEST_TIME = datetime.min.replace(tzinfo=UTC) + CREATED_BEFORE


class FakeClusterError(GpuSliceError):
    """Arguments that do not describe a cluster this project could run on."""


@dataclass(frozen=True, slots=True)
class FakeClusterSpec:
    """What to generate; ``validate`` refuses what a real cluster could not have."""

    nodes: int
    gpus_per_node: int = 8
    product: str = "H100-80GB"
    mode: ClusterMode = "mps"
    slices: int = 7
    seed: int = 0
    pods_per_node: int = 0
    now: datetime = field(default_factory=lambda: datetime.fromisoformat("2025-01-01T00:00:00+00:00"))
    node_prefix: str = "gpu-node"
    namespace: str = "default"

    def validate(self) -> Product:
        """The catalogue product; ``FakeClusterError`` for anything out of range."""
        if self.nodes < 1 or self.nodes > MAX_NODES:
            raise FakeClusterError(f"--nodes must be between 1 and {MAX_NODES}, got {self.nodes}")
        if self.gpus_per_node < 1 or self.gpus_per_node > MAX_GPUS_PER_NODE:
            raise FakeClusterError(
                f"--gpus-per-node must be between 1 and {MAX_GPUS_PER_NODE}, got {self.gpus_per_node}")
        if not 1 <= self.slices <= MAX_SLICES_REAL:
            raise FakeClusterError(
                f"--slices must be between 1 and {MAX_SLICES_REAL} (the MPS client limit), got {self.slices}")
        if self.pods_per_node < 0:
            raise FakeClusterError(f"--pods-per-node must not be negative, got {self.pods_per_node}")
        if self.mode not in CLUSTER_MODES:
            raise FakeClusterError(f"--mode must be one of {', '.join(CLUSTER_MODES)}, got {self.mode!r}")
        if self.now.tzinfo is None:
            raise FakeClusterError("the generation time must be timezone-aware")
        if self.now < EARLIEST_TIME:
            raise FakeClusterError(f"--time must be {ann.format_time(EARLIEST_TIME)} or later (nodes are dated "
                                   f"{CREATED_BEFORE.days} days before it), got {ann.format_time(self.now)}")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.node_prefix) or len(self.node_prefix) > 40:
            raise FakeClusterError(f"node prefix {self.node_prefix!r} is not a valid DNS label start")
        try:
            prod = PRODUCTS[self.product]
        except KeyError:
            raise FakeClusterError(
                f"unknown GPU product {self.product!r}; known: {', '.join(PRODUCTS)}") from None
        if prod.memory_mib is None:
            raise FakeClusterError(f"product {self.product} has no known memory size; pick a named model")
        if self.mode == "mig" and not prod.mig_capable:
            capable = ", ".join(p.name for p in PRODUCTS.values() if p.mig_capable)
            raise FakeClusterError(f"product {self.product} does not support MIG; MIG-capable: {capable}")
        return prod


@dataclass(frozen=True, slots=True)
class FakeCluster:
    """The generated objects, plus the model values they encode (for tests and the simulator)."""

    document: dict[str, Any]
    inventories: tuple[NodeInventory, ...]
    holdings: tuple[HeldSlices, ...]
    unplaced: int  # pods asked for by --pods-per-node that no longer fitted


def _uuid(rng: random.Random) -> str:
    return str(uuidlib.UUID(int=rng.getrandbits(128), version=4))


def _gfd_product(prod: Product) -> str:
    """The GFD ``nvidia.com/gpu.product`` value: NVML name sanitised as GFD does."""
    name = prod.nvml_names[0] if prod.nvml_names else prod.name
    name = re.sub(r"[^A-Za-z0-9\-_. ]", "", name).replace(" ", "-")
    return name[:63].strip("-_.")


def random_mig_layout(prod: Product, rng: random.Random) -> tuple[tuple[MigProfile, int], ...]:
    """A random maximal legal MIG layout: add a random fitting profile until none fits.

    Media-extension profiles are left out (clusters rarely configure them for LLM serving).
    """
    chosen: list[tuple[MigProfile, int]] = []
    profiles = [p for p in prod.mig_profiles if not p.name.endswith("+me")]
    while True:
        options: list[tuple[MigProfile, int]] = []
        for prof in profiles:
            for start in prof.starts:
                trial = [*chosen, (prof, start)]
                try:
                    validate_mig_layout(prod.name, [MigInstance(f"MIG-{i}", p.name, s, p.compute_slices,
                                                                p.memory_mib) for i, (p, s) in
                                                    enumerate(trial)], where="layout")
                except CatalogueError:
                    continue
                options.append((prof, start))
        if not options:
            return tuple(sorted(chosen, key=lambda ps: ps[1]))
        fitting = sorted({p.name for p, _ in options})
        name = rng.choice(fitting)
        starts = [s for p, s in options if p.name == name]
        chosen.append((prod.profile(name), rng.choice(starts)))


def _gpu_modes(spec: FakeClusterSpec, prod: Product, rng: random.Random) -> list[GpuMode]:
    if spec.mode != "mixed":
        return [spec.mode] * spec.gpus_per_node
    kinds: list[GpuMode] = ["mig", "mps", "whole"] if prod.mig_capable else ["mps", "whole"]
    return [rng.choice(kinds) for _ in range(spec.gpus_per_node)]


def _make_gpus(spec: FakeClusterSpec, prod: Product, rng: random.Random) -> tuple[Gpu, ...]:
    assert prod.memory_mib is not None
    gpus = []
    for index, mode in enumerate(_gpu_modes(spec, prod, rng)):
        uuid = f"GPU-{_uuid(rng)}"
        if mode == "mig":
            instances = tuple(MigInstance(f"MIG-{_uuid(rng)}", p.name, start, p.compute_slices, p.memory_mib)
                              for p, start in random_mig_layout(prod, rng))
            gpus.append(Gpu(uuid, index, prod.name, prod.memory_mib, "mig",
                            sum(i.compute_slices for i in instances), instances=instances))
        else:
            gpus.append(Gpu(uuid, index, prod.name, prod.memory_mib, mode, spec.slices))
    return tuple(gpus)


def _sizes(inventory: NodeInventory, rng: random.Random) -> list[int]:
    """Request sizes worth trying on this node, in a seeded random order."""
    sizes: set[int] = set()
    whole = [g for g in inventory.gpus if g.mode == "whole"]
    for gpu in inventory.gpus:
        if gpu.mode == "mig":
            sizes.update(i.compute_slices for i in gpu.instances)
        elif gpu.mode == "mps":
            sizes.update(range(1, gpu.slices + 1))
    for m in range(1, len(whole) + 1):
        sizes.update(g.slices * m for g in whole)
    # Random order biased toward small requests, as in LLM serving (most replicas take a slice or two).
    keys = {k: rng.random() * k for k in sorted(sizes)}
    return sorted(keys, key=keys.__getitem__)


def _place(inventory: NodeInventory, rng: random.Random) -> tuple[SliceRequest, Placement] | None:
    for k in _sizes(inventory, rng):
        found = enumerate_placements(inventory, SliceRequest(k)).placements
        if found:
            placement = rng.choice(found)
            memory = None
            if rng.random() < 0.5:  # half the pods state a memory floor their placement meets
                gib = placement.memory_mib // 1024
                memory = gib * 1024 if gib >= 1 else None
            return SliceRequest(k, Fraction(memory) if memory else None), placement
    return None


def _node_object(spec: FakeClusterSpec, prod: Product, name: str, gpus: tuple[Gpu, ...],
                 rng: random.Random, cordon: frozenset[str]) -> dict[str, Any]:
    itype, count, price = _INSTANCE_TYPES.get(prod.name, ("", 0, 0.0))
    if count != spec.gpus_per_node:
        per_gpu = price / count if count else _DEFAULT_GPU_HOUR
        itype = f"fake-{prod.name.lower()}-x{spec.gpus_per_node}"
        price = per_gpu * spec.gpus_per_node
    spot = rng.random() < _SPOT_SHARE
    hourly = round(price * (_SPOT_DISCOUNT if spot else 1.0), 2)
    zone = rng.choice("abc")
    modes = {g.mode for g in gpus}
    slice_count = sum(len(g.slice_ids()) for g in gpus)
    assert prod.memory_mib is not None
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        ann.INSTANCE_TYPE_LABEL: itype,
        ann.CAPACITY_TYPE_LABEL: "spot" if spot else "on-demand",
        ann.REGION_LABEL: "us-east-2",
        ann.ZONE_LABEL: f"us-east-2{zone}",
        ann.GFD_PRODUCT_LABEL: _gfd_product(prod),
        ann.GFD_MEMORY_LABEL: str(prod.memory_mib),
        ann.GFD_COUNT_LABEL: str(len(gpus)),
        ann.GFD_MIG_CAPABLE_LABEL: "true" if prod.mig_capable else "false",
        ann.MODE_LABEL: modes.pop() if len(modes) == 1 else "mixed",
        ann.PRODUCT_LABEL: prod.name,
    }
    annotations = {ann.INVENTORY_KEY: ann.encode_inventory(gpus), ann.HOURLY_COST_KEY: f"{hourly:.2f}"}
    if cordon:
        annotations[ann.CORDON_KEY] = ann.encode_cordon(cordon)
    resources = {"cpu": str(_NODE_CPUS), "memory": f"{_NODE_MEMORY_GI}Gi", "pods": "110",
                 "ephemeral-storage": "3500Gi", RESOURCE: str(slice_count)}
    created = ann.format_time(spec.now - CREATED_BEFORE)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "uid": _uuid(rng), "labels": labels, "annotations": annotations,
                     "creationTimestamp": created, "resourceVersion": "1"},
        "spec": {"providerID": f"aws:///us-east-2{zone}/i-{rng.getrandbits(68):017x}"},
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "lastHeartbeatTime": ann.format_time(spec.now),
                            "lastTransitionTime": created}],
            "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux",
                         "kubeletVersion": "v1.31.4", "containerRuntimeVersion": "containerd://1.7.24"},
        },
    }


@dataclass
class _Owners:
    """ReplicaSets per request size; a pod joins the first one without a pod on its GPUs."""

    rng: random.Random
    uids: dict[str, str] = field(default_factory=dict)
    gpus: dict[str, set[str]] = field(default_factory=dict)

    def pick(self, size: int, gpus: tuple[str, ...]) -> tuple[str, str]:
        n = 0
        while True:
            name = f"llm-{size}s-{n}-{self._hash(size, n)}"
            taken = self.gpus.setdefault(name, set())
            if not taken & set(gpus):
                taken.update(gpus)
                if name not in self.uids:
                    self.uids[name] = _uuid(self.rng)
                return name, self.uids[name]
            n += 1

    @staticmethod
    def _hash(size: int, n: int) -> str:
        return f"{(size * 7919 + n * 104729) % 0xFFFFF:05x}"


def _pod_object(spec: FakeClusterSpec, node: str, request: SliceRequest, placement: Placement,
                owner: tuple[str, str], rng: random.Random, created: datetime) -> tuple[dict[str, Any], HeldSlices]:
    uid = _uuid(rng)
    owner_name, owner_uid = owner
    name = f"{owner_name}-{_uuid(rng)[:5]}"
    assignment = ann.Assignment(
        pod_uid=uid, node=node, gpus=placement.gpus, instance=placement.instance,
        slice_ids=placement.slice_ids, policy="fragmentation",
        scores={"fragmentation": round(rng.random(), 4)}, time=created)
    allocated = ann.Allocated(slice_ids=placement.slice_ids, time=created + timedelta(seconds=2))
    annotations = {ann.ASSIGNMENT_KEY: ann.encode_assignment(assignment),
                   ann.ALLOCATED_KEY: ann.encode_allocated(allocated)}
    if request.memory_mib is not None:
        annotations[MEMORY_KEY] = f"{int(request.memory_mib) // 1024}Gi"
    count = str(request.slices)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name, "namespace": spec.namespace, "uid": uid, "resourceVersion": "1",
            "creationTimestamp": ann.format_time(created),
            "labels": {"app": owner_name.rsplit("-", 1)[0], "pod-template-hash": owner_name.rsplit("-", 1)[1]},
            "annotations": annotations,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": owner_name,
                                 "uid": owner_uid, "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {
            "nodeName": node,
            "schedulerName": SCHEDULER_NAME,
            "restartPolicy": "Always",
            "containers": [{
                "name": "server",
                "image": "vllm/vllm-openai:v0.6.4",
                "resources": {"requests": {RESOURCE: count, "cpu": "4", "memory": "32Gi"},
                              "limits": {RESOURCE: count, "memory": "32Gi"}},
            }],
        },
        "status": {"phase": "Running", "startTime": ann.format_time(created + timedelta(seconds=1)),
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }
    held = HeldSlices(uid, f"{spec.namespace}/{name}", frozenset(placement.slice_ids), "allocated", True,
                      assignment, allocated)
    return pod, held


def generate(spec: FakeClusterSpec) -> FakeCluster:
    """Build the cluster described by ``spec``; ``FakeClusterError`` when the spec is invalid."""
    prod = spec.validate()
    rng = random.Random(spec.seed)
    nodes: list[dict[str, Any]] = []
    pods: list[dict[str, Any]] = []
    inventories: list[NodeInventory] = []
    holdings: list[HeldSlices] = []
    owners = _Owners(random.Random(rng.getrandbits(64)))
    unplaced = 0
    width = max(3, len(str(spec.nodes - 1)))
    for n in range(spec.nodes):
        name = f"{spec.node_prefix}-{n:0{width}d}"
        gpus = _make_gpus(spec, prod, rng)
        nodes.append(_node_object(spec, prod, name, gpus, rng, frozenset()))
        inventory = NodeInventory(name, gpus)
        for i in range(spec.pods_per_node):
            chosen = _place(inventory, rng)
            if chosen is None:
                unplaced += spec.pods_per_node - i
                break
            request, placement = chosen
            created = spec.now - timedelta(minutes=rng.randint(5, int(CREATED_BEFORE.total_seconds()) // 60))
            owner = owners.pick(request.slices, placement.gpus)
            pod, held = _pod_object(spec, name, request, placement, owner, rng, created)
            pods.append(pod)
            holdings.append(held)
            inventory = inventory.allocate(placement.slice_ids)
        inventories.append(inventory)
    document = {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""},
                "items": [*nodes, *pods]}
    return FakeCluster(document, tuple(inventories), tuple(holdings), unplaced)
