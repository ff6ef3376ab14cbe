"""Wire facts of the kubelet APIs, checked against hand-written expectations.

The expected tables and byte fixtures below are written by hand from kubelet's
api.proto files and the protobuf wire format (reference/protocols.md 1.1, 1.2, 1.7),
not produced by our generator or serializer: a typo in protos/ or a generator
change that alters the wire shows up here.
"""

from __future__ import annotations

from typing import Any, cast

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor

from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2 as dp
from deviceplugin._proto.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from deviceplugin._proto.podresources.v1 import api_pb2 as pr
from deviceplugin._proto.podresources.v1 import api_pb2_grpc as pr_grpc

S, B, I32, I64, U64, MSG = "string", "bool", "int32", "int64", "uint64", "message"
_TYPE_NAMES = {
    FieldDescriptor.TYPE_STRING: S,
    FieldDescriptor.TYPE_BOOL: B,
    FieldDescriptor.TYPE_INT32: I32,
    FieldDescriptor.TYPE_INT64: I64,
    FieldDescriptor.TYPE_UINT64: U64,
    FieldDescriptor.TYPE_MESSAGE: MSG,
}
MAP = "map<string,string>"

# message -> [(field, number, type, repeated, message type or None)], in proto order.
Field = tuple[str, int, str, bool, str | None]

DEVICEPLUGIN_MESSAGES: dict[str, list[Field]] = {
    "DevicePluginOptions": [
        ("pre_start_required", 1, B, False, None),
        ("get_preferred_allocation_available", 2, B, False, None),
    ],
    "RegisterRequest": [
        ("version", 1, S, False, None),
        ("endpoint", 2, S, False, None),
        ("resource_name", 3, S, False, None),
        ("options", 4, MSG, False, "v1beta1.DevicePluginOptions"),
    ],
    "Empty": [],
    "ListAndWatchResponse": [("devices", 1, MSG, True, "v1beta1.Device")],
    "TopologyInfo": [("nodes", 1, MSG, True, "v1beta1.NUMANode")],
    "NUMANode": [("ID", 1, I64, False, None)],
    "Device": [
        ("ID", 1, S, False, None),
        ("health", 2, S, False, None),
        ("topology", 3, MSG, False, "v1beta1.TopologyInfo"),
    ],
    "PreStartContainerRequest": [("devices_ids", 1, S, True, None)],
    "PreStartContainerResponse": [],
    "PreferredAllocationRequest": [("container_requests", 1, MSG, True, "v1beta1.ContainerPreferredAllocationRequest")],
    "ContainerPreferredAllocationRequest": [
        ("available_deviceIDs", 1, S, True, None),
        ("must_include_deviceIDs", 2, S, True, None),
        ("allocation_size", 3, I32, False, None),
    ],
    "PreferredAllocationResponse": [
        ("container_responses", 1, MSG, True, "v1beta1.ContainerPreferredAllocationResponse")
    ],
    "ContainerPreferredAllocationResponse": [("deviceIDs", 1, S, True, None)],
    "AllocateRequest": [("container_requests", 1, MSG, True, "v1beta1.ContainerAllocateRequest")],
    "ContainerAllocateRequest": [("devices_ids", 1, S, True, None)],
    "CDIDevice": [("name", 1, S, False, None)],
    "AllocateResponse": [("container_responses", 1, MSG, True, "v1beta1.ContainerAllocateResponse")],
    "ContainerAllocateResponse": [
        ("envs", 1, MAP, True, None),
        ("mounts", 2, MSG, True, "v1beta1.Mount"),
        ("devices", 3, MSG, True, "v1beta1.DeviceSpec"),
        ("annotations", 4, MAP, True, None),
        ("cdi_devices", 5, MSG, True, "v1beta1.CDIDevice"),
    ],
    "Mount": [
        ("container_path", 1, S, False, None),
        ("host_path", 2, S, False, None),
        ("read_only", 3, B, False, None),
    ],
    "DeviceSpec": [
        ("container_path", 1, S, False, None),
        ("host_path", 2, S, False, None),
        ("permissions", 3, S, False, None),
    ],
}

PODRESOURCES_MESSAGES: dict[str, list[Field]] = {
    "AllocatableResourcesRequest": [],
    "AllocatableResourcesResponse": [
        ("devices", 1, MSG, True, "v1.ContainerDevices"),
        ("cpu_ids", 2, I64, True, None),
        ("memory", 3, MSG, True, "v1.ContainerMemory"),
    ],
    "ListPodResourcesRequest": [],
    "ListPodResourcesResponse": [("pod_resources", 1, MSG, True, "v1.PodResources")],
    "PodResources": [
        ("name", 1, S, False, None),
        ("namespace", 2, S, False, None),
        ("containers", 3, MSG, True, "v1.ContainerResources"),
    ],
    "ContainerResources": [
        ("name", 1, S, False, None),
        ("devices", 2, MSG, True, "v1.ContainerDevices"),
        ("cpu_ids", 3, I64, True, None),
        ("memory", 4, MSG, True, "v1.ContainerMemory"),
        ("dynamic_resources", 5, MSG, True, "v1.DynamicResource"),
    ],
    "ContainerMemory": [
        ("memory_type", 1, S, False, None),
        ("size", 2, U64, False, None),
        ("topology", 3, MSG, False, "v1.TopologyInfo"),
    ],
    "ContainerDevices": [
        ("resource_name", 1, S, False, None),
        ("device_ids", 2, S, True, None),
        ("topology", 3, MSG, False, "v1.TopologyInfo"),
    ],
    "TopologyInfo": [("nodes", 1, MSG, True, "v1.NUMANode")],
    "NUMANode": [("ID", 1, I64, False, None)],
    "DynamicResource": [
        ("claim_name", 2, S, False, None),
        ("claim_namespace", 3, S, False, None),
        ("claim_resources", 4, MSG, True, "v1.ClaimResource"),
    ],
    "ClaimResource": [
        ("cdi_devices", 1, MSG, True, "v1.CDIDevice"),
        ("driver_name", 2, S, False, None),
        ("pool_name", 3, S, False, None),
        ("device_name", 4, S, False, None),
    ],
    "CDIDevice": [("name", 1, S, False, None)],
    "GetPodResourcesRequest": [("pod_name", 1, S, False, None), ("pod_namespace", 2, S, False, None)],
    "GetPodResourcesResponse": [("pod_resources", 1, MSG, False, "v1.PodResources")],
}

# (gRPC path, request, response, server-streaming)
DEVICEPLUGIN_METHODS = [
    ("/v1beta1.Registration/Register", "v1beta1.RegisterRequest", "v1beta1.Empty", False),
    (
        "/v1beta1.DevicePlugin/GetDevicePluginOptions",
        "v1beta1.Empty",
        "v1beta1.DevicePluginOptions",
        False,
    ),
    ("/v1beta1.DevicePlugin/ListAndWatch", "v1beta1.Empty", "v1beta1.ListAndWatchResponse", True),
    (
        "/v1beta1.DevicePlugin/GetPreferredAllocation",
        "v1beta1.PreferredAllocationRequest",
        "v1beta1.PreferredAllocationResponse",
        False,
    ),
    ("/v1beta1.DevicePlugin/Allocate", "v1beta1.AllocateRequest", "v1beta1.AllocateResponse", False),
    (
        "/v1beta1.DevicePlugin/PreStartContainer",
        "v1beta1.PreStartContainerRequest",
        "v1beta1.PreStartContainerResponse",
        False,
    ),
]
PODRESOURCES_METHODS = [
    ("/v1.PodResourcesLister/List", "v1.ListPodResourcesRequest", "v1.ListPodResourcesResponse", False),
    (
        "/v1.PodResourcesLister/GetAllocatableResources",
        "v1.AllocatableResourcesRequest",
        "v1.AllocatableResourcesResponse",
        False,
    ),
    ("/v1.PodResourcesLister/Get", "v1.GetPodResourcesRequest", "v1.GetPodResourcesResponse", False),
]


def _describe(desc: Descriptor) -> list[Field]:
    out: list[Field] = []
    for f in desc.fields:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            assert (key.type, value.type) == (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_STRING)
            out.append((f.name, f.number, MAP, f.is_repeated, None))
            continue
        type_name = _TYPE_NAMES.get(f.type, f"type#{f.type}")
        msg = f.message_type.full_name if f.message_type is not None else None
        out.append((f.name, f.number, type_name, f.is_repeated, msg))
    return out


@pytest.mark.parametrize(
    ("file", "package", "messages"),
    [(dp.DESCRIPTOR, "v1beta1", DEVICEPLUGIN_MESSAGES), (pr.DESCRIPTOR, "v1", PODRESOURCES_MESSAGES)],
    ids=["deviceplugin", "podresources"],
)
def test_messages_fields_numbers_types(file: FileDescriptor, package: str, messages: dict[str, list[Field]]) -> None:
    assert file.package == package
    assert list(file.dependencies) == [], "no imports (no gogo)"
    assert set(file.message_types_by_name) == set(messages)
    for name, fields in messages.items():
        assert _describe(file.message_types_by_name[name]) == fields, name


def test_removed_dynamic_resource_tag_stays_free() -> None:
    """Tag 1 of DynamicResource (class_name) was removed upstream; reusing it would misparse old peers."""
    assert 1 not in pr.DynamicResource.DESCRIPTOR.fields_by_number


@pytest.mark.parametrize(
    ("file", "methods"),
    [(dp.DESCRIPTOR, DEVICEPLUGIN_METHODS), (pr.DESCRIPTOR, PODRESOURCES_METHODS)],
    ids=["deviceplugin", "podresources"],
)
def test_service_descriptors(file: FileDescriptor, methods: list[tuple[str, str, str, bool]]) -> None:
    got = []
    for service in file.services_by_name.values():
        for m in service.methods:
            got.append(
                (
                    f"/{service.full_name}/{m.name}",
                    m.input_type.full_name,
                    m.output_type.full_name,
                    m.server_streaming,
                )
            )
            assert not m.client_streaming
    assert sorted(got) == sorted(methods)


class _RecordingChannel:
    """Stands in for grpc.Channel to see which paths and call kinds the generated stubs use."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def _record(self, kind: str) -> Any:
        def make(path: str, *args: Any, **kwargs: Any) -> str:
            self.calls.append((kind, path))
            return path

        return make

    def __getattr__(self, kind: str) -> Any:
        if kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            return self._record(kind)
        raise AttributeError(kind)


def test_generated_stubs_use_the_kubelet_paths() -> None:
    ch = _RecordingChannel()
    channel = cast(grpc.Channel, ch)
    dp_grpc.RegistrationStub(channel)
    dp_grpc.DevicePluginStub(channel)
    pr_grpc.PodResourcesListerStub(channel)
    expected = [
        ("unary_stream" if streaming else "unary_unary", path)
        for path, _, _, streaming in DEVICEPLUGIN_METHODS + PODRESOURCES_METHODS
    ]
    assert sorted(ch.calls) == sorted(expected)


def test_generated_servicers_register_the_kubelet_paths() -> None:
    """The add_*_to_server helpers must register handlers under the same paths kubelet dials."""
    registered: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    class _Server:
        def add_generic_rpc_handlers(self, handlers: Any) -> None:
            """The generated code also adds a generic handler; the registered ones carry the same paths."""

        def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
            for name, handler in handlers.items():
                registered[f"/{service}/{name}"] = handler

    server = cast(grpc.Server, _Server())
    dp_grpc.add_RegistrationServicer_to_server(dp_grpc.RegistrationServicer(), server)
    dp_grpc.add_DevicePluginServicer_to_server(dp_grpc.DevicePluginServicer(), server)
    pr_grpc.add_PodResourcesListerServicer_to_server(pr_grpc.PodResourcesListerServicer(), server)
    for path, _, _, streaming in DEVICEPLUGIN_METHODS + PODRESOURCES_METHODS:
        assert path in registered, path
        assert registered[path].response_streaming is streaming, path
        assert registered[path].request_streaming is False, path
    assert len(registered) == len(DEVICEPLUGIN_METHODS) + len(PODRESOURCES_METHODS)


def _hex(s: str) -> bytes:
    """Hex with spaces and '|' separators (for readability) to bytes."""
    return bytes.fromhex(s.replace("|", " "))


# Each fixture: hand-written bytes (tag = field_number << 3 | wire_type; 0 varint, 2 length-delimited).
REGISTER_REQUEST = _hex(
    "0a 07 76 31 62 65 74 61 31"  # 1: version "v1beta1"
    "| 12 08 67 70 75 2e 73 6f 63 6b"  # 2: endpoint "gpu.sock"
    "| 1a 15 65 78 61 6d 70 6c 65 2e 63 6f 6d 2f 67 70 75 2d 73 6c 69 63 65"  # 3: "example.com/gpu-slice"
    "| 22 02 10 01"  # 4: options { 2: get_preferred_allocation_available true }
)

ALLOCATE_REQUEST = _hex(
    "0a 14"  # 1: container_requests, 20 bytes
    "| 0a 08 47 50 55 2d 61 3a 3a 30"  # 1: devices_ids "GPU-a::0"
    "| 0a 08 47 50 55 2d 61 3a 3a 31"  # 1: devices_ids "GPU-a::1"
)

ALLOCATE_RESPONSE = _hex(
    "0a 11"  # 1: container_responses, 17 bytes
    "| 0a 06 0a 01 4b 12 01 56"  # 1: envs entry { key "K", value "V" }
    "| 2a 07 0a 05 78 2f 79 3d 7a"  # 5: cdi_devices { name "x/y=z" }
)

PREFERRED_ALLOCATION_REQUEST = _hex(
    "0a 0b"  # 1: container_requests, 11 bytes
    "| 0a 01 61 | 0a 01 62"  # 1: available_deviceIDs "a", "b"
    "| 12 01 61"  # 2: must_include_deviceIDs "a"
    "| 18 02"  # 3: allocation_size 2 (varint)
)

LIST_AND_WATCH_RESPONSE = _hex(
    "0a 13"  # 1: devices, 19 bytes
    "| 0a 02 73 30"  # 1: ID "s0"
    "| 12 07 48 65 61 6c 74 68 79"  # 2: health "Healthy"
    "| 1a 04 0a 02 08 01"  # 3: topology { nodes { ID 1 } }
)

NUMA_NODE_MINUS_ONE = _hex("08 ff ff ff ff ff ff ff ff ff 01")  # int64 -1: ten-byte varint, not zigzag

LIST_POD_RESOURCES_RESPONSE = _hex(
    "0a 29"  # 1: pod_resources, 41 bytes
    "| 0a 01 70"  # 1: name "p"
    "| 12 02 6e 73"  # 2: namespace "ns"
    "| 1a 20"  # 3: containers, 32 bytes
    "|   0a 01 63"  # 1: name "c"
    "|   12 1b"  # 2: devices, 27 bytes
    "|     0a 15 65 78 61 6d 70 6c 65 2e 63 6f 6d 2f 67 70 75 2d 73 6c 69 63 65"  # 1: resource_name
    "|     12 02 73 30"  # 2: device_ids "s0"
)

GET_POD_RESOURCES_REQUEST = _hex("0a 01 70 | 12 02 6e 73")  # pod_name "p", pod_namespace "ns"


def test_register_request_bytes() -> None:
    msg = dp.RegisterRequest.FromString(REGISTER_REQUEST)
    assert msg.version == "v1beta1"
    assert msg.endpoint == "gpu.sock"
    assert msg.resource_name == "example.com/gpu-slice"
    assert msg.HasField("options")
    assert msg.options.get_preferred_allocation_available is True
    assert msg.options.pre_start_required is False
    assert msg.SerializeToString() == REGISTER_REQUEST


def test_allocate_request_bytes() -> None:
    msg = dp.AllocateRequest.FromString(ALLOCATE_REQUEST)
    assert [list(r.devices_ids) for r in msg.container_requests] == [["GPU-a::0", "GPU-a::1"]]
    assert msg.SerializeToString() == ALLOCATE_REQUEST


def test_allocate_response_bytes() -> None:
    msg = dp.AllocateResponse.FromString(ALLOCATE_RESPONSE)
    (resp,) = msg.container_responses
    assert dict(resp.envs) == {"K": "V"}
    assert [c.name for c in resp.cdi_devices] == ["x/y=z"]
    assert len(resp.mounts) == len(resp.devices) == len(resp.annotations) == 0
    assert msg.SerializeToString() == ALLOCATE_RESPONSE


def test_preferred_allocation_request_bytes() -> None:
    msg = dp.PreferredAllocationRequest.FromString(PREFERRED_ALLOCATION_REQUEST)
    (req,) = msg.container_requests
    assert list(req.available_deviceIDs) == ["a", "b"]
    assert list(req.must_include_deviceIDs) == ["a"]
    assert req.allocation_size == 2
    assert msg.SerializeToString() == PREFERRED_ALLOCATION_REQUEST


def test_list_and_watch_response_bytes() -> None:
    msg = dp.ListAndWatchResponse.FromString(LIST_AND_WATCH_RESPONSE)
    (dev,) = msg.devices
    assert (dev.ID, dev.health) == ("s0", "Healthy")
    assert [n.ID for n in dev.topology.nodes] == [1]
    assert msg.SerializeToString() == LIST_AND_WATCH_RESPONSE
    assert dp.NUMANode.FromString(NUMA_NODE_MINUS_ONE).ID == -1
    assert dp.NUMANode(ID=-1).SerializeToString() == NUMA_NODE_MINUS_ONE


def test_pod_resources_bytes() -> None:
    msg = pr.ListPodResourcesResponse.FromString(LIST_POD_RESOURCES_RESPONSE)
    (pod,) = msg.pod_resources
    assert (pod.name, pod.namespace) == ("p", "ns")
    (container,) = pod.containers
    assert container.name == "c"
    assert [(d.resource_name, list(d.device_ids)) for d in container.devices] == [("example.com/gpu-slice", ["s0"])]
    assert msg.SerializeToString() == LIST_POD_RESOURCES_RESPONSE
    req = pr.GetPodResourcesRequest.FromString(GET_POD_RESOURCES_REQUEST)
    assert (req.pod_name, req.pod_namespace) == ("p", "ns")


def test_unknown_fields_from_newer_kubelets_are_tolerated() -> None:
    """A newer kubelet may add fields (e.g. ContainerResources.isolation = 6); old code must still parse."""
    extra = _hex("0a 01 63 | 32 03 61 62 63")  # name "c", then unknown field 6 (length-delimited) "abc"
    msg = pr.ContainerResources.FromString(extra)
    assert msg.name == "c"


def test_checked_in_code_matches_the_protos() -> None:
    """The same check CI runs (scripts/gen_protos.py --check), so a stale checkout fails locally too."""
    pytest.importorskip("grpc_tools")
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "gen_protos.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
