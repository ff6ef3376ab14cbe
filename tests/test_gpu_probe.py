"""``e2e/gpu_probe.py`` (run by hand on a lent GPU machine) against the fake NVML at the nvidia-ml-py seam:
it reports what the plugin would advertise, the node's CDI names and which advertised owner lacks one,
the reset state and the processes, and never lets a setter through."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deviceplugin.test_nvml_backend import H100, MIB, FakeGpu, FakeNvml, mig_gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))


class ProbeNvml(FakeNvml):
    def nvmlSystemGetDriverVersion(self) -> str:
        return "570.86.15"


def test_probe_reads_cdi_names_reset_state_and_processes_and_changes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import gpu_probe

    mps = FakeGpu("GPU-bbbb", H100, 81559, processes=[(4242, 900 * MIB)], mps_clients=[(4343, 5000 * MIB)])
    mps.remap = (0, 1, 1, 0)
    nv = ProbeNvml([mig_gpu(), mps])
    monkeypatch.setattr(gpu_probe, "pynvml", nv)
    spec = tmp_path / "cdi" / "nvidia.yaml"
    spec.parent.mkdir()
    spec.write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: '0'\n- name: GPU-bbbb\n"
                    "- name: MIG-3g\n- name: MIG-2g\n")
    out = tmp_path / "probe.json"
    monkeypatch.setattr(sys, "argv", ["gpu_probe.py", "--health-seconds", "0.2", "--out", str(out),
                                      "--cdi-spec-dir", str(spec.parent)])
    assert gpu_probe.main() == 0  # read-only: nothing changed, no setter attempted
    report: dict[str, Any] = json.loads(out.read_text())
    assert report["cdi"]["specs"] == [str(spec)] and report["cdi"]["names"] == ["0", "GPU-bbbb", "MIG-2g", "MIG-3g"]
    assert list(report["cdi"]["advertised_without_a_name"]) == ["MIG-1g"]
    assert report["reset_needed"] == ["GPU-bbbb"]
    assert report["processes"]["GPU-bbbb"] == [{"pid": 4242, "used_mib": 900, "mps_client": False},
                                               {"pid": 4343, "used_mib": 5000, "mps_client": True}]
    health = {d["ID"].rsplit("::", 1)[0]: d["health"] for d in report["devices"]}
    assert health == {"MIG-3g": "Healthy", "MIG-2g": "Healthy", "MIG-1g": "Unhealthy", "GPU-bbbb": "Unhealthy"}
    assert report["unchanged"] and report["setters_refused"] == []
    assert "nvmlDeviceSetComputeMode" not in report["nvml_calls"]
    assert "PROBE OK" in capsys.readouterr().err
