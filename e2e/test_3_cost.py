"""Scenario 3: cost. New pods prefer the node pool made cheaper in the price data, all else equal.

Two nodes offer MPS A100s (``gpu-mps`` and ``gpu-mix``); the price data is each node's
``example.com/hourly-cost`` annotation, which wins over OpenCost and the price table. A 1-slice MPS
pod first lands with both nodes priced the same (where packing alone puts it); then the node it did
*not* choose is made four times cheaper and the same pod lands there; then the prices swap and it
lands on the other. So the price, and nothing else, moved it.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from e2e.harness import ASSIGNMENT, System, ann_of, clean, counts_dict, place_and_remove, slice_pod, wait

pytestmark = pytest.mark.timeout(300)

COST = "example.com/hourly-cost"
POOL = ("gpu-mps", "gpu-mix")


def _price(system: System, prices: dict[str, str | None]) -> None:
    for node, value in prices.items():
        system.kube.patch_node(node, {"metadata": {"annotations": {COST: value}}})
    # The extenders see node changes on their watch; give it a moment past the API write.
    wait("the nodes' prices written", lambda: all(
        ann_of(system.kube.node(n)).get(COST) == v for n, v in prices.items()), 30)
    time.sleep(2)


def _place_one(system: System, name: str) -> str:
    pod = place_and_remove(system, slice_pod(name, 1, isolation="mps"))
    node: str = json.loads(ann_of(pod)[ASSIGNMENT])["node"]
    return node


def test_cheaper_pool_is_preferred(system: System, record: dict[str, Any]) -> None:
    try:
        _price(system, dict.fromkeys(POOL, "20"))
        packing = _place_one(system, "cost-equal")
        other = next(n for n in POOL if n != packing)
        _price(system, {packing: "20", other: "5"})
        cheap = _place_one(system, "cost-cheap")
        _price(system, {packing: "5", other: "20"})
        back = _place_one(system, "cost-back")
        record.update(equal_prices=packing, cheaper_other=cheap, prices_swapped=back)
        assert cheap == other, f"with {other} four times cheaper the pod still went to {cheap}"
        assert back == packing, f"with {packing} cheaper again the pod went to {back}"
        counts = system.settle_and_audit()
        record["counts"] = counts_dict(counts)
        assert not counts.bad(), counts.problems
    finally:
        _price(system, dict.fromkeys(POOL))
    clean(system)
