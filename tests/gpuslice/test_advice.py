"""Right-sizing advice (gpuslice.advice): the smaller slice a pod's peaks fit with headroom, the cases
it refuses to guess, and the cluster totals, over a status built by the decision API."""

from __future__ import annotations

import pytest

from gpuslice.advice import Advice, Holding, Peak, advise, advise_cluster, duration
from gpuslice.catalogue import PRODUCTS
from gpuslice.errors import AdviceError
from gpuslice.rules import mps_share_mib
from gpuslice.scheduler import Scheduler
from gpuslice.status import build_status
from gpuslice.view import ClusterView

from .test_view import A_LAYOUT, NOW, S, mig_gpu, mps_gpu, node_obj, pod_obj, sids, whole_gpu

H100 = "H100-80GB"
H100_MIB = PRODUCTS[H100].memory_mib or 0
GIB = 1024.0


def mig(slices: int, profile: str, floor: float | None = None) -> Holding:
    return Holding(H100, "mig", slices, H100_MIB, 7, profile, floor)


def mps(slices: int, floor: float | None = None) -> Holding:
    return Holding(H100, "mps", slices, H100_MIB, S, "", floor)


def test_an_idle_3g_instance_is_told_the_1g_that_holds_its_peaks() -> None:
    a = advise(mig(3, "3g.40gb"), Peak(6 * GIB, 0.2))
    assert a.advised and (a.slices, a.profile, a.frees, a.floor_mib) == (1, "1g.10gb", 2, 0)
    assert a.memory_mib == PRODUCTS[H100].profile("1g.10gb").memory_mib
    assert "1 slice (1g.10gb)" in a.why and "20 % headroom" in a.why.replace("%", " %")


def test_activity_decides_the_compute_slices_and_memory_the_profile() -> None:
    # 50 % of 3 slices with 20 % headroom: ceil(1.8) = 2 slices of compute
    a = advise(mig(3, "3g.40gb"), Peak(6 * GIB, 0.5))
    assert (a.slices, a.profile) == (2, "2g.20gb")
    # 9 GiB peak: 10.8 GiB with headroom exceeds 1g.10gb (9.75 GiB): 1g.20gb is the smallest that holds it
    a = advise(mig(3, "3g.40gb"), Peak(9 * GIB, 0.1))
    assert (a.slices, a.profile) == (1, "1g.20gb")
    # without headroom the same 9 GiB fits 1g.10gb
    assert advise(mig(3, "3g.40gb"), Peak(9 * GIB, 0.1), headroom=0).profile == "1g.10gb"


def test_a_busy_or_full_pod_is_sized_right() -> None:
    busy = advise(mig(3, "3g.40gb"), Peak(6 * GIB, 0.9))
    assert not busy.advised and busy.why.startswith("sized right")
    full = advise(mig(3, "3g.40gb"), Peak(30 * GIB, 0.1))  # 36 GiB with headroom: only a 3g holds it
    assert not full.advised
    one = advise(mig(1, "1g.10gb"), Peak(0.0, 0.0))
    assert not one.advised  # nothing is smaller than one slice


def test_a_memory_floor_the_smaller_slice_fails_is_lowered_too() -> None:
    a = advise(mig(3, "3g.40gb", floor=36 * GIB), Peak(6 * GIB, 0.2))
    assert a.advised and a.profile == "1g.10gb"
    assert a.floor_mib == round(6 * GIB * 1.2) and f"{a.floor_mib}Mi" in a.why
    assert advise(mig(3, "3g.40gb", floor=8 * GIB), Peak(6 * GIB, 0.2)).floor_mib == 0  # 8Gi passes on 1g.10gb


def test_mps_pods_without_activity_are_advised_on_memory_only_where_slices_cap_only_memory() -> None:
    share3 = mps_share_mib(H100_MIB, 3, S)
    assert share3 > 3 * 10 * GIB
    threads = advise(mps(5), Peak(12 * GIB))
    assert not threads.advised and "memory-and-threads" in threads.why
    a = advise(mps(5), Peak(12 * GIB), mps_limits="memory-only")
    # 14.4 GiB with headroom: two 7ths of the H100 (about 22 GiB) hold it, one (about 11 GiB) does not
    assert a.advised and (a.slices, a.profile, a.frees) == (2, "", 3)
    assert a.memory_mib == mps_share_mib(H100_MIB, 2, S)
    # a measured activity, where one is given, is used on MPS too
    assert advise(mps(5), Peak(4 * GIB, 0.5)).slices == 3


def test_what_is_not_measured_is_said_not_guessed() -> None:
    assert advise(mig(3, "3g.40gb"), Peak(None, 0.1)) == Advice(False, "its GPU memory use is not measured")
    no_activity = advise(mig(3, "3g.40gb"), Peak(4 * GIB))
    assert not no_activity.advised and "activity is not measured" in no_activity.why
    whole = advise(Holding(H100, "whole", 7, H100_MIB, 7), Peak(1.0, 0.0))
    assert not whole.advised and "whole-GPU" in whole.why


@pytest.mark.parametrize(("peak", "headroom", "match"), [
    (Peak(-1.0, 0.1), 0.2, "peak memory"), (Peak(float("nan"), 0.1), 0.2, "peak memory"),
    (Peak(1.0, 60.0), 0.2, "ratio between 0 and 1"), (Peak(1.0, -0.1), 0.2, "ratio between 0 and 1"),
    (Peak(1.0, 0.1), -0.5, "headroom"), (Peak(1.0, 0.1), float("inf"), "headroom")])
def test_figures_the_rule_cannot_use_are_errors(peak: Peak, headroom: float, match: str) -> None:
    with pytest.raises(AdviceError, match=match):
        advise(mig(3, "3g.40gb"), peak, headroom=headroom)


def test_the_advised_slice_is_one_the_filter_takes() -> None:
    """Advice and admission agree: the pod asking the advised slices and floor fits that profile."""
    from gpuslice.remedies import fitting_profile

    a = advise(mig(3, "3g.40gb", floor=36 * GIB), Peak(7 * GIB, 0.2))
    assert fitting_profile(H100, a.slices, a.floor_mib, 0.03) is not None
    assert fitting_profile(H100, a.slices, a.floor_mib, 0.03).name == a.profile  # type: ignore[union-attr]


def test_cluster_advice_lists_every_holder_and_sums_what_is_freed() -> None:
    mpsg, migg, whole = mps_gpu("n1", 0), mig_gpu("n1", 1, A_LAYOUT), whole_gpu("n1", 2)
    three_g = migg.instances[0]
    objs = [node_obj("n1", [mpsg, migg, whole]),
            pod_obj("a", 3, node="n1", assigned=sids(mpsg.uuid, 3), allocated=sids(mpsg.uuid, 3)),
            pod_obj("b", 3, node="n1", assigned=sids(three_g.uuid, 3), gpu_memory="36Gi", isolation="mig"),
            pod_obj("c", S, node="n1", assigned=sids(whole.uuid, S)),
            pod_obj("d", 2, node="n1", assigned=sids(mpsg.uuid, 2, start=3)),
            pod_obj("p", 2)]  # Pending: not a holder
    view = ClusterView.from_objects(objs, NOW)
    st = build_status(view, Scheduler.from_config(view), NOW)
    floors = {"b": 36 * GIB}
    peaks = {"a": Peak(3 * GIB), "b": Peak(5 * GIB, 0.1), "c": Peak(10 * GIB, 0.05),
             "d": Peak(3 * GIB, observed_s=600.0)}
    out = advise_cluster(st, peaks, floors, window_s=3600, mps_limits="memory-only")
    by = {p.uid: p for p in out.pods}
    assert set(by) == {"a", "b", "c", "d"}
    assert by["a"].advice.slices == 1 and by["a"].mode == "mps" and by["a"].memory_mib == mps_share_mib(
        H100_MIB, 3, S)
    assert by["b"].advice.profile == "1g.10gb" and by["b"].advice.floor_mib > 0 and by["b"].profile == "3g.40gb"
    assert not by["c"].advice.advised and "whole-GPU" in by["c"].advice.why
    assert not by["d"].advice.advised and by["d"].advice.why == "measured for only 10m of the last 1h"
    assert {(f.product, f.mode, f.slices) for f in out.freed} == {(H100, "mps", 2), (H100, "mig", 2)}
    assert [p.uid for p in out.advised] == ["a", "b"]
    # a pod without figures is said so
    out = advise_cluster(st, {}, floors, window_s=1800)
    assert {p.advice.why for p in out.pods} == {"no figures for this pod over the last 30m"}
    assert out.freed == ()


def test_duration_reads_as_prometheus_writes_it() -> None:
    assert [duration(s) for s in (0, 45, 90, 3600, 5400, 86400 + 60)] == ["0s", "45s", "1m30s", "1h", "1h30m",
                                                                          "1d1m"]
