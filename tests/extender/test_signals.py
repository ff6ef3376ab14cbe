"""Signals from a tiny local Prometheus stand-in that serves /api/v1/query answers.

The refresher sends one instant query per metric name (``label_replace(timestamp(NAME), ...) or
last_over_time(NAME[W])``); Prometheus answers an instant vector holding, per series, its latest value
and a twin labelled ``gpu_slice_sample="time"`` whose value is that sample's own time. ``REAL_ANSWER``
is such an answer as Prometheus 2.42 gave it, typed out by hand; the tables below are written in that
form by :func:`answer` (value strings, Unix-second times, the evaluation time of the query) with the
label sets of dcgm-exporter up to 4.8 (``Hostname``, ``DCGM_FI_PROF_*_ACTIVE``), of 4.9 (``hostname``,
``*_UTIL_RATIO``) and of OpenCost (reference 3.2-3.3 and 4).
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from extender.signals import SignalRefresher, SignalSettings, SignalSnapshot, unit_scale
from gpuslice import annotations as ann
from gpuslice.config import load_config
from tests.extender.helpers import wait_for

NOW = 1_750_000_000.0
GPU0 = "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"
GPU1 = "GPU-1b2c3d4e-0000-1111-2222-333344445555"
GPU2 = "GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff"
NODE = "gpu-node-1"

EMPTY = '{"status":"success","data":{"resultType":"vector","result":[]}}'

# What Prometheus 2.42 answered to the query for ``up`` (one series), by hand.
REAL_ANSWER = """{"status":"success","data":{"resultType":"vector","result":[
 {"metric":{"gpu_slice_sample":"time","instance":"127.0.0.1:19099","job":"self"},
  "value":[1796549747.317,"1796549743.208"]},
 {"metric":{"__name__":"up","instance":"127.0.0.1:19099","job":"self"},"value":[1796549747.317,"1"]}]}}"""


def answer(name: str, *rows: tuple[str, float, str]) -> str:
    """The answer to the query for ``name``: per (labels as JSON text without braces, sample time,
    value) a value series and its sample-time twin, evaluated at ``NOW``."""
    out = []
    for labels, at, value in rows:
        out.append(f'{{"metric":{{"gpu_slice_sample":"time",{labels}}},"value":[{NOW},"{at}"]}}')
        out.append(f'{{"metric":{{"__name__":"{name}",{labels}}},"value":[{NOW},"{value}"]}}')
    return '{"status":"success","data":{"resultType":"vector","result":[' + ",".join(out) + "]}}"


H0 = '"gpu":"0","UUID":"GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52","device":"nvidia0","Hostname":"gpu-node-1"'
H1_GI9 = ('"gpu":"1","UUID":"GPU-1b2c3d4e-0000-1111-2222-333344445555","GPU_I_PROFILE":"1g.10gb",'
          '"GPU_I_ID":"9","Hostname":"gpu-node-1","container":"main","namespace":"ml","pod":"llm-0"')
H2 = '"gpu":"2","UUID":"GPU-9f8e7d6c-aaaa-bbbb-cccc-ddddeeeeffff","device":"nvidia2","Hostname":"gpu-node-1"'

# dcgm-exporter <= 4.8: Hostname, PROF *_ACTIVE, GPU_UTIL in percent; one whole GPU (GPU0), one MIG
# instance (GPU1, GI 9), one GPU without profiling metrics (GPU2).
OLD = {
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": answer("DCGM_FI_PROF_GR_ENGINE_ACTIVE", (H0, 1749999970, "0.42"),
                                            (H1_GI9, 1749999990.5, "0.8")),
    "DCGM_FI_PROF_DRAM_ACTIVE": answer("DCGM_FI_PROF_DRAM_ACTIVE", (H0, 1749999985, "0.9")),
    "DCGM_FI_DEV_GPU_UTIL": answer("DCGM_FI_DEV_GPU_UTIL", (H0, 1749999970, "5"), (H2, 1749999960, "37")),
}

# dcgm-exporter 4.9: hostname, *_UTIL_RATIO names.
NEW = {
    "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO": answer(
        "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO", (H0.replace("Hostname", "hostname"), 1749999970, "0.42"),
        (H1_GI9.replace("Hostname", "hostname"), 1749999990.5, "0.8")),
    "DCGM_FI_PROF_DRAM_UTIL_RATIO": answer("DCGM_FI_PROF_DRAM_UTIL_RATIO",
                                           (H0.replace("Hostname", "hostname"), 1749999985, "0.9")),
    "DCGM_FI_DEV_GPU_UTIL_RATIO": answer("DCGM_FI_DEV_GPU_UTIL_RATIO",
                                         (H2.replace("Hostname", "hostname"), 1749999960, "0.37")),
}

OPENCOST = {
    "node_total_hourly_cost": answer(
        "node_total_hourly_cost",
        ('"instance":"gpu-node-1","node":"gpu-node-1","instance_type":"p5.48xlarge","region":"us-east-2",'
         '"job":"opencost"', 1749999960, "98.32"),
        ('"instance":"old-node","node":"old-node","instance_type":"g5.xlarge"', 1749999000, "1.01")),
}

_NAME_IN_QUERY = re.compile(r"timestamp\(([A-Za-z_:][A-Za-z0-9_:]*)")


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out and left: expected in the timeout test


class FakePrometheus:
    """``/api/v1/query`` on 127.0.0.1: the answer for the query's metric name (a key ``*`` answers every
    query), else empty."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[int, str]] = {}
        self.queries: list[str] = []
        self.delay = 0.0
        self._release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = parse_qs(url.query).get("query", [""])[0]
                outer.queries.append(query)
                if outer.delay:
                    outer._release.wait(outer.delay)
                code, body = 404, '{"status":"error","errorType":"not_found","error":"no such path"}'
                if url.path == "/api/v1/query":
                    found = _NAME_IN_QUERY.search(query)
                    name = found.group(1) if found else ""
                    code, body = outer.answers.get(name, outer.answers.get("*", (200, EMPTY)))
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def serve(self, answers: dict[str, str]) -> None:
        self.answers.update({k: (200, v) for k, v in answers.items()})

    def stop(self) -> None:
        self._release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def prom() -> Iterator[FakePrometheus]:
    server = FakePrometheus()
    server.thread.start()
    try:
        yield server
    finally:
        server.stop()


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def refreshers() -> Iterator[list[SignalRefresher]]:
    made: list[SignalRefresher] = []
    yield made
    for r in made:
        r.stop()


def make(refreshers: list[SignalRefresher], url: str | None, clock: Clock | None = None,
         **kwargs: Any) -> SignalRefresher:
    settings_keys = {"timeout_s", "max_age_s", "interval_s", "matchers", "uuid_labels"}
    settings = SignalSettings(url=url, **{k: v for k, v in kwargs.items() if k in settings_keys})
    rest = {k: v for k, v in kwargs.items() if k not in settings_keys}
    r = SignalRefresher(settings, clock=clock or Clock(), **rest)
    refreshers.append(r)
    return r


# ------------------------------------------------------------------------------------- DCGM


@pytest.mark.parametrize("answers", [OLD, NEW], ids=["exporter-4.8", "exporter-4.9"])
def test_activity_from_either_exporter_spelling(prom: FakePrometheus, refreshers: list[SignalRefresher],
                                                answers: dict[str, str]) -> None:
    prom.serve(answers)
    r = make(refreshers, prom.url)
    assert r.refresh()
    snap = r.snapshot()
    # GPU0: max(graphics 0.42 at -30 s, DRAM 0.9 at -15 s); the age is the older sample's.
    assert snap.activity(NODE, GPU0) == (0.9, 30.0)
    # GPU1's MIG instance with GPU-instance id 9 (the inventory's gpuInstanceId).
    assert snap.activity(NODE, GPU1, 9) == (0.8, 9.5)
    assert snap.activity(NODE, GPU1, 3) is None
    assert snap.activity(NODE, GPU1) is None  # no whole-GPU series for a MIG GPU
    # GPU2 has no profiling metrics: GPU_UTIL (percent before 4.9, a ratio after) is the fallback.
    value, age = snap.activity(NODE, GPU2) or (None, None)
    assert value == pytest.approx(0.37) and age == 40.0
    assert snap.activity(NODE, "GPU-nope") is None


def test_the_real_answer_format_is_read(prom: FakePrometheus, refreshers: list[SignalRefresher]) -> None:
    prom.serve({"*": REAL_ANSWER})
    r = make(refreshers, prom.url, clock=Clock(1796549747.317), uuid_labels=("instance",))
    assert r.refresh()
    assert r.snapshot().sample("gr_engine", None, "127.0.0.1:19099") == (1.0, pytest.approx(4.109))


def test_only_used_series_are_asked_one_instant_query_per_name(prom: FakePrometheus,
                                                               refreshers: list[SignalRefresher]) -> None:
    r = make(refreshers, prom.url, max_age_s=90, matchers='job="dcgm-exporter"')
    assert r.refresh()
    assert prom.queries[0] == ('label_replace(timestamp(DCGM_FI_PROF_GR_ENGINE_ACTIVE{job="dcgm-exporter"}), '
                               '"gpu_slice_sample", "time", "", "") or '
                               'last_over_time(DCGM_FI_PROF_GR_ENGINE_ACTIVE{job="dcgm-exporter"}[90s])')
    names = [_NAME_IN_QUERY.search(q).group(1) for q in prom.queries]  # type: ignore[union-attr]
    assert names == ["DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO",
                     "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_PROF_DRAM_UTIL_RATIO", "DCGM_FI_DEV_GPU_UTIL",
                     "DCGM_FI_DEV_GPU_UTIL_RATIO", "node_total_hourly_cost"]
    assert not any("[" in q.split(" or ")[0] for q in prom.queries)  # no range vector is answered


def test_gpu_util_is_not_used_for_mig_instances(prom: FakePrometheus, refreshers: list[SignalRefresher]) -> None:
    prom.serve({"DCGM_FI_DEV_GPU_UTIL": answer("DCGM_FI_DEV_GPU_UTIL", (H1_GI9, 1749999990, "50"))})
    r = make(refreshers, prom.url)
    assert r.refresh()
    assert r.snapshot().activity(NODE, GPU1, 9) is None


def test_unit_scale_follows_the_name() -> None:
    assert unit_scale("gpu_util", "DCGM_FI_DEV_GPU_UTIL") == 0.01
    assert unit_scale("gpu_util", "DCGM_FI_DEV_GPU_UTIL_RATIO") == 1.0
    assert unit_scale("gr_engine", "DCGM_FI_PROF_GR_ENGINE_ACTIVE") == 1.0
    assert unit_scale("node_total_cost", "node_total_hourly_cost") == 1.0


def test_two_series_for_one_gpu_prefer_the_asked_node(prom: FakePrometheus, refreshers: list[SignalRefresher]) -> None:
    uuid = '"UUID":"GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"'
    prom.serve({"DCGM_FI_PROF_GR_ENGINE_ACTIVE": answer("DCGM_FI_PROF_GR_ENGINE_ACTIVE",
                                                        (uuid + ',"Hostname":"gpu-node-1"', 1749999950, "0.1"),
                                                        (uuid + ',"Hostname":"ip-10-0-0-5"', 1749999990, "0.7"))})
    r = make(refreshers, prom.url)
    assert r.refresh()
    snap = r.snapshot()
    assert snap.activity(NODE, GPU0) == (0.1, 50.0)
    assert snap.activity("renamed-node", GPU0) == (0.7, 10.0)  # no exact node: the newest
    assert snap.activity(None, GPU0) == (0.7, 10.0)


def test_odd_series_are_skipped(prom: FakePrometheus, refreshers: list[SignalRefresher]) -> None:
    prom.serve({"DCGM_FI_PROF_GR_ENGINE_ACTIVE": """{"status":"success","data":{"resultType":"vector","result":[
 {"metric":{"gpu_slice_sample":"time","Hostname":"gpu-node-1"},"value":[1750000000,"1749999990"]},
 {"metric":{"__name__":"DCGM_FI_PROF_GR_ENGINE_ACTIVE","Hostname":"gpu-node-1"},"value":[1750000000,"0.5"]},
 {"metric":{"gpu_slice_sample":"time","UUID":"GPU-a","GPU_I_ID":"x"},"value":[1750000000,"1749999990"]},
 {"metric":{"__name__":"DCGM_FI_PROF_GR_ENGINE_ACTIVE","UUID":"GPU-a","GPU_I_ID":"x"},"value":[1750000000,"0.5"]},
 {"metric":{"gpu_slice_sample":"time","UUID":"GPU-b"},"value":[1750000000,"1749999990"]},
 {"metric":{"__name__":"DCGM_FI_PROF_GR_ENGINE_ACTIVE","UUID":"GPU-b"},"value":[1750000000,"NaN"]},
 {"metric":{"__name__":"DCGM_FI_PROF_GR_ENGINE_ACTIVE","UUID":"GPU-c"},"value":"0.5"},
 {"metric":{"__name__":"DCGM_FI_PROF_GR_ENGINE_ACTIVE","UUID":"GPU-e"},"value":[1750000000,"0.5"]},
 {"metric":{"gpu_slice_sample":"time","UUID":"GPU-d"},"value":[1750000000,"1749999980"]},
 {"metric":{"__name__":"DCGM_FI_PROF_GR_ENGINE_ACTIVE","UUID":"GPU-d"},"value":[1750000000,"0.2"]},
 {"metric":"nope"},
 7
]}}"""})
    r = make(refreshers, prom.url)
    assert r.refresh()
    snap = r.snapshot()
    # no uuid; a GI that is no number; NaN; no [time, value] pair; no sample-time twin
    assert [snap.activity(NODE, g) for g in ("GPU-a", "GPU-b", "GPU-c", "GPU-e")] == [None, None, None, None]
    assert snap.activity(NODE, "GPU-d") == (0.2, 20.0)
    assert r.query_errors == 0


# ------------------------------------------------------------------------------------- staleness


def test_stale_samples_are_absent_and_age_out_without_a_refresh(prom: FakePrometheus,
                                                                refreshers: list[SignalRefresher]) -> None:
    prom.serve(OLD)
    clock = Clock(NOW + 60)  # GPU0's graphics sample is 90 s old, DRAM 75 s; GPU2's util 100 s
    r = make(refreshers, prom.url, clock, max_age_s=95)
    assert r.refresh()
    snap = r.snapshot()
    assert snap.activity(NODE, GPU0) == (0.9, 90.0)
    assert snap.activity(NODE, GPU2) is None
    clock.now = NOW + 80  # graphics now 110 s old: only DRAM is left
    assert snap.activity(NODE, GPU0) == (0.9, 95.0)
    clock.now = NOW + 200
    assert snap.activity(NODE, GPU0) is None
    assert snap.activity(NODE, GPU0, now=NOW) == (0.9, 30.0)
    assert snap.newest_age("gr_engine", now=NOW) == pytest.approx(9.5)
    assert snap.newest_age("node_total_cost") is None


# ------------------------------------------------------------------------------------- failures


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_prometheus_down_is_a_counted_rate_limited_warning(refreshers: list[SignalRefresher],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    errors: list[tuple[str, str]] = []
    r = make(refreshers, f"http://127.0.0.1:{closed_port()}", timeout_s=1.0,
             on_query_error=lambda k, why: errors.append((k, why)))
    with caplog.at_level(logging.WARNING, logger="extender.signals"):
        assert r.refresh() is False
        assert r.refresh() is False
    assert errors == [("gr_engine", "unreachable")] * 2  # the round stops at the first refused connection
    assert r.query_errors == 2
    assert len([rec for rec in caplog.records if rec.levelno == logging.WARNING]) == 1
    snap = r.snapshot()
    assert snap.activity(NODE, GPU0) is None and snap.node_cost(NODE) is None


def test_data_outlives_an_outage_until_it_is_stale(prom: FakePrometheus, refreshers: list[SignalRefresher]) -> None:
    prom.serve(OLD)
    clock = Clock()
    r = make(refreshers, prom.url, clock)
    assert r.refresh()
    prom.answers.clear()
    prom.answers.update({"*": (503, "Service Unavailable")})
    assert not r.refresh()
    assert r.snapshot().activity(NODE, GPU0) == (0.9, 30.0)
    clock.now = NOW + 200
    assert not r.refresh()
    assert r.snapshot().activity(NODE, GPU0) is None
    assert r.last_success == NOW


@pytest.mark.parametrize(("code", "body", "reason"), [
    (400, '{"status":"error","errorType":"bad_data","error":"invalid parameter \\"query\\""}', "prometheus_error"),
    (422, '{"status":"error","errorType":"execution","error":"query processing would load too many samples"}',
     "prometheus_error"),
    (200, "<html>a proxy login page</html>", "bad_response"),
    (200, '{"status":"success","data":{"resultType":"scalar","result":[1749999990,"1"]}}', "bad_response"),
    (200, '{"status":"success","data":{"resultType":"vector","result":{}}}', "bad_response"),
    (200, '{"status":"success","data":{"resultType":"matrix","result":[]}}', "bad_response"),
    (200, '{"status":"success"}', "bad_response"),
    (200, "[]", "bad_response"),
    (404, "not found", "http"),
])
def test_bad_answers_are_counted_and_keep_old_data(prom: FakePrometheus, refreshers: list[SignalRefresher],
                                                   code: int, body: str, reason: str) -> None:
    prom.serve(OLD)
    errors: list[tuple[str, str]] = []
    r = make(refreshers, prom.url, on_query_error=lambda k, why: errors.append((k, why)))
    assert r.refresh()
    prom.answers["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] = (code, body)
    assert not r.refresh()
    assert errors == [("gr_engine", reason)]
    assert r.snapshot().activity(NODE, GPU0) == (0.9, 30.0)  # graphics kept from before, DRAM fresh


def test_a_slow_prometheus_times_out(prom: FakePrometheus, refreshers: list[SignalRefresher]) -> None:
    prom.delay = 5.0
    errors: list[tuple[str, str]] = []
    r = make(refreshers, prom.url, timeout_s=0.2, on_query_error=lambda k, why: errors.append((k, why)))
    assert not r.refresh()
    assert errors == [("gr_engine", "timeout")]
    assert len(prom.queries) == 1


def test_no_prometheus_configured_means_no_queries(refreshers: list[SignalRefresher]) -> None:
    r = make(refreshers, None)
    assert not r.refresh()
    r.start()
    assert r.snapshot().activity(NODE, GPU0) is None


# ------------------------------------------------------------------------------------- cost


def node(name: str, *, labels: dict[str, str] | None = None,
         annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}}}


CONFIG = load_config({"version": "v1", "prices": {"instanceTypes": {
    "p5.48xlarge": {"on-demand": 98.32, "spot": 39.3}, "g6.12xlarge": {"on-demand": 4.6, "spot": 2.1}}}})


def test_node_cost_priority(prom: FakePrometheus, refreshers: list[SignalRefresher]) -> None:
    prom.serve(OPENCOST)
    r = make(refreshers, prom.url, config=CONFIG)
    r.replace_nodes([
        node(NODE, labels={ann.INSTANCE_TYPE_LABEL: "p5.48xlarge"}, annotations={ann.HOURLY_COST_KEY: "50"}),
        node("annotated", annotations={ann.HOURLY_COST_KEY: "7.25"},
             labels={ann.INSTANCE_TYPE_LABEL: "g6.12xlarge"}),
        node("karpenter-spot", labels={ann.INSTANCE_TYPE_LABEL: "g6.12xlarge", "karpenter.sh/capacity-type": "spot"}),
        node("gke-spot", labels={ann.INSTANCE_TYPE_LABEL: "p5.48xlarge", "cloud.google.com/gke-spot": "true"}),
        node("unlabelled-capacity", labels={"beta.kubernetes.io/instance-type": "g6.12xlarge"}),
        node("old-node", labels={ann.INSTANCE_TYPE_LABEL: "g6.12xlarge"}),
        node("unknown", labels={ann.INSTANCE_TYPE_LABEL: "m5.large"}),
        node("garbled", annotations={ann.HOURLY_COST_KEY: "cheap"}),
    ])
    assert r.refresh()
    snap = r.snapshot()
    assert snap.node_cost(NODE) == 98.32 and snap.cost_source(NODE) == "opencost"  # OpenCost wins
    assert snap.live_node_cost(NODE) == 98.32
    assert snap.node_cost("annotated") == 7.25  # the annotation before the table
    assert snap.node_cost("karpenter-spot") == 2.1
    assert snap.node_cost("gke-spot") == 39.3
    assert snap.node_cost("unlabelled-capacity") == 4.6  # no capacity label: on-demand
    assert snap.node_cost("old-node") == 4.6  # its OpenCost figure is 1000 s old
    assert snap.cost_source("old-node") == "fallback"
    assert snap.node_cost("unknown") is None and snap.cost_source("unknown") is None
    assert snap.node_cost("garbled") is None
    assert snap.node_cost("never-seen") is None


def test_node_prices_follow_node_events(refreshers: list[SignalRefresher]) -> None:
    r = make(refreshers, None, config=CONFIG)
    first = r.snapshot()
    r.observe_node(node("a", annotations={ann.HOURLY_COST_KEY: "3"}))
    second = r.snapshot()
    assert second is not first and second.node_cost("a") == 3.0
    assert first.node_cost("a") is None  # snapshots do not change
    r.observe_node(node("a", annotations={ann.HOURLY_COST_KEY: "3"}))
    assert r.snapshot() is second  # no change, no new snapshot
    r.observe_node(node("a", labels={ann.INSTANCE_TYPE_LABEL: "p5.48xlarge"}))
    assert r.snapshot().node_cost("a") == 98.32
    r.forget_node("a")
    assert r.snapshot().node_cost("a") is None
    r.observe_node(node("b", annotations={ann.HOURLY_COST_KEY: "1"}))
    r.replace_nodes([node("c", annotations={ann.HOURLY_COST_KEY: "2"})])
    assert r.snapshot().node_cost("b") is None and r.snapshot().node_cost("c") == 2.0


# ------------------------------------------------------------------------------------- lifecycle


def test_background_refresh_and_prompt_stop(prom: FakePrometheus, refreshers: list[SignalRefresher]) -> None:
    prom.serve(OLD)
    r = make(refreshers, prom.url, interval_s=0.05)
    r.start()
    assert wait_for(lambda: r.refreshes >= 2)
    assert r.snapshot().activity(NODE, GPU0) == (0.9, 30.0)
    thread = next(t for t in threading.enumerate() if t.name == "signals")
    r.stop(timeout=2.0)
    assert not thread.is_alive()


@pytest.mark.parametrize("bad", [
    {"gr_engine": ("DCGM FI",)}, {"node_labels": ("host-name",)}, {"matchers": "}"}, {"max_age_s": 0},
])
def test_settings_refuse_what_would_break_a_query(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SignalSettings(url="http://127.0.0.1:9090", **bad)


def test_snapshot_is_immutable() -> None:
    snap = SignalSnapshot()
    with pytest.raises(AttributeError):
        snap.max_age_s = 5  # type: ignore[misc]
    assert json.dumps(snap.newest_age("dram")) == "null"
