"""Benchmark: the extender service against the DESIGN 7 bars of issue 8. Prints figures; asserts nothing.

Three parts (``--part latency,rss,e2e``, all by default):

a. **latency** -- ``POST /filter`` then ``POST /prioritize`` over loopback HTTP for one pending pod
   at a time, the node names of the whole cluster in both (``nodeCacheCapable``: kube-scheduler
   sends names; prioritize over every node is its worst case, with the narrowed filter
   kube-scheduler really skips it), on N nodes x 8 H100 (mps, 7 slices) with K running pods per
   node (``gpu-slice fake-cluster``'s generator, same seed, same objects). The extender runs in a
   child process of this script, fed as ``gpu-slice extender --kubeconfig`` feeds it: each listed
   object JSON-decoded on its own, passed through the informer's transform (``Extender.transform``:
   pods projected at once, nodes slimmed) and handed to ``Extender.on_relist`` per kind (which freezes the
   synced state out of the garbage collector), served by uvicorn on 127.0.0.1 with
   ``extender.app.build_app``; there is no API server behind it (a ``MemoryBinder`` holding no pods;
   nothing is bound). A thread in that process delivers watch events the way the informer does: at
   ``--event-rate`` per second, 80 % pod and 20 % node MODIFIED events (a pod's annotation and
   resourceVersion change; a node's heartbeat), each JSON-encoded as a watch line, decoded with
   ``json.loads``, passed through the same transform and passed to ``Extender.on_event``. Each pod is
   also sent to ``/prioritize`` with only the names its filter passed, which is kube-scheduler's real
   call (the narrowed filter passes one node, and kube-scheduler then skips scoring). Each size is
   measured quiet first, then with events. Bars: p99 < 25 ms at 1,000 nodes, < 100 ms at 5,000.
b. **rss** -- resident memory of the extender with 5,000 nodes and 50,000 pods (bar < 300 MB), two
   ways: ``gpu-slice extender --cluster FILE`` on ``gpu-slice fake-cluster --nodes 5000
   --pods-per-node 10`` output (the dry-run path, which parses YAML); and ``gpu-slice extender
   --kubeconfig`` (the production path: the informer lists in pages of 500 and watches) against the
   repository's fake API server (``tests/fakeapi``, in another process) holding the same objects.
   VmRSS once ``/readyz`` is green, after 5 s, and the peak VmHWM.
c. **e2e** -- through the real kube-apiserver and kube-scheduler 1.36 of ``../shared/k8s`` with
   ``--e2e-nodes`` (100) plain GPU Node objects: a batch of ``--e2e-pods`` (300) slice pods created
   by 8 threads, and the time until the last one is bound (a watch records when each gets
   ``spec.nodeName``). Once with the shipped ``manifests/scheduler/scheduler-config.yaml`` and
   ``gpu-slice extender`` (fenced on the scheduler's Lease when run as root, else ``--no-fencing``),
   once with the same scheduler config without the extender (the default binder), for reference.
   Bar: 40 pods/s.

The latency child also reports its garbage collections while serving (count, total and longest
pause per generation) and its VmRSS once loaded. ``--gc-freeze`` adds a second ``gc.freeze()`` after
the child's own setup (``Extender.on_relist`` already freezes the synced state).
``--profile`` writes a cProfile of the latency child's event loop thread (where the verbs run) and
prints the top functions; ``--py-spy EXE`` samples the extender during the e2e batch and prints
where its time goes. Run from the repository: ``.venv/bin/python bench/bench_extender.py`` (about
20 minutes on 2 cores, most of it in the memory part: a 90 MiB YAML file, and the fake API
server's paging); ``--quick`` runs small sizes (about two minutes); ``--workdir DIR`` keeps the
generated files for the next run.
"""

from __future__ import annotations

import argparse
import copy
import gc
import http.client
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.k8s_launcher import CLUSTER, run_cluster  # noqa: E402

SHIPPED_CONFIG = REPO / "manifests" / "scheduler" / "scheduler-config.yaml"
RESOURCE = "example.com/gpu-slice"
SCHEDULER_NAME = "gpu-slice-scheduler"
LEASE = "kube-system/gpu-slice-scheduler"
HOSTNAME = "gpu-slice-bench-0"
BARS_MS = {1000: 25.0, 5000: 100.0}
RSS_BAR_MB = 300.0
E2E_BAR = 40.0
SIZES = (1, 2, 1, 3, 1, 2, 7, 1)  # LLM serving: mostly a slice or two


def say(text: str = "") -> None:
    print(text, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_status(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as err:
        return int(err.code)
    except OSError:
        return 0


def wait_for(what: str, check: Callable[[], Any], timeout: float, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MB."""
    got = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                got[key] = int(rest.split()[0]) / 1024
    return got["VmRSS"], got["VmHWM"]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def figures(ms: list[float]) -> str:
    return f"p50 {statistics.median(ms):7.2f}  p99 {pct(ms, 99):7.2f}  max {max(ms):7.2f} ms  (n={len(ms)})"


def stop_process(proc: subprocess.Popen[Any] | None, timeout: float = 15) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def pending_pod(i: int, size: int, memory: str | None = None) -> dict[str, Any]:
    """A pending slice pod as kube-scheduler sends it (a typed informer object, admission defaults set)."""
    rs = f"llm-{size}s-bench"
    ann = {"example.com/gpu-memory": memory} if memory else {}
    return {
        "metadata": {
            "name": f"{rs}-{i:05d}", "namespace": "serving", "uid": f"00000000-0000-4000-8000-{i:012d}",
            "resourceVersion": str(100000 + i), "creationTimestamp": "2025-01-01T00:00:00Z",
            "labels": {"app": f"llm-{size}s", "pod-template-hash": "bench"}, "annotations": ann,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs,
                                 "uid": f"00000000-0000-4000-9000-{size:012d}", "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "spec": {
            "containers": [{"name": "server", "image": "vllm/vllm-openai:v0.6.4",
                            "args": ["--model", "meta-llama/Llama-3.1-8B-Instruct"],
                            "ports": [{"containerPort": 8000, "protocol": "TCP"}],
                            "resources": {"limits": {RESOURCE: str(size), "memory": "32Gi"},
                                          "requests": {RESOURCE: str(size), "cpu": "4", "memory": "32Gi"}},
                            "terminationMessagePath": "/dev/termination-log",
                            "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent"}],
            "restartPolicy": "Always", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default", "securityContext": {}, "schedulerName": SCHEDULER_NAME,
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
                             "tolerationSeconds": 300},
                            {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
                             "effect": "NoExecute", "tolerationSeconds": 300}],
            "priority": 0, "enableServiceLinks": True, "preemptionPolicy": "PreemptLowerPriority",
        },
        "status": {"phase": "Pending", "qosClass": "Burstable"},
    }


# ---- (a) latency: the child process that serves ---------------------------------------------------------

def serve(args: argparse.Namespace) -> int:
    """The extender, built as ``--cluster`` builds it, with a thread delivering watch events."""
    import uvicorn

    from extender.app import build_app
    from extender.binder import MemoryBinder
    from extender.lease import Fence
    from extender.metrics import ExtenderMetrics
    from extender.service import Extender
    from gpuslice.config import default_config
    from gpuslice.fakecluster import FakeClusterSpec, generate

    t0 = time.perf_counter()
    items = generate(FakeClusterSpec(nodes=args.nodes, gpus_per_node=8, pods_per_node=args.pods_per_node,
                                     seed=args.seed)).document["items"]
    # As the API server sends them: every object its own JSON-decoded dict (the generator shares parts).
    items = [json.loads(b) for b in (json.dumps(i).encode() for i in items)]
    gen_s = time.perf_counter() - t0
    # Event sources kept as JSON bytes (not tracked by the garbage collector), so this process's heap
    # is the extender's own, as with the informer.
    rng0 = random.Random(2)
    node_src = [json.dumps(i).encode() for i in items if i["kind"] == "Node"]
    pod_src = [json.dumps(i).encode() for i in items if i["kind"] == "Pod"]
    node_src = rng0.sample(node_src, min(1000, len(node_src)))
    pod_src = rng0.sample(pod_src, min(4000, len(pod_src)))
    t0 = time.perf_counter()
    # As the informer feeds it (``gpu-slice extender --kubeconfig``): each listed object through the
    # informer's transform (``Extender.transform``), then ``on_relist`` per kind, which freezes the
    # synced state out of the garbage collector once both kinds are in. The MemoryBinder holds no pods:
    # nothing is bound here, and the production binder (ApiBinder) holds no objects either.
    ext = Extender(default_config(), MemoryBinder([]), fence=Fence.disabled(), metrics=ExtenderMetrics(),
                   lease_name=LEASE)
    listed = {kind: [ext.transform(kind, i) for i in items if i["kind"] == kind] for kind in ("Node", "Pod")}
    del items
    gc.collect()
    for kind in ("Node", "Pod"):
        ext.on_relist(kind, listed.pop(kind))
    load_s = time.perf_counter() - t0
    if args.gc_freeze:  # a second freeze, after the bench's own setup (on_relist has frozen the state already)
        gc.collect()
        gc.freeze()
    stats: dict[str, Any] = {"generate_s": gen_s, "load_s": load_s, "rss_loaded_mb": rss_mb(os.getpid())[0],
                             "events": 0, "event_s": [],
                             "late_ticks": 0, "gc": {0: [], 1: [], 2: []}}
    gc_started: list[float] = [0.0]

    def gc_timer(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            stats["gc"][info["generation"]].append(time.perf_counter() - gc_started[0])
    gc.callbacks.append(gc_timer)
    flag = Path(args.events_flag)
    stop = threading.Event()

    def events() -> None:
        rng = random.Random(1)
        rv = 10_000_000
        interval = 1.0 / args.event_rate
        due = None
        while not stop.is_set():
            if not flag.exists():
                due = None
                stop.wait(0.05)
                continue
            now = time.perf_counter()
            due = now if due is None else due
            if now < due:
                stop.wait(due - now)
                continue
            if now - due > interval:  # behind schedule: count it, do not burst to catch up
                stats["late_ticks"] += 1
                due = now
            due += interval
            rv += 1
            if rng.random() < 0.8:
                obj = json.loads(pod_src[rng.randrange(len(pod_src))])
                obj["metadata"]["resourceVersion"] = str(rv)
                obj["metadata"].setdefault("annotations", {})["bench.example.com/tick"] = str(rv)
                obj["metadata"]["managedFields"] = [{"manager": "kubelet", "operation": "Update"}]
                kind = "Pod"
            else:
                obj = json.loads(node_src[rng.randrange(len(node_src))])
                obj["metadata"]["resourceVersion"] = str(rv)
                obj["status"]["conditions"][0]["lastHeartbeatTime"] = time.strftime("%Y-%m-%dT%H:%M:%SZ")
                obj["metadata"]["managedFields"] = [{"manager": "kubelet", "operation": "Update"}]
                kind = "Node"
            line = json.dumps({"type": "MODIFIED", "object": obj}).encode()
            started = time.perf_counter()
            event = json.loads(line)
            ext.on_event(kind, event["type"], ext.transform(kind, event["object"]))
            stats["event_s"].append(time.perf_counter() - started)
            stats["events"] += 1

    thread = threading.Thread(target=events, name="watch-events", daemon=True)
    thread.start()
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()  # the main thread: uvicorn's event loop, where /filter and /prioritize run
    app = build_app(ext)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning",
                                           access_log=False))
    # uvicorn drains on SIGTERM and then raises it again for the handler found at start: leave through
    # the finally below so the summary is written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.run()
    finally:
        stop.set()
        thread.join(5)
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        ev = stats.pop("event_s")
        stats["event_ms_p50"] = statistics.median(ev) * 1000 if ev else None
        stats["event_ms_p99"] = pct(ev, 99) * 1000 if ev else None
        stats["gc"] = {g: [len(v), sum(v) * 1000, max(v, default=0.0) * 1000] for g, v in stats["gc"].items()}
        Path(args.summary).write_text(json.dumps(stats))
    return 0


class Client:
    """kube-scheduler's side: one keep-alive connection, JSON bodies, 200 expected."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, verb: str, body: Any) -> Any:
        data = json.dumps(body).encode()
        self.conn.request("POST", f"/{verb}", body=data, headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        out = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"/{verb}: HTTP {resp.status}: {out[:300]!r}")
        return json.loads(out)

    def close(self) -> None:
        self.conn.close()


def measure(port: int, names: list[str], iterations: int, warmup: int = 20) -> dict[str, list[float]]:
    """Per pod: /filter over all names, /prioritize over all names (the worst case), then /prioritize
    over only the names filter passed (what kube-scheduler sends; it sends none when filter passed no
    node, and skips scoring when one node passed, which the narrowed filter always leaves)."""
    client = Client(port)
    out: dict[str, list[float]] = {"filter": [], "prioritize": [], "both": [], "prioritize_passed": [],
                                   "protocol": []}
    passed = 0
    try:
        for i in range(warmup + iterations):
            slot = i % 16  # 16 pending pods in turn: each re-filter moves its own reservation
            pod = pending_pod(slot, SIZES[slot % len(SIZES)])
            args = {"Pod": pod, "Nodes": None, "NodeNames": names}
            t0 = time.perf_counter()
            res = client.post("filter", args)
            t1 = time.perf_counter()
            client.post("prioritize", args)
            t2 = time.perf_counter()
            ok = list(res.get("NodeNames") or [])
            t3 = t4 = time.perf_counter()
            if ok:
                client.post("prioritize", {"Pod": pod, "Nodes": None, "NodeNames": ok})
                t4 = time.perf_counter()
            if i >= warmup:
                out["filter"].append((t1 - t0) * 1000)
                out["prioritize"].append((t2 - t1) * 1000)
                out["both"].append((t2 - t0) * 1000)
                if ok:
                    out["prioritize_passed"].append((t4 - t3) * 1000)
                out["protocol"].append((t1 - t0 + t4 - t3) * 1000)
                passed += len(ok)
    finally:
        client.close()
    if passed == 0:
        say("  WARNING: no filter call passed a node")
    return out


def part_latency(args: argparse.Namespace, work: Path) -> dict[int, dict[str, Any]]:
    say("== (a) filter + prioritize over loopback HTTP, one pod, while watch events arrive")
    results: dict[int, dict[str, Any]] = {}
    for n in args.nodes:
        port = free_port()
        flag = work / f"events-{n}.flag"
        summary = work / f"serve-{n}.json"
        profile = work / f"serve-{n}.prof" if args.profile else None
        cmd = [sys.executable, __file__, "_serve", "--nodes", str(n), "--pods-per-node", str(args.pods_per_node),
               "--port", str(port), "--event-rate", str(args.event_rate), "--events-flag", str(flag),
               "--summary", str(summary)] + (["--profile", str(profile)] if profile else []) + (
                   ["--gc-freeze"] if args.gc_freeze else [])
        say(f"-- {n} nodes x 8 H100 (mps), {args.pods_per_node} pods per node"
            f"{' [a second gc.freeze() after setup]' if args.gc_freeze else ''}; extender child: "
            f"{' '.join(Path(c).name if c == __file__ else c for c in cmd[1:4])} ...")
        log = open(work / f"serve-{n}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            def ready(proc: subprocess.Popen[bytes] = proc, port: int = port, n: int = n) -> bool:
                if proc.poll() is not None:
                    raise RuntimeError(f"serve child exited: {(work / f'serve-{n}.log').read_text()[-2000:]}")
                return http_status(f"http://127.0.0.1:{port}/readyz") == 200
            t0 = time.monotonic()
            wait_for("the extender child", ready, 900, 0.5)
            say(f"   ready after {time.monotonic() - t0:.1f} s (generate + load)")
            names = [f"gpu-node-{i:0{max(3, len(str(n - 1)))}d}" for i in range(n)]
            quiet = measure(port, names, args.iterations)
            load_quiet = os.getloadavg()[0]
            flag.touch()
            time.sleep(1.0)
            busy = measure(port, names, args.iterations)
            flag.unlink()
            stop_process(proc, 60)
            child = json.loads(summary.read_text()) if summary.is_file() else {}
        finally:
            stop_process(proc, 60)
            log.close()
        bar = BARS_MS.get(n)
        say(f"   child: generated in {child.get('generate_s', 0):.1f} s, Extender.load {child.get('load_s', 0):.1f} s; "
            f"events delivered {child.get('events')} (late ticks {child.get('late_ticks')}), on_event "
            f"p50 {child.get('event_ms_p50') or 0:.2f} ms p99 {child.get('event_ms_p99') or 0:.2f} ms")
        for gen, (count, total, longest) in sorted((child.get("gc") or {}).items()):
            say(f"   garbage collections of generation {gen} while serving: {count}, {total:.0f} ms in all, "
                f"longest {longest:.0f} ms")
        say(f"   child VmRSS once loaded: {child.get('rss_loaded_mb', 0):.0f} MB (includes the generator's freed heap; "
            "part rss measures the extender alone)")
        for label, data in (("quiet", quiet), (f"events {args.event_rate}/s", busy)):
            say(f"   [{label}] (1-min load average {os.getloadavg()[0]:.1f} after it)"
                if label != "quiet" else f"   [{label}] (1-min load average {load_quiet:.1f} after it)")
            say(f"     filter                        {figures(data['filter'])}")
            say(f"     prioritize (all N)            {figures(data['prioritize'])}")
            say(f"     filter+prioritize (all N)     {figures(data['both'])}"
                + (f"   bar p99 < {bar:.0f} ms: {'met' if pct(data['both'], 99) < bar else 'MISSED'}" if bar else ""))
            if data["prioritize_passed"]:
                say(f"     prioritize (filter's nodes)   {figures(data['prioritize_passed'])}")
            say(f"     filter+prioritize (filter's)  {figures(data['protocol'])}"
                + (f"   bar p99 < {bar:.0f} ms: {'met' if pct(data['protocol'], 99) < bar else 'MISSED'}"
                   if bar else "") + "  <- what kube-scheduler sends")
        results[n] = {"quiet": quiet, "busy": busy, "child": child}
        if profile and profile.is_file():
            import pstats

            say(f"   cProfile of the serving thread ({profile.name}), top 25 by cumulative time:")
            pstats.Stats(str(profile)).sort_stats("cumulative").print_stats(25)
    return results


# ---- (b) memory ---------------------------------------------------------------------------------------

def fake_api_child(args: argparse.Namespace) -> int:
    """A fake API server process holding ``--nodes`` x ``--pods-per-node`` objects; writes a kubeconfig."""
    from gpuslice.fakecluster import FakeClusterSpec, generate
    from tests.fakeapi import FakeApiServer

    items = generate(FakeClusterSpec(nodes=args.nodes, gpus_per_node=8, pods_per_node=args.pods_per_node,
                                     seed=args.seed)).document["items"]
    api = FakeApiServer(max_watch_seconds=600)
    for obj in items:
        obj["metadata"].pop("resourceVersion", None)
        (api.store.put_node if obj["kind"] == "Node" else api.store.put_pod)(obj)
    del items
    api.start()
    kubeconfig = {"apiVersion": "v1", "kind": "Config",
                  "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
                  "users": [{"name": "u", "user": {"token": "bench"}}],
                  "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}],
                  "current-context": "fake"}
    Path(args.kubeconfig + ".tmp").write_text(json.dumps(kubeconfig))
    os.replace(args.kubeconfig + ".tmp", args.kubeconfig)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    stop.wait(1800)
    api.stop()
    return 0


def watch_rss(proc: subprocess.Popen[bytes], port: int, timeout: float) -> tuple[float, float, float, float]:
    """Seconds to ready (``/readyz`` on the ops ``port``), VmRSS at ready, VmRSS 5 s later, peak VmHWM."""
    t0 = time.monotonic()

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"extender exited with {proc.returncode}")
        return http_status(f"http://127.0.0.1:{port}/readyz") == 200
    wait_for("extender /readyz", ready, timeout, 0.5)
    took = time.monotonic() - t0
    at_ready, _ = rss_mb(proc.pid)
    time.sleep(5)
    later, peak = rss_mb(proc.pid)
    return took, at_ready, later, peak


def part_rss(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    n, k = args.rss_nodes, 10
    say(f"== (b) extender memory with {n} nodes and {n * k} pods (bar < {RSS_BAR_MB:.0f} MB RSS)")
    out: dict[str, Any] = {}
    gs = [sys.executable, "-m", "gpuslice_cli"]
    # b1: gpu-slice extender --cluster FILE (the dry-run path)
    path = work / f"cluster-{n}-p{k}.yaml"
    if not path.is_file():
        cmd = [*gs, "fake-cluster", "--nodes", str(n), "--pods-per-node", str(k), "-o", str(path)]
        say(f"   $ gpu-slice fake-cluster --nodes {n} --pods-per-node {k} -o {path.name}")
        t0 = time.monotonic()
        subprocess.run(cmd, check=True)
        say(f"     {time.monotonic() - t0:.0f} s, {path.stat().st_size / 2**20:.0f} MiB")
    port, ops = free_port(), free_port()
    say(f"   $ gpu-slice extender --cluster {path.name} --port {port} --ops-address 127.0.0.1 --ops-port {ops}")
    log = open(work / "rss-cluster.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([*gs, "extender", "--cluster", str(path), "--port", str(port), "--ops-address",
                             "127.0.0.1", "--ops-port", str(ops)], stdout=log, stderr=subprocess.STDOUT)
    try:
        took, at_ready, later, peak = watch_rss(proc, ops, 1200)
        names = [f"gpu-node-{i:0{max(3, len(str(n - 1)))}d}" for i in range(n)]
        lat = measure(port, names, 100)
    finally:
        stop_process(proc)
        log.close()
    say(f"     ready after {took:.0f} s; VmRSS {at_ready:.0f} MB at ready, {later:.0f} MB 5 s later; "
        f"peak VmHWM {peak:.0f} MB: bar {'met' if later < RSS_BAR_MB else 'MISSED'}")
    say(f"     (quiet, same process) filter+prioritize {figures(lat['both'])}")
    out["cluster"] = {"ready_s": took, "rss": later, "hwm": peak, "latency": lat}
    # b2: gpu-slice extender --kubeconfig (the informer) against the fake API server in another process
    kubeconfig = work / "fakeapi.kubeconfig"
    kubeconfig.unlink(missing_ok=True)
    say("   fake API server child (tests/fakeapi) with the same objects; then")
    api_log = open(work / "fakeapi.log", "wb")  # noqa: SIM115
    api = subprocess.Popen([sys.executable, __file__, "_fakeapi", "--nodes", str(n), "--pods-per-node", str(k),
                            "--kubeconfig", str(kubeconfig)], stdout=api_log, stderr=subprocess.STDOUT, cwd=REPO)
    proc = None
    log = open(work / "rss-informer.log", "wb")  # noqa: SIM115
    try:
        def api_up() -> bool:
            if api.poll() is not None:
                raise RuntimeError(f"fake API server exited: {(work / 'fakeapi.log').read_text()[-2000:]}")
            return kubeconfig.is_file()
        wait_for("the fake API server", api_up, 900, 0.5)
        port, ops = free_port(), free_port()
        say(f"   $ gpu-slice extender --kubeconfig fakeapi.kubeconfig --no-fencing --port {port} "
            f"--ops-address 127.0.0.1 --ops-port {ops}")
        proc = subprocess.Popen([*gs, "extender", "--kubeconfig", str(kubeconfig), "--no-fencing", "--port",
                                 str(port), "--ops-address", "127.0.0.1", "--ops-port", str(ops)], stdout=log,
                                stderr=subprocess.STDOUT)
        took, at_ready, later, peak = watch_rss(proc, ops, 1200)
    finally:
        stop_process(proc)
        stop_process(api)
        log.close()
        api_log.close()
    say(f"     ready after {took:.0f} s; VmRSS {at_ready:.0f} MB at ready, {later:.0f} MB 5 s later; "
        f"peak VmHWM {peak:.0f} MB: bar {'met' if later < RSS_BAR_MB else 'MISSED'}")
    out["informer"] = {"ready_s": took, "rss": later, "hwm": peak}
    return out


# ---- (c) end to end through the real kube-scheduler ----------------------------------------------------

def cluster(*args: str, timeout: float = 300) -> str:
    return run_cluster(*args, timeout=timeout)


def drain(resp: Any) -> Any:
    try:
        return json.loads(resp.data)
    finally:
        resp.release_conn()


class BoundWatch:
    """Records when each pod of a namespace is first seen with ``spec.nodeName``: a raw watch from the
    namespace's list version, so no bind between the list and the watch is missed."""

    def __init__(self, core: Any, namespace: str) -> None:
        self.core, self.namespace = core, namespace
        self.bound: dict[str, float] = {}
        self.stop = threading.Event()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.started.wait(10)

    def _run(self) -> None:
        from e2e.harness import follow_pods

        def seen(_kind: str, obj: dict[str, Any], now: float) -> None:
            name = (obj.get("metadata") or {}).get("name")
            if name and (obj.get("spec") or {}).get("nodeName") and name not in self.bound:
                self.bound[name] = now
        follow_pods(self.core, self.namespace, seen, self.stop, clock=time.perf_counter, started=self.started)


def slice_pod(name: str, size: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": f"llm-{size}s"}},
            "spec": {"schedulerName": SCHEDULER_NAME, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "server", "image": "registry.invalid/llm-server:1",
                                     "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                                                   "limits": {RESOURCE: str(size)}}}]}}


def batch(core: Any, namespace: str, count: int, threads: int = 8, timeout: float = 300,
          cpu: dict[str, int] | None = None) -> dict[str, Any]:
    """``count`` slice pods created by ``threads`` threads in a new namespace, until a watch saw all bound:
    pods/s from the first create to the last bind, each pod's create->bind time, the CPU of ``cpu``'s pids."""
    drain(core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
                                _preload_content=False))
    watch = BoundWatch(core, namespace)
    names = [f"p-{i:04d}" for i in range(count)]
    created: dict[str, float] = {}
    lock = threading.Lock()

    def create(part: list[str]) -> None:
        for name in part:
            drain(core.create_namespaced_pod(namespace, slice_pod(name, SIZES[int(name[2:]) % len(SIZES)]),
                                             _preload_content=False))
            with lock:
                created[name] = time.perf_counter()

    cpu = dict(cpu or {})
    cpu["this benchmark"] = os.getpid()
    cpu0 = {k: cpu_seconds(p) for k, p in cpu.items()}
    load0 = os.getloadavg()[0]
    start = time.perf_counter()
    workers = [threading.Thread(target=create, args=(names[i::threads],)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    created_all = time.perf_counter()
    try:
        wait_for(f"{count} pods bound in {namespace}", lambda: len(watch.bound) >= count, timeout, 0.05)
    finally:
        watch.stop.set()
    used = {k: cpu_seconds(p) - cpu0[k] for k, p in cpu.items()}
    times = sorted(watch.bound.values())
    last = times[-1]
    lat = [1000 * max(0.0, watch.bound[n] - created[n]) for n in names]
    return {"pods": count, "create_s": created_all - start, "total_s": last - start,
            "rate": count / (last - start), "bind_span_rate": (count - 1) / max(1e-9, last - times[0]),
            "first_bind_s": times[0] - start, "cpu_s": used, "bind_ms_p50": statistics.median(lat),
            "bind_ms_p99": pct(lat, 99), "load": (load0, os.getloadavg()[0])}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_users(d: Path, extra: dict[str, int]) -> dict[str, int]:
    """The control plane's processes (the launcher's pid files) plus ``extra``."""
    pids = dict(extra)
    for f in sorted((d / "run").glob("*.pid")):
        try:
            pids[f.stem] = int(f.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return pids


def print_spy(path: Path, top: int = 25) -> None:
    """Self and inclusive sample shares per function from py-spy's collapsed stacks (all threads)."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [f for f in stack.split(";") if not f.startswith(("thread ", "process "))]
        if not frames:
            continue
        total += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
    if not total:
        return
    say(f"   py-spy of the extender during the batch ({path.name}, {total} samples, all threads):")
    say("     self %  function (file:line)")
    for f, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        say(f"     {100 * n / total:5.1f}  {f}")
    say("     inclusive %, the project's own functions:")
    ours = [(f, n) for f, n in incl.items() if "(extender/" in f or "(gpuslice/" in f or "/extender/" in f
            or "/gpuslice/" in f]
    for f, n in sorted(ours, key=lambda kv: -kv[1])[:top]:
        say(f"     {100 * n / total:5.1f}  {f}")


def say_cpu(res: dict[str, Any]) -> None:
    cpu = res["cpu_s"]
    wall = res["total_s"]
    parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v >= 0.05)
    say(f"     CPU seconds during the batch ({wall:.1f} s wall, {os.cpu_count()} CPUs): {parts}; extender "
        f"{1000 * cpu.get('extender', 0) / res['pods']:.0f} ms per pod" if "extender" in cpu else
        f"     CPU seconds during the batch ({wall:.1f} s wall, {os.cpu_count()} CPUs): {parts}")


def make_nodes(core: Any, count: int) -> None:
    """``count`` plain GPU Node objects (``gpu-slice fake-cluster``'s, 8 H100 mps each, seed 3), their
    allocatable and Ready condition posted through the status subresource as kubelet would, 8 at a time."""
    from gpuslice.fakecluster import FakeClusterSpec, generate

    nodes = [i for i in generate(FakeClusterSpec(nodes=count, gpus_per_node=8, seed=3)).document["items"]
             if i["kind"] == "Node"]
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def make(part: list[dict[str, Any]]) -> None:
        for node in part:
            meta = node["metadata"]
            drain(core.create_node({"apiVersion": "v1", "kind": "Node", "spec": node["spec"],
                                    "metadata": {k: meta[k] for k in ("name", "labels", "annotations")}},
                                   _preload_content=False))
            status = {k: node["status"][k] for k in ("capacity", "allocatable")}
            status["conditions"] = [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                     "lastHeartbeatTime": now, "lastTransitionTime": now}]
            drain(core.patch_node_status(meta["name"], {"status": status}, _preload_content=False))
    workers = [threading.Thread(target=make, args=(nodes[i::8],)) for i in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def part_e2e(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import yaml
    from kubernetes import client, config

    say(f"== (c) end to end: real kube-apiserver + kube-scheduler 1.36, {args.e2e_nodes} nodes x 8 H100 (mps), "
        f"a batch of {args.e2e_pods} slice pods (bar {E2E_BAR:.0f} pods/s)")
    if not CLUSTER.is_file():
        say(f"   skipped: {CLUSTER} is absent")
        return {}
    d = Path(tempfile.mkdtemp(prefix="gsb-"))
    ext_proc = None
    ext_log = None
    out: dict[str, Any] = {}
    try:
        say("   $ cluster up DIR")
        cluster("up", str(d))
        api_client = config.new_client_from_config(config_file=str(d / "kubeconfig"))
        core = client.CoreV1Api(api_client)
        make_nodes(core, args.e2e_nodes)
        say(f"   {args.e2e_nodes} Node objects created (allocatable through the status subresource)")

        fencing = os.geteuid() == 0 and shutil.which("unshare") is not None
        port, ops = free_port(), free_port()
        ext_cmd = [sys.executable, "-m", "gpuslice_cli", "extender", "--kubeconfig", str(d / "kubeconfig"),
                   "--port", str(port), "--ops-address", "127.0.0.1", "--ops-port", str(ops), "--lease", LEASE,
                   "--identity", HOSTNAME, "--log-level", "WARNING"]
        if not fencing:
            ext_cmd.append("--no-fencing")
        say(f"   $ gpu-slice extender --kubeconfig DIR/kubeconfig --port {port} --lease {LEASE} --identity "
            f"{HOSTNAME}{'' if fencing else ' --no-fencing'}")
        ext_log = open(d / "extender.log", "wb")  # noqa: SIM115
        ext_proc = subprocess.Popen(ext_cmd, stdout=ext_log, stderr=subprocess.STDOUT, cwd=REPO)
        wait_for("extender /readyz", lambda: http_status(f"http://127.0.0.1:{ops}/readyz") == 200, 60)

        shipped = yaml.safe_load(SHIPPED_CONFIG.read_text())
        with_ext = copy.deepcopy(shipped)
        with_ext["extenders"][0]["urlPrefix"] = f"http://127.0.0.1:{port}"
        (d / "with-extender.yaml").write_text(yaml.safe_dump(with_ext, sort_keys=False))
        host = ["--hostname", HOSTNAME] if fencing else []
        say(f"   $ cluster scheduler DIR with-extender.yaml {' '.join(host)}  (the shipped config, urlPrefix port "
            "changed)")
        cluster("scheduler", str(d), str(d / "with-extender.yaml"), *host)
        from kubernetes.client import CoordinationV1Api

        coord = CoordinationV1Api(api_client)

        def holder() -> bool:
            try:
                lease = drain(coord.read_namespaced_lease("gpu-slice-scheduler", "kube-system",
                                                          _preload_content=False))
            except Exception:
                return False
            return bool((lease.get("spec") or {}).get("holderIdentity"))
        wait_for("the scheduler's Lease", holder, 60)
        spy = None
        if args.py_spy:
            spy_out = work / "extender-e2e.collapsed"
            spy = subprocess.Popen([args.py_spy, "record", "--pid", str(ext_proc.pid), "--rate", "100", "--nonblocking",
                                    "--format", "raw", "--output", str(spy_out)], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        try:
            res = batch(core, "bench-ext", args.e2e_pods, cpu=cpu_users(d, {"extender": ext_proc.pid}))
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
        if spy is not None and spy_out.is_file():
            print_spy(spy_out)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{ops}/metrics", timeout=5).read().decode()
        counts = {}
        for line in metrics.splitlines():
            if line.startswith("gpu_slice_extender_requests_total{"):
                labels, value = line.rsplit(" ", 1)
                counts[labels[len("gpu_slice_extender_requests_total"):]] = float(value)
        res["calls"] = counts
        out["extender"] = res
        say(f"   with extender: {res['pods']} pods bound {res['total_s']:.2f} s after the first create "
            f"({res['rate']:.1f} pods/s; creates took {res['create_s']:.2f} s; first bind at "
            f"{res['first_bind_s']:.2f} s; first-to-last bind {res['bind_span_rate']:.1f} pods/s): "
            f"bar {'met' if res['rate'] >= E2E_BAR else 'MISSED'}")
        say(f"   extender calls: {counts}")
        say_cpu(res)

        cluster("stop", str(d), "scheduler")
        ref = copy.deepcopy(shipped)
        ref.pop("extenders")
        ref["leaderElection"]["resourceName"] = "gpu-slice-scheduler-ref"
        (d / "no-extender.yaml").write_text(yaml.safe_dump(ref, sort_keys=False))
        say("   $ cluster stop DIR scheduler; cluster scheduler DIR no-extender.yaml --name ref  (same config, no "
            "extenders, Lease gpu-slice-scheduler-ref)")
        cluster("scheduler", str(d), str(d / "no-extender.yaml"), "--name", "ref")
        time.sleep(2)
        res = batch(core, "bench-ref", args.e2e_pods, cpu=cpu_users(d, {}))
        out["reference"] = res
        say(f"   no extender:   {res['pods']} pods bound {res['total_s']:.2f} s after the first create "
            f"({res['rate']:.1f} pods/s; creates took {res['create_s']:.2f} s; first-to-last bind "
            f"{res['bind_span_rate']:.1f} pods/s)")
        say_cpu(res)
    finally:
        stop_process(ext_proc)
        if ext_log is not None:
            ext_log.close()
        subprocess.run([sys.executable, str(CLUSTER), "down", str(d)], capture_output=True, timeout=120, check=False)
        if args.keep:
            say(f"   kept {d}")
        else:
            shutil.rmtree(d, ignore_errors=True)
    return out


# ---- main ---------------------------------------------------------------------------------------------

@contextmanager
def workdir(path: str | None) -> Iterator[Path]:
    if path:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        yield p
        return
    p = Path(tempfile.mkdtemp(prefix="gs-bench-"))
    try:
        yield p
    finally:
        shutil.rmtree(p, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("_serve", "_fakeapi"):
        child = argparse.ArgumentParser()
        child.add_argument("--nodes", type=int, required=True)
        child.add_argument("--pods-per-node", type=int, default=10)
        child.add_argument("--seed", type=int, default=0)
        child.add_argument("--port", type=int)
        child.add_argument("--event-rate", type=float, default=100.0)
        child.add_argument("--events-flag")
        child.add_argument("--summary")
        child.add_argument("--profile")
        child.add_argument("--kubeconfig")
        child.add_argument("--gc-freeze", action="store_true")
        a = child.parse_args(argv[1:])
        return serve(a) if argv[0] == "_serve" else fake_api_child(a)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="latency,rss,e2e", help="comma list of latency, rss, e2e")
    parser.add_argument("--nodes", default="1000,5000", help="node counts for the latency part")
    parser.add_argument("--pods-per-node", type=int, default=10, help="running pods per node (latency part)")
    parser.add_argument("--iterations", type=int, default=300, help="filter+prioritize calls per measurement")
    parser.add_argument("--event-rate", type=float, default=100.0, help="watch events per second (latency part)")
    parser.add_argument("--rss-nodes", type=int, default=5000, help="nodes for the memory part (10 pods each)")
    parser.add_argument("--e2e-nodes", type=int, default=100)
    parser.add_argument("--e2e-pods", type=int, default=300)
    parser.add_argument("--workdir", help="keep generated files here (reused by later runs)")
    parser.add_argument("--keep", action="store_true", help="keep the e2e cluster directory")
    parser.add_argument("--profile", action="store_true", help="cProfile the latency child's serving thread")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="latency part: a second gc.freeze() after the child's setup (Extender.on_relist "
                             "already freezes the synced state)")
    parser.add_argument("--py-spy", metavar="EXE", help="py-spy executable: record the extender during the e2e "
                                                        "batch and print where its time goes")
    parser.add_argument("--quick", action="store_true", help="small sizes: 200 nodes, 100 calls, 500-node RSS, "
                                                            "20 nodes and 100 pods end to end")
    args = parser.parse_args(argv)
    if args.quick:
        args.nodes, args.iterations, args.rss_nodes, args.e2e_nodes, args.e2e_pods = "200", 100, 500, 20, 100
    args.nodes = [int(x) for x in str(args.nodes).split(",") if x]
    parts = {p.strip() for p in args.part.split(",") if p.strip()}
    say(f"bench_extender: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; parts {sorted(parts)}")
    with workdir(args.workdir) as work:
        if "latency" in parts:
            part_latency(args, work)
        if "rss" in parts:
            part_rss(args, work)
        if "e2e" in parts:
            part_e2e(args, work)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
