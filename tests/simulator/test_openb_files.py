"""CSV readers: both pod formats, and errors that name file, line and column."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.openb import OpenbPod, TraceError, build_state, pod_slices, read_nodes, read_pods, to_request

FULL = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_reads_eleven_and_five_column_pod_files(tmp_path: Path) -> None:
    full = read_pods(write(tmp_path, "a.csv", FULL + "p0,6000,12288,1,460,T4|P100,LS,Running,0,1,0\n"
                                                      "p1,1000,100,0,0,,BE,Pending,0,,\n"))
    assert full[0].gpu_spec == frozenset({"T4", "P100"}) and full[1].gpu_spec is None
    short = read_pods(write(tmp_path, "b.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,8,1000\n"))
    assert short[0].num_gpu == 8 and short[0].total_milli == 8000


def test_node_file_and_state(tmp_path: Path) -> None:
    nodes = read_nodes(write(tmp_path, "n.csv", "sn,cpu_milli,memory_mib,gpu,model\nx,96000,1000,8,G2\n"
                                                "y,64000,1000,2,T4\n"))
    state = build_state(nodes, 1000)
    assert state.n_units == 10 and state.total_slices == 10000 and state.width == 8


@pytest.mark.parametrize(("text", "line", "column"), [
    ("name,cpu_milli,memory_mib,num_gpu\np,1,1,1\n", 1, "gpu_milli"),
    ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,abc\n", 2, "gpu_milli"),
    ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,500\nq,-4,1,1,500\n", 3, "cpu_milli"),
    ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,2,500\n", 2, "gpu_milli"),
    ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,1500\n", 2, "gpu_milli"),
    ("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1\n", 2, ""),
])
def test_malformed_pod_files_name_line_and_column(tmp_path: Path, text: str, line: int, column: str) -> None:
    path = write(tmp_path, "bad.csv", text)
    with pytest.raises(TraceError) as e:
        read_pods(path)
    assert e.value.line == line and e.value.column == column
    assert str(path) in str(e.value) and f"line {line}" in str(e.value)


def test_missing_file_and_bad_node_rows(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        read_nodes(tmp_path / "nope.csv")
    with pytest.raises(TraceError, match="duplicate node name"):
        read_nodes(write(tmp_path, "n.csv", "sn,cpu_milli,memory_mib,gpu,model\nx,1,1,1,G2\nx,1,1,1,G2\n"))


def test_slice_granularity_rounds_up() -> None:
    p = OpenbPod("p", 1000, 1, 1, 460)
    assert pod_slices(p, 1000) == 460 and pod_slices(p, 7) == 4 and pod_slices(p, 1) == 1
    whole = to_request(OpenbPod("w", 1000, 1, 4, 1000), 7)
    assert whole.gpus == 4 and whole.slices == 7
    assert to_request(OpenbPod("c", 1000, 1, 0, 0)).gpus == 0


def test_non_utf8_file_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.csv"
    path.write_bytes(b"name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,1,500\np\xe9,1,1,1,500\n")
    with pytest.raises(TraceError) as e:
        read_pods(path)
    assert e.value.line == 3 and str(path) in str(e.value) and "UTF-8" in str(e.value)
    with pytest.raises(TraceError, match="UTF-8"):
        read_nodes(path)


def test_binary_file_oversized_field_and_byte_order_mark(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="line 2: contains a NUL byte"):
        read_pods(write(tmp_path, "nul.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np\x00,1,1,1,5\n"))
    huge = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,1,500\n\"" + "x" * 200_000 + "\",1,1,1,500\n"
    with pytest.raises(TraceError, match="line 3: not a valid CSV"):
        read_pods(write(tmp_path, "huge.csv", huge))
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbfname,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,1,500\n")
    assert read_pods(bom)[0].name == "p0"
