"""ClusterView's assumed binds and reservation lifetimes (DESIGN 4): the books never roll back.

Our own binds are assumed until the cluster confirms them; a relist or an event older than the bind
leaves the slices counted; a pod's deletion releases what it held or reserved."""

from __future__ import annotations

from gpuslice.reservations import Reservation
from gpuslice.view import ASSUMED_TTL_S, ClusterView
from tests.gpuslice.test_view import NOW, gpu_uuid, mps_gpu, node_obj, pod_obj, sids, snapshot


def free_slices(view: ClusterView) -> int:
    st = view.state
    return int(sum(int(st.unit_free[r]) for n in view.nodes.values() for r in n.row_ids))


def cluster() -> tuple[ClusterView, dict[str, object], dict[str, object]]:
    """One MPS H100 node; a pending 7-slice pod ``p`` and the same pod as our bind left it."""
    view = ClusterView()
    view.replace_nodes([node_obj("n", [mps_gpu("n", 0)])])
    pending = pod_obj("p", 7, phase="Pending")
    view.replace_pods([pending], NOW)
    bound = pod_obj("p", 7, node="n", assigned=sids(gpu_uuid("n", 0), 7))
    return view, pending, bound


def test_a_relist_older_than_our_bind_leaves_the_books_unchanged() -> None:
    view, pending, bound = cluster()
    assert free_slices(view) == 7
    view.assume(bound, NOW)
    assert free_slices(view) == 0
    before = snapshot(view)
    view.replace_pods([pending], NOW + 1)     # listed before the bind: the pod unbound
    assert snapshot(view) == before
    view.replace_pods([], NOW + 2)            # listed before the pod existed
    assert snapshot(view) == before and "p" in view.assumed
    view.upsert_pod(pending, NOW + 3)          # an event older than the bind
    assert snapshot(view) == before


def test_the_watch_confirms_an_assumed_bind_and_later_events_apply() -> None:
    view, _pending, bound = cluster()
    view.assume(bound, NOW)
    view.upsert_pod(bound, NOW + 1)
    assert "p" not in view.assumed and free_slices(view) == 0
    view.upsert_pod(pod_obj("p", 7, node="n", assigned=sids(gpu_uuid("n", 0), 7), phase="Succeeded"), NOW + 2)
    assert free_slices(view) == 7


def test_a_relist_that_shows_the_bind_confirms_it() -> None:
    view, _pending, bound = cluster()
    view.assume(bound, NOW)
    view.replace_pods([bound], NOW + 1)
    assert not view.assumed and free_slices(view) == 0


def test_deleting_an_assumed_pod_frees_its_slices() -> None:
    view, _pending, bound = cluster()
    view.assume(bound, NOW)
    view.remove_pod("p")
    assert not view.assumed and free_slices(view) == 7


def test_an_unconfirmed_assumption_ends_after_its_ttl_as_the_cluster_last_said() -> None:
    view, _pending, bound = cluster()
    view.assume(bound, NOW)
    view.replace_pods([], NOW + 1)              # a relist without the pod: it was deleted meanwhile
    view.expire(NOW + ASSUMED_TTL_S - 1)
    assert free_slices(view) == 0
    view.expire(NOW + ASSUMED_TTL_S + 1)
    assert free_slices(view) == 7 and "p" not in view.pods
    # Without any report after the bind, the bind is what the view knows: it stays.
    view2, _, bound2 = cluster()
    view2.assume(bound2, NOW)
    view2.expire(NOW + ASSUMED_TTL_S + 1)
    assert free_slices(view2) == 0 and not view2.assumed
    # A last report without the bind is applied when the assumption ends.
    view3, pending3, bound3 = cluster()
    view3.assume(bound3, NOW)
    view3.upsert_pod(pending3, NOW + 1)
    view3.expire(NOW + ASSUMED_TTL_S + 1)
    assert free_slices(view3) == 7 and view3.pods["p"].info.node == ""


def test_a_deleted_pod_releases_its_reservation_at_once() -> None:
    view, _pending, _bound = cluster()
    g = gpu_uuid("n", 0)
    view.hold(Reservation("p", "n", ((g, ""),), 3, sids(g, 3), 0, 0, "", NOW + 60))
    assert free_slices(view) == 4
    view.remove_pod("p")
    assert free_slices(view) == 7 and "p" not in view.reservations
    # A reservation of a pod the view never held goes too, on its deletion event.
    view.hold(Reservation("ghost", "n", ((g, ""),), 2, sids(g, 2), 0, 0, "", NOW + 60))
    view.remove_pod("ghost")
    assert free_slices(view) == 7


def test_pretend_gone_frees_for_a_moment_and_restores_exactly() -> None:
    view = ClusterView()
    view.replace_nodes([node_obj("n", [mps_gpu("n", 0)])])
    g = gpu_uuid("n", 0)
    view.replace_pods([pod_obj("a", 3, node="n", assigned=sids(g, 3)), pod_obj("b", 2, node="n",
                                                                             assigned=sids(g, 2, 3))], NOW)
    before = snapshot(view)
    with view.pretend_gone(["a"]):
        assert free_slices(view) == 5
    assert snapshot(view) == before
