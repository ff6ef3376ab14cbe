"""Right-sizing advice: the smaller slice a pod's measured peaks fit, and what the cluster would free.

One rule (:func:`advise`) decides for one pod from its holding (product, mode, slices, what its slice
gives) and its peaks over a window (the most GPU memory it used and the highest activity of its
slice). Both peaks are raised by a *headroom* before anything is compared: a pod is told to shrink
only to a slice that holds ``peak * (1 + headroom)`` of memory and of compute.

* **Compute**: activity is the ratio (0..1) of time the pod's own slice was busy, the higher of
  graphics-engine and memory-bandwidth activity (LLM decoding is bandwidth-bound). A k-slice MIG
  instance busy ``a`` of the time does ``a * k`` slices' worth of work, so it needs
  ``ceil(a * k * (1 + headroom))`` slices. MIG is the one mode where the hardware reports a pod's own
  activity; an MPS pod's is never the GPU's activity divided by its share, so without it an MPS pod
  is advised on memory alone only where its slices cap nothing but memory (``mpsLimits:
  memory-only``); under ``memory-and-threads`` a smaller share also caps its SMs, and no advice is
  given.
* **Memory**: a MIG profile of the same product whose memory holds the peak with headroom, or an MPS
  share (:func:`gpuslice.rules.mps_share_mib`, the rule the packer and the daemon's cap use).
* The smallest such slice (fewest compute slices, then least memory) smaller than the current one
  is advised; none means the pod is sized right. Where the pod's own memory floor
  (``example.com/gpu-memory``) would not pass on the smaller slice, the floor to ask instead is said
  too (the peak with headroom), since the extender would otherwise refuse the smaller pod.

Whole-GPU pods are not advised: their next size down is a different mode, a move the pod's owner
decides. :func:`advise_cluster` applies the rule to every pod a :class:`gpuslice.status.ClusterStatus`
lists as holding slices, and sums what would be freed per product. The peaks come from outside the
core (``gpu-slice status --prometheus-url`` queries them); nothing here reads a clock or the network.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from gpuslice.catalogue import PRODUCTS
from gpuslice.errors import AdviceError
from gpuslice.rules import DEFAULT_MEMORY_TOLERANCE, memory_fits, mps_share_mib
from gpuslice.status import ClusterStatus
from gpuslice.units import format_mib

DEFAULT_HEADROOM = 0.2
#: A pod is advised only on figures that cover this part of the window: a server that started ten
#: minutes ago may still be loading its model, using little memory and no compute.
DEFAULT_MIN_COVERAGE = 0.9
MpsLimits = Literal["memory-and-threads", "memory-only"]


@dataclass(frozen=True, slots=True)
class Peak:
    """A pod's highest figures over the window; ``None`` where nothing measured them. ``observed_s``:
    how long before the window's end its figures start (``None``: the whole window)."""

    memory_mib: float | None
    activity: float | None = None
    observed_s: float | None = None


@dataclass(frozen=True, slots=True)
class Holding:
    """What a pod holds now: ``slices`` of one MIG instance (``profile``) or one MPS GPU cut into
    ``slices_per_gpu``, on a GPU of ``product`` with ``gpu_memory_mib``; ``floor_mib`` is the pod's
    own memory floor (None: it asked none)."""

    product: str
    mode: str
    slices: int
    gpu_memory_mib: int
    slices_per_gpu: int
    profile: str = ""
    floor_mib: float | None = None


@dataclass(frozen=True, slots=True)
class Advice:
    """The rule's answer for one pod. ``advised`` False: ``why`` says why not (sized right, or not
    measured). Otherwise ``slices`` (and ``profile`` on MIG) is the smaller slice, ``memory_mib`` what
    it gives, ``frees`` the slices given back, and ``floor_mib`` the memory floor to ask instead
    (0: the pod's floor passes as it is)."""

    advised: bool
    why: str
    slices: int = 0
    profile: str = ""
    memory_mib: int = 0
    frees: int = 0
    floor_mib: int = 0


def _check(peak: Peak, headroom: float) -> None:
    if not (math.isfinite(headroom) and 0 <= headroom <= 10):
        raise AdviceError(f"headroom must be a ratio between 0 and 10 (0.2 = 20 %), got {headroom!r}")
    if peak.memory_mib is not None and not (math.isfinite(peak.memory_mib) and peak.memory_mib >= 0):
        raise AdviceError(f"peak memory must be a non-negative number of MiB, got {peak.memory_mib!r}")
    # A small excess over 1 is a sampling artefact of a busy slice; more is a series in percent.
    if peak.activity is not None and not (math.isfinite(peak.activity) and 0 <= peak.activity <= 1.01):
        raise AdviceError(f"peak activity must be a ratio between 0 and 1, got {peak.activity!r}")


def _compute_need(holding: Holding, peak: Peak, headroom: float, mps_limits: MpsLimits) -> int | str:
    """Slices of compute the pod needs, or why that cannot be told."""
    if peak.activity is not None:
        return max(1, math.ceil(min(peak.activity, 1.0) * holding.slices * (1 + headroom) - 1e-9))
    if holding.mode == "mps" and mps_limits == "memory-only":
        return 1  # its slices cap only memory: compute is shared, whatever its share
    if holding.mode == "mps":
        return ("MPS reports no per-pod activity, and under mpsLimits memory-and-threads a smaller share "
                "also caps the pod's SMs")
    return "its MIG instance's activity is not measured (NVML reports it on Hopper and later GPUs)"


def advise(holding: Holding, peak: Peak, *, headroom: float = DEFAULT_HEADROOM,
           tolerance: float = DEFAULT_MEMORY_TOLERANCE, mps_limits: MpsLimits = "memory-and-threads") -> Advice:
    """The smallest slice smaller than the pod's that holds its peaks with ``headroom`` (see the module)."""
    _check(peak, headroom)
    if holding.mode not in ("mig", "mps"):
        return Advice(False, "whole-GPU pods are not advised (a smaller slice is another mode)")
    if peak.memory_mib is None:
        return Advice(False, "its GPU memory use is not measured")
    need = _compute_need(holding, peak, headroom, mps_limits)
    if isinstance(need, str):
        return Advice(False, need)
    memory = peak.memory_mib * (1 + headroom)
    k = holding.slices
    best: tuple[int, int, str] | None = None  # (slices, memory, profile)
    if holding.mode == "mig":
        prod = PRODUCTS.get(holding.product)
        for p in prod.mig_profiles if prod is not None else ():
            if need <= p.compute_slices < k and p.memory_mib >= memory and not p.name.endswith("+me"):
                cand = (p.compute_slices, p.memory_mib, p.name)
                best = cand if best is None or cand < best else best
    else:
        for j in range(need, k):
            share = mps_share_mib(holding.gpu_memory_mib, j, holding.slices_per_gpu)
            if share >= memory:
                best = (j, share, "")
                break
    peaks = (f"peak {format_mib(peak.memory_mib)}"
             + (f" and {peak.activity:.0%} activity" if peak.activity is not None else "")
             + f" with {headroom:.0%} headroom")
    if best is None:
        return Advice(False, f"sized right: no smaller slice holds its {peaks}")
    slices, mem, profile = best
    floor = 0
    if holding.floor_mib is not None and not memory_fits(mem, holding.floor_mib, tolerance):
        floor = math.ceil(memory)
    what = f"{slices} slice{'s' if slices > 1 else ''}" + (f" ({profile})" if profile else "")
    why = f"{what} would hold its {peaks}; frees {k - slices} of {k}"
    if floor:
        why += f"; lower example.com/gpu-memory to {floor}Mi"
    return Advice(True, why, slices, profile, mem, k - slices, floor)


# --------------------------------------------------------------------------- the cluster

@dataclass(frozen=True, slots=True)
class PodAdvice:
    """One pod holding slices: where, what it holds, its peaks, and the rule's answer."""

    pod: str  # namespace/name
    uid: str
    node: str
    gpu: str
    unit: str  # MIG instance or GPU uuid
    product: str
    mode: str
    slices: int
    profile: str
    memory_mib: int  # what its slice gives now
    peak_memory_mib: float | None
    peak_activity: float | None
    advice: Advice


@dataclass(frozen=True, slots=True)
class Freed:
    """Slices the advice would give back on GPUs of one product and mode (``gpus``: the same in
    whole GPUs, slices / the GPU's slice count)."""

    product: str
    mode: str
    slices: int
    gpus: float


@dataclass(frozen=True, slots=True)
class ClusterAdvice:
    """Every pod holding slices with its advice, and the totals freed (``available`` False: no
    measurements were given, ``why`` says what to do)."""

    available: bool
    why: str = ""
    window_s: float = 0.0
    headroom: float = DEFAULT_HEADROOM
    pods: tuple[PodAdvice, ...] = ()
    freed: tuple[Freed, ...] = field(default=())

    @property
    def advised(self) -> tuple[PodAdvice, ...]:
        return tuple(p for p in self.pods if p.advice.advised)


def unavailable(why: str) -> ClusterAdvice:
    """Advice that could not be worked out, and why (say how to get it)."""
    return ClusterAdvice(False, why)


def duration(seconds: float) -> str:
    """``90`` -> ``1m30s``, ``3600`` -> ``1h`` (as Prometheus writes a range)."""
    left = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size:
            parts.append(f"{left // size}{unit}")
            left %= size
    return "".join(parts) or "0s"


def advise_cluster(status: ClusterStatus, peaks: Mapping[str, Peak], floors: Mapping[str, float | None], *,
                   window_s: float, headroom: float = DEFAULT_HEADROOM, tolerance: float = DEFAULT_MEMORY_TOLERANCE,
                   mps_limits: MpsLimits = "memory-and-threads",
                   min_coverage: float = DEFAULT_MIN_COVERAGE) -> ClusterAdvice:
    """The rule for every pod ``status`` lists as holding slices (not filter-time reservations), by
    pod UID: ``peaks`` its measured peaks (a pod with none has no figures in the window), ``floors``
    its memory floor. A pod spread over several units (whole GPUs) is listed once, not advised; a pod
    whose figures cover less than ``min_coverage`` of the window is not advised either."""
    window = duration(window_s)
    seen: dict[str, int] = {}
    rows: list[PodAdvice] = []
    for node in status.nodes:
        for gpu in node.gpus:
            for unit in gpu.units:
                for h in unit.holders:
                    if h.source == "reserved":
                        continue
                    if h.uid in seen:
                        continue
                    seen[h.uid] = len(rows)
                    holding = Holding(gpu.product, gpu.mode, h.slices, gpu.memory_mib, gpu.slices, unit.profile,
                                      floors.get(h.uid))
                    peak = peaks.get(h.uid, Peak(None))
                    mem = unit.memory_mib if gpu.mode != "mps" else mps_share_mib(gpu.memory_mib, h.slices,
                                                                                  gpu.slices)
                    if h.uid not in peaks:
                        advice = Advice(False, f"no figures for this pod over the last {window}")
                    elif peak.observed_s is not None and peak.observed_s < min_coverage * window_s:
                        advice = Advice(False, f"measured for only {duration(peak.observed_s)} of the last {window}")
                    else:
                        try:
                            advice = advise(holding, peak, headroom=headroom, tolerance=tolerance,
                                            mps_limits=mps_limits)
                        except AdviceError as err:
                            advice = Advice(False, f"its figures cannot be used: {err}")
                    rows.append(PodAdvice(h.pod, h.uid, node.name, gpu.uuid, unit.uuid, gpu.product, gpu.mode,
                                          h.slices, unit.profile, mem, peak.memory_mib, peak.activity, advice))
    totals: dict[tuple[str, str], list[float]] = {}
    # a GPU's worth: every compute slice of its product under MIG (a layout may leave some unused), S otherwise
    per_gpu = {(n.name, g.uuid): (PRODUCTS[g.product].compute_slices if g.mode == "mig" and g.product in PRODUCTS
                                  else g.slices) for n in status.nodes for g in n.gpus}
    for row in rows:
        if row.advice.advised:
            t = totals.setdefault((row.product, row.mode), [0, 0.0])
            t[0] += row.advice.frees
            t[1] += row.advice.frees / max(per_gpu.get((row.node, row.gpu), 1), 1)
    freed = tuple(Freed(p, m, int(t[0]), round(t[1], 2)) for (p, m), t in sorted(totals.items()))
    return ClusterAdvice(True, "", window_s, headroom, tuple(rows), freed)


__all__ = ["DEFAULT_HEADROOM", "DEFAULT_MIN_COVERAGE", "Advice", "ClusterAdvice", "Freed", "Holding", "Peak",
           "PodAdvice", "advise", "advise_cluster", "duration", "unavailable"]
