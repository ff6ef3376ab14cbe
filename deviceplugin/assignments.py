"""The plugin's view of assignments on this node, and the preferred/Allocate decisions made from it.

Kubelet's ``GetPreferredAllocation`` and ``Allocate`` never say which pod they serve, and kubelet may
admit same-size pods in any order. So the plugin works with *ids*, not pods: the candidates for a
request of size k are the assignments of size k, of live pods on this node, whose ids kubelet still
lists as available, in the order kubelet admits pods (creation time, then binding order), so the pod
kubelet is admitting gets its own assignment (the extender's ``/bind`` guarantees every such placement
suits every pending pod of that size, should the guess be wrong). Everything here is pure given the
cache: no I/O, no clock, no locks, so the RPC path stays fast and the logic is tested without gRPC.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from fractions import Fraction
from typing import Any

from deviceplugin.dcgm import UTILIZATION_ANNOTATION
from deviceplugin.errors import PlacementRefused
from gpuslice import ids
from gpuslice.annotations import decode_allocated_for, decode_assignment_for, format_time, parse_time
from gpuslice.catalogue import product
from gpuslice.errors import DeviceIdError, GpuSliceError
from gpuslice.model import Gpu, MigInstance, NodeInventory
from gpuslice.placement import Placement
from gpuslice.rules import mps_share_mib

log = logging.getLogger(__name__)

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _when(text: str) -> datetime:
    """A pod or assignment time for ordering; unreadable or missing times sort first."""
    if not text:
        return _EPOCH
    try:
        return parse_time(text)
    except GpuSliceError:
        return _EPOCH
MAX_LOCAL_NOTES = 256
#: An Allocate note that PodResources never shows (admission failed after Allocate, or the pod was
#: deleted first) stops holding its ids after this long, so the ids return to the pool.
LOCAL_NOTE_TTL_S = 120.0


@dataclass(frozen=True, slots=True)
class PodView:
    """What the plugin needs of one pod on its node, decoded once when the watch delivers it.

    ``assignment_ids`` are the extender's slice ids when the pod carries a valid assignment for this
    node and this pod UID; ``allocated_ids`` the ids already stamped from PodResources.
    """

    namespace: str
    name: str
    uid: str
    node_name: str
    phase: str
    created: str = ""
    assigned_at: str = ""
    assignment_ids: tuple[str, ...] | None = None
    allocated_ids: tuple[str, ...] | None = None
    utilization: str | None = None  # example.com/simulated-utilization, raw (the simulated DCGM series)
    container: str = ""  # the container that requests slices (dcgm-exporter's container label)
    _order: tuple[datetime, datetime, str, str] = field(default=(datetime.min, datetime.min, "", ""), init=False,
                                                        repr=False, compare=False)
    _created_at: datetime = field(default=datetime.min, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Parsed once when the watch delivers the pod: the RPC path sorts by it on every call.
        created = _when(self.created)
        assigned = _when(self.assigned_at) if self.assigned_at else created
        object.__setattr__(self, "_order", (assigned, created, self.namespace, self.name))
        object.__setattr__(self, "_created_at", created)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def live(self) -> bool:
        return self.phase not in TERMINAL_PHASES

    @property
    def order(self) -> tuple[datetime, datetime, str, str]:
        """Assignment order: assignment time, then creation time, then name (stable tie-break).

        Times are compared parsed: RFC 3339 strings with and without fractions do not sort as text.
        """
        return self._order

    @property
    def created_at(self) -> datetime:
        """The parsed creation time: kubelet's admission order (``HandlePodAdditions``) sorts by it."""
        return self._created_at


@dataclass(frozen=True, slots=True)
class Candidate:
    """One assignment that may still be handed out: its pod and its ids (kubelet order kept)."""

    pod: PodView
    slice_ids: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.slice_ids)


@dataclass(slots=True)
class AssignmentBook:
    """The mutable cache (owned by the event loop): pods on this node and what kubelet has admitted.

    ``admitted`` maps (namespace, name) to the ids PodResources reports for the pod; a pod present
    there or carrying an ``allocated`` stamp is no longer pending.
    """

    node: str
    pods: dict[str, PodView] = field(default_factory=dict)
    #: The order in which pods were first seen bound to this node: the order of the binding events
    #: kubelet receives on its own watch, which breaks its creation-time ties.
    bound_seq: dict[str, int] = field(default_factory=dict)
    _next_seq: int = 0
    admitted: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    local: list[frozenset[str]] = field(default_factory=list)
    local_at: list[float] = field(default_factory=list)

    def upsert(self, pod: PodView) -> None:
        self.pods[pod.uid] = pod
        self._note_bound(pod)

    def _note_bound(self, pod: PodView) -> None:
        """Give a pod seen bound to this node for the first time the next place in binding order."""
        if pod.node_name == self.node and pod.uid not in self.bound_seq:
            self.bound_seq[pod.uid] = self._next_seq
            self._next_seq += 1

    def remove(self, uid: str) -> None:
        pod = self.pods.pop(uid, None)
        self.bound_seq.pop(uid, None)
        if pod is not None:
            self.admitted.pop(pod.key, None)

    def replace_all(self, pods: Iterable[PodView]) -> None:
        """A fresh list after a (re)list: drop pods that vanished while the watch was down.

        Pods already known keep their binding order; new ones follow in creation order (a list
        comes in name order, which says nothing about when each pod was bound).
        """
        fresh = sorted(pods, key=lambda p: (p.created_at, p.namespace, p.name))
        self.pods = {p.uid: p for p in fresh}
        self.bound_seq = {uid: n for uid, n in self.bound_seq.items() if uid in self.pods}
        for pod in fresh:
            self._note_bound(pod)
        live_keys = {p.key for p in self.pods.values()}
        self.admitted = {k: v for k, v in self.admitted.items() if k in live_keys}

    def admission_key(self, pod: PodView) -> tuple[datetime, int, str, str]:
        """kubelet's admission order as far as the plugin can know it.

        kubelet admits a batch of newly bound pods one at a time sorted by creation time (seconds,
        so replicas tie), ties kept in arrival order, which is binding order: the order this
        plugin's own watch saw them bound.
        """
        return (pod.created_at, self.bound_seq.get(pod.uid, self._next_seq), pod.namespace, pod.name)

    def set_admitted(self, admitted: Mapping[tuple[str, str], tuple[str, ...]], now: float | None = None) -> None:
        """Replace the admitted map with what PodResources ``List`` reports now.

        Local Allocate notes that PodResources now shows are dropped; the rest stay (kubelet records
        the devices only after Allocate returns, so a List may not show them yet) until
        ``LOCAL_NOTE_TTL_S`` after the Allocate, when ``now`` (monotonic seconds) is given.
        """
        self.admitted = dict(admitted)
        seen = frozenset(i for ids_ in self.admitted.values() for i in ids_)
        keep = [(ids_, at) for ids_, at in zip(self.local, self.local_at, strict=True)
                if not ids_ <= seen and (now is None or now - at < LOCAL_NOTE_TTL_S)]
        self.local = [ids_ for ids_, _ in keep]
        self.local_at = [at for _, at in keep]

    def note_allocated(self, slice_ids: Iterable[str], now: float = 0.0) -> None:
        """Kubelet just took these ids (an Allocate call): they are no longer free for anyone else."""
        self.local.append(frozenset(slice_ids))
        self.local_at.append(now)
        del self.local[:-MAX_LOCAL_NOTES]
        del self.local_at[:-MAX_LOCAL_NOTES]

    def pod_by_key(self, key: tuple[str, str]) -> PodView | None:
        for pod in self.pods.values():
            if pod.key == key:
                return pod
        return None

    def assigned(self) -> list[PodView]:
        """Live pods on this node with an assignment, in kubelet's admission order."""
        out = [p for p in self.pods.values()
               if p.live and p.node_name == self.node and p.assignment_ids is not None]
        out.sort(key=self.admission_key)
        return out

    def pending(self) -> list[PodView]:
        """Assigned pods kubelet has not admitted yet (phase Pending, no stamp, absent from PodResources)."""
        return [p for p in self.assigned()
                if p.phase == "Pending" and p.allocated_ids is None and p.key not in self.admitted]

    def candidates(self, available: Iterable[str] | None = None) -> list[Candidate]:
        """Assignments that may still be handed out: pending pods' own first (kubelet's admission order),
        then leftovers.

        A leftover is the assignment of a pod that was admitted with other ids (kubelet swapped two
        same-size pods); it is offered only when made after the oldest pending pod of that size was
        assigned, because only then did ``/bind`` check that it suits that pod too, and newest first,
        since the swap partner is the most recent. Sizes with no pending pod have none. With
        ``available`` given, only assignments whose ids are all available.
        """
        pending = self.pending()
        pending_uids = {p.uid for p in pending}
        earliest: dict[int, tuple[datetime, datetime, str, str]] = {}
        for p in pending:
            size = len(p.assignment_ids or ())
            earliest[size] = min(earliest.get(size, p.order), p.order)
        avail = None if available is None else frozenset(available)
        taken = frozenset(i for ids_ in self.admitted.values() for i in ids_) | frozenset(
            i for p in self.pods.values() if p.live for i in (p.allocated_ids or ())) | frozenset(
            i for ids_ in self.local for i in ids_)
        own: list[Candidate] = []
        leftovers: list[Candidate] = []
        for pod in self.assigned():
            sids = pod.assignment_ids or ()
            if len(sids) not in earliest:
                continue
            if avail is not None and not avail.issuperset(sids):
                continue
            if avail is None and taken.intersection(sids):
                continue
            if pod.uid in pending_uids:
                own.append(Candidate(pod, sids))
            elif pod.order >= earliest[len(sids)]:
                leftovers.append(Candidate(pod, sids))
        leftovers.sort(key=lambda c: c.pod.order, reverse=True)
        return own + leftovers

    def in_use(self) -> frozenset[str]:
        """Ids live pods hold or kubelet just gave: admitted (PodResources), stamped, or noted at Allocate."""
        out = {i for ids_ in self.admitted.values() for i in ids_}
        out |= {i for p in self.pods.values() if p.live for i in (p.allocated_ids or ())}
        out |= {i for note in self.local for i in note}
        return frozenset(out)

    def held(self) -> frozenset[str]:
        """Ids in use or promised to a pending assignment: what a cordon or a mode change must not take."""
        return self.in_use() | frozenset(i for p in self.pending() for i in (p.assignment_ids or ()))

    def held_by_candidates(self) -> frozenset[str]:
        """Ids reserved for pending assignments: a pod without one must not take them."""
        return frozenset(i for c in self.candidates() for i in c.slice_ids)

    def match(self, slice_ids: Iterable[str]) -> Candidate | None:
        """The assignment whose ids are exactly ``slice_ids`` (pending ones first), if any."""
        wanted = frozenset(slice_ids)
        for cand in self.candidates():
            if frozenset(cand.slice_ids) == wanted:
                return cand
        for pod in self.assigned():
            if pod.assignment_ids is not None and frozenset(pod.assignment_ids) == wanted:
                return Candidate(pod, pod.assignment_ids)
        return None


def preferred(book: AssignmentBook | None, inventory: NodeInventory, available: Iterable[str],
              must_include: Iterable[str], size: int) -> tuple[list[str], Candidate | None]:
    """Kubelet's preferred ids for one container: the first fitting assignment in admission order, else a
    best fit.

    Returns the ids and the candidate they came from (``None`` for a best-fit choice).
    """
    avail = list(dict.fromkeys(available))
    must = list(dict.fromkeys(must_include))
    if size <= 0:
        return [], None
    if book is not None:
        for cand in book.candidates(avail):
            if cand.size == size and set(must) <= set(cand.slice_ids):
                return list(cand.slice_ids), cand
    held = book.held_by_candidates() if book is not None else frozenset()
    choice = best_fit(inventory, [i for i in avail if i not in held or i in must], must, size)
    if choice is None and held:
        choice = best_fit(inventory, avail, must, size)
    return (choice or []), None


def _group(inventory: NodeInventory, slice_ids: Iterable[str]) -> dict[str, list[str]]:
    """Available ids per GPU uuid (unknown or undecodable ids are ignored: kubelet is advisory)."""
    out: dict[str, list[str]] = {}
    owners = _owner_map(inventory)
    for sid in slice_ids:
        try:
            owner = ids.owner_of(sid)
        except DeviceIdError:
            continue
        gpu = owners.get(owner)
        if gpu is not None:
            out.setdefault(gpu.uuid, []).append(sid)
    return out


def _owner_map(inventory: NodeInventory) -> dict[str, Gpu]:
    owners: dict[str, Gpu] = {}
    for gpu in inventory.gpus:
        owners[gpu.uuid] = gpu
        for inst in gpu.instances:
            owners[inst.uuid] = gpu
    return owners


def best_fit(inventory: NodeInventory, available: Iterable[str], must_include: Iterable[str],
             size: int) -> list[str] | None:
    """A valid placement from ``available`` that leaves the fewest free slices on its GPU.

    MIG: one whole instance of exactly ``size`` compute slices; MPS: ``size`` ids of one GPU (lowest
    ordinals); whole: ``size/S`` completely available GPUs. ``None`` when nothing fits.
    """
    must = set(must_include)
    by_gpu = _group(inventory, available)
    options: list[tuple[int, int, list[str]]] = []  # (leftover, gpu index, ids)
    whole: list[Gpu] = []
    for gpu in inventory.gpus:
        have = set(by_gpu.get(gpu.uuid, ()))
        if gpu.mode == "mig":
            for inst in gpu.instances:
                sids = inst.slice_ids()
                if inst.compute_slices == size and have.issuperset(sids) and must <= set(sids):
                    options.append((len(have) - size, gpu.index, list(sids)))
        elif gpu.mode == "mps":
            gpu_ids = set(gpu.slice_ids())
            ordered = [s for s in gpu.slice_ids() if s in have or s in must]
            if must <= gpu_ids and size <= gpu.slices and len(ordered) >= size:
                pick = ([s for s in ordered if s in must] + [s for s in ordered if s not in must])[:size]
                if must <= set(pick):
                    options.append((len(ordered) - size, gpu.index, pick))
        elif have.issuperset(gpu.slice_ids()):
            whole.append(gpu)
    for s in sorted({g.slices for g in whole}):
        same = [g for g in whole if g.slices == s]
        if size % s == 0 and len(same) >= size // s:
            pick = [sid for g in same[: size // s] for sid in g.slice_ids()]
            if must <= set(pick):
                options.append((0, same[0].index, pick))
    if not options:
        return None
    options.sort(key=lambda o: (o[0], o[1]))
    return options[0][2]


def check_placement(inventory: NodeInventory, slice_ids: Iterable[str]) -> Placement:
    """Whether ``slice_ids`` form one valid placement on this node; the placement, or why not.

    Valid: all ids of exactly one MIG instance; or up to S ids of one MPS GPU; or every id of one or
    more whole-mode GPUs. Raises ``PlacementRefused`` with a message that says what is wrong.
    """
    wanted = list(dict.fromkeys(slice_ids))
    if not wanted:
        raise PlacementRefused("no device ids were given")
    owners = _owner_map(inventory)
    gpus: dict[str, Gpu] = {}
    instances: set[str] = set()
    for sid in wanted:
        try:
            owner = ids.owner_of(sid)
        except DeviceIdError as exc:
            raise PlacementRefused(str(exc)) from exc
        gpu = owners.get(owner)
        if gpu is None or sid not in gpu.slice_ids():
            raise PlacementRefused(f"device id {sid} is not advertised by this node")
        gpus[gpu.uuid] = gpu
        if owner != gpu.uuid:
            instances.add(owner)
    modes = {g.mode for g in gpus.values()}
    if len(modes) > 1:
        raise PlacementRefused(f"ids span GPUs in different modes ({', '.join(sorted(modes))})")
    mode = modes.pop()
    first = next(iter(gpus.values()))
    if mode == "mig":
        if len(instances) != 1:
            raise PlacementRefused(
                f"MIG ids must all belong to one MIG instance, these span {len(instances)}: {sorted(instances)}")
        inst: MigInstance = first.instance(next(iter(instances)))
        missing = [s for s in inst.slice_ids() if s not in wanted]
        if missing:
            raise PlacementRefused(
                f"a MIG placement takes every slice of its instance {inst.uuid} ({inst.profile}); "
                f"missing {missing}")
        return Placement(inventory.node, "mig", (first.uuid,), inst.uuid, inst.slice_ids(), inst.memory_mib)
    if mode == "mps":
        if len(gpus) != 1:
            raise PlacementRefused(f"MPS ids must all belong to one GPU, these span {len(gpus)}: {sorted(gpus)}")
        if len(wanted) > first.slices:
            raise PlacementRefused(f"{len(wanted)} ids exceed the {first.slices} slices of one MPS GPU")
        order = {s: n for n, s in enumerate(first.slice_ids())}
        sids = tuple(sorted(wanted, key=order.__getitem__))
        return Placement(inventory.node, "mps", (first.uuid,), None, sids,
                         mps_share_mib(first.memory_mib, len(sids), first.slices))
    for gpu in sorted(gpus.values(), key=lambda g: g.index):
        missing = [s for s in gpu.slice_ids() if s not in wanted]
        if missing:
            raise PlacementRefused(
                f"whole-GPU placements take every slice of each GPU; GPU {gpu.index} ({gpu.uuid}) "
                f"is missing {len(missing)} of {gpu.slices}")
    chosen = sorted(gpus.values(), key=lambda g: g.index)
    return Placement(inventory.node, "whole", tuple(g.uuid for g in chosen), None,
                     tuple(s for g in chosen for s in g.slice_ids()), sum(g.memory_mib for g in chosen))


def slice_fraction(inventory: NodeInventory, placement: Placement) -> Fraction:
    """The share of one GPU's compute a placement gives (k/S; MIG: compute slices of 7 or 4)."""
    gpu = inventory.gpu(placement.gpu)
    if placement.mode == "mig":
        return Fraction(len(placement.slice_ids), product(gpu.product).compute_slices)
    if placement.mode == "mps":
        return Fraction(len(placement.slice_ids), gpu.slices)
    return Fraction(len(placement.gpus))


def pod_view(obj: Mapping[str, Any], node: str) -> PodView:
    """Decode what the plugin needs of a pod (JSON mapping); a bad annotation is logged and ignored.

    An assignment counts only when it names this node and this pod's UID (``decode_assignment_for``
    checks the UID), so a copied manifest cannot claim another pod's slices.
    """
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    assignment_ids: tuple[str, ...] | None = None
    assigned_at = ""
    allocated_ids: tuple[str, ...] | None = None
    try:
        assignment = decode_assignment_for(obj)
    except GpuSliceError as exc:
        log.warning("pod %s/%s: ignoring its assignment: %s", namespace, name, exc)
        assignment = None
    if assignment is not None:
        if assignment.node == node:
            assignment_ids = assignment.slice_ids
            assigned_at = format_time(assignment.time)
        else:
            log.warning("pod %s/%s: its assignment names node %s, not this node %s; ignored",
                        namespace, name, assignment.node, node)
    try:
        allocated = decode_allocated_for(obj)
    except GpuSliceError as exc:
        log.warning("pod %s/%s: ignoring its allocated stamp: %s", namespace, name, exc)
        allocated = None
    if allocated is not None:
        allocated_ids = allocated.slice_ids
    annotations = meta.get("annotations") or {}
    raw_util = annotations.get(UTILIZATION_ANNOTATION) if isinstance(annotations, Mapping) else None
    return PodView(namespace=namespace, name=name, uid=str(meta.get("uid", "")),
                   node_name=str(spec.get("nodeName") or ""), phase=str(status.get("phase") or "Pending"),
                   created=str(meta.get("creationTimestamp") or ""), assigned_at=assigned_at,
                   assignment_ids=assignment_ids, allocated_ids=allocated_ids,
                   utilization=None if raw_util is None else str(raw_util), container=_slice_container(spec))



def _slice_container(spec: Mapping[str, Any]) -> str:
    """The first container whose limits ask for an extended resource named ``*/gpu-slice``, else the first."""
    containers = spec.get("containers") or []
    names = []
    for c in containers if isinstance(containers, list) else []:
        if not isinstance(c, Mapping):
            continue
        names.append(str(c.get("name") or ""))
        limits = (c.get("resources") or {}).get("limits") or {}
        if isinstance(limits, Mapping) and any(str(k).endswith("/gpu-slice") for k in limits):
            return names[-1]
    return names[0] if names else ""
