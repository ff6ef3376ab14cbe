"""Reading a v1 List (fake-cluster output or a kubectl dump) for the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuslice_cli.main import main as gpu_slice
from simulator.kubefile import KubeFileError, load_kube_cluster, looks_like_kube_list


def _fake(tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "cluster.yaml"
    assert gpu_slice(["fake-cluster", "--nodes", "3", "--gpus-per-node", "4", "--product", "H100-80GB",
                      "--mode", "mixed", "--pods-per-node", "3", "--seed", "5", "-o", str(out), *extra]) == 0
    return out


def test_fake_cluster_output_loads_as_an_empty_cluster_with_its_pods(tmp_path: Path) -> None:
    cluster = load_kube_cluster([_fake(tmp_path)])
    assert len(cluster.nodes) == 3 and cluster.gpus == 12
    assert cluster.slices_per_gpu == 7
    assert len(cluster.requests) == 9
    assert all(inv.used == frozenset() for _, inv in cluster.nodes)
    assert all(r.gpus >= 1 and r.owner for r in cluster.requests)
    state = cluster.state()
    assert state.allocated_slices == 0 and state.n_nodes == 3


def test_file_kind_is_chosen_by_suffix() -> None:
    assert looks_like_kube_list("c.yaml") and looks_like_kube_list("c.JSON")
    assert not looks_like_kube_list("openb_pod_list_default.csv")


def test_refusals_name_the_file_and_object(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("apiVersion: v1\nkind: List\nitems: []\n")
    with pytest.raises(KubeFileError, match=r"empty\.yaml: no Node with an example\.com/gpu-slice\.inventory"):
        load_kube_cluster([empty])
    broken = tmp_path / "broken.yaml"
    limit = "          example.com/gpu-slice: '"
    broken.write_text(_fake(tmp_path).read_text().replace(limit, limit + "-", 1))
    with pytest.raises(KubeFileError, match=r"broken.yaml: pod default/\S+: .*must not be negative"):
        load_kube_cluster([broken])
    with pytest.raises(KubeFileError, match=r"missing\.yaml: cannot read"):
        load_kube_cluster([tmp_path / "missing.yaml"])


def test_simulate_replays_a_v1_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = _fake(tmp_path)
    report = tmp_path / "out.json"
    assert gpu_slice(["simulate", "--nodes", str(cluster), "--pods", str(cluster), "--policy", "fgd,bestfit",
                      "--seeds", "42", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "cluster      fgd" in out and "cluster      bestfit" in out
    runs = json.loads(report.read_text())["runs"]
    assert {r["policy"] for r in runs} == {"fgd", "bestfit"}
    assert all(r["pods_placed"] > 0 for r in runs)


def test_simulate_refuses_mixed_formats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = _fake(tmp_path)
    csv = tmp_path / "pods.csv"
    csv.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n")
    assert gpu_slice(["simulate", "--nodes", str(cluster), "--pods", str(csv)]) == 2
    assert "not both" in capsys.readouterr().err
