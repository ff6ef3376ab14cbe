"""The extender wire format against hand-written JSON from reference/protocols.md 2.2.

Every request fixture below is typed out by hand as kube-scheduler's Go encoder would send it
(PascalCase keys, nil pointers as ``null``, the v1 objects inside in camelCase); none is produced
by ``extender.wire``. Results are checked against hand-written expected JSON key by key.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extender import wire
from extender.errors import WireError
from gpuslice.errors import GpuSliceError

POD = """{
  "metadata": {"name": "llm-0", "namespace": "ml", "uid": "6f1c1c4e-4b8a-4a57-9a5e-0d0f9b7a1c11",
               "labels": {"app": "llm"},
               "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "llm-7d9f",
                                    "uid": "0c5d9a43-1111-4d6b-a1c0-6a2f6f3c0b01", "controller": true}]},
  "spec": {"schedulerName": "gpu-slice-scheduler", "priority": 0,
           "containers": [{"name": "main", "image": "vllm/vllm-openai",
                           "resources": {"limits": {"example.com/gpu-slice": "2"},
                                         "requests": {"example.com/gpu-slice": "2"}}}]},
  "status": {"phase": "Pending"}
}"""

FILTER_NAMES = ('{"Pod":' + POD + ',"Nodes":null,"NodeNames":["n1","n2","n3"]}').encode()

FILTER_NODES = ('{"Pod":' + POD + ''',"Nodes":{"metadata":{},"items":[
  {"metadata":{"name":"n1","labels":{"node.kubernetes.io/instance-type":"p5.48xlarge"}},
   "status":{"allocatable":{"example.com/gpu-slice":"56"}}},
  {"metadata":{"name":"n2"},"spec":{"unschedulable":false}}
]},"NodeNames":null}''').encode()

BIND = b'{"PodName":"p","PodNamespace":"ns","PodUID":"9d0c6a8e-2f2a-4f0e-8b8e-4d3c2b1a0f9e","Node":"n1"}'

PREEMPT_META = ('{"Pod":' + POD + ''',"NodeNameToVictims":null,"NodeNameToMetaVictims":{
  "n1":{"Pods":[{"UID":"a1"},{"UID":"a2"}],"NumPDBViolations":1},
  "n2":{"Pods":[],"NumPDBViolations":0}}}''').encode()

PREEMPT_FULL = ('{"Pod":' + POD + ''',"NodeNameToVictims":{
  "n1":{"Pods":[{"metadata":{"name":"v","namespace":"ml","uid":"a1"},"spec":{"priority":-5}}],
        "NumPDBViolations":0}},"NodeNameToMetaVictims":null}''').encode()


# ------------------------------------------------------------------------------------- requests


def test_filter_request_with_node_names() -> None:
    args = wire.parse_extender_args(FILTER_NAMES)
    assert args.node_cache_capable
    assert args.node_names == ("n1", "n2", "n3")
    assert args.nodes is None
    assert args.candidates == ("n1", "n2", "n3")
    assert args.pod["metadata"]["uid"] == "6f1c1c4e-4b8a-4a57-9a5e-0d0f9b7a1c11"
    assert args.pod["spec"]["containers"][0]["resources"]["limits"] == {"example.com/gpu-slice": "2"}


def test_filter_request_with_a_node_list() -> None:
    args = wire.parse_extender_args(FILTER_NODES)
    assert not args.node_cache_capable
    assert args.candidates == ("n1", "n2")
    assert args.nodes is not None
    assert args.nodes[0]["metadata"]["labels"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}


def test_pod_stays_the_plain_dict_sent() -> None:
    args = wire.parse_extender_args(FILTER_NAMES)
    assert args.pod == json.loads(POD)
    assert type(args.pod) is dict


def test_empty_node_names_and_a_nil_item_list_mean_no_candidates() -> None:
    args = wire.parse_extender_args(('{"Pod":' + POD + ',"NodeNames":[]}').encode())
    assert args.candidates == ()
    args = wire.parse_extender_args(('{"Pod":' + POD + ',"Nodes":{"metadata":{},"items":null}}').encode())
    assert args.candidates == () and args.nodes == ()


def test_unknown_keys_are_ignored() -> None:
    args = wire.parse_extender_args(('{"Pod":' + POD + ',"NodeNames":["n1"],"FutureField":{"x":1}}').encode())
    assert args.candidates == ("n1",)


def test_bind_request() -> None:
    args = wire.parse_binding_args(BIND)
    assert args == wire.ExtenderBindingArgs("p", "ns", "9d0c6a8e-2f2a-4f0e-8b8e-4d3c2b1a0f9e", "n1")


def test_preempt_request_meta_victims() -> None:
    args = wire.parse_preemption_args(PREEMPT_META)
    assert args.meta
    assert args.victims["n1"] == wire.Victims(("a1", "a2"), 1)
    assert args.victims["n2"] == wire.Victims((), 0)


def test_preempt_request_full_victims_keep_the_pods() -> None:
    args = wire.parse_preemption_args(PREEMPT_FULL)
    assert not args.meta
    victims = args.victims["n1"]
    assert victims.pod_uids == ("a1",)
    assert victims.pods is not None and victims.pods[0]["spec"]["priority"] == -5


def test_preempt_request_with_nil_maps_has_no_candidates() -> None:
    args = wire.parse_preemption_args(('{"Pod":' + POD + ',"NodeNameToVictims":null,'
                                       '"NodeNameToMetaVictims":null}').encode())
    assert dict(args.victims) == {}


def test_request_to_json_matches_what_the_scheduler_sends() -> None:
    assert wire.parse_extender_args(FILTER_NAMES).to_json() == json.loads(FILTER_NAMES)
    assert wire.parse_extender_args(FILTER_NODES).to_json() == json.loads(FILTER_NODES)
    assert wire.parse_binding_args(BIND).to_json() == json.loads(BIND)
    assert wire.parse_preemption_args(PREEMPT_META).to_json() == json.loads(PREEMPT_META)
    assert wire.parse_preemption_args(PREEMPT_FULL).to_json() == json.loads(PREEMPT_FULL)


# ------------------------------------------------------------------------------------- results


def roundtrip(value: Any) -> Any:
    return wire.load_json(wire.encode(value))


def test_filter_result_with_node_names_is_the_reference_example() -> None:
    args = wire.parse_extender_args(FILTER_NAMES)
    result = wire.filter_result(args, ["n1"], failed={"n2": "spot too expensive"},
                                failed_unresolvable={"n3": "no GPU"})
    body = json.loads(wire.encode(result.to_json()))
    assert body == {"Nodes": None, "NodeNames": ["n1"], "FailedNodes": {"n2": "spot too expensive"},
                    "FailedAndUnresolvableNodes": {"n3": "no GPU"}, "Error": ""}
    assert list(body) == ["Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"]
    assert wire.parse_filter_result(body) == result


def test_filter_result_with_nodes_returns_the_node_objects_sent() -> None:
    args = wire.parse_extender_args(FILTER_NODES)
    result = wire.filter_result(args, ["n2"], failed={"n1": "no fitting slice"})
    body = json.loads(wire.encode(result.to_json()))
    sent = json.loads(FILTER_NODES)["Nodes"]["items"]
    assert body == {"Nodes": {"metadata": {}, "items": [sent[1]]}, "NodeNames": None,
                    "FailedNodes": {"n1": "no fitting slice"}, "FailedAndUnresolvableNodes": {}, "Error": ""}
    assert wire.parse_filter_result(body).passing == ("n2",)


def test_filter_error_passes_no_node() -> None:
    result = wire.filter_error(wire.parse_extender_args(FILTER_NAMES), "not the leader")
    assert roundtrip(result.to_json()) == {"Nodes": None, "NodeNames": [], "FailedNodes": {},
                                           "FailedAndUnresolvableNodes": {}, "Error": "not the leader"}


def test_filter_result_refuses_nodes_not_offered_or_both_passing_and_failed() -> None:
    args = wire.parse_extender_args(FILTER_NAMES)
    with pytest.raises(ValueError, match="did not offer"):
        wire.filter_result(args, ["n9"])
    with pytest.raises(ValueError, match="both passes and fails"):
        wire.filter_result(args, ["n1"], failed={"n1": "x"})


def test_long_reasons_are_cut() -> None:
    args = wire.parse_extender_args(FILTER_NAMES)
    body = wire.filter_result(args, [], failed={"n1": "x" * 5000}).to_json()
    assert len(body["FailedNodes"]["n1"]) == wire.MAX_REASON_CHARS


def test_host_priority_list_is_a_bare_array() -> None:
    body = roundtrip(wire.host_priority_list([wire.HostPriority("n1", 7), wire.HostPriority("n2", 3)]))
    assert body == [{"Host": "n1", "Score": 7}, {"Host": "n2", "Score": 3}]
    assert wire.encode(wire.host_priority_list({"n1": 10})) == b'[{"Host":"n1","Score":10}]'
    assert wire.parse_host_priority_list(body) == (wire.HostPriority("n1", 7), wire.HostPriority("n2", 3))


@pytest.mark.parametrize("score", [-1, 11, 7.0, True, "7"])
def test_host_priority_refuses_scores_the_scheduler_cannot_use(score: Any) -> None:
    with pytest.raises(ValueError):
        wire.HostPriority("n1", score)


def test_host_priorities_from_pairs_match_the_list_of_objects() -> None:
    pairs = [("n1", 7), ("n2", 0), ("n3", 10)]
    assert wire.host_priorities(pairs) == wire.host_priority_list([wire.HostPriority(h, s) for h, s in pairs])
    assert wire.host_priorities([]) == []


@pytest.mark.parametrize("score", [-1, 11, 7.0, True, "7"])
def test_host_priorities_refuse_what_host_priority_refuses_naming_the_node(score: Any) -> None:
    with pytest.raises(ValueError, match="score of n2"):
        wire.host_priorities([("n1", 3), ("n2", score), ("n3", 4)])


def test_many_distinct_long_reasons_are_each_cut_and_short_ones_kept() -> None:
    args = wire.parse_extender_args(FILTER_NAMES)
    failed = {"n1": "a" * 600, "n2": "short"}
    body = wire.filter_result(args, [], failed=failed, failed_unresolvable={"n3": "b" * 600}).to_json()
    assert body["FailedNodes"] == {"n1": "a" * (wire.MAX_REASON_CHARS - 1) + "…", "n2": "short"}
    assert body["FailedAndUnresolvableNodes"] == {"n3": "b" * (wire.MAX_REASON_CHARS - 1) + "…"}


def test_depth_is_checked_below_a_list_that_mixes_scalars_and_containers() -> None:
    nested = "[" * 70 + "]" * 70
    body = ('{"Pod":' + POD + ',"NodeNames":["n1"],"x":["a",1,null,' + nested + ']}').encode()
    with pytest.raises(WireError, match="nested too deeply"):
        wire.parse_extender_args(body)
    flat = ('{"Pod":' + POD + ',"NodeNames":["n1","n2"],"x":{"a":1,"b":[true,2.5,null]}}').encode()
    assert wire.parse_extender_args(flat).candidates == ("n1", "n2")


def test_parse_host_priority_list_insists_on_integers() -> None:
    with pytest.raises(WireError, match=r"\[0\]\.Score"):
        wire.parse_host_priority_list([{"Host": "n1", "Score": 7.5}])


def test_binding_result() -> None:
    assert roundtrip(wire.BindingResult().to_json()) == {"Error": ""}
    body = roundtrip(wire.BindingResult("pod ml/p was deleted").to_json())
    assert body == {"Error": "pod ml/p was deleted"}
    assert wire.parse_binding_result(body) == wire.BindingResult("pod ml/p was deleted")


def test_preemption_result_is_always_meta_victims() -> None:
    args = wire.parse_preemption_args(PREEMPT_FULL)
    result = wire.PreemptionResult({"n1": args.victims["n1"]})
    body = roundtrip(result.to_json())
    assert body == {"NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": "a1"}], "NumPDBViolations": 0}}}
    assert wire.parse_preemption_result(body).victims == {"n1": wire.Victims(("a1",), 0)}
    assert roundtrip(wire.PreemptionResult().to_json()) == {"NodeNameToMetaVictims": {}}


def test_non_ascii_reasons_are_utf8() -> None:
    args = wire.parse_extender_args(FILTER_NAMES)
    raw = wire.encode(wire.filter_result(args, [], failed={"n1": "GPU über 90 %"}).to_json())
    assert "über".encode() in raw


# ------------------------------------------------------------------------------------- hostile input


def _pod_with(meta: str) -> str:
    return '{"metadata":' + meta + ',"spec":{"containers":[]}}'


MALFORMED_FILTER: list[tuple[bytes, str]] = [
    (b"[]", "must be a JSON object"),
    (b'"Pod"', "must be a JSON object"),
    (b"null", "must be a JSON object"),
    (b"42", "must be a JSON object"),
    (b"", "empty"),
    (b"   ", "empty"),
    (b'{"NodeNames":["n1"]}', "Pod: missing"),
    (b'{"pod":{},"nodeNames":["n1"]}', "PascalCase; found 'pod'"),
    (b'{"Pod":[],"NodeNames":["n1"]}', "Pod: expected a v1.Pod object, got an array"),
    (b'{"Pod":null,"NodeNames":["n1"]}', "Pod: expected a v1.Pod object, got null"),
    (b'{"Pod":{"spec":{}},"NodeNames":["n1"]}', "Pod.metadata: missing"),
    (('{"Pod":' + _pod_with('{"name":"p"}') + ',"NodeNames":["n1"]}').encode(), "Pod.metadata.uid: missing"),
    (('{"Pod":' + _pod_with('{"name":7,"uid":"u"}') + ',"NodeNames":["n1"]}').encode(),
     "Pod.metadata.name: expected a string, got a number"),
    (('{"Pod":' + _pod_with('{"name":"","uid":"u"}') + ',"NodeNames":["n1"]}').encode(),
     "Pod.metadata.name: must not be empty"),
    (('{"Pod":' + _pod_with('{"name":"p","uid":"u","namespace":1}') + ',"NodeNames":[]}').encode(),
     "Pod.metadata.namespace"),
    ((b'{"Pod":{"metadata":{"name":"p","uid":"u"},"spec":"x"},"NodeNames":[]}'), "Pod.spec"),
    (('{"Pod":' + POD + '}').encode(), "neither Nodes nor NodeNames"),
    (('{"Pod":' + POD + ',"Nodes":null,"NodeNames":null}').encode(), "neither Nodes nor NodeNames"),
    (('{"Pod":' + POD + ',"nodeNames":["n1"]}').encode(), "PascalCase; found 'nodeNames'"),
    (('{"Pod":' + POD + ',"Nodes":{"items":[]},"NodeNames":[]}').encode(), "both Nodes and NodeNames"),
    (('{"Pod":' + POD + ',"NodeNames":"n1"}').encode(), "NodeNames: expected an array, got a string"),
    (('{"Pod":' + POD + ',"NodeNames":["n1",2]}').encode(), "NodeNames[1]: expected a string"),
    (('{"Pod":' + POD + ',"NodeNames":[""]}').encode(), "NodeNames[0]: must not be empty"),
    (('{"Pod":' + POD + ',"NodeNames":["' + "n" * 300 + '"]}').encode(), "over the limit of 253"),
    (('{"Pod":' + POD + ',"Nodes":["n1"]}').encode(), "Nodes: expected a v1.NodeList object"),
    (('{"Pod":' + POD + ',"Nodes":{"items":{}}}').encode(), "Nodes.items: expected an array"),
    (('{"Pod":' + POD + ',"Nodes":{"items":[{"metadata":{}}]}}').encode(), "Nodes.items[0].metadata.name"),
    (b'{"Pod":\xff}', "not UTF-8"),
    (b'\xef\xbb\xbf{"Pod":{}}', "not valid JSON"),  # a BOM: Go's encoder never writes one
    (('{"Pod":' + POD + ',"NodeNames":["n1"]').encode(), "not valid JSON"),
    (b'{"Pod":{"metadata":{"name":"p","uid":"u","x":NaN}},"NodeNames":[]}', "not valid JSON"),
    (b'{"Pod":{"metadata":{"name":"p","uid":"u","x":' + b"9" * 5000 + b"}},\"NodeNames\":[]}", "not valid JSON"),
]


@pytest.mark.parametrize(("body", "expected"), MALFORMED_FILTER)
def test_malformed_filter_requests_raise_wire_error(body: bytes, expected: str) -> None:
    with pytest.raises(WireError) as err:
        wire.parse_extender_args(body)
    assert expected in str(err.value)
    assert isinstance(err.value, GpuSliceError)


def test_wire_error_names_the_field() -> None:
    with pytest.raises(WireError) as err:
        wire.parse_extender_args(('{"Pod":' + POD + ',"NodeNames":["n1",2]}').encode())
    assert err.value.field == "NodeNames[1]"
    assert err.value.reason == "expected a string, got a number"


def test_body_over_the_size_limit_is_refused_before_parsing() -> None:
    with pytest.raises(WireError, match="over the limit of 1024 bytes"):
        wire.parse_extender_args(b"{" + b" " * 2000 + b"}", max_bytes=1024)


def test_deep_json_is_refused() -> None:
    deep = ('{"Pod":' + POD[:-1] + ',"x":' + "[" * 100 + "]" * 100 + '},"NodeNames":[]}').encode()
    with pytest.raises(WireError, match="nested too deeply"):
        wire.parse_extender_args(deep)
    very_deep = b'{"Pod":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    with pytest.raises(WireError, match="nested too deeply"):
        wire.parse_extender_args(very_deep)
    assert wire.parse_extender_args(deep, max_depth=200).candidates == ()


MALFORMED_BIND: list[tuple[bytes, str]] = [
    (b"[]", "must be a JSON object"),
    (b'{"PodName":"p","PodNamespace":"ns","PodUID":"u"}', "Node: missing"),
    (b'{"PodName":"p","PodNamespace":"ns","PodUID":7,"Node":"n1"}', "PodUID: expected a string"),
    (b'{"PodName":"","PodNamespace":"ns","PodUID":"u","Node":"n1"}', "PodName: must not be empty"),
    (b'{"podName":"p","PodNamespace":"ns","PodUID":"u","Node":"n1"}', "PascalCase; found 'podName'"),
]


@pytest.mark.parametrize(("body", "expected"), MALFORMED_BIND)
def test_malformed_bind_requests_raise_wire_error(body: bytes, expected: str) -> None:
    with pytest.raises(WireError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        wire.parse_binding_args(body)


def _preempt(victims: str, key: str = "NodeNameToMetaVictims") -> bytes:
    return ('{"Pod":' + POD + ',"' + key + '":' + victims + '}').encode()


MALFORMED_PREEMPT: list[tuple[bytes, str]] = [
    (b'{"NodeNameToMetaVictims":{}}', "Pod: missing"),
    (_preempt("[]"), "NodeNameToMetaVictims: expected a JSON object"),
    (_preempt('{"n1":[]}'), "NodeNameToMetaVictims.n1: expected a MetaVictims object"),
    (_preempt('{"n1":{"Pods":[{"uid":"a"}]}}'), "NodeNameToMetaVictims.n1.Pods[0].UID: missing"),
    (_preempt('{"n1":{"Pods":[{"UID":1}]}}'), "NodeNameToMetaVictims.n1.Pods[0].UID: expected a string"),
    (_preempt('{"n1":{"Pods":[],"NumPDBViolations":-1}}'), "NumPDBViolations: integer out of range"),
    (_preempt('{"n1":{"Pods":[],"NumPDBViolations":1.5}}'), "NumPDBViolations: expected an integer"),
    (_preempt('{"n1":{"Pods":[],"NumPDBViolations":true}}'), "NumPDBViolations: expected an integer"),
    (_preempt('{"n1":{"Pods":[],"NumPDBViolations":' + str(2**63) + '}}'), "integer out of range"),
    (_preempt('{"n1":{"Pods":[{"metadata":{"name":"v"}}]}}', "NodeNameToVictims"),
     "NodeNameToVictims.n1.Pods[0].metadata.uid: missing"),
    (('{"Pod":' + POD + ',"NodeNameToVictims":{"n1":{"Pods":[]}},"NodeNameToMetaVictims":{"n2":{"Pods":[]}}}')
     .encode(), "both NodeNameToVictims and NodeNameToMetaVictims"),
]


@pytest.mark.parametrize(("body", "expected"), MALFORMED_PREEMPT)
def test_malformed_preempt_requests_raise_wire_error(body: bytes, expected: str) -> None:
    with pytest.raises(WireError) as err:
        wire.parse_preemption_args(body)
    assert expected in str(err.value)


def test_malformed_results_raise_wire_error() -> None:
    with pytest.raises(WireError, match="HostPriorityList: expected an array"):
        wire.parse_host_priority_list({"Host": "n1"})
    with pytest.raises(WireError, match=r"FailedNodes\.n1: expected a string"):
        wire.parse_filter_result({"NodeNames": [], "FailedNodes": {"n1": 3}})
    with pytest.raises(WireError, match="Error: expected a string"):
        wire.parse_binding_result({"Error": 1})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=30,
)
request_like = st.fixed_dictionaries(
    {}, optional={"Pod": json_values, "Nodes": json_values, "NodeNames": json_values, "PodName": json_values,
                  "PodNamespace": json_values, "PodUID": json_values, "Node": json_values,
                  "NodeNameToVictims": json_values, "NodeNameToMetaVictims": json_values})


@settings(max_examples=120, deadline=None)
@given(st.one_of(json_values, request_like))
def test_any_json_either_parses_or_raises_wire_error(value: Any) -> None:
    body = json.dumps(value).encode()
    for parse in (wire.parse_extender_args, wire.parse_binding_args, wire.parse_preemption_args):
        with contextlib.suppress(WireError):
            parse(body)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_either_parse_or_raise_wire_error(body: bytes) -> None:
    with contextlib.suppress(WireError):
        wire.parse_extender_args(body)
