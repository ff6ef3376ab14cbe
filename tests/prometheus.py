"""Debian's ``prometheus`` on loopback for tests: scrape some targets every second, answer instant
queries, stop by itself (terminated, then killed) when the block ends."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SKIP = "Debian's prometheus binary is absent (apt-get install -y prometheus)"


def binary() -> str | None:
    return shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Prometheus:
    url: str

    def answer(self, promql: str) -> dict[str, Any]:
        """The whole answer of an instant query, an error answer (a bad query) included."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return dict(json.loads(resp.read()))
        except urllib.error.HTTPError as err:
            return dict(json.loads(err.read()))

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant query's result list ([] while Prometheus is not up yet)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                body = json.loads(resp.read())
        except OSError:
            return []
        result: list[dict[str, Any]] = body["data"]["result"]
        return result


@contextlib.contextmanager
def running(targets: list[str], work: Path, job: str = "gpu-slice-device-plugin") -> Iterator[Prometheus]:
    """Prometheus scraping ``targets`` (host:port) every second, its data under ``work``."""
    exe = binary()
    assert exe is not None, SKIP
    port = _free_port()
    config = work / "prometheus.yml"
    config.write_text("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                      f"scrape_configs:\n  - job_name: {job}\n    honor_labels: true\n"
                      f"    static_configs: [{{targets: {json.dumps(targets)}}}]\n")
    proc = subprocess.Popen([exe, f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield Prometheus(f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
