"""``gpu-slice simulate`` arguments, outputs and errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from simulator.cli import add_arguments, parse_seeds, run


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def files(tmp_path: Path) -> tuple[Path, Path]:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + "".join(
        f"n{i},32000,128000,{2 if i % 2 else 4},{'T4' if i % 2 else 'G2'}\n" for i in range(12)))
    pods = tmp_path / "openb_pod_list_tiny.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n" + "".join(
        f"p{i},2000,4000,{1 if i % 5 else 2},{(300 + 100 * (i % 4)) if i % 5 and i % 3 else 1000}\n"
        for i in range(30)))
    return nodes, pods


def test_seed_ranges() -> None:
    assert parse_seeds("42-44,50") == [42, 43, 44, 50]
    with pytest.raises(argparse.ArgumentTypeError, match="bad seed list 'x'"):
        parse_seeds("x")
    with pytest.raises(argparse.ArgumentTypeError, match="seed range '51-42' is empty"):
        parse_seeds("51-42")
    with pytest.raises(argparse.ArgumentTypeError, match="no seeds given"):
        parse_seeds(",")


def test_run_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes, pods = files(tmp_path)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = parse(["--nodes", str(nodes), "--pods", str(pods), "--policy", "fragmentation,fgd,bestfit",
                  "--seeds", "1-2", "--mode", "all", "--json", str(out), "--plot", str(png), "--slices", "100"])
    assert run(args) == 0
    data = json.loads(out.read_text())
    assert len(data["runs"]) == 3 * 2 * 4  # policies x seeds x modes
    assert {r["mode"] for r in data["runs"]} == {"protocol", "wide", "ideal", "paper"}
    for key in ("unallocated_gpu_pct_at_100", "unallocated_gpu_pct_at_130", "first_failure_arrived_pct",
                "pods_placed", "seconds", "policy", "seed", "mode", "trace"):
        assert key in data["runs"][0]
    assert png.read_bytes()[:4] == b"\x89PNG"
    text = capsys.readouterr().out
    assert "unalloc@100" in text and "tiny" in text and "\r" not in text  # no progress bar off a TTY


def test_weighted_policy_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes, pods = files(tmp_path)
    assert run(parse(["--nodes", str(nodes), "--pods", str(pods), "--policy", "bestfit:0.7+spread:0.3"])) == 0
    assert run(parse(["--nodes", str(nodes), "--pods", str(pods), "--policy", "tetris"])) == 2
    assert "known policies" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,zz\n")
    assert run(parse(["--nodes", str(nodes), "--pods", str(bad)])) == 2
    assert "line 2" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "message"), [
    (["--extender-weight", "0"], "--extender-weight must be >= 1"),
    (["--narrow-margin", "-1"], "--narrow-margin must be a finite number >= 0"),
    (["--narrow-margin", "nan"], "--narrow-margin must be a finite number >= 0"),
    (["--slices", "0"], "--slices must be 1..1000"),
    (["--narrow-max-nodes", "0"], "--narrow-max-nodes must be >= 1"),
])
def test_numeric_flags_are_refused_by_name(flags: list[str], message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert run(parse(flags)) == 2
    assert message in capsys.readouterr().err


def test_inflate_is_refused_by_name_while_parsing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(["--inflate", "-2"])
    assert exit_.value.code == 2
    assert "argument --inflate: must be a finite number >= 0" in capsys.readouterr().err


def test_the_trace_plot_draws_every_seed_and_their_median() -> None:
    """--plot with several seeds: one thin curve per seed and a bold median, per policy and mode."""
    import numpy as np

    from simulator.engine import RunResult
    from simulator.report import plot_figure

    def run(policy: str, seed: int, lift: float) -> RunResult:
        arrived = np.linspace(0, 130, 200)
        return RunResult(policy, "protocol", seed, arrived, np.minimum(arrived, 90 + lift), np.ones(200, bool), 0.1)

    fig = plot_figure([("t", run("fgd", 1, 0)), ("t", run("fgd", 2, 3)), ("t", run("fgd", 3, 6)),
                       ("t", run("bestfit", 1, 0))])
    (ax,) = fig.axes
    labels = [ln.get_label() for ln in ax.lines]
    assert len(ax.lines) == 1 + 3 + 1 + 1  # ideal, three fgd seeds, fgd median, one bestfit seed
    assert "t fgd (protocol), median of seeds 1, 2, 3" in labels and "t bestfit (protocol), seed 1" in labels
    fgd = [ln for ln in ax.lines if ln.get_color() == ax.lines[1].get_color()]
    assert len(fgd) == 4
