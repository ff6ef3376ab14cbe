"""Preemption: the fewest lower-priority pods on a node whose slices free one valid placement.

Fit is not re-implemented here: the node's lower-priority pods are taken out of the view for a
moment, the state's own fit (:meth:`ClusterState.fit`, the one rule) lists the units the pod could
then use, and the pods are put back. For each such unit (or set of whole GPUs) the victims are the
pods holding what the placement needs (for an MPS GPU, the largest holders until enough slices are
free), plus lower-priority pods of the pod's own owner on that GPU (owner-spread rule), plus, if the
node is short of CPU or memory, the lower-priority pods that free the most. The placement with the
fewest victims wins (then the lowest priorities, then the fewest slices moved).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuslice import ids
from gpuslice.errors import GpuSliceError
from gpuslice.packing.state import KIND_MPS, PackRequest
from gpuslice.pods import PodInfo

if TYPE_CHECKING:
    from gpuslice.view import ClusterView


def victims_on(view: ClusterView, req: PackRequest, priority: int, name: str, now: float = 0.0) -> list[str]:
    """UIDs of the fewest lower-priority pods on node ``name`` to evict for ``req``; [] when none works."""
    n = view.nodes.get(name)
    if n is None or n.row < 0:
        return []
    st = view.state
    v = n.row
    lower = {p.uid: p for p in view.pods_on(name) if p.priority < priority and p.node == name and not p.terminal}
    if not lower:
        return []
    # Who holds what on each unit now, before anything is taken out.
    holders: dict[int, dict[str, int]] = {}
    for sid, uid in n.held.items():
        try:
            row = n.keys.get(ids.owner_of(sid))
        except GpuSliceError:
            continue
        if row is not None:
            holders.setdefault(row, {})
            holders[row][uid] = holders[row].get(uid, 0) + 1
    free_before = {int(r): int(st.unit_free[r]) for r in n.row_ids}
    cpu_free, mem_free = int(st.node_cpu_free[v]), int(st.node_mem_free[v])
    gpu_of = {int(r): int(st.unit_gpu_id[r]) for r in n.row_ids}
    kind = {int(r): int(st.unit_kind[r]) for r in n.row_ids}
    # Take every lower-priority pod out, ask the one fit rule, put them back.
    with view.pretend_gone(lower):
        fit = st.fit(req)
        feasible = bool(fit.feasible[v])
        rows = [int(r) for r in st.node_rows(v) if fit.unit_ok.shape[0] and fit.unit_ok[r]]
    if not feasible or not rows:
        return []
    same_owner: dict[int, set[str]] = {}
    if req.owner:
        for row, who in holders.items():
            for uid in who:
                p = lower.get(uid)
                if p is not None and p.owner == req.owner:
                    same_owner.setdefault(gpu_of[row], set()).add(uid)

    def unit_victims(row: int) -> set[str] | None:
        who = holders.get(row, {})
        shared = kind[row] == KIND_MPS and req.gpus == 1
        if any(uid not in lower for uid in who) and not shared:
            return None
        # The owner-spread rule evicts these whatever else goes; the slices they free count first.
        out: set[str] = set(same_owner.get(gpu_of[row], set()))
        if shared:
            need = req.slices - free_before[row] - sum(who.get(uid, 0) for uid in out)
            for uid, k in sorted(who.items(), key=lambda t: (-t[1], lower[t[0]].priority if t[0] in lower else 0,
                                                              t[0])):
                if need <= 0:
                    break
                if uid not in lower or uid in out:
                    continue
                out.add(uid)
                need -= k
            if need > 0:
                return None
        else:
            out |= set(who)
        return out

    options: list[set[str]] = []
    if req.gpus <= 1:
        for row in rows:
            got = unit_victims(row)
            if got is not None:
                options.append(got)
    else:
        per = [(got, row) for row in rows if (got := unit_victims(row)) is not None]
        per.sort(key=lambda t: (len(t[0]), t[1]))
        if len(per) >= req.gpus:
            chosen: set[str] = set()
            for got, _ in per[: req.gpus]:
                chosen |= got
            options.append(chosen)
    best: tuple[tuple[int, int, int], list[str]] | None = None
    for option in options:
        victims = _add_for_resources(option, lower, req, cpu_free, mem_free)
        if not victims:
            continue
        key = (len(victims), sum(lower[u].priority for u in victims), sum(_slices(lower[u]) for u in victims))
        if best is None or key < best[0]:
            best = (key, sorted(victims))
    return [] if best is None else best[1]


def _slices(p: PodInfo) -> int:
    return 0 if p.request is None else p.request.slices


def _add_for_resources(victims: set[str], lower: dict[str, PodInfo], req: PackRequest, cpu_free: int,
                       mem_free: int) -> set[str] | None:
    """Add lower-priority pods (lowest priority, then most CPU) until CPU and memory fit."""
    out = set(victims)
    cpu = cpu_free + sum(lower[u].cpu_milli for u in out)
    mem = mem_free + sum(lower[u].memory_mib for u in out)
    rest = sorted((p for u, p in lower.items() if u not in out), key=lambda p: (p.priority, -p.cpu_milli, p.uid))
    for p in rest:
        if cpu >= req.cpu_milli and mem >= req.memory_mib:
            break
        out.add(p.uid)
        cpu += p.cpu_milli
        mem += p.memory_mib
    if cpu < req.cpu_milli or mem < req.memory_mib:
        return None
    return out


__all__ = ["victims_on"]
