"""Output of a simulation: the table, the JSON file, the PNG plot, and the terminal progress bar."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from simulator.engine import RunResult
from simulator.metrics import binned_curve, first_failure_arrived, unallocated_at


def _legend(title: str, rows: Sequence[tuple[str, str]]) -> str:
    """A column-name / meaning list, so a reader need not guess what a short header means."""
    width = max(len(name) for name, _ in rows)
    pad = " " * (width + 4)
    lines = [title]
    for name, text in rows:
        first, *rest = text.split("\n")
        lines.append(f"  {name:<{width}}  {first}")
        lines.extend(pad + more for more in rest)
    return "\n".join(lines)


#: What the columns of the trace table mean (printed under it and in ``--help``).
TRACE_LEGEND = _legend("Columns of the trace table (means over the seeds; pods arrive one by one and never\n"
                       "leave; a pod that fits nowhere is dropped):", [
    ("seeds", "how many seeds (--seeds) the row averages"),
    ("unalloc@100", "% of the cluster's GPU capacity left unallocated when the pods tried so far ask for\n"
                    "100 % of it: capacity stranded by fragmentation (lower is better)"),
    ("published", "the FGD authors' published mean for the same trace and policy, when the trace folder\n"
                  "has published_results.csv; '-' otherwise"),
    ("unalloc@130", "the same when the pods tried ask for 130 % of capacity (needs --inflate 1.3 or more)"),
    ("1st fail%", "requested GPU (% of capacity) when allocation first falls a point behind the requests:\n"
                  "how full the cluster gets before a pod is turned away (higher is better)"),
    ("placed", "pods placed, of all the pods tried (the trace after --inflate)"),
    ("s/seed", "seconds one replay took"),
    ("nan", "the workload never reached that level (e.g. no pod asks for a GPU)"),
])

#: What the columns of the built-in LLM day's table mean (printed under it and in ``--help``).
BUILTIN_LEGEND = _legend("Columns of the built-in day's table (means over the seeds):", [
    ("placed", "pods bound to a GPU slice during the day"),
    ("pending", "pods that found no fitting slice when first tried and waited Pending (reasons below)"),
    ("never", "of those, pods deleted (scale-down, end of day) before a slice freed up for them"),
    ("pend-h", "pod-hours spent Pending, all pods together"),
    ("GPUs avg", "GPUs holding at least one slice pod, time-averaged over the day; GPUs peak: the most\n"
                 "at once"),
    ("frag %", "idle slices on GPUs in use / all slices of GPUs in use, time-averaged: capacity paid for\n"
               "but stranded"),
    ("$/h avg", "hourly price of the nodes holding at least one GPU pod (their spot or on-demand price),\n"
                "time-averaged, as if an autoscaler removed empty nodes; $/h peak: the dearest moment"),
])


@dataclass(frozen=True, slots=True)
class Summary:
    """The figures of one run, as written to JSON."""

    trace: str
    policy: str
    mode: str
    seed: int
    unallocated_gpu_pct_at_100: float
    unallocated_gpu_pct_at_130: float
    first_failure_arrived_pct: float
    pods: int
    pods_placed: int
    seconds: float
    #: Pod UID -> ``node/target`` (see ``RunResult.placements``); only for v1 List replays, whose pods
    #: are real objects an operator can look up.
    placements: dict[str, str] | None = None

    @classmethod
    def of(cls, trace: str, r: RunResult, *, with_placements: bool = False) -> Summary:
        return cls(trace, r.policy, r.mode, r.seed, unallocated_at(r.arrived, r.allocated, 100.0),
                   unallocated_at(r.arrived, r.allocated, 130.0), first_failure_arrived(r.arrived, r.allocated),
                   int(r.placed.shape[0]), r.pods_placed, r.seconds,
                   dict(r.placements) if with_placements else None)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k in self.__slots__:
            v = getattr(self, k)
            if k == "placements":
                if v is not None:
                    out[k] = v
                continue
            out[k] = None if isinstance(v, float) and math.isnan(v) else (round(v, 4) if isinstance(v, float) else v)
        return out


def _mean(xs: Sequence[float]) -> float:
    ok = [x for x in xs if not math.isnan(x)]
    return sum(ok) / len(ok) if ok else math.nan


def table(summaries: Sequence[Summary], published: dict[tuple[str, str], float] | None = None) -> str:
    """Mean per (trace, policy, mode) over seeds, with the published FGD-artifact mean when known."""
    groups: dict[tuple[str, str, str], list[Summary]] = {}
    for s in summaries:
        groups.setdefault((s.trace, s.policy, s.mode), []).append(s)
    head = f"{'trace':<12} {'policy':<16} {'mode':<9} {'seeds':>5} {'unalloc@100':>11} {'published':>9} " \
           f"{'unalloc@130':>11} {'1st fail%':>9} {'placed':>7} {'s/seed':>7}"
    lines = [head, "-" * len(head)]
    for (trace, policy, mode), ss in groups.items():
        pub = (published or {}).get((trace, policy))
        pub_text = f"{pub:9.2f}" if pub is not None else f"{'-':>9}"
        lines.append(
            f"{trace:<12} {policy:<16} {mode:<9} {len(ss):>5} "
            f"{_mean([s.unallocated_gpu_pct_at_100 for s in ss]):>11.2f} "
            f"{pub_text} {_mean([s.unallocated_gpu_pct_at_130 for s in ss]):>11.2f} "
            f"{_mean([s.first_failure_arrived_pct for s in ss]):>9.1f} "
            f"{_mean([float(s.pods_placed) for s in ss]):>7.0f} {_mean([s.seconds for s in ss]):>7.2f}")
    return "\n".join(lines)


def write_json(path: str | os.PathLike[str], summaries: Sequence[Summary], meta: dict[str, Any],
               stdout: TextIO | None = None) -> None:
    """The figures as JSON; ``-`` writes to standard output, as the built-in scenario does."""
    text = json.dumps({"meta": meta, "runs": [s.as_json() for s in summaries]}, indent=2) + "\n"
    if str(path) == "-":
        (stdout or sys.stdout).write(text)
    else:
        Path(path).write_text(text)


def plot_figure(runs: Sequence[tuple[str, RunResult]]) -> Any:
    """Allocation against arrived workload per (trace, policy, mode): every seed's curve, thin, and
    with several seeds their median, bold, in the same colour (a matplotlib Figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, list[tuple[int, np.ndarray]]] = {}
    for trace, r in runs:
        _, mean = binned_curve(r.arrived, r.allocated)
        curves.setdefault(f"{trace} {r.policy} ({r.mode})", []).append((r.seed, mean))
    fig, ax = plt.subplots(figsize=(8, 5))
    x = np.arange(131)
    ax.plot(x, np.minimum(x, 100), color="grey", linestyle=":", label="ideal")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, (label, seeded) in enumerate(curves.items()):
        colour = colours[n % len(colours)]
        several = len(seeded) > 1
        for seed, curve in seeded:
            ax.plot(x, curve, color=colour, linewidth=0.8 if several else 1.5, alpha=0.45 if several else 1.0,
                    label=None if several else f"{label}, seed {seed}")
        if several:
            stack = np.vstack([c for _, c in seeded])
            with np.errstate(all="ignore"):
                med = np.array([np.median(c[~np.isnan(c)]) if (~np.isnan(c)).any() else np.nan for c in stack.T])
            seeds = ", ".join(str(sd) for sd, _ in seeded)
            ax.plot(x, med, color=colour, linewidth=2.0, label=f"{label}, median of seeds {seeds}")
    ax.set_xlabel("arrived workload (% of GPU capacity)")
    ax.set_ylabel("GPU allocated (%)")
    ax.set_xlim(60, 130)
    ax.set_ylim(60, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_plot(path: str | os.PathLike[str], runs: Sequence[tuple[str, RunResult]]) -> None:
    """:func:`plot_figure`, written to ``path`` (the format from its suffix)."""
    import matplotlib.pyplot as plt

    fig = plot_figure(runs)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def progress_bar(label: str, stream: TextIO | None = None) -> Callable[[int, int], None] | None:
    """A one-line progress bar, only when the stream is a terminal (never in logs or pipes)."""
    out = stream or sys.stdout
    if not out.isatty():
        return None

    def update(done: int, total: int) -> None:
        width = 30
        filled = int(width * done / max(total, 1))
        out.write(f"\r{label:<40} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done >= total:
            out.write("\r" + " " * 90 + "\r")
        out.flush()

    return update
