"""``gpu-slice extender``: start-up validation (extender.cli.build_settings), the Service, and the command.

Everything that can stop start-up is refused before anything listens, naming the flag or config
field. The Service is started on a ``gpu-slice fake-cluster`` file (``--cluster``, binds in memory)
and on the fake API server (``--kubeconfig``, the real client), and the command itself runs once as a
child process on loopback, stopped with SIGTERM as Kubernetes stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extender import wire
from extender.app import build_app
from extender.binder import MemoryBinder
from extender.cli import Service, Settings, SettingsError, add_arguments, build_settings, run
from gpuslice.errors import ConfigError
from gpuslice.kubelist import parse_list_text
from gpuslice_cli.main import main as gpu_slice
from tests.extender.helpers import WAIT, wait_for
from tests.extender.test_app import TestClient, filter_names, ok_json, pod_json, pod_obj, post, small_cluster
from tests.extender.test_service import lease
from tests.fakeapi import FakeApiServer

ROOT = Path(__file__).resolve().parents[2]
ME = "gpu-slice-scheduler-0"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu-slice extender")
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def cluster_file(tmp_path: Path) -> Path:
    """``gpu-slice fake-cluster``: 3 nodes of 2 MPS H100s, one running slice pod each."""
    path = tmp_path / "cluster.yaml"
    assert gpu_slice(["fake-cluster", "--nodes", "3", "--gpus-per-node", "2", "--mode", "mps",
                      "--pods-per-node", "1", "--seed", "3", "-o", str(path)]) == 0
    return path


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


# ------------------------------------------------------------------------------------------ flags


@pytest.mark.parametrize(("text", "field"), [
    ("version: v1\npolicies: [{name: fragmentation}, {name: nope}]\n", "policies.1.name: unknown policy 'nope'"),
    ("version: v1\nslicez: 7\n", "slicez: unknown field"),
    ("version: v1\nnarrowing: {margin: -1}\n", "narrowing.margin: must be >= 0"),
    ("slices: 7\n", "version: required field missing"),
    ("version: v1\npolicies: [\n", "not valid YAML"),
])
def test_a_bad_config_file_stops_start_up_naming_the_field(tmp_path: Path, text: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_settings(parse("--config", write(tmp_path, "config.yaml", text)))
    assert field in str(err.value)


@pytest.mark.parametrize(("argv", "says"), [
    (["--config", "/nonexistent/gpu-slice.yaml"], "--config /nonexistent/gpu-slice.yaml: cannot read"),
    (["--lease", "gpu-slice-scheduler"], "--lease must be NAMESPACE/NAME, got 'gpu-slice-scheduler'"),
    (["--lease", "kube-system/"], "--lease must be NAMESPACE/NAME"),
    (["--lease", "/gpu-slice-scheduler"], "--lease must be NAMESPACE/NAME"),
    (["--lease", "kube-system/a/b"], "--lease must be NAMESPACE/NAME"),
    (["--tls-cert", "@FILE@"], "--tls-cert and --tls-key go together"),
    (["--tls-key", "@FILE@"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "/nonexistent/tls.crt", "--tls-key", "@FILE@"], "--tls-cert /nonexistent/tls.crt: no such file"),
    (["--cluster", "/nonexistent/cluster.yaml"], "--cluster /nonexistent/cluster.yaml: no such file"),
    (["--kubeconfig", "/nonexistent/kubeconfig"], "--kubeconfig /nonexistent/kubeconfig: no such file"),
    (["--port", "0"], "--port must be 1..65535"),
    (["--port", "70000"], "--port must be 1..65535"),
    (["--ops-port", "0"], "--ops-port must be 1..65535"),
    (["--port", "9000", "--ops-port", "9000"], "--ops-port 9000 is the verbs' --port"),
    (["--address", "0.0.0.0"], "--address 0.0.0.0 would let anyone who reaches it steer placement"),
    (["--address", "10.0.0.7", "--tls-cert", "@FILE@", "--tls-key", "@FILE@"], "or give --tls-client-ca"),
    (["--tls-client-ca", "@FILE@"], "--tls-client-ca needs --tls-cert and --tls-key"),
    (["--tls-client-ca", "/nonexistent/ca.crt", "--tls-cert", "@FILE@", "--tls-key", "@FILE@"],
     "--tls-client-ca /nonexistent/ca.crt: no such file"),
    (["--max-body-bytes", "100"], "--max-body-bytes must be at least 1024"),
    (["--signal-interval", "0"], "--signal-interval and --signal-max-age must be > 0"),
    (["--prometheus-url", "prometheus:9090"], "--prometheus-url must start with http:// or https://"),
])
def test_bad_flags_stop_start_up_naming_the_flag(tmp_path: Path, argv: list[str], says: str) -> None:
    existing = write(tmp_path, "exists.pem", "-----BEGIN-----\n")
    with pytest.raises(SettingsError) as err:
        build_settings(parse(*[existing if a == "@FILE@" else a for a in argv]))
    assert says in str(err.value)


def test_kubeconfig_and_cluster_are_exclusive(cluster_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse("--cluster", str(cluster_file), "--kubeconfig", str(cluster_file))
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_good_flags_give_settings(tmp_path: Path, cluster_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write(tmp_path, "config.yaml", "version: v1\npolicies: [{name: bestfit}]\nnarrowing: {margin: 0.1}\n")
    kubeconfig = write(tmp_path, "kubeconfig", "apiVersion: v1\nkind: Config\n")
    monkeypatch.setenv("POD_NAME", "sched-7")
    s = build_settings(parse("--config", config, "--kubeconfig", kubeconfig, "--lease", "gpu/leader",
                             "--port", "9443", "--prometheus-url", "http://prometheus:9090"))
    assert (s.kubeconfig, s.cluster, s.lease_namespace, s.lease_name) == (kubeconfig, None, "gpu", "leader")
    assert (s.fencing, s.identity, s.address, s.port) == (True, "sched-7", "127.0.0.1", 9443)
    assert s.config.narrowing.margin == 0.1 and [p.name for p in s.config.policies] == ["bestfit"]
    assert build_settings(parse("--kubeconfig", kubeconfig, "--no-fencing", "--identity", "x")).fencing is False
    dry = build_settings(parse("--cluster", str(cluster_file)))
    assert dry.cluster == cluster_file and dry.fencing is False  # a dry run has no Lease to read
    assert (dry.ops_address, dry.ops_port, dry.tls_client_ca) == ("0.0.0.0", 8889, None)
    # Off loopback only with client certificates; loopback in any spelling needs none.
    pem = write(tmp_path, "x.pem", "-----BEGIN-----\n")
    remote = build_settings(parse("--cluster", str(cluster_file), "--address", "0.0.0.0", "--tls-cert", pem,
                                  "--tls-key", pem, "--tls-client-ca", pem))
    assert (remote.address, remote.tls_client_ca) == ("0.0.0.0", pem)
    for loop in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert build_settings(parse("--cluster", str(cluster_file), "--address", loop)).address == loop


def test_run_refuses_a_bad_config_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write(tmp_path, "config.yaml", "version: v1\npolicies: [{name: nope}]\n")
    assert run(parse("--config", config)) == 2
    assert "gpu-slice extender: invalid config: policies.0.name: unknown policy 'nope'" in capsys.readouterr().err
    assert gpu_slice(["extender", "--lease", "nolash"]) == 2
    assert "--lease must be NAMESPACE/NAME" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ Service


def test_service_on_a_fake_cluster_file_is_ready_and_binds_in_memory(cluster_file: Path) -> None:
    items = parse_list_text(cluster_file.read_text(encoding="utf-8"))
    nodes = [str(i["metadata"]["name"]) for i in items if i["kind"] == "Node"]
    running = [i for i in items if i["kind"] == "Pod"]
    service = Service(build_settings(parse("--cluster", str(cluster_file))))
    service.start()
    try:
        ext = service.ext
        assert ext.ready and service.ready() == (True, "")
        # The running pods' slices are counted from their annotations.
        held = {uid for n in ext.view.nodes.values() for uid in n.held.values()}
        assert held == {str(p["metadata"]["uid"]) for p in running}
        with TestClient(build_app(ext, max_body=service.settings.max_body_bytes, ready=service.ready)) as c:
            assert c.get("/readyz").status_code == 200
            got = ok_json(post(c, "filter", filter_names(pod_json("p1", 2), nodes)))
            assert got["Error"] == "" and len(got["NodeNames"]) == 1
            node = got["NodeNames"][0]
            bind = '{"PodName": "p1", "PodNamespace": "ml", "PodUID": "uid-p1", "Node": "' + node + '"}'
            assert ok_json(post(c, "bind", bind)) == {"Error": ""}
        binder = ext.binder
        assert isinstance(binder, MemoryBinder) and binder.binds == [("ml", "p1", node)]
    finally:
        service.stop()


def test_service_refuses_a_cluster_file_that_is_not_a_list(tmp_path: Path) -> None:
    path = write(tmp_path, "cluster.yaml", "kind: List\nitems: [\n")
    with pytest.raises(SettingsError) as err:
        Service(build_settings(parse("--cluster", path)))
    assert str(err.value).startswith(f"--cluster {path}: ")


def test_without_kubeconfig_or_cluster_the_service_needs_the_in_cluster_account(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with pytest.raises(SettingsError) as err:
        Service(build_settings(parse()))
    assert "cannot use the in-cluster service account" in str(err.value)
    assert "give --kubeconfig or --cluster" in str(err.value)
    broken = write(tmp_path, "kubeconfig", "apiVersion: v1\nkind: Config\n")
    assert run(parse("--kubeconfig", broken)) == 2
    assert f"gpu-slice extender: cannot use {broken}: " in capsys.readouterr().err


def test_service_refreshes_signals_in_the_background_and_stops(cluster_file: Path) -> None:
    """With --prometheus-url the signal loop runs; Prometheus being down is counted, never fatal."""
    closed = free_port()  # nothing listens there: every query is refused at once
    service = Service(build_settings(parse("--cluster", str(cluster_file), "--prometheus-url",
                                           f"http://127.0.0.1:{closed}", "--signal-interval", "0.05")))
    service.start()
    try:
        def errors() -> float:
            body, _ = service.metrics.render()
            return sum(float(line.split()[-1]) for line in body.decode().splitlines()
                       if line.startswith("gpu_slice_extender_prometheus_query_errors_total"))

        assert wait_for(lambda: errors() > 0)
        assert service.ext.ready and service.ready()[0]
    finally:
        service.stop()
    assert all(not t.is_alive() for t in service._threads)


@pytest.fixture
def kubeconfig(tmp_path: Path, fake_api: FakeApiServer) -> str:
    return write(tmp_path, "kubeconfig", json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": fake_api.url}}],
        "users": [{"name": "fake", "user": {"token": "not-checked"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}))


@pytest.fixture
def api_service(kubeconfig: str) -> Iterator[Service]:
    service = Service(build_settings(parse("--kubeconfig", kubeconfig, "--identity", ME)))
    try:
        yield service
    finally:
        service.stop()


def metric(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_service_on_the_api_server_turns_ready_after_sync_and_again_after_a_leader_change(
        fake_api: FakeApiServer, api_service: Service) -> None:
    for obj in small_cluster():
        (fake_api.store.put_node if obj["kind"] == "Node" else fake_api.store.put_pod)(obj)
    fake_api.store.put_lease(lease(f"{ME}_0b8e2c1a-5d4f-4c3b-9a8e-7f6d5c4b3a21"))
    service = api_service
    settings: Settings = service.settings
    assert settings.fencing and service.fence.enabled
    fake_api.store.put_pod(pod_obj("p1", 2))
    app = build_app(service.ext, ready=service.ready)
    with TestClient(app) as c:
        assert c.get("/readyz").status_code == 503  # nothing listed yet
        service.start()
        assert wait_for(lambda: c.get("/readyz").status_code == 200)
        assert wait_for(lambda: service.fence.record is not None)
        assert metric(c.get("/metrics").text, "gpu_slice_extender_leader") == 1  # no /readyz needed
        got = ok_json(post(c, "filter", filter_names(pod_json("p1", 2), ["gpu-a", "gpu-b"])))
        assert got["NodeNames"] == ["gpu-b"]

        # Another replica takes over: the fence's own poll notices (no /readyz in between). Until a
        # fresh list has caught up, the verbs refuse too, not only /readyz (the node list is held
        # back, so the catching-up is seen).
        fake_api.hang_next("list", "/api/v1/nodes", 1.0)
        fake_api.store.put_lease(lease("gpu-slice-scheduler-1_7f6d5c4b-3a21-4c3b-9a8e-0b8e2c1a5d4f"))
        assert wait_for(lambda: service.ext.not_ready() != "")
        got = ok_json(post(c, "filter", filter_names(pod_json("p1", 2), ["gpu-a", "gpu-b"])))
        assert got["NodeNames"] == [] and "leadership changed" in got["Error"]
        resp = c.get("/readyz")
        assert resp.status_code == 503 and "leadership changed" in resp.text
        assert wait_for(lambda: c.get("/readyz").status_code == 200)
        assert service.informer is not None and service.informer.relists["Node"] >= 2
        assert metric(c.get("/metrics").text, "gpu_slice_extender_leader") == 0
        bind = '{"PodName": "p1", "PodNamespace": "ml", "PodUID": "uid-p1", "Node": "gpu-b"}'
        assert "does not hold its lease" in ok_json(post(c, "bind", bind))["Error"]


# ------------------------------------------------------------------------------------------ the command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_gpu_slice_extender_serves_a_fake_cluster_and_stops_on_sigterm(cluster_file: Path) -> None:
    port = free_port()
    ops = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gpuslice_cli", "extender", "--cluster", str(cluster_file),
                             "--address", "127.0.0.1", "--port", str(port), "--ops-address", "127.0.0.1",
                             "--ops-port", str(ops), "--log-level", "warning"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if proc.poll() is not None:
                return True  # exited: stop waiting, the assertion below says why
            try:
                return httpx.get(f"http://127.0.0.1:{ops}/readyz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_for(ready, timeout=3 * WAIT)
        assert proc.poll() is None, proc.communicate()
        nodes = [str(i["metadata"]["name"]) for i in parse_list_text(cluster_file.read_text(encoding="utf-8"))
                 if i["kind"] == "Node"]
        got = httpx.post(f"{base}/filter", content=filter_names(pod_json("p1", 1), nodes).encode(),
                         headers={"Content-Type": "application/json"}, timeout=5)
        result = wire.parse_filter_result(got.json())
        assert got.status_code == 200 and result.error == "" and len(result.passing) == 1
        # Each port serves its own: no verbs on the ops port, no probes or metrics on the verbs' port.
        assert httpx.post(f"http://127.0.0.1:{ops}/filter", content=b"{}", timeout=5).status_code == 404
        assert httpx.get(f"{base}/metrics", timeout=5).status_code == 404
        assert "gpu_slice_extender_requests_total" in httpx.get(f"http://127.0.0.1:{ops}/metrics", timeout=5).text
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=WAIT)
        assert proc.returncode == 0, err.decode(errors="replace")  # drained, service stopped, clean exit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_memory_binder_keeps_only_pods_that_may_still_be_bound() -> None:
    """--cluster: a pod the file shows bound lives only in the view; pending and asked-about pods are kept."""
    from extender.binder import MemoryBinder

    running = {"metadata": {"name": "run", "namespace": "ns", "uid": "u1"}, "spec": {"nodeName": "n1"}}
    pending = {"metadata": {"name": "wait", "namespace": "ns", "uid": "u2"}, "spec": {}}
    binder = MemoryBinder([running, pending])
    assert binder.read_pod("ns", "run") is None
    assert binder.read_pod("ns", "wait") == pending
    binder.bind("ns", "wait", "u2", "n1", {})
    assert [p["metadata"]["name"] for p in binder.node_pods("n1")] == ["wait"]


def test_the_first_leader_after_no_lease_starts_without_a_catch_up(fake_api: FakeApiServer,
                                                                   api_service: Service) -> None:
    """No Lease yet, then this replica's scheduler creates it: nobody decided before it, so the verbs
    are not held back (a relist is for a change from another leader)."""
    for obj in small_cluster():
        (fake_api.store.put_node if obj["kind"] == "Node" else fake_api.store.put_pod)(obj)
    service = api_service
    service.start()
    assert service.informer is not None
    assert wait_for(lambda: service.ext.not_ready() == "" and service.informer.synced)
    assert wait_for(lambda: service.fence.holds() is False and service.fence._observed)
    relists = dict(service.informer.relists)
    fake_api.store.put_lease(lease(f"{ME}_0b8e2c1a-5d4f-4c3b-9a8e-7f6d5c4b3a21"))
    assert wait_for(lambda: service.fence.holds())
    assert service.ext.not_ready() == "" and service.fence.generation == 1
    assert service.informer.relists == relists
