"""Preemption (DESIGN 4): per node, the fewest lower-priority pods whose slices free one valid
placement; nodes where no such set exists are left out; the view is the same afterwards."""

from __future__ import annotations

import itertools
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice.preemption import NodeVictims, victims_on
from gpuslice.scheduler import Scheduler
from gpuslice.view import ClusterView

from .test_view import A_LAYOUT, NOW, S, mig_gpu, mig_uuid, mps_gpu, node_obj, pod_obj, sids, snapshot, whole_gpu

LOW, MID, HIGH = 0, 100, 1000


def running(uid: str, gpu: str, k: int, start: int = 0, *, node: str = "n1", priority: int = LOW,
            **kw: Any) -> dict[str, Any]:
    """A bound, stamped pod holding ``k`` ids of ``gpu`` (an MPS/whole GPU or a MIG instance UUID)."""
    held = sids(gpu, k, start)
    return pod_obj(uid, k, node=node, assigned=held, allocated=held, priority=priority, **kw)


def uids(found: dict[str, NodeVictims]) -> dict[str, list[str]]:
    """Per node, the victims' UIDs sorted (the set is what these tests check; the order has its own)."""
    return {n: sorted(p.uid for p in nv.victims) for n, nv in found.items()}


def preempt(objects: list[dict[str, Any]], pod: dict[str, Any], names: list[str]) -> tuple[
        dict[str, list[str]], ClusterView]:
    view = ClusterView.from_objects(objects, NOW)
    before = snapshot(view)
    pods_before = {uid: p.info for uid, p in view.pods.items()}
    by_node = {k: set(v) for k, v in view.by_node.items()}
    out = uids(Scheduler.from_config(view).preempt(pod, names, NOW))
    assert snapshot(view) == before, "preempt changed the view"
    assert {uid: p.info for uid, p in view.pods.items()} == pods_before
    assert {k: set(v) for k, v in view.by_node.items()} == by_node
    return out, view


def test_one_three_slice_pod_rather_than_three_one_slice_pods() -> None:
    """GPU0: three 1-slice pods; GPU1: one 3-slice pod; both GPUs' other 4 slices run a high pod."""
    g0, g1 = mps_gpu("n1", 0), mps_gpu("n1", 1)
    objs = [node_obj("n1", [g0, g1]),
            running("one-a", g0.uuid, 1, 0), running("one-b", g0.uuid, 1, 1), running("one-c", g0.uuid, 1, 2),
            running("top0", g0.uuid, 4, 3, priority=HIGH),
            running("three", g1.uuid, 3, 0),
            running("top1", g1.uuid, 4, 3, priority=HIGH)]
    out, _ = preempt(objs, pod_obj("new", 3, priority=MID), ["n1"])
    assert out == {"n1": ["three"]}


def test_on_one_gpu_the_largest_holders_go_first() -> None:
    g = mps_gpu("n1", 0)
    objs = [node_obj("n1", [g]), running("three", g.uuid, 3, 0),
            running("one-a", g.uuid, 1, 3), running("one-b", g.uuid, 1, 4), running("one-c", g.uuid, 1, 5)]
    out, _ = preempt(objs, pod_obj("new", 4, priority=MID), ["n1"])  # 1 free, 3 more needed
    assert out == {"n1": ["three"]}
    out, _ = preempt(objs, pod_obj("new", 5, priority=MID), ["n1"])  # 4 more: the 3-slice pod and one more
    assert len(out["n1"]) == 2 and "three" in out["n1"]


def test_higher_and_equal_priority_pods_are_never_victims() -> None:
    g0, g1 = mps_gpu("n1", 0), mps_gpu("n1", 1)
    objs = [node_obj("n1", [g0, g1]), running("high", g0.uuid, S, priority=HIGH),
            running("same", g1.uuid, S, priority=MID)]
    out, _ = preempt(objs, pod_obj("new", 1, priority=MID), ["n1"])
    assert out == {}
    out, _ = preempt(objs, pod_obj("new", 1, priority=MID + 1), ["n1"])
    assert out == {"n1": ["same"]}


def test_mig_victim_is_the_lower_priority_holder_of_a_fitting_instance() -> None:
    g = mig_gpu("n1", 0, (("3g.40gb", 0), ("3g.40gb", 4)))
    objs = [node_obj("n1", [g]),
            running("high", mig_uuid("n1", 0, "0"), 3, priority=HIGH),
            running("low", mig_uuid("n1", 0, "4"), 3)]
    out, _ = preempt(objs, pod_obj("new", 3, priority=MID), ["n1"])
    assert out == {"n1": ["low"]}
    # no 2-slice instance on the node: nothing to gain by evicting, the node is left out
    out, _ = preempt(objs, pod_obj("new", 2, priority=MID), ["n1"])
    assert out == {}


def test_nodes_where_no_set_works_are_left_out() -> None:
    objs = [node_obj("mps", [mps_gpu("mps", 0)]), running("a", mps_gpu("mps", 0).uuid, S, node="mps"),
            node_obj("mig", [mig_gpu("mig", 0, A_LAYOUT)]),
            running("b", mig_uuid("mig", 0, "0"), 3, node="mig"),
            running("c", mig_uuid("mig", 0, "4"), 2, node="mig"),
            running("d", mig_uuid("mig", 0, "6"), 1, node="mig"),
            node_obj("plain", None)]
    out, _ = preempt(objs, pod_obj("new", 2, priority=MID, isolation="mig"), ["mps", "mig", "plain", "ghost"])
    assert out == {"mig": ["c"]}
    out, _ = preempt(objs, pod_obj("new", 2, priority=MID, isolation="mps"), ["mps", "mig"])
    assert out == {"mps": ["a"]}
    # a pod that asks no slices, or cannot be met as written, preempts nothing
    assert preempt(objs, pod_obj("new", 0, priority=MID), ["mps"])[0] == {}
    assert preempt(objs, pod_obj("new", S + 1, priority=MID), ["mps"])[0] == {}


def test_whole_gpus_for_a_multi_gpu_pod() -> None:
    gpus = [whole_gpu("n1", i) for i in range(3)]
    objs = [node_obj("n1", gpus), running("a", gpus[0].uuid, S), running("b", gpus[1].uuid, S, priority=HIGH),
            running("c", gpus[2].uuid, S)]
    out, _ = preempt(objs, pod_obj("new", 2 * S, priority=MID), ["n1"])
    assert out == {"n1": ["a", "c"]}
    out, _ = preempt(objs, pod_obj("new", 3 * S, priority=MID), ["n1"])
    assert out == {}


def test_owner_spread_adds_the_lower_priority_pod_of_the_same_owner() -> None:
    g = mps_gpu("n1", 0)
    objs = [node_obj("n1", [g]), running("mine", g.uuid, 1, owner="web")]
    out, _ = preempt(objs, pod_obj("new", 1, priority=MID, owner="web"), ["n1"])
    assert out == {"n1": ["mine"]}
    objs = [node_obj("n1", [g]), running("mine", g.uuid, 1, owner="web", priority=HIGH)]
    assert preempt(objs, pod_obj("new", 1, priority=MID, owner="web"), ["n1"])[0] == {}


def test_cpu_short_node_adds_victims_for_cpu() -> None:
    g0, g1 = mps_gpu("n1", 0), mps_gpu("n1", 1)
    objs = [node_obj("n1", [g0, g1], cpu="8"), running("gpu-low", g0.uuid, S, cpu="1"),
            pod_obj("cpu-hog", 0, node="n1", cpu="6", priority=LOW), running("high", g1.uuid, 3, cpu="1",
                                                                             priority=HIGH)]
    # GPU1 has 4 free slices, but only 0 CPU is free; the hog frees the most CPU
    out, _ = preempt(objs, pod_obj("new", 2, priority=MID, cpu="4"), ["n1"])
    assert out == {"n1": ["cpu-hog"]}


def test_reserved_slices_are_not_victims() -> None:
    g = mps_gpu("n1", 0)
    view = ClusterView.from_objects([node_obj("n1", [g]), running("low", g.uuid, 2)], NOW)
    sched = Scheduler.from_config(view)
    assert sched.filter(pod_obj("other", 5), ["n1"], NOW).reservation is not None
    before = snapshot(view)
    assert sched.preempt(pod_obj("new", 3, priority=MID), ["n1"], NOW) == {}  # only 2 could be freed
    assert uids(sched.preempt(pod_obj("new", 2, priority=MID), ["n1"], NOW)) == {"n1": ["low"]}
    assert snapshot(view) == before
    assert victims_on(view, sched.request_of(pod_obj("new", 2))[1], MID, "ghost") is None  # type: ignore[arg-type]


def test_preempted_set_really_frees_a_placement() -> None:
    """Take the victims out: the pod then passes the filter on that node."""
    g0, g1 = mps_gpu("n1", 0), mig_gpu("n1", 1, A_LAYOUT)
    objs = [node_obj("n1", [g0, g1]), running("a", g0.uuid, 4), running("b", g0.uuid, 3, 4, priority=HIGH),
            running("c", mig_uuid("n1", 1, "0"), 3), running("d", mig_uuid("n1", 1, "4"), 2),
            running("e", mig_uuid("n1", 1, "6"), 1, priority=HIGH)]
    for k in (1, 2, 3, 4):
        pod = pod_obj("new", k, priority=MID)
        out, view = preempt(objs, pod, ["n1"])
        assert out, k
        sched = Scheduler.from_config(view)
        assert sched.filter(pod, ["n1"], NOW).feasible == (), k
        for uid in out["n1"]:
            view.remove_pod(uid)
        assert sched.filter(pod_obj(f"new{k}", k, priority=MID), ["n1"], NOW).feasible == ("n1",), k
        assert len(out["n1"]) == 1, (k, out)


def test_owner_victims_count_toward_the_slices_freed() -> None:
    """Found by these tests: on an MPS GPU the largest holders were taken first and the pod of the
    same owner (which the owner-spread rule evicts anyway) added on top, so a set of two was
    offered where the same-owner pod alone frees enough."""
    g = mps_gpu("n1", 0)
    objs = [node_obj("n1", [g]), running("mine", g.uuid, 1, 0, owner="web"), running("big", g.uuid, 3, 1)]
    out, _ = preempt(objs, pod_obj("new", 4, priority=MID, owner="web"), ["n1"])  # 3 free + mine's 1 = 4
    assert out == {"n1": ["mine"]}
    out, _ = preempt(objs, pod_obj("new", 5, priority=MID, owner="web"), ["n1"])
    assert out == {"n1": ["big", "mine"]}


# --------------------------------------------------------------------------- the property, by brute force

LAYOUTS = st.sampled_from([(("3g.40gb", 0), ("3g.40gb", 4)), A_LAYOUT,
                           (("1g.10gb", 0), ("1g.10gb", 1), ("2g.20gb", 2), ("3g.40gb", 4))])


@st.composite
def scenes(draw: st.DrawFn) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One node of up to 3 GPUs (any modes) running up to 7 pods of low or high priority."""
    gpus = []
    for i, kind in enumerate(draw(st.lists(st.sampled_from(["mps", "whole", "mig"]), min_size=1, max_size=3))):
        gpus.append(mps_gpu("n1", i) if kind == "mps" else whole_gpu("n1", i) if kind == "whole" else
                    mig_gpu("n1", i, draw(LAYOUTS)))
    objs = [node_obj("n1", gpus, cpu=draw(st.sampled_from(["64", "6"])))]

    def add(owner_id: str, k: int, start: int = 0) -> None:
        objs.append(running(f"p{len(objs)}", owner_id, k, start, priority=draw(st.sampled_from([LOW, HIGH])),
                            owner=draw(st.sampled_from([None, "web"])), cpu="1"))

    for g in gpus:
        if g.mode == "mps":
            pos = 0
            while pos < S and len(objs) < 8 and (k := draw(st.integers(0, S - pos))):
                add(g.uuid, k, pos)
                pos += k
        elif g.mode == "whole":
            if draw(st.booleans()):
                add(g.uuid, S)
        else:
            for inst in g.instances:
                if draw(st.booleans()):
                    add(inst.uuid, inst.compute_slices)
    pod = pod_obj("new", draw(st.sampled_from([1, 2, 3, 4, 7, 14])), priority=MID,
                  owner=draw(st.sampled_from([None, "web"])), cpu=draw(st.sampled_from(["1", "3"])))
    return objs, pod


def fits(objs: list[dict[str, Any]], pod: dict[str, Any]) -> bool:
    view = ClusterView.from_objects(objs, NOW)
    return Scheduler.from_config(view).filter(pod, ["n1"], NOW).feasible == ("n1",)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenes())
def test_victims_are_a_fewest_set_that_frees_a_placement(scene: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    """Against brute force over every subset of lower-priority pods: the node is offered exactly
    when some subset works, the victims do free a placement, and no smaller subset would."""
    objs, pod = scene
    out, _ = preempt(objs, pod, ["n1"])
    if fits(objs, pod):
        return  # kube-scheduler does not ask to preempt where the pod fits
    lower = [o["metadata"]["uid"] for o in objs[1:] if o["spec"].get("priority", 0) < MID]
    smallest: tuple[str, ...] | None = None
    for r in range(len(lower) + 1):
        smallest = next((sub for sub in itertools.combinations(lower, r)
                         if fits([o for o in objs if o["metadata"].get("uid") not in sub], pod)), None)
        if smallest is not None:
            break
    got = out.get("n1")
    if smallest is None:
        assert got is None
        return
    assert got is not None, f"missed {smallest}"
    assert set(got) <= set(lower)
    assert fits([o for o in objs if o["metadata"].get("uid") not in got], pod), got
    assert len(got) == len(smallest), (got, smallest)
