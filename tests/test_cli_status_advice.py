"""``gpu-slice status --prometheus-url``: right-sizing advice from the per-pod series, said to be
unavailable (and why) without a URL or when Prometheus cannot answer, and bad flags refused. The
Prometheus here is a loopback stand-in answering the HTTP API's instant queries with hand-written
JSON; the queries themselves run against a real Prometheus in
``tests/deviceplugin/test_pod_series_prometheus.py``."""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gpuslice_cli import main as cli
from gpuslice_cli.advice import PrometheusError, fetch_peaks, parse_window
from tests.gpuslice.test_view import A_LAYOUT, mig_gpu, mps_gpu, node_obj, pod_obj, sids
from tests.test_cli_status import dump

GIB = 1024**3


def cluster(tmp_path: Path) -> Path:
    mps, mig = mps_gpu("n1", 0), mig_gpu("n1", 1, A_LAYOUT)
    three_g = mig.instances[0]
    return dump(tmp_path, [node_obj("n1", [mps, mig]),
                           pod_obj("idle", 3, node="n1", assigned=sids(three_g.uuid, 3),
                                   allocated=sids(three_g.uuid, 3), gpu_memory="36Gi", isolation="mig"),
                           pod_obj("chat", 4, node="n1", assigned=sids(mps.uuid, 4), allocated=sids(mps.uuid, 4))])


Answer = Callable[[str], list[dict[str, Any]] | tuple[int, dict[str, Any]]]


@pytest.fixture
def prom() -> Iterator[tuple[list[str], Callable[[Answer], str]]]:
    """A loopback stand-in of Prometheus' /api/v1/query; ``serve(answer)`` gives its URL."""
    seen: list[str] = []
    servers: list[ThreadingHTTPServer] = []

    def serve(answer: Answer) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlparse(self.path)
                query = urllib.parse.parse_qs(url.query)["query"][0]
                seen.append(query)
                got = answer(query)
                status, body = got if isinstance(got, tuple) else (200, {"status": "success", "data": {
                    "resultType": "vector", "result": got}})
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: Any) -> None:
                return None

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield seen, serve
    for server in servers:
        server.shutdown()
        server.server_close()


def series(uid: str, value: float) -> dict[str, Any]:
    return {"metric": {"pod_uid": uid}, "value": [time.time(), repr(value)]}


def measured(query: str) -> list[dict[str, Any]]:
    if "gpu_slice_pod_memory_used_bytes" in query:
        return [series("idle", 4 * GIB), series("chat", 30 * GIB)]
    if "gpu_slice_pod_gpu_activity_ratio" in query:
        return [series("idle", 0.15)]
    if "gpu_slice_pod_memory_bandwidth_ratio" in query:
        return [series("idle", 0.25)]
    if "timestamp(gpu_slice_pod_slices)" in query:
        return [series("idle", time.time() - 7200), series("chat", time.time() - 7200)]
    return []


def test_advice_names_the_pod_its_smaller_slice_and_what_the_cluster_frees(
        tmp_path: Path, prom: Any, capsys: pytest.CaptureFixture[str]) -> None:
    seen, serve = prom
    url = serve(measured)
    assert cli.main(["status", "--cluster", str(cluster(tmp_path)), "--prometheus-url", url, "--window", "1h"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("ns/pod-idle "))
    # 4 GiB and 25 % activity of a 3g.40gb: 1 slice of compute, 4.8 GiB with headroom: 1g.10gb; its 36Gi
    # floor would not pass there, so the floor to ask is said too
    assert "1 slice (1g.10gb), frees 2; example.com/gpu-memory: 4916Mi" in row
    assert "3 (3g.40gb)" in row and "25%" in row and "4.00 GiB" in row
    assert "ns/pod-chat" not in out.split("PEAK MEMORY")[1].split("\n\n")[0]  # MPS without activity: not advised
    assert ("1 of 2 pods holding slices fit a smaller slice over the last 1h with 20% headroom; resized, they "
            "would free 2 mig slices of H100-80GB (0.29 GPU)") in out  # 2 of 7
    assert all("[3600s]" in q or "[3600s:36s]" in q for q in seen)
    # -o wide lists every pod with why; -o json carries the same
    cli.main(["status", "--cluster", str(cluster(tmp_path)), "--prometheus-url", url, "-o", "wide"])
    assert "under mpsLimits memory-and-threads a smaller share also caps" in capsys.readouterr().out
    cli.main(["status", "--cluster", str(cluster(tmp_path)), "--prometheus-url", url, "-o", "json"])
    advice = json.loads(capsys.readouterr().out)["advice"]
    assert advice["available"] and advice["window_s"] == 3600 and advice["freed"][0]["slices"] == 2
    by_uid = {p["uid"]: p for p in advice["pods"]}
    assert by_uid["idle"]["advice"]["profile"] == "1g.10gb" and by_uid["idle"]["peak_activity"] == 0.25
    assert not by_uid["chat"]["advice"]["advised"]


def test_memory_only_mps_pods_are_advised_on_memory(tmp_path: Path, prom: Any,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    _, serve = prom
    cfg = tmp_path / "config.yaml"
    cfg.write_text("version: v1\nmpsLimits: memory-only\n")
    url = serve(lambda q: [series("chat", 10 * GIB), series("idle", GIB)] if "memory_used" in q else
                [series("chat", time.time() - 4000)] if "timestamp" in q else [])
    assert cli.main(["status", "--cluster", str(cluster(tmp_path)), "--config", str(cfg), "--prometheus-url", url,
                     "-o", "json"]) == 0
    advice = json.loads(capsys.readouterr().out)["advice"]
    chat = next(p for p in advice["pods"] if p["uid"] == "chat")
    assert chat["advice"]["advised"] and chat["advice"]["slices"] == 2  # 12 GiB with headroom: two 7ths of an H100
    idle = next(p for p in advice["pods"] if p["uid"] == "idle")
    # its series are younger than one point of the presence subquery: measured for no time yet
    assert idle["advice"]["why"] == "measured for only 0s of the last 1h"


def test_without_a_url_or_with_prometheus_down_advice_is_unavailable_and_says_why(
        tmp_path: Path, prom: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--cluster", str(cluster(tmp_path))]) == 0
    assert capsys.readouterr().out.rstrip().endswith(
        "Right-sizing advice unavailable: no --prometheus-url given: advice needs the device plugins' per-pod series")
    assert cli.main(["status", "--cluster", str(cluster(tmp_path)), "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["advice"]["available"] is False
    # nothing listens there: the status is printed, advice is not, and stderr says why
    _, serve = prom
    down = serve(lambda q: [])
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert cli.main(["status", "--cluster", str(cluster(tmp_path)), "--prometheus-url", dead]) == 0
    captured = capsys.readouterr()
    assert "cannot reach Prometheus" in captured.err and "NODE" in captured.out
    assert "Right-sizing advice unavailable: " + dead in captured.out
    assert down  # a Prometheus with no series: every pod "no figures"
    assert cli.main(["status", "--cluster", str(cluster(tmp_path)), "--prometheus-url", down, "-o", "wide"]) == 0
    assert "no figures for this pod over the last 1h" in capsys.readouterr().out


def test_prometheus_errors_are_said_with_the_query() -> None:
    import httpx

    def transport(status: int, body: Any) -> httpx.Client:
        return httpx.Client(base_url="http://prom", transport=httpx.MockTransport(
            lambda request: httpx.Response(status, json=body)))

    with pytest.raises(PrometheusError, match=r"Prometheus refused .*bad_data: parse error"):
        fetch_peaks("http://prom", 3600, 0, client=transport(400, {"status": "error", "errorType": "bad_data",
                                                                   "error": "parse error"}))
    with pytest.raises(PrometheusError, match="HTTP 502"):
        fetch_peaks("http://prom", 3600, 0, client=transport(502, "bad gateway"))
    with pytest.raises(PrometheusError, match="no result list"):
        fetch_peaks("http://prom", 3600, 0, client=transport(200, {"status": "success", "data": {}}))


@pytest.mark.parametrize(("flags", "message"), [
    (["--window", "soon"], "--window must be a duration"), (["--window", "5s"], "at least 10s"),
    (["--headroom", "-1"], "--headroom must be a ratio"), (["--headroom", "nan"], "--headroom must be a ratio"),
    (["--prometheus-url", "prometheus:9090"], "--prometheus-url must start with http://")])
def test_bad_flags_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                               message: str) -> None:
    assert cli.main(["status", "--cluster", str(cluster(tmp_path)), *flags]) == 2
    assert message in capsys.readouterr().err


def test_windows_read_as_prometheus_durations() -> None:
    assert [parse_window(w) for w in ("1h", "90m", "1h30m", "3600s", "2d", "1m", "10s")] == [
        3600, 5400, 5400, 3600, 172800, 60, 10]
