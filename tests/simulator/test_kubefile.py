"""Reading a v1 List (fake-cluster output or a kubectl dump) for the simulator."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

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
    with pytest.raises(KubeFileError, match=r"missing\.yaml: cannot read"):
        load_kube_cluster([tmp_path / "missing.yaml"])


def _hostile(tmp_path: Path, kind: str, mutate: Callable[[dict[str, Any]], None]) -> Path:
    doc = yaml.safe_load(_fake(tmp_path).read_text())
    item = next(i for i in doc["items"] if i["kind"] == kind)
    mutate(item)
    out = tmp_path / "hostile.json"
    out.write_text(json.dumps(doc))
    return out


def test_a_bad_pod_is_reported_and_the_rest_replayed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A live snapshot holds pods no scheduler can place as written: each is named, none stops the replay."""
    broken = tmp_path / "broken.yaml"
    doc = yaml.safe_load(_fake(tmp_path).read_text())
    for pod in [i for i in doc["items"] if i["kind"] == "Pod"][:2]:  # two pods with negative slice counts
        for c in pod["spec"]["containers"]:
            for part in ("requests", "limits"):
                if "example.com/gpu-slice" in c["resources"].get(part, {}):
                    c["resources"][part]["example.com/gpu-slice"] = "-2"
    broken.write_text(yaml.safe_dump(doc))
    cluster = load_kube_cluster([broken])
    assert len(cluster.requests) == 7 and len(cluster.skipped) == 2
    assert all(re.match(r".*broken\.yaml: item \d+: pod default/\S+: .*must not be negative", line)
               for line in cluster.skipped), cluster.skipped
    report = tmp_path / "out.json"
    assert gpu_slice(["simulate", "--nodes", str(broken), "--pods", str(broken), "--policy", "bestfit",
                      "--seeds", "42", "--json", str(report)]) == 0
    err = capsys.readouterr().err
    assert err.count("gpu-slice simulate: skipped ") == 2 and "2 object(s) skipped" in err
    assert len(json.loads(report.read_text())["meta"]["skipped"]) == 2


@pytest.mark.parametrize(("kind", "mutate", "says"), [
    ("Node", lambda n: n.__setitem__("status", "Ready"), r"node \S+: status must be an object"),
    ("Node", lambda n: n["metadata"].__setitem__("labels", ["a", "b"]),
     r"node \S+: metadata\.labels must be an object"),
    ("Pod", lambda p: p["metadata"].__setitem__("ownerReferences", "rs"), r"metadata\.ownerReferences must be a list"),
    ("Pod", lambda p: p["spec"].__setitem__("priority", "high"), r"spec\.priority must be an integer"),
])
def test_hostile_objects_are_skipped_by_name(tmp_path: Path, kind: str, mutate: Callable[[dict[str, Any]], None],
                                             says: str) -> None:
    cluster = load_kube_cluster([_hostile(tmp_path, kind, mutate)])
    (line,) = cluster.skipped
    assert re.match(rf".*hostile\.json: item \d+: .*{says}", line), line


def test_non_utf8_file_is_refused_by_name(tmp_path: Path) -> None:
    binary = tmp_path / "latin1.yaml"
    binary.write_bytes(_fake(tmp_path).read_bytes() + b"\n# caf\xe9\n")
    with pytest.raises(KubeFileError, match=r"latin1\.yaml: not UTF-8 text"):
        load_kube_cluster([binary])


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
    # Where each pod landed, by UID: a node of the list, then a GPU or MIG instance of that node.
    loaded = load_kube_cluster([cluster])
    targets = {inv.node: {t for g in inv.gpus for t in (g.uuid, *(i.uuid for i in g.instances))}
               for _, inv in loaded.nodes}
    for r in runs:
        where = r["placements"]
        assert {q.uid for q in loaded.requests} <= set(where)  # with the inflated copies (--inflate)
        landed = {uid: w for uid, w in where.items() if w}
        assert len(landed) == r["pods_placed"] and len(where) == r["pods"]
        for w in landed.values():
            node, _, rest = w.partition("/")
            assert node in targets or not rest, w
            assert all(t in targets[node] for t in rest.split("+") if rest), w


def test_simulate_refuses_mixed_formats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = _fake(tmp_path)
    csv = tmp_path / "pods.csv"
    csv.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n")
    assert gpu_slice(["simulate", "--nodes", str(cluster), "--pods", str(csv)]) == 2
    assert "not both" in capsys.readouterr().err
