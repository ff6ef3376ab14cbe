"""The simulated backend: topology validation, faults, layout changes, stand-in MPS daemons."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import yaml

from deviceplugin.backend import GpuTarget, HealthEvent
from deviceplugin.errors import TopologyError
from deviceplugin.mps import MpsOptions, pipe_dir, standin_command
from deviceplugin.mps_supervisor import MpsSupervisor
from deviceplugin.simulated import (
    SimulatedBackend,
    builtin_topology,
    load_topology,
    parse_topology,
    sim_gpu_uuid,
)


def test_builtin_node_is_two_h100_one_mixed_mig_one_mps_with_stable_uuids() -> None:
    topo = builtin_topology()
    mig, mps = topo.gpus
    assert (mig.product, mig.mode, mig.slices) == ("H100-80GB", "mig", 7)
    assert [(i.profile, i.start) for i in mig.instances] == [
        ("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4)]
    assert (mps.product, mps.mode, mps.slices, mps.index) == ("H100-80GB", "mps", 7, 1)
    assert builtin_topology() == topo
    assert mig.uuid == sim_gpu_uuid("sim-node", 0) and mig.uuid.startswith("GPU-")
    assert builtin_topology("other-node").gpus[0].uuid != mig.uuid
    assert load_topology(None) == topo


def write(tmp_path: Path, doc: object) -> Path:
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_topology_file_is_loaded(tmp_path: Path) -> None:
    path = write(tmp_path, {"version": 1, "node": "n1", "slices": 10, "gpus": [
        {"product": "A100-40GB", "mode": "mig", "instances": [{"profile": "7g.40gb", "start": 0, "uuid": "MIG-x"}]},
        {"product": "H200-141GB", "mode": "whole", "uuid": "GPU-fixed"},
        {"product": "L4", "mode": "mps", "slices": 1000},
    ]})
    topo = load_topology(path)
    assert topo.node == "n1"
    assert [(g.uuid, g.mode, g.slices) for g in topo.gpus] == [
        (sim_gpu_uuid("n1", 0), "mig", 7), ("GPU-fixed", "whole", 10), (sim_gpu_uuid("n1", 2), "mps", 1000)]
    assert topo.gpus[0].instances[0].uuid == "MIG-x"


@pytest.mark.parametrize(("doc", "message"), [
    ({"gpus": [{"product": "H100-80GB"}, {"product": "H999"}]},
     "gpus[1].product: unknown GPU product 'H999'; known: A100-40GB"),
    ({"gpus": [{"product": "H100-80GB", "mode": "mig", "instances": [{"profile": "3g.40gb", "start": 2}]}]},
     "gpus[0].instances: GPU GPU-"),
    ({"gpus": [{"product": "H100-80GB", "mode": "mig", "instances": [
        {"profile": "4g.40gb", "start": 0}, {"profile": "2g.20gb", "start": 2}]}]},
     "overlaps another instance's memory slices"),
    ({"gpus": [{"product": "H100-80GB", "mode": "mig", "instances": [{"profile": "9g.99gb", "start": 0}]}]},
     "gpus[0].instances[0].profile: H100-80GB has no MIG profile '9g.99gb'"),
    ({"gpus": [{"product": "L4", "mode": "mig", "instances": []}]},
     "gpus[0].instances: GPU GPU-"),
    ({"gpus": [{"product": "L4", "mode": "mig", "uuid": "GPU-l4", "instances": []}]},
     "gpus[0].instances: GPU GPU-l4: product L4 does not support MIG"),
    ({"gpus": [{"product": "H100-80GB", "uuid": "GPU-a"}, {"product": "H100-80GB", "uuid": "GPU-a"}]},
     "gpus[1].uuid: duplicate UUID GPU-a (also at "),
    ({"gpus": [{"product": "H100-80GB", "mode": "mig", "instances": [
        {"profile": "1g.10gb", "start": 0, "uuid": "MIG-a"}, {"profile": "1g.10gb", "start": 1, "uuid": "MIG-a"}]}]},
     "gpus[0].instances[1].uuid: duplicate UUID MIG-a"),
    ({"gpus": [{"product": "H100-80GB", "mode": "mps", "slices": 1001}]},
     "gpus[0].slices: must be an integer in 1..1000, got 1001"),
    ({"gpus": [{"product": "H100-80GB", "mode": "shared"}]},
     "gpus[0].mode: must be one of mig, mps, whole, got 'shared'"),
    ({"gpus": [{"product": "H100-80GB", "mode": "mps", "instances": []}]},
     "gpus[0].instances: only mig GPUs have instances (mode is mps)"),
    ({"gpus": [{"product": "H100-80GB", "colour": "green"}]},
     "gpus[0].colour: unknown field; known: instances, memory_mib, mode, product, slices, uuid"),
    ({"gpus": [{"product": "G1"}]}, "gpus[0].memory_mib: product G1 has no known memory size; give memory_mib"),
    ({"gpus": []}, "gpus: must be a non-empty list"),
    ({"version": 2, "gpus": [{"product": "L4"}]}, "version: only version 1 is supported, got 2"),
])
def test_bad_topologies_name_the_field(tmp_path: Path, doc: dict[str, object], message: str) -> None:
    path = write(tmp_path, doc)
    with pytest.raises(TopologyError) as exc:
        load_topology(path)
    assert str(exc.value).startswith(f"{path}: ") and message in str(exc.value)


def test_illegal_layout_message_comes_from_the_model_validator() -> None:
    with pytest.raises(TopologyError) as exc:
        parse_topology({"gpus": [{"product": "H100-80GB", "uuid": "GPU-z", "mode": "mig",
                                  "instances": [{"profile": "3g.40gb", "start": 2, "uuid": "MIG-z"}]}]})
    assert str(exc.value) == ("topology: gpus[0].instances: GPU GPU-z: instance MIG-z (3g.40gb) cannot start at "
                              "memory slice 2; legal starts [0, 4]")


def test_unreadable_and_invalid_yaml_files(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="cannot read topology"):
        load_topology(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus: [\n")
    with pytest.raises(TopologyError, match="not valid YAML"):
        load_topology(bad)


def test_fault_injection_emits_events_and_shows_in_discovery() -> None:
    backend = SimulatedBackend()
    mig, mps = backend.discover()
    events: list[HealthEvent] = []
    backend.watch_health(events.append)
    assert backend.inject_fault(mps.uuid, "XID 79: fell off the bus") == HealthEvent(
        mps.uuid, False, "XID 79: fell off the bus")
    assert backend.inject_fault(mps.uuid, "again") is None
    inst = mig.instances[3].uuid
    backend.inject_fault(mig.uuid, "XID 94 on instance", instance_uuid=inst)
    now_mig, now_mps = backend.discover()
    assert now_mig.healthy and not now_mps.healthy
    assert backend.unhealthy() == {mps.uuid: "XID 79: fell off the bus", inst: "XID 94 on instance"}
    assert backend.recover(mps.uuid) == HealthEvent(mps.uuid, True, "recovered (was: XID 79: fell off the bus)")
    assert backend.recover(mps.uuid) is None
    backend.recover(mig.uuid, instance_uuid=inst)
    assert [(e.gpu_uuid, e.healthy, e.instance_uuid) for e in events] == [
        (mps.uuid, False, None), (mig.uuid, False, inst), (mps.uuid, True, None), (mig.uuid, True, inst)]
    assert all(g.healthy for g in backend.discover()) and backend.unhealthy() == {}


def test_fault_refusals_name_the_unknown_device() -> None:
    backend = SimulatedBackend()
    mig, _ = backend.discover()
    with pytest.raises(TopologyError, match="no simulated GPU GPU-nope; known: GPU-"):
        backend.inject_fault("GPU-nope", "x")
    with pytest.raises(TopologyError) as exc:
        backend.inject_fault(mig.uuid, "x", instance_uuid="MIG-nope")
    assert str(exc.value) == f"GPU {mig.uuid} has no MIG instance MIG-nope"


def test_layout_change_waits_while_ids_are_allocated_then_applies() -> None:
    backend = SimulatedBackend()
    mig, _ = backend.discover()
    keep = mig.instances[3]  # 3g.40gb@4 stays and keeps its UUID
    allocated = frozenset({mig.instances[0].slice_ids()[0]})
    layout = (("4g.40gb", 0), ("3g.40gb", 4))
    assert backend.change_layout(mig.uuid, layout, allocated) == [
        f"GPU {mig.uuid}: change waits (mig[2g.20gb@0, 1g.10gb@2, 1g.10gb@3, 3g.40gb@4] -> "
        f"mig[4g.40gb@0, 3g.40gb@4]): 1 of its ids are allocated ({mig.instances[0].uuid}::0)"]
    assert backend.discover()[0] == mig
    assert backend.change_layout(mig.uuid, layout, frozenset()) == [
        f"GPU {mig.uuid}: changed: mig[2g.20gb@0, 1g.10gb@2, 1g.10gb@3, 3g.40gb@4] -> mig[4g.40gb@0, 3g.40gb@4]"]
    now = backend.discover()[0]
    assert [(i.profile, i.start) for i in now.instances] == [("4g.40gb", 0), ("3g.40gb", 4)]
    assert now.instances[1].uuid == keep.uuid and now.slices == 7
    assert backend.change_layout(mig.uuid, layout, frozenset()) == []


def test_layout_and_mode_refusals() -> None:
    backend = SimulatedBackend()
    mig, mps = backend.discover()
    [msg] = backend.change_layout(mig.uuid, (("3g.40gb", 2),), frozenset())
    assert msg.startswith(f"GPU {mig.uuid}: refused: mig_layout: GPU {mig.uuid}: instance MIG-")
    assert msg.endswith("(3g.40gb) cannot start at memory slice 2; legal starts [0, 4]")
    assert backend.apply_targets({mps.uuid: GpuTarget("mig", 0)}, frozenset()) == [
        f"GPU {mps.uuid}: refused: target mig needs a mig_layout for a GPU that is not in MIG mode"]
    assert backend.apply_targets({mps.uuid: GpuTarget("mps", 1001)}, frozenset()) == [
        f"GPU {mps.uuid}: refused: S must be in 1..1000, got 1001"]
    assert backend.apply_targets({"GPU-nope": GpuTarget("mps", 7)}, frozenset()) == [
        "GPU GPU-nope: no such simulated GPU; target ignored"]


def test_mode_and_s_changes_wait_on_allocation() -> None:
    backend = SimulatedBackend()
    mig, mps = backend.discover()
    assert backend.apply_targets({mps.uuid: GpuTarget("whole", 7)}, frozenset({f"{mps.uuid}::6"})) == [
        f"GPU {mps.uuid}: change waits (mps(S=7) -> whole(S=7)): 1 of its ids are allocated ({mps.uuid}::6)"]
    assert backend.apply_targets({mps.uuid: GpuTarget("mps", 14), mig.uuid: GpuTarget("whole", 7)},
                                 frozenset()) == [
        f"GPU {mps.uuid}: changed: mps(S=7) -> mps(S=14)",
        f"GPU {mig.uuid}: changed: mig[2g.20gb@0, 1g.10gb@2, 1g.10gb@3, 3g.40gb@4] -> whole(S=7)"]
    now_mig, now_mps = backend.discover()
    assert (now_mig.mode, now_mig.instances, now_mps.slices) == ("whole", (), 14)


def test_simulated_mps_slices_follow_the_stand_in_daemon(tmp_path: Path) -> None:
    root = tmp_path / "mps"
    sup = MpsSupervisor(MpsOptions(root=root, control_command=standin_command(), probe_interval_s=0.0,
                                   probe_timeout_s=3.0, extra_env={"GPU_SLICE_MPS_STANDIN_LIFETIME_S": "60"}))
    backend = SimulatedBackend(mps=sup)
    try:
        _, mps = backend.discover()
        assert not mps.healthy  # not answering yet: not started
        sup.check_once()
        assert backend.discover()[1].healthy and backend.unhealthy() == {}
        pid = int((pipe_dir(root, mps.uuid) / "standin.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        sup.check_once()
        assert not backend.discover()[1].healthy
        assert backend.unhealthy()[mps.uuid].startswith("MPS daemon stopped answering")
        sup.check_once()
        assert backend.discover()[1].healthy
        # leaving mps mode stops supervising (and quits) that GPU's daemon
        backend.apply_targets({mps.uuid: GpuTarget("whole", 7)}, frozenset())
        assert sup.status() == {} and backend.discover()[1].healthy
    finally:
        backend.close()
