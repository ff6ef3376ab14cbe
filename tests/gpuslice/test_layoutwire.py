"""The dynamic-layout Node annotations (gpuslice.layoutwire): hand-written wire JSON, round trips, refusals."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gpuslice.errors import AnnotationError
from gpuslice.layoutwire import (
    GpuResult,
    LayoutResults,
    WantedGpu,
    WantedLayouts,
    decode_results,
    decode_wanted,
    encode_results,
    encode_wanted,
)

WANTED = ('{"v": 1, "generation": 7, "time": "2025-01-01T00:00:00Z", "gpus": [{"uuid": "GPU-aaaa", '
          '"instances": [{"profile": "3g.40gb", "start": 4}, {"profile": "1g.10gb", "start": 0}], '
          '"pods": ["uid-1"], "reason": "a Pending pod", "later": true}]}')
RESULTS = ('{"v": 1, "generation": 7, "time": "2025-01-01T00:00:02Z", "gpus": [{"uuid": "GPU-aaaa", '
           '"state": "refused", "message": "MIG instance MIG-x holds ids"}]}')


def test_hand_written_wanted_layout_decodes_and_unknown_fields_are_ignored() -> None:
    w = decode_wanted(WANTED)
    assert w.generation == 7 and w.time == datetime(2025, 1, 1, tzinfo=UTC)
    (g,) = w.gpus
    assert g.uuid == "GPU-aaaa" and g.instances == (("1g.10gb", 0), ("3g.40gb", 4)) and g.pods == ("uid-1",)
    assert w.gpu("GPU-aaaa") is g and w.gpu("GPU-b") is None


def test_hand_written_results_decode() -> None:
    r = decode_results(RESULTS)
    assert r.generation == 7 and r.gpu("GPU-aaaa") == GpuResult("GPU-aaaa", "refused", "MIG instance MIG-x holds ids")


def test_round_trips_are_exact_and_deterministic() -> None:
    when = datetime(2025, 1, 1, 0, 0, 1, tzinfo=UTC)
    w = WantedLayouts(3, when, (WantedGpu("GPU-b", (("7g.80gb", 0),)), WantedGpu("GPU-a", (("1g.10gb", 6),), ("u",))))
    assert decode_wanted(encode_wanted(w)).gpus == tuple(sorted(w.gpus, key=lambda g: g.uuid))
    assert encode_wanted(w) == encode_wanted(decode_wanted(encode_wanted(w)))
    r = LayoutResults(3, when, (GpuResult("GPU-a", "applied", "ok"),))
    assert decode_results(encode_results(r)) == r


@pytest.mark.parametrize("text, message", [
    ('{"v": 2, "generation": 1, "time": "2025-01-01T00:00:00Z", "gpus": []}', "unsupported version 2"),
    ('{"v": 1, "generation": 0, "time": "2025-01-01T00:00:00Z", "gpus": []}', "generation must be >= 1"),
    ('{"v": 1, "generation": 1, "time": "2025-01-01T00:00:00Z", "gpus": [{"uuid": "MIG-x", "instances": []}]}',
     "must be a GPU UUID"),
    ('{"v": 1, "generation": 1, "time": "2025-01-01T00:00:00Z", "gpus": [{"uuid": "GPU-x", "instances": '
     '[{"profile": "1g.10gb", "start": 8}]}]}', "start must be <= 7"),
    ('{"v": 1, "generation": 1, "time": "2025-01-01T00:00:00Z", "gpus": [{"uuid": "GPU-x", "instances": '
     '[{"profile": "1g.10gb", "start": 1}, {"profile": "1g.20gb", "start": 1}]}]}', "same memory slice"),
    ('{"v": 1, "generation": 1, "time": "2025-01-01T00:00:00Z", "gpus": [{"uuid": "GPU-x", "instances": []},'
     ' {"uuid": "GPU-x", "instances": []}]}', "listed twice"),
    ('[1]', "must be a JSON object"),
])
def test_bad_wanted_layouts_are_refused_with_the_field(text: str, message: str) -> None:
    with pytest.raises(AnnotationError, match=message):
        decode_wanted(text)


def test_bad_result_state_is_refused() -> None:
    with pytest.raises(AnnotationError, match="state must be one of applied, refused, failed"):
        decode_results(RESULTS.replace("refused", "done"))
