"""``gpu-slice simulate``: argument parsing and the run loop over traces, policies, modes and seeds.

With ``--nodes/--pods`` (or ``--trace-dir``) it replays openb-format traces; with neither it hands
over to the built-in LLM-serving scenario in :mod:`simulator.builtin`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from gpuslice.config import default_policy_spec
from gpuslice.decision import NarrowConfig
from gpuslice.errors import GpuSliceError
from gpuslice.policies.registry import resolve
from simulator.engine import MODES, EngineOptions, RunResult, replay, simulate
from simulator.inflate import inflate
from simulator.kubefile import inflate_requests, load_kube_cluster, looks_like_kube_list
from simulator.openb import MILLI, read_nodes, read_pods
from simulator.report import Summary, progress_bar, table, write_json, write_plot

PUBLISHED_NAMES = {"random": "Random", "dotprod": "DotProd", "gpuclustering": "GpuClustering",
                   "gpupacking": "GpuPacking", "bestfit": "BestFit", "fgd": "FGD"}
NODE_FILE = "openb_node_list_gpu_node.csv"


def default_trace_dir() -> Path:
    """``$GPU_SLICE_OPENB_DIR`` or ``../shared/data/openb`` next to the repository."""
    env = os.environ.get("GPU_SLICE_OPENB_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "data" / "openb"


def parse_seeds(text: str) -> list[int]:
    """``42-51``, ``42,45`` or a mix."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad seed list {text!r}; use e.g. 42-51 or 42,43") from None
        if last < first:
            raise argparse.ArgumentTypeError(f"seed range {part!r} is empty; write the smaller seed first")
        seeds.extend(range(first, last + 1))
    if not seeds:
        raise argparse.ArgumentTypeError("no seeds given")
    return seeds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("openb traces")
    g.add_argument("--nodes", type=Path, help="node list CSV (openb format: sn,cpu_milli,memory_mib,gpu,model)")
    g.add_argument("--pods", type=Path, action="append", default=[],
                   help="pod list CSV (11- or 5-column openb format); repeat for several traces")
    g.add_argument("--trace-dir", type=Path, help="a folder of openb files; with --traces, names like default,cpu050")
    g.add_argument("--traces", default="", help="trace names under --trace-dir (openb_pod_list_NAME.csv)")
    parser.add_argument("--policy", default=None,
                        help="policy name(s), comma-separated, or weighted 'a:0.7+b:0.3'; default: the "
                             "config's default mix (built-in scenario: that mix against every baseline); "
                             "e.g. fragmentation,fgd,bestfit")
    parser.add_argument("--seeds", type=parse_seeds, default=[42], help="e.g. 42-51 (default 42)")
    parser.add_argument("--inflate", type=float, default=1.3, help="tune ratio of the FGD artifact (default 1.3)")
    parser.add_argument("--slices", type=int, default=MILLI, help="MPS slices per GPU, simulation only (1..1000)")
    parser.add_argument("--mode", default="protocol", choices=[*MODES, "all"],
                        help="protocol (narrowed filter + 0..10 prioritize), wide (no narrowing), ideal, paper, all")
    parser.add_argument("--narrow-margin", type=float, default=0.0, help="narrowed filter: score margin")
    parser.add_argument("--narrow-max-nodes", type=int, default=1, help="narrowed filter: nodes passed on")
    parser.add_argument("--extender-weight", type=int, default=1, help="extender weight in kube-scheduler")
    parser.add_argument("--kube-scorer", choices=["none", "least-allocated"], default="none",
                        help="kube-scheduler's own scores (none: the profile disables the spreading scorers)")
    parser.add_argument("--json", type=Path, help="write per-run figures to this JSON file")
    parser.add_argument("--plot", type=Path, help="write a PNG of allocation against arrived workload")


def _policies(spec: str) -> list[str]:
    names = [p.strip().replace("+", ",") for p in spec.split(",") if p.strip()]
    for n in names:
        resolve(n)
    return names


def _published(path: Path) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    if not path.is_file():
        return out
    lines = path.read_text().splitlines()[1:]
    rev = {v: k for k, v in PUBLISHED_NAMES.items()}
    for line in lines:
        f = line.split(",")
        if len(f) >= 4 and f[1] in rev:
            out[(f[0], rev[f[1]])] = float(f[3])
    return out


def _trace_files(args: argparse.Namespace) -> tuple[Path, list[tuple[str, Path]]]:
    pods: list[tuple[str, Path]] = []
    tdir: Path | None = args.trace_dir
    for p in args.pods:
        name = p.stem.removeprefix("openb_pod_list_")
        pods.append((name, p))
    if args.traces:
        base = tdir or default_trace_dir()
        pods += [(t, base / f"openb_pod_list_{t}.csv") for t in args.traces.split(",") if t]
    nodes = args.nodes or (tdir or default_trace_dir()) / NODE_FILE
    return nodes, pods


def _run_kube(args: argparse.Namespace, paths: list[Path], policies: list[str], narrow: NarrowConfig) -> int:
    """Replay the pods of v1 List files on their nodes (emptied), S taken from the inventories."""
    cluster = load_kube_cluster(paths)
    if not cluster.requests:
        print(f"gpu-slice simulate: {paths[0]}: no Pod to replay", file=sys.stderr)
        return 2
    name = paths[-1].stem
    capacity = cluster.state().total_slices
    modes = list(MODES) if args.mode == "all" else [args.mode]
    summaries: list[Summary] = []
    runs: list[tuple[str, RunResult]] = []
    for seed in args.seeds:
        requests = inflate_requests(cluster.requests, capacity, seed, args.inflate)
        for policy in policies:
            for mode in modes:
                opts = EngineOptions(mode=mode, slices=cluster.slices_per_gpu, narrow=narrow,
                                     extender_weight=args.extender_weight, kube_scorer=args.kube_scorer)
                r = replay(cluster.state(), requests, cluster.requests, policy, seed, opts,
                           progress=progress_bar(f"{name} {policy} {mode} seed {seed}"))
                summaries.append(Summary.of(name, r))
                if args.plot:
                    runs.append((name, r))
    print(table(summaries, {}))
    if args.json:
        write_json(args.json, summaries, {"cluster": [str(p) for p in paths], "seeds": args.seeds,
                                          "inflate": args.inflate, "slices": cluster.slices_per_gpu})
    if args.plot:
        write_plot(args.plot, runs)
    return 0


def _flag_errors(args: argparse.Namespace) -> list[str]:
    """Refusals for numeric flags, each naming the flag (argparse only checks types)."""
    errors = []
    if args.inflate < 0:
        errors.append(f"--inflate must be >= 0 (0 replays the pods as listed), got {args.inflate}")
    if args.extender_weight < 1:
        errors.append(f"--extender-weight must be >= 1 (kube-scheduler requires a positive weight), "
                      f"got {args.extender_weight}")
    if args.narrow_margin < 0:
        errors.append(f"--narrow-margin must be >= 0, got {args.narrow_margin}")
    if args.narrow_max_nodes < 1:
        errors.append(f"--narrow-max-nodes must be >= 1, got {args.narrow_max_nodes}")
    return errors


def run(args: argparse.Namespace) -> int:
    errors = _flag_errors(args)
    if errors:
        for e in errors:
            print(f"gpu-slice simulate: {e}", file=sys.stderr)
        return 2
    if not args.nodes and not args.pods and not args.traces:
        try:
            builtin = importlib.import_module("simulator.builtin")
        except ModuleNotFoundError:
            print("gpu-slice simulate: the built-in LLM scenario (simulator.builtin) is not available in this "
                  "build; give --nodes FILE --pods FILE (openb format) or --traces NAMES", file=sys.stderr)
            return 2
        return int(builtin.run(args))
    if not 1 <= args.slices <= MILLI:
        print(f"gpu-slice simulate: --slices must be 1..{MILLI}", file=sys.stderr)
        return 2
    try:
        policies = _policies(args.policy or default_policy_spec().replace(",", "+"))
        narrow = NarrowConfig(args.narrow_margin, args.narrow_max_nodes)
        given = [p for p in (args.nodes, *args.pods) if p is not None]
        kube_paths = [p for p in given if looks_like_kube_list(p)]
        if kube_paths and len(kube_paths) != len(given):
            print("gpu-slice simulate: give either openb CSV files or v1 List files (.yaml/.json), not both",
                  file=sys.stderr)
            return 2
        if kube_paths:
            return _run_kube(args, list(dict.fromkeys(kube_paths)), policies, narrow)
        nodes_path, traces = _trace_files(args)
        if not traces:
            print("gpu-slice simulate: no pod list given (--pods FILE or --traces NAMES)", file=sys.stderr)
            return 2
        nodes = read_nodes(nodes_path)
        loaded = [(name, read_pods(path)) for name, path in traces]
    except GpuSliceError as e:
        print(f"gpu-slice simulate: {e}", file=sys.stderr)
        return 2
    modes = list(MODES) if args.mode == "all" else [args.mode]
    capacity = sum(n.gpus for n in nodes) * MILLI
    summaries: list[Summary] = []
    runs: list[tuple[str, RunResult]] = []
    for trace_name, pods in loaded:
        for seed in args.seeds:
            inflated = inflate(pods, capacity, seed, args.inflate)
            for policy in policies:
                for mode in modes:
                    opts = EngineOptions(mode=mode, slices=args.slices, narrow=narrow,
                                         extender_weight=args.extender_weight, kube_scorer=args.kube_scorer)
                    bar = progress_bar(f"{trace_name} {policy} {mode} seed {seed}")
                    r = simulate(nodes, inflated, policy, seed, opts, trace=pods, progress=bar)
                    s = Summary.of(trace_name, r)
                    summaries.append(s)
                    if args.plot:
                        runs.append((trace_name, r))
                    print(f"{trace_name} {policy} {mode} seed={seed}: "
                          f"unallocated@100={s.unallocated_gpu_pct_at_100:.2f}% "
                          f"@130={s.unallocated_gpu_pct_at_130:.2f}% first-failure={s.first_failure_arrived_pct:.0f}% "
                          f"placed={s.pods_placed}/{s.pods} {s.seconds:.1f}s", flush=True)
    published = _published(nodes_path.parent / "published_results.csv")
    print()
    print(table(summaries, published))
    if args.json:
        write_json(args.json, summaries, {"nodes": str(nodes_path), "traces": [str(p) for _, p in traces],
                                          "seeds": args.seeds, "inflate": args.inflate, "slices": args.slices,
                                          "narrow_margin": args.narrow_margin,
                                          "narrow_max_nodes": args.narrow_max_nodes})
    if args.plot:
        write_plot(args.plot, runs)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-slice simulate", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
