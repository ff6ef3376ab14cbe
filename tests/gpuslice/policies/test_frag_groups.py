"""FGD's expected fragment, evaluated per group of shapes that differ only in CPU, equals the
definition taken shape by shape (the grouping is how pods with many distinct CPU requests stay fast)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuslice.packing.frag import TargetShapes, TargetWorkload, frags_from_stats
from gpuslice.packing.state import PackRequest

PRODUCTS = ("A100", "H100", "L4")


def by_definition(cnt: np.ndarray, sub: np.ndarray, total: np.ndarray, cpu: np.ndarray, prod: np.ndarray,
                  t: TargetShapes) -> np.ndarray:
    """Shape m hostable (asks GPUs, allowed product, CPU and accepting units enough): its idle slices
    on non-accepting units; otherwise every idle slice. Weighted by m's probability."""
    host = (t.gpus > 0) & (cpu[:, None] >= t.cpu) & t.prod_ok[prod] & (cnt[:, t.kidx] >= t.gpus)
    return np.asarray(np.where(host, sub[:, t.kidx], total[:, None]) @ t.p)


def cpu_by_definition(cnt: np.ndarray, cpu: np.ndarray, prod: np.ndarray, t: TargetShapes) -> np.ndarray:
    """The node's free CPU for each shape it cannot host: a GPU shape as above, a CPU-only shape
    when the node lacks its CPU. Weighted by m's probability."""
    gpu_host = (t.gpus > 0) & (cpu[:, None] >= t.cpu) & t.prod_ok[prod] & (cnt[:, t.kidx] >= t.gpus)
    cpu_host = (t.gpus == 0) & (cpu[:, None] >= t.cpu)
    return np.asarray(np.maximum(cpu, 0) * ((~(gpu_host | cpu_host)) @ t.p))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), pods=st.integers(1, 400), aware=st.booleans())
def test_grouped_fragment_equals_the_per_shape_definition(seed: int, pods: int, aware: bool) -> None:
    rng = np.random.default_rng(seed)
    w = TargetWorkload(aware=aware)
    for _ in range(pods):
        gpus = int(rng.choice([0, 1, 1, 2, 4]))
        slices = int(rng.integers(1, 8)) if gpus == 1 else (7 if gpus else 0)
        products = None if rng.random() < 0.6 else frozenset(
            rng.choice(PRODUCTS, size=int(rng.integers(1, 3)), replace=False).tolist())
        w.observe(PackRequest(cpu_milli=int(rng.integers(0, 40)) * 500, gpus=gpus, slices=slices,
                              products=products, gpu_memory_mib=int(rng.choice([0, 20480])),
                              isolation=str(rng.choice(["any", "mig", "mps"]))))
    t = TargetShapes.build(w, PRODUCTS)
    rows, tests = 64, len(t.tests)
    cnt = rng.integers(0, 9, size=(rows, tests))
    sub = rng.integers(0, 40, size=(rows, tests))
    total = sub.max(axis=1, initial=0) + rng.integers(0, 20, size=rows)
    cpu = rng.integers(-1000, 20000, size=rows)  # removed nodes have -1
    prod = rng.integers(0, len(PRODUCTS), size=rows)
    gpu, cpu_frag = frags_from_stats(cnt, sub, total, cpu, prod, t)
    assert np.allclose(gpu, by_definition(cnt, sub, total, cpu, prod, t), rtol=1e-12, atol=1e-9)
    assert np.allclose(cpu_frag, cpu_by_definition(cnt, cpu, prod, t), rtol=1e-12, atol=1e-6)


def test_many_distinct_cpu_requests_make_few_groups() -> None:
    w = TargetWorkload()
    for c in range(1000):
        w.observe(PackRequest(cpu_milli=1000 + c, gpus=1, slices=2))
    t = TargetShapes.build(w, PRODUCTS)
    assert len(t.p) == 1000 and len(t.groups) == 1
