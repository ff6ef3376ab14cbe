"""``gpu-slice simulate``: argument parsing and the run loop over traces, policies, modes and seeds.

With ``--nodes/--pods`` (or ``--trace-dir``) it replays openb-format traces; with neither it hands
over to the built-in LLM-serving scenario in :mod:`simulator.builtin`.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from pathlib import Path
from typing import Literal

from gpuslice.config import Config, default_policy_spec, load_config_text
from gpuslice.decision import NarrowConfig
from gpuslice.errors import ConfigError, GpuSliceError
from gpuslice.policies.registry import resolve
from simulator import dra
from simulator.engine import MODES, EngineOptions, RunResult, replay, simulate
from simulator.inflate import has_gpu_demand, inflate
from simulator.kubefile import KubeCluster, inflate_requests, load_kube_cluster, looks_like_kube_list
from simulator.miglayouts import DynamicLayouts, dynamic_products, physical_slices
from simulator.openb import MILLI, read_nodes, read_pods
from simulator.report import (
    BUILTIN_LEGEND,
    TRACE_LEGEND,
    Summary,
    progress_bar,
    table,
    write_json,
    write_plot,
)

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


#: What a flag means when not given; ``None`` in the namespace until then, so that a flag given
#: where it does not apply can be refused instead of ignored.
DEFAULTS: dict[str, object] = {"inflate": 1.3, "slices": MILLI, "mode": "protocol", "narrow_margin": 0.0,
                               "narrow_max_nodes": 1, "extender_weight": 1, "kube_scorer": "none"}

#: Flags the built-in LLM day does not read, and why (it reads --narrow-margin: scores within it of
#: the best count as tied and go to the node first in the extender's order).
BUILTIN_IGNORES: dict[str, str] = {
    "inflate": "its pods are generated, with arrivals and departures; there is no trace to scale",
    "slices": "its nodes have their own MIG layouts and MPS slice counts",
    "mode": "it always runs the extender's narrowed filter with reservations",
    "narrow_max_nodes": "its narrowed filter passes one node on, as the extender does by default",
    "extender_weight": "kube-scheduler has nothing to weigh there: the narrowed filter passes one node",
    "kube_scorer": "kube-scheduler has nothing to score there: the narrowed filter passes one node",
}

#: Flags only some modes read, the modes, and why.
MODE_ONLY: dict[str, tuple[tuple[str, ...], str]] = {
    "narrow_margin": (("protocol",), "only protocol narrows the extender's filter"),
    "narrow_max_nodes": (("protocol",), "only protocol narrows the extender's filter"),
    "extender_weight": (("protocol", "wide"), "only protocol and wide go through kube-scheduler's scoring"),
    "kube_scorer": (("protocol", "wide"), "only protocol and wide go through kube-scheduler's scoring"),
}

EPILOG = f"""\
Without --nodes/--pods/--traces it runs the built-in LLM-serving day; --inflate, --slices,
--mode, --narrow-max-nodes and the kube-scheduler flags are for traces and are refused there. An
openb CSV pod list needs its node list (--nodes, or --trace-dir holding {NODE_FILE});
a v1 List (.yaml/.json) carries its own nodes.

{BUILTIN_LEGEND}

{TRACE_LEGEND}
"""


class SimulateError(GpuSliceError):
    """Arguments that cannot make a run; the CLI prints the message on one line and exits 2."""


def parse_inflate(text: str) -> float:
    """``--inflate``: a finite ratio >= 0, refused at parsing (NaN or infinity would never stop)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0 replays the pods as listed), "
                                         f"got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``gpu-slice simulate``; the epilog explains the output's columns."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    g = parser.add_argument_group("openb traces and v1 Lists")
    g.add_argument("--nodes", type=Path,
                   help="node list: openb CSV (sn,cpu_milli,memory_mib,gpu,model) or a v1 List (.yaml/.json)")
    g.add_argument("--pods", type=Path, action="append", default=[],
                   help="pod list: openb CSV (11 or 5 columns; needs --nodes or --trace-dir) or a v1 List; "
                        "repeat for several traces")
    g.add_argument("--trace-dir", type=Path,
                   help=f"a folder of openb files ({NODE_FILE}, openb_pod_list_NAME.csv)")
    g.add_argument("--traces", default="", help="trace names under --trace-dir, e.g. default,cpu050")
    parser.add_argument("--policy", default=None,
                        help="policy name(s), comma-separated, or weighted 'a:0.7+b:0.3'; default: the "
                             "config's default mix (built-in scenario: that mix against every baseline); "
                             "e.g. fragmentation,fgd,bestfit")
    parser.add_argument("--seeds", type=parse_seeds, default=[42], help="e.g. 42-51 (default 42)")
    parser.add_argument("--narrow-margin", type=float, default=None,
                        help="narrowed filter: scores within this margin of the best count as tied and go in "
                             "the extender's node order (--mode protocol, and the built-in day; default 0)")
    t = parser.add_argument_group("trace replay only (refused for the built-in day)")
    t.add_argument("--inflate", type=parse_inflate, default=None,
                   help="scale the trace to this ratio of GPU capacity, the FGD artifact's tune ratio "
                        "(default 1.3; 0 replays the pods as listed)")
    t.add_argument("--slices", type=int, default=None,
                   help=f"MPS slices per GPU for openb CSV, simulation only (1..{MILLI}, default {MILLI})")
    t.add_argument("--mode", default=None, choices=[*MODES, "all"],
                   help="protocol (narrowed filter + 0..10 prioritize; the default), wide (no narrowing), "
                        "ideal, paper, all")
    t.add_argument("--narrow-max-nodes", type=int, default=None,
                   help="narrowed filter: nodes passed on (protocol; default 1)")
    t.add_argument("--extender-weight", type=int, default=None,
                   help="extender weight in kube-scheduler (protocol, wide; default 1)")
    t.add_argument("--kube-scorer", choices=["none", "least-allocated"], default=None,
                   help="kube-scheduler's own scores (protocol, wide; default none: the profile disables "
                        "the spreading scorers)")
    parser.add_argument("--config", type=Path, default=None,
                        help="the services' versioned config file (YAML): its policies (when --policy is not "
                             "given), narrowing margin (when --narrow-margin is not given), memory tolerance, "
                             "isolation default, owner-spread rule, reservation TTL and prices, so a replay "
                             "decides as the extender configured with it would")
    parser.add_argument("--mig-layouts", choices=["static", "dynamic"], default=None,
                        help="static: MIG layouts as the nodes have them; dynamic: free MIG slots are re-cut for pods "
                             "refused for shape (gpuslice.miglayout; --mode protocol; capacity then counts every "
                             "compute slice); default: what the config's migLayouts.<product>.dynamic says")
    dra.add_arguments(parser)
    parser.add_argument("--json", type=Path, help="write per-run figures to this JSON file ('-': standard output)")
    parser.add_argument("--plot", type=Path,
                        help="write a plot to this image file (.png, .pdf, .svg...): allocation against "
                             "arrived workload, or GPUs and $/h over the built-in day")


def _policies(spec: str) -> list[str]:
    names = [p.strip().replace("+", ",") for p in spec.split(",") if p.strip()]
    for n in names:
        resolve(n)
    return names


def _published(path: Path) -> dict[tuple[str, str], float]:
    """The FGD authors' means, when the trace folder has them; an unreadable file just shows '-'."""
    out: dict[tuple[str, str], float] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()[1:]
    except (OSError, UnicodeDecodeError):
        return out
    rev = {v: k for k, v in PUBLISHED_NAMES.items()}
    for line in lines:
        f = line.split(",")
        if len(f) >= 4 and f[1] in rev:
            try:
                out[(f[0], rev[f[1]])] = float(f[3])
            except ValueError:
                continue
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


def _flag_errors(args: argparse.Namespace) -> list[str]:
    """Refusals for numeric flags, each naming the flag (argparse only checks types)."""
    errors = []
    if args.extender_weight is not None and args.extender_weight < 1:
        errors.append(f"--extender-weight must be >= 1 (kube-scheduler requires a positive weight), "
                      f"got {args.extender_weight}")
    if args.narrow_margin is not None and not (math.isfinite(args.narrow_margin) and args.narrow_margin >= 0):
        errors.append(f"--narrow-margin must be a finite number >= 0, got {args.narrow_margin}")
    if args.narrow_max_nodes is not None and args.narrow_max_nodes < 1:
        errors.append(f"--narrow-max-nodes must be >= 1, got {args.narrow_max_nodes}")
    if args.slices is not None and not 1 <= args.slices <= MILLI:
        errors.append(f"--slices must be 1..{MILLI}, got {args.slices}")
    return errors


Source = Literal["builtin", "openb", "kube"]


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _source(args: argparse.Namespace) -> Source:
    """Which workload the flags name; refuses combinations that would silently use something else."""
    given = [p for p in (args.nodes, *args.pods) if p is not None]
    kube = [p for p in given if looks_like_kube_list(p)]
    if kube:
        if len(kube) != len(given):
            raise SimulateError("give either openb CSV files or v1 List files (.yaml/.json), not both")
        named = "--traces" if args.traces else "--trace-dir" if args.trace_dir else ""
        if named:
            raise SimulateError(f"{named} names openb CSV traces and does not apply to v1 List files "
                                "(.yaml/.json); give one or the other")
        return "kube"
    if not given and not args.traces:
        if args.trace_dir:
            raise SimulateError(f"--trace-dir {args.trace_dir} needs --traces NAMES (openb_pod_list_NAME.csv "
                                "in it) or --pods FILE")
        return "builtin"
    if args.pods and args.nodes is None and args.trace_dir is None:
        raise SimulateError(f"--pods {args.pods[0]} is an openb CSV pod list and needs its node list: give "
                            f"--nodes FILE, or --trace-dir DIR holding {NODE_FILE} (a v1 List "
                            "(.yaml/.json) carries its own nodes)")
    if not args.pods and not args.traces:
        raise SimulateError("no pod list given (--pods FILE or --traces NAMES)")
    return "openb"


def _applicability(args: argparse.Namespace, source: Source) -> None:
    """Refuse, naming it, a flag the chosen workload or mode would ignore."""
    given = [d for d in DEFAULTS if getattr(args, d, None) is not None]
    if source == "builtin":
        given = [d for d in given if d in BUILTIN_IGNORES]
        if given:
            raise SimulateError(f"{_flag(given[0])} does not apply to the built-in LLM day: "
                                f"{BUILTIN_IGNORES[given[0]]} (it is for --nodes/--pods traces)")
        return
    if source == "kube" and "slices" in given:
        raise SimulateError("--slices does not apply to v1 List files: their GPUs carry their own slice count "
                            "(S) in the inventory annotation")
    mode = args.mode or DEFAULTS["mode"]
    for dest in given:
        if dest in MODE_ONLY and mode != "all":
            modes, why = MODE_ONLY[dest]
            if mode not in modes:
                raise SimulateError(f"{_flag(dest)} does not apply to --mode {mode}: {why}")


def _plot_formats() -> set[str]:
    """Image formats matplotlib can write, so a bad ``--plot`` suffix is refused before the run."""
    from matplotlib.figure import Figure

    return set(Figure().canvas.get_supported_filetypes())


def _check_output(flag: str, path: Path) -> None:
    """Fail before the run, not after it, when an output file cannot be written."""
    if flag == "--json" and str(path) == "-":
        return
    if flag == "--plot" and path.suffix:
        formats = _plot_formats()
        if path.suffix[1:].lower() not in formats:
            raise SimulateError(f"--plot {path}: cannot write {path.suffix!r} images; use one of "
                                f"{', '.join(sorted(formats))}")
    if path.is_dir():
        raise SimulateError(f"{flag} {path}: is a folder; give a file name")
    existed = path.exists()
    try:
        with path.open("ab"):  # append: an existing file is left as it is
            pass
    except OSError as err:
        raise SimulateError(f"{flag} {path}: cannot write: {err.strerror or err}") from None
    if not existed:
        path.unlink(missing_ok=True)


def _fill_defaults(args: argparse.Namespace) -> None:
    for dest, value in DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, value)


def _no_gpu_note(name: str, count: int) -> None:
    print(f"gpu-slice simulate: note: {name}: no pod asks for a GPU, so there is nothing to pack or inflate; "
          f"the {count} pods are replayed as listed", file=sys.stderr)


def _write_outputs(args: argparse.Namespace, summaries: list[Summary], meta: dict[str, object],
                   runs: list[tuple[str, RunResult]]) -> None:
    flag = ""
    try:
        if args.json:
            flag = f"--json {args.json}"
            write_json(args.json, summaries, meta)
        if args.plot:
            flag = f"--plot {args.plot}"
            write_plot(args.plot, runs)
    except OSError as err:  # checked up front; this is a full disk or a path changed during the run
        raise SimulateError(f"{flag}: cannot write: {err.strerror or err}") from None


def _run_kube(args: argparse.Namespace, paths: list[Path], policies: list[str], narrow: NarrowConfig,
              config: Config | None = None) -> int:
    """Replay the pods of v1 List files on their nodes (emptied), S taken from the inventories."""
    cluster = load_kube_cluster(paths, config=config)
    for line in cluster.skipped:
        print(f"gpu-slice simulate: skipped {line}", file=sys.stderr)
    if cluster.skipped:
        print(f"gpu-slice simulate: {len(cluster.skipped)} object(s) skipped (the extender would refuse them as "
              f"written); replaying the other {len(cluster.requests)} pods", file=sys.stderr)
    if not cluster.requests:
        raise SimulateError(f"{paths[0]}: no Pod to replay")
    if cluster.gpus == 0:
        raise SimulateError(f"{paths[0]}: the nodes have no GPUs: nothing to pack")
    name = paths[-1].stem
    if not has_gpu_demand(cluster.requests, lambda r: r.total_slices):
        _no_gpu_note(name, len(cluster.requests))
    capacity = cluster.state().total_slices
    modes = list(MODES) if args.mode == "all" else [args.mode]
    dynamic = _dynamic_for(args, config, cluster, modes)
    if dynamic:
        capacity = physical_slices([inv for _, inv in cluster.nodes], dynamic)
    summaries: list[Summary] = []
    runs: list[tuple[str, RunResult]] = []
    for seed in args.seeds:
        requests = inflate_requests(cluster.requests, capacity, seed, args.inflate)
        for policy in policies:
            for mode in modes:
                opts = EngineOptions(mode=mode, slices=cluster.slices_per_gpu, narrow=narrow,
                                     extender_weight=args.extender_weight, kube_scorer=args.kube_scorer,
                                     placements=True, devices=args.devices)
                state = cluster.state()
                layouts = DynamicLayouts.build(state, {s.name: inv for s, inv in cluster.nodes}, dynamic,
                                               memory_tolerance=cluster.memory_tolerance,
                                               wait_s=0.0) if dynamic else None
                r = replay(state, requests, cluster.requests, policy, seed, opts,
                           progress=progress_bar(f"{name} {policy} {mode} seed {seed}"), layouts=layouts,
                           capacity=capacity)
                if layouts is not None:
                    print(f"{name} {policy} seed {seed}: dynamic MIG layouts: {layouts.summary()}", flush=True)
                summaries.append(Summary.of(name, r, with_placements=True))
                if args.plot:
                    runs.append((name, r))
    _print_devices(args)
    print(table(summaries, {}))
    print()
    print(TRACE_LEGEND)
    if dynamic:
        print(f"\nDynamic MIG layouts ({', '.join(sorted(dynamic))}): capacity counts every compute slice of those "
              f"GPUs ({capacity} slices), also those a static layout leaves without an instance; re-cuts are "
              "instant in an arrival-only replay (no clock).")
    _write_outputs(args, summaries, {"cluster": [str(p) for p in paths], "seeds": args.seeds,
                                     "inflate": args.inflate, "slices": cluster.slices_per_gpu,
                                     "device_choice": args.devices.label,
                                     "skipped": list(cluster.skipped),
                                     "mig_layouts": "dynamic" if dynamic else "static"}, runs)
    return 0


def _dynamic_for(args: argparse.Namespace, config: Config | None, cluster: KubeCluster,
                 modes: list[str]) -> frozenset[str]:
    """The MIG products of this cluster whose layouts follow demand (``--mig-layouts``, else the config)."""
    wanted = dynamic_products(args.mig_layouts, config)
    present = {g.product for _, inv in cluster.nodes for g in inv.gpus if g.mode == "mig"}
    dynamic = frozenset(wanted & present)
    dra.refuse_dynamic_with_dra(dynamic, args.devices)
    if dynamic and modes != ["protocol"]:
        raise SimulateError(f"dynamic MIG layouts are replayed in --mode protocol only (the extender's path), "
                            f"not {args.mode}")
    return dynamic


def run(args: argparse.Namespace) -> int:
    """Check every flag and output path, then run; a refusal is one line on stderr and exit 2."""
    errors = _flag_errors(args)
    if errors:
        for e in errors:
            print(f"gpu-slice simulate: {e}", file=sys.stderr)
        return 2
    try:
        return _run(args)
    except GpuSliceError as e:
        print(f"gpu-slice simulate: {e}", file=sys.stderr)
        return 2


def _load_config(args: argparse.Namespace) -> Config | None:
    """``--config``: read and validated before anything runs; a bad field stops the run naming it."""
    path: Path | None = getattr(args, "config", None)
    if path is None:
        return None
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise SimulateError(f"--config {path}: cannot read: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise SimulateError(f"--config {path}: not UTF-8 text") from None
    try:
        config = load_config_text(text, simulator=True)
    except ConfigError as err:
        raise SimulateError(f"--config {path}: {err}") from None
    if args.policy is None:
        args.policy = "+".join(f"{name}:{weight:g}" for name, weight in config.policy_weights().items())
    if args.narrow_margin is None and config.narrowing.margin:
        args.narrow_margin = config.narrowing.margin
    return config


def _print_devices(args: argparse.Namespace) -> None:
    if args.devices.kind != "free":
        print(f"device choice: {args.devices.label}")


def _run(args: argparse.Namespace) -> int:
    source = _source(args)
    _applicability(args, source)
    args.devices = dra.choice_from_args(args)
    config = _load_config(args)
    args.config_obj = config
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            _check_output(flag, path)
    _fill_defaults(args)
    if source == "builtin":
        try:
            builtin = importlib.import_module("simulator.builtin")
        except ModuleNotFoundError:
            raise SimulateError("the built-in LLM scenario (simulator.builtin) is not available in this build; "
                                "give --nodes FILE --pods FILE (openb format) or --traces NAMES") from None
        return int(builtin.run(args))
    policies = _policies(args.policy or default_policy_spec().replace(",", "+"))
    narrow = NarrowConfig(args.narrow_margin, args.narrow_max_nodes)
    if source == "kube":
        given = [p for p in (args.nodes, *args.pods) if p is not None]
        return _run_kube(args, list(dict.fromkeys(given)), policies, narrow, config)
    if args.mig_layouts == "dynamic":
        raise SimulateError("--mig-layouts dynamic does not apply to openb CSV traces: their nodes have no MIG GPUs")
    nodes_path, traces = _trace_files(args)
    nodes = read_nodes(nodes_path)
    loaded = [(name, read_pods(path)) for name, path in traces]
    capacity = sum(n.gpus for n in nodes) * MILLI
    if capacity == 0:
        raise SimulateError(f"{nodes_path}: the node list has no GPUs: nothing to pack")
    for name, pods in loaded:
        if not has_gpu_demand(pods, lambda p: p.total_milli):
            _no_gpu_note(name, len(pods))
    modes = list(MODES) if args.mode == "all" else [args.mode]
    summaries: list[Summary] = []
    runs: list[tuple[str, RunResult]] = []
    for trace_name, pods in loaded:
        for seed in args.seeds:
            inflated = inflate(pods, capacity, seed, args.inflate)
            for policy in policies:
                for mode in modes:
                    opts = EngineOptions(mode=mode, slices=args.slices, narrow=narrow,
                                         extender_weight=args.extender_weight, kube_scorer=args.kube_scorer,
                                         devices=args.devices)
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
    _print_devices(args)
    print(table(summaries, published))
    print()
    print(TRACE_LEGEND)
    _write_outputs(args, summaries, {"nodes": str(nodes_path), "traces": [str(p) for _, p in traces],
                                     "seeds": args.seeds, "inflate": args.inflate, "slices": args.slices,
                                     "narrow_margin": args.narrow_margin,
                                     "narrow_max_nodes": args.narrow_max_nodes,
                                     "device_choice": args.devices.label}, runs)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-slice simulate", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
