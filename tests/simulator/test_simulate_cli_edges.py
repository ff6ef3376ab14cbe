"""``gpu-slice simulate`` at its edges: refusals that name the flag or file, before any run starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuslice_cli.main import main as gpu_slice
from simulator import builtin
from simulator.llm.cluster import build_cluster

NODES = "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(f"n{i},32000,128000,2,T4\n" for i in range(4))
PODS = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n" + "".join(f"p{i},1000,1000,1,500\n" for i in range(6))


@pytest.fixture
def csvs(tmp_path: Path) -> tuple[Path, Path]:
    nodes, pods = tmp_path / "nodes.csv", tmp_path / "openb_pod_list_tiny.csv"
    nodes.write_text(NODES)
    pods.write_text(PODS)
    return nodes, pods


@pytest.fixture
def kube_list(tmp_path: Path) -> Path:
    out = tmp_path / "cluster.yaml"
    assert gpu_slice(["fake-cluster", "--nodes", "2", "--gpus-per-node", "2", "--pods-per-node", "2",
                      "-o", str(out)]) == 0
    return out


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``gpu-slice simulate ARGV``, expect exit 2 with nothing on stdout; the one-line error."""
    try:
        rc = gpu_slice(["simulate", *argv])
    except SystemExit as exit_:  # argparse's own refusals
        rc = int(exit_.code or 0)
    assert rc == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert lines and "Traceback" not in captured.err
    return lines[-1]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "abc"])
def test_inflate_must_be_finite_and_not_negative(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert "argument --inflate" in refused([f"--inflate={value}"], capsys)


def test_a_workload_without_gpu_demand_is_replayed_as_listed(csvs: tuple[Path, Path], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    nodes, _ = csvs
    cpu_only = tmp_path / "cpu.csv"
    cpu_only.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\nc0,1000,1000,0,0\nc1,1000,1000,0,0\n")
    assert gpu_slice(["simulate", "--nodes", str(nodes), "--pods", str(cpu_only), "--policy", "bestfit"]) == 0
    captured = capsys.readouterr()
    assert "no pod asks for a GPU" in captured.err and "replayed as listed" in captured.err
    assert "placed=2/2" in captured.out


def test_a_node_list_without_gpus_is_refused(csvs: tuple[Path, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    _, pods = csvs
    cpu_nodes = tmp_path / "cpu_nodes.csv"
    cpu_nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nc,1000,1000,0,\n")
    assert "has no GPUs" in refused(["--nodes", str(cpu_nodes), "--pods", str(pods)], capsys)


def test_non_utf8_pod_list_is_one_line_naming_the_file(csvs: tuple[Path, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    nodes, _ = csvs
    latin1 = tmp_path / "latin1.csv"
    latin1.write_bytes(PODS.encode() + b"caf\xe9,1,1,1,500\n")
    line = refused(["--nodes", str(nodes), "--pods", str(latin1)], capsys)
    assert str(latin1) in line and "line 8" in line and "UTF-8" in line


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_unwritable_outputs_are_refused_before_the_run(flag: str, csvs: tuple[Path, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    nodes, pods = csvs
    missing_dir = tmp_path / "no" / "such" / "out.png"
    line = refused(["--nodes", str(nodes), "--pods", str(pods), flag, str(missing_dir)], capsys)
    assert line.startswith(f"gpu-slice simulate: {flag} {missing_dir}: cannot write")
    assert f"{flag} {tmp_path}: is a folder" in refused([flag, str(tmp_path)], capsys)  # built-in day too
    assert not missing_dir.parent.exists()


def test_plot_format_is_checked_before_the_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "plot.docx"
    assert "--plot" in refused(["--plot", str(target)], capsys) and not target.exists()


def test_output_check_leaves_an_existing_file_alone(csvs: tuple[Path, Path], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    nodes, pods = csvs
    report = tmp_path / "r.json"
    report.write_text("old")
    line = refused(["--nodes", str(nodes), "--pods", str(pods), "--json", str(report), "--mode", "ideal",
                    "--narrow-margin", "0.5"], capsys)
    assert "--narrow-margin" in line and report.read_text() == "old"


def test_csv_pods_need_a_node_list(csvs: tuple[Path, Path], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    _, pods = csvs
    line = refused(["--pods", str(pods)], capsys)
    assert "--nodes" in line and "--trace-dir" in line
    assert "--trace-dir" in refused(["--trace-dir", str(tmp_path)], capsys)
    (tmp_path / "openb_node_list_gpu_node.csv").write_text(NODES)
    assert gpu_slice(["simulate", "--pods", str(pods), "--trace-dir", str(tmp_path), "--policy", "bestfit"]) == 0


def test_a_v1_list_carries_its_own_nodes(kube_list: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_slice(["simulate", "--pods", str(kube_list), "--policy", "bestfit"]) == 0
    assert "bestfit" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "flag"), [
    (["--inflate", "1.5"], "--inflate"),
    (["--slices", "10"], "--slices"),
    (["--mode", "wide"], "--mode"),
    (["--narrow-max-nodes", "2"], "--narrow-max-nodes"),
    (["--extender-weight", "2"], "--extender-weight"),
    (["--kube-scorer", "least-allocated"], "--kube-scorer"),
])
def test_flags_the_built_in_day_ignores_are_refused(argv: list[str], flag: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    line = refused(argv, capsys)
    assert line.startswith(f"gpu-slice simulate: {flag} does not apply to the built-in")


@pytest.mark.parametrize(("argv", "flag"), [
    (["--mode", "ideal", "--narrow-margin", "0.2"], "--narrow-margin"),
    (["--mode", "wide", "--narrow-max-nodes", "3"], "--narrow-max-nodes"),
    (["--mode", "paper", "--kube-scorer", "least-allocated"], "--kube-scorer"),
    (["--mode", "ideal", "--extender-weight", "3"], "--extender-weight"),
])
def test_flags_a_mode_ignores_are_refused(argv: list[str], flag: str, csvs: tuple[Path, Path],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    nodes, pods = csvs
    line = refused(["--nodes", str(nodes), "--pods", str(pods), *argv], capsys)
    assert line.startswith(f"gpu-slice simulate: {flag} does not apply to --mode {argv[1]}")


def test_flags_a_mode_uses_are_accepted(csvs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    nodes, pods = csvs
    base = ["--nodes", str(nodes), "--pods", str(pods), "--policy", "bestfit"]
    assert gpu_slice(["simulate", *base, "--mode", "wide", "--extender-weight", "2", "--kube-scorer",
                      "least-allocated"]) == 0
    assert gpu_slice(["simulate", *base, "--mode", "all", "--narrow-margin", "0.1", "--slices", "100"]) == 0
    assert gpu_slice(["simulate", *base, "--mode", "protocol", "--narrow-max-nodes", "2"]) == 0
    assert gpu_slice(["simulate", "--policy", "bestfit", "--narrow-margin", "0.05"]) == 0  # the built-in day


def test_v1_lists_refuse_slices_and_trace_names(kube_list: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "--slices does not apply to v1 List" in refused(["--nodes", str(kube_list), "--slices", "10"], capsys)
    assert "--traces" in refused(["--nodes", str(kube_list), "--traces", "default"], capsys)


def test_built_in_output_speaks_to_an_operator_without_a_verdict() -> None:
    def row(policy: str, pending: float) -> dict[str, object]:
        return {"policy": policy, "seeds": [42], "placed": 10.0, "pending": pending, "never": 0.0, "pend-h": 0.0,
                "GPUs avg": 1.0, "GPUs peak": 1.0, "frag %": 0.0, "$/h avg": 1.0, "$/h peak": 1.0,
                "created": 10.0, "top_reasons": []}

    text = builtin.render([row(builtin.DEFAULT_POLICY, 0.0), row("dotprod", 0.0)], cluster=build_cluster(),
                          seeds=[42])
    assert "bar" not in text.lower() and "not met" not in text.lower() and "strictly" not in text
    for column in ("never", "pend-h", "frag %", "$/h avg"):
        assert any(line.strip().startswith(column) for line in text.splitlines()[3:]), column
    assert "one seed" in text  # says a single seed's gaps may be chance


def test_help_explains_the_columns(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        gpu_slice(["simulate", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for column in ("never", "pend-h", "frag %", "unalloc@100", "1st fail%", "published"):
        assert f"  {column} " in text, column


def test_trace_table_has_a_legend(csvs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    nodes, pods = csvs
    assert gpu_slice(["simulate", "--nodes", str(nodes), "--pods", str(pods), "--policy", "bestfit"]) == 0
    out = capsys.readouterr().out
    assert "unalloc@100 " in out and any(line.strip().startswith("1st fail%") for line in out.splitlines())
