"""``gpu-slice simulate --device-choice free|steered|first-fit`` and ``--republish-every`` (issue 52)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuslice.config import default_policy_spec
from gpuslice.fakecluster import FakeClusterSpec, generate
from gpuslice.packing.state import KIND_MPS, ClusterState, NodeSpec, PackRequest, UnitSpec
from gpuslice.scheduler import PackedCluster, Scheduler
from simulator.cli import NODE_FILE, default_trace_dir, run
from simulator.dra import DeviceChoice, DeviceChoiceError, Driver, attach
from simulator.engine import EngineOptions, replay, simulate
from simulator.inflate import inflate
from simulator.kubefile import inflate_requests, load_kube_cluster
from simulator.llm.cluster import build_cluster
from simulator.llm.engine import replay as day_replay
from simulator.llm.workload import generate as day_workload
from simulator.metrics import unallocated_at
from simulator.openb import MILLI, read_nodes, read_pods

from .test_cli_simulate import files as tiny_openb  # the trace the golden file was recorded on
from .test_cli_simulate import parse

GOLDEN = json.loads((Path(__file__).parent / "data" / "free_golden.json").read_text())
DATA = default_trace_dir()
CHOICES = (DeviceChoice(), DeviceChoice("free"))


def fake_file(tmp_path: Path, mode: str, seed: int) -> Path:
    """What bench/robust_workloads.fake_cluster_file writes, on 6 nodes: the golden's clusters."""
    fc = generate(FakeClusterSpec(nodes=6, gpus_per_node=8, product="H100-80GB", mode=mode,  # type: ignore[arg-type]
                                  pods_per_node=8, seed=seed))
    path = tmp_path / f"fc_{mode}_{seed}.json"
    path.write_text(json.dumps(fc.document))
    return path


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


# ----- free decides exactly as before the flag existed ---------------------------------------------

def test_free_keeps_every_decision_on_fake_clusters(tmp_path: Path) -> None:
    devices = DeviceChoice("free")
    for mode, fc in (("mig", 4), ("mixed", 3), ("mps", 2)):
        cluster = load_kube_cluster([fake_file(tmp_path, mode, fc)])
        reqs = inflate_requests(cluster.requests, cluster.state().total_slices, 42, 1.3)
        for run_mode in ("protocol", "ideal"):
            r = replay(cluster.state(), reqs, cluster.requests, default_policy_spec(), 42,
                       EngineOptions(mode=run_mode, slices=cluster.slices_per_gpu, placements=True, devices=devices))
            want = GOLDEN["fake"][f"{mode}-{fc}-{run_mode}"]
            assert (r.pods_placed, len(r.placements), digest(r.placements)) == (want["placed"], want["pods"],
                                                                              want["sha256"])


@pytest.mark.parametrize("devices", CHOICES, ids=["default", "free"])
def test_free_keeps_every_decision_on_a_small_trace(tmp_path: Path, devices: DeviceChoice) -> None:
    node_file, pod_file = tiny_openb(tmp_path)
    nodes, pods = read_nodes(node_file), read_pods(pod_file)
    inflated = inflate(pods, sum(n.gpus for n in nodes) * MILLI, 7, 1.3)
    for run_mode in ("protocol", "wide", "ideal", "paper"):
        r = simulate(nodes, inflated, "fragmentation", 7, EngineOptions(mode=run_mode, devices=devices), trace=pods)
        assert digest([round(float(x), 9) for x in r.allocated]) == GOLDEN["openb"][run_mode]["sha256"]


def test_free_keeps_the_built_in_day() -> None:
    want = GOLDEN["builtin"]
    r = day_replay(build_cluster(), day_workload(want["seed"]), default_policy_spec(), devices=DeviceChoice("free"))
    got = r.as_dict()
    assert {k: got[k] for k in want if k != "seed"} == {k: v for k, v in want.items() if k != "seed"}


@pytest.mark.openb
@pytest.mark.skipif(not (DATA / NODE_FILE).is_file(), reason=f"openb trace not found under {DATA} "
                                                                "(set GPU_SLICE_OPENB_DIR)")
def test_free_keeps_the_openb_figure_on_a_reduced_trace() -> None:
    want = GOLDEN["openb_reduced"]
    nodes = read_nodes(DATA / NODE_FILE)[:: want["nodes_every"]]
    pods = read_pods(DATA / "openb_pod_list_default.csv")
    inflated = inflate(pods, sum(n.gpus for n in nodes) * MILLI, want["seed"])
    r = simulate(nodes, inflated, want["policy"], want["seed"], EngineOptions(devices=DeviceChoice("free")),
                 trace=pods)
    assert (unallocated_at(r.arrived, r.allocated, 100.0), r.pods_placed) == (want["unallocated_at_100"],
                                                                              want["placed"])


# ----- DRA's choice changes decisions, and a steered run holds together ------------------------------

def test_first_fit_and_steering_change_where_pods_go_and_leak_nothing(tmp_path: Path) -> None:
    cluster = load_kube_cluster([fake_file(tmp_path, "mixed", 3)])
    reqs = inflate_requests(cluster.requests, cluster.state().total_slices, 42, 1.3)
    where = {}
    for devices in (DeviceChoice(), DeviceChoice("first-fit"), DeviceChoice("steered"), DeviceChoice("steered", 4)):
        state = cluster.state()
        r = replay(state, reqs, cluster.requests, default_policy_spec(), 42,
                   EngineOptions(slices=cluster.slices_per_gpu, placements=True, devices=devices))
        where[devices.label] = r.placements
        assert state.allocated_slices == int(state.total_slices * r.allocated[-1] / 100.0 + 0.5)
    free, first_fit = where[DeviceChoice().label], where[DeviceChoice("first-fit").label]
    assert free != first_fit  # the extender's device choice and a fixed order disagree somewhere
    assert free != where[DeviceChoice("steered").label]


def test_a_steered_day_places_pods_and_leaks_nothing() -> None:
    r = day_replay(build_cluster(), day_workload(43), default_policy_spec(), devices=DeviceChoice("steered", 4))
    assert r.pods_placed > 900 and r.leaked_slices == 0


# ----- republishing: after every event, or every K events and one event late -------------------------

def lag_driver(every: int) -> tuple[Driver, ClusterState, int]:
    """A driver whose steering publishes, for one unit, the number of events seen when it computed."""
    state = ClusterState([NodeSpec("n", 64000, 256000, "H100")],
                         [UnitSpec(0, g, KIND_MPS, 7, memory_mib=81920) for g in range(2)], slices_per_gpu=7)
    driver = attach(Scheduler(PackedCluster(state), "bestfit"), DeviceChoice("steered", every))
    assert driver is not None and driver.steering is not None
    unit = int(state.node_rows(0)[1])
    driver.steering.orders = lambda: (np.array([unit]), np.array([100 + driver.events]))  # type: ignore[method-assign]
    return driver, state, unit


@pytest.mark.parametrize(("every", "seen"), [
    (0, [101, 102, 103, 104, 105, 106, 107]),  # after every event, at once
    (1, [1, 101, 102, 103, 104, 105, 106]),    # every event, one event late
    (3, [1, 1, 1, 103, 103, 103, 106]),        # computed at events 3 and 6, in force at 4 and 7
])
def test_republish_every_k_events_lands_one_event_late(every: int, seen: list[int]) -> None:
    driver, _, unit = lag_driver(every)
    got = []
    for _ in seen:
        driver.event()
        got.append(int(driver.order.place[unit]))
    assert got == seen  # 1: the fixed order (position 1) before any publication arrived


def test_free_attaches_nothing_and_first_fit_never_republishes() -> None:
    state = ClusterState([NodeSpec("n", 64000, 256000, "H100")],
                         [UnitSpec(0, g, KIND_MPS, 7, memory_mib=81920) for g in range(2)], slices_per_gpu=7)
    sched = Scheduler(PackedCluster(state), "bestfit")
    assert attach(sched, DeviceChoice()) is None and sched.devices is None
    driver = attach(sched, DeviceChoice("first-fit"))
    assert driver is not None and driver.steering is None and sched.devices is driver.order
    driver.observe(PackRequest(gpus=1, slices=2))
    state.take(0, [1], 2, 0, 0)
    driver.event()
    assert driver.order.version == 0 and driver.order.place[:2].tolist() == [0, 1]


# ----- the flags -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("flags", "message"), [
    (["--republish-every", "4"], "--republish-every applies only to --device-choice steered: free lets the "
                                 "extender pick the device"),
    (["--device-choice", "first-fit", "--republish-every", "4"], "first-fit publishes one fixed order"),
    (["--device-choice", "steered", "--republish-every", "0"], "--republish-every must be >= 1"),
    (["--device-choice", "steered", "--republish-every", "-3"], "--republish-every must be >= 1"),
])
def test_bad_device_flags_are_refused_by_name(tmp_path: Path, flags: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    nodes, pods = tiny_openb(tmp_path)
    assert run(parse(["--nodes", str(nodes), "--pods", str(pods), *flags])) == 2
    assert message in capsys.readouterr().err
    assert run(parse(flags)) == 2  # the built-in day refuses them the same way, before running
    assert message in capsys.readouterr().err


def test_an_unknown_device_choice_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--device-choice", "best"])
    assert exc.value.code == 2
    assert "invalid choice: 'best'" in capsys.readouterr().err
    with pytest.raises(DeviceChoiceError, match="must be one of free, steered, first-fit"):
        DeviceChoice("best")


def test_a_steered_trace_run_says_how_devices_were_chosen(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes, pods = tiny_openb(tmp_path)
    out = tmp_path / "r.json"
    assert run(parse(["--nodes", str(nodes), "--pods", str(pods), "--device-choice", "steered",
                      "--republish-every", "4", "--json", str(out), "--slices", "100"])) == 0
    text = capsys.readouterr().out
    assert "device choice: steered, republished every 4 events, seen one event late" in text
    meta = json.loads(out.read_text())["meta"]
    assert meta["device_choice"] == "steered, republished every 4 events, seen one event late"
    assert run(parse(["--nodes", str(nodes), "--pods", str(pods)])) == 0
    assert "device choice" not in capsys.readouterr().out  # free: today's output


def test_dynamic_mig_layouts_and_a_dra_device_choice_are_refused_together(capsys: pytest.CaptureFixture[str]) -> None:
    """Under DRA the devices are the instances a driver published; a re-cut is not modelled with it."""
    assert run(parse(["--mig-layouts", "dynamic", "--device-choice", "first-fit"])) == 2
    err = capsys.readouterr().err
    assert "--device-choice first-fit models DRA over static MIG layouts" in err
    assert "give --mig-layouts static" in err
