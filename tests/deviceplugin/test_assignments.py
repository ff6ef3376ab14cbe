"""The pure decisions: candidates, preferred ids, best fit, placement checks, pod decoding."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplugin.assignments import (
    AssignmentBook,
    PodView,
    best_fit,
    check_placement,
    pod_view,
    preferred,
)
from deviceplugin.errors import PlacementRefused
from deviceplugin.simulated import builtin_topology
from gpuslice.model import Gpu, NodeInventory

NODE = "node-a"
TOPO = builtin_topology(NODE)
MIG: Gpu = TOPO.gpus[0]
MPS: Gpu = TOPO.gpus[1]
INV = NodeInventory(NODE, TOPO.gpus)
ALL = sorted(INV.all_ids())


def pod(name: str, ids: tuple[str, ...] | None, at: str = "2025-01-01T00:00:00Z", **kw: object) -> PodView:
    fields: dict[str, object] = {"phase": "Pending", "created": at, "assigned_at": at, "assignment_ids": ids}
    fields.update(kw)
    return PodView("default", name, f"uid-{name}", NODE, **fields)  # type: ignore[arg-type]


def test_candidates_are_oldest_first_and_only_for_sizes_still_pending() -> None:
    book = AssignmentBook(NODE)
    a, b = MIG.instances[1].slice_ids(), MIG.instances[2].slice_ids()
    book.upsert(pod("late", a, "2025-01-01T00:00:02Z"))
    book.upsert(pod("early", b, "2025-01-01T00:00:01Z"))
    assert [c.pod.name for c in book.candidates()] == ["early", "late"]
    book.set_admitted({("default", "early"): a, ("default", "late"): b})
    assert book.candidates() == []  # nobody of that size is pending any more


def test_swapped_admission_keeps_the_other_assignment_available() -> None:
    book = AssignmentBook(NODE)
    a, b = MIG.instances[1].slice_ids(), MIG.instances[2].slice_ids()
    book.upsert(pod("p", a, "2025-01-01T00:00:01Z"))
    book.upsert(pod("q", b, "2025-01-01T00:00:02Z"))
    book.set_admitted({("default", "q"): a})  # q was admitted first and got p's ids
    ids, cand = preferred(book, INV, [i for i in ALL if i not in a], [], 1)
    assert cand is not None and cand.pod.name == "q" and tuple(ids) == b


def test_a_pending_pod_gets_its_own_assignment_before_an_old_leftover() -> None:
    """A pod admitted long ago on other ids leaves its assignment free; a later pod of that size
    must not be steered there (``/bind`` never checked it suits the later pod): its own comes first."""
    book = AssignmentBook(NODE)
    x, z = MIG.instances[1].slice_ids(), MIG.instances[2].slice_ids()
    y = MPS.slice_ids()[:1]
    book.upsert(pod("r", x, "2025-01-01T00:00:00Z", phase="Running", allocated_ids=z))
    book.set_admitted({("default", "r"): z})
    book.upsert(pod("p", y, "2025-01-01T01:00:00Z"))
    avail = [i for i in ALL if i not in z]
    assert [c.pod.name for c in book.candidates(avail)] == ["p"]
    ids, cand = preferred(book, INV, avail, [], 1)
    assert cand is not None and cand.pod.name == "p" and tuple(ids) == y


def test_order_compares_times_not_text() -> None:
    book = AssignmentBook(NODE)
    a, b = MIG.instances[1].slice_ids(), MIG.instances[2].slice_ids()
    book.upsert(pod("later", a, "2025-01-01T00:00:00.5Z"))
    book.upsert(pod("earlier", b, "2025-01-01T00:00:00Z"))
    assert [c.pod.name for c in book.candidates()] == ["earlier", "later"]


def test_candidates_follow_kubelets_admission_order_not_assignment_time() -> None:
    book = AssignmentBook(NODE)
    a, b, c = (MIG.instances[n].slice_ids() for n in (1, 2, 3))
    # Bound in this order; "young" was assigned first but created last.
    book.upsert(pod("young", a, "2025-01-01T00:00:05Z", created="2025-01-01T00:00:09Z"))
    book.upsert(pod("tie-bound-first", b, "2025-01-01T00:00:07Z", created="2025-01-01T00:00:01Z"))
    book.upsert(pod("tie-bound-second", c, "2025-01-01T00:00:06Z", created="2025-01-01T00:00:01Z"))
    assert [c.pod.name for c in book.candidates()] == ["tie-bound-first", "tie-bound-second", "young"]
    ids, cand = preferred(book, INV, ALL, [], 1)
    assert cand is not None and cand.pod.name == "tie-bound-first" and tuple(ids) == b


def test_a_relist_keeps_binding_order_and_orders_new_pods_by_creation() -> None:
    book = AssignmentBook(NODE)
    a, b, c = (MIG.instances[n].slice_ids() for n in (1, 2, 3))
    book.upsert(pod("z-known", a, created="2025-01-01T00:00:01Z"))
    book.replace_all([pod("new-late", c, created="2025-01-01T00:00:01Z"),
                      pod("z-known", a, created="2025-01-01T00:00:01Z"),
                      pod("a-new", b, created="2025-01-01T00:00:01Z")])
    assert [c.pod.name for c in book.candidates()] == ["z-known", "a-new", "new-late"]
    book.remove("uid-z-known")
    assert "uid-z-known" not in book.bound_seq


def test_terminal_deleted_and_foreign_node_pods_are_not_candidates() -> None:
    book = AssignmentBook(NODE)
    book.upsert(pod("done", MIG.instances[1].slice_ids(), phase="Succeeded"))
    book.upsert(PodView("default", "elsewhere", "u2", "node-b", "Pending", assignment_ids=MIG.instances[2].slice_ids()))
    book.upsert(pod("gone", MIG.instances[3].slice_ids()))
    book.remove("uid-gone")
    assert book.candidates() == []


def test_preferred_skips_assignments_whose_ids_are_not_available() -> None:
    book = AssignmentBook(NODE)
    a = MIG.instances[1].slice_ids()
    book.upsert(pod("p", a))
    ids, cand = preferred(book, INV, [i for i in ALL if i != a[0]], [], 1)
    assert cand is None
    assert len(ids) == 1 and ids[0] in MIG.instances[2].slice_ids()


def test_preferred_honours_must_include() -> None:
    book = AssignmentBook(NODE)
    book.upsert(pod("p", MPS.slice_ids()[:2]))
    must = [MPS.slice_ids()[5]]
    ids, cand = preferred(book, INV, ALL, must, 2)
    assert cand is None and must[0] in ids and len(ids) == 2


def test_best_fit_prefers_the_tightest_gpu() -> None:
    avail = [*MIG.instances[1].slice_ids(), *MPS.slice_ids()]
    assert best_fit(INV, avail, [], 1) == list(MIG.instances[1].slice_ids())
    assert best_fit(INV, avail, [], 3) == list(MPS.slice_ids()[:3])
    assert best_fit(INV, avail, [], 8) is None


@settings(max_examples=200, deadline=None)
@given(st.sets(st.sampled_from(ALL)), st.integers(min_value=1, max_value=8))
def test_best_fit_always_returns_one_valid_placement(avail: set[str], size: int) -> None:
    choice = best_fit(INV, sorted(avail), [], size)
    if choice is not None:
        assert len(choice) == size and set(choice) <= avail
        check_placement(INV, choice)


def test_check_placement_accepts_valid_sets() -> None:
    p = check_placement(INV, MIG.instances[3].slice_ids())
    assert p.mode == "mig" and p.instance == MIG.instances[3].uuid and p.memory_mib == MIG.instances[3].memory_mib
    p = check_placement(INV, MPS.slice_ids()[4:6])
    # 2/7 of what is left after 512 MiB for the MPS server and 256 MiB of context per slice
    assert p.mode == "mps" and p.memory_mib == (MPS.memory_mib - 512 - 7 * 256) * 2 // MPS.slices


def test_check_placement_refusals_say_why() -> None:
    cases = {
        "one MIG instance": [MIG.instances[1].slice_ids()[0], MIG.instances[2].slice_ids()[0]],
        "every slice of its instance": [MIG.instances[0].slice_ids()[0]],
        "different modes": [MIG.instances[1].slice_ids()[0], MPS.slice_ids()[0]],
        "not advertised": ["GPU-00000000-0000-0000-0000-000000000000::0"],
        "not of the form": ["bogus"],
        "no device ids": [],
    }
    for needle, ids in cases.items():
        try:
            check_placement(INV, ids)
        except PlacementRefused as exc:
            assert needle in str(exc), (needle, str(exc))
        else:
            raise AssertionError(f"{ids} accepted")


def _raw(uid: str, assignment_uid: str, node: str) -> dict[str, object]:
    ids = list(MIG.instances[1].slice_ids())
    assignment = (f'{{"v":1,"podUID":"{assignment_uid}","node":"{node}","gpus":["{MIG.uuid}"],'
                  f'"instance":"{MIG.instances[1].uuid}","sliceIds":{json.dumps(ids)},'
                  '"policy":"fragmentation","scores":{},"time":"2025-01-01T00:00:05Z"}')
    stamp = f'{{"v":1,"sliceIds":{json.dumps(ids)},"time":"2025-01-01T00:00:09Z"}}'
    return {"metadata": {"name": "p", "namespace": "ns", "uid": uid, "creationTimestamp": "2025-01-01T00:00:00Z",
                         "annotations": {"example.com/gpu-slice.assignment": assignment,
                                         "example.com/gpu-slice.allocated": stamp}},
            "spec": {"nodeName": NODE}, "status": {"phase": "Running"}}


def test_pod_view_decodes_assignment_and_stamp() -> None:
    view = pod_view(_raw("u1", "u1", NODE), NODE)
    assert view.assignment_ids == MIG.instances[1].slice_ids()
    assert view.allocated_ids == MIG.instances[1].slice_ids()
    assert view.assigned_at == "2025-01-01T00:00:05Z" and view.phase == "Running"


def test_pod_view_ignores_copied_or_foreign_assignments() -> None:
    assert pod_view(_raw("u1", "someone-else", NODE), NODE).assignment_ids is None
    assert pod_view(_raw("u1", "u1", "node-b"), NODE).assignment_ids is None


def test_an_allocate_note_never_seen_by_pod_resources_expires() -> None:
    from deviceplugin.assignments import LOCAL_NOTE_TTL_S

    book = AssignmentBook(NODE)
    x = MIG.instances[1].slice_ids()
    book.note_allocated(x, now=100.0)
    book.upsert(pod("b", x, "2025-01-01T00:00:01Z"))
    book.set_admitted({}, now=100.0 + LOCAL_NOTE_TTL_S - 1)
    assert book.candidates() == []  # still held by the recent Allocate
    book.set_admitted({}, now=100.0 + LOCAL_NOTE_TTL_S)
    assert [c.pod.name for c in book.candidates()] == ["b"]
