"""CI runs the README's test command itself, and the ``test`` extra is enough for the whole suite."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_TEST_COMMAND = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/pytest"


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("awk") is None, reason="needs bash and awk")
def test_ci_reads_the_test_command_from_the_readme() -> None:
    out = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--print-test-command"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == README_TEST_COMMAND
    assert f"```sh\n{README_TEST_COMMAND}\n```" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_test_extra_brings_what_the_suite_runs() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    test = " ".join(extras["test"])
    # tests/test_architecture.py runs lint-imports; tests/protos/test_wire.py imports grpc_tools.
    for needed in ("pytest", "pytest-timeout", "pytest-asyncio", "hypothesis", "import-linter",
                   "grpcio-tools==1.85.1"):
        assert needed in test, needed
    assert "gpu-slice[test]" in extras["dev"]
