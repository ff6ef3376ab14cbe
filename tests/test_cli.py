"""The ``gpu-slice`` entry point: lazy dispatch and honest refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuslice_cli import main as cli


def test_no_command_prints_usage_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "simulate" in capsys.readouterr().err


def test_unknown_command_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bogus"])
    assert exc.value.code == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


def test_unbuilt_subcommand_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(cli.SUBCOMMANDS, "extender", ("gpuslice_not_a_module.cli", "x"))
    assert cli.main(["extender"]) == cli.EXIT_NOT_BUILT
    assert "gpu-slice extender: not built yet" in capsys.readouterr().err


def test_every_subcommand_is_registered() -> None:
    assert set(cli.SUBCOMMANDS) == {"simulate", "extender", "device-plugin", "mps-daemon", "fake-cluster", "status"}


def test_help_does_not_import_heavy_packages() -> None:
    code = ("import sys; from gpuslice_cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('grpc', 'kubernetes', 'matplotlib', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
