"""``gpu-slice status``: kubectl-style tables, ``-o json|yaml``, the live read through the real
Kubernetes client (against the fake API server) and honest refusals of bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice import annotations as ann
from gpuslice_cli import main as cli
from gpuslice_cli.status import render
from gpuslice_cli.tables import table
from tests.fakeapi.fixtures import fake_api  # noqa: F401
from tests.fakeapi.server import FakeApiServer
from tests.gpuslice.test_view import A_LAYOUT, mig_gpu, mps_gpu, node_obj, pod_obj, sids


def objects() -> list[dict[str, Any]]:
    mps, mig = mps_gpu("n1", 0), mig_gpu("n1", 1, A_LAYOUT)
    return [node_obj("n1", [mps, mig]),
            pod_obj("a", 4, node="n1", assigned=sids(mps.uuid, 4), allocated=sids(mps.uuid, 4)),
            pod_obj("big", 7)]


def dump(tmp_path: Path, items: list[dict[str, Any]]) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}))
    return path


def write_kubeconfig(tmp_path: Path, server: str) -> Path:
    """A kubeconfig for the fake API server (plain HTTP, no credentials)."""
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}],
        "users": [{"name": "u", "user": {}}]}))
    return path


def test_table_is_printed_as_kubectl_prints() -> None:
    out = table(["name", "slices"], [["a", 7], ["longer-name", ""]])
    assert out.splitlines() == ["NAME          SLICES", "a             7", "longer-name   <none>"]


def test_status_of_a_dump_prints_units_capacity_and_the_pending_pod(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--cluster", str(dump(tmp_path, objects()))]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["NODE", "GPU", "PRODUCT", "MODE", "INSTANCE", "SLICES", "FREE", "STRANDED", "PODS"]
    mps_row = next(ln for ln in lines if " mps " in ln)
    # 3 free slices, and the shapes known ask 4 and 7: stranded.
    assert mps_row.split() == ["n1", "0", "H100-80GB", "mps", "-", "7", "3", "3", "ns/pod-a(4)"]
    assert any(ln.split()[:5] == ["n1", "1", "H100-80GB", "mig", "3g.40gb@0"] for ln in lines)
    pending = next(ln for ln in lines if ln.startswith("ns/pod-big"))
    assert "no MIG instance here has 7 compute slices" in pending and "re-cut idle MIG GPU 1" in pending
    assert "PENDING POD" in out and "STRANDED" in out


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_json_and_yaml_carry_the_same_data(tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    assert cli.main(["status", "--cluster", str(dump(tmp_path, objects())), "-o", fmt]) == 0
    text = capsys.readouterr().out
    data = json.loads(text) if fmt == "json" else yaml.safe_load(text)
    assert data["kind"] == "ClusterStatus" and data["capacity"]["gpus"] == 2
    (pending,) = data["pending"]
    assert pending["pod"] == "ns/pod-big" and pending["suggestions"][0]["kind"] == "recut"
    gpus = data["nodes"][0]["gpus"]
    assert gpus[0]["units"][0]["holders"][0]["pod"] == "ns/pod-a"


def test_wide_shows_uuids_and_every_suggestion(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--cluster", str(dump(tmp_path, objects())), "-o", "wide"]) == 0
    out = capsys.readouterr().out
    assert "UUID" in out.splitlines()[0] and "GPU-n1-0000" in out
    assert " | add a node with" in out


def test_live_status_reads_nodes_and_pods_through_the_kubernetes_client(
        fake_api: FakeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    for obj in objects():
        body = {k: v for k, v in obj.items() if k != "kind"}
        if obj["kind"] == "Node":
            fake_api.store.put_node(body)
        else:
            fake_api.store.put_pod(body)
    kubeconfig = write_kubeconfig(tmp_path, fake_api.url)
    assert cli.main(["status", "--kubeconfig", str(kubeconfig), "-o", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["pod"] for p in data["pending"]] == ["ns/pod-big"]
    assert data["capacity"]["held"] == 4


def test_bad_input_is_refused_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--cluster", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: v1\nkind: List\nitems: 3\n")
    assert cli.main(["status", "--cluster", str(bad)]) == 2
    assert "gpu-slice status: --cluster" in capsys.readouterr().err
    cfg = tmp_path / "config.yaml"
    cfg.write_text("version: v1\nslices: 0\n")
    assert cli.main(["status", "--cluster", str(dump(tmp_path, objects())), "--config", str(cfg)]) == 2
    assert "slices" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["status", "-o", "xml"])
    assert render is not None and ann.INVENTORY_KEY


def test_without_flags_it_uses_the_kubeconfig_kubectl_would(
        fake_api: FakeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = write_kubeconfig(tmp_path, fake_api.url)
    # The client reads $KUBECONFIG (else ~/.kube/config) once, when it is first imported.
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    assert cli.main(["status", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["nodes"] == []
    assert cli.main(["status", "--kubeconfig", str(tmp_path / "nowhere")]) == 2
    assert "cannot use" in capsys.readouterr().err


def test_each_mig_gpu_shows_its_actual_and_wanted_layout_and_why_a_recut_waits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """issue 51: the extender's wish on the Node beside the layout the plugin advertises, and the
    plugin's last word on it; ``-o json`` carries the same rows."""
    from datetime import UTC, datetime

    from gpuslice.layoutwire import LAYOUT_KEY, WantedGpu, WantedLayouts, encode_wanted

    items = objects()
    mig = mig_gpu("n1", 1, A_LAYOUT)
    want = (("1g.10gb", 6), ("3g.40gb", 0), ("3g.40gb", 4))
    items[0]["metadata"]["annotations"][LAYOUT_KEY] = encode_wanted(
        WantedLayouts(1, datetime(2026, 1, 1, tzinfo=UTC), (WantedGpu(mig.uuid, want),)))
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\nmigLayouts:\n  H100-80GB:\n    dynamic: true\n")
    path = dump(tmp_path, items)
    assert cli.main(["status", "--cluster", str(path), "--config", str(config)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("NODE") and "PENDING RE-CUT" in ln)
    row = lines[header + 1].split(None, 6)
    assert row[:4] == ["n1", mig.uuid, "H100-80GB", "dynamic"]
    assert row[4] == "1g.10gb@6,2g.20gb@4,3g.40gb@0" and row[5] == "1g.10gb@6,3g.40gb@0,3g.40gb@4"
    assert row[6].startswith("re-cut to [1g.10gb@6, 3g.40gb@0, 3g.40gb@4] not applied yet")
    assert cli.main(["status", "--cluster", str(path), "-o", "json"]) == 0  # no config: static
    (layout,) = json.loads(capsys.readouterr().out)["migLayouts"]
    assert layout["gpu"] == mig.uuid and layout["dynamic"] is False
    assert [tuple(s) for s in layout["wanted"]] == list(want)
