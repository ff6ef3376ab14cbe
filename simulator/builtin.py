"""``gpu-slice simulate`` with no trace: the built-in LLM-serving day, one row per policy.

What the columns mean (the same definitions for every policy):

* ``placed``: pods bound during the day; ``pending``: pods that found no fitting slice when first
  tried and went Pending (the cause is in the reasons below the table); ``never``: of those, pods
  deleted (scale-down, end of day) before any slice freed up for them; ``pend-h``: pod-hours spent
  Pending;
* ``GPUs avg/peak``: GPUs holding at least one slice pod, time-averaged over the day and at peak;
* ``frag %``: idle slices on GPUs in use / all slices of GPUs in use, time-averaged: capacity that
  is paid for but stranded;
* ``$/h avg/peak``: the price of nodes holding at least one GPU pod (spot or on-demand price of
  their instance type), time-averaged: what the day costs when an autoscaler removes empty nodes.

With several seeds every figure is the mean over seeds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from gpuslice.config import default_policy_spec
from gpuslice.errors import GpuSliceError
from gpuslice.policies.registry import resolve
from gpuslice.reservations import DEFAULT_TTL_S
from simulator.dra import DeviceChoice, refuse_dynamic_with_dra
from simulator.llm.cluster import Cluster, build_cluster
from simulator.llm.engine import Result, replay
from simulator.llm.workload import Workload, generate
from simulator.miglayouts import RECUT_WAIT_S, dynamic_products
from simulator.report import BUILTIN_LEGEND

#: Our default scoring (``gpuslice.config.DEFAULT_POLICIES``), as a registry spec.
DEFAULT_POLICY = default_policy_spec()
DEFAULT_LABEL = f"default ({DEFAULT_POLICY})"
#: The bar's baselines (DESIGN 7): the FGD paper's policies and kube-scheduler's two scorers.
BAR_BASELINES: tuple[str, ...] = ("bestfit", "binpack", "spread", "random", "fgd", "dotprod", "gpuclustering",
                                  "gpupacking")
#: Compared when no policy is chosen: our default first, every baseline, then our single policies
#: (the default's parts and ``utilization``), shown for reference but not part of the bar.
OWN_POLICIES: tuple[str, ...] = ("fragmentation", "cost", "utilization")
BASELINES: tuple[str, ...] = BAR_BASELINES + OWN_POLICIES
COLUMNS: tuple[str, ...] = ("policy", "placed", "pending", "never", "pend-h", "GPUs avg", "GPUs peak",
                            "frag %", "$/h avg", "$/h peak")


def policies_from(spec: str | Sequence[str] | None) -> list[str]:
    """The policies to run. Unset, ``default`` or the default mix itself means our default against
    every baseline; otherwise a comma-separated list where ``a:0.7+b:0.3`` is one weighted policy and
    ``default`` stands for the default mix."""
    if spec is None or spec in ("default", DEFAULT_POLICY, DEFAULT_POLICY.replace(",", "+")):
        return [DEFAULT_POLICY, *BASELINES]
    items = [spec] if isinstance(spec, str) else list(spec)
    names = [p.strip().replace("+", ",") for item in items for p in item.split(",") if p.strip()]
    return [DEFAULT_POLICY if n == "default" else n for n in names]


def label(policy: str) -> str:
    """How the table names a policy: the default mix says that it is the default."""
    return DEFAULT_LABEL if policy == DEFAULT_POLICY else policy


def run_all(policies: Sequence[str], seeds: Sequence[int], *, cluster: Cluster | None = None,
            margin: float = 0.0, workloads: dict[int, Workload] | None = None,
            reservation_ttl_s: float = DEFAULT_TTL_S, mig_dynamic: frozenset[str] = frozenset(),
            devices: DeviceChoice | None = None) -> list[Result]:
    """Every policy on every seed; each seed's workload is generated once and shared. ``mig_dynamic``:
    the MIG products whose free slots are re-cut for Pending pods (empty: the static layouts).
    ``devices``: who picks each pod's device (``--device-choice``; default: the extender, as today)."""
    cluster = cluster or build_cluster()
    results: list[Result] = []
    for seed in seeds:
        workload = (workloads or {}).get(seed) or generate(seed)
        for policy in policies:
            results.append(replay(cluster, workload, policy, margin=margin, reservation_ttl_s=reservation_ttl_s,
                                  mig_dynamic=mig_dynamic, devices=devices))
    return results


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def summarise(results: Sequence[Result]) -> list[dict[str, Any]]:
    """One row per policy (in first-seen order): means over seeds and the pooled top reasons."""
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(r.policy, []).append(r)
    rows: list[dict[str, Any]] = []
    for policy, rs in groups.items():
        reasons: Counter[str] = Counter()
        for r in rs:
            reasons.update(r.reasons)
        rows.append({
            "policy": policy, "seeds": [r.seed for r in rs],
            "placed": _mean([r.pods_placed for r in rs]), "pending": _mean([r.pods_pending for r in rs]),
            "never": _mean([r.pods_never_placed for r in rs]), "pend-h": _mean([r.pending_pod_hours for r in rs]),
            "GPUs avg": _mean([r.gpus_in_use_avg for r in rs]), "GPUs peak": _mean([r.gpus_in_use_peak for r in rs]),
            "frag %": _mean([r.fragmentation_pct for r in rs]), "$/h avg": _mean([r.cost_per_hour for r in rs]),
            "$/h peak": _mean([r.cost_peak for r in rs]), "created": _mean([r.pods_created for r in rs]),
            "wall_s": sum(r.wall_s for r in rs), "leaked_slices": sum(r.leaked_slices for r in rs),
            "top_reasons": reasons.most_common(3),
        })
    return rows


def render(rows: Sequence[dict[str, Any]], *, cluster: Cluster, seeds: Sequence[int]) -> str:
    """The readable table, the reasons per policy, what the columns mean and how to read them."""
    first = max([34, *(len(label(r["policy"])) for r in rows)])  # the default's label names its mix
    widths = (first, 7, 7, 6, 7, 8, 9, 6, 8, 8)
    lines = [
        f"built-in LLM-serving day: {len(cluster.nodes)} nodes, {cluster.gpu_count} GPUs "
        f"(${cluster.hourly_cost():,.0f}/h if all kept up), seeds {_seed_text(seeds)}"
        + (f", {rows[0]['created']:.0f} pods created per day (mean)" if rows else ""),
        "  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(COLUMNS, widths,
                                                                                      strict=True))),
    ]
    fmt = (f"{{:<{first}}}", "{:>7.1f}", "{:>7.1f}", "{:>6.1f}", "{:>7.1f}", "{:>8.1f}", "{:>9.1f}", "{:>6.1f}",
           "{:>8.0f}", "{:>8.0f}")
    for row in rows:
        shown = {**row, "policy": label(row["policy"])}
        lines.append("  ".join(f.format(shown[c]) for f, c in zip(fmt, COLUMNS, strict=True)))
    lines.append("")
    lines.append("Pending for lack of a fitting slice, top reasons (pods, summed over seeds):")
    for row in rows:
        if not row["top_reasons"]:
            lines.append(f"  {label(row['policy'])}: none")
            continue
        lines.append(f"  {label(row['policy'])}:")
        lines.extend(f"    {n:>5}  {text}" for text, n in row["top_reasons"])
    lines.append("")
    lines.append(BUILTIN_LEGEND)
    lines.append("")
    lines.append(reading_note(seeds))
    return "\n".join(lines)


def reading_note(seeds: Sequence[int]) -> str:
    """How to read the table for one's own cluster: trade-offs, and how far one seed can be trusted."""
    lines = ["Fewer pending pods, fewer GPUs in use, lower frag % and lower $/h are better, but they can pull",
             "against each other: choose the policy whose trade-off suits your cluster."]
    if len(seeds) == 1:
        lines += ["This is one seed, one simulated day: gaps of a few pods or GPUs between policies may be",
                  "chance; add --seeds 42-51 to compare means over ten days."]
    return "\n".join(lines)


def bar_verdict(rows: Sequence[dict[str, Any]]) -> str:
    """Whether the default mix beats every bar baseline on pending, GPUs in use and $/hour; our own
    single policies, when shown, are reported apart (they are not the bar).

    A development check for ``bench/bench_builtin.py`` (ties count as not better): never printed by
    ``gpu-slice simulate``, whose users run their own cluster, not the project's benchmark."""
    ours = next((r for r in rows if r["policy"] == DEFAULT_POLICY), None)
    if ours is None:
        return ""
    lines: list[str] = []
    for group, title in ((BAR_BASELINES, "bar"), (OWN_POLICIES, "own single policies")):
        others = [r for r in rows if r["policy"] in group and r["policy"] != DEFAULT_POLICY]
        if not others:
            continue
        lost = [f"{r['policy']} ({c}: {r[c]:.1f} vs {ours[c]:.1f})" for r in others
                for c in ("pending", "GPUs avg", "$/h avg") if r[c] <= ours[c]]
        if title == "bar":
            lines.append(f"bar met: {DEFAULT_LABEL} has fewer Pending pods, fewer GPUs in use and lower $/h "
                         "than every baseline" if not lost else
                         f"bar NOT met: {DEFAULT_LABEL} is not strictly better than " + "; ".join(lost))
        else:
            lines.append(f"vs {title}: " + ("strictly better on all three" if not lost else
                                            "not strictly better than " + "; ".join(lost)))
    return "\n".join(lines)


def recut_note(results: Sequence[Result], dynamic: frozenset[str]) -> str:
    """What dynamic MIG layouts did: pods that waited for a re-cut instead of going Pending, per policy."""
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(r.policy, []).append(r)
    lines = [f"Dynamic MIG layouts ({', '.join(sorted(dynamic))}): a pod refused for shape waits "
             f"{RECUT_WAIT_S:g} s for a re-cut of free MIG slots (simulator.miglayouts.RECUT_WAIT_S) and is not "
             "counted Pending; per policy, means over seeds:"]
    for policy, rs in groups.items():
        lines.append(f"  {label(policy)}: {_mean([r.pods_recut for r in rs]):.1f} pods waited for a re-cut, "
                     f"{_mean([r.recuts for r in rs]):.1f} re-cuts, "
                     f"{sum(r.busy_instances_destroyed for r in rs)} running or reserved instances destroyed")
    return "\n".join(lines)


def _seed_text(seeds: Sequence[int]) -> str:
    s = list(seeds)
    if len(s) > 2 and s == list(range(s[0], s[-1] + 1)):
        return f"{s[0]}-{s[-1]}"
    return ",".join(map(str, s))


def plot_figure(results: Sequence[Result]) -> Any:
    """GPUs in use and $/h over the day: one colour per policy, one line per seed (a matplotlib Figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted({r.seed for r in results})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    policies = list(dict.fromkeys(r.policy for r in results))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    labelled: set[str] = set()
    for r in results:
        colour = colours[policies.index(r.policy) % len(colours)]
        hours = [p[0] for p in r.series]
        label = None if r.policy in labelled else r.policy
        labelled.add(r.policy)
        style = {"color": colour, "linewidth": 1.0 if len(seeds) > 1 else 1.5, "alpha": 0.7 if len(seeds) > 1 else 1}
        ax1.plot(hours, [p[1] for p in r.series], label=label, **style)
        ax2.plot(hours, [p[2] for p in r.series], **style)
    ax1.set_ylabel("GPUs in use")
    ax2.set_ylabel("$/hour of nodes in use")
    ax2.set_xlabel("hour of the simulated day")
    ax1.legend(fontsize=7, ncol=3)
    which = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))} (one line each)"
    ax1.set_title(f"built-in LLM-serving day, {which}")
    fig.tight_layout()
    return fig


def write_plot(path: Path, results: Sequence[Result]) -> None:
    """:func:`plot_figure`, written to ``path``."""
    import matplotlib.pyplot as plt

    fig = plot_figure(results)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Entry point from ``simulator.cli.run`` when no trace is given; 2 on a bad policy or output path."""
    out = out or sys.stdout
    policies = policies_from(getattr(args, "policy", None))
    seeds = list(getattr(args, "seeds", None) or [42])
    margin = float(getattr(args, "narrow_margin", 0.0) or 0.0)
    config = getattr(args, "config_obj", None)
    ttl = config.reservation_ttl_seconds if config is not None else DEFAULT_TTL_S
    devices: DeviceChoice | None = getattr(args, "devices", None)
    started = time.perf_counter()
    try:
        for policy in policies:  # unknown names and bad weights before the first run, not after some
            resolve(policy)
        present = {g.product for n in build_cluster().nodes for g in n.inventory.gpus if g.mode == "mig"}
        dynamic = dynamic_products(getattr(args, "mig_layouts", None), config) & present
        refuse_dynamic_with_dra(dynamic, devices)
        results = run_all(policies, seeds, margin=margin, reservation_ttl_s=ttl, mig_dynamic=dynamic,
                          devices=devices)
    except GpuSliceError as err:
        print(f"gpu-slice simulate: {err}", file=sys.stderr)
        return 2
    cluster = build_cluster()
    rows = summarise(results)
    if devices is not None and devices.kind != "free":
        print(f"device choice: {devices.label}", file=out)
    print(render(rows, cluster=cluster, seeds=seeds), file=out)
    if dynamic:
        print(f"\n{recut_note(results, dynamic)}", file=out)
    print(f"\n{len(results)} runs in {time.perf_counter() - started:.1f} s", file=out)
    json_path = getattr(args, "json", None)
    plot_path = getattr(args, "plot", None)
    flag = ""
    try:
        if json_path:
            flag = f"--json {json_path}"
            doc = {"scenario": "builtin-llm", "nodes": len(cluster.nodes), "gpus": cluster.gpu_count,
                   "device_choice": (devices or DeviceChoice()).label,
                   "definitions": __doc__, "summary": rows, "runs": [r.as_dict() for r in results]}
            text = json.dumps(doc, indent=2, default=str)
            if str(json_path) == "-":
                print(text, file=out)
            else:
                Path(json_path).write_text(text + "\n")
        if plot_path:
            flag = f"--plot {plot_path}"
            write_plot(Path(plot_path), results)
    except OSError as err:  # the CLI checked the paths up front; this is the disk filling up or the like
        print(f"gpu-slice simulate: {flag}: cannot write: {err.strerror or err}", file=sys.stderr)
        return 2
    return 0
