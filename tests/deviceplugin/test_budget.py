"""The budget watch: NVML process lists (the simulated backend at the same seam) mapped to pods through
cgroup files laid out as on a node, judged against each pod's share, reported once, evicted on demand."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client import CollectorRegistry

from deviceplugin.assignments import AssignmentBook, PodView
from deviceplugin.backend import GpuProcess
from deviceplugin.budget import Holder, check_gpu, pod_uid_of
from deviceplugin.budget_watch import BudgetWatch
from deviceplugin.simulated import SimulatedBackend, builtin_topology
from gpuslice.model import NodeInventory
from gpuslice.rules import mps_share_mib

TOPO = builtin_topology("n1")
MIG, MPS = TOPO.gpus
UID_A = "4f1c1f0e-3b7a-4f4e-9a59-5a1c2d9e0b11"
UID_B = "5f1c1f0e-3b7a-4f4e-9a59-5a1c2d9e0b12"
UID_C = "6f1c1f0e-3b7a-4f4e-9a59-5a1c2d9e0b13"
MIB = 1


def proc_root(tmp_path: Path) -> Path:
    """/proc as a node shows it: cgroupfs (v1) and systemd (v2) layouts, the MPS server, a host process."""
    root = tmp_path / "proc"
    layout = {
        101: (f"12:memory:/kubepods/burstable/pod{UID_A}/0123abcd\n", "python3"),
        102: (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_A.replace('-', '_')}.slice/"
              "cri-containerd-4567.scope\n", "python3"),
        201: (f"0::/kubepods.slice/kubepods-pod{UID_B.replace('-', '_')}.slice/cri-containerd-89.scope\n", "vllm"),
        301: (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_C.replace('-', '_')}"
              ".slice/cri-containerd-aa.scope\n", "python3"),
        400: ("0::/system.slice/nvidia-mps.service\n", "nvidia-cuda-mps-server"),
        500: ("0::/user.slice/user-1000.slice/session-3.scope\n", "python3"),
    }
    for pid, (cgroup, comm) in layout.items():
        d = root / str(pid)
        d.mkdir(parents=True)
        (d / "cgroup").write_text(cgroup)
        (d / "comm").write_text(comm + "\n")
    return root


def test_pod_uids_are_read_from_both_cgroup_layouts(tmp_path: Path) -> None:
    root = proc_root(tmp_path)
    assert [pod_uid_of(p, root) for p in (101, 102, 201, 400, 500, 999)] == [UID_A, UID_A, UID_B, None, None, None]


def test_two_clients_over_their_share_a_process_outside_mps_and_a_stranger_are_found(tmp_path: Path) -> None:
    root = proc_root(tmp_path)
    share1 = mps_share_mib(MPS.memory_mib, 1, MPS.slices)
    holders = {UID_A: Holder(UID_A, "default", "llm-a", MPS.slice_ids()[:1]),
               UID_B: Holder(UID_B, "default", "llm-b", MPS.slice_ids()[1:3]),
               UID_C: Holder(UID_C, "default", "llm-c", MIG.instances[0].slice_ids())}
    procs = [GpuProcess(101, share1 - 1000, True), GpuProcess(102, 2000, True),  # pod A: two clients, one share
             GpuProcess(201, 9000, True),                                            # pod B: within its 2 slices
             GpuProcess(400, 300, False),                                            # the MPS server
             GpuProcess(500, 4000, False),                                           # a host process, no MPS
             GpuProcess(301, 100, True)]                                             # pod C holds no slice here
    found = check_gpu(MPS, procs, holders, root)
    assert [(f.kind, f.pod_uid, f.pids) for f in found] == [
        ("outside-mps", None, (500,)), ("over-share", UID_A, (101, 102)), ("no-slices", UID_C, (301,))]
    assert found[1].message == (
        f"pod default/llm-a uses {share1 + 1000} MiB on GPU {MPS.uuid} in 2 MPS client process(es) (101, 102); its "
        f"1-slice share is {share1} MiB (the MPS daemon caps each client process, not each pod)")
    assert found[0].message.startswith(f"process 500 of a host process uses MPS GPU {MPS.uuid} without MPS")


def test_the_watch_reports_once_evicts_the_offenders_and_clears_its_metric(tmp_path: Path) -> None:
    root = proc_root(tmp_path)
    backend = SimulatedBackend(TOPO)
    book = AssignmentBook("n1")
    for uid, name, ids in ((UID_A, "llm-a", MPS.slice_ids()[:1]), (UID_B, "llm-b", MPS.slice_ids()[1:3])):
        book.upsert(PodView("default", name, uid, "n1", "Running", created="2025-01-01T00:00:00Z",
                            allocated_ids=ids))
    book.set_admitted({("default", "llm-b"): MPS.slice_ids()[1:3]})
    events: list[tuple[str, ...]] = []
    evicted: list[tuple[str, str, str]] = []

    async def event(ns: str, name: str, uid: str, reason: str, message: str, type_: str) -> None:
        events.append((name, reason, type_))

    registry = CollectorRegistry()
    watch = BudgetWatch(backend, lambda: NodeInventory("n1", TOPO.gpus), lambda: book, interval_s=0.1,
                        proc_root=root, event=event, evict=lambda ns, name, uid: evicted.append((ns, name, uid)),
                        registry=registry)
    share1 = mps_share_mib(MPS.memory_mib, 1, MPS.slices)
    backend.set_processes(MPS.uuid, (GpuProcess(101, share1, True), GpuProcess(102, 10, True),
                                     GpuProcess(201, 100, False), GpuProcess(400, 300, False)))

    async def go() -> None:
        for _ in range(2):  # a finding that persists is reported once
            found = await watch.pass_once()
            assert [(f.kind, f.pod_uid) for f in found] == [("outside-mps", UID_B), ("over-share", UID_A)]
        assert sorted(events) == [("llm-a", "GpuShareExceeded", "Warning"), ("llm-b", "GpuOutsideMps", "Warning")]
        assert sorted(evicted) == [("default", "llm-a", UID_A), ("default", "llm-b", UID_B)]
        value = registry.get_sample_value("gpu_slice_budget_violations", {"gpu_uuid": MPS.uuid, "kind": "over-share"})
        assert value == 1.0 and registry.get_sample_value("gpu_slice_budget_evictions_total") == 2.0
        backend.set_processes(MPS.uuid, (GpuProcess(201, 100, True), GpuProcess(400, 300, False)))
        assert await watch.pass_once() == []
        assert registry.get_sample_value("gpu_slice_budget_violations",
                                         {"gpu_uuid": MPS.uuid, "kind": "over-share"}) == 0.0

    asyncio.run(go())
