"""``gpu-slice status``: every GPU and its slices, free and stranded capacity, disagreements between
assignment and ``allocated``, and each Pending slice pod with its reason and the smallest change
that lets it in.

It reads the live cluster (``--kubeconfig``; else the in-cluster service account in a pod, else the
kubeconfig kubectl would use) or a dump
(``--cluster FILE``: ``kubectl get nodes,pods -A -o yaml``, or ``gpu-slice fake-cluster`` output),
builds the extender's own view and decision API over it (:mod:`gpuslice.status`) and prints tables
as kubectl does, or ``-o json|yaml``. It only reads: nothing is reserved, bound or written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from gpuslice.config import Config, default_config, load_config_text
from gpuslice.errors import GpuSliceError
from gpuslice.status import ClusterStatus, GpuStatus, PendingPod, UnitStatus
from gpuslice_cli.tables import table

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


def collect(items: Any, config: Config, now: float) -> ClusterStatus:
    """The status of nodes and pods given as v1 mappings, decided by the extender's own code."""
    from gpuslice.scheduler import Scheduler
    from gpuslice.status import build_status
    from gpuslice.view import ClusterView

    view = ClusterView.from_objects(items, now, config=config)
    return build_status(view, Scheduler.from_config(view, config), now)


# --------------------------------------------------------------------------- printing

def _unit_name(g: GpuStatus, u: UnitStatus) -> str:
    return f"{u.profile}@{u.start}" if u.profile else "-"


def _pods(u: UnitStatus) -> str:
    return ",".join(f"{h.pod}({h.slices})" if h.source != "reserved" else f"{h.pod}({h.slices},reserved)"
                    for h in u.holders)


def render(st: ClusterStatus, output: str = "table") -> str:
    """The status as text: kubectl-style tables (``table``/``wide``), JSON or YAML."""
    if output == "json":
        return json.dumps(st.to_dict(), indent=2, sort_keys=False)
    if output == "yaml":
        import yaml

        return str(yaml.safe_dump(st.to_dict(), sort_keys=False))
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
    if st.problems:
        parts.append(table(["problem"], [[p] for p in st.problems]))
    return "\n\n".join(parts)


def _short(p: PendingPod) -> str:
    """The most common node reason alone (``wide`` prints them all)."""
    if not p.reason.startswith("0/") or not p.reasons:
        return p.reason
    text, n = next(iter(p.reasons.items()))
    more = len(p.reasons) - 1
    return (f"0/{sum(p.reasons.values())} nodes: {n} x {text}"
            + (f" (+{more} other reason{'s' if more > 1 else ''})" if more else ""))


def run(args: argparse.Namespace) -> int:
    try:
        config = _config(args.config)
        now = time.time()
        items: Any = _file_items(args.cluster) if args.cluster else live_items(args.kubeconfig)
        st = collect(items, config, now)
    except GpuSliceError as err:
        print(f"gpu-slice status: {err}", file=sys.stderr)
        return 2
    print(render(st, args.output))
    return 0
