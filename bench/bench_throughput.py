"""Benchmark: scheduling throughput with the extender against kube-scheduler alone (issue 50's bars).

Through the real kube-apiserver and kube-scheduler 1.36 of ``../shared/k8s`` on ``--nodes`` (100)
plain GPU Node objects (8 H100 in mps mode each, allocatable posted through the status subresource;
no kubelet, so pods are scheduled and bound, never started). Paired runs, alternated: each pair is
one run **with** the extender (``gpu-slice extender`` fenced on the scheduler's Lease when run as
root, beside a kube-scheduler running the shipped ``manifests/scheduler/scheduler-config.yaml``)
and one **without** (the same config without ``extenders``: kube-scheduler binds by itself), in
the order with/without, without/with, ... so drift in the machine's load falls on both sides. Every
run starts its own processes (a fresh Lease name each time, so no run waits for an old leader's
Lease), creates ``--pods`` slice pods in a namespace of its own, waits until a watch has seen every
pod bound, stops its processes and deletes its pods, so each run meets the same empty cluster.

Two ways of creating the pods (``--modes``): ``burst``, from 8 threads at once, and ``serial``, one
by one from a single thread (each create waits for the one before).

Printed per run: pods/s from the first create to the last bind, p50/p99 of each pod's time from its
create call returning to its bind being seen, and the CPU seconds of every process of the run (the
extender's per pod: the filter and bind bar). Per mode: the ratio with/without per pair and its
median (bar >= 0.90), and the median extender CPU per pod (bar <= 4 ms). The 1-minute load average
is printed before and after each run: on a shared machine it sets the figures as much as the code.
``--py-spy EXE`` samples the extender during the first run with it (``--gil``: only the thread
holding the GIL, so the profile is of CPU, not of waits) and prints where its time goes. Asserts
nothing. Run from the repository: ``.venv/bin/python bench/bench_throughput.py`` (about 4 minutes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_extender import (  # noqa: E402
    SHIPPED_CONFIG,
    batch,
    cluster,
    drain,
    free_port,
    http_status,
    make_nodes,
    print_spy,
    say,
    stop_process,
    wait_for,
)
from tests.k8s_launcher import CLUSTER  # noqa: E402

HOSTNAME = "gpu-slice-tp-0"
RATIO_BAR = 0.90
CPU_BAR_MS = 4.0


class Run:
    """One run's processes: a kube-scheduler (and, with the extender, a ``gpu-slice extender``)."""

    def __init__(self, d: Path, api_client: Any, index: int, with_extender: bool, fencing: bool) -> None:
        self.d, self.index, self.with_extender, self.fencing = d, index, with_extender, fencing
        self.lease = f"gs-tp-{index}"
        self.name = f"sched-{index}"
        self.extender: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.ops_port = 0  # /readyz and /metrics
        self.api_client = api_client
        self.log: Any = None

    def start(self) -> None:
        import yaml

        config = yaml.safe_load(SHIPPED_CONFIG.read_text())
        config["leaderElection"]["resourceName"] = self.lease
        if self.with_extender:
            self.port, self.ops_port = free_port(), free_port()
            argv = [sys.executable, "-m", "gpuslice_cli", "extender", "--kubeconfig", str(self.d / "kubeconfig"),
                    "--port", str(self.port), "--ops-address", "127.0.0.1", "--ops-port", str(self.ops_port),
                    "--lease", f"kube-system/{self.lease}", "--identity", HOSTNAME,
                    "--log-level", "WARNING"] + ([] if self.fencing else ["--no-fencing"])
            self.log = open(self.d / f"extender-{self.index}.log", "wb")  # noqa: SIM115
            self.extender = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
            wait_for("extender /readyz", lambda: http_status(f"http://127.0.0.1:{self.ops_port}/readyz") == 200, 60)
            config["extenders"][0]["urlPrefix"] = f"http://127.0.0.1:{self.port}"
        else:
            config.pop("extenders")
        path = self.d / f"{self.name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        cluster("scheduler", str(self.d), str(path), "--name", self.name,
                *(["--hostname", HOSTNAME] if self.fencing else []))
        from kubernetes.client import CoordinationV1Api

        coord = CoordinationV1Api(self.api_client)

        def held() -> bool:
            try:
                lease = drain(coord.read_namespaced_lease(self.lease, "kube-system", _preload_content=False))
            except Exception:
                return False
            return bool((lease.get("spec") or {}).get("holderIdentity"))
        wait_for(f"Lease {self.lease}", held, 60)
        if self.with_extender:  # the fence has read the new holder
            wait_for("extender /readyz", lambda: http_status(f"http://127.0.0.1:{self.ops_port}/readyz") == 200, 60)

    def pids(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for comp in ("apiserver", "etcd", self.name):
            try:
                out["scheduler" if comp == self.name else comp] = int(
                    (self.d / "run" / f"{comp}.pid").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
        if self.extender is not None:
            out["extender"] = self.extender.pid
        return out

    def stop(self) -> None:
        cluster("stop", str(self.d), self.name)
        stop_process(self.extender)
        if self.log is not None:
            self.log.close()


def delete_all(core: Any, namespace: str) -> None:
    drain(core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0, _preload_content=False))
    wait_for(f"the pods of {namespace} gone",
             lambda: not drain(core.list_namespaced_pod(namespace, _preload_content=False))["items"], 120, 0.5)


def describe(res: dict[str, Any], with_extender: bool) -> str:
    cpu = res["cpu_s"]
    parts = ", ".join(f"{'bench' if k == 'this benchmark' else k} {v:.2f}"
                      for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))
    ext = f"; extender {1000 * cpu['extender'] / res['pods']:.2f} ms CPU per pod" if with_extender else ""
    return (f"{res['rate']:6.1f} pods/s ({res['total_s']:.2f} s), create->bind p50 {res['bind_ms_p50']:.0f} ms "
            f"p99 {res['bind_ms_p99']:.0f} ms; CPU s: {parts}{ext}; load {res['load'][0]:.2f} -> {res['load'][1]:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--pods", type=int, default=300, help="pods per run (default 300)")
    parser.add_argument("--pairs", type=int, default=3, help="paired runs per mode (default 3)")
    parser.add_argument("--modes", default="burst,serial", help="burst (8 creating threads) and/or serial (one)")
    parser.add_argument("--py-spy", metavar="EXE", help="py-spy: sample the extender in the first run with it")
    parser.add_argument("--keep-profile", metavar="FILE", help="keep py-spy's collapsed stacks in FILE")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in ("burst", "serial") for m in modes):
        parser.error("--modes takes burst and/or serial")
    say(f"bench_throughput: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; {args.nodes} nodes x 8 H100 "
        f"(mps), {args.pods} pods per run, {args.pairs} pairs per mode, modes {modes}; load {os.getloadavg()}")
    if not CLUSTER.is_file():
        say(f"skipped: {CLUSTER} is absent")
        return 0
    from kubernetes import client, config

    fencing = os.geteuid() == 0 and shutil.which("unshare") is not None
    d = Path(tempfile.mkdtemp(prefix="gstp-"))
    index = 0
    spied = False
    summary: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    try:
        cluster("up", str(d))
        api_client = config.new_client_from_config(config_file=str(d / "kubeconfig"))
        core = client.CoreV1Api(api_client)
        make_nodes(core, args.nodes)
        say(f"   {args.nodes} Node objects created; extender {'fenced on' if fencing else 'unfenced (not root):'} "
            "each run's own Lease")
        for mode in modes:
            threads = 8 if mode == "burst" else 1
            say(f"== {mode}: {args.pods} pods created {'from 8 threads' if threads == 8 else 'one by one'}")
            pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
            for pair in range(args.pairs):
                order = (True, False) if pair % 2 == 0 else (False, True)
                got: dict[bool, dict[str, Any]] = {}
                for with_extender in order:
                    index += 1
                    run = Run(d, api_client, index, with_extender, fencing)
                    spy = None
                    try:
                        run.start()
                        if with_extender and args.py_spy and not spied and run.extender is not None:
                            spy_out = d / "extender.collapsed"
                            spy = subprocess.Popen([args.py_spy, "record", "--pid", str(run.extender.pid), "--rate",
                                                    "250", "--gil", "--format", "raw", "--output", str(spy_out)],
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                            time.sleep(1.0)
                        res = batch(core, f"tp-{index}", args.pods, threads, cpu=run.pids())
                        if with_extender and run.port:
                            body = urllib.request.urlopen(f"http://127.0.0.1:{run.ops_port}/metrics", timeout=5).read()
                            res["calls"] = {ln.split(" ")[0][len("gpu_slice_extender_requests_total"):]: float(
                                ln.split(" ")[1]) for ln in body.decode().splitlines()
                                if ln.startswith("gpu_slice_extender_requests_total{")}
                    finally:
                        if spy is not None:
                            spy.send_signal(signal.SIGINT)
                            spy.wait(30)
                            spied = True
                            if spy_out.is_file():
                                print_spy(spy_out, top=30)
                                if args.keep_profile:
                                    shutil.copy(spy_out, args.keep_profile)
                        run.stop()
                    delete_all(core, f"tp-{index}")
                    got[with_extender] = res
                    side = "with   " if with_extender else "without"
                    say(f"   pair {pair + 1} {side}: {describe(res, with_extender)}")
                    if with_extender and res.get("calls"):
                        say(f"      extender calls: {res['calls']}")
                pairs.append((got[True], got[False]))
                say(f"   pair {pair + 1}: ratio with/without {got[True]['rate'] / got[False]['rate']:.3f}")
            ratios = [w["rate"] / o["rate"] for w, o in pairs]
            cpu = [1000 * w["cpu_s"]["extender"] / w["pods"] for w, _ in pairs]
            median = statistics.median(ratios)
            say(f"   {mode}: ratio with/without per pair {', '.join(f'{r:.3f}' for r in ratios)}; median {median:.3f} "
                f"(bar >= {RATIO_BAR}: {'met' if median >= RATIO_BAR else 'MISSED'}); extender CPU per pod "
                f"{', '.join(f'{c:.2f}' for c in cpu)} ms, median {statistics.median(cpu):.2f} (bar <= {CPU_BAR_MS}: "
                f"{'met' if statistics.median(cpu) <= CPU_BAR_MS else 'MISSED'})")
            summary[mode] = pairs
    finally:
        subprocess.run([sys.executable, str(CLUSTER), "down", str(d)], capture_output=True, timeout=120, check=False)
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
