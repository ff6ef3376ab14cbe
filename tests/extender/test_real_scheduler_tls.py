"""The extender served to a remote kube-scheduler: TLS with client-certificate verification (issue 47),
with the real kube-scheduler 1.36 of ``../shared/k8s`` (skipped where it or ``openssl`` is absent).

A CA signs the extender's serving certificate and kube-scheduler's client certificate; the extender runs
with ``--tls-cert/--tls-key/--tls-client-ca``; kube-scheduler runs the shipped profile with
``enableHTTPS: true`` and a ``tlsConfig`` holding its client certificate. A client without a
certificate is refused in the TLS handshake; a client whose certificate another CA signed too;
kube-scheduler with its certificate is served: it filters and binds a slice pod through the extender.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.extender.test_real_scheduler import (
    CLUSTER,
    REPO,
    SHIPPED_CONFIG,
    Api,
    _cluster,
    _fake_nodes,
    _free_port,
    _http_get,
    _stop,
    _wait,
)

pytestmark = [
    pytest.mark.skipif(not CLUSTER.is_file(), reason=f"no real control plane: {CLUSTER} is absent"),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed (it makes the test's CA)"),
    pytest.mark.timeout(180),
]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", cwd=d)


def make_cert(d: Path, ca: str, name: str, *, server: bool) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=d)
    ext = d / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n" if server
                   else "extendedKeyUsage=clientAuth\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", ext.name, "-out", f"{name}.crt", cwd=d)


@pytest.fixture(scope="module")
def tls_cluster() -> Iterator[tuple[Path, Api, int, int]]:
    work = Path(tempfile.mkdtemp(prefix="gst-"))
    extender: subprocess.Popen[bytes] | None = None
    log = None
    try:
        make_ca(work, "ca")
        make_cert(work, "ca", "extender", server=True)
        make_cert(work, "ca", "kube-scheduler", server=False)
        make_ca(work, "other-ca")
        make_cert(work, "other-ca", "stranger", server=False)
        _cluster("up", str(work))
        api = Api(str(work / "kubeconfig"))
        for node in _fake_nodes("--nodes", "2", "--gpus-per-node", "1", "--mode", "mps", "--seed", "3",
                                "--node-prefix", "tls"):
            api.create_node(node)
        port, ops = _free_port(), _free_port()
        log = open(work / "extender.log", "wb")  # noqa: SIM115 - closed in finally
        extender = subprocess.Popen(
            [sys.executable, "-m", "gpuslice_cli", "extender", "--kubeconfig", str(work / "kubeconfig"),
             "--no-fencing", "--address", "127.0.0.1", "--port", str(port), "--ops-address", "127.0.0.1",
             "--ops-port", str(ops), "--tls-cert", str(work / "extender.crt"), "--tls-key", str(work / "extender.key"),
             "--tls-client-ca", str(work / "ca.crt")], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        _wait("extender /readyz", lambda: _http_get(f"http://127.0.0.1:{ops}/readyz")[0] == 200, 30)
        config = yaml.safe_load(SHIPPED_CONFIG.read_text())
        (ext,) = config["extenders"]
        ext["urlPrefix"] = f"https://127.0.0.1:{port}"
        ext["enableHTTPS"] = True
        ext["tlsConfig"] = {"certFile": str(work / "kube-scheduler.crt"), "keyFile": str(work / "kube-scheduler.key"),
                            "caFile": str(work / "ca.crt")}
        config["leaderElection"]["leaderElect"] = False
        path = work / "scheduler-config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        _cluster("scheduler", str(work), str(path))
        yield work, api, port, ops
    finally:
        try:
            _stop(extender)
        finally:
            subprocess.run([sys.executable, str(CLUSTER), "down", str(work)], capture_output=True, timeout=60,
                           check=False)
            if log is not None:
                log.close()
            shutil.rmtree(work, ignore_errors=True)


def _post(port: int, ctx: ssl.SSLContext) -> int:
    req = urllib.request.Request(f"https://127.0.0.1:{port}/filter", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
        return int(r.status)


def _context(work: Path, cert: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(work / "ca.crt"))
    if cert is not None:
        ctx.load_cert_chain(str(work / f"{cert}.crt"), str(work / f"{cert}.key"))
    return ctx


def test_without_a_client_certificate_the_verbs_are_refused(tls_cluster: tuple[Path, Api, int, int]) -> None:
    work, _api, port, _ops = tls_cluster
    for cert in (None, "stranger"):  # no certificate; one another CA signed
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError, OSError)):
            _post(port, _context(work, cert))
    with pytest.raises(urllib.error.HTTPError) as err:  # a certificate of the CA: served (400: an empty pod)
        _post(port, _context(work, "kube-scheduler"))
    assert err.value.code == 400
    # Plain HTTP on the verbs' port gets no answer either.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        s.settimeout(5)
        try:
            data = s.recv(4096)
        except OSError:
            data = b""
    assert b'"Error"' not in data


def test_kube_scheduler_with_its_certificate_is_served(tls_cluster: tuple[Path, Api, int, int]) -> None:
    work, api, _port, ops = tls_cluster
    api.create_pod("tls-pod", 2)

    def bound() -> str:
        pods = [p for p in api.pods() if p["metadata"]["name"] == "tls-pod"]
        return str(pods[0]["spec"].get("nodeName") or "") if pods else ""

    try:
        node = _wait("the pod bound through the extender over TLS", bound, 60)
    except AssertionError as err:
        logs = (work / "extender.log").read_text(errors="replace")[-3000:]
        sched = (work / "logs" / "scheduler.log").read_text(errors="replace")[-3000:]
        raise AssertionError(f"{err}\n--- extender\n{logs}\n--- scheduler\n{sched}") from None
    assert node.startswith("tls")
    _, metrics = _http_get(f"http://127.0.0.1:{ops}/metrics")
    assert 'gpu_slice_extender_requests_total{outcome="ok",verb="bind"} 1.0' in metrics, metrics
