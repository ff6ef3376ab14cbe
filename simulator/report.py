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

    @classmethod
    def of(cls, trace: str, r: RunResult) -> Summary:
        return cls(trace, r.policy, r.mode, r.seed, unallocated_at(r.arrived, r.allocated, 100.0),
                   unallocated_at(r.arrived, r.allocated, 130.0), first_failure_arrived(r.arrived, r.allocated),
                   int(r.placed.shape[0]), r.pods_placed, r.seconds)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k in self.__slots__:
            v = getattr(self, k)
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


def write_json(path: str | os.PathLike[str], summaries: Sequence[Summary], meta: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "runs": [s.as_json() for s in summaries]}, indent=2) + "\n")


def write_plot(path: str | os.PathLike[str], runs: Sequence[tuple[str, RunResult]]) -> None:
    """Allocation against arrived workload, the median over seeds per (trace, policy, mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, list[np.ndarray]] = {}
    for trace, r in runs:
        _, mean = binned_curve(r.arrived, r.allocated)
        curves.setdefault(f"{trace} {r.policy} ({r.mode})", []).append(mean)
    fig, ax = plt.subplots(figsize=(8, 5))
    x = np.arange(131)
    ax.plot(x, np.minimum(x, 100), color="grey", linestyle=":", label="ideal")
    for label, ms in curves.items():
        stack = np.vstack(ms)
        with np.errstate(all="ignore"):
            med = np.array([np.median(c[~np.isnan(c)]) if (~np.isnan(c)).any() else np.nan for c in stack.T])
        ax.plot(x, med, label=label)
    ax.set_xlabel("arrived workload (% of GPU capacity)")
    ax.set_ylabel("GPU allocated (%)")
    ax.set_xlim(60, 130)
    ax.set_ylim(60, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
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
