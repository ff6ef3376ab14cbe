"""Dynamic MIG layouts in a replay: the core's re-cut decisions applied to the replay's array state.

The decision is the core's (:class:`gpuslice.miglayout.LayoutPlanner`), the same the extender makes;
this module only carries it out on a :class:`ClusterState` (``ClusterState.recut_gpu``: the retired
instances' rows leave the node, new rows come, every other row keeps its number) and counts what a
re-cut did. A retired instance that anything held would be refused by the state; the count of such
refusals is kept (``busy_refused``) so a replay reports it instead of assuming it is zero.

The time a pod waits for its re-cut (:data:`RECUT_WAIT_S`) is modelled by the replays that have a
clock (the built-in day, the departures replay); arrival-only replays have none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from gpuslice.catalogue import PRODUCTS
from gpuslice.config import Config
from gpuslice.errors import GpuSliceError
from gpuslice.miglayout import LayoutPlanner, Recut, Slot, slots_from_inventories
from gpuslice.model import NodeInventory
from gpuslice.packing.state import KIND_MIG, Candidates, ClusterState, PackRequest, UnitSpec

LayoutMode = Literal["static", "dynamic"]
LAYOUT_MODES: tuple[str, ...] = ("static", "dynamic")

#: Seconds from a pod's refusal to its bind on the instance a re-cut made for it, as modelled here:
#: the extender's layout publisher (up to 1 s: it runs after each refusal and at most once a second),
#: the device plugin's node watch (under 1 s), the NVML calls (destroy and create of GPU and compute
#: instances: 2 s assumed per GPU; DCGM's hierarchy is reported stale for 1-2 s after a create, NVIDIA
#: DCGM issue 230; not measured here, no machine may create instances), the new ids re-advertised
#: (ListAndWatch at once; kubelet posts allocatable on its node-status sync, every 10 s by default,
#: 5 s on average, needed only when the slice count grows), then kube-scheduler's retry of the
#: unschedulable pod on the node update (its backoff, 1 s initially). 1 + 1 + 2 + 5 + 1 = 10 s.
RECUT_WAIT_S = 10.0


def dynamic_products(mode: LayoutMode | None, config: Config | None) -> frozenset[str]:
    """The MIG products whose layouts follow demand: every MIG-capable one for ``dynamic``, none for
    ``static``, and with no flag what the config says (``migLayouts.<product>.dynamic``)."""
    if mode == "dynamic":
        return frozenset(p.name for p in PRODUCTS.values() if p.mig_capable)
    if mode == "static" or config is None:
        return frozenset()
    return config.dynamic_mig_products()


def physical_slices(inventories: Iterable[NodeInventory], dynamic: frozenset[str]) -> int:
    """Capacity in slices when MIG GPUs of ``dynamic`` products can be cut into every compute slice:
    those count their product's compute slices, every other GPU what it advertises now."""
    total = 0
    for inv in inventories:
        for g in inv.gpus:
            if g.mode == "mig" and g.product in dynamic:
                total += PRODUCTS[g.product].compute_slices
            else:
                total += g.slices
    return total


@dataclass(slots=True)
class DynamicLayouts:
    """Re-cuts for one replay: plan with the core, apply to ``state``, count."""

    state: ClusterState
    slots: dict[int, Slot]
    planner: LayoutPlanner
    wait_s: float = RECUT_WAIT_S
    recuts: int = 0
    created: int = 0
    destroyed: int = 0
    busy_refused: int = 0  # re-cuts refused because an instance to destroy was held: must stay 0
    _serial: int = 0
    in_flight: dict[str, float] = field(default_factory=dict)  # GPU uuid -> when its re-cut is done

    @classmethod
    def build(cls, state: ClusterState, inventories: Mapping[str, NodeInventory], products: frozenset[str], *,
              memory_tolerance: float, wait_s: float = RECUT_WAIT_S) -> DynamicLayouts:
        slots = slots_from_inventories(state, {n: inv.gpus for n, inv in inventories.items()})
        return cls(state, slots, LayoutPlanner(products, memory_tolerance=memory_tolerance), wait_s)

    def observe(self, req: PackRequest) -> None:
        self.planner.observe(req)

    def instance_order(self, state: ClusterState, req: PackRequest, cands: Candidates) -> NDArray[np.float64] | None:
        """The scheduler's tie-break among MIG instances (:meth:`LayoutPlanner.instance_order`)."""
        return self.planner.instance_order(state, self.slots, req, cands)

    def recut_for(self, req: PackRequest, now: float = 0.0, *, nodes: NDArray[np.bool_] | None = None) -> Recut | None:
        """Plan and apply the re-cut that lets ``req`` in (None: no GPU's free slots can hold it)."""
        busy = [g for g, t in self.in_flight.items() if t > now]
        recut = self.planner.for_pending(self.state, self.slots, req, nodes=nodes, exclude=busy)
        if recut is None or not self.apply(recut):
            return None
        self.in_flight[recut.gpu] = now + self.wait_s
        return recut

    def apply(self, recut: Recut) -> bool:
        """Carry out one re-cut on the state; False (and counted) when an instance to destroy is held."""
        st = self.state
        v = st.node_index[recut.node]
        rows = [u for u in st.node_rows(v).tolist()
                if int(st.unit_gpu_index[u]) == recut.gpu_index and int(st.unit_kind[u]) == KIND_MIG]
        by_key = {st.unit_instance[u] or str(u): u for u in rows}
        retire = [by_key[k] for k in recut.destroy]
        if any(int(st.unit_free[u]) != int(st.unit_cap[u]) for u in retire):
            self.busy_refused += 1
            return False
        prod = PRODUCTS[recut.product]
        units = []
        for profile, start in recut.create:
            p = prod.profile(profile)
            self._serial += 1
            units.append(UnitSpec(v, recut.gpu_index, KIND_MIG, p.compute_slices, p.memory_mib, gpu=recut.gpu,
                                  instance=f"{recut.gpu}/{profile}@{start}#{self._serial}"))
        try:
            new = st.recut_gpu(v, recut.gpu_index, retire, units)
        except GpuSliceError:
            self.busy_refused += 1
            return False
        for u in retire:
            self.slots.pop(u, None)
        for u, slot in zip(new, recut.create, strict=True):
            self.slots[u] = slot
        self.recuts += 1
        self.created += len(new)
        self.destroyed += len(retire)
        return True

    def summary(self) -> dict[str, int]:
        return {"recuts": self.recuts, "instances_created": self.created, "instances_destroyed": self.destroyed,
                "busy_instances_destroyed": self.busy_refused}
