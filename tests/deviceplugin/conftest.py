"""Shared fixtures for the device plugin tests: short socket dirs, the kubelet stand-in, the fake API."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakeapi.fixtures import fake_api  # noqa: F401
from tests.kubelet.standin import KubeletStandin


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short temp dir (unix socket paths must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="gs-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(sock_dir: Path) -> Iterator[KubeletStandin]:
    """A started kubelet stand-in serving Registration and PodResources under ``sock_dir``."""
    k = KubeletStandin(sock_dir / "dp", sock_dir / "pr", seed=7)
    k.start()
    try:
        yield k
    finally:
        k.stop()


# The whole-app fixture of test_app.py, for the other whole-app modules (test_app_node.py).
from tests.deviceplugin.test_app import env  # noqa: E402,F401
