"""Building the shipped kustomize tree: ``kubectl kustomize`` once per overlay, cached for the session.

Every test that reads the built objects goes through ``build``; when kubectl is absent they skip with
the reason (``.ci/run`` installs it, so CI never skips them).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
OVERLAYS = ("nvidia", "simulated")
EXAMPLES = MANIFESTS / "examples"
NAMESPACE = "gpu-slice-system"

#: The Kubernetes versions the manifests are validated against (README "Supported versions").
OLDEST, NEWEST = "1.30", "1.36"

#: Kinds of the Prometheus operator, which no Kubernetes schema covers.
MONITORING_KINDS = frozenset({"PodMonitor", "ServiceMonitor", "PrometheusRule"})

Obj = dict[str, Any]


def kubectl() -> str | None:
    return shutil.which("kubectl")


def run_kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """kubectl as the identity of one kubeconfig file, its output captured; the caller judges the exit."""
    exe = kubectl()
    assert exe is not None
    return subprocess.run([exe, "--kubeconfig", str(kubeconfig), *args], input=stdin, capture_output=True, text=True,
                          timeout=60, check=False)


@functools.cache
def _build(path: str) -> tuple[Obj, ...]:
    exe = kubectl()
    assert exe is not None
    done = subprocess.run([exe, "kustomize", path], capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize {path} failed:\n{done.stderr}")
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


@functools.cache
def _monitored(overlay: str) -> tuple[Obj, ...]:
    """The overlay with the opt-in monitoring component, as README "Install" tells users to add it: a
    kustomization of their own whose resources are the overlay and whose components the monitoring."""
    with tempfile.TemporaryDirectory(prefix="gsk") as tmp:
        rel = os.path.relpath(MANIFESTS, tmp)
        Path(tmp, "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            f"resources:\n  - {rel}/overlays/{overlay}\ncomponents:\n  - {rel}/components/monitoring\n")
        return _build(tmp)


@functools.cache
def with_scheduler_tag(overlay: str, tag: str) -> tuple[Obj, ...]:
    """The overlay with the scheduler image set to ``tag`` the way README "Install" says: an ``images``
    entry (what ``kustomize edit set image`` writes) in a kustomization over the overlay."""
    if kubectl() is None:
        pytest.skip("kubectl is not installed (.ci/run installs it): the kustomize tree cannot be built")
    with tempfile.TemporaryDirectory(prefix="gsk") as tmp:
        rel = os.path.relpath(MANIFESTS, tmp)
        Path(tmp, "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            f"resources:\n  - {rel}/overlays/{overlay}\n"
            f"images:\n  - name: registry.k8s.io/kube-scheduler\n    newTag: {tag}\n")
        return _build(tmp)


def build(overlay: str, *, monitoring: bool = False) -> list[Obj]:
    """The objects ``kubectl kustomize manifests/overlays/<overlay>`` renders (skips without kubectl);
    ``monitoring``: with the opt-in ``components/monitoring`` added."""
    if kubectl() is None:
        pytest.skip("kubectl is not installed (.ci/run installs it): the kustomize tree cannot be built")
    if monitoring:
        return [dict(o) for o in _monitored(overlay)]
    return [dict(o) for o in _build(str(MANIFESTS / "overlays" / overlay))]


def build_text(path: Path) -> str:
    exe = kubectl()
    if exe is None:
        pytest.skip("kubectl is not installed (.ci/run installs it)")
    done = subprocess.run([exe, "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def named_prefix(objs: list[Obj], kind: str, prefix: str) -> Obj:
    """A generated object (ConfigMap with a hash suffix) by its name before the suffix."""
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].startswith(prefix + "-")]
    assert len(found) == 1, f"expected one {kind} {prefix}-<hash>, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def examples() -> list[tuple[str, Obj]]:
    out = []
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        out += [(path.relative_to(EXAMPLES).as_posix(), d) for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def until_refused(attempt: Callable[[int], subprocess.CompletedProcess[str]], marker: str,
                  timeout: float = 30) -> None:
    """The API server compiles a new admission policy within a second or two: call ``attempt(n)`` until
    it is refused with ``marker`` in its error. ``n`` counts the attempts, so a write can carry a new
    value each time (a write that changes nothing is admitted and would never show the refusal)."""
    deadline = time.monotonic() + timeout
    n = 0
    while True:
        done = attempt(n)
        if done.returncode != 0 and marker in done.stderr:
            return
        assert time.monotonic() < deadline, f"the policy never took effect: {done.stdout}{done.stderr}"
        n += 1
        time.sleep(0.5)
