"""``gpu-slice simulate --config``: the services' config decides the replay, bad fields stop it by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuslice_cli.main import main as gpu_slice


def _fake(tmp_path: Path) -> Path:
    out = tmp_path / "cluster.yaml"
    assert gpu_slice(["fake-cluster", "--nodes", "3", "--gpus-per-node", "2", "--mode", "mixed",
                      "--pods-per-node", "2", "--seed", "3", "-o", str(out)]) == 0
    return out


def test_a_bad_config_field_stops_the_run_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("version: v1\nmemoryTolerance: 0.9\n")
    cluster = _fake(tmp_path)
    assert gpu_slice(["simulate", "--nodes", str(cluster), "--pods", str(cluster), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "memoryTolerance: must be <= 0.2" in err


def test_missing_config_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = _fake(tmp_path)
    assert gpu_slice(["simulate", "--nodes", str(cluster), "--pods", str(cluster), "--config",
                      str(tmp_path / "nope.yaml")]) == 2
    assert "--config" in capsys.readouterr().err


def test_config_policies_are_the_default_when_no_policy_is_given(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("version: v1\npolicies: [{name: bestfit, weight: 2}, {name: spread, weight: 1}]\n")
    cluster = _fake(tmp_path)
    report = tmp_path / "out.json"
    assert gpu_slice(["simulate", "--nodes", str(cluster), "--pods", str(cluster), "--config", str(cfg),
                      "--json", str(report)]) == 0
    runs = json.loads(report.read_text())["runs"]
    assert {r["policy"] for r in runs} == {"bestfit:2,spread:1"}


def test_config_isolation_default_reaches_the_pods(tmp_path: Path) -> None:
    from gpuslice.config import load_config_text
    from simulator.kubefile import load_kube_cluster

    cluster = _fake(tmp_path)
    plain = load_kube_cluster([cluster])
    pinned = load_kube_cluster([cluster], config=load_config_text("version: v1\nisolationDefault: mig\n"))
    assert {r.isolation for r in plain.requests if r.gpus} == {"any"}
    assert {r.isolation for r in pinned.requests if r.gpus} == {"mig"}
