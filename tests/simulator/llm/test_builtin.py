"""The built-in LLM scenario: a valid cluster, a deterministic workload, a leak-free replay, a table."""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pytest

from gpuslice.catalogue import product
from gpuslice.model import validate_mig_layout
from gpuslice.packing.state import PackRequest
from simulator import builtin
from simulator.llm.cluster import LAYOUTS, PRICES, TEMPLATES, build_cluster
from simulator.llm.engine import Replay, build_state, pack_request, replay
from simulator.llm.workload import JOB_VARIANTS, VARIANTS, Owner, generate


@pytest.fixture(scope="module")
def cluster():  # type: ignore[no-untyped-def]
    return build_cluster()


def test_every_layout_is_a_legal_mig_layout() -> None:
    from gpuslice.model import MigInstance

    for prod in ("H100-80GB", "A100-80GB"):
        cat = product(prod)
        for name, layout in LAYOUTS.items():
            insts = [MigInstance(f"MIG-{j}", p, s, cat.profile(p).compute_slices, cat.profile(p).memory_mib)
                     for j, (p, s) in enumerate(layout)]
            validate_mig_layout(prod, insts, where=f"{prod} {name}")


def test_cluster_shape_and_prices(cluster) -> None:  # type: ignore[no-untyped-def]
    assert 40 <= len(cluster.nodes) <= 80
    modes = {g.mode for n in cluster.nodes for g in n.inventory.gpus}
    assert modes == {"mig", "mps", "whole"}
    products = {g.product for n in cluster.nodes for g in n.inventory.gpus}
    assert {"H100-80GB", "A100-80GB", "L4", "L40S"} <= products
    assert {n.capacity_type for n in cluster.nodes} == {"spot", "on-demand"}
    for n in cluster.nodes:
        price = PRICES[n.instance_type]
        assert 0 < price.spot < price.on_demand
        assert n.hourly_cost == (price.spot if n.capacity_type == "spot" else price.on_demand)
    assert set(TEMPLATES) == {n.template for n in cluster.nodes}


@pytest.mark.parametrize("variant", VARIANTS + JOB_VARIANTS, ids=lambda v: v.name)
def test_every_memory_floor_fits_somewhere_in_the_empty_cluster(cluster, variant) -> None:  # type: ignore[no-untyped-def]
    owner = Owner(f"t/{variant.name}", "Deployment", variant)
    assert owner.request.memory_mib is not None
    state, _ = build_state(cluster)
    req = pack_request(owner, "uid")
    assert state.fit(req).feasible.any(), variant
    # The floor matters: the same request with 1.6x the memory fits fewer nodes (or none).
    bigger = PackRequest(cpu_milli=req.cpu_milli, memory_mib=req.memory_mib, gpus=req.gpus, slices=req.slices,
                         gpu_memory_mib=int(req.gpu_memory_mib * 1.6), isolation=req.isolation)
    assert state.fit(bigger).feasible.sum() <= state.fit(req).feasible.sum()


def test_workload_is_deterministic_by_seed() -> None:
    a, b, c = generate(42), generate(42), generate(43)
    assert a == b
    assert a.events != c.events
    assert 500 <= a.pods_created <= 3000
    kinds = {e.kind for e in a.events}
    assert {"create", "delete", "rollout", "delete-old"} <= kinds
    assert any(o.kind == "Job" for o in a.owners)
    assert any(o.request.isolation == "mig" for o in a.owners)
    sizes = {o.request.slices for s in range(42, 52) for o in generate(s).owners}
    assert {1, 2, 3, 4, 7, 14} <= sizes  # 7B-AWQ .. 70B fp16 on two whole GPUs


def test_replay_is_deterministic_and_leaks_nothing(cluster) -> None:  # type: ignore[no-untyped-def]
    w = generate(42)
    r1 = Replay(cluster, w, "fragmentation")
    res1 = r1.run()
    res2 = replay(cluster, w, "fragmentation")
    d1, d2 = res1.as_dict(), res2.as_dict()
    d1.pop("wall_s")
    d2.pop("wall_s")
    assert d1 == d2
    assert res1.pods_created == w.pods_created
    assert res1.pods_placed + res1.pods_never_placed >= res1.pods_created - res1.pods_pending
    # After every owner is deleted the cluster is empty: departures freed every slice and reservation.
    assert res1.leaked_slices == 0
    st = r1.state
    assert (st.unit_free[: st.n_units] == st.unit_cap[: st.n_units]).all()
    assert (st.node_cpu_free == st.node_cpu_cap).all() and (st.node_mem_free == st.node_mem_cap).all()
    assert not r1.packed.reservations.held and not r1.pods and not r1.pending
    assert 0 < res1.gpus_in_use_avg <= res1.gpus_in_use_peak <= cluster.gpu_count
    assert 0 < res1.cost_per_hour <= res1.cost_peak <= cluster.hourly_cost() + 1e-6


def test_pending_pods_come_with_reasons(cluster) -> None:  # type: ignore[no-untyped-def]
    heavy = generate(44, scale=2.5)
    res = replay(cluster, heavy, "bestfit")
    assert res.pods_pending > 0
    assert sum(res.reasons.values()) >= res.pods_pending
    assert all(text and "serving/" not in text for text in res.reasons)  # normalised, no owner names


def test_owner_spread_keeps_replicas_on_distinct_gpus(cluster) -> None:  # type: ignore[no-untyped-def]
    """DESIGN 4: never two pods of one owner on one GPU, so not on two MIG instances of one GPU."""
    r = Replay(cluster, generate(45), "binpack")
    seen: dict[tuple[str, int], str] = {}
    original = r._bind

    def check(t: float, uid: str) -> None:
        original(t, uid)
        pod = r.pods.get(uid)
        if pod is not None and pod.phase == "running":
            for u in pod.units:
                g = int(r.unit_gpu[u])
                other = seen.get((pod.owner.name, g))
                if other is not None and other in r.pods and r.pods[other].phase == "running":
                    raise AssertionError(f"{uid} shares GPU {g} with {other}")
                seen[(pod.owner.name, g)] = uid

    r._bind = check  # type: ignore[method-assign]
    r.run()


def test_run_prints_the_promised_table_and_json(tmp_path: Path) -> None:
    out = io.StringIO()
    json_path = tmp_path / "out.json"
    args = argparse.Namespace(policy="fragmentation,bestfit", seeds=[42], json=json_path, plot=None)
    assert builtin.run(args, out=out) == 0
    text = out.getvalue()
    header = next(line for line in text.splitlines() if line.startswith("policy"))
    for col in builtin.COLUMNS:
        assert col in header
    assert "fragmentation" in text and "bestfit" in text and "top reasons" in text
    doc = json.loads(json_path.read_text())
    assert {r["policy"] for r in doc["summary"]} == {"fragmentation", "bestfit"}
    assert all(r["leaked_slices"] == 0 for r in doc["runs"])


def test_default_policy_means_every_baseline() -> None:
    from gpuslice.config import default_policy_spec

    for spec in (None, "default", default_policy_spec()):
        names = builtin.policies_from(spec)
        assert names[0] == builtin.DEFAULT_POLICY == default_policy_spec()
        assert set(builtin.BAR_BASELINES) | {"fragmentation", "cost", "utilization"} <= set(names)
    assert builtin.policies_from("fragmentation") == ["fragmentation"]
    assert builtin.policies_from("fragmentation:0.7+cost:0.3,bestfit") == ["fragmentation:0.7,cost:0.3", "bestfit"]
    assert builtin.label(builtin.DEFAULT_POLICY).startswith("default (")


def test_bar_verdict_names_the_default_and_keeps_own_policies_apart() -> None:
    def row(policy: str, pending: float, gpus: float, cost: float) -> dict[str, object]:
        return {"policy": policy, "pending": pending, "GPUs avg": gpus, "$/h avg": cost}

    rows = [row(builtin.DEFAULT_POLICY, 1, 1, 1), *(row(b, 2, 2, 2) for b in builtin.BAR_BASELINES),
            row("cost", 3, 3, 0.5)]
    text = builtin.bar_verdict(rows)
    assert text.startswith(f"bar met: {builtin.DEFAULT_LABEL}")
    assert "own single policies: not strictly better than cost" in text


def test_unknown_policy_is_refused() -> None:
    args = argparse.Namespace(policy="nosuch", seeds=[42], json=None, plot=None)
    assert builtin.run(args, out=io.StringIO()) == 2


def test_the_day_plot_draws_one_line_per_policy_and_seed() -> None:
    from simulator.builtin import plot_figure, run_all

    results = run_all(["bestfit", "spread"], [42, 43], margin=0.0)
    fig = plot_figure(results)
    top, bottom = fig.axes
    assert len(top.lines) == len(bottom.lines) == 4
    assert sorted(t for t in (ln.get_label() for ln in top.lines) if not t.startswith("_")) == ["bestfit", "spread"]
    assert "seeds 42, 43" in top.get_title()
