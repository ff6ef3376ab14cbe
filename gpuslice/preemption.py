"""Preemption by kube-scheduler's rules, on slices: which lower-priority pods to evict, and where.

kube-scheduler (1.36, ``DefaultPreemption``) preempts only pods of lower priority, counts the
PodDisruptionBudgets each set of victims would break (``NumPDBViolations``), lists victims most
important first (``MoreImportantPod``: higher priority, then the earlier started) and picks the node by
``pickOneNodeForPreemption``: fewest PDB violations, then the lowest highest-victim priority, the
lowest sum of priorities, the fewest victims, the latest start of the highest-priority victims. Its
dry run only counts slices, so on our nodes the victims are chosen here, by shape:

* :func:`victims_on`: on one node, for every unit the pod could use once emptied (the state's own
  rule, :meth:`ClusterState.unit_accepts`), the pods that must leave: every holder of a MIG instance
  or whole GPU; on an MPS GPU the smallest set of holders whose slices make up the shortfall; the
  pod's own owner's pods on that GPU (the owner-spread rule); then, when the node is short of CPU or
  memory, the least important pods that free it. Of these placements the one with the fewest PDB
  violations, then the fewest victims, then the least important wins (DESIGN 4: the smallest set).
  ``allowed`` limits the victims (kube-scheduler's proposal); a pod holding what the placement needs
  that may not be evicted rules the placement out.
* :func:`pick_node`: kube-scheduler's choice among nodes, for the extender's own route (the shape-only
  shortfall kube-scheduler never asks about).

Times are the pods' creation times (the start time is not kept; the two differ by the scheduling delay).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import TYPE_CHECKING

import numpy as np

from gpuslice import ids
from gpuslice.disruption import Budget, violating
from gpuslice.errors import GpuSliceError
from gpuslice.packing.state import KIND_MPS, PackRequest
from gpuslice.pods import PodInfo

if TYPE_CHECKING:
    from gpuslice.view import ClusterView

#: An MPS GPU with more removable holders than this is searched greedily (largest first), not exactly.
MAX_EXACT_HOLDERS = 12
#: How long slices freed by the extender's own preemption stay held for the preemptor.
NOMINATION_TTL_S = 300.0
_NEWEST = "\uffff"  # a pod without a creation time sorts as the newest (kube: no start time is "now")
_OFFSET = 2**31  # kube-scheduler adds MaxInt32 + 1 to each priority before summing


def importance(p: PodInfo) -> tuple[int, str]:
    """Sort key, most important first: higher priority, then the older (``MoreImportantPod``)."""
    return (-p.priority, p.created or _NEWEST)


@dataclass(frozen=True, slots=True)
class NodeVictims:
    """The victims on one node (most important first), the PDB violations they make, and the unit
    rows and slice ids of the placement they free."""

    node: str
    victims: tuple[PodInfo, ...]
    violations: int
    units: tuple[int, ...]
    slice_ids: tuple[str, ...]

    def pick_key(self) -> tuple[int, int, int, int, str]:
        """kube-scheduler's ``pickOneNodeForPreemption`` order (lower is better), but the last tie."""
        top = self.victims[0].priority
        earliest = min(p.created or _NEWEST for p in self.victims if p.priority == top)
        latest_first = "".join(chr(0x10FFFF - ord(c)) for c in earliest)  # later start time wins
        return (self.violations, top, sum(p.priority + _OFFSET for p in self.victims), len(self.victims),
                latest_first)


def pick_node(options: Iterable[NodeVictims]) -> NodeVictims | None:
    """kube-scheduler's node among ``options``; on a full tie the first given wins."""
    best: NodeVictims | None = None
    for o in options:
        if best is None or o.pick_key() < best.pick_key():
            best = o
    return best


def _key(victims: Sequence[PodInfo], budgets: Sequence[Budget]) -> tuple[int, int, int, int]:
    ordered = sorted(victims, key=importance)
    return (len(violating(ordered, budgets)), len(ordered), max((p.priority for p in ordered), default=0),
            sum(p.priority for p in ordered))


def _cover(cands: list[tuple[PodInfo, int]], deficit: int, budgets: Sequence[Budget]) -> list[PodInfo] | None:
    """The best set of (pod, slices) whose slices add up to ``deficit`` (None when they cannot)."""
    if deficit <= 0:
        return []
    if sum(k for _, k in cands) < deficit:
        return None
    if len(cands) <= MAX_EXACT_HOLDERS:
        best: tuple[tuple[int, int, int, int], list[PodInfo]] | None = None
        for size in range(1, len(cands) + 1):
            for combo in combinations(cands, size):
                if sum(k for _, k in combo) < deficit:
                    continue
                pods = [p for p, _ in combo]
                key = _key(pods, budgets)
                if best is None or key < best[0]:
                    best = (key, pods)
            if best is not None and best[0][0] == 0:
                break  # no smaller set can come later; larger ones cannot beat a violation-free one on size
        return None if best is None else best[1]
    out: list[PodInfo] = []
    for p, k in sorted(cands, key=lambda t: (-t[1], t[0].priority, t[0].uid)):
        if deficit <= 0:
            break
        out.append(p)
        deficit -= k
    return out


def _top_up(victims: list[PodInfo], lower: dict[str, PodInfo], req: PackRequest, cpu_free: int,
            mem_free: int) -> list[PodInfo] | None:
    """Add the least important lower-priority pods (most CPU first among equals) until CPU and memory fit."""
    out = list(victims)
    chosen = {p.uid for p in out}
    cpu = cpu_free + sum(p.cpu_milli for p in out)
    mem = mem_free + sum(p.memory_mib for p in out)
    rest = sorted((p for u, p in lower.items() if u not in chosen),
                  key=lambda p: (p.priority, -p.cpu_milli, p.created or _NEWEST, p.uid))
    for p in rest:
        if cpu >= req.cpu_milli and mem >= req.memory_mib:
            break
        out.append(p)
        cpu += p.cpu_milli
        mem += p.memory_mib
    return out if cpu >= req.cpu_milli and mem >= req.memory_mib else None


def victims_on(view: ClusterView, req: PackRequest, priority: int, name: str, budgets: Sequence[Budget] = (),
               *, allowed: Collection[str] | None = None) -> NodeVictims | None:
    """The victims on node ``name`` that let ``req`` (of ``priority``) in; None when no set does."""
    n = view.nodes.get(name)
    if n is None or n.row < 0:
        return None
    st = view.state
    v = n.row
    lower = {p.uid: p for p in view.pods_on(name)
             if p.node == name and not p.terminal and p.priority < priority and (allowed is None or p.uid in allowed)}
    if not lower:
        return None
    holders: dict[int, dict[str, int]] = {}
    for sid, uid in n.held.items():
        try:
            row = n.keys.get(ids.owner_of(sid))
        except GpuSliceError:
            continue
        if row is not None:
            holders.setdefault(row, {})
            holders[row][uid] = holders[row].get(uid, 0) + 1
    rows = np.array(sorted(n.row_ids), dtype=np.int64)
    ok = st.unit_accepts(req, rows, as_if_empty=True)
    gpu_of = {int(r): int(st.unit_gpu_id[r]) for r in rows}
    # The owner-spread rule: the pod's own owner's pods on a GPU must leave it (if they may), else the
    # GPU is out.
    same_owner: dict[int, set[str]] = {}
    owner_blocked: set[int] = set()
    if req.owner:
        for row, who in holders.items():
            for uid in who:
                p = view.pod(uid)
                if p is not None and p.owner == req.owner:
                    if uid in lower:
                        same_owner.setdefault(gpu_of[row], set()).add(uid)
                    else:
                        owner_blocked.add(gpu_of[row])

    def unit_option(row: int) -> list[PodInfo] | None:
        who = holders.get(row, {})
        g = gpu_of[row]
        if g in owner_blocked:
            return None
        forced = [lower[u] for u in sorted(same_owner.get(g, ()))]
        forced_ids = {p.uid for p in forced}
        if int(st.unit_kind[row]) == KIND_MPS and req.gpus <= 1:
            cap = int(st.unit_cap[row])
            if cap - sum(k for u, k in who.items() if u not in lower) < req.slices:
                return None
            free = cap - sum(who.values()) + sum(who.get(u, 0) for u in forced_ids)
            cands = [(lower[u], k) for u, k in sorted(who.items()) if u in lower and u not in forced_ids]
            chosen = _cover(cands, req.slices - free, budgets)
            return None if chosen is None else forced + chosen
        if any(u not in lower for u in who):
            return None
        return forced + [lower[u] for u in sorted(who) if u not in forced_ids]

    cpu_free, mem_free = int(st.node_cpu_free[v]), int(st.node_mem_free[v])
    per_unit = [(int(r), got) for r, good in zip(rows.tolist(), ok.tolist(), strict=True)
                if good and (got := unit_option(int(r))) is not None]
    options: list[tuple[list[PodInfo], tuple[int, ...]]] = []
    if req.gpus <= 1:
        options = [(got, (row,)) for row, got in per_unit]
    elif len(per_unit) >= req.gpus:
        per_unit.sort(key=lambda t: (_key(t[1], budgets), t[0]))
        picked = per_unit[: req.gpus]
        union: dict[str, PodInfo] = {}
        for _, got in picked:
            union.update((p.uid, p) for p in got)
        options = [(list(union.values()), tuple(r for r, _ in picked))]
    best: tuple[tuple[int, int, int, int], list[PodInfo], tuple[int, ...]] | None = None
    for victims, units in options:
        full = _top_up(victims, lower, req, cpu_free, mem_free)
        if not full:
            continue
        key = _key(full, budgets)
        if best is None or key < best[0]:
            best = (key, full, units)
    if best is None:
        return None
    key, victims, units = best
    ordered = tuple(sorted(victims, key=importance))
    return NodeVictims(name, ordered, key[0], units, _freed_ids(view, name, units, req, {p.uid for p in ordered}))


def _freed_ids(view: ClusterView, name: str, units: Sequence[int], req: PackRequest,
               leaving: set[str]) -> tuple[str, ...]:
    """The slice ids the placement takes once the victims are gone: a MIG instance or whole GPU whole;
    on an MPS GPU the free ids first, then the victims'."""
    n = view.nodes[name]
    out: list[str] = []
    for row in units:
        unit = view.unit_ids(name, row)
        if int(view.state.unit_cap[row]) == req.slices or int(view.state.unit_kind[row]) != KIND_MPS:
            out.extend(unit)
            continue
        free = [s for s in unit if s not in n.held]
        freed = [s for s in unit if n.held.get(s) in leaving]
        out.extend((free + freed)[: req.slices])
    return tuple(out)


__all__ = ["MAX_EXACT_HOLDERS", "NOMINATION_TTL_S", "NodeVictims", "importance", "pick_node", "victims_on"]
