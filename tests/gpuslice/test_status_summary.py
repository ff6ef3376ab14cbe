"""The cheap summary for gauges (gpuslice.status.Summarizer) says exactly what build_status says about
stranded slices and each Pending pod's cause, on generated clusters and after changes, while packing
each pod only when it changed."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from gpuslice.fakecluster import FakeClusterSpec, generate
from gpuslice.scheduler import Scheduler
from gpuslice.status import CAUSES, ClusterStatus, Summarizer, build_status
from gpuslice.view import ClusterView

from .test_view import A_LAYOUT, NOW, mig_gpu, mps_gpu, node_obj, pod_obj, sids

FAKE_NOW = 1_735_689_600.0  # the fake cluster's 2025-01-01T00:00:00Z


def pending(n: int, *, bad: int = 0) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        mig = i % 3 == 0
        notes = {"example.com/gpu-isolation": "mig" if mig else "mps"}
        slices = "7" if mig else str(1 + i % 6)
        if i < bad:
            notes["example.com/gpu-memory"] = "20GB"  # not a quantity: the request cannot be read
        out.append({"kind": "Pod", "metadata": {"name": f"p-{i}", "namespace": "t", "uid": f"p-{i}",
                                                "annotations": notes, "creationTimestamp": "2025-01-01T00:00:00Z"},
                    "spec": {"schedulerName": "gpu-slice-scheduler", "priority": 1000, "containers": [
                        {"name": "s", "resources": {"requests": {"cpu": "2", "memory": "8Gi"},
                                                    "limits": {"example.com/gpu-slice": slices}}}]},
                    "status": {"phase": "Pending"}})
    return out


def expected(st: ClusterStatus) -> tuple[dict[tuple[str, str], int], Counter[tuple[str, str]]]:
    stranded: Counter[tuple[str, str]] = Counter()
    for n in st.nodes:
        for g in n.gpus:
            for u in g.units:
                if u.stranded:
                    stranded[(g.product, g.mode)] += u.stranded
    causes = Counter((p.cause, next(iter(p.reasons)) if p.cause == "refused" else "") for p in st.pending)
    return dict(stranded), causes


@pytest.mark.parametrize(("mode", "seed", "pods"), [("mixed", 4, 25), ("mig", 5, 25), ("mps", 3, 40)])
def test_the_summary_agrees_with_the_status_on_generated_clusters(mode: str, seed: int, pods: int) -> None:
    fake = generate(FakeClusterSpec(nodes=30, mode=mode, pods_per_node=pods, seed=seed))  # type: ignore[arg-type]
    view = ClusterView.from_objects([*fake.document["items"], *pending(12, bad=2)], FAKE_NOW)
    sched = Scheduler.from_config(view)
    got = Summarizer().summary(view, sched, FAKE_NOW)
    stranded, causes = expected(build_status(view, sched, FAKE_NOW, max_suggestions=0))
    assert got.stranded == stranded
    assert bool(stranded) == (mode != "mps")  # half-full MIG and mixed clusters strand slices; this MPS one not
    assert Counter(got.pending) == causes and len(got.pending) == 12
    assert {c for c, _ in got.pending} <= set(CAUSES) and ("invalid", "") in got.pending


def test_changes_are_followed_and_unchanged_pods_are_not_packed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    mps, mig = mps_gpu("n1", 0), mig_gpu("n1", 1, A_LAYOUT)
    three_g = mig.instances[0]
    objs = [node_obj("n1", [mps, mig]),
            pod_obj("a", 3, node="n1", assigned=sids(three_g.uuid, 3), isolation="mig"),
            pod_obj("b", 2, node="n1", assigned=sids(mps.uuid, 2)),
            pod_obj("p", 7, isolation="mig")]
    view = ClusterView.from_objects(objs, NOW)
    sched = Scheduler.from_config(view)
    summarizer = Summarizer()
    first = summarizer.summary(view, sched, NOW)
    assert first.stranded == expected(build_status(view, sched, NOW))[0]
    assert first.pending == (("refused", first.pending[0][1]),) and "7 compute slices" in first.pending[0][1]

    from gpuslice import pods as pods_module

    packed: list[str] = []
    real_pack = pods_module.PodInfo.pack

    def counting(self: Any, *args: Any, **kw: Any) -> Any:
        packed.append(self.uid)
        return real_pack(self, *args, **kw)

    monkeypatch.setattr(pods_module.PodInfo, "pack", counting)
    again = summarizer.summary(view, sched, NOW)
    assert again == first and packed == ["p"]  # nothing changed: only the Pending pod's request is needed
    packed.clear()
    view.upsert_pod(pod_obj("q", 1, isolation="mps"), NOW)  # fits the MPS GPU
    after = summarizer.summary(view, sched, NOW)
    assert sorted(packed) == ["p", "q"] and sorted(c for c, _ in after.pending) == ["fits", "refused"]
    assert after.stranded == expected(build_status(view, sched, NOW))[0]
    view.remove_pod("p")  # the Pending 7-slice pod and its shape leave
    gone = summarizer.summary(view, sched, NOW)
    assert [c for c, _ in gone.pending] == ["fits"] and set(summarizer._cache) == {"a", "b", "q"}
    assert gone.stranded == expected(build_status(view, sched, NOW))[0] and gone.shapes == 3


def test_pods_are_packed_outside_the_hold_and_only_pending_ones_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """As build_status holds the extender's lock: one step at a time, no packing inside a step."""
    fake = generate(FakeClusterSpec(nodes=5, mode="mixed", pods_per_node=10, seed=1))
    view = ClusterView.from_objects([*fake.document["items"], *pending(3)], FAKE_NOW)
    sched = Scheduler.from_config(view)
    inside: list[bool] = [False]
    steps: list[int] = []

    class Hold:
        def __enter__(self) -> None:
            assert not inside[0], "steps do not nest"
            inside[0] = True
            steps.append(1)

        def __exit__(self, *exc: object) -> None:
            inside[0] = False

    from gpuslice import pods as pods_module

    real_pack = pods_module.PodInfo.pack
    packed: list[str] = []

    def pack(self: Any, *args: Any, **kw: Any) -> Any:
        assert not inside[0], f"pod {self.uid} packed inside a step"
        packed.append(self.uid)
        return real_pack(self, *args, **kw)

    monkeypatch.setattr(pods_module.PodInfo, "pack", pack)
    summarizer = Summarizer()
    first = summarizer.summary(view, sched, FAKE_NOW, hold=Hold)
    slice_pods = sum(1 for p in view.pods.values() if p.info.request is not None)
    assert len(packed) == slice_pods and len(steps) >= 3
    packed.clear()
    assert summarizer.summary(view, sched, FAKE_NOW, hold=Hold) == first
    assert sorted(packed) == ["p-0", "p-1", "p-2"]  # only the Pending pods' requests, again
    monkeypatch.undo()
    assert first == Summarizer().summary(view, sched, FAKE_NOW)
