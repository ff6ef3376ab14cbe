"""The counting rule (DESIGN 3): which pods hold which slice ids on a node.

One function, used by the extender, the device plugin and the simulator, so their bookkeeping can
never drift apart. A pod holds slices on ``node`` when

* it is not Succeeded or Failed,
* its assignment decodes, was written for this pod's UID and names ``node``, and
* either it is bound there (``spec.nodeName == node``), or it is not bound yet and its reservation
  (assignment time + TTL) has not expired;

the ids are its ``allocated`` stamp when present (what kubelet really gave), else the assignment's.
A pod bound to ``node`` without any assignment (another scheduler's pod using our resource) holds its
``allocated`` ids, since kubelet gave them to it. A pod whose annotations do not decode holds nothing
and is reported, never raised: one bad pod must not stop a node's bookkeeping. If two pods claim the
same id (which kubelet never allows on a running node, so it means stale or forged state), the
stronger claim keeps it (allocated over assignment, bound over reserved, then older), the other pod
keeps the rest of its ids, and the clash is reported; an id is never counted twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from gpuslice import rules
from gpuslice.annotations import (
    ALLOCATED_KEY,
    ASSIGNMENT_KEY,
    Allocated,
    Assignment,
    decode_allocated,
    decode_assignment,
    pod_annotations,
)
from gpuslice.errors import GpuSliceError, InventoryError
from gpuslice.model import Gpu, NodeInventory
from gpuslice.placement import DEFAULT_MEMORY_TOLERANCE, Placement, suits
from gpuslice.requests import SliceRequest

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})

Source = Literal["allocated", "assignment"]


@dataclass(frozen=True, slots=True)
class HeldSlices:
    """What one pod holds on the node, and where the ids came from."""

    pod_uid: str
    pod: str  # namespace/name, for messages and events
    slice_ids: frozenset[str]
    source: Source
    bound: bool
    assignment: Assignment | None
    allocated: Allocated | None

    @property
    def drift(self) -> bool:
        """Kubelet gave other ids than the extender assigned (counted by the tests as a failure)."""
        return (self.assignment is not None and self.allocated is not None
                and frozenset(self.assignment.slice_ids) != frozenset(self.allocated.slice_ids))

    @property
    def stamped(self) -> bool:
        """The plugin has written ``allocated``: kubelet's choice is known."""
        return self.allocated is not None


@dataclass(frozen=True, slots=True)
class PodProblem:
    """A pod the rule could not count, or counted only in part, and why."""

    pod: str
    pod_uid: str
    reason: str

    def __str__(self) -> str:
        return f"pod {self.pod} ({self.pod_uid or 'no uid'}): {self.reason}"


@dataclass(frozen=True, slots=True)
class Holdings:
    """The result of the counting rule for one node."""

    node: str
    held: Mapping[str, HeldSlices]  # pod UID -> holding
    problems: tuple[PodProblem, ...]

    def ids(self) -> frozenset[str]:
        """Every id held on the node."""
        return frozenset(sid for h in self.held.values() for sid in h.slice_ids)

    def holder_of(self, slice_id: str) -> HeldSlices | None:
        for h in self.held.values():
            if slice_id in h.slice_ids:
                return h
        return None


@dataclass(frozen=True, slots=True)
class Claim:
    """One pod's claim on a node's ids before clashes are settled (:func:`claim_of`, :func:`settle`)."""

    uid: str
    pod: str
    node: str
    bound: bool
    ids: tuple[str, ...]
    source: Source
    assignment: Assignment | None
    allocated: Allocated | None
    time: datetime | None

    def rank(self) -> tuple[int, int, datetime, str]:
        """Stronger claims sort first: kubelet's stamp, then bound pods, then older, then UID."""
        oldest = self.time if self.time is not None else datetime.min.replace(tzinfo=UTC)
        return (0 if self.source == "allocated" else 1, 0 if self.bound else 1, oldest, self.uid)


def _meta(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = pod.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def pod_label(pod: Mapping[str, Any]) -> str:
    """``namespace/name`` of a pod mapping."""
    meta = _meta(pod)
    return f"{meta.get('namespace') or 'default'}/{meta.get('name') or '?'}"


def pod_uid(pod: Mapping[str, Any]) -> str:
    uid = _meta(pod).get("uid")
    return uid if isinstance(uid, str) else ""


def pod_node_name(pod: Mapping[str, Any]) -> str:
    """``spec.nodeName`` or ``""`` when the pod is not bound."""
    spec = pod.get("spec")
    name = spec.get("nodeName") if isinstance(spec, Mapping) else None
    return name if isinstance(name, str) else ""


def pod_phase(pod: Mapping[str, Any]) -> str:
    status = pod.get("status")
    phase = status.get("phase") if isinstance(status, Mapping) else None
    return phase if isinstance(phase, str) else ""


def claim_of(pod: Mapping[str, Any], *, now: datetime,
           reservation_ttl: timedelta) -> tuple[Claim | None, PodProblem | None, str]:
    """One pod's claim under the rule, independent of any node; the third value is the node it
    concerns (its nodeName, else its assignment's node, else ``""``) so problems land on one node."""
    label, uid, node_name = pod_label(pod), pod_uid(pod), pod_node_name(pod)
    if pod_phase(pod) in TERMINAL_PHASES:
        return None, None, node_name
    try:
        annotations = pod_annotations(pod)
    except GpuSliceError as err:
        return None, PodProblem(label, uid, str(err)), node_name
    return claim_from(uid, label, node_name, annotations.get(ASSIGNMENT_KEY), annotations.get(ALLOCATED_KEY),
                      now=now, reservation_ttl=reservation_ttl)


def claim_from(uid: str, label: str, node_name: str, raw_assignment: object, raw_allocated: object, *,
               now: datetime, reservation_ttl: timedelta) -> tuple[Claim | None, PodProblem | None, str]:
    """:func:`claim_of` for a pod that is not Succeeded or Failed, given by its parts. Each contract
    value is the annotation as written or, already decoded, an ``Assignment`` / ``Allocated``: a
    projection that keeps decoded values need not keep their text as well."""
    if raw_assignment is None and raw_allocated is None:
        return None, None, node_name
    assignment: Assignment | None = None
    allocated: Allocated | None = None
    damaged: PodProblem | None = None
    if isinstance(raw_allocated, Allocated):
        allocated = raw_allocated
    elif raw_allocated is not None:
        try:
            allocated = decode_allocated(raw_allocated)
        except GpuSliceError as err:
            # A broken stamp must not free a running pod's slices: fall back to the assignment.
            damaged = PodProblem(label, uid, f"{err}; counted by its {ASSIGNMENT_KEY} instead")
    if isinstance(raw_assignment, Assignment):
        assignment = raw_assignment
    elif raw_assignment is not None:
        try:
            assignment = decode_assignment(raw_assignment)
        except GpuSliceError as err:
            if allocated is None or not node_name:
                return None, PodProblem(label, uid, f"{err}; the pod holds nothing until it is fixed"), node_name
            # Bound and stamped: kubelet's ids stand on their own, as for another scheduler's pod.
            damaged = PodProblem(label, uid, f"{err}; counted by its {ALLOCATED_KEY} stamp instead")
    if assignment is None:
        if allocated is None:
            assert damaged is not None
            return None, PodProblem(label, uid, f"{damaged.reason.split('; counted')[0]}; the pod holds nothing "
                                                "until it is fixed"), node_name
        if not node_name:
            return None, PodProblem(label, uid, f"{ALLOCATED_KEY} is set on a pod that is not bound"), ""
        return (Claim(uid, label, node_name, True, allocated.slice_ids, "allocated", None, allocated,
                       allocated.time), damaged, node_name)
    concerns = node_name or assignment.node
    if assignment.pod_uid != uid:
        return None, PodProblem(
            label, uid, f"{ASSIGNMENT_KEY} is for pod UID {assignment.pod_uid!r}, not this pod; "
                        "it holds nothing"), concerns
    if node_name and node_name != assignment.node:
        return None, PodProblem(
            label, uid, f"bound to node {node_name} but assigned to {assignment.node}; it holds nothing "
                        "by the assignment"), concerns
    if not node_name and now - reservation_ttl >= assignment.time:  # no overflow near datetime.max
        return None, None, concerns  # reservation expired: holds nothing, nothing wrong
    if allocated is not None:
        return (Claim(uid, label, assignment.node, bool(node_name), allocated.slice_ids, "allocated",
                       assignment, allocated, assignment.time), damaged, concerns)
    return (Claim(uid, label, assignment.node, bool(node_name), assignment.slice_ids, "assignment",
                   assignment, None, assignment.time), damaged, concerns)


def settle(node: str, claims: list[Claim], problems: list[PodProblem]) -> Holdings:
    """Give each id to its strongest claim; report and drop the weaker claim's clashing ids."""
    owner: dict[str, str] = {}
    held: dict[str, HeldSlices] = {}
    for c in sorted(claims, key=Claim.rank):
        if c.uid in held:
            problems.append(PodProblem(c.pod, c.uid, "another pod object has the same UID; counted once"))
            continue
        clash = sorted(sid for sid in c.ids if sid in owner)
        if clash:
            holders = sorted({held[owner[sid]].pod for sid in clash})
            problems.append(PodProblem(
                c.pod, c.uid, f"ids {', '.join(clash)} are already held by {', '.join(holders)}; "
                              "not counted twice"))
        mine = frozenset(sid for sid in c.ids if sid not in owner)
        for sid in mine:
            owner[sid] = c.uid
        held[c.uid] = HeldSlices(c.uid, c.pod, mine, c.source, c.bound, c.assignment, c.allocated)
    return Holdings(node, held, tuple(problems))


def _check_now(now: datetime) -> None:
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError("now must be a timezone-aware datetime")


def held_slices(node: str, pods: Iterable[Mapping[str, Any]], *, now: datetime,
                reservation_ttl: timedelta) -> Holdings:
    """The counting rule for one node: pod UID → held ids, plus the problems found.

    ``pods`` may be every pod of the cluster or only those of interest (bound to ``node`` or not
    bound at all); others are ignored. Problems are reported for pods that concern this node (bound
    here, or assigned here while unbound) and for unbound pods whose annotations do not decode.
    """
    _check_now(now)
    claims: list[Claim] = []
    problems: list[PodProblem] = []
    for pod in pods:
        claim, problem, concerns = claim_of(pod, now=now, reservation_ttl=reservation_ttl)
        if problem is not None and concerns in (node, ""):
            problems.append(problem)
        if claim is not None and claim.node == node:
            claims.append(claim)
    return settle(node, claims, problems)


def held_by_node(pods: Iterable[Mapping[str, Any]], *, now: datetime,
                 reservation_ttl: timedelta) -> tuple[dict[str, Holdings], tuple[PodProblem, ...]]:
    """The counting rule for every node at once; each problem is reported once, not per node."""
    _check_now(now)
    claims: dict[str, list[Claim]] = {}
    problems: list[PodProblem] = []
    for pod in pods:
        claim, problem, _ = claim_of(pod, now=now, reservation_ttl=reservation_ttl)
        if problem is not None:
            problems.append(problem)
        if claim is not None:
            claims.setdefault(claim.node, []).append(claim)
    out: dict[str, Holdings] = {}
    for node in sorted(claims):
        settled = settle(node, claims[node], [])
        problems.extend(settled.problems)
        out[node] = Holdings(node, settled.held, settled.problems)
    return out, tuple(problems)


def inventory_with_pods(node: str, gpus: Iterable[Gpu], pods: Iterable[Mapping[str, Any]], *,
                        now: datetime, reservation_ttl: timedelta) -> tuple[NodeInventory, Holdings]:
    """A ``NodeInventory`` whose ``used`` set is what the rule says pods hold.

    Held ids that the node no longer advertises (a GPU gone or re-laid out under a running pod)
    cannot be marked used; they are reported as problems instead of failing the whole node.
    """
    holdings = held_slices(node, pods, now=now, reservation_ttl=reservation_ttl)
    return apply_holdings(NodeInventory(node, tuple(gpus)), holdings)


def apply_holdings(inventory: NodeInventory, holdings: Holdings) -> tuple[NodeInventory, Holdings]:
    """Mark ``holdings`` used on ``inventory``; unknown ids become problems (see ``inventory_with_pods``)."""
    known = inventory.all_ids()
    problems = list(holdings.problems)
    for h in holdings.held.values():
        missing = sorted(h.slice_ids - known)
        if missing:
            problems.append(PodProblem(h.pod, h.pod_uid, f"holds ids not advertised on node {inventory.node}: "
                                                         f"{', '.join(missing)}"))
    used = holdings.ids() & known
    return inventory.with_used(used), Holdings(holdings.node, holdings.held, tuple(problems))


# --------------------------------------------------------------------------- same-size pods at bind

def placement_from_assignment(assignment: Assignment, inventory: NodeInventory) -> Placement:
    """Rebuild the ``Placement`` an assignment describes, with its memory from the inventory.

    Raises ``InventoryError`` when the assignment's GPUs or instance are not on this node.
    """
    gpus = [inventory.gpu(uuid) for uuid in assignment.gpus]
    if assignment.instance is not None:
        gpu = gpus[0]
        inst = gpu.instance(assignment.instance)
        return Placement(inventory.node, "mig", (gpu.uuid,), inst.uuid, assignment.slice_ids, inst.memory_mib)
    if len(gpus) == 1 and gpus[0].mode == "mps":
        gpu = gpus[0]
        memory = rules.mps_share_mib(gpu.memory_mib, len(assignment.slice_ids), gpu.slices)
        return Placement(inventory.node, "mps", (gpu.uuid,), None, assignment.slice_ids, memory)
    if any(g.mode != "whole" for g in gpus):
        raise InventoryError(f"assignment for pod {assignment.pod_uid} spans GPUs that are not all whole-mode")
    return Placement(inventory.node, "whole", tuple(g.uuid for g in gpus), None, assignment.slice_ids,
                     sum(g.memory_mib for g in gpus))


def placements_suit_both(first: Placement, first_request: SliceRequest, second: Placement,
                         second_request: SliceRequest, inventory: NodeInventory, *,
                         memory_tolerance: float = DEFAULT_MEMORY_TOLERANCE) -> bool:
    """Whether kubelet may hand either pod either placement: same size, and each placement
    satisfies both pods' size, isolation and memory (DESIGN 3, "Same-size pods")."""
    if first_request.slices != second_request.slices:
        return False
    return all(suits(p, r, inventory, memory_tolerance=memory_tolerance)
               for p in (first, second) for r in (first_request, second_request))


def unstamped_same_size(holdings: Holdings, size: int, *, exclude_uid: str = "") -> tuple[HeldSlices, ...]:
    """Assignments on the node that kubelet has not admitted yet (no ``allocated``) of ``size`` slices.

    These are the pods kubelet could confuse with a new pod of the same size, oldest first.
    """
    found = [(h.assignment.time, h.pod_uid, h) for h in holdings.held.values()
             if h.assignment is not None and not h.stamped and h.assignment.size == size
             and h.pod_uid != exclude_uid]
    return tuple(h for _, _, h in sorted(found, key=lambda t: (t[0], t[1])))


def bind_conflicts(placement: Placement, request: SliceRequest, pod_uid: str, holdings: Holdings,
                   requests: Mapping[str, SliceRequest], inventory: NodeInventory, *,
                   memory_tolerance: float = DEFAULT_MEMORY_TOLERANCE) -> tuple[HeldSlices, ...]:
    """The unstamped same-size assignments that make binding this pod unsafe (DESIGN 3).

    ``requests`` maps pod UID to its parsed request for the pods in ``holdings``. An empty answer
    means ``/bind`` may go ahead; otherwise it refuses and the scheduler retries once kubelet has
    admitted (and the plugin stamped) the earlier pods. A pending pod whose request is unknown or
    whose assignment no longer maps onto the inventory counts as a conflict: refusing is the safe
    side, the retry is cheap.
    """
    out: list[HeldSlices] = []
    for other in unstamped_same_size(holdings, request.slices, exclude_uid=pod_uid):
        assert other.assignment is not None
        other_request = requests.get(other.pod_uid)
        try:
            other_placement = placement_from_assignment(other.assignment, inventory)
        except GpuSliceError:
            out.append(other)
            continue
        if other_request is None or not placements_suit_both(
                placement, request, other_placement, other_request, inventory,
                memory_tolerance=memory_tolerance):
            out.append(other)
    return tuple(out)


__all__ = [
    "TERMINAL_PHASES",
    "Claim",
    "HeldSlices",
    "Holdings",
    "PodProblem",
    "apply_holdings",
    "bind_conflicts",
    "claim_from",
    "claim_of",
    "held_by_node",
    "held_slices",
    "inventory_with_pods",
    "placement_from_assignment",
    "placements_suit_both",
    "pod_label",
    "pod_node_name",
    "pod_phase",
    "pod_uid",
    "settle",
    "suits",
    "unstamped_same_size",
]
