"""``gpu-slice fake-cluster``: output loads back through the codecs and the counting rule."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from gpuslice import annotations as ann
from gpuslice.catalogue import PRODUCTS
from gpuslice.counting import held_slices
from gpuslice.fakecluster import ClusterMode, FakeClusterError, FakeClusterSpec, generate, random_mig_layout
from gpuslice.kubelist import dump_list, load_cluster, load_cluster_text, parse_list_text
from gpuslice.placement import enumerate_placements, suits
from gpuslice.requests import parse_request
from gpuslice_cli import fake_cluster
from gpuslice_cli.main import main as gpu_slice_main

NOW = datetime(2025, 1, 1, tzinfo=UTC)


def cli(tmp_path: Path, *args: str) -> tuple[int, str]:
    out = tmp_path / "cluster.yaml"
    rc = fake_cluster.main([*args, "-o", str(out)])
    return rc, out.read_text() if out.exists() else ""


@pytest.mark.parametrize("mode", ["mps", "mig", "whole", "mixed"])
def test_cli_output_loads_back(tmp_path: Path, mode: ClusterMode) -> None:
    rc, text = cli(tmp_path, "--nodes", "4", "--gpus-per-node", "8", "--product", "H100-80GB", "--mode", mode,
                   "--pods-per-node", "6", "--seed", "11")
    assert rc == 0
    doc = yaml.safe_load(text)
    assert doc["apiVersion"] == "v1" and doc["kind"] == "List"
    view = load_cluster_text(text, now=NOW)
    assert view.problems == ()
    assert len(view.inventories) == 4
    pods = [i for i in doc["items"] if i["kind"] == "Pod"]
    assert len(pods) == 24 - generate(FakeClusterSpec(nodes=4, mode=mode, pods_per_node=6, seed=11)).unplaced
    assert len(pods) >= 12
    # every pod's ids are held exactly once, by that pod, and form a placement that suits its request
    for name, inv in view.inventories.items():
        holdings = view.holdings[name]
        on_node = [p for p in pods if p["spec"]["nodeName"] == name]
        assert set(holdings.held) == {p["metadata"]["uid"] for p in on_node}
        all_ids = [sid for h in holdings.held.values() for sid in h.slice_ids]
        assert len(all_ids) == len(set(all_ids))
        assert inv.used == frozenset(all_ids)
        for p in on_node:
            request = parse_request(p)
            assert request is not None
            held = holdings.held[p["metadata"]["uid"]]
            assert held.source == "allocated" and not held.drift
            assignment = ann.decode_assignment_for(p)
            assert assignment is not None and assignment.size == request.slices
            # the pod's ids are one of the placements the core enumerates on the node without it
            freed = inv.release(held.slice_ids)
            options = {pl.slice_ids: pl for pl in enumerate_placements(freed, request).placements}
            matching = [pl for pl in enumerate_placements(freed, request).placements
                        if frozenset(pl.slice_ids) == held.slice_ids]
            assert matching or (assignment.instance is None and len(assignment.gpus) == 1), options
            gpu = inv.gpu(assignment.gpus[0])
            if gpu.mode == "mps":  # mps placements name the lowest free ordinals; check shape instead
                assert all(inv.gpu_of(sid).uuid == gpu.uuid for sid in held.slice_ids)
                assert len(held.slice_ids) == request.slices <= gpu.slices
            for pl in matching:
                assert suits(pl, request, inv)


def test_node_object_shape(tmp_path: Path) -> None:
    rc, text = cli(tmp_path, "--nodes", "1", "--gpus-per-node", "8", "--product", "H100-80GB", "--mode", "mig")
    assert rc == 0
    (node,) = parse_list_text(text)
    labels = node["metadata"]["labels"]
    assert labels[ann.MODE_LABEL] == "mig"
    assert labels[ann.PRODUCT_LABEL] == "H100-80GB"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels["node.kubernetes.io/instance-type"] == "p5.48xlarge"
    assert labels["karpenter.sh/capacity-type"] in ("on-demand", "spot")
    assert float(node["metadata"]["annotations"][ann.HOURLY_COST_KEY]) > 0
    gpus = ann.decode_inventory(node["metadata"]["annotations"][ann.INVENTORY_KEY])
    assert len(gpus) == 8 and all(g.mode == "mig" for g in gpus)
    assert all(g.uuid.startswith("GPU-") and len(g.uuid) == 40 for g in gpus)
    slices = sum(g.slices for g in gpus)
    assert node["status"]["capacity"]["example.com/gpu-slice"] == str(slices)
    assert node["status"]["allocatable"]["example.com/gpu-slice"] == str(slices)
    assert {"cpu", "memory", "pods"} <= set(node["status"]["capacity"])


def test_mig_layouts_vary_and_are_legal() -> None:
    for name in ("H100-80GB", "A30-24GB", "H200-141GB", "A100-40GB"):
        prod = PRODUCTS[name]
        layouts = {tuple((p.name, s) for p, s in random_mig_layout(prod, random.Random(seed))) for seed in range(40)}
        assert len(layouts) > 3, name
    cluster = generate(FakeClusterSpec(nodes=3, gpus_per_node=8, mode="mixed", seed=5))
    modes = {g.mode for inv in cluster.inventories for g in inv.gpus}
    assert modes == {"mig", "mps", "whole"}


def test_mixed_on_a_non_mig_product_uses_mps_and_whole() -> None:
    cluster = generate(FakeClusterSpec(nodes=2, gpus_per_node=8, product="L4", mode="mixed", seed=1))
    assert {g.mode for inv in cluster.inventories for g in inv.gpus} == {"mps", "whole"}


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    args = ("--nodes", "3", "--mode", "mixed", "--pods-per-node", "4")
    assert cli(tmp_path, *args, "--seed", "7") == cli(tmp_path, *args, "--seed", "7")
    assert cli(tmp_path, *args, "--seed", "7")[1] != cli(tmp_path, *args, "--seed", "8")[1]


def test_owner_spread_no_two_pods_of_one_owner_on_a_gpu() -> None:
    cluster = generate(FakeClusterSpec(nodes=2, gpus_per_node=2, mode="mps", pods_per_node=10, seed=3))
    pods = [i for i in cluster.document["items"] if i["kind"] == "Pod"]
    seen: set[tuple[str, str]] = set()
    for p in pods:
        owner = p["metadata"]["ownerReferences"][0]["uid"]
        for gpu in ann.decode_assignment_for(p).gpus:  # type: ignore[union-attr]
            assert (owner, gpu) not in seen
            seen.add((owner, gpu))


def test_pods_that_do_not_fit_are_counted(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cluster = generate(FakeClusterSpec(nodes=1, gpus_per_node=1, mode="whole", pods_per_node=3))
    assert cluster.unplaced == 2
    rc, _ = cli(tmp_path, "--nodes", "1", "--gpus-per-node", "1", "--mode", "whole", "--pods-per-node", "3")
    assert rc == 0
    assert "2 of 3 pods did not fit" in capsys.readouterr().err


def test_load_cluster_reports_bad_nodes_and_pods() -> None:
    cluster = generate(FakeClusterSpec(nodes=2, gpus_per_node=2, pods_per_node=2, seed=2))
    items = [dict(i) for i in cluster.document["items"]]
    bad_node = {**items[0], "metadata": {**items[0]["metadata"],
                                         "annotations": {ann.INVENTORY_KEY: '{"v": 9}'}}}
    pod = items[2]
    bad_pod = {**pod, "metadata": {**pod["metadata"], "annotations": {ann.ASSIGNMENT_KEY: "nope"}}}
    view = load_cluster([bad_node, items[1], bad_pod, *items[3:]], now=NOW)
    assert list(view.inventories) == [items[1]["metadata"]["name"]]
    assert view.problems[0] == (f"node {items[0]['metadata']['name']}: unsupported version 9 of "
                                "example.com/gpu-slice.inventory; this build reads version 1")
    assert any("is not valid JSON" in p for p in view.problems)


def test_cordon_annotation_marks_gpus_cordoned() -> None:
    cluster = generate(FakeClusterSpec(nodes=1, gpus_per_node=2, seed=2))
    node = cluster.document["items"][0]
    uuid = cluster.inventories[0].gpus[1].uuid
    node["metadata"]["annotations"][ann.CORDON_KEY] = uuid
    view = load_cluster([node], now=NOW)
    inv = next(iter(view.inventories.values()))
    assert [g.cordoned for g in inv.gpus] == [False, True]


def test_dump_is_kubectl_like_and_parses() -> None:
    cluster = generate(FakeClusterSpec(nodes=1, gpus_per_node=1, pods_per_node=1, seed=4))
    text = dump_list(cluster.document)
    assert text.startswith("apiVersion: v1\nitems:\n")
    assert len(parse_list_text(text)) == 2
    node_name = cluster.inventories[0].node
    pods = [i for i in yaml.safe_load(text)["items"] if i["kind"] == "Pod"]
    assert set(held_slices(node_name, pods, now=NOW, reservation_ttl=timedelta(0)).held) == {
        pods[0]["metadata"]["uid"]}


@pytest.mark.parametrize(("args", "message"), [
    (["--nodes", "0"], "gpu-slice fake-cluster: error: --nodes must be between 1 and 100000, got 0\n"),
    (["--nodes", "1", "--product", "B300"],
     "gpu-slice fake-cluster: error: unknown GPU product 'B300'; known: " + ", ".join(PRODUCTS) + "\n"),
    (["--nodes", "1", "--product", "T4", "--mode", "mig"],
     "gpu-slice fake-cluster: error: product T4 does not support MIG; MIG-capable: A100-40GB, A100-80GB, "
     "H100-80GB, H200-141GB, A30-24GB\n"),
    (["--nodes", "1", "--slices", "0"],
     "gpu-slice fake-cluster: error: --slices must be between 1 and 48 (the MPS client limit), got 0\n"),
    (["--nodes", "1", "--slices", "49"],
     "gpu-slice fake-cluster: error: --slices must be between 1 and 48 (the MPS client limit), got 49\n"),
    (["--nodes", "1", "--gpus-per-node", "0"],
     "gpu-slice fake-cluster: error: --gpus-per-node must be between 1 and 64, got 0\n"),
    (["--nodes", "1", "--pods-per-node", "-1"],
     "gpu-slice fake-cluster: error: --pods-per-node must not be negative, got -1\n"),
    (["--nodes", "1", "--product", "G1"],
     "gpu-slice fake-cluster: error: product G1 has no known memory size; pick a named model\n"),
    (["--nodes", "1", "--time", "now"],
     "gpu-slice fake-cluster: error: --time 'now' is not an RFC 3339 timestamp such as 2025-01-01T00:00:00Z\n"),
    (["--nodes", "1", "--time", "0001-01-01T00:00:00Z"],
     "gpu-slice fake-cluster: error: --time must be 0001-01-08T00:00:00Z or later (nodes are dated 7 days "
     "before it), got 0001-01-01T00:00:00Z\n"),
])
def test_cli_refusals_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                             message: str) -> None:
    out = tmp_path / "x.yaml"
    assert fake_cluster.main([*args, "-o", str(out)]) == 2
    assert capsys.readouterr().err == message
    assert not out.exists()


def test_argparse_refusals_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        fake_cluster.main(["--nodes", "1", "--mode", "shared"])
    assert exit_.value.code == 2
    assert "invalid choice: 'shared'" in capsys.readouterr().err


def test_dispatcher_runs_fake_cluster(tmp_path: Path) -> None:
    out = tmp_path / "c.yaml"
    assert gpu_slice_main(["fake-cluster", "--nodes", "1", "--gpus-per-node", "2", "-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["kind"] == "List"
    assert gpu_slice_main(["fake-cluster", "--nodes", "0", "-o", str(out)]) == 2


def test_spec_validation_direct() -> None:
    with pytest.raises(FakeClusterError, match="node prefix 'Bad_Prefix' is not a valid DNS label start"):
        generate(FakeClusterSpec(nodes=1, node_prefix="Bad_Prefix"))


def test_earliest_time_is_accepted_and_the_one_before_refused() -> None:
    earliest = datetime(1, 1, 8, tzinfo=UTC)
    assert generate(FakeClusterSpec(nodes=1, gpus_per_node=1, pods_per_node=2, now=earliest)).document["items"]
    with pytest.raises(FakeClusterError, match="--time must be 0001-01-08T00:00:00Z or later"):
        generate(FakeClusterSpec(nodes=1, now=earliest - timedelta(microseconds=1)))
