"""The ``../shared/k8s`` launcher (real etcd, kube-apiserver, kube-scheduler, kubelet-dm), called one
way by the tests, ``e2e/`` and the benches: a failed command raises ``AssertionError`` with its
exit status and the end of its stderr, so a test shows why the control plane did not start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
K8S = REPO.parent / "shared" / "k8s"
CLUSTER = K8S / "cluster"


def run_cluster(*args: str, timeout: float = 180) -> str:
    """Run ``cluster ARGS`` and return its stripped stdout."""
    done = subprocess.run([sys.executable, str(CLUSTER), *args], capture_output=True, text=True, timeout=timeout,
                          check=False)
    if done.returncode != 0:
        raise AssertionError(f"cluster {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout.strip()
