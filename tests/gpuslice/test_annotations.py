"""The annotation contract (DESIGN 3): hand-written wire JSON, refusals, and round-trips."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuslice import annotations as ann
from gpuslice.annotations import Allocated, Assignment
from gpuslice.catalogue import PRODUCTS
from gpuslice.errors import AnnotationError
from gpuslice.fakecluster import random_mig_layout
from gpuslice.model import Gpu, GpuMode, MigInstance

GPU_A = "GPU-5f3b9c1e-2a4d-4e6f-8a1b-3c5d7e9f0a12"
GPU_B = "GPU-0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9"
MIG_A = "MIG-7a1e2b3c-4d5e-5f60-8172-93a4b5c6d7e8"
MIG_B = "MIG-11111111-2222-5333-8444-555555555555"

# Written by hand from DESIGN 3, not produced by the encoder.
INVENTORY_JSON = """
{"v": 1,
 "gpus": [
  {"uuid": "GPU-5f3b9c1e-2a4d-4e6f-8a1b-3c5d7e9f0a12", "index": 0, "product": "H100-80GB",
   "memoryMiB": 81559, "mode": "mig", "slices": 7, "healthy": true, "cordoned": false,
   "instances": [
     {"uuid": "MIG-7a1e2b3c-4d5e-5f60-8172-93a4b5c6d7e8", "profile": "4g.40gb", "start": 0,
      "slices": 4, "memoryMiB": 40448},
     {"uuid": "MIG-11111111-2222-5333-8444-555555555555", "profile": "3g.40gb", "start": 4,
      "slices": 3, "memoryMiB": 40448}]},
  {"uuid": "GPU-0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9", "index": 1, "product": "H100-80GB",
   "memoryMiB": 81559, "mode": "mps", "slices": 7, "healthy": false, "cordoned": true,
   "instances": []}
 ]}
"""

ASSIGNMENT_JSON = """
{"v": 1, "podUID": "3f2a6c1e-8d7b-4a5c-9e0f-1b2c3d4e5f60", "node": "gpu-node-007",
 "gpus": ["GPU-5f3b9c1e-2a4d-4e6f-8a1b-3c5d7e9f0a12"],
 "instance": "MIG-11111111-2222-5333-8444-555555555555",
 "sliceIds": ["MIG-11111111-2222-5333-8444-555555555555::0",
              "MIG-11111111-2222-5333-8444-555555555555::1",
              "MIG-11111111-2222-5333-8444-555555555555::2"],
 "policy": "fragmentation", "scores": {"fragmentation": 0.75, "utilization": 1},
 "time": "2025-03-04T05:06:07.5+01:00"}
"""

ALLOCATED_JSON = """{"v":1,"sliceIds":["GPU-0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9::3",
 "GPU-0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9::4"],"time":"2025-03-04T04:06:09Z"}"""


def pod(uid: str, assignment: str | None = None) -> dict[str, object]:
    annotations = {} if assignment is None else {ann.ASSIGNMENT_KEY: assignment}
    return {"metadata": {"name": "p", "namespace": "ns", "uid": uid, "annotations": annotations}}


# --------------------------------------------------------------------------- hand-written fixtures

def test_inventory_fixture_decodes() -> None:
    gpus = ann.decode_inventory(INVENTORY_JSON)
    assert [g.uuid for g in gpus] == [GPU_A, GPU_B]
    mig, mps = gpus
    assert mig.mode == "mig" and mig.slices == 7 and mig.memory_mib == 81559
    assert mig.instances == (MigInstance(MIG_A, "4g.40gb", 0, 4, 40448), MigInstance(MIG_B, "3g.40gb", 4, 3, 40448))
    assert mps.mode == "mps" and not mps.healthy and mps.cordoned and mps.instances == ()


def test_assignment_fixture_decodes() -> None:
    a = ann.decode_assignment(ASSIGNMENT_JSON)
    assert a.pod_uid == "3f2a6c1e-8d7b-4a5c-9e0f-1b2c3d4e5f60"
    assert a.node == "gpu-node-007"
    assert a.gpus == (GPU_A,)
    assert a.instance == MIG_B
    assert a.slice_ids == (f"{MIG_B}::0", f"{MIG_B}::1", f"{MIG_B}::2")
    assert a.size == 3
    assert a.policy == "fragmentation"
    assert dict(a.scores) == {"fragmentation": 0.75, "utilization": 1.0}
    assert a.time == datetime(2025, 3, 4, 4, 6, 7, 500000, tzinfo=UTC)


def test_allocated_fixture_decodes() -> None:
    al = ann.decode_allocated(ALLOCATED_JSON)
    assert al.slice_ids == (f"{GPU_B}::3", f"{GPU_B}::4")
    assert al.time == datetime(2025, 3, 4, 4, 6, 9, tzinfo=UTC)


def test_encoding_is_sorted_and_compact() -> None:
    a = ann.decode_assignment(ASSIGNMENT_JSON)
    text = ann.encode_assignment(a)
    assert text == (
        '{"gpus":["GPU-5f3b9c1e-2a4d-4e6f-8a1b-3c5d7e9f0a12"],'
        '"instance":"MIG-11111111-2222-5333-8444-555555555555",'
        '"node":"gpu-node-007","podUID":"3f2a6c1e-8d7b-4a5c-9e0f-1b2c3d4e5f60","policy":"fragmentation",'
        '"scores":{"fragmentation":0.75,"utilization":1.0},'
        '"sliceIds":["MIG-11111111-2222-5333-8444-555555555555::0",'
        '"MIG-11111111-2222-5333-8444-555555555555::1","MIG-11111111-2222-5333-8444-555555555555::2"],'
        '"time":"2025-03-04T04:06:07.500000Z","v":1}')
    assert ann.encode_allocated(ann.decode_allocated(ALLOCATED_JSON)) == (
        '{"sliceIds":["GPU-0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9::3",'
        '"GPU-0b1c2d3e-4f50-4617-8293-a4b5c6d7e8f9::4"],"time":"2025-03-04T04:06:09Z","v":1}')


def test_unknown_fields_are_ignored_for_rolling_updates() -> None:
    obj = json.loads(ALLOCATED_JSON)
    obj["futureOptionalField"] = {"x": 1}
    assert ann.decode_allocated(json.dumps(obj)).slice_ids == (f"{GPU_B}::3", f"{GPU_B}::4")


# --------------------------------------------------------------------------- refusals

@pytest.mark.parametrize(("text", "message"), [
    ("{", "example.com/gpu-slice.assignment is not valid JSON: Expecting property name enclosed in double "
          "quotes: line 1 column 2 (char 1)"),
    ("", "example.com/gpu-slice.assignment is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    ("[1]", "example.com/gpu-slice.assignment must be a JSON object, got array"),
    ('"v"', "example.com/gpu-slice.assignment must be a JSON object, got string"),
    ("{}", 'example.com/gpu-slice.assignment has no version field "v"; this build reads version 1'),
    ('{"v": "1"}', "example.com/gpu-slice.assignment: field v must be an integer version, got string"),
    ('{"v": true}', "example.com/gpu-slice.assignment: field v must be an integer version, got boolean"),
    ('{"v": 2}', "unsupported version 2 of example.com/gpu-slice.assignment; this build reads version 1"),
    ('{"v": 0, "podUID": "x"}', "unsupported version 0 of example.com/gpu-slice.assignment; "
                                "this build reads version 1"),
    ('{"v": 1, "v": 1}', "example.com/gpu-slice.assignment is not valid JSON: key 'v' appears twice"),
    ('{"v": NaN}', "example.com/gpu-slice.assignment is not valid JSON: NaN is not valid JSON"),
])
def test_assignment_envelope_refusals(text: str, message: str) -> None:
    with pytest.raises(AnnotationError) as err:
        ann.decode_assignment(text)
    assert str(err.value) == message


def _assignment(**changes: object) -> str:
    obj = json.loads(ASSIGNMENT_JSON)
    for key, value in changes.items():
        if value is ...:
            del obj[key]
        else:
            obj[key] = value
    return json.dumps(obj)


@pytest.mark.parametrize(("changes", "message"), [
    ({"podUID": ...}, "example.com/gpu-slice.assignment: missing field podUID"),
    ({"node": ...}, "example.com/gpu-slice.assignment: missing field node"),
    ({"time": ...}, "example.com/gpu-slice.assignment: missing field time"),
    ({"instance": ...}, "example.com/gpu-slice.assignment: missing field instance"),
    ({"scores": ...}, "example.com/gpu-slice.assignment: missing field scores"),
    ({"podUID": 7}, "example.com/gpu-slice.assignment: field podUID must be a non-empty string, got number"),
    ({"podUID": ""}, "example.com/gpu-slice.assignment: field podUID must be a non-empty string, got string"),
    ({"gpus": "GPU-x"}, "example.com/gpu-slice.assignment: field gpus must be an array, got string"),
    ({"sliceIds": [1]}, "example.com/gpu-slice.assignment: field sliceIds must be an array of strings, "
                        "got an array holding number"),
    ({"instance": 3}, "example.com/gpu-slice.assignment: field instance must be a non-empty string or null, "
                      "got number"),
    ({"scores": []}, "example.com/gpu-slice.assignment: field scores must be an object, got array"),
    ({"scores": {"a": "high"}}, "example.com/gpu-slice.assignment: scores.a must be a finite number, got 'high'"),
    ({"time": "yesterday"}, "example.com/gpu-slice.assignment: field time 'yesterday' is not an RFC 3339 "
                            "timestamp such as 2025-01-01T00:00:00Z"),
    ({"time": "2025-03-04T05:06:07"}, "example.com/gpu-slice.assignment: field time '2025-03-04T05:06:07' is "
                                      "not an RFC 3339 timestamp such as 2025-01-01T00:00:00Z"),
    ({"time": "2025-02-30T00:00:00Z"}, "example.com/gpu-slice.assignment: field time '2025-02-30T00:00:00Z' "
                                       "is not a valid date and time: day is out of range for month"),
    ({"sliceIds": ["MIG-11111111-2222-5333-8444-555555555555:0"]},
     "example.com/gpu-slice.assignment: sliceIds: device id 'MIG-11111111-2222-5333-8444-555555555555:0' "
     "is not of the form <uuid>::<n>"),
    ({"sliceIds": ["MIG-11111111-2222-5333-8444-555555555555::01"]},
     "example.com/gpu-slice.assignment: sliceIds: device id 'MIG-11111111-2222-5333-8444-555555555555::01' "
     "has an invalid slice ordinal '01'"),
    ({"sliceIds": [f"{MIG_A}::0"]},
     f"example.com/gpu-slice.assignment: sliceIds: {MIG_A}::0 does not belong to {MIG_B}"),
    ({"sliceIds": [f"{MIG_B}::0", f"{MIG_B}::0"]},
     "example.com/gpu-slice.assignment: sliceIds lists a slice id twice"),
    ({"sliceIds": []}, "example.com/gpu-slice.assignment: sliceIds must list at least one slice id"),
    ({"gpus": []}, "example.com/gpu-slice.assignment: gpus must name at least one GPU"),
    ({"gpus": [GPU_A, GPU_B]}, "example.com/gpu-slice.assignment: a MIG assignment (instance set) must name "
                               "exactly one GPU"),
    ({"gpus": ["GPU a"]}, "example.com/gpu-slice.assignment: gpus: device owner 'GPU a' must be a GPU or MIG "
                          "UUID without ':'"),
    ({"instance": None}, f"example.com/gpu-slice.assignment: sliceIds: {MIG_B}::0 does not belong to {GPU_A}"),
])
def test_assignment_field_refusals(changes: dict[str, object], message: str) -> None:
    with pytest.raises(AnnotationError) as err:
        ann.decode_assignment(_assignment(**changes))
    assert str(err.value) == message


def test_assignment_for_pod_checks_uid() -> None:
    good = pod("3f2a6c1e-8d7b-4a5c-9e0f-1b2c3d4e5f60", ASSIGNMENT_JSON)
    assert ann.decode_assignment_for(good) is not None
    assert ann.decode_assignment_for(pod("any")) is None
    with pytest.raises(AnnotationError) as err:
        ann.decode_assignment_for(pod("0000-other", ASSIGNMENT_JSON))
    assert str(err.value) == ("example.com/gpu-slice.assignment is for pod UID "
                              "'3f2a6c1e-8d7b-4a5c-9e0f-1b2c3d4e5f60', but this pod's metadata.uid is '0000-other'")


def test_allocated_for_pod() -> None:
    p = {"metadata": {"uid": "u", "annotations": {ann.ALLOCATED_KEY: ALLOCATED_JSON}}}
    assert ann.decode_allocated_for(p) == ann.decode_allocated(ALLOCATED_JSON)
    assert ann.decode_allocated_for({"metadata": {"uid": "u"}}) is None
    with pytest.raises(AnnotationError, match=r"unsupported version 3 of example.com/gpu-slice.allocated"):
        ann.decode_allocated('{"v":3}')
    with pytest.raises(AnnotationError) as err:
        ann.decode_allocated('{"v":1,"time":"2025-01-01T00:00:00Z"}')
    assert str(err.value) == "example.com/gpu-slice.allocated: missing field sliceIds"


def _inventory(mutate: object) -> str:
    obj = json.loads(INVENTORY_JSON)
    assert callable(mutate)
    mutate(obj)
    return json.dumps(obj)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda o: o.pop("gpus"), "example.com/gpu-slice.inventory: missing field gpus"),
    (lambda o: o["gpus"].append(3), "example.com/gpu-slice.inventory: gpus[2] must be an object, got number"),
    (lambda o: o["gpus"][1].pop("healthy"), "example.com/gpu-slice.inventory: missing field gpus[1].healthy"),
    (lambda o: o["gpus"][1].update(healthy="yes"),
     "example.com/gpu-slice.inventory: field gpus[1].healthy must be a boolean, got string"),
    (lambda o: o["gpus"][1].update(index=1.0),
     "example.com/gpu-slice.inventory: field gpus[1].index must be an integer, got number"),
    (lambda o: o["gpus"][1].update(index=-1),
     "example.com/gpu-slice.inventory: field gpus[1].index must be >= 0, got -1"),
    (lambda o: o["gpus"][1].update(mode="time-slicing"),
     "example.com/gpu-slice.inventory: gpus[1]: field mode must be one of mig, mps, whole, got 'time-slicing'"),
    (lambda o: o["gpus"][1].update(index=0), "example.com/gpu-slice.inventory: GPU index 0 is listed twice"),
    (lambda o: o["gpus"][1].update(uuid=GPU_A),
     f"example.com/gpu-slice.inventory: UUID {GPU_A} is listed twice"),
    (lambda o: o["gpus"][0]["instances"][1].update(start=3),
     f"example.com/gpu-slice.inventory: gpus[0]: GPU {GPU_A}: instance {MIG_B} (3g.40gb) cannot start at "
     "memory slice 3; legal starts [0, 4]"),
    (lambda o: o["gpus"][0]["instances"][1].pop("profile"),
     "example.com/gpu-slice.inventory: missing field gpus[0].instances[1].profile"),
    (lambda o: o["gpus"][0]["instances"][1].update(uuid="MIG bad"),
     "example.com/gpu-slice.inventory: gpus[0].instances[1]: uuid: device owner 'MIG bad' must be a GPU or "
     "MIG UUID without ':'"),
    (lambda o: o["gpus"][0].update(slices=6),
     f"example.com/gpu-slice.inventory: gpus[0]: GPU {GPU_A}: slices=6 but its MIG instances hold 7"),
    (lambda o: o["gpus"][0].update(product="B200"),
     "example.com/gpu-slice.inventory: gpus[0]: unknown GPU product 'B200'; known: A100-40GB, A100-80GB, "
     "H100-80GB, H200-141GB, A30-24GB, L4, L40S, A10, T4, P100, V100M16, V100M32, G1, G2, G3"),
    (lambda o: o["gpus"][1].update(slices=0),
     f"example.com/gpu-slice.inventory: gpus[1]: GPU {GPU_B}: slices must be at least 1, got 0"),
    (lambda o: o.update(v=2), "unsupported version 2 of example.com/gpu-slice.inventory; this build reads version 1"),
])
def test_inventory_refusals(mutate: object, message: str) -> None:
    with pytest.raises(AnnotationError) as err:
        ann.decode_inventory(_inventory(mutate))
    assert str(err.value) == message


def test_inventory_refuses_non_string() -> None:
    with pytest.raises(AnnotationError, match=r"must be a JSON string, got object"):
        ann.decode_inventory({"v": 1})


def test_assignment_constructor_refuses_naive_time() -> None:
    with pytest.raises(AnnotationError, match=r"time must be timezone-aware"):
        Assignment("u", "n", (GPU_A,), None, (f"{GPU_A}::0",), "p", datetime(2025, 1, 1))


def test_cordon_annotation() -> None:
    assert ann.parse_cordon(None) == frozenset()
    assert ann.parse_cordon(f" {GPU_A}, {GPU_B},") == {GPU_A, GPU_B}
    assert ann.encode_cordon([GPU_B, GPU_A, GPU_B]) == f"{GPU_B},{GPU_A}"
    with pytest.raises(AnnotationError) as err:
        ann.parse_cordon(MIG_A)
    assert str(err.value) == f"example.com/gpu-slice.cordon: '{MIG_A}' is not a GPU UUID (GPU-…)"


def test_time_codec() -> None:
    assert ann.format_time(datetime(2025, 1, 1, 1, tzinfo=timezone(timedelta(hours=1)))) == "2025-01-01T00:00:00Z"
    assert ann.parse_time("2025-01-01T00:00:00.123456789z") == datetime(2025, 1, 1, 0, 0, 0, 123456, tzinfo=UTC)
    with pytest.raises(AnnotationError, match=r"has no timezone"):
        ann.format_time(datetime(2025, 1, 1))


def test_label_keys() -> None:
    assert ann.MODE_LABEL == "example.com/gpu-slice.mode"
    assert ann.PRODUCT_LABEL == "example.com/gpu-slice.product"
    assert ann.CORDON_KEY == "example.com/gpu-slice.cordon"
    assert ann.HOURLY_COST_KEY == "example.com/hourly-cost"
    assert ann.SIMULATED_UTILIZATION_KEY == "example.com/simulated-utilization"


# --------------------------------------------------------------------------- round-trip properties

_hex = st.text("0123456789abcdef", min_size=8, max_size=8)
uuids = st.builds(lambda a, b: f"{a}-{b}", _hex, _hex)
_zones = [UTC, timezone(timedelta(hours=-7)), timezone(timedelta(hours=5, minutes=30))]
times = st.datetimes(min_value=datetime(1970, 1, 1), max_value=datetime(2200, 1, 1),
                     timezones=st.sampled_from(_zones))
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
names = st.text(st.characters(codec="utf-8", categories=("L", "N", "P", "S", "Zs")), min_size=1, max_size=12)


@st.composite
def assignments(draw: st.DrawFn) -> Assignment:
    mig = draw(st.booleans())
    gpus: tuple[str, ...]
    if mig:
        gpus = (f"GPU-{draw(uuids)}",)
        instance: str | None = f"MIG-{draw(uuids)}"
        owners = [instance]
    else:
        gpus = tuple(f"GPU-{u}" for u in draw(st.lists(uuids, min_size=1, max_size=4, unique=True)))
        instance = None
        owners = list(gpus)
    ordinals = draw(st.lists(st.tuples(st.sampled_from(owners), st.integers(0, 999)), min_size=1, max_size=10,
                             unique=True))
    return Assignment(
        pod_uid=draw(names), node=draw(names), gpus=gpus, instance=instance,
        slice_ids=tuple(f"{o}::{n}" for o, n in ordinals), policy=draw(names), time=draw(times),
        scores=draw(st.dictionaries(names, finite, max_size=4)))


@given(assignments())
def test_assignment_round_trip(a: Assignment) -> None:
    text = ann.encode_assignment(a)
    back = ann.decode_assignment(text)
    assert back == a
    assert ann.encode_assignment(back) == text  # deterministic


@given(st.lists(st.builds(lambda u, n: f"GPU-{u}::{n}", uuids, st.integers(0, 10**6)), min_size=1,
                unique=True), times)
def test_allocated_round_trip(slice_ids: list[str], when: datetime) -> None:
    al = Allocated(tuple(slice_ids), when)
    assert ann.decode_allocated(ann.encode_allocated(al)) == al


@st.composite
def inventories(draw: st.DrawFn) -> tuple[Gpu, ...]:
    count = draw(st.integers(1, 6))
    gpus = []
    for index in range(count):
        product = draw(st.sampled_from(["H100-80GB", "A30-24GB", "L4", "H200-141GB"]))
        prod = PRODUCTS[product]
        modes: list[GpuMode] = ["mig", "mps", "whole"] if prod.mig_capable else ["mps", "whole"]
        mode = draw(st.sampled_from(modes))
        uuid = f"GPU-{index}-{draw(uuids)}"
        healthy, cordoned = draw(st.booleans()), draw(st.booleans())
        assert prod.memory_mib is not None
        if mode == "mig":
            layout = random_mig_layout(prod, random.Random(draw(st.integers(0, 2**32))))
            insts = tuple(MigInstance(f"MIG-{index}-{n}-{draw(uuids)}", p.name, s, p.compute_slices, p.memory_mib)
                          for n, (p, s) in enumerate(layout))
            gpus.append(Gpu(uuid, index, product, prod.memory_mib, "mig", sum(i.compute_slices for i in insts),
                            healthy, cordoned, insts))
        else:
            gpus.append(Gpu(uuid, index, product, prod.memory_mib, mode, draw(st.integers(1, 48)), healthy,
                            cordoned))
    return tuple(gpus)


@given(inventories())
def test_inventory_round_trip(gpus: tuple[Gpu, ...]) -> None:
    text = ann.encode_inventory(gpus)
    assert ann.decode_inventory(text) == gpus
    assert json.loads(text)["v"] == 1


def test_hostile_annotations_raise_the_typed_error() -> None:
    import json as _json

    with pytest.raises(AnnotationError, match="nested too deeply"):
        ann.decode_assignment("[" * 200_000)
    early = _json.dumps({"v": 1, "sliceIds": ["GPU-a::0"], "time": "0001-01-01T00:00:00+01:00"})
    with pytest.raises(AnnotationError, match="is not a valid date and time"):
        ann.decode_allocated(early)


def test_inventory_gpu_instance_id_is_optional_and_round_trips() -> None:
    """``gpuInstanceId`` (dcgm-exporter's GPU_I_ID) of a MIG instance: written by hand, read; an inventory
    without it (an older plugin) still reads, with no id."""
    text = INVENTORY_JSON.replace('"slices": 3, "memoryMiB": 40448}', '"slices": 3, "memoryMiB": 40448, '
                                                                       '"gpuInstanceId": 2}')
    mig, _ = ann.decode_inventory(text)
    assert [i.gi for i in mig.instances] == [None, 2]
    assert ann.decode_inventory(ann.encode_inventory((mig,)))[0].instances == mig.instances
    text_out = ann.encode_inventory((mig,))
    assert '"gpuInstanceId":2' in text_out and text_out.count("gpuInstance") == 1
    for bad, says in (('"gpuInstanceId": -1', "must be >= 0"), ('"gpuInstanceId": "2"', "must be an integer"),
                      ('"gpuInstanceId": true', "must be an integer")):
        with pytest.raises(AnnotationError, match=says):
            ann.decode_inventory(text.replace('"gpuInstanceId": 2', bad))
