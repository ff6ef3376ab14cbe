"""Device plugin latency bench: Allocate / GetPreferredAllocation p50/p99, and re-registration time.

Runs the whole plugin (``DevicePluginApp``, simulated backend) against the kubelet stand-in and the
fake API server from ``tests/`` (everything on loopback and unix sockets in a temp dir), with a pod
cache of ``--pods`` pods carrying assignments and stamps. Allocate is called through a real gRPC
client on the plugin's unix socket, cycling over valid placements, so each figure includes gRPC and
protobuf costs. Re-registration is timed from the start of a kubelet restart (sockets deleted,
``kubelet.sock`` recreated) until kubelet holds a new registration with a device list.

    .venv/bin/python bench/bench_deviceplugin.py [--calls 2000] [--pods 300] [--restarts 5]

Bars (DESIGN 7): Allocate p99 under 10 ms; re-registered within 5 s of a kubelet restart.
The same figures under kubelet's own device manager: ``bench_deviceplugin_kubelet_dm.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2 as pb  # noqa: E402
from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc  # noqa: E402
from deviceplugin.app import DevicePluginApp  # noqa: E402
from deviceplugin.settings import Settings  # noqa: E402
from deviceplugin.simulated import SimulatedBackend, builtin_topology  # noqa: E402
from tests.fakeapi.server import FakeApiServer  # noqa: E402
from tests.kubelet.standin import KubeletStandin  # noqa: E402

RESOURCE = "example.com/gpu-slice"
NODE = "bench-node"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def fill_api(api: FakeApiServer, pods: int, id_sets: list[list[str]]) -> None:
    """``pods`` pods on the node with assignments; most stamped (running), the rest pending."""
    api.store.put_node({"metadata": {"name": NODE}})
    for n in range(pods):
        ids = id_sets[n % len(id_sets)]
        uid = f"uid-{n}"
        at = f"2025-01-01T{n // 3600 % 24:02d}:{n // 60 % 60:02d}:{n % 60:02d}Z"
        assignment: dict[str, object] = {"v": 1, "podUID": uid, "node": NODE, "gpus": ["GPU-x"], "instance": None,
                                         "sliceIds": ids, "policy": "fragmentation", "scores": {}, "time": at}
        # gpus/instance are not what the plugin reads; keep them consistent anyway
        owner = ids[0].rsplit("::", 1)[0]
        if owner.startswith("MIG-"):
            assignment["instance"] = owner
            assignment["gpus"] = [builtin_topology(NODE).gpus[0].uuid]
        else:
            assignment["gpus"] = [owner]
        annotations = {"example.com/gpu-slice.assignment": json.dumps(assignment)}
        phase = "Running" if n % 10 else "Pending"
        if phase == "Running":
            annotations["example.com/gpu-slice.allocated"] = json.dumps(
                {"v": 1, "sliceIds": ids, "time": "2025-01-01T01:00:00Z"})
        api.store.put_pod({"metadata": {"name": f"pod-{n}", "namespace": "default", "uid": uid,
                                        "annotations": annotations},
                           "spec": {"nodeName": NODE, "containers": [{"name": "main", "image": "x"}]},
                           "status": {"phase": phase}})


def placements() -> list[list[str]]:
    """Valid id sets on the built-in node: every MIG instance, MPS sets of 1..7 slices."""
    mig, mps = builtin_topology(NODE).gpus
    out = [list(i.slice_ids()) for i in mig.instances]
    ids = mps.slice_ids()
    out += [list(ids[k: k + size]) for size in range(1, 8) for k in range(0, 8 - size)]
    return out


async def bench(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="gsb-"))
    api = FakeApiServer().start()
    kubelet = KubeletStandin(tmp / "dp", tmp / "pr", seed=1)
    kubelet.start()
    id_sets = placements()
    fill_api(api, args.pods, id_sets)
    settings = Settings(node_name=NODE, backend="simulated", plugin_dir=kubelet.plugin_dir,
                        pod_resources_socket=kubelet.pod_resources_socket, metrics_port=0,
                        mps_root=tmp / "mps").validate()
    app = DevicePluginApp(settings, backend=SimulatedBackend(builtin_topology(NODE)), api_client=api.client())
    stop = asyncio.Event()
    task = asyncio.create_task(app.run(stop))
    try:
        await asyncio.wait_for(app.ready.wait(), 20)
        await kubelet.wait_for_registration_async(RESOURCE, timeout=20)
        assert app.book is not None
        print(f"pod cache: {len(app.book.pods)} pods, {len(app.book.pending())} pending assignments")

        def calls() -> tuple[list[float], list[float]]:
            allocate: list[float] = []
            preferred: list[float] = []
            avail = [d for s in id_sets for d in s]
            with grpc.insecure_channel(f"unix://{settings.socket_path}") as channel:
                stub = pb_grpc.DevicePluginStub(channel)
                for n in range(args.warmup + args.calls):
                    ids = id_sets[n % len(id_sets)]
                    req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
                    t0 = time.perf_counter()
                    stub.Allocate(req)
                    t1 = time.perf_counter()
                    preq = pb.PreferredAllocationRequest(container_requests=[pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=sorted(set(avail)), allocation_size=len(ids))])
                    stub.GetPreferredAllocation(preq)
                    t2 = time.perf_counter()
                    if n >= args.warmup:
                        allocate.append(t1 - t0)
                        preferred.append(t2 - t1)
            return allocate, preferred

        allocate, preferred = await asyncio.to_thread(calls)
        # GetPreferredAllocation waits (up to preferred_wait_s) for the pod cache when no pending
        # assignment of the asked size matches: by design, so those calls are counted apart.
        waited = [v for v in preferred if v >= settings.preferred_wait_s * 0.9]
        answered = [v for v in preferred if v < settings.preferred_wait_s * 0.9]
        for name, values, bar in (("Allocate", allocate, " (bar: p99 < 10 ms)"),
                                  ("GetPreferredAllocation", answered, " (calls answered from the cache)")):
            ms = [v * 1000 for v in values]
            print(f"{name:24s} n={len(ms)} p50={percentile(ms, 50):.3f} ms p90={percentile(ms, 90):.3f} ms "
                  f"p99={percentile(ms, 99):.3f} ms max={max(ms):.3f} ms{bar}")
        print(f"GetPreferredAllocation   n={len(waited)} calls matched no pending assignment and waited the bounded "
              f"{settings.preferred_wait_s} s for the pod cache before a best fit (issue 9 point 4)")

        times: list[float] = []
        for _ in range(args.restarts):
            gen = kubelet.generation
            t0 = time.perf_counter()
            await asyncio.to_thread(kubelet.restart)
            await kubelet.wait_for_registration_async(RESOURCE, after=gen, timeout=30)
            times.append(time.perf_counter() - t0)
            await asyncio.sleep(0.3)
        print(f"re-registration after kubelet restart: n={len(times)} mean={statistics.mean(times):.3f} s "
              f"max={max(times):.3f} s (bar: < 5 s; directory poll {settings.dir_poll_s} s)")
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        kubelet.stop()
        api.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--pods", type=int, default=300)
    parser.add_argument("--restarts", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
