"""dcgm-exporter-compatible series. Expected lines are written by hand from reference/protocols.md 3.2."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from deviceplugin.dcgm import DcgmCollector, DcgmOptions, SliceUse, parse_utilization, render_text
from deviceplugin.simulated import parse_topology
from gpuslice.model import Gpu

TOPOLOGY = parse_topology({"node": "gpu-node-1", "gpus": [
    {"product": "H100-80GB", "mode": "mig", "uuid": "GPU-aaaa", "instances": [
        {"profile": "1g.10gb", "start": 2, "uuid": "MIG-one"},
        {"profile": "3g.40gb", "start": 4, "uuid": "MIG-three"}]},
    {"product": "H100-80GB", "mode": "mps", "uuid": "GPU-bbbb", "slices": 4},
    {"product": "H100-80GB", "mode": "whole", "uuid": "GPU-cccc", "slices": 4},
]})
GPUS: tuple[Gpu, ...] = TOPOLOGY.gpus
BASE0 = ('gpu="0",UUID="GPU-aaaa",pci_bus_id="00000000:07:00.0",device="nvidia0",'
         'modelName="NVIDIA H100 80GB HBM3"')
BASE1 = ('gpu="1",UUID="GPU-bbbb",pci_bus_id="00000000:0F:00.0",device="nvidia1",'
         'modelName="NVIDIA H100 80GB HBM3"')
BASE2 = ('gpu="2",UUID="GPU-cccc",pci_bus_id="00000000:17:00.0",device="nvidia2",'
         'modelName="NVIDIA H100 80GB HBM3"')
HOST = 'hostname="gpu-node-1",DCGM_FI_DRIVER_VERSION="550.54.15"'


def uses() -> dict[str, SliceUse]:
    return {
        "MIG-one::0": SliceUse("ml", "llm-0", "main", "42"),
        "GPU-bbbb::0": SliceUse("ml", "a", "srv", "60"),
        "GPU-bbbb::1": SliceUse("ml", "a", "srv", "60"),
        "GPU-bbbb::2": SliceUse("ml", "b", "srv", " 20 "),
    }


def lines(text: str, metric: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(metric + "{")]


def test_series_names_labels_and_order_match_the_exporter() -> None:
    text = render_text(DcgmCollector(lambda: GPUS, uses, DcgmOptions(hostname="gpu-node-1")).collect())
    assert lines(text, "DCGM_FI_PROF_GR_ENGINE_ACTIVE") == [
        f'DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{BASE0},GPU_I_PROFILE="1g.10gb",GPU_I_ID="9",{HOST},'
        'container="main",namespace="ml",pod="llm-0"} 0.42',
        f'DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{BASE0},GPU_I_PROFILE="3g.40gb",GPU_I_ID="2",{HOST}}} 0',
        # MPS GPU, S=4: a holds 2 slices at 60 %, b 1 slice at 20 % -> 0.3 + 0.05; one series per pod
        f'DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{BASE1},{HOST},container="srv",namespace="ml",pod="a"}} 0.35',
        f'DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{BASE1},{HOST},container="srv",namespace="ml",pod="b"}} 0.35',
        f'DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{BASE2},{HOST}}} 0',
    ]
    # no GPU_UTIL on MIG instances
    assert lines(text, "DCGM_FI_DEV_GPU_UTIL") == [
        f'DCGM_FI_DEV_GPU_UTIL{{{BASE1},{HOST},container="srv",namespace="ml",pod="a"}} 35',
        f'DCGM_FI_DEV_GPU_UTIL{{{BASE1},{HOST},container="srv",namespace="ml",pod="b"}} 35',
        f'DCGM_FI_DEV_GPU_UTIL{{{BASE2},{HOST}}} 0',
    ]
    assert lines(text, "DCGM_FI_PROF_DRAM_ACTIVE")[0].endswith(" 0.336")  # 0.8 x 0.42
    # memory: 1g.10gb instance 9984 MiB, 90 % of it in use; MPS: 3 of 4 slices held, 90 % of that share
    assert lines(text, "DCGM_FI_DEV_FB_USED")[0].endswith(" 8986")
    assert lines(text, "DCGM_FI_DEV_FB_FREE")[0].endswith(" 998")
    assert lines(text, "DCGM_FI_DEV_FB_USED")[2].endswith(" 55052")  # round(81559 * 3/4 * 0.9)
    assert lines(text, "DCGM_FI_DEV_FB_FREE")[4].endswith(" 81559")
    assert "# TYPE DCGM_FI_DEV_FB_USED gauge" in text


def test_hostname_label_and_driver_version_are_configurable_and_registry_serves_it() -> None:
    collector = DcgmCollector(lambda: GPUS[2:], dict, DcgmOptions(hostname="n", hostname_label="Hostname",
                                                                  driver_version=None))
    text = render_text(collector.collect())
    assert f'DCGM_FI_DEV_GPU_UTIL{{{BASE2},Hostname="n"}} 0' in text.splitlines()
    registry = CollectorRegistry()
    registry.register(collector)
    assert registry.get_sample_value("DCGM_FI_DEV_FB_FREE", {
        "gpu": "2", "UUID": "GPU-cccc", "pci_bus_id": "00000000:17:00.0", "device": "nvidia2",
        "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "n"}) == 81559
    assert b"DCGM_FI_DEV_GPU_UTIL{" in generate_latest(registry)


@pytest.mark.parametrize("raw", ["high", "101", "-1", "nan", "inf", "", True, [], "5%"])
def test_bad_utilization_is_ignored_logged_once_and_counted(raw: object, caplog: pytest.LogCaptureFixture) -> None:
    bad = {"GPU-bbbb::0": SliceUse("ml", "x", "srv", raw)}  # type: ignore[arg-type]
    collector = DcgmCollector(lambda: GPUS[1:2], lambda: bad)
    registry = CollectorRegistry()
    registry.register(collector)
    with caplog.at_level(logging.WARNING, logger="deviceplugin.dcgm"):
        for _ in range(3):
            generate_latest(registry)
    assert registry.get_sample_value("gpu_slice_simulated_utilization_invalid_total") == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"pod ml/x: annotation example.com/simulated-utilization ignored: utilization must be a number 0-100, "
        f"got {raw!r}"]
    assert registry.get_sample_value("DCGM_FI_DEV_GPU_UTIL", {
        "gpu": "1", "UUID": "GPU-bbbb", "pci_bus_id": "00000000:0F:00.0", "device": "nvidia1",
        "modelName": "NVIDIA H100 80GB HBM3", "hostname": "sim-node", "DCGM_FI_DRIVER_VERSION": "550.54.15",
        "container": "srv", "namespace": "ml", "pod": "x"}) == 0


def test_parse_utilization_accepts_numbers_in_range() -> None:
    assert [parse_utilization(v) for v in ("0", "100", "37.5", 12, None)] == [0, 100, 37.5, 12, 0]


def test_malformed_slice_id_does_not_fail_the_scrape() -> None:
    collector = DcgmCollector(lambda: GPUS, lambda: {"not-an-id": SliceUse("a", "b", "c", "1")})
    assert "DCGM_FI_DEV_FB_USED" in render_text(collector.collect())
