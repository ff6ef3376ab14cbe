"""Refusal reasons (gpuslice.reasons) as the extender's filter hands them over.

Each refused node gets one cause, and the cause decides where the node goes: ``unresolvable`` when
no change of usage could ever let the pod in (kube-scheduler then skips preemption there),
``failed`` when it is what runs there now. The review's cases first, then a property: a reason
called unresolvable really is (the pod does not fit the node even emptied and uncordoned) and a
resolvable one really is not (it fits the emptied node).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuslice.config import Config, default_config
from gpuslice.reasons import explain
from gpuslice.scheduler import UNKNOWN_NODE, FilterResult, Scheduler
from gpuslice.view import ClusterView

from .test_view import (
    A_LAYOUT,
    NOW,
    S,
    gpu_uuid,
    mig_gpu,
    mig_uuid,
    mps_gpu,
    node_obj,
    pod_obj,
    sids,
    whole_gpu,
)


def decide(objects: list[dict[str, Any]], pod: dict[str, Any], names: list[str] | None = None, *,
           config: Config | None = None) -> FilterResult:
    view = ClusterView.from_objects(objects, NOW, config=config)
    sched = Scheduler.from_config(view, config)
    if names is None:
        names = [o["metadata"]["name"] for o in objects if o["kind"] == "Node"]
    return sched.filter(pod, names, NOW)


def only_reason(res: FilterResult, node: str, *, hard: bool) -> str:
    """The node's reason, asserting it sits on the right side and nowhere else."""
    assert node not in res.feasible
    side, other = (res.unresolvable, res.failed) if hard else (res.failed, res.unresolvable)
    assert node in side, f"{node} expected {'unresolvable' if hard else 'failed'}: {res}"
    assert node not in other
    assert side[node]
    return side[node]


# --------------------------------------------------------------------------- the review's cases

def test_multi_gpu_pod_on_idle_mps_gpus_is_told_it_needs_whole_mode_gpus() -> None:
    node = node_obj("n1", [mps_gpu("n1", i) for i in range(8)])
    res = decide([node], pod_obj("u1", 2 * S))
    text = only_reason(res, "n1", hard=True)
    assert "whole-mode" in text and "needs 2 whole-mode GPUs" in text
    assert "node has 0" in text and "modes here: mps" in text
    assert "completely free" not in text and "fewer than" not in text
    assert res.reservation is None


def test_mig_node_without_the_size_lists_its_instance_sizes() -> None:
    node = node_obj("n1", [mig_gpu("n1", 0, (("3g.40gb", 0), ("3g.40gb", 4))),
                           mig_gpu("n1", 1, (("4g.40gb", 0), ("3g.40gb", 4)))])
    text = only_reason(decide([node], pod_obj("u1", 2)), "n1", hard=True)
    assert text == ("no GPU here can take exactly 2 slices: no MIG instance here has 2 compute slices (instances "
                    "here: 3, 4; the layout would have to change)")


def test_a_layout_without_the_size_never_reads_as_in_use() -> None:
    """The issue's case: a 7-slice pod on a node whose MPS GPU has 3 slices free and whose MIG GPU is
    idle with no 7g instance. Only the MPS GPU can free up; the sentence says the layout will not."""
    g = mps_gpu("n1", 0)
    mig = mig_gpu("n1", 1, (("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)))
    objs = [node_obj("n1", [g, mig]), pod_obj("a", 4, node="n1", assigned=sids(g.uuid, 4))]
    text = only_reason(decide(objs, pod_obj("u1", 7)), "n1", hard=False)
    assert not text.startswith("slices in use")
    assert text == ("no MIG instance here has 7 compute slices (instances here: 1, 2, 3; the layout would have "
                    "to change), so waiting will not help on the MIG GPUs; and no MPS GPU has 7 free slices now "
                    "(at most 3 of 7 free)")
    # The same node with a 7g instance in use instead: waiting helps everywhere, "in use" is right.
    full = mig_gpu("n1", 1, (("7g.80gb", 0),))
    objs = [node_obj("n1", [g, full]), pod_obj("a", 4, node="n1", assigned=sids(g.uuid, 4)),
            pod_obj("b", 7, node="n1", assigned=sids(full.instances[0].uuid, 7))]
    assert only_reason(decide(objs, pod_obj("u1", 7)), "n1", hard=False).startswith("slices in use")


def test_whole_mode_node_says_whole_gpus_only() -> None:
    text = only_reason(decide([node_obj("n1", [whole_gpu("n1", 0)])], pod_obj("u1", 3)), "n1", hard=True)
    assert "exactly 3 slices" in text and f"whole-mode GPUs are given only whole ({S} slices)" in text


def test_busy_slices_are_resolvable() -> None:
    g = mps_gpu("n1", 0)
    mig = mig_gpu("n1", 1, A_LAYOUT)
    objs = [node_obj("n1", [g]), pod_obj("a", 5, node="n1", assigned=sids(g.uuid, 5))]
    text = only_reason(decide(objs, pod_obj("u1", 3)), "n1", hard=False)
    assert text == f"slices in use: no fitting GPU has 3 free slices (at most 2 of {S} free)"
    objs = [node_obj("n2", [mig]), pod_obj("b", 2, node="n2", assigned=sids(mig_uuid("n2", 1, "4"), 2))]
    objs[0] = node_obj("n2", [mig_gpu("n2", 1, A_LAYOUT)])
    text = only_reason(decide(objs, pod_obj("u1", 2)), "n2", hard=False)
    assert text == "slices in use: every fitting 2-slice MIG instance here is taken"


def test_busy_whole_gpus_for_a_multi_gpu_pod_are_resolvable() -> None:
    gpus = [whole_gpu("n1", 0), whole_gpu("n1", 1)]
    objs = [node_obj("n1", gpus), pod_obj("a", S, node="n1", assigned=sids(gpus[0].uuid, S))]
    text = only_reason(decide(objs, pod_obj("u1", 2 * S)), "n1", hard=False)
    assert text == "slices in use: 1 of the 2 whole GPUs needed are free"


def test_mig_isolation_on_an_mps_only_node_is_unresolvable() -> None:
    res = decide([node_obj("n1", [mps_gpu("n1", 0)])], pod_obj("u1", 1, isolation="mig"))
    assert only_reason(res, "n1", hard=True) == ("pod asks mig isolation and the node has no MIG instances "
                                                 "(modes here: mps)")
    res = decide([node_obj("n1", [mig_gpu("n1", 0, A_LAYOUT)])], pod_obj("u1", 1, isolation="mps"))
    assert "pod asks mps isolation and the node has no MPS GPUs" in only_reason(res, "n1", hard=True)


def test_memory_floor_too_large_is_unresolvable() -> None:
    res = decide([node_obj("n1", [mps_gpu("n1", 0)])], pod_obj("u1", 1, gpu_memory="40Gi"))
    text = only_reason(res, "n1", hard=True)
    share = (81559 - 512 - S * 256) // S  # the MPS server and one context per slice are kept out
    assert text == ("no GPU or MIG instance here gives 40.00 GiB of GPU memory to a 1-slice pod (at most "
                    f"{share / 1024:.2f} GiB here)")


def test_product_not_allowed_is_unresolvable() -> None:
    res = decide([node_obj("n1", [mps_gpu("n1", 0)])], pod_obj("u1", 1, product="A100-80GB"))
    assert only_reason(res, "n1", hard=True) == ("GPU product H100-80GB is not among the pod's allowed products "
                                                 "(A100-80GB)")


def test_owner_spread_is_resolvable() -> None:
    g = mps_gpu("n1", 0)
    objs = [node_obj("n1", [g]), pod_obj("a", 1, node="n1", assigned=sids(g.uuid, 1), owner="web")]
    res = decide(objs, pod_obj("u1", 1, owner="web"))
    assert only_reason(res, "n1", hard=False) == ("every fitting GPU already runs a pod of ns/ReplicaSet/web "
                                                  "(owner-spread rule)")
    # a pod of another owner fits there
    assert decide(objs, pod_obj("u1", 1, owner="api")).feasible == ("n1",)


def test_owner_spread_covers_every_mig_instance_of_the_gpu() -> None:
    g = mig_gpu("n1", 0, (("1g.10gb", 0), ("1g.10gb", 1)))
    objs = [node_obj("n1", [g]), pod_obj("a", 1, node="n1", assigned=sids(mig_uuid("n1", 0, "0"), 1), owner="web")]
    assert "owner-spread" in only_reason(decide(objs, pod_obj("u1", 1, owner="web")), "n1", hard=False)


def test_cordoned_gpus_are_resolvable_and_named() -> None:
    gpus = [mps_gpu("n1", 0), mps_gpu("n1", 1)]
    res = decide([node_obj("n1", gpus, cordon=[g.uuid for g in gpus])], pod_obj("u1", 1))
    assert only_reason(res, "n1", hard=False) == "GPU 0, 1 could take the pod but are unhealthy or cordoned"
    res = decide([node_obj("n1", [replace(gpus[0], healthy=False)])], pod_obj("u1", 1))
    assert "unhealthy or cordoned" in only_reason(res, "n1", hard=False)


def test_cpu_short_now_is_resolvable_but_too_little_allocatable_is_not() -> None:
    g = mps_gpu("n1", 0)
    objs = [node_obj("n1", [g], cpu="8", memory="32Gi"),
            pod_obj("a", 1, node="n1", assigned=sids(g.uuid, 1), cpu="6", memory="24Gi")]
    assert only_reason(decide(objs, pod_obj("u1", 1, cpu="4")), "n1", hard=False) == (
        "insufficient cpu: pod asks 4000m, node has 2000m free")
    assert only_reason(decide(objs, pod_obj("u1", 1, cpu="16")), "n1", hard=True) == (
        "node has 8000m allocatable CPU, the pod asks 16000m")
    assert only_reason(decide(objs, pod_obj("u1", 1, memory="16Gi")), "n1", hard=False) == (
        "insufficient memory: pod asks 16384 MiB, node has 8192 MiB free")
    assert only_reason(decide(objs, pod_obj("u1", 1, memory="64Gi")), "n1", hard=True) == (
        "node has 32768 MiB allocatable memory, the pod asks 65536 MiB")


# --------------------------------------------------------------------------- filter's sides

def test_filter_sorts_nodes_into_feasible_failed_and_unresolvable() -> None:
    g = mps_gpu("busy", 0)
    objs = [
        node_obj("ok", [mps_gpu("ok", 0)]),
        node_obj("busy", [g]),
        pod_obj("a", S, node="busy", assigned=sids(g.uuid, S)),
        node_obj("mig", [mig_gpu("mig", 0, (("3g.40gb", 0), ("3g.40gb", 4)))]),
        node_obj("plain", None),  # no inventory: takes no slices, ever
        node_obj("broken", [mps_gpu("broken", 0)], annotations={"example.com/gpu-slice.cordon": 42}),
    ]
    res = decide(objs, pod_obj("u1", 2), ["ok", "busy", "mig", "plain", "broken", "ghost"])
    assert res.feasible == ("ok",) and res.error == ""
    assert set(res.failed) == {"busy", "ghost"}
    assert res.failed["ghost"] == UNKNOWN_NODE
    assert set(res.unresolvable) == {"mig", "plain", "broken"}
    assert "no inventory annotation" in res.unresolvable["plain"]
    assert res.unresolvable["broken"].startswith("node broken: ")


def test_a_pod_without_slices_passes_every_node_and_reserves_nothing() -> None:
    objs = [node_obj("n1", [mps_gpu("n1", 0)], cpu="1"), node_obj("plain", None)]
    view = ClusterView.from_objects(objs, NOW)
    sched = Scheduler.from_config(view)
    res = sched.filter(pod_obj("u1", 0, cpu="64"), ["n1", "plain", "ghost"], NOW)
    assert res == FilterResult(feasible=("n1", "plain", "ghost"))
    assert len(view.reservations) == 0


def test_a_pod_that_cannot_be_met_as_written_is_an_error_not_a_node_verdict() -> None:
    res = decide([node_obj("n1", [mps_gpu("n1", 0)])], pod_obj("u1", S + 1))
    assert res.feasible == () and not res.failed and not res.unresolvable
    assert f"{S + 1} slices" in res.error
    two = pod_obj("u2", 1)
    two["spec"]["containers"].append({"name": "side", "resources": {"limits": {"example.com/gpu-slice": "1"}}})
    assert "only one container" in decide([node_obj("n1", [mps_gpu("n1", 0)])], two).error


def test_explain_handles_many_nodes_at_once_and_removed_rows() -> None:
    """The vectorised path: one call over many refused nodes, each with its own cause."""
    objs: list[dict[str, Any]] = []
    for i in range(40):
        name = f"n{i:02d}"
        if i % 4 == 0:
            objs.append(node_obj(name, [mps_gpu(name, 0)], cpu="1"))  # allocatable too small
        elif i % 4 == 1:
            objs.append(node_obj(name, [mig_gpu(name, 0, (("3g.40gb", 0), ("3g.40gb", 4)))]))  # no 2-slice
        elif i % 4 == 2:
            g = mps_gpu(name, 0)
            objs += [node_obj(name, [g]), pod_obj(f"p{i}", 6, node=name, assigned=sids(g.uuid, 6))]  # busy
        else:
            objs.append(node_obj(name, [mps_gpu(name, 0)], cordon=[gpu_uuid(name, 0)]))  # cordoned
    view = ClusterView.from_objects(objs, NOW)
    view.remove_node("n39")
    sched = Scheduler.from_config(view)
    _, req = sched.request_of(pod_obj("u1", 2, cpu="2"))
    assert req is not None
    st_ = view.state
    fit = st_.fit(req)
    rows = np.array([st_.node_names.index(f"n{i:02d}") for i in range(40)], dtype=np.int64)
    assert not fit.feasible[rows].any()
    got = explain(st_, req, fit, rows).as_dict(st_.node_names)
    for i in range(39):
        text, hard = got[f"n{i:02d}"]
        kind = i % 4
        assert hard == (kind in (0, 1)), (i, text)
        assert {0: "allocatable CPU", 1: "exactly 2 slices", 2: "slices in use", 3: "cordoned"}[kind] in text
    assert got["n39"] == ("node was removed", True)


# --------------------------------------------------------------------------- the property

layouts = st.sampled_from([
    (("3g.40gb", 0), ("3g.40gb", 4)),
    A_LAYOUT,
    (("1g.10gb", 0), ("1g.10gb", 1), ("2g.20gb", 2), ("3g.40gb", 4)),
    (("7g.80gb", 0),),
])
gpu_kinds = st.one_of(st.just(("mps", None)), st.just(("whole", None)), st.tuples(st.just("mig"), layouts))


@st.composite
def scenes(draw: st.DrawFn) -> tuple[list[dict[str, Any]], dict[str, Any], bool]:
    kinds = draw(st.lists(gpu_kinds, min_size=1, max_size=3))
    gpus = []
    for i, (kind, layout) in enumerate(kinds):
        flags = {"healthy": draw(st.booleans()) or draw(st.booleans())}
        if kind == "mps":
            gpus.append(mps_gpu("n1", i, **flags))
        elif kind == "whole":
            gpus.append(whole_gpu("n1", i, **flags))
        else:
            gpus.append(mig_gpu("n1", i, layout, **flags))
    cordon = [g.uuid for g in gpus if draw(st.integers(0, 4)) == 0]
    objs: list[dict[str, Any]] = [node_obj("n1", gpus, cpu=str(draw(st.sampled_from([4, 16]))), cordon=cordon)]
    # running pods: some slices of some GPUs, of owner web or api
    for j, g in enumerate(gpus):
        if not draw(st.booleans()):
            continue
        owner = draw(st.sampled_from(["web", "api", None]))
        if g.mode == "mps":
            k = draw(st.integers(1, S))
            objs.append(pod_obj(f"r{j}", k, node="n1", assigned=sids(g.uuid, k), owner=owner, cpu="2"))
        elif g.mode == "whole":
            objs.append(pod_obj(f"r{j}", S, node="n1", assigned=sids(g.uuid, S), owner=owner, cpu="2"))
        else:
            inst = draw(st.sampled_from(g.instances))
            objs.append(pod_obj(f"r{j}", inst.compute_slices, node="n1", assigned=inst.slice_ids(), owner=owner,
                                cpu="2"))
    k = draw(st.sampled_from([1, 2, 3, 4, 7, 14]))
    pod = pod_obj("u1", k, owner=draw(st.sampled_from(["web", None])),
                  isolation=draw(st.sampled_from([None, "mig", "mps", "any"])),
                  gpu_memory=draw(st.sampled_from([None, "8Gi", "20Gi", "40Gi", "100Gi"])),
                  cpu=str(draw(st.sampled_from([1, 8, 20]))),
                  product=draw(st.sampled_from([None, None, None, "A100-80GB"])))
    return objs, pod, draw(st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenes())
def test_unresolvable_means_not_even_on_the_emptied_node(scene: tuple[list[dict[str, Any]], dict[str, Any],
                                                                       bool]) -> None:
    objs, pod, spread = scene
    config = default_config() if spread else default_config().model_copy(update={"owner_spread": False})
    res = decide(objs, pod, config=config)
    if res.error:
        return
    # the node emptied of pods, every GPU healthy and uncordoned: what no change of usage can fix
    bare = node_obj("n1", [replace(g, healthy=True, cordoned=False) for g in
                           ClusterView.from_objects(objs[:1], NOW).inventory("n1").gpus],
                    cpu=objs[0]["status"]["allocatable"]["cpu"])
    fits_empty = decide([bare], pod, config=config).feasible == ("n1",)
    if res.feasible:
        assert fits_empty
    elif "n1" in res.unresolvable:
        assert not fits_empty, res.unresolvable
    else:
        assert res.failed["n1"], res
        assert fits_empty, res.failed


@pytest.mark.parametrize("isolation", ["mig", "any"])
def test_reason_for_mig_instance_too_small_for_the_memory(isolation: str) -> None:
    node = node_obj("n1", [mig_gpu("n1", 0, (("1g.10gb", 0), ("1g.10gb", 1)))])
    text = only_reason(decide([node], pod_obj("u1", 1, gpu_memory="20Gi", isolation=isolation)), "n1", hard=True)
    assert text == ("no GPU or MIG instance here gives 20.00 GiB of GPU memory to a 1-slice pod (at most 9.75 GiB "
                    "here)")


def test_groups_match_row_uniqueness_even_when_folding_would_overflow() -> None:
    """The cheap row grouping equals ``np.unique(axis=0)``. Five columns of 8,192 distinct values
    fold past 2**64; without re-ranking, the row (4096, 0, 0, 0, 0) would wrap onto (0, 0, 0, 0, 0)."""
    from gpuslice.reasons import _groups

    ramp = np.arange(8_192, dtype=np.int64)
    keys = np.vstack([np.stack([ramp] * 5, axis=1), [[4_096, 0, 0, 0, 0]]])
    keys = keys[np.random.default_rng(7).permutation(keys.shape[0])]
    first, inverse = _groups([keys[:, j].copy() for j in range(5)])
    assert first.shape[0] == np.unique(keys, axis=0).shape[0] == 8_193
    assert np.array_equal(keys[first][inverse], keys)  # every row lands in a group of its own values
