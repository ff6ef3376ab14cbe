"""The extender's MIG layout publisher: a refused pod gets a re-cut written to its Node; once the plugin's
inventory shows it, the new instance is reserved for that pod and the next filter places it there."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from extender import wire
from extender.lease import Fence
from gpuslice import annotations as ann
from gpuslice.catalogue import PRODUCTS
from gpuslice.config import load_config
from gpuslice.layoutwire import LAYOUT_KEY, STATUS_KEY, GpuResult, LayoutResults, decode_wanted, encode_results
from gpuslice.model import Gpu, MigInstance
from tests.extender.test_app import NOW, Clock, node_obj, pod_obj, static_extender

H100 = "H100-80GB"
DYNAMIC = load_config({"version": "v1", "migLayouts": {H100: {"dynamic": True}}})


def mig_gpu(node: str, layout: list[tuple[str, int]], tag: str = "") -> Gpu:
    prod = PRODUCTS[H100]
    insts = tuple(MigInstance(f"MIG-{node}-{p}-{s}{tag}", p, s, prod.profile(p).compute_slices,
                              prod.profile(p).memory_mib) for p, s in layout)
    return Gpu(f"GPU-{node}-0", 0, H100, prod.memory_mib or 0, "mig", sum(i.compute_slices for i in insts),
               instances=insts)


SEVEN = [("1g.10gb", s) for s in range(7)]


def cluster() -> list[dict[str, Any]]:
    g = mig_gpu("gpu-a", SEVEN)
    used = g.instances[0]
    return [node_obj("gpu-a", [g]), node_obj("gpu-b", [mig_gpu("gpu-b", SEVEN)]),
            pod_obj("small", 1, node="gpu-a", assigned=list(used.slice_ids()))]


def _mig_pod(name: str, slices: int) -> dict[str, Any]:
    pod = pod_obj(name, slices)
    pod["metadata"]["annotations"]["example.com/gpu-isolation"] = "mig"
    return pod


def test_refused_pod_gets_a_recut_then_the_new_instance_reserved_and_placed() -> None:
    clock = Clock()
    ext = static_extender(cluster(), config=DYNAMIC, clock=clock)
    written: dict[str, str] = {}
    ext.layouts.write = lambda node, value: written.__setitem__(node, value)
    pod = _mig_pod("big", 3)
    res = ext.filter(wire.ExtenderArgs(pod, node_names=("gpu-a",)))
    assert not res.node_names and "gpu-a" in {**res.failed, **res.failed_unresolvable}
    (recut,) = ext.layouts.step(clock())
    assert recut.node == "gpu-a" and recut.pod == "uid-big" and recut.target == ("3g.40gb", 4)
    wanted = decode_wanted(written["gpu-a"])
    (g,) = wanted.gpus
    assert wanted.generation == 1 and g.uuid == "GPU-gpu-a-0" and g.pods == ("uid-big",)
    assert g.instances == (*(("1g.10gb", s) for s in range(4)), ("3g.40gb", 4))
    assert ext.layouts.step(clock()) == []  # in flight: not planned twice
    # The plugin applied it: the node's inventory now has the 3g (the used 1g kept, new instance new UUID).
    old = mig_gpu("gpu-a", SEVEN)
    insts = (*old.instances[:4], MigInstance("MIG-new-3g", "3g.40gb", 4, 3, 40448))
    node = node_obj("gpu-a", [Gpu(old.uuid, 0, H100, old.memory_mib, "mig", 7, instances=insts)])
    node["metadata"]["annotations"][LAYOUT_KEY] = written["gpu-a"]
    node["metadata"]["annotations"][STATUS_KEY] = encode_results(LayoutResults(
        1, datetime.fromtimestamp(NOW, UTC), (GpuResult("GPU-gpu-a-0", "applied", "ok"),)))
    ext.on_event("Node", "MODIFIED", node)
    clock.now += 2
    assert ext.layouts.step(clock()) == []
    assert "MIG-new-3g::0" in {sid for sid, uid in ext.view.nodes["gpu-a"].held.items() if uid == "uid-big"}
    # Another pod cannot take it meanwhile; the pod itself, filtered again, gets it.
    other = ext.filter(wire.ExtenderArgs(_mig_pod("other", 3), node_names=("gpu-a",)))
    assert not other.node_names
    again = ext.filter(wire.ExtenderArgs(pod, node_names=("gpu-a",)))
    assert again.node_names == ("gpu-a",)
    held = ext.view.reservations.get("uid-big")
    assert held is not None and held.units == (("GPU-gpu-a-0", "MIG-new-3g"),)


def test_only_the_nodes_offered_are_recut_and_a_refusal_frees_the_gpu() -> None:
    clock = Clock()
    ext = static_extender(cluster(), config=DYNAMIC, clock=clock)
    written: dict[str, str] = {}
    ext.layouts.write = lambda node, value: written.__setitem__(node, value)
    ext.filter(wire.ExtenderArgs(_mig_pod("big", 3), node_names=("gpu-b",)))
    (recut,) = ext.layouts.step(clock())
    assert recut.node == "gpu-b" and list(written) == ["gpu-b"]
    node = node_obj("gpu-b", [mig_gpu("gpu-b", SEVEN)])
    node["metadata"]["annotations"][STATUS_KEY] = encode_results(LayoutResults(
        1, datetime.fromtimestamp(NOW, UTC), (GpuResult("GPU-gpu-b-0", "refused", "holds a pod"),)))
    ext.on_event("Node", "MODIFIED", node)
    ext.layouts.step(clock())  # settles the refusal, then plans again with generation 2
    assert decode_wanted(written["gpu-b"]).generation == 2
    assert any("refused: holds a pod" in o for o in ext.layouts.outcomes)


def test_static_config_plans_nothing_and_a_follower_writes_nothing() -> None:
    ext = static_extender(cluster(), clock=Clock())
    assert not ext.layouts.active
    ext.filter(wire.ExtenderArgs(_mig_pod("big", 3), node_names=("gpu-a",)))
    assert ext.layouts.step(NOW) == [] and not ext.layouts.refused

    class Follower(Fence):
        def holds(self, now: datetime | None = None) -> bool:
            return False

    ext2 = static_extender(cluster(), config=DYNAMIC, clock=Clock())
    ext2.fence = Follower(None, "me", enabled=False)
    ext2.filter(wire.ExtenderArgs(_mig_pod("big", 3), node_names=("gpu-a",)))
    assert ext2.layouts.step(NOW) == []


def test_status_lists_wanted_and_actual_layouts() -> None:
    clock = Clock()
    ext = static_extender(cluster(), config=DYNAMIC, clock=clock)
    written: dict[str, str] = {}
    ext.layouts.write = lambda node, value: written.__setitem__(node, value)
    ext.filter(wire.ExtenderArgs(_mig_pod("big", 3), node_names=("gpu-a",)))
    ext.layouts.step(clock())
    node = node_obj("gpu-a", [mig_gpu("gpu-a", SEVEN)])
    node["metadata"]["annotations"][LAYOUT_KEY] = written["gpu-a"]
    ext.on_event("Node", "MODIFIED", node)
    rows = {r.node: r for r in ext.layouts.status()}
    assert rows["gpu-a"].wanted is not None and rows["gpu-a"].wanted[-1] == ("3g.40gb", 4)
    assert "has not answered" in rows["gpu-a"].pending and rows["gpu-b"].wanted is None
    assert json.loads(written["gpu-a"])["v"] == ann.VERSION


def test_the_filter_picks_the_free_instance_that_keeps_free_slots_usable() -> None:
    g = mig_gpu("gpu-a", SEVEN)
    busy = g.instances[4]  # 1g@4: the 4-7 half is broken, the 0-3 half is not
    items = [node_obj("gpu-a", [g]), pod_obj("small", 1, node="gpu-a", assigned=list(busy.slice_ids()))]
    picked = {}
    for config in (DYNAMIC, None):
        ext = static_extender(items, config=config, clock=Clock())
        for n, k in enumerate([3, 4, 3]):  # the learned demand also asks bigger instances
            ext.sched.observe(ext.sched.request_of(_mig_pod(f"o{n}", k))[1])  # type: ignore[arg-type]
            ext.layouts.observe(ext.sched.request_of(_mig_pod(f"o{n}", k))[1])  # type: ignore[arg-type]
        res = ext.filter(wire.ExtenderArgs(_mig_pod("one", 1), node_names=("gpu-a",)))
        assert res.node_names == ("gpu-a",)
        held = ext.view.reservations.get("uid-one")
        assert held is not None
        picked[config is not None] = next(i.start for i in g.instances if i.uuid == held.units[0][1])
    assert picked[False] == 0 and picked[True] in (5, 6)
