"""The decision API (gpuslice.scheduler): narrowing, prioritize, reservations, bind and the config.

The pod-level methods take pods and node names as the extender receives them; every test builds a
ClusterView from v1 objects (the helpers of test_view) and asks the Scheduler what it would do.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice import annotations as ann
from gpuslice.config import Config, load_config
from gpuslice.counting import placement_from_assignment
from gpuslice.decision import NarrowConfig, NodeBest, narrowed_filter, node_key, priority_scores
from gpuslice.packing.state import KIND_MPS, ClusterState, NodeSpec, PackRequest, UnitSpec
from gpuslice.placement import enumerate_placements, suits
from gpuslice.pods import project
from gpuslice.scheduler import NARROWED_OUT, UNKNOWN_NODE, PackedCluster, Scheduler, pods_as_requests
from gpuslice.view import ClusterView, ViewSettings

from .test_view import (
    A_LAYOUT,
    NOW,
    NOW_DT,
    S,
    assignment_of,
    gpu_uuid,
    mig_gpu,
    mig_uuid,
    mps_gpu,
    node_obj,
    pod_obj,
    sids,
    snapshot,
    unit,
    whole_gpu,
)


def config(**fields: Any) -> Config:
    return load_config({"version": "v1", **fields})


def build(objects: list[dict[str, Any]], *, cfg: Config | None = None, policy: str | None = None,
          margin: float | None = None) -> tuple[ClusterView, Scheduler]:
    view = ClusterView.from_objects(objects, NOW, config=cfg)
    if policy is None and margin is None:
        return view, Scheduler.from_config(view, cfg)
    owner_spread = True if cfg is None else cfg.owner_spread
    return view, Scheduler(view, policy or "fragmentation", narrow=NarrowConfig(margin=margin or 0.0),
                           owner_spread=owner_spread)


def two_nodes() -> tuple[str, str, list[dict[str, Any]]]:
    """``empty`` (an idle MPS GPU) comes first in the consistent node order; ``busy`` (4 of 7 slices
    in use) packs better. Packing policies prefer ``busy``; a wide margin ties them, and then the
    node order picks ``empty``."""
    empty, busy = sorted(["alpha", "beta"], key=node_key)
    g = mps_gpu(busy, 0)
    objs = [node_obj(empty, [mps_gpu(empty, 0)]), node_obj(busy, [g]),
            pod_obj("a", 4, node=busy, assigned=sids(g.uuid, 4), cpu="0")]
    return empty, busy, objs


def test_the_same_node_list_is_looked_up_again_after_nodes_leave_join_or_rebuild() -> None:
    """kube-scheduler repeats one NodeNames list; the kept lookup must follow node removal, a node
    joining under a removed name, and a rebuilt state."""
    empty, busy, objs = two_nodes()
    view, sched = build(objs)
    names = [empty, busy]
    pod = pod_obj("p", 2)
    first = sched.filter(pod, names, NOW)
    assert first.feasible and not first.failed.get(busy, "").startswith("node is not known")
    view.remove_node(busy)
    gone = sched.filter(pod, names, NOW)
    assert gone.failed[busy] == UNKNOWN_NODE and gone.feasible == (empty,)
    assert dict(sched.prioritize(pod, names, NOW))[busy] == 0
    view.upsert_node(objs[1])
    back = sched.filter(pod, names, NOW)
    assert busy not in back.failed or back.failed[busy] != UNKNOWN_NODE
    assert busy in back.feasible + tuple(back.failed)
    view.rebuild()
    again = sched.filter(pod, names, NOW)
    assert UNKNOWN_NODE not in again.failed.values() and len(again.feasible) == 1


# --------------------------------------------------------------------------- narrowing

def test_narrowed_filter_margin_ties_near_best_nodes_and_orders_them_by_key() -> None:
    best = NodeBest(np.array([0, 1, 2], dtype=np.int64), np.array([0, 1, 2], dtype=np.int64),
                    np.array([0.9, 0.85, 0.5]))
    rank = np.array([5, 1, 0], dtype=np.int64)
    assert narrowed_filter(best, rank, NarrowConfig(margin=0.0)).node.tolist() == [0]
    assert narrowed_filter(best, rank, NarrowConfig(margin=0.1)).node.tolist() == [1]
    assert narrowed_filter(best, rank, NarrowConfig(margin=0.5)).node.tolist() == [2]
    assert narrowed_filter(best, rank, NarrowConfig(margin=0.1, max_nodes=3)).node.tolist() == [1, 0]
    assert narrowed_filter(best, rank, NarrowConfig(margin=0.0, max_nodes=3)).node.tolist() == [0]


@pytest.mark.parametrize(("margin", "expect"), [(0.0, "busy"), (0.2, "busy"), (0.3, "empty"), (1.0, "empty")])
def test_margin_changes_the_filter_choice(margin: float, expect: str) -> None:
    empty, busy = sorted(["alpha", "beta"], key=node_key)
    *_, objs = two_nodes()
    view, sched = build(objs, policy="bestfit", margin=margin)  # scores: busy 0.357, empty 0.071
    res = sched.filter(pod_obj("u1", 1, cpu="0"), [busy, empty], NOW)
    chosen = {"busy": busy, "empty": empty}[expect]
    assert res.feasible == (chosen,)
    other = empty if chosen == busy else busy
    assert res.failed == {other: NARROWED_OUT} and res.unresolvable == {}
    assert res.reservation is not None and res.reservation.node == chosen
    assert view.reservations.get("u1") == res.reservation


def test_priority_scores_rank_one_node_alone_at_ten() -> None:
    out = priority_scores(np.array([0.5, 0.9, 0.7]), ranked=True)
    assert out[1] == 10 and max(out[0], out[2]) <= 9 and out[2] > out[0]
    assert priority_scores(np.array([0.5, 0.9, 0.7]), ranked=False).tolist() == [0, 10, 5]
    lead = priority_scores(np.array([0.5, 0.9, 0.7]), ranked=True, lead=2)
    assert lead[2] == 10 and lead[1] <= 9
    tie = priority_scores(np.array([0.4, 0.4]), ranked=True)
    assert sorted(tie.tolist()) == [9, 10]


def test_prioritize_gives_ten_to_the_node_the_filter_reserved() -> None:
    empty, busy, objs = two_nodes()
    view, sched = build(objs, policy="bestfit", margin=1.0)
    pod = pod_obj("u1", 1, cpu="0")
    res = sched.filter(pod, [busy, empty], NOW)
    assert res.feasible == (empty,)  # the lower-scoring node, by the consistent order
    before = snapshot(view)
    got = dict(sched.prioritize(pod, [busy, empty, "ghost"], NOW))
    assert got[empty] == 10 and got[busy] <= 9 and got["ghost"] == 0
    assert snapshot(view) == before  # prioritize leaves the reservation where it was
    # without a reservation the best-scoring node leads
    view2, sched2 = build(objs, policy="bestfit")
    got2 = dict(sched2.prioritize(pod_obj("u2", 1, cpu="0"), [empty, busy], NOW))
    assert got2[busy] == 10 and got2[empty] <= 9
    assert len(view2.reservations) == 0
    # a pod without slices: nothing to say
    assert sched2.prioritize(pod_obj("u3", 0), [empty, busy], NOW) == [(empty, 0), (busy, 0)]


def three_mps_nodes() -> tuple[list[str], list[dict[str, Any]]]:
    """Three one-GPU MPS nodes with 0, 2 and 4 of 7 slices in use, in the consistent node order."""
    names = sorted(["n-a", "n-b", "n-c"], key=node_key)
    objs: list[dict[str, Any]] = []
    for i, name in enumerate(names):
        g = mps_gpu(name, 0)
        objs.append(node_obj(name, [g]))
        if i:
            objs.append(pod_obj(f"run{i}", 2 * i, node=name, assigned=sids(g.uuid, 2 * i), cpu="0"))
    return names, objs


def count_ranks(sched: Scheduler, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = sched.rank

    def counted(*a: Any, **kw: Any) -> Any:
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(sched, "rank", counted)
    return calls


def test_prioritize_reuses_the_filter_ranking_of_the_same_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    """Filter then prioritize of one pod read one snapshot: prioritize ranks nothing again, and its
    answer is what a scheduler that never filtered the pod gives (the best node leads either way)."""
    names, objs = three_mps_nodes()
    _, sched = build(objs, policy="bestfit")
    _, fresh = build(objs, policy="bestfit")
    pod = pod_obj("u1", 2, cpu="0")
    res = sched.filter(pod, names, NOW)
    assert res.feasible == (names[2],)
    calls = count_ranks(sched, monkeypatch)
    got = sched.prioritize(pod, names, NOW)
    assert calls[0] == 0
    assert got == fresh.prioritize(pod, names, NOW)
    assert dict(got)[names[2]] == 10
    # another pod, or the same pod over nodes the filter did not rank: ranked afresh
    sched.prioritize(pod_obj("u2", 2, cpu="0"), names, NOW)
    assert calls[0] == 1
    sched.filter(pod, names[:2], NOW)  # ranks once itself
    sched.prioritize(pod, names, NOW)
    assert calls[0] == 3


def test_a_change_between_filter_and_prioritize_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Usage, price and live activity written after the filter all make prioritize rank again."""
    names, objs = three_mps_nodes()
    view, sched = build(objs, policy="bestfit")
    pod = pod_obj("u1", 2, cpu="0")
    assert sched.filter(pod, names[:2], NOW).feasible == (names[1],)
    # another pod binds and fills names[0] before the pod's prioritize comes
    g0 = mps_gpu(names[0], 0)
    view.upsert_pod(pod_obj("late", 7, node=names[0], assigned=sids(g0.uuid, 7), cpu="0"), NOW)
    calls = count_ranks(sched, monkeypatch)
    got = dict(sched.prioritize(pod, names[:2], NOW))
    assert calls[0] == 1 and got[names[0]] == 0 and got[names[1]] == 10

    _, priced = build(objs, policy="cost")
    priced.filter(pod, names, NOW)
    calls = count_ranks(priced, monkeypatch)
    priced.prioritize(pod, names, NOW)
    assert calls[0] == 0
    priced.state.set_node_cost(priced.state.node_index[names[0]], 99.0)
    priced.prioritize(pod, names, NOW)
    assert calls[0] == 1

    _, hot = build(objs, policy="utilization")
    hot.filter(pod, names, NOW)
    calls = count_ranks(hot, monkeypatch)
    hot.prioritize(pod, names, NOW)
    assert calls[0] == 0
    (mem,) = hot.memory
    mem.update(np.array([0], dtype=np.int64), np.array([0.9]), NOW, hot.state.n_units)
    hot.prioritize(pod, names, NOW)
    assert calls[0] == 1
    mem.now = NOW + 1
    hot.prioritize(pod, names, NOW)
    assert calls[0] == 2
    hot.observe(PackRequest(gpus=1, slices=1))
    hot.prioritize(pod, names, NOW)
    assert calls[0] == 3


# --------------------------------------------------------------------------- reservations

def test_filter_reserves_by_uid_and_the_next_pod_sees_it() -> None:
    g = mps_gpu("n1", 0)
    view, sched = build([node_obj("n1", [g])])
    first = sched.filter(pod_obj("u1", 4), ["n1"], NOW)
    r1 = first.reservation
    assert r1 is not None and r1.uid == "u1" and r1.node == "n1" and len(r1.slice_ids) == 4
    assert unit(view, "n1", g.uuid) == (3, True)
    # the same pod filtered again replaces its reservation, it does not take more
    again = sched.filter(pod_obj("u1", 4), ["n1"], NOW + 1)
    assert again.reservation is not None and unit(view, "n1", g.uuid) == (3, True)
    r1 = again.reservation
    second = sched.filter(pod_obj("u2", 4), ["n1"], NOW + 1)
    assert second.feasible == () and "slices in use" in second.failed["n1"]
    third = sched.filter(pod_obj("u3", 3), ["n1"], NOW + 1)
    assert third.feasible == ("n1",) and third.reservation is not None
    assert not set(third.reservation.slice_ids) & set(r1.slice_ids)
    assert unit(view, "n1", g.uuid) == (0, True)


def test_a_reserved_mig_instance_is_not_offered_twice() -> None:
    _view, sched = build([node_obj("n1", [mig_gpu("n1", 0, A_LAYOUT)])])
    r = sched.filter(pod_obj("u1", 2), ["n1"], NOW).reservation
    assert r is not None and r.slice_ids == sids(mig_uuid("n1", 0, "4"), 2)
    assert r.units == ((gpu_uuid("n1", 0), mig_uuid("n1", 0, "4")),)
    res = sched.filter(pod_obj("u2", 2), ["n1"], NOW)
    assert res.feasible == () and "slices in use" in res.failed["n1"]


def test_reservation_expires_after_the_configured_ttl() -> None:
    cfg = config(reservationTTLSeconds=5)
    assert ViewSettings.from_config(cfg).reservation_ttl_s == 5
    g = mps_gpu("n1", 0)
    view, sched = build([node_obj("n1", [g])], cfg=cfg)
    r = sched.filter(pod_obj("u1", S), ["n1"], NOW).reservation
    assert r is not None and r.expires == NOW + 5
    assert sched.filter(pod_obj("u2", 1), ["n1"], NOW + 4.9).feasible == ()
    res = sched.filter(pod_obj("u2", 1), ["n1"], NOW + 5)  # filter expires what is due first
    assert res.feasible == ("n1",) and "u1" not in view.reservations
    view.expire(NOW + 10)
    assert unit(view, "n1", g.uuid) == (7, True)


def test_rebuild_keeps_reservations_for_later_filters() -> None:
    g = mps_gpu("n1", 0)
    view, sched = build([node_obj("n1", [g])])
    r = sched.filter(pod_obj("u1", 5), ["n1"], NOW).reservation
    assert r is not None
    view.rebuild()
    assert view.reservations.get("u1") == r and unit(view, "n1", g.uuid) == (2, True)
    assert sched.filter(pod_obj("u2", 3), ["n1"], NOW).feasible == ()
    plan = sched.bind_check(pod_obj("u1", 5), "n1", NOW)
    assert plan.assignment is not None and plan.assignment.slice_ids == r.slice_ids


def test_packed_cluster_holds_and_expires_reservations_on_a_bare_state() -> None:
    state = ClusterState([NodeSpec("n1", 8000, 8192, "G2")], [UnitSpec(0, 0, KIND_MPS, 10)], slices_per_gpu=10)
    cluster = PackedCluster(state, reservation_ttl_s=30)
    sched = Scheduler(cluster, "bestfit")
    req = PackRequest(cpu_milli=1000, memory_mib=512, gpus=1, slices=4, uid="u1")
    chosen, _, _ = sched.filter_request(req, None, NOW)
    assert chosen.node.tolist() == [0]
    assert int(state.unit_free[0]) == 6 and int(state.node_cpu_free[0]) == 7000
    sched.filter_request(req, None, NOW + 1)  # the same uid again: replaced, not doubled
    assert int(state.unit_free[0]) == 6
    cluster.expire(NOW + 31)
    assert int(state.unit_free[0]) == 10 and int(state.node_cpu_free[0]) == 8000 and len(cluster.reservations) == 0


# --------------------------------------------------------------------------- bind

def test_bind_check_writes_the_reserved_ids() -> None:
    view, sched = build([node_obj("n1", [mps_gpu("n1", 0), mig_gpu("n1", 1, A_LAYOUT)])])
    for uid, k in (("u1", 2), ("u2", 4)):
        res = sched.filter(pod_obj(uid, k), ["n1"], NOW)
        r = res.reservation
        assert r is not None
        plan = sched.bind_check(pod_obj(uid, k), "n1", NOW + 1)
        a = plan.assignment
        assert a is not None and plan.refusal == "" and not plan.already
        assert a.pod_uid == uid and a.node == "n1" and a.slice_ids == r.slice_ids
        assert a.time == NOW_DT + timedelta(seconds=1)
        gpus, inst = (a.gpus, a.instance)
        if inst is not None:
            assert gpus == (gpu_uuid("n1", 1),) and all(s.startswith(inst + "::") for s in a.slice_ids)
        else:
            assert len(gpus) == 1 and all(s.startswith(gpus[0] + "::") for s in a.slice_ids)
        # the reservation outlives bind until the assignment arrives by watch
        kept = view.reservations.get(uid)
        assert kept is not None and kept.expires == NOW + 1 + 60
    # the assignment, once seen on the pod, supersedes the reservation
    held = view.reservations.held["u1"].slice_ids
    view.upsert_pod(pod_obj("u1", 2, node="n1", assigned=held), NOW + 2)
    assert "u1" not in view.reservations


def test_bind_check_without_a_reservation_picks_and_holds_a_free_placement() -> None:
    g = mps_gpu("n1", 0)
    view, sched = build([node_obj("n1", [g]), pod_obj("a", 3, node="n1", assigned=sids(g.uuid, 3))])
    plan = sched.bind_check(pod_obj("u1", 2), "n1", NOW)
    assert plan.assignment is not None
    assert not set(plan.assignment.slice_ids) & set(sids(g.uuid, 3))
    assert view.reservations.get("u1") is not None and unit(view, "n1", g.uuid) == (2, True)
    full = sched.bind_check(pod_obj("u2", 3), "n1", NOW)
    assert full.assignment is None and "slices in use" in full.refusal


def test_the_assignment_carries_each_policys_score_and_the_total() -> None:
    """``scores`` is the breakdown that chose the placement: every configured policy and ``total``,
    from the filter's ranking when the pod was reserved, from bind's own when not."""
    g = mps_gpu("n1", 0)
    mig = mig_gpu("n1", 1, A_LAYOUT)
    _, sched = build([node_obj("n1", [g, mig]), pod_obj("a", 3, node="n1", assigned=sids(g.uuid, 3))])
    names = {p.name for p, _ in sched.policy.parts}
    assert names == {"fragmentation", "cost", "utilization"}
    res = sched.filter(pod_obj("u1", 2), ["n1"], NOW)
    assert res.reservation is not None
    reserved = dict(res.reservation.scores)
    a = sched.bind_check(pod_obj("u1", 2), "n1", NOW + 1).assignment
    assert a is not None and dict(a.scores) == reserved
    assert set(a.scores) == names | {"total"} and all(0.0 <= v <= 1.0 for v in a.scores.values())
    b = sched.bind_check(pod_obj("u2", 1), "n1", NOW + 1).assignment  # no filter before: bind ranks itself
    assert b is not None and set(b.scores) == names | {"total"}
    # Without prices or DCGM samples the mix scores as fragmentation alone (no signal, no effect).
    assert b.scores["total"] == b.scores["fragmentation"]


def test_bind_check_on_another_node_than_reserved_moves_the_hold() -> None:
    view, sched = build([node_obj("n1", [mps_gpu("n1", 0)]), node_obj("n2", [mps_gpu("n2", 0)])])
    r = sched.filter(pod_obj("u1", 3), ["n1"], NOW).reservation
    assert r is not None and r.node == "n1"
    plan = sched.bind_check(pod_obj("u1", 3), "n2", NOW)
    assert plan.assignment is not None and plan.assignment.node == "n2"
    assert all(s.startswith(gpu_uuid("n2", 0)) for s in plan.assignment.slice_ids)
    assert unit(view, "n1", gpu_uuid("n1", 0)) == (7, True) and unit(view, "n2", gpu_uuid("n2", 0)) == (4, True)


def test_bind_check_refusals() -> None:
    _view, sched = build([node_obj("n1", [mps_gpu("n1", 0)]), node_obj("plain", None)])
    sched.filter(pod_obj("u1", 1), ["n1"], NOW)
    fenced = sched.bind_check(pod_obj("u1", 1), "n1", NOW, lease_held=False, lease="kube-system/gpu-slice")
    assert fenced.assignment is None and "does not hold its lease kube-system/gpu-slice" in fenced.refusal
    assert sched.bind_check(pod_obj("u1", 1), "ghost", NOW).refusal == UNKNOWN_NODE
    assert "no inventory annotation" in sched.bind_check(pod_obj("u1", 1), "plain", NOW).refusal
    assert "asks no slices" in sched.bind_check(pod_obj("u9", 0), "n1", NOW).refusal
    assert f"{S + 1} slices" in sched.bind_check(pod_obj("u8", S + 1), "n1", NOW).refusal


def test_bind_check_is_idempotent_for_a_pod_that_carries_its_assignment() -> None:
    view, sched = build([node_obj("n1", [mps_gpu("n1", 0)]), node_obj("n2", [mps_gpu("n2", 0)])])
    sched.filter(pod_obj("u1", 2), ["n1"], NOW)
    plan = sched.bind_check(pod_obj("u1", 2), "n1", NOW)
    assert plan.assignment is not None
    written = pod_obj("u1", 2, annotations={ann.ASSIGNMENT_KEY: ann.encode_assignment(plan.assignment)})
    again = sched.bind_check(written, "n1", NOW + 1)
    assert again.already and again.assignment == plan.assignment and again.refusal == ""
    elsewhere = sched.bind_check(written, "n2", NOW + 1)
    assert elsewhere.assignment is None and "already assigned to node n1" in elsewhere.refusal
    assert unit(view, "n1", gpu_uuid("n1", 0)) == (5, True) and unit(view, "n2", gpu_uuid("n2", 0)) == (7, True)


def test_same_size_rule_refuses_when_placements_do_not_suit_both_pods() -> None:
    """An unstamped 1-slice pod on MPS (isolation mps) and a new 1-slice pod asking MIG: kubelet could
    swap their ids, and neither placement suits the other pod, so bind refuses naming the first."""
    g, mig = mps_gpu("n1", 0), mig_gpu("n1", 1, A_LAYOUT)
    first = pod_obj("a", 1, node="n1", assigned=sids(g.uuid, 1), isolation="mps",
                    at=NOW_DT - timedelta(seconds=3))
    view, sched = build([node_obj("n1", [g, mig]), first])
    plan = sched.bind_check(pod_obj("u1", 1, isolation="mig"), "n1", NOW)
    assert plan.assignment is None
    assert plan.refusal.startswith("same-size rule: ns/pod-a on n1 ask the same 1 slices")
    # an identical replica suits both: no refusal
    twin = sched.bind_check(pod_obj("u2", 1, isolation="mps"), "n1", NOW)
    assert twin.assignment is not None and twin.refusal == ""
    # once kubelet has admitted the first pod (the plugin stamped it), the rule no longer applies
    view.upsert_pod(pod_obj("a", 1, node="n1", assigned=sids(g.uuid, 1), allocated=sids(g.uuid, 1),
                            isolation="mps"), NOW)
    assert sched.bind_check(pod_obj("u1", 1, isolation="mig"), "n1", NOW).assignment is not None
    # a different size never conflicts
    _view2, sched2 = build([node_obj("n1", [g, mig]), first])
    assert sched2.bind_check(pod_obj("u3", 2, isolation="mig"), "n1", NOW).assignment is not None


def test_bind_then_filter_does_not_hand_out_the_bound_ids() -> None:
    g = mps_gpu("n1", 0)
    view, sched = build([node_obj("n1", [g])])
    sched.filter(pod_obj("u1", 4), ["n1"], NOW)
    plan = sched.bind_check(pod_obj("u1", 4), "n1", NOW)
    assert plan.assignment is not None
    nxt = sched.filter(pod_obj("u2", 3), ["n1"], NOW + 30)
    assert nxt.reservation is not None and not set(nxt.reservation.slice_ids) & set(plan.assignment.slice_ids)
    # the pod arrives bound with its assignment: counted once, by the pod
    view.upsert_pod(pod_obj("u1", 4, node="n1", assigned=plan.assignment.slice_ids), NOW + 31)
    assert unit(view, "n1", g.uuid) == (0, True)
    assert view.state.allocated_slices == 7


# --------------------------------------------------------------------------- config fields

def test_from_config_reads_policies_and_margin() -> None:
    empty, busy, objs = two_nodes()
    _, spread = build(objs, cfg=config(policies=[{"name": "spread"}]))
    assert spread.policy.name == "spread"
    assert spread.filter(pod_obj("u1", 1, cpu="0"), [busy, empty], NOW).feasible == (empty,)
    _, packing = build(objs, cfg=config(policies=[{"name": "bestfit"}]))
    assert packing.filter(pod_obj("u1", 1, cpu="0"), [busy, empty], NOW).feasible == (busy,)
    _, wide = build(objs, cfg=config(policies=[{"name": "bestfit"}], narrowing={"margin": 0.3}))
    assert wide.narrow.margin == 0.3
    assert wide.filter(pod_obj("u1", 1, cpu="0"), [busy, empty], NOW).feasible == (empty,)


def test_owner_spread_false_lets_two_pods_of_one_owner_share_a_gpu() -> None:
    g = mps_gpu("n1", 0)
    objs = [node_obj("n1", [g]), pod_obj("a", 1, node="n1", assigned=sids(g.uuid, 1), owner="web")]
    _, strict = build(objs)
    assert "owner-spread" in strict.filter(pod_obj("u1", 1, owner="web"), ["n1"], NOW).failed["n1"]
    view, lax = build(objs, cfg=config(ownerSpread=False))
    assert not lax.owner_spread and not view.settings.owner_spread
    res = lax.filter(pod_obj("u1", 1, owner="web"), ["n1"], NOW)
    assert res.feasible == ("n1",) and res.reservation is not None and res.reservation.owner == ""
    assert lax.filter(pod_obj("u2", 1, owner="web"), ["n1"], NOW).feasible == ("n1",)


def test_isolation_default_applies_to_pods_without_the_annotation() -> None:
    objs = [node_obj("mps", [mps_gpu("mps", 0)]), node_obj("mig", [mig_gpu("mig", 0, A_LAYOUT)])]
    _, sched = build(objs, cfg=config(isolationDefault="mig"))
    res = sched.filter(pod_obj("u1", 1), ["mps", "mig"], NOW)
    assert res.feasible == ("mig",)
    assert "pod asks mig isolation" in res.unresolvable["mps"]
    explicit = sched.filter(pod_obj("u2", 1, isolation="mps"), ["mps", "mig"], NOW)
    assert explicit.feasible == ("mps",)
    _, default = build(objs)
    assert set(default.filter(pod_obj("u3", 1), ["mps"], NOW).feasible) == {"mps"}


def test_memory_tolerance_decides_a_floor_just_above_the_instance() -> None:
    objs = [node_obj("n1", [mig_gpu("n1", 0, (("1g.10gb", 0),))])]  # 9984 MiB
    pod = pod_obj("u1", 1, gpu_memory="10400Mi")  # 10400 * 0.97 = 10088 > 9984; * 0.95 = 9880 fits
    _, tight = build(objs)
    assert "10.16 GiB" in tight.filter(pod, ["n1"], NOW).unresolvable["n1"]
    view, loose = build(objs, cfg=config(memoryTolerance=0.05))
    assert view.state.memory_tolerance == 0.05
    res = loose.filter(pod, ["n1"], NOW)
    assert res.feasible == ("n1",)
    plan = loose.bind_check(pod, "n1", NOW)
    assert plan.assignment is not None and plan.assignment.instance == mig_uuid("n1", 0, "0")


def test_slices_per_gpu_from_config() -> None:
    cfg = config(slices=4)
    objs = [node_obj("n1", [mps_gpu("n1", 0, slices=4), mps_gpu("n1", 1, slices=4)])]
    view, sched = build(objs, cfg=cfg)
    assert view.settings.slices_per_gpu == 4
    assert sched.filter(pod_obj("u1", 4), ["n1"], NOW).feasible == ("n1",)
    assert "5 slices" in sched.filter(pod_obj("u2", 5), ["n1"], NOW).error


def test_assignment_helper_round_trips() -> None:
    """The helpers build what the codecs accept (a guard for the other tests)."""
    a = assignment_of("u1", "n1", sids(mig_uuid("n1", 0, "4"), 2), NOW_DT)
    assert a.instance == mig_uuid("n1", 0, "4") and a.gpus == (gpu_uuid("n1", 0),)
    assert ann.decode_assignment(ann.encode_assignment(a)) == a


def test_pods_as_requests_and_warm_start_read_the_pods_holding_slices() -> None:
    g = mps_gpu("n1", 0)
    objs = [node_obj("n1", [g]),
            pod_obj("old", 2, node="n1", assigned=sids(g.uuid, 2), owner="web", at=NOW_DT - timedelta(hours=2)),
            pod_obj("new", 3, node="n1", assigned=sids(g.uuid, 3, 2), at=NOW_DT - timedelta(hours=1)),
            pod_obj("done", 1, node="n1", assigned=sids(g.uuid, 1, 5), phase="Succeeded"),
            pod_obj("waiting", 1)]
    view, sched = build(objs)
    reqs = pods_as_requests(view)
    assert [(r.uid, r.slices, r.owner) for r in reqs] == [("old", 2, "ns/ReplicaSet/web"), ("new", 3, "")]
    assert [r.owner for r in pods_as_requests(view, owner_spread=False)] == ["", ""]
    assert sched.warm_start(reqs) == 2


# --------------------------------------------------------------------------- the whole loop, as a property

flow_layouts = st.sampled_from([(("3g.40gb", 0), ("3g.40gb", 4)), A_LAYOUT,
                                (("1g.10gb", 0), ("1g.10gb", 1), ("2g.20gb", 2), ("3g.40gb", 4))])


@st.composite
def flows(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[tuple[int, str | None, str | None, str | None, str,
                                                                    int]]]:
    objs = []
    for name in ("na", "nb"):
        gpus = []
        for i, kind in enumerate(draw(st.lists(st.sampled_from(["mps", "whole", "mig"]), min_size=1, max_size=3))):
            gpus.append(mps_gpu(name, i) if kind == "mps" else whole_gpu(name, i) if kind == "whole" else
                        mig_gpu(name, i, draw(flow_layouts)))
        objs.append(node_obj(name, gpus, cpu="16", cordon=[g.uuid for g in gpus if draw(st.integers(0, 5)) == 0]))
    pods = draw(st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 7, 14]), st.sampled_from([None, "mig", "mps"]),
                                   st.sampled_from([None, "10Gi", "20Gi", "40Gi"]),
                                   st.sampled_from([None, "web"]), st.sampled_from(["unbound", "bound", "stamped"]),
                                   st.integers(0, 30)), max_size=8))
    return objs, pods


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flows())
def test_filter_bind_watch_loop_stays_consistent(flow: tuple[list[dict[str, Any]], list[Any]]) -> None:
    """Pods arrive one by one: filter, bind on the chosen node, then the watch shows the pod (bound,
    or stamped by the plugin, or still unbound). At each step the object model (enumerate_placements)
    agrees with the array state's verdict, bind writes the reserved ids as a placement that suits
    the pod and that nobody else holds, and at the end the view equals one built in one go."""
    objs, pods = flow
    view = ClusterView.from_objects(objs, NOW)
    sched = Scheduler.from_config(view)
    now, objects = NOW, list(objs)
    for n, (k, iso, mem, owner, fate, dt) in enumerate(pods):
        now += dt
        uid = f"u{n}"

        def make(**kw: Any) -> dict[str, Any]:
            return pod_obj(uid, k, isolation=iso, gpu_memory=mem, owner=owner, cpu="1", **kw)  # noqa: B023

        info = project(make())
        assert info.request is not None
        res = sched.filter(make(), ["na", "nb"], now)
        if res.error:
            continue
        r = res.reservation
        for name in ("na", "nb"):
            inv = view.inventory(name)
            if r is not None and r.node == name:
                inv = inv.release(r.slice_ids)
            fits = bool(enumerate_placements(inv, info.request).placements)
            if name in res.feasible:
                assert fits
            elif fits and not owner:
                assert res.failed.get(name) == NARROWED_OUT or "cpu" in res.failed.get(name, ""), res
        if not res.feasible:
            assert r is None
            continue
        node = res.feasible[0]
        plan = sched.bind_check(make(), node, now)
        if plan.assignment is None:
            assert plan.refusal.startswith("same-size rule"), plan.refusal
            continue
        a = plan.assignment
        assert r is not None and a.slice_ids == r.slice_ids
        inv = view.inventory(node)
        assert not set(a.slice_ids) & {s for s, h in view.nodes[node].held.items() if h != uid}
        assert suits(placement_from_assignment(a, inv), info.request, inv)
        notes = {ann.ASSIGNMENT_KEY: ann.encode_assignment(a)}
        if fate == "unbound":
            seen = make(annotations=notes)
        else:
            seen = make(node=node, annotations=notes, allocated=a.slice_ids if fate == "stamped" else None, at=a.time)
        view.upsert_pod(seen, now)
        objects.append(seen)
    view.expire(now)
    whole = ClusterView.from_objects(objects, now)
    for held in view.reservations.held.values():
        whole.hold(held)
    assert snapshot(view) == snapshot(whole)
