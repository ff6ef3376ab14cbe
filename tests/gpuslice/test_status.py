"""The operator's view (gpuslice.status): holders, free and stranded slices, disagreements, and each
Pending pod's reason with the smallest change that lets it in, each checked against the decision API
it must agree with (applying a suggestion must make the filter pass)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from gpuslice.remedies import fitting_products, fitting_profile
from gpuslice.scheduler import Scheduler
from gpuslice.status import ClusterStatus, build_status
from gpuslice.view import ClusterView

from .test_view import (
    A_LAYOUT,
    NOW,
    S,
    gpu_uuid,
    mig_gpu,
    mps_gpu,
    node_obj,
    pod_obj,
    sids,
    whole_gpu,
)


def status_of(objects: list[dict[str, Any]]) -> tuple[ClusterView, Scheduler, ClusterStatus]:
    view = ClusterView.from_objects(objects, NOW)
    sched = Scheduler.from_config(view)
    return view, sched, build_status(view, sched, NOW)


def units(st: ClusterStatus) -> dict[str, Any]:
    return {u.uuid: u for n in st.nodes for g in n.gpus for u in g.units}


def test_holders_free_and_totals_follow_the_counting_rule() -> None:
    mps, mig, whole = mps_gpu("n1", 0), mig_gpu("n1", 1, A_LAYOUT), whole_gpu("n1", 2)
    three_g = mig.instances[0]
    objs = [node_obj("n1", [mps, mig, whole]),
            pod_obj("a", 3, node="n1", assigned=sids(mps.uuid, 3), allocated=sids(mps.uuid, 3)),
            pod_obj("b", 3, node="n1", assigned=sids(three_g.uuid, 3))]
    _, _, st = status_of(objs)
    (node,) = st.nodes
    assert [(g.index, g.mode, g.product) for g in node.gpus] == [(0, "mps", "H100-80GB"), (1, "mig", "H100-80GB"),
                                                                 (2, "whole", "H100-80GB")]
    u = units(st)
    assert u[mps.uuid].free == S - 3
    (holder,) = u[mps.uuid].holders
    assert (holder.pod, holder.slices, holder.source) == ("ns/pod-a", 3, "allocated")
    assert u[three_g.uuid].free == 0 and u[three_g.uuid].holders[0].source == "assignment"
    assert u[three_g.uuid].profile == "3g.40gb" and u[three_g.uuid].start == 0
    assert u[whole.uuid].free == S and u[whole.uuid].holders == ()
    cap = st.capacity
    assert (cap.gpus, cap.slices, cap.held) == (3, S + 6 + S, 6)
    assert cap.free == (S - 3) + 3 + S and cap.unavailable == 0
    assert st.pending == () and st.disagreements == ()
    json.dumps(st.to_dict())  # plain data all the way down


def test_free_slices_that_no_shape_can_use_are_stranded() -> None:
    """Every pod here asks 2 MIG slices: the idle 1g instance can never take one, the 2g can."""
    mig = mig_gpu("n1", 0, A_LAYOUT)  # 3g, 2g, 1g
    two_g = next(i for i in mig.instances if i.profile == "2g.20gb")
    three_g = next(i for i in mig.instances if i.profile == "3g.40gb")
    objs = [node_obj("n1", [mig]),
            pod_obj("a", 3, node="n1", assigned=sids(three_g.uuid, 3), isolation="mig"),
            pod_obj("p", 2, isolation="mig")]  # Pending shape: 2 slices
    _, _, st = status_of(objs)
    u = units(st)
    one_g = next(x for x in u.values() if x.profile == "1g.10gb")
    assert one_g.free == 1 and one_g.stranded == 1
    assert u[two_g.uuid].free == 2 and u[two_g.uuid].stranded == 0
    assert st.capacity.stranded == 1 and st.capacity.free == 3 and st.capacity.shapes == 2


def test_nothing_is_called_stranded_when_no_shape_is_known() -> None:
    _, _, st = status_of([node_obj("n1", [mps_gpu("n1", 0)])])
    assert st.capacity.free == S and st.capacity.stranded == 0 and st.capacity.shapes == 0


def test_a_cordoned_gpu_is_unavailable_not_free() -> None:
    g = mps_gpu("n1", 0)
    _, _, st = status_of([node_obj("n1", [g, mps_gpu("n1", 1)], cordon=[g.uuid])])
    assert st.capacity.free == S and st.capacity.unavailable == S
    assert next(x for x in st.nodes[0].gpus if x.uuid == g.uuid).cordoned


def test_assignment_and_allocated_that_disagree_are_listed() -> None:
    g = mps_gpu("n1", 0)
    objs = [node_obj("n1", [g]), pod_obj("a", 2, node="n1", assigned=sids(g.uuid, 2), allocated=sids(g.uuid, 2, 3))]
    _, _, st = status_of(objs)
    (d,) = st.disagreements
    assert (d.pod, d.node) == ("ns/pod-a", "n1")
    assert d.assigned == sids(g.uuid, 2) and d.allocated == sids(g.uuid, 2, 3)


def test_a_seven_slice_pod_beside_an_idle_mig_gpu_is_told_to_recut_it() -> None:
    """The issue's case: the MPS GPU is busy, the MIG GPU idle without a 7g instance."""
    mps, mig = mps_gpu("n1", 0), mig_gpu("n1", 1, A_LAYOUT)
    objs = [node_obj("n1", [mps, mig]), pod_obj("a", 4, node="n1", assigned=sids(mps.uuid, 4)), pod_obj("big", 7)]
    _, _, st = status_of(objs)
    (p,) = st.pending
    assert p.pod == "ns/pod-big" and p.slices == 7
    assert "no MIG instance here has 7 compute slices" in p.reason and not p.reason.startswith("slices in use")
    first = p.suggestions[0]
    assert (first.kind, first.node, first.gpu, first.profile) == ("recut", "n1", mig.uuid, "7g.80gb")
    assert first.text.startswith(f"re-cut idle MIG GPU 1 ({mig.uuid}) on node n1")
    assert any(s.kind == "add-node" and s.product == "H100-80GB" for s in p.suggestions)


def test_free_slots_of_a_partly_used_mig_gpu_are_suggested_for_a_recut() -> None:
    """Seven 1g instances, one held: a 3-slice MIG pod is told to re-cut three free 1g into a 3g,
    by the extender's own planner, and the held instance is neither destroyed nor re-used."""
    seven = tuple(("1g.10gb", i) for i in range(7))
    mig = mig_gpu("n1", 0, seven)
    used = mig.instances[0]
    objs = [node_obj("n1", [mig]), pod_obj("a", 1, node="n1", assigned=sids(used.uuid, 1), isolation="mig"),
            pod_obj("three", 3, isolation="mig")]
    _, _, st = status_of(objs)
    (p,) = st.pending
    first = p.suggestions[0]
    assert (first.kind, first.node, first.gpu, first.profile) == ("recut", "n1", mig.uuid, "3g.40gb")
    assert first.text.startswith(f"re-cut the free MIG slots of GPU 0 ({mig.uuid}) on node n1")
    assert first.text.endswith("to include a 3g.40gb instance: destroy 3 free instances, create 3g.40gb")
    assert used.uuid not in first.text


def test_a_suggested_recut_applied_lets_the_pod_in() -> None:
    """The layout the suggestion names, given to the GPU as the device plugin would cut it, makes the
    decision API place the Pending pod there, and the held instance keeps its pod."""
    seven = tuple(("1g.10gb", i) for i in range(7))
    mig = mig_gpu("n1", 0, seven)
    used = mig.instances[0]
    held = pod_obj("a", 1, node="n1", assigned=sids(used.uuid, 1), isolation="mig")
    pending = pod_obj("three", 3, isolation="mig")
    _, sched, st = status_of([node_obj("n1", [mig]), held, pending])
    assert sched.filter(pending, ["n1"], NOW).feasible == ()
    cut = st.pending[0].suggestions[0]
    assert cut.kind == "recut" and ("1g.10gb", 0) in cut.layout
    kept = {(i.profile, i.start) for i in mig.instances}
    recut = mig_gpu("n1", 0, cut.layout, tag="r")  # new instances get new UUIDs; the kept one its old
    recut = replace(recut, instances=tuple(
        next(i for i in mig.instances if (i.profile, i.start) == (j.profile, j.start)) if (j.profile, j.start) in kept
        else j for j in recut.instances))
    assert used in recut.instances
    _, sched2, st2 = status_of([node_obj("n1", [recut]), held, pending])
    assert sched2.filter(pending, ["n1"], NOW).feasible == ("n1",)
    assert st2.pending[0].cause == "fits"


def test_a_suggested_eviction_applied_lets_the_pod_in() -> None:
    """Two MPS GPUs, each 5 of 7 slices taken by priority-0 pods; an urgent 4-slice pod. The status
    names the fewest victims; taking them out makes the scheduler's own filter pass."""
    g0, g1 = mps_gpu("n1", 0), mps_gpu("n2", 0)
    objs = [node_obj("n1", [g0]), node_obj("n2", [g1]),
            pod_obj("a", 3, node="n1", assigned=sids(g0.uuid, 3), priority=0),
            pod_obj("b", 2, node="n1", assigned=sids(g0.uuid, 2, 3), priority=0),
            pod_obj("c", 5, node="n2", assigned=sids(g1.uuid, 5), priority=0),
            pod_obj("urgent", 4, priority=100)]
    view, sched, st = status_of(objs)
    (p,) = st.pending
    evict = next(s for s in p.suggestions if s.kind == "evict")
    assert len(evict.uids) == 1 and evict.node in ("n1", "n2")
    assert "priority 0" in evict.text
    assert sched.filter(pod_obj("urgent", 4, priority=100), ["n1", "n2"], NOW).feasible == ()
    for uid in evict.uids:
        view.remove_pod(uid)
    res = sched.filter(pod_obj("urgent", 4, priority=100), ["n1", "n2"], NOW)
    assert res.feasible == (evict.node,)


def test_equal_priorities_get_no_eviction_and_an_oversized_floor_gets_a_bigger_product() -> None:
    g = mps_gpu("n1", 0)
    objs = [node_obj("n1", [g]), pod_obj("a", 7, node="n1", assigned=sids(g.uuid, 7)),
            pod_obj("big", 7, gpu_memory="120Gi")]
    _, _, st = status_of(objs)
    (p,) = st.pending
    kinds = [s.kind for s in p.suggestions]
    assert "evict" not in kinds and "recut" not in kinds
    (add,) = p.suggestions
    assert add.product == "H200-141GB" and "H200-141GB" in add.text
    assert p.memory == "120.00 GiB"


def test_a_bad_request_is_pending_with_its_error_and_a_fix() -> None:
    bad = pod_obj("bad", 2, annotations={"example.com/gpu-isolation": "secure"})
    _, _, st = status_of([node_obj("n1", [mps_gpu("n1", 0)]), bad])
    (p,) = st.pending
    assert "must be one of mig, mps, any" in p.reason
    assert [s.kind for s in p.suggestions] == ["fix"]


def test_a_pod_that_fits_now_is_said_to_fit() -> None:
    _, _, st = status_of([node_obj("n1", [mps_gpu("n1", 0)]), pod_obj("p", 2)])
    (p,) = st.pending
    assert p.reason.startswith("fits on 1 node(s) now") and p.suggestions == ()


def test_remedies_pick_real_profiles_and_products() -> None:
    assert fitting_profile("H100-80GB", 1, 15 * 1024, 0.03) is not None
    assert fitting_profile("H100-80GB", 1, 15 * 1024, 0.03).name == "1g.20gb"  # type: ignore[union-attr]
    assert fitting_profile("H100-80GB", 1, 0, 0.03).name == "1g.10gb"  # type: ignore[union-attr]
    assert fitting_profile("H100-80GB", 5, 0, 0.03) is None  # no 5g profile
    assert fitting_profile("L4", 1, 0, 0.03) is None
    from gpuslice.packing.state import PackRequest

    req = PackRequest(gpus=2, slices=S, gpu_memory_mib=40 * 1024, isolation="any")
    names = [f.product for f in fitting_products(req, S, 0.03, frozenset({"A100-80GB"}))]
    assert names[0] == "A100-80GB" and "L4" not in names and "L40S" in names
    mig_only = PackRequest(gpus=1, slices=3, isolation="mig")
    assert {f.mode for f in fitting_products(mig_only, S, 0.03)} == {"mig"}
    assert gpu_uuid("n", 0)  # the helpers are shared with the view tests


def test_a_live_build_holds_the_lock_one_step_at_a_time() -> None:
    """The slice map passes the extender's lock as ``hold``: each step takes it on its own (never nested,
    never the whole build), and a pod deleted between the scan and its own step is left out."""
    mps = mps_gpu("n1", 0)
    objs = [node_obj("n1", [mps]), node_obj("n2", [mps_gpu("n2", 0)]),
            pod_obj("a", 3, node="n1", assigned=sids(mps.uuid, 3)),
            pod_obj("p", 2 * S), pod_obj("q", 2 * S)]  # two Pending pods asking two whole GPUs: none here
    view = ClusterView.from_objects(objs, NOW)
    sched = Scheduler.from_config(view)
    entries: list[int] = []
    depth = [0]
    delete_at = [0]

    class Hold:
        def __enter__(self) -> None:
            assert depth[0] == 0, "a step nested in another one"
            depth[0] += 1
            entries.append(1)
            if len(entries) == delete_at[0]:
                view.remove_pod("q")

        def __exit__(self, *exc: object) -> None:
            depth[0] -= 1

    whole = build_status(view, sched, NOW, hold=Hold)
    steps = len(entries)
    # the scan, one per shape (3 and 2*S slices) and the row count, one per node, the alive count, one per
    # Pending pod, the problems
    assert steps == 1 + 2 + 1 + 2 + 1 + 2 + 1
    assert [p.pod for p in whole.pending] == ["ns/pod-p", "ns/pod-q"]
    entries.clear()
    delete_at[0] = steps - 2  # p's step (Pending pods go p, q, then the problems): q goes before its own
    st = build_status(view, sched, NOW, hold=Hold)
    assert [p.pod for p in st.pending] == ["ns/pod-p"]
    assert [n.name for n in st.nodes] == ["n1", "n2"]
