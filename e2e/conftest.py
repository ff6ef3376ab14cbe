"""One whole system per ``pytest e2e`` session (``e2e/harness.py``), stopped at the end whatever happens.

Where ``../shared/k8s``, kubectl or ``prometheus`` is absent every test skips and says which. Each
scenario records its duration, the faults it injected, the inputs it tried and its DESIGN 8 counts
in ``RECORD``; the terminal summary prints them, and ``GPU_SLICE_E2E_RESULTS=FILE`` writes them as
JSON (what ``e2e/RESULTS.md`` reports).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from e2e.harness import System, clean, skip_reason

RECORD: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="session")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    s = System(tmp_path_factory.mktemp("e2e"))
    try:
        s.start()
        RECORD.setdefault("start", {})["duration_s"] = round(s.timings["start_s"], 1)
        RECORD["start"]["fencing"] = s.fencing
        RECORD["start"]["replicas"] = len(s.replicas)
        yield s
    finally:
        s.close()


def pytest_configure(config: pytest.Config) -> None:
    # SIGTERM (a CI timeout, a stopped job) unwinds like Ctrl-C, so the session's finalizers stop every process.
    def _term(_sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _term)


@pytest.fixture(autouse=True)
def _clean_after(request: pytest.FixtureRequest) -> Iterator[None]:
    """Whatever a scenario left (a failed one too), the next starts on an empty test namespace, with
    every kube-scheduler replica running (one that exited, say on losing its Lease, is started again
    as the kubelet would)."""
    yield
    if "system" in request.fixturenames:
        s: System = request.getfixturevalue("system")
        with contextlib.suppress(Exception):
            clean(s)
        with contextlib.suppress(Exception):
            s.revive_schedulers()


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The calling scenario's entry in RECORD; its duration is filled in afterwards."""
    entry: dict[str, Any] = RECORD.setdefault(request.node.name, {})
    t0 = time.monotonic()
    yield entry
    entry["duration_s"] = round(time.monotonic() - t0, 1)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RECORD:
        return
    terminalreporter.section("gpu-slice e2e record")
    for name, entry in RECORD.items():
        terminalreporter.write_line(f"{name}: {json.dumps(entry, sort_keys=True, default=str)}")
    out = os.environ.get("GPU_SLICE_E2E_RESULTS")
    if out:
        with open(out, "w") as f:
            json.dump(RECORD, f, indent=2, sort_keys=True, default=str)
