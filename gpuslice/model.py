"""The slice model: GPUs in one of three modes, MIG instances, and a node's inventory.

Values are immutable; operations return new values, so a scheduler can try a placement on a copy
and the device plugin can swap its whole view atomically when health or layout changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from gpuslice import ids
from gpuslice.catalogue import product
from gpuslice.errors import CatalogueError, InventoryError

GpuMode = Literal["mig", "mps", "whole"]
GPU_MODES: tuple[str, ...] = get_args(GpuMode)


@dataclass(frozen=True, slots=True)
class MigInstance:
    """An existing GPU instance: its UUID, profile, memory-slice start and size, and its GPU-instance
    id (``gi``: NVML's ``nvmlDeviceGetGpuInstanceId``, the ``GPU_I_ID`` label dcgm-exporter puts on
    the instance's series; None when the plugin that wrote the inventory did not say)."""

    uuid: str
    profile: str
    start: int
    compute_slices: int
    memory_mib: int
    gi: int | None = None

    def __post_init__(self) -> None:
        if self.gi is not None and (isinstance(self.gi, bool) or not isinstance(self.gi, int) or self.gi < 0):
            raise InventoryError(f"MIG instance {self.uuid}: GPU-instance id must be an integer >= 0, got {self.gi!r}")

    def slice_ids(self) -> tuple[str, ...]:
        return ids.encode_all(self.uuid, self.compute_slices)


@dataclass(frozen=True, slots=True)
class Gpu:
    """One physical GPU as the scheduler sees it.

    ``slices`` is S for ``mps`` and ``whole`` GPUs (the cluster-wide slices per GPU) and the sum of
    the instances' compute slices for ``mig`` GPUs (compute slices with no instance are not
    advertised, because no pod could be given them).
    """

    uuid: str
    index: int
    product: str
    memory_mib: int
    mode: GpuMode
    slices: int
    healthy: bool = True
    cordoned: bool = False
    instances: tuple[MigInstance, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in GPU_MODES:
            raise CatalogueError(f"GPU {self.uuid}: mode must be one of {', '.join(GPU_MODES)}, got {self.mode!r}")
        if self.mode == "mig":
            owners = [self.uuid, *(i.uuid for i in self.instances)]
            if len(set(owners)) != len(owners):
                raise CatalogueError(f"GPU {self.uuid}: MIG instance UUIDs must be unique and differ from the GPU's")
            validate_mig_layout(self.product, self.instances, where=f"GPU {self.uuid}")
            total = sum(i.compute_slices for i in self.instances)
            if self.slices != total:
                raise CatalogueError(f"GPU {self.uuid}: slices={self.slices} but its MIG instances hold {total}")
        else:
            if self.instances:
                raise CatalogueError(f"GPU {self.uuid}: MIG instances listed but mode is {self.mode}")
            if self.slices < 1:
                raise CatalogueError(f"GPU {self.uuid}: slices must be at least 1, got {self.slices}")
        # The ids are checked here (the owners and the longest id) but derived when asked, not kept:
        # a cluster's inventories would otherwise hold hundreds of thousands of id strings.
        for owner, count in self._owners():
            ids.encode(owner, count - 1)

    @property
    def schedulable(self) -> bool:
        """Healthy and not cordoned: new placements may land here."""
        return self.healthy and not self.cordoned

    def _owners(self) -> list[tuple[str, int]]:
        """(id owner, slice count) of each owner that advertises ids: the MIG instances, else the GPU."""
        if self.mode == "mig":
            return [(inst.uuid, inst.compute_slices) for inst in self.instances if inst.compute_slices > 0]
        return [(self.uuid, self.slices)]

    def slice_ids(self) -> tuple[str, ...]:
        """Every id this GPU advertises, in a stable order."""
        if self.mode == "mig":
            return tuple(sid for inst in self.instances for sid in inst.slice_ids())
        return ids.encode_all(self.uuid, self.slices)

    def instance(self, uuid: str) -> MigInstance:
        for inst in self.instances:
            if inst.uuid == uuid:
                return inst
        raise InventoryError(f"GPU {self.uuid} has no MIG instance {uuid}")

    def owns(self, owner: str) -> bool:
        """Whether an id owner (GPU or MIG UUID) belongs to this GPU."""
        return owner == self.uuid or any(i.uuid == owner for i in self.instances)


def validate_mig_layout(product_name: str, instances: Iterable[MigInstance], *, where: str) -> None:
    """Check a MIG layout against the catalogue: known profiles, legal starts, no overlap, counts."""
    prod = product(product_name)
    if not prod.mig_capable:
        raise CatalogueError(f"{where}: product {product_name} does not support MIG")
    used: set[int] = set()
    counts: dict[str, int] = {}
    for inst in instances:
        prof = prod.profile(inst.profile)
        if inst.start not in prof.starts:
            raise CatalogueError(
                f"{where}: instance {inst.uuid} ({inst.profile}) cannot start at memory slice {inst.start}; "
                f"legal starts {list(prof.starts)}")
        if inst.compute_slices != prof.compute_slices:
            raise CatalogueError(
                f"{where}: instance {inst.uuid} claims {inst.compute_slices} compute slices, "
                f"profile {inst.profile} has {prof.compute_slices}")
        covered = prof.covers(inst.start)
        if covered & used:
            raise CatalogueError(f"{where}: instance {inst.uuid} overlaps another instance's memory slices")
        used |= covered
        counts[prof.name] = counts.get(prof.name, 0) + 1
        if counts[prof.name] > prof.max_count:
            raise CatalogueError(f"{where}: more than {prof.max_count} instances of {prof.name}")
    if sum(n for name, n in counts.items() if name.endswith("+me")) > 1:
        raise CatalogueError(f"{where}: at most one media-extension (+me) instance per GPU")
    if sum(prod.profile(i.profile).compute_slices for i in instances) > prod.compute_slices:
        raise CatalogueError(f"{where}: instances hold more than {prod.compute_slices} compute slices")


def place_mig_layout(product_name: str, profiles: Iterable[str], *, where: str) -> tuple[tuple[str, int], ...]:
    """Legal memory-slice starts for a layout given by profile names (the config's ``migLayouts``),
    largest profiles first, each at its first start that fits; ``CatalogueError`` naming the profile
    when no placement exists (or the layout breaks a count rule of :func:`validate_mig_layout`)."""
    prod = product(product_name)
    names = list(profiles)
    order = sorted(range(len(names)), key=lambda n: (-prod.profile(names[n]).memory_slices, n))
    starts: dict[int, int] = {}

    def place(k: int, used: frozenset[int]) -> bool:
        if k == len(order):
            return True
        prof = prod.profile(names[order[k]])
        for start in prof.starts:
            covered = prof.covers(start)
            if covered <= frozenset(range(prod.memory_slices)) and not covered & used:
                starts[order[k]] = start
                if place(k + 1, used | covered):
                    return True
        return False

    if not place(0, frozenset()):
        raise CatalogueError(f"{where}: {', '.join(names)} cannot all be placed on one {product_name} (no legal "
                             "memory-slice starts leave room for every instance)")
    instances = [MigInstance(f"MIG-layout-{n}", name, starts[n], prod.profile(name).compute_slices,
                             prod.profile(name).memory_mib) for n, name in enumerate(names)]
    validate_mig_layout(product_name, instances, where=where)
    return tuple((name, starts[n]) for n, name in enumerate(names))


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """One node's GPUs and which of their slice ids are in use.

    ``used`` holds ids that pods hold (by the counting rule) or that reservations claim. Ids of
    unhealthy or cordoned GPUs stay in ``all_ids`` (running pods keep them) but are never free.
    """

    node: str
    gpus: tuple[Gpu, ...]
    used: frozenset[str] = field(default=frozenset())
    _all: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for gpu in self.gpus:
            owners = {gpu.uuid, *(i.uuid for i in gpu.instances)}
            if owners & seen:
                raise InventoryError(f"node {self.node}: GPU or MIG UUID listed twice near {gpu.uuid}")
            seen |= owners
        unknown = self.used - self.all_ids() if self.used else frozenset()
        if unknown:
            raise InventoryError(f"node {self.node}: used ids not on this node: {sorted(unknown)[:5]}")

    def __iter__(self) -> Iterator[Gpu]:
        return iter(self.gpus)

    def all_ids(self) -> frozenset[str]:
        """Every id the node advertises, built on first use and kept (an inventory asked once is
        usually asked again; one that never is, such as the extender's, holds no ids)."""
        if not self._all:
            object.__setattr__(self, "_all", frozenset(sid for gpu in self.gpus for sid in gpu.slice_ids()))
        return self._all

    def free_ids(self) -> frozenset[str]:
        """Ids a new placement may take: unused, on schedulable GPUs."""
        return frozenset(
            sid for gpu in self.gpus if gpu.schedulable for sid in gpu.slice_ids() if sid not in self.used)

    def free_on(self, gpu: Gpu) -> tuple[str, ...]:
        """Unused ids of one GPU in advertised order (ignores health: callers check ``schedulable``)."""
        return tuple(sid for sid in gpu.slice_ids() if sid not in self.used)

    def gpu(self, uuid: str) -> Gpu:
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        raise InventoryError(f"node {self.node} has no GPU {uuid}")

    def gpu_of(self, slice_id: str) -> Gpu:
        """The GPU that owns an id (GPU or MIG owner)."""
        owner = ids.owner_of(slice_id)
        for gpu in self.gpus:
            if gpu.owns(owner):
                return gpu
        raise InventoryError(f"node {self.node} has no device {slice_id}")

    def allocate(self, slice_ids: Iterable[str]) -> NodeInventory:
        """Mark ids used; refuse unknown or already used ids so double counting shows up."""
        wanted = frozenset(slice_ids)
        unknown = wanted - self.all_ids()
        if unknown:
            raise InventoryError(f"node {self.node}: unknown device ids {sorted(unknown)}")
        taken = wanted & self.used
        if taken:
            raise InventoryError(f"node {self.node}: device ids already in use {sorted(taken)}")
        return replace(self, used=self.used | wanted)

    def release(self, slice_ids: Iterable[str]) -> NodeInventory:
        """Mark ids free; releasing an id that is not used is a bookkeeping bug and raises."""
        gone = frozenset(slice_ids)
        missing = gone - self.used
        if missing:
            raise InventoryError(f"node {self.node}: releasing ids that are not in use {sorted(missing)}")
        return replace(self, used=self.used - gone)

    def with_used(self, slice_ids: Iterable[str]) -> NodeInventory:
        """Replace the used set wholesale (rebuilding from the counting rule)."""
        return replace(self, used=frozenset(slice_ids))

    def with_gpu(self, gpu: Gpu) -> NodeInventory:
        """Replace one GPU (health, cordon or layout change); the used ids must still exist."""
        gpus = tuple(gpu if g.uuid == gpu.uuid else g for g in self.gpus)
        if gpus == self.gpus and gpu not in self.gpus:
            raise InventoryError(f"node {self.node} has no GPU {gpu.uuid}")
        return NodeInventory(self.node, gpus, self.used)
