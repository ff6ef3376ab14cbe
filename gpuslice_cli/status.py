"""``gpu-slice status``: every GPU and its slices, free and stranded capacity, disagreements between
assignment and ``allocated``, and each Pending slice pod with its reason and the smallest change
that lets it in.

It reads the live cluster (``--kubeconfig``; else the in-cluster service account in a pod, else the
kubeconfig kubectl would use) or a dump
(``--cluster FILE``: ``kubectl get nodes,pods -A -o yaml``, or ``gpu-slice fake-cluster`` output),
builds the extender's own view and decision API over it (:mod:`gpuslice.status`) and prints tables
as kubectl does, or ``-o json|yaml``. It only reads: nothing is reserved, bound or written.

With ``--prometheus-url`` it adds right-sizing advice: each pod's peak memory and activity over
``--window`` from the device plugins' per-pod series (:mod:`gpuslice_cli.advice`), judged by the
core's rule (:mod:`gpuslice.advice`), and what the cluster would free. Without it, or when
Prometheus cannot answer, the output says advice is unavailable and why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuslice.advice import DEFAULT_HEADROOM, DEFAULT_MIN_COVERAGE, ClusterAdvice, duration, unavailable
from gpuslice.config import Config, default_config, load_config_text
from gpuslice.errors import GpuSliceError
from gpuslice.miglayout import LayoutStatus, layout_status_of_nodes
from gpuslice.status import ClusterStatus, GpuStatus, PendingPod, UnitStatus
from gpuslice.units import format_mib
from gpuslice_cli.tables import table

if TYPE_CHECKING:
    from gpuslice.view import ClusterView

OUTPUTS = ("table", "wide", "json", "yaml")


class StatusError(GpuSliceError):
    """A flag, file or cluster read that stops the command; the message says which."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--kubeconfig", help="kubeconfig file (default: the in-cluster service account inside a pod, "
                                          "else $KUBECONFIG or ~/.kube/config, as kubectl)")
    src.add_argument("--cluster", help="a v1 List of nodes and pods instead of the live cluster "
                                       "(kubectl get nodes,pods -A -o yaml; gpu-slice fake-cluster output)")
    parser.add_argument("--config", help="the versioned config the services run with (S, memory tolerance, "
                                         "policies); default: the built-in defaults")
    parser.add_argument("-o", "--output", default="table", choices=OUTPUTS,
                        help="table (default), wide (full UUIDs and every suggestion), json or yaml")
    parser.add_argument("--prometheus-url", help="the Prometheus that scrapes the device plugins: adds right-sizing "
                                                 "advice from their per-pod series (without it advice is unavailable)")
    parser.add_argument("--window", default="1h", help="how far back the advice looks at each pod's peaks "
                                                       "(a duration: 1h, 30m, 1d; default 1h)")
    parser.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                        help=f"how much above its peaks a smaller slice must hold (default {DEFAULT_HEADROOM}: 20 %%)")


def _config(path: str | None) -> Config:
    if not path:
        return default_config()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise StatusError(f"--config {path}: cannot read: {err}") from None
    return load_config_text(text)


def _file_items(path: str) -> Iterator[Mapping[str, Any]]:
    from gpuslice.kubelist import iter_list_items

    try:
        with open(path, encoding="utf-8") as stream:
            yield from iter_list_items(stream)
    except (OSError, UnicodeDecodeError) as err:
        raise StatusError(f"--cluster {path}: cannot read: {err}") from None
    except GpuSliceError as err:
        raise StatusError(f"--cluster {path}: {err}") from None


def live_items(kubeconfig: str | None) -> list[Mapping[str, Any]]:
    """Every node and pod of the cluster, as plain v1 mappings with their ``kind``."""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    conf = client.Configuration()
    incluster = not kubeconfig and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    try:
        if incluster:
            config.load_incluster_config(client_configuration=conf)  # type: ignore[no-untyped-call]
        else:  # kubectl's lookup: the file given, else $KUBECONFIG, else ~/.kube/config
            config.load_kube_config(config_file=kubeconfig, client_configuration=conf)  # type: ignore[no-untyped-call]
    except (config.ConfigException, OSError) as err:
        where = kubeconfig or ("the in-cluster service account" if incluster else "the default kubeconfig")
        raise StatusError(f"cannot use {where}: {err} (give --kubeconfig or --cluster)") from None
    api = client.ApiClient(conf)
    core = client.CoreV1Api(api)
    out: list[Mapping[str, Any]] = []
    try:
        calls: tuple[tuple[str, Any], ...] = (("Node", core.list_node), ("Pod", core.list_pod_for_all_namespaces))
        for kind, call in calls:
            resp = call(_preload_content=False, _request_timeout=60)
            try:
                items = json.loads(resp.data)["items"]
            finally:
                resp.release_conn()
            out += [{**item, "kind": kind} for item in items]
    except ApiException as err:
        raise StatusError(f"cannot list nodes and pods: {err.status} {err.reason}: {str(err.body)[:300]}") from None
    except OSError as err:  # urllib3 wraps connection failures in OSError subclasses
        raise StatusError(f"cannot reach the API server: {err}") from None
    finally:
        api.close()  # type: ignore[no-untyped-call]
    return out


def build(items: Any, config: Config, now: float) -> tuple[ClusterView, ClusterStatus]:
    """The view of nodes and pods given as v1 mappings, and its status, decided by the extender's own code."""
    from gpuslice.scheduler import Scheduler
    from gpuslice.status import build_status
    from gpuslice.view import ClusterView

    view = ClusterView.from_objects(items, now, config=config)
    return view, build_status(view, Scheduler.from_config(view, config), now)


def collect(items: Any, config: Config, now: float) -> ClusterStatus:
    """The status of nodes and pods given as v1 mappings, decided by the extender's own code."""
    return build(items, config, now)[1]


def advise(view: ClusterView, st: ClusterStatus, config: Config, now: float, *, url: str | None, window_s: float,
           headroom: float) -> ClusterAdvice:
    """Right-sizing advice from the per-pod series in Prometheus, or why it is unavailable."""
    from gpuslice.advice import advise_cluster
    from gpuslice_cli.advice import PrometheusError, fetch_peaks

    if not url:
        return unavailable("no --prometheus-url given: advice needs the device plugins' per-pod series")
    try:
        peaks = fetch_peaks(url, window_s, now)
    except PrometheusError as err:
        return unavailable(f"{url}: {err}")
    floors: dict[str, float | None] = {}
    for uid in {h.uid for n in st.nodes for g in n.gpus for u in g.units for h in u.holders}:
        info = view.pod(uid)
        req = info.request if info is not None else None
        floors[uid] = float(req.memory_mib) if req is not None and req.memory_mib is not None else None
    return advise_cluster(st, peaks, floors, window_s=window_s, headroom=headroom, tolerance=config.memory_tolerance,
                          mps_limits=config.mps_limits, min_coverage=DEFAULT_MIN_COVERAGE)


# --------------------------------------------------------------------------- printing

def _unit_name(g: GpuStatus, u: UnitStatus) -> str:
    return f"{u.profile}@{u.start}" if u.profile else "-"


def _pods(u: UnitStatus) -> str:
    return ",".join(f"{h.pod}({h.slices})" if h.source != "reserved" else f"{h.pod}({h.slices},reserved)"
                    for h in u.holders)


def render(st: ClusterStatus, output: str = "table", advice: ClusterAdvice | None = None,
           layouts: Sequence[LayoutStatus] = ()) -> str:
    """The status as text: kubectl-style tables (``table``/``wide``), JSON or YAML; with ``advice``,
    its table (or its ``advice`` key); with ``layouts``, each MIG GPU's actual and wanted layout
    (``migLayouts``)."""
    if output in ("json", "yaml"):
        data = st.to_dict()
        if layouts:
            data["migLayouts"] = [asdict(x) for x in layouts]
        if advice is not None:
            data["advice"] = asdict(advice)
        if output == "json":
            return json.dumps(data, indent=2, sort_keys=False)
        import yaml

        return str(yaml.safe_dump(data, sort_keys=False))
    wide = output == "wide"
    parts: list[str] = []
    headers = ["node", "gpu", "product", "mode", "instance", "slices", "free", "stranded", "pods"]
    if wide:
        headers.insert(5, "uuid")
    rows: list[list[object]] = []
    for n in st.nodes:
        if n.error:
            rows.append([n.name, "-", n.product or "-", "-", "-", *(["-"] if wide else []), 0, 0, 0,
                         f"node unusable: {n.error}"])
        for g in n.gpus:
            state = "" if g.healthy and not g.cordoned else ("(unhealthy)" if not g.healthy else "(cordoned)")
            for u in sorted(g.units, key=lambda x: x.start):
                row: list[object] = [n.name, g.index, g.product, g.mode + state, _unit_name(g, u), u.slices,
                                     u.free, u.stranded, _pods(u)]
                if wide:
                    row.insert(5, u.uuid)
                rows.append(row)
    parts.append(table(headers, rows) if rows else "No GPU nodes with slices found.")
    c = st.capacity
    parts.append(table(["gpus", "slices", "held", "free", "stranded", "unavailable", "shapes"],
                       [[c.gpus, c.slices, c.held, c.free, c.stranded, c.unavailable, c.shapes]]))
    if st.pending:
        prow = []
        for p in st.pending:
            sug = (" | ".join(s.text for s in p.suggestions) if wide else
                   (p.suggestions[0].text if p.suggestions else "-"))
            reason = p.reason if wide else _short(p)
            prow.append([p.pod, p.slices, p.memory or "-", p.isolation or "-", p.priority, reason, sug])
        parts.append(table(["pending pod", "slices", "memory", "isolation", "priority", "reason", "suggestion"],
                           prow))
    if st.disagreements:
        parts.append(table(["pod", "node", "assigned", "allocated"],
                           [[d.pod, d.node, ",".join(d.assigned), ",".join(d.allocated)] for d in st.disagreements]))
    if layouts:
        parts.append(render_layouts(layouts))
    if st.problems:
        parts.append(table(["problem"], [[p] for p in st.problems]))
    if advice is not None:
        parts.append(render_advice(advice, wide))
    return "\n\n".join(parts)


def _slots(layout: Sequence[tuple[str, int]] | None) -> str:
    return ",".join(f"{p}@{s}" for p, s in layout) if layout else "-"


def render_layouts(layouts: Sequence[LayoutStatus]) -> str:
    """Each MIG GPU: whether its free slots follow demand, its layout now, the extender's wish, and why a
    re-cut is pending (or why the layout is static)."""
    rows = [[x.node, x.gpu, x.product, "dynamic" if x.dynamic else "static", _slots(x.actual),
             _slots(x.wanted) if x.wanted is not None else "-", x.pending or "-"] for x in layouts]
    return table(["node", "mig gpu", "product", "layout", "actual", "wanted", "pending re-cut"], rows)


def render_advice(advice: ClusterAdvice, wide: bool = False) -> str:
    """The advice table (advised pods; ``wide``: every pod with why) and one line of totals."""
    if not advice.available:
        return f"Right-sizing advice unavailable: {advice.why}"
    window = duration(advice.window_s)
    shown = advice.pods if wide else advice.advised
    lines = []
    if shown:
        rows = []
        for p in shown:
            now = f"{p.slices} ({p.profile})" if p.profile else str(p.slices)
            peak = "-" if p.peak_memory_mib is None else format_mib(p.peak_memory_mib)
            act = "-" if p.peak_activity is None else f"{p.peak_activity:.0%}"
            rows.append([p.pod, p.node, p.mode, now, format_mib(p.memory_mib), peak, act,
                         p.advice.why if wide or not p.advice.advised else _advised(p.advice.slices, p.advice.profile,
                                                                                   p.advice.frees, p.advice.floor_mib)])
        lines.append(table(["pod", "node", "mode", "slices", "memory", "peak memory", "peak activity",
                            "advice"], rows))
    freed = ", ".join(f"{f.slices} {f.mode} slice{'s' if f.slices != 1 else ''} of {f.product} ({f.gpus:g} GPU)"
                      for f in advice.freed)
    lines.append(f"{len(advice.advised)} of {len(advice.pods)} pods holding slices fit a smaller slice over the last "
                 f"{window} with {advice.headroom:.0%} headroom"
                 + (f"; resized, they would free {freed}" if freed else ""))
    return "\n".join(lines)


def _advised(slices: int, profile: str, frees: int, floor_mib: int) -> str:
    text = f"{slices} slice{'s' if slices > 1 else ''}" + (f" ({profile})" if profile else "") + f", frees {frees}"
    return text + (f"; example.com/gpu-memory: {floor_mib}Mi" if floor_mib else "")


def _short(p: PendingPod) -> str:
    """The most common node reason alone (``wide`` prints them all)."""
    if not p.reason.startswith("0/") or not p.reasons:
        return p.reason
    text, n = next(iter(p.reasons.items()))
    more = len(p.reasons) - 1
    return (f"0/{sum(p.reasons.values())} nodes: {n} x {text}"
            + (f" (+{more} other reason{'s' if more > 1 else ''})" if more else ""))


def run(args: argparse.Namespace) -> int:
    from gpuslice_cli.advice import parse_window

    try:
        url = getattr(args, "prometheus_url", None)
        if url and not url.startswith(("http://", "https://")):
            raise StatusError(f"--prometheus-url must start with http:// or https://, got {url!r}")
        window_s = parse_window(getattr(args, "window", "1h"))
        headroom = float(getattr(args, "headroom", DEFAULT_HEADROOM))
        if not 0 <= headroom <= 10:
            raise StatusError(f"--headroom must be a ratio between 0 and 10 (0.2 = 20 %), got {headroom}")
        config = _config(args.config)
        now = time.time()
        items: list[Mapping[str, Any]] = list(_file_items(args.cluster) if args.cluster else
                                              live_items(args.kubeconfig))
        view, st = build(items, config, now)
        layouts = layout_status_of_nodes((i for i in items if i.get("kind") == "Node"),
                                         config.dynamic_mig_products())
        advice = advise(view, st, config, now, url=url, window_s=window_s, headroom=headroom)
    except GpuSliceError as err:
        print(f"gpu-slice status: {err}", file=sys.stderr)
        return 2
    if url and not advice.available:
        print(f"gpu-slice status: right-sizing advice unavailable: {advice.why}", file=sys.stderr)
    print(render(st, args.output, advice, layouts))
    return 0
