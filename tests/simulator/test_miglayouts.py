"""Dynamic MIG layouts in the simulator: the core's re-cuts applied to a replay, counted, never on a held unit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuslice.config import default_policy_spec, load_config
from gpuslice.fakecluster import FakeClusterSpec, generate
from gpuslice.miglayout import Recut, legal
from gpuslice.packing.state import KIND_MIG
from simulator.cli import main
from simulator.engine import EngineOptions, replay
from simulator.kubefile import inflate_requests, load_kube_cluster
from simulator.llm.cluster import build_cluster
from simulator.llm.engine import replay as day_replay
from simulator.llm.workload import generate as day_workload
from simulator.miglayouts import DynamicLayouts, dynamic_products, physical_slices

H100 = frozenset({"H100-80GB"})


@pytest.fixture(scope="module")
def fc_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    fc = generate(FakeClusterSpec(nodes=4, gpus_per_node=4, mode="mig", pods_per_node=6, seed=3))
    path = tmp_path_factory.mktemp("fc") / "fc.json"
    path.write_text(json.dumps(fc.document))
    return path


def _layouts_legal(dyn: DynamicLayouts) -> bool:
    st = dyn.state
    for v in range(st.n_nodes):
        by_gpu: dict[int, list[tuple[str, int]]] = {}
        for u in st.node_rows(v).tolist():
            if st.unit_kind[u] == KIND_MIG:
                by_gpu.setdefault(int(st.unit_gpu_index[u]), []).append(dyn.slots[u])
        if not all(legal("H100-80GB", tuple(sorted(slots))) for slots in by_gpu.values()):
            return False
    return True


def test_dynamic_layouts_place_more_and_never_destroy_a_held_instance(fc_file: Path) -> None:
    cl = load_kube_cluster([fc_file])
    inv = {s.name: i for s, i in cl.nodes}
    phys = physical_slices(inv.values(), H100)
    assert phys == 4 * 4 * 7 and cl.state().total_slices < phys
    reqs = inflate_requests(cl.requests, phys, 42, 1.3)
    opts = EngineOptions(mode="protocol", slices=7)
    static = replay(cl.state(), reqs, cl.requests, default_policy_spec(), 42, opts, capacity=phys)
    st = cl.state()
    dyn = DynamicLayouts.build(st, inv, H100, memory_tolerance=cl.memory_tolerance, wait_s=0.0)
    dynamic = replay(st, reqs, cl.requests, default_policy_spec(), 42, opts, layouts=dyn, capacity=phys)
    assert dyn.recuts > 0 and dyn.busy_refused == 0
    assert dynamic.allocated[-1] > static.allocated[-1]
    assert _layouts_legal(dyn)


def test_a_recut_naming_a_held_instance_is_refused_and_counted(fc_file: Path) -> None:
    cl = load_kube_cluster([fc_file])
    st = cl.state()
    dyn = DynamicLayouts.build(st, {s.name: i for s, i in cl.nodes}, H100, memory_tolerance=0.03)
    u = next(u for u in st.node_rows(0).tolist() if st.unit_kind[u] == KIND_MIG)
    st.take(0, [u], int(st.unit_cap[u]), 0, 0)
    slot = dyn.slots[u]
    recut = Recut(st.node_names[0], st.unit_gpu[u], int(st.unit_gpu_index[u]), "H100-80GB", (st.unit_instance[u],),
                  (), (), "p", None)
    assert not dyn.apply(recut) and dyn.busy_refused == 1 and dyn.slots[u] == slot and dyn.recuts == 0


def test_dynamic_products_follow_flag_then_config() -> None:
    cfg = load_config({"version": "v1", "migLayouts": {"H100-80GB": {"dynamic": True}, "A100-80GB": {}}})
    assert dynamic_products(None, cfg) == H100
    assert dynamic_products("static", cfg) == frozenset()
    assert "A30-24GB" in dynamic_products("dynamic", None)
    assert dynamic_products(None, None) == frozenset()


def test_the_llm_day_waits_for_recuts_and_runs_more() -> None:
    # Two MIG nodes under a day's demand: pods refused for shape wait 10 s for a re-cut and then run.
    cluster = build_cluster((("h100-mig-b", 1, 0), ("a100-mig", 1, 0)))
    work = day_workload(46, owners=10, jobs_per_hour=0.5, scale=1.0)
    static = day_replay(cluster, work, "fragmentation")
    dynamic = day_replay(cluster, work, "fragmentation", mig_dynamic=frozenset({"H100-80GB", "A100-80GB"}))
    assert static.pods_recut == 0 and static.recuts == 0
    assert dynamic.pods_recut > 0 and dynamic.busy_instances_destroyed == 0 and dynamic.leaked_slices == 0
    assert dynamic.running_pod_hours > static.running_pod_hours
    assert dynamic.recut_wait_pod_hours == pytest.approx(dynamic.pods_recut * 10 / 3600)


def test_cli_mig_layouts_flag(fc_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nodes", str(fc_file), "--pods", str(fc_file), "--mig-layouts", "dynamic", "--seeds", "42"]) == 0
    out = capsys.readouterr().out
    assert "dynamic MIG layouts: {'recuts':" in out and "capacity counts every compute slice" in out
    assert main(["--nodes", str(fc_file), "--pods", str(fc_file), "--mig-layouts", "dynamic", "--mode", "wide"]) == 2
    assert "protocol only" in capsys.readouterr().err
    assert main(["--nodes", "n.csv", "--pods", "p.csv", "--mig-layouts", "dynamic"]) == 2
    assert "openb CSV traces: their nodes have no MIG GPUs" in capsys.readouterr().err
