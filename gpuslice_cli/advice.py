"""The Prometheus side of ``gpu-slice status --prometheus-url``: each pod's peaks over the window, read
from the device plugins' per-pod series (``deviceplugin.pod_series``), for the core's right-sizing
rule (:mod:`gpuslice.advice`).

Per pod (by its ``pod_uid`` label), at one evaluation time:

* peak memory: ``max_over_time(gpu_slice_pod_memory_used_bytes[W])``;
* peak activity: the higher of ``max_over_time`` of ``gpu_slice_pod_gpu_activity_ratio`` and
  ``gpu_slice_pod_memory_bandwidth_ratio`` (MIG pods; none for MPS pods);
* how long it has been measured: the earliest sample time of ``gpu_slice_pod_slices`` in the window
  (a subquery over ``timestamp()``, one point per 1 % of the window; a pod younger than one point has
  been measured for 0 s), so a pod that started within the window is not advised on a few quiet
  minutes.

Every failure (Prometheus unreachable, an HTTP error, an answer that is not Prometheus') raises
:class:`PrometheusError` naming the query; the status command then prints the status and says why
advice is unavailable.
"""

from __future__ import annotations

import math
import re
from typing import Any

import httpx

from gpuslice.advice import Peak
from gpuslice.errors import GpuSliceError

MEMORY = "gpu_slice_pod_memory_used_bytes"
ACTIVITY = ("gpu_slice_pod_gpu_activity_ratio", "gpu_slice_pod_memory_bandwidth_ratio")
PRESENCE = "gpu_slice_pod_slices"
_MIB = 1024 * 1024
_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")


class PrometheusError(GpuSliceError):
    """Prometheus could not answer a query; the message says which and why."""


def parse_window(text: str) -> float:
    """Seconds of a Prometheus-style duration (``1h``, ``90m``, ``1h30m``, ``3600s``, ``2d``), at least 10 s
    (it should span many scrapes: an hour or a day of serving is what a slice is sized for)."""
    found = _DURATION.fullmatch(text.strip()) if text else None
    if not found or not any(found.groups()):
        raise GpuSliceError(f"--window must be a duration such as 1h, 30m or 1h30m, got {text!r}")
    days, hours, minutes, seconds = (int(g or 0) for g in found.groups())
    total = days * 86400 + hours * 3600 + minutes * 60 + seconds
    if total < 10:
        raise GpuSliceError(f"--window must be at least 10s (several scrapes), got {text!r}")
    return float(total)


def _query(client: httpx.Client, promql: str, at: float) -> list[dict[str, Any]]:
    try:
        resp = client.get("/api/v1/query", params={"query": promql, "time": f"{at:.3f}"})
    except httpx.HTTPError as exc:
        raise PrometheusError(f"cannot reach Prometheus ({type(exc).__name__}: {exc})") from None
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("status") == "error":
        raise PrometheusError(f"Prometheus refused {promql!r}: {body.get('errorType')}: {str(body.get('error'))[:300]}")
    if resp.status_code != 200 or not isinstance(body, dict) or body.get("status") != "success":
        raise PrometheusError(f"Prometheus answered HTTP {resp.status_code} to {promql!r}, not a query result")
    data = body.get("data")
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, list):
        raise PrometheusError(f"Prometheus' answer to {promql!r} has no result list")
    return [r for r in result if isinstance(r, dict) and isinstance(r.get("metric"), dict)]


def _by_uid(rows: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for row in rows:
        uid = row["metric"].get("pod_uid")
        value = row.get("value")
        if not uid or not isinstance(value, list) or len(value) != 2:
            continue
        try:
            number = float(value[1])
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            out[str(uid)] = number
    return out


def fetch_peaks(url: str, window_s: float, at: float, *, timeout_s: float = 30.0,
                client: httpx.Client | None = None) -> dict[str, Peak]:
    """Pod UID -> its peaks over the ``window_s`` seconds before ``at`` (seconds since the epoch)."""
    window = f"{int(window_s)}s"
    step = f"{max(1, int(window_s // 100))}s"
    own = client is None
    http = client or httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s)
    try:
        memory = _by_uid(_query(http, f"max by (pod_uid) (max_over_time({MEMORY}[{window}]))", at))
        activity: dict[str, float] = {}
        for name in ACTIVITY:
            for uid, value in _by_uid(_query(http, f"max by (pod_uid) (max_over_time({name}[{window}]))", at)).items():
                activity[uid] = max(activity.get(uid, 0.0), value)
        first = _by_uid(_query(http, f"min by (pod_uid) (min_over_time(timestamp({PRESENCE})[{window}:{step}]))",
                               at))
    finally:
        if own:
            http.close()
    out: dict[str, Peak] = {}
    for uid in set(memory) | set(activity) | set(first):
        # No point of the subquery yet: the pod's series are younger than one step.
        observed = max(0.0, at - first[uid]) if uid in first else 0.0
        out[uid] = Peak(memory[uid] / _MIB if uid in memory else None, activity.get(uid), observed)
    return out
