"""The re-cut decision (gpuslice.miglayout): geometry against the catalogue, safety, triggers, margin."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice.catalogue import PRODUCTS
from gpuslice.errors import CatalogueError
from gpuslice.fakecluster import random_mig_layout
from gpuslice.miglayout import (
    DEFAULT_MARGIN,
    DemandShape,
    GpuLayout,
    Held,
    LayoutPlanner,
    dynamic_fragment,
    fills,
    gpu_layouts,
    layout_status,
    legal,
    slots_from_inventories,
    static_fragment,
)
from gpuslice.model import Gpu, MigInstance, NodeInventory, validate_mig_layout
from gpuslice.packing.build import state_from_inventories
from gpuslice.packing.state import KIND_MIG, NodeSpec, PackRequest, UnitSpec

H100 = "H100-80GB"


def _valid(product: str, layout: tuple[tuple[str, int], ...]) -> bool:
    prod = PRODUCTS[product]
    try:
        validate_mig_layout(product, [MigInstance(f"MIG-{n}", p, s, prod.profile(p).compute_slices, 1)
                                      for n, (p, s) in enumerate(layout)], where="t")
    except CatalogueError:
        return False
    return True


def test_fills_of_an_empty_gpu_are_exactly_the_legal_layouts_without_media_extensions() -> None:
    # Brute force over every set of (profile, start) a re-cut may create, checked by the catalogue's rule.
    for product in ("H100-80GB", "A30-24GB"):
        prod = PRODUCTS[product]
        slots = [(p.name, s) for p in prod.mig_profiles if not p.name.endswith("+me") for s in p.starts]
        legal_sets = set()
        for n in range(0, 8):
            for combo in itertools.combinations(slots, n):
                if _valid(product, tuple(sorted(combo))):
                    legal_sets.add(frozenset(combo))
        assert {frozenset(f) for f in fills(product, ())} == legal_sets


def _node(layout: tuple[tuple[str, int], ...], *, busy: tuple[int, ...] = (), name: str = "n1",
          gpus: int = 1) -> tuple[NodeSpec, NodeInventory]:
    prod = PRODUCTS[H100]
    out = []
    for g in range(gpus):
        insts = tuple(MigInstance(f"MIG-{name}-{g}-{p}-{s}", p, s, prod.profile(p).compute_slices,
                                  prod.profile(p).memory_mib) for p, s in layout)
        out.append(Gpu(f"GPU-{name}-{g}", g, H100, 81559, "mig", sum(i.compute_slices for i in insts),
                       instances=insts))
    inv = NodeInventory(name, tuple(out))
    used = [sid for i, inst in enumerate(out[0].instances) if i in busy for sid in inst.slice_ids()]
    return NodeSpec(name, 96_000, 1 << 20, H100), inv.with_used(used)


SEVEN_1G = tuple(("1g.10gb", i) for i in range(7))


def _state(*nodes: tuple[NodeSpec, NodeInventory]):  # type: ignore[no-untyped-def]
    st = state_from_inventories(list(nodes), slices_per_gpu=7)
    slots = slots_from_inventories(st, {spec.name: inv.gpus for spec, inv in nodes})
    return st, slots


def test_a_3g_pod_on_seven_1g_with_one_in_use_destroys_three_free_1g_and_keeps_the_used_one() -> None:
    st, slots = _state(_node(SEVEN_1G, busy=(0,)))
    planner = LayoutPlanner(frozenset({H100}))
    recut = planner.for_pending(st, slots, PackRequest(cpu_milli=1000, gpus=1, slices=3, uid="p"))
    assert recut is not None
    assert recut.target == ("3g.40gb", 4) and recut.pod == "p"
    assert sorted(recut.destroy) == [f"MIG-n1-0-1g.10gb-{s}" for s in (4, 5, 6)]
    assert ("1g.10gb", 0) in recut.wanted and legal(H100, recut.wanted)
    assert recut.create == (("3g.40gb", 4),)


def test_no_recut_when_only_busy_instances_are_in_the_way() -> None:
    st, slots = _state(_node(SEVEN_1G, busy=(1, 5)))  # a 3g needs 0-3 or 4-7: both hold a busy 1g
    assert LayoutPlanner(frozenset({H100})).for_pending(st, slots, PackRequest(gpus=1, slices=3)) is None


def test_static_products_are_never_recut() -> None:
    st, slots = _state(_node(SEVEN_1G))
    assert LayoutPlanner(frozenset()).for_pending(st, slots, PackRequest(gpus=1, slices=3)) is None
    assert LayoutPlanner(frozenset({"A100-80GB"})).for_pending(st, slots, PackRequest(gpus=1, slices=3)) is None


def test_owner_spread_cpu_isolation_and_nodes_are_respected() -> None:
    st, slots = _state(_node(SEVEN_1G))
    planner = LayoutPlanner(frozenset({H100}))
    st.take(0, [0], 1, 1000, 0, owner="rs-a")  # a pod of rs-a holds the GPU's first 1g
    assert planner.for_pending(st, slots, PackRequest(gpus=1, slices=3, owner="rs-a")) is None
    assert planner.for_pending(st, slots, PackRequest(gpus=1, slices=3, owner="rs-b")) is not None
    assert planner.for_pending(st, slots, PackRequest(gpus=1, slices=3, cpu_milli=500_000)) is None
    assert planner.for_pending(st, slots, PackRequest(gpus=1, slices=3, isolation="mps")) is None
    assert planner.for_pending(st, slots, PackRequest(gpus=1, slices=3), nodes=st.node_alive & False) is None


def test_a_memory_floor_picks_the_profile_that_meets_it() -> None:
    st, slots = _state(_node(SEVEN_1G))
    recut = LayoutPlanner(frozenset({H100})).for_pending(st, slots, PackRequest(gpus=1, slices=1,
                                                                                 gpu_memory_mib=19 * 1024))
    assert recut is not None and recut.target is not None and recut.target[0] == "1g.20gb"
    assert LayoutPlanner(frozenset({H100})).for_pending(st, slots, PackRequest(gpus=1, slices=1,
                                                                                gpu_memory_mib=30 * 1024)) is None


def test_the_gpu_already_in_use_is_preferred_when_fragment_ties() -> None:
    idle = _node(SEVEN_1G, name="a")
    used = _node(SEVEN_1G, busy=(0,), name="b")
    st, slots = _state(idle, used)
    recut = LayoutPlanner(frozenset({H100})).for_pending(st, slots, PackRequest(gpus=1, slices=3, uid="p"))
    assert recut is not None and recut.node == "b"


def test_a_whole_gpu_pod_gets_a_7g_made_of_seven_free_1g() -> None:
    st, slots = _state(_node(SEVEN_1G))
    planner = LayoutPlanner(frozenset({H100}))
    for n in range(20):
        planner.observe(PackRequest(gpus=1, slices=1, uid=f"o{n}"))
    recut = planner.for_pending(st, slots, PackRequest(gpus=1, slices=7, uid="big"))
    assert recut is not None and recut.wanted == (("7g.80gb", 0),) and len(recut.destroy) == 7


def test_the_rest_of_the_freed_slots_is_filled_for_the_learned_demand() -> None:
    # On an idle GPU with one 7g, a 3g pod takes 3g@0 or 3g@4 and the other half is filled with what the
    # learned demand asks most: here 1g pods, so four 1g instances (one more compute slice than a 3g).
    st, slots = _state(_node((("7g.80gb", 0),)))
    planner = LayoutPlanner(frozenset({H100}))
    for n in range(20):
        planner.observe(PackRequest(gpus=1, slices=1, uid=f"o{n}"))
    recut = planner.for_pending(st, slots, PackRequest(gpus=1, slices=3, uid="p"))
    assert recut is not None and recut.target is not None
    rest = [s for s in recut.wanted if s != recut.target]
    assert len(rest) == 4 and all(p == "1g.10gb" for p, _ in rest)


def test_fragment_measures_follow_the_definitions() -> None:
    half = (DemandShape(0.5, 1, 0, "any", None), DemandShape(0.5, 3, 0, "any", None))
    # Empty H100: 1g pods use all 7 slices; 3g pods at most two (6), one slice idle for them.
    assert dynamic_fragment(H100, (), half) == 0.5
    # With 3g@4 busy, 4 slices are idle: four 1g, or one 3g (one idle): still 0.5.
    assert dynamic_fragment(H100, (("3g.40gb", 4),), half) == 0.5
    # Static: seven free 1g are fragment for the 3g pods only.
    assert static_fragment(H100, [(s, False) for s in SEVEN_1G], half) == 3.5
    # A lone free 3g@0 leaves 4 compute slices uncovered (fragment for all) plus 3 for the 1g pods.
    assert static_fragment(H100, [(("3g.40gb", 0), False)], half) == 4 + 0.5 * 3


def test_proactive_recut_needs_more_than_the_margin_and_does_not_flap() -> None:
    planner = LayoutPlanner(frozenset({H100}))
    for n in range(16):
        planner.observe(PackRequest(gpus=1, slices=3, uid=f"o{n}"))
    st, slots = _state(_node(SEVEN_1G))
    (recut,) = planner.proactive(st, slots)
    assert recut.gain > DEFAULT_MARGIN and sorted(recut.wanted) == [("3g.40gb", 0), ("3g.40gb", 4)]
    st2, slots2 = _state(_node(recut.wanted))
    assert planner.proactive(st2, slots2) == []  # at the best layout: no re-cut back


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([1, 2, 3, 4, 7]), st.integers(0, 40))
def test_a_recut_never_destroys_a_busy_instance_and_is_always_legal(seed: int, k: int, floor_gib: int) -> None:
    rng = random.Random(seed)
    layout = tuple((p.name, s) for p, s in random_mig_layout(PRODUCTS[H100], rng))
    busy = tuple(i for i in range(len(layout)) if rng.random() < 0.4)
    st, slots = _state(_node(layout, busy=busy))
    recut = LayoutPlanner(frozenset({H100})).for_pending(
        st, slots, PackRequest(gpus=1, slices=k, gpu_memory_mib=floor_gib * 1024))
    if recut is None:
        return
    busy_slots = {layout[i] for i in busy}
    busy_keys = {f"MIG-n1-0-{p}-{s}" for p, s in busy_slots}
    assert not busy_keys & set(recut.destroy)
    assert busy_slots <= set(recut.wanted)
    assert legal(H100, recut.wanted)
    prof = PRODUCTS[H100].profile(recut.target[0]) if recut.target else None
    assert prof is not None and prof.compute_slices == k and prof.memory_mib >= floor_gib * 1024 * 0.97


def test_recut_gpu_keeps_every_other_row_and_refuses_a_held_unit() -> None:
    spec, inv = _node(SEVEN_1G, busy=(0,), gpus=2)
    st = state_from_inventories([(spec, inv)], slices_per_gpu=7)
    before = st.node_rows(0).tolist()
    total = st.total_slices
    retire = [u for u in before if st.unit_gpu_index[u] == 0 and st.unit_instance[u].endswith(("-4", "-5", "-6"))]
    new = st.recut_gpu(0, 0, retire, [UnitSpec(0, 0, KIND_MIG, 3, 40448, gpu="GPU-n1-0", instance="MIG-new")])
    after = st.node_rows(0).tolist()
    assert set(before) - set(retire) <= set(after) and new[0] in after and len(after) == len(before) - 2
    assert st.total_slices == total and st.allocated_slices == 1
    busy = [u for u in after if st.unit_free[u] < st.unit_cap[u]]
    try:
        st.recut_gpu(0, 0, busy, [])
    except Exception as exc:
        assert "never destroyed" in str(exc)
    else:
        raise AssertionError("a held unit was retired")
    assert len(gpu_layouts(st, {**slots_from_inventories(st, {"n1": inv.gpus}), new[0]: ("3g.40gb", 4)},
                           frozenset({H100}))) == 2


def test_layout_status_says_what_is_wanted_and_why_it_waits() -> None:
    _, inv = _node(SEVEN_1G)
    gpu = inv.gpus[0]
    want = (("1g.10gb", 0), ("1g.10gb", 1), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4))
    (row,) = layout_status({"n1": inv.gpus}, {"n1": {gpu.uuid: want}}, {}, frozenset({H100}))
    assert row.actual == SEVEN_1G and row.wanted == want
    assert "not applied yet" in row.pending and "has not answered" in row.pending
    (row,) = layout_status({"n1": inv.gpus}, {}, {}, frozenset())
    assert row.wanted is None and "static layout" in row.pending
    _ = GpuLayout, Held  # the public types the status code and the services build on


def _node_obj(name: str, inv: NodeInventory, extra: dict[str, str] | None = None) -> dict[str, object]:
    from gpuslice import annotations as ann

    return {"kind": "Node", "metadata": {"name": name, "annotations": {
        ann.INVENTORY_KEY: ann.encode_inventory(inv.gpus), **(extra or {})}},
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi"}}}


def test_status_from_node_objects_and_a_suggested_recut_for_a_pending_pod() -> None:
    from datetime import UTC, datetime

    from gpuslice.layoutwire import LAYOUT_KEY, WantedGpu, WantedLayouts, encode_wanted
    from gpuslice.miglayout import layout_status_of_nodes, suggest_recut
    from gpuslice.view import ClusterView

    _, inv = _node(SEVEN_1G)
    want = (("1g.10gb", 0), ("1g.10gb", 1), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4))
    wish = encode_wanted(WantedLayouts(1, datetime(2025, 1, 1, tzinfo=UTC), (WantedGpu(inv.gpus[0].uuid, want),)))
    rows = layout_status_of_nodes([_node_obj("n1", inv, {LAYOUT_KEY: wish}), {"metadata": {"name": "cpu"}}],
                                  frozenset({H100}))
    assert [(r.node, r.wanted) for r in rows] == [("n1", want)]
    view = ClusterView()
    view.upsert_node(_node_obj("n1", inv))
    recut = suggest_recut(view, PackRequest(gpus=1, slices=3, uid="pending"))
    assert recut is not None and recut.node == "n1" and recut.target is not None and recut.target[0] == "3g.40gb"
    assert suggest_recut(view, PackRequest(gpus=1, slices=3), nodes=["other"]) is None


def test_a_pod_takes_the_free_instance_that_keeps_the_free_slots_usable() -> None:
    # 1g@4 is busy: the 4-7 half cannot hold a 3g or 4g any more, the 0-3 half still can. A 1g pod taking
    # 1g@0 (the first free unit, the policy's tie) would break that half too; 1g@5 or @6 does not.
    from gpuslice.scheduler import PackedCluster, Scheduler

    st, slots = _state(_node(SEVEN_1G, busy=(4,)))
    planner = LayoutPlanner(frozenset({H100}))
    for n, k in enumerate([1, 3, 4, 1, 3, 4, 1, 3]):
        planner.observe(PackRequest(gpus=1, slices=k, uid=f"o{n}"))
    sched = Scheduler(PackedCluster(st), "fragmentation")
    req = PackRequest(gpus=1, slices=1, uid="p")
    plain = sched.rank(req)
    assert slots[int(plain.cands.units[int(plain.best.index[0]), 0])][1] == 0
    sched.instance_order = lambda state, r, cands: planner.instance_order(state, slots, r, cands)
    ordered = sched.rank(req)
    assert slots[int(ordered.cands.units[int(ordered.best.index[0]), 0])][1] in (5, 6)
    assert LayoutPlanner(frozenset()).instance_order(st, slots, req, ordered.cands) is None  # static: untouched


def test_before_orders_by_the_first_key_then_the_second_whatever_their_scales() -> None:
    import numpy as np

    from gpuslice.scheduler import before

    key = before(np.array([0.0, -1e-6, 0.0, 5.0]), np.array([1e9, 3.0, -1e9, 0.0]))
    assert list(np.argsort(-key)) == [3, 0, 2, 1]
